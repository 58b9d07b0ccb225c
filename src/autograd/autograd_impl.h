/* SPDX-License-Identifier: MIT */
/*
 * autograd_impl.h: how operations record themselves on the tape.
 *
 * An operation computes its outputs first (in any grad mode), then asks for a node:
 *
 *     struct fsdp__node *node = NULL;
 *     FSDP_TRY(rc, fail, fsdp__record(&def_mul, 2, (fsdp_tensor_t *[]){a, b}, 1, &y, &node));
 *     if (node) { fsdp__node_save(node, a); fsdp__node_save(node, b); }
 *
 * fsdp__record returns node == NULL when nothing needs a gradient (grad mode off, or no input
 * requires one); otherwise it marks the outputs as requiring grad and gives them tape slots.
 * The node keeps references only to what is saved, and to the leaves it feeds gradients to.
 *
 * At backward, def->backward receives the gradients of the outputs (gout[i] is never NULL:
 * zeros stand in for outputs that got none) and writes a new reference into gin[i] for each
 * input with node->needs[i] set (it may leave gin[i] NULL: no gradient). It runs with grad mode
 * off, so it may use the public operations freely. A gradient returned for an input must have
 * the input's shape; dtype is converted by the engine if needed.
 */
#ifndef FSDP_AUTOGRAD_IMPL_H
#define FSDP_AUTOGRAD_IMPL_H

#include <stdbool.h>
#include <stdint.h>

#include <fsdp/autograd.h>

#include "tensor/tensor_impl.h"

struct fsdp__node;

typedef int (*fsdp__backward_fn)(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                                 fsdp_tensor_t **gin);

struct fsdp__op_def {
    const char *name;
    fsdp__backward_fn backward;
};

#define FSDP__NODE_SAVED 8
#define FSDP__NODE_SCALARS 8

struct fsdp__node {
    const struct fsdp__op_def *def;
    int nin, nout;
    bool *needs;              /* nin: whether input i wants a gradient */
    int64_t *in_slot;         /* nin: slot of a non-leaf input, -1 otherwise */
    fsdp_tensor_t **in_leaf;  /* nin: leaf input that requires grad (owned ref), else NULL */
    int64_t *out_slot;        /* nout */
    /* Output geometry, to make zeros for an output without gradient. */
    fsdp_dtype_t *out_dt;     /* nout */
    int *out_ndim;            /* nout */
    int64_t (*out_shape)[FSDP_MAX_DIMS]; /* nout */
    /* What backward needs, owned. */
    fsdp_tensor_t *saved[FSDP__NODE_SAVED];
    int nsaved;
    double f[FSDP__NODE_SCALARS];
    int64_t i[FSDP__NODE_SCALARS];
    void *extra;              /* freed with extra_free when the node is dropped */
    void (*extra_free)(void *extra);
    /* Input geometry (first FSDP__NODE_SAVED inputs), for shape-only backward rules. */
    int in_ndim[FSDP__NODE_SAVED];
    int64_t in_shape[FSDP__NODE_SAVED][FSDP_MAX_DIMS];
    fsdp_dtype_t in_dt[FSDP__NODE_SAVED];
};

/* Records a node for an operation of nin inputs and nout outputs (see above). Inputs may be
 * NULL (optional arguments): they never need a gradient. */
int fsdp__record(const struct fsdp__op_def *def, int nin, fsdp_tensor_t *const *in, int nout,
                 fsdp_tensor_t *const *out, struct fsdp__node **node);
/* Keeps a reference to t for the backward (t may be NULL: saved as NULL). */
int fsdp__node_save(struct fsdp__node *node, fsdp_tensor_t *t);
/* For operations that carry their own state (recompute regions, caller-defined functions): the
 * node takes extra (extra_free runs when the tape drops the node) and keeps the first n inputs
 * for the backward. On failure the node, with extra, stays on the tape and is freed with it. */
int fsdp__node_adopt(struct fsdp__node *node, void *extra, void (*extra_free)(void *extra), int n,
                     fsdp_tensor_t *const *in);
/* Releases out[0..n) and sets them to NULL (a failed operation's outputs). */
void fsdp__drop_outputs(int n, fsdp_tensor_t **out);

/* Whether the current tape is in the first, unrecorded run of a recompute region: grad mode is
 * off there, but a backward will run the same code again (FSDP keeps parameters it would free
 * after a forward without grad). */
bool fsdp__in_region_first_run(const fsdp_ctx_t *ctx);

/* fsdp_checkpoint that takes arg: arg_free(arg) (may be NULL) runs when the tape drops the
 * region's node, or before returning when no node was recorded (grad mode off, an error). */
int fsdp__checkpoint_owned(fsdp_ctx_t *ctx, fsdp_region_fn fn, void *arg,
                           void (*arg_free)(void *arg), int nin, fsdp_tensor_t *const *in,
                           int nout, fsdp_tensor_t **out);

/* Whether any of the n tensors (NULL allowed) would make an operation record: grad mode on and
 * one of them requires grad. Operations use it to skip saving work in inference. */
bool fsdp__needs_grad(fsdp_ctx_t *ctx, int n, fsdp_tensor_t *const *ts);

#endif /* FSDP_AUTOGRAD_IMPL_H */
