/* SPDX-License-Identifier: MIT */
/*
 * t_mp_ema.c: MP-TE-01 (spec section 6, seed 003's test_train_ema_eval_flow): train -> EMA update
 * under summon_full_params -> eval, with MixedPrecision(param_dtype f16).
 *
 * The model (tm_ema_create, TransformerWithEMA reduced) has a main branch `module` and an EMA
 * branch `ema_module`; training runs the main branch, eval mode the EMA branch. Units, as the
 * seed's ModuleWrapPolicy({Transformer, EncoderLayer, DecoderLayer}) nests them: each branch's
 * first Linear, each branch, and the root (which then manages no parameter). Strategies
 * SHARD_GRAD_OP (the seed's main case: no reshard after forward), FULL_SHARD and NO_SHARD at
 * W=2 (the seed's) and W=4, each with and without use_orig_params; Adam (lr 1e-2) over the main
 * branch only, as the seed. Each of 3 iterations:
 *   1. train: forward on this rank's input, sum, backward, step, zero_grad;
 *   2. inside fsdp_summon_begin/end with writeback: EMA = d * EMA + (1 - d) * main (d = 0.75),
 *      written into the summoned full (f32) parameters;
 *   3. eval forward under no-grad on a fixed per-rank input (as the seed); a variant at W=2 runs
 *      it with grad on and never differentiates it, so that SHARD_GRAD_OP keeps the EMA units'
 *      f16 unsharded parameters into the next summon: upstream's stale-parameter case, made
 *      certain to arise (checked).
 * Checks, against a local reference on every rank that holds f32 masters and applies the casts
 * by hand (weights and inputs rounded to f16 for compute; every rank's f16 gradient reduced as
 * FSDP does: pre-divided in f16, summed in f32 in rank order, rounded to f16, post-divided,
 * widened; the same Adam; the same EMA formula):
 *   - the eval outputs are f16, change every iteration (and the first differs from the last),
 *     and equal the reference's computed with the expected EMA weights (fp16 tolerance:
 *     rtol 1e-3, atol 1e-5);
 *   - the weights the EMA branch's Linears actually compute with, read by forward pre-hooks on
 *     them at each eval, are f16 and are the expected EMA weights rounded to f16 (fp16
 *     tolerance): after the writeback every strategy re-gathers or re-casts instead of reusing a
 *     stale low-precision unsharded parameter; sharded strategies issue a new all-gather for each
 *     EMA unit at each eval;
 *   - after the last iteration this rank's shards of every parameter (main and EMA, f32) match
 *     the reference masters (fp16 tolerance), and the training losses match too; every unit is
 *     IDLE at the end (and, after a no-grad eval, resharded).
 *
 * Every rank records its checks and fu_run_job() prints one TAP line per check (fsdp_util.h).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "models/models.h"
#include "tap.h"

#define TE_D 16
#define TE_H 32
#define TE_ITERS 3
#define TE_DECAY 0.75f
#define TE_LR 1e-2
#define TE_ROWS 4

/* ---- helpers --------------------------------------------------------------------------------- */

/* PyTorch's gradient pre- and post-divide factors for a world of w ranks. */
static void divide_factors(int w, double *pre, double *post) {
    int f = 1;
    while (w % f == 0 && w / f > f)
        f *= 2;
    *pre = f;
    *post = (double)w / f;
}

static float round16(float x) {
    return fsdp_f16_to_f32(fsdp_f32_to_f16(x));
}

/* Replaces every parameter of m's tree with a leaf copy in dt that requires grad (made under
 * no-grad, so that the copies are leaves). */
static int params_to(fsdp_module_t *m, fsdp_dtype_t dt) {
    fsdp_named_list_t ps = {0};
    int rc = fsdp_module_named_params(m, false, &ps);
    bool was = fsdp_set_grad_enabled(fsdp_module_ctx(m), false);
    for (size_t i = 0; i < ps.n && rc == 0; i++) {
        fsdp_tensor_t *h = NULL;
        rc = fsdp_to_dtype(ps.tensors[i], dt, &h);
        if (rc == 0) rc = fsdp_tensor_set_requires_grad(h, true);
        if (rc == 0) rc = fsdp_module_set_param(m, ps.names[i], h, false);
        fsdp_tensor_release(h);
    }
    fsdp_set_grad_enabled(fsdp_module_ctx(m), was);
    fsdp_named_list_free(&ps);
    return rc;
}

/* Copies (casting) every parameter of src's tree into dst's (same structure). */
static int copy_params(fsdp_module_t *dst, const fsdp_module_t *src) {
    fsdp_named_list_t a = {0}, b = {0};
    int rc = fsdp_module_named_params(dst, false, &a);
    if (rc == 0) rc = fsdp_module_named_params(src, false, &b);
    if (rc == 0 && a.n != b.n) rc = FSDP_EINTERNAL;
    for (size_t i = 0; i < a.n && rc == 0; i++)
        rc = fsdp_tensor_copy_(a.tensors[i], b.tensors[i]);
    fsdp_named_list_free(&a);
    fsdp_named_list_free(&b);
    return rc;
}

/* The EMA update on every parameter pair of the two branches of m (full f32 tensors: the
 * summoned ones, or the reference's): e = d * e + (1 - d) * p, computed on the host in float,
 * the same code for FSDP and the reference. */
static int ema_update(fsdp_module_t *m) {
    fsdp_named_list_t p = {0}, e = {0};
    int rc = fsdp_module_named_params(fsdp_module_child(m, "module"), false, &p);
    if (rc == 0) rc = fsdp_module_named_params(fsdp_module_child(m, "ema_module"), false, &e);
    if (rc == 0 && p.n != e.n) rc = FSDP_EINTERNAL;
    for (size_t i = 0; i < p.n && rc == 0; i++) {
        int64_t np = 0, ne = 0;
        float *pv = fu_host_f32(p.tensors[i], &np), *ev = fu_host_f32(e.tensors[i], &ne);
        if (!pv || !ev || np != ne || fsdp_tensor_dtype(e.tensors[i]) != FSDP_DTYPE_F32) {
            rc = FSDP_EINVAL; /* the summoned parameters must be full and full precision */
        } else {
            for (int64_t k = 0; k < ne; k++)
                ev[k] = TE_DECAY * ev[k] + (1.0f - TE_DECAY) * pv[k];
            rc = fsdp_tensor_copy_from_host(e.tensors[i], ev, (size_t)ne * sizeof *ev);
        }
        free(pv);
        free(ev);
    }
    fsdp_named_list_free(&p);
    fsdp_named_list_free(&e);
    return rc;
}

/* A forward pre-hook on one of the EMA branch's Linears (added after wrapping, so it runs while
 * the unit's compute parameters are in the module's slots): compares the weight and bias the
 * Linear computes with against the expected EMA values (the reference master's) rounded to
 * f16. */
typedef struct lin_probe {
    const fsdp_module_t *expect; /* the reference master Linear */
    int calls;
    bool f16;     /* every time, both were f16 */
    double worst; /* worst fp16 closeness to the expected values over the calls */
} lin_probe_t;

static int probe_linear(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t **in) {
    (void)nin;
    (void)in;
    lin_probe_t *p = arg;
    static const char *const names[2] = {"weight", "bias"};
    p->calls++;
    for (int i = 0; i < 2; i++) {
        fsdp_tensor_t *t = fsdp_module_param(m, names[i]);
        fsdp_tensor_t *e = fsdp_module_param(p->expect, names[i]);
        int64_t nt = 0, ne = 0;
        float *tv = t ? fu_host_f32(t, &nt) : NULL, *ev = e ? fu_host_f32(e, &ne) : NULL;
        if (!t || fsdp_tensor_dtype(t) != FSDP_DTYPE_F16) p->f16 = false;
        if (!tv || !ev || nt != ne) {
            p->worst = INFINITY;
        } else {
            for (int64_t k = 0; k < nt; k++) {
                double c = fu_closeness(tv[k], round16(ev[k]), FU_F16_RTOL, FU_F16_ATOL);
                if (isnan(c) || c > p->worst) p->worst = isnan(c) ? INFINITY : c;
            }
        }
        free(tv);
        free(ev);
    }
    return 0;
}

/* ---- the reference --------------------------------------------------------------------------- */

/* One reference training step: for every rank q, the main branch's f16 compute copy run on q's
 * input (cast to f16 by hand), its f16 gradients reduced as FSDP's f16 reduction does, into the
 * masters' .grad; then Adam. *loss_v receives this rank's loss. */
static int ref_train(fsdp_ctx_t *ctx, int world, int it, fsdp_module_t *master, fsdp_module_t *comp,
                     fsdp_optim_t *opt, double *loss_v) {
    fsdp_module_t *mm = fsdp_module_child(master, "module"),
                  *cm = fsdp_module_child(comp, "module");
    fsdp_named_list_t mp = {0}, cp = {0};
    fsdp_tensor_t *x = NULL, *xh = NULL, *y = NULL, *loss = NULL;
    float **acc = NULL;
    double pre, post;
    divide_factors(world, &pre, &post);
    int rc = copy_params(cm, mm);
    if (rc == 0) rc = fsdp_module_named_params(mm, false, &mp);
    if (rc == 0) rc = fsdp_module_named_params(cm, false, &cp);
    if (rc == 0 && (acc = calloc(mp.n, sizeof *acc)) == NULL) rc = FSDP_ENOMEM;
    for (int q = 0; q < world && rc == 0; q++) {
        for (size_t i = 0; i < cp.n && rc == 0; i++)
            rc = fsdp_tensor_zero_grad(cp.tensors[i], true);
        if (rc == 0)
            rc = fu_rand_input(ctx, 100 + 10 * (uint64_t)it + (uint64_t)q, TE_ROWS, TE_D, &x);
        if (rc == 0) rc = fsdp_to_dtype(x, FSDP_DTYPE_F16, &xh);
        if (rc == 0) rc = fsdp_module_forward1(cm, xh, &y);
        if (rc == 0) rc = tm_sum_loss(y, &loss);
        if (rc == 0 && q == fsdp_ctx_rank(ctx)) rc = fsdp_tensor_item(loss, 0, loss_v);
        if (rc == 0) rc = fsdp_backward(loss, NULL);
        for (size_t i = 0; i < cp.n && rc == 0; i++) {
            int64_t n = 0;
            float *g = fu_host_f32(fsdp_tensor_grad(cp.tensors[i]), &n);
            if (!g) {
                rc = FSDP_EINTERNAL;
                break;
            }
            if (!acc[i]) {
                acc[i] = g;
                for (int64_t k = 0; k < n; k++)
                    acc[i][k] = round16(g[k] / (float)pre);
            } else {
                for (int64_t k = 0; k < n; k++)
                    acc[i][k] += round16(g[k] / (float)pre);
                free(g);
            }
        }
        fsdp_tensor_release(x);
        fsdp_tensor_release(xh);
        fsdp_tensor_release(y);
        fsdp_tensor_release(loss);
        x = xh = y = loss = NULL;
    }
    for (size_t i = 0; i < mp.n && rc == 0; i++) {
        fsdp_tensor_t *g = NULL;
        int64_t n = fsdp_tensor_numel(mp.tensors[i]);
        for (int64_t k = 0; k < n; k++)
            acc[i][k] = round16(round16(acc[i][k]) / (float)post);
        rc = fsdp_tensor_from_host(ctx, FSDP_DTYPE_F32, fsdp_tensor_ndim(mp.tensors[i]),
                                   fsdp_tensor_shape(mp.tensors[i]), acc[i], FSDP_MEM_GRADS, &g);
        if (rc == 0) rc = fsdp_tensor_set_grad(mp.tensors[i], g);
        fsdp_tensor_release(g);
    }
    if (rc == 0) rc = fsdp_optim_step(opt);
    for (size_t i = 0; acc && i < mp.n; i++)
        free(acc[i]);
    free(acc);
    fsdp_tensor_release(x);
    fsdp_tensor_release(xh);
    fsdp_tensor_release(y);
    fsdp_tensor_release(loss);
    fsdp_named_list_free(&mp);
    fsdp_named_list_free(&cp);
    return rc;
}

/* The reference eval: the EMA branch's masters cast to f16, run on the input cast to f16. */
static int ref_eval(fsdp_ctx_t *ctx, fsdp_module_t *master, fsdp_module_t *comp, fsdp_tensor_t *x,
                    fsdp_tensor_t **out) {
    fsdp_tensor_t *xh = NULL;
    bool was = fsdp_set_grad_enabled(ctx, false);
    int rc =
        copy_params(fsdp_module_child(comp, "ema_module"), fsdp_module_child(master, "ema_module"));
    if (rc == 0) rc = fsdp_to_dtype(x, FSDP_DTYPE_F16, &xh);
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(comp, "ema_module"), xh, out);
    fsdp_set_grad_enabled(ctx, was);
    fsdp_tensor_release(xh);
    return rc;
}

/* An Adam optimizer (lr TE_LR, PyTorch's other defaults) over the entries of l whose names
 * start with "module." (the main branch; the seed optimizes fsdp_model.module.parameters()). */
static int make_adam(fsdp_ctx_t *ctx, const fsdp_named_list_t *l, fsdp_optim_t **opt) {
    fsdp_adam_options_t ao;
    fsdp_adam_options_init(&ao);
    ao.lr = TE_LR;
    fsdp_tensor_t **ts = calloc(l->n + 1, sizeof *ts);
    const char **names = calloc(l->n + 1, sizeof *names);
    size_t n = 0;
    int rc = ts && names ? fsdp_optim_adam_create(ctx, &ao, false, opt) : FSDP_ENOMEM;
    for (size_t i = 0; i < l->n && rc == 0; i++)
        if (strncmp(l->names[i], "module.", 7) == 0) {
            ts[n] = l->tensors[i];
            names[n++] = l->names[i];
        }
    if (rc == 0) rc = n > 0 ? fsdp_optim_add_group(*opt, n, ts, names, NULL, NULL) : FSDP_EINTERNAL;
    free(ts);
    free(names);
    return rc;
}

/* ---- the test -------------------------------------------------------------------------------- */

static const char *const te_units[] = {"module.0", "module", "ema_module.0", "ema_module", NULL};

typedef struct te_job {
    fu_job_t j;     /* first */
    bool eval_grad; /* eval forward with grad enabled (no backward) instead of under no-grad */
} te_job_t;

static int te_rank(fsdp_ctx_t *ctx, void *arg) {
    te_job_t *tj = arg;
    fu_job_t *j = &tj->j;
    fu_res_t *r = fu_res_of(j, ctx);
    const int rank = fsdp_ctx_rank(ctx);
    fsdp_module_t *m = NULL, *master = NULL, *comp = NULL;
    fsdp_unit_t *root = NULL, *ema_u[2] = {NULL, NULL};
    fsdp_optim_t *opt = NULL, *ref_opt = NULL;
    fsdp_named_list_t params = {0}, mparams = {0};
    fsdp_tensor_t *x = NULL, *y = NULL, *loss = NULL, *ex = NULL, *ey = NULL, *ry = NULL;
    lin_probe_t probe[2];
    double sums[TE_ITERS] = {0};
    char name[200], why[760];
    fsdp_options_t o;
    fu_job_options(j, &o);
    int rc;
    /* Eval runs the other branch, so FSDP warns (each eval) that the forward order changed since
     * the first iteration, as upstream's execution-order check does; checked below, not shown. */
    fsdp_ctx_set_log_level(ctx, FSDP_LOG_ERROR);
    FU_TRY(done, "building", tm_ema_create(ctx, TE_D, TE_H, &m));
    FU_TRY(done, "building the reference", tm_ema_create(ctx, TE_D, TE_H, &master));
    FU_TRY(done, "building the reference", tm_ema_create(ctx, TE_D, TE_H, &comp));
    FU_TRY(done, "building the reference", params_to(comp, FSDP_DTYPE_F16));
    FU_TRY(done, "wrapping", fu_wrap_listed(m, te_units, &o, NULL, NULL));
    FU_TRY(done, "wrapping", fsdp_wrap(m, &o, &root));
    ema_u[0] = fsdp_unit_of(fsdp_module_child(m, "ema_module.0"));
    ema_u[1] = fsdp_unit_of(fsdp_module_child(m, "ema_module"));
    if (!fu_ck(r, ema_u[0] && ema_u[1] && !fsdp_unit_flat_param(root),
               "5 units; the root manages no parameter", "EMA units %p %p, root flat %p",
               (void *)ema_u[0], (void *)ema_u[1], (void *)fsdp_unit_flat_param(root)))
        goto done;
    static const char *const lin[2] = {"ema_module.0", "ema_module.2"};
    for (int i = 0; i < 2; i++) {
        int h;
        probe[i] = (lin_probe_t){fsdp_module_child(master, lin[i]), 0, true, 0};
        FU_TRY(done, "hooks",
               fsdp_module_add_forward_pre_hook(fsdp_module_child(m, lin[i]), probe_linear,
                                                &probe[i], &h));
    }
    FU_TRY(done, "optimizers", fsdp_named_params(root, &params));
    FU_TRY(done, "optimizers", make_adam(ctx, &params, &opt));
    FU_TRY(done, "optimizers", fsdp_module_named_params(master, true, &mparams));
    FU_TRY(done, "optimizers", make_adam(ctx, &mparams, &ref_opt));
    /* The seed draws its eval inputs once, after torch.manual_seed(1 + rank). */
    FU_TRY(done, "eval input", fu_rand_input(ctx, 1 + (uint64_t)rank, 3, TE_D, &ex));

    bool loss_ok = true, out_ok = true, dt_ok = true, regather = true, fresh = true;
    char lwhy[300] = "", owhy[300] = "", gwhy[300] = "", fwhy[300] = "";
    const bool sharded = fsdp_unit_strategy(ema_u[0]) != FSDP_NO_SHARD;
    const bool sgo = fsdp_unit_strategy(ema_u[0]) == FSDP_SHARD_GRAD_OP;
    bool kept = true;
    for (int it = 0; it < TE_ITERS; it++) {
        double lv = 0, rv = 0;
        /* 1. train */
        fsdp_module_train(m, true);
        FU_TRY(done, "train step",
               fu_rand_input(ctx, 100 + 10 * (uint64_t)it + (uint64_t)rank, TE_ROWS, TE_D, &x));
        FU_TRY(done, "train step", fsdp_module_forward1(m, x, &y));
        FU_TRY(done, "train step", tm_sum_loss(y, &loss));
        FU_TRY(done, "train step", fsdp_tensor_item(loss, 0, &lv));
        FU_TRY(done, "train step", fsdp_backward(loss, NULL));
        FU_TRY(done, "train step", fsdp_optim_step(opt));
        FU_TRY(done, "train step", fsdp_optim_zero_grad(opt, true));
        FU_TRY(done, "reference train step",
               ref_train(ctx, j->world, it, master, comp, ref_opt, &rv));
        double cl = fu_closeness(lv, rv, FU_F16_RTOL, FU_F16_ATOL);
        if (!(cl <= 1.0) && loss_ok) {
            loss_ok = false;
            snprintf(lwhy, sizeof lwhy, "iteration %d: loss %.9g, reference %.9g", it, lv, rv);
        }
        fsdp_tensor_release(x);
        fsdp_tensor_release(y);
        fsdp_tensor_release(loss);
        x = y = loss = NULL;
        /* 2. the EMA update under summon_full_params (writeback on) */
        FU_TRY(done, "summon", fsdp_summon_begin(root, NULL));
        rc = ema_update(m);
        int rc2 = fsdp_summon_end(root);
        FU_TRY(done, "EMA update inside the summon", rc);
        FU_TRY(done, "ending the summon (writeback)", rc2);
        FU_TRY(done, "reference EMA update", ema_update(master));
        /* 3. eval under no-grad */
        fsdp_unit_stats_t s0[2], s1[2];
        for (int i = 0; i < 2; i++)
            fsdp_unit_get_stats(ema_u[i], &s0[i]);
        int calls0[2] = {probe[0].calls, probe[1].calls};
        fsdp_module_train(m, false);
        bool was = fsdp_set_grad_enabled(ctx, tj->eval_grad);
        rc = fsdp_module_forward1(m, ex, &ey);
        fsdp_set_grad_enabled(ctx, was);
        FU_TRY(done, "eval forward", rc);
        for (int i = 0; i < 2; i++) {
            fsdp_unit_get_stats(ema_u[i], &s1[i]);
            /* With grad on nothing reshards a SHARD_GRAD_OP unit after its forward: it keeps its
             * f16 unsharded parameters into the next summon (upstream's stale-parameter case). */
            if (tj->eval_grad && sgo && !fsdp_unit_is_unsharded(ema_u[i])) kept = false;
        }
        FU_TRY(done, "reference eval", ref_eval(ctx, master, comp, ex, &ry));
        {
            int64_t n = 0;
            float *v = fu_host_f32(ey, &n);
            sums[it] = 0;
            for (int64_t k = 0; v && k < n; k++)
                sums[it] += v[k];
            free(v);
        }
        if (fsdp_tensor_dtype(ey) != FSDP_DTYPE_F16) dt_ok = false;
        cl = fu_tensor_closeness(ey, ry, FU_F16_RTOL, FU_F16_ATOL);
        if (!(cl >= 0 && cl <= 1.0) && out_ok) {
            out_ok = false;
            snprintf(owhy, sizeof owhy, "iteration %d: worst element %.3g of fp16 tolerance", it,
                     cl);
        }
        for (int i = 0; i < 2; i++) {
            uint64_t ag = s1[i].all_gathers - s0[i].all_gathers;
            if (sharded && ag < 1 && regather) {
                regather = false;
                snprintf(gwhy, sizeof gwhy, "iteration %d: EMA unit '%s' issued no all-gather", it,
                         fsdp_unit_fqn(ema_u[i]));
            }
            if ((probe[i].calls != calls0[i] + 1 || !probe[i].f16 || !(probe[i].worst <= 1.0)) &&
                fresh) {
                fresh = false;
                snprintf(fwhy, sizeof fwhy,
                         "iteration %d: '%s' ran %d times, f16 %d, its weights are %.3g of fp16 "
                         "tolerance from the expected EMA",
                         it, lin[i], probe[i].calls - calls0[i], probe[i].f16, probe[i].worst);
            }
        }
        fsdp_tensor_release(ey);
        fsdp_tensor_release(ry);
        ey = ry = NULL;
        fsdp_tape_clear(ctx); /* the eval_grad variant's graph, never differentiated */
    }
    fu_ck(r, loss_ok,
          "MP-TE-01: every training loss matches the hand-cast reference (fp16 tolerance)", "%s",
          lwhy);
    fu_ck(r, dt_ok, "MP-TE-01: every eval output is f16 (param_dtype)", "an output is not");
    bool changes = true;
    for (int it = 0; it + 1 < TE_ITERS; it++)
        changes &= sums[it] != sums[it + 1];
    changes &= sums[0] != sums[TE_ITERS - 1];
    fu_ck(r, changes,
          "MP-TE-01: the eval output sum changes every iteration, and the first differs from the "
          "last",
          "sums %.9g %.9g %.9g", sums[0], sums[1], sums[2]);
    fu_ck(r, out_ok,
          "MP-TE-01: every eval output equals the reference computed with the expected EMA "
          "weights (fp16 tolerance)",
          "%s", owhy);
    snprintf(name, sizeof name,
             "MP-TE-01: at each eval after the summon's writeback, the EMA branch computes with "
             "f16 weights equal to the fresh EMA values (re-%s, not a stale unsharded copy)",
             sharded ? "gathered and re-cast" : "cast");
    fu_ck(r, fresh, name, "%s", fwhy);
    if (sharded)
        fu_ck(r, regather, "MP-TE-01: each eval issues a new all-gather for each EMA unit", "%s",
              gwhy);
    double cl = fu_shards_vs(root, NULL, false, fu_ref_param, master, FU_F16_RTOL, FU_F16_ATOL, why,
                             sizeof why);
    fu_ck(r, cl <= 1.0,
          "MP-TE-01: after 3 iterations this rank's shards of every parameter, main and EMA (f32), "
          "match the reference masters (fp16 tolerance)",
          "worst %.3g of tolerance: %s", cl, why);
    char warn[1100];
    uint64_t nw = fsdp_ctx_warnings(ctx, warn, sizeof warn);
    fu_ck(r, nw >= 1 && strstr(warn, "forward order changed"),
          "MP-TE-01: FSDP warns that the forward order changed (eval runs the EMA branch)",
          "%llu warnings, the last \"%s\"", (unsigned long long)nw, warn);
    if (tj->eval_grad && sgo)
        fu_ck(r, kept,
              "MP-TE-01 (eval with grad on): the EMA units stay unsharded after each eval forward, "
              "so the next summon and eval meet their f16 unsharded parameters",
              "an EMA unit was resharded");
    if (tj->eval_grad) {
        bool idle = true;
        fsdp_unit_t **u = NULL;
        size_t nu = 0;
        if (fsdp_units(root, &u, &nu) < 0) idle = false;
        for (size_t i = 0; i < nu; i++)
            idle &= fsdp_unit_state(u[i]) == FSDP_STATE_IDLE;
        free(u);
        fu_ck(r, idle, "MP-TE-01: every unit IDLE at the end", "a unit is not");
    } else {
        fu_ck(r, fu_tree_idle(root), "MP-TE-01: every unit IDLE and resharded at the end",
              "a unit is not");
    }
done:
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(ex);
    fsdp_tensor_release(ey);
    fsdp_tensor_release(ry);
    fsdp_named_list_free(&params);
    fsdp_named_list_free(&mparams);
    fsdp_optim_destroy(ref_opt);
    fu_teardown(ctx, m, root, NULL, opt);
    fsdp_module_release(master);
    fsdp_module_release(comp);
    return rc;
}

int main(void) {
    tap_plan_lazy();
    /* The seed's order: SHARD_GRAD_OP first (the strategy that exposed upstream's bug). */
    static const fsdp_sharding_strategy_t strategies[3] = {FSDP_SHARD_GRAD_OP, FSDP_FULL_SHARD,
                                                           FSDP_NO_SHARD};
    for (int s = 0; s < 3; s++)
        for (int orig = 0; orig < 2; orig++) {
            char prefix[160];
            snprintf(prefix, sizeof prefix,
                     "MP-TE-01 train/EMA/eval param f16 %s use_orig_params=%d",
                     fsdp_sharding_strategy_name(strategies[s]), orig);
            for (int eg = 0; eg < 3; eg++) {
                te_job_t *tj = calloc(1, sizeof *tj);
                if (!tj) tap_bail("out of memory");
                char p2[200];
                snprintf(p2, sizeof p2, "%s%s", prefix, eg == 1 ? " eval with grad on" : "");
                /* The seed's world size 2 (no-grad eval, and the grad-on variant); 4 as well. */
                fu_job_init(&tj->j, p2, eg == 2 ? 4 : 2, strategies[s], orig);
                tj->j.mp.enabled = true;
                tj->j.mp.param_dtype = FSDP_DTYPE_F16;
                tj->eval_grad = eg == 1;
                fu_run_job(&tj->j, te_rank);
                free(tj);
            }
        }
    return tap_done();
}
