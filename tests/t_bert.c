/* SPDX-License-Identifier: MIT */
/*
 * t_bert.c: the BERT masked-LM model (fsdp/bert.h) against PyTorch, and its properties.
 *
 * tests/golden/bert.bin (written by tests/golden/gen_bert.py, Hugging Face's BertForMaskedLM
 * rewritten in plain torch, with the pooler) holds a tiny configuration, the state dict, inputs
 * with padding, masked-LM labels with -100 entries, the encoder output, the logits, the pooled
 * output, the loss and the gradient of loss + sum(pooled * gpooled) for every parameter. This
 * program checks (t_bert_props.c checks the configuration, dropout, the initialisation and the
 * model without a pooler):
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
 *   - every child runs through fsdp_module_forward (forward hooks fire);
 *   - input errors: FSDP_EINVAL naming the argument, no output, and (under ASan) nothing leaked.
 *
 * Tolerance: |got - want| <= atol + rtol |want| with the spec's fp32 rtol 1.3e-6, atol 1e-5.
 * Comparisons between two libfsdp runs that must agree exactly are bitwise.
 */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tap.h"
#include "bert_util.h"

#define WHAT "BERT forward/backward vs PyTorch"

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
    char msg[512];
    int rc = bert_util_open(msg, sizeof msg);
    if (rc == GOLDEN_ENOENT)
        return tap_skip_all("no golden vectors (run tests/golden/gen_bert.py --out tests/golden)");
    tap_plan_lazy();
    if (!tap_ok(rc == 0, "load %s (%d records)", msg, rc == 0 ? golden_count(G) : 0))
        return tap_done();

    inputs_t in = {0};
    fsdp_module_t *m = NULL;
    fsdp_bert_config_t cfg;
    golden_config(&cfg);
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
out:
    fsdp_module_release(m);
    inputs_free(&in);
    bert_util_close();
    return tap_done();
}
