#!/bin/sh
# SPDX-License-Identifier: MIT
# gpu-bundle.sh: builds the GPU bundle, a directory that runs libfsdp's GPU checks on a bare CUDA
# machine in one command (its run.sh; tools/gpu-run.sh in the source tree).
#
#   tools/gpu-bundle.sh [--out DIR] [--build DIR] [--cuda DIR] [--jobs N] [--max-mib N]
#
# --out    the bundle (default gpu-bundle/ at the top of the source tree; git ignores it). It
#          is emptied first.
# --build  the build directory (default _build-gpu/ in the source tree), configured here when it
#          has no config.status: --with-cuda=DIR --with-nccl=DIR --without-gloo
#          --without-hiredis --prefix=/opt/libfsdp. BLAS (OpenBLAS) and jansson are used as
#          found: the GPU tests check every kernel against the CPU device, whose matrix products
#          without BLAS are about 35 times slower.
# --cuda   the CUDA toolkit (default /usr/local/cuda); NCCL is looked for in it as well.
# --jobs   make's parallelism (default: the number of online cores).
# --max-mib the largest bundle allowed (default 48: the device tool takes 64 MiB, the source tree
#          travels too).
#
# What the bundle holds (MANIFEST lists every file with its size and SHA-256):
#   run.sh, env.sh              the run and the environment it sets (the library path)
#   bin/fsdp-train, bin/fsdprun the installed programs (relinked by libtool for the prefix)
#   lib/libfsdp.so.*            the library; lib/libfsdp/libfsdp-cuda.so, the CUDA plugin
#   lib/carried.tar.gz          every shared library the programs need that is not glibc, the
#                               GCC runtime, the CUDA driver, cudart, cuBLAS(Lt) or NCCL: here
#                               jansson, OpenBLAS and OpenBLAS's Fortran runtime (env.sh
#                               unpacks them into lib/ on the first run)
#   tests/*.tap                 make check-gpu's programs, plus t_plugin (libfsdp.so opening the
#                               plugin as a user program does) and t_cuda_host
#   bench/                      bench_gpt_gpu, gpt2_gpu.sh and the PyTorch twin
#   data/corpus.txt             fsdp-train's corpus
# cuBLAS, cuBLASLt, cudart and NCCL are not carried: run.sh finds them on the machine.
#
# Exit status: 0 when the bundle was made, 1 when a step failed, 2 for bad usage.

set -eu

src=$(cd "$(dirname "$0")/.." && pwd)
out=$src/gpu-bundle
build=$src/_build-gpu
cuda=/usr/local/cuda
jobs=$(nproc 2>/dev/null || echo 2)
max_mib=48

die() { echo "gpu-bundle.sh: $*" >&2; exit 1; }
usage() { echo "gpu-bundle.sh: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
    case $1 in
    --out | --build | --cuda | --jobs | --max-mib)
        [ $# -ge 2 ] || usage "$1 needs a value"
        case $1 in
        --out) out=$2 ;;
        --build) build=$2 ;;
        --cuda) cuda=$2 ;;
        --jobs) jobs=$2 ;;
        --max-mib) max_mib=$2 ;;
        esac
        shift 2 ;;
    --help | -h)
        awk 'NR == 1 || /SPDX-License-Identifier/ { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
        exit 0 ;;
    *) usage "unknown option '$1' (see --help)" ;;
    esac
done
case $jobs in '' | *[!0-9]* | 0) usage "--jobs needs a positive integer" ;; esac
case $max_mib in '' | *[!0-9]* | 0) usage "--max-mib needs a positive integer" ;; esac
[ -x "$cuda/bin/nvcc" ] || die "no nvcc in $cuda/bin (give the toolkit with --cuda DIR)"
case $out in /*) ;; *) out=$(pwd)/$out ;; esac
case $build in /*) ;; *) build=$(pwd)/$build ;; esac

# --- configure and build ---------------------------------------------------------------------
if [ ! -x "$src/configure" ]; then
    echo "== autoreconf -fi (no configure script yet)"
    (cd "$src" && autoreconf -fi) || die "autoreconf failed"
fi
mkdir -p "$build"
if [ ! -f "$build/config.status" ]; then
    echo "== configure in $build"
    (cd "$build" && "$src/configure" --with-cuda="$cuda" --with-nccl="$cuda" --without-gloo \
        --without-hiredis --prefix=/opt/libfsdp) > "$build/configure.out" 2>&1 ||
        { tail -30 "$build/configure.out"; die "configure failed (log: $build/configure.out)"; }
fi
grep -q '^#define FSDP_HAVE_CUDA 1' "$build/config.h" ||
    die "$build is configured without CUDA (remove its config.status to reconfigure)"
grep -q '^#define FSDP_HAVE_NCCL 1' "$build/config.h" ||
    die "$build is configured without NCCL (remove its config.status to reconfigure)"

gpu_tests=$(awk '/^GPU_TESTS =/ { on = 1 } on { sub(/^GPU_TESTS =/, ""); c = sub(/\\$/, "");
    printf "%s ", $0; if (!c) exit }' "$build/Makefile" | tr -s ' ')
[ -n "$gpu_tests" ] || die "no GPU_TESTS in $build/Makefile"
tests="$gpu_tests tests/t_plugin.tap tests/t_cuda_host.tap"
echo "== make (-j$jobs) in $build"
# The library first, then the extra programs: one make with both goals would build the
# convenience libraries twice at once (all is a recursive make).
(cd "$build" && make -j"$jobs" && make -j"$jobs" $tests bench/bench_gpt_gpu) \
    > "$build/bundle-build.out" 2>&1 ||
    { tail -30 "$build/bundle-build.out"; die "make failed (log: $build/bundle-build.out)"; }

stage=$build/bundle-stage
rm -rf "$stage"
(cd "$build" && make install DESTDIR="$stage") > "$build/bundle-install.out" 2>&1 ||
    { tail -30 "$build/bundle-install.out"; die "make install failed"; }
prefix=$stage/opt/libfsdp

# --- the bundle ------------------------------------------------------------------------------
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib/libfsdp" "$out/tests" "$out/bench" "$out/data"
cp "$prefix/bin/fsdp-train" "$prefix/bin/fsdprun" "$out/bin/"
cp -P "$prefix"/lib/libfsdp.so* "$out/lib/"
cp "$prefix/lib/libfsdp/libfsdp-cuda.so" "$out/lib/libfsdp/"
for t in $tests; do
    # A program linked with the uninstalled libfsdp.la is a libtool wrapper; take its binary.
    b=$build/$t
    d=$(dirname "$b")/.libs/$(basename "$b")
    [ -f "$d" ] && b=$d
    cp "$b" "$out/tests/$(basename "$t")"
done
cp "$build/bench/bench_gpt_gpu" "$out/bench/"
for f in gpt2_gpu.sh lib.sh gpt2_torch_fsdp.py gpt_step_torch.py; do cp "$src/bench/$f" "$out/bench/"; done
cp "$src/data/corpus.txt" "$out/data/"
cp "$src/tools/gpu-run.sh" "$out/run.sh"
chmod +x "$out/run.sh"

# The shared libraries to carry: every dependency that ld.so resolves here except the C library,
# the GCC runtime, the CUDA driver and the CUDA libraries run.sh finds there, and libfsdp itself.
system_lib() {
    case $1 in
    linux-vdso.so.* | ld-linux*.so.* | libc.so.* | libm.so.* | libdl.so.* | libpthread.so.* | \
        librt.so.* | libutil.so.* | libresolv.so.* | libstdc++.so.* | libgcc_s.so.* | \
        libcuda.so.* | libcudart.so.* | libcublas.so.* | libcublasLt.so.* | libnccl.so.* | \
        libfsdp.so.*) return 0 ;;
    esac
    return 1
}
# Debug information is left here: the bundle would not fit otherwise (symbols stay, so
# backtraces still name functions).
strip --strip-debug "$out"/bin/* "$out"/lib/libfsdp.so.*.* "$out"/lib/libfsdp/*.so \
    "$out"/tests/* "$out/bench/bench_gpt_gpu" || die "strip failed"
carry=$build/bundle-carry
rm -rf "$carry"
mkdir -p "$carry"
for f in "$out"/bin/* "$out"/lib/libfsdp.so.*.* "$out"/lib/libfsdp/*.so "$out"/tests/* \
    "$out/bench/bench_gpt_gpu"; do
    LD_LIBRARY_PATH="$out/lib" ldd "$f" 2>/dev/null | awk '$2 == "=>" { print $1, $3 }'
done | sort -u | while read -r name path; do
    system_lib "$name" && continue
    [ -f "$path" ] || die "$name: not found here (ldd: $path)"
    [ -e "$carry/$name" ] || cp -L "$path" "$carry/$name"
done
# They travel compressed (OpenBLAS alone is 36 MB, 11 MB gzipped); env.sh unpacks them into
# lib/ the first time.
carried=$(cd "$carry" && ls)
tar czf "$out/lib/carried.tar.gz" -C "$carry" . || die "tar failed"
carried_sizes=$(cd "$carry" && for n in $carried; do printf ' %s (%d)' "$n" "$(stat -c %s "$n")"; done)

cat > "$out/env.sh" <<'EOF'
# env.sh: sourced by run.sh (with $bundle set to the bundle's directory); unpacks the carried
# shared libraries the first time, outside the bundle (in $TMPDIR, one folder per archive, so
# the bundle keeps its size and may be read-only), and puts lib/ and that folder on the library
# path, wherever the bundle lies. libfsdp finds the CUDA plugin by itself, in lib/libfsdp/.
carried_dir=
if [ -f "$bundle/lib/carried.tar.gz" ]; then
    carried_dir="${TMPDIR:-/tmp}/fsdp-gpu-bundle-libs.$(cksum < "$bundle/lib/carried.tar.gz" | cut -d' ' -f1)"
    if [ ! -f "$carried_dir/.carried" ]; then
        mkdir -p "$carried_dir" && tar xzf "$bundle/lib/carried.tar.gz" -C "$carried_dir" &&
            : > "$carried_dir/.carried"
    fi
fi
LD_LIBRARY_PATH="$bundle/lib${carried_dir:+:$carried_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
# The carried OpenBLAS takes its generic kernels on a CPU model it does not know (the GPU
# machine's, as libfsdp warns); AVX-512 ones are SkylakeX's.
if [ -z "${OPENBLAS_CORETYPE:-}" ] && grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
    export OPENBLAS_CORETYPE=SkylakeX
fi
EOF

# --- manifest and size -----------------------------------------------------------------------
commit=$(cd "$src" && git rev-parse --short HEAD 2>/dev/null || echo unknown)
dirty=$(cd "$src" && git status --porcelain --untracked-files=no 2>/dev/null | head -1)
{
    echo "libfsdp GPU bundle"
    echo "source: $commit${dirty:+ (with uncommitted changes)}"
    echo "made: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
    echo "configure: $(sed -n 's/^  \$ //p' "$build/config.log" | head -1)"
    echo "nvcc: $("$cuda/bin/nvcc" --version | tail -1)"
    echo "arch: $(sed -n 's/^NVCC_ARCH_FLAGS = //p' "$build/Makefile")"
    echo "carried libraries (lib/carried.tar.gz, bytes unpacked):$carried_sizes"
    echo
    (cd "$out" && find . -type f ! -name MANIFEST | sort | while read -r f; do
        printf '%10d  %s  %s\n' "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -c1-16)" "${f#./}"
    done)
} > "$out/MANIFEST"

kib=$(du -sk "$out" | cut -f1)
echo "== bundle: $out, $((kib / 1024)) MiB ($(find "$out" -type f | wc -l) files; carried:$carried_sizes)"
[ "$kib" -le $((max_mib * 1024)) ] || die "the bundle is $((kib / 1024)) MiB, over --max-mib $max_mib"
echo "run it here with: $out/run.sh   (on the device machine: gpu-bundle/run.sh; see --help)"
