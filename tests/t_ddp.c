/*
 * t_ddp.c: the DDP wrapper (fsdp/ddp.h), the reference of the FSDP parity tests (spec F50).
 *
 * Every multi-rank case runs over sim ranks (threads). Expected gradients are computed on each
 * rank independently of DDP: an undistributed copy of the model is run once per rank r with
 * the input rank r draws, and the W local gradients are averaged in double. Ranks store what
 * they saw in per-rank slots; the main thread reports after fsdp_sim_run() returns.
 *
 * Cases: gradient and SGD-momentum parity at W = 1..4; bucket counts and bitwise independence
 * of the bucket cap; no_sync; parameters unused on some or all ranks; sync_module_states and
 * broadcast_buffers; DummyDDP and a world of one; a parameterless module; mixed dtypes;
 * determinism; error paths (arguments, models that differ across ranks, a failing collective).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "models/models.h"
#include "tap.h"

#define MAXW 4
#define STEPS 3
#define NP TM_NESTED_NUM_PARAMS
#define RTOL 1.3e-6
#define ATOL 1e-5

/* ---- helpers --------------------------------------------------------------------------------- */

#define CHECK(rc, label, call)                                                                     \
    do {                                                                                           \
        (rc) = (call);                                                                             \
        if ((rc) < 0) goto label;                                                                  \
    } while (0)

/* The input rank r draws in tm_nested_wrapped_get_input: rand(4, 8) after seeding 1 + r. */
static int input_seeded(fsdp_ctx_t *ctx, uint64_t seed, fsdp_tensor_t **x) {
    static const int64_t shape[2] = {4, 8};
    *x = NULL;
    tm_manual_seed(ctx, seed);
    int rc = fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, shape, FSDP_MEM_ACTIVATIONS, x);
    if (rc == 0) rc = fsdp_tensor_uniform_(*x, 0.0, 1.0);
    return rc;
}

static int input_as_rank(fsdp_ctx_t *ctx, int r, fsdp_tensor_t **x) {
    return input_seeded(ctx, 1 + (uint64_t)r, x);
}

/* Every parameter (named_params order) concatenated as f32 into out (room for cap). */
static int params_to_host(fsdp_module_t *m, float *out, size_t cap, size_t *n) {
    fsdp_named_list_t l = {0};
    int rc = fsdp_module_named_params(m, false, &l);
    size_t o = 0;
    for (size_t i = 0; i < l.n && rc == 0; i++) {
        size_t k = (size_t)fsdp_tensor_numel(l.tensors[i]);
        if (o + k > cap) rc = FSDP_EINVAL;
        if (rc == 0) rc = fsdp_tensor_to_host(l.tensors[i], out + o, k * sizeof(float));
        o += k;
    }
    fsdp_named_list_free(&l);
    if (n) *n = o;
    return rc;
}

/* Same for the gradients; a parameter without one reads as NaN. */
static int grads_to_host(fsdp_module_t *m, float *out, size_t cap, size_t *n) {
    fsdp_named_list_t l = {0};
    int rc = fsdp_module_named_params(m, false, &l);
    size_t o = 0;
    for (size_t i = 0; i < l.n && rc == 0; i++) {
        size_t k = (size_t)fsdp_tensor_numel(l.tensors[i]);
        fsdp_tensor_t *g = fsdp_tensor_grad(l.tensors[i]);
        if (o + k > cap)
            rc = FSDP_EINVAL;
        else if (g)
            rc = fsdp_tensor_to_host(g, out + o, k * sizeof(float));
        else
            for (size_t j = 0; j < k; j++)
                out[o + j] = NAN;
        o += k;
    }
    fsdp_named_list_free(&l);
    if (n) *n = o;
    return rc;
}

/* Overwrites every gradient of m (creating missing ones) from host f32 values. */
static int grads_from_host(fsdp_module_t *m, const float *in) {
    fsdp_named_list_t l = {0};
    int rc = fsdp_module_named_params(m, false, &l);
    size_t o = 0;
    for (size_t i = 0; i < l.n && rc == 0; i++) {
        fsdp_tensor_t *p = l.tensors[i], *g = fsdp_tensor_grad(p);
        size_t k = (size_t)fsdp_tensor_numel(p);
        if (!g) {
            fsdp_tensor_t *z = NULL;
            rc = fsdp_tensor_zeros(fsdp_tensor_ctx(p), FSDP_DTYPE_F32, fsdp_tensor_ndim(p),
                                   fsdp_tensor_shape(p), FSDP_MEM_GRADS, &z);
            if (rc == 0) rc = fsdp_tensor_set_grad(p, z);
            fsdp_tensor_release(z);
            g = fsdp_tensor_grad(p);
        }
        if (rc == 0) rc = fsdp_tensor_copy_from_host(g, in + o, k * sizeof(float));
        o += k;
    }
    fsdp_named_list_free(&l);
    return rc;
}

/* Largest violation ratio |a - b| / (atol + rtol |b|) over n values (<= 1 passes); NaN on
 * both sides counts as equal, on one side as a failure (ratio 1e30). */
static double worst(const float *a, const float *b, size_t n) {
    double w = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i]) || isnan(b[i])) {
            if (!(isnan(a[i]) && isnan(b[i]))) w = 1e30;
            continue;
        }
        double r = fabs((double)a[i] - (double)b[i]) / (ATOL + RTOL * fabs((double)b[i]));
        if (r > w) w = r;
    }
    return w;
}

static int optim_for(fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_optim_t **opt) {
    fsdp_sgd_options_t so;
    fsdp_named_list_t l = {0};
    fsdp_sgd_options_init(&so);
    so.lr = 0.01;
    so.momentum = 0.9;
    int rc = fsdp_optim_sgd_create(ctx, &so, opt);
    if (rc == 0) rc = fsdp_module_named_params(m, false, &l);
    if (rc == 0)
        rc = fsdp_optim_add_group(*opt, l.n, l.tensors, (const char *const *)l.names, NULL, NULL);
    fsdp_named_list_free(&l);
    return rc;
}

/* forward + sum loss + backward on a plain module; *loss_out (may be NULL) gets the loss. */
static int plain_step(fsdp_module_t *m, fsdp_tensor_t *x, double *loss_out) {
    fsdp_tensor_t *y = NULL, *loss = NULL;
    int rc = fsdp_module_forward1(m, x, &y);
    if (rc == 0) rc = tm_sum_loss(y, &loss);
    if (rc == 0 && loss_out) rc = fsdp_tensor_item(loss, 0, loss_out);
    if (rc == 0) rc = fsdp_backward(loss, NULL);
    fsdp_tensor_release(y);
    fsdp_tensor_release(loss);
    return rc;
}

static int ddp_step(fsdp_ddp_t *d, fsdp_tensor_t *x, double *loss_out) {
    fsdp_tensor_t *y = NULL, *loss = NULL;
    int rc = fsdp_ddp_forward1(d, x, &y);
    if (rc == 0) rc = tm_sum_loss(y, &loss);
    if (rc == 0 && loss_out) rc = fsdp_tensor_item(loss, 0, loss_out);
    if (rc == 0) rc = fsdp_backward(loss, NULL);
    fsdp_tensor_release(y);
    fsdp_tensor_release(loss);
    return rc;
}

static uint64_t coll_calls(fsdp_pg_t *pg, fsdp_coll_kind_t k) {
    fsdp_pg_counters_t c;
    fsdp_pg_get_counters(pg, &c);
    return c.calls[k];
}

static uint64_t coll_total(fsdp_pg_t *pg) {
    fsdp_pg_counters_t c;
    uint64_t t = 0;
    fsdp_pg_get_counters(pg, &c);
    for (int k = 0; k < FSDP_COLL_COUNT; k++)
        t += c.calls[k];
    return t;
}

static int run_sim(int world, fsdp_sim_fn fn, void *arg, const fsdp_sim_fault_t *faults,
                   size_t nfaults, int *status) {
    fsdp_sim_options_t o;
    fsdp_sim_options_init(&o);
    o.world_size = world;
    o.seed = 7;
    o.timeout_ms = 20000;
    o.faults = faults;
    o.nfaults = nfaults;
    return fsdp_sim_run(&o, fn, arg, status);
}

/* ---- 1, 7: gradient and training parity, determinism ----------------------------------------- */

typedef struct {
    int rc;
    double grad_worst, loss_worst, param_worst;
    double loss[STEPS];
    float grad0[NP];    /* DDP gradients after the first backward */
    float params[NP];   /* after the last step */
    uint64_t allreduce; /* all-reduces issued by the last step */
    uint64_t allreduce_bytes;
    fsdp_ddp_stats_t stats;
    size_t comm_leak, total_leak;
    char bucket0[3][64]; /* names of bucket 0's first parameters */
    size_t bucket0_n;
} train_res_t;

typedef struct {
    size_t cap; /* bucket cap; 0: default */
    train_res_t r[MAXW];
} train_t;

static int train_fn(fsdp_ctx_t *ctx, void *arg) {
    train_t *t = arg;
    int rank = fsdp_ctx_rank(ctx), world = fsdp_ctx_world_size(ctx), rc;
    train_res_t *res = &t->r[rank];
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_ddp_t *d = NULL;
    fsdp_optim_t *opt = NULL, *ropt = NULL;
    fsdp_tensor_t *x = NULL;
    fsdp_ddp_options_t o;
    fsdp_mem_stats_t before, after;
    static _Thread_local float g[NP], rg[NP], p[NP], rp[NP];
    static _Thread_local double acc[NP];
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    fsdp_ctx_device(ctx);
    fsdp_mem_get_stats(ctx, &before);
    fsdp_ddp_options_init(&o);
    if (t->cap) o.bucket_cap_bytes = t->cap;
    CHECK(rc, out, tm_nested_wrapped_create(ctx, true, &m));
    CHECK(rc, out, tm_nested_wrapped_create(ctx, true, &ref));
    CHECK(rc, out, fsdp_ddp_create(m, pg, &o, &d));
    CHECK(rc, out, optim_for(ctx, m, &opt));
    CHECK(rc, out, optim_for(ctx, ref, &ropt));
    res->bucket0_n = fsdp_ddp_bucket_num_params(d, 0);
    for (size_t i = 0; i < res->bucket0_n && i < 3; i++) {
        const char *nm = NULL;
        fsdp_ddp_bucket_param(d, 0, i, &nm);
        snprintf(res->bucket0[i], sizeof res->bucket0[i], "%s", nm ? nm : "");
    }
    for (int s = 0; s < STEPS; s++) {
        double ref_loss = 0;
        CHECK(rc, out, fsdp_optim_zero_grad(opt, false));
        CHECK(rc, out, tm_nested_wrapped_get_input(ctx, &x));
        fsdp_pg_reset_counters(pg);
        CHECK(rc, out, ddp_step(d, x, &res->loss[s]));
        {
            fsdp_pg_counters_t c;
            fsdp_pg_get_counters(pg, &c);
            res->allreduce = c.calls[FSDP_COLL_ALL_REDUCE];
            res->allreduce_bytes = c.bytes[FSDP_COLL_ALL_REDUCE];
        }
        fsdp_tensor_release(x);
        x = NULL;
        /* The reference: every rank's local gradient, averaged. */
        memset(acc, 0, sizeof acc);
        for (int r = 0; r < world; r++) {
            double l;
            CHECK(rc, out, fsdp_module_zero_grad(ref, true));
            CHECK(rc, out, input_as_rank(ctx, r, &x));
            CHECK(rc, out, plain_step(ref, x, &l));
            fsdp_tensor_release(x);
            x = NULL;
            if (r == rank) ref_loss = l;
            CHECK(rc, out, grads_to_host(ref, rg, NP, NULL));
            for (int i = 0; i < NP; i++)
                acc[i] += rg[i];
        }
        for (int i = 0; i < NP; i++)
            rg[i] = (float)(acc[i] / world);
        CHECK(rc, out, grads_from_host(ref, rg));
        CHECK(rc, out, grads_to_host(m, g, NP, NULL));
        if (s == 0) memcpy(res->grad0, g, sizeof g);
        double w = worst(g, rg, NP);
        if (w > res->grad_worst) res->grad_worst = w;
        w = fabs(res->loss[s] - ref_loss) / (ATOL + RTOL * fabs(ref_loss));
        if (w > res->loss_worst) res->loss_worst = w;
        CHECK(rc, out, fsdp_optim_step(opt));
        CHECK(rc, out, fsdp_optim_step(ropt));
        CHECK(rc, out, params_to_host(m, p, NP, NULL));
        CHECK(rc, out, params_to_host(ref, rp, NP, NULL));
        w = worst(p, rp, NP);
        if (w > res->param_worst) res->param_worst = w;
    }
    memcpy(res->params, p, sizeof p);
    fsdp_ddp_get_stats(d, &res->stats);
out:
    fsdp_tensor_release(x);
    fsdp_ddp_destroy(d);
    fsdp_optim_destroy(opt);
    fsdp_optim_destroy(ropt);
    fsdp_module_release(m);
    fsdp_module_release(ref);
    fsdp_tape_clear(ctx);
    fsdp_mem_get_stats(ctx, &after);
    res->comm_leak = after.current[FSDP_MEM_COMM] - before.current[FSDP_MEM_COMM];
    res->total_leak = after.total_current - before.total_current;
    res->rc = rc;
    return rc;
}

static train_t tr[MAXW + 1], tr_again, tr_small, tr_big;

static void test_parity(void) {
    for (int w = 1; w <= MAXW; w++) {
        train_t *t = &tr[w];
        int rc = run_sim(w, train_fn, t, NULL, 0, NULL);
        int ok_rc = rc == 0, grads = 1, loss = 1, params = 1, same = 1, noleak = 1, calls = 1;
        double gw = 0, lw = 0, pw = 0;
        for (int r = 0; r < w; r++) {
            ok_rc &= t->r[r].rc == 0;
            gw = fmax(gw, t->r[r].grad_worst);
            lw = fmax(lw, t->r[r].loss_worst);
            pw = fmax(pw, t->r[r].param_worst);
            same &= memcmp(t->r[r].params, t->r[0].params, sizeof t->r[0].params) == 0;
            noleak &= t->r[r].comm_leak == 0 && t->r[r].total_leak == 0;
            /* One bucket (default cap) + the used flags at W > 1; nothing at W = 1. */
            calls &= t->r[r].allreduce == (w > 1 ? 2u : 0u) &&
                     t->r[r].stats.last_allreduce_calls == t->r[r].allreduce;
        }
        grads = gw <= 1;
        loss = lw <= 1;
        params = pw <= 1;
        tap_ok(ok_rc, "F50 W=%d: %d ranks train NestedWrappedModule under DDP (%s)", w, w,
               fsdp_strerror(rc));
        tap_ok(grads,
               "F50 W=%d: DDP gradients equal the average of the ranks' local gradients "
               "(worst %.3g of rtol 1.3e-6 + atol 1e-5)",
               w, gw);
        tap_ok(loss,
               "F50 W=%d: %d SGD-momentum steps: every loss matches the reference (worst %.3g)", w,
               STEPS, lw);
        tap_ok(params,
               "F50 W=%d: parameters match the single-process reference after each step "
               "(worst %.3g)",
               w, pw);
        tap_ok(same, "F50 W=%d: every rank's parameters are bitwise rank 0's (replicas stay equal)",
               w);
        tap_ok(calls, "F50 W=%d: %s all-reduces per synced backward", w,
               w > 1 ? "bucket + used flags = 2" : "no");
        tap_ok(noleak, "F50 W=%d: destroy returns every byte (comm buffers included)", w);
    }
    /* 7: the same run again gives the same bits. */
    int rc = run_sim(3, train_fn, &tr_again, NULL, 0, NULL);
    int same = rc == 0;
    for (int r = 0; r < 3; r++) {
        same &= memcmp(tr_again.r[r].loss, tr[3].r[r].loss, sizeof tr[3].r[r].loss) == 0;
        same &= memcmp(tr_again.r[r].params, tr[3].r[r].params, sizeof tr[3].r[r].params) == 0;
        same &= memcmp(tr_again.r[r].grad0, tr[3].r[r].grad0, sizeof tr[3].r[r].grad0) == 0;
    }
    tap_ok(same, "determinism: a second W=3 run gives bitwise the same losses, gradients and "
                 "parameters");
    /* The W=3 average is not a power-of-two division: the ranks' losses differ, so the check
     * above really compares different per-rank inputs. */
    tap_ok(tr[3].r[0].loss[0] != tr[3].r[1].loss[0], "ranks see different inputs (losses %g, %g)",
           tr[3].r[0].loss[0], tr[3].r[1].loss[0]);
}

/* ---- 2: buckets ------------------------------------------------------------------------------ */

/* Expected buckets for f32 parameters of the given sizes (registration order), by the rule of
 * fsdp/ddp.h: reverse order, greedy, never over cap unless a parameter alone is larger. */
static size_t expected_buckets(const int64_t *numel, size_t n, size_t cap) {
    size_t nb = 0, cur = 0;
    bool open = false;
    for (size_t i = n; i-- > 0;) {
        size_t b = (size_t)numel[i] * 4;
        if (open && cur + b > cap) open = false;
        if (!open) {
            nb++;
            cur = 0;
            open = true;
        }
        cur += b;
    }
    return nb;
}

static void test_buckets(void) {
    const size_t cap = 256;
    tr_small.cap = cap;
    tr_big.cap = 0;
    int rc1 = run_sim(2, train_fn, &tr_small, NULL, 0, NULL);
    int rc2 = run_sim(2, train_fn, &tr_big, NULL, 0, NULL);
    tap_ok(rc1 == 0 && rc2 == 0, "F50 buckets: W=2 runs with a 256-byte and a 25 MiB cap");
    /* NestedWrappedModule's parameters in registration order. */
    fsdp_ctx_t *ctx = NULL;
    fsdp_ctx_options_t co;
    fsdp_module_t *m = NULL;
    fsdp_named_list_t l = {0};
    int64_t numel[16];
    size_t n = 0;
    fsdp_ctx_options_init(&co);
    fsdp_ctx_create(&co, &ctx);
    tm_nested_wrapped_create(ctx, true, &m);
    fsdp_module_named_params(m, false, &l);
    for (size_t i = 0; i < l.n && i < 16; i++)
        numel[n++] = fsdp_tensor_numel(l.tensors[i]);
    size_t want = expected_buckets(numel, n, cap);
    size_t bytes = 0;
    for (size_t i = 0; i < n; i++)
        bytes += (size_t)numel[i] * 4;
    fsdp_named_list_free(&l);
    fsdp_module_release(m);
    fsdp_ctx_destroy(ctx);
    /* By hand: [3.bias 3.weight 2.bias] [2.weight] [1.1.bias] [1.1.weight] [1.0.bias]
     * [1.0.weight] [0.bias 0.weight]. */
    tap_is_size(want, 7, "F50 buckets: the reverse-order packing rule gives 7 buckets at 256 B");
    for (int r = 0; r < 2; r++) {
        tap_is_size(tr_small.r[r].stats.num_buckets, want, "rank %d: DDP built that many buckets",
                    r);
        tap_is_uint(tr_small.r[r].allreduce, want + 1,
                    "rank %d: all-reduces per synced backward (pg counters) = buckets + used flags",
                    r);
        tap_is_uint(tr_small.r[r].allreduce_bytes, bytes + n * 4,
                    "rank %d: all-reduce bytes = gradients + one i32 flag per parameter", r);
        tap_is_uint(tr_small.r[r].stats.last_early_launches, want,
                    "rank %d: every bucket was launched from a grad hook, overlapping backward", r);
        tap_is_size(tr_big.r[r].stats.num_buckets, 1, "rank %d: the default cap gives 1 bucket", r);
    }
    tap_ok(tr_small.r[0].bucket0_n == 3 && strcmp(tr_small.r[0].bucket0[0], "module.3.bias") == 0 &&
               strcmp(tr_small.r[0].bucket0[1], "module.3.weight") == 0 &&
               strcmp(tr_small.r[0].bucket0[2], "module.2.bias") == 0,
           "F50 buckets: bucket 0 holds module.3.bias, module.3.weight, module.2.bias (got %zu: "
           "%s %s %s)",
           tr_small.r[0].bucket0_n, tr_small.r[0].bucket0[0], tr_small.r[0].bucket0[1],
           tr_small.r[0].bucket0[2]);
    int same = 1;
    for (int r = 0; r < 2; r++) {
        same &= memcmp(tr_small.r[r].grad0, tr_big.r[r].grad0, sizeof tr_big.r[r].grad0) == 0;
        same &= memcmp(tr_small.r[r].loss, tr_big.r[r].loss, sizeof tr_big.r[r].loss) == 0;
        same &= memcmp(tr_small.r[r].params, tr_big.r[r].params, sizeof tr_big.r[r].params) == 0;
    }
    tap_ok(same, "F50 buckets: 7 small buckets give bitwise the gradients, losses and parameters "
                 "of one big bucket");
}

/* ---- 3: no_sync ------------------------------------------------------------------------------ */

typedef struct {
    struct {
        int rc;
        uint64_t nosync_calls, sync_allreduce;
        int local_bitwise;
        double worst;
    } r[MAXW];
} nosync_t;

static int nosync_fn(fsdp_ctx_t *ctx, void *arg) {
    nosync_t *t = arg;
    int rank = fsdp_ctx_rank(ctx), world = fsdp_ctx_world_size(ctx), rc;
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_ddp_t *d = NULL;
    fsdp_tensor_t *x = NULL;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    fsdp_ddp_options_t o;
    static _Thread_local float g[NP], rg[NP];
    static _Thread_local double acc[NP];
    fsdp_ddp_options_init(&o);
    o.bucket_cap_bytes = 256;
    CHECK(rc, out, tm_nested_wrapped_create(ctx, true, &m));
    CHECK(rc, out, tm_nested_wrapped_create(ctx, true, &ref));
    CHECK(rc, out, fsdp_ddp_create(m, pg, &o, &d));
    fsdp_pg_reset_counters(pg);
    CHECK(rc, out, fsdp_ddp_set_sync(d, false));
    for (int k = 0; k < 2; k++) {
        CHECK(rc, out, input_seeded(ctx, 100 + 10 * (uint64_t)k + (uint64_t)rank, &x));
        CHECK(rc, out, ddp_step(d, x, NULL));
        fsdp_tensor_release(x);
        x = NULL;
    }
    t->r[rank].nosync_calls = coll_total(pg);
    /* Under no_sync the gradients are this rank's own accumulation, bit for bit. */
    for (int k = 0; k < 2; k++) {
        CHECK(rc, out, input_seeded(ctx, 100 + 10 * (uint64_t)k + (uint64_t)rank, &x));
        CHECK(rc, out, plain_step(ref, x, NULL));
        fsdp_tensor_release(x);
        x = NULL;
    }
    CHECK(rc, out, grads_to_host(m, g, NP, NULL));
    CHECK(rc, out, grads_to_host(ref, rg, NP, NULL));
    t->r[rank].local_bitwise = memcmp(g, rg, sizeof g) == 0;
    CHECK(rc, out, fsdp_ddp_set_sync(d, true));
    CHECK(rc, out, input_seeded(ctx, 120 + (uint64_t)rank, &x));
    fsdp_pg_reset_counters(pg);
    CHECK(rc, out, ddp_step(d, x, NULL));
    t->r[rank].sync_allreduce = coll_calls(pg, FSDP_COLL_ALL_REDUCE);
    fsdp_tensor_release(x);
    x = NULL;
    /* Reference: three accumulated backwards per rank, averaged over the ranks. */
    memset(acc, 0, sizeof acc);
    for (int r = 0; r < world; r++) {
        CHECK(rc, out, fsdp_module_zero_grad(ref, true));
        for (int k = 0; k < 3; k++) {
            CHECK(rc, out, input_seeded(ctx, 100 + 10 * (uint64_t)k + (uint64_t)r, &x));
            CHECK(rc, out, plain_step(ref, x, NULL));
            fsdp_tensor_release(x);
            x = NULL;
        }
        CHECK(rc, out, grads_to_host(ref, rg, NP, NULL));
        for (int i = 0; i < NP; i++)
            acc[i] += rg[i];
    }
    for (int i = 0; i < NP; i++)
        rg[i] = (float)(acc[i] / world);
    CHECK(rc, out, grads_to_host(m, g, NP, NULL));
    t->r[rank].worst = worst(g, rg, NP);
out:
    fsdp_tensor_release(x);
    fsdp_ddp_destroy(d);
    fsdp_module_release(m);
    fsdp_module_release(ref);
    t->r[rank].rc = rc;
    return rc;
}

static void test_nosync(void) {
    static nosync_t t;
    int rc = run_sim(2, nosync_fn, &t, NULL, 0, NULL);
    tap_ok(rc == 0 && t.r[0].rc == 0 && t.r[1].rc == 0, "no_sync: W=2 run (%s)", fsdp_strerror(rc));
    for (int r = 0; r < 2; r++) {
        tap_is_uint(t.r[r].nosync_calls, 0, "no_sync rank %d: two backwards issue no collective",
                    r);
        tap_ok(t.r[r].local_bitwise,
               "no_sync rank %d: gradients are the local accumulation, bitwise", r);
        tap_is_uint(t.r[r].sync_allreduce, 8,
                    "no_sync rank %d: the synced backward issues 7 buckets + used flags", r);
        tap_ok(t.r[r].worst <= 1,
               "no_sync rank %d: 2 no_sync + 1 synced backward = average of 3 accumulated "
               "backwards (worst %.3g)",
               r, t.r[r].worst);
    }
}

/* ---- 4: unused parameters -------------------------------------------------------------------- */

/* "Partial": a, b, c = Linear(8, 4); y = a(x) (+ b(x) when acting as rank 0); c never used. */
typedef struct {
    int as_rank;
} partial_t;

static int partial_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                           fsdp_tensor_t **out) {
    partial_t *p = fsdp_module_impl(m);
    fsdp_tensor_t *ya = NULL, *yb = NULL;
    if (nin != 1 || nout != 1) return FSDP_EINVAL;
    int rc = fsdp_module_forward1(fsdp_module_child(m, "a"), in[0], &ya);
    if (rc < 0) return rc;
    if (p->as_rank != 0) {
        out[0] = ya;
        return FSDP_OK;
    }
    rc = fsdp_module_forward1(fsdp_module_child(m, "b"), in[0], &yb);
    if (rc == 0) rc = fsdp_add(ya, yb, &out[0]);
    fsdp_tensor_release(ya);
    fsdp_tensor_release(yb);
    return rc;
}

static const fsdp_module_ops_t partial_ops = {"Partial", partial_forward, free};

static int partial_create(fsdp_ctx_t *ctx, int as_rank, fsdp_module_t **out) {
    partial_t *impl = malloc(sizeof *impl);
    fsdp_module_t *m = NULL;
    int rc;
    *out = NULL;
    if (!impl) return FSDP_ENOMEM;
    impl->as_rank = as_rank;
    rc = fsdp_module_create(ctx, &partial_ops, impl, &m);
    if (rc < 0) {
        free(impl);
        return rc;
    }
    tm_manual_seed(ctx, 3);
    const char *names[3] = {"a", "b", "c"};
    for (int i = 0; i < 3 && rc == 0; i++) {
        fsdp_module_t *l = NULL;
        rc = fsdp_linear_create(ctx, 8, 4, true, &l);
        if (rc == 0) rc = fsdp_module_add_child(m, names[i], l);
        fsdp_module_release(l);
    }
    if (rc < 0) {
        fsdp_module_release(m);
        return rc;
    }
    *out = m;
    return FSDP_OK;
}

#define PARTIAL_NP (3 * (32 + 4))

typedef struct {
    struct {
        int rc;
        double worst_a, worst_b;
        int b_ok;   /* b.grad created (ranks 0, 1) or the stale one updated (rank 2) */
        int b_kept; /* iteration 2 (b used nowhere): b.grad bitwise unchanged */
        size_t unused2;
        int c_weight_kept; /* the stale c.weight grad (rank 1) is the same tensor, unchanged */
        int c_none;        /* c's gradients are none where they were none */
        size_t unused;
    } r[MAXW];
} unused_t;

static int unused_fn(fsdp_ctx_t *ctx, void *arg) {
    unused_t *t = arg;
    int rank = fsdp_ctx_rank(ctx), world = fsdp_ctx_world_size(ctx), rc;
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_ddp_t *d = NULL;
    fsdp_tensor_t *x = NULL, *stale = NULL, *stale_b = NULL;
    float g[PARTIAL_NP], rg[PARTIAL_NP], sv[32], b1[32], b2[32];
    double acc[PARTIAL_NP];
    fsdp_ddp_options_t o;
    fsdp_ddp_options_init(&o);
    o.bucket_cap_bytes = 64; /* several buckets, some holding unused parameters */
    CHECK(rc, out, partial_create(ctx, rank, &m));
    CHECK(rc, out, fsdp_ddp_create(m, fsdp_ctx_pg(ctx), &o, &d));
    fsdp_tensor_t *cw = fsdp_module_param(m, "c.weight");
    fsdp_tensor_t *cb = fsdp_module_param(m, "c.bias");
    fsdp_tensor_t *bw = fsdp_module_param(m, "b.weight");
    if (rank == 1) {
        CHECK(rc, out,
              fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 2, fsdp_tensor_shape(cw), 7.0, FSDP_MEM_GRADS,
                               &stale));
        CHECK(rc, out, fsdp_tensor_set_grad(cw, stale));
    }
    if (rank == 2) {
        /* A stale gradient on a rank that does not use b: it must contribute zeros. */
        CHECK(rc, out,
              fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 2, fsdp_tensor_shape(bw), 5.0, FSDP_MEM_GRADS,
                               &stale_b));
        CHECK(rc, out, fsdp_tensor_set_grad(bw, stale_b));
    }
    int b_had = fsdp_tensor_grad(bw) != NULL;
    CHECK(rc, out, tm_nested_wrapped_get_input(ctx, &x));
    CHECK(rc, out, ddp_step(d, x, NULL));
    fsdp_tensor_release(x);
    x = NULL;
    t->r[rank].b_ok =
        rank == 2 ? fsdp_tensor_grad(bw) == stale_b : !b_had && fsdp_tensor_grad(bw) != NULL;
    if (rank == 1) {
        rc = fsdp_tensor_to_host(fsdp_tensor_grad(cw), sv, sizeof sv);
        int kept = rc == 0 && fsdp_tensor_grad(cw) == stale;
        for (int i = 0; i < 32; i++)
            kept &= sv[i] == 7.0f;
        t->r[rank].c_weight_kept = kept;
        t->r[rank].c_none = fsdp_tensor_grad(cb) == NULL;
    } else {
        t->r[rank].c_weight_kept = 1;
        t->r[rank].c_none = fsdp_tensor_grad(cw) == NULL && fsdp_tensor_grad(cb) == NULL;
    }
    fsdp_ddp_stats_t st;
    fsdp_ddp_get_stats(d, &st);
    t->r[rank].unused = st.last_unused_params;
    /* Reference: each rank's local gradients of a and b (zeros where unused), averaged. */
    memset(acc, 0, sizeof acc);
    for (int r = 0; r < world; r++) {
        CHECK(rc, out, partial_create(ctx, r, &ref));
        CHECK(rc, out, input_as_rank(ctx, r, &x));
        CHECK(rc, out, plain_step(ref, x, NULL));
        fsdp_tensor_release(x);
        x = NULL;
        CHECK(rc, out, grads_to_host(ref, rg, PARTIAL_NP, NULL));
        for (int i = 0; i < PARTIAL_NP; i++)
            acc[i] += isnan(rg[i]) ? 0.0 : rg[i];
        fsdp_module_release(ref);
        ref = NULL;
    }
    for (int i = 0; i < PARTIAL_NP; i++)
        rg[i] = (float)(acc[i] / world);
    CHECK(rc, out, grads_to_host(m, g, PARTIAL_NP, NULL));
    /* named_params order: a.weight, a.bias, b.weight, b.bias, c.weight, c.bias. */
    t->r[rank].worst_a = worst(g, rg, 36);
    t->r[rank].worst_b = worst(g + 36, rg + 36, 36);
    /* Iteration 2: b is used nowhere now, so its averaged gradient stays as it is (the used
     * flags of iteration 1 were cleared by its synced backward). */
    ((partial_t *)fsdp_module_impl(m))->as_rank = -1;
    CHECK(rc, out, fsdp_tensor_to_host(fsdp_tensor_grad(bw), b1, sizeof b1));
    CHECK(rc, out, tm_nested_wrapped_get_input(ctx, &x));
    CHECK(rc, out, ddp_step(d, x, NULL));
    CHECK(rc, out, fsdp_tensor_to_host(fsdp_tensor_grad(bw), b2, sizeof b2));
    t->r[rank].b_kept = memcmp(b1, b2, sizeof b1) == 0;
    fsdp_ddp_get_stats(d, &st);
    t->r[rank].unused2 = st.last_unused_params;
out:
    fsdp_tensor_release(x);
    fsdp_tensor_release(stale);
    fsdp_tensor_release(stale_b);
    fsdp_ddp_destroy(d);
    fsdp_module_release(m);
    fsdp_module_release(ref);
    t->r[rank].rc = rc;
    return rc;
}

static void test_unused(void) {
    static unused_t t;
    int rc = run_sim(3, unused_fn, &t, NULL, 0, NULL);
    tap_ok(rc == 0, "find_unused (UOP-MPG-04/05): W=3, b used on rank 0 only, c on no rank (%s)",
           fsdp_strerror(rc));
    for (int r = 0; r < 3; r++) {
        tap_ok(t.r[r].worst_a <= 1, "rank %d: a (used everywhere) gets the average (worst %.3g)", r,
               t.r[r].worst_a);
        tap_ok(t.r[r].worst_b <= 1,
               "rank %d: b (used on rank 0) gets rank 0's gradient / 3 (worst %.3g)", r,
               t.r[r].worst_b);
        if (r == 2)
            tap_ok(t.r[r].b_ok, "rank 2: b's stale gradient (not used here) contributed zeros "
                                "and was overwritten in place");
        else
            tap_ok(t.r[r].b_ok, "rank %d: b.grad was none and now exists", r);
        tap_ok(t.r[r].c_none, "rank %d: c (used nowhere): none stays none", r);
        tap_is_size(t.r[r].unused, 2, "rank %d: stats count 2 parameters unused everywhere", r);
        tap_ok(t.r[r].b_kept && t.r[r].unused2 == 4,
               "rank %d: next iteration, b used nowhere: its gradient is left alone (%zu unused)",
               r, t.r[r].unused2);
    }
    tap_ok(t.r[1].c_weight_kept,
           "rank 1: the stale c.weight gradient is left untouched (same tensor, same values)");
}

/* ---- 5: sync_module_states and broadcast_buffers --------------------------------------------- */

/* "Buffered": lin = Linear(8, 4) drawn from a per-rank seed; buffers scale (f32 [4], persistent)
 * and count (i64 [2], not persistent); y = lin(x) + scale. */
static int buffered_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                            fsdp_tensor_t **out) {
    fsdp_tensor_t *y = NULL;
    if (nin != 1 || nout != 1) return FSDP_EINVAL;
    int rc = fsdp_module_forward1(fsdp_module_child(m, "lin"), in[0], &y);
    if (rc == 0) rc = fsdp_add(y, fsdp_module_buffer(m, "scale"), &out[0]);
    fsdp_tensor_release(y);
    return rc;
}

static const fsdp_module_ops_t buffered_ops = {"Buffered", buffered_forward, NULL};

static int buffered_create(fsdp_ctx_t *ctx, uint64_t seed, fsdp_module_t **out) {
    fsdp_module_t *m = NULL, *l = NULL;
    fsdp_tensor_t *s = NULL, *c = NULL;
    int rc;
    *out = NULL;
    CHECK(rc, fail, fsdp_module_create(ctx, &buffered_ops, NULL, &m));
    tm_manual_seed(ctx, seed);
    CHECK(rc, fail, fsdp_linear_create(ctx, 8, 4, true, &l));
    CHECK(rc, fail, fsdp_module_add_child(m, "lin", l));
    CHECK(rc, fail, fsdp_tensor_zeros(ctx, FSDP_DTYPE_F32, 1, (int64_t[]){4}, FSDP_MEM_OTHER, &s));
    CHECK(rc, fail, fsdp_module_add_buffer(m, "scale", s, true));
    CHECK(rc, fail, fsdp_tensor_zeros(ctx, FSDP_DTYPE_I64, 1, (int64_t[]){2}, FSDP_MEM_OTHER, &c));
    CHECK(rc, fail, fsdp_module_add_buffer(m, "count", c, false));
    *out = m;
    m = NULL;
fail:
    fsdp_module_release(l);
    fsdp_tensor_release(s);
    fsdp_tensor_release(c);
    fsdp_module_release(m);
    return rc;
}

static int set_buffers(fsdp_module_t *m, float sv, int64_t cv) {
    float s[4] = {sv, sv + 1, sv + 2, sv + 3};
    int64_t c[2] = {cv, -cv};
    int rc = fsdp_tensor_copy_from_host(fsdp_module_buffer(m, "scale"), s, sizeof s);
    if (rc == 0) rc = fsdp_tensor_copy_from_host(fsdp_module_buffer(m, "count"), c, sizeof c);
    return rc;
}

typedef struct {
    int rc;
    float w0[32];        /* lin.weight after creation */
    float s_create[4];   /* scale after creation */
    int64_t c_create[2]; /* count after creation */
    float s_fwd[4];      /* scale after a forward (buffers reset per rank before it) */
    int64_t c_fwd[2];
    float s_ns1[4]; /* after a no_sync forward that follows a synced one */
    float s_ns2[4]; /* after a no_sync forward that follows a no_sync one */
    int same_objects;
} states_res_t;

typedef struct {
    bool sync_states, bcast;
    states_res_t r[MAXW];
} states_t;

static int states_fn(fsdp_ctx_t *ctx, void *arg) {
    states_t *t = arg;
    int rank = fsdp_ctx_rank(ctx), rc;
    fsdp_module_t *m = NULL;
    fsdp_ddp_t *d = NULL;
    fsdp_tensor_t *x = NULL;
    fsdp_ddp_options_t o;
    states_res_t *res = &t->r[rank];
    fsdp_ddp_options_init(&o);
    o.sync_module_states = t->sync_states;
    o.broadcast_buffers = t->bcast;
    CHECK(rc, out, buffered_create(ctx, 50 + (uint64_t)rank, &m));
    CHECK(rc, out, set_buffers(m, 10.0f * (float)rank, 100 * rank + 1));
    fsdp_tensor_t *w = fsdp_module_param(m, "lin.weight");
    fsdp_tensor_t *sb = fsdp_module_buffer(m, "scale");
    CHECK(rc, out, fsdp_ddp_create(m, fsdp_ctx_pg(ctx), &o, &d));
    res->same_objects = w == fsdp_module_param(m, "lin.weight") &&
                        sb == fsdp_module_buffer(m, "scale") && fsdp_ddp_module(d) == m;
    CHECK(rc, out, fsdp_tensor_to_host(w, res->w0, sizeof res->w0));
    CHECK(rc, out, fsdp_tensor_to_host(sb, res->s_create, sizeof res->s_create));
    CHECK(rc, out,
          fsdp_tensor_to_host(fsdp_module_buffer(m, "count"), res->c_create, sizeof res->c_create));
    CHECK(rc, out, tm_nested_wrapped_get_input(ctx, &x));
    CHECK(rc, out, set_buffers(m, 20.0f + (float)rank, 7 + rank));
    CHECK(rc, out, ddp_step(d, x, NULL));
    CHECK(rc, out, fsdp_tensor_to_host(sb, res->s_fwd, sizeof res->s_fwd));
    CHECK(rc, out,
          fsdp_tensor_to_host(fsdp_module_buffer(m, "count"), res->c_fwd, sizeof res->c_fwd));
    /* PyTorch's rule: a forward broadcasts unless the previous forward ran under no_sync. */
    CHECK(rc, out, fsdp_ddp_set_sync(d, false));
    CHECK(rc, out, set_buffers(m, 30.0f + (float)rank, 0));
    CHECK(rc, out, ddp_step(d, x, NULL));
    CHECK(rc, out, fsdp_tensor_to_host(sb, res->s_ns1, sizeof res->s_ns1));
    CHECK(rc, out, set_buffers(m, 40.0f + (float)rank, 0));
    CHECK(rc, out, ddp_step(d, x, NULL));
    CHECK(rc, out, fsdp_tensor_to_host(sb, res->s_ns2, sizeof res->s_ns2));
out:
    fsdp_tensor_release(x);
    fsdp_ddp_destroy(d);
    fsdp_module_release(m);
    res->rc = rc;
    return rc;
}

static void test_states(void) {
    static states_t on, off;
    on.sync_states = on.bcast = true;
    off.sync_states = off.bcast = false;
    int rc1 = run_sim(3, states_fn, &on, NULL, 0, NULL);
    int rc2 = run_sim(3, states_fn, &off, NULL, 0, NULL);
    tap_ok(rc1 == 0 && rc2 == 0, "states: W=3 runs with and without sync_module_states and "
                                 "broadcast_buffers");
    int params = 1, bufs = 1, fwd = 1, objs = 1, ns1 = 1, ns2 = 1;
    for (int r = 1; r < 3; r++) {
        params &= memcmp(on.r[r].w0, on.r[0].w0, sizeof on.r[0].w0) == 0;
        bufs &= memcmp(on.r[r].s_create, on.r[0].s_create, sizeof on.r[0].s_create) == 0 &&
                memcmp(on.r[r].c_create, on.r[0].c_create, sizeof on.r[0].c_create) == 0;
        fwd &= memcmp(on.r[r].s_fwd, on.r[0].s_fwd, sizeof on.r[0].s_fwd) == 0 &&
               memcmp(on.r[r].c_fwd, on.r[0].c_fwd, sizeof on.r[0].c_fwd) == 0;
        ns1 &= memcmp(on.r[r].s_ns1, on.r[0].s_ns1, sizeof on.r[0].s_ns1) == 0;
        ns2 &= on.r[r].s_ns2[0] == 40.0f + (float)r;
    }
    for (int r = 0; r < 3; r++)
        objs &= on.r[r].same_objects;
    tap_ok(params, "sync_module_states: every rank's lin.weight is rank 0's after creation");
    tap_ok(bufs && on.r[2].c_create[0] == 1 && on.r[2].s_create[0] == 0.0f,
           "sync_module_states: buffers (f32 persistent, i64 not persistent) are rank 0's");
    tap_ok(objs, "sync_module_states: parameters and buffers stay the same tensor objects");
    tap_ok(fwd && on.r[1].s_fwd[0] == 20.0f && on.r[2].c_fwd[1] == -7,
           "broadcast_buffers: before a forward every buffer is replaced by rank 0's");
    tap_ok(ns1 && on.r[2].s_ns1[0] == 30.0f,
           "broadcast_buffers: a no_sync forward after a synced one still broadcasts");
    tap_ok(ns2, "broadcast_buffers: a forward after a no_sync forward does not (PyTorch's "
                "require_forward_param_sync)");
    int differ = memcmp(off.r[1].w0, off.r[0].w0, sizeof off.r[0].w0) != 0 &&
                 off.r[1].s_create[0] == 10.0f && off.r[2].s_fwd[0] == 22.0f;
    tap_ok(differ, "without sync_module_states and broadcast_buffers ranks keep their own values");
}

/* ---- 6: DummyDDP, a world of one, a parameterless module, mixed dtypes ----------------------- */

typedef struct {
    struct {
        int rc;
        uint64_t calls;
        int bitwise;
        size_t buckets;
    } r[MAXW];
} dummy_t;

static int dummy_fn(fsdp_ctx_t *ctx, void *arg) {
    dummy_t *t = arg;
    int rank = fsdp_ctx_rank(ctx), rc;
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_ddp_t *d = NULL;
    fsdp_tensor_t *x = NULL;
    fsdp_ddp_options_t o;
    float g[1024], rg[1024];
    size_t n = 0;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    fsdp_ddp_options_init(&o);
    o.dummy = true;
    CHECK(rc, out, tm_moe_create(ctx, true, &m));
    CHECK(rc, out, tm_moe_create(ctx, true, &ref));
    fsdp_pg_reset_counters(pg);
    CHECK(rc, out, fsdp_ddp_create(m, NULL, &o, &d));
    CHECK(rc, out, tm_moe_get_input(ctx, &x));
    CHECK(rc, out, ddp_step(d, x, NULL));
    CHECK(rc, out, ddp_step(d, x, NULL));
    t->r[rank].calls = coll_total(pg);
    CHECK(rc, out, plain_step(ref, x, NULL));
    CHECK(rc, out, plain_step(ref, x, NULL));
    CHECK(rc, out, grads_to_host(m, g, 1024, &n));
    CHECK(rc, out, grads_to_host(ref, rg, 1024, NULL));
    t->r[rank].bitwise = n > 0 && memcmp(g, rg, n * sizeof *g) == 0;
    fsdp_ddp_stats_t st;
    fsdp_ddp_get_stats(d, &st);
    t->r[rank].buckets = st.num_buckets;
out:
    fsdp_tensor_release(x);
    fsdp_ddp_destroy(d);
    fsdp_module_release(m);
    fsdp_module_release(ref);
    t->r[rank].rc = rc;
    return rc;
}

/* DYN-FK-03: a module without parameters. */
static int paramless_fn(fsdp_ctx_t *ctx, void *arg) {
    dummy_t *t = arg;
    int rank = fsdp_ctx_rank(ctx), rc;
    fsdp_module_t *m = NULL;
    fsdp_ddp_t *d = NULL;
    fsdp_tensor_t *x0 = NULL, *x = NULL;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    float v[32], gv[32];
    CHECK(rc, out, fsdp_relu_create(ctx, &m));
    CHECK(rc, out, fsdp_ddp_create(m, pg, NULL, &d));
    CHECK(rc, out, input_as_rank(ctx, rank, &x0));
    CHECK(rc, out, fsdp_add_scalar(x0, -0.5, &x));
    t->r[rank].bitwise = 0;
    fsdp_pg_reset_counters(pg);
    CHECK(rc, out, fsdp_tensor_set_requires_grad(x, true));
    CHECK(rc, out, ddp_step(d, x, NULL));
    t->r[rank].calls = coll_total(pg);
    CHECK(rc, out, fsdp_tensor_to_host(x, v, sizeof v));
    CHECK(rc, out, fsdp_tensor_to_host(fsdp_tensor_grad(x), gv, sizeof gv));
    int ok = 1;
    for (int i = 0; i < 32; i++)
        ok &= gv[i] == (v[i] > 0 ? 1.0f : 0.0f);
    t->r[rank].bitwise = ok;
    t->r[rank].buckets = fsdp_ddp_bucket_num_params(d, 0);
out:
    fsdp_tensor_release(x0);
    fsdp_tensor_release(x);
    fsdp_ddp_destroy(d);
    fsdp_module_release(m);
    t->r[rank].rc = rc;
    return rc;
}

/* "Mixed": lin = Linear(8, 4) (f32) and s (f64 [4]); y = lin(x) + s. */
static int mixed_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                         fsdp_tensor_t **out) {
    fsdp_tensor_t *y = NULL, *s = NULL;
    if (nin != 1 || nout != 1) return FSDP_EINVAL;
    int rc = fsdp_module_forward1(fsdp_module_child(m, "lin"), in[0], &y);
    if (rc == 0) rc = fsdp_to_dtype(fsdp_module_param(m, "s"), FSDP_DTYPE_F32, &s);
    if (rc == 0) rc = fsdp_add(y, s, &out[0]);
    fsdp_tensor_release(y);
    fsdp_tensor_release(s);
    return rc;
}

static const fsdp_module_ops_t mixed_ops = {"Mixed", mixed_forward, NULL};

typedef struct {
    struct {
        int rc;
        size_t buckets;
        int single_dtype;
        double s_grad[4];
        float lin_grad[36];
        int s_dtype;
    } r[MAXW];
} mixed_t;

static int mixed_fn(fsdp_ctx_t *ctx, void *arg) {
    mixed_t *t = arg;
    int rank = fsdp_ctx_rank(ctx), rc;
    fsdp_module_t *m = NULL, *l = NULL;
    fsdp_ddp_t *d = NULL;
    fsdp_tensor_t *x = NULL, *s = NULL;
    fsdp_ddp_options_t o;
    fsdp_ddp_options_init(&o);
    o.bucket_cap_bytes = 1 << 20;
    CHECK(rc, out, fsdp_module_create(ctx, &mixed_ops, NULL, &m));
    tm_manual_seed(ctx, 5);
    CHECK(rc, out, fsdp_linear_create(ctx, 8, 4, true, &l));
    CHECK(rc, out, fsdp_module_add_child(m, "lin", l));
    CHECK(rc, out,
          fsdp_tensor_full(ctx, FSDP_DTYPE_F64, 1, (int64_t[]){4}, 0.5, FSDP_MEM_PARAMS, &s));
    CHECK(rc, out, fsdp_module_add_param(m, "s", s));
    CHECK(rc, out, fsdp_ddp_create(m, fsdp_ctx_pg(ctx), &o, &d));
    CHECK(rc, out, tm_nested_wrapped_get_input(ctx, &x));
    CHECK(rc, out, ddp_step(d, x, NULL));
    fsdp_ddp_stats_t st;
    fsdp_ddp_get_stats(d, &st);
    t->r[rank].buckets = st.num_buckets;
    int single = 1;
    for (size_t b = 0; b < st.num_buckets; b++) {
        fsdp_dtype_t dt = fsdp_tensor_dtype(fsdp_ddp_bucket_param(d, b, 0, NULL));
        for (size_t i = 1; i < fsdp_ddp_bucket_num_params(d, b); i++)
            single &= fsdp_tensor_dtype(fsdp_ddp_bucket_param(d, b, i, NULL)) == dt;
    }
    /* s is the root's own parameter, first in pre-order, so last in reverse order: bucket 0
     * holds lin's f32 parameters and bucket 1 the f64 one, although they would fit in one. */
    single &= fsdp_tensor_dtype(fsdp_ddp_bucket_param(d, 0, 0, NULL)) == FSDP_DTYPE_F32 &&
              fsdp_ddp_bucket_param(d, 1, 0, NULL) == s;
    t->r[rank].single_dtype = single;
    fsdp_tensor_t *sg = fsdp_tensor_grad(s);
    t->r[rank].s_dtype = sg ? (int)fsdp_tensor_dtype(sg) : -1;
    if (sg) CHECK(rc, out, fsdp_tensor_to_host(sg, t->r[rank].s_grad, sizeof t->r[rank].s_grad));
    CHECK(rc, out, grads_to_host(l, t->r[rank].lin_grad, 36, NULL));
out:
    fsdp_tensor_release(x);
    fsdp_tensor_release(s);
    fsdp_ddp_destroy(d);
    fsdp_module_release(l);
    fsdp_module_release(m);
    t->r[rank].rc = rc;
    return rc;
}

static void test_dummy_and_small(void) {
    static dummy_t t, pl;
    int rc = run_sim(2, dummy_fn, &t, NULL, 0, NULL);
    tap_ok(rc == 0, "CORE-P07 reference: DummyDDP over MixtureOfExperts at W=2 (%s)",
           fsdp_strerror(rc));
    for (int r = 0; r < 2; r++) {
        tap_is_uint(t.r[r].calls, 0, "CORE-P07 reference: DummyDDP rank %d issues no collective",
                    r);
        tap_ok(t.r[r].bitwise,
               "CORE-P07 reference: DummyDDP rank %d gradients are the local ones, bitwise", r);
        tap_is_size(t.r[r].buckets, 0, "DummyDDP rank %d has no buckets", r);
    }

    /* DYN-FK: a world of one without any group is transparent. */
    fsdp_ctx_t *ctx = NULL;
    fsdp_ctx_options_t co;
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_ddp_t *d = NULL;
    fsdp_tensor_t *x = NULL;
    float g[NP], rg[NP];
    fsdp_ctx_options_init(&co);
    rc = fsdp_ctx_create(&co, &ctx);
    if (rc == 0) rc = tm_nested_wrapped_create(ctx, true, &m);
    if (rc == 0) rc = tm_nested_wrapped_create(ctx, true, &ref);
    if (rc == 0) rc = fsdp_ddp_create(m, NULL, NULL, &d);
    tap_ok(rc == 0 && fsdp_ddp_pg(d) == NULL, "DYN-FK: DDP on a context without a group (world of "
                                              "one)");
    if (rc == 0) rc = tm_nested_wrapped_get_input(ctx, &x);
    for (int k = 0; k < 2 && rc == 0; k++) {
        rc = ddp_step(d, x, NULL);
        if (rc == 0) rc = plain_step(ref, x, NULL);
    }
    if (rc == 0) rc = grads_to_host(m, g, NP, NULL);
    if (rc == 0) rc = grads_to_host(ref, rg, NP, NULL);
    tap_ok(rc == 0 && memcmp(g, rg, sizeof g) == 0,
           "DYN-FK: at world size 1 two synced backwards give bitwise the unwrapped gradients");
    fsdp_ddp_stats_t st = {0};
    fsdp_ddp_get_stats(d, &st);
    tap_ok(st.synced_backwards == 2 && st.last_allreduce_calls == 0 && st.num_buckets == 1,
           "DYN-FK: world of one: 2 synced backwards, no all-reduce, 1 bucket (%llu, %llu, %zu)",
           (unsigned long long)st.synced_backwards, (unsigned long long)st.last_allreduce_calls,
           st.num_buckets);
    fsdp_tensor_release(x);
    fsdp_ddp_destroy(d);
    fsdp_module_release(m);
    fsdp_module_release(ref);
    fsdp_ctx_destroy(ctx);

    rc = run_sim(2, paramless_fn, &pl, NULL, 0, NULL);
    tap_ok(rc == 0, "DYN-FK-03: DDP over a parameterless module (ReLU) at W=2 (%s)",
           fsdp_strerror(rc));
    for (int r = 0; r < 2; r++) {
        tap_ok(pl.r[r].bitwise && pl.r[r].buckets == 0,
               "DYN-FK-03 rank %d: the input gradient is right and there are no buckets", r);
        tap_is_uint(pl.r[r].calls, 0, "DYN-FK-03 rank %d: no collective", r);
    }

    static mixed_t mx;
    rc = run_sim(2, mixed_fn, &mx, NULL, 0, NULL);
    tap_ok(rc == 0, "mixed dtypes: an f64 parameter beside f32 ones at W=2 (%s)",
           fsdp_strerror(rc));
    for (int r = 0; r < 2; r++) {
        tap_ok(mx.r[r].buckets == 2 && mx.r[r].single_dtype,
               "mixed dtypes rank %d: 2 buckets, one dtype each, f64 last (%zu)", r,
               mx.r[r].buckets);
        tap_ok(mx.r[r].s_dtype == FSDP_DTYPE_F64 && mx.r[r].s_grad[0] == 4.0 &&
                   mx.r[r].s_grad[3] == 4.0,
               "mixed dtypes rank %d: the f64 gradient is averaged in f64 (%g)", r,
               mx.r[r].s_grad[0]);
    }
    tap_ok(memcmp(mx.r[0].lin_grad, mx.r[1].lin_grad, sizeof mx.r[0].lin_grad) == 0,
           "mixed dtypes: the f32 gradients are equal on both ranks");
}

/* ---- 8: errors ------------------------------------------------------------------------------- */

static void test_arg_errors(void) {
    fsdp_ctx_t *ctx = NULL;
    fsdp_ctx_options_t co;
    fsdp_module_t *m = NULL;
    fsdp_ddp_t *d = NULL, *d2 = (fsdp_ddp_t *)&co;
    fsdp_ddp_options_t o;
    fsdp_ctx_options_init(&co);
    fsdp_ctx_create(&co, &ctx);
    tm_nested_wrapped_create(ctx, true, &m);
    tap_is_int(fsdp_ddp_create(NULL, NULL, NULL, &d2), FSDP_EINVAL, "errors: a NULL module");
    tap_ok(d2 == NULL, "errors: *out is NULL after a failure");
    tap_is_int(fsdp_ddp_create(m, NULL, NULL, NULL), FSDP_EINVAL, "errors: a NULL out");
    tap_has_str(fsdp_ctx_last_error(ctx), "out is NULL", "errors: the message says out is NULL");
    fsdp_ddp_options_init(&o);
    o.bucket_cap_bytes = 0;
    tap_is_int(fsdp_ddp_create(m, NULL, &o, &d), FSDP_EINVAL, "errors: bucket_cap_bytes 0");
    tap_has_str(fsdp_ctx_last_error(ctx), "bucket_cap_bytes", "errors: the message names it");
    tap_is_int(fsdp_ddp_create(m, NULL, NULL, &d), 0, "errors: a first wrapper");
    tap_is_int(fsdp_ddp_create(m, NULL, NULL, &d2), FSDP_EINVAL,
               "errors: a second wrapper over the same parameters");
    tap_has_str(fsdp_ctx_last_error(ctx), "parameter 'module.0.weight' is already bucketed",
                "errors: the message names the parameter");
    fsdp_ddp_destroy(d);
    d = NULL;
    tap_is_int(fsdp_ddp_create(m, NULL, NULL, &d), 0,
               "errors: after destroy the module can be wrapped again (hooks removed)");
    fsdp_ddp_destroy(d);
    tap_is_int(fsdp_ddp_forward(NULL, 0, NULL, 0, NULL), FSDP_EINVAL, "errors: forward(NULL)");
    tap_is_int(fsdp_ddp_set_sync(NULL, false), FSDP_EINVAL, "errors: set_sync(NULL)");
    tap_is_int(fsdp_ddp_get_stats(NULL, NULL), FSDP_EINVAL, "errors: get_stats(NULL)");
    tap_ok(fsdp_ddp_module(NULL) == NULL && fsdp_ddp_bucket_param(NULL, 0, 0, NULL) == NULL &&
               fsdp_ddp_bucket_num_params(NULL, 0) == 0,
           "errors: queries accept NULL");
    fsdp_ddp_destroy(NULL);
    fsdp_module_release(m);
    fsdp_ctx_destroy(ctx);
}

typedef struct {
    int mode; /* 0: rank 1 has another shape, 1: rank 1 has an extra layer */
    struct {
        int rc;
        char msg[512];
    } r[MAXW];
} mismatch_t;

static int mismatch_fn(fsdp_ctx_t *ctx, void *arg) {
    mismatch_t *t = arg;
    int rank = fsdp_ctx_rank(ctx), rc;
    fsdp_module_t *m = NULL, *l = NULL;
    fsdp_ddp_t *d = NULL;
    CHECK(rc, out, fsdp_sequential_create(ctx, &m));
    CHECK(rc, out, fsdp_linear_create(ctx, 8, rank == 1 && t->mode == 0 ? 5 : 4, true, &l));
    CHECK(rc, out, fsdp_module_append(m, l));
    if (rank == 1 && t->mode == 1) {
        fsdp_module_release(l);
        l = NULL;
        CHECK(rc, out, fsdp_linear_create(ctx, 4, 4, true, &l));
        CHECK(rc, out, fsdp_module_append(m, l));
    }
    rc = fsdp_ddp_create(m, fsdp_ctx_pg(ctx), NULL, &d);
    snprintf(t->r[rank].msg, sizeof t->r[rank].msg, "%s", fsdp_ctx_last_error(ctx));
out:
    fsdp_ddp_destroy(d);
    fsdp_module_release(l);
    fsdp_module_release(m);
    t->r[rank].rc = rc;
    return 0;
}

/* A failing collective in backward. */
typedef struct {
    uint64_t seq_after_create;
    struct {
        int rc;
        char msg[512];
    } r[MAXW];
} fault_t;

static int fault_fn(fsdp_ctx_t *ctx, void *arg) {
    fault_t *t = arg;
    int rank = fsdp_ctx_rank(ctx), rc;
    fsdp_module_t *m = NULL;
    fsdp_ddp_t *d = NULL;
    fsdp_tensor_t *x = NULL;
    fsdp_ddp_options_t o;
    fsdp_ddp_options_init(&o);
    o.bucket_cap_bytes = 256;
    CHECK(rc, out, tm_nested_wrapped_create(ctx, true, &m));
    CHECK(rc, out, fsdp_ddp_create(m, fsdp_ctx_pg(ctx), &o, &d));
    if (rank == 0) t->seq_after_create = fsdp_pg_seq(fsdp_ctx_pg(ctx));
    CHECK(rc, out, tm_nested_wrapped_get_input(ctx, &x));
    rc = ddp_step(d, x, NULL);
    snprintf(t->r[rank].msg, sizeof t->r[rank].msg, "%s", fsdp_ctx_last_error(ctx));
out:
    fsdp_tensor_release(x);
    fsdp_ddp_destroy(d);
    fsdp_module_release(m);
    t->r[rank].rc = rc;
    return 0;
}

static void test_rank_errors(void) {
    static mismatch_t shape, count;
    shape.mode = 0;
    count.mode = 1;
    run_sim(2, mismatch_fn, &shape, NULL, 0, NULL);
    run_sim(2, mismatch_fn, &count, NULL, 0, NULL);
    for (int r = 0; r < 2; r++) {
        tap_is_int(shape.r[r].rc, FSDP_EINVAL,
                   "errors rank %d: a parameter shape differs on rank 1", r);
        tap_has_str(shape.r[r].msg, "parameter '0.weight' differs across ranks",
                    "errors rank %d: the message names the parameter", r);
        tap_has_str(shape.r[r].msg, "rank 0 has f32[4, 8] (requires_grad 1), rank 1 has f32[5, 8]",
                    "errors rank %d: and both ranks' shapes", r);
        tap_is_int(count.r[r].rc, FSDP_EINVAL, "errors rank %d: rank 1 has more parameters", r);
        tap_has_str(count.r[r].msg, "rank 1 has 4 parameters and 0 buffers, rank 0 has 2",
                    "errors rank %d: the message gives both counts", r);
    }
    /* Find the first collective after creation, then make rank 1 fail it. */
    static fault_t probe, bad;
    int rc = run_sim(2, fault_fn, &probe, NULL, 0, NULL);
    tap_ok(rc == 0 && probe.r[0].rc == 0 && probe.r[1].rc == 0 && probe.seq_after_create > 0,
           "errors: probe run (first backward collective is #%llu)",
           (unsigned long long)probe.seq_after_create);
    fsdp_sim_fault_t f = {.kind = FSDP_SIM_FAIL, .rank = 1, .call = probe.seq_after_create};
    run_sim(2, fault_fn, &bad, &f, 1, NULL);
    for (int r = 0; r < 2; r++) {
        tap_ok(bad.r[r].rc == (r == 1 ? FSDP_EBACKEND : FSDP_EREMOTE),
               "errors rank %d: a failing bucket all-reduce makes fsdp_backward fail (%s)", r,
               fsdp_err_name(bad.r[r].rc));
        tap_has_str(bad.r[r].msg, "all-reduce", "errors rank %d: the message says what failed", r);
        tap_has_str(bad.r[r].msg, "DDP (rank", "errors rank %d: and names the rank", r);
        tap_diag("rank %d: %s", r, bad.r[r].msg);
    }
}

int main(void) {
    tap_plan_lazy();
    test_parity();
    test_buckets();
    test_nosync();
    test_unused();
    test_states();
    test_dummy_and_small();
    test_arg_errors();
    test_rank_errors();
    return tap_done();
}
