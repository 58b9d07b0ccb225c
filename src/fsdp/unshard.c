/* SPDX-License-Identifier: MIT */
/*
 * unshard.c: a unit's parameters between sharded and unsharded: the cross-device copy, staging
 * the shard (the H2D copy of an offloaded shard on the copy stream, the cast to the compute
 * dtype), the all-gather into the unsharded flat parameter with the limit on outstanding
 * all-gathers, the module slots, and the reshard that frees the unsharded storage.
 *
 * Invariants: u->full has bytes iff u->unsharded; an all-gather in flight (u->ag_work, listed in
 * the root's ag_queue in issue order) writes into full, so full is not read before
 * fsdp__unshard's wait; a shard that must change device or dtype first is staged into this
 * rank's slot of full and gathered in place. Every copy between a unit's compute device and its
 * offload host goes through fsdp__xcopy or stage_shard here.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/timeutil.h"
#include "fsdp/fsdp_impl.h"
#include "nn/nn_impl.h"
#include "tensor/tensor_impl.h"

/* ---- copies ---------------------------------------------------------------------------------- */

/* dst = src (shapes equal; dtypes may differ) where the two may be on different devices: src is
 * made contiguous in dst's dtype on its own device, then copied over by the device that can
 * reach both memories (the non-host one; either for two host devices). */
int fsdp__xcopy(fsdp_tensor_t *dst, const fsdp_tensor_t *src) {
    if (dst->dev == src->dev) return fsdp_tensor_copy_(dst, src);
    int64_t n = fsdp_tensor_numel(dst);
    if (n != fsdp_tensor_numel(src) || dst->ndim != src->ndim ||
        memcmp(dst->shape, src->shape, sizeof(int64_t) * (size_t)dst->ndim) != 0) {
        char a[200], b[200];
        return fsdp__ctx_err(dst->ctx, FSDP_EINVAL,
                             "copy from %s to %s: destination %s and source %s differ in shape",
                             src->dev->name, dst->dev->name, fsdp_tensor_describe(dst, a, sizeof a),
                             fsdp_tensor_describe(src, b, sizeof b));
    }
    if (n == 0) return FSDP_OK;
    if (!dst->st->ptr || !src->st->ptr)
        return fsdp__ctx_err(dst->ctx, FSDP_EINVAL, "copy from %s to %s: a storage has been freed",
                             src->dev->name, dst->dev->name);
    fsdp_tensor_t *c = NULL, *tmp = NULL, *d = dst;
    int rc = fsdp__as_contig((fsdp_tensor_t *)src, dst->dt, &c);
    if (rc == 0 && !fsdp_tensor_is_contiguous(dst)) {
        rc = fsdp__tensor_new(dst->ctx, dst->dev, dst->dt, dst->ndim, dst->shape, FSDP_MEM_OTHER,
                              &tmp);
        d = tmp;
    }
    if (rc == 0) {
        bool sh = fsdp_device_kind(src->dev) == FSDP_DEVICE_CPU;
        bool dh = fsdp_device_kind(dst->dev) == FSDP_DEVICE_CPU;
        fsdp_copy_kind_t kind = sh && dh ? FSDP_COPY_H2H
                                : sh     ? FSDP_COPY_H2D
                                : dh     ? FSDP_COPY_D2H
                                         : FSDP_COPY_D2D;
        fsdp_device_t *via = sh || !dh ? dst->dev : src->dev;
        rc = fsdp_device_memcpy(via, fsdp_tensor_data(d), fsdp_tensor_data(c),
                                (size_t)n * fsdp_dtype_size(dst->dt), kind, NULL);
    }
    if (rc == 0 && tmp) rc = fsdp__mp_cast_shard(dst, tmp);
    fsdp_tensor_release(tmp);
    fsdp_tensor_release(c);
    return rc;
}

/* Stages the shard for the all-gather: dst (on u->dev, contiguous, in the compute dtype) = src
 * (u->flat, on the host with CPU offload), PyTorch's pre-unshard (the H2D copy of an offloaded
 * shard, the low-precision shard).
 * When the shard is in the compute device's host memory (fsdp__device_pin_offload: pinned on
 * CUDA), its bytes travel on the unit's copy stream, which first waits for the compute stream's
 * earlier work (dst's memory may have been freed by it moments ago), and the compute stream
 * waits on an event recorded after the copy: the host enqueues and goes on, the all-gather and
 * the kernels that read dst are ordered after the copy on the device. A dtype change (mixed
 * precision) then happens on the device, after the wait, through a temporary in the shard's
 * dtype. Otherwise this is fsdp__xcopy's synchronous copy. The shard itself is next written by
 * the optimizer, after the final callback has waited for the compute stream. */
static int stage_shard(fsdp_unit_t *u, fsdp_tensor_t *dst, const fsdp_tensor_t *src) {
    if (!u->host_dev || u->dev == u->host_dev || !u->host_dev->offload_ops ||
        src->dev != u->host_dev || dst->dev != u->dev || !fsdp_tensor_is_contiguous(src) ||
        !fsdp_tensor_is_contiguous(dst))
        return fsdp__xcopy(dst, src);
    int rc = fsdp__copy_stream_ready(u);
    if (rc < 0) return rc;
    fsdp_tensor_t *tmp = NULL, *land = dst;
    if (dst->dt != src->dt) {
        rc = fsdp__tensor_new(u->ctx, u->dev, src->dt, dst->ndim, dst->shape, FSDP_MEM_OTHER, &tmp);
        land = tmp;
    }
    size_t bytes = (size_t)fsdp_tensor_numel(src) * fsdp_dtype_size(src->dt);
    if (rc == 0) rc = fsdp_event_record(u->copy_ev[0], NULL);
    if (rc == 0) rc = fsdp_event_wait(u->copy_ev[0], u->copy_stream);
    if (rc == 0)
        rc = fsdp_device_memcpy(u->dev, fsdp_tensor_data(land), fsdp_tensor_data(src), bytes,
                                FSDP_COPY_H2D, u->copy_stream);
    if (rc == 0) rc = fsdp_event_record(u->copy_ev[1], u->copy_stream);
    if (rc == 0) rc = fsdp_event_wait(u->copy_ev[1], NULL);
    /* The cast runs on the compute stream after the wait; tmp's memory goes back to the compute
     * stream's pool, where every later use is ordered after the copy as well. */
    if (rc == 0 && tmp) rc = fsdp__mp_cast_shard(dst, tmp);
    fsdp_tensor_release(tmp);
    return rc;
}

/* ---- slots ----------------------------------------------------------------------------------- */

/* Points every module slot of u's parameters at the compute views (to_cv) or back at the
 * original objects. */
void fsdp__swap_slots(fsdp_unit_t *u, bool to_cv) {
    if (u->slots_swapped == to_cv) return;
    for (size_t i = 0; i < u->nslots; i++) {
        struct fsdp__slotref *s = &u->slots[i];
        struct fsdp__param *p = &u->params[s->param];
        fsdp_tensor_t *want = to_cv ? p->cv : p->orig;
        struct fsdp__slot *slot = &s->m->params[s->slot];
        if (slot->t == want) continue;
        fsdp_tensor_retain(want);
        fsdp_tensor_release(slot->t);
        slot->t = want;
    }
    u->slots_swapped = to_cv;
}

/* ---- unshard and reshard --------------------------------------------------------------------- */

static size_t full_bytes(const fsdp_unit_t *u) {
    return (size_t)u->layout.padded_numel * fsdp_dtype_size(u->cdt);
}

/* Frees u's unsharded storage. Memory from the all-gather stream's pool is first marked as used
 * by the compute stream, which read it, so that the pool hands it out again only once the
 * compute stream has passed this point; when that cannot be recorded, the compute stream is
 * synchronized instead: never reused on a guess. */
static int free_full(fsdp_unit_t *u) {
    int rc = FSDP_OK;
    void *p = fsdp_tensor_data(u->full);
    if (u->full_on_ag && p) {
        rc = fsdp__device_record_stream(u->dev, p, NULL);
        if (rc < 0) {
            rc = fsdp__unit_err(u, rc,
                                "marking the unsharded parameter as read by the compute "
                                "stream: %s",
                                fsdp_ctx_last_error(u->ctx));
            u->dev->ops->stream_sync(u->dev, NULL);
        }
    }
    u->full_on_ag = false;
    int rc2 = fsdp_tensor_storage_resize(u->full, 0);
    return rc < 0 ? rc : rc2;
}

void fsdp__unshard_free(fsdp_unit_t *u) {
    if (u->full && u->full_on_ag) free_full(u);
}

/* Removes u from the root's queue of outstanding all-gathers. */
static void ag_queue_remove(fsdp_unit_t *root, fsdp_unit_t *u) {
    for (size_t i = 0; i < root->nag; i++)
        if (root->ag_queue[i] == u) {
            memmove(&root->ag_queue[i], &root->ag_queue[i + 1],
                    (root->nag - i - 1) * sizeof root->ag_queue[0]);
            root->nag--;
            return;
        }
}

/* Waits for u's outstanding all-gather, if any. */
static int unshard_wait(fsdp_unit_t *u) {
    if (!u->ag_work) return FSDP_OK;
    fsdp__reap_tree(u);
    int rc = fsdp__unit_wait(u, u->ag_work);
    char why[FSDP_ERR_LEN];
    snprintf(why, sizeof why, "%s", rc < 0 ? fsdp__wait_error(u->pg, u->ag_work) : "");
    fsdp_work_release(u->ag_work);
    u->ag_work = NULL;
    ag_queue_remove(fsdp__root_of(u), u);
    if (rc < 0) {
        u->unsharded = false;
        free_full(u);
        return fsdp__unit_err(u, rc, "all-gather of the flat parameter failed: %s", why);
    }
    return FSDP_OK;
}

/* Starts gathering u's parameters (asynchronously); a no-op when they are unsharded or on their
 * way. Respects the limit on outstanding all-gathers. */
int fsdp__unshard_issue(fsdp_unit_t *u, bool prefetch) {
    if (u->nparams == 0 || u->unsharded) return FSDP_OK;
    if (!fsdp__separate_full(u)) {
        u->unsharded = true; /* full and flat share the storage */
        return FSDP_OK;
    }
    fsdp_unit_t *root = fsdp__root_of(u);
    int limit = u->opt.limit_all_gathers;
    /* On a device with a compute stream the waits below are stream waits and hold the host
     * back in nothing: the limit also makes the host wait until the device has passed the
     * reshard `limit` reshards ago, as PyTorch's limiter does, so that the host, and the
     * buffers it releases only once the device is done with them, stay that close. */
    while (limit > 0 && root->nfree_ev >= (size_t)limit) {
        fsdp_event_t *ev = root->free_ev[0];
        int rc = fsdp_event_sync(ev);
        fsdp_event_destroy(ev);
        root->nfree_ev--;
        memmove(root->free_ev, root->free_ev + 1, root->nfree_ev * sizeof *root->free_ev);
        if (rc < 0)
            return fsdp__unit_err(u, rc, "waiting for an earlier reshard: %s",
                                  fsdp_ctx_last_error(u->ctx));
    }
    while (limit > 0 && root->nag >= (size_t)limit) {
        int rc = unshard_wait(root->ag_queue[0]);
        if (rc < 0) return rc;
    }
    /* In an iteration on a device with stream pools, full comes from the all-gather stream's
     * pool and everything up to the collective is queued there (streams.c). */
    fsdp_stream_t *ags = fsdp__ag_stream(u);
    int rc = ags ? fsdp__tensor_storage_alloc_on(u->full, ags)
                 : fsdp_tensor_storage_resize(u->full, full_bytes(u));
    if (rc < 0)
        return fsdp__unit_err(u, rc, "cannot allocate the unsharded parameter (%zu bytes)",
                              full_bytes(u));
    u->full_on_ag = ags != NULL;
    const void *src = fsdp_tensor_data(u->flat);
    if (u->opt.cpu_offload || u->cdt != u->dt || !fsdp__is_sharded(u->opt.strategy)) {
        /* The shard goes to the device and/or to the compute dtype first (PyTorch's
         * pre-unshard: the H2D copy of an offloaded shard, the low-precision shard); an
         * unsharded strategy's full parameter is that copy (NO_SHARD with mixed precision keeps
         * full separate, also while full precision is forced). */
        if (!fsdp__is_sharded(u->opt.strategy)) {
            rc = stage_shard(u, u->full, u->flat);
            if (rc < 0) {
                free_full(u);
                return fsdp__unit_err(u, rc, "preparing the unsharded parameters failed");
            }
            u->unsharded = true;
            return FSDP_OK;
        }
        /* Staged straight into this rank's slot of the unsharded parameter, and gathered in
         * place there: no shard-sized buffer in the compute dtype besides full (PyTorch keeps
         * one, its _mp_shard). */
        fsdp_tensor_t *slot = NULL;
        rc = fsdp__view1d(u->full, (int64_t)u->rank * u->layout.shard_numel, u->layout.shard_numel,
                          &slot);
        /* On the all-gather stream the shard is on u->dev (no offload) and contiguous: the cast
         * is queued there, behind the iteration's order after the compute stream. */
        if (rc == 0 && ags)
            rc = fsdp_device_cast(u->dev, fsdp_tensor_data(slot), u->cdt, fsdp_tensor_data(u->flat),
                                  u->dt, (size_t)u->layout.shard_numel, ags);
        else if (rc == 0)
            rc = stage_shard(u, slot, u->flat);
        if (rc == 0) src = fsdp_tensor_data(slot);
        fsdp_tensor_release(slot); /* a view: full keeps the storage */
        if (rc < 0) {
            free_full(u);
            return fsdp__unit_err(u, rc, "preparing the shard for the all-gather failed");
        }
    }
    void *stream = ags ? fsdp_stream_native(ags) : NULL;
    if (!ags) rc = fsdp__side_stream(u, &stream);
    if (rc == 0) {
        fsdp_coll_desc_t d = {.kind = FSDP_COLL_ALL_GATHER,
                              .send = src,
                              .recv = fsdp_tensor_data(u->full),
                              .count = (size_t)u->layout.shard_numel,
                              .dtype = u->cdt,
                              .stream = stream};
        rc = fsdp_pg_collective(u->pg, &d, &u->ag_work);
        if (rc < 0)
            rc = fsdp__unit_err(u, rc, "all-gather of the flat parameter failed: %s",
                                fsdp_pg_last_error(u->pg));
    }
    if (rc < 0) {
        free_full(u);
        return rc;
    }
    if (root->nag == root->capag) {
        size_t cap = root->capag ? 2 * root->capag : 8;
        fsdp_unit_t **nq = realloc(root->ag_queue, cap * sizeof *nq);
        if (!nq) {
            unshard_wait(u);
            return fsdp__unit_err(u, FSDP_ENOMEM, "out of memory");
        }
        root->ag_queue = nq;
        root->capag = cap;
    }
    root->ag_queue[root->nag++] = u;
    u->unsharded = true;
    u->stats.all_gathers++;
    if (prefetch) u->stats.prefetches++;
    return FSDP_OK;
}

int fsdp__unshard(fsdp_unit_t *u) {
    int rc = fsdp__unshard_issue(u, false);
    if (rc == 0) rc = unshard_wait(u);
    return rc;
}

/* Records the point of u's reshard on the compute stream in its root's free-event queue. */
static int note_free_event(fsdp_unit_t *u) {
    fsdp_unit_t *root = fsdp__root_of(u);
    if (root->nfree_ev == root->capfree_ev) {
        size_t cap = root->capfree_ev ? 2 * root->capfree_ev : 4;
        fsdp_event_t **nq = realloc(root->free_ev, cap * sizeof *nq);
        if (!nq) return fsdp__unit_err(u, FSDP_ENOMEM, "out of memory");
        root->free_ev = nq;
        root->capfree_ev = cap;
    }
    fsdp_event_t *ev = NULL;
    int rc = fsdp_event_create(u->dev, &ev);
    if (rc == 0) rc = fsdp_event_record(ev, NULL);
    if (rc < 0) {
        fsdp_event_destroy(ev);
        return fsdp__unit_err(u, rc, "recording the reshard: %s", fsdp_ctx_last_error(u->ctx));
    }
    root->free_ev[root->nfree_ev++] = ev;
    return FSDP_OK;
}

int fsdp__reshard(fsdp_unit_t *u) {
    if (u->nparams == 0 || !u->unsharded) return FSDP_OK;
    int rc = unshard_wait(u);
    if (fsdp__separate_full(u)) {
        if (u->opt.delay_before_free_ms > 0) fsdp__sleep_ms(u->opt.delay_before_free_ms);
        int rc2 = free_full(u);
        if (rc == 0) rc = rc2;
        if (rc == 0 && u->opt.limit_all_gathers > 0 && fsdp__device_compute_stream(u->dev))
            rc = note_free_event(u);
    }
    u->unsharded = false;
    return rc;
}
