/* SPDX-License-Identifier: MIT */
/*
 * backward.c: the backward engine.
 *
 * Backward keeps one gradient per slot, walks the tape's entries in reverse (recording order is
 * a topological order, so no graph search is needed), and frees each node and each slot's
 * gradient as soon as they are consumed. A node whose outputs got no gradient does not run.
 * A leaf's gradient is gathered over all its uses and accumulated into .grad once, when its last
 * use has been processed, and its hooks run then. Marks run their function with whether any of
 * their tensors got a gradient. Final callbacks run after the walk, on the root tape only.
 *
 * The engine runs with grad mode off and the tensor memory category set to gradients; the tape
 * is reset at the end whether backward succeeded or not. Argument errors are found before
 * anything runs and leave the tape as it was.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "autograd/autograd_impl.h"
#include "autograd/tape_impl.h"
#include "core/trace.h"
#include "tensor/tensor_impl.h"

static bool same_shape(const fsdp_tensor_t *t, int ndim, const int64_t *shape) {
    return t->ndim == ndim && memcmp(t->shape, shape, sizeof(int64_t) * (size_t)ndim) == 0;
}

/* Adds g into leaf->grad (creating it), then runs the leaf's hooks. Takes g's reference. */
static int accumulate_leaf(fsdp_tensor_t *leaf, fsdp_tensor_t *g) {
    int rc = FSDP_OK;
    if (g->dt != leaf->dt && !leaf->grad_native) {
        fsdp_tensor_t *c = NULL;
        rc = fsdp_to_dtype(g, leaf->dt, &c);
        fsdp_tensor_release(g);
        if (rc < 0) return rc;
        g = c;
    }
    if (!leaf->grad) {
        /* Take g as the gradient when nobody else sees it; otherwise the gradient gets its own
         * storage, since later accumulation writes into it in place. */
        bool exclusive = atomic_load(&g->refs) == 1 && atomic_load(&g->st->refs) == 1 &&
                         fsdp_tensor_is_contiguous(g) && g->st->cat == FSDP_MEM_GRADS;
        if (exclusive) {
            leaf->grad = g;
            g = NULL;
        } else {
            rc = fsdp_tensor_clone(g, FSDP_MEM_GRADS, &leaf->grad);
        }
    } else if (!leaf->grad->st->ptr) {
        rc = fsdp__op_err(leaf, FSDP_EINVAL, "backward",
                          "the gradient of '%s' has had its storage freed", fsdp_tensor_name(leaf));
    } else if (leaf->grad_fresh) {
        /* A gradient whose owner has not zeroed it (FSDP's unsharded gradient): g is written,
         * rounded to its dtype, as 0 + g would be (but for the sign of a zero gradient). */
        rc = fsdp_tensor_copy_(leaf->grad, g);
    } else if (fsdp_tensor_is_contiguous(leaf->grad) && fsdp_tensor_is_contiguous(g) &&
               (leaf->dt == FSDP_DTYPE_F32 || leaf->dt == FSDP_DTYPE_F64)) {
        rc = leaf->dev->ops->axpy(leaf->dev, leaf->dt, (size_t)fsdp_tensor_numel(g), 1.0,
                                  fsdp_tensor_data(g), fsdp_tensor_data(leaf->grad));
    } else {
        fsdp_tensor_t *sum = NULL;
        rc = fsdp_add(leaf->grad, g, &sum);
        if (rc == 0) rc = fsdp_tensor_copy_(leaf->grad, sum);
        fsdp_tensor_release(sum);
    }
    fsdp_tensor_release(g);
    leaf->grad_fresh = false;
    for (struct fsdp_grad_hook *h = leaf->hooks; h && rc == 0; h = h->next)
        rc = h->fn(leaf, h->arg);
    return rc;
}

/* Whether g can be added into acc in place: acc is a gradient gathered by this backward that
 * nobody else sees (one reference to the tensor and one to its storage), both are contiguous
 * f32 or f64 of one shape on one device. axpy with alpha 1 computes acc + g element by element,
 * the bits of fsdp_add, without a new tensor and its first pass over fresh memory. */
static bool add_in_place(const fsdp_tensor_t *acc, const fsdp_tensor_t *g) {
    return atomic_load(&acc->refs) == 1 && atomic_load(&acc->st->refs) == 1 && acc->st->ptr &&
           acc->dt == g->dt && (acc->dt == FSDP_DTYPE_F32 || acc->dt == FSDP_DTYPE_F64) &&
           acc->dev == g->dev && same_shape(acc, g->ndim, g->shape) &&
           fsdp_tensor_is_contiguous(acc) && fsdp_tensor_is_contiguous(g);
}

/* *acc += g: in place when add_in_place allows, else *acc becomes a new sum. Takes g's
 * reference. */
static int accumulate_into(fsdp_tensor_t **acc, fsdp_tensor_t *g) {
    int rc;
    /* Contributions in two dtypes (a half gradient from a device with native half kernels, an
     * f32 one from a product): the half one is widened, so the sum is never rounded twice. On
     * devices that widen every half kernel (lp_native 0) all contributions are f32 and this
     * never runs. */
    if ((*acc)->dt != g->dt) {
        fsdp_tensor_t *wide = NULL;
        bool acc_narrow = fsdp_dtype_size((*acc)->dt) < fsdp_dtype_size(g->dt);
        rc = fsdp_to_dtype(acc_narrow ? *acc : g, acc_narrow ? g->dt : (*acc)->dt, &wide);
        if (rc < 0) {
            fsdp_tensor_release(g);
            return rc;
        }
        if (acc_narrow) {
            fsdp_tensor_release(*acc);
            *acc = wide;
        } else {
            fsdp_tensor_release(g);
            g = wide;
        }
    }
    if (add_in_place(*acc, g)) {
        size_t n = (size_t)fsdp_tensor_numel(g);
        rc = n == 0 ? FSDP_OK
                    : (*acc)->dev->ops->axpy((*acc)->dev, (*acc)->dt, n, 1.0, fsdp_tensor_data(g),
                                             fsdp_tensor_data(*acc));
        fsdp_tensor_release(g);
        return rc;
    }
    fsdp_tensor_t *sum = NULL;
    rc = fsdp_add(*acc, g, &sum);
    fsdp_tensor_release(g);
    if (rc < 0) return rc;
    fsdp_tensor_release(*acc);
    *acc = sum;
    return FSDP_OK;
}

/* Adds g into grads[slot]. Takes g's reference. */
static int accumulate_slot(fsdp_tensor_t **grads, int64_t slot, fsdp_tensor_t *g) {
    if (!grads[slot]) {
        grads[slot] = g;
        return FSDP_OK;
    }
    return accumulate_into(&grads[slot], g);
}

/* One backward's working state: a gradient per slot, and per leaf the number of recorded uses
 * not yet processed plus the gradient gathered so far. A leaf's gradient is accumulated into
 * .grad (and its hooks run) once, when its last use has been processed, as PyTorch's engine
 * does: FSDP's post-backward hook relies on firing once with the complete gradient. */
struct leaf_state {
    fsdp_tensor_t *leaf; /* borrowed (nodes hold the references) */
    int64_t pending;
    fsdp_tensor_t *grad; /* gathered gradient, owned */
    bool got;            /* accumulated into .grad during this backward */
};

struct bw {
    struct fsdp_tape *tape;
    fsdp_tensor_t **grads; /* nslots */
    struct leaf_state *leaves;
    size_t nleaves, cap; /* open addressing, cap a power of two */
};

static size_t leaf_hash(const fsdp_tensor_t *t, size_t cap) {
    uintptr_t x = (uintptr_t)t;
    x ^= x >> 17;
    x *= (uintptr_t)0x9E3779B97F4A7C15ull;
    return (size_t)(x >> 7) & (cap - 1);
}

static struct leaf_state *leaf_find(struct bw *bw, const fsdp_tensor_t *t, bool add) {
    if (bw->cap == 0) return NULL;
    for (size_t i = leaf_hash(t, bw->cap);; i = (i + 1) & (bw->cap - 1)) {
        struct leaf_state *ls = &bw->leaves[i];
        if (ls->leaf == t) return ls;
        if (!ls->leaf) {
            if (!add) return NULL;
            ls->leaf = (fsdp_tensor_t *)t;
            bw->nleaves++;
            return ls;
        }
    }
}

/* Counts every leaf use on the tape. */
static int bw_init_leaves(struct bw *bw) {
    size_t uses = 0;
    for (size_t i = 0; i < bw->tape->n; i++) {
        struct fsdp__node *n = bw->tape->e[i].node;
        if (!n) continue;
        for (int j = 0; j < n->nin; j++)
            if (n->in_leaf[j]) uses++;
    }
    size_t cap = 16;
    while (cap < 2 * uses + 2)
        cap *= 2;
    bw->leaves = calloc(cap, sizeof *bw->leaves);
    if (!bw->leaves) return fsdp__ctx_err(bw->tape->ctx, FSDP_ENOMEM, "backward: out of memory");
    bw->cap = cap;
    for (size_t i = 0; i < bw->tape->n; i++) {
        struct fsdp__node *n = bw->tape->e[i].node;
        if (!n) continue;
        for (int j = 0; j < n->nin; j++)
            if (n->in_leaf[j]) leaf_find(bw, n->in_leaf[j], true)->pending++;
    }
    return FSDP_OK;
}

/* One use of leaf processed, with gradient g (owned, may be NULL). */
static int leaf_use(struct bw *bw, fsdp_tensor_t *leaf, fsdp_tensor_t *g) {
    struct leaf_state *ls = leaf_find(bw, leaf, false);
    int rc = FSDP_OK;
    if (!ls) { /* cannot happen: every use was counted */
        fsdp_tensor_release(g);
        return fsdp__ctx_err(bw->tape->ctx, FSDP_EINTERNAL, "backward: uncounted leaf use");
    }
    if (g) {
        if (!ls->grad) {
            ls->grad = g;
        } else {
            rc = accumulate_into(&ls->grad, g);
            if (rc < 0) return rc;
        }
    }
    if (--ls->pending == 0 && ls->grad) {
        fsdp_tensor_t *total = ls->grad;
        ls->grad = NULL;
        ls->got = true;
        rc = accumulate_leaf(leaf, total);
    }
    return rc;
}

static void bw_fini(struct bw *bw) {
    if (bw->grads)
        for (int64_t s = 0; s < bw->tape->nslots; s++)
            fsdp_tensor_release(bw->grads[s]);
    for (size_t i = 0; i < bw->cap; i++)
        fsdp_tensor_release(bw->leaves[i].grad);
    free(bw->grads);
    free(bw->leaves);
}

/* Processes one node: runs its backward when any output got a gradient, and accounts every
 * leaf use either way. */
static int run_node(struct bw *bw, struct fsdp__node *n) {
    struct fsdp_tape *tape = bw->tape;
    fsdp_tensor_t **grads = bw->grads;
    bool any = false;
    int rc = FSDP_OK;
    for (int o = 0; o < n->nout; o++)
        if (grads[n->out_slot[o]]) any = true;
    if (!any) {
        for (int i = 0; i < n->nin && rc == 0; i++)
            if (n->in_leaf[i]) rc = leaf_use(bw, n->in_leaf[i], NULL);
        return rc;
    }
    fsdp_tensor_t **gout = calloc((size_t)n->nout, sizeof *gout);
    fsdp_tensor_t **gin = calloc((size_t)(n->nin > 0 ? n->nin : 1), sizeof *gin);
    if (!gout || !gin) {
        rc = fsdp__ctx_err(tape->ctx, FSDP_ENOMEM, "backward: out of memory");
        goto out;
    }
    for (int o = 0; o < n->nout; o++) {
        fsdp_tensor_t *g = grads[n->out_slot[o]];
        if (g) {
            gout[o] = fsdp_tensor_retain(g);
            continue;
        }
        FSDP_TRY(rc, out,
                 fsdp_tensor_zeros(tape->ctx, n->out_dt[o], n->out_ndim[o], n->out_shape[o],
                                   FSDP_MEM_GRADS, &gout[o]));
    }
    /* The outputs' gradients are consumed now: free them before the inputs' ones appear. */
    for (int o = 0; o < n->nout; o++) {
        fsdp_tensor_release(grads[n->out_slot[o]]);
        grads[n->out_slot[o]] = NULL;
    }
    rc = n->def->backward(n, gout, gin);
    if (rc < 0) {
        fsdp__ctx_err(tape->ctx, rc, "backward of %s failed: %s", n->def->name,
                      fsdp_ctx_last_error(tape->ctx));
        goto out;
    }
    for (int i = 0; i < n->nin && rc == 0; i++) {
        fsdp_tensor_t *g = gin[i];
        gin[i] = NULL;
        if (g && !n->needs[i]) {
            fsdp_tensor_release(g);
            g = NULL;
        }
        if (g && i < FSDP__NODE_SAVED && !same_shape(g, n->in_ndim[i], n->in_shape[i])) {
            char a[160], b[160];
            rc = fsdp__ctx_err(tape->ctx, FSDP_EINTERNAL,
                               "backward of %s gave a gradient of shape %s for input %d of "
                               "shape %s",
                               n->def->name, fsdp__shape_str(g->ndim, g->shape, a, sizeof a), i,
                               fsdp__shape_str(n->in_ndim[i], n->in_shape[i], b, sizeof b));
            fsdp_tensor_release(g);
            break;
        }
        if (n->in_leaf[i])
            rc = leaf_use(bw, n->in_leaf[i], g);
        else if (g)
            rc = accumulate_slot(grads, n->in_slot[i], g);
    }
out:
    if (gin)
        for (int i = 0; i < n->nin; i++)
            fsdp_tensor_release(gin[i]);
    if (gout)
        for (int o = 0; o < n->nout; o++)
            fsdp_tensor_release(gout[o]);
    free(gin);
    free(gout);
    return rc;
}

static int run_mark(struct bw *bw, struct mark *m) {
    if (!m->fn) return FSDP_OK;
    bool has = m->n == 0;
    for (int i = 0; i < m->n && !has; i++) {
        fsdp_tensor_t *t = m->ts[i];
        if (!t) continue;
        if (fsdp__live_slot(bw->tape, t)) {
            has = bw->grads[t->slot] != NULL;
        } else if (t->slot < 0) {
            struct leaf_state *ls = leaf_find(bw, t, false);
            has = ls && (ls->got || ls->grad);
        }
    }
    return m->fn(bw->tape->ctx, m->arg, has);
}

/* Checks an output and its grad_output before anything runs. */
static int check_output(struct fsdp_tape *tape, fsdp_tensor_t *y, fsdp_tensor_t *gy) {
    char a[200], b[200];
    if (!y->requires_grad)
        return fsdp__op_err(y, FSDP_EINVAL, "fsdp_backward",
                            "the output %s does not require a gradient (nothing recorded it)",
                            fsdp_tensor_describe(y, a, sizeof a));
    if (y->slot >= 0 && !fsdp__live_slot(tape, y))
        return fsdp__op_err(y, FSDP_EINVAL, "fsdp_backward",
                            "the graph of %s was already freed by an earlier backward or "
                            "fsdp_tape_clear",
                            fsdp_tensor_describe(y, a, sizeof a));
    if (gy && !same_shape(gy, y->ndim, y->shape))
        return fsdp__op_err(
            y, FSDP_EINVAL, "fsdp_backward", "grad_output %s does not match the output %s",
            fsdp_tensor_describe(gy, b, sizeof b), fsdp_tensor_describe(y, a, sizeof a));
    if (!gy && fsdp_tensor_numel(y) != 1)
        return fsdp__op_err(y, FSDP_EINVAL, "fsdp_backward",
                            "grad_output is needed for the non-scalar output %s",
                            fsdp_tensor_describe(y, a, sizeof a));
    return FSDP_OK;
}

static int seed_output(struct bw *bw, fsdp_tensor_t *y, fsdp_tensor_t *gy) {
    fsdp_tensor_t *g = NULL;
    if (gy) {
        g = fsdp_tensor_retain(gy);
    } else {
        int rc = fsdp_tensor_full(y->ctx, y->dt, y->ndim, y->shape, 1.0, FSDP_MEM_GRADS, &g);
        if (rc < 0) return rc;
    }
    if (y->slot >= 0) return accumulate_slot(bw->grads, y->slot, g);
    /* A leaf output: its gradient is the seed itself. */
    return accumulate_leaf(y, g);
}

int fsdp_backward_multi(int n, fsdp_tensor_t *const *outputs, fsdp_tensor_t *const *grad_outputs) {
    if (n <= 0 || !outputs || !outputs[0])
        return fsdp__ctx_err(n > 0 && outputs && outputs[0] ? outputs[0]->ctx : NULL, FSDP_EINVAL,
                             "fsdp_backward: no outputs");
    fsdp_ctx_t *ctx = outputs[0]->ctx;
    struct fsdp_tape *tape = fsdp__get_tape(ctx);
    if (!tape) return fsdp__ctx_err(ctx, FSDP_ENOMEM, "fsdp_backward: no memory for the tape");
    if (tape->in_backward)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_backward: a backward is already running");
    /* Argument errors leave the tape as it was, so the caller can fix the call and retry. */
    for (int i = 0; i < n; i++) {
        if (!outputs[i] || outputs[i]->ctx != ctx)
            return fsdp__ctx_err(ctx, FSDP_EINVAL,
                                 "fsdp_backward: output %d is NULL or of another context", i);
        fsdp_tensor_t *gy = grad_outputs ? grad_outputs[i] : NULL;
        if (gy && (gy->ctx != ctx || gy->dev != outputs[i]->dev))
            return fsdp__ctx_err(ctx, FSDP_EINVAL,
                                 "fsdp_backward: grad_output %d is on another device or context",
                                 i);
        int rc = check_output(tape, outputs[i], gy);
        if (rc < 0) return rc;
    }
    int rc = FSDP_OK;
    struct bw bw = {tape, NULL, NULL, 0, 0};
    /* The pass of a loss, final callbacks included; a recompute region's inner pass is part of
     * its parent's. */
    bool traced = !tape->parent && fsdp__tracing(ctx);
    if (traced) fsdp__trace_begin(ctx, FSDP__TRACE_AUTOGRAD, "backward");
    bool was_enabled = tape->grad_enabled;
    tape->grad_enabled = false;
    tape->in_backward = true;
    fsdp__sync_tensor_cat(ctx);
    bw.grads = calloc((size_t)(tape->nslots > 0 ? tape->nslots : 1), sizeof *bw.grads);
    if (!bw.grads) {
        rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "fsdp_backward: out of memory");
        goto out;
    }
    FSDP_TRY(rc, out, bw_init_leaves(&bw));
    for (int i = 0; i < n; i++)
        FSDP_TRY(rc, out, seed_output(&bw, outputs[i], grad_outputs ? grad_outputs[i] : NULL));
    for (size_t i = tape->n; i-- > 0;) {
        struct entry *e = &tape->e[i];
        if (e->kind == ENTRY_MARK) {
            FSDP_TRY(rc, out, run_mark(&bw, e->mark));
        } else if (e->node) {
            rc = run_node(&bw, e->node);
            /* Saved tensors are no longer needed: free them now, not at the end. */
            fsdp__node_free(e->node);
            e->node = NULL;
            if (rc < 0) goto out;
        }
    }
    if (!tape->parent) {
        /* Final callbacks may queue more callbacks; run until the queue is empty. */
        for (size_t i = 0; i < tape->ncbs; i++) {
            struct callback cb = tape->cbs[i];
            FSDP_TRY(rc, out, cb.fn(ctx, cb.arg));
        }
    }
out:
    bw_fini(&bw);
    if (!tape->parent) tape->ncbs = 0;
    tape->in_backward = false;
    fsdp__sync_tensor_cat(ctx);
    tape->grad_enabled = was_enabled;
    fsdp__tape_reset(tape);
    if (traced) fsdp__trace_end(ctx, FSDP__TRACE_AUTOGRAD, "backward");
    return rc;
}

int fsdp_backward(fsdp_tensor_t *loss, fsdp_tensor_t *grad_output) {
    if (!loss) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_backward: loss is NULL");
    return fsdp_backward_multi(1, &loss, &grad_output);
}
