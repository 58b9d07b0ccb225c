/* SPDX-License-Identifier: MIT */
/*
 * cpu_nn_kernels.c: the CPU device's neural-network kernels (softmax, layer and batch norm,
 * embedding, cross-entropy, dropout, SGD and Adam steps), for f32 and f64.
 *
 * These kernels are the reference every other device is tested against, and they are checked
 * against PyTorch 1.13, so they follow PyTorch's CPU numerics:
 *   - element arithmetic is done in the tensor's dtype (float for f32), in PyTorch's order of
 *     operations, with scalar coefficients computed in double and rounded once to the dtype;
 *   - sums over a row or a channel are accumulated in double and rounded once, which is at
 *     least as accurate as PyTorch's float reductions and does not depend on vector width;
 *   - multiply-adds are not fused (C11 mode compiles with -ffp-contract=off), so a result is
 *     the same at every optimisation level. PyTorch's AVX2 paths fuse some of them; the
 *     difference is at most an ulp per operation.
 *
 * The file instantiates itself once per dtype: the part under "#ifdef NN_T" is the body of
 * every kernel written for one element type T, and the part under "#ifndef NN_T" includes this
 * same file twice (T = float, T = double) and then defines the fsdp__cpu_* entry points, which
 * dispatch on dtype. That keeps one copy of each kernel without multi-line macros.
 *
 * Kernels trust their arguments (the tensor layer checked shapes, see device_impl.h); the only
 * data they check is what the caller cannot check cheaply on a device: cross-entropy targets.
 */
#ifndef NN_T

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include <fsdp/rng.h>

#include "device/cpu_impl.h"
#include "device/cpu_vec.h"

/* f32 rows are processed in chunks of this many elements where a kernel needs scratch (exp of a
 * row before it is scaled), so that the scratch lives on the stack and in L1. */
#define NN_VEC_CHUNK 512

/* Columns of gw/gb accumulated at a time in the norm backwards: two double arrays of this size
 * live on the stack, and a chunk of one row (1 KiB of f32) stays in L1 across rows. */
#define NN_COL_CHUNK 256

#define NN_CAT2(a, b) a##_##b
#define NN_CAT(a, b) NN_CAT2(a, b)
#define NN_FN(name) NN_CAT(name, NN_S)

#define NN_T float
#define NN_S f32
#define NN_EXP expf
#define NN_SQRT sqrtf
#define NN_F32 1
#include "device/cpu_nn_kernels.c"
#undef NN_T
#undef NN_S
#undef NN_EXP
#undef NN_SQRT
#undef NN_F32

#define NN_T double
#define NN_S f64
#define NN_EXP exp
#define NN_SQRT sqrt
#define NN_F32 0
#include "device/cpu_nn_kernels.c"
#undef NN_T
#undef NN_S
#undef NN_EXP
#undef NN_SQRT
#undef NN_F32

/* Calls fn_f32 or fn_f64 with the remaining arguments, or returns FSDP_ENOTSUP. */
#define NN_DISPATCH(dt, fn, ...)                                                                   \
    do {                                                                                           \
        switch (dt) {                                                                              \
        case FSDP_DTYPE_F32:                                                                       \
            return fn##_f32(__VA_ARGS__);                                                          \
        case FSDP_DTYPE_F64:                                                                       \
            return fn##_f64(__VA_ARGS__);                                                          \
        default:                                                                                   \
            return FSDP_ENOTSUP;                                                                   \
        }                                                                                          \
    } while (0)

int fsdp__cpu_softmax(fsdp_device_t *dev, fsdp_dtype_t dt, bool log_softmax, size_t rows, size_t n,
                      const void *x, void *y) {
    (void)dev;
    NN_DISPATCH(dt, softmax, log_softmax, rows, n, x, y);
}

int fsdp__cpu_softmax_backward(fsdp_device_t *dev, fsdp_dtype_t dt, bool log_softmax, size_t rows,
                               size_t n, const void *y, const void *gy, void *gx) {
    (void)dev;
    NN_DISPATCH(dt, softmax_backward, log_softmax, rows, n, y, gy, gx);
}

int fsdp__cpu_layer_norm(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n, double eps,
                         const void *x, const void *w, const void *b, void *y, void *mean,
                         void *rstd) {
    (void)dev;
    NN_DISPATCH(dt, layer_norm, rows, n, eps, x, w, b, y, mean, rstd);
}

int fsdp__cpu_layer_norm_backward(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n,
                                  const void *x, const void *w, const void *mean, const void *rstd,
                                  const void *gy, void *gx, void *gw, void *gb) {
    (void)dev;
    NN_DISPATCH(dt, layer_norm_backward, rows, n, x, w, mean, rstd, gy, gx, gw, gb);
}

int fsdp__cpu_batch_norm(fsdp_device_t *dev, fsdp_dtype_t dt, bool train, size_t nb, size_t c,
                         size_t l, double eps, double momentum, const void *x, const void *w,
                         const void *b, void *running_mean, void *running_var, void *y, void *mean,
                         void *rstd) {
    (void)dev;
    /* Evaluation normalizes with the running statistics, so it cannot go without them. */
    if (!train && (!running_mean || !running_var)) return FSDP_EINVAL;
    NN_DISPATCH(dt, batch_norm, train, nb, c, l, eps, momentum, x, w, b, running_mean, running_var,
                y, mean, rstd);
}

int fsdp__cpu_batch_norm_backward(fsdp_device_t *dev, fsdp_dtype_t dt, bool train, size_t nb,
                                  size_t c, size_t l, const void *x, const void *w,
                                  const void *mean, const void *rstd, const void *gy, void *gx,
                                  void *gw, void *gb) {
    (void)dev;
    NN_DISPATCH(dt, batch_norm_backward, train, nb, c, l, x, w, mean, rstd, gy, gx, gw, gb);
}

int fsdp__cpu_embedding(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, size_t dim,
                        const int64_t *idx, const void *w, void *y) {
    (void)dev;
    NN_DISPATCH(dt, embedding, n, dim, idx, w, y);
}

int fsdp__cpu_embedding_backward(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, size_t dim,
                                 const int64_t *idx, int64_t padding_idx, const void *gy,
                                 void *gw) {
    (void)dev;
    NN_DISPATCH(dt, embedding_backward, n, dim, idx, padding_idx, gy, gw);
}

int fsdp__cpu_cross_entropy(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n,
                            const void *logits, const int64_t *target, int64_t ignore_index,
                            double label_smoothing, void *loss, void *logp) {
    (void)dev;
    NN_DISPATCH(dt, cross_entropy, rows, n, logits, target, ignore_index, label_smoothing, loss,
                logp);
}

int fsdp__cpu_cross_entropy_backward(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n,
                                     const void *logp, const int64_t *target, int64_t ignore_index,
                                     double label_smoothing, const void *gloss, void *gx) {
    (void)dev;
    NN_DISPATCH(dt, cross_entropy_backward, rows, n, logp, target, ignore_index, label_smoothing,
                gloss, gx);
}

/*
 * Dropout's random numbers, the contract another device must reproduce bit for bit:
 *   element i of a call uses word (i % 4) of Philox block b = offset + i / 4 (mod 2^64), where
 *   block b is fsdp_philox4x32_10(ctr = {lo32(b), hi32(b), lo32(stream), hi32(stream)},
 *   key = {lo32(seed), hi32(seed)}), the same layout as fsdp_rng_u32() of an fsdp_rng_t
 *   {seed, stream, offset};
 *   with k = word >> 8 (u = k * 2^-24, the uniform f32 of fsdp_rng_uniform_f32 on [0, 1)),
 *   the element is kept iff u >= p, evaluated exactly as the integer test k >= ceil(p * 2^24)
 *   (p * 2^24 is exact in double);
 *   y = kept ? x * scale : 0 with scale = (T)1 / (T)(1 - p) computed in the dtype (PyTorch's
 *   CPU dropout also multiplies by a noise tensor holding 1 / (1 - p)), mask = kept.
 * p <= 0 keeps everything (y = x) and p >= 1 drops everything (y = 0), without dividing by 0.
 * A call uses ceil(n / 4) blocks, so the next call should start at offset + ceil(n / 4).
 */
int fsdp__cpu_dropout(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, double p, uint64_t seed,
                      uint64_t stream, uint64_t offset, const void *x, void *y, uint8_t *mask) {
    (void)dev;
    NN_DISPATCH(dt, dropout, n, p, seed, stream, offset, x, y, mask);
}

int fsdp__cpu_sgd_step(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, void *p, const void *g,
                       void *buf, double lr, double momentum, double dampening, double wd,
                       bool nesterov, bool first) {
    (void)dev;
    if (momentum != 0.0 && !buf) return FSDP_EINVAL;
    NN_DISPATCH(dt, sgd_step, n, p, g, buf, lr, momentum, dampening, wd, nesterov, first);
}

int fsdp__cpu_adam_step(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, void *p, const void *g,
                        void *m, void *v, void *vmax, double lr, double beta1, double beta2,
                        double eps, double wd, bool decoupled, bool amsgrad, int64_t t) {
    (void)dev;
    if (amsgrad && !vmax) return FSDP_EINVAL;
    NN_DISPATCH(dt, adam_step, n, p, g, m, v, vmax, lr, beta1, beta2, eps, wd, decoupled, amsgrad,
                t);
}

#else /* NN_T: the kernels for one element type */

#define T NN_T

/* ---- softmax ---- */

/* PyTorch's order: m = max(x); softmax = exp(x - m) * (1 / sum); log-softmax =
 * (x - m) - log(sum), subtracting the two terms separately so that a large m does not swallow
 * a small log(sum). y may alias x: each element is read before it is written. */
FSDP_CPU_CLONES
static void NN_FN(softmax_row)(bool lg, size_t n, const T *x, T *y) {
    if (n == 0) return;
#if NN_F32
    /* The same steps with the SIMD exp and lane-ordered double sums of cpu_vec.c. */
    {
        const float mx = fsdp__vec_max_f32(n, x);
        if (lg) {
            const float lse = (float)log(fsdp__vec_exp_sum_f32(n, x, mx, NULL));
            for (size_t j = 0; j < n; j++)
                y[j] = x[j] - mx - lse;
        } else {
            const float inv = (float)(1.0 / fsdp__vec_exp_sum_f32(n, x, mx, y));
            for (size_t j = 0; j < n; j++)
                y[j] *= inv;
        }
        return;
    }
#endif
    T mx = x[0];
    for (size_t j = 1; j < n; j++)
        if (x[j] > mx) mx = x[j];
    double s = 0.0;
    if (lg) {
        for (size_t j = 0; j < n; j++)
            s += (double)NN_EXP(x[j] - mx);
        const T lse = (T)log(s);
        for (size_t j = 0; j < n; j++)
            y[j] = x[j] - mx - lse;
    } else {
        for (size_t j = 0; j < n; j++) {
            T e = NN_EXP(x[j] - mx);
            y[j] = e;
            s += (double)e;
        }
        const T inv = (T)(1.0 / s);
        for (size_t j = 0; j < n; j++)
            y[j] *= inv;
    }
}

static int NN_FN(softmax)(bool lg, size_t rows, size_t n, const T *x, T *y) {
    for (size_t r = 0; r < rows; r++)
        NN_FN(softmax_row)(lg, n, x + r * n, y + r * n);
    return FSDP_OK;
}

FSDP_CPU_CLONES
static int NN_FN(softmax_backward)(bool lg, size_t rows, size_t n, const T *y, const T *gy, T *gx) {
    for (size_t r = 0; r < rows; r++) {
        const T *yr = y + r * n, *gr = gy + r * n;
        T *xr = gx + r * n;
        double s = 0.0;
#if NN_F32
        if (lg) {
            const float st = (float)fsdp__vec_sum_f32(n, gr);
            float e[NN_VEC_CHUNK];
            for (size_t c0 = 0; c0 < n; c0 += NN_VEC_CHUNK) {
                const size_t cn = n - c0 < NN_VEC_CHUNK ? n - c0 : NN_VEC_CHUNK;
                fsdp__vec_exp_f32(cn, yr + c0, 0.0f, e);
                for (size_t j = 0; j < cn; j++)
                    xr[c0 + j] = gr[c0 + j] - e[j] * st;
            }
        } else {
            const float st = (float)fsdp__vec_dot_f32(n, gr, yr);
            for (size_t j = 0; j < n; j++)
                xr[j] = yr[j] * (gr[j] - st);
        }
        continue;
#endif
        if (lg) {
            for (size_t j = 0; j < n; j++)
                s += (double)gr[j];
            const T st = (T)s;
            for (size_t j = 0; j < n; j++)
                xr[j] = gr[j] - NN_EXP(yr[j]) * st;
        } else {
            for (size_t j = 0; j < n; j++)
                s += (double)gr[j] * (double)yr[j];
            const T st = (T)s;
            for (size_t j = 0; j < n; j++)
                xr[j] = yr[j] * (gr[j] - st);
        }
    }
    return FSDP_OK;
}

/* ---- layer norm ---- */

FSDP_CPU_CLONES
static int NN_FN(layer_norm)(size_t rows, size_t n, double eps, const T *x, const T *w, const T *b,
                             T *y, T *mean, T *rstd) {
    for (size_t r = 0; r < rows; r++) {
        const T *xr = x + r * n;
        T *yr = y + r * n;
        /* Two passes in double: the biased variance without E[x^2] - E[x]^2 cancellation. */
        double s = 0.0, ss = 0.0;
#if NN_F32
        s = fsdp__vec_sum_f32(n, xr);
        const double mu = n ? s / (double)n : 0.0;
        ss = fsdp__vec_sumsq_dev_f32(n, xr, mu);
#else
        for (size_t j = 0; j < n; j++)
            s += (double)xr[j];
        const double mu = n ? s / (double)n : 0.0;
        for (size_t j = 0; j < n; j++) {
            double d = (double)xr[j] - mu;
            ss += d * d;
        }
#endif
        const double var = n ? ss / (double)n : 0.0;
        const T mt = (T)mu, rt = (T)(1.0 / sqrt(var + eps));
        mean[r] = mt;
        rstd[r] = rt;
        if (w && b) {
            for (size_t j = 0; j < n; j++)
                yr[j] = (xr[j] - mt) * rt * w[j] + b[j];
        } else {
            for (size_t j = 0; j < n; j++) {
                T v = (xr[j] - mt) * rt;
                if (w) v *= w[j];
                if (b) v += b[j];
                yr[j] = v;
            }
        }
    }
    return FSDP_OK;
}

/*
 * With xh = (x - mean) rstd and g = gy w: gx = rstd (g - mean_j(g) - xh mean_j(g xh)),
 * gw += sum_rows gy xh, gb += sum_rows gy. The weight gradients are summed over rows in double,
 * a chunk of columns at a time, so that they need no heap scratch and are rounded once.
 */
FSDP_CPU_CLONES
static int NN_FN(layer_norm_backward)(size_t rows, size_t n, const T *x, const T *w, const T *mean,
                                      const T *rstd, const T *gy, T *gx, T *gw, T *gb) {
    if (gx && n > 0) {
        const bool pf = fsdp__vec_prefetch_on();
        for (size_t r = 0; r < rows; r++) {
            const T *xr = x + r * n, *gr = gy + r * n;
            T *dr = gx + r * n;
            const T mt = mean[r], rt = rstd[r];
            if (pf && r + 2 < rows) { /* two rows ahead (cpu_vec.h) */
                fsdp__prefetch(xr + 2 * n, n * sizeof(T));
                fsdp__prefetch(gr + 2 * n, n * sizeof(T));
            }
#if NN_F32
            fsdp__vec_ln_bwd_row_f32(n, xr, w, mt, rt, gr, dr);
            continue;
#endif
            double sg = 0.0, sgx = 0.0;
            for (size_t j = 0; j < n; j++) {
                T xh = (xr[j] - mt) * rt;
                T g = w ? gr[j] * w[j] : gr[j];
                sg += (double)g;
                sgx += (double)g * (double)xh;
            }
            const T c1 = (T)(sg / (double)n), c2 = (T)(sgx / (double)n);
            for (size_t j = 0; j < n; j++) {
                T xh = (xr[j] - mt) * rt;
                T g = w ? gr[j] * w[j] : gr[j];
                dr[j] = (g - c1 - xh * c2) * rt;
            }
        }
    }
    if (gw || gb) {
        double aw[NN_COL_CHUNK], ab[NN_COL_CHUNK];
        for (size_t c0 = 0; c0 < n; c0 += NN_COL_CHUNK) {
            const size_t cn = n - c0 < NN_COL_CHUNK ? n - c0 : NN_COL_CHUNK;
            memset(aw, 0, cn * sizeof aw[0]);
            memset(ab, 0, cn * sizeof ab[0]);
            for (size_t r = 0; r < rows; r++) {
                const T *xr = x + r * n + c0, *gr = gy + r * n + c0;
                const T mt = mean[r], rt = rstd[r];
                for (size_t j = 0; j < cn; j++) {
                    T xh = (xr[j] - mt) * rt;
                    aw[j] += (double)gr[j] * (double)xh;
                    ab[j] += (double)gr[j];
                }
            }
            if (gw)
                for (size_t j = 0; j < cn; j++)
                    gw[c0 + j] += (T)aw[j];
            if (gb)
                for (size_t j = 0; j < cn; j++)
                    gb[c0 + j] += (T)ab[j];
        }
    }
    return FSDP_OK;
}

/* ---- batch norm: x is (nb, c, l), channel ch is nb runs of l contiguous elements ---- */

static int NN_FN(batch_norm)(bool train, size_t nb, size_t c, size_t l, double eps, double momentum,
                             const T *x, const T *w, const T *b, T *rmean, T *rvar, T *y, T *mean,
                             T *rstd) {
    const size_t cnt = nb * l;
    for (size_t ch = 0; ch < c; ch++) {
        double mu, rs;
        if (train) {
            double s = 0.0, ss = 0.0;
            for (size_t i = 0; i < nb; i++) {
                const T *xr = x + (i * c + ch) * l;
                for (size_t k = 0; k < l; k++)
                    s += (double)xr[k];
            }
            mu = cnt ? s / (double)cnt : 0.0;
            for (size_t i = 0; i < nb; i++) {
                const T *xr = x + (i * c + ch) * l;
                for (size_t k = 0; k < l; k++) {
                    double d = (double)xr[k] - mu;
                    ss += d * d;
                }
            }
            rs = 1.0 / sqrt((cnt ? ss / (double)cnt : 0.0) + eps);
            /* PyTorch's update order; the unbiased variance of one element is 0/0 = NaN, as in
             * PyTorch's kernel (its module refuses such a batch before getting here). */
            if (cnt > 0 && rmean)
                rmean[ch] = (T)(momentum * mu + (1.0 - momentum) * (double)rmean[ch]);
            if (cnt > 0 && rvar) {
                double unbiased = ss / ((double)cnt - 1.0);
                rvar[ch] = (T)(momentum * unbiased + (1.0 - momentum) * (double)rvar[ch]);
            }
        } else {
            mu = (double)rmean[ch];
            rs = 1.0 / sqrt((double)rvar[ch] + eps);
        }
        const T mt = (T)mu, rt = (T)rs;
        mean[ch] = mt;
        rstd[ch] = rt;
        const T alpha = w ? rt * w[ch] : rt, beta = b ? b[ch] : (T)0;
        for (size_t i = 0; i < nb; i++) {
            const T *xr = x + (i * c + ch) * l;
            T *yr = y + (i * c + ch) * l;
            for (size_t k = 0; k < l; k++)
                yr[k] = (xr[k] - mt) * alpha + beta;
        }
    }
    return FSDP_OK;
}

/*
 * Per channel, with sums over the N*L elements: sg = sum gy, dot = sum gy (x - mean).
 * Training: gx = (gy - sg/N - (x - mean) dot rstd^2 / N) rstd w (mean and variance depend on x);
 * evaluation: gx = gy rstd w. Both: gw += dot rstd, gb += sg.
 */
static int NN_FN(batch_norm_backward)(bool train, size_t nb, size_t c, size_t l, const T *x,
                                      const T *w, const T *mean, const T *rstd, const T *gy, T *gx,
                                      T *gw, T *gb) {
    const size_t cnt = nb * l;
    for (size_t ch = 0; ch < c; ch++) {
        const T mt = mean[ch], rt = rstd[ch];
        const double mu = (double)mt, rs = (double)rt;
        double sg = 0.0, dot = 0.0;
        for (size_t i = 0; i < nb; i++) {
            const T *xr = x + (i * c + ch) * l, *gr = gy + (i * c + ch) * l;
            for (size_t k = 0; k < l; k++) {
                sg += (double)gr[k];
                dot += (double)gr[k] * ((double)xr[k] - mu);
            }
        }
        if (gx) {
            const T scale = w ? rt * w[ch] : rt;
            if (train && cnt > 0) {
                const T kc = (T)(dot * rs * rs / (double)cnt), gm = (T)(sg / (double)cnt);
                for (size_t i = 0; i < nb; i++) {
                    const T *xr = x + (i * c + ch) * l, *gr = gy + (i * c + ch) * l;
                    T *dr = gx + (i * c + ch) * l;
                    for (size_t k = 0; k < l; k++)
                        dr[k] = (gr[k] - gm - (xr[k] - mt) * kc) * scale;
                }
            } else {
                for (size_t i = 0; i < nb; i++) {
                    const T *gr = gy + (i * c + ch) * l;
                    T *dr = gx + (i * c + ch) * l;
                    for (size_t k = 0; k < l; k++)
                        dr[k] = gr[k] * scale;
                }
            }
        }
        if (gw) gw[ch] += (T)(dot * rs);
        if (gb) gb[ch] += (T)sg;
    }
    return FSDP_OK;
}

/* ---- embedding ---- */

static int NN_FN(embedding)(size_t n, size_t dim, const int64_t *idx, const T *w, T *y) {
    for (size_t i = 0; i < n; i++)
        memcpy(y + i * dim, w + (size_t)idx[i] * dim, dim * sizeof(T));
    return FSDP_OK;
}

FSDP_CPU_CLONES
static int NN_FN(embedding_backward)(size_t n, size_t dim, const int64_t *idx, int64_t padding_idx,
                                     const T *gy, T *gw) {
    /* In index order, so repeated indices always sum in the same order. */
    for (size_t i = 0; i < n; i++) {
        if (padding_idx >= 0 && idx[i] == padding_idx) continue;
        T *dst = gw + (size_t)idx[i] * dim;
        const T *src = gy + i * dim;
        for (size_t j = 0; j < dim; j++)
            dst[j] += src[j];
    }
    return FSDP_OK;
}

/* ---- cross-entropy ---- */

static int NN_FN(cross_entropy)(size_t rows, size_t n, const T *logits, const int64_t *target,
                                int64_t ignore_index, double ls, T *loss, T *logp) {
    for (size_t r = 0; r < rows; r++) {
        T *lp = logp + r * n;
        NN_FN(softmax_row)(true, n, logits + r * n, lp);
        const int64_t t = target[r];
        if (t == ignore_index) {
            loss[r] = (T)0;
            continue;
        }
        /* A target is data, which the caller cannot range-check without reading it back from
         * the device, so the CPU reference checks it rather than read out of bounds. */
        if (t < 0 || (uint64_t)t >= (uint64_t)n) return FSDP_EINVAL;
        double v = -(1.0 - ls) * (double)lp[t];
        if (ls != 0.0) {
            double s = 0.0;
            for (size_t j = 0; j < n; j++)
                s += (double)lp[j];
            v -= ls / (double)n * s;
        }
        loss[r] = (T)v;
    }
    return FSDP_OK;
}

FSDP_CPU_CLONES
static int NN_FN(cross_entropy_backward)(size_t rows, size_t n, const T *logp,
                                         const int64_t *target, int64_t ignore_index, double ls,
                                         const T *gloss, T *gx) {
    const T smooth = (T)(ls / (double)n), onehot = (T)(1.0 - ls);
    for (size_t r = 0; r < rows; r++) {
        const T *lp = logp + r * n;
        T *dr = gx + r * n;
        const int64_t t = target[r];
        if (t == ignore_index) {
            for (size_t j = 0; j < n; j++)
                dr[j] = (T)0;
            continue;
        }
        if (t < 0 || (uint64_t)t >= (uint64_t)n) return FSDP_EINVAL;
        const T g = gloss[r];
#if NN_F32
        /* exp into the output row, then the scaling; the target's element is recomputed from
         * its exp as the scalar code does. */
        fsdp__vec_exp_f32(n, lp, 0.0f, dr);
        const float et = dr[t];
        for (size_t j = 0; j < n; j++)
            dr[j] = g * (dr[j] - smooth);
        dr[t] = g * (et - smooth - onehot);
        continue;
#endif
        const T e_t = NN_EXP(lp[t]); /* before the row is written: gx may alias logp */
        for (size_t j = 0; j < n; j++)
            dr[j] = g * (NN_EXP(lp[j]) - smooth);
        dr[t] = g * (e_t - smooth - onehot);
    }
    return FSDP_OK;
}

/* ---- dropout (the mapping is described above fsdp__cpu_dropout) ---- */

static int NN_FN(dropout)(size_t n, double p, uint64_t seed, uint64_t stream, uint64_t offset,
                          const T *x, T *y, uint8_t *mask) {
    if (!(p > 0.0)) {
        for (size_t i = 0; i < n; i++)
            y[i] = x[i];
        if (mask) memset(mask, 1, n);
        return FSDP_OK;
    }
    if (p >= 1.0) {
        for (size_t i = 0; i < n; i++)
            y[i] = (T)0;
        if (mask) memset(mask, 0, n);
        return FSDP_OK;
    }
    /* p in (0, 1): threshold in [1, 2^24]. */
    const uint32_t thr = (uint32_t)ceil(p * 0x1p24);
    const T scale = (T)1 / (T)(1.0 - p);
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    uint32_t ctr[4] = {0, 0, (uint32_t)stream, (uint32_t)(stream >> 32)};
    for (size_t i = 0; i < n; i += 4) {
        const uint64_t blk = offset + (uint64_t)(i / 4);
        uint32_t word[4];
        ctr[0] = (uint32_t)blk;
        ctr[1] = (uint32_t)(blk >> 32);
        fsdp_philox4x32_10(ctr, key, word);
        const size_t m = n - i < 4 ? n - i : 4;
        for (size_t j = 0; j < m; j++) {
            const bool keep = (word[j] >> 8) >= thr;
            y[i + j] = keep ? x[i + j] * scale : (T)0;
            if (mask) mask[i + j] = (uint8_t)keep;
        }
    }
    return FSDP_OK;
}

/* ---- optimizers ---- */

/*
 * torch.optim.SGD (1.13, single-tensor): d = g + wd p; buf = first ? d : buf momentum +
 * (1 - dampening) d; d = nesterov ? d + momentum buf : buf; p = p + (-lr) d. Each "+ a b" is
 * PyTorch's add with alpha, i.e. x + alpha * y with alpha rounded to the dtype.
 */
static int NN_FN(sgd_step)(size_t n, T *p, const T *g, T *buf, double lr, double momentum,
                           double dampening, double wd, bool nesterov, bool first) {
    const T wdt = (T)wd, mom = (T)momentum, damp = (T)(1.0 - dampening), nlr = (T)(-lr);
    const bool use_wd = wd != 0.0, use_mom = momentum != 0.0;
    for (size_t i = 0; i < n; i++) {
        T d = g[i];
        if (use_wd) d = d + wdt * p[i];
        if (use_mom) {
            T bv = first ? d : buf[i] * mom + damp * d;
            buf[i] = bv;
            d = nesterov ? d + mom * bv : bv;
        }
        p[i] = p[i] + nlr * d;
    }
    return FSDP_OK;
}

/*
 * torch.optim.Adam / AdamW (1.13, single-tensor), step t:
 *   AdamW: p = p * (1 - lr wd);  Adam: g = g + wd p (when wd != 0)
 *   m = m b1 + (1 - b1) g;  v = v b2 + ((1 - b2) g) g;  amsgrad: vmax = max(vmax, v), use vmax
 *   denom = sqrt(v) / sqrt(1 - b2^t) + eps;  p = p + ((-lr / (1 - b1^t)) m) / denom
 * with the bias corrections and step size computed in double (Python floats in PyTorch).
 */
FSDP_CPU_CLONES
static int NN_FN(adam_step)(size_t n, T *p, const T *g, T *m, T *v, T *vmax, double lr,
                            double beta1, double beta2, double eps, double wd, bool decoupled,
                            bool amsgrad, int64_t t) {
    const double bc1 = 1.0 - pow(beta1, (double)t), bc2 = 1.0 - pow(beta2, (double)t);
    const T b1 = (T)beta1, omb1 = (T)(1.0 - beta1), b2 = (T)beta2, omb2 = (T)(1.0 - beta2);
    const T bc2_sqrt = (T)sqrt(bc2), epst = (T)eps, nstep = (T)(-(lr / bc1));
    const T wdt = (T)wd, decay = (T)(1.0 - lr * wd);
    const bool couple_wd = !decoupled && wd != 0.0;
    if (!amsgrad && !couple_wd) {
        /* AdamW, or Adam without weight decay: the same operations in branch-free loops the
         * compiler vectorizes (sqrt and division are exact IEEE operations in any width). */
        T *restrict pr = p, *restrict mr = m, *restrict vr = v;
        const T *restrict gr = g;
        const T dec = decoupled ? decay : (T)1;
        for (size_t i = 0; i < n; i++) {
            const T gi = gr[i];
            const T mi = mr[i] * b1 + omb1 * gi;
            const T vi = vr[i] * b2 + omb2 * gi * gi;
            mr[i] = mi;
            vr[i] = vi;
            const T denom = NN_SQRT(vi) / bc2_sqrt + epst;
            /* p * 1 is p exactly, so plain Adam takes the same loop. */
            pr[i] = pr[i] * dec + nstep * mi / denom;
        }
        return FSDP_OK;
    }
    for (size_t i = 0; i < n; i++) {
        T gi = g[i];
        if (decoupled)
            p[i] = p[i] * decay;
        else if (couple_wd)
            gi = gi + wdt * p[i];
        const T mi = m[i] * b1 + omb1 * gi;
        const T vi = v[i] * b2 + omb2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        T vs = vi;
        if (amsgrad) {
            /* Like torch.maximum, a NaN in either operand propagates. */
            T a = vmax[i];
            vs = (a > vi || isnan(a)) ? a : vi;
            vmax[i] = vs;
        }
        const T denom = NN_SQRT(vs) / bc2_sqrt + epst;
        p[i] = p[i] + nstep * mi / denom;
    }
    return FSDP_OK;
}

#undef T

#endif /* NN_T */
