#!/bin/sh
# SPDX-License-Identifier: MIT
# paper_figures.sh: fsdp-sim against the figures of the PyTorch FSDP paper, as one table.
#
#   bench/paper_figures.sh [--kernels native|libfsdp] [--t5-batches "1 2 3 4 8"] [--quick]
#
# Zhao et al., PVLDB 16(12), 2023, section 5: A100 80GB GPUs on 2 Tb/s RoCE (fsdp-sim's
# cluster preset fsdp-paper-a100), full sharding, backward prefetch, the rate limiter,
# activation checkpointing, bf16 and Adam. For each figure the script runs fsdp-sim on that
# configuration and prints the paper's value, the model's, the gap and whether it is within
# 15%:
#   - GPT-175B hardware TFLOPS per GPU at 1 and 2 sequences a GPU (paper: 173 and 186), at
#     128, 256 and 512 GPUs;
#   - their change from 128 to 512 GPUs (paper: linear total throughput, flat per GPU; the
#     script counts within 15% as a change under 15% of the 128-GPU figure);
#   - the gain of backward prefetch, step without it over step with it, less 1 (paper: about
#     18%, batch and world size not given), at each batch and world size;
#   - T5-11B's change in hardware TFLOPS per GPU from 8 to 512 GPUs (paper: about -7%, batch not
#     given), at every batch of --t5-batches (default 1 2 3 4 8 sequences of 512 a GPU).
# --kernels native (the default) simulates half kernels as PyTorch's (the paper ran PyTorch);
# libfsdp simulates libfsdp's own, which widen bf16 to f32. docs/simulation.md explains every
# gap. The figures are simulated, not timed: the table is the same on any machine (about a
# minute here: 175B at 512 GPUs is the longest run). --quick: GPT-175B at 128 GPUs and T5 at
# batch 8 only (a smoke test of the script).
#
# Environment: FSDP_SIM (default: the build tree's tools/fsdp-sim).
set -u
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib.sh"
kernels=native
t5_batches="1 2 3 4 8"
gpus="128 256 512"
while [ $# -gt 0 ]; do
    case $1 in
    --kernels) kernels=$2; shift 2 ;;
    --t5-batches) t5_batches=$2; shift 2 ;;
    --quick) gpus=128; t5_batches=8; shift ;;
    --help|-h) bench_help ;;
    *) echo "paper_figures.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
    esac
done
case $kernels in native|libfsdp) ;; *) echo "paper_figures.sh: --kernels must be native or libfsdp" >&2; exit 2 ;; esac
for b in $t5_batches; do
    case $b in ''|*[!0-9]*|0) echo "paper_figures.sh: --t5-batches takes positive integers, not '$b'" >&2; exit 2 ;; esac
done

sim=$(find_tool fsdp-sim "${FSDP_SIM:-}")
[ -n "$sim" ] || { echo "paper_figures.sh: fsdp-sim not found (build it, or set FSDP_SIM)" >&2; exit 2; }
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT

# field NAME: a number field of the JSON lines on stdin, one per line.
field() { sed -n "s/.*\"$1\":\([0-9.e+-]*\).*/\1/p"; }

# run NAME ARGS...: fsdp-sim --json into $tmp/NAME (one line per world size); exit 1 on failure.
run() {
    _n=$1
    shift
    "$sim" --cluster fsdp-paper-a100 --activation-checkpointing --kernels "$kernels" --json \
        "$@" > "$tmp/$_n" 2> "$tmp/$_n.err" || {
        echo "paper_figures.sh: fsdp-sim $* failed:" >&2
        cat "$tmp/$_n.err" >&2
        exit 1
    }
}

# row FIGURE PAPER MODEL UNIT: one table row; PAPER and MODEL are numbers (UNIT printed after
# each), the gap is MODEL / PAPER - 1 and within 15% when its magnitude is at most 0.15.
row() {
    awk -v f="$1" -v p="$2" -v m="$3" -v u="$4" 'BEGIN {
        g = m / p - 1
        printf "| %s | %s%s | %.1f%s | %+.1f%% | %s |\n", f, p, u, m, u, 100 * g,
               (g <= 0.15 && g >= -0.15) ? "yes" : "no" }'
}

list=$(echo "$gpus" | tr ' ' ',')
echo "# paper_figures.sh: fsdp-sim --cluster fsdp-paper-a100 --activation-checkpointing --kernels $kernels"
echo "| figure | paper | model | gap | within 15% |"
echo "|---|---|---|---|---|"
for b in 1 2; do
    run "pre$b" --model gpt3-175b --gpus "$list" --batch "$b"
    run "none$b" --model gpt3-175b --gpus "$list" --batch "$b" --prefetch none
    paper=173
    [ "$b" -eq 2 ] && paper=186
    field hw_tflops_per_gpu < "$tmp/pre$b" > "$tmp/tf$b"
    field step_s < "$tmp/pre$b" > "$tmp/sp$b"
    field step_s < "$tmp/none$b" > "$tmp/sn$b"
    i=1
    for g in $gpus; do
        tf=$(sed -n "${i}p" "$tmp/tf$b")
        row "GPT-175B, $b sequence(s) a GPU, $g GPUs: hardware TFLOPS per GPU" "$paper" "$tf" ""
        i=$((i + 1))
    done
    first=$(head -1 "$tmp/tf$b")
    last=$(tail -1 "$tmp/tf$b")
    if [ "$(wc -l < "$tmp/tf$b")" -gt 1 ]; then
        awk -v a="$first" -v z="$last" -v b="$b" -v g0="${gpus%% *}" -v g1="${gpus##* }" 'BEGIN {
            c = z / a - 1
            printf "| GPT-175B, %d sequence(s): TFLOPS per GPU from %d to %d GPUs | flat | %+.2f%% | | %s |\n",
                   b, g0, g1, 100 * c, (c <= 0.15 && c >= -0.15) ? "yes" : "no" }'
    fi
    i=1
    for g in $gpus; do
        sp=$(sed -n "${i}p" "$tmp/sp$b")
        sn=$(sed -n "${i}p" "$tmp/sn$b")
        gain=$(awk -v p="$sp" -v n="$sn" 'BEGIN { printf "%.4f", 100 * (n / p - 1) }')
        row "GPT-175B, $b sequence(s), $g GPUs: backward prefetch's gain ($sn s without, $sp s with)" 18 "$gain" "%"
        i=$((i + 1))
    done
done
for b in $t5_batches; do
    run "t5_$b" --model t5-11b-proxy --gpus 8,512 --batch "$b"
    field hw_tflops_per_gpu < "$tmp/t5_$b" > "$tmp/t5tf$b"
    a=$(head -1 "$tmp/t5tf$b")
    z=$(tail -1 "$tmp/t5tf$b")
    c=$(awk -v a="$a" -v z="$z" 'BEGIN { printf "%.4f", 100 * (z / a - 1) }')
    row "T5-11B, $b sequence(s) of 512 a GPU: TFLOPS per GPU from 8 to 512 GPUs ($a to $z)" -7 "$c" "%"
done
