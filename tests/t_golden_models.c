/* SPDX-License-Identifier: MIT */
/*
 * t_golden_models.c: whole test models and optimizer steps against PyTorch.
 *
 * tests/golden/models.bin (written by tests/golden/gen_models.py) holds, for each model, PyTorch's
 * initial state dict, an input, the output, the loss and every parameter's gradient, and the
 * losses and parameters of 3 steps of SGD (lr 0.01, momentum 0.9) and of 3 steps of AdamW (lr
 * 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01) started from the same weights. For each
 * model this program builds the C model (tests/models/models.h, or fsdp_gpt_create), loads
 * PyTorch's state dict strictly by name (so the keys must be exactly PyTorch's, the tied weight's
 * two names and the int64 buffer included), then compares:
 *   - the state dict read back, every key;
 *   - the output, the loss and each parameter's gradient (one TAP line per fully qualified name);
 *   - for each optimizer and step: the loss of that step and every parameter after it (one line
 *     per step, naming the worst parameter when one is off).
 * Optimizer steps are zero_grad, forward, loss, backward, step on the same input, as the
 * generator does. A "# worst" comment per model gives the largest error seen.
 *
 * Tolerance: |got - want| <= atol + rtol |want| with the spec's fp32 rtol 1.3e-6, atol 1e-5, for
 * everything except the few AdamW parameter elements whose gradient is rounding noise around an
 * exact zero; see ADAM_NOISE below.
 */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/autograd.h>
#include <fsdp/context.h>
#include <fsdp/errno.h>
#include <fsdp/nn.h>
#include <fsdp/optim.h>
#include <fsdp/tensor.h>
#include <fsdp/transformer.h>

#include "golden.h"
#include "models/models.h"
#include "tap.h"

#ifndef GOLDEN_DIR
#define GOLDEN_DIR "tests/golden"
#endif

#define RTOL 1.3e-6
#define ATOL 1e-5
#define STEPS 3

/* ---- the models ------------------------------------------------------------------------------ */

typedef struct model_case {
    const char *key;   /* record prefix in models.bin */
    const char *label; /* model name in TAP lines */
    int (*build)(fsdp_ctx_t *ctx, fsdp_module_t **m);
    /* Forward on the golden inputs `in` and the model's loss. */
    int (*run)(fsdp_module_t *m, fsdp_tensor_t *const *in, fsdp_tensor_t **out,
               fsdp_tensor_t **loss);
    const char *inputs[2]; /* input record names, NULL-padded */
} model_case_t;

static int build_nested(fsdp_ctx_t *ctx, fsdp_module_t **m) {
    return tm_nested_wrapped_create(ctx, true, m);
}

static int build_moe(fsdp_ctx_t *ctx, fsdp_module_t **m) {
    return tm_moe_create(ctx, true, m);
}

static int build_transformer(fsdp_ctx_t *ctx, fsdp_module_t **m) {
    return tm_transformer_create(ctx, true, true, m); /* eval mode: dropout off */
}

static int build_writeback(fsdp_ctx_t *ctx, fsdp_module_t **m) {
    return tm_writeback_create(ctx, m);
}

static int build_gpt(fsdp_ctx_t *ctx, fsdp_module_t **m) {
    fsdp_gpt_config_t cfg;
    tm_gpt_tiny_config(&cfg);
    return fsdp_gpt_create(ctx, &cfg, m);
}

static int run_sum(fsdp_module_t *m, fsdp_tensor_t *const *in, fsdp_tensor_t **out,
                   fsdp_tensor_t **loss) {
    int rc = fsdp_module_forward1(m, in[0], out);
    return rc < 0 ? rc : tm_sum_loss(*out, loss);
}

static int run_transformer(fsdp_module_t *m, fsdp_tensor_t *const *in, fsdp_tensor_t **out,
                           fsdp_tensor_t **loss) {
    int rc = tm_transformer_forward(m, in[0], in[1], out);
    return rc < 0 ? rc : tm_transformer_loss(in[1], *out, loss);
}

static int run_gpt(fsdp_module_t *m, fsdp_tensor_t *const *in, fsdp_tensor_t **out,
                   fsdp_tensor_t **loss) {
    return fsdp_gpt_forward_loss(m, in[0], in[1], loss, out);
}

static const model_case_t cases[] = {
    {"nested", "NestedWrappedModule", build_nested, run_sum, {"x", NULL}},
    {"moe", "MixtureOfExperts(rank 0)", build_moe, run_sum, {"x", NULL}},
    {"transformer",
     "TransformerWithSharedParams",
     build_transformer,
     run_transformer,
     {"src", "tgt"}},
    {"writeback", "Model(writeback)", build_writeback, run_sum, {"x", NULL}},
    {"gpt", "GPT(tiny)", build_gpt, run_gpt, {"tokens", "targets"}},
};

/* ---- comparisons ----------------------------------------------------------------------------- */

/* The largest errors of one model, for the "# worst" line. */
typedef struct worst {
    double abs;       /* largest |got - want| */
    double ratio;     /* largest |got - want| / (atol + rtol |want|) */
    char what[400];   /* where the largest ratio was */
    double noise_abs; /* largest |got - want| among AdamW noise elements (see ADAM_NOISE) */
} worst_t;

/* Element-wise errors of t against r (same numel assumed checked by golden_compare). */
static void track(worst_t *w, const fsdp_tensor_t *t, const golden_rec_t *r, const char *what) {
    if (!t || !r || fsdp_tensor_numel(t) != r->numel || r->numel == 0) return;
    if (fsdp_tensor_dtype(t) != FSDP_DTYPE_F32 || r->dtype != FSDP_DTYPE_F32) return;
    size_t n = (size_t)r->numel;
    float *g = malloc(n * sizeof *g);
    if (g && fsdp_tensor_to_host(t, g, n * sizeof *g) == 0) {
        const float *v = r->data;
        for (size_t i = 0; i < n; i++) {
            double d = fabs((double)g[i] - (double)v[i]);
            double ratio = d / (ATOL + RTOL * fabs((double)v[i]));
            if (d > w->abs) w->abs = d;
            if (ratio > w->ratio) {
                w->ratio = ratio;
                snprintf(w->what, sizeof w->what, "%s[%zu]: got %.9g want %.9g", what, i,
                         (double)g[i], (double)v[i]);
            }
        }
    }
    free(g);
}

/* golden_check with tracking. */
static int check(worst_t *w, const char *what, const fsdp_tensor_t *t, const golden_rec_t *r) {
    track(w, t, r, what);
    return golden_check(what, t, r, RTOL, ATOL);
}

/*
 * AdamW divides the first moment by the root of the second: for a gradient that is exactly zero
 * in exact arithmetic (the key part of an attention's input bias: softmax is invariant to adding
 * the same q . b_k to every score of a row) the libraries get rounding noise of ~1e-9 or an exact
 * 0, differently, and the update lr * g / (|g| + eps) turns that noise into anything in [-lr, lr].
 * Such elements are compared with an absolute tolerance of 3 lr per step taken (more than the
 * two updates can differ by). An element becomes (and stays) one of them at the first step where
 * its gradient is tiny in both libraries and not exactly zero in both (a gradient exactly zero in
 * both, such as a dead ReLU's row, keeps the element strict). Tiny: below ADAM_NOISE in magnitude
 * and below ADAM_NOISE times the largest magnitude in that parameter's gradient (rounding noise
 * is relative to the terms summed). PyTorch's side is the "adamw/gradclass<k>" records.
 */
#define ADAM_NOISE 1e-7

/* Compares every parameter with the records "<prefix>/<fqn>"; returns 1 when all match. masks
 * (may be NULL; masks[i] NULL for a parameter without noise elements) mark the elements compared
 * with noise_atol instead; *nrelaxed counts them. detail receives the first failure. */
static int compare_params(const fsdp_named_list_t *params, const golden_t *g, const char *prefix,
                          bool *const *masks, double noise_atol, worst_t *w, char *detail,
                          size_t len, int *nrelaxed) {
    int pass = 1;
    detail[0] = 0;
    for (size_t i = 0; i < params->n; i++) {
        const golden_rec_t *r = golden_findf(g, prefix, params->names[i]);
        char what[300], d[1024];
        snprintf(what, sizeof what, "%s/%s", prefix, params->names[i]);
        if (!r) {
            if (pass) snprintf(detail, len, "%s: no golden record", what);
            pass = 0;
            continue;
        }
        const bool *mask = masks ? masks[i] : NULL;
        if (!mask) {
            track(w, params->tensors[i], r, what);
            if (!golden_compare(params->tensors[i], r, RTOL, ATOL, d, sizeof d)) {
                if (pass) snprintf(detail, len, "%s", d);
                pass = 0;
            }
            continue;
        }
        /* Element-wise, relaxing the noise elements. */
        size_t n = (size_t)r->numel;
        float *got = malloc(n * sizeof *got);
        if (!got || fsdp_tensor_numel(params->tensors[i]) != r->numel ||
            fsdp_tensor_to_host(params->tensors[i], got, n * sizeof *got) < 0) {
            if (pass) snprintf(detail, len, "%s: cannot read the parameter", what);
            pass = 0;
            free(got);
            continue;
        }
        const float *want = r->data;
        for (size_t k = 0; k < n; k++) {
            double err = fabs((double)got[k] - (double)want[k]);
            double strict = ATOL + RTOL * fabs((double)want[k]);
            double tol = mask[k] ? noise_atol : strict;
            if (mask[k]) {
                (*nrelaxed)++;
                if (err > w->noise_abs) w->noise_abs = err;
            } else {
                if (err > w->abs) w->abs = err;
                if (err / strict > w->ratio) {
                    w->ratio = err / strict;
                    snprintf(w->what, sizeof w->what, "%.300s[%zu]: got %.9g want %.9g", what, k,
                             (double)got[k], (double)want[k]);
                }
            }
            if (!(err <= tol)) {
                if (pass)
                    snprintf(detail, len, "%s[%zu]: got %.9g, want %.9g (|diff| %.3g, tol %.3g%s)",
                             what, k, (double)got[k], (double)want[k], err, tol,
                             mask[k] ? ", noise element" : "");
                pass = 0;
            }
        }
        free(got);
    }
    return pass;
}

/* Updates the noise masks described above with the gradients of step `step` (after backward,
 * before the optimizer step); masks[i] is allocated when parameter i first gets such an element.
 * Returns the number of elements newly marked, or -1 when out of memory. */
static int update_noise_masks(const fsdp_named_list_t *params, const golden_t *g, const char *key,
                              int step, bool **masks) {
    int count = 0;
    for (size_t i = 0; i < params->n; i++) {
        char k[300];
        snprintf(k, sizeof k, "adamw/gradclass%d/%s", step, params->names[i]);
        const golden_rec_t *cls = golden_findf(g, key, k);
        fsdp_tensor_t *cg = fsdp_tensor_grad(params->tensors[i]);
        if (!cls || !cg || cls->dtype != FSDP_DTYPE_U8 || fsdp_tensor_numel(cg) != cls->numel)
            continue; /* no PyTorch gradient below ADAM_NOISE in this parameter at this step */
        size_t n = (size_t)cls->numel;
        float *c = malloc(n * sizeof *c);
        if (!masks[i]) masks[i] = calloc(n ? n : 1, sizeof *masks[i]);
        if (!c || !masks[i] || fsdp_tensor_to_host(cg, c, n * sizeof *c) < 0) {
            free(c);
            return -1;
        }
        const uint8_t *pc = cls->data; /* 0: not tiny, 1: exactly 0, 2: tiny, not 0 */
        float cmax = 0;
        for (size_t e = 0; e < n; e++)
            cmax = fmaxf(cmax, fabsf(c[e]));
        for (size_t e = 0; e < n; e++) {
            float a = fabsf(c[e]);
            bool tiny = a < ADAM_NOISE && a < ADAM_NOISE * cmax;
            bool noise = pc[e] != 0 && (tiny || c[e] == 0) && !(pc[e] == 1 && c[e] == 0);
            if (noise && !masks[i][e]) {
                masks[i][e] = true;
                count++;
            }
        }
        free(c);
    }
    return count;
}

/* ---- loading --------------------------------------------------------------------------------- */

/* Every record "<key>/<sub>/..." as a state-dict list (names without the prefix). */
static int golden_state_dict(fsdp_ctx_t *ctx, const golden_t *g, const char *key, const char *sub,
                             fsdp_named_list_t *sd) {
    char prefix[128];
    int n = snprintf(prefix, sizeof prefix, "%s/%s/", key, sub);
    size_t plen = (size_t)n, cap = 0;
    memset(sd, 0, sizeof *sd);
    sd->owned = true;
    for (int i = 0; i < golden_count(g); i++) {
        const golden_rec_t *r = golden_at(g, i);
        if (strncmp(r->name, prefix, plen) != 0) continue;
        if (sd->n == cap) {
            cap = cap ? 2 * cap : 32;
            char **nn = realloc(sd->names, cap * sizeof *nn);
            if (nn) sd->names = nn;
            fsdp_tensor_t **nt = realloc(sd->tensors, cap * sizeof *nt);
            if (nt) sd->tensors = nt;
            if (!nn || !nt) return FSDP_ENOMEM;
        }
        char *name = malloc(strlen(r->name + plen) + 1);
        fsdp_tensor_t *t = golden_tensor(ctx, r);
        if (!name || !t) {
            free(name);
            fsdp_tensor_release(t);
            return FSDP_ENOMEM;
        }
        strcpy(name, r->name + plen);
        sd->names[sd->n] = name;
        sd->tensors[sd->n] = t;
        sd->n++;
    }
    return FSDP_OK;
}

/* Builds the model and loads PyTorch's initial state dict (strict). */
static int build_loaded(fsdp_ctx_t *ctx, const model_case_t *c, const fsdp_named_list_t *sd,
                        fsdp_module_t **m) {
    int rc = c->build(ctx, m);
    if (rc < 0) return rc;
    rc = fsdp_module_load_state_dict(*m, sd, true);
    if (rc < 0) {
        fsdp_module_release(*m);
        *m = NULL;
    }
    return rc;
}

/* ---- one model
 * ------------------------------------------------------------------------------------ */

static void release_all(fsdp_tensor_t **ts, int n) {
    for (int i = 0; i < n; i++) {
        fsdp_tensor_release(ts[i]);
        ts[i] = NULL;
    }
}

static void optimizer_steps(fsdp_ctx_t *ctx, const golden_t *g, const model_case_t *c,
                            const fsdp_named_list_t *sd, fsdp_tensor_t *const *in, bool adamw,
                            worst_t *w) {
    const char *oname = adamw ? "adamw" : "sgd";
    fsdp_module_t *m = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_named_list_t params = {0};
    bool **masks = NULL;
    int rc = build_loaded(ctx, c, sd, &m);
    if (rc == 0) rc = fsdp_module_named_params(m, false, &params);
    if (rc == 0 && !adamw) {
        fsdp_sgd_options_t o;
        fsdp_sgd_options_init(&o);
        o.lr = golden_value(golden_find(g, "sgd/p/lr"), 0);
        o.momentum = golden_value(golden_find(g, "sgd/p/momentum"), 0);
        rc = fsdp_optim_sgd_create(ctx, &o, &opt);
    } else if (rc == 0) {
        fsdp_adam_options_t o;
        fsdp_adamw_options_init(&o);
        o.lr = golden_value(golden_find(g, "adamw/p/lr"), 0);
        o.beta1 = golden_value(golden_find(g, "adamw/p/beta1"), 0);
        o.beta2 = golden_value(golden_find(g, "adamw/p/beta2"), 0);
        o.eps = golden_value(golden_find(g, "adamw/p/eps"), 0);
        o.weight_decay = golden_value(golden_find(g, "adamw/p/weight_decay"), 0);
        rc = fsdp_optim_adam_create(ctx, &o, true, &opt);
    }
    if (rc == 0)
        rc = fsdp_optim_add_group(opt, params.n, params.tensors, (const char *const *)params.names,
                                  NULL, NULL);
    if (!tap_ok(rc == 0, "%s %s: model loaded and optimizer created", c->label,
                adamw ? "AdamW" : "SGD-momentum")) {
        tap_diag("%s", fsdp_ctx_last_error(ctx));
        tap_skip(2 * STEPS, "no optimizer");
        goto out;
    }
    double lr = 0;
    fsdp_optim_get_lr(opt, 0, &lr);
    if (adamw) masks = calloc(params.n ? params.n : 1, sizeof *masks);
    for (int step = 1; step <= STEPS; step++) {
        fsdp_tensor_t *tmp[2] = {NULL, NULL};
        char what[200], key[64], detail[1200];
        rc = fsdp_optim_zero_grad(opt, false);
        if (rc == 0) rc = c->run(m, in, &tmp[0], &tmp[1]);
        snprintf(what, sizeof what, "%s %s step %d: loss", c->label, oname, step);
        snprintf(key, sizeof key, "%s/loss%d", oname, step);
        check(w, what, rc == 0 ? tmp[1] : NULL, golden_findf(g, c->key, key));
        if (rc == 0) rc = fsdp_backward(tmp[1], NULL);
        int newly = 0;
        if (rc == 0 && masks) {
            newly = update_noise_masks(&params, g, c->key, step, masks);
            if (newly < 0) rc = FSDP_ENOMEM;
        }
        if (rc == 0) rc = fsdp_optim_step(opt);
        release_all(tmp, 2);
        if (rc < 0) {
            tap_ok(0, "%s %s step %d: forward, backward and step run", c->label, oname, step);
            tap_diag("%s: %s", fsdp_strerror(rc), fsdp_ctx_last_error(ctx));
            continue;
        }
        char prefix[64];
        snprintf(prefix, sizeof prefix, "%s/%s/step%d", c->key, oname, step);
        int relaxed = 0;
        int pass = compare_params(&params, g, prefix, masks, 3.0 * lr * step, w, detail,
                                  sizeof detail, &relaxed);
        tap_ok(pass, "%s %s step %d: all %zu parameters match PyTorch", c->label, oname, step,
               params.n);
        if (!pass) tap_diag("%s", detail);
        if (relaxed)
            tap_diag("%s adamw step %d: %d elements (%d new) compared as zero-gradient noise at "
                     "atol %g",
                     c->label, step, relaxed, newly, 3.0 * lr * step);
    }
out:
    for (size_t i = 0; masks && i < params.n; i++)
        free(masks[i]);
    free(masks);
    fsdp_optim_destroy(opt);
    fsdp_named_list_free(&params);
    fsdp_module_release(m);
}

static void run_model(fsdp_ctx_t *ctx, const golden_t *g, const model_case_t *c) {
    worst_t w = {0, 0, "", 0};
    fsdp_named_list_t sd = {0}, csd = {0}, params = {0};
    fsdp_module_t *m = NULL;
    fsdp_tensor_t *in[2] = {NULL, NULL}, *res[2] = {NULL, NULL};
    char what[300];

    int rc = golden_state_dict(ctx, g, c->key, "init", &sd);
    for (int i = 0; rc == 0 && i < 2 && c->inputs[i]; i++) {
        char k[64];
        snprintf(k, sizeof k, "input/%s", c->inputs[i]);
        in[i] = golden_tensor(ctx, golden_findf(g, c->key, k));
        if (!in[i]) rc = FSDP_EINVAL;
    }
    if (!tap_ok(rc == 0 && sd.n > 0, "%s: golden state dict (%zu keys) and inputs read", c->label,
                sd.n))
        goto out;
    rc = build_loaded(ctx, c, &sd, &m);
    if (!tap_ok(rc == 0, "%s: built, PyTorch state dict loaded strictly (keys are PyTorch's)",
                c->label)) {
        tap_diag("%s: %s", fsdp_strerror(rc), fsdp_ctx_last_error(ctx));
        goto out;
    }
    /* The state dict read back equals what was loaded, key by key. */
    rc = fsdp_module_state_dict(m, &csd);
    int sd_bad = 0;
    char sd_detail[1024] = "";
    for (size_t i = 0; rc == 0 && i < sd.n; i++) {
        const fsdp_tensor_t *t = NULL;
        for (size_t j = 0; j < csd.n && !t; j++)
            if (strcmp(csd.names[j], sd.names[i]) == 0) t = csd.tensors[j];
        char k[300];
        snprintf(k, sizeof k, "init/%s", sd.names[i]);
        if (!t ||
            !golden_compare(t, golden_findf(g, c->key, k), 0, 0, sd_detail, sizeof sd_detail)) {
            if (!sd_bad++ && !t) snprintf(sd_detail, sizeof sd_detail, "%s missing", sd.names[i]);
        }
    }
    if (!tap_ok(rc == 0 && sd_bad == 0 && csd.n == sd.n,
                "%s: state dict after loading equals PyTorch's (%zu keys, exact)", c->label, csd.n))
        tap_diag("%d keys off; %s", sd_bad, sd_detail);

    rc = c->run(m, in, &res[0], &res[1]);
    if (!tap_ok(rc == 0, "%s: forward and loss run", c->label)) {
        tap_diag("%s: %s", fsdp_strerror(rc), fsdp_ctx_last_error(ctx));
        goto out;
    }
    snprintf(what, sizeof what, "%s: output", c->label);
    check(&w, what, res[0], golden_findf(g, c->key, "out"));
    snprintf(what, sizeof what, "%s: loss", c->label);
    check(&w, what, res[1], golden_findf(g, c->key, "loss"));
    rc = fsdp_backward(res[1], NULL);
    if (!tap_ok(rc == 0, "%s: backward runs", c->label))
        tap_diag("%s: %s", fsdp_strerror(rc), fsdp_ctx_last_error(ctx));
    rc = fsdp_module_named_params(m, false, &params);
    int ngrad_recs = 0;
    char gprefix[64];
    int gplen = snprintf(gprefix, sizeof gprefix, "%s/grad/", c->key);
    for (int i = 0; i < golden_count(g); i++)
        if (strncmp(golden_at(g, i)->name, gprefix, (size_t)gplen) == 0) ngrad_recs++;
    tap_is_int((int64_t)params.n, ngrad_recs,
               "%s: as many named parameters as PyTorch (tied weight once)", c->label);
    for (size_t i = 0; rc == 0 && i < params.n; i++) {
        char k[300];
        snprintf(k, sizeof k, "grad/%s", params.names[i]);
        snprintf(what, sizeof what, "%s: grad %s", c->label, params.names[i]);
        check(&w, what, fsdp_tensor_grad(params.tensors[i]), golden_findf(g, c->key, k));
    }
    release_all(res, 2);

    optimizer_steps(ctx, g, c, &sd, in, false, &w);
    optimizer_steps(ctx, g, c, &sd, in, true, &w);
    tap_diag("%s worst: |diff| %.3g, %.3g x tolerance at %s; AdamW noise elements: |diff| %.3g",
             c->label, w.abs, w.ratio, w.what[0] ? w.what : "-", w.noise_abs);
out:
    release_all(res, 2);
    release_all(in, 2);
    fsdp_named_list_free(&params);
    fsdp_named_list_free(&csd);
    fsdp_named_list_free(&sd);
    fsdp_module_release(m);
}

int main(void) {
    const char *path = GOLDEN_DIR "/models.bin";
    char msg[512];
    golden_t *g = NULL;
    int rc = golden_load_msg(path, &g, msg, sizeof msg);
    if (rc == GOLDEN_ENOENT)
        return tap_skip_all(
            "no golden vectors (run tests/golden/gen_models.py --out tests/golden)");
    tap_plan_lazy();
    if (!tap_ok(rc == 0, "load %s (%d records)", msg, golden_count(g))) return tap_done();
    fsdp_ctx_options_t opts;
    fsdp_ctx_t *ctx = NULL;
    fsdp_ctx_options_init(&opts);
    if (fsdp_ctx_create(&opts, &ctx) < 0) tap_bail("fsdp_ctx_create failed");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_model(ctx, g, &cases[i]);
    golden_free(g);
    fsdp_ctx_destroy(ctx);
    return tap_done();
}
