#!/bin/sh
# SPDX-License-Identifier: MIT
# overhead_sweep.sh: what distribution costs at every batch per rank, as one table.
#
#   bench/overhead_sweep.sh [--batches "1 2 4 8"] [--vocabs "256 8192"] [--steps N]
#                           [--warmup N] [--rounds N] [--gemm] [--quick] [model options...]
#
# For every vocabulary and batch per rank B, one compute thread per rank, the same GPT (the
# benchmarks' default: 6 blocks, d_model 384, 6 heads, sequence 128; --layers, --d, --heads and
# --seq go to every program), it runs back to back:
#   1 rank     bench_gpt_step --batch B --threads 1: the step of one rank alone, no FSDP;
#   sim        bench_fsdp_step --only main --rounds 1: FULL_SHARD and NO_SHARD on 2 sim ranks
#              (threads of one process);
#   gloo       bench_gpt_gloo under fsdprun -n 2: FULL_SHARD, then NO_SHARD (--strategy);
#   torch      gpt_gloo_torch.py --nproc 2: PyTorch DDP over gloo (skipped without torch).
# and prints the median step of each, with the ratios the targets are about: the 2-rank step
# over the 1-rank step at the same B (distribution's overhead; target <= 1.25), libfsdp's
# FULL_SHARD over gloo against PyTorch DDP (step, target <= 0.7; peak RSS, target <= 0.5), and
# FULL_SHARD over NO_SHARD on gloo (target <= 1.15). Every figure is wall-clock time on this
# machine: run it on a quiet one (the load average is printed first).
#
# --rounds N (default 1) runs the five programs of every point N times in turn and prints the
# median of their N medians (and of the peak RSS): on a machine whose speed moves between runs
# of a few seconds (a shared virtual machine), one round can put the same point 20% apart.
#
# --gemm adds a second table: how much of each step the matrix products take. The 1-rank, Gloo
# FULL_SHARD and PyTorch DDP runs go under the preloaded bench/.libs/libgemmclock.so
# (gemm_clock.c: the wall time, FLOPs and calls of every sgemm, per process), and run a second
# time with twice the timed steps; the difference between the two is a rank's products in
# --steps steady-state steps. For each: GEMM ms a step and its GFLOP/s, the rest of the step
# (median step less the products), and the Gloo step's products as a share of DDP's step: what
# the 0.7 target leaves for everything that is not a product.
#
# Environment: BENCH_GPT_STEP, BENCH_FSDP_STEP, BENCH_GPT_GLOO, FSDPRUN (default: the build tree,
# as the other scripts find them), PYTHON (the interpreter with torch). --quick: the benchmarks'
# tiny model, batches 1 and 2, vocabulary 256, 2 steps (a smoke test of the script).
# GEMM_CLOCK_LIB: the preload (default: .libs/libgemmclock.so beside bench_gpt_step).
set -u
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib.sh"
batches="1 2 4 8"
vocabs="256 8192"
steps=5
warmup=2
rounds=1
model=
quick=
gemm=0
while [ $# -gt 0 ]; do
    case $1 in
    --batches) batches=$2; shift 2 ;;
    --vocabs) vocabs=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --gemm) gemm=1; shift ;;
    --quick) quick=--quick; batches="1 2"; vocabs=256; steps=2; warmup=1; shift ;;
    --layers|--d|--heads|--seq) model="$model $1 $2"; shift 2 ;;
    --help|-h) bench_help ;;
    *) echo "overhead_sweep.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
    esac
done
for v in "$steps" "$warmup" "$rounds"; do
    case $v in ''|*[!0-9]*|0) echo "overhead_sweep.sh: --steps, --warmup and --rounds must be positive integers" >&2; exit 2 ;; esac
done

step=$(bench_find_prog "${BENCH_GPT_STEP:-}" bench/bench_gpt_step)
fsdp=$(bench_find_prog "${BENCH_FSDP_STEP:-}" bench/bench_fsdp_step)
gloo=$(bench_find_prog "${BENCH_GPT_GLOO:-}" bench/bench_gpt_gloo)
fsdprun=$(bench_find_prog "${FSDPRUN:-}" tools/fsdprun)
for p in "$step" "$fsdp" "$gloo" "$fsdprun"; do
    [ -n "$p" ] && [ -x "$p" ] || {
        echo "overhead_sweep.sh: a benchmark is missing (make bench/bench_gpt_step" \
            "bench/bench_fsdp_step bench/bench_gpt_gloo tools/fsdprun in a build with Gloo)" >&2
        exit 1
    }
done
if [ -z "${OPENBLAS_CORETYPE+set}" ] &&
    [ "$(OPENBLAS_VERBOSE=2 "$step" --help 2>&1 | sed -n 's/^Core: //p' | head -n 1)" = Prescott ]; then
    if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then export OPENBLAS_CORETYPE=SkylakeX
    elif grep -qw avx2 /proc/cpuinfo 2>/dev/null; then export OPENBLAS_CORETYPE=Haswell
    fi
fi
bench_torch overhead_sweep.sh
clock_lib=
if [ "$gemm" = 1 ]; then
    clock_lib=${GEMM_CLOCK_LIB:-$(dirname "$step")/.libs/libgemmclock.so}
    [ -f "$clock_lib" ] || {
        echo "overhead_sweep.sh: --gemm needs $clock_lib (make bench/libgemmclock.la)" >&2
        exit 1
    }
    case $clock_lib in /*) ;; *) clock_lib=$(pwd)/$clock_lib ;; esac
fi
export FSDP_NUM_THREADS=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT INT TERM

median_of() { bench_step_median "$1" | head -n 1; }
rss_of() { sed -n 's/^peak RSS MiB max \([0-9.]*\).*/\1/p' "$1" | head -n 1; }
row_of() { awk -v c="$2" '$1 == "FSDP" && $2 == c { print $3; exit }' "$1"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "" || b == 0) print "n/a"; else printf "%.2f", a / b }'; }
# run NAME FILE COMMAND...: runs the command into FILE; on failure, says so and marks status.
# With --gemm and GEMM_DIR set, the command runs under the clock, its records in GEMM_DIR.
run() {
    _name=$1 _out=$2
    shift 2
    if [ -n "${GEMM_DIR:-}" ]; then
        rm -rf "$GEMM_DIR" && mkdir -p "$GEMM_DIR"
        set -- env GEMM_CLOCK_DIR="$GEMM_DIR" LD_PRELOAD="$clock_lib" "$@"
    fi
    if ! "$@" > "$_out" 2>&1; then
        echo "overhead_sweep.sh: $_name failed:" >&2
        tail -5 "$_out" >&2
        status=1
    fi
}

# gemm_of SHORT LONG: a rank's products in --steps steps, from the clock's records of two runs
# (one record per process that multiplied; the ranks are averaged): "ms GFLOP", or nothing.
# gemm_sum DIR: "processes seconds GFLOP", summed over the records in DIR.
gemm_sum() {
    cat "$1"/gemm.* 2>/dev/null | awk '$1 == "seconds" { s += $2; n++ } $1 == "gflop" { f += $2 }
        END { printf "%d %.9f %.6f\n", n, s, f }'
}
gemm_of() {
    gemm_sum "$1" > "$tmp/g1"
    gemm_sum "$2" > "$tmp/g2"
    awk -v steps="$steps" 'NR == 1 { n1 = $1; s1 = $2; f1 = $3 } NR == 2 { n2 = $1; s2 = $2; f2 = $3 }
        END { if (n1 > 0 && n1 == n2 && s2 > s1)
                  printf "%.1f %.2f\n", (s2 - s1) / n1 / steps * 1e3, (f2 - f1) / n1 / steps }' \
        "$tmp/g1" "$tmp/g2"
}
# gemm_ms G: the milliseconds of gemm_of's G; gemm_cell G: "ms (GFLOP/s)", or n/a.
gemm_ms() { printf '%s' "$1" | cut -d' ' -f1; }
gemm_cell() {
    if [ -z "$1" ]; then printf 'n/a'
    else printf '%s\n' "$1" | awk '{ printf "%s (%.0f)", $1, ($1 > 0 ? $2 / $1 * 1e3 : 0) }'; fi
}
minus() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "") print "n/a"; else printf "%.1f", a - b }'; }
gemm_rows=

echo "# overhead_sweep.sh: one thread per rank, OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-(unset)}," \
    "$steps timed steps after $warmup, median of $rounds round(s); load average $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)"
echo "| vocab | B | 1 rank ms | sim FULL ms (x 1 rank) | gloo FULL ms (x 1 rank) | gloo NO_SHARD ms | FULL / NO_SHARD | torch DDP ms | FULL / DDP step | FULL / DDP RSS |"
echo "|---|---|---|---|---|---|---|---|---|---|"
status=0
for v in $vocabs; do
    for b in $batches; do
        base="$quick $model --batch $b --vocab $v --warmup $warmup"
        common="$base --steps $steps"
        rm -f "$tmp"/*.ms "$tmp"/*.rss
        round=1
        while [ "$round" -le "$rounds" ]; do
            [ "$gemm" = 1 ] && [ "$round" = 1 ] && GEMM_DIR=$tmp/one.g1
            # shellcheck disable=SC2086
            run bench_gpt_step "$tmp/one" "$step" $common --threads 1
            GEMM_DIR=
            # shellcheck disable=SC2086
            run bench_fsdp_step "$tmp/sim" "$fsdp" $common --only main --rounds 1
            [ "$gemm" = 1 ] && [ "$round" = 1 ] && GEMM_DIR=$tmp/full.g1
            # shellcheck disable=SC2086
            run "bench_gpt_gloo FULL_SHARD" "$tmp/full" "$fsdprun" --no-prefix -n 2 "$gloo" $common --threads 1
            GEMM_DIR=
            # shellcheck disable=SC2086
            run "bench_gpt_gloo NO_SHARD" "$tmp/noshard" "$fsdprun" --no-prefix -n 2 "$gloo" $common \
                --threads 1 --strategy no-shard
            if [ "$have_torch" = 1 ]; then
                [ "$gemm" = 1 ] && [ "$round" = 1 ] && GEMM_DIR=$tmp/torch.g1
                # shellcheck disable=SC2086
                run gpt_gloo_torch.py "$tmp/torch" "$py" "$here/gpt_gloo_torch.py" --nproc 2 $common --threads 1
                GEMM_DIR=
                median_of "$tmp/torch" >> "$tmp/torch.ms"
                rss_of "$tmp/torch" >> "$tmp/torch.rss"
            fi
            median_of "$tmp/one" >> "$tmp/one.ms"
            row_of "$tmp/sim" FULL_SHARD >> "$tmp/sim.ms"
            median_of "$tmp/full" >> "$tmp/full.ms"
            rss_of "$tmp/full" >> "$tmp/full.rss"
            median_of "$tmp/noshard" >> "$tmp/noshard.ms"
            round=$((round + 1))
        done
        one=$(bench_median < "$tmp/one.ms")
        sim=$(bench_median < "$tmp/sim.ms")
        full=$(bench_median < "$tmp/full.ms")
        full_rss=$(bench_median < "$tmp/full.rss")
        nos=$(bench_median < "$tmp/noshard.ms")
        t_ms='' t_rss=''
        if [ "$have_torch" = 1 ]; then
            t_ms=$(bench_median < "$tmp/torch.ms")
            t_rss=$(bench_median < "$tmp/torch.rss")
        fi
        if [ "$gemm" = 1 ]; then
            # The same three runs again with twice the steps (outputs discarded).
            long="$base --steps $((2 * steps))"
            GEMM_DIR=$tmp/one.g2
            # shellcheck disable=SC2086
            run "bench_gpt_step (clocked)" "$tmp/x" "$step" $long --threads 1
            GEMM_DIR=$tmp/full.g2
            # shellcheck disable=SC2086
            run "bench_gpt_gloo FULL_SHARD (clocked)" "$tmp/x" "$fsdprun" --no-prefix -n 2 "$gloo" $long --threads 1
            gt=
            if [ "$have_torch" = 1 ]; then
                GEMM_DIR=$tmp/torch.g2
                # shellcheck disable=SC2086
                run "gpt_gloo_torch.py (clocked)" "$tmp/x" "$py" "$here/gpt_gloo_torch.py" --nproc 2 $long --threads 1
                gt=$(gemm_of "$tmp/torch.g1" "$tmp/torch.g2")
            fi
            GEMM_DIR=
            go=$(gemm_of "$tmp/one.g1" "$tmp/one.g2")
            gf=$(gemm_of "$tmp/full.g1" "$tmp/full.g2")
            gflop=$(printf '%s' "$go" | cut -d' ' -f2)
            gemm_rows="$gemm_rows| $v | $b | ${gflop:-n/a} | $(gemm_cell "$go") | $(minus "$one" "$(gemm_ms "$go")") | $(gemm_cell "$gf") | $(minus "$full" "$(gemm_ms "$gf")") | $(gemm_cell "$gt") | $(minus "$t_ms" "$(gemm_ms "$gt")") | $(ratio "$(gemm_ms "$gf")" "$t_ms") |
"
        fi
        echo "| $v | $b | ${one:-n/a} | ${sim:-n/a} ($(ratio "$sim" "$one")) | ${full:-n/a} ($(ratio "$full" "$one")) | ${nos:-n/a} | $(ratio "$full" "$nos") | ${t_ms:-n/a} | $(ratio "$full" "$t_ms") | $(ratio "$full_rss" "$t_rss") |"
    done
done
echo "# targets: 2 ranks <= 1.25 x 1 rank; FULL / NO_SHARD <= 1.15; FULL / DDP step <= 0.7, RSS <= 0.5"
if [ "$gemm" = 1 ]; then
    echo
    echo "# the matrix products (sgemm) of a rank's step: ms (GFLOP/s), and the rest of the step"
    echo "| vocab | B | GFLOP a rank-step | 1 rank GEMM ms | 1 rank rest ms | gloo FULL GEMM ms | gloo FULL rest ms | torch DDP GEMM ms | torch DDP rest ms | gloo FULL GEMM / DDP step |"
    echo "|---|---|---|---|---|---|---|---|---|---|"
    printf '%s' "$gemm_rows"
fi
exit $status
