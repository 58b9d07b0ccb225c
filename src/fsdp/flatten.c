/* SPDX-License-Identifier: MIT */
/*
 * flatten.c: a wrapped unit's parameters become its flat parameter: the checks on what was
 * collected, sync_module_states, the move to options.device (buffers and parameters, each
 * tensor object kept, as PyTorch's `module.to(device_id)`), the shard and its views, and the
 * move of an adopted unit to the device of the unit adopting it.
 *
 * Invariants: every tensor object a user holds (parameters, buffers, gradients) stays the same
 * object: moves re-point it at new storage (fsdp__repoint); after flattening, each original
 * parameter views its part of the local shard, and the compute views view the unsharded flat
 * parameter.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp/fsdp_impl.h"
#include "nn/nn_impl.h"
#include "tensor/tensor_impl.h"

/* ---- moving tensors between devices ---------------------------------------------------------- */

/* Points t at src's elements, taking src's device too (set_data itself keeps the device). */
int fsdp__repoint(fsdp_tensor_t *t, fsdp_tensor_t *src) {
    fsdp_device_t *was = t->dev;
    t->dev = src->dev;
    int rc = fsdp__tensor_set_data(t, src);
    if (rc < 0) t->dev = was;
    return rc;
}

void fsdp__flat_requires_grad(fsdp_unit_t *u) {
    bool rg = false;
    for (int i = 0; i < u->nparams; i++)
        rg |= u->params[i].orig->requires_grad;
    u->flat->requires_grad = rg;
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
    if (rc == 0) rc = fsdp__xcopy(c, t);
    if (rc == 0 && t->grad) rc = fsdp__tensor_move(t->grad, dev);
    if (rc == 0) rc = fsdp__repoint(t, c);
    fsdp_tensor_release(c);
    return rc;
}

/* Checks what PyTorch's _validate_tensors_to_flatten checks. */
static int validate_params(fsdp_unit_t *u) {
    for (int i = 1; i < u->nparams; i++) {
        struct fsdp__param *a = &u->params[0], *b = &u->params[i];
        if (b->orig->dt != a->orig->dt)
            return fsdp__unit_err(u, FSDP_EINVAL,
                                  "parameters must have one dtype to be flattened: '%s' is %s but "
                                  "'%s' is %s",
                                  a->fqn, fsdp_dtype_name(a->orig->dt), b->fqn,
                                  fsdp_dtype_name(b->orig->dt));
        if (b->orig->dev != a->orig->dev)
            return fsdp__unit_err(u, FSDP_EINVAL,
                                  "parameters '%s' and '%s' are on different devices", a->fqn,
                                  b->fqn);
        if (!u->opt.use_orig_params && b->orig->requires_grad != a->orig->requires_grad)
            return fsdp__unit_err(u, FSDP_EINVAL,
                                  "parameters must have uniform requires_grad when use_orig_params "
                                  "is off: '%s' has %s but '%s' has %s",
                                  a->fqn, a->orig->requires_grad ? "true" : "false", b->fqn,
                                  b->orig->requires_grad ? "true" : "false");
    }
    return FSDP_OK;
}

/* sync_module_states: rank 0's values of every managed parameter and every buffer of the
 * subtree (outside nested units and ignored modules). */
int fsdp__sync_states(fsdp_unit_t *u, fsdp_module_t *m, bool top) {
    if (!top && (fsdp_unit_of(m) || fsdp__unit_ignores(u, m))) return FSDP_OK;
    int rc = FSDP_OK;
    for (size_t i = 0; i < m->nbuffers && rc == 0; i++) {
        fsdp_tensor_t *b = m->buffers[i].t;
        if (!fsdp_tensor_is_contiguous(b)) continue;
        rc = fsdp_pg_broadcast(u->pg, fsdp_tensor_data(b), fsdp_tensor_data(b),
                               (size_t)fsdp_tensor_numel(b), b->dt, 0, NULL);
    }
    for (size_t i = 0; i < m->nchildren && rc == 0; i++)
        rc = fsdp__sync_states(u, m->children[i].m, false);
    return rc;
}

/* Builds the flat parameter and its views from the collected parameters. */
int fsdp__flatten(fsdp_unit_t *u) {
    int rc = FSDP_OK;
    if (u->opt.device && !u->opt.cpu_offload) {
        /* PyTorch's device_id: the module moves to the compute device before it is flattened,
         * so the parameter objects themselves end up there (and sync_module_states broadcasts
         * on it). */
        for (int i = 0; i < u->nparams; i++) {
            if ((rc = fsdp__tensor_move(u->params[i].orig, u->opt.device)) < 0)
                return fsdp__unit_err(
                    u, rc, "moving parameter '%s' to options.device (%s) failed: %s",
                    u->params[i].fqn, fsdp_device_name(u->opt.device), fsdp_ctx_last_error(u->ctx));
        }
    }
    if ((rc = validate_params(u)) < 0) return rc;
    u->dt = u->params[0].orig->dt;
    /* Where the parameters are: the offload host, or (moved above) the compute device. */
    fsdp_device_t *pdev = u->params[0].orig->dev;
    u->dev = pdev;
    fsdp__mp_set_dtypes(u);
    if (u->opt.cpu_offload) {
        if (fsdp_device_kind(pdev) != FSDP_DEVICE_CPU)
            return fsdp__unit_err(
                u, FSDP_EINVAL,
                "an FSDP-managed module with parameter CPU offloading enabled has "
                "parameters on %s ('%s'); keep the module on the host until it is "
                "wrapped (options.device chooses the compute device)",
                fsdp_device_name(pdev), u->params[0].fqn);
        /* The shard and its gradient stay on the host the parameters are on; the unit computes
         * on options.device, or without it on the host itself (the category tells the offloaded
         * bytes apart then). */
        u->host_dev = pdev;
        if (u->opt.device) u->dev = u->opt.device;
        /* The shard and the sharded gradient (FSDP_MEM_OFFLOAD on the host) come from the
         * compute device's host memory when it has some (pinned memory for CUDA, so the copies
         * to and from it can be asynchronous); on a CPU compute device nothing changes. */
        if (u->dev != pdev && (rc = fsdp__device_pin_offload(pdev, u->dev)) < 0)
            return fsdp__unit_err(u, rc, "cannot set up the offload host memory on %s: %s",
                                  fsdp_device_name(pdev), fsdp_ctx_last_error(u->ctx));
    }
    int64_t *numel = calloc((size_t)u->nparams, sizeof *numel);
    if (!numel) return fsdp__unit_err(u, FSDP_ENOMEM, "out of memory");
    for (int i = 0; i < u->nparams; i++)
        numel[i] = fsdp_tensor_numel(u->params[i].orig);
    int align = u->opt.use_orig_params ? (int)(16 / fsdp_dtype_size(u->dt)) : 1;
    int world = fsdp__is_sharded(u->opt.strategy) ? u->world : 1;
    rc = fsdp__layout_build(u->nparams, numel, align, world, &u->layout);
    free(numel);
    if (rc < 0) return fsdp__unit_err(u, rc, "out of memory");
    int shard_rank = fsdp__is_sharded(u->opt.strategy) ? u->rank : 0;

    /* The unsharded flat parameter, filled from the parameters (padding zero), where they are. */
    const int64_t full_n[1] = {u->layout.padded_numel};
    FSDP_TRY(rc, out,
             fsdp__zeros_on(u, pdev, u->dt, u->layout.padded_numel, FSDP_MEM_PARAMS, &u->full));
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
        FSDP_TRY(rc, out,
                 fsdp__tensor_view(u->full, u->layout.offset[i], p->ndim, p->shape, NULL, &dst));
        fsdp__contiguous_strides(p->ndim, p->shape, dst->stride);
        rc = fsdp_tensor_copy_(dst, p->orig);
        fsdp_tensor_release(dst);
        if (rc < 0) goto out;
        fsdp__layout_shard_info(&u->layout, i, shard_rank, &p->sh);
    }

    /* The local shard. */
    const int64_t shard_n[1] = {u->layout.shard_numel};
    if (fsdp__separate_full(u)) {
        /* pdev is the offload host, or without offload the compute device. */
        FSDP_TRY(rc, out,
                 fsdp__tensor_new(u->ctx, pdev, u->dt, 1, shard_n,
                                  u->opt.cpu_offload ? FSDP_MEM_OFFLOAD : FSDP_MEM_PARAMS,
                                  &u->flat));
        fsdp_tensor_t *src = NULL;
        FSDP_TRY(rc, out,
                 fsdp__view1d(u->full, (int64_t)shard_rank * u->layout.shard_numel,
                              u->layout.shard_numel, &src));
        rc = fsdp_tensor_copy_(u->flat, src);
        fsdp_tensor_release(src);
        if (rc < 0) goto out;
        if (u->cdt != u->dt || u->dev != pdev) {
            /* Mixed precision: the unsharded parameter is gathered in the compute dtype; with
             * offload to another compute device, there. */
            fsdp_tensor_release(u->full);
            u->full = NULL;
            FSDP_TRY(
                rc, out,
                fsdp__tensor_new(u->ctx, u->dev, u->cdt, 1, full_n, FSDP_MEM_PARAMS, &u->full));
        }
        FSDP_TRY(rc, out, fsdp_tensor_storage_resize(u->full, 0));
        u->unsharded = false;
    } else {
        FSDP_TRY(rc, out, fsdp__view1d(u->full, 0, u->layout.shard_numel, &u->flat));
        u->unsharded = true;
    }
    /* The compute views: the original shapes at their offsets in the unsharded parameter. */
    for (int i = 0; i < u->nparams; i++) {
        struct fsdp__param *p = &u->params[i];
        FSDP_TRY(rc, out,
                 fsdp__tensor_view(u->full, u->layout.offset[i], p->ndim, p->shape, NULL, &p->cv));
        fsdp__contiguous_strides(p->ndim, p->shape, p->cv->stride);
        p->cv->requires_grad = p->orig->requires_grad;
        FSDP_TRY(rc, out, fsdp_tensor_set_name(p->cv, p->fqn));
    }
    fsdp__flat_requires_grad(u);
    FSDP_TRY(rc, out, fsdp_tensor_set_name(u->flat, "_flat_param"));

    /* The original objects become views of their part of the shard. */
    for (int i = 0; i < u->nparams; i++) {
        struct fsdp__param *p = &u->params[i];
        fsdp_tensor_t *v = NULL;
        FSDP_TRY(rc, out,
                 fsdp__view1d(u->flat, p->sh.in_shard ? p->sh.offset_in_shard : 0,
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
int fsdp__move_buffers(fsdp_unit_t *u, fsdp_module_t *m, bool top, fsdp_device_t *dev) {
    if (!top && (fsdp_unit_of(m) || fsdp__unit_ignores(u, m))) return FSDP_OK;
    int rc = FSDP_OK;
    for (size_t i = 0; i < m->nbuffers && rc == 0; i++)
        rc = fsdp__tensor_move(m->buffers[i].t, dev);
    for (size_t i = 0; i < m->nchildren && rc == 0; i++)
        rc = fsdp__move_buffers(u, m->children[i].m, false, dev);
    return rc;
}

/* Gives t (and its gradient) new storage on the same device, allocated under the storage's
 * category as the device routes it now; each tensor object is kept. */
static int fresh_storage(fsdp_tensor_t *t) {
    fsdp_tensor_t *c = NULL;
    int rc = fsdp__tensor_new(t->ctx, t->dev, t->dt, t->ndim, t->shape, t->st->cat, &c);
    if (rc == 0) rc = fsdp_tensor_copy_(c, t);
    if (rc == 0 && t->grad) rc = fresh_storage(t->grad);
    if (rc == 0) rc = fsdp__repoint(t, c);
    fsdp_tensor_release(c);
    return rc;
}

/* Moves an idle unit (wrapped earlier, now adopted) to compute on dev: its buffers, and the
 * shard with the original parameters (unless offloaded: those stay on the host), the unsharded
 * parameter and the compute views, each tensor object kept. */
static int unit_set_device(fsdp_unit_t *u, fsdp_device_t *dev) {
    if (u->state != FSDP_STATE_IDLE || u->ag_work || u->rs_in || u->full_grad)
        return fsdp__unit_err(u, FSDP_EINVAL,
                              "cannot move the unit to %s (options.device of the unit adopting it) "
                              "while it runs or is unsharded by the caller",
                              fsdp_device_name(dev));
    fsdp_tensor_t *v = NULL;
    int rc = fsdp__move_buffers(u, u->module, true, dev);
    if (rc < 0) goto fail;
    if (u->nparams == 0 || u->dev == dev) {
        u->dev = dev;
        return FSDP_OK;
    }
    if (u->unsharded && fsdp__separate_full(u) && (rc = fsdp__reshard(u)) < 0) goto fail;
    /* Whether the shard got new storage (the original parameters must view it again). */
    bool moved = false;
    if (!u->opt.cpu_offload) {
        if (fsdp__separate_full(u)) {
            rc = fsdp__tensor_move(u->flat, dev); /* its gradient too */
        } else {
            /* NO_SHARD: the shard is a view of the unsharded parameter. */
            rc = fsdp__tensor_move(u->full, dev);
            if (rc == 0) rc = fsdp__view1d(u->full, 0, u->layout.shard_numel, &v);
            if (rc == 0) rc = fsdp__repoint(u->flat, v);
            fsdp_tensor_release(v);
            v = NULL;
            if (rc == 0 && u->flat->grad) rc = fsdp__tensor_move(u->flat->grad, dev);
        }
        moved = true;
    } else {
        /* Offloaded: the shard stays on the host, but moves into the new compute device's host
         * memory when it has some (flatten's fsdp__device_pin_offload, for a unit that learns
         * its compute device only now). */
        int pin = fsdp__device_pin_offload(u->host_dev, dev);
        if (pin < 0) rc = pin;
        if (pin > 0) {
            rc = fresh_storage(u->flat); /* its gradient too */
            moved = true;
        }
    }
    if (rc < 0) goto fail;
    for (int i = 0; i < u->nparams && moved && rc == 0; i++) {
        struct fsdp__param *p = &u->params[i];
        rc = fsdp__view1d(u->flat, p->sh.in_shard ? p->sh.offset_in_shard : 0, p->sh.numel_in_shard,
                          &v);
        if (rc == 0) rc = fsdp__repoint(p->orig, v);
        fsdp_tensor_release(v);
        v = NULL;
        /* A moved shard's gradients are on dev already when they are; an offloaded shard got
         * fresh storage on the same host, so its views are redone regardless. */
        if (rc < 0 || !p->orig->grad || (!u->opt.cpu_offload && p->orig->grad->dev == dev))
            continue;
        if (u->opt.use_orig_params && u->flat->grad) {
            /* It viewed the old flat gradient: view the moved one. */
            rc = fsdp__view1d(u->flat->grad, p->sh.offset_in_shard, p->sh.numel_in_shard, &v);
            if (rc == 0) {
                fsdp_tensor_release(p->orig->grad);
                p->orig->grad = v;
                v = NULL;
            }
        } else {
            rc = fsdp__tensor_move(p->orig->grad, u->flat->dev);
        }
    }
    if (rc < 0) goto fail;
    if (fsdp__separate_full(u)) {
        const int64_t n[1] = {u->layout.padded_numel};
        rc = fsdp__tensor_new(u->ctx, dev, u->cdt, 1, n, FSDP_MEM_PARAMS, &v);
        if (rc == 0) rc = fsdp__repoint(u->full, v);
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
            rc = fsdp__repoint(p->cv, v);
        }
        fsdp_tensor_release(v);
        v = NULL;
    }
    if (rc < 0) goto fail;
    u->dev = dev;
    return FSDP_OK;
fail:
    return fsdp__unit_err(u, rc,
                          "moving the unit to %s (options.device of the unit adopting it) "
                          "failed: %s",
                          fsdp_device_name(dev), fsdp_ctx_last_error(u->ctx));
}

/* A unit adopted by a wrap with options.device takes that device unless its own option is set,
 * and so do the units below it (PyTorch's nested instances compute on the root's device). */
int fsdp__inherit_device(fsdp_unit_t *c, fsdp_device_t *dev) {
    if (c->opt.device) return FSDP_OK;
    int rc = unit_set_device(c, dev);
    if (rc < 0) return rc;
    c->opt.device = dev;
    for (size_t i = 0; i < c->nchildren && rc == 0; i++)
        rc = fsdp__inherit_device(c->children[i], dev);
    return rc;
}
