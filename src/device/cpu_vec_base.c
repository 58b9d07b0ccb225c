/* SPDX-License-Identifier: MIT */
/*
 * cpu_vec_base.c: the f32 SIMD kernels (cpu_vec_impl.h) for the baseline instruction set of the
 * build: SSE2 on x86-64, the target's own vector unit elsewhere.
 */
#include <config.h>

#define VEC_OPS fsdp__vec_ops_base
#include "device/cpu_vec_impl.h"
