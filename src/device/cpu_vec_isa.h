/* SPDX-License-Identifier: MIT */
/*
 * cpu_vec_isa.h: the tables of f32 SIMD kernels, one per instruction set, between cpu_vec.c
 * (which picks one at run time) and the files that build them from cpu_vec_impl.h.
 *
 * Why not target_clones: the kernels call inlined helpers that take and return 64-byte vectors.
 * Under target_clones the helpers are compiled for the baseline and inlined into the AVX-512
 * clone, and clang refuses that call ("AVX vector argument ... without 'avx512f' enabled
 * changes the ABI"), although after inlining no call is left. Here each instruction set has a
 * file of its own in which every function, helpers included, carries the same target, so
 * GCC and clang build the same code (see "CPU kernels: SIMD" in docs/design.md).
 */
#ifndef FSDP_CPU_VEC_ISA_H
#define FSDP_CPU_VEC_ISA_H

#include <stddef.h>

/* x86-64 with GCC or clang: AVX2 and AVX-512 tables beside the baseline (SSE2). Elsewhere the
 * baseline table is the only one, built for the target's own vector unit. */
#if defined(__x86_64__) && defined(__GNUC__)
#define FSDP_VEC_X86 1
#else
#define FSDP_VEC_X86 0
#endif

/* One table: the kernels of cpu_vec.h, same arguments, same results to the bit. */
struct fsdp_vec_ops {
    void (*exp_f32)(size_t n, const float *x, float sub, float *y);
    double (*exp_sum_f32)(size_t n, const float *x, float sub, float *y);
    void (*tanh_f32)(size_t n, const float *x, float *y);
    void (*gelu_tanh_f32)(size_t n, const float *x, float *y);
    void (*gelu_tanh_bwd_f32)(size_t n, const float *x, const float *gy, float *gx);
    float (*max_f32)(size_t n, const float *x);
    double (*sum_f32)(size_t n, const float *x);
    double (*sumsq_dev_f32)(size_t n, const float *x, double mu);
    double (*dot_f32)(size_t n, const float *a, const float *b);
    void (*ln_bwd_row_f32)(size_t n, const float *x, const float *w, float mt, float rt,
                           const float *gy, float *gx);
};

extern const struct fsdp_vec_ops fsdp__vec_ops_base;
#if FSDP_VEC_X86
extern const struct fsdp_vec_ops fsdp__vec_ops_avx2;
extern const struct fsdp_vec_ops fsdp__vec_ops_avx512f;
#endif

#endif
