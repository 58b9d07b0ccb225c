/* SPDX-License-Identifier: MIT */
/*
 * pg_worker.h: the per-rank communication worker of the backends whose collectives run on a
 * host thread (sim, gloo): one FIFO queue, one execution slot and one thread per rank, shared by
 * all the rank's groups of that backend. The backend supplies what a collective does (an execute
 * callback); the worker supplies when and on which thread it runs.
 *
 * The ordering contract (pg.h, "Completion": a rank's collectives execute in the order it issued
 * them, over all its groups, like one CUDA stream) is implemented here and nowhere else:
 *
 *   - One execution slot: at most one work of the worker executes at any time, on the worker's
 *     thread or on a caller's. `busy` says the slot is held; it changes hands only under `mu`.
 *   - FIFO: works execute in the order fsdp__pg_worker_post() took `mu`, whatever their group.
 *     A queued work is never overtaken: the worker takes the head only when the slot is free.
 *   - Inline execution: a blocking work (w->sync) posted while nothing is queued or executing
 *     runs at once on the caller's thread, in the slot, which saves two thread hand-offs. Any
 *     other work (asynchronous, or posted while the worker is busy or has a queue) is queued and
 *     runs on the worker's thread; the caller of a blocking one then waits for its work.
 *   - The worker never touches a work after its execute callback returned, so the work's group
 *     may be destroyed as soon as the work has completed.
 *   - Stopping drains: fsdp__pg_worker_stop() lets the thread execute what is still queued, then
 *     joins it. Nothing may be posted once stop has been called.
 *
 * The thread starts with the caller's signal mask plus the signals the backend asks to block
 * (gloo blocks SIGPIPE on its worker for good); what a backend needs on a caller's thread while
 * it executes inline (gloo blocks SIGPIPE there too, only meanwhile) is the execute callback's
 * business, told by its `on_caller` argument.
 */
#ifndef FSDP_PG_WORKER_H
#define FSDP_PG_WORKER_H

#include <pthread.h>
#include <signal.h>

#include "pg/pg_impl.h"

/* Executes one work in the slot and completes it (fsdp__work_complete, for a real backend)
 * before returning. `arg` is the one given to the worker; `on_caller` is 1 when the work runs
 * inline on the thread that posted it, 0 on the worker's thread. */
typedef void (*fsdp__pg_exec_fn)(void *arg, fsdp_work_t *w, int on_caller);

typedef struct fsdp__pg_worker {
    pthread_mutex_t mu;
    pthread_cond_t cv;        /* the worker's thread waits here for work or a free slot */
    fsdp_work_t *head, *tail; /* queued works (linked by w->next), in post order */
    int busy;                 /* the slot: a work is executing (on either thread) */
    int stop;                 /* no more posts; the thread exits once the queue is empty */
    int started;              /* the thread runs and has not been joined */
    pthread_t thread;
    fsdp__pg_exec_fn exec;
    void *arg;
} fsdp__pg_worker_t;

/* Initializes a worker without starting its thread: works posted meanwhile are queued (or run
 * inline) and the queue is executed once it starts. */
void fsdp__pg_worker_init(fsdp__pg_worker_t *wk, fsdp__pg_exec_fn exec, void *arg);

/* Starts the worker's thread with `blocked` (NULL: none) added to the caller's signal mask.
 * Returns FSDP_OK, or FSDP_ENOMEM when the thread cannot be created (the worker stays usable by
 * fsdp__pg_worker_fini()). */
int fsdp__pg_worker_start(fsdp__pg_worker_t *wk, const sigset_t *blocked);

/* Names thread t "<prefix><index>" (at most 15 bytes, cut), as top -H, perf and gdb show it,
 * so that the time a rank's compute and communication take can be told apart. Best effort: a
 * platform without thread names keeps the process's. */
void fsdp__thread_name(pthread_t t, const char *prefix, int index);

/* Runs w inline or queues it (see the top of this file); w->next is the worker's until w has
 * executed. Returns FSDP_OK, or FSDP_EINTERNAL without running or queueing w when the worker is
 * stopping (a caller's bug). */
int fsdp__pg_worker_post(fsdp__pg_worker_t *wk, fsdp_work_t *w);

/* Executes what is still queued on the worker's thread, then joins it. A worker that was never
 * started must have an empty queue. Idempotent. */
void fsdp__pg_worker_stop(fsdp__pg_worker_t *wk);

/* Frees what init set up; after fsdp__pg_worker_stop() (or when never started). */
void fsdp__pg_worker_fini(fsdp__pg_worker_t *wk);

/*
 * A started worker held by the rank's context as a shared state under `key` (a static object's
 * address of the backend), so that all the rank's groups of that backend share one worker and
 * one order. The first acquire makes and starts it with exec, arg and blocked; later ones take a
 * reference on it and ignore those. Returns FSDP_OK or FSDP_ENOMEM. The last release stops it,
 * which finds its queue empty: every group waited for its works before being destroyed.
 */
int fsdp__pg_worker_acquire(fsdp_ctx_t *ctx, const void *key, fsdp__pg_exec_fn exec, void *arg,
                            const sigset_t *blocked, fsdp__pg_worker_t **out);
void fsdp__pg_worker_release(fsdp_ctx_t *ctx, const void *key, fsdp__pg_worker_t *wk);

#endif /* FSDP_PG_WORKER_H */
