/* SPDX-License-Identifier: MIT */
/*
 * t_bert_props.c: properties of the BERT masked-LM model (fsdp/bert.h) beside its match with
 * PyTorch (t_bert.c), on the same golden model (tests/golden/bert.bin):
 *   - the configuration: Hugging Face's BertConfig defaults, and every bad field FSDP_EINVAL
 *     naming it, with no model made;
 *   - dropout: eval mode ignores it, train mode draws reproducible masks from the seed;
 *   - Hugging Face's initialisation (statistics, zero padding row, reproducible from the seed);
 *   - add_pooling_layer false (Hugging Face's BertForMaskedLM key set exactly).
 */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tap.h"
#include "bert_util.h"

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

int main(void) {
    char msg[512];
    int rc = bert_util_open(msg, sizeof msg);
    if (rc == GOLDEN_ENOENT)
        return tap_skip_all("no golden vectors (run tests/golden/gen_bert.py --out tests/golden)");
    tap_plan_lazy();
    if (!tap_ok(rc == 0, "load %s (%d records)", msg, rc == 0 ? golden_count(G) : 0))
        return tap_done();
    inputs_t in = {0};
    test_config_defaults();
    test_config_errors();
    if (tap_ok(inputs_load(&in) == 0, "the golden inputs load")) {
        test_dropout(&in);
        test_init();
        test_no_pooler(&in);
    }
    inputs_free(&in);
    bert_util_close();
    return tap_done();
}
