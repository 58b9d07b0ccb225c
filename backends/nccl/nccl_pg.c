/*
 * nccl_pg.c: the NCCL process group: creation, the collectives on the group's communication
 * stream, the watchdog, failures and sub-groups (see fsdp/nccl.h for what a user sees).
 *
 * Threads. post() runs on the caller's thread: it enqueues the collective on the group's stream
 * (NCCL calls are asynchronous) and appends an op to the group's queue. The group's watchdog
 * thread polls the end event of the op at the head of the queue and completes the works in
 * order. Only the watchdog aborts the communicator, so nothing can use it while it is torn down:
 * a failure seen by post() (a CUDA or NCCL error while enqueueing) is recorded on its op and the
 * watchdog acts on it when that op reaches the head. gp->mu guards the queue, the sticky failure
 * and the comm pointer; post() holds it while it enqueues, so an abort never overlaps an enqueue.
 *
 * Host buffers. CUDA's pointer attributes tell device, managed and pinned memory (which NCCL's
 * kernels reach) from plain host memory, which is staged: copied to a device buffer on the
 * stream before the collective and copied back by the watchdog once the end event has fired
 * (on a stream of its own, so that it never waits behind later collectives). A copy from
 * pageable memory may wait for the stream's earlier work, so a staged collective is enqueued
 * only once the group's earlier ones have completed (or failed).
 */
#include <cuda_runtime.h>
#include "backends/nccl/nccl_inc.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backends/nccl/nccl_id.h"
#include "backends/nccl/nccl_kernels.h"
#include "backends/nccl/nccl_map.h"
#include "backends/nccl/nccl_pg.h"
#include "core/timeutil.h"
#include "pg/pg_impl.h"

/* The watchdog's polling interval while a collective runs. */
#define POLL_NS 50000

typedef struct nccl_op {
    fsdp_work_t *w;
    cudaEvent_t end;
    int64_t head_ns; /* when it reached the head of the queue (0: not yet) */
    void *stage;     /* device copy of the host buffers (cudaMallocAsync), or NULL */
    void *back_host; /* host recv to copy back into once complete, or NULL */
    const void *back_dev;
    size_t back_bytes;
    int fail_rc; /* enqueueing failed: fail the group when this op reaches the head */
    char fail_msg[FSDP_ERR_LEN];
    struct nccl_op *next;
} nccl_op_t;

struct nccl_pg;

/* The rank's order over its NCCL groups (fsdp/pg.h: a rank's collectives run in the order it
 * issued them, over all its groups, like one CUDA stream). Shared by the NCCL groups of one
 * context (a shared state of the context); last is guarded by mu. */
typedef struct nccl_rank {
    pthread_mutex_t mu;
    struct nccl_pg *last; /* the group of the rank's last collective, or NULL */
} nccl_rank_t;

typedef struct nccl_pg {
    fsdp_pg_t base;
    nccl_rank_t *rk;
    cudaEvent_t last_ev; /* recorded after the group's last collective */
    int device;
    ncclComm_t comm;    /* NULL once aborted */
    cudaStream_t cs;    /* the communication stream */
    cudaStream_t xs;    /* the watchdog's copy-back stream */
    unsigned char *one; /* a device byte for barrier */
    pthread_mutex_t mu;
    pthread_cond_t cv;   /* wakes the watchdog */
    pthread_cond_t idle; /* broadcast when the queue becomes empty */
    nccl_op_t *head, *tail;
    int stop;
    int broken_rc; /* sticky failure (0: none) and its message, guarded by mu */
    char broken_msg[FSDP_ERR_LEN];
    int started;
    pthread_t thread;
} nccl_pg_t;

/* ---------------------------------------------------------------------------------------- */
/* Errors: the one place where CUDA's and NCCL's statuses become libfsdp's. */

static int cuda_err(cudaError_t e, const char *what, char *msg, size_t cap) {
    if (e == cudaSuccess) return FSDP_OK;
    snprintf(msg, cap, "%s: CUDA error %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
    return FSDP_EBACKEND;
}

static int nccl_err(ncclResult_t r, ncclComm_t comm, const char *what, char *msg, size_t cap) {
    if (r == ncclSuccess || r == ncclInProgress) return FSDP_OK;
    const char *last = ncclGetLastError(comm);
    snprintf(msg, cap, "%s: %s%s%s", what, ncclGetErrorString(r), last && *last ? ": " : "",
             last ? last : "");
    return r == ncclRemoteError || r == ncclSystemError ? FSDP_EREMOTE : FSDP_EBACKEND;
}

/* Waits until comm's pending operation (init, split, finalize, a call that returned
 * ncclInProgress) is over, at most until deadline_ns. Returns its state; ncclInProgress when the
 * deadline passed. */
static ncclResult_t comm_settle(ncclComm_t comm, int64_t deadline_ns) {
    ncclResult_t st = ncclInProgress;
    const struct timespec pause = {0, POLL_NS};
    for (;;) {
        if (ncclCommGetAsyncError(comm, &st) != ncclSuccess) return ncclInternalError;
        if (st != ncclInProgress || fsdp__now_ns() >= deadline_ns) return st;
        nanosleep(&pause, NULL);
    }
}

static int64_t deadline_after(int64_t ms) {
    return fsdp__now_ns() + ms * 1000000;
}

/* ---------------------------------------------------------------------------------------- */
/* Enqueueing */

static int has_op(fsdp_coll_kind_t k) {
    return k == FSDP_COLL_REDUCE_SCATTER || k == FSDP_COLL_ALL_REDUCE || k == FSDP_COLL_REDUCE;
}

/* 1 when p is host memory that the GPU cannot reach (plain malloc). */
static int is_plain_host(const void *p) {
    struct cudaPointerAttributes a;
    if (!p) return 0;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError(); /* older runtimes report unknown pointers as an error */
        return 1;
    }
    return a.type == cudaMemoryTypeUnregistered;
}

/* The bytes a collective reads from send and writes to recv on this rank. */
static void coll_bytes(const fsdp_pg_t *pg, const fsdp_coll_t *c, size_t *sb, size_t *rb) {
    size_t one = c->count * fsdp_dtype_size(c->dtype), all = one * (size_t)pg->size;
    *sb = *rb = one;
    if (c->kind == FSDP_COLL_ALL_GATHER) *rb = all;
    if (c->kind == FSDP_COLL_REDUCE_SCATTER) *sb = all;
    if (c->kind == FSDP_COLL_ALL_TO_ALL) *sb = *rb = all;
}

/*
 * Replaces plain host buffers by device copies made on the stream: one staging buffer for both
 * when they overlap (in place), else one region each. The recv region is copied back after
 * completion where this rank's recv is written.
 */
static int stage_host(nccl_pg_t *gp, nccl_op_t *op, const void **send, void **recv, char *msg,
                      size_t cap) {
    const fsdp_coll_t *c = &op->w->coll;
    size_t sb, rb;
    coll_bytes(&gp->base, c, &sb, &rb);
    int sh = is_plain_host(*send), rh = is_plain_host(*recv);
    if (!sh && !rh) return FSDP_OK;
    const unsigned char *s = *send;
    unsigned char *r = *recv;
    const unsigned char *lo[2] = {NULL, NULL}; /* host regions to copy in: [lo, lo + len) */
    size_t len[2] = {0, 0};
    if (sh && rh && s < r + rb && r < s + sb) {
        const unsigned char *a = s < r ? s : r;
        const unsigned char *b = s + sb > r + rb ? s + sb : r + rb;
        lo[0] = a;
        len[0] = (size_t)(b - a);
    } else {
        if (sh) {
            lo[0] = s;
            len[0] = sb;
        }
        if (rh) {
            lo[1] = r;
            len[1] = rb;
        }
    }
    unsigned char *dev = NULL;
    int rc = cuda_err(cudaMallocAsync((void **)&dev, len[0] + len[1] + 1, gp->cs),
                      "staging host buffers", msg, cap);
    if (rc < 0) return rc;
    op->stage = dev;
    for (int i = 0; i < 2; i++) {
        if (!lo[i]) continue;
        unsigned char *d = dev + (i ? len[0] : 0);
        rc = cuda_err(cudaMemcpyAsync(d, lo[i], len[i], cudaMemcpyHostToDevice, gp->cs),
                      "copying a host buffer to the device", msg, cap);
        if (rc < 0) return rc;
        if (sh && s >= lo[i] && s < lo[i] + len[i]) *send = d + (s - lo[i]);
        if (rh && r >= lo[i] && r < lo[i] + len[i]) *recv = d + (r - lo[i]);
    }
    int written = c->kind != FSDP_COLL_REDUCE || gp->base.rank == c->root;
    if (rh && written && c->kind != FSDP_COLL_BARRIER) {
        op->back_host = r;
        op->back_dev = *recv;
        op->back_bytes = rb;
    }
    return FSDP_OK;
}

/* One NCCL call's status, settled when the non-blocking communicator says it is in progress. */
static int nccl_call(nccl_pg_t *gp, ncclResult_t r, const char *what, int64_t timeout_ms, char *msg,
                     size_t cap) {
    if (r == ncclInProgress) r = comm_settle(gp->comm, deadline_after(timeout_ms));
    if (r == ncclInProgress) {
        snprintf(msg, cap, "%s: NCCL still had it in progress after %lld ms", what,
                 (long long)timeout_ms);
        return FSDP_ETIMEDOUT;
    }
    return nccl_err(r, gp->comm, what, msg, cap);
}

/* A scratch buffer on the stream, freed on the stream after what follows. */
static int scratch(nccl_pg_t *gp, void **p, size_t bytes, char *msg, size_t cap) {
    return cuda_err(cudaMallocAsync(p, bytes ? bytes : 1, gp->cs), "scratch buffer", msg, cap);
}

/* The reductions, with the widening and division the plan asks for. */
static int reduce_kinds(nccl_pg_t *gp, const fsdp_coll_t *c, const fsdp_nccl_plan_t *p,
                        const void *send, void *recv, char *msg, size_t cap) {
    const int n = gp->base.size, r = gp->base.rank;
    const size_t cnt = c->count;
    const int to_me = c->kind != FSDP_COLL_REDUCE || r == c->root;
    const size_t in = c->kind == FSDP_COLL_REDUCE_SCATTER ? cnt * (size_t)n : cnt;
    float *a = NULL;
    int rc;
    const void *s = send;
    void *d = recv;
    if (p->widen) {
        rc = scratch(gp, (void **)&a, in * sizeof(float), msg, cap);
        if (rc < 0) return rc;
        rc = cuda_err((cudaError_t)fsdp__nccl_widen(send, a, in, c->dtype, gp->cs),
                      "widening to f32", msg, cap);
        if (rc < 0) goto out;
        s = a;
        d = c->kind == FSDP_COLL_REDUCE_SCATTER ? a + (size_t)r * cnt : a;
    }
    /* A non-root's recv of reduce is not used and may be NULL: NCCL gets send there. */
    if (!d) d = (void *)s;
    ncclResult_t nr;
    if (c->kind == FSDP_COLL_REDUCE_SCATTER)
        nr = ncclReduceScatter(s, d, cnt, p->type, p->op, gp->comm, gp->cs);
    else if (c->kind == FSDP_COLL_ALL_REDUCE)
        nr = ncclAllReduce(s, d, cnt, p->type, p->op, gp->comm, gp->cs);
    else
        nr = ncclReduce(s, d, cnt, p->type, p->op, c->root, gp->comm, gp->cs);
    rc = nccl_call(gp, nr, fsdp_coll_name(c->kind), c->timeout_ms, msg, cap);
    if (rc < 0 || !to_me) goto out;
    if (p->divide) {
        rc = cuda_err(
            (cudaError_t)fsdp__nccl_divide(d, cnt, p->widen ? FSDP_DTYPE_F32 : c->dtype, n, gp->cs),
            "avg: dividing by the group size", msg, cap);
        if (rc < 0) goto out;
    }
    if (p->widen)
        rc = cuda_err((cudaError_t)fsdp__nccl_narrow(d, recv, cnt, c->dtype, gp->cs),
                      "rounding f32 back", msg, cap);
out:
    if (a) cudaFreeAsync(a, gp->cs);
    return rc;
}

/* Enqueues op's collective on the communication stream between the caller's stream's events. */
static int enqueue(nccl_pg_t *gp, nccl_op_t *op, const fsdp_nccl_plan_t *plan, char *msg,
                   size_t cap) {
    const fsdp_coll_t *c = &op->w->coll;
    cudaStream_t us = (cudaStream_t)c->stream;
    cudaEvent_t start = NULL;
    int rc = cuda_err(cudaEventCreateWithFlags(&start, cudaEventDisableTiming), "event", msg, cap);
    if (rc < 0) return rc;
    rc = cuda_err(cudaEventRecord(start, us), "recording on the caller's stream", msg, cap);
    if (rc == FSDP_OK)
        rc = cuda_err(cudaStreamWaitEvent(gp->cs, start, 0), "ordering after the caller's stream",
                      msg, cap);
    cudaEventDestroy(start);
    if (rc < 0) return rc;

    const void *send = c->send;
    void *recv = c->recv;
    if (c->kind != FSDP_COLL_BARRIER && c->count > 0)
        rc = stage_host(gp, op, &send, &recv, msg, cap);
    if (rc < 0) return rc;
    const size_t es = fsdp_dtype_size(c->dtype), cnt = c->count;
    const char *what = fsdp_coll_name(c->kind);
    switch (c->kind) {
    case FSDP_COLL_BARRIER:
        rc = nccl_call(gp, ncclAllReduce(gp->one, gp->one, 1, ncclUint8, ncclMax, gp->comm, gp->cs),
                       what, c->timeout_ms, msg, cap);
        break;
    case FSDP_COLL_ALL_GATHER:
        if (cnt)
            rc = nccl_call(gp, ncclAllGather(send, recv, cnt, plan->type, gp->comm, gp->cs), what,
                           c->timeout_ms, msg, cap);
        break;
    case FSDP_COLL_BROADCAST:
        if (cnt)
            rc = nccl_call(
                gp,
                ncclBroadcast(send ? send : recv, recv, cnt, plan->type, c->root, gp->comm, gp->cs),
                what, c->timeout_ms, msg, cap);
        break;
    case FSDP_COLL_ALL_TO_ALL:
        if (!cnt) break;
        rc = nccl_call(gp, ncclGroupStart(), "ncclGroupStart", c->timeout_ms, msg, cap);
        for (int q = 0; rc == FSDP_OK && q < gp->base.size; q++) {
            size_t off = (size_t)q * cnt * es;
            rc = nccl_call(gp,
                           ncclSend((const char *)send + off, cnt, plan->type, q, gp->comm, gp->cs),
                           "all_to_all send", c->timeout_ms, msg, cap);
            if (rc == FSDP_OK)
                rc = nccl_call(gp,
                               ncclRecv((char *)recv + off, cnt, plan->type, q, gp->comm, gp->cs),
                               "all_to_all recv", c->timeout_ms, msg, cap);
        }
        {
            /* The group is ended even after a failed send or receive; the first error wins. */
            char later[FSDP_ERR_LEN];
            int rc2 = nccl_call(gp, ncclGroupEnd(), "all_to_all (ncclGroupEnd)", c->timeout_ms,
                                rc < 0 ? later : msg, rc < 0 ? sizeof later : cap);
            if (rc == FSDP_OK) rc = rc2;
        }
        break;
    default:
        if (cnt && has_op(c->kind)) rc = reduce_kinds(gp, c, plan, send, recv, msg, cap);
        break;
    }
    if (rc < 0) return rc;
    rc = cuda_err(cudaEventRecord(op->end, gp->cs), "recording the end event", msg, cap);
    if (rc == FSDP_OK)
        rc = cuda_err(cudaStreamWaitEvent(us, op->end, 0), "ordering the caller's stream after",
                      msg, cap);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* The watchdog */

static void op_free(nccl_pg_t *gp, nccl_op_t *op) {
    if (op->stage) cudaFreeAsync(op->stage, gp->cs);
    if (op->end) cudaEventDestroy(op->end);
    free(op);
}

/* Copies a staged recv back once the op is complete. */
static int op_finish(nccl_pg_t *gp, nccl_op_t *op, char *msg, size_t cap) {
    if (!op->back_host) return FSDP_OK;
    int rc = cuda_err(cudaMemcpyAsync(op->back_host, op->back_dev, op->back_bytes,
                                      cudaMemcpyDeviceToHost, gp->xs),
                      "copying the result back to host memory", msg, cap);
    if (rc == FSDP_OK)
        rc = cuda_err(cudaStreamSynchronize(gp->xs), "copying the result back to host memory", msg,
                      cap);
    return rc;
}

static void describe(const nccl_pg_t *gp, const fsdp_coll_t *c, char *buf, size_t cap) {
    char desc[160];
    fsdp__coll_describe(c, desc, sizeof desc);
    snprintf(buf, cap, "%s seq %llu on group '%s' (rank %d)", desc, (unsigned long long)c->seq,
             gp->base.name, gp->base.rank);
}

/*
 * Fails the head op with rc and msg, aborts the communicator, makes the failure sticky and fails
 * every op still queued. Called by the watchdog without gp->mu.
 */
static void fail_all(nccl_pg_t *gp, int rc, const char *msg) {
    pthread_mutex_lock(&gp->mu);
    if (gp->comm) {
        ncclCommAbort(gp->comm);
        gp->comm = NULL;
    }
    gp->broken_rc = rc;
    snprintf(gp->broken_msg, sizeof gp->broken_msg, "%s", msg);
    nccl_op_t *list = gp->head;
    gp->head = gp->tail = NULL;
    pthread_cond_broadcast(&gp->idle);
    pthread_mutex_unlock(&gp->mu);
    fsdp_log(gp->base.ctx, FSDP_LOG_DEBUG, "nccl: %s: %s", fsdp_err_name(rc), msg);
    for (int first = 1; list; first = 0) {
        nccl_op_t *op = list;
        list = op->next;
        fsdp_work_t *w = op->w;
        if (first) {
            op_free(gp, op);
            fsdp__work_complete(w, rc, "%s", msg);
        } else {
            char who[384];
            describe(gp, &w->coll, who, sizeof who);
            op_free(gp, op);
            fsdp__work_complete(w, rc, "%s did not complete: the group failed earlier: %s", who,
                                msg);
        }
    }
}

static void *watchdog_main(void *arg) {
    nccl_pg_t *gp = arg;
    const struct timespec pause = {0, POLL_NS};
    char msg[FSDP_ERR_LEN], who[384];
    cudaSetDevice(gp->device);
    pthread_mutex_lock(&gp->mu);
    for (;;) {
        while (!gp->head && !gp->stop)
            pthread_cond_wait(&gp->cv, &gp->mu);
        nccl_op_t *op = gp->head;
        if (!op) break;
        if (!op->head_ns) op->head_ns = fsdp__now_ns();
        ncclComm_t comm = gp->comm;
        pthread_mutex_unlock(&gp->mu);

        const fsdp_coll_t *c = &op->w->coll;
        int rc = FSDP_OK;
        if (op->fail_rc < 0) {
            rc = op->fail_rc;
            snprintf(msg, sizeof msg, "%s", op->fail_msg);
        } else {
            cudaError_t e = cudaEventQuery(op->end);
            if (e == cudaSuccess) {
                rc = op_finish(gp, op, msg, sizeof msg);
                pthread_mutex_lock(&gp->mu);
                gp->head = op->next;
                if (!gp->head) {
                    gp->tail = NULL;
                    pthread_cond_broadcast(&gp->idle);
                }
                pthread_mutex_unlock(&gp->mu);
                fsdp_work_t *w = op->w;
                op_free(gp, op);
                if (rc == FSDP_OK) {
                    fsdp__work_complete(w, FSDP_OK, NULL);
                } else {
                    describe(gp, &w->coll, who, sizeof who);
                    fsdp__work_complete(w, rc, "%s failed: %s", who, msg);
                }
                pthread_mutex_lock(&gp->mu);
                continue;
            }
            describe(gp, c, who, sizeof who);
            ncclResult_t st = ncclSuccess;
            if (e != cudaErrorNotReady) {
                char why[FSDP_ERR_LEN];
                rc = cuda_err(e, "waiting for its end event", why, sizeof why);
                snprintf(msg, sizeof msg, "%s failed: %.1500s", who, why);
            } else if (comm && ncclCommGetAsyncError(comm, &st) == ncclSuccess &&
                       st != ncclSuccess && st != ncclInProgress) {
                const char *last = ncclGetLastError(comm);
                rc = FSDP_EREMOTE;
                snprintf(msg, sizeof msg,
                         "%s: NCCL reported an asynchronous error (%s%s%s): a peer failed or the "
                         "network broke; the communicator was aborted",
                         who, ncclGetErrorString(st), last && *last ? ": " : "", last ? last : "");
            } else if (fsdp__now_ns() - op->head_ns >= c->timeout_ms * 1000000) {
                rc = FSDP_ETIMEDOUT;
                snprintf(msg, sizeof msg,
                         "timed out after %lld ms in %s: a peer did not join or stalled; the "
                         "communicator was aborted",
                         (long long)c->timeout_ms, who);
            }
        }
        if (rc < 0)
            fail_all(gp, rc, msg);
        else
            nanosleep(&pause, NULL);
        pthread_mutex_lock(&gp->mu);
    }
    pthread_mutex_unlock(&gp->mu);
    return NULL;
}

/* ---------------------------------------------------------------------------------------- */
/* The backend */

static int nccl_post(fsdp_pg_t *pg, fsdp_work_t *w) {
    nccl_pg_t *gp = (nccl_pg_t *)pg;
    const fsdp_coll_t *c = &w->coll;
    char msg[FSDP_ERR_LEN], who[384];
    fsdp_nccl_plan_t plan;
    memset(&plan, 0, sizeof plan);
    if (c->kind != FSDP_COLL_BARRIER) {
        int rc = fsdp__nccl_plan(c->kind, c->dtype, c->op, &plan, msg, sizeof msg);
        if (rc < 0)
            return fsdp__pg_err(pg, rc, "fsdp_pg_%s on group '%s' (rank %d): %s",
                                fsdp_coll_name(c->kind), pg->name, pg->rank, msg);
    }
    nccl_op_t *op = calloc(1, sizeof *op);
    if (!op) return fsdp__pg_err(pg, FSDP_ENOMEM, "nccl: out of memory for an op");
    op->w = w;
    /* Copying from pageable host memory may wait for the stream's earlier work, and only the
     * watchdog (which needs mu) can abort a collective that never ends: so a staged collective
     * first waits, without blocking the watchdog, until the group's queue is empty. */
    const int staged = c->kind != FSDP_COLL_BARRIER && c->count > 0 &&
                       (is_plain_host(c->send) || is_plain_host(c->recv));
    pthread_mutex_lock(&gp->mu);
    while (staged && gp->head && gp->broken_rc == 0)
        pthread_cond_wait(&gp->idle, &gp->mu);
    if (gp->broken_rc < 0) {
        int rc = gp->broken_rc;
        snprintf(msg, sizeof msg, "%s", gp->broken_msg);
        pthread_mutex_unlock(&gp->mu);
        free(op);
        describe(gp, c, who, sizeof who);
        fsdp__work_complete(w, rc, "%s was not run: the group failed earlier: %s", who, msg);
        return FSDP_OK;
    }
    int prev = -1;
    cudaGetDevice(&prev);
    if (prev != gp->device) cudaSetDevice(gp->device);
    int rc = cuda_err(cudaEventCreateWithFlags(&op->end, cudaEventDisableTiming), "event", msg,
                      sizeof msg);
    /* After the rank's previous collective, whatever its group; the stream orders the group's
     * own. */
    pthread_mutex_lock(&gp->rk->mu);
    nccl_pg_t *last = gp->rk->last;
    if (rc == FSDP_OK && last && last != gp)
        rc = cuda_err(cudaStreamWaitEvent(gp->cs, last->last_ev, 0),
                      "ordering after the rank's collective on another group", msg, sizeof msg);
    if (rc == FSDP_OK) rc = enqueue(gp, op, &plan, msg, sizeof msg);
    if (rc == FSDP_OK)
        rc = cuda_err(cudaEventRecord(gp->last_ev, gp->cs), "recording the group's last event", msg,
                      sizeof msg);
    if (rc == FSDP_OK) gp->rk->last = gp;
    pthread_mutex_unlock(&gp->rk->mu);
    if (prev >= 0 && prev != gp->device) cudaSetDevice(prev);
    if (rc < 0) {
        op->fail_rc = rc;
        describe(gp, c, who, sizeof who);
        snprintf(op->fail_msg, sizeof op->fail_msg, "%s failed: %.1500s", who, msg);
    }
    op->next = NULL;
    if (gp->tail)
        gp->tail->next = op;
    else
        gp->head = op;
    gp->tail = op;
    pthread_cond_signal(&gp->cv);
    pthread_mutex_unlock(&gp->mu);
    return FSDP_OK;
}

/*
 * fsdp_work_wait_stream: `stream` waits for the end event of w's collective. The op is looked up
 * in the queue under gp->mu, where the watchdog cannot free its event; an op no longer queued has
 * completed or failed, and the core reads which from the work. A staged collective is complete
 * only once the watchdog has copied its result back to host memory, which no stream can wait
 * for: 1 asks the core to wait on the host.
 */
static int nccl_wait_stream(fsdp_pg_t *pg, fsdp_work_t *w, void *stream) {
    nccl_pg_t *gp = (nccl_pg_t *)pg;
    char msg[FSDP_ERR_LEN], who[384];
    int rc = FSDP_OK;
    pthread_mutex_lock(&gp->mu);
    for (nccl_op_t *op = gp->head; op; op = op->next) {
        if (op->w != w) continue;
        if (op->back_host)
            rc = 1;
        else if (op->fail_rc == 0)
            rc = cuda_err(cudaStreamWaitEvent((cudaStream_t)stream, op->end, 0),
                          "making the stream wait for the collective's end event", msg, sizeof msg);
        break;
    }
    pthread_mutex_unlock(&gp->mu);
    if (rc < 0) {
        describe(gp, &w->coll, who, sizeof who);
        return fsdp__pg_err(pg, rc, "fsdp_work_wait_stream: %s: %s", who, msg);
    }
    return rc;
}

/* The key of the rank's ordering state among the context's shared states. */
static const char rank_key;

static int rank_create(fsdp_ctx_t *ctx, void *arg, void **obj) {
    (void)ctx;
    (void)arg;
    nccl_rank_t *rk = calloc(1, sizeof *rk);
    if (!rk) return FSDP_ENOMEM;
    pthread_mutex_init(&rk->mu, NULL);
    *obj = rk;
    return FSDP_OK;
}

/* Takes a reference on the rank's ordering state, shared with the context's other NCCL
 * groups. */
static int rank_acquire(nccl_pg_t *gp) {
    void *obj = NULL;
    int rc = fsdp__ctx_shared_acquire(gp->base.ctx, &rank_key, rank_create, NULL, &obj);
    gp->rk = obj;
    return rc;
}

static void rank_release(nccl_pg_t *gp) {
    nccl_rank_t *rk = gp->rk;
    if (!rk) return;
    pthread_mutex_lock(&rk->mu);
    if (rk->last == gp) rk->last = NULL;
    pthread_mutex_unlock(&rk->mu);
    gp->rk = NULL;
    int last = fsdp__ctx_shared_release(gp->base.ctx, &rank_key);
    if (last) {
        pthread_mutex_destroy(&rk->mu);
        free(rk);
    }
}

static void nccl_destroy(fsdp_pg_t *pg) {
    nccl_pg_t *gp = (nccl_pg_t *)pg;
    if (gp->started) {
        pthread_mutex_lock(&gp->mu);
        gp->stop = 1;
        pthread_cond_signal(&gp->cv);
        pthread_mutex_unlock(&gp->mu);
        pthread_join(gp->thread, NULL);
    }
    int prev = -1;
    cudaGetDevice(&prev);
    if (gp->device >= 0) cudaSetDevice(gp->device);
    if (gp->comm) {
        /* Finalize flushes NCCL's pending work; a peer that is gone would make it wait
         * forever, so it is bounded by the group's timeout and the communicator aborted then. */
        ncclResult_t r = ncclCommFinalize(gp->comm);
        if (r == ncclInProgress || r == ncclSuccess)
            r = comm_settle(gp->comm, deadline_after(pg->timeout_ms));
        if (r == ncclSuccess)
            ncclCommDestroy(gp->comm);
        else
            ncclCommAbort(gp->comm);
    }
    rank_release(gp);
    if (gp->last_ev) cudaEventDestroy(gp->last_ev);
    if (gp->one) cudaFreeAsync(gp->one, gp->cs); /* no device-wide synchronization */
    if (gp->cs) cudaStreamDestroy(gp->cs);
    if (gp->xs) cudaStreamDestroy(gp->xs);
    if (prev >= 0) cudaSetDevice(prev);
    pthread_mutex_destroy(&gp->mu);
    pthread_cond_destroy(&gp->cv);
    pthread_cond_destroy(&gp->idle);
    fsdp__pg_fini(pg);
    free(gp);
}

static int nccl_split(fsdp_pg_t *parent, int color, const int *members, int n, int new_rank,
                      const char *name, fsdp_pg_t **out);

static const struct fsdp_pg_ops nccl_ops = {
    .name = "nccl",
    .post = nccl_post,
    .wait_stream = nccl_wait_stream,
    .split = nccl_split,
    .destroy = nccl_destroy,
};

/*
 * A group around a communicator: the base, the streams, the barrier byte and the watchdog.
 * Takes over comm (aborted on failure). On failure everything is freed and msg says why.
 */
static int group_create(fsdp_ctx_t *ctx, ncclComm_t comm, int device, const char *name, int rank,
                        int size, const int *world_ranks, nccl_pg_t **out, char *msg, size_t cap) {
    nccl_pg_t *gp = calloc(1, sizeof *gp);
    if (!gp) {
        ncclCommAbort(comm);
        snprintf(msg, cap, "out of memory");
        return FSDP_ENOMEM;
    }
    gp->device = device;
    gp->comm = comm;
    pthread_mutex_init(&gp->mu, NULL);
    pthread_cond_init(&gp->cv, NULL);
    pthread_cond_init(&gp->idle, NULL);
    int rc = fsdp__pg_init(&gp->base, &nccl_ops, ctx, rank, size, world_ranks, name);
    if (rc < 0) {
        snprintf(msg, cap, "out of memory");
        goto fail;
    }
    rc = cuda_err(cudaSetDevice(device), "selecting the device", msg, cap);
    if (rc == FSDP_OK)
        rc = cuda_err(cudaStreamCreateWithFlags(&gp->cs, cudaStreamNonBlocking),
                      "creating the communication stream", msg, cap);
    if (rc == FSDP_OK)
        rc = cuda_err(cudaStreamCreateWithFlags(&gp->xs, cudaStreamNonBlocking),
                      "creating the copy-back stream", msg, cap);
    if (rc == FSDP_OK)
        rc = cuda_err(cudaMallocAsync((void **)&gp->one, 1, gp->cs), "allocating the barrier byte",
                      msg, cap);
    if (rc == FSDP_OK)
        rc =
            cuda_err(cudaMemsetAsync(gp->one, 0, 1, gp->cs), "clearing the barrier byte", msg, cap);
    if (rc == FSDP_OK)
        rc = cuda_err(cudaEventCreateWithFlags(&gp->last_ev, cudaEventDisableTiming),
                      "creating the last event", msg, cap);
    if (rc < 0) goto fail;
    if (rank_acquire(gp) < 0) {
        snprintf(msg, cap, "out of memory");
        rc = FSDP_ENOMEM;
        goto fail;
    }
    if (pthread_create(&gp->thread, NULL, watchdog_main, gp) != 0) {
        snprintf(msg, cap, "cannot start the watchdog thread");
        rc = FSDP_ENOMEM;
        goto fail;
    }
    gp->started = 1;
    *out = gp;
    return FSDP_OK;
fail:
    if (gp->comm) ncclCommAbort(gp->comm);
    gp->comm = NULL;
    nccl_destroy(&gp->base);
    return rc;
}

static int nccl_split(fsdp_pg_t *parent, int color, const int *members, int n, int new_rank,
                      const char *name, fsdp_pg_t **out) {
    nccl_pg_t *pp = (nccl_pg_t *)parent;
    char msg[FSDP_ERR_LEN];
    const char *gname = name ? name : "(none)";
    pthread_mutex_lock(&pp->mu);
    if (pp->broken_rc < 0 || !pp->comm) {
        int rc = pp->broken_rc < 0 ? pp->broken_rc : FSDP_EINTERNAL;
        snprintf(msg, sizeof msg, "%s", pp->broken_msg);
        pthread_mutex_unlock(&pp->mu);
        return fsdp__pg_err(parent, rc, "nccl: cannot split group '%s': it failed earlier: %s",
                            parent->name, msg);
    }
    int prev = -1;
    cudaGetDevice(&prev);
    cudaSetDevice(pp->device);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclComm_t comm = NULL;
    const int64_t deadline = deadline_after(parent->timeout_ms);
    ncclResult_t r = ncclCommSplit(pp->comm, color >= 0 ? color : NCCL_SPLIT_NOCOLOR,
                                   new_rank >= 0 ? new_rank : 0, &comm, &cfg);
    if (r == ncclSuccess || r == ncclInProgress) {
        r = comm_settle(pp->comm, deadline);
        if (r == ncclSuccess && comm) r = comm_settle(comm, deadline);
    }
    pthread_mutex_unlock(&pp->mu);
    if (prev >= 0) cudaSetDevice(prev);
    if (r != ncclSuccess) {
        if (comm) ncclCommAbort(comm);
        if (r == ncclInProgress)
            return fsdp__pg_err(parent, FSDP_ETIMEDOUT,
                                "nccl: ncclCommSplit of group '%s' into '%s' (color %d) did not "
                                "complete within %lld ms: a rank of '%s' did not take part",
                                parent->name, gname, color, (long long)parent->timeout_ms,
                                parent->name);
        int rc = nccl_err(r, pp->comm, "ncclCommSplit", msg, sizeof msg);
        return fsdp__pg_err(parent, rc, "nccl: cannot create group '%s' from '%s': %s", gname,
                            parent->name, msg);
    }
    if (color < 0) return FSDP_OK;
    int *world_ranks = malloc((size_t)n * sizeof *world_ranks);
    if (!world_ranks) {
        ncclCommAbort(comm);
        return fsdp__pg_err(parent, FSDP_ENOMEM, "nccl: out of memory");
    }
    for (int i = 0; i < n; i++)
        world_ranks[i] = parent->world_ranks[members[i]];
    nccl_pg_t *gp = NULL;
    int rc = group_create(parent->ctx, comm, pp->device, name, new_rank, n, world_ranks, &gp, msg,
                          sizeof msg);
    free(world_ranks);
    if (rc < 0)
        return fsdp__pg_err(parent, rc, "nccl: cannot create group '%s' (rank %d of %d): %s", name,
                            new_rank, n, msg);
    *out = &gp->base;
    return FSDP_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Entry points (through the CUDA plugin's table, see cuda_plugin.c) */

/* fsdp_nccl_device() of fsdp/nccl.h, through the plugin's table (nccl_api.c). */
int fsdp__nccl_device(const fsdp_pg_t *pg) {
    return pg && pg->ops == &nccl_ops ? ((const nccl_pg_t *)pg)->device : -1;
}

/* The device of this rank: o->device, else $LOCAL_RANK, else rank modulo the devices. */
static int pick_device(fsdp_ctx_t *ctx, const fsdp_nccl_options_t *o, int ndev, const char **from) {
    if (o->device >= 0) {
        *from = "options.device";
        return o->device;
    }
    const char *lr = getenv("LOCAL_RANK");
    if (lr && *lr) {
        char *end = NULL;
        errno = 0;
        long v = strtol(lr, &end, 10);
        if (!errno && !*end && v >= 0 && v < 1 << 20) {
            *from = "LOCAL_RANK";
            return (int)v;
        }
    }
    *from = "rank modulo the device count";
    return ctx->rank % ndev;
}

/* fsdp_pg_create_nccl() of fsdp/nccl.h, through the plugin's table (nccl_api.c). */
int fsdp__nccl_create(fsdp_ctx_t *ctx, fsdp_store_t *store, const fsdp_nccl_options_t *o,
                      fsdp_pg_t **out) {
    if (out) *out = NULL;
    if (!ctx) return FSDP_EINVAL;
    if (!store || !out)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_pg_create_nccl: %s is NULL",
                             store ? "out" : "store");
    fsdp_nccl_options_t defaults;
    if (!o) {
        fsdp_nccl_options_init(&defaults);
        o = &defaults;
    }
    const int rank = ctx->rank, size = ctx->world_size;
    if (o->timeout_ms < 0)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_pg_create_nccl (rank %d of %d): timeout_ms %lld is negative (0 "
                             "means the default, %d ms)",
                             rank, size, (long long)o->timeout_ms, FSDP_PG_DEFAULT_TIMEOUT_MS);
    const int64_t timeout = o->timeout_ms > 0 ? o->timeout_ms : FSDP_PG_DEFAULT_TIMEOUT_MS;
    char msg[FSDP_ERR_LEN];
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev <= 0) {
        if (e != cudaSuccess) cudaGetLastError();
        return fsdp__ctx_err(ctx, FSDP_ENOTSUP,
                             "fsdp_pg_create_nccl (rank %d of %d): no CUDA device is visible "
                             "(cudaGetDeviceCount: %s); the nccl backend needs one GPU per rank",
                             rank, size, e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    }
    const char *from = "";
    const int device = pick_device(ctx, o, ndev, &from);
    if (device >= ndev)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_pg_create_nccl (rank %d of %d): device %d (from %s) does not "
                             "exist: %d CUDA device(s) are visible",
                             rank, size, device, from, ndev);

    fsdp_store_t *ws = NULL;
    int rc = fsdp__nccl_world_store(store, size, timeout, &ws, msg, sizeof msg);
    if (rc < 0)
        return fsdp__ctx_err(ctx, rc, "fsdp_pg_create_nccl (rank %d of %d): %s", rank, size, msg);
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (rank == 0) {
        ncclResult_t r = ncclGetUniqueId(&id);
        if (r != ncclSuccess) {
            rc = nccl_err(r, NULL, "ncclGetUniqueId", msg, sizeof msg);
            goto fail;
        }
    }
    rc = fsdp__nccl_id_exchange(ws, "id", rank, &id, sizeof id, msg, sizeof msg);
    if (rc < 0) goto fail;

    int prev = -1;
    cudaGetDevice(&prev);
    rc = cuda_err(cudaSetDevice(device), "selecting the device", msg, sizeof msg);
    if (rc < 0) goto fail;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclComm_t comm = NULL;
    ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &cfg);
    if ((r == ncclSuccess || r == ncclInProgress) && comm)
        r = comm_settle(comm, deadline_after(timeout));
    if (prev >= 0) cudaSetDevice(prev);
    if (r != ncclSuccess) {
        if (r == ncclInProgress) {
            snprintf(msg, sizeof msg,
                     "the communicator was not ready after %lld ms: a rank did not join",
                     (long long)timeout);
            rc = FSDP_ETIMEDOUT;
        } else {
            rc = nccl_err(r, comm, "ncclCommInitRankConfig", msg, sizeof msg);
        }
        if (comm) ncclCommAbort(comm);
        goto fail;
    }
    nccl_pg_t *gp = NULL;
    rc = group_create(ctx, comm, device, "world", rank, size, NULL, &gp, msg, sizeof msg);
    if (rc < 0) goto fail;
    fsdp_store_destroy(ws);
    fsdp_pg_set_timeout(&gp->base, timeout);
    if (!ctx->pg) fsdp__ctx_attach(ctx, &gp->base, store);
    *out = &gp->base;
    return FSDP_OK;
fail:
    fsdp_store_destroy(ws);
    return fsdp__ctx_err(ctx, rc,
                         "fsdp_pg_create_nccl (rank %d of %d, device %d from %s, timeout "
                         "%lld ms): %s",
                         rank, size, device, from, (long long)timeout, msg);
}
