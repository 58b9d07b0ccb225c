/* SPDX-License-Identifier: MIT */
/*
 * summon.c: FSDP units seen from outside: navigation and listings (units, named parameters,
 * stats), summons (fsdp_summon_begin/end) and the explicit fsdp_unit_unshard/reshard.
 *
 * A summoned unit is in FSDP_STATE_SUMMON and its module slots show the full parameters: the
 * compute views, or (offload_to_cpu, mixed precision) views of a full-precision copy in
 * summon_host. A summon is all or nothing per call: the units the running fsdp_summon_begin
 * summoned are marked (summon_this_call), and on failure only those are ended, without
 * writeback.
 */
#include <stdlib.h>
#include <string.h>

#include "fsdp/fsdp_impl.h"
#include "nn/nn_impl.h"
#include "tensor/tensor_impl.h"

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
        return fsdp__unit_err(u, FSDP_EINVAL,
                              "fsdp_unit_param_info: index %zu, but the unit has %d "
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
    int rc = fsdp__collect_units((fsdp_unit_t *)root, units, n, &cap);
    if (rc < 0) {
        free(*units);
        *units = NULL;
        *n = 0;
        return fsdp__unit_err(root, FSDP_ENOMEM, "out of memory");
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
            char *name = fsdp__join_name(units[i]->fqn, "_flat_param");
            if (!name) {
                rc = fsdp__unit_err(root, FSDP_ENOMEM, "out of memory");
                break;
            }
            rc = fsdp__list_push(out, &cap, name, units[i]->flat, units[i]->module);
            free(name);
        }
        free(units);
        /* Parameters no unit manages (ignored modules). */
        for (size_t i = 0; i < all.n && rc == 0; i++)
            if (!fsdp__owner_of_param(root->ctx, all.tensors[i], NULL))
                rc = fsdp__list_push(out, &cap, all.names[i], all.tensors[i], all.modules[i]);
    }
    fsdp_named_list_free(&all);
    if (rc < 0) fsdp_named_list_free(out);
    return rc;
}

/* ---- summon and explicit unshard ------------------------------------------------------------ */

/* Summon's offload_to_cpu and the state dicts' (fsdp_impl.h). */
fsdp_device_t *fsdp__host_device(const fsdp_unit_t *u) {
    if (u->host_dev) return u->host_dev;
    if (fsdp_device_kind(u->dev) == FSDP_DEVICE_CPU) return u->dev;
    return fsdp__ctx_cpu_device(u->ctx);
}

static const fsdp__abi_struct_t summon_options_abi =
    FSDP__ABI_STRUCT(fsdp_summon_options_t, "fsdp_summon_options_init", with_grads);

void(fsdp_summon_options_init)(fsdp_summon_options_t *o, size_t size) {
    fsdp_summon_options_t d;
    memset(&d, 0, sizeof d);
    d.recurse = true;
    d.writeback = true;
    fsdp__abi_init(o, size, &d, &summon_options_abi);
}

/* Points u's module slots at views of `base` (a full flat tensor) with the parameters' shapes;
 * the views are kept in u->summon_views so that the end of the summon can drop them. */
static int slots_to_views_of(fsdp_unit_t *u, fsdp_tensor_t *base) {
    u->summon_views = calloc((size_t)u->nparams, sizeof *u->summon_views);
    if (!u->summon_views) return fsdp__unit_err(u, FSDP_ENOMEM, "out of memory");
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

void fsdp__drop_summon_views(fsdp_unit_t *u) {
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
    if (!fsdp__is_sharded(u->opt.strategy)) {
        rc = fsdp__tensor_new(u->ctx, dev, u->dt, 1, n, cat, out);
        if (rc == 0) rc = fsdp__xcopy(*out, u->flat);
        goto done;
    }
    /* The collective runs on the compute device: an offloaded shard goes there first, and the
     * result goes to dev afterwards when that is another device. */
    if (u->flat->dev != u->dev) {
        rc = fsdp__tensor_new(u->ctx, u->dev, u->dt, 1, sn, FSDP_MEM_COMM, &staged);
        if (rc == 0) rc = fsdp__xcopy(staged, u->flat);
        src = staged;
    }
    if (rc == 0)
        rc = fsdp__tensor_new(u->ctx, u->dev, u->dt, 1, n, dev == u->dev ? cat : FSDP_MEM_COMM,
                              &g);
    if (rc == 0) {
        rc = fsdp_pg_all_gather(u->pg, fsdp_tensor_data(src), fsdp_tensor_data(g),
                                (size_t)u->layout.shard_numel, u->dt, NULL);
        if (rc < 0) rc = fsdp__unit_err(u, rc, "all-gather of the full parameters failed: %s",
                                        fsdp_pg_last_error(u->pg));
    }
    fsdp_tensor_release(staged);
    if (rc == 0 && dev != u->dev) {
        rc = fsdp__tensor_new(u->ctx, dev, u->dt, 1, n, cat, out);
        if (rc == 0) rc = fsdp__xcopy(*out, g);
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
    if (u->nparams == 0 || !fsdp__any_requires_grad(u)) return FSDP_OK;
    fsdp__drop_cleared_flat_grad(u);
    int rc =
        fsdp__zeros_on(u, u->dev, u->dt, u->layout.padded_numel, FSDP_MEM_GRADS, &u->full_grad);
    if (rc < 0) return rc;
    fsdp_tensor_t *g = u->flat->grad, *staged = NULL;
    /* The sharded gradient is gathered in the parameters' dtype: one kept in param_dtype
     * (keep_low_precision_grads) or on the host is staged as such first. */
    if (!g || g->dev != u->dev || g->dt != u->dt) {
        rc = fsdp__zeros_on(u, u->dev, u->dt, u->layout.shard_numel, FSDP_MEM_COMM, &staged);
        if (rc == 0 && g) rc = fsdp__xcopy(staged, g);
        if (rc < 0) {
            fsdp_tensor_release(staged);
            return rc;
        }
        g = staged;
    }
    if (fsdp__is_sharded(u->opt.strategy)) {
        rc = fsdp_pg_all_gather(u->pg, fsdp_tensor_data(g), fsdp_tensor_data(u->full_grad),
                                (size_t)u->layout.shard_numel, u->dt, NULL);
    } else {
        rc = fsdp_tensor_copy_(u->full_grad, g); /* NO_SHARD: the gradient is already full */
    }
    fsdp_tensor_release(staged);
    if (rc < 0) return fsdp__unit_err(u, rc, "gathering the gradients failed: %s",
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
        return fsdp__unit_err(u, FSDP_EINVAL, "%s: the unit is %s",
                              explicit_unshard ? "fsdp_unit_unshard" : "fsdp_summon_begin",
                              u->state == FSDP_STATE_SUMMON ? "already unsharded by the caller"
                                                            : "in forward or backward");
    /* PyTorch's pre-unshard: original parameters the user replaced go into the shard first
     * (and unsharded parameters gathered before are dropped). */
    int wrc = fsdp__writeback_orig_params(u, false);
    if (wrc < 0) return wrc;
    u->was_unsharded = u->unsharded;
    u->summon = *o;
    u->summon_this_call = true;
    bool show = !o->rank0_only || u->rank == 0;
    int rc = FSDP_OK;
    if (u->nparams > 0 && (o->offload_to_cpu || u->cdt != u->dt)) {
        /* A full-precision copy (PyTorch forces full precision here), on the host with
         * offload_to_cpu; the compute-dtype buffer is left alone. */
        fsdp_device_t *where = o->offload_to_cpu ? fsdp__host_device(u) : u->dev;
        rc = where ? gather_full_precision(u, where,
                                           o->offload_to_cpu ? FSDP_MEM_OFFLOAD : FSDP_MEM_PARAMS,
                                           &u->summon_host)
                   : fsdp__unit_err(u, FSDP_ENOMEM,
                                    "fsdp_summon_begin: offload_to_cpu: the context's CPU "
                                    "device could not be made");
        u->state = FSDP_STATE_SUMMON;
        if (rc == 0 && show) rc = slots_to_views_of(u, u->summon_host);
        if (rc == 0 && o->with_grads) rc = summon_grads(u, show ? u->summon_views : NULL);
        if (rc == 0 && !show) {
            fsdp_tensor_release(u->summon_host);
            u->summon_host = NULL;
        }
        return rc;
    }
    rc = fsdp__unshard(u);
    if (rc < 0) return rc;
    u->state = FSDP_STATE_SUMMON;
    if (o->with_grads && (rc = summon_grads(u, NULL)) < 0) return rc;
    if (show) fsdp__swap_slots(u, true);
    else if (!u->was_unsharded && fsdp__separate_full(u))
        rc = fsdp__reshard(u); /* rank0_only elsewhere */
    return rc;
}

static int summon_end_one(fsdp_unit_t *u) {
    if (u->state != FSDP_STATE_SUMMON) return FSDP_OK;
    int rc = FSDP_OK;
    bool offloaded = u->summon_host != NULL;
    fsdp__swap_slots(u, false);
    fsdp__drop_summon_views(u);
    if (u->nparams > 0 && u->summon.writeback && (fsdp__separate_full(u) || offloaded)) {
        /* Only this rank's part of the full parameters persists, as in PyTorch. */
        int shard_rank = fsdp__is_sharded(u->opt.strategy) ? u->rank : 0;
        fsdp_tensor_t *src = NULL;
        rc = fsdp__view1d(offloaded ? u->summon_host : u->full,
                          (int64_t)shard_rank * u->layout.shard_numel, u->layout.shard_numel, &src);
        if (rc == 0) rc = fsdp__xcopy(u->flat, src);
        fsdp_tensor_release(src);
    }
    fsdp_tensor_release(u->summon_host);
    u->summon_host = NULL;
    fsdp__drop_cv_grads(u);
    fsdp_tensor_release(u->full_grad);
    u->full_grad = NULL;
    /* After a writeback the shard is the truth: an unsharded parameter kept from before the
     * summon (a no-reshard strategy after forward; in the compute dtype with mixed precision)
     * is stale, so it goes and the next forward gathers the shard again. */
    bool wrote = u->nparams > 0 && u->summon.writeback && (fsdp__separate_full(u) || offloaded);
    if ((!u->was_unsharded || wrote) && u->unsharded) {
        int r = fsdp__reshard(u);
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

int fsdp_summon_begin(fsdp_unit_t *u, const fsdp_summon_options_t *user_o) {
    if (!u) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_summon_begin: unit is NULL");
    int rc = fsdp__abi_check(u->ctx, "fsdp_summon_begin", "o", user_o, &summon_options_abi);
    if (rc < 0) return rc;
    /* The units keep a copy (u->summon), of this library's layout. */
    fsdp_summon_options_t oc;
    fsdp_summon_options_init(&oc);
    if (user_o) fsdp__abi_copy_in(&oc, user_o, &summon_options_abi);
    const fsdp_summon_options_t *o = &oc;
    if (fsdp_in_backward(u->ctx))
        return fsdp__unit_err(u, FSDP_EINVAL, "fsdp_summon_begin: not allowed during backward");
    if (o->rank0_only && o->writeback)
        return fsdp__unit_err(u, FSDP_EINVAL,
                              "fsdp_summon_begin: rank0_only with writeback is not supported (the "
                              "other ranks would have nothing to write back)");
    if (o->with_grads && !u->opt.use_orig_params)
        return fsdp__unit_err(u, FSDP_EINVAL,
                              "fsdp_summon_begin: with_grads needs use_orig_params");
    if (o->with_grads && o->offload_to_cpu)
        return fsdp__unit_err(
            u, FSDP_EINVAL, "fsdp_summon_begin: with_grads cannot be combined with offload_to_cpu");
    rc = summon_rec(u, o, true);
    rollback_summon(u, rc < 0);
    return rc;
}

int fsdp_summon_end(fsdp_unit_t *u) {
    if (!u) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_summon_end: unit is NULL");
    if (u->state != FSDP_STATE_SUMMON)
        return fsdp__unit_err(u, FSDP_EINVAL, "fsdp_summon_end without fsdp_summon_begin");
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
        return fsdp__unit_err(u, FSDP_EINVAL, "fsdp_unit_reshard without fsdp_unit_unshard");
    return summon_end_one(u);
}
