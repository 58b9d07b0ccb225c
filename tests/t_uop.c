/* SPDX-License-Identifier: MIT */
/*
 * t_uop.c: use_orig_params in full (seed 001, test_fsdp_use_orig_params.py; spec F06, F20,
 * F21, F25, F28..F34). Every FSDP model is compared with DDP over the same sim group (or, for
 * UOP-UR, with a twin wrapped without use_orig_params), parameters as well as losses, within
 * assert_close's fp32 tolerances (rtol 1.3e-6, atol 1e-5):
 *   UOP-MPG-02  Sequential(3 x Linear(5, 5)), units "0" and "2" and the root (holding "1"),
 *               AdamW with PyTorch's three groups (weights: lr 1e-2, weight decay 0.1; biases:
 *               lr 1e-3, weight decay 0.01; the rest: the defaults, lr 5e-3) over the original
 *               parameters, made before or after wrapping; 10 steps with zero_grad before the
 *               forward on even steps and between forward and backward on odd ones,
 *               set_to_none both ways, and with FSDP_SKIP_WRITEBACK_CHECK=1; every strategy.
 *   UOP-MPG-03  the same with CPU offload and Adam (optimizer after wrapping, set_to_none off).
 *   UOP-MPG-04  every bias frozen after wrapping (DDP's before it is made): trained in parity,
 *               the frozen parameters bitwise unchanged on both sides.
 *   UOP-IN-01   Sequential(2 x Linear(3, 3)) with both biases frozen before wrapping into one
 *               flat parameter: wrapping accepts it, the flags are reported per parameter, and
 *               it trains in parity with the biases bitwise unchanged.
 *   UOP-MPG-05  two optimizers over disjoint parameters (Adam lr 5e-3 over the weights, AdamW
 *               lr 1e-2 over the biases) of one flat parameter whose every rank's shard holds a
 *               weight and a bias; after a step only the weight optimizer's gradients are set
 *               to none, then a forward: (FULL_SHARD) the weight gradients are none, the bias
 *               gradients still the reduced ones, parameters with no local elements have none;
 *               the backward and two more steps stay in parity.
 *   UOP-UR-01   two forwards (x, then x + 1) before one backward of the sum of both outputs;
 *   UOP-UR-02   the same with a summon of both twins between the two forwards, whose parameters
 *               agree there: outputs, losses and final parameters equal the twin's.
 *   UOP-PA-01, UOP-FQ-01, UOP-WB-01..04 and UOP-MT-01 (views, names, writeback, empty ranks)
 *               are in t_uop_access.c.
 * UOP-MPG-01 (torch.compile) has no C analog: compilation does not exist here, and the property
 * behind it (two instances trained in lockstep agree bitwise) is what UOP-UR checks.
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
#include "uop_util.h"

enum { K_MPG02, K_MPG03, K_MPG04, K_IN01 };

/* ---- small pieces ------------------------------------------------------------------------- */

/* One model's forward and backward of sum(model(x)) (through DDP when d is given): zero_grad
 * on opt (may be NULL) before the forward (zero_between false) or between forward and
 * backward. Both models of a comparison run one after the other: a backward frees the tape. */
static int fwd_bwd(fsdp_module_t *m, fsdp_ddp_t *d, fsdp_tensor_t *x, fsdp_optim_t *opt,
                   bool set_to_none, bool zero_between, double *loss_value) {
    fsdp_tensor_t *loss = NULL;
    int rc = opt && !zero_between ? fsdp_optim_zero_grad(opt, set_to_none) : 0;
    if (rc == 0) rc = fwd_loss(m, d, x, NULL, &loss);
    if (rc == 0 && opt && zero_between) rc = fsdp_optim_zero_grad(opt, set_to_none);
    if (rc == 0) rc = fsdp_backward(loss, NULL);
    if (loss_value) *loss_value = item(loss);
    fsdp_tensor_release(loss);
    return rc;
}

/* Sequential(n x Linear(d, d)) and a DDP reference replica of it over the world group. */
static int ref_ddp(fsdp_ctx_t *ctx, int n, int64_t d, bool freeze_bias, fsdp_module_t **ref,
                   fsdp_ddp_t **ddp) {
    int rc = fu_linear_stack(ctx, n, d, ref);
    for (int i = 0; i < n && rc == 0 && freeze_bias; i++) {
        char name[32];
        snprintf(name, sizeof name, "%d.bias", i);
        rc = fsdp_tensor_set_requires_grad(fsdp_module_param(*ref, name), false);
    }
    if (rc == 0) rc = fsdp_ddp_create(*ref, NULL, NULL, ddp);
    return rc;
}

/* PyTorch's _get_param_groups over l: weights (weight decay 0.1, lr 1e-2), biases (0.01,
 * 1e-3), the rest (the defaults: lr 5e-3); Adam or AdamW. */
static int grouped_optim(fsdp_ctx_t *ctx, const fsdp_named_list_t *l, bool adamw,
                         fsdp_optim_t **out) {
    fsdp_adam_options_t d, g;
    if (adamw)
        fsdp_adamw_options_init(&d);
    else
        fsdp_adam_options_init(&d);
    d.lr = 5e-3;
    fsdp_tensor_t **p = calloc(l->n + 1, sizeof *p);
    const char **nm = calloc(l->n + 1, sizeof *nm);
    int rc = p && nm ? fsdp_optim_adam_create(ctx, &d, adamw, out) : FSDP_ENOMEM;
    for (int k = 0; k < 3 && rc == 0; k++) {
        size_t n = 0;
        for (size_t i = 0; i < l->n; i++) {
            bool w = strstr(l->names[i], "weight") != NULL;
            bool b = !w && strstr(l->names[i], "bias") != NULL;
            if ((k == 0 && w) || (k == 1 && b) || (k == 2 && !w && !b)) {
                nm[n] = l->names[i];
                p[n++] = l->tensors[i];
            }
        }
        g = d;
        if (k == 0) g.weight_decay = 0.1, g.lr = 1e-2;
        if (k == 1) g.weight_decay = 0.01, g.lr = 1e-3;
        rc = fsdp_optim_add_group(*out, n, p, nm, &g, NULL);
    }
    free(p);
    free(nm);
    return rc;
}

/* Adam (lr) or AdamW (lr) over the parameters of l whose name contains `part`. */
static int part_optim(fsdp_ctx_t *ctx, const fsdp_named_list_t *l, const char *part, bool adamw,
                      double lr, fsdp_optim_t **out) {
    fsdp_adam_options_t d;
    if (adamw)
        fsdp_adamw_options_init(&d);
    else
        fsdp_adam_options_init(&d);
    d.lr = lr;
    fsdp_tensor_t **p = calloc(l->n + 1, sizeof *p);
    const char **nm = calloc(l->n + 1, sizeof *nm);
    size_t n = 0;
    for (size_t i = 0; p && nm && i < l->n; i++)
        if (strstr(l->names[i], part)) {
            nm[n] = l->names[i];
            p[n++] = l->tensors[i];
        }
    int rc = p && nm ? fsdp_optim_adam_create(ctx, &d, adamw, out) : FSDP_ENOMEM;
    if (rc == 0) rc = fsdp_optim_add_group(*out, n, p, nm, NULL, NULL);
    free(p);
    free(nm);
    return rc;
}

/* The values of the tensors of l whose name contains part, concatenated (host copies). */
static int snapshot(const fsdp_named_list_t *l, const char *part, fu_vals_t *out) {
    fsdp_named_list_t sub = {0};
    size_t cap = l->n;
    sub.names = calloc(cap + 1, sizeof *sub.names);
    sub.tensors = calloc(cap + 1, sizeof *sub.tensors);
    int rc = sub.names && sub.tensors ? 0 : FSDP_ENOMEM;
    for (size_t i = 0; i < l->n && rc == 0; i++)
        if (strstr(l->names[i], part)) {
            sub.names[sub.n] = l->names[i];
            sub.tensors[sub.n++] = l->tensors[i];
        }
    if (rc == 0) rc = fu_list_values(&sub, false, out);
    free(sub.names);
    free(sub.tensors);
    return rc;
}

static bool same_vals(const fu_vals_t *a, const fu_vals_t *b) {
    return a->n == b->n && (a->n == 0 || memcmp(a->v, b->v, a->n * sizeof *a->v) == 0);
}

/* ---- UOP-MPG-02/03/04, UOP-IN-01: training parity against DDP ------------------------------- */

static int parity_rank(fsdp_ctx_t *ctx, void *arg) {
    uop_job_t *uj = arg;
    fu_res_t *r = fu_res_of(&uj->j, ctx);
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_ddp_t *ddp = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_optim_t *opt = NULL, *ref_opt = NULL;
    fsdp_named_list_t fl = {0}, rl = {0};
    fsdp_tensor_t *x = NULL;
    fu_vals_t frozen0 = {0}, frozen1 = {0}, rfrozen0 = {0}, rfrozen1 = {0};
    int rc, rank = fsdp_ctx_rank(ctx);
    bool in01 = uj->kind == K_IN01, freeze = in01 || uj->kind == K_MPG04;
    int nl = in01 ? 2 : 3;
    int64_t d = in01 ? 3 : 5;
    FU_TRY(done, "building the models", fu_linear_stack(ctx, nl, d, &m));
    FU_TRY(done, "building DDP", ref_ddp(ctx, nl, d, freeze, &ref, &ddp));
    FU_TRY(done, "reference optimizer", fsdp_module_named_params(ref, false, &rl));
    FU_TRY(done, "reference optimizer", grouped_optim(ctx, &rl, uj->kind == K_MPG02, &ref_opt));
    if (in01)
        for (int i = 0; i < nl; i++) {
            char name[32];
            snprintf(name, sizeof name, "%d.bias", i);
            FU_TRY(done, "freezing", fsdp_tensor_set_requires_grad(fsdp_module_param(m, name), 0));
        }
    if (uj->optim_before_wrap) {
        FU_TRY(done, "optimizer", fsdp_module_named_params(m, false, &fl));
        FU_TRY(done, "optimizer", grouped_optim(ctx, &fl, uj->kind == K_MPG02, &opt));
    }
    fsdp_options_t o;
    fu_job_options(&uj->j, &o);
    if (in01) {
        FU_TRY(done, "UOP-IN-01: wrapping mixed requires_grad into one flat parameter",
               fsdp_wrap(m, &o, &root));
        bool flags = fsdp_unit_num_params(root) == 4;
        for (size_t i = 0; flags && i < 4; i++) {
            fsdp_param_info_t pi;
            flags = fsdp_unit_param_info(root, i, &pi) == 0 &&
                    fsdp_tensor_requires_grad(pi.param) == (strstr(pi.fqn, "weight") != NULL);
        }
        fu_ck(r, flags,
              "UOP-IN-01: one flat parameter; weights require grad, biases do not, after wrapping",
              "%zu parameters, or a flag is wrong", fsdp_unit_num_params(root));
    } else {
        static const char *const units[] = {"0", "2", NULL};
        FU_TRY(done, "wrapping", fu_wrap_listed(m, units, &o, NULL, NULL));
        FU_TRY(done, "wrapping", fsdp_wrap(m, &o, &root));
    }
    if (!uj->optim_before_wrap) {
        FU_TRY(done, "optimizer", fsdp_named_params(root, &fl));
        FU_TRY(done, "optimizer", grouped_optim(ctx, &fl, uj->kind == K_MPG02, &opt));
    } else {
        fsdp_named_list_free(&fl);
        FU_TRY(done, "optimizer", fsdp_named_params(root, &fl));
    }
    if (uj->kind == K_MPG04)
        for (size_t i = 0; i < fl.n; i++)
            if (strstr(fl.names[i], "bias"))
                FU_TRY(done, "freezing after wrapping",
                       fsdp_tensor_set_requires_grad(fl.tensors[i], false));
    if (freeze) {
        FU_TRY(done, "snapshot", snapshot(&fl, "bias", &frozen0));
        FU_TRY(done, "snapshot", snapshot(&rl, "bias", &rfrozen0));
    }
    double worst = 0;
    char why[400] = "";
    for (int it = 0; it < ITERS; it++) {
        FU_TRY(done, "input",
               fu_rand_input(ctx, 1000 + 17 * (uint64_t)rank + (uint64_t)it, 4, d, &x));
        double vf = NAN, vd = NAN;
        FU_TRY(done, "FSDP iteration", fwd_bwd(m, NULL, x, opt, uj->set_to_none, it % 2 == 1, &vf));
        FU_TRY(done, "DDP iteration",
               fwd_bwd(ref, ddp, x, ref_opt, uj->set_to_none, it % 2 == 1, &vd));
        FU_TRY(done, "FSDP step", fsdp_optim_step(opt));
        FU_TRY(done, "DDP step", fsdp_optim_step(ref_opt));
        double c = fu_closeness(vf, vd, RTOL, ATOL);
        if (!(c <= worst)) {
            worst = isnan(c) ? INFINITY : c;
            snprintf(why, sizeof why, "iteration %d: loss %.9g, DDP %.9g", it, vf, vd);
        }
        fsdp_tensor_release(x);
        x = NULL;
    }
    fu_ck(r, worst <= 1.0, "losses equal DDP's in every iteration", "closeness %.3g, %s", worst,
          why);
    ck_params(r, root, m, ref, "after 10 steps");
    if (freeze) {
        FU_TRY(done, "snapshot", snapshot(&fl, "bias", &frozen1));
        FU_TRY(done, "snapshot", snapshot(&rl, "bias", &rfrozen1));
        fu_ck(r, frozen0.n > 0 || rank != fsdp_ctx_world_size(ctx) - 1,
              "frozen biases: the last rank's shard holds some of them", "none");
        fu_ck(r, same_vals(&frozen0, &frozen1) && same_vals(&rfrozen0, &rfrozen1),
              "frozen biases are bitwise unchanged (FSDP's shard views and DDP's)",
              "FSDP %zu/%zu values, DDP %zu/%zu", frozen0.n, frozen1.n, rfrozen0.n, rfrozen1.n);
    }
done:
    fsdp_tensor_release(x);
    fu_vals_free(&frozen0), fu_vals_free(&frozen1), fu_vals_free(&rfrozen0),
        fu_vals_free(&rfrozen1);
    fsdp_named_list_free(&fl);
    fsdp_named_list_free(&rl);
    fsdp_optim_destroy(ref_opt);
    fsdp_ddp_destroy(ddp);
    fsdp_module_release(ref);
    fu_teardown(ctx, m, root, NULL, opt);
    return rc < 0 ? rc : 0;
}

static void run_parity(void) {
    static const char *const names[] = {"UOP-MPG-02", "UOP-MPG-03", "UOP-MPG-04", "UOP-IN-01"};
    char prefix[160];
    for (int s = 0; s < 3; s++) {
        fsdp_sharding_strategy_t st = fu_strategies[s];
        const char *sn = fsdp_sharding_strategy_name(st);
        for (int k = 0; k < 8; k++) {
            bool stn = k & 1, before = k & 2, skip = k & 4;
            /* MPG-02: 8 combinations; the writeback check's skip leaks as in the seed only
             * within a job here (set and unset around it). */
            snprintf(prefix, sizeof prefix, "%s %s set_to_none=%d optim_before_wrap=%d skip_wb=%d",
                     names[K_MPG02], sn, stn, before, skip);
            uop_job_t *u = uop_new(prefix, 2, st);
            u->kind = K_MPG02, u->set_to_none = stn, u->optim_before_wrap = before;
            if (skip) setenv("FSDP_SKIP_WRITEBACK_CHECK", "1", 1);
            uop_run(u, parity_rank);
            unsetenv("FSDP_SKIP_WRITEBACK_CHECK");
        }
        for (int skip = 0; skip < 2; skip++) {
            snprintf(prefix, sizeof prefix, "%s %s offload skip_wb=%d", names[K_MPG03], sn, skip);
            uop_job_t *u = uop_new(prefix, 2, st);
            u->kind = K_MPG03, u->j.offload = true;
            if (skip) setenv("FSDP_SKIP_WRITEBACK_CHECK", "1", 1);
            uop_run(u, parity_rank);
            unsetenv("FSDP_SKIP_WRITEBACK_CHECK");
        }
        for (int kind = K_MPG04; kind <= K_IN01; kind++) {
            snprintf(prefix, sizeof prefix, "%s %s", names[kind], sn);
            uop_job_t *u = uop_new(prefix, 2, st);
            u->kind = kind;
            uop_run(u, parity_rank);
        }
    }
    /* World sizes 1 and 4, where it is cheap. */
    for (int w = 1; w <= 4; w += 3) {
        snprintf(prefix, sizeof prefix, "%s FULL_SHARD set_to_none=1", names[K_MPG02]);
        uop_job_t *u = uop_new(prefix, w, FSDP_FULL_SHARD);
        u->kind = K_MPG02, u->set_to_none = true;
        uop_run(u, parity_rank);
        snprintf(prefix, sizeof prefix, "%s FULL_SHARD offload", names[K_MPG03]);
        u = uop_new(prefix, w, FSDP_FULL_SHARD);
        u->kind = K_MPG03, u->j.offload = true;
        uop_run(u, parity_rank);
        snprintf(prefix, sizeof prefix, "%s SHARD_GRAD_OP", names[K_MPG04]);
        u = uop_new(prefix, w, FSDP_SHARD_GRAD_OP);
        u->kind = K_MPG04;
        uop_run(u, parity_rank);
    }
}

/* ---- UOP-MPG-05: two optimizers over disjoint parameters ------------------------------------ */

/* One training iteration on FSDP and DDP: zero both optimizers (set_to_none), forward,
 * backward, step both; the loss parity folded into *worst. */
static int mpg05_iter(fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_module_t *ref, fsdp_ddp_t *ddp,
                      fsdp_optim_t *const *of, fsdp_optim_t *const *od, int it, double *worst) {
    fsdp_tensor_t *x = NULL;
    double vf = NAN, vd = NAN;
    int rc = fu_rand_input(ctx, 300 + 11 * (uint64_t)fsdp_ctx_rank(ctx) + (uint64_t)it, 3, 5, &x);
    for (int k = 0; k < 2 && rc == 0; k++) {
        rc = fsdp_optim_zero_grad(of[k], true);
        if (rc == 0) rc = fsdp_optim_zero_grad(od[k], true);
    }
    if (rc == 0) rc = fwd_bwd(m, NULL, x, NULL, false, false, &vf);
    if (rc == 0) rc = fwd_bwd(ref, ddp, x, NULL, false, false, &vd);
    for (int k = 0; k < 2 && rc == 0; k++) {
        rc = fsdp_optim_step(of[k]);
        if (rc == 0) rc = fsdp_optim_step(od[k]);
    }
    double c = fu_closeness(vf, vd, RTOL, ATOL);
    if (isnan(c) || c > *worst) *worst = isnan(c) ? INFINITY : c;
    fsdp_tensor_release(x);
    return rc;
}

static int mpg05_rank(fsdp_ctx_t *ctx, void *arg) {
    uop_job_t *uj = arg;
    fu_res_t *r = fu_res_of(&uj->j, ctx);
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_ddp_t *ddp = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_optim_t *of[2] = {NULL, NULL}, *od[2] = {NULL, NULL};
    fsdp_named_list_t fl = {0}, rl = {0};
    fsdp_tensor_t *x = NULL, *lf = NULL, *ld = NULL;
    int rc, rank = fsdp_ctx_rank(ctx);
    double worst = 0;
    char why[800] = "";
    FU_TRY(done, "building the models", fu_linear_stack(ctx, 2, 5, &m));
    FU_TRY(done, "building DDP", ref_ddp(ctx, 2, 5, false, &ref, &ddp));
    fsdp_options_t o;
    fu_job_options(&uj->j, &o);
    FU_TRY(done, "wrapping", fsdp_wrap(m, &o, &root));
    FU_TRY(done, "optimizers", fsdp_named_params(root, &fl));
    FU_TRY(done, "optimizers", fsdp_module_named_params(ref, false, &rl));
    FU_TRY(done, "optimizers", part_optim(ctx, &fl, "weight", false, 5e-3, &of[0]));
    FU_TRY(done, "optimizers", part_optim(ctx, &fl, "bias", true, 1e-2, &of[1]));
    FU_TRY(done, "optimizers", part_optim(ctx, &rl, "weight", false, 5e-3, &od[0]));
    FU_TRY(done, "optimizers", part_optim(ctx, &rl, "bias", true, 1e-2, &od[1]));
    /* Not vacuous: this rank's shard holds a weight and a bias, both nonempty. */
    bool w = false, b = false;
    for (size_t i = 0; i < fsdp_unit_num_params(root); i++) {
        fsdp_param_info_t pi;
        if (fsdp_unit_param_info(root, i, &pi) < 0 || pi.numel_in_shard == 0) continue;
        w |= strstr(pi.fqn, "weight") != NULL;
        b |= strstr(pi.fqn, "bias") != NULL;
    }
    fu_ck(r, w && b, "this rank's shard holds a nonempty weight and a nonempty bias",
          "Rank %d does not have a FlatParameter with both a weight and a bias in its shard, "
          "meaning that this test is vacuous",
          rank);
    FU_TRY(done, "iteration 1", mpg05_iter(ctx, m, ref, ddp, of, od, 0, &worst));
    ck_params(r, root, m, ref, "after one iteration");
    /* Only the weight optimizer's gradients go to none; then a forward. */
    FU_TRY(done, "zero_grad", fsdp_optim_zero_grad(of[0], true));
    FU_TRY(done, "zero_grad", fsdp_optim_zero_grad(od[0], true));
    FU_TRY(done, "input", fu_rand_input(ctx, 900 + (uint64_t)rank, 3, 5, &x));
    FU_TRY(done, "FSDP forward", fwd_loss(m, NULL, x, NULL, &lf));
    if (uj->j.strategy == FSDP_FULL_SHARD) {
        bool ok = true;
        why[0] = 0;
        for (size_t i = 0; i < fsdp_unit_num_params(root); i++) {
            fsdp_param_info_t pi;
            if (fsdp_unit_param_info(root, i, &pi) < 0) continue;
            fsdp_tensor_t *g = fsdp_tensor_grad(pi.param);
            int64_t n = fsdp_tensor_numel(pi.param);
            if (n != pi.numel_in_shard) {
                fu_add_why(why, sizeof why, "'%s' has %lld elements, its shard part %lld", pi.fqn,
                           (long long)n, (long long)pi.numel_in_shard);
                ok = false;
            }
            if (n == 0 || strstr(pi.fqn, "weight")) {
                if (g)
                    fu_add_why(why, sizeof why, "'%s' (%lld elements) has a gradient", pi.fqn,
                               (long long)n);
                ok &= g == NULL;
                continue;
            }
            /* A bias: the reduced gradient, DDP's flattened. */
            fsdp_tensor_t *dg = fsdp_tensor_grad(fsdp_module_param(ref, pi.fqn));
            int64_t na = 0, nd = 0;
            float *a = g ? fu_host_f32(g, &na) : NULL, *e = dg ? fu_host_f32(dg, &nd) : NULL;
            bool same = a && e && na == n && pi.intra_start + n <= nd;
            for (int64_t k = 0; same && k < n; k++)
                same = fu_closeness(a[k], e[pi.intra_start + k], RTOL, ATOL) <= 1.0;
            if (!same) fu_add_why(why, sizeof why, "'%s': gradient differs from DDP's", pi.fqn);
            ok &= same;
            free(a), free(e);
        }
        fu_ck(r, ok,
              "after zeroing the weight optimizer and a forward: weight gradients none, bias "
              "gradients DDP's, empty parameters none",
              "%s", why);
        ck_params(r, root, m, ref, "between forward and backward");
    }
    FU_TRY(done, "FSDP backward", fsdp_backward(lf, NULL));
    FU_TRY(done, "DDP forward", fwd_loss(ref, ddp, x, NULL, &ld));
    FU_TRY(done, "DDP backward", fsdp_backward(ld, NULL));
    double c = fu_closeness(item(lf), item(ld), RTOL, ATOL);
    if (isnan(c) || c > worst) worst = isnan(c) ? INFINITY : c;
    for (int k = 0; k < 2; k++) {
        FU_TRY(done, "step", fsdp_optim_step(of[k]));
        FU_TRY(done, "step", fsdp_optim_step(od[k]));
    }
    ck_params(r, root, m, ref, "after the step with cleared weight gradients");
    FU_TRY(done, "iteration 3", mpg05_iter(ctx, m, ref, ddp, of, od, 2, &worst));
    fu_ck(r, worst <= 1.0, "losses equal DDP's in every iteration", "closeness %.3g", worst);
    ck_params(r, root, m, ref, "after one more iteration (Adam's step counts agree)");
done:
    fsdp_tensor_release(x), fsdp_tensor_release(lf), fsdp_tensor_release(ld);
    fsdp_named_list_free(&fl);
    fsdp_named_list_free(&rl);
    for (int k = 0; k < 2; k++)
        fsdp_optim_destroy(of[k]), fsdp_optim_destroy(od[k]);
    fsdp_ddp_destroy(ddp);
    fsdp_module_release(ref);
    fu_teardown(ctx, m, root, NULL, NULL);
    return rc < 0 ? rc : 0;
}

/* ---- UOP-UR-01/02: several forwards before one backward, a summon between them -------------- */

/* Under one summon of both twins (nested), the largest closeness of a's parameters to b's. */
static double twins_vs(fsdp_unit_t *ra, fsdp_module_t *a, fsdp_unit_t *rb, fsdp_module_t *b,
                       char *why, size_t len) {
    fu_vals_t va = {0}, vb = {0};
    double worst = INFINITY;
    why[0] = 0;
    int rc = fu_summon_nowb(ra);
    if (rc == 0) {
        rc = fu_summon_nowb(rb);
        if (rc == 0) {
            rc = fu_module_values(a, false, false, &va);
            if (rc == 0) rc = fu_module_values(b, false, false, &vb);
            int r2 = fsdp_summon_end(rb);
            if (rc == 0) rc = r2;
        }
        int r1 = fsdp_summon_end(ra);
        if (rc == 0) rc = r1;
    }
    if (rc == 0 && va.n == vb.n && va.n > 0) {
        worst = 0;
        for (size_t i = 0; i < va.n; i++) {
            double c = fu_closeness(va.v[i], vb.v[i], RTOL, ATOL);
            if (isnan(c)) c = INFINITY;
            if (c > 1.0 && !why[0])
                snprintf(why, len, "element %zu: %.9g vs %.9g", i, va.v[i], vb.v[i]);
            if (c > worst) worst = c;
        }
    } else {
        snprintf(why, len, "rc %d (%s), %zu vs %zu values", rc, fsdp_err_name(rc), va.n, vb.n);
    }
    fu_vals_free(&va);
    fu_vals_free(&vb);
    return worst;
}

static int ur_rank(fsdp_ctx_t *ctx, void *arg) {
    uop_job_t *uj = arg;
    fu_res_t *r = fu_res_of(&uj->j, ctx);
    fsdp_module_t *m[2] = {NULL, NULL};
    fsdp_unit_t *root[2] = {NULL, NULL};
    fsdp_optim_t *opt[2] = {NULL, NULL};
    fsdp_named_list_t l = {0};
    fsdp_tensor_t *x1 = NULL, *x2 = NULL, *o1[2] = {NULL, NULL}, *o2[2] = {NULL, NULL};
    fsdp_tensor_t *sum[2] = {NULL, NULL}, *loss[2] = {NULL, NULL};
    int rc, rank = fsdp_ctx_rank(ctx);
    double wout = 0, wsum = 0, wmid = 0;
    char why[400] = "";
    static const char *const units[] = {"0", "2", NULL};
    for (int k = 0; k < 2; k++) {
        FU_TRY(done, "building the twins", fu_linear_stack(ctx, 3, 5, &m[k]));
        fsdp_options_t o;
        fu_job_options(&uj->j, &o);
        o.use_orig_params = k == 1;
        FU_TRY(done, "wrapping", fu_wrap_listed(m[k], units, &o, NULL, NULL));
        FU_TRY(done, "wrapping", fsdp_wrap(m[k], &o, &root[k]));
        FU_TRY(done, "optimizer", fsdp_named_params(root[k], &l));
        FU_TRY(done, "optimizer", adam_over(ctx, &l, &opt[k]));
        fsdp_named_list_free(&l);
    }
    for (int it = 0; it < 3; it++) {
        FU_TRY(done, "input",
               fu_rand_input(ctx, 500 + 13 * (uint64_t)rank + (uint64_t)it, 4, 5, &x1));
        FU_TRY(done, "input", fsdp_add_scalar(x1, 1.0, &x2));
        for (int k = 0; k < 2; k++) {
            FU_TRY(done, "zero_grad", fsdp_optim_zero_grad(opt[k], true));
            FU_TRY(done, "forward 1", fsdp_module_forward1(m[k], x1, &o1[k]));
            if (uj->flag) {
                /* Twin k between its forwards, the other one between iterations: both summoned
                 * (nested). Twin 0 goes first, so both have taken the same steps then; twin 1's
                 * summon is there for what it must not disturb. */
                double c = twins_vs(root[0], m[0], root[1], m[1], why, sizeof why);
                if (k == 0 && !(c <= wmid)) wmid = isnan(c) ? INFINITY : c;
            }
            FU_TRY(done, "forward 2", fsdp_module_forward1(m[k], x2, &o2[k]));
            FU_TRY(done, "loss", fsdp_add(o1[k], o2[k], &sum[k]));
            FU_TRY(done, "loss", tm_sum_loss(sum[k], &loss[k]));
            FU_TRY(done, "backward", fsdp_backward(loss[k], NULL));
            FU_TRY(done, "step", fsdp_optim_step(opt[k]));
        }
        double c1 = fu_tensor_closeness(o1[1], o1[0], RTOL, ATOL);
        double c2 = fu_tensor_closeness(o2[1], o2[0], RTOL, ATOL);
        double cl = fu_closeness(item(loss[1]), item(loss[0]), RTOL, ATOL);
        if (c1 < 0 || c2 < 0) c1 = INFINITY;
        wout = fmax(wout, fmax(c1, c2));
        wsum = isnan(cl) ? INFINITY : fmax(wsum, cl);
        fsdp_tensor_release(x1), fsdp_tensor_release(x2);
        x1 = x2 = NULL;
        for (int k = 0; k < 2; k++) {
            fsdp_tensor_release(o1[k]), fsdp_tensor_release(o2[k]);
            fsdp_tensor_release(sum[k]), fsdp_tensor_release(loss[k]);
            o1[k] = o2[k] = sum[k] = loss[k] = NULL;
        }
    }
    fu_ck(r, wout <= 1.0, "UOP-UR: both forwards' outputs equal the twin's (orig params off)",
          "closeness %.3g", wout);
    fu_ck(r, wsum <= 1.0, "UOP-UR: the losses of out1 + out2 equal the twin's", "closeness %.3g",
          wsum);
    if (uj->flag)
        fu_ck(r, wmid <= 1.0,
              "UOP-UR-02: summoned between the forwards, parameters equal the twin's",
              "closeness %.3g: %s", wmid, why);
    double c = twins_vs(root[0], m[0], root[1], m[1], why, sizeof why);
    fu_ck(r, c <= 1.0, "UOP-UR: after 3 iterations, summoned parameters equal the twin's",
          "closeness %.3g: %s", c, why);
done:
    fsdp_tensor_release(x1), fsdp_tensor_release(x2);
    for (int k = 0; k < 2; k++) {
        fsdp_tensor_release(o1[k]), fsdp_tensor_release(o2[k]);
        fsdp_tensor_release(sum[k]), fsdp_tensor_release(loss[k]);
    }
    fsdp_named_list_free(&l);
    fu_teardown(ctx, m[0], root[0], NULL, opt[0]);
    fu_teardown(ctx, m[1], root[1], NULL, opt[1]);
    return rc < 0 ? rc : 0;
}

/* ---- main -------------------------------------------------------------------------------- */

int main(void) {
    char prefix[160];
    tap_plan_lazy();
    run_parity();
    for (int s = 0; s < 2; s++) {
        snprintf(prefix, sizeof prefix, "UOP-MPG-05 %s",
                 fsdp_sharding_strategy_name(fu_strategies[s]));
        uop_run(uop_new(prefix, 2, fu_strategies[s]), mpg05_rank);
    }
    for (int s = 0; s < 3; s++)
        for (int k = 0; k < 4; k++) {
            bool summon = k & 1, offload = k & 2;
            snprintf(prefix, sizeof prefix, "UOP-UR-%02d %s offload=%d", summon ? 2 : 1,
                     fsdp_sharding_strategy_name(fu_strategies[s]), offload);
            uop_job_t *u = uop_new(prefix, 2, fu_strategies[s]);
            u->flag = summon, u->j.offload = offload;
            uop_run(u, ur_rank);
        }
    return tap_done();
}
