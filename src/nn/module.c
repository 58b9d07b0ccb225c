/* SPDX-License-Identifier: MIT */
/*
 * module.c: the module tree: creation and lifetime, registration of children, parameters and
 * buffers, lookups by dotted path, training mode, and the helpers built-in module types share.
 *
 * What a module holds and the tree's invariants are in nn_impl.h. Listings of the tree are in
 * module_list.c, hooks and fsdp_module_forward in module_hooks.c, state dicts in state_dict.c.
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
int fsdp__module_grow(void **arr, size_t *cap, size_t n, size_t es) {
    if (n < *cap) return FSDP_OK;
    size_t nc = *cap ? *cap * 2 : 4;
    void *p = realloc(*arr, nc * es);
    if (!p) return FSDP_ENOMEM;
    *arr = p;
    *cap = nc;
    return FSDP_OK;
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
    if (!copy || fsdp__module_grow((void **)&m->children, &m->capchildren, m->nchildren,
                                   sizeof *m->children)) {
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
    if (!copy || fsdp__module_grow((void **)arr, cap, *n, sizeof **arr)) {
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
