/* SPDX-License-Identifier: MIT */
/*
 * t_mp_inputs.c: mixed precision at a unit's inputs (spec section 6, seed 003):
 *   MP-S03..S06  TransformerWithSharedParams (integer token inputs) under one FSDP unit with
 *                MixedPrecision reduce-only f16 (S03), param + buffer f16 (S04), all f16 (S05),
 *                param f16 + reduce f32 + buffer f16 (S06), FULL_SHARD at W = 1, 2, 4: the
 *                integer inputs reach the model uncast (a forward pre-hook records them), the
 *                loss has param_dtype (f32 when unset), and 6 SGD steps (lr 0.1) follow a local
 *                reference that applies the same casts by hand (parameters and floating buffers
 *                in param_dtype, the gradient rounded to reduce_dtype before it reaches the f32
 *                masters): losses and final parameters within fp16 tolerance. The reduce dtype
 *                is read off the group's byte counters (one reduce-scatter of padded_numel
 *                elements of reduce_dtype per step; an f16 one moves half the bytes of an f32
 *                one) and the all-gather's off param_dtype; at W=1, where nothing is
 *                communicated, S03's f16 reduction shows in the gradient's values (every one an
 *                f16 value);
 *   MP-S14       Linear(D, D, no bias) under MixedPrecision(param f16, reduce f32, buffer f32),
 *                3 strategies x use_orig_params at W = 1, 2, 4: an f32 input that requires grad
 *                gets its gradient back in f32, equal to a reference that casts by hand, and the
 *                sharded weight gradient equals the reference's f32 reduction of every rank's
 *                f16 gradient;
 *   kernel       fsdp_linear and fsdp_matmul refuse operands of different dtypes with PyTorch's
 *                message, record nothing and return no output.
 * Per-unit precision (MP-DP-01..06) and ignored modules (MP-IG-01) are in t_mp_dp_inputs.c.
 *
 * Tolerances (spec section 0): fp32 rtol 1.3e-6 atol 1e-5; fp16 rtol 1e-3 atol 1e-5. Every rank
 * records its checks and fu_run_job() prints one TAP line per check (fsdp_util.h).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "models/models.h"
#include "mp_inputs_util.h"
#include "tap.h"

/* ---- kernel checks --------------------------------------------------------------------------- */

static int kernel_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    const int64_t sx[2] = {2, 3}, sw[2] = {4, 3}, sb[1] = {4};
    fsdp_tensor_t *x32 = NULL, *x16 = NULL, *w32 = NULL, *w16 = NULL, *b16 = NULL, *y = NULL;
    fsdp_tensor_t *wt32 = NULL;
    int rc;
    FU_TRY(done, "setting up",
           fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 2, sx, 0.5, FSDP_MEM_ACTIVATIONS, &x32));
    FU_TRY(done, "setting up",
           fsdp_tensor_full(ctx, FSDP_DTYPE_F16, 2, sx, 0.5, FSDP_MEM_ACTIVATIONS, &x16));
    FU_TRY(done, "setting up",
           fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 2, sw, 0.25, FSDP_MEM_ACTIVATIONS, &w32));
    FU_TRY(done, "setting up",
           fsdp_tensor_full(ctx, FSDP_DTYPE_F16, 2, sw, 0.25, FSDP_MEM_ACTIVATIONS, &w16));
    FU_TRY(done, "setting up",
           fsdp_tensor_full(ctx, FSDP_DTYPE_F16, 1, sb, 1.0, FSDP_MEM_ACTIVATIONS, &b16));
    FU_TRY(done, "setting up", fsdp_tensor_set_requires_grad(w32, true));
    FU_TRY(done, "setting up", fsdp_transpose(w32, 0, 1, &wt32));
    size_t tape0 = fsdp_tape_size(ctx);
    y = (fsdp_tensor_t *)1;
    rc = fsdp_linear(x16, w32, NULL, &y);
    fu_ck(r, dtype_error(rc, fsdp_ctx_last_error(ctx), true) && !y,
          "MP-DP-03 kernel: linear(x f16, w f32) is EINVAL \"" MAT_PHRASE "\" with no output",
          "rc %s, out %p, message \"%s\"", fsdp_err_name(rc), (void *)y, fsdp_ctx_last_error(ctx));
    fu_ck(r, fsdp_tape_size(ctx) == tape0, "kernel: the refused linear recorded nothing",
          "tape %zu -> %zu", tape0, fsdp_tape_size(ctx));
    rc = fsdp_linear(x32, w16, NULL, &y);
    fu_ck(r, dtype_error(rc, fsdp_ctx_last_error(ctx), true) && !y,
          "kernel: linear(x f32, w f16) is EINVAL \"" MAT_PHRASE "\"", "rc %s, message \"%s\"",
          fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
    rc = fsdp_linear(x16, w16, b16, &y);
    fu_ck(r, rc == 0 && y && fsdp_tensor_dtype(y) == FSDP_DTYPE_F16,
          "kernel: linear(x f16, w f16, b f16) runs and is f16 (control)", "rc %s (%s)",
          fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
    double v = 0;
    if (y) fsdp_tensor_item(y, 0, &v);
    fu_ck(r, v == 0.5 * 0.25 * 3 + 1.0, "kernel: the f16 control's value is 1.375", "got %.9g", v);
    fsdp_tensor_release(y);
    y = NULL;
    const int64_t sb32[1] = {4};
    fsdp_tensor_t *b32 = NULL;
    FU_TRY(done, "setting up",
           fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 1, sb32, 1.0, FSDP_MEM_ACTIVATIONS, &b32));
    rc = fsdp_linear(x16, w16, b32, &y);
    fsdp_tensor_release(b32);
    fu_ck(r, dtype_error(rc, fsdp_ctx_last_error(ctx), false) && !y,
          "kernel: linear(x f16, w f16, b f32) is EINVAL \"" DTYPE_PHRASE "\" with no output",
          "rc %s, message \"%s\"", fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
    tape0 = fsdp_tape_size(ctx);
    rc = fsdp_matmul(x16, wt32, &y);
    const char *msg = fsdp_ctx_last_error(ctx);
    fu_ck(r,
          rc == FSDP_EINVAL && !y && strstr(msg, MAT_PHRASE) && strstr(msg, "matmul") &&
              fsdp_tape_size(ctx) == tape0,
          "kernel: matmul(a f16, b f32) is EINVAL \"" MAT_PHRASE "\", records nothing",
          "rc %s, message \"%s\"", fsdp_err_name(rc), msg);
    rc = FSDP_OK;
done:
    fsdp_tensor_release(x32);
    fsdp_tensor_release(x16);
    fsdp_tensor_release(w32);
    fsdp_tensor_release(w16);
    fsdp_tensor_release(b16);
    fsdp_tensor_release(wt32);
    fsdp_tape_clear(ctx);
    return rc;
}

/* ---- MP-S03..S06 ----------------------------------------------------------------------------- */

#define EMB_STEPS 6
#define EMB_LR 0.1

typedef struct emb_job {
    fu_job_t j; /* first */
    const char *id;
} emb_job_t;

/* x rounded to dt (f16 or f32). */
static float round_to(float x, fsdp_dtype_t dt) {
    return dt == FSDP_DTYPE_F16 ? fsdp_f16_to_f32(fsdp_f32_to_f16(x)) : x;
}

/* The f32 gradient FSDP stores when every one of `world` ranks has the compute gradient g:
 * g in the reduce dtype, pre-divided there, summed in f32 in rank order and rounded to the
 * reduce dtype (the sim's reduction), post-divided there, widened to f32. Mimicking each
 * rounding matters: a pre-divided f16 subnormal loses its last bit, and over the steps such
 * differences in the masters flip f16 roundings of the weights. */
static int reduced_grad(const fsdp_tensor_t *g, fsdp_dtype_t rdt, int world, fsdp_tensor_t **out) {
    double pre, post;
    divide_factors(world, &pre, &post);
    int64_t n = 0;
    float *v = fu_host_f32(g, &n);
    if (!v) return FSDP_ENOMEM;
    for (int64_t k = 0; k < n; k++) {
        float x = round_to(round_to(v[k], rdt) / (float)pre, rdt), acc = x;
        for (int q = 1; q < world; q++)
            acc += x;
        v[k] = round_to(round_to(acc, rdt) / (float)post, rdt);
    }
    int rc = fsdp_tensor_from_host(fsdp_tensor_ctx(g), FSDP_DTYPE_F32, fsdp_tensor_ndim(g),
                                   fsdp_tensor_shape(g), v, FSDP_MEM_GRADS, out);
    free(v);
    return rc;
}

/* One reference step: masters -> the compute model (param dtype), forward, backward, the
 * compute model's gradients reduced as FSDP does (reduced_grad) into the masters' .grad, SGD. */
static int ref_step(fsdp_ctx_t *ctx, int world, fsdp_module_t *master, fsdp_module_t *comp,
                    fsdp_optim_t *opt, fsdp_dtype_t rdt, double *loss_v) {
    fsdp_named_list_t mp = {0}, cp = {0};
    fsdp_tensor_t *src = NULL, *tgt = NULL, *out = NULL, *loss = NULL;
    int rc;
    if ((rc = fsdp_module_named_params(master, false, &mp)) < 0) goto done;
    if ((rc = fsdp_module_named_params(comp, false, &cp)) < 0) goto done;
    if (mp.n != cp.n) {
        rc = FSDP_EINTERNAL;
        goto done;
    }
    for (size_t i = 0; i < mp.n && rc == 0; i++) {
        rc = fsdp_tensor_copy_(cp.tensors[i], mp.tensors[i]);
        if (rc == 0) rc = fsdp_tensor_zero_grad(cp.tensors[i], true);
    }
    if (rc < 0) goto done;
    if ((rc = tm_transformer_get_input(ctx, &src, &tgt)) < 0) goto done;
    if ((rc = tm_transformer_forward(comp, src, tgt, &out)) < 0) goto done;
    if ((rc = tm_transformer_loss(tgt, out, &loss)) < 0) goto done;
    if ((rc = fsdp_tensor_item(loss, 0, loss_v)) < 0) goto done;
    if ((rc = fsdp_backward(loss, NULL)) < 0) goto done;
    for (size_t i = 0; i < mp.n && rc == 0; i++) {
        fsdp_tensor_t *g = fsdp_tensor_grad(cp.tensors[i]), *gf = NULL;
        if (!g) {
            rc = fsdp_tensor_zero_grad(mp.tensors[i], true);
            continue;
        }
        rc = reduced_grad(g, rdt, world, &gf);
        if (rc == 0) rc = fsdp_tensor_set_grad(mp.tensors[i], gf);
        fsdp_tensor_release(gf);
    }
    if (rc == 0) rc = fsdp_optim_step(opt);
done:
    fsdp_tensor_release(src);
    fsdp_tensor_release(tgt);
    fsdp_tensor_release(out);
    fsdp_tensor_release(loss);
    fsdp_named_list_free(&mp);
    fsdp_named_list_free(&cp);
    return rc;
}

/* Every element of t is an f16 value (a round trip through f16 changes nothing). */
static bool all_f16_values(const fsdp_tensor_t *t) {
    int64_t n = 0;
    float *v = fu_host_f32(t, &n);
    bool ok = v != NULL;
    for (int64_t i = 0; ok && i < n; i++)
        ok = fsdp_f16_to_f32(fsdp_f32_to_f16(v[i])) == v[i];
    free(v);
    return ok;
}

static int emb_rank(fsdp_ctx_t *ctx, void *arg) {
    emb_job_t *ej = arg;
    fu_job_t *j = &ej->j;
    fu_res_t *r = fu_res_of(j, ctx);
    const fsdp_mixed_precision_t *mp = &j->mp;
    fsdp_dtype_t pdt = mp->param_dtype == FSDP_MP_UNSET ? FSDP_DTYPE_F32 : mp->param_dtype;
    fsdp_dtype_t rdt = mp->reduce_dtype == FSDP_MP_UNSET ? pdt : mp->reduce_dtype;
    fsdp_dtype_t bdt = mp->buffer_dtype == FSDP_MP_UNSET ? FSDP_DTYPE_F32 : mp->buffer_dtype;
    fsdp_module_t *m = NULL, *master = NULL, *comp = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_optim_t *opt = NULL, *ref_opt = NULL;
    fsdp_named_list_t params = {0}, mparams = {0};
    fsdp_tensor_t *out = NULL, *tgt = NULL, *loss = NULL;
    seen_t in_root;
    char name[200], why[760];
    fsdp_options_t o;
    fu_job_options(j, &o);
    int rc;
    FU_TRY(done, "building", tm_transformer_create(ctx, true, true, &m));
    FU_TRY(done, "building the reference", tm_transformer_create(ctx, true, true, &master));
    FU_TRY(done, "building the reference", tm_transformer_create(ctx, true, true, &comp));
    FU_TRY(done, "building the reference", params_to(comp, pdt));
    FU_TRY(done, "building the reference", buffers_to(comp, bdt));
    /* One top-level unit (NO_FSDP model under FSDP(mixed_precision=cfg)), as the seed. */
    FU_TRY(done, "wrapping", fsdp_wrap(m, &o, &root));
    FU_TRY(done, "watching the root's inputs", watch(m, &in_root));
    FU_TRY(done, "optimizers", fsdp_named_params(root, &params));
    FU_TRY(done, "optimizers", fu_make_sgd(ctx, &params, EMB_LR, 0.0, &opt));
    FU_TRY(done, "optimizers", fsdp_module_named_params(master, false, &mparams));
    FU_TRY(done, "optimizers", fu_make_sgd(ctx, &mparams, EMB_LR, 0.0, &ref_opt));
    fsdp_pg_t *pg = fsdp_unit_pg(root);
    fsdp_flat_sizes_t fs;
    fsdp_unit_flat_sizes(root, &fs);
    const uint64_t pn = (uint64_t)fs.padded_numel;
    char gwhy[760] = "";
    bool grad_ok = true;
    bool ints = true, ldt_ok = true, loss_ok = true, ag_ok = true, rs_ok = true, f16g = true;
    double first = 0, last = 0;
    why[0] = 0;
    for (int it = 0; it < EMB_STEPS; it++) {
        double lv = 0, rv = 0;
        fsdp_pg_counters_t c0, c1, c2;
        fsdp_optim_zero_grad(opt, true);
        fsdp_pg_get_counters(pg, &c0);
        FU_TRY(done, "FSDP forward", fu_transformer_forward(ctx, m, &out, &tgt));
        fsdp_pg_get_counters(pg, &c1);
        FU_TRY(done, "FSDP loss", tm_transformer_loss(tgt, out, &loss));
        FU_TRY(done, "FSDP loss", fsdp_tensor_item(loss, 0, &lv));
        ints &= saw(&in_root, 0, FSDP_DTYPE_I64) && saw(&in_root, 1, FSDP_DTYPE_I64);
        if (fsdp_tensor_dtype(loss) != pdt && ldt_ok) {
            ldt_ok = false;
            fu_add_why(why, sizeof why, "step %d: the loss is %s", it,
                       fsdp_dtype_name(fsdp_tensor_dtype(loss)));
        }
        FU_TRY(done, "FSDP backward", fsdp_backward(loss, NULL));
        fsdp_pg_get_counters(pg, &c2);
        FU_TRY(done, "FSDP step", fsdp_optim_step(opt));
        FU_TRY(done, "reference step", ref_step(ctx, j->world, master, comp, ref_opt, rdt, &rv));
        {
            char w2[760];
            double gc = fu_shards_vs(root, NULL, true, fu_ref_grad, master, FU_F16_RTOL,
                                     FU_F16_ATOL, w2, sizeof w2);
            if (!(gc <= 1.0) && grad_ok) {
                grad_ok = false;
                fu_add_why(gwhy, sizeof gwhy, "step %d: worst %.3g of tolerance: %s", it, gc, w2);
            }
        }
        if (it == 0) first = lv;
        last = lv;
        double cl = fu_closeness(lv, rv, FU_F16_RTOL, FU_F16_ATOL);
        if (!(cl <= 1.0) && loss_ok) {
            loss_ok = false;
            fu_add_why(why, sizeof why, "step %d: loss %.9g, reference %.9g", it, lv, rv);
        }
        /* The first forward also runs the execution-order check's small all-gathers. */
        uint64_t ag_calls = c1.calls[FSDP_COLL_ALL_GATHER] - c0.calls[FSDP_COLL_ALL_GATHER];
        uint64_t ag_bytes = c1.bytes[FSDP_COLL_ALL_GATHER] - c0.bytes[FSDP_COLL_ALL_GATHER];
        uint64_t rs_calls = c2.calls[FSDP_COLL_REDUCE_SCATTER] - c1.calls[FSDP_COLL_REDUCE_SCATTER];
        uint64_t rs_bytes = c2.bytes[FSDP_COLL_REDUCE_SCATTER] - c1.bytes[FSDP_COLL_REDUCE_SCATTER];
        uint64_t ar_calls = c2.calls[FSDP_COLL_ALL_REDUCE] - c1.calls[FSDP_COLL_ALL_REDUCE];
        if (j->world > 1) {
            if (it > 0 && (ag_calls != 1 || ag_bytes != pn * fsdp_dtype_size(pdt)) && ag_ok) {
                ag_ok = false;
                fu_add_why(why, sizeof why,
                           "step %d: %llu all-gathers of %llu bytes, want 1 of %llu (%s)", it,
                           (unsigned long long)ag_calls, (unsigned long long)ag_bytes,
                           (unsigned long long)(pn * fsdp_dtype_size(pdt)), fsdp_dtype_name(pdt));
            }
            if ((rs_calls != 1 || rs_bytes != pn * fsdp_dtype_size(rdt)) && rs_ok) {
                rs_ok = false;
                fu_add_why(why, sizeof why,
                           "step %d: %llu reduce-scatters of %llu bytes, want 1 of %llu (%s)", it,
                           (unsigned long long)rs_calls, (unsigned long long)rs_bytes,
                           (unsigned long long)(pn * fsdp_dtype_size(rdt)), fsdp_dtype_name(rdt));
            }
        } else if ((ag_calls | rs_calls | ar_calls) != 0 && rs_ok) {
            rs_ok = false;
            fu_add_why(why, sizeof why, "step %d: W=1 communicated (%llu %llu %llu calls)", it,
                       (unsigned long long)ag_calls, (unsigned long long)rs_calls,
                       (unsigned long long)ar_calls);
        }
        fsdp_tensor_t *g = fsdp_tensor_grad(fsdp_unit_flat_param(root));
        if (rdt == FSDP_DTYPE_F16 && (!g || !all_f16_values(g))) f16g = false;
        fsdp_tensor_release(out);
        fsdp_tensor_release(tgt);
        fsdp_tensor_release(loss);
        out = tgt = loss = NULL;
    }
    snprintf(name, sizeof name,
             "%s: the integer token inputs reach the model uncast (i64 and i64 seen by a pre-hook "
             "after FSDP's) on all %d steps",
             ej->id, EMB_STEPS);
    fu_ck(r, ints && in_root.calls == EMB_STEPS, name, "last seen %s, %s in %d calls",
          dt_name(&in_root, 0), dt_name(&in_root, 1), in_root.calls);
    snprintf(name, sizeof name, "%s: the loss is %s (param_dtype%s) on every step", ej->id,
             fsdp_dtype_name(pdt), mp->param_dtype == FSDP_MP_UNSET ? " unset" : "");
    fu_ck(r, ldt_ok, name, "%s", why);
    snprintf(name, sizeof name,
             "%s: 6 SGD steps (lr 0.1): every loss matches the hand-cast reference within fp16 "
             "tolerance",
             ej->id);
    fu_ck(r, loss_ok, name, "%s", why);
    snprintf(name, sizeof name,
             "%s: on every step this rank's sharded gradient (f32) matches the reference's "
             "gradient rounded to the reduce dtype (fp16 tolerance)",
             ej->id);
    fu_ck(r, grad_ok, name, "%s", gwhy);
    fu_ck(r, fabs(first - last) > 1e-3 * fabs(first), "training moved the loss",
          "first %.9g, last %.9g", first, last);
    double cl = fu_shards_vs(root, NULL, false, fu_ref_param, master, FU_F16_RTOL, FU_F16_ATOL, why,
                             sizeof why);
    snprintf(name, sizeof name,
             "%s: after 6 steps this rank's shard of every parameter (f32) matches the reference "
             "masters within fp16 tolerance",
             ej->id);
    fu_ck(r, cl <= 1.0, name, "worst %.3g of tolerance: %s", cl, why);
    if (j->world > 1) {
        snprintf(name, sizeof name,
                 "%s: each step all-gathers padded_numel %s elements (param_dtype) once", ej->id,
                 fsdp_dtype_name(pdt));
        fu_ck(r, ag_ok, name, "%s", why);
        snprintf(name, sizeof name,
                 "%s: each step reduce-scatters padded_numel %s elements (%s bytes each: the "
                 "reduce dtype) once",
                 ej->id, fsdp_dtype_name(rdt), rdt == FSDP_DTYPE_F16 ? "2" : "4");
        fu_ck(r, rs_ok, name, "%s", why);
    } else {
        fu_ck(r, rs_ok, "W=1: nothing is communicated (NO_SHARD in effect)", "%s", why);
    }
    if (rdt == FSDP_DTYPE_F16) {
        snprintf(name, sizeof name,
                 "%s: every sharded gradient value is an f16 value (reduced in f16, stored in f32)",
                 ej->id);
        fu_ck(r, f16g, name, "a gradient value is not representable in f16");
    }
done:
    fsdp_tensor_release(out);
    fsdp_tensor_release(tgt);
    fsdp_tensor_release(loss);
    fsdp_named_list_free(&params);
    fsdp_named_list_free(&mparams);
    fsdp_optim_destroy(ref_opt);
    fu_teardown(ctx, m, root, NULL, opt);
    fsdp_module_release(master);
    fsdp_module_release(comp);
    return rc;
}

/* ---- MP-S14 ---------------------------------------------------------------------------------- */

#define S14_ROWS 32

typedef struct s14_job {
    fu_job_t j; /* first */
    int64_t d;
} s14_job_t;

static fsdp_tensor_t *expect_tensor(void *arg, const char *fqn) {
    return strcmp(fqn, "weight") == 0 ? arg : NULL;
}

static int s14_rank(fsdp_ctx_t *ctx, void *arg) {
    s14_job_t *sj = arg;
    fu_job_t *j = &sj->j;
    fu_res_t *r = fu_res_of(j, ctx);
    const int64_t d = sj->d;
    const int rank = fsdp_ctx_rank(ctx);
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *x = NULL, *y = NULL, *loss = NULL, *xr = NULL, *xh = NULL, *expect = NULL;
    float *acc = NULL, *gx_ref = NULL;
    int64_t ngx = 0;
    char why[760];
    fsdp_options_t o;
    fu_job_options(j, &o);
    int rc;
    tm_manual_seed(ctx, 0);
    FU_TRY(done, "building", fsdp_linear_create(ctx, d, d, false, &m));
    tm_manual_seed(ctx, 0);
    FU_TRY(done, "building the reference", fsdp_linear_create(ctx, d, d, false, &ref));
    FU_TRY(done, "building the reference", params_to(ref, FSDP_DTYPE_F16));
    FU_TRY(done, "wrapping", fsdp_wrap(m, &o, &root));
    FU_TRY(done, "input", fu_rand_input(ctx, 1 + (uint64_t)rank, S14_ROWS, d, &x));
    FU_TRY(done, "input", fsdp_tensor_set_requires_grad(x, true));
    FU_TRY(done, "FSDP forward", fsdp_module_forward1(m, x, &y));
    fu_ck(r, fsdp_tensor_dtype(y) == FSDP_DTYPE_F16, "MP-S14: the output is f16 (param_dtype)",
          "it is %s", fsdp_dtype_name(fsdp_tensor_dtype(y)));
    FU_TRY(done, "FSDP backward", tm_sum_loss(y, &loss));
    FU_TRY(done, "FSDP backward", fsdp_backward(loss, NULL));
    fsdp_tensor_t *gx = fsdp_tensor_grad(x);
    fu_ck(r, gx && fsdp_tensor_dtype(gx) == FSDP_DTYPE_F32,
          "MP-S14: the f32 input that requires grad gets its gradient, in f32 (through the cast)",
          "grad %s", gx ? fsdp_dtype_name(fsdp_tensor_dtype(gx)) : "none");

    /* The reference: every rank's input cast to f16 by hand through the f16 weights; this
     * rank's input gradient, and the weight gradients summed as the f32 reduction does (each
     * rank's f16 gradient in f32, pre-divided, summed in rank order, post-divided). */
    double pre, post;
    divide_factors(j->world, &pre, &post);
    fsdp_tensor_t *w16 = fsdp_module_param(ref, "weight");
    acc = calloc((size_t)(d * d), sizeof *acc);
    if (!acc) FU_TRY(done, "reference", FSDP_ENOMEM);
    for (int q = 0; q < j->world; q++) {
        FU_TRY(done, "reference", fsdp_tensor_zero_grad(w16, true));
        FU_TRY(done, "reference", fu_rand_input(ctx, 1 + (uint64_t)q, S14_ROWS, d, &xr));
        FU_TRY(done, "reference", fsdp_tensor_set_requires_grad(xr, true));
        FU_TRY(done, "reference", fsdp_to_dtype(xr, FSDP_DTYPE_F16, &xh));
        fsdp_tensor_release(y);
        fsdp_tensor_release(loss);
        y = loss = NULL;
        FU_TRY(done, "reference", fsdp_linear(xh, w16, NULL, &y));
        FU_TRY(done, "reference", tm_sum_loss(y, &loss));
        FU_TRY(done, "reference", fsdp_backward(loss, NULL));
        int64_t n = 0;
        float *g = fu_host_f32(fsdp_tensor_grad(w16), &n);
        if (!g || n != d * d) {
            free(g);
            FU_TRY(done, "reference", FSDP_EINTERNAL);
        }
        for (int64_t k = 0; k < n; k++) {
            float v = (float)(g[k] / pre);
            acc[k] = q == 0 ? v : acc[k] + v;
        }
        free(g);
        if (q == rank) gx_ref = fu_host_f32(fsdp_tensor_grad(xr), &ngx);
        fsdp_tensor_release(xr);
        fsdp_tensor_release(xh);
        xr = xh = NULL;
    }
    for (int64_t k = 0; k < d * d; k++)
        acc[k] = (float)(acc[k] / post);
    double worst = -1;
    if (gx && gx_ref) {
        int64_t n = 0;
        float *a = fu_host_f32(gx, &n);
        worst = a && n == ngx ? 0 : INFINITY;
        for (int64_t k = 0; a && k < n && n == ngx; k++) {
            double c = fu_closeness(a[k], gx_ref[k], FU_F32_RTOL, FU_F32_ATOL);
            if (!(c <= worst)) worst = isnan(c) ? INFINITY : c;
        }
        free(a);
    }
    fu_ck(r, worst >= 0 && worst <= 1.0,
          "MP-S14: the input gradient equals the hand-cast reference's (fp32 tolerance)",
          "worst element %.3g of tolerance", worst);
    const int64_t shape[2] = {d, d};
    FU_TRY(
        done, "reference",
        fsdp_tensor_from_host(ctx, FSDP_DTYPE_F32, 2, shape, acc, FSDP_MEM_ACTIVATIONS, &expect));
    double cl = fu_shards_vs(root, NULL, true, expect_tensor, expect, FU_F32_RTOL, FU_F32_ATOL, why,
                             sizeof why);
    fu_ck(r, cl <= 1.0,
          "MP-S14: the sharded weight gradient (f32) equals every rank's f16 gradient reduced in "
          "f32 (reduce_dtype), fp32 tolerance",
          "worst %.3g of tolerance: %s", cl, why);
done:
    free(acc);
    free(gx_ref);
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(xr);
    fsdp_tensor_release(xh);
    fsdp_tensor_release(expect);
    fu_teardown(ctx, m, root, NULL, NULL);
    fsdp_module_release(ref);
    return rc;
}

/* ---- main ------------------------------------------------------------------------------------ */

static const int worlds[3] = {1, 2, 4};

int main(void) {
    tap_plan_lazy();
    char prefix[160];
    {
        fu_job_t *j = fu_job_new("kernel dtype checks", 1, FSDP_FULL_SHARD, false);
        fu_run_job(j, kernel_rank);
        free(j);
    }
    static const struct {
        const char *id, *what;
        fsdp_dtype_t p, rd, b;
    } cfgs[4] = {
        {"MP-S03", "reduce f16 only", FSDP_MP_UNSET, FSDP_DTYPE_F16, FSDP_MP_UNSET},
        {"MP-S04", "param + buffer f16", FSDP_DTYPE_F16, FSDP_MP_UNSET, FSDP_DTYPE_F16},
        {"MP-S05", "param, reduce, buffer f16", FSDP_DTYPE_F16, FSDP_DTYPE_F16, FSDP_DTYPE_F16},
        {"MP-S06", "param f16, reduce f32, buffer f16", FSDP_DTYPE_F16, FSDP_DTYPE_F32,
         FSDP_DTYPE_F16},
    };
    for (int c = 0; c < 4; c++)
        for (int w = 0; w < 3; w++) {
            emb_job_t *ej = calloc(1, sizeof *ej);
            if (!ej) tap_bail("out of memory");
            snprintf(prefix, sizeof prefix, "%s TransformerWithSharedParams (%s) FULL_SHARD",
                     cfgs[c].id, cfgs[c].what);
            fu_job_init(&ej->j, prefix, worlds[w], FSDP_FULL_SHARD, false);
            mp_init(&ej->j.mp, cfgs[c].p, cfgs[c].rd, cfgs[c].b);
            ej->id = cfgs[c].id;
            fu_run_job(&ej->j, emb_rank);
            free(ej);
        }
    for (int w = 0; w < 3; w++)
        for (int s = 0; s < 3; s++)
            for (int orig = 0; orig < 2; orig++) {
                s14_job_t *sj = calloc(1, sizeof *sj);
                if (!sj) tap_bail("out of memory");
                /* The seed's Linear(1024, 1024) at its world size 2; smaller elsewhere. */
                sj->d = worlds[w] == 2 ? 1024 : 256;
                snprintf(prefix, sizeof prefix,
                         "MP-S14 Linear(%lld, %lld) param f16 reduce f32 %s use_orig_params=%d",
                         (long long)sj->d, (long long)sj->d,
                         fsdp_sharding_strategy_name(fu_strategies[s]), orig);
                fu_job_init(&sj->j, prefix, worlds[w], fu_strategies[s], orig);
                mp_init(&sj->j.mp, FSDP_DTYPE_F16, FSDP_DTYPE_F32, FSDP_DTYPE_F32);
                fu_run_job(&sj->j, s14_rank);
                free(sj);
            }
    return tap_done();
}
