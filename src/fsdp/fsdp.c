/*
 * fsdp.c: FSDP units at run time: the per-rank registry, unshard and reshard, gradients, the
 * forward/backward runtime, destroy.
 *
 * See include/fsdp/fsdp.h for the behaviour and fsdp_impl.h for the objects of a unit; units are
 * built in wrap.c, summoned and listed in summon.c. The runtime is driven by the module's hooks
 * (installed by fsdp_wrap):
 *   forward pre-hook   (root: lazy init, new iteration) unshard, slots -> compute views,
 *                      forward prefetch
 *   forward hook       slots -> original objects, reshard unless kept, record the order
 *   backward pre-hook  (the exit mark: the outputs' gradients are ready) queue the final
 *                      callback, unshard, BACKWARD_PRE prefetch, point the compute views'
 *                      gradients into a zeroed unsharded flat gradient
 *   backward hook      (the entry mark of the unit's first invocation) reshard,
 *                      BACKWARD_POST prefetch, start the gradient reduction
 *   final callback     catch-all reshard, wait for every reduction, store sharded gradients
 * Every copy between a unit's compute device and its offload host goes through fsdp__xcopy here.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp/fsdp_impl.h"
#include "nn/nn_impl.h"
#include "core/timeutil.h"
#include "tensor/tensor_impl.h"

bool fsdp__is_sharded(fsdp_sharding_strategy_t s) { return s != FSDP_NO_SHARD; }

/* Whether the unsharded flat parameter has storage of its own (gathered, then freed). */
bool fsdp__separate_full(const fsdp_unit_t *u) {
    return fsdp__is_sharded(u->opt.strategy) || u->opt.cpu_offload || u->cdt != u->dt;
}

static bool reshard_after_forward(fsdp_sharding_strategy_t s) {
    return s == FSDP_FULL_SHARD || s == FSDP_HYBRID_SHARD;
}

int fsdp__unit_err(const fsdp_unit_t *u, int rc, const char *fmt, ...) {
    char msg[FSDP_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return fsdp__ctx_err(u->ctx, rc, "FSDP unit '%s' (rank %d): %s", u->fqn[0] ? u->fqn : "<root>",
                         u->ctx->rank, msg);
}

/* ---- per-rank registry ------------------------------------------------------------------------ */

static void registry_destroy(struct fsdp__rank *r) {
    if (!r) return;
    /* Units the user did not destroy: free them without communicating (their groups are gone).
     * Children first, so no unit outlives a pointer to it. */
    for (size_t i = r->n; i-- > 0;)
        if (r->units[i].u) fsdp__unit_free(r->units[i].u);
    free(r->units);
    free(r);
}

static struct fsdp__rank *registry(fsdp_ctx_t *ctx) {
    if (!ctx->fsdp) {
        ctx->fsdp = calloc(1, sizeof *ctx->fsdp);
        ctx->fsdp_destroy = registry_destroy;
    }
    return ctx->fsdp;
}

fsdp_unit_t *fsdp_unit_of(const fsdp_module_t *m) {
    if (!m || !m->ctx || !m->ctx->fsdp) return NULL;
    struct fsdp__rank *r = m->ctx->fsdp;
    for (size_t i = 0; i < r->n; i++)
        if (r->units[i].m == m) return r->units[i].u;
    return NULL;
}

int fsdp__registry_add(fsdp_unit_t *u) {
    struct fsdp__rank *r = registry(u->ctx);
    if (!r) return fsdp__unit_err(u, FSDP_ENOMEM, "out of memory");
    if (r->n == r->cap) {
        size_t cap = r->cap ? 2 * r->cap : 16;
        struct fsdp__entry *ne = realloc(r->units, cap * sizeof *ne);
        if (!ne) return fsdp__unit_err(u, FSDP_ENOMEM, "out of memory");
        r->units = ne;
        r->cap = cap;
    }
    r->units[r->n++] = (struct fsdp__entry){u->module, u};
    return FSDP_OK;
}

static void registry_remove(fsdp_unit_t *u) {
    struct fsdp__rank *r = u->ctx->fsdp;
    if (!r) return;
    for (size_t i = 0; i < r->n; i++)
        if (r->units[i].u == u) {
            memmove(&r->units[i], &r->units[i + 1], (r->n - i - 1) * sizeof r->units[0]);
            r->n--;
            return;
        }
}

/* The unit that manages tensor t as an original parameter, or NULL. */
fsdp_unit_t *fsdp__owner_of_param(fsdp_ctx_t *ctx, const fsdp_tensor_t *t, int *index) {
    struct fsdp__rank *r = ctx->fsdp;
    for (size_t i = 0; r && i < r->n; i++) {
        fsdp_unit_t *u = r->units[i].u;
        for (int p = 0; p < u->nparams; p++)
            if (u->params[p].orig == t) {
                if (index) *index = p;
                return u;
            }
    }
    return NULL;
}

/* ---- small helpers --------------------------------------------------------------------------- */

static fsdp_unit_t *root_of(fsdp_unit_t *u) {
    while (u->parent) u = u->parent;
    return u;
}

/* t /= v in place (a contiguous float tensor), as PyTorch's div_ rounds: 16-bit floats are
 * divided in f32 and rounded once. */
static int div_inplace(fsdp_tensor_t *t, double v) {
    if (v == 1.0 || fsdp_tensor_numel(t) == 0) return FSDP_OK;
    int cdt = fsdp__compute_dtype(t->dt);
    if (cdt < 0) return fsdp__ctx_err(t->ctx, FSDP_EINVAL, "cannot divide a %s tensor",
                                     fsdp_dtype_name(t->dt));
    fsdp_tensor_t *s = NULL, *x = t;
    int rc = FSDP_OK;
    if ((fsdp_dtype_t)cdt != t->dt) rc = fsdp__as_contig(t, (fsdp_dtype_t)cdt, &x);
    if (rc == 0) rc = fsdp__tensor_new(t->ctx, t->dev, x->dt, 0, NULL, FSDP_MEM_OTHER, &s);
    if (rc == 0) rc = fsdp_tensor_fill_(s, v);
    if (rc == 0) {
        const int64_t shape[1] = {fsdp_tensor_numel(t)}, one[1] = {1}, zero[1] = {0};
        rc = t->dev->ops->binary(t->dev, x->dt, FSDP_BINARY_DIV, 1, shape, fsdp_tensor_data(x),
                                 fsdp_tensor_data(x), one, fsdp_tensor_data(s), zero);
    }
    if (rc == 0 && x != t) rc = fsdp_tensor_copy_(t, x);
    if (x != t) fsdp_tensor_release(x);
    fsdp_tensor_release(s);
    return rc;
}

/* A 1-D view of n elements of base starting at element off (relative to base's offset). */
int fsdp__view1d(fsdp_tensor_t *base, int64_t off, int64_t n, fsdp_tensor_t **out) {
    const int64_t shape[1] = {n}, stride[1] = {1};
    return fsdp__tensor_view(base, base->offset + off, 1, shape, stride, out);
}

/* ---- devices --------------------------------------------------------------------------------- */

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
    if (rc == 0 && tmp) rc = fsdp_tensor_copy_(dst, tmp);
    fsdp_tensor_release(tmp);
    fsdp_tensor_release(c);
    return rc;
}

static void copy_stream_drop(fsdp_unit_t *u) {
    for (int i = 0; i < 2; i++) {
        fsdp_event_destroy(u->copy_ev[i]);
        u->copy_ev[i] = NULL;
    }
    fsdp_stream_destroy(u->copy_stream);
    u->copy_stream = NULL;
    u->copy_dev = NULL;
}

/* The H2D copy of an offloaded shard: dst (on u->dev, contiguous) = src (u->flat on the host).
 * When the shard is in the compute device's host memory (fsdp__device_pin_offload: pinned on
 * CUDA), its bytes travel on the unit's copy stream, which first waits for the compute stream's
 * earlier work (dst's memory may have been freed by it moments ago), and the compute stream
 * waits on an event recorded after the copy: the host enqueues and goes on, the all-gather and
 * the kernels that read dst are ordered after the copy on the device. A dtype change (mixed
 * precision) then happens on the device, after the wait, through a temporary in the shard's
 * dtype. Otherwise this is fsdp__xcopy's synchronous copy. The shard itself is next written by
 * the optimizer, after the final callback has waited for the compute stream. */
static int offload_h2d(fsdp_unit_t *u, fsdp_tensor_t *dst, const fsdp_tensor_t *src) {
    if (!u->host_dev || u->dev == u->host_dev || !u->host_dev->offload_ops ||
        src->dev != u->host_dev || dst->dev != u->dev || !fsdp_tensor_is_contiguous(src) ||
        !fsdp_tensor_is_contiguous(dst))
        return fsdp__xcopy(dst, src);
    int rc = FSDP_OK;
    if (u->copy_dev != u->dev) copy_stream_drop(u); /* the unit moved since the last copy */
    if (!u->copy_stream) {
        rc = fsdp_stream_create(u->dev, &u->copy_stream);
        for (int i = 0; i < 2 && rc == 0; i++) rc = fsdp_event_create(u->dev, &u->copy_ev[i]);
        if (rc < 0) {
            copy_stream_drop(u);
            return rc;
        }
        u->copy_dev = u->dev;
    }
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
    if (rc == 0 && tmp) rc = fsdp_tensor_copy_(dst, tmp);
    fsdp_tensor_release(tmp);
    return rc;
}


/* A zeroed contiguous 1-D tensor of n elements on dev. */
int fsdp__zeros_on(fsdp_unit_t *u, fsdp_device_t *dev, fsdp_dtype_t dt, int64_t n,
                   fsdp_mem_cat_t cat, fsdp_tensor_t **out) {
    const int64_t shape[1] = {n};
    int rc = fsdp__tensor_new(u->ctx, dev, dt, 1, shape, cat, out);
    if (rc == 0) rc = fsdp_tensor_zero_(*out);
    if (rc < 0) {
        fsdp_tensor_release(*out);
        *out = NULL;
    }
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

/* ---- unshard and reshard ------------------------------------------------------------------- */

static size_t full_bytes(const fsdp_unit_t *u) {
    return (size_t)u->layout.padded_numel * fsdp_dtype_size(u->cdt);
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

/* ---- stream-ordered waits (docs/design.md, "Stream-ordered collective waits") ------------- */

/*
 * Waits for one of u's collectives: on the compute stream when u's device has one (the host
 * goes on; the kernels queued from now on read the result in order), else on the host. After it
 * returns, a buffer the collective read may only be released through release_after().
 */
static int work_wait(fsdp_unit_t *u, fsdp_work_t *w) {
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
static int reap_deferred(fsdp_unit_t *u, bool wait) {
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
 * so that a unit's staging shard does not stay allocated until that unit's own next wait (its
 * backward) while the rest of the forward runs. Non-blocking. */
static void reap_tree(fsdp_unit_t *u) {
    fsdp_unit_t *root = root_of(u);
    if (!root->initialized) {
        reap_deferred(u, false);
        return;
    }
    for (size_t i = 0; i < root->nall; i++)
        if (root->all[i]->ndeferred) reap_deferred(root->all[i], false);
}

/* Releases t (may be NULL) once the compute stream has passed this point: right away without a
 * compute stream (the host waited), else through u's deferred list. When no event can be
 * recorded, the compute stream is synchronized instead: never released on a guess. */
static int release_after(fsdp_unit_t *u, fsdp_tensor_t *t) {
    if (!t) return FSDP_OK;
    if (!fsdp__device_compute_stream(u->dev)) {
        fsdp_tensor_release(t);
        return FSDP_OK;
    }
    reap_deferred(u, false);
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
 * end where the result is used (work_wait), so compute in between overlaps the collective.
 * side_begin points pg at the side stream (the caller's stream is saved in *saved) and
 * side_end puts it back. Without a compute stream nothing changes.
 */
static int side_begin(fsdp_unit_t *u, fsdp_pg_t *pg, void **saved) {
    *saved = fsdp_pg_stream(pg);
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
        return fsdp__unit_err(u, rc, "ordering the collectives' stream after the compute stream: %s",
                              fsdp_ctx_last_error(u->ctx));
    fsdp_pg_set_stream(pg, fsdp_stream_native(u->side));
    return FSDP_OK;
}

static void side_end(fsdp_pg_t *pg, void *saved) { fsdp_pg_set_stream(pg, saved); }

/* The message of a failed wait for w: its own failure, or another collective's of its group
 * that the wait reported (a late failure). */
static const char *wait_error(fsdp_pg_t *pg, fsdp_work_t *w) {
    const char *e = fsdp_work_error(w);
    return *e ? e : fsdp_pg_last_error(pg);
}

/* Waits for u's outstanding all-gather, if any. */
static int unshard_wait(fsdp_unit_t *u) {
    if (!u->ag_work) return FSDP_OK;
    reap_tree(u);
    int rc = work_wait(u, u->ag_work);
    char why[FSDP_ERR_LEN];
    snprintf(why, sizeof why, "%s", rc < 0 ? wait_error(u->pg, u->ag_work) : "");
    fsdp_work_release(u->ag_work);
    u->ag_work = NULL;
    int rc2 = release_after(u, u->staging);
    u->staging = NULL;
    if (rc == 0 && rc2 < 0) {
        rc = rc2;
        snprintf(why, sizeof why, "releasing the staging shard: %s", fsdp_ctx_last_error(u->ctx));
    }
    ag_queue_remove(root_of(u), u);
    if (rc < 0) {
        u->unsharded = false;
        fsdp_tensor_storage_resize(u->full, 0);
        return fsdp__unit_err(u, rc, "all-gather of the flat parameter failed: %s", why);
    }
    return FSDP_OK;
}

/* Starts gathering u's parameters (asynchronously); a no-op when they are unsharded or on their
 * way. Respects the limit on outstanding all-gathers. */
static int unshard_issue(fsdp_unit_t *u, bool prefetch) {
    if (u->nparams == 0 || u->unsharded) return FSDP_OK;
    if (!fsdp__separate_full(u)) {
        u->unsharded = true; /* full and flat share the storage */
        return FSDP_OK;
    }
    fsdp_unit_t *root = root_of(u);
    int limit = u->opt.limit_all_gathers;
    while (limit > 0 && root->nag >= (size_t)limit) {
        int rc = unshard_wait(root->ag_queue[0]);
        if (rc < 0) return rc;
    }
    int rc = fsdp_tensor_storage_resize(u->full, full_bytes(u));
    if (rc < 0) return fsdp__unit_err(u, rc, "cannot allocate the unsharded parameter (%zu bytes)",
                                      full_bytes(u));
    const void *src = fsdp_tensor_data(u->flat);
    if (u->opt.cpu_offload || u->cdt != u->dt) {
        /* The shard goes to the device and/or to the compute dtype first (PyTorch's
         * pre-unshard: the H2D copy of an offloaded shard, the low-precision shard). */
        if (!fsdp__is_sharded(u->opt.strategy)) {
            rc = offload_h2d(u, u->full, u->flat);
            if (rc < 0) {
                fsdp_tensor_storage_resize(u->full, 0);
                return fsdp__unit_err(u, rc, "preparing the unsharded parameters failed");
            }
            u->unsharded = true;
            return FSDP_OK;
        }
        const int64_t n[1] = {u->layout.shard_numel};
        rc = fsdp__tensor_new(u->ctx, u->dev, u->cdt, 1, n, FSDP_MEM_PARAMS, &u->staging);
        if (rc == 0) rc = offload_h2d(u, u->staging, u->flat);
        if (rc < 0) {
            fsdp_tensor_release(u->staging);
            u->staging = NULL;
            fsdp_tensor_storage_resize(u->full, 0);
            return fsdp__unit_err(u, rc, "preparing the shard for the all-gather failed");
        }
        src = fsdp_tensor_data(u->staging);
    }
    void *saved = NULL;
    rc = side_begin(u, u->pg, &saved);
    if (rc == 0) {
        rc = fsdp_pg_all_gather(u->pg, src, fsdp_tensor_data(u->full),
                                (size_t)u->layout.shard_numel, u->cdt, &u->ag_work);
        side_end(u->pg, saved);
        if (rc < 0)
            rc = fsdp__unit_err(u, rc, "all-gather of the flat parameter failed: %s",
                                fsdp_pg_last_error(u->pg));
    }
    if (rc < 0) {
        fsdp_tensor_release(u->staging);
        u->staging = NULL;
        fsdp_tensor_storage_resize(u->full, 0);
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
    int rc = unshard_issue(u, false);
    if (rc == 0) rc = unshard_wait(u);
    return rc;
}

int fsdp__reshard(fsdp_unit_t *u) {
    if (u->nparams == 0 || !u->unsharded) return FSDP_OK;
    int rc = unshard_wait(u);
    if (fsdp__separate_full(u)) {
        if (u->opt.delay_before_free_ms > 0) fsdp__sleep_ms(u->opt.delay_before_free_ms);
        int rc2 = fsdp_tensor_storage_resize(u->full, 0);
        if (rc == 0) rc = rc2;
    }
    u->unsharded = false;
    return rc;
}

/* ---- gradients -------------------------------------------------------------------------------- */

bool fsdp__any_requires_grad(const fsdp_unit_t *u) {
    return u->flat && u->flat->requires_grad;
}

/* Before the unit's backward: a zeroed unsharded flat gradient (or the one accumulated under
 * no_sync, which backward goes on adding to), and each compute view's .grad a view into it, so
 * backward accumulates straight into the flat gradient. */
static int prepare_grads(fsdp_unit_t *u) {
    if (u->nparams == 0 || !fsdp__any_requires_grad(u) || u->full_grad) return FSDP_OK;
    int rc = FSDP_OK;
    if (u->local_grad) {
        u->full_grad = u->local_grad;
        u->local_grad = NULL;
    } else {
        rc = fsdp__zeros_on(u, u->dev, u->cdt, u->layout.padded_numel, FSDP_MEM_GRADS,
                            &u->full_grad);
        if (rc < 0) return fsdp__unit_err(u, rc, "cannot allocate the unsharded gradient");
    }
    for (int i = 0; i < u->nparams; i++) {
        struct fsdp__param *p = &u->params[i];
        if (!p->cv->requires_grad) continue;
        fsdp_tensor_t *g = NULL;
        rc = fsdp__tensor_view(u->full_grad, u->layout.offset[i], p->ndim, p->shape, NULL, &g);
        if (rc < 0) return rc;
        fsdp__contiguous_strides(p->ndim, p->shape, g->stride);
        fsdp_tensor_release(p->cv->grad);
        p->cv->grad = g;
    }
    return FSDP_OK;
}

void fsdp__drop_cv_grads(fsdp_unit_t *u) {
    for (int i = 0; i < u->nparams; i++) {
        fsdp_tensor_release(u->params[i].cv->grad);
        u->params[i].cv->grad = NULL;
    }
}

/* Starts the reduction of u's unsharded gradient (asynchronous). */
static int reduce_grad(fsdp_unit_t *u) {
    fsdp_tensor_t *g = u->full_grad;
    u->full_grad = NULL;
    fsdp__drop_cv_grads(u);
    if (!g) return FSDP_OK;
    double pre, post;
    int world = u->world * (u->replicate_pg ? fsdp_pg_size(u->replicate_pg) : 1);
    fsdp__divide_factors(world, &pre, &post);
    int rc = FSDP_OK;
    if (g->dt != u->rdt) {
        fsdp_tensor_t *c = NULL;
        rc = fsdp_to_dtype(g, u->rdt, &c);
        fsdp_tensor_release(g);
        if (rc < 0) return rc;
        g = c;
    }
    rc = div_inplace(g, pre);
    if (rc < 0) goto fail;
    if (u->opt.delay_before_reduce_ms > 0) fsdp__sleep_ms(u->opt.delay_before_reduce_ms);
    if (fsdp__is_sharded(u->opt.strategy)) {
        const int64_t n[1] = {u->layout.shard_numel};
        FSDP_TRY(rc, fail, fsdp__tensor_new(u->ctx, u->dev, u->rdt, 1, n, FSDP_MEM_GRADS,
                                            &u->rs_out));
        void *saved = NULL;
        FSDP_TRY(rc, fail, side_begin(u, u->pg, &saved));
        rc = fsdp_pg_reduce_scatter(u->pg, fsdp_tensor_data(g), fsdp_tensor_data(u->rs_out),
                                    (size_t)u->layout.shard_numel, u->rdt, FSDP_REDOP_SUM,
                                    &u->rs_work);
        side_end(u->pg, saved);
        if (rc < 0) {
            rc = fsdp__unit_err(u, rc, "gradient reduce-scatter failed: %s",
                                fsdp_pg_last_error(u->pg));
            goto fail;
        }
        u->stats.reduce_scatters++;
        if (u->replicate_pg && fsdp_pg_size(u->replicate_pg) > 1) {
            /* A rank runs its collectives in issue order, so this reads the finished shard. */
            FSDP_TRY(rc, fail, side_begin(u, u->replicate_pg, &saved));
            rc = fsdp_pg_all_reduce(u->replicate_pg, fsdp_tensor_data(u->rs_out),
                                    fsdp_tensor_data(u->rs_out), (size_t)u->layout.shard_numel,
                                    u->rdt, FSDP_REDOP_SUM, &u->ar_work);
            side_end(u->replicate_pg, saved);
            if (rc < 0) {
                rc = fsdp__unit_err(u, rc, "gradient all-reduce across replicas failed: %s",
                                    fsdp_pg_last_error(u->replicate_pg));
                goto fail;
            }
            u->stats.all_reduces++;
        }
    } else {
        u->rs_out = fsdp_tensor_retain(g);
        if (u->world > 1) {
            void *saved = NULL;
            FSDP_TRY(rc, fail, side_begin(u, u->pg, &saved));
            rc = fsdp_pg_all_reduce(u->pg, fsdp_tensor_data(g), fsdp_tensor_data(g),
                                    (size_t)u->layout.padded_numel, u->rdt, FSDP_REDOP_SUM,
                                    &u->ar_work);
            side_end(u->pg, saved);
            if (rc < 0) {
                rc = fsdp__unit_err(u, rc, "gradient all-reduce failed: %s",
                                    fsdp_pg_last_error(u->pg));
                goto fail;
            }
            u->stats.all_reduces++;
        }
    }
    u->rs_in = g;
    u->post_divide = post;
    return FSDP_OK;
fail:
    fsdp_tensor_release(g);
    return rc;
}

/* Waits for u's reduction and adds the result into the flat parameter's gradient. */
static int finish_reduction(fsdp_unit_t *u) {
    if (!u->rs_in) return FSDP_OK;
    int rc = FSDP_OK;
    reap_tree(u);
    if (u->rs_work) {
        int r = work_wait(u, u->rs_work);
        if (r < 0 && rc == 0) rc = fsdp__unit_err(u, r, "gradient reduce-scatter failed: %s",
                                                  wait_error(u->pg, u->rs_work));
        fsdp_work_release(u->rs_work);
        u->rs_work = NULL;
    }
    if (u->ar_work) {
        fsdp_pg_t *apg = u->replicate_pg && fsdp__is_sharded(u->opt.strategy) ? u->replicate_pg
                                                                               : u->pg;
        int r = work_wait(u, u->ar_work);
        if (r < 0 && rc == 0) rc = fsdp__unit_err(u, r, "gradient all-reduce failed: %s",
                                                  wait_error(apg, u->ar_work));
        fsdp_work_release(u->ar_work);
        u->ar_work = NULL;
    }
    fsdp_tensor_t *out = u->rs_out;
    u->rs_out = NULL;
    /* The reduction read rs_in on the communication stream: released after the wait's event. */
    int rc2 = release_after(u, u->rs_in);
    u->rs_in = NULL;
    if (rc == 0) rc = rc2;
    if (rc == 0) rc = div_inplace(out, u->post_divide);
    if (rc == 0 && (u->opt.cpu_offload || out->dt != u->dt)) {
        /* The reduced gradient goes to the parameters' dtype, and to the host with offload,
         * where the optimizer runs. */
        fsdp_tensor_t *h = NULL;
        const int64_t n[1] = {fsdp_tensor_numel(out)};
        rc = fsdp__tensor_new(u->ctx, u->opt.cpu_offload ? u->host_dev : u->dev, u->dt, 1, n,
                              u->opt.cpu_offload ? FSDP_MEM_OFFLOAD : FSDP_MEM_GRADS, &h);
        if (rc == 0) rc = fsdp__xcopy(h, out); /* the D2H copy of an offloaded gradient */
        fsdp_tensor_release(out);
        out = h;
    }
    if (rc == 0) {
        /* NO_SHARD reduced the unpadded flat gradient: its numel is the flat's. */
        if (!u->flat->grad) {
            u->flat->grad = fsdp_tensor_retain(out);
        } else {
            fsdp_device_t *d = u->flat->grad->dev;
            rc = d->ops->axpy(d, u->dt, (size_t)fsdp_tensor_numel(out), 1.0,
                              fsdp_tensor_data(out), fsdp_tensor_data(u->flat->grad));
        }
    }
    fsdp_tensor_release(out);
    if (rc == 0 && u->opt.use_orig_params) {
        for (int i = 0; i < u->nparams && rc == 0; i++) {
            struct fsdp__param *p = &u->params[i];
            if (!p->orig->requires_grad) continue;
            fsdp_tensor_t *g = NULL;
            rc = fsdp__view1d(u->flat->grad, p->sh.offset_in_shard, p->sh.numel_in_shard, &g);
            if (rc == 0) {
                fsdp_tensor_release(p->orig->grad);
                p->orig->grad = g;
            }
        }
    }
    return rc;
}

/* With use_orig_params the user clears gradients through the original parameters: when every
 * one of them has none (zero_grad with set_to_none), the flat gradient goes too, as in PyTorch,
 * so that nothing reads a gradient the user dropped. */
void fsdp__drop_cleared_flat_grad(fsdp_unit_t *u) {
    if (!u->opt.use_orig_params || !u->flat || !u->flat->grad) return;
    for (int p = 0; p < u->nparams; p++)
        if (u->params[p].orig->grad) return;
    fsdp_tensor_release(u->flat->grad);
    u->flat->grad = NULL;
}

/* ---- the runtime ------------------------------------------------------------------------------ */

static int push_unit(fsdp_unit_t ***arr, size_t *n, size_t *cap, fsdp_unit_t *u) {
    if (*n == *cap) {
        size_t c = *cap ? 2 * *cap : 8;
        fsdp_unit_t **na = realloc(*arr, c * sizeof *na);
        if (!na) return FSDP_ENOMEM;
        *arr = na;
        *cap = c;
    }
    (*arr)[(*n)++] = u;
    return FSDP_OK;
}

/* Pre-order list of the units of root's tree (root->all, rebuilt at lazy init). */
int fsdp__collect_units(fsdp_unit_t *u, fsdp_unit_t ***arr, size_t *n, size_t *cap) {
    int rc = push_unit(arr, n, cap, u);
    for (size_t i = 0; i < u->nchildren && rc == 0; i++)
        rc = fsdp__collect_units(u->children[i], arr, n, cap);
    return rc;
}

/* Whether m is one of the modules u was told to ignore (u keeps its own copy of the list). */
bool fsdp__unit_ignores(const fsdp_unit_t *u, const fsdp_module_t *m) {
    for (size_t i = 0; i < u->nignored; i++)
        if (u->ignored[i] == m) return true;
    return false;
}

/* Casts the floating buffers of the modules u manages (its subtree outside nested units and
 * ignored modules) to its buffer_dtype, replacing the tensors in the module slots. */
static int cast_buffers(fsdp_unit_t *u, fsdp_module_t *m, bool top) {
    const fsdp_mixed_precision_t *mp = &u->opt.mixed_precision;
    if (!mp->enabled || mp->buffer_dtype == FSDP_MP_UNSET) return FSDP_OK;
    if (!top && (fsdp_unit_of(m) || fsdp__unit_ignores(u, m))) return FSDP_OK;
    int rc = FSDP_OK;
    for (size_t i = 0; i < m->nbuffers && rc == 0; i++) {
        fsdp_tensor_t *b = m->buffers[i].t, *c = NULL;
        if (!fsdp_dtype_is_float(b->dt) || b->dt == mp->buffer_dtype) continue;
        rc = fsdp_to_dtype(b, mp->buffer_dtype, &c);
        if (rc == 0) rc = fsdp_tensor_set_name(c, fsdp_tensor_name(b));
        if (rc < 0) {
            fsdp_tensor_release(c);
            break;
        }
        fsdp_tensor_release(b);
        m->buffers[i].t = c;
    }
    for (size_t i = 0; i < m->nchildren && rc == 0; i++)
        rc = cast_buffers(u, m->children[i].m, false);
    return rc;
}

/* Parameters must stay where the unit put them (PyTorch's _check_flat_params_on_expected_device,
 * run at lazy init): a parameter moved to another device after wrapping (PyTorch's CUDA_AFTER
 * `.cuda()`) no longer views the shard, and the unit would compute with what the shard holds
 * while the user trains the moved copy. */
static int check_placement(fsdp_unit_t *u) {
    fsdp_device_t *want = u->opt.cpu_offload ? u->host_dev : u->dev;
    for (int i = 0; i < u->nparams; i++) {
        const fsdp_tensor_t *t = u->params[i].orig;
        if (t->dev == want) continue;
        if (u->opt.cpu_offload)
            return fsdp__unit_err(
                u, FSDP_EINVAL,
                "an FSDP-managed module with parameter CPU offloading enabled has "
                "parameters on %s: '%s' was moved off the host device (%s) that "
                "holds its shard after wrapping; keep offloaded modules on the host "
                "(options.device chooses the compute device)",
                fsdp_device_name(t->dev), u->params[i].fqn, fsdp_device_name(want));
        return fsdp__unit_err(
            u, FSDP_EINVAL,
            "parameter '%s' is on %s but the unit keeps it on %s: parameters must not "
            "be moved after wrapping (options.device chooses the compute device)",
            u->params[i].fqn, fsdp_device_name(t->dev), fsdp_device_name(want));
    }
    return FSDP_OK;
}

static int lazy_init(fsdp_unit_t *root) {
    if (root->initialized) return FSDP_OK;
    root->nall = 0;
    int rc = fsdp__collect_units(root, &root->all, &root->nall, &root->capall);
    if (rc < 0) return fsdp__unit_err(root, FSDP_ENOMEM, "out of memory");
    for (size_t i = 0; i < root->nall; i++) {
        fsdp_unit_t *u = root->all[i];
        u->is_root = u == root;
        if (u != root && u->opt.use_orig_params != root->opt.use_orig_params)
            return fsdp__unit_err(u, FSDP_EINVAL,
                                  "use_orig_params is %s here but %s at the root; every unit of a "
                                  "tree must use the same setting",
                                  u->opt.use_orig_params ? "on" : "off",
                                  root->opt.use_orig_params ? "on" : "off");
        if ((rc = check_placement(u)) < 0) return rc;
    }
    for (size_t i = 0; i < root->nall; i++) {
        fsdp_unit_t *u = root->all[i];
        int rc2 = cast_buffers(u, u->module, true);
        if (rc2 < 0)
            return fsdp__unit_err(u, rc2, "casting buffers to the mixed-precision buffer dtype "
                                  "failed: %s", fsdp_ctx_last_error(u->ctx));
    }
    root->initialized = true;
    return FSDP_OK;
}

/* A new iteration begins at the root's forward: undo what a failed forward may have left,
 * and with use_orig_params drop flat gradients whose original gradients were all set to none. */
static int root_pre_forward(fsdp_unit_t *root) {
    int rc = lazy_init(root);
    if (rc < 0) return rc;
    /* With an empty tape no earlier forward of this iteration can still be differentiated (its
     * graph was dropped, e.g. a validation forward): start counting invocations afresh. */
    bool fresh = fsdp_tape_size(root->ctx) == 0;
    if (fresh) root->cb_queued = false;
    for (size_t i = 0; i < root->nall; i++) {
        fsdp_unit_t *u = root->all[i];
        if (u->state == FSDP_STATE_SUMMON)
            return fsdp__unit_err(u, FSDP_EINVAL, "forward while the unit is unsharded by "
                                  "fsdp_summon_begin or fsdp_unit_unshard");
        if (fresh) {
            u->fwd_invocations = 0;
            u->needs_pre_backward = false;
            u->bwd_pending = 0;
        }
        if (u->state != FSDP_STATE_IDLE && !fsdp_in_backward(u->ctx)) {
            fsdp__swap_slots(u, false);
            u->state = FSDP_STATE_IDLE;
        }
        fsdp__drop_cleared_flat_grad(u);
    }
    root->npost = 0;
    root->nred = 0; /* a reduction left over by a failed backward is finished by the next
                     * final callback, which goes over every unit */
    root->fwd_pos = 0;
    return FSDP_OK;
}

static size_t unit_index(const fsdp_unit_t *root, const fsdp_unit_t *u) {
    for (size_t i = 0; i < root->nall; i++)
        if (root->all[i] == u) return i;
    return root->nall;
}

static const char *unit_label(const fsdp_unit_t *u) { return u->fqn[0] ? u->fqn : "<root>"; }

/*
 * Execution-order check. In the first iteration every rank tells the others which unit it is
 * about to run (one all-gather of an index over the root's group), so ranks that diverge get an
 * error naming the units instead of all-gathering each other's shards. Afterwards the order is
 * compared locally with the first iteration's: forward prefetch relies on it.
 */
static int check_order(fsdp_unit_t *root, fsdp_unit_t *u) {
    size_t k = root->fwd_pos++;
    if (root->fwd_order_done) {
        fsdp_unit_t *want = k < root->nfwd ? root->fwd_order[k] : NULL;
        if (want == u) return FSDP_OK;
        if (u->opt.forward_prefetch)
            return fsdp__unit_err(
                u, FSDP_EINVAL,
                "the forward order changed: unit #%zu of this iteration is '%s' but "
                "it was '%s' in the first iteration, and forward prefetch relies on "
                "that order (turn forward_prefetch off for dynamic graphs)",
                k, unit_label(u), want ? unit_label(want) : "(none)");
        if (!root->order_warned)
            fsdp_log(u->ctx, FSDP_LOG_WARN,
                     "FSDP: the forward order changed after the first iteration (unit #%zu is "
                     "'%s', was '%s')",
                     k, unit_label(u), want ? unit_label(want) : "(none)");
        root->order_warned = true;
        return FSDP_OK;
    }
    if (!root->opt.check_exec_order || root->world < 2) return FSDP_OK;
    int w = root->world;
    fsdp_tensor_t *t = NULL;
    const int64_t n[1] = {w};
    int rc = fsdp__tensor_new(u->ctx, root->dev, FSDP_DTYPE_I64, 1, n, FSDP_MEM_COMM, &t);
    if (rc < 0) return rc;
    int64_t mine = (int64_t)unit_index(root, u), *all = calloc((size_t)w, sizeof *all);
    if (!all) rc = fsdp__unit_err(u, FSDP_ENOMEM, "out of memory");
    if (rc == 0) {
        fsdp_tensor_t *slot = NULL;
        rc = fsdp__view1d(t, root->rank, 1, &slot);
        if (rc == 0) rc = fsdp_tensor_copy_from_host(slot, &mine, sizeof mine);
        fsdp_tensor_release(slot);
    }
    if (rc == 0) {
        char *base = fsdp_tensor_data(t);
        rc = fsdp_pg_all_gather(root->pg, base + (size_t)root->rank * sizeof(int64_t), base, 1,
                                FSDP_DTYPE_I64, NULL);
        if (rc < 0)
            rc = fsdp__unit_err(u, rc, "execution-order check: all-gather failed: %s",
                                fsdp_pg_last_error(root->pg));
    }
    if (rc == 0) rc = fsdp_tensor_to_host(t, all, (size_t)w * sizeof *all);
    for (int r = 0; r < w && rc == 0; r++) {
        if (all[r] == all[0]) continue;
        const char *a = all[0] >= 0 && (size_t)all[0] < root->nall ? unit_label(root->all[all[0]])
                                                                    : "?";
        const char *b = all[r] >= 0 && (size_t)all[r] < root->nall ? unit_label(root->all[all[r]])
                                                                    : "?";
        rc = fsdp__unit_err(
            u, FSDP_EINVAL,
            "ranks run FSDP units in different orders: as unit #%zu of the forward, "
            "rank 0 runs '%s' but rank %d runs '%s'",
            k, a, r, b);
    }
    free(all);
    fsdp_tensor_release(t);
    return rc;
}

static fsdp_unit_t *next_in_forward_order(fsdp_unit_t *root, fsdp_unit_t *u) {
    if (!root->fwd_order_done) return NULL;
    for (size_t i = 0; i + 1 < root->nfwd; i++)
        if (root->fwd_order[i] == u) return root->fwd_order[i + 1];
    return NULL;
}

/* Casts the floating tensors of t[0..n) that are not of dtype dt to dt (differentiably),
 * replacing them; what names them in messages. */
static int cast_floats(fsdp_unit_t *u, int n, fsdp_tensor_t **t, int dt, const char *what) {
    for (int i = 0; i < n; i++) {
        if (!t[i] || !fsdp_dtype_is_float(t[i]->dt) || (int)t[i]->dt == dt) continue;
        fsdp_tensor_t *c = NULL;
        int rc = fsdp_to_dtype(t[i], (fsdp_dtype_t)dt, &c);
        if (rc < 0)
            return fsdp__unit_err(u, rc, "casting forward %s %d from %s to %s failed: %s", what,
                                  i, fsdp_dtype_name(t[i]->dt), fsdp_dtype_name((fsdp_dtype_t)dt),
                                  fsdp_ctx_last_error(u->ctx));
        fsdp_tensor_release(t[i]);
        t[i] = c;
    }
    return FSDP_OK;
}

/* A unit the mixed-precision rule made full-precision (batch norm under a low-precision model):
 * remembers the dtype of its last floating input, then runs the module in the parameters' dtype
 * (upstream's _override_module_mixed_precision hooks). */
static int cast_io_inputs(fsdp_unit_t *u, int nin, fsdp_tensor_t **in) {
    u->io_dt = -1;
    for (int i = 0; i < nin; i++)
        if (in[i] && fsdp_dtype_is_float(in[i]->dt)) u->io_dt = (int)in[i]->dt;
    return cast_floats(u, nin, in, (int)u->dt, "input");
}

int fsdp__forward_pre_hook(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t **in) {
    (void)m;
    fsdp_unit_t *u = arg;
    fsdp_unit_t *root = root_of(u);
    int rc;
    if (u == root && (rc = root_pre_forward(root)) < 0) return rc;
    if (u->cast_io && (rc = cast_io_inputs(u, nin, in)) < 0) return rc;
    if (fsdp_in_backward(u->ctx)) return FSDP_OK; /* a recompute region re-running the module */
    if (u->state == FSDP_STATE_SUMMON)
        return fsdp__unit_err(u, FSDP_EINVAL, "forward while the unit is unsharded by "
                              "fsdp_summon_begin or fsdp_unit_unshard");
    u->state = FSDP_STATE_FORWARD;
    if ((rc = check_order(root, u)) < 0) return rc;
    if (u == root && u->opt.device)
        /* PyTorch's root moves inputs to the compute device (differentiable inputs are left
         * alone: this copy is not recorded). */
        for (int i = 0; i < nin; i++) {
            if (!in[i] || in[i]->dev == u->dev || in[i]->requires_grad) continue;
            fsdp_tensor_t *c = NULL;
            rc = fsdp__tensor_new(u->ctx, u->dev, in[i]->dt, in[i]->ndim, in[i]->shape,
                                  fsdp__op_cat(u->ctx), &c);
            if (rc == 0) rc = fsdp__xcopy(c, in[i]);
            if (rc < 0) {
                fsdp_tensor_release(c);
                return fsdp__unit_err(u, rc, "moving forward input %d to %s failed: %s", i,
                                      fsdp_device_name(u->dev), fsdp_ctx_last_error(u->ctx));
            }
            fsdp_tensor_release(in[i]);
            in[i] = c;
        }
    const fsdp_mixed_precision_t *mp = &u->opt.mixed_precision;
    if (mp->enabled && mp->param_dtype != FSDP_MP_UNSET &&
        ((u == root && mp->cast_root_forward_inputs) || mp->cast_forward_inputs) &&
        (rc = cast_floats(u, nin, in, (int)mp->param_dtype, "input")) < 0)
        return rc;
    if (!root->fwd_order_done && push_unit(&root->fwd_order, &root->nfwd, &root->capfwd, u) < 0)
        return fsdp__unit_err(u, FSDP_ENOMEM, "out of memory");
    if ((rc = fsdp__unshard(u)) < 0) return rc;
    fsdp__swap_slots(u, true);
    if (u->opt.forward_prefetch) {
        fsdp_unit_t *next = next_in_forward_order(root, u);
        if (next && !next->unsharded && (rc = unshard_issue(next, true)) < 0) return rc;
    }
    if (fsdp_is_grad_enabled(u->ctx) && u->nparams >= 0) {
        u->fwd_invocations++;
        u->needs_pre_backward = true;
        if (u->fwd_invocations == 1) {
            u->stats.n_pre_bwd_registered++;
            if (fsdp__any_requires_grad(u)) u->stats.n_post_bwd_registered++;
        }
    }
    return FSDP_OK;
}

int fsdp__forward_hook(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t *const *in, int nout,
                       fsdp_tensor_t **out) {
    (void)m, (void)nin, (void)in, (void)nout, (void)out;
    fsdp_unit_t *u = arg;
    fsdp_unit_t *root = root_of(u);
    int rc = FSDP_OK;
    if (u->cast_io && u->io_dt >= 0 && (rc = cast_floats(u, nout, out, u->io_dt, "output")) < 0)
        return rc;
    if (fsdp_in_backward(u->ctx)) return FSDP_OK;
    fsdp__swap_slots(u, false);
    if (u == root) root->fwd_order_done = true;
    if (push_unit(&root->post_order, &root->npost, &root->cappost, u) < 0)
        return fsdp__unit_err(u, FSDP_ENOMEM, "out of memory");
    bool grad = fsdp_is_grad_enabled(u->ctx);
    if (!grad || (u != root && reshard_after_forward(u->opt.strategy))) rc = fsdp__reshard(u);
    u->state = FSDP_STATE_IDLE;
    return rc;
}

static int final_callback(fsdp_ctx_t *ctx, void *arg);

/* The unit run just before u in the last forward (the backward prefetch target). */
static fsdp_unit_t *backward_prefetch_target(fsdp_unit_t *root, fsdp_unit_t *u) {
    for (size_t i = root->npost; i-- > 1;)
        if (root->post_order[i] == u) {
            for (size_t j = i; j-- > 0;) {
                fsdp_unit_t *t = root->post_order[j];
                if (t != u && t->needs_pre_backward && t->bwd_pending == 0) return t;
            }
            return NULL;
        }
    return NULL;
}

static int prefetch_backward(fsdp_unit_t *u) {
    fsdp_unit_t *t = backward_prefetch_target(root_of(u), u);
    if (!t || t->unsharded) return FSDP_OK;
    return unshard_issue(t, true);
}

int fsdp__backward_pre_hook(fsdp_module_t *m, void *arg, bool has_grad) {
    (void)m;
    fsdp_unit_t *u = arg;
    fsdp_unit_t *root = root_of(u);
    int rc;
    if (!root->cb_queued) {
        if ((rc = fsdp_queue_callback(u->ctx, final_callback, root)) < 0) return rc;
        root->cb_queued = true;
    }
    if (!has_grad || !u->needs_pre_backward) return FSDP_OK;
    if (u->state != FSDP_STATE_BACKWARD_PRE) {
        u->state = FSDP_STATE_BACKWARD_PRE;
        u->bwd_pending = u->fwd_invocations;
        u->stats.pre_backward_hooks++;
    }
    if ((rc = fsdp__unshard(u)) < 0) return rc;
    if (u->opt.backward_prefetch == FSDP_BACKWARD_PRE && (rc = prefetch_backward(u)) < 0)
        return rc;
    return prepare_grads(u);
}

/*
 * At most this many gradient reductions in flight per root: before another one starts, the
 * oldest is finished (waited for, its unsharded gradient freed, the result added to the sharded
 * gradient). Without a bound every unit's unsharded gradient stayed alive until the final
 * callback, so FULL_SHARD's gradient peak was the whole model's gradient and more. Two keep the
 * communication of one unit overlapping the computation of the next.
 */
#define MAX_INFLIGHT_REDUCTIONS 2

/* Queues u's reduction (just started) and finishes the oldest ones beyond the bound. */
static int track_reduction(fsdp_unit_t *u) {
    if (!u->rs_in) return FSDP_OK; /* nothing was started (no gradient) */
    fsdp_unit_t *root = root_of(u);
    if (root->nred == root->capred) {
        size_t cap = root->capred ? 2 * root->capred : 8;
        fsdp_unit_t **nq = realloc(root->red_queue, cap * sizeof *nq);
        if (!nq) return fsdp__unit_err(u, FSDP_ENOMEM, "out of memory");
        root->red_queue = nq;
        root->capred = cap;
    }
    root->red_queue[root->nred++] = u;
    int rc = FSDP_OK;
    while (rc == 0 && root->nred > MAX_INFLIGHT_REDUCTIONS) {
        rc = finish_reduction(root->red_queue[0]);
        memmove(&root->red_queue[0], &root->red_queue[1],
                (root->nred - 1) * sizeof root->red_queue[0]);
        root->nred--;
    }
    return rc;
}

static int post_backward(fsdp_unit_t *u) {
    u->state = FSDP_STATE_BACKWARD_POST;
    u->needs_pre_backward = false;
    u->bwd_pending = 0;
    int rc = FSDP_OK;
    if (fsdp__separate_full(u)) rc = fsdp__reshard(u);
    if (rc == 0 && u->opt.backward_prefetch == FSDP_BACKWARD_POST) rc = prefetch_backward(u);
    if (rc == 0 && root_of(u)->no_sync) {
        /* No reduction: the unsharded gradient stays with the unit for the next backward. */
        fsdp__drop_cv_grads(u);
        u->local_grad = u->full_grad;
        u->full_grad = NULL;
    } else {
        if (rc == 0) rc = reduce_grad(u);
        if (rc == 0) rc = track_reduction(u);
    }
    u->stats.post_backward_hooks++;
    return rc;
}

int fsdp__backward_hook(fsdp_module_t *m, void *arg, bool has_grad) {
    (void)m, (void)has_grad;
    fsdp_unit_t *u = arg;
    if (u->state != FSDP_STATE_BACKWARD_PRE) return FSDP_OK;
    if (--u->bwd_pending > 0) return FSDP_OK;
    return post_backward(u);
}

static int final_callback(fsdp_ctx_t *ctx, void *arg) {
    (void)ctx;
    fsdp_unit_t *root = arg;
    int rc = FSDP_OK;
    for (size_t i = 0; i < root->nall; i++) {
        fsdp_unit_t *u = root->all[i];
        int r = FSDP_OK;
        if (u->state == FSDP_STATE_BACKWARD_PRE) {
            r = post_backward(u); /* an entry mark that never came (should not happen) */
        } else if (u->state != FSDP_STATE_BACKWARD_POST && u->unsharded && fsdp__separate_full(u)) {
            r = fsdp__reshard(u); /* ran forward, but its outputs were not part of the loss */
        }
        if (rc == 0) rc = r;
    }
    for (size_t i = 0; i < root->nall; i++) {
        fsdp_unit_t *u = root->all[i];
        int r = finish_reduction(u);
        if (rc == 0) rc = r;
    }
    /* The end of backward is a blocking point for the collectives waited on the compute stream:
     * a failure after such a wait is reported here at the latest, and the buffers they read go
     * back. Only stream waits get here; a host that waited has nothing to synchronize. */
    for (size_t i = 0; i < root->nall; i++) {
        fsdp_unit_t *u = root->all[i];
        if (!u->stream_waited) continue;
        u->stream_waited = false;
        int r = fsdp_pg_sync(u->pg);
        if (r < 0 && rc == 0)
            rc = fsdp__unit_err(u, r, "end of backward: %s", fsdp_pg_last_error(u->pg));
        if (u->replicate_pg) {
            r = fsdp_pg_sync(u->replicate_pg);
            if (r < 0 && rc == 0)
                rc = fsdp__unit_err(u, r, "end of backward: %s",
                                    fsdp_pg_last_error(u->replicate_pg));
        }
        r = reap_deferred(u, true);
        if (r < 0 && rc == 0) rc = r;
    }
    for (size_t i = 0; i < root->nall; i++) {
        fsdp_unit_t *u = root->all[i];
        u->state = FSDP_STATE_IDLE;
        u->fwd_invocations = 0;
        u->bwd_pending = 0;
        u->needs_pre_backward = false;
        fsdp__drop_cv_grads(u);
        fsdp_tensor_release(u->full_grad);
        u->full_grad = NULL;
    }
    root->nred = 0;
    root->cb_queued = false;
    return rc;
}

/* ---- no_sync --------------------------------------------------------------------------------- */

static int no_sync_set(fsdp_unit_t *root, bool on, const char *fn) {
    if (!root) return FSDP_EINVAL;
    if (root->parent)
        return fsdp__unit_err(root, FSDP_EINVAL, "%s: not a root unit (call it on the root)", fn);
    if (root->no_sync == on)
        return fsdp__unit_err(root, FSDP_EINVAL, "%s: the tree is %s", fn,
                              on ? "already in no_sync (it does not nest)" : "not in no_sync");
    fsdp_unit_t **all = NULL;
    size_t n = 0, cap = 0;
    if (fsdp__collect_units(root, &all, &n, &cap) < 0) {
        free(all);
        return fsdp__unit_err(root, FSDP_ENOMEM, "out of memory");
    }
    int rc = FSDP_OK;
    for (size_t i = 0; i < n && rc == 0; i++) {
        fsdp_training_state_t st = all[i]->state;
        if (fsdp_in_backward(root->ctx) || st == FSDP_STATE_BACKWARD_PRE ||
            st == FSDP_STATE_BACKWARD_POST)
            rc = fsdp__unit_err(all[i], FSDP_EINVAL,
                                "%s: unit '%s' is in a backward that has not finished: begin and "
                                "end no_sync before a backward or after it",
                                fn, unit_label(all[i]));
    }
    free(all);
    if (rc == 0) root->no_sync = on;
    return rc;
}

int fsdp_no_sync_begin(fsdp_unit_t *root) { return no_sync_set(root, true, "fsdp_no_sync_begin"); }

int fsdp_no_sync_end(fsdp_unit_t *root) { return no_sync_set(root, false, "fsdp_no_sync_end"); }

bool fsdp_in_no_sync(const fsdp_unit_t *u) {
    while (u && u->parent) u = u->parent;
    return u && u->no_sync;
}

fsdp_tensor_t *fsdp_unit_local_grad(const fsdp_unit_t *u) { return u ? u->local_grad : NULL; }

/* ---- destroy --------------------------------------------------------------------------------- */

void fsdp__unit_free(fsdp_unit_t *u) {
    if (!u) return;
    fsdp_work_release(u->ag_work);
    fsdp_work_release(u->rs_work);
    fsdp_work_release(u->ar_work);
    if (u->module) {
        fsdp__swap_slots(u, false);
        for (int k = 0; k < 4; k++)
            if (u->hook_handles[k] > 0) fsdp_module_remove_hook(u->module, u->hook_handles[k]);
    }
    registry_remove(u);
    for (int i = 0; i < u->nparams; i++) {
        fsdp_tensor_release(u->params[i].orig);
        fsdp_tensor_release(u->params[i].cv);
        free(u->params[i].fqn);
    }
    free(u->params);
    free(u->slots);
    fsdp__layout_free(&u->layout);
    fsdp_tensor_release(u->flat);
    fsdp_tensor_release(u->full);
    fsdp_tensor_release(u->full_grad);
    fsdp_tensor_release(u->local_grad);
    fsdp_tensor_release(u->staging);
    copy_stream_drop(u);
    fsdp_tensor_release(u->summon_host);
    fsdp__drop_summon_views(u);
    fsdp_tensor_release(u->rs_in);
    fsdp_tensor_release(u->rs_out);
    reap_deferred(u, true);
    while (u->ndeferred > 0) /* an event failed: the device has too */
        drop_first_deferred(u);
    free(u->deferred);
    side_drop(u);
    free(u->children);
    free(u->ignored);
    free(u->all);
    free(u->fwd_order);
    free(u->post_order);
    free(u->ag_queue);
    free(u->red_queue);
    free(u->fqn);
    fsdp_module_release(u->module);
    free(u);
}

int fsdp_destroy(fsdp_unit_t *root) {
    if (!root) return FSDP_OK;
    if (root->parent)
        return fsdp__unit_err(root, FSDP_EINVAL,
                              "fsdp_destroy: not a root unit (destroy its root)");
    fsdp_unit_t **all = NULL;
    size_t n = 0, cap = 0;
    if (fsdp__collect_units(root, &all, &n, &cap) < 0) {
        free(all);
        return fsdp__unit_err(root, FSDP_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        fsdp_unit_t *u = all[i];
        if (u->ag_work) fsdp_work_wait(u->ag_work, -1);
        if (u->rs_work) fsdp_work_wait(u->rs_work, -1);
        if (u->ar_work) fsdp_work_wait(u->ar_work, -1);
    }
    for (size_t i = n; i-- > 0;) fsdp__unit_free(all[i]);
    free(all);
    return FSDP_OK;
}
