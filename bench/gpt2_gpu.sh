#!/bin/sh
# SPDX-License-Identifier: MIT
# gpt2_gpu.sh: libfsdp FSDP over NCCL (bench_gpt_gpu) against PyTorch FSDP over NCCL
# (gpt2_torch_fsdp.py) on GPUs: GPT-2 small, same batch, sequence, optimizer and precision.
#
#   bench/gpt2_gpu.sh [--runs N] [--nproc N] [bench options...]
#
# Runs both sides N times (--runs, default 3), alternating, each with --nproc ranks, one per
# GPU (default 1; more go through tools/fsdprun --backend nccl and torchrun), and prints per
# run and in summary (medians over the runs) the ratios libfsdp/PyTorch of tokens/s
# (target >= 1.0), of the allocator's peak memory (libfsdp's device counters against
# torch.cuda.max_memory_allocated) and of the GPU's used memory (cudaMemGetInfo). Every other
# option goes to both programs unchanged (see bench_gpt_gpu --help): --layers, --d, --heads,
# --seq, --batch (per rank), --vocab, --steps, --warmup, --seed, --lr, --peak-n, --peak-iters,
# --quick, --bf16. With --bf16, PyTorch runs bf16 only when libfsdp's run did (its header
# line says which precision ran), so both sides always compare the same precision.
#
# Environment: BENCH_GPT_GPU (the C program; default bench/bench_gpt_gpu in the current
# directory, then next to this script), FSDPRUN (default tools/fsdprun likewise), PYTHON (the
# interpreter with torch; default /usr/bin/python3 when it imports torch, else python3),
# TORCHRUN (default "$PYTHON -m torch.distributed.run").
#
# Exit status: 0 when every run succeeded, 1 when one failed, 2 for bad usage. Without torch
# the script prints libfsdp's numbers alone and exits 0.

set -u

here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib.sh"
runs=3
nproc=1
bench_args gpt2_gpu.sh "--runs --nproc" --bf16 "$@"
bf16=0
bench_has --bf16 "$@" && bf16=1

cbench=$(bench_find_prog "${BENCH_GPT_GPU:-}" bench/bench_gpt_gpu)
fsdprun=$(bench_find_prog "${FSDPRUN:-}" tools/fsdprun)
if [ -z "$cbench" ] || [ ! -x "$cbench" ]; then
    echo "gpt2_gpu.sh: bench_gpt_gpu not found${cbench:+ at $cbench} (it is built only with --with-cuda and --with-nccl; set BENCH_GPT_GPU)" >&2
    exit 2
fi
if [ "$nproc" -gt 1 ] && [ -z "$fsdprun" ]; then
    echo "gpt2_gpu.sh: tools/fsdprun not found for --nproc $nproc (set FSDPRUN)" >&2
    exit 2
fi
bench_torch gpt2_gpu.sh "torch, torch.distributed.fsdp"
torchrun=${TORCHRUN:-"$py -m torch.distributed.run"}

tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT

run_c() {
    if [ "$bf16" = 1 ]; then set -- --bf16; else set --; fi
    if [ "$nproc" -gt 1 ]; then
        eval "\"\$fsdprun\" -n $nproc --backend nccl --no-prefix \"\$cbench\" \"\$@\" $args"
    else
        eval "\"\$cbench\" \"\$@\" $args"
    fi
}
run_torch() { # $1: --bf16 or nothing
    if [ -n "$1" ]; then set -- --bf16; else set --; fi
    if [ "$nproc" -gt 1 ]; then
        eval "$torchrun --standalone --nproc_per_node $nproc \"\$here/gpt2_torch_fsdp.py\" \"\$@\" $args"
    else
        eval "\"\$py\" \"\$here/gpt2_torch_fsdp.py\" \"\$@\" $args"
    fi
}
# field FILE PATTERN: the number after the last ':' or the first number after PATTERN's text
val() { sed -n "s/^$2[^0-9]*\\([0-9][0-9.]*\\).*/\\1/p" "$1" | tail -n 1; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "" || b + 0 == 0) print "n/a"; else printf "%.3f", a / b }'; }

status=0
: > "$tmp/tok"; : > "$tmp/mem"; : > "$tmp/used"
i=1
while [ "$i" -le "$runs" ]; do
    echo "== run $i/$runs: libfsdp"
    if ! run_c > "$tmp/c.out" 2>&1; then
        cat "$tmp/c.out"; echo "gpt2_gpu.sh: bench_gpt_gpu failed" >&2; status=1; break
    fi
    cat "$tmp/c.out"
    tb=
    grep -q '^# bench_gpt_gpu:.*bf16 mixed precision' "$tmp/c.out" && tb=--bf16
    if [ "$have_torch" = 1 ]; then
        echo "== run $i/$runs: PyTorch"
        if ! run_torch "$tb" > "$tmp/t.out" 2>&1; then
            cat "$tmp/t.out"; echo "gpt2_gpu.sh: gpt2_torch_fsdp.py failed" >&2; status=1; break
        fi
        cat "$tmp/t.out"
        rt=$(ratio "$(val "$tmp/c.out" 'tokens\/s')" "$(val "$tmp/t.out" 'tokens\/s')")
        rm_=$(ratio "$(val "$tmp/c.out" 'memory (')" "$(val "$tmp/t.out" 'memory (')")
        ru=$(ratio "$(val "$tmp/c.out" 'GPU used memory ([^)]*):')" \
                   "$(val "$tmp/t.out" 'GPU used memory ([^)]*):')")
        echo "run $i: libfsdp/PyTorch tokens/s $rt (target >= 1.0), allocator peak $rm_, GPU used $ru"
        echo "$rt" >> "$tmp/tok"; echo "$rm_" >> "$tmp/mem"; echo "$ru" >> "$tmp/used"
    fi
    i=$((i + 1))
done
if [ "$have_torch" = 1 ] && [ -s "$tmp/tok" ]; then
    echo "summary over $(wc -l < "$tmp/tok") run(s), medians of libfsdp/PyTorch: tokens/s" \
         "$(grep -v n/a "$tmp/tok" | bench_median n/a %.3f) (target >= 1.0), allocator peak memory" \
         "$(grep -v n/a "$tmp/mem" | bench_median n/a %.3f), GPU used memory $(grep -v n/a "$tmp/used" | bench_median n/a %.3f)"
fi
exit $status
