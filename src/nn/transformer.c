/* SPDX-License-Identifier: MIT */
/*
 * transformer.c: PyTorch 1.13's TransformerEncoderLayer, TransformerDecoderLayer,
 * TransformerEncoder, TransformerDecoder and Transformer.
 *
 * Each type registers its children in PyTorch's order and under PyTorch's names, so parameter
 * listings and state dicts match PyTorch's key for key. Children are run through
 * fsdp_module_forward() so that their hooks fire. A module's impl holds borrowed pointers to its
 * children (the module holds the references; children are never replaced).
 *
 * Cloned layers (PyTorch's _get_clones deep-copies one layer) are built by rewinding the
 * context's random stream to the same point for every copy, which gives every copy the values
 * of the first and leaves the stream where one layer's initialisation leaves it.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "nn/nn_impl.h"
#include <fsdp/transformer.h>

static const fsdp__abi_struct_t config_abi =
    FSDP__ABI_STRUCT(fsdp_transformer_config_t, "fsdp_transformer_config_init", norm_first);

void(fsdp_transformer_config_init)(fsdp_transformer_config_t *cfg, size_t size) {
    fsdp_transformer_config_t d;
    memset(&d, 0, sizeof d);
    d.d_model = 512;
    d.nhead = 8;
    d.num_encoder_layers = 6;
    d.num_decoder_layers = 6;
    d.dim_feedforward = 2048;
    d.dropout = 0.1;
    d.activation = FSDP_ACTIVATION_RELU;
    d.layer_norm_eps = 1e-5;
    d.batch_first = false;
    d.norm_first = false;
    fsdp__abi_init(cfg, size, &d, &config_abi);
}

/* The layers of a TransformerEncoderLayer or TransformerDecoderLayer (the decoder's extra
 * children are NULL in an encoder layer). */
struct layer {
    fsdp_module_t *self_attn, *multihead_attn;
    fsdp_module_t *linear1, *dropout, *linear2;
    fsdp_module_t *norm1, *norm2, *norm3;
    fsdp_module_t *dropout1, *dropout2, *dropout3;
    fsdp_activation_t activation;
    bool norm_first;
};

/* TransformerEncoder / TransformerDecoder. */
struct stack {
    fsdp_module_t *layers; /* ModuleList */
    fsdp_module_t *norm;   /* NULL without a final norm */
    bool decoder;          /* layers take (tgt, memory, ...) rather than (src, ...) */
};

struct transformer {
    fsdp_module_t *encoder, *decoder;
    int64_t d_model;
    bool batch_first;
};

/* Registers child under name and drops the caller's reference (the parent keeps one); *slot
 * (may be NULL) borrows the child. The child is consumed on failure too. */
static int adopt(fsdp_module_t *m, const char *name, fsdp_module_t *child, fsdp_module_t **slot) {
    int rc = fsdp_module_add_child(m, name, child);
    if (rc == 0 && slot) *slot = child;
    fsdp_module_release(child);
    return rc;
}

static int check_config(fsdp_ctx_t *ctx, const char *fn, const fsdp_transformer_config_t *cfg) {
    if (!cfg) return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: cfg is NULL", fn);
    int rc = fsdp__abi_check(ctx, fn, "cfg", cfg, &config_abi);
    if (rc < 0) return rc;
    if (cfg->d_model <= 0 || cfg->nhead <= 0 || cfg->d_model % cfg->nhead != 0)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "%s: d_model %lld must be positive and divisible by nhead %lld", fn,
                             (long long)cfg->d_model, (long long)cfg->nhead);
    if (cfg->dim_feedforward <= 0 || cfg->num_encoder_layers < 0 || cfg->num_decoder_layers < 0)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "%s: dim_feedforward %lld must be positive and the layer counts "
                             "(%lld, %lld) not negative",
                             fn, (long long)cfg->dim_feedforward,
                             (long long)cfg->num_encoder_layers,
                             (long long)cfg->num_decoder_layers);
    if (!(cfg->dropout >= 0.0 && cfg->dropout < 1.0) || !(cfg->layer_norm_eps > 0.0))
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "%s: dropout %g must be in [0, 1) and layer_norm_eps %g positive", fn,
                             cfg->dropout, cfg->layer_norm_eps);
    if (cfg->activation != FSDP_ACTIVATION_RELU && cfg->activation != FSDP_ACTIVATION_GELU)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: activation %d is not relu or gelu", fn,
                             (int)cfg->activation);
    return FSDP_OK;
}

/* ---- blocks shared by both layer types ------------------------------------------------------- */

/* A sub-block of a layer: y = f(x). */
typedef int (*block_fn)(const struct layer *ly, void *arg, fsdp_tensor_t *x, fsdp_tensor_t **y);

/* x + f(norm(x)) when norm_first, else norm(x + f(x)). */
static int residual(const struct layer *ly, fsdp_module_t *norm, block_fn f, void *arg,
                    fsdp_tensor_t *x, fsdp_tensor_t **out) {
    fsdp_tensor_t *h = NULL, *b = NULL, *s = NULL;
    int rc;
    *out = NULL;
    if (ly->norm_first) {
        FSDP_TRY(rc, fail, fsdp_module_forward1(norm, x, &h));
        FSDP_TRY(rc, fail, f(ly, arg, h, &b));
        FSDP_TRY(rc, fail, fsdp_add(x, b, out));
    } else {
        FSDP_TRY(rc, fail, f(ly, arg, x, &b));
        FSDP_TRY(rc, fail, fsdp_add(x, b, &s));
        FSDP_TRY(rc, fail, fsdp_module_forward1(norm, s, out));
    }
fail:
    fsdp_tensor_release(h);
    fsdp_tensor_release(b);
    fsdp_tensor_release(s);
    return rc;
}

/* Attention inputs of a sub-block: x attends to memory (NULL: to itself). */
struct attn_arg {
    fsdp_module_t *mha;
    fsdp_module_t *drop;
    fsdp_tensor_t *memory, *mask, *kpm;
};

static int attn_block(const struct layer *ly, void *arg, fsdp_tensor_t *x, fsdp_tensor_t **y) {
    const struct attn_arg *a = arg;
    fsdp_tensor_t *t = NULL;
    fsdp_tensor_t *kv = a->memory ? a->memory : x;
    (void)ly;
    int rc = fsdp_mha_forward(a->mha, x, kv, kv, a->kpm, a->mask, &t);
    if (rc == 0) rc = fsdp_module_forward1(a->drop, t, y);
    fsdp_tensor_release(t);
    return rc;
}

/* linear2(dropout(activation(linear1(x)))), then the last dropout of the layer (arg). */
static int ff_block(const struct layer *ly, void *arg, fsdp_tensor_t *x, fsdp_tensor_t **y) {
    fsdp_tensor_t *a = NULL, *b = NULL, *c = NULL, *d = NULL;
    int rc;
    FSDP_TRY(rc, fail, fsdp_module_forward1(ly->linear1, x, &a));
    if (ly->activation == FSDP_ACTIVATION_GELU)
        FSDP_TRY(rc, fail, fsdp_gelu(a, FSDP_GELU_ERF, &b));
    else
        FSDP_TRY(rc, fail, fsdp_relu(a, &b));
    FSDP_TRY(rc, fail, fsdp_module_forward1(ly->dropout, b, &c));
    FSDP_TRY(rc, fail, fsdp_module_forward1(ly->linear2, c, &d));
    FSDP_TRY(rc, fail, fsdp_module_forward1((fsdp_module_t *)arg, d, y));
fail:
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    fsdp_tensor_release(c);
    fsdp_tensor_release(d);
    return rc;
}

/* Creates the children of a layer in PyTorch's order (decoder adds multihead_attn, norm3 and
 * dropout3). */
static int layer_init(fsdp_module_t *m, struct layer *ly, const fsdp_transformer_config_t *cfg,
                      bool decoder) {
    fsdp_ctx_t *ctx = fsdp_module_ctx(m);
    fsdp_module_t *c = NULL;
    int64_t d = cfg->d_model, ff = cfg->dim_feedforward;
    int rc;
    ly->activation = cfg->activation;
    ly->norm_first = cfg->norm_first;
    FSDP_TRY(rc, fail,
             fsdp_mha_create(ctx, d, cfg->nhead, cfg->dropout, true, cfg->batch_first, &c));
    FSDP_TRY(rc, fail, adopt(m, "self_attn", c, &ly->self_attn));
    if (decoder) {
        FSDP_TRY(rc, fail,
                 fsdp_mha_create(ctx, d, cfg->nhead, cfg->dropout, true, cfg->batch_first, &c));
        FSDP_TRY(rc, fail, adopt(m, "multihead_attn", c, &ly->multihead_attn));
    }
    FSDP_TRY(rc, fail, fsdp_linear_create(ctx, d, ff, true, &c));
    FSDP_TRY(rc, fail, adopt(m, "linear1", c, &ly->linear1));
    FSDP_TRY(rc, fail, fsdp_dropout_create(ctx, cfg->dropout, &c));
    FSDP_TRY(rc, fail, adopt(m, "dropout", c, &ly->dropout));
    FSDP_TRY(rc, fail, fsdp_linear_create(ctx, ff, d, true, &c));
    FSDP_TRY(rc, fail, adopt(m, "linear2", c, &ly->linear2));
    static const char *const norms[3] = {"norm1", "norm2", "norm3"};
    fsdp_module_t **norm_slots[3] = {&ly->norm1, &ly->norm2, &ly->norm3};
    for (int i = 0; i < (decoder ? 3 : 2); i++) {
        FSDP_TRY(rc, fail, fsdp_layernorm_create(ctx, d, cfg->layer_norm_eps, true, &c));
        FSDP_TRY(rc, fail, adopt(m, norms[i], c, norm_slots[i]));
    }
    static const char *const drops[3] = {"dropout1", "dropout2", "dropout3"};
    fsdp_module_t **drop_slots[3] = {&ly->dropout1, &ly->dropout2, &ly->dropout3};
    for (int i = 0; i < (decoder ? 3 : 2); i++) {
        FSDP_TRY(rc, fail, fsdp_dropout_create(ctx, cfg->dropout, &c));
        FSDP_TRY(rc, fail, adopt(m, drops[i], c, drop_slots[i]));
    }
fail:
    return rc;
}

/* ---- TransformerEncoderLayer ----------------------------------------------------------------- */

/* Inputs: src[, src_mask[, src_key_padding_mask]]. */
static int encoder_layer_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                                 fsdp_tensor_t **out) {
    const struct layer *ly = fsdp_module_impl(m);
    fsdp_tensor_t *x = NULL;
    int rc = fsdp__module_check_io(m, nin, in, 1, 3, nout, 1);
    if (rc < 0) return rc;
    out[0] = NULL;
    struct attn_arg sa = {ly->self_attn, ly->dropout1, NULL, nin > 1 ? in[1] : NULL,
                          nin > 2 ? in[2] : NULL};
    FSDP_TRY(rc, fail, residual(ly, ly->norm1, attn_block, &sa, in[0], &x));
    FSDP_TRY(rc, fail, residual(ly, ly->norm2, ff_block, ly->dropout2, x, out));
fail:
    fsdp_tensor_release(x);
    return rc;
}

static const fsdp_module_ops_t encoder_layer_ops = {
    .type = "TransformerEncoderLayer",
    .forward = encoder_layer_forward,
    .destroy = NULL,
};

int fsdp_transformer_encoder_layer_create(fsdp_ctx_t *ctx, const fsdp_transformer_config_t *cfg,
                                          fsdp_module_t **m) {
    fsdp_module_t *mod = NULL;
    struct layer *ly = NULL;
    int rc;
    if (!m)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_transformer_encoder_layer_create: m is NULL");
    *m = NULL;
    if (!ctx) return FSDP_EINVAL;
    FSDP_TRY(rc, fail, check_config(ctx, "fsdp_transformer_encoder_layer_create", cfg));
    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &encoder_layer_ops, sizeof *ly, &mod, (void **)&ly));
    FSDP_TRY(rc, fail, layer_init(mod, ly, cfg, false));
    *m = mod;
    return FSDP_OK;
fail:
    fsdp_module_release(mod);
    return rc;
}

int fsdp_transformer_encoder_layer_forward(fsdp_module_t *m, fsdp_tensor_t *src,
                                           fsdp_tensor_t *src_mask,
                                           fsdp_tensor_t *src_key_padding_mask,
                                           fsdp_tensor_t **out) {
    if (!m || !out) return FSDP_EINVAL;
    *out = NULL;
    if (fsdp_module_ops(m) != &encoder_layer_ops)
        return fsdp__module_err(m, FSDP_EINVAL, "not a TransformerEncoderLayer");
    fsdp_tensor_t *in[3] = {src, src_mask, src_key_padding_mask};
    return fsdp_module_forward(m, src_key_padding_mask ? 3 : src_mask ? 2 : 1, in, 1, out);
}

/* ---- TransformerDecoderLayer ----------------------------------------------------------------- */

/* Inputs: tgt, memory[, tgt_mask[, memory_mask[, tgt_key_padding_mask[,
 * memory_key_padding_mask]]]]. */
static int decoder_layer_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                                 fsdp_tensor_t **out) {
    const struct layer *ly = fsdp_module_impl(m);
    fsdp_tensor_t *x = NULL, *y = NULL;
    int rc = fsdp__module_check_io(m, nin, in, 2, 6, nout, 1);
    if (rc < 0) return rc;
    out[0] = NULL;
    fsdp_tensor_t *opt[4] = {NULL, NULL, NULL, NULL};
    for (int i = 2; i < nin; i++)
        opt[i - 2] = in[i];
    struct attn_arg sa = {ly->self_attn, ly->dropout1, NULL, opt[0], opt[2]};
    struct attn_arg ca = {ly->multihead_attn, ly->dropout2, in[1], opt[1], opt[3]};
    FSDP_TRY(rc, fail, residual(ly, ly->norm1, attn_block, &sa, in[0], &x));
    FSDP_TRY(rc, fail, residual(ly, ly->norm2, attn_block, &ca, x, &y));
    FSDP_TRY(rc, fail, residual(ly, ly->norm3, ff_block, ly->dropout3, y, out));
fail:
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    return rc;
}

static const fsdp_module_ops_t decoder_layer_ops = {
    .type = "TransformerDecoderLayer",
    .forward = decoder_layer_forward,
    .destroy = NULL,
};

int fsdp_transformer_decoder_layer_create(fsdp_ctx_t *ctx, const fsdp_transformer_config_t *cfg,
                                          fsdp_module_t **m) {
    fsdp_module_t *mod = NULL;
    struct layer *ly = NULL;
    int rc;
    if (!m)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_transformer_decoder_layer_create: m is NULL");
    *m = NULL;
    if (!ctx) return FSDP_EINVAL;
    FSDP_TRY(rc, fail, check_config(ctx, "fsdp_transformer_decoder_layer_create", cfg));
    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &decoder_layer_ops, sizeof *ly, &mod, (void **)&ly));
    FSDP_TRY(rc, fail, layer_init(mod, ly, cfg, true));
    *m = mod;
    return FSDP_OK;
fail:
    fsdp_module_release(mod);
    return rc;
}

/* The number of inputs to pass: one past the last non-NULL entry, at least min. */
static int count_inputs(fsdp_tensor_t *const *in, int n, int min) {
    while (n > min && !in[n - 1])
        n--;
    return n;
}

int fsdp_transformer_decoder_layer_forward(fsdp_module_t *m, fsdp_tensor_t *tgt,
                                           fsdp_tensor_t *memory, fsdp_tensor_t *tgt_mask,
                                           fsdp_tensor_t *memory_mask,
                                           fsdp_tensor_t *tgt_key_padding_mask,
                                           fsdp_tensor_t *memory_key_padding_mask,
                                           fsdp_tensor_t **out) {
    if (!m || !out) return FSDP_EINVAL;
    *out = NULL;
    if (fsdp_module_ops(m) != &decoder_layer_ops)
        return fsdp__module_err(m, FSDP_EINVAL, "not a TransformerDecoderLayer");
    fsdp_tensor_t *in[6] = {
        tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask};
    return fsdp_module_forward(m, count_inputs(in, 6, 2), in, 1, out);
}

/* ---- TransformerEncoder and TransformerDecoder ----------------------------------------------- */

/* Runs every layer with in[1..nin) as the other inputs (masks, memory), then the norm. */
static int stack_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                         fsdp_tensor_t **out) {
    const struct stack *st = fsdp_module_impl(m);
    bool decoder = st->decoder;
    fsdp_tensor_t *args[6] = {NULL, NULL, NULL, NULL, NULL, NULL}, *x = NULL, *y = NULL;
    int rc = fsdp__module_check_io(m, nin, in, decoder ? 2 : 1, decoder ? 6 : 3, nout, 1);
    if (rc < 0) return rc;
    out[0] = NULL;
    for (int i = 1; i < nin; i++)
        args[i] = in[i];
    x = fsdp_tensor_retain(in[0]);
    size_t n = fsdp_module_num_children(st->layers);
    for (size_t i = 0; i < n; i++) {
        args[0] = x;
        FSDP_TRY(rc, fail,
                 fsdp_module_forward(fsdp_module_child_at(st->layers, i, NULL), nin, args, 1, &y));
        fsdp_tensor_release(x);
        x = y;
        y = NULL;
    }
    if (st->norm) {
        FSDP_TRY(rc, fail, fsdp_module_forward1(st->norm, x, out));
    } else {
        out[0] = x;
        x = NULL;
    }
fail:
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    return rc;
}

static const fsdp_module_ops_t encoder_ops = {
    .type = "TransformerEncoder",
    .forward = stack_forward,
    .destroy = NULL,
};

static const fsdp_module_ops_t decoder_ops = {
    .type = "TransformerDecoder",
    .forward = stack_forward,
    .destroy = NULL,
};

static int stack_create(fsdp_ctx_t *ctx, const fsdp_transformer_config_t *cfg, int64_t num_layers,
                        bool final_norm, bool decoder, fsdp_module_t **m) {
    const char *fn =
        decoder ? "fsdp_transformer_decoder_create" : "fsdp_transformer_encoder_create";
    fsdp_module_t *mod = NULL, *c = NULL;
    struct stack *st = NULL;
    int rc;
    if (!m) return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: m is NULL", fn);
    *m = NULL;
    if (!ctx) return FSDP_EINVAL;
    FSDP_TRY(rc, fail, check_config(ctx, fn, cfg));
    if (num_layers < 0) {
        rc = fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: num_layers %lld is negative", fn,
                           (long long)num_layers);
        goto fail;
    }
    FSDP_TRY(rc, fail,
             fsdp__module_new(ctx, decoder ? &decoder_ops : &encoder_ops, sizeof *st, &mod,
                              (void **)&st));
    st->decoder = decoder;
    FSDP_TRY(rc, fail, fsdp_modulelist_create(ctx, &c));
    FSDP_TRY(rc, fail, adopt(mod, "layers", c, &st->layers));
    /* Every copy starts where the prototype started; the stream ends where one layer left it
     * (PyTorch builds one layer and deep-copies it, even zero times). */
    fsdp_rng_t *rng = fsdp_ctx_rng(ctx);
    fsdp_rng_t start = *rng, after = *rng;
    for (int64_t i = 0; i < (num_layers > 0 ? num_layers : 1); i++) {
        *rng = start;
        if (decoder)
            rc = fsdp_transformer_decoder_layer_create(ctx, cfg, &c);
        else
            rc = fsdp_transformer_encoder_layer_create(ctx, cfg, &c);
        if (rc < 0) goto restore;
        if (i == 0) after = *rng;
        if (num_layers == 0) {
            fsdp_module_release(c);
            break;
        }
        rc = fsdp_module_append(st->layers, c);
        fsdp_module_release(c);
        if (rc < 0) goto restore;
    }
    *rng = after;
    if (final_norm) {
        FSDP_TRY(rc, fail, fsdp_layernorm_create(ctx, cfg->d_model, cfg->layer_norm_eps, true, &c));
        FSDP_TRY(rc, fail, adopt(mod, "norm", c, &st->norm));
    }
    *m = mod;
    return FSDP_OK;
restore:
    *rng = after;
fail:
    fsdp_module_release(mod);
    return rc;
}

int fsdp_transformer_encoder_create(fsdp_ctx_t *ctx, const fsdp_transformer_config_t *cfg,
                                    int64_t num_layers, bool final_norm, fsdp_module_t **m) {
    return stack_create(ctx, cfg, num_layers, final_norm, false, m);
}

int fsdp_transformer_decoder_create(fsdp_ctx_t *ctx, const fsdp_transformer_config_t *cfg,
                                    int64_t num_layers, bool final_norm, fsdp_module_t **m) {
    return stack_create(ctx, cfg, num_layers, final_norm, true, m);
}

int fsdp_transformer_encoder_forward(fsdp_module_t *m, fsdp_tensor_t *src, fsdp_tensor_t *mask,
                                     fsdp_tensor_t *src_key_padding_mask, fsdp_tensor_t **out) {
    if (!m || !out) return FSDP_EINVAL;
    *out = NULL;
    if (fsdp_module_ops(m) != &encoder_ops)
        return fsdp__module_err(m, FSDP_EINVAL, "not a TransformerEncoder");
    fsdp_tensor_t *in[3] = {src, mask, src_key_padding_mask};
    return fsdp_module_forward(m, count_inputs(in, 3, 1), in, 1, out);
}

int fsdp_transformer_decoder_forward(fsdp_module_t *m, fsdp_tensor_t *tgt, fsdp_tensor_t *memory,
                                     fsdp_tensor_t *tgt_mask, fsdp_tensor_t *memory_mask,
                                     fsdp_tensor_t *tgt_key_padding_mask,
                                     fsdp_tensor_t *memory_key_padding_mask, fsdp_tensor_t **out) {
    if (!m || !out) return FSDP_EINVAL;
    *out = NULL;
    if (fsdp_module_ops(m) != &decoder_ops)
        return fsdp__module_err(m, FSDP_EINVAL, "not a TransformerDecoder");
    fsdp_tensor_t *in[6] = {
        tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask};
    return fsdp_module_forward(m, count_inputs(in, 6, 2), in, 1, out);
}

/* ---- Transformer ----------------------------------------------------------------------------- */

/* Inputs: src, tgt[, src_mask[, tgt_mask[, memory_mask[, src_key_padding_mask[,
 * tgt_key_padding_mask[, memory_key_padding_mask]]]]]]. */
static int transformer_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                               fsdp_tensor_t **out) {
    const struct transformer *tr = fsdp_module_impl(m);
    fsdp_tensor_t *memory = NULL;
    int rc = fsdp__module_check_io(m, nin, in, 2, 8, nout, 1);
    if (rc < 0) return rc;
    out[0] = NULL;
    fsdp_tensor_t *a[8] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    for (int i = 0; i < nin; i++)
        a[i] = in[i];
    fsdp_tensor_t *src = a[0], *tgt = a[1];
    int nd = fsdp_tensor_ndim(src), bd = tr->batch_first ? 0 : 1;
    if (nd == 3 && fsdp_tensor_size(src, bd) != fsdp_tensor_size(tgt, bd)) {
        char d0[160], d1[160];
        return fsdp__module_err(
            m, FSDP_EINVAL, "the batch number of src %s and tgt %s must be equal",
            fsdp_tensor_describe(src, d0, sizeof d0), fsdp_tensor_describe(tgt, d1, sizeof d1));
    }
    if (fsdp_tensor_size(src, -1) != tr->d_model || fsdp_tensor_size(tgt, -1) != tr->d_model) {
        char d0[160], d1[160];
        return fsdp__module_err(m, FSDP_EINVAL,
                                "the feature number of src %s and tgt %s must be d_model %lld",
                                fsdp_tensor_describe(src, d0, sizeof d0),
                                fsdp_tensor_describe(tgt, d1, sizeof d1), (long long)tr->d_model);
    }
    fsdp_tensor_t *enc_in[3] = {src, a[2], a[5]};
    FSDP_TRY(rc, fail,
             fsdp_module_forward(tr->encoder, count_inputs(enc_in, 3, 1), enc_in, 1, &memory));
    fsdp_tensor_t *dec_in[6] = {tgt, memory, a[3], a[4], a[6], a[7]};
    FSDP_TRY(rc, fail,
             fsdp_module_forward(tr->decoder, count_inputs(dec_in, 6, 2), dec_in, 1, out));
fail:
    fsdp_tensor_release(memory);
    return rc;
}

static const fsdp_module_ops_t transformer_ops = {
    .type = "Transformer",
    .forward = transformer_forward,
    .destroy = NULL,
};

/* _reset_parameters: xavier_uniform_ (gain 1) on every parameter with more than one
 * dimension, in parameter order. */
static int reset_parameters(fsdp_module_t *m) {
    fsdp_named_list_t list = {0};
    int rc = fsdp_module_named_params(m, false, &list);
    if (rc < 0) return rc;
    for (size_t i = 0; i < list.n && rc == 0; i++) {
        fsdp_tensor_t *t = list.tensors[i];
        int nd = fsdp_tensor_ndim(t);
        if (nd < 2) continue;
        int64_t receptive = 1;
        for (int d = 2; d < nd; d++)
            receptive *= fsdp_tensor_size(t, d);
        double fan_in = (double)(fsdp_tensor_size(t, 1) * receptive);
        double fan_out = (double)(fsdp_tensor_size(t, 0) * receptive);
        double bound = sqrt(6.0 / (fan_in + fan_out));
        rc = fsdp_tensor_uniform_(t, -bound, bound);
    }
    fsdp_named_list_free(&list);
    return rc;
}

int fsdp_transformer_create(fsdp_ctx_t *ctx, const fsdp_transformer_config_t *cfg,
                            fsdp_module_t **m) {
    fsdp_module_t *mod = NULL, *c = NULL;
    struct transformer *tr = NULL;
    int rc;
    if (!m) return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_transformer_create: m is NULL");
    *m = NULL;
    if (!ctx) return FSDP_EINVAL;
    FSDP_TRY(rc, fail, check_config(ctx, "fsdp_transformer_create", cfg));
    FSDP_TRY(rc, fail, fsdp__module_new(ctx, &transformer_ops, sizeof *tr, &mod, (void **)&tr));
    tr->d_model = cfg->d_model;
    tr->batch_first = cfg->batch_first;
    FSDP_TRY(rc, fail, stack_create(ctx, cfg, cfg->num_encoder_layers, true, false, &c));
    FSDP_TRY(rc, fail, adopt(mod, "encoder", c, &tr->encoder));
    FSDP_TRY(rc, fail, stack_create(ctx, cfg, cfg->num_decoder_layers, true, true, &c));
    FSDP_TRY(rc, fail, adopt(mod, "decoder", c, &tr->decoder));
    FSDP_TRY(rc, fail, reset_parameters(mod));
    *m = mod;
    return FSDP_OK;
fail:
    fsdp_module_release(mod);
    return rc;
}

int fsdp_transformer_forward(fsdp_module_t *m, fsdp_tensor_t *src, fsdp_tensor_t *tgt,
                             fsdp_tensor_t *src_mask, fsdp_tensor_t *tgt_mask,
                             fsdp_tensor_t *memory_mask, fsdp_tensor_t *src_key_padding_mask,
                             fsdp_tensor_t *tgt_key_padding_mask,
                             fsdp_tensor_t *memory_key_padding_mask, fsdp_tensor_t **out) {
    if (!m || !out) return FSDP_EINVAL;
    *out = NULL;
    if (fsdp_module_ops(m) != &transformer_ops)
        return fsdp__module_err(m, FSDP_EINVAL, "not a Transformer");
    fsdp_tensor_t *in[8] = {src,
                            tgt,
                            src_mask,
                            tgt_mask,
                            memory_mask,
                            src_key_padding_mask,
                            tgt_key_padding_mask,
                            memory_key_padding_mask};
    return fsdp_module_forward(m, count_inputs(in, 8, 2), in, 1, out);
}
