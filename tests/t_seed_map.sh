#!/bin/sh
# SPDX-License-Identifier: MIT
# t_seed_map.sh: docs/seeds.md stays true, against the spec and against this make check run.
#
# docs/seeds.md has one row "| ID | test | text |" per behaviour ID of
# ../shared/spec/seed-behaviours.md. The test column names the test that carries the ID, as
# TESTS names it (tests/t_x.tap or tests/t_x.sh), or says why none does:
#   not applicable  no C analog, or one that only a GPU run can check (the text then begins
#                   "GPU run (make check-gpu)");
#   not built       a C analog that no test checks yet; the text says what is missing;
#   pending         a C analog that another worktree is building; the text says what it is.
# Checks:
#   1. the table is there, with no ID in two rows;
#   2. every ID of the spec has a row and every row's ID is in the spec (skipped without the
#      spec beside the source tree, as in a distribution tarball);
#   3. a row naming a test: that test's log, tests/t_x.log in the build tree, exists and holds a
#      passing TAP line carrying the ID: "ok N - ... ID ...", neither "not ok" nor a SKIP or TODO
#      directive (a mapped test runs in every make check, so a skip is never enough);
#   4. a row without a test gives a reason, and no result line of any log carries its ID (a
#      GPU row excepted: its test runs under make check-gpu, whose logs may lie beside ours).
# A line carries an ID when the ID stands as a word in it: "CORE-H01/H03" carries CORE-H01 only.
# Makefile.am makes tests/t_seed_map.log depend on every other test's log, so that this runs
# after them; this script reads the logs and never runs a test.
srcdir=${srcdir:-.}
build=${top_builddir:-.}
doc="$srcdir/docs/seeds.md"
spec="$srcdir/../shared/spec/seed-behaviours.md"
. "$srcdir/tests/tap.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tab=$(printf '\t')

# ok_list FILE DESCRIPTION: one TAP line, passing when FILE (one problem a line) is empty;
# otherwise the first problems go into the description and all of them follow as comments.
TAP_SHOW=1000
ok_list() {
  count=$(wc -l < "$1" | tr -d ' ')
  first=$(head -3 "$1" | paste -s -d ';' - | sed 's/;/; /g')
  [ "$count" -gt 3 ] && first="$first; ..."
  if [ "$count" -eq 0 ]; then ok 0 "$2"; else ok 1 "$2 (not so, $count: $first)" "$1"; fi
}

echo "1..4"

# The rows: "ID<TAB>test<TAB>text", spaces around the cells trimmed.
awk -F'|' '/<!-- seeds:begin -->/ { on = 1; next } /<!-- seeds:end -->/ { on = 0 }
  on && /^\| *(CORE|UOP|WRAP|MP|DYN)-/ {
    for (i = 2; i <= 4; i++) gsub(/^ +| +$/, "", $i)
    print $2 "\t" $3 "\t" $4
  }' "$doc" > "$tmp/rows" 2> /dev/null
cut -f1 "$tmp/rows" | sort > "$tmp/row_ids"
uniq -d "$tmp/row_ids" | sed 's/$/ has two rows or more/' > "$tmp/bad"
[ -s "$tmp/rows" ] || echo "no rows between <!-- seeds:begin --> and <!-- seeds:end -->" >> "$tmp/bad"
ok_list "$tmp/bad" "docs/seeds.md has its table, one row per ID ($(wc -l < "$tmp/rows" | tr -d ' ') rows)"

# The spec's IDs: the first word of each "#### " heading, and any ID after " / " in it.
if [ -f "$spec" ]; then
  awk '/^#### / {
      print $2
      s = $0
      while (match(s, / \/ (CORE|UOP|WRAP|MP|DYN)-[A-Z]+-?[0-9][0-9]/)) {
        print substr(s, RSTART + 3, RLENGTH - 3)
        s = substr(s, RSTART + RLENGTH)
      }
    }' "$spec" | sort -u > "$tmp/spec_ids"
  { comm -23 "$tmp/spec_ids" "$tmp/row_ids" | sed 's/$/ has no row/'
    sort -u "$tmp/row_ids" | comm -13 "$tmp/spec_ids" - | sed 's/$/ is not an ID of the spec/'
  } > "$tmp/bad"
  ok_list "$tmp/bad" "every one of the spec's $(wc -l < "$tmp/spec_ids" | tr -d ' ') IDs has a row, every row an ID of the spec"
else
  n=$((n + 1))
  echo "ok $n # SKIP no ../shared/spec beside the source tree"
fi

# What the logs say: "log<TAB>ID<TAB>pass|fail|skip" for every ID on a TAP result line of every
# other test's log.
for log in "$build"/tests/*.log; do
  [ -f "$log" ] && [ "${log##*/}" != t_seed_map.log ] && echo "$log"
done > "$tmp/logs"
: > "$tmp/results"
if [ -s "$tmp/logs" ]; then
  # One log a word: the build tree's test names have no blanks.
  awk '/^(not )?ok([ \t]|$)/ {
      st = /^not ok/ ? "fail" : toupper($0) ~ /#[ \t]*(SKIP|TODO)/ ? "skip" : "pass"
      s = $0
      while (match(s, /(CORE|UOP|WRAP|MP|DYN)-[A-Z]+-?[0-9][0-9]/)) {
        pre = RSTART > 1 ? substr(s, RSTART - 1, 1) : ""
        post = substr(s, RSTART + RLENGTH, 1)
        if (pre !~ /[A-Za-z0-9-]/ && post !~ /[0-9]/)
          print FILENAME "\t" substr(s, RSTART, RLENGTH) "\t" st
        s = substr(s, RSTART + RLENGTH)
      }
    }' $(cat "$tmp/logs") | sort -u > "$tmp/results"
fi

# 3. Rows that name a test.
: > "$tmp/bad"
while IFS="$tab" read -r id test text; do
  case $test in
  "not applicable" | "not built" | pending) continue ;;
  tests/*.tap | tests/*.sh) ;;
  *)
    echo "$id: '$test' is neither a test (tests/*.tap, tests/*.sh) nor not applicable, not built or pending"
    continue ;;
  esac
  log="$build/${test%.*}.log"
  if [ ! -f "$log" ]; then
    echo "$id: $test has no log ($log): it did not run in this make check"
  elif ! grep -qxF "$log$tab$id${tab}pass" "$tmp/results"; then
    others=$(grep -cF "$log$tab$id$tab" "$tmp/results")
    echo "$id: $test has no passing TAP line carrying the ID$([ "$others" -gt 0 ] && echo ' (only failing or skipped ones)')"
  fi
done < "$tmp/rows" >> "$tmp/bad"
ok_list "$tmp/bad" "every row that names a test has a passing TAP line carrying its ID in that test's log"

# 4. Rows without a test.
: > "$tmp/bad"
while IFS="$tab" read -r id test text; do
  case $test in
  "not applicable" | "not built" | pending) ;;
  *) continue ;;
  esac
  [ -n "$text" ] || echo "$id ($test): no reason given"
  case $text in "GPU run (make check-gpu)"*) continue ;; esac
  grep -F "$tab$id$tab" "$tmp/results" | cut -f1 | sort -u | while read -r log; do
    echo "$id ($test): ${log#"$build"/} carries it; name that test in the row"
  done
done < "$tmp/rows" >> "$tmp/bad"
ok_list "$tmp/bad" "every row without a test gives a reason, and no test's log carries its ID"

for kind in tests "not applicable" "not built" pending; do
  case $kind in
  tests) c=$(cut -f2 "$tmp/rows" | grep -c '^tests/') ;;
  *) c=$(cut -f2 "$tmp/rows" | grep -cx "$kind") ;;
  esac
  printf '# %s: %s\n' "$kind" "$c"
done
[ "$failed" -eq 0 ]
