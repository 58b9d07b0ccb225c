#!/bin/sh
# SPDX-License-Identifier: MIT
# faults.sh: the fault table. Causes each fault of the trust and failure work, as an operator or
# another user of the host would, and prints what happened: how long until the job noticed,
# the exit status, and every line each rank and launcher printed.
#
#   bench/faults.sh [--quick] [--keep DIR]
#
# Run from the build tree (or set FSDP_TRAIN, FSDPRUN and STRANGER). Faults:
#   - a stranger (another user: nobody, as root only) races the Gloo listeners of a job;
#   - a rank killed with SIGKILL, on one node and across two nodes (fsdprun --nnodes 2);
#   - a rank stopped with SIGSTOP, under fsdp-train's default timeout (60 s; --quick: --timeout 5);
#   - a file store in a directory others can write, or behind a symbolic link;
#   - the TCP store with the wrong key;
#   - --data on a FIFO;
#   - a checkpoint step left by a killed save (only its staging directory), then --resume latest;
#   - a save that hits the file-size limit (RLIMIT_FSIZE);
#   - --export and --metrics to /dev/full;
#   - launcher settings: -n 100000, --backend nosuch, Gloo with no launcher, --steps 0.
# "detected" is the time from the fault to the end of the job (for a launch-time fault: from the
# start). The table is Markdown; each row's lines are the output, one per <br>, with the
# progress lines of a healthy run left out. Exit status 0 when every fault was caught as
# expected (the job fails where it must fail, and succeeds where the fault must be survived).
set -u
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib.sh"
quick=0
keep=
while [ $# -gt 0 ]; do
    case $1 in
    --quick) quick=1; shift ;;
    --keep) keep=$2; shift 2 ;;
    --help|-h) bench_help ;;
    *) echo "faults.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
train=$(find_tool fsdp-train "${FSDP_TRAIN:-}")
fsdprun=$(find_tool fsdprun "${FSDPRUN:-}")
stranger=${STRANGER:-$(dirname "${fsdprun:-.}")/../tests/stranger}
[ -n "$train" ] && [ -n "$fsdprun" ] || { echo "faults.sh: no fsdp-train or fsdprun (run from the build tree)" >&2; exit 2; }
tmp=$(mktemp -d) || exit 1
[ -n "$keep" ] && mkdir -p "$keep"
trap 'if [ -n "$keep" ]; then cp -r "$tmp"/. "$keep"/; fi; rm -rf "$tmp"' EXIT
has_gloo=0
"$train" --version 2> /dev/null | grep -q 'backends:.*gloo' && has_gloo=1
tiny="--n-layer 1 --n-embd 32 --n-head 2 --block-size 32 --seq-len 16 --batch-size 4 --val-every 0 --sample-tokens 0 --quiet"
bad=0

now_ms() { echo $(($(date +%s%N) / 1000000)); }
# wait_file FILE PID: until FILE is not empty (at most 120 s) or PID has ended.
wait_file() {
    _i=0
    while [ ! -s "$1" ] && [ $_i -lt 1200 ] && kill -0 "$2" 2> /dev/null; do
        sleep 0.1
        _i=$((_i + 1))
    done
}
# row FAULT MS STATUS EXPECT FILES...: one line of the table. EXPECT is "fail" or "ok": what the
# job's status must be for the fault to count as caught.
row() {
    _f=$1 _ms=$2 _st=$3 _want=$4
    shift 4
    _lines=$(cat "$@" 2> /dev/null | grep -v '^\s*$' | grep -v '^\[rank [0-9]*\] step ' |
        sed 's/|/\\|/g' | awk 'BEGIN { ORS = "" } { if (NR > 1) print "<br>"; print "`" $0 "`" }')
    [ -n "$_lines" ] || _lines="(nothing)"
    if [ "$_want" = fail ] && [ "$_st" = 0 ]; then bad=1; _st="$_st (NOT CAUGHT)"; fi
    if [ "$_want" = ok ] && [ "$_st" != 0 ]; then bad=1; _st="$_st (JOB LOST)"; fi
    printf '| %s | %s.%03d s | %s | %s |\n' "$_f" $((_ms / 1000)) $((_ms % 1000)) "$_st" "$_lines"
}
# timed NAME CMD...: runs CMD with its output in $tmp/NAME.out; sets st and ms.
timed() {
    _n=$1
    shift
    _t0=$(now_ms)
    "$@" > "$tmp/$_n.out" 2>&1
    st=$?
    ms=$(($(now_ms) - _t0))
}
# kill_rank NAME SIGNAL EXTRA_TRAIN_ARGS: a two-rank Gloo job on one node; rank 1 gets SIGNAL
# after rank 0's first step.
kill_rank() {
    _n=$1 _sig=$2
    shift 2
    rm -f "$tmp/pid" "$tmp/m.jsonl"
    # shellcheck disable=SC2016,SC2086
    "$fsdprun" -n 2 --grace 2 sh -c 'if [ "$RANK" = 1 ]; then echo $$ > "$0"; fi; exec "$@"' \
        "$tmp/pid" "$train" --backend gloo $tiny --steps 100000 --metrics "$tmp/m.jsonl" "$@" \
        > "$tmp/$_n.out" 2>&1 &
    _p=$!
    wait_file "$tmp/m.jsonl" $_p
    wait_file "$tmp/pid" $_p
    _t0=$(now_ms)
    [ -s "$tmp/pid" ] && kill "-$_sig" "$(cat "$tmp/pid")"
    wait $_p
    st=$?
    ms=$(($(now_ms) - _t0))
    [ -s "$tmp/pid" ] && kill -CONT "$(cat "$tmp/pid")" 2> /dev/null
}

echo "| fault | detected | exit | what the ranks and launchers printed |"
echo "|---|---|---|---|"

if [ $has_gloo = 1 ]; then
    # --- a stranger races the listeners -----------------------------------------------------
    if [ "$(id -u)" = 0 ] && [ -x "$stranger" ]; then
        # the stranger, as nobody, must reach its ready and stop files
        chmod 755 "$tmp"
        mkdir "$tmp/s" && chmod 1777 "$tmp/s"
        "$stranger" 120 "$tmp/s/ready" "$tmp/s/stop" > "$tmp/stranger.out" 2>&1 &
        sp=$!
        i=0
        while [ ! -e "$tmp/s/ready" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
        # shellcheck disable=SC2086
        timed race "$fsdprun" -n 2 --share-network "$train" --backend gloo $tiny --steps 2
        touch "$tmp/s/stop"
        wait $sp
        row "a stranger (user nobody) connects to every new loopback listener while two ranks start" \
            $ms $st ok "$tmp/race.out" "$tmp/stranger.out"
    fi
    # --- a rank killed, a rank stopped --------------------------------------------------------
    kill_rank kill9 KILL
    row "rank 1 killed (SIGKILL) during training, one node" $ms $st fail "$tmp/kill9.out"
    if [ $quick = 1 ]; then
        kill_rank stop STOP --timeout 5
        row "rank 1 stopped (SIGSTOP), --timeout 5" $ms $st fail "$tmp/stop.out"
    else
        kill_rank stop STOP
        row "rank 1 stopped (SIGSTOP), default timeout (60 s)" $ms $st fail "$tmp/stop.out"
    fi
    # --- across two nodes ---------------------------------------------------------------------
    mkdir -m 700 "$tmp/store"
    rm -f "$tmp/pid" "$tmp/m.jsonl"
    # shellcheck disable=SC2086
    "$fsdprun" -n 1 --nnodes 2 --node-rank 0 --store "file://$tmp/store" "$train" --backend gloo \
        $tiny --steps 100000 --metrics "$tmp/m.jsonl" > "$tmp/node0.out" 2>&1 &
    p0=$!
    # shellcheck disable=SC2016,SC2086
    "$fsdprun" -n 1 --nnodes 2 --node-rank 1 --store "file://$tmp/store" sh -c 'echo $$ > "$0"; exec "$@"' \
        "$tmp/pid" "$train" --backend gloo $tiny --steps 100000 > "$tmp/node1.out" 2>&1 &
    p1=$!
    wait_file "$tmp/m.jsonl" $p0
    wait_file "$tmp/pid" $p1
    t0=$(now_ms)
    [ -s "$tmp/pid" ] && kill -9 "$(cat "$tmp/pid")"
    wait $p0
    st=$?
    ms=$(($(now_ms) - t0))
    wait $p1
    sed 's/^/node 0: /' "$tmp/node0.out" > "$tmp/nodes.out"
    sed 's/^/node 1: /' "$tmp/node1.out" >> "$tmp/nodes.out"
    row "node 1's rank killed (SIGKILL), two fsdprun --nnodes 2 over a file store (node 0's status)" \
        $ms $st fail "$tmp/nodes.out"
fi

# --- stores that trust no one -------------------------------------------------------------------
if [ $has_gloo = 1 ]; then
    mkdir -m 777 "$tmp/open"
    chmod 777 "$tmp/open"
    # shellcheck disable=SC2086
    timed ww "$fsdprun" -n 2 --store "file://$tmp/open" "$train" --backend gloo $tiny --steps 2
    row "file store in a directory of mode 0777 (not sticky), as another user would leave it" $ms $st fail "$tmp/ww.out"
    mkdir -m 700 "$tmp/real"
    ln -s "$tmp/real" "$tmp/link"
    # shellcheck disable=SC2086
    timed link "$fsdprun" -n 2 --store "file://$tmp/link" "$train" --backend gloo $tiny --steps 2
    row "file store path is a symbolic link planted by another user" $ms $st fail "$tmp/link.out"
    head -c 32 /dev/urandom > "$tmp/key1"
    head -c 32 /dev/urandom > "$tmp/key2"
    chmod 600 "$tmp/key1" "$tmp/key2"
    port=$((20000 + $$ % 20000))
    # shellcheck disable=SC2086
    FSDP_STORE_KEY_FILE="$tmp/key1" "$fsdprun" -n 1 --nnodes 2 --node-rank 0 --master-addr 127.0.0.1 \
        --master-port $port --timeout 10 "$train" --backend gloo $tiny --steps 2 > "$tmp/key0.out" 2>&1 &
    kp=$!
    sleep 1
    # shellcheck disable=SC2086
    FSDP_STORE_KEY_FILE="$tmp/key2" timed key1 "$fsdprun" -n 1 --nnodes 2 --node-rank 1 \
        --master-addr 127.0.0.1 --master-port $port "$train" --backend gloo $tiny --steps 2
    wait $kp
    sed 's/^/node 0: /' "$tmp/key0.out" > "$tmp/key.out"
    sed 's/^/node 1: /' "$tmp/key1.out" >> "$tmp/key.out"
    row "TCP store: node 1 has another key (FSDP_STORE_KEY_FILE) than node 0's server (node 1's status; node 0 stops at its --timeout 10)" $ms $st fail "$tmp/key.out"
fi

# --- files that are not files -------------------------------------------------------------------
mkfifo "$tmp/fifo"
timed fifo "$train" $tiny --steps 2 --data "$tmp/fifo"
row "--data names a FIFO (nobody writes to it)" $ms $st fail "$tmp/fifo.out"
timed exp "$train" $tiny --steps 2 --export /dev/full
[ -c /dev/full ] || { bad=1; echo "faults.sh: /dev/full is no longer a character device" >&2; }
row "--export /dev/full (afterwards: $(stat -c %F /dev/full))" $ms $st fail "$tmp/exp.out"
timed met "$train" $tiny --steps 2 --metrics /dev/full
row "--metrics /dev/full" $ms $st fail "$tmp/met.out"

# --- checkpoints ----------------------------------------------------------------------------------
"$train" $tiny --steps 4 --world-size 2 --save-every 2 --checkpoint-dir "$tmp/ck" > "$tmp/ck.out" 2>&1
mkdir "$tmp/ck/step-6.partial"
head -c 4096 /dev/urandom > "$tmp/ck/step-6.partial/rank-0-of-2.safetensors.tmp-12345-1"
timed resume "$train" $tiny --steps 6 --world-size 2 --save-every 2 --checkpoint-dir "$tmp/ck" --resume latest \
    --resume-override steps
row "a save killed half-way (step-6.partial with a .tmp file), then --resume latest" $ms $st ok "$tmp/resume.out"
half=$(($(wc -c < "$tmp/ck/step-4/rank-0-of-2.safetensors") / 1024))
# shellcheck disable=SC2016,SC2086
timed full sh -c 'trap "" XFSZ; ulimit -f "$0"; exec "$@"' "$half" "$train" $tiny --steps 10 \
    --world-size 2 --save-every 2 --checkpoint-dir "$tmp/ck" --resume "$tmp/ck/step-4" --resume-override steps
row "disk full: the file-size limit is half a rank's shard, re-saving step 6 (--on-save-error stop)" \
    $ms $st fail "$tmp/full.out"
timed after "$train" $tiny --steps 8 --world-size 2 --resume "$tmp/ck/step-6" --resume-override steps
row "then --resume step-6: the step-6 saved before the failed re-save" $ms $st ok "$tmp/after.out"

# --- launcher settings ----------------------------------------------------------------------------
timed n "$fsdprun" -n 100000 "$train"
row "fsdprun -n 100000" $ms $st fail "$tmp/n.out"
timed be "$fsdprun" -n 1 --backend nosuch "$train"
row "fsdprun --backend nosuch" $ms $st fail "$tmp/be.out"
if [ $has_gloo = 1 ]; then
    timed nol env -u RANK -u WORLD_SIZE -u FSDP_STORE "$train" --backend gloo $tiny --steps 2
    row "fsdp-train --backend gloo with no launcher" $ms $st fail "$tmp/nol.out"
fi
timed s0 "$train" $tiny --steps 0
row "fsdp-train --steps 0 (evaluates only)" $ms $st ok "$tmp/s0.out"
echo
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg); $(bench_cores) cores"
exit $bad
