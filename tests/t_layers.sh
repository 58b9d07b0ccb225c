#!/bin/sh
# SPDX-License-Identifier: MIT
# t_layers.sh: the layering of docs/design.md, enforced. The table between the markers
# "<!-- layers:begin -->" and "<!-- layers:end -->" of the section "Layers" gives each layer a
# number and its paths (a file, or a directory ending in /; the longest matching path wins).
# Every file under src/, sim/, backends/, tools/ and include/ must be in a layer, and may include
# only files of its own layer or of lower ones. An include is resolved as the compiler does:
# "x" beside the including file, then under src/, then at the top; <fsdp/x.h> and <fsdp.h> under
# include/. Includes that resolve to no file of the source tree (system and generated headers)
# are not checked. A failure names the file, the line and both layers. Project includes are
# written one way: a file under src/ by its path from src/, any other by its path from the top.
srcdir=${srcdir:-.}
design="$srcdir/docs/design.md"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [ ! -f "$design" ]; then
  echo "1..0 # SKIP $design not found"
  exit 0
fi

# The table: "number name path" per line.
awk '/<!-- layers:begin -->/ { on = 1; next } /<!-- layers:end -->/ { on = 0 }
     on && /^\| *[0-9]+ *\|/ {
       n = split($0, col, "|"); num = col[2]; name = col[3]; paths = col[4]
       gsub(/ /, "", num); gsub(/^ +| +$/, "", name)
       while (match(paths, /`[^`]+`/)) {
         print num, name, substr(paths, RSTART + 1, RLENGTH - 2)
         paths = substr(paths, RSTART + RLENGTH)
       }
     }' "$design" > "$tmp/table"

# check_files LIST: prints "file:line: what" for every violation among the files of LIST (paths
# relative to $root), and "unplaced file" for a file in no layer. Sets nothing else.
check_files() {
  awk -v root="$root" -v table="$tmp/table" '
    function layer_of(path,    best, bl, p) {
      best = ""; bl = 0
      for (p in lnum)
        if ((path == p || (substr(p, length(p)) == "/" && index(path, p) == 1)) && length(p) > bl) {
          best = p; bl = length(p)
        }
      return best
    }
    function exists(path,    line, r) {
      if (path in seen) return seen[path]
      r = (getline line < (root "/" path)) >= 0
      close(root "/" path)
      if (!r && path ~ /\.h$/) {
        r = (getline line < (root "/" path ".in")) >= 0
        close(root "/" path ".in")
      }
      seen[path] = r
      return r
    }
    function norm(path,    n, i, parts, out, k) {
      n = split(path, parts, "/"); k = 0
      for (i = 1; i <= n; i++) {
        if (parts[i] == "." || parts[i] == "") continue
        if (parts[i] == ".." && k > 0) { k--; continue }
        stack[++k] = parts[i]
      }
      out = ""
      for (i = 1; i <= k; i++) out = out (i > 1 ? "/" : "") stack[i]
      return out
    }
    function resolve(inc, sys, dir,    c) {
      if (sys) {
        if (inc == "fsdp.h" || inc ~ /^fsdp\//) return "include/" inc
        return ""
      }
      c = norm(dir "/" inc); if (exists(c)) return c
      c = norm("src/" inc); if (exists(c)) return c
      c = norm(inc); if (exists(c)) return c
      return ""
    }
    BEGIN {
      while ((getline l < table) > 0) {
        split(l, f, " "); lnum[f[3]] = f[1] + 0; lname[f[3]] = f[2]
      }
    }
    {
      file = $0
      lf = layer_of(file)
      if (lf == "") { print file ": unplaced file (in no layer of the table)"; next }
      dir = file; sub(/\/[^\/]*$/, "", dir)
      ln = 0
      while ((getline line < (root "/" file)) > 0) {
        ln++
        if (line !~ /^[ \t]*#[ \t]*include[ \t]*["<]/) continue
        sys = line ~ /#[ \t]*include[ \t]*</
        inc = line; sub(/^[^"<]*["<]/, "", inc); sub(/[">].*$/, "", inc)
        t = resolve(inc, sys, dir)
        if (t == "") continue
        # One way to write a project include: a file under src/ from src/, any other from the
        # top (never beside the including file, never src/... from the top).
        want = t ~ /^src\// ? substr(t, 5) : t
        if (!sys && inc != want)
            printf "%s:%d: writes \"%s\" for %s; write \"%s\"\n", file, ln, inc, t, want
        lt = layer_of(t)
        if (lt == "") { print file ":" ln ": includes " t ", which is in no layer"; continue }
        edges++
        if (lnum[lt] > lnum[lf])
          printf "%s:%d: includes %s (layer %d, %s) from layer %d (%s)\n", file, ln, t,
                 lnum[lt], lname[lt], lnum[lf], lname[lf]
      }
      close(root "/" file)
    }
    END { print edges + 0 > "/dev/stderr" }' "$1"
}

root=$srcdir
(cd "$srcdir" && find src sim backends tools include -type f \
  \( -name '*.c' -o -name '*.h' -o -name '*.cc' -o -name '*.cu' \) | LC_ALL=C sort) > "$tmp/files"

echo "1..7"
nl=$(cut -d' ' -f1 "$tmp/table" | sort -u | wc -l)
if [ "$nl" -ge 10 ]; then
  echo "ok 1 - docs/design.md has the table of layers ($nl layers, $(wc -l < "$tmp/table") paths)"
else
  echo "not ok 1 - docs/design.md's table of layers has $nl layers (markers or rows missing)"
fi

check_files "$tmp/files" > "$tmp/out" 2> "$tmp/edges"
grep 'unplaced file' "$tmp/out" > "$tmp/unplaced"
grep ': writes "' "$tmp/out" > "$tmp/written"
grep -v 'unplaced file' "$tmp/out" | grep -v ': writes "' > "$tmp/up"
if [ ! -s "$tmp/unplaced" ]; then
  echo "ok 2 - every one of the $(wc -l < "$tmp/files") files under src/ sim/ backends/ tools/ include/ is in a layer"
else
  echo "not ok 2 - $(wc -l < "$tmp/unplaced") files are in no layer"
  sed 's/^/# /' "$tmp/unplaced"
fi
if [ ! -s "$tmp/up" ]; then
  echo "ok 3 - no file includes a higher layer ($(cat "$tmp/edges") includes within the tree checked)"
else
  echo "not ok 3 - $(wc -l < "$tmp/up") includes of a higher layer"
  sed 's/^/# /' "$tmp/up"
fi

if [ ! -s "$tmp/written" ]; then
  echo "ok 4 - every project include is written one way (from src/ for src files, else from the top)"
else
  echo "not ok 4 - $(wc -l < "$tmp/written") includes written another way"
  sed 's/^/# /' "$tmp/written"
fi

# The checker itself: a planted upward include (the core reaching the process group, the
# tensor layer reaching autograd), an include written beside its file and a file outside every
# layer are caught, with file and line.
root=$tmp/plant
mkdir -p "$root/src/core" "$root/src/pg" "$root/src/tensor" "$root/src/autograd" "$root/src/new"
printf '#include <stdio.h>\n#include "pg/pg_impl.h"\n#include "near.h"\n' > "$root/src/core/bad.c"
: > "$root/src/core/near.h"
printf '#include "autograd/autograd_impl.h"\n' > "$root/src/tensor/tensor.c"
: > "$root/src/pg/pg_impl.h"
: > "$root/src/autograd/autograd_impl.h"
: > "$root/src/new/orphan.c"
printf 'src/core/bad.c\nsrc/tensor/tensor.c\nsrc/new/orphan.c\n' > "$tmp/plist"
check_files "$tmp/plist" > "$tmp/pout" 2>/dev/null
if grep -q '^src/core/bad.c:2: includes src/pg/pg_impl.h (layer [0-9]*, pg) from layer 1 (core)$' "$tmp/pout" &&
   grep -q '^src/tensor/tensor.c:1: includes src/autograd/autograd_impl.h (layer [0-9]*, autograd) from layer [0-9]* (tensor)$' "$tmp/pout"; then
  echo "ok 5 - planted upward includes are reported with file, line and both layers"
else
  echo "not ok 5 - planted upward includes were not reported as expected"
fi
sed 's/^/# /' "$tmp/pout"
if grep -q '^src/new/orphan.c: unplaced file' "$tmp/pout"; then
  echo "ok 6 - a file in no layer is reported"
else
  echo "not ok 6 - a file in no layer was not reported"
fi
if grep -q '^src/core/bad.c:3: writes "near.h" for src/core/near.h; write "core/near.h"$' "$tmp/pout"; then
  echo "ok 7 - an include written beside its file is reported with the way to write it"
else
  echo "not ok 7 - an include written beside its file was not reported"
fi
