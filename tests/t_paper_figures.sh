#!/bin/sh
# SPDX-License-Identifier: MIT
# t_paper_figures.sh: bench/paper_figures.sh, fsdp-sim against the PyTorch FSDP paper's figures
# (docs/simulation.md), kept as a regression test of the figures the model reproduces:
#   - GPT-175B's hardware TFLOPS per GPU at 128 GPUs within 15% of the paper's 173 (1 sequence a
#     GPU) and 186 (2 sequences);
#   - backward prefetch's gain at 1 sequence within 15% of the paper's 18%;
#   - T5-11B's TFLOPS per GPU fall from 8 to 512 GPUs at 2 sequences a GPU, as the paper's do,
#     and do not at 8, where the model hides the communication;
#   - every figure is one table row with a verdict, and bad options exit 2 naming the problem.
# The figures are simulated (GPU presets, no timing), so they are the same on every machine.
top_builddir=${top_builddir:-.}
srcdir=${srcdir:-.}
script="$srcdir/bench/paper_figures.sh"
tmp=$(mktemp -d) || { echo "Bail out! mktemp -d failed"; exit 1; }
trap 'rm -rf "$tmp"' EXIT
. "$(dirname "$0")/tap.sh"
echo "1..7"

FSDP_SIM="$top_builddir/tools/fsdp-sim" sh "$script" --quick --t5-batches "2 8" \
  > "$tmp/table" 2> "$tmp/err"
st=$?
rows=$(grep -c '^| .* | \(yes\|no\) |$' "$tmp/table")
[ "$st" -eq 0 ] && [ "$rows" -eq 6 ]
ok $? "one row per figure, each with a verdict ($rows rows)" "$tmp/table" "$tmp/err"

# The model's figure of the first row whose figure column matches $1.
model() { grep -- "$1" "$tmp/table" | head -1 | awk -F'|' '{ gsub(/[ %]/, "", $4); print $4 }'; }
verdict() { grep -- "$1" "$tmp/table" | head -1 | awk -F'|' '{ gsub(/ /, "", $6); print $6 }'; }

for b in 1 2; do
  pat="GPT-175B, $b sequence(s) a GPU, 128 GPUs"
  [ "$(verdict "$pat")" = yes ]
  ok $? "GPT-175B at $b sequence(s) a GPU: $(model "$pat") TFLOPS per GPU, within 15% of the paper" \
    "$tmp/table"
done
pat="GPT-175B, 1 sequence(s), 128 GPUs: backward prefetch"
[ "$(verdict "$pat")" = yes ]
ok $? "backward prefetch at 1 sequence a GPU: $(model "$pat")%, within 15% of the paper's 18%" \
  "$tmp/table"

t2=$(model "T5-11B, 2 sequence(s)")
t8=$(model "T5-11B, 8 sequence(s)")
[ -n "$t2" ] && awk -v c="$t2" 'BEGIN { exit !(c < -1) }'
ok $? "T5-11B at 2 sequences a GPU: TFLOPS per GPU fall from 8 to 512 GPUs ($t2%)" "$tmp/table"
[ -n "$t8" ] && awk -v c="$t8" 'BEGIN { exit !(c > -1) }'
ok $? "T5-11B at 8 sequences a GPU: the communication hidden, no fall ($t8%)" "$tmp/table"

FSDP_SIM="$top_builddir/tools/fsdp-sim" sh "$script" --kernels cuda > "$tmp/o" 2> "$tmp/e"
st=$?
[ "$st" -eq 2 ] && grep -q -- "--kernels must be native or libfsdp" "$tmp/e"
ok $? "an unknown --kernels exits 2 naming the option (exit $st)" "$tmp/e"
exit 0
