#!/bin/sh
# SPDX-License-Identifier: MIT
# t_fsdprun_nodes.sh: a rank killed on one node is reported on the others (issue 26, item 2).
#
# Two fsdprun play nodes 0 and 1 of a two-rank Gloo training on this host, as in the issue's
# repro, over a file store, over the TCP store that node 0 serves, and over that store with the
# job's key (FSDP_STORE_KEY_FILE). Once rank 0 has
# logged a step, node 1's rank is killed with SIGKILL: it prints nothing. Checks:
#   - rank 0 names the peer it lost, with its host, and the collective it was in;
#   - node 1's fsdprun leaves a record in the store (tools/fsdprun_record.c) and node 0's
#     fsdprun prints it: "node 1 reports: rank 1 (host H) failed: signal 9 (SIGKILL)";
#   - node 0's summary names that record as what came before its own rank's failure;
#   - both launchers exit non-zero.
top_builddir=${top_builddir:-.}
fsdprun="$top_builddir/tools/fsdprun"
train="$top_builddir/tools/fsdp-train"
. "$(dirname "$0")/tap.sh"

if ! "$train" --version 2>/dev/null | grep -q 'backends:.*gloo'; then
  echo "1..0 # SKIP fsdp-train has no Gloo"
  exit 0
fi
tmp=$(mktemp -d) || { echo "Bail out! mktemp -d failed"; exit 1; }
trap 'rm -rf "$tmp"' EXIT
host=$(hostname)
args="--backend gloo --steps 100000 --n-layer 1 --n-embd 32 --block-size 32 --seq-len 32 --batch-size 2 --val-every 0 --sample-tokens 0 --quiet"

# kill_node1 KIND STORE_ARGS...: runs the two nodes, kills rank 1 after rank 0's first step;
# sets rc0 and rc1, the launchers' statuses; their output is in $tmp/KIND.0 and $tmp/KIND.1.
kill_node1() {
  kind=$1
  shift
  rm -f "$tmp/pid" "$tmp/m.jsonl"
  # shellcheck disable=SC2086
  "$fsdprun" -n 1 --nnodes 2 --node-rank 0 "$@" "$train" $args --metrics "$tmp/m.jsonl" \
    > "$tmp/$kind.0" 2>&1 &
  p0=$!
  # shellcheck disable=SC2016,SC2086
  "$fsdprun" -n 1 --nnodes 2 --node-rank 1 "$@" sh -c 'echo $$ > "$0"; exec "$@"' "$tmp/pid" \
    "$train" $args > "$tmp/$kind.1" 2>&1 &
  p1=$!
  i=0
  while { [ ! -s "$tmp/m.jsonl" ] || [ ! -s "$tmp/pid" ]; } && [ $i -lt 1200 ] &&
    kill -0 $p0 2>/dev/null; do
    sleep 0.1
    i=$((i + 1))
  done
  [ -s "$tmp/pid" ] && kill -9 "$(cat "$tmp/pid")"
  wait $p0
  rc0=$?
  wait $p1
  rc1=$?
}

# tcpkey: the TCP store with the job's key (FSDP_STORE_KEY_FILE), which the launchers, the
# ranks and the records all use.
head -c 32 /dev/urandom > "$tmp/key"
chmod 600 "$tmp/key"
for kind in file tcp tcpkey; do
  port=$((20000 + ($$ + ${#kind}) % 20000))
  if [ $kind = file ]; then
    mkdir -m 700 "$tmp/store"
    kill_node1 file --store "file://$tmp/store"
  elif [ $kind = tcp ]; then
    kill_node1 tcp --master-addr 127.0.0.1 --master-port $port
  else
    FSDP_STORE_KEY_FILE="$tmp/key"
    export FSDP_STORE_KEY_FILE
    kill_node1 tcpkey --master-addr 127.0.0.1 --master-port $port
    unset FSDP_STORE_KEY_FILE
  fi
  out0="$tmp/$kind.0"
  out1="$tmp/$kind.1"
  grep -q "^fsdprun: rank 1 was killed by signal 9 (SIGKILL)" "$out1"
  ok $? "$kind store: node 1's fsdprun sees its rank killed by SIGKILL" "$out1"
  grep -q "^\[rank 0\] fsdp-train: rank 0: stopped in [^:]*: a peer failed: .* seq [0-9]* on group 'world' (rank 0): peer rank 1 (world rank 1, host 127.0.0.1) failed or closed its connection" "$out0"
  ok $? "$kind store: rank 0 names the lost peer, its host, the collective and its sequence number" "$out0"
  grep -qF "fsdprun: node 1 reports: rank 1 (host $host) failed: signal 9 (SIGKILL); its last line: none" "$out0"
  ok $? "$kind store: node 0's fsdprun prints node 1's record: rank, host, signal" "$out0"
  grep -q "^fsdprun: summary: rank 0 failed first on node 0 (status 1);.*; before it, [0-9]* ms earlier, node 1: rank 1 (host $host) failed: signal 9 (SIGKILL)" "$out0"
  ok $? "$kind store: node 0's summary names node 1's failure as the earlier one" "$out0"
  [ "$rc0" -ne 0 ] && [ "$rc1" -ne 0 ]
  ok $? "$kind store: both launchers fail (exit $rc0 and $rc1)" "$out0" "$out1"
done
echo "1..$n"
[ "$failed" = 0 ]
