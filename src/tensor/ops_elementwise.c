/* SPDX-License-Identifier: MIT */
/*
 * ops_elementwise.c: element-wise operations (broadcasting arithmetic, activations, where and
 * masked fill, dtype conversion, the causal mask, the mean squared error) and their gradients.
 *
 * Every operation computes in fsdp__kernel_dtype() of its input (f32 for f16/bf16, so the
 * half types get one rounding, at the end; the type itself on a device whose kernels take it
 * natively) and returns a new contiguous tensor. The binary
 * kernel reads its operands through strides, so broadcast and transposed operands are never
 * copied in f32/f64; the unary and where kernels need contiguous operands, made with
 * fsdp__as_contig(). An operation records its node only after its output is final, so a failure
 * leaves nothing on the tape.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "autograd/autograd_impl.h"
#include "tensor/tensor_impl.h"

/* ---- shared checks -------------------------------------------------------------------------- */

static int check_out_ptr(fsdp_ctx_t *ctx, fsdp_tensor_t **out, const char *op) {
    if (!out) return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: out is NULL", op);
    *out = NULL;
    return FSDP_OK;
}

/* A float operand whose storage is present (not freed by fsdp_tensor_storage_resize). */
static int check_float(const fsdp_tensor_t *t, const char *op, const char *arg) {
    char d[200];
    if (fsdp__compute_dtype(t->dt) < 0)
        return fsdp__op_err(t, FSDP_EINVAL, op, "argument '%s' is %s; a float tensor is required",
                            arg, fsdp_tensor_describe(t, d, sizeof d));
    if (fsdp_tensor_numel(t) > 0 && !t->st->ptr)
        return fsdp__op_err(t, FSDP_EINVAL, op, "the storage of argument '%s' %s has been freed",
                            arg, fsdp_tensor_describe(t, d, sizeof d));
    return FSDP_OK;
}

static bool same_shape(const fsdp_tensor_t *a, const fsdp_tensor_t *b) {
    return a->ndim == b->ndim && memcmp(a->shape, b->shape, sizeof(int64_t) * (size_t)a->ndim) == 0;
}

/* Two operands that must agree exactly in shape and dtype (where, mse_loss). */
static int check_same_geometry(const fsdp_tensor_t *a, const fsdp_tensor_t *b, const char *op,
                               const char *an, const char *bn) {
    if (same_shape(a, b) && a->dt == b->dt) return FSDP_OK;
    char x[200], y[200];
    return fsdp__op_err(
        a, FSDP_EINVAL, op, "'%s' %s and '%s' %s must have the same shape and dtype", an,
        fsdp_tensor_describe(a, x, sizeof x), bn, fsdp_tensor_describe(b, y, sizeof y));
}

/* Kernels are given at least one dimension: a scalar (ndim 0) is passed as shape [1], which
 * reads its one element through any stride. */
static int kernel_geometry(int ndim, const int64_t *shape, int64_t *kshape) {
    if (ndim == 0) {
        kshape[0] = 1;
        return 1;
    }
    memcpy(kshape, shape, sizeof(int64_t) * (size_t)ndim);
    return ndim;
}

/* A new contiguous output of t's context and device. */
static int new_like(const fsdp_tensor_t *t, fsdp_dtype_t dt, int ndim, const int64_t *shape,
                    fsdp_tensor_t **out) {
    return fsdp__tensor_new(t->ctx, t->dev, dt, ndim, shape, fsdp__op_cat(t->ctx), out);
}

/* ---- binary arithmetic with broadcasting ----------------------------------------------------- */

/* Forward of a op b into a new tensor of the broadcast shape, in the operands' dtype. */
static int binary_forward(fsdp_tensor_t *a, fsdp_tensor_t *b, fsdp_binary_op_t bop, const char *op,
                          fsdp_tensor_t **out) {
    fsdp_tensor_t *ac = NULL, *bc = NULL, *y = NULL;
    int nd, rc;
    int64_t shape[FSDP_MAX_DIMS], as[FSDP_MAX_DIMS], bs[FSDP_MAX_DIMS], ks[FSDP_MAX_DIMS];
    *out = NULL;
    FSDP_TRY(rc, fail, check_float(a, op, "a"));
    FSDP_TRY(rc, fail, check_float(b, op, "b"));
    FSDP_TRY(rc, fail, fsdp__check_same_device(a, b, op));
    if (a->dt != b->dt) {
        char x[200], z[200];
        rc = fsdp__op_err(a, FSDP_EINVAL, op, "operands %s and %s have different dtypes",
                          fsdp_tensor_describe(a, x, sizeof x),
                          fsdp_tensor_describe(b, z, sizeof z));
        goto fail;
    }
    FSDP_TRY(rc, fail, fsdp__broadcast_shape(a, b, op, &nd, shape));
    fsdp_dtype_t cdt = fsdp__kernel_dtype(a->dev, a->dt);
    /* f32/f64 operands are read in place through their strides; half types are widened. */
    if (a->dt == cdt) {
        ac = fsdp_tensor_retain(a);
        bc = fsdp_tensor_retain(b);
    } else {
        FSDP_TRY(rc, fail, fsdp__as_contig(a, cdt, &ac));
        FSDP_TRY(rc, fail, fsdp__as_contig(b, cdt, &bc));
    }
    FSDP_TRY(rc, fail, new_like(a, cdt, nd, shape, &y));
    if (fsdp__shape_numel(nd, shape) > 0) {
        fsdp__broadcast_strides(ac, nd, shape, as);
        fsdp__broadcast_strides(bc, nd, shape, bs);
        if (nd == 0) as[0] = bs[0] = 0;
        int kn = kernel_geometry(nd, shape, ks);
        FSDP_TRY(rc, fail,
                 a->dev->ops->binary(a->dev, cdt, bop, kn, ks, fsdp_tensor_data(y),
                                     fsdp_tensor_data(ac), as, fsdp_tensor_data(bc), bs));
    }
    FSDP_TRY(rc, fail, fsdp__round_to(&y, a->dt));
    *out = y;
    y = NULL;
fail:
    fsdp_tensor_release(ac);
    fsdp_tensor_release(bc);
    fsdp_tensor_release(y);
    return rc;
}

static int add_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout, fsdp_tensor_t **gin) {
    int rc = FSDP_OK;
    if (node->needs[0])
        FSDP_TRY(rc, out,
                 fsdp__sum_to_shape(gout[0], node->in_ndim[0], node->in_shape[0], &gin[0]));
    if (node->needs[1])
        FSDP_TRY(rc, out,
                 fsdp__sum_to_shape(gout[0], node->in_ndim[1], node->in_shape[1], &gin[1]));
out:
    return rc;
}

static int sub_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout, fsdp_tensor_t **gin) {
    fsdp_tensor_t *s = NULL;
    int rc = FSDP_OK;
    if (node->needs[0])
        FSDP_TRY(rc, out,
                 fsdp__sum_to_shape(gout[0], node->in_ndim[0], node->in_shape[0], &gin[0]));
    if (node->needs[1]) {
        FSDP_TRY(rc, out, fsdp__sum_to_shape(gout[0], node->in_ndim[1], node->in_shape[1], &s));
        FSDP_TRY(rc, out, fsdp_scale(s, -1.0, &gin[1]));
    }
out:
    fsdp_tensor_release(s);
    return rc;
}

/* d(a b) = g b da + g a db; saved[0] = a (for b's gradient), saved[1] = b (for a's). */
static int mul_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout, fsdp_tensor_t **gin) {
    fsdp_tensor_t *t = NULL;
    int rc = FSDP_OK;
    for (int i = 0; i < 2; i++) {
        if (!node->needs[i]) continue;
        FSDP_TRY(rc, out, fsdp_mul(gout[0], node->saved[1 - i], &t));
        FSDP_TRY(rc, out, fsdp__sum_to_shape(t, node->in_ndim[i], node->in_shape[i], &gin[i]));
        fsdp_tensor_release(t);
        t = NULL;
    }
out:
    fsdp_tensor_release(t);
    return rc;
}

/* d(a / b) = g / b da - (g / b) (a / b) db; saved[0] = a (only for b's gradient), saved[1] = b. */
static int div_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout, fsdp_tensor_t **gin) {
    fsdp_tensor_t *q = NULL, *t = NULL, *u = NULL, *s = NULL;
    int rc;
    FSDP_TRY(rc, out, fsdp_div(gout[0], node->saved[1], &q));
    if (node->needs[0])
        FSDP_TRY(rc, out, fsdp__sum_to_shape(q, node->in_ndim[0], node->in_shape[0], &gin[0]));
    if (node->needs[1]) {
        FSDP_TRY(rc, out, fsdp_mul(q, node->saved[0], &t));
        FSDP_TRY(rc, out, fsdp_div(t, node->saved[1], &u));
        FSDP_TRY(rc, out, fsdp__sum_to_shape(u, node->in_ndim[1], node->in_shape[1], &s));
        FSDP_TRY(rc, out, fsdp_scale(s, -1.0, &gin[1]));
    }
out:
    fsdp_tensor_release(q);
    fsdp_tensor_release(t);
    fsdp_tensor_release(u);
    fsdp_tensor_release(s);
    return rc;
}

static const struct fsdp__op_def def_add = {"add", add_backward};
static const struct fsdp__op_def def_sub = {"sub", sub_backward};
static const struct fsdp__op_def def_mul = {"mul", mul_backward};
static const struct fsdp__op_def def_div = {"div", div_backward};

static int binary_op(fsdp_tensor_t *a, fsdp_tensor_t *b, fsdp_binary_op_t bop, const char *op,
                     fsdp_tensor_t **out) {
    fsdp_ctx_t *ctx = a ? a->ctx : b ? b->ctx : NULL;
    fsdp_tensor_t *y = NULL;
    struct fsdp__node *node = NULL;
    int rc;
    FSDP_TRY(rc, fail, check_out_ptr(ctx, out, op));
    FSDP_TRY(rc, fail, fsdp__check_tensor(ctx, a, op, "a"));
    FSDP_TRY(rc, fail, fsdp__check_tensor(ctx, b, op, "b"));
    FSDP_TRY(rc, fail, binary_forward(a, b, bop, op, &y));
    const struct fsdp__op_def *def = bop == FSDP_BINARY_ADD   ? &def_add
                                     : bop == FSDP_BINARY_SUB ? &def_sub
                                     : bop == FSDP_BINARY_MUL ? &def_mul
                                                              : &def_div;
    FSDP_TRY(rc, fail, fsdp__record(def, 2, (fsdp_tensor_t *[]){a, b}, 1, &y, &node));
    if (node && bop == FSDP_BINARY_MUL) {
        FSDP_TRY(rc, fail, fsdp__node_save(node, node->needs[1] ? a : NULL));
        FSDP_TRY(rc, fail, fsdp__node_save(node, node->needs[0] ? b : NULL));
    } else if (node && bop == FSDP_BINARY_DIV) {
        FSDP_TRY(rc, fail, fsdp__node_save(node, node->needs[1] ? a : NULL));
        FSDP_TRY(rc, fail, fsdp__node_save(node, b));
    }
    *out = y;
    return FSDP_OK;
fail:
    fsdp_tensor_release(y);
    return rc;
}

int fsdp_add(fsdp_tensor_t *a, fsdp_tensor_t *b, fsdp_tensor_t **out) {
    return binary_op(a, b, FSDP_BINARY_ADD, "fsdp_add", out);
}

int fsdp_sub(fsdp_tensor_t *a, fsdp_tensor_t *b, fsdp_tensor_t **out) {
    return binary_op(a, b, FSDP_BINARY_SUB, "fsdp_sub", out);
}

int fsdp_mul(fsdp_tensor_t *a, fsdp_tensor_t *b, fsdp_tensor_t **out) {
    return binary_op(a, b, FSDP_BINARY_MUL, "fsdp_mul", out);
}

int fsdp_div(fsdp_tensor_t *a, fsdp_tensor_t *b, fsdp_tensor_t **out) {
    return binary_op(a, b, FSDP_BINARY_DIV, "fsdp_div", out);
}

/* ---- unary operations ---------------------------------------------------------------------- */

/* y = op(x, alpha) into a new tensor of x's dtype and shape. */
static int unary_forward(fsdp_tensor_t *x, fsdp_unary_op_t uop, double alpha, const char *op,
                         fsdp_tensor_t **out) {
    fsdp_tensor_t *xc = NULL, *y = NULL;
    int rc;
    *out = NULL;
    FSDP_TRY(rc, fail, check_float(x, op, "x"));
    fsdp_dtype_t cdt = fsdp__kernel_dtype(x->dev, x->dt);
    FSDP_TRY(rc, fail, fsdp__as_contig(x, cdt, &xc));
    FSDP_TRY(rc, fail, new_like(x, cdt, x->ndim, x->shape, &y));
    int64_t n = fsdp_tensor_numel(x);
    if (n > 0)
        FSDP_TRY(rc, fail,
                 x->dev->ops->unary(x->dev, cdt, uop, (size_t)n, alpha, fsdp_tensor_data(xc),
                                    fsdp_tensor_data(y)));
    FSDP_TRY(rc, fail, fsdp__round_to(&y, x->dt));
    *out = y;
    y = NULL;
fail:
    fsdp_tensor_release(xc);
    fsdp_tensor_release(y);
    return rc;
}

/* saved[0] = x, saved[1] = y (the kernel may use either); i[0] = the unary op, f[0] = alpha. */
static int unary_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                          fsdp_tensor_t **gin) {
    fsdp_tensor_t *x = node->saved[0], *xc = NULL, *yc = NULL, *gc = NULL, *gx = NULL;
    int rc;
    fsdp_dtype_t cdt = fsdp__kernel_dtype(x->dev, x->dt);
    FSDP_TRY(rc, out, fsdp__as_contig(x, cdt, &xc));
    FSDP_TRY(rc, out, fsdp__as_contig(node->saved[1], cdt, &yc));
    if (fsdp__overwritable(gout[0], cdt, x->ndim, x->shape)) {
        /* The gradient in, overwritten by the gradient out (the kernels are element-wise). */
        gc = fsdp_tensor_retain(gout[0]);
        gx = fsdp_tensor_retain(gout[0]);
    } else {
        FSDP_TRY(rc, out, fsdp__as_contig(gout[0], cdt, &gc));
        FSDP_TRY(rc, out, new_like(x, cdt, x->ndim, x->shape, &gx));
    }
    int64_t n = fsdp_tensor_numel(x);
    if (n > 0)
        FSDP_TRY(rc, out,
                 x->dev->ops->unary_backward(x->dev, cdt, (fsdp_unary_op_t)node->i[0], (size_t)n,
                                             node->f[0], fsdp_tensor_data(xc), fsdp_tensor_data(yc),
                                             fsdp_tensor_data(gc), fsdp_tensor_data(gx)));
    FSDP_TRY(rc, out, fsdp__round_to(&gx, x->dt));
    gin[0] = gx;
    gx = NULL;
out:
    fsdp_tensor_release(xc);
    fsdp_tensor_release(yc);
    fsdp_tensor_release(gc);
    fsdp_tensor_release(gx);
    return rc;
}

static const struct fsdp__op_def def_unary = {"unary", unary_backward};

/* An activation: records x and its output for unary_backward. */
static int activation(fsdp_tensor_t *x, fsdp_unary_op_t uop, const char *op, fsdp_tensor_t **out) {
    fsdp_ctx_t *ctx = x ? x->ctx : NULL;
    fsdp_tensor_t *y = NULL;
    struct fsdp__node *node = NULL;
    int rc;
    FSDP_TRY(rc, fail, check_out_ptr(ctx, out, op));
    FSDP_TRY(rc, fail, fsdp__check_tensor(ctx, x, op, "x"));
    FSDP_TRY(rc, fail, unary_forward(x, uop, 0.0, op, &y));
    FSDP_TRY(rc, fail, fsdp__record(&def_unary, 1, &x, 1, &y, &node));
    if (node) {
        node->i[0] = uop;
        node->f[0] = 0.0;
        FSDP_TRY(rc, fail, fsdp__node_save(node, x));
        FSDP_TRY(rc, fail, fsdp__node_save(node, y));
    }
    *out = y;
    return FSDP_OK;
fail:
    fsdp_tensor_release(y);
    return rc;
}

int fsdp_relu(fsdp_tensor_t *x, fsdp_tensor_t **out) {
    return activation(x, FSDP_UNARY_RELU, "fsdp_relu", out);
}

int fsdp_gelu(fsdp_tensor_t *x, fsdp_gelu_approx_t approx, fsdp_tensor_t **out) {
    if (approx != FSDP_GELU_ERF && approx != FSDP_GELU_TANH) {
        fsdp_ctx_t *ctx = x ? x->ctx : NULL;
        if (out) *out = NULL;
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_gelu: approx %d is not a fsdp_gelu_approx_t",
                             (int)approx);
    }
    return activation(x, approx == FSDP_GELU_ERF ? FSDP_UNARY_GELU_ERF : FSDP_UNARY_GELU_TANH,
                      "fsdp_gelu", out);
}

int fsdp_tanh(fsdp_tensor_t *x, fsdp_tensor_t **out) {
    return activation(x, FSDP_UNARY_TANH, "fsdp_tanh", out);
}

int fsdp_sigmoid(fsdp_tensor_t *x, fsdp_tensor_t **out) {
    return activation(x, FSDP_UNARY_SIGMOID, "fsdp_sigmoid", out);
}

int fsdp_exp(fsdp_tensor_t *x, fsdp_tensor_t **out) {
    return activation(x, FSDP_UNARY_EXP, "fsdp_exp", out);
}

int fsdp_ln(fsdp_tensor_t *x, fsdp_tensor_t **out) {
    return activation(x, FSDP_UNARY_LOG, "fsdp_ln", out);
}

/* The affine maps need nothing saved: d(alpha a) = alpha, d(a + alpha) = 1. */
static int scale_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                          fsdp_tensor_t **gin) {
    return fsdp_scale(gout[0], node->f[0], &gin[0]);
}

static int add_scalar_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                               fsdp_tensor_t **gin) {
    (void)node;
    gin[0] = fsdp_tensor_retain(gout[0]);
    return FSDP_OK;
}

static const struct fsdp__op_def def_scale = {"scale", scale_backward};
static const struct fsdp__op_def def_add_scalar = {"add_scalar", add_scalar_backward};

static int affine(fsdp_tensor_t *a, double alpha, bool scale, fsdp_tensor_t **out) {
    const char *op = scale ? "fsdp_scale" : "fsdp_add_scalar";
    fsdp_ctx_t *ctx = a ? a->ctx : NULL;
    fsdp_tensor_t *y = NULL;
    struct fsdp__node *node = NULL;
    int rc;
    FSDP_TRY(rc, fail, check_out_ptr(ctx, out, op));
    FSDP_TRY(rc, fail, fsdp__check_tensor(ctx, a, op, "a"));
    FSDP_TRY(rc, fail,
             unary_forward(a, scale ? FSDP_UNARY_SCALE : FSDP_UNARY_ADD_SCALAR, alpha, op, &y));
    FSDP_TRY(rc, fail, fsdp__record(scale ? &def_scale : &def_add_scalar, 1, &a, 1, &y, &node));
    if (node) node->f[0] = alpha;
    *out = y;
    return FSDP_OK;
fail:
    fsdp_tensor_release(y);
    return rc;
}

int fsdp_scale(fsdp_tensor_t *a, double alpha, fsdp_tensor_t **out) {
    return affine(a, alpha, true, out);
}

int fsdp_add_scalar(fsdp_tensor_t *a, double alpha, fsdp_tensor_t **out) {
    return affine(a, alpha, false, out);
}

/* ---- where and masked fill ---------------------------------------------------------------- */

/* mask (u8/bool) broadcast to like's shape, as a contiguous u8 tensor the where kernel reads. */
static int expand_mask(fsdp_tensor_t *mask, const fsdp_tensor_t *like, const char *op,
                       const char *arg, fsdp_tensor_t **out) {
    fsdp_tensor_t *m = NULL;
    int nd, rc;
    int64_t shape[FSDP_MAX_DIMS], ms[FSDP_MAX_DIMS], ks[FSDP_MAX_DIMS];
    char x[200], y[200];
    *out = NULL;
    FSDP_TRY(rc, fail, fsdp__check_same_device(like, mask, op));
    if (mask->dt != FSDP_DTYPE_U8 && mask->dt != FSDP_DTYPE_BOOL) {
        rc = fsdp__op_err(like, FSDP_EINVAL, op,
                          "argument '%s' is %s; a u8 or bool mask is "
                          "required",
                          arg, fsdp_tensor_describe(mask, x, sizeof x));
        goto fail;
    }
    if (fsdp__broadcast_shape(mask, like, op, &nd, shape) < 0 || nd != like->ndim ||
        memcmp(shape, like->shape, sizeof(int64_t) * (size_t)nd) != 0) {
        rc = fsdp__op_err(like, FSDP_EINVAL, op, "mask '%s' %s does not broadcast to %s", arg,
                          fsdp_tensor_describe(mask, x, sizeof x),
                          fsdp_tensor_describe(like, y, sizeof y));
        goto fail;
    }
    if (fsdp_tensor_numel(like) > 0 && !mask->st->ptr) {
        rc = fsdp__op_err(like, FSDP_EINVAL, op, "the storage of mask '%s' has been freed", arg);
        goto fail;
    }
    FSDP_TRY(rc, fail, new_like(like, FSDP_DTYPE_U8, like->ndim, like->shape, &m));
    if (fsdp_tensor_numel(like) > 0) {
        fsdp__broadcast_strides(mask, nd, shape, ms);
        if (nd == 0) ms[0] = 0;
        int kn = kernel_geometry(nd, shape, ks);
        /* bool is one byte holding 0 or 1, so it copies as u8. */
        FSDP_TRY(rc, fail,
                 like->dev->ops->copy_strided(like->dev, FSDP_DTYPE_U8, kn, ks, fsdp_tensor_data(m),
                                              fsdp_tensor_data(mask), ms));
    }
    *out = m;
    return FSDP_OK;
fail:
    fsdp_tensor_release(m);
    return rc;
}

/* y = m ? a : b where a or b may be NULL for the scalars av / bv; like gives dtype and shape. */
static int where_kernel(const fsdp_tensor_t *like, fsdp_tensor_t *m, fsdp_tensor_t *a, double av,
                        fsdp_tensor_t *b, double bv, fsdp_tensor_t **out) {
    fsdp_tensor_t *ac = NULL, *bc = NULL, *y = NULL;
    int rc;
    *out = NULL;
    fsdp_dtype_t cdt = fsdp__kernel_dtype(like->dev, like->dt);
    if (a) FSDP_TRY(rc, fail, fsdp__as_contig(a, cdt, &ac));
    if (b) FSDP_TRY(rc, fail, fsdp__as_contig(b, cdt, &bc));
    FSDP_TRY(rc, fail, new_like(like, cdt, like->ndim, like->shape, &y));
    int64_t n = fsdp_tensor_numel(like);
    if (n > 0)
        FSDP_TRY(rc, fail,
                 like->dev->ops->where(like->dev, cdt, (size_t)n, fsdp_tensor_data(m),
                                       ac ? fsdp_tensor_data(ac) : NULL, av,
                                       bc ? fsdp_tensor_data(bc) : NULL, bv, fsdp_tensor_data(y)));
    FSDP_TRY(rc, fail, fsdp__round_to(&y, like->dt));
    *out = y;
    y = NULL;
fail:
    fsdp_tensor_release(ac);
    fsdp_tensor_release(bc);
    fsdp_tensor_release(y);
    return rc;
}

/* saved[0] = the expanded u8 mask; the gradient goes to a where it is set, to b elsewhere. */
static int where_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                          fsdp_tensor_t **gin) {
    fsdp_tensor_t *m = node->saved[0], *g = gout[0];
    int rc = FSDP_OK;
    if (node->needs[0]) FSDP_TRY(rc, out, where_kernel(g, m, g, 0.0, NULL, 0.0, &gin[0]));
    if (node->needs[1]) FSDP_TRY(rc, out, where_kernel(g, m, NULL, 0.0, g, 0.0, &gin[1]));
out:
    return rc;
}

/* Only the unmasked elements of x reach the output, so only they get a gradient. */
static int masked_fill_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                                fsdp_tensor_t **gin) {
    return where_kernel(gout[0], node->saved[0], NULL, 0.0, gout[0], 0.0, &gin[0]);
}

static const struct fsdp__op_def def_where = {"where", where_backward};
static const struct fsdp__op_def def_masked_fill = {"masked_fill", masked_fill_backward};

int fsdp_where(fsdp_tensor_t *cond, fsdp_tensor_t *a, fsdp_tensor_t *b, fsdp_tensor_t **out) {
    const char *op = "fsdp_where";
    fsdp_ctx_t *ctx = a ? a->ctx : b ? b->ctx : cond ? cond->ctx : NULL;
    fsdp_tensor_t *m = NULL, *y = NULL;
    struct fsdp__node *node = NULL;
    int rc;
    FSDP_TRY(rc, fail, check_out_ptr(ctx, out, op));
    FSDP_TRY(rc, fail, fsdp__check_tensor(ctx, cond, op, "cond"));
    FSDP_TRY(rc, fail, fsdp__check_tensor(ctx, a, op, "a"));
    FSDP_TRY(rc, fail, fsdp__check_tensor(ctx, b, op, "b"));
    FSDP_TRY(rc, fail, check_float(a, op, "a"));
    FSDP_TRY(rc, fail, check_float(b, op, "b"));
    FSDP_TRY(rc, fail, fsdp__check_same_device(a, b, op));
    FSDP_TRY(rc, fail, check_same_geometry(a, b, op, "a", "b"));
    FSDP_TRY(rc, fail, expand_mask(cond, a, op, "cond", &m));
    FSDP_TRY(rc, fail, where_kernel(a, m, a, 0.0, b, 0.0, &y));
    FSDP_TRY(rc, fail, fsdp__record(&def_where, 2, (fsdp_tensor_t *[]){a, b}, 1, &y, &node));
    if (node) FSDP_TRY(rc, fail, fsdp__node_save(node, m));
    fsdp_tensor_release(m);
    *out = y;
    return FSDP_OK;
fail:
    fsdp_tensor_release(m);
    fsdp_tensor_release(y);
    return rc;
}

int fsdp_masked_fill(fsdp_tensor_t *x, fsdp_tensor_t *mask, double value, fsdp_tensor_t **out) {
    const char *op = "fsdp_masked_fill";
    fsdp_ctx_t *ctx = x ? x->ctx : mask ? mask->ctx : NULL;
    fsdp_tensor_t *m = NULL, *y = NULL;
    struct fsdp__node *node = NULL;
    int rc;
    FSDP_TRY(rc, fail, check_out_ptr(ctx, out, op));
    FSDP_TRY(rc, fail, fsdp__check_tensor(ctx, x, op, "x"));
    FSDP_TRY(rc, fail, fsdp__check_tensor(ctx, mask, op, "mask"));
    FSDP_TRY(rc, fail, check_float(x, op, "x"));
    FSDP_TRY(rc, fail, expand_mask(mask, x, op, "mask", &m));
    FSDP_TRY(rc, fail, where_kernel(x, m, NULL, value, x, 0.0, &y));
    FSDP_TRY(rc, fail, fsdp__record(&def_masked_fill, 1, &x, 1, &y, &node));
    if (node) FSDP_TRY(rc, fail, fsdp__node_save(node, m));
    fsdp_tensor_release(m);
    *out = y;
    return FSDP_OK;
fail:
    fsdp_tensor_release(m);
    fsdp_tensor_release(y);
    return rc;
}

int fsdp_causal_mask(fsdp_ctx_t *ctx, int64_t l, fsdp_tensor_t **out) {
    float *host = NULL;
    int rc;
    FSDP_TRY(rc, fail, check_out_ptr(ctx, out, "fsdp_causal_mask"));
    if (!ctx) {
        rc = FSDP_EINVAL;
        goto fail;
    }
    /* The bound keeps l * l * 4 bytes from overflowing size_t. */
    if (l < 0 || l > ((int64_t)1 << 28)) {
        rc = fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_causal_mask: length %lld is outside [0, 2^28]",
                           (long long)l);
        goto fail;
    }
    /* Built on the host and copied once: there is no triangular kernel, and the mask is made
     * once per sequence length. */
    size_t n = (size_t)l * (size_t)l;
    if (n > 0) {
        FSDP_TRY(rc, fail, fsdp_mem_alloc(ctx, FSDP_MEM_OTHER, n * sizeof *host, (void **)&host));
        for (int64_t i = 0; i < l; i++)
            for (int64_t j = 0; j < l; j++)
                host[i * l + j] = j > i ? -INFINITY : 0.0f;
    }
    int64_t shape[2] = {l, l};
    FSDP_TRY(rc, fail,
             fsdp_tensor_from_host(ctx, FSDP_DTYPE_F32, 2, shape, host, fsdp__op_cat(ctx), out));
fail:
    fsdp_mem_free(ctx, host);
    return rc;
}

/* ---- dtype conversion ----------------------------------------------------------------------- */

static int to_dtype_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                             fsdp_tensor_t **gin) {
    return fsdp__as_contig(gout[0], node->in_dt[0], &gin[0]);
}

static const struct fsdp__op_def def_to_dtype = {"to_dtype", to_dtype_backward};

int fsdp_to_dtype(fsdp_tensor_t *t, fsdp_dtype_t dt, fsdp_tensor_t **out) {
    const char *op = "fsdp_to_dtype";
    fsdp_ctx_t *ctx = t ? t->ctx : NULL;
    fsdp_tensor_t *tc = NULL, *y = NULL;
    struct fsdp__node *node = NULL;
    int rc;
    FSDP_TRY(rc, fail, check_out_ptr(ctx, out, op));
    FSDP_TRY(rc, fail, fsdp__check_tensor(ctx, t, op, "t"));
    if (!fsdp_dtype_valid((int)dt)) {
        rc = fsdp__op_err(t, FSDP_EINVAL, op, "dtype %d is not a fsdp_dtype_t", (int)dt);
        goto fail;
    }
    int64_t n = fsdp_tensor_numel(t);
    if (n > 0 && !t->st->ptr) {
        rc = fsdp__op_err(t, FSDP_EINVAL, op, "the storage of argument 't' has been freed");
        goto fail;
    }
    /* Always a new tensor, even for the same dtype: the output gets its own autograd state. */
    FSDP_TRY(rc, fail, fsdp__as_contig(t, t->dt, &tc));
    if (dt == t->dt && tc != t) {
        /* A strided t was just copied: that copy is the answer. */
        y = tc;
        tc = NULL;
    } else {
        FSDP_TRY(rc, fail, new_like(t, dt, t->ndim, t->shape, &y));
        if (n > 0 && dt == t->dt)
            rc = t->dev->ops->memcpy(t->dev, fsdp_tensor_data(y), fsdp_tensor_data(tc),
                                     (size_t)n * fsdp_dtype_size(dt), FSDP_COPY_D2D, NULL);
        else if (n > 0)
            rc = t->dev->ops->cast(t->dev, dt, fsdp_tensor_data(y), t->dt, fsdp_tensor_data(tc),
                                   (size_t)n);
        if (rc < 0) goto fail;
    }
    /* Only float-to-float conversions carry a gradient; an integer output is a constant. */
    if (fsdp_dtype_is_float(t->dt) && fsdp_dtype_is_float(dt))
        FSDP_TRY(rc, fail, fsdp__record(&def_to_dtype, 1, &t, 1, &y, &node));
    fsdp_tensor_release(tc);
    *out = y;
    return FSDP_OK;
fail:
    fsdp_tensor_release(tc);
    fsdp_tensor_release(y);
    return rc;
}

/* ---- mean squared error ------------------------------------------------------------------- */

/* saved[0] = d = a - b in the compute dtype, i[0] = reduction. d loss / da = 2 d g (/ n). */
static int mse_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout, fsdp_tensor_t **gin) {
    fsdp_tensor_t *d = node->saved[0], *gc = NULL, *p = NULL;
    int rc;
    int64_t n = fsdp_tensor_numel(d);
    double k = node->i[0] == FSDP_REDUCTION_MEAN ? 2.0 / (double)(n > 0 ? n : 1) : 2.0;
    FSDP_TRY(rc, out, fsdp__as_contig(gout[0], d->dt, &gc));
    /* A scalar gradient (mean, sum) broadcasts over d. */
    FSDP_TRY(rc, out, fsdp_mul(d, gc, &p));
    for (int i = 0; i < 2; i++) {
        if (!node->needs[i]) continue;
        FSDP_TRY(rc, out, fsdp_scale(p, i == 0 ? k : -k, &gin[i]));
        FSDP_TRY(rc, out, fsdp__round_to(&gin[i], node->in_dt[i]));
    }
out:
    fsdp_tensor_release(gc);
    fsdp_tensor_release(p);
    return rc;
}

static const struct fsdp__op_def def_mse = {"mse_loss", mse_backward};

int fsdp_mse_loss(fsdp_tensor_t *a, fsdp_tensor_t *b, fsdp_reduction_t reduction,
                  fsdp_tensor_t **out) {
    const char *op = "fsdp_mse_loss";
    fsdp_ctx_t *ctx = a ? a->ctx : b ? b->ctx : NULL;
    fsdp_tensor_t *ac = NULL, *bc = NULL, *d = NULL, *sq = NULL, *y = NULL;
    struct fsdp__node *node = NULL;
    int rc;
    int64_t ks[FSDP_MAX_DIMS], cs[FSDP_MAX_DIMS];
    FSDP_TRY(rc, fail, check_out_ptr(ctx, out, op));
    FSDP_TRY(rc, fail, fsdp__check_tensor(ctx, a, op, "a"));
    FSDP_TRY(rc, fail, fsdp__check_tensor(ctx, b, op, "b"));
    FSDP_TRY(rc, fail, check_float(a, op, "a"));
    FSDP_TRY(rc, fail, check_float(b, op, "b"));
    FSDP_TRY(rc, fail, fsdp__check_same_device(a, b, op));
    FSDP_TRY(rc, fail, check_same_geometry(a, b, op, "a", "b"));
    if (reduction != FSDP_REDUCTION_MEAN && reduction != FSDP_REDUCTION_SUM &&
        reduction != FSDP_REDUCTION_NONE) {
        rc = fsdp__op_err(a, FSDP_EINVAL, op, "reduction %d is not a fsdp_reduction_t",
                          (int)reduction);
        goto fail;
    }
    fsdp_dtype_t cdt = fsdp__kernel_dtype(a->dev, a->dt);
    int64_t n = fsdp_tensor_numel(a);
    FSDP_TRY(rc, fail, fsdp__as_contig(a, cdt, &ac));
    FSDP_TRY(rc, fail, fsdp__as_contig(b, cdt, &bc));
    FSDP_TRY(rc, fail, new_like(a, cdt, a->ndim, a->shape, &d));
    FSDP_TRY(rc, fail, new_like(a, cdt, a->ndim, a->shape, &sq));
    if (n > 0) {
        /* Everything is contiguous here, so the binary kernel runs on one flat dimension. */
        ks[0] = n;
        cs[0] = 1;
        FSDP_TRY(rc, fail,
                 a->dev->ops->binary(a->dev, cdt, FSDP_BINARY_SUB, 1, ks, fsdp_tensor_data(d),
                                     fsdp_tensor_data(ac), cs, fsdp_tensor_data(bc), cs));
        FSDP_TRY(rc, fail,
                 a->dev->ops->binary(a->dev, cdt, FSDP_BINARY_MUL, 1, ks, fsdp_tensor_data(sq),
                                     fsdp_tensor_data(d), cs, fsdp_tensor_data(d), cs));
    }
    if (reduction == FSDP_REDUCTION_NONE) {
        y = sq;
        sq = NULL;
    } else {
        FSDP_TRY(rc, fail, new_like(a, cdt, 0, NULL, &y));
        /* The mean of no elements is NaN, as in PyTorch. */
        double alpha = reduction == FSDP_REDUCTION_SUM ? 1.0 : n > 0 ? 1.0 / (double)n : NAN;
        if (n > 0)
            FSDP_TRY(rc, fail,
                     a->dev->ops->reduce_sum(a->dev, cdt, 1, (size_t)n, 1, alpha,
                                             fsdp_tensor_data(sq), fsdp_tensor_data(y)));
        else
            FSDP_TRY(rc, fail,
                     a->dev->ops->fill(a->dev, cdt, 1, reduction == FSDP_REDUCTION_SUM ? 0.0 : NAN,
                                       fsdp_tensor_data(y)));
    }
    FSDP_TRY(rc, fail, fsdp__round_to(&y, a->dt));
    FSDP_TRY(rc, fail, fsdp__record(&def_mse, 2, (fsdp_tensor_t *[]){a, b}, 1, &y, &node));
    if (node) {
        node->i[0] = reduction;
        FSDP_TRY(rc, fail, fsdp__node_save(node, d));
    }
    *out = y;
    y = NULL;
fail:
    fsdp_tensor_release(ac);
    fsdp_tensor_release(bc);
    fsdp_tensor_release(d);
    fsdp_tensor_release(sq);
    fsdp_tensor_release(y);
    return rc;
}
