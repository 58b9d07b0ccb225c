#!/bin/sh
# SPDX-License-Identifier: MIT
# gpt_step.sh: runs bench_gpt_step (libfsdp) and gpt_step_torch.py (PyTorch) with the same
# arguments and thread count, and prints both medians and their ratio.
#
#   bench/gpt_step.sh [--runs N] [bench options...]
#
# Every option except --runs goes to both programs unchanged (see bench_gpt_step --help). The
# thread count is --threads when given, else FSDP_NUM_THREADS, else all online cores; both
# sides get it as --threads and through FSDP_NUM_THREADS, OMP_NUM_THREADS and
# OPENBLAS_NUM_THREADS, so neither library starts more threads than the other. With --runs N
# (default 1) the two programs run N times, alternating, and the ratio of each pair is printed.
#
# Environment: BENCH_GPT_STEP (the C program; default: bench/bench_gpt_step in the current
# directory, then next to this script), PYTHON (the interpreter with torch; default
# /usr/bin/python3 when it imports torch, else python3).
#
# Exit status: 0 when every run succeeded, 1 when one failed, 2 for bad usage. When torch cannot
# be imported the script says so, prints libfsdp's numbers alone and exits 0.

set -u

here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib.sh"
runs=1
# --runs is ours; everything else is passed through.
bench_args gpt_step.sh --runs "" "$@"
bench_threads "$(bench_cores)"

cbench=$(bench_find_prog "${BENCH_GPT_STEP:-}" bench/bench_gpt_step)
if [ -z "$cbench" ] || [ ! -x "$cbench" ]; then
    echo "gpt_step.sh: bench_gpt_step not found (build it with make bench/bench_gpt_step, or set BENCH_GPT_STEP)" >&2
    exit 1
fi

bench_torch gpt_step.sh


tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT INT TERM
status=0
ratios=
i=1
while [ "$i" -le "$runs" ]; do
    echo "== run $i of $runs: libfsdp ($cbench, $threads threads)"
    if eval "\"\$cbench\" $args" >"$tmp/c.out" 2>&1; then cat "$tmp/c.out"; else
        cat "$tmp/c.out"; echo "gpt_step.sh: bench_gpt_step failed" >&2; status=1; fi
    c_ms=$(bench_step_median "$tmp/c.out")
    t_ms=
    if [ "$have_torch" = 1 ]; then
        echo "== run $i of $runs: PyTorch ($py, $threads threads)"
        if eval "\"\$py\" \"\$here/gpt_step_torch.py\" $args" >"$tmp/t.out" 2>&1; then
            cat "$tmp/t.out"; else
            cat "$tmp/t.out"; echo "gpt_step.sh: gpt_step_torch.py failed" >&2; status=1; fi
        t_ms=$(bench_step_median "$tmp/t.out")
    fi
    echo "libfsdp median ms/step: ${c_ms:-n/a}"
    if [ "$have_torch" = 1 ]; then
        echo "pytorch median ms/step: ${t_ms:-n/a}"
        if [ -n "$c_ms" ] && [ -n "$t_ms" ]; then
            r=$(awk -v c="$c_ms" -v t="$t_ms" 'BEGIN { printf "%.2f", c / t }')
            echo "ratio libfsdp/pytorch = $r"
            ratios="$ratios $r"
        fi
    fi
    i=$((i + 1))
done
if [ "$runs" -gt 1 ] && [ -n "$ratios" ]; then
    echo "$ratios" | awk '{ lo = $1; hi = $1; s = 0
        for (i = 1; i <= NF; i++) { if ($i < lo) lo = $i; if ($i > hi) hi = $i; s += $i }
        printf "ratios:%s (min %.2f, mean %.2f, max %.2f; target <= 1.0)\n", $0, lo, s / NF, hi }'
fi
exit $status
