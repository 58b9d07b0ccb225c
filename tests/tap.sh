# SPDX-License-Identifier: MIT
# tap.sh: TAP output for the shell tests, sourced by them:  . "$(dirname "$0")/tap.sh"
#
# ok STATUS DESCRIPTION [FILE...]   prints the next test as "ok N - DESCRIPTION" when STATUS is
#     0, else as "not ok N - DESCRIPTION" followed by the last $TAP_SHOW lines (default 30) of
#     each FILE that exists, as diagnostics. n counts the tests printed, failed the failures.
n=0
failed=0
ok() {
  tap_st=$1
  tap_desc=$2
  shift 2
  n=$((n + 1))
  if [ "$tap_st" -eq 0 ]; then
    echo "ok $n - $tap_desc"
  else
    echo "not ok $n - $tap_desc"
    failed=$((failed + 1))
    for tap_f in "$@"; do
      [ -f "$tap_f" ] && sed -e 's/^/#   /' "$tap_f" | tail -"${TAP_SHOW:-30}"
    done
  fi
}
