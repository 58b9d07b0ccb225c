/* SPDX-License-Identifier: MIT */
/*
 * optim_state.c: the optimizer state dict (fsdp_optim_state_dict, fsdp_optim_load_state_dict).
 *
 * Keys follow PyTorch's layout flattened into names: "group.<g>.<hyper-parameter>" for each
 * group's hyper-parameters (every one the optimizer's kind uses, as f64 scalars) and
 * "<parameter name>.<slot>" for each parameter with state (its buffers, cloned, and Adam's
 * "step"). Loading builds a complete plan first (every key parsed, every tensor checked, every
 * buffer copied into new FSDP_MEM_OPTIM tensors) and only then swaps the new state in, so a
 * failed load leaves the optimizer as it was; its error lists every missing, unexpected and
 * invalid entry at once.
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "optim/optim_impl.h"
#include "tensor/tensor_impl.h"

/* The key suffix of each state entry, by slot. */
static const char *const slot_names[FSDP__OPTIM_NSLOT] = {"momentum_buffer", "exp_avg",
                                                          "exp_avg_sq", "max_exp_avg_sq", "step"};

#define K_SGD 1u
#define K_ADAM 2u

/* The hyper-parameters a state dict carries, in the order it lists them. */
static const struct hp_desc {
    const char *name;
    unsigned kinds; /* K_SGD and/or K_ADAM */
    size_t off;     /* offset of the double or bool field in struct fsdp__hparams */
    bool flag;      /* a bool field, saved as 0 or 1 */
} hp_table[] = {
    {"lr", K_SGD | K_ADAM, offsetof(struct fsdp__hparams, lr), false},
    {"momentum", K_SGD, offsetof(struct fsdp__hparams, momentum), false},
    {"dampening", K_SGD, offsetof(struct fsdp__hparams, dampening), false},
    {"beta1", K_ADAM, offsetof(struct fsdp__hparams, beta1), false},
    {"beta2", K_ADAM, offsetof(struct fsdp__hparams, beta2), false},
    {"eps", K_ADAM, offsetof(struct fsdp__hparams, eps), false},
    {"weight_decay", K_SGD | K_ADAM, offsetof(struct fsdp__hparams, weight_decay), false},
    {"nesterov", K_SGD, offsetof(struct fsdp__hparams, nesterov), true},
    {"amsgrad", K_ADAM, offsetof(struct fsdp__hparams, amsgrad), true},
};
#define NHP (sizeof hp_table / sizeof hp_table[0])

/* ---- hyper-parameters as state-dict entries ------------------------------------------------- */

static unsigned kind_mask(fsdp_optim_kind_t kind) {
    return kind == FSDP_OPTIM_SGD ? K_SGD : K_ADAM;
}

static double hp_get(const struct fsdp__hparams *h, const struct hp_desc *d) {
    const char *base = (const char *)h + d->off;
    if (d->flag) return *(const bool *)(const void *)base ? 1.0 : 0.0;
    return *(const double *)(const void *)base;
}

static void hp_set(struct fsdp__hparams *h, const struct hp_desc *d, double v) {
    char *base = (char *)h + d->off;
    if (d->flag)
        *(bool *)(void *)base = v != 0.0;
    else
        *(double *)(void *)base = v;
}

/* ---- state dict: saving ---------------------------------------------------------------------- */

static bool has_state(const fsdp_optim_t *opt, const struct fsdp__oparam *p) {
    return p->buf[opt->kind == FSDP_OPTIM_SGD ? FSDP__OPTIM_MOMENTUM : FSDP__OPTIM_EXP_AVG] != NULL;
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
    return fsdp__optim_state_dict(opt, true, out);
}

int fsdp__optim_state_dict(const fsdp_optim_t *opt, bool copy, fsdp_named_list_t *out) {
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
        const struct fsdp__oparam *p = &opt->params[i];
        if (!has_state(opt, p)) continue;
        count += opt->kind == FSDP_OPTIM_SGD ? 1 : 1 + FSDP__OPTIM_NBUF - 1;
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
        const struct fsdp__oparam *p = &opt->params[i];
        if (!has_state(opt, p)) continue;
        if (opt->kind != FSDP_OPTIM_SGD) {
            fsdp_tensor_t *t = NULL;
            FSDP_TRY(rc, fail, scalar_new(ctx, (double)p->step, &t));
            FSDP_TRY(rc, fail, list_put(&l, key_join(p->name, 0, slot_names[FSDP__OPTIM_STEP]), t));
        }
        for (int s = 0; s < FSDP__OPTIM_NBUF; s++) {
            if (!p->buf[s]) continue;
            fsdp_tensor_t *t = NULL;
            if (copy)
                FSDP_TRY(rc, fail, fsdp_tensor_clone(p->buf[s], FSDP_MEM_OTHER, &t));
            else
                t = fsdp_tensor_retain(p->buf[s]);
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
    for (int i = 0; i < FSDP__OPTIM_NSLOT; i++) {
        const bool sgd_slot = i == FSDP__OPTIM_MOMENTUM;
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
    struct fsdp__hparams *hp; /* ngroups: the groups' new hyper-parameters */
    bool *hp_seen;            /* ngroups * NHP */
    size_t *entry; /* nparams * FSDP__OPTIM_NSLOT: index of the entry in sd, SIZE_MAX when absent */
    int64_t *step; /* nparams */
    fsdp_tensor_t **made; /* nparams * FSDP__OPTIM_NBUF: the new buffers */
};

static void plan_free(struct load_plan *pl, size_t nparams) {
    if (pl->made)
        for (size_t i = 0; i < nparams * FSDP__OPTIM_NBUF; i++)
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
    if (pl->entry[pi * FSDP__OPTIM_NSLOT + (size_t)slot] != SIZE_MAX) {
        text_add(bad, "'%s' appears twice", key);
        return;
    }
    pl->entry[pi * FSDP__OPTIM_NSLOT + (size_t)slot] = e;
    if (!t) {
        text_add(bad, "'%s' has no tensor", key);
        return;
    }
    if (slot == FSDP__OPTIM_STEP) {
        if (!read_scalar(t, key, bad, &v)) return;
        if (!(v >= 0.0 && v <= 9007199254740992.0) || v != floor(v)) {
            text_add(bad, "'%s' is %g (a step count is a non-negative integer)", key, v);
            return;
        }
        pl->step[pi] = (int64_t)v;
        return;
    }
    const fsdp_tensor_t *p = opt->params[pi].t;
    if (!fsdp_dtype_is_float(t->dt) || !fsdp__optim_same_shape(t, p)) {
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
        if (all && !fsdp__optim_hp_valid(opt->kind, &pl->hp[g], why, sizeof why))
            text_add(bad, "group %d: %s", g, why);
    }
    for (size_t i = 0; i < opt->nparams; i++) {
        const struct fsdp__oparam *p = &opt->params[i];
        const size_t *en = &pl->entry[i * FSDP__OPTIM_NSLOT];
        bool any = false;
        for (int s = 0; s < FSDP__OPTIM_NSLOT; s++)
            any = any || en[s] != SIZE_MAX;
        if (!any || opt->kind == FSDP_OPTIM_SGD) continue;
        /* max_exp_avg_sq is kept without amsgrad (PyTorch keeps it when amsgrad is turned
         * off), so it is only required with amsgrad. */
        const bool amsgrad = pl->hp[p->group].amsgrad;
        for (int s = FSDP__OPTIM_EXP_AVG; s < FSDP__OPTIM_NSLOT; s++) {
            const bool need = s != FSDP__OPTIM_MAX_EXP_AVG_SQ || amsgrad;
            if (need && en[s] == SIZE_MAX) text_add(missing, "'%s.%s'", p->name, slot_names[s]);
        }
    }
}

/* Copies every buffer the plan loads into new FSDP_MEM_OPTIM tensors; with adopt, an entry that
 * already is such a tensor (the parameter's dtype, device and shape, contiguous) is taken as it
 * is. */
static int plan_make(const fsdp_optim_t *opt, const fsdp_named_list_t *sd, bool adopt,
                     struct load_plan *pl) {
    for (size_t i = 0; i < opt->nparams; i++) {
        const fsdp_tensor_t *p = opt->params[i].t;
        for (int s = 0; s < FSDP__OPTIM_NBUF; s++) {
            const size_t e = pl->entry[i * FSDP__OPTIM_NSLOT + (size_t)s];
            if (e == SIZE_MAX) continue;
            fsdp_tensor_t **dst = &pl->made[i * FSDP__OPTIM_NBUF + (size_t)s];
            fsdp_tensor_t *src = sd->tensors[e];
            if (adopt && src->dt == p->dt && src->dev == p->dev && src->ndim == p->ndim &&
                memcmp(src->shape, p->shape, sizeof(int64_t) * (size_t)p->ndim) == 0 &&
                fsdp_tensor_is_contiguous(src)) {
                *dst = fsdp_tensor_retain(src);
                continue;
            }
            int rc =
                fsdp__tensor_new(p->ctx, p->dev, p->dt, p->ndim, p->shape, FSDP_MEM_OPTIM, dst);
            if (rc == FSDP_OK) rc = fsdp_tensor_copy_(*dst, sd->tensors[e]);
            if (rc < 0) return rc;
        }
    }
    return FSDP_OK;
}

int fsdp_optim_load_state_dict(fsdp_optim_t *opt, const fsdp_named_list_t *sd) {
    return fsdp__optim_load_state_dict(opt, sd, false);
}

int fsdp__optim_load_state_dict(fsdp_optim_t *opt, const fsdp_named_list_t *sd, bool adopt) {
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
    pl.entry = malloc((np * FSDP__OPTIM_NSLOT + 1) * sizeof *pl.entry);
    pl.step = calloc(np + 1, sizeof *pl.step);
    pl.made = calloc(np * FSDP__OPTIM_NBUF + 1, sizeof *pl.made);
    if (!pl.hp || !pl.hp_seen || !pl.entry || !pl.step || !pl.made) {
        rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
        goto out;
    }
    for (size_t g = 0; g < ng; g++)
        pl.hp[g] = opt->groups[g].hp;
    for (size_t i = 0; i < np * FSDP__OPTIM_NSLOT; i++)
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
    rc = plan_make(opt, sd, adopt, &pl);
    if (rc < 0) {
        fsdp__ctx_err(ctx, rc, "%s: copying the state failed: %s", fn, fsdp_ctx_last_error(ctx));
        goto out;
    }

    /* Nothing can fail from here on: swap the new state in. */
    for (size_t g = 0; g < ng; g++)
        opt->groups[g].hp = pl.hp[g];
    for (size_t i = 0; i < np; i++) {
        struct fsdp__oparam *p = &opt->params[i];
        fsdp__optim_drop_buffers(p);
        for (int s = 0; s < FSDP__OPTIM_NBUF; s++) {
            p->buf[s] = pl.made[i * FSDP__OPTIM_NBUF + (size_t)s];
            pl.made[i * FSDP__OPTIM_NBUF + (size_t)s] = NULL;
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
