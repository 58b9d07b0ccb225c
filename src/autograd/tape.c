/*
 * tape.c: the per-rank autograd tape and the backward engine.
 *
 * The tape is an array of entries in recording order: operation nodes and marks. Non-leaf
 * tensors are named by slot numbers, so a node never holds its own outputs (activations that
 * nothing saved are freed as soon as the user drops them). Backward keeps one gradient per slot,
 * walks the entries in reverse (recording order is a topological order), and frees each node
 * and each slot's gradient as soon as they are consumed.
 *
 * Generations. Every tape (and every clear of it) gets a new generation number from a process
 * counter; a tensor remembers the generation that gave it its slot, so a tensor from a cleared
 * graph is recognised instead of being read through a dangling slot.
 *
 * Recompute regions push a child tape on the context for the re-run, so what they record is
 * differentiated and dropped on its own, inside the parent's backward.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "autograd/autograd_impl.h"
#include "tensor/tensor_impl.h"

enum entry_kind { ENTRY_NODE = 0, ENTRY_MARK };

struct mark {
    char *label;
    int n;
    fsdp_tensor_t **ts; /* owned references */
    fsdp_mark_fn fn;
    void *arg;
    void (*arg_free)(void *arg);
};

struct entry {
    enum entry_kind kind;
    struct fsdp__node *node; /* NULL once its backward has run */
    struct mark *mark;
};

struct callback {
    fsdp_callback_fn fn;
    void *arg;
};

struct fsdp_tape {
    fsdp_ctx_t *ctx;
    struct fsdp_tape *parent; /* the tape a recompute region was pushed over, else NULL */
    struct entry *e;
    size_t n, cap;
    int64_t nslots;
    uint64_t gen;
    bool grad_enabled;
    bool in_backward;
    struct callback *cbs; /* final callbacks (root tape only) */
    size_t ncbs, capcbs;
};

static _Atomic uint64_t next_gen = 1;

static uint64_t new_gen(void) { return atomic_fetch_add(&next_gen, 1); }

static void node_free(struct fsdp__node *n) {
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

static void tape_reset(struct fsdp_tape *t) {
    /* Dropped newest first, so a mark's arg_free sees the nodes recorded before it intact. */
    for (size_t i = t->n; i-- > 0;) {
        node_free(t->e[i].node);
        mark_free(t->e[i].mark);
    }
    t->n = 0;
    t->nslots = 0;
    t->gen = new_gen();
}

static void tape_destroy(struct fsdp_tape *t) {
    if (!t) return;
    tape_reset(t);
    free(t->e);
    free(t->cbs);
    free(t);
}

static struct fsdp_tape *tape_new(fsdp_ctx_t *ctx, struct fsdp_tape *parent) {
    struct fsdp_tape *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->ctx = ctx;
    t->parent = parent;
    t->gen = new_gen();
    t->grad_enabled = true;
    return t;
}

/* The context's tape, created on first use (NULL only when memory runs out). */
static struct fsdp_tape *get_tape(fsdp_ctx_t *ctx) {
    if (!ctx) return NULL;
    if (!ctx->tape) {
        ctx->tape = tape_new(ctx, NULL);
        ctx->tape_destroy = tape_destroy;
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
    struct fsdp_tape *t = get_tape(ctx);
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
static void sync_tensor_cat(fsdp_ctx_t *ctx) {
    atomic_store(&ctx->tensor_mem_cat,
                 fsdp_in_backward(ctx) ? (int)FSDP_MEM_GRADS : (int)FSDP_MEM_ACTIVATIONS);
}

size_t fsdp_tape_size(const fsdp_ctx_t *ctx) {
    return ctx && ctx->tape ? ctx->tape->n : 0;
}

void fsdp_tape_clear(fsdp_ctx_t *ctx) {
    if (ctx && ctx->tape && !ctx->tape->in_backward) tape_reset(ctx->tape);
}

/* ---- recording ----------------------------------------------------------------------------- */

/* Whether t has a live slot on tape. */
static bool live_slot(const struct fsdp_tape *tape, const fsdp_tensor_t *t) {
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
    struct fsdp_tape *tape = get_tape(ctx);
    if (!tape) return fsdp__ctx_err(ctx, FSDP_ENOMEM, "autograd: no memory for the tape");
    bool any = false;
    for (int i = 0; i < nin; i++) {
        if (!in[i] || !in[i]->requires_grad) continue;
        if (in[i]->slot >= 0 && !live_slot(tape, in[i]))
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
        node_free(n);
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
    node_free(n);
    return fsdp__ctx_err(ctx, FSDP_ENOMEM, "%s: no memory to record the operation", def->name);
}

int fsdp__node_save(struct fsdp__node *node, fsdp_tensor_t *t) {
    if (node->nsaved >= FSDP__NODE_SAVED)
        return fsdp__ctx_err(t ? t->ctx : NULL, FSDP_EINTERNAL,
                             "%s: more than %d saved tensors", node->def->name, FSDP__NODE_SAVED);
    node->saved[node->nsaved++] = t ? fsdp_tensor_retain(t) : NULL;
    return FSDP_OK;
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
    struct fsdp_tape *tape = get_tape(ctx);
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

/* ---- backward ------------------------------------------------------------------------------- */

static bool same_shape(const fsdp_tensor_t *t, int ndim, const int64_t *shape) {
    return t->ndim == ndim && memcmp(t->shape, shape, sizeof(int64_t) * (size_t)ndim) == 0;
}

/* Adds g into leaf->grad (creating it), then runs the leaf's hooks. Takes g's reference. */
static int accumulate_leaf(fsdp_tensor_t *leaf, fsdp_tensor_t *g) {
    int rc = FSDP_OK;
    if (g->dt != leaf->dt) {
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
                          "the gradient of '%s' has had its storage freed",
                          fsdp_tensor_name(leaf));
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
    for (struct fsdp_grad_hook *h = leaf->hooks; h && rc == 0; h = h->next) rc = h->fn(leaf, h->arg);
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
    while (cap < 2 * uses + 2) cap *= 2;
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
        for (int64_t s = 0; s < bw->tape->nslots; s++) fsdp_tensor_release(bw->grads[s]);
    for (size_t i = 0; i < bw->cap; i++) fsdp_tensor_release(bw->leaves[i].grad);
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
        for (int i = 0; i < n->nin; i++) fsdp_tensor_release(gin[i]);
    if (gout)
        for (int o = 0; o < n->nout; o++) fsdp_tensor_release(gout[o]);
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
        if (live_slot(bw->tape, t)) {
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
    if (y->slot >= 0 && !live_slot(tape, y))
        return fsdp__op_err(y, FSDP_EINVAL, "fsdp_backward",
                            "the graph of %s was already freed by an earlier backward or "
                            "fsdp_tape_clear",
                            fsdp_tensor_describe(y, a, sizeof a));
    if (gy && !same_shape(gy, y->ndim, y->shape))
        return fsdp__op_err(y, FSDP_EINVAL, "fsdp_backward",
                            "grad_output %s does not match the output %s",
                            fsdp_tensor_describe(gy, b, sizeof b),
                            fsdp_tensor_describe(y, a, sizeof a));
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
        return fsdp__ctx_err(n > 0 && outputs && outputs[0] ? outputs[0]->ctx : NULL,
                             FSDP_EINVAL, "fsdp_backward: no outputs");
    fsdp_ctx_t *ctx = outputs[0]->ctx;
    struct fsdp_tape *tape = get_tape(ctx);
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
    bool was_enabled = tape->grad_enabled;
    tape->grad_enabled = false;
    tape->in_backward = true;
    sync_tensor_cat(ctx);
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
            node_free(e->node);
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
    sync_tensor_cat(ctx);
    tape->grad_enabled = was_enabled;
    tape_reset(tape);
    return rc;
}

int fsdp_backward(fsdp_tensor_t *loss, fsdp_tensor_t *grad_output) {
    if (!loss) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_backward: loss is NULL");
    return fsdp_backward_multi(1, &loss, &grad_output);
}

/* ---- recompute regions ---------------------------------------------------------------------- */

struct region {
    fsdp_region_fn fn;
    void *arg;
    int nin;             /* the region's inputs (the node may carry one more: an anchor) */
    uint64_t rng_offset; /* the random stream's position when the region first ran */
};

static int region_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                           fsdp_tensor_t **gin) {
    struct region *r = node->extra;
    fsdp_ctx_t *ctx = fsdp_tensor_ctx(gout[0]);
    int nin = r->nin, nout = node->nout, rc = FSDP_OK;
    struct fsdp_tape *parent = ctx->tape;
    struct fsdp_tape *sub = tape_new(ctx, parent);
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
    }
    ctx->tape = sub;
    sync_tensor_cat(ctx);
    ctx->rng.offset = r->rng_offset;
    rc = r->fn(ctx, r->arg, nin, ins, nout, outs);
    ctx->rng.offset = offset_now;
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
    sync_tensor_cat(ctx);
out:
    tape_destroy(sub);
    if (ins)
        for (int i = 0; i < nin; i++) fsdp_tensor_release(ins[i]);
    if (outs)
        for (int o = 0; o < nout; o++) fsdp_tensor_release(outs[o]);
    free(ins);
    free(outs);
    free(roots);
    free(rgrads);
    return rc;
}

/* Recorded whenever grad mode is on: parameters used inside the region need gradients even when
 * no input requires one. */
static const struct fsdp__op_def def_region = {"checkpoint", region_backward};

int fsdp_checkpoint(fsdp_ctx_t *ctx, fsdp_region_fn fn, void *arg, int nin,
                    fsdp_tensor_t *const *in, int nout, fsdp_tensor_t **out) {
    if (!ctx || !fn || nin < 0 || nout <= 0 || !out || (nin > 0 && !in))
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_checkpoint: fn, out and nout > 0 are required");
    if (nin > FSDP__NODE_SAVED)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_checkpoint: at most %d inputs (got %d)",
                             FSDP__NODE_SAVED, nin);
    for (int o = 0; o < nout; o++) out[o] = NULL;
    uint64_t offset = ctx->rng.offset;
    bool was = fsdp_set_grad_enabled(ctx, false);
    int rc = fn(ctx, arg, nin, in, nout, out);
    fsdp_set_grad_enabled(ctx, was);
    for (int o = 0; o < nout && rc == 0; o++)
        if (!out[o])
            rc = fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_checkpoint: the region left output %d NULL",
                               o);
    if (rc < 0) goto fail;
    if (!was) return FSDP_OK;

    struct fsdp_tape *tape = get_tape(ctx);
    struct region *r = malloc(sizeof *r);
    if (!tape || !r) {
        free(r);
        rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "fsdp_checkpoint: out of memory");
        goto fail;
    }
    r->fn = fn;
    r->arg = arg;
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
            for (int i = 0; i < nin; i++) args[i] = in[i];
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
    node->extra = r;
    node->extra_free = free;
    for (int i = 0; i < nin && rc == 0; i++) rc = fsdp__node_save(node, in[i]);
    if (rc < 0) goto fail; /* the node stays on the tape and is freed with it */
    return FSDP_OK;
fail:
    for (int o = 0; o < nout; o++) {
        fsdp_tensor_release(out[o]);
        out[o] = NULL;
    }
    return rc;
}
