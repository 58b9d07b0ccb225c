/* SPDX-License-Identifier: MIT */
/*
 * grad_scaler.c: the sharded gradient scaler (include/fsdp/grad_scaler.h), PyTorch's
 * ShardedGradScaler over torch.amp.GradScaler.
 *
 * The scale is kept as a float because PyTorch keeps it in an f32 tensor: every value it takes
 * is rounded to f32, and the updates follow torch._amp_update_scale_ (the product with the
 * factor in double, rounded to f32; a growth to inf is not applied). The growth tracker counts
 * clean iterations, as PyTorch's int32 tracker.
 *
 * Per-iteration state is PyTorch's per-optimizer OptState: each optimizer seen since the last
 * update has an entry (READY is "no entry") that is UNSCALED after unscale() and STEPPED after
 * step(), with the found-inf flag agreed by every rank of the group. update() consumes the flags
 * of every entry and clears the list.
 *
 * Gradient math runs on each gradient's own device through its kernels (as clip.c does): the
 * inf/NaN check multiplies the gradient by 0 in its compute dtype (0 * x is 0 for a finite x
 * and NaN for an inf or a NaN) and sums the products, chunk by chunk so that the temporary
 * stays small, and the sum is NaN exactly when some element was not finite; the unscale is the
 * clip's in-place multiply (fsdp__grad_scale). The found-inf flag crosses the group as one f32
 * in host memory, which every backend accepts (NCCL stages it).
 *
 * Invariants: scale is finite and > 0; 0 <= growth_tracker < growth_interval; opts[0..nopts)
 * name distinct optimizers.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "optim/optim_impl.h"
#include "tensor/tensor_impl.h"
#include <fsdp/autograd.h>
#include <fsdp/grad_scaler.h>

/* Elements the inf/NaN check multiplies into its temporary at a time. */
#define CHECK_CHUNK ((int64_t)1 << 20)

enum stage { STAGE_READY = 0, STAGE_UNSCALED, STAGE_STEPPED };

struct opt_state {
    const fsdp_optim_t *opt; /* borrowed, only compared */
    enum stage stage;
    bool found_inf; /* the all-reduced flag of its unscale */
};

struct fsdp_grad_scaler {
    fsdp_ctx_t *ctx;
    fsdp_pg_t *pg; /* NULL: no all-reduce (a world of one rank without a group) */
    bool enabled;
    float scale;
    double growth_factor, backoff_factor;
    int64_t growth_interval, growth_tracker;
    bool scale_used; /* scale() was called once: PyTorch's lazily created _scale exists */
    struct opt_state *opts;
    size_t nopts, cap;
};

/* Sets the context's error as "<fn>: rank <r>: <text>" and returns rc. */
static int serr(const fsdp_grad_scaler_t *s, int rc, const char *fn, const char *fmt, ...)
    FSDP_PRINTF(4, 5);
static int serr(const fsdp_grad_scaler_t *s, int rc, const char *fn, const char *fmt, ...) {
    char buf[FSDP_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return fsdp__ctx_err(s->ctx, rc, "%s: rank %d: %s", fn, fsdp_ctx_rank(s->ctx), buf);
}

/* Checks a scale, growth factor, backoff factor and interval as PyTorch's constructor asserts
 * them (plus a usable scale); writes the first problem into why. */
static bool params_valid(const char *scale_key, double scale, double growth, double backoff,
                         int64_t interval, char *why, size_t len) {
    const float fs = (float)scale;
    if (!(scale > 0.0) || !isfinite(fs) || !(fs > 0.0f)) {
        snprintf(why, len, "%s %g must be > 0 and finite as an f32 value", scale_key, scale);
        return false;
    }
    if (!(growth > 1.0) || !isfinite(growth)) {
        snprintf(why, len, "growth_factor %g must be > 1.0 (and finite)", growth);
        return false;
    }
    if (!(backoff > 0.0 && backoff < 1.0)) {
        snprintf(why, len, "backoff_factor %g must be in (0, 1)", backoff);
        return false;
    }
    if (interval <= 0) {
        snprintf(why, len, "growth_interval %lld must be > 0", (long long)interval);
        return false;
    }
    return true;
}

static const fsdp__abi_struct_t scaler_options_abi =
    FSDP__ABI_STRUCT(fsdp_grad_scaler_options_t, "fsdp_grad_scaler_options_init", pg);

void(fsdp_grad_scaler_options_init)(fsdp_grad_scaler_options_t *o, size_t size) {
    fsdp_grad_scaler_options_t d;
    memset(&d, 0, sizeof d);
    d.init_scale = 65536.0;
    d.growth_factor = 2.0;
    d.backoff_factor = 0.5;
    d.growth_interval = 2000;
    d.enabled = true;
    d.pg = NULL;
    fsdp__abi_init(o, size, &d, &scaler_options_abi);
}

int fsdp_grad_scaler_create(fsdp_ctx_t *ctx, const fsdp_grad_scaler_options_t *o,
                            fsdp_grad_scaler_t **out) {
    static const char fn[] = "fsdp_grad_scaler_create";
    fsdp_grad_scaler_options_t def;
    fsdp_grad_scaler_t *s = NULL;
    char why[200];
    int rc = FSDP_OK;
    if (out) *out = NULL;
    if (!ctx || !out) {
        rc = fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: %s is NULL", fn, ctx ? "out" : "ctx");
        goto out;
    }
    if ((rc = fsdp__abi_check(ctx, fn, "o", o, &scaler_options_abi)) < 0) goto out;
    if (!o) {
        fsdp_grad_scaler_options_init(&def);
        o = &def;
    }
    if (o->enabled && !params_valid("init_scale", o->init_scale, o->growth_factor,
                                    o->backoff_factor, o->growth_interval, why, sizeof why)) {
        rc = fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: rank %d: options: %s", fn, fsdp_ctx_rank(ctx),
                           why);
        goto out;
    }
    fsdp_pg_t *pg = o->pg ? o->pg : fsdp_ctx_pg(ctx);
    if (o->enabled && !pg && fsdp_ctx_world_size(ctx) > 1) {
        rc = fsdp__ctx_err(ctx, FSDP_EINVAL,
                           "%s: rank %d: no process group: options.pg is NULL, the context has no "
                           "world group and the world size is %d",
                           fn, fsdp_ctx_rank(ctx), fsdp_ctx_world_size(ctx));
        goto out;
    }
    s = calloc(1, sizeof *s);
    if (!s) {
        rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "%s: rank %d: out of memory", fn, fsdp_ctx_rank(ctx));
        goto out;
    }
    s->ctx = ctx;
    s->pg = pg;
    s->enabled = o->enabled;
    s->scale = (float)o->init_scale;
    s->growth_factor = o->growth_factor;
    s->backoff_factor = o->backoff_factor;
    s->growth_interval = o->growth_interval;
    *out = s;
out:
    return rc;
}

void fsdp_grad_scaler_destroy(fsdp_grad_scaler_t *s) {
    if (!s) return;
    free(s->opts);
    free(s);
}

int fsdp_grad_scaler_scale(fsdp_grad_scaler_t *s, fsdp_tensor_t *loss, fsdp_tensor_t **out) {
    static const char fn[] = "fsdp_grad_scaler_scale";
    int rc = FSDP_OK;
    if (out) *out = NULL;
    if (!s) return FSDP_EINVAL;
    if (!loss || !out) {
        rc = serr(s, FSDP_EINVAL, fn, "%s is NULL", loss ? "out" : "loss");
    } else if (!s->enabled) {
        *out = fsdp_tensor_retain(loss);
    } else if (!fsdp_dtype_is_float(fsdp_tensor_dtype(loss))) {
        rc = serr(s, FSDP_EINVAL, fn, "the loss is %s; it must be a float tensor",
                  fsdp_dtype_name(fsdp_tensor_dtype(loss)));
    } else {
        rc = fsdp_scale(loss, (double)s->scale, out);
        if (rc < 0)
            serr(s, rc, fn, "scaling the loss by %g failed: %s", (double)s->scale,
                 fsdp_ctx_last_error(s->ctx));
        else
            s->scale_used = true;
    }
    return rc;
}

/* PyTorch's _check_scale_growth_tracker. */
static int check_scale_used(const fsdp_grad_scaler_t *s, const char *fn, const char *what) {
    if (s->scale_used) return FSDP_OK;
    return serr(s, FSDP_EINVAL, fn,
                "Attempted %s but _scale is None. This may indicate your script did not use "
                "fsdp_grad_scaler_scale(loss) earlier in the iteration",
                what);
}

static struct opt_state *find_opt(fsdp_grad_scaler_t *s, const fsdp_optim_t *opt) {
    for (size_t i = 0; i < s->nopts; i++)
        if (s->opts[i].opt == opt) return &s->opts[i];
    return NULL;
}

/* The entry of opt, added (READY, not found) when missing; NULL when out of memory. */
static struct opt_state *add_opt(fsdp_grad_scaler_t *s, const fsdp_optim_t *opt) {
    struct opt_state *e = find_opt(s, opt);
    if (e) return e;
    if (s->nopts == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 4;
        struct opt_state *n = realloc(s->opts, cap * sizeof *n);
        if (!n) return NULL;
        s->opts = n;
        s->cap = cap;
    }
    e = &s->opts[s->nopts++];
    e->opt = opt;
    e->stage = STAGE_READY;
    e->found_inf = false;
    return e;
}

/* *found |= whether g (contiguous or not, any float dtype) holds an inf or a NaN. */
static int check_nonfinite(fsdp_tensor_t *g, bool *found) {
    const int64_t n = fsdp_tensor_numel(g);
    if (n == 0) return FSDP_OK; /* nothing to check (a rank's empty shard) */
    const fsdp_dtype_t cdt = (fsdp_dtype_t)fsdp__compute_dtype(g->dt);
    const size_t esz = fsdp_dtype_size(cdt);
    const int64_t chunk = n < CHECK_CHUNK ? n : CHECK_CHUNK, nchunks = (n + chunk - 1) / chunk;
    const int64_t one = 1;
    fsdp_tensor_t *x = NULL, *tmp = NULL, *sums = NULL, *total = NULL;
    fsdp_device_t *dev = g->dev;
    double v = 0.0;
    int rc;
    FSDP_TRY(rc, out, fsdp__as_contig(g, cdt, &x));
    FSDP_TRY(rc, out, fsdp__tensor_new(g->ctx, dev, cdt, 1, &chunk, FSDP_MEM_OTHER, &tmp));
    FSDP_TRY(rc, out, fsdp__tensor_new(g->ctx, dev, cdt, 1, &nchunks, FSDP_MEM_OTHER, &sums));
    const char *xd = fsdp_tensor_data(x);
    char *sd = fsdp_tensor_data(sums);
    for (int64_t k = 0; k < nchunks; k++) {
        const int64_t off = k * chunk, len = n - off < chunk ? n - off : chunk;
        FSDP_TRY(rc, out,
                 dev->ops->unary(dev, cdt, FSDP_UNARY_SCALE, (size_t)len, 0.0,
                                 xd + (size_t)off * esz, fsdp_tensor_data(tmp)));
        FSDP_TRY(rc, out,
                 dev->ops->reduce_sum(dev, cdt, 1, (size_t)len, 1, 1.0, fsdp_tensor_data(tmp),
                                      sd + (size_t)k * esz));
    }
    if (nchunks > 1) {
        FSDP_TRY(rc, out, fsdp__tensor_new(g->ctx, dev, cdt, 1, &one, FSDP_MEM_OTHER, &total));
        FSDP_TRY(rc, out,
                 dev->ops->reduce_sum(dev, cdt, 1, (size_t)nchunks, 1, 1.0, sd,
                                      fsdp_tensor_data(total)));
    }
    FSDP_TRY(rc, out, fsdp_tensor_item(total ? total : sums, 0, &v));
    if (v != 0.0) *found = true; /* NaN (or, impossibly, a non-zero sum of zeros) */
out:
    fsdp_tensor_release(x);
    fsdp_tensor_release(tmp);
    fsdp_tensor_release(sums);
    fsdp_tensor_release(total);
    return rc;
}

/* Calls f on the gradient of every parameter of opt that has one, groups in order, through
 * the optimizer's public accessors; stops at the first error. */
typedef int (*grad_fn)(fsdp_grad_scaler_t *s, const char *name, fsdp_tensor_t *g, void *arg);

static int for_each_grad(fsdp_grad_scaler_t *s, fsdp_optim_t *opt, grad_fn f, void *arg) {
    int rc = FSDP_OK;
    for (int gi = 0; gi < fsdp_optim_num_groups(opt) && rc == FSDP_OK; gi++) {
        for (size_t i = 0; i < fsdp_optim_group_size(opt, gi) && rc == FSDP_OK; i++) {
            const char *name = NULL;
            fsdp_tensor_t *p = fsdp_optim_group_param(opt, gi, i, &name);
            fsdp_tensor_t *g = p ? fsdp_tensor_grad(p) : NULL;
            if (g) rc = f(s, name ? name : fsdp_tensor_name(p), g, arg);
        }
    }
    return rc;
}

static int grad_checkable(fsdp_grad_scaler_t *s, const char *name, fsdp_tensor_t *g, void *arg) {
    (void)arg;
    char d[160];
    if (fsdp__compute_dtype(g->dt) < 0)
        return serr(s, FSDP_EINVAL, "fsdp_grad_scaler_unscale",
                    "the gradient of parameter '%s' is %s; only float gradients can be unscaled",
                    name, fsdp_tensor_describe(g, d, sizeof d));
    if (fsdp_tensor_numel(g) > 0 && !fsdp_tensor_data(g))
        return serr(s, FSDP_EINVAL, "fsdp_grad_scaler_unscale",
                    "the gradient of parameter '%s' has no storage", name);
    return FSDP_OK;
}

struct unscale_arg {
    double inv;
    bool found;
};

static int grad_unscale(fsdp_grad_scaler_t *s, const char *name, fsdp_tensor_t *g, void *arg) {
    struct unscale_arg *a = arg;
    int rc = check_nonfinite(g, &a->found);
    if (rc == 0) rc = fsdp__grad_scale(g, a->inv);
    if (rc < 0)
        serr(s, rc, "fsdp_grad_scaler_unscale",
             "unscaling the gradient of parameter '%s' failed: %s", name,
             fsdp_ctx_last_error(s->ctx));
    return rc;
}

/* Unscales opt's gradients into entry e and agrees on the flag over the group. A rank whose
 * gradients could not be unscaled still joins the all-reduce, with the flag set, so that its
 * peers do not wait for it until the group's timeout and skip the step; it returns its error
 * and its entry stays READY. */
static int unscale_into(fsdp_grad_scaler_t *s, fsdp_optim_t *opt, struct opt_state *e) {
    static const char fn[] = "fsdp_grad_scaler_unscale";
    /* FP32 division can be imprecise; PyTorch takes the reciprocal in f64 and rounds it. */
    struct unscale_arg a = {.inv = (double)(float)(1.0 / (double)s->scale), .found = false};
    bool was = fsdp_set_grad_enabled(s->ctx, false);
    int rc = for_each_grad(s, opt, grad_checkable, NULL);
    if (rc == 0) rc = for_each_grad(s, opt, grad_unscale, &a);
    fsdp_set_grad_enabled(s->ctx, was);
    float flag = a.found || rc < 0 ? 1.0f : 0.0f;
    if (s->pg) {
        int arc = fsdp_pg_all_reduce(s->pg, &flag, &flag, 1, FSDP_DTYPE_F32, FSDP_REDOP_MAX, NULL);
        if (arc < 0 && rc == 0)
            rc = serr(s, arc, fn,
                      "all-reduce of the found-inf flag over group '%s' (size %d) failed: %s",
                      fsdp_pg_name(s->pg), fsdp_pg_size(s->pg), fsdp_pg_last_error(s->pg));
    }
    if (rc == 0) {
        e->found_inf = flag != 0.0f;
        e->stage = STAGE_UNSCALED;
    }
    return rc;
}

/* The common checks of unscale and step, and opt's entry. */
static int begin(fsdp_grad_scaler_t *s, fsdp_optim_t *opt, const char *fn, const char *what,
                 struct opt_state **e) {
    int rc = FSDP_OK;
    *e = NULL;
    if (!opt) {
        rc = serr(s, FSDP_EINVAL, fn, "opt is NULL");
    } else if (fsdp_optim_ctx(opt) != s->ctx) {
        rc = serr(s, FSDP_EINVAL, fn, "the optimizer belongs to another context (rank %d)",
                  fsdp_ctx_rank(fsdp_optim_ctx(opt)));
    } else if ((rc = check_scale_used(s, fn, what)) == FSDP_OK) {
        *e = add_opt(s, opt);
        if (!*e) rc = serr(s, FSDP_ENOMEM, fn, "out of memory");
    }
    return rc;
}

int fsdp_grad_scaler_unscale(fsdp_grad_scaler_t *s, fsdp_optim_t *opt) {
    static const char fn[] = "fsdp_grad_scaler_unscale";
    struct opt_state *e = NULL;
    int rc = FSDP_OK;
    if (!s) return FSDP_EINVAL;
    if (!s->enabled) {
        if (!opt) rc = serr(s, FSDP_EINVAL, fn, "opt is NULL");
        goto out;
    }
    FSDP_TRY(rc, out, begin(s, opt, fn, "unscale_", &e));
    if (e->stage == STAGE_UNSCALED) {
        rc = serr(s, FSDP_EINVAL, fn,
                  "unscale() has already been called on this optimizer since the last update()");
        goto out;
    }
    if (e->stage == STAGE_STEPPED) {
        rc = serr(s, FSDP_EINVAL, fn, "unscale() is being called after step()");
        goto out;
    }
    rc = unscale_into(s, opt, e);
out:
    return rc;
}

int fsdp_grad_scaler_step(fsdp_grad_scaler_t *s, fsdp_optim_t *opt, bool *stepped) {
    static const char fn[] = "fsdp_grad_scaler_step";
    struct opt_state *e = NULL;
    int rc = FSDP_OK;
    if (stepped) *stepped = false;
    if (!s) return FSDP_EINVAL;
    if (!s->enabled) {
        if (!opt) {
            rc = serr(s, FSDP_EINVAL, fn, "opt is NULL");
            goto out;
        }
        rc = fsdp_optim_step(opt);
        if (rc == 0 && stepped) *stepped = true;
        goto out;
    }
    FSDP_TRY(rc, out, begin(s, opt, fn, "step", &e));
    if (e->stage == STAGE_STEPPED) {
        rc = serr(s, FSDP_EINVAL, fn, "step() has already been called since the last update()");
        goto out;
    }
    if (e->stage != STAGE_UNSCALED) FSDP_TRY(rc, out, unscale_into(s, opt, e));
    if (!e->found_inf) {
        FSDP_TRY(rc, out, fsdp_optim_step(opt));
        if (stepped) *stepped = true;
    }
    e->stage = STAGE_STEPPED;
out:
    return rc;
}

/* torch._amp_update_scale_ with the found-inf flag of this iteration. */
static void update_scale(fsdp_grad_scaler_t *s, bool found_inf) {
    const int64_t successful = s->growth_tracker + 1;
    if (found_inf) {
        s->scale = (float)((double)s->scale * s->backoff_factor);
        s->growth_tracker = 0;
    } else if (successful == s->growth_interval) {
        const float grown = (float)((double)s->scale * s->growth_factor);
        if (isfinite(grown)) s->scale = grown; /* never grow the scale past f32's range */
        s->growth_tracker = 0;
    } else {
        s->growth_tracker = successful;
    }
}

int fsdp_grad_scaler_update(fsdp_grad_scaler_t *s) {
    static const char fn[] = "fsdp_grad_scaler_update";
    int rc = FSDP_OK;
    bool found = false, any = false;
    if (!s) return FSDP_EINVAL;
    if (!s->enabled) goto out;
    FSDP_TRY(rc, out, check_scale_used(s, fn, "update"));
    for (size_t i = 0; i < s->nopts; i++) {
        if (s->opts[i].stage == STAGE_READY) continue;
        any = true;
        found = found || s->opts[i].found_inf;
    }
    if (!any) {
        rc = serr(s, FSDP_EINVAL, fn,
                  "No inf checks were recorded prior to update(): call fsdp_grad_scaler_step "
                  "(or unscale) for the iteration's optimizers first");
        goto out;
    }
    update_scale(s, found);
    s->nopts = 0;
out:
    return rc;
}

int fsdp_grad_scaler_update_to(fsdp_grad_scaler_t *s, double new_scale) {
    static const char fn[] = "fsdp_grad_scaler_update_to";
    int rc = FSDP_OK;
    if (!s) return FSDP_EINVAL;
    if (!s->enabled) goto out;
    FSDP_TRY(rc, out, check_scale_used(s, fn, "update"));
    const float fs = (float)new_scale;
    if (!(new_scale > 0.0) || !isfinite(fs) || !(fs > 0.0f)) {
        rc = serr(s, FSDP_EINVAL, fn, "new_scale %g must be > 0 and finite as an f32 value",
                  new_scale);
        goto out;
    }
    s->scale = fs;
    s->nopts = 0;
out:
    return rc;
}

double fsdp_grad_scaler_get_scale(const fsdp_grad_scaler_t *s) {
    return s && s->enabled ? (double)s->scale : 1.0;
}

bool fsdp_grad_scaler_found_inf(const fsdp_grad_scaler_t *s) {
    if (!s || !s->enabled) return false;
    for (size_t i = 0; i < s->nopts; i++)
        if (s->opts[i].stage != STAGE_READY && s->opts[i].found_inf) return true;
    return false;
}

int fsdp_grad_scaler_state_dict(const fsdp_grad_scaler_t *s, fsdp_grad_scaler_state_t *st) {
    int rc = FSDP_OK;
    if (!s) return FSDP_EINVAL;
    if (!st) {
        rc = serr(s, FSDP_EINVAL, "fsdp_grad_scaler_state_dict", "st is NULL");
        goto out;
    }
    memset(st, 0, sizeof *st);
    if (!s->enabled) goto out;
    st->scale = (double)s->scale;
    st->growth_factor = s->growth_factor;
    st->backoff_factor = s->backoff_factor;
    st->growth_interval = s->growth_interval;
    st->growth_tracker = s->growth_tracker;
out:
    return rc;
}

int fsdp_grad_scaler_load_state_dict(fsdp_grad_scaler_t *s, const fsdp_grad_scaler_state_t *st) {
    static const char fn[] = "fsdp_grad_scaler_load_state_dict";
    char why[200];
    int rc = FSDP_OK;
    if (!s) return FSDP_EINVAL;
    if (!st) {
        rc = serr(s, FSDP_EINVAL, fn, "st is NULL");
        goto out;
    }
    if (!s->enabled) goto out;
    if (st->scale == 0.0 && st->growth_factor == 0.0 && st->backoff_factor == 0.0 &&
        st->growth_interval == 0 && st->growth_tracker == 0) {
        rc = serr(s, FSDP_EINVAL, fn,
                  "The source state dict is empty, possibly because it was saved from a disabled "
                  "instance of GradScaler");
        goto out;
    }
    if (!params_valid("scale", st->scale, st->growth_factor, st->backoff_factor,
                      st->growth_interval, why, sizeof why)) {
        rc = serr(s, FSDP_EINVAL, fn, "state: %s", why);
        goto out;
    }
    if (st->growth_tracker < 0 || st->growth_tracker >= st->growth_interval) {
        rc = serr(s, FSDP_EINVAL, fn,
                  "state: growth_tracker %lld must be in [0, growth_interval %lld)",
                  (long long)st->growth_tracker, (long long)st->growth_interval);
        goto out;
    }
    s->scale = (float)st->scale;
    s->growth_factor = st->growth_factor;
    s->backoff_factor = st->backoff_factor;
    s->growth_interval = st->growth_interval;
    s->growth_tracker = st->growth_tracker;
out:
    return rc;
}
