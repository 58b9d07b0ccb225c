/* SPDX-License-Identifier: MIT */
/*
 * bert.c: Hugging Face's BertForMaskedLM (module types "BertForMaskedLM", "BertModel",
 * "BertEncoder"; the layers and the head are in bert_layers.c), its configuration and its
 * masked-LM loss. The interface and the computation are described in fsdp/bert.h.
 *
 * BertModel turns the (B, S) attention mask into the additive (B, 1, 1, S) mask once per forward,
 * in the dtype of the embeddings' output (so that under mixed precision the "large negative" is
 * the lowest finite value of the compute dtype, as Hugging Face's finfo(dtype).min, and never
 * rounds to -inf), and hands it to every BertLayer as a second input. Without a mask no mask is
 * added at all (Hugging Face adds zeros, which changes no bit).
 *
 * Invariants: the root's and the BertModel's impl hold a copy of the configuration (returned by
 * fsdp_bert_get_config) and borrowed pointers to their children; the encoder finds its layers
 * through its ModuleList at every forward.
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "nn/bert_impl.h"

static const fsdp__abi_struct_t config_abi =
    FSDP__ABI_STRUCT(fsdp_bert_config_t, "fsdp_bert_config_init", add_pooling_layer);

void(fsdp_bert_config_init)(fsdp_bert_config_t *cfg, size_t size) {
    fsdp_bert_config_t d;
    memset(&d, 0, sizeof d);
    d.vocab_size = 30522;
    d.hidden_size = 768;
    d.num_hidden_layers = 12;
    d.num_attention_heads = 12;
    d.intermediate_size = 3072;
    d.max_position_embeddings = 512;
    d.type_vocab_size = 2;
    d.layer_norm_eps = 1e-12;
    d.hidden_dropout_prob = 0.1;
    d.attention_probs_dropout_prob = 0.1;
    d.pad_token_id = 0;
    d.initializer_range = 0.02;
    d.add_pooling_layer = true;
    fsdp__abi_init(cfg, size, &d, &config_abi);
}

/* fsdp_bert_config_check with the calling function's name in the message. */
static int check_config(fsdp_ctx_t *ctx, const char *fn, const fsdp_bert_config_t *cfg) {
    if (!cfg) return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: cfg is NULL", fn);
    int rc = fsdp__abi_check(ctx, fn, "cfg", cfg, &config_abi);
    if (rc < 0) return rc;
    const struct {
        const char *name;
        int64_t v, min;
    } sizes[] = {
        {"vocab_size", cfg->vocab_size, 1},
        {"hidden_size", cfg->hidden_size, 1},
        {"num_hidden_layers", cfg->num_hidden_layers, 0},
        {"num_attention_heads", cfg->num_attention_heads, 1},
        {"intermediate_size", cfg->intermediate_size, 1},
        {"max_position_embeddings", cfg->max_position_embeddings, 1},
        {"type_vocab_size", cfg->type_vocab_size, 1},
    };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if (sizes[i].v < sizes[i].min)
            return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: %s %lld must be %s", fn, sizes[i].name,
                                 (long long)sizes[i].v, sizes[i].min ? "positive" : "zero or more");
    if (cfg->hidden_size % cfg->num_attention_heads != 0)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "%s: hidden_size %lld is not a multiple of num_attention_heads %lld",
                             fn, (long long)cfg->hidden_size, (long long)cfg->num_attention_heads);
    if (!(cfg->layer_norm_eps > 0.0 && isfinite(cfg->layer_norm_eps)))
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: layer_norm_eps %g must be positive", fn,
                             cfg->layer_norm_eps);
    const struct {
        const char *name;
        double p;
    } probs[] = {
        {"hidden_dropout_prob", cfg->hidden_dropout_prob},
        {"attention_probs_dropout_prob", cfg->attention_probs_dropout_prob},
    };
    for (size_t i = 0; i < sizeof probs / sizeof probs[0]; i++)
        if (!(probs[i].p >= 0.0 && probs[i].p < 1.0))
            return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: %s %g is outside [0, 1)", fn, probs[i].name,
                                 probs[i].p);
    if (cfg->pad_token_id < -1 || cfg->pad_token_id >= cfg->vocab_size)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "%s: pad_token_id %lld must be in [0, vocab_size %lld) or -1 (none)",
                             fn, (long long)cfg->pad_token_id, (long long)cfg->vocab_size);
    if (!(cfg->initializer_range >= 0.0 && isfinite(cfg->initializer_range)))
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: initializer_range %g must be zero or more", fn,
                             cfg->initializer_range);
    return FSDP_OK;
}

int fsdp_bert_config_check(fsdp_ctx_t *ctx, const fsdp_bert_config_t *cfg) {
    return check_config(ctx, "fsdp_bert_config_check", cfg);
}

/* ---- BertEncoder ----------------------------------------------------------------------------- */

struct encoder {
    fsdp_module_t *layer; /* ModuleList of BertLayer */
};

/* Inputs: hidden[, mask]; every layer in order. */
static int encoder_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                           fsdp_tensor_t **out) {
    const struct encoder *e = fsdp_module_impl(m);
    fsdp_tensor_t *x = NULL, *y = NULL;
    int rc = fsdp__module_check_io(m, nin, in, 1, 2, nout, 1);
    if (rc < 0) return rc;
    out[0] = NULL;
    fsdp_tensor_t *mask = nin > 1 ? in[1] : NULL;
    x = fsdp_tensor_retain(in[0]);
    size_t n = fsdp_module_num_children(e->layer);
    for (size_t i = 0; i < n; i++) {
        fsdp_tensor_t *lin[2] = {x, mask};
        FSDP_TRY(
            rc, fail,
            fsdp_module_forward(fsdp_module_child_at(e->layer, i, NULL), mask ? 2 : 1, lin, 1, &y));
        fsdp_tensor_release(x);
        x = y;
        y = NULL;
    }
    out[0] = x;
    x = NULL;
fail:
    fsdp_tensor_release(x);
    return rc;
}

static const fsdp_module_ops_t encoder_ops = {
    .type = "BertEncoder",
    .forward = encoder_forward,
    .destroy = NULL,
};

static int encoder_create(fsdp_ctx_t *ctx, const fsdp_bert_config_t *cfg, fsdp_module_t **out) {
    fsdp_module_t *m = NULL, *c = NULL;
    struct encoder *e = NULL;
    int rc;
    *out = NULL;
    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &encoder_ops, sizeof *e, &m, (void **)&e));
    FSDP_TRY(rc, fail, fsdp_modulelist_create(ctx, &c));
    FSDP_TRY(rc, fail, fsdp__bert_adopt(m, "layer", c, &e->layer));
    for (int64_t i = 0; i < cfg->num_hidden_layers; i++) {
        FSDP_TRY(rc, fail, fsdp__bert_layer_create(ctx, cfg, &c));
        rc = fsdp_module_append(e->layer, c);
        fsdp_module_release(c);
        if (rc < 0) goto fail;
    }
    *out = m;
    return FSDP_OK;
fail:
    fsdp_module_release(m);
    return rc;
}

/* ---- BertModel ------------------------------------------------------------------------------- */

struct bert_model {
    fsdp_bert_config_t cfg;
    fsdp_module_t *embeddings, *encoder, *pooler; /* pooler NULL without add_pooling_layer */
};

/* The most negative finite value of dt (torch.finfo(dt).min). */
static double lowest_of(fsdp_dtype_t dt) {
    switch (dt) {
    case FSDP_DTYPE_F64:
        return -DBL_MAX;
    case FSDP_DTYPE_F16:
        return -65504.0;
    case FSDP_DTYPE_BF16:
        return -3.3895313892515355e38; /* (2 - 2^-7) 2^127 */
    default:
        return -FLT_MAX;
    }
}

/* Hugging Face's get_extended_attention_mask: (1 - mask) * lowest as (B, 1, 1, S) in dtype dt,
 * computed as mask * -lowest + lowest (exact for 0 and 1). */
static int extended_mask(fsdp_tensor_t *mask, fsdp_dtype_t dt, fsdp_tensor_t **out) {
    fsdp_tensor_t *f = NULL, *s = NULL, *a = NULL;
    double low = lowest_of(dt);
    int rc;
    FSDP_TRY(rc, fail, fsdp_to_dtype(mask, dt, &f));
    FSDP_TRY(rc, fail, fsdp_scale(f, -low, &s));
    FSDP_TRY(rc, fail, fsdp_add_scalar(s, low, &a));
    const int64_t s4[4] = {fsdp_tensor_size(mask, 0), 1, 1, fsdp_tensor_size(mask, 1)};
    FSDP_TRY(rc, fail, fsdp_view(a, 4, s4, out));
fail:
    fsdp_tensor_release(f);
    fsdp_tensor_release(s);
    fsdp_tensor_release(a);
    return rc;
}

/* Inputs: input_ids[, attention_mask[, token_type_ids]]; outputs sequence_output[, pooled]. */
static int bert_model_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                              fsdp_tensor_t **out) {
    const struct bert_model *b = fsdp_module_impl(m);
    fsdp_tensor_t *emb = NULL, *mask = NULL, *seq = NULL;
    int rc;
    if (nout == 2 && !b->pooler)
        return fsdp__module_err(m, FSDP_EINVAL,
                                "the pooled output was asked for, but the model has no pooler "
                                "(add_pooling_layer is false)");
    rc = fsdp__module_check_io(m, nin, in, 1, 3, nout, nout == 2 ? 2 : 1);
    if (rc < 0) return rc;
    for (int i = 0; i < nout; i++)
        out[i] = NULL;
    fsdp_tensor_t *ids = in[0], *am = nin > 1 ? in[1] : NULL, *types = nin > 2 ? in[2] : NULL;
    FSDP_TRY(rc, fail, fsdp__bert_check_ids(m, &b->cfg, ids, am, "attention_mask", false));
    fsdp_tensor_t *ein[2] = {ids, types};
    FSDP_TRY(rc, fail, fsdp_module_forward(b->embeddings, types ? 2 : 1, ein, 1, &emb));
    if (am) FSDP_TRY(rc, fail, extended_mask(am, fsdp_tensor_dtype(emb), &mask));
    fsdp_tensor_t *xin[2] = {emb, mask};
    FSDP_TRY(rc, fail, fsdp_module_forward(b->encoder, mask ? 2 : 1, xin, 1, &seq));
    if (nout == 2) FSDP_TRY(rc, fail, fsdp_module_forward1(b->pooler, seq, &out[1]));
    out[0] = seq;
    seq = NULL;
fail:
    if (rc < 0) {
        for (int i = 0; i < nout; i++) {
            fsdp_tensor_release(out[i]);
            out[i] = NULL;
        }
    }
    fsdp_tensor_release(emb);
    fsdp_tensor_release(mask);
    fsdp_tensor_release(seq);
    return rc;
}

static const fsdp_module_ops_t bert_model_ops = {
    .type = "BertModel",
    .forward = bert_model_forward,
    .destroy = NULL,
};

static int bert_model_create(fsdp_ctx_t *ctx, const fsdp_bert_config_t *cfg, fsdp_module_t **out) {
    fsdp_module_t *m = NULL, *c = NULL;
    struct bert_model *b = NULL;
    int rc;
    *out = NULL;
    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &bert_model_ops, sizeof *b, &m, (void **)&b));
    b->cfg = *cfg;
    FSDP_TRY(rc, fail, fsdp__bert_embeddings_create(ctx, cfg, &c));
    FSDP_TRY(rc, fail, fsdp__bert_adopt(m, "embeddings", c, &b->embeddings));
    FSDP_TRY(rc, fail, encoder_create(ctx, cfg, &c));
    FSDP_TRY(rc, fail, fsdp__bert_adopt(m, "encoder", c, &b->encoder));
    if (cfg->add_pooling_layer) {
        FSDP_TRY(rc, fail, fsdp__bert_pooler_create(ctx, cfg, &c));
        FSDP_TRY(rc, fail, fsdp__bert_adopt(m, "pooler", c, &b->pooler));
    }
    *out = m;
    return FSDP_OK;
fail:
    fsdp_module_release(m);
    return rc;
}

/* ---- BertForMaskedLM ------------------------------------------------------------------------- */

struct bert_mlm {
    fsdp_bert_config_t cfg;
    fsdp_module_t *bert, *cls;
};

/* Inputs: input_ids[, attention_mask[, token_type_ids]]; outputs logits[, pooled]. */
static int bert_mlm_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                            fsdp_tensor_t **out) {
    const struct bert_mlm *r = fsdp_module_impl(m);
    fsdp_tensor_t *res[2] = {NULL, NULL};
    int rc = fsdp__module_check_io(m, nin, in, 1, 3, nout, nout == 2 ? 2 : 1);
    if (rc < 0) return rc;
    for (int i = 0; i < nout; i++)
        out[i] = NULL;
    FSDP_TRY(rc, fail, fsdp_module_forward(r->bert, nin, in, nout, res));
    FSDP_TRY(rc, fail, fsdp_module_forward1(r->cls, res[0], &out[0]));
    if (nout == 2) {
        out[1] = res[1];
        res[1] = NULL;
    }
fail:
    fsdp_tensor_release(res[0]);
    fsdp_tensor_release(res[1]);
    return rc;
}

static const fsdp_module_ops_t bert_mlm_ops = {
    .type = "BertForMaskedLM",
    .forward = bert_mlm_forward,
    .destroy = NULL,
};

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* BertPreTrainedModel._init_weights over the parameters in order: matrices (Linear weights and
 * embeddings) normal(0, initializer_range), LayerNorm weights ones, every other vector (biases,
 * cls.predictions.bias) zeros; then the padding row of the word embeddings zeroed. */
static int init_weights(fsdp_module_t *m, const fsdp_bert_config_t *cfg) {
    fsdp_named_list_t list = {0};
    fsdp_tensor_t *row = NULL;
    int rc = fsdp_module_named_params(m, false, &list);
    if (rc < 0) return rc;
    for (size_t i = 0; i < list.n && rc == 0; i++) {
        fsdp_tensor_t *t = list.tensors[i];
        if (fsdp_tensor_ndim(t) >= 2)
            rc = fsdp_tensor_normal_(t, 0.0, cfg->initializer_range);
        else if (ends_with(list.names[i], "LayerNorm.weight"))
            rc = fsdp_tensor_fill_(t, 1.0);
        else
            rc = fsdp_tensor_zero_(t);
    }
    fsdp_tensor_t *w = fsdp_module_param(m, "bert.embeddings.word_embeddings.weight");
    if (rc == 0 && cfg->pad_token_id >= 0) rc = fsdp_narrow(w, 0, cfg->pad_token_id, 1, &row);
    if (rc == 0 && row) rc = fsdp_tensor_zero_(row);
    fsdp_tensor_release(row);
    fsdp_named_list_free(&list);
    return rc;
}

int fsdp_bert_create(fsdp_ctx_t *ctx, const fsdp_bert_config_t *user_cfg, fsdp_module_t **m) {
    fsdp_module_t *mod = NULL, *c = NULL;
    struct bert_mlm *r = NULL;
    int rc;
    if (!m) return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_bert_create: m is NULL");
    *m = NULL;
    if (!ctx) return FSDP_EINVAL;
    FSDP_TRY(rc, fail, check_config(ctx, "fsdp_bert_create", user_cfg));
    /* Every module below keeps a copy of this one, of this library's layout. */
    fsdp_bert_config_t cfg_copy;
    fsdp_bert_config_init(&cfg_copy);
    fsdp__abi_copy_in(&cfg_copy, user_cfg, &config_abi);
    const fsdp_bert_config_t *cfg = &cfg_copy;
    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &bert_mlm_ops, sizeof *r, &mod, (void **)&r));
    r->cfg = *cfg;
    FSDP_TRY(rc, fail, bert_model_create(ctx, cfg, &c));
    FSDP_TRY(rc, fail, fsdp__bert_adopt(mod, "bert", c, &r->bert));
    fsdp_tensor_t *word = fsdp_module_param(r->bert, "embeddings.word_embeddings.weight");
    FSDP_TRY(rc, fail, fsdp__bert_mlm_head_create(ctx, cfg, word, &c));
    FSDP_TRY(rc, fail, fsdp__bert_adopt(mod, "cls", c, &r->cls));
    FSDP_TRY(rc, fail, init_weights(mod, cfg));
    *m = mod;
    return FSDP_OK;
fail:
    fsdp_module_release(mod);
    return rc;
}

const fsdp_bert_config_t *fsdp_bert_get_config(const fsdp_module_t *m) {
    if (!m) return NULL;
    if (fsdp_module_ops(m) == &bert_mlm_ops)
        return &((const struct bert_mlm *)fsdp_module_impl(m))->cfg;
    if (fsdp_module_ops(m) == &bert_model_ops)
        return &((const struct bert_model *)fsdp_module_impl(m))->cfg;
    return NULL;
}

/* The number of inputs to pass: one past the last non-NULL entry, at least 1. */
static int count_inputs(fsdp_tensor_t *const *in, int n) {
    while (n > 1 && !in[n - 1])
        n--;
    return n;
}

int fsdp_bert_forward(fsdp_module_t *m, fsdp_tensor_t *input_ids, fsdp_tensor_t *attention_mask,
                      fsdp_tensor_t *token_type_ids, fsdp_tensor_t **logits,
                      fsdp_tensor_t **pooled) {
    fsdp_tensor_t *res[2] = {NULL, NULL};
    if (pooled) *pooled = NULL;
    if (!m) return FSDP_EINVAL;
    if (!logits) return fsdp__module_err(m, FSDP_EINVAL, "fsdp_bert_forward: logits is NULL");
    *logits = NULL;
    if (fsdp_module_ops(m) != &bert_mlm_ops)
        return fsdp__module_err(m, FSDP_EINVAL, "fsdp_bert_forward: not a BertForMaskedLM");
    if (!input_ids) return fsdp__module_err(m, FSDP_EINVAL, "fsdp_bert_forward: input_ids is NULL");
    fsdp_tensor_t *in[3] = {input_ids, attention_mask, token_type_ids};
    int rc = fsdp_module_forward(m, count_inputs(in, 3), in, pooled ? 2 : 1, res);
    if (rc < 0) return rc;
    *logits = res[0];
    if (pooled) *pooled = res[1];
    return FSDP_OK;
}

int fsdp_bert_mlm_loss(fsdp_tensor_t *logits, fsdp_tensor_t *labels, fsdp_tensor_t **loss) {
    fsdp_ctx_t *ctx = logits ? fsdp_tensor_ctx(logits) : NULL;
    fsdp_tensor_t *l2 = NULL, *t1 = NULL;
    char d0[160], d1[160];
    int rc;
    if (!loss) return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_bert_mlm_loss: loss is NULL");
    *loss = NULL;
    if (!logits || !labels)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_bert_mlm_loss: logits and labels are required");
    const int64_t *ls = fsdp_tensor_shape(logits), *ts = fsdp_tensor_shape(labels);
    if (fsdp_tensor_ndim(logits) != 3 || fsdp_tensor_ndim(labels) != 2 || ls[0] != ts[0] ||
        ls[1] != ts[1])
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_bert_mlm_loss: logits %s and labels %s must be (B, S, V) and "
                             "(B, S)",
                             fsdp_tensor_describe(logits, d0, sizeof d0),
                             fsdp_tensor_describe(labels, d1, sizeof d1));
    const int64_t s2[2] = {ls[0] * ls[1], ls[2]}, s1[1] = {ts[0] * ts[1]};
    FSDP_TRY(rc, fail, fsdp_reshape(logits, 2, s2, &l2));
    FSDP_TRY(rc, fail, fsdp_reshape(labels, 1, s1, &t1));
    FSDP_TRY(rc, fail,
             fsdp_cross_entropy(l2, t1, FSDP_BERT_IGNORE_INDEX, FSDP_REDUCTION_MEAN, 0.0, loss));
fail:
    fsdp_tensor_release(l2);
    fsdp_tensor_release(t1);
    return rc;
}

int fsdp_bert_forward_loss(fsdp_module_t *m, fsdp_tensor_t *input_ids,
                           fsdp_tensor_t *attention_mask, fsdp_tensor_t *token_type_ids,
                           fsdp_tensor_t *labels, fsdp_tensor_t **loss, fsdp_tensor_t **logits,
                           fsdp_tensor_t **pooled) {
    fsdp_tensor_t *lg = NULL, *pl = NULL;
    int rc;
    if (logits) *logits = NULL;
    if (pooled) *pooled = NULL;
    if (!m) return FSDP_EINVAL;
    if (!loss) return fsdp__module_err(m, FSDP_EINVAL, "fsdp_bert_forward_loss: loss is NULL");
    *loss = NULL;
    FSDP_TRY(
        rc, fail,
        fsdp_bert_forward(m, input_ids, attention_mask, token_type_ids, &lg, pooled ? &pl : NULL));
    FSDP_TRY(rc, fail, fsdp_bert_mlm_loss(lg, labels, loss));
    if (logits) {
        *logits = lg;
        lg = NULL;
    }
    if (pooled) {
        *pooled = pl;
        pl = NULL;
    }
fail:
    fsdp_tensor_release(lg);
    fsdp_tensor_release(pl);
    return rc;
}
