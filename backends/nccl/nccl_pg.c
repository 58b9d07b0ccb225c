/* SPDX-License-Identifier: MIT */
/*
 * nccl_pg.c: the NCCL process group: creation, posting collectives, stream waits, the rank's
 * order over its groups, destroy and sub-groups (see fsdp/nccl.h for what a user sees); the
 * enqueueing on the communication stream and the watchdog are in nccl_exec.c.
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
#include "backends/nccl/nccl_pg.h"
#include "backends/nccl/nccl_pg_impl.h"
#include "core/timeutil.h"

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
                       (fsdp__nccl_is_plain_host(c->send) || fsdp__nccl_is_plain_host(c->recv));
    pthread_mutex_lock(&gp->mu);
    while (staged && gp->head && gp->broken_rc == 0)
        pthread_cond_wait(&gp->idle, &gp->mu);
    if (gp->broken_rc < 0) {
        int rc = gp->broken_rc;
        snprintf(msg, sizeof msg, "%s", gp->broken_msg);
        pthread_mutex_unlock(&gp->mu);
        free(op);
        fsdp__nccl_describe(gp, c, who, sizeof who);
        fsdp__work_complete(w, rc, "%s was not run: the group failed earlier: %s", who, msg);
        return FSDP_OK;
    }
    int prev = -1;
    cudaGetDevice(&prev);
    if (prev != gp->device) cudaSetDevice(gp->device);
    int rc = fsdp__nccl_cuda_err(cudaEventCreateWithFlags(&op->end, cudaEventDisableTiming),
                                 "event", msg, sizeof msg);
    /* After the rank's previous collective, whatever its group; the stream orders the group's
     * own. */
    pthread_mutex_lock(&gp->rk->mu);
    nccl_pg_t *last = gp->rk->last;
    if (rc == FSDP_OK && last && last != gp)
        rc = fsdp__nccl_cuda_err(cudaStreamWaitEvent(gp->cs, last->last_ev, 0),
                                 "ordering after the rank's collective on another group", msg,
                                 sizeof msg);
    if (rc == FSDP_OK) rc = fsdp__nccl_enqueue(gp, op, &plan, msg, sizeof msg);
    if (rc == FSDP_OK)
        rc = fsdp__nccl_cuda_err(cudaEventRecord(gp->last_ev, gp->cs),
                                 "recording the group's last event", msg, sizeof msg);
    if (rc == FSDP_OK) gp->rk->last = gp;
    pthread_mutex_unlock(&gp->rk->mu);
    if (prev >= 0 && prev != gp->device) cudaSetDevice(prev);
    if (rc < 0) {
        op->fail_rc = rc;
        fsdp__nccl_describe(gp, c, who, sizeof who);
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
            rc = fsdp__nccl_cuda_err(cudaStreamWaitEvent((cudaStream_t)stream, op->end, 0),
                                     "making the stream wait for the collective's end event", msg,
                                     sizeof msg);
        break;
    }
    pthread_mutex_unlock(&gp->mu);
    if (rc < 0) {
        fsdp__nccl_describe(gp, &w->coll, who, sizeof who);
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
            r = fsdp__nccl_comm_settle(gp->comm, fsdp__nccl_deadline_after(pg->timeout_ms));
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
    rc = fsdp__nccl_cuda_err(cudaSetDevice(device), "selecting the device", msg, cap);
    if (rc == FSDP_OK)
        rc = fsdp__nccl_cuda_err(cudaStreamCreateWithFlags(&gp->cs, cudaStreamNonBlocking),
                                 "creating the communication stream", msg, cap);
    if (rc == FSDP_OK)
        rc = fsdp__nccl_cuda_err(cudaStreamCreateWithFlags(&gp->xs, cudaStreamNonBlocking),
                                 "creating the copy-back stream", msg, cap);
    if (rc == FSDP_OK)
        rc = fsdp__nccl_cuda_err(cudaMallocAsync((void **)&gp->one, 1, gp->cs),
                                 "allocating the barrier byte", msg, cap);
    if (rc == FSDP_OK)
        rc = fsdp__nccl_cuda_err(cudaMemsetAsync(gp->one, 0, 1, gp->cs),
                                 "clearing the barrier byte", msg, cap);
    if (rc == FSDP_OK)
        rc = fsdp__nccl_cuda_err(cudaEventCreateWithFlags(&gp->last_ev, cudaEventDisableTiming),
                                 "creating the last event", msg, cap);
    if (rc < 0) goto fail;
    if (rank_acquire(gp) < 0) {
        snprintf(msg, cap, "out of memory");
        rc = FSDP_ENOMEM;
        goto fail;
    }
    if (pthread_create(&gp->thread, NULL, fsdp__nccl_watchdog_main, gp) != 0) {
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
    const int64_t deadline = fsdp__nccl_deadline_after(parent->timeout_ms);
    ncclResult_t r = ncclCommSplit(pp->comm, color >= 0 ? color : NCCL_SPLIT_NOCOLOR,
                                   new_rank >= 0 ? new_rank : 0, &comm, &cfg);
    if (r == ncclSuccess || r == ncclInProgress) {
        r = fsdp__nccl_comm_settle(pp->comm, deadline);
        if (r == ncclSuccess && comm) r = fsdp__nccl_comm_settle(comm, deadline);
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
        int rc = fsdp__nccl_err(r, pp->comm, "ncclCommSplit", msg, sizeof msg);
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
    /* fsdp_pg_create_nccl (src/launch/nccl_api.c) checked the arguments
     * (fsdp__pg_check_world_args) before loading this plugin. */
    fsdp_nccl_options_t defaults;
    if (!o) {
        fsdp_nccl_options_init(&defaults);
        o = &defaults;
    }
    const int rank = ctx->rank, size = ctx->world_size;
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
            rc = fsdp__nccl_err(r, NULL, "ncclGetUniqueId", msg, sizeof msg);
            goto fail;
        }
    }
    rc = fsdp__nccl_id_exchange(ws, "id", rank, &id, sizeof id, msg, sizeof msg);
    if (rc < 0) goto fail;

    int prev = -1;
    cudaGetDevice(&prev);
    rc = fsdp__nccl_cuda_err(cudaSetDevice(device), "selecting the device", msg, sizeof msg);
    if (rc < 0) goto fail;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclComm_t comm = NULL;
    ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &cfg);
    if ((r == ncclSuccess || r == ncclInProgress) && comm)
        r = fsdp__nccl_comm_settle(comm, fsdp__nccl_deadline_after(timeout));
    if (prev >= 0) cudaSetDevice(prev);
    if (r != ncclSuccess) {
        if (r == ncclInProgress) {
            snprintf(msg, sizeof msg,
                     "the communicator was not ready after %lld ms: a rank did not join",
                     (long long)timeout);
            rc = FSDP_ETIMEDOUT;
        } else {
            rc = fsdp__nccl_err(r, comm, "ncclCommInitRankConfig", msg, sizeof msg);
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
