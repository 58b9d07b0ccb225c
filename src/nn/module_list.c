/* SPDX-License-Identifier: MIT */
/*
 * module_list.c: listings of a module tree: named parameters, buffers, state entries and
 * modules, parameter aliases, and visiting every module.
 *
 * Listings walk the tree in pre-order (a module's own entries in registration order, then its
 * children). Without aliases a shared module and a shared tensor are visited once, under the
 * first path that reaches them, as PyTorch's named_parameters() does; with aliases every path
 * and name is listed, as PyTorch's state_dict() does. Pointer identity decides what is shared.
 */
#include <stdlib.h>
#include <string.h>

#include "nn/nn_impl.h"

/* "prefix.name", or name when prefix is empty. NULL when out of memory. */
static char *join_name(const char *prefix, const char *name) {
    size_t a = strlen(prefix), b = strlen(name);
    char *s = malloc(a + b + 2);
    if (!s) return NULL;
    if (a) {
        memcpy(s, prefix, a);
        s[a++] = '.';
    }
    memcpy(s + a, name, b + 1);
    return s;
}

/* A set of pointers (open addressing), for de-duplicating shared modules and tensors. */
struct ptrset {
    const void **slots;
    size_t cap, n;
};

static size_t ptr_hash(const void *p) {
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return (size_t)x;
}

/* 1 when p was added, 0 when it was there already, FSDP_ENOMEM. */
static int ptrset_add(struct ptrset *s, const void *p) {
    if ((s->n + 1) * 2 > s->cap) {
        size_t nc = s->cap ? s->cap * 2 : 32;
        const void **ns = calloc(nc, sizeof *ns);
        if (!ns) return FSDP_ENOMEM;
        for (size_t i = 0; i < s->cap; i++) {
            if (!s->slots[i]) continue;
            size_t j = ptr_hash(s->slots[i]) & (nc - 1);
            while (ns[j])
                j = (j + 1) & (nc - 1);
            ns[j] = s->slots[i];
        }
        free(s->slots);
        s->slots = ns;
        s->cap = nc;
    }
    size_t j = ptr_hash(p) & (s->cap - 1);
    while (s->slots[j]) {
        if (s->slots[j] == p) return 0;
        j = (j + 1) & (s->cap - 1);
    }
    s->slots[j] = p;
    s->n++;
    return 1;
}

static void ptrset_free(struct ptrset *s) {
    free(s->slots);
    s->slots = NULL;
    s->cap = s->n = 0;
}

/* ---- listings ------------------------------------------------------------------------------ */

void fsdp_named_list_free(fsdp_named_list_t *list) {
    if (!list) return;
    for (size_t i = 0; i < list->n; i++) {
        if (list->names) free(list->names[i]);
        if (list->owned && list->tensors) fsdp_tensor_release(list->tensors[i]);
    }
    free(list->names);
    free(list->tensors);
    free(list->modules);
    memset(list, 0, sizeof *list);
}

int fsdp__list_push(fsdp_named_list_t *list, size_t *cap, const char *name, fsdp_tensor_t *t,
                    fsdp_module_t *m) {
    if (list->n == *cap) {
        size_t nc = *cap ? *cap * 2 : 16;
        char **nn = realloc(list->names, nc * sizeof *nn);
        if (!nn) return FSDP_ENOMEM;
        list->names = nn;
        fsdp_tensor_t **nt = realloc(list->tensors, nc * sizeof *nt);
        if (!nt) return FSDP_ENOMEM;
        list->tensors = nt;
        fsdp_module_t **nm = realloc(list->modules, nc * sizeof *nm);
        if (!nm) return FSDP_ENOMEM;
        list->modules = nm;
        *cap = nc;
    }
    char *copy = strdup(name);
    if (!copy) return FSDP_ENOMEM;
    list->names[list->n] = copy;
    list->tensors[list->n] = list->owned ? fsdp_tensor_retain(t) : t;
    list->modules[list->n] = m;
    list->n++;
    return FSDP_OK;
}

struct lister {
    enum fsdp__list_what what;
    bool aliases;
    bool modules_only;
    fsdp_named_list_t *out;
    size_t cap;
    struct ptrset mods, tensors;
};

static int list_slots(struct lister *L, fsdp_module_t *m, const char *prefix,
                      const struct fsdp__slot *s, size_t n, bool persistent_only) {
    for (size_t i = 0; i < n; i++) {
        if (persistent_only && !s[i].persistent) continue;
        if (!L->aliases) {
            int r = ptrset_add(&L->tensors, s[i].t);
            if (r < 0) return r;
            if (r == 0) continue;
        }
        char *fqn = join_name(prefix, s[i].name);
        if (!fqn) return FSDP_ENOMEM;
        int rc = fsdp__list_push(L->out, &L->cap, fqn, s[i].t, m);
        free(fqn);
        if (rc < 0) return rc;
    }
    return FSDP_OK;
}

static int list_walk(struct lister *L, fsdp_module_t *m, const char *prefix) {
    int rc;
    if (!L->aliases) {
        rc = ptrset_add(&L->mods, m);
        if (rc <= 0) return rc;
    }
    if (L->modules_only) {
        FSDP_TRY(rc, out, fsdp__list_push(L->out, &L->cap, prefix, NULL, m));
    } else {
        if (L->what != FSDP__LIST_BUFFERS)
            FSDP_TRY(rc, out, list_slots(L, m, prefix, m->params, m->nparams, false));
        if (L->what != FSDP__LIST_PARAMS)
            FSDP_TRY(
                rc, out,
                list_slots(L, m, prefix, m->buffers, m->nbuffers, L->what == FSDP__LIST_STATE));
    }
    for (size_t i = 0; i < m->nchildren; i++) {
        char *p = join_name(prefix, m->children[i].name);
        if (!p) return FSDP_ENOMEM;
        rc = list_walk(L, m->children[i].m, p);
        free(p);
        if (rc < 0) return rc;
    }
    rc = FSDP_OK;
out:
    return rc;
}

static int run_listing(const fsdp_module_t *m, enum fsdp__list_what what, bool aliases,
                       bool modules_only, fsdp_named_list_t *out, const char *fn) {
    if (!out) return fsdp__ctx_err(m ? m->ctx : NULL, FSDP_EINVAL, "%s: out is NULL", fn);
    memset(out, 0, sizeof *out);
    if (!m) return fsdp__ctx_err(NULL, FSDP_EINVAL, "%s: module is NULL", fn);
    struct lister L = {what, aliases, modules_only, out, 0, {NULL, 0, 0}, {NULL, 0, 0}};
    int rc = list_walk(&L, (fsdp_module_t *)m, "");
    ptrset_free(&L.mods);
    ptrset_free(&L.tensors);
    if (rc < 0) {
        fsdp_named_list_free(out);
        return fsdp__module_err(m, rc, "%s: out of memory", fn);
    }
    if (modules_only) {
        free(out->tensors);
        out->tensors = NULL;
    }
    return FSDP_OK;
}

int fsdp__module_list(const fsdp_module_t *m, enum fsdp__list_what what, bool with_aliases,
                      fsdp_named_list_t *out) {
    return run_listing(m, what, with_aliases, false, out, "module listing");
}

int fsdp_module_named_params(const fsdp_module_t *m, bool with_aliases, fsdp_named_list_t *out) {
    return run_listing(m, FSDP__LIST_PARAMS, with_aliases, false, out, "fsdp_module_named_params");
}

int fsdp_module_named_buffers(const fsdp_module_t *m, bool with_aliases, fsdp_named_list_t *out) {
    return run_listing(m, FSDP__LIST_BUFFERS, with_aliases, false, out,
                       "fsdp_module_named_buffers");
}

int fsdp_module_named_modules(const fsdp_module_t *m, fsdp_named_list_t *out) {
    return run_listing(m, FSDP__LIST_PARAMS, false, true, out, "fsdp_module_named_modules");
}

int64_t fsdp_module_num_params(const fsdp_module_t *m) {
    fsdp_named_list_t l;
    int rc = fsdp_module_named_params(m, false, &l);
    if (rc < 0) return rc;
    int64_t n = 0;
    for (size_t i = 0; i < l.n; i++)
        n += fsdp_tensor_numel(l.tensors[i]);
    fsdp_named_list_free(&l);
    return n;
}

int fsdp_module_param_aliases(const fsdp_module_t *m, const fsdp_tensor_t *t,
                              fsdp_named_list_t *out) {
    if (!out) return fsdp__module_err(m, FSDP_EINVAL, "fsdp_module_param_aliases: out is NULL");
    fsdp_named_list_t all;
    int rc = fsdp_module_named_params(m, true, &all);
    memset(out, 0, sizeof *out);
    if (rc < 0) return rc;
    if (!t) {
        fsdp_named_list_free(&all);
        return fsdp__module_err(m, FSDP_EINVAL, "fsdp_module_param_aliases: tensor is NULL");
    }
    size_t cap = 0;
    for (size_t i = 0; i < all.n && rc == 0; i++)
        if (all.tensors[i] == t)
            rc = fsdp__list_push(out, &cap, all.names[i], all.tensors[i], all.modules[i]);
    fsdp_named_list_free(&all);
    if (rc < 0) {
        fsdp_named_list_free(out);
        return fsdp__module_err(m, rc, "fsdp_module_param_aliases: out of memory");
    }
    return FSDP_OK;
}

int fsdp_module_visit(fsdp_module_t *m, fsdp_module_visit_fn fn, void *arg) {
    if (!fn) return fsdp__module_err(m, FSDP_EINVAL, "fsdp_module_visit: fn is NULL");
    fsdp_named_list_t l;
    int rc = fsdp_module_named_modules(m, &l);
    if (rc < 0) return rc;
    /* The walk runs over a snapshot, each module retained, so fn may rearrange the tree. */
    for (size_t i = 0; i < l.n; i++)
        fsdp_module_retain(l.modules[i]);
    for (size_t i = 0; i < l.n && rc == 0; i++)
        rc = fn(l.modules[i], l.names[i], arg);
    for (size_t i = 0; i < l.n; i++)
        fsdp_module_release(l.modules[i]);
    fsdp_named_list_free(&l);
    return rc;
}
