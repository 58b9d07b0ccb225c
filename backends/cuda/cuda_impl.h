/* SPDX-License-Identifier: MIT */
/*
 * cuda_impl.h: what the files of the CUDA device share (cuda_device.c: creation, memory,
 * streams, elementwise kernels, the vtable; cuda_gemm.c: matrix products; cuda_nn.c: row
 * kernels, norms, embedding, losses, dropout, optimizers): the device's state, the one error
 * translation (cuda_fail for the runtime, blas_fail for cuBLAS statuses), making the device's GPU
 * current (use/USE), and the vtable entries the other files define.
 */
#ifndef FSDP_CUDA_IMPL_H
#define FSDP_CUDA_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The CUDA headers come in through -I, so GCC checks them like ours; cublasLt.h declares a
 * function with an empty parameter list. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#pragma GCC diagnostic pop

#include "backends/cuda/cuda_device.h"

#define LT_WORKSPACE ((size_t)32 << 20)

struct cuda_dev {
    fsdp_device_t *dev;
    int ordinal;
    cudaStream_t compute;
    cublasHandle_t blas;
    cublasLtHandle_t lt;
    void *lt_ws;     /* cuBLASLt workspace (LT_WORKSPACE bytes) */
    double *scratch; /* FSDP_CUDA_SUMSQ_BLOCKS partial sums of sum_squares */
    fsdp_bcache_t *alloc;
    bool tf32;
};

static inline struct cuda_dev *cd_of(fsdp_device_t *dev) {
    return dev->impl;
}

static inline int cuda_fail(fsdp_device_t *dev, cudaError_t e, const char *what) {
    cudaGetLastError(); /* clears a sticky-free error so the next call starts clean */
    int rc = e == cudaErrorMemoryAllocation ? FSDP_ENOMEM : FSDP_EBACKEND;
    return fsdp__ctx_err(dev->ctx, rc, "%s %s: %s (%s)", dev->name, what, cudaGetErrorString(e),
                         cudaGetErrorName(e));
}

static inline int blas_fail(fsdp_device_t *dev, cublasStatus_t st, const char *what) {
    return fsdp__ctx_err(dev->ctx, st == CUBLAS_STATUS_ALLOC_FAILED ? FSDP_ENOMEM : FSDP_EBACKEND,
                         "%s %s: cuBLAS status %d", dev->name, what, (int)st);
}

/* Makes the device current; returns its state, or NULL with the error in *rc. */
static inline struct cuda_dev *use(fsdp_device_t *dev, int *rc) {
    struct cuda_dev *cd = cd_of(dev);
    cudaError_t e = cudaSetDevice(cd->ordinal);
    if (e != cudaSuccess) {
        *rc = cuda_fail(dev, e, "cudaSetDevice");
        return NULL;
    }
    *rc = FSDP_OK;
    return cd;
}

#define USE(cd, dev)                                                                               \
    int rc_;                                                                                       \
    struct cuda_dev *cd = use(dev, &rc_);                                                          \
    if (!cd) return rc_

static inline int launched(fsdp_device_t *dev, cudaError_t e, const char *what) {
    return e == cudaSuccess ? FSDP_OK : cuda_fail(dev, e, what);
}

static inline int bad_dtype(fsdp_device_t *dev, const char *fn, fsdp_dtype_t dt) {
    return fsdp__ctx_err(dev->ctx, FSDP_ENOTSUP,
                         "cuda %s: dtype %s is not supported (the kernel takes f32 or f64)", fn,
                         fsdp_dtype_name(dt));
}

#define FLOAT_DT(dev, fn, dt)                                                                      \
    do {                                                                                           \
        if ((dt) != FSDP_DTYPE_F32 && (dt) != FSDP_DTYPE_F64) return bad_dtype(dev, fn, dt);       \
    } while (0)

/* ---- defined in cuda_gemm.c and cuda_nn.c: vtable entries (device.h says what each does) ---- */

int fsdp__cuda_gemm(fsdp_device_t *dev, fsdp_dtype_t dt, bool trans_a, bool trans_b, int64_t m,
                    int64_t n, int64_t k, double alpha, const void *a, int64_t lda,
                    int64_t stride_a, const void *b, int64_t ldb, int64_t stride_b, double beta,
                    void *c, int64_t ldc, int64_t stride_c, int64_t batch);
int fsdp__cuda_gemm_lp(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_dtype_t ct, bool trans_a,
                       bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const void *a,
                       int64_t lda, int64_t stride_a, const void *b, int64_t ldb, int64_t stride_b,
                       double beta, void *c, int64_t ldc, int64_t stride_c, int64_t batch);
int fsdp__cuda_softmax(fsdp_device_t *dev, fsdp_dtype_t dt, bool lg, size_t rows, size_t n,
                       const void *x, void *y);
int fsdp__cuda_softmax_backward(fsdp_device_t *dev, fsdp_dtype_t dt, bool lg, size_t rows, size_t n,
                                const void *y, const void *gy, void *gx);
int fsdp__cuda_layer_norm(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n, double eps,
                          const void *x, const void *w, const void *b, void *y, void *mean,
                          void *rstd);
int fsdp__cuda_layer_norm_backward(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n,
                                   const void *x, const void *w, const void *mean, const void *rstd,
                                   const void *gy, void *gx, void *gw, void *gb);
int fsdp__cuda_batch_norm(fsdp_device_t *dev, fsdp_dtype_t dt, bool train, size_t nb, size_t c,
                          size_t l, double eps, double momentum, const void *x, const void *w,
                          const void *b, void *running_mean, void *running_var, void *y, void *mean,
                          void *rstd);
int fsdp__cuda_batch_norm_backward(fsdp_device_t *dev, fsdp_dtype_t dt, bool train, size_t nb,
                                   size_t c, size_t l, const void *x, const void *w,
                                   const void *mean, const void *rstd, const void *gy, void *gx,
                                   void *gw, void *gb);
int fsdp__cuda_embedding(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, size_t dim,
                         const int64_t *idx, const void *w, void *y);
int fsdp__cuda_embedding_backward(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, size_t dim,
                                  const int64_t *idx, int64_t padding_idx, const void *gy,
                                  void *gw);
int fsdp__cuda_cross_entropy(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n,
                             const void *logits, const int64_t *target, int64_t ignore_index,
                             double label_smoothing, void *loss, void *logp);
int fsdp__cuda_cross_entropy_backward(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n,
                                      const void *logp, const int64_t *target, int64_t ignore_index,
                                      double label_smoothing, const void *gloss, void *gx);
int fsdp__cuda_dropout(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, double p, uint64_t seed,
                       uint64_t stream, uint64_t offset, const void *x, void *y, uint8_t *mask);
int fsdp__cuda_sgd_step(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, void *p, const void *g,
                        void *buf, double lr, double momentum, double dampening, double wd,
                        bool nesterov, bool first);
int fsdp__cuda_adam_step(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, void *p, const void *g,
                         void *m, void *v, void *vmax, double lr, double beta1, double beta2,
                         double eps, double wd, bool decoupled, bool amsgrad, int64_t t);

#endif /* FSDP_CUDA_IMPL_H */
