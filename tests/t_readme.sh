#!/bin/sh
# SPDX-License-Identifier: MIT
# t_readme.sh: every code block of README.md compiles as printed (fenced blocks, indented ones
# inside list items too).
# - A C block with a main() is a program: compiled as it stands (no include added, implicit
#   declarations are errors) against this build's headers and library, then run.
# - A C block without one is a fragment: compiled inside a function that gives it the names the
#   README's prose gives it (ctx, a context; model, a module) and <stdio.h>.
# - A sh block is checked by sh -n (its commands need machines and files this test has not).
top_builddir=${top_builddir:-.}
srcdir=${srcdir:-.}
CC=${CC:-cc}
readme="$srcdir/README.md"
lib="$top_builddir/.libs/libfsdp.so"
# A sanitizer build's library needs its runtime loaded first, which a program built here
# without the sanitizer flags does not do: such programs are compiled and linked, not run. GCC's
# library depends on the shared runtime (ldd shows it); clang's leaves the runtime's symbols
# undefined, for the program to bring, so programs are linked with FSDP_SANITIZER_LDFLAGS (from
# make check's environment) as well.
run=1
if command -v ldd >/dev/null 2>&1 && [ -f "$lib" ] &&
   ldd "$lib" 2>/dev/null | grep -q 'lib[atu]*san\.so\|libubsan\.so'; then
  run=0
fi
if [ -n "${FSDP_SANITIZER_LDFLAGS:-}" ]; then
  run=0
fi
san_ldflags=${FSDP_SANITIZER_LDFLAGS:-}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Split the blocks into files: c.N and sh.N, numbered in order.
# A block may be indented (inside a list item); its lines lose the fence's indentation.
awk -v dir="$tmp" '
  /^[ ]*```c$/ { n++; f = dir "/c." n; inblk = 1; ind = index($0, "`") - 1; next }
  /^[ ]*```sh$/ { n++; f = dir "/sh." n; inblk = 1; ind = index($0, "`") - 1; next }
  /^[ ]*```/ { if (inblk) { close(f); inblk = 0 } next }
  inblk { print substr($0, ind + 1) > f }' "$readme"
blocks=$(ls "$tmp" | sort -t. -k2 -n)
count=$(printf '%s\n' "$blocks" | grep -c .)
echo "1..$((count + 1))"
if [ "$count" -ge 10 ]; then
  echo "ok 1 - README.md has $count code blocks"
else
  echo "not ok 1 - README.md has only $count code blocks"
fi
i=1
flags="-std=c11 -D_POSIX_C_SOURCE=200809L -I$srcdir/include -I$top_builddir/include -Wall -Werror=implicit-function-declaration"
for b in $blocks; do
  i=$((i + 1))
  f="$tmp/$b"
  line=$(grep -n . "$f" | sed -n 1p | cut -d: -f2- | cut -c1-60)
  case $b in
  sh.*)
    if sh -n "$f" 2>"$tmp/err"; then
      echo "ok $i - sh block $b parses: $line"
    else
      echo "not ok $i - sh block $b: $(head -1 "$tmp/err")"
    fi ;;
  c.*)
    if grep -q 'int main' "$f"; then
      if [ ! -f "$lib" ]; then
        echo "ok $i # SKIP no shared library to link the program $b against"
        continue
      fi
      if [ $run = 0 ]; then
        if $CC $flags $san_ldflags -o "$tmp/prog" -x c "$f" -L"$top_builddir/.libs" -lfsdp 2>"$tmp/err"; then
          echo "ok $i - C program $b compiles as printed (not run: sanitizer build): $line"
        else
          echo "not ok $i - C program $b: $(grep -m1 -i 'error' "$tmp/err")"
        fi
      elif $CC $flags $san_ldflags -o "$tmp/prog" -x c "$f" -L"$top_builddir/.libs" -lfsdp 2>"$tmp/err" &&
         LD_LIBRARY_PATH="$top_builddir/.libs" "$tmp/prog" >"$tmp/out" 2>&1; then
        echo "ok $i - C program $b compiles as printed and runs: $line"
      else
        echo "not ok $i - C program $b: $(grep -m1 -i 'error' "$tmp/err" || tail -1 "$tmp/out")"
      fi
    else
      { echo '#include <stdio.h>'
        echo '#include <fsdp.h>'
        echo 'int readme_fragment(fsdp_ctx_t *ctx, fsdp_module_t *model);'
        echo 'int readme_fragment(fsdp_ctx_t *ctx, fsdp_module_t *model) {'
        echo '    (void)ctx; (void)model;'
        cat "$f"
        echo '    return 0;'
        echo '}'; } > "$tmp/frag.c"
      if $CC $flags -Wno-unused-variable -c -o "$tmp/frag.o" "$tmp/frag.c" 2>"$tmp/err"; then
        echo "ok $i - C fragment $b compiles: $line"
      else
        echo "not ok $i - C fragment $b: $(grep -m1 -i 'error' "$tmp/err")"
      fi
    fi ;;
  esac
done
