/* SPDX-License-Identifier: MIT */
/*
 * optim_full.c: the optimizer's FULL state dict keyed by parameter name (PyTorch's
 * optim_state_dict under FullStateDictConfig) and its load.
 *
 * The keys are those of the SHARDED one (optim_state.c); each "<fqn>.<state>" is one whole
 * tensor with the parameter's shape. Each unit gathers its own parameters' states over its shard
 * group (u->pg, what fsdp_unit_pg returns): the state of a flat parameter, or of the original
 * parameters with use_orig_params, is laid out like the unit's flat shard, so one all-gather of
 * a shard-sized buffer per state (and dtype) puts every parameter's state at its place in the
 * unsharded flat layout. An all-gather only moves bytes, so the result is bitwise what the ranks
 * hold (-0.0 and NaN payloads included). Replicas are never combined: a NO_SHARD unit holds
 * everything and gathers nothing, and under the hybrid strategies each shard group gathers a
 * whole copy by itself (the replicate group is not used).
 *
 * Invariant: every rank of a unit's group issues the same collectives in the same order. Per
 * unit with parameters, in pre-order: one all-gather of what each rank holds (which states, in
 * which dtype, the step counts), then one all-gather per state and dtype that some rank holds.
 * Every decision between them (what to gather, what is inconsistent) is taken from gathered
 * data only, so that all ranks take the same branch, errors included.
 *
 * The load hands the entries, each as one replicated piece covering its whole tensor, to
 * fsdp_load_sharded_optim_state_dict, after checking every name and shape against the model
 * on every rank alike (a rank that holds no part of a parameter would not look at its shape).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp/fsdp_impl.h"
#include "nn/nn_impl.h"
#include "tensor/tensor_impl.h"

/* The tensor states: every one of fsdp__opt_states but "step" (its last). */
#define NS (FSDP__N_OPT_STATES - 1)
/* A rank's metadata, per parameter of a unit: the dtype + 1 of each tensor state it holds (0:
 * none), whether it holds a step count, the count's bits. */
#define MW (NS + 2)

static const char fn_sd[] = "fsdp_full_optim_state_dict";
static const char fn_load[] = "fsdp_load_full_optim_state_dict";

/* One unit's gathered state (kept only on the ranks that receive the dict). */
struct ustate {
    fsdp_tensor_t **t; /* [nparams * NS]: the whole state s of parameter i, or NULL */
    double *step;      /* [nparams] */
    bool *has_step;    /* [nparams] */
};

static void ustate_free(struct ustate *us, int nparams) {
    if (us->t)
        for (int i = 0; i < nparams * NS; i++)
            fsdp_tensor_release(us->t[i]);
    free(us->t);
    free(us->step);
    free(us->has_step);
    *us = (struct ustate){0};
}

/* The tensor "<name>.<state>" of the optimizer's own state dict, or NULL. */
static fsdp_tensor_t *osd_find(const fsdp_named_list_t *osd, const char *name, const char *state) {
    size_t nl = strlen(name);
    for (size_t i = 0; i < osd->n; i++) {
        const char *k = osd->names[i];
        if (strncmp(k, name, nl) == 0 && k[nl] == '.' && strcmp(k + nl + 1, state) == 0)
            return osd->tensors[i];
    }
    return NULL;
}

/* The world rank of rank r of u's layout (for messages). */
static int world_rank(const fsdp_unit_t *u, int r) {
    return u->layout.world == 1 ? fsdp_ctx_rank(u->ctx) : fsdp_pg_world_rank(u->pg, r);
}

/* *recv (layout.world times send's elements, on u->dev) = every rank's send in group order: an
 * all-gather over u's shard group, or send itself when the unit does not shard. */
static int gather(fsdp_unit_t *u, fsdp_tensor_t *send, fsdp_tensor_t **recv) {
    int world = u->layout.world;
    int64_t n = fsdp_tensor_numel(send);
    *recv = NULL;
    if (world == 1 || n == 0) {
        *recv = fsdp_tensor_retain(send);
        return FSDP_OK;
    }
    const int64_t shape[1] = {n * world};
    int rc = fsdp__tensor_new(u->ctx, u->dev, send->dt, 1, shape, FSDP_MEM_OTHER, recv);
    if (rc == 0)
        rc = fsdp_pg_all_gather(u->pg, fsdp_tensor_data(send), fsdp_tensor_data(*recv), (size_t)n,
                                send->dt, NULL);
    if (rc < 0) {
        rc = fsdp__unit_err(u, rc,
                            "%s: the all-gather of %lld elements per rank over group '%s' failed "
                            "(rank %d): %s",
                            fn_sd, (long long)n, fsdp_pg_name(u->pg), fsdp_ctx_rank(u->ctx),
                            fsdp_pg_last_error(u->pg));
        fsdp_tensor_release(*recv);
        *recv = NULL;
    }
    return rc;
}

/* A copy of src on dev (src's shape and dtype). */
static int copy_to(fsdp_ctx_t *ctx, fsdp_device_t *dev, fsdp_tensor_t *src, fsdp_tensor_t **out) {
    *out = NULL;
    if (src->dev == dev) return fsdp_tensor_clone(src, FSDP_MEM_OTHER, out);
    int rc = fsdp__tensor_new(ctx, dev, src->dt, src->ndim, src->shape, FSDP_MEM_OTHER, out);
    if (rc == 0) rc = fsdp__xcopy(*out, src);
    if (rc < 0) {
        fsdp_tensor_release(*out);
        *out = NULL;
    }
    return rc;
}

/* The metadata of every rank of u's group (*all: malloc'ed, layout.world rows of nparams *
 * MW) from this rank's (mine). */
static int gather_meta(fsdp_unit_t *u, const int64_t *mine, int64_t **all) {
    size_t n = (size_t)u->nparams * MW, world = (size_t)u->layout.world;
    const int64_t shape[1] = {(int64_t)n};
    fsdp_tensor_t *send = NULL, *recv = NULL;
    *all = malloc(n * world * sizeof **all);
    if (!*all) return fsdp__unit_err(u, FSDP_ENOMEM, "%s: out of memory", fn_sd);
    int rc = fsdp__tensor_new(u->ctx, u->dev, FSDP_DTYPE_I64, 1, shape, FSDP_MEM_OTHER, &send);
    if (rc == 0) rc = fsdp_tensor_copy_from_host(send, mine, n * sizeof *mine);
    if (rc == 0) rc = gather(u, send, &recv);
    if (rc == 0) rc = fsdp_tensor_to_host(recv, *all, n * world * sizeof **all);
    fsdp_tensor_release(send);
    fsdp_tensor_release(recv);
    return rc;
}

/* The state s of parameter i in some rank's metadata: the dtype code every rank that holds
 * elements of it agrees on (0: no rank has it), or FSDP_EINVAL naming the parameter, the ranks
 * and the sizes. */
static int state_code(fsdp_unit_t *u, const int64_t *all, int i, int s, int64_t *code) {
    size_t row = (size_t)u->nparams * MW;
    int from = -1;
    *code = 0;
    for (int r = 0; r < u->layout.world; r++)
        if (all[(size_t)r * row + (size_t)i * MW + s] != 0) {
            *code = all[(size_t)r * row + (size_t)i * MW + s];
            from = r;
            break;
        }
    if (*code == 0) return FSDP_OK;
    for (int r = 0; r < u->layout.world; r++) {
        fsdp__shard_info_t sh;
        fsdp__layout_shard_info(&u->layout, i, r, &sh);
        int64_t c = all[(size_t)r * row + (size_t)i * MW + s];
        if (sh.numel_in_shard == 0 || c == *code) continue;
        char *fqn = fsdp__join_name(u->fqn, u->params[i].fqn);
        int rc = fsdp__unit_err(
            u, FSDP_EINVAL,
            "%s: '%s.%s': rank %d holds %lld of its %lld elements but %s, while rank %d holds it "
            "in %s",
            fn_sd, fqn ? fqn : u->params[i].fqn, fsdp__opt_states[s], world_rank(u, r),
            (long long)sh.numel_in_shard, (long long)u->layout.numel[i],
            c == 0 ? "no such state" : fsdp_dtype_name((fsdp_dtype_t)(c - 1)), world_rank(u, from),
            fsdp_dtype_name((fsdp_dtype_t)(*code - 1)));
        free(fqn);
        return rc;
    }
    return FSDP_OK;
}

/* Parameter i's step count from the metadata: a rank holding elements of it first; ranks that
 * hold elements must agree. */
static int step_of(fsdp_unit_t *u, const int64_t *all, int i, struct ustate *us) {
    size_t row = (size_t)u->nparams * MW;
    int from = -1;
    bool from_holds = false;
    double v = 0;
    for (int r = 0; r < u->layout.world; r++) {
        const int64_t *m = &all[(size_t)r * row + (size_t)i * MW];
        if (!m[NS]) continue;
        fsdp__shard_info_t sh;
        fsdp__layout_shard_info(&u->layout, i, r, &sh);
        double x;
        memcpy(&x, &m[NS + 1], sizeof x);
        bool holds = sh.numel_in_shard > 0;
        if (from >= 0 && from_holds && holds && memcmp(&x, &v, sizeof x) != 0) {
            char *fqn = fsdp__join_name(u->fqn, u->params[i].fqn);
            int rc = fsdp__unit_err(
                u, FSDP_EINVAL, "%s: '%s.step': rank %d counts %g steps but rank %d counts %g",
                fn_sd, fqn ? fqn : u->params[i].fqn, world_rank(u, from), v, world_rank(u, r), x);
            free(fqn);
            return rc;
        }
        if (from < 0 || (holds && !from_holds)) {
            from = r;
            from_holds = holds;
            v = x;
        }
    }
    us->has_step[i] = from >= 0;
    us->step[i] = v;
    return FSDP_OK;
}

/* Gathers the state of every parameter of u that opt holds; with keep, into us (on dev). */
static int gather_unit(fsdp_unit_t *u, const struct fsdp__opt_param *p, size_t np,
                       const fsdp_named_list_t *osd, bool keep, fsdp_device_t *dev,
                       struct ustate *us) {
    int n = u->nparams, rc = FSDP_OK;
    const struct fsdp__opt_param **cover = calloc((size_t)n, sizeof *cover);
    int64_t *mine = calloc((size_t)n * MW, sizeof *mine), *all = NULL, *codes = NULL;
    fsdp_tensor_t **st = calloc((size_t)n * NS, sizeof *st); /* borrowed from osd */
    us->t = calloc((size_t)n * NS, sizeof *us->t);
    us->step = calloc((size_t)n, sizeof *us->step);
    us->has_step = calloc((size_t)n, sizeof *us->has_step);
    codes = calloc((size_t)n, sizeof *codes);
    if (!cover || !mine || !st || !us->t || !us->step || !us->has_step || !codes) {
        rc = fsdp__unit_err(u, FSDP_ENOMEM, "%s: out of memory", fn_sd);
        goto out;
    }
    for (size_t k = 0; k < np; k++) {
        if (p[k].u != u) continue;
        for (int i = 0; i < n; i++)
            if (p[k].index < 0 || p[k].index == i) cover[i] = &p[k];
    }
    for (int i = 0; i < n; i++) {
        if (!cover[i]) continue;
        for (int s = 0; s < NS; s++) {
            st[i * NS + s] = osd_find(osd, cover[i]->name, fsdp__opt_states[s]);
            if (st[i * NS + s]) mine[i * MW + s] = (int64_t)st[i * NS + s]->dt + 1;
        }
        fsdp_tensor_t *step = osd_find(osd, cover[i]->name, "step");
        double v = 0;
        if (step && (rc = fsdp_tensor_item(step, 0, &v)) < 0) goto out;
        mine[i * MW + NS] = step != NULL;
        memcpy(&mine[i * MW + NS + 1], &v, sizeof v);
    }
    if ((rc = gather_meta(u, mine, &all)) < 0) goto out;
    for (int i = 0; i < n && rc == 0; i++)
        rc = step_of(u, all, i, us);
    for (int s = 0; s < NS && rc == 0; s++) {
        for (int i = 0; i < n && rc == 0; i++)
            rc = state_code(u, all, i, s, &codes[i]);
        /* one gather per dtype that state s comes in (one, unless parameters differ) */
        for (int first = 0; first < n && rc == 0; first++) {
            int64_t c = codes[first];
            if (c == 0) continue;
            fsdp_dtype_t dt = (fsdp_dtype_t)(c - 1);
            fsdp_tensor_t *send = NULL, *recv = NULL;
            rc = fsdp__zeros_on(u, u->dev, dt, u->layout.shard_numel, FSDP_MEM_OTHER, &send);
            for (int i = first; i < n && rc == 0; i++) {
                const fsdp__shard_info_t *sh = &u->params[i].sh;
                fsdp_tensor_t *src_t = st[i * NS + s];
                if (codes[i] != c || !src_t || sh->numel_in_shard == 0) continue;
                fsdp_tensor_t *a = NULL, *b = NULL;
                /* a flat parameter's state is laid out like the shard; an original one's is
                 * its part alone */
                int64_t off = cover[i]->index < 0 ? sh->offset_in_shard : 0;
                if (off + sh->numel_in_shard > fsdp_tensor_numel(src_t))
                    rc = fsdp__unit_err(u, FSDP_EINTERNAL,
                                        "%s: the '%s' state of '%s' has %lld elements, not the "
                                        "%lld of this rank's part (rank %d)",
                                        fn_sd, fsdp__opt_states[s], cover[i]->name,
                                        (long long)fsdp_tensor_numel(src_t),
                                        (long long)(off + sh->numel_in_shard),
                                        fsdp_ctx_rank(u->ctx));
                if (rc == 0) rc = fsdp__view1d(src_t, off, sh->numel_in_shard, &a);
                if (rc == 0) rc = fsdp__view1d(send, sh->offset_in_shard, sh->numel_in_shard, &b);
                if (rc == 0) rc = fsdp__xcopy(b, a);
                fsdp_tensor_release(a);
                fsdp_tensor_release(b);
            }
            if (rc == 0) rc = gather(u, send, &recv);
            for (int i = first; i < n && rc == 0; i++) {
                if (codes[i] != c) continue;
                codes[i] = 0; /* done */
                if (!keep) continue;
                struct fsdp__param *q = &u->params[i];
                fsdp_tensor_t *whole = NULL, *v = NULL, *d = NULL;
                rc = fsdp__tensor_new(u->ctx, dev, dt, q->ndim, q->shape, FSDP_MEM_OTHER, &whole);
                if (rc == 0) rc = fsdp__view1d(recv, u->layout.offset[i], u->layout.numel[i], &v);
                if (rc == 0) rc = fsdp__view1d(whole, 0, u->layout.numel[i], &d);
                if (rc == 0) rc = fsdp__xcopy(d, v);
                fsdp_tensor_release(v);
                fsdp_tensor_release(d);
                if (rc == 0)
                    us->t[i * NS + s] = whole;
                else
                    fsdp_tensor_release(whole);
            }
            fsdp_tensor_release(send);
            fsdp_tensor_release(recv);
        }
    }
out:
    free(cover);
    free(mine);
    free(all);
    free(st);
    free(codes);
    return rc;
}

/* Appends (name, t) to out, taking t's reference (released on failure) and freeing name. */
static int push(fsdp_unit_t *root, fsdp_named_list_t *out, size_t *cap, char *name,
                fsdp_tensor_t *t) {
    int rc = name && t ? fsdp__list_push(out, cap, name, t, NULL) : FSDP_ENOMEM;
    free(name);
    fsdp_tensor_release(t);
    if (rc < 0) return fsdp__unit_err(root, rc, "%s: out of memory", fn_sd);
    return FSDP_OK;
}

/* An f64 scalar holding v on dev. */
static int scalar(fsdp_unit_t *root, fsdp_device_t *dev, double v, fsdp_tensor_t **out) {
    int rc = fsdp__tensor_new(root->ctx, dev, FSDP_DTYPE_F64, 0, NULL, FSDP_MEM_OTHER, out);
    if (rc == 0) rc = fsdp_tensor_fill_(*out, v);
    if (rc < 0) {
        fsdp_tensor_release(*out);
        *out = NULL;
    }
    return rc;
}

/* The entries of optimizer parameter p, in the SHARDED dict's order: every covered model
 * parameter's group, then state by state. */
static int emit_param(fsdp_unit_t *root, const struct fsdp__opt_param *p,
                      const fsdp_named_list_t *osd, struct ustate *us, bool offload,
                      fsdp_named_list_t *out, size_t *cap) {
    fsdp_unit_t *u = p->u;
    int lo = 0, hi = 1, rc = FSDP_OK;
    if (u) {
        lo = p->index < 0 ? 0 : p->index;
        hi = p->index < 0 ? u->nparams : p->index + 1;
    }
    fsdp_device_t *sdev = offload ? fsdp__host_device(root) : fsdp_ctx_device(root->ctx);
    for (int pass = -1; pass < FSDP__N_OPT_STATES && rc == 0; pass++) {
        const char *state = pass < 0 ? "group" : fsdp__opt_states[pass];
        bool is_step = pass == FSDP__N_OPT_STATES - 1;
        for (int i = lo; i < hi && rc == 0; i++) {
            char *fqn = u ? fsdp__join_name(u->fqn, u->params[i].fqn) : strdup(p->name);
            char *key = fqn ? fsdp__join_name(fqn, state) : NULL;
            free(fqn);
            fsdp_tensor_t *t = NULL;
            if (!key) return fsdp__unit_err(root, FSDP_ENOMEM, "%s: out of memory", fn_sd);
            if (pass < 0) {
                rc = scalar(root, sdev, (double)p->group, &t);
            } else if (!u) { /* a parameter no unit manages: every rank holds it whole */
                fsdp_tensor_t *src = osd_find(osd, p->name, state);
                if (src && is_step) {
                    double v = 0;
                    rc = fsdp_tensor_item(src, 0, &v);
                    if (rc == 0) rc = scalar(root, sdev, v, &t);
                } else if (src) {
                    rc = copy_to(root->ctx, offload ? sdev : src->dev, src, &t);
                }
            } else if (is_step) {
                if (us->has_step[i]) rc = scalar(root, sdev, us->step[i], &t);
            } else {
                t = us->t[i * NS + pass]; /* moved into the list */
                us->t[i * NS + pass] = NULL;
            }
            if (rc < 0 || !t) {
                free(key);
                fsdp_tensor_release(t);
                continue;
            }
            rc = push(root, out, cap, key, t);
        }
    }
    return rc;
}

int fsdp_full_optim_state_dict(fsdp_unit_t *root, const fsdp_optim_t *opt,
                               const fsdp_full_state_dict_options_t *o, fsdp_named_list_t *out) {
    if (out) *out = (fsdp_named_list_t){0};
    int rc = fsdp__sd_check_root(root, fn_sd);
    if (rc < 0) return rc;
    if (!out || !opt)
        return fsdp__unit_err(root, FSDP_EINVAL, "%s: %s is NULL", fn_sd, out ? "opt" : "out");
    if ((rc = fsdp__abi_check(root->ctx, fn_sd, "o", o, &fsdp__full_sd_options_abi)) < 0) return rc;
    fsdp_full_state_dict_options_t def;
    if (!o) {
        fsdp_full_state_dict_options_init(&def);
        o = &def;
    }
    /* rank 0 of the world (under the hybrid strategies, not every shard group's rank 0) */
    bool keep = !o->rank0_only || fsdp_ctx_rank(root->ctx) == 0;
    fsdp_unit_t **units = NULL;
    size_t nu = 0, np = 0, cap = 0;
    struct fsdp__opt_param *p = NULL;
    struct ustate *us = NULL;
    fsdp_named_list_t osd = {0};
    if ((rc = fsdp_units(root, &units, &nu)) < 0) return rc;
    if ((rc = fsdp__opt_params(root, units, nu, opt, &p, &np)) < 0) goto out;
    if ((rc = fsdp_optim_state_dict(opt, &osd)) < 0) goto out;
    us = calloc(nu + 1, sizeof *us);
    if (!us) {
        rc = fsdp__unit_err(root, FSDP_ENOMEM, "%s: out of memory", fn_sd);
        goto out;
    }
    if (o->offload_to_cpu && !fsdp__host_device(root)) {
        rc = fsdp__unit_err(root, FSDP_ENOMEM,
                            "%s: offload_to_cpu: the context's CPU device could not be made",
                            fn_sd);
        goto out;
    }
    for (size_t i = 0; i < nu && rc == 0; i++) {
        fsdp_unit_t *u = units[i];
        if (u->nparams == 0) continue;
        rc = gather_unit(u, p, np, &osd, keep, o->offload_to_cpu ? fsdp__host_device(u) : u->dev,
                         &us[i]);
    }
    if (rc < 0 || !keep) goto out;
    out->owned = true;
    /* the hyper-parameters, "group.<g>.<hp>", as the optimizer's own state dict */
    fsdp_device_t *host = fsdp__host_device(root);
    for (size_t i = 0; i < osd.n && rc == 0; i++) {
        if (strncmp(osd.names[i], "group.", 6) != 0) continue;
        fsdp_tensor_t *c = NULL;
        rc = copy_to(root->ctx, o->offload_to_cpu ? host : osd.tensors[i]->dev, osd.tensors[i], &c);
        if (rc == 0) rc = push(root, out, &cap, strdup(osd.names[i]), c);
    }
    for (size_t k = 0; k < np && rc == 0; k++) {
        size_t ui = 0;
        while (p[k].u && ui < nu && units[ui] != p[k].u)
            ui++;
        rc = emit_param(root, &p[k], &osd, p[k].u ? &us[ui] : NULL, o->offload_to_cpu, out, &cap);
    }
out:
    if (us)
        for (size_t i = 0; i < nu; i++)
            ustate_free(&us[i], units[i]->nparams);
    free(us);
    free(units);
    free(p);
    fsdp_named_list_free(&osd);
    if (rc < 0) {
        if (!strstr(fsdp_ctx_last_error(root->ctx), fn_sd))
            fsdp__unit_err(root, rc, "%s: %s", fn_sd, fsdp_ctx_last_error(root->ctx));
        fsdp_named_list_free(out);
        *out = (fsdp_named_list_t){0};
    }
    return rc;
}

/* ---- the load -------------------------------------------------------------------------------- */

/* A model parameter's name and shape, for checking a full dict's entries. */
struct known {
    char *fqn;
    int ndim;
    const int64_t *shape;
};

static void known_free(struct known *k, size_t n) {
    for (size_t i = 0; i < n; i++)
        free(k[i].fqn);
    free(k);
}

/* Every parameter of the model under the names the dict uses: each unit's parameters (a tied
 * one under its first name), then the parameters opt holds that no unit manages (under opt's
 * names), then the module's other parameters no unit manages. */
static int known_params(fsdp_unit_t *root, fsdp_unit_t *const *units, size_t nu,
                        const struct fsdp__opt_param *p, size_t np, const fsdp_named_list_t *mp,
                        struct known **out, size_t *n) {
    size_t cap = np + mp->n + 1;
    for (size_t i = 0; i < nu; i++)
        cap += (size_t)units[i]->nparams;
    struct known *k = calloc(cap, sizeof *k);
    if (!k) return fsdp__unit_err(root, FSDP_ENOMEM, "%s: out of memory", fn_load);
    size_t m = 0;
    int rc = FSDP_OK;
    for (size_t i = 0; i < nu && rc == 0; i++)
        for (int j = 0; j < units[i]->nparams && rc == 0; j++) {
            struct fsdp__param *q = &units[i]->params[j];
            k[m] = (struct known){fsdp__join_name(units[i]->fqn, q->fqn), q->ndim, q->shape};
            if (!k[m++].fqn) rc = FSDP_ENOMEM;
        }
    for (size_t i = 0; i < np && rc == 0; i++) {
        if (p[i].u) continue;
        k[m] = (struct known){strdup(p[i].name), p[i].t->ndim, p[i].t->shape};
        if (!k[m++].fqn) rc = FSDP_ENOMEM;
    }
    for (size_t i = 0; i < mp->n && rc == 0; i++) {
        bool managed = false;
        for (size_t j = 0; j < nu && !managed; j++)
            managed = units[j]->flat && fsdp_tensor_same_storage(units[j]->flat, mp->tensors[i]);
        if (managed) continue;
        k[m] = (struct known){strdup(mp->names[i]), mp->tensors[i]->ndim, mp->tensors[i]->shape};
        if (!k[m++].fqn) rc = FSDP_ENOMEM;
    }
    *out = k;
    *n = m;
    if (rc < 0) return fsdp__unit_err(root, rc, "%s: out of memory", fn_load);
    return FSDP_OK;
}

/* Checks one entry's name and shape: "group.<g>.<hp>" (the optimizer checks those) or
 * "<fqn>.<state>" of a parameter of the model, with the parameter's shape (scalars for step and
 * group). */
static int check_entry(fsdp_unit_t *root, const struct known *k, size_t nk, const char *name,
                       const fsdp_tensor_t *t) {
    if (!t) return fsdp__unit_err(root, FSDP_EINVAL, "%s: entry '%s' has no tensor", fn_load, name);
    if (strncmp(name, "group.", 6) == 0 && strchr(name + 6, '.')) return FSDP_OK;
    const char *dot = strrchr(name, '.');
    int s = -1;
    for (int i = 0; dot && i < FSDP__N_OPT_STATES && s < 0; i++)
        if (strcmp(dot + 1, fsdp__opt_states[i]) == 0) s = i;
    bool is_group = dot && strcmp(dot + 1, "group") == 0;
    if (s < 0 && !is_group)
        return fsdp__unit_err(root, FSDP_EINVAL,
                              "%s: unexpected entry '%s' (not '<parameter>.<state>', "
                              "'<parameter>.group' or 'group.<g>.<hyper-parameter>')",
                              fn_load, name);
    size_t fl = (size_t)(dot - name);
    const struct known *q = NULL;
    for (size_t i = 0; i < nk && !q; i++)
        if (strlen(k[i].fqn) == fl && strncmp(k[i].fqn, name, fl) == 0) q = &k[i];
    if (!q)
        return fsdp__unit_err(root, FSDP_EINVAL,
                              "%s: unexpected entry '%s': the model has no parameter '%.*s'",
                              fn_load, name, (int)fl, name);
    char a[200], b[200] = "";
    if (is_group || s == FSDP__N_OPT_STATES - 1) {
        if (fsdp_tensor_numel(t) != 1)
            return fsdp__unit_err(root, FSDP_EINVAL, "%s: '%s' is %s, not a scalar", fn_load, name,
                                  fsdp_tensor_describe(t, a, sizeof a));
        return FSDP_OK;
    }
    bool same = t->ndim == q->ndim;
    for (int d = 0; same && d < q->ndim; d++)
        same = t->shape[d] == q->shape[d];
    if (same) return FSDP_OK;
    size_t off = 0;
    for (int d = 0; d < q->ndim && off < sizeof b; d++)
        off += (size_t)snprintf(b + off, sizeof b - off, "%s%lld", d ? ", " : "",
                                (long long)q->shape[d]);
    return fsdp__unit_err(
        root, FSDP_EINVAL, "%s: '%s' is %s but parameter '%s' has shape [%s] (rank %d)", fn_load,
        name, fsdp_tensor_describe(t, a, sizeof a), q->fqn, b, fsdp_ctx_rank(root->ctx));
}

int fsdp_load_full_optim_state_dict(fsdp_unit_t *root, fsdp_optim_t *opt,
                                    const fsdp_named_list_t *sd) {
    int rc = fsdp__sd_check_root(root, fn_load);
    if (rc < 0) return rc;
    if (!opt || !sd || (sd->n > 0 && (!sd->names || !sd->tensors)))
        return fsdp__unit_err(root, FSDP_EINVAL, "%s: %s is NULL", fn_load, opt ? "sd" : "opt");
    fsdp_unit_t **units = NULL;
    size_t nu = 0, np = 0, nk = 0;
    struct fsdp__opt_param *p = NULL;
    struct known *k = NULL;
    fsdp_named_list_t mp = {0};
    fsdp_shard_list_t pieces = {0};
    if ((rc = fsdp_units(root, &units, &nu)) < 0) return rc;
    if ((rc = fsdp__opt_params(root, units, nu, opt, &p, &np)) < 0) goto out;
    if ((rc = fsdp_module_named_params(root->module, false, &mp)) < 0) goto out;
    if ((rc = known_params(root, units, nu, p, np, &mp, &k, &nk)) < 0) goto out;
    for (size_t i = 0; i < sd->n && rc == 0; i++)
        rc = check_entry(root, k, nk, sd->names[i], sd->tensors[i]);
    if (rc < 0) goto out;
    /* each entry one replicated piece: the whole tensor at offset 0 */
    pieces.e = calloc(sd->n + 1, sizeof *pieces.e);
    if (!pieces.e) {
        rc = fsdp__unit_err(root, FSDP_ENOMEM, "%s: out of memory", fn_load);
        goto out;
    }
    for (size_t i = 0; i < sd->n; i++) {
        fsdp_shard_entry_t *e = &pieces.e[pieces.n++];
        const fsdp_tensor_t *t = sd->tensors[i];
        e->name = sd->names[i]; /* borrowed: not freed below */
        e->t = sd->tensors[i];
        e->ndim = t->ndim;
        if (t->ndim > 0) memcpy(e->shape, t->shape, (size_t)t->ndim * sizeof *t->shape);
        e->replicated = true;
    }
    rc = fsdp_load_sharded_optim_state_dict(root, opt, &pieces);
    if (rc < 0) {
        /* the sharded load's message, as this function's */
        static const char fn_sh[] = "fsdp_load_sharded_optim_state_dict: ";
        char msg[FSDP_ERR_LEN];
        const char *e = fsdp_ctx_last_error(root->ctx), *at = e, *next;
        while ((next = strstr(at, fn_sh)) != NULL)
            at = next + strlen(fn_sh);
        snprintf(msg, sizeof msg, "%s", at);
        rc = fsdp__unit_err(root, rc, "%s: %s", fn_load, msg);
    }
out:
    free(pieces.e);
    free(units);
    free(p);
    known_free(k, nk);
    fsdp_named_list_free(&mp);
    return rc;
}
