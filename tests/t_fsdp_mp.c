/* SPDX-License-Identifier: MIT */
/*
 * t_fsdp_mp.c: mixed precision in the test_fsdp_core.py tests (spec sections 3 and 6):
 *   CORE-P02    NestedWrappedModule under MixedPrecision(param, reduce, buffer = f16), one
 *               iteration over the seed-000 instance and subtest matrix: the loss is f16 and
 *               within fp16 tolerance of a reference that rounds weights and input to half
 *               (upstream's DDP under autocast; parameters are not compared, as upstream);
 *               backward, the step and the state round trip complete; the sharded gradients
 *               and the parameters the optimizer steps stay f32;
 *   CORE-PI-01  with an all-None MixedPrecision (enabled, every dtype FSDP_MP_UNSET, which
 *               must mean full precision): a write into the local shard after wrapping still
 *               reaches the next forward, and every output is f32 and bitwise the output of a
 *               twin wrapped without mixed precision (given the same write);
 *   CORE-H03    with the all-None config: no backward-hook registration before the first
 *               forward, one per unit after each forward; and the run is bitwise a run without
 *               mixed precision: losses, every unit's counters, local shards and sharded
 *               gradients after each step;
 *   CORE-NG-01  with param, reduce and buffer dtype f16, after one training step: an eval
 *               forward with grad and a no-grad forward (both in eval mode, as upstream) agree
 *               within fp16 tolerance (rtol 1e-3, atol 1e-5: torch's assert_close default for
 *               f16; spec section 0), both f16; the no-grad forward records nothing and leaves
 *               every unit sharded; the training loss is f16, buffers are f16 and the sharded
 *               gradients f32.
 *
 * Every rank records its checks and fu_run_job() prints one TAP line per check (fsdp_util.h).
 * Upstream's cuda_first axis has no C counterpart (no CUDA init modes on the sim backend).
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

/* MixedPrecision(param_dtype, reduce_dtype, buffer_dtype all f16), upstream's default_mp. */
static void mp_f16(fsdp_mixed_precision_t *mp) {
    fsdp_mixed_precision_init(mp);
    mp->enabled = true;
    mp->param_dtype = mp->reduce_dtype = mp->buffer_dtype = FSDP_DTYPE_F16;
}

/* MixedPrecision() with every field None: enabled, every dtype unset. */
static void mp_all_none(fsdp_mixed_precision_t *mp) {
    fsdp_mixed_precision_init(mp);
    mp->enabled = true;
}

/* Every gradient of l (where there is one) is f32 and finite; otherwise false with the first
 * offender in why. */
static bool grads_f32_finite(const fsdp_named_list_t *l, char *why, size_t len) {
    for (size_t i = 0; i < l->n; i++) {
        fsdp_tensor_t *g = fsdp_tensor_grad(l->tensors[i]);
        if (!g) continue;
        bool finite = true;
        for (int64_t k = 0; k < fsdp_tensor_numel(g) && finite; k++) {
            double v = 0;
            finite = fsdp_tensor_item(g, k, &v) == 0 && isfinite(v);
        }
        if (fsdp_tensor_dtype(g) != FSDP_DTYPE_F32 || !finite) {
            snprintf(why, len, "gradient of '%s' is %s%s", l->names[i],
                     fsdp_dtype_name(fsdp_tensor_dtype(g)),
                     finite ? "" : " with non-finite values");
            return false;
        }
    }
    return true;
}

/* Every tensor of l is f32; otherwise false with the first offender in why. */
static bool all_f32(const fsdp_named_list_t *l, char *why, size_t len) {
    for (size_t i = 0; i < l->n; i++)
        if (fsdp_tensor_dtype(l->tensors[i]) != FSDP_DTYPE_F32) {
            snprintf(why, len, "'%s' is %s", l->names[i],
                     fsdp_dtype_name(fsdp_tensor_dtype(l->tensors[i])));
            return false;
        }
    return true;
}

/* ---- CORE-P02 -------------------------------------------------------------------------------- */

/* m's parameters replaced by f16 copies (tied parameters stay tied). NestedWrappedModule, the
 * only model this runs on, has no buffers. */
static int to_half(fsdp_module_t *m) {
    fsdp_named_list_t ps = {0};
    int rc = fsdp_module_named_params(m, true, &ps);
    fsdp_tensor_t **done_from = calloc(ps.n + 1, sizeof *done_from);
    fsdp_tensor_t **done_to = calloc(ps.n + 1, sizeof *done_to);
    size_t nd = 0;
    if (!done_from || !done_to) rc = FSDP_ENOMEM;
    for (size_t i = 0; i < ps.n && rc == 0; i++) {
        fsdp_tensor_t *h = NULL;
        for (size_t k = 0; k < nd; k++)
            if (done_from[k] == ps.tensors[i]) h = done_to[k];
        if (!h) {
            rc = fsdp_to_dtype(ps.tensors[i], FSDP_DTYPE_F16, &h);
            if (rc < 0) break;
            fsdp_tensor_set_requires_grad(h, true);
            done_from[nd] = ps.tensors[i];
            done_to[nd++] = h;
        }
        rc = fsdp_module_set_param(m, ps.names[i], h, false);
    }
    for (size_t k = 0; k < nd; k++)
        fsdp_tensor_release(done_to[k]);
    free(done_from);
    free(done_to);
    fsdp_named_list_free(&ps);
    return rc;
}

/* NestedWrappedModule's forward and loss (sum of the output). */
static int nested_loss(fsdp_module_t *m, fsdp_tensor_t *in, fsdp_tensor_t **loss) {
    fsdp_tensor_t *out = NULL;
    int rc = fsdp_module_forward1(m, in, &out);
    if (rc == 0) rc = tm_sum_loss(out, loss);
    fsdp_tensor_release(out);
    return rc;
}

/* One iteration of upstream's PARITY under mixed precision. The reference is the model with
 * its weights and input rounded to half and full-precision masters elsewhere (upstream's DDP
 * under autocast); only the loss is compared, as upstream. */
static int p02_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *half = NULL, *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_named_list_t params = {0};
    fsdp_tensor_t *in = NULL, *h_in = NULL, *loss = NULL;
    double ref_loss = 0, loss_v = 0;
    char why[760];
    fsdp_options_t o;
    fu_job_options(j, &o);
    int rc;
    FU_TRY(done, "setting up", tm_nested_wrapped_create(ctx, true, &half));
    FU_TRY(done, "setting up", to_half(half));
    FU_TRY(done, "setting up", tm_nested_wrapped_create(ctx, true, &m));
    FU_TRY(done, "setting up", fu_wrap_listed(m, tm_nested_wrapped_units(), &o, NULL, NULL));
    FU_TRY(done, "setting up", fsdp_wrap(m, &o, &root));
    FU_TRY(done, "setting up", fsdp_named_params(root, &params));
    FU_TRY(done, "setting up", fu_make_sgd(ctx, &params, 0.01, 0.9, &opt));
    FU_TRY(done, "reference forward", tm_nested_wrapped_get_input(ctx, &in));
    FU_TRY(done, "reference forward", fsdp_to_dtype(in, FSDP_DTYPE_F16, &h_in));
    FU_TRY(done, "reference forward", nested_loss(half, h_in, &loss));
    FU_TRY(done, "reference forward", fsdp_tensor_item(loss, 0, &ref_loss));
    fsdp_tensor_release(loss);
    loss = NULL;
    fsdp_tape_clear(ctx);
    fsdp_optim_zero_grad(opt, true);
    FU_TRY(done, "FSDP forward", nested_loss(m, in, &loss));
    FU_TRY(done, "FSDP forward", fsdp_tensor_item(loss, 0, &loss_v));
    fu_ck(r, fsdp_tensor_dtype(loss) == FSDP_DTYPE_F16, "CORE-P02: the loss is f16 (param_dtype)",
          "the loss is %s", fsdp_dtype_name(fsdp_tensor_dtype(loss)));
    double cl = fu_closeness(loss_v, ref_loss, FU_F16_RTOL, FU_F16_ATOL);
    fu_ck(r, cl <= 1.0,
          "CORE-P02: the loss matches the reference (weights and input rounded to half) within "
          "fp16 tolerance (rtol 1e-3, atol 1e-5)",
          "loss %.9g, reference %.9g: %.3g of tolerance", loss_v, ref_loss, cl);
    rc = fsdp_backward(loss, NULL);
    if (rc == 0) rc = fsdp_optim_step(opt);
    if (rc < 0) {
        fu_fatal(r, ctx, "FSDP backward and step", rc);
        goto done;
    }
    fu_ck(r, grads_f32_finite(&params, why, sizeof why),
          "CORE-P02: the sharded gradients are stored in the parameters' dtype (f32) and are "
          "finite",
          "%s", why);
    fu_ck(r, all_f32(&params, why, sizeof why),
          "CORE-P02: the parameters the optimizer steps stay f32 (full precision)", "%s", why);
    rc = fu_state_round_trip(root);
    fu_ck(r, rc == 0, "CORE-P02: the state round trip (save_model) completes", "%s (%s)",
          fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
done:
    fsdp_tensor_release(in);
    fsdp_tensor_release(h_in);
    fsdp_tensor_release(loss);
    fsdp_named_list_free(&params);
    fu_teardown(ctx, m, root, NULL, opt);
    fsdp_module_release(half);
    return rc;
}

/* ---- CORE-PI-01 with an all-None MixedPrecision ---------------------------------------------- */

/* Twins A and B wrapped with the job's all-None config, A0 and B0 without mixed precision; B
 * is changed through its local shard after wrapping and B0 gets the same shard. */
enum { PI_A, PI_B, PI_A0, PI_B0, PI_N };

static int pi_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m[PI_N] = {NULL};
    fsdp_unit_t *root[PI_N] = {NULL};
    fsdp_tensor_t *out[PI_N] = {NULL};
    fsdp_options_t o_mp, o_none;
    fu_job_options(j, &o_mp);
    o_none = o_mp;
    fsdp_mixed_precision_init(&o_none.mixed_precision);
    int rc = FSDP_OK;
    for (int i = 0; i < PI_N && rc == 0; i++) {
        if ((rc = tm_transformer_create(ctx, true, true, &m[i])) < 0)
            fu_fatal(r, ctx, "building TransformerWithSharedParams", rc);
        else if ((rc = fu_wrap_transformer_opts(m[i], i < PI_A0 ? &o_mp : &o_none, &root[i])) < 0)
            fu_fatal(r, ctx, "wrapping TransformerWithSharedParams", rc);
    }
    if (rc < 0) goto done;
    if ((rc = fu_change_root_shard(r, ctx, m[PI_B], root[PI_B], j->orig, 11)) != 0) {
        rc = rc > 0 ? FSDP_OK : rc;
        goto done;
    }
    /* The whole local shard, so the use_orig_params write (a view into it) is copied too. */
    fsdp_tensor_t *fb = fsdp_unit_flat_param(root[PI_B]), *fb0 = fsdp_unit_flat_param(root[PI_B0]);
    FU_TRY(done, "copying B's local shard into B0's", fsdp_tensor_copy_(fb0, fb));
    for (int i = 0; i < PI_N; i++)
        FU_TRY(done, "forward", fu_transformer_forward(ctx, m[i], &out[i], NULL));
    fu_ck(r,
          fsdp_tensor_dtype(out[PI_A]) == FSDP_DTYPE_F32 &&
              fsdp_tensor_dtype(out[PI_B]) == FSDP_DTYPE_F32,
          "all-None mixed precision: the outputs are f32", "%s and %s",
          fsdp_dtype_name(fsdp_tensor_dtype(out[PI_A])),
          fsdp_dtype_name(fsdp_tensor_dtype(out[PI_B])));
    int same = fu_same_bits(out[PI_A], out[PI_A0]);
    fu_ck(r, same == 1,
          "all-None mixed precision: an unchanged twin's output is bitwise that of a twin wrapped "
          "without mixed precision",
          "same_bits returned %d", same);
    same = fu_same_bits(out[PI_B], out[PI_B0]);
    fu_ck(r, same == 1,
          "all-None mixed precision: the changed twin's output is bitwise that of a twin without "
          "mixed precision given the same shard",
          "same_bits returned %d", same);
    double cl = fu_tensor_closeness(out[PI_B], out[PI_A], FU_F32_RTOL, FU_F32_ATOL);
    fu_ck(r, cl > 1.0,
          j->orig ? "CORE-PI-01 (all-None mixed precision, use_orig_params): a write into an "
                    "original parameter's shard view reaches the next forward"
                  : "CORE-PI-01 (all-None mixed precision): a write into the root's flat "
                    "parameter (local shard) reaches the next forward",
          "new_output did not reflect change to param after init (outputs within fp32 tolerance: "
          "worst %.3g of tolerance)",
          cl);
done:
    for (int i = 0; i < PI_N; i++)
        fsdp_tensor_release(out[i]);
    fsdp_tape_clear(ctx);
    for (int i = 0; i < PI_N; i++) {
        fsdp_unit_destroy(root[i]);
        fsdp_module_release(m[i]);
    }
    return rc;
}

/* ---- CORE-H03 with an all-None MixedPrecision ------------------------------------------------ */

/* The first half of a training step of a wrapped TransformerWithSharedParams: zero the
 * gradients, forward, loss (*lossp, a new reference; *loss_v its value, *loss_dt its dtype). */
static int forward_loss(fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_optim_t *opt, double *loss_v,
                        fsdp_dtype_t *loss_dt, fsdp_tensor_t **lossp) {
    fsdp_tensor_t *out = NULL, *tgt = NULL;
    fsdp_optim_zero_grad(opt, true);
    int rc = fu_transformer_forward(ctx, m, &out, &tgt);
    if (rc == 0) rc = tm_transformer_loss(tgt, out, lossp);
    if (rc == 0) rc = fsdp_tensor_item(*lossp, 0, loss_v);
    if (rc == 0) *loss_dt = fsdp_tensor_dtype(*lossp);
    fsdp_tensor_release(out);
    fsdp_tensor_release(tgt);
    return rc;
}

/* Unit i of x and of y have the same counters, bitwise the same local shard and the same
 * sharded gradient; otherwise false with the offenders in why. */
static bool units_match(fsdp_unit_t *const *x, fsdp_unit_t *const *y, size_t n, char *why,
                        size_t len) {
    bool ok = true;
    why[0] = 0;
    for (size_t i = 0; i < n; i++) {
        fsdp_unit_stats_t a, b;
        fsdp_unit_get_stats(x[i], &a);
        fsdp_unit_get_stats(y[i], &b);
        if (memcmp(&a, &b, sizeof a) != 0) {
            fu_add_why(
                why, len,
                "unit '%s': counters differ (all-gathers %llu/%llu, reduce-scatters "
                "%llu/%llu, pre-backward %llu/%llu, post-backward %llu/%llu)",
                fsdp_unit_fqn(x[i]), (unsigned long long)a.all_gathers,
                (unsigned long long)b.all_gathers, (unsigned long long)a.reduce_scatters,
                (unsigned long long)b.reduce_scatters, (unsigned long long)a.pre_backward_hooks,
                (unsigned long long)b.pre_backward_hooks, (unsigned long long)a.post_backward_hooks,
                (unsigned long long)b.post_backward_hooks);
            ok = false;
        }
        fsdp_tensor_t *fx = fsdp_unit_flat_param(x[i]), *fy = fsdp_unit_flat_param(y[i]);
        if (!fx || !fy) continue;
        int s = fu_same_bits(fx, fy);
        fsdp_tensor_t *gx = fsdp_tensor_grad(fx), *gy = fsdp_tensor_grad(fy);
        int g = gx && gy ? fu_same_bits(gx, gy) : (!gx && !gy);
        if (s != 1 || g != 1 || fsdp_tensor_dtype(fx) != FSDP_DTYPE_F32) {
            fu_add_why(why, len, "unit '%s': shard %s (%s), sharded gradient %s",
                       fsdp_unit_fqn(x[i]), s == 1 ? "same" : "differs",
                       fsdp_dtype_name(fsdp_tensor_dtype(fx)), g == 1 ? "same" : "differs");
            ok = false;
        }
    }
    return ok;
}

/* Twins X (the job's all-None config) and Y (no mixed precision) trained side by side. */
static int h03_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *mx = NULL, *my = NULL;
    fsdp_unit_t *rx = NULL, *ry = NULL, **ux = NULL, **uy = NULL;
    fsdp_optim_t *ox = NULL, *oy = NULL;
    fsdp_tensor_t *lx = NULL, *ly = NULL;
    size_t nx = 0, ny = 0;
    int post_mult[8];
    char why[760], name[200];
    fsdp_options_t o_mp, o_none;
    fu_job_options(j, &o_mp);
    o_none = o_mp;
    fsdp_mixed_precision_init(&o_none.mixed_precision);
    int rc;
    FU_TRY(done, "building, wrapping and the optimizers",
           tm_transformer_create(ctx, true, true, &mx));
    FU_TRY(done, "building, wrapping and the optimizers",
           tm_transformer_create(ctx, true, true, &my));
    FU_TRY(done, "building, wrapping and the optimizers", fu_wrap_transformer_opts(mx, &o_mp, &rx));
    FU_TRY(done, "building, wrapping and the optimizers",
           fu_wrap_transformer_opts(my, &o_none, &ry));
    FU_TRY(done, "building, wrapping and the optimizers", fsdp_units(rx, &ux, &nx));
    FU_TRY(done, "building, wrapping and the optimizers", fsdp_units(ry, &uy, &ny));
    FU_TRY(done, "building, wrapping and the optimizers",
           fu_make_fsdp_sgd(ctx, rx, 0.01, 0.9, &ox));
    FU_TRY(done, "building, wrapping and the optimizers",
           fu_make_fsdp_sgd(ctx, ry, 0.01, 0.9, &oy));
    if (!fu_ck(r, nx == 5 && ny == 5, "5 units in each twin", "%zu and %zu units", nx, ny))
        goto done;
    for (size_t i = 0; i < nx; i++)
        post_mult[i] = 1;
    fu_ck(r, fu_counters_are(ux, nx, post_mult, 0, why, sizeof why),
          "CORE-H03 (all-None mixed precision): no pre- or post-backward registration before the "
          "first forward",
          "%s", why);
    for (int it = 1; it <= 2; it++) {
        double vx = 0, vy = 0;
        fsdp_dtype_t dx = FSDP_DTYPE_F32, dy = FSDP_DTYPE_F32;
        FU_TRY(done, "forward (all-None mixed precision)",
               forward_loss(ctx, mx, ox, &vx, &dx, &lx));
        snprintf(name, sizeof name,
                 "CORE-H03 (all-None mixed precision): after forward %d every unit registered "
                 "pre- and post-backward %d times",
                 it, it);
        fu_ck(r, fu_counters_are(ux, nx, post_mult, (uint64_t)it, why, sizeof why), name, "%s",
              why);
        FU_TRY(done, "backward and step (all-None mixed precision)", fsdp_backward(lx, NULL));
        FU_TRY(done, "backward and step (all-None mixed precision)", fsdp_optim_step(ox));
        FU_TRY(done, "step without mixed precision", forward_loss(ctx, my, oy, &vy, &dy, &ly));
        FU_TRY(done, "step without mixed precision", fsdp_backward(ly, NULL));
        FU_TRY(done, "step without mixed precision", fsdp_optim_step(oy));
        snprintf(name, sizeof name,
                 "all-None mixed precision: step %d: the loss is f32 and bitwise the loss "
                 "without mixed precision",
                 it);
        fu_ck(r, dx == FSDP_DTYPE_F32 && memcmp(&vx, &vy, sizeof vx) == 0, name,
              "loss %.17g (%s), without %.17g (%s)", vx, fsdp_dtype_name(dx), vy,
              fsdp_dtype_name(dy));
        snprintf(name, sizeof name,
                 "all-None mixed precision: after step %d every unit's counters, local shard "
                 "(f32) and sharded gradient are bitwise the run without mixed precision's",
                 it);
        fu_ck(r, units_match(ux, uy, nx, why, sizeof why), name, "%s", why);
        snprintf(name, sizeof name, "F19: every unit IDLE after step %d", it);
        fu_ck(r, fu_all_idle(ux, nx, why, sizeof why), name, "%s", why);
        fsdp_tensor_release(lx);
        fsdp_tensor_release(ly);
        lx = ly = NULL;
    }
done:
    fsdp_tensor_release(lx);
    fsdp_tensor_release(ly);
    fu_teardown(ctx, mx, rx, ux, ox);
    fu_teardown(ctx, my, ry, uy, oy);
    return rc;
}

/* ---- CORE-NG-01 with f16 parameters ---------------------------------------------------------- */

/* Every floating buffer of m is f16 (buffer_dtype); otherwise false with the first offender. */
static bool buffers_f16(fsdp_module_t *m, char *why, size_t len) {
    fsdp_named_list_t b = {0};
    if (fsdp_module_named_buffers(m, false, &b) < 0) {
        snprintf(why, len, "fsdp_module_named_buffers failed");
        return false;
    }
    bool ok = true, any = false;
    for (size_t i = 0; i < b.n && ok; i++) {
        fsdp_dtype_t dt = fsdp_tensor_dtype(b.tensors[i]);
        if (!fsdp_dtype_is_float(dt)) continue;
        any = true;
        if (dt != FSDP_DTYPE_F16) {
            snprintf(why, len, "buffer '%s' is %s", b.names[i], fsdp_dtype_name(dt));
            ok = false;
        }
    }
    if (ok && !any) {
        snprintf(why, len, "no floating buffer");
        ok = false;
    }
    fsdp_named_list_free(&b);
    return ok;
}

static int ng_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL, **u = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_named_list_t params = {0};
    fsdp_tensor_t *loss = NULL, *ng = NULL, *ev = NULL;
    size_t n = 0;
    int post_mult[8];
    char why[760];
    int rc;
    /* Not deterministic: training mode, so dropout is active (seeded alike on every rank). */
    if ((rc = fu_transformer_setup(r, ctx, j, false, &m, &root, &u, &n, &opt)) < 0) goto done;
    FU_TRY(done, "fsdp_named_params", fsdp_named_params(root, &params));
    if (!fu_ck(r, n == 5, "5 units", "%zu units", n)) goto done;
    for (size_t i = 0; i < n; i++)
        post_mult[i] = 1;
    fu_ck(r, fsdp_module_is_training(m), "the model trains with dropout", "it is in eval mode");

    /* One training step, with upstream's harness checks on the loss dtype. */
    double lv = 0;
    fsdp_dtype_t ldt = FSDP_DTYPE_F32;
    FU_TRY(done, "training step", forward_loss(ctx, m, opt, &lv, &ldt, &loss));
    FU_TRY(done, "training step", fsdp_backward(loss, NULL));
    FU_TRY(done, "training step", fsdp_optim_step(opt));
    fsdp_tensor_release(loss);
    loss = NULL;
    fu_ck(r, ldt == FSDP_DTYPE_F16 && isfinite(lv), "fp16: the training loss is f16 and finite",
          "%s, %g", fsdp_dtype_name(ldt), lv);
    fu_ck(r, grads_f32_finite(&params, why, sizeof why),
          "fp16: the sharded gradients are f32 (the parameters' dtype) and finite", "%s", why);
    fu_ck(r, buffers_f16(m, why, sizeof why), "fp16: every floating buffer is f16 (buffer_dtype)",
          "%s", why);
    fu_ck(r, fu_all_idle(u, n, why, sizeof why), "F19: every unit IDLE after the step", "%s", why);

    fsdp_module_train(m, false);
    size_t tape0 = fsdp_tape_size(ctx);
    FU_TRY(done, "no-grad forward", fu_no_grad_forward(ctx, m, &ng));
    fu_ck(r, tape0 == 0 && fsdp_tape_size(ctx) == 0,
          "CORE-NG-01 (fp16): a no-grad forward records nothing on the tape",
          "tape size %zu before, %zu after", tape0, fsdp_tape_size(ctx));
    fu_ck(r, !fsdp_tensor_requires_grad(ng) && fsdp_tensor_dtype(ng) == FSDP_DTYPE_F16,
          "CORE-NG-01 (fp16): the no-grad output is f16 and requires no gradient",
          "requires grad %d, %s", fsdp_tensor_requires_grad(ng),
          fsdp_dtype_name(fsdp_tensor_dtype(ng)));
    fu_ck(r, fu_none_unsharded(u, n, why, sizeof why),
          "CORE-NG-01 (fp16): after a no-grad forward no unit (root included) is unsharded", "%s",
          why);
    fu_ck(r, fu_counters_are(u, n, post_mult, 1, why, sizeof why),
          "CORE-NG-01 (fp16): a no-grad forward registers no backward hooks", "%s", why);

    /* Eval mode with grad on: upstream's reference output. */
    FU_TRY(done, "eval forward", fu_transformer_forward(ctx, m, &ev, NULL));
    fu_ck(r, fsdp_tensor_requires_grad(ev) && fsdp_tensor_dtype(ev) == FSDP_DTYPE_F16,
          "control: the eval forward with grad on recorded its graph and is f16",
          "requires grad %d, %s", fsdp_tensor_requires_grad(ev),
          fsdp_dtype_name(fsdp_tensor_dtype(ev)));
    double cl = fu_tensor_closeness(ng, ev, FU_F16_RTOL, FU_F16_ATOL);
    fu_ck(r, cl >= 0 && cl <= 1.0,
          "CORE-NG-01 (fp16): eval forward and no-grad forward agree within fp16 tolerance "
          "(rtol 1e-3, atol 1e-5)",
          "worst element %.3g of fp16 tolerance (-1: not comparable); bitwise equal: %d", cl,
          fu_same_bits(ng, ev));
    fu_ck(r, fu_all_idle(u, n, why, sizeof why),
          "CORE-NG-01 (fp16): every unit IDLE after the eval forward", "%s", why);
done:
    fsdp_tensor_release(loss);
    fsdp_tensor_release(ng);
    fsdp_tensor_release(ev);
    fsdp_named_list_free(&params);
    fu_teardown(ctx, m, root, u, opt);
    return rc;
}

/* ---- main ------------------------------------------------------------------------------------ */

int main(void) {
    tap_plan_lazy();
    /* CORE-P02: one iteration, the whole instance and subtest matrix at W=2 and a part of it
     * (backward prefetch PRE, no forward prefetch) at W=3. */
    for (int w = 2; w <= 3; w++)
        for (int off = 0; off < 2; off++)
            for (int s = 0; s < 3; s++)
                for (int b = 0; b < 3; b++)
                    for (int fp = 0; fp < 2; fp++)
                        for (int orig = 0; orig < 2; orig++) {
                            if (w == 3 && (b != 1 || fp)) continue;
                            char prefix[160];
                            snprintf(prefix, sizeof prefix,
                                     "CORE-P02 NestedWrappedModule %s offload=%d bwd_prefetch=%s "
                                     "fwd_prefetch=%d use_orig_params=%d mixed_precision(f16, "
                                     "f16, f16)",
                                     fsdp_sharding_strategy_name(fu_strategies[s]), off,
                                     fsdp_backward_prefetch_name(fu_bwd_prefetches[b]), fp, orig);
                            fu_job_t *j = fu_job_new(prefix, w, fu_strategies[s], orig);
                            j->bp = fu_bwd_prefetches[b];
                            j->fwd_prefetch = fp;
                            j->offload = off;
                            mp_f16(&j->mp);
                            fu_run_job(j, p02_rank);
                            free(j);
                        }
    for (int w = 2; w <= 3; w++) {
        for (int orig = 0; orig < 2; orig++) {
            fu_job_t *j = fu_job_new(orig ? "CORE-PI-01 all-None MixedPrecision FULL_SHARD "
                                            "use_orig_params"
                                          : "CORE-PI-01 all-None MixedPrecision FULL_SHARD",
                                     w, FSDP_FULL_SHARD, orig);
            mp_all_none(&j->mp);
            fu_run_job(j, pi_rank);
            free(j);
        }
        fu_job_t *j = fu_job_new("CORE-H03 all-None MixedPrecision TransformerWithSharedParams "
                                 "FULL_SHARD",
                                 w, FSDP_FULL_SHARD, false);
        mp_all_none(&j->mp);
        fu_run_job(j, h03_rank);
        free(j);
        j = fu_job_new("CORE-NG-01 MixedPrecision(f16, f16, f16) TransformerWithSharedParams "
                       "FULL_SHARD",
                       w, FSDP_FULL_SHARD, false);
        mp_f16(&j->mp);
        fu_run_job(j, ng_rank);
        free(j);
    }
    return tap_done();
}
