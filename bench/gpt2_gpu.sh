#!/bin/sh
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
# interpreter with torch; default python3), TORCHRUN (default "$PYTHON -m torch.distributed.run").
#
# Exit status: 0 when every run succeeded, 1 when one failed, 2 for bad usage. Without torch
# the script prints libfsdp's numbers alone and exits 0.

set -u

here=$(cd "$(dirname "$0")" && pwd)
runs=3
nproc=1
args=
bf16=0
while [ $# -gt 0 ]; do
    case $1 in
    --runs|--nproc)
        [ $# -ge 2 ] || { echo "gpt2_gpu.sh: $1 needs a value" >&2; exit 2; }
        if [ "$1" = --runs ]; then runs=$2; else nproc=$2; fi
        shift 2 ;;
    --help|-h)
        sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --bf16)
        bf16=1; shift ;;
    *)
        args="$args '$(printf '%s' "$1" | sed "s/'/'\\\\''/g")'"; shift ;;
    esac
done
case $runs in ''|*[!0-9]*|0) echo "gpt2_gpu.sh: --runs needs a positive integer" >&2; exit 2 ;; esac
case $nproc in ''|*[!0-9]*|0) echo "gpt2_gpu.sh: --nproc needs a positive integer" >&2; exit 2 ;; esac

find_prog() { # $1: variable's value, $2: path relative to the build tree
    if [ -n "$1" ]; then echo "$1"; return; fi
    for c in "./$2" "$here/$(basename "$2")" "$here/../$2"; do
        [ -x "$c" ] && { echo "$c"; return; }
    done
}
cbench=$(find_prog "${BENCH_GPT_GPU:-}" bench/bench_gpt_gpu)
fsdprun=$(find_prog "${FSDPRUN:-}" tools/fsdprun)
if [ -z "$cbench" ] || [ ! -x "$cbench" ]; then
    echo "gpt2_gpu.sh: bench_gpt_gpu not found${cbench:+ at $cbench} (it is built only with --with-cuda and --with-nccl; set BENCH_GPT_GPU)" >&2
    exit 2
fi
if [ "$nproc" -gt 1 ] && [ -z "$fsdprun" ]; then
    echo "gpt2_gpu.sh: tools/fsdprun not found for --nproc $nproc (set FSDPRUN)" >&2
    exit 2
fi
python=${PYTHON:-python3}
torchrun=${TORCHRUN:-"$python -m torch.distributed.run"}
have_torch=1
"$python" -c 'import torch, torch.distributed.fsdp' >/dev/null 2>&1 || have_torch=0
[ "$have_torch" = 1 ] || echo "gpt2_gpu.sh: no PyTorch for $python; libfsdp's numbers alone" >&2

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
        eval "\"\$python\" \"\$here/gpt2_torch_fsdp.py\" \"\$@\" $args"
    fi
}
# field FILE PATTERN: the number after the last ':' or the first number after PATTERN's text
val() { sed -n "s/^$2[^0-9]*\\([0-9][0-9.]*\\).*/\\1/p" "$1" | tail -n 1; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "" || b + 0 == 0) print "n/a"; else printf "%.3f", a / b }'; }
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print "n/a"; else if (NR % 2) print v[(NR + 1) / 2]; else printf "%.3f", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

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
         "$(grep -v n/a "$tmp/tok" | median) (target >= 1.0), allocator peak memory" \
         "$(grep -v n/a "$tmp/mem" | median), GPU used memory $(grep -v n/a "$tmp/used" | median)"
fi
exit $status
