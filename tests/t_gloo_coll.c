/* SPDX-License-Identifier: MIT */
/*
 * t_gloo_coll.c: the Gloo process group over TCP loopback (seed behaviour F02, "Collectives
 * that FSDP and the references use", on the gloo backend).
 *
 * Ranks are threads of this process. Each creates its own context and its own Gloo world group
 * over a clone of one shared in-memory store, and FSDP_GLOO_SHM=0 keeps the groups off the
 * shared-memory transport, so every byte goes through Gloo's tcp transport.
 *
 * 1. The F02 matrix of coll_check.h at world sizes 2, 3 and 4: every collective x dtype x
 *    reduce op, in place and out of place, counts 0, 1, 1001 and a ~4 MiB message
 *    (FSDP_TEST_LARGE_MB, default 4; 1 under ThreadSanitizer), roots 0 and size-1, NULL for
 *    the buffers the contract does not use, the count-1 cases through works; barrier.
 * 2. Bitwise agreement with the sim backend on random (inexact) f32/bf16/f16 values:
 *    reduce_scatter and all_reduce at every world size (both reduce in rank order), reduce at
 *    world size 2 (Gloo's ring reduce combines in another order from 3 ranks on).
 *    Parts 1 and 2 are in gloo_coll_suite.c (the matrix itself in coll_matrix.c, which serves
 *    sim too), which t_gloo_coll_mp.c runs on rank processes.
 * 3. Asynchronous works on two groups: issue order is execution order across groups, a blocking
 *    call queues behind outstanding works, works complete and test as done.
 * 4. Sub-groups from split (reordered by key) and new_group, nested, running collectives.
 * 5. A rank that never joins: the others fail with FSDP_ETIMEDOUT after the group timeout, with
 *    a message naming the collective; the failure is sticky.
 * 6. A peer that destroys its group mid-run: FSDP_EREMOTE (or FSDP_ETIMEDOUT), well before the
 *    timeout, sticky too.
 * 7. FSDP_GLOO_CHECK=1: mismatched calls fail on every rank with FSDP_EMISMATCH listing every
 *    rank's call; the group stays usable.
 * 8. Creation: argument errors, a peer that never comes (FSDP_ETIMEDOUT), a one-rank world, the
 *    context's world group and store, worlds one after the other on one store, and
 *    FSDP_ENOTSUP in a build without Gloo.
 */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <fsdp.h>

#include "coll_check.h"
#include "coll_matrix.h"
#include "coll_prescale.h"
#include "gloo_coll_suite.h"
#include "gloo_world.h"
#include "tap.h"

#define ODD_COUNT CM_ODD_COUNT
#define MAX_WORLD GW_MAX_WORLD
#define KEEP_MSGS REC_KEEP

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

/* ---------------------------------------------------------------------------------------- */
/* 3. Asynchronous works and ordering across groups */

#define AS_COUNT 200000

static int async_rank(fsdp_ctx_t *ctx, fsdp_pg_t *world, void *arg) {
    rec_t *rc = arg;
    const int r = fsdp_pg_rank(world), n = fsdp_pg_size(world);
    (void)ctx;
    int all[MAX_WORLD];
    for (int i = 0; i < n; i++)
        all[i] = i;
    fsdp_pg_t *g2 = NULL;
    int s = fsdp_pg_new_group(world, all, n, &g2);
    rec_check(rc, s == FSDP_OK && g2, "rank %d: new_group over all ranks: %s: %s", r,
              fsdp_err_name(s), fsdp_pg_last_error(world));
    if (s != FSDP_OK) return s;
    float *x = malloc(AS_COUNT * sizeof *x), *y = malloc(AS_COUNT * sizeof *y);
    float *z = malloc(AS_COUNT * sizeof *z), *g = malloc((size_t)n * 4 * sizeof *g);
    float *bc = malloc(AS_COUNT * sizeof *bc);
    if (!x || !y || !z || !g || !bc) tap_bail("out of memory");
    for (size_t i = 0; i < AS_COUNT; i++) {
        x[i] = (float)(r + 1);
        y[i] = z[i] = bc[i] = -1.0f;
    }
    const float s1 = (float)(n * (n + 1) / 2); /* the sum of x over ranks */
    fsdp_work_t *w[5] = {NULL};
    /* y = sum x on the world; z = sum y on g2 (reads y: needs w0 done first); g gathers z's
     * first 4 elements on the world; bc gets root 0's z on g2. All issued without waiting. */
    int e = fsdp_pg_all_reduce(world, x, y, AS_COUNT, FSDP_DTYPE_F32, FSDP_REDOP_SUM, &w[0]);
    e |= fsdp_pg_all_reduce(g2, y, z, AS_COUNT, FSDP_DTYPE_F32, FSDP_REDOP_SUM, &w[1]);
    e |= fsdp_pg_all_gather(world, z, g, 4, FSDP_DTYPE_F32, &w[2]);
    e |= fsdp_pg_broadcast(g2, z, bc, AS_COUNT, FSDP_DTYPE_F32, 0, &w[3]);
    rec_check(rc, e == FSDP_OK, "rank %d: issuing four works failed", r);
    /* A blocking call queues behind them: when it returns they are done. */
    e = fsdp_pg_barrier(world, NULL);
    rec_check(rc, e == FSDP_OK, "rank %d: barrier after the works: %s", r, fsdp_err_name(e));
    for (int i = 0; i < 4; i++) {
        int done = 0;
        e = w[i] ? fsdp_work_test(w[i], &done) : FSDP_EINVAL;
        rec_check(rc, e == FSDP_OK && done,
                  "rank %d: work %d not done (%s) after a later blocking call returned", r, i,
                  fsdp_err_name(e));
    }
    /* Wait in reverse order, release. */
    for (int i = 3; i >= 0; i--) {
        e = fsdp_work_wait(w[i], 10000);
        rec_check(rc, e == FSDP_OK, "rank %d: work %d: %s: %s", r, i, fsdp_err_name(e),
                  fsdp_work_error(w[i]));
        fsdp_work_release(w[i]);
    }
    size_t bad = 0;
    for (size_t i = 0; i < AS_COUNT; i++)
        bad += y[i] != s1 || z[i] != s1 * (float)n || bc[i] != s1 * (float)n;
    for (int i = 0; i < n * 4; i++)
        bad += g[i] != s1 * (float)n;
    rec_check(rc, bad == 0,
              "rank %d: %zu wrong elements: y[0] %g (want %g), z[0] %g, bc[0] %g (want %g)", r, bad,
              (double)y[0], (double)s1, (double)z[0], (double)bc[0], (double)(s1 * n));
    /* Many small works back to back, alternating groups, then one wait on the last: every
     * earlier one has completed by then (issue order). */
    enum { NW = 24 };
    fsdp_work_t *many[NW];
    float v[NW];
    for (int i = 0; i < NW; i++) {
        v[i] = (float)(i + r);
        e = fsdp_pg_all_reduce(i % 2 ? g2 : world, &v[i], &v[i], 1, FSDP_DTYPE_F32, FSDP_REDOP_MAX,
                               &many[i]);
        if (e != FSDP_OK) many[i] = NULL;
    }
    e = many[NW - 1] ? fsdp_work_wait(many[NW - 1], 10000) : FSDP_EINVAL;
    int early = 0;
    for (int i = 0; i < NW; i++) {
        int done = 0;
        if (!many[i] || fsdp_work_test(many[i], &done) != FSDP_OK || !done)
            early++;
        else if (v[i] != (float)(i + n - 1))
            early++;
        fsdp_work_release(many[i]);
    }
    rec_check(rc, e == FSDP_OK && early == 0,
              "rank %d: %d of %d alternating works were not done or wrong after the last one "
              "completed (%s)",
              r, early, NW, fsdp_err_name(e));
    free(x), free(y), free(z), free(g), free(bc);
    fsdp_pg_destroy(g2);
    return FSDP_OK;
}

static void test_async(void) {
    rec_t rc;
    rec_init(&rc);
    int s = gw_run(3, async_rank, &rc, NULL);
    rec_report(&rc, s,
               "async: world 3, works on two groups run in issue order, a blocking call queues "
               "behind them, alternating works complete in order");
}

/* ---------------------------------------------------------------------------------------- */
/* 4. Sub-groups */

static void sub_colls(rec_t *rc, fsdp_pg_t *pg, const char *where) {
    int n = fsdp_pg_size(pg);
    rec_coll(rc, pg, where, FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_F32, FSDP_REDOP_SUM, ODD_COUNT, 0, 0);
    rec_coll(rc, pg, where, FSDP_COLL_REDUCE_SCATTER, FSDP_DTYPE_BF16, FSDP_REDOP_AVG, ODD_COUNT, 1,
             0);
    rec_coll(rc, pg, where, FSDP_COLL_ALL_GATHER, FSDP_DTYPE_I64, FSDP_REDOP_SUM, ODD_COUNT, 1, 0);
    rec_coll(rc, pg, where, FSDP_COLL_BROADCAST, FSDP_DTYPE_U8, FSDP_REDOP_SUM, ODD_COUNT, 0,
             n - 1);
    rec_coll(rc, pg, where, FSDP_COLL_REDUCE, FSDP_DTYPE_I32, FSDP_REDOP_PROD, ODD_COUNT, 0, n - 1);
    rec_coll(rc, pg, where, FSDP_COLL_ALL_TO_ALL, FSDP_DTYPE_F16, FSDP_REDOP_SUM, 77, 0, 0);
    rec_coll(rc, pg, where, FSDP_COLL_BARRIER, FSDP_DTYPE_U8, FSDP_REDOP_SUM, 0, 0, 0);
}

static int groups_rank(fsdp_ctx_t *ctx, fsdp_pg_t *world, void *arg) {
    rec_t *rc = arg;
    const int r = fsdp_pg_rank(world);
    (void)ctx;
    /* split: colors by parity, keys reversing the order. */
    fsdp_pg_t *half = NULL, *nested = NULL, *trio = NULL;
    int s = fsdp_pg_split(world, r % 2, -r, &half);
    rec_check(rc, s == FSDP_OK && half, "rank %d: split: %s: %s", r, fsdp_err_name(s),
              fsdp_pg_last_error(world));
    if (!half) return s;
    int want_rank = r >= 2 ? 0 : 1; /* {3, 1} and {2, 0} */
    rec_check(
        rc,
        fsdp_pg_size(half) == 2 && fsdp_pg_rank(half) == want_rank &&
            fsdp_pg_world_rank(half, 0) == 2 + r % 2 && strcmp(fsdp_pg_backend(half), "gloo") == 0,
        "rank %d: split gave rank %d of %d, world rank of 0 %d, backend %s", r, fsdp_pg_rank(half),
        fsdp_pg_size(half), fsdp_pg_world_rank(half, 0), fsdp_pg_backend(half));
    sub_colls(rc, half, "split");
    /* A world collective between sub-group collectives. */
    rec_coll(rc, world, "world between", FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_I32, FSDP_REDOP_SUM,
             ODD_COUNT, 1, 0);
    /* Nested: split the half again, everybody in one color. */
    s = fsdp_pg_split(half, 7, 0, &nested);
    rec_check(rc, s == FSDP_OK && nested && fsdp_pg_size(nested) == 2,
              "rank %d: nested split: %s: %s", r, fsdp_err_name(s), fsdp_pg_last_error(half));
    if (nested) {
        rec_coll(rc, nested, "nested", FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_F64, FSDP_REDOP_MAX,
                 ODD_COUNT, 0, 0);
        rec_coll(rc, nested, "nested", FSDP_COLL_REDUCE_SCATTER, FSDP_DTYPE_F32, FSDP_REDOP_SUM,
                 ODD_COUNT, 0, 0);
    }
    /* new_group over {3, 1, 0}: rank 2 is left out. */
    static const int list[3] = {3, 1, 0};
    s = fsdp_pg_new_group(world, list, 3, &trio);
    rec_check(rc, s == FSDP_OK && (r == 2 ? trio == NULL : trio != NULL),
              "rank %d: new_group {3, 1, 0}: %s (group %p): %s", r, fsdp_err_name(s), (void *)trio,
              fsdp_pg_last_error(world));
    if (trio) {
        int want = r == 3 ? 0 : r == 1 ? 1 : 2;
        rec_check(rc, fsdp_pg_rank(trio) == want && fsdp_pg_size(trio) == 3,
                  "rank %d: new_group rank %d of %d (want %d of 3)", r, fsdp_pg_rank(trio),
                  fsdp_pg_size(trio), want);
        sub_colls(rc, trio, "new_group");
    }
    rec_coll(rc, world, "world after", FSDP_COLL_ALL_GATHER, FSDP_DTYPE_F32, FSDP_REDOP_SUM,
             ODD_COUNT, 0, 0);
    fsdp_pg_destroy(trio);
    fsdp_pg_destroy(nested);
    fsdp_pg_destroy(half);
    return FSDP_OK;
}

static void test_groups(void) {
    rec_t rc;
    rec_init(&rc);
    int s = gw_run(4, groups_rank, &rc, NULL);
    rec_report(&rc, s,
               "sub-groups: world 4, split by parity (reversed by key), a nested split and "
               "new_group {3, 1, 0} run every collective, the world keeps working");
}

/* ---------------------------------------------------------------------------------------- */
/* 5. A rank that never joins; 6. a peer that destroys its group */

typedef struct fault {
    rec_t rec;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int failed; /* ranks whose collective has failed */
    int64_t timeout_ms;
} fault_t;

static void fault_init(fault_t *f, int64_t timeout_ms) {
    rec_init(&f->rec);
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    f->failed = 0;
    f->timeout_ms = timeout_ms;
}

static void fault_fini(fault_t *f) {
    pthread_mutex_destroy(&f->mu);
    pthread_cond_destroy(&f->cv);
}

static void fault_mark(fault_t *f) {
    pthread_mutex_lock(&f->mu);
    f->failed++;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

static void fault_wait(fault_t *f, int count) {
    pthread_mutex_lock(&f->mu);
    while (f->failed < count)
        pthread_cond_wait(&f->cv, &f->mu);
    pthread_mutex_unlock(&f->mu);
}

/* The stickiness check after a failure with status `want`. */
static void check_sticky(fault_t *f, fsdp_pg_t *pg, int want) {
    const int r = fsdp_pg_rank(pg);
    double t0 = gw_now_s();
    int e = fsdp_pg_barrier(pg, NULL);
    double dt = gw_now_s() - t0;
    rec_check(&f->rec, e == want && dt < 0.5 && strstr(fsdp_pg_last_error(pg), "failed earlier"),
              "rank %d: the next collective returned %s after %.3f s (want %s at once): %.300s", r,
              fsdp_err_name(e), dt, fsdp_err_name(want), fsdp_pg_last_error(pg));
    float x = 1.0f;
    fsdp_work_t *w = NULL;
    e = fsdp_pg_all_reduce(pg, &x, &x, 1, FSDP_DTYPE_F32, FSDP_REDOP_SUM, &w);
    if (e == FSDP_OK) e = fsdp_work_wait(w, 5000);
    fsdp_work_release(w);
    rec_check(&f->rec, e == want, "rank %d: an async collective after the failure returned %s", r,
              fsdp_err_name(e));
}

static int timeout_rank(fsdp_ctx_t *ctx, fsdp_pg_t *pg, void *arg) {
    fault_t *f = arg;
    const int r = fsdp_pg_rank(pg), n = fsdp_pg_size(pg);
    (void)ctx;
    float buf[1000];
    for (int i = 0; i < 1000; i++)
        buf[i] = (float)r;
    int e = fsdp_pg_barrier(pg, NULL);
    rec_check(&f->rec, e == FSDP_OK, "rank %d: warm-up barrier: %s", r, fsdp_err_name(e));
    fsdp_pg_set_timeout(pg, f->timeout_ms);
    if (r == n - 1) {
        /* Never joins the all_reduce: waits until the others have failed, then tries. */
        fault_wait(f, n - 1);
        e = fsdp_pg_all_reduce(pg, buf, buf, 1000, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
        rec_check(&f->rec, e < 0,
                  "rank %d (late): the all_reduce after the others failed "
                  "returned %s",
                  r, fsdp_err_name(e));
        return FSDP_OK;
    }
    double t0 = gw_now_s();
    if (r == 1) {
        fsdp_work_t *w = NULL;
        e = fsdp_pg_all_reduce(pg, buf, buf, 1000, FSDP_DTYPE_F32, FSDP_REDOP_SUM, &w);
        if (e == FSDP_OK) e = fsdp_work_wait(w, -1);
        fsdp_work_release(w);
    } else {
        e = fsdp_pg_all_reduce(pg, buf, buf, 1000, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    }
    double dt = gw_now_s() - t0;
    const char *err = fsdp_pg_last_error(pg);
    double lo = (double)f->timeout_ms * 0.7e-3, hi = (double)f->timeout_ms * 1e-3 + 3.0;
    rec_check(&f->rec,
              e == FSDP_ETIMEDOUT && dt >= lo && dt <= hi &&
                  strstr(err, "all_reduce(f32, count=1000, op=sum)") && strstr(err, "timed out") &&
                  strstr(err, "group 'world'"),
              "rank %d: %s after %.3f s (want FSDP_ETIMEDOUT in [%.2f, %.2f] s naming the "
              "collective): %.400s",
              r, fsdp_err_name(e), dt, lo, hi, err);
    if (r == 0) tap_diag("timeout message: %s", err);
    fault_mark(f);
    check_sticky(f, pg, FSDP_ETIMEDOUT);
    return FSDP_OK;
}

static int destroy_rank(fsdp_ctx_t *ctx, fsdp_pg_t *pg, void *arg) {
    fault_t *f = arg;
    const int r = fsdp_pg_rank(pg);
    (void)ctx;
    enum { C = 300000 };
    float *buf = malloc(C * sizeof *buf);
    if (!buf) tap_bail("out of memory");
    for (int i = 0; i < C; i++)
        buf[i] = 1.0f;
    fsdp_pg_set_timeout(pg, f->timeout_ms);
    int e = FSDP_OK;
    for (int it = 0; it < 3 && e == FSDP_OK; it++)
        e = fsdp_pg_all_reduce(pg, buf, buf, C, FSDP_DTYPE_F32, FSDP_REDOP_MAX, NULL);
    rec_check(&f->rec, e == FSDP_OK, "rank %d: all_reduce before the destroy: %s", r,
              fsdp_err_name(e));
    if (r == 1) {
        /* Lets the others block in the next collective, then leaves. */
        sleep_ms(150);
        fsdp_pg_destroy(pg);
        free(buf);
        return FSDP_OK;
    }
    double t0 = gw_now_s();
    e = fsdp_pg_all_reduce(pg, buf, buf, C, FSDP_DTYPE_F32, FSDP_REDOP_MAX, NULL);
    double dt = gw_now_s() - t0;
    rec_check(&f->rec, (e == FSDP_EREMOTE || e == FSDP_ETIMEDOUT) && dt < 3.0,
              "rank %d: %s after %.3f s (want FSDP_EREMOTE or FSDP_ETIMEDOUT, well before the "
              "%lld ms timeout): %.400s",
              r, fsdp_err_name(e), dt, (long long)f->timeout_ms, fsdp_pg_last_error(pg));
    if (r == 0) tap_diag("peer-destroyed message: %s", fsdp_pg_last_error(pg));
    if (e < 0) check_sticky(f, pg, e);
    free(buf);
    return FSDP_OK;
}

static void test_faults(void) {
    for (int n = 2; n <= 3; n++) {
        fault_t f;
        fault_init(&f, 500);
        double t0 = gw_now_s();
        int s = gw_run(n, timeout_rank, &f, NULL);
        rec_report(&f.rec, s,
                   "timeout: world %d, rank %d never joins an all_reduce: the others get "
                   "FSDP_ETIMEDOUT after the 500 ms group timeout naming the collective, then "
                   "every later call fails at once (sticky) (%.1f s)",
                   n, n - 1, gw_now_s() - t0);
        fault_fini(&f);
    }
    fault_t f;
    fault_init(&f, 20000);
    double t0 = gw_now_s();
    int s = gw_run(3, destroy_rank, &f, NULL);
    rec_report(&f.rec, s,
               "peer exit: world 3, rank 1 destroys its group while ranks 0 and 2 wait in an "
               "all_reduce: they fail with FSDP_EREMOTE or FSDP_ETIMEDOUT in under 3 s of a 20 s "
               "timeout, sticky (%.1f s)",
               gw_now_s() - t0);
    fault_fini(&f);
}

/* ---------------------------------------------------------------------------------------- */
/* 7. The mismatch check */

static int check_rank(fsdp_ctx_t *ctx, fsdp_pg_t *pg, void *arg) {
    rec_t *rc = arg;
    const int r = fsdp_pg_rank(pg);
    (void)ctx;
    fsdp_pg_set_timeout(pg, 20000);
    rec_coll(rc, pg, "checked", FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_F32, FSDP_REDOP_SUM, ODD_COUNT, 0,
             0);
    rec_coll(rc, pg, "checked", FSDP_COLL_BROADCAST, FSDP_DTYPE_I32, FSDP_REDOP_SUM, ODD_COUNT, 1,
             2);
    float a[16], b[16];
    for (int i = 0; i < 16; i++)
        a[i] = 1.0f, b[i] = 42.0f;
    int e;
    if (r == 0)
        e = fsdp_pg_all_reduce(pg, a, b, 8, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    else if (r == 1)
        e = fsdp_pg_all_reduce(pg, a, b, 9, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    else
        e = fsdp_pg_broadcast(pg, a, b, 8, FSDP_DTYPE_F32, 0, NULL);
    const char *err = fsdp_pg_last_error(pg);
    int untouched = 1;
    for (int i = 0; i < 16; i++)
        untouched &= b[i] == 42.0f;
    rec_check(rc,
              e == FSDP_EMISMATCH && untouched &&
                  strstr(err, "rank 0: all_reduce(f32, count=8, op=sum)") &&
                  strstr(err, "rank 1: all_reduce(f32, count=9, op=sum)") &&
                  strstr(err, "rank 2: broadcast(f32, count=8, root=0)"),
              "rank %d: %s (want FSDP_EMISMATCH listing every call, recv untouched %d): %.400s", r,
              fsdp_err_name(e), untouched, err);
    if (r == 0) tap_diag("mismatch message: %s", err);
    /* An empty call against non-empty ones is a mismatch too (checked before the shortcut). */
    e = fsdp_pg_all_reduce(pg, a, b, r == 0 ? 0 : 4, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    rec_check(rc, e == FSDP_EMISMATCH, "rank %d: count 0 against 4: %s", r, fsdp_err_name(e));
    /* The group stays usable. */
    rec_coll(rc, pg, "after a mismatch", FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_BF16, FSDP_REDOP_MAX,
             ODD_COUNT, 1, 0);
    rec_coll(rc, pg, "after a mismatch", FSDP_COLL_REDUCE_SCATTER, FSDP_DTYPE_F32, FSDP_REDOP_SUM,
             ODD_COUNT, 0, 0);
    /* Sub-groups inherit the check. */
    fsdp_pg_t *sub = NULL;
    e = fsdp_pg_split(pg, 0, 0, &sub);
    if (sub) {
        e = r == 0 ? fsdp_pg_barrier(sub, NULL)
                   : fsdp_pg_all_reduce(sub, a, b, 4, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
        rec_check(rc, e == FSDP_EMISMATCH, "rank %d: mismatch on a sub-group: %s: %s", r,
                  fsdp_err_name(e), fsdp_pg_last_error(sub));
        fsdp_pg_destroy(sub);
    } else {
        rec_check(rc, 0, "rank %d: split: %s", r, fsdp_err_name(e));
    }
    return FSDP_OK;
}

static void test_check(void) {
    /* Set before the ranks start: groups read it when they are created. */
    setenv("FSDP_GLOO_CHECK", "1", 1);
    rec_t rc;
    rec_init(&rc);
    int s = gw_run(3, check_rank, &rc, NULL);
    unsetenv("FSDP_GLOO_CHECK");
    rec_report(&rc, s,
               "FSDP_GLOO_CHECK=1: different calls at one sequence number fail with "
               "FSDP_EMISMATCH on every rank, listing every call, buffers untouched; the group "
               "stays usable; sub-groups inherit the check");
}

/* ---------------------------------------------------------------------------------------- */
/* 8. Creation */

static int one_rank(fsdp_ctx_t *ctx, fsdp_pg_t *pg, void *arg) {
    rec_t *rc = arg;
    rec_check(rc, fsdp_ctx_pg(ctx) == pg && fsdp_ctx_store(ctx) != NULL,
              "the group is not the context's world group (%p, %p)", (void *)fsdp_ctx_pg(ctx),
              (void *)pg);
    rec_check(rc,
              strcmp(fsdp_pg_backend(pg), "gloo") == 0 && strcmp(fsdp_pg_name(pg), "world") == 0,
              "backend '%s', name '%s'", fsdp_pg_backend(pg), fsdp_pg_name(pg));
    for (int k = 0; k < CM_NKINDS; k++)
        rec_coll(rc, pg, "world 1", cm_kinds[k], FSDP_DTYPE_BF16,
                 cm_kinds[k] == FSDP_COLL_ALL_TO_ALL ? FSDP_REDOP_SUM : FSDP_REDOP_AVG, ODD_COUNT,
                 cm_kinds[k] != FSDP_COLL_ALL_TO_ALL, 0);
    rec_coll(rc, pg, "world 1", FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_BOOL, FSDP_REDOP_MIN, ODD_COUNT, 0,
             0);
    return FSDP_OK;
}

static int reuse_rank(fsdp_ctx_t *ctx, fsdp_pg_t *pg, void *arg) {
    rec_t *rc = arg;
    (void)ctx;
    rec_coll(rc, pg, "a later world", FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_I64, FSDP_REDOP_SUM,
             ODD_COUNT, 0, 0);
    return FSDP_OK;
}

static void test_create(void) {
    fsdp_ctx_t *ctx = NULL;
    fsdp_store_t *store = NULL;
    fsdp_pg_t *pg = (fsdp_pg_t *)(void *)&ctx;
    if (fsdp_ctx_create(NULL, &ctx) != FSDP_OK || fsdp_store_create_memory(NULL, &store) != FSDP_OK)
        tap_bail("cannot create a context and a store");
    if (!fsdp_gloo_available()) {
        int e = fsdp_pg_create_gloo(ctx, store, NULL, &pg);
        tap_ok(e == FSDP_ENOTSUP && pg == NULL &&
                   strstr(fsdp_ctx_last_error(ctx), "without Gloo") != NULL,
               "a build without Gloo: fsdp_pg_create_gloo returns FSDP_ENOTSUP and says why");
        tap_diag("%s", fsdp_ctx_last_error(ctx));
        fsdp_store_destroy(store);
        fsdp_ctx_destroy(ctx);
        return;
    }
    tap_skip(1, "FSDP_ENOTSUP is checked in builds without Gloo");
    fsdp_gloo_options_t o;
    fsdp_gloo_options_init(&o);
    tap_is_int(fsdp_pg_create_gloo(ctx, NULL, &o, &pg), FSDP_EINVAL,
               "create: a NULL store is FSDP_EINVAL");
    tap_ok(pg == NULL, "create: *out is NULL after a failure");
    tap_is_int(fsdp_pg_create_gloo(NULL, store, &o, &pg), FSDP_EINVAL,
               "create: a NULL context is FSDP_EINVAL");
    o.timeout_ms = -1;
    int e = fsdp_pg_create_gloo(ctx, store, &o, &pg);
    tap_ok(e == FSDP_EINVAL && strstr(fsdp_ctx_last_error(ctx), "timeout_ms"),
           "create: a negative timeout is FSDP_EINVAL and named");
    /* Rank 0 of a world of 2 whose rank 1 never comes. */
    fsdp_ctx_t *lone = NULL;
    fsdp_ctx_options_t co;
    fsdp_ctx_options_init(&co);
    co.world_size = 2;
    if (fsdp_ctx_create(&co, &lone) != FSDP_OK) tap_bail("fsdp_ctx_create");
    o.timeout_ms = 300;
    double t0 = gw_now_s();
    e = fsdp_pg_create_gloo(lone, store, &o, &pg);
    double dt = gw_now_s() - t0;
    tap_ok(e == FSDP_ETIMEDOUT && pg == NULL && dt < 5.0 &&
               strstr(fsdp_ctx_last_error(lone), "rank 0 of 2"),
           "create: a peer that never comes gives FSDP_ETIMEDOUT after the 300 ms timeout "
           "(%.2f s)",
           dt);
    tap_diag("%s", fsdp_ctx_last_error(lone));
    fsdp_ctx_destroy(lone);
    fsdp_store_destroy(store);
    fsdp_ctx_destroy(ctx);

    rec_t rc;
    rec_init(&rc);
    int s = gw_run(1, one_rank, &rc, NULL);
    rec_report(&rc, s,
               "world 1: the group becomes the context's world group; every collective works "
               "alone");
    /* Two worlds, one after the other, on one store. */
    if (fsdp_store_create_memory(NULL, &store) != FSDP_OK) tap_bail("store");
    rec_init(&rc);
    s = gw_run_on(store, 3, reuse_rank, &rc, NULL);
    if (s == FSDP_OK) s = gw_run_on(store, 3, reuse_rank, &rc, NULL);
    if (s == FSDP_OK) s = gw_run_on(store, 2, reuse_rank, &rc, NULL);
    rec_report(&rc, s, "one store serves three Gloo worlds in turn (3, 3, then 2 ranks)");
    fsdp_store_destroy(store);
}

/* ---------------------------------------------------------------------------------------- */

int main(void) {
    /* TCP for every group: this program's ranks share a host, so they would otherwise take the
     * shared-memory transport, which t_gloo_coll_mp.c and t_gloo_shm.c cover. */
    setenv("FSDP_GLOO_SHM", "0", 1);
    tap_plan_lazy();
    double t0 = gw_now_s();
    test_create();
    if (!fsdp_gloo_available()) return tap_done();
    test_check();
    test_async();
    test_groups();
    test_faults();
    gcs_bitwise(gw_run, "F02 gloo");
    int combos = gcs_matrix(gw_run, "F02 gloo", gcs_large_bytes());
    static const int pworlds[] = {2, 3};
    cp_suite(gw_run, "F02 gloo tcp", pworlds, 2, cm_large_bytes(6, 0) / 4, 0);
    tap_diag("matrix: %d combinations per rank over worlds 2, 3, 4; large case %zu MiB; "
             "%.1f s in all",
             combos, gcs_large_bytes() >> 20, gw_now_s() - t0);
    return tap_done();
}
