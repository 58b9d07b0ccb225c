/* SPDX-License-Identifier: MIT */
/*
 * cpu_vec_avx2.c: the f32 SIMD kernels (cpu_vec_impl.h) for AVX2 (a 64-byte vector is two
 * registers), on x86-64
 * only; cpu_vec.c calls them only on a CPU that has the instructions. Every function of the
 * file, the inlined helpers included, is compiled for the same target (cpu_vec_isa.h says why).
 */
#include <config.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "device/cpu_vec_isa.h"

#if FSDP_VEC_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2"))), apply_to = function)
#else
#pragma GCC target("avx2")
#endif

#define VEC_OPS fsdp__vec_ops_avx2
#include "device/cpu_vec_impl.h"

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
