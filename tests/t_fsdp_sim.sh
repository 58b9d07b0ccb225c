#!/bin/sh
# SPDX-License-Identifier: MIT
# t_fsdp_sim.sh: fsdp-sim, the cluster simulator's command line.
#   - --list names every model and cluster preset, and every model preset simulates;
#   - the table has one row per world size and strategy, JSON lines carry the figures;
#   - GPT-3 175B on 512 GPUs simulates, with activation checkpointing under the GPU's memory;
#   - backward prefetch shortens the step, fully sharding cuts the parameters' memory;
#   - collectives slow the kernels they overlap (NCCL's SMs) unless --no-contention;
#   - --layers, --d-model and the other shape options override the preset's shape;
#   - --cluster cpu times its kernels call by call unless asked for the roofline, and
#     --backend gloo calibrates the network from Gloo's collectives, and under fsdprun from its
#     processes' (skipped without Gloo);
#   - --plot writes a well-formed SVG (skipped without gnuplot);
#   - --trace writes the measured step's trace in simulated time (tests/trace_check reads it);
#   - bad options exit 2 and impossible worlds exit 1, each with a message naming the problem.
top_builddir=${top_builddir:-.}
sim="$top_builddir/tools/fsdp-sim"
tmp=$(mktemp -d) || { echo "Bail out! mktemp -d failed"; exit 1; }
trap 'rm -rf "$tmp"' EXIT
. "$(dirname "$0")/tap.sh"
echo "1..28"

"$sim" --list > "$tmp/list" 2>&1
st=$?
models=$(sed -n '/^models:/,/^clusters:/p' "$tmp/list" | awk 'NF > 1 {print $1}')
[ "$st" -eq 0 ] && echo "$models" | grep -qx gpt3-175b && grep -q '^  dgx-h100 ' "$tmp/list" &&
  grep -q '^  fsdp-paper-a100 ' "$tmp/list"
ok $? "--list names the model and cluster presets" "$tmp/list"

bad=""
for m in $models; do
  "$sim" --model "$m" --gpus 8 --json > "$tmp/m.json" 2> "$tmp/m.err" &&
    grep -q "\"model\":\"$m\"" "$tmp/m.json" || bad="$bad $m"
done
[ -n "$models" ] && [ -z "$bad" ]
ok $? "every model preset simulates on 8 GPUs (failed:${bad:- none})" "$tmp/m.err"

"$sim" --model gpt2 --gpus 8,16 --strategy full,hybrid --batch 4 > "$tmp/table" 2>&1
st=$?
rows=$(grep -cE '^ +(8|16) +(FULL_SHARD|HYBRID_SHARD) ' "$tmp/table")
[ "$st" -eq 0 ] && [ "$rows" -eq 4 ]
ok $? "a sweep prints one row per world size and strategy ($rows rows)" "$tmp/table"

"$sim" --model gpt2 --gpus 8,16 --json > "$tmp/lines" 2>&1
st=$?
good=$(grep -c '^{"model":"gpt2",.*"step_s":[0-9.e+-]*,.*"peak_bytes":{.*"total":[0-9]*},.*}$' \
  "$tmp/lines")
[ "$st" -eq 0 ] && [ "$good" -eq 2 ] && [ "$(wc -l < "$tmp/lines")" -eq 2 ]
ok $? "--json prints one object per configuration, with the step and peak memory" "$tmp/lines"

# A field of the JSON line on stdin.
field() { sed -n "s/.*\"$1\":\([0-9.e+-]*\).*/\1/p"; }

"$sim" --model gpt3-175b --gpus 512 --batch 1 --activation-checkpointing --json \
  > "$tmp/175b" 2>&1
st=$?
total=$(sed -n 's/.*"total":\([0-9]*\)}.*/\1/p' "$tmp/175b")
tf=$(field tflops_per_gpu < "$tmp/175b")
[ "$st" -eq 0 ] && [ -n "$total" ] && [ "$total" -lt 85899345920 ] && [ -n "$tf" ] &&
  awk -v t="$tf" 'BEGIN { exit !(t > 10 && t < 312) }'
ok $? "GPT-3 175B on 512 A100s: $tf TFLOPS per GPU, peak $total bytes under 80 GiB" "$tmp/175b"

"$sim" --model gpt3-175b --gpus 64 --batch 1 --json > "$tmp/noac" 2>&1
total_noac=$(sed -n 's/.*"total":\([0-9]*\)}.*/\1/p' "$tmp/noac")
[ -n "$total_noac" ] && [ "$total_noac" -gt 85899345920 ]
ok $? "without activation checkpointing 175B does not fit ($total_noac bytes)" "$tmp/noac"

"$sim" --model gpt3-6.7b --gpus 64 --batch 2 --activation-checkpointing --json > "$tmp/pre" 2>&1
"$sim" --model gpt3-6.7b --gpus 64 --batch 2 --activation-checkpointing --prefetch none \
  --json > "$tmp/none" 2>&1
s_pre=$(field step_s < "$tmp/pre")
s_none=$(field step_s < "$tmp/none")
x_pre=$(field exposed_comm_s < "$tmp/pre")
x_none=$(field exposed_comm_s < "$tmp/none")
[ -n "$s_pre" ] && [ -n "$s_none" ] &&
  awk -v a="$s_pre" -v b="$s_none" -v c="$x_pre" -v d="$x_none" 'BEGIN { exit !(a < b && c < d) }'
ok $? "backward prefetch: step $s_pre s < $s_none s, exposed $x_pre s < $x_none s" \
  "$tmp/pre" "$tmp/none"

"$sim" --model gpt3-6.7b --gpus 64 --batch 2 --activation-checkpointing --prefetch none \
  --no-contention --json > "$tmp/free" 2>&1
c_pre=$(field contention_s < "$tmp/pre")
c_free=$(field contention_s < "$tmp/free")
s_free=$(field step_s < "$tmp/free")
[ -n "$c_pre" ] && [ -n "$c_free" ] && [ -n "$s_free" ] && grep -q '"contention":false' "$tmp/free" &&
  awk -v c="$c_pre" -v f="$c_free" -v s="$s_none" -v t="$s_free" \
    'BEGIN { exit !(c > 0 && f == 0 && t <= s) }'
ok $? "contention: $c_pre s lost beside the collectives; none with --no-contention (step $s_free s <= $s_none s)" \
  "$tmp/pre" "$tmp/free"

"$sim" --model gpt3-6.7b --gpus 64 --strategy full,no-shard --json > "$tmp/strat" 2>&1
p_full=$(grep FULL_SHARD "$tmp/strat" | sed -n 's/.*"params":\([0-9]*\),.*"grads".*/\1/p')
p_none=$(grep NO_SHARD "$tmp/strat" | sed -n 's/.*"params":\([0-9]*\),.*"grads".*/\1/p')
[ -n "$p_full" ] && [ -n "$p_none" ] && [ "$((p_none / p_full))" -ge 8 ]
ok $? "FULL_SHARD peaks at $p_full parameter bytes, NO_SHARD at $p_none" "$tmp/strat"

valid_svg() {
  if command -v xmllint > /dev/null 2>&1; then
    xmllint --noout "$1" 2> "$tmp/xml" || return 1
  fi
  grep -q '<svg' "$1" && tail -c 200 "$1" | grep -q '</svg>'
}
if command -v gnuplot > /dev/null 2>&1; then
  "$sim" --model gpt2 --gpus 8,16,32 --strategy full,grad-op --plot "$tmp/p.svg" \
    > "$tmp/plot.out" 2>&1
  st=$?
  [ "$st" -eq 0 ] && valid_svg "$tmp/p.svg" && grep -q 'SHARD_GRAD_OP' "$tmp/p.svg" &&
    grep -q 'activations' "$tmp/p.svg"
  ok $? "--plot writes a well-formed SVG with both strategies and the categories" \
    "$tmp/plot.out" "$tmp/xml"
else
  n=$((n + 1))
  echo "ok $n # SKIP gnuplot is not installed"
fi

# --cluster cpu: this machine calibrated, fsdp-train's tiny model with its gradient clipping.
"$sim" --cluster cpu --model tiny --precision fp32 --gpus 2 --batch 8 --grad-clip 1 --json \
  > "$tmp/cpu" 2>&1
st=$?
[ "$st" -eq 0 ] && grep -q '"cluster":"cpu","gpus":2,' "$tmp/cpu" &&
  grep -q '"all_reduce":{"bytes":[1-9]' "$tmp/cpu"
ok $? "--cluster cpu calibrates this machine; clipping all-reduces the norm (exit $st)" "$tmp/cpu"
grep -q '"kernel_times":"measured","measured_calls":[1-9][0-9]*,"backend":"sim"' "$tmp/cpu"
ok $? "  its kernels are timed on this CPU by default, call by call" "$tmp/cpu"
"$sim" --cluster cpu --kernel-times roofline --model tiny --precision fp32 --gpus 2 --batch 8 \
  --json > "$tmp/roof" 2>&1
st=$?
[ "$st" -eq 0 ] && grep -q '"kernel_times":"roofline","measured_calls":0,' "$tmp/roof"
ok $? "  --kernel-times roofline prices them by the calibrated rates (exit $st)" "$tmp/roof"
if "$top_builddir/tools/fsdp-train" --version 2>/dev/null | grep -q 'backends:.*gloo'; then
  "$sim" --cluster cpu --backend gloo --model tiny --precision fp32 --gpus 2 --batch 8 --json \
    > "$tmp/gloo" 2>&1
  st=$?
  [ "$st" -eq 0 ] && grep -q '"backend":"gloo"' "$tmp/gloo" &&
    grep -q '"all_gather":{"bytes":[1-9][0-9]*,"s":[0-9.e-]*[1-9]' "$tmp/gloo"
  ok $? "--backend gloo times Gloo's collectives for the network (exit $st)" "$tmp/gloo"
  # Under a launcher its processes time them; rank 0 alone prints (its one JSON line).
  run="$top_builddir/tools/fsdprun"
  "$run" -n 2 --no-prefix "$sim" --cluster cpu --backend gloo --model tiny --precision fp32 \
    --gpus 2 --batch 8 --json > "$tmp/launched" 2> "$tmp/launched.err"
  st=$?
  [ "$st" -eq 0 ] && [ "$(wc -l < "$tmp/launched")" -eq 1 ] &&
    grep -q '"gpus":2,"gpus_per_node":2,' "$tmp/launched" &&
    grep -q '"all_gather":{"bytes":[1-9][0-9]*,"s":[0-9.e-]*[1-9]' "$tmp/launched"
  ok $? "under fsdprun -n 2 the two processes calibrate, rank 0 prints (exit $st)" \
    "$tmp/launched.err"
  "$run" -n 2 --no-prefix "$sim" --cluster cpu --backend gloo --model tiny --gpus 4 \
    > "$tmp/launched" 2> "$tmp/launched.err"
  st=$?
  [ "$st" -ne 0 ] && grep -q -- "--gpus 4: the launcher started 2 processes" "$tmp/launched.err"
  ok $? "  --gpus other than the launched world is refused, naming both (exit $st)" \
    "$tmp/launched.err"
  "$run" -n 2 --no-prefix "$sim" --cluster cpu --model tiny --gpus 2 \
    > "$tmp/launched" 2> "$tmp/launched.err"
  st=$?
  [ "$st" -ne 0 ] && grep -q -- "give --cluster cpu --backend gloo" "$tmp/launched.err"
  ok $? "  and so is a launched run without --backend gloo (exit $st)" "$tmp/launched.err"
else
  for i in 1 2 3 4; do
    n=$((n + 1))
    echo "ok $n # SKIP fsdp-train has no Gloo backend"
  done
fi

# The shape options override the preset: tiny with 6 blocks has 6 x 198272 + 41216 parameters.
"$sim" --model tiny --layers 6 --gpus 2 --json > "$tmp/shape" 2>&1
st=$?
[ "$st" -eq 0 ] && grep -q '"model":"tiny-custom","params":1230848,' "$tmp/shape"
ok $? "--layers overrides the preset's depth: tiny-custom, 1230848 parameters (exit $st)" "$tmp/shape"

# --trace: the measured step in simulated time, read back by tests/trace_check.
check="$top_builddir/tests/trace_check"
"$sim" --model gpt2-medium --gpus 16 --batch 2 --prefetch none --trace "$tmp/t.json" --json \
  > "$tmp/t.out" 2>&1
st=$?
"$check" "$tmp/t.json" > "$tmp/t.check" 2>&1
cst=$?
# 24 blocks and the root: 25 forward and 25 backward spans; the waits are the exposed comm.
[ "$st" -eq 0 ] && [ "$cst" -eq 0 ] && grep -q '^rank 0 .*forward 25 backward 25 ' "$tmp/t.check" &&
  grep -q '^rank 0 .* optimizer 1 ' "$tmp/t.check" && grep -q '^rank 0 .* comm [1-9]' "$tmp/t.check"
ok $? "--trace writes a valid trace of the step: a span per unit and phase, the collectives" \
  "$tmp/t.out" "$tmp/t.check"
"$sim" --model gpt2 --gpus 8,16 --trace "$tmp/t2.json" > "$tmp/t2.out" 2> "$tmp/t2.err"
st=$?
[ "$st" -eq 2 ] && grep -q "one configuration" "$tmp/t2.err" && [ ! -e "$tmp/t2.json" ]
ok $? "--trace with two configurations exits 2 (exit $st)" "$tmp/t2.err"

# Errors: a message naming the problem, the exit status of its kind.
err() {
  want=$1 pattern=$2 desc=$3
  shift 3
  "$sim" "$@" > "$tmp/e.out" 2> "$tmp/e.err"
  st=$?
  [ "$st" -eq "$want" ] && grep -q -- "$pattern" "$tmp/e.err"
  ok $? "$desc (exit $st)" "$tmp/e.err"
}
err 2 "unknown model" "an unknown model exits 2" --model gpt5
err 2 "world sizes" "--gpus 0 exits 2" --gpus 0
err 1 "whole nodes" "12 GPUs over nodes of 8 exit 1, as not filling whole nodes" --gpus 12
err 1 "unknown cluster preset" "an unknown cluster exits 1, listing the known" --cluster tpu
err 1 "must end in .svg" "--plot to a .png exits 1" --model gpt2 --plot "$tmp/x.png"
err 2 "only with --cluster cpu" "--kernel-times measured on a GPU preset exits 2" \
  --kernel-times measured
err 2 "only with --cluster cpu" "--backend on a GPU preset exits 2" --backend gloo
err 2 "must divide --d-model" "--heads that do not divide --d-model exit 2" --d-model 384 --heads 7

exit 0
