/*
 * tensor.c: tensor and storage lifetimes, properties, host copies, gradients, and the helpers
 * every operation shares (dtype promotion, broadcasting, error messages).
 *
 * A tensor header is small and owned by whoever holds a reference; its storage is shared by
 * every view and freed through the device when the last view goes.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/tensor_impl.h"

/* ---- small helpers ------------------------------------------------------------------------- */

int64_t fsdp__shape_numel(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    return n;
}

void fsdp__contiguous_strides(int ndim, const int64_t *shape, int64_t *stride) {
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        stride[i] = s;
        s *= shape[i] > 0 ? shape[i] : 1;
    }
}

char *fsdp__shape_str(int ndim, const int64_t *shape, char *buf, size_t len) {
    size_t at = 0;
    if (len == 0) return buf;
    buf[0] = '\0';
    at += (size_t)snprintf(buf + at, at < len ? len - at : 0, "[");
    for (int i = 0; i < ndim && at < len; i++)
        at += (size_t)snprintf(buf + at, len - at, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (at < len) snprintf(buf + at, len - at, "]");
    return buf;
}

char *fsdp_tensor_describe(const fsdp_tensor_t *t, char *buf, size_t len) {
    if (!buf || len == 0) return buf;
    if (!t) {
        snprintf(buf, len, "(null)");
        return buf;
    }
    char shp[160];
    fsdp__shape_str(t->ndim, t->shape, shp, sizeof shp);
    snprintf(buf, len, "%s%s", fsdp_dtype_name(t->dt), shp);
    return buf;
}

int fsdp__op_err(const fsdp_tensor_t *t, int rc, const char *op, const char *fmt, ...) {
    char msg[FSDP_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return fsdp__ctx_err(t ? t->ctx : NULL, rc, "%s: %s", op, msg);
}

int fsdp__check_tensor(fsdp_ctx_t *ctx, const fsdp_tensor_t *t, const char *op, const char *arg) {
    if (t) return FSDP_OK;
    return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: argument '%s' is NULL", op, arg);
}

int fsdp__check_float(fsdp_ctx_t *ctx, const fsdp_tensor_t *t, const char *op, const char *arg) {
    int rc = fsdp__check_tensor(ctx, t, op, arg);
    if (rc < 0) return rc;
    char d[96];
    if (fsdp__compute_dtype(t->dt) < 0)
        return fsdp__op_err(t, FSDP_EINVAL, op, "%s %s must be a float tensor", arg,
                            fsdp_tensor_describe(t, d, sizeof d));
    if (!t->st->ptr && fsdp_tensor_numel(t) > 0)
        return fsdp__op_err(t, FSDP_EINVAL, op, "%s %s has no storage (freed by a resize)", arg,
                            fsdp_tensor_describe(t, d, sizeof d));
    return 0;
}

int fsdp__check_same_device(const fsdp_tensor_t *a, const fsdp_tensor_t *b, const char *op) {
    if (a->ctx != b->ctx)
        return fsdp__op_err(a, FSDP_EINVAL, op, "operands belong to different contexts (ranks)");
    if (a->dev != b->dev)
        return fsdp__op_err(a, FSDP_EINVAL, op, "operands are on different devices (%s and %s)",
                            a->dev->name, b->dev->name);
    return FSDP_OK;
}

int fsdp__compute_dtype(fsdp_dtype_t dt) {
    switch (dt) {
    case FSDP_DTYPE_F32:
    case FSDP_DTYPE_F16:
    case FSDP_DTYPE_BF16: return FSDP_DTYPE_F32;
    case FSDP_DTYPE_F64: return FSDP_DTYPE_F64;
    default: return -1;
    }
}

int fsdp__norm_dim(const fsdp_tensor_t *t, int dim, int ndim, const char *op, int *out) {
    int d = dim < 0 ? dim + ndim : dim;
    if (d < 0 || d >= ndim) {
        char shp[160];
        return fsdp__op_err(t, FSDP_EINVAL, op, "dim %d is out of range for a tensor of shape %s",
                            dim, fsdp__shape_str(t->ndim, t->shape, shp, sizeof shp));
    }
    *out = d;
    return FSDP_OK;
}

fsdp_mem_cat_t fsdp__op_cat(const fsdp_ctx_t *ctx) {
    /* Set by the autograd engine (gradients while the rank runs backward). */
    return (fsdp_mem_cat_t)atomic_load(&ctx->tensor_mem_cat);
}

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

/* ---- data movement ----------------------------------------------------------------------- */

/* A contiguous tensor with t's values: t retained when contiguous, else a strided copy. */
static int materialize(fsdp_tensor_t *t, fsdp_dtype_t dt, fsdp_tensor_t **out) {
    *out = NULL;
    fsdp_tensor_t *c = NULL;
    int rc;
    if (fsdp_tensor_is_contiguous(t)) {
        c = fsdp_tensor_retain(t);
    } else {
        rc = fsdp__tensor_new(t->ctx, t->dev, t->dt, t->ndim, t->shape, fsdp__op_cat(t->ctx), &c);
        if (rc < 0) return rc;
        if (fsdp_tensor_numel(t) > 0) {
            if (!t->st->ptr) {
                fsdp_tensor_release(c);
                return fsdp__op_err(t, FSDP_EINVAL, "tensor", "storage has been freed");
            }
            rc = t->dev->ops->copy_strided(t->dev, t->dt, t->ndim, t->shape, fsdp_tensor_data(c),
                                           fsdp_tensor_data(t), t->stride);
            if (rc < 0) {
                fsdp_tensor_release(c);
                return rc;
            }
        }
    }
    if (c->dt == dt) {
        *out = c;
        return FSDP_OK;
    }
    fsdp_tensor_t *d = NULL;
    rc = fsdp__tensor_new(t->ctx, t->dev, dt, t->ndim, t->shape, fsdp__op_cat(t->ctx), &d);
    if (rc == 0 && fsdp_tensor_numel(c) > 0)
        rc = t->dev->ops->cast(t->dev, dt, fsdp_tensor_data(d), c->dt, fsdp_tensor_data(c),
                               (size_t)fsdp_tensor_numel(c));
    fsdp_tensor_release(c);
    if (rc < 0) {
        fsdp_tensor_release(d);
        return rc;
    }
    *out = d;
    return FSDP_OK;
}

int fsdp__as_contig(fsdp_tensor_t *t, fsdp_dtype_t dt, fsdp_tensor_t **out) {
    return materialize(t, dt, out);
}

int fsdp__round_to(fsdp_tensor_t **t, fsdp_dtype_t dt) {
    if ((*t)->dt == dt) return FSDP_OK;
    fsdp_tensor_t *r = NULL;
    int rc = materialize(*t, dt, &r);
    if (rc < 0) return rc;
    fsdp_tensor_release(*t);
    *t = r;
    return FSDP_OK;
}

static int check_host_bytes(const fsdp_tensor_t *t, const char *op, size_t bytes) {
    size_t want = (size_t)fsdp_tensor_numel(t) * fsdp_dtype_size(t->dt);
    if (bytes != want) {
        char d[200];
        return fsdp__op_err(t, FSDP_EINVAL, op, "%zu bytes given for %s '%s', which holds %zu",
                            bytes, fsdp_tensor_describe(t, d, sizeof d), fsdp_tensor_name(t),
                            want);
    }
    if (want && !t->st->ptr)
        return fsdp__op_err(t, FSDP_EINVAL, op, "the storage of '%s' has been freed",
                            fsdp_tensor_name(t));
    return FSDP_OK;
}

int fsdp_tensor_to_host(const fsdp_tensor_t *t, void *dst, size_t bytes) {
    if (!t) return FSDP_EINVAL;
    int rc = check_host_bytes(t, "fsdp_tensor_to_host", bytes);
    if (rc < 0 || bytes == 0) return rc;
    if (!dst) return fsdp__op_err(t, FSDP_EINVAL, "fsdp_tensor_to_host", "dst is NULL");
    fsdp_tensor_t *c = NULL;
    rc = materialize((fsdp_tensor_t *)t, t->dt, &c);
    if (rc < 0) return rc;
    rc = fsdp_device_memcpy(t->dev, dst, fsdp_tensor_data(c), bytes, FSDP_COPY_D2H, NULL);
    fsdp_tensor_release(c);
    return rc;
}

int fsdp_tensor_copy_from_host(fsdp_tensor_t *t, const void *src, size_t bytes) {
    if (!t) return FSDP_EINVAL;
    int rc = check_host_bytes(t, "fsdp_tensor_copy_from_host", bytes);
    if (rc < 0 || bytes == 0) return rc;
    if (!src) return fsdp__op_err(t, FSDP_EINVAL, "fsdp_tensor_copy_from_host", "src is NULL");
    if (t->slot >= 0)
        return fsdp__op_err(t, FSDP_EINVAL, "fsdp_tensor_copy_from_host",
                            "'%s' is the output of a recorded operation; writing it would make "
                            "its gradient wrong",
                            fsdp_tensor_name(t));
    if (fsdp_tensor_is_contiguous(t))
        return fsdp_device_memcpy(t->dev, fsdp_tensor_data(t), src, bytes, FSDP_COPY_H2D, NULL);
    /* A strided destination: stage contiguously on the device, then scatter. */
    fsdp_tensor_t *tmp = NULL;
    rc = fsdp__tensor_new(t->ctx, t->dev, t->dt, t->ndim, t->shape, FSDP_MEM_OTHER, &tmp);
    if (rc < 0) return rc;
    rc = fsdp_device_memcpy(t->dev, fsdp_tensor_data(tmp), src, bytes, FSDP_COPY_H2D, NULL);
    if (rc == 0) rc = fsdp_tensor_copy_(t, tmp);
    fsdp_tensor_release(tmp);
    return rc;
}

static int scatter_strided(fsdp_tensor_t *dst, fsdp_tensor_t *src_contig) {
    /* The device vtable has no strided store, but binary() writes a contiguous y from strided
     * a and b. A strided destination is rare (copying into a transposed view); it is handled
     * here by walking the outer dimensions on the host and issuing one contiguous-row copy per
     * innermost run when dst's last stride is 1, or one element copy otherwise. */
    int nd = dst->ndim;
    size_t es = fsdp_dtype_size(dst->dt);
    int64_t inner = nd ? dst->shape[nd - 1] : 1;
    int64_t inner_stride = nd ? dst->stride[nd - 1] : 1;
    int64_t rows = inner ? fsdp_tensor_numel(dst) / inner : 0;
    int64_t idx[FSDP_MAX_DIMS] = {0};
    char *dbase = (char *)dst->st->ptr + (size_t)dst->offset * es;
    const char *s = fsdp_tensor_data(src_contig);
    for (int64_t r = 0; r < rows; r++) {
        int64_t off = 0;
        for (int d = 0; d < nd - 1; d++) off += idx[d] * dst->stride[d];
        if (inner_stride == 1) {
            int rc = fsdp_device_memcpy(dst->dev, dbase + (size_t)off * es, s, (size_t)inner * es,
                                        FSDP_COPY_D2D, NULL);
            if (rc < 0) return rc;
        } else {
            for (int64_t j = 0; j < inner; j++) {
                int rc = fsdp_device_memcpy(dst->dev, dbase + (size_t)(off + j * inner_stride) * es,
                                            s + (size_t)j * es, es, FSDP_COPY_D2D, NULL);
                if (rc < 0) return rc;
            }
        }
        s += (size_t)inner * es;
        for (int d = nd - 2; d >= 0; d--) {
            if (++idx[d] < dst->shape[d]) break;
            idx[d] = 0;
        }
    }
    return FSDP_OK;
}

int fsdp_tensor_copy_(fsdp_tensor_t *dst, const fsdp_tensor_t *src) {
    if (!dst || !src) return fsdp__ctx_err(dst ? dst->ctx : src ? src->ctx : NULL, FSDP_EINVAL,
                                           "fsdp_tensor_copy_: NULL tensor");
    int rc = fsdp__check_same_device(dst, src, "fsdp_tensor_copy_");
    if (rc < 0) return rc;
    if (fsdp_tensor_numel(dst) != fsdp_tensor_numel(src) || dst->ndim != src->ndim ||
        memcmp(dst->shape, src->shape, sizeof(int64_t) * (size_t)dst->ndim) != 0) {
        char a[200], b[200];
        return fsdp__op_err(dst, FSDP_EINVAL, "fsdp_tensor_copy_",
                            "destination '%s' %s and source %s differ in shape",
                            fsdp_tensor_name(dst), fsdp_tensor_describe(dst, a, sizeof a),
                            fsdp_tensor_describe(src, b, sizeof b));
    }
    if (fsdp_tensor_numel(dst) == 0) return FSDP_OK;
    if (!dst->st->ptr || !src->st->ptr)
        return fsdp__op_err(dst, FSDP_EINVAL, "fsdp_tensor_copy_", "a storage has been freed");
    fsdp_tensor_t *c = NULL;
    rc = materialize((fsdp_tensor_t *)src, dst->dt, &c);
    if (rc < 0) return rc;
    if (fsdp_tensor_is_contiguous(dst)) {
        if (fsdp_tensor_data(dst) != fsdp_tensor_data(c))
            rc = fsdp_device_memcpy(dst->dev, fsdp_tensor_data(dst), fsdp_tensor_data(c),
                                    (size_t)fsdp_tensor_numel(dst) * fsdp_dtype_size(dst->dt),
                                    FSDP_COPY_D2D, NULL);
    } else {
        rc = scatter_strided(dst, c);
    }
    fsdp_tensor_release(c);
    return rc;
}

int fsdp_tensor_fill_(fsdp_tensor_t *t, double value) {
    if (!t) return FSDP_EINVAL;
    int64_t n = fsdp_tensor_numel(t);
    if (n == 0) return FSDP_OK;
    if (!t->st->ptr) return fsdp__op_err(t, FSDP_EINVAL, "fsdp_tensor_fill_", "storage freed");
    if (fsdp_tensor_is_contiguous(t))
        return t->dev->ops->fill(t->dev, t->dt, (size_t)n, value, fsdp_tensor_data(t));
    fsdp_tensor_t *tmp = NULL;
    int rc = fsdp__tensor_new(t->ctx, t->dev, t->dt, t->ndim, t->shape, FSDP_MEM_OTHER, &tmp);
    if (rc < 0) return rc;
    rc = t->dev->ops->fill(t->dev, t->dt, (size_t)n, value, fsdp_tensor_data(tmp));
    if (rc == 0) rc = scatter_strided(t, tmp);
    fsdp_tensor_release(tmp);
    return rc;
}

int fsdp_tensor_zero_(fsdp_tensor_t *t) { return fsdp_tensor_fill_(t, 0.0); }

int fsdp_tensor_clone(const fsdp_tensor_t *t, fsdp_mem_cat_t cat, fsdp_tensor_t **out) {
    if (!out) return FSDP_EINVAL;
    *out = NULL;
    if (!t) return FSDP_EINVAL;
    int rc = fsdp__tensor_new(t->ctx, t->dev, t->dt, t->ndim, t->shape, cat, out);
    if (rc < 0) return rc;
    rc = fsdp_tensor_copy_(*out, t);
    if (rc < 0) {
        fsdp_tensor_release(*out);
        *out = NULL;
    }
    return rc;
}

int fsdp_tensor_item(const fsdp_tensor_t *t, int64_t i, double *out) {
    if (!t || !out) return FSDP_EINVAL;
    int64_t n = fsdp_tensor_numel(t);
    if (i < 0 || i >= n)
        return fsdp__op_err(t, FSDP_EINVAL, "fsdp_tensor_item", "index %lld outside [0, %lld)",
                            (long long)i, (long long)n);
    /* Locate element i through the strides, then read one element. */
    int64_t off = t->offset, rem = i;
    for (int d = t->ndim - 1; d >= 0; d--) {
        off += (rem % t->shape[d]) * t->stride[d];
        rem /= t->shape[d];
    }
    if (!t->st->ptr) return fsdp__op_err(t, FSDP_EINVAL, "fsdp_tensor_item", "storage freed");
    size_t es = fsdp_dtype_size(t->dt);
    unsigned char raw[8];
    int rc = fsdp_device_memcpy(t->dev, raw, (char *)t->st->ptr + (size_t)off * es, es,
                                FSDP_COPY_D2H, NULL);
    if (rc < 0) return rc;
    double d = 0;
    rc = fsdp_dtype_convert(&d, FSDP_DTYPE_F64, raw, t->dt, 1);
    *out = d;
    return rc;
}

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

/* ---- broadcasting ------------------------------------------------------------------------- */

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

int fsdp__broadcast_shape(const fsdp_tensor_t *a, const fsdp_tensor_t *b, const char *op,
                          int *ndim, int64_t *shape) {
    int nd = FSDP_MAX(a->ndim, b->ndim);
    for (int i = 0; i < nd; i++) {
        int ia = a->ndim - nd + i, ib = b->ndim - nd + i;
        int64_t sa = ia >= 0 ? a->shape[ia] : 1, sb = ib >= 0 ? b->shape[ib] : 1;
        if (sa != sb && sa != 1 && sb != 1) {
            char x[160], y[160];
            return fsdp__op_err(a, FSDP_EINVAL, op,
                                "shapes %s and %s do not broadcast (dimension %d: %lld vs %lld)",
                                fsdp__shape_str(a->ndim, a->shape, x, sizeof x),
                                fsdp__shape_str(b->ndim, b->shape, y, sizeof y), i,
                                (long long)sa, (long long)sb);
        }
        shape[i] = sa == 1 ? sb : sa;
    }
    *ndim = nd;
    return FSDP_OK;
}

void fsdp__broadcast_strides(const fsdp_tensor_t *t, int ndim, const int64_t *shape,
                             int64_t *stride) {
    for (int i = 0; i < ndim; i++) {
        int it = t->ndim - ndim + i;
        stride[i] = (it < 0 || (t->shape[it] == 1 && shape[i] != 1)) ? 0 : t->stride[it];
    }
}

int fsdp__sum_to_shape(fsdp_tensor_t *g, int ndim, const int64_t *shape, fsdp_tensor_t **out) {
    *out = NULL;
    if (g->ndim == ndim && memcmp(g->shape, shape, sizeof(int64_t) * (size_t)ndim) == 0) {
        *out = fsdp_tensor_retain(g);
        return FSDP_OK;
    }
    /* Dimensions to sum: the leading ones g has beyond ndim, and those where shape is 1. */
    int dims[FSDP_MAX_DIMS], nd = 0;
    int lead = g->ndim - ndim;
    for (int i = 0; i < g->ndim; i++) {
        int is = i - lead;
        if (is < 0 || (shape[is] == 1 && g->shape[i] != 1)) dims[nd++] = i;
    }
    fsdp_tensor_t *s = NULL;
    int rc;
    if (nd == 0) {
        s = fsdp_tensor_retain(g);
    } else {
        rc = fsdp_sum(g, nd, dims, true, &s);
        if (rc < 0) return rc;
    }
    rc = fsdp_reshape(s, ndim, shape, out);
    fsdp_tensor_release(s);
    return rc;
}
