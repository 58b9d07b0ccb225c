#!/bin/sh
# SPDX-License-Identifier: MIT
# rpm-build.sh: builds libfsdp's binary RPMs (libfsdp, libfsdp-devel, fsdp-tools) from a release
# tarball with `rpmbuild -bb --nodeps`, copies them into an output directory, lists them and
# checks that each package holds what it should.
#
#   packaging/rpm-build.sh [--out DIR] [--spec FILE] [--keep] [TARBALL] [RPMBUILD-ARG ...]
#
# TARBALL  the tarball `make dist` makes (default: the newest libfsdp-*.tar.gz in the current
#          directory). Its version must be the spec's.
# --out    where the .rpm files go (default: ./rpms); files of the same names there are
#          replaced.
# --spec   the spec (default: libfsdp.spec inside the tarball, else the one beside this script,
#          ../libfsdp.spec).
# --keep   keep the temporary rpmbuild tree (its BUILD/ holds the build and test-suite.log).
# The arguments after TARBALL, or from the first one that starts with "-" and is none of the
# above, go to rpmbuild as they are: --nocheck skips %check (make check, about ten minutes on
# two cores), --without gloo, --define 'NAME VALUE'. `--` ends this script's own arguments.
#
# rpmbuild runs in a private %_topdir under a temporary directory ($TMPDIR or /tmp), removed
# at the end; nothing is written to ~/rpmbuild. --nodeps because the build dependencies are
# named as Fedora names them, which rpm cannot see on a Debian machine (whose packages
# libjansson-dev, libhiredis-dev, libopenblas-dev and libgloo-dev provide them).
#
# Exit status: 0 when the three packages were built and hold what they should; 1 when rpmbuild
# failed or a check failed (the message says which); 2 for bad usage.
set -eu

prog=rpm-build.sh
here=$(cd "$(dirname "$0")" && pwd)

usage() {
    # The header comment, from the line after the SPDX tag to the first line that is not one.
    awk 'NR > 2 && /^#/ { sub(/^# ?/, ""); print; next } NR > 2 { exit }' "$0"
}
die() {
    echo "$prog: $1" >&2
    exit "${2:-1}"
}

outdir=./rpms
spec=
keep=0
tarball=
while [ $# -gt 0 ]; do
    case $1 in
    -h | --help) usage; exit 0 ;;
    --out | -o)
        [ $# -ge 2 ] || die "$1 needs a directory" 2
        outdir=$2; shift 2 ;;
    --out=*) outdir=${1#--out=}; shift ;;
    --spec)
        [ $# -ge 2 ] || die "$1 needs a file" 2
        spec=$2; shift 2 ;;
    --spec=*) spec=${1#--spec=}; shift ;;
    --keep) keep=1; shift ;;
    --) shift; break ;;
    -*) break ;;
    *)
        [ -z "$tarball" ] || break
        tarball=$1; shift ;;
    esac
done
# What is left in "$@" goes to rpmbuild.

command -v rpmbuild > /dev/null 2>&1 || die "rpmbuild is not installed (Debian: apt-get install rpm)"
case ${TMPDIR:-/tmp} in
*[[:space:]]*) die "TMPDIR='$TMPDIR' has a space, which rpmbuild's %prep cannot take" 2 ;;
esac

if [ -z "$tarball" ]; then
    # The newest by modification time; ls -t is the portable way to sort by it, and the names
    # are libfsdp-*.tar.gz.
    # shellcheck disable=SC2012
    tarball=$(ls -t libfsdp-*.tar.gz 2> /dev/null | head -n 1) || true
    [ -n "$tarball" ] || die "no TARBALL given and no libfsdp-*.tar.gz in $(pwd) (make dist makes one)" 2
fi
[ -f "$tarball" ] || die "$tarball: no such file" 2
case $(basename "$tarball") in
libfsdp-*.tar.gz) ;;
*) die "$tarball: not a libfsdp-VERSION.tar.gz" 2 ;;
esac
tarball=$(cd "$(dirname "$tarball")" && pwd)/$(basename "$tarball")
version=$(basename "$tarball" .tar.gz)
version=${version#libfsdp-}

mkdir -p "$outdir" || die "cannot create $outdir"
outdir=$(cd "$outdir" && pwd)

top=$(mktemp -d "${TMPDIR:-/tmp}/libfsdp-rpm.XXXXXX") || die "cannot make a temporary directory"
cleanup() {
    if [ "$keep" = 1 ]; then
        echo "$prog: kept the rpmbuild tree $top"
    else
        rm -rf "$top"
    fi
}
trap cleanup EXIT
trap 'exit 1' HUP INT PIPE TERM
mkdir -p "$top/SOURCES" "$top/SPECS" "$top/BUILD" "$top/BUILDROOT" "$top/RPMS" \
    "$top/SRPMS" "$top/tmp"

# The spec: given, else the tarball's own (it matches the sources), else the one beside us.
if [ -n "$spec" ]; then
    [ -f "$spec" ] || die "$spec: no such file" 2
    cp "$spec" "$top/SPECS/libfsdp.spec"
    spec_from=$spec
elif tar -xzf "$tarball" -C "$top/tmp" "libfsdp-$version/libfsdp.spec" 2> /dev/null; then
    mv "$top/tmp/libfsdp-$version/libfsdp.spec" "$top/SPECS/libfsdp.spec"
    spec_from="$tarball (libfsdp-$version/libfsdp.spec)"
elif [ -f "$here/../libfsdp.spec" ]; then
    cp "$here/../libfsdp.spec" "$top/SPECS/libfsdp.spec"
    spec_from=$(cd "$here/.." && pwd)/libfsdp.spec
else
    die "no spec: the tarball has no libfsdp.spec and there is none in $here/.."
fi
rm -rf "$top/tmp/libfsdp-$version"
echo "$prog: spec from $spec_from"

spec_version=$(rpmspec -q --srpm --qf '%{VERSION}\n' --define "_topdir $top" \
    "$top/SPECS/libfsdp.spec" 2> /dev/null) ||
    die "rpmspec cannot read the spec from $spec_from (rpmspec -P on it says why)"
[ "$spec_version" = "$version" ] ||
    die "the spec is for version $spec_version but the tarball is $version"
cp "$tarball" "$top/SOURCES/libfsdp-$version.tar.gz"

# Every directory rpmbuild writes to is named here, so that a ~/.rpmmacros setting one of them
# elsewhere cannot send the build there.
echo "$prog: rpmbuild -bb --nodeps${*:+ $*} in $top"
rpmbuild -bb --nodeps --define "_topdir $top" --define "_sourcedir $top/SOURCES" \
    --define "_specdir $top/SPECS" --define "_builddir $top/BUILD" \
    --define "_buildrootdir $top/BUILDROOT" --define "_rpmdir $top/RPMS" \
    --define "_srcrpmdir $top/SRPMS" --define "_tmppath $top/tmp" \
    "$@" "$top/SPECS/libfsdp.spec" || die "rpmbuild failed (see above)"

# The packages rpmbuild made (with debuginfo packages where the platform makes them).
rpms=$(find "$top/RPMS" -type f -name '*.rpm' | sort)
[ -n "$rpms" ] || die "rpmbuild made no .rpm file"
for f in $rpms; do
    rm -f "$outdir/$(basename "$f")"
    cp "$f" "$outdir/"
done

fail=0
problem() {
    echo "$prog: FAIL: $1" >&2
    fail=1
}
# pkgfile NAME: the package called NAME among those built (not its -devel or -debuginfo).
pkgfile() {
    for f in $rpms; do
        if [ "$(rpm -qp --qf '%{NAME}' "$f" 2> /dev/null)" = "$1" ]; then
            echo "$outdir/$(basename "$f")"
            return 0
        fi
    done
    return 1
}
# has FILE LIST REGEX WHAT: LIST (rpm -qlp's output) has a line matching REGEX.
has() {
    printf '%s\n' "$2" | grep -Eq "$3" || problem "$(basename "$1") lacks $4"
}
# hasnt FILE LIST REGEX WHAT: no line of LIST matches REGEX.
hasnt() {
    if printf '%s\n' "$2" | grep -Eq "$3"; then
        problem "$(basename "$1") holds $4: $(printf '%s\n' "$2" | grep -E "$3" | head -n 3 | tr '\n' ' ')"
    fi
}
# needs_lib FILE: FILE requires libfsdp of exactly this version and release.
needs_lib() {
    rpm -qp --requires "$1" 2> /dev/null | grep -Eq "^libfsdp(\(.*\))? = $version-" ||
        problem "$(basename "$1") does not require libfsdp = $version-<release>"
}

lib=$(pkgfile libfsdp) || problem "no libfsdp package was built"
devel=$(pkgfile libfsdp-devel) || problem "no libfsdp-devel package was built"
tools=$(pkgfile fsdp-tools) || problem "no fsdp-tools package was built"

if [ -n "$lib" ]; then
    l=$(rpm -qlp "$lib")
    has "$lib" "$l" '/lib(64)?/libfsdp\.so\.0$' "the libfsdp.so.0 link"
    has "$lib" "$l" '/lib(64)?/libfsdp\.so\.0\.[0-9]+\.[0-9]+$' "the shared library libfsdp.so.0.*"
    has "$lib" "$l" '/licenses/libfsdp/LICENSE$' "the licence (%license LICENSE)"
    has "$lib" "$l" '/doc/libfsdp/README\.md$' "README.md"
    has "$lib" "$l" '/doc/libfsdp/NEWS$' "NEWS"
    has "$lib" "$l" '^/usr/share/libfsdp/corpus\.txt$' "the corpus the library reads (share/libfsdp/corpus.txt)"
    hasnt "$lib" "$l" '(/include/|/bin/|\.a$|\.la$|/libfsdp\.so$)' "development files or programs"
fi
if [ -n "$devel" ]; then
    l=$(rpm -qlp "$devel")
    has "$devel" "$l" '^/usr/include/fsdp\.h$' "fsdp.h"
    has "$devel" "$l" '^/usr/include/fsdp/fsdp\.h$' "fsdp/fsdp.h"
    has "$devel" "$l" '^/usr/include/fsdp/version\.h$' "fsdp/version.h (generated by configure)"
    has "$devel" "$l" '/lib(64)?/libfsdp\.so$' "the libfsdp.so link"
    has "$devel" "$l" '/lib(64)?/libfsdp\.a$' "the static library libfsdp.a"
    has "$devel" "$l" '/lib(64)?/pkgconfig/fsdp\.pc$' "fsdp.pc"
    hasnt "$devel" "$l" '(\.la$|/libfsdp\.so\.0)' "libtool archives or the runtime library"
    needs_lib "$devel"
fi
if [ -n "$tools" ]; then
    l=$(rpm -qlp "$tools")
    for p in fsdprun fsdp-train fsdp-ckpt fsdp-sim fsdp-plot; do
        has "$tools" "$l" "^/usr/bin/$p\$" "bin/$p"
        has "$tools" "$l" "/man/man1/$p\\.1(\\.gz|\\.bz2|\\.xz|\\.zst)?\$" "the man page $p.1"
    done
    hasnt "$tools" "$l" '(/include/|/lib(64)?/libfsdp\.)' "library or development files"
    needs_lib "$tools"
fi

echo "$prog: packages in $outdir:"
for f in $rpms; do
    ls -l "$outdir/$(basename "$f")"
done
[ "$fail" = 0 ] || die "the packages are not as they should be (see FAIL above)"
echo "$prog: libfsdp, libfsdp-devel and fsdp-tools $version built and checked"
