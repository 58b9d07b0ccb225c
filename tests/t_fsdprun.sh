#!/bin/sh
# SPDX-License-Identifier: MIT
# t_fsdprun.sh: the fsdprun launcher, run from the build tree with small shell-script ranks.
# Checks the ranks' environment and the temporary store, line prefixing without interleaving,
# partial lines, exit statuses, failure and signal handling, multi-node numbering and usage
# errors. Waits are generous (the machine may be loaded); "quickly" means well before a rank's
# 60 s sleep would have ended.
top_builddir=${top_builddir:-.}
fsdprun="$top_builddir/tools/fsdprun"
if [ ! -x "$fsdprun" ]; then
  echo "Bail out! $fsdprun was not built"
  exit 1
fi
tmp=$(mktemp -d) || { echo "Bail out! mktemp -d failed"; exit 1; }
tmp=$(cd "$tmp" && pwd -P)
trap 'rm -rf "$tmp"' EXIT

. "$(dirname "$0")/tap.sh"
is() { [ "$1" = "$2" ]; }
has() { grep -q -e "$2" "$1"; }
# waits up to $2 seconds for the file $1
wait_for() {
  i=0
  while [ ! -e "$1" ] && [ "$i" -lt $(($2 * 10)) ]; do
    sleep 0.1
    i=$((i + 1))
  done
  [ -e "$1" ]
}

# --- the environment of each rank, and the temporary store --------------------------------------
mkdir "$tmp/tmpdir"
cat > "$tmp/env.sh" <<'EOF'
d=${FSDP_STORE#file://}
if [ -d "$d" ]; then there=yes; else there=no; fi
echo "env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $NODE_RANK $NNODES $FSDP_BACKEND" \
  "$there $FSDP_STORE"
mkdir -p "$d/sub" && echo x > "$d/sub/written-by-$RANK"
EOF
RANK=77 WORLD_SIZE=99 FSDP_STORE=inherited TMPDIR="$tmp/tmpdir" \
  "$fsdprun" -n 3 --backend sim sh "$tmp/env.sh" > "$tmp/env.out" 2> "$tmp/env.err"
rc=$?
ok "$rc" "three ranks that succeed: exit status 0 (got $rc)" "$tmp/env.err"
st=0
for i in 0 1 2; do
  has "$tmp/env.out" "^\[rank $i\] env $i 3 $i 3 0 1 sim yes file://$tmp/tmpdir/fsdprun\." || st=1
done
ok $st "each rank gets RANK, WORLD_SIZE, LOCAL_*, NODE_RANK, NNODES, FSDP_BACKEND (not ours)" \
  "$tmp/env.out"
urls=$(sed -n 's/^\[rank [0-9]*\] env .* //p' "$tmp/env.out" | sort -u)
is "$(printf '%s\n' "$urls" | wc -l | tr -d ' ')" 1
ok $? "all ranks share one FSDP_STORE, a file:// URL under \$TMPDIR that exists during the run" \
  "$tmp/env.out"
dir=${urls#file://}
[ -n "$dir" ] && [ ! -e "$dir" ]
ok $? "the store directory (with what the ranks wrote in it) is removed after the run"
is "$(ls "$tmp/tmpdir" | wc -l | tr -d ' ')" 0
ok $? "nothing is left under \$TMPDIR"

# --- prefixes: 4 ranks x 200 lines, each line written in two pieces, stdout and stderr mixed ------
cat > "$tmp/lines.sh" <<'EOF'
pay=abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789abcdefghijklmnopqrstuvwxyz
i=0
while [ $i -lt 200 ]; do
  if [ $((i % 3)) = 0 ]; then
    printf '%s:%s:' "$RANK" "$i" >&2
    printf '%s%s\n' "$pay" "$pay" >&2
  else
    printf '%s:%s:' "$RANK" "$i"
    printf '%s%s\n' "$pay" "$pay"
  fi
  i=$((i + 1))
done
EOF
"$fsdprun" -n 4 sh "$tmp/lines.sh" > "$tmp/lines.out" 2>&1
rc=$?
ok "$rc" "200 lines per rank: exit status 0 (got $rc)"
pay=abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789abcdefghijklmnopqrstuvwxyz
awk -v pay="$pay$pay" '
  {
    if (!match($0, /^\[rank [0-9]+\] /)) { bad++; next }
    r = substr($0, 7, RLENGTH - 8)
    nf = split(substr($0, RLENGTH + 1), f, ":")
    if (nf != 3 || f[1] != r || f[3] != pay) bad++
    count[r]++
  }
  END {
    for (r = 0; r < 4; r++) if (count[r] != 200) bad++
    if (NR != 800) bad++
    exit bad > 0
  }' "$tmp/lines.out"
ok $? "every line is '[rank R] ' + one whole line of rank R, exactly 200 per rank" "$tmp/lines.out"

# --- partial lines --------------------------------------------------------------------------------
cat > "$tmp/partial.sh" <<'EOF'
if [ "$RANK" = 0 ]; then
  printf 'hel'
  sleep 1
  echo 'lo'
  printf 'first\nno newline at the end'
  printf 'stderr without newline' >&2
else
  sleep 0.3
  echo 'other rank'
fi
EOF
"$fsdprun" -n 2 sh "$tmp/partial.sh" > "$tmp/partial.out" 2> "$tmp/partial.err"
rc=$?
ok "$rc" "partial lines: exit status 0 (got $rc)" "$tmp/partial.err"
has "$tmp/partial.out" '^\[rank 0\] hello$' && has "$tmp/partial.out" '^\[rank 1\] other rank$'
ok $? "a line written in two pieces a second apart stays whole while another rank writes" \
  "$tmp/partial.out"
has "$tmp/partial.out" '^\[rank 0\] first$' &&
  has "$tmp/partial.out" '^\[rank 0\] no newline at the end$'
ok $? "a last stdout line without a newline is prefixed and terminated" "$tmp/partial.out"
has "$tmp/partial.err" '^\[rank 0\] stderr without newline$'
ok $? "a last stderr line without a newline too" "$tmp/partial.err"
is "$(tail -c 1 "$tmp/partial.out" | od -An -c | tr -d ' ')" '\n'
ok $? "the output ends with a newline"

# --- one rank fails: the others are stopped ------------------------------------------------------
cat > "$tmp/fail.sh" <<'EOF'
if [ "$RANK" = 1 ]; then sleep 0.5; exit 3; fi
sleep 60
echo survived
EOF
t0=$(date +%s)
"$fsdprun" -n 3 sh "$tmp/fail.sh" > "$tmp/fail.out" 2> "$tmp/fail.err"
rc=$?
t1=$(date +%s)
ok "$([ "$rc" = 1 ]; echo $?)" "a rank exiting 3 makes fsdprun exit 1 (got $rc)" "$tmp/fail.err"
has "$tmp/fail.err" '^fsdprun: rank 1 exited with status 3$'
ok $? "the message names the rank and its status" "$tmp/fail.err"
is "$(grep -c '^fsdprun: rank' "$tmp/fail.err")" 1
ok $? "only the first failure is reported, not the ranks fsdprun stopped" "$tmp/fail.err"
[ $((t1 - t0)) -lt 30 ] && ! has "$tmp/fail.out" survived
ok $? "the sleeping ranks are terminated quickly ($((t1 - t0)) s, their sleep was 60 s)" \
  "$tmp/fail.out"

# --- a rank killed by a signal -------------------------------------------------------------------
cat > "$tmp/kill.sh" <<'EOF'
if [ "$RANK" = 0 ]; then echo "about to go" >&2; echo; kill -9 $$; fi
sleep 60
EOF
t0=$(date +%s)
"$fsdprun" -n 2 sh "$tmp/kill.sh" > "$tmp/kill.out" 2> "$tmp/kill.err"
rc=$?
t1=$(date +%s)
ok "$([ "$rc" = 137 ]; echo $?)" "a rank killed by SIGKILL makes fsdprun exit 128+9 (got $rc)" \
  "$tmp/kill.err"
has "$tmp/kill.err" '^fsdprun: rank 0 was killed by signal 9 (SIGKILL)$'
ok $? "the message names the rank and the signal" "$tmp/kill.err"
# Issue 26 item 2: a summary once every rank is reaped (its last line: the last non-blank one).
has "$tmp/kill.err" "^fsdprun: summary: rank 0 failed first (signal 9 (SIGKILL)); its last line: 'about to go'; then, as a consequence, ranks 1 (signal 15 (SIGTERM), stopped by fsdprun)\$"
ok $? "the summary names the first rank to fail, its signal, its last line and the rank stopped" \
  "$tmp/kill.err"
has "$tmp/fail.err" "^fsdprun: summary: rank 1 failed first (status 3); its last line: none; then, as a consequence, ranks 0 (signal 15 (SIGTERM), stopped by fsdprun), 2 (signal 15 (SIGTERM), stopped by fsdprun)\$"
ok $? "... and a rank that printed nothing, with every rank stopped" "$tmp/fail.err"
[ $((t1 - t0)) -lt 30 ]
ok $? "the other rank is stopped quickly ($((t1 - t0)) s)"

# --- SIGTERM to fsdprun reaches the ranks ------------------------------------------------------
cat > "$tmp/term.sh" <<EOF
trap 'echo term > "$tmp/marker.\$RANK"; exit 0' TERM
: > "$tmp/ready.\$RANK"
i=0
while [ \$i -lt 600 ]; do sleep 0.1; i=\$((i + 1)); done
EOF
"$fsdprun" -n 2 sh "$tmp/term.sh" > "$tmp/term.out" 2> "$tmp/term.err" &
pid=$!
wait_for "$tmp/ready.0" 30 && wait_for "$tmp/ready.1" 30
ok $? "both ranks start and install their TERM trap"
t0=$(date +%s)
kill -TERM "$pid"
wait "$pid"
rc=$?
t1=$(date +%s)
[ -f "$tmp/marker.0" ] && [ -f "$tmp/marker.1" ]
ok $? "SIGTERM sent to fsdprun reaches every rank ($((t1 - t0)) s)" "$tmp/term.err"
ok "$([ "$rc" = 143 ]; echo $?)" "fsdprun then exits 128+15 (got $rc)" "$tmp/term.err"
has "$tmp/term.err" 'got SIGTERM'
ok $? "and says it forwarded the signal" "$tmp/term.err"

# --- a rank that ignores SIGTERM gets SIGKILL after the grace period ---------------------------
cat > "$tmp/stubborn.sh" <<EOF
if [ "\$RANK" = 1 ]; then
  i=0
  while [ ! -e "$tmp/stubborn.ready" ] && [ \$i -lt 300 ]; do sleep 0.1; i=\$((i + 1)); done
  exit 5
fi
trap '' TERM
: > "$tmp/stubborn.ready"
sleep 60
EOF
t0=$(date +%s)
"$fsdprun" -n 2 --grace 1 sh "$tmp/stubborn.sh" > "$tmp/stubborn.out" 2> "$tmp/stubborn.err"
rc=$?
t1=$(date +%s)
ok "$([ "$rc" = 1 ]; echo $?)" "--grace 1: exit status 1 for the rank that exited 5 (got $rc)" \
  "$tmp/stubborn.err"
has "$tmp/stubborn.err" '^fsdprun: rank 1 exited with status 5$' &&
  has "$tmp/stubborn.err" 'sending SIGKILL'
ok $? "the rank ignoring SIGTERM is killed after the grace period" "$tmp/stubborn.err"
[ $((t1 - t0)) -lt 30 ]
ok $? "well before its sleep ends ($((t1 - t0)) s)"

# --- --timeout ---------------------------------------------------------------------------------
t0=$(date +%s)
"$fsdprun" -n 2 --timeout 1 sh -c 'sleep 60' > "$tmp/to.out" 2> "$tmp/to.err"
rc=$?
t1=$(date +%s)
ok "$([ "$rc" = 124 ] && [ $((t1 - t0)) -lt 30 ]; echo $?)" \
  "--timeout 1 stops a 60 s job with status 124 (got $rc after $((t1 - t0)) s)" "$tmp/to.err"

# --- several nodes -----------------------------------------------------------------------------
cat > "$tmp/nodes.sh" <<'EOF'
echo "$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $NODE_RANK $NNODES $FSDP_STORE"
EOF
"$fsdprun" -n 2 --nnodes 2 --node-rank 1 --store "file://$tmp/shared" sh "$tmp/nodes.sh" \
  > "$tmp/nodes.out" 2> "$tmp/nodes.err"
rc=$?
has "$tmp/nodes.out" "^\[rank 2\] 2 4 0 2 1 2 file://$tmp/shared$" &&
  has "$tmp/nodes.out" "^\[rank 3\] 3 4 1 2 1 2 file://$tmp/shared$" && [ "$rc" = 0 ]
ok $? "--nnodes 2 --node-rank 1 -n 2 gives ranks 2 and 3 of 4 with the given store" \
  "$tmp/nodes.out" "$tmp/nodes.err"
"$fsdprun" -n 2 --nnodes 2 --node-rank 1 sh "$tmp/nodes.sh" > "$tmp/ns.out" 2> "$tmp/ns.err"
rc=$?
[ "$rc" = 2 ] && has "$tmp/ns.err" 'needs --master-addr HOST' && has "$tmp/ns.err" 'or --store URL' && [ ! -s "$tmp/ns.out" ]
ok $? "--nnodes 2 without --store or --master-addr is refused with exit status 2 (got $rc)" "$tmp/ns.err"

# --- --no-prefix -------------------------------------------------------------------------------
"$fsdprun" -n 2 --no-prefix sh -c 'echo plain-$RANK' > "$tmp/np.out" 2>&1
is "$(sort "$tmp/np.out" | tr '\n' ' ')" "plain-0 plain-1 "
ok $? "--no-prefix: the ranks write straight to fsdprun's output" "$tmp/np.out"

# --- --force: more ranks than the limit (the CPUs, at least 8) ---------------------------------
lim=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
[ "$lim" -lt 8 ] && lim=8
over=$((lim + 1))
"$fsdprun" -n $over --force --no-prefix sh -c 'echo r' > "$tmp/force.out" 2>&1
rc=$?
[ "$rc" = 0 ] && [ "$(grep -c '^r$' "$tmp/force.out")" = "$over" ]
ok $? "-n $over --force starts $over ranks past the limit of $lim (exit $rc)" "$tmp/force.out"

# --- usage errors: exit status 2 and a clear message ------------------------------------------
printf 'echo hi\n' > "$tmp/not-executable"
usage() { # expected-text args...
  want=$1
  shift
  "$fsdprun" "$@" > "$tmp/u.out" 2> "$tmp/u.err"
  rc=$?
  [ "$rc" = 2 ] && has "$tmp/u.err" "$want"
  ok $? "usage error '$*': exit 2 (got $rc), says \"$want\"" "$tmp/u.err"
}
usage 'missing -n' sh -c true
usage "-n 100000 is more ranks than this node's" -n 100000 true
usage "--backend 'nosuch' is not a backend: gloo, nccl or sim" -n 1 --backend nosuch true
usage "wants a whole number of at least 1, not '0'" -n 0 sh -c true
usage "not 'x'" -n x sh -c true
usage "unknown option '--bogus'" -n 2 --bogus sh -c true
usage 'no program to run' -n 2
usage '-n needs a value' -n
usage "--node-rank 2 is not less than --nnodes 2" \
  -n 1 --nnodes 2 --node-rank 2 --store file:///x true
usage "--store wants a URL" -n 1 --store /not/a/url true
usage "cannot run '$tmp/nope': No such file or directory" -n 2 "$tmp/nope"
usage "cannot run '$tmp/not-executable': Permission denied" -n 1 "$tmp/not-executable"
"$fsdprun" --help > "$tmp/help.out" 2>&1
rc=$?
[ "$rc" = 0 ] && has "$tmp/help.out" SYNOPSIS && has "$tmp/help.out" 'EXIT STATUS'
ok $? "--help prints the manual and exits 0"
"$fsdprun" -n1 --grace=0.5 -- sh -c 'echo "$RANK/$WORLD_SIZE"' > "$tmp/forms.out" 2>&1
is "$(cat "$tmp/forms.out")" "[rank 0] 0/1"
ok $? "-nN, --name=value and -- are accepted" "$tmp/forms.out"

echo "1..$n"
[ "$failed" = 0 ]
