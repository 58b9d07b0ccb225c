/* SPDX-License-Identifier: MIT */
/*
 * clip.c: gradient norms and clipping (PyTorch's torch.nn.utils.clip_grad_norm_).
 */
#include <math.h>
#include <stdlib.h>

#include "internal.h"
#include "optim/optim_impl.h"
#include "tensor/tensor_impl.h"
#include <fsdp/optim.h>

int fsdp__grad_norm_part(fsdp_tensor_t *g, double p, double *out) {
    *out = 0.0;
    int64_t n = fsdp_tensor_numel(g);
    if (n == 0) return FSDP_OK;
    int cdt = fsdp__compute_dtype(g->dt);
    if (cdt < 0)
        return fsdp__op_err(g, FSDP_EINVAL, "grad norm", "'%s' is not a float tensor (%s)",
                            fsdp_tensor_name(g), fsdp_dtype_name(g->dt));
    fsdp_tensor_t *x = NULL, *tmp = NULL, *y = NULL;
    int rc = fsdp__as_contig(g, (fsdp_dtype_t)cdt, &x);
    const int64_t one[1] = {1};
    if (rc == 0) rc = fsdp__tensor_new(g->ctx, g->dev, x->dt, 0, one, FSDP_MEM_OTHER, &y);
    const struct fsdp_dev_ops *ops = g->dev->ops;
    if (rc == 0 && p == 2.0) {
        rc = ops->sum_squares(g->dev, x->dt, (size_t)n, fsdp_tensor_data(x), fsdp_tensor_data(y));
    } else if (rc == 0) {
        rc = fsdp__tensor_new(g->ctx, g->dev, x->dt, 1, &n, FSDP_MEM_OTHER, &tmp);
        if (rc == 0)
            rc = ops->unary(g->dev, x->dt, FSDP_UNARY_ABS, (size_t)n, 0.0, fsdp_tensor_data(x),
                            fsdp_tensor_data(tmp));
        if (rc == 0 && isinf(p)) {
            rc = ops->reduce_max(g->dev, x->dt, 1, (size_t)n, 1, fsdp_tensor_data(tmp),
                                 fsdp_tensor_data(y), NULL);
        } else if (rc == 0) {
            if (p != 1.0)
                rc = ops->unary(g->dev, x->dt, FSDP_UNARY_POW, (size_t)n, p,
                                fsdp_tensor_data(tmp), fsdp_tensor_data(tmp));
            if (rc == 0)
                rc = ops->reduce_sum(g->dev, x->dt, 1, (size_t)n, 1, 1.0, fsdp_tensor_data(tmp),
                                     fsdp_tensor_data(y));
        }
    }
    if (rc == 0) rc = fsdp_tensor_item(y, 0, out);
    fsdp_tensor_release(x);
    fsdp_tensor_release(tmp);
    fsdp_tensor_release(y);
    return rc;
}

double fsdp__grad_norm_finish(double acc, double p) {
    if (isinf(p) || p == 1.0) return acc;
    if (p == 2.0) return sqrt(acc);
    return pow(acc, 1.0 / p);
}

double fsdp__clip_coef(double max_norm, double total) {
    double c = max_norm / (total + 1e-6);
    return c < 1.0 ? c : 1.0;
}

int fsdp__grad_scale(fsdp_tensor_t *g, double coef) {
    if (coef == 1.0 || fsdp_tensor_numel(g) == 0) return FSDP_OK;
    if (fsdp_tensor_is_contiguous(g) && (g->dt == FSDP_DTYPE_F32 || g->dt == FSDP_DTYPE_F64))
        return g->dev->ops->unary(g->dev, g->dt, FSDP_UNARY_SCALE, (size_t)fsdp_tensor_numel(g),
                                  coef, fsdp_tensor_data(g), fsdp_tensor_data(g));
    fsdp_tensor_t *s = NULL;
    int rc = fsdp_scale(g, coef, &s);
    if (rc == 0) rc = fsdp_tensor_copy_(g, s);
    fsdp_tensor_release(s);
    return rc;
}

int fsdp_clip_grad_norm(fsdp_ctx_t *ctx, size_t n, fsdp_tensor_t *const *params, double max_norm,
                        double norm_type, double *total_norm) {
    if (total_norm) *total_norm = 0.0;
    if (!ctx) return FSDP_EINVAL;
    if (n > 0 && !params)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_clip_grad_norm: %zu parameters but the "
                             "array is NULL", n);
    if (!(max_norm >= 0.0) || !(norm_type > 0.0))
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_clip_grad_norm: max_norm %g must be >= 0 and norm_type %g > 0",
                             max_norm, norm_type);
    double acc = 0.0;
    for (size_t i = 0; i < n; i++) {
        fsdp_tensor_t *g = params[i] ? fsdp_tensor_grad(params[i]) : NULL;
        if (!g) continue;
        double part = 0.0;
        int rc = fsdp__grad_norm_part(g, norm_type, &part);
        if (rc < 0) return rc;
        acc = isinf(norm_type) ? fmax(acc, part) : acc + part;
    }
    double total = fsdp__grad_norm_finish(acc, norm_type);
    double coef = fsdp__clip_coef(max_norm, total);
    for (size_t i = 0; i < n && coef < 1.0; i++) {
        fsdp_tensor_t *g = params[i] ? fsdp_tensor_grad(params[i]) : NULL;
        if (!g) continue;
        int rc = fsdp__grad_scale(g, coef);
        if (rc < 0) return rc;
    }
    if (total_norm) *total_norm = total;
    return FSDP_OK;
}
