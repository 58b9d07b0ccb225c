#!/bin/sh
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
runs=1
threads=
next_is_threads=0
for arg in "$@"; do
    if [ "$next_is_threads" = 1 ]; then threads=$arg; next_is_threads=0; fi
    [ "$arg" = "--threads" ] && next_is_threads=1
done

# --runs is ours; everything else is passed through.
args=
while [ $# -gt 0 ]; do
    case $1 in
    --runs)
        [ $# -ge 2 ] || { echo "gpt_step.sh: --runs needs a value" >&2; exit 2; }
        runs=$2; shift 2 ;;
    --help|-h)
        sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *)
        args="$args '$(printf '%s' "$1" | sed "s/'/'\\\\''/g")'"; shift ;;
    esac
done
case $runs in ''|*[!0-9]*|0) echo "gpt_step.sh: --runs needs a positive integer" >&2; exit 2 ;; esac

if [ -z "$threads" ]; then
    threads=${FSDP_NUM_THREADS:-$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN)}
    args="$args --threads $threads"
fi
export FSDP_NUM_THREADS=$threads OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads

cbench=${BENCH_GPT_STEP:-}
if [ -z "$cbench" ]; then
    for c in ./bench/bench_gpt_step "$here/bench_gpt_step"; do
        [ -x "$c" ] && { cbench=$c; break; }
    done
fi
if [ -z "$cbench" ] || [ ! -x "$cbench" ]; then
    echo "gpt_step.sh: bench_gpt_step not found (build it with make bench/bench_gpt_step, or set BENCH_GPT_STEP)" >&2
    exit 1
fi

py=${PYTHON:-}
if [ -z "$py" ]; then
    if /usr/bin/python3 -c 'import torch' >/dev/null 2>&1; then py=/usr/bin/python3; else py=python3; fi
fi
have_torch=1
if ! "$py" -c 'import torch' >/dev/null 2>&1; then
    have_torch=0
    echo "gpt_step.sh: PyTorch is not installed for $py (set PYTHON); printing libfsdp's numbers only"
fi

median_of() { sed -n 's/^ms\/step median \([0-9.]*\).*/\1/p' "$1"; }

tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT INT TERM
status=0
ratios=
i=1
while [ "$i" -le "$runs" ]; do
    echo "== run $i of $runs: libfsdp ($cbench, $threads threads)"
    if eval "\"\$cbench\" $args" >"$tmp/c.out" 2>&1; then cat "$tmp/c.out"; else
        cat "$tmp/c.out"; echo "gpt_step.sh: bench_gpt_step failed" >&2; status=1; fi
    c_ms=$(median_of "$tmp/c.out")
    t_ms=
    if [ "$have_torch" = 1 ]; then
        echo "== run $i of $runs: PyTorch ($py, $threads threads)"
        if eval "\"\$py\" \"\$here/gpt_step_torch.py\" $args" >"$tmp/t.out" 2>&1; then
            cat "$tmp/t.out"; else
            cat "$tmp/t.out"; echo "gpt_step.sh: gpt_step_torch.py failed" >&2; status=1; fi
        t_ms=$(median_of "$tmp/t.out")
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
