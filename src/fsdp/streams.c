/* SPDX-License-Identifier: MIT */
/*
 * streams.c: a unit's streams and the waits for its collectives (docs/design.md,
 * "Stream-ordered collective waits"), and the root's all-gather stream.
 *
 * On a device with a compute stream (CUDA) a unit has two streams of its own, made on first use
 * and remade when the unit moves to another device: the copy stream, on which an offloaded
 * shard travels to the device (unshard.c), and the side stream, on which the unit's collectives
 * are issued, ordered after the compute stream's work so far. A collective is then waited for on
 * the compute stream (fsdp__unit_wait), not on the host, and a buffer it read goes back only
 * once the compute stream has passed that point: fsdp__release_after lists it with an event
 * (u->deferred, oldest first) and the reapers release what the device has finished with. On a
 * device without a compute stream every wait is a host wait and buffers go back at once.
 *
 * Invariants: the deferred list is in the order its events were recorded on one stream, so once
 * one entry is pending every later one is too; an entry leaves the list right after its tensor
 * is released; every stream and event of a unit belongs to u->dev (copy_dev, side_dev say which
 * device they were made on).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp/fsdp_impl.h"
#include "tensor/tensor_impl.h"

/* ---- the copy stream ------------------------------------------------------------------------- */

static void copy_stream_drop(fsdp_unit_t *u) {
    for (int i = 0; i < 2; i++) {
        fsdp_event_destroy(u->copy_ev[i]);
        u->copy_ev[i] = NULL;
    }
    fsdp_stream_destroy(u->copy_stream);
    u->copy_stream = NULL;
    u->copy_dev = NULL;
}

int fsdp__copy_stream_ready(fsdp_unit_t *u) {
    if (u->copy_dev != u->dev) copy_stream_drop(u); /* the unit moved since the last copy */
    if (u->copy_stream) return FSDP_OK;
    int rc = fsdp_stream_create(u->dev, &u->copy_stream);
    for (int i = 0; i < 2 && rc == 0; i++)
        rc = fsdp_event_create(u->dev, &u->copy_ev[i]);
    if (rc < 0) {
        copy_stream_drop(u);
        return rc;
    }
    u->copy_dev = u->dev;
    return FSDP_OK;
}

/* ---- waits and deferred releases ------------------------------------------------------------- */

/*
 * Waits for one of u's collectives: on the compute stream when u's device has one (the host
 * goes on; the kernels queued from now on read the result in order), else on the host. After it
 * returns, a buffer the collective read may only be released through fsdp__release_after().
 */
int fsdp__unit_wait(fsdp_unit_t *u, fsdp_work_t *w) {
    void *cs = fsdp__device_compute_stream(u->dev);
    if (!cs) return fsdp_work_wait(w, -1);
    u->stream_waited = true;
    return fsdp_work_wait_stream(w, cs);
}

/* Releases u's oldest deferred buffer and its event. The entry stays listed while its tensor
 * is released (t_fsdp_stream's device checks each free against the list) and goes right after,
 * so the list never holds a released tensor. */
static void drop_first_deferred(fsdp_unit_t *u) {
    fsdp_tensor_release(u->deferred[0].t);
    fsdp_event_destroy(u->deferred[0].ev);
    u->ndeferred--;
    memmove(u->deferred, u->deferred + 1, u->ndeferred * sizeof *u->deferred);
}

/* Releases the deferred buffers of u whose event has completed (wait: after waiting for each),
 * oldest first; returns the first event failure (the rest stay listed). */
int fsdp__reap_deferred(fsdp_unit_t *u, bool wait) {
    int rc = FSDP_OK;
    while (u->ndeferred > 0) {
        struct fsdp__deferred *d = &u->deferred[0];
        int done = wait ? fsdp_event_sync(d->ev) : fsdp__event_query(d->ev);
        if (wait && done == FSDP_OK) done = 1;
        if (done < 0) rc = done;
        /* Recorded in order on one stream: once one is pending, the later ones are too. */
        if (done != 1) break;
        drop_first_deferred(u);
    }
    return rc;
}

/* At a wait of any unit: releases what the compute stream has finished with in u's whole tree,
 * so that a buffer a unit's collective read does not stay allocated until that unit's own next
 * wait while the rest of the pass runs. Non-blocking. */
void fsdp__reap_tree(fsdp_unit_t *u) {
    fsdp_unit_t *root = fsdp__root_of(u);
    if (!root->initialized) {
        fsdp__reap_deferred(u, false);
        return;
    }
    for (size_t i = 0; i < root->nall; i++)
        if (root->all[i]->ndeferred) fsdp__reap_deferred(root->all[i], false);
}

/* Releases t (may be NULL) once the compute stream has passed this point: right away without a
 * compute stream (the host waited), else through u's deferred list. When no event can be
 * recorded, the compute stream is synchronized instead: never released on a guess. */
int fsdp__release_after(fsdp_unit_t *u, fsdp_tensor_t *t) {
    if (!t) return FSDP_OK;
    if (!fsdp__device_compute_stream(u->dev)) {
        fsdp_tensor_release(t);
        return FSDP_OK;
    }
    fsdp__reap_deferred(u, false);
    fsdp_event_t *ev = NULL;
    int rc = FSDP_OK;
    if (u->ndeferred == u->capdeferred) {
        size_t cap = u->capdeferred ? 2 * u->capdeferred : 4;
        struct fsdp__deferred *nd = realloc(u->deferred, cap * sizeof *nd);
        if (nd) {
            u->deferred = nd;
            u->capdeferred = cap;
        } else {
            rc = fsdp__unit_err(u, FSDP_ENOMEM, "out of memory");
        }
    }
    if (rc == 0) rc = fsdp_event_create(u->dev, &ev);
    if (rc == 0) rc = fsdp_event_record(ev, NULL);
    if (rc == 0) {
        u->deferred[u->ndeferred++] = (struct fsdp__deferred){t, ev};
        return FSDP_OK;
    }
    fsdp_event_destroy(ev);
    /* A device that cannot even synchronize has failed: nothing runs on it any more. */
    u->dev->ops->stream_sync(u->dev, NULL);
    fsdp_tensor_release(t);
    return rc;
}

/* ---- the collectives' side stream ----------------------------------------------------------- */

static void side_drop(fsdp_unit_t *u) {
    fsdp_event_destroy(u->side_ev);
    fsdp_stream_destroy(u->side);
    u->side_ev = NULL;
    u->side = NULL;
    u->side_dev = NULL;
}

/*
 * With a compute stream, u's collectives are issued on a side stream of u's (PyTorch's
 * all-gather and reduce-scatter streams), which first waits for the compute stream's work so
 * far: what the collective reads was produced there, and the memory it writes may have been
 * freed there a moment ago. A group that makes its caller's stream wait for the collective's end
 * when it is issued (NCCL) then holds only the side stream, and the compute stream waits for the
 * end where the result is used (fsdp__unit_wait), so compute in between overlaps the collective.
 * fsdp__side_stream orders the side stream after the compute stream and gives its native
 * handle, which the collective carries in its descriptor (fsdp_coll_desc_t): the group, which
 * every unit of a tree shares, keeps no stream. Without a compute stream it gives NULL.
 */
int fsdp__side_stream(fsdp_unit_t *u, void **stream) {
    *stream = NULL;
    if (!fsdp__device_compute_stream(u->dev)) return FSDP_OK;
    int rc = FSDP_OK;
    if (u->side_dev != u->dev) side_drop(u); /* the unit moved since its last collective */
    if (!u->side) {
        rc = fsdp_stream_create(u->dev, &u->side);
        if (rc == 0) rc = fsdp_event_create(u->dev, &u->side_ev);
        if (rc < 0) {
            side_drop(u);
            return fsdp__unit_err(u, rc, "creating the collectives' stream: %s",
                                  fsdp_ctx_last_error(u->ctx));
        }
        u->side_dev = u->dev;
    }
    rc = fsdp_event_record(u->side_ev, NULL);
    if (rc == 0) rc = fsdp_event_wait(u->side_ev, u->side);
    if (rc < 0)
        return fsdp__unit_err(u, rc,
                              "ordering the collectives' stream after the compute stream: %s",
                              fsdp_ctx_last_error(u->ctx));
    *stream = fsdp_stream_native(u->side);
    return FSDP_OK;
}

/* ---- the all-gather stream ------------------------------------------------------------------ */

/*
 * The side stream waits for all the compute stream's work so far before each collective,
 * because full comes from the compute stream's pool: memory the host freed a moment ago may
 * still be read by queued kernels. So an all-gather issued at a unit's pre-forward, after the
 * host queued the previous unit's kernels, cannot start before they end, and without
 * forward_prefetch every forward all-gather is exposed. On a device that allocates per stream
 * (fsdp__device_stream_pools: CUDA, and the shape-only device), the root keeps one all-gather
 * stream for the whole tree, as PyTorch's unshard stream: full is allocated from that stream's
 * pool and its low-precision shard is cast there, so that the stream need only be ordered
 * after the compute stream once an iteration, at the root's pre-forward, where the optimizer's
 * writes to the shards are behind it. Before full is freed, its use by the compute stream is
 * recorded (fsdp__device_record_stream), so its block is handed out again only once the compute
 * stream has passed that point; the rate limiter keeps the host, and so the blocks pending,
 * within `limit` reshards of the device. Outside an iteration (summon, state dicts), with CPU
 * offload (the shard arrives on the copy stream) and for NO_SHARD, the side stream serves.
 */
static bool ag_stream_wanted(fsdp_unit_t *root) {
    if (!fsdp__device_compute_stream(root->dev) || !fsdp__device_stream_pools(root->dev))
        return false;
    return !fsdp__env_is("FSDP_AG_STREAM", "0");
}

static void ag_drop(fsdp_unit_t *root) {
    fsdp_event_destroy(root->ag_ev);
    fsdp_stream_destroy(root->ag_stream);
    root->ag_ev = NULL;
    root->ag_stream = NULL;
    root->ag_dev = NULL;
    root->ag_ordered = false;
}

int fsdp__ag_stream_begin(fsdp_unit_t *root) {
    root->ag_ordered = false;
    if (!ag_stream_wanted(root)) return FSDP_OK;
    if (root->ag_dev != root->dev) ag_drop(root); /* the tree moved since the last iteration */
    int rc = FSDP_OK;
    if (!root->ag_stream) {
        rc = fsdp_stream_create(root->dev, &root->ag_stream);
        if (rc == 0) rc = fsdp_event_create(root->dev, &root->ag_ev);
        if (rc < 0) {
            ag_drop(root);
            return fsdp__unit_err(root, rc, "creating the all-gather stream: %s",
                                  fsdp_ctx_last_error(root->ctx));
        }
        root->ag_dev = root->dev;
    }
    rc = fsdp_event_record(root->ag_ev, NULL);
    if (rc == 0) rc = fsdp_event_wait(root->ag_ev, root->ag_stream);
    if (rc < 0)
        return fsdp__unit_err(root, rc,
                              "ordering the all-gather stream after the compute stream: %s",
                              fsdp_ctx_last_error(root->ctx));
    root->ag_ordered = true;
    return FSDP_OK;
}

void fsdp__ag_stream_end(fsdp_unit_t *root) {
    root->ag_ordered = false;
}

fsdp_stream_t *fsdp__ag_stream(fsdp_unit_t *u) {
    fsdp_unit_t *root = fsdp__root_of(u);
    if (!root->ag_ordered || root->ag_dev != u->dev || u->opt.cpu_offload ||
        !fsdp__is_sharded(u->opt.strategy))
        return NULL;
    return root->ag_stream;
}

/* The message of a failed wait for w: its own failure, or another collective's of its group
 * that the wait reported (a late failure). */
const char *fsdp__wait_error(fsdp_pg_t *pg, fsdp_work_t *w) {
    const char *e = fsdp_work_error(w);
    return *e ? e : fsdp_pg_last_error(pg);
}

/* ---- teardown -------------------------------------------------------------------------------- */

void fsdp__unit_streams_free(fsdp_unit_t *u) {
    copy_stream_drop(u);
    fsdp__reap_deferred(u, true);
    while (u->ndeferred > 0) /* an event failed: the device has too */
        drop_first_deferred(u);
    free(u->deferred);
    u->deferred = NULL;
    u->capdeferred = 0;
    side_drop(u);
    ag_drop(u);
}
