#!/bin/sh
# SPDX-License-Identifier: MIT
# gpt_gloo.sh: FSDP over gloo (bench_gpt_gloo under fsdprun) against PyTorch DDP over gloo
# (gpt_gloo_torch.py), same model, batch, optimizer and thread count, one rank per process.
#
#   bench/gpt_gloo.sh [--runs N] [--nproc N] [bench options...]
#
# Runs both sides N times (--runs, default 3), alternating, with --nproc processes each
# (default 2), and prints per run and in summary the ratios libfsdp/PyTorch of the median step
# time (target <= 0.7) and of the per-process peak RSS, the largest rank's VmHWM
# (target <= 0.5). Every other option goes to both programs unchanged (see
# bench_gpt_gloo --help): --layers, --d, --heads, --seq, --batch (per rank), --vocab, --steps,
# --warmup, --threads, --seed, --lr, --quick.
#
# Threads: --threads when given, else FSDP_NUM_THREADS, else the online cores divided by the
# processes (at least 1); both sides get the count as --threads (torch.set_num_threads) and
# through FSDP_NUM_THREADS, OMP_NUM_THREADS and OPENBLAS_NUM_THREADS.
#
# OpenBLAS: both libfsdp and Debian's PyTorch (BLAS_INFO=generic, libblas.so.3) run their matrix
# products in OpenBLAS, whose 0.3.21 falls back to its generic Prescott kernels on CPUs newer
# than itself (see bench/README.md). When OPENBLAS_CORETYPE is unset and OpenBLAS reports that
# fallback, the script exports OPENBLAS_CORETYPE=SkylakeX (AVX-512) or Haswell (AVX2) for both
# sides; set OPENBLAS_CORETYPE (even to the empty string) to choose yourself.
#
# Environment: BENCH_GPT_GLOO (the C program; default bench/bench_gpt_gloo in the current
# directory, then next to this script), FSDPRUN (default tools/fsdprun likewise), PYTHON (the
# interpreter with torch; default /usr/bin/python3 when it imports torch, else python3).
#
# Exit status: 0 when every run succeeded, 1 when one failed, 2 for bad usage. Without torch
# the script prints libfsdp's numbers alone and exits 0.

set -u

here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib.sh"
runs=3
nproc=2
bench_args gpt_gloo.sh "--runs --nproc" "" "$@"
bench_threads $(($(bench_cores) / nproc))

cbench=$(bench_find_prog "${BENCH_GPT_GLOO:-}" bench/bench_gpt_gloo)
fsdprun=$(bench_find_prog "${FSDPRUN:-}" tools/fsdprun)
for p in "$cbench" "$fsdprun"; do
    if [ -z "$p" ] || [ ! -x "$p" ]; then
        echo "gpt_gloo.sh: bench_gpt_gloo or fsdprun not found (make bench/bench_gpt_gloo" \
            "tools/fsdprun in a build with Gloo, or set BENCH_GPT_GLOO and FSDPRUN)" >&2
        exit 1
    fi
done

# The core OpenBLAS picks by itself, as it reports when it loads (libfsdp's side links it).
blas_core=$(OPENBLAS_VERBOSE=2 "$cbench" --help 2>&1 | sed -n 's/^Core: //p' | head -n 1)
if [ -z "${OPENBLAS_CORETYPE+set}" ] && [ "$blas_core" = Prescott ]; then
    if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then export OPENBLAS_CORETYPE=SkylakeX
    elif grep -qw avx2 /proc/cpuinfo 2>/dev/null; then export OPENBLAS_CORETYPE=Haswell
    fi
fi

bench_torch gpt_gloo.sh

echo "# gpt_gloo.sh: $nproc processes per side, $threads thread(s) each," \
    "OpenBLAS core ${blas_core:-unknown}, OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-(unset)};" \
    "load average $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)"

rss_of() { sed -n 's/^peak RSS MiB max \([0-9.]*\).*/\1/p' "$1"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", a / b }'; }

tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT INT TERM
status=0
tratios=
mratios=
i=1
while [ "$i" -le "$runs" ]; do
    echo "== run $i of $runs: libfsdp FSDP ($fsdprun -n $nproc $cbench)"
    if eval "\"\$fsdprun\" --no-prefix -n \"\$nproc\" \"\$cbench\" $args" >"$tmp/c.out" 2>&1; then
        cat "$tmp/c.out"; else
        cat "$tmp/c.out"; echo "gpt_gloo.sh: bench_gpt_gloo failed" >&2; status=1; fi
    c_ms=$(bench_step_median "$tmp/c.out")
    c_rss=$(rss_of "$tmp/c.out")
    t_ms=
    t_rss=
    if [ "$have_torch" = 1 ]; then
        echo "== run $i of $runs: PyTorch DDP ($py gpt_gloo_torch.py --nproc $nproc)"
        if eval "\"\$py\" \"\$here/gpt_gloo_torch.py\" --nproc \"\$nproc\" $args" >"$tmp/t.out" 2>&1
        then cat "$tmp/t.out"; else
            cat "$tmp/t.out"; echo "gpt_gloo.sh: gpt_gloo_torch.py failed" >&2; status=1; fi
        t_ms=$(bench_step_median "$tmp/t.out")
        t_rss=$(rss_of "$tmp/t.out")
    fi
    echo "libfsdp: median ms/step ${c_ms:-n/a}, peak RSS MiB ${c_rss:-n/a}"
    if [ "$have_torch" = 1 ]; then
        echo "pytorch: median ms/step ${t_ms:-n/a}, peak RSS MiB ${t_rss:-n/a}"
        if [ -n "$c_ms" ] && [ -n "$t_ms" ] && [ -n "$c_rss" ] && [ -n "$t_rss" ]; then
            tr=$(ratio "$c_ms" "$t_ms")
            mr=$(ratio "$c_rss" "$t_rss")
            echo "run $i: ratio libfsdp/pytorch step time = $tr, peak RSS = $mr"
            tratios="$tratios $tr"
            mratios="$mratios $mr"
        fi
    fi
    i=$((i + 1))
done
summary() { # $1: name, $2: target, $3: ratios
    echo "$3" | awk -v name="$1" -v target="$2" '{ lo = $1; hi = $1; s = 0
        for (i = 1; i <= NF; i++) { if ($i < lo) lo = $i; if ($i > hi) hi = $i; s += $i }
        printf "ratio libfsdp/pytorch %s:%s (min %.3f, mean %.3f, max %.3f; target <= %s) %s\n",
            name, $0, lo, s / NF, hi, target, hi <= target ? "PASS" : (lo <= target ? "MIXED" : "MISS") }'
}
if [ -n "$tratios" ]; then
    summary "step time" 0.7 "$tratios"
    summary "peak RSS" 0.5 "$mratios"
fi
exit $status
