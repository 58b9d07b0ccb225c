/* SPDX-License-Identifier: MIT */
/*
 * t_attention_packed.c: attention over packed heads as one operation (tensor/ops_attention.h,
 * the CPU device's cpu_attention.c) against the same attention composed from views,
 * fsdp_attention and a merge of the heads, as nn/gpt.c composes it where the fused kernel is
 * not taken.
 *
 * Where the mask leaves nothing to skip (no mask, a dense one) the fused path promises the
 * composed path's bits, forward and backward, and the checks compare bits: every output and
 * every gradient element, for batch, sequence and head sizes that leave the SIMD kernels tails
 * (T = 7, 17, 33; head size 5). So it does where a head's inputs are not finite or large enough
 * to overflow a skipped score (scores that overflow under the causal mask; an inf in v at a key
 * every row but the last masks): the kernel must then run the whole tile, and the NaNs come out
 * where the composed path puts them. Where the mask cuts rows short (causal, -inf holes before
 * finite columns, a row masked entirely) the fused kernel skips the masked part of its products
 * by blocks of rows, which the BLAS rounds otherwise: outputs and gradients are compared with the
 * composed path within the f32 tolerance (rtol 1.3e-6, atol 1e-5), also at T = 130, 300 and 520,
 * where several blocks and sizes of them run, and the forward is checked against a double-
 * precision reference written here, so that both paths are not merely close but right. A GPT
 * built twice from one seed gives the same loss and parameter gradients with the fused path and
 * with FSDP_FUSED_ATTENTION=0 (bitwise at T = 13, within tolerance at T = 70), in fewer
 * allocations. Bad arguments get FSDP_EINVAL and a message that names what is wrong.
 * (Behaviour F04: deterministic models are bitwise identical whichever kernels run, where no
 * masked product is skipped.)
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "tap.h"
#include "device/cpu_vec.h"
#include "tensor/ops_attention.h"

static fsdp_ctx_t *ctx;

#define F32 FSDP_DTYPE_F32
#define CAT FSDP_MEM_OTHER

static void must(int rc, const char *what) {
    if (rc < 0) tap_bail("%s failed: %s (%s)", what, fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
}

/* Uniform values in [lo, hi) from a small fixed generator (xorshift). */
static void fill_uniform(float *v, size_t n, float lo, float hi, uint32_t seed) {
    uint32_t s = seed * 2654435761u + 1u;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        v[i] = lo + (hi - lo) * (float)((s >> 8) * (1.0 / 16777216.0));
    }
}

static fsdp_tensor_t *from_host(int ndim, const int64_t *shape, const float *v) {
    fsdp_tensor_t *t = NULL;
    must(fsdp_tensor_from_host(ctx, F32, ndim, shape, v, CAT, &t), "from_host");
    return t;
}

static float *to_host(const fsdp_tensor_t *t) {
    size_t n = (size_t)fsdp_tensor_numel(t);
    float *v = malloc((n ? n : 1) * sizeof *v);
    if (!v) tap_bail("out of memory");
    must(fsdp_tensor_to_host(t, v, n * sizeof *v), "to_host");
    return v;
}

/* Index of the first element whose bits differ (NaNs of any payload count as equal), or -1. */
static int64_t first_diff(const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i]) && isnan(b[i])) continue;
        if (memcmp(&a[i], &b[i], sizeof(float)) != 0) return (int64_t)i;
    }
    return -1;
}

/* The worst |a - b| / (atol + rtol |b|) over n elements at the f32 tolerance (rtol 1.3e-6,
 * atol 1e-5); NaN in both counts as equal, in one only as infinitely far. */
static double worst_tol(const float *a, const float *b, size_t n, int64_t *at) {
    double worst = 0;
    *at = -1;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i]) && isnan(b[i])) continue;
        double r = isnan(a[i]) || isnan(b[i])
                       ? INFINITY
                       : fabs((double)a[i] - b[i]) / (1e-5 + 1.3e-6 * fabs((double)b[i]));
        if (r > worst) worst = r, *at = (int64_t)i;
    }
    return worst;
}

/* The composed path of nn/gpt.c: heads split out of qkv by views, fsdp_attention, heads merged. */
static int composed(fsdp_tensor_t *qkv, int64_t h, fsdp_tensor_t *mask, fsdp_tensor_t **out) {
    const int64_t b = fsdp_tensor_size(qkv, 0), t = fsdp_tensor_size(qkv, 1);
    const int64_t d = fsdp_tensor_size(qkv, 2) / 3, hd = d / h;
    fsdp_tensor_t *q5 = NULL, *qp = NULL, *y = NULL, *yp = NULL;
    fsdp_tensor_t *pieces[3] = {NULL, NULL, NULL}, *heads[3] = {NULL, NULL, NULL};
    const int64_t s5[5] = {b, t, 3, h, hd}, ones[3] = {1, 1, 1}, s4[4] = {b, h, t, hd};
    const int64_t s3[3] = {b, t, d};
    const int perm5[5] = {2, 0, 3, 1, 4}, perm4[4] = {0, 2, 1, 3};
    int rc = fsdp_view(qkv, 5, s5, &q5);
    if (rc >= 0) rc = fsdp_permute(q5, perm5, &qp);
    if (rc >= 0) rc = fsdp_split(qp, ones, 3, 0, pieces);
    for (int i = 0; i < 3 && rc >= 0; i++)
        rc = fsdp_view(pieces[i], 4, s4, &heads[i]);
    if (rc >= 0) rc = fsdp_attention(heads[0], heads[1], heads[2], mask, NULL, 0.0, true, &y);
    if (rc >= 0) rc = fsdp_permute(y, perm4, &yp);
    if (rc >= 0) rc = fsdp_reshape(yp, 3, s3, out);
    for (int i = 0; i < 3; i++) {
        fsdp_tensor_release(pieces[i]);
        fsdp_tensor_release(heads[i]);
    }
    fsdp_tensor_release(q5);
    fsdp_tensor_release(qp);
    fsdp_tensor_release(y);
    fsdp_tensor_release(yp);
    return rc;
}

/* One run of attention over qkv (shape, values v) with h heads: the fused operation, or the
 * composed path, forward then backward with gy; the output and qkv's gradient copied to the
 * host (*yh, *gh, to free). Returns whether the fused operation would take the input. */
static bool run_path(bool fused, const int64_t shape[3], const float *v, int64_t h,
                     fsdp_tensor_t *mask, fsdp_tensor_t *gy, float **yh, float **gh) {
    fsdp_tensor_t *qkv = from_host(3, shape, v), *y = NULL;
    must(fsdp_tensor_set_requires_grad(qkv, true), "requires_grad");
    const bool taken = fsdp__attention_packed_ok(qkv, h, mask);
    const double hd = (double)(shape[2] / 3 / h);
    if (fused)
        must(fsdp__attention_packed(qkv, h, 1.0 / sqrt(hd), mask, &y), "fused");
    else
        must(composed(qkv, h, mask, &y), "composed");
    must(fsdp_backward(y, gy), "backward");
    *yh = to_host(y);
    *gh = to_host(fsdp_tensor_grad(qkv));
    fsdp_tensor_release(qkv);
    fsdp_tensor_release(y);
    fsdp_tape_clear(ctx);
    return taken;
}

/* The forward in double, by the definition: y = softmax(q k^T / sqrt(hd) + mask) v per head. */
static void reference(int64_t b, int64_t t, int64_t h, int64_t hd, const float *qkv,
                      const float *mask, double *y) {
    const int64_t d = h * hd, ld = 3 * d;
    double *s = malloc((size_t)t * sizeof *s);
    if (!s) tap_bail("out of memory");
    for (int64_t n = 0; n < b; n++)
        for (int64_t hh = 0; hh < h; hh++)
            for (int64_t i = 0; i < t; i++) {
                const float *q = qkv + (n * t + i) * ld + hh * hd;
                double mx = -INFINITY, sum = 0;
                for (int64_t j = 0; j < t; j++) {
                    const float *k = qkv + (n * t + j) * ld + d + hh * hd;
                    double dot = 0;
                    for (int64_t e = 0; e < hd; e++)
                        dot += (double)q[e] * (double)k[e];
                    s[j] = dot / sqrt((double)hd) + (mask ? (double)mask[i * t + j] : 0.0);
                    mx = fmax(mx, s[j]);
                }
                for (int64_t j = 0; j < t; j++)
                    sum += s[j] = exp(s[j] - mx);
                for (int64_t e = 0; e < hd; e++) {
                    double acc = 0;
                    for (int64_t j = 0; j < t; j++)
                        acc += s[j] / sum * (double)qkv[(n * t + j) * ld + 2 * d + hh * hd + e];
                    y[((n * t + i) * h + hh) * hd + e] = acc;
                }
            }
    free(s);
}

enum mask_kind { M_NONE, M_CAUSAL, M_DENSE, M_HOLES, M_DEAD_ROW, M_OVERFLOW, M_INF_V };
static const char *const mask_names[] = {"no mask",          "causal mask", "dense mask",
                                         "-inf holes",       "a dead row",  "overflowing scores",
                                         "inf in a masked v"};

static float *make_mask(enum mask_kind k, int64_t t, uint32_t seed) {
    if (k == M_NONE) return NULL;
    float *m = malloc((size_t)(t * t) * sizeof *m);
    if (!m) tap_bail("out of memory");
    if (k == M_DENSE) {
        fill_uniform(m, (size_t)(t * t), -2.0f, 2.0f, seed);
        return m;
    }
    for (int64_t i = 0; i < t; i++)
        for (int64_t j = 0; j < t; j++)
            m[i * t + j] = j <= i ? 0.0f : -INFINITY;
    if (k == M_HOLES) /* -inf before finite columns: only the tail may be skipped */
        for (int64_t i = 0; i < t; i++)
            for (int64_t j = 0; j < t; j++) {
                if ((i + j) % 3 == 1 && j != i)
                    m[i * t + j] = -INFINITY;
                else if (j > i && (i + j) % 4 == 0)
                    m[i * t + j] = 0.5f;
            }
    if (k == M_DEAD_ROW)
        for (int64_t j = 0; j < t; j++)
            m[(t / 2) * t + j] = -INFINITY;
    return m;
}

/* One case: fused and composed outputs and qkv gradients compared bit for bit. */
static void check_case(int64_t b, int64_t t, int64_t h, int64_t hd, enum mask_kind mk,
                       uint32_t seed) {
    const int64_t d = h * hd, shape[3] = {b, t, 3 * d}, ms[2] = {t, t}, ys[3] = {b, t, d};
    const size_t n = (size_t)(b * t * 3 * d), ny = (size_t)(b * t * d);
    float *v = malloc(n * sizeof *v), *gyv = malloc(ny * sizeof *gyv);
    if (!v || !gyv) tap_bail("out of memory");
    fill_uniform(v, n, -1.0f, 1.0f, seed);
    if (mk == M_OVERFLOW) {
        /* q > 0 and the key of the last position at 3e38: its scores overflow to +inf, and in
         * every row but the last that key is masked (causal), so inf + -inf: NaN as composed. */
        for (int64_t r = 0; r < b * t; r++)
            for (int64_t e = 0; e < d; e++) {
                float *q = &v[r * 3 * d + e];
                *q = fabsf(*q) + 0.5f;
                if (r % t == t - 1) v[r * 3 * d + d + e] = 3e38f;
            }
    }
    if (mk == M_INF_V) /* the last key's v in every head: masked for every row but the last */
        for (int64_t n0 = 0; n0 < b; n0++)
            for (int64_t hh = 0; hh < h; hh++)
                v[((n0 + 1) * t - 1) * 3 * d + 2 * d + hh * hd] = INFINITY;
    fill_uniform(gyv, ny, -1.0f, 1.0f, seed + 7);
    float *mv = make_mask(mk == M_OVERFLOW || mk == M_INF_V ? M_CAUSAL : mk, t, seed + 3);
    fsdp_tensor_t *mask = mv ? from_host(2, ms, mv) : NULL, *gy = from_host(3, ys, gyv);
    float *yh[2], *gh[2];
    const char *tag = mask_names[mk];
    for (int path = 0; path < 2; path++) {
        const bool taken = run_path(path == 0, shape, v, h, mask, gy, &yh[path], &gh[path]);
        tap_ok(taken, "B %lld T %lld H %lld hd %lld, %s: the fused kernel takes it", (long long)b,
               (long long)t, (long long)h, (long long)hd, tag);
    }
    /* Masks that cut rows short let the fused kernel skip; the others, and inputs it must not
     * skip over, keep the composed bits. */
    const bool skips = mk == M_CAUSAL || mk == M_HOLES || mk == M_DEAD_ROW;
    if (!skips) {
        int64_t dy = first_diff(yh[0], yh[1], ny), dg = first_diff(gh[0], gh[1], n);
        tap_ok(dy < 0, "B %lld T %lld H %lld hd %lld, %s: output bitwise the composed one%s",
               (long long)b, (long long)t, (long long)h, (long long)hd, tag,
               dy < 0 ? "" : " (differs)");
        if (dy >= 0) tap_diag("first at %lld: %.9g vs %.9g", (long long)dy, yh[0][dy], yh[1][dy]);
        tap_ok(dg < 0, "B %lld T %lld H %lld hd %lld, %s: qkv gradient bitwise the composed one",
               (long long)b, (long long)t, (long long)h, (long long)hd, tag);
        if (dg >= 0) tap_diag("first at %lld: %.9g vs %.9g", (long long)dg, gh[0][dg], gh[1][dg]);
    } else {
        int64_t ay, ag;
        double wy = worst_tol(yh[0], yh[1], ny, &ay), wg = worst_tol(gh[0], gh[1], n, &ag);
        tap_ok(wy <= 1.0,
               "B %lld T %lld H %lld hd %lld, %s: output within f32 tolerance of the composed one "
               "(worst %.3g of it)",
               (long long)b, (long long)t, (long long)h, (long long)hd, tag, wy);
        if (wy > 1.0) tap_diag("at %lld: %.9g vs %.9g", (long long)ay, yh[0][ay], yh[1][ay]);
        tap_ok(wg <= 1.0,
               "B %lld T %lld H %lld hd %lld, %s: qkv gradient within f32 tolerance of the "
               "composed one (worst %.3g of it)",
               (long long)b, (long long)t, (long long)h, (long long)hd, tag, wg);
        if (wg > 1.0) tap_diag("at %lld: %.9g vs %.9g", (long long)ag, gh[0][ag], gh[1][ag]);
    }
    if (mk == M_INF_V && t > 1) /* row 0 weighs the last key 0: 0 x inf */
        tap_ok(isnan(yh[0][0]) && isnan(gh[0][0]),
               "an inf in a masked v spreads NaN to row 0's output and q gradient, as composed");
    if (mk == M_NONE || mk == M_CAUSAL || mk == M_DENSE) {
        double *ref = malloc(ny * sizeof *ref), worst = 0;
        if (!ref) tap_bail("out of memory");
        reference(b, t, h, hd, v, mv, ref);
        for (size_t i = 0; i < ny; i++)
            worst = fmax(worst, fabs(yh[0][i] - ref[i]) / (1e-5 + 1.3e-6 * fabs(ref[i])));
        tap_ok(worst <= 1.0,
               "B %lld T %lld H %lld hd %lld, %s: within f32 tolerance of the "
               "double reference (worst %.3g of it)",
               (long long)b, (long long)t, (long long)h, (long long)hd, tag, worst);
        free(ref);
    }
    if (mk == M_DEAD_ROW) {
        /* Row t/2 of every head has no admissible key: NaN, as softmax over -inf gives. */
        tap_ok(isnan(yh[0][(size_t)(t / 2) * (size_t)d]), "a row masked entirely comes out NaN");
    }
    for (int path = 0; path < 2; path++) {
        free(yh[path]);
        free(gh[path]);
    }
    fsdp_tensor_release(mask);
    fsdp_tensor_release(gy);
    free(v);
    free(gyv);
    free(mv);
}

static void test_bits(void) {
    static const int64_t sizes[][4] = {{1, 1, 1, 1},   {2, 7, 3, 5},   {1, 17, 2, 16},
                                       {2, 33, 4, 8},  {1, 64, 6, 64}, {1, 130, 2, 16},
                                       {2, 300, 1, 8}, {1, 520, 1, 16}};
    uint32_t seed = 11;
    for (size_t c = 0; c < sizeof sizes / sizeof sizes[0]; c++)
        for (int mk = M_NONE; mk <= M_INF_V; mk++)
            check_case(sizes[c][0], sizes[c][1], sizes[c][2], sizes[c][3], (enum mask_kind)mk,
                       seed++);
}

/* The prefetch of the rows whose norms decide the skipping (cpu_vec.h) changes no bit: a causal
 * case that skips, forward and backward, with and without it. */
static void test_prefetch(void) {
    const int64_t b = 2, t = 130, h = 2, hd = 64, d = h * hd, shape[3] = {b, t, 3 * d};
    const int64_t ys[3] = {b, t, d}, ms[2] = {t, t};
    const size_t n = (size_t)(b * t * 3 * d), ny = (size_t)(b * t * d);
    float *v = malloc(n * sizeof *v), *gyv = malloc(ny * sizeof *gyv);
    float *mv = make_mask(M_CAUSAL, t, 5);
    if (!v || !gyv || !mv) tap_bail("out of memory");
    fill_uniform(v, n, -1.0f, 1.0f, 41);
    fill_uniform(gyv, ny, -1.0f, 1.0f, 42);
    fsdp_tensor_t *mask = from_host(2, ms, mv), *gy = from_host(3, ys, gyv);
    float *yh[2], *gh[2];
    for (int on = 0; on < 2; on++) {
        fsdp__vec_set_prefetch(on);
        run_path(true, shape, v, h, mask, gy, &yh[on], &gh[on]);
    }
    fsdp__vec_set_prefetch(true);
    tap_ok(first_diff(yh[0], yh[1], ny) < 0 && first_diff(gh[0], gh[1], n) < 0,
           "B 2 T 130 H 2 hd 64, causal: the same output and qkv gradient bits with and without "
           "prefetch");
    for (int on = 0; on < 2; on++) {
        free(yh[on]);
        free(gh[on]);
    }
    fsdp_tensor_release(mask);
    fsdp_tensor_release(gy);
    free(v);
    free(gyv);
    free(mv);
}

/* Bad arguments: not taken by _ok, and FSDP_EINVAL from the operation, naming the problem. */
static void test_errors(void) {
    const int64_t s3[3] = {2, 4, 12}, s2[2] = {4, 12}, m5[2] = {5, 5}, m4[2] = {4, 4};
    fsdp_tensor_t *qkv = NULL, *flat = NULL, *wide = NULL, *good = NULL, *q64 = NULL;
    fsdp_tensor_t *y = NULL, *tr = NULL;
    must(fsdp_tensor_zeros(ctx, F32, 3, s3, CAT, &qkv), "zeros");
    must(fsdp_tensor_zeros(ctx, F32, 2, s2, CAT, &flat), "zeros");
    must(fsdp_tensor_zeros(ctx, F32, 2, m5, CAT, &wide), "zeros");
    must(fsdp_tensor_zeros(ctx, F32, 2, m4, CAT, &good), "zeros");
    must(fsdp_tensor_zeros(ctx, FSDP_DTYPE_F64, 3, s3, CAT, &q64), "zeros");
    must(fsdp_transpose(qkv, 0, 1, &tr), "transpose");
    struct {
        fsdp_tensor_t *qkv, *mask;
        int64_t heads;
        const char *what, *needle;
    } bad[] = {
        {qkv, NULL, 3, "heads 3 do not divide d 4", "heads must divide d"},
        {qkv, NULL, 0, "heads 0", "heads must divide d"},
        {flat, NULL, 2, "a 2-d qkv", "(B, T, 3 d)"},
        {q64, NULL, 2, "an f64 qkv", "contiguous f32"},
        {tr, NULL, 2, "a transposed qkv", "contiguous f32"},
        {qkv, wide, 2, "a (5, 5) mask for T 4", "mask must be"},
        {NULL, NULL, 2, "no qkv", NULL},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        tap_ok(!fsdp__attention_packed_ok(bad[i].qkv, bad[i].heads, bad[i].mask), "%s: not taken",
               bad[i].what);
        int rc = fsdp__attention_packed(bad[i].qkv, bad[i].heads, 1.0, bad[i].mask, &y);
        /* Without a tensor there is no context to hold a message: the code alone. */
        const char *msg = bad[i].qkv ? fsdp_ctx_last_error(ctx) : NULL;
        bool said = !bad[i].needle || (msg && strstr(msg, bad[i].needle));
        tap_ok(rc == FSDP_EINVAL && y == NULL && said, "%s: FSDP_EINVAL%s%s%s", bad[i].what,
               bad[i].needle ? " saying \"" : "", bad[i].needle ? bad[i].needle : "",
               bad[i].needle ? "\"" : "");
        if (rc != FSDP_EINVAL || !said) tap_diag("rc %d, message: %s", rc, msg ? msg : "(none)");
    }
    must(fsdp_tensor_set_requires_grad(good, true), "requires_grad");
    tap_ok(!fsdp__attention_packed_ok(qkv, 2, good), "a mask that needs a gradient: not taken");
    tap_ok(fsdp_tensor_numel(qkv) == 96 && fsdp__attention_packed_ok(qkv, 2, NULL),
           "the same qkv with heads 2 and no mask: taken");
    setenv("FSDP_FUSED_ATTENTION", "0", 1);
    tap_ok(!fsdp__attention_packed_ok(qkv, 2, NULL), "FSDP_FUSED_ATTENTION=0: not taken");
    unsetenv("FSDP_FUSED_ATTENTION");
    fsdp_tensor_release(qkv);
    fsdp_tensor_release(flat);
    fsdp_tensor_release(wide);
    fsdp_tensor_release(good);
    fsdp_tensor_release(q64);
    fsdp_tensor_release(tr);
}

/* A GPT's loss and every parameter's gradient, with the fused path or without it. */
struct gpt_run {
    double loss;
    size_t allocs;
    size_t nparams, total;
    float *grads;
};

static void gpt_run(bool fused, int64_t t, struct gpt_run *r) {
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    o.seed = 99;
    fsdp_ctx_t *c = NULL;
    if (fsdp_ctx_create(&o, &c) < 0) tap_bail("context creation failed");
    fsdp_gpt_config_t cfg;
    fsdp_gpt_config_init(&cfg);
    cfg.vocab = 37;
    cfg.max_seq = t;
    cfg.n_layer = 2;
    cfg.n_head = 3;
    cfg.d_model = 24;
    fsdp_module_t *m = NULL;
    if (fsdp_gpt_create(c, &cfg, &m) < 0) tap_bail("gpt_create: %s", fsdp_ctx_last_error(c));
    const int64_t bsz = 3, shape[2] = {bsz, t};
    int64_t *tok = malloc((size_t)(bsz * t) * sizeof *tok);
    int64_t *tgt = malloc((size_t)(bsz * t) * sizeof *tgt);
    if (!tok || !tgt) tap_bail("out of memory");
    for (int64_t i = 0; i < bsz * t; i++) {
        tok[i] = (i * 7 + 3) % 37;
        tgt[i] = (i * 11 + 5) % 37;
    }
    fsdp_tensor_t *tokens = NULL, *targets = NULL, *loss = NULL, *logits = NULL;
    if (fsdp_tensor_from_host(c, FSDP_DTYPE_I64, 2, shape, tok, CAT, &tokens) < 0 ||
        fsdp_tensor_from_host(c, FSDP_DTYPE_I64, 2, shape, tgt, CAT, &targets) < 0)
        tap_bail("tokens: %s", fsdp_ctx_last_error(c));
    free(tok);
    free(tgt);
    if (!fused) setenv("FSDP_FUSED_ATTENTION", "0", 1);
    fsdp_mem_stats_t before, after;
    fsdp_mem_get_stats(c, &before);
    if (fsdp_gpt_forward_loss(m, tokens, targets, &loss, &logits) < 0 ||
        fsdp_backward(loss, NULL) < 0)
        tap_bail("gpt step: %s", fsdp_ctx_last_error(c));
    fsdp_mem_get_stats(c, &after);
    unsetenv("FSDP_FUSED_ATTENTION");
    r->allocs = after.allocs - before.allocs;
    if (fsdp_tensor_item(loss, 0, &r->loss) < 0) tap_bail("item");
    fsdp_named_list_t ps;
    if (fsdp_module_named_params(m, false, &ps) < 0) tap_bail("named_params");
    r->nparams = ps.n;
    r->total = 0;
    for (size_t i = 0; i < ps.n; i++)
        r->total += (size_t)fsdp_tensor_numel(ps.tensors[i]);
    r->grads = malloc(r->total * sizeof(float));
    if (!r->grads) tap_bail("out of memory");
    size_t off = 0;
    for (size_t i = 0; i < ps.n; i++) {
        fsdp_tensor_t *g = fsdp_tensor_grad(ps.tensors[i]);
        size_t k = (size_t)fsdp_tensor_numel(ps.tensors[i]);
        if (!g || fsdp_tensor_to_host(g, r->grads + off, k * sizeof(float)) < 0)
            tap_bail("gradient of %s", ps.names[i]);
        off += k;
    }
    fsdp_named_list_free(&ps);
    fsdp_tensor_release(tokens);
    fsdp_tensor_release(targets);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(logits);
    fsdp_module_release(m);
    fsdp_tape_clear(c);
    fsdp_ctx_destroy(c);
}

static void test_gpt(void) {
    struct gpt_run fu, co;
    /* T = 13: one block of rows, the composed path's products: bitwise. */
    gpt_run(true, 13, &fu);
    gpt_run(false, 13, &co);
    tap_ok(memcmp(&fu.loss, &co.loss, sizeof fu.loss) == 0,
           "GPT, T 13: the loss is bitwise the same with and without the fused path (%.9g, %.9g)",
           fu.loss, co.loss);
    tap_ok(fu.total == co.total && first_diff(fu.grads, co.grads, fu.total) < 0,
           "GPT, T 13: all %zu parameter gradients (%zu elements) bitwise the same", fu.nparams,
           fu.total);
    tap_ok(fu.allocs < co.allocs,
           "GPT: the fused path allocates less in a step (%zu against %zu allocations)", fu.allocs,
           co.allocs);
    free(fu.grads);
    free(co.grads);
    /* T = 70: the causal blocks skip; the same within f32 tolerance. */
    gpt_run(true, 70, &fu);
    gpt_run(false, 70, &co);
    tap_ok(fabs(fu.loss - co.loss) <= 1e-5 + 1.3e-6 * fabs(co.loss),
           "GPT, T 70: the loss within f32 tolerance with and without the fused path (%.9g, %.9g)",
           fu.loss, co.loss);
    int64_t at;
    double w = fu.total == co.total ? worst_tol(fu.grads, co.grads, fu.total, &at) : INFINITY;
    tap_ok(w <= 1.0,
           "GPT, T 70: all %zu parameter gradients within f32 tolerance (worst %.3g of it)",
           fu.nparams, w);
    free(fu.grads);
    free(co.grads);
}

int main(void) {
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    if (fsdp_ctx_create(&o, &ctx) < 0) tap_bail("context creation failed");
    tap_plan_lazy();
    test_bits();
    test_prefetch();
    test_errors();
    test_gpt();
    fsdp_tape_clear(ctx);
    fsdp_ctx_destroy(ctx);
    return tap_done();
}
