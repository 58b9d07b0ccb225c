/* SPDX-License-Identifier: MIT */
/*
 * unit.c: FSDP units as objects: the per-rank registry (which module a unit wraps, which unit
 * owns a parameter), trees of units, small helpers the other files of src/fsdp share, and
 * destroy.
 *
 * Files of a unit's life (fsdp_impl.h has the objects): wrap.c builds units; hooks.c runs them
 * (unshard.c, grads.c, precision.c and streams.c do the work of the hooks); summon.c shows them
 * from outside; this file frees them.
 *
 * Invariants: every live unit of a rank is in its context's registry (ctx->fsdp) under its
 * module, until fsdp__unit_free; a unit of a tree is freed only with the whole tree (children
 * first), and units the user never destroyed are freed without communicating when the context
 * goes.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp/fsdp_impl.h"
#include "nn/nn_impl.h"
#include "tensor/tensor_impl.h"

bool fsdp__is_sharded(fsdp_sharding_strategy_t s) {
    return s != FSDP_NO_SHARD;
}

/* Whether the unsharded flat parameter has storage of its own (gathered, then freed). */
bool fsdp__separate_full(const fsdp_unit_t *u) {
    /* The configured compute dtype: with mixed precision full stays separate also while full
     * precision is forced (fsdp__mp_select), so its storage can change dtype. */
    return fsdp__is_sharded(u->opt.strategy) || u->opt.cpu_offload || u->mp_cdt != u->dt;
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

/* ---- per-rank registry ------------------------------------------------------------------------
 */

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

/* ---- trees of units ----------------------------------------------------------------------------
 */

fsdp_unit_t *fsdp__root_of(fsdp_unit_t *u) {
    while (u->parent)
        u = u->parent;
    return u;
}

/* A 1-D view of n elements of base starting at element off (relative to base's offset). */
int fsdp__view1d(fsdp_tensor_t *base, int64_t off, int64_t n, fsdp_tensor_t **out) {
    const int64_t shape[1] = {n}, stride[1] = {1};
    return fsdp__tensor_view(base, base->offset + off, 1, shape, stride, out);
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

int fsdp__push_unit(fsdp_unit_t ***arr, size_t *n, size_t *cap, fsdp_unit_t *u) {
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
    int rc = fsdp__push_unit(arr, n, cap, u);
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

const char *fsdp__unit_label(const fsdp_unit_t *u) {
    return u->fqn[0] ? u->fqn : "<root>";
}

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
    fsdp__unshard_free(u);
    fsdp_tensor_release(u->full);
    fsdp_tensor_release(u->full_grad);
    fsdp_tensor_release(u->local_grad);
    fsdp_tensor_release(u->summon_host);
    fsdp__drop_summon_views(u);
    fsdp_tensor_release(u->rs_in);
    fsdp_tensor_release(u->rs_out);
    fsdp__unit_streams_free(u);
    fsdp__mp_free(u);
    free(u->children);
    free(u->ignored);
    free(u->all);
    free(u->fwd_order);
    free(u->post_order);
    free(u->ag_queue);
    for (size_t i = 0; i < u->nfree_ev; i++)
        fsdp_event_destroy(u->free_ev[i]);
    free(u->free_ev);
    free(u->red_queue);
    free(u->fqn);
    fsdp_module_release(u->module);
    free(u);
}

int fsdp_unit_destroy(fsdp_unit_t *root) {
    if (!root) return FSDP_OK;
    if (root->parent)
        return fsdp__unit_err(root, FSDP_EINVAL,
                              "fsdp_unit_destroy: not a root unit (destroy its root)");
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
    for (size_t i = n; i-- > 0;)
        fsdp__unit_free(all[i]);
    free(all);
    return FSDP_OK;
}
