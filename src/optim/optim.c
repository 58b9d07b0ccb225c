/* SPDX-License-Identifier: MIT */
/*
 * optim.c: SGD, Adam and AdamW over parameter groups, as torch.optim of PyTorch 1.13.
 *
 * The arithmetic lives in the device kernels (sgd_step, adam_step); this file keeps the groups
 * and the per-parameter state, and validates everything before it modifies anything. The state
 * dict (saving and loading) is in optim_state.c; the object's layout and its invariants are in
 * optim_impl.h.
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/trace.h"
#include "internal.h"
#include "optim/optim_impl.h"
#include "tensor/tensor_impl.h"

/* ---- hyper-parameters ------------------------------------------------------------------------ */

bool fsdp__optim_hp_valid(fsdp_optim_kind_t kind, const struct fsdp__hparams *h, char *why,
                          size_t len) {
    if (!(h->lr >= 0.0)) {
        snprintf(why, len, "invalid learning rate %g (must be >= 0)", h->lr);
        return false;
    }
    if (!(h->weight_decay >= 0.0)) {
        snprintf(why, len, "invalid weight_decay %g (must be >= 0)", h->weight_decay);
        return false;
    }
    if (kind == FSDP_OPTIM_SGD) {
        if (!(h->momentum >= 0.0)) {
            snprintf(why, len, "invalid momentum %g (must be >= 0)", h->momentum);
            return false;
        }
        if (isnan(h->dampening)) {
            snprintf(why, len, "invalid dampening (NaN)");
            return false;
        }
        if (h->nesterov && (h->momentum <= 0.0 || h->dampening != 0.0)) {
            snprintf(why, len,
                     "nesterov momentum requires momentum > 0 and dampening == 0 (momentum %g, "
                     "dampening %g)",
                     h->momentum, h->dampening);
            return false;
        }
        return true;
    }
    if (!(h->eps >= 0.0)) {
        snprintf(why, len, "invalid eps %g (must be >= 0)", h->eps);
        return false;
    }
    if (!(h->beta1 >= 0.0 && h->beta1 < 1.0)) {
        snprintf(why, len, "invalid beta1 %g (must be in [0, 1))", h->beta1);
        return false;
    }
    if (!(h->beta2 >= 0.0 && h->beta2 < 1.0)) {
        snprintf(why, len, "invalid beta2 %g (must be in [0, 1))", h->beta2);
        return false;
    }
    return true;
}

static const fsdp__abi_struct_t sgd_abi =
    FSDP__ABI_STRUCT(fsdp_sgd_options_t, "fsdp_sgd_options_init", nesterov);
const fsdp__abi_struct_t fsdp__adam_options_abi = FSDP__ABI_STRUCT(
    fsdp_adam_options_t, "fsdp_adam_options_init or fsdp_adamw_options_init", amsgrad);

/* The two structs share their first members, so the kind tag can be read before the struct's
 * type is known. */
_Static_assert(offsetof(fsdp_sgd_options_t, kind) == offsetof(fsdp_adam_options_t, kind),
               "the kind tag of the optimizer options is at one offset");

static const fsdp__abi_struct_t *opts_abi(fsdp_optim_kind_t kind) {
    return kind == FSDP_OPTIM_SGD ? &sgd_abi : &fsdp__adam_options_abi;
}

/* Reads a public option struct (its members after size start with the kind tag) for an
 * optimizer of `kind` into h and validates it. */
static int read_opts(fsdp_ctx_t *ctx, fsdp_optim_kind_t kind, const void *opts, const char *fn,
                     struct fsdp__hparams *h) {
    const fsdp_optim_kind_t tag = ((const fsdp_sgd_options_t *)opts)->kind;
    memset(h, 0, sizeof *h);
    /* The size is checked against the struct the tag names (the optimizer's when the tag is not
     * a kind), so that a mismatch is reported as one. */
    const bool tag_ok = tag == FSDP_OPTIM_SGD || tag == FSDP_OPTIM_ADAM || tag == FSDP_OPTIM_ADAMW;
    int rc = fsdp__abi_check(ctx, fn, "opts", opts, opts_abi(tag_ok ? tag : kind));
    if (rc < 0) return rc;
    if (tag != FSDP_OPTIM_SGD && tag != FSDP_OPTIM_ADAM && tag != FSDP_OPTIM_ADAMW)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "%s: the options' kind is %d: fill them with "
                             "fsdp_sgd_options_init(), fsdp_adam_options_init() or "
                             "fsdp_adamw_options_init() first",
                             fn, (int)tag);
    if ((tag == FSDP_OPTIM_SGD) != (kind == FSDP_OPTIM_SGD))
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: %s options given to an %s optimizer", fn,
                             tag == FSDP_OPTIM_SGD ? "SGD" : "Adam",
                             kind == FSDP_OPTIM_SGD ? "SGD" : "Adam/AdamW");
    if (kind == FSDP_OPTIM_SGD) {
        const fsdp_sgd_options_t *o = opts;
        h->lr = o->lr;
        h->momentum = o->momentum;
        h->dampening = o->dampening;
        h->weight_decay = o->weight_decay;
        h->nesterov = o->nesterov;
    } else {
        const fsdp_adam_options_t *o = opts;
        h->lr = o->lr;
        h->beta1 = o->beta1;
        h->beta2 = o->beta2;
        h->eps = o->eps;
        h->weight_decay = o->weight_decay;
        h->amsgrad = o->amsgrad;
    }
    char why[256];
    if (!fsdp__optim_hp_valid(kind, h, why, sizeof why))
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: %s", fn, why);
    return FSDP_OK;
}

/* Fills the caller's struct opts of opts_size bytes with h, as the _init functions fill it. */
static int write_opts(fsdp_ctx_t *ctx, fsdp_optim_kind_t kind, const struct fsdp__hparams *h,
                      void *opts, size_t opts_size) {
    static const char fn[] = "fsdp_optim_get_options";
    if (kind == FSDP_OPTIM_SGD) {
        fsdp_sgd_options_t o;
        memset(&o, 0, sizeof o);
        o.kind = FSDP_OPTIM_SGD;
        o.lr = h->lr;
        o.momentum = h->momentum;
        o.dampening = h->dampening;
        o.weight_decay = h->weight_decay;
        o.nesterov = h->nesterov;
        return fsdp__abi_fill(ctx, fn, "sizeof *opts", opts, opts_size, &o, &sgd_abi);
    }
    fsdp_adam_options_t o;
    memset(&o, 0, sizeof o);
    o.kind = kind;
    o.lr = h->lr;
    o.beta1 = h->beta1;
    o.beta2 = h->beta2;
    o.eps = h->eps;
    o.weight_decay = h->weight_decay;
    o.amsgrad = h->amsgrad;
    return fsdp__abi_fill(ctx, fn, "sizeof *opts", opts, opts_size, &o, &fsdp__adam_options_abi);
}

void(fsdp_sgd_options_init)(fsdp_sgd_options_t *opts, size_t size) {
    fsdp_sgd_options_t d;
    memset(&d, 0, sizeof d);
    d.kind = FSDP_OPTIM_SGD;
    d.lr = 1e-3;
    fsdp__abi_init(opts, size, &d, &sgd_abi);
}

static void adam_defaults(fsdp_adam_options_t *d, fsdp_optim_kind_t kind) {
    memset(d, 0, sizeof *d);
    d->kind = kind;
    d->lr = 1e-3;
    d->beta1 = 0.9;
    d->beta2 = 0.999;
    d->eps = 1e-8;
    if (kind == FSDP_OPTIM_ADAMW) d->weight_decay = 1e-2;
}

void(fsdp_adam_options_init)(fsdp_adam_options_t *opts, size_t size) {
    fsdp_adam_options_t d;
    adam_defaults(&d, FSDP_OPTIM_ADAM);
    fsdp__abi_init(opts, size, &d, &fsdp__adam_options_abi);
}

void(fsdp_adamw_options_init)(fsdp_adam_options_t *opts, size_t size) {
    fsdp_adam_options_t d;
    adam_defaults(&d, FSDP_OPTIM_ADAMW);
    fsdp__abi_init(opts, size, &d, &fsdp__adam_options_abi);
}

/* ---- creation -------------------------------------------------------------------------------- */

static int optim_new(fsdp_ctx_t *ctx, fsdp_optim_kind_t kind, const void *defaults, const char *fn,
                     fsdp_optim_t **out) {
    if (!out) return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: out is NULL", fn);
    *out = NULL;
    if (!ctx) return FSDP_EINVAL;
    struct fsdp__hparams h;
    int rc = read_opts(ctx, kind, defaults, fn, &h);
    if (rc < 0) return rc;
    fsdp_optim_t *opt = calloc(1, sizeof *opt);
    if (!opt) return fsdp__ctx_err(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
    opt->ctx = ctx;
    opt->kind = kind;
    opt->defaults = h;
    *out = opt;
    return FSDP_OK;
}

int fsdp_optim_sgd_create(fsdp_ctx_t *ctx, const fsdp_sgd_options_t *defaults, fsdp_optim_t **out) {
    fsdp_sgd_options_t d;
    if (!defaults) {
        fsdp_sgd_options_init(&d);
        defaults = &d;
    }
    return optim_new(ctx, FSDP_OPTIM_SGD, defaults, "fsdp_optim_sgd_create", out);
}

int fsdp_optim_adam_create(fsdp_ctx_t *ctx, const fsdp_adam_options_t *defaults, bool decoupled,
                           fsdp_optim_t **out) {
    fsdp_adam_options_t d;
    if (!defaults) {
        if (decoupled)
            fsdp_adamw_options_init(&d);
        else
            fsdp_adam_options_init(&d);
        defaults = &d;
    }
    return optim_new(ctx, decoupled ? FSDP_OPTIM_ADAMW : FSDP_OPTIM_ADAM, defaults,
                     "fsdp_optim_adam_create", out);
}

void fsdp__optim_drop_buffers(struct fsdp__oparam *p) {
    for (int s = 0; s < FSDP__OPTIM_NBUF; s++) {
        fsdp_tensor_release(p->buf[s]);
        p->buf[s] = NULL;
        p->fresh[s] = false;
    }
    p->step = 0;
}

void fsdp_optim_destroy(fsdp_optim_t *opt) {
    if (!opt) return;
    for (size_t i = 0; i < opt->nparams; i++) {
        fsdp__optim_drop_buffers(&opt->params[i]);
        fsdp_tensor_release(opt->params[i].t);
        free(opt->params[i].name);
    }
    free(opt->params);
    free(opt->groups);
    free(opt);
}

fsdp_optim_kind_t fsdp_optim_kind(const fsdp_optim_t *opt) {
    return opt ? opt->kind : (fsdp_optim_kind_t)0;
}

fsdp_ctx_t *fsdp_optim_ctx(const fsdp_optim_t *opt) {
    return opt ? opt->ctx : NULL;
}

/* ---- parameter groups ------------------------------------------------------------------------ */

static const char *param_name(const char *const *names, fsdp_tensor_t *const *params, size_t i) {
    return names && names[i] ? names[i] : fsdp_tensor_name(params[i]);
}

/* Checks parameter i of a group being added against the optimizer and the group's earlier
 * parameters. */
static int check_new_param(const fsdp_optim_t *opt, fsdp_tensor_t *const *params,
                           const char *const *names, size_t i) {
    static const char fn[] = "fsdp_optim_add_group";
    fsdp_ctx_t *ctx = opt->ctx;
    const fsdp_tensor_t *t = params[i];
    if (!t) return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: parameter %zu is NULL", fn, i);
    const char *name = param_name(names, params, i);
    if (!name[0])
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "%s: parameter %zu has no name (pass names, or name the tensor)", fn,
                             i);
    if (t->ctx != ctx)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: parameter '%s' belongs to another context", fn,
                             name);
    if (!fsdp_tensor_is_leaf(t))
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "%s: parameter '%s' is not a leaf tensor; only leaves can be "
                             "optimized",
                             fn, name);
    if (t->dt != FSDP_DTYPE_F32 && t->dt != FSDP_DTYPE_F64)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "%s: parameter '%s' is %s; optimizers update f32 and f64 "
                             "parameters",
                             fn, name, fsdp_dtype_name(t->dt));
    for (size_t j = 0; j < opt->nparams; j++) {
        const struct fsdp__oparam *q = &opt->params[j];
        if (q->t == t)
            return fsdp__ctx_err(ctx, FSDP_EINVAL,
                                 "%s: parameter '%s' is already in group %d (as '%s'); a "
                                 "parameter may appear in only one group",
                                 fn, name, q->group, q->name);
        if (strcmp(q->name, name) == 0)
            return fsdp__ctx_err(ctx, FSDP_EINVAL,
                                 "%s: name '%s' is already used by a parameter of group %d", fn,
                                 name, q->group);
    }
    for (size_t j = 0; j < i; j++) {
        if (params[j] == t)
            return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: parameter '%s' appears twice in the group",
                                 fn, name);
        if (strcmp(param_name(names, params, j), name) == 0)
            return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: name '%s' is given twice in the group", fn,
                                 name);
    }
    return FSDP_OK;
}

int fsdp_optim_add_group(fsdp_optim_t *opt, size_t n, fsdp_tensor_t *const *params,
                         const char *const *names, const void *overrides, int *group) {
    static const char fn[] = "fsdp_optim_add_group";
    if (!opt) return FSDP_EINVAL;
    fsdp_ctx_t *ctx = opt->ctx;
    char **copies = NULL;
    int rc = FSDP_OK;
    if (n > 0 && !params) return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: params is NULL", fn);
    struct fsdp__hparams h = opt->defaults;
    if (overrides) FSDP_TRY(rc, fail, read_opts(ctx, opt->kind, overrides, fn, &h));
    for (size_t i = 0; i < n; i++)
        FSDP_TRY(rc, fail, check_new_param(opt, params, names, i));

    /* Everything that can fail is allocated before anything is committed. */
    copies = calloc(n ? n : 1, sizeof *copies);
    if (!copies) goto oom;
    for (size_t i = 0; i < n; i++) {
        copies[i] = strdup(param_name(names, params, i));
        if (!copies[i]) goto oom;
    }
    struct fsdp__oparam *np = realloc(opt->params, (opt->nparams + n + 1) * sizeof *np);
    if (!np) goto oom;
    opt->params = np;
    struct fsdp__ogroup *ng = realloc(opt->groups, ((size_t)opt->ngroups + 1) * sizeof *ng);
    if (!ng) goto oom;
    opt->groups = ng;

    struct fsdp__ogroup *g = &opt->groups[opt->ngroups];
    g->hp = h;
    g->begin = opt->nparams;
    g->count = n;
    for (size_t i = 0; i < n; i++) {
        struct fsdp__oparam *p = &opt->params[opt->nparams + i];
        memset(p, 0, sizeof *p);
        p->t = fsdp_tensor_retain(params[i]);
        p->name = copies[i];
        p->group = opt->ngroups;
    }
    opt->nparams += n;
    if (group) *group = opt->ngroups;
    opt->ngroups++;
    free(copies);
    return FSDP_OK;

oom:
    rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
fail:
    if (copies)
        for (size_t i = 0; i < n; i++)
            free(copies[i]);
    free(copies);
    return rc;
}

int fsdp_optim_num_groups(const fsdp_optim_t *opt) {
    return opt ? opt->ngroups : 0;
}

static bool group_ok(const fsdp_optim_t *opt, int group) {
    return opt && group >= 0 && group < opt->ngroups;
}

size_t fsdp_optim_group_size(const fsdp_optim_t *opt, int group) {
    return group_ok(opt, group) ? opt->groups[group].count : 0;
}

fsdp_tensor_t *fsdp_optim_group_param(const fsdp_optim_t *opt, int group, size_t i,
                                      const char **name) {
    if (name) *name = NULL;
    if (!group_ok(opt, group) || i >= opt->groups[group].count) return NULL;
    const struct fsdp__oparam *p = &opt->params[opt->groups[group].begin + i];
    if (name) *name = p->name;
    return p->t;
}

static int bad_group(const fsdp_optim_t *opt, int group, const char *fn) {
    return fsdp__ctx_err(opt->ctx, FSDP_EINVAL, "%s: group %d does not exist (%d groups)", fn,
                         group, opt->ngroups);
}

int fsdp_optim_get_lr(const fsdp_optim_t *opt, int group, double *lr) {
    if (!opt || !lr) return FSDP_EINVAL;
    if (!group_ok(opt, group)) return bad_group(opt, group, "fsdp_optim_get_lr");
    *lr = opt->groups[group].hp.lr;
    return FSDP_OK;
}

int fsdp_optim_set_lr(fsdp_optim_t *opt, int group, double lr) {
    if (!opt) return FSDP_EINVAL;
    if (!group_ok(opt, group)) return bad_group(opt, group, "fsdp_optim_set_lr");
    if (!(lr >= 0.0))
        return fsdp__ctx_err(opt->ctx, FSDP_EINVAL,
                             "fsdp_optim_set_lr: invalid learning rate %g (must be >= 0)", lr);
    opt->groups[group].hp.lr = lr;
    return FSDP_OK;
}

int(fsdp_optim_get_options)(const fsdp_optim_t *opt, int group, void *opts, size_t opts_size) {
    if (!opt || !opts) return FSDP_EINVAL;
    if (group != -1 && !group_ok(opt, group))
        return bad_group(opt, group, "fsdp_optim_get_options");
    return write_opts(opt->ctx, opt->kind, group == -1 ? &opt->defaults : &opt->groups[group].hp,
                      opts, opts_size);
}

int fsdp_optim_set_options(fsdp_optim_t *opt, int group, const void *opts) {
    static const char fn[] = "fsdp_optim_set_options";
    if (!opt) return FSDP_EINVAL;
    if (!opts) return fsdp__ctx_err(opt->ctx, FSDP_EINVAL, "%s: opts is NULL", fn);
    if (group != -1 && !group_ok(opt, group)) return bad_group(opt, group, fn);
    struct fsdp__hparams h;
    int rc = read_opts(opt->ctx, opt->kind, opts, fn, &h);
    if (rc < 0) return rc;
    if (group == -1)
        opt->defaults = h;
    else
        opt->groups[group].hp = h;
    return FSDP_OK;
}

/* ---- stepping -------------------------------------------------------------------------------- */

bool fsdp__optim_same_shape(const fsdp_tensor_t *a, const fsdp_tensor_t *b) {
    return a->ndim == b->ndim && memcmp(a->shape, b->shape, sizeof(int64_t) * (size_t)a->ndim) == 0;
}

/* Whether a gradient of dtype gt can step a parameter of dtype pt: the same dtype, or a float
 * of lower precision that widens exactly (f16/bf16 for f32, f16/bf16/f32 for f64). PyTorch's
 * optimizers promote such a gradient (keep_low_precision_grads hands them f16 gradients of f32
 * flat parameters); the step upcasts it into a temporary of the parameter's dtype. */
static bool grad_dtype_ok(fsdp_dtype_t gt, fsdp_dtype_t pt) {
    if (gt == pt) return true;
    const bool half = gt == FSDP_DTYPE_F16 || gt == FSDP_DTYPE_BF16;
    return (pt == FSDP_DTYPE_F32 && half) ||
           (pt == FSDP_DTYPE_F64 && (half || gt == FSDP_DTYPE_F32));
}

/* Whether a parameter's step can run: dtypes, storage, gradient, device kernel. */
static int check_step_param(const fsdp_optim_t *opt, const struct fsdp__oparam *p) {
    static const char fn[] = "fsdp_optim_step";
    const fsdp_tensor_t *t = p->t, *g = t->grad;
    fsdp_ctx_t *ctx = opt->ctx;
    char a[160], b[160];
    const bool empty = fsdp_tensor_numel(t) == 0;
    if (!empty && !fsdp_tensor_data(t))
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "%s: parameter '%s' has no storage (freed by a resize to 0 bytes)", fn,
                             p->name);
    if (!grad_dtype_ok(g->dt, t->dt) || !fsdp__optim_same_shape(g, t))
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "%s: the gradient of parameter '%s' is %s but the parameter is %s; "
                             "they must have the same dtype and shape (a float gradient of lower "
                             "precision than the parameter is also accepted)",
                             fn, p->name, fsdp_tensor_describe(g, a, sizeof a),
                             fsdp_tensor_describe(t, b, sizeof b));
    if (g->ctx != t->ctx || g->dev != t->dev)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "%s: the gradient of parameter '%s' is on another device or context",
                             fn, p->name);
    if (!empty && !fsdp_tensor_data(g))
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: the gradient of parameter '%s' has no storage",
                             fn, p->name);
    const struct fsdp_dev_ops *ops = t->dev->ops;
    if ((opt->kind == FSDP_OPTIM_SGD && !ops->sgd_step) ||
        (opt->kind != FSDP_OPTIM_SGD && !ops->adam_step))
        return fsdp__ctx_err(ctx, FSDP_ENOTSUP, "%s: device %s has no %s kernel (parameter '%s')",
                             fn, t->dev->name,
                             opt->kind == FSDP_OPTIM_SGD ? "sgd_step" : "adam_step", p->name);
    return FSDP_OK;
}

/* A new state buffer for p, zero-filled unless the kernel writes it before reading it. */
static int new_buffer(struct fsdp__oparam *p, int slot, bool zero) {
    const fsdp_tensor_t *t = p->t;
    fsdp_tensor_t *b = NULL;
    int rc = fsdp__tensor_new(t->ctx, t->dev, t->dt, t->ndim, t->shape, FSDP_MEM_OPTIM, &b);
    if (rc < 0) return rc;
    if (zero && fsdp_tensor_numel(b) > 0) {
        rc = t->dev->ops->fill(t->dev, t->dt, (size_t)fsdp_tensor_numel(b), 0.0,
                               fsdp_tensor_data(b));
        if (rc < 0) {
            fsdp_tensor_release(b);
            return rc;
        }
    }
    p->buf[slot] = b;
    p->fresh[slot] = true;
    return FSDP_OK;
}

/* Creates the state p's step needs and does not have yet (PyTorch's lazy initialisation). */
static int ensure_state(const fsdp_optim_t *opt, struct fsdp__oparam *p) {
    const struct fsdp__hparams *h = &opt->groups[p->group].hp;
    int rc = FSDP_OK;
    if (opt->kind == FSDP_OPTIM_SGD) {
        /* The first step copies the update direction into the buffer (the kernel's `first`). */
        if (h->momentum != 0.0 && !p->buf[FSDP__OPTIM_MOMENTUM])
            rc = new_buffer(p, FSDP__OPTIM_MOMENTUM, false);
        return rc;
    }
    if (!p->buf[FSDP__OPTIM_EXP_AVG]) {
        p->step = 0;
        FSDP_TRY(rc, out, new_buffer(p, FSDP__OPTIM_EXP_AVG, true));
    }
    if (!p->buf[FSDP__OPTIM_EXP_AVG_SQ])
        FSDP_TRY(rc, out, new_buffer(p, FSDP__OPTIM_EXP_AVG_SQ, true));
    if (h->amsgrad && !p->buf[FSDP__OPTIM_MAX_EXP_AVG_SQ])
        FSDP_TRY(rc, out, new_buffer(p, FSDP__OPTIM_MAX_EXP_AVG_SQ, true));
out:
    return rc;
}

/* Drops the buffers a failed step created but did not use. */
static void drop_fresh(fsdp_optim_t *opt) {
    for (size_t i = 0; i < opt->nparams; i++) {
        struct fsdp__oparam *p = &opt->params[i];
        for (int s = 0; s < FSDP__OPTIM_NBUF; s++) {
            if (!p->fresh[s]) continue;
            fsdp_tensor_release(p->buf[s]);
            p->buf[s] = NULL;
            p->fresh[s] = false;
        }
        if (opt->kind != FSDP_OPTIM_SGD && !p->buf[FSDP__OPTIM_EXP_AVG]) p->step = 0;
    }
}

static void *data_or_null(const fsdp_tensor_t *t) {
    return t ? fsdp_tensor_data(t) : NULL;
}

/* A contiguous copy of g in dtype dt (FSDP_MEM_OTHER): a clone, and for a gradient of lower
 * precision its exact upcast. */
static int stage_grad(fsdp_tensor_t *g, fsdp_dtype_t dt, fsdp_tensor_t **out) {
    fsdp_tensor_t *c = NULL, *d = NULL;
    int rc = FSDP_OK;
    if (!fsdp_tensor_is_contiguous(g)) FSDP_TRY(rc, done, fsdp_tensor_clone(g, FSDP_MEM_OTHER, &c));
    if (g->dt != dt) {
        const fsdp_tensor_t *src = c ? c : g;
        FSDP_TRY(rc, done,
                 fsdp__tensor_new(g->ctx, g->dev, dt, g->ndim, g->shape, FSDP_MEM_OTHER, &d));
        FSDP_TRY(rc, done,
                 g->dev->ops->cast(g->dev, dt, fsdp_tensor_data(d), src->dt, fsdp_tensor_data(src),
                                   (size_t)fsdp_tensor_numel(src)));
        fsdp_tensor_release(c);
        c = d;
        d = NULL;
    }
done:
    if (rc < 0) {
        fsdp_tensor_release(c);
        c = NULL;
    }
    fsdp_tensor_release(d);
    *out = c;
    return rc;
}

/* Runs the kernel on one parameter, staging contiguous copies of a non-contiguous parameter or
 * gradient, and a gradient of lower precision upcast to the parameter's dtype. */
static int update_param(const fsdp_optim_t *opt, struct fsdp__oparam *p) {
    const struct fsdp__hparams *h = &opt->groups[p->group].hp;
    fsdp_tensor_t *t = p->t, *g = t->grad, *pc = NULL, *gc = NULL;
    fsdp_device_t *dev = t->dev;
    const size_t n = (size_t)fsdp_tensor_numel(t);
    int rc = FSDP_OK;
    if (n > 0 && !fsdp_tensor_is_contiguous(t))
        FSDP_TRY(rc, out, fsdp_tensor_clone(t, FSDP_MEM_OTHER, &pc));
    if (n > 0 && (g->dt != t->dt || !fsdp_tensor_is_contiguous(g)))
        FSDP_TRY(rc, out, stage_grad(g, t->dt, &gc));
    void *pd = fsdp_tensor_data(pc ? pc : t);
    const void *gd = fsdp_tensor_data(gc ? gc : g);
    if (opt->kind == FSDP_OPTIM_SGD) {
        const bool mom = h->momentum != 0.0;
        FSDP_TRY(rc, out,
                 dev->ops->sgd_step(dev, t->dt, n, pd, gd,
                                    mom ? data_or_null(p->buf[FSDP__OPTIM_MOMENTUM]) : NULL, h->lr,
                                    h->momentum, h->dampening, h->weight_decay, h->nesterov,
                                    mom && p->fresh[FSDP__OPTIM_MOMENTUM]));
    } else {
        const int64_t step = p->step + 1;
        FSDP_TRY(rc, out,
                 dev->ops->adam_step(
                     dev, t->dt, n, pd, gd, data_or_null(p->buf[FSDP__OPTIM_EXP_AVG]),
                     data_or_null(p->buf[FSDP__OPTIM_EXP_AVG_SQ]),
                     h->amsgrad ? data_or_null(p->buf[FSDP__OPTIM_MAX_EXP_AVG_SQ]) : NULL, h->lr,
                     h->beta1, h->beta2, h->eps, h->weight_decay, opt->kind == FSDP_OPTIM_ADAMW,
                     h->amsgrad, step));
        p->step = step;
    }
    /* The kernel has initialised whatever this step created. */
    for (int s = 0; s < FSDP__OPTIM_NBUF; s++)
        p->fresh[s] = false;
    if (pc) rc = fsdp_tensor_copy_(t, pc);
out:
    fsdp_tensor_release(pc);
    fsdp_tensor_release(gc);
    if (rc < 0)
        fsdp__ctx_err(opt->ctx, rc, "fsdp_optim_step: updating parameter '%s' failed: %s", p->name,
                      fsdp_ctx_last_error(opt->ctx));
    return rc;
}

int fsdp_optim_step(fsdp_optim_t *opt) {
    if (!opt) return FSDP_EINVAL;
    int rc = FSDP_OK;
    bool was = true;
    bool traced = fsdp__tracing(opt->ctx);
    if (traced) fsdp__trace_begin(opt->ctx, FSDP__TRACE_OPTIM, "step");
    /* Every parameter is checked before any is touched. */
    for (size_t i = 0; i < opt->nparams; i++)
        if (opt->params[i].t->grad) FSDP_TRY(rc, out, check_step_param(opt, &opt->params[i]));
    for (size_t i = 0; i < opt->nparams; i++)
        if (opt->params[i].t->grad) FSDP_TRY(rc, fail, ensure_state(opt, &opt->params[i]));
    was = fsdp_set_grad_enabled(opt->ctx, false);
    for (size_t i = 0; i < opt->nparams && rc == FSDP_OK; i++)
        if (opt->params[i].t->grad) rc = update_param(opt, &opt->params[i]);
    fsdp_set_grad_enabled(opt->ctx, was);
    if (rc < 0) goto fail;
    goto out;
fail:
    drop_fresh(opt);
out:
    if (traced) fsdp__trace_end(opt->ctx, FSDP__TRACE_OPTIM, "step");
    return rc;
}

int fsdp_optim_zero_grad(fsdp_optim_t *opt, bool set_to_none) {
    if (!opt) return FSDP_EINVAL;
    for (size_t i = 0; i < opt->nparams; i++) {
        int rc = fsdp_tensor_zero_grad(opt->params[i].t, set_to_none);
        if (rc < 0) return rc;
    }
    return FSDP_OK;
}

size_t fsdp_optim_state_bytes(const fsdp_optim_t *opt) {
    size_t total = 0;
    if (!opt) return 0;
    for (size_t i = 0; i < opt->nparams; i++)
        for (int s = 0; s < FSDP__OPTIM_NBUF; s++)
            if (opt->params[i].buf[s]) total += fsdp_tensor_storage_bytes(opt->params[i].buf[s]);
    return total;
}
