#!/bin/sh
# SPDX-License-Identifier: MIT
# cpu_floor.sh: how much processor time distribution adds to a step, and the step it allows.
#
#   bench/cpu_floor.sh [--batches "1 2 4 8"] [--vocabs "256 8192"] [--steps N] [--rounds N]
#                      [--quick] [fsdp-train model options...]
#
# Wall-clock ratios on a shared two-core machine move by 20% between runs; processor time
# moves much less, and it bounds what any schedule can reach. For every vocabulary and batch
# per rank B it runs fsdp-train (one compute thread a rank, FULL_SHARD, the default job's GPT
# unless model options say otherwise) three ways:
#   1 rank   --world-size 1 on the sim backend: the baseline;
#   sim      --world-size 2 on the sim backend (two ranks as threads of one process);
#   gloo     fsdprun -n 2 --backend gloo (two processes, shared memory and cross-memory attach);
# each twice, with S and 3S steps (--steps S, default 10), and takes the difference, so that
# start-up, loading and the last evaluation drop out: per step, the wall time and the user and
# system time of the whole process tree (/usr/bin/time; fsdprun waits for its ranks, so their
# time is counted). It prints, per point:
#   CPU x 1 rank   the 2-rank run's processor time a step over twice the 1-rank run's: what
#                  distribution costs in work (copies, reductions, synchronisation, spinning);
#   comm           a rank's communication thread (fsdp-comm<r>) alone, ms a step: its share of
#                  the ranks' threads' time, sampled from /proc during the longer run;
#   floor          that time spread over the machine's cores (at most 2 per rank), over the
#                  1-rank step: no schedule of this work can take fewer wall seconds, so a
#                  target of the 2-rank step below this is out of reach on this machine;
#   wall x 1 rank  what the step took, two ways: the wall time of the difference (all the
#                  process does a step: the step, the metrics' collectives, the logging) and
#                  the median step fsdp-train reports in its --metrics (step_s; the steps
#                  after the first two of the longer run), which one slow second of the
#                  machine moves less.
# --rounds N (default 1) takes the median of N such differences. --quick: the tiny model,
# B = 1, vocabulary 256, 2 and 6 steps (a smoke test of the script).
#
# Environment: FSDP_TRAIN, FSDPRUN (default: the build tree's tools/), TIME (default
# /usr/bin/time, GNU time).
set -u
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib.sh"
batches="1 2 4 8"
vocabs="256 8192"
steps=10
rounds=1
model="--n-layer 6 --n-embd 384 --n-head 6 --block-size 128 --seq-len 128"
extra=
while [ $# -gt 0 ]; do
    case $1 in
    --batches) batches=$2; shift 2 ;;
    --vocabs) vocabs=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --quick) model="--n-layer 2 --n-embd 64 --n-head 4 --block-size 32 --seq-len 32"
        batches=1; vocabs=256; steps=2; shift ;;
    --n-layer|--n-embd|--n-head|--block-size|--seq-len) extra="$extra $1 $2"; shift 2 ;;
    --help|-h) bench_help ;;
    *) echo "cpu_floor.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
    esac
done
for v in "$steps" "$rounds"; do
    case $v in ''|*[!0-9]*|0) echo "cpu_floor.sh: --steps and --rounds need positive integers" >&2; exit 2 ;; esac
done
model="$model$extra"
train=$(bench_find_prog "${FSDP_TRAIN:-}" tools/fsdp-train)
fsdprun=$(bench_find_prog "${FSDPRUN:-}" tools/fsdprun)
timer=${TIME:-/usr/bin/time}
if [ -z "$train" ] || [ -z "$fsdprun" ]; then
    echo "cpu_floor.sh: tools/fsdp-train and tools/fsdprun not found (run it in the build tree)" >&2
    exit 2
fi
if ! "$timer" -f %U true > /dev/null 2>&1; then
    echo "cpu_floor.sh: $timer is not GNU time (Debian's package time)" >&2
    exit 2
fi
"$train" --backend gloo --world-size 1 --steps 0 --val-steps 1 --sample-tokens 0 --quiet \
    $model --vocab-size 256 > /dev/null 2>&1 && have_gloo=1 || have_gloo=0
cores=$(bench_cores)
ncores=$((cores < 2 ? cores : 2))
long=$((3 * steps))
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT INT TERM
export FSDP_NUM_THREADS=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

# descendants PID: PID's descendant processes (not PID itself).
descendants() {
    ps -e -o pid= -o ppid= | awk -v root="$1" '{ up[$1] = $2 }
        END { for (p in up) { q = p; while (q in up && q != root) q = up[q]; if (q == root && p != root) print p } }'
}

# threads_cpu ROOT PID...: one line per thread of the processes PID: "role ticks", where role
# is comm for the communication workers (fsdp-comm<r>), compute for the ranks' threads
# (fsdp-rank<r> of a sim run, the main thread of a Gloo rank's process), other for the rest,
# and ticks its user + system time so far; sets _cnt to the number of lines. Shell builtins
# only: the sampler runs beside the ranks on the same two cores, and the processes it would
# start (a cat, a sed and an awk a thread, twice a second) took processor time from the
# two-rank runs, whose cores are all busy, and not from the one-rank run, which leaves a core
# idle: the wall ratios came out high. ROOT is the timed process (time itself).
threads_cpu() {
    _root=$1
    shift
    _cnt=0
    for _p in "$@"; do
        for _t in /proc/"$_p"/task/*; do
            read -r _c 2> /dev/null < "$_t/comm" || continue
            read -r _st 2> /dev/null < "$_t/stat" || continue
            _st=${_st##*) }
            case $_c in
            fsdp-comm*) _r=comm ;;
            fsdp-rank*) _r=compute ;;
            *) if [ "${_t##*/}" = "$_p" ] && [ "$_p" != "$_root" ]; then _r=compute; else _r=other; fi ;;
            esac
            # shellcheck disable=SC2086 # the fields of stat, split on purpose
            set -- $_st
            echo "$_r $((${12} + ${13}))"
            _cnt=$((_cnt + 1))
        done
    done
}

# timed OUT STEPS CMD...: runs CMD with --steps STEPS and appends "wall user sys" to OUT. For
# the longer run it also samples the threads twice a second and appends to OUT.share the
# communication workers' share of the threads' time between the first sample after the
# shorter run's wall time (past the start-up) and the last one. The processes are listed once,
# at the first sample (the ranks are up by then).
timed() {
    _out=$1 _s=$2
    shift 2
    "$timer" -f "%e %U %S" -o "$tmp/t" "$@" --steps "$_s" > "$tmp/log" 2>&1 &
    _pid=$!
    _t0=$(date +%s.%N)
    _from=$(awk 'NR == 1 { print $1 }' "$_out" 2>/dev/null)
    _pids='' _nfirst='' _k=0
    : > "$tmp/first"
    : > "$tmp/last"
    while kill -0 "$_pid" 2>/dev/null; do
        sleep 0.5
        [ -n "$_from" ] || continue
        if [ -z "$_nfirst" ]; then
            awk -v a="$_t0" -v b="$(date +%s.%N)" -v f="$_from" 'BEGIN { exit !(b - a > f) }' ||
                continue
            _pids=$(descendants "$_pid")
            # shellcheck disable=SC2086 # a list of process ids
            threads_cpu "$_pid" $_pids > "$tmp/first"
            [ "$_cnt" -gt 0 ] || continue
            _nfirst=$_cnt
            cp "$tmp/first" "$tmp/last"
            continue
        fi
        # Alternate two files; keep the sample only while every thread of the first still
        # runs (not in the ranks' exit).
        _k=$((1 - _k))
        # shellcheck disable=SC2086
        threads_cpu "$_pid" $_pids > "$tmp/snap$_k"
        [ "$_cnt" = "$_nfirst" ] && _last=$tmp/snap$_k
    done
    if ! wait "$_pid"; then
        echo "cpu_floor.sh: failed: $*" >&2
        tail -5 "$tmp/log" >&2
        exit 1
    fi
    [ -n "${_last:-}" ] && cp "$_last" "$tmp/last"
    _last=
    if [ -n "$_nfirst" ]; then
        awk 'FNR == NR { a[$1] += $2; next } { b[$1] += $2 }
            END { c = b["comm"] - a["comm"]; t = c + b["compute"] - a["compute"]
                  printf "%.4f\n", (t > 0 ? c / t : 0) }' "$tmp/first" "$tmp/last" >> "$_out.share"
    fi
    tail -n 1 "$tmp/t" >> "$_out"
}

# per_step NAME CMD...: one round of NAME's two runs; appends to $tmp/NAME.d the per-step
# wall, user and system milliseconds of the difference, the communication share, and the
# median of the step times fsdp-train itself reports (--metrics: step_s, the slowest rank's,
# from the zeroing of the gradients to the end of the optimizer step) over the longer run's
# steps after the first two.
per_step() {
    _n=$1
    shift
    rm -f "$tmp/$_n.ab" "$tmp/$_n.ab.share" "$tmp/m0.jsonl" "$tmp/m.jsonl"
    # Both runs write their metrics, so that the difference holds the same work a step.
    timed "$tmp/$_n.ab" "$steps" "$@" --metrics "$tmp/m0.jsonl"
    timed "$tmp/$_n.ab" "$long" "$@" --metrics "$tmp/m.jsonl"
    _sh=$(cat "$tmp/$_n.ab.share" 2>/dev/null)
    _st=$(sed -n 's/.*"type":"train".*"step_s":\([0-9.e+-]*\).*/\1/p' "$tmp/m.jsonl" 2>/dev/null |
        tail -n +3 | bench_median 0 %.6f)
    awk -v d=$((long - steps)) -v sh="${_sh:-0}" -v st="$_st" 'NR == 1 { w = $1; u = $2; s = $3 }
        NR == 2 { printf "%.2f %.2f %.2f %.4f %.2f\n", ($1 - w) * 1e3 / d, ($2 - u) * 1e3 / d,
                  ($3 - s) * 1e3 / d, sh, st * 1e3 }' \
        "$tmp/$_n.ab" >> "$tmp/$_n.d"
}

# col NAME K: the median over the rounds of column K of NAME's differences.
col() { awk -v k="$2" '{ print $k }' "$tmp/$1.d" | bench_median; }

echo "# cpu_floor.sh: fsdp-train FULL_SHARD, one thread a rank, $steps and $long steps, median of $rounds round(s); $cores cores; OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-auto}; load average $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)"
echo "| vocab | B | 1 rank ms (CPU) | 1 rank step | sim ms (x) | sim step (x) | sim CPU ms (x) | sim sys | sim comm | sim floor | gloo ms (x) | gloo step (x) | gloo CPU ms (x) | gloo sys | gloo comm | gloo floor |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
for v in $vocabs; do
    for b in $batches; do
        common="$model --vocab-size $v --val-every 0 --val-steps 1 --sample-tokens 0 --quiet"
        rm -f "$tmp"/*.d
        r=0
        while [ $r -lt "$rounds" ]; do
            per_step one "$train" $common --world-size 1 --batch-size "$b"
            per_step sim "$train" $common --world-size 2 --batch-size $((2 * b))
            [ "$have_gloo" = 1 ] && per_step gloo "$fsdprun" -n 2 "$train" --backend gloo \
                $common --batch-size $((2 * b))
            r=$((r + 1))
        done
        w1=$(col one 1)
        s1=$(col one 5)
        c1=$(awk -v u="$(col one 2)" -v s="$(col one 3)" 'BEGIN { printf "%.2f", u + s }')
        row="| $v | $b | $w1 ($c1) | $s1"
        for n in sim gloo; do
            if [ ! -f "$tmp/$n.d" ]; then
                row="$row | - | - | - | - | - | -"
                continue
            fi
            row="$row |$(awk -v w="$(col $n 1)" -v u="$(col $n 2)" -v s="$(col $n 3)" \
                -v sh="$(col $n 4)" -v st="$(col $n 5)" -v w1="$w1" -v c1="$c1" -v s1="$s1" \
                -v nc="$ncores" 'BEGIN {
                    c = u + s
                    if (w1 <= 0 || c1 <= 0 || s1 <= 0) {
                        printf " %.1f | %.1f | %.1f | %.1f | - | -", w, st, c, s; exit
                    }
                    f = c / nc / w1; if (f < 1) f = 1
                    printf " %.1f (%.2f) | %.1f (%.2f) | %.1f (%.2f) | %.1f | %.1f | %.2f", w,
                        w / w1, st, st / s1, c, c / (2 * c1), s, sh * c / 2, f }')"
        done
        echo "$row |"
    done
done
echo "# ms: the wall time a step from the difference of the two runs; step: the median step fsdp-train reports (--metrics step_s), (x) over the 1-rank run's"
echo "# CPU (x): the 2-rank run's user + system time a step over twice the 1-rank run's; comm: a rank's communication worker's share of it, ms a step (the threads sampled during the longer run); floor: the 2-rank time over $ncores cores, over the 1-rank step (the least the 2-rank step can take, in 1-rank steps)"
