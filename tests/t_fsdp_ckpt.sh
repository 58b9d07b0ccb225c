#!/bin/sh
# SPDX-License-Identifier: MIT
# t_fsdp_ckpt.sh: fsdp-ckpt (info, consolidate, shard, verify) end to end.
#   - a full model file from fsdp-train --export (a 1-layer, width-16 GPT) sharded at world 3
#     verifies, and info lists every tensor of the file, as model.<name>, in 3 chunks;
#   - consolidating it gives the file's tensors bit for bit: fsdp-train --init takes it, and
#     re-exporting from it (--steps 0) gives the same bytes as re-exporting from the original;
#   - worlds 1, 2, 3 and 5 consolidate to the same bytes, each tensor in its non-empty pieces of
#     ceil(numel / world) elements (16 elements at world 5: 4 chunks of 4);
#     a scalar, a 2-element and an empty tensor at world 5 keep their bytes;
#   - --all on a shard-made directory is the default output with the "model." prefixes;
#   - info --json is one JSON object with the same tensors;
#   - shard replaces an existing checkpoint directory but refuses a directory of other files;
#   - usage errors exit 2 with one line naming the problem; a missing index.json or a
#     truncated rank file makes verify exit 1 naming the file;
#   - --help and --version.
top_builddir=${top_builddir:-.}
ckpt="$top_builddir/tools/fsdp-ckpt"
train="$top_builddir/tools/fsdp-train"
for p in "$ckpt" "$train"; do
  if [ ! -x "$p" ]; then
    echo "Bail out! $p was not built"
    exit 1
  fi
done
FSDP_NUM_THREADS=1
OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-SkylakeX}
export FSDP_NUM_THREADS OPENBLAS_CORETYPE
tmp=$(mktemp -d) || { echo "Bail out! mktemp -d failed"; exit 1; }
trap 'rm -rf "$tmp"' EXIT

. "$(dirname "$0")/tap.sh"

# The safetensors header (JSON) of file $1.
header() {
  hlen=$(od -An -t u8 -N 8 "$1" | tr -d ' ')
  dd if="$1" bs=1 skip=8 count="$hlen" 2> /dev/null
}
# The tensor names of safetensors file $1, sorted, one per line.
st_names() { header "$1" | grep -o '"[^"]*":{"dtype"' | sed -e 's/^"//' -e 's/":{"dtype"$//' | sort; }
# The data section of safetensors file $1 (everything after the header).
st_data() {
  hlen=$(od -An -t u8 -N 8 "$1" | tr -d ' ')
  tail -c +$((hlen + 9)) "$1"
}
# The tensor lines of fsdp-ckpt info's output: name and chunk column.
info_tensors() { sed -n -e '/^tensors:/,$p' "$1" | sed -n -e 's/^  //p'; }

echo "1..23"

# --- 1-4: a model file, sharded at world 3 ------------------------------------------------------
m="--n-layer 1 --n-head 2 --n-embd 16 --block-size 16 --seq-len 16 --batch-size 4 --world-size 1
   --warmup 1 --val-every 0 --val-steps 1 --sample-tokens 0 --quiet"
# shellcheck disable=SC2086
"$train" $m --steps 2 --export "$tmp/model.st" > "$tmp/train.out" 2>&1
st=$?
st_names "$tmp/model.st" > "$tmp/names"
nt=$(wc -l < "$tmp/names")
[ "$st" -eq 0 ] && [ "$nt" -gt 10 ]
ok $? "fsdp-train --export writes a full model file ($nt tensors, exit $st)" "$tmp/train.out"

"$ckpt" shard "$tmp/model.st" "$tmp/d3" --world 3 > "$tmp/shard.out" 2>&1
st=$?
[ "$st" -eq 0 ] && [ -f "$tmp/d3/index.json" ] && [ -f "$tmp/d3/rank-0-of-3.safetensors" ] &&
  [ -f "$tmp/d3/rank-2-of-3.safetensors" ] && [ ! -e "$tmp/d3/rank-3-of-3.safetensors" ] &&
  [ ! -e "$tmp/d3.partial" ]
ok $? "shard --world 3 writes index.json and 3 rank files (exit $st)" "$tmp/shard.out"

"$ckpt" verify "$tmp/d3" > "$tmp/verify.out" 2>&1
st=$?
[ "$st" -eq 0 ] && grep -q "^ok: $nt tensors, 3 files, [0-9]* bytes$" "$tmp/verify.out"
ok $? "verify exits 0 and says ok: $nt tensors, 3 files (exit $st)" "$tmp/verify.out"

"$ckpt" info "$tmp/d3" > "$tmp/info.out" 2>&1
st=$?
info_tensors "$tmp/info.out" | awk '{ print $1 }' | sed -e 's/^model\.//' > "$tmp/info.names"
[ "$st" -eq 0 ] && grep -q '^world size: 3$' "$tmp/info.out" &&
  grep -q "^tensors: *$nt$" "$tmp/info.out" && cmp -s "$tmp/names" "$tmp/info.names" &&
  [ "$(info_tensors "$tmp/info.out" | grep -c '^model\..* 3 chunks$')" -eq "$nt" ] &&
  grep -q '^  producer = fsdp-train$' "$tmp/info.out"
ok $? "info lists every tensor of the file as model.<name> in 3 chunks, and the metadata" \
  "$tmp/info.out"

# --- 5-7: consolidate is bitwise; fsdp-train --init takes it ----------------------------------------
"$ckpt" consolidate "$tmp/d3" "$tmp/c3.st" > "$tmp/cons.out" 2>&1
st=$?
st_names "$tmp/c3.st" > "$tmp/c3.names"
[ "$st" -eq 0 ] && cmp -s "$tmp/names" "$tmp/c3.names" && [ ! -s "$tmp/cons.out" ]
ok $? "consolidate writes the file's tensor names, without the prefix (exit $st)" \
  "$tmp/cons.out" "$tmp/c3.names"
header "$tmp/c3.st" | grep -q '"__metadata__":{[^}]*"producer":"fsdp-train"'
ok $? "the index's metadata is the file's __metadata__"
# Both files go through the same load and export, so equal exports mean equal tensors.
# shellcheck disable=SC2086
"$train" $m --steps 0 --init "$tmp/model.st" --export "$tmp/e0.st" > "$tmp/e0.out" 2>&1
st0=$?
# shellcheck disable=SC2086
"$train" $m --steps 0 --init "$tmp/c3.st" --export "$tmp/e1.st" > "$tmp/e1.out" 2>&1
st1=$?
[ "$st0" -eq 0 ] && [ "$st1" -eq 0 ] && cmp "$tmp/e0.st" "$tmp/e1.st" > "$tmp/e.cmp" 2>&1
ok $? "fsdp-train --init takes the consolidated file, and its tensors are the original's bit for bit (exit $st0, $st1)" \
  "$tmp/e1.out" "$tmp/e.cmp"

# --- 8-9: worlds 1, 2, 3 and 5 -----------------------------------------------------------------------
worlds_ok=0
for w in 1 2 3 5; do
  "$ckpt" shard "$tmp/model.st" "$tmp/w$w" --world "$w" > "$tmp/w$w.out" 2>&1 &&
    "$ckpt" verify "$tmp/w$w" >> "$tmp/w$w.out" 2>&1 &&
    "$ckpt" info "$tmp/w$w" > "$tmp/w$w.info" 2>&1 &&
    "$ckpt" consolidate "$tmp/w$w" "$tmp/c$w.st" >> "$tmp/w$w.out" 2>&1
  st=$?
  # ceil(numel / c) non-empty pieces of c = ceil(numel / w) elements
  good=$(info_tensors "$tmp/w$w.info" | awk -v w="$w" '
    { n = $(NF - 2); c = int((n + w - 1) / w); if ($(NF - 1) == int((n + c - 1) / c)) k++ }
    END { print k + 0 }')
  if [ "$st" -ne 0 ] || ! cmp -s "$tmp/c3.st" "$tmp/c$w.st" || [ "$good" -ne "$nt" ]; then
    echo "#   world $w: exit $st"
    sed -e 's/^/#     /' "$tmp/w$w.out" "$tmp/w$w.info" | tail -20
    worlds_ok=1
  fi
done
ok $worlds_ok "worlds 1, 2, 3 and 5: verify, every tensor in ceil(numel / ceil(numel / w)) chunks, the same consolidated bytes"
# A scalar (F32 1.5), two I64 (7, -2) and an empty F32 (0 x 3) written by hand: the header
# padded to 8 bytes.
hdr='{"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]},"t":{"dtype":"I64","shape":[2],"data_offsets":[4,20]},"e":{"dtype":"F32","shape":[0,3],"data_offsets":[20,20]}}'
while [ $((${#hdr} % 8)) -ne 0 ]; do hdr="$hdr "; done
{
  printf "\\$(printf %03o ${#hdr})\\000\\000\\000\\000\\000\\000\\000"
  printf '%s' "$hdr"
  printf '\000\000\300\077\007\000\000\000\000\000\000\000\376\377\377\377\377\377\377\377'
} > "$tmp/tiny.st"
st_data "$tmp/tiny.st" > "$tmp/tiny.data"
"$ckpt" shard "$tmp/tiny.st" "$tmp/tiny5" --world 5 > "$tmp/tiny.out" 2>&1 &&
  "$ckpt" info "$tmp/tiny5" > "$tmp/tiny.info" 2>&1 &&
  "$ckpt" consolidate "$tmp/tiny5" "$tmp/tiny.c.st" >> "$tmp/tiny.out" 2>&1
st=$?
st_data "$tmp/tiny.c.st" > "$tmp/tiny.c.data"
[ "$st" -eq 0 ] && cmp -s "$tmp/tiny.data" "$tmp/tiny.c.data" &&
  info_tensors "$tmp/tiny.info" | grep -q '^model\.s  *F32  *\[\]  *1  1 chunk$' &&
  info_tensors "$tmp/tiny.info" | grep -q '^model\.t  *I64  *\[2\]  *2  2 chunks$' &&
  info_tensors "$tmp/tiny.info" | grep -q '^model\.e  *F32  *\[0, 3\]  *0 '
ok $? "a scalar, a 2-element and an empty tensor at world 5: one, two and no chunks, the same bytes (exit $st)" \
  "$tmp/tiny.out" "$tmp/tiny.info"

# --- 10: --all ------------------------------------------------------------------------------------
"$ckpt" consolidate --all "$tmp/d3" "$tmp/all.st" > "$tmp/all.out" 2>&1
st=$?
st_names "$tmp/all.st" > "$tmp/all.names"
sed -e 's/^/model./' "$tmp/c3.names" > "$tmp/c3.prefixed"
st_data "$tmp/all.st" > "$tmp/all.data"
st_data "$tmp/c3.st" > "$tmp/c3.data"
[ "$st" -eq 0 ] && cmp -s "$tmp/all.names" "$tmp/c3.prefixed" && cmp -s "$tmp/all.data" "$tmp/c3.data"
ok $? "consolidate --all of a shard-made directory: the default output with model. prefixes (exit $st)" \
  "$tmp/all.out" "$tmp/all.names"

# --- 11: info --json ------------------------------------------------------------------------------
"$ckpt" info --json "$tmp/d3" > "$tmp/info.json" 2> "$tmp/json.err"
st=$?
if command -v python3 > /dev/null 2>&1; then
  python3 - "$tmp/info.json" "$nt" > "$tmp/json.chk" 2>&1 << 'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
assert j["world_size"] == 3 and len(j["files"]) == 3, j
assert j["total_bytes"] == sum(f["size"] for f in j["files"])
assert len(j["tensors"]) == int(sys.argv[2])
assert all(t["name"].startswith("model.") and t["chunks"] == 3 and not t["replicated"]
           for t in j["tensors"])
assert j["metadata"]["producer"] == "fsdp-train"
EOF
else
  grep -q '"world_size": 3' "$tmp/info.json" && [ "$(grep -c '"chunks": 3' "$tmp/info.json")" -eq "$nt" ]
fi
chk=$?
[ "$st" -eq 0 ] && [ "$chk" -eq 0 ]
ok $? "info --json: one object with the world size, files, metadata and $nt tensors (exit $st)" \
  "$tmp/json.err" "$tmp/json.chk"

# --- 12-13: replacing a directory -------------------------------------------------------------------
"$ckpt" shard "$tmp/model.st" "$tmp/d3" --world=2 > "$tmp/re.out" 2>&1 &&
  "$ckpt" info "$tmp/d3" > "$tmp/re.info" 2>&1
st=$?
[ "$st" -eq 0 ] && grep -q '^world size: 2$' "$tmp/re.info" && [ ! -e "$tmp/d3/rank-2-of-3.safetensors" ] &&
  [ ! -e "$tmp/d3.partial" ]
ok $? "shard over an existing checkpoint directory replaces it (exit $st)" "$tmp/re.out"
mkdir "$tmp/mine" && echo keep > "$tmp/mine/notes.txt"
"$ckpt" shard "$tmp/model.st" "$tmp/mine" --world 2 > "$tmp/mine.out" 2> "$tmp/mine.err"
st=$?
[ "$st" -eq 1 ] && grep -q "mine' holds 'notes.txt'" "$tmp/mine.err" &&
  [ "$(cat "$tmp/mine/notes.txt")" = keep ] && [ ! -e "$tmp/mine.partial" ] &&
  echo keep > "$tmp/afile" && ! "$ckpt" shard "$tmp/model.st" "$tmp/afile" --world 2 \
  > /dev/null 2>> "$tmp/mine.err" && grep -q "afile' exists and is not a directory" "$tmp/mine.err" &&
  [ "$(cat "$tmp/afile")" = keep ]
ok $? "shard refuses a directory that holds other files, or a file, and leaves them alone (exit $st)" \
  "$tmp/mine.err"

# --- 14-20: usage errors ----------------------------------------------------------------------------
usage() { # expected-pattern description args...
  pat=$1
  desc=$2
  shift 2
  "$ckpt" "$@" > "$tmp/u.out" 2> "$tmp/u.err"
  st=$?
  [ "$st" -eq 2 ] && [ "$(wc -l < "$tmp/u.err")" -eq 1 ] && [ ! -s "$tmp/u.out" ] &&
    grep -q -- "$pat" "$tmp/u.err"
  ok $? "$desc: exit 2 with one line naming the problem (exit $st)" "$tmp/u.err"
}
usage 'no command' "no arguments"
usage "unknown command 'frobnicate'" "an unknown command" frobnicate "$tmp/d3"
usage '--world: 0 is out of range' "--world 0" shard "$tmp/model.st" "$tmp/x" --world 0
usage 'verify: no DIR given' "verify without DIR" verify
usage 'shard: --world N is required' "shard without --world" shard "$tmp/model.st" "$tmp/x"
usage "unknown option '--bogus'" "an unknown option" info "$tmp/d3" --bogus
[ ! -e "$tmp/x" ]
ok $? "usage errors write nothing"

# --- 21-22: broken directories ----------------------------------------------------------------------
cp -r "$tmp/w2" "$tmp/noidx" && rm "$tmp/noidx/index.json"
"$ckpt" verify "$tmp/noidx" > "$tmp/noidx.out" 2> "$tmp/noidx.err"
st=$?
[ "$st" -eq 1 ] && grep -q 'noidx/index.json' "$tmp/noidx.err" && [ ! -s "$tmp/noidx.out" ]
ok $? "verify of a directory without index.json exits 1 naming it (exit $st)" "$tmp/noidx.err"
cp -r "$tmp/w2" "$tmp/trunc"
f="$tmp/trunc/rank-1-of-2.safetensors"
head -c $(($(wc -c < "$f") - 5)) "$f" > "$tmp/t" && mv "$tmp/t" "$f"
"$ckpt" verify "$tmp/trunc" > "$tmp/trunc.out" 2> "$tmp/trunc.err"
st=$?
[ "$st" -eq 1 ] && grep -q 'rank-1-of-2.safetensors' "$tmp/trunc.err"
ok $? "verify of a truncated rank file exits 1 naming the file (exit $st)" "$tmp/trunc.err"

# --- 23: --help and --version ------------------------------------------------------------------------
"$ckpt" --help > "$tmp/help.out" 2>&1 && "$ckpt" --version > "$tmp/version.out" 2>&1
st=$?
[ "$st" -eq 0 ] && grep -q '^usage: fsdp-ckpt info DIR' "$tmp/help.out" &&
  grep -q '^fsdp-ckpt (libfsdp) [0-9]' "$tmp/version.out"
ok $? "--help and --version exit 0 (exit $st)" "$tmp/help.out" "$tmp/version.out"

[ "$n" -eq 23 ] || echo "# ran $n tests, planned 23"
exit 0
