/* SPDX-License-Identifier: MIT */
/*
 * attention.c: scaled dot-product attention and the MultiheadAttention module.
 *
 * Heads are never looped over: a projection's output (L, N, c*E) is viewed as (L, N, c, H, hd),
 * permuted to (c, N, H, L, hd) and split into c contiguous (N, H, L, hd) tensors in one strided
 * copy each, so that scores and values are batched products over (N, H) whose operands the
 * GEMM reads in place (k^T is a transposed view). Masks stay in their own shapes and are
 * broadcast by the add and masked-fill operations, never expanded per head.
 *
 * Invariants: parameter slot 0 is in_proj_weight and slot 1 in_proj_bias (when the module has
 * biases); the slots are stable when FSDP swaps the tensors, so forward finds them by index.
 */
#include <math.h>
#include <stddef.h>

#include "nn/nn_impl.h"
#include <fsdp/transformer.h>

struct mha {
    int64_t e;      /* embed_dim */
    int64_t h;      /* num_heads */
    int64_t hd;     /* e / h */
    double dropout; /* on the attention weights, training only */
    bool bias;      /* in_proj_bias and out_proj.bias exist */
    bool batch_first;
    fsdp_module_t *out_proj; /* the child "out_proj" (borrowed: the module holds it) */
};

/* ---- scaled dot-product attention ------------------------------------------------------------ */

int fsdp_attention(fsdp_tensor_t *q, fsdp_tensor_t *k, fsdp_tensor_t *v, fsdp_tensor_t *bias,
                   fsdp_tensor_t *ignore, double dropout_p, bool train, fsdp_tensor_t **out) {
    fsdp_ctx_t *ctx = q ? fsdp_tensor_ctx(q) : k ? fsdp_tensor_ctx(k) : NULL;
    fsdp_tensor_t *qs = NULL, *kt = NULL, *s = NULL, *t = NULL, *b = NULL, *w = NULL, *wd = NULL;
    char d0[160], d1[160], d2[160];
    int rc;
    if (!out) return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_attention: out is NULL");
    *out = NULL;
    if (!q || !k || !v)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_attention: q, k and v are required");
    int nd = fsdp_tensor_ndim(q);
    if (nd < 2 || fsdp_tensor_ndim(k) != nd || fsdp_tensor_ndim(v) != nd ||
        fsdp_tensor_size(k, -1) != fsdp_tensor_size(q, -1) ||
        fsdp_tensor_size(v, -2) != fsdp_tensor_size(k, -2))
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_attention: q %s, k %s and v %s must be (..., L, E), (..., S, E) "
                             "and (..., S, Ev)",
                             fsdp_tensor_describe(q, d0, sizeof d0),
                             fsdp_tensor_describe(k, d1, sizeof d1),
                             fsdp_tensor_describe(v, d2, sizeof d2));
    if (!(dropout_p >= 0.0 && dropout_p < 1.0))
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_attention: dropout_p %g is outside [0, 1)",
                             dropout_p);
    int64_t e = fsdp_tensor_size(q, -1);
    /* PyTorch scales q rather than the scores; it is also the smaller tensor when L > E. */
    FSDP_TRY(rc, fail, fsdp_scale(q, e > 0 ? 1.0 / sqrt((double)e) : 1.0, &qs));
    FSDP_TRY(rc, fail, fsdp_transpose(k, nd - 2, nd - 1, &kt));
    FSDP_TRY(rc, fail, fsdp_matmul(qs, kt, &s));
    if (bias) {
        if (fsdp_tensor_dtype(bias) != fsdp_tensor_dtype(s))
            FSDP_TRY(rc, fail, fsdp_to_dtype(bias, fsdp_tensor_dtype(s), &b));
        else
            b = fsdp_tensor_retain(bias);
        FSDP_TRY(rc, fail, fsdp_add(s, b, &t));
        fsdp_tensor_release(s);
        s = t;
        t = NULL;
    }
    if (ignore) {
        FSDP_TRY(rc, fail, fsdp_masked_fill(s, ignore, -INFINITY, &t));
        fsdp_tensor_release(s);
        s = t;
        t = NULL;
    }
    FSDP_TRY(rc, fail, fsdp_softmax(s, nd - 1, &w));
    FSDP_TRY(rc, fail, fsdp_dropout(w, dropout_p, train, &wd));
    FSDP_TRY(rc, fail, fsdp_matmul(wd, v, out));
fail:
    fsdp_tensor_release(qs);
    fsdp_tensor_release(kt);
    fsdp_tensor_release(s);
    fsdp_tensor_release(t);
    fsdp_tensor_release(b);
    fsdp_tensor_release(w);
    fsdp_tensor_release(wd);
    return rc;
}

/* ---- MultiheadAttention ---------------------------------------------------------------------- */

/*
 * The `count` projections of x by rows [first*E, (first+count)*E) of the packed in-projection,
 * each split into heads: outs[i] is (N, H, Lx, hd), contiguous. x is (Lx, N, E), or (N, Lx, E)
 * when batch_first.
 */
static int project(fsdp_module_t *m, const struct mha *a, fsdp_tensor_t *x, int first, int count,
                   fsdp_tensor_t **outs) {
    fsdp_tensor_t *w = fsdp__module_param_at(m, 0);
    fsdp_tensor_t *b = a->bias ? fsdp__module_param_at(m, 1) : NULL;
    fsdp_tensor_t *wn = NULL, *bn = NULL, *y = NULL, *y5 = NULL, *yp = NULL;
    fsdp_tensor_t *pieces[3] = {NULL, NULL, NULL};
    int bd = a->batch_first ? 0 : 1, ld = 1 - bd;
    int rc;
    for (int i = 0; i < count; i++)
        outs[i] = NULL;
    if (count == 3) {
        wn = fsdp_tensor_retain(w);
        bn = b ? fsdp_tensor_retain(b) : NULL;
    } else {
        FSDP_TRY(rc, fail, fsdp_narrow(w, 0, first * a->e, count * a->e, &wn));
        if (b) FSDP_TRY(rc, fail, fsdp_narrow(b, 0, first * a->e, count * a->e, &bn));
    }
    FSDP_TRY(rc, fail, fsdp_linear(x, wn, bn, &y));
    int64_t n = fsdp_tensor_size(x, bd), lx = fsdp_tensor_size(x, ld);
    int64_t shape5[5];
    shape5[bd] = n;
    shape5[ld] = lx;
    shape5[2] = count;
    shape5[3] = a->h;
    shape5[4] = a->hd;
    FSDP_TRY(rc, fail, fsdp_view(y, 5, shape5, &y5));
    const int perm[5] = {2, bd, 3, ld, 4};
    FSDP_TRY(rc, fail, fsdp_permute(y5, perm, &yp));
    const int64_t ones[3] = {1, 1, 1};
    FSDP_TRY(rc, fail, fsdp_split(yp, ones, count, 0, pieces));
    const int64_t shape4[4] = {n, a->h, lx, a->hd};
    for (int i = 0; i < count; i++)
        FSDP_TRY(rc, fail, fsdp_view(pieces[i], 4, shape4, &outs[i]));
fail:
    if (rc < 0) {
        for (int i = 0; i < count; i++) {
            fsdp_tensor_release(outs[i]);
            outs[i] = NULL;
        }
    }
    for (int i = 0; i < 3; i++)
        fsdp_tensor_release(pieces[i]);
    fsdp_tensor_release(wn);
    fsdp_tensor_release(bn);
    fsdp_tensor_release(y);
    fsdp_tensor_release(y5);
    fsdp_tensor_release(yp);
    return rc;
}

static bool is_mask_dtype(fsdp_dtype_t dt) {
    return dt == FSDP_DTYPE_BOOL || dt == FSDP_DTYPE_U8;
}

/*
 * Turns the user's masks into what fsdp_attention takes: *bias (float, broadcast to
 * (N, H, L, S)) and *ignore (bool/u8, same). A bool attn_mask becomes -inf/0 scores when a
 * bool key padding mask also needs the ignore slot (PyTorch 1.13 converts it the same way).
 */
static int prepare_masks(fsdp_module_t *m, const struct mha *a, fsdp_tensor_t *kpm,
                         fsdp_tensor_t *mask, int64_t n, int64_t l, int64_t s, fsdp_dtype_t dt,
                         fsdp_tensor_t **bias, fsdp_tensor_t **ignore) {
    fsdp_tensor_t *mk = NULL, *kp = NULL, *z = NULL, *t = NULL;
    char d0[160];
    int rc = FSDP_OK;
    *bias = *ignore = NULL;
    if (mask) {
        int mnd = fsdp_tensor_ndim(mask);
        const int64_t *ms = fsdp_tensor_shape(mask);
        if (mnd == 2 && ms[0] == l && ms[1] == s) {
            mk = fsdp_tensor_retain(mask);
        } else if (mnd == 3 && ms[0] == n * a->h && ms[1] == l && ms[2] == s) {
            const int64_t s4[4] = {n, a->h, l, s};
            FSDP_TRY(rc, fail, fsdp_reshape(mask, 4, s4, &mk));
        } else {
            rc = fsdp__module_err(m, FSDP_EINVAL,
                                  "attn_mask %s must be (L, S) = (%lld, %lld) or (N * num_heads, "
                                  "L, S) = (%lld, %lld, %lld)",
                                  fsdp_tensor_describe(mask, d0, sizeof d0), (long long)l,
                                  (long long)s, (long long)(n * a->h), (long long)l, (long long)s);
            goto fail;
        }
        fsdp_dtype_t mdt = fsdp_tensor_dtype(mask);
        if (!is_mask_dtype(mdt) && !fsdp_dtype_is_float(mdt)) {
            rc = fsdp__module_err(m, FSDP_EINVAL, "attn_mask %s must be float, bool or u8",
                                  fsdp_tensor_describe(mask, d0, sizeof d0));
            goto fail;
        }
    }
    if (kpm) {
        if (fsdp_tensor_ndim(kpm) != 2 || fsdp_tensor_size(kpm, 0) != n ||
            fsdp_tensor_size(kpm, 1) != s ||
            (!is_mask_dtype(fsdp_tensor_dtype(kpm)) &&
             !fsdp_dtype_is_float(fsdp_tensor_dtype(kpm)))) {
            rc = fsdp__module_err(m, FSDP_EINVAL,
                                  "key_padding_mask %s must be (N, S) = (%lld, %lld), bool, u8 or "
                                  "float",
                                  fsdp_tensor_describe(kpm, d0, sizeof d0), (long long)n,
                                  (long long)s);
            goto fail;
        }
        const int64_t s4[4] = {n, 1, 1, s};
        FSDP_TRY(rc, fail, fsdp_reshape(kpm, 4, s4, &kp));
    }
    bool mask_bool = mk && is_mask_dtype(fsdp_tensor_dtype(mk));
    bool kpm_bool = kp && is_mask_dtype(fsdp_tensor_dtype(kp));
    if (mask_bool && kpm_bool) {
        FSDP_TRY(rc, fail,
                 fsdp_tensor_zeros(fsdp_module_ctx(m), dt, fsdp_tensor_ndim(mk),
                                   fsdp_tensor_shape(mk), FSDP_MEM_ACTIVATIONS, &z));
        FSDP_TRY(rc, fail, fsdp_masked_fill(z, mk, -INFINITY, bias));
        fsdp_tensor_release(mk);
        mk = NULL;
        *ignore = kp;
        kp = NULL;
    } else if (mask_bool) {
        *ignore = mk;
        mk = NULL;
    } else if (kpm_bool) {
        *ignore = kp;
        kp = NULL;
    }
    /* Whatever is left is additive: a float attn_mask and/or a float key padding mask. */
    if (mk && kp) {
        FSDP_TRY(rc, fail, fsdp_add(mk, kp, &t));
        *bias = t;
        t = NULL;
    } else if (mk || kp) {
        *bias = mk ? mk : kp;
        mk = kp = NULL;
    }
fail:
    if (rc < 0) {
        fsdp_tensor_release(*bias);
        fsdp_tensor_release(*ignore);
        *bias = *ignore = NULL;
    }
    fsdp_tensor_release(mk);
    fsdp_tensor_release(kp);
    fsdp_tensor_release(z);
    fsdp_tensor_release(t);
    return rc;
}

/* The attention of (batched) query, key and value; see fsdp_mha_create. */
static int mha_run(fsdp_module_t *m, const struct mha *a, fsdp_tensor_t *query, fsdp_tensor_t *key,
                   fsdp_tensor_t *value, fsdp_tensor_t *kpm, fsdp_tensor_t *mask,
                   fsdp_tensor_t **out) {
    fsdp_tensor_t *qkv[3] = {NULL, NULL, NULL};
    fsdp_tensor_t *bias = NULL, *ignore = NULL, *y = NULL, *yp = NULL, *ym = NULL;
    char d0[160], d1[160], d2[160];
    int bd = a->batch_first ? 0 : 1, ld = 1 - bd;
    int rc;
    if (fsdp_tensor_ndim(query) != 3 || fsdp_tensor_ndim(key) != 3 ||
        fsdp_tensor_ndim(value) != 3 || fsdp_tensor_size(query, 2) != a->e ||
        fsdp_tensor_size(key, 2) != a->e || fsdp_tensor_size(value, 2) != a->e ||
        fsdp_tensor_size(key, bd) != fsdp_tensor_size(query, bd) ||
        fsdp_tensor_size(value, bd) != fsdp_tensor_size(query, bd) ||
        fsdp_tensor_size(value, ld) != fsdp_tensor_size(key, ld)) {
        rc = fsdp__module_err(
            m, FSDP_EINVAL,
            "query %s, key %s and value %s must be %s with E = %lld and the "
            "same N",
            fsdp_tensor_describe(query, d0, sizeof d0), fsdp_tensor_describe(key, d1, sizeof d1),
            fsdp_tensor_describe(value, d2, sizeof d2),
            a->batch_first ? "(N, L, E), (N, S, E), (N, S, E)" : "(L, N, E), (S, N, E), (S, N, E)",
            (long long)a->e);
        goto fail;
    }
    int64_t n = fsdp_tensor_size(query, bd), l = fsdp_tensor_size(query, ld);
    int64_t s = fsdp_tensor_size(key, ld);
    if (query == key && key == value) {
        FSDP_TRY(rc, fail, project(m, a, query, 0, 3, qkv));
    } else if (key == value) {
        FSDP_TRY(rc, fail, project(m, a, query, 0, 1, qkv));
        FSDP_TRY(rc, fail, project(m, a, key, 1, 2, qkv + 1));
    } else {
        FSDP_TRY(rc, fail, project(m, a, query, 0, 1, qkv));
        FSDP_TRY(rc, fail, project(m, a, key, 1, 1, qkv + 1));
        FSDP_TRY(rc, fail, project(m, a, value, 2, 1, qkv + 2));
    }
    FSDP_TRY(rc, fail,
             prepare_masks(m, a, kpm, mask, n, l, s, fsdp_tensor_dtype(qkv[0]), &bias, &ignore));
    FSDP_TRY(rc, fail,
             fsdp_attention(qkv[0], qkv[1], qkv[2], bias, ignore, a->dropout,
                            fsdp_module_is_training(m), &y));
    /* (N, H, L, hd) -> (L, N, H, hd) or (N, L, H, hd) -> (L, N, E) or (N, L, E). */
    const int perm_lf[4] = {2, 0, 1, 3}, perm_bf[4] = {0, 2, 1, 3};
    FSDP_TRY(rc, fail, fsdp_permute(y, a->batch_first ? perm_bf : perm_lf, &yp));
    int64_t shape3[3];
    shape3[bd] = n;
    shape3[ld] = l;
    shape3[2] = a->e;
    FSDP_TRY(rc, fail, fsdp_reshape(yp, 3, shape3, &ym));
    FSDP_TRY(rc, fail, fsdp_module_forward1(a->out_proj, ym, out));
fail:
    for (int i = 0; i < 3; i++)
        fsdp_tensor_release(qkv[i]);
    fsdp_tensor_release(bias);
    fsdp_tensor_release(ignore);
    fsdp_tensor_release(y);
    fsdp_tensor_release(yp);
    fsdp_tensor_release(ym);
    return rc;
}

/* Inputs: query, key, value[, key_padding_mask[, attn_mask]]. Unbatched 2-d inputs get a batch
 * dimension of one for the run and lose it again. */
static int mha_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                       fsdp_tensor_t **out) {
    const struct mha *a = fsdp_module_impl(m);
    fsdp_tensor_t *u[4] = {NULL, NULL, NULL, NULL}, *y = NULL;
    int rc = fsdp__module_check_io(m, nin, in, 3, 5, nout, 1);
    if (rc < 0) return rc;
    out[0] = NULL;
    fsdp_tensor_t *q = in[0], *k = in[1], *v = in[2];
    fsdp_tensor_t *kpm = nin > 3 ? in[3] : NULL, *mask = nin > 4 ? in[4] : NULL;
    if (fsdp_tensor_ndim(q) != 2) return mha_run(m, a, q, k, v, kpm, mask, out);
    if (fsdp_tensor_ndim(k) != 2 || fsdp_tensor_ndim(v) != 2 ||
        (kpm && fsdp_tensor_ndim(kpm) != 1)) {
        char d0[160], d1[160];
        return fsdp__module_err(m, FSDP_EINVAL,
                                "unbatched query %s needs 2-d key %s and value and a 1-d "
                                "key_padding_mask",
                                fsdp_tensor_describe(q, d0, sizeof d0),
                                fsdp_tensor_describe(k, d1, sizeof d1));
    }
    int bd = a->batch_first ? 0 : 1;
    FSDP_TRY(rc, fail, fsdp_unsqueeze(q, bd, &u[0]));
    if (k == q)
        u[1] = fsdp_tensor_retain(u[0]);
    else
        FSDP_TRY(rc, fail, fsdp_unsqueeze(k, bd, &u[1]));
    if (v == k)
        u[2] = fsdp_tensor_retain(u[1]);
    else
        FSDP_TRY(rc, fail, fsdp_unsqueeze(v, bd, &u[2]));
    if (kpm) FSDP_TRY(rc, fail, fsdp_unsqueeze(kpm, 0, &u[3]));
    /* Keep self-attention recognisable: the unsqueezed views are distinct tensors. */
    fsdp_tensor_t *uk = k == q ? u[0] : u[1], *uv = v == k ? uk : u[2];
    FSDP_TRY(rc, fail, mha_run(m, a, u[0], uk, uv, u[3], mask, &y));
    FSDP_TRY(rc, fail, fsdp_squeeze(y, bd, out));
fail:
    for (int i = 0; i < 4; i++)
        fsdp_tensor_release(u[i]);
    fsdp_tensor_release(y);
    return rc;
}

static const fsdp_module_ops_t mha_ops = {
    .type = "MultiheadAttention",
    .forward = mha_forward,
    .destroy = NULL,
};

/* xavier_uniform_ (gain 1) of a matrix: U(-b, b) with b = sqrt(6 / (fan_in + fan_out)). */
static int xavier_uniform(fsdp_tensor_t *t) {
    int64_t fan_out = fsdp_tensor_size(t, 0), fan_in = fsdp_tensor_size(t, 1);
    double bound = sqrt(6.0 / (double)(fan_in + fan_out));
    return fsdp_tensor_uniform_(t, -bound, bound);
}

int fsdp_mha_create(fsdp_ctx_t *ctx, int64_t embed_dim, int64_t num_heads, double dropout,
                    bool bias, bool batch_first, fsdp_module_t **m) {
    fsdp_module_t *mod = NULL, *lin = NULL;
    struct mha *a = NULL;
    fsdp_tensor_t *w = NULL, *b = NULL;
    int rc;
    if (!m) return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_mha_create: m is NULL");
    *m = NULL;
    if (!ctx) return FSDP_EINVAL;
    if (embed_dim <= 0 || num_heads <= 0 || embed_dim % num_heads != 0)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_mha_create: embed_dim %lld must be positive and divisible by "
                             "num_heads %lld",
                             (long long)embed_dim, (long long)num_heads);
    if (!(dropout >= 0.0 && dropout < 1.0))
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_mha_create: dropout %g is outside [0, 1)",
                             dropout);
    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &mha_ops, sizeof *a, &mod, (void **)&a));
    a->e = embed_dim;
    a->h = num_heads;
    a->hd = embed_dim / num_heads;
    a->dropout = dropout;
    a->bias = bias;
    a->batch_first = batch_first;
    /* PyTorch's registration order: in_proj_weight, in_proj_bias, then out_proj. */
    const int64_t ws[2] = {3 * embed_dim, embed_dim}, bs[1] = {3 * embed_dim};
    FSDP_TRY(rc, fail, fsdp__module_new_param(mod, "in_proj_weight", 2, ws, 0.0, &w));
    if (bias) FSDP_TRY(rc, fail, fsdp__module_new_param(mod, "in_proj_bias", 1, bs, 0.0, &b));
    /* The Linear draws its weight and bias now, before in_proj_weight, as in PyTorch. */
    FSDP_TRY(rc, fail, fsdp_linear_create(ctx, embed_dim, embed_dim, bias, &lin));
    /* The module keeps the only reference; a->out_proj borrows it. */
    rc = fsdp_module_add_child(mod, "out_proj", lin);
    fsdp_module_release(lin);
    if (rc < 0) goto fail;
    a->out_proj = lin;
    /* _reset_parameters: xavier on in_proj_weight, zeros on both biases. */
    FSDP_TRY(rc, fail, xavier_uniform(w));
    if (bias) FSDP_TRY(rc, fail, fsdp_tensor_zero_(fsdp_module_param(lin, "bias")));
    *m = mod;
    return FSDP_OK;
fail:
    fsdp_module_release(mod);
    return rc;
}

int fsdp_mha_forward(fsdp_module_t *m, fsdp_tensor_t *query, fsdp_tensor_t *key,
                     fsdp_tensor_t *value, fsdp_tensor_t *key_padding_mask,
                     fsdp_tensor_t *attn_mask, fsdp_tensor_t **out) {
    if (!m || !out) return FSDP_EINVAL;
    *out = NULL;
    if (fsdp_module_ops(m) != &mha_ops)
        return fsdp__module_err(m, FSDP_EINVAL, "fsdp_mha_forward: not a MultiheadAttention");
    fsdp_tensor_t *in[5] = {query, key, value, key_padding_mask, attn_mask};
    int nin = attn_mask ? 5 : key_padding_mask ? 4 : 3;
    return fsdp_module_forward(m, nin, in, 1, out);
}
