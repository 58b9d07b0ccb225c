/* SPDX-License-Identifier: MIT */
/*
 * grads.c: a unit's gradients: the unsharded flat gradient that backward accumulates into, its
 * reduction (reduce-scatter, the all-reduce across replicas for the hybrid strategies, or one
 * all-reduce for NO_SHARD) with the bound on reductions in flight, the sharded gradient it
 * leaves, gradient accumulation without communication (no_sync), and fsdp_unit_clip_grad_norm.
 *
 * Invariants: between a unit's backward pre-hook and its reduction, each compute view's .grad
 * is a view into u->full_grad; a reduction in flight holds its input (rs_in, released after the
 * wait through streams.c) and output (rs_out) and is listed in the root's red_queue; at most
 * MAX_INFLIGHT_REDUCTIONS are in flight per root; under no_sync the unsharded gradient stays
 * with the unit (local_grad) and nothing is communicated.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/timeutil.h"
#include "fsdp/fsdp_impl.h"
#include "nn/nn_impl.h"
#include "optim/optim_impl.h"
#include "tensor/tensor_impl.h"

/* t /= v in place (a contiguous float tensor), as PyTorch's div_ rounds: 16-bit floats are
 * divided in f32 and rounded once, inside the kernel on a device with native 16-bit kernels
 * (fsdp__kernel_dtype), else around it. On such a device the divisor reaches the kernel in t's
 * dtype: FSDP's factors are integers, exact in bf16 up to 256 (a post-divide factor above that,
 * from a world of twice a large prime, would be rounded). */
static int div_inplace(fsdp_tensor_t *t, double v) {
    if (v == 1.0 || fsdp_tensor_numel(t) == 0) return FSDP_OK;
    int cdt = (int)fsdp__kernel_dtype(t->dev, t->dt);
    if (cdt < 0)
        return fsdp__ctx_err(t->ctx, FSDP_EINVAL, "cannot divide a %s tensor",
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

bool fsdp__any_requires_grad(const fsdp_unit_t *u) {
    return u->flat && u->flat->requires_grad;
}

/* ---- the unsharded gradient ------------------------------------------------------------------ */

/* Before the unit's backward: the unsharded flat gradient (or the one accumulated under
 * no_sync, which backward goes on adding to), and each compute view's .grad a view into it, so
 * backward writes straight into the flat gradient. A new flat gradient is not zeroed: each
 * view is marked fresh, backward writes its first gradient into it (a copy where 0 + g would
 * have been added: the same bits but for the sign of a zero, which autograd keeps as PyTorch's
 * does), and fsdp__settle_grads zeroes what backward did not write before anything reads it.
 * That saves a pass that writes the whole buffer and another that reads it. */
int fsdp__prepare_grads(fsdp_unit_t *u) {
    if (u->nparams == 0 || !fsdp__any_requires_grad(u) || u->full_grad) return FSDP_OK;
    int rc = FSDP_OK;
    bool fresh = !u->local_grad;
    if (u->local_grad) {
        u->full_grad = u->local_grad;
        u->local_grad = NULL;
    } else {
        const int64_t n[1] = {u->layout.padded_numel};
        rc = fsdp__tensor_new(u->ctx, u->dev, u->cdt, 1, n, FSDP_MEM_GRADS, &u->full_grad);
        if (rc < 0) return fsdp__unit_err(u, rc, "cannot allocate the unsharded gradient");
    }
    u->full_grad_fresh = fresh;
    for (int i = 0; i < u->nparams; i++) {
        struct fsdp__param *p = &u->params[i];
        if (!p->cv->requires_grad) continue;
        fsdp_tensor_t *g = NULL;
        rc = fsdp__tensor_view(u->full_grad, u->layout.offset[i], p->ndim, p->shape, NULL, &g);
        if (rc < 0) return rc;
        fsdp__contiguous_strides(p->ndim, p->shape, g->stride);
        fsdp_tensor_release(p->cv->grad);
        p->cv->grad = g;
        p->cv->grad_fresh = fresh;
    }
    return FSDP_OK;
}

/* Zeroes elements [from, to) of u's unsharded gradient. */
static int zero_range(fsdp_unit_t *u, int64_t from, int64_t to) {
    if (to <= from) return FSDP_OK;
    fsdp_tensor_t *v = NULL;
    int rc = fsdp__view1d(u->full_grad, from, to - from, &v);
    if (rc == 0) rc = fsdp_tensor_zero_(v);
    fsdp_tensor_release(v);
    return rc;
}

/* After the unit's backward, before its unsharded gradient is read (reduced, or kept under
 * no_sync): zeroes what backward did not write in a fresh one (the views of parameters that
 * got no gradient or need none, the alignment gaps and the padding), as few ranges as they
 * make, then drops the compute views' .grad. */
int fsdp__settle_grads(fsdp_unit_t *u) {
    int rc = FSDP_OK;
    if (u->full_grad && u->full_grad_fresh) {
        int64_t from = 0; /* start of the run of elements still to zero */
        for (int i = 0; i < u->nparams && rc == 0; i++) {
            const fsdp_tensor_t *cv = u->params[i].cv;
            int64_t off = u->layout.offset[i];
            if (cv->requires_grad && cv->grad && !cv->grad_fresh) {
                rc = zero_range(u, from, off); /* written: ends the run */
                from = off + u->layout.numel[i];
            }
        }
        if (rc == 0) rc = zero_range(u, from, u->layout.padded_numel);
        if (rc < 0)
            rc = fsdp__unit_err(u, rc, "cannot zero the unsharded gradient's unwritten part");
    }
    u->full_grad_fresh = false;
    fsdp__drop_cv_grads(u);
    return rc;
}

void fsdp__drop_cv_grads(fsdp_unit_t *u) {
    for (int i = 0; i < u->nparams; i++) {
        fsdp_tensor_release(u->params[i].cv->grad);
        u->params[i].cv->grad = NULL;
        u->params[i].cv->grad_fresh = false;
    }
}

/* ---- reduction ------------------------------------------------------------------------------- */

/* Issues one of u's gradient sums (a reduce-scatter or an all-reduce over pg, in the reduction
 * dtype) on u's side stream, each input first multiplied by prescale (0: none); what names it in
 * a failure's message. */
static int grad_sum(fsdp_unit_t *u, fsdp_pg_t *pg, fsdp_coll_kind_t kind, fsdp_tensor_t *send,
                    fsdp_tensor_t *recv, int64_t count, double prescale, fsdp_work_t **work,
                    const char *what) {
    void *stream = NULL;
    int rc = fsdp__side_stream(u, &stream);
    if (rc < 0) return rc;
    fsdp_coll_desc_t d = {.kind = kind,
                          .send = fsdp_tensor_data(send),
                          .recv = fsdp_tensor_data(recv),
                          .count = (size_t)count,
                          .dtype = u->rdt,
                          .op = FSDP_REDOP_SUM,
                          .stream = stream,
                          .prescale = prescale};
    rc = fsdp_pg_collective(pg, &d, work);
    if (rc < 0) return fsdp__unit_err(u, rc, "%s failed: %s", what, fsdp_pg_last_error(pg));
    return FSDP_OK;
}

/* Starts the reduction of u's unsharded gradient (asynchronous). */
int fsdp__reduce_grad(fsdp_unit_t *u) {
    int rc = fsdp__settle_grads(u);
    fsdp_tensor_t *g = u->full_grad;
    u->full_grad = NULL;
    if (!g || rc < 0) {
        fsdp_tensor_release(g);
        return rc;
    }
    double pre, post;
    int world = u->world * (u->replicate_pg ? fsdp_pg_size(u->replicate_pg) : 1);
    fsdp__divide_factors(world, &pre, &post);
    rc = fsdp__mp_grad_for_reduce(u, &g);
    if (rc < 0) return rc;
    /* The pre-divide rides on the first collective as its prescale: every rank's input times
     * 1 / pre, rounded to the reduction dtype, then summed. pre is a power of two, so the
     * product is the quotient, bit for bit, without a pass over the gradient of its own. */
    const double prescale = pre == 1.0 ? 0.0 : 1.0 / pre;
    if (u->opt.delay_before_reduce_ms > 0) fsdp__sleep_ms(u->opt.delay_before_reduce_ms);
    if (fsdp__is_sharded(u->opt.strategy)) {
        const int64_t n[1] = {u->layout.shard_numel};
        FSDP_TRY(rc, fail,
                 fsdp__tensor_new(u->ctx, u->dev, u->rdt, 1, n, FSDP_MEM_GRADS, &u->rs_out));
        FSDP_TRY(rc, fail,
                 grad_sum(u, u->pg, FSDP_COLL_REDUCE_SCATTER, g, u->rs_out, u->layout.shard_numel,
                          prescale, &u->rs_work, "gradient reduce-scatter"));
        u->stats.reduce_scatters++;
        if (u->replicate_pg && fsdp_pg_size(u->replicate_pg) > 1) {
            /* A rank runs its collectives in issue order, so this reads the finished shard. */
            FSDP_TRY(rc, fail,
                     grad_sum(u, u->replicate_pg, FSDP_COLL_ALL_REDUCE, u->rs_out, u->rs_out,
                              u->layout.shard_numel, 0.0, &u->ar_work,
                              "gradient all-reduce across replicas"));
            u->stats.all_reduces++;
        }
    } else {
        u->rs_out = fsdp_tensor_retain(g);
        if (u->world > 1) {
            FSDP_TRY(rc, fail,
                     grad_sum(u, u->pg, FSDP_COLL_ALL_REDUCE, g, g, u->layout.padded_numel,
                              prescale, &u->ar_work, "gradient all-reduce"));
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
int fsdp__finish_reduction(fsdp_unit_t *u) {
    if (!u->rs_in) return FSDP_OK;
    int rc = FSDP_OK;
    fsdp__reap_tree(u);
    if (u->rs_work) {
        int r = fsdp__unit_wait(u, u->rs_work);
        if (r < 0 && rc == 0)
            rc = fsdp__unit_err(u, r, "gradient reduce-scatter failed: %s",
                                fsdp__wait_error(u->pg, u->rs_work));
        fsdp_work_release(u->rs_work);
        u->rs_work = NULL;
    }
    if (u->ar_work) {
        fsdp_pg_t *apg =
            u->replicate_pg && fsdp__is_sharded(u->opt.strategy) ? u->replicate_pg : u->pg;
        int r = fsdp__unit_wait(u, u->ar_work);
        if (r < 0 && rc == 0)
            rc = fsdp__unit_err(u, r, "gradient all-reduce failed: %s",
                                fsdp__wait_error(apg, u->ar_work));
        fsdp_work_release(u->ar_work);
        u->ar_work = NULL;
    }
    fsdp_tensor_t *out = u->rs_out;
    u->rs_out = NULL;
    /* The reduction read rs_in on the communication stream: released after the wait's event. */
    int rc2 = fsdp__release_after(u, u->rs_in);
    u->rs_in = NULL;
    if (rc == 0) rc = rc2;
    if (rc == 0) rc = div_inplace(out, u->post_divide);
    if (rc == 0) rc = fsdp__mp_grad_for_param(u, &out);
    if (rc == 0) {
        /* NO_SHARD reduced the unpadded flat gradient: its numel is the flat's. */
        fsdp_tensor_t *acc = u->flat->grad;
        if (!acc) {
            u->flat->grad = fsdp_tensor_retain(out);
        } else if (acc->dt == out->dt && (acc->dt == FSDP_DTYPE_F32 || acc->dt == FSDP_DTYPE_F64)) {
            rc = acc->dev->ops->axpy(acc->dev, acc->dt, (size_t)fsdp_tensor_numel(out), 1.0,
                                     fsdp_tensor_data(out), fsdp_tensor_data(acc));
        } else {
            /* A 16-bit gradient (keep_low_precision_grads) accumulates in its own dtype, each
             * sum rounded once, as PyTorch's in-place add; a gradient of another dtype (one
             * reduced in full precision in eval) is added in the accumulated one's. */
            fsdp_tensor_t *sum = NULL;
            rc = fsdp_add(acc, out, &sum);
            if (rc == 0) rc = fsdp_tensor_copy_(acc, sum);
            fsdp_tensor_release(sum);
        }
    }
    fsdp_tensor_release(out);
    if (rc == 0 && u->opt.use_orig_params) {
        for (int i = 0; i < u->nparams && rc == 0; i++) {
            struct fsdp__param *p = &u->params[i];
            if (!p->orig->requires_grad) continue;
            if (!p->sh.in_shard) {
                /* Nothing of it here: no gradient, as PyTorch's sharded gradient views. */
                fsdp_tensor_release(p->orig->grad);
                p->orig->grad = NULL;
                continue;
            }
            fsdp_tensor_t *g = NULL;
            rc = fsdp__view1d(u->flat->grad, p->sh.offset_in_shard, p->sh.numel_in_shard, &g);
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
void fsdp__drop_cleared_flat_grad(fsdp_unit_t *u) {
    if (!u->opt.use_orig_params || !u->flat || !u->flat->grad) return;
    for (int p = 0; p < u->nparams; p++)
        if (u->params[p].orig->grad) return;
    fsdp_tensor_release(u->flat->grad);
    u->flat->grad = NULL;
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
int fsdp__track_reduction(fsdp_unit_t *u) {
    if (!u->rs_in) return FSDP_OK; /* nothing was started (no gradient) */
    fsdp_unit_t *root = fsdp__root_of(u);
    if (root->nred == root->capred) {
        size_t cap = root->capred ? 2 * root->capred : 8;
        fsdp_unit_t **nq = realloc(root->red_queue, cap * sizeof *nq);
        if (!nq) return fsdp__unit_err(u, FSDP_ENOMEM, "out of memory");
        root->red_queue = nq;
        root->capred = cap;
    }
    root->red_queue[root->nred++] = u;
    int rc = FSDP_OK;
    while (rc == 0 && root->nred > MAX_INFLIGHT_REDUCTIONS) {
        rc = fsdp__finish_reduction(root->red_queue[0]);
        memmove(&root->red_queue[0], &root->red_queue[1],
                (root->nred - 1) * sizeof root->red_queue[0]);
        root->nred--;
    }
    return rc;
}

/* ---- no_sync --------------------------------------------------------------------------------- */

static int no_sync_set(fsdp_unit_t *root, bool on, const char *fn) {
    if (!root) return FSDP_EINVAL;
    if (root->parent)
        return fsdp__unit_err(root, FSDP_EINVAL, "%s: not a root unit (call it on the root)", fn);
    if (root->no_sync == on)
        return fsdp__unit_err(root, FSDP_EINVAL, "%s: the tree is %s", fn,
                              on ? "already in no_sync (it does not nest)" : "not in no_sync");
    fsdp_unit_t **all = NULL;
    size_t n = 0, cap = 0;
    if (fsdp__collect_units(root, &all, &n, &cap) < 0) {
        free(all);
        return fsdp__unit_err(root, FSDP_ENOMEM, "out of memory");
    }
    int rc = FSDP_OK;
    for (size_t i = 0; i < n && rc == 0; i++) {
        fsdp_training_state_t st = all[i]->state;
        if (fsdp_in_backward(root->ctx) || st == FSDP_STATE_BACKWARD_PRE ||
            st == FSDP_STATE_BACKWARD_POST)
            rc = fsdp__unit_err(all[i], FSDP_EINVAL,
                                "%s: unit '%s' is in a backward that has not finished: begin and "
                                "end no_sync before a backward or after it",
                                fn, fsdp__unit_label(all[i]));
    }
    free(all);
    if (rc == 0) root->no_sync = on;
    return rc;
}

int fsdp_no_sync_begin(fsdp_unit_t *root) {
    return no_sync_set(root, true, "fsdp_no_sync_begin");
}

int fsdp_no_sync_end(fsdp_unit_t *root) {
    return no_sync_set(root, false, "fsdp_no_sync_end");
}

bool fsdp_in_no_sync(const fsdp_unit_t *u) {
    while (u && u->parent)
        u = u->parent;
    return u && u->no_sync;
}

fsdp_tensor_t *fsdp_unit_local_grad(const fsdp_unit_t *u) {
    return u ? u->local_grad : NULL;
}

/* ---- clip_grad_norm ------------------------------------------------------------------------- */

/* All-reduces one f64 over u's group through a device buffer (the group may be NCCL). */
static int all_reduce_scalar(fsdp_unit_t *u, double *v, fsdp_redop_t op) {
    fsdp_tensor_t *t = NULL;
    const int64_t one[1] = {1};
    int rc = fsdp__tensor_new(u->ctx, u->dev, FSDP_DTYPE_F64, 1, one, FSDP_MEM_COMM, &t);
    if (rc == 0) rc = fsdp_tensor_fill_(t, *v);
    if (rc == 0) {
        rc = fsdp_pg_all_reduce(u->pg, fsdp_tensor_data(t), fsdp_tensor_data(t), 1, FSDP_DTYPE_F64,
                                op, NULL);
        if (rc < 0)
            rc = fsdp__unit_err(u, rc, "all-reduce of a scalar failed: %s",
                                fsdp_pg_last_error(u->pg));
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
        return fsdp__unit_err(root, FSDP_EINVAL, "fsdp_unit_clip_grad_norm: only on the root unit");
    if (!(max_norm >= 0.0) || !(norm_type > 0.0))
        return fsdp__unit_err(
            root, FSDP_EINVAL,
            "fsdp_unit_clip_grad_norm: max_norm %g must be >= 0 and norm_type %g > 0", max_norm,
            norm_type);
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
        bool shard = fsdp__is_sharded(u->opt.strategy) && u->world > 1;
        double *acc = shard ? &sharded : &local;
        *acc = inf ? fmax(*acc, part) : *acc + part;
    }
    for (size_t i = 0; i < all.n && rc == 0; i++) {
        fsdp_tensor_t *g = fsdp_tensor_grad(all.tensors[i]);
        if (!g || fsdp__owner_of_param(root->ctx, all.tensors[i], NULL)) continue;
        double part = 0.0;
        rc = fsdp__grad_norm_part(g, norm_type, &part);
        local = inf ? fmax(local, part) : local + part;
    }
    if (rc == 0 && root->world > 1)
        rc = all_reduce_scalar(root, &sharded, inf ? FSDP_REDOP_MAX : FSDP_REDOP_SUM);
    double total = fsdp__grad_norm_finish(inf ? fmax(sharded, local) : sharded + local, norm_type);
    double coef = fsdp__clip_coef(max_norm, total);
    for (size_t i = 0; i < nu && rc == 0 && coef < 1.0; i++)
        if (units[i]->flat && units[i]->flat->grad)
            rc = fsdp__grad_scale(units[i]->flat->grad, coef);
    for (size_t i = 0; i < all.n && rc == 0 && coef < 1.0; i++) {
        fsdp_tensor_t *g = fsdp_tensor_grad(all.tensors[i]);
        if (g && !fsdp__owner_of_param(root->ctx, all.tensors[i], NULL))
            rc = fsdp__grad_scale(g, coef);
    }
    free(units);
    fsdp_named_list_free(&all);
    if (rc == 0 && total_norm) *total_norm = total;
    return rc;
}
