/* SPDX-License-Identifier: MIT */
/*
 * ops_norm.c: layer norm and batch norm.
 *
 * As the operations of ops_nn.c, a norm converts its inputs to the compute dtype (f32 for
 * f16/bf16), runs one device kernel and rounds the output back to x's dtype. The forward kernel
 * also writes the mean and rstd of every group it normalises (a row of layer norm, a channel of
 * batch norm); the node saves them with x and w, so that backward is one kernel call too:
 * norm_backward makes the operands and gradients for both norms and a per-norm function calls
 * the kernel. w and b are optional and of x's dtype. Batch norm's running statistics may be of
 * another float dtype; training updates them in place, through a converted copy that is written
 * back when they are not contiguous compute-dtype tensors already.
 */
#include "autograd/autograd_impl.h"
#include "tensor/tensor_impl.h"

/* ---- shared checks ---- */

/* Checks an optional float argument (NULL passes): same device as x, and x's dtype when
 * same_dtype. */
static int check_opt(const fsdp_tensor_t *x, const fsdp_tensor_t *t, const char *op,
                     const char *arg, bool same_dtype) {
    int rc = 0;
    char dx[96], dt[96];
    if (!t) return 0;
    FSDP_TRY(rc, fail, fsdp__check_float(x->ctx, t, op, arg));
    FSDP_TRY(rc, fail, fsdp__check_same_device(x, t, op));
    if (same_dtype && t->dt != x->dt)
        return fsdp__op_err(x, FSDP_EINVAL, op, "x %s and %s %s differ in dtype",
                            fsdp_tensor_describe(x, dx, sizeof dx), arg,
                            fsdp_tensor_describe(t, dt, sizeof dt));
    return 0;
fail:
    return rc;
}

/* ---- norm backward (layer norm and batch norm) ---- */

/* What a norm's backward kernel reads and writes: compute-dtype data of x, w (NULL without one),
 * the saved mean and rstd and the output gradient; the input gradients gx, gw, gb (NULL when not
 * wanted; gw and gb start at zero because the kernels accumulate into them). */
struct norm_grads {
    fsdp_device_t *dev;
    fsdp_dtype_t cdt;
    const void *x, *w, *mean, *rstd, *gy;
    void *gx, *gw, *gb;
};

/* The end of a norm's forward: rounds *y to x's dtype and records the node, which keeps i0 in
 * i[0] and saves (x, w, mean, rstd) for norm_backward(). */
static int norm_record(const struct fsdp__op_def *def, int64_t i0, fsdp_tensor_t *x,
                       fsdp_tensor_t *w, fsdp_tensor_t *b, fsdp_tensor_t *mean, fsdp_tensor_t *rstd,
                       fsdp_tensor_t **y) {
    struct fsdp__node *node = NULL;
    int rc = 0;
    FSDP_TRY(rc, out, fsdp__round_to(y, x->dt));
    FSDP_TRY(rc, out, fsdp__record(def, 3, (fsdp_tensor_t *[]){x, w, b}, 1, y, &node));
    if (node) {
        node->i[0] = i0;
        FSDP_TRY(rc, out, fsdp__node_save(node, x));
        FSDP_TRY(rc, out, fsdp__node_save(node, w));
        FSDP_TRY(rc, out, fsdp__node_save(node, mean));
        FSDP_TRY(rc, out, fsdp__node_save(node, rstd));
    }
out:
    return rc;
}

/* Runs one norm's backward kernel over the whole of x (nothing when x is empty). */
typedef int (*norm_kernel_fn)(const struct fsdp__node *node, const struct norm_grads *a);

/* The backward of a norm whose node saved (x, w, mean, rstd) and whose w and b have the shape
 * (pnd, pshape): makes the compute-dtype operands and the gradients, then runs kernel. */
static int norm_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout, fsdp_tensor_t **gin,
                         int pnd, const int64_t *pshape, norm_kernel_fn kernel) {
    fsdp_tensor_t *x = node->saved[0], *w = node->saved[1];
    fsdp_tensor_t *xc = NULL, *wc = NULL, *gy = NULL;
    fsdp_ctx_t *ctx = x->ctx;
    fsdp_device_t *dev = x->dev;
    fsdp_dtype_t cdt = fsdp__kernel_dtype(dev, x->dt);
    fsdp_mem_cat_t cat = fsdp__op_cat(ctx);
    int rc = 0;
    FSDP_TRY(rc, fail, fsdp__as_contig(x, cdt, &xc));
    if (w) FSDP_TRY(rc, fail, fsdp__as_contig(w, cdt, &wc));
    FSDP_TRY(rc, fail, fsdp__as_contig(gout[0], cdt, &gy));
    if (node->needs[0])
        FSDP_TRY(rc, fail, fsdp__tensor_new(ctx, dev, cdt, x->ndim, x->shape, cat, &gin[0]));
    /* The kernel accumulates gw and gb, so they start at zero. */
    for (int i = 1; i < 3; i++) {
        if (i >= node->nin || !node->needs[i]) continue;
        FSDP_TRY(rc, fail, fsdp__tensor_new_zeroed(ctx, dev, cdt, pnd, pshape, cat, &gin[i]));
    }
    const struct norm_grads a = {
        .dev = dev,
        .cdt = cdt,
        .x = fsdp_tensor_data(xc),
        .w = wc ? fsdp_tensor_data(wc) : NULL,
        .mean = fsdp_tensor_data(node->saved[2]),
        .rstd = fsdp_tensor_data(node->saved[3]),
        .gy = fsdp_tensor_data(gy),
        .gx = gin[0] ? fsdp_tensor_data(gin[0]) : NULL,
        .gw = node->nin > 1 && gin[1] ? fsdp_tensor_data(gin[1]) : NULL,
        .gb = node->nin > 2 && gin[2] ? fsdp_tensor_data(gin[2]) : NULL,
    };
    FSDP_TRY(rc, fail, kernel(node, &a));
    fsdp_tensor_release(xc);
    fsdp_tensor_release(wc);
    fsdp_tensor_release(gy);
    return 0;
fail:
    fsdp_tensor_release(xc);
    fsdp_tensor_release(wc);
    fsdp_tensor_release(gy);
    for (int i = 0; i < node->nin; i++) {
        fsdp_tensor_release(gin[i]);
        gin[i] = NULL;
    }
    return rc;
}

/* ---- layer norm ---- */

/* Layer norm's node keeps norm_ndim in i[0]: rows of n elements, normalised one by one. */
static int layer_norm_kernel(const struct fsdp__node *node, const struct norm_grads *a) {
    const fsdp_tensor_t *x = node->saved[0];
    int nd = (int)node->i[0];
    int64_t n = fsdp__shape_numel(nd, x->shape + x->ndim - nd);
    int64_t rows = fsdp__shape_numel(x->ndim - nd, x->shape);
    if (rows * n == 0) return 0;
    return a->dev->ops->layer_norm_backward(a->dev, a->cdt, (size_t)rows, (size_t)n, a->x, a->w,
                                            a->mean, a->rstd, a->gy, a->gx, a->gw, a->gb);
}

static int layer_norm_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                               fsdp_tensor_t **gin) {
    const fsdp_tensor_t *x = node->saved[0];
    int nd = (int)node->i[0];
    return norm_backward(node, gout, gin, nd, x->shape + x->ndim - nd, layer_norm_kernel);
}

static const struct fsdp__op_def def_layer_norm = {"layer_norm", layer_norm_backward};

/* w or b of layer norm must have the shape of x's last nd dimensions. */
static int check_norm_shape(const fsdp_tensor_t *x, const fsdp_tensor_t *t, int nd,
                            const char *arg) {
    bool ok = !t || t->ndim == nd;
    for (int i = 0; ok && t && i < nd; i++)
        ok = t->shape[i] == x->shape[x->ndim - nd + i];
    if (ok) return 0;
    char dx[96], dt[96];
    return fsdp__op_err(
        x, FSDP_EINVAL, "layer_norm", "%s %s must have the shape of the last %d dimensions of x %s",
        arg, fsdp_tensor_describe(t, dt, sizeof dt), nd, fsdp_tensor_describe(x, dx, sizeof dx));
}

int fsdp_layer_norm(fsdp_tensor_t *x, int norm_ndim, fsdp_tensor_t *w, fsdp_tensor_t *b, double eps,
                    fsdp_tensor_t **out) {
    fsdp_tensor_t *xc = NULL, *wc = NULL, *bc = NULL, *y = NULL, *mean = NULL, *rstd = NULL;
    char dx[96];
    int rc = 0;
    if (out) *out = NULL;
    FSDP_TRY(rc, fail, fsdp__check_float(NULL, x, "layer_norm", "x"));
    FSDP_TRY(rc, fail, check_opt(x, w, "layer_norm", "w", true));
    FSDP_TRY(rc, fail, check_opt(x, b, "layer_norm", "b", true));
    if (!out) return fsdp__op_err(x, FSDP_EINVAL, "layer_norm", "out is NULL");
    if (norm_ndim < 1 || norm_ndim > x->ndim)
        return fsdp__op_err(x, FSDP_EINVAL, "layer_norm",
                            "norm_ndim %d must be in [1, %d] for x %s", norm_ndim, x->ndim,
                            fsdp_tensor_describe(x, dx, sizeof dx));
    if (!(eps >= 0)) return fsdp__op_err(x, FSDP_EINVAL, "layer_norm", "eps %g must be >= 0", eps);
    FSDP_TRY(rc, fail, check_norm_shape(x, w, norm_ndim, "w"));
    FSDP_TRY(rc, fail, check_norm_shape(x, b, norm_ndim, "b"));
    fsdp_dtype_t cdt = fsdp__kernel_dtype(x->dev, x->dt);
    fsdp_device_t *dev = x->dev;
    fsdp_mem_cat_t cat = fsdp__op_cat(x->ctx);
    int64_t n = fsdp__shape_numel(norm_ndim, x->shape + x->ndim - norm_ndim);
    int64_t rows = fsdp__shape_numel(x->ndim - norm_ndim, x->shape);
    FSDP_TRY(rc, fail, fsdp__as_contig(x, cdt, &xc));
    if (w) FSDP_TRY(rc, fail, fsdp__as_contig(w, cdt, &wc));
    if (b) FSDP_TRY(rc, fail, fsdp__as_contig(b, cdt, &bc));
    FSDP_TRY(rc, fail, fsdp__tensor_new(x->ctx, dev, cdt, x->ndim, x->shape, cat, &y));
    FSDP_TRY(rc, fail, fsdp__tensor_new(x->ctx, dev, cdt, 1, &rows, cat, &mean));
    FSDP_TRY(rc, fail, fsdp__tensor_new(x->ctx, dev, cdt, 1, &rows, cat, &rstd));
    if (rows * n > 0)
        FSDP_TRY(rc, fail,
                 dev->ops->layer_norm(dev, cdt, (size_t)rows, (size_t)n, eps, fsdp_tensor_data(xc),
                                      wc ? fsdp_tensor_data(wc) : NULL,
                                      bc ? fsdp_tensor_data(bc) : NULL, fsdp_tensor_data(y),
                                      fsdp_tensor_data(mean), fsdp_tensor_data(rstd)));
    FSDP_TRY(rc, fail, norm_record(&def_layer_norm, norm_ndim, x, w, b, mean, rstd, &y));
    *out = y;
    y = NULL;
fail:
    fsdp_tensor_release(xc);
    fsdp_tensor_release(wc);
    fsdp_tensor_release(bc);
    fsdp_tensor_release(mean);
    fsdp_tensor_release(rstd);
    fsdp_tensor_release(y);
    return rc;
}

/* ---- batch norm ---- */

/* Batch norm's node keeps train in i[0]; x is (N, C, L...) with per-channel statistics. */
static int batch_norm_kernel(const struct fsdp__node *node, const struct norm_grads *a) {
    const fsdp_tensor_t *x = node->saved[0];
    int64_t nb = x->shape[0], c = x->shape[1], l = fsdp__shape_numel(x->ndim - 2, x->shape + 2);
    if (nb * c * l == 0) return 0;
    return a->dev->ops->batch_norm_backward(a->dev, a->cdt, node->i[0] != 0, (size_t)nb, (size_t)c,
                                            (size_t)l, a->x, a->w, a->mean, a->rstd, a->gy, a->gx,
                                            a->gw, a->gb);
}

static int batch_norm_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                               fsdp_tensor_t **gin) {
    return norm_backward(node, gout, gin, 1, node->saved[0]->shape + 1, batch_norm_kernel);
}

static const struct fsdp__op_def def_batch_norm = {"batch_norm", batch_norm_backward};

/* w, b and the running statistics of batch norm are (C) vectors. */
static int check_channels(const fsdp_tensor_t *x, const fsdp_tensor_t *t, const char *arg) {
    if (!t || (t->ndim == 1 && t->shape[0] == x->shape[1])) return 0;
    char dx[96], dt[96];
    return fsdp__op_err(x, FSDP_EINVAL, "batch_norm", "%s %s must be (C) = [%lld] for x %s", arg,
                        fsdp_tensor_describe(t, dt, sizeof dt), (long long)x->shape[1],
                        fsdp_tensor_describe(x, dx, sizeof dx));
}

int fsdp_batch_norm(fsdp_tensor_t *x, fsdp_tensor_t *w, fsdp_tensor_t *b,
                    fsdp_tensor_t *running_mean, fsdp_tensor_t *running_var, bool train,
                    double momentum, double eps, fsdp_tensor_t **out) {
    fsdp_tensor_t *xc = NULL, *wc = NULL, *bc = NULL, *rm = NULL, *rv = NULL;
    fsdp_tensor_t *y = NULL, *mean = NULL, *rstd = NULL;
    char dx[96];
    int rc = 0;
    if (out) *out = NULL;
    FSDP_TRY(rc, fail, fsdp__check_float(NULL, x, "batch_norm", "x"));
    FSDP_TRY(rc, fail, check_opt(x, w, "batch_norm", "w", true));
    FSDP_TRY(rc, fail, check_opt(x, b, "batch_norm", "b", true));
    FSDP_TRY(rc, fail, check_opt(x, running_mean, "batch_norm", "running_mean", false));
    FSDP_TRY(rc, fail, check_opt(x, running_var, "batch_norm", "running_var", false));
    if (!out) return fsdp__op_err(x, FSDP_EINVAL, "batch_norm", "out is NULL");
    fsdp_tensor_describe(x, dx, sizeof dx);
    if (x->ndim < 2)
        return fsdp__op_err(x, FSDP_EINVAL, "batch_norm", "x %s must be (N, C, ...)", dx);
    FSDP_TRY(rc, fail, check_channels(x, w, "w"));
    FSDP_TRY(rc, fail, check_channels(x, b, "b"));
    FSDP_TRY(rc, fail, check_channels(x, running_mean, "running_mean"));
    FSDP_TRY(rc, fail, check_channels(x, running_var, "running_var"));
    int64_t nb = x->shape[0], c = x->shape[1], l = fsdp__shape_numel(x->ndim - 2, x->shape + 2);
    if (!train && (!running_mean || !running_var))
        return fsdp__op_err(x, FSDP_EINVAL, "batch_norm",
                            "evaluation of x %s needs running_mean and running_var", dx);
    if (train && nb * l <= 1 && c > 0)
        return fsdp__op_err(x, FSDP_EINVAL, "batch_norm",
                            "training needs more than one value per channel, x is %s", dx);
    if (!(eps >= 0) || !(momentum >= 0 && momentum <= 1))
        return fsdp__op_err(x, FSDP_EINVAL, "batch_norm",
                            "eps %g must be >= 0 and momentum %g in [0, 1]", eps, momentum);
    fsdp_dtype_t cdt = fsdp__kernel_dtype(x->dev, x->dt);
    fsdp_device_t *dev = x->dev;
    fsdp_mem_cat_t cat = fsdp__op_cat(x->ctx);
    FSDP_TRY(rc, fail, fsdp__as_contig(x, cdt, &xc));
    if (w) FSDP_TRY(rc, fail, fsdp__as_contig(w, cdt, &wc));
    if (b) FSDP_TRY(rc, fail, fsdp__as_contig(b, cdt, &bc));
    /* Running statistics are updated in place; a converted copy is written back below. */
    if (running_mean) FSDP_TRY(rc, fail, fsdp__as_contig(running_mean, cdt, &rm));
    if (running_var) FSDP_TRY(rc, fail, fsdp__as_contig(running_var, cdt, &rv));
    FSDP_TRY(rc, fail, fsdp__tensor_new(x->ctx, dev, cdt, x->ndim, x->shape, cat, &y));
    FSDP_TRY(rc, fail, fsdp__tensor_new(x->ctx, dev, cdt, 1, &c, cat, &mean));
    FSDP_TRY(rc, fail, fsdp__tensor_new(x->ctx, dev, cdt, 1, &c, cat, &rstd));
    if (c > 0)
        FSDP_TRY(
            rc, fail,
            dev->ops->batch_norm(dev, cdt, train, (size_t)nb, (size_t)c, (size_t)l, eps, momentum,
                                 fsdp_tensor_data(xc), wc ? fsdp_tensor_data(wc) : NULL,
                                 bc ? fsdp_tensor_data(bc) : NULL, rm ? fsdp_tensor_data(rm) : NULL,
                                 rv ? fsdp_tensor_data(rv) : NULL, fsdp_tensor_data(y),
                                 fsdp_tensor_data(mean), fsdp_tensor_data(rstd)));
    if (train && rm && rm != running_mean) FSDP_TRY(rc, fail, fsdp_tensor_copy_(running_mean, rm));
    if (train && rv && rv != running_var) FSDP_TRY(rc, fail, fsdp_tensor_copy_(running_var, rv));
    FSDP_TRY(rc, fail, norm_record(&def_batch_norm, train, x, w, b, mean, rstd, &y));
    *out = y;
    y = NULL;
fail:
    fsdp_tensor_release(xc);
    fsdp_tensor_release(wc);
    fsdp_tensor_release(bc);
    fsdp_tensor_release(rm);
    fsdp_tensor_release(rv);
    fsdp_tensor_release(mean);
    fsdp_tensor_release(rstd);
    fsdp_tensor_release(y);
    return rc;
}
