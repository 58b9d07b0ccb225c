#!/bin/sh
# SPDX-License-Identifier: MIT
# packaging/deb-build.sh: builds libfsdp's Debian packages from a release tarball (make dist),
# the way a Debian maintainer would: the tarball becomes the .orig.tar.gz, its debian/ directory
# builds the binary packages with dpkg-buildpackage, and lintian checks them.
#
# usage: packaging/deb-build.sh [--nocheck] [--no-lintian] [--profile P] [--no-build-deps]
#                                [--out DIR] [TARBALL]
#   TARBALL       libfsdp-VERSION.tar.gz (default: the newest in the current directory)
#   --nocheck     DEB_BUILD_OPTIONS=nocheck: skip make check (CI has run it already)
#   --profile P   a build profile (pkg.libfsdp.cuda builds libfsdp-cuda0; needs the toolkit:
#                 Debian's under /usr, or DEB_CUDA_PREFIX=/usr/local/cuda with --no-build-deps)
#   --no-build-deps  do not check Build-Depends (dpkg-buildpackage -d)
#   --out DIR     where the .deb, .buildinfo and .changes files go (default: ./debs)
#   --no-lintian  skip lintian
# Exits non-zero when the build fails or lintian reports an error or a warning. Prints how long
# the build and lintian took.
set -u
nocheck=0 lint=1 profile= out=debs tarball= nodeps=
while [ $# -gt 0 ]; do
    case $1 in
    --nocheck) nocheck=1 ;;
    --no-lintian) lint=0 ;;
    --profile) profile=$2; shift ;;
    --no-build-deps) nodeps=-d ;;
    --out) out=$2; shift ;;
    -h | --help) sed -n '3,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "deb-build.sh: unknown option $1" >&2; exit 2 ;;
    *) tarball=$1 ;;
    esac
    shift
done
die() { echo "deb-build.sh: $*" >&2; exit 1; }
[ -n "$tarball" ] || tarball=$(ls -t libfsdp-*.tar.gz 2>/dev/null | head -1)
[ -n "$tarball" ] && [ -f "$tarball" ] || die "no tarball (run make dist, or name one)"
for t in dpkg-buildpackage dh; do
    command -v $t >/dev/null 2>&1 || die "$t is missing (apt-get install dpkg-dev debhelper)"
done
base=$(basename "$tarball" .tar.gz)
version=${base#libfsdp-}
mkdir -p "$out" || die "cannot create $out"
out=$(cd "$out" && pwd)
work=$(mktemp -d) || die "mktemp failed"
trap 'rm -rf "$work"' EXIT
cp "$tarball" "$work/libfsdp_$version.orig.tar.gz"
tar -C "$work" -xzf "$tarball" || die "cannot unpack $tarball"
src=$work/$base
[ -f "$src/debian/control" ] || die "$tarball has no debian/ directory"

opts="parallel=$(nproc 2>/dev/null || echo 2)"
[ $nocheck = 1 ] && opts="$opts nocheck"
t0=$(date +%s)
echo "== dpkg-buildpackage -us -uc -b (DEB_BUILD_OPTIONS=$opts${profile:+, profile $profile})"
(cd "$src" && DEB_BUILD_OPTIONS=$opts dpkg-buildpackage -us -uc -b $nodeps ${profile:+-P"$profile"} \
    > "$work/build.log" 2>&1)
st=$?
t1=$(date +%s)
if [ $st != 0 ]; then
    tail -60 "$work/build.log"
    cp "$work/build.log" "$out/build.log"
    die "dpkg-buildpackage failed after $((t1 - t0)) s (log: $out/build.log)"
fi
cp "$work/build.log" "$out/build.log"
changes=$(ls "$work"/libfsdp_*.changes)
for f in $(sed -n '/^Files:/,$p' "$changes" | awk 'NF == 5 { print $5 }') $(basename "$changes"); do
    cp "$work/$f" "$out/"
done
echo "built in $((t1 - t0)) s:"
(cd "$out" && ls -l *.deb | awk '{ print "  " $5 "  " $9 }')
if [ $lint = 1 ]; then
    command -v lintian >/dev/null 2>&1 || die "lintian is missing (apt-get install lintian)"
    echo "== lintian"
    lintian --fail-on error,warning "$out/$(basename "$changes")"
    st=$?
    echo "lintian took $(($(date +%s) - t1)) s"
    [ $st = 0 ] || die "lintian reported errors or warnings"
fi
echo "deb-build.sh: packages in $out"
