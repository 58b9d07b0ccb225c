/* SPDX-License-Identifier: MIT */
/*
 * checkpoint.c: recompute regions (activation checkpointing).
 *
 * fsdp_checkpoint runs a region with grad mode off, so nothing inside is recorded or saved, and
 * records one node that keeps only the region's inputs. The node's backward runs the region
 * again on a child tape pushed on the context (with the random stream rewound to where the
 * first run began, so dropout draws the same masks) and differentiates it there, inside the
 * parent's backward; what the re-run recorded is dropped with the child tape.
 */
#include <stdlib.h>

#include "autograd/autograd_impl.h"
#include "autograd/tape_impl.h"
#include "core/trace.h"
#include "tensor/tensor_impl.h"

struct region {
    fsdp_region_fn fn;
    void *arg;
    void (*arg_free)(void *arg); /* may be NULL; called on arg when the node is dropped */
    int nin;                     /* the region's inputs (the node may carry one more: an anchor) */
    uint64_t rng_offset;         /* the random stream's position when the region first ran */
};

static int region_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                           fsdp_tensor_t **gin) {
    struct region *r = node->extra;
    fsdp_ctx_t *ctx = fsdp_tensor_ctx(gout[0]);
    int nin = r->nin, nout = node->nout, rc = FSDP_OK;
    struct fsdp_tape *parent = ctx->tape;
    struct fsdp_tape *sub = fsdp__tape_new(ctx, parent);
    fsdp_tensor_t **ins = calloc((size_t)(nin > 0 ? nin : 1), sizeof *ins);
    fsdp_tensor_t **outs = calloc((size_t)nout, sizeof *outs);
    fsdp_tensor_t **roots = calloc((size_t)nout, sizeof *roots);
    fsdp_tensor_t **rgrads = calloc((size_t)nout, sizeof *rgrads);
    uint64_t offset_now = ctx->rng.offset;
    if (!sub || !ins || !outs || !roots || !rgrads) {
        rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "checkpoint: out of memory");
        goto out;
    }
    /* The saved inputs become fresh leaves of the child tape. */
    for (int i = 0; i < nin; i++) {
        if (!node->saved[i]) continue;
        FSDP_TRY(rc, out, fsdp_detach(node->saved[i], &ins[i]));
        if (node->needs[i]) FSDP_TRY(rc, out, fsdp_tensor_set_requires_grad(ins[i], true));
        /* Their gradients go back into the parent's graph in the dtype the region's operations
         * gave them, as a run without the region would pass them on (a bf16 activation may
         * carry an f32 gradient), not cast to the input's dtype as a leaf's .grad is. */
        ins[i]->grad_native = true;
    }
    ctx->tape = sub;
    /* The re-run's tensors are activations again (the parent's backward would count them as
     * gradients), so the activations peak shows what recomputation holds at once. */
    atomic_store(&ctx->tensor_mem_cat, (int)FSDP_MEM_ACTIVATIONS);
    ctx->rng.offset = r->rng_offset;
    bool traced = fsdp__tracing(ctx);
    if (traced) fsdp__trace_begin(ctx, FSDP__TRACE_CHECKPOINT, "recompute");
    rc = r->fn(ctx, r->arg, nin, ins, nout, outs);
    if (traced) fsdp__trace_end(ctx, FSDP__TRACE_CHECKPOINT, "recompute");
    ctx->rng.offset = offset_now;
    fsdp__sync_tensor_cat(ctx);
    if (rc < 0) goto restore;
    int nroots = 0;
    for (int o = 0; o < nout; o++) {
        if (!outs[o] || !outs[o]->requires_grad) continue;
        roots[nroots] = outs[o];
        rgrads[nroots++] = gout[o];
    }
    if (nroots > 0) rc = fsdp_backward_multi(nroots, roots, rgrads);
    for (int i = 0; i < nin && rc == 0; i++)
        if (ins[i] && node->needs[i] && ins[i]->grad) gin[i] = fsdp_tensor_retain(ins[i]->grad);
restore:
    ctx->tape = parent;
    fsdp__sync_tensor_cat(ctx);
out:
    fsdp__tape_destroy(sub);
    if (ins)
        for (int i = 0; i < nin; i++)
            fsdp_tensor_release(ins[i]);
    if (outs)
        for (int o = 0; o < nout; o++)
            fsdp_tensor_release(outs[o]);
    free(ins);
    free(outs);
    free(roots);
    free(rgrads);
    return rc;
}

/* Recorded whenever grad mode is on: parameters used inside the region need gradients even when
 * no input requires one. */
static const struct fsdp__op_def def_region = {"checkpoint", region_backward};

bool fsdp__in_region_first_run(const fsdp_ctx_t *ctx) {
    return ctx && ctx->tape && ctx->tape->region_depth > 0;
}

static void region_free(void *p) {
    struct region *r = p;
    if (r->arg_free) r->arg_free(r->arg);
    free(r);
}

int fsdp_checkpoint(fsdp_ctx_t *ctx, fsdp_region_fn fn, void *arg, int nin,
                    fsdp_tensor_t *const *in, int nout, fsdp_tensor_t **out) {
    return fsdp__checkpoint_owned(ctx, fn, arg, NULL, nin, in, nout, out);
}

int fsdp__checkpoint_owned(fsdp_ctx_t *ctx, fsdp_region_fn fn, void *arg,
                           void (*arg_free)(void *arg), int nin, fsdp_tensor_t *const *in, int nout,
                           fsdp_tensor_t **out) {
    bool owned = false; /* whether the tape's node has taken arg */
    int rc = FSDP_OK;
    if (!ctx || !fn || nin < 0 || nout <= 0 || !out || (nin > 0 && !in)) {
        rc = fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_checkpoint: fn, out and nout > 0 are required");
        goto out;
    }
    if (nin > FSDP__NODE_SAVED) {
        rc = fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_checkpoint: at most %d inputs (got %d)",
                           FSDP__NODE_SAVED, nin);
        goto out;
    }
    for (int o = 0; o < nout; o++)
        out[o] = NULL;
    uint64_t offset = ctx->rng.offset;
    bool was = fsdp_set_grad_enabled(ctx, false);
    struct fsdp_tape *first = was ? ctx->tape : NULL; /* the run a backward will repeat */
    if (first) first->region_depth++;
    rc = fn(ctx, arg, nin, in, nout, out);
    if (first) first->region_depth--;
    fsdp_set_grad_enabled(ctx, was);
    for (int o = 0; o < nout && rc == 0; o++)
        if (!out[o])
            rc = fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_checkpoint: the region left output %d NULL",
                               o);
    if (rc < 0) goto fail;
    if (!was) goto out; /* nothing to differentiate: the region ran once, as plain code */

    struct fsdp_tape *tape = fsdp__get_tape(ctx);
    struct region *r = malloc(sizeof *r);
    if (!tape || !r) {
        free(r);
        rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "fsdp_checkpoint: out of memory");
        goto fail;
    }
    r->fn = fn;
    r->arg = arg;
    r->arg_free = NULL; /* set once the node owns r */
    r->nin = nin;
    r->rng_offset = offset;
    struct fsdp__node *node = NULL;
    rc = fsdp__record(&def_region, nin, in, nout, out, &node);
    if (rc == 0 && !node) {
        /* No input requires grad: record with a stand-in so the region still runs backward
         * for the parameters it uses. A zero-size leaf requiring grad is its anchor. */
        fsdp_tensor_t *anchor = NULL;
        fsdp_tensor_t *args[FSDP__NODE_SAVED + 1];
        rc = fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 1, (const int64_t[]){0}, FSDP_MEM_OTHER,
                               &anchor);
        if (rc == 0) rc = fsdp_tensor_set_requires_grad(anchor, true);
        if (rc == 0) {
            for (int i = 0; i < nin; i++)
                args[i] = in[i];
            args[nin] = anchor;
            rc = fsdp__record(&def_region, nin + 1, args, nout, out, &node);
        }
        fsdp_tensor_release(anchor);
    }
    if (rc < 0 || !node) {
        free(r);
        if (rc == 0) rc = fsdp__ctx_err(ctx, FSDP_EINTERNAL, "fsdp_checkpoint: not recorded");
        goto fail;
    }
    r->arg_free = arg_free;
    owned = true;
    if ((rc = fsdp__node_adopt(node, r, region_free, nin, in)) < 0) goto fail;
    return FSDP_OK;
fail:
    fsdp__drop_outputs(nout, out);
out:
    if (!owned && arg_free) arg_free(arg);
    return rc;
}
