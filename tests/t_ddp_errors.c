/* SPDX-License-Identifier: MIT */
/*
 * t_ddp_errors.c: the DDP wrapper (fsdp/ddp.h) beyond gradient parity: sync_module_states and
 * broadcast_buffers, DummyDDP and a world of one, a parameterless module, mixed dtypes, and the
 * error paths (arguments, models that differ across ranks, a failing collective).
 *
 * Multi-rank cases run over sim ranks (threads) that store what they saw in per-rank slots; the
 * main thread reports after fsdp_sim_run() returns. Parity, buckets, no_sync and unused
 * parameters are in t_ddp.c; the helpers both use are in ddp_util.c.
 */
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "ddp_util.h"
#include "models/models.h"
#include "tap.h"

/* ---- 5: sync_module_states and broadcast_buffers --------------------------------------------- */

/* "Buffered": lin = Linear(8, 4) drawn from a per-rank seed; buffers scale (f32 [4], persistent)
 * and count (i64 [2], not persistent); y = lin(x) + scale. */
static const fsdp_module_ops_t buffered_ops = {"Buffered", lin_plus_scale_forward, NULL};

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
    rank_release(x, d, m, NULL);
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
    rank_release(x, d, m, ref);
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
    rank_release(x, d, m, NULL);
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
    fsdp_tensor_release(s);
    rank_release(x, d, l, m);
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
    rank_release(NULL, d, l, m);
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
    rank_release(x, d, m, NULL);
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
    test_states();
    test_dummy_and_small();
    test_arg_errors();
    test_rank_errors();
    return tap_done();
}
