# SPDX-License-Identifier: MIT
# fsdp_flags.m4: compiler flags, threads and sanitizers for libfsdp.

# FSDP_CHECK_PTHREAD: make -pthread part of CFLAGS and LIBS (glibc needs both for static links).
AC_DEFUN([FSDP_CHECK_PTHREAD], [
  AC_MSG_CHECKING([whether $CC accepts -pthread])
  fsdp_save_CFLAGS=$CFLAGS
  CFLAGS="$CFLAGS -pthread"
  AC_LINK_IFELSE([AC_LANG_PROGRAM([[#include <pthread.h>]],
                                  [[pthread_t t; return pthread_create(&t, 0, 0, 0);]])],
    [AC_MSG_RESULT([yes]); PTHREAD_CFLAGS=-pthread],
    [AC_MSG_RESULT([no]); PTHREAD_CFLAGS=])
  CFLAGS=$fsdp_save_CFLAGS
  AS_IF([test -z "$PTHREAD_CFLAGS"],
    [AC_SEARCH_LIBS([pthread_create], [pthread], [],
       [AC_MSG_ERROR([POSIX threads are required])])])
  AC_SUBST([PTHREAD_CFLAGS])
])

# FSDP_TRY_CFLAG(FLAG, VAR): append FLAG to VAR when the compiler accepts it with -Werror.
AC_DEFUN([FSDP_TRY_CFLAG], [
  AC_MSG_CHECKING([whether $CC accepts $1])
  fsdp_save_CFLAGS=$CFLAGS
  CFLAGS="$CFLAGS -Werror $1"
  AC_COMPILE_IFELSE([AC_LANG_PROGRAM([], [])],
    [AC_MSG_RESULT([yes]); $2="$$2 $1"], [AC_MSG_RESULT([no])])
  CFLAGS=$fsdp_save_CFLAGS
])

# FSDP_CHECK_CFLAGS: warnings (and -Werror with --enable-werror), hidden visibility.
AC_DEFUN([FSDP_CHECK_CFLAGS], [
  AC_ARG_ENABLE([werror],
    [AS_HELP_STRING([--enable-werror], [treat compiler warnings as errors])],
    [], [enable_werror=no])
  FSDP_WARN_CFLAGS=
  for fsdp_flag in -std=c11 -Wall -Wextra -Wstrict-prototypes -Wmissing-prototypes \
                   -Wshadow -Wpointer-arith -Wvla -Wno-unused-parameter; do
    FSDP_TRY_CFLAG([$fsdp_flag], [FSDP_WARN_CFLAGS])
  done
  AS_IF([test "x$enable_werror" = xyes], [FSDP_WARN_CFLAGS="$FSDP_WARN_CFLAGS -Werror"])
  FSDP_VISIBILITY_CFLAGS=
  FSDP_TRY_CFLAG([-fvisibility=hidden], [FSDP_VISIBILITY_CFLAGS])
  # Kernel code generation (see "CPU kernels: SIMD" in docs/design.md). GCC's -O2 vectorizes
  # only loops whose trip count is a known multiple of the vector width; the dynamic cost model
  # vectorizes the kernels' elementwise loops (with run-time alias checks and scalar tails),
  # -fno-math-errno lets sqrt become one instruction instead of a call guarded for errno, and
  # -ffp-contract=off (implied by GCC's -std=c11, not by clang's, which fuses within an
  # expression when the target has FMA, as AVX-512 does) is explicit because the bitwise
  # agreement of the multiversioned kernels depends on it. None of them changes a result: no
  # reassociation, no fused multiply-add. -Wno-psabi silences the compilers' note on 64-byte
  # vectors passed between the inlined helpers of cpu_vec_impl.h. Clang has no
  # -fvect-cost-model (its vectorizer's cost model needs no flag): it warns, so the -Werror
  # probe leaves it out, as it does any flag a compiler does not know.
  FSDP_KERNEL_CFLAGS=
  for fsdp_flag in -fvect-cost-model=dynamic -fno-math-errno -ffp-contract=off -Wno-psabi; do
    FSDP_TRY_CFLAG([$fsdp_flag], [FSDP_KERNEL_CFLAGS])
  done
  # Reproducible builds: the build directory (debug information's compilation directory) is
  # recorded as ".", so the same sources built in two directories give the same bytes. A
  # directory whose name has a space or "=" keeps its name (the flag could not say it).
  FSDP_REPRO_FLAGS=
  fsdp_abs_builddir=`pwd`
  AS_CASE([$fsdp_abs_builddir], [*[[\ =]]*], [],
    [FSDP_TRY_CFLAG([-ffile-prefix-map=$fsdp_abs_builddir=.], [FSDP_REPRO_FLAGS])])
  AC_SUBST([FSDP_WARN_CFLAGS])
  AC_SUBST([FSDP_VISIBILITY_CFLAGS])
  AC_SUBST([FSDP_KERNEL_CFLAGS])
  AC_SUBST([FSDP_REPRO_FLAGS])
])

# FSDP_TRY_CXXFLAG(FLAG, VAR): append FLAG to VAR when the C++ compiler accepts it with -Werror.
AC_DEFUN([FSDP_TRY_CXXFLAG], [
  AC_MSG_CHECKING([whether $CXX accepts $1])
  AC_LANG_PUSH([C++])
  fsdp_save_CXXFLAGS=$CXXFLAGS
  CXXFLAGS="$CXXFLAGS -Werror $1"
  AC_COMPILE_IFELSE([AC_LANG_PROGRAM([], [])],
    [AC_MSG_RESULT([yes]); $2="$$2 $1"], [AC_MSG_RESULT([no])])
  CXXFLAGS=$fsdp_save_CXXFLAGS
  AC_LANG_POP([C++])
])

# FSDP_CHECK_CXXFLAGS: warnings for the only C++ file (the Gloo transport): the C set minus the
# C-only flags, plus -Werror with --enable-werror. Call after FSDP_CHECK_CFLAGS. Gloo's own
# headers come in as system headers (-isystem), so their warnings do not count.
AC_DEFUN([FSDP_CHECK_CXXFLAGS], [
  FSDP_WARN_CXXFLAGS=
  for fsdp_flag in -std=c++17 -Wall -Wextra -Wshadow -Wpointer-arith -Wvla \
                   -Wno-unused-parameter; do
    FSDP_TRY_CXXFLAG([$fsdp_flag], [FSDP_WARN_CXXFLAGS])
  done
  AS_IF([test "x$enable_werror" = xyes], [FSDP_WARN_CXXFLAGS="$FSDP_WARN_CXXFLAGS -Werror"])
  AC_SUBST([FSDP_WARN_CXXFLAGS])
])

# FSDP_ARG_SANITIZERS: --enable-sanitizers=address,undefined | thread. The flags go to C and C++
# alike (FSDP_SANITIZER_CFLAGS and FSDP_SANITIZER_CXXFLAGS), with one exception: clang's
# -fsanitize=undefined checks C++ virtual calls (vptr) with handlers that live in the C++ part of
# its runtime, which the C driver that links every program of the tree leaves out (undefined
# __ubsan_vptr_type_cache). Under clang the one C++ file (the Gloo transport) is therefore built
# with -fno-sanitize=vptr; GCC's runtime has the handlers, and keeps the check. Every report is
# fatal: -fno-sanitize-recover=all here, and UBSAN_OPTIONS=halt_on_error=1 in make check.
AC_DEFUN([FSDP_ARG_SANITIZERS], [
  AC_ARG_ENABLE([sanitizers],
    [AS_HELP_STRING([--enable-sanitizers=LIST],
      [build with -fsanitize=LIST (address,undefined or thread)])],
    [], [enable_sanitizers=no])
  fsdp_sanitizers=
  FSDP_SANITIZER_CFLAGS=
  FSDP_SANITIZER_CXXFLAGS=
  FSDP_SANITIZER_LDFLAGS=
  AS_CASE([$enable_sanitizers],
    [no|""], [],
    [yes], [fsdp_sanitizers=address,undefined],
    [fsdp_sanitizers=$enable_sanitizers])
  AS_IF([test -n "$fsdp_sanitizers"], [
    AS_CASE([,$fsdp_sanitizers,],
      [*,thread,*address*|*address*,thread,*],
        [AC_MSG_ERROR([--enable-sanitizers: thread cannot be combined with address])])
    fsdp_san_flags="-fsanitize=$fsdp_sanitizers -fno-omit-frame-pointer -fno-sanitize-recover=all -g"
    AC_MSG_CHECKING([whether $CC supports $fsdp_san_flags])
    fsdp_save_CFLAGS=$CFLAGS
    fsdp_save_LDFLAGS=$LDFLAGS
    CFLAGS="$CFLAGS $fsdp_san_flags"
    LDFLAGS="$LDFLAGS -fsanitize=$fsdp_sanitizers"
    AC_LINK_IFELSE([AC_LANG_PROGRAM([], [])],
      [AC_MSG_RESULT([yes])],
      [AC_MSG_RESULT([no])
       AC_MSG_ERROR([--enable-sanitizers=$fsdp_sanitizers: the compiler or its runtime is missing])])
    CFLAGS=$fsdp_save_CFLAGS
    LDFLAGS=$fsdp_save_LDFLAGS
    FSDP_SANITIZER_CFLAGS=$fsdp_san_flags
    FSDP_SANITIZER_CXXFLAGS=$fsdp_san_flags
    FSDP_SANITIZER_LDFLAGS="-fsanitize=$fsdp_sanitizers"
    AS_CASE([,$fsdp_sanitizers,], [*,undefined,*], [
      AC_LANG_PUSH([C++])
      AC_COMPILE_IFELSE([AC_LANG_PROGRAM([], [[
#ifndef __clang__
#error not clang
#endif
]])], [FSDP_SANITIZER_CXXFLAGS="$fsdp_san_flags -fno-sanitize=vptr"])
      AC_LANG_POP([C++])])
  ])
  AM_CONDITIONAL([FSDP_TSAN], [test "x$fsdp_sanitizers" = xthread])
  AC_SUBST([FSDP_SANITIZER_CFLAGS])
  AC_SUBST([FSDP_SANITIZER_CXXFLAGS])
  AC_SUBST([FSDP_SANITIZER_LDFLAGS])
])

# FSDP_ARG_FUZZING: --enable-fuzzing builds the libFuzzer targets of fuzz/ (docs/fuzzing.md).
# Needs a compiler with libFuzzer (clang; on Debian the clang package and libclang-rt-N-dev, which
# holds libclang_rt.fuzzer). Every C file is then compiled with -fsanitize=fuzzer-no-link, so
# that coverage guides the fuzzer through the library and not only through the target, and the
# targets are linked with -fsanitize=fuzzer (libFuzzer's main). Unless --enable-sanitizers says
# otherwise, it turns on address,undefined: a fuzzer without them finds only crashes. Call before
# FSDP_ARG_SANITIZERS.
AC_DEFUN([FSDP_ARG_FUZZING], [
  AC_ARG_ENABLE([fuzzing],
    [AS_HELP_STRING([--enable-fuzzing],
      [build the libFuzzer targets of fuzz/ (clang; implies --enable-sanitizers=address,undefined
       unless that is given)])],
    [], [enable_fuzzing=no])
  FSDP_FUZZ_CFLAGS=
  FSDP_FUZZ_LDFLAGS=
  AS_IF([test "x$enable_fuzzing" = xyes], [
    AS_IF([test "x${enable_sanitizers+set}" != xset], [enable_sanitizers=address,undefined])
    AS_CASE([,$enable_sanitizers,], [*,thread,*],
      [AC_MSG_ERROR([--enable-fuzzing: libFuzzer does not run under ThreadSanitizer])])
    AS_CASE([$enable_sanitizers], [no|""], [fsdp_fuzz_san=], [yes], [fsdp_fuzz_san=address,undefined],
      [fsdp_fuzz_san=$enable_sanitizers])
    fsdp_fuzz_san=${fsdp_fuzz_san:+,$fsdp_fuzz_san}
    AC_MSG_CHECKING([whether $CC builds libFuzzer targets])
    fsdp_save_CFLAGS=$CFLAGS
    fsdp_save_LDFLAGS=$LDFLAGS
    CFLAGS="$CFLAGS -fsanitize=fuzzer$fsdp_fuzz_san"
    LDFLAGS="$LDFLAGS -fsanitize=fuzzer$fsdp_fuzz_san"
    AC_LINK_IFELSE([AC_LANG_SOURCE([[
#include <stddef.h>
#include <stdint.h>
int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n);
int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { return n && d[0] == 'x'; }
]])], [fsdp_fuzz_ok=yes], [fsdp_fuzz_ok=no])
    AS_IF([test "$fsdp_fuzz_ok" = yes], [
      dnl the library and the tests: instrumented, linked without libFuzzer's main
      CFLAGS="$fsdp_save_CFLAGS -fsanitize=fuzzer-no-link$fsdp_fuzz_san"
      LDFLAGS="$fsdp_save_LDFLAGS -fsanitize=fuzzer-no-link$fsdp_fuzz_san"
      AC_LINK_IFELSE([AC_LANG_PROGRAM([], [])], [], [fsdp_fuzz_ok=no])])
    CFLAGS=$fsdp_save_CFLAGS
    LDFLAGS=$fsdp_save_LDFLAGS
    AC_MSG_RESULT([$fsdp_fuzz_ok])
    AS_IF([test "$fsdp_fuzz_ok" != yes],
      [AC_MSG_ERROR([--enable-fuzzing needs a compiler with libFuzzer: CC=clang (Debian: the clang
  and libclang-rt-dev packages)])])
    FSDP_FUZZ_CFLAGS=-fsanitize=fuzzer-no-link
    FSDP_FUZZ_LDFLAGS=-fsanitize=fuzzer
  ])
  AM_CONDITIONAL([FSDP_FUZZING], [test "x$enable_fuzzing" = xyes])
  AC_SUBST([FSDP_FUZZ_CFLAGS])
  AC_SUBST([FSDP_FUZZ_LDFLAGS])
])
