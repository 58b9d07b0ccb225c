/* SPDX-License-Identifier: MIT */
/*
 * t_wrap_train.c: units made by the wrap APIs, trained on sim ranks, against PyTorch's
 * test_wrap.py (spec section 5) and the mixed-precision rule for batch norm: WRAP-FW-04
 * against DDP over the cpu_offload x backward_prefetch x forward_prefetch matrix, WRAP-TA-14's
 * smoke step at world 1 and 2, the thread-local scope of the manual API (WRAP-TA-02), the
 * composable fsdp_fully_shard against fsdp_wrap, and a batch-norm unit that the mixed-precision
 * rule made full-precision running in f32 between low-precision units (MP-S07's C analog, with
 * upstream's _override_module_mixed_precision hooks). t_wrap.c covers construction.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "mp_run.h"
#include "models/models.h"
#include "tap.h"
#include "wrap_util.h"

/* ---- WRAP-FW-04: options propagate, and the units train as DDP does ------------------------- */

#define FW04_STEPS 6

static int ones_input(fsdp_ctx_t *c, fsdp_tensor_t **x) {
    const int64_t shape[2] = {1, 1};
    return fsdp_tensor_full(c, FSDP_DTYPE_F32, 2, shape, 1.0, FSDP_MEM_ACTIVATIONS, x);
}

/* forward, sum, backward, step; *y receives the output (a new reference). */
static int fw04_step(fsdp_module_t *m, fsdp_ddp_t *d, fsdp_optim_t *opt, fsdp_tensor_t *x,
                     fsdp_tensor_t **y) {
    fsdp_tensor_t *loss = NULL;
    int rc = d ? fsdp_ddp_forward1(d, x, y) : fsdp_module_forward1(m, x, y);
    if (rc == 0) rc = tm_sum_loss(*y, &loss);
    if (rc == 0) rc = fsdp_backward(loss, NULL);
    if (rc == 0) rc = fsdp_optim_step(opt); /* no zero_grad: upstream's loop has none */
    fsdp_tensor_release(loss);
    return rc;
}

static int fw04_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_unit_t *root = NULL, **u = NULL;
    fsdp_ddp_t *ddp = NULL;
    fsdp_optim_t *opt = NULL, *ref_opt = NULL;
    fsdp_policy_t *p = wu_size_policy(0);
    fsdp_named_list_t rl = {0};
    fsdp_tensor_t *x = NULL, *y = NULL, *yr = NULL;
    size_t n = 0;
    int rc;
    char why[600] = "";
    FU_TRY(done, "building the models", wu_my_model(ctx, false, &m));
    FU_TRY(done, "building the models", wu_my_model(ctx, false, &ref));
    fsdp_options_t o;
    fu_job_options(j, &o);
    o.auto_wrap_policy = p;
    FU_TRY(done, "fsdp_wrap with size policy min 0", fsdp_wrap(m, &o, &root));
    FU_TRY(done, "fsdp_units", fsdp_units(root, &u, &n));
    fu_ck(r, strcmp(wu_unit_names(root), "(root)|lin1|lin2|lin3|lin4|lin4.nested_lin") == 0,
          "min_num_params 0 makes every module a unit", "%s", wu_unit_names(root));
    bool same = true;
    fsdp_options_t ro;
    FU_TRY(done, "fsdp_unit_options", fsdp_unit_options(root, &ro));
    for (size_t i = 0; i < n; i++) {
        fsdp_options_t uo;
        FU_TRY(done, "fsdp_unit_options", fsdp_unit_options(u[i], &uo));
        if (uo.cpu_offload != j->offload || uo.backward_prefetch != j->bp ||
            uo.forward_prefetch != j->fwd_prefetch || uo.cpu_offload != ro.cpu_offload ||
            uo.backward_prefetch != ro.backward_prefetch ||
            uo.forward_prefetch != ro.forward_prefetch || uo.strategy != ro.strategy ||
            uo.pg != ro.pg || uo.limit_all_gathers != ro.limit_all_gathers ||
            uo.use_orig_params != ro.use_orig_params ||
            uo.check_exec_order != ro.check_exec_order || uo.auto_wrap_policy != NULL)
            fu_add_why(why, sizeof why, "%s: offload %d bwd %s fwd %d strategy %s",
                       fsdp_unit_fqn(u[i]), uo.cpu_offload,
                       fsdp_backward_prefetch_name(uo.backward_prefetch), uo.forward_prefetch,
                       fsdp_sharding_strategy_name(uo.strategy)),
                same = false;
    }
    fu_ck(r, same,
          "every unit reports the root's cpu_offload, backward_prefetch and "
          "forward_prefetch (and strategy, group, limit, use_orig_params)",
          "%s", why);
    fsdp_mem_stats_t ms;
    fsdp_mem_get_stats(ctx, &ms);
    fu_ck(r, (ms.current[FSDP_MEM_OFFLOAD] > 0) == j->offload,
          j->offload ? "with offload the shards live in host memory (FSDP_MEM_OFFLOAD)"
                     : "without offload nothing is in FSDP_MEM_OFFLOAD",
          "%zu bytes", ms.current[FSDP_MEM_OFFLOAD]);
    FU_TRY(done, "DDP reference", fsdp_ddp_create(ref, fsdp_ctx_pg(ctx), NULL, &ddp));
    FU_TRY(done, "optimizers", fu_make_fsdp_sgd(ctx, root, 0.01, 0.9, &opt));
    FU_TRY(done, "optimizers", fsdp_module_named_params(ref, false, &rl));
    FU_TRY(done, "optimizers", fu_make_sgd(ctx, &rl, 0.01, 0.9, &ref_opt));
    double worst = 0;
    bool idle = true;
    why[0] = 0;
    for (int s = 0; s < FW04_STEPS; s++) {
        FU_TRY(done, "the input", ones_input(ctx, &x));
        FU_TRY(done, "FSDP step", fw04_step(m, NULL, opt, x, &y));
        FU_TRY(done, "DDP step", fw04_step(ref, ddp, ref_opt, x, &yr));
        double c = fu_tensor_closeness(y, yr, FU_F32_RTOL, FU_F32_ATOL);
        if (c < 0 || c > 1) fu_add_why(why, sizeof why, "step %d: closeness %.3g", s, c);
        if (c < 0 || c > worst) worst = c < 0 ? INFINITY : c;
        idle &= fu_tree_idle(root);
        fsdp_tensor_release(x);
        fsdp_tensor_release(y);
        fsdp_tensor_release(yr);
        x = y = yr = NULL;
    }
    fu_ck(r, worst <= 1,
          "6 SGD(momentum 0.9) steps: each step's output equals DDP's (rtol 1.3e-6, "
          "atol 1e-5)",
          "%s", why);
    fu_ck(r, idle, "every unit idle and resharded after each step", "a unit was left running");
done:
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    fsdp_tensor_release(yr);
    fsdp_tape_clear(ctx);
    fsdp_named_list_free(&rl);
    free(u);
    fsdp_optim_destroy(opt);
    fsdp_optim_destroy(ref_opt);
    fsdp_ddp_destroy(ddp);
    fsdp_unit_destroy(root);
    fsdp_module_release(m);
    fsdp_module_release(ref);
    fsdp_policy_release(p);
    return rc < 0 ? rc : FSDP_OK;
}

static void test_fw04(void) {
    static const fsdp_backward_prefetch_t bps[2] = {FSDP_BACKWARD_POST, FSDP_BACKWARD_PRE};
    for (int off = 0; off < 2; off++)
        for (int b = 0; b < 2; b++)
            for (int f = 0; f < 2; f++) {
                char prefix[160];
                snprintf(prefix, sizeof prefix, "WRAP-FW-04 cpu_offload %d %s forward_prefetch %d",
                         off, fsdp_backward_prefetch_name(bps[b]), f);
                fu_job_t *j = fu_job_new(prefix, 2, FSDP_FULL_SHARD, false);
                j->offload = off;
                j->bp = bps[b];
                j->fwd_prefetch = f;
                fu_run_job(j, fw04_rank);
                free(j);
            }
}

/* ---- WRAP-TA-14: the auto-wrap smoke test ---------------------------------------------------- */

typedef struct ta14_job {
    fu_job_t base; /* first */
    bool device;   /* options.device: a second CPU device of the rank's context */
} ta14_job_t;

static int ta14_rank(fsdp_ctx_t *ctx, void *arg) {
    ta14_job_t *j = arg;
    fu_res_t *r = fu_res_of(&j->base, ctx);
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_device_t *A = NULL;
    fsdp_policy_t *p = wu_size_policy(40);
    fsdp_tensor_t *x = NULL, *y = NULL, *loss = NULL;
    int rc;
    FU_TRY(done, "NestedSequentialModel", tm_nested_sequential_create(ctx, &m));
    fsdp_options_t o;
    fu_job_options(&j->base, &o);
    o.auto_wrap_policy = p;
    if (j->device) {
        FU_TRY(done, "creating device A", fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &A));
        o.device = A;
    }
    FU_TRY(done, "fsdp_wrap with size policy 40", fsdp_wrap(m, &o, &root));
    fu_ck(r, strcmp(wu_unit_names(root), "(root)|2") == 0, "the root and [2] are the units", "%s",
          wu_unit_names(root));
    fsdp_unit_t *u2 = fsdp_unit_of(fsdp_module_child(m, "2"));
    fu_ck(r,
          !j->device ||
              (fsdp_unit_compute_device(root) == A && u2 && fsdp_unit_compute_device(u2) == A),
          "every unit computes on options.device when given", "not on A");
    if (A) FU_TRY(done, "fsdp_ctx_set_device(A)", fsdp_ctx_set_device(ctx, A));
    FU_TRY(done, "the input", fu_rand_input(ctx, 3, 1, 5, &x));
    FU_TRY(done, "forward", fsdp_module_forward1(m, x, &y));
    FU_TRY(done, "MSE loss", fsdp_mse_loss(x, y, FSDP_REDUCTION_MEAN, &loss));
    FU_TRY(done, "backward", fsdp_backward(loss, NULL));
    double lv = NAN;
    FU_TRY(done, "reading the loss", fsdp_tensor_item(loss, 0, &lv));
    fsdp_tensor_t *g0 = fsdp_tensor_grad(fsdp_unit_flat_param(root));
    fsdp_tensor_t *g2 = u2 ? fsdp_tensor_grad(fsdp_unit_flat_param(u2)) : NULL;
    fu_ck(r, isfinite(lv) && g0 && g2 && fu_tree_idle(root),
          "forward, MSE(input, output), backward: a finite loss, both units' sharded gradients, "
          "every unit idle",
          "loss %g, grads %p %p", lv, (void *)g0, (void *)g2);
done:
    fsdp_tensor_release(loss);
    fsdp_tensor_release(y);
    fsdp_tensor_release(x);
    fsdp_tape_clear(ctx);
    fsdp_unit_destroy(root);
    fsdp_module_release(m);
    fsdp_ctx_set_device(ctx, NULL);
    fsdp_device_destroy(A);
    fsdp_policy_release(p);
    return rc < 0 ? rc : FSDP_OK;
}

/* On the sim backend and, as the spec's C analog asks of every real backend, on Gloo processes
 * (each creating and destroying its group and file store). */
static void test_ta14(void) {
    for (int gloo = 0; gloo < 2; gloo++)
        for (int world = 1; world <= 2; world++)
            for (int off = 0; off < 2; off++)
                for (int dev = 0; dev < 2; dev++) {
                    char prefix[160];
                    snprintf(prefix, sizeof prefix, "WRAP-TA-14 %s cpu_offload %d device %d",
                             gloo ? "gloo" : "sim", off, dev);
                    ta14_job_t *j = malloc(sizeof *j);
                    if (!j) tap_bail("out of memory");
                    fu_job_init(&j->base, prefix, world, FSDP_FULL_SHARD, false);
                    j->base.offload = off;
                    j->device = dev;
                    if (!gloo)
                        fu_run_job(&j->base, ta14_rank);
                    else if (mp_run_job(&j->base, sizeof *j, ta14_rank) == FSDP_ENOTSUP)
                        tap_skip(1, "WRAP-TA-14 on Gloo: libfsdp was built without Gloo");
                    free(j);
                }
}

/* ---- WRAP-TA-02: the scope is per thread ---------------------------------------------------- */

static int scope_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    int rank = fsdp_ctx_rank(ctx), rc;
    fsdp_pg_t *self = NULL, *world = fsdp_ctx_pg(ctx);
    fsdp_module_t *l = NULL;
    fsdp_unit_t *u = NULL;
    bool opened = false;
    FU_TRY(done, "a dummy group of this rank",
           fsdp_pg_create_dummy(ctx, 0, 1, FSDP_DUMMY_NOOP, &self));
    FU_TRY(done, "Linear(5, 5)", fsdp_linear_create(ctx, 5, 5, true, &l));
    if (rank == 0) {
        fsdp_options_t o;
        fsdp_options_init(&o);
        o.pg = self;
        FU_TRY(done, "fsdp_enable_wrap", fsdp_enable_wrap(&o));
        opened = true;
    }
    FU_TRY(done, "barrier", fsdp_pg_barrier(world, NULL)); /* rank 0's scope is open now */
    bool enabled = fsdp_wrap_enabled();
    FU_TRY(done, "fsdp_wrap_scoped", fsdp_wrap_scoped(l, NULL, &u));
    bool want = rank == 0;
    fu_ck(r, enabled == want && (u != NULL) == want && (fsdp_unit_of(l) != NULL) == want,
          "while rank 0's scope is open, rank 0 wraps and rank 1 (no scope of its own) gets the "
          "identity",
          "rank %d: enabled %d, unit %p", rank, enabled, (void *)u);
    FU_TRY(done, "barrier", fsdp_pg_barrier(world, NULL));
done:
    if (opened) fsdp_disable_wrap();
    fsdp_unit_destroy(u);
    fsdp_module_release(l);
    fsdp_pg_destroy(self);
    return rc < 0 ? rc : FSDP_OK;
}

/* ---- fsdp_fully_shard against fsdp_wrap ------------------------------------------------------ */

#define FS_STEPS 3

/* The names of a listing joined by '|' into a malloc'ed string. */
static char *joined(const fsdp_named_list_t *l) {
    size_t len = 1;
    for (size_t i = 0; i < l->n; i++)
        len += strlen(l->names[i]) + 1;
    char *s = malloc(len);
    if (!s) return NULL;
    s[0] = 0;
    for (size_t i = 0; i < l->n; i++) {
        if (i) strcat(s, "|");
        strcat(s, l->names[i]);
    }
    return s;
}

typedef enum { L_PARAMS, L_STATE, L_FSDP } listing_t;

/* Whether two listings have the same names in the same order. */
static bool same_names(const fsdp_module_t *a, const fsdp_unit_t *ua, listing_t how,
                       const fsdp_module_t *b) {
    fsdp_named_list_t la = {0}, lb = {0};
    int rc = how == L_STATE  ? fsdp_module_state_dict(a, &la)
             : how == L_FSDP ? fsdp_named_params(ua, &la)
                             : fsdp_module_named_params(a, false, &la);
    if (rc == 0)
        rc = how == L_STATE ? fsdp_module_state_dict(b, &lb)
                            : fsdp_module_named_params(b, false, &lb);
    char *sa = rc == 0 ? joined(&la) : NULL, *sb = rc == 0 ? joined(&lb) : NULL;
    bool ok = sa && sb && la.n > 0 && strcmp(sa, sb) == 0;
    if (!ok) tap_diag("%s\n  vs %s", sa ? sa : "?", sb ? sb : "?");
    free(sa);
    free(sb);
    fsdp_named_list_free(&la);
    fsdp_named_list_free(&lb);
    return ok;
}

static int fs_loss(fsdp_ctx_t *ctx, fsdp_module_t *m, double *out) {
    fsdp_tensor_t *src = NULL, *tgt = NULL, *y = NULL, *loss = NULL;
    int rc = tm_transformer_get_input(ctx, &src, &tgt);
    if (rc == 0) rc = tm_transformer_forward(m, src, tgt, &y);
    if (rc == 0) rc = tm_transformer_loss(tgt, y, &loss);
    if (rc == 0) rc = fsdp_backward(loss, NULL);
    if (rc == 0) rc = fsdp_tensor_item(loss, 0, out);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(y);
    fsdp_tensor_release(src);
    fsdp_tensor_release(tgt);
    return rc;
}

static int fs_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *ma = NULL, *mb = NULL, *mu = NULL;
    fsdp_unit_t *ra = NULL, *rb = NULL, **u = NULL;
    fsdp_optim_t *oa = NULL, *ob = NULL;
    fsdp_named_list_t la = {0};
    size_t n = 0;
    int rc;
    FU_TRY(done, "building the models", tm_transformer_create(ctx, true, true, &ma));
    FU_TRY(done, "building the models", tm_transformer_create(ctx, true, true, &mb));
    FU_TRY(done, "building the models", tm_transformer_create(ctx, true, true, &mu));
    fsdp_options_t o;
    fu_job_options(j, &o); /* use_orig_params off: fully_shard turns it on */
    for (const char *const *f = tm_transformer_units(); *f; f++)
        FU_TRY(done, "fully_shard on a layer",
               fsdp_fully_shard(fsdp_module_child(ma, *f), &o, NULL));
    FU_TRY(done, "fully_shard on the root", fsdp_fully_shard(ma, &o, &ra));
    fsdp_options_t ob_o = o;
    ob_o.use_orig_params = true;
    FU_TRY(done, "fsdp_wrap with the transformer policy", fu_wrap_transformer_opts(mb, &ob_o, &rb));
    fu_ck(r, ra == fsdp_unit_of(ma) && strcmp(wu_unit_names(ra), wu_unit_names(rb)) == 0,
          "children then the root give the units the policy gives", "%s vs %s", wu_unit_names(ra),
          wu_unit_names(rb));
    FU_TRY(done, "fsdp_units", fsdp_units(ra, &u, &n));
    bool orig = n == 5;
    for (size_t i = 0; i < n; i++) {
        fsdp_options_t uo;
        orig &= fsdp_unit_options(u[i], &uo) == 0 && uo.use_orig_params;
    }
    fu_ck(r, orig, "every fully_shard unit runs with use_orig_params", "%zu units", n);
    fu_ck(r, same_names(ma, NULL, L_PARAMS, mu),
          "the module's parameter FQNs are the unwrapped model's", "see the diagnostics");
    fu_ck(r, same_names(ma, NULL, L_STATE, mu), "its state-dict keys are the unwrapped model's",
          "see the diagnostics");
    fu_ck(r, same_names(ma, ra, L_FSDP, mu),
          "what FSDP hands the optimizer is the module's own parameters", "see the diagnostics");
    /* A optimizes the module's own parameters, as with an unwrapped model. */
    FU_TRY(done, "optimizers", fsdp_module_named_params(ma, false, &la));
    FU_TRY(done, "optimizers", fu_make_sgd(ctx, &la, 0.01, 0.9, &oa));
    FU_TRY(done, "optimizers", fu_make_fsdp_sgd(ctx, rb, 0.01, 0.9, &ob));
    char why[400] = "";
    bool same = true;
    for (int s = 0; s < FS_STEPS; s++) {
        double a = NAN, b = NAN;
        FU_TRY(done, "fully_shard step", fs_loss(ctx, ma, &a));
        FU_TRY(done, "fully_shard step", fsdp_optim_step(oa));
        FU_TRY(done, "fully_shard step", fsdp_optim_zero_grad(oa, true));
        FU_TRY(done, "fsdp_wrap step", fs_loss(ctx, mb, &b));
        FU_TRY(done, "fsdp_wrap step", fsdp_optim_step(ob));
        FU_TRY(done, "fsdp_wrap step", fsdp_optim_zero_grad(ob, true));
        if (memcmp(&a, &b, sizeof a) != 0) {
            fu_add_why(why, sizeof why, "step %d: %.9g vs %.9g", s, a, b);
            same = false;
        }
    }
    fu_ck(r, same, "3 SGD steps: the losses are bitwise fsdp_wrap's", "%s", why);
done:
    fsdp_tape_clear(ctx);
    free(u);
    fsdp_named_list_free(&la);
    fsdp_optim_destroy(oa);
    fsdp_optim_destroy(ob);
    fsdp_unit_destroy(ra);
    fsdp_unit_destroy(rb);
    fsdp_module_release(ma);
    fsdp_module_release(mb);
    fsdp_module_release(mu);
    return rc < 0 ? rc : FSDP_OK;
}

/* ---- batch norm under mixed precision: a full-precision unit between f16 units ------------ */

/* What the test's hooks on the batch-norm module saw (registered after the unit's, so they see
 * the unit's casts). */
typedef struct bn_seen {
    fsdp_tensor_t *in, *out; /* the last forward's input and output (references) */
    int calls;
} bn_seen_t;

static int bn_seen_pre(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t **in) {
    (void)m;
    bn_seen_t *s = arg;
    fsdp_tensor_release(s->in);
    s->in = nin > 0 && in[0] ? fsdp_tensor_retain(in[0]) : NULL;
    s->calls++;
    return FSDP_OK;
}

static int bn_seen_post(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t *const *in, int nout,
                        fsdp_tensor_t **out) {
    (void)m, (void)nin, (void)in;
    bn_seen_t *s = arg;
    fsdp_tensor_release(s->out);
    s->out = nout > 0 && out[0] ? fsdp_tensor_retain(out[0]) : NULL;
    return FSDP_OK;
}

/* Sequential(Linear(4, 8), BatchNorm1d(8), Linear(8, 4)), seeded. */
static int bn_net(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_module_t *s = NULL, *l0 = NULL, *bn = NULL, *l2 = NULL;
    tm_manual_seed(ctx, 0);
    int rc = fsdp_sequential_create(ctx, &s);
    if (rc == 0) rc = fsdp_linear_create(ctx, 4, 8, true, &l0);
    if (rc == 0) rc = fsdp_batchnorm_create(ctx, 0, 8, 1e-5, 0.1, &bn);
    if (rc == 0) rc = fsdp_linear_create(ctx, 8, 4, true, &l2);
    if (rc == 0) rc = fsdp_module_append(s, l0);
    if (rc == 0) rc = fsdp_module_append(s, bn);
    if (rc == 0) rc = fsdp_module_append(s, l2);
    fsdp_module_release(l0);
    fsdp_module_release(bn);
    fsdp_module_release(l2);
    if (rc < 0) {
        fsdp_module_release(s);
        s = NULL;
    }
    *out = s;
    return rc;
}

static int bn_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    static const char *const linear[] = {"Linear", NULL};
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_policy_t *p = NULL;
    fsdp_tensor_t *x = NULL, *y = NULL, *loss = NULL, *yref = NULL, *yref16 = NULL;
    bn_seen_t seen = {0};
    int hpre = -1, hpost = -1, rc;
    FU_TRY(done, "the model", bn_net(ctx, &m));
    FU_TRY(done, "the reference BatchNorm1d(8)", fsdp_batchnorm_create(ctx, 0, 8, 1e-5, 0.1, &ref));
    FU_TRY(done, "the Linear policy", fsdp_policy_module_types_create(linear, &p));
    fsdp_options_t o;
    fu_job_options(j, &o);
    o.auto_wrap_policy = p;
    o.mixed_precision.enabled = true;
    o.mixed_precision.param_dtype = o.mixed_precision.reduce_dtype = FSDP_DTYPE_F16;
    uint64_t nwarn = fsdp_ctx_warnings(ctx, NULL, 0);
    fsdp_log_level_t lv = fsdp_ctx_log_level(ctx);
    fsdp_ctx_set_log_level(ctx, FSDP_LOG_ERROR); /* counted, not printed */
    rc = fsdp_wrap(m, &o, &root);
    fsdp_ctx_set_log_level(ctx, lv);
    FU_TRY(done, "fsdp_wrap with the Linear policy and f16 mixed precision", rc);
    char warn[1024];
    nwarn = fsdp_ctx_warnings(ctx, warn, sizeof warn) - nwarn;
    fsdp_module_t *bn = fsdp_module_child(m, "1");
    fu_ck(r, strcmp(wu_unit_names(root), "(root)|0|1|2") == 0,
          "the batch norm becomes a unit of its own beside the Linear units", "%s",
          wu_unit_names(root));
    fsdp_options_t bo, lo;
    FU_TRY(done, "fsdp_unit_options", fsdp_unit_options(fsdp_unit_of(bn), &bo));
    FU_TRY(done, "fsdp_unit_options", fsdp_unit_options(fsdp_unit_of(fsdp_module_child(m, "0")), &lo));
    fu_ck(r, !bo.mixed_precision.enabled && lo.mixed_precision.enabled,
          "its mixed precision is off, the Linear units' on", "bn %d, linear %d",
          bo.mixed_precision.enabled, lo.mixed_precision.enabled);
    fu_ck(r, nwarn == 1 && strstr(warn, "{BatchNorm1d}") && strstr(warn, "mixed precision disabled"),
          "one warning (fsdp_ctx_warnings) names BatchNorm1d and says its mixed precision is "
          "disabled",
          "%d: %s", (int)nwarn, warn);
    FU_TRY(done, "hooks", fsdp_module_add_forward_pre_hook(bn, bn_seen_pre, &seen, &hpre));
    FU_TRY(done, "hooks", fsdp_module_add_forward_hook(bn, bn_seen_post, &seen, &hpost));
    FU_TRY(done, "the input", fu_rand_input(ctx, 7, 6, 4, &x));
    FU_TRY(done, "forward", fsdp_module_forward1(m, x, &y));
    fu_ck(r, seen.calls == 1 && seen.in && fsdp_tensor_dtype(seen.in) == FSDP_DTYPE_F32,
          "the f16 activations reach the batch norm cast to f32", "dtype %s",
          seen.in ? fsdp_dtype_name(fsdp_tensor_dtype(seen.in)) : "-");
    fu_ck(r, seen.out && fsdp_tensor_dtype(seen.out) == FSDP_DTYPE_F16 &&
                 fsdp_tensor_dtype(y) == FSDP_DTYPE_F16,
          "its output goes on in f16 (the dtype of its input), as does the model's", "%s, %s",
          seen.out ? fsdp_dtype_name(fsdp_tensor_dtype(seen.out)) : "-",
          fsdp_dtype_name(fsdp_tensor_dtype(y)));
    FU_TRY(done, "the reference", fsdp_module_forward1(ref, seen.in, &yref));
    FU_TRY(done, "the reference", fsdp_to_dtype(yref, FSDP_DTYPE_F16, &yref16));
    fu_ck(r, fu_same_bits(seen.out, yref16) == 1,
          "it computed in f32 and rounded once: bitwise an f32 BatchNorm1d's output cast to f16",
          "differs");
    FU_TRY(done, "loss", tm_sum_loss(y, &loss));
    FU_TRY(done, "backward", fsdp_backward(loss, NULL));
    fsdp_tensor_t *g = fsdp_tensor_grad(fsdp_unit_flat_param(fsdp_unit_of(bn)));
    float *gv = NULL;
    int64_t gn = 0;
    bool finite = g && (gv = fu_host_f32(g, &gn)) != NULL;
    for (int64_t i = 0; finite && i < gn; i++)
        finite = isfinite(gv[i]);
    free(gv);
    fu_ck(r, finite && fsdp_tensor_dtype(g) == FSDP_DTYPE_F32 && fu_tree_idle(root),
          "backward gives the batch norm's shard an f32 gradient, finite, every unit idle",
          "grad %p", (void *)g);
done:
    if (hpre >= 0) fsdp_module_remove_hook(fsdp_module_child(m, "1"), hpre);
    if (hpost >= 0) fsdp_module_remove_hook(fsdp_module_child(m, "1"), hpost);
    fsdp_tensor_release(seen.in);
    fsdp_tensor_release(seen.out);
    fsdp_tensor_release(yref16);
    fsdp_tensor_release(yref);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(y);
    fsdp_tensor_release(x);
    fsdp_tape_clear(ctx);
    fsdp_unit_destroy(root);
    fsdp_module_release(m);
    fsdp_module_release(ref);
    fsdp_policy_release(p);
    return rc < 0 ? rc : FSDP_OK;
}

/* ---- main ------------------------------------------------------------------------------------ */

int main(void) {
    setenv("FSDP_LOG", "warn", 1);
    tap_plan_lazy();
    test_fw04();
    test_ta14();
    fu_run("WRAP-TA-02 thread-local scope", 2, FSDP_FULL_SHARD, false, scope_rank);
    fu_run("fully_shard vs fsdp_wrap TransformerWithSharedParams", 2, FSDP_FULL_SHARD, false,
           fs_rank);
    for (int world = 1; world <= 2; world++)
        fu_run("MP-S07 Linear-BatchNorm1d-Linear under f16 mixed precision", world, FSDP_FULL_SHARD, false,
               bn_rank);
    return tap_done();
}
