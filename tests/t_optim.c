/* SPDX-License-Identifier: MIT */
/*
 * t_optim.c: SGD, Adam and AdamW against a double-precision reference of torch.optim (PyTorch
 * 1.13), on f32 and f64 parameters over several steps with fixed gradients; parameter groups and
 * learning rates; skipped parameters; zero_grad; gradients of lower precision than their
 * parameter (f16/bf16 for f32, f16/f32 for f64: a step equals, bitwise, one with the gradient
 * upcast by hand); state dict save/load (bitwise round trip and strict errors); argument errors;
 * and the FSDP_MEM_OPTIM accounting of optimizer state.
 *
 * Gradients shrink from step to step (scale 1, 0.1, 0.01, ...) so that Adam's second moment
 * falls and amsgrad's running maximum differs from it.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <fsdp.h>

#include "tap.h"

static fsdp_ctx_t *ctx;

#define NSTEPS 4
#define MAXN 16

/* ---- helpers --------------------------------------------------------------------------------- */

/* Rounds v to what a tensor of dtype dt stores. */
static double round_to(fsdp_dtype_t dt, double v) {
    return dt == FSDP_DTYPE_F32 ? (float)v : v;
}

static fsdp_tensor_t *make_tensor(fsdp_dtype_t dt, int ndim, const int64_t *shape,
                                  const double *v) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= shape[i];
    fsdp_tensor_t *t = NULL;
    if (dt == FSDP_DTYPE_F32) {
        float f[MAXN];
        for (int64_t i = 0; i < n; i++)
            f[i] = (float)v[i];
        fsdp_tensor_from_host(ctx, dt, ndim, shape, f, FSDP_MEM_PARAMS, &t);
    } else {
        fsdp_tensor_from_host(ctx, dt, ndim, shape, v, FSDP_MEM_PARAMS, &t);
    }
    if (!t) tap_bail("cannot create a tensor: %s", fsdp_ctx_last_error(ctx));
    return t;
}

static void read_tensor(const fsdp_tensor_t *t, double *out) {
    const int64_t n = fsdp_tensor_numel(t);
    for (int64_t i = 0; i < n; i++)
        fsdp_tensor_item(t, i, &out[i]);
}

static void set_grad(fsdp_tensor_t *p, const double *g) {
    fsdp_tensor_t *gt =
        make_tensor(fsdp_tensor_dtype(p), fsdp_tensor_ndim(p), fsdp_tensor_shape(p), g);
    if (fsdp_tensor_set_grad(p, gt) < 0) tap_bail("set_grad: %s", fsdp_ctx_last_error(ctx));
    fsdp_tensor_release(gt);
}

/* Deterministic initial values and per-step gradients of parameter k. */
static double init_value(int k, int i) {
    return 0.5 * sin(1.0 + 0.7 * i + 1.3 * k) + 0.1 * k;
}
static double grad_value(int k, int i, int step) {
    return pow(0.1, step) * (cos(0.3 + 0.9 * i - 0.4 * k + 0.2 * step) + 0.05);
}

/* Largest |a - b| / (atol + rtol |b|) over n elements: <= 1 passes. */
static double worst(size_t n, const double *a, const double *b, double rtol, double atol) {
    double w = 0.0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs(a[i] - b[i]) / (atol + rtol * fabs(b[i]));
        if (!(e <= w)) w = e;
    }
    return w;
}

static bool bits_equal(const fsdp_tensor_t *a, const fsdp_tensor_t *b) {
    unsigned char x[MAXN * 8], y[MAXN * 8];
    size_t bytes = (size_t)fsdp_tensor_numel(a) * fsdp_dtype_size(fsdp_tensor_dtype(a));
    if (fsdp_tensor_to_host(a, x, bytes) < 0 || fsdp_tensor_to_host(b, y, bytes) < 0) return false;
    return memcmp(x, y, bytes) == 0;
}

static size_t optim_mem(void) {
    fsdp_mem_stats_t s;
    fsdp_mem_get_stats(ctx, &s);
    return s.current[FSDP_MEM_OPTIM];
}

static fsdp_tensor_t *entry(const fsdp_named_list_t *sd, const char *name) {
    for (size_t i = 0; i < sd->n; i++)
        if (strcmp(sd->names[i], name) == 0) return sd->tensors[i];
    return NULL;
}

/* ---- reference: torch.optim in double -------------------------------------------------------- */

struct cfg {
    const char *what;
    fsdp_optim_kind_t kind;
    double lr, momentum, dampening, weight_decay, beta1, beta2, eps;
    bool nesterov, amsgrad;
};

struct ref_state {
    double buf[MAXN], m[MAXN], v[MAXN], vmax[MAXN];
    bool have_buf;
    int64_t step;
};

static void ref_step(const struct cfg *c, size_t n, double *p, const double *g0,
                     struct ref_state *s) {
    double g[MAXN];
    memcpy(g, g0, n * sizeof *g);
    if (c->kind == FSDP_OPTIM_SGD) {
        for (size_t i = 0; i < n; i++) {
            double d = g[i];
            if (c->weight_decay != 0.0) d += c->weight_decay * p[i];
            if (c->momentum != 0.0) {
                s->buf[i] = s->have_buf ? c->momentum * s->buf[i] + (1.0 - c->dampening) * d : d;
                d = c->nesterov ? d + c->momentum * s->buf[i] : s->buf[i];
            }
            p[i] -= c->lr * d;
        }
        if (c->momentum != 0.0) s->have_buf = true;
        return;
    }
    const int64_t t = ++s->step;
    const double bc1 = 1.0 - pow(c->beta1, (double)t), bc2 = 1.0 - pow(c->beta2, (double)t);
    for (size_t i = 0; i < n; i++) {
        if (c->kind == FSDP_OPTIM_ADAMW)
            p[i] *= 1.0 - c->lr * c->weight_decay;
        else if (c->weight_decay != 0.0)
            g[i] += c->weight_decay * p[i];
        s->m[i] = c->beta1 * s->m[i] + (1.0 - c->beta1) * g[i];
        s->v[i] = c->beta2 * s->v[i] + (1.0 - c->beta2) * g[i] * g[i];
        double vs = s->v[i];
        if (c->amsgrad) {
            s->vmax[i] = fmax(s->vmax[i], s->v[i]);
            vs = s->vmax[i];
        }
        p[i] -= c->lr / bc1 * s->m[i] / (sqrt(vs) / sqrt(bc2) + c->eps);
    }
}

static int create_from_cfg(const struct cfg *c, fsdp_optim_t **opt) {
    if (c->kind == FSDP_OPTIM_SGD) {
        fsdp_sgd_options_t o;
        fsdp_sgd_options_init(&o);
        o.lr = c->lr;
        o.momentum = c->momentum;
        o.dampening = c->dampening;
        o.weight_decay = c->weight_decay;
        o.nesterov = c->nesterov;
        return fsdp_optim_sgd_create(ctx, &o, opt);
    }
    fsdp_adam_options_t o;
    fsdp_adam_options_init(&o);
    o.lr = c->lr;
    o.beta1 = c->beta1;
    o.beta2 = c->beta2;
    o.eps = c->eps;
    o.weight_decay = c->weight_decay;
    o.amsgrad = c->amsgrad;
    return fsdp_optim_adam_create(ctx, &o, c->kind == FSDP_OPTIM_ADAMW, opt);
}

/* Four parameters: f32 (5), f32 (2, 3), f64 (5), f64 (2, 3). */
#define NPARAMS 4
static const int64_t shape_vec[1] = {5}, shape_mat[2] = {2, 3};

static fsdp_tensor_t *make_param(int k, double *host) {
    const fsdp_dtype_t dt = k < 2 ? FSDP_DTYPE_F32 : FSDP_DTYPE_F64;
    const int ndim = k % 2 ? 2 : 1;
    const int64_t *shape = k % 2 ? shape_mat : shape_vec;
    const size_t n = k % 2 ? 6 : 5;
    for (size_t i = 0; i < n; i++)
        host[i] = round_to(dt, init_value(k, (int)i));
    fsdp_tensor_t *p = make_tensor(dt, ndim, shape, host);
    fsdp_tensor_set_requires_grad(p, true);
    return p;
}

static void check_against_reference(const struct cfg *c) {
    fsdp_tensor_t *p[NPARAMS];
    double ref[NPARAMS][MAXN];
    struct ref_state st[NPARAMS];
    memset(st, 0, sizeof st);
    fsdp_optim_t *opt = NULL;
    if (create_from_cfg(c, &opt) < 0) tap_bail("%s: %s", c->what, fsdp_ctx_last_error(ctx));
    for (int k = 0; k < NPARAMS; k++)
        p[k] = make_param(k, ref[k]);
    const char *names[NPARAMS] = {"a32", "b32", "a64", "b64"};
    if (fsdp_optim_add_group(opt, NPARAMS, p, names, NULL, NULL) < 0)
        tap_bail("%s: add_group: %s", c->what, fsdp_ctx_last_error(ctx));

    int rc = 0;
    for (int s = 0; s < NSTEPS && rc == 0; s++) {
        for (int k = 0; k < NPARAMS; k++) {
            const fsdp_dtype_t dt = fsdp_tensor_dtype(p[k]);
            const size_t n = (size_t)fsdp_tensor_numel(p[k]);
            double g[MAXN];
            for (size_t i = 0; i < n; i++)
                g[i] = round_to(dt, grad_value(k, (int)i, s));
            set_grad(p[k], g);
            ref_step(c, n, ref[k], g, &st[k]);
        }
        rc = fsdp_optim_step(opt);
    }
    if (rc < 0) tap_diag("%s: step failed: %s", c->what, fsdp_ctx_last_error(ctx));
    double w32 = 0.0, w64 = 0.0;
    for (int k = 0; k < NPARAMS; k++) {
        double got[MAXN];
        const size_t n = (size_t)fsdp_tensor_numel(p[k]);
        read_tensor(p[k], got);
        if (k < 2)
            w32 = fmax(w32, worst(n, got, ref[k], 1e-6, 1e-6));
        else
            w64 = fmax(w64, worst(n, got, ref[k], 1e-12, 1e-14));
    }
    tap_ok(rc == 0 && w32 <= 1.0, "%s: f32 matches the reference after %d steps (worst %.3g)",
           c->what, NSTEPS, w32);
    tap_ok(rc == 0 && w64 <= 1.0, "%s: f64 matches the reference after %d steps (worst %.3g)",
           c->what, NSTEPS, w64);
    fsdp_optim_destroy(opt);
    for (int k = 0; k < NPARAMS; k++)
        fsdp_tensor_release(p[k]);
}

static void algorithms(void) {
    static const struct cfg cfgs[] = {
        {"SGD plain", FSDP_OPTIM_SGD, 0.1, 0, 0, 0, 0, 0, 0, false, false},
        {"SGD momentum", FSDP_OPTIM_SGD, 0.1, 0.9, 0, 0, 0, 0, 0, false, false},
        {"SGD momentum+dampening", FSDP_OPTIM_SGD, 0.1, 0.9, 0.3, 0, 0, 0, 0, false, false},
        {"SGD nesterov", FSDP_OPTIM_SGD, 0.1, 0.9, 0, 0, 0, 0, 0, true, false},
        {"SGD weight decay", FSDP_OPTIM_SGD, 0.1, 0, 0, 0.05, 0, 0, 0, false, false},
        {"SGD momentum+wd+nesterov", FSDP_OPTIM_SGD, 0.05, 0.5, 0, 0.1, 0, 0, 0, true, false},
        {"Adam", FSDP_OPTIM_ADAM, 1e-2, 0, 0, 0, 0.9, 0.999, 1e-8, false, false},
        {"Adam weight decay", FSDP_OPTIM_ADAM, 1e-2, 0, 0, 0.1, 0.9, 0.999, 1e-8, false, false},
        {"Adam amsgrad", FSDP_OPTIM_ADAM, 1e-2, 0, 0, 0, 0.8, 0.99, 1e-6, false, true},
        {"AdamW", FSDP_OPTIM_ADAMW, 1e-2, 0, 0, 0.1, 0.9, 0.999, 1e-8, false, false},
        {"AdamW amsgrad", FSDP_OPTIM_ADAMW, 1e-2, 0, 0, 0.2, 0.9, 0.95, 1e-8, false, true},
    };
    for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++)
        check_against_reference(&cfgs[i]);

    /* The test data does exercise amsgrad: its result differs from plain Adam's. */
    struct ref_state a, b;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    double pa[1] = {1.0}, pb[1] = {1.0};
    struct cfg c = cfgs[8];
    for (int s = 0; s < NSTEPS; s++) {
        double g[1] = {grad_value(0, 0, s)};
        c.amsgrad = true;
        ref_step(&c, 1, pa, g, &a);
        c.amsgrad = false;
        ref_step(&c, 1, pb, g, &b);
    }
    tap_ok(pa[0] != pb[0], "the test gradients make amsgrad matter (%.17g vs %.17g)", pa[0], pb[0]);
}

/* ---- defaults and argument errors ------------------------------------------------------------ */

static void options(void) {
    fsdp_sgd_options_t s;
    fsdp_adam_options_t a, w;
    fsdp_sgd_options_init(&s);
    fsdp_adam_options_init(&a);
    fsdp_adamw_options_init(&w);
    tap_ok(s.kind == FSDP_OPTIM_SGD && s.momentum == 0 && s.dampening == 0 && s.weight_decay == 0 &&
               !s.nesterov,
           "SGD defaults (momentum 0, dampening 0, wd 0, no nesterov)");
    tap_ok(a.kind == FSDP_OPTIM_ADAM && a.lr == 1e-3 && a.beta1 == 0.9 && a.beta2 == 0.999 &&
               a.eps == 1e-8 && a.weight_decay == 0 && !a.amsgrad,
           "Adam defaults as PyTorch");
    tap_ok(w.kind == FSDP_OPTIM_ADAMW && w.lr == 1e-3 && w.weight_decay == 1e-2,
           "AdamW defaults as PyTorch (wd 1e-2)");

    fsdp_optim_t *opt = (fsdp_optim_t *)1;
    s.momentum = 0.0;
    s.nesterov = true;
    tap_is_int(fsdp_optim_sgd_create(ctx, &s, &opt), FSDP_EINVAL, "nesterov without momentum");
    tap_ok(opt == NULL, "out is NULL on failure");
    tap_has_str(fsdp_ctx_last_error(ctx), "nesterov", "the message names nesterov");
    s.momentum = 0.9;
    s.dampening = 0.1;
    tap_is_int(fsdp_optim_sgd_create(ctx, &s, &opt), FSDP_EINVAL,
               "nesterov with dampening refused");
    s.dampening = 0.0;
    tap_is_int(fsdp_optim_sgd_create(ctx, &s, &opt), 0, "nesterov with momentum accepted");
    fsdp_optim_destroy(opt);

    a.beta1 = 1.0;
    tap_is_int(fsdp_optim_adam_create(ctx, &a, false, &opt), FSDP_EINVAL, "beta1 = 1 refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "beta1", "the message names beta1");
    a.beta1 = 0.9;
    a.lr = -1.0;
    tap_is_int(fsdp_optim_adam_create(ctx, &a, true, &opt), FSDP_EINVAL, "negative lr refused");
    fsdp_adam_options_t zero;
    memset(&zero, 0, sizeof zero);
    tap_is_int(fsdp_optim_adam_create(ctx, &zero, false, &opt), FSDP_EINVAL,
               "options not filled by an init function are refused");

    /* Created from NULL defaults: PyTorch's. */
    tap_is_int(fsdp_optim_adam_create(ctx, NULL, true, &opt), 0, "AdamW with NULL defaults");
    fsdp_adam_options_t got;
    fsdp_optim_get_options(opt, -1, &got);
    tap_ok(got.kind == FSDP_OPTIM_ADAMW && got.weight_decay == 1e-2 && got.lr == 1e-3,
           "its defaults are AdamW's");
    tap_is_int(fsdp_optim_kind(opt), FSDP_OPTIM_ADAMW, "kind AdamW");
    fsdp_sgd_options_t wrong;
    fsdp_sgd_options_init(&wrong);
    tap_is_int(fsdp_optim_set_options(opt, -1, &wrong), FSDP_EINVAL,
               "SGD options refused by an AdamW optimizer");
    fsdp_optim_destroy(opt);
}

/* ---- groups ---------------------------------------------------------------------------------- */

static void groups(void) {
    fsdp_sgd_options_t d;
    fsdp_sgd_options_init(&d);
    d.lr = 0.1;
    fsdp_optim_t *opt = NULL;
    fsdp_optim_sgd_create(ctx, &d, &opt);
    double h0[MAXN], h1[MAXN], r0[MAXN], r1[MAXN];
    fsdp_tensor_t *p0 = make_param(2, h0), *p1 = make_param(3, h1);
    memcpy(r0, h0, sizeof h0);
    memcpy(r1, h1, sizeof h1);
    fsdp_tensor_set_name(p1, "decoder.weight");

    int g0 = -1, g1 = -1;
    const char *n0[1] = {"encoder.weight"};
    tap_is_int(fsdp_optim_add_group(opt, 1, &p0, n0, NULL, &g0), 0, "group 0 with defaults");
    fsdp_sgd_options_t o;
    fsdp_optim_get_options(opt, -1, &o);
    o.lr = 0.01;
    o.momentum = 0.9;
    tap_is_int(fsdp_optim_add_group(opt, 1, &p1, NULL, &o, &g1), 0,
               "group 1 with overrides, named by the tensor");
    tap_ok(g0 == 0 && g1 == 1, "group indices 0 and 1");
    const char *name = NULL;
    tap_ok(fsdp_optim_group_param(opt, 1, 0, &name) == p1 && name &&
               strcmp(name, "decoder.weight") == 0,
           "group 1 holds the tensor under its tensor name");
    double lr0 = 0, lr1 = 0;
    fsdp_optim_get_lr(opt, 0, &lr0);
    fsdp_optim_get_lr(opt, 1, &lr1);
    tap_ok(lr0 == 0.1 && lr1 == 0.01, "per-group lr (%g, %g)", lr0, lr1);

    /* Errors leave the groups alone. */
    const char *nd[1] = {"again"};
    tap_is_int(fsdp_optim_add_group(opt, 1, &p0, nd, NULL, NULL), FSDP_EINVAL,
               "a parameter in two groups is refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "'again'", "the message names the parameter");
    fsdp_tensor_t *p2 = make_param(2, h0);
    fsdp_tensor_set_requires_grad(p2, true);
    tap_is_int(fsdp_optim_add_group(opt, 1, &p2, n0, NULL, NULL), FSDP_EINVAL,
               "a duplicate name is refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "encoder.weight", "the message names the name");
    fsdp_tensor_t *twice[2] = {p2, p2};
    const char *tn[2] = {"x", "y"};
    tap_is_int(fsdp_optim_add_group(opt, 2, twice, tn, NULL, NULL), FSDP_EINVAL,
               "a tensor twice in one group is refused");
    tap_is_int(fsdp_optim_add_group(opt, 1, &p2, NULL, NULL, NULL), FSDP_EINVAL,
               "an unnamed parameter is refused");
    const int64_t one[1] = {4};
    fsdp_tensor_t *h = NULL;
    fsdp_tensor_zeros(ctx, FSDP_DTYPE_F16, 1, one, FSDP_MEM_OTHER, &h);
    const char *hn[1] = {"half"};
    tap_is_int(fsdp_optim_add_group(opt, 1, &h, hn, NULL, NULL), FSDP_EINVAL,
               "an f16 parameter is refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "half", "the message names it");
    fsdp_tensor_release(h);
    fsdp_tensor_t *nonleaf = NULL;
    fsdp_scale(p2, 2.0, &nonleaf);
    const char *ln[1] = {"nonleaf"};
    tap_is_int(nonleaf ? fsdp_optim_add_group(opt, 1, &nonleaf, ln, NULL, NULL) : -99, FSDP_EINVAL,
               "a non-leaf is refused");
    fsdp_tensor_release(nonleaf);
    fsdp_tape_clear(ctx);
    tap_is_int(fsdp_optim_num_groups(opt), 2, "failed additions added nothing");

    /* A scheduler lowers group 1's lr; the step follows. */
    tap_is_int(fsdp_optim_set_lr(opt, 1, 0.05), 0, "set_lr");
    tap_is_int(fsdp_optim_set_lr(opt, 1, -0.5), FSDP_EINVAL, "negative lr refused");
    tap_is_int(fsdp_optim_set_lr(opt, 7, 0.5), FSDP_EINVAL, "set_lr of a missing group");
    tap_is_int(fsdp_optim_get_lr(opt, -1, &lr0), FSDP_EINVAL, "get_lr of a missing group");
    struct cfg c0 = {"g0", FSDP_OPTIM_SGD, 0.1, 0, 0, 0, 0, 0, 0, false, false};
    struct cfg c1 = {"g1", FSDP_OPTIM_SGD, 0.05, 0.9, 0, 0, 0, 0, 0, false, false};
    struct ref_state s0, s1;
    memset(&s0, 0, sizeof s0);
    memset(&s1, 0, sizeof s1);
    int rc = 0;
    for (int s = 0; s < 3 && rc == 0; s++) {
        double g0v[MAXN], g1v[MAXN];
        for (int i = 0; i < 6; i++) {
            g0v[i] = grad_value(0, i, s);
            g1v[i] = grad_value(1, i, s);
        }
        set_grad(p0, g0v);
        set_grad(p1, g1v);
        ref_step(&c0, 5, r0, g0v, &s0);
        ref_step(&c1, 6, r1, g1v, &s1);
        rc = fsdp_optim_step(opt);
    }
    double got0[MAXN], got1[MAXN];
    read_tensor(p0, got0);
    read_tensor(p1, got1);
    tap_ok(rc == 0 && worst(5, got0, r0, 1e-12, 1e-14) <= 1 &&
               worst(6, got1, r1, 1e-12, 1e-14) <= 1,
           "each group steps with its own hyper-parameters");
    fsdp_optim_destroy(opt);
    fsdp_tensor_release(p0);
    fsdp_tensor_release(p1);
    fsdp_tensor_release(p2);
}

/* ---- skipping, zero_grad, bad gradients, grad mode ------------------------------------------- */

static void stepping(void) {
    fsdp_optim_t *opt = NULL;
    fsdp_optim_adam_create(ctx, NULL, false, &opt);
    double h0[MAXN], h1[MAXN];
    fsdp_tensor_t *p[2] = {make_param(0, h0), make_param(1, h1)};
    const char *names[2] = {"with_grad", "without_grad"};
    fsdp_optim_add_group(opt, 2, p, names, NULL, NULL);
    double g[MAXN];
    for (int i = 0; i < 6; i++)
        g[i] = grad_value(0, i, 0);
    set_grad(p[0], g);
    fsdp_tensor_t *before = NULL;
    fsdp_tensor_clone(p[1], FSDP_MEM_OTHER, &before);
    tap_is_int(fsdp_optim_step(opt), 0, "step with one parameter lacking a gradient");
    tap_ok(bits_equal(p[1], before), "the parameter without a gradient is unchanged");
    tap_ok(fsdp_is_grad_enabled(ctx), "grad mode is restored after the step");
    fsdp_named_list_t sd;
    fsdp_optim_state_dict(opt, &sd);
    tap_ok(entry(&sd, "with_grad.exp_avg") && !entry(&sd, "without_grad.exp_avg") &&
               !entry(&sd, "without_grad.step"),
           "only the parameter with a gradient has state");
    fsdp_named_list_free(&sd);
    tap_is_size(fsdp_optim_state_bytes(opt), 2 * 5 * sizeof(float),
                "state: exp_avg and exp_avg_sq of 5 f32");

    /* zero_grad, both ways. */
    tap_is_int(fsdp_optim_zero_grad(opt, false), 0, "zero_grad(set_to_none = false)");
    double z[MAXN] = {1};
    fsdp_tensor_t *gr = fsdp_tensor_grad(p[0]);
    if (gr) read_tensor(gr, z);
    tap_ok(gr && z[0] == 0 && z[4] == 0, "the gradient is kept and zeroed");
    tap_ok(fsdp_tensor_grad(p[1]) == NULL, "a missing gradient stays missing");
    tap_is_int(fsdp_optim_zero_grad(opt, true), 0, "zero_grad(set_to_none = true)");
    tap_ok(fsdp_tensor_grad(p[0]) == NULL, "the gradient is gone");
    fsdp_tensor_t *kept = NULL;
    fsdp_tensor_clone(p[0], FSDP_MEM_OTHER, &kept);
    tap_is_int(fsdp_optim_step(opt), 0, "a step without gradients");
    tap_ok(bits_equal(p[0], kept), "changes nothing");

    /* A gradient of the wrong dtype is refused before anything moves. */
    set_grad(p[0], g);
    fsdp_tensor_t *g64 = make_tensor(FSDP_DTYPE_F64, 2, shape_mat, g);
    fsdp_tensor_set_grad(p[1], g64);
    fsdp_tensor_release(g64);
    tap_is_int(fsdp_optim_step(opt), FSDP_EINVAL, "an f64 gradient of an f32 parameter");
    tap_has_str(fsdp_ctx_last_error(ctx), "without_grad", "the message names the parameter");
    tap_ok(bits_equal(p[0], kept), "no parameter was updated");
    tap_is_size(fsdp_optim_state_bytes(opt), 2 * 5 * sizeof(float), "no state was created");
    fsdp_tensor_release(kept);
    fsdp_tensor_release(before);
    fsdp_optim_destroy(opt);
    fsdp_tensor_release(p[0]);
    fsdp_tensor_release(p[1]);
}

/* A transposed (non-contiguous) parameter and gradient are staged through contiguous copies. */
static void non_contiguous(void) {
    const int64_t base_shape[2] = {2, 3};
    double v[6], gv[6];
    for (int i = 0; i < 6; i++) {
        v[i] = init_value(0, i);
        gv[i] = grad_value(1, i, 0);
    }
    fsdp_tensor_t *base = make_tensor(FSDP_DTYPE_F64, 2, base_shape, v), *pt = NULL;
    fsdp_tensor_t *gbase = make_tensor(FSDP_DTYPE_F64, 2, base_shape, gv), *gt = NULL;
    fsdp_transpose(base, 0, 1, &pt);
    fsdp_transpose(gbase, 0, 1, &gt);
    if (!pt || !gt) tap_bail("transpose: %s", fsdp_ctx_last_error(ctx));
    fsdp_tensor_set_requires_grad(pt, true);
    fsdp_tensor_set_grad(pt, gt);
    fsdp_optim_t *opt = NULL;
    fsdp_sgd_options_t o;
    fsdp_sgd_options_init(&o);
    o.lr = 0.5;
    o.momentum = 0.9;
    fsdp_optim_sgd_create(ctx, &o, &opt);
    const char *n[1] = {"transposed"};
    fsdp_optim_add_group(opt, 1, &pt, n, NULL, NULL);
    tap_ok(!fsdp_tensor_is_contiguous(pt), "the parameter is a transposed view");
    int rc = fsdp_optim_step(opt);
    if (rc == 0) rc = fsdp_optim_step(opt);
    /* Element-wise update: the base's element i moves by the gradient's element i. */
    double got[6], want[6];
    read_tensor(base, got);
    for (int i = 0; i < 6; i++)
        want[i] = v[i] - 0.5 * gv[i] - 0.5 * (0.9 * gv[i] + gv[i]);
    tap_ok(rc == 0 && worst(6, got, want, 1e-14, 1e-15) <= 1,
           "non-contiguous parameter and gradient updated in place");
    fsdp_optim_destroy(opt);
    fsdp_tensor_release(pt);
    fsdp_tensor_release(gt);
    fsdp_tensor_release(base);
    fsdp_tensor_release(gbase);
}

/* ---- gradients of lower precision ------------------------------------------------------------ */

/* A tensor of dtype dt (f16, bf16, f32 or f64) holding v rounded to dt; *wide receives the
 * rounded values widened exactly (what an upcast by hand gives). */
static fsdp_tensor_t *make_lp(fsdp_dtype_t dt, int ndim, const int64_t *shape, const double *v,
                              double *wide) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= shape[i];
    if (dt == FSDP_DTYPE_F32 || dt == FSDP_DTYPE_F64) {
        for (int64_t i = 0; i < n; i++)
            wide[i] = round_to(dt, v[i]);
        return make_tensor(dt, ndim, shape, v);
    }
    uint16_t h[MAXN];
    for (int64_t i = 0; i < n; i++) {
        h[i] = dt == FSDP_DTYPE_F16 ? fsdp_f32_to_f16((float)v[i]) : fsdp_f32_to_bf16((float)v[i]);
        wide[i] = dt == FSDP_DTYPE_F16 ? fsdp_f16_to_f32(h[i]) : fsdp_bf16_to_f32(h[i]);
    }
    fsdp_tensor_t *t = NULL;
    fsdp_tensor_from_host(ctx, dt, ndim, shape, h, FSDP_MEM_GRADS, &t);
    if (!t) tap_bail("cannot create a tensor: %s", fsdp_ctx_last_error(ctx));
    return t;
}

/* keep_low_precision_grads hands the optimizer f16/bf16 gradients of f32 flat parameters;
 * PyTorch's optimizers promote them. A step with a lower-precision gradient must equal, bit for
 * bit, a step with that gradient upcast by hand to the parameter's dtype: SGD (momentum,
 * weight decay) and Adam (weight decay, amsgrad), three steps, for f16 and bf16 gradients of f32
 * parameters and f16 and f32 gradients of f64 parameters. */
static void low_precision_grads(void) {
    static const struct {
        fsdp_dtype_t p, g;
    } pairs[4] = {{FSDP_DTYPE_F32, FSDP_DTYPE_F16},
                  {FSDP_DTYPE_F32, FSDP_DTYPE_BF16},
                  {FSDP_DTYPE_F64, FSDP_DTYPE_F16},
                  {FSDP_DTYPE_F64, FSDP_DTYPE_F32}};
    for (int alg = 0; alg < 2; alg++)
        for (int k = 0; k < 4; k++) {
            fsdp_optim_t *oa = NULL, *ob = NULL;
            if (alg == 0) {
                fsdp_sgd_options_t o;
                fsdp_sgd_options_init(&o);
                o.lr = 0.1;
                o.momentum = 0.9;
                o.weight_decay = 0.01;
                fsdp_optim_sgd_create(ctx, &o, &oa);
                fsdp_optim_sgd_create(ctx, &o, &ob);
            } else {
                fsdp_adam_options_t o;
                fsdp_adam_options_init(&o);
                o.lr = 0.01;
                o.weight_decay = 0.01;
                o.amsgrad = true;
                fsdp_optim_adam_create(ctx, &o, false, &oa);
                fsdp_optim_adam_create(ctx, &o, false, &ob);
            }
            double v[MAXN], g[MAXN], wide[MAXN];
            for (int i = 0; i < 6; i++)
                v[i] = init_value(k, i);
            fsdp_tensor_t *pa = make_tensor(pairs[k].p, 2, shape_mat, v);
            fsdp_tensor_t *pb = make_tensor(pairs[k].p, 2, shape_mat, v);
            fsdp_tensor_set_requires_grad(pa, true);
            fsdp_tensor_set_requires_grad(pb, true);
            const char *na[1] = {"lp"}, *nb[1] = {"upcast"};
            fsdp_optim_add_group(oa, 1, &pa, na, NULL, NULL);
            fsdp_optim_add_group(ob, 1, &pb, nb, NULL, NULL);
            int rc = 0;
            bool kept = true;
            for (int step = 0; step < 3 && rc == 0; step++) {
                for (int i = 0; i < 6; i++)
                    g[i] = grad_value(k, i, step);
                fsdp_tensor_t *ga = make_lp(pairs[k].g, 2, shape_mat, g, wide);
                fsdp_tensor_t *gb = make_tensor(pairs[k].p, 2, shape_mat, wide);
                fsdp_tensor_set_grad(pa, ga);
                fsdp_tensor_set_grad(pb, gb);
                rc = fsdp_optim_step(oa);
                if (rc == 0) rc = fsdp_optim_step(ob);
                kept = kept && fsdp_tensor_grad(pa) == ga;
                fsdp_tensor_release(ga);
                fsdp_tensor_release(gb);
            }
            tap_ok(rc == 0 && bits_equal(pa, pb) && kept,
                   "%s, %s gradient of an %s parameter: 3 steps equal (bitwise) steps with the "
                   "gradient upcast by hand; the gradient is left as it is",
                   alg == 0 ? "SGD(momentum, weight_decay)" : "Adam(weight_decay, amsgrad)",
                   fsdp_dtype_name(pairs[k].g), fsdp_dtype_name(pairs[k].p));
            if (rc < 0) tap_diag("%s", fsdp_ctx_last_error(ctx));
            fsdp_optim_destroy(oa);
            fsdp_optim_destroy(ob);
            fsdp_tensor_release(pa);
            fsdp_tensor_release(pb);
        }

    /* A gradient of higher precision is still refused, naming the parameter and both dtypes. */
    fsdp_optim_t *opt = NULL;
    fsdp_optim_sgd_create(ctx, NULL, &opt);
    double v[MAXN] = {0};
    fsdp_tensor_t *p16 = make_tensor(FSDP_DTYPE_F32, 1, shape_vec, v);
    fsdp_tensor_set_requires_grad(p16, true);
    const char *n[1] = {"narrow"};
    fsdp_optim_add_group(opt, 1, &p16, n, NULL, NULL);
    fsdp_tensor_t *g64 = make_tensor(FSDP_DTYPE_F64, 1, shape_vec, v);
    fsdp_tensor_set_grad(p16, g64);
    int rc = fsdp_optim_step(opt);
    const char *e = fsdp_ctx_last_error(ctx);
    tap_ok(rc == FSDP_EINVAL && strstr(e, "narrow") && strstr(e, "f64") && strstr(e, "f32") &&
               strstr(e, "same dtype and shape"),
           "an f64 gradient of an f32 parameter is still refused, naming the parameter and both "
           "dtypes");
    if (rc != FSDP_EINVAL) tap_diag("rc %d: %s", rc, e);
    fsdp_tensor_release(g64);
    fsdp_optim_destroy(opt);
    fsdp_tensor_release(p16);
}

/* ---- state dict ------------------------------------------------------------------------------ */

/* Two optimizers over equal parameters: the first steps twice and saves, the second loads; then
 * both step once more and must agree bit for bit. */
static void round_trip(const struct cfg *c) {
    fsdp_tensor_t *pa[NPARAMS], *pb[NPARAMS];
    double host[MAXN];
    const char *names[NPARAMS] = {"l0.w", "l0.b", "l1.w", "l1.b"};
    fsdp_optim_t *a = NULL, *b = NULL;
    create_from_cfg(c, &a);
    create_from_cfg(c, &b);
    for (int k = 0; k < NPARAMS; k++)
        pa[k] = make_param(k, host);
    /* Two groups, the second with half the lr (set after creation: the load must restore it). */
    fsdp_optim_add_group(a, 2, pa, names, NULL, NULL);
    fsdp_optim_add_group(a, 2, pa + 2, names + 2, NULL, NULL);
    fsdp_optim_set_lr(a, 1, c->lr / 2);
    for (int s = 0; s < 2; s++) {
        for (int k = 0; k < NPARAMS; k++) {
            double g[MAXN];
            for (int i = 0; i < 6; i++)
                g[i] = grad_value(k, i, s);
            set_grad(pa[k], g);
        }
        fsdp_optim_step(a);
    }
    fsdp_named_list_t sd;
    int rc = fsdp_optim_state_dict(a, &sd);
    tap_ok(rc == 0 && sd.owned, "%s: state_dict (%zu entries) owns its tensors", c->what, sd.n);

    /* b: copies of a's parameters now, registered in one group per pair again. */
    for (int k = 0; k < NPARAMS; k++) {
        fsdp_tensor_clone(pa[k], FSDP_MEM_PARAMS, &pb[k]);
        fsdp_tensor_set_requires_grad(pb[k], true);
    }
    fsdp_optim_add_group(b, 2, pb, names, NULL, NULL);
    fsdp_optim_add_group(b, 2, pb + 2, names + 2, NULL, NULL);
    rc = fsdp_optim_load_state_dict(b, &sd);
    if (rc < 0) tap_diag("load: %s", fsdp_ctx_last_error(ctx));
    tap_is_int(rc, 0, "%s: load_state_dict into a fresh optimizer", c->what);
    double lr = 0;
    fsdp_optim_get_lr(b, 1, &lr);
    tap_ok(lr == c->lr / 2, "%s: the group's lr came with the state (%g)", c->what, lr);
    tap_is_size(fsdp_optim_state_bytes(b), fsdp_optim_state_bytes(a), "%s: same state size",
                c->what);
    for (int k = 0; k < NPARAMS; k++) {
        double g[MAXN];
        for (int i = 0; i < 6; i++)
            g[i] = grad_value(k, i, 2);
        set_grad(pa[k], g);
        set_grad(pb[k], g);
    }
    /* The same state through a checkpoint file loads too. */
    char path[192];
    char name[64];
    snprintf(name, sizeof name, "t_optim_%ld.sd", (long)getpid());
    tap_tmppath(path, sizeof path, name);
    fsdp_named_list_t file = {0};
    rc = fsdp_state_dict_save(&sd, path);
    if (rc == 0) rc = fsdp_state_dict_load(ctx, path, &file);
    if (rc == 0) rc = fsdp_optim_load_state_dict(b, &file);
    if (rc < 0) tap_diag("file: %s", fsdp_ctx_last_error(ctx));
    tap_is_int(rc, 0, "%s: the state dict survives fsdp_state_dict_save/load", c->what);
    fsdp_named_list_free(&file);
    remove(path);
    fsdp_optim_step(a);
    fsdp_optim_step(b);
    bool same = true;
    for (int k = 0; k < NPARAMS; k++)
        same = same && bits_equal(pa[k], pb[k]);
    tap_ok(same, "%s: the next step is bitwise equal after the round trip", c->what);
    fsdp_named_list_free(&sd);
    fsdp_optim_destroy(a);
    fsdp_optim_destroy(b);
    for (int k = 0; k < NPARAMS; k++) {
        fsdp_tensor_release(pa[k]);
        fsdp_tensor_release(pb[k]);
    }
}

static void state_dict(void) {
    static const struct cfg adam = {
        "AdamW amsgrad", FSDP_OPTIM_ADAMW, 1e-2, 0, 0, 0.1, 0.9, 0.999, 1e-8, false, true};
    static const struct cfg sgd = {"SGD momentum", FSDP_OPTIM_SGD, 0.1, 0.9, 0.1, 0.01, 0, 0, 0,
                                   false,          false};
    round_trip(&adam);
    round_trip(&sgd);

    /* Keys and values. */
    fsdp_optim_t *opt = NULL;
    fsdp_optim_adam_create(ctx, NULL, false, &opt);
    double host[MAXN];
    fsdp_tensor_t *p[2] = {make_param(0, host), make_param(3, host)};
    const char *names[2] = {"w", "v"};
    fsdp_optim_add_group(opt, 2, p, names, NULL, NULL);
    for (int s = 0; s < 2; s++) {
        double g[MAXN];
        for (int i = 0; i < 6; i++)
            g[i] = grad_value(0, i, s);
        set_grad(p[0], g);
        set_grad(p[1], g);
        fsdp_optim_step(opt);
    }
    fsdp_named_list_t sd;
    fsdp_optim_state_dict(opt, &sd);
    double v = -1;
    fsdp_tensor_t *t = entry(&sd, "w.step");
    if (t) fsdp_tensor_item(t, 0, &v);
    tap_ok(t && fsdp_tensor_dtype(t) == FSDP_DTYPE_F64 && v == 2.0, "'w.step' is f64 2");
    t = entry(&sd, "group.0.beta2");
    v = -1;
    if (t) fsdp_tensor_item(t, 0, &v);
    tap_ok(t && v == 0.999, "'group.0.beta2' is 0.999");
    t = entry(&sd, "v.exp_avg_sq");
    tap_ok(t && fsdp_tensor_ndim(t) == 2 && fsdp_tensor_size(t, 1) == 3 &&
               fsdp_tensor_dtype(t) == FSDP_DTYPE_F64,
           "'v.exp_avg_sq' has the parameter's shape and dtype");
    tap_ok(!entry(&sd, "w.max_exp_avg_sq") && !entry(&sd, "w.momentum_buffer"),
           "no keys of other configurations");
    tap_ok(sd.n == 6 + 2 * 3, "6 group keys and 3 per parameter (%zu)", sd.n);

    /* A bad state dict: one key missing, one unexpected, one of the wrong shape. */
    fsdp_named_list_t bad = {0};
    bad.n = sd.n;
    bad.names = calloc(sd.n, sizeof *bad.names);
    bad.tensors = calloc(sd.n, sizeof *bad.tensors);
    fsdp_tensor_t *wrong = make_tensor(FSDP_DTYPE_F32, 1, shape_vec, host);
    for (size_t i = 0; i < sd.n; i++) {
        bad.names[i] = sd.names[i];
        bad.tensors[i] = sd.tensors[i];
        if (strcmp(sd.names[i], "w.exp_avg_sq") == 0) bad.names[i] = (char *)"u.exp_avg_sq";
        if (strcmp(sd.names[i], "v.exp_avg") == 0) bad.tensors[i] = wrong;
        if (strcmp(sd.names[i], "group.0.lr") == 0) bad.names[i] = (char *)"group.0.lr_typo";
    }
    fsdp_named_list_t before;
    fsdp_optim_state_dict(opt, &before);
    tap_is_int(fsdp_optim_load_state_dict(opt, &bad), FSDP_EINVAL, "a bad state dict is refused");
    const char *msg = fsdp_ctx_last_error(ctx);
    tap_has_str(msg, "'w.exp_avg_sq'", "missing buffer named");
    tap_has_str(msg, "'group.0.lr'", "missing hyper-parameter named");
    tap_has_str(msg, "'u.exp_avg_sq'", "unexpected key named");
    tap_has_str(msg, "'group.0.lr_typo'", "unexpected hyper-parameter key named");
    tap_has_str(msg, "'v.exp_avg'", "shape mismatch named");
    fsdp_named_list_t after;
    fsdp_optim_state_dict(opt, &after);
    bool same = after.n == before.n;
    for (size_t i = 0; same && i < after.n; i++)
        same = strcmp(after.names[i], before.names[i]) == 0 &&
               bits_equal(after.tensors[i], before.tensors[i]);
    tap_ok(same, "nothing was modified");

    /* A state whose step count is not an integer, and a missing step. */
    for (size_t i = 0; i < sd.n; i++) {
        bad.names[i] = sd.names[i];
        bad.tensors[i] = sd.tensors[i];
    }
    fsdp_tensor_t *half = NULL;
    fsdp_tensor_full(ctx, FSDP_DTYPE_F64, 0, NULL, 1.5, FSDP_MEM_OTHER, &half);
    for (size_t i = 0; i < sd.n; i++)
        if (strcmp(sd.names[i], "w.step") == 0) bad.tensors[i] = half;
    tap_is_int(fsdp_optim_load_state_dict(opt, &bad), FSDP_EINVAL, "step 1.5 is refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "'w.step'", "the message names the step");

    /* Loading an empty state for the parameters (only group keys) clears their state. */
    fsdp_named_list_t groups_only = sd;
    groups_only.n = 6;
    groups_only.owned = false;
    tap_is_int(fsdp_optim_load_state_dict(opt, &groups_only), 0,
               "a state dict without parameter state loads");
    tap_is_size(fsdp_optim_state_bytes(opt), 0, "and leaves no state");

    fsdp_tensor_release(half);
    fsdp_tensor_release(wrong);
    free(bad.names);
    free(bad.tensors);
    fsdp_named_list_free(&before);
    fsdp_named_list_free(&after);
    fsdp_named_list_free(&sd);
    fsdp_optim_destroy(opt);
    fsdp_tensor_release(p[0]);
    fsdp_tensor_release(p[1]);
}

/* ---- memory ---------------------------------------------------------------------------------- */

static void memory(void) {
    const size_t base = optim_mem();
    fsdp_adam_options_t o;
    fsdp_adam_options_init(&o);
    o.amsgrad = true;
    fsdp_optim_t *opt = NULL;
    fsdp_optim_adam_create(ctx, &o, false, &opt);
    double host[MAXN];
    fsdp_tensor_t *p[2] = {make_param(1, host), make_param(2, host)};
    const char *names[2] = {"f32", "f64"};
    fsdp_optim_add_group(opt, 2, p, names, NULL, NULL);
    tap_is_size(optim_mem(), base, "no state before the first step");
    for (int k = 0; k < 2; k++) {
        double g[MAXN];
        for (int i = 0; i < 6; i++)
            g[i] = grad_value(k, i, 0);
        set_grad(p[k], g);
    }
    fsdp_optim_step(opt);
    const size_t want = 3 * (6 * sizeof(float) + 5 * sizeof(double));
    tap_is_size(optim_mem() - base, want, "m, v and vmax of both parameters under optim");
    tap_is_size(fsdp_optim_state_bytes(opt), want, "fsdp_optim_state_bytes agrees");
    fsdp_named_list_t sd;
    fsdp_optim_state_dict(opt, &sd);
    tap_is_size(optim_mem() - base, want, "a state dict's copies are not counted as optim");
    fsdp_named_list_free(&sd);
    fsdp_optim_destroy(opt);
    tap_is_size(optim_mem(), base, "destroy frees the state");
    fsdp_tensor_release(p[0]);
    fsdp_tensor_release(p[1]);
}

int main(void) {
    tap_plan_lazy();
    fsdp_ctx_options_t co;
    fsdp_ctx_options_init(&co);
    if (fsdp_ctx_create(&co, &ctx) < 0) tap_bail("cannot create a context");
    algorithms();
    options();
    groups();
    stepping();
    non_contiguous();
    low_precision_grads();
    state_dict();
    memory();
    fsdp_ctx_destroy(ctx);
    return tap_done();
}
