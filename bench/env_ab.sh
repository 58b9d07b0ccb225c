#!/bin/sh
# SPDX-License-Identifier: MIT
# env_ab.sh: one rank's GPT step with and without an environment switch, in alternating runs.
#
#   bench/env_ab.sh [--base VAR=VALUE] [--rounds N] [--batches "1 2 4 8"]
#                   [--vocabs "256 8192"] [--steps N] [--threads N] [model options...]
#
# For every vocabulary and batch B it runs bench_gpt_step (one rank, no FSDP, --threads 1 by
# default) --rounds times as it is and --rounds times with VAR=VALUE in its environment (the
# baseline; default FSDP_FUSED_ATTENTION=0, the composed attention), alternating the two so
# that a machine that drifts during the sweep drifts for both, and prints per point the
# median over the rounds of each run's median step, and current / baseline. A switch that
# changes no bits must also leave the losses alone: the script says whether the two printed
# the same losses. Model options (--layers, --d, --heads, --seq) go to every run.
#
# Environment: BENCH_GPT_STEP (default: the build tree's bench/bench_gpt_step).
set -u
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib.sh"
base=FSDP_FUSED_ATTENTION=0
rounds=5
batches="1 2 4 8"
vocabs="256 8192"
steps=10
threads=1
model=
while [ $# -gt 0 ]; do
    case $1 in
    --base) base=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --batches) batches=$2; shift 2 ;;
    --vocabs) vocabs=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --layers|--d|--heads|--seq) model="$model $1 $2"; shift 2 ;;
    --help|-h) bench_help ;;
    *) echo "env_ab.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
    esac
done
case $base in [A-Za-z_]*=*) ;; *) echo "env_ab.sh: --base must be VAR=VALUE, not '$base'" >&2; exit 2 ;; esac
for v in "$rounds" "$steps" "$threads"; do
    case $v in ''|*[!0-9]*|0) echo "env_ab.sh: --rounds, --steps and --threads must be positive integers" >&2; exit 2 ;; esac
done
step=$(bench_find_prog "${BENCH_GPT_STEP:-}" bench/bench_gpt_step)
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
echo "# env_ab.sh: baseline $base, $rounds rounds of $steps steps, --threads $threads; load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "| vocab | B | baseline ms | current ms | current / baseline | same losses |"
echo "|---|---|---|---|---|---|"
status=0
for v in $vocabs; do
    for b in $batches; do
        : > "$tmp/base.ms"
        : > "$tmp/cur.ms"
        for _ in $(seq "$rounds"); do
            # shellcheck disable=SC2086 # model options are split on purpose
            env "$base" "$step" --batch "$b" --vocab "$v" --steps "$steps" --threads "$threads" $model > "$tmp/base.out" 2>&1 || { echo "env_ab.sh: baseline run failed:" >&2; tail -n 5 "$tmp/base.out" >&2; exit 1; }
            # shellcheck disable=SC2086
            "$step" --batch "$b" --vocab "$v" --steps "$steps" --threads "$threads" $model > "$tmp/cur.out" 2>&1 || { echo "env_ab.sh: run failed:" >&2; tail -n 5 "$tmp/cur.out" >&2; exit 1; }
            bench_step_median "$tmp/base.out" >> "$tmp/base.ms"
            bench_step_median "$tmp/cur.out" >> "$tmp/cur.ms"
        done
        lb=$(sed -n 's/^step .* loss \([0-9.]*\) .*/\1/p' "$tmp/base.out" | tr '\n' ' ')
        lc=$(sed -n 's/^step .* loss \([0-9.]*\) .*/\1/p' "$tmp/cur.out" | tr '\n' ' ')
        same=no
        if [ -n "$lb" ] && [ "$lb" = "$lc" ]; then same=yes; else status=1; fi
        mb=$(bench_median - < "$tmp/base.ms")
        mc=$(bench_median - < "$tmp/cur.ms")
        ratio=$(awk -v a="$mc" -v b="$mb" 'BEGIN { if (b > 0) printf "%.3f", a / b; else print "-" }')
        echo "| $v | $b | $mb | $mc | $ratio | $same |"
    done
done
exit $status
