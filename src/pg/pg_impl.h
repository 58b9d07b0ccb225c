/* SPDX-License-Identifier: MIT */
/*
 * pg_impl.h: the interface between the process-group core and its backends.
 *
 * The core (pg.c) checks every argument once, assigns the sequence number, counts calls and
 * bytes, and builds one descriptor (fsdp_coll_t) per collective. A backend sees only that
 * descriptor through one entry point, post(), and reports completion with
 * fsdp__work_complete(). One entry point instead of one per collective keeps every backend's
 * transport code in one switch and lets the sim backend compare descriptors across ranks for
 * mismatch detection (see docs/design.md).
 *
 * A backend embeds struct fsdp_pg as the first member of its own group struct and defines one
 * static const struct fsdp_pg_ops.
 */
#ifndef FSDP_PG_IMPL_H
#define FSDP_PG_IMPL_H

#include <pthread.h>

#include <fsdp/pg.h>

#include "internal.h"

/* One collective as issued by one rank. Count and buffer meanings are those of pg.h. */
typedef struct fsdp_coll {
    fsdp_coll_kind_t kind;
    const void *send;
    void *recv;
    size_t count;       /* elements per rank (NCCL meaning) */
    fsdp_dtype_t dtype;
    fsdp_redop_t op;    /* reductions only */
    double prescale;    /* sums only: 0, or every input is multiplied by it first (pg.h) */
    int root;           /* broadcast and reduce only */
    uint64_t seq;       /* the group's sequence number of this call */
    int64_t timeout_ms; /* the group's timeout when the call was issued */
    void *stream;       /* the native stream it is issued on (fsdp_coll_desc_t) */
    bool host;          /* the core's own exchange: plain host buffers, whatever device the
                         * group keeps its buffers on (sub-group agreement) */
} fsdp_coll_t;

struct fsdp_work {
    fsdp_pg_t *pg;
    fsdp_coll_t coll;
    int done;   /* guarded by pg->mu */
    int status; /* valid once done */
    int refs;   /* the caller's handle, the backend's and the late list's, guarded by pg->mu */
    int sync;   /* the caller blocks until completion; a backend may run it on that thread */
    fsdp_work_t *next; /* free for the backend's queue */
    /* Waited on a stream (fsdp_work_wait_stream) and its status not reported yet: the work is
     * on pg's late list, which holds a reference. Both guarded by pg->mu. */
    int late;
    fsdp_work_t *late_next;
    /* When it was issued (CLOCK_MONOTONIC ns) if its rank recorded a trace then, else 0: its
     * completion is then recorded on the rank's communication track. */
    int64_t trace_issued;
    double vtime; /* free for a virtual-time backend: the simulated completion time */
    char err[FSDP_ERR_LEN];
};

struct fsdp_pg_ops {
    const char *name;
    /* Starts w->coll. Returns FSDP_OK and later calls fsdp__work_complete(w) exactly once (from
     * any thread, possibly before returning), or returns a negative status without calling it. */
    int (*post)(fsdp_pg_t *pg, fsdp_work_t *w);
    /* Creates this rank's handle on a sub-group made of `members` (ranks of parent, in new-rank
     * order; this rank is members[new_rank]). `name` is the same on every member and unique for
     * the parent. NULL when the backend cannot split. */
    int (*create_subgroup)(fsdp_pg_t *parent, const int *members, int n, int new_rank,
                           const char *name, fsdp_pg_t **out);
    /* Instead of create_subgroup (which is then unused), for a backend whose split is
     * collective over the whole parent, as NCCL's ncclCommSplit is: called on every rank of
     * parent that took part in the exchange, with members, n, new_rank and name as above and
     * `color` (>= 0) the same on every member and different for the other groups the same
     * fsdp_pg_split() makes, or color -1 on a rank that joins no group (members NULL, n 0,
     * new_rank -1, name NULL; *out stays NULL). NULL for the other backends. */
    int (*split)(fsdp_pg_t *parent, int color, const int *members, int n, int new_rank,
                 const char *name, fsdp_pg_t **out);
    /* Optional. Makes later work on `stream` (the backend's native stream: a cudaStream_t)
     * wait until w's collective has completed, without blocking the host. Called by the core
     * (fsdp_work_wait_stream, which checked the arguments) on a work that may have completed
     * meanwhile; it neither completes nor frees w. Returns FSDP_OK once the wait is enqueued
     * (or nothing is left to wait for), 1 when this collective cannot be ordered on a stream
     * (the core then waits on the host), or a negative status with the group's last error set
     * (the core then waits on the host too, so the caller's buffers are never released early).
     * NULL for a backend without device streams: the core waits on the host. */
    int (*wait_stream)(fsdp_pg_t *pg, fsdp_work_t *w, void *stream);
    /* Optional. Called on the waiting thread when a host wait (fsdp_work_wait, or a blocking
     * collective) has seen w complete successfully: a virtual-time backend moves its rank's
     * host clock to the collective's simulated end. NULL for the real backends. */
    void (*host_waited)(fsdp_pg_t *pg, fsdp_work_t *w);
    /* Frees the backend's group after the core has waited for every outstanding work; must call
     * fsdp__pg_fini(). */
    void (*destroy)(fsdp_pg_t *pg);
};

struct fsdp_pg {
    const struct fsdp_pg_ops *ops;
    int rank;
    int size;
    fsdp_ctx_t *ctx;   /* owning rank's context; NULL for a context-less dummy group */
    int *world_ranks;  /* [size]: world rank of each group rank */
    char name[96];
    uint64_t seq;      /* next sequence number (guarded by issue_mu) */
    int64_t timeout_ms;
    fsdp_pg_counters_t counters; /* guarded by mu */
    /* Held while a collective is numbered, posted and counted, so that calls from several
     * threads get their sequence numbers in the order they reach the backend. */
    pthread_mutex_t issue_mu;
    pthread_mutex_t mu; /* guards the works' done/status/refs, pending and counters */
    pthread_cond_t cv;  /* signalled when a work completes */
    size_t pending;     /* works posted and not yet completed */
    /* Works waited on a stream whose status no blocking point has reported yet, oldest first
     * (guarded by mu; see fsdp_work_wait_stream in pg.h). */
    fsdp_work_t *late_head, *late_tail;
    struct fsdp__ctx_child child; /* its registration on ctx (destroyed with it if forgotten) */
    char err[FSDP_ERR_LEN];
};

/* Initializes the base of a backend's group (copies world_ranks; NULL means the identity) and
 * registers it on ctx. Returns FSDP_ENOMEM; fsdp__pg_fini() is safe after a failure. */
int fsdp__pg_init(fsdp_pg_t *pg, const struct fsdp_pg_ops *ops, fsdp_ctx_t *ctx, int rank,
                  int size, const int *world_ranks, const char *name);

/* The argument checks every constructor of a world group makes (fsdp_pg_create_gloo,
 * fsdp_pg_create_nccl), done once here: *out (when given) is set to NULL; ctx, store and out
 * must be given and timeout_ms (the options' value) must not be negative. On success *timeout
 * is the group's timeout (timeout_ms, or FSDP_PG_DEFAULT_TIMEOUT_MS for 0). A failure is
 * FSDP_EINVAL with a message on ctx naming fn, the rank and the argument (none without ctx). */
int fsdp__pg_check_world_args(fsdp_ctx_t *ctx, const char *fn, const fsdp_store_t *store,
                              fsdp_pg_t **out, int64_t timeout_ms, int64_t *timeout);

/* Releases what fsdp__pg_init() set up and unregisters the group from its context. */
void fsdp__pg_fini(fsdp_pg_t *pg);

/* Completes a work with a status and, for a failure, a message. Called once per work by the
 * backend; drops the backend's reference. */
void fsdp__work_complete(fsdp_work_t *w, int status, const char *fmt, ...) FSDP_PRINTF(3, 4);

/* Sets the group's last error (logged at debug level) and returns rc. */
int fsdp__pg_err(fsdp_pg_t *pg, int rc, const char *fmt, ...) FSDP_PRINTF(3, 4);

/* "all_reduce(f32, count=4, op=sum)": a description of a collective for messages. */
void fsdp__coll_describe(const fsdp_coll_t *c, char *buf, size_t cap);

/* Issues a collective after validation; used by the public functions and by split. */
int fsdp__pg_issue(fsdp_pg_t *pg, const fsdp_coll_t *c, fsdp_work_t **work);

#endif /* FSDP_PG_IMPL_H */
