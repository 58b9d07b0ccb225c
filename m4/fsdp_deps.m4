# SPDX-License-Identifier: MIT
# fsdp_deps.m4: dependencies of libfsdp (BLAS, CUDA, NCCL, Gloo, hiredis, jansson).
#
# Each --with-X takes yes, no, DIR, check or nothing. Nothing means "check" (use it when found and
# say so in the summary), except for CUDA, which is off unless asked for. yes or DIR means
# required: a missing dependency stops configure.
# jansson is the exception: it is always required (see FSDP_CHECK_JANSSON).

# FSDP_DEP_REQUIRED(VALUE): true when the user asked for the dependency explicitly.
m4_define([FSDP_DEP_REQUIRED], [test "x$1" != xcheck && test "x$1" != xno])

# FSDP_CHECK_BLAS: a CBLAS (OpenBLAS preferred) for the CPU device's matrix products.
AC_DEFUN([FSDP_CHECK_BLAS], [
  AC_ARG_WITH([blas],
    [AS_HELP_STRING([--with-blas[[=LIB]]],
      [CBLAS library for CPU matrix products: openblas, blas, or a -l name (default: check)])],
    [], [with_blas=check])
  fsdp_have_blas=no
  BLAS_LIBS=
  AS_IF([test "x$with_blas" != xno], [
    AS_CASE([$with_blas], [check|yes], [fsdp_blas_libs="openblas blas cblas"],
            [fsdp_blas_libs=$with_blas])
    AC_CHECK_HEADERS([cblas.h], [
      fsdp_save_LIBS=$LIBS
      AC_SEARCH_LIBS([cblas_sgemm], [$fsdp_blas_libs], [fsdp_have_blas=yes])
      LIBS=$fsdp_save_LIBS
      AS_CASE([$ac_cv_search_cblas_sgemm],
        [no|"none required"], [],
        [BLAS_LIBS=$ac_cv_search_cblas_sgemm])
    ])
    AS_IF([test "x$fsdp_have_blas" = xno && FSDP_DEP_REQUIRED([$with_blas])],
      [AC_MSG_ERROR([--with-blas=$with_blas given but no CBLAS (cblas.h and cblas_sgemm) was found; install libopenblas-dev])])
  ])
  AS_IF([test "x$fsdp_have_blas" = xyes],
    [AC_DEFINE([FSDP_HAVE_BLAS], [1], [Define to 1 when a CBLAS is available.])
     fsdp_blas_summary="yes ($BLAS_LIBS)"],
    [fsdp_blas_summary=no])
  AM_CONDITIONAL([HAVE_BLAS], [test "x$fsdp_have_blas" = xyes])
  AC_SUBST([BLAS_LIBS])
])

# FSDP_LIBDIR_OF(PREFIX, LIB, VAR): sets VAR to the directory under PREFIX that holds libLIB.so:
# lib64 (NVIDIA's toolkit), lib/<multiarch> (Debian's nvidia-cuda-toolkit and libnccl-dev under
# /usr), lib, or targets/<arch>-linux/lib; PREFIX/lib when none does (the link check then fails).
AC_DEFUN([FSDP_LIBDIR_OF], [
  fsdp_multiarch=`$CC -print-multiarch 2>/dev/null`
  $3=$1/lib
  for fsdp_d in "$1/lib64" ${fsdp_multiarch:+"$1/lib/$fsdp_multiarch"} "$1/lib"                 "$1/targets/`uname -m`-linux/lib"; do
    AS_IF([test -e "$fsdp_d/lib$2.so"], [$3=$fsdp_d; break])
  done
])

# FSDP_SYSTEM_DIR(DIR): true when DIR is searched by the compiler or the dynamic linker anyway
# (/usr/include, /usr/lib, /usr/lib64, /usr/lib/<multiarch>, /lib...): no -I, -L or rpath for it.
m4_define([FSDP_SYSTEM_DIR], [AS_CASE([$1],
  [/usr/include|/usr/lib|/usr/lib64|/lib|/lib64|/usr/lib/$fsdp_multiarch|/lib/$fsdp_multiarch],
  [true], [false])])

# FSDP_CUDA_FLAGS(PREFIX, INCDIR, LIBDIR, CPPVAR, LDVAR): the -I, -L and rpath flags for a
# dependency installed under PREFIX, leaving out system directories; the rpath only when
# --enable-cuda-rpath (the default for a toolkit outside the system directories).
AC_DEFUN([FSDP_CUDA_FLAGS], [
  $4=
  $5=
  AS_IF([FSDP_SYSTEM_DIR([$2])], [], [$4="-I$2"])
  AS_IF([FSDP_SYSTEM_DIR([$3])], [], [
    $5="-L$3"
    AS_IF([test "x$enable_cuda_rpath" != xno], [$5="$[]$5 -Wl,-rpath,$3"])
  ])
])

# FSDP_CHECK_CUDA: CUDA runtime and nvcc; .cu files are compiled through build-aux/cudalt.sh.
# Off unless asked for: a package's contents must not depend on what the build machine has.
AC_DEFUN([FSDP_CHECK_CUDA], [
  AC_ARG_WITH([cuda],
    [AS_HELP_STRING([--with-cuda[[=DIR]]],
      [build the CUDA plugin against the toolkit in DIR; yes: /usr/local/cuda, else the system's
       (Debian's nvidia-cuda-toolkit); check: use it when found (default: no)])],
    [], [with_cuda=no])
  AC_ARG_ENABLE([cuda-rpath],
    [AS_HELP_STRING([--disable-cuda-rpath],
      [no run path to a CUDA or NCCL library directory outside the system's (default: set one, so
       that the plugin finds a toolkit in /usr/local/cuda without LD_LIBRARY_PATH)])],
    [], [enable_cuda_rpath=yes])
  AC_ARG_WITH([cuda-arch],
    [AS_HELP_STRING([--with-cuda-arch=FLAGS],
      [nvcc code generation flags (default: sm_90 code plus compute_90 PTX)])],
    [], [with_cuda_arch="-gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_90,code=compute_90"])
  AC_ARG_VAR([NVCC], [CUDA compiler])
  AC_ARG_VAR([NVCCFLAGS], [extra flags for nvcc])
  fsdp_have_cuda=no
  CUDA_CPPFLAGS=
  CUDA_LDFLAGS=
  CUDA_LIBS=
  AS_IF([test "x$with_cuda" != xno], [
    dnl yes and check look in NVIDIA's place first, then in the system's (Debian's layout: nvcc in
    dnl /usr/bin, the headers in /usr/include, the libraries in /usr/lib/<multiarch>).
    AS_CASE([$with_cuda], [check|yes], [fsdp_cuda_dirs="/usr/local/cuda /usr"],
            [fsdp_cuda_dirs=$with_cuda])
    fsdp_cuda_ok=no
    for fsdp_cuda_dir in $fsdp_cuda_dirs; do
      AS_IF([test -f "$fsdp_cuda_dir/include/cuda_runtime.h"], [fsdp_cuda_ok=yes; break])
    done
    FSDP_LIBDIR_OF([$fsdp_cuda_dir], [cudart], [fsdp_cuda_libdir])
    FSDP_CUDA_FLAGS([$fsdp_cuda_dir], [$fsdp_cuda_dir/include], [$fsdp_cuda_libdir],
                    [fsdp_cuda_cppflags], [fsdp_cuda_ldflags])
    fsdp_save_CPPFLAGS=$CPPFLAGS
    fsdp_save_LDFLAGS=$LDFLAGS
    fsdp_save_LIBS=$LIBS
    CPPFLAGS="$CPPFLAGS -I$fsdp_cuda_dir/include"
    LDFLAGS="$LDFLAGS -L$fsdp_cuda_libdir"
    AS_IF([test $fsdp_cuda_ok = yes],
      [AC_CHECK_HEADER([cuda_runtime.h], [], [fsdp_cuda_ok=no])])
    AS_IF([test $fsdp_cuda_ok = yes],
      [AC_CHECK_LIB([cudart], [cudaGetDeviceCount], [], [fsdp_cuda_ok=no])])
    AS_IF([test $fsdp_cuda_ok = yes], [
      AS_IF([test -z "$NVCC"], [AC_PATH_PROG([NVCC], [nvcc], [no], [$fsdp_cuda_dir/bin$PATH_SEPARATOR$PATH])])
      AS_IF([test "x$NVCC" = xno || test -z "$NVCC"], [fsdp_cuda_ok=no])
    ])
    AS_IF([test $fsdp_cuda_ok = yes], [
      AC_MSG_CHECKING([whether $NVCC compiles a kernel for $with_cuda_arch])
      cat > conftest.cu <<FSDP_EOF
__global__ void k(float *x) { x[[threadIdx.x]] = 1.0f; }
int main(void) { k<<<1, 1>>>(0); return 0; }
FSDP_EOF
      AS_IF([$NVCC $with_cuda_arch -c conftest.cu -o conftest.$OBJEXT >&AS_MESSAGE_LOG_FD 2>&1],
        [AC_MSG_RESULT([yes])], [AC_MSG_RESULT([no]); fsdp_cuda_ok=no])
      rm -f conftest.cu conftest.$OBJEXT
    ])
    CPPFLAGS=$fsdp_save_CPPFLAGS
    LDFLAGS=$fsdp_save_LDFLAGS
    LIBS=$fsdp_save_LIBS
    AS_IF([test $fsdp_cuda_ok = yes], [
      fsdp_have_cuda=yes
      CUDA_CPPFLAGS=$fsdp_cuda_cppflags
      CUDA_LDFLAGS=$fsdp_cuda_ldflags
      CUDA_LIBS="-lcudart -lstdc++"
    ], [FSDP_DEP_REQUIRED([$with_cuda])], [
      AC_MSG_ERROR([--with-cuda=$with_cuda given but CUDA was not usable in $fsdp_cuda_dirs (need include/cuda_runtime.h, libcudart.so and nvcc; see config.log)])
    ])
  ])
  AS_IF([test $fsdp_have_cuda = yes],
    [AC_DEFINE([FSDP_HAVE_CUDA], [1], [Define to 1 when the CUDA device is built.])
     fsdp_cuda_summary="yes ($fsdp_cuda_dir, libraries in $fsdp_cuda_libdir, $with_cuda_arch)"],
    [AS_IF([test "x$with_cuda" = xno], [fsdp_cuda_summary="no (--with-cuda builds the plugin)"],
           [fsdp_cuda_summary=no])])
  NVCC_ARCH_FLAGS=$with_cuda_arch
  AM_CONDITIONAL([HAVE_CUDA], [test $fsdp_have_cuda = yes])
  AC_SUBST([NVCC_ARCH_FLAGS])
  AC_SUBST([CUDA_CPPFLAGS])
  AC_SUBST([CUDA_LDFLAGS])
  AC_SUBST([CUDA_LIBS])
])

# FSDP_CHECK_NCCL: NCCL for the nccl process group; needs CUDA.
AC_DEFUN([FSDP_CHECK_NCCL], [
  AC_ARG_WITH([nccl],
    [AS_HELP_STRING([--with-nccl[[=DIR]]], [NCCL for the nccl backend (default: check, needs CUDA)])],
    [], [with_nccl=check])
  fsdp_have_nccl=no
  NCCL_CPPFLAGS=
  NCCL_LDFLAGS=
  NCCL_LIBS=
  AS_IF([test "x$with_nccl" != xno], [
    AS_IF([test $fsdp_have_cuda = no], [
      AS_IF([FSDP_DEP_REQUIRED([$with_nccl])],
        [AC_MSG_ERROR([--with-nccl needs CUDA, which is not enabled (use --with-cuda or --with-cuda=DIR)])])
    ], [
      AS_CASE([$with_nccl], [check|yes], [fsdp_nccl_dir=$fsdp_cuda_dir], [fsdp_nccl_dir=$with_nccl])
      FSDP_LIBDIR_OF([$fsdp_nccl_dir], [nccl], [fsdp_nccl_libdir])
      FSDP_CUDA_FLAGS([$fsdp_nccl_dir], [$fsdp_nccl_dir/include], [$fsdp_nccl_libdir],
                      [fsdp_nccl_cppflags], [fsdp_nccl_ldflags])
      fsdp_save_CPPFLAGS=$CPPFLAGS
      fsdp_save_LDFLAGS=$LDFLAGS
      fsdp_save_LIBS=$LIBS
      CPPFLAGS="$CPPFLAGS $CUDA_CPPFLAGS -I$fsdp_nccl_dir/include"
      LDFLAGS="$LDFLAGS $CUDA_LDFLAGS -L$fsdp_nccl_libdir"
      fsdp_nccl_ok=yes
      AC_CHECK_HEADER([nccl.h], [], [fsdp_nccl_ok=no])
      dnl A directory given explicitly must hold nccl.h itself (the CUDA include path may too).
      AS_IF([test "x$with_nccl" != xcheck && test "x$with_nccl" != xyes &&
             test ! -f "$fsdp_nccl_dir/include/nccl.h"], [fsdp_nccl_ok=no])
      AS_IF([test $fsdp_nccl_ok = yes],
        [AC_CHECK_LIB([nccl], [ncclCommInitRank], [], [fsdp_nccl_ok=no], [-lcudart])])
      CPPFLAGS=$fsdp_save_CPPFLAGS
      LDFLAGS=$fsdp_save_LDFLAGS
      LIBS=$fsdp_save_LIBS
      AS_IF([test $fsdp_nccl_ok = yes], [
        fsdp_have_nccl=yes
        NCCL_CPPFLAGS=$fsdp_nccl_cppflags
        NCCL_LDFLAGS=$fsdp_nccl_ldflags
        NCCL_LIBS=-lnccl
      ], [FSDP_DEP_REQUIRED([$with_nccl])], [
        AC_MSG_ERROR([--with-nccl=$with_nccl given but nccl.h or libnccl was not found in $fsdp_nccl_dir])
      ])
    ])
  ])
  AS_IF([test $fsdp_have_nccl = yes],
    [AC_DEFINE([FSDP_HAVE_NCCL], [1], [Define to 1 when NCCL is available.])
     fsdp_nccl_summary="found ($fsdp_nccl_dir)"],
    [fsdp_nccl_summary=no])
  AM_CONDITIONAL([HAVE_NCCL], [test $fsdp_have_nccl = yes])
  AC_SUBST([NCCL_CPPFLAGS])
  AC_SUBST([NCCL_LDFLAGS])
  AC_SUBST([NCCL_LIBS])
])

# FSDP_CHECK_CRYPTO: OpenSSL's libcrypto (Debian's libssl-dev) for HMAC-SHA256: the gloo
# backend's connections and the TCP store's clients prove they hold the job's key with it.
# Without it there is no gloo backend and the TCP store refuses a key (FSDP_STORE_KEY_FILE).
AC_DEFUN([FSDP_CHECK_CRYPTO], [
  fsdp_have_crypto=no
  CRYPTO_LIBS=
  fsdp_save_LIBS=$LIBS
  LIBS="-lcrypto $LIBS"
  AC_MSG_CHECKING([for OpenSSL's libcrypto (openssl/hmac.h, -lcrypto)])
  AC_LINK_IFELSE([AC_LANG_PROGRAM([[#include <openssl/evp.h>
#include <openssl/hmac.h>]],
      [[unsigned n = 0; unsigned char k[32] = {0}, o[32];
        return HMAC(EVP_sha256(), k, 32, k, 32, o, &n) == 0;]])],
    [fsdp_have_crypto=yes])
  AC_MSG_RESULT([$fsdp_have_crypto])
  LIBS=$fsdp_save_LIBS
  AS_IF([test $fsdp_have_crypto = yes],
    [CRYPTO_LIBS=-lcrypto
     AC_DEFINE([FSDP_HAVE_CRYPTO], [1], [Define to 1 when OpenSSL's libcrypto is available.])])
  AM_CONDITIONAL([HAVE_CRYPTO], [test $fsdp_have_crypto = yes])
  AC_SUBST([CRYPTO_LIBS])
])

# FSDP_CHECK_GLOO: Debian's libgloo-dev (C++) for the gloo process group.
AC_DEFUN([FSDP_CHECK_GLOO], [
  AC_ARG_WITH([gloo],
    [AS_HELP_STRING([--with-gloo[[=DIR]]], [Gloo for the gloo backend (default: check)])],
    [], [with_gloo=check])
  fsdp_have_gloo=no
  GLOO_CPPFLAGS=
  GLOO_LDFLAGS=
  GLOO_LIBS=
  AS_IF([test "x$with_gloo" != xno], [
    AS_CASE([$with_gloo], [check|yes], [fsdp_gloo_dir=], [fsdp_gloo_dir=$with_gloo])
    AS_IF([test -n "$fsdp_gloo_dir"],
      [GLOO_CPPFLAGS="-isystem $fsdp_gloo_dir/include"; GLOO_LDFLAGS="-L$fsdp_gloo_dir/lib"])
    AC_LANG_PUSH([C++])
    fsdp_save_CPPFLAGS=$CPPFLAGS
    fsdp_save_LDFLAGS=$LDFLAGS
    fsdp_save_LIBS=$LIBS
    CPPFLAGS="$CPPFLAGS $GLOO_CPPFLAGS"
    LDFLAGS="$LDFLAGS $GLOO_LDFLAGS"
    LIBS="-lgloo $LIBS"
    AC_MSG_CHECKING([for Gloo (gloo/context.h, -lgloo)${fsdp_gloo_dir:+ in $fsdp_gloo_dir}])
    AC_LINK_IFELSE([AC_LANG_PROGRAM([[#include <gloo/context.h>]],
                                    [[gloo::Context c(0, 1); return c.size - 1;]])],
      [fsdp_have_gloo=yes], [fsdp_have_gloo=no])
    dnl A directory given explicitly must hold the headers itself, not the system.
    AS_IF([test -n "$fsdp_gloo_dir" && test ! -f "$fsdp_gloo_dir/include/gloo/context.h"],
      [fsdp_have_gloo=no])
    AC_MSG_RESULT([$fsdp_have_gloo])
    CPPFLAGS=$fsdp_save_CPPFLAGS
    LDFLAGS=$fsdp_save_LDFLAGS
    LIBS=$fsdp_save_LIBS
    AC_LANG_POP([C++])
    dnl The backend's connections prove membership of the job with HMAC-SHA256 (gloo_mesh.c).
    fsdp_crypto_missing=no
    AS_IF([test $fsdp_have_gloo = yes && test $fsdp_have_crypto = no], [
      fsdp_have_gloo=no
      fsdp_crypto_missing=yes
      AS_IF([FSDP_DEP_REQUIRED([$with_gloo])],
        [AC_MSG_ERROR([the gloo backend authenticates its connections with OpenSSL's libcrypto, which was not found; install libssl-dev])],
        [AC_MSG_WARN([Gloo found but OpenSSL's libcrypto not: building without the gloo backend (install libssl-dev)])])])
    dnl Gloo is C++: programs linked with the C driver need its runtime too.
    AS_IF([test $fsdp_have_gloo = yes], [GLOO_LIBS="-lgloo -lstdc++"], [
      GLOO_CPPFLAGS=
      GLOO_LDFLAGS=
      AS_IF([FSDP_DEP_REQUIRED([$with_gloo]) && test $fsdp_crypto_missing = no],
        [AC_MSG_ERROR([--with-gloo=$with_gloo given but Gloo (gloo/context.h and -lgloo) was not found${fsdp_gloo_dir:+ in $fsdp_gloo_dir}; install libgloo-dev])])
    ])
  ])
  AS_IF([test $fsdp_have_gloo = yes],
    [AC_DEFINE([FSDP_HAVE_GLOO], [1], [Define to 1 when Gloo is available.])
     fsdp_gloo_summary="found${fsdp_gloo_dir:+ ($fsdp_gloo_dir)}"],
    [fsdp_gloo_summary=no])
  AM_CONDITIONAL([HAVE_GLOO], [test $fsdp_have_gloo = yes])
  AC_SUBST([GLOO_CPPFLAGS])
  AC_SUBST([GLOO_LDFLAGS])
  AC_SUBST([GLOO_LIBS])
])

# FSDP_CHECK_HIREDIS: Debian's libhiredis-dev for the Redis rendezvous store.
AC_DEFUN([FSDP_CHECK_HIREDIS], [
  AC_ARG_WITH([hiredis],
    [AS_HELP_STRING([--with-hiredis[[=DIR]]], [hiredis for the Redis store (default: check)])],
    [], [with_hiredis=check])
  fsdp_have_hiredis=no
  HIREDIS_CPPFLAGS=
  HIREDIS_LDFLAGS=
  HIREDIS_LIBS=
  AS_IF([test "x$with_hiredis" != xno], [
    AS_CASE([$with_hiredis], [check|yes], [fsdp_hiredis_dir=], [fsdp_hiredis_dir=$with_hiredis])
    AS_IF([test -n "$fsdp_hiredis_dir"],
      [HIREDIS_CPPFLAGS="-I$fsdp_hiredis_dir/include"; HIREDIS_LDFLAGS="-L$fsdp_hiredis_dir/lib"])
    fsdp_save_CPPFLAGS=$CPPFLAGS
    fsdp_save_LDFLAGS=$LDFLAGS
    fsdp_save_LIBS=$LIBS
    CPPFLAGS="$CPPFLAGS $HIREDIS_CPPFLAGS"
    LDFLAGS="$LDFLAGS $HIREDIS_LDFLAGS"
    LIBS="-lhiredis $LIBS"
    AC_MSG_CHECKING([for hiredis (hiredis/hiredis.h, -lhiredis)${fsdp_hiredis_dir:+ in $fsdp_hiredis_dir}])
    AC_LINK_IFELSE([AC_LANG_PROGRAM([[#include <hiredis/hiredis.h>]],
                                    [[struct timeval tv = {1, 0};
                                      redisContext *c = redisConnectWithTimeout("localhost", 1, tv);
                                      redisFree(c); return 0;]])],
      [fsdp_have_hiredis=yes], [fsdp_have_hiredis=no])
    dnl A directory given explicitly must hold the headers itself, not the system.
    AS_IF([test -n "$fsdp_hiredis_dir" && test ! -f "$fsdp_hiredis_dir/include/hiredis/hiredis.h"],
      [fsdp_have_hiredis=no])
    AC_MSG_RESULT([$fsdp_have_hiredis])
    CPPFLAGS=$fsdp_save_CPPFLAGS
    LDFLAGS=$fsdp_save_LDFLAGS
    LIBS=$fsdp_save_LIBS
    AS_IF([test $fsdp_have_hiredis = yes], [HIREDIS_LIBS=-lhiredis], [
      HIREDIS_CPPFLAGS=
      HIREDIS_LDFLAGS=
      AS_IF([FSDP_DEP_REQUIRED([$with_hiredis])],
        [AC_MSG_ERROR([--with-hiredis=$with_hiredis given but hiredis (hiredis/hiredis.h and -lhiredis) was not found${fsdp_hiredis_dir:+ in $fsdp_hiredis_dir}; install libhiredis-dev])])
    ])
  ])
  AS_IF([test $fsdp_have_hiredis = yes],
    [AC_DEFINE([FSDP_HAVE_HIREDIS], [1], [Define to 1 when hiredis is available for the Redis store.])
     fsdp_hiredis_summary="found${fsdp_hiredis_dir:+ ($fsdp_hiredis_dir)}"],
    [fsdp_hiredis_summary=no])
  AM_CONDITIONAL([HAVE_HIREDIS], [test $fsdp_have_hiredis = yes])
  AC_SUBST([HIREDIS_CPPFLAGS])
  AC_SUBST([HIREDIS_LDFLAGS])
  AC_SUBST([HIREDIS_LIBS])
])

# FSDP_CHECK_JANSSON: Debian's libjansson-dev, the JSON parser of the safetensors reader and
# writer (src/io/). Required, unlike the dependencies above: checkpoints are part of every
# build, so a missing jansson stops configure instead of producing a library whose
# safetensors functions all fail. --with-jansson=DIR looks in DIR/include and DIR/lib.
AC_DEFUN([FSDP_CHECK_JANSSON], [
  AC_ARG_WITH([jansson],
    [AS_HELP_STRING([--with-jansson[[=DIR]]], [jansson for safetensors checkpoints (required)])],
    [], [with_jansson=check])
  AS_IF([test "x$with_jansson" = xno],
    [AC_MSG_ERROR([jansson cannot be disabled: libfsdp reads and writes safetensors checkpoints with it (install libjansson-dev)])])
  JANSSON_CPPFLAGS=
  JANSSON_LDFLAGS=
  JANSSON_LIBS=
  AS_CASE([$with_jansson], [check|yes], [fsdp_jansson_dir=], [fsdp_jansson_dir=$with_jansson])
  AS_IF([test -n "$fsdp_jansson_dir"],
    [JANSSON_CPPFLAGS="-I$fsdp_jansson_dir/include"; JANSSON_LDFLAGS="-L$fsdp_jansson_dir/lib"])
  fsdp_save_CPPFLAGS=$CPPFLAGS
  fsdp_save_LDFLAGS=$LDFLAGS
  fsdp_save_LIBS=$LIBS
  CPPFLAGS="$CPPFLAGS $JANSSON_CPPFLAGS"
  LDFLAGS="$LDFLAGS $JANSSON_LDFLAGS"
  LIBS="-ljansson $LIBS"
  dnl JSON_REJECT_DUPLICATES and json_loadb are what the reader relies on (jansson >= 2.1).
  AC_MSG_CHECKING([for jansson (jansson.h, -ljansson)${fsdp_jansson_dir:+ in $fsdp_jansson_dir}])
  AC_LINK_IFELSE([AC_LANG_PROGRAM([[#include <jansson.h>]],
                                  [[json_error_t e;
                                    json_t *j = json_loadb("{}", 2, JSON_REJECT_DUPLICATES, &e);
                                    int ok = j && json_is_object(j); json_decref(j);
                                    return !ok;]])],
    [fsdp_have_jansson=yes], [fsdp_have_jansson=no])
  dnl A directory given explicitly must hold the headers itself, not the system.
  AS_IF([test -n "$fsdp_jansson_dir" && test ! -f "$fsdp_jansson_dir/include/jansson.h"],
    [fsdp_have_jansson=no])
  AC_MSG_RESULT([$fsdp_have_jansson])
  CPPFLAGS=$fsdp_save_CPPFLAGS
  LDFLAGS=$fsdp_save_LDFLAGS
  LIBS=$fsdp_save_LIBS
  AS_IF([test $fsdp_have_jansson = yes], [JANSSON_LIBS=-ljansson],
    [AC_MSG_ERROR([jansson (jansson.h and -ljansson) was not found${fsdp_jansson_dir:+ in $fsdp_jansson_dir}; libfsdp needs it for safetensors checkpoints: install libjansson-dev, or give --with-jansson=DIR])])
  fsdp_jansson_summary="found${fsdp_jansson_dir:+ ($fsdp_jansson_dir)}"
  AC_SUBST([JANSSON_CPPFLAGS])
  AC_SUBST([JANSSON_LDFLAGS])
  AC_SUBST([JANSSON_LIBS])
])
