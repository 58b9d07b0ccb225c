/* SPDX-License-Identifier: MIT */
/*
 * t_transformer.c: tests of attention, the transformer modules and the GPT model.
 *
 * Structure is checked against what PyTorch 1.13 lists (the expected names, orders and counts
 * below are written out by hand from torch.nn's source); MultiheadAttention's forward against a
 * naive double-precision reference written here, for every projection path and mask kind; the
 * layers against their children composed by hand; gradients by finite differences in f64 (the
 * modules are built in f32 and their parameters swapped for f64 copies with
 * fsdp_module_set_param). GPT is checked for causality, its tied head (one parameter, both
 * gradient contributions) and train/eval behaviour. Everything is tiny and runs in well under a
 * second.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "gradcheck.h"
#include "tap.h"

static fsdp_ctx_t *ctx;

#define F64 FSDP_DTYPE_F64
#define F32 FSDP_DTYPE_F32
#define CAT FSDP_MEM_OTHER

/* Stops the run when a call that must succeed fails: later checks would only cascade. */
static void must(int rc, const char *what) {
    if (rc < 0) tap_bail("%s failed: %s (%s)", what, fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
}

/* One TAP line per checked input (gc_check shares tap.h's counter). */
static void gc(const char *name, gc_fn fn, void *arg, int nin, fsdp_tensor_t *const *in,
               double rtol, double atol) {
    gc_check(ctx, name, fn, arg, nin, in, NULL, 1e-6, rtol, atol);
}

/* ---- helpers --------------------------------------------------------------------------------- */

/* A tensor of dtype dt with values uniform in [lo, hi) from a fixed generator. */
static fsdp_tensor_t *randt(fsdp_dtype_t dt, int ndim, const int64_t *shape, double lo, double hi,
                            unsigned seed) {
    fsdp_tensor_t *t64 = gc_rand(ctx, ndim, shape, lo, hi, seed), *t = NULL;
    if (!t64) tap_bail("gc_rand failed");
    if (dt == F64) return t64;
    must(fsdp_tensor_empty(ctx, dt, ndim, shape, CAT, &t), "empty");
    must(fsdp_tensor_copy_(t, t64), "copy_");
    fsdp_tensor_release(t64);
    return t;
}

static fsdp_tensor_t *mk_i64(int ndim, const int64_t *shape, const int64_t *v) {
    fsdp_tensor_t *t = NULL;
    must(fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, ndim, shape, v, CAT, &t), "from_host i64");
    return t;
}

static fsdp_tensor_t *mk_bool(int ndim, const int64_t *shape, const unsigned char *v) {
    fsdp_tensor_t *t = NULL;
    must(fsdp_tensor_from_host(ctx, FSDP_DTYPE_BOOL, ndim, shape, v, CAT, &t), "from_host bool");
    return t;
}

static fsdp_tensor_t *mk_f(fsdp_dtype_t dt, int ndim, const int64_t *shape, const double *v) {
    fsdp_tensor_t *t64 = NULL, *t = NULL;
    must(fsdp_tensor_from_host(ctx, F64, ndim, shape, v, CAT, &t64), "from_host f64");
    if (dt == F64) return t64;
    must(fsdp_tensor_empty(ctx, dt, ndim, shape, CAT, &t), "empty");
    must(fsdp_tensor_copy_(t, t64), "copy_");
    fsdp_tensor_release(t64);
    return t;
}

/* t's elements (row-major) as doubles; the caller frees. */
static double *host(const fsdp_tensor_t *t) {
    int64_t n = fsdp_tensor_numel(t);
    double *v = malloc((size_t)(n > 0 ? n : 1) * sizeof *v);
    if (!v) tap_bail("out of memory");
    for (int64_t i = 0; i < n; i++)
        must(fsdp_tensor_item(t, i, &v[i]), "item");
    return v;
}

/* Largest |a - b| over two tensors of equal size (INFINITY when the sizes differ). */
static double max_diff(const fsdp_tensor_t *a, const fsdp_tensor_t *b) {
    if (fsdp_tensor_numel(a) != fsdp_tensor_numel(b)) return INFINITY;
    double *x = host(a), *y = host(b), m = 0;
    for (int64_t i = 0; i < fsdp_tensor_numel(a); i++) {
        double d = fabs(x[i] - y[i]);
        if (isnan(d)) d = INFINITY;
        if (d > m) m = d;
    }
    free(x);
    free(y);
    return m;
}

static bool all_finite(const fsdp_tensor_t *t) {
    double *x = host(t);
    bool ok = true;
    for (int64_t i = 0; i < fsdp_tensor_numel(t); i++)
        ok = ok && isfinite(x[i]);
    free(x);
    return ok;
}

static bool same_shape(const fsdp_tensor_t *t, int ndim, const int64_t *shape) {
    if (fsdp_tensor_ndim(t) != ndim) return false;
    for (int i = 0; i < ndim; i++)
        if (fsdp_tensor_size(t, i) != shape[i]) return false;
    return true;
}

/* One check that m's parameter names equal want[0..n) in order (and one for the count). */
static void check_names(const fsdp_module_t *m, const char *const *want, size_t n,
                        const char *what) {
    fsdp_named_list_t l = {0};
    must(fsdp_module_named_params(m, false, &l), "named_params");
    tap_is_size(l.n, n, "%s: %zu parameter tensors", what, n);
    size_t bad = SIZE_MAX;
    for (size_t i = 0; i < n && i < l.n && bad == SIZE_MAX; i++)
        if (strcmp(l.names[i], want[i]) != 0) bad = i;
    if (bad == SIZE_MAX && l.n != n) bad = l.n < n ? l.n : n;
    if (bad != SIZE_MAX)
        tap_diag("first difference at %zu: got \"%s\", want \"%s\"", bad,
                 bad < l.n ? l.names[bad] : "(none)", bad < n ? want[bad] : "(none)");
    tap_ok(bad == SIZE_MAX, "%s: parameter names and order equal PyTorch's", what);
    fsdp_named_list_free(&l);
}

/* Replaces every parameter of m by an f64 copy (requiring grad), for finite differences. */
static void to_f64(fsdp_module_t *m) {
    fsdp_named_list_t l = {0};
    must(fsdp_module_named_params(m, false, &l), "named_params");
    for (size_t i = 0; i < l.n; i++) {
        fsdp_tensor_t *t = l.tensors[i], *t64 = NULL;
        must(fsdp_tensor_empty(ctx, F64, fsdp_tensor_ndim(t), fsdp_tensor_shape(t), FSDP_MEM_PARAMS,
                               &t64),
             "empty f64");
        must(fsdp_tensor_copy_(t64, t), "copy_ f64");
        must(fsdp_module_set_param(m, l.names[i], t64, false), "set_param f64");
        must(fsdp_tensor_set_requires_grad(t64, true), "requires_grad");
        fsdp_tensor_release(t64);
    }
    fsdp_named_list_free(&l);
}

/* Copies every parameter of src into dst (same structure). */
static void copy_params(fsdp_module_t *dst, const fsdp_module_t *src) {
    fsdp_named_list_t a = {0}, b = {0};
    must(fsdp_module_named_params(dst, false, &a), "named_params");
    must(fsdp_module_named_params(src, false, &b), "named_params");
    if (a.n != b.n) tap_bail("copy_params: %zu vs %zu parameters", a.n, b.n);
    for (size_t i = 0; i < a.n; i++)
        must(fsdp_tensor_copy_(a.tensors[i], b.tensors[i]), "copy_ param");
    fsdp_named_list_free(&a);
    fsdp_named_list_free(&b);
}

/* ---- MultiheadAttention: structure ----------------------------------------------------------- */

static void test_mha_structure(void) {
    fsdp_module_t *m = NULL;
    const int64_t e = 8;
    must(fsdp_mha_create(ctx, e, 2, 0.0, true, false, &m), "mha_create");
    static const char *const names[] = {"in_proj_weight", "in_proj_bias", "out_proj.weight",
                                        "out_proj.bias"};
    check_names(m, names, 4, "MultiheadAttention(8, 2)");
    tap_is_int(fsdp_module_num_params(m), 4 * e * e + 4 * e, "MHA has 4E^2 + 4E parameters");
    tap_is_str(fsdp_module_type(m), "MultiheadAttention", "MHA type name");
    tap_is_str(fsdp_module_type(fsdp_module_child(m, "out_proj")), "Linear", "out_proj is Linear");
    fsdp_tensor_t *w = fsdp_module_param(m, "in_proj_weight");
    tap_ok(same_shape(w, 2, (const int64_t[]){3 * e, e}), "in_proj_weight is (3E, E)");
    /* _reset_parameters: xavier-uniform in_proj_weight, zero biases; out_proj.weight keeps the
     * Linear initialisation U(-1/sqrt(E), 1/sqrt(E)). */
    double *v = host(w), xb = sqrt(6.0 / (double)(4 * e)), mx = 0;
    for (int64_t i = 0; i < 3 * e * e; i++)
        mx = fmax(mx, fabs(v[i]));
    free(v);
    tap_ok(mx > 0.5 * xb && mx <= xb, "in_proj_weight is xavier-uniform (max |w| %g, bound %g)", mx,
           xb);
    v = host(fsdp_module_param(m, "out_proj.weight"));
    mx = 0;
    for (int64_t i = 0; i < e * e; i++)
        mx = fmax(mx, fabs(v[i]));
    free(v);
    tap_ok(mx > 0 && mx <= 1 / sqrt((double)e), "out_proj.weight is U(-1/sqrt(E), 1/sqrt(E))");
    double *b1 = host(fsdp_module_param(m, "in_proj_bias"));
    double *b2 = host(fsdp_module_param(m, "out_proj.bias"));
    bool zero = true;
    for (int64_t i = 0; i < 3 * e; i++)
        zero = zero && b1[i] == 0 && (i >= e || b2[i] == 0);
    free(b1);
    free(b2);
    tap_ok(zero, "in_proj_bias and out_proj.bias are zeros");
    fsdp_module_release(m);

    must(fsdp_mha_create(ctx, e, 4, 0.0, false, true, &m), "mha_create no bias");
    static const char *const nb[] = {"in_proj_weight", "out_proj.weight"};
    check_names(m, nb, 2, "MultiheadAttention(bias=False)");
    fsdp_module_release(m);

    m = NULL;
    tap_is_int(fsdp_mha_create(ctx, 10, 3, 0.0, true, false, &m), FSDP_EINVAL,
               "num_heads must divide embed_dim");
    tap_has_str(fsdp_ctx_last_error(ctx), "divisible", "the error says why");
    tap_is_int(fsdp_mha_create(ctx, 8, 2, 1.0, true, false, &m), FSDP_EINVAL,
               "dropout 1 is refused");
    tap_ok(m == NULL, "no module after a failed create");
}

/* ---- MultiheadAttention: forward against a reference ----------------------------------------- */

/* Sizes and masks of one reference run; inputs are (L, N, E), (S, N, E). */
struct ref_case {
    int64_t l, s, n, e, h;
    const double *fmask; /* additive (L, S), or (N*H, L, S) when per_head; or NULL */
    bool per_head;
    const unsigned char *bmask; /* (L, S), set = forbidden; or NULL */
    const unsigned char *kpm;   /* (N, S), set = padding; or NULL */
};

/* The attention output (L, N, E) computed naively in double. */
static void ref_mha(const struct ref_case *c, const double *q, const double *k, const double *v,
                    const double *w, const double *b, const double *wo, const double *bo,
                    double *out) {
    int64_t l = c->l, s = c->s, n = c->n, e = c->e, h = c->h, hd = e / h;
    double *qp = calloc((size_t)(l * n * e), sizeof *qp);
    double *kp = calloc((size_t)(s * n * e), sizeof *kp);
    double *vp = calloc((size_t)(s * n * e), sizeof *vp);
    double *o = calloc((size_t)(l * n * e), sizeof *o);
    double *sc = calloc((size_t)s, sizeof *sc);
    if (!qp || !kp || !vp || !o || !sc) tap_bail("out of memory");
    for (int64_t r = 0; r < l * n; r++)
        for (int64_t i = 0; i < e; i++) {
            double acc = b[i];
            for (int64_t j = 0; j < e; j++)
                acc += q[r * e + j] * w[i * e + j];
            qp[r * e + i] = acc;
        }
    for (int64_t r = 0; r < s * n; r++)
        for (int64_t i = 0; i < e; i++) {
            double ak = b[e + i], av = b[2 * e + i];
            for (int64_t j = 0; j < e; j++) {
                ak += k[r * e + j] * w[(e + i) * e + j];
                av += v[r * e + j] * w[(2 * e + i) * e + j];
            }
            kp[r * e + i] = ak;
            vp[r * e + i] = av;
        }
    for (int64_t bn = 0; bn < n; bn++)
        for (int64_t hh = 0; hh < h; hh++)
            for (int64_t i = 0; i < l; i++) {
                double mx = -INFINITY, sum = 0;
                for (int64_t j = 0; j < s; j++) {
                    double acc = 0;
                    for (int64_t d = 0; d < hd; d++)
                        acc +=
                            qp[(i * n + bn) * e + hh * hd + d] * kp[(j * n + bn) * e + hh * hd + d];
                    acc /= sqrt((double)hd);
                    if (c->fmask)
                        acc += c->per_head ? c->fmask[((bn * h + hh) * l + i) * s + j]
                                           : c->fmask[i * s + j];
                    if (c->bmask && c->bmask[i * s + j]) acc = -INFINITY;
                    if (c->kpm && c->kpm[bn * s + j]) acc = -INFINITY;
                    sc[j] = acc;
                    mx = fmax(mx, acc);
                }
                for (int64_t j = 0; j < s; j++) {
                    sc[j] = exp(sc[j] - mx);
                    sum += sc[j];
                }
                for (int64_t d = 0; d < hd; d++) {
                    double acc = 0;
                    for (int64_t j = 0; j < s; j++)
                        acc += sc[j] / sum * vp[(j * n + bn) * e + hh * hd + d];
                    o[(i * n + bn) * e + hh * hd + d] = acc;
                }
            }
    for (int64_t r = 0; r < l * n; r++)
        for (int64_t i = 0; i < e; i++) {
            double acc = bo[i];
            for (int64_t j = 0; j < e; j++)
                acc += o[r * e + j] * wo[i * e + j];
            out[r * e + i] = acc;
        }
    free(qp);
    free(kp);
    free(vp);
    free(o);
    free(sc);
}

/* Runs m on (q, k, v, masks) and compares with ref_mha. */
static void check_ref(fsdp_module_t *m, const struct ref_case *c, fsdp_tensor_t *q,
                      fsdp_tensor_t *k, fsdp_tensor_t *v, fsdp_tensor_t *kpm, fsdp_tensor_t *mask,
                      const char *what) {
    fsdp_tensor_t *y = NULL;
    int rc = fsdp_mha_forward(m, q, k, v, kpm, mask, &y);
    tap_is_int(rc, 0, "MHA forward, %s", what);
    if (rc < 0) {
        tap_diag("%s", fsdp_ctx_last_error(ctx));
        tap_skip(2, "forward failed");
        return;
    }
    tap_ok(same_shape(y, 3, (const int64_t[]){c->l, c->n, c->e}), "MHA output is (L, N, E), %s",
           what);
    double *hq = host(q), *hk = host(k), *hv = host(v);
    double *w = host(fsdp_module_param(m, "in_proj_weight"));
    double *b = host(fsdp_module_param(m, "in_proj_bias"));
    double *wo = host(fsdp_module_param(m, "out_proj.weight"));
    double *bo = host(fsdp_module_param(m, "out_proj.bias"));
    double *want = calloc((size_t)(c->l * c->n * c->e), sizeof *want), *got = host(y);
    if (!want) tap_bail("out of memory");
    ref_mha(c, hq, hk, hv, w, b, wo, bo, want);
    double md = 0;
    for (int64_t i = 0; i < c->l * c->n * c->e; i++)
        md = fmax(md, isnan(got[i] - want[i]) ? INFINITY : fabs(got[i] - want[i]));
    tap_ok(md < 2e-5, "MHA equals the reference, %s (max diff %g)", what, md);
    free(hq);
    free(hk);
    free(hv);
    free(w);
    free(b);
    free(wo);
    free(bo);
    free(want);
    free(got);
    fsdp_tensor_release(y);
}

static void test_mha_forward(void) {
    const int64_t l = 3, s = 4, n = 2, e = 8, h = 2;
    fsdp_module_t *m = NULL;
    must(fsdp_mha_create(ctx, e, h, 0.0, true, false, &m), "mha_create");
    /* Non-zero biases so that every bias path is exercised. */
    fsdp_tensor_t *rb = randt(F32, 1, (const int64_t[]){3 * e}, -0.5, 0.5, 11);
    must(fsdp_tensor_copy_(fsdp_module_param(m, "in_proj_bias"), rb), "copy bias");
    fsdp_tensor_release(rb);
    rb = randt(F32, 1, (const int64_t[]){e}, -0.5, 0.5, 12);
    must(fsdp_tensor_copy_(fsdp_module_param(m, "out_proj.bias"), rb), "copy bias");
    fsdp_tensor_release(rb);

    fsdp_tensor_t *x = randt(F32, 3, (const int64_t[]){l, n, e}, -1, 1, 1);
    fsdp_tensor_t *q = randt(F32, 3, (const int64_t[]){l, n, e}, -1, 1, 2);
    fsdp_tensor_t *k = randt(F32, 3, (const int64_t[]){s, n, e}, -1, 1, 3);
    fsdp_tensor_t *v = randt(F32, 3, (const int64_t[]){s, n, e}, -1, 1, 4);

    struct ref_case c = {l, l, n, e, h, NULL, false, NULL, NULL};
    check_ref(m, &c, x, x, x, NULL, NULL, "self-attention (packed projection)");

    double fm[3 * 4];
    for (int i = 0; i < 12; i++)
        fm[i] = 0.25 * (i % 5) - (i == 7 ? 1e9 : 0);
    fsdp_tensor_t *fmask = mk_f(F32, 2, (const int64_t[]){l, s}, fm);
    c = (struct ref_case){l, s, n, e, h, fm, false, NULL, NULL};
    check_ref(m, &c, q, k, k, NULL, fmask, "key is value, float attn_mask");

    const unsigned char bm[12] = {0, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0};
    const unsigned char kp[8] = {0, 0, 0, 1, 1, 0, 0, 0};
    fsdp_tensor_t *bmask = mk_bool(2, (const int64_t[]){l, s}, bm);
    fsdp_tensor_t *kpm = mk_bool(2, (const int64_t[]){n, s}, kp);
    c = (struct ref_case){l, s, n, e, h, NULL, false, bm, kp};
    check_ref(m, &c, q, k, v, kpm, bmask, "separate q, k, v, bool attn_mask and key_padding_mask");
    c = (struct ref_case){l, s, n, e, h, NULL, false, bm, NULL};
    check_ref(m, &c, q, k, v, NULL, bmask, "bool attn_mask alone");
    c = (struct ref_case){l, s, n, e, h, fm, false, NULL, kp};
    check_ref(m, &c, q, k, v, kpm, fmask, "float attn_mask and bool key_padding_mask");

    double ph[2 * 2 * 3 * 4];
    for (int i = 0; i < 48; i++)
        ph[i] = 0.1 * ((i * 7) % 11) - 0.5;
    fsdp_tensor_t *phm = mk_f(F32, 3, (const int64_t[]){n * h, l, s}, ph);
    c = (struct ref_case){l, s, n, e, h, ph, true, NULL, NULL};
    check_ref(m, &c, q, k, v, NULL, phm, "per-head (N*H, L, S) float mask");

    /* A padded key does not matter: changing its value changes nothing. */
    fsdp_tensor_t *y0 = NULL, *y1 = NULL, *y2 = NULL;
    double *hv = host(v);
    hv[(3 * n + 0) * e + 1] += 5.0; /* key 3 of batch 0: padded */
    fsdp_tensor_t *v1 = mk_f(F32, 3, (const int64_t[]){s, n, e}, hv);
    hv[(1 * n + 1) * e + 1] += 5.0; /* key 1 of batch 1: not padded */
    fsdp_tensor_t *v2 = mk_f(F32, 3, (const int64_t[]){s, n, e}, hv);
    free(hv);
    must(fsdp_mha_forward(m, q, k, v, kpm, NULL, &y0), "mha kpm");
    must(fsdp_mha_forward(m, q, k, v1, kpm, NULL, &y1), "mha kpm");
    must(fsdp_mha_forward(m, q, k, v2, kpm, NULL, &y2), "mha kpm");
    tap_ok(max_diff(y0, y1) == 0, "key_padding_mask: a padded key's value has no effect");
    tap_ok(max_diff(y0, y2) > 1e-3, "key_padding_mask: an unpadded key's value has an effect");
    fsdp_tensor_release(y0);
    fsdp_tensor_release(y1);
    fsdp_tensor_release(y2);
    fsdp_tensor_release(v1);
    fsdp_tensor_release(v2);

    /* batch_first: the same weights on transposed inputs give the transposed output. */
    fsdp_module_t *mb = NULL;
    must(fsdp_mha_create(ctx, e, h, 0.0, true, true, &mb), "mha_create batch_first");
    copy_params(mb, m);
    fsdp_tensor_t *qt = NULL, *kt = NULL, *vt = NULL, *yt = NULL, *ytt = NULL, *yr = NULL;
    must(fsdp_transpose(q, 0, 1, &qt), "transpose");
    must(fsdp_transpose(k, 0, 1, &kt), "transpose");
    must(fsdp_transpose(v, 0, 1, &vt), "transpose");
    must(fsdp_mha_forward(m, q, k, v, kpm, bmask, &yr), "mha");
    must(fsdp_mha_forward(mb, qt, kt, vt, kpm, bmask, &yt), "mha batch_first");
    must(fsdp_transpose(yt, 0, 1, &ytt), "transpose");
    tap_ok(same_shape(yt, 3, (const int64_t[]){n, l, e}), "batch_first output is (N, L, E)");
    tap_ok(max_diff(ytt, yr) < 1e-6, "batch_first gives the transposed output (diff %g)",
           max_diff(ytt, yr));
    fsdp_tensor_release(qt);
    fsdp_tensor_release(kt);
    fsdp_tensor_release(vt);
    fsdp_tensor_release(yt);
    fsdp_tensor_release(ytt);
    fsdp_tensor_release(yr);
    fsdp_module_release(mb);

    /* Unbatched (L, E) input equals the batched run with N = 1. */
    fsdp_tensor_t *x2 = randt(F32, 2, (const int64_t[]){l, e}, -1, 1, 5), *x3 = NULL;
    fsdp_tensor_t *u = NULL, *ub = NULL;
    must(fsdp_unsqueeze(x2, 1, &x3), "unsqueeze");
    must(fsdp_mha_forward(m, x2, x2, x2, NULL, NULL, &u), "mha unbatched");
    must(fsdp_mha_forward(m, x3, x3, x3, NULL, NULL, &ub), "mha batched");
    tap_ok(same_shape(u, 2, (const int64_t[]){l, e}) && max_diff(u, ub) < 1e-7,
           "unbatched input gives the batched result without the batch dimension");
    fsdp_tensor_release(x2);
    fsdp_tensor_release(x3);
    fsdp_tensor_release(u);
    fsdp_tensor_release(ub);

    /* The generic module forward takes the same inputs. */
    fsdp_tensor_t *y = NULL, *ya = NULL;
    fsdp_tensor_t *in[5] = {q, k, v, kpm, bmask};
    must(fsdp_module_forward(m, 5, in, 1, &y), "module_forward");
    must(fsdp_mha_forward(m, q, k, v, kpm, bmask, &ya), "mha");
    tap_ok(max_diff(y, ya) == 0, "fsdp_module_forward(q, k, v, kpm, mask) equals fsdp_mha_forward");
    fsdp_tensor_release(y);
    fsdp_tensor_release(ya);

    /* Errors name the module and the shapes. */
    fsdp_tensor_t *bad = randt(F32, 3, (const int64_t[]){l, n, e + 1}, -1, 1, 6);
    y = NULL;
    tap_is_int(fsdp_mha_forward(m, bad, bad, bad, NULL, NULL, &y), FSDP_EINVAL,
               "a wrong embedding size is refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "MultiheadAttention", "the error names the module");
    tap_is_int(fsdp_mha_forward(m, q, k, v, NULL, fmask, &y), 0, "a good mask is accepted");
    fsdp_tensor_release(y);
    y = NULL;
    tap_is_int(fsdp_mha_forward(m, q, q, q, NULL, fmask, &y), FSDP_EINVAL,
               "an attn_mask of the wrong shape is refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "attn_mask", "the error names attn_mask");
    tap_ok(y == NULL, "no output after an error");
    fsdp_tensor_release(bad);

    fsdp_tensor_release(x);
    fsdp_tensor_release(q);
    fsdp_tensor_release(k);
    fsdp_tensor_release(v);
    fsdp_tensor_release(fmask);
    fsdp_tensor_release(bmask);
    fsdp_tensor_release(kpm);
    fsdp_tensor_release(phm);
    fsdp_module_release(m);
}

/* ---- MultiheadAttention: gradients and dropout ----------------------------------------------- */

struct mha_arg {
    fsdp_module_t *m;
    fsdp_tensor_t *kpm, *mask;
    bool self; /* in[0] is query, key and value */
};

static int mha_fn(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    const struct mha_arg *a = arg;
    (void)nin;
    if (a->self) return fsdp_mha_forward(a->m, in[0], in[0], in[0], a->kpm, a->mask, out);
    return fsdp_mha_forward(a->m, in[0], in[1], in[2], a->kpm, a->mask, out);
}

static void test_mha_grad(void) {
    const int64_t l = 3, s = 2, n = 2, e = 4, h = 2;
    fsdp_module_t *m = NULL;
    must(fsdp_mha_create(ctx, e, h, 0.0, true, false, &m), "mha_create");
    to_f64(m);
    fsdp_tensor_t *rb = randt(F64, 1, (const int64_t[]){3 * e}, -0.5, 0.5, 21);
    must(fsdp_tensor_copy_(fsdp_module_param(m, "in_proj_bias"), rb), "copy bias");
    fsdp_tensor_release(rb);
    tap_is_int(fsdp_tensor_dtype(fsdp_module_param(m, "out_proj.weight")), F64,
               "parameters swapped for f64 copies");
    fsdp_tensor_t *q = randt(F64, 3, (const int64_t[]){l, n, e}, -1, 1, 22);
    fsdp_tensor_t *k = randt(F64, 3, (const int64_t[]){s, n, e}, -1, 1, 23);
    fsdp_tensor_t *v = randt(F64, 3, (const int64_t[]){s, n, e}, -1, 1, 24);
    const double fm[6] = {0, -0.5, 0.3, 0, -1, 0.2};
    const unsigned char kp[4] = {0, 0, 0, 1};
    fsdp_tensor_t *mask = mk_f(F64, 2, (const int64_t[]){l, s}, fm);
    fsdp_tensor_t *kpm = mk_bool(2, (const int64_t[]){n, s}, kp);
    struct mha_arg a = {m, kpm, mask, false};
    fsdp_tensor_t *in[7] = {q,
                            k,
                            v,
                            fsdp_module_param(m, "in_proj_weight"),
                            fsdp_module_param(m, "in_proj_bias"),
                            fsdp_module_param(m, "out_proj.weight"),
                            fsdp_module_param(m, "out_proj.bias")};
    gc("MHA (q, k, v, in_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias)", mha_fn, &a, 7,
       in, 1e-5, 1e-7);
    /* Self-attention goes through the packed projection and its split. */
    fsdp_tensor_t *x = randt(F64, 3, (const int64_t[]){l, n, e}, -1, 1, 25);
    struct mha_arg sa = {m, NULL, NULL, true};
    fsdp_tensor_t *in2[3] = {x, fsdp_module_param(m, "in_proj_weight"),
                             fsdp_module_param(m, "in_proj_bias")};
    gc("MHA self-attention (x, in_proj_weight, in_proj_bias)", mha_fn, &sa, 3, in2, 1e-5, 1e-7);
    /* Key is value: the two-row-block projection. */
    struct mha_arg kv = {m, kpm, NULL, false};
    fsdp_tensor_t *in3[4] = {q, k, k, fsdp_module_param(m, "in_proj_weight")};
    gc("MHA key is value (q, kv, kv, in_proj_weight)", mha_fn, &kv, 4, in3, 1e-5, 1e-7);
    fsdp_tensor_release(q);
    fsdp_tensor_release(k);
    fsdp_tensor_release(v);
    fsdp_tensor_release(x);
    fsdp_tensor_release(mask);
    fsdp_tensor_release(kpm);
    fsdp_module_release(m);
}

static void test_mha_dropout(void) {
    fsdp_module_t *m = NULL, *m0 = NULL;
    must(fsdp_mha_create(ctx, 8, 2, 0.5, true, false, &m), "mha_create");
    must(fsdp_mha_create(ctx, 8, 2, 0.0, true, false, &m0), "mha_create");
    copy_params(m0, m);
    fsdp_tensor_t *x = randt(F32, 3, (const int64_t[]){5, 2, 8}, -1, 1, 31);
    fsdp_tensor_t *a = NULL, *b = NULL, *c = NULL, *d = NULL, *r = NULL;
    tap_ok(fsdp_module_is_training(m), "modules start in training mode");
    must(fsdp_mha_forward(m, x, x, x, NULL, NULL, &a), "mha train");
    must(fsdp_mha_forward(m, x, x, x, NULL, NULL, &b), "mha train");
    tap_ok(max_diff(a, b) > 1e-4, "training: attention dropout draws new masks");
    fsdp_module_train(m, false);
    must(fsdp_mha_forward(m, x, x, x, NULL, NULL, &c), "mha eval");
    must(fsdp_mha_forward(m, x, x, x, NULL, NULL, &d), "mha eval");
    must(fsdp_mha_forward(m0, x, x, x, NULL, NULL, &r), "mha p=0");
    tap_ok(max_diff(c, d) == 0, "eval: the output is deterministic");
    tap_ok(max_diff(c, r) == 0, "eval: dropout is off (equals p = 0)");
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    fsdp_tensor_release(c);
    fsdp_tensor_release(d);
    fsdp_tensor_release(r);
    fsdp_tensor_release(x);
    fsdp_module_release(m);
    fsdp_module_release(m0);
}

/* ---- transformer structure ------------------------------------------------------------------- */

static const char *const enc_layer_names[] = {"self_attn.in_proj_weight",
                                              "self_attn.in_proj_bias",
                                              "self_attn.out_proj.weight",
                                              "self_attn.out_proj.bias",
                                              "linear1.weight",
                                              "linear1.bias",
                                              "linear2.weight",
                                              "linear2.bias",
                                              "norm1.weight",
                                              "norm1.bias",
                                              "norm2.weight",
                                              "norm2.bias"};

static const char *const dec_layer_names[] = {"self_attn.in_proj_weight",
                                              "self_attn.in_proj_bias",
                                              "self_attn.out_proj.weight",
                                              "self_attn.out_proj.bias",
                                              "multihead_attn.in_proj_weight",
                                              "multihead_attn.in_proj_bias",
                                              "multihead_attn.out_proj.weight",
                                              "multihead_attn.out_proj.bias",
                                              "linear1.weight",
                                              "linear1.bias",
                                              "linear2.weight",
                                              "linear2.bias",
                                              "norm1.weight",
                                              "norm1.bias",
                                              "norm2.weight",
                                              "norm2.bias",
                                              "norm3.weight",
                                              "norm3.bias"};

static void small_config(fsdp_transformer_config_t *cfg) {
    fsdp_transformer_config_init(cfg);
    cfg->d_model = 16;
    cfg->nhead = 2;
    cfg->num_encoder_layers = 2;
    cfg->num_decoder_layers = 2;
    cfg->dim_feedforward = 8;
}

static void test_transformer_structure(void) {
    fsdp_transformer_config_t cfg;
    fsdp_transformer_config_init(&cfg);
    tap_ok(cfg.d_model == 512 && cfg.nhead == 8 && cfg.num_encoder_layers == 6 &&
               cfg.num_decoder_layers == 6 && cfg.dim_feedforward == 2048 && cfg.dropout == 0.1 &&
               cfg.activation == FSDP_ACTIVATION_RELU && cfg.layer_norm_eps == 1e-5 &&
               !cfg.batch_first && !cfg.norm_first,
           "config defaults are nn.Transformer's");
    small_config(&cfg);
    fsdp_module_t *m = NULL;
    must(fsdp_transformer_create(ctx, &cfg, &m), "transformer_create");
    /* nn.Transformer(d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=2,
     * dim_feedforward=8): per MHA 3*16*16 + 3*16 + 16*16 + 16 = 1088; Linear(16, 8) 136;
     * Linear(8, 16) 144; LayerNorm(16) 32. Encoder layer 1088 + 136 + 144 + 2*32 = 1432,
     * decoder layer 2*1088 + 136 + 144 + 3*32 = 2552; 2*1432 + 32 + 2*2552 + 32 = 8032. */
    tap_is_int(fsdp_module_num_params(m), 8032,
               "nn.Transformer(16, 2, 2, 2, 8) has 8032 parameters");
    const char *want[64];
    char buf[64][64];
    size_t n = 0;
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 12; j++, n++) {
            snprintf(buf[n], sizeof buf[n], "encoder.layers.%d.%s", i, enc_layer_names[j]);
            want[n] = buf[n];
        }
    want[n++] = "encoder.norm.weight";
    want[n++] = "encoder.norm.bias";
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 18; j++, n++) {
            snprintf(buf[n], sizeof buf[n], "decoder.layers.%d.%s", i, dec_layer_names[j]);
            want[n] = buf[n];
        }
    want[n++] = "decoder.norm.weight";
    want[n++] = "decoder.norm.bias";
    check_names(m, want, n, "nn.Transformer(16, 2, 2, 2, 8)");
    fsdp_named_list_t sd = {0};
    must(fsdp_module_state_dict(m, &sd), "state_dict");
    tap_is_size(sd.n, 64, "the state dict has the 64 keys of PyTorch's");
    fsdp_named_list_free(&sd);
    tap_ok(fsdp_module_param(m, "decoder.layers.1.multihead_attn.out_proj.bias") != NULL &&
               fsdp_module_param(m, "encoder.layers.0.self_attn.in_proj_weight") != NULL &&
               fsdp_module_param(m, "encoder.norm.weight") != NULL,
           "PyTorch's keys resolve");
    tap_is_str(fsdp_module_type(fsdp_module_child(m, "encoder")), "TransformerEncoder",
               "encoder type");
    tap_is_str(fsdp_module_type(fsdp_module_child(m, "decoder.layers.1")),
               "TransformerDecoderLayer", "decoder layer type");
    tap_is_str(fsdp_module_type(fsdp_module_child(m, "encoder.layers.0.dropout1")), "Dropout",
               "dropout1 is a Dropout child");

    /* Clones start equal (1-d parameters keep the prototype's values); _reset_parameters
     * redraws every matrix, so those differ between layers. */
    tap_ok(max_diff(fsdp_module_param(m, "encoder.layers.0.linear1.bias"),
                    fsdp_module_param(m, "encoder.layers.1.linear1.bias")) == 0,
           "cloned layers share the prototype's linear1.bias");
    tap_ok(max_diff(fsdp_module_param(m, "encoder.layers.0.linear1.weight"),
                    fsdp_module_param(m, "encoder.layers.1.linear1.weight")) > 0,
           "xavier redraws each layer's linear1.weight");
    fsdp_tensor_t *w = fsdp_module_param(m, "decoder.layers.0.linear2.weight");
    double *v = host(w), mx = 0, bound = sqrt(6.0 / (8 + 16));
    for (int i = 0; i < 8 * 16; i++)
        mx = fmax(mx, fabs(v[i]));
    free(v);
    tap_ok(mx > 0.5 * bound && mx <= bound, "linear2.weight is xavier-uniform after reset");
    v = host(fsdp_module_param(m, "decoder.layers.1.self_attn.in_proj_bias"));
    bool zero = true;
    for (int i = 0; i < 48; i++)
        zero = zero && v[i] == 0;
    free(v);
    tap_ok(zero, "in_proj_bias stays zero");
    fsdp_module_release(m);

    /* A standalone encoder without a final norm. */
    must(fsdp_transformer_encoder_create(ctx, &cfg, 3, false, &m), "encoder_create");
    tap_is_int(fsdp_module_num_params(m), 3 * 1432, "TransformerEncoder(layer, 3) without norm");
    tap_ok(fsdp_module_child(m, "norm") == NULL && fsdp_module_child(m, "layers.2") != NULL,
           "three layers, no norm");
    fsdp_module_release(m);

    cfg.d_model = 15;
    tap_is_int(fsdp_transformer_create(ctx, &cfg, &m), FSDP_EINVAL, "nhead must divide d_model");
}

/* ---- layers against their children composed by hand ------------------------------------------ */

static fsdp_tensor_t *run1(fsdp_module_t *m, const char *child, fsdp_tensor_t *x) {
    fsdp_tensor_t *y = NULL;
    must(fsdp_module_forward1(fsdp_module_child(m, child), x, &y), child);
    return y;
}

static fsdp_tensor_t *add(fsdp_tensor_t *a, fsdp_tensor_t *b) {
    fsdp_tensor_t *y = NULL;
    must(fsdp_add(a, b, &y), "add");
    return y;
}

/* linear2(act(linear1(x))) (dropout is off in eval mode). */
static fsdp_tensor_t *ff_by_hand(fsdp_module_t *ly, fsdp_tensor_t *x, bool gelu) {
    fsdp_tensor_t *a = run1(ly, "linear1", x), *b = NULL;
    if (gelu)
        must(fsdp_gelu(a, FSDP_GELU_ERF, &b), "gelu");
    else
        must(fsdp_relu(a, &b), "relu");
    fsdp_tensor_t *c = run1(ly, "linear2", b);
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    return c;
}

static fsdp_tensor_t *attn_by_hand(fsdp_module_t *ly, const char *which, fsdp_tensor_t *x,
                                   fsdp_tensor_t *mem, fsdp_tensor_t *mask) {
    fsdp_tensor_t *y = NULL;
    must(fsdp_mha_forward(fsdp_module_child(ly, which), x, mem ? mem : x, mem ? mem : x, NULL, mask,
                          &y),
         "mha");
    return y;
}

/* x + f(norm(x)) or norm(x + f(x)), with f given by its output on the right input. */
static void test_layers_by_hand(void) {
    fsdp_transformer_config_t cfg;
    small_config(&cfg);
    fsdp_tensor_t *x = randt(F32, 3, (const int64_t[]){4, 2, 16}, -1, 1, 41);
    fsdp_tensor_t *mem = randt(F32, 3, (const int64_t[]){5, 2, 16}, -1, 1, 42);
    fsdp_tensor_t *cm = NULL;
    must(fsdp_causal_mask(ctx, 4, &cm), "causal_mask");
    for (int variant = 0; variant < 3; variant++) {
        bool nf = variant == 1, gelu = variant == 2;
        const char *what = nf ? "norm_first" : gelu ? "gelu" : "post-norm";
        cfg.norm_first = nf;
        cfg.activation = gelu ? FSDP_ACTIVATION_GELU : FSDP_ACTIVATION_RELU;
        fsdp_module_t *ly = NULL;
        must(fsdp_transformer_encoder_layer_create(ctx, &cfg, &ly), "encoder_layer_create");
        fsdp_module_train(ly, false);
        fsdp_tensor_t *got = NULL, *want = NULL;
        must(fsdp_transformer_encoder_layer_forward(ly, x, cm, NULL, &got), "encoder layer");
        if (nf) {
            fsdp_tensor_t *h = run1(ly, "norm1", x),
                          *a = attn_by_hand(ly, "self_attn", h, NULL, cm);
            fsdp_tensor_t *x1 = add(x, a), *h2 = run1(ly, "norm2", x1);
            fsdp_tensor_t *f = ff_by_hand(ly, h2, gelu);
            want = add(x1, f);
            fsdp_tensor_release(h);
            fsdp_tensor_release(a);
            fsdp_tensor_release(x1);
            fsdp_tensor_release(h2);
            fsdp_tensor_release(f);
        } else {
            fsdp_tensor_t *a = attn_by_hand(ly, "self_attn", x, NULL, cm), *s = add(x, a);
            fsdp_tensor_t *x1 = run1(ly, "norm1", s), *f = ff_by_hand(ly, x1, gelu);
            fsdp_tensor_t *s2 = add(x1, f);
            want = run1(ly, "norm2", s2);
            fsdp_tensor_release(a);
            fsdp_tensor_release(s);
            fsdp_tensor_release(x1);
            fsdp_tensor_release(f);
            fsdp_tensor_release(s2);
        }
        tap_ok(max_diff(got, want) == 0, "TransformerEncoderLayer (%s) = its children composed",
               what);
        fsdp_tensor_release(got);
        fsdp_tensor_release(want);
        fsdp_module_release(ly);

        must(fsdp_transformer_decoder_layer_create(ctx, &cfg, &ly), "decoder_layer_create");
        fsdp_module_train(ly, false);
        must(fsdp_transformer_decoder_layer_forward(ly, x, mem, cm, NULL, NULL, NULL, &got),
             "decoder layer");
        if (nf) {
            fsdp_tensor_t *h = run1(ly, "norm1", x),
                          *a = attn_by_hand(ly, "self_attn", h, NULL, cm);
            fsdp_tensor_t *x1 = add(x, a), *h2 = run1(ly, "norm2", x1);
            fsdp_tensor_t *c = attn_by_hand(ly, "multihead_attn", h2, mem, NULL);
            fsdp_tensor_t *x2 = add(x1, c), *h3 = run1(ly, "norm3", x2);
            fsdp_tensor_t *f = ff_by_hand(ly, h3, gelu);
            want = add(x2, f);
            fsdp_tensor_release(h);
            fsdp_tensor_release(a);
            fsdp_tensor_release(x1);
            fsdp_tensor_release(h2);
            fsdp_tensor_release(c);
            fsdp_tensor_release(x2);
            fsdp_tensor_release(h3);
            fsdp_tensor_release(f);
        } else {
            fsdp_tensor_t *a = attn_by_hand(ly, "self_attn", x, NULL, cm), *s = add(x, a);
            fsdp_tensor_t *x1 = run1(ly, "norm1", s);
            fsdp_tensor_t *c = attn_by_hand(ly, "multihead_attn", x1, mem, NULL), *s2 = add(x1, c);
            fsdp_tensor_t *x2 = run1(ly, "norm2", s2), *f = ff_by_hand(ly, x2, gelu);
            fsdp_tensor_t *s3 = add(x2, f);
            want = run1(ly, "norm3", s3);
            fsdp_tensor_release(a);
            fsdp_tensor_release(s);
            fsdp_tensor_release(x1);
            fsdp_tensor_release(c);
            fsdp_tensor_release(s2);
            fsdp_tensor_release(x2);
            fsdp_tensor_release(f);
            fsdp_tensor_release(s3);
        }
        tap_ok(max_diff(got, want) == 0, "TransformerDecoderLayer (%s) = its children composed",
               what);
        fsdp_tensor_release(got);
        fsdp_tensor_release(want);
        fsdp_module_release(ly);
    }
    fsdp_tensor_release(x);
    fsdp_tensor_release(mem);
    fsdp_tensor_release(cm);
}

/* ---- transformer forward --------------------------------------------------------------------- */

static void test_transformer_forward(void) {
    fsdp_transformer_config_t cfg;
    small_config(&cfg);
    const int64_t s = 5, t = 4, n = 3, d = 16;
    fsdp_module_t *m = NULL, *mb = NULL, *mn = NULL;
    must(fsdp_transformer_create(ctx, &cfg, &m), "transformer_create");
    fsdp_tensor_t *src = randt(F32, 3, (const int64_t[]){s, n, d}, -1, 1, 51);
    fsdp_tensor_t *tgt = randt(F32, 3, (const int64_t[]){t, n, d}, -1, 1, 52);
    fsdp_tensor_t *cm = NULL, *y0 = NULL, *y1 = NULL, *y2 = NULL, *y3 = NULL;
    must(fsdp_causal_mask(ctx, t, &cm), "causal_mask");
    const unsigned char kp[15] = {0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1};
    fsdp_tensor_t *skpm = mk_bool(2, (const int64_t[]){n, s}, kp);

    must(fsdp_transformer_forward(m, src, tgt, NULL, cm, NULL, skpm, NULL, skpm, &y0),
         "transformer forward (train)");
    tap_ok(same_shape(y0, 3, (const int64_t[]){t, n, d}) && all_finite(y0),
           "Transformer output is (T, N, E) and finite");
    fsdp_module_train(m, false);
    must(fsdp_transformer_forward(m, src, tgt, NULL, cm, NULL, skpm, NULL, skpm, &y1), "eval");
    must(fsdp_transformer_forward(m, src, tgt, NULL, cm, NULL, skpm, NULL, skpm, &y2), "eval");
    tap_ok(max_diff(y1, y2) == 0, "eval: the Transformer is deterministic");
    tap_ok(max_diff(y0, y1) > 1e-4, "train: dropout changes the output");

    /* With the causal tgt_mask, a change in the last target position leaves the others. */
    double *ht = host(tgt);
    for (int64_t i = 0; i < n * d; i++)
        ht[(t - 1) * n * d + i] += 1.0;
    fsdp_tensor_t *tgt2 = mk_f(F32, 3, (const int64_t[]){t, n, d}, ht);
    free(ht);
    must(fsdp_transformer_forward(m, src, tgt2, NULL, cm, NULL, skpm, NULL, skpm, &y3), "eval");
    fsdp_tensor_t *a = NULL, *b = NULL, *al = NULL, *bl = NULL;
    must(fsdp_narrow(y1, 0, 0, t - 1, &a), "narrow");
    must(fsdp_narrow(y3, 0, 0, t - 1, &b), "narrow");
    must(fsdp_narrow(y1, 0, t - 1, 1, &al), "narrow");
    must(fsdp_narrow(y3, 0, t - 1, 1, &bl), "narrow");
    tap_ok(max_diff(a, b) < 1e-6, "tgt_mask: earlier positions ignore a later target (diff %g)",
           max_diff(a, b));
    tap_ok(max_diff(al, bl) > 1e-3, "tgt_mask: the changed position itself changes");
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    fsdp_tensor_release(al);
    fsdp_tensor_release(bl);
    fsdp_tensor_release(tgt2);
    fsdp_tensor_release(y3);

    /* The module forward takes PyTorch's argument order. */
    fsdp_tensor_t *in[8] = {src, tgt, NULL, cm, NULL, skpm, NULL, skpm};
    must(fsdp_module_forward(m, 8, in, 1, &y3), "module forward");
    tap_ok(max_diff(y3, y1) == 0, "fsdp_module_forward(src, tgt, ...) equals the function form");
    fsdp_tensor_release(y3);
    y3 = NULL;

    /* batch_first with the same weights. */
    cfg.batch_first = true;
    must(fsdp_transformer_create(ctx, &cfg, &mb), "transformer batch_first");
    copy_params(mb, m);
    fsdp_module_train(mb, false);
    fsdp_tensor_t *st = NULL, *tt = NULL, *ybt = NULL;
    must(fsdp_transpose(src, 0, 1, &st), "transpose");
    must(fsdp_transpose(tgt, 0, 1, &tt), "transpose");
    must(fsdp_transformer_forward(mb, st, tt, NULL, cm, NULL, skpm, NULL, skpm, &y3), "bf");
    must(fsdp_transpose(y3, 0, 1, &ybt), "transpose");
    tap_ok(same_shape(y3, 3, (const int64_t[]){n, t, d}) && max_diff(ybt, y1) < 1e-5,
           "batch_first Transformer gives the transposed output");
    fsdp_tensor_release(st);
    fsdp_tensor_release(tt);
    fsdp_tensor_release(ybt);
    fsdp_tensor_release(y3);
    y3 = NULL;

    /* norm_first with the same weights: runs, and is another function. */
    cfg.batch_first = false;
    cfg.norm_first = true;
    must(fsdp_transformer_create(ctx, &cfg, &mn), "transformer norm_first");
    copy_params(mn, m);
    fsdp_module_train(mn, false);
    must(fsdp_transformer_forward(mn, src, tgt, NULL, cm, NULL, NULL, NULL, NULL, &y3), "nf");
    tap_ok(same_shape(y3, 3, (const int64_t[]){t, n, d}) && all_finite(y3) &&
               max_diff(y3, y1) > 1e-3,
           "norm_first Transformer runs and differs from post-norm");
    fsdp_tensor_release(y3);
    y3 = NULL;

    /* Backward reaches every parameter. */
    fsdp_tensor_t *loss = NULL;
    must(fsdp_transformer_forward(mn, src, tgt, NULL, cm, NULL, NULL, NULL, NULL, &y3), "nf");
    must(fsdp_sum(y3, 0, NULL, false, &loss), "sum");
    must(fsdp_backward(loss, NULL), "backward");
    fsdp_named_list_t l = {0};
    must(fsdp_module_named_params(mn, false, &l), "named_params");
    size_t with_grad = 0;
    for (size_t i = 0; i < l.n; i++)
        with_grad += fsdp_tensor_grad(l.tensors[i]) != NULL;
    tap_is_size(with_grad, l.n, "backward gives every Transformer parameter a gradient");
    fsdp_named_list_free(&l);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(y3);
    y3 = NULL;

    /* Mismatched batch sizes are refused. */
    fsdp_tensor_t *tgt_bad = randt(F32, 3, (const int64_t[]){t, n + 1, d}, -1, 1, 53);
    tap_is_int(fsdp_transformer_forward(m, src, tgt_bad, NULL, NULL, NULL, NULL, NULL, NULL, &y3),
               FSDP_EINVAL, "src and tgt with different batch sizes are refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "batch", "the error says batch");
    fsdp_tensor_release(tgt_bad);

    fsdp_tensor_release(src);
    fsdp_tensor_release(tgt);
    fsdp_tensor_release(cm);
    fsdp_tensor_release(skpm);
    fsdp_tensor_release(y0);
    fsdp_tensor_release(y1);
    fsdp_tensor_release(y2);
    fsdp_module_release(m);
    fsdp_module_release(mb);
    fsdp_module_release(mn);
}

/* A decoder layer's gradient in f64, through both attentions and the norms. */
struct dec_arg {
    fsdp_module_t *m;
    fsdp_tensor_t *mask;
};

static int dec_fn(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    const struct dec_arg *a = arg;
    (void)nin;
    return fsdp_transformer_decoder_layer_forward(a->m, in[0], in[1], a->mask, NULL, NULL, NULL,
                                                  out);
}

static void test_decoder_grad(void) {
    fsdp_transformer_config_t cfg;
    fsdp_transformer_config_init(&cfg);
    cfg.d_model = 4;
    cfg.nhead = 2;
    cfg.dim_feedforward = 6;
    cfg.dropout = 0.0;
    cfg.activation = FSDP_ACTIVATION_GELU;
    fsdp_module_t *m = NULL;
    must(fsdp_transformer_decoder_layer_create(ctx, &cfg, &m), "decoder_layer_create");
    to_f64(m);
    fsdp_tensor_t *tgt = randt(F64, 3, (const int64_t[]){3, 1, 4}, -1, 1, 61);
    fsdp_tensor_t *mem = randt(F64, 3, (const int64_t[]){2, 1, 4}, -1, 1, 62);
    fsdp_tensor_t *cm = NULL;
    must(fsdp_causal_mask(ctx, 3, &cm), "causal_mask");
    struct dec_arg a = {m, cm};
    fsdp_tensor_t *in[5] = {tgt, mem, fsdp_module_param(m, "multihead_attn.in_proj_weight"),
                            fsdp_module_param(m, "linear1.weight"),
                            fsdp_module_param(m, "norm2.weight")};
    gc("TransformerDecoderLayer (tgt, memory, multihead_attn.in_proj_weight, linear1.weight, "
       "norm2.weight)",
       dec_fn, &a, 5, in, 1e-5, 1e-7);
    fsdp_tensor_release(tgt);
    fsdp_tensor_release(mem);
    fsdp_tensor_release(cm);
    fsdp_module_release(m);
}

/* ---- GPT ------------------------------------------------------------------------------------- */

static void tiny_gpt(fsdp_gpt_config_t *cfg) {
    fsdp_gpt_config_init(cfg);
    cfg->vocab = 11;
    cfg->max_seq = 8;
    cfg->n_layer = 2;
    cfg->n_head = 2;
    cfg->d_model = 8;
}

static void test_gpt_structure(void) {
    fsdp_gpt_config_t cfg;
    fsdp_gpt_config_init(&cfg);
    tap_ok(cfg.vocab == 50257 && cfg.max_seq == 1024 && cfg.n_layer == 12 && cfg.n_head == 12 &&
               cfg.d_model == 768 && cfg.d_ff == 0 && cfg.dropout == 0.0 && cfg.init_std == 0.02,
           "GPT config defaults are GPT-2 small");
    tiny_gpt(&cfg);
    fsdp_module_t *m = NULL;
    must(fsdp_gpt_create(ctx, &cfg, &m), "gpt_create");
    static const char *const block[] = {
        "ln_1.weight",        "ln_1.bias",        "attn.c_attn.weight", "attn.c_attn.bias",
        "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight",        "ln_2.bias",
        "mlp.c_fc.weight",    "mlp.c_fc.bias",    "mlp.c_proj.weight",  "mlp.c_proj.bias"};
    const char *want[28];
    char buf[24][40];
    size_t n = 0;
    want[n++] = "wte.weight";
    want[n++] = "wpe.weight";
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 12; j++) {
            snprintf(buf[i * 12 + j], sizeof buf[0], "h.%d.%s", i, block[j]);
            want[n++] = buf[i * 12 + j];
        }
    want[n++] = "ln_f.weight";
    want[n++] = "ln_f.bias";
    check_names(m, want, n, "GPT(vocab 11, seq 8, 2 layers, d 8)");
    /* wte 88 + wpe 64 + 2 * (ln 16 + c_attn 216 + c_proj 72 + ln 16 + c_fc 288 + c_proj 264)
     * + ln_f 16 = 1912; the head adds nothing (tied). */
    tap_is_int(fsdp_module_num_params(m), 1912, "GPT parameter count with the tied head: 1912");
    fsdp_named_list_t l = {0};
    must(fsdp_module_named_params(m, true, &l), "named_params aliases");
    size_t wte = 0;
    for (size_t i = 0; i < l.n; i++)
        wte += fsdp_tensor_same_storage(l.tensors[i], fsdp_module_param(m, "wte.weight"));
    tap_is_size(wte, 1, "the tied embedding is one parameter under one name");
    tap_is_size(l.n, 28, "no separate head weight (lm_head) exists");
    fsdp_named_list_free(&l);
    tap_is_str(fsdp_module_type(m), "GPT", "GPT type");
    tap_is_str(fsdp_module_type(fsdp_module_child(m, "h.1")), "GPTBlock", "block type");
    tap_is_str(fsdp_module_type(fsdp_module_child(m, "h.0.attn")), "CausalSelfAttention",
               "attention type");
    tap_is_str(fsdp_module_type(fsdp_module_child(m, "h.0.mlp")), "MLP", "MLP type");
    const fsdp_gpt_config_t *gc_ = fsdp_gpt_get_config(m);
    tap_ok(gc_ && gc_->d_ff == 32 && gc_->vocab == 11, "the config resolves d_ff to 4 d");
    tap_ok(fsdp_gpt_get_config(fsdp_module_child(m, "h.0")) == NULL, "a block is not a GPT");
    fsdp_module_release(m);

    /* Initialisation statistics on a wider model. */
    cfg.d_model = 64;
    cfg.n_head = 4;
    cfg.n_layer = 2;
    must(fsdp_gpt_create(ctx, &cfg, &m), "gpt_create");
    struct {
        const char *name;
        double std;
    } st[3] = {{"h.0.attn.c_attn.weight", 0.02},
               {"h.1.mlp.c_proj.weight", 0.01},
               {"h.0.attn.c_proj.weight", 0.01}};
    for (int i = 0; i < 3; i++) {
        fsdp_tensor_t *w = fsdp_module_param(m, st[i].name);
        double *v = host(w), ss = 0;
        int64_t k = fsdp_tensor_numel(w);
        for (int64_t j = 0; j < k; j++)
            ss += v[j] * v[j];
        free(v);
        double sd = sqrt(ss / (double)k);
        tap_ok(fabs(sd - st[i].std) < 0.1 * st[i].std, "%s ~ N(0, %g) (std %g)", st[i].name,
               st[i].std, sd);
    }
    double *b = host(fsdp_module_param(m, "h.1.mlp.c_fc.bias"));
    double *g = host(fsdp_module_param(m, "h.1.ln_2.weight"));
    bool ok = true;
    for (int j = 0; j < 64; j++)
        ok = ok && b[j] == 0 && g[j] == 1;
    free(b);
    free(g);
    tap_ok(ok, "biases are zeros and LayerNorm weights ones");
    fsdp_module_release(m);

    cfg.n_head = 5;
    tap_is_int(fsdp_gpt_create(ctx, &cfg, &m), FSDP_EINVAL, "n_head must divide d_model");
}

/* A forward hook keeping the output of ln_f. */
static int keep_output(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t *const *in, int nout,
                       fsdp_tensor_t **out) {
    (void)m;
    (void)nin;
    (void)in;
    (void)nout;
    fsdp_tensor_t **slot = arg;
    fsdp_tensor_release(*slot);
    *slot = fsdp_tensor_retain(out[0]);
    return 0;
}

static void test_gpt_forward(void) {
    fsdp_gpt_config_t cfg;
    tiny_gpt(&cfg);
    const int64_t bsz = 2, t = 6, v = 11, d = 8;
    fsdp_module_t *m = NULL;
    must(fsdp_gpt_create(ctx, &cfg, &m), "gpt_create");
    /* Tokens 9 and 10 never occur, so their embedding rows get only the head's gradient. */
    const int64_t tok[12] = {1, 4, 2, 7, 0, 3, 5, 5, 8, 6, 1, 2};
    const int64_t tgt[12] = {4, 2, 7, 0, 3, 9, 5, 8, 6, 1, 2, 10};
    fsdp_tensor_t *tokens = mk_i64(2, (const int64_t[]){bsz, t}, tok);
    fsdp_tensor_t *targets = mk_i64(2, (const int64_t[]){bsz, t}, tgt);
    fsdp_tensor_t *logits = NULL, *loss = NULL, *xf = NULL;
    int handle = 0;
    must(fsdp_module_add_forward_hook(fsdp_module_child(m, "ln_f"), keep_output, &xf, &handle),
         "hook");
    must(fsdp_gpt_forward_loss(m, tokens, targets, &loss, &logits), "gpt forward_loss");
    tap_ok(same_shape(logits, 3, (const int64_t[]){bsz, t, v}), "GPT logits are (B, T, vocab)");
    double lv = 0;
    must(fsdp_tensor_item(loss, 0, &lv), "item");
    tap_is_near(lv, log((double)v), 0, 0.05, "initial loss is about ln(vocab)");
    must(fsdp_backward(loss, NULL), "backward");

    /* Head gradient by hand: d loss / d wte[c] (head part) = sum_r (p_rc - [y_r = c]) xf_r / R. */
    double *lg = host(logits), *xh = host(xf);
    fsdp_tensor_t *wg = fsdp_tensor_grad(fsdp_module_param(m, "wte.weight"));
    tap_ok(wg != NULL, "wte has a gradient");
    double *gh = wg ? host(wg) : calloc((size_t)(v * d), sizeof(double));
    double *head = calloc((size_t)(v * d), sizeof *head);
    if (!head || !gh) tap_bail("out of memory");
    const int64_t rows = bsz * t;
    for (int64_t r = 0; r < rows; r++) {
        double mx = -INFINITY, sum = 0;
        for (int64_t c = 0; c < v; c++)
            mx = fmax(mx, lg[r * v + c]);
        for (int64_t c = 0; c < v; c++)
            sum += exp(lg[r * v + c] - mx);
        for (int64_t c = 0; c < v; c++) {
            double dl = (exp(lg[r * v + c] - mx) / sum - (tgt[r] == c)) / (double)rows;
            for (int64_t j = 0; j < d; j++)
                head[c * d + j] += dl * xh[r * d + j];
        }
    }
    double absent = 0, present = 0;
    for (int64_t j = 0; j < d; j++) {
        absent = fmax(absent, fabs(gh[9 * d + j] - head[9 * d + j]));
        absent = fmax(absent, fabs(gh[10 * d + j] - head[10 * d + j]));
        present = fmax(present, fabs(gh[1 * d + j] - head[1 * d + j]));
    }
    tap_ok(absent < 1e-6, "unused token rows of wte get exactly the head's gradient (diff %g)",
           absent);
    tap_ok(present > 1e-5, "used token rows get the head's plus the embedding's gradient");
    free(lg);
    free(xh);
    free(gh);
    free(head);
    must(fsdp_module_remove_hook(fsdp_module_child(m, "ln_f"), handle), "remove_hook");
    fsdp_tensor_release(xf);
    fsdp_tensor_release(loss);
    must(fsdp_module_zero_grad(m, true), "zero_grad");
    bool was = fsdp_set_grad_enabled(ctx, false);

    /* Causality: changing token 3 leaves logits at positions 0..2 unchanged. */
    int64_t tok2[12];
    memcpy(tok2, tok, sizeof tok2);
    tok2[3] = 10;
    tok2[t + 3] = 10;
    fsdp_tensor_t *tokens2 = mk_i64(2, (const int64_t[]){bsz, t}, tok2), *logits2 = NULL;
    must(fsdp_gpt_forward(m, tokens2, &logits2), "gpt forward");
    fsdp_tensor_t *a = NULL, *b = NULL, *c3 = NULL, *d3 = NULL;
    must(fsdp_narrow(logits, 1, 0, 3, &a), "narrow");
    must(fsdp_narrow(logits2, 1, 0, 3, &b), "narrow");
    must(fsdp_narrow(logits, 1, 3, 1, &c3), "narrow");
    must(fsdp_narrow(logits2, 1, 3, 1, &d3), "narrow");
    tap_ok(max_diff(a, b) < 1e-6, "causal: earlier logits ignore a later token (diff %g)",
           max_diff(a, b));
    tap_ok(max_diff(c3, d3) > 1e-4, "causal: the changed position's logits change");
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    fsdp_tensor_release(c3);
    fsdp_tensor_release(d3);
    fsdp_tensor_release(tokens2);
    fsdp_tensor_release(logits2);

    /* The mask cache follows the sequence length. */
    fsdp_tensor_t *t3 = NULL, *l3 = NULL, *l6 = NULL, *l3n = NULL;
    must(fsdp_narrow(tokens, 1, 0, 3, &t3), "narrow");
    fsdp_tensor_t *t3c = NULL;
    must(fsdp_tensor_clone(t3, CAT, &t3c), "clone");
    must(fsdp_gpt_forward(m, t3c, &l3), "gpt T=3");
    must(fsdp_gpt_forward(m, tokens, &l6), "gpt T=6 again");
    must(fsdp_narrow(logits, 1, 0, 3, &l3n), "narrow");
    tap_ok(max_diff(l3, l3n) < 1e-6 && max_diff(l6, logits) == 0,
           "a shorter sequence, then the first length again, give consistent logits");
    fsdp_tensor_release(t3);
    fsdp_tensor_release(t3c);
    fsdp_tensor_release(l3);
    fsdp_tensor_release(l6);
    fsdp_tensor_release(l3n);

    /* Ignored targets (-1) drop out of the mean. */
    int64_t tg2[12];
    memcpy(tg2, tgt, sizeof tg2);
    for (int i = 6; i < 12; i++)
        tg2[i] = -1;
    fsdp_tensor_t *targets2 = mk_i64(2, (const int64_t[]){bsz, t}, tg2), *half = NULL;
    fsdp_tensor_t *row0 = NULL, *lrow0 = NULL, *trow0 = NULL, *ref = NULL;
    must(fsdp_gpt_loss(logits, targets2, &half), "gpt_loss ignore");
    must(fsdp_narrow(logits, 0, 0, 1, &row0), "narrow");
    must(fsdp_tensor_clone(row0, CAT, &lrow0), "clone");
    must(fsdp_narrow(targets, 0, 0, 1, &trow0), "narrow");
    fsdp_tensor_t *trow0c = NULL;
    must(fsdp_tensor_clone(trow0, CAT, &trow0c), "clone");
    must(fsdp_gpt_loss(lrow0, trow0c, &ref), "gpt_loss row 0");
    double hv = 0, rv = 0;
    must(fsdp_tensor_item(half, 0, &hv), "item");
    must(fsdp_tensor_item(ref, 0, &rv), "item");
    tap_is_near(hv, rv, 1e-6, 0, "targets of -1 are ignored");
    fsdp_tensor_release(targets2);
    fsdp_tensor_release(half);
    fsdp_tensor_release(row0);
    fsdp_tensor_release(lrow0);
    fsdp_tensor_release(trow0);
    fsdp_tensor_release(trow0c);
    fsdp_tensor_release(ref);

    /* Errors. */
    fsdp_tensor_t *y = NULL;
    int64_t longtok[9] = {0};
    fsdp_tensor_t *tl = mk_i64(2, (const int64_t[]){1, 9}, longtok);
    tap_is_int(fsdp_gpt_forward(m, tl, &y), FSDP_EINVAL, "T > max_seq is refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "max_seq", "the error names max_seq");
    fsdp_tensor_release(tl);
    int64_t badtok[2] = {3, 11};
    fsdp_tensor_t *tb = mk_i64(2, (const int64_t[]){1, 2}, badtok);
    tap_ok(fsdp_gpt_forward(m, tb, &y) < 0 && y == NULL, "a token >= vocab is refused");
    fsdp_tensor_release(tb);
    tap_is_int(fsdp_gpt_forward(m, logits, &y), FSDP_EINVAL, "float tokens are refused");
    fsdp_set_grad_enabled(ctx, was);

    fsdp_tensor_release(tokens);
    fsdp_tensor_release(targets);
    fsdp_tensor_release(logits);
    fsdp_module_release(m);
}

static void test_gpt_dropout(void) {
    fsdp_gpt_config_t cfg;
    tiny_gpt(&cfg);
    cfg.dropout = 0.2;
    fsdp_module_t *m = NULL;
    must(fsdp_gpt_create(ctx, &cfg, &m), "gpt_create");
    const int64_t tok[5] = {1, 2, 3, 4, 5};
    fsdp_tensor_t *tokens = mk_i64(2, (const int64_t[]){1, 5}, tok);
    fsdp_tensor_t *a = NULL, *b = NULL, *c = NULL, *d = NULL;
    must(fsdp_gpt_forward(m, tokens, &a), "train");
    must(fsdp_gpt_forward(m, tokens, &b), "train");
    fsdp_module_train(m, false);
    tap_ok(!fsdp_module_is_training(fsdp_module_child(m, "h.1.attn")), "eval reaches every block");
    must(fsdp_gpt_forward(m, tokens, &c), "eval");
    must(fsdp_gpt_forward(m, tokens, &d), "eval");
    tap_ok(max_diff(a, b) > 1e-5, "GPT train: dropout changes the logits between runs");
    tap_ok(max_diff(c, d) == 0, "GPT eval: deterministic logits");
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    fsdp_tensor_release(c);
    fsdp_tensor_release(d);
    fsdp_tensor_release(tokens);
    fsdp_module_release(m);
}

struct gpt_arg {
    fsdp_module_t *m;
    fsdp_tensor_t *tokens;
};

static int gpt_fn(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    const struct gpt_arg *a = arg;
    (void)nin;
    (void)in;
    return fsdp_gpt_forward(a->m, a->tokens, out);
}

/* The whole model's gradient in f64, the tied wte (both uses) first of all. */
static void test_gpt_grad(void) {
    fsdp_gpt_config_t cfg;
    tiny_gpt(&cfg);
    cfg.vocab = 5;
    cfg.max_seq = 4;
    cfg.d_model = 4;
    cfg.init_std = 0.5; /* large enough that every path carries signal */
    fsdp_module_t *m = NULL;
    must(fsdp_gpt_create(ctx, &cfg, &m), "gpt_create");
    to_f64(m);
    const int64_t tok[6] = {1, 0, 3, 2, 2, 4};
    fsdp_tensor_t *tokens = mk_i64(2, (const int64_t[]){2, 3}, tok);
    struct gpt_arg a = {m, tokens};
    fsdp_tensor_t *in[6] = {fsdp_module_param(m, "wte.weight"),
                            fsdp_module_param(m, "wpe.weight"),
                            fsdp_module_param(m, "h.0.attn.c_attn.weight"),
                            fsdp_module_param(m, "h.1.attn.c_proj.bias"),
                            fsdp_module_param(m, "h.1.mlp.c_fc.weight"),
                            fsdp_module_param(m, "ln_f.weight")};
    gc("GPT (wte tied, wpe, c_attn.weight, c_proj.bias, c_fc.weight, ln_f.weight)", gpt_fn, &a, 6,
       in, 1e-5, 1e-7);
    fsdp_tensor_release(tokens);
    fsdp_module_release(m);
}

int main(void) {
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    o.seed = 4321;
    if (fsdp_ctx_create(&o, &ctx) < 0) tap_bail("context creation failed");
    tap_plan_lazy();
    test_mha_structure();
    test_mha_forward();
    test_mha_grad();
    test_mha_dropout();
    test_transformer_structure();
    test_layers_by_hand();
    test_transformer_forward();
    test_decoder_grad();
    test_gpt_structure();
    test_gpt_forward();
    test_gpt_dropout();
    test_gpt_grad();
    fsdp_tape_clear(ctx);
    fsdp_ctx_destroy(ctx);
    return tap_done();
}
