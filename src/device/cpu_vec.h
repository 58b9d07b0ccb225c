/* SPDX-License-Identifier: MIT */
/*
 * cpu_vec.h: f32 array kernels of the CPU device that are written for SIMD (cpu_vec.c): exp,
 * tanh and the tanh-approximated GELU with its derivative, and the row reductions of softmax
 * and layer norm.
 *
 * Invariants every caller may rely on:
 *   - Results are bitwise the same on every x86-64 CPU and at every vector width: each element
 *     goes through the same sequence of IEEE operations (no fused multiply-adds, see
 *     FSDP_CPU_CLONES), and reductions use a fixed number of lanes combined in a fixed order,
 *     so the instruction set chosen at run time changes the speed and never the bits.
 *   - exp and tanh are within 3 ulp of the correctly rounded result over the whole f32 range
 *     (tests/t_device_vec checks a sweep against the double functions), propagate NaN, and give
 *     exp(-inf) = 0, exp(+inf) = +inf, tanh(+-inf) = +-1.
 *   - Outputs may alias inputs exactly (y == x), never partially.
 */
#ifndef FSDP_CPU_VEC_H
#define FSDP_CPU_VEC_H

#include <stdbool.h>
#include <stddef.h>

#include "core/sanitizer.h"

/*
 * Function multiversioning, for the generic kernels of cpu_kernels.c and cpu_nn_kernels.c: on
 * x86-64 with GCC (or a clang that has the attribute) and an ELF target (ifunc), a function
 * carrying FSDP_CPU_CLONES is compiled for AVX-512, AVX2 and the baseline, and the loader picks
 * one for the CPU. Elsewhere it expands to nothing and the portable code runs. The build passes
 * -ffp-contract=off (FSDP_KERNEL_CFLAGS), so the AVX2 and AVX-512 clones do not fuse
 * multiply-adds and compute the baseline's bits. The kernels below are not clones: cpu_vec.c
 * dispatches them itself (cpu_vec_isa.h says why).
 */
/* Not under ThreadSanitizer: the clones' ifunc resolvers run while the dynamic loader relocates
 * the program, before the TSan runtime is initialized, and their instrumentation crashes there. */
#if FSDP_UNDER_TSAN && !defined(FSDP_NO_CLONES)
#define FSDP_NO_CLONES 1
#endif
#if defined(__x86_64__) && defined(__ELF__) && defined(__has_attribute) && !defined(FSDP_NO_CLONES)
#if __has_attribute(target_clones)
#define FSDP_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef FSDP_CPU_CLONES
#define FSDP_CPU_CLONES
#endif

/*
 * Software prefetch, for the kernels that stream arrays larger than the caches: GELU forward and
 * backward, exp (the cross-entropy's backward over the logits), layer norm's backward, and the
 * attention's row norms (rows at the stride of the packed q, k and v). In a training step
 * those arrays were written long before (a saved activation, the input of a layer norm) and come
 * from memory, and the kernels stalled on their loads: perf put a third of GELU's backward on the
 * instruction after the load of x. The hardware prefetchers do not cross a 4 KiB page and do not
 * follow rows at a stride. A prefetch changes no value, so the results are the same with or
 * without it.
 */
/* How far ahead of the element being computed the streaming kernels prefetch, in bytes. */
#define FSDP_PREFETCH_AHEAD 2048
#define FSDP_CACHE_LINE 64
#if defined(__GNUC__)
#define FSDP_PREFETCH_LINE(p) __builtin_prefetch((p), 0, 0)
#else
#define FSDP_PREFETCH_LINE(p) ((void)(p))
#endif

/* Whether the kernels prefetch: yes, unless the environment sets FSDP_PREFETCH=0 (read at the
 * first call), or fsdp__vec_set_prefetch changed it. For comparisons only; results do not
 * depend on it. */
bool fsdp__vec_prefetch_on(void);

/* Sets whether the kernels prefetch (tests compare the two). */
void fsdp__vec_set_prefetch(bool on);

/* Prefetches the lines of [p, p + bytes) for reading, which must lie inside the caller's
 * array. */
static inline void fsdp__prefetch(const void *p, size_t bytes) {
    const char *c = (const char *)p;
    for (size_t o = 0; o < bytes; o += FSDP_CACHE_LINE)
        FSDP_PREFETCH_LINE(c + o);
}

/* Prefetches the line FSDP_PREFETCH_AHEAD bytes after element i of base, an array of n
 * elements of es bytes each, when that element is inside it. */
static inline void fsdp__prefetch_ahead(const void *base, size_t i, size_t n, size_t es) {
    const size_t ahead = FSDP_PREFETCH_AHEAD / es;
    if (i + ahead < n) FSDP_PREFETCH_LINE((const char *)base + (i + ahead) * es);
}

/* The instruction sets the kernels below are built for (AVX2 and AVX-512 on x86-64 only). */
enum { FSDP_VEC_BASE, FSDP_VEC_AVX2, FSDP_VEC_AVX512F, FSDP_VEC_NISA };

/* The instruction set the kernels use: the best that the build and the CPU have, chosen at the
 * first call, unless fsdp__vec_set_isa changed it. With AVX2 the five reductions (max, sum,
 * sumsq_dev, dot, ln_bwd_row) run the baseline's code, which is faster there (cpu_vec.c). */
int fsdp__vec_isa(void);

/* "base", "avx2" or "avx512f". */
const char *fsdp__vec_isa_name(int isa);

/* Makes the kernels use isa from now on (for tests, which compare the instruction sets; all
 * give the same bits); -1, changing nothing, when the build or the CPU does not have it. */
int fsdp__vec_set_isa(int isa);

/* y[i] = exp(x[i] - sub). */
void fsdp__vec_exp_f32(size_t n, const float *x, float sub, float *y);

/* Returns the sum in double, lane by lane in a fixed order, of exp(x[i] - sub); stores the
 * terms rounded to float in y unless y is NULL. */
double fsdp__vec_exp_sum_f32(size_t n, const float *x, float sub, float *y);

/* y[i] = tanh(x[i]). */
void fsdp__vec_tanh_f32(size_t n, const float *x, float *y);

/* y[i] = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), PyTorch's GELU(approximate="tanh"). */
void fsdp__vec_gelu_tanh_f32(size_t n, const float *x, float *y);

/* gx[i] = gy[i] * d/dx gelu_tanh(x[i]) in PyTorch's formula (left + right, see cpu_kernels.c). */
void fsdp__vec_gelu_tanh_bwd_f32(size_t n, const float *x, const float *gy, float *gx);

/* The largest element (n >= 1); a NaN anywhere may or may not be returned, the callers' results
 * are NaN either way. */
float fsdp__vec_max_f32(size_t n, const float *x);

/* Sums in double, in a fixed lane order: sum x[i], and sum (x[i] - mu)^2 with x[i] - mu in
 * double. */
double fsdp__vec_sum_f32(size_t n, const float *x);
double fsdp__vec_sumsq_dev_f32(size_t n, const float *x, double mu);

/* The sum in double of a[i] * b[i], each float converted to double, in a fixed lane order. */
double fsdp__vec_dot_f32(size_t n, const float *a, const float *b);

/* One row (n >= 1) of layer norm's input gradient: xh = (x - mt) rt, g = gy w (gy when w is
 * NULL), c1 = mean(g), c2 = mean(g xh) with the sums in double, gx = (g - c1 - xh c2) rt. */
void fsdp__vec_ln_bwd_row_f32(size_t n, const float *x, const float *w, float mt, float rt,
                              const float *gy, float *gx);

#endif /* FSDP_CPU_VEC_H */
