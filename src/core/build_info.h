/* SPDX-License-Identifier: MIT */
/*
 * build_info.h: FSDP_BUILD_INFO, the one line that says how this build was made: the version,
 * the git revision of a git checkout (core/git-revision.h, made by make in the build tree), and
 * what configure compiled in (config.h). fsdp_build_info() returns it, and fsdprun, which does
 * not link the library, prints it for --version.
 */
#ifndef FSDP_CORE_BUILD_INFO_H
#define FSDP_CORE_BUILD_INFO_H

#include <config.h>

#include "core/git-revision.h"

#ifdef FSDP_HAVE_GLOO
#define FSDP_INFO_GLOO " gloo"
#else
#define FSDP_INFO_GLOO ""
#endif
#ifdef FSDP_HAVE_NCCL
#define FSDP_INFO_NCCL " nccl"
#else
#define FSDP_INFO_NCCL ""
#endif
#ifdef FSDP_HAVE_CUDA
#define FSDP_INFO_CUDA " cuda"
#else
#define FSDP_INFO_CUDA ""
#endif
#ifdef FSDP_HAVE_BLAS
#define FSDP_INFO_BLAS "yes"
#else
#define FSDP_INFO_BLAS "no (built-in kernels)"
#endif
#ifdef FSDP_HAVE_HIREDIS
#define FSDP_INFO_REDIS "yes"
#else
#define FSDP_INFO_REDIS "no"
#endif

#define FSDP_BUILD_INFO                                                                            \
    "libfsdp " PACKAGE_VERSION FSDP_GIT_REVISION "; backends: sim" FSDP_INFO_GLOO FSDP_INFO_NCCL  \
    "; devices: cpu" FSDP_INFO_CUDA "; BLAS: " FSDP_INFO_BLAS "; Redis store: " FSDP_INFO_REDIS

#endif /* FSDP_CORE_BUILD_INFO_H */
