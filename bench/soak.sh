#!/bin/sh
# SPDX-License-Identifier: MIT
# soak.sh: a long run of fsdp-train, watched for resident memory that grows and descriptors that leak.
#
#   bench/soak.sh [--sim-steps N] [--gloo-steps N] [--every N] [--quick] [--keep DIR]
#
# Trains fsdp-train's default model for --sim-steps steps on the sim backend (default 20000:
# the ranks are threads of one process) and for --gloo-steps steps on two Gloo processes under
# tools/fsdprun (default 5000; skipped when fsdp-train has no Gloo), validation and the
# sample off. While a run goes, the script samples each process's resident set (VmRSS) and its
# open descriptors (/proc/PID/fd) every 0.2 s and keeps, for every multiple of --every steps
# (default 100), the first sample taken at or after it, reading the step from the --metrics
# file the run writes. After a warm-up (the first tenth of the steps, at least --every * 2) it fits
# a line to RSS against step and prints, per process:
#   - RSS at the end of the warm-up and at the end, in MiB;
#   - the slope in KiB per 1000 steps, and what that slope adds over the steps after the warm-up;
#   - the least and most descriptors after the warm-up.
# Verdict: `flat` when the fitted growth over the run after the warm-up is under 1 MiB and under
# 1% of the RSS, and the descriptor count never changed; `GROWS` otherwise. The exit status is
# 1 when a run failed or a verdict is GROWS, 0 otherwise.
#
# Environment: FSDP_TRAIN, FSDPRUN (default: the build tree's tools/). --quick: 600 sim steps
# and 300 Gloo steps, sampled every 50 (a smoke test of the script). --keep DIR keeps the
# samples (DIR/<backend>.samples: step, pid, RSS KiB, descriptors) and the runs' output.
set -u
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib.sh"
sim_steps=20000
gloo_steps=5000
every=100
keep=
while [ $# -gt 0 ]; do
    case $1 in
    --sim-steps) sim_steps=$2; shift 2 ;;
    --gloo-steps) gloo_steps=$2; shift 2 ;;
    --every) every=$2; shift 2 ;;
    --keep) keep=$2; shift 2 ;;
    --quick) sim_steps=600; gloo_steps=300; every=50; shift ;;
    --help|-h) bench_help ;;
    *) echo "soak.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
for v in "$sim_steps" "$gloo_steps" "$every"; do
    case $v in ''|*[!0-9]*) echo "soak.sh: step counts must be non-negative integers" >&2; exit 2 ;; esac
done
[ "$every" -gt 0 ] || { echo "soak.sh: --every must be positive" >&2; exit 2; }

train=$(find_tool fsdp-train "${FSDP_TRAIN:-}")
fsdprun=$(find_tool fsdprun "${FSDPRUN:-}")
[ -n "$train" ] || { echo "soak.sh: fsdp-train not found (build it, or set FSDP_TRAIN)" >&2; exit 2; }
if [ -n "$keep" ]; then
    mkdir -p "$keep" || exit 2
    tmp=$keep
else
    tmp=$(mktemp -d) || exit 1
    trap 'rm -rf "$tmp"' EXIT
fi

# The step of the last train record in metrics file $1 (0 before the first).
last_step() {
    tail -n 4 "$1" 2>/dev/null | sed -n 's/.*"type":"train".*"step":\([0-9]*\).*/\1/p' | tail -n 1
}

# The processes to watch: the program itself (sim), or fsdprun's children (Gloo ranks).
watched() { # BACKEND PID
    if [ "$1" = sim ]; then echo "$2"; else pgrep -P "$2" 2>/dev/null; fi
}

# sample BACKEND PID METRICS OUT: appends "step pid rss_kib fds" lines to OUT until PID exits,
# one per process for the first poll at or after each multiple of $every.
sample() {
    _next=$every
    while kill -0 "$2" 2>/dev/null; do
        _s=$(last_step "$3")
        if [ -n "$_s" ] && [ "$_s" -ge "$_next" ]; then
            for _p in $(watched "$1" "$2"); do
                _rss=$(awk '/^VmRSS:/ { print $2 }' "/proc/$_p/status" 2>/dev/null)
                _fds=$(ls "/proc/$_p/fd" 2>/dev/null | wc -l)
                [ -n "$_rss" ] && echo "$_s $_p $_rss $_fds" >> "$4"
            done
            _next=$(( (_s / every + 1) * every ))
        fi
        sleep 0.2
    done
}

# Fits RSS against step after the warm-up, per process; prints one table row each.
report() { # BACKEND STEPS SAMPLES
    _warm=$(( $2 / 10 ))
    [ "$_warm" -lt $((every * 2)) ] && _warm=$((every * 2))
    awk -v b="$1" -v warm="$_warm" -v steps="$2" '
        $1 >= warm {
            p = $2; n[p]++; x = $1; y = $3
            sx[p] += x; sy[p] += y; sxx[p] += x * x; sxy[p] += x * y
            if (!(p in x0)) { x0[p] = x; y0[p] = y; f0[p] = $4; fmin[p] = $4; fmax[p] = $4 }
            x1[p] = x; y1[p] = y
            if ($4 < fmin[p]) fmin[p] = $4
            if ($4 > fmax[p]) fmax[p] = $4
        }
        END {
            bad = 0; rows = 0
            for (p in n) {
                rows++
                d = n[p] * sxx[p] - sx[p] * sx[p]
                slope = (n[p] > 2 && d > 0) ? (n[p] * sxy[p] - sx[p] * sy[p]) / d : 0
                growth = slope * (x1[p] - x0[p])
                ok = n[p] > 2 && growth < 1024 && growth < 0.01 * y1[p] && fmin[p] == fmax[p]
                if (!ok) bad = 1
                printf "| %s | %d | %d | %.1f | %.1f | %+.1f | %+.0f | %d..%d | %s |\n", b, p, n[p],
                    y0[p] / 1024, y1[p] / 1024, slope * 1000, growth, fmin[p], fmax[p],
                    (n[p] > 2 ? (ok ? "flat" : "GROWS") : "too few samples")
            }
            if (rows == 0) { printf "| %s | | 0 | | | | | | no samples after step %d |\n", b, warm; bad = 1 }
            exit bad
        }' "$3"
}

common="--val-every 0 --val-steps 1 --sample-tokens 0 --quiet"
status=0
echo "# soak: sampling every $every steps; load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "| backend | pid | samples | RSS after warm-up MiB | RSS at end MiB | KiB per 1000 steps | fitted growth KiB | descriptors | verdict |"
echo "|---|---|---|---|---|---|---|---|---|"
for b in sim gloo; do
    if [ "$b" = sim ]; then steps=$sim_steps; else steps=$gloo_steps; fi
    [ "$steps" -gt 0 ] || continue
    if [ "$b" = gloo ]; then
        if [ -z "$fsdprun" ] || ! "$train" --version 2>/dev/null | grep -qi gloo; then
            echo "| gloo | | | | | | | | skipped: no Gloo in fsdp-train or no fsdprun |"
            continue
        fi
    fi
    m="$tmp/$b.jsonl"
    out="$tmp/$b.samples"
    rm -f "$m" "$out"
    start=$(date +%s)
    if [ "$b" = sim ]; then
        # shellcheck disable=SC2086
        "$train" $common --steps "$steps" --metrics "$m" > "$tmp/$b.out" 2>&1 &
    else
        # shellcheck disable=SC2086
        "$fsdprun" -n 2 "$train" --backend gloo $common --steps "$steps" --metrics "$m" > "$tmp/$b.out" 2>&1 &
    fi
    pid=$!
    sample "$b" "$pid" "$m" "$out"
    wait "$pid"
    st=$?
    if [ $st -ne 0 ]; then
        echo "| $b | | | | | | | | run failed (exit $st) |"
        tail -5 "$tmp/$b.out" >&2
        status=1
        continue
    fi
    [ -f "$out" ] || : > "$out"
    report "$b" "$steps" "$out" || status=1
    echo "# $b: $steps steps in $(( $(date +%s) - start )) s"
done
exit $status
