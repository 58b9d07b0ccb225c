/* SPDX-License-Identifier: MIT */
/*
 * optim_state.c: the optimizer's SHARDED state dict keyed by parameter name
 * (fsdp_sharded_optim_state_dict and its load): an optimizer's state over a tree of units, as
 * the pieces of state_dict.c (each with its global shape and element offset), whatever the
 * optimizer steps over (flat parameters, original parameters, parameters no unit manages), and
 * loadable into an optimizer over another wrapping, use_orig_params setting or world size.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp/fsdp_impl.h"
#include "optim/optim_impl.h"
#include "tensor/tensor_impl.h"

/* ---- the optimizer's SHARDED state dict ----------------------------------------------------- */

const char *const fsdp__opt_states[FSDP__N_OPT_STATES] = {"momentum_buffer", "exp_avg",
                                                          "exp_avg_sq", "max_exp_avg_sq", "step"};
#define OPT_STATES fsdp__opt_states
#define N_OPT_STATES FSDP__N_OPT_STATES

static int classify(fsdp_unit_t *const *units, size_t nu, fsdp_tensor_t *t,
                    struct fsdp__opt_param *p) {
    p->u = NULL;
    p->index = -1;
    for (size_t i = 0; i < nu; i++) {
        if (units[i]->flat == t) {
            p->u = units[i];
            return FSDP_OK;
        }
        for (int k = 0; k < units[i]->nparams; k++)
            if (units[i]->params[k].orig == t) {
                p->u = units[i];
                p->index = k;
                return FSDP_OK;
            }
    }
    return FSDP_OK;
}

int fsdp__opt_params(fsdp_unit_t *root, fsdp_unit_t *const *units, size_t nu,
                     const fsdp_optim_t *opt, struct fsdp__opt_param **out, size_t *n) {
    size_t total = 0;
    int ng = fsdp_optim_num_groups(opt);
    for (int g = 0; g < ng; g++)
        total += fsdp_optim_group_size(opt, g);
    struct fsdp__opt_param *p = calloc(total + 1, sizeof *p);
    if (!p) return fsdp__unit_err(root, FSDP_ENOMEM, "optimizer state dict: out of memory");
    size_t k = 0;
    for (int g = 0; g < ng; g++)
        for (size_t i = 0; i < fsdp_optim_group_size(opt, g); i++, k++) {
            p[k].t = fsdp_optim_group_param(opt, g, i, &p[k].name);
            p[k].group = g;
            classify(units, nu, p[k].t, &p[k]);
        }
    *out = p;
    *n = k;
    return FSDP_OK;
}

/* A replicated f64 scalar entry. */
static int push_scalar(fsdp_unit_t *root, fsdp_shard_list_t *out, size_t *cap, char *name,
                       double v) {
    fsdp_tensor_t *t = NULL;
    int rc = fsdp__tensor_new(root->ctx, fsdp_ctx_device(root->ctx), FSDP_DTYPE_F64, 0, NULL,
                              FSDP_MEM_OTHER, &t);
    if (rc == 0) rc = fsdp_tensor_fill_(t, v);
    if (rc < 0) {
        free(name);
        fsdp_tensor_release(t);
        return rc;
    }
    return fsdp__sd_push(root, out, cap, name, t, 0, NULL, 0, true);
}

/* The pieces of one state tensor s of parameter p (its flat or original parameter's shape). */
static int push_state(fsdp_unit_t *root, const struct fsdp__opt_param *p, const char *state,
                      fsdp_tensor_t *s, bool copy, fsdp_shard_list_t *out, size_t *cap) {
    if (!p->u) {
        fsdp_tensor_t *c = NULL;
        int rc = fsdp_tensor_clone(s, FSDP_MEM_OTHER, &c);
        if (rc < 0) return rc;
        return fsdp__sd_push(root, out, cap, fsdp__join_name(p->name, state), c, s->ndim, s->shape,
                             0, true);
    }
    fsdp_unit_t *u = p->u;
    int rc = FSDP_OK;
    for (int i = 0; i < u->nparams && rc == 0; i++) {
        if (p->index >= 0 && i != p->index) continue;
        struct fsdp__param *q = &u->params[i];
        if (!q->sh.in_shard || q->sh.numel_in_shard == 0) continue;
        fsdp_tensor_t *c = NULL;
        bool repl = false;
        rc = fsdp__sd_piece(u, q, s, p->index >= 0 ? 0 : q->sh.offset_in_shard, copy, &c, &repl);
        char *fqn = fsdp__join_name(u->fqn, q->fqn);
        char *name = fqn ? fsdp__join_name(fqn, state) : NULL;
        free(fqn);
        if (rc == 0)
            rc = fsdp__sd_push(root, out, cap, name, c, q->ndim, q->shape, q->sh.intra_start, repl);
        else
            free(name);
    }
    return rc;
}

/* The fully qualified names of the model parameters p covers (one for an original or plain
 * parameter, every parameter of a flat one), as a callback. */
typedef int (*fqn_fn)(void *arg, const char *fqn);
static int each_fqn(const struct fsdp__opt_param *p, fqn_fn fn, void *arg) {
    if (!p->u) return fn(arg, p->name);
    int rc = FSDP_OK;
    for (int i = 0; i < p->u->nparams && rc == 0; i++) {
        if (p->index >= 0 && i != p->index) continue;
        char *fqn = fsdp__join_name(p->u->fqn, p->u->params[i].fqn);
        rc = fqn ? fn(arg, fqn) : FSDP_ENOMEM;
        free(fqn);
    }
    return rc;
}

struct scalar_arg {
    fsdp_unit_t *root;
    fsdp_shard_list_t *out;
    size_t *cap;
    const char *suffix;
    double v;
};

static int push_scalar_fqn(void *arg, const char *fqn) {
    struct scalar_arg *a = arg;
    return push_scalar(a->root, a->out, a->cap, fsdp__join_name(fqn, a->suffix), a->v);
}

int fsdp_sharded_optim_state_dict(fsdp_unit_t *root, const fsdp_optim_t *opt,
                                  fsdp_shard_list_t *out) {
    return fsdp__sharded_optim_state_dict(root, opt, true, out);
}

int fsdp__sharded_optim_state_dict(fsdp_unit_t *root, const fsdp_optim_t *opt, bool copy,
                                   fsdp_shard_list_t *out) {
    static const char fn[] = "fsdp_sharded_optim_state_dict";
    if (out) *out = (fsdp_shard_list_t){0};
    int rc = fsdp__sd_check_root(root, fn);
    if (rc < 0) return rc;
    if (!out || !opt)
        return fsdp__unit_err(root, FSDP_EINVAL, "%s: %s is NULL", fn, out ? "opt" : "out");
    fsdp_unit_t **units = NULL;
    size_t nu = 0, np = 0, cap = 0;
    struct fsdp__opt_param *p = NULL;
    fsdp_named_list_t osd = {0};
    if ((rc = fsdp_units(root, &units, &nu)) < 0) return rc;
    if ((rc = fsdp__opt_params(root, units, nu, opt, &p, &np)) < 0) goto out;
    if ((rc = fsdp__optim_state_dict(opt, copy, &osd)) < 0) goto out;
    /* hyper-parameters: "group.<g>.<hp>", replicated */
    for (size_t i = 0; i < osd.n && rc == 0; i++) {
        if (strncmp(osd.names[i], "group.", 6) != 0) continue;
        fsdp_tensor_t *c = NULL;
        rc = fsdp_tensor_clone(osd.tensors[i], FSDP_MEM_OTHER, &c);
        if (rc == 0) rc = fsdp__sd_push(root, out, &cap, strdup(osd.names[i]), c, 0, NULL, 0, true);
    }
    for (size_t k = 0; k < np && rc == 0; k++) {
        /* the group of every model parameter, so a load can check its own grouping */
        struct scalar_arg ga = {root, out, &cap, "group", (double)p[k].group};
        rc = each_fqn(&p[k], push_scalar_fqn, &ga);
        for (size_t s = 0; s < N_OPT_STATES && rc == 0; s++) {
            char *key = fsdp__join_name(p[k].name, OPT_STATES[s]);
            if (!key) {
                rc = FSDP_ENOMEM;
                break;
            }
            fsdp_tensor_t *st = NULL;
            for (size_t i = 0; i < osd.n && !st; i++)
                if (strcmp(osd.names[i], key) == 0) st = osd.tensors[i];
            free(key);
            if (!st) continue;
            if (strcmp(OPT_STATES[s], "step") == 0) {
                double v = 0;
                rc = fsdp_tensor_item(st, 0, &v);
                struct scalar_arg sa = {root, out, &cap, "step", v};
                if (rc == 0) rc = each_fqn(&p[k], push_scalar_fqn, &sa);
            } else {
                rc = push_state(root, &p[k], OPT_STATES[s], st, copy, out, &cap);
            }
        }
    }
out:
    free(units);
    free(p);
    fsdp_named_list_free(&osd);
    if (rc < 0) {
        fsdp__unit_err(root, rc, "%s: %s", fn, fsdp_ctx_last_error(root->ctx));
        fsdp_shard_list_free(out);
    }
    return rc;
}

/* The entry named exactly `name` in sd, or NULL. */
static const fsdp_shard_entry_t *find(const fsdp_shard_list_t *sd, const char *name) {
    for (size_t i = 0; i < sd->n; i++)
        if (strcmp(sd->e[i].name, name) == 0) return &sd->e[i];
    return NULL;
}

/* Builds the state tensor of `state` for p from sd's pieces (with write) or checks it; *have
 * says whether sd holds that state for p at all (for every model parameter p covers: for some
 * but not all is an error). */
static int build_state(fsdp_unit_t *root, const fsdp_shard_list_t *sd,
                       const struct fsdp__opt_param *p, const char *state, fsdp_shard_entry_t **tmp,
                       fsdp_tensor_t **out, bool *have, const char *fn) {
    *out = NULL;
    *have = false;
    size_t with = 0, of = 0;
    int rc = FSDP_OK;
    /* which of the covered parameters have it */
    for (int pass = 0; pass < 2 && rc == 0; pass++) {
        if (pass == 1) {
            if (with == 0) return FSDP_OK;
            if (with != of)
                return fsdp__unit_err(root, FSDP_EINVAL,
                                      "%s: '%s' (optimizer parameter '%s'): %zu of the %zu "
                                      "parameters it holds have a '%s' state",
                                      fn, state, p->name, with, of, state);
            *have = true;
            /* FSDP_MEM_OPTIM: the optimizer adopts it when the load succeeds */
            rc = fsdp__tensor_new(root->ctx, p->t->dev, p->t->dt, p->t->ndim, p->t->shape,
                                  FSDP_MEM_OPTIM, out);
            if (rc == 0) rc = fsdp_tensor_zero_(*out);
            if (rc < 0) return rc;
        }
        if (!p->u) {
            char *key = fsdp__join_name(p->name, state);
            if (!key) return FSDP_ENOMEM;
            of = 1;
            if (pass == 0) {
                with = find(sd, key) ? 1 : 0;
            } else {
                struct fsdp__sd_target t = {.name = key,
                                            .ndim = p->t->ndim,
                                            .shape = p->t->shape,
                                            .total = fsdp_tensor_numel(p->t),
                                            .lo = 0,
                                            .numel = fsdp_tensor_numel(p->t),
                                            .replicated = true};
                rc = fsdp__view1d(*out, 0, t.numel, &t.dst);
                if (rc == 0) rc = fsdp__sd_fill(root, sd, &t, tmp, true, fn);
                fsdp_tensor_release(t.dst);
            }
            free(key);
            continue;
        }
        for (int i = 0; i < p->u->nparams && rc == 0; i++) {
            if (p->index >= 0 && i != p->index) continue;
            struct fsdp__param *q = &p->u->params[i];
            char *fqn = fsdp__join_name(p->u->fqn, q->fqn);
            char *key = fqn ? fsdp__join_name(fqn, state) : NULL;
            free(fqn);
            if (!key) return FSDP_ENOMEM;
            if (pass == 0) {
                of++;
                with += find(sd, key) != NULL;
            } else if (q->sh.in_shard && q->sh.numel_in_shard > 0) {
                struct fsdp__sd_target t = {.name = key,
                                            .ndim = q->ndim,
                                            .shape = q->shape,
                                            .total = fsdp_tensor_numel(q->cv),
                                            .lo = q->sh.intra_start,
                                            .numel = q->sh.numel_in_shard};
                rc = fsdp__view1d(*out, p->index >= 0 ? 0 : q->sh.offset_in_shard, t.numel, &t.dst);
                /* checked piece by piece as it is copied: the tensor is a fresh one, and the
                 * optimizer takes nothing unless every state checks out */
                if (rc == 0) rc = fsdp__sd_fill(root, sd, &t, tmp, true, fn);
                fsdp_tensor_release(t.dst);
            }
            free(key);
        }
    }
    if (rc < 0) {
        fsdp_tensor_release(*out);
        *out = NULL;
    }
    return rc;
}

struct check_arg {
    fsdp_unit_t *root;
    const fsdp_shard_list_t *sd;
    const char *suffix;
    double want; /* group: the index to match; step: filled with the first value seen */
    bool any, differ;
    const char *fn;
};

/* "<fqn>.group" must equal the parameter's group here. */
static int check_group(void *arg, const char *fqn) {
    struct check_arg *a = arg;
    char *key = fsdp__join_name(fqn, "group");
    if (!key) return FSDP_ENOMEM;
    const fsdp_shard_entry_t *e = find(a->sd, key);
    double v = -1;
    int rc = e ? fsdp_tensor_item(e->t, 0, &v) : FSDP_OK;
    if (rc == 0 && (!e || v != a->want))
        rc = fsdp__unit_err(
            a->root, FSDP_EINVAL, "%s: '%s' is in group %g of this optimizer but the state dict %s",
            a->fn, fqn, a->want, e ? "puts it in another group" : "has no group for it");
    free(key);
    return rc;
}

/* The step counts of the covered parameters: all equal (one optimizer parameter holds one). */
static int check_step(void *arg, const char *fqn) {
    struct check_arg *a = arg;
    char *key = fsdp__join_name(fqn, "step");
    if (!key) return FSDP_ENOMEM;
    const fsdp_shard_entry_t *e = find(a->sd, key);
    free(key);
    if (!e) return FSDP_OK;
    double v = 0;
    int rc = fsdp_tensor_item(e->t, 0, &v);
    if (rc < 0) return rc;
    if (a->any && v != a->want) a->differ = true;
    a->want = v;
    a->any = true;
    return FSDP_OK;
}

/* Appends (name, t) to a growing named list, taking both (freed on failure). */
static int named_push(fsdp_unit_t *root, fsdp_named_list_t *l, size_t *cap, char *name,
                      fsdp_tensor_t *t) {
    if (l->n == *cap) {
        size_t nc = *cap ? 2 * *cap : 32;
        char **nn = realloc(l->names, nc * sizeof *nn);
        if (nn) l->names = nn;
        fsdp_tensor_t **nt = nn ? realloc(l->tensors, nc * sizeof *nt) : NULL;
        if (nt) l->tensors = nt;
        if (!nn || !nt) {
            free(name);
            fsdp_tensor_release(t);
            return fsdp__unit_err(root, FSDP_ENOMEM, "optimizer state dict: out of memory");
        }
        *cap = nc;
    }
    if (!name) {
        fsdp_tensor_release(t);
        return fsdp__unit_err(root, FSDP_ENOMEM, "optimizer state dict: out of memory");
    }
    l->names[l->n] = name;
    l->tensors[l->n] = t;
    l->n++;
    return FSDP_OK;
}

int fsdp_load_sharded_optim_state_dict(fsdp_unit_t *root, fsdp_optim_t *opt,
                                       const fsdp_shard_list_t *sd) {
    static const char fn[] = "fsdp_load_sharded_optim_state_dict";
    int rc = fsdp__sd_check_root(root, fn);
    if (rc < 0) return rc;
    if (!opt || !sd || (sd->n > 0 && !sd->e))
        return fsdp__unit_err(root, FSDP_EINVAL, "%s: %s is NULL", fn, opt ? "sd" : "opt");
    fsdp_unit_t **units = NULL;
    size_t nu = 0, np = 0;
    struct fsdp__opt_param *p = NULL;
    fsdp_named_list_t built = {0};
    size_t cap = 0;
    fsdp_shard_entry_t **tmp = calloc(sd->n + 1, sizeof *tmp);
    if (!tmp) return fsdp__unit_err(root, FSDP_ENOMEM, "%s: out of memory", fn);
    if ((rc = fsdp_units(root, &units, &nu)) < 0) goto out;
    if ((rc = fsdp__opt_params(root, units, nu, opt, &p, &np)) < 0) goto out;
    built.owned = true;
    /* hyper-parameters pass through: the optimizer's load checks them */
    for (size_t i = 0; i < sd->n && rc == 0; i++) {
        if (strncmp(sd->e[i].name, "group.", 6) != 0 || strchr(sd->e[i].name + 6, '.') == NULL)
            continue;
        bool dup = false; /* the same hyper-parameter from several ranks' lists */
        for (size_t k = 0; k < built.n && !dup; k++)
            dup = strcmp(built.names[k], sd->e[i].name) == 0;
        if (dup) continue;
        rc = named_push(root, &built, &cap, strdup(sd->e[i].name), fsdp_tensor_retain(sd->e[i].t));
    }
    for (size_t k = 0; k < np && rc == 0; k++) {
        struct check_arg ga = {root, sd, "group", (double)p[k].group, false, false, fn};
        if ((rc = each_fqn(&p[k], check_group, &ga)) < 0) break;
        for (size_t s = 0; s < N_OPT_STATES && rc == 0; s++) {
            fsdp_tensor_t *st = NULL;
            bool have = false;
            if (strcmp(OPT_STATES[s], "step") == 0) {
                struct check_arg sa = {root, sd, "step", 0, false, false, fn};
                rc = each_fqn(&p[k], check_step, &sa);
                if (rc < 0) break;
                if (sa.differ) {
                    rc = fsdp__unit_err(root, FSDP_EINVAL,
                                        "%s: the parameters of optimizer parameter '%s' have "
                                        "different step counts",
                                        fn, p[k].name);
                    break;
                }
                if (!sa.any) continue;
                rc = fsdp__tensor_new(root->ctx, fsdp_ctx_device(root->ctx), FSDP_DTYPE_F64, 0,
                                      NULL, FSDP_MEM_OTHER, &st);
                if (rc == 0) rc = fsdp_tensor_fill_(st, sa.want);
                have = rc == 0;
            } else {
                rc = build_state(root, sd, &p[k], OPT_STATES[s], tmp, &st, &have, fn);
            }
            if (rc < 0 || !have) {
                fsdp_tensor_release(st);
                continue;
            }
            rc = named_push(root, &built, &cap, fsdp__join_name(p[k].name, OPT_STATES[s]), st);
        }
    }
    /* the state tensors were built for this load: the optimizer takes them without a copy */
    if (rc == 0) rc = fsdp__optim_load_state_dict(opt, &built, true);
out:
    free(tmp);
    free(units);
    free(p);
    fsdp_named_list_free(&built);
    return rc;
}
