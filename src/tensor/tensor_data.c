/* SPDX-License-Identifier: MIT */
/*
 * tensor_data.c: moving tensor data: contiguous and converted copies for the operations
 * (fsdp__as_contig, fsdp__round_to), copies to and from the host, copies between tensors,
 * fills, clones and reading one element.
 *
 * Any strides are accepted. A strided source is gathered by the device's copy_strided; a
 * strided destination, which the device vtable cannot write, is scattered from a contiguous
 * copy by scatter_strided. A tensor whose storage was freed by fsdp_tensor_storage_resize is
 * refused with an error rather than read, and nothing here records on the tape.
 */
#include <string.h>

#include "tensor/tensor_impl.h"

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

bool fsdp__overwritable(const fsdp_tensor_t *g, fsdp_dtype_t dt, int ndim, const int64_t *shape) {
    if (!g || !g->st || g->dt != dt || g->ndim != ndim || g->offset != 0 || g->requires_grad)
        return false;
    if (atomic_load(&g->refs) != 1 || atomic_load(&g->st->refs) != 1 || !g->st->owned) return false;
    for (int i = 0; i < ndim; i++)
        if (g->shape[i] != shape[i]) return false;
    return fsdp_tensor_is_contiguous(g) &&
           (size_t)fsdp_tensor_numel(g) * fsdp_dtype_size(dt) == g->st->bytes;
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
                            bytes, fsdp_tensor_describe(t, d, sizeof d), fsdp_tensor_name(t), want);
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
        for (int d = 0; d < nd - 1; d++)
            off += idx[d] * dst->stride[d];
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
    if (!dst || !src)
        return fsdp__ctx_err(dst   ? dst->ctx
                             : src ? src->ctx
                                   : NULL,
                             FSDP_EINVAL, "fsdp_tensor_copy_: NULL tensor");
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

int fsdp_tensor_zero_(fsdp_tensor_t *t) {
    return fsdp_tensor_fill_(t, 0.0);
}

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
