#!/bin/sh
# SPDX-License-Identifier: MIT
# t_safetensors_py.sh: a file written by libfsdp's safetensors writer, read by an independent
# Python reader (numpy + json, in tests/golden/gen_safetensors.py --check), which checks the
# header (length, alignment, padding, no duplicate names, metadata), the tiling of the data
# section, and every tensor's exact bytes. Skips without a python3 that imports numpy.
srcdir=${srcdir:-.}
top_builddir=${top_builddir:-.}
script="$srcdir/tests/golden/gen_safetensors.py"
writer="$top_builddir/tests/t_safetensors.tap"
py=
for p in python3 /usr/bin/python3; do
  if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import numpy' >/dev/null 2>&1; then
    py=$p
    break
  fi
done
if [ -z "$py" ]; then
  echo "1..0 # SKIP no python3 with numpy"
  exit 0
fi
if [ ! -x "$writer" ]; then
  echo "1..0 # SKIP $writer is not built"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! "$writer" --write "$tmp/libfsdp.safetensors" 2>"$tmp/err"; then
  echo "1..1"
  echo "not ok 1 - [python reader] libfsdp writes the golden tensors"
  sed 's/^/#   /' "$tmp/err"
  exit 1
fi
# The checker prints the whole TAP stream; its descriptions get this script's tag.
"$py" "$script" --check "$tmp/libfsdp.safetensors" |
  sed -e 's/^\(\(not \)\{0,1\}ok [0-9]* - \)/\1[python reader] /'
