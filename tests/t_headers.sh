#!/bin/sh
# SPDX-License-Identifier: MIT
# t_headers.sh: every public header compiles on its own, as C11 and as C++ (extern "C" guards),
# with warnings as errors, and none includes a CUDA, NCCL or Gloo header.
srcdir=${srcdir:-.}
top_builddir=${top_builddir:-.}
CC=${CC:-cc}
CXX=${CXX:-c++}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
headers="fsdp.h $(cd "$srcdir/include" && ls fsdp/*.h)"
n=0
for h in $headers; do n=$((n + 3)); done
echo "1..$n"
i=0
for h in $headers; do
  printf '#include <%s>\nint fsdp_header_check_dummy(void);\n' "$h" > "$tmp/c.c"
  cp "$tmp/c.c" "$tmp/c.cc"
  i=$((i + 1))
  if $CC -std=c11 -Wall -Wextra -Werror -I"$srcdir/include" -I"$top_builddir/include" \
       -c "$tmp/c.c" -o "$tmp/c.o" 2>"$tmp/err"; then
    echo "ok $i - $h compiles alone as C11"
  else
    echo "not ok $i - $h compiles alone as C11"; sed 's/^/#   /' "$tmp/err"
  fi
  i=$((i + 1))
  if ! command -v "$CXX" >/dev/null 2>&1; then
    echo "ok $i # SKIP no C++ compiler"
  elif $CXX -Wall -Wextra -Werror -I"$srcdir/include" -I"$top_builddir/include" \
       -c "$tmp/c.cc" -o "$tmp/cc.o" 2>"$tmp/err"; then
    echo "ok $i - $h compiles alone as C++"
  else
    echo "not ok $i - $h compiles alone as C++"; sed 's/^/#   /' "$tmp/err"
  fi
  i=$((i + 1))
  f="$srcdir/include/$h"
  [ -f "$f" ] || f="$top_builddir/include/$h"
  if grep -Eq '#[[:space:]]*include[[:space:]]*[<"](cuda|nccl|gloo|cublas)' "$f"; then
    echo "not ok $i - $h includes a CUDA, NCCL or Gloo header"
  else
    echo "ok $i - $h includes no CUDA, NCCL or Gloo header"
  fi
done
