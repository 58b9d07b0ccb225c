/* SPDX-License-Identifier: MIT */
/*
 * cuda_nn.c: the CUDA device's row kernels and the kernels of the layers and optimizers:
 * softmax, layer and batch norm, embedding, cross-entropy, dropout (on the CPU's Philox stream,
 * so a CUDA run drops the same elements as a CPU run), SGD and Adam(W) steps. Each checks its
 * dtype, makes the device current and launches the kernel of cuda_kernels.h on the compute
 * stream.
 */
#include <config.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cuda/cuda_impl.h"
#include "backends/cuda/cuda_kernels.h"
#include "backends/cuda/cuda_philox.h"

/* ---- row kernels, norms, embedding, losses, dropout, optimizers ---- */

int fsdp__cuda_softmax(fsdp_device_t *dev, fsdp_dtype_t dt, bool lg, size_t rows, size_t n,
                       const void *x, void *y) {
    FLOAT_DT(dev, "softmax", dt);
    if (rows == 0 || n == 0) return FSDP_OK;
    USE(cd, dev);
    return launched(dev, fsdp__cuda_k_softmax(cd->compute, dt == FSDP_DTYPE_F64, lg, rows, n, x, y),
                    "softmax kernel");
}

int fsdp__cuda_softmax_backward(fsdp_device_t *dev, fsdp_dtype_t dt, bool lg, size_t rows, size_t n,
                                const void *y, const void *gy, void *gx) {
    FLOAT_DT(dev, "softmax_backward", dt);
    if (rows == 0 || n == 0) return FSDP_OK;
    USE(cd, dev);
    return launched(
        dev,
        fsdp__cuda_k_softmax_backward(cd->compute, dt == FSDP_DTYPE_F64, lg, rows, n, y, gy, gx),
        "softmax_backward kernel");
}

int fsdp__cuda_layer_norm(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n, double eps,
                          const void *x, const void *w, const void *b, void *y, void *mean,
                          void *rstd) {
    FLOAT_DT(dev, "layer_norm", dt);
    if (rows == 0) return FSDP_OK;
    USE(cd, dev);
    return launched(dev,
                    fsdp__cuda_k_layer_norm(cd->compute, dt == FSDP_DTYPE_F64, rows, n, eps, x, w,
                                            b, y, mean, rstd),
                    "layer_norm kernel");
}

int fsdp__cuda_layer_norm_backward(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n,
                                   const void *x, const void *w, const void *mean, const void *rstd,
                                   const void *gy, void *gx, void *gw, void *gb) {
    FLOAT_DT(dev, "layer_norm_backward", dt);
    if (n == 0 || (rows == 0 && !gw && !gb)) return FSDP_OK;
    USE(cd, dev);
    return launched(dev,
                    fsdp__cuda_k_layer_norm_backward(cd->compute, dt == FSDP_DTYPE_F64, rows, n, x,
                                                     w, mean, rstd, gy, rows ? gx : NULL, gw, gb),
                    "layer_norm_backward kernel");
}

int fsdp__cuda_batch_norm(fsdp_device_t *dev, fsdp_dtype_t dt, bool train, size_t nb, size_t c,
                          size_t l, double eps, double momentum, const void *x, const void *w,
                          const void *b, void *running_mean, void *running_var, void *y, void *mean,
                          void *rstd) {
    FLOAT_DT(dev, "batch_norm", dt);
    if (!train && (!running_mean || !running_var))
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL,
                             "cuda batch_norm: evaluation needs running_mean and running_var");
    if (c == 0) return FSDP_OK;
    USE(cd, dev);
    return launched(dev,
                    fsdp__cuda_k_batch_norm(cd->compute, dt == FSDP_DTYPE_F64, train, nb, c, l, eps,
                                            momentum, x, w, b, running_mean, running_var, y, mean,
                                            rstd),
                    "batch_norm kernel");
}

int fsdp__cuda_batch_norm_backward(fsdp_device_t *dev, fsdp_dtype_t dt, bool train, size_t nb,
                                   size_t c, size_t l, const void *x, const void *w,
                                   const void *mean, const void *rstd, const void *gy, void *gx,
                                   void *gw, void *gb) {
    FLOAT_DT(dev, "batch_norm_backward", dt);
    if (c == 0) return FSDP_OK;
    USE(cd, dev);
    return launched(dev,
                    fsdp__cuda_k_batch_norm_backward(cd->compute, dt == FSDP_DTYPE_F64, train, nb,
                                                     c, l, x, w, mean, rstd, gy, gx, gw, gb),
                    "batch_norm_backward kernel");
}

int fsdp__cuda_embedding(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, size_t dim,
                         const int64_t *idx, const void *w, void *y) {
    FLOAT_DT(dev, "embedding", dt);
    if (n == 0 || dim == 0) return FSDP_OK;
    USE(cd, dev);
    return launched(dev,
                    fsdp__cuda_k_embedding(cd->compute, dt == FSDP_DTYPE_F64, n, dim, idx, w, y),
                    "embedding kernel");
}

int fsdp__cuda_embedding_backward(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, size_t dim,
                                  const int64_t *idx, int64_t padding_idx, const void *gy,
                                  void *gw) {
    FLOAT_DT(dev, "embedding_backward", dt);
    if (n == 0 || dim == 0) return FSDP_OK;
    USE(cd, dev);
    return launched(dev,
                    fsdp__cuda_k_embedding_backward(cd->compute, dt == FSDP_DTYPE_F64, n, dim, idx,
                                                    padding_idx, gy, gw),
                    "embedding_backward kernel");
}

int fsdp__cuda_cross_entropy(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n,
                             const void *logits, const int64_t *target, int64_t ignore_index,
                             double label_smoothing, void *loss, void *logp) {
    FLOAT_DT(dev, "cross_entropy", dt);
    if (rows == 0) return FSDP_OK;
    USE(cd, dev);
    return launched(dev,
                    fsdp__cuda_k_cross_entropy(cd->compute, dt == FSDP_DTYPE_F64, rows, n, logits,
                                               target, ignore_index, label_smoothing, loss, logp),
                    "cross_entropy kernel");
}

int fsdp__cuda_cross_entropy_backward(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n,
                                      const void *logp, const int64_t *target, int64_t ignore_index,
                                      double label_smoothing, const void *gloss, void *gx) {
    FLOAT_DT(dev, "cross_entropy_backward", dt);
    if (rows == 0 || n == 0) return FSDP_OK;
    USE(cd, dev);
    return launched(dev,
                    fsdp__cuda_k_cross_entropy_backward(cd->compute, dt == FSDP_DTYPE_F64, rows, n,
                                                        logp, target, ignore_index, label_smoothing,
                                                        gloss, gx),
                    "cross_entropy_backward kernel");
}

int fsdp__cuda_dropout(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, double p, uint64_t seed,
                       uint64_t stream, uint64_t offset, const void *x, void *y, uint8_t *mask) {
    FLOAT_DT(dev, "dropout", dt);
    if (n == 0) return FSDP_OK;
    int mode = !(p > 0.0) ? 1 : p >= 1.0 ? 2 : 0;
    uint32_t thr = mode == 0 ? fsdp_cuda_dropout_threshold(p) : 0;
    USE(cd, dev);
    return launched(dev,
                    fsdp__cuda_k_dropout(cd->compute, dt == FSDP_DTYPE_F64, n, mode, thr, p, seed,
                                         stream, offset, x, y, mask),
                    "dropout kernel");
}

int fsdp__cuda_sgd_step(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, void *p, const void *g,
                        void *buf, double lr, double momentum, double dampening, double wd,
                        bool nesterov, bool first) {
    FLOAT_DT(dev, "sgd_step", dt);
    if (momentum != 0.0 && !buf)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "cuda sgd_step: momentum %g needs buf",
                             momentum);
    if (n == 0) return FSDP_OK;
    USE(cd, dev);
    return launched(dev,
                    fsdp__cuda_k_sgd_step(cd->compute, dt == FSDP_DTYPE_F64, n, p, g, buf, lr,
                                          momentum, dampening, wd, nesterov, first),
                    "sgd_step kernel");
}

int fsdp__cuda_adam_step(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, void *p, const void *g,
                         void *m, void *v, void *vmax, double lr, double beta1, double beta2,
                         double eps, double wd, bool decoupled, bool amsgrad, int64_t t) {
    FLOAT_DT(dev, "adam_step", dt);
    if (amsgrad && !vmax)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "cuda adam_step: amsgrad needs vmax");
    if (n == 0) return FSDP_OK;
    USE(cd, dev);
    return launched(dev,
                    fsdp__cuda_k_adam_step(cd->compute, dt == FSDP_DTYPE_F64, n, p, g, m, v, vmax,
                                           lr, beta1, beta2, eps, wd, decoupled, amsgrad, t),
                    "adam_step kernel");
}
