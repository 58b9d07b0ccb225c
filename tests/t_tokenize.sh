#!/bin/sh
# SPDX-License-Identifier: MIT
# t_tokenize.sh: GPT-2's BPE through the programs (issue 25, "A GPT-2 BPE tokenizer in C"), on the
# golden vocabulary of t_bpe.tap (256 bytes, 122 merges, <|endoftext|>: 379 ids).
#   - fsdp-tokenize writes an llm.c token file (magic 20240520, version 1, the count it prints)
#     and --decode gives back the text byte for byte, invalid UTF-8 included;
#   - a vocabulary with an id above 65535 is refused (uint16 tokens), a missing one too (exit 2);
#   - fsdp-train --tokenizer on a text file trains on its BPE tokens: the losses of the same run
#     on the token file fsdp-tokenize made, bit for bit, and it says the data was encoded;
#   - the sample is decoded: its text is that of the ids the run without --tokenizer prints, and
#     a --prompt is encoded and printed as text;
#   - fsdp-train --tokenizer of a directory without the files exits 2 with one line.
top_builddir=${top_builddir:-.}
train="$top_builddir/tools/fsdp-train"
tok="$top_builddir/tools/fsdp-tokenize"
bpe="$top_builddir/tests/t_bpe.tap"
for p in "$train" "$tok" "$bpe"; do
  [ -x "$p" ] || { echo "Bail out! $p was not built"; exit 1; }
done
FSDP_NUM_THREADS=1
export FSDP_NUM_THREADS
tmp=$(mktemp -d) || { echo "Bail out! mktemp -d failed"; exit 1; }
trap 'rm -rf "$tmp"' EXIT
. "$(dirname "$0")/tap.sh"
echo "1..14"

mkdir "$tmp/v" && "$bpe" --write-vocab "$tmp/v" || { echo "Bail out! no vocabulary"; exit 1; }
# Text of several kinds, two bytes that are not UTF-8, and enough of it for a few batches.
{
  i=0
  while [ $i -lt 40 ]; do
    printf "It's the cat's day; they're sure we've 12 dogs, 3.50 each!\n  Caf\303\251 \346\235\261\344\272\254 \377\376 end.\n"
    i=$((i + 1))
  done
} > "$tmp/in.txt"

"$tok" --tokenizer "$tmp/v" "$tmp/in.txt" "$tmp/in.bin" > "$tmp/enc.out" 2>&1
ok $? "fsdp-tokenize encodes a text file" "$tmp/enc.out"
count=$(sed -n 's/.*: \([0-9]*\) tokens (vocabulary of 379).*/\1/p' "$tmp/enc.out")
hdr=$(od -An -tu4 -N12 "$tmp/in.bin" | tr -s ' ' | sed 's/^ //')
size=$(wc -c < "$tmp/in.bin")
[ -n "$count" ] && [ "$hdr" = "20240520 1 $count" ] && [ "$size" -eq $((1024 + 2 * count)) ]
ok $? "the file: magic 20240520, version 1, the $count tokens printed, then uint16 ($hdr; $size bytes)"
"$tok" --tokenizer "$tmp/v" --decode "$tmp/in.bin" "$tmp/back.txt" > "$tmp/dec.out" 2>&1 &&
  cmp "$tmp/in.txt" "$tmp/back.txt" >> "$tmp/dec.out" 2>&1
ok $? "--decode gives back the text byte for byte" "$tmp/dec.out"

mkdir "$tmp/big" && cp "$tmp/v/vocab.bpe" "$tmp/big/" &&
  sed 's/"<|endoftext|>": *[0-9]*/"<|endoftext|>": 70000/' "$tmp/v/encoder.json" > "$tmp/big/encoder.json"
"$tok" --tokenizer "$tmp/big" "$tmp/in.txt" "$tmp/big.bin" > "$tmp/big.out" 2>&1
st=$?
[ $st -eq 1 ] && grep -q "70001 ids does not fit the uint16" "$tmp/big.out" && [ ! -e "$tmp/big.bin" ]
ok $? "a vocabulary of 70001 ids is refused for uint16 tokens (exit $st)" "$tmp/big.out"
"$tok" --tokenizer "$tmp/none" "$tmp/in.txt" "$tmp/x.bin" > "$tmp/none.out" 2>&1
st=$?
[ $st -eq 2 ] && [ "$(wc -l < "$tmp/none.out")" -eq 1 ] && grep -q "none/encoder.json" "$tmp/none.out"
ok $? "a missing tokenizer: exit 2, one line naming the file (exit $st)" "$tmp/none.out"

# ---- fsdp-train --------------------------------------------------------------------------------
f="--model tiny --n-layer 1 --n-embd 32 --n-head 2 --seq-len 16 --batch-size 4 --world-size 2"
f="$f --val-steps 1 --warmup 1 --val-every 0 --steps 3"
loss() { grep '"type":"train"' "$1" | sed -e 's/.*"loss":\([^,}]*\).*/\1/'; }
"$train" $f --tokenizer "$tmp/v" --data "$tmp/in.txt" --sample-tokens 0 --metrics "$tmp/a.jsonl" \
  > "$tmp/a.out" 2>&1
ok $? "fsdp-train --tokenizer trains on a text file" "$tmp/a.out"
grep -q "vocabulary 379:" "$tmp/a.out" && grep -q "in.txt encoded by --tokenizer" "$tmp/a.out"
ok $? "... with the tokenizer's vocabulary, saying the text was encoded" "$tmp/a.out"
"$train" $f --vocab-size 379 --data "$tmp/in.bin" --sample-tokens 0 --metrics "$tmp/b.jsonl" \
  > "$tmp/b.out" 2>&1
loss "$tmp/a.jsonl" > "$tmp/la"
loss "$tmp/b.jsonl" > "$tmp/lb"
[ -s "$tmp/la" ] && cmp -s "$tmp/la" "$tmp/lb"
ok $? "... the losses of the run on fsdp-tokenize's file, bit for bit ($(tr '\n' ' ' < "$tmp/la"))" \
  "$tmp/b.out" "$tmp/la" "$tmp/lb"

# The sample: the run without a tokenizer prints ids; with it, their text.
s="--sample-tokens 40 --temperature 0"
"$train" $f --vocab-size 379 --data "$tmp/in.bin" $s > "$tmp/ids.out" 2>&1
ok $? "a run on token data prints its sample as ids" "$tmp/ids.out"
"$train" $f --tokenizer "$tmp/v" --data "$tmp/in.bin" $s --prompt "" > "$tmp/txt.out" 2>&1
ok $? "... the same run with --tokenizer" "$tmp/txt.out"
sed -n '/^sample (/{n;p;}' "$tmp/ids.out" | "$bpe" --decode "$tmp/v" > "$tmp/want"
sed -n '/^sample (/{n;p;}' "$tmp/txt.out" > "$tmp/got"
[ "$(wc -c < "$tmp/want")" -gt 20 ] && cmp -s "$tmp/want" "$tmp/got"
ok $? "... prints the text of those ids: $(head -c 60 "$tmp/got")" "$tmp/want" "$tmp/got"
"$train" $f --tokenizer "$tmp/v" --data "$tmp/in.txt" --sample-tokens 5 --prompt "Café they're" \
  > "$tmp/p.out" 2>&1
ok $? "a --prompt with --tokenizer" "$tmp/p.out"
sed -n '/^sample (/{n;p;}' "$tmp/p.out" | grep -q "^Café they're"
ok $? "... is encoded and printed back as text" "$tmp/p.out"
"$train" $f --tokenizer "$tmp/none" > "$tmp/bad.out" 2>&1
st=$?
[ $st -eq 2 ] && [ "$(wc -l < "$tmp/bad.out")" -eq 1 ] && grep -q "^fsdp-train: --tokenizer: " "$tmp/bad.out"
ok $? "fsdp-train --tokenizer without its files: exit 2, one line (exit $st)" "$tmp/bad.out"
[ "$n" -eq 14 ] || echo "# ran $n tests, planned 14"
exit 0
