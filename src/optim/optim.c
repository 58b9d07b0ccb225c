/*
 * optim.c: SGD, Adam and AdamW over parameter groups, as torch.optim of PyTorch 1.13.
 *
 * The arithmetic lives in the device kernels (sgd_step, adam_step); this file keeps the groups,
 * the per-parameter state and the state dict, and validates everything before it modifies
 * anything.
 *
 * Invariants:
 *   - params[] holds every parameter once, groups in order: group g owns
 *     params[groups[g].begin .. groups[g].begin + groups[g].count).
 *   - State buffers are contiguous, in their parameter's dtype, shape and device, counted under
 *     FSDP_MEM_OPTIM; NULL means "not created". A parameter has state iff its momentum buffer
 *     (SGD) or its exp_avg (Adam, AdamW) exists; Adam's step is 0 without state.
 *   - `fresh` flags are only set inside fsdp_optim_step(): a buffer created by the running step
 *     whose kernel has not run yet. Whatever is still fresh when a step fails is dropped, so a
 *     failed step never leaves half-initialised state behind.
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "tensor/tensor_impl.h"

/* State entries of a parameter; the first NBUF are buffers, SLOT_STEP is Adam's count. */
enum { SLOT_MOMENTUM = 0, SLOT_EXP_AVG, SLOT_EXP_AVG_SQ, SLOT_MAX_EXP_AVG_SQ, NBUF };
enum { SLOT_STEP = NBUF, NSLOT };

static const char *const slot_names[NSLOT] = {"momentum_buffer", "exp_avg", "exp_avg_sq",
                                              "max_exp_avg_sq", "step"};

/* Hyper-parameters of every algorithm in one struct; each kind reads its own fields. */
struct hparams {
    double lr, momentum, dampening, beta1, beta2, eps, weight_decay;
    bool nesterov, amsgrad;
};

#define K_SGD 1u
#define K_ADAM 2u

/* The hyper-parameters a state dict carries, in the order it lists them. */
static const struct hp_desc {
    const char *name;
    unsigned kinds; /* K_SGD and/or K_ADAM */
    size_t off;     /* offset of the double or bool field in struct hparams */
    bool flag;      /* a bool field, saved as 0 or 1 */
} hp_table[] = {
    {"lr", K_SGD | K_ADAM, offsetof(struct hparams, lr), false},
    {"momentum", K_SGD, offsetof(struct hparams, momentum), false},
    {"dampening", K_SGD, offsetof(struct hparams, dampening), false},
    {"beta1", K_ADAM, offsetof(struct hparams, beta1), false},
    {"beta2", K_ADAM, offsetof(struct hparams, beta2), false},
    {"eps", K_ADAM, offsetof(struct hparams, eps), false},
    {"weight_decay", K_SGD | K_ADAM, offsetof(struct hparams, weight_decay), false},
    {"nesterov", K_SGD, offsetof(struct hparams, nesterov), true},
    {"amsgrad", K_ADAM, offsetof(struct hparams, amsgrad), true},
};
#define NHP (sizeof hp_table / sizeof hp_table[0])

struct oparam {
    fsdp_tensor_t *t; /* retained */
    char *name;       /* owned */
    int group;
    int64_t step;             /* Adam steps taken */
    fsdp_tensor_t *buf[NBUF]; /* owned state buffers, NULL when absent */
    bool fresh[NBUF];         /* see the invariants above */
};

struct group {
    struct hparams hp;
    size_t begin, count;
};

struct fsdp_optim {
    fsdp_ctx_t *ctx;
    fsdp_optim_kind_t kind;
    struct hparams defaults;
    struct group *groups;
    int ngroups;
    struct oparam *params;
    size_t nparams;
};

/* ---- hyper-parameters ------------------------------------------------------------------------ */

static unsigned kind_mask(fsdp_optim_kind_t kind) {
    return kind == FSDP_OPTIM_SGD ? K_SGD : K_ADAM;
}

static double hp_get(const struct hparams *h, const struct hp_desc *d) {
    const char *base = (const char *)h + d->off;
    if (d->flag) return *(const bool *)(const void *)base ? 1.0 : 0.0;
    return *(const double *)(const void *)base;
}

static void hp_set(struct hparams *h, const struct hp_desc *d, double v) {
    char *base = (char *)h + d->off;
    if (d->flag)
        *(bool *)(void *)base = v != 0.0;
    else
        *(double *)(void *)base = v;
}

/* Checks h for an optimizer of `kind` as PyTorch's constructors do; on failure writes the
 * reason into why and returns false. NaN fails every comparison, so it is refused too. */
static bool hp_valid(fsdp_optim_kind_t kind, const struct hparams *h, char *why, size_t len) {
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

/* Reads a public option struct (its first member is the kind tag) for an optimizer of `kind`
 * into h and validates it. */
static int read_opts(fsdp_ctx_t *ctx, fsdp_optim_kind_t kind, const void *opts, const char *fn,
                     struct hparams *h) {
    const fsdp_optim_kind_t tag = *(const fsdp_optim_kind_t *)opts;
    memset(h, 0, sizeof *h);
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
    if (!hp_valid(kind, h, why, sizeof why))
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: %s", fn, why);
    return FSDP_OK;
}

static void write_opts(fsdp_optim_kind_t kind, const struct hparams *h, void *opts) {
    if (kind == FSDP_OPTIM_SGD) {
        fsdp_sgd_options_t *o = opts;
        memset(o, 0, sizeof *o);
        o->kind = FSDP_OPTIM_SGD;
        o->lr = h->lr;
        o->momentum = h->momentum;
        o->dampening = h->dampening;
        o->weight_decay = h->weight_decay;
        o->nesterov = h->nesterov;
    } else {
        fsdp_adam_options_t *o = opts;
        memset(o, 0, sizeof *o);
        o->kind = kind;
        o->lr = h->lr;
        o->beta1 = h->beta1;
        o->beta2 = h->beta2;
        o->eps = h->eps;
        o->weight_decay = h->weight_decay;
        o->amsgrad = h->amsgrad;
    }
}

void fsdp_sgd_options_init(fsdp_sgd_options_t *opts) {
    if (!opts) return;
    memset(opts, 0, sizeof *opts);
    opts->kind = FSDP_OPTIM_SGD;
    opts->lr = 1e-3;
}

void fsdp_adam_options_init(fsdp_adam_options_t *opts) {
    if (!opts) return;
    memset(opts, 0, sizeof *opts);
    opts->kind = FSDP_OPTIM_ADAM;
    opts->lr = 1e-3;
    opts->beta1 = 0.9;
    opts->beta2 = 0.999;
    opts->eps = 1e-8;
}

void fsdp_adamw_options_init(fsdp_adam_options_t *opts) {
    if (!opts) return;
    fsdp_adam_options_init(opts);
    opts->kind = FSDP_OPTIM_ADAMW;
    opts->weight_decay = 1e-2;
}

/* ---- creation -------------------------------------------------------------------------------- */

static int optim_new(fsdp_ctx_t *ctx, fsdp_optim_kind_t kind, const void *defaults, const char *fn,
                     fsdp_optim_t **out) {
    if (!out) return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: out is NULL", fn);
    *out = NULL;
    if (!ctx) return FSDP_EINVAL;
    struct hparams h;
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

static void drop_buffers(struct oparam *p) {
    for (int s = 0; s < NBUF; s++) {
        fsdp_tensor_release(p->buf[s]);
        p->buf[s] = NULL;
        p->fresh[s] = false;
    }
    p->step = 0;
}

void fsdp_optim_destroy(fsdp_optim_t *opt) {
    if (!opt) return;
    for (size_t i = 0; i < opt->nparams; i++) {
        drop_buffers(&opt->params[i]);
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
        const struct oparam *q = &opt->params[j];
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
    struct hparams h = opt->defaults;
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
    struct oparam *np = realloc(opt->params, (opt->nparams + n + 1) * sizeof *np);
    if (!np) goto oom;
    opt->params = np;
    struct group *ng = realloc(opt->groups, ((size_t)opt->ngroups + 1) * sizeof *ng);
    if (!ng) goto oom;
    opt->groups = ng;

    struct group *g = &opt->groups[opt->ngroups];
    g->hp = h;
    g->begin = opt->nparams;
    g->count = n;
    for (size_t i = 0; i < n; i++) {
        struct oparam *p = &opt->params[opt->nparams + i];
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
    const struct oparam *p = &opt->params[opt->groups[group].begin + i];
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

int fsdp_optim_get_options(const fsdp_optim_t *opt, int group, void *opts) {
    if (!opt || !opts) return FSDP_EINVAL;
    if (group != -1 && !group_ok(opt, group))
        return bad_group(opt, group, "fsdp_optim_get_options");
    write_opts(opt->kind, group == -1 ? &opt->defaults : &opt->groups[group].hp, opts);
    return FSDP_OK;
}

int fsdp_optim_set_options(fsdp_optim_t *opt, int group, const void *opts) {
    static const char fn[] = "fsdp_optim_set_options";
    if (!opt) return FSDP_EINVAL;
    if (!opts) return fsdp__ctx_err(opt->ctx, FSDP_EINVAL, "%s: opts is NULL", fn);
    if (group != -1 && !group_ok(opt, group)) return bad_group(opt, group, fn);
    struct hparams h;
    int rc = read_opts(opt->ctx, opt->kind, opts, fn, &h);
    if (rc < 0) return rc;
    if (group == -1)
        opt->defaults = h;
    else
        opt->groups[group].hp = h;
    return FSDP_OK;
}

/* ---- stepping -------------------------------------------------------------------------------- */

static bool same_shape(const fsdp_tensor_t *a, const fsdp_tensor_t *b) {
    return a->ndim == b->ndim && memcmp(a->shape, b->shape, sizeof(int64_t) * (size_t)a->ndim) == 0;
}

/* Whether a parameter's step can run: dtypes, storage, gradient, device kernel. */
static int check_step_param(const fsdp_optim_t *opt, const struct oparam *p) {
    static const char fn[] = "fsdp_optim_step";
    const fsdp_tensor_t *t = p->t, *g = t->grad;
    fsdp_ctx_t *ctx = opt->ctx;
    char a[160], b[160];
    const bool empty = fsdp_tensor_numel(t) == 0;
    if (!empty && !fsdp_tensor_data(t))
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "%s: parameter '%s' has no storage (freed by a resize to 0 bytes)", fn,
                             p->name);
    if (g->dt != t->dt || !same_shape(g, t))
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "%s: the gradient of parameter '%s' is %s but the parameter is %s; "
                             "they must have the same dtype and shape",
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
static int new_buffer(struct oparam *p, int slot, bool zero) {
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
static int ensure_state(const fsdp_optim_t *opt, struct oparam *p) {
    const struct hparams *h = &opt->groups[p->group].hp;
    int rc = FSDP_OK;
    if (opt->kind == FSDP_OPTIM_SGD) {
        /* The first step copies the update direction into the buffer (the kernel's `first`). */
        if (h->momentum != 0.0 && !p->buf[SLOT_MOMENTUM]) rc = new_buffer(p, SLOT_MOMENTUM, false);
        return rc;
    }
    if (!p->buf[SLOT_EXP_AVG]) {
        p->step = 0;
        FSDP_TRY(rc, out, new_buffer(p, SLOT_EXP_AVG, true));
    }
    if (!p->buf[SLOT_EXP_AVG_SQ]) FSDP_TRY(rc, out, new_buffer(p, SLOT_EXP_AVG_SQ, true));
    if (h->amsgrad && !p->buf[SLOT_MAX_EXP_AVG_SQ])
        FSDP_TRY(rc, out, new_buffer(p, SLOT_MAX_EXP_AVG_SQ, true));
out:
    return rc;
}

/* Drops the buffers a failed step created but did not use. */
static void drop_fresh(fsdp_optim_t *opt) {
    for (size_t i = 0; i < opt->nparams; i++) {
        struct oparam *p = &opt->params[i];
        for (int s = 0; s < NBUF; s++) {
            if (!p->fresh[s]) continue;
            fsdp_tensor_release(p->buf[s]);
            p->buf[s] = NULL;
            p->fresh[s] = false;
        }
        if (opt->kind != FSDP_OPTIM_SGD && !p->buf[SLOT_EXP_AVG]) p->step = 0;
    }
}

static void *data_or_null(const fsdp_tensor_t *t) {
    return t ? fsdp_tensor_data(t) : NULL;
}

/* Runs the kernel on one parameter, staging contiguous copies of a non-contiguous parameter or
 * gradient. */
static int update_param(const fsdp_optim_t *opt, struct oparam *p) {
    const struct hparams *h = &opt->groups[p->group].hp;
    fsdp_tensor_t *t = p->t, *g = t->grad, *pc = NULL, *gc = NULL;
    fsdp_device_t *dev = t->dev;
    const size_t n = (size_t)fsdp_tensor_numel(t);
    int rc = FSDP_OK;
    if (n > 0 && !fsdp_tensor_is_contiguous(t))
        FSDP_TRY(rc, out, fsdp_tensor_clone(t, FSDP_MEM_OTHER, &pc));
    if (n > 0 && !fsdp_tensor_is_contiguous(g))
        FSDP_TRY(rc, out, fsdp_tensor_clone(g, FSDP_MEM_OTHER, &gc));
    void *pd = fsdp_tensor_data(pc ? pc : t);
    const void *gd = fsdp_tensor_data(gc ? gc : g);
    if (opt->kind == FSDP_OPTIM_SGD) {
        const bool mom = h->momentum != 0.0;
        FSDP_TRY(rc, out,
                 dev->ops->sgd_step(dev, t->dt, n, pd, gd,
                                    mom ? data_or_null(p->buf[SLOT_MOMENTUM]) : NULL, h->lr,
                                    h->momentum, h->dampening, h->weight_decay, h->nesterov,
                                    mom && p->fresh[SLOT_MOMENTUM]));
    } else {
        const int64_t step = p->step + 1;
        FSDP_TRY(rc, out,
                 dev->ops->adam_step(dev, t->dt, n, pd, gd, data_or_null(p->buf[SLOT_EXP_AVG]),
                                     data_or_null(p->buf[SLOT_EXP_AVG_SQ]),
                                     h->amsgrad ? data_or_null(p->buf[SLOT_MAX_EXP_AVG_SQ]) : NULL,
                                     h->lr, h->beta1, h->beta2, h->eps, h->weight_decay,
                                     opt->kind == FSDP_OPTIM_ADAMW, h->amsgrad, step));
        p->step = step;
    }
    /* The kernel has initialised whatever this step created. */
    for (int s = 0; s < NBUF; s++)
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
    return FSDP_OK;
fail:
    drop_fresh(opt);
out:
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
        for (int s = 0; s < NBUF; s++)
            if (opt->params[i].buf[s]) total += fsdp_tensor_storage_bytes(opt->params[i].buf[s]);
    return total;
}

/* ---- state dict: saving ---------------------------------------------------------------------- */

static bool has_state(const fsdp_optim_t *opt, const struct oparam *p) {
    return p->buf[opt->kind == FSDP_OPTIM_SGD ? SLOT_MOMENTUM : SLOT_EXP_AVG] != NULL;
}

/* "<a>.<b>" or "group.<g>.<b>" in new memory. */
static char *key_join(const char *a, int g, const char *b) {
    char gbuf[32];
    if (!a) {
        snprintf(gbuf, sizeof gbuf, "group.%d", g);
        a = gbuf;
    }
    size_t len = strlen(a) + 1 + strlen(b) + 1;
    char *k = malloc(len);
    if (k) snprintf(k, len, "%s.%s", a, b);
    return k;
}

static int scalar_new(fsdp_ctx_t *ctx, double v, fsdp_tensor_t **out) {
    const int64_t unused_shape[1] = {1};
    return fsdp_tensor_from_host(ctx, FSDP_DTYPE_F64, 0, unused_shape, &v, FSDP_MEM_OTHER, out);
}

/* Appends (key, t) to a list sized beforehand; takes ownership of both, also on failure. */
static int list_put(fsdp_named_list_t *l, char *key, fsdp_tensor_t *t) {
    if (!key || !t) {
        free(key);
        fsdp_tensor_release(t);
        return FSDP_ENOMEM;
    }
    l->names[l->n] = key;
    l->tensors[l->n] = t;
    l->n++;
    return FSDP_OK;
}

int fsdp_optim_state_dict(const fsdp_optim_t *opt, fsdp_named_list_t *out) {
    static const char fn[] = "fsdp_optim_state_dict";
    if (!out)
        return opt ? fsdp__ctx_err(opt->ctx, FSDP_EINVAL, "%s: out is NULL", fn) : FSDP_EINVAL;
    memset(out, 0, sizeof *out);
    if (!opt) return FSDP_EINVAL;
    fsdp_ctx_t *ctx = opt->ctx;
    const unsigned mask = kind_mask(opt->kind);
    fsdp_named_list_t l = {0};
    l.owned = true;
    int rc = FSDP_OK;

    size_t count = 0;
    for (size_t d = 0; d < NHP; d++)
        if (hp_table[d].kinds & mask) count += (size_t)opt->ngroups;
    for (size_t i = 0; i < opt->nparams; i++) {
        const struct oparam *p = &opt->params[i];
        if (!has_state(opt, p)) continue;
        count += opt->kind == FSDP_OPTIM_SGD ? 1 : 1 + NBUF - 1;
    }
    l.names = calloc(count ? count : 1, sizeof *l.names);
    l.tensors = calloc(count ? count : 1, sizeof *l.tensors);
    if (!l.names || !l.tensors) goto oom;

    for (int g = 0; g < opt->ngroups; g++) {
        for (size_t d = 0; d < NHP; d++) {
            if (!(hp_table[d].kinds & mask)) continue;
            fsdp_tensor_t *t = NULL;
            FSDP_TRY(rc, fail, scalar_new(ctx, hp_get(&opt->groups[g].hp, &hp_table[d]), &t));
            FSDP_TRY(rc, fail, list_put(&l, key_join(NULL, g, hp_table[d].name), t));
        }
    }
    for (size_t i = 0; i < opt->nparams; i++) {
        const struct oparam *p = &opt->params[i];
        if (!has_state(opt, p)) continue;
        if (opt->kind != FSDP_OPTIM_SGD) {
            fsdp_tensor_t *t = NULL;
            FSDP_TRY(rc, fail, scalar_new(ctx, (double)p->step, &t));
            FSDP_TRY(rc, fail, list_put(&l, key_join(p->name, 0, slot_names[SLOT_STEP]), t));
        }
        for (int s = 0; s < NBUF; s++) {
            if (!p->buf[s]) continue;
            fsdp_tensor_t *t = NULL;
            FSDP_TRY(rc, fail, fsdp_tensor_clone(p->buf[s], FSDP_MEM_OTHER, &t));
            FSDP_TRY(rc, fail, list_put(&l, key_join(p->name, 0, slot_names[s]), t));
        }
    }
    *out = l;
    return FSDP_OK;

oom:
    rc = FSDP_ENOMEM;
fail:
    if (rc == FSDP_ENOMEM) fsdp__ctx_err(ctx, rc, "%s: out of memory", fn);
    fsdp_named_list_free(&l);
    return rc;
}

/* ---- state dict: loading --------------------------------------------------------------------- */

/* A growing text: the lists of an error message. Running out of memory only truncates it. */
struct text {
    char *s;
    size_t len, cap;
    size_t items;
};

static void text_add(struct text *t, const char *fmt, ...) FSDP_PRINTF(2, 3);

static void text_add(struct text *t, const char *fmt, ...) {
    char item[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(item, sizeof item, fmt, ap);
    va_end(ap);
    size_t need = t->len + strlen(item) + 3;
    if (need > t->cap) {
        size_t cap = t->cap ? t->cap : 128;
        while (cap < need)
            cap *= 2;
        char *s = realloc(t->s, cap);
        if (!s) return;
        t->s = s;
        t->cap = cap;
    }
    t->len += (size_t)snprintf(t->s + t->len, t->cap - t->len, "%s%s", t->items ? ", " : "", item);
    t->items++;
}

/* Whether key is "group.<g>.<hp>" for one of opt's groups and a hyper-parameter of its kind. */
static bool parse_group_key(const fsdp_optim_t *opt, const char *key, int *g, size_t *hp) {
    if (strncmp(key, "group.", 6) != 0) return false;
    const char *s = key + 6;
    long v = 0;
    if (*s < '0' || *s > '9' || (s[0] == '0' && s[1] != '.')) return false; /* "01" too */
    while (*s >= '0' && *s <= '9') {
        v = v * 10 + (*s++ - '0');
        if (v >= opt->ngroups) return false;
    }
    if (*s++ != '.') return false;
    for (size_t d = 0; d < NHP; d++) {
        if ((hp_table[d].kinds & kind_mask(opt->kind)) && strcmp(s, hp_table[d].name) == 0) {
            *g = (int)v;
            *hp = d;
            return true;
        }
    }
    return false;
}

/* Whether key is "<param name>.<slot>" for one of opt's parameters and a slot of its kind. */
static bool parse_param_key(const fsdp_optim_t *opt, const char *key, size_t *pi, int *slot) {
    const char *dot = strrchr(key, '.');
    if (!dot || dot == key) return false;
    int s = -1;
    for (int i = 0; i < NSLOT; i++) {
        const bool sgd_slot = i == SLOT_MOMENTUM;
        if (sgd_slot != (opt->kind == FSDP_OPTIM_SGD)) continue;
        if (strcmp(dot + 1, slot_names[i]) == 0) s = i;
    }
    if (s < 0) return false;
    const size_t len = (size_t)(dot - key);
    for (size_t i = 0; i < opt->nparams; i++) {
        const char *name = opt->params[i].name;
        if (strncmp(name, key, len) == 0 && name[len] == '\0') {
            *pi = i;
            *slot = s;
            return true;
        }
    }
    return false;
}

/* What load_state_dict learns from sd before it changes anything. */
struct load_plan {
    struct hparams *hp;   /* ngroups: the groups' new hyper-parameters */
    bool *hp_seen;        /* ngroups * NHP */
    size_t *entry;        /* nparams * NSLOT: index of the entry in sd, SIZE_MAX when absent */
    int64_t *step;        /* nparams */
    fsdp_tensor_t **made; /* nparams * NBUF: the new buffers */
};

static void plan_free(struct load_plan *pl, size_t nparams) {
    if (pl->made)
        for (size_t i = 0; i < nparams * NBUF; i++)
            fsdp_tensor_release(pl->made[i]);
    free(pl->hp);
    free(pl->hp_seen);
    free(pl->entry);
    free(pl->step);
    free(pl->made);
}

/* Reads a one-element tensor; false (with the reason in bad) when it is not one. */
static bool read_scalar(const fsdp_tensor_t *t, const char *key, struct text *bad, double *v) {
    char a[160];
    if (fsdp_tensor_numel(t) != 1) {
        text_add(bad, "'%s' is %s (one element expected)", key,
                 fsdp_tensor_describe(t, a, sizeof a));
        return false;
    }
    if (fsdp_tensor_item(t, 0, v) < 0) {
        text_add(bad, "'%s' cannot be read", key);
        return false;
    }
    return true;
}

/* Checks one entry of sd against the optimizer and records it in the plan. */
static void plan_entry(const fsdp_optim_t *opt, const fsdp_named_list_t *sd, size_t e,
                       struct load_plan *pl, struct text *unexpected, struct text *bad) {
    const char *key = sd->names[e];
    const fsdp_tensor_t *t = sd->tensors[e];
    char a[160], b[160];
    int g = 0, slot = 0;
    size_t hp = 0, pi = 0;
    double v = 0.0;
    if (!key) {
        text_add(bad, "entry %zu has no name", e);
        return;
    }
    if (parse_group_key(opt, key, &g, &hp)) {
        if (pl->hp_seen[(size_t)g * NHP + hp]) {
            text_add(bad, "'%s' appears twice", key);
            return;
        }
        pl->hp_seen[(size_t)g * NHP + hp] = true;
        if (!t) {
            text_add(bad, "'%s' has no tensor", key);
            return;
        }
        if (!read_scalar(t, key, bad, &v)) return;
        if (hp_table[hp].flag && v != 0.0 && v != 1.0) {
            text_add(bad, "'%s' is %g (0 or 1 expected)", key, v);
            return;
        }
        hp_set(&pl->hp[g], &hp_table[hp], v);
        return;
    }
    if (!parse_param_key(opt, key, &pi, &slot)) {
        text_add(unexpected, "'%s'", key);
        return;
    }
    if (pl->entry[pi * NSLOT + (size_t)slot] != SIZE_MAX) {
        text_add(bad, "'%s' appears twice", key);
        return;
    }
    pl->entry[pi * NSLOT + (size_t)slot] = e;
    if (!t) {
        text_add(bad, "'%s' has no tensor", key);
        return;
    }
    if (slot == SLOT_STEP) {
        if (!read_scalar(t, key, bad, &v)) return;
        if (!(v >= 0.0 && v <= 9007199254740992.0) || v != floor(v)) {
            text_add(bad, "'%s' is %g (a step count is a non-negative integer)", key, v);
            return;
        }
        pl->step[pi] = (int64_t)v;
        return;
    }
    const fsdp_tensor_t *p = opt->params[pi].t;
    if (!fsdp_dtype_is_float(t->dt) || !same_shape(t, p)) {
        text_add(bad, "'%s' is %s but the parameter is %s", key,
                 fsdp_tensor_describe(t, a, sizeof a), fsdp_tensor_describe(p, b, sizeof b));
        return;
    }
    if (t->ctx != p->ctx || t->dev != p->dev) {
        text_add(bad, "'%s' is on device %s (context %p), the parameter on %s (context %p)", key,
                 t->dev->name, (void *)t->ctx, p->dev->name, (void *)p->ctx);
        return;
    }
    if (fsdp_tensor_numel(t) > 0 && !fsdp_tensor_data(t)) {
        text_add(bad, "'%s' has no storage", key);
        return;
    }
}

/* After every entry was seen: what is missing, and whether the loaded values hang together. */
static void plan_check(const fsdp_optim_t *opt, const struct load_plan *pl, struct text *missing,
                       struct text *bad) {
    const unsigned mask = kind_mask(opt->kind);
    for (int g = 0; g < opt->ngroups; g++) {
        bool all = true;
        for (size_t d = 0; d < NHP; d++) {
            if (!(hp_table[d].kinds & mask) || pl->hp_seen[(size_t)g * NHP + d]) continue;
            text_add(missing, "'group.%d.%s'", g, hp_table[d].name);
            all = false;
        }
        char why[256];
        if (all && !hp_valid(opt->kind, &pl->hp[g], why, sizeof why))
            text_add(bad, "group %d: %s", g, why);
    }
    for (size_t i = 0; i < opt->nparams; i++) {
        const struct oparam *p = &opt->params[i];
        const size_t *en = &pl->entry[i * NSLOT];
        bool any = false;
        for (int s = 0; s < NSLOT; s++)
            any = any || en[s] != SIZE_MAX;
        if (!any || opt->kind == FSDP_OPTIM_SGD) continue;
        /* max_exp_avg_sq is kept without amsgrad (PyTorch keeps it when amsgrad is turned
         * off), so it is only required with amsgrad. */
        const bool amsgrad = pl->hp[p->group].amsgrad;
        for (int s = SLOT_EXP_AVG; s < NSLOT; s++) {
            const bool need = s != SLOT_MAX_EXP_AVG_SQ || amsgrad;
            if (need && en[s] == SIZE_MAX) text_add(missing, "'%s.%s'", p->name, slot_names[s]);
        }
    }
}

/* Copies every buffer the plan loads into new FSDP_MEM_OPTIM tensors. */
static int plan_make(const fsdp_optim_t *opt, const fsdp_named_list_t *sd, struct load_plan *pl) {
    for (size_t i = 0; i < opt->nparams; i++) {
        const fsdp_tensor_t *p = opt->params[i].t;
        for (int s = 0; s < NBUF; s++) {
            const size_t e = pl->entry[i * NSLOT + (size_t)s];
            if (e == SIZE_MAX) continue;
            fsdp_tensor_t **dst = &pl->made[i * NBUF + (size_t)s];
            int rc =
                fsdp__tensor_new(p->ctx, p->dev, p->dt, p->ndim, p->shape, FSDP_MEM_OPTIM, dst);
            if (rc == FSDP_OK) rc = fsdp_tensor_copy_(*dst, sd->tensors[e]);
            if (rc < 0) return rc;
        }
    }
    return FSDP_OK;
}

int fsdp_optim_load_state_dict(fsdp_optim_t *opt, const fsdp_named_list_t *sd) {
    static const char fn[] = "fsdp_optim_load_state_dict";
    if (!opt) return FSDP_EINVAL;
    fsdp_ctx_t *ctx = opt->ctx;
    if (!sd || (sd->n > 0 && (!sd->names || !sd->tensors)))
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: the state dict is NULL or has no arrays", fn);
    const size_t ng = (size_t)opt->ngroups, np = opt->nparams;
    struct load_plan pl = {0};
    struct text missing = {0}, unexpected = {0}, bad = {0};
    int rc = FSDP_OK;

    pl.hp = calloc(ng ? ng : 1, sizeof *pl.hp);
    pl.hp_seen = calloc(ng * NHP + 1, sizeof *pl.hp_seen);
    pl.entry = malloc((np * NSLOT + 1) * sizeof *pl.entry);
    pl.step = calloc(np + 1, sizeof *pl.step);
    pl.made = calloc(np * NBUF + 1, sizeof *pl.made);
    if (!pl.hp || !pl.hp_seen || !pl.entry || !pl.step || !pl.made) {
        rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
        goto out;
    }
    for (size_t g = 0; g < ng; g++)
        pl.hp[g] = opt->groups[g].hp;
    for (size_t i = 0; i < np * NSLOT; i++)
        pl.entry[i] = SIZE_MAX;

    for (size_t e = 0; e < sd->n; e++)
        plan_entry(opt, sd, e, &pl, &unexpected, &bad);
    plan_check(opt, &pl, &missing, &bad);
    if (missing.items || unexpected.items || bad.items) {
        /* One message listing every problem; empty categories are left out. */
        const struct text *parts[3] = {&missing, &unexpected, &bad};
        static const char *const titles[3] = {"missing keys", "unexpected keys", "invalid entries"};
        char msg[FSDP_ERR_LEN];
        size_t at = (size_t)snprintf(msg, sizeof msg, "%s:", fn);
        for (int k = 0; k < 3 && at < sizeof msg; k++) {
            if (!parts[k]->items) continue;
            at += (size_t)snprintf(msg + at, sizeof msg - at, "%s %s (%zu): %s",
                                   at > strlen(fn) + 1 ? ";" : "", titles[k], parts[k]->items,
                                   parts[k]->s ? parts[k]->s : "(out of memory)");
        }
        rc = fsdp__ctx_err(ctx, FSDP_EINVAL, "%s", msg);
        goto out;
    }
    rc = plan_make(opt, sd, &pl);
    if (rc < 0) {
        fsdp__ctx_err(ctx, rc, "%s: copying the state failed: %s", fn, fsdp_ctx_last_error(ctx));
        goto out;
    }

    /* Nothing can fail from here on: swap the new state in. */
    for (size_t g = 0; g < ng; g++)
        opt->groups[g].hp = pl.hp[g];
    for (size_t i = 0; i < np; i++) {
        struct oparam *p = &opt->params[i];
        drop_buffers(p);
        for (int s = 0; s < NBUF; s++) {
            p->buf[s] = pl.made[i * NBUF + (size_t)s];
            pl.made[i * NBUF + (size_t)s] = NULL;
        }
        p->step = has_state(opt, p) ? pl.step[i] : 0;
    }
out:
    plan_free(&pl, np);
    free(missing.s);
    free(unexpected.s);
    free(bad.s);
    return rc;
}
