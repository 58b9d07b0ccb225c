/* SPDX-License-Identifier: MIT */
/*
 * cpu_vec_impl.h: the body of the f32 SIMD kernels of cpu_vec.h, compiled once per instruction
 * set: cpu_vec_base.c, cpu_vec_avx2.c and cpu_vec_avx512f.c each define VEC_OPS (the name of
 * their table of kernels, cpu_vec_isa.h) and put every function of their file under one target
 * attribute before including this file. Every function here is static; only the table is
 * exported, and cpu_vec.c picks a table at run time.
 *
 * The code is written with GCC's generic vector types (16 floats, 8 doubles), which GCC and
 * clang lower to whatever the target has (four SSE registers, two AVX2 registers or one AVX-512
 * register), so one source serves every instruction set. A tail shorter than a vector is copied
 * into a padded vector and goes through the same code, so the element at index i gets the same
 * bits whatever n is and wherever it sits.
 *
 * exp(x): x = k ln2 + r with k = round(x / ln2) and |r| <= ln2 / 2 (Cody and Waite's two-part
 * ln2, so r is exact to about 2^-40); exp(r) is the degree-7 Taylor polynomial (truncation below
 * 2^-27 relative on that interval) evaluated in Horner form as 1 + (r + r^2 q(r)); the scaling by
 * 2^k is two exact multiplications by 2^(k/2) and 2^(k - k/2), so results that end in the
 * subnormal range round once and the overflow threshold is exactly libm's.
 *
 * tanh(x) = sign(x) t / (t + 2) with t = expm1(2|x|): no cancellation anywhere (t >= 0), and the
 * sensitivity of t / (t + 2) to an error in t is 2 / (t + 2) <= 1, so the 1 ulp of expm1 stays
 * about 1 ulp, plus two roundings. expm1(u) for u >= 0 uses the same reduction: expm1(u) =
 * 2^k expm1(r) + (2^k - 1), with 2^k - 1 exact; expm1(r) = r + r^2 q(r), degree 8. |x| is
 * clamped to 10 first, where t / (t + 2) already rounds to 1.
 *
 * Without GCC vector extensions (another compiler) the file falls back to the libm functions
 * element by element: correct, slower, and not bitwise the vector path.
 */
#ifndef VEC_OPS
#error "cpu_vec_impl.h is included by cpu_vec_base.c, cpu_vec_avx2.c and cpu_vec_avx512f.c"
#endif

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "device/cpu_vec.h"
#include "device/cpu_vec_isa.h"

#define SQRT_2_OVER_PI 0.79788456080286535588 /* sqrt(2 / pi) */
#define GELU_KAPPA 0.044715

#if defined(__GNUC__)

/* The helpers below pass 64-byte vectors by value. They are static, inlined, and compiled for
 * the same instruction set as the kernels that call them (the whole file is, see cpu_vec_isa.h),
 * so no vector crosses a call boundary whose ABI depends on the instruction set, and the
 * compilers' note that the AVX-512 ABI differs does not apply. */
#pragma GCC diagnostic ignored "-Wpsabi"

#define FORCE_INLINE __attribute__((always_inline))
#define VL 16 /* floats per vector */
typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VL * sizeof(int32_t))));
typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
typedef double vd __attribute__((vector_size(8 * sizeof(double))));

static inline FORCE_INLINE vf vf_set(float c) {
    return (vf){c, c, c, c, c, c, c, c, c, c, c, c, c, c, c, c};
}
static inline FORCE_INLINE vi vi_set(int32_t c) {
    return (vi){c, c, c, c, c, c, c, c, c, c, c, c, c, c, c, c};
}

static inline FORCE_INLINE vf vf_load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline FORCE_INLINE void vf_store(float *p, vf v) {
    memcpy(p, &v, sizeof v);
}
/* Loads the m < VL floats at p, the other lanes set to pad. */
static inline FORCE_INLINE vf vf_load_part(const float *p, size_t m, float pad) {
    float b[VL];
    for (size_t i = 0; i < VL; i++)
        b[i] = i < m ? p[i] : pad;
    return vf_load(b);
}
static inline FORCE_INLINE void vf_store_part(float *p, size_t m, vf v) {
    float b[VL];
    vf_store(b, v);
    memcpy(p, b, m * sizeof(float));
}

/* m ? a : b, lane by lane, for a mask of all-ones / all-zeros lanes (a vector comparison). */
static inline FORCE_INLINE vf vf_sel(vi m, vf a, vf b) {
    return (vf)(((vi)a & m) | ((vi)b & ~m));
}
static inline FORCE_INLINE vf vf_min(vf a, vf b) {
    return vf_sel(a < b, a, b);
}
static inline FORCE_INLINE vf vf_max(vf a, vf b) {
    return vf_sel(a > b, a, b);
}

#define LOG2E 1.44269504088896341f
#define LN2_HI 6.9313812256e-01f /* 0x3f317180: k * LN2_HI is exact for |k| < 2^8 */
#define LN2_LO 9.0580006145e-06f /* 0x3717f7d1 */
#define ROUND_MAGIC 12582912.0f  /* 1.5 * 2^23: adding it rounds |v| < 2^22 to an integer */

/* Sets *k to round(x / ln2) (as float and as int) and returns r = x - k ln2, for |x| < 2^21. */
static inline FORCE_INLINE vf reduce_ln2(vf x, vf *kf, vi *ki) {
    const vf t = x * vf_set(LOG2E) + vf_set(ROUND_MAGIC);
    *kf = t - vf_set(ROUND_MAGIC);
    *ki = (vi)t - (vi)vf_set(ROUND_MAGIC);
    return (x - *kf * vf_set(LN2_HI)) - *kf * vf_set(LN2_LO);
}

/* 2^k for -126 <= k <= 127. */
static inline FORCE_INLINE vf pow2i(vi k) {
    return (vf)((k + vi_set(127)) << 23);
}

static inline FORCE_INLINE vf v_exp(vf x) {
    /* Below -104 the result is 0 and above 89 it overflows, as libm's; the clamp keeps k within
     * two normal powers of two. NaN is put back at the end. */
    const vf xc = vf_min(vf_max(x, vf_set(-104.0f)), vf_set(89.0f));
    vf kf;
    vi k;
    const vf r = reduce_ln2(xc, &kf, &k);
    vf q = vf_set(1.0f / 5040);
    q = q * r + vf_set(1.0f / 720);
    q = q * r + vf_set(1.0f / 120);
    q = q * r + vf_set(1.0f / 24);
    q = q * r + vf_set(1.0f / 6);
    q = q * r + vf_set(0.5f);
    const vf p = vf_set(1.0f) + (r + (r * r) * q);
    const vi k1 = k >> 1;
    const vf y = (p * pow2i(k1)) * pow2i(k - k1);
    return vf_sel(x != x, x, y);
}

static inline FORCE_INLINE vf v_tanh(vf x) {
    const vi sign = (vi)x & vi_set(INT32_MIN);
    const vf a = (vf)((vi)x & vi_set(INT32_MAX));
    const vf u = vf_set(2.0f) * vf_min(a, vf_set(10.0f)); /* a NaN becomes 10 here */
    vf kf;
    vi k;
    const vf r = reduce_ln2(u, &kf, &k);
    vf q = vf_set(1.0f / 40320);
    q = q * r + vf_set(1.0f / 5040);
    q = q * r + vf_set(1.0f / 720);
    q = q * r + vf_set(1.0f / 120);
    q = q * r + vf_set(1.0f / 24);
    q = q * r + vf_set(1.0f / 6);
    q = q * r + vf_set(0.5f);
    const vf em = r + (r * r) * q; /* expm1(r) */
    const vf s = pow2i(k);
    const vf t = s * em + (s - vf_set(1.0f));
    const vf th = (vf)((vi)(t / (t + vf_set(2.0f))) | sign);
    return vf_sel(x != x, x, th);
}

/* The GELU expressions of cpu_kernels.c, in the same order of operations. */
static inline FORCE_INLINE vf v_gelu_tanh(vf v) {
    const vf t =
        v_tanh(vf_set((float)SQRT_2_OVER_PI) * (v + vf_set((float)GELU_KAPPA) * v * v * v));
    return vf_set(0.5f) * v * (vf_set(1.0f) + t);
}

static inline FORCE_INLINE vf v_gelu_tanh_bwd(vf v, vf g) {
    const vf half = vf_set(0.5f), one = vf_set(1.0f), beta = vf_set((float)SQRT_2_OVER_PI);
    const vf kappa = vf_set((float)GELU_KAPPA);
    const vf t = v_tanh(beta * (v + kappa * v * v * v));
    const vf left = half * (one + t);
    const vf right = half * v * (one - t * t) * beta * (one + vf_set(3.0f) * kappa * v * v);
    return g * (left + right);
}

/* Adds the 16 floats of v, converted to double, to the accumulators (lanes 0-7, 8-15). */
static inline FORCE_INLINE void acc_add(vd *a0, vd *a1, vf v) {
    vf8 lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    *a0 += __builtin_convertvector(lo, vd);
    *a1 += __builtin_convertvector(hi, vd);
}

/* The sum of the 16 lanes of two accumulators, in a fixed pairwise order. */
static inline FORCE_INLINE double acc_total(vd a0, vd a1) {
    const vd a = a0 + a1;
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

static void vec_exp_f32(size_t n, const float *x, float sub, float *y) {
    const vf s = vf_set(sub);
    const bool pf = fsdp__vec_prefetch_on();
    size_t i = 0;
    for (; i + VL <= n; i += VL) {
        if (pf) fsdp__prefetch_ahead(x, i, n, sizeof *x);
        vf_store(y + i, v_exp(vf_load(x + i) - s));
    }
    if (i < n) vf_store_part(y + i, n - i, v_exp(vf_load_part(x + i, n - i, sub) - s));
}

static double vec_exp_sum_f32(size_t n, const float *x, float sub, float *y) {
    const vf s = vf_set(sub);
    vd a0 = {0}, a1 = {0};
    size_t i = 0;
    for (; i + VL <= n; i += VL) {
        const vf e = v_exp(vf_load(x + i) - s);
        if (y) vf_store(y + i, e);
        acc_add(&a0, &a1, e);
    }
    if (i < n) {
        /* exp(-inf) = 0 pads the sum. */
        const vf e = v_exp(vf_load_part(x + i, n - i, -INFINITY) - s);
        if (y) vf_store_part(y + i, n - i, e);
        acc_add(&a0, &a1, e);
    }
    return acc_total(a0, a1);
}

static void vec_tanh_f32(size_t n, const float *x, float *y) {
    size_t i = 0;
    for (; i + VL <= n; i += VL)
        vf_store(y + i, v_tanh(vf_load(x + i)));
    if (i < n) vf_store_part(y + i, n - i, v_tanh(vf_load_part(x + i, n - i, 0.0f)));
}

static void vec_gelu_tanh_f32(size_t n, const float *x, float *y) {
    const bool pf = fsdp__vec_prefetch_on();
    size_t i = 0;
    for (; i + VL <= n; i += VL) {
        if (pf) fsdp__prefetch_ahead(x, i, n, sizeof *x);
        vf_store(y + i, v_gelu_tanh(vf_load(x + i)));
    }
    if (i < n) vf_store_part(y + i, n - i, v_gelu_tanh(vf_load_part(x + i, n - i, 0.0f)));
}

static void vec_gelu_tanh_bwd_f32(size_t n, const float *x, const float *gy, float *gx) {
    const bool pf = fsdp__vec_prefetch_on();
    size_t i = 0;
    for (; i + VL <= n; i += VL) {
        if (pf) {
            fsdp__prefetch_ahead(x, i, n, sizeof *x);
            fsdp__prefetch_ahead(gy, i, n, sizeof *gy);
        }
        vf_store(gx + i, v_gelu_tanh_bwd(vf_load(x + i), vf_load(gy + i)));
    }
    if (i < n)
        vf_store_part(
            gx + i, n - i,
            v_gelu_tanh_bwd(vf_load_part(x + i, n - i, 0.0f), vf_load_part(gy + i, n - i, 0.0f)));
}

static float vec_max_f32(size_t n, const float *x) {
    vf m = vf_set(x[0]);
    size_t i = 0;
    for (; i + VL <= n; i += VL)
        m = vf_max(m, vf_load(x + i));
    if (i < n) m = vf_max(m, vf_load_part(x + i, n - i, x[0]));
    float best = m[0];
    for (int l = 1; l < VL; l++)
        if (m[l] > best) best = m[l];
    return best;
}

static double vec_sum_f32(size_t n, const float *x) {
    vd a0 = {0}, a1 = {0};
    size_t i = 0;
    for (; i + VL <= n; i += VL)
        acc_add(&a0, &a1, vf_load(x + i));
    if (i < n) acc_add(&a0, &a1, vf_load_part(x + i, n - i, 0.0f));
    return acc_total(a0, a1);
}

/* Adds v (8 floats as doubles, minus mu) squared to *a. */
static inline FORCE_INLINE void acc_sq8(vd *a, const float *p, vd mu) {
    vf8 h;
    memcpy(&h, p, sizeof h);
    const vd d = __builtin_convertvector(h, vd) - mu;
    *a += d * d;
}

static double vec_sumsq_dev_f32(size_t n, const float *x, double mu) {
    const vd m = {mu, mu, mu, mu, mu, mu, mu, mu};
    vd a0 = {0}, a1 = {0};
    size_t i = 0;
    for (; i + VL <= n; i += VL) {
        acc_sq8(&a0, x + i, m);
        acc_sq8(&a1, x + i + 8, m);
    }
    double s = acc_total(a0, a1);
    /* The tail, fewer than 16 elements, in index order after the lanes. */
    for (; i < n; i++) {
        const double d = (double)x[i] - mu;
        s += d * d;
    }
    return s;
}

/*
 * One row of layer_norm's input gradient (cpu_nn_kernels.c gives the formula): with
 * xh = (x - mt) rt and g = gy w (gy alone when w is NULL), in float, sums of g and g xh in
 * double, then gx = (g - c1 - xh c2) rt.
 */
static inline FORCE_INLINE vf ln_g(const float *gy, const float *w, size_t i) {
    return w ? vf_load(gy + i) * vf_load(w + i) : vf_load(gy + i);
}
static inline FORCE_INLINE vf ln_g_part(const float *gy, const float *w, size_t i, size_t m) {
    const vf g = vf_load_part(gy + i, m, 0.0f);
    return w ? g * vf_load_part(w + i, m, 0.0f) : g;
}

/* Adds the 16 products a b, each of the two floats converted to double, to the accumulators. */
static inline FORCE_INLINE void acc_dot(vd *a0, vd *a1, vf a, vf b) {
    vf8 al, ah, bl, bh;
    memcpy(&al, &a, sizeof al);
    memcpy(&ah, (const char *)&a + sizeof al, sizeof ah);
    memcpy(&bl, &b, sizeof bl);
    memcpy(&bh, (const char *)&b + sizeof bl, sizeof bh);
    *a0 += __builtin_convertvector(al, vd) * __builtin_convertvector(bl, vd);
    *a1 += __builtin_convertvector(ah, vd) * __builtin_convertvector(bh, vd);
}

static double vec_dot_f32(size_t n, const float *a, const float *b) {
    vd p0 = {0}, p1 = {0};
    size_t i = 0;
    for (; i + VL <= n; i += VL)
        acc_dot(&p0, &p1, vf_load(a + i), vf_load(b + i));
    if (i < n)
        acc_dot(&p0, &p1, vf_load_part(a + i, n - i, 0.0f), vf_load_part(b + i, n - i, 0.0f));
    return acc_total(p0, p1);
}

static void vec_ln_bwd_row_f32(size_t n, const float *x, const float *w, float mt, float rt,
                               const float *gy, float *gx) {
    const vf vm = vf_set(mt), vr = vf_set(rt);
    vd s0 = {0}, s1 = {0}, p0 = {0}, p1 = {0};
    size_t i = 0;
    for (; i + VL <= n; i += VL) {
        const vf xh = (vf_load(x + i) - vm) * vr, g = ln_g(gy, w, i);
        acc_add(&s0, &s1, g);
        acc_dot(&p0, &p1, g, xh);
    }
    if (i < n) {
        /* Padding lanes have g = 0, so they add 0 to both sums. */
        const vf xh = (vf_load_part(x + i, n - i, mt) - vm) * vr, g = ln_g_part(gy, w, i, n - i);
        acc_add(&s0, &s1, g);
        acc_dot(&p0, &p1, g, xh);
    }
    const float c1 = (float)(acc_total(s0, s1) / (double)n);
    const float c2 = (float)(acc_total(p0, p1) / (double)n);
    const vf v1 = vf_set(c1), v2 = vf_set(c2);
    for (i = 0; i + VL <= n; i += VL) {
        const vf xh = (vf_load(x + i) - vm) * vr, g = ln_g(gy, w, i);
        vf_store(gx + i, (g - v1 - xh * v2) * vr);
    }
    if (i < n) {
        const vf xh = (vf_load_part(x + i, n - i, mt) - vm) * vr, g = ln_g_part(gy, w, i, n - i);
        vf_store_part(gx + i, n - i, (g - v1 - xh * v2) * vr);
    }
}

#else /* !__GNUC__: element by element with libm */

static void vec_exp_f32(size_t n, const float *x, float sub, float *y) {
    for (size_t i = 0; i < n; i++)
        y[i] = expf(x[i] - sub);
}

static double vec_exp_sum_f32(size_t n, const float *x, float sub, float *y) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++) {
        const float e = expf(x[i] - sub);
        if (y) y[i] = e;
        s += (double)e;
    }
    return s;
}

static void vec_tanh_f32(size_t n, const float *x, float *y) {
    for (size_t i = 0; i < n; i++)
        y[i] = tanhf(x[i]);
}

static void vec_gelu_tanh_f32(size_t n, const float *x, float *y) {
    for (size_t i = 0; i < n; i++) {
        const float v = x[i];
        y[i] =
            0.5f * v * (1.0f + tanhf((float)SQRT_2_OVER_PI * (v + (float)GELU_KAPPA * v * v * v)));
    }
}

static void vec_gelu_tanh_bwd_f32(size_t n, const float *x, const float *gy, float *gx) {
    const float beta = (float)SQRT_2_OVER_PI, kappa = (float)GELU_KAPPA;
    for (size_t i = 0; i < n; i++) {
        const float v = x[i], t = tanhf(beta * (v + kappa * v * v * v));
        const float left = 0.5f * (1.0f + t);
        const float right = 0.5f * v * (1.0f - t * t) * beta * (1.0f + 3.0f * kappa * v * v);
        gx[i] = gy[i] * (left + right);
    }
}

static float vec_max_f32(size_t n, const float *x) {
    float m = x[0];
    for (size_t i = 1; i < n; i++)
        if (x[i] > m) m = x[i];
    return m;
}

static double vec_sum_f32(size_t n, const float *x) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++)
        s += (double)x[i];
    return s;
}

static double vec_sumsq_dev_f32(size_t n, const float *x, double mu) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double d = (double)x[i] - mu;
        s += d * d;
    }
    return s;
}

static double vec_dot_f32(size_t n, const float *a, const float *b) {
    double p = 0.0;
    for (size_t i = 0; i < n; i++)
        p += (double)a[i] * (double)b[i];
    return p;
}

static void vec_ln_bwd_row_f32(size_t n, const float *x, const float *w, float mt, float rt,
                               const float *gy, float *gx) {
    double sg = 0.0, sgx = 0.0;
    for (size_t j = 0; j < n; j++) {
        const float xh = (x[j] - mt) * rt, g = w ? gy[j] * w[j] : gy[j];
        sg += (double)g;
        sgx += (double)g * (double)xh;
    }
    const float c1 = (float)(sg / (double)n), c2 = (float)(sgx / (double)n);
    for (size_t j = 0; j < n; j++) {
        const float xh = (x[j] - mt) * rt, g = w ? gy[j] * w[j] : gy[j];
        gx[j] = (g - c1 - xh * c2) * rt;
    }
}

#endif /* __GNUC__ */

const struct fsdp_vec_ops VEC_OPS = {
    .exp_f32 = vec_exp_f32,
    .exp_sum_f32 = vec_exp_sum_f32,
    .tanh_f32 = vec_tanh_f32,
    .gelu_tanh_f32 = vec_gelu_tanh_f32,
    .gelu_tanh_bwd_f32 = vec_gelu_tanh_bwd_f32,
    .max_f32 = vec_max_f32,
    .sum_f32 = vec_sum_f32,
    .sumsq_dev_f32 = vec_sumsq_dev_f32,
    .dot_f32 = vec_dot_f32,
    .ln_bwd_row_f32 = vec_ln_bwd_row_f32,
};
