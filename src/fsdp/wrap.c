/* SPDX-License-Identifier: MIT */
/*
 * wrap.c: building FSDP units: options and their checks, collecting the parameters a unit
 * manages, fsdp_wrap itself (by hand, or driven by a wrap plan from policy.c), the composable
 * fsdp_fully_shard, the per-thread wrap scope of the manual API, and per-unit option reporting.
 *
 * A unit manages the parameters of its module's subtree outside nested units and ignored
 * modules (and any parameter an ignored module holds, wherever else it is registered); units met
 * on the way are adopted as its children. A unit enters the per-rank registry at the end of its
 * wrap; a failed wrap frees it and leaves the units it would have adopted as roots (parameters
 * it already flattened cannot be restored). Flattening and the moves to options.device are in
 * flatten.c. The hooks installed here run the unit through hooks.c.
 *
 * With an auto-wrap policy the only traversal is the plan's (fsdp_wrap_plan_build): every check
 * that can refuse the tree runs before the first unit is made, then the planned units are
 * wrapped in the plan's post-order and each must take exactly the parameter elements the plan
 * counted for it (checked after collecting, before anything is changed).
 *
 * The wrap scope (fsdp_enable_wrap) is the one piece of per-thread state of the library:
 * PyTorch's enable_wrap is a context manager around the caller's code, so it belongs to the
 * calling thread (a rank), not to a context.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp/fsdp_impl.h"
#include <fsdp/policy.h>
#include "nn/nn_impl.h"
#include "tensor/tensor_impl.h"

/* ---- options --------------------------------------------------------------------------------- */

static const char *const strategy_names[FSDP_SHARDING_COUNT] = {
    "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"};
static const char *const prefetch_names[FSDP_BACKWARD_PREFETCH_COUNT] = {"NONE", "BACKWARD_PRE",
                                                                         "BACKWARD_POST"};

const char *fsdp_sharding_strategy_name(fsdp_sharding_strategy_t s) {
    return (int)s >= 0 && s < FSDP_SHARDING_COUNT ? strategy_names[s] : "?";
}

const char *fsdp_backward_prefetch_name(fsdp_backward_prefetch_t p) {
    return (int)p >= 0 && p < FSDP_BACKWARD_PREFETCH_COUNT ? prefetch_names[p] : "?";
}

const fsdp__abi_struct_t fsdp__mixed_precision_abi =
    FSDP__ABI_STRUCT(fsdp_mixed_precision_t, "fsdp_mixed_precision_init", module_classes_to_ignore);
const fsdp__abi_struct_t fsdp__options_abi =
    FSDP__ABI_STRUCT(fsdp_options_t, "fsdp_options_init", delay_before_free_ms);

void(fsdp_mixed_precision_init)(fsdp_mixed_precision_t *mp, size_t size) {
    static const char *const batchnorm[] = {FSDP_TYPE_BATCHNORM, NULL};
    fsdp_mixed_precision_t d;
    memset(&d, 0, sizeof d);
    d.module_classes_to_ignore = batchnorm;
    d.param_dtype = d.reduce_dtype = d.buffer_dtype = FSDP_MP_UNSET;
    d.cast_root_forward_inputs = true;
    fsdp__abi_init(mp, size, &d, &fsdp__mixed_precision_abi);
}

void(fsdp_options_init)(fsdp_options_t *o, size_t size) {
    fsdp_options_t d;
    memset(&d, 0, sizeof d);
    fsdp_mixed_precision_init(&d.mixed_precision);
    d.strategy = FSDP_FULL_SHARD;
    d.backward_prefetch = FSDP_BACKWARD_PRE;
    d.limit_all_gathers = 2;
    fsdp__abi_init(o, size, &d, &fsdp__options_abi);
}

int fsdp__check_options(fsdp_ctx_t *ctx, const char *fn, const char *arg, const fsdp_options_t *o) {
    int rc = fsdp__abi_check(ctx, fn, arg, o, &fsdp__options_abi);
    if (rc < 0 || !o) return rc;
    char what[64];
    snprintf(what, sizeof what, "%s->mixed_precision", arg);
    return fsdp__abi_check_embedded(ctx, fn, what, &o->mixed_precision, &fsdp__mixed_precision_abi,
                                    "fsdp_options_init");
}

static bool is_hybrid(fsdp_sharding_strategy_t s) {
    return s == FSDP_HYBRID_SHARD || s == FSDP_HYBRID_SHARD_ZERO2;
}

/* ---- wrapping -------------------------------------------------------------------------------- */

char *fsdp__join_name(const char *prefix, const char *name) {
    size_t a = strlen(prefix), b = strlen(name);
    char *s = malloc(a + b + 2);
    if (!s) return NULL;
    if (a) {
        memcpy(s, prefix, a);
        s[a] = '.';
        memcpy(s + a + 1, name, b + 1);
    } else {
        memcpy(s, name, b + 1);
    }
    return s;
}

struct collect {
    fsdp_unit_t *u;
    const fsdp_options_t *o;
    size_t capparams, capslots;
    fsdp_tensor_t **ign; /* parameters of the ignored modules' subtrees */
    size_t nign, capign;
};

static bool is_ignored(const fsdp_options_t *o, const fsdp_module_t *m) {
    for (size_t i = 0; i < o->num_ignored_modules; i++)
        if (o->ignored_modules[i] == m) return true;
    return false;
}

static int add_child_unit(fsdp_unit_t *u, fsdp_unit_t *c) {
    if (u->nchildren == u->capchildren) {
        size_t cap = u->capchildren ? 2 * u->capchildren : 4;
        fsdp_unit_t **nc = realloc(u->children, cap * sizeof *nc);
        if (!nc) return FSDP_ENOMEM;
        u->children = nc;
        u->capchildren = cap;
    }
    u->children[u->nchildren++] = c;
    return FSDP_OK;
}

static bool param_ignored(const struct collect *c, const fsdp_tensor_t *t) {
    for (size_t i = 0; i < c->nign; i++)
        if (c->ign[i] == t) return true;
    return false;
}

/* Adds the parameters of m's subtree to c->ign (PyTorch's ignored parameters: a parameter an
 * ignored module holds is ignored wherever else it is registered too). */
static int collect_ignored(struct collect *c, const fsdp_module_t *m) {
    for (size_t i = 0; i < m->nparams; i++) {
        if (param_ignored(c, m->params[i].t)) continue;
        if (c->nign == c->capign) {
            size_t cap = c->capign ? 2 * c->capign : 8;
            fsdp_tensor_t **v = realloc(c->ign, cap * sizeof *v);
            if (!v) return FSDP_ENOMEM;
            c->ign = v;
            c->capign = cap;
        }
        c->ign[c->nign++] = m->params[i].t;
    }
    for (size_t i = 0; i < m->nchildren; i++) {
        int rc = collect_ignored(c, m->children[i].m);
        if (rc < 0) return rc;
    }
    return FSDP_OK;
}

/* Walks m's subtree in pre-order, collecting the parameters u manages and every slot that holds
 * one; adopts the units met on the way (their subtrees are theirs). */
static int collect(struct collect *c, fsdp_module_t *m, const char *prefix) {
    fsdp_unit_t *u = c->u;
    if (m != u->module) {
        fsdp_unit_t *other = fsdp_unit_of(m);
        if (other) {
            if (other->parent && other->parent != u)
                return fsdp__unit_err(u, FSDP_EINVAL,
                                      "module '%s' is already a unit inside another "
                                      "tree", prefix);
            if (!other->parent) {
                /* Adopt it (once, even if the module appears twice). */
                bool have = false;
                for (size_t i = 0; i < u->nchildren; i++) have |= u->children[i] == other;
                if (!have && add_child_unit(u, other) < 0)
                    return fsdp__unit_err(u, FSDP_ENOMEM, "out of memory");
            }
            return FSDP_OK;
        }
        if (is_ignored(c->o, m)) return FSDP_OK;
    }
    for (size_t i = 0; i < m->nparams; i++) {
        fsdp_tensor_t *t = m->params[i].t;
        if (param_ignored(c, t)) continue;
        int idx = -1;
        for (int p = 0; p < u->nparams; p++)
            if (u->params[p].orig == t) idx = p;
        char *fqn = fsdp__join_name(prefix, m->params[i].name);
        if (!fqn) return fsdp__unit_err(u, FSDP_ENOMEM, "out of memory");
        if (idx < 0) {
            int oi = 0;
            fsdp_unit_t *owner = fsdp__owner_of_param(u->ctx, t, &oi);
            if (owner) {
                int rc = fsdp__unit_err(
                    u, FSDP_EINVAL,
                    "parameter '%s' is shared with parameter '%s' of the unit at "
                    "'%s'; a shared parameter must belong to one unit: wrap the "
                    "modules that share it in one unit",
                    fqn, owner->params[oi].fqn,
                    owner->module == u->module ? "" : fsdp_module_type(owner->module));
                free(fqn);
                return rc;
            }
            if (!fsdp_dtype_is_float(t->dt)) {
                int rc = fsdp__unit_err(u, FSDP_EINVAL,
                                        "cannot flatten parameter '%s' of dtype %s: "
                                        "FSDP flattens floating-point parameters only",
                                        fqn, fsdp_dtype_name(t->dt));
                free(fqn);
                return rc;
            }
            if ((size_t)u->nparams == c->capparams) {
                size_t cap = c->capparams ? 2 * c->capparams : 8;
                struct fsdp__param *np = realloc(u->params, cap * sizeof *np);
                if (!np) {
                    free(fqn);
                    return fsdp__unit_err(u, FSDP_ENOMEM, "out of memory");
                }
                u->params = np;
                c->capparams = cap;
            }
            struct fsdp__param *p = &u->params[u->nparams];
            *p = (struct fsdp__param){0};
            p->fqn = fqn;
            fqn = NULL;
            p->orig = fsdp_tensor_retain(t);
            p->ndim = t->ndim;
            memcpy(p->shape, t->shape, sizeof p->shape);
            idx = u->nparams++;
        }
        free(fqn);
        if (u->nslots == c->capslots) {
            size_t cap = c->capslots ? 2 * c->capslots : 8;
            struct fsdp__slotref *ns = realloc(u->slots, cap * sizeof *ns);
            if (!ns) return fsdp__unit_err(u, FSDP_ENOMEM, "out of memory");
            u->slots = ns;
            c->capslots = cap;
        }
        u->slots[u->nslots++] = (struct fsdp__slotref){m, i, idx};
    }
    for (size_t i = 0; i < m->nchildren; i++) {
        char *name = fsdp__join_name(prefix, m->children[i].name);
        if (!name) return fsdp__unit_err(u, FSDP_ENOMEM, "out of memory");
        int rc = collect(c, m->children[i].m, name);
        free(name);
        if (rc < 0) return rc;
    }
    return FSDP_OK;
}

static int set_fqns(fsdp_unit_t *u, fsdp_module_t *m, const char *prefix);

/* Parameter elements u collected (before flattening changes the tensors). */
static int64_t collected_numel(const fsdp_unit_t *u) {
    int64_t n = 0;
    for (int i = 0; i < u->nparams; i++) n += fsdp_tensor_numel(u->params[i].orig);
    return n;
}

/* Makes m a unit with options o over group pg. expect_numel >= 0: the parameter elements the
 * wrap plan counted for m, checked after collecting (before anything changes). */
static int wrap_one(fsdp_module_t *m, const fsdp_options_t *o, fsdp_pg_t *pg, const char *fqn,
                    int64_t expect_numel, fsdp_unit_t **out) {
    *out = NULL;
    fsdp_unit_t *u = calloc(1, sizeof *u);
    if (!u) return fsdp__ctx_err(m->ctx, FSDP_ENOMEM, "fsdp_wrap: out of memory");
    u->ctx = m->ctx;
    u->module = fsdp_module_retain(m);
    u->fqn = strdup(fqn ? fqn : "");
    u->opt = *o; /* this library's layout: fsdp_wrap's copy */
    fsdp_full_state_dict_options_init(&u->sd_full);
    u->opt.ignored_modules = NULL; /* the caller's array: copied below */
    u->opt.num_ignored_modules = 0;
    u->opt.auto_wrap_policy = NULL; /* borrowed for the call only */
    u->full_prec_in_eval = fsdp__mp_full_prec_in_eval(o);
    u->skip_writeback_check = fsdp__skip_writeback_env();
    struct collect c = {u, o, 0, 0, NULL, 0, 0};
    if (o->num_ignored_modules > 0) {
        u->ignored = malloc(o->num_ignored_modules * sizeof *u->ignored);
        if (!u->ignored) {
            free(u->fqn);
            fsdp_module_release(u->module);
            free(u);
            return fsdp__ctx_err(m->ctx, FSDP_ENOMEM, "fsdp_wrap: out of memory");
        }
        memcpy(u->ignored, o->ignored_modules, o->num_ignored_modules * sizeof *u->ignored);
        u->nignored = o->num_ignored_modules;
        u->opt.ignored_modules = u->ignored;
        u->opt.num_ignored_modules = u->nignored;
    }
    u->pg = pg;
    u->rank = fsdp_pg_rank(pg);
    u->world = fsdp_pg_size(pg);
    u->replicate_pg = is_hybrid(o->strategy) ? o->replicate_pg : NULL;
    u->dev = o->device ? o->device : fsdp_ctx_device(m->ctx); /* fsdp__flatten() refines it */
    int rc = FSDP_OK;
    if (!u->fqn) {
        rc = fsdp__ctx_err(m->ctx, FSDP_ENOMEM, "fsdp_wrap: out of memory");
        goto fail;
    }
    if (u->world == 1 && o->strategy != FSDP_NO_SHARD && !u->replicate_pg) {
        /* PyTorch forces NO_SHARD on a group of one. */
        u->opt.strategy = FSDP_NO_SHARD;
    }
    for (size_t i = 0; i < u->nignored; i++)
        if (collect_ignored(&c, u->ignored[i]) < 0) {
            rc = fsdp__unit_err(u, FSDP_ENOMEM, "out of memory");
            goto fail;
        }
    FSDP_TRY(rc, fail, collect(&c, m, ""));
    if (expect_numel >= 0 && collected_numel(u) != expect_numel) {
        rc = fsdp__unit_err(u, FSDP_EINTERNAL,
                            "internal error: the unit collected %lld parameter elements but the "
                            "wrap plan counted %lld for it",
                            (long long)collected_numel(u), (long long)expect_numel);
        goto fail;
    }
    if (o->device && (rc = fsdp__move_buffers(u, m, true, o->device)) < 0) {
        rc = fsdp__unit_err(u, rc, "moving buffers to options.device (%s) failed: %s",
                            fsdp_device_name(o->device), fsdp_ctx_last_error(u->ctx));
        goto fail;
    }
    if (o->sync_module_states) {
        rc = fsdp__sync_states(u, m, true);
        if (rc < 0) {
            rc = fsdp__unit_err(u, rc, "sync_module_states: broadcast failed: %s",
                                fsdp_pg_last_error(pg));
            goto fail;
        }
    }
    if (u->nparams > 0) FSDP_TRY(rc, fail, fsdp__flatten(u));
    for (size_t i = 0; o->device && i < u->nchildren; i++)
        FSDP_TRY(rc, fail, fsdp__inherit_device(u->children[i], o->device));
    FSDP_TRY(rc, fail, fsdp_module_add_forward_pre_hook(m, fsdp__forward_pre_hook, u,
                                                        &u->hook_handles[0]));
    FSDP_TRY(rc, fail, fsdp_module_add_forward_hook(m, fsdp__forward_hook, u, &u->hook_handles[1]));
    FSDP_TRY(rc, fail, fsdp_module_add_backward_pre_hook(m, fsdp__backward_pre_hook, u,
                                                         &u->hook_handles[2]));
    FSDP_TRY(rc, fail,
             fsdp_module_add_backward_hook(m, fsdp__backward_hook, u, &u->hook_handles[3]));
    FSDP_TRY(rc, fail, fsdp__registry_add(u));
    for (size_t i = 0; i < u->nchildren; i++) u->children[i]->parent = u;
    /* Names of the adopted units, now relative to this module. */
    if (u->nchildren > 0 && (rc = set_fqns(u, m, "")) < 0) {
        rc = fsdp__unit_err(u, rc, "out of memory");
        goto fail;
    }
    free(c.ign);
    *out = u;
    return FSDP_OK;
fail:
    /* Parameters already re-pointed cannot be restored; before flattening they are untouched. */
    free(c.ign);
    for (size_t i = 0; i < u->nchildren; i++)
        if (u->children[i]->parent == u) u->children[i]->parent = NULL;
    u->nchildren = 0;
    fsdp__unit_free(u);
    return rc;
}

/* Checks the options one unit of module m is wrapped with; *pg receives the group it shards
 * over. who names the unit in messages ("fsdp_wrap", or the planned unit). */
static int check_options(fsdp_module_t *m, const fsdp_options_t *o, const char *who,
                         fsdp_pg_t **pg) {
    if ((int)o->strategy < 0 || o->strategy >= FSDP_SHARDING_COUNT)
        return fsdp__ctx_err(m->ctx, FSDP_EINVAL, "%s: sharding strategy %d is not one", who,
                             (int)o->strategy);
    if ((int)o->backward_prefetch < 0 || o->backward_prefetch >= FSDP_BACKWARD_PREFETCH_COUNT)
        return fsdp__ctx_err(m->ctx, FSDP_EINVAL, "%s: backward prefetch %d is not one", who,
                             (int)o->backward_prefetch);
    if (o->limit_all_gathers < 0)
        return fsdp__ctx_err(m->ctx, FSDP_EINVAL, "%s: limit_all_gathers is %d; it must be >= 0",
                             who, o->limit_all_gathers);
    if (o->delay_before_reduce_ms < 0 || o->delay_before_free_ms < 0)
        return fsdp__ctx_err(m->ctx, FSDP_EINVAL,
                             "%s: delays must be >= 0 (delay_before_reduce_ms %d, "
                             "delay_before_free_ms %d)",
                             who, o->delay_before_reduce_ms, o->delay_before_free_ms);
    if (o->device && fsdp_device_ctx(o->device) != m->ctx)
        return fsdp__ctx_err(m->ctx, FSDP_EINVAL,
                             "%s: options.device (%s) belongs to another context "
                             "(of rank %d) than the module (rank %d); a unit computes on a "
                             "device of the module's context",
                             who, fsdp_device_name(o->device),
                             fsdp_ctx_rank(fsdp_device_ctx(o->device)), fsdp_ctx_rank(m->ctx));
    if (o->num_ignored_modules > 0 && !o->ignored_modules)
        return fsdp__ctx_err(m->ctx, FSDP_EINVAL, "%s: %zu ignored modules but the array is NULL",
                             who, o->num_ignored_modules);
    *pg = o->pg ? o->pg : m->ctx->pg;
    if (!*pg)
        return fsdp__ctx_err(m->ctx, FSDP_EINVAL,
                             "%s: no process group (options.pg is NULL and the context "
                             "has no world group)",
                             who);
    if (is_hybrid(o->strategy) && !o->replicate_pg)
        return fsdp__ctx_err(m->ctx, FSDP_EINVAL,
                             "%s: %s needs options.replicate_pg (the group across "
                             "which shards are replicated)",
                             who, fsdp_sharding_strategy_name(o->strategy));
    return FSDP_OK;
}

/* The options of a planned unit: the root's with the entry's overrides, no policy. */
static void entry_options(const fsdp_options_t *root, const fsdp_wrap_plan_entry_t *e,
                          fsdp_options_t *out) {
    fsdp_unit_overrides_apply(root, &e->overrides, out); /* cannot fail: neither is NULL */
    out->auto_wrap_policy = NULL;
}

/* Auto-wrap: every check, then the planned units below m in post-order; the root is left to
 * the caller. *root_numel receives what the plan counted for m. */
static int wrap_planned(fsdp_module_t *m, const fsdp_options_t *o, int64_t *root_numel) {
    fsdp_wrap_plan_t plan = {0};
    fsdp_wrap_plan_options_t po;
    fsdp_wrap_plan_options_init(&po);
    po.ignored_modules = o->ignored_modules;
    po.num_ignored_modules = o->num_ignored_modules;
    po.mixed_precision = o->mixed_precision.enabled;
    po.mp_ignored_types = o->mixed_precision.module_classes_to_ignore;
    po.use_orig_params = o->use_orig_params;
    int rc = fsdp_wrap_check_no_units(m, NULL, NULL);
    if (rc < 0) return rc;
    FSDP_TRY(rc, out, fsdp_wrap_plan_build(m, o->auto_wrap_policy, &po, &plan));
    FSDP_TRY(rc, out, fsdp_wrap_plan_validate_frozen(m, &plan, &po, NULL));
    /* Every unit's options before the first unit is made. */
    for (size_t i = 0; i < plan.n; i++) {
        const fsdp_wrap_plan_entry_t *e = &plan.entries[i];
        if (e->is_root) continue;
        fsdp_options_t eo;
        fsdp_pg_t *pg = NULL;
        entry_options(o, e, &eo);
        char who[160];
        snprintf(who, sizeof who, "fsdp_wrap: the unit planned at '%s'", e->fqn);
        FSDP_TRY(rc, out, check_options(e->module, &eo, who, &pg));
    }
    for (size_t i = 0; i < plan.n; i++) {
        const fsdp_wrap_plan_entry_t *e = &plan.entries[i];
        if (e->is_root) {
            *root_numel = e->managed_numel;
            continue;
        }
        fsdp_options_t eo;
        fsdp_pg_t *pg = NULL;
        fsdp_unit_t *u = NULL;
        entry_options(o, e, &eo);
        FSDP_TRY(rc, out, check_options(e->module, &eo, "fsdp_wrap", &pg));
        FSDP_TRY(rc, out, wrap_one(e->module, &eo, pg, e->fqn, e->managed_numel, &u));
        u->cast_io = e->mp_override && u->nparams > 0;
        u->io_dt = -1;
    }
out:
    fsdp_wrap_plan_free(&plan);
    return rc;
}

int fsdp_wrap(fsdp_module_t *m, const fsdp_options_t *user_o, fsdp_unit_t **out) {
    if (out) *out = NULL;
    if (!m) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_wrap: module is NULL");
    if (!out) return fsdp__ctx_err(m->ctx, FSDP_EINVAL, "fsdp_wrap: out is NULL");
    int rc = fsdp__check_options(m->ctx, "fsdp_wrap", "o", user_o);
    if (rc < 0) return rc;
    /* Everything below reads a copy of this library's layout (the defaults, then what the
     * caller's size covers). */
    fsdp_options_t oc;
    fsdp_options_init(&oc);
    if (user_o) fsdp__abi_copy_in(&oc, user_o, &fsdp__options_abi);
    const fsdp_options_t *o = &oc;
    fsdp_pg_t *pg = NULL;
    rc = check_options(m, o, "fsdp_wrap", &pg);
    if (rc < 0) return rc;
    if (m->ctx->fsdp)
        for (size_t i = 0; i < m->ctx->fsdp->n; i++) {
            fsdp_unit_t *r = m->ctx->fsdp->units[i].u;
            if (r->initialized)
                for (size_t j = 0; j < r->nall; j++)
                    if (r->all[j] == r && r->state != FSDP_STATE_IDLE)
                        return fsdp__ctx_err(m->ctx, FSDP_EINVAL,
                                             "fsdp_wrap: a unit is running forward or backward");
        }
    int64_t numel = -1;
    if (o->auto_wrap_policy) {
        if ((rc = wrap_planned(m, o, &numel)) < 0) return rc;
    } else if (fsdp_unit_of(m)) {
        return fsdp__module_err(m, FSDP_EINVAL, "fsdp_wrap: the module is already an FSDP unit");
    }
    return wrap_one(m, o, pg, "", numel, out);
}

int fsdp_fully_shard(fsdp_module_t *m, const fsdp_options_t *o, fsdp_unit_t **out) {
    fsdp_unit_t *u = NULL;
    if (out) *out = NULL;
    int rc = fsdp__check_options(m ? m->ctx : NULL, "fsdp_fully_shard", "o", o);
    if (rc < 0) return rc;
    fsdp_options_t fo;
    fsdp_options_init(&fo);
    if (o) fsdp__abi_copy_in(&fo, o, &fsdp__options_abi);
    fo.use_orig_params = true; /* upstream's fully_shard has no flat parameter to show */
    rc = fsdp_wrap(m, &fo, &u);
    if (out) *out = u;
    return rc;
}

int(fsdp_unit_options)(const fsdp_unit_t *u, fsdp_options_t *out, size_t out_size) {
    if (!u || !out) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "fsdp_unit_options: %s is NULL", !u ? "u" : "out");
        return FSDP_EINVAL;
    }
    fsdp_options_t o = u->opt; /* the strategy is the clamped one, ignored_modules u's copy */
    o.pg = u->pg;
    o.replicate_pg = u->replicate_pg;
    o.device = u->dev;
    o.auto_wrap_policy = NULL;
    return fsdp__abi_fill(u->ctx, "fsdp_unit_options", "sizeof *out", out, out_size, &o,
                          &fsdp__options_abi);
}

/* ---- the manual wrap API --------------------------------------------------------------------- */

/* The calling thread's wrap scope. */
static _Thread_local struct {
    bool open;
    fsdp_options_t defaults;
} scope;

int fsdp_enable_wrap(const fsdp_options_t *defaults) {
    if (scope.open) {
        fsdp_log(NULL, FSDP_LOG_ERROR,
                 "fsdp_enable_wrap: this thread is already within a wrap scope; scopes do not "
                 "nest (close it with fsdp_disable_wrap first)");
        return FSDP_EINVAL;
    }
    int rc = fsdp__check_options(NULL, "fsdp_enable_wrap", "defaults", defaults);
    if (rc < 0) return rc;
    fsdp_options_init(&scope.defaults);
    if (defaults) fsdp__abi_copy_in(&scope.defaults, defaults, &fsdp__options_abi);
    scope.open = true;
    return FSDP_OK;
}

int fsdp_disable_wrap(void) {
    if (!scope.open) {
        fsdp_log(NULL, FSDP_LOG_ERROR,
                 "fsdp_disable_wrap: this thread has no wrap scope open (fsdp_enable_wrap)");
        return FSDP_EINVAL;
    }
    scope.open = false;
    fsdp_options_init(&scope.defaults); /* drops the borrowed pointers */
    return FSDP_OK;
}

bool fsdp_wrap_enabled(void) {
    return scope.open;
}

int fsdp_wrap_scoped(fsdp_module_t *m, const fsdp_unit_overrides_t *ov, fsdp_unit_t **out) {
    if (out) *out = NULL;
    if (!m) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_wrap_scoped: module is NULL");
    if (!out) return fsdp__ctx_err(m->ctx, FSDP_EINVAL, "fsdp_wrap_scoped: out is NULL");
    if (!scope.open) return FSDP_OK; /* PyTorch's wrap() outside enable_wrap: the identity */
    int rc = fsdp__check_overrides(m->ctx, "fsdp_wrap_scoped", "ov", ov);
    if (rc < 0) return rc;
    fsdp_options_t o;
    fsdp_unit_overrides_apply(&scope.defaults, ov, &o);
    return fsdp_wrap(m, &o, out);
}

/* Sets fqn of every unit under u (relative to the root's module). */
static int set_fqns(fsdp_unit_t *u, fsdp_module_t *m, const char *prefix) {
    fsdp_unit_t *mu = fsdp_unit_of(m);
    if (mu && mu != u && mu->parent) {
        char *s = strdup(prefix);
        if (!s) return FSDP_ENOMEM;
        free(mu->fqn);
        mu->fqn = s;
    }
    for (size_t i = 0; i < m->nchildren; i++) {
        char *name = fsdp__join_name(prefix, m->children[i].name);
        if (!name) return FSDP_ENOMEM;
        int rc = set_fqns(u, m->children[i].m, name);
        free(name);
        if (rc < 0) return rc;
    }
    return FSDP_OK;
}
