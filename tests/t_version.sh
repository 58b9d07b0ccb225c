#!/bin/sh
# SPDX-License-Identifier: MIT
# t_version.sh: --version of every installed program. Each prints "NAME (libfsdp) VERSION" with
# the package's version; the C programs add fsdp_build_info()'s line: the same version, the git
# revision exactly when the sources are a git checkout, and the backends and devices that
# config.h says were compiled in.
top_builddir=${top_builddir:-.}
srcdir=${srcdir:-.}
cfg="$top_builddir/config.h"
version=$(sed -n 's/^#define PACKAGE_VERSION "\(.*\)"/\1/p' "$cfg")
have() { grep -q "^#define FSDP_HAVE_$1 1" "$cfg"; }
echo "1..7"
i=0
for p in fsdp-train fsdprun fsdp-ckpt fsdp-sim fsdp-tokenize; do
  i=$((i + 1))
  out=$("$top_builddir/tools/$p" --version 2>&1)
  rc=$?
  first=$(printf '%s\n' "$out" | sed -n 1p)
  info=$(printf '%s\n' "$out" | sed -n 2p)
  why=
  [ $rc -eq 0 ] || why="$why exit $rc;"
  [ "$first" = "$p (libfsdp) $version" ] || why="$why first line '$first';"
  case $info in "libfsdp $version"*"; backends: sim"*"; devices: cpu"*) ;; *) why="$why info '$info';" ;; esac
  for b in GLOO:gloo NCCL:nccl CUDA:cuda; do
    m=${b%%:*} w=${b#*:}
    if have "$m"; then
      printf '%s' "$info" | grep -q " $w" || why="$why $w compiled in but not named;"
    else
      printf '%s' "$info" | grep -q " $w" && why="$why $w named but not compiled in;"
    fi
  done
  if [ -e "$srcdir/.git" ] && command -v git >/dev/null 2>&1; then
    printf '%s' "$info" | grep -q "(git [0-9a-f]" || why="$why no git revision from a checkout;"
  else
    printf '%s' "$info" | grep -q "(git " && why="$why a git revision outside a checkout;"
  fi
  if [ -z "$why" ]; then
    echo "ok $i - $p --version: $first; $info"
  else
    echo "not ok $i - $p --version:$why"
  fi
done
out=$("$top_builddir/tools/fsdp-plot" --version 2>&1)
if [ $? -eq 0 ] && [ "$out" = "fsdp-plot (libfsdp) $version" ]; then
  echo "ok 6 - fsdp-plot --version: $out"
else
  echo "not ok 6 - fsdp-plot --version: '$out'"
fi
help=$("$top_builddir/tools/fsdp-train" --help 2>&1)
if printf '%s' "$help" | grep -q -- '--version'; then
  echo "ok 7 - fsdp-train --help lists --version"
else
  echo "not ok 7 - fsdp-train --help does not list --version"
fi
