#!/bin/sh
# t_seed_map.sh: docs/seed-map.md stays true. For every seed whose IDs the map covers (today the
# UOP-* IDs of seed 001):
#   - every ID of that family in ../shared/spec/seed-behaviours.md has exactly one row;
#   - a row naming a test file: the file exists and names the ID;
#   - a row saying "no C analog" or "not built": it gives a reason, and no test file names the
#     ID as covered (a test may mention it only in a comment saying it has no analog, which
#     t_uop.c does with the words "no C analog").
# Without the spec beside the tree (a distribution tarball), the first check is skipped.
srcdir=${srcdir:-.}
map="$srcdir/docs/seed-map.md"
spec="$srcdir/../shared/spec/seed-behaviours.md"
n=0
fails=0
ok() {
  n=$((n + 1))
  if [ "$1" -eq 0 ]; then echo "ok $n - $2"; else echo "not ok $n - $2"; fails=$((fails + 1)); fi
}
echo "1..4"
rows=$(sed -n '/<!-- seed-map:begin -->/,/<!-- seed-map:end -->/p' "$map" | grep '^| [A-Z]*-' )
[ -n "$rows" ]
ok $? "docs/seed-map.md has a table between its markers"

if [ -f "$spec" ]; then
  missing=""
  for id in $(grep -o 'UOP-[A-Z]*-[0-9]*' "$spec" | sort -u); do
    c=$(printf '%s\n' "$rows" | grep -c "^| $id |")
    [ "$c" -eq 1 ] || missing="$missing $id($c)"
  done
  [ -z "$missing" ]
  ok $? "every UOP-* ID of the spec has exactly one row${missing:+ (not so:$missing)}"
else
  n=$((n + 1))
  echo "ok $n # SKIP no ../shared/spec beside the source tree"
fi

bad=""
printf '%s\n' "$rows" | while IFS='|' read -r _ id test why _; do
  id=$(echo "$id" | tr -d ' ')
  test=$(echo "$test" | sed -e 's/^ *//' -e 's/ *$//')
  case $test in
  "no C analog"|"not built") ;;
  *) { [ -f "$srcdir/$test" ] && grep -q "$id" "$srcdir/$test"; } || echo "$id:$test" ;;
  esac
done > seed_map.bad
bad=$(tr '\n' ' ' < seed_map.bad)
[ -z "$bad" ]
ok $? "every row's test file exists and names its ID${bad:+ (not so: $bad)}"

bad=""
printf '%s\n' "$rows" | while IFS='|' read -r _ id test why _; do
  id=$(echo "$id" | tr -d ' ')
  test=$(echo "$test" | sed -e 's/^ *//' -e 's/ *$//')
  case $test in
  "no C analog"|"not built")
    r=$(echo "$why" | tr -d ' ')
    [ -n "$r" ] || echo "$id:no-reason"
    # a claim is a test line naming the ID that does not say it has no analog
    grep -l "$id" "$srcdir"/tests/*.c "$srcdir"/tests/*.sh 2> /dev/null | while read -r f; do
      grep "$id" "$f" | grep -qv "no C analog" && echo "$id:claimed-by-${f##*/}"
    done ;;
  esac
done > seed_map.bad
bad=$(tr '\n' ' ' < seed_map.bad)
rm -f seed_map.bad
[ -z "$bad" ]
ok $? "rows without a test give a reason and no test claims them${bad:+ (not so: $bad)}"
[ "$fails" -eq 0 ]
