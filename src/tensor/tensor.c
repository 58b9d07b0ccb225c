/* SPDX-License-Identifier: MIT */
/*
 * tensor.c: tensor and storage lifetimes (creation, references, wrapping user memory, freeing
 * and restoring a storage), properties, and what a tensor keeps for autograd: requires_grad,
 * the accumulated .grad and gradient hooks.
 *
 * A tensor header is small and owned by whoever holds a reference; its storage is shared by
 * every view and freed through the device when the last view goes. Copies, fills and host
 * transfers are in tensor_data.c; the helpers every operation shares in tensor_helpers.c.
 */
#include <stdlib.h>
#include <string.h>

#include "tensor/tensor_impl.h"

/* ---- storage ----------------------------------------------------------------------------- */

static int storage_new(fsdp_device_t *dev, size_t bytes, fsdp_mem_cat_t cat, bool zero,
                       struct fsdp_storage **out) {
    struct fsdp_storage *st = calloc(1, sizeof *st);
    if (!st) return fsdp__ctx_err(dev->ctx, FSDP_ENOMEM, "tensor: out of host memory");
    int rc = zero ? fsdp__device_alloc_zeroed(dev, cat, bytes, &st->ptr)
                  : fsdp_device_alloc(dev, cat, bytes, &st->ptr);
    if (rc < 0) {
        free(st);
        return rc;
    }
    atomic_init(&st->refs, 1);
    st->dev = dev;
    st->bytes = st->full_bytes = bytes;
    st->cat = cat;
    st->owned = true;
    *out = st;
    return FSDP_OK;
}

static void storage_release(struct fsdp_storage *st) {
    if (!st || atomic_fetch_sub(&st->refs, 1) != 1) return;
    if (st->owned && st->ptr) fsdp_device_free(st->dev, st->ptr);
    free(st);
}

/* ---- tensors ------------------------------------------------------------------------------- */

static int check_shape(fsdp_ctx_t *ctx, const char *op, int ndim, const int64_t *shape) {
    if (ndim < 0 || ndim > FSDP_MAX_DIMS)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: ndim %d is outside [0, %d]", op, ndim,
                             FSDP_MAX_DIMS);
    if (ndim > 0 && !shape)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: shape is NULL with ndim %d", op, ndim);
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0)
            return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: size %lld of dimension %d is negative",
                                 op, (long long)shape[i], i);
    return FSDP_OK;
}

static fsdp_tensor_t *header_new(fsdp_ctx_t *ctx, fsdp_device_t *dev, fsdp_dtype_t dt, int ndim,
                                 const int64_t *shape) {
    fsdp_tensor_t *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    atomic_init(&t->refs, 1);
    t->ctx = ctx;
    t->dev = dev;
    t->dt = dt;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    fsdp__contiguous_strides(ndim, t->shape, t->stride);
    t->slot = -1;
    return t;
}

static int tensor_new(fsdp_ctx_t *ctx, fsdp_device_t *dev, fsdp_dtype_t dt, int ndim,
                      const int64_t *shape, fsdp_mem_cat_t cat, bool zero, fsdp_tensor_t **out) {
    *out = NULL;
    fsdp_tensor_t *t = header_new(ctx, dev, dt, ndim, shape);
    if (!t) return fsdp__ctx_err(ctx, FSDP_ENOMEM, "tensor: out of host memory");
    size_t bytes = (size_t)fsdp__shape_numel(ndim, shape) * fsdp_dtype_size(dt);
    int rc = storage_new(dev, bytes, cat, zero, &t->st);
    if (rc < 0) {
        free(t);
        return rc;
    }
    *out = t;
    return FSDP_OK;
}

int fsdp__tensor_new(fsdp_ctx_t *ctx, fsdp_device_t *dev, fsdp_dtype_t dt, int ndim,
                     const int64_t *shape, fsdp_mem_cat_t cat, fsdp_tensor_t **out) {
    return tensor_new(ctx, dev, dt, ndim, shape, cat, false, out);
}

int fsdp__tensor_new_zeroed(fsdp_ctx_t *ctx, fsdp_device_t *dev, fsdp_dtype_t dt, int ndim,
                            const int64_t *shape, fsdp_mem_cat_t cat, fsdp_tensor_t **out) {
    return tensor_new(ctx, dev, dt, ndim, shape, cat, true, out);
}

int fsdp__tensor_view(fsdp_tensor_t *t, int64_t offset, int ndim, const int64_t *shape,
                      const int64_t *stride, fsdp_tensor_t **out) {
    *out = NULL;
    fsdp_tensor_t *v = header_new(t->ctx, t->dev, t->dt, ndim, shape);
    if (!v) return fsdp__ctx_err(t->ctx, FSDP_ENOMEM, "tensor: out of host memory");
    if (stride)
        for (int i = 0; i < ndim; i++) v->stride[i] = stride[i];
    v->offset = offset;
    v->st = t->st;
    atomic_fetch_add(&t->st->refs, 1);
    *out = v;
    return FSDP_OK;
}

static int creation_args(fsdp_ctx_t *ctx, const char *op, fsdp_dtype_t dt, int ndim,
                         const int64_t *shape, fsdp_mem_cat_t cat, fsdp_tensor_t **out) {
    if (!out) return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: out is NULL", op);
    *out = NULL;
    if (!ctx) return FSDP_EINVAL;
    if (!fsdp_dtype_valid((int)dt))
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: dtype %d is not a dtype", op, (int)dt);
    if ((int)cat < 0 || cat >= FSDP_MEM_NCAT)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: memory category %d is not a category", op,
                             (int)cat);
    return check_shape(ctx, op, ndim, shape);
}

int fsdp_tensor_empty(fsdp_ctx_t *ctx, fsdp_dtype_t dt, int ndim, const int64_t *shape,
                      fsdp_mem_cat_t cat, fsdp_tensor_t **out) {
    int rc = creation_args(ctx, "fsdp_tensor_empty", dt, ndim, shape, cat, out);
    if (rc < 0) return rc;
    fsdp_device_t *dev = fsdp_ctx_device(ctx);
    if (!dev) return fsdp__ctx_err(ctx, FSDP_ENOMEM, "fsdp_tensor_empty: no device");
    return fsdp__tensor_new(ctx, dev, dt, ndim, shape, cat, out);
}

int fsdp_tensor_full(fsdp_ctx_t *ctx, fsdp_dtype_t dt, int ndim, const int64_t *shape,
                     double value, fsdp_mem_cat_t cat, fsdp_tensor_t **out) {
    int rc = fsdp_tensor_empty(ctx, dt, ndim, shape, cat, out);
    if (rc < 0) return rc;
    rc = fsdp_tensor_fill_(*out, value);
    if (rc < 0) {
        fsdp_tensor_release(*out);
        *out = NULL;
    }
    return rc;
}

int fsdp_tensor_zeros(fsdp_ctx_t *ctx, fsdp_dtype_t dt, int ndim, const int64_t *shape,
                      fsdp_mem_cat_t cat, fsdp_tensor_t **out) {
    return fsdp_tensor_full(ctx, dt, ndim, shape, 0.0, cat, out);
}

int fsdp_tensor_from_host(fsdp_ctx_t *ctx, fsdp_dtype_t dt, int ndim, const int64_t *shape,
                          const void *data, fsdp_mem_cat_t cat, fsdp_tensor_t **out) {
    int rc = fsdp_tensor_empty(ctx, dt, ndim, shape, cat, out);
    if (rc < 0) return rc;
    size_t bytes = (size_t)fsdp__shape_numel(ndim, shape) * fsdp_dtype_size(dt);
    if (bytes && !data) {
        rc = fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_tensor_from_host: data is NULL");
    } else {
        rc = fsdp_device_memcpy((*out)->dev, fsdp_tensor_data(*out), data, bytes, FSDP_COPY_H2D,
                                NULL);
    }
    if (rc < 0) {
        fsdp_tensor_release(*out);
        *out = NULL;
    }
    return rc;
}

int fsdp_tensor_wrap(fsdp_device_t *dev, void *data, fsdp_dtype_t dt, int ndim,
                     const int64_t *shape, fsdp_tensor_t **out) {
    if (!dev) return FSDP_EINVAL;
    int rc = creation_args(dev->ctx, "fsdp_tensor_wrap", dt, ndim, shape, FSDP_MEM_OTHER, out);
    if (rc < 0) return rc;
    size_t bytes = (size_t)fsdp__shape_numel(ndim, shape) * fsdp_dtype_size(dt);
    if (bytes && !data)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "fsdp_tensor_wrap: data is NULL");
    fsdp_tensor_t *t = header_new(dev->ctx, dev, dt, ndim, shape);
    struct fsdp_storage *st = calloc(1, sizeof *st);
    if (!t || !st) {
        free(t);
        free(st);
        return fsdp__ctx_err(dev->ctx, FSDP_ENOMEM, "fsdp_tensor_wrap: out of host memory");
    }
    atomic_init(&st->refs, 1);
    st->dev = dev;
    st->ptr = data;
    st->bytes = st->full_bytes = bytes;
    st->cat = FSDP_MEM_OTHER;
    st->owned = false;
    t->st = st;
    *out = t;
    return FSDP_OK;
}

static int random_fill(fsdp_tensor_t *t, const char *op, bool normal, double a, double b) {
    if (!t) return FSDP_EINVAL;
    if (t->dt != FSDP_DTYPE_F32 && t->dt != FSDP_DTYPE_F64)
        return fsdp__op_err(t, FSDP_EINVAL, op, "dtype %s is not f32 or f64",
                            fsdp_dtype_name(t->dt));
    int64_t n = fsdp_tensor_numel(t);
    /* A shape-only tensor has no values: the stream moves on as if they had been drawn, so
     * what is drawn afterwards is the same as on a real device. */
    if (t->dev->kind == FSDP_DEVICE_META) {
        t->ctx->rng.offset += ((uint64_t)n + 3) / 4; /* 4 words a block, as both draws use */
        return FSDP_OK;
    }
    float *tmp = malloc((size_t)(n > 0 ? n : 1) * sizeof *tmp);
    if (!tmp) return fsdp__op_err(t, FSDP_ENOMEM, op, "out of host memory");
    if (normal)
        fsdp_rng_normal_f32(&t->ctx->rng, tmp, (size_t)n, (float)a, (float)b);
    else
        fsdp_rng_uniform_f32(&t->ctx->rng, tmp, (size_t)n, (float)a, (float)b);
    int rc = FSDP_OK;
    if (t->dt == FSDP_DTYPE_F32) {
        rc = fsdp_tensor_copy_from_host(t, tmp, (size_t)n * sizeof(float));
    } else {
        double *d = malloc((size_t)(n > 0 ? n : 1) * sizeof *d);
        if (!d) {
            rc = fsdp__op_err(t, FSDP_ENOMEM, op, "out of host memory");
        } else {
            for (int64_t i = 0; i < n; i++) d[i] = tmp[i];
            rc = fsdp_tensor_copy_from_host(t, d, (size_t)n * sizeof(double));
            free(d);
        }
    }
    free(tmp);
    return rc;
}

int fsdp_tensor_uniform_(fsdp_tensor_t *t, double lo, double hi) {
    return random_fill(t, "fsdp_tensor_uniform_", false, lo, hi);
}

int fsdp_tensor_normal_(fsdp_tensor_t *t, double mean, double std) {
    return random_fill(t, "fsdp_tensor_normal_", true, mean, std);
}

fsdp_tensor_t *fsdp_tensor_retain(fsdp_tensor_t *t) {
    if (t) atomic_fetch_add(&t->refs, 1);
    return t;
}

void fsdp_tensor_release(fsdp_tensor_t *t) {
    if (!t || atomic_fetch_sub(&t->refs, 1) != 1) return;
    fsdp_tensor_release(t->grad);
    for (struct fsdp_grad_hook *h = t->hooks, *next; h; h = next) {
        next = h->next;
        free(h);
    }
    storage_release(t->st);
    free(t->name);
    free(t);
}

/* ---- properties ---------------------------------------------------------------------------- */

fsdp_ctx_t *fsdp_tensor_ctx(const fsdp_tensor_t *t) { return t ? t->ctx : NULL; }
fsdp_device_t *fsdp_tensor_device(const fsdp_tensor_t *t) { return t ? t->dev : NULL; }
fsdp_dtype_t fsdp_tensor_dtype(const fsdp_tensor_t *t) { return t ? t->dt : FSDP_DTYPE_F32; }
int fsdp_tensor_ndim(const fsdp_tensor_t *t) { return t ? t->ndim : 0; }
const int64_t *fsdp_tensor_shape(const fsdp_tensor_t *t) { return t ? t->shape : NULL; }
const int64_t *fsdp_tensor_strides(const fsdp_tensor_t *t) { return t ? t->stride : NULL; }
int64_t fsdp_tensor_storage_offset(const fsdp_tensor_t *t) { return t ? t->offset : 0; }
size_t fsdp_tensor_storage_bytes(const fsdp_tensor_t *t) { return t ? t->st->bytes : 0; }

int64_t fsdp_tensor_size(const fsdp_tensor_t *t, int d) {
    if (!t) return 0;
    if (d < 0) d += t->ndim;
    return d >= 0 && d < t->ndim ? t->shape[d] : 0;
}

int64_t fsdp_tensor_numel(const fsdp_tensor_t *t) {
    return t ? fsdp__shape_numel(t->ndim, t->shape) : 0;
}

bool fsdp_tensor_is_contiguous(const fsdp_tensor_t *t) {
    if (!t) return false;
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->stride[i] != s) return false;
        s *= t->shape[i];
    }
    return true;
}

bool fsdp_tensor_same_storage(const fsdp_tensor_t *a, const fsdp_tensor_t *b) {
    return a && b && a->st == b->st;
}

void *fsdp_tensor_data(const fsdp_tensor_t *t) {
    if (!t || !t->st->ptr) return NULL;
    return (char *)t->st->ptr + (size_t)t->offset * fsdp_dtype_size(t->dt);
}

int fsdp_tensor_set_name(fsdp_tensor_t *t, const char *name) {
    if (!t) return FSDP_EINVAL;
    char *copy = name ? strdup(name) : NULL;
    if (name && !copy) return fsdp__ctx_err(t->ctx, FSDP_ENOMEM, "fsdp_tensor_set_name: no memory");
    free(t->name);
    t->name = copy;
    return FSDP_OK;
}

const char *fsdp_tensor_name(const fsdp_tensor_t *t) {
    return t && t->name ? t->name : "";
}

/* ---- freeing and restoring storage ------------------------------------------------------ */

int fsdp_tensor_storage_resize(fsdp_tensor_t *t, size_t bytes) {
    if (!t) return FSDP_EINVAL;
    struct fsdp_storage *st = t->st;
    if (!st->owned)
        return fsdp__op_err(t, FSDP_EINVAL, "fsdp_tensor_storage_resize",
                            "the storage of '%s' wraps user memory", fsdp_tensor_name(t));
    if (bytes != 0 && bytes != st->full_bytes)
        return fsdp__op_err(t, FSDP_EINVAL, "fsdp_tensor_storage_resize",
                            "%zu bytes: a storage is either freed (0) or restored to its %zu "
                            "bytes",
                            bytes, st->full_bytes);
    if (bytes == st->bytes) return FSDP_OK;
    if (bytes == 0) {
        fsdp_device_free(st->dev, st->ptr);
        st->ptr = NULL;
        st->bytes = 0;
        return FSDP_OK;
    }
    int rc = fsdp_device_alloc(st->dev, st->cat, bytes, &st->ptr);
    if (rc < 0) return rc;
    st->bytes = bytes;
    return FSDP_OK;
}

int fsdp__tensor_storage_alloc_on(fsdp_tensor_t *t, fsdp_stream_t *stream) {
    struct fsdp_storage *st = t->st;
    if (!st->owned || st->bytes != 0)
        return fsdp__op_err(t, FSDP_EINVAL, "fsdp__tensor_storage_alloc_on",
                            "the storage of '%s' %s", fsdp_tensor_name(t),
                            st->owned ? "is allocated already" : "wraps user memory");
    int rc = fsdp__device_alloc_on(st->dev, st->cat, st->full_bytes, stream, &st->ptr);
    if (rc < 0) return rc;
    st->bytes = st->full_bytes;
    return FSDP_OK;
}

/* ---- gradients ------------------------------------------------------------------------------ */

int fsdp__tensor_set_data(fsdp_tensor_t *t, fsdp_tensor_t *src) {
    if (t->dt != src->dt || t->dev != src->dev || t->ctx != src->ctx)
        return fsdp__op_err(t, FSDP_EINVAL, "set_data",
                            "'%s' and its new data differ in dtype, device or context",
                            fsdp_tensor_name(t));
    if (t->st != src->st) {
        atomic_fetch_add(&src->st->refs, 1);
        storage_release(t->st);
        t->st = src->st;
    }
    t->offset = src->offset;
    t->ndim = src->ndim;
    memcpy(t->shape, src->shape, sizeof t->shape);
    memcpy(t->stride, src->stride, sizeof t->stride);
    return FSDP_OK;
}

int fsdp_tensor_set_data(fsdp_tensor_t *t, fsdp_tensor_t *src) {
    fsdp_ctx_t *ctx = t ? t->ctx : src ? src->ctx : NULL;
    if (!t || !src) return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_tensor_set_data: NULL argument");
    if (t == src) return FSDP_OK;
    return fsdp__tensor_set_data(t, src);
}

int fsdp_tensor_set_requires_grad(fsdp_tensor_t *t, bool requires_grad) {
    if (!t) return FSDP_EINVAL;
    if (t->slot >= 0 && !requires_grad)
        return fsdp__op_err(t, FSDP_EINVAL, "fsdp_tensor_set_requires_grad",
                            "'%s' is not a leaf; use fsdp_detach()", fsdp_tensor_name(t));
    if (requires_grad && !fsdp_dtype_is_float(t->dt))
        return fsdp__op_err(t, FSDP_EINVAL, "fsdp_tensor_set_requires_grad",
                            "only float tensors can require a gradient ('%s' is %s)",
                            fsdp_tensor_name(t), fsdp_dtype_name(t->dt));
    t->requires_grad = requires_grad;
    return FSDP_OK;
}

bool fsdp_tensor_requires_grad(const fsdp_tensor_t *t) { return t && t->requires_grad; }
bool fsdp_tensor_is_leaf(const fsdp_tensor_t *t) { return t && t->slot < 0; }
fsdp_tensor_t *fsdp_tensor_grad(const fsdp_tensor_t *t) { return t ? t->grad : NULL; }

int fsdp_tensor_set_grad(fsdp_tensor_t *t, fsdp_tensor_t *grad) {
    if (!t) return FSDP_EINVAL;
    if (grad) {
        if (grad == t)
            return fsdp__op_err(t, FSDP_EINVAL, "fsdp_tensor_set_grad",
                                "a tensor cannot be its own gradient");
        if (grad->ndim != t->ndim ||
            memcmp(grad->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim) != 0 ||
            !fsdp_dtype_is_float(grad->dt)) {
            char a[200], b[200];
            return fsdp__op_err(t, FSDP_EINVAL, "fsdp_tensor_set_grad",
                                "gradient %s does not fit '%s' %s",
                                fsdp_tensor_describe(grad, b, sizeof b), fsdp_tensor_name(t),
                                fsdp_tensor_describe(t, a, sizeof a));
        }
        if (grad->ctx != t->ctx || grad->dev != t->dev)
            return fsdp__op_err(t, FSDP_EINVAL, "fsdp_tensor_set_grad",
                                "gradient of '%s' is on another device or context",
                                fsdp_tensor_name(t));
        fsdp_tensor_retain(grad);
    }
    fsdp_tensor_release(t->grad);
    t->grad = grad;
    t->grad_fresh = false; /* the caller's gradient is added to, never overwritten */
    return FSDP_OK;
}

int fsdp_tensor_zero_grad(fsdp_tensor_t *t, bool set_to_none) {
    if (!t) return FSDP_EINVAL;
    if (!t->grad) return FSDP_OK;
    if (set_to_none) return fsdp_tensor_set_grad(t, NULL);
    return fsdp_tensor_zero_(t->grad);
}

int fsdp_tensor_add_grad_hook(fsdp_tensor_t *leaf, fsdp_grad_hook_fn fn, void *arg) {
    if (!leaf || !fn) return fsdp__ctx_err(leaf ? leaf->ctx : NULL, FSDP_EINVAL,
                                           "fsdp_tensor_add_grad_hook: NULL argument");
    if (leaf->slot >= 0)
        return fsdp__op_err(leaf, FSDP_EINVAL, "fsdp_tensor_add_grad_hook",
                            "'%s' is not a leaf", fsdp_tensor_name(leaf));
    struct fsdp_grad_hook *h = calloc(1, sizeof *h);
    if (!h) return fsdp__op_err(leaf, FSDP_ENOMEM, "fsdp_tensor_add_grad_hook", "no memory");
    h->fn = fn;
    h->arg = arg;
    /* Appended, so hooks run in registration order. */
    struct fsdp_grad_hook **p = &leaf->hooks;
    while (*p) p = &(*p)->next;
    *p = h;
    return FSDP_OK;
}

int fsdp_tensor_remove_grad_hook(fsdp_tensor_t *leaf, fsdp_grad_hook_fn fn, void *arg) {
    if (!leaf) return 0;
    int n = 0;
    struct fsdp_grad_hook **h = &leaf->hooks;
    while (*h) {
        if ((*h)->fn == fn && (*h)->arg == arg) {
            struct fsdp_grad_hook *dead = *h;
            *h = dead->next;
            free(dead);
            n++;
        } else {
            h = &(*h)->next;
        }
    }
    return n;
}

bool fsdp_tensor_has_grad_hook(const fsdp_tensor_t *leaf, fsdp_grad_hook_fn fn) {
    for (const struct fsdp_grad_hook *h = leaf ? leaf->hooks : NULL; h; h = h->next)
        if (h->fn == fn) return true;
    return false;
}
