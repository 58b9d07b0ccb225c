/* SPDX-License-Identifier: MIT */
/*
 * t_mp_dp_inputs.c: mixed precision per unit and around ignored modules (spec section 6, seed
 * 003); t_mp_inputs.c has the unit inputs of one mixed-precision unit (MP-S03..S06, MP-S14).
 *   MP-DP-01..06 per-unit precision on SaveForwardInputsModel (and DP-06's ToyModel): input
 *                dtypes recorded by forward pre-hooks added after wrapping (so they see what the
 *                module receives); the dtype errors the seed expects come from the linear kernel
 *                ("mat1 and mat2 must have the same dtype") with no output; the outputs that do
 *                run match a local reference of the same weights with the same casts (fp16
 *                tolerance), and DP-05 (at W = 1, 2, 4) also c2's and c1's sharded gradients,
 *                stored in f32;
 *   MP-IG-01     ModelWithIgnoredModule with `ignored` in ignored_modules under param f16: the
 *                f32 Linear inside the ignored module receives f16 activations and the forward
 *                fails with the kernel's dtype error (PyTorch's behaviour, docs/design.md
 *                "Mixed precision: inputs, per-unit precision, ignored modules"); the ignored
 *                parameters stay f32 and whole, the model can be torn down, and a second forward
 *                fails the same way instead of computing anything;
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

/* ---- MP-DP-01..06 ---------------------------------------------------------------------------- */

enum dp_case { DP01 = 1, DP02, DP03, DP04, DP05, DP06 };

typedef struct dp_job {
    fu_job_t j; /* first */
    enum dp_case c;
} dp_job_t;

/* The local reference of SaveForwardInputsModel: c1 in f32, c2's weights and input cast to f16
 * by hand; output and loss (sum) with its backward run. ref's c2 is converted in place. */
static int dp_reference(fsdp_ctx_t *ctx, fsdp_module_t *ref, fsdp_tensor_t *x,
                        fsdp_tensor_t **out) {
    fsdp_tensor_t *h = NULL, *hh = NULL, *loss = NULL;
    int rc = params_to(fsdp_module_child(ref, "c2"), FSDP_DTYPE_F16);
    (void)ctx;
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(ref, "c1"), x, &h);
    if (rc == 0) rc = fsdp_to_dtype(h, FSDP_DTYPE_F16, &hh);
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(ref, "c2"), hh, out);
    if (rc == 0) rc = tm_sum_loss(*out, &loss);
    if (rc == 0) rc = fsdp_backward(loss, NULL);
    fsdp_tensor_release(h);
    fsdp_tensor_release(hh);
    fsdp_tensor_release(loss);
    return rc;
}

/* DP-06's reference: every weight and the input in f16 (the root casts x; l2 gets l1's f16
 * output); y is not used by the computation. */
static int dp6_reference(fsdp_module_t *ref, fsdp_tensor_t *x, fsdp_tensor_t **out) {
    fsdp_tensor_t *xh = NULL, *h = NULL, *loss = NULL;
    int rc = params_to(ref, FSDP_DTYPE_F16);
    if (rc == 0) rc = fsdp_to_dtype(x, FSDP_DTYPE_F16, &xh);
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(ref, "l1"), xh, &h);
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(ref, "l2.l"), h, out);
    if (rc == 0) rc = tm_sum_loss(*out, &loss);
    if (rc == 0) rc = fsdp_backward(loss, NULL);
    fsdp_tensor_release(xh);
    fsdp_tensor_release(h);
    fsdp_tensor_release(loss);
    return rc;
}

static const char *const dp_ids[] = {"",         "MP-DP-01", "MP-DP-02", "MP-DP-03",
                                     "MP-DP-04", "MP-DP-05", "MP-DP-06"};

static int dp_rank(fsdp_ctx_t *ctx, void *arg) {
    dp_job_t *dj = arg;
    fu_job_t *j = &dj->j;
    fu_res_t *r = fu_res_of(j, ctx);
    const char *id = dp_ids[dj->c];
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_unit_t *root = NULL, *child = NULL;
    fsdp_tensor_t *x = NULL, *y = NULL, *loss = NULL, *ry = NULL;
    seen_t s_model, s_a, s_b;
    char name[200], why[760];
    fsdp_options_t o_root, o_child;
    fu_job_options(j, &o_root);
    o_child = o_root;
    int rc;
    fsdp_mixed_precision_t f16, f32;
    mp_init(&f16, FSDP_DTYPE_F16, FSDP_MP_UNSET, FSDP_MP_UNSET);
    mp_init(&f32, FSDP_DTYPE_F32, FSDP_MP_UNSET, FSDP_MP_UNSET);
    bool self_cast = dj->c == DP02;
    const char *wrapped = dj->c == DP04 ? "c1" : "c2";
    if (dj->c == DP06) {
        FU_TRY(done, "building", tm_external_inputs_create(ctx, &m));
        FU_TRY(done, "building the reference", tm_external_inputs_create(ctx, &ref));
        wrapped = "l2";
    } else {
        FU_TRY(done, "building", tm_save_inputs_create(ctx, self_cast, &m));
        FU_TRY(done, "building the reference", tm_save_inputs_create(ctx, false, &ref));
    }
    /* The child unit's and the root's configurations, as the seed's. */
    o_child.mixed_precision = f16;
    o_child.mixed_precision.cast_forward_inputs = dj->c == DP01 || dj->c == DP04 || dj->c == DP05;
    fsdp_mixed_precision_init(&o_root.mixed_precision);
    if (dj->c == DP04 || dj->c == DP05) {
        o_root.mixed_precision = f32;
        o_root.mixed_precision.cast_forward_inputs = true;
    } else if (dj->c == DP06) {
        o_root.mixed_precision = f16;
    }
    FU_TRY(done, "wrapping the child", fsdp_wrap(fsdp_module_child(m, wrapped), &o_child, &child));
    FU_TRY(done, "wrapping the root", fsdp_wrap(m, &o_root, &root));
    /* Hooks added after wrapping run after FSDP's: they see what the module's forward gets. */
    FU_TRY(done, "hooks", watch(m, &s_model));
    FU_TRY(done, "hooks", watch(fsdp_module_child(m, dj->c == DP06 ? "l1" : "c1"), &s_a));
    FU_TRY(done, "hooks", watch(fsdp_module_child(m, dj->c == DP06 ? "l2" : "c2"), &s_b));
    FU_TRY(done, "input", fu_rand_input(ctx, 7, 2, 100, &x));

    rc = fsdp_module_forward1(m, x, &y);
    if (dj->c == DP03 || dj->c == DP04) {
        const char *msg = fsdp_ctx_last_error(ctx);
        snprintf(name, sizeof name,
                 "%s: the forward fails with the linear kernel's \"" MAT_PHRASE "\" (EINVAL), no "
                 "output",
                 id);
        fu_ck(r, dtype_error(rc, msg, true) && !y, name, "rc %s, output %p, message \"%s\"",
              fsdp_err_name(rc), (void *)y, msg);
        snprintf(name, sizeof name, "%s: the message names the f16 and f32 operands", id);
        fu_ck(r, msg && strstr(msg, "f16[") && strstr(msg, "f32["), name, "message \"%s\"", msg);
        /* Which module got what: c1 ran (DP-04: in f16 after its cast), c2 was entered. */
        snprintf(name, sizeof name, "%s: recorded inputs model f32, c1 %s, c2 %s", id,
                 dj->c == DP04 ? "f16" : "f32", dj->c == DP04 ? "f16" : "f32");
        fu_ck(r,
              saw(&s_model, 0, FSDP_DTYPE_F32) &&
                  saw(&s_a, 0, dj->c == DP04 ? FSDP_DTYPE_F16 : FSDP_DTYPE_F32) &&
                  saw(&s_b, 0, dj->c == DP04 ? FSDP_DTYPE_F16 : FSDP_DTYPE_F32),
              name, "model %s, c1 %s, c2 %s", dt_name(&s_model, 0), dt_name(&s_a, 0),
              dt_name(&s_b, 0));
        fsdp_tape_clear(ctx);
        rc = fsdp_module_forward1(m, x, &y);
        msg = fsdp_ctx_last_error(ctx);
        snprintf(name, sizeof name,
                 "%s: a second forward fails the same way (no state left behind, no output)", id);
        fu_ck(r, dtype_error(rc, msg, true) && !y, name, "rc %s, message \"%s\"", fsdp_err_name(rc),
              msg);
        fsdp_tape_clear(ctx);
        rc = FSDP_OK;
        goto done;
    }
    if (rc < 0) FU_TRY(done, "FSDP forward", rc);
    FU_TRY(done, "FSDP backward", tm_sum_loss(y, &loss));
    FU_TRY(done, "FSDP backward", fsdp_backward(loss, NULL));
    if (dj->c == DP06) {
        fu_ck(
            r,
            saw(&s_model, 0, FSDP_DTYPE_F16) && saw(&s_b, 0, FSDP_DTYPE_F16) &&
                saw(&s_b, 1, FSDP_DTYPE_F32),
            "MP-DP-06: recorded model_input_x f16 (the root casts), l2_input_x f16 (l1's output), "
            "l2_input_y f32 (made in the parent's forward; a non-root unit does not cast)",
            "model_input_x %s, l2_input_x %s, l2_input_y %s", dt_name(&s_model, 0),
            dt_name(&s_b, 0), dt_name(&s_b, 1));
        FU_TRY(done, "reference", dp6_reference(ref, x, &ry));
    } else {
        fsdp_dtype_t c2_dt = dj->c == DP02 ? FSDP_DTYPE_F32 : FSDP_DTYPE_F16;
        snprintf(name, sizeof name, "%s: recorded inputs model f32, c1 f32, c2 %s%s", id,
                 fsdp_dtype_name(c2_dt),
                 dj->c == DP02 ? " (the unit does not cast; the module casts inside)" : "");
        fu_ck(r,
              saw(&s_model, 0, FSDP_DTYPE_F32) && saw(&s_a, 0, FSDP_DTYPE_F32) &&
                  saw(&s_b, 0, c2_dt),
              name, "model %s, c1 %s, c2 %s", dt_name(&s_model, 0), dt_name(&s_a, 0),
              dt_name(&s_b, 0));
        FU_TRY(done, "reference", dp_reference(ctx, ref, x, &ry));
    }
    snprintf(name, sizeof name,
             "%s: the output is f16 and matches the hand-cast local reference (fp16 tolerance)",
             id);
    double cl = fu_tensor_closeness(y, ry, FU_F16_RTOL, FU_F16_ATOL);
    fu_ck(r, fsdp_tensor_dtype(y) == FSDP_DTYPE_F16 && cl >= 0 && cl <= 1.0, name,
          "%s output, worst element %.3g of tolerance", fsdp_dtype_name(fsdp_tensor_dtype(y)), cl);
    snprintf(name, sizeof name,
             "%s: forward and backward complete; every unit IDLE and resharded afterwards", id);
    fu_ck(r, fu_tree_idle(root), name, "a unit is not");
    if (dj->c == DP05 || dj->c == DP06 || dj->c == DP01) {
        /* The same input on every rank: the reduction averages equal gradients. */
        cl = fu_shards_vs(root, child, true, fu_ref_grad, ref, FU_F16_RTOL, FU_F16_ATOL, why,
                          sizeof why);
        snprintf(name, sizeof name,
                 "%s: %s's sharded gradients are full precision (f32) and match the reference's "
                 "(fp16 tolerance)",
                 id, wrapped);
        fu_ck(r, cl <= 1.0, name, "worst %.3g of tolerance: %s", cl, why);
        cl = fu_shards_vs(root, NULL, true, fu_ref_grad, ref, FU_F16_RTOL, FU_F16_ATOL, why,
                          sizeof why);
        snprintf(name, sizeof name,
                 "%s: every sharded gradient of the tree (f32) matches the reference's, through "
                 "the f16 cast (fp16 tolerance)",
                 id);
        fu_ck(r, cl <= 1.0, name, "worst %.3g of tolerance: %s", cl, why);
    }
done:
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    fsdp_tensor_release(ry);
    fsdp_tensor_release(loss);
    fu_teardown(ctx, m, root, NULL, NULL);
    fsdp_module_release(ref);
    return rc;
}

/* ---- MP-IG-01 -------------------------------------------------------------------------------- */

static int ig_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *x = NULL, *y = NULL;
    fsdp_options_t o;
    fu_job_options(j, &o);
    int rc;
    FU_TRY(done, "building", tm_ignored_create(ctx, &m));
    fsdp_module_t *ign = fsdp_module_child(m, "ignored");
    fsdp_module_t *const ignored[1] = {ign};
    o.ignored_modules = ignored;
    o.num_ignored_modules = 1;
    FU_TRY(done, "wrapping", fsdp_wrap(m, &o, &root));
    fsdp_tensor_t *w = fsdp_module_param(ign, "l.weight");
    const int64_t x_shape[2] = {2, 100};
    FU_TRY(done, "input",
           fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 2, x_shape, 1.0, FSDP_MEM_ACTIVATIONS, &x));
    rc = fsdp_module_forward1(m, x, &y);
    const char *msg = fsdp_ctx_last_error(ctx);
    fu_ck(r, dtype_error(rc, msg, true) && !y,
          "MP-IG-01: the ignored f32 Linear receiving f16 activations fails with the kernel's "
          "\"" MAT_PHRASE "\" (EINVAL), no output",
          "rc %s, output %p, message \"%s\"", fsdp_err_name(rc), (void *)y, msg);
    fu_ck(r, msg && strstr(msg, "f16[2, 100]") && strstr(msg, "f32[100, 100]"),
          "MP-IG-01: the message names the f16 activation and the f32 weight", "message \"%s\"",
          msg);
    fu_ck(r,
          w == fsdp_module_param(ign, "l.weight") && fsdp_tensor_dtype(w) == FSDP_DTYPE_F32 &&
              fsdp_tensor_numel(w) == 100 * 100,
          "MP-IG-01: the ignored parameters stay the module's own, f32 and whole (not flattened)",
          "weight %s with %lld elements",
          fsdp_dtype_name(fsdp_tensor_dtype(fsdp_module_param(ign, "l.weight"))),
          (long long)fsdp_tensor_numel(fsdp_module_param(ign, "l.weight")));
    fsdp_tape_clear(ctx);
    rc = fsdp_module_forward1(m, x, &y);
    msg = fsdp_ctx_last_error(ctx);
    fu_ck(r, dtype_error(rc, msg, true) && !y,
          "MP-IG-01: a second forward fails the same way (nothing computed with the wrong dtype)",
          "rc %s, message \"%s\"", fsdp_err_name(rc), msg);
    fsdp_tape_clear(ctx);
    rc = fsdp_unit_destroy(root);
    root = NULL;
    fu_ck(r, rc == 0, "MP-IG-01: the wrapped model is torn down cleanly after the failures",
          "rc %s (%s)", fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
    rc = FSDP_OK;
done:
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    fu_teardown(ctx, m, root, NULL, NULL);
    return rc;
}

/* ---- main ------------------------------------------------------------------------------------ */

static const int worlds[3] = {1, 2, 4};

int main(void) {
    tap_plan_lazy();
    char prefix[160];
    static const char *const dp_what[] = {
        "",
        "c2 f16 (cast_forward_inputs) under a root without mixed precision",
        "c2 f16 without cast_forward_inputs, modules cast themselves",
        "c2 f16 without cast_forward_inputs, modules do not cast",
        "c1 f16 (cast) then c2 in an f32 root",
        "c2 f16 (cast) under an f32 root",
        "l2 f16 under an f16 root, y made inside the parent",
    };
    for (int c = DP01; c <= DP06; c++)
        for (int w = 0; w < 3; w++) {
            if (c != DP05 && worlds[w] != 2) continue; /* the seed's world size 2 */
            dp_job_t *dj = calloc(1, sizeof *dj);
            if (!dj) tap_bail("out of memory");
            snprintf(prefix, sizeof prefix, "%s %s", dp_ids[c], dp_what[c]);
            fu_job_init(&dj->j, prefix, worlds[w], FSDP_FULL_SHARD, false);
            dj->c = (enum dp_case)c;
            fu_run_job(&dj->j, dp_rank);
            free(dj);
        }
    for (int w = 1; w <= 2; w++) {
        fu_job_t *j = fu_job_new("MP-IG-01 ModelWithIgnoredModule param f16, ignored_modules = "
                                 "[ignored]",
                                 w, FSDP_FULL_SHARD, false);
        mp_init(&j->mp, FSDP_DTYPE_F16, FSDP_MP_UNSET, FSDP_MP_UNSET);
        fu_run_job(j, ig_rank);
        free(j);
    }
    return tap_done();
}
