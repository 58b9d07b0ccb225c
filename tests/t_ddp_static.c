/* SPDX-License-Identifier: MIT */
/*
 * t_ddp_static.c: the DDP behaviours of seed 004 (test_dynamo_distributed.py), part two (part one,
 * the bucket arithmetic and parameters_to_ignore, is t_ddp_dyn.c): each bucket's all-reduce
 * issued while backward still runs (F50), static_graph (DYN-MP-03/05), a world of one
 * (DYN-SP-12, with DYN-SP-01/02/10) and the options' errors.
 *
 * The order of launches is observed from module backward hooks: a pre-hook runs before a
 * layer's backward, a post-hook after its parameters' gradients (and so the wrapper's grad
 * hooks); each records how many all-reduces the group had issued since the backward began.
 * Multi-rank cases run over sim ranks (threads) that store what they saw in per-rank slots; the
 * main thread reports.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "ddp_util.h"
#include "models/models.h"
#include "tap.h"

#define MIB ((size_t)1 << 20)

/* ---- the order of launches during backward, and static_graph --------------------------------- */

/* "Skip": children l0 = Linear(8, 16), l1 = Linear(16, 16), u = Linear(16, 16),
 * l2 = Linear(16, 4), registered in that order; y = l2(relu(u(relu(l1(relu(l0(x))))))) with u
 * left out when use_u is false. At a 256-byte cap each Linear is one bucket: b0 = l2, b1 = u,
 * b2 = l1, b3 = l0 (reverse order; each layer's bias + weight reaches 256 B). */
typedef struct {
    bool use_u;
} skip_t;

static int relu_of(fsdp_module_t *m, const char *child, fsdp_tensor_t *x, fsdp_tensor_t **y) {
    fsdp_tensor_t *h = NULL;
    int rc = fsdp_module_forward1(fsdp_module_child(m, child), x, &h);
    if (rc == 0) rc = fsdp_relu(h, y);
    fsdp_tensor_release(h);
    return rc;
}

static int skip_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                        fsdp_tensor_t **out) {
    skip_t *s = fsdp_module_impl(m);
    fsdp_tensor_t *a = NULL, *b = NULL;
    if (nin != 1 || nout != 1) return FSDP_EINVAL;
    int rc = relu_of(m, "l0", in[0], &a);
    if (rc == 0) rc = relu_of(m, "l1", a, &b);
    if (rc == 0 && s->use_u) {
        fsdp_tensor_release(a);
        a = b;
        b = NULL;
        rc = relu_of(m, "u", a, &b);
    }
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(m, "l2"), b, &out[0]);
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    return rc;
}
static const fsdp_module_ops_t skip_ops = {"Skip", skip_forward, free};

static const char *const skip_layers[4] = {"l0", "l1", "u", "l2"};

static int skip_create(fsdp_ctx_t *ctx, bool use_u, fsdp_module_t **out) {
    static const int64_t dims[4][2] = {{8, 16}, {16, 16}, {16, 16}, {16, 4}};
    skip_t *impl = malloc(sizeof *impl);
    int rc;
    *out = NULL;
    if (!impl) return FSDP_ENOMEM;
    impl->use_u = use_u;
    rc = fsdp_module_create(ctx, &skip_ops, impl, out);
    if (rc < 0) {
        free(impl);
        return rc;
    }
    tm_manual_seed(ctx, 9);
    for (int i = 0; i < 4 && rc == 0; i++) {
        fsdp_module_t *l = NULL;
        rc = fsdp_linear_create(ctx, dims[i][0], dims[i][1], true, &l);
        if (rc == 0) rc = fsdp_module_add_child(*out, skip_layers[i], l);
        fsdp_module_release(l);
    }
    if (rc < 0) {
        fsdp_module_release(*out);
        *out = NULL;
    }
    return rc;
}

static void skip_use_u(fsdp_module_t *m, bool use_u) {
    ((skip_t *)fsdp_module_impl(m))->use_u = use_u;
}

/* The trace: "l2<0 l2>1 ..." (layer, < before its backward or > after it, all-reduces issued
 * since the backward began), then "end=N" after it. */
typedef struct {
    fsdp_pg_t *pg;
    char buf[256];
    size_t n;
} trace_t;

typedef struct {
    trace_t *t;
    const char *name;
} trace_hook_t;

static uint64_t allreduces(fsdp_pg_t *pg) {
    fsdp_pg_counters_t c;
    fsdp_pg_get_counters(pg, &c);
    return c.calls[FSDP_COLL_ALL_REDUCE];
}

static void trace_add(trace_t *t, const char *name, char sep, uint64_t v) {
    if (t->n + 32 < sizeof t->buf)
        t->n += (size_t)snprintf(t->buf + t->n, sizeof t->buf - t->n, "%s%s%c%llu", t->n ? " " : "",
                                 name, sep, (unsigned long long)v);
}

static int trace_pre(fsdp_module_t *m, void *arg, bool has_grad) {
    trace_hook_t *h = arg;
    (void)m;
    (void)has_grad;
    trace_add(h->t, h->name, '<', allreduces(h->t->pg));
    return FSDP_OK;
}

static int trace_post(fsdp_module_t *m, void *arg, bool has_grad) {
    trace_hook_t *h = arg;
    (void)m;
    (void)has_grad;
    trace_add(h->t, h->name, '>', allreduces(h->t->pg));
    return FSDP_OK;
}

static int trace_hooks(fsdp_module_t *m, trace_hook_t *h, trace_t *t) {
    int rc = FSDP_OK, handle;
    for (int i = 0; i < 4 && rc == 0; i++) {
        h[i] = (trace_hook_t){t, skip_layers[i]};
        fsdp_module_t *l = fsdp_module_child(m, skip_layers[i]);
        rc = fsdp_module_add_backward_pre_hook(l, trace_pre, &h[i], &handle);
        if (rc == 0) rc = fsdp_module_add_backward_hook(l, trace_post, &h[i], &handle);
    }
    return rc;
}

/* One traced step through d on the input seeded `seed`; t->buf receives the trace. */
static int traced_step(fsdp_ctx_t *ctx, fsdp_ddp_t *d, trace_t *t, uint64_t seed) {
    fsdp_tensor_t *x = NULL, *y = NULL, *loss = NULL;
    int rc = input_seeded(ctx, seed, &x);
    if (rc == 0) rc = fsdp_ddp_forward1(d, x, &y);
    if (rc == 0) rc = tm_sum_loss(y, &loss);
    t->n = 0;
    t->buf[0] = 0;
    fsdp_pg_reset_counters(t->pg);
    if (rc == 0) rc = fsdp_backward(loss, NULL);
    trace_add(t, "end", '=', allreduces(t->pg));
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    fsdp_tensor_release(loss);
    return rc;
}

#define SKIP_NP (128 + 16 + 256 + 16 + 256 + 16 + 64 + 4)
#define STEPS 5

typedef struct {
    struct {
        int rc;
        char dense[256];       /* dynamic, u used */
        char dyn[STEPS][256];  /* dynamic, u unused */
        char stat[STEPS][256]; /* static_graph, u unused */
        uint64_t dyn_calls[STEPS], stat_calls[STEPS];
        int bitwise[STEPS]; /* static_graph's gradients are dynamic's, bit for bit */
        int u_none;         /* u (unused everywhere) keeps no gradient in both */
        uint64_t stat_early;
    } r[MAXW];
} order_t;

/* Step s's input on this rank; step 2 also runs a no_sync backward first. */
static int order_step(fsdp_ctx_t *ctx, fsdp_ddp_t *d, trace_t *t, int rank, int s) {
    uint64_t seed = 200 + 10 * (uint64_t)s + (uint64_t)rank;
    int rc = FSDP_OK;
    if (s == 2) {
        fsdp_tensor_t *x = NULL;
        rc = fsdp_ddp_set_sync(d, false);
        if (rc == 0) rc = input_seeded(ctx, seed + 5, &x);
        if (rc == 0) rc = ddp_step(d, x, NULL);
        if (rc == 0) rc = fsdp_ddp_set_sync(d, true);
        fsdp_tensor_release(x);
    }
    if (rc == 0) rc = traced_step(ctx, d, t, seed);
    return rc;
}

static int order_fn(fsdp_ctx_t *ctx, void *arg) {
    order_t *t = arg;
    int rank = fsdp_ctx_rank(ctx), rc;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    fsdp_module_t *md = NULL, *ms = NULL;
    fsdp_ddp_t *dd = NULL, *ds = NULL;
    fsdp_ddp_options_t o;
    trace_t tr = {.pg = pg};
    trace_hook_t hd[4], hs[4];
    float gd[SKIP_NP], gs[SKIP_NP];
    fsdp_ddp_stats_t st;
    fsdp_ddp_options_init(&o);
    o.bucket_cap_bytes = 256;
    o.first_bucket_bytes = 256;
    /* Every layer used: each bucket goes as soon as its layer's backward is done. */
    CHECK(rc, out, skip_create(ctx, true, &md));
    CHECK(rc, out, trace_hooks(md, hd, &tr));
    CHECK(rc, out, fsdp_ddp_create(md, pg, &o, &dd));
    CHECK(rc, out, traced_step(ctx, dd, &tr, 100 + (uint64_t)rank));
    snprintf(t->r[rank].dense, sizeof t->r[rank].dense, "%s", tr.buf);
    rank_release(NULL, dd, md, NULL);
    dd = NULL;
    md = NULL;
    /* u unused: dynamic and static_graph side by side on the same inputs. */
    CHECK(rc, out, skip_create(ctx, false, &md));
    CHECK(rc, out, skip_create(ctx, false, &ms));
    CHECK(rc, out, trace_hooks(md, hd, &tr));
    CHECK(rc, out, trace_hooks(ms, hs, &tr));
    CHECK(rc, out, fsdp_ddp_create(md, pg, &o, &dd));
    o.static_graph = true;
    CHECK(rc, out, fsdp_ddp_create(ms, pg, &o, &ds));
    for (int s = 0; s < STEPS; s++) {
        CHECK(rc, out, fsdp_module_zero_grad(md, true));
        CHECK(rc, out, fsdp_module_zero_grad(ms, true));
        CHECK(rc, out, order_step(ctx, dd, &tr, rank, s));
        snprintf(t->r[rank].dyn[s], sizeof t->r[rank].dyn[s], "%s", tr.buf);
        fsdp_ddp_get_stats(dd, &st);
        t->r[rank].dyn_calls[s] = st.last_allreduce_calls;
        CHECK(rc, out, order_step(ctx, ds, &tr, rank, s));
        snprintf(t->r[rank].stat[s], sizeof t->r[rank].stat[s], "%s", tr.buf);
        fsdp_ddp_get_stats(ds, &st);
        t->r[rank].stat_calls[s] = st.last_allreduce_calls;
        t->r[rank].stat_early = st.last_early_launches;
        CHECK(rc, out, grads_to_host(md, gd, SKIP_NP, NULL));
        CHECK(rc, out, grads_to_host(ms, gs, SKIP_NP, NULL));
        t->r[rank].bitwise[s] = memcmp(gd, gs, sizeof gd) == 0;
    }
    t->r[rank].u_none = !fsdp_tensor_grad(fsdp_module_param(md, "u.weight")) &&
                        !fsdp_tensor_grad(fsdp_module_param(ms, "u.weight"));
out:
    rank_release(NULL, dd, md, NULL);
    rank_release(NULL, ds, ms, NULL);
    t->r[rank].rc = rc;
    return rc;
}

static void test_order_static(void) {
    static order_t t;
    int rc = run_sim(2, order_fn, &t, NULL, 0, NULL);
    tap_ok(rc == 0 && t.r[0].rc == 0 && t.r[1].rc == 0,
           "F50 overlap: W=2, four one-layer buckets, traced backwards (%s)", fsdp_strerror(rc));
    for (int r = 0; r < 2; r++) {
        tap_is_str(t.r[r].dense, "l2<0 l2>1 u<1 u>2 l1<2 l1>3 l0<3 l0>4 end=5",
                   "F50 overlap rank %d: bucket k's all-reduce is issued when its layer's "
                   "backward ends, before the next layer's begins (layer<all-reduces before, "
                   ">after)",
                   r);
        tap_is_str(t.r[r].dyn[0], "l2<0 l2>1 l1<1 l1>1 l0<1 l0>1 end=5",
                   "F50 overlap rank %d: u unused: bucket 1 never completes, so buckets 1-3 and "
                   "the used flags wait for the final callback (launches stay in bucket order)",
                   r);
        tap_is_str(t.r[r].stat[0], "l2<0 l2>0 l1<0 l1>0 l0<0 l0>0 end=5",
                   "DYN-MP-03/05 rank %d: static_graph's first backward launches everything at "
                   "the end (PyTorch's delay_all_reduce), used flags included",
                   r);
        int later = 1, dyn_same = 1, calls = 1, bits = 1;
        for (int s = 1; s < STEPS; s++) {
            later &= strcmp(t.r[r].stat[s], "l2<0 l2>2 l1<2 l1>3 l0<3 l0>4 end=4") == 0;
            dyn_same &= strcmp(t.r[r].dyn[s], t.r[r].dyn[0]) == 0;
            calls &= t.r[r].stat_calls[s] == 4 && t.r[r].dyn_calls[s] == 5;
        }
        for (int s = 0; s < STEPS; s++)
            bits &= t.r[r].bitwise[s];
        tap_ok_why(later, t.r[r].stat[1],
                   "DYN-MP-03/05 rank %d: static_graph later backwards: u (no gradient in the "
                   "first) is ready from the start, so bucket 1 goes with bucket 0 and every "
                   "bucket leaves during backward; no used-flag all-reduce: "
                   "\"l2<0 l2>2 l1<2 l1>3 l0<3 l0>4 end=4\"",
                   r);
        tap_ok(dyn_same, "F50 rank %d: the dynamic traces repeat every step", r);
        tap_ok(calls && t.r[r].stat_calls[0] == 5 && t.r[r].dyn_calls[0] == 5,
               "DYN-MP-03/05 rank %d: all-reduces per synced backward: dynamic 5 every step, "
               "static_graph 5 then 4 (stats)",
               r);
        tap_is_uint(t.r[r].stat_early, 4,
                    "DYN-MP-03/05 rank %d: static_graph launches all 4 buckets from grad hooks", r);
        tap_ok(bits,
               "DYN-MP-03/05 rank %d: %d steps (one with a no_sync backward first): static_graph "
               "gives bitwise the gradients of the dynamic mode",
               r, STEPS);
        tap_ok(t.r[r].u_none,
               "DYN-MP-03/05 rank %d: u, unused everywhere, keeps no gradient in "
               "both modes",
               r);
    }
}

/* ---- static_graph: a graph that changes -------------------------------------------------------
 */

typedef struct {
    struct {
        int rc;
        int rc_more, rc_after, rc_less;
        char msg_more[512], msg_less[512];
    } r[MAXW];
} change_t;

/* Rank 1 changes its graph in step 1 (u used when it was not, then the other way round); the
 * step after must work again. */
static int change_fn(fsdp_ctx_t *ctx, void *arg) {
    change_t *t = arg;
    int rank = fsdp_ctx_rank(ctx), rc;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    fsdp_module_t *m = NULL;
    fsdp_ddp_t *d = NULL;
    fsdp_ddp_options_t o;
    trace_t tr = {.pg = pg};
    fsdp_ddp_options_init(&o);
    o.bucket_cap_bytes = o.first_bucket_bytes = 256;
    o.static_graph = true;
    for (int k = 0; k < 2; k++) {
        bool first_u = k == 1;
        CHECK(rc, out, skip_create(ctx, first_u, &m));
        CHECK(rc, out, fsdp_ddp_create(m, pg, &o, &d));
        CHECK(rc, out, traced_step(ctx, d, &tr, 1));
        skip_use_u(m, rank == 1 ? !first_u : first_u);
        int r1 = traced_step(ctx, d, &tr, 2);
        snprintf(k ? t->r[rank].msg_less : t->r[rank].msg_more, sizeof t->r[rank].msg_more, "%s",
                 r1 < 0 ? fsdp_ctx_last_error(ctx) : "");
        *(k ? &t->r[rank].rc_less : &t->r[rank].rc_more) = r1;
        skip_use_u(m, first_u);
        if (k == 0) t->r[rank].rc_after = traced_step(ctx, d, &tr, 3);
        rank_release(NULL, d, m, NULL);
        d = NULL;
        m = NULL;
    }
out:
    rank_release(NULL, d, m, NULL);
    t->r[rank].rc = rc;
    return rc;
}

static void test_static_change(void) {
    static change_t t;
    int rc = run_sim(2, change_fn, &t, NULL, 0, NULL);
    tap_ok(rc == 0 && t.r[0].rc == 0 && t.r[1].rc == 0,
           "DYN-MP-03/05: W=2, rank 1's graph changes under static_graph; no rank hangs (%s)",
           fsdp_strerror(rc));
    tap_is_int(t.r[0].rc_more, 0, "DYN-MP-03/05: rank 0, unchanged, completes the backward");
    tap_is_int(t.r[1].rc_more, FSDP_EINVAL,
               "DYN-MP-03/05: rank 1 using u, which had no gradient in the first backward, gets "
               "FSDP_EINVAL after joining every collective");
    tap_has_str(t.r[1].msg_more, "static_graph: parameter 'u.",
                "DYN-MP-03/05: the message names static_graph and the parameter");
    tap_has_str(t.r[1].msg_more, "more often than in the first synced backward (1 hook(s) now, 0",
                "DYN-MP-03/05: and the counts");
    tap_diag("%s", t.r[1].msg_more);
    tap_ok(t.r[0].rc_after == 0 && t.r[1].rc_after == 0,
           "DYN-MP-03/05: back on the first graph, the next backward works on both ranks");
    tap_is_int(t.r[0].rc_less, 0, "DYN-MP-03/05: rank 0 again completes");
    tap_is_int(t.r[1].rc_less, FSDP_EINVAL,
               "DYN-MP-03/05: rank 1 leaving out u, used in the first backward, gets FSDP_EINVAL");
    tap_has_str(t.r[1].msg_less, "less often than in the first synced backward (0 hook(s) now, 1",
                "DYN-MP-03/05: naming the counts");
}

/* ---- DYN-SP-12: a world of one -----------------------------------------------------------------
 */

typedef struct {
    int rc, size;
    uint64_t calls;
    int bitwise[2];
    fsdp_ddp_stats_t st[2];
} one_t;

static int one_fn(fsdp_ctx_t *ctx, void *arg) {
    one_t *t = arg;
    int rc;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    fsdp_module_t *m[2] = {NULL, NULL}, *ref = NULL;
    fsdp_ddp_t *d[2] = {NULL, NULL};
    fsdp_tensor_t *x = NULL;
    fsdp_ddp_options_t o;
    static const char *const ign[1] = {"l1.bias"};
    float g[SKIP_NP], rg[SKIP_NP];
    t->size = fsdp_pg_size(pg);
    fsdp_pg_reset_counters(pg);
    fsdp_ddp_options_init(&o);
    o.bucket_cap_bytes = o.first_bucket_bytes = 256;
    CHECK(rc, out, skip_create(ctx, true, &ref));
    for (int k = 0; k < 2; k++) {
        CHECK(rc, out, skip_create(ctx, true, &m[k]));
        if (k == 1) {
            o.static_graph = true;
            o.parameters_to_ignore = ign;
            o.num_parameters_to_ignore = 1;
        }
        CHECK(rc, out, fsdp_ddp_create(m[k], pg, &o, &d[k]));
    }
    for (int s = 0; s < 3; s++) {
        CHECK(rc, out, input_seeded(ctx, 300 + (uint64_t)s, &x));
        for (int k = 0; k < 2; k++)
            CHECK(rc, out, ddp_step(d[k], x, NULL));
        CHECK(rc, out, plain_step(ref, x, NULL));
        fsdp_tensor_release(x);
        x = NULL;
    }
    t->calls = coll_total(pg);
    CHECK(rc, out, grads_to_host(ref, rg, SKIP_NP, NULL));
    for (int k = 0; k < 2; k++) {
        CHECK(rc, out, grads_to_host(m[k], g, SKIP_NP, NULL));
        t->bitwise[k] = memcmp(g, rg, sizeof g) == 0;
        fsdp_ddp_get_stats(d[k], &t->st[k]);
    }
out:
    for (int k = 0; k < 2; k++)
        rank_release(NULL, d[k], m[k], NULL);
    rank_release(x, NULL, ref, NULL);
    t->rc = rc;
    return rc;
}

static void test_world_one(void) {
    static one_t t;
    int rc = run_sim(1, one_fn, &t, NULL, 0, NULL);
    tap_ok(rc == 0 && t.rc == 0, "DYN-SP-12: DDP over a one-rank sim group (%s)",
           fsdp_strerror(rc));
    tap_is_int(t.size, 1, "DYN-SP-12: the group's size is 1");
    tap_is_uint(t.calls, 0,
                "DYN-SP-12: two wrappers, created and run 3 steps, issue no collective at all");
    tap_ok(t.bitwise[0] && t.bitwise[1],
           "DYN-SP-12 DYN-SP-01 DYN-SP-02 DYN-SP-10: 3 accumulated backwards through 4 buckets "
           "give bitwise the plain module's gradients, without and with parameters_to_ignore + "
           "static_graph");
    for (int k = 0; k < 2; k++)
        tap_ok(t.st[k].synced_backwards == 3 && t.st[k].last_allreduce_calls == 0 &&
                   t.st[k].last_allreduce_bytes == 0 && t.st[k].num_buckets == 4 &&
                   t.st[k].num_ignored_params == (size_t)k && t.st[k].num_params == 8 - (size_t)k,
               "DYN-SP-12 %s: stats: 3 synced backwards, 0 all-reduces, 4 buckets, %d ignored",
               k ? "ignore + static_graph" : "plain", k);
}

/* ---- errors ------------------------------------------------------------------------------------
 */

static void test_errors(void) {
    fsdp_ctx_t *ctx = NULL;
    fsdp_ctx_options_t co;
    fsdp_module_t *m = NULL;
    fsdp_ddp_t *d = (fsdp_ddp_t *)&co;
    fsdp_ddp_options_t o;
    fsdp_mem_stats_t before, after;
    static const char *const bad[2] = {"l1.weight", "l9.weight"};
    static const char *const holes[2] = {"l1.weight", NULL};
    fsdp_ctx_options_init(&co);
    fsdp_ctx_create(&co, &ctx);
    skip_create(ctx, true, &m);
    fsdp_mem_get_stats(ctx, &before);
    fsdp_ddp_options_init(&o);
    tap_ok(o.first_bucket_bytes == MIB && !o.static_graph && o.num_parameters_to_ignore == 0 &&
               o.parameters_to_ignore == NULL,
           "options: first_bucket_bytes 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES), static_graph "
           "off, nothing ignored by default");
    o.parameters_to_ignore = bad;
    o.num_parameters_to_ignore = 2;
    tap_is_int(fsdp_ddp_create(m, NULL, &o, &d), FSDP_EINVAL,
               "errors: parameters_to_ignore naming no parameter or buffer");
    tap_ok(d == NULL, "errors: *out is NULL after it");
    tap_has_str(fsdp_ctx_last_error(ctx),
                "parameters_to_ignore[1] 'l9.weight' is neither a parameter nor a buffer",
                "errors: the message names the entry");
    o.parameters_to_ignore = holes;
    tap_is_int(fsdp_ddp_create(m, NULL, &o, &d), FSDP_EINVAL, "errors: a NULL entry");
    tap_has_str(fsdp_ctx_last_error(ctx), "parameters_to_ignore[1] is NULL",
                "errors: the message gives its index");
    o.parameters_to_ignore = NULL;
    tap_is_int(fsdp_ddp_create(m, NULL, &o, &d), FSDP_EINVAL,
               "errors: num_parameters_to_ignore without a list");
    tap_has_str(fsdp_ctx_last_error(ctx), "parameters_to_ignore is NULL",
                "errors: the message says so");
    fsdp_ddp_options_init(&o);
    o.first_bucket_bytes = 0;
    tap_is_int(fsdp_ddp_create(m, NULL, &o, &d), FSDP_EINVAL, "errors: first_bucket_bytes 0");
    tap_has_str(fsdp_ctx_last_error(ctx), "first_bucket_bytes", "errors: the message names it");
    fsdp_mem_get_stats(ctx, &after);
    tap_is_size(after.total_current, before.total_current,
                "errors: the failed creations hold no tensor memory");
    /* The names were copied: the caller's array may go once fsdp_ddp_create returned. */
    char name[16];
    const char *one[1] = {name};
    snprintf(name, sizeof name, "%s", "u.bias");
    fsdp_ddp_options_init(&o);
    o.parameters_to_ignore = one;
    o.num_parameters_to_ignore = 1;
    tap_is_int(fsdp_ddp_create(m, NULL, &o, &d), 0,
               "errors: after the failures the module can be wrapped (no hook left behind)");
    memset(name, 'x', sizeof name - 1);
    fsdp_ddp_stats_t st = {0};
    fsdp_ddp_get_stats(d, &st);
    tap_ok(st.num_ignored_params == 1 && st.num_params == 7,
           "options: parameters_to_ignore is copied at creation (%zu ignored)",
           st.num_ignored_params);
    tap_is_size(fsdp_ddp_bucket_bytes(d, 99), 0, "errors: bucket_bytes of a bad bucket is 0");
    fsdp_ddp_destroy(d);
    fsdp_module_release(m);
    fsdp_ctx_destroy(ctx);
}

int main(void) {
    tap_plan_lazy();
    test_order_static();
    test_static_change();
    test_world_one();
    test_errors();
    return tap_done();
}
