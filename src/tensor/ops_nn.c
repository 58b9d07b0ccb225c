/* SPDX-License-Identifier: MIT */
/*
 * ops_nn.c: the neural-network operations (softmax, embedding, dropout, cross-entropy); the norms
 * are in ops_norm.c.
 *
 * Each operation converts its inputs to the compute dtype (f32 for f16/bf16; no copy when an
 * input already is a contiguous compute-dtype tensor), runs one row kernel of the device, rounds
 * the output back to the input dtype and records a node. What backward needs beyond the inputs
 * (the dropout mask, cross-entropy's log-probabilities) is written by the forward kernel and
 * saved, so backward is one kernel call too.
 *
 * Softmax along a dimension other than the last moves that dimension last (one strided copy),
 * runs the row kernel in place and moves it back; the last dimension needs no copy.
 * Indices (embedding, targets) are range-checked on the host: the CPU device's memory is read in
 * place, other devices' indices are copied to the host first.
 */
#include <math.h>
#include <stdio.h>

#include "autograd/autograd_impl.h"
#include "tensor/tensor_impl.h"

/* ---- shared checks ---- */

/* A host-readable view of a contiguous int64 tensor: its memory on the CPU device, otherwise a
 * host copy left in *buf for the caller to free. */
static int host_i64(const fsdp_tensor_t *t, const int64_t **p, void **buf) {
    int64_t n = fsdp_tensor_numel(t);
    int rc = 0;
    *buf = NULL;
    *p = fsdp_tensor_data(t);
    if (t->dev->kind == FSDP_DEVICE_CPU || n == 0) return 0;
    FSDP_TRY(rc, fail, fsdp_mem_alloc(t->ctx, FSDP_MEM_OTHER, (size_t)n * 8, buf));
    FSDP_TRY(rc, fail, t->dev->ops->memcpy(t->dev, *buf, *p, (size_t)n * 8, FSDP_COPY_D2H, NULL));
    *p = *buf;
    return 0;
fail:
    fsdp_mem_free(t->ctx, *buf);
    *buf = NULL;
    return rc;
}

/* ---- softmax, log_softmax ---- */

/* Geometry of a softmax along d: x viewed as (outer, n, inner). */
static void split_dim(const fsdp_tensor_t *t, int d, int64_t *outer, int64_t *n, int64_t *inner) {
    *outer = fsdp__shape_numel(d, t->shape);
    *n = t->shape[d];
    *inner = fsdp__shape_numel(t->ndim - d - 1, t->shape + d + 1);
}

/* A contiguous compute-dtype copy of t with dimension d moved last. */
static int to_last(fsdp_tensor_t *t, int d, fsdp_dtype_t cdt, fsdp_tensor_t **out) {
    int64_t shape[FSDP_MAX_DIMS], stride[FSDP_MAX_DIMS];
    fsdp_tensor_t *v = NULL;
    int rc = 0, j = 0;
    for (int i = 0; i < t->ndim; i++) {
        if (i == d) continue;
        shape[j] = t->shape[i];
        stride[j++] = t->stride[i];
    }
    shape[j] = t->shape[d];
    stride[j] = t->stride[d];
    FSDP_TRY(rc, fail, fsdp__tensor_view(t, t->offset, t->ndim, shape, stride, &v));
    FSDP_TRY(rc, fail, fsdp__as_contig(v, cdt, out));
fail:
    fsdp_tensor_release(v);
    return rc;
}

/* The inverse of to_last: a new contiguous tensor of `shape` from tp (dimension d last). */
static int from_last(const fsdp_tensor_t *tp, int d, int ndim, const int64_t *shape,
                     fsdp_tensor_t **out) {
    int64_t cs[FSDP_MAX_DIMS], stride[FSDP_MAX_DIMS];
    int rc = 0;
    fsdp__contiguous_strides(tp->ndim, tp->shape, cs);
    for (int i = 0; i < ndim; i++)
        stride[i] = i < d ? cs[i] : i == d ? cs[ndim - 1] : cs[i - 1];
    FSDP_TRY(rc, fail,
             fsdp__tensor_new(tp->ctx, tp->dev, tp->dt, ndim, shape, fsdp__op_cat(tp->ctx), out));
    FSDP_TRY(rc, fail,
             tp->dev->ops->copy_strided(tp->dev, tp->dt, ndim, shape, fsdp_tensor_data(*out),
                                        fsdp_tensor_data(tp), stride));
    return 0;
fail:
    fsdp_tensor_release(*out);
    *out = NULL;
    return rc;
}

static int softmax_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                            fsdp_tensor_t **gin) {
    fsdp_tensor_t *y = node->saved[0], *yc = NULL, *gy = NULL, *gx = NULL;
    fsdp_ctx_t *ctx = y->ctx;
    fsdp_dtype_t cdt = fsdp__kernel_dtype(y->dev, y->dt);
    int d = (int)node->i[0];
    bool log = node->i[1] != 0;
    int64_t outer = 1, n = 1, inner = 1;
    int rc = 0;
    if (!node->needs[0]) return 0;
    if (y->ndim > 0) split_dim(y, d, &outer, &n, &inner);
    bool last = inner == 1 || n == 1;
    if (last) {
        FSDP_TRY(rc, fail, fsdp__as_contig(y, cdt, &yc));
        FSDP_TRY(rc, fail, fsdp__as_contig(gout[0], cdt, &gy));
    } else {
        FSDP_TRY(rc, fail, to_last(y, d, cdt, &yc));
        FSDP_TRY(rc, fail, to_last(gout[0], d, cdt, &gy));
    }
    FSDP_TRY(rc, fail,
             fsdp__tensor_new(ctx, y->dev, cdt, yc->ndim, yc->shape, fsdp__op_cat(ctx), &gx));
    if (outer * n * inner > 0)
        FSDP_TRY(rc, fail,
                 y->dev->ops->softmax_backward(y->dev, cdt, log, (size_t)(outer * inner), (size_t)n,
                                               fsdp_tensor_data(yc), fsdp_tensor_data(gy),
                                               fsdp_tensor_data(gx)));
    if (last) {
        gin[0] = gx;
        gx = NULL;
    } else {
        FSDP_TRY(rc, fail, from_last(gx, d, y->ndim, y->shape, &gin[0]));
    }
fail:
    fsdp_tensor_release(yc);
    fsdp_tensor_release(gy);
    fsdp_tensor_release(gx);
    return rc;
}

static const struct fsdp__op_def def_softmax = {"softmax", softmax_backward};
static const struct fsdp__op_def def_log_softmax = {"log_softmax", softmax_backward};

static int softmax_impl(fsdp_tensor_t *x, int dim, bool log, fsdp_tensor_t **out) {
    const char *op = log ? "log_softmax" : "softmax";
    fsdp_tensor_t *xc = NULL, *y = NULL, *yp = NULL;
    struct fsdp__node *node = NULL;
    int64_t outer = 1, n = 1, inner = 1;
    int rc = 0, d = 0;
    if (out) *out = NULL;
    FSDP_TRY(rc, fail, fsdp__check_float(NULL, x, op, "x"));
    if (!out) return fsdp__op_err(x, FSDP_EINVAL, op, "out is NULL");
    if (x->ndim == 0) {
        /* A scalar is one row of one element (dim 0 or -1, as PyTorch allows). */
        if (dim != 0 && dim != -1)
            return fsdp__op_err(x, FSDP_EINVAL, op, "dim %d is out of range for a scalar", dim);
    } else {
        FSDP_TRY(rc, fail, fsdp__norm_dim(x, dim, x->ndim, op, &d));
        split_dim(x, d, &outer, &n, &inner);
    }
    fsdp_dtype_t cdt = fsdp__kernel_dtype(x->dev, x->dt);
    fsdp_device_t *dev = x->dev;
    bool last = inner == 1 || n == 1;
    if (last) {
        FSDP_TRY(rc, fail, fsdp__as_contig(x, cdt, &xc));
        FSDP_TRY(rc, fail,
                 fsdp__tensor_new(x->ctx, dev, cdt, x->ndim, x->shape, fsdp__op_cat(x->ctx), &y));
        if (outer * n * inner > 0)
            FSDP_TRY(rc, fail,
                     dev->ops->softmax(dev, cdt, log, (size_t)(outer * inner), (size_t)n,
                                       fsdp_tensor_data(xc), fsdp_tensor_data(y)));
    } else {
        /* to_last always copies here (n > 1 and inner > 1), so the kernel may run in place. */
        FSDP_TRY(rc, fail, to_last(x, d, cdt, &xc));
        if (fsdp_tensor_same_storage(xc, x)) {
            FSDP_TRY(
                rc, fail,
                fsdp__tensor_new(x->ctx, dev, cdt, xc->ndim, xc->shape, fsdp__op_cat(x->ctx), &yp));
        } else {
            yp = fsdp_tensor_retain(xc);
        }
        if (outer * n * inner > 0)
            FSDP_TRY(rc, fail,
                     dev->ops->softmax(dev, cdt, log, (size_t)(outer * inner), (size_t)n,
                                       fsdp_tensor_data(xc), fsdp_tensor_data(yp)));
        FSDP_TRY(rc, fail, from_last(yp, d, x->ndim, x->shape, &y));
    }
    fsdp_tensor_release(xc);
    fsdp_tensor_release(yp);
    xc = yp = NULL;
    FSDP_TRY(rc, fail, fsdp__round_to(&y, x->dt));
    FSDP_TRY(rc, fail, fsdp__record(log ? &def_log_softmax : &def_softmax, 1, &x, 1, &y, &node));
    if (node) {
        node->i[0] = d;
        node->i[1] = log;
        FSDP_TRY(rc, fail, fsdp__node_save(node, y));
    }
    *out = y;
    return 0;
fail:
    fsdp_tensor_release(xc);
    fsdp_tensor_release(yp);
    fsdp_tensor_release(y);
    return rc;
}

int fsdp_softmax(fsdp_tensor_t *x, int dim, fsdp_tensor_t **out) {
    return softmax_impl(x, dim, false, out);
}

int fsdp_log_softmax(fsdp_tensor_t *x, int dim, fsdp_tensor_t **out) {
    return softmax_impl(x, dim, true, out);
}

/* ---- embedding ---- */

static int embedding_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                              fsdp_tensor_t **gin) {
    fsdp_tensor_t *idx = node->saved[0], *gy = NULL;
    fsdp_ctx_t *ctx = idx->ctx;
    fsdp_device_t *dev = idx->dev;
    fsdp_dtype_t cdt = fsdp__kernel_dtype(dev, node->in_dt[0]);
    const int64_t *wshape = node->in_shape[0];
    int64_t n = fsdp_tensor_numel(idx), dim = wshape[1];
    int rc = 0;
    if (!node->needs[0]) return 0;
    FSDP_TRY(rc, fail, fsdp__as_contig(gout[0], cdt, &gy));
    /* Rows the batch never used keep their zeros. */
    FSDP_TRY(rc, fail,
             fsdp__tensor_new_zeroed(ctx, dev, cdt, 2, wshape, fsdp__op_cat(ctx), &gin[0]));
    if (n * dim > 0)
        FSDP_TRY(rc, fail,
                 dev->ops->embedding_backward(dev, cdt, (size_t)n, (size_t)dim,
                                              fsdp_tensor_data(idx), node->i[0],
                                              fsdp_tensor_data(gy), fsdp_tensor_data(gin[0])));
    fsdp_tensor_release(gy);
    return 0;
fail:
    fsdp_tensor_release(gy);
    fsdp_tensor_release(gin[0]);
    gin[0] = NULL;
    return rc;
}

static const struct fsdp__op_def def_embedding = {"embedding", embedding_backward};

int fsdp_embedding(fsdp_tensor_t *idx, fsdp_tensor_t *w, int64_t padding_idx, fsdp_tensor_t **out) {
    fsdp_tensor_t *ic = NULL, *wc = NULL, *y = NULL;
    struct fsdp__node *node = NULL;
    const int64_t *hidx = NULL;
    void *hbuf = NULL;
    char di[96], dw[96];
    int rc = 0;
    if (out) *out = NULL;
    FSDP_TRY(rc, fail, fsdp__check_tensor(NULL, idx, "embedding", "idx"));
    FSDP_TRY(rc, fail, fsdp__check_float(idx->ctx, w, "embedding", "w"));
    FSDP_TRY(rc, fail, fsdp__check_same_device(idx, w, "embedding"));
    if (!out) return fsdp__op_err(w, FSDP_EINVAL, "embedding", "out is NULL");
    fsdp_tensor_describe(idx, di, sizeof di);
    fsdp_tensor_describe(w, dw, sizeof dw);
    if (idx->dt != FSDP_DTYPE_I64 && idx->dt != FSDP_DTYPE_I32)
        return fsdp__op_err(w, FSDP_EINVAL, "embedding", "idx %s must be i64 or i32", di);
    if (w->ndim != 2 || idx->ndim + 1 > FSDP_MAX_DIMS)
        return fsdp__op_err(w, FSDP_EINVAL, "embedding",
                            "w %s must be (num, dim) and idx %s have < %d dimensions", dw, di,
                            FSDP_MAX_DIMS);
    int64_t num = w->shape[0], dim = w->shape[1];
    if (padding_idx >= num)
        return fsdp__op_err(w, FSDP_EINVAL, "embedding",
                            "padding_idx %lld is out of range for w %s", (long long)padding_idx,
                            dw);
    FSDP_TRY(rc, fail, fsdp__as_contig(idx, FSDP_DTYPE_I64, &ic));
    int64_t n = fsdp_tensor_numel(ic);
    FSDP_TRY(rc, fail, host_i64(ic, &hidx, &hbuf));
    for (int64_t i = 0; i < n; i++) {
        if (hidx[i] >= 0 && hidx[i] < num) continue;
        rc = fsdp__op_err(w, FSDP_EINVAL, "embedding",
                          "index %lld at position %lld of idx %s is out of range for a table "
                          "of %lld rows (w %s)",
                          (long long)hidx[i], (long long)i, di, (long long)num, dw);
        goto fail;
    }
    fsdp_mem_free(w->ctx, hbuf);
    hbuf = NULL;
    fsdp_dtype_t cdt = fsdp__kernel_dtype(w->dev, w->dt);
    int64_t shape[FSDP_MAX_DIMS];
    for (int i = 0; i < idx->ndim; i++)
        shape[i] = idx->shape[i];
    shape[idx->ndim] = dim;
    FSDP_TRY(rc, fail, fsdp__as_contig(w, cdt, &wc));
    FSDP_TRY(rc, fail,
             fsdp__tensor_new(w->ctx, w->dev, cdt, idx->ndim + 1, shape, fsdp__op_cat(w->ctx), &y));
    if (n * dim > 0)
        FSDP_TRY(rc, fail,
                 w->dev->ops->embedding(w->dev, cdt, (size_t)n, (size_t)dim, fsdp_tensor_data(ic),
                                        fsdp_tensor_data(wc), fsdp_tensor_data(y)));
    FSDP_TRY(rc, fail, fsdp__round_to(&y, w->dt));
    FSDP_TRY(rc, fail, fsdp__record(&def_embedding, 1, &w, 1, &y, &node));
    if (node) {
        node->i[0] = padding_idx < 0 ? -1 : padding_idx;
        FSDP_TRY(rc, fail, fsdp__node_save(node, ic));
    }
    *out = y;
    y = NULL;
fail:
    if (hbuf) fsdp_mem_free(w->ctx, hbuf);
    fsdp_tensor_release(ic);
    fsdp_tensor_release(wc);
    fsdp_tensor_release(y);
    return rc;
}

/* ---- dropout ---- */

static int dropout_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                            fsdp_tensor_t **gin) {
    fsdp_tensor_t *mask = node->saved[0], *gy = NULL;
    fsdp_ctx_t *ctx = mask->ctx;
    fsdp_device_t *dev = mask->dev;
    fsdp_dtype_t cdt = fsdp__kernel_dtype(dev, node->in_dt[0]);
    double p = node->f[0];
    size_t n = (size_t)fsdp_tensor_numel(mask);
    int rc = 0;
    if (!node->needs[0]) return 0;
    FSDP_TRY(rc, fail, fsdp__as_contig(gout[0], cdt, &gy));
    FSDP_TRY(rc, fail,
             fsdp__tensor_new(ctx, dev, cdt, mask->ndim, mask->shape, fsdp__op_cat(ctx), &gin[0]));
    void *gx = fsdp_tensor_data(gin[0]);
    if (n > 0 && p >= 1) {
        FSDP_TRY(rc, fail, dev->ops->fill(dev, cdt, n, 0.0, gx));
    } else if (n > 0) {
        /* gx = mask ? gy / (1 - p) : 0, as the forward scaled the kept elements. */
        FSDP_TRY(rc, fail,
                 dev->ops->where(dev, cdt, n, fsdp_tensor_data(mask), fsdp_tensor_data(gy), 0.0,
                                 NULL, 0.0, gx));
        FSDP_TRY(rc, fail, dev->ops->unary(dev, cdt, FSDP_UNARY_SCALE, n, 1.0 / (1.0 - p), gx, gx));
    }
    fsdp_tensor_release(gy);
    return 0;
fail:
    fsdp_tensor_release(gy);
    fsdp_tensor_release(gin[0]);
    gin[0] = NULL;
    return rc;
}

static const struct fsdp__op_def def_dropout = {"dropout", dropout_backward};

int fsdp_dropout(fsdp_tensor_t *x, double p, bool train, fsdp_tensor_t **out) {
    fsdp_tensor_t *xc = NULL, *y = NULL, *mask = NULL;
    struct fsdp__node *node = NULL;
    int rc = 0;
    if (out) *out = NULL;
    FSDP_TRY(rc, fail, fsdp__check_float(NULL, x, "dropout", "x"));
    if (!out) return fsdp__op_err(x, FSDP_EINVAL, "dropout", "out is NULL");
    if (!(p >= 0 && p <= 1))
        return fsdp__op_err(x, FSDP_EINVAL, "dropout", "p %g must be in [0, 1]", p);
    if (!train || p == 0) {
        *out = fsdp_tensor_retain(x);
        return 0;
    }
    fsdp_ctx_t *ctx = x->ctx;
    fsdp_device_t *dev = x->dev;
    fsdp_dtype_t cdt = fsdp__kernel_dtype(dev, x->dt);
    fsdp_mem_cat_t cat = fsdp__op_cat(ctx);
    size_t n = (size_t)fsdp_tensor_numel(x);
    FSDP_TRY(rc, fail, fsdp__as_contig(x, cdt, &xc));
    FSDP_TRY(rc, fail, fsdp__tensor_new(ctx, dev, cdt, x->ndim, x->shape, cat, &y));
    FSDP_TRY(rc, fail, fsdp__tensor_new(ctx, dev, FSDP_DTYPE_U8, x->ndim, x->shape, cat, &mask));
    if (n > 0 && p >= 1) {
        /* Everything dropped: the kernel's 1 / (1 - p) would turn zeros into NaN. */
        FSDP_TRY(rc, fail, dev->ops->fill(dev, cdt, n, 0.0, fsdp_tensor_data(y)));
        FSDP_TRY(rc, fail, dev->ops->fill(dev, FSDP_DTYPE_U8, n, 0.0, fsdp_tensor_data(mask)));
    } else if (n > 0) {
        FSDP_TRY(rc, fail,
                 dev->ops->dropout(dev, cdt, n, p, ctx->rng.seed, ctx->rng.stream, ctx->rng.offset,
                                   fsdp_tensor_data(xc), fsdp_tensor_data(y),
                                   fsdp_tensor_data(mask)));
    }
    /* Four draws per counter block: the next call starts on a block this one never touched. */
    ctx->rng.offset += (n + 3) / 4;
    FSDP_TRY(rc, fail, fsdp__round_to(&y, x->dt));
    FSDP_TRY(rc, fail, fsdp__record(&def_dropout, 1, &x, 1, &y, &node));
    if (node) {
        node->f[0] = p;
        FSDP_TRY(rc, fail, fsdp__node_save(node, mask));
    }
    *out = y;
    y = NULL;
fail:
    fsdp_tensor_release(xc);
    fsdp_tensor_release(mask);
    fsdp_tensor_release(y);
    return rc;
}

/* ---- cross-entropy ---- */

static int cross_entropy_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                                  fsdp_tensor_t **gin) {
    fsdp_tensor_t *logp = node->saved[0], *tgt = node->saved[1], *g = NULL, *gloss = NULL;
    fsdp_ctx_t *ctx = logp->ctx;
    fsdp_device_t *dev = logp->dev;
    fsdp_dtype_t cdt = logp->dt;
    fsdp_mem_cat_t cat = fsdp__op_cat(ctx);
    int64_t rows = logp->shape[0], c = logp->shape[1], count = node->i[2];
    fsdp_reduction_t red = (fsdp_reduction_t)node->i[1];
    double ls = node->f[0];
    int rc = 0;
    if (!node->needs[0]) return 0;
    FSDP_TRY(rc, fail, fsdp__as_contig(gout[0], cdt, &g));
    if (red == FSDP_REDUCTION_NONE) {
        gloss = g;
        g = NULL;
    } else {
        /* Every row gets the scalar upstream gradient, divided by the count for the mean. */
        FSDP_TRY(rc, fail, fsdp__tensor_new(ctx, dev, cdt, 1, &rows, cat, &gloss));
        if (rows > 0) {
            FSDP_TRY(rc, fail,
                     dev->ops->copy_strided(dev, cdt, 1, &rows, fsdp_tensor_data(gloss),
                                            fsdp_tensor_data(g), (const int64_t[]){0}));
            if (red == FSDP_REDUCTION_MEAN)
                FSDP_TRY(rc, fail,
                         dev->ops->unary(dev, cdt, FSDP_UNARY_SCALE, (size_t)rows,
                                         count > 0 ? 1.0 / (double)count : 0.0,
                                         fsdp_tensor_data(gloss), fsdp_tensor_data(gloss)));
        }
    }
    if (fsdp__overwritable(logp, cdt, node->in_ndim[0], node->in_shape[0]))
        gin[0] = fsdp_tensor_retain(logp); /* the log-probabilities, read once, become gx */
    else
        FSDP_TRY(
            rc, fail,
            fsdp__tensor_new(ctx, dev, cdt, node->in_ndim[0], node->in_shape[0], cat, &gin[0]));
    if (rows * c > 0)
        FSDP_TRY(rc, fail,
                 dev->ops->cross_entropy_backward(dev, cdt, (size_t)rows, (size_t)c,
                                                  fsdp_tensor_data(logp), fsdp_tensor_data(tgt),
                                                  node->i[0], ls, fsdp_tensor_data(gloss),
                                                  fsdp_tensor_data(gin[0])));
    fsdp_tensor_release(g);
    fsdp_tensor_release(gloss);
    return 0;
fail:
    fsdp_tensor_release(g);
    fsdp_tensor_release(gloss);
    fsdp_tensor_release(gin[0]);
    gin[0] = NULL;
    return rc;
}

static const struct fsdp__op_def def_cross_entropy = {"cross_entropy", cross_entropy_backward};

int fsdp_cross_entropy(fsdp_tensor_t *logits, fsdp_tensor_t *target, int64_t ignore_index,
                       fsdp_reduction_t reduction, double label_smoothing, fsdp_tensor_t **out) {
    fsdp_tensor_t *lc = NULL, *tc = NULL, *loss = NULL, *logp = NULL, *y = NULL;
    struct fsdp__node *node = NULL;
    const int64_t *ht = NULL;
    void *hbuf = NULL;
    char dl[96], dtg[96];
    int rc = 0;
    if (out) *out = NULL;
    FSDP_TRY(rc, fail, fsdp__check_float(NULL, logits, "cross_entropy", "logits"));
    FSDP_TRY(rc, fail, fsdp__check_tensor(logits->ctx, target, "cross_entropy", "target"));
    FSDP_TRY(rc, fail, fsdp__check_same_device(logits, target, "cross_entropy"));
    if (!out) return fsdp__op_err(logits, FSDP_EINVAL, "cross_entropy", "out is NULL");
    fsdp_tensor_describe(logits, dl, sizeof dl);
    fsdp_tensor_describe(target, dtg, sizeof dtg);
    if (target->dt != FSDP_DTYPE_I64 && target->dt != FSDP_DTYPE_I32)
        return fsdp__op_err(logits, FSDP_EINVAL, "cross_entropy", "target %s must be i64", dtg);
    bool batched = logits->ndim == 2;
    if (!((batched && target->ndim == 1 && target->shape[0] == logits->shape[0]) ||
          (logits->ndim == 1 && target->ndim == 0)))
        return fsdp__op_err(logits, FSDP_EINVAL, "cross_entropy",
                            "logits %s and target %s: need logits (N, C) with target (N), or "
                            "logits (C) with a scalar target",
                            dl, dtg);
    if ((int)reduction < 0 || reduction > FSDP_REDUCTION_NONE)
        return fsdp__op_err(logits, FSDP_EINVAL, "cross_entropy", "reduction %d is unknown",
                            (int)reduction);
    if (!(label_smoothing >= 0 && label_smoothing <= 1))
        return fsdp__op_err(logits, FSDP_EINVAL, "cross_entropy",
                            "label_smoothing %g must be in [0, 1]", label_smoothing);
    int64_t rows = batched ? logits->shape[0] : 1, c = logits->shape[logits->ndim - 1];
    int64_t count = 0;
    FSDP_TRY(rc, fail, fsdp__as_contig(target, FSDP_DTYPE_I64, &tc));
    FSDP_TRY(rc, fail, host_i64(tc, &ht, &hbuf));
    for (int64_t i = 0; i < rows; i++) {
        if (ht[i] == ignore_index) continue;
        if (ht[i] < 0 || ht[i] >= c) {
            rc = fsdp__op_err(logits, FSDP_EINVAL, "cross_entropy",
                              "target %lld at position %lld is out of range for %lld classes "
                              "(logits %s)",
                              (long long)ht[i], (long long)i, (long long)c, dl);
            goto fail;
        }
        count++;
    }
    fsdp_mem_free(logits->ctx, hbuf);
    hbuf = NULL;
    fsdp_ctx_t *ctx = logits->ctx;
    fsdp_device_t *dev = logits->dev;
    fsdp_dtype_t cdt = fsdp__kernel_dtype(dev, logits->dt);
    fsdp_mem_cat_t cat = fsdp__op_cat(ctx);
    FSDP_TRY(rc, fail, fsdp__as_contig(logits, cdt, &lc));
    FSDP_TRY(rc, fail, fsdp__tensor_new(ctx, dev, cdt, batched ? 1 : 0, &rows, cat, &loss));
    FSDP_TRY(rc, fail, fsdp__tensor_new(ctx, dev, cdt, 2, (const int64_t[]){rows, c}, cat, &logp));
    if (rows > 0 && c > 0)
        FSDP_TRY(rc, fail,
                 dev->ops->cross_entropy(dev, cdt, (size_t)rows, (size_t)c, fsdp_tensor_data(lc),
                                         fsdp_tensor_data(tc), ignore_index, label_smoothing,
                                         fsdp_tensor_data(loss), fsdp_tensor_data(logp)));
    else if (rows > 0)
        FSDP_TRY(rc, fail, dev->ops->fill(dev, cdt, (size_t)rows, 0.0, fsdp_tensor_data(loss)));
    if (reduction == FSDP_REDUCTION_NONE) {
        y = loss;
        loss = NULL;
    } else {
        FSDP_TRY(rc, fail, fsdp__tensor_new(ctx, dev, cdt, 0, NULL, cat, &y));
        if (reduction == FSDP_REDUCTION_MEAN && count == 0)
            /* 0 / 0, as PyTorch: every target ignored gives NaN. */
            FSDP_TRY(rc, fail, dev->ops->fill(dev, cdt, 1, NAN, fsdp_tensor_data(y)));
        else if (rows == 0)
            FSDP_TRY(rc, fail, dev->ops->fill(dev, cdt, 1, 0.0, fsdp_tensor_data(y)));
        else
            FSDP_TRY(
                rc, fail,
                dev->ops->reduce_sum(dev, cdt, 1, (size_t)rows, 1,
                                     reduction == FSDP_REDUCTION_MEAN ? 1.0 / (double)count : 1.0,
                                     fsdp_tensor_data(loss), fsdp_tensor_data(y)));
    }
    FSDP_TRY(rc, fail, fsdp__round_to(&y, logits->dt));
    FSDP_TRY(rc, fail, fsdp__record(&def_cross_entropy, 1, &logits, 1, &y, &node));
    if (node) {
        node->i[0] = ignore_index;
        node->i[1] = reduction;
        node->i[2] = count;
        node->f[0] = label_smoothing;
        FSDP_TRY(rc, fail, fsdp__node_save(node, logp));
        FSDP_TRY(rc, fail, fsdp__node_save(node, tc));
    }
    *out = y;
    y = NULL;
fail:
    if (hbuf) fsdp_mem_free(logits->ctx, hbuf);
    fsdp_tensor_release(lc);
    fsdp_tensor_release(tc);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(logp);
    fsdp_tensor_release(y);
    return rc;
}
