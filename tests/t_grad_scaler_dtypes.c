/* SPDX-License-Identifier: MIT */
/*
 * t_grad_scaler_dtypes.c: the sharded gradient scaler (fsdp/grad_scaler.h, feature F44 of
 * MP-S02) beyond f32, and its errors; t_grad_scaler.c has scaling, clipping, skipping, growth and
 * the mixed-precision run.
 * Gradient dtypes (one rank and two): f16, bf16 and f64 gradients are unscaled in their own
 * dtype exactly as PyTorch rounds (x * (float)(1/scale) in f32, rounded once; in f64 for f64),
 * an f16 inf is found, the flag reaches the other rank.
 * Errors: each bad option (the field and its value in the message), NULL arguments, unscale
 * twice, step twice, unscale after step, update before any step, use before scale(), a bad
 * update_to, bad and empty state dicts (nothing changes), a missing process group; the disabled
 * scaler is a pass-through.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "tap.h"

/* ---- gradient dtypes ------------------------------------------------------------------------ */

#define DT_N 6

/* f16/bf16/f64 gradients of f32/f64 parameters in a plain optimizer: unscaled as PyTorch rounds,
 * an f16 inf found on rank 0 reaches every rank. */
static int dtype_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    static const fsdp_dtype_t gdt[3] = {FSDP_DTYPE_F16, FSDP_DTYPE_BF16, FSDP_DTYPE_F64};
    static const double vals[DT_N] = {3.0, -1000.0, 0.125, 6.0e4, 1e-3, -7.5};
    const int64_t shape[1] = {DT_N};
    fsdp_tensor_t *p[3] = {NULL}, *g[3] = {NULL}, *loss = NULL, *scaled = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_grad_scaler_t *sc = NULL;
    int rc;
    for (int k = 0; k < 3; k++) {
        fsdp_dtype_t pdt = gdt[k] == FSDP_DTYPE_F64 ? FSDP_DTYPE_F64 : FSDP_DTYPE_F32;
        FU_TRY(done, "setting up", fsdp_tensor_zeros(ctx, pdt, 1, shape, FSDP_MEM_PARAMS, &p[k]));
        fsdp_tensor_set_requires_grad(p[k], true);
        FU_TRY(done, "setting up", fsdp_tensor_zeros(ctx, gdt[k], 1, shape, FSDP_MEM_GRADS, &g[k]));
        FU_TRY(done, "setting up", fsdp_tensor_set_grad(p[k], g[k]));
    }
    /* Element-wise values through the host. */
    for (int k = 0; k < 3; k++) {
        if (gdt[k] == FSDP_DTYPE_F64) {
            FU_TRY(done, "setting up", fsdp_tensor_copy_from_host(g[k], vals, sizeof vals));
        } else {
            uint16_t h[DT_N];
            for (int i = 0; i < DT_N; i++)
                h[i] = gdt[k] == FSDP_DTYPE_F16 ? fsdp_f32_to_f16((float)vals[i])
                                                : fsdp_f32_to_bf16((float)vals[i]);
            FU_TRY(done, "setting up", fsdp_tensor_copy_from_host(g[k], h, sizeof h));
        }
    }
    fsdp_sgd_options_t so;
    fsdp_sgd_options_init(&so);
    so.lr = 0.5;
    FU_TRY(done, "setting up", fsdp_optim_sgd_create(ctx, &so, &opt));
    const char *names[3] = {"g16", "gbf16", "g64"};
    FU_TRY(done, "setting up", fsdp_optim_add_group(opt, 3, p, names, NULL, NULL));
    /* A scale whose inverse is not a power of two: 3.0 -> inv = (float)(1/3). */
    fsdp_grad_scaler_options_t o;
    fsdp_grad_scaler_options_init(&o);
    o.init_scale = 3.0;
    FU_TRY(done, "setting up", fsdp_grad_scaler_create(ctx, &o, &sc));
    FU_TRY(done, "setting up",
           fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 0, NULL, 1.0, FSDP_MEM_OTHER, &loss));
    FU_TRY(done, "scale", fsdp_grad_scaler_scale(sc, loss, &scaled));
    FU_TRY(done, "unscale", fsdp_grad_scaler_unscale(sc, opt));
    const float inv = (float)(1.0 / 3.0);
    for (int k = 0; k < 3; k++) {
        bool ok = fsdp_tensor_dtype(g[k]) == gdt[k];
        char why[300] = "";
        for (int i = 0; i < DT_N && ok; i++) {
            double got = 0, want;
            FU_TRY(done, "reading", fsdp_tensor_item(g[k], i, &got));
            if (gdt[k] == FSDP_DTYPE_F16)
                want = fsdp_f16_to_f32(
                    fsdp_f32_to_f16(fsdp_f16_to_f32(fsdp_f32_to_f16((float)vals[i])) * inv));
            else if (gdt[k] == FSDP_DTYPE_BF16)
                want = fsdp_bf16_to_f32(
                    fsdp_f32_to_bf16(fsdp_bf16_to_f32(fsdp_f32_to_bf16((float)vals[i])) * inv));
            else
                want = vals[i] * (double)inv;
            if (got != want) {
                ok = false;
                snprintf(why, sizeof why, "element %d: %.9g, want %.9g", i, got, want);
            }
        }
        char name[200];
        snprintf(name, sizeof name,
                 "F44 unscale of a %s gradient: stays %s, each element (%s)(x * (float)(1/3)) "
                 "computed in %s, exactly",
                 fsdp_dtype_name(gdt[k]), fsdp_dtype_name(gdt[k]), fsdp_dtype_name(gdt[k]),
                 gdt[k] == FSDP_DTYPE_F64 ? "f64" : "f32");
        fu_ck(r, ok, name, "%s", why);
    }
    /* The step with the unscaled f16/bf16/f64 gradients (the optimizer upcasts them). */
    bool stepped = false;
    FU_TRY(done, "step", fsdp_grad_scaler_step(sc, opt, &stepped));
    double pv = 0, gv = 0;
    FU_TRY(done, "reading", fsdp_tensor_item(p[0], 0, &pv));
    FU_TRY(done, "reading", fsdp_tensor_item(g[0], 0, &gv));
    fu_ck(r, stepped && pv == (double)(0.0f - (float)(0.5 * gv)),
          "F44 step with f16 gradients of f32 parameters: the step is taken with the upcast "
          "gradient",
          "stepped %d, p %.9g, g %.9g", stepped, pv, gv);
    FU_TRY(done, "update", fsdp_grad_scaler_update(sc));

    /* An f16 inf on rank 0 only. */
    fsdp_tensor_release(scaled);
    scaled = NULL;
    FU_TRY(done, "scale", fsdp_grad_scaler_scale(sc, loss, &scaled));
    if (fsdp_ctx_rank(ctx) == 0) {
        uint16_t h[DT_N];
        for (int i = 0; i < DT_N; i++)
            h[i] = fsdp_f32_to_f16(i == 3 ? 7e4f : 1.0f); /* 7e4 overflows f16 to inf */
        FU_TRY(done, "setting up", fsdp_tensor_copy_from_host(g[0], h, sizeof h));
    }
    FU_TRY(done, "step", fsdp_grad_scaler_step(sc, opt, &stepped));
    fu_ck(r, fsdp_grad_scaler_found_inf(sc) && !stepped,
          "F44: an f16 inf in rank 0's gradient: every rank finds it and skips the step",
          "found_inf %d, stepped %d", fsdp_grad_scaler_found_inf(sc), stepped);
    FU_TRY(done, "update", fsdp_grad_scaler_update(sc));
    fu_ck(r, fsdp_grad_scaler_get_scale(sc) == 1.5, "F44: the scale backs off to 3 x 0.5", "%g",
          fsdp_grad_scaler_get_scale(sc));
done:
    for (int k = 0; k < 3; k++) {
        fsdp_tensor_release(p[k]);
        fsdp_tensor_release(g[k]);
    }
    fsdp_tensor_release(loss);
    fsdp_tensor_release(scaled);
    fsdp_optim_destroy(opt);
    fsdp_grad_scaler_destroy(sc);
    return rc;
}

/* ---- errors and the disabled scaler ---------------------------------------------------------- */

/* Checks rc is FSDP_EINVAL and the last error contains every non-NULL needle. */
static void ck_err(fsdp_ctx_t *ctx, int rc, const char *a, const char *b, const char *name) {
    const char *e = fsdp_ctx_last_error(ctx);
    bool ok = rc == FSDP_EINVAL && (!a || strstr(e, a)) && (!b || strstr(e, b));
    tap_ok(ok, "F44 error: %s", name);
    if (!ok)
        tap_diag("rc %s, message '%s', wanted '%s' and '%s'", fsdp_err_name(rc), e, a ? a : "",
                 b ? b : "");
}

static int errors_rank(fsdp_ctx_t *ctx, void *arg) {
    (void)arg;
    fsdp_grad_scaler_t *s = NULL, *d = NULL;
    fsdp_grad_scaler_options_t o;
    fsdp_tensor_t *p = NULL, *g = NULL, *loss = NULL, *out = NULL;
    fsdp_optim_t *opt = NULL;
    const int64_t shape[1] = {4};
    int rc;

    fsdp_grad_scaler_options_init(&o);
    tap_ok(o.init_scale == 65536.0 && o.growth_factor == 2.0 && o.backoff_factor == 0.5 &&
               o.growth_interval == 2000 && o.enabled && !o.pg,
           "F44 options_init: PyTorch's defaults (2^16, 2.0, 0.5, 2000, enabled, world group)");
    static const struct {
        const char *field, *value;
    } bad[] = {
        {"growth_factor", "1"},    {"growth_factor", "0.5"},   {"backoff_factor", "1"},
        {"backoff_factor", "0"},   {"backoff_factor", "-0.5"}, {"growth_interval", "0"},
        {"growth_interval", "-3"}, {"init_scale", "0"},        {"init_scale", "-1"},
        {"init_scale", "inf"},     {"init_scale", "1e+39"},    {"growth_factor", "nan"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fsdp_grad_scaler_options_init(&o);
        double v = strtod(bad[i].value, NULL);
        if (!strcmp(bad[i].field, "growth_factor")) o.growth_factor = v;
        if (!strcmp(bad[i].field, "backoff_factor")) o.backoff_factor = v;
        if (!strcmp(bad[i].field, "growth_interval")) o.growth_interval = (int64_t)v;
        if (!strcmp(bad[i].field, "init_scale")) o.init_scale = v;
        s = (fsdp_grad_scaler_t *)&o; /* must be reset to NULL */
        rc = fsdp_grad_scaler_create(ctx, &o, &s);
        char name[120];
        snprintf(name, sizeof name, "create with %s = %s names the field and the value",
                 bad[i].field, bad[i].value);
        ck_err(ctx, rc, bad[i].field, bad[i].value, name);
        tap_ok(s == NULL, "F44 error: a failed create leaves *out NULL (%s)", bad[i].field);
        s = NULL;
    }
    fsdp_grad_scaler_options_init(&o);
    o.enabled = false;
    o.growth_factor = 0.1;
    rc = fsdp_grad_scaler_create(ctx, &o, &d);
    tap_ok(rc == 0 && d, "F44: a disabled scaler's options are not checked (as PyTorch)");
    fsdp_grad_scaler_destroy(d);
    d = NULL;
    tap_is_int(fsdp_grad_scaler_create(NULL, NULL, &s), FSDP_EINVAL, "F44 error: create, NULL ctx");
    ck_err(ctx, fsdp_grad_scaler_create(ctx, NULL, NULL), "out", NULL, "create, NULL out");

    /* A parameter and a gradient, an optimizer and a loss. */
    rc = fsdp_tensor_zeros(ctx, FSDP_DTYPE_F32, 1, shape, FSDP_MEM_PARAMS, &p);
    if (rc == 0) rc = fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 1, shape, 2.0, FSDP_MEM_GRADS, &g);
    if (rc == 0) fsdp_tensor_set_requires_grad(p, true);
    if (rc == 0) rc = fsdp_tensor_set_grad(p, g);
    if (rc == 0) rc = fsdp_optim_sgd_create(ctx, NULL, &opt);
    const char *pname = "p";
    if (rc == 0) rc = fsdp_optim_add_group(opt, 1, &p, &pname, NULL, NULL);
    if (rc == 0) rc = fsdp_tensor_full(ctx, FSDP_DTYPE_F16, 0, NULL, 1.5, FSDP_MEM_OTHER, &loss);
    if (rc == 0) rc = fsdp_grad_scaler_create(ctx, NULL, &s);
    if (rc < 0) {
        tap_bail("setting up: %s (%s)", fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
        goto done;
    }
    /* Before the first scale(). */
    ck_err(ctx, fsdp_grad_scaler_unscale(s, opt), "Attempted unscale_ but _scale is None", NULL,
           "unscale before the first scale()");
    ck_err(ctx, fsdp_grad_scaler_step(s, opt, NULL), "Attempted step", NULL,
           "step before the first scale()");
    ck_err(ctx, fsdp_grad_scaler_update(s), "Attempted update", NULL,
           "update before the first scale()");
    /* NULL arguments. */
    tap_is_int(fsdp_grad_scaler_scale(NULL, loss, &out), FSDP_EINVAL, "F44 error: scale, NULL s");
    ck_err(ctx, fsdp_grad_scaler_scale(s, NULL, &out), "loss is NULL", NULL, "scale, NULL loss");
    ck_err(ctx, fsdp_grad_scaler_scale(s, loss, NULL), "out is NULL", NULL, "scale, NULL out");
    ck_err(ctx, fsdp_grad_scaler_unscale(s, NULL), "opt is NULL", NULL, "unscale, NULL opt");
    ck_err(ctx, fsdp_grad_scaler_step(s, NULL, NULL), "opt is NULL", NULL, "step, NULL opt");
    tap_is_int(fsdp_grad_scaler_unscale(NULL, opt), FSDP_EINVAL, "F44 error: unscale, NULL s");
    tap_is_int(fsdp_grad_scaler_step(NULL, opt, NULL), FSDP_EINVAL, "F44 error: step, NULL s");
    tap_is_int(fsdp_grad_scaler_update(NULL), FSDP_EINVAL, "F44 error: update, NULL s");
    tap_is_int(fsdp_grad_scaler_update_to(NULL, 2.0), FSDP_EINVAL, "F44 error: update_to, NULL s");
    ck_err(ctx, fsdp_grad_scaler_state_dict(s, NULL), "st is NULL", NULL, "state_dict, NULL st");
    ck_err(ctx, fsdp_grad_scaler_load_state_dict(s, NULL), "st is NULL", NULL,
           "load_state_dict, NULL st");
    tap_ok(fsdp_grad_scaler_get_scale(NULL) == 1.0 && !fsdp_grad_scaler_found_inf(NULL),
           "F44: get_scale(NULL) is 1.0, found_inf(NULL) false");

    /* Scaling an f16 loss: in f16, by the f32 scale. */
    rc = fsdp_grad_scaler_scale(s, loss, &out);
    double v = 0;
    if (rc == 0) rc = fsdp_tensor_item(out, 0, &v);
    tap_ok(rc == 0 && fsdp_tensor_dtype(out) == FSDP_DTYPE_F16 && isinf(v),
           "F44 scale: an f16 loss 1.5 x 2^16 stays f16 and overflows to inf (as PyTorch)");
    fsdp_tensor_release(out);
    out = NULL;
    ck_err(ctx, fsdp_grad_scaler_update(s), "No inf checks were recorded prior to update", NULL,
           "update with no unscale or step since the last update");
    /* Order of calls. */
    rc = fsdp_grad_scaler_unscale(s, opt);
    tap_is_int(rc, 0, "F44: unscale");
    double gv = 0;
    fsdp_tensor_item(g, 0, &gv);
    tap_ok(gv == 2.0 / 65536.0, "F44 unscale: 2 / 2^16 (got %g)", gv);
    ck_err(ctx, fsdp_grad_scaler_unscale(s, opt),
           "unscale() has already been called on this optimizer since the last update()", NULL,
           "unscale twice");
    bool stepped = false;
    rc = fsdp_grad_scaler_step(s, opt, &stepped);
    tap_ok(rc == 0 && stepped, "F44: step after unscale steps");
    ck_err(ctx, fsdp_grad_scaler_step(s, opt, &stepped),
           "step() has already been called since the last update()", NULL, "step twice");
    tap_ok(!stepped, "F44: a refused step reports stepped false");
    ck_err(ctx, fsdp_grad_scaler_unscale(s, opt), "unscale() is being called after step()", NULL,
           "unscale after step");
    fsdp_grad_scaler_state_t st0, st1;
    fsdp_grad_scaler_state_dict(s, &st0);
    ck_err(ctx, fsdp_grad_scaler_update_to(s, 0.0), "new_scale", "0", "update_to(0)");
    ck_err(ctx, fsdp_grad_scaler_update_to(s, -2.0), "new_scale", "-2", "update_to(-2)");
    ck_err(ctx, fsdp_grad_scaler_update_to(s, INFINITY), "new_scale", "inf", "update_to(inf)");
    ck_err(ctx, fsdp_grad_scaler_update_to(s, 1e40), "new_scale", "1e+40",
           "update_to(1e40), inf in f32");
    rc = fsdp_grad_scaler_update_to(s, 1000.0);
    tap_ok(rc == 0 && fsdp_grad_scaler_get_scale(s) == 1000.0 && !fsdp_grad_scaler_found_inf(s),
           "F44 update_to(1000) sets the scale (tracker kept) and ends the iteration");
    fsdp_grad_scaler_state_dict(s, &st1);
    tap_ok(st1.growth_tracker == st0.growth_tracker, "F44 update_to keeps the tracker");
    rc = fsdp_grad_scaler_update_to(s, 0.1);
    tap_ok(rc == 0 && fsdp_grad_scaler_get_scale(s) == (double)0.1f,
           "F44 update_to(0.1): the scale is rounded to f32 (as PyTorch's f32 scale tensor)");

    /* load_state_dict validation: nothing changes on error. */
    fsdp_grad_scaler_state_dict(s, &st0);
    struct {
        const char *key, *value;
        fsdp_grad_scaler_state_t st;
    } bst[] = {
        {"scale", "-1", {-1.0, 2.0, 0.5, 10, 0}},
        {"growth_factor", "0.9", {4.0, 0.9, 0.5, 10, 0}},
        {"backoff_factor", "1.5", {4.0, 2.0, 1.5, 10, 0}},
        {"growth_interval", "0", {4.0, 2.0, 0.5, 0, 0}},
        {"growth_tracker", "10", {4.0, 2.0, 0.5, 10, 10}},
        {"growth_tracker", "-1", {4.0, 2.0, 0.5, 10, -1}},
    };
    for (size_t i = 0; i < sizeof bst / sizeof bst[0]; i++) {
        char name[120];
        snprintf(name, sizeof name, "load_state_dict with %s = %s names the key and the value",
                 bst[i].key, bst[i].value);
        ck_err(ctx, fsdp_grad_scaler_load_state_dict(s, &bst[i].st), bst[i].key, bst[i].value,
               name);
    }
    fsdp_grad_scaler_state_t empty;
    memset(&empty, 0, sizeof empty);
    ck_err(ctx, fsdp_grad_scaler_load_state_dict(s, &empty), "The source state dict is empty", NULL,
           "load_state_dict of an empty (all-zero) state");
    fsdp_grad_scaler_state_dict(s, &st1);
    tap_ok(memcmp(&st0, &st1, sizeof st0) == 0, "F44: failed loads changed nothing");

    /* The disabled scaler. */
    fsdp_grad_scaler_options_init(&o);
    o.enabled = false;
    rc = fsdp_grad_scaler_create(ctx, &o, &d);
    if (rc == 0) rc = fsdp_grad_scaler_scale(d, loss, &out);
    tap_ok(rc == 0 && out == loss, "F44 disabled: scale returns the loss itself (a new reference)");
    fsdp_tensor_release(out);
    out = NULL;
    double p0 = 0, p1 = 0;
    fsdp_tensor_fill_(g, 4.0);
    fsdp_tensor_item(p, 0, &p0);
    rc = fsdp_grad_scaler_unscale(d, opt);
    fsdp_tensor_item(g, 0, &gv);
    tap_ok(rc == 0 && gv == 4.0, "F44 disabled: unscale leaves the gradients alone");
    rc = fsdp_grad_scaler_step(d, opt, &stepped);
    fsdp_tensor_item(p, 0, &p1);
    tap_ok(rc == 0 && stepped && p1 == (double)((float)p0 - (float)(1e-3 * 4.0)),
           "F44 disabled: step just steps (p %g -> %g)", p0, p1);
    rc = fsdp_grad_scaler_step(d, opt, &stepped);
    tap_ok(rc == 0 && stepped, "F44 disabled: a second step is not refused (no state)");
    tap_ok(fsdp_grad_scaler_update(d) == 0 && fsdp_grad_scaler_update_to(d, -1.0) == 0 &&
               fsdp_grad_scaler_get_scale(d) == 1.0 && !fsdp_grad_scaler_found_inf(d),
           "F44 disabled: update and update_to do nothing, the scale is 1.0");
    fsdp_grad_scaler_state_dict(d, &st1);
    tap_ok(memcmp(&st1, &empty, sizeof empty) == 0 &&
               fsdp_grad_scaler_load_state_dict(d, &st0) == 0,
           "F44 disabled: the state is empty (all zero) and loading is a no-op");
    fsdp_grad_scaler_destroy(NULL);
    tap_ok(1, "F44: destroy(NULL) is fine");

    /* A context of world size 2 without a group cannot agree on the flag. */
    fsdp_ctx_options_t co;
    fsdp_ctx_options_init(&co);
    co.rank = 0;
    co.world_size = 2;
    co.log_level = FSDP_LOG_OFF; /* the error below is read from the context, not logged */
    fsdp_ctx_t *lone = NULL;
    rc = fsdp_ctx_create(&co, &lone);
    if (rc == 0) {
        fsdp_grad_scaler_t *x = NULL;
        ck_err(lone, fsdp_grad_scaler_create(lone, NULL, &x), "no process group", "world size is 2",
               "create at world size 2 without any group");
        fsdp_grad_scaler_destroy(x);
    } else {
        tap_ok(0, "F44 error: creating a lone context: %s", fsdp_err_name(rc));
    }
    fsdp_ctx_destroy(lone);
done:
    fsdp_tensor_release(out);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(p);
    fsdp_tensor_release(g);
    fsdp_optim_destroy(opt);
    fsdp_grad_scaler_destroy(s);
    fsdp_grad_scaler_destroy(d);
    return 0;
}

int main(void) {
    tap_plan_lazy();
    for (int w = 1; w <= 2; w++)
        fu_run("F44 f16/bf16/f64 gradients", w, FSDP_FULL_SHARD, false, dtype_rank);

    fsdp_sim_options_t so;
    fsdp_sim_options_init(&so);
    so.world_size = 1;
    int st = 0;
    int rc = fsdp_sim_run(&so, errors_rank, NULL, &st);
    tap_ok(rc == 0 && st == 0, "F44 errors: the run completed");
    return tap_done();
}
