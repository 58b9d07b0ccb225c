#!/bin/sh
# SPDX-License-Identifier: MIT
# train_table.sh: fsdp-train's throughput and memory, as a table.
#
#   bench/train_table.sh [--steps-tiny N] [--steps-10m N] [--quick]
#
# Trains two models with fsdp-train on the default corpus (bytes, vocabulary 256), FULL_SHARD:
#   tiny  the default model (4 layers, 4 heads, width 128, block 64; batch 16 x 64 tokens);
#   10M   6 layers, 6 heads, width 384, sequence 128 (10.7 M parameters; batch 16 x 128),
# each on sim world sizes 1, 2 and 4 (threads of one process) and on Gloo with 2 processes
# under tools/fsdprun (skipped when fsdp-train was built without Gloo). Each run writes
# --metrics; the table gives, per run, the median tokens per second over the steps after the
# first two (warm-up), the ratio of that to sim world 1 of the same model (the baseline, run by
# this script), and the largest per-rank peak of the memory libfsdp tracks (parameters,
# gradients, optimizer state, activations, communication buffers; mem_peak_bytes_per_rank, shown in MiB).
#
# Threads: fsdp-train's default, the online cores divided by the ranks of the process (so every
# run uses the whole machine), unless FSDP_NUM_THREADS is set.
#
# Environment: FSDP_TRAIN (default ./fsdp-train, then tools/fsdp-train), FSDPRUN (default
# tools/fsdprun). --quick: 4 and 3 steps (a smoke test of the script).
set -u
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib.sh"
steps_tiny=30
steps_10m=8
while [ $# -gt 0 ]; do
    case $1 in
    --steps-tiny) steps_tiny=$2; shift 2 ;;
    --steps-10m) steps_10m=$2; shift 2 ;;
    --quick) steps_tiny=4; steps_10m=3; shift ;;
    --help|-h) bench_help ;;
    *) echo "train_table.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
for v in "$steps_tiny" "$steps_10m"; do
    case $v in ''|*[!0-9]*|0|1|2) echo "train_table.sh: steps must be integers >= 3" >&2; exit 2 ;; esac
done

train=${FSDP_TRAIN:-}
if [ -z "$train" ]; then
    for c in ./fsdp-train ./tools/fsdp-train "$here/../fsdp-train" "$here/../tools/fsdp-train"; do
        if [ -x "$c" ]; then train=$c; break; fi
    done
fi
[ -n "$train" ] && [ -x "$train" ] || { echo "train_table.sh: fsdp-train not found (build it, or set FSDP_TRAIN)" >&2; exit 2; }
fsdprun=${FSDPRUN:-$(dirname "$train")/tools/fsdprun}
[ -x "$fsdprun" ] || fsdprun=$(dirname "$train")/fsdprun
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT

common="--val-every 0 --val-steps 1 --sample-tokens 0 --quiet --warmup 2"
tiny=""
m10="--n-layer 6 --n-head 6 --n-embd 384 --block-size 128 --seq-len 128"

# The median tokens/s after the first two steps and the largest per-rank peak MiB of a metrics
# file, as "tokens_per_s peak_mib".
summarize() {
    grep '"type":"train"' "$1" | tail -n +3 |
        sed -e 's/.*"tokens_per_s":\([^,]*\).*/\1/' | sort -g |
        awk '{ v[NR] = $1 } END { if (NR == 0) { print "nan"; exit } m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; print m }' > "$tmp/tps"
    grep '"type":"train"' "$1" | sed -e 's/.*"mem_peak_bytes_per_rank":\[\([^]]*\)\].*/\1/' |
        tr ',' '\n' | sort -g | tail -1 | awk '{ printf "%.1f\n", $1 / 1048576 }' > "$tmp/peak"
    echo "$(cat "$tmp/tps") $(cat "$tmp/peak")"
}

status=0
echo "| model | run | steps | tokens/s | vs sim W=1 | peak MiB per rank |"
echo "|---|---|---|---|---|---|"
for model in tiny 10M; do
    if [ $model = tiny ]; then flags=$tiny; steps=$steps_tiny; else flags=$m10; steps=$steps_10m; fi
    base=
    for run in "sim W=1" "sim W=2" "sim W=4" "gloo 2 procs"; do
        m="$tmp/m.jsonl"
        rm -f "$m"
        case $run in
        sim*)
            w=${run#sim W=}
            # shellcheck disable=SC2086
            "$train" $common $flags --steps "$steps" --world-size "$w" --metrics "$m" > "$tmp/out" 2>&1 ;;
        gloo*)
            if [ ! -x "$fsdprun" ] ||
                ! "$train" --version 2>/dev/null | grep -q 'backends:.*gloo'; then
                echo "| $model | $run | - | skipped: no Gloo | | |"
                continue
            fi
            # shellcheck disable=SC2086
            "$fsdprun" -n 2 "$train" --backend gloo $common $flags --steps "$steps" --metrics "$m" > "$tmp/out" 2>&1 ;;
        esac
        st=$?
        if [ $st -ne 0 ] || [ ! -s "$m" ]; then
            echo "| $model | $run | $steps | failed (exit $st) | | |"
            sed -e 's/^/#   /' "$tmp/out" | tail -5 >&2
            status=1
            continue
        fi
        set -- $(summarize "$m")
        tps=$1 peak=$2
        [ -z "$base" ] && base=$tps
        ratio=$(awk -v a="$tps" -v b="$base" 'BEGIN { printf "%.2f", a / b }')
        printf '| %s | %s | %s | %.0f | %s | %.1f |\n' "$model" "$run" "$steps" "$tps" "$ratio" "$peak"
    done
done
exit $status
