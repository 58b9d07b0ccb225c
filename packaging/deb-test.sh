#!/bin/sh
# SPDX-License-Identifier: MIT
# packaging/deb-test.sh: installs the Debian packages built by deb-build.sh, runs the
# autopkgtest scripts of debian/tests/control against the installation (as autopkgtest's null
# runner would: from the source tree, each in a scratch AUTOPKGTEST_TMP), then removes the
# packages again, whatever the tests gave.
#
# usage: packaging/deb-test.sh [DEBDIR]   (default ./debs; run as root, from the source tree)
# Exits non-zero when installing fails or any test fails; prints one line per test.
set -u
debs=${1:-debs}
die() { echo "deb-test.sh: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "installing packages needs root"
[ -f debian/tests/control ] || die "run from the source tree (no debian/tests/control here)"
pkgs=$(ls "$debs"/libfsdp0_*.deb "$debs"/libfsdp-dev_*.deb "$debs"/fsdp-tools_*.deb 2>/dev/null)
[ $(printf '%s\n' "$pkgs" | grep -c .) = 3 ] || die "libfsdp0, libfsdp-dev and fsdp-tools not all in $debs"
names="libfsdp0 libfsdp-dev fsdp-tools"
cleanup() {
    DEBIAN_FRONTEND=noninteractive apt-get remove -y -qq --purge $names >/dev/null 2>&1 ||
        dpkg --purge $names >/dev/null 2>&1
}
trap cleanup EXIT
echo "== installing $(echo $pkgs | xargs -n1 basename | tr '\n' ' ')"
# apt-get installs what the packages depend on (and the tests' Depends: a compiler, pkgconf).
abs=
for p in $pkgs; do abs="$abs $(cd "$(dirname "$p")" && pwd)/$(basename "$p")"; done
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $abs build-essential pkgconf \
    > deb-test-install.log 2>&1 || { tail -20 deb-test-install.log; die "apt-get install failed"; }
rm -f deb-test-install.log
for p in $names; do
    dpkg -s "$p" 2>/dev/null | grep -q '^Status: install ok installed' || die "$p is not installed"
done
fail=0
for t in $(sed -n 's/^Tests: *//p' debian/tests/control); do
    tmp=$(mktemp -d)
    t0=$(date +%s)
    if AUTOPKGTEST_TMP=$tmp "debian/tests/$t" > "$tmp.log" 2>&1; then
        echo "PASS $t ($(($(date +%s) - t0)) s)"
    else
        echo "FAIL $t"
        sed 's/^/    /' "$tmp.log" | tail -30
        fail=1
    fi
    rm -rf "$tmp" "$tmp.log"
done
[ $fail = 0 ] || die "autopkgtest scripts failed"
echo "deb-test.sh: every autopkgtest passed against the installed packages"
