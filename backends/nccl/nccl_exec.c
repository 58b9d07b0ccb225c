/* SPDX-License-Identifier: MIT */
/*
 * nccl_exec.c: the NCCL group at work: the one translation of CUDA's and NCCL's statuses,
 * enqueueing a collective on the group's communication stream (staging plain host buffers,
 * widening and dividing where NCCL has no such type or operator, nccl_map.h), and the watchdog
 * thread that completes the group's ops in order, copies staged results back, and aborts the
 * communicator on a timeout or failure (see nccl_pg.c for the threads and their locks).
 */
#include <cuda_runtime.h>
#include "backends/nccl/nccl_inc.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backends/nccl/nccl_kernels.h"
#include "backends/nccl/nccl_pg_impl.h"
#include "core/timeutil.h"

/* ---------------------------------------------------------------------------------------- */
/* Errors: the one place where CUDA's and NCCL's statuses become libfsdp's. */

int fsdp__nccl_cuda_err(cudaError_t e, const char *what, char *msg, size_t cap) {
    if (e == cudaSuccess) return FSDP_OK;
    snprintf(msg, cap, "%s: CUDA error %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
    return FSDP_EBACKEND;
}

int fsdp__nccl_err(ncclResult_t r, ncclComm_t comm, const char *what, char *msg, size_t cap) {
    if (r == ncclSuccess || r == ncclInProgress) return FSDP_OK;
    const char *last = ncclGetLastError(comm);
    snprintf(msg, cap, "%s: %s%s%s", what, ncclGetErrorString(r), last && *last ? ": " : "",
             last ? last : "");
    return r == ncclRemoteError || r == ncclSystemError ? FSDP_EREMOTE : FSDP_EBACKEND;
}

/* Waits until comm's pending operation (init, split, finalize, a call that returned
 * ncclInProgress) is over, at most until deadline_ns. Returns its state; ncclInProgress when the
 * deadline passed. */
ncclResult_t fsdp__nccl_comm_settle(ncclComm_t comm, int64_t deadline_ns) {
    ncclResult_t st = ncclInProgress;
    const struct timespec pause = {0, POLL_NS};
    for (;;) {
        if (ncclCommGetAsyncError(comm, &st) != ncclSuccess) return ncclInternalError;
        if (st != ncclInProgress || fsdp__now_ns() >= deadline_ns) return st;
        nanosleep(&pause, NULL);
    }
}

int64_t fsdp__nccl_deadline_after(int64_t ms) {
    return fsdp__now_ns() + ms * 1000000;
}

/* ---------------------------------------------------------------------------------------- */
/* Enqueueing */

static int has_op(fsdp_coll_kind_t k) {
    return k == FSDP_COLL_REDUCE_SCATTER || k == FSDP_COLL_ALL_REDUCE || k == FSDP_COLL_REDUCE;
}

/* 1 when p is host memory that the GPU cannot reach (plain malloc). */
int fsdp__nccl_is_plain_host(const void *p) {
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
    int sh = fsdp__nccl_is_plain_host(*send), rh = fsdp__nccl_is_plain_host(*recv);
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
    int rc = fsdp__nccl_cuda_err(cudaMallocAsync((void **)&dev, len[0] + len[1] + 1, gp->cs),
                                 "staging host buffers", msg, cap);
    if (rc < 0) return rc;
    op->stage = dev;
    for (int i = 0; i < 2; i++) {
        if (!lo[i]) continue;
        unsigned char *d = dev + (i ? len[0] : 0);
        rc = fsdp__nccl_cuda_err(cudaMemcpyAsync(d, lo[i], len[i], cudaMemcpyHostToDevice, gp->cs),
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
    if (r == ncclInProgress)
        r = fsdp__nccl_comm_settle(gp->comm, fsdp__nccl_deadline_after(timeout_ms));
    if (r == ncclInProgress) {
        snprintf(msg, cap, "%s: NCCL still had it in progress after %lld ms", what,
                 (long long)timeout_ms);
        return FSDP_ETIMEDOUT;
    }
    return fsdp__nccl_err(r, gp->comm, what, msg, cap);
}

/* A scratch buffer on the stream, freed on the stream after what follows. */
static int scratch(nccl_pg_t *gp, void **p, size_t bytes, char *msg, size_t cap) {
    return fsdp__nccl_cuda_err(cudaMallocAsync(p, bytes ? bytes : 1, gp->cs), "scratch buffer", msg,
                               cap);
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
        rc = fsdp__nccl_cuda_err((cudaError_t)fsdp__nccl_widen(send, a, in, c->dtype, gp->cs),
                                 "widening to f32", msg, cap);
        if (rc < 0) goto out;
        s = a;
        d = c->kind == FSDP_COLL_REDUCE_SCATTER ? a + (size_t)r * cnt : a;
    }
    /* A non-root's recv of reduce is not used and may be NULL: NCCL gets send there. */
    if (!d) d = (void *)s;
    /* A prescaled sum is NCCL's PreMulSum, with the factor in the (widened) type it sums in. */
    ncclRedOp_t rop = p->op;
    int premul = c->prescale != 0.0 && c->op == FSDP_REDOP_SUM;
    if (premul) {
        float f = (float)c->prescale;
        double v = c->prescale;
        void *scalar = p->type == ncclFloat64 ? (void *)&v : (void *)&f;
        rc = nccl_call(gp,
                       ncclRedOpCreatePreMulSum(&rop, scalar, p->type, ncclScalarHostImmediate,
                                                gp->comm),
                       "creating the prescaled sum", c->timeout_ms, msg, cap);
        if (rc < 0) goto out;
    }
    ncclResult_t nr;
    if (c->kind == FSDP_COLL_REDUCE_SCATTER)
        nr = ncclReduceScatter(s, d, cnt, p->type, rop, gp->comm, gp->cs);
    else if (c->kind == FSDP_COLL_ALL_REDUCE)
        nr = ncclAllReduce(s, d, cnt, p->type, rop, gp->comm, gp->cs);
    else
        nr = ncclReduce(s, d, cnt, p->type, rop, c->root, gp->comm, gp->cs);
    rc = nccl_call(gp, nr, fsdp_coll_name(c->kind), c->timeout_ms, msg, cap);
    /* NCCL lets an operator go once the calls that use it are enqueued. */
    if (premul) ncclRedOpDestroy(rop, gp->comm);
    if (rc < 0 || !to_me) goto out;
    if (p->divide) {
        rc = fsdp__nccl_cuda_err(
            (cudaError_t)fsdp__nccl_divide(d, cnt, p->widen ? FSDP_DTYPE_F32 : c->dtype, n, gp->cs),
            "avg: dividing by the group size", msg, cap);
        if (rc < 0) goto out;
    }
    if (p->widen)
        rc = fsdp__nccl_cuda_err((cudaError_t)fsdp__nccl_narrow(d, recv, cnt, c->dtype, gp->cs),
                                 "rounding f32 back", msg, cap);
out:
    if (a) cudaFreeAsync(a, gp->cs);
    return rc;
}

/* Enqueues op's collective on the communication stream between the caller's stream's events. */
int fsdp__nccl_enqueue(nccl_pg_t *gp, nccl_op_t *op, const fsdp_nccl_plan_t *plan, char *msg,
                       size_t cap) {
    const fsdp_coll_t *c = &op->w->coll;
    cudaStream_t us = (cudaStream_t)c->stream;
    cudaEvent_t start = NULL;
    int rc = fsdp__nccl_cuda_err(cudaEventCreateWithFlags(&start, cudaEventDisableTiming), "event",
                                 msg, cap);
    if (rc < 0) return rc;
    rc = fsdp__nccl_cuda_err(cudaEventRecord(start, us), "recording on the caller's stream", msg,
                             cap);
    if (rc == FSDP_OK)
        rc = fsdp__nccl_cuda_err(cudaStreamWaitEvent(gp->cs, start, 0),
                                 "ordering after the caller's stream", msg, cap);
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
    rc = fsdp__nccl_cuda_err(cudaEventRecord(op->end, gp->cs), "recording the end event", msg, cap);
    if (rc == FSDP_OK)
        rc = fsdp__nccl_cuda_err(cudaStreamWaitEvent(us, op->end, 0),
                                 "ordering the caller's stream after", msg, cap);
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
    int rc = fsdp__nccl_cuda_err(cudaMemcpyAsync(op->back_host, op->back_dev, op->back_bytes,
                                                 cudaMemcpyDeviceToHost, gp->xs),
                                 "copying the result back to host memory", msg, cap);
    if (rc == FSDP_OK)
        rc = fsdp__nccl_cuda_err(cudaStreamSynchronize(gp->xs),
                                 "copying the result back to host memory", msg, cap);
    return rc;
}

void fsdp__nccl_describe(const nccl_pg_t *gp, const fsdp_coll_t *c, char *buf, size_t cap) {
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
            fsdp__nccl_describe(gp, &w->coll, who, sizeof who);
            op_free(gp, op);
            fsdp__work_complete(w, rc, "%s did not complete: the group failed earlier: %s", who,
                                msg);
        }
    }
}

void *fsdp__nccl_watchdog_main(void *arg) {
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
                    fsdp__nccl_describe(gp, &w->coll, who, sizeof who);
                    fsdp__work_complete(w, rc, "%s failed: %s", who, msg);
                }
                pthread_mutex_lock(&gp->mu);
                continue;
            }
            fsdp__nccl_describe(gp, c, who, sizeof who);
            ncclResult_t st = ncclSuccess;
            if (e != cudaErrorNotReady) {
                char why[FSDP_ERR_LEN];
                rc = fsdp__nccl_cuda_err(e, "waiting for its end event", why, sizeof why);
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
