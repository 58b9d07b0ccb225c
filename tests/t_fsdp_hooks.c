/* SPDX-License-Identifier: MIT */
/*
 * t_fsdp_hooks.c: the hook behaviours of test_fsdp_core.py (spec section 3, TestHooks and
 * TestAutograd):
 *   CORE-H01/H03 the backward-hook registration counters: none before the first forward, one
 *               per unit and forward with grad (post only for units with trainable
 *               parameters), unchanged by backward and by the optimizer step, one more per
 *               iteration; each unit's pre- and post-backward hook runs once per backward and
 *               frees its parameters when backward leaves it;
 *   CORE-H01 sub-case (TwiceModel): one registration per forward even when a unit runs twice
 *               in it, none for a frozen unit's post-backward; backward passes the twice-run
 *               unit twice and frees it only after its first invocation; losses and parameters
 *               match the unwrapped model;
 *   CORE-H02    the same counters after a full state-dict round trip under summon;
 *   CORE-AG-01  during a unit's forward its modules' parameter slots are views into the
 *               unsharded flat parameter at the parameters' offsets, and the original objects
 *               (views into the local shard) again afterwards; backward starts unsharded and
 *               frees after the unit's backward; over strategy x use_orig_params x
 *               forward_prefetch x backward_prefetch;
 *   F19         every unit IDLE after each step.
 *
 * The rank functions record checks per rank and fu_run_job() prints one TAP line per check
 * (see fsdp_util.h). CORE-H03's mixed-precision variant is in t_fsdp_mp.c; the cuda_first
 * variants have no C counterpart (no CUDA init modes on the sim backend).
 */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "models/models.h"
#include "tap.h"

/* A unit's per-backward hooks ran exactly k times each. */
static bool hooks_ran(fsdp_unit_t *const *u, size_t n, uint64_t k, char *why, size_t len) {
    for (size_t i = 0; i < n; i++) {
        fsdp_unit_stats_t s;
        fsdp_unit_get_stats(u[i], &s);
        if (s.pre_backward_hooks != k || s.post_backward_hooks != k) {
            snprintf(why, len,
                     "unit '%s': pre_backward_hooks %llu, post_backward_hooks %llu; "
                     "want %llu each",
                     fsdp_unit_fqn(u[i]), (unsigned long long)s.pre_backward_hooks,
                     (unsigned long long)s.post_backward_hooks, (unsigned long long)k);
            return false;
        }
    }
    return true;
}

/* ---- CORE-H01, CORE-H02, CORE-H03 on TransformerWithSharedParams ----------------------------- */

static int hooks_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL, **u = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_tensor_t *out = NULL, *tgt = NULL, *loss = NULL, *before = NULL, *after = NULL;
    size_t n = 0;
    int post_mult[8];
    fu_bwd_watch_t w[8];
    char why[760], name[200];
    int rc;
    if ((rc = fu_transformer_setup(r, ctx, j, true, &m, &root, &u, &n, &opt)) < 0) goto done;
    if (!fu_ck(r, n == 5, "5 units (4 layers and the root)", "%zu units", n)) goto done;
    FU_TRY(done, "adding backward hooks", fu_watch_units(u, n, w));
    bool trainable = true;
    for (size_t i = 0; i < n; i++) {
        post_mult[i] = 1;
        trainable &=
            fsdp_unit_flat_param(u[i]) && fsdp_tensor_requires_grad(fsdp_unit_flat_param(u[i]));
    }
    fu_ck(r, trainable, "every unit has trainable parameters", "a unit has none");
    fu_ck(r, fu_counters_are(u, n, post_mult, 0, why, sizeof why),
          "CORE-H03: no pre- or post-backward registration before the first forward", "%s", why);

    for (int it = 1; it <= 3; it++) {
        if (it == 3) {
            /* CORE-H02: a full state-dict round trip between iterations 2 and 3. */
            FU_TRY(done, "no-grad forward before the round trip",
                   fu_no_grad_forward(ctx, m, &before));
            FU_TRY(done, "CORE-H02: state-dict round trip under summon", fu_state_round_trip(root));
            fu_ck(r, fu_all_idle(u, n, why, sizeof why),
                  "CORE-H02: every unit IDLE after the round trip", "%s", why);
            fu_ck(r, fu_counters_are(u, n, post_mult, 2, why, sizeof why),
                  "CORE-H02: the round trip (and a no-grad forward) registered nothing", "%s", why);
            FU_TRY(done, "no-grad forward after the round trip",
                   fu_no_grad_forward(ctx, m, &after));
            int same = fu_same_bits(before, after);
            fu_ck(r, same == 1, "CORE-H02: the round trip restored every parameter (same output)",
                  "same_bits returned %d", same);
        }
        const char *id = it == 3 ? "CORE-H02" : "CORE-H01/H03";
        fsdp_optim_zero_grad(opt, true);
        FU_TRY(done, "forward", fu_transformer_forward(ctx, m, &out, &tgt));
        FU_TRY(done, "forward", tm_transformer_loss(tgt, out, &loss));
        snprintf(name, sizeof name,
                 "%s: after forward %d every unit registered pre- and post-backward %d times", id,
                 it, it);
        fu_ck(r, fu_counters_are(u, n, post_mult, (uint64_t)it, why, sizeof why), name, "%s", why);
        FU_TRY(done, "backward", fsdp_backward(loss, NULL));
        snprintf(name, sizeof name, "%s: iteration %d: backward leaves the counters alone", id, it);
        fu_ck(r, fu_counters_are(u, n, post_mult, (uint64_t)it, why, sizeof why), name, "%s", why);
        snprintf(name, sizeof name,
                 "%s: iteration %d: each unit's pre- and post-backward hook ran once", id, it);
        fu_ck(r, hooks_ran(u, n, (uint64_t)it, why, sizeof why), name, "%s", why);
        snprintf(name, sizeof name,
                 "%s: iteration %d: each unit freed its parameters when backward left it", id, it);
        fu_ck(r, fu_watched(w, n, it, why, sizeof why), name, "%s", why);
        FU_TRY(done, "optimizer step", fsdp_optim_step(opt));
        snprintf(name, sizeof name,
                 "%s: iteration %d: the optimizer step leaves the counters "
                 "alone",
                 id, it);
        fu_ck(r, fu_counters_are(u, n, post_mult, (uint64_t)it, why, sizeof why), name, "%s", why);
        snprintf(name, sizeof name, "F19: every unit IDLE after step %d", it);
        fu_ck(r, fu_all_idle(u, n, why, sizeof why), name, "%s", why);
        fsdp_tensor_release(out);
        fsdp_tensor_release(tgt);
        fsdp_tensor_release(loss);
        out = tgt = loss = NULL;
    }
done:
    fsdp_tensor_release(out);
    fsdp_tensor_release(tgt);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(before);
    fsdp_tensor_release(after);
    fu_teardown(ctx, m, root, u, opt);
    return rc;
}

/* ---- CORE-H01 sub-case: a unit run twice in one forward, and a frozen unit ------------------- */

/*
 * TwiceModel: children lin (Linear(4, 4), a unit), frozen (Linear(4, 4) with requires_grad off,
 * a unit) and head (Linear(4, 4), managed by the root). forward(x) = head(frozen(lin(lin(x)))).
 */
static int twice_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                         fsdp_tensor_t **out) {
    if (nin != 1 || nout != 1) return FSDP_EINVAL;
    fsdp_tensor_t *a = NULL, *b = NULL, *c = NULL;
    int rc = fsdp_module_forward1(fsdp_module_child(m, "lin"), in[0], &a);
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(m, "lin"), a, &b);
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(m, "frozen"), b, &c);
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(m, "head"), c, &out[0]);
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    fsdp_tensor_release(c);
    return rc;
}

static const fsdp_module_ops_t twice_ops = {"TwiceModel", twice_forward, NULL};

static int twice_create(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_module_t *m = NULL, *c = NULL;
    tm_manual_seed(ctx, 3);
    int rc = fsdp_module_create(ctx, &twice_ops, NULL, &m);
    const char *names[3] = {"lin", "frozen", "head"};
    for (int i = 0; i < 3 && rc == 0; i++) {
        rc = fsdp_linear_create(ctx, 4, 4, true, &c);
        if (rc == 0 && i == 1) rc = fsdp_module_requires_grad_(c, false);
        if (rc == 0) rc = fsdp_module_add_child(m, names[i], c);
        fsdp_module_release(c);
        c = NULL;
    }
    if (rc < 0) {
        fsdp_module_release(m);
        m = NULL;
    }
    *out = m;
    return rc;
}

static int twice_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_unit_t *root = NULL, *ul = NULL, *uf = NULL, **u = NULL;
    fsdp_optim_t *opt = NULL, *ref_opt = NULL;
    fsdp_named_list_t ref_params = {0}, full = {0};
    fsdp_tensor_t *x = NULL, *out = NULL, *loss = NULL;
    size_t n = 0;
    int post_mult[3];
    fu_bwd_watch_t w[3];
    char why[760], name[200];
    int rc;
    FU_TRY(done, "building TwiceModel", twice_create(ctx, &m));
    FU_TRY(done, "building TwiceModel", twice_create(ctx, &ref));
    fsdp_options_t o;
    fu_job_options(j, &o);
    FU_TRY(done, "wrapping TwiceModel and the optimizers",
           fsdp_wrap(fsdp_module_child(m, "lin"), &o, &ul));
    FU_TRY(done, "wrapping TwiceModel and the optimizers",
           fsdp_wrap(fsdp_module_child(m, "frozen"), &o, &uf));
    FU_TRY(done, "wrapping TwiceModel and the optimizers", fsdp_wrap(m, &o, &root));
    FU_TRY(done, "wrapping TwiceModel and the optimizers", fsdp_units(root, &u, &n));
    FU_TRY(done, "wrapping TwiceModel and the optimizers",
           fu_make_fsdp_sgd(ctx, root, 0.1, 0.0, &opt));
    FU_TRY(done, "wrapping TwiceModel and the optimizers",
           fsdp_module_named_params(ref, false, &ref_params));
    FU_TRY(done, "wrapping TwiceModel and the optimizers",
           fu_make_sgd(ctx, &ref_params, 0.1, 0.0, &ref_opt));
    if (!fu_ck(r, n == 3 && u[0] == root, "TwiceModel has 3 units, the root first", "%zu units", n))
        goto done;
    for (size_t i = 0; i < n; i++)
        post_mult[i] = u[i] == uf ? 0 : 1;
    FU_TRY(done, "adding backward hooks", fu_watch_units(u, n, w));
    FU_TRY(done, "input", fu_rand_input(ctx, 9, 3, 4, &x));
    fu_ck(r, fu_counters_are(u, n, post_mult, 0, why, sizeof why),
          "CORE-H03: nothing registered before the first forward", "%s", why);
    for (int it = 1; it <= 2; it++) {
        double l_ref = 0, l = 0;
        fsdp_optim_zero_grad(ref_opt, true);
        FU_TRY(done, "reference step", fsdp_module_forward1(ref, x, &out));
        FU_TRY(done, "reference step", tm_sum_loss(out, &loss));
        FU_TRY(done, "reference step", fsdp_tensor_item(loss, 0, &l_ref));
        FU_TRY(done, "reference step", fsdp_backward(loss, NULL));
        FU_TRY(done, "reference step", fsdp_optim_step(ref_opt));
        fsdp_tensor_release(out);
        fsdp_tensor_release(loss);
        out = loss = NULL;
        fsdp_optim_zero_grad(opt, true);
        FU_TRY(done, "forward", fsdp_module_forward1(m, x, &out));
        FU_TRY(done, "forward", tm_sum_loss(out, &loss));
        FU_TRY(done, "forward", fsdp_tensor_item(loss, 0, &l));
        snprintf(name, sizeof name,
                 "CORE-H01: forward %d: one registration per unit although 'lin' ran twice; "
                 "none for the frozen unit's post-backward",
                 it);
        fu_ck(r, fu_counters_are(u, n, post_mult, (uint64_t)it, why, sizeof why), name, "%s", why);
        FU_TRY(done, "backward", fsdp_backward(loss, NULL));
        snprintf(name, sizeof name, "CORE-H01: iteration %d: backward leaves the counters alone",
                 it);
        fu_ck(r, fu_counters_are(u, n, post_mult, (uint64_t)it, why, sizeof why), name, "%s", why);
        snprintf(name, sizeof name,
                 "iteration %d: backward passed 'lin' twice and freed it only after its first "
                 "invocation",
                 it);
        bool okw = true;
        for (size_t i = 0; i < n; i++) {
            int want = (u[i] == ul ? 2 : 1) * it;
            if (w[i].calls != want || w[i].unsharded_after != (u[i] == ul ? it : 0)) {
                snprintf(why, sizeof why,
                         "unit '%s': %d backward passes (want %d), still unsharded after %d",
                         fsdp_unit_fqn(u[i]), w[i].calls, want, w[i].unsharded_after);
                okw = false;
                break;
            }
        }
        fu_ck(r, okw, name, "%s", why);
        FU_TRY(done, "optimizer step", fsdp_optim_step(opt));
        snprintf(name, sizeof name, "F19: every unit IDLE after step %d", it);
        fu_ck(r, fu_all_idle(u, n, why, sizeof why), name, "%s", why);
        snprintf(name, sizeof name, "iteration %d: loss matches the unwrapped model", it);
        fu_ck(r, fu_closeness(l, l_ref, FU_F32_RTOL, FU_F32_ATOL) <= 1.0, name,
              "loss %.9g, reference %.9g", l, l_ref);
        fsdp_tensor_release(out);
        fsdp_tensor_release(loss);
        out = loss = NULL;
    }
    /* The parameters after two steps against the reference's. */
    FU_TRY(done, "summon", fu_summon_nowb(root));
    rc = fsdp_module_named_params(m, false, &full);
    double worst = full.n == ref_params.n ? 0 : INFINITY;
    for (size_t i = 0; rc == 0 && i < full.n && i < ref_params.n; i++) {
        double c = strcmp(full.names[i], ref_params.names[i]) == 0
                       ? fu_tensor_closeness(full.tensors[i], ref_params.tensors[i], FU_F32_RTOL,
                                             FU_F32_ATOL)
                       : INFINITY;
        if (c < 0 || c > worst) worst = c < 0 ? INFINITY : c;
    }
    int rc2 = fsdp_summon_end(root);
    if (rc == 0) rc = rc2;
    if (rc < 0) {
        fu_fatal(r, ctx, "reading the full parameters", rc);
        goto done;
    }
    fu_ck(r, worst <= 1.0,
          "after 2 steps the full parameters match the unwrapped model (twice-run unit's gradient "
          "accumulated over both uses, frozen unit unchanged)",
          "worst element %.3g of fp32 tolerance", worst);
done:
    fsdp_tensor_release(x);
    fsdp_tensor_release(out);
    fsdp_tensor_release(loss);
    fsdp_tape_clear(ctx);
    fsdp_named_list_free(&full);
    fsdp_named_list_free(&ref_params);
    free(u);
    fsdp_optim_destroy(opt);
    fsdp_optim_destroy(ref_opt);
    fsdp_unit_destroy(root);
    if (!root) {
        fsdp_unit_destroy(ul);
        fsdp_unit_destroy(uf);
    }
    fsdp_module_release(m);
    fsdp_module_release(ref);
    return rc;
}

/* ---- CORE-AG-01 ------------------------------------------------------------------------------ */

/* What the hooks on one Linear saw. */
typedef struct lin_watch {
    fsdp_unit_t *u;
    fsdp_sharding_strategy_t strategy;
    int fwd_pre, fwd_post, bwd_pre, bwd_post;
    char err_fwd[400], err_after[400], err_bwd_pre[400], err_bwd_post[400];
} lin_watch_t;

static void set_err(char *dst, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void set_err(char *dst, size_t len, const char *fmt, ...) {
    if (dst[0]) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(dst, len, fmt, ap);
    va_end(ap);
}

/* In compute: every managed slot is a view into the unsharded flat parameter at its offset. */
static int ag_fwd_pre(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t **in) {
    (void)nin, (void)in;
    lin_watch_t *h = arg;
    h->fwd_pre++;
    fsdp_unit_t *u = h->u;
    fsdp_tensor_t *full = fsdp_unit_full_param(u);
    fsdp_flat_sizes_t fs;
    fsdp_unit_flat_sizes(u, &fs);
    if (!fsdp_unit_is_unsharded(u) || !full) {
        set_err(h->err_fwd, sizeof h->err_fwd, "forward %d: the unit is not unsharded", h->fwd_pre);
        return FSDP_OK;
    }
    size_t es = fsdp_dtype_size(fsdp_tensor_dtype(full));
    if (fsdp_tensor_storage_bytes(full) < (size_t)fs.padded_numel * es) {
        set_err(h->err_fwd, sizeof h->err_fwd,
                "forward %d: the unsharded flat parameter has %zu bytes, want %zu", h->fwd_pre,
                fsdp_tensor_storage_bytes(full), (size_t)fs.padded_numel * es);
        return FSDP_OK;
    }
    const char *lo = fsdp_tensor_data(full), *hi = lo + (size_t)fs.padded_numel * es;
    for (size_t i = 0; i < fsdp_unit_num_params(u); i++) {
        fsdp_param_info_t info;
        if (fsdp_unit_param_info(u, i, &info) < 0) {
            set_err(h->err_fwd, sizeof h->err_fwd, "param_info %zu failed", i);
            break;
        }
        fsdp_tensor_t *s = fsdp_module_param(m, info.fqn);
        const char *p = s ? fsdp_tensor_data(s) : NULL;
        int64_t ne = s ? fsdp_tensor_numel(s) : 0;
        if (!s || s == info.param)
            set_err(h->err_fwd, sizeof h->err_fwd,
                    "forward %d: slot '%s' holds %s, not a compute view", h->fwd_pre, info.fqn,
                    s ? "the original parameter object" : "nothing");
        else if (p < lo || p + (size_t)ne * es > hi)
            set_err(h->err_fwd, sizeof h->err_fwd,
                    "forward %d: slot '%s' data %p..+%lld elements is outside the unsharded flat "
                    "parameter [%p, %p)",
                    h->fwd_pre, info.fqn, (const void *)p, (long long)ne, (const void *)lo,
                    (const void *)hi);
        else if (p != lo + (size_t)info.offset * es || ne != info.numel ||
                 fsdp_tensor_ndim(s) != info.ndim ||
                 memcmp(fsdp_tensor_shape(s), info.shape, sizeof(int64_t) * (size_t)info.ndim))
            set_err(h->err_fwd, sizeof h->err_fwd,
                    "forward %d: slot '%s' is at element %lld with %lld elements, %d-d; want "
                    "offset %lld, %lld elements, %d-d",
                    h->fwd_pre, info.fqn, (long long)((p - lo) / (ptrdiff_t)es), (long long)ne,
                    fsdp_tensor_ndim(s), (long long)info.offset, (long long)info.numel, info.ndim);
    }
    return FSDP_OK;
}

/* After compute: the original objects, 1-D views into the local shard (or empty). */
static void check_originals(lin_watch_t *h, fsdp_module_t *m, char *err, size_t len,
                            const char *when) {
    fsdp_unit_t *u = h->u;
    fsdp_tensor_t *flat = fsdp_unit_flat_param(u);
    fsdp_flat_sizes_t fs;
    fsdp_unit_flat_sizes(u, &fs);
    size_t es = fsdp_dtype_size(fsdp_tensor_dtype(flat));
    const char *lo = fsdp_tensor_data(flat), *hi = lo + (size_t)fs.shard_numel * es;
    for (size_t i = 0; i < fsdp_unit_num_params(u); i++) {
        fsdp_param_info_t info;
        if (fsdp_unit_param_info(u, i, &info) < 0) {
            set_err(err, len, "param_info %zu failed", i);
            return;
        }
        fsdp_tensor_t *s = fsdp_module_param(m, info.fqn);
        if (s != info.param) {
            set_err(err, len, "%s: slot '%s' does not hold the original parameter object", when,
                    info.fqn);
            continue;
        }
        int64_t ne = fsdp_tensor_numel(s);
        const char *p = fsdp_tensor_data(s);
        if (ne != info.numel_in_shard || (ne > 0 && (p < lo || p + (size_t)ne * es > hi ||
                                                     p != lo + (size_t)info.offset_in_shard * es)))
            set_err(err, len,
                    "%s: '%s' has %lld elements at %p; want %lld in the local shard [%p, %p) at "
                    "element %lld",
                    when, info.fqn, (long long)ne, (const void *)p, (long long)info.numel_in_shard,
                    (const void *)lo, (const void *)hi, (long long)info.offset_in_shard);
    }
}

static int ag_fwd_post(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t *const *in, int nout,
                       fsdp_tensor_t **out) {
    (void)nin, (void)in, (void)nout, (void)out;
    lin_watch_t *h = arg;
    h->fwd_post++;
    check_originals(h, m, h->err_after, sizeof h->err_after, "after its forward");
    bool held = fsdp_unit_is_unsharded(h->u);
    bool want = h->strategy == FSDP_SHARD_GRAD_OP;
    if (held != want)
        set_err(h->err_after, sizeof h->err_after, "after forward %d the unit is %s under %s",
                h->fwd_post, held ? "unsharded" : "sharded",
                fsdp_sharding_strategy_name(h->strategy));
    return FSDP_OK;
}

static int ag_bwd_pre(fsdp_module_t *m, void *arg, bool has_grad) {
    (void)m, (void)has_grad;
    lin_watch_t *h = arg;
    h->bwd_pre++;
    fsdp_flat_sizes_t fs;
    fsdp_unit_flat_sizes(h->u, &fs);
    fsdp_tensor_t *full = fsdp_unit_full_param(h->u);
    size_t want = full ? (size_t)fs.padded_numel * fsdp_dtype_size(fsdp_tensor_dtype(full)) : 1;
    if (!fsdp_unit_is_unsharded(h->u) || !full || fsdp_tensor_storage_bytes(full) != want)
        set_err(h->err_bwd_pre, sizeof h->err_bwd_pre,
                "backward %d started with the unit %s (unsharded storage %zu bytes, want %zu)",
                h->bwd_pre, fsdp_unit_is_unsharded(h->u) ? "unsharded" : "sharded",
                full ? fsdp_tensor_storage_bytes(full) : 0, want);
    return FSDP_OK;
}

static int ag_bwd_post(fsdp_module_t *m, void *arg, bool has_grad) {
    (void)m, (void)has_grad;
    lin_watch_t *h = arg;
    h->bwd_post++;
    if (fsdp_unit_is_unsharded(h->u))
        set_err(h->err_bwd_post, sizeof h->err_bwd_post,
                "backward %d left the unit with its parameters unsharded", h->bwd_post);
    return FSDP_OK;
}

#define AG_LAYERS 5
#define AG_ITERS 3

static int ag_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL, **u = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_tensor_t *x = NULL, *out = NULL, *loss = NULL;
    lin_watch_t h[AG_LAYERS];
    size_t n = 0;
    int post_mult[AG_LAYERS + 1];
    char why[760];
    int rc;
    static const char *const lin_types[] = {"Linear", NULL};

    memset(h, 0, sizeof h);
    FU_TRY(done, "building Sequential(5 x Linear(3, 3))", fu_linear_stack(ctx, AG_LAYERS, 3, &m));
    fsdp_options_t o;
    fu_job_options(j, &o);
    FU_TRY(done, "wrapping and the optimizer", fu_wrap_types(m, &o, lin_types, &root));
    FU_TRY(done, "wrapping and the optimizer", fsdp_units(root, &u, &n));
    FU_TRY(done, "wrapping and the optimizer", fu_make_fsdp_sgd(ctx, root, 0.01, 0.9, &opt));
    if (!fu_ck(r, n == AG_LAYERS + 1, "fsdp_units lists exactly 6 units", "%zu units", n))
        goto done;
    /* Hooks after wrapping, so they run after FSDP's. */
    for (int i = 0; i < AG_LAYERS; i++) {
        char idx[8];
        snprintf(idx, sizeof idx, "%d", i);
        fsdp_module_t *l = fsdp_module_child(m, idx);
        h[i].u = fsdp_unit_of(l);
        h[i].strategy = j->strategy;
        int hd;
        if (!h[i].u || fsdp_unit_num_params(h[i].u) != 2) {
            fu_ck(r, false, "each Linear is a unit with its weight and bias",
                  "Linear %d: unit %p with %zu parameters", i, (void *)h[i].u,
                  fsdp_unit_num_params(h[i].u));
            goto done;
        }
        FU_TRY(done, "adding hooks", fsdp_module_add_forward_pre_hook(l, ag_fwd_pre, &h[i], &hd));
        FU_TRY(done, "adding hooks", fsdp_module_add_forward_hook(l, ag_fwd_post, &h[i], &hd));
        FU_TRY(done, "adding hooks", fsdp_module_add_backward_pre_hook(l, ag_bwd_pre, &h[i], &hd));
        FU_TRY(done, "adding hooks", fsdp_module_add_backward_hook(l, ag_bwd_post, &h[i], &hd));
    }
    for (size_t i = 0; i < n; i++)
        post_mult[i] = fsdp_unit_num_params(u[i]) > 0;
    fu_ck(r, fsdp_unit_num_params(root) == 0 && post_mult[0] == 0, "the root manages no parameters",
          "root has %zu", fsdp_unit_num_params(root));
    FU_TRY(done, "input", fu_rand_input(ctx, 1 + (uint64_t)fsdp_ctx_rank(ctx), 2, 3, &x));
    bool counters_ok = true, idle_ok = true, orig_ok = true;
    char cwhy[600] = "", iwhy[600] = "", owhy[600] = "";
    for (int it = 1; it <= AG_ITERS; it++) {
        fsdp_optim_zero_grad(opt, true);
        FU_TRY(done, "forward", fsdp_module_forward1(m, x, &out));
        FU_TRY(done, "forward", tm_sum_loss(out, &loss));
        /* Outside compute, every Linear's slots hold the original objects again. */
        for (int i = 0; i < AG_LAYERS && orig_ok; i++) {
            char idx[8];
            snprintf(idx, sizeof idx, "%d", i);
            check_originals(&h[i], fsdp_module_child(m, idx), owhy, sizeof owhy,
                            "after the model's forward");
            orig_ok = owhy[0] == 0;
        }
        if (counters_ok && !fu_counters_are(u, n, post_mult, (uint64_t)it, cwhy, sizeof cwhy))
            counters_ok = false;
        FU_TRY(done, "backward and step", fsdp_backward(loss, NULL));
        FU_TRY(done, "backward and step", fsdp_optim_step(opt));
        if (idle_ok && !fu_all_idle(u, n, iwhy, sizeof iwhy)) idle_ok = false;
        fsdp_tensor_release(out);
        fsdp_tensor_release(loss);
        out = loss = NULL;
    }
    static const char *const hook_checks[4] = {
        "CORE-AG-01: in forward the slots are views into the unsharded flat parameter at the "
        "parameters' offsets",
        "CORE-AG-01: after a unit's forward its slots hold the original objects, views into the "
        "local shard",
        "CORE-AG-01: a unit's backward starts with it unsharded",
        "a unit's parameters are freed when backward leaves it"};
    for (int k = 0; k < 4; k++) {
        bool ok = true;
        for (int i = 0; i < AG_LAYERS && ok; i++) {
            const char *e[4] = {h[i].err_fwd, h[i].err_after, h[i].err_bwd_pre, h[i].err_bwd_post};
            int calls[4] = {h[i].fwd_pre, h[i].fwd_post, h[i].bwd_pre, h[i].bwd_post};
            if (e[k][0] || calls[k] != AG_ITERS) {
                ok = false;
                snprintf(why, sizeof why, "Linear %d: hook ran %d times (want %d)%s%s", i, calls[k],
                         AG_ITERS, e[k][0] ? ": " : "", e[k]);
            }
        }
        fu_ck(r, ok, hook_checks[k], "%s", why);
    }
    fu_ck(r, orig_ok, "CORE-AG-01: after the model's forward every slot holds its original object",
          "%s", owhy);
    fu_ck(r, counters_ok,
          "CORE-H03: registrations once per unit and iteration (the parameterless root: pre only)",
          "%s", cwhy);
    fu_ck(r, idle_ok, "F19: every unit IDLE after each step", "%s", iwhy);
done:
    fsdp_tensor_release(x);
    fsdp_tensor_release(out);
    fsdp_tensor_release(loss);
    fu_teardown(ctx, m, root, u, opt);
    return rc;
}

/* ---- main ------------------------------------------------------------------------------------ */

int main(void) {
    tap_plan_lazy();
    for (int w = 2; w <= 3; w++) {
        fu_run("CORE-H01/H02/H03 TransformerWithSharedParams FULL_SHARD", w, FSDP_FULL_SHARD, false,
               hooks_rank);
        fu_run("CORE-H01 TwiceModel FULL_SHARD", w, FSDP_FULL_SHARD, false, twice_rank);
    }
    fu_run("CORE-H01 TwiceModel SHARD_GRAD_OP use_orig_params", 2, FSDP_SHARD_GRAD_OP, true,
           twice_rank);
    /* NO_SHARD excluded, as upstream. */
    for (int w = 2; w <= 3; w++)
        for (int s = 0; s < 2; s++)
            for (int orig = 0; orig < 2; orig++)
                for (int fp = 0; fp < 2; fp++)
                    for (int b = 0; b < 3; b++) {
                        char prefix[160];
                        snprintf(prefix, sizeof prefix,
                                 "CORE-AG-01 %s use_orig_params=%d forward_prefetch=%d "
                                 "backward_prefetch=%s",
                                 fsdp_sharding_strategy_name(fu_strategies[s]), orig, fp,
                                 fsdp_backward_prefetch_name(fu_bwd_prefetches[b]));
                        fu_job_t *j = fu_job_new(prefix, w, fu_strategies[s], orig);
                        j->fwd_prefetch = fp;
                        j->bp = fu_bwd_prefetches[b];
                        fu_run_job(j, ag_rank);
                        free(j);
                    }
    return tap_done();
}
