/* SPDX-License-Identifier: MIT */
/*
 * ops_reduce.c: sums and means over sets of dimensions, concatenation and splitting, and their
 * gradients.
 *
 * Reductions run on the device's reduce_sum kernel, which sums the middle axis of a contiguous
 * (outer, r, inner) view: each maximal run of adjacent reduced dimensions is one kernel call,
 * so any set of dimensions costs at most ceil(ndim / 2) passes. A mean is a sum whose last pass
 * is scaled by 1 / count. Concatenation and splitting only move elements (copy_strided, in the
 * tensors' own dtype, any dtype), so they never round.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autograd/autograd_impl.h"
#include "tensor/tensor_impl.h"

/* Kernels get at least one dimension: a scalar is shape [1] read with stride 0. */
static int kernel_geometry(int ndim, const int64_t *shape, int64_t *stride, int64_t *kshape) {
    if (ndim == 0) {
        kshape[0] = 1;
        stride[0] = 0;
        return 1;
    }
    memcpy(kshape, shape, sizeof(int64_t) * (size_t)ndim);
    return ndim;
}

static int64_t prod(const int64_t *shape, int from, int to) {
    int64_t p = 1;
    for (int i = from; i < to; i++)
        p *= shape[i];
    return p;
}

/* ---- sum and mean --------------------------------------------------------------------------- */

/* i[0] = bit mask of the reduced dimensions, f[0] = the scale (1, or 1 / count for a mean). The
 * gradient is g broadcast back over the reduced dimensions, times the scale. */
static int reduce_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                           fsdp_tensor_t **gin) {
    fsdp_tensor_t *g = gout[0], *gc = NULL, *gx = NULL;
    int nd = node->in_ndim[0], rc;
    const int64_t *shape = node->in_shape[0];
    int64_t kshape[FSDP_MAX_DIMS], stride[FSDP_MAX_DIMS], ks[FSDP_MAX_DIMS];
    fsdp_dtype_t cdt = fsdp__kernel_dtype(g->dev, node->in_dt[0]);
    for (int d = 0; d < nd; d++)
        kshape[d] = (node->i[0] >> d) & 1 ? 1 : shape[d];
    fsdp__contiguous_strides(nd, kshape, stride);
    for (int d = 0; d < nd; d++)
        if ((node->i[0] >> d) & 1) stride[d] = 0;
    /* g is laid out like the keepdim shape whether or not the forward kept the dimensions. */
    FSDP_TRY(rc, out, fsdp__as_contig(g, cdt, &gc));
    FSDP_TRY(rc, out, fsdp__tensor_new(g->ctx, g->dev, cdt, nd, shape, fsdp__op_cat(g->ctx), &gx));
    int64_t n = fsdp__shape_numel(nd, shape);
    if (n > 0) {
        int kn = kernel_geometry(nd, shape, stride, ks);
        FSDP_TRY(rc, out,
                 g->dev->ops->copy_strided(g->dev, cdt, kn, ks, fsdp_tensor_data(gx),
                                           fsdp_tensor_data(gc), stride));
        if (node->f[0] != 1.0)
            FSDP_TRY(rc, out,
                     g->dev->ops->unary(g->dev, cdt, FSDP_UNARY_SCALE, (size_t)n, node->f[0],
                                        fsdp_tensor_data(gx), fsdp_tensor_data(gx)));
    }
    FSDP_TRY(rc, out, fsdp__round_to(&gx, node->in_dt[0]));
    gin[0] = gx;
    gx = NULL;
out:
    fsdp_tensor_release(gc);
    fsdp_tensor_release(gx);
    return rc;
}

static const struct fsdp__op_def def_sum = {"sum", reduce_backward};
static const struct fsdp__op_def def_mean = {"mean", reduce_backward};

static int reduce_op(fsdp_tensor_t *x, int ndims, const int *dims, bool keepdim, bool mean,
                     fsdp_tensor_t **out) {
    const char *op = mean ? "fsdp_mean" : "fsdp_sum";
    fsdp_ctx_t *ctx = x ? x->ctx : NULL;
    fsdp_tensor_t *cur = NULL, *next = NULL;
    struct fsdp__node *node = NULL;
    bool red[FSDP_MAX_DIMS] = {false};
    int64_t cshape[FSDP_MAX_DIMS], oshape[FSDP_MAX_DIMS];
    int ond = 0, rc;
    char desc[200];
    if (!out) return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: out is NULL", op);
    *out = NULL;
    FSDP_TRY(rc, fail, fsdp__check_tensor(ctx, x, op, "x"));
    if (fsdp__compute_dtype(x->dt) < 0) {
        rc = fsdp__op_err(x, FSDP_EINVAL, op, "argument 'x' is %s; a float tensor is required",
                          fsdp_tensor_describe(x, desc, sizeof desc));
        goto fail;
    }
    if (fsdp_tensor_numel(x) > 0 && !x->st->ptr) {
        rc = fsdp__op_err(x, FSDP_EINVAL, op, "the storage of argument 'x' has been freed");
        goto fail;
    }
    if (ndims < 0 || ndims > x->ndim || (ndims > 0 && !dims)) {
        rc = fsdp__op_err(x, FSDP_EINVAL, op, "%d dims%s for %s", ndims,
                          ndims > 0 && !dims ? " but dims is NULL" : "",
                          fsdp_tensor_describe(x, desc, sizeof desc));
        goto fail;
    }
    for (int i = 0; i < ndims; i++) {
        int d;
        FSDP_TRY(rc, fail, fsdp__norm_dim(x, dims[i], x->ndim, op, &d));
        if (red[d]) {
            rc = fsdp__op_err(x, FSDP_EINVAL, op, "dimension %d appears twice in dims of %s", d,
                              fsdp_tensor_describe(x, desc, sizeof desc));
            goto fail;
        }
        red[d] = true;
    }
    int nd = x->ndim;
    int64_t count = 1;
    for (int d = 0; d < nd; d++) {
        if (ndims == 0) red[d] = true;
        if (red[d]) count *= x->shape[d];
        if (!red[d] || keepdim) oshape[ond++] = red[d] ? 1 : x->shape[d];
        cshape[d] = x->shape[d];
    }
    /* The mean of no elements is NaN, as in PyTorch: 0 * inf from the kernel. */
    double alpha = mean ? 1.0 / (double)count : 1.0;
    fsdp_dtype_t cdt = fsdp__kernel_dtype(x->dev, x->dt);
    FSDP_TRY(rc, fail, fsdp__as_contig(x, cdt, &cur));
    /* Runs of adjacent reduced dimensions, each one kernel pass. */
    int rs[FSDP_MAX_DIMS], re[FSDP_MAX_DIMS], nruns = 0;
    for (int d = 0; d < nd; d++) {
        if (!red[d]) continue;
        if (d == 0 || !red[d - 1]) rs[nruns++] = d;
        re[nruns - 1] = d + 1;
    }
    bool empty_out = fsdp__shape_numel(ond, oshape) == 0;
    if (nruns == 0 || empty_out) {
        /* Nothing to sum (a scalar, or no element out): one pass with r = 1 copies and scales. */
        FSDP_TRY(rc, fail,
                 fsdp__tensor_new(ctx, x->dev, cdt, ond, oshape, fsdp__op_cat(ctx), &next));
        if (!empty_out)
            FSDP_TRY(rc, fail,
                     x->dev->ops->reduce_sum(x->dev, cdt, 1, 1, (size_t)fsdp_tensor_numel(x), alpha,
                                             fsdp_tensor_data(cur), fsdp_tensor_data(next)));
        fsdp_tensor_release(cur);
        cur = next;
        next = NULL;
    }
    for (int k = 0; k < nruns && !empty_out; k++) {
        bool last = k == nruns - 1;
        size_t outer = (size_t)prod(cshape, 0, rs[k]);
        size_t r = (size_t)prod(cshape, rs[k], re[k]);
        size_t inner = (size_t)prod(cshape, re[k], nd);
        for (int d = rs[k]; d < re[k]; d++)
            cshape[d] = 1;
        FSDP_TRY(rc, fail,
                 fsdp__tensor_new(ctx, x->dev, cdt, last ? ond : nd, last ? oshape : cshape,
                                  fsdp__op_cat(ctx), &next));
        FSDP_TRY(rc, fail,
                 x->dev->ops->reduce_sum(x->dev, cdt, outer, r, inner, last ? alpha : 1.0,
                                         fsdp_tensor_data(cur), fsdp_tensor_data(next)));
        fsdp_tensor_release(cur);
        cur = next;
        next = NULL;
    }
    FSDP_TRY(rc, fail, fsdp__round_to(&cur, x->dt));
    FSDP_TRY(rc, fail, fsdp__record(mean ? &def_mean : &def_sum, 1, &x, 1, &cur, &node));
    if (node) {
        node->i[0] = 0;
        for (int d = 0; d < nd; d++)
            if (red[d]) node->i[0] |= (int64_t)1 << d;
        node->f[0] = alpha;
    }
    *out = cur;
    return FSDP_OK;
fail:
    fsdp_tensor_release(cur);
    fsdp_tensor_release(next);
    return rc;
}

int fsdp_sum(fsdp_tensor_t *x, int ndims, const int *dims, bool keepdim, fsdp_tensor_t **out) {
    return reduce_op(x, ndims, dims, keepdim, false, out);
}

int fsdp_mean(fsdp_tensor_t *x, int ndims, const int *dims, bool keepdim, fsdp_tensor_t **out) {
    return reduce_op(x, ndims, dims, keepdim, true, out);
}

/* ---- cat ------------------------------------------------------------------------------------ */

/* Copies the n inputs into y, contiguous, along dimension d. The device has only a strided
 * gather into a contiguous destination, so when d is not the outermost non-trivial dimension
 * the pieces go into a buffer with d moved to the front (where each piece is one contiguous
 * block) and one more gather puts the buffer in y's order. */
static int cat_copy(fsdp_tensor_t *const *ts, int n, int d, fsdp_tensor_t *y) {
    fsdp_device_t *dev = y->dev;
    fsdp_tensor_t *tmp = NULL;
    int nd = y->ndim, rc = FSDP_OK;
    size_t es = fsdp_dtype_size(y->dt);
    int64_t outer = prod(y->shape, 0, d), inner = prod(y->shape, d + 1, nd);
    int64_t pshape[FSDP_MAX_DIMS], pstride[FSDP_MAX_DIMS], cs[FSDP_MAX_DIMS];
    char *yb = fsdp_tensor_data(y);
    if (outer == 1) {
        int64_t off = 0;
        for (int i = 0; i < n; i++) {
            if (fsdp_tensor_numel(ts[i]) > 0)
                FSDP_TRY(rc, out,
                         dev->ops->copy_strided(dev, y->dt, nd, ts[i]->shape,
                                                yb + (size_t)(off * inner) * es,
                                                fsdp_tensor_data(ts[i]), ts[i]->stride));
            off += ts[i]->shape[d];
        }
        goto out;
    }
    pshape[0] = y->shape[d];
    for (int k = 0, j = 1; k < nd; k++)
        if (k != d) pshape[j++] = y->shape[k];
    FSDP_TRY(rc, out, fsdp__tensor_new(y->ctx, dev, y->dt, nd, pshape, fsdp__op_cat(y->ctx), &tmp));
    char *tb = fsdp_tensor_data(tmp);
    int64_t rest = outer * inner, off = 0;
    for (int i = 0; i < n; i++) {
        const fsdp_tensor_t *t = ts[i];
        pshape[0] = t->shape[d];
        pstride[0] = t->stride[d];
        for (int k = 0, j = 1; k < nd; k++)
            if (k != d) pstride[j++] = t->stride[k];
        if (fsdp_tensor_numel(t) > 0)
            FSDP_TRY(rc, out,
                     dev->ops->copy_strided(dev, y->dt, nd, pshape, tb + (size_t)(off * rest) * es,
                                            fsdp_tensor_data(t), pstride));
        off += t->shape[d];
    }
    fsdp__contiguous_strides(nd, tmp->shape, cs);
    for (int k = 0; k < nd; k++)
        pstride[k] = k == d ? cs[0] : k < d ? cs[k + 1] : cs[k];
    FSDP_TRY(rc, out, dev->ops->copy_strided(dev, y->dt, nd, y->shape, yb, tb, pstride));
out:
    fsdp_tensor_release(tmp);
    return rc;
}

/* i[0] = the dimension; extra = the n sizes along it. Each input gets its slice of g. */
static int cat_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout, fsdp_tensor_t **gin) {
    const int64_t *sizes = node->extra;
    fsdp_tensor_t *v = NULL;
    int rc = FSDP_OK;
    int64_t off = 0;
    for (int i = 0; i < node->nin; i++) {
        if (node->needs[i]) {
            FSDP_TRY(rc, out, fsdp_narrow(gout[0], (int)node->i[0], off, sizes[i], &v));
            /* A copy, so an input's gradient never pins the whole of g. */
            FSDP_TRY(rc, out, fsdp_tensor_clone(v, fsdp__op_cat(v->ctx), &gin[i]));
            fsdp_tensor_release(v);
            v = NULL;
        }
        off += sizes[i];
    }
out:
    fsdp_tensor_release(v);
    return rc;
}

static const struct fsdp__op_def def_cat = {"cat", cat_backward};

int fsdp_cat(fsdp_tensor_t *const *ts, int n, int dim, fsdp_tensor_t **out) {
    const char *op = "fsdp_cat";
    fsdp_ctx_t *ctx = ts && n > 0 && ts[0] ? ts[0]->ctx : NULL;
    fsdp_tensor_t *y = NULL;
    struct fsdp__node *node = NULL;
    int64_t *sizes = NULL;
    int d = 0, rc;
    char name[32], x[200], z[200];
    if (!out) return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: out is NULL", op);
    *out = NULL;
    if (!ts || n <= 0) {
        rc = fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: %d tensors%s; at least one is needed", op, n,
                           ts ? "" : " (ts is NULL)");
        goto fail;
    }
    for (int i = 0; i < n; i++) {
        snprintf(name, sizeof name, "ts[%d]", i);
        FSDP_TRY(rc, fail, fsdp__check_tensor(ctx, ts[i], op, name));
    }
    fsdp_tensor_t *t0 = ts[0];
    if (t0->ndim == 0) {
        rc = fsdp__op_err(t0, FSDP_EINVAL, op, "scalars (ts[0] is %s) cannot be concatenated",
                          fsdp_tensor_describe(t0, x, sizeof x));
        goto fail;
    }
    FSDP_TRY(rc, fail, fsdp__norm_dim(t0, dim, t0->ndim, op, &d));
    int64_t shape[FSDP_MAX_DIMS];
    memcpy(shape, t0->shape, sizeof shape);
    shape[d] = 0;
    for (int i = 0; i < n; i++) {
        const fsdp_tensor_t *t = ts[i];
        FSDP_TRY(rc, fail, fsdp__check_same_device(t0, t, op));
        bool fits = t->dt == t0->dt && t->ndim == t0->ndim;
        for (int k = 0; k < t0->ndim && fits; k++)
            if (k != d && t->shape[k] != t0->shape[k]) fits = false;
        if (!fits) {
            rc = fsdp__op_err(
                t0, FSDP_EINVAL, op, "ts[%d] %s does not match ts[0] %s outside dimension %d", i,
                fsdp_tensor_describe(t, x, sizeof x), fsdp_tensor_describe(t0, z, sizeof z), d);
            goto fail;
        }
        if (fsdp_tensor_numel(t) > 0 && !t->st->ptr) {
            rc = fsdp__op_err(t0, FSDP_EINVAL, op, "the storage of ts[%d] has been freed", i);
            goto fail;
        }
        shape[d] += t->shape[d];
    }
    FSDP_TRY(rc, fail,
             fsdp__tensor_new(ctx, t0->dev, t0->dt, t0->ndim, shape, fsdp__op_cat(ctx), &y));
    if (fsdp_tensor_numel(y) > 0) FSDP_TRY(rc, fail, cat_copy(ts, n, d, y));
    FSDP_TRY(rc, fail, fsdp__record(&def_cat, n, ts, 1, &y, &node));
    if (node) {
        /* More inputs than the node keeps shapes for, so the sizes travel in extra. */
        sizes = malloc((size_t)n * sizeof *sizes);
        if (!sizes) {
            rc = fsdp__op_err(t0, FSDP_ENOMEM, op, "out of host memory");
            goto fail;
        }
        for (int i = 0; i < n; i++)
            sizes[i] = ts[i]->shape[d];
        node->i[0] = d;
        node->extra = sizes;
        node->extra_free = free;
    }
    *out = y;
    return FSDP_OK;
fail:
    fsdp_tensor_release(y);
    return rc;
}

/* ---- split ---------------------------------------------------------------------------------- */

/* i[0] = the dimension. x's gradient is the outputs' gradients put back together. */
static int split_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                          fsdp_tensor_t **gin) {
    return fsdp_cat(gout, node->nout, (int)node->i[0], &gin[0]);
}

static const struct fsdp__op_def def_split = {"split", split_backward};

int fsdp_split(fsdp_tensor_t *x, const int64_t *sizes, int n, int dim, fsdp_tensor_t **outs) {
    const char *op = "fsdp_split";
    fsdp_ctx_t *ctx = x ? x->ctx : NULL;
    struct fsdp__node *node = NULL;
    int d = 0, rc;
    char desc[200];
    if (!outs || n <= 0)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: %d pieces%s; at least one is needed", op, n,
                             outs ? "" : " (outs is NULL)");
    for (int i = 0; i < n; i++)
        outs[i] = NULL;
    FSDP_TRY(rc, fail, fsdp__check_tensor(ctx, x, op, "x"));
    if (x->ndim == 0) {
        rc = fsdp__op_err(x, FSDP_EINVAL, op, "a scalar cannot be split");
        goto fail;
    }
    FSDP_TRY(rc, fail, fsdp__norm_dim(x, dim, x->ndim, op, &d));
    if (!sizes) {
        rc = fsdp__op_err(x, FSDP_EINVAL, op, "sizes is NULL");
        goto fail;
    }
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        if (sizes[i] < 0) {
            rc = fsdp__op_err(x, FSDP_EINVAL, op, "sizes[%d] is %lld", i, (long long)sizes[i]);
            goto fail;
        }
        total += sizes[i];
    }
    if (total != x->shape[d]) {
        rc = fsdp__op_err(x, FSDP_EINVAL, op, "sizes add up to %lld but dimension %d of %s is %lld",
                          (long long)total, d, fsdp_tensor_describe(x, desc, sizeof desc),
                          (long long)x->shape[d]);
        goto fail;
    }
    if (fsdp_tensor_numel(x) > 0 && !x->st->ptr) {
        rc = fsdp__op_err(x, FSDP_EINVAL, op, "the storage of argument 'x' has been freed");
        goto fail;
    }
    size_t es = fsdp_dtype_size(x->dt);
    int64_t shape[FSDP_MAX_DIMS], off = 0;
    memcpy(shape, x->shape, sizeof shape);
    for (int i = 0; i < n; i++) {
        shape[d] = sizes[i];
        FSDP_TRY(rc, fail,
                 fsdp__tensor_new(ctx, x->dev, x->dt, x->ndim, shape, fsdp__op_cat(ctx), &outs[i]));
        if (fsdp_tensor_numel(outs[i]) > 0) {
            const char *src = (const char *)fsdp_tensor_data(x) + (size_t)(off * x->stride[d]) * es;
            FSDP_TRY(rc, fail,
                     x->dev->ops->copy_strided(x->dev, x->dt, x->ndim, shape,
                                               fsdp_tensor_data(outs[i]), src, x->stride));
        }
        off += sizes[i];
    }
    FSDP_TRY(rc, fail, fsdp__record(&def_split, 1, &x, n, outs, &node));
    if (node) node->i[0] = d;
    return FSDP_OK;
fail:
    for (int i = 0; i < n; i++) {
        fsdp_tensor_release(outs[i]);
        outs[i] = NULL;
    }
    return rc;
}
