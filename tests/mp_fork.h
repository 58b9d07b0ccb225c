/* SPDX-License-Identifier: MIT */
/*
 * mp_fork.h: rank processes for the tests that run Gloo worlds of real processes on one host:
 * mp_run.c (fsdp_util's jobs) and gloo_world.c's gw_run_procs() (the collective suite).
 *
 * mp_fork_ranks() makes a fresh directory for the ranks' file store, flushes stdio, forks one
 * process per rank and waits for all of them, killing them after a deadline; then it removes
 * the directory. A rank process runs the rank function, whose return value it stores in memory
 * shared with the parent, and leaves with _exit(), so no atexit handler (the sanitizers' leak
 * report, stdio buffers of the parent) runs twice.
 *
 * What a rank function records for the parent must be in memory that mp_shared_alloc() mapped
 * (MAP_SHARED | MAP_ANONYMOUS) before the fork: a child inherits the mapping at the same
 * address, so pointers into it stay valid, while what it writes to ordinary memory goes to its
 * own copy. A lock in that memory must be process-shared (mp_mutex_init()). Children may read
 * anything the parent wrote before the fork.
 */
#ifndef FSDP_TESTS_MP_FORK_H
#define FSDP_TESTS_MP_FORK_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp.h>

/* Most rank processes one run forks. */
#define MP_MAX_RANKS 8

/* Connect timeout of the Gloo world groups the rank processes (and gloo_world.c's threads)
 * create; their collectives get their own. */
#define MP_CONNECT_MS 60000

/* One rank process: rank of n, with `dir` for its file store. Returns the rank's status (0 or a
 * negative FSDP_E* code). */
typedef int (*mp_rank_fn)(int rank, int n, const char *dir, void *arg);

/*
 * Runs fn in n (1..MP_MAX_RANKS) forked processes and waits for them, at most deadline_s
 * seconds (5 times that under ThreadSanitizer, twice under AddressSanitizer): then it kills the
 * ones left with SIGKILL and says so with tap_diag(). status[] (may
 * be NULL) gets every rank's status: what fn returned, FSDP_EINTERNAL for a process that did not
 * get that far. Returns FSDP_ETIMEDOUT when processes were killed, else FSDP_EREMOTE when one
 * ended by a signal or a nonzero exit status (named with tap_diag()), else the first negative
 * rank status, else FSDP_OK. Bails out of the test program when it cannot fork or make the
 * directory. Call it from a single-threaded parent.
 */
int mp_fork_ranks(int n, mp_rank_fn fn, void *arg, int deadline_s, int *status);

/* bytes of zeroed memory shared with the processes that mp_fork_ranks() forks afterwards; bails
 * out of the test program when the mapping fails. */
void *mp_shared_alloc(size_t bytes);
/* Unmaps what mp_shared_alloc() returned (NULL is a no-op). */
void mp_shared_free(void *p);

/* Initializes *mu as a PTHREAD_PROCESS_SHARED mutex (it works between threads as well). */
void mp_mutex_init(pthread_mutex_t *mu);

/*
 * A rank's context (rank of n, `seed`) and its Gloo world group over `store` (borrowed: it must
 * outlive the context), with MP_CONNECT_MS to connect. The group belongs to the context, which
 * destroys it. On failure returns the status, with *ctx the context when it was made (or NULL)
 * and err (cap bytes) naming the failed step and the library's message.
 */
int mp_gloo_rank(int rank, int n, uint64_t seed, fsdp_store_t *store, fsdp_ctx_t **ctx,
                 fsdp_pg_t **pg, char *err, size_t cap);

/* The same over NCCL on GPU `rank`, with a CUDA device on that GPU (*dev, owned by the caller,
 * destroyed after fsdp_ctx_set_device(ctx, NULL)) set as the context's device. */
int mp_nccl_rank(int rank, int n, uint64_t seed, fsdp_store_t *store, fsdp_ctx_t **ctx,
                 fsdp_device_t **dev, char *err, size_t cap);

#endif /* FSDP_TESTS_MP_FORK_H */
