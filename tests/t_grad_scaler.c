/* SPDX-License-Identifier: MIT */
/*
 * t_grad_scaler.c: the sharded gradient scaler (fsdp/grad_scaler.h), feature F44 of MP-S02
 * (spec section 6: "the C scaler must unscale sharded grads, all-reduce a found-inf flag (a max
 * across ranks), skip the step on inf, and update the scale", with an inf injected on one
 * rank's shard).
 *
 * The FSDP jobs run Sequential(3 x Linear(5, 5)) with layer "1" wrapped by hand and then the
 * root (so shards are padded at W=2 and W=4), SGD(lr 0.01, momentum 0.9), at world sizes 1, 2
 * and 4, FULL_SHARD and SHARD_GRAD_OP, with and without use_orig_params. The reference is a
 * twin wrapped alike and trained without the scaler on the same inputs:
 *   scale    the scaled loss is loss * scale exactly, and every sharded gradient equals
 *            scale x the twin's (bitwise: the scale is a power of two); after unscale they
 *            equal the twin's bitwise;
 *   clip     unscale then fsdp_unit_clip_grad_norm gives the twin's norm and clipped gradients
 *            (f32 tolerance rtol 1.3e-6, atol 1e-5), and the steps give its parameters;
 *   skip     an inf (then, in a later iteration, a NaN) written into one element of the LAST
 *            rank's shard gradient: every rank reports found_inf, every rank skips the step, the
 *            scale backs off by backoff_factor, every rank's parameters are bitwise unchanged,
 *            and the next clean iteration steps and matches the twin that never saw the bad
 *            iteration;
 *   growth   with growth_interval 3 the scale doubles after 3 clean steps and the tracker
 *            resets; a state_dict taken mid-run and loaded into a new scaler continues bitwise
 *            like the uninterrupted run (scales, trackers and parameters).
 * MP-S02 (e2e): MixedPrecision(param, reduce, buffer = f16) with the default scaler (init 2^16:
 * the f16 loss overflows when scaled, so the first steps are skipped and the scale backs off,
 * as upstream's runs calibrate) against an f32 run without mixed precision or scaler that took
 * the same number of steps on the same data (mean-square loss, 10 iterations): the loss after
 * every step and every parameter agree within torch's f16 tolerance, rtol 1e-3, atol 1e-5 (the
 * measured worst, printed as a diagnostic, is about 0.6 of it), and both losses decrease.
 * Gradients of other dtypes and the scaler's errors are in t_grad_scaler_dtypes.c.
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

#define DIM 5
#define BATCH 4

static const char *const units_listed[] = {"1", NULL};

/* One side of a comparison: a wrapped model, its flat parameters and SGD over them. */
typedef struct side {
    fsdp_module_t *m;
    fsdp_unit_t *root;
    fsdp_named_list_t params;
    fsdp_optim_t *opt;
} side_t;

static int side_build(fsdp_ctx_t *ctx, const fsdp_options_t *o, side_t *s) {
    memset(s, 0, sizeof *s);
    int rc = fu_linear_stack(ctx, 3, DIM, &s->m);
    if (rc == 0) rc = fu_wrap_listed(s->m, units_listed, o, NULL, NULL);
    if (rc == 0) rc = fsdp_wrap(s->m, o, &s->root);
    if (rc == 0) rc = fsdp_named_params(s->root, &s->params);
    if (rc == 0) rc = fu_make_sgd(ctx, &s->params, 0.01, 0.9, &s->opt);
    return rc;
}

static void side_free(fsdp_ctx_t *ctx, side_t *s) {
    fsdp_named_list_free(&s->params);
    fu_teardown(ctx, s->m, s->root, NULL, s->opt);
    memset(s, 0, sizeof *s);
}

/* Forward on this rank's input of iteration `it` and the loss: the sum of the output, or with
 * mse the mean square of the output (a loss that training decreases). */
static int side_loss(fsdp_ctx_t *ctx, side_t *s, int it, bool mse, fsdp_tensor_t **loss) {
    fsdp_tensor_t *x = NULL, *out = NULL, *zero = NULL;
    *loss = NULL;
    int rc = fu_rand_input(ctx, 1000u + 97u * (uint64_t)it + (uint64_t)fsdp_ctx_rank(ctx), BATCH,
                           DIM, &x);
    if (rc == 0) rc = fsdp_optim_zero_grad(s->opt, true);
    if (rc == 0) rc = fsdp_module_forward1(s->m, x, &out);
    if (rc == 0 && !mse) rc = tm_sum_loss(out, loss);
    if (rc == 0 && mse) {
        const int64_t shape[2] = {BATCH, DIM};
        rc = fsdp_tensor_zeros(ctx, fsdp_tensor_dtype(out), 2, shape, FSDP_MEM_ACTIVATIONS, &zero);
        if (rc == 0) rc = fsdp_mse_loss(out, zero, FSDP_REDUCTION_MEAN, loss);
    }
    fsdp_tensor_release(x);
    fsdp_tensor_release(out);
    fsdp_tensor_release(zero);
    return rc;
}

/* Backward of loss (scaled by sc when sc is not NULL); *lv the unscaled loss. */
static int side_backward(fsdp_grad_scaler_t *sc, fsdp_tensor_t *loss, double *lv,
                         double *scaled_v) {
    fsdp_tensor_t *scaled = NULL;
    int rc = fsdp_tensor_item(loss, 0, lv);
    if (rc == 0 && sc) rc = fsdp_grad_scaler_scale(sc, loss, &scaled);
    if (rc == 0 && scaled && scaled_v) rc = fsdp_tensor_item(scaled, 0, scaled_v);
    if (rc == 0) rc = fsdp_backward(scaled ? scaled : loss, NULL);
    fsdp_tensor_release(scaled);
    return rc;
}

/* Writes v into one element of the first non-empty gradient of l (this rank's shard). Returns
 * 1 when this rank has no non-empty gradient. */
static int poison(const fsdp_named_list_t *l, double v) {
    for (size_t i = 0; i < l->n; i++) {
        fsdp_tensor_t *g = fsdp_tensor_grad(l->tensors[i]);
        int64_t n = g ? fsdp_tensor_numel(g) : 0;
        if (n == 0) continue;
        if (fsdp_tensor_dtype(g) != FSDP_DTYPE_F32) return FSDP_EINVAL;
        float *h = malloc((size_t)n * sizeof *h);
        if (!h) return FSDP_ENOMEM;
        int rc = fsdp_tensor_to_host(g, h, (size_t)n * sizeof *h);
        h[n / 2] = (float)v;
        if (rc == 0) rc = fsdp_tensor_copy_from_host(g, h, (size_t)n * sizeof *h);
        free(h);
        return rc;
    }
    return 1;
}

/* Bitwise equality of two value arrays (NaN-aware: compares the bits). */
static bool same_vals(const fu_vals_t *a, const fu_vals_t *b, char *why, size_t len) {
    if (a->n != b->n) {
        snprintf(why, len, "%zu values vs %zu", a->n, b->n);
        return false;
    }
    for (size_t i = 0; i < a->n; i++)
        if (memcmp(&a->v[i], &b->v[i], sizeof(double)) != 0) {
            snprintf(why, len, "element %zu: %.9g vs %.9g", i, a->v[i], b->v[i]);
            return false;
        }
    return true;
}

/* a[i] * k == b[i] for every i, bitwise. */
static bool scaled_vals(const fu_vals_t *a, double k, const fu_vals_t *b, char *why, size_t len) {
    if (a->n != b->n) {
        snprintf(why, len, "%zu values vs %zu", a->n, b->n);
        return false;
    }
    for (size_t i = 0; i < a->n; i++)
        if (!(a->v[i] == b->v[i] * k)) {
            snprintf(why, len, "element %zu: %.9g vs %g x %.9g", i, a->v[i], k, b->v[i]);
            return false;
        }
    return true;
}

/* Largest fu_closeness over the elements (NaN: INFINITY; size mismatch: INFINITY). */
static double vals_closeness(const fu_vals_t *a, const fu_vals_t *b, double rtol, double atol) {
    if (a->n != b->n) return INFINITY;
    double worst = 0;
    for (size_t i = 0; i < a->n; i++) {
        double c = fu_closeness(a->v[i], b->v[i], rtol, atol);
        if (isnan(c)) c = INFINITY;
        if (c > worst) worst = c;
    }
    return worst;
}

static int make_scaler(fsdp_ctx_t *ctx, double init, int64_t interval, fsdp_grad_scaler_t **s) {
    fsdp_grad_scaler_options_t o;
    fsdp_grad_scaler_options_init(&o);
    if (init > 0) o.init_scale = init;
    if (interval > 0) o.growth_interval = interval;
    return fsdp_grad_scaler_create(ctx, &o, s);
}

/* ---- scale, unscale, clip -------------------------------------------------------------------- */

static int scale_clip_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    side_t a = {0}, b = {0};
    fsdp_grad_scaler_t *sc = NULL;
    fsdp_tensor_t *la = NULL, *lb = NULL;
    fu_vals_t ga = {0}, gb = {0}, pa = {0}, pb = {0};
    char why[400];
    fsdp_options_t o;
    fu_job_options(j, &o);
    int rc;
    FU_TRY(done, "setting up", side_build(ctx, &o, &a));
    FU_TRY(done, "setting up", side_build(ctx, &o, &b));
    FU_TRY(done, "setting up", make_scaler(ctx, 0, 0, &sc));
    fu_ck(r, fsdp_grad_scaler_get_scale(sc) == 65536.0, "F44: the default scale is 2^16", "%g",
          fsdp_grad_scaler_get_scale(sc));

    /* Iteration 0: the scaled backward against the plain one. */
    double lva = 0, lvb = 0, sva = 0;
    FU_TRY(done, "forward", side_loss(ctx, &a, 0, false, &la));
    FU_TRY(done, "scaled backward", side_backward(sc, la, &lva, &sva));
    FU_TRY(done, "forward", side_loss(ctx, &b, 0, false, &lb));
    FU_TRY(done, "backward", side_backward(NULL, lb, &lvb, NULL));
    fu_ck(r, sva == lva * 65536.0 && lva == lvb,
          "F44 scale: the scaled loss is loss x 2^16 exactly (and the loss is the twin's)",
          "scaled %.9g, loss %.9g, twin %.9g", sva, lva, lvb);
    FU_TRY(done, "reading gradients", fu_list_values(&a.params, true, &ga));
    FU_TRY(done, "reading gradients", fu_list_values(&b.params, true, &gb));
    fu_ck(r, scaled_vals(&ga, 65536.0, &gb, why, sizeof why),
          "F44 scale: every sharded gradient is 2^16 x the twin's (bitwise)", "%s", why);
    FU_TRY(done, "unscale", fsdp_grad_scaler_unscale(sc, a.opt));
    fu_ck(r, !fsdp_grad_scaler_found_inf(sc), "F44 unscale: clean gradients: found_inf false",
          "found_inf true");
    FU_TRY(done, "reading gradients", fu_list_values(&a.params, true, &ga));
    fu_ck(r, same_vals(&ga, &gb, why, sizeof why),
          "F44 unscale: the unscaled gradients are bitwise the twin's", "%s", why);

    /* Clip at a norm below the gradients' so that clipping acts. */
    double na = 0, nb = 0;
    FU_TRY(done, "clip", fsdp_unit_clip_grad_norm(a.root, 0.05, 2.0, &na));
    FU_TRY(done, "clip", fsdp_unit_clip_grad_norm(b.root, 0.05, 2.0, &nb));
    fu_ck(r, fu_closeness(na, nb, FU_F32_RTOL, FU_F32_ATOL) <= 1.0 && nb > 0.05,
          "F44 unscale + clip_grad_norm: the total norm is the twin's (f32 tolerance) and above "
          "max_norm",
          "norm %.9g, twin %.9g", na, nb);
    FU_TRY(done, "reading gradients", fu_list_values(&a.params, true, &ga));
    FU_TRY(done, "reading gradients", fu_list_values(&b.params, true, &gb));
    double cl = vals_closeness(&ga, &gb, FU_F32_RTOL, FU_F32_ATOL);
    fu_ck(r, cl <= 1.0,
          "F44 unscale + clip_grad_norm: the clipped gradients are the twin's (rtol 1.3e-6, atol "
          "1e-5)",
          "worst %.3g of tolerance", cl);
    bool stepped = false;
    FU_TRY(done, "step", fsdp_grad_scaler_step(sc, a.opt, &stepped));
    FU_TRY(done, "step", fsdp_optim_step(b.opt));
    FU_TRY(done, "update", fsdp_grad_scaler_update(sc));
    fu_ck(r, stepped, "F44 step after unscale: the step is taken", "skipped");
    FU_TRY(done, "reading parameters", fu_list_values(&a.params, false, &pa));
    FU_TRY(done, "reading parameters", fu_list_values(&b.params, false, &pb));
    cl = vals_closeness(&pa, &pb, FU_F32_RTOL, FU_F32_ATOL);
    fu_ck(r, cl <= 1.0, "F44 step: the parameters are the twin's after the clipped step (f32)",
          "worst %.3g of tolerance", cl);

    /* Iteration 1: step() unscales by itself. */
    fsdp_tensor_release(la);
    fsdp_tensor_release(lb);
    la = lb = NULL;
    FU_TRY(done, "forward", side_loss(ctx, &a, 1, false, &la));
    FU_TRY(done, "scaled backward", side_backward(sc, la, &lva, NULL));
    FU_TRY(done, "forward", side_loss(ctx, &b, 1, false, &lb));
    FU_TRY(done, "backward", side_backward(NULL, lb, &lvb, NULL));
    FU_TRY(done, "step", fsdp_grad_scaler_step(sc, a.opt, &stepped));
    FU_TRY(done, "step", fsdp_optim_step(b.opt));
    FU_TRY(done, "update", fsdp_grad_scaler_update(sc));
    FU_TRY(done, "reading parameters", fu_list_values(&a.params, false, &pa));
    FU_TRY(done, "reading parameters", fu_list_values(&b.params, false, &pb));
    cl = vals_closeness(&pa, &pb, FU_F32_RTOL, FU_F32_ATOL);
    fu_ck(r, stepped && cl <= 1.0 && fsdp_grad_scaler_get_scale(sc) == 65536.0,
          "F44 step (unscaling itself): steps, the parameters are the twin's (f32), the scale "
          "stays 2^16 before growth_interval",
          "stepped %d, worst %.3g of tolerance, scale %g", stepped, cl,
          fsdp_grad_scaler_get_scale(sc));
done:
    fsdp_tensor_release(la);
    fsdp_tensor_release(lb);
    fu_vals_free(&ga);
    fu_vals_free(&gb);
    fu_vals_free(&pa);
    fu_vals_free(&pb);
    fsdp_grad_scaler_destroy(sc);
    side_free(ctx, &a);
    side_free(ctx, &b);
    return rc;
}

/* ---- inf and NaN on one rank ---------------------------------------------------------------- */

static int skip_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    side_t a = {0}, b = {0};
    fsdp_grad_scaler_t *sc = NULL;
    fsdp_tensor_t *la = NULL, *lb = NULL;
    fu_vals_t before = {0}, after = {0}, pb = {0};
    char why[400];
    fsdp_options_t o;
    fu_job_options(j, &o);
    const bool bad_rank = fsdp_ctx_rank(ctx) == fsdp_ctx_world_size(ctx) - 1;
    int rc;
    FU_TRY(done, "setting up", side_build(ctx, &o, &a));
    FU_TRY(done, "setting up", side_build(ctx, &o, &b));
    FU_TRY(done, "setting up", make_scaler(ctx, 0, 0, &sc));
    /* Iterations: 0 inf, 1 clean, 2 NaN, 3 clean; the twin runs only 1 and 3. */
    for (int it = 0; it < 4; it++) {
        const bool bad = it == 0 || it == 2;
        const char *what = it == 0 ? "an inf" : "a NaN";
        const double want_scale = it < 2 ? 32768.0 : 16384.0;
        double lv = 0;
        bool stepped = !bad;
        fsdp_tensor_release(la);
        la = NULL;
        FU_TRY(done, "reading parameters", fu_list_values(&a.params, false, &before));
        FU_TRY(done, "forward", side_loss(ctx, &a, it, false, &la));
        FU_TRY(done, "scaled backward", side_backward(sc, la, &lv, NULL));
        if (bad) {
            rc = bad_rank ? poison(&a.params, it == 0 ? INFINITY : NAN) : 0;
            fu_ck(r, rc == 0, "control: the last rank has a non-empty shard gradient to poison",
                  "poison returned %d", rc);
            if (rc < 0) goto done;
        }
        if (bad) {
            FU_TRY(done, "step", fsdp_grad_scaler_step(sc, a.opt, &stepped));
            char name[200];
            snprintf(name, sizeof name,
                     "MP-S02/F44: %s in the last rank's shard: this rank reports found_inf and "
                     "skips the step",
                     what);
            fu_ck(r, fsdp_grad_scaler_found_inf(sc) && !stepped, name, "found_inf %d, stepped %d",
                  fsdp_grad_scaler_found_inf(sc), stepped);
            FU_TRY(done, "update", fsdp_grad_scaler_update(sc));
            FU_TRY(done, "reading parameters", fu_list_values(&a.params, false, &after));
            snprintf(name, sizeof name,
                     "MP-S02/F44: after %s: the parameters of this rank are bitwise unchanged",
                     what);
            fu_ck(r, same_vals(&before, &after, why, sizeof why), name, "%s", why);
            snprintf(name, sizeof name,
                     "MP-S02/F44: after %s: update() backs the scale off by backoff_factor to %g "
                     "and found_inf is cleared",
                     what, want_scale);
            fu_ck(r,
                  fsdp_grad_scaler_get_scale(sc) == want_scale && !fsdp_grad_scaler_found_inf(sc),
                  name, "scale %g, found_inf %d", fsdp_grad_scaler_get_scale(sc),
                  fsdp_grad_scaler_found_inf(sc));
            continue;
        }
        fsdp_tensor_release(lb);
        lb = NULL;
        FU_TRY(done, "forward", side_loss(ctx, &b, it, false, &lb));
        FU_TRY(done, "backward", side_backward(NULL, lb, &lv, NULL));
        FU_TRY(done, "step", fsdp_optim_step(b.opt));
        FU_TRY(done, "step", fsdp_grad_scaler_step(sc, a.opt, &stepped));
        FU_TRY(done, "update", fsdp_grad_scaler_update(sc));
        FU_TRY(done, "reading parameters", fu_list_values(&a.params, false, &after));
        FU_TRY(done, "reading parameters", fu_list_values(&b.params, false, &pb));
        double cl = vals_closeness(&after, &pb, FU_F32_RTOL, FU_F32_ATOL);
        char name[200];
        snprintf(name, sizeof name,
                 "MP-S02/F44: the clean iteration after %s steps, keeps the scale at %g, and the "
                 "parameters match the twin that never saw the bad iteration (f32)",
                 it == 1 ? "an inf" : "a NaN", want_scale);
        fu_ck(r, stepped && cl <= 1.0 && fsdp_grad_scaler_get_scale(sc) == want_scale, name,
              "stepped %d, worst %.3g of tolerance, scale %g", stepped, cl,
              fsdp_grad_scaler_get_scale(sc));
    }
done:
    fsdp_tensor_release(la);
    fsdp_tensor_release(lb);
    fu_vals_free(&before);
    fu_vals_free(&after);
    fu_vals_free(&pb);
    fsdp_grad_scaler_destroy(sc);
    side_free(ctx, &a);
    side_free(ctx, &b);
    return rc;
}

/* ---- growth and the state dict --------------------------------------------------------------- */

#define G_ITERS 6
#define G_SAVE 2 /* the state is saved after this iteration's update */
#define G_BAD 1  /* iteration with an inf on the last rank */

/* Runs iterations [from, to) of the growth schedule on s with scaler sc, recording the scale and
 * tracker after each update. */
static int growth_iters(fsdp_ctx_t *ctx, side_t *s, fsdp_grad_scaler_t *sc, int from, int to,
                        double *scales, int64_t *trackers) {
    const bool bad_rank = fsdp_ctx_rank(ctx) == fsdp_ctx_world_size(ctx) - 1;
    fsdp_tensor_t *l = NULL;
    int rc = FSDP_OK;
    for (int it = from; it < to && rc == 0; it++) {
        double lv = 0;
        fsdp_grad_scaler_state_t st;
        rc = side_loss(ctx, s, it, false, &l);
        if (rc == 0) rc = side_backward(sc, l, &lv, NULL);
        if (rc == 0 && it == G_BAD && bad_rank) rc = poison(&s->params, INFINITY);
        if (rc == 0) rc = fsdp_grad_scaler_step(sc, s->opt, NULL);
        if (rc == 0) rc = fsdp_grad_scaler_update(sc);
        if (rc == 0) rc = fsdp_grad_scaler_state_dict(sc, &st);
        scales[it] = st.scale;
        trackers[it] = st.growth_tracker;
        fsdp_tensor_release(l);
        l = NULL;
    }
    return rc;
}

static int growth_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    side_t a = {0}, c = {0};
    fsdp_grad_scaler_t *sa = NULL, *sc1 = NULL, *sc2 = NULL;
    fsdp_tensor_t *l = NULL;
    fu_vals_t pa = {0}, pc = {0};
    double scales_a[G_ITERS] = {0}, scales_c[G_ITERS] = {0};
    int64_t tr_a[G_ITERS] = {0}, tr_c[G_ITERS] = {0};
    char why[400];
    fsdp_options_t o;
    fu_job_options(j, &o);
    int rc;

    /* Three clean steps with growth_interval 3. */
    FU_TRY(done, "setting up", side_build(ctx, &o, &a));
    FU_TRY(done, "setting up", make_scaler(ctx, 0, 3, &sa));
    int64_t tr[3] = {0};
    double sc_after[3] = {0};
    for (int it = 0; it < 3; it++) {
        double lv = 0;
        fsdp_grad_scaler_state_t st;
        FU_TRY(done, "forward", side_loss(ctx, &a, it, false, &l));
        FU_TRY(done, "scaled backward", side_backward(sa, l, &lv, NULL));
        FU_TRY(done, "step", fsdp_grad_scaler_step(sa, a.opt, NULL));
        FU_TRY(done, "update", fsdp_grad_scaler_update(sa));
        FU_TRY(done, "state_dict", fsdp_grad_scaler_state_dict(sa, &st));
        tr[it] = st.growth_tracker;
        sc_after[it] = fsdp_grad_scaler_get_scale(sa);
        fsdp_tensor_release(l);
        l = NULL;
    }
    fu_ck(r, tr[0] == 1 && tr[1] == 2 && sc_after[0] == 65536.0 && sc_after[1] == 65536.0,
          "F44 growth: the tracker counts clean steps (1, 2) and the scale stays 2^16 before "
          "growth_interval 3",
          "trackers %lld %lld, scales %g %g", (long long)tr[0], (long long)tr[1], sc_after[0],
          sc_after[1]);
    fu_ck(r, sc_after[2] == 131072.0 && tr[2] == 0,
          "F44 growth: after 3 clean steps the scale doubles (growth_factor 2) to 2^17 and the "
          "tracker resets to 0",
          "scale %g, tracker %lld", sc_after[2], (long long)tr[2]);
    fsdp_grad_scaler_destroy(sa);
    sa = NULL;
    side_free(ctx, &a);

    /* The uninterrupted run and one through a state dict, with an inf at iteration G_BAD. */
    FU_TRY(done, "setting up", side_build(ctx, &o, &a));
    FU_TRY(done, "setting up", side_build(ctx, &o, &c));
    FU_TRY(done, "setting up", make_scaler(ctx, 0, 3, &sa));
    FU_TRY(done, "setting up", make_scaler(ctx, 0, 3, &sc1));
    FU_TRY(done, "uninterrupted run", growth_iters(ctx, &a, sa, 0, G_ITERS, scales_a, tr_a));
    FU_TRY(done, "first half", growth_iters(ctx, &c, sc1, 0, G_SAVE + 1, scales_c, tr_c));
    fsdp_grad_scaler_state_t st;
    FU_TRY(done, "state_dict", fsdp_grad_scaler_state_dict(sc1, &st));
    fu_ck(r,
          st.scale == 32768.0 && st.growth_factor == 2.0 && st.backoff_factor == 0.5 &&
              st.growth_interval == 3 && st.growth_tracker == 1,
          "F44 state_dict after the skipped step and one clean step: scale 2^15, factors 2 and "
          "0.5, interval 3, tracker 1",
          "scale %g, growth %g, backoff %g, interval %lld, tracker %lld", st.scale,
          st.growth_factor, st.backoff_factor, (long long)st.growth_interval,
          (long long)st.growth_tracker);
    fsdp_grad_scaler_destroy(sc1);
    sc1 = NULL;
    /* A new scaler with other options takes everything from the state. */
    fsdp_grad_scaler_options_t so;
    fsdp_grad_scaler_options_init(&so);
    so.init_scale = 8.0;
    so.growth_interval = 7;
    so.growth_factor = 4.0;
    so.backoff_factor = 0.25;
    FU_TRY(done, "setting up", fsdp_grad_scaler_create(ctx, &so, &sc2));
    FU_TRY(done, "load_state_dict", fsdp_grad_scaler_load_state_dict(sc2, &st));
    fu_ck(r, fsdp_grad_scaler_get_scale(sc2) == st.scale, "F44 load_state_dict sets the scale",
          "%g", fsdp_grad_scaler_get_scale(sc2));
    FU_TRY(done, "second half", growth_iters(ctx, &c, sc2, G_SAVE + 1, G_ITERS, scales_c, tr_c));
    bool same = true;
    for (int it = 0; it < G_ITERS; it++)
        if (scales_a[it] != scales_c[it] || tr_a[it] != tr_c[it]) {
            same = false;
            snprintf(why, sizeof why, "iteration %d: scale %g vs %g, tracker %lld vs %lld", it,
                     scales_a[it], scales_c[it], (long long)tr_a[it], (long long)tr_c[it]);
            break;
        }
    fu_ck(r, same,
          "F44 state_dict round trip mid-run: every later scale and tracker is the uninterrupted "
          "run's",
          "%s", why);
    fu_ck(r,
          scales_a[0] == 65536.0 && scales_a[1] == 32768.0 && scales_a[2] == 32768.0 &&
              scales_a[3] == 32768.0 && scales_a[4] == 65536.0 && scales_a[5] == 65536.0,
          "F44 schedule: 2^16, backoff to 2^15 on the inf, growth to 2^16 after 3 clean steps",
          "%g %g %g %g %g %g", scales_a[0], scales_a[1], scales_a[2], scales_a[3], scales_a[4],
          scales_a[5]);
    FU_TRY(done, "reading parameters", fu_list_values(&a.params, false, &pa));
    FU_TRY(done, "reading parameters", fu_list_values(&c.params, false, &pc));
    fu_ck(r, same_vals(&pa, &pc, why, sizeof why),
          "F44 state_dict round trip mid-run: the parameters are bitwise the uninterrupted run's",
          "%s", why);
done:
    fsdp_tensor_release(l);
    fu_vals_free(&pa);
    fu_vals_free(&pc);
    fsdp_grad_scaler_destroy(sa);
    fsdp_grad_scaler_destroy(sc1);
    fsdp_grad_scaler_destroy(sc2);
    side_free(ctx, &a);
    side_free(ctx, &c);
    return rc;
}

/* ---- MP-S02: f16 mixed precision with the scaler against f32 --------------------------------- */

#define E2E_ITERS 10
#define E2E_RTOL FU_F16_RTOL
#define E2E_ATOL FU_F16_ATOL

static int e2e_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    side_t h = {0}, f = {0};
    fsdp_grad_scaler_t *sc = NULL;
    fsdp_tensor_t *l = NULL;
    fu_vals_t ph = {0}, pf = {0};
    double lh[E2E_ITERS + 1] = {0}, lf[E2E_ITERS + 1] = {0};
    int taken = 0, skipped = 0;
    bool f16_loss = true;
    fsdp_options_t o;
    fu_job_options(j, &o); /* mixed precision f16 from the job */
    fsdp_options_t of = o;
    fsdp_mixed_precision_init(&of.mixed_precision);
    int rc;
    FU_TRY(done, "setting up", side_build(ctx, &o, &h));
    FU_TRY(done, "setting up", side_build(ctx, &of, &f));
    FU_TRY(done, "setting up", make_scaler(ctx, 0, 0, &sc));
    /* The same data every iteration, so a skipped iteration only delays the run. */
    for (int it = 0; it < E2E_ITERS; it++) {
        double lv = 0;
        bool stepped = false;
        FU_TRY(done, "f16 forward", side_loss(ctx, &h, 0, true, &l));
        f16_loss = f16_loss && fsdp_tensor_dtype(l) == FSDP_DTYPE_F16;
        FU_TRY(done, "f16 scaled backward", side_backward(sc, l, &lv, NULL));
        FU_TRY(done, "f16 step", fsdp_grad_scaler_step(sc, h.opt, &stepped));
        FU_TRY(done, "update", fsdp_grad_scaler_update(sc));
        fsdp_tensor_release(l);
        l = NULL;
        if (stepped)
            lh[taken++] = lv;
        else
            skipped++;
    }
    for (int it = 0; it <= taken; it++) {
        double lv = 0;
        FU_TRY(done, "f32 forward", side_loss(ctx, &f, 0, true, &l));
        FU_TRY(done, "f32 backward", side_backward(NULL, l, &lv, NULL));
        if (it < taken) FU_TRY(done, "f32 step", fsdp_optim_step(f.opt));
        fsdp_tensor_release(l);
        l = NULL;
        lf[it] = lv;
    }
    /* The f16 loss after the last step. */
    FU_TRY(done, "f16 forward", side_loss(ctx, &h, 0, true, &l));
    FU_TRY(done, "f16 forward", fsdp_tensor_item(l, 0, &lh[taken]));
    fsdp_tensor_release(l);
    l = NULL;
    fu_ck(r, f16_loss, "MP-S02: the loss is f16 (param_dtype) in every iteration", "not f16");
    fu_ck(r,
          skipped >= 1 && taken >= 5 && fsdp_grad_scaler_get_scale(sc) == 65536.0 / (1 << skipped),
          "MP-S02/F44: the f16 loss scaled by 2^16 overflows at first: the first steps are "
          "skipped, the scale backs off once per skip, and training goes on",
          "%d skipped, %d taken, scale %g", skipped, taken, fsdp_grad_scaler_get_scale(sc));
    double worst = 0;
    for (int it = 0; it <= taken; it++) {
        double c = fu_closeness(lh[it], lf[it], E2E_RTOL, E2E_ATOL);
        if (!(c <= worst)) worst = isnan(c) ? INFINITY : c;
    }
    fu_ck(r, worst <= 1.0,
          "MP-S02: every loss of the f16 run with the scaler is the f32 run's after as many steps "
          "(rtol 1e-3, atol 1e-5)",
          "worst %.3g of tolerance; first %.6g vs %.6g, last %.6g vs %.6g", worst, lh[0], lf[0],
          lh[taken], lf[taken]);
    fu_ck(r, lh[taken] < lh[0] && lf[taken] < lf[0],
          "MP-S02: both runs converge (the last loss is below the first)",
          "f16 %.6g -> %.6g, f32 %.6g -> %.6g", lh[0], lh[taken], lf[0], lf[taken]);
    FU_TRY(done, "reading parameters", fu_list_values(&h.params, false, &ph));
    FU_TRY(done, "reading parameters", fu_list_values(&f.params, false, &pf));
    double cl = vals_closeness(&ph, &pf, E2E_RTOL, E2E_ATOL);
    fu_ck(r, cl <= 1.0,
          "MP-S02: the f16 run's (f32 master) parameters are the f32 run's (rtol 1e-3, atol 1e-5)",
          "worst %.3g of tolerance", cl);
    if (fsdp_ctx_rank(ctx) == 0)
        tap_diag("%s W=%d: %d skipped, %d taken; measured worst loss closeness %.3g, parameter "
                 "closeness %.3g (of rtol 1e-3, atol 1e-5)",
                 j->prefix, j->world, skipped, taken, worst, cl);
done:
    fsdp_tensor_release(l);
    fu_vals_free(&ph);
    fu_vals_free(&pf);
    fsdp_grad_scaler_destroy(sc);
    side_free(ctx, &h);
    side_free(ctx, &f);
    return rc;
}

/* ---- main ------------------------------------------------------------------------------------ */

static void mp_f16(fsdp_mixed_precision_t *mp) {
    fsdp_mixed_precision_init(mp);
    mp->enabled = true;
    mp->param_dtype = mp->reduce_dtype = mp->buffer_dtype = FSDP_DTYPE_F16;
}

int main(void) {
    tap_plan_lazy();
    static const int worlds[3] = {1, 2, 4};
    static const fsdp_sharding_strategy_t strategies[2] = {FSDP_FULL_SHARD, FSDP_SHARD_GRAD_OP};
    for (int wi = 0; wi < 3; wi++)
        for (int si = 0; si < 2; si++)
            for (int orig = 0; orig < 2; orig++) {
                char prefix[160];
                const char *sn = fsdp_sharding_strategy_name(strategies[si]);
                snprintf(prefix, sizeof prefix, "F44 scale/unscale/clip %s use_orig_params=%d", sn,
                         orig);
                fu_run(prefix, worlds[wi], strategies[si], orig, scale_clip_rank);
                snprintf(prefix, sizeof prefix, "MP-S02 inf/NaN on one rank %s use_orig_params=%d",
                         sn, orig);
                fu_run(prefix, worlds[wi], strategies[si], orig, skip_rank);
                snprintf(prefix, sizeof prefix, "F44 growth and state dict %s use_orig_params=%d",
                         sn, orig);
                fu_run(prefix, worlds[wi], strategies[si], orig, growth_rank);
            }
    for (int wi = 0; wi < 3; wi++)
        for (int orig = 0; orig < 2; orig++) {
            char prefix[160];
            snprintf(prefix, sizeof prefix,
                     "MP-S02 e2e MixedPrecision(f16, f16, f16) + scaler vs f32 FULL_SHARD "
                     "use_orig_params=%d",
                     orig);
            fu_job_t *j = fu_job_new(prefix, worlds[wi], FSDP_FULL_SHARD, orig);
            mp_f16(&j->mp);
            fu_run_job(j, e2e_rank);
            free(j);
        }
    return tap_done();
}
