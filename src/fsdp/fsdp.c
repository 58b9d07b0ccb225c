/*
 * fsdp.c: FSDP units: wrapping, the forward/backward runtime, summoning, listings.
 *
 * See include/fsdp/fsdp.h for the behaviour and fsdp_impl.h for the objects of a unit. The
 * runtime is driven by the module's hooks:
 *   forward pre-hook   (root: lazy init, new iteration) unshard, slots -> compute views,
 *                      forward prefetch
 *   forward hook       slots -> original objects, reshard unless kept, record the order
 *   backward pre-hook  (the exit mark: the outputs' gradients are ready) queue the final
 *                      callback, unshard, BACKWARD_PRE prefetch, point the compute views'
 *                      gradients into a zeroed unsharded flat gradient
 *   backward hook      (the entry mark of the unit's first invocation) reshard,
 *                      BACKWARD_POST prefetch, start the gradient reduction
 *   final callback     catch-all reshard, wait for every reduction, store sharded gradients
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp/fsdp_impl.h"
#include "nn/nn_impl.h"
#include "core/timeutil.h"
#include "optim/optim_impl.h"
#include "tensor/tensor_impl.h"

static const char *const strategy_names[FSDP_SHARDING_COUNT] = {
    "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"};
static const char *const prefetch_names[FSDP_BACKWARD_PREFETCH_COUNT] = {"NONE", "BACKWARD_PRE",
                                                                         "BACKWARD_POST"};

const char *fsdp_sharding_strategy_name(fsdp_sharding_strategy_t s) {
    return (int)s >= 0 && s < FSDP_SHARDING_COUNT ? strategy_names[s] : "?";
}

const char *fsdp_backward_prefetch_name(fsdp_backward_prefetch_t p) {
    return (int)p >= 0 && p < FSDP_BACKWARD_PREFETCH_COUNT ? prefetch_names[p] : "?";
}

void fsdp_mixed_precision_init(fsdp_mixed_precision_t *mp) {
    if (!mp) return;
    *mp = (fsdp_mixed_precision_t){0};
    mp->param_dtype = mp->reduce_dtype = mp->buffer_dtype = FSDP_MP_UNSET;
    mp->cast_root_forward_inputs = true;
}

void fsdp_options_init(fsdp_options_t *o) {
    if (!o) return;
    *o = (fsdp_options_t){0};
    fsdp_mixed_precision_init(&o->mixed_precision);
    o->strategy = FSDP_FULL_SHARD;
    o->backward_prefetch = FSDP_BACKWARD_PRE;
    o->limit_all_gathers = 2;
}

static bool is_sharded(fsdp_sharding_strategy_t s) { return s != FSDP_NO_SHARD; }

/* Whether the unsharded flat parameter has storage of its own (gathered, then freed). */
static bool separate_full(const fsdp_unit_t *u) {
    return is_sharded(u->opt.strategy) || u->opt.cpu_offload || u->cdt != u->dt;
}

static bool is_hybrid(fsdp_sharding_strategy_t s) {
    return s == FSDP_HYBRID_SHARD || s == FSDP_HYBRID_SHARD_ZERO2;
}

static bool reshard_after_forward(fsdp_sharding_strategy_t s) {
    return s == FSDP_FULL_SHARD || s == FSDP_HYBRID_SHARD;
}

static int unit_err(const fsdp_unit_t *u, int rc, const char *fmt, ...) FSDP_PRINTF(3, 4);
static int unit_err(const fsdp_unit_t *u, int rc, const char *fmt, ...) {
    char msg[FSDP_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return fsdp__ctx_err(u->ctx, rc, "FSDP unit '%s' (rank %d): %s", u->fqn[0] ? u->fqn : "<root>",
                         u->ctx->rank, msg);
}

/* ---- per-rank registry ------------------------------------------------------------------------ */

static void unit_free(fsdp_unit_t *u);

static void registry_destroy(struct fsdp__rank *r) {
    if (!r) return;
    /* Units the user did not destroy: free them without communicating (their groups are gone).
     * Children first, so no unit outlives a pointer to it. */
    for (size_t i = r->n; i-- > 0;)
        if (r->units[i].u) unit_free(r->units[i].u);
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

static int registry_add(fsdp_unit_t *u) {
    struct fsdp__rank *r = registry(u->ctx);
    if (!r) return unit_err(u, FSDP_ENOMEM, "out of memory");
    if (r->n == r->cap) {
        size_t cap = r->cap ? 2 * r->cap : 16;
        struct fsdp__entry *ne = realloc(r->units, cap * sizeof *ne);
        if (!ne) return unit_err(u, FSDP_ENOMEM, "out of memory");
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
static fsdp_unit_t *owner_of_param(fsdp_ctx_t *ctx, const fsdp_tensor_t *t, int *index) {
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

static char *join_name(const char *prefix, const char *name) {
    size_t a = strlen(prefix), b = strlen(name);
    char *s = malloc(a + b + 2);
    if (!s) return NULL;
    if (a) {
        memcpy(s, prefix, a);
        s[a] = '.';
        memcpy(s + a + 1, name, b + 1);
    } else {
        memcpy(s, name, b + 1);
    }
    return s;
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
static int view1d(fsdp_tensor_t *base, int64_t off, int64_t n, fsdp_tensor_t **out) {
    const int64_t shape[1] = {n}, stride[1] = {1};
    return fsdp__tensor_view(base, base->offset + off, 1, shape, stride, out);
}

/* ---- devices --------------------------------------------------------------------------------- */

/* Points t at src's elements, taking src's device too (set_data itself keeps the device). */
static int repoint(fsdp_tensor_t *t, fsdp_tensor_t *src) {
    fsdp_device_t *was = t->dev;
    t->dev = src->dev;
    int rc = fsdp__tensor_set_data(t, src);
    if (rc < 0) t->dev = was;
    return rc;
}

/* dst = src (shapes equal; dtypes may differ) where the two may be on different devices: src is
 * made contiguous in dst's dtype on its own device, then copied over by the device that can
 * reach both memories (the non-host one; either for two host devices). */
static int xcopy(fsdp_tensor_t *dst, const fsdp_tensor_t *src) {
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

int fsdp__tensor_move(fsdp_tensor_t *t, fsdp_device_t *dev) {
    if (!t || !dev) return fsdp__ctx_err(t ? t->ctx : NULL, FSDP_EINVAL, "move: NULL argument");
    if (t->dev == dev) return FSDP_OK;
    if (dev->ctx != t->ctx)
        return fsdp__ctx_err(t->ctx, FSDP_EINVAL,
                             "moving '%s' to %s: the device belongs to another context (rank %d)",
                             fsdp_tensor_name(t), dev->name, dev->ctx ? dev->ctx->rank : -1);
    fsdp_tensor_t *c = NULL;
    int rc = fsdp__tensor_new(t->ctx, dev, t->dt, t->ndim, t->shape, t->st->cat, &c);
    if (rc == 0) rc = xcopy(c, t);
    if (rc == 0 && t->grad) rc = fsdp__tensor_move(t->grad, dev);
    if (rc == 0) rc = repoint(t, c);
    fsdp_tensor_release(c);
    return rc;
}

/* A zeroed contiguous 1-D tensor of n elements on dev. */
static int zeros_on(fsdp_unit_t *u, fsdp_device_t *dev, fsdp_dtype_t dt, int64_t n,
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

/* Where host copies of u's parameters go (summon's offload_to_cpu): the offload host, else the
 * compute device when it is a host device, else the context's own CPU device if it has one. */
static fsdp_device_t *host_device(const fsdp_unit_t *u) {
    if (u->host_dev) return u->host_dev;
    if (fsdp_device_kind(u->dev) == FSDP_DEVICE_CPU || !u->ctx->dev_owned) return u->dev;
    return u->ctx->dev_owned;
}

/* ---- slots ----------------------------------------------------------------------------------- */

/* Points every module slot of u's parameters at the compute views (to_cv) or back at the
 * original objects. */
static void swap_slots(fsdp_unit_t *u, bool to_cv) {
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

/* Waits for u's outstanding all-gather, if any. */
static int unshard_wait(fsdp_unit_t *u) {
    if (!u->ag_work) return FSDP_OK;
    int rc = fsdp_work_wait(u->ag_work, -1);
    fsdp_work_release(u->ag_work);
    u->ag_work = NULL;
    fsdp_tensor_release(u->staging);
    u->staging = NULL;
    ag_queue_remove(root_of(u), u);
    if (rc < 0) {
        u->unsharded = false;
        fsdp_tensor_storage_resize(u->full, 0);
        return unit_err(u, rc, "all-gather of the flat parameter failed: %s",
                        fsdp_ctx_last_error(u->ctx));
    }
    return FSDP_OK;
}

/* Starts gathering u's parameters (asynchronously); a no-op when they are unsharded or on their
 * way. Respects the limit on outstanding all-gathers. */
static int unshard_issue(fsdp_unit_t *u, bool prefetch) {
    if (u->nparams == 0 || u->unsharded) return FSDP_OK;
    if (!separate_full(u)) {
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
    if (rc < 0) return unit_err(u, rc, "cannot allocate the unsharded parameter (%zu bytes)",
                                full_bytes(u));
    const void *src = fsdp_tensor_data(u->flat);
    if (u->opt.cpu_offload || u->cdt != u->dt) {
        /* The shard goes to the device and/or to the compute dtype first (PyTorch's
         * pre-unshard: the H2D copy of an offloaded shard, the low-precision shard). */
        if (!is_sharded(u->opt.strategy)) {
            rc = xcopy(u->full, u->flat);
            if (rc < 0) {
                fsdp_tensor_storage_resize(u->full, 0);
                return unit_err(u, rc, "preparing the unsharded parameters failed");
            }
            u->unsharded = true;
            return FSDP_OK;
        }
        const int64_t n[1] = {u->layout.shard_numel};
        rc = fsdp__tensor_new(u->ctx, u->dev, u->cdt, 1, n, FSDP_MEM_PARAMS, &u->staging);
        if (rc == 0) rc = xcopy(u->staging, u->flat);
        if (rc < 0) {
            fsdp_tensor_release(u->staging);
            u->staging = NULL;
            fsdp_tensor_storage_resize(u->full, 0);
            return unit_err(u, rc, "preparing the shard for the all-gather failed");
        }
        src = fsdp_tensor_data(u->staging);
    }
    rc = fsdp_pg_all_gather(u->pg, src, fsdp_tensor_data(u->full),
                            (size_t)u->layout.shard_numel, u->cdt, &u->ag_work);
    if (rc < 0) {
        fsdp_tensor_release(u->staging);
        u->staging = NULL;
        fsdp_tensor_storage_resize(u->full, 0);
        return unit_err(u, rc, "all-gather of the flat parameter failed: %s",
                        fsdp_pg_last_error(u->pg));
    }
    if (root->nag == root->capag) {
        size_t cap = root->capag ? 2 * root->capag : 8;
        fsdp_unit_t **nq = realloc(root->ag_queue, cap * sizeof *nq);
        if (!nq) {
            unshard_wait(u);
            return unit_err(u, FSDP_ENOMEM, "out of memory");
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

static int unshard(fsdp_unit_t *u) {
    int rc = unshard_issue(u, false);
    if (rc == 0) rc = unshard_wait(u);
    return rc;
}

static int reshard(fsdp_unit_t *u) {
    if (u->nparams == 0 || !u->unsharded) return FSDP_OK;
    int rc = unshard_wait(u);
    if (separate_full(u)) {
        if (u->opt.delay_before_free_ms > 0) fsdp__sleep_ms(u->opt.delay_before_free_ms);
        int rc2 = fsdp_tensor_storage_resize(u->full, 0);
        if (rc == 0) rc = rc2;
    }
    u->unsharded = false;
    return rc;
}

/* ---- gradients -------------------------------------------------------------------------------- */

static bool any_requires_grad(const fsdp_unit_t *u) {
    return u->flat && u->flat->requires_grad;
}

/* Before the unit's backward: a zeroed unsharded flat gradient, and each compute view's .grad a
 * view into it, so backward accumulates straight into the flat gradient. */
static int prepare_grads(fsdp_unit_t *u) {
    if (u->nparams == 0 || !any_requires_grad(u) || u->full_grad) return FSDP_OK;
    int rc = zeros_on(u, u->dev, u->cdt, u->layout.padded_numel, FSDP_MEM_GRADS, &u->full_grad);
    if (rc < 0) return unit_err(u, rc, "cannot allocate the unsharded gradient");
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

static void drop_cv_grads(fsdp_unit_t *u) {
    for (int i = 0; i < u->nparams; i++) {
        fsdp_tensor_release(u->params[i].cv->grad);
        u->params[i].cv->grad = NULL;
    }
}

/* Starts the reduction of u's unsharded gradient (asynchronous). */
static int reduce_grad(fsdp_unit_t *u) {
    fsdp_tensor_t *g = u->full_grad;
    u->full_grad = NULL;
    drop_cv_grads(u);
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
    if (is_sharded(u->opt.strategy)) {
        const int64_t n[1] = {u->layout.shard_numel};
        FSDP_TRY(rc, fail, fsdp__tensor_new(u->ctx, u->dev, u->rdt, 1, n, FSDP_MEM_GRADS,
                                            &u->rs_out));
        rc = fsdp_pg_reduce_scatter(u->pg, fsdp_tensor_data(g), fsdp_tensor_data(u->rs_out),
                                    (size_t)u->layout.shard_numel, u->rdt, FSDP_REDOP_SUM,
                                    &u->rs_work);
        if (rc < 0) {
            rc = unit_err(u, rc, "gradient reduce-scatter failed: %s", fsdp_pg_last_error(u->pg));
            goto fail;
        }
        u->stats.reduce_scatters++;
        if (u->replicate_pg && fsdp_pg_size(u->replicate_pg) > 1) {
            /* A rank runs its collectives in issue order, so this reads the finished shard. */
            rc = fsdp_pg_all_reduce(u->replicate_pg, fsdp_tensor_data(u->rs_out),
                                    fsdp_tensor_data(u->rs_out), (size_t)u->layout.shard_numel,
                                    u->rdt, FSDP_REDOP_SUM, &u->ar_work);
            if (rc < 0) {
                rc = unit_err(u, rc, "gradient all-reduce across replicas failed: %s",
                              fsdp_pg_last_error(u->replicate_pg));
                goto fail;
            }
            u->stats.all_reduces++;
        }
    } else {
        u->rs_out = fsdp_tensor_retain(g);
        if (u->world > 1) {
            rc = fsdp_pg_all_reduce(u->pg, fsdp_tensor_data(g), fsdp_tensor_data(g),
                                    (size_t)u->layout.padded_numel, u->rdt, FSDP_REDOP_SUM,
                                    &u->ar_work);
            if (rc < 0) {
                rc = unit_err(u, rc, "gradient all-reduce failed: %s", fsdp_pg_last_error(u->pg));
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
    if (u->rs_work) {
        int r = fsdp_work_wait(u->rs_work, -1);
        if (r < 0 && rc == 0) rc = unit_err(u, r, "gradient reduce-scatter failed: %s",
                                            fsdp_work_error(u->rs_work));
        fsdp_work_release(u->rs_work);
        u->rs_work = NULL;
    }
    if (u->ar_work) {
        int r = fsdp_work_wait(u->ar_work, -1);
        if (r < 0 && rc == 0) rc = unit_err(u, r, "gradient all-reduce failed: %s",
                                            fsdp_work_error(u->ar_work));
        fsdp_work_release(u->ar_work);
        u->ar_work = NULL;
    }
    fsdp_tensor_t *out = u->rs_out;
    u->rs_out = NULL;
    fsdp_tensor_release(u->rs_in);
    u->rs_in = NULL;
    if (rc == 0) rc = div_inplace(out, u->post_divide);
    if (rc == 0 && (u->opt.cpu_offload || out->dt != u->dt)) {
        /* The reduced gradient goes to the parameters' dtype, and to the host with offload,
         * where the optimizer runs. */
        fsdp_tensor_t *h = NULL;
        const int64_t n[1] = {fsdp_tensor_numel(out)};
        rc = fsdp__tensor_new(u->ctx, u->opt.cpu_offload ? u->host_dev : u->dev, u->dt, 1, n,
                              u->opt.cpu_offload ? FSDP_MEM_OFFLOAD : FSDP_MEM_GRADS, &h);
        if (rc == 0) rc = xcopy(h, out); /* the D2H copy of an offloaded gradient */
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
            rc = view1d(u->flat->grad, p->sh.offset_in_shard, p->sh.numel_in_shard, &g);
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
static void drop_cleared_flat_grad(fsdp_unit_t *u) {
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
static int collect_units(fsdp_unit_t *u, fsdp_unit_t ***arr, size_t *n, size_t *cap) {
    int rc = push_unit(arr, n, cap, u);
    for (size_t i = 0; i < u->nchildren && rc == 0; i++)
        rc = collect_units(u->children[i], arr, n, cap);
    return rc;
}

/* Whether m is one of the modules u was told to ignore (u keeps its own copy of the list). */
static bool unit_ignores(const fsdp_unit_t *u, const fsdp_module_t *m) {
    for (size_t i = 0; i < u->nignored; i++)
        if (u->ignored[i] == m) return true;
    return false;
}

/* Casts the floating buffers of the modules u manages (its subtree outside nested units and
 * ignored modules) to its buffer_dtype, replacing the tensors in the module slots. */
static int cast_buffers(fsdp_unit_t *u, fsdp_module_t *m, bool top) {
    const fsdp_mixed_precision_t *mp = &u->opt.mixed_precision;
    if (!mp->enabled || mp->buffer_dtype == FSDP_MP_UNSET) return FSDP_OK;
    if (!top && (fsdp_unit_of(m) || unit_ignores(u, m))) return FSDP_OK;
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
            return unit_err(u, FSDP_EINVAL,
                            "an FSDP-managed module with parameter CPU offloading enabled has "
                            "parameters on %s: '%s' was moved off the host device (%s) that "
                            "holds its shard after wrapping; keep offloaded modules on the host "
                            "(options.device chooses the compute device)",
                            fsdp_device_name(t->dev), u->params[i].fqn, fsdp_device_name(want));
        return unit_err(u, FSDP_EINVAL,
                        "parameter '%s' is on %s but the unit keeps it on %s: parameters must not "
                        "be moved after wrapping (options.device chooses the compute device)",
                        u->params[i].fqn, fsdp_device_name(t->dev), fsdp_device_name(want));
    }
    return FSDP_OK;
}

static int lazy_init(fsdp_unit_t *root) {
    if (root->initialized) return FSDP_OK;
    root->nall = 0;
    int rc = collect_units(root, &root->all, &root->nall, &root->capall);
    if (rc < 0) return unit_err(root, FSDP_ENOMEM, "out of memory");
    for (size_t i = 0; i < root->nall; i++) {
        fsdp_unit_t *u = root->all[i];
        u->is_root = u == root;
        if (u != root && u->opt.use_orig_params != root->opt.use_orig_params)
            return unit_err(u, FSDP_EINVAL,
                            "use_orig_params is %s here but %s at the root; every unit of a "
                            "tree must use the same setting",
                            u->opt.use_orig_params ? "on" : "off",
                            root->opt.use_orig_params ? "on" : "off");
        if ((rc = check_placement(u)) < 0) return rc;
    }
    for (size_t i = 0; i < root->nall; i++) {
        fsdp_unit_t *u = root->all[i];
        int rc2 = cast_buffers(u, u->module, true);
        if (rc2 < 0) return unit_err(u, rc2, "casting buffers to the mixed-precision buffer dtype "
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
            return unit_err(u, FSDP_EINVAL, "forward while the unit is unsharded by "
                            "fsdp_summon_begin or fsdp_unit_unshard");
        if (fresh) {
            u->fwd_invocations = 0;
            u->needs_pre_backward = false;
            u->bwd_pending = 0;
        }
        if (u->state != FSDP_STATE_IDLE && !fsdp_in_backward(u->ctx)) {
            swap_slots(u, false);
            u->state = FSDP_STATE_IDLE;
        }
        drop_cleared_flat_grad(u);
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
            return unit_err(u, FSDP_EINVAL,
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
    if (!all) rc = unit_err(u, FSDP_ENOMEM, "out of memory");
    if (rc == 0) {
        fsdp_tensor_t *slot = NULL;
        rc = view1d(t, root->rank, 1, &slot);
        if (rc == 0) rc = fsdp_tensor_copy_from_host(slot, &mine, sizeof mine);
        fsdp_tensor_release(slot);
    }
    if (rc == 0) {
        char *base = fsdp_tensor_data(t);
        rc = fsdp_pg_all_gather(root->pg, base + (size_t)root->rank * sizeof(int64_t), base, 1,
                                FSDP_DTYPE_I64, NULL);
        if (rc < 0)
            rc = unit_err(u, rc, "execution-order check: all-gather failed: %s",
                          fsdp_pg_last_error(root->pg));
    }
    if (rc == 0) rc = fsdp_tensor_to_host(t, all, (size_t)w * sizeof *all);
    for (int r = 0; r < w && rc == 0; r++) {
        if (all[r] == all[0]) continue;
        const char *a = all[0] >= 0 && (size_t)all[0] < root->nall ? unit_label(root->all[all[0]])
                                                                    : "?";
        const char *b = all[r] >= 0 && (size_t)all[r] < root->nall ? unit_label(root->all[all[r]])
                                                                    : "?";
        rc = unit_err(u, FSDP_EINVAL,
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

static int forward_pre_hook(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t **in) {
    (void)m;
    fsdp_unit_t *u = arg;
    fsdp_unit_t *root = root_of(u);
    int rc;
    if (u == root && (rc = root_pre_forward(root)) < 0) return rc;
    if (fsdp_in_backward(u->ctx)) return FSDP_OK; /* a recompute region re-running the module */
    if (u->state == FSDP_STATE_SUMMON)
        return unit_err(u, FSDP_EINVAL, "forward while the unit is unsharded by "
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
            if (rc == 0) rc = xcopy(c, in[i]);
            if (rc < 0) {
                fsdp_tensor_release(c);
                return unit_err(u, rc, "moving forward input %d to %s failed: %s", i,
                                fsdp_device_name(u->dev), fsdp_ctx_last_error(u->ctx));
            }
            fsdp_tensor_release(in[i]);
            in[i] = c;
        }
    const fsdp_mixed_precision_t *mp = &u->opt.mixed_precision;
    if (mp->enabled && mp->param_dtype != FSDP_MP_UNSET &&
        ((u == root && mp->cast_root_forward_inputs) || mp->cast_forward_inputs))
        for (int i = 0; i < nin; i++) {
            if (!in[i] || !fsdp_dtype_is_float(in[i]->dt) || in[i]->dt == mp->param_dtype)
                continue;
            fsdp_tensor_t *c = NULL;
            if ((rc = fsdp_to_dtype(in[i], mp->param_dtype, &c)) < 0) return rc;
            fsdp_tensor_release(in[i]);
            in[i] = c;
        }
    if (!root->fwd_order_done && push_unit(&root->fwd_order, &root->nfwd, &root->capfwd, u) < 0)
        return unit_err(u, FSDP_ENOMEM, "out of memory");
    if ((rc = unshard(u)) < 0) return rc;
    swap_slots(u, true);
    if (u->opt.forward_prefetch) {
        fsdp_unit_t *next = next_in_forward_order(root, u);
        if (next && !next->unsharded && (rc = unshard_issue(next, true)) < 0) return rc;
    }
    if (fsdp_is_grad_enabled(u->ctx) && u->nparams >= 0) {
        u->fwd_invocations++;
        u->needs_pre_backward = true;
        if (u->fwd_invocations == 1) {
            u->stats.n_pre_bwd_registered++;
            if (any_requires_grad(u)) u->stats.n_post_bwd_registered++;
        }
    }
    return FSDP_OK;
}

static int forward_hook(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t *const *in, int nout,
                        fsdp_tensor_t **out) {
    (void)m, (void)nin, (void)in, (void)nout, (void)out;
    fsdp_unit_t *u = arg;
    fsdp_unit_t *root = root_of(u);
    if (fsdp_in_backward(u->ctx)) return FSDP_OK;
    swap_slots(u, false);
    if (u == root) root->fwd_order_done = true;
    if (push_unit(&root->post_order, &root->npost, &root->cappost, u) < 0)
        return unit_err(u, FSDP_ENOMEM, "out of memory");
    bool grad = fsdp_is_grad_enabled(u->ctx);
    int rc = FSDP_OK;
    if (!grad || (u != root && reshard_after_forward(u->opt.strategy))) rc = reshard(u);
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

static int backward_pre_hook(fsdp_module_t *m, void *arg, bool has_grad) {
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
    if ((rc = unshard(u)) < 0) return rc;
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
        if (!nq) return unit_err(u, FSDP_ENOMEM, "out of memory");
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
    if (separate_full(u)) rc = reshard(u);
    if (rc == 0 && u->opt.backward_prefetch == FSDP_BACKWARD_POST) rc = prefetch_backward(u);
    if (rc == 0) rc = reduce_grad(u);
    if (rc == 0) rc = track_reduction(u);
    u->stats.post_backward_hooks++;
    return rc;
}

static int backward_hook(fsdp_module_t *m, void *arg, bool has_grad) {
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
        } else if (u->state != FSDP_STATE_BACKWARD_POST && u->unsharded && separate_full(u)) {
            r = reshard(u); /* ran forward, but its outputs were not part of the loss */
        }
        if (rc == 0) rc = r;
    }
    for (size_t i = 0; i < root->nall; i++) {
        fsdp_unit_t *u = root->all[i];
        int r = finish_reduction(u);
        if (rc == 0) rc = r;
        u->state = FSDP_STATE_IDLE;
        u->fwd_invocations = 0;
        u->bwd_pending = 0;
        u->needs_pre_backward = false;
        drop_cv_grads(u);
        fsdp_tensor_release(u->full_grad);
        u->full_grad = NULL;
    }
    root->nred = 0;
    root->cb_queued = false;
    return rc;
}

/* ---- wrapping -------------------------------------------------------------------------------- */

struct collect {
    fsdp_unit_t *u;
    const fsdp_options_t *o;
    size_t capparams, capslots;
    int rc;
};

static bool is_ignored(const fsdp_options_t *o, const fsdp_module_t *m) {
    for (size_t i = 0; i < o->num_ignored_modules; i++)
        if (o->ignored_modules[i] == m) return true;
    return false;
}

static int add_child_unit(fsdp_unit_t *u, fsdp_unit_t *c) {
    if (u->nchildren == u->capchildren) {
        size_t cap = u->capchildren ? 2 * u->capchildren : 4;
        fsdp_unit_t **nc = realloc(u->children, cap * sizeof *nc);
        if (!nc) return FSDP_ENOMEM;
        u->children = nc;
        u->capchildren = cap;
    }
    u->children[u->nchildren++] = c;
    return FSDP_OK;
}

/* Walks m's subtree in pre-order, collecting the parameters u manages and every slot that holds
 * one; adopts the units met on the way (their subtrees are theirs). */
static int collect(struct collect *c, fsdp_module_t *m, const char *prefix) {
    fsdp_unit_t *u = c->u;
    if (m != u->module) {
        fsdp_unit_t *other = fsdp_unit_of(m);
        if (other) {
            if (other->parent && other->parent != u)
                return unit_err(u, FSDP_EINVAL, "module '%s' is already a unit inside another "
                                "tree", prefix);
            if (!other->parent) {
                /* Adopt it (once, even if the module appears twice). */
                bool have = false;
                for (size_t i = 0; i < u->nchildren; i++) have |= u->children[i] == other;
                if (!have && add_child_unit(u, other) < 0)
                    return unit_err(u, FSDP_ENOMEM, "out of memory");
            }
            return FSDP_OK;
        }
        if (is_ignored(c->o, m)) return FSDP_OK;
    }
    for (size_t i = 0; i < m->nparams; i++) {
        fsdp_tensor_t *t = m->params[i].t;
        int idx = -1;
        for (int p = 0; p < u->nparams; p++)
            if (u->params[p].orig == t) idx = p;
        char *fqn = join_name(prefix, m->params[i].name);
        if (!fqn) return unit_err(u, FSDP_ENOMEM, "out of memory");
        if (idx < 0) {
            int oi = 0;
            fsdp_unit_t *owner = owner_of_param(u->ctx, t, &oi);
            if (owner) {
                int rc = unit_err(u, FSDP_EINVAL,
                                  "parameter '%s' is shared with parameter '%s' of the unit at "
                                  "'%s'; a shared parameter must belong to one unit: wrap the "
                                  "modules that share it in one unit",
                                  fqn, owner->params[oi].fqn,
                                  owner->module == u->module ? "" : fsdp_module_type(owner->module));
                free(fqn);
                return rc;
            }
            if (!fsdp_dtype_is_float(t->dt)) {
                int rc = unit_err(u, FSDP_EINVAL, "cannot flatten parameter '%s' of dtype %s: "
                                  "FSDP flattens floating-point parameters only",
                                  fqn, fsdp_dtype_name(t->dt));
                free(fqn);
                return rc;
            }
            if ((size_t)u->nparams == c->capparams) {
                size_t cap = c->capparams ? 2 * c->capparams : 8;
                struct fsdp__param *np = realloc(u->params, cap * sizeof *np);
                if (!np) {
                    free(fqn);
                    return unit_err(u, FSDP_ENOMEM, "out of memory");
                }
                u->params = np;
                c->capparams = cap;
            }
            struct fsdp__param *p = &u->params[u->nparams];
            *p = (struct fsdp__param){0};
            p->fqn = fqn;
            fqn = NULL;
            p->orig = fsdp_tensor_retain(t);
            p->ndim = t->ndim;
            memcpy(p->shape, t->shape, sizeof p->shape);
            idx = u->nparams++;
        }
        free(fqn);
        if (u->nslots == c->capslots) {
            size_t cap = c->capslots ? 2 * c->capslots : 8;
            struct fsdp__slotref *ns = realloc(u->slots, cap * sizeof *ns);
            if (!ns) return unit_err(u, FSDP_ENOMEM, "out of memory");
            u->slots = ns;
            c->capslots = cap;
        }
        u->slots[u->nslots++] = (struct fsdp__slotref){m, i, idx};
    }
    for (size_t i = 0; i < m->nchildren; i++) {
        char *name = join_name(prefix, m->children[i].name);
        if (!name) return unit_err(u, FSDP_ENOMEM, "out of memory");
        int rc = collect(c, m->children[i].m, name);
        free(name);
        if (rc < 0) return rc;
    }
    return FSDP_OK;
}

/* Checks what PyTorch's _validate_tensors_to_flatten checks. */
static int validate_params(fsdp_unit_t *u) {
    for (int i = 1; i < u->nparams; i++) {
        struct fsdp__param *a = &u->params[0], *b = &u->params[i];
        if (b->orig->dt != a->orig->dt)
            return unit_err(u, FSDP_EINVAL,
                            "parameters must have one dtype to be flattened: '%s' is %s but "
                            "'%s' is %s",
                            a->fqn, fsdp_dtype_name(a->orig->dt), b->fqn,
                            fsdp_dtype_name(b->orig->dt));
        if (b->orig->dev != a->orig->dev)
            return unit_err(u, FSDP_EINVAL, "parameters '%s' and '%s' are on different devices",
                            a->fqn, b->fqn);
        if (!u->opt.use_orig_params && b->orig->requires_grad != a->orig->requires_grad)
            return unit_err(u, FSDP_EINVAL,
                            "parameters must have uniform requires_grad when use_orig_params "
                            "is off: '%s' has %s but '%s' has %s",
                            a->fqn, a->orig->requires_grad ? "true" : "false", b->fqn,
                            b->orig->requires_grad ? "true" : "false");
    }
    return FSDP_OK;
}

/* sync_module_states: rank 0's values of every managed parameter and every buffer of the
 * subtree (outside nested units and ignored modules). */
static int sync_states(fsdp_unit_t *u, fsdp_module_t *m, bool top) {
    if (!top && (fsdp_unit_of(m) || unit_ignores(u, m))) return FSDP_OK;
    int rc = FSDP_OK;
    for (size_t i = 0; i < m->nbuffers && rc == 0; i++) {
        fsdp_tensor_t *b = m->buffers[i].t;
        if (!fsdp_tensor_is_contiguous(b)) continue;
        rc = fsdp_pg_broadcast(u->pg, fsdp_tensor_data(b), fsdp_tensor_data(b),
                               (size_t)fsdp_tensor_numel(b), b->dt, 0, NULL);
    }
    for (size_t i = 0; i < m->nchildren && rc == 0; i++)
        rc = sync_states(u, m->children[i].m, false);
    return rc;
}

/* Builds the flat parameter and its views from the collected parameters. */
static int flatten(fsdp_unit_t *u) {
    int rc = FSDP_OK;
    if (u->opt.device && !u->opt.cpu_offload) {
        /* PyTorch's device_id: the module moves to the compute device before it is flattened,
         * so the parameter objects themselves end up there (and sync_module_states broadcasts
         * on it). */
        for (int i = 0; i < u->nparams; i++) {
            if ((rc = fsdp__tensor_move(u->params[i].orig, u->opt.device)) < 0)
                return unit_err(u, rc, "moving parameter '%s' to options.device (%s) failed: %s",
                                u->params[i].fqn, fsdp_device_name(u->opt.device),
                                fsdp_ctx_last_error(u->ctx));
        }
    }
    if ((rc = validate_params(u)) < 0) return rc;
    u->dt = u->params[0].orig->dt;
    /* Where the parameters are: the offload host, or (moved above) the compute device. */
    fsdp_device_t *pdev = u->params[0].orig->dev;
    u->dev = pdev;
    const fsdp_mixed_precision_t *mp = &u->opt.mixed_precision;
    u->cdt = mp->enabled && mp->param_dtype != FSDP_MP_UNSET ? mp->param_dtype : u->dt;
    u->rdt = mp->enabled && mp->reduce_dtype != FSDP_MP_UNSET ? mp->reduce_dtype : u->cdt;
    if (u->opt.cpu_offload) {
        if (fsdp_device_kind(pdev) != FSDP_DEVICE_CPU)
            return unit_err(u, FSDP_EINVAL,
                            "an FSDP-managed module with parameter CPU offloading enabled has "
                            "parameters on %s ('%s'); keep the module on the host until it is "
                            "wrapped (options.device chooses the compute device)",
                            fsdp_device_name(pdev), u->params[0].fqn);
        /* The shard and its gradient stay on the host the parameters are on; the unit computes
         * on options.device, or without it on the host itself (the category tells the offloaded
         * bytes apart then). */
        u->host_dev = pdev;
        if (u->opt.device) u->dev = u->opt.device;
    }
    int64_t *numel = calloc((size_t)u->nparams, sizeof *numel);
    if (!numel) return unit_err(u, FSDP_ENOMEM, "out of memory");
    for (int i = 0; i < u->nparams; i++) numel[i] = fsdp_tensor_numel(u->params[i].orig);
    int align = u->opt.use_orig_params ? (int)(16 / fsdp_dtype_size(u->dt)) : 1;
    int world = is_sharded(u->opt.strategy) ? u->world : 1;
    rc = fsdp__layout_build(u->nparams, numel, align, world, &u->layout);
    free(numel);
    if (rc < 0) return unit_err(u, rc, "out of memory");
    int shard_rank = is_sharded(u->opt.strategy) ? u->rank : 0;

    /* The unsharded flat parameter, filled from the parameters (padding zero), where they are. */
    const int64_t full_n[1] = {u->layout.padded_numel};
    FSDP_TRY(rc, out, zeros_on(u, pdev, u->dt, u->layout.padded_numel, FSDP_MEM_PARAMS, &u->full));
    if (u->opt.sync_module_states)
        for (int i = 0; i < u->nparams && rc == 0; i++) {
            fsdp_tensor_t *t = u->params[i].orig;
            fsdp_tensor_t *c = NULL;
            FSDP_TRY(rc, out, fsdp_contiguous(t, &c));
            rc = fsdp_pg_broadcast(u->pg, fsdp_tensor_data(c), fsdp_tensor_data(c),
                                   (size_t)fsdp_tensor_numel(c), u->dt, 0, NULL);
            if (rc == 0 && c != t) rc = fsdp_tensor_copy_(t, c);
            fsdp_tensor_release(c);
            if (rc < 0) goto out;
        }
    for (int i = 0; i < u->nparams; i++) {
        struct fsdp__param *p = &u->params[i];
        fsdp_tensor_t *dst = NULL;
        FSDP_TRY(rc, out, fsdp__tensor_view(u->full, u->layout.offset[i], p->ndim, p->shape, NULL,
                                            &dst));
        fsdp__contiguous_strides(p->ndim, p->shape, dst->stride);
        rc = fsdp_tensor_copy_(dst, p->orig);
        fsdp_tensor_release(dst);
        if (rc < 0) goto out;
        fsdp__layout_shard_info(&u->layout, i, shard_rank, &p->sh);
    }

    /* The local shard. */
    const int64_t shard_n[1] = {u->layout.shard_numel};
    if (separate_full(u)) {
        /* pdev is the offload host, or without offload the compute device. */
        FSDP_TRY(rc, out, fsdp__tensor_new(u->ctx, pdev, u->dt, 1, shard_n,
                                           u->opt.cpu_offload ? FSDP_MEM_OFFLOAD
                                                              : FSDP_MEM_PARAMS,
                                           &u->flat));
        fsdp_tensor_t *src = NULL;
        FSDP_TRY(rc, out, view1d(u->full, (int64_t)shard_rank * u->layout.shard_numel,
                                 u->layout.shard_numel, &src));
        rc = fsdp_tensor_copy_(u->flat, src);
        fsdp_tensor_release(src);
        if (rc < 0) goto out;
        if (u->cdt != u->dt || u->dev != pdev) {
            /* Mixed precision: the unsharded parameter is gathered in the compute dtype; with
             * offload to another compute device, there. */
            fsdp_tensor_release(u->full);
            u->full = NULL;
            FSDP_TRY(rc, out, fsdp__tensor_new(u->ctx, u->dev, u->cdt, 1, full_n,
                                               FSDP_MEM_PARAMS, &u->full));
        }
        FSDP_TRY(rc, out, fsdp_tensor_storage_resize(u->full, 0));
        u->unsharded = false;
    } else {
        FSDP_TRY(rc, out, view1d(u->full, 0, u->layout.shard_numel, &u->flat));
        u->unsharded = true;
    }
    /* The compute views: the original shapes at their offsets in the unsharded parameter. */
    for (int i = 0; i < u->nparams; i++) {
        struct fsdp__param *p = &u->params[i];
        FSDP_TRY(rc, out, fsdp__tensor_view(u->full, u->layout.offset[i], p->ndim, p->shape, NULL,
                                            &p->cv));
        fsdp__contiguous_strides(p->ndim, p->shape, p->cv->stride);
        p->cv->requires_grad = p->orig->requires_grad;
        FSDP_TRY(rc, out, fsdp_tensor_set_name(p->cv, p->fqn));
    }
    bool rg = false;
    for (int i = 0; i < u->nparams; i++) rg |= u->params[i].orig->requires_grad;
    u->flat->requires_grad = rg;
    FSDP_TRY(rc, out, fsdp_tensor_set_name(u->flat, "_flat_param"));

    /* The original objects become views of their part of the shard. */
    for (int i = 0; i < u->nparams; i++) {
        struct fsdp__param *p = &u->params[i];
        fsdp_tensor_t *v = NULL;
        FSDP_TRY(rc, out, view1d(u->flat, p->sh.in_shard ? p->sh.offset_in_shard : 0,
                                 p->sh.numel_in_shard, &v));
        fsdp_tensor_release(p->orig->grad);
        p->orig->grad = NULL;
        rc = fsdp__tensor_set_data(p->orig, v);
        fsdp_tensor_release(v);
        if (rc < 0) goto out;
    }
out:
    return rc;
}

/* Moves the buffers of the modules u manages (its subtree outside nested units and ignored
 * modules) to dev, keeping each buffer object, as `module.to(device_id)` does. */
static int move_buffers(fsdp_unit_t *u, fsdp_module_t *m, bool top, fsdp_device_t *dev) {
    if (!top && (fsdp_unit_of(m) || unit_ignores(u, m))) return FSDP_OK;
    int rc = FSDP_OK;
    for (size_t i = 0; i < m->nbuffers && rc == 0; i++)
        rc = fsdp__tensor_move(m->buffers[i].t, dev);
    for (size_t i = 0; i < m->nchildren && rc == 0; i++)
        rc = move_buffers(u, m->children[i].m, false, dev);
    return rc;
}

/* Moves an idle unit (wrapped earlier, now adopted) to compute on dev: its buffers, and the
 * shard with the original parameters (unless offloaded: those stay on the host), the unsharded
 * parameter and the compute views, each tensor object kept. */
static int unit_set_device(fsdp_unit_t *u, fsdp_device_t *dev) {
    if (u->state != FSDP_STATE_IDLE || u->ag_work || u->rs_in || u->full_grad)
        return unit_err(u, FSDP_EINVAL,
                        "cannot move the unit to %s (options.device of the unit adopting it) "
                        "while it runs or is unsharded by the caller",
                        fsdp_device_name(dev));
    fsdp_tensor_t *v = NULL;
    int rc = move_buffers(u, u->module, true, dev);
    if (rc < 0) goto fail;
    if (u->nparams == 0 || u->dev == dev) {
        u->dev = dev;
        return FSDP_OK;
    }
    if (u->unsharded && separate_full(u) && (rc = reshard(u)) < 0) goto fail;
    if (!u->opt.cpu_offload) {
        if (separate_full(u)) {
            rc = fsdp__tensor_move(u->flat, dev); /* its gradient too */
        } else {
            /* NO_SHARD: the shard is a view of the unsharded parameter. */
            rc = fsdp__tensor_move(u->full, dev);
            if (rc == 0) rc = view1d(u->full, 0, u->layout.shard_numel, &v);
            if (rc == 0) rc = repoint(u->flat, v);
            fsdp_tensor_release(v);
            v = NULL;
            if (rc == 0 && u->flat->grad) rc = fsdp__tensor_move(u->flat->grad, dev);
        }
        for (int i = 0; i < u->nparams && rc == 0; i++) {
            struct fsdp__param *p = &u->params[i];
            rc = view1d(u->flat, p->sh.in_shard ? p->sh.offset_in_shard : 0, p->sh.numel_in_shard,
                        &v);
            if (rc == 0) rc = repoint(p->orig, v);
            fsdp_tensor_release(v);
            v = NULL;
            if (rc < 0 || !p->orig->grad || p->orig->grad->dev == dev) continue;
            if (u->opt.use_orig_params && u->flat->grad) {
                /* It viewed the old flat gradient: view the moved one. */
                rc = view1d(u->flat->grad, p->sh.offset_in_shard, p->sh.numel_in_shard, &v);
                if (rc == 0) {
                    fsdp_tensor_release(p->orig->grad);
                    p->orig->grad = v;
                    v = NULL;
                }
            } else {
                rc = fsdp__tensor_move(p->orig->grad, dev);
            }
        }
        if (rc < 0) goto fail;
    }
    if (separate_full(u)) {
        const int64_t n[1] = {u->layout.padded_numel};
        rc = fsdp__tensor_new(u->ctx, dev, u->cdt, 1, n, FSDP_MEM_PARAMS, &v);
        if (rc == 0) rc = repoint(u->full, v);
        fsdp_tensor_release(v);
        v = NULL;
        if (rc == 0) rc = fsdp_tensor_storage_resize(u->full, 0);
        if (rc < 0) goto fail;
    }
    for (int i = 0; i < u->nparams && rc == 0; i++) {
        struct fsdp__param *p = &u->params[i];
        rc = fsdp__tensor_view(u->full, u->layout.offset[i], p->ndim, p->shape, NULL, &v);
        if (rc == 0) {
            fsdp__contiguous_strides(p->ndim, p->shape, v->stride);
            rc = repoint(p->cv, v);
        }
        fsdp_tensor_release(v);
        v = NULL;
    }
    if (rc < 0) goto fail;
    u->dev = dev;
    return FSDP_OK;
fail:
    return unit_err(u, rc, "moving the unit to %s (options.device of the unit adopting it) "
                    "failed: %s", fsdp_device_name(dev), fsdp_ctx_last_error(u->ctx));
}

/* A unit adopted by a wrap with options.device takes that device unless its own option is set,
 * and so do the units below it (PyTorch's nested instances compute on the root's device). */
static int inherit_device(fsdp_unit_t *c, fsdp_device_t *dev) {
    if (c->opt.device) return FSDP_OK;
    int rc = unit_set_device(c, dev);
    if (rc < 0) return rc;
    c->opt.device = dev;
    for (size_t i = 0; i < c->nchildren && rc == 0; i++) rc = inherit_device(c->children[i], dev);
    return rc;
}

static int wrap_one(fsdp_module_t *m, const fsdp_options_t *o, fsdp_pg_t *pg, const char *fqn,
                    fsdp_unit_t **out);
static int set_fqns(fsdp_unit_t *u, fsdp_module_t *m, const char *prefix);

struct policy_walk {
    const fsdp_options_t *o;
    fsdp_pg_t *pg;
    int rc;
};

static bool policy_matches(const fsdp_options_t *o, fsdp_module_t *m, const char *fqn,
                           int64_t nonwrapped) {
    if (o->wrap_types)
        for (const char *const *t = o->wrap_types; *t; t++)
            if (strcmp(*t, fsdp_module_type(m)) == 0) return true;
    return o->policy && o->policy(m, fqn, nonwrapped, o->policy_arg);
}

/* Parameter elements of m's subtree that no unit manages yet (shared tensors once). */
static int64_t nonwrapped_numel(fsdp_module_t *m) {
    fsdp_named_list_t l = {0};
    if (fsdp_module_named_params(m, false, &l) < 0) return 0;
    int64_t n = 0;
    for (size_t i = 0; i < l.n; i++)
        if (!owner_of_param(m->ctx, l.tensors[i], NULL)) n += fsdp_tensor_numel(l.tensors[i]);
    fsdp_named_list_free(&l);
    return n;
}

/* Post-order: children first, then m itself (unless it is the top of the wrap). */
static int auto_wrap(struct policy_walk *w, fsdp_module_t *m, const char *fqn, bool top) {
    if (fsdp_unit_of(m) || is_ignored(w->o, m)) return FSDP_OK;
    for (size_t i = 0; i < m->nchildren; i++) {
        char *name = join_name(fqn, m->children[i].name);
        if (!name) return fsdp__ctx_err(m->ctx, FSDP_ENOMEM, "fsdp_wrap: out of memory");
        int rc = auto_wrap(w, m->children[i].m, name, false);
        free(name);
        if (rc < 0) return rc;
    }
    if (top) return FSDP_OK;
    if (!policy_matches(w->o, m, fqn, nonwrapped_numel(m))) return FSDP_OK;
    fsdp_unit_t *u = NULL;
    return wrap_one(m, w->o, w->pg, fqn, &u);
}

static void drop_summon_views(fsdp_unit_t *u);

static void unit_free(fsdp_unit_t *u) {
    if (!u) return;
    fsdp_work_release(u->ag_work);
    fsdp_work_release(u->rs_work);
    fsdp_work_release(u->ar_work);
    if (u->module) {
        swap_slots(u, false);
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
    fsdp_tensor_release(u->staging);
    fsdp_tensor_release(u->summon_host);
    drop_summon_views(u);
    fsdp_tensor_release(u->rs_in);
    fsdp_tensor_release(u->rs_out);
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

static int wrap_one(fsdp_module_t *m, const fsdp_options_t *o, fsdp_pg_t *pg, const char *fqn,
                    fsdp_unit_t **out) {
    *out = NULL;
    fsdp_unit_t *u = calloc(1, sizeof *u);
    if (!u) return fsdp__ctx_err(m->ctx, FSDP_ENOMEM, "fsdp_wrap: out of memory");
    u->ctx = m->ctx;
    u->module = fsdp_module_retain(m);
    u->fqn = strdup(fqn ? fqn : "");
    u->opt = *o;
    u->opt.ignored_modules = NULL; /* the caller's array: copied below */
    u->opt.num_ignored_modules = 0;
    if (o->num_ignored_modules > 0) {
        u->ignored = malloc(o->num_ignored_modules * sizeof *u->ignored);
        if (!u->ignored) {
            free(u->fqn);
            fsdp_module_release(u->module);
            free(u);
            return fsdp__ctx_err(m->ctx, FSDP_ENOMEM, "fsdp_wrap: out of memory");
        }
        memcpy(u->ignored, o->ignored_modules, o->num_ignored_modules * sizeof *u->ignored);
        u->nignored = o->num_ignored_modules;
    }
    u->opt.wrap_types = NULL;
    u->opt.policy = NULL;
    u->pg = pg;
    u->rank = fsdp_pg_rank(pg);
    u->world = fsdp_pg_size(pg);
    u->replicate_pg = is_hybrid(o->strategy) ? o->replicate_pg : NULL;
    u->dev = o->device ? o->device : fsdp_ctx_device(m->ctx); /* flatten() refines it */
    int rc = FSDP_OK;
    if (!u->fqn) {
        rc = fsdp__ctx_err(m->ctx, FSDP_ENOMEM, "fsdp_wrap: out of memory");
        goto fail;
    }
    if (u->world == 1 && o->strategy != FSDP_NO_SHARD && !u->replicate_pg) {
        /* PyTorch forces NO_SHARD on a group of one. */
        u->opt.strategy = FSDP_NO_SHARD;
    }
    struct collect c = {u, o, 0, 0, 0};
    FSDP_TRY(rc, fail, collect(&c, m, ""));
    if (o->device && (rc = move_buffers(u, m, true, o->device)) < 0) {
        rc = unit_err(u, rc, "moving buffers to options.device (%s) failed: %s",
                      fsdp_device_name(o->device), fsdp_ctx_last_error(u->ctx));
        goto fail;
    }
    if (o->sync_module_states) {
        rc = sync_states(u, m, true);
        if (rc < 0) {
            rc = unit_err(u, rc, "sync_module_states: broadcast failed: %s",
                          fsdp_pg_last_error(pg));
            goto fail;
        }
    }
    if (u->nparams > 0) FSDP_TRY(rc, fail, flatten(u));
    for (size_t i = 0; o->device && i < u->nchildren; i++)
        FSDP_TRY(rc, fail, inherit_device(u->children[i], o->device));
    FSDP_TRY(rc, fail, fsdp_module_add_forward_pre_hook(m, forward_pre_hook, u,
                                                        &u->hook_handles[0]));
    FSDP_TRY(rc, fail, fsdp_module_add_forward_hook(m, forward_hook, u, &u->hook_handles[1]));
    FSDP_TRY(rc, fail, fsdp_module_add_backward_pre_hook(m, backward_pre_hook, u,
                                                         &u->hook_handles[2]));
    FSDP_TRY(rc, fail, fsdp_module_add_backward_hook(m, backward_hook, u, &u->hook_handles[3]));
    FSDP_TRY(rc, fail, registry_add(u));
    for (size_t i = 0; i < u->nchildren; i++) u->children[i]->parent = u;
    /* Names of the adopted units, now relative to this module. */
    if (u->nchildren > 0 && (rc = set_fqns(u, m, "")) < 0) {
        rc = unit_err(u, rc, "out of memory");
        goto fail;
    }
    *out = u;
    return FSDP_OK;
fail:
    /* Parameters already re-pointed cannot be restored; before flatten() they are untouched. */
    for (size_t i = 0; i < u->nchildren; i++)
        if (u->children[i]->parent == u) u->children[i]->parent = NULL;
    u->nchildren = 0;
    unit_free(u);
    return rc;
}

int fsdp_wrap(fsdp_module_t *m, const fsdp_options_t *o, fsdp_unit_t **out) {
    if (out) *out = NULL;
    if (!m) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_wrap: module is NULL");
    if (!out) return fsdp__ctx_err(m->ctx, FSDP_EINVAL, "fsdp_wrap: out is NULL");
    fsdp_options_t def;
    if (!o) {
        fsdp_options_init(&def);
        o = &def;
    }
    if ((int)o->strategy < 0 || o->strategy >= FSDP_SHARDING_COUNT)
        return fsdp__ctx_err(m->ctx, FSDP_EINVAL, "fsdp_wrap: sharding strategy %d is not one",
                             (int)o->strategy);
    if ((int)o->backward_prefetch < 0 || o->backward_prefetch >= FSDP_BACKWARD_PREFETCH_COUNT)
        return fsdp__ctx_err(m->ctx, FSDP_EINVAL, "fsdp_wrap: backward prefetch %d is not one",
                             (int)o->backward_prefetch);
    if (o->limit_all_gathers < 0)
        return fsdp__ctx_err(m->ctx, FSDP_EINVAL,
                             "fsdp_wrap: limit_all_gathers is %d; it must be >= 0",
                             o->limit_all_gathers);
    if (o->delay_before_reduce_ms < 0 || o->delay_before_free_ms < 0)
        return fsdp__ctx_err(m->ctx, FSDP_EINVAL,
                             "fsdp_wrap: delays must be >= 0 (delay_before_reduce_ms %d, "
                             "delay_before_free_ms %d)",
                             o->delay_before_reduce_ms, o->delay_before_free_ms);
    if (o->device && fsdp_device_ctx(o->device) != m->ctx)
        return fsdp__ctx_err(m->ctx, FSDP_EINVAL,
                             "fsdp_wrap: options.device (%s) belongs to another context "
                             "(of rank %d) than the module (rank %d); a unit computes on a "
                             "device of the module's context",
                             fsdp_device_name(o->device), fsdp_ctx_rank(fsdp_device_ctx(o->device)),
                             fsdp_ctx_rank(m->ctx));
    if (o->num_ignored_modules > 0 && !o->ignored_modules)
        return fsdp__ctx_err(m->ctx, FSDP_EINVAL,
                             "fsdp_wrap: %zu ignored modules but the array is NULL",
                             o->num_ignored_modules);
    fsdp_pg_t *pg = o->pg ? o->pg : m->ctx->pg;
    if (!pg)
        return fsdp__ctx_err(m->ctx, FSDP_EINVAL,
                             "fsdp_wrap: no process group (options.pg is NULL and the context "
                             "has no world group)");
    if (is_hybrid(o->strategy) && !o->replicate_pg)
        return fsdp__ctx_err(m->ctx, FSDP_EINVAL,
                             "fsdp_wrap: %s needs options.replicate_pg (the group across "
                             "which shards are replicated)",
                             fsdp_sharding_strategy_name(o->strategy));
    if (fsdp_unit_of(m))
        return fsdp__module_err(m, FSDP_EINVAL, "fsdp_wrap: the module is already an FSDP unit");
    if (m->ctx->fsdp)
        for (size_t i = 0; i < m->ctx->fsdp->n; i++) {
            fsdp_unit_t *r = m->ctx->fsdp->units[i].u;
            if (r->initialized)
                for (size_t j = 0; j < r->nall; j++)
                    if (r->all[j] == r && r->state != FSDP_STATE_IDLE)
                        return fsdp__ctx_err(m->ctx, FSDP_EINVAL,
                                             "fsdp_wrap: a unit is running forward or backward");
        }
    if (o->wrap_types || o->policy) {
        struct policy_walk w = {o, pg, 0};
        int rc = auto_wrap(&w, m, "", true);
        if (rc < 0) return rc;
    }
    return wrap_one(m, o, pg, "", out);
}

/* Sets fqn of every unit under u (relative to the root's module). */
static int set_fqns(fsdp_unit_t *u, fsdp_module_t *m, const char *prefix) {
    fsdp_unit_t *mu = fsdp_unit_of(m);
    if (mu && mu != u && mu->parent) {
        char *s = strdup(prefix);
        if (!s) return FSDP_ENOMEM;
        free(mu->fqn);
        mu->fqn = s;
    }
    for (size_t i = 0; i < m->nchildren; i++) {
        char *name = join_name(prefix, m->children[i].name);
        if (!name) return FSDP_ENOMEM;
        int rc = set_fqns(u, m->children[i].m, name);
        free(name);
        if (rc < 0) return rc;
    }
    return FSDP_OK;
}

int fsdp_destroy(fsdp_unit_t *root) {
    if (!root) return FSDP_OK;
    if (root->parent)
        return unit_err(root, FSDP_EINVAL, "fsdp_destroy: not a root unit (destroy its root)");
    fsdp_unit_t **all = NULL;
    size_t n = 0, cap = 0;
    if (collect_units(root, &all, &n, &cap) < 0) {
        free(all);
        return unit_err(root, FSDP_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        fsdp_unit_t *u = all[i];
        if (u->ag_work) fsdp_work_wait(u->ag_work, -1);
        if (u->rs_work) fsdp_work_wait(u->rs_work, -1);
        if (u->ar_work) fsdp_work_wait(u->ar_work, -1);
    }
    for (size_t i = n; i-- > 0;) unit_free(all[i]);
    free(all);
    return FSDP_OK;
}

/* ---- navigation and listings ---------------------------------------------------------------- */

fsdp_module_t *fsdp_unit_module(const fsdp_unit_t *u) { return u ? u->module : NULL; }
fsdp_unit_t *fsdp_unit_parent(const fsdp_unit_t *u) { return u ? u->parent : NULL; }
bool fsdp_unit_is_root(const fsdp_unit_t *u) { return u && !u->parent; }
const char *fsdp_unit_fqn(const fsdp_unit_t *u) { return u ? u->fqn : ""; }
fsdp_sharding_strategy_t fsdp_unit_strategy(const fsdp_unit_t *u) {
    return u ? u->opt.strategy : FSDP_FULL_SHARD;
}
fsdp_pg_t *fsdp_unit_pg(const fsdp_unit_t *u) { return u ? u->pg : NULL; }
fsdp_device_t *fsdp_unit_compute_device(const fsdp_unit_t *u) { return u ? u->dev : NULL; }
fsdp_tensor_t *fsdp_unit_flat_param(const fsdp_unit_t *u) { return u ? u->flat : NULL; }
fsdp_tensor_t *fsdp_unit_full_param(const fsdp_unit_t *u) { return u ? u->full : NULL; }
bool fsdp_unit_is_unsharded(const fsdp_unit_t *u) { return u && u->unsharded; }
size_t fsdp_unit_num_params(const fsdp_unit_t *u) { return u ? (size_t)u->nparams : 0; }
fsdp_training_state_t fsdp_unit_state(const fsdp_unit_t *u) {
    return u ? u->state : FSDP_STATE_IDLE;
}

void fsdp_unit_get_stats(const fsdp_unit_t *u, fsdp_unit_stats_t *out) {
    if (!out) return;
    *out = u ? u->stats : (fsdp_unit_stats_t){0};
}

void fsdp_unit_flat_sizes(const fsdp_unit_t *u, fsdp_flat_sizes_t *out) {
    if (!out) return;
    *out = (fsdp_flat_sizes_t){0};
    if (!u) return;
    out->unpadded_numel = u->layout.unpadded_numel;
    out->padded_numel = u->layout.padded_numel;
    out->shard_numel = u->layout.shard_numel;
    out->world = u->layout.world;
}

int fsdp_unit_param_info(const fsdp_unit_t *u, size_t i, fsdp_param_info_t *out) {
    if (!u || !out) return fsdp__ctx_err(u ? u->ctx : NULL, FSDP_EINVAL,
                                         "fsdp_unit_param_info: NULL argument");
    if (i >= (size_t)u->nparams)
        return unit_err(u, FSDP_EINVAL, "fsdp_unit_param_info: index %zu, but the unit has %d "
                        "parameters", i, u->nparams);
    const struct fsdp__param *p = &u->params[i];
    *out = (fsdp_param_info_t){p->fqn,
                               p->orig,
                               p->ndim,
                               p->shape,
                               u->layout.numel[i],
                               u->layout.offset[i],
                               p->sh.in_shard,
                               p->sh.offset_in_shard,
                               p->sh.numel_in_shard,
                               p->sh.intra_start};
    return FSDP_OK;
}

int fsdp_units(const fsdp_unit_t *root, fsdp_unit_t ***units, size_t *n) {
    if (!root || !units || !n)
        return fsdp__ctx_err(root ? root->ctx : NULL, FSDP_EINVAL, "fsdp_units: NULL argument");
    *units = NULL;
    *n = 0;
    size_t cap = 0;
    int rc = collect_units((fsdp_unit_t *)root, units, n, &cap);
    if (rc < 0) {
        free(*units);
        *units = NULL;
        *n = 0;
        return unit_err(root, FSDP_ENOMEM, "out of memory");
    }
    return FSDP_OK;
}

int fsdp_named_params(const fsdp_unit_t *root, fsdp_named_list_t *out) {
    if (!root || !out)
        return fsdp__ctx_err(root ? root->ctx : NULL, FSDP_EINVAL,
                             "fsdp_named_params: NULL argument");
    *out = (fsdp_named_list_t){0};
    fsdp_named_list_t all = {0};
    int rc = fsdp_module_named_params(root->module, false, &all);
    if (rc < 0) return rc;
    out->owned = true;
    size_t cap = 0;
    if (root->opt.use_orig_params) {
        for (size_t i = 0; i < all.n && rc == 0; i++)
            rc = fsdp__list_push(out, &cap, all.names[i], all.tensors[i], all.modules[i]);
    } else {
        fsdp_unit_t **units = NULL;
        size_t nu = 0;
        rc = fsdp_units(root, &units, &nu);
        for (size_t i = 0; i < nu && rc == 0; i++) {
            if (!units[i]->flat) continue;
            char *name = join_name(units[i]->fqn, "_flat_param");
            if (!name) {
                rc = unit_err(root, FSDP_ENOMEM, "out of memory");
                break;
            }
            rc = fsdp__list_push(out, &cap, name, units[i]->flat, units[i]->module);
            free(name);
        }
        free(units);
        /* Parameters no unit manages (ignored modules). */
        for (size_t i = 0; i < all.n && rc == 0; i++)
            if (!owner_of_param(root->ctx, all.tensors[i], NULL))
                rc = fsdp__list_push(out, &cap, all.names[i], all.tensors[i], all.modules[i]);
    }
    fsdp_named_list_free(&all);
    if (rc < 0) fsdp_named_list_free(out);
    return rc;
}

/* ---- summon and explicit unshard ------------------------------------------------------------ */

void fsdp_summon_options_init(fsdp_summon_options_t *o) {
    if (!o) return;
    *o = (fsdp_summon_options_t){0};
    o->recurse = true;
    o->writeback = true;
}

/* Points u's module slots at views of `base` (a full flat tensor) with the parameters' shapes;
 * the views are kept in u->summon_views so that the end of the summon can drop them. */
static int slots_to_views_of(fsdp_unit_t *u, fsdp_tensor_t *base) {
    u->summon_views = calloc((size_t)u->nparams, sizeof *u->summon_views);
    if (!u->summon_views) return unit_err(u, FSDP_ENOMEM, "out of memory");
    for (int i = 0; i < u->nparams; i++) {
        struct fsdp__param *p = &u->params[i];
        int rc = fsdp__tensor_view(base, u->layout.offset[i], p->ndim, p->shape, NULL,
                                   &u->summon_views[i]);
        if (rc < 0) return rc;
        fsdp__contiguous_strides(p->ndim, p->shape, u->summon_views[i]->stride);
        fsdp_tensor_set_name(u->summon_views[i], p->fqn);
    }
    for (size_t i = 0; i < u->nslots; i++) {
        struct fsdp__slotref *sr = &u->slots[i];
        struct fsdp__slot *slot = &sr->m->params[sr->slot];
        fsdp_tensor_t *want = u->summon_views[sr->param];
        fsdp_tensor_retain(want);
        fsdp_tensor_release(slot->t);
        slot->t = want;
    }
    u->slots_swapped = true;
    return FSDP_OK;
}

static void drop_summon_views(fsdp_unit_t *u) {
    if (!u->summon_views) return;
    for (int i = 0; i < u->nparams; i++) fsdp_tensor_release(u->summon_views[i]);
    free(u->summon_views);
    u->summon_views = NULL;
}

/* Gathers the full flat parameter in the parameters' own dtype into a new tensor on dev (for
 * summons that must not show the compute-dtype copy). Collective for sharded units. */
static int gather_full_precision(fsdp_unit_t *u, fsdp_device_t *dev, fsdp_mem_cat_t cat,
                                 fsdp_tensor_t **out) {
    const int64_t n[1] = {u->layout.padded_numel}, sn[1] = {u->layout.shard_numel};
    fsdp_tensor_t *src = u->flat, *staged = NULL, *g = NULL;
    int rc = FSDP_OK;
    *out = NULL;
    if (!is_sharded(u->opt.strategy)) {
        rc = fsdp__tensor_new(u->ctx, dev, u->dt, 1, n, cat, out);
        if (rc == 0) rc = xcopy(*out, u->flat);
        goto done;
    }
    /* The collective runs on the compute device: an offloaded shard goes there first, and the
     * result goes to dev afterwards when that is another device. */
    if (u->flat->dev != u->dev) {
        rc = fsdp__tensor_new(u->ctx, u->dev, u->dt, 1, sn, FSDP_MEM_COMM, &staged);
        if (rc == 0) rc = xcopy(staged, u->flat);
        src = staged;
    }
    if (rc == 0)
        rc = fsdp__tensor_new(u->ctx, u->dev, u->dt, 1, n, dev == u->dev ? cat : FSDP_MEM_COMM,
                              &g);
    if (rc == 0) {
        rc = fsdp_pg_all_gather(u->pg, fsdp_tensor_data(src), fsdp_tensor_data(g),
                                (size_t)u->layout.shard_numel, u->dt, NULL);
        if (rc < 0) rc = unit_err(u, rc, "all-gather of the full parameters failed: %s",
                                  fsdp_pg_last_error(u->pg));
    }
    fsdp_tensor_release(staged);
    if (rc == 0 && dev != u->dev) {
        rc = fsdp__tensor_new(u->ctx, dev, u->dt, 1, n, cat, out);
        if (rc == 0) rc = xcopy(*out, g);
        fsdp_tensor_release(g);
    } else {
        *out = g;
    }
done:
    if (rc < 0) {
        fsdp_tensor_release(*out);
        *out = NULL;
    }
    return rc;
}

/* with_grads: the unsharded gradient (zeros where a rank has none), as the .grad of the tensors
 * the module slots show (views[i], or the compute views when views is NULL). */
static int summon_grads(fsdp_unit_t *u, fsdp_tensor_t **views) {
    if (u->nparams == 0 || !any_requires_grad(u)) return FSDP_OK;
    drop_cleared_flat_grad(u);
    int rc = zeros_on(u, u->dev, u->dt, u->layout.padded_numel, FSDP_MEM_GRADS, &u->full_grad);
    if (rc < 0) return rc;
    fsdp_tensor_t *g = u->flat->grad, *staged = NULL;
    if (!g || g->dev != u->dev) {
        rc = zeros_on(u, u->dev, u->dt, u->layout.shard_numel, FSDP_MEM_COMM, &staged);
        if (rc == 0 && g) rc = xcopy(staged, g);
        if (rc < 0) {
            fsdp_tensor_release(staged);
            return rc;
        }
        g = staged;
    }
    if (is_sharded(u->opt.strategy)) {
        rc = fsdp_pg_all_gather(u->pg, fsdp_tensor_data(g), fsdp_tensor_data(u->full_grad),
                                (size_t)u->layout.shard_numel, u->dt, NULL);
    } else {
        rc = fsdp_tensor_copy_(u->full_grad, g); /* NO_SHARD: the gradient is already full */
    }
    fsdp_tensor_release(staged);
    if (rc < 0) return unit_err(u, rc, "gathering the gradients failed: %s",
                                fsdp_ctx_last_error(u->ctx));
    for (int i = 0; i < u->nparams && rc == 0; i++) {
        struct fsdp__param *p = &u->params[i];
        if (!p->orig->requires_grad) continue;
        fsdp_tensor_t *v = NULL, *shown = views ? views[i] : p->cv;
        rc = fsdp__tensor_view(u->full_grad, u->layout.offset[i], p->ndim, p->shape, NULL, &v);
        if (rc < 0) break;
        fsdp__contiguous_strides(p->ndim, p->shape, v->stride);
        fsdp_tensor_release(shown->grad);
        shown->grad = v;
    }
    return rc;
}

static int summon_one(fsdp_unit_t *u, const fsdp_summon_options_t *o, bool explicit_unshard) {
    if (u->state != FSDP_STATE_IDLE)
        return unit_err(u, FSDP_EINVAL, "%s: the unit is %s",
                        explicit_unshard ? "fsdp_unit_unshard" : "fsdp_summon_begin",
                        u->state == FSDP_STATE_SUMMON ? "already unsharded by the caller"
                                                      : "in forward or backward");
    u->was_unsharded = u->unsharded;
    u->summon = *o;
    u->summon_this_call = true;
    bool show = !o->rank0_only || u->rank == 0;
    int rc = FSDP_OK;
    if (u->nparams > 0 && (o->offload_to_cpu || u->cdt != u->dt)) {
        /* A full-precision copy (PyTorch forces full precision here), on the host with
         * offload_to_cpu; the compute-dtype buffer is left alone. */
        fsdp_device_t *where = o->offload_to_cpu ? host_device(u) : u->dev;
        rc = gather_full_precision(u, where,
                                   o->offload_to_cpu ? FSDP_MEM_OFFLOAD : FSDP_MEM_PARAMS,
                                   &u->summon_host);
        u->state = FSDP_STATE_SUMMON;
        if (rc == 0 && show) rc = slots_to_views_of(u, u->summon_host);
        if (rc == 0 && o->with_grads) rc = summon_grads(u, show ? u->summon_views : NULL);
        if (rc == 0 && !show) {
            fsdp_tensor_release(u->summon_host);
            u->summon_host = NULL;
        }
        return rc;
    }
    rc = unshard(u);
    if (rc < 0) return rc;
    u->state = FSDP_STATE_SUMMON;
    if (o->with_grads && (rc = summon_grads(u, NULL)) < 0) return rc;
    if (show) swap_slots(u, true);
    else if (!u->was_unsharded && separate_full(u)) rc = reshard(u); /* rank0_only elsewhere */
    return rc;
}

static int summon_end_one(fsdp_unit_t *u) {
    if (u->state != FSDP_STATE_SUMMON) return FSDP_OK;
    int rc = FSDP_OK;
    bool offloaded = u->summon_host != NULL;
    swap_slots(u, false);
    drop_summon_views(u);
    if (u->nparams > 0 && u->summon.writeback && (separate_full(u) || offloaded)) {
        /* Only this rank's part of the full parameters persists, as in PyTorch. */
        int shard_rank = is_sharded(u->opt.strategy) ? u->rank : 0;
        fsdp_tensor_t *src = NULL;
        rc = view1d(offloaded ? u->summon_host : u->full,
                    (int64_t)shard_rank * u->layout.shard_numel, u->layout.shard_numel, &src);
        if (rc == 0) rc = xcopy(u->flat, src);
        fsdp_tensor_release(src);
    }
    fsdp_tensor_release(u->summon_host);
    u->summon_host = NULL;
    drop_cv_grads(u);
    fsdp_tensor_release(u->full_grad);
    u->full_grad = NULL;
    if (!u->was_unsharded && u->unsharded) {
        int r = reshard(u);
        if (rc == 0) rc = r;
    }
    u->state = FSDP_STATE_IDLE;
    return rc;
}

static int summon_rec(fsdp_unit_t *u, const fsdp_summon_options_t *o, bool begin) {
    int rc = begin ? summon_one(u, o, false) : summon_end_one(u);
    if (o->recurse)
        for (size_t i = 0; i < u->nchildren; i++) {
            int r = summon_rec(u->children[i], o, begin);
            if (rc == 0) rc = r;
            if (begin && rc < 0) break;
        }
    return rc;
}

/* After a begin over u's tree: on failure, ends (without writeback) the summons this call
 * started, and only those: units a caller summoned before keep their summon. Clears the marks. */
static void rollback_summon(fsdp_unit_t *u, bool failed) {
    if (failed && u->summon_this_call) {
        u->summon.writeback = false;
        summon_end_one(u);
    }
    u->summon_this_call = false;
    for (size_t i = 0; i < u->nchildren; i++) rollback_summon(u->children[i], failed);
}

int fsdp_summon_begin(fsdp_unit_t *u, const fsdp_summon_options_t *o) {
    if (!u) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_summon_begin: unit is NULL");
    fsdp_summon_options_t def;
    if (!o) {
        fsdp_summon_options_init(&def);
        o = &def;
    }
    if (fsdp_in_backward(u->ctx))
        return unit_err(u, FSDP_EINVAL, "fsdp_summon_begin: not allowed during backward");
    if (o->rank0_only && o->writeback)
        return unit_err(u, FSDP_EINVAL,
                        "fsdp_summon_begin: rank0_only with writeback is not supported (the "
                        "other ranks would have nothing to write back)");
    if (o->with_grads && !u->opt.use_orig_params)
        return unit_err(u, FSDP_EINVAL,
                        "fsdp_summon_begin: with_grads needs use_orig_params");
    if (o->with_grads && o->offload_to_cpu)
        return unit_err(u, FSDP_EINVAL,
                        "fsdp_summon_begin: with_grads cannot be combined with offload_to_cpu");
    int rc = summon_rec(u, o, true);
    rollback_summon(u, rc < 0);
    return rc;
}

int fsdp_summon_end(fsdp_unit_t *u) {
    if (!u) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_summon_end: unit is NULL");
    if (u->state != FSDP_STATE_SUMMON)
        return unit_err(u, FSDP_EINVAL, "fsdp_summon_end without fsdp_summon_begin");
    fsdp_summon_options_t o = u->summon;
    return summon_rec(u, &o, false);
}

int fsdp_unit_unshard(fsdp_unit_t *u) {
    if (!u) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_unit_unshard: unit is NULL");
    fsdp_summon_options_t o;
    fsdp_summon_options_init(&o);
    o.recurse = false;
    o.writeback = true;
    int rc = summon_one(u, &o, true);
    rollback_summon(u, rc < 0);
    return rc;
}

int fsdp_unit_reshard(fsdp_unit_t *u) {
    if (!u) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_unit_reshard: unit is NULL");
    if (u->state != FSDP_STATE_SUMMON)
        return unit_err(u, FSDP_EINVAL, "fsdp_unit_reshard without fsdp_unit_unshard");
    return summon_end_one(u);
}

/* ---- clip_grad_norm ------------------------------------------------------------------------- */

/* All-reduces one f64 over u's group through a device buffer (the group may be NCCL). */
static int all_reduce_scalar(fsdp_unit_t *u, double *v, fsdp_redop_t op) {
    fsdp_tensor_t *t = NULL;
    const int64_t one[1] = {1};
    int rc = fsdp__tensor_new(u->ctx, u->dev, FSDP_DTYPE_F64, 1, one, FSDP_MEM_COMM, &t);
    if (rc == 0) rc = fsdp_tensor_fill_(t, *v);
    if (rc == 0) {
        rc = fsdp_pg_all_reduce(u->pg, fsdp_tensor_data(t), fsdp_tensor_data(t), 1,
                                FSDP_DTYPE_F64, op, NULL);
        if (rc < 0)
            rc = unit_err(u, rc, "all-reduce of a scalar failed: %s", fsdp_pg_last_error(u->pg));
    }
    if (rc == 0) rc = fsdp_tensor_item(t, 0, v);
    fsdp_tensor_release(t);
    return rc;
}

int fsdp_unit_clip_grad_norm(fsdp_unit_t *root, double max_norm, double norm_type,
                             double *total_norm) {
    if (total_norm) *total_norm = 0.0;
    if (!root) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_unit_clip_grad_norm: root is NULL");
    if (root->parent)
        return unit_err(root, FSDP_EINVAL, "fsdp_unit_clip_grad_norm: only on the root unit");
    if (!(max_norm >= 0.0) || !(norm_type > 0.0))
        return unit_err(root, FSDP_EINVAL,
                        "fsdp_unit_clip_grad_norm: max_norm %g must be >= 0 and norm_type %g > 0",
                        max_norm, norm_type);
    bool inf = isinf(norm_type);
    fsdp_unit_t **units = NULL;
    size_t nu = 0;
    fsdp_named_list_t all = {0};
    int rc = fsdp_units(root, &units, &nu);
    if (rc == 0) rc = fsdp_module_named_params(root->module, false, &all);
    double sharded = 0.0, local = 0.0;
    for (size_t i = 0; i < nu && rc == 0; i++) {
        fsdp_unit_t *u = units[i];
        if (!u->flat || !u->flat->grad) continue;
        double part = 0.0;
        rc = fsdp__grad_norm_part(u->flat->grad, norm_type, &part);
        bool shard = is_sharded(u->opt.strategy) && u->world > 1;
        double *acc = shard ? &sharded : &local;
        *acc = inf ? fmax(*acc, part) : *acc + part;
    }
    for (size_t i = 0; i < all.n && rc == 0; i++) {
        fsdp_tensor_t *g = fsdp_tensor_grad(all.tensors[i]);
        if (!g || owner_of_param(root->ctx, all.tensors[i], NULL)) continue;
        double part = 0.0;
        rc = fsdp__grad_norm_part(g, norm_type, &part);
        local = inf ? fmax(local, part) : local + part;
    }
    if (rc == 0 && root->world > 1)
        rc = all_reduce_scalar(root, &sharded, inf ? FSDP_REDOP_MAX : FSDP_REDOP_SUM);
    double total = fsdp__grad_norm_finish(inf ? fmax(sharded, local) : sharded + local,
                                          norm_type);
    double coef = fsdp__clip_coef(max_norm, total);
    for (size_t i = 0; i < nu && rc == 0 && coef < 1.0; i++)
        if (units[i]->flat && units[i]->flat->grad)
            rc = fsdp__grad_scale(units[i]->flat->grad, coef);
    for (size_t i = 0; i < all.n && rc == 0 && coef < 1.0; i++) {
        fsdp_tensor_t *g = fsdp_tensor_grad(all.tensors[i]);
        if (g && !owner_of_param(root->ctx, all.tensors[i], NULL)) rc = fsdp__grad_scale(g, coef);
    }
    free(units);
    fsdp_named_list_free(&all);
    if (rc == 0 && total_norm) *total_norm = total;
    return rc;
}
