/* SPDX-License-Identifier: MIT */
/*
 * t_fsdp_core.c: the unit behaviours of test_fsdp_core.py that concern parameters and modes
 * (spec section 3; the hook tests are in t_fsdp_hooks.c, parity in t_fsdp.c, the
 * mixed-precision variants in t_fsdp_mp.c):
 *   CORE-PI-01  a write into the local shard after wrapping reaches the next forward (the flat
 *               parameter, and with use_orig_params an original parameter's shard view);
 *   CORE-NG-01  an eval forward equals a no-grad forward bitwise; no-grad records nothing and
 *               leaves every unit sharded; training goes on normally after a forward whose graph
 *               was dropped;
 *   F19         every unit IDLE after each step;
 *   fsdp_wrap error paths: NULL module, bad options, wrapping twice or inside a tree, mixed
 *               dtypes, a parameter shared by two units; the module stays usable afterwards.
 *
 * Every rank of a sim run (world 2, and 3 where cheap) runs the same checks in the same order
 * and records each into its own list; the main thread prints one TAP line per check, passing
 * only when every rank passed it, with each failing rank's detail as comments (fu_run_job). The
 * upstream cuda_first variants have no C counterpart (no CUDA init modes on the sim backend).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "models/models.h"
#include "tap.h"

/* ---- CORE-PI-01 ------------------------------------------------------------------------------ */

/* Three twins A, B, C; B is changed through its local shard after wrapping. */
static int pi_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m[3] = {NULL, NULL, NULL};
    fsdp_unit_t *root[3] = {NULL, NULL, NULL};
    fsdp_tensor_t *out[3] = {NULL, NULL, NULL};
    int rc = FSDP_OK;
    for (int i = 0; i < 3 && rc == 0; i++) {
        if ((rc = tm_transformer_create(ctx, true, true, &m[i])) < 0)
            fu_fatal(r, ctx, "building TransformerWithSharedParams", rc);
        else if ((rc = fu_wrap_transformer(m[i], j, &root[i])) < 0)
            fu_fatal(r, ctx, "wrapping TransformerWithSharedParams", rc);
    }
    if (rc < 0) goto done;
    if ((rc = fu_change_root_shard(r, ctx, m[1], root[1], j->orig, 11)) != 0) {
        rc = rc > 0 ? FSDP_OK : rc;
        goto done;
    }
    for (int i = 0; i < 3; i++)
        FU_TRY(done, "forward", fu_transformer_forward(ctx, m[i], &out[i], NULL));
    int same = fu_same_bits(out[0], out[2]);
    fu_ck(r, same == 1, "control: an unchanged twin gives bitwise the same output",
          "same_bits returned %d", same);
    double cl = fu_tensor_closeness(out[1], out[0], FU_F32_RTOL, FU_F32_ATOL);
    fu_ck(r, cl > 1.0,
          j->orig ? "CORE-PI-01 (use_orig_params): a write into an original parameter's shard "
                    "view reaches the next forward"
                  : "CORE-PI-01: a write into the root's flat parameter (local shard) reaches the "
                    "next forward",
          "new_output did not reflect change to param after init (outputs within fp32 tolerance: "
          "worst %.3g of tolerance)",
          cl);
done:
    for (int i = 0; i < 3; i++)
        fsdp_tensor_release(out[i]);
    fsdp_tape_clear(ctx);
    for (int i = 0; i < 3; i++) {
        fsdp_unit_destroy(root[i]);
        fsdp_module_release(m[i]);
    }
    return rc;
}

/* ---- CORE-NG-01 ------------------------------------------------------------------------------ */

static int ng_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL, **u = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_tensor_t *out = NULL, *tgt = NULL, *loss = NULL, *ng = NULL, *ev = NULL;
    size_t n = 0;
    int post_mult[8];
    fu_bwd_watch_t w[8];
    fsdp_unit_stats_t s0;
    char why[760];
    int rc;
    /* Not deterministic: training mode, so dropout is active (seeded alike on every rank). */
    if ((rc = fu_transformer_setup(r, ctx, j, false, &m, &root, &u, &n, &opt)) < 0) goto done;
    if (!fu_ck(r, n == 5, "5 units", "%zu units", n)) goto done;
    for (size_t i = 0; i < n; i++)
        post_mult[i] = 1;
    FU_TRY(done, "adding backward hooks", fu_watch_units(u, n, w));
    fu_ck(r, fsdp_module_is_training(m), "the model trains with dropout", "it is in eval mode");

    /* One training step. */
    fsdp_optim_zero_grad(opt, true);
    FU_TRY(done, "training step", fu_transformer_forward(ctx, m, &out, &tgt));
    FU_TRY(done, "training step", tm_transformer_loss(tgt, out, &loss));
    FU_TRY(done, "training step", fsdp_backward(loss, NULL));
    FU_TRY(done, "training step", fsdp_optim_step(opt));
    fsdp_tensor_release(out);
    fsdp_tensor_release(tgt);
    fsdp_tensor_release(loss);
    out = tgt = loss = NULL;
    fu_ck(r, fu_all_idle(u, n, why, sizeof why), "F19: every unit IDLE after the step", "%s", why);

    fsdp_module_train(m, false);
    fsdp_unit_get_stats(root, &s0);
    size_t tape0 = fsdp_tape_size(ctx);
    FU_TRY(done, "no-grad forward", fu_no_grad_forward(ctx, m, &ng));
    fu_ck(r, tape0 == 0 && fsdp_tape_size(ctx) == 0,
          "CORE-NG-01: a no-grad forward records nothing on the tape",
          "tape size %zu before, %zu after", tape0, fsdp_tape_size(ctx));
    fu_ck(r, !fsdp_tensor_requires_grad(ng), "CORE-NG-01: the no-grad output requires no gradient",
          "it does");
    fu_ck(r, fu_none_unsharded(u, n, why, sizeof why),
          "CORE-NG-01: after a no-grad forward no unit (root included) is unsharded", "%s", why);
    fu_ck(r, fu_all_idle(u, n, why, sizeof why),
          "CORE-NG-01: every unit IDLE after the no-grad forward", "%s", why);
    fu_ck(r, fu_counters_are(u, n, post_mult, 1, why, sizeof why),
          "CORE-NG-01: a no-grad forward registers no backward hooks", "%s", why);

    /* Eval mode with grad on: records, and must compute the same. */
    FU_TRY(done, "eval forward", fu_transformer_forward(ctx, m, &ev, NULL));
    fu_ck(r, fsdp_tape_size(ctx) > 0 && fsdp_tensor_requires_grad(ev),
          "control: the eval forward with grad on recorded its graph", "tape size %zu",
          fsdp_tape_size(ctx));
    int same = fu_same_bits(ev, ng);
    fu_ck(r, same == 1, "CORE-NG-01: eval forward and no-grad forward give bitwise the same output",
          "same_bits returned %d (closeness %.3g of fp32 tolerance)", same,
          fu_tensor_closeness(ng, ev, FU_F32_RTOL, FU_F32_ATOL));
    fu_ck(r, fu_all_idle(u, n, why, sizeof why),
          "CORE-NG-01: every unit IDLE after the eval forward", "%s", why);
    fu_ck(r, fu_counters_are(u, n, post_mult, 2, why, sizeof why),
          "a forward with grad in eval mode registers once per unit", "%s", why);

    /* The eval graph is dropped unused (no backward); training goes on. */
    fsdp_tensor_release(ev);
    ev = NULL;
    fsdp_tape_clear(ctx);
    fsdp_module_train(m, true);
    fsdp_optim_zero_grad(opt, true);
    FU_TRY(done, "forward after the dropped eval graph",
           fu_transformer_forward(ctx, m, &out, &tgt));
    FU_TRY(done, "forward after the dropped eval graph", tm_transformer_loss(tgt, out, &loss));
    fu_ck(r, fu_counters_are(u, n, post_mult, 3, why, sizeof why),
          "after a forward whose graph was dropped (fsdp_tape_clear), the next forward registers "
          "pre- and post-backward again",
          "%s", why);
    FU_TRY(done, "training step after the dropped eval graph", fsdp_backward(loss, NULL));
    FU_TRY(done, "training step after the dropped eval graph", fsdp_optim_step(opt));
    fu_ck(r, fu_watched(w, n, 2, why, sizeof why),
          "after a dropped eval graph, backward frees each unit when it leaves it (not only in the "
          "final callback)",
          "%s", why);
    fu_ck(r, fu_all_idle(u, n, why, sizeof why), "F19: every unit IDLE after the next step", "%s",
          why);
done:
    fsdp_tensor_release(out);
    fsdp_tensor_release(tgt);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(ng);
    fsdp_tensor_release(ev);
    fu_teardown(ctx, m, root, u, opt);
    return rc;
}

/* ---- fsdp_wrap error paths ------------------------------------------------------------------- */

/* Tied: one parameter "tied_w" (registered by the caller); forward x W^T. */
static int tied_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                        fsdp_tensor_t **out) {
    if (nin != 1 || nout != 1) return FSDP_EINVAL;
    return fsdp_linear(in[0], fsdp_module_param(m, "tied_w"), NULL, &out[0]);
}

static const fsdp_module_ops_t tied_ops = {"Tied", tied_forward, NULL};

/* Sequential(Linear(3, 3), Tied) where Tied's tied_w is the Linear's weight. */
static int tied_model(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_module_t *m = NULL, *l = NULL, *t = NULL;
    tm_manual_seed(ctx, 0);
    int rc = fsdp_sequential_create(ctx, &m);
    if (rc == 0) rc = fsdp_linear_create(ctx, 3, 3, true, &l);
    if (rc == 0) rc = fsdp_module_append(m, l);
    if (rc == 0) rc = fsdp_module_create(ctx, &tied_ops, NULL, &t);
    if (rc == 0) rc = fsdp_module_add_param(t, "tied_w", fsdp_module_param(l, "weight"));
    if (rc == 0) rc = fsdp_module_append(m, t);
    fsdp_module_release(l);
    fsdp_module_release(t);
    if (rc < 0) {
        fsdp_module_release(m);
        m = NULL;
    }
    *out = m;
    return rc;
}

/* Forward of m and of ref on the same input agree (fp32 tolerance): 1, 0, or -1 on failure. */
static int forward_matches(fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_module_t *ref) {
    fsdp_tensor_t *x = NULL, *a = NULL, *b = NULL;
    int res = -1;
    if (fu_rand_input(ctx, 17, 2, 3, &x) == 0 && fsdp_module_forward1(m, x, &a) == 0 &&
        fsdp_module_forward1(ref, x, &b) == 0) {
        double c = fu_tensor_closeness(a, b, FU_F32_RTOL, FU_F32_ATOL);
        res = c >= 0 && c <= 1.0;
    }
    fsdp_tensor_release(x);
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    fsdp_tape_clear(ctx);
    return res;
}

static bool shape_is(const fsdp_tensor_t *t, int64_t d0, int64_t d1) {
    return t && fsdp_tensor_ndim(t) == 2 && fsdp_tensor_size(t, 0) == d0 &&
           fsdp_tensor_size(t, 1) == d1;
}

static int err_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL, *ref = NULL, *m2 = NULL;
    fsdp_unit_t *u = NULL, *u2 = NULL, *u3 = NULL;
    fsdp_tensor_t *f64 = NULL, *bias = NULL;
    fsdp_options_t o;
    const char *msg;
    int rc, ret = FSDP_OK;
    fu_job_options(j, &o);

    /* NULL module (and NULL out). */
    u = (fsdp_unit_t *)&u2; /* any non-NULL value: must be cleared */
    rc = fsdp_wrap(NULL, &o, &u);
    fu_ck(r, rc == FSDP_EINVAL && u == NULL,
          "fsdp_wrap(NULL module) is FSDP_EINVAL and sets *out "
          "to NULL",
          "rc %s, out %p", fsdp_err_name(rc), (void *)u);
    u = NULL;

    if ((rc = fu_linear_stack(ctx, 2, 3, &m)) < 0 || (rc = fu_linear_stack(ctx, 2, 3, &ref)) < 0) {
        ret = fu_fatal(r, ctx, "building Sequential(Linear, Linear)", rc);
        goto done;
    }
    rc = fsdp_wrap(m, &o, NULL);
    fu_ck(r, rc == FSDP_EINVAL && fsdp_unit_of(m) == NULL,
          "fsdp_wrap with out NULL is FSDP_EINVAL and wraps nothing", "rc %s", fsdp_err_name(rc));

    /* Bad options. */
    fsdp_options_t bad = o;
    bad.limit_all_gathers = -1;
    rc = fsdp_wrap(m, &bad, &u);
    msg = fsdp_ctx_last_error(ctx);
    fu_ck(r, rc == FSDP_EINVAL && u == NULL && strstr(msg, "limit_all_gathers"),
          "a negative limit_all_gathers is FSDP_EINVAL naming the option", "rc %s, message '%s'",
          fsdp_err_name(rc), msg);
    bad = o;
    bad.strategy = FSDP_SHARDING_COUNT;
    rc = fsdp_wrap(m, &bad, &u);
    fu_ck(r, rc == FSDP_EINVAL && u == NULL, "an invalid sharding strategy is FSDP_EINVAL", "rc %s",
          fsdp_err_name(rc));
    fu_ck(r,
          fsdp_unit_of(m) == NULL && fsdp_unit_of(fsdp_module_child(m, "0")) == NULL &&
              shape_is(fsdp_module_param(m, "0.weight"), 3, 3),
          "after refused options the module is untouched (no unit, parameters as registered)",
          "unit %p, 0.weight 2-d (3, 3): %d", (void *)fsdp_unit_of(m),
          shape_is(fsdp_module_param(m, "0.weight"), 3, 3));
    int fm = forward_matches(ctx, m, ref);
    fu_ck(r, fm == 1, "after refused options the module still computes what it did", "%d", fm);

    /* Wrapping twice, and wrapping a module inside a wrapped tree. */
    if ((rc = fsdp_wrap(m, &o, &u)) < 0) {
        ret = fu_fatal(r, ctx, "wrapping Sequential(Linear, Linear)", rc);
        goto done;
    }
    rc = fsdp_wrap(m, &o, &u2);
    msg = fsdp_ctx_last_error(ctx);
    fu_ck(r, rc == FSDP_EINVAL && u2 == NULL && strstr(msg, "already"),
          "wrapping a unit's module again is FSDP_EINVAL ('already a unit')", "rc %s, message '%s'",
          fsdp_err_name(rc), msg);
    rc = fsdp_wrap(fsdp_module_child(m, "1"), &o, &u2);
    msg = fsdp_ctx_last_error(ctx);
    fu_ck(r, rc == FSDP_EINVAL && u2 == NULL && strstr(msg, "weight"),
          "wrapping a submodule whose parameters a unit already manages is FSDP_EINVAL naming the "
          "parameter",
          "rc %s, message '%s'", fsdp_err_name(rc), msg);
    fu_ck(r,
          fsdp_unit_of(m) == u && fsdp_unit_is_root(u) &&
              fsdp_unit_of(fsdp_module_child(m, "1")) == NULL,
          "after the refused wraps the first unit is intact", "unit of m %p (want %p)",
          (void *)fsdp_unit_of(m), (void *)u);
    fm = forward_matches(ctx, m, ref);
    fu_ck(r, fm == 1,
          "after the refused wraps the unit still computes the unwrapped model's output", "%d", fm);
    fsdp_unit_destroy(u);
    u = NULL;
    fsdp_module_release(m);
    m = NULL;

    /* Mixed dtypes. */
    if ((rc = fu_linear_stack(ctx, 2, 3, &m)) < 0) {
        ret = fu_fatal(r, ctx, "building Sequential(Linear, Linear)", rc);
        goto done;
    }
    const int64_t three[1] = {3};
    bias = fsdp_tensor_retain(fsdp_module_param(m, "1.bias"));
    if ((rc = fsdp_tensor_zeros(ctx, FSDP_DTYPE_F64, 1, three, FSDP_MEM_PARAMS, &f64)) < 0 ||
        (rc = fsdp_tensor_copy_(f64, bias)) < 0 ||
        (rc = fsdp_tensor_set_requires_grad(f64, true)) < 0 ||
        (rc = fsdp_module_set_param(m, "1.bias", f64, false)) < 0) {
        ret = fu_fatal(r, ctx, "making 1.bias f64", rc);
        goto done;
    }
    rc = fsdp_wrap(m, &o, &u);
    msg = fsdp_ctx_last_error(ctx);
    fu_ck(r,
          rc == FSDP_EINVAL && u == NULL && strstr(msg, "1.bias") &&
              (strstr(msg, "0.weight") || strstr(msg, "0.bias") || strstr(msg, "1.weight")) &&
              strstr(msg, "f64"),
          "mixed dtypes: FSDP_EINVAL naming the f64 parameter and an f32 one",
          "rc %s, message '%s'", fsdp_err_name(rc), msg);
    fu_ck(r,
          fsdp_unit_of(m) == NULL && fsdp_module_param(m, "1.bias") == f64 &&
              shape_is(fsdp_module_param(m, "0.weight"), 3, 3),
          "after the mixed-dtype refusal the module is untouched", "unit %p",
          (void *)fsdp_unit_of(m));
    if ((rc = fsdp_module_set_param(m, "1.bias", bias, false)) < 0) {
        ret = fu_fatal(r, ctx, "restoring 1.bias", rc);
        goto done;
    }
    rc = fsdp_wrap(m, &o, &u);
    fu_ck(r, rc == 0 && u, "with the dtype fixed the same module wraps", "rc %s (%s)",
          fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
    fm = u ? forward_matches(ctx, m, ref) : 0;
    fu_ck(r, fm == 1, "and computes the unwrapped model's output", "%d", fm);
    fsdp_unit_destroy(u);
    u = NULL;
    fsdp_module_release(m);
    m = NULL;

    /* A parameter shared by two units: Linear's weight is also Tied's tied_w. */
    if ((rc = tied_model(ctx, &m)) < 0 || (rc = tied_model(ctx, &m2)) < 0) {
        ret = fu_fatal(r, ctx, "building the tied model", rc);
        goto done;
    }
    fsdp_module_t *c0 = fsdp_module_child(m, "0"), *c1 = fsdp_module_child(m, "1");
    int rc0 = fsdp_wrap(c0, &o, &u);
    char msg0[600];
    snprintf(msg0, sizeof msg0, "%s", fsdp_ctx_last_error(ctx));
    int rc1 = fsdp_wrap(c1, &o, &u2);
    msg = rc0 < 0 ? msg0 : fsdp_ctx_last_error(ctx);
    fu_ck(r, (rc0 < 0 || rc1 < 0) && (strstr(msg, "tied_w") || strstr(msg, "weight")),
          "a parameter shared by two units: wrapping the second (or the first) is refused, naming "
          "the parameter",
          "wrap of '0' %s, of '1' %s; message '%s'", fsdp_err_name(rc0), fsdp_err_name(rc1), msg);
    if (rc0 == 0 && rc1 < 0) {
        rc = fsdp_wrap(m, &o, &u3);
        msg = fsdp_ctx_last_error(ctx);
        fu_ck(
            r, rc < 0 && u3 == NULL && strstr(msg, "tied_w"),
            "wrapping the root over a unit whose parameter a sibling shares is refused, naming it",
            "rc %s, message '%s'", fsdp_err_name(rc), msg);
        fu_ck(r,
              fsdp_unit_of(c0) == u && fsdp_unit_parent(u) == NULL && fsdp_unit_of(m) == NULL &&
                  fsdp_unit_of(c1) == NULL,
              "after the refusals the first unit stands alone and nothing else is a unit",
              "unit of '0' %p (want %p), parent %p, unit of root %p, of '1' %p",
              (void *)fsdp_unit_of(c0), (void *)u, (void *)fsdp_unit_parent(u),
              (void *)fsdp_unit_of(m), (void *)fsdp_unit_of(c1));
        fm = forward_matches(ctx, c0, fsdp_module_child(m2, "0"));
        fu_ck(r, fm == 1, "the first unit still computes its Linear", "%d", fm);
    }
    fsdp_unit_destroy(u3);
    fsdp_unit_destroy(u2);
    fsdp_unit_destroy(u);
    u = u2 = u3 = NULL;
    fsdp_module_release(m);
    m = NULL;

    /* The same sharing met by an auto-wrap policy ({"Linear"}): the Linear becomes a unit, then
     * the root's wrap is refused, naming the parameter. (Whether the Linear's unit survives the
     * refusal is not promised; it is destroyed here if it did.) */
    if ((rc = tied_model(ctx, &m)) < 0) {
        ret = fu_fatal(r, ctx, "building the tied model", rc);
        goto done;
    }
    static const char *const lin_types[] = {"Linear", NULL};
    rc = fu_wrap_types(m, &o, lin_types, &u);
    msg = fsdp_ctx_last_error(ctx);
    fu_ck(r, rc == FSDP_EINVAL && u == NULL && strstr(msg, "tied_w"),
          "a parameter shared across units chosen by a wrap policy: FSDP_EINVAL naming it",
          "rc %s, message '%s'", fsdp_err_name(rc), msg);
    fu_ck(r, fsdp_unit_of(m) == NULL, "the refused root is not a unit", "it is");
    fsdp_unit_destroy(u);
    u = NULL;
    fsdp_unit_t *left = fsdp_unit_of(fsdp_module_child(m, "0"));
    if (left && fsdp_unit_is_root(left)) fsdp_unit_destroy(left);
    fsdp_module_release(m);
    m = NULL;

    /* Control: a tensor shared inside one unit is fine (tied weights, as in the transformer). */
    if ((rc = tied_model(ctx, &m)) < 0) {
        ret = fu_fatal(r, ctx, "building the tied model", rc);
        goto done;
    }
    rc = fsdp_wrap(m, &o, &u);
    fu_ck(r, rc == 0 && u && fsdp_unit_num_params(u) == 2,
          "control: a parameter shared inside one unit wraps, flattened once",
          "rc %s (%s), %zu parameters", fsdp_err_name(rc), fsdp_ctx_last_error(ctx),
          fsdp_unit_num_params(u));
    fm = u ? forward_matches(ctx, m, m2) : 0;
    fu_ck(r, fm == 1, "control: and computes the unwrapped tied model's output", "%d", fm);
done:
    fsdp_tensor_release(f64);
    fsdp_tensor_release(bias);
    fsdp_unit_destroy(u3);
    fsdp_unit_destroy(u2);
    fsdp_unit_destroy(u);
    fsdp_module_release(m);
    fsdp_module_release(m2);
    fsdp_module_release(ref);
    return ret;
}

/* ---- main ------------------------------------------------------------------------------------ */

int main(void) {
    tap_plan_lazy();
    for (int w = 2; w <= 3; w++) {
        fu_run("CORE-PI-01 FULL_SHARD", w, FSDP_FULL_SHARD, false, pi_rank);
        fu_run("CORE-PI-01 FULL_SHARD use_orig_params", w, FSDP_FULL_SHARD, true, pi_rank);
        fu_run("CORE-NG-01 TransformerWithSharedParams FULL_SHARD", w, FSDP_FULL_SHARD, false,
               ng_rank);
    }
    fu_run("fsdp_wrap errors", 2, FSDP_FULL_SHARD, false, err_rank);
    fu_run("fsdp_wrap errors use_orig_params", 2, FSDP_FULL_SHARD, true, err_rank);
    return tap_done();
}
