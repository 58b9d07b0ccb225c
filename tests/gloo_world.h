/* SPDX-License-Identifier: MIT */
/*
 * gloo_world.h: Gloo worlds of threads or processes for the gloo tests, and failure recording.
 *
 * gw_run() starts one thread per rank; each creates its own context and its own Gloo world
 * group over a clone (made by the main thread) of one in-memory store, runs fn, and destroys its
 * context (which destroys the groups it still has). gw_run_procs() does the same with one
 * process per rank (mp_fork.h), each opening a file store in a directory the parent made: what
 * fn records for the parent must then be in mp_shared_alloc() memory. Ranks record checks in a
 * rec_t, which the main thread turns into one TAP line.
 */
#ifndef FSDP_TESTS_GLOO_WORLD_H
#define FSDP_TESTS_GLOO_WORLD_H

#include <pthread.h>

#include <fsdp.h>

#define GW_MAX_WORLD 4
#define REC_KEEP 3

/* How long gw_run_procs() lets its processes run before it kills them. */
#define GW_DEADLINE_S 120

typedef int (*gw_fn)(fsdp_ctx_t *ctx, fsdp_pg_t *pg, void *arg);

typedef struct gw_rank {
    pthread_t thread;
    int rank, size;
    fsdp_store_t *store; /* this rank's clone of the shared store (made by the main thread) */
    gw_fn fn;
    void *arg;
    int status;
    char err[600];
} gw_rank_t;

/* Runs fn on n ranks over `store` (NULL: a fresh in-memory store). Returns the first failing
 * rank's status; status[] (may be NULL) gets every rank's. */
int gw_run_on(fsdp_store_t *store, int n, gw_fn fn, void *arg, int *status);
int gw_run(int n, gw_fn fn, void *arg, int *status);
/* gw_run() with one process per rank (forked from a single-threaded caller); fn's arg must
 * point into mp_shared_alloc() memory where fn writes what the parent reads. FSDP_ENOTSUP when
 * libfsdp has no Gloo backend. */
int gw_run_procs(int n, gw_fn fn, void *arg, int *status);

/* A gw_run() or gw_run_procs(). */
typedef int (*gw_runner_fn)(int n, gw_fn fn, void *arg, int *status);

/* Seconds on the monotonic clock. */
double gw_now_s(void);

/* Failures recorded by ranks, reported by the main thread. */
typedef struct rec {
    pthread_mutex_t mu;
    int checks, fails;
    char msg[REC_KEEP][700];
} rec_t;

/* Its lock is process-shared, so a rec_t in mp_shared_alloc() memory serves gw_run_procs(). */
void rec_init(rec_t *r);
/* Counts a check; keeps the message of the first REC_KEEP failures. Thread-safe. */
void rec_check(rec_t *r, int pass, const char *fmt, ...) FSDP_PRINTF(3, 4);
/* One TAP line for everything recorded (and the status of the run); destroys r's lock. */
void rec_report(rec_t *r, int rc, const char *fmt, ...) FSDP_PRINTF(3, 4);
/* coll_check_run() on pg, recorded. */
void rec_coll(rec_t *rc, fsdp_pg_t *pg, const char *where, fsdp_coll_kind_t kind, fsdp_dtype_t dt,
              fsdp_redop_t op, size_t count, int in_place, int root);

#endif /* FSDP_TESTS_GLOO_WORLD_H */
