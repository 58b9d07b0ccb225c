# SPDX-License-Identifier: MIT
# train_prelude.sh: what the fsdp-train shell tests (t_fsdp_train.sh, t_train_ckpt.sh) set up
# first, sourced by them:  . "$(dirname "$0")/train_prelude.sh"
# Sets train and fsdprun (the build tree's programs; bails out when fsdp-train is missing), one
# compute thread per rank, a scratch directory $tmp removed at exit, and the TAP helpers.
top_builddir=${top_builddir:-.}
train="$top_builddir/tools/fsdp-train"
fsdprun="$top_builddir/tools/fsdprun"
if [ ! -x "$train" ]; then
  echo "Bail out! $train was not built"
  exit 1
fi
FSDP_NUM_THREADS=1
export FSDP_NUM_THREADS
tmp=$(mktemp -d) || { echo "Bail out! mktemp -d failed"; exit 1; }
trap 'rm -rf "$tmp"' EXIT
. "$(dirname "$0")/tap.sh"
