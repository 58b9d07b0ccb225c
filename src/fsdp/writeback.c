/* SPDX-License-Identifier: MIT */
/*
 * writeback.c: with use_orig_params, changes the user made to an original parameter object
 * outside FSDP's knowledge go back into the unit's flat shard (PyTorch's
 * FlatParamHandle._writeback_orig_params, run from pre_unshard).
 *
 * Outside forward each original parameter views its part of the local shard (a 1-D tensor of
 * numel_in_shard elements) and, after backward, its .grad views its part of the sharded
 * gradient. In-place changes need nothing. What is detected and written back:
 *   parameter  the module slot holds another tensor object (PyTorch's `module.w = Parameter(..)`,
 *              here fsdp_module_set_param), which the unit adopts as the original parameter, or
 *              the object's data no longer views the shard (`w.data = ...`, here
 *              fsdp_tensor_set_data): the values are copied into the shard and the object views
 *              the shard again;
 *   gradient   a gradient set to none while the flat parameter has a gradient: its part of the
 *              sharded gradient is zeroed, so the next backward does not add to a gradient the
 *              user dropped; a gradient that is not the view into the sharded gradient (a new
 *              tensor, or new data): copied into it (allocating a zeroed sharded gradient when
 *              there was none) and replaced by the view.
 * A replacement must have the shape of the part it replaces, [numel_in_shard], and the
 * parameters' dtype; otherwise FSDP_EINVAL "Cannot writeback when the parameter (gradient) shape
 * changes" naming the parameter, the rank and both shapes. The check runs where PyTorch runs it:
 * before a unit gathers its parameters for forward, at its first pre-backward hook of a backward,
 * and at a summon or explicit unshard. A unit that keeps its unsharded parameters from forward to
 * backward (SHARD_GRAD_OP, HYBRID_SHARD_ZERO2) cannot take a change between the two: the forward
 * computed with the kept parameters and the backward would too, so that is FSDP_EINVAL "FSDP
 * does not support changing the parameters between forward and backward". Any other unit
 * holding unsharded parameters when a parameter was written back frees them, so that the next
 * gather shows the new values. FSDP_SKIP_WRITEBACK_CHECK=1 in the environment at wrap time skips
 * the check (PyTorch's variable of that name).
 *
 * Invariant: nothing reads the shard while it is written here (quiesce: an all-gather still
 * in flight is waited for, and its unsharded parameters freed).
 *
 * The errors are local: each rank reports what it detects on its own shard before any
 * collective of the unshard, so a change made on one rank only fails there, and the other
 * ranks wait in the collective (as PyTorch's do). Make such changes on every rank alike.
 */
#include <stdio.h>

#include "fsdp/fsdp_impl.h"
#include "nn/nn_impl.h"
#include "tensor/tensor_impl.h"

/* Whether t is exactly the 1-D view of n elements at element `off` of base's storage. */
static bool is_view_of(const fsdp_tensor_t *t, const fsdp_tensor_t *base, int64_t off, int64_t n) {
    if (!t || !base || t->st != base->st || t->dt != base->dt || t->dev != base->dev) return false;
    if (t->ndim != 1 || t->shape[0] != n) return false;
    if (n > 1 && t->stride[0] != 1) return false;
    return n == 0 || t->offset == base->offset + off;
}

static char *shape_of(const fsdp_tensor_t *t, char *buf, size_t len) {
    return fsdp__shape_str(t->ndim, t->shape, buf, len);
}

/* The tensor a slot of parameter i holds now when it is another object than the one the unit
 * knows, else NULL. */
static fsdp_tensor_t *replaced_object(const fsdp_unit_t *u, int i) {
    for (size_t s = 0; s < u->nslots; s++) {
        const struct fsdp__slotref *sr = &u->slots[s];
        if (sr->param != i) continue;
        fsdp_tensor_t *t = sr->m->params[sr->slot].t;
        if (t && t != u->params[i].orig) return t;
    }
    return NULL;
}

/* Parameter i's object becomes t (a tensor the user put in one of its module slots): every slot
 * of the parameter holds t, and t is the original parameter from now on. */
static void adopt_object(fsdp_unit_t *u, int i, fsdp_tensor_t *t) {
    struct fsdp__param *p = &u->params[i];
    for (size_t s = 0; s < u->nslots; s++) {
        struct fsdp__slotref *sr = &u->slots[s];
        if (sr->param != i) continue;
        struct fsdp__slot *slot = &sr->m->params[sr->slot];
        if (slot->t == t) continue;
        fsdp_tensor_retain(t);
        fsdp_tensor_release(slot->t);
        slot->t = t;
    }
    fsdp_tensor_retain(t);
    fsdp_tensor_release(p->orig);
    p->orig = t;
    fsdp_tensor_set_name(t, p->fqn);
    p->cv->requires_grad = t->requires_grad;
}

/* Writes parameter i's values back into the shard and points its object at the shard again. */
static int writeback_param(fsdp_unit_t *u, int i, fsdp_tensor_t *t) {
    struct fsdp__param *p = &u->params[i];
    int64_t off = p->sh.in_shard ? p->sh.offset_in_shard : 0, n = p->sh.numel_in_shard;
    char a[64], b[64];
    if (t->ndim != 1 || t->shape[0] != n) {
        const int64_t want[1] = {n};
        return fsdp__unit_err(u, FSDP_EINVAL,
                              "Cannot writeback when the parameter shape changes: '%s' expects "
                              "%s (its part of rank %d's shard) but got %s",
                              p->fqn, fsdp__shape_str(1, want, a, sizeof a), u->rank,
                              shape_of(t, b, sizeof b));
    }
    if (t->dt != u->flat->dt)
        return fsdp__unit_err(u, FSDP_EINVAL,
                              "Cannot writeback when the parameter dtype changes: '%s' is %s but "
                              "the flat parameter is %s",
                              p->fqn, fsdp_dtype_name(t->dt), fsdp_dtype_name(u->flat->dt));
    if (n > 0 && !t->st->ptr)
        return fsdp__unit_err(u, FSDP_EINVAL,
                              "Cannot writeback parameter '%s': its new storage has been freed",
                              p->fqn);
    fsdp_tensor_t *v = NULL;
    int rc = fsdp__view1d(u->flat, off, n, &v);
    if (rc == 0 && n > 0) rc = fsdp__xcopy(v, t);
    if (rc == 0) rc = fsdp__repoint(t, v);
    fsdp_tensor_release(v);
    if (rc < 0)
        rc = fsdp__unit_err(u, rc, "writing parameter '%s' back into the shard failed: %s", p->fqn,
                            fsdp_ctx_last_error(u->ctx));
    return rc;
}

/* Writes parameter i's gradient back into the sharded gradient (see the top of the file). */
static int writeback_grad(fsdp_unit_t *u, int i) {
    struct fsdp__param *p = &u->params[i];
    fsdp_tensor_t *t = p->orig, *fg = u->flat->grad, *v = NULL;
    int64_t off = p->sh.in_shard ? p->sh.offset_in_shard : 0, n = p->sh.numel_in_shard;
    int rc = FSDP_OK;
    if (!t->grad) {
        if (!fg || n == 0) return FSDP_OK;
        rc = fsdp__view1d(fg, off, n, &v);
        if (rc == 0) rc = fsdp_tensor_zero_(v);
        goto out;
    }
    if (fg && is_view_of(t->grad, fg, off, n)) return FSDP_OK;
    if (t->grad->ndim != 1 || t->grad->shape[0] != n) {
        char a[64], b[64];
        const int64_t want[1] = {n};
        return fsdp__unit_err(u, FSDP_EINVAL,
                              "Cannot writeback when the gradient shape changes: the gradient of "
                              "'%s' expects %s (its part of rank %d's shard) but got %s",
                              p->fqn, fsdp__shape_str(1, want, a, sizeof a), u->rank,
                              shape_of(t->grad, b, sizeof b));
    }
    if (!fg) {
        rc = fsdp__zeros_on(u, u->flat->dev, fsdp__mp_grad_dtype(u), u->layout.shard_numel,
                            FSDP_MEM_GRADS, &fg);
        if (rc < 0) goto out;
        u->flat->grad = fg;
    }
    rc = fsdp__view1d(fg, off, n, &v);
    if (rc == 0 && n > 0) rc = fsdp__xcopy(v, t->grad);
    if (rc == 0) {
        fsdp_tensor_release(t->grad);
        t->grad = fsdp_tensor_retain(v);
    }
out:
    fsdp_tensor_release(v);
    if (rc < 0)
        rc = fsdp__unit_err(u, rc, "writing the gradient of '%s' back failed: %s", p->fqn,
                            fsdp_ctx_last_error(u->ctx));
    return rc;
}

/* Before the first write into u's shard: unsharded parameters gathered from it are stale and
 * go (the next unshard gathers again), which also waits for an all-gather still reading the
 * shard (a prefetch); and the compute stream, which waited for that all-gather and for the copy
 * of an offloaded shard to the device, is drained, so no device copy reads the shard while the
 * host writes it. */
static int quiesce(fsdp_unit_t *u) {
    int rc = FSDP_OK;
    if (u->unsharded && fsdp__separate_full(u)) rc = fsdp__reshard(u);
    if (rc == 0) rc = u->dev->ops->stream_sync(u->dev, NULL);
    if (rc < 0)
        rc = fsdp__unit_err(u, rc, "before writing changed parameters back: %s",
                            fsdp_ctx_last_error(u->ctx));
    return rc;
}

int fsdp__writeback_orig_params(fsdp_unit_t *u, bool from_hook) {
    if (!u->opt.use_orig_params || u->nparams == 0 || !u->flat || u->skip_writeback_check ||
        u->slots_swapped)
        return FSDP_OK;
    /* Parameters kept unsharded from a forward for its backward (PyTorch's skipped sharded
     * views): a change now would not reach the computation. */
    bool kept =
        from_hook && u->needs_pre_backward &&
        (u->opt.strategy == FSDP_SHARD_GRAD_OP || u->opt.strategy == FSDP_HYBRID_SHARD_ZERO2);
    bool wrote = false;
    int rc = FSDP_OK;
    for (int i = 0; i < u->nparams && rc == 0; i++) {
        struct fsdp__param *p = &u->params[i];
        int64_t off = p->sh.in_shard ? p->sh.offset_in_shard : 0;
        fsdp_tensor_t *obj = replaced_object(u, i);
        fsdp_tensor_t *t = obj ? obj : p->orig;
        if (obj || !is_view_of(t, u->flat, off, p->sh.numel_in_shard)) {
            if (kept) {
                rc = fsdp__unit_err(u, FSDP_EINVAL,
                                    "FSDP does not support changing the parameters between "
                                    "forward and backward for %s: '%s' %s after the forward",
                                    fsdp_sharding_strategy_name(u->opt.strategy), p->fqn,
                                    obj ? "was replaced by another tensor"
                                        : "no longer views its part of the shard");
                break;
            }
            if (!wrote) rc = quiesce(u);
            if (rc == 0) rc = writeback_param(u, i, t);
            if (rc == 0 && obj) adopt_object(u, i, obj);
            wrote = true;
        }
        if (rc == 0) rc = writeback_grad(u, i);
    }
    if (rc == 0 && wrote) fsdp__flat_requires_grad(u);
    /* The shard was written on the compute stream inside an iteration: the all-gather stream,
     * ordered after it at the root's pre-forward, is ordered after it again. */
    fsdp_unit_t *root = fsdp__root_of(u);
    if (rc == 0 && wrote && root->ag_ordered) rc = fsdp__ag_stream_begin(root);
    return rc;
}

bool fsdp__skip_writeback_env(void) {
    return fsdp__env_is("FSDP_SKIP_WRITEBACK_CHECK", "1");
}
