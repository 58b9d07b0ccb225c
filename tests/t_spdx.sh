#!/bin/sh
# SPDX-License-Identifier: MIT
# t_spdx.sh: the licence is stated everywhere it must be. LICENSE holds the MIT (Expat) text and
# a copyright line; every source file of the tree (C, C++, CUDA, headers and their templates,
# shell and Python scripts, the project's m4, Makefile.am, configure.ac, fsdp.pc.in, the man
# pages) names it with an SPDX tag in its first three lines. The files Autotools and libtool
# generate or install (configure, Makefile.in, build-aux/ but cudalt.sh, m4/ but fsdp_*.m4) are
# theirs and are not looked at. Runs in the source tree or an unpacked tarball (no git needed).
srcdir=${srcdir:-.}
echo "1..3"

lic="$srcdir/LICENSE"
if [ -f "$lic" ] && grep -q '^MIT License$' "$lic" && grep -q '^Copyright (c) [0-9]' "$lic" &&
   grep -q 'Permission is hereby granted, free of charge' "$lic"; then
  echo "ok 1 - LICENSE holds the MIT licence and a copyright line"
else
  echo "not ok 1 - LICENSE is missing or does not hold the MIT licence and a copyright line"
fi

list=$(mktemp)
trap 'rm -f "$list"' EXIT
(cd "$srcdir" && find src sim backends include tools tests bench data docs fuzz \
    \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cc' -o -name '*.in' \
       -o -name '*.sh' -o -name '*.py' -o -name '*.1' -o -name fsdp-plot \) -type f -print;
 ls m4/fsdp_*.m4 build-aux/cudalt.sh Makefile.am configure.ac fsdp.pc.in) 2>/dev/null |
  sort > "$list"
count=$(wc -l < "$list")
missing=
while read -r f; do
  head -3 "$srcdir/$f" | grep -q 'SPDX-License-Identifier: MIT' || missing="$missing $f"
done < "$list"
if [ "$count" -gt 300 ]; then
  echo "ok 2 - $count source files found to check"
else
  echo "not ok 2 - only $count source files found under $srcdir"
fi
if [ -z "$missing" ]; then
  echo "ok 3 - every one names the licence with SPDX-License-Identifier: MIT"
else
  echo "not ok 3 - without the SPDX tag in their first three lines:$missing"
fi
