/* SPDX-License-Identifier: MIT */
/*
 * tape.c: the per-rank autograd tape: its lifetime, grad mode, and recording (operation nodes,
 * marks, final callbacks).
 *
 * The tape is an array of entries in recording order: operation nodes and marks. Non-leaf
 * tensors are named by slot numbers, so a node never holds its own outputs (activations that
 * nothing saved are freed as soon as the user drops them). The engine that walks it is in
 * backward.c, recompute regions in checkpoint.c; the tape's layout is in tape_impl.h.
 *
 * Generations. Every tape (and every clear of it) gets a new generation number from a process
 * counter; a tensor remembers the generation that gave it its slot, so a tensor from a cleared
 * graph is recognised instead of being read through a dangling slot.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "autograd/autograd_impl.h"
#include "autograd/tape_impl.h"
#include "tensor/tensor_impl.h"

static _Atomic uint64_t next_gen = 1;

static uint64_t new_gen(void) { return atomic_fetch_add(&next_gen, 1); }

void fsdp__node_free(struct fsdp__node *n) {
    if (!n) return;
    for (int i = 0; i < n->nin; i++) fsdp_tensor_release(n->in_leaf[i]);
    for (int i = 0; i < n->nsaved; i++) fsdp_tensor_release(n->saved[i]);
    if (n->extra_free) n->extra_free(n->extra);
    free(n->needs);
    free(n->in_slot);
    free(n->in_leaf);
    free(n->out_slot);
    free(n->out_dt);
    free(n->out_ndim);
    free(n->out_shape);
    free(n);
}

static void mark_free(struct mark *m) {
    if (!m) return;
    for (int i = 0; i < m->n; i++) fsdp_tensor_release(m->ts[i]);
    free(m->ts);
    if (m->arg_free) m->arg_free(m->arg);
    free(m->label);
    free(m);
}

void fsdp__tape_reset(struct fsdp_tape *t) {
    /* Dropped newest first, so a mark's arg_free sees the nodes recorded before it intact. */
    for (size_t i = t->n; i-- > 0;) {
        fsdp__node_free(t->e[i].node);
        mark_free(t->e[i].mark);
    }
    t->n = 0;
    t->nslots = 0;
    t->gen = new_gen();
}

void fsdp__tape_destroy(struct fsdp_tape *t) {
    if (!t) return;
    fsdp__tape_reset(t);
    free(t->e);
    free(t->cbs);
    free(t);
}

struct fsdp_tape *fsdp__tape_new(fsdp_ctx_t *ctx, struct fsdp_tape *parent) {
    struct fsdp_tape *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->ctx = ctx;
    t->parent = parent;
    t->gen = new_gen();
    t->grad_enabled = true;
    return t;
}

/* The context's tape, created on first use (NULL only when memory runs out). */
struct fsdp_tape *fsdp__get_tape(fsdp_ctx_t *ctx) {
    if (!ctx) return NULL;
    if (!ctx->tape) {
        ctx->tape = fsdp__tape_new(ctx, NULL);
        ctx->tape_destroy = fsdp__tape_destroy;
    }
    return ctx->tape;
}

static int push_entry(struct fsdp_tape *t, struct entry e) {
    if (t->n == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 256;
        struct entry *ne = realloc(t->e, cap * sizeof *ne);
        if (!ne) return fsdp__ctx_err(t->ctx, FSDP_ENOMEM, "autograd: tape out of memory");
        t->e = ne;
        t->cap = cap;
    }
    t->e[t->n++] = e;
    return FSDP_OK;
}

/* ---- grad mode ------------------------------------------------------------------------------ */

bool fsdp_set_grad_enabled(fsdp_ctx_t *ctx, bool enabled) {
    struct fsdp_tape *t = fsdp__get_tape(ctx);
    if (!t) return false;
    bool was = t->grad_enabled;
    t->grad_enabled = enabled;
    return was;
}

bool fsdp_is_grad_enabled(const fsdp_ctx_t *ctx) {
    if (!ctx) return false;
    return ctx->tape ? ctx->tape->grad_enabled : true;
}

bool fsdp_in_backward(const fsdp_ctx_t *ctx) {
    for (const struct fsdp_tape *t = ctx ? ctx->tape : NULL; t; t = t->parent)
        if (t->in_backward) return true;
    return false;
}

/* Tells the tensor layer which category new tensors count in: gradients while this rank runs
 * backward (on any tape of the chain), activations otherwise. Called whenever that changes. */
void fsdp__sync_tensor_cat(fsdp_ctx_t *ctx) {
    atomic_store(&ctx->tensor_mem_cat,
                 fsdp_in_backward(ctx) ? (int)FSDP_MEM_GRADS : (int)FSDP_MEM_ACTIVATIONS);
}

size_t fsdp_tape_size(const fsdp_ctx_t *ctx) {
    return ctx && ctx->tape ? ctx->tape->n : 0;
}

void fsdp_tape_clear(fsdp_ctx_t *ctx) {
    if (ctx && ctx->tape && !ctx->tape->in_backward) fsdp__tape_reset(ctx->tape);
}

/* ---- recording ----------------------------------------------------------------------------- */

/* Whether t has a live slot on tape. */
bool fsdp__live_slot(const struct fsdp_tape *tape, const fsdp_tensor_t *t) {
    return t->slot >= 0 && t->tape_gen == tape->gen && t->slot < tape->nslots;
}

bool fsdp__needs_grad(fsdp_ctx_t *ctx, int n, fsdp_tensor_t *const *ts) {
    if (!fsdp_is_grad_enabled(ctx)) return false;
    for (int i = 0; i < n; i++)
        if (ts[i] && ts[i]->requires_grad) return true;
    return false;
}

int fsdp__record(const struct fsdp__op_def *def, int nin, fsdp_tensor_t *const *in, int nout,
                 fsdp_tensor_t *const *out, struct fsdp__node **node) {
    *node = NULL;
    fsdp_ctx_t *ctx = NULL;
    for (int i = 0; i < nin && !ctx; i++)
        if (in[i]) ctx = in[i]->ctx;
    for (int i = 0; i < nout && !ctx; i++)
        if (out[i]) ctx = out[i]->ctx;
    if (!ctx || !fsdp_is_grad_enabled(ctx)) return FSDP_OK;
    struct fsdp_tape *tape = fsdp__get_tape(ctx);
    if (!tape) return fsdp__ctx_err(ctx, FSDP_ENOMEM, "autograd: no memory for the tape");
    bool any = false;
    for (int i = 0; i < nin; i++) {
        if (!in[i] || !in[i]->requires_grad) continue;
        if (in[i]->slot >= 0 && !fsdp__live_slot(tape, in[i]))
            return fsdp__ctx_err(ctx, FSDP_EINVAL,
                                 "%s: input %d ('%s') comes from a graph that backward or "
                                 "fsdp_tape_clear already freed; detach it first",
                                 def->name, i, fsdp_tensor_name(in[i]));
        any = true;
    }
    if (!any) return FSDP_OK;

    struct fsdp__node *n = calloc(1, sizeof *n);
    if (!n) goto oom;
    n->def = def;
    n->nin = nin;
    n->nout = nout;
    size_t ni = (size_t)(nin > 0 ? nin : 1), no = (size_t)(nout > 0 ? nout : 1);
    n->needs = calloc(ni, sizeof *n->needs);
    n->in_slot = calloc(ni, sizeof *n->in_slot);
    n->in_leaf = calloc(ni, sizeof *n->in_leaf);
    n->out_slot = calloc(no, sizeof *n->out_slot);
    n->out_dt = calloc(no, sizeof *n->out_dt);
    n->out_ndim = calloc(no, sizeof *n->out_ndim);
    n->out_shape = calloc(no, sizeof *n->out_shape);
    if (!n->needs || !n->in_slot || !n->in_leaf || !n->out_slot || !n->out_dt || !n->out_ndim ||
        !n->out_shape)
        goto oom;
    for (int i = 0; i < nin; i++) {
        fsdp_tensor_t *t = in[i];
        n->in_slot[i] = -1;
        if (t && i < FSDP__NODE_SAVED) {
            n->in_ndim[i] = t->ndim;
            memcpy(n->in_shape[i], t->shape, sizeof n->in_shape[i]);
            n->in_dt[i] = t->dt;
        }
        if (!t || !t->requires_grad) continue;
        n->needs[i] = true;
        if (t->slot >= 0)
            n->in_slot[i] = t->slot;
        else
            n->in_leaf[i] = fsdp_tensor_retain(t);
    }
    if (push_entry(tape, (struct entry){ENTRY_NODE, n, NULL}) < 0) {
        fsdp__node_free(n);
        return FSDP_ENOMEM;
    }
    for (int i = 0; i < nout; i++) {
        fsdp_tensor_t *t = out[i];
        n->out_slot[i] = tape->nslots++;
        n->out_dt[i] = t->dt;
        n->out_ndim[i] = t->ndim;
        memcpy(n->out_shape[i], t->shape, sizeof n->out_shape[i]);
        t->requires_grad = true;
        t->slot = n->out_slot[i];
        t->tape_gen = tape->gen;
    }
    *node = n;
    return FSDP_OK;
oom:
    fsdp__node_free(n);
    return fsdp__ctx_err(ctx, FSDP_ENOMEM, "%s: no memory to record the operation", def->name);
}

int fsdp__node_save(struct fsdp__node *node, fsdp_tensor_t *t) {
    if (node->nsaved >= FSDP__NODE_SAVED)
        return fsdp__ctx_err(t ? t->ctx : NULL, FSDP_EINTERNAL,
                             "%s: more than %d saved tensors", node->def->name, FSDP__NODE_SAVED);
    node->saved[node->nsaved++] = t ? fsdp_tensor_retain(t) : NULL;
    return FSDP_OK;
}

int fsdp__node_adopt(struct fsdp__node *node, void *extra, void (*extra_free)(void *extra), int n,
                     fsdp_tensor_t *const *in) {
    node->extra = extra;
    node->extra_free = extra_free;
    int rc = FSDP_OK;
    for (int i = 0; i < n && rc == 0; i++)
        rc = fsdp__node_save(node, in[i]);
    return rc;
}

void fsdp__drop_outputs(int n, fsdp_tensor_t **out) {
    for (int o = 0; o < n; o++) {
        fsdp_tensor_release(out[o]);
        out[o] = NULL;
    }
}

/* ---- marks and callbacks ---------------------------------------------------------------- */

int fsdp_tape_mark(fsdp_ctx_t *ctx, const char *label, int n, fsdp_tensor_t *const *tensors,
                   fsdp_mark_fn fn, void *arg, void (*arg_free)(void *arg)) {
    if (!ctx) return FSDP_EINVAL;
    if (n < 0 || (n > 0 && !tensors))
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_tape_mark: %d tensors but tensors is NULL",
                             n);
    if (!fsdp_is_grad_enabled(ctx)) {
        if (arg_free) arg_free(arg);
        return FSDP_OK;
    }
    struct fsdp_tape *tape = fsdp__get_tape(ctx);
    struct mark *m = calloc(1, sizeof *m);
    if (!tape || !m) goto oom;
    m->label = strdup(label ? label : "");
    m->ts = calloc((size_t)(n > 0 ? n : 1), sizeof *m->ts);
    if (!m->label || !m->ts) goto oom;
    for (int i = 0; i < n; i++) m->ts[i] = tensors[i] ? fsdp_tensor_retain(tensors[i]) : NULL;
    m->n = n;
    m->fn = fn;
    m->arg = arg;
    m->arg_free = arg_free;
    if (push_entry(tape, (struct entry){ENTRY_MARK, NULL, m}) < 0) {
        mark_free(m);
        return FSDP_ENOMEM;
    }
    return FSDP_OK;
oom:
    if (m) {
        free(m->label);
        free(m->ts);
        free(m);
    }
    if (arg_free) arg_free(arg);
    return fsdp__ctx_err(ctx, FSDP_ENOMEM, "fsdp_tape_mark: out of memory");
}

int fsdp_queue_callback(fsdp_ctx_t *ctx, fsdp_callback_fn fn, void *arg) {
    if (!ctx || !fn) return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_queue_callback: NULL argument");
    if (!fsdp_in_backward(ctx))
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_queue_callback: callbacks can only be queued during backward");
    struct fsdp_tape *root = ctx->tape;
    while (root->parent) root = root->parent;
    if (root->ncbs == root->capcbs) {
        size_t cap = root->capcbs ? root->capcbs * 2 : 8;
        struct callback *nc = realloc(root->cbs, cap * sizeof *nc);
        if (!nc) return fsdp__ctx_err(ctx, FSDP_ENOMEM, "fsdp_queue_callback: out of memory");
        root->cbs = nc;
        root->capcbs = cap;
    }
    root->cbs[root->ncbs++] = (struct callback){fn, arg};
    return FSDP_OK;
}
