/* SPDX-License-Identifier: MIT */
/*
 * hooks.c: the FSDP runtime, driven by the hooks fsdp_wrap installs on each unit's module:
 *   forward pre-hook   (root: lazy init, new iteration) write back changed original
 *                      parameters, unshard, slots -> compute views, forward prefetch
 *   forward hook       slots -> original objects, reshard unless kept, record the order
 *   backward pre-hook  (the exit mark: the outputs' gradients are ready) queue the final
 *                      callback, write back changed original gradients, unshard,
 *                      BACKWARD_PRE prefetch, point the compute views' gradients into a zeroed
 *                      unsharded flat gradient
 *   backward hook      (the entry mark of the unit's first invocation) reshard,
 *                      BACKWARD_POST prefetch, start the gradient reduction
 *   final callback     catch-all reshard, wait for every reduction, store sharded gradients
 * and the execution-order check that forward prefetch relies on. What the hooks do to the
 * parameters is in unshard.c, to the gradients in grads.c, to dtypes in precision.c.
 *
 * Activation checkpointing: a unit called inside a recompute region runs twice. The first run
 * (grad mode off) keeps its parameters as a forward with grad would; the re-run during
 * backward unshards the unit again and counts as its forward (recompute_pre_forward), so the
 * backward hooks recorded on the region's tape find it ready.
 *
 * Invariants: a module slot holds a compute view exactly while its unit is in forward, in its
 * backward (from the backward pre-hook to the reshard, so that a region re-run inside the unit
 * computes with the full parameters), or summoned; the root's fwd_order is the first iteration's
 * order of pre-forwards, post_order this iteration's order of forwards (the backward prefetch
 * follows it in reverse); the final callback is queued once per backward (cb_queued) and leaves
 * every unit idle.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autograd/autograd_impl.h"
#include "core/trace.h"
#include "fsdp/fsdp_impl.h"
#include "nn/nn_impl.h"
#include "tensor/tensor_impl.h"

static bool reshard_after_forward(fsdp_sharding_strategy_t s) {
    return s == FSDP_FULL_SHARD || s == FSDP_HYBRID_SHARD;
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

/* ---- lazy init and the root's pre-forward ------------------------------------------------------
 */

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
        int rc2 = fsdp__mp_cast_buffers(u, u->module, true);
        if (rc2 < 0)
            return fsdp__unit_err(u, rc2,
                                  "casting buffers to the mixed-precision buffer dtype "
                                  "failed: %s",
                                  fsdp_ctx_last_error(u->ctx));
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
            return fsdp__unit_err(u, FSDP_EINVAL,
                                  "forward while the unit is unsharded by "
                                  "fsdp_summon_begin or fsdp_unit_unshard");
        if (fresh) {
            u->fwd_invocations = 0;
            u->needs_pre_backward = false;
            u->needs_recompute = false;
            u->bwd_pending = 0;
        }
        if (u->state != FSDP_STATE_IDLE && !fsdp_in_backward(u->ctx)) {
            fsdp__swap_slots(u, false);
            u->state = FSDP_STATE_IDLE;
        }
        fsdp__drop_cleared_flat_grad(u);
    }
    /* Full precision in eval (use_full_prec_in_eval), or back to mixed precision. */
    if ((rc = fsdp__mp_select(root)) < 0) return rc;
    root->npost = 0;
    root->nred = 0; /* a reduction left over by a failed backward is finished by the next
                     * final callback, which goes over every unit */
    root->fwd_pos = 0;
    /* Last: the optimizer's and the casts' writes to the shards are behind this point. */
    return fsdp__ag_stream_begin(root);
}

/* ---- the execution order ----------------------------------------------------------------------
 */

static size_t unit_index(const fsdp_unit_t *root, const fsdp_unit_t *u) {
    for (size_t i = 0; i < root->nall; i++)
        if (root->all[i] == u) return i;
    return root->nall;
}

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
                k, fsdp__unit_label(u), want ? fsdp__unit_label(want) : "(none)");
        if (!root->order_warned)
            fsdp_log(u->ctx, FSDP_LOG_WARN,
                     "FSDP: the forward order changed after the first iteration (unit #%zu is "
                     "'%s', was '%s')",
                     k, fsdp__unit_label(u), want ? fsdp__unit_label(want) : "(none)");
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
        const char *a =
            all[0] >= 0 && (size_t)all[0] < root->nall ? fsdp__unit_label(root->all[all[0]]) : "?";
        const char *b =
            all[r] >= 0 && (size_t)all[r] < root->nall ? fsdp__unit_label(root->all[all[r]]) : "?";
        rc =
            fsdp__unit_err(u, FSDP_EINVAL,
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

/* ---- forward ----------------------------------------------------------------------------------
 */

/* A forward whose backward will come: one more invocation for the backward hooks to wait for
 * (the hooks count as registered at the first of an iteration). */
static void count_invocation(fsdp_unit_t *u) {
    u->fwd_invocations++;
    u->needs_pre_backward = true;
    if (u->fwd_invocations == 1) {
        u->stats.n_pre_bwd_registered++;
        if (fsdp__any_requires_grad(u)) u->stats.n_post_bwd_registered++;
    }
}

/* A unit whose call is the recomputation of a region (activation checkpointing around the unit
 * or around a module holding it): the first run kept nothing for backward, so the unit is
 * unsharded again (an all-gather if it was resharded), runs with its compute views, and counts
 * as an invocation whose backward comes next, on the region's tape. It stays unsharded after
 * the call: its backward pre-hook follows at once. The execution order, prefetch and writeback
 * belong to the first run. */
static int recompute_pre_forward(fsdp_unit_t *u, int nin, fsdp_tensor_t **in) {
    int rc;
    if (u->state == FSDP_STATE_SUMMON)
        return fsdp__unit_err(u, FSDP_EINVAL,
                              "recomputing a checkpointed region while the unit is unsharded by "
                              "fsdp_summon_begin or fsdp_unit_unshard");
    if (u->state == FSDP_STATE_BACKWARD_POST) u->fwd_invocations = 0; /* a second region */
    u->needs_recompute = false;
    u->state = FSDP_STATE_FORWARD;
    if ((rc = fsdp__mp_cast_forward_inputs(u, u == fsdp__root_of(u), nin, in)) < 0) return rc;
    if ((rc = fsdp__unshard(u)) < 0) return rc;
    fsdp__swap_slots(u, true);
    count_invocation(u);
    return FSDP_OK;
}

int fsdp__forward_pre_hook(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t **in) {
    (void)m;
    fsdp_unit_t *u = arg;
    fsdp_unit_t *root = fsdp__root_of(u);
    int rc;
    bool recompute = fsdp_in_backward(u->ctx); /* a recompute region re-running the module */
    if (fsdp__tracing(u->ctx))
        fsdp__trace_begin(u->ctx, recompute ? FSDP__TRACE_RECOMPUTE : FSDP__TRACE_FORWARD,
                          fsdp__unit_label(u));
    if (u == root && !recompute && (rc = root_pre_forward(root)) < 0) return rc;
    if (u->cast_io && (rc = fsdp__mp_cast_io_inputs(u, nin, in)) < 0) return rc;
    /* Re-run inside the unit's own backward (a region within the unit): the backward pre-hook
     * has unsharded it and put the compute views in place already. */
    if (recompute && u->state == FSDP_STATE_BACKWARD_PRE) return FSDP_OK;
    if (recompute) return recompute_pre_forward(u, nin, in);
    if (u->state == FSDP_STATE_SUMMON)
        return fsdp__unit_err(u, FSDP_EINVAL,
                              "forward while the unit is unsharded by "
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
    if ((rc = fsdp__mp_cast_forward_inputs(u, u == root, nin, in)) < 0) return rc;
    if (!root->fwd_order_done &&
        fsdp__push_unit(&root->fwd_order, &root->nfwd, &root->capfwd, u) < 0)
        return fsdp__unit_err(u, FSDP_ENOMEM, "out of memory");
    /* PyTorch's pre-unshard: original parameters the user replaced go into the shard first. */
    if ((rc = fsdp__writeback_orig_params(u, true)) < 0) return rc;
    if ((rc = fsdp__unshard(u)) < 0) return rc;
    fsdp__swap_slots(u, true);
    if (u->opt.forward_prefetch) {
        fsdp_unit_t *next = next_in_forward_order(root, u);
        if (next && !next->unsharded && (rc = fsdp__unshard_issue(next, true)) < 0) return rc;
    }
    if (fsdp_is_grad_enabled(u->ctx) && u->nparams >= 0) count_invocation(u);
    return FSDP_OK;
}

static int forward_hook(fsdp_unit_t *u, int nout, fsdp_tensor_t **out) {
    fsdp_unit_t *root = fsdp__root_of(u);
    int rc = FSDP_OK;
    if ((rc = fsdp__mp_cast_io_outputs(u, nout, out)) < 0) return rc;
    if (fsdp_in_backward(u->ctx)) {
        if (u->state == FSDP_STATE_FORWARD) { /* the end of recompute_pre_forward's call */
            fsdp__swap_slots(u, false);
            u->state = FSDP_STATE_IDLE;
        }
        return FSDP_OK;
    }
    fsdp__swap_slots(u, false);
    if (u == root) root->fwd_order_done = true;
    if (fsdp__push_unit(&root->post_order, &root->npost, &root->cappost, u) < 0)
        return fsdp__unit_err(u, FSDP_ENOMEM, "out of memory");
    /* Without grad no backward will free the parameters, so they go now; but the first run of
     * a recompute region will be differentiated (its backward re-runs it). */
    bool in_region = fsdp__in_region_first_run(u->ctx);
    bool grad = fsdp_is_grad_enabled(u->ctx) || in_region;
    if (in_region) u->needs_recompute = true;
    if (!grad || (u != root && reshard_after_forward(u->opt.strategy))) rc = fsdp__reshard(u);
    /* A forward without grad ends its iteration: whatever writes the shards next (a state dict
     * load, the user) is not ordered before the all-gather stream. */
    if (u == root && !grad) fsdp__ag_stream_end(root);
    u->state = FSDP_STATE_IDLE;
    return rc;
}

int fsdp__forward_hook(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t *const *in, int nout,
                       fsdp_tensor_t **out) {
    (void)m, (void)nin, (void)in;
    fsdp_unit_t *u = arg;
    int rc = forward_hook(u, nout, out);
    if (fsdp__tracing(u->ctx))
        fsdp__trace_end(u->ctx,
                        fsdp_in_backward(u->ctx) ? FSDP__TRACE_RECOMPUTE : FSDP__TRACE_FORWARD,
                        fsdp__unit_label(u));
    return rc;
}

/* ---- backward ---------------------------------------------------------------------------------
 */

static int final_callback(fsdp_ctx_t *ctx, void *arg);

/* The unit run just before u in the last forward (the backward prefetch target). */
static fsdp_unit_t *backward_prefetch_target(fsdp_unit_t *root, fsdp_unit_t *u) {
    for (size_t i = root->npost; i-- > 1;)
        if (root->post_order[i] == u) {
            for (size_t j = i; j-- > 0;) {
                fsdp_unit_t *t = root->post_order[j];
                /* A unit whose region has not been re-run yet gathers for that re-run. */
                if (t != u && (t->needs_pre_backward || t->needs_recompute) && t->bwd_pending == 0)
                    return t;
            }
            return NULL;
        }
    return NULL;
}

static int prefetch_backward(fsdp_unit_t *u) {
    fsdp_unit_t *t = backward_prefetch_target(fsdp__root_of(u), u);
    if (!t || t->unsharded) return FSDP_OK;
    return fsdp__unshard_issue(t, true);
}

int fsdp__backward_pre_hook(fsdp_module_t *m, void *arg, bool has_grad) {
    (void)m;
    fsdp_unit_t *u = arg;
    fsdp_unit_t *root = fsdp__root_of(u);
    int rc;
    if (!root->cb_queued) {
        if ((rc = fsdp_queue_callback(u->ctx, final_callback, root)) < 0) return rc;
        root->cb_queued = true;
    }
    if (!has_grad || !u->needs_pre_backward) return FSDP_OK;
    if (u->state != FSDP_STATE_BACKWARD_PRE) {
        /* The unit's backward span runs from here to the end of post_backward. */
        if (fsdp__tracing(u->ctx))
            fsdp__trace_begin(u->ctx, FSDP__TRACE_BACKWARD, fsdp__unit_label(u));
        /* Gradients the user cleared or replaced since the forward (a zero_grad between forward
         * and backward) are written back before this backward adds to the sharded gradient;
         * a changed parameter is refused where the forward's parameters are kept. */
        fsdp__drop_cleared_flat_grad(u);
        if ((rc = fsdp__writeback_orig_params(u, true)) < 0) return rc;
        u->state = FSDP_STATE_BACKWARD_PRE;
        u->bwd_pending = u->fwd_invocations;
        u->stats.pre_backward_hooks++;
    }
    if ((rc = fsdp__unshard(u)) < 0) return rc;
    /* The compute views stand in the module's slots until the unit's backward ends, so that a
     * recompute region inside the unit computes with the unsharded parameters. */
    fsdp__swap_slots(u, true);
    if (u->opt.backward_prefetch == FSDP_BACKWARD_PRE && (rc = prefetch_backward(u)) < 0) return rc;
    return fsdp__prepare_grads(u);
}

static int post_backward(fsdp_unit_t *u) {
    u->state = FSDP_STATE_BACKWARD_POST;
    u->needs_pre_backward = false;
    u->bwd_pending = 0;
    fsdp__swap_slots(u, false);
    int rc = FSDP_OK;
    if (fsdp__separate_full(u)) rc = fsdp__reshard(u);
    if (rc == 0 && u->opt.backward_prefetch == FSDP_BACKWARD_POST) rc = prefetch_backward(u);
    if (rc == 0 && fsdp__root_of(u)->no_sync) {
        /* No reduction: the unsharded gradient stays with the unit for the next backward. */
        rc = fsdp__settle_grads(u);
        u->local_grad = u->full_grad;
        u->full_grad = NULL;
    } else {
        if (rc == 0) rc = fsdp__reduce_grad(u);
        if (rc == 0) rc = fsdp__track_reduction(u);
    }
    u->stats.post_backward_hooks++;
    if (fsdp__tracing(u->ctx)) fsdp__trace_end(u->ctx, FSDP__TRACE_BACKWARD, fsdp__unit_label(u));
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
        int r = fsdp__finish_reduction(u);
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
        r = fsdp__reap_deferred(u, true);
        if (r < 0 && rc == 0) rc = r;
    }
    for (size_t i = 0; i < root->nall; i++) {
        fsdp_unit_t *u = root->all[i];
        fsdp__swap_slots(u, false);
        u->state = FSDP_STATE_IDLE;
        u->fwd_invocations = 0;
        u->bwd_pending = 0;
        u->needs_pre_backward = false;
        u->needs_recompute = false;
        fsdp__drop_cv_grads(u);
        fsdp_tensor_release(u->full_grad);
        u->full_grad = NULL;
    }
    root->nred = 0;
    root->cb_queued = false;
    fsdp__ag_stream_end(root); /* the optimizer writes the shards next */
    return rc;
}
