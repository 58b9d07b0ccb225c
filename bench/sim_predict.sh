#!/bin/sh
# SPDX-License-Identifier: MIT
# sim_predict.sh: fsdp-sim's prediction of fsdp-train's step on this machine, beside the step.
#
#   bench/sim_predict.sh [--steps N] [--runs N] [--worlds "1 2 4"] [--quick]
#
# For each backend (sim threads, and Gloo processes under tools/fsdprun when fsdp-train has
# Gloo) and each world size, trains fsdp-train's default model (tiny: 4 layers, width 128,
# 16 rows of 64 tokens a step, FULL_SHARD, f32, backward prefetch, clipping at 1) for N steps
# (default 30) and takes the median step time of steps 6 to N; then runs
# `fsdp-sim --cluster cpu --backend B` on the same configuration --runs times (default 3: the
# calibration is a measurement and varies; for Gloo at world N > 1 under `fsdprun -n N`, so that
# processes time the collectives, as they run in fsdp-train) and takes the median predicted
# step. The table gives both, the predicted one's range over the runs, and the gap (predicted /
# measured - 1).
# docs/simulation.md explains the model and the gaps.
#
# Run it on a quiet machine: every figure is a wall-clock time of this CPU. Environment:
# FSDP_TRAIN, FSDP_SIM, FSDPRUN (default: next to each other in the build tree's tools/).
# --quick: 8 steps, 1 run, world sizes 1 and 2 (a smoke test of the script).
set -u
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib.sh"
steps=30
runs=3
worlds="1 2 4"
while [ $# -gt 0 ]; do
    case $1 in
    --steps) steps=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --worlds) worlds=$2; shift 2 ;;
    --quick) steps=8; runs=1; worlds="1 2"; shift ;;
    --help|-h) bench_help ;;
    *) echo "sim_predict.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
case $steps in ''|*[!0-9]*|[0-7]) echo "sim_predict.sh: --steps must be an integer >= 8" >&2; exit 2 ;; esac
case $runs in ''|*[!0-9]*|0) echo "sim_predict.sh: --runs must be a positive integer" >&2; exit 2 ;; esac

train=$(find_tool fsdp-train "${FSDP_TRAIN:-}")
sim=$(find_tool fsdp-sim "${FSDP_SIM:-}")
fsdprun=$(find_tool fsdprun "${FSDPRUN:-}")
[ -n "$train" ] && [ -n "$sim" ] ||
    { echo "sim_predict.sh: fsdp-train or fsdp-sim not found (build them, or set FSDP_TRAIN and FSDP_SIM)" >&2; exit 2; }
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT

# The median of the numbers on stdin (one per line).
median() {
    sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) { print "nan"; exit }
        print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

common="--steps $steps --val-every 0 --val-steps 1 --sample-tokens 0 --quiet"
backends=sim
if [ -n "$fsdprun" ] && "$train" --version 2>/dev/null | grep -q 'backends:.*gloo'; then
    backends="sim gloo"
fi
status=0
echo "| backend | world | rows per rank | measured ms | predicted ms (range) | gap |"
echo "|---|---|---|---|---|---|"
for b in $backends; do
    for w in $worlds; do
        m="$tmp/m.jsonl"
        rm -f "$m"
        if [ "$b" = sim ]; then
            # shellcheck disable=SC2086
            "$train" $common --world-size "$w" --metrics "$m" > "$tmp/out" 2>&1
        else
            # shellcheck disable=SC2086
            "$fsdprun" -n "$w" "$train" --backend gloo $common --metrics "$m" > "$tmp/out" 2>&1
        fi
        st=$?
        if [ $st -ne 0 ] || [ ! -s "$m" ]; then
            echo "| $b | $w | | failed (exit $st) | | |"
            tail -5 "$tmp/out" >&2
            status=1
            continue
        fi
        measured=$(grep '"type":"train"' "$m" | tail -n +6 |
            sed -e 's/.*"step_s":\([^,]*\).*/\1/' | median)
        rows=$((16 / w))
        : > "$tmp/pred"
        i=0
        # Gloo's ranks are processes: fsdp-sim times its collectives between as many of them,
        # started the same way (a world of threads switches faster on shared cores).
        launch=
        [ "$b" = gloo ] && [ "$w" -gt 1 ] && launch="$fsdprun -n $w --no-prefix"
        while [ $i -lt "$runs" ]; do
            # shellcheck disable=SC2086 # the launcher and its options, when there is one
            $launch "$sim" --model tiny --cluster cpu --backend "$b" --gpus "$w" --batch "$rows" \
                --precision fp32 --grad-clip 1 --json > "$tmp/sim" 2> "$tmp/err" ||
                { cat "$tmp/err" >&2; status=1; }
            sed -e 's/.*"step_s":\([^,]*\).*/\1/' "$tmp/sim" >> "$tmp/pred"
            i=$((i + 1))
        done
        pred=$(median < "$tmp/pred")
        lo=$(sort -g "$tmp/pred" | head -1)
        hi=$(sort -g "$tmp/pred" | tail -1)
        awk -v b="$b" -v w="$w" -v r="$rows" -v m="$measured" -v p="$pred" -v lo="$lo" -v hi="$hi" \
            'BEGIN { printf "| %s | %d | %d | %.1f | %.1f (%.1f to %.1f) | %+.0f%% |\n",
                     b, w, r, 1e3 * m, 1e3 * p, 1e3 * lo, 1e3 * hi, 100 * (p / m - 1) }'
    done
done
exit $status
