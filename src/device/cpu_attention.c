/* SPDX-License-Identifier: MIT */
/*
 * cpu_attention.c: the CPU device's attention over packed heads (device_impl.h, `attention`),
 * forward and backward, for f32.
 *
 * Composed from separate operations, attention makes every step a pass over tensors of the
 * whole batch: the heads are copied out of the packed projection, q is scaled, the (B, H, T, T)
 * scores are written, the mask is added in another pass, the softmax reads and writes them
 * again, and the heads are copied back together; the backward does the same in reverse. Each
 * of those passes streams megabytes through memory. Here one (sequence, head) goes through all
 * of its steps before the next starts, so its T x T tile stays in the core's cache between
 * them, and q, k and v are read where they lie in the packed (B, T, 3 H hd) tensor: the GEMM's
 * leading dimension steps over the other heads, and the output is written into the head's
 * columns of (B, T, H hd). Nothing is copied in or out.
 *
 * The arithmetic is the composed path's, kernel for kernel: the same products through
 * fsdp__cpu_gemm with the same shapes and transpose flags (only the leading dimensions differ,
 * and the BLAS packs its operands whatever their stride), each into zeros with beta = 1 as the
 * ops layer's outputs are; the same softmax and softmax-backward kernels; scale and mask as
 * single float operations in the same order. So every value is bit for bit what fsdp_attention
 * gives on split heads (t_attention_packed checks it), and the bits of a run do not depend on
 * which path it took. The one product whose output is transposed (the gradient of k, computed
 * as that of k^T) goes through a small scratch tile and is transposed on the way out.
 *
 * Invariants: p holds the forward's softmax, which the backward reads; the caller checked the
 * shapes (the ops layer); scratch is one allocation per call, freed before returning.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "device/cpu_impl.h"

/* Per-call scratch: the scaled q of one head (t x hd), for the forward the row limits of the
 * mask (t), and for the backward the gradient of its scores (t x t) and of k^T (hd x t). */
struct attn_scratch {
    void *buf; /* the one allocation the others point into */
    float *qs, *gs, *gkt;
    int64_t *lim;
};

static int scratch_get(fsdp_device_t *dev, const char *fn, int64_t t, int64_t hd, bool backward,
                       struct attn_scratch *s) {
    size_t nq = (size_t)(t * hd), ns = backward ? (size_t)(t * t) : 0;
    size_t nk = backward ? nq : 0, nl = backward ? 0 : (size_t)t;
    size_t bytes = nl * sizeof(int64_t) + (nq + ns + nk) * sizeof(float);
    char *buf = malloc(bytes);
    if (!buf)
        return fsdp__ctx_err(dev->ctx, FSDP_ENOMEM,
                             "cpu %s: no memory for the %zu-byte scratch of one head (t %lld, "
                             "head size %lld)",
                             fn, bytes, (long long)t, (long long)hd);
    s->buf = buf;
    s->lim = (int64_t *)buf;
    s->qs = (float *)(buf + nl * sizeof(int64_t));
    s->gs = s->qs + nq;
    s->gkt = s->gs + ns;
    return FSDP_OK;
}

/* y = (float)scale * x for t rows of hd floats, x's at stride ldx and y's at stride ldy (y may
 * be x): fsdp_scale's kernel. */
static void scale_rows(int64_t t, int64_t hd, float al, const float *x, int64_t ldx, float *y,
                       int64_t ldy) {
    for (int64_t i = 0; i < t; i++)
        for (int64_t e = 0; e < hd; e++)
            y[i * ldy + e] = al * x[i * ldx + e];
}

/* Zeros t rows of n floats at stride ld: the zeroed output the ops layer's GEMMs accumulate into
 * (beta = 1). */
static void zero_rows(int64_t t, int64_t n, float *c, int64_t ld) {
    for (int64_t i = 0; i < t; i++)
        memset(c + i * ld, 0, (size_t)n * sizeof(float));
}

/* C (m x n, row stride ldc) = op(A) op(B), into zeros as the composed path computes it. */
static int gemm0(fsdp_device_t *dev, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                 const float *a, int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc) {
    zero_rows(m, n, c, ldc);
    return fsdp__cpu_gemm(dev, FSDP_DTYPE_F32, ta, tb, m, n, k, 1.0, a, lda, 0, b, ldb, 0, 1.0, c,
                          ldc, 0, 1);
}

/* lim[i]: 1 + the last column of mask row i that is not -inf (t without a mask). A row masked
 * entirely keeps t, so that it comes out as the composed softmax leaves it. */
static void row_limits(int64_t t, const float *m, int64_t *lim) {
    for (int64_t i = 0; i < t; i++) {
        int64_t c = t;
        if (m)
            while (c > 0 && m[i * t + c - 1] == -INFINITY)
                c--;
        lim[i] = c > 0 ? c : t;
    }
}

/*
 * One row of scores x (t), in place: + mask, then softmax. The columns from c on have a mask
 * of -inf: the composed softmax gives them exp(-inf - max) = 0, and adds those zeros to the
 * row's sum, where they change no bit. So the softmax runs over the first c columns, and the
 * rest get what the composed path writes there, 0 times the row's 1 / sum: 0, or NaN when the
 * row's other values are NaN. Only a masked score that is finite may be skipped so.
 */
static int softmax_row(fsdp_device_t *dev, int64_t t, int64_t c, const float *m, float *x) {
    /* A masked score that is itself inf or NaN makes the composed sum NaN: take the whole row
     * then, as it does. */
    for (int64_t j = c; j < t && c < t; j++)
        if (!isfinite(x[j])) c = t;
    if (m)
        for (int64_t j = 0; j < c; j++)
            x[j] = x[j] + m[j];
    int rc = fsdp__cpu_softmax(dev, FSDP_DTYPE_F32, false, 1, (size_t)c, x, x);
    if (rc < 0) return rc;
    const float z = isnan(x[0]) ? NAN : 0.0f;
    for (int64_t j = c; j < t; j++)
        x[j] = z;
    return FSDP_OK;
}

int fsdp__cpu_attention(fsdp_device_t *dev, fsdp_dtype_t dt, int64_t batch, int64_t t,
                        int64_t heads, int64_t hd, double scale, const void *qkv, const void *mask,
                        void *p, void *y) {
    if (dt != FSDP_DTYPE_F32) return fsdp__cpu_bad_dtype(dev, "attention", dt, "f32");
    const int64_t d = heads * hd, ld = 3 * d;
    const float al = (float)scale, *m = mask;
    struct attn_scratch s;
    int rc = scratch_get(dev, "attention", t, hd, false, &s);
    if (rc < 0) return rc;
    row_limits(t, m, s.lim);
    for (int64_t b = 0; b < batch && rc >= 0; b++) {
        for (int64_t h = 0; h < heads && rc >= 0; h++) {
            const float *q = (const float *)qkv + b * t * ld + h * hd, *k = q + d, *v = q + 2 * d;
            float *pb = (float *)p + (b * heads + h) * t * t;
            float *yb = (float *)y + b * t * d + h * hd;
            scale_rows(t, hd, al, q, ld, s.qs, hd);
            /* scores = qs k^T (k^T as the transposed view of k) */
            rc = gemm0(dev, false, true, t, t, hd, s.qs, hd, k, ld, pb, t);
            if (rc < 0) break;
            for (int64_t i = 0; i < t && rc >= 0; i++)
                rc = softmax_row(dev, t, s.lim[i], m ? m + i * t : NULL, pb + i * t);
            if (rc < 0) break;
            rc = gemm0(dev, false, false, t, hd, t, pb, t, v, ld, yb, d);
        }
    }
    free(s.buf);
    return rc < 0 ? rc : FSDP_OK;
}

int fsdp__cpu_attention_backward(fsdp_device_t *dev, fsdp_dtype_t dt, int64_t batch, int64_t t,
                                 int64_t heads, int64_t hd, double scale, const void *qkv,
                                 const void *p, const void *gy, void *gqkv) {
    if (dt != FSDP_DTYPE_F32) return fsdp__cpu_bad_dtype(dev, "attention_backward", dt, "f32");
    const int64_t d = heads * hd, ld = 3 * d;
    const float al = (float)scale;
    struct attn_scratch s;
    int rc = scratch_get(dev, "attention_backward", t, hd, true, &s);
    if (rc < 0) return rc;
    for (int64_t b = 0; b < batch && rc >= 0; b++) {
        for (int64_t h = 0; h < heads && rc >= 0; h++) {
            const int64_t off = b * t * ld + h * hd;
            const float *q = (const float *)qkv + off, *k = q + d, *v = q + 2 * d;
            float *gq = (float *)gqkv + off, *gk = gq + d, *gv = gq + 2 * d;
            const float *pb = (const float *)p + (b * heads + h) * t * t;
            const float *gyb = (const float *)gy + b * t * d + h * hd;
            /* y = P v: gP = gy v^T, gv = P^T gy. */
            rc = gemm0(dev, false, true, t, t, hd, gyb, d, v, ld, s.gs, t);
            if (rc < 0) break;
            rc = gemm0(dev, true, false, t, hd, t, pb, t, gyb, d, gv, ld);
            if (rc < 0) break;
            /* P = softmax(S): gS in place of gP. */
            rc = fsdp__cpu_softmax_backward(dev, FSDP_DTYPE_F32, false, (size_t)t, (size_t)t, pb,
                                            s.gs, s.gs);
            if (rc < 0) break;
            /* S = qs k^T: gqs = gS k, then gq = scale gqs; g(k^T) = qs^T gS, then transposed. */
            rc = gemm0(dev, false, false, t, hd, t, s.gs, t, k, ld, gq, ld);
            if (rc < 0) break;
            scale_rows(t, hd, al, gq, ld, gq, ld);
            scale_rows(t, hd, al, q, ld, s.qs, hd);
            rc = gemm0(dev, true, false, hd, t, t, s.qs, hd, s.gs, t, s.gkt, t);
            if (rc < 0) break;
            for (int64_t i = 0; i < t; i++)
                for (int64_t e = 0; e < hd; e++)
                    gk[i * ld + e] = s.gkt[e * t + i];
        }
    }
    free(s.buf);
    return rc < 0 ? rc : FSDP_OK;
}
