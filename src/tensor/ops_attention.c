/* SPDX-License-Identifier: MIT */
/*
 * ops_attention.c: attention over packed heads as one operation (ops_attention.h).
 *
 * The forward hands the whole (B, T, 3 d) projection to the device's attention kernel, which
 * writes the output and the attention weights; the node saves qkv and the weights, and the
 * backward hands both with the incoming gradient to attention_backward, which writes the
 * gradient of every element of qkv. Composed from views, fsdp_attention and a merge, the same
 * step saves a scaled copy of q and the weights, and keeps qkv alive through the views of k and
 * v; here only the weights are new memory. The split and merge copies, and the copies the
 * batched products make of the strided k and v, forward and backward, are not made at all.
 */
#include "autograd/autograd_impl.h"
#include "tensor/ops_attention.h"
#include "tensor/tensor_impl.h"

/* NULL when the arguments fit, else what does not (for the error message). */
static const char *packed_misfit(const fsdp_tensor_t *qkv, int64_t heads,
                                 const fsdp_tensor_t *mask) {
    if (!qkv) return "qkv is NULL";
    if (!qkv->dev->ops->attention || !qkv->dev->ops->attention_backward ||
        !(qkv->dev->attn_fused & FSDP__DT_BIT(FSDP_DTYPE_F32)))
        return "the device has no fused attention kernel for f32";
    if (qkv->dt != FSDP_DTYPE_F32 || qkv->ndim != 3 || !fsdp_tensor_is_contiguous(qkv))
        return "qkv must be a contiguous f32 (B, T, 3 d) tensor";
    const int64_t b = qkv->shape[0], t = qkv->shape[1], d3 = qkv->shape[2];
    if (b <= 0 || t <= 0 || d3 <= 0 || d3 % 3 != 0) return "qkv must be (B, T, 3 d), all > 0";
    if (heads <= 0 || (d3 / 3) % heads != 0) return "heads must divide d";
    if (!mask) return NULL;
    if (mask->dev != qkv->dev) return "mask must be on qkv's device";
    if (mask->dt != FSDP_DTYPE_F32 || mask->ndim != 2 || mask->shape[0] != t ||
        mask->shape[1] != t || !fsdp_tensor_is_contiguous(mask))
        return "mask must be a contiguous f32 (T, T) tensor";
    if (fsdp_tensor_requires_grad(mask)) return "mask must not require a gradient";
    return NULL;
}

bool fsdp__attention_packed_ok(const fsdp_tensor_t *qkv, int64_t heads, const fsdp_tensor_t *mask) {
    return !packed_misfit(qkv, heads, mask) && !fsdp__env_is("FSDP_FUSED_ATTENTION", "0");
}

static int packed_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                           fsdp_tensor_t **gin) {
    fsdp_tensor_t *qkv = node->saved[0], *p = node->saved[1], *gy = NULL;
    fsdp_device_t *dev = qkv->dev;
    const int64_t heads = node->i[0], d = qkv->shape[2] / 3;
    int rc;
    FSDP_TRY(rc, fail, fsdp__as_contig(gout[0], FSDP_DTYPE_F32, &gy));
    FSDP_TRY(rc, fail,
             fsdp__tensor_new(qkv->ctx, dev, FSDP_DTYPE_F32, 3, qkv->shape, fsdp__op_cat(qkv->ctx),
                              &gin[0]));
    FSDP_TRY(rc, fail,
             dev->ops->attention_backward(dev, FSDP_DTYPE_F32, qkv->shape[0], qkv->shape[1], heads,
                                          d / heads, node->f[0], fsdp_tensor_data(qkv),
                                          fsdp_tensor_data(p), fsdp_tensor_data(gy),
                                          fsdp_tensor_data(gin[0])));
    fsdp_tensor_release(gy);
    return FSDP_OK;
fail:
    fsdp_tensor_release(gy);
    fsdp_tensor_release(gin[0]);
    gin[0] = NULL;
    return rc;
}

static const struct fsdp__op_def def_attention_packed = {"attention_packed", packed_backward};

int fsdp__attention_packed(fsdp_tensor_t *qkv, int64_t heads, double scale, fsdp_tensor_t *mask,
                           fsdp_tensor_t **out) {
    fsdp_tensor_t *y = NULL, *p = NULL;
    struct fsdp__node *node = NULL;
    int rc;
    if (!out)
        return fsdp__ctx_err(qkv ? qkv->ctx : NULL, FSDP_EINVAL, "attention_packed: out is NULL");
    *out = NULL;
    const char *why = packed_misfit(qkv, heads, mask);
    if (why) {
        char d0[160] = "NULL", d1[160] = "NULL";
        if (qkv) fsdp_tensor_describe(qkv, d0, sizeof d0);
        if (mask) fsdp_tensor_describe(mask, d1, sizeof d1);
        return fsdp__ctx_err(qkv ? qkv->ctx : NULL, FSDP_EINVAL,
                             "attention_packed: %s (qkv %s, heads %lld, mask %s)", why, d0,
                             (long long)heads, d1);
    }
    fsdp_device_t *dev = qkv->dev;
    const int64_t b = qkv->shape[0], t = qkv->shape[1], d = qkv->shape[2] / 3;
    const int64_t ys[3] = {b, t, d}, ps[4] = {b, heads, t, t};
    FSDP_TRY(rc, fail,
             fsdp__tensor_new(qkv->ctx, dev, FSDP_DTYPE_F32, 3, ys, fsdp__op_cat(qkv->ctx), &y));
    FSDP_TRY(rc, fail,
             fsdp__tensor_new(qkv->ctx, dev, FSDP_DTYPE_F32, 4, ps, fsdp__op_cat(qkv->ctx), &p));
    FSDP_TRY(rc, fail,
             dev->ops->attention(dev, FSDP_DTYPE_F32, b, t, heads, d / heads, scale,
                                 fsdp_tensor_data(qkv), mask ? fsdp_tensor_data(mask) : NULL,
                                 fsdp_tensor_data(p), fsdp_tensor_data(y)));
    FSDP_TRY(rc, fail, fsdp__record(&def_attention_packed, 1, &qkv, 1, &y, &node));
    if (node) {
        node->i[0] = heads;
        node->f[0] = scale;
        FSDP_TRY(rc, fail, fsdp__node_save(node, qkv));
        FSDP_TRY(rc, fail, fsdp__node_save(node, p));
    }
    fsdp_tensor_release(p);
    *out = y;
    return FSDP_OK;
fail:
    fsdp_tensor_release(p);
    fsdp_tensor_release(y);
    return rc;
}
