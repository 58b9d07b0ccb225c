/* SPDX-License-Identifier: MIT */
/*
 * cuda_kernels.h: the extern "C" launchers of the CUDA device's kernels (cuda_kernels.cu,
 * cuda_nn_kernels.cu), called by cuda_device.c.
 *
 * Every launcher enqueues on `s` and returns the launch's cudaError_t (cudaSuccess when the
 * kernel was queued); it never synchronizes. Element types: `f64` selects double, else float.
 * Arguments were checked by the device layer (device_impl.h gives each kernel's contract).
 */
#ifndef FSDP_CUDA_KERNELS_H
#define FSDP_CUDA_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FSDP_CUDA_MAX_DIMS 8

/* fsdp_unary_op_t and fsdp_binary_op_t (device_impl.h, which nvcc does not compile: it carries
 * C11 atomics); cuda_device.c checks at compile time that the numbers agree. */
enum {
    FSDP_CUDA_UN_RELU = 0,
    FSDP_CUDA_UN_GELU_ERF,
    FSDP_CUDA_UN_GELU_TANH,
    FSDP_CUDA_UN_TANH,
    FSDP_CUDA_UN_SIGMOID,
    FSDP_CUDA_UN_NEG,
    FSDP_CUDA_UN_EXP,
    FSDP_CUDA_UN_LOG,
    FSDP_CUDA_UN_SQRT,
    FSDP_CUDA_UN_RSQRT,
    FSDP_CUDA_UN_SQUARE,
    FSDP_CUDA_UN_ABS,
    FSDP_CUDA_UN_SCALE,
    FSDP_CUDA_UN_ADD_SCALAR,
    FSDP_CUDA_UN_POW,
    FSDP_CUDA_UN_COUNT
};
enum {
    FSDP_CUDA_BIN_ADD = 0,
    FSDP_CUDA_BIN_SUB,
    FSDP_CUDA_BIN_MUL,
    FSDP_CUDA_BIN_DIV,
    FSDP_CUDA_BIN_MAX,
    FSDP_CUDA_BIN_MIN,
    FSDP_CUDA_BIN_COUNT
};

/* Shape and up to two operands' element strides, passed to strided kernels by value. i32: the
 * element count and every offset fit in 31 bits, so the kernels index in 32-bit arithmetic. */
struct fsdp_cuda_nd {
    int nd;
    int i32;
    int64_t shape[FSDP_CUDA_MAX_DIMS];
    int64_t st[2][FSDP_CUDA_MAX_DIMS];
};

/* ---- cuda_kernels.cu ---- */
/* y[i] = the es-byte pattern `bits` (es = 1, 2, 4 or 8). */
cudaError_t fsdp__cuda_k_fill(cudaStream_t s, size_t es, uint64_t bits, size_t n, void *y);
/* Cast between fsdp dtypes (the numbers of fsdp_dtype_t), dtype.c's rules. */
cudaError_t fsdp__cuda_k_cast(cudaStream_t s, int yt, void *y, int xt, const void *x, size_t n);
cudaError_t fsdp__cuda_k_copy_strided(cudaStream_t s, size_t es, const struct fsdp_cuda_nd *p,
                                      int64_t total, void *y, const void *x);
cudaError_t fsdp__cuda_k_unary(cudaStream_t s, bool f64, int op, size_t n, double alpha,
                               const void *x, void *y);
cudaError_t fsdp__cuda_k_unary_backward(cudaStream_t s, bool f64, int op, size_t n, double alpha,
                                        const void *x, const void *y, const void *gy, void *gx);
cudaError_t fsdp__cuda_k_binary(cudaStream_t s, bool f64, int op, const struct fsdp_cuda_nd *p,
                                int64_t total, void *y, const void *a, const void *b);
cudaError_t fsdp__cuda_k_axpy(cudaStream_t s, bool f64, size_t n, double alpha, const void *x,
                              void *y);
cudaError_t fsdp__cuda_k_where(cudaStream_t s, bool f64, size_t n, const uint8_t *cond,
                               const void *a, double av, const void *b, double bv, void *y);
cudaError_t fsdp__cuda_k_reduce_sum(cudaStream_t s, bool f64, size_t outer, size_t r, size_t inner,
                                    double alpha, const void *x, void *y);
cudaError_t fsdp__cuda_k_reduce_max(cudaStream_t s, bool f64, size_t outer, size_t r, size_t inner,
                                    const void *x, void *y, int64_t *idx);
/* Needs `scratch` of FSDP_CUDA_SUMSQ_BLOCKS doubles (device memory). */
#define FSDP_CUDA_SUMSQ_BLOCKS 256
cudaError_t fsdp__cuda_k_sum_squares(cudaStream_t s, bool f64, size_t n, const void *x,
                                     double *scratch, void *out);
/* C = beta C for an m x n matrix with row stride ldc, `batch` matrices stride_c apart; dt (an
 * fsdp_dtype_t) is f32, f64, bf16 or f16 (halves: beta C in f32, rounded once; beta 0 gives
 * zeros, NaN included). */
cudaError_t fsdp__cuda_k_scale_c(cudaStream_t s, int dt, int64_t m, int64_t n, double beta,
                                 void *c, int64_t ldc, int64_t stride_c, int64_t batch);

/* The reduction of a collective (device_impl.h's coll_reduce): fsdp_redop_t's numbers (pg.h;
 * cuda_device.c checks them), and the pointers, passed to the kernel by value. */
enum {
    FSDP_CUDA_REDOP_SUM = 0,
    FSDP_CUDA_REDOP_AVG,
    FSDP_CUDA_REDOP_MIN,
    FSDP_CUDA_REDOP_MAX,
    FSDP_CUDA_REDOP_PROD
};
#define FSDP_CUDA_COLL_MAX_PTRS 64
struct fsdp_cuda_coll_ptrs {
    const void *in[FSDP_CUDA_COLL_MAX_PTRS];
    void *out[FSDP_CUDA_COLL_MAX_PTRS];
};
/* dt: an fsdp_dtype_t; 1 <= nin, nout <= FSDP_CUDA_COLL_MAX_PTRS. */
cudaError_t fsdp__cuda_k_coll_reduce(cudaStream_t s, int dt, int op, int divisor, double pre,
                                     const struct fsdp_cuda_coll_ptrs *p, int nin, int nout,
                                     size_t n);

/* ---- cuda_nn_kernels.cu ---- */
cudaError_t fsdp__cuda_k_softmax(cudaStream_t s, bool f64, bool lg, size_t rows, size_t n,
                                 const void *x, void *y);
cudaError_t fsdp__cuda_k_softmax_backward(cudaStream_t s, bool f64, bool lg, size_t rows, size_t n,
                                          const void *y, const void *gy, void *gx);
cudaError_t fsdp__cuda_k_layer_norm(cudaStream_t s, bool f64, size_t rows, size_t n, double eps,
                                    const void *x, const void *w, const void *b, void *y,
                                    void *mean, void *rstd);
cudaError_t fsdp__cuda_k_layer_norm_backward(cudaStream_t s, bool f64, size_t rows, size_t n,
                                             const void *x, const void *w, const void *mean,
                                             const void *rstd, const void *gy, void *gx, void *gw,
                                             void *gb);
cudaError_t fsdp__cuda_k_batch_norm(cudaStream_t s, bool f64, bool train, size_t nb, size_t c,
                                    size_t l, double eps, double momentum, const void *x,
                                    const void *w, const void *b, void *rmean, void *rvar, void *y,
                                    void *mean, void *rstd);
cudaError_t fsdp__cuda_k_batch_norm_backward(cudaStream_t s, bool f64, bool train, size_t nb,
                                             size_t c, size_t l, const void *x, const void *w,
                                             const void *mean, const void *rstd, const void *gy,
                                             void *gx, void *gw, void *gb);
cudaError_t fsdp__cuda_k_embedding(cudaStream_t s, bool f64, size_t n, size_t dim,
                                   const int64_t *idx, const void *w, void *y);
cudaError_t fsdp__cuda_k_embedding_backward(cudaStream_t s, bool f64, size_t n, size_t dim,
                                            const int64_t *idx, int64_t padding_idx, const void *gy,
                                            void *gw);
cudaError_t fsdp__cuda_k_cross_entropy(cudaStream_t s, bool f64, size_t rows, size_t n,
                                       const void *logits, const int64_t *target,
                                       int64_t ignore_index, double ls, void *loss, void *logp);
cudaError_t fsdp__cuda_k_cross_entropy_backward(cudaStream_t s, bool f64, size_t rows, size_t n,
                                                const void *logp, const int64_t *target,
                                                int64_t ignore_index, double ls, const void *gloss,
                                                void *gx);
/* thr: fsdp_cuda_dropout_threshold(p) for 0 < p < 1; p <= 0 and p >= 1 are handled by the
 * caller's flags keep_all / drop_all. */
cudaError_t fsdp__cuda_k_dropout(cudaStream_t s, bool f64, size_t n, int mode, uint32_t thr,
                                 double p, uint64_t seed, uint64_t stream, uint64_t offset,
                                 const void *x, void *y, uint8_t *mask);
cudaError_t fsdp__cuda_k_sgd_step(cudaStream_t s, bool f64, size_t n, void *p, const void *g,
                                  void *buf, double lr, double momentum, double dampening,
                                  double wd, bool nesterov, bool first);
cudaError_t fsdp__cuda_k_adam_step(cudaStream_t s, bool f64, size_t n, void *p, const void *g,
                                   void *m, void *v, void *vmax, double lr, double beta1,
                                   double beta2, double eps, double wd, bool decoupled,
                                   bool amsgrad, int64_t t);

#ifdef __cplusplus
}
#endif

#endif /* FSDP_CUDA_KERNELS_H */
