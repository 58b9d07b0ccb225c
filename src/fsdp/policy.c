/* SPDX-License-Identifier: MIT */
/*
 * policy.c: auto-wrap policies and per-unit overrides (include/fsdp/policy.h): what decides,
 * module by module, whether a subtree becomes an FSDP unit. Planning a wrap with them and the
 * wrap-time validation are in plan.c.
 *
 * Everything here is a pure function of a module tree: nothing communicates, no unit is made,
 * no module is changed.
 *
 * Invariants:
 *   - A policy never changes after its constructor returns; only its reference count moves
 *     (atomically), so one policy may serve every rank thread.
 *   - Every kind answers through policy_ops.decide, so an or-policy treats its members alike.
 */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/policy.h>

#include "fsdp/fsdp_impl.h"
#include "nn/nn_impl.h"

/* ---- small helpers --------------------------------------------------------------------------- */

static size_t list_len(const char *const *l) {
    size_t n = 0;
    while (l && l[n]) n++;
    return n;
}

static void strlist_free(char **l) {
    for (size_t i = 0; l && l[i]; i++) free(l[i]);
    free(l);
}

/* A NULL-terminated deep copy of a followed by b (either may be NULL). */
static char **strlist_concat(const char *const *a, const char *const *b) {
    size_t na = list_len(a), nb = list_len(b);
    char **l = calloc(na + nb + 1, sizeof *l);
    if (!l) return NULL;
    for (size_t i = 0; i < na + nb; i++) {
        l[i] = strdup(i < na ? a[i] : b[i - na]);
        if (!l[i]) {
            strlist_free(l);
            return NULL;
        }
    }
    return l;
}

bool fsdp_policy_type_matches(const char *type, const char *pattern) {
    static const char *const batchnorm[] = {"BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
                                            "SyncBatchNorm", NULL};
    if (!type || !pattern) return false;
    if (strcmp(type, pattern) == 0) return true;
    if (strcmp(pattern, FSDP_TYPE_BATCHNORM) == 0)
        for (const char *const *t = batchnorm; *t; t++)
            if (strcmp(type, *t) == 0) return true;
    return false;
}

bool fsdp__type_in(const fsdp_module_t *m, const char *const *patterns) {
    for (size_t i = 0; patterns && patterns[i]; i++)
        if (fsdp_policy_type_matches(fsdp_module_type(m), patterns[i])) return true;
    return false;
}

/* ---- overrides ------------------------------------------------------------------------------- */

const fsdp__abi_struct_t fsdp__unit_overrides_abi =
    FSDP__ABI_STRUCT(fsdp_unit_overrides_t, "fsdp_unit_overrides_init", sync_module_states);

void(fsdp_unit_overrides_init)(fsdp_unit_overrides_t *ov, size_t size) {
    fsdp_unit_overrides_t d;
    memset(&d, 0, sizeof d);
    d.strategy = FSDP_FULL_SHARD;
    d.backward_prefetch = FSDP_BACKWARD_PRE;
    fsdp_mixed_precision_init(&d.mixed_precision);
    fsdp__abi_init(ov, size, &d, &fsdp__unit_overrides_abi);
}

int fsdp__check_overrides(fsdp_ctx_t *ctx, const char *fn, const char *arg,
                          const fsdp_unit_overrides_t *ov) {
    int rc = fsdp__abi_check(ctx, fn, arg, ov, &fsdp__unit_overrides_abi);
    if (rc < 0 || !ov || !ov->has_mixed_precision) return rc;
    char what[64];
    snprintf(what, sizeof what, "%s->mixed_precision", arg);
    return fsdp__abi_check_embedded(ctx, fn, what, &ov->mixed_precision, &fsdp__mixed_precision_abi,
                                    "fsdp_unit_overrides_init");
}

bool fsdp_unit_overrides_any(const fsdp_unit_overrides_t *ov) {
    if (!ov ||
        fsdp__abi_check(NULL, "fsdp_unit_overrides_any", "ov", ov, &fsdp__unit_overrides_abi) < 0)
        return false;
    return ov->has_pg || ov->has_replicate_pg || ov->has_strategy || ov->has_cpu_offload ||
           ov->has_device || ov->has_backward_prefetch || ov->has_forward_prefetch ||
           ov->has_limit_all_gathers || ov->has_mixed_precision || ov->has_sync_module_states;
}

int(fsdp_unit_overrides_apply)(const fsdp_options_t *root, const fsdp_unit_overrides_t *ov,
                               fsdp_options_t *out, size_t out_size) {
    static const char fn[] = "fsdp_unit_overrides_apply";
    if (!root || !out) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "%s: %s is NULL", fn, !root ? "root" : "out");
        return FSDP_EINVAL;
    }
    int rc = fsdp__check_options(NULL, fn, "root", root);
    if (rc == 0) rc = fsdp__check_overrides(NULL, fn, "ov", ov);
    if (rc < 0) return rc;
    fsdp_options_t o;
    fsdp_options_init(&o);
    fsdp__abi_copy_in(&o, root, &fsdp__options_abi);
    if (ov) {
        if (ov->has_pg) o.pg = ov->pg;
        if (ov->has_replicate_pg) o.replicate_pg = ov->replicate_pg;
        if (ov->has_strategy) o.strategy = ov->strategy;
        if (ov->has_cpu_offload) o.cpu_offload = ov->cpu_offload;
        if (ov->has_device) o.device = ov->device;
        if (ov->has_backward_prefetch) o.backward_prefetch = ov->backward_prefetch;
        if (ov->has_forward_prefetch) o.forward_prefetch = ov->forward_prefetch;
        if (ov->has_limit_all_gathers) o.limit_all_gathers = ov->limit_all_gathers;
        if (ov->has_mixed_precision) o.mixed_precision = ov->mixed_precision;
        if (ov->has_sync_module_states) o.sync_module_states = ov->sync_module_states;
    }
    return fsdp__abi_fill(NULL, fn, "sizeof *out", out, out_size, &o, &fsdp__options_abi);
}

/* Values a custom function may get wrong; reported against the module's type. */
static int check_overrides(fsdp_module_t *m, const fsdp_unit_overrides_t *ov) {
    int rc = fsdp__check_overrides(fsdp_module_ctx(m), "custom policy", "ov", ov);
    if (rc < 0) return rc;
    const char *what = NULL;
    int v = 0;
    if (ov->has_strategy && ((int)ov->strategy < 0 || ov->strategy >= FSDP_SHARDING_COUNT))
        what = "strategy", v = (int)ov->strategy;
    else if (ov->has_backward_prefetch && ((int)ov->backward_prefetch < 0 ||
                                           ov->backward_prefetch >= FSDP_BACKWARD_PREFETCH_COUNT))
        what = "backward_prefetch", v = (int)ov->backward_prefetch;
    else if (ov->has_limit_all_gathers && ov->limit_all_gathers < 0)
        what = "limit_all_gathers", v = ov->limit_all_gathers;
    if (!what) return FSDP_OK;
    return fsdp__ctx_err(fsdp_module_ctx(m), FSDP_EINVAL,
                         "custom policy: the overrides for a module of type %s have an invalid "
                         "%s (%d)",
                         fsdp_module_type(m), what, v);
}

/* ---- policies -------------------------------------------------------------------------------- */

struct policy_ops {
    const char *kind;
    /* recurse/numel as fsdp_policy_decide; ov is non-NULL and initialized. */
    int (*decide)(const fsdp_policy_t *p, fsdp_module_t *m, bool recurse, int64_t numel,
                  fsdp_unit_overrides_t *ov);
};

/* The user function of a lambda, custom or callback policy. */
union policy_fn {
    fsdp_policy_fn callback;
    fsdp_policy_lambda_fn lambda;
    fsdp_policy_custom_fn custom;
};

struct fsdp_policy {
    const struct policy_ops *ops;
    _Atomic long refs;
    int64_t min_num_params; /* size_based */
    char **force_leaf;      /* size_based, NULL-terminated */
    char **exclude;         /* size_based */
    char **types;           /* module_types, transformer, types_individually */
    union policy_fn fn;
    void *arg;               /* borrowed */
    fsdp_policy_t **members; /* or: references */
    size_t nmembers;
};

static int decide_always(const fsdp_policy_t *p, fsdp_module_t *m, bool recurse, int64_t numel,
                         fsdp_unit_overrides_t *ov) {
    (void)p, (void)m, (void)recurse, (void)numel, (void)ov;
    return 1;
}

/* PyTorch's size_based_auto_wrap_policy: recurse into large modules that are not force-leaf;
 * wrap large modules that are not excluded containers. */
static int decide_size(const fsdp_policy_t *p, fsdp_module_t *m, bool recurse, int64_t numel,
                       fsdp_unit_overrides_t *ov) {
    (void)ov;
    bool large = numel >= p->min_num_params;
    if (recurse) return large && !fsdp__type_in(m, (const char *const *)p->force_leaf);
    return large && !fsdp__type_in(m, (const char *const *)p->exclude);
}

static int decide_types(const fsdp_policy_t *p, fsdp_module_t *m, bool recurse, int64_t numel,
                        fsdp_unit_overrides_t *ov) {
    (void)numel, (void)ov;
    return recurse || fsdp__type_in(m, (const char *const *)p->types);
}

static int decide_lambda(const fsdp_policy_t *p, fsdp_module_t *m, bool recurse, int64_t numel,
                         fsdp_unit_overrides_t *ov) {
    (void)numel, (void)ov;
    return recurse || p->fn.lambda(m, p->arg);
}

static int decide_custom(const fsdp_policy_t *p, fsdp_module_t *m, bool recurse, int64_t numel,
                         fsdp_unit_overrides_t *ov) {
    (void)numel;
    if (recurse) return 1;
    fsdp_unit_overrides_t local;
    fsdp_unit_overrides_init(&local);
    int r = p->fn.custom(m, &local, p->arg);
    if (r < 0) return r;
    if (r == FSDP_POLICY_NO) return 0;
    if (r == FSDP_POLICY_YES) return 1;
    if (r != FSDP_POLICY_OVERRIDE)
        return fsdp__ctx_err(fsdp_module_ctx(m), FSDP_EINVAL,
                             "custom policy: the function returned %d for a module of type %s; "
                             "expected FSDP_POLICY_NO, FSDP_POLICY_YES, FSDP_POLICY_OVERRIDE or "
                             "a negative error code",
                             r, fsdp_module_type(m));
    if (!fsdp_unit_overrides_any(&local)) return 0; /* PyTorch's empty dict */
    int rc = check_overrides(m, &local);
    if (rc < 0) return rc;
    *ov = local;
    return 1;
}

static int decide_or(const fsdp_policy_t *p, fsdp_module_t *m, bool recurse, int64_t numel,
                     fsdp_unit_overrides_t *ov) {
    for (size_t i = 0; i < p->nmembers; i++) {
        int r = fsdp_policy_decide(p->members[i], m, recurse, numel, ov);
        if (r != 0) return r; /* the first yes decides, as Python's any() */
    }
    return 0;
}

static int decide_callback(const fsdp_policy_t *p, fsdp_module_t *m, bool recurse, int64_t numel,
                           fsdp_unit_overrides_t *ov) {
    (void)ov;
    return p->fn.callback(m, recurse, numel, p->arg) ? 1 : 0;
}

static const struct policy_ops always_ops = {"always", decide_always};
static const struct policy_ops size_ops = {"size_based", decide_size};
static const struct policy_ops module_types_ops = {"module_types", decide_types};
static const struct policy_ops transformer_ops = {"transformer", decide_types};
static const struct policy_ops individually_ops = {"types_individually", decide_types};
static const struct policy_ops lambda_ops = {"lambda", decide_lambda};
static const struct policy_ops custom_ops = {"custom", decide_custom};
static const struct policy_ops or_ops = {"or", decide_or};
static const struct policy_ops callback_ops = {"callback", decide_callback};

static int policy_new(const struct policy_ops *ops, const char *fn, fsdp_policy_t **out,
                      fsdp_policy_t **p) {
    *p = NULL;
    if (!out) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "%s: out is NULL", fn);
        return FSDP_EINVAL;
    }
    *out = NULL;
    *p = calloc(1, sizeof **p);
    if (!*p) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "%s: out of memory", fn);
        return FSDP_ENOMEM;
    }
    (*p)->ops = ops;
    atomic_init(&(*p)->refs, 1);
    return FSDP_OK;
}

static int policy_nomem(const char *fn, fsdp_policy_t *p) {
    fsdp_policy_release(p);
    fsdp_log(NULL, FSDP_LOG_ERROR, "%s: out of memory", fn);
    return FSDP_ENOMEM;
}

int fsdp_policy_always_create(fsdp_policy_t **out) {
    fsdp_policy_t *p;
    int rc = policy_new(&always_ops, "fsdp_policy_always_create", out, &p);
    if (rc < 0) return rc;
    *out = p;
    return FSDP_OK;
}

static const fsdp__abi_struct_t size_policy_options_abi = FSDP__ABI_STRUCT(
    fsdp_size_policy_options_t, "fsdp_size_policy_options_init", extra_exclude_wrap_types);

void(fsdp_size_policy_options_init)(fsdp_size_policy_options_t *o, size_t size) {
    static const char *const force_leaf[] = {"MultiheadAttention", NULL};
    static const char *const exclude[] = {"ModuleList", "ModuleDict", NULL};
    fsdp_size_policy_options_t d;
    memset(&d, 0, sizeof d);
    d.min_num_params = 100000000;
    d.force_leaf_types = force_leaf;
    d.exclude_wrap_types = exclude;
    fsdp__abi_init(o, size, &d, &size_policy_options_abi);
}

int fsdp_policy_size_based_create(const fsdp_size_policy_options_t *o, fsdp_policy_t **out) {
    static const char *fn = "fsdp_policy_size_based_create";
    int rc = fsdp__abi_check(NULL, fn, "o", o, &size_policy_options_abi);
    if (rc < 0) {
        if (out) *out = NULL;
        return rc;
    }
    fsdp_size_policy_options_t def;
    if (!o) {
        fsdp_size_policy_options_init(&def);
        o = &def;
    }
    if (o->min_num_params < 0) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "%s: min_num_params %lld must be >= 0", fn,
                 (long long)o->min_num_params);
        if (out) *out = NULL;
        return FSDP_EINVAL;
    }
    fsdp_policy_t *p;
    rc = policy_new(&size_ops, fn, out, &p);
    if (rc < 0) return rc;
    p->min_num_params = o->min_num_params;
    p->force_leaf = strlist_concat(o->force_leaf_types, o->extra_force_leaf_types);
    p->exclude = strlist_concat(o->exclude_wrap_types, o->extra_exclude_wrap_types);
    if (!p->force_leaf || !p->exclude) return policy_nomem(fn, p);
    *out = p;
    return FSDP_OK;
}

static int types_create(const struct policy_ops *ops, const char *fn, const char *const *types,
                        fsdp_policy_t **out) {
    if (list_len(types) == 0) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "%s: types is NULL or empty (a NULL-terminated list of "
                 "module type names is needed)", fn);
        if (out) *out = NULL;
        return FSDP_EINVAL;
    }
    fsdp_policy_t *p;
    int rc = policy_new(ops, fn, out, &p);
    if (rc < 0) return rc;
    p->types = strlist_concat(types, NULL);
    if (!p->types) return policy_nomem(fn, p);
    *out = p;
    return FSDP_OK;
}

int fsdp_policy_module_types_create(const char *const *types, fsdp_policy_t **out) {
    return types_create(&module_types_ops, "fsdp_policy_module_types_create", types, out);
}

int fsdp_policy_transformer_create(const char *const *layer_types, fsdp_policy_t **out) {
    return types_create(&transformer_ops, "fsdp_policy_transformer_create", layer_types, out);
}

int fsdp_policy_types_individually_create(const char *const *types, fsdp_policy_t **out) {
    return types_create(&individually_ops, "fsdp_policy_types_individually_create", types, out);
}

/* The three kinds around a user function. */
static int fn_create(const struct policy_ops *ops, const char *fn, union policy_fn f,
                     bool have_fn, void *arg, fsdp_policy_t **out) {
    if (!have_fn) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "%s: fn is NULL", fn);
        if (out) *out = NULL;
        return FSDP_EINVAL;
    }
    fsdp_policy_t *p;
    int rc = policy_new(ops, fn, out, &p);
    if (rc < 0) return rc;
    p->fn = f;
    p->arg = arg;
    *out = p;
    return FSDP_OK;
}

int fsdp_policy_lambda_create(fsdp_policy_lambda_fn fn, void *arg, fsdp_policy_t **out) {
    union policy_fn f = {.lambda = fn};
    return fn_create(&lambda_ops, "fsdp_policy_lambda_create", f, fn != NULL, arg, out);
}

int fsdp_policy_custom_create(fsdp_policy_custom_fn fn, void *arg, fsdp_policy_t **out) {
    union policy_fn f = {.custom = fn};
    return fn_create(&custom_ops, "fsdp_policy_custom_create", f, fn != NULL, arg, out);
}

int fsdp_policy_callback_create(fsdp_policy_fn fn, void *arg, fsdp_policy_t **out) {
    union policy_fn f = {.callback = fn};
    return fn_create(&callback_ops, "fsdp_policy_callback_create", f, fn != NULL, arg, out);
}

int fsdp_policy_or_create(fsdp_policy_t *const *policies, size_t n, fsdp_policy_t **out) {
    static const char *fn = "fsdp_policy_or_create";
    if (!policies || n == 0) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "%s: %s (at least one policy is needed)", fn,
                 !policies ? "policies is NULL" : "n is 0");
        if (out) *out = NULL;
        return FSDP_EINVAL;
    }
    for (size_t i = 0; i < n; i++)
        if (!policies[i]) {
            fsdp_log(NULL, FSDP_LOG_ERROR, "%s: policies[%zu] is NULL", fn, i);
            if (out) *out = NULL;
            return FSDP_EINVAL;
        }
    fsdp_policy_t *p;
    int rc = policy_new(&or_ops, fn, out, &p);
    if (rc < 0) return rc;
    p->members = calloc(n, sizeof *p->members);
    if (!p->members) return policy_nomem(fn, p);
    for (size_t i = 0; i < n; i++) p->members[i] = fsdp_policy_retain(policies[i]);
    p->nmembers = n;
    *out = p;
    return FSDP_OK;
}

fsdp_policy_t *fsdp_policy_retain(fsdp_policy_t *p) {
    if (p) atomic_fetch_add_explicit(&p->refs, 1, memory_order_relaxed);
    return p;
}

void fsdp_policy_release(fsdp_policy_t *p) {
    if (!p || atomic_fetch_sub_explicit(&p->refs, 1, memory_order_acq_rel) != 1) return;
    strlist_free(p->force_leaf);
    strlist_free(p->exclude);
    strlist_free(p->types);
    for (size_t i = 0; i < p->nmembers; i++) fsdp_policy_release(p->members[i]);
    free(p->members);
    free(p);
}

const char *fsdp_policy_kind(const fsdp_policy_t *p) {
    return p ? p->ops->kind : "(null)";
}

int fsdp_policy_decide(const fsdp_policy_t *p, fsdp_module_t *m, bool recurse,
                       int64_t nonwrapped_numel, fsdp_unit_overrides_t *ov) {
    static const char fn[] = "fsdp_policy_decide";
    /* The caller's ov tells its size (it must have been initialised); the decision is made in a
     * struct of this library's layout and then copied out. */
    fsdp_ctx_t *ctx = m ? fsdp_module_ctx(m) : NULL;
    int r = fsdp__abi_check(ctx, fn, "ov", ov, &fsdp__unit_overrides_abi);
    if (r < 0) return r;
    fsdp_unit_overrides_t local;
    fsdp_unit_overrides_init(&local);
    if (!m) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "%s: m is NULL", fn);
        r = FSDP_EINVAL;
    } else if (!p) {
        r = fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: p is NULL", fn);
    } else {
        r = p->ops->decide(p, m, recurse, nonwrapped_numel, &local);
        if (r <= 0) fsdp_unit_overrides_init(&local); /* a no carries no overrides */
    }
    if (ov) fsdp__abi_fill(ctx, fn, "ov->size", ov, ov->size, &local, &fsdp__unit_overrides_abi);
    return r;
}

bool fsdp_policy_call(const fsdp_policy_t *p, fsdp_module_t *m, bool recurse,
                      int64_t nonwrapped_numel) {
    return fsdp_policy_decide(p, m, recurse, nonwrapped_numel, NULL) > 0;
}
