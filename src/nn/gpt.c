/* SPDX-License-Identifier: MIT */
/*
 * gpt.c: a GPT-2 style decoder-only language model (module types "GPT", "GPTBlock",
 * "CausalSelfAttention", "MLP").
 *
 * The forward is written to copy as little as the operations allow: one product for query,
 * key and value; one (T, T) causal mask, built once per sequence length and dtype and kept in
 * the model; the head shares the token embedding through fsdp_linear(x, wte, NULL), so there is
 * no second weight and the embedding's gradient accumulates both uses. Where the device has a
 * fused attention kernel (the CPU, f32, no attention dropout) the packed projection goes to it
 * whole (tensor/ops_attention.h): one pass per sequence and head, q, k and v read in place.
 * Elsewhere attention is composed: one strided split lays the heads out as (B, H, T, hd) for
 * batched products (the key transposed by a view), the mask is broadcast over batch and heads by
 * the add, and one copy merges the heads. Both give the same values; the fused kernel skips the
 * causal mask's half of its products, so beyond a block of rows they differ in rounding only.
 *
 * Invariants: the model's impl caches the mask and the position indices of the last sequence
 * length (released by destroy); a block's children are found through borrowed pointers in its
 * impl; parameters are looked up at every forward (FSDP may swap their tensors).
 */
#include <math.h>
#include <string.h>

#include "nn/nn_impl.h"
#include "tensor/ops_attention.h"
#include <fsdp/transformer.h>

static const fsdp__abi_struct_t config_abi =
    FSDP__ABI_STRUCT(fsdp_gpt_config_t, "fsdp_gpt_config_init", init_std);

void(fsdp_gpt_config_init)(fsdp_gpt_config_t *cfg, size_t size) {
    fsdp_gpt_config_t d;
    memset(&d, 0, sizeof d);
    d.vocab = 50257;
    d.max_seq = 1024;
    d.n_layer = 12;
    d.n_head = 12;
    d.d_model = 768;
    d.d_ff = 0;
    d.dropout = 0.0;
    d.layer_norm_eps = 1e-5;
    d.init_std = 0.02;
    fsdp__abi_init(cfg, size, &d, &config_abi);
}

struct gpt {
    fsdp_gpt_config_t cfg;               /* d_ff resolved; size this library's */
    fsdp_module_t *wte, *wpe, *h, *ln_f; /* children (borrowed) */
    fsdp_tensor_t *mask; /* (T, T) additive causal mask of the last forward, or NULL */
    fsdp_tensor_t *pos;  /* (T) int64 positions 0..T-1 of the last forward, or NULL */
};

struct block {
    fsdp_module_t *ln_1, *attn, *ln_2, *mlp;
};

struct csa {
    fsdp_module_t *c_attn, *c_proj;
    int64_t d, h;
    double dropout;
};

struct mlp {
    fsdp_module_t *c_fc, *c_proj;
    double dropout;
};

/* Registers child under name and drops the caller's reference (the parent keeps one); *slot
 * (may be NULL) borrows the child. The child is consumed on failure too. */
static int adopt(fsdp_module_t *m, const char *name, fsdp_module_t *child, fsdp_module_t **slot) {
    int rc = fsdp_module_add_child(m, name, child);
    if (rc == 0 && slot) *slot = child;
    fsdp_module_release(child);
    return rc;
}

/* A (T, T) causal mask in dtype dt on dev, for a block run on its own. */
static int make_mask(fsdp_ctx_t *ctx, int64_t t, fsdp_dtype_t dt, fsdp_tensor_t **out) {
    fsdp_tensor_t *m = NULL;
    int rc = fsdp_causal_mask(ctx, t, &m);
    if (rc < 0) return rc;
    if (fsdp_tensor_dtype(m) == dt) {
        *out = m;
        return FSDP_OK;
    }
    rc = fsdp_to_dtype(m, dt, out);
    fsdp_tensor_release(m);
    return rc;
}

/* ---- CausalSelfAttention --------------------------------------------------------------------- */

/* Inputs: x (B, T, d)[, mask (T, T) additive]. */
static int csa_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                       fsdp_tensor_t **out) {
    const struct csa *a = fsdp_module_impl(m);
    fsdp_tensor_t *mask = NULL, *qkv = NULL, *q5 = NULL, *qp = NULL, *y = NULL, *yp = NULL;
    fsdp_tensor_t *ym = NULL, *z = NULL;
    fsdp_tensor_t *pieces[3] = {NULL, NULL, NULL}, *heads[3] = {NULL, NULL, NULL};
    int rc = fsdp__module_check_io(m, nin, in, 1, 2, nout, 1);
    if (rc < 0) return rc;
    out[0] = NULL;
    fsdp_tensor_t *x = in[0];
    if (fsdp_tensor_ndim(x) != 3 || fsdp_tensor_size(x, 2) != a->d) {
        char d0[160];
        return fsdp__module_err(m, FSDP_EINVAL, "input %s must be (B, T, %lld)",
                                fsdp_tensor_describe(x, d0, sizeof d0), (long long)a->d);
    }
    int64_t b = fsdp_tensor_size(x, 0), t = fsdp_tensor_size(x, 1), hd = a->d / a->h;
    FSDP_TRY(rc, fail, fsdp_module_forward1(a->c_attn, x, &qkv));
    if (nin > 1 && in[1])
        mask = fsdp_tensor_retain(in[1]);
    else
        FSDP_TRY(rc, fail, make_mask(fsdp_module_ctx(m), t, fsdp_tensor_dtype(qkv), &mask));
    bool train = fsdp_module_is_training(m);
    if ((a->dropout == 0.0 || !train) && fsdp__attention_packed_ok(qkv, a->h, mask)) {
        /* One pass per (sequence, head) reading q, k and v in place: the composed path's values
         * below, without its copies, whole-batch passes and masked products (ops_attention.h). */
        FSDP_TRY(rc, fail, fsdp__attention_packed(qkv, a->h, 1.0 / sqrt((double)hd), mask, &ym));
    } else {
        /* (B, T, 3d) -> (B, T, 3, H, hd) -> (3, B, H, T, hd) -> three contiguous (B, H, T, hd). */
        const int64_t s5[5] = {b, t, 3, a->h, hd};
        FSDP_TRY(rc, fail, fsdp_view(qkv, 5, s5, &q5));
        const int perm5[5] = {2, 0, 3, 1, 4};
        FSDP_TRY(rc, fail, fsdp_permute(q5, perm5, &qp));
        const int64_t ones[3] = {1, 1, 1};
        FSDP_TRY(rc, fail, fsdp_split(qp, ones, 3, 0, pieces));
        const int64_t s4[4] = {b, a->h, t, hd};
        for (int i = 0; i < 3; i++)
            FSDP_TRY(rc, fail, fsdp_view(pieces[i], 4, s4, &heads[i]));
        FSDP_TRY(rc, fail,
                 fsdp_attention(heads[0], heads[1], heads[2], mask, NULL, a->dropout, train, &y));
        /* (B, H, T, hd) -> (B, T, H, hd) -> (B, T, d): the one copy that merges the heads. */
        const int perm4[4] = {0, 2, 1, 3};
        FSDP_TRY(rc, fail, fsdp_permute(y, perm4, &yp));
        const int64_t s3[3] = {b, t, a->d};
        FSDP_TRY(rc, fail, fsdp_reshape(yp, 3, s3, &ym));
    }
    FSDP_TRY(rc, fail, fsdp_module_forward1(a->c_proj, ym, &z));
    FSDP_TRY(rc, fail, fsdp_dropout(z, a->dropout, train, out));
fail:
    for (int i = 0; i < 3; i++) {
        fsdp_tensor_release(pieces[i]);
        fsdp_tensor_release(heads[i]);
    }
    fsdp_tensor_release(mask);
    fsdp_tensor_release(qkv);
    fsdp_tensor_release(q5);
    fsdp_tensor_release(qp);
    fsdp_tensor_release(y);
    fsdp_tensor_release(yp);
    fsdp_tensor_release(ym);
    fsdp_tensor_release(z);
    return rc;
}

static const fsdp_module_ops_t csa_ops = {
    .type = "CausalSelfAttention",
    .forward = csa_forward,
    .destroy = NULL,
};

/* ---- MLP ------------------------------------------------------------------------------------- */

static int mlp_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                       fsdp_tensor_t **out) {
    const struct mlp *p = fsdp_module_impl(m);
    fsdp_tensor_t *a = NULL, *g = NULL, *c = NULL;
    int rc = fsdp__module_check_io(m, nin, in, 1, 1, nout, 1);
    if (rc < 0) return rc;
    out[0] = NULL;
    FSDP_TRY(rc, fail, fsdp_module_forward1(p->c_fc, in[0], &a));
    FSDP_TRY(rc, fail, fsdp_gelu(a, FSDP_GELU_TANH, &g));
    FSDP_TRY(rc, fail, fsdp_module_forward1(p->c_proj, g, &c));
    FSDP_TRY(rc, fail, fsdp_dropout(c, p->dropout, fsdp_module_is_training(m), out));
fail:
    fsdp_tensor_release(a);
    fsdp_tensor_release(g);
    fsdp_tensor_release(c);
    return rc;
}

static const fsdp_module_ops_t mlp_ops = {
    .type = "MLP",
    .forward = mlp_forward,
    .destroy = NULL,
};

/* ---- GPTBlock -------------------------------------------------------------------------------- */

/* Inputs: x (B, T, d)[, mask]: x + attn(ln_1(x)), then + mlp(ln_2(.)). */
static int block_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                         fsdp_tensor_t **out) {
    const struct block *bl = fsdp_module_impl(m);
    fsdp_tensor_t *h = NULL, *a = NULL, *x1 = NULL, *h2 = NULL, *f = NULL;
    int rc = fsdp__module_check_io(m, nin, in, 1, 2, nout, 1);
    if (rc < 0) return rc;
    out[0] = NULL;
    FSDP_TRY(rc, fail, fsdp_module_forward1(bl->ln_1, in[0], &h));
    fsdp_tensor_t *ain[2] = {h, nin > 1 ? in[1] : NULL};
    FSDP_TRY(rc, fail, fsdp_module_forward(bl->attn, ain[1] ? 2 : 1, ain, 1, &a));
    FSDP_TRY(rc, fail, fsdp_add(in[0], a, &x1));
    FSDP_TRY(rc, fail, fsdp_module_forward1(bl->ln_2, x1, &h2));
    FSDP_TRY(rc, fail, fsdp_module_forward1(bl->mlp, h2, &f));
    FSDP_TRY(rc, fail, fsdp_add(x1, f, out));
fail:
    fsdp_tensor_release(h);
    fsdp_tensor_release(a);
    fsdp_tensor_release(x1);
    fsdp_tensor_release(h2);
    fsdp_tensor_release(f);
    return rc;
}

static const fsdp_module_ops_t block_ops = {
    .type = "GPTBlock",
    .forward = block_forward,
    .destroy = NULL,
};

static int block_create(fsdp_ctx_t *ctx, const fsdp_gpt_config_t *cfg, fsdp_module_t **out) {
    fsdp_module_t *m = NULL, *c = NULL, *sub = NULL;
    struct block *bl = NULL;
    struct csa *a = NULL;
    struct mlp *p = NULL;
    int64_t d = cfg->d_model;
    double eps = cfg->layer_norm_eps;
    int rc;
    *out = NULL;
    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &block_ops, sizeof *bl, &m, (void **)&bl));
    FSDP_TRY(rc, fail, fsdp_layernorm_create(ctx, d, eps, true, &c));
    FSDP_TRY(rc, fail, adopt(m, "ln_1", c, &bl->ln_1));

    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &csa_ops, sizeof *a, &sub, (void **)&a));
    FSDP_TRY(rc, fail, adopt(m, "attn", sub, &bl->attn));
    a->d = d;
    a->h = cfg->n_head;
    a->dropout = cfg->dropout;
    FSDP_TRY(rc, fail, fsdp_linear_create(ctx, d, 3 * d, true, &c));
    FSDP_TRY(rc, fail, adopt(bl->attn, "c_attn", c, &a->c_attn));
    FSDP_TRY(rc, fail, fsdp_linear_create(ctx, d, d, true, &c));
    FSDP_TRY(rc, fail, adopt(bl->attn, "c_proj", c, &a->c_proj));

    FSDP_TRY(rc, fail, fsdp_layernorm_create(ctx, d, eps, true, &c));
    FSDP_TRY(rc, fail, adopt(m, "ln_2", c, &bl->ln_2));

    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &mlp_ops, sizeof *p, &sub, (void **)&p));
    FSDP_TRY(rc, fail, adopt(m, "mlp", sub, &bl->mlp));
    p->dropout = cfg->dropout;
    FSDP_TRY(rc, fail, fsdp_linear_create(ctx, d, cfg->d_ff, true, &c));
    FSDP_TRY(rc, fail, adopt(bl->mlp, "c_fc", c, &p->c_fc));
    FSDP_TRY(rc, fail, fsdp_linear_create(ctx, cfg->d_ff, d, true, &c));
    FSDP_TRY(rc, fail, adopt(bl->mlp, "c_proj", c, &p->c_proj));
    *out = m;
    return FSDP_OK;
fail:
    fsdp_module_release(m);
    return rc;
}

/* ---- GPT ------------------------------------------------------------------------------------- */

/* Makes g->pos and g->mask fit a sequence of length t in dtype dt on dev. */
static int gpt_cache(struct gpt *g, fsdp_ctx_t *ctx, int64_t t, fsdp_dtype_t dt,
                     fsdp_device_t *dev) {
    int64_t *host = NULL;
    int rc = FSDP_OK;
    if (!g->pos || fsdp_tensor_size(g->pos, 0) != t || fsdp_tensor_device(g->pos) != dev) {
        fsdp_tensor_release(g->pos);
        g->pos = NULL;
        FSDP_TRY(rc, fail,
                 fsdp_mem_alloc(ctx, FSDP_MEM_OTHER, (size_t)t * sizeof *host, (void **)&host));
        for (int64_t i = 0; i < t; i++)
            host[i] = i;
        FSDP_TRY(rc, fail,
                 fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, 1, &t, host, FSDP_MEM_OTHER, &g->pos));
    }
    if (!g->mask || fsdp_tensor_size(g->mask, 0) != t || fsdp_tensor_dtype(g->mask) != dt ||
        fsdp_tensor_device(g->mask) != dev) {
        fsdp_tensor_release(g->mask);
        g->mask = NULL;
        /* Not recorded: the mask outlives this forward's tape. */
        bool was = fsdp_set_grad_enabled(ctx, false);
        rc = make_mask(ctx, t, dt, &g->mask);
        fsdp_set_grad_enabled(ctx, was);
        if (rc < 0) goto fail;
    }
fail:
    fsdp_mem_free(ctx, host);
    return rc;
}

/* Input: tokens (B, T). Output: logits (B, T, vocab). */
static int gpt_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                       fsdp_tensor_t **out) {
    struct gpt *g = fsdp_module_impl(m);
    fsdp_ctx_t *ctx = fsdp_module_ctx(m);
    fsdp_tensor_t *tok = NULL, *pe = NULL, *x = NULL, *y = NULL;
    int rc = fsdp__module_check_io(m, nin, in, 1, 1, nout, 1);
    if (rc < 0) return rc;
    out[0] = NULL;
    fsdp_tensor_t *tokens = in[0];
    fsdp_dtype_t tdt = fsdp_tensor_dtype(tokens);
    int64_t t = fsdp_tensor_size(tokens, 1);
    if (fsdp_tensor_ndim(tokens) != 2 || (tdt != FSDP_DTYPE_I64 && tdt != FSDP_DTYPE_I32) ||
        t < 1 || t > g->cfg.max_seq) {
        char d0[160];
        return fsdp__module_err(
            m, FSDP_EINVAL, "tokens %s must be (B, T) int64 or i32 with 1 <= T <= max_seq %lld",
            fsdp_tensor_describe(tokens, d0, sizeof d0), (long long)g->cfg.max_seq);
    }
    FSDP_TRY(rc, fail, fsdp_module_forward1(g->wte, tokens, &tok));
    FSDP_TRY(rc, fail, gpt_cache(g, ctx, t, fsdp_tensor_dtype(tok), fsdp_tensor_device(tok)));
    FSDP_TRY(rc, fail, fsdp_module_forward1(g->wpe, g->pos, &pe));
    FSDP_TRY(rc, fail, fsdp_add(tok, pe, &y));
    FSDP_TRY(rc, fail, fsdp_dropout(y, g->cfg.dropout, fsdp_module_is_training(m), &x));
    fsdp_tensor_release(y);
    y = NULL;
    size_t n = fsdp_module_num_children(g->h);
    for (size_t i = 0; i < n; i++) {
        fsdp_tensor_t *bin[2] = {x, g->mask};
        FSDP_TRY(rc, fail, fsdp_module_forward(fsdp_module_child_at(g->h, i, NULL), 2, bin, 1, &y));
        fsdp_tensor_release(x);
        x = y;
        y = NULL;
    }
    FSDP_TRY(rc, fail, fsdp_module_forward1(g->ln_f, x, &y));
    /* The head is the token embedding: logits = y wte^T. */
    FSDP_TRY(rc, fail, fsdp_linear(y, fsdp__module_param_at(g->wte, 0), NULL, out));
fail:
    fsdp_tensor_release(tok);
    fsdp_tensor_release(pe);
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    return rc;
}

static void gpt_destroy(void *impl) {
    struct gpt *g = impl;
    fsdp_tensor_release(g->mask);
    fsdp_tensor_release(g->pos);
    g->mask = g->pos = NULL;
}

static const fsdp_module_ops_t gpt_ops = {
    .type = "GPT",
    .forward = gpt_forward,
    .destroy = gpt_destroy,
};

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* GPT-2's initialisation over the parameters in order: matrices and embeddings normal(0, std)
 * (c_proj weights std / sqrt(2 n_layer)), biases zero; LayerNorm weights keep their ones. */
static int gpt_init_weights(fsdp_module_t *m, const fsdp_gpt_config_t *cfg) {
    fsdp_named_list_t list = {0};
    int rc = fsdp_module_named_params(m, false, &list);
    if (rc < 0) return rc;
    double proj_std = cfg->init_std / sqrt(2.0 * (double)cfg->n_layer);
    for (size_t i = 0; i < list.n && rc == 0; i++) {
        fsdp_tensor_t *t = list.tensors[i];
        if (fsdp_tensor_ndim(t) >= 2)
            rc = fsdp_tensor_normal_(
                t, 0.0, ends_with(list.names[i], "c_proj.weight") ? proj_std : cfg->init_std);
        else if (ends_with(list.names[i], "bias"))
            rc = fsdp_tensor_zero_(t);
    }
    fsdp_named_list_free(&list);
    return rc;
}

int fsdp_gpt_create(fsdp_ctx_t *ctx, const fsdp_gpt_config_t *cfg, fsdp_module_t **m) {
    fsdp_module_t *mod = NULL, *c = NULL;
    struct gpt *g = NULL;
    int rc;
    if (!m) return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_gpt_create: m is NULL");
    *m = NULL;
    if (!ctx) return FSDP_EINVAL;
    if (!cfg) return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_gpt_create: cfg is NULL");
    if ((rc = fsdp__abi_check(ctx, "fsdp_gpt_create", "cfg", cfg, &config_abi)) < 0) return rc;
    if (cfg->vocab <= 0 || cfg->max_seq <= 0 || cfg->n_layer < 0 || cfg->n_head <= 0 ||
        cfg->d_model <= 0 || cfg->d_model % cfg->n_head != 0 || cfg->d_ff < 0)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_gpt_create: vocab %lld, max_seq %lld, n_head %lld and d_model "
                             "%lld must be positive, n_layer %lld and d_ff %lld not negative, and "
                             "n_head must divide d_model",
                             (long long)cfg->vocab, (long long)cfg->max_seq, (long long)cfg->n_head,
                             (long long)cfg->d_model, (long long)cfg->n_layer,
                             (long long)cfg->d_ff);
    if (!(cfg->dropout >= 0.0 && cfg->dropout < 1.0) || !(cfg->layer_norm_eps > 0.0) ||
        !(cfg->init_std >= 0.0))
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_gpt_create: dropout %g must be in [0, 1), layer_norm_eps %g "
                             "positive and init_std %g not negative",
                             cfg->dropout, cfg->layer_norm_eps, cfg->init_std);
    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &gpt_ops, sizeof *g, &mod, (void **)&g));
    fsdp_gpt_config_init(&g->cfg);
    fsdp__abi_copy_in(&g->cfg, cfg, &config_abi);
    if (g->cfg.d_ff == 0) g->cfg.d_ff = 4 * cfg->d_model;
    FSDP_TRY(rc, fail, fsdp_embedding_create(ctx, cfg->vocab, cfg->d_model, -1, &c));
    FSDP_TRY(rc, fail, adopt(mod, "wte", c, &g->wte));
    FSDP_TRY(rc, fail, fsdp_embedding_create(ctx, cfg->max_seq, cfg->d_model, -1, &c));
    FSDP_TRY(rc, fail, adopt(mod, "wpe", c, &g->wpe));
    FSDP_TRY(rc, fail, fsdp_modulelist_create(ctx, &c));
    FSDP_TRY(rc, fail, adopt(mod, "h", c, &g->h));
    for (int64_t i = 0; i < cfg->n_layer; i++) {
        FSDP_TRY(rc, fail, block_create(ctx, &g->cfg, &c));
        rc = fsdp_module_append(g->h, c);
        fsdp_module_release(c);
        if (rc < 0) goto fail;
    }
    FSDP_TRY(rc, fail, fsdp_layernorm_create(ctx, cfg->d_model, cfg->layer_norm_eps, true, &c));
    FSDP_TRY(rc, fail, adopt(mod, "ln_f", c, &g->ln_f));
    FSDP_TRY(rc, fail, gpt_init_weights(mod, &g->cfg));
    *m = mod;
    return FSDP_OK;
fail:
    fsdp_module_release(mod);
    return rc;
}

const fsdp_gpt_config_t *fsdp_gpt_get_config(const fsdp_module_t *m) {
    if (!m || fsdp_module_ops(m) != &gpt_ops) return NULL;
    const struct gpt *g = fsdp_module_impl(m);
    return &g->cfg;
}

int fsdp_gpt_forward(fsdp_module_t *m, fsdp_tensor_t *tokens, fsdp_tensor_t **logits) {
    if (!m || !logits) return FSDP_EINVAL;
    *logits = NULL;
    if (fsdp_module_ops(m) != &gpt_ops)
        return fsdp__module_err(m, FSDP_EINVAL, "fsdp_gpt_forward: not a GPT");
    return fsdp_module_forward(m, 1, &tokens, 1, logits);
}

int fsdp_gpt_loss(fsdp_tensor_t *logits, fsdp_tensor_t *targets, fsdp_tensor_t **loss) {
    fsdp_ctx_t *ctx = logits ? fsdp_tensor_ctx(logits) : NULL;
    fsdp_tensor_t *l2 = NULL, *t1 = NULL;
    char d0[160], d1[160];
    int rc;
    if (!loss) return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_gpt_loss: loss is NULL");
    *loss = NULL;
    if (!logits || !targets)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_gpt_loss: logits and targets are required");
    const int64_t *ls = fsdp_tensor_shape(logits), *ts = fsdp_tensor_shape(targets);
    if (fsdp_tensor_ndim(logits) != 3 || fsdp_tensor_ndim(targets) != 2 || ls[0] != ts[0] ||
        ls[1] != ts[1])
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_gpt_loss: logits %s and targets %s must be (B, T, V) and (B, T)",
                             fsdp_tensor_describe(logits, d0, sizeof d0),
                             fsdp_tensor_describe(targets, d1, sizeof d1));
    const int64_t s2[2] = {ls[0] * ls[1], ls[2]}, s1[1] = {ts[0] * ts[1]};
    FSDP_TRY(rc, fail, fsdp_reshape(logits, 2, s2, &l2));
    FSDP_TRY(rc, fail, fsdp_reshape(targets, 1, s1, &t1));
    FSDP_TRY(rc, fail, fsdp_cross_entropy(l2, t1, -1, FSDP_REDUCTION_MEAN, 0.0, loss));
fail:
    fsdp_tensor_release(l2);
    fsdp_tensor_release(t1);
    return rc;
}

int fsdp_gpt_forward_loss(fsdp_module_t *m, fsdp_tensor_t *tokens, fsdp_tensor_t *targets,
                          fsdp_tensor_t **loss, fsdp_tensor_t **logits) {
    fsdp_tensor_t *lg = NULL;
    int rc;
    if (logits) *logits = NULL;
    if (!loss) return FSDP_EINVAL;
    *loss = NULL;
    FSDP_TRY(rc, fail, fsdp_gpt_forward(m, tokens, &lg));
    FSDP_TRY(rc, fail, fsdp_gpt_loss(lg, targets, loss));
    if (logits) {
        *logits = lg;
        lg = NULL;
    }
fail:
    fsdp_tensor_release(lg);
    return rc;
}
