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
 * Over the whole tile the arithmetic is the composed path's, kernel for kernel: the same
 * products through fsdp__cpu_gemm with the same shapes and transpose flags (only the leading
 * dimensions differ, and the BLAS packs its operands whatever their stride), each into zeros
 * with beta = 1 as the ops layer's outputs are; the same softmax and softmax-backward kernels;
 * scale and mask as single float operations in the same order. So every value is bit for bit
 * what fsdp_attention gives on split heads (t_attention_packed checks it). The one product
 * whose output is transposed (the gradient of k, computed as that of k^T) goes through a small
 * scratch tile and is transposed on the way out.
 *
 * Under a mask that cuts rows short, as the causal one does, the products skip what the mask
 * removes: the composed path computes every score of the T x T tile and multiplies every weight,
 * though half of them are masked and their weights are zeros. Here the products of a head run by
 * blocks of rows (block_rows: 32 at T = 128, up to 128 at T >= 1024), a block of queries only as
 * far as its last key with a weight (its rows' limits), a block of keys from the first query that
 * weighs it, so a causal head does about half the arithmetic of its products and of its softmax
 * backward. What is left out is a sum of terms that are a zero weight times a finite value, so
 * the results are those of the whole tile up to the order of the additions: the BLAS gives other
 * roundings to products of other shapes, so the skipping path is not bit for bit the composed
 * one (t_attention_packed compares it within f32 tolerance, and with the double reference). A
 * head takes the blocks only when its inputs are finite and small enough that no skipped product
 * can overflow (`bounded`); otherwise, or when the mask leaves nothing to skip, it runs the whole
 * tile as above, and an inf or NaN spreads exactly as in the composed path. The backward finds
 * its rows' limits in the saved weights (the last weight that is not an exact zero), so it needs
 * no mask.
 *
 * Invariants: p holds the forward's softmax, which the backward reads; the caller checked the
 * shapes (the ops layer); scratch is one allocation per call, freed before returning.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "device/cpu_impl.h"
#include "device/cpu_vec.h"

/* Per-call scratch: the scaled q of one head (t x hd), the rows' limits (t: the forward's from
 * the mask, the backward's from the weights), and for the backward the gradient of its scores
 * (t x t) and of k^T (hd x t). */
struct attn_scratch {
    void *buf; /* the one allocation the others point into */
    float *qs, *gs, *gkt;
    int64_t *lim;
};

static int scratch_get(fsdp_device_t *dev, const char *fn, int64_t t, int64_t hd, bool backward,
                       struct attn_scratch *s) {
    size_t nq = (size_t)(t * hd), ns = backward ? (size_t)(t * t) : 0;
    size_t nk = backward ? nq : 0, nl = (size_t)t;
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
 * entirely keeps t, so that it comes out as the composed softmax leaves it. Whether any row
 * stops short of t. */
static bool row_limits(int64_t t, const float *m, int64_t *lim) {
    bool any = false;
    for (int64_t i = 0; i < t; i++) {
        int64_t c = t;
        if (m)
            while (c > 0 && m[i * t + c - 1] == -INFINITY)
                c--;
        lim[i] = c > 0 ? c : t;
        any |= lim[i] < t;
    }
    return any;
}

/* Rows (or keys) per block of the skipping products: an eighth of the tile, between 32 and 128
 * and a multiple of 16 (the BLAS kernels' row unroll). Measured here (OpenBLAS, one core): at
 * T = 128 blocks of 32 take the products of a causal head from 50 to 36 us, and at T = 1024
 * blocks of 128 from about 1 ms to 0.55 to 0.68 ms each; smaller blocks pay the calls' own cost,
 * larger ones skip less. */
static int64_t block_rows(int64_t t) {
    int64_t r = (t / 8) & ~(int64_t)15;
    return r < 32 ? 32 : r > 128 ? 128 : r;
}

/* The largest squared norm of t rows of hd floats at stride ld, summed in double by the SIMD
 * kernel (which no finite float overflows); inf or NaN when a value is not finite. */
static double max_row_sq(int64_t t, int64_t hd, const float *x, int64_t ld) {
    const bool pf = fsdp__vec_prefetch_on();
    double best = 0;
    for (int64_t i = 0; i < t; i++) {
        /* Four rows ahead: rows at a stride, which the hardware does not prefetch (cpu_vec.h). */
        if (pf && i + 4 < t) fsdp__prefetch(x + (i + 4) * ld, (size_t)hd * sizeof *x);
        const double s = fsdp__vec_sumsq_dev_f32((size_t)hd, x + i * ld, 0.0);
        if (!(s <= best)) best = s; /* a NaN stays */
    }
    return best;
}

/* Whether every value of a and b (t rows of hd each) is finite and no dot product of a row of a
 * with a row of b can come near overflow (|a.b| <= |a| |b|, with room for the rounding of hd
 * additions): then a product the blocks skip is finite, and its weight of zero makes it 0. */
static bool bounded(int64_t t, int64_t hd, const float *a, int64_t lda, const float *b,
                    int64_t ldb) {
    const double na = max_row_sq(t, hd, a, lda), nb = max_row_sq(t, hd, b, ldb);
    return isfinite(na) && isfinite(nb) && sqrt(na) * sqrt(nb) < 1e37;
}

/* The largest lim[i] over rows [i0, i1): how far a block of queries reaches. */
static int64_t block_reach(const int64_t *lim, int64_t i0, int64_t i1) {
    int64_t c = 0;
    for (int64_t i = i0; i < i1; i++)
        if (lim[i] > c) c = lim[i];
    return c;
}

/* The first row i with lim[i] > j (t if none): no row before it weighs key j or any later one. */
static int64_t first_reaching(const int64_t *lim, int64_t t, int64_t j) {
    int64_t i = 0;
    while (i < t && lim[i] <= j)
        i++;
    return i;
}

/* lim[i]: 1 + the last column of row i of the weights p that is not an exact zero (a NaN is not
 * one), at least 1. Whether any row stops short of t. */
static bool weight_limits(int64_t t, const float *p, int64_t *lim) {
    bool any = false;
    for (int64_t i = 0; i < t; i++) {
        const float *row = p + i * t;
        int64_t c = t;
        /* 16 at a time while they are all zeros (of either sign: the bits but the sign's), in a
         * loop the compiler vectorises; then one at a time. */
        while (c > 16) {
            uint32_t w[16], any_bits = 0;
            memcpy(w, row + c - 16, sizeof w);
            for (int k = 0; k < 16; k++)
                any_bits |= w[k] & 0x7fffffffu;
            if (any_bits) break;
            c -= 16;
        }
        while (c > 1 && row[c - 1] == 0.0f)
            c--;
        lim[i] = c;
        any |= c < t;
    }
    return any;
}

/*
 * One row of scores x (t), in place: + mask, then softmax. The columns from c on have a mask
 * of -inf: the composed softmax gives them exp(-inf - max) = 0, and adds those zeros to the
 * row's sum, where they change no bit. So the softmax runs over the first c columns, and the
 * rest get what the composed path writes there, 0 times the row's 1 / sum: 0, or NaN when the
 * row's other values are NaN. Only a masked score that is finite may be skipped so; `finite`
 * says the caller knows the masked scores to be (the blocks then did not compute them).
 */
static int softmax_row(fsdp_device_t *dev, int64_t t, int64_t c, const float *m, bool finite,
                       float *x) {
    /* A masked score that is itself inf or NaN makes the composed sum NaN: take the whole row
     * then, as it does. */
    for (int64_t j = c; j < t && c < t && !finite; j++)
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

/*
 * One head's forward. With `blocks` (the file's header) it runs by blocks of queries: the scores
 * of each block as far as its rows reach, their softmax, and the product with v over those keys
 * only; the weights past a row's limit are written as the whole tile writes them (softmax_row),
 * so the backward reads the same layout, and a row of NaN (a mask of +inf or NaN) makes its
 * block take every key. Without, one block of t rows over every key: the composed path's shapes.
 */
static int forward_head(fsdp_device_t *dev, int64_t t, int64_t hd, const struct attn_scratch *s,
                        bool blocks, const float *k, const float *v, int64_t ld, const float *m,
                        float *pb, float *yb, int64_t ldy) {
    const int64_t rb = blocks ? block_rows(t) : t;
    int rc = FSDP_OK;
    for (int64_t i0 = 0; i0 < t && rc >= 0; i0 += rb) {
        const int64_t i1 = i0 + rb < t ? i0 + rb : t;
        int64_t c = blocks ? block_reach(s->lim, i0, i1) : t;
        /* scores = qs k^T (k^T as the transposed view of k) */
        rc = gemm0(dev, false, true, i1 - i0, c, hd, s->qs + i0 * hd, hd, k, ld, pb + i0 * t, t);
        for (int64_t i = i0; i < i1 && rc >= 0; i++) {
            rc = softmax_row(dev, t, s->lim[i], m ? m + i * t : NULL, blocks, pb + i * t);
            if (isnan(pb[i * t])) c = t;
        }
        if (rc >= 0)
            rc =
                gemm0(dev, false, false, i1 - i0, hd, c, pb + i0 * t, t, v, ld, yb + i0 * ldy, ldy);
    }
    return rc;
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
    /* Some row stops short: the blocks have something to leave out. */
    const bool skip = row_limits(t, m, s.lim);
    for (int64_t b = 0; b < batch && rc >= 0; b++) {
        for (int64_t h = 0; h < heads && rc >= 0; h++) {
            const float *q = (const float *)qkv + b * t * ld + h * hd, *k = q + d, *v = q + 2 * d;
            float *pb = (float *)p + (b * heads + h) * t * t;
            float *yb = (float *)y + b * t * d + h * hd;
            scale_rows(t, hd, al, q, ld, s.qs, hd);
            const bool blocks =
                skip && bounded(t, hd, s.qs, hd, k, ld) && isfinite(max_row_sq(t, hd, v, ld));
            rc = forward_head(dev, t, hd, &s, blocks, k, v, ld, m, pb, yb, d);
        }
    }
    free(s.buf);
    return rc < 0 ? rc : FSDP_OK;
}

/*
 * One head's backward. With `blocks` (the file's header) each product runs by blocks of rows as
 * far as lim reaches; without, lim is t everywhere and every product is one call over the whole
 * tile, the composed path's shapes. s->qs holds the scaled q.
 */
static int backward_head(fsdp_device_t *dev, int64_t t, int64_t hd, const struct attn_scratch *s,
                         bool blocks, const float *k, const float *v, int64_t ld, const float *pb,
                         const float *gyb, int64_t ldy, float al, float *gq) {
    const int64_t rb = blocks ? block_rows(t) : t, d = ld / 3;
    const int64_t *lim = s->lim;
    float *gk = gq + d, *gv = gq + 2 * d;
    int rc = FSDP_OK;
    /* y = P v: gP = gy v^T, by blocks of queries; gv = P^T gy, by blocks of keys, each from the
     * first query that weighs it (none: zeros). */
    for (int64_t i0 = 0; i0 < t && rc >= 0; i0 += rb) {
        const int64_t i1 = i0 + rb < t ? i0 + rb : t, c = block_reach(lim, i0, i1);
        rc = gemm0(dev, false, true, i1 - i0, c, hd, gyb + i0 * ldy, ldy, v, ld, s->gs + i0 * t, t);
    }
    for (int64_t j0 = 0; j0 < t && rc >= 0; j0 += rb) {
        const int64_t j1 = j0 + rb < t ? j0 + rb : t, i = first_reaching(lim, t, j0);
        if (i == t)
            zero_rows(j1 - j0, hd, gv + j0 * ld, ld);
        else
            rc = gemm0(dev, true, false, j1 - j0, hd, t - i, pb + i * t + j0, t, gyb + i * ldy, ldy,
                       gv + j0 * ld, ld);
    }
    if (rc < 0) return rc;
    /* P = softmax(S): gS in place of gP, over each row's weights, zeros past them. */
    if (!blocks)
        rc = fsdp__cpu_softmax_backward(dev, FSDP_DTYPE_F32, false, (size_t)t, (size_t)t, pb, s->gs,
                                        s->gs);
    for (int64_t i = 0; i < t && blocks && rc >= 0; i++) {
        rc = fsdp__cpu_softmax_backward(dev, FSDP_DTYPE_F32, false, 1, (size_t)lim[i], pb + i * t,
                                        s->gs + i * t, s->gs + i * t);
        memset(s->gs + i * t + lim[i], 0, (size_t)(t - lim[i]) * sizeof(float));
    }
    /* S = qs k^T: gqs = gS k, then gq = scale gqs; g(k^T) = qs^T gS, then transposed. */
    for (int64_t i0 = 0; i0 < t && rc >= 0; i0 += rb) {
        const int64_t i1 = i0 + rb < t ? i0 + rb : t, c = block_reach(lim, i0, i1);
        rc = gemm0(dev, false, false, i1 - i0, hd, c, s->gs + i0 * t, t, k, ld, gq + i0 * ld, ld);
    }
    if (rc < 0) return rc;
    scale_rows(t, hd, al, gq, ld, gq, ld);
    for (int64_t j0 = 0; j0 < t && rc >= 0; j0 += rb) {
        const int64_t j1 = j0 + rb < t ? j0 + rb : t, i = first_reaching(lim, t, j0);
        if (i == t)
            zero_rows(hd, j1 - j0, s->gkt + j0, t);
        else
            rc = gemm0(dev, true, false, hd, j1 - j0, t - i, s->qs + i * hd, hd, s->gs + i * t + j0,
                       t, s->gkt + j0, t);
    }
    if (rc < 0) return rc;
    for (int64_t i = 0; i < t; i++)
        for (int64_t e = 0; e < hd; e++)
            gk[i * ld + e] = s->gkt[e * t + i];
    return FSDP_OK;
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
            const float *pb = (const float *)p + (b * heads + h) * t * t;
            const float *gyb = (const float *)gy + b * t * d + h * hd;
            scale_rows(t, hd, al, q, ld, s.qs, hd);
            bool blocks = weight_limits(t, pb, s.lim) && bounded(t, hd, gyb, d, v, ld) &&
                          bounded(t, hd, s.qs, hd, k, ld);
            if (!blocks)
                for (int64_t i = 0; i < t; i++)
                    s.lim[i] = t;
            rc = backward_head(dev, t, hd, &s, blocks, k, v, ld, pb, gyb, d, al,
                               (float *)gqkv + off);
        }
    }
    free(s.buf);
    return rc < 0 ? rc : FSDP_OK;
}
