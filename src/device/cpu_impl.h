/* SPDX-License-Identifier: MIT */
/*
 * cpu_impl.h: the functions of the CPU device, one per member of struct fsdp_dev_ops.
 *
 * Each fsdp__cpu_<member> has exactly the type of the vtable member it fills, so cpu.c can
 * assemble fsdp__cpu_dev_ops with designated initializers and the compiler checks every entry.
 * They live in four files: cpu.c (memory, copies, streams, init/fini), cpu_kernels.c
 * (elementwise, reductions, gemm), cpu_nn_kernels.c (row kernels, norms, embedding, losses,
 * dropout, optimizer steps) and cpu_attention.c (attention over packed heads). Nothing outside
 * src/device/ calls them by name: the layers above go through the vtable, so the CUDA device can
 * stand in. (The one exception is fsdp__cpu_cache_stats, which tests call to see the block cache.)
 */
#ifndef FSDP_CPU_IMPL_H
#define FSDP_CPU_IMPL_H

#include "device/block_cache.h"
#include "device/device_impl.h"

/* FSDP_ENOTSUP from kernel fn for dtype dt, saying which dtypes it takes (`takes`), on dev's
 * context (cpu_kernels.c). Not a member: the kernels' shared error. */
int fsdp__cpu_bad_dtype(fsdp_device_t *dev, const char *fn, fsdp_dtype_t dt, const char *takes);

/* ---- memory, copies, streams (cpu.c) ---- */
int fsdp__cpu_alloc(fsdp_device_t *dev, size_t bytes, void **out);
int fsdp__cpu_alloc_zeroed(fsdp_device_t *dev, size_t bytes, void **out);
void fsdp__cpu_free(fsdp_device_t *dev, void *ptr);
int fsdp__cpu_memcpy(fsdp_device_t *dev, void *dst, const void *src, size_t n,
                     fsdp_copy_kind_t kind, void *stream);
int fsdp__cpu_memset(fsdp_device_t *dev, void *dst, int byte, size_t n, void *stream);
int fsdp__cpu_stream_create(fsdp_device_t *dev, void **out);
void fsdp__cpu_stream_destroy(fsdp_device_t *dev, void *stream);
int fsdp__cpu_stream_sync(fsdp_device_t *dev, void *stream);
int fsdp__cpu_event_create(fsdp_device_t *dev, void **out);
void fsdp__cpu_event_destroy(fsdp_device_t *dev, void *ev);
int fsdp__cpu_event_record(fsdp_device_t *dev, void *ev, void *stream);
int fsdp__cpu_event_wait(fsdp_device_t *dev, void *ev, void *stream);
int fsdp__cpu_event_sync(fsdp_device_t *dev, void *ev);
int fsdp__cpu_init(fsdp_device_t *dev);
void fsdp__cpu_fini(fsdp_device_t *dev);
/* The counters of a CPU device's block cache (block_cache.h), for tests and benchmarks. False,
 * and all zero, when the cache is off (FSDP_CPU_CACHE_MB=0, or AddressSanitizer). */
bool fsdp__cpu_cache_stats(const fsdp_device_t *dev, fsdp_bcache_stats_t *out);

/* ---- elementwise, reductions, matrix products (cpu_kernels.c) ---- */
int fsdp__cpu_fill(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, double value, void *y);
int fsdp__cpu_cast(fsdp_device_t *dev, fsdp_dtype_t dt, void *y, fsdp_dtype_t xt, const void *x,
                   size_t n);
int fsdp__cpu_copy_strided(fsdp_device_t *dev, fsdp_dtype_t dt, int ndim, const int64_t *shape,
                           void *y, const void *x, const int64_t *xstride);
int fsdp__cpu_unary(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_unary_op_t op, size_t n, double alpha,
                    const void *x, void *y);
int fsdp__cpu_unary_backward(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_unary_op_t op, size_t n,
                             double alpha, const void *x, const void *y, const void *gy, void *gx);
int fsdp__cpu_binary(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_binary_op_t op, int ndim,
                     const int64_t *shape, void *y, const void *a, const int64_t *astride,
                     const void *b, const int64_t *bstride);
int fsdp__cpu_axpy(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, double alpha, const void *x,
                   void *y);
int fsdp__cpu_where(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, const uint8_t *cond,
                    const void *a, double av, const void *b, double bv, void *y);
int fsdp__cpu_reduce_sum(fsdp_device_t *dev, fsdp_dtype_t dt, size_t outer, size_t r, size_t inner,
                         double alpha, const void *x, void *y);
int fsdp__cpu_reduce_max(fsdp_device_t *dev, fsdp_dtype_t dt, size_t outer, size_t r, size_t inner,
                         const void *x, void *y, int64_t *idx);
int fsdp__cpu_sum_squares(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, const void *x, void *out);
int fsdp__cpu_coll_reduce(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_redop_t op, int divisor,
                          double prescale, void *const *outs, int nout, const void *const *ins,
                          int nin, size_t n, void *stream);
int fsdp__cpu_gemm(fsdp_device_t *dev, fsdp_dtype_t dt, bool trans_a, bool trans_b, int64_t m,
                   int64_t n, int64_t k, double alpha, const void *a, int64_t lda, int64_t stride_a,
                   const void *b, int64_t ldb, int64_t stride_b, double beta, void *c, int64_t ldc,
                   int64_t stride_c, int64_t batch);

/* ---- row kernels, norms, embedding, losses, dropout, optimizers (cpu_nn_kernels.c) ---- */
int fsdp__cpu_softmax(fsdp_device_t *dev, fsdp_dtype_t dt, bool log, size_t rows, size_t n,
                      const void *x, void *y);
int fsdp__cpu_softmax_backward(fsdp_device_t *dev, fsdp_dtype_t dt, bool log, size_t rows, size_t n,
                               const void *y, const void *gy, void *gx);

/* ---- attention over packed heads (cpu_attention.c) ---- */
int fsdp__cpu_attention(fsdp_device_t *dev, fsdp_dtype_t dt, int64_t batch, int64_t t,
                        int64_t heads, int64_t hd, double scale, const void *qkv, const void *mask,
                        void *p, void *y);
int fsdp__cpu_attention_backward(fsdp_device_t *dev, fsdp_dtype_t dt, int64_t batch, int64_t t,
                                 int64_t heads, int64_t hd, double scale, const void *qkv,
                                 const void *p, const void *gy, void *gqkv);

int fsdp__cpu_layer_norm(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n, double eps,
                         const void *x, const void *w, const void *b, void *y, void *mean,
                         void *rstd);
int fsdp__cpu_layer_norm_backward(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n,
                                  const void *x, const void *w, const void *mean, const void *rstd,
                                  const void *gy, void *gx, void *gw, void *gb);
int fsdp__cpu_batch_norm(fsdp_device_t *dev, fsdp_dtype_t dt, bool train, size_t nb, size_t c,
                         size_t l, double eps, double momentum, const void *x, const void *w,
                         const void *b, void *running_mean, void *running_var, void *y, void *mean,
                         void *rstd);
int fsdp__cpu_batch_norm_backward(fsdp_device_t *dev, fsdp_dtype_t dt, bool train, size_t nb,
                                  size_t c, size_t l, const void *x, const void *w,
                                  const void *mean, const void *rstd, const void *gy, void *gx,
                                  void *gw, void *gb);
int fsdp__cpu_embedding(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, size_t dim,
                        const int64_t *idx, const void *w, void *y);
int fsdp__cpu_embedding_backward(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, size_t dim,
                                 const int64_t *idx, int64_t padding_idx, const void *gy, void *gw);
int fsdp__cpu_cross_entropy(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n,
                            const void *logits, const int64_t *target, int64_t ignore_index,
                            double label_smoothing, void *loss, void *logp);
int fsdp__cpu_cross_entropy_backward(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n,
                                     const void *logp, const int64_t *target, int64_t ignore_index,
                                     double label_smoothing, const void *gloss, void *gx);
int fsdp__cpu_dropout(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, double p, uint64_t seed,
                      uint64_t stream, uint64_t offset, const void *x, void *y, uint8_t *mask);
int fsdp__cpu_sgd_step(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, void *p, const void *g,
                       void *buf, double lr, double momentum, double dampening, double wd,
                       bool nesterov, bool first);
int fsdp__cpu_adam_step(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, void *p, const void *g,
                        void *m, void *v, void *vmax, double lr, double beta1, double beta2,
                        double eps, double wd, bool decoupled, bool amsgrad, int64_t t);

#endif /* FSDP_CPU_IMPL_H */
