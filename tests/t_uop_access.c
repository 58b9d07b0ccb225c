/* SPDX-License-Identifier: MIT */
/*
 * t_uop_access.c: use_orig_params seen from the model (seed 001, test_fsdp_use_orig_params.py;
 * spec F06, F20, F21, F25, F28..F34): the original parameters as views of the shards, their
 * names inside forward, writing them back, and ranks that hold none of them. Every FSDP model is
 * compared with DDP over the same sim group, parameters as well as losses, within assert_close's
 * fp32 tolerances (rtol 1.3e-6, atol 1e-5). t_uop.c has the training parity, several optimizers
 * and several forwards before a backward.
 *   UOP-PA-01   lin1 Linear(5, 5, no bias), relu, lin2 Linear(5, 7) under the always policy: at
 *               world size 2 lin1's shards hold 13 and 12 weight elements, rank 0 holds 22 of
 *               lin2's weight, rank 1 the other 13, one alignment pad and all 7 bias elements,
 *               and rank 0's bias view is empty; the views equal the slices of DDP's parameters
 *               after a forward, after backward and step, and after another forward.
 *   UOP-FQ-01   inside forward the module's named parameters are "lin.weight" and "lin.bias"
 *               with their unsharded shapes; outside, 1-D shard views.
 *   UOP-WB-01   a weight replaced by a tensor of 2.0 (new data, or a new object in the module
 *               slot) is written back at the next summon: values equal DDP's, and the object
 *               views the shard again (and a new object is the one FSDP hands the optimizer).
 *   UOP-WB-02   after a backward a weight's gradient gets new data, a new tensor of 2.0, or is
 *               set to none: Adam's step sees it (parity with DDP), and the next backward
 *               without zero_grad accumulates onto the written-back gradient (parity again).
 *   UOP-WB-03   a replacement of another shape fails the summon with FSDP_EINVAL "Cannot
 *               writeback" naming the parameter and both shapes, on the rank that made it.
 *   UOP-WB-04   SHARD_GRAD_OP: a parameter changed between forward and backward (new data, or a
 *               new object) fails the backward with "FSDP does not support changing the
 *               parameters between forward and backward".
 *   UOP-MT-01   world size 8: Linear(3, 1, no bias) sharded so that five ranks hold no element;
 *               Adam steps over the (empty) original parameters and the parameters match a
 *               local model trained on every rank's input.
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

/* ---- models of the writeback and access tests ----------------------------------------------- */

/* x -> lin1 -> relu -> lin2, as TestFSDPUseOrigParamsWriteback.Model. */
static int lin_relu_lin_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                                fsdp_tensor_t **out) {
    fsdp_tensor_t *z = NULL, *h = NULL;
    if (nin != 1 || nout != 1) return FSDP_EINVAL;
    int rc = fsdp_module_forward1(fsdp_module_child(m, "lin1"), in[0], &z);
    if (rc == 0) rc = fsdp_relu(z, &h);
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(m, "lin2"), h, &out[0]);
    fsdp_tensor_release(z);
    fsdp_tensor_release(h);
    return rc;
}

static const fsdp_module_ops_t pa_ops = {"Model", lin_relu_lin_forward, NULL};

/* UOP-PA-01's model (seed 42): lin1 Linear(5, 5, no bias), relu, lin2 Linear(5, 7). */
static int pa_model(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_module_t *m = NULL, *l = NULL;
    int rc = fsdp_module_create(ctx, &pa_ops, NULL, &m);
    tm_manual_seed(ctx, 42);
    if (rc == 0) rc = fsdp_linear_create(ctx, 5, 5, false, &l);
    if (rc == 0) rc = fsdp_module_add_child(m, "lin1", l);
    fsdp_module_release(l);
    l = NULL;
    if (rc == 0) rc = fsdp_linear_create(ctx, 5, 7, true, &l);
    if (rc == 0) rc = fsdp_module_add_child(m, "lin2", l);
    fsdp_module_release(l);
    if (rc < 0) {
        fsdp_module_release(m);
        m = NULL;
    }
    *out = m;
    return rc;
}

/* ---- UOP-PA-01 ------------------------------------------------------------------------------- */

/* The seed's slices at world size 2: {parameter, rank 0 start, count, rank 1 start, count}. */
static const struct pa_slice {
    const char *name;
    int64_t start[2], n[2];
} pa_slices[] = {
    {"lin1.weight", {0, 13}, {13, 12}},
    {"lin2.weight", {0, 22}, {22, 13}},
    {"lin2.bias", {0, 0}, {0, 7}},
};

/* Every original parameter equals its slice of DDP's flattened parameter (NO_SHARD: all of
 * it). */
static void pa_check_views(fu_res_t *r, fsdp_module_t *m, fsdp_module_t *ref, bool sharded,
                           int rank, const char *when) {
    char why[800] = "", name[200];
    bool ok = true;
    for (size_t i = 0; i < sizeof pa_slices / sizeof pa_slices[0]; i++) {
        const struct pa_slice *s = &pa_slices[i];
        fsdp_tensor_t *t = fsdp_module_param(m, s->name), *e = fsdp_module_param(ref, s->name);
        int64_t start = sharded ? s->start[rank] : 0;
        int64_t n = sharded ? s->n[rank] : fsdp_tensor_numel(e);
        int64_t na = 0, ne = 0;
        float *a = t ? fu_host_f32(t, &na) : NULL, *x = e ? fu_host_f32(e, &ne) : NULL;
        bool good =
            t && e && fsdp_tensor_ndim(t) == 1 && na == n && x && start + n <= ne && (n == 0 || a);
        for (int64_t k = 0; good && k < n; k++)
            good = fu_closeness(a[k], x[start + k], RTOL, ATOL) <= 1.0;
        if (!good)
            fu_add_why(why, sizeof why,
                       "'%s': %lld elements (want %lld from %lld) or values differ", s->name,
                       (long long)na, (long long)n, (long long)start);
        ok &= good;
        free(a), free(x);
    }
    snprintf(name, sizeof name, "%s: each view is its slice of DDP's flattened parameter", when);
    fu_ck(r, ok, name, "%s", why);
}

static int pa_rank(fsdp_ctx_t *ctx, void *arg) {
    uop_job_t *uj = arg;
    fu_res_t *r = fu_res_of(&uj->j, ctx);
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_ddp_t *ddp = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_policy_t *pol = NULL;
    fsdp_optim_t *opt = NULL, *ref_opt = NULL;
    fsdp_named_list_t fl = {0}, rl = {0};
    fsdp_tensor_t *x = NULL, *lf = NULL, *ld = NULL;
    int rc, rank = fsdp_ctx_rank(ctx);
    bool sharded = uj->j.strategy != FSDP_NO_SHARD;
    FU_TRY(done, "building the models", pa_model(ctx, &m));
    FU_TRY(done, "building the models", pa_model(ctx, &ref));
    FU_TRY(done, "DDP", fsdp_ddp_create(ref, NULL, NULL, &ddp));
    fsdp_options_t o;
    fu_job_options(&uj->j, &o);
    FU_TRY(done, "policy", fsdp_policy_always_create(&pol));
    o.auto_wrap_policy = pol;
    FU_TRY(done, "wrapping", fsdp_wrap(m, &o, &root));
    FU_TRY(done, "optimizers", fsdp_named_params(root, &fl));
    FU_TRY(done, "optimizers", fsdp_module_named_params(ref, false, &rl));
    FU_TRY(done, "optimizers", adam_over(ctx, &fl, &opt));
    FU_TRY(done, "optimizers", adam_over(ctx, &rl, &ref_opt));
    if (sharded) {
        fsdp_unit_t *u1 = fsdp_unit_of(fsdp_module_child(m, "lin1"));
        fsdp_unit_t *u2 = fsdp_unit_of(fsdp_module_child(m, "lin2"));
        fsdp_flat_sizes_t s1 = {0}, s2 = {0};
        fsdp_param_info_t w1 = {0}, w2 = {0}, b2 = {0};
        bool got = u1 && u2 && fsdp_unit_param_info(u1, 0, &w1) == 0 &&
                   fsdp_unit_param_info(u2, 0, &w2) == 0 && fsdp_unit_param_info(u2, 1, &b2) == 0;
        fsdp_unit_flat_sizes(u1, &s1);
        fsdp_unit_flat_sizes(u2, &s2);
        fu_ck(r, got && s1.shard_numel == 13 && s2.shard_numel == 22 && s2.padded_numel == 44,
              "layout: lin1's shard is 13 elements, lin2's 22 (35 weights, 1 pad, 7 biases, 1 "
              "world pad)",
              "units %p %p, shards %lld and %lld, lin2 padded %lld", (void *)u1, (void *)u2,
              (long long)s1.shard_numel, (long long)s2.shard_numel, (long long)s2.padded_numel);
        bool lay = got && w1.numel_in_shard == (rank == 0 ? 13 : 12) &&
                   w2.numel_in_shard == (rank == 0 ? 22 : 13) && w2.offset_in_shard == 0 &&
                   b2.numel_in_shard == (rank == 0 ? 0 : 7) && b2.in_shard == (rank == 1) &&
                   (rank == 0 || b2.offset_in_shard == 14);
        fu_ck(r, lay,
              "layout: lin1.weight 13|12; lin2.weight 22|13; rank 1 holds 13 weights, one pad, "
              "then all 7 biases; rank 0's bias view is empty",
              "rank %d: lin1.weight %lld, lin2.weight %lld at %lld, lin2.bias %lld at %lld", rank,
              (long long)w1.numel_in_shard, (long long)w2.numel_in_shard,
              (long long)w2.offset_in_shard, (long long)b2.numel_in_shard,
              (long long)b2.offset_in_shard);
        fu_ck(r, fsdp_tensor_numel(fsdp_module_param(m, "lin2.bias")) == (rank == 0 ? 0 : 7),
              "rank 0's lin2.bias is an empty tensor, rank 1's holds 7", "%lld elements",
              (long long)fsdp_tensor_numel(fsdp_module_param(m, "lin2.bias")));
    }
    FU_TRY(done, "input", fu_rand_input(ctx, 42 + (uint64_t)rank, 2, 5, &x));
    FU_TRY(done, "FSDP forward", fwd_loss(m, NULL, x, NULL, &lf));
    pa_check_views(r, m, ref, sharded, rank, "after forward");
    FU_TRY(done, "FSDP backward", fsdp_backward(lf, NULL));
    FU_TRY(done, "DDP forward", fwd_loss(ref, ddp, x, NULL, &ld));
    FU_TRY(done, "DDP backward", fsdp_backward(ld, NULL));
    fu_ck(r, fu_closeness(item(lf), item(ld), RTOL, ATOL) <= 1.0, "the loss equals DDP's",
          "%.9g vs %.9g", item(lf), item(ld));
    FU_TRY(done, "step", fsdp_optim_step(opt));
    FU_TRY(done, "step", fsdp_optim_step(ref_opt));
    pa_check_views(r, m, ref, sharded, rank, "after backward and step");
    fsdp_tensor_release(lf), fsdp_tensor_release(ld);
    lf = ld = NULL;
    FU_TRY(done, "FSDP forward", fwd_loss(m, NULL, x, NULL, &lf));
    pa_check_views(r, m, ref, sharded, rank, "after another forward");
    FU_TRY(done, "FSDP backward", fsdp_backward(lf, NULL));
    FU_TRY(done, "DDP forward", fwd_loss(ref, ddp, x, NULL, &ld));
    FU_TRY(done, "DDP backward", fsdp_backward(ld, NULL));
    fu_ck(r, fu_closeness(item(lf), item(ld), RTOL, ATOL) <= 1.0, "the second loss equals DDP's",
          "%.9g vs %.9g", item(lf), item(ld));
done:
    fsdp_tensor_release(x), fsdp_tensor_release(lf), fsdp_tensor_release(ld);
    fsdp_named_list_free(&fl);
    fsdp_named_list_free(&rl);
    fsdp_policy_release(pol);
    fsdp_optim_destroy(ref_opt);
    fsdp_ddp_destroy(ddp);
    fsdp_module_release(ref);
    fu_teardown(ctx, m, root, NULL, opt);
    return rc < 0 ? rc : 0;
}

/* ---- UOP-FQ-01 ------------------------------------------------------------------------------- */

static int fq_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                      fsdp_tensor_t **out) {
    if (nin != 1 || nout != 1) return FSDP_EINVAL;
    return fsdp_module_forward1(fsdp_module_child(m, "lin"), in[0], &out[0]);
}

static const fsdp_module_ops_t fq_ops = {"Model", fq_forward, NULL};

/* What the root's named parameters looked like inside its forward. */
typedef struct fq_seen {
    fsdp_module_t *root;
    int calls;
    size_t n;
    char names[4][32];
    int ndim[4];
    int64_t shape[4][2];
} fq_seen_t;

static int fq_pre_hook(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t **in) {
    (void)m, (void)nin, (void)in;
    fq_seen_t *s = arg;
    fsdp_named_list_t l = {0};
    int rc = fsdp_module_named_params(s->root, false, &l);
    s->calls++;
    s->n = l.n;
    for (size_t i = 0; rc == 0 && i < l.n && i < 4; i++) {
        snprintf(s->names[i], sizeof s->names[i], "%s", l.names[i]);
        s->ndim[i] = fsdp_tensor_ndim(l.tensors[i]);
        for (int d = 0; d < s->ndim[i] && d < 2; d++)
            s->shape[i][d] = fsdp_tensor_size(l.tensors[i], d);
    }
    fsdp_named_list_free(&l);
    return rc;
}

static int fq_rank(fsdp_ctx_t *ctx, void *arg) {
    uop_job_t *uj = arg;
    fu_res_t *r = fu_res_of(&uj->j, ctx);
    fsdp_module_t *m = NULL, *l = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *x = NULL, *y = NULL;
    fq_seen_t seen = {0};
    int rc, h;
    FU_TRY(done, "model", fsdp_module_create(ctx, &fq_ops, NULL, &m));
    tm_manual_seed(ctx, 0);
    FU_TRY(done, "model", fsdp_linear_create(ctx, 5, 5, true, &l));
    FU_TRY(done, "model", fsdp_module_add_child(m, "lin", l));
    fsdp_options_t o;
    fu_job_options(&uj->j, &o);
    FU_TRY(done, "wrapping", fsdp_wrap(m, &o, &root));
    seen.root = m;
    FU_TRY(done, "hook", fsdp_module_add_forward_pre_hook(l, fq_pre_hook, &seen, &h));
    FU_TRY(done, "input", fu_rand_input(ctx, 7, 2, 5, &x));
    FU_TRY(done, "forward", fsdp_module_forward1(m, x, &y));
    bool ok = seen.calls == 1 && seen.n == 2 && strcmp(seen.names[0], "lin.weight") == 0 &&
              strcmp(seen.names[1], "lin.bias") == 0 && seen.ndim[0] == 2 &&
              seen.shape[0][0] == 5 && seen.shape[0][1] == 5 && seen.ndim[1] == 1 &&
              seen.shape[1][0] == 5;
    fu_ck(r, ok,
          "inside forward the named parameters are lin.weight (5, 5) and lin.bias (5,): clean "
          "names, unsharded shapes",
          "%d calls, %zu parameters: '%s' ndim %d (%lld, %lld), '%s' ndim %d (%lld)", seen.calls,
          seen.n, seen.names[0], seen.ndim[0], (long long)seen.shape[0][0],
          (long long)seen.shape[0][1], seen.names[1], seen.ndim[1], (long long)seen.shape[1][0]);
    bool outside = true;
    for (size_t i = 0; i < fsdp_unit_num_params(root); i++) {
        fsdp_param_info_t pi;
        outside &= fsdp_unit_param_info(root, i, &pi) == 0 && fsdp_tensor_ndim(pi.param) == 1 &&
                   fsdp_tensor_numel(pi.param) == pi.numel_in_shard;
    }
    fu_ck(r, outside, "outside forward they are 1-D views of this rank's shard", "not so");
done:
    fsdp_tensor_release(x), fsdp_tensor_release(y);
    fsdp_module_release(l);
    fu_teardown(ctx, m, root, NULL, NULL);
    return rc < 0 ? rc : 0;
}

/* ---- UOP-WB-01..04 ------------------------------------------------------------------------- */

/* TestFSDPUseOrigParamsWriteback.Model wrapped as one unit (no policy, or types), with a DDP
 * replica. */
static int wb_setup(fu_res_t *r, fsdp_ctx_t *ctx, const uop_job_t *uj, bool linear_units,
                    fsdp_module_t **m, fsdp_unit_t **root, fsdp_module_t **ref, fsdp_ddp_t **ddp) {
    int rc;
    FU_TRY(fail, "building the models", tm_writeback_create(ctx, m));
    FU_TRY(fail, "building the models", tm_writeback_create(ctx, ref));
    FU_TRY(fail, "DDP", fsdp_ddp_create(*ref, NULL, NULL, ddp));
    fsdp_options_t o;
    fu_job_options(&uj->j, &o);
    static const char *const types[] = {"Linear", NULL};
    if (linear_units)
        FU_TRY(fail, "wrapping", fu_wrap_types(*m, &o, types, root));
    else
        FU_TRY(fail, "wrapping", fsdp_wrap(*m, &o, root));
fail:
    return rc;
}

/* A tensor shaped like t (dims of shape when given) filled with v, on t's device. */
static int like(fsdp_ctx_t *ctx, const fsdp_tensor_t *t, int ndim, const int64_t *shape, double v,
                fsdp_tensor_t **out) {
    if (!shape) ndim = fsdp_tensor_ndim(t), shape = fsdp_tensor_shape(t);
    return fsdp_tensor_full(ctx, FSDP_DTYPE_F32, ndim, shape, v, FSDP_MEM_PARAMS, out);
}

static int wb01_rank(fsdp_ctx_t *ctx, void *arg) {
    uop_job_t *uj = arg;
    fu_res_t *r = fu_res_of(&uj->j, ctx);
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_ddp_t *ddp = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *nt = NULL;
    fsdp_named_list_t l = {0};
    int rc;
    const char *name = uj->which == 0 ? "lin1.weight" : "lin2.weight";
    FU_TRY(done, "setup", wb_setup(r, ctx, uj, false, &m, &root, &ref, &ddp));
    fsdp_tensor_t *p = fsdp_module_param(m, name);
    FU_TRY(done, "new value", like(ctx, p, 0, NULL, 2.0, &nt));
    if (uj->flag) {
        FU_TRY(done, "p.data = 2", fsdp_tensor_set_data(p, nt));
    } else {
        FU_TRY(done, "requires_grad", fsdp_tensor_set_requires_grad(nt, true));
        FU_TRY(done, "module.p = Parameter(2)", fsdp_module_set_param(m, name, nt, false));
    }
    FU_TRY(done, "DDP's change", fsdp_tensor_fill_(fsdp_module_param(ref, name), 2.0));
    char why[400];
    double c = summoned_vs(root, m, ref, why, sizeof why);
    fu_ck(r, c <= 1.0, "the change is written back: summoned parameters equal DDP's",
          "closeness %.3g: %s", c, why);
    fsdp_tensor_t *now = fsdp_module_param(m, name);
    fsdp_tensor_t *flat = fsdp_unit_flat_param(root);
    fu_ck(r, fsdp_tensor_same_storage(now, flat) || fsdp_tensor_numel(now) == 0,
          "the parameter object views the shard again", "it does not");
    FU_TRY(done, "named params", fsdp_named_params(root, &l));
    bool listed = false;
    for (size_t i = 0; i < l.n; i++)
        listed |= strcmp(l.names[i], name) == 0 && l.tensors[i] == now;
    fu_ck(r, listed && (uj->flag ? now == p : now == nt),
          "the object in the module slot is the one FSDP hands the optimizer",
          "listed %d, same object %d", listed, uj->flag ? now == p : now == nt);
    char why2[800];
    c = fu_shards_vs(root, NULL, false, fu_ref_param, ref, RTOL, ATOL, why2, sizeof why2);
    fu_ck(r, c <= 1.0, "the shard holds DDP's values", "closeness %.3g: %s", c, why2);
done:
    fsdp_tensor_release(nt);
    fsdp_named_list_free(&l);
    fsdp_ddp_destroy(ddp);
    fsdp_module_release(ref);
    fu_teardown(ctx, m, root, NULL, NULL);
    return rc < 0 ? rc : 0;
}

static int fwd_bwd2(fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_module_t *ref, fsdp_ddp_t *ddp,
                    uint64_t seed) {
    fsdp_tensor_t *x = NULL, *lf = NULL, *ld = NULL;
    int rc = fu_rand_input(ctx, seed + 31 * (uint64_t)fsdp_ctx_rank(ctx), 2, 5, &x);
    if (rc == 0) rc = fwd_loss(m, NULL, x, NULL, &lf);
    if (rc == 0) rc = fsdp_backward(lf, NULL);
    if (rc == 0) rc = fwd_loss(ref, ddp, x, NULL, &ld);
    if (rc == 0) rc = fsdp_backward(ld, NULL);
    fsdp_tensor_release(x), fsdp_tensor_release(lf), fsdp_tensor_release(ld);
    return rc;
}

static int wb02_rank(fsdp_ctx_t *ctx, void *arg) {
    uop_job_t *uj = arg;
    fu_res_t *r = fu_res_of(&uj->j, ctx);
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_ddp_t *ddp = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *nt = NULL;
    fsdp_optim_t *opt = NULL, *ref_opt = NULL;
    fsdp_named_list_t fl = {0}, rl = {0};
    int rc;
    const char *name = uj->which == 0 ? "lin1.weight" : "lin2.weight";
    FU_TRY(done, "setup", wb_setup(r, ctx, uj, false, &m, &root, &ref, &ddp));
    FU_TRY(done, "optimizers", fsdp_named_params(root, &fl));
    FU_TRY(done, "optimizers", fsdp_module_named_params(ref, false, &rl));
    FU_TRY(done, "optimizers", adam_over(ctx, &fl, &opt));
    FU_TRY(done, "optimizers", adam_over(ctx, &rl, &ref_opt));
    FU_TRY(done, "forward and backward", fwd_bwd2(ctx, m, ref, ddp, 11));
    fsdp_tensor_t *p = fsdp_module_param(m, name), *rp = fsdp_module_param(ref, name);
    if (uj->set_to_none) {
        FU_TRY(done, "grad = None", fsdp_tensor_set_grad(p, NULL));
        FU_TRY(done, "grad = None", fsdp_tensor_set_grad(rp, NULL));
    } else if (uj->flag) {
        fsdp_tensor_t *g = fsdp_tensor_grad(p);
        if (g) { /* only where this rank's gradient is not none */
            FU_TRY(done, "new value", like(ctx, g, 0, NULL, 2.0, &nt));
            FU_TRY(done, "grad.data = 2", fsdp_tensor_set_data(g, nt));
        }
        FU_TRY(done, "DDP's change", fsdp_tensor_fill_(fsdp_tensor_grad(rp), 2.0));
    } else {
        FU_TRY(done, "new value", like(ctx, p, 0, NULL, 2.0, &nt));
        FU_TRY(done, "grad = 2", fsdp_tensor_set_grad(p, nt));
        FU_TRY(done, "DDP's change", fsdp_tensor_fill_(fsdp_tensor_grad(rp), 2.0));
    }
    FU_TRY(done, "step", fsdp_optim_step(opt));
    FU_TRY(done, "step", fsdp_optim_step(ref_opt));
    ck_params(r, root, m, ref, "the step sees the changed gradient");
    /* No zero_grad: the next backward accumulates onto the written-back gradient. */
    FU_TRY(done, "forward and backward", fwd_bwd2(ctx, m, ref, ddp, 12));
    char why[800];
    double c = fu_shards_vs(root, NULL, true, fu_ref_grad, ref, RTOL, ATOL, why, sizeof why);
    fu_ck(r, c <= 1.0, "the next backward accumulates onto the written-back gradient (DDP's)",
          "closeness %.3g: %s", c, why);
    FU_TRY(done, "step", fsdp_optim_step(opt));
    FU_TRY(done, "step", fsdp_optim_step(ref_opt));
    ck_params(r, root, m, ref, "after the second step");
done:
    fsdp_tensor_release(nt);
    fsdp_named_list_free(&fl);
    fsdp_named_list_free(&rl);
    fsdp_optim_destroy(ref_opt);
    fsdp_ddp_destroy(ddp);
    fsdp_module_release(ref);
    fu_teardown(ctx, m, root, NULL, opt);
    return rc < 0 ? rc : 0;
}

static int wb03_rank(fsdp_ctx_t *ctx, void *arg) {
    uop_job_t *uj = arg;
    fu_res_t *r = fu_res_of(&uj->j, ctx);
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_ddp_t *ddp = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *nt = NULL, *ng = NULL;
    int rc, rank = fsdp_ctx_rank(ctx);
    FU_TRY(done, "setup", wb_setup(r, ctx, uj, false, &m, &root, &ref, &ddp));
    const char *name = rank == 0 ? "lin1.weight" : "lin2.weight";
    const int64_t shape[2] = {rank == 0 ? 6 : 8, 6};
    int64_t want = fsdp_tensor_numel(fsdp_module_param(m, name));
    FU_TRY(done, "new parameter", like(ctx, NULL, 2, shape, 1.0, &nt));
    FU_TRY(done, "new parameter", fsdp_tensor_set_requires_grad(nt, true));
    FU_TRY(done, "new gradient", like(ctx, NULL, 2, shape, 1.0, &ng));
    FU_TRY(done, "new gradient", fsdp_tensor_set_grad(nt, ng));
    FU_TRY(done, "module.p = Parameter(...)", fsdp_module_set_param(m, name, nt, true));
    rc = fsdp_summon_begin(root, NULL);
    const char *msg = fsdp_ctx_last_error(ctx);
    char got[32], exp[32];
    snprintf(got, sizeof got, "[%d, 6]", rank == 0 ? 6 : 8);
    snprintf(exp, sizeof exp, "[%lld]", (long long)want);
    fu_ck(r,
          rc == FSDP_EINVAL && strstr(msg, "Cannot writeback") && strstr(msg, name) &&
              strstr(msg, got) && strstr(msg, exp),
          "a replacement of another shape fails the summon: EINVAL \"Cannot writeback\", naming "
          "the parameter and both shapes",
          "%s: %s", fsdp_err_name(rc), msg);
    if (rc == 0) fsdp_summon_end(root);
    fu_ck(r, fsdp_unit_state(root) == FSDP_STATE_IDLE, "the unit is left idle", "state %d",
          (int)fsdp_unit_state(root));
    rc = 0;
done:
    fsdp_tensor_release(nt), fsdp_tensor_release(ng);
    fsdp_ddp_destroy(ddp);
    fsdp_module_release(ref);
    fu_teardown(ctx, m, root, NULL, NULL);
    return rc < 0 ? rc : 0;
}

static int wb04_rank(fsdp_ctx_t *ctx, void *arg) {
    uop_job_t *uj = arg;
    fu_res_t *r = fu_res_of(&uj->j, ctx);
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_ddp_t *ddp = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *x = NULL, *loss = NULL, *c = NULL;
    int rc;
    FU_TRY(done, "setup", wb_setup(r, ctx, uj, true, &m, &root, &ref, &ddp));
    FU_TRY(done, "input", fu_rand_input(ctx, 3, 2, 5, &x));
    FU_TRY(done, "forward", fwd_loss(m, NULL, x, NULL, &loss));
    fsdp_tensor_t *p = fsdp_module_param(m, "lin1.weight");
    FU_TRY(done, "clone", fsdp_tensor_clone(p, FSDP_MEM_PARAMS, &c));
    if (uj->flag) {
        FU_TRY(done, "p.data = p.clone()", fsdp_tensor_set_data(p, c));
    } else {
        FU_TRY(done, "requires_grad", fsdp_tensor_set_requires_grad(c, true));
        FU_TRY(done, "module.p = Parameter(p.clone())",
               fsdp_module_set_param(m, "lin1.weight", c, false));
    }
    rc = fsdp_backward(loss, NULL);
    const char *msg = fsdp_ctx_last_error(ctx);
    if (uj->j.strategy == FSDP_SHARD_GRAD_OP) {
        fu_ck(r,
              rc == FSDP_EINVAL &&
                  strstr(msg, "FSDP does not support changing the parameters between "
                              "forward and backward") &&
                  strstr(msg, "'lin1'") && strstr(msg, "'weight'"),
              "SHARD_GRAD_OP: backward fails: \"FSDP does not support changing the parameters "
              "between forward and backward\"",
              "%s: %s", fsdp_err_name(rc), msg);
    } else {
        fu_ck(r, rc == 0,
              "FULL_SHARD (resharded after forward): the change is written back and "
              "backward runs",
              "%s: %s", fsdp_err_name(rc), msg);
    }
    rc = 0;
done:
    fsdp_tensor_release(x), fsdp_tensor_release(loss), fsdp_tensor_release(c);
    fsdp_ddp_destroy(ddp);
    fsdp_module_release(ref);
    fu_teardown(ctx, m, root, NULL, NULL);
    return rc < 0 ? rc : 0;
}

/* ---- UOP-MT-01: world size 8, ranks with nothing ------------------------------------------- */

#define MT_WORLD 8
#define MT_STEPS 3
#define MT_EMPTY 1000

typedef struct mt_res {
    int rc[MT_WORLD];
    bool empty[MT_WORLD];   /* this rank's shard holds no element of the weight */
    double close[MT_WORLD]; /* of its part of the weight to the local model's */
    bool many_ok[MT_WORLD]; /* an Adam step over 1000 empty tensors is a no-op */
    char why[MT_WORLD][200];
} mt_res_t;

static int mt_rank(fsdp_ctx_t *ctx, void *arg) {
    mt_res_t *res = arg;
    int rank = fsdp_ctx_rank(ctx), world = fsdp_ctx_world_size(ctx);
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_optim_t *opt = NULL, *ref_opt = NULL, *many = NULL;
    fsdp_named_list_t fl = {0}, rl = {0};
    fsdp_tensor_t *x = NULL, *loss = NULL, *scaled = NULL, **empties = NULL;
    fsdp_adam_options_t ao;
    fsdp_adam_options_init(&ao);
    ao.lr = 1e-2;
    res->close[rank] = INFINITY;
    tm_manual_seed(ctx, 0);
    int rc = fsdp_linear_create(ctx, 3, 1, false, &m);
    tm_manual_seed(ctx, 0);
    if (rc == 0) rc = fsdp_linear_create(ctx, 3, 1, false, &ref);
    fsdp_options_t o;
    fsdp_options_init(&o);
    o.use_orig_params = true;
    o.check_exec_order = true;
    if (rc == 0) rc = fsdp_wrap(m, &o, &root);
    if (rc == 0) rc = fsdp_named_params(root, &fl);
    if (rc == 0) rc = fsdp_module_named_params(ref, false, &rl);
    if (rc == 0) rc = adam_over(ctx, &fl, &opt);
    if (rc == 0) rc = adam_over(ctx, &rl, &ref_opt);
    if (rc == 0) res->empty[rank] = fsdp_tensor_numel(fsdp_module_param(m, "weight")) == 0;
    for (int s = 0; s < MT_STEPS && rc == 0; s++) {
        rc = fsdp_optim_zero_grad(opt, true);
        if (rc == 0) rc = fsdp_optim_zero_grad(ref_opt, true);
        /* The local model on every rank's input, each loss scaled by 1/world (the mean). */
        for (int q = 0; q < world && rc == 0; q++) {
            rc = fu_rand_input(ctx, 70 + 10 * (uint64_t)q + (uint64_t)s, 2, 3, &x);
            if (rc == 0) rc = fwd_loss(ref, NULL, x, NULL, &loss);
            if (rc == 0) rc = fsdp_scale(loss, 1.0 / world, &scaled);
            if (rc == 0) rc = fsdp_backward(scaled, NULL);
            fsdp_tensor_release(x), fsdp_tensor_release(loss), fsdp_tensor_release(scaled);
            x = loss = scaled = NULL;
        }
        if (rc == 0) rc = fu_rand_input(ctx, 70 + 10 * (uint64_t)rank + (uint64_t)s, 2, 3, &x);
        if (rc == 0) rc = fwd_loss(m, NULL, x, NULL, &loss);
        if (rc == 0) rc = fsdp_backward(loss, NULL);
        if (rc == 0) rc = fsdp_optim_step(opt);
        if (rc == 0) rc = fsdp_optim_step(ref_opt);
        fsdp_tensor_release(x), fsdp_tensor_release(loss);
        x = loss = NULL;
    }
    if (rc == 0)
        res->close[rank] = fu_shards_vs(root, NULL, false, fu_ref_param, ref, RTOL, ATOL,
                                        res->why[rank], sizeof res->why[rank]);
    /* The seed's regression: a batched step over many zero-element tensors. */
    empties = calloc(MT_EMPTY, sizeof *empties);
    if (!empties && rc == 0) rc = FSDP_ENOMEM;
    const int64_t zero[1] = {0};
    for (int i = 0; i < MT_EMPTY && rc == 0; i++) {
        fsdp_tensor_t *g = NULL;
        char name[32];
        snprintf(name, sizeof name, "empty.%d", i);
        rc = fsdp_tensor_zeros(ctx, FSDP_DTYPE_F32, 1, zero, FSDP_MEM_PARAMS, &empties[i]);
        if (rc == 0) rc = fsdp_tensor_set_name(empties[i], name);
        if (rc == 0) rc = fsdp_tensor_set_requires_grad(empties[i], true);
        if (rc == 0) rc = fsdp_tensor_zeros(ctx, FSDP_DTYPE_F32, 1, zero, FSDP_MEM_GRADS, &g);
        if (rc == 0) rc = fsdp_tensor_set_grad(empties[i], g);
        fsdp_tensor_release(g);
    }
    if (rc == 0) rc = fsdp_optim_adam_create(ctx, &ao, true, &many);
    if (rc == 0) rc = fsdp_optim_add_group(many, MT_EMPTY, empties, NULL, NULL, NULL);
    double norm = -1;
    if (rc == 0) rc = fsdp_optim_step(many);
    if (rc == 0) rc = fsdp_clip_grad_norm(ctx, MT_EMPTY, empties, 1.0, 2.0, &norm);
    res->many_ok[rank] = rc == 0 && norm == 0.0;
    if (rc < 0) snprintf(res->why[rank], sizeof res->why[rank], "%s", fsdp_ctx_last_error(ctx));
    for (int i = 0; empties && i < MT_EMPTY; i++)
        fsdp_tensor_release(empties[i]);
    free(empties);
    fsdp_optim_destroy(many);
    fsdp_named_list_free(&fl);
    fsdp_named_list_free(&rl);
    fsdp_optim_destroy(ref_opt);
    fsdp_module_release(ref);
    fu_teardown(ctx, m, root, NULL, opt);
    res->rc[rank] = rc;
    return rc < 0 ? rc : 0;
}

static void run_mt01(void) {
    mt_res_t res;
    memset(&res, 0, sizeof res);
    fsdp_sim_options_t so;
    fsdp_sim_options_init(&so);
    so.world_size = MT_WORLD;
    so.timeout_ms = 60000;
    int st[MT_WORLD] = {0};
    int rc = fsdp_sim_run(&so, mt_rank, &res, st);
    int nempty = 0;
    bool close = true, many = true, ran = rc == 0;
    for (int q = 0; q < MT_WORLD; q++) {
        nempty += res.empty[q];
        if (!(res.close[q] <= 1.0)) {
            tap_diag("rank %d: closeness %.3g: %s", q, res.close[q], res.why[q]);
            close = false;
        }
        if (!res.many_ok[q]) tap_diag("rank %d: %s", q, res.why[q]);
        many &= res.many_ok[q];
        ran &= st[q] == 0 && res.rc[q] == 0;
    }
    tap_ok(nempty == 5, "UOP-MT-01 W=8: Linear(3, 1) leaves five ranks' shards empty (%d)", nempty);
    tap_ok(close, "UOP-MT-01 W=8: Adam over the (empty) original parameters matches the local "
                  "model trained on every rank's input");
    tap_ok(many, "UOP-MT-01 W=8: an Adam step and a clip over 1000 zero-element tensors are "
                 "no-ops");
    tap_ok(ran, "UOP-MT-01 W=8: every rank ran to the end without a library error");
}

/* ---- main -------------------------------------------------------------------------------- */

int main(void) {
    char prefix[160];
    tap_plan_lazy();
    for (int s = 0; s < 3; s++) {
        snprintf(prefix, sizeof prefix, "UOP-PA-01 %s",
                 fsdp_sharding_strategy_name(fu_strategies[s]));
        uop_run(uop_new(prefix, 2, fu_strategies[s]), pa_rank);
    }
    uop_run(uop_new("UOP-FQ-01", 2, FSDP_FULL_SHARD), fq_rank);
    for (int k = 0; k < 4; k++) {
        snprintf(prefix, sizeof prefix, "UOP-WB-01 change_first_weight=%d change_data=%d", !(k & 1),
                 !(k & 2));
        uop_job_t *u = uop_new(prefix, 2, FSDP_FULL_SHARD);
        u->which = k & 1, u->flag = !(k & 2);
        uop_run(u, wb01_rank);
    }
    for (int k = 0; k < 8; k++) {
        bool first = k & 1, data = k & 2, none = k & 4;
        if (data && none) continue; /* as the seed */
        snprintf(prefix, sizeof prefix,
                 "UOP-WB-02 change_first_weight_grad=%d change_data=%d set_to_none=%d", first, data,
                 none);
        uop_job_t *u = uop_new(prefix, 2, FSDP_FULL_SHARD);
        u->which = first ? 0 : 1, u->flag = data, u->set_to_none = none;
        uop_run(u, wb02_rank);
    }
    uop_run(uop_new("UOP-WB-03", 2, FSDP_FULL_SHARD), wb03_rank);
    for (int k = 0; k < 4; k++) {
        fsdp_sharding_strategy_t s = k & 2 ? FSDP_FULL_SHARD : FSDP_SHARD_GRAD_OP;
        snprintf(prefix, sizeof prefix, "UOP-WB-04 %s change_data=%d",
                 fsdp_sharding_strategy_name(s), !(k & 1));
        uop_job_t *u = uop_new(prefix, 2, s);
        u->flag = !(k & 1);
        uop_run(u, wb04_rank);
    }
    run_mt01();
    return tap_done();
}
