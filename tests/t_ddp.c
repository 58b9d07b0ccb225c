/* SPDX-License-Identifier: MIT */
/*
 * t_ddp.c: the DDP wrapper (fsdp/ddp.h), the reference of the FSDP parity tests (spec F50):
 * parity, buckets, no_sync and unused parameters.
 *
 * Every multi-rank case runs over sim ranks (threads). Expected gradients are computed on each
 * rank independently of DDP: an undistributed copy of the model is run once per rank r with
 * the input rank r draws, and the W local gradients are averaged in double. Ranks store what
 * they saw in per-rank slots; the main thread reports after fsdp_sim_run() returns.
 *
 * Cases: gradient and SGD-momentum parity at W = 1..4; determinism; bucket counts and bitwise
 * independence of the bucket cap; no_sync; parameters unused on some or all ranks. The seed 004
 * behaviours (PyTorch's bucket arithmetic, parameters_to_ignore, the order of launches during
 * backward, static_graph, a world of one) are in t_ddp_dyn.c.
 * sync_module_states, broadcast_buffers, DummyDDP, small worlds and modules, mixed dtypes and the
 * error paths are in t_ddp_errors.c; the helpers both use are in ddp_util.c.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "ddp_util.h"
#include "models/models.h"
#include "tap.h"

#define STEPS 3
#define RTOL 1.3e-6
#define ATOL 1e-5

/* ---- helpers --------------------------------------------------------------------------------- */

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

static uint64_t coll_calls(fsdp_pg_t *pg, fsdp_coll_kind_t k) {
    fsdp_pg_counters_t c;
    fsdp_pg_get_counters(pg, &c);
    return c.calls[k];
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
    char bucket0[4][64]; /* names of bucket 0's first parameters */
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
    for (size_t i = 0; i < res->bucket0_n && i < 4; i++) {
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
    fsdp_optim_destroy(opt);
    fsdp_optim_destroy(ropt);
    rank_release(x, d, m, ref);
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
               "F50 DYN-MP-01 W=%d: parameters match the single-process reference after each step "
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
 * fsdp/ddp.h (PyTorch's reducer): reverse order, greedy, a bucket closes once it has reached
 * its limit, min(1 MiB, cap) for the first and cap for the others. */
static size_t expected_buckets(const int64_t *numel, size_t n, size_t cap) {
    size_t nb = 0, cur = 0, first = cap < ((size_t)1 << 20) ? cap : (size_t)1 << 20;
    bool open = false;
    for (size_t i = n; i-- > 0;) {
        if (!open) {
            nb++;
            cur = 0;
            open = true;
        }
        cur += (size_t)numel[i] * 4;
        if (cur >= (nb == 1 ? first : cap)) open = false;
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
    /* By hand, bytes in reverse order: [3.bias 32, 3.weight 128, 2.bias 16, 2.weight 256: 432]
     * [1.1.bias 64, 1.1.weight 1024] [1.0.bias 64, 1.0.weight 256] [0.bias 16, 0.weight 128]:
     * each bucket closes with the parameter that takes it to 256 B or more. */
    tap_is_size(want, 4, "F50 buckets: the reverse-order packing rule gives 4 buckets at 256 B");
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
    tap_ok(tr_small.r[0].bucket0_n == 4 && strcmp(tr_small.r[0].bucket0[0], "module.3.bias") == 0 &&
               strcmp(tr_small.r[0].bucket0[1], "module.3.weight") == 0 &&
               strcmp(tr_small.r[0].bucket0[2], "module.2.bias") == 0 &&
               strcmp(tr_small.r[0].bucket0[3], "module.2.weight") == 0,
           "F50 buckets: bucket 0 holds module.3.bias, module.3.weight, module.2.bias, "
           "module.2.weight (got %zu: %s %s %s %s)",
           tr_small.r[0].bucket0_n, tr_small.r[0].bucket0[0], tr_small.r[0].bucket0[1],
           tr_small.r[0].bucket0[2], tr_small.r[0].bucket0[3]);
    int same = 1;
    for (int r = 0; r < 2; r++) {
        same &= memcmp(tr_small.r[r].grad0, tr_big.r[r].grad0, sizeof tr_big.r[r].grad0) == 0;
        same &= memcmp(tr_small.r[r].loss, tr_big.r[r].loss, sizeof tr_big.r[r].loss) == 0;
        same &= memcmp(tr_small.r[r].params, tr_big.r[r].params, sizeof tr_big.r[r].params) == 0;
    }
    tap_ok(same, "F50 buckets: 4 small buckets give bitwise the gradients, losses and parameters "
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

/* Backwards k = k0 .. k1 - 1 of rank r's no_sync sequence, on the inputs seeded 100 + 10 k + r:
 * through d when it is not NULL, otherwise on the plain module m. */
static int seeded_steps(fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_ddp_t *d, int r, int k0, int k1) {
    fsdp_tensor_t *x = NULL;
    int rc = 0;
    for (int k = k0; k < k1 && rc == 0; k++) {
        rc = input_seeded(ctx, 100 + 10 * (uint64_t)k + (uint64_t)r, &x);
        if (rc == 0) rc = d ? ddp_step(d, x, NULL) : plain_step(m, x, NULL);
        fsdp_tensor_release(x);
        x = NULL;
    }
    return rc;
}

static int nosync_fn(fsdp_ctx_t *ctx, void *arg) {
    nosync_t *t = arg;
    int rank = fsdp_ctx_rank(ctx), world = fsdp_ctx_world_size(ctx), rc;
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_ddp_t *d = NULL;
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
    CHECK(rc, out, seeded_steps(ctx, NULL, d, rank, 0, 2));
    t->r[rank].nosync_calls = coll_total(pg);
    /* Under no_sync the gradients are this rank's own accumulation, bit for bit. */
    CHECK(rc, out, seeded_steps(ctx, ref, NULL, rank, 0, 2));
    CHECK(rc, out, grads_to_host(m, g, NP, NULL));
    CHECK(rc, out, grads_to_host(ref, rg, NP, NULL));
    t->r[rank].local_bitwise = memcmp(g, rg, sizeof g) == 0;
    CHECK(rc, out, fsdp_ddp_set_sync(d, true));
    fsdp_pg_reset_counters(pg);
    CHECK(rc, out, seeded_steps(ctx, NULL, d, rank, 2, 3));
    t->r[rank].sync_allreduce = coll_calls(pg, FSDP_COLL_ALL_REDUCE);
    /* Reference: three accumulated backwards per rank, averaged over the ranks. */
    memset(acc, 0, sizeof acc);
    for (int r = 0; r < world; r++) {
        CHECK(rc, out, fsdp_module_zero_grad(ref, true));
        CHECK(rc, out, seeded_steps(ctx, ref, NULL, r, 0, 3));
        CHECK(rc, out, grads_to_host(ref, rg, NP, NULL));
        for (int i = 0; i < NP; i++)
            acc[i] += rg[i];
    }
    for (int i = 0; i < NP; i++)
        rg[i] = (float)(acc[i] / world);
    CHECK(rc, out, grads_to_host(m, g, NP, NULL));
    t->r[rank].worst = worst(g, rg, NP);
out:
    rank_release(NULL, d, m, ref);
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
        tap_is_uint(t.r[r].sync_allreduce, 5,
                    "no_sync rank %d: the synced backward issues 4 buckets + used flags", r);
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
    fsdp_tensor_release(stale);
    fsdp_tensor_release(stale_b);
    rank_release(x, d, m, ref);
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

int main(void) {
    tap_plan_lazy();
    test_parity();
    test_buckets();
    test_nosync();
    test_unused();
    return tap_done();
}
