#!/bin/sh
# SPDX-License-Identifier: MIT
# t_fsdp_plot.sh: fsdp-plot draws fsdp-train's loss curves.
#   - a short fsdp-train run's metrics give an SVG that is well-formed XML (xmllint when it is
#     installed, otherwise the SVG root element and its end), holds one path per curve (training
#     and validation) and the file's name in its key;
#   - two files give curves of both in one picture;
#   - bad usage, an unreadable file, a file without training records and a name that is not
#     .svg exit 2 with one line on stderr naming the problem, and write nothing.
# Without gnuplot the picture checks are skipped (the error for a missing gnuplot is checked).
top_builddir=${top_builddir:-.}
srcdir=${srcdir:-.}
train="$top_builddir/tools/fsdp-train"
plot="${top_builddir:-.}/tools/fsdp-plot"
tmp=$(mktemp -d) || { echo "Bail out! mktemp -d failed"; exit 1; }
trap 'rm -rf "$tmp"' EXIT
. "$(dirname "$0")/tap.sh"
echo "1..10"

FSDP_NUM_THREADS=1 "$train" --steps 12 --warmup 2 --val-every 4 --val-steps 1 --sample-tokens 0 \
  --quiet --world-size 2 --metrics "$tmp/a.jsonl" > "$tmp/a.out" 2>&1
st1=$?
FSDP_NUM_THREADS=1 "$train" --steps 12 --warmup 2 --val-every 4 --val-steps 1 --sample-tokens 0 \
  --quiet --world-size 2 --lr 3e-3 --metrics "$tmp/b.jsonl" > "$tmp/b.out" 2>&1
st2=$?
[ "$st1" -eq 0 ] && [ "$st2" -eq 0 ]
ok $? "two short fsdp-train runs write their metrics (exit $st1, $st2)" "$tmp/a.out" "$tmp/b.out"

# A picture is well-formed SVG: xmllint when there is one, else the root element and its end.
valid_svg() {
  if command -v xmllint > /dev/null 2>&1; then
    xmllint --noout "$1" 2> "$tmp/xml" || return 1
  fi
  grep -q '<svg' "$1" && tail -c 200 "$1" | grep -q '</svg>'
}

if command -v gnuplot > /dev/null 2>&1; then
  sh "$plot" -o "$tmp/one.svg" "$tmp/a.jsonl" > "$tmp/one.out" 2>&1
  st=$?
  [ "$st" -eq 0 ] && valid_svg "$tmp/one.svg"
  ok $? "one run: exit $st and a well-formed SVG" "$tmp/one.out"
  # gnuplot's SVG draws each curve as a <path> in its own group; the key names the file.
  grep -q 'a.jsonl train' "$tmp/one.svg" && grep -q 'a.jsonl validation' "$tmp/one.svg"
  ok $? "its key names the training and the validation curve of a.jsonl"
  sh "$plot" --title "two runs" --log-y -o "$tmp/two.svg" "$tmp/a.jsonl" "$tmp/b.jsonl" \
    > "$tmp/two.out" 2>&1
  st=$?
  [ "$st" -eq 0 ] && valid_svg "$tmp/two.svg" && grep -q 'b.jsonl train' "$tmp/two.svg" &&
    grep -q 'two runs' "$tmp/two.svg"
  ok $? "two runs, a title and a log axis in one well-formed SVG (exit $st)" "$tmp/two.out"
else
  for k in 1 2 3; do
    n=$((n + 1))
    echo "ok $n # SKIP gnuplot is not installed"
  done
fi

# Errors: exit 2, one line naming the problem, no picture.
err() {
  want=$1
  shift
  rm -f "$tmp/bad.svg"
  sh "$plot" "$@" > /dev/null 2> "$tmp/err"
  st=$?
  lines=$(wc -l < "$tmp/err")
  [ "$st" -eq "$want" ] && [ "$lines" -eq 1 ] && [ ! -e "$tmp/bad.svg" ]
}
err 2 -o "$tmp/bad.svg"
ok $? "no metrics file: exit 2, one line" "$tmp/err"
err 2 -o "$tmp/bad.svg" "$tmp/missing.jsonl" && grep -q "missing.jsonl" "$tmp/err"
ok $? "an unreadable file: exit 2 naming it" "$tmp/err"
grep -v '"type":"train"' "$tmp/a.jsonl" > "$tmp/val_only.jsonl"
err 2 -o "$tmp/bad.svg" "$tmp/val_only.jsonl" && grep -q "no training record" "$tmp/err"
ok $? "a file without training records: exit 2 saying so" "$tmp/err"
err 2 -o "$tmp/bad.png" "$tmp/a.jsonl" && grep -q "svg" "$tmp/err"
ok $? "a picture name that is not .svg: exit 2" "$tmp/err"
err 2 --frobnicate "$tmp/a.jsonl" && grep -q "frobnicate" "$tmp/err"
ok $? "an unknown option: exit 2 naming it" "$tmp/err"
# Without gnuplot on the path: exit 3 and the package to install.
mkdir "$tmp/bin"
for tool in sed grep basename mktemp rm; do
  ln -s "$(command -v "$tool")" "$tmp/bin/$tool"
done
shell=$(command -v sh)
PATH="$tmp/bin" "$shell" "$plot" -o "$tmp/bad.svg" "$tmp/a.jsonl" > /dev/null 2> "$tmp/err"
st=$?
[ "$st" -eq 3 ] && grep -q "gnuplot-nox" "$tmp/err" && [ ! -e "$tmp/bad.svg" ]
ok $? "no gnuplot: exit 3 naming the package (exit $st)" "$tmp/err"
[ "$failed" -eq 0 ]
