#!/bin/sh
# SPDX-License-Identifier: MIT
# t_plugin_libs.sh: the CUDA plugin from outside. libfsdp.so needs none of the CUDA libraries and
# the plugin (libfsdp-cuda.so) needs them all; a run of fsdp-train on sim ranks loads none of
# them, and its peak RSS is far below that of the same run with them loaded (the plugin
# preloaded, which is what linking them cost); a plugin that is missing, is not a libfsdp
# plugin, or belongs to another libfsdp version gives fsdp-train's --device cuda check a clear
# message naming the path; an install moved elsewhere (lib/ with the plugin in lib/libfsdp/)
# still finds its own plugin. Skips in a build without CUDA.
top_builddir=${top_builddir:-.}
CC=${CC:-cc}
lib="$top_builddir/.libs/libfsdp.so"
plugin="$top_builddir/.libs/libfsdp-cuda.so"
train="$top_builddir/tools/fsdp-train"
if ! grep -q '^#define FSDP_HAVE_CUDA 1' "$top_builddir/config.h" 2>/dev/null; then
  echo "1..0 # SKIP libfsdp was built without CUDA: there is no plugin"
  exit 0
fi
for t in readelf nm; do
  if ! command -v $t >/dev/null 2>&1; then echo "1..0 # SKIP $t is not installed"; exit 0; fi
done
if [ ! -f "$lib" ] || [ ! -f "$plugin" ]; then
  echo "1..0 # SKIP no shared library or plugin was built ($lib, $plugin)"
  exit 0
fi
cuda_libs="libcudart libcublas libcublasLt"
grep -q '^#define FSDP_HAVE_NCCL 1' "$top_builddir/config.h" && cuda_libs="$cuda_libs libnccl"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "1..9"

needed() { readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
bad=
for l in $cuda_libs; do needed "$lib" | grep -q "^$l\.so" && bad="$bad $l"; done
if [ -z "$bad" ]; then
  echo "ok 1 - libfsdp.so has no NEEDED entry for $cuda_libs"
else
  echo "not ok 1 - libfsdp.so needs$bad"
fi
missing=
for l in $cuda_libs; do needed "$plugin" | grep -q "^$l\.so" || missing="$missing $l"; done
needed "$plugin" | grep -q '^libfsdp\.so' || missing="$missing libfsdp"
if [ -z "$missing" ]; then
  echo "ok 2 - libfsdp-cuda.so needs $cuda_libs and libfsdp"
else
  echo "not ok 2 - libfsdp-cuda.so does not need$missing"
fi
exported=$(nm -D --defined-only "$plugin" | awk '$2 ~ /^[TDBRVWiu]$/ {print $3}')
if [ "$exported" = "fsdp_cuda_plugin_v1" ]; then
  echo "ok 3 - the plugin exports its entry point only"
else
  echo "not ok 3 - the plugin exports:" $exported
fi

# A short run on two sim ranks, with the dynamic loader listing every file it opens.
tiny="--steps 2 --n-layer 1 --n-embd 32 --n-head 2 --world-size 2 --batch-size 4 --seq-len 16 \
  --val-steps 1 --sample-tokens 0 --quiet"
if LD_DEBUG=files LD_DEBUG_OUTPUT="$tmp/ld" "$train" $tiny >"$tmp/out" 2>&1; then
  loaded=$(cat "$tmp"/ld.* 2>/dev/null | sed -n 's/.*file=\([^ ]*\).*/\1/p' | sort -u)
  hits=$(printf '%s\n' "$loaded" | grep -E 'libcudart|libcublas|libnccl|libfsdp-cuda')
  if [ -n "$loaded" ] && [ -z "$hits" ]; then
    echo "ok 4 - fsdp-train on sim ranks loads no CUDA library ($(printf '%s\n' "$loaded" | wc -l) files loaded)"
  else
    echo "not ok 4 - fsdp-train on sim ranks loaded:" $hits "(of $(printf '%s\n' "$loaded" | wc -l) files)"
  fi
else
  echo "not ok 4 - fsdp-train $tiny failed"
  sed 's/^/#   /' "$tmp/out"
fi

# Peak RSS of fsdp-train --help, and of the same with the plugin (and so the CUDA libraries)
# preloaded: the cost every CPU run paid when libfsdp.so linked them.
if [ ! -x /usr/bin/time ]; then
  echo "ok 5 # SKIP /usr/bin/time is not installed"
elif needed "$lib" | grep -qE '^lib(asan|tsan|ubsan)'; then
  echo "ok 5 # SKIP sanitizer build (its runtime must come first; preloading the plugin fails)"
else
  /usr/bin/time -f '%M' -o "$tmp/rss0" "$train" --help >/dev/null 2>&1
  LD_PRELOAD="$(cd "$(dirname "$plugin")" && pwd)/libfsdp-cuda.so" \
    /usr/bin/time -f '%M' -o "$tmp/rss1" "$train" --help >/dev/null 2>&1
  r0=$(tail -n 1 "$tmp/rss0"); r1=$(tail -n 1 "$tmp/rss1")
  echo "# fsdp-train --help peak RSS: $r0 KiB; with the CUDA libraries loaded: $r1 KiB"
  if [ -n "$r0" ] && [ -n "$r1" ] && [ $((r0 * 4)) -lt "$r1" ]; then
    echo "ok 5 - peak RSS $r0 KiB is under a quarter of the $r1 KiB with the CUDA libraries"
  else
    echo "not ok 5 - peak RSS $r0 KiB against $r1 KiB with the CUDA libraries"
  fi
fi

# Plugins that must be refused, found through FSDP_PLUGIN_DIR.
check_refused() { # n dir expected-text description
  out=$(CUDA_VISIBLE_DEVICES= FSDP_PLUGIN_DIR="$2" "$train" --device cuda --backend nccl 2>&1)
  rc=$?
  if [ $rc -ne 0 ] && printf '%s' "$out" | grep -qF "$2/libfsdp-cuda.so" &&
     printf '%s' "$out" | grep -qF "$3"; then
    echo "ok $1 - $4: exit $rc, the message names the path and the reason"
  else
    echo "not ok $1 - $4: exit $rc"
  fi
  printf '%s\n' "$out" | sed 's/^/#   /'
}
mkdir "$tmp/empty" "$tmp/nosym" "$tmp/other"
check_refused 6 "$tmp/empty" "cannot open shared object file" "a directory without the plugin"
printf 'int fsdp_not_a_plugin(void);\nint fsdp_not_a_plugin(void) { return 0; }\n' > "$tmp/nosym.c"
cat > "$tmp/other.c" <<'EOC'
#include <stdint.h>
struct table { uint32_t abi, size; const char *version; void *ops[3]; };
static const struct table t = {1, sizeof t, "0.0.0-other", {0, 0, 0}};
const struct table *fsdp_cuda_plugin_v1(const void *core);
const struct table *fsdp_cuda_plugin_v1(const void *core) { (void)core; return &t; }
EOC
if $CC -shared -fPIC -o "$tmp/nosym/libfsdp-cuda.so" "$tmp/nosym.c" 2>"$tmp/err" &&
   $CC -shared -fPIC -o "$tmp/other/libfsdp-cuda.so" "$tmp/other.c" 2>>"$tmp/err"; then
  check_refused 7 "$tmp/nosym" "not a libfsdp plugin" "a library without the entry point"
  check_refused 8 "$tmp/other" "is a plugin of libfsdp 0.0.0-other" "a plugin of another version"
else
  echo "ok 7 # SKIP $CC cannot build a shared library"
  echo "ok 8 # SKIP $CC cannot build a shared library"
  sed 's/^/#   /' "$tmp/err"
fi

# An install moved elsewhere: lib/libfsdp.so with the plugin in lib/libfsdp/, as make install
# lays them out, found with no FSDP_PLUGIN_DIR (the GPU bundle relies on it). The plugin loads
# and then reports that CUDA sees no device (CUDA_VISIBLE_DEVICES is emptied).
real=
for c in "$top_builddir/tools/.libs/fsdp-train" "$top_builddir/tools/.libs/lt-fsdp-train"; do
  [ -x "$c" ] && real=$c && break
done
if [ -z "$real" ]; then
  echo "ok 9 # SKIP no libtool-built fsdp-train binary under tools/.libs"
else
  mkdir -p "$tmp/moved/bin" "$tmp/moved/lib/libfsdp"
  cp "$real" "$tmp/moved/bin/fsdp-train"
  cp -P "$top_builddir"/.libs/libfsdp.so* "$tmp/moved/lib/"
  cp "$plugin" "$tmp/moved/lib/libfsdp/"
  # A moved, uninstalled program has no default corpus (not installed, not in a build tree).
  corpus=$(cd "${srcdir:-.}/data" && pwd)/corpus.txt
  out=$(cd "$tmp" && env -u FSDP_PLUGIN_DIR CUDA_VISIBLE_DEVICES= \
    LD_LIBRARY_PATH="$tmp/moved/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    LD_DEBUG=files LD_DEBUG_OUTPUT="$tmp/ldm" moved/bin/fsdp-train --device cuda --backend nccl \
    --data "$corpus" 2>&1)
  rc=$?
  opened=$(cat "$tmp"/ldm.* 2>/dev/null | sed -n 's/.*file=\([^ ]*libfsdp-cuda\.so\).*/\1/p' | sort -u)
  if [ $rc -ne 0 ] && printf '%s' "$out" | grep -q 'no CUDA device is visible' &&
     [ "$opened" = "$tmp/moved/lib/libfsdp/libfsdp-cuda.so" ]; then
    echo "ok 9 - a moved install loads its own plugin from lib/libfsdp/ (exit $rc: no device visible)"
  else
    echo "not ok 9 - a moved install: exit $rc, plugin opened: ${opened:-none}"
  fi
  printf '%s\n' "$out" | sed 's/^/#   /'
fi
