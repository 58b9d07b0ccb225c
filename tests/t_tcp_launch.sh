#!/bin/sh
# SPDX-License-Identifier: MIT
# t_tcp_launch.sh: the TCP store in launches (issue 25 items 2, 3 and 5): fsdprun's torchrun
# options (--nproc-per-node, --nnodes, --node-rank, --master-addr, --master-port,
# --rdzv-endpoint), two fsdprun launchers as the two nodes of one job on loopback, where node 0
# serves the store, and fsdp_init_from_env reading MASTER_ADDR/MASTER_PORT (rank 0 serves, the
# others connect; FSDP_STORE wins over them). The gloo runs skip without Gloo; the option checks
# always run. Ports come from tests/free_port and are retried if another process takes one.
# Time bounds are hang guards only (`timeout`).
top_builddir=${top_builddir:-.}
fsdprun="$top_builddir/tools/fsdprun"
worker="$top_builddir/tests/gloo_worker"
freeport="$top_builddir/tests/free_port"
for p in "$fsdprun" "$worker" "$freeport"; do
  if [ ! -x "$p" ]; then
    echo "Bail out! $p was not built"
    exit 1
  fi
done
tmp=$(mktemp -d) || { echo "Bail out! mktemp -d failed"; exit 1; }
trap 'rm -rf "$tmp"' EXIT
. "$(dirname "$0")/tap.sh"
has() { grep -q -e "$2" "$1"; }
count() { grep -c -e "$2" "$1"; }

# --- options (no Gloo needed) -------------------------------------------------------------------
usage() { # expected-text args...
  want=$1
  shift
  "$fsdprun" "$@" true > "$tmp/u.out" 2>&1
  rc=$?
  [ "$rc" -eq 2 ] && has "$tmp/u.out" "$want"
  ok $? "fsdprun $*: usage error (exit $rc) saying '$want'" "$tmp/u.out"
}
usage "needs --master-addr HOST" --nnodes 2 -n 1
usage "works on a single node only" --nnodes 2 -n 1 --master-addr 127.0.0.1 --master-port 0
usage "wants HOST:PORT" -n 1 --rdzv-endpoint 127.0.0.1
usage "wants HOST:PORT" -n 1 --rdzv-endpoint ::1:5
usage "port number in 0..65535" -n 1 --master-port 65536
usage "give one or the other" -n 1 --rdzv-endpoint h:1 --master-port 2
usage "give one or the other" -n 1 --store file:///x --master-addr h
usage "not less than --nnodes" --nnodes 2 --node-rank 2 -n 1 --master-addr h
"$fsdprun" -n 1 --store 'redis:pass@h' true > "$tmp/u.out" 2>&1
! has "$tmp/u.out" "pass"
ok $? "a malformed --store is refused without echoing it (it may hold a password)" "$tmp/u.out"

"$fsdprun" --nproc_per_node=2 --master-addr 127.0.0.1 --master-port 0 \
  sh -c 'echo "$RANK $WORLD_SIZE $FSDP_STORE $MASTER_ADDR $MASTER_PORT"' > "$tmp/env.out" 2>&1
rc=$?
port=$(sed -n 's|.*tcp://127.0.0.1:\([0-9]*\) 127.0.0.1 \([0-9]*\)$|\1 \2|p' "$tmp/env.out" | head -1)
set -- $port
[ "$rc" -eq 0 ] && [ "$(count "$tmp/env.out" "tcp://127.0.0.1:")" -eq 2 ] && [ -n "$1" ] &&
  [ "$1" != 0 ] && [ "$1" = "$2" ]
ok $? "--nproc_per_node=2 --master-port 0: both ranks get FSDP_STORE=tcp://127.0.0.1:P and MASTER_PORT=P, a free port" \
  "$tmp/env.out"
"$fsdprun" -n 1 sh -c 'echo "store=$FSDP_STORE master=${MASTER_ADDR-unset}"' > "$tmp/def.out" 2>&1
has "$tmp/def.out" "store=file:///.* master=unset"
ok $? "one node without master options keeps the temporary file store and sets no MASTER_ADDR" \
  "$tmp/def.out"

if ! "$worker" allreduce 2> /dev/null | grep -q 'allreduce ok (gloo)'; then
  echo "# SKIP the gloo runs: libfsdp was built without Gloo"
  echo "1..$n"
  exit 0
fi

# --- two launchers, two nodes, one job ----------------------------------------------------------
for attempt in 1 2 3; do
  p=$("$freeport")
  timeout 120 "$fsdprun" --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 127.0.0.1 \
    --master-port "$p" "$worker" allreduce > "$tmp/n0.out" 2>&1 &
  n0=$!
  FSDP_TIMEOUT_MS=30000 timeout 120 "$fsdprun" --nnodes 2 --node_rank 1 -n 2 \
    --rdzv-endpoint "127.0.0.1:$p" "$worker" allreduce > "$tmp/n1.out" 2>&1
  r1=$?
  wait $n0
  r0=$?
  has "$tmp/n0.out" "Address already in use" || break
done
cat "$tmp/n0.out" "$tmp/n1.out" > "$tmp/nodes.out"
[ "$r0" -eq 0 ] && [ "$r1" -eq 0 ] && [ "$(count "$tmp/nodes.out" "of 4: allreduce ok (gloo)")" -eq 4 ]
ok $? "--nnodes 2: node 0 serves the TCP store at --master-addr/--master-port, node 1 reaches it by --rdzv-endpoint; 4 ranks all_reduce over gloo (exit $r0, $r1)" \
  "$tmp/nodes.out"
has "$tmp/n1.out" "\[rank 2\]" && has "$tmp/n1.out" "\[rank 3\]"
ok $? "node 1's ranks are 2 and 3" "$tmp/n1.out"

# --- fsdp_init_from_env with MASTER_ADDR/MASTER_PORT, no launcher -------------------------------
for attempt in 1 2 3; do
  p=$("$freeport")
  # rank 1 first: it retries until rank 0 serves
  RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$p FSDP_TIMEOUT_MS=30000 \
    timeout 60 "$worker" allreduce > "$tmp/m1.out" 2>&1 &
  m1=$!
  sleep 0.2
  RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$p FSDP_TIMEOUT_MS=30000 \
    timeout 60 "$worker" allreduce > "$tmp/m0.out" 2>&1
  r0=$?
  wait $m1
  r1=$?
  has "$tmp/m0.out" "Address already in use" || break
done
cat "$tmp/m0.out" "$tmp/m1.out" > "$tmp/m.out"
[ "$r0" -eq 0 ] && [ "$r1" -eq 0 ] && [ "$(count "$tmp/m.out" "allreduce ok (gloo)")" -eq 2 ]
ok $? "MASTER_ADDR/MASTER_PORT: rank 0 serves the TCP store, rank 1 (started first) connects; the all_reduce is right" \
  "$tmp/m.out"

RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 timeout 30 "$worker" allreduce > "$tmp/half.out" 2>&1
rc=$?
[ "$rc" -eq 1 ] && has "$tmp/half.out" "MASTER_ADDR is set but MASTER_PORT is not"
ok $? "MASTER_ADDR without MASTER_PORT is a clear error (exit $rc)" "$tmp/half.out"
RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=http timeout 30 "$worker" allreduce \
  > "$tmp/badport.out" 2>&1
rc=$?
[ "$rc" -eq 1 ] && has "$tmp/badport.out" "MASTER_PORT='http' is not a port"
ok $? "a MASTER_PORT that is not a port is a clear error (exit $rc)" "$tmp/badport.out"

# FSDP_STORE wins: MASTER_* point at a closed port, the file store is used.
p=$("$freeport")
mkdir "$tmp/prec"
for r in 0 1; do
  RANK=$r WORLD_SIZE=2 FSDP_STORE="file://$tmp/prec" MASTER_ADDR=127.0.0.1 MASTER_PORT=$p \
    FSDP_TIMEOUT_MS=30000 timeout 60 "$worker" allreduce > "$tmp/prec$r.out" 2>&1 &
done
wait
cat "$tmp/prec0.out" "$tmp/prec1.out" > "$tmp/prec.out"
[ "$(count "$tmp/prec.out" "allreduce ok (gloo)")" -eq 2 ] && [ -n "$(ls "$tmp/prec")" ]
ok $? "FSDP_STORE takes precedence over MASTER_ADDR/MASTER_PORT (the file store holds the keys)" \
  "$tmp/prec.out"

# A rank whose rank 0 never comes: a timeout naming the master address, not a hang.
p=$("$freeport")
RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$p FSDP_TIMEOUT_MS=1000 \
  timeout 30 "$worker" allreduce > "$tmp/alone.out" 2>&1
rc=$?
[ "$rc" -eq 1 ] && has "$tmp/alone.out" "127.0.0.1:$p"
ok $? "without rank 0, rank 1 fails within its timeout naming 127.0.0.1:$p (exit $rc)" \
  "$tmp/alone.out"
echo "1..$n"
