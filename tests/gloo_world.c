/* SPDX-License-Identifier: MIT */
/*
 * gloo_world.c: Gloo worlds of threads or processes for the gloo tests, and failure recording
 * (see gloo_world.h).
 */
#define _POSIX_C_SOURCE 200809L

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coll_check.h"
#include "gloo_world.h"
#include "mp_fork.h"
#include "tap.h"

double gw_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* One rank, on a thread or in a process: its own context and Gloo world group over `store`, then
 * fn. The context destroys the groups the rank left (its world group among them); the store
 * they borrow is the caller's. */
static int gw_rank_body(int rank, int n, fsdp_store_t *store, gw_fn fn, void *arg, char *err,
                        size_t cap) {
    fsdp_ctx_t *ctx = NULL;
    fsdp_pg_t *pg = NULL;
    int rc = mp_gloo_rank(rank, n, 0, store, &ctx, &pg, err, cap);
    if (rc == FSDP_OK) rc = fn(ctx, pg, arg);
    fsdp_ctx_destroy(ctx);
    coll_check_release();
    return rc;
}

static void *gw_main(void *p) {
    gw_rank_t *g = p;
    g->status = gw_rank_body(g->rank, g->size, g->store, g->fn, g->arg, g->err, sizeof g->err);
    return NULL;
}

int gw_run_on(fsdp_store_t *store, int n, gw_fn fn, void *arg, int *status) {
    gw_rank_t g[GW_MAX_WORLD];
    fsdp_store_t *own = NULL;
    if (!store) {
        if (fsdp_store_create_memory(NULL, &own) != FSDP_OK) tap_bail("cannot create a store");
        store = own;
    }
    memset(g, 0, sizeof g);
    for (int r = 0; r < n; r++) {
        g[r].rank = r;
        g[r].size = n;
        if (fsdp_store_clone(store, NULL, &g[r].store) != FSDP_OK) tap_bail("fsdp_store_clone");
        g[r].fn = fn;
        g[r].arg = arg;
        if (pthread_create(&g[r].thread, NULL, gw_main, &g[r]) != 0) tap_bail("pthread_create");
    }
    int rc = FSDP_OK;
    for (int r = 0; r < n; r++) {
        pthread_join(g[r].thread, NULL);
        if (status) status[r] = g[r].status;
        if (g[r].status < 0 && rc == FSDP_OK) rc = g[r].status;
        if (g[r].err[0]) tap_diag("rank %d: %s", r, g[r].err);
        fsdp_store_destroy(g[r].store);
    }
    fsdp_store_destroy(own);
    return rc;
}

int gw_run(int n, gw_fn fn, void *arg, int *status) {
    return gw_run_on(NULL, n, fn, arg, status);
}

typedef struct gw_procs {
    gw_fn fn;
    void *arg;
} gw_procs_t;

static int gw_proc_main(int rank, int n, const char *dir, void *arg) {
    const gw_procs_t *gp = arg;
    fsdp_store_t *store = NULL;
    char err[600] = "";
    int rc = fsdp_store_create_file(NULL, dir, &store); /* a failure is logged */
    if (rc < 0)
        snprintf(err, sizeof err, "fsdp_store_create_file: %s", fsdp_err_name(rc));
    else
        rc = gw_rank_body(rank, n, store, gp->fn, gp->arg, err, sizeof err);
    fsdp_store_destroy(store);
    if (err[0]) tap_diag("rank %d: %s", rank, err);
    return rc;
}

int gw_run_procs(int n, gw_fn fn, void *arg, int *status) {
    if (!fsdp_gloo_available()) return FSDP_ENOTSUP;
    gw_procs_t gp = {fn, arg};
    return mp_fork_ranks(n, gw_proc_main, &gp, GW_DEADLINE_S, status);
}

void rec_init(rec_t *r) {
    memset(r, 0, sizeof *r);
    mp_mutex_init(&r->mu);
}

void rec_check(rec_t *r, int pass, const char *fmt, ...) {
    pthread_mutex_lock(&r->mu);
    r->checks++;
    if (!pass) {
        if (r->fails < REC_KEEP) {
            va_list ap;
            va_start(ap, fmt);
            vsnprintf(r->msg[r->fails], sizeof r->msg[0], fmt, ap);
            va_end(ap);
        }
        r->fails++;
    }
    pthread_mutex_unlock(&r->mu);
}

void rec_report(rec_t *r, int rc, const char *fmt, ...) {
    char name[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    tap_ok(rc == FSDP_OK && r->fails == 0 && r->checks > 0, "%s (%d checks)", name, r->checks);
    if (rc != FSDP_OK) tap_diag("a rank returned %s", fsdp_err_name(rc));
    for (int i = 0; i < r->fails && i < REC_KEEP; i++)
        tap_diag("  %s", r->msg[i]);
    pthread_mutex_destroy(&r->mu);
}

void rec_coll(rec_t *rc, fsdp_pg_t *pg, const char *where, fsdp_coll_kind_t kind, fsdp_dtype_t dt,
              fsdp_redop_t op, size_t count, int in_place, int root) {
    char why[1024];
    int r = coll_check_run(pg, kind, dt, op, count, in_place, root, why, sizeof why);
    rec_check(rc, r == 0, "%s: rank %d of %d: %s", where, fsdp_pg_rank(pg), fsdp_pg_size(pg), why);
}
