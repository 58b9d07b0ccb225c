/* SPDX-License-Identifier: MIT */
/*
 * t_gloo_iface.c: how a Gloo rank chooses the address it listens on (fsdp_gloo_options_t):
 *   - iface "lo" (the option, and $FSDP_GLOO_IFNAME) connects two ranks, which then all-reduce;
 *   - hostname 127.0.0.1 (the option, and $FSDP_GLOO_HOST) likewise; an interface wins over a
 *     hostname when both are given;
 *   - an interface that does not exist, and an address no interface of this host has, fail on
 *     every rank with FSDP_EBACKEND, a message naming the interface or address, and well
 *     within the timeout; nothing leaks (ASan checks it) and the context stays usable.
 *   - a rendezvous that times out because a rank never called fsdp_pg_create_gloo fails on the
 *     ranks that came with FSDP_ETIMEDOUT and a message naming the absent rank.
 * Ranks are threads, each with its own context and a clone of one in-memory store.
 */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <fsdp.h>

#include "tap.h"

#define WORLD 2
#define MAXW 3
#define TIMEOUT_MS 5000

typedef struct rank_arg {
    int rank, world;
    int absent; /* does not create the group */
    fsdp_store_t *store;
    fsdp_gloo_options_t opt;
    int create_rc;
    int reduce_ok;
    double seconds;
    char err[2048];
} rank_arg_t;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *rank_main(void *p) {
    rank_arg_t *a = p;
    fsdp_ctx_t *ctx = NULL;
    fsdp_pg_t *pg = NULL;
    fsdp_ctx_options_t co;
    fsdp_ctx_options_init(&co);
    co.rank = a->rank;
    co.world_size = a->world;
    a->create_rc = fsdp_ctx_create(&co, &ctx);
    if (a->create_rc < 0) {
        snprintf(a->err, sizeof a->err, "fsdp_ctx_create failed");
        return NULL;
    }
    if (a->absent) {
        fsdp_ctx_destroy(ctx);
        return NULL;
    }
    double t0 = now_s();
    a->create_rc = fsdp_pg_create_gloo(ctx, a->store, &a->opt, &pg);
    a->seconds = now_s() - t0;
    if (a->create_rc < 0) {
        snprintf(a->err, sizeof a->err, "%s", fsdp_ctx_last_error(ctx));
    } else {
        float x[3] = {1.0f + (float)a->rank, 2.0f, 3.0f}, y[3] = {0};
        int rc = fsdp_pg_all_reduce(pg, x, y, 3, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
        a->reduce_ok = rc == 0 && y[0] == 3.0f && y[1] == 4.0f && y[2] == 6.0f;
        fsdp_pg_destroy(pg);
    }
    /* The context is still usable after a failed creation: a log call and destroy. */
    fsdp_ctx_destroy(ctx);
    return NULL;
}

/* Runs n ranks with options o, rank `absent` (-1: none) never creating its group; fills a[]. */
static void run_n(int n, int absent, const fsdp_gloo_options_t *o, rank_arg_t *a) {
    fsdp_store_t *store = NULL;
    if (fsdp_store_create_memory(NULL, &store) != FSDP_OK) tap_bail("fsdp_store_create_memory");
    pthread_t t[MAXW];
    for (int r = 0; r < n; r++) {
        memset(&a[r], 0, sizeof a[r]);
        a[r].rank = r;
        a[r].world = n;
        a[r].absent = r == absent;
        a[r].opt = *o;
        if (fsdp_store_clone(store, NULL, &a[r].store) != FSDP_OK) tap_bail("fsdp_store_clone");
    }
    for (int r = 0; r < n; r++)
        if (pthread_create(&t[r], NULL, rank_main, &a[r]) != 0) tap_bail("pthread_create");
    for (int r = 0; r < n; r++) {
        pthread_join(t[r], NULL);
        fsdp_store_destroy(a[r].store);
    }
    fsdp_store_destroy(store);
}

static void run(const fsdp_gloo_options_t *o, rank_arg_t a[WORLD]) { run_n(WORLD, -1, o, a); }

static void expect_ok(const fsdp_gloo_options_t *o, const char *what) {
    rank_arg_t a[WORLD];
    run(o, a);
    int ok = 1;
    for (int r = 0; r < WORLD; r++) {
        if (a[r].create_rc != 0 || !a[r].reduce_ok) {
            tap_diag("rank %d: create %s (%s), all_reduce %s", r, fsdp_strerror(a[r].create_rc),
                     a[r].err, a[r].reduce_ok ? "right" : "wrong");
            ok = 0;
        }
    }
    tap_ok(ok, "%s: both ranks connect and all-reduce", what);
}

static void expect_fail(const fsdp_gloo_options_t *o, const char *what, const char *named) {
    rank_arg_t a[WORLD];
    run(o, a);
    int ok = 1;
    for (int r = 0; r < WORLD; r++) {
        if (a[r].create_rc != FSDP_EBACKEND || !strstr(a[r].err, named) ||
            a[r].seconds > TIMEOUT_MS / 1000.0 + 2.0) {
            tap_diag("rank %d: %s after %.1f s: %s", r, fsdp_strerror(a[r].create_rc),
                     a[r].seconds, a[r].err);
            ok = 0;
        }
    }
    tap_ok(ok, "%s: every rank fails with FSDP_EBACKEND naming '%s' within the timeout", what,
           named);
}

int main(void) {
    tap_plan_lazy();
    if (!fsdp_gloo_available()) return tap_skip_all("libfsdp was built without Gloo");
    fsdp_gloo_options_t o;

    fsdp_gloo_options_init(&o);
    o.timeout_ms = TIMEOUT_MS;
    o.iface = "lo";
    expect_ok(&o, "iface lo");

    fsdp_gloo_options_init(&o);
    o.timeout_ms = TIMEOUT_MS;
    o.hostname = "127.0.0.1";
    expect_ok(&o, "hostname 127.0.0.1");

    fsdp_gloo_options_init(&o);
    o.timeout_ms = TIMEOUT_MS;
    o.hostname = "192.0.2.1"; /* TEST-NET-1: no interface of this host has it */
    o.iface = "lo";
    expect_ok(&o, "iface lo wins over an unusable hostname");

    fsdp_gloo_options_init(&o);
    o.timeout_ms = TIMEOUT_MS;
    o.iface = "nosuchif0";
    expect_fail(&o, "iface nosuchif0", "nosuchif0");

    fsdp_gloo_options_init(&o);
    o.timeout_ms = TIMEOUT_MS;
    o.hostname = "192.0.2.1";
    expect_fail(&o, "hostname 192.0.2.1 (not an address of this host)", "192.0.2.1");

    /* The environment, read when the options leave the field NULL. */
    fsdp_gloo_options_init(&o);
    o.timeout_ms = TIMEOUT_MS;
    setenv("FSDP_GLOO_IFNAME", "lo", 1);
    expect_ok(&o, "FSDP_GLOO_IFNAME=lo");
    setenv("FSDP_GLOO_IFNAME", "nosuchif1", 1);
    expect_fail(&o, "FSDP_GLOO_IFNAME=nosuchif1", "nosuchif1");
    unsetenv("FSDP_GLOO_IFNAME");
    setenv("FSDP_GLOO_HOST", "127.0.0.1", 1);
    expect_ok(&o, "FSDP_GLOO_HOST=127.0.0.1");
    setenv("FSDP_GLOO_HOST", "192.0.2.1", 1);
    expect_fail(&o, "FSDP_GLOO_HOST=192.0.2.1", "192.0.2.1");
    unsetenv("FSDP_GLOO_HOST");

    /* Rank 1 of 3 never comes. */
    rank_arg_t a[MAXW];
    fsdp_gloo_options_init(&o);
    o.timeout_ms = 1500;
    run_n(3, 1, &o, a);
    int ok = 1;
    for (int r = 0; r < 3; r += 2) {
        if (a[r].create_rc != FSDP_ETIMEDOUT || !strstr(a[r].err, "never joined: rank 1") ||
            strstr(a[r].err, "rank 1,") || a[r].seconds > 1.5 + 2.0) {
            tap_diag("rank %d: %s after %.1f s: %s", r, fsdp_strerror(a[r].create_rc),
                     a[r].seconds, a[r].err);
            ok = 0;
        }
    }
    tap_ok(ok, "a rank that never joins: the others time out within 1.5 s + 2 s naming rank 1 "
               "(and only it)");
    return tap_done();
}
