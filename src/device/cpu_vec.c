/* SPDX-License-Identifier: MIT */
/*
 * cpu_vec.c: the f32 SIMD kernels declared in cpu_vec.h, dispatched at run time to the table
 * (cpu_vec_isa.h) built for the best instruction set the CPU has: AVX-512, AVX2 or the
 * baseline. The kernels themselves are in cpu_vec_impl.h; every table gives the same bits.
 */
#include <config.h>

#include <stdatomic.h>
#include <stddef.h>

#include "device/cpu_vec.h"
#include "device/cpu_vec_isa.h"
#include "internal.h"

/* The tables this build has, by FSDP_VEC_* (NULL: not built for this target). */
static const struct fsdp_vec_ops *const isa_ops[FSDP_VEC_NISA] = {
    [FSDP_VEC_BASE] = &fsdp__vec_ops_base,
#if FSDP_VEC_X86
    [FSDP_VEC_AVX2] = &fsdp__vec_ops_avx2,
    [FSDP_VEC_AVX512F] = &fsdp__vec_ops_avx512f,
#endif
};

static const char *const isa_names[FSDP_VEC_NISA] = {
    [FSDP_VEC_BASE] = "base", [FSDP_VEC_AVX2] = "avx2", [FSDP_VEC_AVX512F] = "avx512f"};

/* Whether the CPU (and the kernel, which must save the registers) has the instructions of isa.
 * The same test as the resolvers of target_clones (FSDP_CPU_CLONES). */
static int cpu_has(int isa) {
#if FSDP_VEC_X86
    __builtin_cpu_init(); /* may run before the constructors that would have called it */
    if (isa == FSDP_VEC_AVX2) return __builtin_cpu_supports("avx2");
    if (isa == FSDP_VEC_AVX512F) return __builtin_cpu_supports("avx512f");
#endif
    return isa == FSDP_VEC_BASE;
}

/* The current choice, FSDP_VEC_NISA until the first call makes it. Threads that make it at the
 * same time store the same value. */
static _Atomic int current = FSDP_VEC_NISA;

static int pick(void) {
    for (int isa = FSDP_VEC_NISA - 1; isa > FSDP_VEC_BASE; isa--)
        if (isa_ops[isa] && cpu_has(isa)) return isa;
    return FSDP_VEC_BASE;
}

int fsdp__vec_isa(void) {
    int isa = atomic_load_explicit(&current, memory_order_relaxed);
    if (isa == FSDP_VEC_NISA) {
        isa = pick();
        atomic_store_explicit(&current, isa, memory_order_relaxed);
    }
    return isa;
}

const char *fsdp__vec_isa_name(int isa) {
    return isa >= 0 && isa < FSDP_VEC_NISA ? isa_names[isa] : "?";
}

int fsdp__vec_set_isa(int isa) {
    if (isa < 0 || isa >= FSDP_VEC_NISA || !isa_ops[isa] || !cpu_has(isa)) return -1;
    atomic_store_explicit(&current, isa, memory_order_relaxed);
    return 0;
}

/* Whether the kernels prefetch (cpu_vec.h): -1 until the first call reads the environment. */
static _Atomic int prefetch_state = -1;

bool fsdp__vec_prefetch_on(void) {
    int on = atomic_load_explicit(&prefetch_state, memory_order_relaxed);
    if (on < 0) {
        on = !fsdp__env_is("FSDP_PREFETCH", "0");
        atomic_store_explicit(&prefetch_state, on, memory_order_relaxed);
    }
    return on;
}

void fsdp__vec_set_prefetch(bool on) {
    atomic_store_explicit(&prefetch_state, on ? 1 : 0, memory_order_relaxed);
}

static const struct fsdp_vec_ops *ops(void) {
    return isa_ops[fsdp__vec_isa()];
}

/*
 * The table for the reductions (max, sum, sumsq_dev, dot, ln_bwd_row): the baseline's where
 * AVX2 was chosen. GCC 12 keeps the AVX2 table's 64-byte vectors and 8-double accumulators in
 * memory, and bench_vec measured its reductions 1.1 to 3.6 times slower per element than the
 * baseline's (docs/design.md, "CPU kernels: SIMD and run-time dispatch"). Every table gives the
 * same bits, so mixing them changes no result.
 */
static const struct fsdp_vec_ops *reduce_ops(void) {
    const int isa = fsdp__vec_isa();
    return isa_ops[isa == FSDP_VEC_AVX2 ? FSDP_VEC_BASE : isa];
}

void fsdp__vec_exp_f32(size_t n, const float *x, float sub, float *y) {
    ops()->exp_f32(n, x, sub, y);
}

double fsdp__vec_exp_sum_f32(size_t n, const float *x, float sub, float *y) {
    return ops()->exp_sum_f32(n, x, sub, y);
}

void fsdp__vec_tanh_f32(size_t n, const float *x, float *y) {
    ops()->tanh_f32(n, x, y);
}

void fsdp__vec_gelu_tanh_f32(size_t n, const float *x, float *y) {
    ops()->gelu_tanh_f32(n, x, y);
}

void fsdp__vec_gelu_tanh_bwd_f32(size_t n, const float *x, const float *gy, float *gx) {
    ops()->gelu_tanh_bwd_f32(n, x, gy, gx);
}

float fsdp__vec_max_f32(size_t n, const float *x) {
    return reduce_ops()->max_f32(n, x);
}

double fsdp__vec_sum_f32(size_t n, const float *x) {
    return reduce_ops()->sum_f32(n, x);
}

double fsdp__vec_sumsq_dev_f32(size_t n, const float *x, double mu) {
    return reduce_ops()->sumsq_dev_f32(n, x, mu);
}

double fsdp__vec_dot_f32(size_t n, const float *a, const float *b) {
    return reduce_ops()->dot_f32(n, a, b);
}

void fsdp__vec_ln_bwd_row_f32(size_t n, const float *x, const float *w, float mt, float rt,
                              const float *gy, float *gx) {
    reduce_ops()->ln_bwd_row_f32(n, x, w, mt, rt, gy, gx);
}
