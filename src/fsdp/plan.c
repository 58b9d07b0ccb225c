/* SPDX-License-Identifier: MIT */
/*
 * plan.c: wrap plans and wrap-time validation (include/fsdp/policy.h): which subtrees of a
 * module tree become FSDP units under a policy (fsdp_wrap_plan_build), and the checks that can
 * refuse a tree before the first unit is made (no units already, frozen parameters). The
 * policies themselves are in policy.c; fsdp_wrap() (wrap.c) turns a plan into units.
 *
 * Everything here is a pure function of a module tree: nothing communicates, no unit is made,
 * no module is changed.
 *
 * Invariants: in a plan, a parameter belongs to at most one entry (the first, in post-order,
 * whose subtree holds it), and an ignored parameter to none. managed_numel sums exactly those.
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/policy.h>

#include "fsdp/fsdp_impl.h"
#include "nn/nn_impl.h"

/* ---- a set of pointers (open addressing) ----------------------------------------------------- */

struct ptrset {
    const void **slot; /* cap entries, NULL = empty */
    size_t cap, n;     /* cap is 0 or a power of two */
};

static size_t ptr_hash(const void *p, size_t cap) {
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 29;
    return (size_t)x & (cap - 1);
}

static bool ptrset_has(const struct ptrset *s, const void *p) {
    if (s->cap == 0 || !p) return false;
    for (size_t i = ptr_hash(p, s->cap);; i = (i + 1) & (s->cap - 1)) {
        if (s->slot[i] == p) return true;
        if (!s->slot[i]) return false;
    }
}

/* 1 when added, 0 when already there, FSDP_ENOMEM. */
static int ptrset_add(struct ptrset *s, const void *p) {
    if (ptrset_has(s, p)) return 0;
    if (2 * (s->n + 1) > s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 16;
        const void **slot = calloc(cap, sizeof *slot);
        if (!slot) return FSDP_ENOMEM;
        for (size_t i = 0; i < s->cap; i++) {
            if (!s->slot[i]) continue;
            size_t j = ptr_hash(s->slot[i], cap);
            while (slot[j])
                j = (j + 1) & (cap - 1);
            slot[j] = s->slot[i];
        }
        free(s->slot);
        s->slot = slot;
        s->cap = cap;
    }
    size_t j = ptr_hash(p, s->cap);
    while (s->slot[j])
        j = (j + 1) & (s->cap - 1);
    s->slot[j] = p;
    s->n++;
    return 1;
}

static void ptrset_clear(struct ptrset *s) {
    if (s->cap) memset(s->slot, 0, s->cap * sizeof *s->slot);
    s->n = 0;
}

static void ptrset_free(struct ptrset *s) {
    free(s->slot);
    *s = (struct ptrset){0};
}

/* ---- planning -------------------------------------------------------------------------------- */

static const fsdp__abi_struct_t plan_options_abi =
    FSDP__ABI_STRUCT(fsdp_wrap_plan_options_t, "fsdp_wrap_plan_options_init", use_orig_params);

void(fsdp_wrap_plan_options_init)(fsdp_wrap_plan_options_t *o, size_t size) {
    static const char *const mp_ignored[] = {FSDP_TYPE_BATCHNORM, NULL};
    fsdp_wrap_plan_options_t d;
    memset(&d, 0, sizeof d);
    d.mp_ignored_types = mp_ignored;
    fsdp__abi_init(o, size, &d, &plan_options_abi);
}

/* Adds every module of m's subtree to mods and every parameter of it to params. */
static int add_subtree(struct ptrset *mods, struct ptrset *params, const fsdp_module_t *m) {
    int rc = ptrset_add(mods, m);
    if (rc <= 0) return rc; /* already there: so is its subtree */
    for (size_t i = 0; i < m->nparams; i++)
        if ((rc = ptrset_add(params, m->params[i].t)) < 0) return rc;
    for (size_t i = 0; i < m->nchildren; i++)
        if ((rc = add_subtree(mods, params, m->children[i].m)) < 0) return rc;
    return FSDP_OK;
}

/* Ignored modules (whole subtrees) and ignored parameters (theirs and the listed ones). */
static int ignored_sets(fsdp_ctx_t *ctx, const char *fn, const fsdp_module_t *root,
                        const fsdp_wrap_plan_options_t *o, struct ptrset *mods,
                        struct ptrset *params) {
    int rc;
    if (o->num_ignored_modules && !o->ignored_modules)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "%s: ignored_modules is NULL but "
                             "num_ignored_modules is %zu",
                             fn, o->num_ignored_modules);
    if (o->num_ignored_params && !o->ignored_params)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "%s: ignored_params is NULL but "
                             "num_ignored_params is %zu",
                             fn, o->num_ignored_params);
    for (size_t i = 0; i < o->num_ignored_modules; i++) {
        if (!o->ignored_modules[i])
            return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: ignored_modules[%zu] is NULL", fn, i);
        if (o->ignored_modules[i] == root)
            return fsdp__ctx_err(ctx, FSDP_EINVAL,
                                 "%s: ignored_modules[%zu] is the root module "
                                 "(the module being wrapped cannot be ignored)",
                                 fn, i);
        if ((rc = add_subtree(mods, params, o->ignored_modules[i])) < 0) goto nomem;
    }
    for (size_t i = 0; i < o->num_ignored_params; i++) {
        if (!o->ignored_params[i])
            return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: ignored_params[%zu] is NULL", fn, i);
        if ((rc = ptrset_add(params, o->ignored_params[i])) < 0) goto nomem;
    }
    return FSDP_OK;
nomem:
    return fsdp__ctx_err(ctx, rc, "%s: out of memory", fn);
}

struct planner {
    fsdp_ctx_t *ctx;
    const fsdp_policy_t *policy;
    const char *const *mp_types; /* NULL unless the mixed-precision rule is on */
    struct ptrset ign_mods, ign_params;
    struct ptrset visited;        /* modules the walk has entered */
    struct ptrset claimed;        /* parameters of planned units */
    struct ptrset seen_m, seen_p; /* scratch for one subtree walk */
    fsdp_wrap_plan_t plan;
    size_t cap;
};

/* Sums the parameters of m's subtree that are neither ignored nor claimed, each once (seen_p
 * collects them). */
static int subtree_walk(struct planner *pl, const fsdp_module_t *m, int64_t *numel) {
    int rc = ptrset_add(&pl->seen_m, m);
    if (rc <= 0) return rc;
    for (size_t i = 0; i < m->nparams; i++) {
        const fsdp_tensor_t *t = m->params[i].t;
        if (ptrset_has(&pl->ign_params, t) || ptrset_has(&pl->claimed, t)) continue;
        if ((rc = ptrset_add(&pl->seen_p, t)) < 0) return rc;
        if (rc == 0) continue;
        *numel += fsdp_tensor_numel(t);
    }
    for (size_t i = 0; i < m->nchildren; i++) {
        const fsdp_module_t *c = m->children[i].m;
        if (ptrset_has(&pl->ign_mods, c)) continue;
        if ((rc = subtree_walk(pl, c, numel)) < 0) return rc;
    }
    return FSDP_OK;
}

static int unwrapped_numel(struct planner *pl, const fsdp_module_t *m, bool claim, int64_t *numel) {
    *numel = 0;
    ptrset_clear(&pl->seen_m);
    ptrset_clear(&pl->seen_p);
    int rc = subtree_walk(pl, m, numel);
    if (rc < 0 || !claim) return rc;
    /* seen_p now holds exactly the parameters the unit takes. */
    for (size_t i = 0; i < pl->seen_p.cap; i++)
        if (pl->seen_p.slot[i] && (rc = ptrset_add(&pl->claimed, pl->seen_p.slot[i])) < 0)
            return rc;
    return FSDP_OK;
}

static int plan_append(struct planner *pl, fsdp_module_t *m, const char *fqn,
                       const fsdp_wrap_plan_entry_t *e) {
    if (pl->plan.n == pl->cap) {
        size_t cap = pl->cap ? 2 * pl->cap : 8;
        fsdp_wrap_plan_entry_t *v = realloc(pl->plan.entries, cap * sizeof *v);
        if (!v) return FSDP_ENOMEM;
        pl->plan.entries = v;
        pl->cap = cap;
    }
    char *name = strdup(fqn);
    if (!name) return FSDP_ENOMEM;
    fsdp_wrap_plan_entry_t *d = &pl->plan.entries[pl->plan.n++];
    *d = *e;
    d->module = m;
    d->fqn = name;
    return FSDP_OK;
}

/* PyTorch's _recursive_wrap, recording instead of wrapping. With the mixed-precision rule on,
 * the policy acts as _or_policy([policy, _wrap_module_cls_individually(mp_types)]) and the
 * modules of mp_types get mixed precision off (PyTorch's _wrap_overrides). */
static int plan_visit(struct planner *pl, fsdp_module_t *m, const char *fqn, bool is_root) {
    int64_t numel = 0;
    int rc = ptrset_add(&pl->visited, m);
    if (rc < 0 || (rc = unwrapped_numel(pl, m, false, &numel)) < 0) goto nomem;
    rc = fsdp_policy_decide(pl->policy, m, true, numel, NULL);
    if (rc < 0) return rc;
    bool recurse = rc > 0 || pl->mp_types;
    for (size_t i = 0; recurse && i < m->nchildren; i++) {
        fsdp_module_t *c = m->children[i].m;
        if (ptrset_has(&pl->ign_mods, c) || ptrset_has(&pl->visited, c)) continue;
        char *name = fsdp__join_name(fqn, m->children[i].name);
        if (!name) goto nomem;
        rc = plan_visit(pl, c, name, false);
        free(name);
        if (rc < 0) return rc;
    }
    if (!recurse && !is_root) return FSDP_OK;
    fsdp_wrap_plan_entry_t e = {0};
    fsdp_unit_overrides_init(&e.overrides);
    e.is_root = is_root;
    if (recurse) {
        if ((rc = unwrapped_numel(pl, m, false, &numel)) < 0) goto nomem;
        rc = fsdp_policy_decide(pl->policy, m, false, numel, &e.overrides);
        if (rc < 0) return rc;
        e.selected = rc > 0;
    }
    if (is_root) {
        fsdp_unit_overrides_init(&e.overrides); /* the root keeps the root's options */
    } else {
        e.mp_override = pl->mp_types && fsdp__type_in(m, pl->mp_types);
        if (!e.selected && !e.mp_override) return FSDP_OK;
        if (e.mp_override) {
            e.overrides.has_mixed_precision = true;
            fsdp_mixed_precision_init(&e.overrides.mixed_precision);
        }
    }
    if ((rc = unwrapped_numel(pl, m, true, &e.managed_numel)) < 0) goto nomem;
    if ((rc = plan_append(pl, m, fqn, &e)) < 0) goto nomem;
    return FSDP_OK;
nomem:
    return fsdp__ctx_err(pl->ctx, FSDP_ENOMEM, "fsdp_wrap_plan_build: out of memory");
}

/* PyTorch's _warn_on_overridden_mixed_precision. */
static void warn_mp_override(const struct planner *pl) {
    fsdp__sbuf_t b = {0};
    size_t k = 0;
    for (size_t i = 0; i < pl->plan.n; i++) {
        const fsdp_wrap_plan_entry_t *e = &pl->plan.entries[i];
        if (!e->mp_override) continue;
        const char *t = fsdp_module_type(e->module);
        bool dup = false;
        for (size_t j = 0; j < i && !dup; j++)
            dup = pl->plan.entries[j].mp_override &&
                  strcmp(fsdp_module_type(pl->plan.entries[j].module), t) == 0;
        if (!dup) fsdp__sb_add(&b, "%s%s", k++ ? ", " : "", t);
    }
    if (k == 0 || b.oom) {
        free(b.s);
        return;
    }
    fsdp_log(pl->ctx, FSDP_LOG_WARN,
             "Both mixed precision and an auto-wrap policy were specified to FSDP, where the "
             "wrapped module has submodules of type:\n{%s}\nThese modules will be wrapped as "
             "separate FSDP instances with mixed precision disabled.",
             b.s);
    free(b.s);
}

static void planner_fini(struct planner *pl) {
    ptrset_free(&pl->ign_mods);
    ptrset_free(&pl->ign_params);
    ptrset_free(&pl->visited);
    ptrset_free(&pl->claimed);
    ptrset_free(&pl->seen_m);
    ptrset_free(&pl->seen_p);
}

int fsdp_wrap_plan_build(fsdp_module_t *root, const fsdp_policy_t *policy,
                         const fsdp_wrap_plan_options_t *o, fsdp_wrap_plan_t *out) {
    static const char *fn = "fsdp_wrap_plan_build";
    if (out) *out = (fsdp_wrap_plan_t){0};
    if (!root || !out) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "%s: %s is NULL", fn, !root ? "root" : "out");
        return FSDP_EINVAL;
    }
    fsdp_ctx_t *ctx = fsdp_module_ctx(root);
    if (!policy)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "%s: policy is NULL (make one with an "
                             "fsdp_policy_*_create function)",
                             fn);
    int rc = fsdp__abi_check(ctx, fn, "o", o, &plan_options_abi);
    if (rc < 0) return rc;
    fsdp_wrap_plan_options_t def;
    if (!o) {
        fsdp_wrap_plan_options_init(&def);
        o = &def;
    }
    struct planner pl = {.ctx = ctx, .policy = policy};
    if (o->mixed_precision && o->mp_ignored_types && o->mp_ignored_types[0])
        pl.mp_types = o->mp_ignored_types;
    rc = ignored_sets(ctx, fn, root, o, &pl.ign_mods, &pl.ign_params);
    if (rc >= 0) rc = plan_visit(&pl, root, "", true);
    if (rc >= 0) warn_mp_override(&pl);
    planner_fini(&pl);
    if (rc < 0) {
        fsdp_wrap_plan_free(&pl.plan);
        return rc;
    }
    *out = pl.plan;
    return FSDP_OK;
}

void fsdp_wrap_plan_free(fsdp_wrap_plan_t *plan) {
    if (!plan) return;
    for (size_t i = 0; i < plan->n; i++)
        free(plan->entries[i].fqn);
    free(plan->entries);
    *plan = (fsdp_wrap_plan_t){0};
}

const fsdp_wrap_plan_entry_t *fsdp_wrap_plan_find(const fsdp_wrap_plan_t *plan,
                                                  const fsdp_module_t *m) {
    for (size_t i = 0; plan && m && i < plan->n; i++)
        if (plan->entries[i].module == m) return &plan->entries[i];
    return NULL;
}

/* ---- validation ------------------------------------------------------------------------------ */

int fsdp_wrap_check_no_units(fsdp_module_t *root, fsdp_module_pred_fn is_unit, void *arg) {
    if (!root) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "fsdp_wrap_check_no_units: root is NULL");
        return FSDP_EINVAL;
    }
    fsdp_ctx_t *ctx = fsdp_module_ctx(root);
    fsdp_named_list_t l = {0};
    int rc = fsdp_module_named_modules(root, &l); /* pre-order, each module once */
    if (rc < 0) return rc;
    for (size_t i = 0; i < l.n; i++) {
        bool unit = is_unit ? is_unit(l.modules[i], arg) : fsdp_unit_of(l.modules[i]) != NULL;
        if (!unit) continue;
        rc = fsdp__ctx_err(ctx, FSDP_EINVAL,
                           "FSDP auto wrapping requires modules to not already have FSDP "
                           "applied but found %s in %s",
                           *l.names[i] ? l.names[i] : "the root module", fsdp_module_type(root));
        break;
    }
    fsdp_named_list_free(&l);
    return rc;
}

/* (module, fqn) in post-order, children in registration order, each module once: the order
 * of PyTorch's _get_post_order_named_modules. */
static int post_order(fsdp_named_list_t *out, size_t *cap, struct ptrset *seen, fsdp_module_t *m,
                      const char *fqn) {
    int rc = ptrset_add(seen, m);
    if (rc <= 0) return rc;
    for (size_t i = 0; i < m->nchildren; i++) {
        if (ptrset_has(seen, m->children[i].m)) continue;
        char *name = fsdp__join_name(fqn, m->children[i].name);
        if (!name) return FSDP_ENOMEM;
        rc = post_order(out, cap, seen, m->children[i].m, name);
        free(name);
        if (rc < 0) return rc;
    }
    return fsdp__list_push(out, cap, fqn, NULL, m);
}

/* One unit's managed parameters, found breadth-first from u and split by requires_grad into
 * two Python-style lists of FQNs. Modules in `visited` (those of units already examined) are
 * not entered; claimed parameters are skipped and the new ones claimed. */
struct frozen_split {
    fsdp__sbuf_t on, off; /* "'a', 'b'" */
    int64_t on_numel, off_numel;
    size_t n_on, n_off;
};

static int managed_split(fsdp_module_t *u, const char *fqn, const struct ptrset *ignored,
                         struct ptrset *visited, struct ptrset *claimed, struct frozen_split *fs) {
    size_t cap = 16, head = 0, tail = 0;
    fsdp_module_t **qm = malloc(cap * sizeof *qm);
    char **qn = malloc(cap * sizeof *qn);
    int rc = (qm && qn) ? ptrset_add(visited, u) : FSDP_ENOMEM;
    if (rc < 0) goto out;
    qm[tail] = u;
    qn[tail] = strdup(fqn);
    if (!qn[tail++]) goto nomem;
    while (head < tail) {
        fsdp_module_t *m = qm[head];
        char *prefix = qn[head++];
        for (size_t i = 0; i < m->nparams; i++) {
            const fsdp_tensor_t *t = m->params[i].t;
            if (ptrset_has(ignored, t)) continue;
            if ((rc = ptrset_add(claimed, t)) < 0) goto out;
            if (rc == 0) continue;
            bool on = fsdp_tensor_requires_grad(t);
            fsdp__sbuf_t *b = on ? &fs->on : &fs->off;
            fsdp__sb_add(b, "%s'%s%s%s'", (on ? fs->n_on : fs->n_off) ? ", " : "", prefix,
                         *prefix ? "." : "", m->params[i].name);
            *(on ? &fs->on_numel : &fs->off_numel) += fsdp_tensor_numel(t);
            ++*(on ? &fs->n_on : &fs->n_off);
        }
        for (size_t i = 0; i < m->nchildren; i++) {
            fsdp_module_t *c = m->children[i].m;
            if ((rc = ptrset_add(visited, c)) < 0) goto out;
            if (rc == 0) continue;
            if (tail == cap) {
                cap *= 2;
                fsdp_module_t **mv = realloc(qm, cap * sizeof *mv);
                if (mv) qm = mv;
                char **nv = mv ? realloc(qn, cap * sizeof *nv) : NULL;
                if (!nv) goto nomem;
                qn = nv;
            }
            qm[tail] = c;
            qn[tail] = fsdp__join_name(prefix, m->children[i].name);
            if (!qn[tail++]) goto nomem;
        }
    }
    rc = (fs->on.oom || fs->off.oom) ? FSDP_ENOMEM : FSDP_OK;
    goto out;
nomem:
    rc = FSDP_ENOMEM;
out:
    for (size_t i = 0; qn && i < tail; i++)
        free(qn[i]);
    free(qm);
    free(qn);
    return rc;
}

static int validate_frozen(fsdp_module_t *root, const struct ptrset *units,
                           const struct ptrset *ignored, bool use_orig_params, char **message) {
    fsdp_ctx_t *ctx = fsdp_module_ctx(root);
    fsdp_named_list_t po = {0};
    size_t cap = 0;
    struct ptrset seen = {0}, visited = {0}, claimed = {0};
    int rc = post_order(&po, &cap, &seen, root, "");
    for (size_t i = 0; rc >= 0 && i < po.n; i++) {
        if (!ptrset_has(units, po.modules[i])) continue;
        struct frozen_split fs = {0};
        rc = managed_split(po.modules[i], po.names[i], ignored, &visited, &claimed, &fs);
        if (rc >= 0 && fs.n_on > 0 && fs.n_off > 0) {
            fsdp__sbuf_t b = {0};
            fsdp__sb_add(&b, "%s has both parameters with requires_grad=True and False.",
                         po.names[i]);
            if (use_orig_params)
                fsdp__sb_add(&b,
                             " We do not recommend wrapping such modules since the gradient memory "
                             "usage will be higher than expected (%lld numel instead of %lld numel "
                             "before sharding via reduce-scatter). ",
                             (long long)(fs.on_numel + fs.off_numel), (long long)fs.on_numel);
            else
                fsdp__sb_add(&b, " FSDP does not support wrapping such modules when "
                                 "use_orig_params=False. ");
            fsdp__sb_add(&b,
                         "If possible, wrap the frozen parameters with FSDP separately.\n"
                         "The following parameters have requires_grad=True:\n[%s]\n"
                         "The following parameters have requires_grad=False:\n[%s]",
                         fs.on.s, fs.off.s);
            if (b.oom) {
                rc = FSDP_ENOMEM;
            } else {
                if (message && !*message) *message = b.s, b.s = NULL;
                if (use_orig_params)
                    fsdp_log(ctx, FSDP_LOG_WARN, "%s", b.s ? b.s : *message);
                else
                    rc = fsdp__ctx_err(ctx, FSDP_EINVAL, "%s", b.s ? b.s : *message);
            }
            free(b.s);
        }
        free(fs.on.s);
        free(fs.off.s);
    }
    if (rc == FSDP_ENOMEM) rc = fsdp__ctx_err(ctx, rc, "fsdp_wrap_validate_frozen: out of memory");
    fsdp_named_list_free(&po);
    ptrset_free(&seen);
    ptrset_free(&visited);
    ptrset_free(&claimed);
    return rc < 0 ? rc : FSDP_OK;
}

int fsdp_wrap_validate_frozen(fsdp_module_t *root, fsdp_module_t *const *units, size_t n,
                              fsdp_tensor_t *const *ignored_params, size_t num_ignored_params,
                              bool use_orig_params, char **message) {
    static const char *fn = "fsdp_wrap_validate_frozen";
    if (message) *message = NULL;
    if (!root) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "%s: root is NULL", fn);
        return FSDP_EINVAL;
    }
    fsdp_ctx_t *ctx = fsdp_module_ctx(root);
    if (n && !units)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: units is NULL but n is %zu", fn, n);
    if (num_ignored_params && !ignored_params)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "%s: ignored_params is NULL but "
                             "num_ignored_params is %zu",
                             fn, num_ignored_params);
    struct ptrset us = {0}, ign = {0};
    int rc = FSDP_OK;
    for (size_t i = 0; rc >= 0 && i < n; i++)
        rc = units[i] ? ptrset_add(&us, units[i])
                      : fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: units[%zu] is NULL", fn, i);
    for (size_t i = 0; rc >= 0 && i < num_ignored_params; i++)
        rc = ignored_params[i] ? ptrset_add(&ign, ignored_params[i])
                               : fsdp__ctx_err(ctx, FSDP_EINVAL,
                                               "%s: ignored_params[%zu] is "
                                               "NULL",
                                               fn, i);
    if (rc == FSDP_ENOMEM) rc = fsdp__ctx_err(ctx, rc, "%s: out of memory", fn);
    if (rc >= 0) rc = validate_frozen(root, &us, &ign, use_orig_params, message);
    ptrset_free(&us);
    ptrset_free(&ign);
    return rc;
}

int fsdp_wrap_plan_validate_frozen(fsdp_module_t *root, const fsdp_wrap_plan_t *plan,
                                   const fsdp_wrap_plan_options_t *o, char **message) {
    static const char *fn = "fsdp_wrap_plan_validate_frozen";
    if (message) *message = NULL;
    if (!root || !plan) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "%s: %s is NULL", fn, !root ? "root" : "plan");
        return FSDP_EINVAL;
    }
    fsdp_ctx_t *ctx = fsdp_module_ctx(root);
    int rc = fsdp__abi_check(ctx, fn, "o", o, &plan_options_abi);
    if (rc < 0) return rc;
    fsdp_wrap_plan_options_t def;
    if (!o) {
        fsdp_wrap_plan_options_init(&def);
        o = &def;
    }
    struct ptrset us = {0}, ign_mods = {0}, ign = {0};
    rc = ignored_sets(ctx, fn, root, o, &ign_mods, &ign);
    for (size_t i = 0; rc >= 0 && i < plan->n; i++) {
        const fsdp_wrap_plan_entry_t *e = &plan->entries[i];
        if (e->selected || (e->mp_override && !e->is_root)) rc = ptrset_add(&us, e->module);
    }
    if (rc == FSDP_ENOMEM) rc = fsdp__ctx_err(ctx, rc, "%s: out of memory", fn);
    if (rc >= 0) rc = validate_frozen(root, &us, &ign, o->use_orig_params, message);
    ptrset_free(&us);
    ptrset_free(&ign_mods);
    ptrset_free(&ign);
    return rc;
}
