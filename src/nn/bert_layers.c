/* SPDX-License-Identifier: MIT */
/*
 * bert_layers.c: the modules of a BERT model below BertModel, as Hugging Face's modeling_bert.py
 * builds them: BertEmbeddings, BertSelfAttention, BertSelfOutput, BertAttention,
 * BertIntermediate, BertOutput, BertLayer, BertPooler, and the masked-LM head
 * (BertPredictionHeadTransform, BertLMPredictionHead, BertOnlyMLMHead).
 *
 * Each type registers its children in Hugging Face's order and under its names, so parameter
 * listings and state dicts match Hugging Face's key for key; children run through
 * fsdp_module_forward() so that their hooks fire. A module's impl holds borrowed pointers to its
 * children (the module holds the references; children are never replaced), and its forward
 * reads parameters and buffers through its children's slots at every call (FSDP may swap the
 * tensors). Dropout is a function call on the module's own training flag, not a child.
 *
 * Attention heads are never looped over: a projection's output (B, S, H) is viewed as
 * (B, S, heads, hd) and permuted to (B, heads, S, hd) for fsdp_attention's batched products; the
 * extended mask (B, 1, 1, S) is broadcast by its add. fsdp_attention scales q by 1/sqrt(hd)
 * before the product where Hugging Face divides the scores; the two differ by rounding only.
 */
#include <stdio.h>

#include "nn/bert_impl.h"
#include <fsdp/transformer.h>

int fsdp__bert_adopt(fsdp_module_t *m, const char *name, fsdp_module_t *child,
                     fsdp_module_t **slot) {
    int rc = fsdp_module_add_child(m, name, child);
    if (rc == 0 && slot) *slot = child;
    fsdp_module_release(child);
    return rc;
}

/* A Linear in -> out with bias registered under name. */
static int add_linear(fsdp_module_t *m, const char *name, int64_t in, int64_t out,
                      fsdp_module_t **slot) {
    fsdp_module_t *c = NULL;
    int rc = fsdp_linear_create(fsdp_module_ctx(m), in, out, true, &c);
    if (rc < 0) return rc;
    return fsdp__bert_adopt(m, name, c, slot);
}

/* A LayerNorm over hidden_size registered as "LayerNorm". */
static int add_layernorm(fsdp_module_t *m, const fsdp_bert_config_t *cfg, fsdp_module_t **slot) {
    fsdp_module_t *c = NULL;
    int rc =
        fsdp_layernorm_create(fsdp_module_ctx(m), cfg->hidden_size, cfg->layer_norm_eps, true, &c);
    if (rc < 0) return rc;
    return fsdp__bert_adopt(m, "LayerNorm", c, slot);
}

static bool is_index_dtype(fsdp_dtype_t dt) {
    return dt == FSDP_DTYPE_I64 || dt == FSDP_DTYPE_I32;
}

int fsdp__bert_check_ids(fsdp_module_t *m, const fsdp_bert_config_t *cfg, fsdp_tensor_t *ids,
                         fsdp_tensor_t *other, const char *other_name, bool other_is_ids) {
    char d0[160];
    int64_t s = fsdp_tensor_size(ids, 1);
    if (fsdp_tensor_ndim(ids) != 2 || !is_index_dtype(fsdp_tensor_dtype(ids)) || s < 1 ||
        s > cfg->max_position_embeddings)
        return fsdp__module_err(m, FSDP_EINVAL,
                                "input_ids %s must be (B, S) int64 or i32 with 1 <= S <= "
                                "max_position_embeddings %lld",
                                fsdp_tensor_describe(ids, d0, sizeof d0),
                                (long long)cfg->max_position_embeddings);
    if (!other) return FSDP_OK;
    if (fsdp_tensor_ndim(other) != 2 || fsdp_tensor_size(other, 0) != fsdp_tensor_size(ids, 0) ||
        fsdp_tensor_size(other, 1) != s ||
        (other_is_ids && !is_index_dtype(fsdp_tensor_dtype(other))))
        return fsdp__module_err(m, FSDP_EINVAL, "%s %s must be (B, S) = (%lld, %lld)%s", other_name,
                                fsdp_tensor_describe(other, d0, sizeof d0),
                                (long long)fsdp_tensor_size(ids, 0), (long long)s,
                                other_is_ids ? " int64 or i32, as input_ids" : ", as input_ids");
    return FSDP_OK;
}

/* ---- BertEmbeddings -------------------------------------------------------------------------- */

/* Buffer slots: 0 position_ids, 1 token_type_ids (both (1, max_position_embeddings) int64). */
struct embeddings {
    fsdp_bert_config_t cfg;
    fsdp_module_t *word, *position, *token_type, *norm;
};

/* The rows [0, s) of a (1, max_position_embeddings) buffer embedded by emb: (1, s, H). */
static int embed_prefix(fsdp_module_t *emb, fsdp_tensor_t *buffer, int64_t s, fsdp_tensor_t **out) {
    fsdp_tensor_t *ids = NULL;
    int rc = fsdp_narrow(buffer, 1, 0, s, &ids);
    if (rc == 0) rc = fsdp_module_forward1(emb, ids, out);
    fsdp_tensor_release(ids);
    return rc;
}

/* Inputs: input_ids[, token_type_ids]. */
static int embeddings_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                              fsdp_tensor_t **out) {
    const struct embeddings *e = fsdp_module_impl(m);
    fsdp_tensor_t *w = NULL, *t = NULL, *p = NULL, *wt = NULL, *x = NULL, *n = NULL;
    int rc = fsdp__module_check_io(m, nin, in, 1, 2, nout, 1);
    if (rc < 0) return rc;
    out[0] = NULL;
    fsdp_tensor_t *ids = in[0], *types = nin > 1 ? in[1] : NULL;
    FSDP_TRY(rc, fail, fsdp__bert_check_ids(m, &e->cfg, ids, types, "token_type_ids", true));
    int64_t s = fsdp_tensor_size(ids, 1);
    FSDP_TRY(rc, fail, fsdp_module_forward1(e->word, ids, &w));
    /* Hugging Face's order: (word + token_type) + position. Absent token types are the zeros of
     * the buffer, embedded once and broadcast over the batch. */
    if (types)
        FSDP_TRY(rc, fail, fsdp_module_forward1(e->token_type, types, &t));
    else
        FSDP_TRY(rc, fail, embed_prefix(e->token_type, fsdp__module_buffer_at(m, 1), s, &t));
    FSDP_TRY(rc, fail, fsdp_add(w, t, &wt));
    FSDP_TRY(rc, fail, embed_prefix(e->position, fsdp__module_buffer_at(m, 0), s, &p));
    FSDP_TRY(rc, fail, fsdp_add(wt, p, &x));
    FSDP_TRY(rc, fail, fsdp_module_forward1(e->norm, x, &n));
    FSDP_TRY(rc, fail,
             fsdp_dropout(n, e->cfg.hidden_dropout_prob, fsdp_module_is_training(m), out));
fail:
    fsdp_tensor_release(w);
    fsdp_tensor_release(t);
    fsdp_tensor_release(p);
    fsdp_tensor_release(wt);
    fsdp_tensor_release(x);
    fsdp_tensor_release(n);
    return rc;
}

static const fsdp_module_ops_t embeddings_ops = {
    .type = "BertEmbeddings",
    .forward = embeddings_forward,
    .destroy = NULL,
};

int fsdp__bert_embeddings_create(fsdp_ctx_t *ctx, const fsdp_bert_config_t *cfg,
                                 fsdp_module_t **out) {
    fsdp_module_t *m = NULL, *c = NULL;
    struct embeddings *e = NULL;
    fsdp_tensor_t *pos = NULL;
    int64_t *host = NULL;
    int64_t h = cfg->hidden_size, p = cfg->max_position_embeddings;
    int rc;
    *out = NULL;
    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &embeddings_ops, sizeof *e, &m, (void **)&e));
    e->cfg = *cfg;
    FSDP_TRY(rc, fail, fsdp_embedding_create(ctx, cfg->vocab_size, h, cfg->pad_token_id, &c));
    FSDP_TRY(rc, fail, fsdp__bert_adopt(m, "word_embeddings", c, &e->word));
    FSDP_TRY(rc, fail, fsdp_embedding_create(ctx, p, h, -1, &c));
    FSDP_TRY(rc, fail, fsdp__bert_adopt(m, "position_embeddings", c, &e->position));
    FSDP_TRY(rc, fail, fsdp_embedding_create(ctx, cfg->type_vocab_size, h, -1, &c));
    FSDP_TRY(rc, fail, fsdp__bert_adopt(m, "token_type_embeddings", c, &e->token_type));
    FSDP_TRY(rc, fail, add_layernorm(m, cfg, &e->norm));
    /* Hugging Face's non-persistent buffers: torch.arange(P).expand((1, -1)) and zeros (1, P). */
    const int64_t bs[2] = {1, p};
    FSDP_TRY(rc, fail,
             fsdp__module_new_buffer(m, "position_ids", FSDP_DTYPE_I64, 2, bs, 0.0, false, &pos));
    FSDP_TRY(rc, fail,
             fsdp_mem_alloc(ctx, FSDP_MEM_OTHER, (size_t)p * sizeof *host, (void **)&host));
    for (int64_t i = 0; i < p; i++)
        host[i] = i;
    FSDP_TRY(rc, fail, fsdp_tensor_copy_from_host(pos, host, (size_t)p * sizeof *host));
    FSDP_TRY(rc, fail,
             fsdp__module_new_buffer(m, "token_type_ids", FSDP_DTYPE_I64, 2, bs, 0.0, false, NULL));
    *out = m;
    m = NULL;
fail:
    fsdp_mem_free(ctx, host);
    fsdp_module_release(m);
    return rc;
}

/* ---- BertSelfAttention ----------------------------------------------------------------------- */

struct self_attn {
    fsdp_module_t *query, *key, *value;
    int64_t hidden, heads, hd;
    double dropout; /* attention_probs_dropout_prob */
};

/* (B, S, H) -> (B, heads, S, hd), a permuted view (transpose_for_scores). */
static int split_heads(const struct self_attn *a, fsdp_tensor_t *x, fsdp_tensor_t **out) {
    fsdp_tensor_t *v = NULL;
    const int64_t s4[4] = {fsdp_tensor_size(x, 0), fsdp_tensor_size(x, 1), a->heads, a->hd};
    const int perm[4] = {0, 2, 1, 3};
    int rc = fsdp_view(x, 4, s4, &v);
    if (rc == 0) rc = fsdp_permute(v, perm, out);
    fsdp_tensor_release(v);
    return rc;
}

/* Inputs: hidden (B, S, H)[, additive mask broadcastable to (B, heads, S, S)]. */
static int self_attn_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                             fsdp_tensor_t **out) {
    const struct self_attn *a = fsdp_module_impl(m);
    fsdp_tensor_t *proj[3] = {NULL, NULL, NULL}, *heads[3] = {NULL, NULL, NULL};
    fsdp_tensor_t *y = NULL, *yp = NULL;
    int rc = fsdp__module_check_io(m, nin, in, 1, 2, nout, 1);
    if (rc < 0) return rc;
    out[0] = NULL;
    fsdp_tensor_t *x = in[0], *mask = nin > 1 ? in[1] : NULL;
    if (fsdp_tensor_ndim(x) != 3 || fsdp_tensor_size(x, 2) != a->hidden) {
        char d0[160];
        return fsdp__module_err(m, FSDP_EINVAL, "hidden_states %s must be (B, S, %lld)",
                                fsdp_tensor_describe(x, d0, sizeof d0), (long long)a->hidden);
    }
    fsdp_module_t *lin[3] = {a->query, a->key, a->value};
    for (int i = 0; i < 3; i++) {
        FSDP_TRY(rc, fail, fsdp_module_forward1(lin[i], x, &proj[i]));
        FSDP_TRY(rc, fail, split_heads(a, proj[i], &heads[i]));
    }
    FSDP_TRY(rc, fail,
             fsdp_attention(heads[0], heads[1], heads[2], mask, NULL, a->dropout,
                            fsdp_module_is_training(m), &y));
    /* (B, heads, S, hd) -> (B, S, heads, hd) -> (B, S, H): the one copy that merges the heads. */
    const int perm[4] = {0, 2, 1, 3};
    FSDP_TRY(rc, fail, fsdp_permute(y, perm, &yp));
    const int64_t s3[3] = {fsdp_tensor_size(x, 0), fsdp_tensor_size(x, 1), a->hidden};
    FSDP_TRY(rc, fail, fsdp_reshape(yp, 3, s3, out));
fail:
    for (int i = 0; i < 3; i++) {
        fsdp_tensor_release(proj[i]);
        fsdp_tensor_release(heads[i]);
    }
    fsdp_tensor_release(y);
    fsdp_tensor_release(yp);
    return rc;
}

static const fsdp_module_ops_t self_attn_ops = {
    .type = "BertSelfAttention",
    .forward = self_attn_forward,
    .destroy = NULL,
};

/* ---- BertSelfOutput and BertOutput ----------------------------------------------------------- */

struct add_norm {
    fsdp_module_t *dense, *norm;
    double dropout; /* hidden_dropout_prob */
};

/* Inputs: hidden, input_tensor -> LayerNorm(dropout(dense(hidden)) + input_tensor). */
static int add_norm_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                            fsdp_tensor_t **out) {
    const struct add_norm *a = fsdp_module_impl(m);
    fsdp_tensor_t *d = NULL, *dd = NULL, *s = NULL;
    int rc = fsdp__module_check_io(m, nin, in, 2, 2, nout, 1);
    if (rc < 0) return rc;
    out[0] = NULL;
    FSDP_TRY(rc, fail, fsdp_module_forward1(a->dense, in[0], &d));
    FSDP_TRY(rc, fail, fsdp_dropout(d, a->dropout, fsdp_module_is_training(m), &dd));
    FSDP_TRY(rc, fail, fsdp_add(dd, in[1], &s));
    FSDP_TRY(rc, fail, fsdp_module_forward1(a->norm, s, out));
fail:
    fsdp_tensor_release(d);
    fsdp_tensor_release(dd);
    fsdp_tensor_release(s);
    return rc;
}

static const fsdp_module_ops_t self_output_ops = {
    .type = "BertSelfOutput",
    .forward = add_norm_forward,
    .destroy = NULL,
};

static const fsdp_module_ops_t output_ops = {
    .type = "BertOutput",
    .forward = add_norm_forward,
    .destroy = NULL,
};

/* A BertSelfOutput (in = hidden) or BertOutput (in = intermediate) registered under name. */
static int add_norm_create(fsdp_module_t *parent, const char *name, const fsdp_module_ops_t *ops,
                           const fsdp_bert_config_t *cfg, int64_t in, fsdp_module_t **slot) {
    fsdp_module_t *m = NULL;
    struct add_norm *a = NULL;
    int rc = fsdp__module_new(fsdp_module_ctx(parent), ops, sizeof *a, &m, (void **)&a);
    if (rc < 0) return rc;
    FSDP_TRY(rc, fail, fsdp__bert_adopt(parent, name, m, slot));
    a->dropout = cfg->hidden_dropout_prob;
    FSDP_TRY(rc, fail, add_linear(m, "dense", in, cfg->hidden_size, &a->dense));
    FSDP_TRY(rc, fail, add_layernorm(m, cfg, &a->norm));
fail:
    return rc;
}

/* ---- BertAttention --------------------------------------------------------------------------- */

struct attention {
    fsdp_module_t *self, *output;
};

/* Inputs: hidden[, mask] -> output(self(hidden, mask), hidden). */
static int attention_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                             fsdp_tensor_t **out) {
    const struct attention *a = fsdp_module_impl(m);
    fsdp_tensor_t *s = NULL;
    int rc = fsdp__module_check_io(m, nin, in, 1, 2, nout, 1);
    if (rc < 0) return rc;
    out[0] = NULL;
    fsdp_tensor_t *sin[2] = {in[0], nin > 1 ? in[1] : NULL};
    FSDP_TRY(rc, fail, fsdp_module_forward(a->self, sin[1] ? 2 : 1, sin, 1, &s));
    fsdp_tensor_t *oin[2] = {s, in[0]};
    FSDP_TRY(rc, fail, fsdp_module_forward(a->output, 2, oin, 1, out));
fail:
    fsdp_tensor_release(s);
    return rc;
}

static const fsdp_module_ops_t attention_ops = {
    .type = "BertAttention",
    .forward = attention_forward,
    .destroy = NULL,
};

static int attention_create(fsdp_module_t *parent, const fsdp_bert_config_t *cfg,
                            fsdp_module_t **slot) {
    fsdp_module_t *m = NULL, *sm = NULL;
    struct attention *a = NULL;
    struct self_attn *sa = NULL;
    fsdp_ctx_t *ctx = fsdp_module_ctx(parent);
    int64_t h = cfg->hidden_size;
    int rc = fsdp__module_new(ctx, &attention_ops, sizeof *a, &m, (void **)&a);
    if (rc < 0) return rc;
    FSDP_TRY(rc, fail, fsdp__bert_adopt(parent, "attention", m, slot));
    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &self_attn_ops, sizeof *sa, &sm, (void **)&sa));
    FSDP_TRY(rc, fail, fsdp__bert_adopt(m, "self", sm, &a->self));
    sa->hidden = h;
    sa->heads = cfg->num_attention_heads;
    sa->hd = h / cfg->num_attention_heads;
    sa->dropout = cfg->attention_probs_dropout_prob;
    FSDP_TRY(rc, fail, add_linear(sm, "query", h, h, &sa->query));
    FSDP_TRY(rc, fail, add_linear(sm, "key", h, h, &sa->key));
    FSDP_TRY(rc, fail, add_linear(sm, "value", h, h, &sa->value));
    FSDP_TRY(rc, fail, add_norm_create(m, "output", &self_output_ops, cfg, h, &a->output));
fail:
    return rc;
}

/* ---- BertIntermediate ------------------------------------------------------------------------ */

struct intermediate {
    fsdp_module_t *dense;
};

/* gelu(dense(x)) with the exact (erf) GELU, Hugging Face's hidden_act "gelu". */
static int intermediate_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                                fsdp_tensor_t **out) {
    const struct intermediate *p = fsdp_module_impl(m);
    fsdp_tensor_t *d = NULL;
    int rc = fsdp__module_check_io(m, nin, in, 1, 1, nout, 1);
    if (rc < 0) return rc;
    out[0] = NULL;
    rc = fsdp_module_forward1(p->dense, in[0], &d);
    if (rc == 0) rc = fsdp_gelu(d, FSDP_GELU_ERF, out);
    fsdp_tensor_release(d);
    return rc;
}

static const fsdp_module_ops_t intermediate_ops = {
    .type = "BertIntermediate",
    .forward = intermediate_forward,
    .destroy = NULL,
};

/* ---- BertLayer ------------------------------------------------------------------------------- */

struct layer {
    fsdp_module_t *attention, *intermediate, *output;
};

/* Inputs: hidden[, mask]: a = attention(hidden, mask); output(intermediate(a), a). */
static int layer_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                         fsdp_tensor_t **out) {
    const struct layer *ly = fsdp_module_impl(m);
    fsdp_tensor_t *a = NULL, *i = NULL;
    int rc = fsdp__module_check_io(m, nin, in, 1, 2, nout, 1);
    if (rc < 0) return rc;
    out[0] = NULL;
    fsdp_tensor_t *ain[2] = {in[0], nin > 1 ? in[1] : NULL};
    FSDP_TRY(rc, fail, fsdp_module_forward(ly->attention, ain[1] ? 2 : 1, ain, 1, &a));
    FSDP_TRY(rc, fail, fsdp_module_forward1(ly->intermediate, a, &i));
    fsdp_tensor_t *oin[2] = {i, a};
    FSDP_TRY(rc, fail, fsdp_module_forward(ly->output, 2, oin, 1, out));
fail:
    fsdp_tensor_release(a);
    fsdp_tensor_release(i);
    return rc;
}

static const fsdp_module_ops_t layer_ops = {
    .type = "BertLayer",
    .forward = layer_forward,
    .destroy = NULL,
};

int fsdp__bert_layer_create(fsdp_ctx_t *ctx, const fsdp_bert_config_t *cfg, fsdp_module_t **out) {
    fsdp_module_t *m = NULL, *c = NULL;
    struct layer *ly = NULL;
    struct intermediate *p = NULL;
    int rc;
    *out = NULL;
    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &layer_ops, sizeof *ly, &m, (void **)&ly));
    FSDP_TRY(rc, fail, attention_create(m, cfg, &ly->attention));
    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &intermediate_ops, sizeof *p, &c, (void **)&p));
    FSDP_TRY(rc, fail, fsdp__bert_adopt(m, "intermediate", c, &ly->intermediate));
    FSDP_TRY(
        rc, fail,
        add_linear(ly->intermediate, "dense", cfg->hidden_size, cfg->intermediate_size, &p->dense));
    FSDP_TRY(rc, fail,
             add_norm_create(m, "output", &output_ops, cfg, cfg->intermediate_size, &ly->output));
    *out = m;
    return FSDP_OK;
fail:
    fsdp_module_release(m);
    return rc;
}

/* ---- BertPooler ------------------------------------------------------------------------------ */

struct pooler {
    fsdp_module_t *dense;
};

/* tanh(dense(hidden[:, 0])). */
static int pooler_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                          fsdp_tensor_t **out) {
    const struct pooler *p = fsdp_module_impl(m);
    fsdp_tensor_t *first = NULL, *f2 = NULL, *d = NULL;
    int rc = fsdp__module_check_io(m, nin, in, 1, 1, nout, 1);
    if (rc < 0) return rc;
    out[0] = NULL;
    if (fsdp_tensor_ndim(in[0]) != 3 || fsdp_tensor_size(in[0], 1) < 1) {
        char d0[160];
        return fsdp__module_err(m, FSDP_EINVAL, "hidden_states %s must be (B, S, H) with S >= 1",
                                fsdp_tensor_describe(in[0], d0, sizeof d0));
    }
    FSDP_TRY(rc, fail, fsdp_narrow(in[0], 1, 0, 1, &first));
    FSDP_TRY(rc, fail, fsdp_squeeze(first, 1, &f2));
    FSDP_TRY(rc, fail, fsdp_module_forward1(p->dense, f2, &d));
    FSDP_TRY(rc, fail, fsdp_tanh(d, out));
fail:
    fsdp_tensor_release(first);
    fsdp_tensor_release(f2);
    fsdp_tensor_release(d);
    return rc;
}

static const fsdp_module_ops_t pooler_ops = {
    .type = "BertPooler",
    .forward = pooler_forward,
    .destroy = NULL,
};

int fsdp__bert_pooler_create(fsdp_ctx_t *ctx, const fsdp_bert_config_t *cfg, fsdp_module_t **out) {
    fsdp_module_t *m = NULL;
    struct pooler *p = NULL;
    int rc;
    *out = NULL;
    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &pooler_ops, sizeof *p, &m, (void **)&p));
    FSDP_TRY(rc, fail, add_linear(m, "dense", cfg->hidden_size, cfg->hidden_size, &p->dense));
    *out = m;
    return FSDP_OK;
fail:
    fsdp_module_release(m);
    return rc;
}

/* ---- the masked-LM head ---------------------------------------------------------------------- */

struct transform {
    fsdp_module_t *dense, *norm;
};

/* BertPredictionHeadTransform: LayerNorm(gelu(dense(x))). */
static int transform_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                             fsdp_tensor_t **out) {
    const struct transform *t = fsdp_module_impl(m);
    fsdp_tensor_t *d = NULL, *g = NULL;
    int rc = fsdp__module_check_io(m, nin, in, 1, 1, nout, 1);
    if (rc < 0) return rc;
    out[0] = NULL;
    FSDP_TRY(rc, fail, fsdp_module_forward1(t->dense, in[0], &d));
    FSDP_TRY(rc, fail, fsdp_gelu(d, FSDP_GELU_ERF, &g));
    FSDP_TRY(rc, fail, fsdp_module_forward1(t->norm, g, out));
fail:
    fsdp_tensor_release(d);
    fsdp_tensor_release(g);
    return rc;
}

static const fsdp_module_ops_t transform_ops = {
    .type = "BertPredictionHeadTransform",
    .forward = transform_forward,
    .destroy = NULL,
};

struct predictions {
    fsdp_module_t *transform, *decoder;
};

/* BertLMPredictionHead: decoder(transform(x)); the decoder's weight and bias are the tied
 * tensors. */
static int predictions_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                               fsdp_tensor_t **out) {
    const struct predictions *p = fsdp_module_impl(m);
    fsdp_tensor_t *t = NULL;
    int rc = fsdp__module_check_io(m, nin, in, 1, 1, nout, 1);
    if (rc < 0) return rc;
    out[0] = NULL;
    rc = fsdp_module_forward1(p->transform, in[0], &t);
    if (rc == 0) rc = fsdp_module_forward1(p->decoder, t, out);
    fsdp_tensor_release(t);
    return rc;
}

static const fsdp_module_ops_t predictions_ops = {
    .type = "BertLMPredictionHead",
    .forward = predictions_forward,
    .destroy = NULL,
};

struct mlm_head {
    fsdp_module_t *predictions;
};

static int mlm_head_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                            fsdp_tensor_t **out) {
    const struct mlm_head *h = fsdp_module_impl(m);
    int rc = fsdp__module_check_io(m, nin, in, 1, 1, nout, 1);
    if (rc < 0) return rc;
    out[0] = NULL;
    return fsdp_module_forward1(h->predictions, in[0], out);
}

static const fsdp_module_ops_t mlm_head_ops = {
    .type = "BertOnlyMLMHead",
    .forward = mlm_head_forward,
    .destroy = NULL,
};

int fsdp__bert_mlm_head_create(fsdp_ctx_t *ctx, const fsdp_bert_config_t *cfg,
                               fsdp_tensor_t *word_weight, fsdp_module_t **out) {
    fsdp_module_t *m = NULL, *pm = NULL, *tm = NULL, *dec = NULL;
    struct mlm_head *h = NULL;
    struct predictions *p = NULL;
    struct transform *t = NULL;
    fsdp_tensor_t *bias = NULL;
    int64_t hs = cfg->hidden_size, v = cfg->vocab_size;
    int rc;
    *out = NULL;
    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &mlm_head_ops, sizeof *h, &m, (void **)&h));
    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &predictions_ops, sizeof *p, &pm, (void **)&p));
    FSDP_TRY(rc, fail, fsdp__bert_adopt(m, "predictions", pm, &h->predictions));
    /* Hugging Face's registration order: transform, decoder, then the parameter bias; listings
     * put a module's own parameters first either way. */
    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &transform_ops, sizeof *t, &tm, (void **)&t));
    FSDP_TRY(rc, fail, fsdp__bert_adopt(pm, "transform", tm, &p->transform));
    FSDP_TRY(rc, fail, add_linear(tm, "dense", hs, hs, &t->dense));
    FSDP_TRY(rc, fail, add_layernorm(tm, cfg, &t->norm));
    /* The decoder is created with its own weight and bias, as PyTorch does, and then both are
     * replaced: one tensor under two names each (see fsdp/bert.h). */
    FSDP_TRY(rc, fail, fsdp_linear_create(ctx, hs, v, true, &dec));
    FSDP_TRY(rc, fail, fsdp__bert_adopt(pm, "decoder", dec, &p->decoder));
    FSDP_TRY(rc, fail, fsdp__module_new_param(pm, "bias", 1, &v, 0.0, &bias));
    FSDP_TRY(rc, fail, fsdp_module_set_param(p->decoder, "weight", word_weight, false));
    FSDP_TRY(rc, fail, fsdp_module_set_param(p->decoder, "bias", bias, false));
    *out = m;
    return FSDP_OK;
fail:
    fsdp_module_release(m);
    return rc;
}
