/*
 * t_bert.c: the BERT masked-LM model (fsdp/bert.h) against PyTorch, and its properties.
 *
 * tests/golden/bert.bin (written by tests/golden/gen_bert.py, Hugging Face's BertForMaskedLM
 * rewritten in plain torch, with the pooler) holds a tiny configuration, the state dict, inputs
 * with padding, masked-LM labels with -100 entries, the encoder output, the logits, the pooled
 * output, the loss and the gradient of loss + sum(pooled * gpooled) for every parameter. This
 * program checks:
 *   - structure: parameter names and shapes in PyTorch's named_parameters() order, state-dict
 *     keys in PyTorch's order (tied aliases included, non-persistent buffers not), module types,
 *     the tied decoder weight and bias (one tensor, one gradient), the config accessor;
 *   - BERT forward/backward vs PyTorch: sequence output, logits, pooled output, loss and every
 *     gradient after loading PyTorch's state dict strictly;
 *   - the pooler gets no gradient from the masked-LM loss alone (PyTorch's None);
 *   - optional inputs: token_type_ids NULL equals zeros, attention_mask NULL equals all ones, a
 *     u8 or float mask equals the int64 one;
 *   - the padding mask: changing a padded token changes no unpadded output, changing an unpadded
 *     token does, and without the mask the padded token is seen;
 *   - dropout: eval mode ignores it, train mode draws reproducible masks from the seed;
 *   - Hugging Face's initialisation (statistics, zero padding row, reproducible from the seed);
 *   - add_pooling_layer false (Hugging Face's BertForMaskedLM key set exactly);
 *   - every child runs through fsdp_module_forward (forward hooks fire);
 *   - configuration and input errors: FSDP_EINVAL naming the field or argument, no output, and
 *     (under ASan) nothing leaked.
 *
 * Tolerance: |got - want| <= atol + rtol |want| with the spec's fp32 rtol 1.3e-6, atol 1e-5.
 * Comparisons between two libfsdp runs that must agree exactly are bitwise.
 */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/autograd.h>
#include <fsdp/bert.h>
#include <fsdp/context.h>
#include <fsdp/errno.h>
#include <fsdp/nn.h>
#include <fsdp/rng.h>
#include <fsdp/tensor.h>

#include "golden.h"
#include "tap.h"

#ifndef GOLDEN_DIR
#define GOLDEN_DIR "tests/golden"
#endif

#define RTOL 1.3e-6
#define ATOL 1e-5
#define WHAT "BERT forward/backward vs PyTorch"

static golden_t *G;
static fsdp_ctx_t *CTX;

/* ---- helpers --------------------------------------------------------------------------------- */

static const golden_rec_t *rec(const char *key) {
    return golden_findf(G, "bert", key);
}

static fsdp_tensor_t *gtensor(const char *key) {
    return golden_tensor(CTX, rec(key));
}

static void golden_config(fsdp_bert_config_t *c) {
    fsdp_bert_config_init(c);
    c->vocab_size = (int64_t)golden_value(rec("p/vocab_size"), 0);
    c->hidden_size = (int64_t)golden_value(rec("p/hidden_size"), 0);
    c->num_hidden_layers = (int64_t)golden_value(rec("p/num_hidden_layers"), 0);
    c->num_attention_heads = (int64_t)golden_value(rec("p/num_attention_heads"), 0);
    c->intermediate_size = (int64_t)golden_value(rec("p/intermediate_size"), 0);
    c->max_position_embeddings = (int64_t)golden_value(rec("p/max_position_embeddings"), 0);
    c->type_vocab_size = (int64_t)golden_value(rec("p/type_vocab_size"), 0);
    c->layer_norm_eps = golden_value(rec("p/layer_norm_eps"), 0);
    c->hidden_dropout_prob = golden_value(rec("p/hidden_dropout_prob"), 0);
    c->attention_probs_dropout_prob = golden_value(rec("p/attention_probs_dropout_prob"), 0);
    c->pad_token_id = (int64_t)golden_value(rec("p/pad_token_id"), 0);
    c->initializer_range = golden_value(rec("p/initializer_range"), 0);
    c->add_pooling_layer = true;
}

/* The golden state dict ("bert/init/<key>" records in file order) as an owned list. */
static int golden_state_dict(fsdp_named_list_t *sd) {
    const char *prefix = "bert/init/";
    size_t plen = strlen(prefix), cap = 0;
    memset(sd, 0, sizeof *sd);
    sd->owned = true;
    for (int i = 0; i < golden_count(G); i++) {
        const golden_rec_t *r = golden_at(G, i);
        if (strncmp(r->name, prefix, plen) != 0) continue;
        if (sd->n == cap) {
            cap = cap ? 2 * cap : 64;
            char **nn = realloc(sd->names, cap * sizeof *nn);
            if (nn) sd->names = nn;
            fsdp_tensor_t **nt = realloc(sd->tensors, cap * sizeof *nt);
            if (nt) sd->tensors = nt;
            if (!nn || !nt) return FSDP_ENOMEM;
        }
        char *name = strdup(r->name + plen);
        fsdp_tensor_t *t = golden_tensor(CTX, r);
        if (!name || !t) {
            free(name);
            fsdp_tensor_release(t);
            return FSDP_ENOMEM;
        }
        sd->names[sd->n] = name;
        sd->tensors[sd->n] = t;
        sd->n++;
    }
    return FSDP_OK;
}

/* The tiny golden model with PyTorch's weights (strict load unless !strict). */
static int build_loaded(const fsdp_bert_config_t *cfg, bool strict, fsdp_module_t **m) {
    fsdp_named_list_t sd = {0};
    int rc = fsdp_bert_create(CTX, cfg, m);
    if (rc == 0) rc = golden_state_dict(&sd);
    if (rc == 0) rc = fsdp_module_load_state_dict(*m, &sd, strict);
    fsdp_named_list_free(&sd);
    if (rc < 0) {
        fsdp_module_release(*m);
        *m = NULL;
    }
    return rc;
}

/* A host copy of t's elements as floats (NULL on failure); *n receives the count. */
static float *host_f32(const fsdp_tensor_t *t, size_t *n) {
    *n = t ? (size_t)fsdp_tensor_numel(t) : 0;
    if (!t || fsdp_tensor_dtype(t) != FSDP_DTYPE_F32) return NULL;
    float *h = malloc(*n ? *n * sizeof *h : 1);
    if (h && fsdp_tensor_to_host(t, h, *n * sizeof *h) < 0) {
        free(h);
        h = NULL;
    }
    return h;
}

/* Whether elements [from, to) of a and b are bitwise equal (both f32 of equal numel). */
static bool same_range(const fsdp_tensor_t *a, const fsdp_tensor_t *b, size_t from, size_t to) {
    size_t na, nb;
    float *ha = host_f32(a, &na), *hb = host_f32(b, &nb);
    bool same = ha && hb && na == nb && to <= na && from <= to &&
                memcmp(ha + from, hb + from, (to - from) * sizeof *ha) == 0;
    free(ha);
    free(hb);
    return same;
}

static bool same_all(const fsdp_tensor_t *a, const fsdp_tensor_t *b) {
    return a && b && fsdp_tensor_numel(a) == fsdp_tensor_numel(b) &&
           same_range(a, b, 0, (size_t)fsdp_tensor_numel(a));
}

/* The golden input_ids with element (b, s) set to v. */
static fsdp_tensor_t *ids_with(int64_t b, int64_t s, int64_t v) {
    const golden_rec_t *r = rec("input/input_ids");
    int64_t *h = malloc((size_t)r->bytes);
    fsdp_tensor_t *t = NULL;
    if (!h) return NULL;
    memcpy(h, r->data, r->bytes);
    h[b * r->shape[1] + s] = v;
    if (fsdp_tensor_from_host(CTX, FSDP_DTYPE_I64, 2, r->shape, h, FSDP_MEM_OTHER, &t) < 0)
        t = NULL;
    free(h);
    return t;
}

/* The golden attention mask converted to dtype dt. */
static fsdp_tensor_t *mask_as(fsdp_dtype_t dt) {
    fsdp_tensor_t *m = gtensor("input/attention_mask"), *out = NULL;
    if (m && fsdp_to_dtype(m, dt, &out) < 0) out = NULL;
    fsdp_tensor_release(m);
    return out;
}

typedef struct inputs {
    fsdp_tensor_t *ids, *types, *mask, *labels, *gpooled;
} inputs_t;

static int inputs_load(inputs_t *in) {
    in->ids = gtensor("input/input_ids");
    in->types = gtensor("input/token_type_ids");
    in->mask = gtensor("input/attention_mask");
    in->labels = gtensor("input/labels");
    in->gpooled = gtensor("input/gpooled");
    return in->ids && in->types && in->mask && in->labels && in->gpooled ? 0 : FSDP_EINVAL;
}

static void inputs_free(inputs_t *in) {
    fsdp_tensor_release(in->ids);
    fsdp_tensor_release(in->types);
    fsdp_tensor_release(in->mask);
    fsdp_tensor_release(in->labels);
    fsdp_tensor_release(in->gpooled);
    memset(in, 0, sizeof *in);
}

/* The largest error seen against PyTorch, for the "# worst" line. */
static double WORST_RATIO, WORST_ABS;
static char WORST_WHAT[300];

/* golden_check, tracking the largest |got - want| / (atol + rtol |want|). */
static int check(const char *what, const fsdp_tensor_t *got, const golden_rec_t *want) {
    size_t n;
    float *g = host_f32(got, &n);
    if (g && want && want->dtype == FSDP_DTYPE_F32 && (int64_t)n == want->numel) {
        const float *w = want->data;
        for (size_t i = 0; i < n; i++) {
            double d = fabs((double)g[i] - (double)w[i]);
            double r = d / (ATOL + RTOL * fabs((double)w[i]));
            if (d > WORST_ABS) WORST_ABS = d;
            if (r > WORST_RATIO) {
                WORST_RATIO = r;
                snprintf(WORST_WHAT, sizeof WORST_WHAT, "%.200s[%zu]", want->name, i);
            }
        }
    }
    free(g);
    return golden_check(what, got, want, RTOL, ATOL);
}

static void diag_err(int rc) {
    tap_diag("%s: %s", fsdp_strerror(rc), fsdp_ctx_last_error(CTX));
}

/* ---- configuration --------------------------------------------------------------------------- */

static void test_config_defaults(void) {
    fsdp_bert_config_t c;
    memset(&c, 0xff, sizeof c);
    fsdp_bert_config_init(&c);
    tap_ok(c.vocab_size == 30522 && c.hidden_size == 768 && c.num_hidden_layers == 12 &&
               c.num_attention_heads == 12 && c.intermediate_size == 3072 &&
               c.max_position_embeddings == 512 && c.type_vocab_size == 2 &&
               c.layer_norm_eps == 1e-12 && c.hidden_dropout_prob == 0.1 &&
               c.attention_probs_dropout_prob == 0.1 && c.pad_token_id == 0 &&
               c.initializer_range == 0.02 && c.add_pooling_layer,
           "fsdp_bert_config_init gives Hugging Face's BertConfig defaults");
    tap_is_int(fsdp_bert_config_check(CTX, &c), 0, "the defaults pass fsdp_bert_config_check");
}

typedef struct bad_field {
    const char *field;
    void (*set)(fsdp_bert_config_t *c);
} bad_field_t;

static void bad_vocab(fsdp_bert_config_t *c) {
    c->vocab_size = 0;
}
static void bad_hidden(fsdp_bert_config_t *c) {
    c->hidden_size = -4;
}
static void bad_layers(fsdp_bert_config_t *c) {
    c->num_hidden_layers = -1;
}
static void bad_heads(fsdp_bert_config_t *c) {
    c->num_attention_heads = 0;
}
static void bad_divisible(fsdp_bert_config_t *c) {
    c->hidden_size = 30;
}
static void bad_intermediate(fsdp_bert_config_t *c) {
    c->intermediate_size = 0;
}
static void bad_positions(fsdp_bert_config_t *c) {
    c->max_position_embeddings = 0;
}
static void bad_types(fsdp_bert_config_t *c) {
    c->type_vocab_size = 0;
}
static void bad_eps(fsdp_bert_config_t *c) {
    c->layer_norm_eps = 0.0;
}
static void bad_eps_nan(fsdp_bert_config_t *c) {
    c->layer_norm_eps = NAN;
}
static void bad_hidden_drop(fsdp_bert_config_t *c) {
    c->hidden_dropout_prob = 1.0;
}
static void bad_attn_drop(fsdp_bert_config_t *c) {
    c->attention_probs_dropout_prob = -0.1;
}
static void bad_pad(fsdp_bert_config_t *c) {
    c->pad_token_id = c->vocab_size;
}
static void bad_pad_neg(fsdp_bert_config_t *c) {
    c->pad_token_id = -2;
}
static void bad_init(fsdp_bert_config_t *c) {
    c->initializer_range = -0.02;
}

static void test_config_errors(void) {
    static const bad_field_t bad[] = {
        {"vocab_size", bad_vocab},
        {"hidden_size", bad_hidden},
        {"num_hidden_layers", bad_layers},
        {"num_attention_heads", bad_heads},
        {"num_attention_heads", bad_divisible},
        {"intermediate_size", bad_intermediate},
        {"max_position_embeddings", bad_positions},
        {"type_vocab_size", bad_types},
        {"layer_norm_eps", bad_eps},
        {"layer_norm_eps", bad_eps_nan},
        {"hidden_dropout_prob", bad_hidden_drop},
        {"attention_probs_dropout_prob", bad_attn_drop},
        {"pad_token_id", bad_pad},
        {"pad_token_id", bad_pad_neg},
        {"initializer_range", bad_init},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fsdp_bert_config_t c;
        golden_config(&c);
        bad[i].set(&c);
        fsdp_module_t *m = (fsdp_module_t *)&c; /* must be reset to NULL */
        int rc = fsdp_bert_create(CTX, &c, &m);
        const char *msg = fsdp_ctx_last_error(CTX);
        bool named = strstr(msg, bad[i].field) != NULL;
        tap_ok_why(rc == FSDP_EINVAL && m == NULL && named, msg,
                   "fsdp_bert_create: bad %s (case %zu) is FSDP_EINVAL naming it, no module",
                   bad[i].field, i);
        fsdp_module_release(rc == 0 ? m : NULL);
    }
    fsdp_module_t *m = NULL;
    int rc = fsdp_bert_create(CTX, NULL, &m);
    tap_ok(rc == FSDP_EINVAL && !m && strstr(fsdp_ctx_last_error(CTX), "cfg"),
           "fsdp_bert_create: a NULL cfg is FSDP_EINVAL naming cfg");
    fsdp_bert_config_t c;
    golden_config(&c);
    c.hidden_dropout_prob = 2.0;
    rc = fsdp_bert_config_check(NULL, &c);
    tap_is_int(rc, FSDP_EINVAL, "fsdp_bert_config_check without a context still says no");
}

/* ---- structure ------------------------------------------------------------------------------- */

static void test_structure(fsdp_module_t *m) {
    fsdp_named_list_t params = {0}, sd = {0}, mods = {0}, bufs = {0}, al = {0};
    char detail[600] = "";
    /* Parameter names and shapes, in order, against the golden gradients' list. */
    int rc = fsdp_module_named_params(m, false, &params);
    size_t k = 0;
    bool ok = rc == 0;
    const char *gp = "bert/grad/";
    for (int i = 0; ok && i < golden_count(G); i++) {
        const golden_rec_t *r = golden_at(G, i);
        if (strncmp(r->name, gp, strlen(gp)) != 0) continue;
        const char *want = r->name + strlen(gp);
        if (k >= params.n || strcmp(params.names[k], want) != 0) {
            snprintf(detail, sizeof detail, "parameter %zu: got %s, want %s", k,
                     k < params.n ? params.names[k] : "(none)", want);
            ok = false;
            break;
        }
        fsdp_tensor_t *t = params.tensors[k];
        bool shape = fsdp_tensor_ndim(t) == r->ndim;
        for (int d = 0; shape && d < r->ndim; d++)
            shape = fsdp_tensor_size(t, d) == r->shape[d];
        if (!shape) {
            snprintf(detail, sizeof detail, "%s: shape differs from PyTorch's", want);
            ok = false;
        }
        k++;
    }
    tap_ok_why(ok && k == params.n && k == 44, detail,
               "parameter names and shapes are PyTorch's named_parameters(), in order (%zu)", k);

    /* State-dict keys in order, aliases included, against the golden state dict. */
    rc = fsdp_module_state_dict(m, &sd);
    k = 0;
    ok = rc == 0;
    const char *ip = "bert/init/";
    detail[0] = 0;
    for (int i = 0; ok && i < golden_count(G); i++) {
        const char *name = golden_at(G, i)->name;
        if (strncmp(name, ip, strlen(ip)) != 0) continue;
        if (k >= sd.n || strcmp(sd.names[k], name + strlen(ip)) != 0) {
            snprintf(detail, sizeof detail, "key %zu: got %s, want %s", k,
                     k < sd.n ? sd.names[k] : "(none)", name + strlen(ip));
            ok = false;
        }
        k++;
    }
    tap_ok_why(ok && k == sd.n && k == 46, detail,
               "state-dict keys are PyTorch's state_dict() keys, in order, with "
               "cls.predictions.decoder.{weight,bias} (%zu)",
               k);

    /* Module types. */
    static const char *const types[][2] = {
        {"bert", "BertModel"},
        {"bert.embeddings", "BertEmbeddings"},
        {"bert.embeddings.word_embeddings", "Embedding"},
        {"bert.embeddings.LayerNorm", "LayerNorm"},
        {"bert.encoder", "BertEncoder"},
        {"bert.encoder.layer", "ModuleList"},
        {"bert.encoder.layer.0", "BertLayer"},
        {"bert.encoder.layer.1", "BertLayer"},
        {"bert.encoder.layer.0.attention", "BertAttention"},
        {"bert.encoder.layer.0.attention.self", "BertSelfAttention"},
        {"bert.encoder.layer.0.attention.self.query", "Linear"},
        {"bert.encoder.layer.0.attention.output", "BertSelfOutput"},
        {"bert.encoder.layer.0.intermediate", "BertIntermediate"},
        {"bert.encoder.layer.0.output", "BertOutput"},
        {"bert.pooler", "BertPooler"},
        {"cls", "BertOnlyMLMHead"},
        {"cls.predictions", "BertLMPredictionHead"},
        {"cls.predictions.transform", "BertPredictionHeadTransform"},
        {"cls.predictions.decoder", "Linear"},
    };
    ok = strcmp(fsdp_module_type(m), "BertForMaskedLM") == 0;
    detail[0] = 0;
    for (size_t i = 0; ok && i < sizeof types / sizeof types[0]; i++) {
        fsdp_module_t *c = fsdp_module_child(m, types[i][0]);
        if (!c || strcmp(fsdp_module_type(c), types[i][1]) != 0) {
            snprintf(detail, sizeof detail, "%s: got %s, want %s", types[i][0],
                     c ? fsdp_module_type(c) : "(absent)", types[i][1]);
            ok = false;
        }
    }
    int nlayers = 0;
    if (fsdp_module_named_modules(m, &mods) == 0)
        for (size_t i = 0; i < mods.n; i++)
            nlayers += strcmp(fsdp_module_type(mods.modules[i]), "BertLayer") == 0;
    tap_ok_why(ok && nlayers == 2, detail,
               "module types are Hugging Face's class names; 2 BertLayer modules to select by "
               "type");

    /* Buffers: Hugging Face's non-persistent position_ids and token_type_ids. */
    rc = fsdp_module_named_buffers(m, false, &bufs);
    ok = rc == 0 && bufs.n == 2 && strcmp(bufs.names[0], "bert.embeddings.position_ids") == 0 &&
         strcmp(bufs.names[1], "bert.embeddings.token_type_ids") == 0;
    if (ok) {
        int64_t pos[16], tt[16];
        ok = fsdp_tensor_numel(bufs.tensors[0]) == 16 &&
             fsdp_tensor_to_host(bufs.tensors[0], pos, sizeof pos) == 0 &&
             fsdp_tensor_to_host(bufs.tensors[1], tt, sizeof tt) == 0;
        for (int i = 0; ok && i < 16; i++)
            ok = pos[i] == i && tt[i] == 0;
    }
    tap_ok(ok, "buffers position_ids = 0..15 and token_type_ids = 0, (1, 16) int64, not in the "
               "state dict");

    /* Tied parameters: one tensor under two names each. */
    fsdp_tensor_t *word = fsdp_module_param(m, "bert.embeddings.word_embeddings.weight");
    fsdp_tensor_t *dec = fsdp_module_param(m, "cls.predictions.decoder.weight");
    fsdp_tensor_t *bias = fsdp_module_param(m, "cls.predictions.bias");
    fsdp_tensor_t *dbias = fsdp_module_param(m, "cls.predictions.decoder.bias");
    tap_ok(word && word == dec && fsdp_tensor_same_storage(word, dec),
           "cls.predictions.decoder.weight is the word embedding tensor (shared storage)");
    tap_ok(bias && bias == dbias, "cls.predictions.decoder.bias is cls.predictions.bias");
    rc = fsdp_module_param_aliases(m, word, &al);
    tap_ok(rc == 0 && al.n == 2 &&
               strcmp(al.names[0], "bert.embeddings.word_embeddings.weight") == 0 &&
               strcmp(al.names[1], "cls.predictions.decoder.weight") == 0,
           "the word embedding has exactly the two names, embedding first");

    /* The configuration accessor. */
    const fsdp_bert_config_t *c = fsdp_bert_get_config(m);
    const fsdp_bert_config_t *cb = fsdp_bert_get_config(fsdp_module_child(m, "bert"));
    tap_ok(c && cb && c->hidden_size == 32 && c->num_hidden_layers == 2 && cb->vocab_size == 50 &&
               !fsdp_bert_get_config(fsdp_module_child(m, "bert.encoder.layer.0")) &&
               !fsdp_bert_get_config(NULL),
           "fsdp_bert_get_config: the root's and BertModel's configuration, NULL for others");

    fsdp_named_list_free(&params);
    fsdp_named_list_free(&sd);
    fsdp_named_list_free(&mods);
    fsdp_named_list_free(&bufs);
    fsdp_named_list_free(&al);
}

/* ---- against PyTorch ------------------------------------------------------------------------- */

static void test_golden(fsdp_module_t *m, const inputs_t *in) {
    fsdp_tensor_t *logits = NULL, *pooled = NULL, *loss = NULL, *seq = NULL, *pg = NULL,
                  *dot = NULL, *obj = NULL;
    fsdp_named_list_t params = {0};
    fsdp_module_train(m, false);
    fsdp_tensor_t *bin[3] = {in->ids, in->mask, in->types};
    int rc = fsdp_module_forward(fsdp_module_child(m, "bert"), 3, bin, 1, &seq);
    if (rc < 0) diag_err(rc);
    check(WHAT ": sequence_output (BertModel)", seq, rec("sequence_output"));
    fsdp_tensor_release(seq);

    rc = fsdp_bert_forward_loss(m, in->ids, in->mask, in->types, in->labels, &loss, &logits,
                                &pooled);
    if (!tap_ok(rc == 0, "fsdp_bert_forward_loss runs on the golden inputs")) {
        diag_err(rc);
        tap_skip(48, "no forward");
        goto out;
    }
    check(WHAT ": logits", logits, rec("logits"));
    check(WHAT ": pooled output", pooled, rec("pooled"));
    check(WHAT ": masked-LM loss (ignore_index -100)", loss, rec("loss"));
    /* objective = loss + sum(pooled * gpooled), differentiated in one backward. */
    rc = fsdp_mul(pooled, in->gpooled, &pg);
    if (rc == 0) rc = fsdp_sum(pg, 0, NULL, false, &dot);
    if (rc == 0) rc = fsdp_add(loss, dot, &obj);
    check(WHAT ": objective loss + sum(pooled * gpooled)", obj, rec("objective"));
    rc = fsdp_module_zero_grad(m, true);
    if (rc == 0) rc = fsdp_backward(obj, NULL);
    if (!tap_ok(rc == 0, "backward of the objective runs")) diag_err(rc);
    rc = fsdp_module_named_params(m, false, &params);
    for (size_t i = 0; rc == 0 && i < params.n; i++) {
        char key[300], what[400];
        snprintf(key, sizeof key, "grad/%s", params.names[i]);
        snprintf(what, sizeof what, WHAT ": grad %s", params.names[i]);
        check(what, fsdp_tensor_grad(params.tensors[i]), rec(key));
    }
    fsdp_tensor_t *word = fsdp_module_param(m, "bert.embeddings.word_embeddings.weight");
    fsdp_tensor_t *dec = fsdp_module_param(m, "cls.predictions.decoder.weight");
    tap_ok(fsdp_tensor_grad(word) && fsdp_tensor_grad(word) == fsdp_tensor_grad(dec),
           "the tied decoder and the word embedding have one gradient (embedding + head)");
    tap_diag("worst against PyTorch: |diff| %.3g, %.3g x tolerance at %s", WORST_ABS, WORST_RATIO,
             WORST_WHAT[0] ? WORST_WHAT : "-");
out:
    fsdp_named_list_free(&params);
    fsdp_tensor_release(logits);
    fsdp_tensor_release(pooled);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(pg);
    fsdp_tensor_release(dot);
    fsdp_tensor_release(obj);
    fsdp_module_zero_grad(m, true);
}

/* The masked-LM loss alone: the pooler is not run and gets no gradient (PyTorch: None). */
static void test_pooler_unused(fsdp_module_t *m, const inputs_t *in) {
    fsdp_tensor_t *loss = NULL;
    fsdp_module_zero_grad(m, true);
    int rc = fsdp_bert_forward_loss(m, in->ids, in->mask, in->types, in->labels, &loss, NULL, NULL);
    if (rc == 0) rc = fsdp_backward(loss, NULL);
    tap_ok(rc == 0 && !fsdp_tensor_grad(fsdp_module_param(m, "bert.pooler.dense.weight")) &&
               !fsdp_tensor_grad(fsdp_module_param(m, "bert.pooler.dense.bias")) &&
               fsdp_tensor_grad(fsdp_module_param(m, "cls.predictions.bias")) &&
               fsdp_tensor_grad(fsdp_module_param(m, "bert.embeddings.LayerNorm.weight")),
           "masked-LM loss alone: no pooler gradient (None in PyTorch), the others have one");
    fsdp_tensor_release(loss);
    fsdp_module_zero_grad(m, true);
}

/* ---- optional inputs and the padding mask ---------------------------------------------------- */

/* Logits of m in eval mode (NULL on failure, with a diagnostic). */
static fsdp_tensor_t *logits_of(fsdp_module_t *m, fsdp_tensor_t *ids, fsdp_tensor_t *mask,
                                fsdp_tensor_t *types, fsdp_tensor_t **pooled) {
    fsdp_tensor_t *lg = NULL;
    int rc = fsdp_bert_forward(m, ids, mask, types, &lg, pooled);
    if (rc < 0) diag_err(rc);
    return lg;
}

static void test_optional_inputs(fsdp_module_t *m, const inputs_t *in) {
    fsdp_tensor_t *zeros = NULL, *ones = NULL;
    const int64_t *shape = fsdp_tensor_shape(in->ids);
    fsdp_tensor_zeros(CTX, FSDP_DTYPE_I64, 2, shape, FSDP_MEM_OTHER, &zeros);
    fsdp_tensor_full(CTX, FSDP_DTYPE_I64, 2, shape, 1.0, FSDP_MEM_OTHER, &ones);
    fsdp_module_train(m, false);
    fsdp_tensor_t *a = logits_of(m, in->ids, in->mask, NULL, NULL);
    fsdp_tensor_t *b = logits_of(m, in->ids, in->mask, zeros, NULL);
    tap_ok(a && b && same_all(a, b), "token_type_ids NULL gives the logits of all-zero types");
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    a = logits_of(m, in->ids, NULL, in->types, NULL);
    b = logits_of(m, in->ids, ones, in->types, NULL);
    tap_ok(a && b && same_all(a, b), "attention_mask NULL gives the logits of an all-ones mask");
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    a = logits_of(m, in->ids, in->mask, in->types, NULL);
    static const fsdp_dtype_t dts[3] = {FSDP_DTYPE_U8, FSDP_DTYPE_BOOL, FSDP_DTYPE_F32};
    for (int i = 0; i < 3; i++) {
        fsdp_tensor_t *mk = mask_as(dts[i]);
        b = logits_of(m, in->ids, mk, in->types, NULL);
        tap_ok(a && b && same_all(a, b), "a %s attention_mask gives the int64 mask's logits",
               fsdp_dtype_name(dts[i]));
        fsdp_tensor_release(mk);
        fsdp_tensor_release(b);
    }
    fsdp_tensor_release(a);
    fsdp_tensor_release(zeros);
    fsdp_tensor_release(ones);
}

static void test_padding_mask(fsdp_module_t *m, const inputs_t *in) {
    /* Sequence 1 is padded from position 7, sequence 2 from position 4 (gen_bert.py). */
    const int64_t S = fsdp_tensor_size(in->ids, 1), V = 50, H = 32;
    const golden_rec_t *am = rec("input/attention_mask");
    tap_ok(am && golden_value(am, 1 * S + 6) == 1 && golden_value(am, 1 * S + 7) == 0 &&
               golden_value(am, 2 * S + 3) == 1 && golden_value(am, 2 * S + 4) == 0,
           "golden mask: sequence 1 padded from position 7, sequence 2 from 4");
    fsdp_module_train(m, false);
    fsdp_tensor_t *p0 = NULL, *p1 = NULL, *p2 = NULL, *p3 = NULL, *p4 = NULL;
    fsdp_tensor_t *base = logits_of(m, in->ids, in->mask, in->types, &p0);
    fsdp_tensor_t *ids_pad = ids_with(1, 8, 7);  /* a padded position of sequence 1 */
    fsdp_tensor_t *ids_real = ids_with(1, 2, 9); /* an unpadded position of sequence 1 */
    fsdp_tensor_t *pad = logits_of(m, ids_pad, in->mask, in->types, &p1);
    tap_ok(base && pad && same_range(base, pad, 0, (size_t)((S + 7) * V)) &&
               same_range(base, pad, (size_t)(2 * S * V), (size_t)(3 * S * V)) && same_all(p0, p1),
           "changing a padded token leaves every unpadded position's logits and the pooled "
           "output bitwise unchanged");
    tap_ok(base && pad && !same_range(base, pad, (size_t)((S + 8) * V), (size_t)((S + 9) * V)),
           "... while the padded position's own logits change");
    fsdp_tensor_t *real = logits_of(m, ids_real, in->mask, in->types, &p2);
    tap_ok(base && real && !same_range(base, real, (size_t)(S * V), (size_t)((S + 1) * V)) &&
               !same_range(p0, p2, (size_t)H, (size_t)(2 * H)) &&
               same_range(base, real, 0, (size_t)(S * V)),
           "changing an unpadded token changes the other positions of its sequence and its pooled "
           "output, not the other sequences");
    fsdp_tensor_t *nomask = logits_of(m, in->ids, NULL, in->types, &p3);
    fsdp_tensor_t *nomask_pad = logits_of(m, ids_pad, NULL, in->types, &p4);
    tap_ok(nomask && nomask_pad &&
               !same_range(nomask, nomask_pad, (size_t)(S * V), (size_t)((S + 1) * V)),
           "without the mask the same padded-token change reaches position 0 (the mask hides it)");
    fsdp_tensor_release(base);
    fsdp_tensor_release(pad);
    fsdp_tensor_release(real);
    fsdp_tensor_release(nomask);
    fsdp_tensor_release(nomask_pad);
    fsdp_tensor_release(ids_pad);
    fsdp_tensor_release(ids_real);
    fsdp_tensor_release(p0);
    fsdp_tensor_release(p1);
    fsdp_tensor_release(p2);
    fsdp_tensor_release(p3);
    fsdp_tensor_release(p4);
}

/* ---- errors ---------------------------------------------------------------------------------- */

static void expect_einval(int rc, fsdp_tensor_t *out, const char *needle, const char *what) {
    const char *msg = fsdp_ctx_last_error(CTX);
    tap_ok_why(rc == FSDP_EINVAL && !out && strstr(msg, needle), msg,
               "%s: FSDP_EINVAL naming %s, no output", what, needle);
}

static void test_forward_errors(fsdp_module_t *m, const inputs_t *in) {
    fsdp_tensor_t *lg = NULL, *pl = NULL, *loss = NULL, *f = NULL, *long_ids = NULL, *bad = NULL;
    fsdp_tensor_t *short_mask = NULL;
    fsdp_to_dtype(in->ids, FSDP_DTYPE_F32, &f);
    int rc = fsdp_bert_forward(m, f, NULL, NULL, &lg, NULL);
    expect_einval(rc, lg, "input_ids", "float input_ids");
    const int64_t s17[2] = {1, 17}, s29[2] = {3, 9};
    fsdp_tensor_zeros(CTX, FSDP_DTYPE_I64, 2, s17, FSDP_MEM_OTHER, &long_ids);
    rc = fsdp_bert_forward(m, long_ids, NULL, NULL, &lg, NULL);
    expect_einval(rc, lg, "max_position_embeddings", "17 tokens with 16 positions");
    fsdp_tensor_zeros(CTX, FSDP_DTYPE_I64, 2, s29, FSDP_MEM_OTHER, &short_mask);
    rc = fsdp_bert_forward(m, in->ids, short_mask, NULL, &lg, NULL);
    expect_einval(rc, lg, "attention_mask", "a (3, 9) attention_mask for (3, 10) ids");
    rc = fsdp_bert_forward(m, in->ids, NULL, short_mask, &lg, NULL);
    expect_einval(rc, lg, "token_type_ids", "(3, 9) token_type_ids");
    bad = ids_with(0, 0, 50);
    rc = fsdp_bert_forward(m, bad, NULL, NULL, &lg, NULL);
    expect_einval(rc, lg, "out of range", "token id 50 with a vocabulary of 50");
    fsdp_tensor_release(bad);
    bad = ids_with(0, 0, 2); /* as token types: 2 >= type_vocab_size */
    rc = fsdp_bert_forward(m, in->ids, NULL, bad, &lg, NULL);
    expect_einval(rc, lg, "out of range", "token type 2 with type_vocab_size 2");
    fsdp_tensor_release(bad);
    rc = fsdp_bert_forward(fsdp_module_child(m, "bert"), in->ids, NULL, NULL, &lg, NULL);
    expect_einval(rc, lg, "BertForMaskedLM", "fsdp_bert_forward on the BertModel child");
    rc = fsdp_bert_forward(m, in->ids, NULL, NULL, &lg, NULL);
    if (rc == 0) rc = fsdp_bert_mlm_loss(lg, in->gpooled, &loss);
    expect_einval(rc, loss, "labels", "fsdp_bert_mlm_loss with (3, 32) labels");
    fsdp_tensor_release(lg);
    lg = NULL;
    rc = fsdp_bert_forward_loss(m, in->ids, NULL, NULL, in->labels, NULL, &lg, &pl);
    tap_ok(rc == FSDP_EINVAL && !lg && !pl, "fsdp_bert_forward_loss with loss NULL: FSDP_EINVAL");
    fsdp_tensor_release(f);
    fsdp_tensor_release(long_ids);
    fsdp_tensor_release(short_mask);
}

/* ---- dropout --------------------------------------------------------------------------------- */

static void test_dropout(const inputs_t *in) {
    fsdp_bert_config_t cfg;
    fsdp_module_t *m = NULL;
    fsdp_tensor_t *ev = NULL, *a = NULL, *b = NULL, *c = NULL, *loss = NULL;
    fsdp_tensor_t *ga = NULL;
    golden_config(&cfg);
    cfg.hidden_dropout_prob = 0.1;
    cfg.attention_probs_dropout_prob = 0.1;
    int rc = build_loaded(&cfg, true, &m);
    if (!tap_ok(rc == 0, "a model with dropout 0.1 loads the golden state dict")) {
        diag_err(rc);
        tap_skip(4, "no model");
        return;
    }
    fsdp_module_train(m, false);
    ev = logits_of(m, in->ids, in->mask, in->types, NULL);
    golden_check("eval mode ignores dropout 0.1: logits match PyTorch's (dropout 0)", ev,
                 rec("logits"), RTOL, ATOL);
    fsdp_module_train(m, true);
    fsdp_rng_init(fsdp_ctx_rng(CTX), 1234, 0);
    a = logits_of(m, in->ids, in->mask, in->types, NULL);
    fsdp_rng_init(fsdp_ctx_rng(CTX), 1234, 0);
    b = logits_of(m, in->ids, in->mask, in->types, NULL);
    fsdp_rng_init(fsdp_ctx_rng(CTX), 4321, 0);
    c = logits_of(m, in->ids, in->mask, in->types, NULL);
    tap_ok(a && b && same_all(a, b) && !same_all(a, ev),
           "train mode: dropout changes the logits, and the same seed gives the same bits");
    tap_ok(a && c && !same_all(a, c), "train mode: another seed draws other dropout masks");
    /* A training step with dropout backpropagates through the same masks: same seed, same
     * gradient. */
    bool same_grad = true;
    for (int k = 0; k < 2 && same_grad; k++) {
        fsdp_module_zero_grad(m, true);
        fsdp_rng_init(fsdp_ctx_rng(CTX), 77, 0);
        rc = fsdp_bert_forward_loss(m, in->ids, in->mask, in->types, in->labels, &loss, NULL, NULL);
        if (rc == 0) rc = fsdp_backward(loss, NULL);
        fsdp_tensor_release(loss);
        loss = NULL;
        fsdp_tensor_t *g = fsdp_tensor_grad(
            fsdp_module_param(m, "bert.encoder.layer.0.attention.self.query.weight"));
        if (rc < 0 || !g) {
            same_grad = false;
        } else if (k == 0) {
            fsdp_tensor_clone(g, FSDP_MEM_OTHER, &ga);
        } else {
            same_grad = same_all(ga, g);
        }
    }
    tap_ok(same_grad, "train mode: forward and backward from one seed give the same gradient");
    fsdp_tensor_release(ev);
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    fsdp_tensor_release(c);
    fsdp_tensor_release(ga);
    fsdp_module_release(m);
}

/* ---- initialisation -------------------------------------------------------------------------- */

static void test_init(void) {
    fsdp_bert_config_t cfg;
    fsdp_module_t *m1 = NULL, *m2 = NULL;
    fsdp_named_list_t p1 = {0}, p2 = {0};
    golden_config(&cfg);
    fsdp_rng_init(fsdp_ctx_rng(CTX), 5, 0);
    int rc = fsdp_bert_create(CTX, &cfg, &m1);
    fsdp_rng_init(fsdp_ctx_rng(CTX), 5, 0);
    if (rc == 0) rc = fsdp_bert_create(CTX, &cfg, &m2);
    if (rc == 0) rc = fsdp_module_named_params(m1, false, &p1);
    if (rc == 0) rc = fsdp_module_named_params(m2, false, &p2);
    if (!tap_ok(rc == 0 && p1.n == p2.n, "two models built from one seed")) {
        diag_err(rc);
        tap_skip(3, "no models");
        goto out;
    }
    bool same = true, ok = true;
    char detail[300] = "";
    for (size_t i = 0; i < p1.n; i++) {
        same = same && same_all(p1.tensors[i], p2.tensors[i]);
        size_t n;
        float *h = host_f32(p1.tensors[i], &n);
        if (!h) {
            ok = false;
            continue;
        }
        const char *name = p1.names[i];
        size_t len = strlen(name);
        bool ln_w = len >= 16 && strcmp(name + len - 16, "LayerNorm.weight") == 0;
        if (fsdp_tensor_ndim(p1.tensors[i]) == 1) {
            for (size_t k = 0; k < n; k++)
                if (h[k] != (ln_w ? 1.0f : 0.0f)) {
                    if (ok) snprintf(detail, sizeof detail, "%s[%zu] = %g", name, k, h[k]);
                    ok = false;
                    break;
                }
        } else {
            /* normal(0, 0.02): mean and std of every matrix within 6 standard errors. */
            bool word = strcmp(name, "bert.embeddings.word_embeddings.weight") == 0;
            size_t from = word ? 32 : 0; /* the padding row 0 is zeroed */
            double s = 0, s2 = 0;
            for (size_t k = from; k < n; k++) {
                s += h[k];
                s2 += (double)h[k] * h[k];
            }
            double cnt = (double)(n - from), mean = s / cnt, sd = sqrt(s2 / cnt - mean * mean);
            if (fabs(mean) > 6 * 0.02 / sqrt(cnt) || fabs(sd - 0.02) > 6 * 0.02 / sqrt(2 * cnt)) {
                if (ok) snprintf(detail, sizeof detail, "%s: mean %g, std %g", name, mean, sd);
                ok = false;
            }
            for (size_t k = 0; word && k < 32; k++)
                if (h[k] != 0.0f) {
                    if (ok) snprintf(detail, sizeof detail, "padding row [%zu] = %g", k, h[k]);
                    ok = false;
                }
        }
        free(h);
    }
    tap_ok(same, "initialisation is reproducible from the context's seed");
    tap_ok_why(ok, detail,
               "Hugging Face's _init_weights: matrices normal(0, 0.02), padding row zero, "
               "LayerNorm ones and zeros, biases zeros");
    tap_ok(fsdp_module_param(m1, "cls.predictions.decoder.weight") ==
               fsdp_module_param(m1, "bert.embeddings.word_embeddings.weight"),
           "a freshly built model is tied too");
out:
    fsdp_named_list_free(&p1);
    fsdp_named_list_free(&p2);
    fsdp_module_release(m1);
    fsdp_module_release(m2);
}

/* ---- without the pooler ---------------------------------------------------------------------- */

static void test_no_pooler(const inputs_t *in) {
    fsdp_bert_config_t cfg;
    fsdp_module_t *m = NULL;
    fsdp_named_list_t sd = {0};
    fsdp_tensor_t *lg = NULL, *pl = NULL;
    golden_config(&cfg);
    cfg.add_pooling_layer = false;
    int rc = build_loaded(&cfg, false, &m); /* the golden pooler keys are unexpected */
    if (!tap_ok(rc == 0, "add_pooling_layer false: built, golden weights loaded (not strict)")) {
        diag_err(rc);
        tap_skip(3, "no model");
        return;
    }
    rc = fsdp_module_state_dict(m, &sd);
    bool pooler = false;
    for (size_t i = 0; i < sd.n; i++)
        pooler = pooler || strncmp(sd.names[i], "bert.pooler", 11) == 0;
    tap_ok(rc == 0 && sd.n == 44 && !pooler && !fsdp_module_child(m, "bert.pooler"),
           "add_pooling_layer false: Hugging Face's BertForMaskedLM keys (44, no bert.pooler)");
    fsdp_module_train(m, false);
    lg = logits_of(m, in->ids, in->mask, in->types, NULL);
    golden_check("add_pooling_layer false: logits still match PyTorch's", lg, rec("logits"), RTOL,
                 ATOL);
    fsdp_tensor_release(lg);
    lg = NULL;
    rc = fsdp_bert_forward(m, in->ids, in->mask, in->types, &lg, &pl);
    expect_einval(rc, lg, "pooler", "the pooled output of a model without a pooler");
    tap_ok(!pl, "... and no pooled output");
    fsdp_named_list_free(&sd);
    fsdp_module_release(m);
}

/* ---- hooks ----------------------------------------------------------------------------------- */

static int count_hook(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t **in) {
    (void)m;
    (void)nin;
    (void)in;
    (*(int *)arg)++;
    return 0;
}

static void test_hooks(fsdp_module_t *m, const inputs_t *in) {
    static const char *const paths[] = {
        "bert",
        "bert.embeddings",
        "bert.embeddings.word_embeddings",
        "bert.encoder",
        "bert.encoder.layer.0",
        "bert.encoder.layer.1",
        "bert.encoder.layer.1.attention.self",
        "bert.encoder.layer.1.output.LayerNorm",
        "bert.pooler",
        "cls.predictions.decoder",
    };
    enum { NP = sizeof paths / sizeof paths[0] };
    int counts[NP] = {0}, handles[NP];
    bool ok = true;
    for (int i = 0; i < NP; i++)
        ok = ok && fsdp_module_add_forward_pre_hook(fsdp_module_child(m, paths[i]), count_hook,
                                                    &counts[i], &handles[i]) == 0;
    fsdp_tensor_t *pl = NULL, *lg = logits_of(m, in->ids, in->mask, in->types, &pl);
    char detail[200] = "";
    for (int i = 0; i < NP; i++) {
        if (counts[i] != 1 && !detail[0])
            snprintf(detail, sizeof detail, "%s ran %d times", paths[i], counts[i]);
        ok = ok && counts[i] == 1;
        fsdp_module_remove_hook(fsdp_module_child(m, paths[i]), handles[i]);
    }
    tap_ok_why(ok && lg, detail,
               "every child runs through fsdp_module_forward: each hook fires once per forward");
    fsdp_tensor_release(lg);
    fsdp_tensor_release(pl);
}

int main(void) {
    const char *path = GOLDEN_DIR "/bert.bin";
    char msg[512];
    int rc = golden_load_msg(path, &G, msg, sizeof msg);
    if (rc == GOLDEN_ENOENT)
        return tap_skip_all("no golden vectors (run tests/golden/gen_bert.py --out tests/golden)");
    tap_plan_lazy();
    if (!tap_ok(rc == 0, "load %s (%d records)", msg, golden_count(G))) return tap_done();
    fsdp_ctx_options_t opts;
    fsdp_ctx_options_init(&opts);
    if (fsdp_ctx_create(&opts, &CTX) < 0) tap_bail("fsdp_ctx_create failed");

    inputs_t in = {0};
    fsdp_module_t *m = NULL;
    fsdp_bert_config_t cfg;
    golden_config(&cfg);
    test_config_defaults();
    test_config_errors();
    rc = inputs_load(&in);
    if (rc == 0) rc = build_loaded(&cfg, true, &m);
    if (!tap_ok(rc == 0, "the golden model is built and PyTorch's state dict loads strictly")) {
        diag_err(rc);
        goto out;
    }
    test_structure(m);
    test_golden(m, &in);
    test_pooler_unused(m, &in);
    test_optional_inputs(m, &in);
    test_padding_mask(m, &in);
    test_hooks(m, &in);
    test_forward_errors(m, &in);
    test_dropout(&in);
    test_init();
    test_no_pooler(&in);
out:
    fsdp_module_release(m);
    inputs_free(&in);
    golden_free(G);
    fsdp_ctx_destroy(CTX);
    return tap_done();
}
