/* SPDX-License-Identifier: MIT */
/*
 * ddp.c: DistributedDataParallel, the reference the FSDP parity tests compare against: the
 * rounds (hooks, launches, the final callback) and the public calls. The semantics (buckets,
 * rounding, unused parameters, no_sync, buffers, static_graph) are in fsdp/ddp.h; creation
 * (ignore list, cross-rank check, bucket assignment, buffers) is in ddp_build.c, the structures
 * in ddp_impl.h.
 *
 * State of one synced backward ("a round"): `armed` is set by a forward run with sync and grad
 * mode on; the first grad hook (or the wrapper's tape mark) of the next backward queues the
 * final callback (`cb_queued`); hooks mark parameters ready and launch buckets in order
 * (buckets [0, next_launch) are launched); the final callback launches the rest, all-reduces
 * the used flags (not in the rounds after the first under static_graph), waits, writes the
 * averages into .grad and ends the round.
 *
 * Readiness. Without static_graph a parameter is ready at its first hook of the round. Under
 * static_graph the first round launches nothing early (it counts each parameter's hooks, as
 * PyTorch's delay_all_reduce does); in later rounds a parameter is ready when its hook has fired
 * as often as in the first round, and one whose hook never fired then is ready from the start.
 *
 * Invariants:
 *   - A launched bucket's flat buffer (and the used-flag buffer once launched) belongs to its
 *     all-reduce until the work has been waited for; nothing reads or writes it meanwhile.
 *   - A bucket's nready counts its parameters with `ready` set.
 *   - refs counts the owner's reference plus one per tape mark whose arg is the wrapper, so a
 *     mark left on a tape never sees freed memory; fsdp_ddp_destroy() frees the contents at
 *     once and the struct itself when the last reference goes.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/autograd.h>
#include <fsdp/ddp.h>

#include "fsdp/ddp_impl.h"
#include "internal.h"
#include "tensor/tensor_impl.h"

static const char *pname(const struct ddp_param *p) {
    return p->name ? p->name : "?";
}

/* ---- options --------------------------------------------------------------------------------- */

static const fsdp__abi_struct_t ddp_options_abi =
    FSDP__ABI_STRUCT(fsdp_ddp_options_t, "fsdp_ddp_options_init", static_graph);

void(fsdp_ddp_options_init)(fsdp_ddp_options_t *o, size_t size) {
    fsdp_ddp_options_t d;
    memset(&d, 0, sizeof d);
    d.bucket_cap_bytes = FSDP_DDP_DEFAULT_BUCKET_CAP_BYTES;
    d.broadcast_buffers = true;
    d.sync_module_states = true;
    d.dummy = false;
    d.first_bucket_bytes = FSDP_DDP_DEFAULT_FIRST_BUCKET_BYTES;
    d.parameters_to_ignore = NULL;
    d.num_parameters_to_ignore = 0;
    d.static_graph = false;
    fsdp__abi_init(o, size, &d, &ddp_options_abi);
}

/* Under static_graph, the rounds after the first: the used map is frozen. */
static bool frozen_round(const fsdp_ddp_t *d) {
    return d->opt.static_graph && d->frozen;
}

/* ---- one round ------------------------------------------------------------------------------- */

static int wait_all(fsdp_ddp_t *d);

/* Copies bucket b's contributions into its flat buffer and launches its all-reduce. A launch
 * refused because an earlier all-reduce already failed (the group's failure is sticky) reports
 * that earlier failure, the root cause, instead. */
static int launch(fsdp_ddp_t *d, size_t b) {
    struct ddp_bucket *bk = &d->buckets[b];
    double inv = 1.0 / (double)d->world;
    int rc = FSDP_OK;
    for (size_t j = 0; j < bk->n && rc == 0; j++) {
        struct ddp_param *p = &d->params[bk->idx[j]];
        fsdp_tensor_t *g = fsdp_tensor_grad(p->t), *scaled = NULL;
        if (p->used && g) {
            rc = fsdp_scale(g, inv, &scaled);
            if (rc == 0) rc = fsdp_tensor_copy_(p->view, scaled);
            fsdp_tensor_release(scaled);
        } else {
            rc = fsdp_tensor_zero_(p->view);
        }
        if (rc < 0)
            return fsdp__ctx_err(d->ctx, rc,
                                 "DDP (rank %d): copying the gradient of '%s' into bucket %zu "
                                 "failed: %s",
                                 d->rank, pname(p), b, fsdp_ctx_last_error(d->ctx));
    }
    if (bk->numel > 0) {
        rc = fsdp_pg_all_reduce(d->pg, fsdp_tensor_data(bk->flat), fsdp_tensor_data(bk->flat),
                                (size_t)bk->numel, bk->dt, FSDP_REDOP_SUM, &bk->work);
        if (rc < 0) {
            fsdp__ctx_err(d->ctx, rc,
                          "DDP (rank %d): launching the all-reduce of bucket %zu (%zu parameters "
                          "from '%s', %lld %s elements) failed: %s",
                          d->rank, b, bk->n, pname(&d->params[bk->idx[0]]), (long long)bk->numel,
                          fsdp_dtype_name(bk->dt), fsdp_pg_last_error(d->pg));
            int earlier = wait_all(d);
            return earlier < 0 ? earlier : rc;
        }
        d->calls++;
        d->bytes += bk->bytes;
    }
    return FSDP_OK;
}

/* Launches buckets in order while the next one is complete. */
static int launch_ready(fsdp_ddp_t *d) {
    while (d->next_launch < d->nbuckets &&
           d->buckets[d->next_launch].nready == d->buckets[d->next_launch].n) {
        int rc = launch(d, d->next_launch);
        d->next_launch++;
        if (rc < 0) return rc;
        d->early++;
    }
    return FSDP_OK;
}

/* Waits for every outstanding work of the round; returns the first failure (with its message on
 * the context) after waiting for all of them, so no buffer stays borrowed. */
static int wait_all(fsdp_ddp_t *d) {
    int first = FSDP_OK;
    for (size_t b = 0; b < d->nbuckets; b++) {
        struct ddp_bucket *bk = &d->buckets[b];
        if (!bk->work) continue;
        int rc = fsdp_work_wait(bk->work, -1);
        if (rc < 0 && first == 0)
            first = fsdp__ctx_err(d->ctx, rc,
                                  "DDP (rank %d): the all-reduce of bucket %zu (%zu parameters "
                                  "from '%s', %zu bytes) failed: %s",
                                  d->rank, b, bk->n, pname(&d->params[bk->idx[0]]), bk->bytes,
                                  fsdp_work_error(bk->work));
        fsdp_work_release(bk->work);
        bk->work = NULL;
    }
    if (d->used_work) {
        int rc = fsdp_work_wait(d->used_work, -1);
        if (rc < 0 && first == 0)
            first = fsdp__ctx_err(d->ctx, rc,
                                  "DDP (rank %d): the all-reduce of the used-parameter flags "
                                  "(%zu) failed: %s",
                                  d->rank, d->nparams, fsdp_work_error(d->used_work));
        fsdp_work_release(d->used_work);
        d->used_work = NULL;
    }
    return first;
}

/* Ends a round: ready marks and launches are forgotten. With clear_used, so are the used
 * flags (after a synced backward). */
static void end_round(fsdp_ddp_t *d, bool clear_used) {
    for (size_t b = 0; b < d->nbuckets; b++)
        d->buckets[b].nready = 0;
    for (size_t i = 0; i < d->nparams; i++) {
        struct ddp_param *p = &d->params[i];
        p->hooks = 0;
        if (clear_used) p->used = false;
        /* static_graph: a parameter without a hook in the first round is ready from the start. */
        p->ready = frozen_round(d) && p->first_hooks == 0;
        if (p->ready) d->buckets[p->bucket].nready++;
    }
    d->extra_hook = SIZE_MAX;
    d->next_launch = 0;
    d->armed = false;
    d->cb_queued = false;
}

/* Writes the reduced values back into .grad of every parameter used on some rank. */
static int write_back(fsdp_ddp_t *d, size_t *unused) {
    int rc = FSDP_OK;
    /* static_graph after the first round: used_host still holds the first round's map. */
    if (!frozen_round(d))
        rc = fsdp_tensor_to_host(d->used_flags, d->used_host, d->nparams * sizeof(int32_t));
    if (rc < 0) return rc;
    for (size_t i = 0; i < d->nparams; i++) {
        struct ddp_param *p = &d->params[i];
        if (d->used_host[i] == 0) {
            (*unused)++;
            continue;
        }
        fsdp_tensor_t *g = fsdp_tensor_grad(p->t);
        if (g) {
            rc = fsdp_tensor_copy_(g, p->view);
        } else {
            fsdp_tensor_t *c = NULL;
            rc = fsdp_tensor_clone(p->view, FSDP_MEM_GRADS, &c);
            if (rc == 0) rc = fsdp_tensor_set_grad(p->t, c);
            fsdp_tensor_release(c);
        }
        if (rc < 0)
            return fsdp__ctx_err(d->ctx, rc,
                                 "DDP (rank %d): writing the averaged gradient of '%s' failed: "
                                 "%s",
                                 d->rank, pname(p), fsdp_ctx_last_error(d->ctx));
    }
    return FSDP_OK;
}

/* Launches the all-reduce of the used flags (PyTorch's local_used_map). */
static int launch_used(fsdp_ddp_t *d) {
    for (size_t i = 0; i < d->nparams; i++)
        d->used_host[i] = d->params[i].used;
    int rc = fsdp_tensor_copy_from_host(d->used_flags, d->used_host, d->nparams * sizeof(int32_t));
    if (rc < 0) return rc;
    rc = fsdp_pg_all_reduce(d->pg, fsdp_tensor_data(d->used_flags), fsdp_tensor_data(d->used_flags),
                            d->nparams, FSDP_DTYPE_I32, FSDP_REDOP_SUM, &d->used_work);
    if (rc < 0)
        return fsdp__ctx_err(d->ctx, rc,
                             "DDP (rank %d): launching the all-reduce of the used-parameter "
                             "flags failed: %s",
                             d->rank, fsdp_pg_last_error(d->pg));
    d->calls++;
    d->bytes += d->nparams * sizeof(int32_t);
    return FSDP_OK;
}

/* static_graph: the first round's counts become the reference; a later round must repeat them.
 * Only this rank's own graph is compared (no collective): a change that makes the frozen used
 * map wrong shows on at least one rank, the one whose own use changed. */
static int static_graph_check(fsdp_ddp_t *d) {
    const char *why = NULL;
    const struct ddp_param *p = NULL;
    uint32_t now = 0;
    if (!d->frozen) {
        for (size_t i = 0; i < d->nparams; i++) {
            d->params[i].first_hooks = d->params[i].hooks;
            d->params[i].first_used = d->params[i].used;
        }
        d->frozen = true;
        return FSDP_OK;
    }
    if (d->extra_hook != SIZE_MAX) {
        p = &d->params[d->extra_hook];
        why = "more often than in";
        now = d->extra_count; /* hooks went on counting */
    }
    for (size_t i = 0; i < d->nparams && !p; i++) {
        const struct ddp_param *q = &d->params[i];
        if (q->hooks != q->first_hooks)
            why = "less often than in";
        else if (q->used != q->first_used)
            why = q->used ? "under no_sync but not before" : "not under no_sync as before";
        else
            continue;
        p = q;
        now = q->hooks;
    }
    if (!p) return FSDP_OK;
    return fsdp__ctx_err(d->ctx, FSDP_EINVAL,
                         "DDP (rank %d): static_graph: parameter '%s' received a gradient %s the "
                         "first synced backward (%u hook(s) now, %u then): the graph changed, "
                         "which static_graph does not allow; this backward joined every "
                         "collective, but the used map it applied is the first backward's, so "
                         "the gradients may be wrong",
                         d->rank, pname(p), why, now, p->first_hooks);
}

/* The final callback of a synced backward. */
static int final_cb(fsdp_ctx_t *ctx, void *arg) {
    fsdp_ddp_t *d = arg;
    int rc = FSDP_OK, grc = FSDP_OK;
    size_t unused = 0;
    (void)ctx;
    if (!d->alive || !d->armed) {
        d->cb_queued = false;
        return FSDP_OK;
    }
    if (d->world > 1 && d->nparams > 0) {
        while (d->next_launch < d->nbuckets && rc == 0)
            rc = launch(d, d->next_launch++);
        if (rc == 0 && !frozen_round(d)) rc = launch_used(d);
        int wrc = wait_all(d);
        if (rc == 0) rc = wrc;
        if (rc == 0) rc = write_back(d, &unused);
    } else {
        for (size_t i = 0; i < d->nparams; i++)
            unused += frozen_round(d) ? !d->params[i].first_used : !d->params[i].used;
    }
    if (rc == 0) {
        d->stats.synced_backwards++;
        d->stats.last_allreduce_calls = d->calls;
        d->stats.last_allreduce_bytes = d->bytes;
        d->stats.last_early_launches = d->early;
        d->stats.last_unused_params = unused;
        if (d->opt.static_graph) grc = static_graph_check(d);
    }
    d->calls = d->bytes = d->early = 0;
    end_round(d, true);
    return rc < 0 ? rc : grc;
}

static int queue_final(fsdp_ddp_t *d) {
    if (d->cb_queued) return FSDP_OK;
    int rc = fsdp_queue_callback(d->ctx, final_cb, d);
    if (rc < 0) return rc;
    d->cb_queued = true;
    return FSDP_OK;
}

static int grad_hook(fsdp_tensor_t *leaf, void *arg) {
    struct ddp_param *p = arg;
    fsdp_ddp_t *d = p->d;
    int rc;
    (void)leaf;
    p->used = true;
    if (!d->armed) return FSDP_OK; /* no_sync: accumulate locally */
    FSDP_TRY(rc, out, queue_final(d));
    if (p->hooks < UINT32_MAX) p->hooks++;
    if (d->opt.static_graph) {
        /* The first round only counts (the final callback launches everything). Later rounds:
         * ready at the first round's count; a hook beyond it is a changed graph, reported by the
         * final callback once every collective of the round has been issued. */
        if (!d->frozen || p->hooks < p->first_hooks) return FSDP_OK;
        if (p->hooks > p->first_hooks) {
            if (d->extra_hook == SIZE_MAX) {
                d->extra_hook = (size_t)(p - d->params);
                d->extra_count = p->hooks;
            }
            return FSDP_OK;
        }
    } else if (p->ready) {
        /* A second hook in one backward (the parameter is used in several recompute regions):
         * the gradient grew after it was marked ready, which is fine until the bucket left. */
        if (d->world > 1 && p->bucket < d->next_launch)
            return fsdp__ctx_err(d->ctx, FSDP_EINVAL,
                                 "DDP (rank %d): parameter '%s' received more gradient after its "
                                 "bucket %zu was all-reduced (is it used in several "
                                 "checkpointed regions?)",
                                 d->rank, pname(p), p->bucket);
        return FSDP_OK;
    }
    p->ready = true;
    d->buckets[p->bucket].nready++;
    if (d->world > 1) rc = launch_ready(d);
out:
    return rc;
}

/* The tape mark a synced forward leaves: queues the final callback even when no parameter gets
 * a gradient on this rank, so the rank still joins the round's collectives. */
static int mark_fn(fsdp_ctx_t *ctx, void *arg, bool has_grad) {
    fsdp_ddp_t *d = arg;
    (void)ctx;
    (void)has_grad;
    if (!d->alive || !d->armed) return FSDP_OK;
    return queue_final(d);
}

static void ddp_unref(fsdp_ddp_t *d) {
    if (--d->refs == 0) free(d);
}

static void mark_free(void *arg) {
    ddp_unref(arg);
}

/* A round that never reached its final callback (a backward that failed, or a graph dropped
 * after its hooks ran): wait for its works and forget it. */
static void drop_stale_round(fsdp_ddp_t *d) {
    if (!d->cb_queued) return;
    (void)wait_all(d);
    d->calls = d->bytes = d->early = 0;
    end_round(d, false);
}

/* ---- public API ------------------------------------------------------------------------------ */

static void free_contents(fsdp_ddp_t *d) {
    (void)wait_all(d);
    for (size_t i = 0; i < d->nparams; i++) {
        struct ddp_param *p = &d->params[i];
        if (p->hooked && p->t) fsdp_tensor_remove_grad_hook(p->t, grad_hook, p);
    }
    fsdp__ddp_free_build(d);
    fsdp_module_release(d->m);
    d->m = NULL;
}

void fsdp_ddp_destroy(fsdp_ddp_t *d) {
    if (!d || !d->alive) return;
    free_contents(d);
    d->alive = false;
    ddp_unref(d);
}

int fsdp_ddp_create(fsdp_module_t *m, fsdp_pg_t *pg, const fsdp_ddp_options_t *o,
                    fsdp_ddp_t **out) {
    fsdp_ctx_t *ctx = m ? fsdp_module_ctx(m) : NULL;
    fsdp_ddp_t *d = NULL;
    int rc;
    if (out) *out = NULL;
    if (!m || !out)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_ddp_create: %s is NULL",
                             !m ? "the module" : "out");
    if ((rc = fsdp__abi_check(ctx, "fsdp_ddp_create", "o", o, &ddp_options_abi)) < 0) return rc;
    d = calloc(1, sizeof *d);
    if (!d) return fsdp__ctx_err(ctx, FSDP_ENOMEM, "fsdp_ddp_create: out of memory");
    d->refs = 1;
    d->alive = true;
    d->ctx = ctx;
    d->sync = true;
    d->require_forward_param_sync = true;
    d->extra_hook = SIZE_MAX;
    fsdp_ddp_options_init(&d->opt);
    if (o) fsdp__abi_copy_in(&d->opt, o, &ddp_options_abi);
    if (d->opt.bucket_cap_bytes == 0 || d->opt.first_bucket_bytes == 0) {
        rc =
            fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_ddp_create: %s must be > 0",
                          d->opt.bucket_cap_bytes == 0 ? "bucket_cap_bytes" : "first_bucket_bytes");
        goto fail;
    }
    FSDP_TRY(rc, fail, fsdp__ddp_copy_ignore(d, o));
    if (!pg && !d->opt.dummy) pg = fsdp_ctx_pg(ctx);
    d->pg = pg;
    d->rank = pg ? fsdp_pg_rank(pg) : 0;
    d->world = pg ? fsdp_pg_size(pg) : 1;
    d->m = fsdp_module_retain(m);
    if (!d->opt.dummy) {
        FSDP_TRY(rc, fail, fsdp__ddp_build(d, grad_hook));
        for (size_t i = 0; i < d->nparams; i++) {
            FSDP_TRY(rc, fail, fsdp_tensor_add_grad_hook(d->params[i].t, grad_hook, &d->params[i]));
            d->params[i].hooked = true;
        }
    }
    d->stats.num_params = d->nparams;
    d->stats.num_buckets = d->nbuckets;
    *out = d;
    return FSDP_OK;
fail:
    free_contents(d);
    free(d);
    return rc;
}

int fsdp_ddp_forward(fsdp_ddp_t *d, int nin, fsdp_tensor_t *const *in, int nout,
                     fsdp_tensor_t **out) {
    if (!d || !d->alive)
        return fsdp__ctx_err(d ? d->ctx : NULL, FSDP_EINVAL,
                             "fsdp_ddp_forward: the wrapper is NULL or destroyed");
    fsdp_ctx_t *ctx = d->ctx;
    int rc;
    if (!d->opt.dummy && !fsdp_in_backward(ctx)) {
        drop_stale_round(d);
        if (d->world > 1 && d->opt.broadcast_buffers && d->require_forward_param_sync) {
            rc = fsdp__ddp_bcast_buffers(d);
            if (rc < 0) return rc;
        }
        if (d->sync && fsdp_is_grad_enabled(ctx)) {
            d->refs++; /* the mark's reference; mark_free drops it, even on failure */
            FSDP_TRY(rc, fail, fsdp_tape_mark(ctx, "DDP", 0, NULL, mark_fn, d, mark_free));
            d->armed = true;
            d->require_forward_param_sync = true;
        } else {
            d->require_forward_param_sync = false;
        }
    }
    return fsdp_module_forward(d->m, nin, in, nout, out);
fail:
    return rc;
}

int fsdp_ddp_forward1(fsdp_ddp_t *d, fsdp_tensor_t *x, fsdp_tensor_t **y) {
    return fsdp_ddp_forward(d, 1, &x, 1, y);
}

fsdp_module_t *fsdp_ddp_module(const fsdp_ddp_t *d) {
    return d && d->alive ? d->m : NULL;
}

fsdp_pg_t *fsdp_ddp_pg(const fsdp_ddp_t *d) {
    return d && d->alive ? d->pg : NULL;
}

int fsdp_ddp_set_sync(fsdp_ddp_t *d, bool sync) {
    if (!d || !d->alive)
        return fsdp__ctx_err(d ? d->ctx : NULL, FSDP_EINVAL,
                             "fsdp_ddp_set_sync: the wrapper is NULL or destroyed");
    d->sync = sync;
    return FSDP_OK;
}

bool fsdp_ddp_sync(const fsdp_ddp_t *d) {
    return d && d->sync;
}

int fsdp_ddp_get_stats(const fsdp_ddp_t *d, fsdp_ddp_stats_t *out) {
    if (!d || !out)
        return fsdp__ctx_err(d ? d->ctx : NULL, FSDP_EINVAL, "fsdp_ddp_get_stats: NULL argument");
    *out = d->stats;
    return FSDP_OK;
}

size_t fsdp_ddp_bucket_num_params(const fsdp_ddp_t *d, size_t b) {
    return d && d->alive && b < d->nbuckets ? d->buckets[b].n : 0;
}

size_t fsdp_ddp_bucket_bytes(const fsdp_ddp_t *d, size_t b) {
    return d && d->alive && b < d->nbuckets ? d->buckets[b].bytes : 0;
}

fsdp_tensor_t *fsdp_ddp_bucket_param(const fsdp_ddp_t *d, size_t b, size_t i, const char **name) {
    if (name) *name = NULL;
    if (!d || !d->alive || b >= d->nbuckets || i >= d->buckets[b].n) return NULL;
    const struct ddp_param *p = &d->params[d->buckets[b].idx[i]];
    if (name) *name = p->name;
    return p->t;
}
