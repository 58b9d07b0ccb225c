/* SPDX-License-Identifier: MIT */
/*
 * t_no_sync.c: gradient accumulation without communication, fsdp_no_sync_begin/_end (spec F22,
 * F21, F06):
 *   UOP-NS-01  Linear(7, 1, no bias) as one unit at world size 2, FULL_SHARD, SHARD_GRAD_OP and
 *              NO_SHARD, with and without use_orig_params: a reference backward; zero_grad; a
 *              backward inside no_sync issues no collective, leaves the sharded gradient alone
 *              and keeps a full-size local gradient (7 -> 8 elements, the padding zero) equal
 *              to the unwrapped model's gradient of this rank's input; the next backward
 *              outside it reduces once, and the gradient is exactly twice the reference.
 *   UOP-NS-02  under mixed precision (param f16, reduce f32) the local gradient stays f16 over
 *              two backwards in no_sync; after the synced backward the gradient is f32.
 *   accumulation parity: Sequential(3 x Linear(5, 5)), a unit per Linear and the root, two
 *              steps of three micro-batches (two in no_sync, the last synced): one reduction
 *              per unit and step, and parameters after each step equal, within the spec's
 *              fp32 tolerance, those of the unwrapped model trained on every rank's
 *              micro-batches (the world's mean gradient), computed on each rank independently.
 *   errors     begin on a unit that is not a root, twice, end without begin, and begin from a
 *              backward hook are refused with FSDP_EINVAL and a message; nothing changes.
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

#define RTOL 1.3e-6
#define ATOL 1e-5

/* Collective calls of a kind on a group since its counters were reset. */
static uint64_t calls(const fsdp_pg_t *pg, fsdp_coll_kind_t k) {
    fsdp_pg_counters_t c;
    fsdp_pg_get_counters(pg, &c);
    return c.calls[k];
}

static uint64_t reductions(const fsdp_pg_t *pg) {
    return calls(pg, FSDP_COLL_REDUCE_SCATTER) + calls(pg, FSDP_COLL_ALL_REDUCE);
}

/* loss = sum(m(x)); backward. */
static int fwd_bwd(fsdp_module_t *m, fsdp_tensor_t *x, double scale) {
    fsdp_tensor_t *out = NULL, *loss = NULL, *scaled = NULL;
    int rc = fsdp_module_forward1(m, x, &out);
    if (rc == 0) rc = tm_sum_loss(out, &loss);
    if (rc == 0 && scale != 1.0) rc = fsdp_scale(loss, scale, &scaled);
    if (rc == 0) rc = fsdp_backward(scaled ? scaled : loss, NULL);
    fsdp_tensor_release(out);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(scaled);
    return rc;
}

static int linear_7_1(fsdp_ctx_t *ctx, fsdp_module_t **m) {
    tm_manual_seed(ctx, 0);
    return fsdp_linear_create(ctx, 7, 1, false, m);
}

/* ---- UOP-NS-01 ------------------------------------------------------------------------------- */

static int ns01_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_tensor_t *x = NULL;
    float *g1 = NULL, *gl = NULL, *loc = NULL, *g2 = NULL;
    int64_t n1 = 0, nl = 0, nloc = 0, n2 = 0;
    int rc;
    bool sharded = j->strategy != FSDP_NO_SHARD;
    FU_TRY(done, "building Linear(7, 1)", linear_7_1(ctx, &m));
    FU_TRY(done, "building Linear(7, 1)", linear_7_1(ctx, &ref));
    fsdp_options_t o;
    fu_job_options(j, &o);
    FU_TRY(done, "wrapping", fsdp_wrap(m, &o, &root));
    FU_TRY(done, "optimizer", fu_make_fsdp_sgd(ctx, root, 0.1, 0.0, &opt));
    FU_TRY(done, "input", fu_rand_input(ctx, 3 + (uint64_t)fsdp_ctx_rank(ctx), 2, 7, &x));
    fsdp_pg_t *pg = fsdp_unit_pg(root);
    fsdp_tensor_t *flat = fsdp_unit_flat_param(root);
    fsdp_flat_sizes_t fs;
    fsdp_unit_flat_sizes(root, &fs);

    /* This rank's unreduced gradient, from the unwrapped model. */
    FU_TRY(done, "reference backward", fwd_bwd(ref, x, 1.0));
    gl = fu_host_f32(fsdp_tensor_grad(fsdp_module_param(ref, "weight")), &nl);

    FU_TRY(done, "reference backward", fwd_bwd(m, x, 1.0));
    g1 = fu_host_f32(fsdp_tensor_grad(flat), &n1);
    fu_ck(r, g1 && gl && nl == 7, "reference gradients exist", "flat %p, unwrapped %p (%lld)",
          (void *)g1, (void *)gl, (long long)nl);
    FU_TRY(done, "zero_grad", fsdp_optim_zero_grad(opt, true));

    fu_ck(r, !fsdp_in_no_sync(root), "F22: not in no_sync before begin", "in no_sync");
    FU_TRY(done, "fsdp_no_sync_begin", fsdp_no_sync_begin(root));
    fu_ck(r, fsdp_in_no_sync(root), "F22: in no_sync after begin", "not in no_sync");
    fsdp_pg_reset_counters(pg);
    FU_TRY(done, "backward in no_sync", fwd_bwd(m, x, 1.0));
    fu_ck(r, reductions(pg) == 0, "UOP-NS-01: backward in no_sync issues no reduction",
          "%llu reduce-scatters, %llu all-reduces",
          (unsigned long long)calls(pg, FSDP_COLL_REDUCE_SCATTER),
          (unsigned long long)calls(pg, FSDP_COLL_ALL_REDUCE));
    fu_ck(r, fsdp_tensor_grad(flat) == NULL,
          "UOP-NS-01: the sharded gradient is untouched in no_sync (still none)", "it has one");
    fsdp_tensor_t *lg = fsdp_unit_local_grad(root);
    loc = lg ? fu_host_f32(lg, &nloc) : NULL;
    fu_ck(r, loc && nloc == fs.padded_numel && (!sharded || nloc > fs.shard_numel),
          "UOP-NS-01: a full-size local gradient (unsharded, padded) although the shard is smaller",
          "local gradient %lld elements, padded %lld, shard %lld", (long long)nloc,
          (long long)fs.padded_numel, (long long)fs.shard_numel);
    if (loc && gl && nloc >= 7) {
        double worst = 0;
        for (int i = 0; i < 7; i++) {
            double c = fu_closeness(loc[i], gl[i], RTOL, ATOL);
            if (c > worst) worst = c;
        }
        fu_ck(r, worst <= 1.0,
              "UOP-NS-01: the local gradient is this rank's own (unreduced) gradient",
              "closeness %.3g", worst);
        bool pad_zero = true;
        for (int64_t i = 7; i < nloc; i++)
            pad_zero = pad_zero && loc[i] == 0.0f;
        fu_ck(r, pad_zero, "F06: the local gradient's padding stays zero", "nonzero padding");
    }
    fu_ck(r, fu_tree_idle(root), "F19: IDLE and resharded after a backward in no_sync", "not idle");
    FU_TRY(done, "fsdp_no_sync_end", fsdp_no_sync_end(root));

    fsdp_pg_reset_counters(pg);
    FU_TRY(done, "synced backward", fwd_bwd(m, x, 1.0));
    fu_ck(r, reductions(pg) == 1, "UOP-NS-01: the synced backward reduces once", "%llu reductions",
          (unsigned long long)reductions(pg));
    fu_ck(r, fsdp_unit_local_grad(root) == NULL,
          "UOP-NS-01: the local gradient is consumed by the synced backward", "still there");
    g2 = fu_host_f32(fsdp_tensor_grad(flat), &n2);
    bool twice = g1 && g2 && n1 == n2;
    for (int64_t i = 0; twice && i < n1; i++)
        twice = g2[i] == 2.0f * g1[i];
    fu_ck(r, twice,
          "UOP-NS-01: after no_sync + synced backward the gradient is exactly 2x the "
          "reference",
          "n %lld vs %lld", (long long)n2, (long long)n1);
    if (j->orig) {
        /* The original parameter's gradient is a view of the flat gradient. */
        fsdp_named_list_t l = {0};
        fu_vals_t v = {0};
        FU_TRY(done, "named params", fsdp_named_params(root, &l));
        rc = fu_list_values(&l, true, &v);
        fsdp_named_list_free(&l);
        bool same = rc == 0 && g2 && (int64_t)v.n <= n2 && v.n > 0;
        for (size_t i = 0; same && i < v.n; i++)
            same = (float)v.v[i] == g2[i];
        fu_ck(r, same, "UOP-NS-01: use_orig_params: the original gradient is the flat one",
              "%zu values", v.n);
        fu_vals_free(&v);
        rc = 0;
    }
done:
    free(g1), free(gl), free(loc), free(g2);
    fsdp_tensor_release(x);
    fu_teardown(ctx, m, root, NULL, opt);
    fsdp_module_release(ref);
    return rc < 0 ? rc : 0;
}

/* ---- UOP-NS-02 ------------------------------------------------------------------------------- */

static int ns02_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *x = NULL;
    int rc;
    tm_manual_seed(ctx, 0);
    FU_TRY(done, "building Linear(3, 3)", fsdp_linear_create(ctx, 3, 3, true, &m));
    fsdp_options_t o;
    fu_job_options(j, &o);
    FU_TRY(done, "wrapping", fsdp_wrap(m, &o, &root));
    FU_TRY(done, "input", fu_rand_input(ctx, 7 + (uint64_t)fsdp_ctx_rank(ctx), 2, 3, &x));
    fsdp_tensor_t *flat = fsdp_unit_flat_param(root);
    FU_TRY(done, "fsdp_no_sync_begin", fsdp_no_sync_begin(root));
    for (int k = 1; k <= 2; k++) {
        FU_TRY(done, "backward in no_sync", fwd_bwd(m, x, 1.0));
        fsdp_tensor_t *lg = fsdp_unit_local_grad(root);
        char name[160];
        snprintf(name, sizeof name,
                 "UOP-NS-02: after backward %d in no_sync the accumulated gradient is f16", k);
        fu_ck(r, lg && fsdp_tensor_dtype(lg) == FSDP_DTYPE_F16, name, "%s",
              lg ? fsdp_dtype_name(fsdp_tensor_dtype(lg)) : "none");
        fu_ck(r, fsdp_tensor_grad(flat) == NULL, "UOP-NS-02: no sharded gradient in no_sync",
              "one exists");
    }
    FU_TRY(done, "fsdp_no_sync_end", fsdp_no_sync_end(root));
    FU_TRY(done, "synced backward", fwd_bwd(m, x, 1.0));
    fsdp_tensor_t *g = fsdp_tensor_grad(flat);
    fu_ck(r, g && fsdp_tensor_dtype(g) == FSDP_DTYPE_F32,
          "UOP-NS-02: after the synced backward the gradient is f32, ready for the optimizer", "%s",
          g ? fsdp_dtype_name(fsdp_tensor_dtype(g)) : "none");
done:
    fsdp_tensor_release(x);
    fu_teardown(ctx, m, root, NULL, NULL);
    return rc < 0 ? rc : 0;
}

/* ---- accumulation parity --------------------------------------------------------------------- */

#define ACC_STEPS 2
#define ACC_MICRO 3

static int acc_input(fsdp_ctx_t *ctx, int rank, int step, int micro, fsdp_tensor_t **x) {
    return fu_rand_input(ctx, 100 + (uint64_t)(rank * 97 + step * 13 + micro), 4, 5, x);
}

static int acc_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_unit_t *root = NULL, **u = NULL;
    fsdp_optim_t *opt = NULL, *ref_opt = NULL;
    fsdp_named_list_t ref_params = {0};
    fsdp_tensor_t *x = NULL;
    fu_vals_t a = {0}, b = {0};
    size_t n = 0;
    int rc;
    int world = fsdp_ctx_world_size(ctx), rank = fsdp_ctx_rank(ctx);
    FU_TRY(done, "building the models", fu_linear_stack(ctx, 3, 5, &m));
    FU_TRY(done, "building the models", fu_linear_stack(ctx, 3, 5, &ref));
    fsdp_options_t o;
    fu_job_options(j, &o);
    static const char *const types[] = {"Linear", NULL};
    FU_TRY(done, "wrapping", fu_wrap_types(m, &o, types, &root));
    FU_TRY(done, "wrapping", fsdp_units(root, &u, &n));
    FU_TRY(done, "optimizers", fu_make_fsdp_sgd(ctx, root, 0.1, 0.0, &opt));
    FU_TRY(done, "optimizers", fsdp_module_named_params(ref, false, &ref_params));
    FU_TRY(done, "optimizers", fu_make_sgd(ctx, &ref_params, 0.1, 0.0, &ref_opt));
    fu_ck(r, n == 4, "a unit per Linear and the root", "%zu units", n);
    fsdp_pg_t *pg = fsdp_unit_pg(root);
    for (int step = 0; step < ACC_STEPS; step++) {
        /* Reference: the unwrapped model on every rank's micro-batches, the mean over ranks. */
        FU_TRY(done, "reference", fsdp_optim_zero_grad(ref_opt, true));
        for (int q = 0; q < world; q++)
            for (int mi = 0; mi < ACC_MICRO; mi++) {
                FU_TRY(done, "reference input", acc_input(ctx, q, step, mi, &x));
                FU_TRY(done, "reference backward", fwd_bwd(ref, x, 1.0 / world));
                fsdp_tensor_release(x);
                x = NULL;
            }
        FU_TRY(done, "reference step", fsdp_optim_step(ref_opt));

        FU_TRY(done, "zero_grad", fsdp_optim_zero_grad(opt, true));
        fsdp_pg_reset_counters(pg);
        for (int mi = 0; mi < ACC_MICRO; mi++) {
            bool last = mi == ACC_MICRO - 1;
            if (mi == 0) FU_TRY(done, "fsdp_no_sync_begin", fsdp_no_sync_begin(root));
            if (last) FU_TRY(done, "fsdp_no_sync_end", fsdp_no_sync_end(root));
            FU_TRY(done, "input", acc_input(ctx, rank, step, mi, &x));
            FU_TRY(done, "backward", fwd_bwd(m, x, 1.0));
            fsdp_tensor_release(x);
            x = NULL;
        }
        /* One reduction per unit with parameters (the Sequential root has none); a group of
         * one rank reduces nothing. */
        size_t want = 0;
        for (size_t i = 0; i < n && world > 1; i++)
            want += fsdp_unit_num_params(u[i]) > 0;
        char name[200];
        snprintf(name, sizeof name,
                 "F22: step %d: %d micro-batches cost one gradient reduction per unit", step,
                 ACC_MICRO);
        fu_ck(r, reductions(pg) == want, name, "%llu reductions, want %zu",
              (unsigned long long)reductions(pg), want);
        FU_TRY(done, "step", fsdp_optim_step(opt));
        FU_TRY(done, "summon", fu_summon_nowb(root));
        rc = fu_module_values(m, false, false, &a);
        int rc2 = fsdp_summon_end(root);
        FU_TRY(done, "parameters", rc < 0 ? rc : rc2);
        FU_TRY(done, "reference parameters", fu_module_values(ref, false, false, &b));
        double worst = a.n == b.n && a.n ? 0 : INFINITY;
        for (size_t i = 0; i < a.n && a.n == b.n; i++) {
            double c = fu_closeness(a.v[i], b.v[i], RTOL, ATOL);
            if (!(c <= worst)) worst = c;
        }
        snprintf(name, sizeof name,
                 "F22/F21: step %d: parameters equal the unwrapped model's on all ranks' "
                 "micro-batches",
                 step);
        fu_ck(r, worst <= 1.0, name, "closeness %.3g over %zu vs %zu values", worst, a.n, b.n);
    }
done:
    fsdp_tensor_release(x);
    fu_vals_free(&a);
    fu_vals_free(&b);
    fsdp_named_list_free(&ref_params);
    fsdp_optim_destroy(ref_opt);
    fu_teardown(ctx, m, root, u, opt);
    fsdp_module_release(ref);
    return rc < 0 ? rc : 0;
}

/* ---- errors ---------------------------------------------------------------------------------- */

struct hook_probe {
    fsdp_unit_t *root;
    int rc;
};

static int begin_in_backward(fsdp_module_t *m, void *arg, bool has_grad) {
    (void)m, (void)has_grad;
    struct hook_probe *p = arg;
    if (p->rc == 1) p->rc = fsdp_no_sync_begin(p->root);
    return FSDP_OK;
}

static int errors_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL, **u = NULL;
    fsdp_tensor_t *x = NULL;
    size_t n = 0;
    int rc;
    FU_TRY(done, "building", fu_linear_stack(ctx, 2, 4, &m));
    fsdp_options_t o;
    fu_job_options(j, &o);
    static const char *const types[] = {"Linear", NULL};
    FU_TRY(done, "wrapping", fu_wrap_types(m, &o, types, &root));
    FU_TRY(done, "wrapping", fsdp_units(root, &u, &n));
    fsdp_unit_t *child = n > 1 ? u[1] : NULL;
    rc = fsdp_no_sync_begin(child);
    fu_ck_einval(r, ctx, rc, "fsdp_no_sync_begin", "not a root",
                 "begin on a unit that is not "
                 "the root is refused");
    fu_ck(r, !fsdp_in_no_sync(root), "... and changes nothing", "in no_sync");
    rc = fsdp_no_sync_end(root);
    fu_ck_einval(r, ctx, rc, "fsdp_no_sync_end", "not in no_sync", "end without begin");
    FU_TRY(done, "begin", fsdp_no_sync_begin(root));
    rc = fsdp_no_sync_begin(root);
    fu_ck_einval(r, ctx, rc, "fsdp_no_sync_begin", "already", "begin twice (no nesting)");
    FU_TRY(done, "end", fsdp_no_sync_end(root));
    fu_ck(r, !fsdp_in_no_sync(root), "end after a refused second begin turns it off", "on");

    struct hook_probe p = {root, 1};
    int h = 0;
    FU_TRY(done, "hook", fsdp_module_add_backward_hook(m, begin_in_backward, &p, &h));
    FU_TRY(done, "input", fu_rand_input(ctx, 1, 2, 4, &x));
    FU_TRY(done, "backward", fwd_bwd(m, x, 1.0));
    fu_ck_einval(r, ctx, p.rc, "fsdp_no_sync_begin", "backward",
                 "begin from inside a backward is refused");
    fu_ck(r, !fsdp_in_no_sync(root), "... and the tree stays synced", "in no_sync");
    fsdp_module_remove_hook(m, h);
    rc = 0;
done:
    fsdp_tensor_release(x);
    fu_teardown(ctx, m, root, u, NULL);
    return rc < 0 ? rc : 0;
}

int main(void) {
    tap_plan_lazy();
    static const fsdp_sharding_strategy_t strategies[] = {FSDP_FULL_SHARD, FSDP_SHARD_GRAD_OP,
                                                          FSDP_NO_SHARD};
    char prefix[160];
    for (size_t s = 0; s < 3; s++)
        for (int orig = 0; orig <= 1; orig++) {
            snprintf(prefix, sizeof prefix, "UOP-NS-01 %s%s",
                     fsdp_sharding_strategy_name(strategies[s]), orig ? " use_orig_params" : "");
            fu_run(prefix, 2, strategies[s], orig, ns01_rank);
        }
    for (size_t s = 0; s < 3; s++) {
        fu_job_t *j = fu_job_new("UOP-NS-02", 2, strategies[s], true);
        snprintf(j->prefix, sizeof j->prefix, "UOP-NS-02 %s fp16/f32",
                 fsdp_sharding_strategy_name(strategies[s]));
        fsdp_mixed_precision_init(&j->mp);
        j->mp.enabled = true;
        j->mp.param_dtype = FSDP_DTYPE_F16;
        j->mp.reduce_dtype = FSDP_DTYPE_F32;
        fu_run_job(j, ns02_rank);
        free(j);
    }
    static const int worlds[] = {1, 2, 3};
    for (size_t s = 0; s < 3; s++)
        for (size_t w = 0; w < 3; w++) {
            snprintf(prefix, sizeof prefix, "F22 accumulation %s",
                     fsdp_sharding_strategy_name(strategies[s]));
            fu_run(prefix, worlds[w], strategies[s], w == 2, acc_rank);
        }
    fu_run("F22 errors", 2, FSDP_FULL_SHARD, false, errors_rank);
    return tap_done();
}
