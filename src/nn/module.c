/*
 * module.c: the module tree: registration, lookups, listings, modes, hooks and forward.
 *
 * Listings walk the tree in pre-order (a module's own entries in registration order, then its
 * children). Without aliases a shared module and a shared tensor are visited once, under the
 * first path that reaches them, as PyTorch's named_parameters() does; with aliases every path
 * and name is listed, as PyTorch's state_dict() does.
 *
 * fsdp_module_forward is the one way a module runs. Backward hooks ride on tape marks: an
 * entry mark before the module's operations (backward reaches it after them: post-hooks) and
 * an exit mark after (backward reaches it first: pre-hooks). A mark holds a reference to the
 * module, so a module dropped by its owner stays valid until the tape lets go of the mark.
 * Marks are recorded only for modules that have hooks of the matching kind, so an unhooked
 * model puts nothing extra on the tape.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/nn_impl.h"
#include "tensor/tensor_impl.h"

/* ---- small helpers ------------------------------------------------------------------------ */

static const char *type_of(const fsdp_module_t *m) {
    return m && m->ops && m->ops->type ? m->ops->type : "Module";
}

int fsdp__module_err(const fsdp_module_t *m, int rc, const char *fmt, ...) {
    char msg[FSDP_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return fsdp__ctx_err(m ? m->ctx : NULL, rc, "%s: %s", type_of(m), msg);
}

/* Grows *arr (elements of size es) so that it holds at least n + 1. */
static int grow(void **arr, size_t *cap, size_t n, size_t es) {
    if (n < *cap) return FSDP_OK;
    size_t nc = *cap ? *cap * 2 : 4;
    void *p = realloc(*arr, nc * es);
    if (!p) return FSDP_ENOMEM;
    *arr = p;
    *cap = nc;
    return FSDP_OK;
}

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
            while (ns[j]) j = (j + 1) & (nc - 1);
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

/* ---- creation and lifetime ------------------------------------------------------------------ */

static int module_alloc(fsdp_ctx_t *ctx, const fsdp_module_ops_t *ops, void *impl,
                        fsdp_module_t **out) {
    if (!out) return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_module_create: out is NULL");
    *out = NULL;
    if (!ctx) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_module_create: ctx is NULL");
    if (!ops) return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_module_create: ops is NULL");
    fsdp_module_t *m = calloc(1, sizeof *m);
    if (!m) return fsdp__ctx_err(ctx, FSDP_ENOMEM, "fsdp_module_create: out of memory");
    m->refs = 1;
    m->ctx = ctx;
    m->ops = ops;
    m->impl = impl;
    m->training = true;
    *out = m;
    return FSDP_OK;
}

int fsdp_module_create(fsdp_ctx_t *ctx, const fsdp_module_ops_t *ops, void *impl,
                       fsdp_module_t **out) {
    return module_alloc(ctx, ops, impl, out);
}

int fsdp__module_new(fsdp_ctx_t *ctx, const fsdp_module_ops_t *ops, size_t impl_size,
                     fsdp_module_t **out, void **impl_out) {
    if (impl_out) *impl_out = NULL;
    void *impl = NULL;
    if (impl_size) {
        impl = calloc(1, impl_size);
        if (!impl) {
            if (out) *out = NULL;
            return fsdp__ctx_err(ctx, FSDP_ENOMEM, "%s: out of memory",
                                 ops && ops->type ? ops->type : "Module");
        }
    }
    int rc = module_alloc(ctx, ops, impl, out);
    if (rc < 0) {
        free(impl);
        return rc;
    }
    (*out)->impl_core_owned = true;
    if (impl_out) *impl_out = impl;
    return FSDP_OK;
}

fsdp_module_t *fsdp_module_retain(fsdp_module_t *m) {
    if (m) m->refs++;
    return m;
}

void fsdp_module_release(fsdp_module_t *m) {
    if (!m || --m->refs > 0) return;
    for (size_t i = 0; i < m->nchildren; i++) {
        fsdp_module_release(m->children[i].m);
        free(m->children[i].name);
    }
    for (size_t i = 0; i < m->nparams; i++) {
        fsdp_tensor_release(m->params[i].t);
        free(m->params[i].name);
    }
    for (size_t i = 0; i < m->nbuffers; i++) {
        fsdp_tensor_release(m->buffers[i].t);
        free(m->buffers[i].name);
    }
    if (m->ops->destroy) m->ops->destroy(m->impl);
    if (m->impl_core_owned) free(m->impl);
    free(m->children);
    free(m->params);
    free(m->buffers);
    free(m->hooks);
    free(m);
}

fsdp_ctx_t *fsdp_module_ctx(const fsdp_module_t *m) { return m ? m->ctx : NULL; }
const char *fsdp_module_type(const fsdp_module_t *m) { return m ? type_of(m) : ""; }
void *fsdp_module_impl(const fsdp_module_t *m) { return m ? m->impl : NULL; }
const fsdp_module_ops_t *fsdp_module_ops(const fsdp_module_t *m) { return m ? m->ops : NULL; }

/* ---- registration --------------------------------------------------------------------------- */

static struct fsdp__child *find_child(const fsdp_module_t *m, const char *name, size_t len) {
    for (size_t i = 0; i < m->nchildren; i++)
        if (strlen(m->children[i].name) == len && memcmp(m->children[i].name, name, len) == 0)
            return &m->children[i];
    return NULL;
}

static struct fsdp__slot *find_slot(struct fsdp__slot *s, size_t n, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (strcmp(s[i].name, name) == 0) return &s[i];
    return NULL;
}

/* Checks that `name` can be registered as a new `kind` ("child", "parameter", "buffer"). */
static int check_new_name(const fsdp_module_t *m, const char *kind, const char *name) {
    if (!name) return fsdp__module_err(m, FSDP_EINVAL, "cannot add a %s with a NULL name", kind);
    if (!name[0])
        return fsdp__module_err(m, FSDP_EINVAL, "cannot add a %s with an empty name", kind);
    if (strchr(name, '.'))
        return fsdp__module_err(m, FSDP_EINVAL, "cannot add %s '%s': names may not contain '.'",
                                kind, name);
    const char *taken = NULL;
    if (find_child(m, name, strlen(name))) taken = "child module";
    else if (find_slot(m->params, m->nparams, name)) taken = "parameter";
    else if (find_slot(m->buffers, m->nbuffers, name)) taken = "buffer";
    if (taken)
        return fsdp__module_err(m, FSDP_EINVAL,
                                "cannot add %s '%s': the name is already taken by a %s", kind,
                                name, taken);
    return FSDP_OK;
}

/* Whether `target` is m or somewhere below it. */
static bool tree_contains(const fsdp_module_t *m, const fsdp_module_t *target) {
    if (m == target) return true;
    for (size_t i = 0; i < m->nchildren; i++)
        if (tree_contains(m->children[i].m, target)) return true;
    return false;
}

int fsdp_module_add_child(fsdp_module_t *m, const char *name, fsdp_module_t *child) {
    if (!m) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_module_add_child: module is NULL");
    int rc = check_new_name(m, "child module", name);
    if (rc < 0) return rc;
    if (!child)
        return fsdp__module_err(m, FSDP_EINVAL, "cannot add child module '%s': it is NULL", name);
    if (child->ctx != m->ctx)
        return fsdp__module_err(m, FSDP_EINVAL,
                                "cannot add child module '%s' (%s): it belongs to another "
                                "context",
                                name, type_of(child));
    if (tree_contains(child, m))
        return fsdp__module_err(m, FSDP_EINVAL,
                                "cannot add child module '%s' (%s): the module would contain "
                                "itself",
                                name, type_of(child));
    char *copy = strdup(name);
    if (!copy || grow((void **)&m->children, &m->capchildren, m->nchildren, sizeof *m->children)) {
        free(copy);
        return fsdp__module_err(m, FSDP_ENOMEM, "cannot add child module '%s': out of memory",
                                name);
    }
    m->children[m->nchildren++] = (struct fsdp__child){copy, fsdp_module_retain(child)};
    return FSDP_OK;
}

/* Common checks for a tensor about to be registered under name as `kind`. */
static int check_tensor_arg(const fsdp_module_t *m, const char *kind, const char *name,
                            const fsdp_tensor_t *t) {
    if (!t) return fsdp__module_err(m, FSDP_EINVAL, "cannot add %s '%s': it is NULL", kind, name);
    if (fsdp_tensor_ctx(t) != m->ctx)
        return fsdp__module_err(m, FSDP_EINVAL,
                                "cannot add %s '%s': the tensor belongs to another context",
                                kind, name);
    return FSDP_OK;
}

/* Names t after its local name unless it already has a name (a tied parameter keeps the
 * first). */
static int name_tensor(fsdp_tensor_t *t, const char *name) {
    if (fsdp_tensor_name(t)[0]) return FSDP_OK;
    return fsdp_tensor_set_name(t, name);
}

static int add_slot(fsdp_module_t *m, bool param, const char *name, fsdp_tensor_t *t,
                    bool persistent) {
    const char *kind = param ? "parameter" : "buffer";
    struct fsdp__slot **arr = param ? &m->params : &m->buffers;
    size_t *n = param ? &m->nparams : &m->nbuffers;
    size_t *cap = param ? &m->capparams : &m->capbuffers;
    char *copy = strdup(name);
    if (!copy || grow((void **)arr, cap, *n, sizeof **arr)) {
        free(copy);
        return fsdp__module_err(m, FSDP_ENOMEM, "cannot add %s '%s': out of memory", kind, name);
    }
    (*arr)[(*n)++] = (struct fsdp__slot){copy, fsdp_tensor_retain(t), persistent};
    return FSDP_OK;
}

int fsdp_module_add_param(fsdp_module_t *m, const char *name, fsdp_tensor_t *t) {
    if (!m) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_module_add_param: module is NULL");
    int rc = check_new_name(m, "parameter", name);
    if (rc < 0) return rc;
    FSDP_TRY(rc, out, check_tensor_arg(m, "parameter", name, t));
    if (!fsdp_dtype_is_float(fsdp_tensor_dtype(t)))
        return fsdp__module_err(m, FSDP_EINVAL,
                                "cannot add parameter '%s': parameters must be float tensors, "
                                "not %s",
                                name, fsdp_dtype_name(fsdp_tensor_dtype(t)));
    if (!fsdp_tensor_is_leaf(t))
        return fsdp__module_err(m, FSDP_EINVAL,
                                "cannot add parameter '%s': it is the output of a recorded "
                                "operation, not a leaf (use fsdp_detach)",
                                name);
    FSDP_TRY(rc, out, fsdp_tensor_set_requires_grad(t, true));
    FSDP_TRY(rc, out, name_tensor(t, name));
    rc = add_slot(m, true, name, t, true);
out:
    return rc;
}

int fsdp_module_add_buffer(fsdp_module_t *m, const char *name, fsdp_tensor_t *t,
                           bool persistent) {
    if (!m) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_module_add_buffer: module is NULL");
    int rc = check_new_name(m, "buffer", name);
    if (rc < 0) return rc;
    FSDP_TRY(rc, out, check_tensor_arg(m, "buffer", name, t));
    FSDP_TRY(rc, out, name_tensor(t, name));
    rc = add_slot(m, false, name, t, persistent);
out:
    return rc;
}

/* ---- lookups ----------------------------------------------------------------------------- */

/* The module named by the first `len` characters of path (dotted, relative to m). */
static fsdp_module_t *resolve(const fsdp_module_t *m, const char *path, size_t len) {
    const fsdp_module_t *cur = m;
    size_t i = 0;
    while (cur && i < len) {
        const char *dot = memchr(path + i, '.', len - i);
        size_t seg = dot ? (size_t)(dot - (path + i)) : len - i;
        struct fsdp__child *c = seg ? find_child(cur, path + i, seg) : NULL;
        cur = c ? c->m : NULL;
        i += seg + (dot ? 1 : 0);
        if (dot && i == len) cur = NULL; /* a trailing dot */
    }
    return (fsdp_module_t *)cur;
}

/* Splits "a.b.c" into the owner module (a.b) and the local name (c). */
static fsdp_module_t *owner_of(const fsdp_module_t *m, const char *path, const char **local) {
    const char *dot = strrchr(path, '.');
    *local = dot ? dot + 1 : path;
    return dot ? resolve(m, path, (size_t)(dot - path)) : (fsdp_module_t *)m;
}

fsdp_module_t *fsdp_module_child(const fsdp_module_t *m, const char *path) {
    if (!m || !path) return NULL;
    return resolve(m, path, strlen(path));
}

fsdp_tensor_t *fsdp_module_param(const fsdp_module_t *m, const char *path) {
    if (!m || !path) return NULL;
    const char *local;
    fsdp_module_t *o = owner_of(m, path, &local);
    struct fsdp__slot *s = o ? find_slot(o->params, o->nparams, local) : NULL;
    return s ? s->t : NULL;
}

fsdp_tensor_t *fsdp_module_buffer(const fsdp_module_t *m, const char *path) {
    if (!m || !path) return NULL;
    const char *local;
    fsdp_module_t *o = owner_of(m, path, &local);
    struct fsdp__slot *s = o ? find_slot(o->buffers, o->nbuffers, local) : NULL;
    return s ? s->t : NULL;
}

size_t fsdp_module_num_children(const fsdp_module_t *m) { return m ? m->nchildren : 0; }

fsdp_module_t *fsdp_module_child_at(const fsdp_module_t *m, size_t i, const char **name) {
    if (!m || i >= m->nchildren) {
        if (name) *name = NULL;
        return NULL;
    }
    if (name) *name = m->children[i].name;
    return m->children[i].m;
}

fsdp_tensor_t *fsdp__module_param_at(const fsdp_module_t *m, size_t i) {
    return m && i < m->nparams ? m->params[i].t : NULL;
}

fsdp_tensor_t *fsdp__module_buffer_at(const fsdp_module_t *m, size_t i) {
    return m && i < m->nbuffers ? m->buffers[i].t : NULL;
}

int fsdp_module_set_param(fsdp_module_t *m, const char *name, fsdp_tensor_t *t,
                          bool allow_reshape) {
    if (!m) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_module_set_param: module is NULL");
    if (!name) return fsdp__module_err(m, FSDP_EINVAL, "fsdp_module_set_param: name is NULL");
    const char *local;
    fsdp_module_t *o = owner_of(m, name, &local);
    struct fsdp__slot *s = o ? find_slot(o->params, o->nparams, local) : NULL;
    if (!s)
        return fsdp__module_err(m, FSDP_EINVAL, "fsdp_module_set_param: no parameter '%s'",
                                name);
    int rc = check_tensor_arg(m, "parameter", name, t);
    if (rc < 0) return rc;
    if (!fsdp_dtype_is_float(fsdp_tensor_dtype(t)))
        return fsdp__module_err(m, FSDP_EINVAL,
                                "fsdp_module_set_param: '%s' must be a float tensor, not %s",
                                name, fsdp_dtype_name(fsdp_tensor_dtype(t)));
    int nd = fsdp_tensor_ndim(t);
    if (!allow_reshape &&
        (nd != fsdp_tensor_ndim(s->t) ||
         memcmp(fsdp_tensor_shape(t), fsdp_tensor_shape(s->t), sizeof(int64_t) * (size_t)nd))) {
        char a[160], b[160];
        return fsdp__module_err(m, FSDP_EINVAL,
                                "fsdp_module_set_param: '%s' is %s; the new tensor %s has "
                                "another shape",
                                name, fsdp_tensor_describe(s->t, a, sizeof a),
                                fsdp_tensor_describe(t, b, sizeof b));
    }
    if (t == s->t) return FSDP_OK;
    if (!fsdp_tensor_name(t)[0]) {
        const char *old = fsdp_tensor_name(s->t);
        rc = fsdp_tensor_set_name(t, old[0] ? old : local);
        if (rc < 0) return rc;
    }
    fsdp_tensor_release(s->t);
    s->t = fsdp_tensor_retain(t);
    return FSDP_OK;
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
            FSDP_TRY(rc, out, list_slots(L, m, prefix, m->buffers, m->nbuffers,
                                         L->what == FSDP__LIST_STATE));
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
    return run_listing(m, FSDP__LIST_PARAMS, with_aliases, false, out,
                       "fsdp_module_named_params");
}

int fsdp_module_named_buffers(const fsdp_module_t *m, bool with_aliases,
                              fsdp_named_list_t *out) {
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
    for (size_t i = 0; i < l.n; i++) n += fsdp_tensor_numel(l.tensors[i]);
    fsdp_named_list_free(&l);
    return n;
}

int fsdp_module_param_aliases(const fsdp_module_t *m, const fsdp_tensor_t *t,
                              fsdp_named_list_t *out) {
    if (!out)
        return fsdp__module_err(m, FSDP_EINVAL, "fsdp_module_param_aliases: out is NULL");
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
        if (all.tensors[i] == t) rc = fsdp__list_push(out, &cap, all.names[i], all.tensors[i],
                                                      all.modules[i]);
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
    for (size_t i = 0; i < l.n; i++) fsdp_module_retain(l.modules[i]);
    for (size_t i = 0; i < l.n && rc == 0; i++) rc = fn(l.modules[i], l.names[i], arg);
    for (size_t i = 0; i < l.n; i++) fsdp_module_release(l.modules[i]);
    fsdp_named_list_free(&l);
    return rc;
}

/* ---- modes ------------------------------------------------------------------------------ */

void fsdp_module_train(fsdp_module_t *m, bool train) {
    if (!m) return;
    m->training = train;
    for (size_t i = 0; i < m->nchildren; i++) fsdp_module_train(m->children[i].m, train);
}

bool fsdp_module_is_training(const fsdp_module_t *m) { return m && m->training; }

int fsdp_module_requires_grad_(fsdp_module_t *m, bool requires_grad) {
    fsdp_named_list_t l;
    int rc = fsdp_module_named_params(m, false, &l);
    if (rc < 0) return rc;
    for (size_t i = 0; i < l.n && rc == 0; i++)
        rc = fsdp_tensor_set_requires_grad(l.tensors[i], requires_grad);
    fsdp_named_list_free(&l);
    return rc;
}

int fsdp_module_zero_grad(fsdp_module_t *m, bool set_to_none) {
    fsdp_named_list_t l;
    int rc = fsdp_module_named_params(m, false, &l);
    if (rc < 0) return rc;
    for (size_t i = 0; i < l.n && rc == 0; i++)
        rc = fsdp_tensor_zero_grad(l.tensors[i], set_to_none);
    fsdp_named_list_free(&l);
    return rc;
}

/* ---- helpers for built-in types ------------------------------------------------------------- */

int fsdp__module_new_param(fsdp_module_t *m, const char *name, int ndim, const int64_t *shape,
                           double value, fsdp_tensor_t **t) {
    if (t) *t = NULL;
    fsdp_tensor_t *p = NULL;
    int rc = fsdp_tensor_full(m->ctx, FSDP_DTYPE_F32, ndim, shape, value, FSDP_MEM_PARAMS, &p);
    if (rc == 0) rc = fsdp_module_add_param(m, name, p);
    if (rc == 0 && t) *t = p;
    fsdp_tensor_release(p);
    return rc;
}

int fsdp__module_new_buffer(fsdp_module_t *m, const char *name, fsdp_dtype_t dt, int ndim,
                            const int64_t *shape, double value, bool persistent,
                            fsdp_tensor_t **t) {
    if (t) *t = NULL;
    fsdp_tensor_t *b = NULL;
    int rc = fsdp_tensor_full(m->ctx, dt, ndim, shape, value, FSDP_MEM_OTHER, &b);
    if (rc == 0) rc = fsdp_module_add_buffer(m, name, b, persistent);
    if (rc == 0 && t) *t = b;
    fsdp_tensor_release(b);
    return rc;
}

int fsdp__module_check_io(const fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int min_in,
                          int max_in, int nout, int want_out) {
    if (nin < min_in || (max_in >= 0 && nin > max_in)) {
        if (max_in == min_in)
            return fsdp__module_err(m, FSDP_EINVAL, "forward takes %d input%s, got %d", min_in,
                                    min_in == 1 ? "" : "s", nin);
        return fsdp__module_err(m, FSDP_EINVAL, "forward takes %d to %d inputs, got %d", min_in,
                                max_in, nin);
    }
    if (nout != want_out)
        return fsdp__module_err(m, FSDP_EINVAL, "forward gives %d output%s, %d asked for",
                                want_out, want_out == 1 ? "" : "s", nout);
    for (int i = 0; i < min_in; i++)
        if (!in[i]) return fsdp__module_err(m, FSDP_EINVAL, "forward input %d is NULL", i);
    return FSDP_OK;
}

/* ---- hooks ------------------------------------------------------------------------------- */

static int add_hook(fsdp_module_t *m, enum fsdp__hook_kind kind, struct fsdp__hook h,
                    bool fn_set, int *handle, const char *fn) {
    if (handle) *handle = 0;
    if (!m) return fsdp__ctx_err(NULL, FSDP_EINVAL, "%s: module is NULL", fn);
    if (!fn_set) return fsdp__module_err(m, FSDP_EINVAL, "%s: hook function is NULL", fn);
    if (grow((void **)&m->hooks, &m->caphooks, m->nhooks, sizeof *m->hooks))
        return fsdp__module_err(m, FSDP_ENOMEM, "%s: out of memory", fn);
    h.kind = kind;
    h.handle = ++m->next_handle;
    m->hooks[m->nhooks++] = h;
    m->nhooks_kind[kind]++;
    if (handle) *handle = h.handle;
    return FSDP_OK;
}

int fsdp_module_add_forward_pre_hook(fsdp_module_t *m, fsdp_forward_pre_hook_fn fn, void *arg,
                                     int *handle) {
    struct fsdp__hook h = {0};
    h.fn.pre = fn;
    h.arg = arg;
    return add_hook(m, FSDP__HOOK_FORWARD_PRE, h, fn != NULL, handle,
                    "fsdp_module_add_forward_pre_hook");
}

int fsdp_module_add_forward_hook(fsdp_module_t *m, fsdp_forward_hook_fn fn, void *arg,
                                 int *handle) {
    struct fsdp__hook h = {0};
    h.fn.post = fn;
    h.arg = arg;
    return add_hook(m, FSDP__HOOK_FORWARD, h, fn != NULL, handle,
                    "fsdp_module_add_forward_hook");
}

int fsdp_module_add_backward_pre_hook(fsdp_module_t *m, fsdp_backward_hook_fn fn, void *arg,
                                      int *handle) {
    struct fsdp__hook h = {0};
    h.fn.bw = fn;
    h.arg = arg;
    return add_hook(m, FSDP__HOOK_BACKWARD_PRE, h, fn != NULL, handle,
                    "fsdp_module_add_backward_pre_hook");
}

int fsdp_module_add_backward_hook(fsdp_module_t *m, fsdp_backward_hook_fn fn, void *arg,
                                  int *handle) {
    struct fsdp__hook h = {0};
    h.fn.bw = fn;
    h.arg = arg;
    return add_hook(m, FSDP__HOOK_BACKWARD, h, fn != NULL, handle,
                    "fsdp_module_add_backward_hook");
}

int fsdp_module_remove_hook(fsdp_module_t *m, int handle) {
    if (!m) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_module_remove_hook: module is NULL");
    for (size_t i = 0; i < m->nhooks; i++) {
        if (m->hooks[i].handle != handle) continue;
        m->nhooks_kind[m->hooks[i].kind]--;
        memmove(&m->hooks[i], &m->hooks[i + 1], (m->nhooks - i - 1) * sizeof *m->hooks);
        m->nhooks--;
        return FSDP_OK;
    }
    return fsdp__module_err(m, FSDP_EINVAL, "fsdp_module_remove_hook: no hook with handle %d",
                            handle);
}

/* The hooks of one kind at this moment, so that a hook may add or remove hooks while they run.
 * *out is freed by the caller. */
static int snapshot_hooks(fsdp_module_t *m, enum fsdp__hook_kind kind, struct fsdp__hook **out,
                          size_t *n) {
    *out = NULL;
    *n = 0;
    if (m->nhooks_kind[kind] == 0) return FSDP_OK;
    struct fsdp__hook *s = malloc((size_t)m->nhooks_kind[kind] * sizeof *s);
    if (!s) return fsdp__module_err(m, FSDP_ENOMEM, "running hooks: out of memory");
    for (size_t i = 0; i < m->nhooks; i++)
        if (m->hooks[i].kind == kind) s[(*n)++] = m->hooks[i];
    *out = s;
    return FSDP_OK;
}

/* Rewrites the context's error after a failing hook so that it says which hook failed. */
static int hook_failed(fsdp_module_t *m, const char *what, int handle, int rc) {
    char prev[FSDP_ERR_LEN];
    snprintf(prev, sizeof prev, "%s", fsdp_ctx_last_error(m->ctx));
    return fsdp__module_err(m, rc, "%s %d failed (%s): %s", what, handle, fsdp_err_name(rc),
                            prev);
}

static int run_backward_hooks(fsdp_module_t *m, enum fsdp__hook_kind kind, bool has_grad) {
    struct fsdp__hook *hs;
    size_t n;
    int rc = snapshot_hooks(m, kind, &hs, &n);
    for (size_t i = 0; i < n && rc == 0; i++) {
        int r = hs[i].fn.bw(m, hs[i].arg, has_grad);
        if (r < 0)
            rc = hook_failed(m,
                             kind == FSDP__HOOK_BACKWARD ? "backward hook" : "backward pre-hook",
                             hs[i].handle, r);
    }
    free(hs);
    return rc;
}

static int mark_backward_post(fsdp_ctx_t *ctx, void *arg, bool has_grad) {
    (void)ctx;
    return run_backward_hooks(arg, FSDP__HOOK_BACKWARD, has_grad);
}

static int mark_backward_pre(fsdp_ctx_t *ctx, void *arg, bool has_grad) {
    (void)ctx;
    return run_backward_hooks(arg, FSDP__HOOK_BACKWARD_PRE, has_grad);
}

static void mark_release(void *arg) { fsdp_module_release(arg); }

/* ---- forward ---------------------------------------------------------------------------- */

int fsdp_module_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                        fsdp_tensor_t **out) {
    if (!m || nin < 0 || nout < 0 || (nin > 0 && !in) || (nout > 0 && !out)) {
        if (out && nout > 0)
            for (int i = 0; i < nout; i++) out[i] = NULL;
        if (!m) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_module_forward: module is NULL");
        return fsdp__module_err(m, FSDP_EINVAL,
                                "fsdp_module_forward: bad arguments (nin %d, in %s, nout %d, "
                                "out %s)",
                                nin, in ? "set" : "NULL", nout, out ? "set" : "NULL");
    }
    int rc = FSDP_OK;
    struct fsdp__hook *hs = NULL;
    size_t nh = 0;
    char label[96];
    fsdp_tensor_t **ins = calloc((size_t)(nin > 0 ? nin : 1), sizeof *ins);
    fsdp_tensor_t **outs = calloc((size_t)(nout > 0 ? nout : 1), sizeof *outs);
    /* Hooks may drop the last outside reference to m; keep it alive until the end. */
    fsdp_module_retain(m);
    if (!ins || !outs) {
        rc = fsdp__module_err(m, FSDP_ENOMEM, "fsdp_module_forward: out of memory");
        goto fail;
    }
    /* Inputs are copied before out[] is cleared, so in and out may be the same array. */
    for (int i = 0; i < nin; i++) ins[i] = fsdp_tensor_retain(in[i]);
    for (int o = 0; o < nout; o++) out[o] = NULL;

    FSDP_TRY(rc, fail, snapshot_hooks(m, FSDP__HOOK_FORWARD_PRE, &hs, &nh));
    for (size_t i = 0; i < nh; i++) {
        rc = hs[i].fn.pre(m, hs[i].arg, nin, ins);
        if (rc < 0) {
            rc = hook_failed(m, "forward pre-hook", hs[i].handle, rc);
            goto fail;
        }
    }
    free(hs);
    hs = NULL;

    if (m->nhooks_kind[FSDP__HOOK_BACKWARD] > 0) {
        snprintf(label, sizeof label, "%s entry", type_of(m));
        FSDP_TRY(rc, fail, fsdp_tape_mark(m->ctx, label, nin, ins, mark_backward_post,
                                          fsdp_module_retain(m), mark_release));
    }
    if (!m->ops->forward) {
        rc = fsdp__module_err(m, FSDP_ENOTSUP, "this module type has no forward");
        goto fail;
    }
    FSDP_TRY(rc, fail, m->ops->forward(m, nin, ins, nout, outs));
    for (int o = 0; o < nout; o++) {
        if (!outs[o]) {
            rc = fsdp__module_err(m, FSDP_EINTERNAL, "forward succeeded but left output %d NULL",
                                  o);
            goto fail;
        }
    }
    if (m->nhooks_kind[FSDP__HOOK_BACKWARD_PRE] > 0) {
        snprintf(label, sizeof label, "%s exit", type_of(m));
        FSDP_TRY(rc, fail, fsdp_tape_mark(m->ctx, label, nout, outs, mark_backward_pre,
                                          fsdp_module_retain(m), mark_release));
    }

    FSDP_TRY(rc, fail, snapshot_hooks(m, FSDP__HOOK_FORWARD, &hs, &nh));
    for (size_t i = 0; i < nh; i++) {
        rc = hs[i].fn.post(m, hs[i].arg, nin, ins, nout, outs);
        if (rc < 0) {
            rc = hook_failed(m, "forward hook", hs[i].handle, rc);
            goto fail;
        }
        for (int o = 0; o < nout; o++) {
            if (!outs[o]) {
                rc = fsdp__module_err(m, FSDP_EINVAL, "forward hook %d left output %d NULL",
                                      hs[i].handle, o);
                goto fail;
            }
        }
    }
    free(hs);
    for (int o = 0; o < nout; o++) out[o] = outs[o];
    for (int i = 0; i < nin; i++) fsdp_tensor_release(ins[i]);
    free(ins);
    free(outs);
    fsdp_module_release(m);
    return FSDP_OK;

fail:
    for (int o = 0; o < nout; o++) out[o] = NULL;
    free(hs);
    if (ins)
        for (int i = 0; i < nin; i++) fsdp_tensor_release(ins[i]);
    if (outs)
        for (int o = 0; o < nout; o++) fsdp_tensor_release(outs[o]);
    free(ins);
    free(outs);
    fsdp_module_release(m);
    return rc;
}

int fsdp_module_forward1(fsdp_module_t *m, fsdp_tensor_t *x, fsdp_tensor_t **y) {
    if (!y) return fsdp__module_err(m, FSDP_EINVAL, "fsdp_module_forward1: y is NULL");
    return fsdp_module_forward(m, 1, &x, 1, y);
}
