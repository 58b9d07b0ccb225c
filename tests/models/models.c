/* SPDX-License-Identifier: MIT */
/*
 * models.c: the seed test models declared in models.h.
 *
 * Every model is a tree of library layers under a root of a test-defined type; children are
 * added in PyTorch's registration order under PyTorch's attribute names, and layers are created
 * in PyTorch's construction order, so the random stream is consumed in the same order as
 * PyTorch's generator is (the values differ: another generator). Roots hold no impl: what a
 * forward needs it finds by name among the children and buffers.
 *
 * Each constructor builds into a local root and hands it to the caller only when everything
 * succeeded; on failure the partial tree is released.
 */
#include "models.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/autograd.h>
#include <fsdp/errno.h>
#include <fsdp/rng.h>

/* rc = call; on failure jump to label (named at the call site, as the library's FSDP_TRY). */
#define TRY(rc, label, call)                                                                       \
    do {                                                                                           \
        (rc) = (call);                                                                             \
        if ((rc) < 0) goto label;                                                                  \
    } while (0)

void tm_manual_seed(fsdp_ctx_t *ctx, uint64_t seed) {
    fsdp_rng_init(fsdp_ctx_rng(ctx), seed, 0);
}

int tm_sum_loss(fsdp_tensor_t *out, fsdp_tensor_t **loss) {
    return fsdp_sum(out, 0, NULL, false, loss);
}

/* ---- building blocks ------------------------------------------------------------------------- */

/* Adds child to parent under name (NULL: the next index, for Sequential and ModuleList) and
 * drops the caller's reference to it, whether or not the add succeeded. */
static int adopt(fsdp_module_t *parent, const char *name, fsdp_module_t *child) {
    int rc = name ? fsdp_module_add_child(parent, name, child) : fsdp_module_append(parent, child);
    fsdp_module_release(child);
    return rc;
}

static int add_linear(fsdp_module_t *parent, const char *name, int64_t in, int64_t out, bool bias) {
    fsdp_module_t *l = NULL;
    int rc = fsdp_linear_create(fsdp_module_ctx(parent), in, out, bias, &l);
    if (rc < 0) return rc;
    return adopt(parent, name, l);
}

/* Same, with every parameter of the new Linear frozen (requires_grad false). */
static int add_frozen_linear(fsdp_module_t *parent, const char *name, int64_t in, int64_t out,
                             bool bias) {
    fsdp_module_t *l = NULL;
    int rc = fsdp_linear_create(fsdp_module_ctx(parent), in, out, bias, &l);
    if (rc < 0) return rc;
    rc = fsdp_module_requires_grad_(l, false);
    if (rc < 0) {
        fsdp_module_release(l);
        return rc;
    }
    return adopt(parent, name, l);
}

static int add_frozen_layernorm(fsdp_module_t *parent, const char *name, int64_t dim) {
    fsdp_module_t *l = NULL;
    int rc = fsdp_layernorm_create(fsdp_module_ctx(parent), dim, 1e-5, true, &l);
    if (rc < 0) return rc;
    rc = fsdp_module_requires_grad_(l, false);
    if (rc < 0) {
        fsdp_module_release(l);
        return rc;
    }
    return adopt(parent, name, l);
}

static int add_batchnorm(fsdp_module_t *parent, const char *name, int spatial, int64_t c) {
    fsdp_module_t *b = NULL;
    int rc = fsdp_batchnorm_create(fsdp_module_ctx(parent), spatial, c, 1e-5, 0.1, &b);
    if (rc < 0) return rc;
    return adopt(parent, name, b);
}

static int check_io(int nin, fsdp_tensor_t *const *in, int want_in, int nout, int want_out) {
    if (nin != want_in || nout != want_out) return FSDP_EINVAL;
    for (int i = 0; i < nin; i++)
        if (!in[i]) return FSDP_EINVAL;
    return FSDP_OK;
}

/* Forward of a root whose only computation is its child `module` (NestedWrappedModule,
 * MixtureOfExperts, ToyModel's `net`, IgnoredModule's `l`): the child's name is the ops' impl
 * convention below. */
static int forward_child(fsdp_module_t *m, const char *child, int nin, fsdp_tensor_t *const *in,
                         int nout, fsdp_tensor_t **out) {
    int rc = check_io(nin, in, 1, nout, 1);
    if (rc < 0) return rc;
    fsdp_module_t *c = fsdp_module_child(m, child);
    if (!c) return FSDP_EINVAL;
    return fsdp_module_forward1(c, in[0], out);
}

static int module_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                          fsdp_tensor_t **out) {
    return forward_child(m, "module", nin, in, nout, out);
}

static int net_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                       fsdp_tensor_t **out) {
    return forward_child(m, "net", nin, in, nout, out);
}

static int l_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                     fsdp_tensor_t **out) {
    return forward_child(m, "l", nin, in, nout, out);
}

/* Runs the named children of m one after the other on a single tensor. */
static int forward_chain(fsdp_module_t *m, const char *const *names, int n, fsdp_tensor_t *x,
                         fsdp_tensor_t **out) {
    int rc = FSDP_OK;
    fsdp_tensor_t *cur = fsdp_tensor_retain(x);
    *out = NULL;
    for (int i = 0; i < n; i++) {
        fsdp_module_t *c = fsdp_module_child(m, names[i]);
        fsdp_tensor_t *next = NULL;
        if (!c) {
            rc = FSDP_EINVAL;
            goto out;
        }
        TRY(rc, out, fsdp_module_forward1(c, cur, &next));
        fsdp_tensor_release(cur);
        cur = next;
    }
    *out = cur;
    cur = NULL;
out:
    fsdp_tensor_release(cur);
    return rc;
}

/* Creates a root of the given type with no impl. */
static int new_root(fsdp_ctx_t *ctx, const fsdp_module_ops_t *ops, fsdp_module_t **out) {
    return fsdp_module_create(ctx, ops, NULL, out);
}

/* ---- NestedWrappedModule --------------------------------------------------------------------- */

static const fsdp_module_ops_t nested_ops = {"NestedWrappedModule", module_forward, NULL};
static const fsdp_module_ops_t moe_ops = {"MixtureOfExperts", module_forward, NULL};

/* The Sequential `module` of NestedWrappedModule. */
static int build_nested_sequential(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_module_t *seq = NULL, *inner = NULL;
    int rc;
    *out = NULL;
    TRY(rc, fail, fsdp_sequential_create(ctx, &seq));
    TRY(rc, fail, add_linear(seq, NULL, 8, 4, true));
    TRY(rc, fail, fsdp_sequential_create(ctx, &inner));
    TRY(rc, fail, add_linear(inner, NULL, 4, 16, true));
    TRY(rc, fail, add_linear(inner, NULL, 16, 16, true));
    rc = adopt(seq, NULL, inner);
    inner = NULL;
    if (rc < 0) goto fail;
    TRY(rc, fail, add_linear(seq, NULL, 16, 4, true));
    TRY(rc, fail, add_linear(seq, NULL, 4, 8, true));
    *out = seq;
    return FSDP_OK;
fail:
    fsdp_module_release(inner);
    fsdp_module_release(seq);
    return rc;
}

int tm_nested_wrapped_create(fsdp_ctx_t *ctx, bool deterministic, fsdp_module_t **out) {
    fsdp_module_t *root = NULL, *seq = NULL;
    int rc;
    if (!out) return FSDP_EINVAL;
    *out = NULL;
    TRY(rc, fail, new_root(ctx, &nested_ops, &root));
    if (deterministic) tm_manual_seed(ctx, 0);
    TRY(rc, fail, build_nested_sequential(ctx, &seq));
    rc = adopt(root, "module", seq);
    if (rc < 0) goto fail;
    *out = root;
    return FSDP_OK;
fail:
    fsdp_module_release(root);
    return rc;
}

/* rand(4, 8) after seeding 1 + rank. */
static int rand_4x8(fsdp_ctx_t *ctx, fsdp_tensor_t **x) {
    static const int64_t shape[2] = {4, 8};
    if (!x) return FSDP_EINVAL;
    *x = NULL;
    tm_manual_seed(ctx, 1 + (uint64_t)fsdp_ctx_rank(ctx));
    fsdp_tensor_t *t = NULL;
    int rc = fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, shape, FSDP_MEM_ACTIVATIONS, &t);
    if (rc < 0) return rc;
    rc = fsdp_tensor_uniform_(t, 0.0, 1.0);
    if (rc < 0) {
        fsdp_tensor_release(t);
        return rc;
    }
    *x = t;
    return FSDP_OK;
}

int tm_nested_wrapped_get_input(fsdp_ctx_t *ctx, fsdp_tensor_t **x) {
    return rand_4x8(ctx, x);
}

const char *const *tm_nested_wrapped_units(void) {
    static const char *const units[] = {"module.1", "module.1.0", "module.2", NULL};
    return units;
}

/* ---- MixtureOfExperts
 * ------------------------------------------------------------------------------ */

int tm_moe_create(fsdp_ctx_t *ctx, bool deterministic, fsdp_module_t **out) {
    fsdp_module_t *root = NULL, *discard = NULL, *seq = NULL, *expert = NULL, *shared = NULL;
    int rc;
    if (!out) return FSDP_EINVAL;
    *out = NULL;
    TRY(rc, fail, new_root(ctx, &moe_ops, &root));
    /* Upstream's super().__init__() builds a NestedWrappedModule first (seeded 0) and replaces
     * it; building and dropping one keeps the random stream where PyTorch's generator is. */
    if (deterministic) tm_manual_seed(ctx, 0);
    TRY(rc, fail, build_nested_sequential(ctx, &discard));
    fsdp_module_release(discard);
    discard = NULL;
    if (deterministic) tm_manual_seed(ctx, 42 + (uint64_t)fsdp_ctx_rank(ctx));
    TRY(rc, fail, fsdp_linear_create(ctx, 23, 12, true, &expert));
    if (deterministic) tm_manual_seed(ctx, 0);
    TRY(rc, fail, fsdp_linear_create(ctx, 12, 23, true, &shared));
    TRY(rc, fail, fsdp_sequential_create(ctx, &seq));
    TRY(rc, fail, add_linear(seq, NULL, 8, 12, true));
    rc = adopt(seq, NULL, shared);
    shared = NULL;
    if (rc < 0) goto fail;
    rc = adopt(seq, NULL, expert);
    expert = NULL;
    if (rc < 0) goto fail;
    TRY(rc, fail, add_linear(seq, NULL, 12, 8, true));
    rc = adopt(root, "module", seq);
    seq = NULL;
    if (rc < 0) goto fail;
    *out = root;
    return FSDP_OK;
fail:
    fsdp_module_release(expert);
    fsdp_module_release(shared);
    fsdp_module_release(seq);
    fsdp_module_release(root);
    return rc;
}

int tm_moe_get_input(fsdp_ctx_t *ctx, fsdp_tensor_t **x) {
    return rand_4x8(ctx, x);
}

bool tm_moe_is_expert_param(const fsdp_module_t *m, const fsdp_tensor_t *p) {
    if (!m || !p) return false;
    return p == fsdp_module_param(m, "module.2.weight") ||
           p == fsdp_module_param(m, "module.2.bias");
}

bool tm_moe_is_expert_fqn(const char *fqn) {
    static const char *const wrappers[] = {"_fsdp_wrapped_module.", "_checkpoint_wrapped_module."};
    char clean[512];
    size_t o = 0;
    if (!fqn) return false;
    const char *p = fqn;
    while (*p) {
        bool skipped = false;
        for (size_t w = 0; w < sizeof wrappers / sizeof wrappers[0]; w++) {
            size_t n = strlen(wrappers[w]);
            /* Only whole segments: at the start or right after a dot. */
            if ((p == fqn || p[-1] == '.') && strncmp(p, wrappers[w], n) == 0) {
                p += n;
                skipped = true;
                break;
            }
        }
        if (skipped) continue;
        if (o + 1 >= sizeof clean) return false;
        clean[o++] = *p++;
    }
    clean[o] = 0;
    return strcmp(clean, "module.2.weight") == 0 || strcmp(clean, "module.2.bias") == 0;
}

const char *const *tm_moe_units(void) {
    static const char *const units[] = {"module.1", "module.2", NULL};
    return units;
}

int tm_moe_run_backward(fsdp_module_t *m, fsdp_tensor_t *loss, fsdp_pg_t *pg) {
    fsdp_named_list_t params = {0};
    int rc = fsdp_backward(loss, NULL);
    if (rc < 0 || !pg || fsdp_pg_size(pg) <= 1) return rc;
    fsdp_ctx_t *ctx = fsdp_module_ctx(m);
    bool was = fsdp_set_grad_enabled(ctx, false);
    double inv = 1.0 / (double)fsdp_pg_size(pg);
    TRY(rc, out, fsdp_module_named_params(m, false, &params));
    for (size_t i = 0; i < params.n; i++) {
        fsdp_tensor_t *p = params.tensors[i], *g = fsdp_tensor_grad(p), *scaled = NULL;
        if (tm_moe_is_expert_param(m, p)) continue; /* these need no reduction */
        if (!g || !fsdp_tensor_is_contiguous(g)) {
            rc = FSDP_EINVAL; /* upstream's p.grad.div_ would fail on a missing gradient too */
            goto out;
        }
        TRY(rc, out, fsdp_scale(g, inv, &scaled));
        rc = fsdp_tensor_copy_(g, scaled);
        fsdp_tensor_release(scaled);
        if (rc < 0) goto out;
        TRY(rc, out,
            fsdp_pg_all_reduce(pg, fsdp_tensor_data(g), fsdp_tensor_data(g),
                               (size_t)fsdp_tensor_numel(g), fsdp_tensor_dtype(g), FSDP_REDOP_SUM,
                               NULL));
    }
out:
    fsdp_named_list_free(&params);
    fsdp_set_grad_enabled(ctx, was);
    return rc;
}

/* ---- TransformerWithSharedParams ------------------------------------------------------------- */

static int twsp_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                        fsdp_tensor_t **out) {
    fsdp_tensor_t *e = NULL, *eb = NULL, *lb = NULL, *src = NULL, *te = NULL, *tgt = NULL,
                  *x = NULL;
    int rc = check_io(nin, in, 2, nout, 1);
    if (rc < 0) return rc;
    fsdp_module_t *embed = fsdp_module_child(m, "embed_tokens");
    fsdp_module_t *tr = fsdp_module_child(m, "transformer");
    fsdp_module_t *proj = fsdp_module_child(m, "output_proj");
    fsdp_module_t *bn = fsdp_module_child(m, "bn");
    fsdp_tensor_t *vocab_bias = fsdp_module_buffer(m, "vocab_bias");
    fsdp_tensor_t *long_buffer = fsdp_module_buffer(m, "long_buffer");
    if (!embed || !tr || !proj || !bn || !vocab_bias || !long_buffer) return FSDP_EINVAL;
    /* src = embed(src) + vocab_bias + long_buffer.type_as(src) */
    TRY(rc, out, fsdp_module_forward1(embed, in[0], &e));
    TRY(rc, out, fsdp_add(e, vocab_bias, &eb));
    TRY(rc, out, fsdp_to_dtype(long_buffer, fsdp_tensor_dtype(eb), &lb));
    TRY(rc, out, fsdp_add(eb, lb, &src));
    /* tgt = bn(embed(tgt)) */
    TRY(rc, out, fsdp_module_forward1(embed, in[1], &te));
    TRY(rc, out, fsdp_module_forward1(bn, te, &tgt));
    TRY(rc, out, fsdp_transformer_forward(tr, src, tgt, NULL, NULL, NULL, NULL, NULL, NULL, &x));
    TRY(rc, out, fsdp_module_forward1(proj, x, &out[0]));
out:
    fsdp_tensor_release(e);
    fsdp_tensor_release(eb);
    fsdp_tensor_release(lb);
    fsdp_tensor_release(src);
    fsdp_tensor_release(te);
    fsdp_tensor_release(tgt);
    fsdp_tensor_release(x);
    return rc;
}

static const fsdp_module_ops_t twsp_ops = {"TransformerWithSharedParams", twsp_forward, NULL};

int tm_transformer_create(fsdp_ctx_t *ctx, bool add_bn, bool deterministic, fsdp_module_t **out) {
    static const int64_t d_shape[1] = {TM_TRANSFORMER_D_MODEL};
    fsdp_module_t *root = NULL, *c = NULL;
    fsdp_tensor_t *buf = NULL;
    fsdp_transformer_config_t cfg;
    int rc;
    if (!out) return FSDP_EINVAL;
    *out = NULL;
    TRY(rc, fail, new_root(ctx, &twsp_ops, &root));
    if (deterministic) tm_manual_seed(ctx, 0);
    TRY(rc, fail, fsdp_embedding_create(ctx, TM_TRANSFORMER_VOCAB, TM_TRANSFORMER_D_MODEL, -1, &c));
    rc = adopt(root, "embed_tokens", c);
    if (rc < 0) goto fail;
    fsdp_transformer_config_init(&cfg);
    cfg.d_model = TM_TRANSFORMER_D_MODEL;
    /* nhead stays PyTorch's default 8: upstream does not pass it. */
    cfg.num_encoder_layers = 2;
    cfg.num_decoder_layers = 2;
    cfg.dim_feedforward = 8;
    cfg.dropout = 0.1;
    TRY(rc, fail, fsdp_transformer_create(ctx, &cfg, &c));
    rc = adopt(root, "transformer", c);
    if (rc < 0) goto fail;
    /* output_proj is created (drawing its own weight, as PyTorch does) and then its weight is
     * replaced by the embedding's: one tensor under two names. */
    TRY(rc, fail, fsdp_linear_create(ctx, TM_TRANSFORMER_D_MODEL, TM_TRANSFORMER_VOCAB, true, &c));
    rc = fsdp_module_set_param(c, "weight", fsdp_module_param(root, "embed_tokens.weight"), false);
    if (rc < 0) {
        fsdp_module_release(c);
        goto fail;
    }
    rc = adopt(root, "output_proj", c);
    if (rc < 0) goto fail;
    TRY(rc, fail, fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 1, d_shape, 1.0, FSDP_MEM_PARAMS, &buf));
    rc = fsdp_module_add_buffer(root, "vocab_bias", buf, true);
    fsdp_tensor_release(buf);
    if (rc < 0) goto fail;
    TRY(rc, fail, fsdp_tensor_zeros(ctx, FSDP_DTYPE_I64, 1, d_shape, FSDP_MEM_PARAMS, &buf));
    rc = fsdp_module_add_buffer(root, "long_buffer", buf, true);
    fsdp_tensor_release(buf);
    if (rc < 0) goto fail;
    if (add_bn) {
        TRY(rc, fail, add_batchnorm(root, "bn", 1, 2));
    } else {
        TRY(rc, fail, fsdp_identity_create(ctx, &c));
        rc = adopt(root, "bn", c);
        if (rc < 0) goto fail;
    }
    if (deterministic) fsdp_module_train(root, false);
    *out = root;
    return FSDP_OK;
fail:
    fsdp_module_release(root);
    return rc;
}

int tm_transformer_get_input(fsdp_ctx_t *ctx, fsdp_tensor_t **src, fsdp_tensor_t **tgt) {
    static const int64_t src_shape[2] = {6, 2}, tgt_shape[2] = {4, 2};
    int64_t ids[12];
    int rc;
    if (!src || !tgt) return FSDP_EINVAL;
    *src = *tgt = NULL;
    tm_manual_seed(ctx, 1 + (uint64_t)fsdp_ctx_rank(ctx));
    for (int i = 0; i < 12; i++)
        ids[i] = i;
    rc = fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, 2, src_shape, ids, FSDP_MEM_ACTIVATIONS, src);
    if (rc < 0) return rc;
    rc = fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, 2, tgt_shape, ids, FSDP_MEM_ACTIVATIONS, tgt);
    if (rc < 0) {
        fsdp_tensor_release(*src);
        *src = NULL;
    }
    return rc;
}

int tm_transformer_forward(fsdp_module_t *m, fsdp_tensor_t *src, fsdp_tensor_t *tgt,
                           fsdp_tensor_t **out) {
    fsdp_tensor_t *in[2] = {src, tgt};
    return fsdp_module_forward(m, 2, in, 1, out);
}

int tm_transformer_loss(fsdp_tensor_t *tgt, fsdp_tensor_t *out, fsdp_tensor_t **loss) {
    fsdp_tensor_t *logits = NULL, *target = NULL;
    const int64_t lshape[2] = {-1, fsdp_tensor_size(out, -1)}, tshape[1] = {-1};
    int rc;
    TRY(rc, fail, fsdp_reshape(out, 2, lshape, &logits));
    TRY(rc, fail, fsdp_reshape(tgt, 1, tshape, &target));
    rc = fsdp_cross_entropy(logits, target, -100, FSDP_REDUCTION_SUM, 0.0, loss);
fail:
    fsdp_tensor_release(logits);
    fsdp_tensor_release(target);
    return rc;
}

const char *const *tm_transformer_units(void) {
    static const char *const units[] = {
        "transformer.encoder.layers.0", "transformer.encoder.layers.1",
        "transformer.decoder.layers.0", "transformer.decoder.layers.1", NULL};
    return units;
}

/* ---- TestFSDPUseOrigParamsWriteback.Model ---------------------------------------------------- */

static int writeback_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                             fsdp_tensor_t **out) {
    fsdp_tensor_t *z = NULL, *r = NULL;
    int rc = check_io(nin, in, 1, nout, 1);
    if (rc < 0) return rc;
    fsdp_module_t *lin1 = fsdp_module_child(m, "lin1"), *lin2 = fsdp_module_child(m, "lin2");
    if (!lin1 || !lin2) return FSDP_EINVAL;
    TRY(rc, out, fsdp_module_forward1(lin1, in[0], &z));
    TRY(rc, out, fsdp_relu(z, &r));
    TRY(rc, out, fsdp_module_forward1(lin2, r, &out[0]));
out:
    fsdp_tensor_release(z);
    fsdp_tensor_release(r);
    return rc;
}

static const fsdp_module_ops_t writeback_ops = {"Model", writeback_forward, NULL};

int tm_writeback_create(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_module_t *root = NULL;
    int rc;
    if (!out) return FSDP_EINVAL;
    *out = NULL;
    TRY(rc, fail, new_root(ctx, &writeback_ops, &root));
    tm_manual_seed(ctx, 42);
    TRY(rc, fail, add_linear(root, "lin1", 5, 5, true));
    TRY(rc, fail, add_linear(root, "lin2", 5, 7, true));
    *out = root;
    return FSDP_OK;
fail:
    fsdp_module_release(root);
    return rc;
}

int tm_writeback_get_input(fsdp_ctx_t *ctx, fsdp_tensor_t **x) {
    static const int64_t shape[2] = {2, 5};
    if (!x) return FSDP_EINVAL;
    *x = NULL;
    fsdp_tensor_t *t = NULL;
    int rc = fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, shape, FSDP_MEM_ACTIVATIONS, &t);
    if (rc < 0) return rc;
    rc = fsdp_tensor_normal_(t, 0.0, 1.0);
    if (rc < 0) {
        fsdp_tensor_release(t);
        return rc;
    }
    *x = t;
    return FSDP_OK;
}

/* ---- NestedSequentialModel
 * ----------------------------------------------------------------------- */

int tm_nested_sequential_create(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_module_t *seq = NULL, *inner = NULL;
    int rc;
    if (!out) return FSDP_EINVAL;
    *out = NULL;
    tm_manual_seed(ctx, 0);
    TRY(rc, fail, fsdp_sequential_create(ctx, &seq));
    TRY(rc, fail, add_linear(seq, NULL, 5, 5, true));
    TRY(rc, fail, add_linear(seq, NULL, 5, 5, true));
    TRY(rc, fail, fsdp_sequential_create(ctx, &inner));
    TRY(rc, fail, add_linear(inner, NULL, 5, 5, true));
    TRY(rc, fail, add_linear(inner, NULL, 5, 5, true));
    rc = adopt(seq, NULL, inner);
    inner = NULL;
    if (rc < 0) goto fail;
    *out = seq;
    return FSDP_OK;
fail:
    fsdp_module_release(inner);
    fsdp_module_release(seq);
    return rc;
}

/* ---- LoraModel
 * ------------------------------------------------------------------------------------ */

/* Structure-only types: no forward (fsdp_module_forward reports FSDP_ENOTSUP). */
static const fsdp_module_ops_t lora_model_ops = {"LoraModel", NULL, NULL};
static const fsdp_module_ops_t lora_decoder_ops = {"LoraDecoder", NULL, NULL};
static const fsdp_module_ops_t lora_attention_ops = {"LoraAttention", NULL, NULL};
static const fsdp_module_ops_t lora_mlp_ops = {"LoraMLP", NULL, NULL};

static int lora_attention_create(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_module_t *m = NULL;
    int rc;
    *out = NULL;
    TRY(rc, fail, new_root(ctx, &lora_attention_ops, &m));
    TRY(rc, fail, add_frozen_linear(m, "q_proj", 32, 32, false));
    TRY(rc, fail, add_linear(m, "lora_A", 32, 8, false));
    TRY(rc, fail, add_linear(m, "lora_B", 8, 32, false));
    TRY(rc, fail, add_frozen_linear(m, "k_proj", 32, 32, false));
    TRY(rc, fail, add_frozen_linear(m, "v_proj", 32, 32, false));
    TRY(rc, fail, add_frozen_linear(m, "o_proj", 32, 32, false));
    *out = m;
    return FSDP_OK;
fail:
    fsdp_module_release(m);
    return rc;
}

static int lora_mlp_create(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_module_t *m = NULL;
    int rc;
    *out = NULL;
    TRY(rc, fail, new_root(ctx, &lora_mlp_ops, &m));
    TRY(rc, fail, add_frozen_linear(m, "proj1", 32, 128, false));
    TRY(rc, fail, add_frozen_linear(m, "proj2", 128, 32, false));
    *out = m;
    return FSDP_OK;
fail:
    fsdp_module_release(m);
    return rc;
}

static int lora_decoder_create(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_module_t *m = NULL, *c = NULL;
    int rc;
    *out = NULL;
    TRY(rc, fail, new_root(ctx, &lora_decoder_ops, &m));
    TRY(rc, fail, lora_attention_create(ctx, &c));
    rc = adopt(m, "attn", c);
    if (rc < 0) goto fail;
    TRY(rc, fail, lora_mlp_create(ctx, &c));
    rc = adopt(m, "mlp", c);
    if (rc < 0) goto fail;
    TRY(rc, fail, add_frozen_layernorm(m, "inp_layernorm", 32));
    TRY(rc, fail, add_frozen_layernorm(m, "post_attn_layernorm", 32));
    *out = m;
    return FSDP_OK;
fail:
    fsdp_module_release(m);
    return rc;
}

int tm_lora_create(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_module_t *root = NULL, *c = NULL, *layers = NULL;
    int rc;
    if (!out) return FSDP_EINVAL;
    *out = NULL;
    tm_manual_seed(ctx, 0);
    TRY(rc, fail, new_root(ctx, &lora_model_ops, &root));
    TRY(rc, fail, fsdp_embedding_create(ctx, 100, 32, -1, &c));
    rc = fsdp_module_requires_grad_(c, false);
    if (rc < 0) {
        fsdp_module_release(c);
        goto fail;
    }
    rc = adopt(root, "embed_tokens", c);
    if (rc < 0) goto fail;
    TRY(rc, fail, fsdp_modulelist_create(ctx, &layers));
    for (int i = 0; i < 4; i++) {
        TRY(rc, fail, lora_decoder_create(ctx, &c));
        rc = adopt(layers, NULL, c);
        if (rc < 0) goto fail;
    }
    rc = adopt(root, "layers", layers);
    layers = NULL;
    if (rc < 0) goto fail;
    TRY(rc, fail, add_frozen_layernorm(root, "norm", 32));
    *out = root;
    return FSDP_OK;
fail:
    fsdp_module_release(layers);
    fsdp_module_release(root);
    return rc;
}

/* ---- BatchNormNet
 * --------------------------------------------------------------------------------- */

static const fsdp_module_ops_t bnnet_ops = {"BatchNormNet", NULL, NULL};

int tm_batchnorm_net_create(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_module_t *root = NULL;
    int rc;
    if (!out) return FSDP_EINVAL;
    *out = NULL;
    tm_manual_seed(ctx, 0);
    TRY(rc, fail, new_root(ctx, &bnnet_ops, &root));
    TRY(rc, fail, add_linear(root, "lin", 10, 10, false));
    TRY(rc, fail, add_batchnorm(root, "bn1", 1, 10));
    TRY(rc, fail, add_batchnorm(root, "bn2", 2, 10));
    TRY(rc, fail, add_batchnorm(root, "bn3", 3, 10));
    TRY(rc, fail, add_batchnorm(root, "sync_bn", 1, 10)); /* SyncBatchNorm stand-in */
    *out = root;
    return FSDP_OK;
fail:
    fsdp_module_release(root);
    return rc;
}

/* ---- ModelWithIgnoredModule
 * ------------------------------------------------------------------------ */

static int ignored_model_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                                 fsdp_tensor_t **out) {
    static const char *const chain[] = {"l1", "ignored", "l2"};
    int rc = check_io(nin, in, 1, nout, 1);
    if (rc < 0) return rc;
    return forward_chain(m, chain, 3, in[0], &out[0]);
}

static const fsdp_module_ops_t ignored_module_ops = {"IgnoredModule", l_forward, NULL};
static const fsdp_module_ops_t ignored_model_ops = {"ModelWithIgnoredModule", ignored_model_forward,
                                                    NULL};

int tm_ignored_create(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_module_t *root = NULL, *ign = NULL;
    int rc;
    if (!out) return FSDP_EINVAL;
    *out = NULL;
    tm_manual_seed(ctx, 0);
    TRY(rc, fail, new_root(ctx, &ignored_model_ops, &root));
    TRY(rc, fail, add_linear(root, "l1", 100, 100, true));
    TRY(rc, fail, new_root(ctx, &ignored_module_ops, &ign));
    TRY(rc, fail, add_linear(ign, "l", 100, 100, true));
    rc = adopt(root, "ignored", ign);
    ign = NULL;
    if (rc < 0) goto fail;
    TRY(rc, fail, add_linear(root, "l2", 100, 100, true));
    *out = root;
    return FSDP_OK;
fail:
    fsdp_module_release(ign);
    fsdp_module_release(root);
    return rc;
}

/* ---- ToyModel
 * ------------------------------------------------------------------------------------- */

static const fsdp_module_ops_t toy_ops = {"ToyModel", net_forward, NULL};

int tm_toy_create(fsdp_ctx_t *ctx, int64_t in, int64_t hidden, int64_t out_features,
                  fsdp_module_t **out) {
    fsdp_module_t *root = NULL, *net = NULL, *relu = NULL;
    const int64_t dims[5] = {in, hidden, hidden, hidden, out_features};
    int rc;
    if (!out) return FSDP_EINVAL;
    *out = NULL;
    tm_manual_seed(ctx, 0);
    TRY(rc, fail, new_root(ctx, &toy_ops, &root));
    TRY(rc, fail, fsdp_sequential_create(ctx, &net));
    for (int i = 0; i < 4; i++) {
        TRY(rc, fail, add_linear(net, NULL, dims[i], dims[i + 1], true));
        TRY(rc, fail, fsdp_relu_create(ctx, &relu));
        rc = adopt(net, NULL, relu);
        if (rc < 0) goto fail;
    }
    rc = adopt(root, "net", net);
    net = NULL;
    if (rc < 0) goto fail;
    *out = root;
    return FSDP_OK;
fail:
    fsdp_module_release(net);
    fsdp_module_release(root);
    return rc;
}

/* ---- mixed-precision models
 * ------------------------------------------------------------------------ */

static void free_impl(void *impl) {
    free(impl);
}

/* SaveForwardInputsModule: impl is a bool, cast_forward_inputs. */
static int save_inputs_module_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                                      fsdp_tensor_t **out) {
    int rc = check_io(nin, in, 1, nout, 1);
    if (rc < 0) return rc;
    const bool *cast = fsdp_module_impl(m);
    fsdp_module_t *l = fsdp_module_child(m, "l");
    fsdp_tensor_t *w = l ? fsdp_module_param(l, "weight") : NULL;
    if (!w) return FSDP_EINVAL;
    if (!*cast || fsdp_tensor_dtype(in[0]) == fsdp_tensor_dtype(w))
        return fsdp_module_forward1(l, in[0], &out[0]);
    fsdp_tensor_t *x = NULL;
    TRY(rc, done, fsdp_to_dtype(in[0], fsdp_tensor_dtype(w), &x));
    rc = fsdp_module_forward1(l, x, &out[0]);
done:
    fsdp_tensor_release(x);
    return rc;
}

static int save_inputs_model_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                                     fsdp_tensor_t **out) {
    static const char *const chain[] = {"c1", "c2"};
    int rc = check_io(nin, in, 1, nout, 1);
    if (rc < 0) return rc;
    return forward_chain(m, chain, 2, in[0], &out[0]);
}

static const fsdp_module_ops_t save_inputs_module_ops = {"SaveForwardInputsModule",
                                                         save_inputs_module_forward, free_impl};
static const fsdp_module_ops_t save_inputs_model_ops = {"SaveForwardInputsModel",
                                                        save_inputs_model_forward, NULL};

int tm_save_inputs_create(fsdp_ctx_t *ctx, bool cast_forward_inputs, fsdp_module_t **out) {
    fsdp_module_t *root = NULL, *c = NULL;
    int rc;
    if (!out) return FSDP_EINVAL;
    *out = NULL;
    tm_manual_seed(ctx, 0);
    TRY(rc, fail, new_root(ctx, &save_inputs_model_ops, &root));
    for (int i = 0; i < 2; i++) {
        bool *cast = malloc(sizeof *cast);
        if (!cast) {
            rc = FSDP_ENOMEM;
            goto fail;
        }
        *cast = cast_forward_inputs;
        rc = fsdp_module_create(ctx, &save_inputs_module_ops, cast, &c);
        if (rc < 0) {
            free(cast);
            goto fail;
        }
        TRY(rc, fail, add_linear(c, "l", 100, 100, true));
        rc = adopt(root, i == 0 ? "c1" : "c2", c);
        c = NULL;
        if (rc < 0) goto fail;
    }
    *out = root;
    return FSDP_OK;
fail:
    fsdp_module_release(c);
    fsdp_module_release(root);
    return rc;
}

/* ToyModule.forward(x, y) = l(x). */
static int toy_module_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                              fsdp_tensor_t **out) {
    int rc = check_io(nin, in, 2, nout, 1);
    if (rc < 0) return rc;
    fsdp_module_t *l = fsdp_module_child(m, "l");
    if (!l) return FSDP_EINVAL;
    return fsdp_module_forward1(l, in[0], &out[0]);
}

static int external_inputs_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                                   fsdp_tensor_t **out) {
    int rc = check_io(nin, in, 1, nout, 1);
    if (rc < 0) return rc;
    fsdp_module_t *l1 = fsdp_module_child(m, "l1"), *l2 = fsdp_module_child(m, "l2");
    if (!l1 || !l2) return FSDP_EINVAL;
    const int64_t shape[2] = {fsdp_tensor_size(in[0], 0), 100};
    fsdp_tensor_t *args[2] = {NULL, NULL};
    TRY(rc, done, fsdp_module_forward1(l1, in[0], &args[0]));
    TRY(rc, done,
        fsdp_tensor_full(fsdp_module_ctx(m), FSDP_DTYPE_F32, 2, shape, 1.0, FSDP_MEM_ACTIVATIONS,
                         &args[1]));
    rc = fsdp_module_forward(l2, 2, args, 1, out);
done:
    fsdp_tensor_release(args[0]);
    fsdp_tensor_release(args[1]);
    return rc;
}

static const fsdp_module_ops_t toy_module_ops = {"ToyModule", toy_module_forward, NULL};
static const fsdp_module_ops_t external_inputs_ops = {"ToyModelWithExternalInputs",
                                                      external_inputs_forward, NULL};

int tm_external_inputs_create(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_module_t *root = NULL, *l2 = NULL;
    int rc;
    if (!out) return FSDP_EINVAL;
    *out = NULL;
    tm_manual_seed(ctx, 0);
    TRY(rc, fail, new_root(ctx, &external_inputs_ops, &root));
    TRY(rc, fail, add_linear(root, "l1", 100, 100, true));
    TRY(rc, fail, new_root(ctx, &toy_module_ops, &l2));
    TRY(rc, fail, add_linear(l2, "l", 100, 100, true));
    rc = adopt(root, "l2", l2);
    l2 = NULL;
    if (rc < 0) goto fail;
    *out = root;
    return FSDP_OK;
fail:
    fsdp_module_release(l2);
    fsdp_module_release(root);
    return rc;
}

static int ema_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                       fsdp_tensor_t **out) {
    return forward_child(m, fsdp_module_is_training(m) ? "module" : "ema_module", nin, in, nout,
                         out);
}

static const fsdp_module_ops_t ema_ops = {"ModelWithEMA", ema_forward, NULL};

/* Sequential(Linear(d, h), ReLU, Linear(h, d)) added to root under name. */
static int add_ema_branch(fsdp_module_t *root, const char *name, int64_t d, int64_t h) {
    fsdp_ctx_t *ctx = fsdp_module_ctx(root);
    fsdp_module_t *seq = NULL, *relu = NULL;
    int rc;
    TRY(rc, fail, fsdp_sequential_create(ctx, &seq));
    TRY(rc, fail, add_linear(seq, NULL, d, h, true));
    TRY(rc, fail, fsdp_relu_create(ctx, &relu));
    rc = adopt(seq, NULL, relu);
    if (rc < 0) goto fail;
    TRY(rc, fail, add_linear(seq, NULL, h, d, true));
    return adopt(root, name, seq);
fail:
    fsdp_module_release(seq);
    return rc;
}

int tm_ema_create(fsdp_ctx_t *ctx, int64_t d, int64_t h, fsdp_module_t **out) {
    fsdp_module_t *root = NULL;
    fsdp_named_list_t a = {0}, b = {0};
    int rc;
    if (!out) return FSDP_EINVAL;
    *out = NULL;
    tm_manual_seed(ctx, 0);
    TRY(rc, fail, new_root(ctx, &ema_ops, &root));
    TRY(rc, fail, add_ema_branch(root, "module", d, h));
    TRY(rc, fail, add_ema_branch(root, "ema_module", d, h));
    TRY(rc, fail, fsdp_module_named_params(fsdp_module_child(root, "module"), false, &a));
    TRY(rc, fail, fsdp_module_named_params(fsdp_module_child(root, "ema_module"), false, &b));
    if (a.n != b.n) {
        rc = FSDP_EINTERNAL;
        goto fail;
    }
    for (size_t i = 0; i < a.n; i++)
        TRY(rc, fail, fsdp_tensor_copy_(b.tensors[i], a.tensors[i]));
    fsdp_named_list_free(&a);
    fsdp_named_list_free(&b);
    *out = root;
    return FSDP_OK;
fail:
    fsdp_named_list_free(&a);
    fsdp_named_list_free(&b);
    fsdp_module_release(root);
    return rc;
}

/* ---- GPT
 * -------------------------------------------------------------------------------------------- */

void tm_gpt_tiny_config(fsdp_gpt_config_t *cfg) {
    fsdp_gpt_config_init(cfg);
    cfg->vocab = 64;
    cfg->max_seq = 16;
    cfg->n_layer = 2;
    cfg->n_head = 4;
    cfg->d_model = 16;
    cfg->d_ff = 64;
    cfg->dropout = 0.0;
    cfg->layer_norm_eps = 1e-5;
    cfg->init_std = 0.02;
}
