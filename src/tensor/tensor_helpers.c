/* SPDX-License-Identifier: MIT */
/*
 * tensor_helpers.c: the helpers every operation (and the autograd engine) shares: shape
 * arithmetic and text, argument checks and error messages, the compute dtype, dimension
 * normalisation, the memory category of new tensors, and broadcasting.
 *
 * They keep no state. An error is reported on the context of the tensor it names (or on the
 * context passed in, when the tensor is the missing argument), prefixed with the operation.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "tensor/tensor_impl.h"

/* ---- small helpers ------------------------------------------------------------------------- */

int64_t fsdp__shape_numel(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= shape[i];
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

fsdp_dtype_t fsdp__kernel_dtype(const fsdp_device_t *dev, fsdp_dtype_t dt) {
    if ((dt == FSDP_DTYPE_BF16 || dt == FSDP_DTYPE_F16) && dev &&
        (dev->lp_native & FSDP__DT_BIT(dt)))
        return dt;
    return (fsdp_dtype_t)fsdp__compute_dtype(dt);
}

int fsdp__compute_dtype(fsdp_dtype_t dt) {
    switch (dt) {
    case FSDP_DTYPE_F32:
    case FSDP_DTYPE_F16:
    case FSDP_DTYPE_BF16:
        return FSDP_DTYPE_F32;
    case FSDP_DTYPE_F64:
        return FSDP_DTYPE_F64;
    default:
        return -1;
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

/* ---- broadcasting ------------------------------------------------------------------------- */

int fsdp__broadcast_shape(const fsdp_tensor_t *a, const fsdp_tensor_t *b, const char *op, int *ndim,
                          int64_t *shape) {
    int nd = FSDP_MAX(a->ndim, b->ndim);
    for (int i = 0; i < nd; i++) {
        int ia = a->ndim - nd + i, ib = b->ndim - nd + i;
        int64_t sa = ia >= 0 ? a->shape[ia] : 1, sb = ib >= 0 ? b->shape[ib] : 1;
        if (sa != sb && sa != 1 && sb != 1) {
            char x[160], y[160];
            return fsdp__op_err(a, FSDP_EINVAL, op,
                                "shapes %s and %s do not broadcast (dimension %d: %lld vs %lld)",
                                fsdp__shape_str(a->ndim, a->shape, x, sizeof x),
                                fsdp__shape_str(b->ndim, b->shape, y, sizeof y), i, (long long)sa,
                                (long long)sb);
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
