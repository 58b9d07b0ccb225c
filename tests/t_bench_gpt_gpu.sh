#!/bin/sh
# SPDX-License-Identifier: MIT
# t_bench_gpt_gpu.sh: the GPU benchmark's host side (bench/bench_gpt_gpu, bench/gpt2_gpu.sh,
# bench/gpt2_torch_fsdp.py), which runs on any machine:
#   - bench_gpt_gpu --help prints its options and exits 0; a bad option or value is one line on
#     stderr and exit 2;
#   - with no GPU, bench_gpt_gpu exits 1 with one line naming cudaGetDeviceCount's error; with
#     a GPU, --quick runs and prints tokens/s, MFU and both memory lines;
#   - gpt2_gpu.sh --help prints its usage and exits 0, a bad --runs or --nproc exits 2, and a
#     BENCH_GPT_GPU that names no program exits 2 saying so;
#   - gpt2_torch_fsdp.py --help exits 0 without importing torch (skipped without python3).
# bench_gpt_gpu is built only with CUDA and NCCL: without it the whole file is skipped.
top_builddir=${top_builddir:-.}
srcdir=${srcdir:-.}
bench="$top_builddir/bench/bench_gpt_gpu"
script="$srcdir/bench/gpt2_gpu.sh"
py="$srcdir/bench/gpt2_torch_fsdp.py"
if [ ! -x "$bench" ]; then
  echo "1..0 # SKIP bench_gpt_gpu is built only with CUDA and NCCL"
  exit 0
fi
tmp=$(mktemp -d) || { echo "Bail out! mktemp -d failed"; exit 1; }
trap 'rm -rf "$tmp"' EXIT
. "$(dirname "$0")/tap.sh"

echo "1..7"

"$bench" --help > "$tmp/h.out" 2> "$tmp/h.err"
st=$?
[ "$st" -eq 0 ] && [ ! -s "$tmp/h.err" ] && grep -q -- '--bf16' "$tmp/h.out" &&
  grep -q -- '--quick' "$tmp/h.out" && grep -q -- '--peak-n' "$tmp/h.out"
ok $? "bench_gpt_gpu --help lists --bf16, --quick and --peak-n and exits 0 (exit $st)" "$tmp/h.out"

bad=0
for args in "--batch 0" "--heads 5" "--peak-n 7" "--no-such-option" "--steps"; do
  # shellcheck disable=SC2086
  "$bench" $args > "$tmp/b.out" 2> "$tmp/b.err"
  st=$?
  if [ "$st" -ne 2 ] || [ "$(wc -l < "$tmp/b.err")" -ne 1 ] || [ -s "$tmp/b.out" ]; then
    echo "#   '$args': exit $st"
    sed -e 's/^/#     /' "$tmp/b.err"
    bad=1
  fi
done
ok $bad "five bad option sets each exit 2 with one line on stderr"

"$bench" --quick > "$tmp/q.out" 2> "$tmp/q.err"
st=$?
if grep -q 'no CUDA device is visible' "$tmp/q.err"; then
  [ "$st" -eq 1 ] && [ "$(wc -l < "$tmp/q.err")" -eq 1 ] && [ ! -s "$tmp/q.out" ] &&
    grep -q 'cudaGetDeviceCount: .*(cuda[A-Za-z]*)' "$tmp/q.err"
  ok $? "with no GPU, bench_gpt_gpu exits 1 with one line naming CUDA's error (exit $st)" \
    "$tmp/q.err"
else
  [ "$st" -eq 0 ] && grep -q '^tokens/s [0-9]' "$tmp/q.out" && grep -q '^MFU [0-9]' "$tmp/q.out" &&
    grep -q '^memory (' "$tmp/q.out" && grep -q '^GPU used memory' "$tmp/q.out"
  ok $? "bench_gpt_gpu --quick runs on the GPU and prints tokens/s, MFU and memory (exit $st)" \
    "$tmp/q.out" "$tmp/q.err"
fi

sh "$script" --help > "$tmp/s.out" 2>&1
st=$?
[ "$st" -eq 0 ] && grep -q 'target >= 1.0' "$tmp/s.out" && grep -q -- '--nproc' "$tmp/s.out"
ok $? "gpt2_gpu.sh --help prints its usage (exit $st)" "$tmp/s.out"

sh "$script" --runs 0 > /dev/null 2> "$tmp/r.err"
st1=$?
sh "$script" --nproc x > /dev/null 2>> "$tmp/r.err"
st2=$?
[ "$st1" -eq 2 ] && [ "$st2" -eq 2 ] && [ "$(wc -l < "$tmp/r.err")" -eq 2 ]
ok $? "gpt2_gpu.sh: a bad --runs or --nproc exits 2 with one line (exit $st1, $st2)" "$tmp/r.err"

BENCH_GPT_GPU="$tmp/nothing-here" sh "$script" --quick > "$tmp/m.out" 2> "$tmp/m.err"
st=$?
[ "$st" -eq 2 ] && [ "$(wc -l < "$tmp/m.err")" -eq 1 ] && grep -q 'nothing-here' "$tmp/m.err"
ok $? "gpt2_gpu.sh with BENCH_GPT_GPU naming no program exits 2 with one line naming it (exit $st)" \
  "$tmp/m.err"

if command -v python3 > /dev/null 2>&1; then
  python3 "$py" --help > "$tmp/p.out" 2>&1
  st=$?
  [ "$st" -eq 0 ] && grep -q -- '--bf16' "$tmp/p.out"
  ok $? "gpt2_torch_fsdp.py --help exits 0 without needing torch (exit $st)" "$tmp/p.out"
else
  n=$((n + 1))
  echo "ok $n # SKIP no python3"
fi
