/* SPDX-License-Identifier: MIT */
/*
 * device_impl.h: the device vtable every device (CPU here, CUDA later) implements.
 *
 * Kernels take raw device pointers, element counts and a compute dtype that is FSDP_DTYPE_F32
 * or FSDP_DTYPE_F64 (the tensor layer converts f16/bf16 to f32 around a kernel and rounds the
 * result; integer tensors only reach the kernels that say so). Arguments have been checked by
 * the caller: kernels do not validate shapes, and every pointer is valid for the sizes given.
 * A kernel returns 0 or a negative FSDP_E* code (a device failure), never aborts.
 *
 * Conventions:
 *   - Outputs never alias inputs unless the kernel says "may alias".
 *   - Backward kernels write (=) their gradient outputs unless they say "accumulates" (+=).
 *   - Row kernels work on `rows` contiguous rows of `n` elements.
 *   - Strided kernels take element strides (not bytes); a stride of 0 broadcasts.
 */
#ifndef FSDP_DEVICE_IMPL_H
#define FSDP_DEVICE_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "internal.h"
#include <fsdp/device.h>

typedef enum fsdp_unary_op {
    FSDP_UNARY_RELU = 0,
    FSDP_UNARY_GELU_ERF,  /* x * Phi(x) */
    FSDP_UNARY_GELU_TANH, /* 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
    FSDP_UNARY_TANH,
    FSDP_UNARY_SIGMOID,
    FSDP_UNARY_NEG,
    FSDP_UNARY_EXP,
    FSDP_UNARY_LOG,
    FSDP_UNARY_SQRT,
    FSDP_UNARY_RSQRT,
    FSDP_UNARY_SQUARE,
    FSDP_UNARY_ABS,
    FSDP_UNARY_SCALE,     /* alpha * x */
    FSDP_UNARY_ADD_SCALAR, /* x + alpha */
    FSDP_UNARY_POW,       /* x ^ alpha */
    FSDP_UNARY_COUNT
} fsdp_unary_op_t;

typedef enum fsdp_binary_op {
    FSDP_BINARY_ADD = 0,
    FSDP_BINARY_SUB,
    FSDP_BINARY_MUL,
    FSDP_BINARY_DIV,
    FSDP_BINARY_MAX,
    FSDP_BINARY_MIN,
    FSDP_BINARY_COUNT
} fsdp_binary_op_t;

/* Where/masked-fill and dropout masks are u8 (0 or 1) arrays. */

struct fsdp_dev_ops {
    const char *name; /* "cpu", "cuda" */
    fsdp_device_kind_t kind;

    /* ---- memory, copies, streams ---- */
    int (*alloc)(fsdp_device_t *dev, size_t bytes, void **out); /* 64-byte aligned, raw */
    /* As alloc, every byte zero. Optional: NULL means alloc followed by memset. A device that
     * knows when new memory is zero already (the CPU's fresh mappings) skips the clearing. */
    int (*alloc_zeroed)(fsdp_device_t *dev, size_t bytes, void **out);
    void (*free)(fsdp_device_t *dev, void *ptr);
    int (*memcpy)(fsdp_device_t *dev, void *dst, const void *src, size_t n, fsdp_copy_kind_t kind,
                  void *stream);
    int (*memset)(fsdp_device_t *dev, void *dst, int byte, size_t n, void *stream);
    int (*stream_create)(fsdp_device_t *dev, void **out);
    void (*stream_destroy)(fsdp_device_t *dev, void *stream);
    int (*stream_sync)(fsdp_device_t *dev, void *stream);
    int (*event_create)(fsdp_device_t *dev, void **out);
    void (*event_destroy)(fsdp_device_t *dev, void *ev);
    int (*event_record)(fsdp_device_t *dev, void *ev, void *stream);
    int (*event_wait)(fsdp_device_t *dev, void *ev, void *stream);
    int (*event_sync)(fsdp_device_t *dev, void *ev);
    /* Optional: 1 when ev has completed, 0 when not yet, or a negative FSDP_E* code; never
     * blocks. NULL: every event has completed once event_record returns (a device that computes
     * on the calling thread, the CPU). */
    int (*event_query)(fsdp_device_t *dev, void *ev);
    /* Optional: the native handle of the stream the kernels run on (a cudaStream_t), which
     * collectives are waited on (fsdp_work_wait_stream) so that the host runs ahead. NULL, or a
     * NULL result: the device computes on the calling thread and FSDP waits on the host. */
    void *(*compute_stream)(fsdp_device_t *dev);
    /* Optional, all three or none (fsdp__device_stream_pools): memory for work queued on
     * `stream` (a stream of this device, not the compute stream), from that stream's own pool,
     * so that a block the host frees there is handed out again only to later work on it
     * (alloc's contract otherwise); the use of a block by work on another stream, so that it is
     * not reused before that work has completed when it is freed (torch's record_stream); and
     * cast's kernel queued on `stream`. A device with them lets FSDP allocate and stage the
     * unsharded parameters on the all-gather stream (streams.c, "the all-gather stream"). */
    int (*alloc_on)(fsdp_device_t *dev, size_t bytes, void *stream, void **out);
    int (*record_stream)(fsdp_device_t *dev, void *ptr, void *stream);
    int (*cast_on)(fsdp_device_t *dev, fsdp_dtype_t dt, void *y, fsdp_dtype_t xt, const void *x,
                   size_t n, void *stream);
    /* Called once after creation (threads, handles) and once before destruction; may be NULL. */
    int (*init)(fsdp_device_t *dev);
    void (*fini)(fsdp_device_t *dev);
    /* Host memory that this device copies to and from asynchronously (pinned memory on CUDA);
     * both NULL when the device has none (the CPU). Used for the offloaded parameters and
     * gradients of FSDP units computing on this device (fsdp__device_pin_offload). Neither may
     * depend on the device's state: host_alloc is called with the host device that will hold
     * the block (for error messages), raw and 64-byte aligned like alloc, and host_free may run
     * after the device that set the routing up was destroyed. */
    int (*host_alloc)(fsdp_device_t *host, size_t bytes, void **out);
    void (*host_free)(fsdp_device_t *host, void *ptr);

    /* ---- elementwise (any dtype: fill and cast; f32/f64: the rest) ---- */
    /* y[i] = value, n elements of dt (every dtype). */
    int (*fill)(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, double value, void *y);
    /* y[i] = (dt) x[i] for every pair of dtypes; f16/bf16 round to nearest even. */
    int (*cast)(fsdp_device_t *dev, fsdp_dtype_t dt, void *y, fsdp_dtype_t xt, const void *x,
                size_t n);
    /* Strided N-d copy of dtype dt (any dtype): y (contiguous, `shape`) = x read with xstride.
     * Materializes transposes, permutes, slices and broadcasts (stride 0). */
    int (*copy_strided)(fsdp_device_t *dev, fsdp_dtype_t dt, int ndim, const int64_t *shape,
                        void *y, const void *x, const int64_t *xstride);
    /* y = op(x, alpha), n elements; y may alias x. */
    int (*unary)(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_unary_op_t op, size_t n, double alpha,
                 const void *x, void *y);
    /* gx = gy * d op(x)/dx, n elements. y is op's forward output (kernels may use either). gx
     * may alias gy (the ops layer overwrites a gradient nobody else holds). */
    int (*unary_backward)(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_unary_op_t op, size_t n,
                          double alpha, const void *x, const void *y, const void *gy, void *gx);
    /* y (contiguous, `shape`) = op(a, b) with a and b read through element strides (0 = a
     * broadcast dimension). ndim <= FSDP_MAX_DIMS. y may alias a or b when that operand's
     * strides are the contiguous strides of shape. */
    int (*binary)(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_binary_op_t op, int ndim,
                  const int64_t *shape, void *y, const void *a, const int64_t *astride,
                  const void *b, const int64_t *bstride);
    /* y += alpha * x, n elements (y may not alias x). */
    int (*axpy)(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, double alpha, const void *x,
                void *y);
    /* y[i] = cond[i] ? a[i] : b[i]; a or b may be NULL meaning the scalar av / bv. */
    int (*where)(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, const uint8_t *cond,
                 const void *a, double av, const void *b, double bv, void *y);

    /* ---- reductions ---- */
    /* View x as (outer, r, inner) contiguous; y (outer, inner) = sum over r, times alpha. */
    int (*reduce_sum)(fsdp_device_t *dev, fsdp_dtype_t dt, size_t outer, size_t r, size_t inner,
                      double alpha, const void *x, void *y);
    /* Same shape; y = max over r (and argmax as int64 when idx != NULL). */
    int (*reduce_max)(fsdp_device_t *dev, fsdp_dtype_t dt, size_t outer, size_t r, size_t inner,
                      const void *x, void *y, int64_t *idx);
    /* out[0] = sum of x[i]^2 over n elements, accumulated in f64 and written as dt. */
    int (*sum_squares)(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, const void *x, void *out);
    /* The reduction of a collective (pg.h's semantics, any dtype and operator the caller
     * checked with fsdp__redop_supported): for each i < n, the value in[0][i] op in[1][i] op ...
     * op in[nin-1][i], evaluated left to right (rank order), is written to every outs[k][i];
     * f16/bf16 accumulate in f32 and round once, integer sums and products wrap, float min/max
     * propagate NaN, bool sum/max are "or" and prod/min "and", avg divides the sum by `divisor`
     * in the accumulation type (truncating for integers); a nonzero `prescale` with op sum on a
     * floating dtype multiplies each input by it first, the product rounded to dt (pg.h). An
     * output may alias an input at the same offsets (each element is read completely before it
     * is written); outputs do not overlap each other. Ordered on `stream` (NULL: the compute
     * stream, and synchronous). The CPU device's implementation is fsdp__reduce()
     * (core/reduce.h). */
    int (*coll_reduce)(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_redop_t op, int divisor,
                       double prescale, void *const *outs, int nout, const void *const *ins,
                       int nin, size_t n, void *stream);

    /* ---- matrix products (BLAS on the CPU, cuBLAS on CUDA) ---- */
    /* For each b < batch: C_b = alpha * op(A_b) op(B_b) + beta * C_b, row-major, where op(X) is
     * X or X^T, op(A) is M x K, op(B) is K x N, C is M x N; A_b = A + b * stride_a (elements),
     * likewise B and C. lda/ldb/ldc are the row strides of the stored (untransposed) matrices.
     * dt is f32 or f64 on every device; the CUDA device also takes bf16 and f16 (f32
     * accumulation, one rounding of the result), which the tensor layer reaches through
     * gemm_lp below. */
    int (*gemm)(fsdp_device_t *dev, fsdp_dtype_t dt, bool trans_a, bool trans_b, int64_t m,
                int64_t n, int64_t k, double alpha, const void *a, int64_t lda, int64_t stride_a,
                const void *b, int64_t ldb, int64_t stride_b, double beta, void *c, int64_t ldc,
                int64_t stride_c, int64_t batch);
    /* The low-precision dtypes whose products this device computes natively: a mask of
     * FSDP__DT_BIT(dt) over bf16 and f16, 0 for a device that has none (the CPU: Debian's
     * OpenBLAS is built without sbgemm). The tensor layer hands operands of these dtypes to
     * gemm_lp as they are stored, and widens every other low-precision operand to f32 for gemm
     * (fsdp__device_gemm_native says which). */
    uint32_t gemm_lp_dtypes;
    /* As gemm, with A and B of dtype dt (a dtype of gemm_lp_dtypes) and C of dtype ct, which is
     * dt or f32: the products are accumulated in f32, alpha and beta are applied in f32 to that
     * sum and to C read as f32, and the result is written to C rounded once to nearest even
     * (not at all when ct is f32). NULL when gemm_lp_dtypes is 0. */
    int (*gemm_lp)(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_dtype_t ct, bool trans_a, bool trans_b,
                   int64_t m, int64_t n, int64_t k, double alpha, const void *a, int64_t lda,
                   int64_t stride_a, const void *b, int64_t ldb, int64_t stride_b, double beta,
                   void *c, int64_t ldc, int64_t stride_c, int64_t batch);

    /* ---- row kernels ---- */
    /* Softmax (log = false) or log-softmax (log = true) of each row. y may alias x. */
    int (*softmax)(fsdp_device_t *dev, fsdp_dtype_t dt, bool log, size_t rows, size_t n,
                   const void *x, void *y);
    /* gx from the forward output y and gy: softmax gx = y (gy - sum(gy y)); log-softmax
     * gx = gy - exp(y) sum(gy). */
    int (*softmax_backward)(fsdp_device_t *dev, fsdp_dtype_t dt, bool log, size_t rows, size_t n,
                            const void *y, const void *gy, void *gx);
    /* Scaled dot-product attention of H heads read from a packed projection, one (sequence,
     * head) at a time; NULL on a device without it (the ops layer then composes attention from
     * the kernels above). qkv is (batch, t, 3 H hd), contiguous: at each position the H heads
     * of q, then those of k, then those of v. For sequence b and head h, with q, k, v its
     * (t, hd) slices: P = softmax((scale q) k^T + mask) goes to p (batch, H, t, t) and P v to
     * the head's hd columns of y (batch, t, H hd). mask is (t, t), added to every head, or
     * NULL. The values are those of the composed kernels (unary scale, gemm, binary add,
     * softmax, gemm): bit for bit where the mask removes nothing from the products, and within
     * the dtype's rounding where a kernel skips what a mask that cuts rows short removes (the
     * CPU's, when every input is finite). The ops layer calls it for the dtypes of the device's
     * attn_fused mask only. */
    int (*attention)(fsdp_device_t *dev, fsdp_dtype_t dt, int64_t batch, int64_t t, int64_t heads,
                     int64_t hd, double scale, const void *qkv, const void *mask, void *p, void *y);
    /* Its gradient: gqkv (batch, t, 3 H hd; every element written) from the forward's qkv and p
     * and gy (batch, t, H hd), the composed kernels' backward as the forward is theirs. */
    int (*attention_backward)(fsdp_device_t *dev, fsdp_dtype_t dt, int64_t batch, int64_t t,
                              int64_t heads, int64_t hd, double scale, const void *qkv,
                              const void *p, const void *gy, void *gqkv);
    /* Layer norm of each row: y = (x - mean) * rstd * w + b (w, b of n elements, either may be
     * NULL: 1 and 0). Writes mean and rstd (rows elements each, always f32 for f32 and f64 for
     * f64) for the backward. */
    int (*layer_norm)(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n, double eps,
                      const void *x, const void *w, const void *b, void *y, void *mean,
                      void *rstd);
    /* gx (may be NULL: not needed) written; gw and gb (may be NULL) accumulate (+=). */
    int (*layer_norm_backward)(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n,
                               const void *x, const void *w, const void *mean, const void *rstd,
                               const void *gy, void *gx, void *gw, void *gb);

    /* ---- batch norm over x viewed as (N, C, L) ---- */
    /* Training: per-channel batch mean and biased variance over N*L; y = (x - mean) rstd w + b;
     * writes mean and rstd (C each); when running_mean/var are non-NULL updates them
     * r = (1 - momentum) r + momentum * stat (variance unbiased: * N*L / (N*L - 1)).
     * Evaluation (train = false): uses running_mean/var instead and writes mean/rstd from them.
     * w, b may be NULL (1 and 0). */
    int (*batch_norm)(fsdp_device_t *dev, fsdp_dtype_t dt, bool train, size_t nb, size_t c,
                      size_t l, double eps, double momentum, const void *x, const void *w,
                      const void *b, void *running_mean, void *running_var, void *y, void *mean,
                      void *rstd);
    /* Backward; train selects batch statistics (gradient through mean and variance) or the
     * fixed running statistics. gx written (may be NULL); gw, gb accumulate (may be NULL). */
    int (*batch_norm_backward)(fsdp_device_t *dev, fsdp_dtype_t dt, bool train, size_t nb,
                               size_t c, size_t l, const void *x, const void *w, const void *mean,
                               const void *rstd, const void *gy, void *gx, void *gw, void *gb);

    /* ---- embedding ---- */
    /* y[i, :] = w[idx[i], :] (dim elements), n indices (int64, already range-checked); rows with
     * idx == padding_idx are copied like any other (the padding row is learnt as zeros). */
    int (*embedding)(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, size_t dim,
                     const int64_t *idx, const void *w, void *y);
    /* gw[idx[i], :] += gy[i, :], skipping idx == padding_idx (padding_idx < 0: none).
     * Deterministic: indices are applied in order i = 0, 1, ... */
    int (*embedding_backward)(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, size_t dim,
                              const int64_t *idx, int64_t padding_idx, const void *gy, void *gw);

    /* ---- losses ---- */
    /* Cross-entropy of each row of logits (rows x n) with int64 targets: loss[i] =
     * -(1 - ls) * logp[t] - ls / n * sum_j logp[j], 0 and not counted when t == ignore_index.
     * Writes loss (rows) and logp (rows x n, log-softmax, kept for the backward). */
    int (*cross_entropy)(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n,
                         const void *logits, const int64_t *target, int64_t ignore_index,
                         double label_smoothing, void *loss, void *logp);
    /* gx[i, :] = gloss[i] * (softmax - (1 - ls) onehot(t) - ls / n); rows with t == ignore_index
     * get 0. gloss has rows elements. gx may alias logp (the ops layer writes the gradient over
     * log-probabilities nobody else holds). */
    int (*cross_entropy_backward)(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n,
                                  const void *logp, const int64_t *target, int64_t ignore_index,
                                  double label_smoothing, const void *gloss, void *gx);

    /* ---- dropout ---- */
    /* mask[i] = 1 with probability 1 - p from the Philox stream (seed, stream) starting at
     * counter `offset` (4 draws per counter, one uniform f32 per draw; keep iff u >= p);
     * y = x * mask / (1 - p). Bitwise reproducible for the same (seed, stream, offset). */
    int (*dropout)(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, double p, uint64_t seed,
                   uint64_t stream, uint64_t offset, const void *x, void *y, uint8_t *mask);

    /* ---- optimizer updates (in place on param p, f32/f64) ---- */
    /* SGD as PyTorch: g' = g + wd p; if momentum: buf = first ? g' : momentum buf +
     * (1 - dampening) g'; g' = nesterov ? g' + momentum buf : buf; p -= lr g'. buf may be NULL
     * when momentum == 0. */
    int (*sgd_step)(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, void *p, const void *g,
                    void *buf, double lr, double momentum, double dampening, double wd,
                    bool nesterov, bool first);
    /* Adam (decoupled = false: g += wd p) or AdamW (decoupled = true: p *= 1 - lr wd), step t
     * (1-based), bias-corrected, PyTorch's order of operations; amsgrad uses vmax (else NULL). */
    int (*adam_step)(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, void *p, const void *g,
                     void *m, void *v, void *vmax, double lr, double beta1, double beta2,
                     double eps, double wd, bool decoupled, bool amsgrad, int64_t t);
};

struct fsdp_device {
    const struct fsdp_dev_ops *ops;
    fsdp_ctx_t *ctx;
    fsdp_device_kind_t kind;
    int ordinal;
    int num_threads;
    char name[32];
    void *impl; /* backend state */
    _Atomic size_t live_allocs;
    /* The low-precision dtypes (FSDP__DT_BIT mask of bf16 and f16) whose element-wise, row,
     * reduction and loss kernels this device computes as stored, accumulating in f32 inside the
     * kernel: the tensor layer hands such tensors to those kernels without widening them to f32
     * (fsdp__kernel_dtype). 0 (every such tensor is widened) on the CPU and CUDA devices; the
     * shape-only device sets it when its compute model says its kernels are native (a kernel
     * library like PyTorch's). Set at creation and not changed while tensors exist. */
    uint32_t lp_native;
    /* The dtypes (FSDP__DT_BIT mask) in which the ops layer hands a packed projection to the
     * `attention` kernel instead of composing attention: f32 on the CPU device (set by its
     * init); on the shape-only device whatever the CPU device that measures its kernels fuses
     * (fsdp_vsim_measure_kernels), so that a simulated CPU rank runs the calls a real one does;
     * 0 elsewhere. */
    uint32_t attn_fused;
    /* Host devices only: where FSDP_MEM_OFFLOAD allocations come from (a compute device's
     * host_alloc/host_free table, set by fsdp__device_pin_offload); NULL: the device's own
     * alloc. Each allocation remembers the table that made it, so changing this is safe. */
    const struct fsdp_dev_ops *offload_ops;
};

/* The native compute stream of dev (its compute_stream entry), or NULL when it has none. */
void *fsdp__device_compute_stream(fsdp_device_t *dev);
/* 1 when ev has completed, 0 when not yet (its device's event_query; 1 without one), or the
 * negative FSDP_E* code of the query's failure (which sets the context's error). */
int fsdp__event_query(fsdp_event_t *ev);

/* Makes the FSDP_MEM_OFFLOAD allocations of host device `host` come from the host memory of
 * compute device `compute` (pinned memory for a CUDA device) from now on. Returns 1 when that
 * routing is in effect, 0 when `compute` has no host memory of its own (a CPU device: nothing
 * changes), FSDP_EINVAL when host is not a host device or the two belong to different contexts.
 * Other categories on `host` (optimizer state, temporaries) stay ordinary memory. */
int fsdp__device_pin_offload(fsdp_device_t *host, fsdp_device_t *compute);

/* The shape checks every gemm makes before it calls its library (BLAS would report a
 * violation through xerbla, which in some CBLAS builds exits the process): negative sizes and
 * row strides that do not cover their rows are FSDP_EINVAL with a message naming `who`'s gemm
 * and the sizes. Returns 1 when there is nothing to compute (m, n or batch is 0), 0 to go on,
 * or the error. */
int fsdp__gemm_check(fsdp_device_t *dev, const char *who, bool trans_a, bool trans_b, int64_t m,
                     int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, int64_t batch);

/* The bit of dtype dt in a dtype mask (gemm_lp_dtypes). */
#define FSDP__DT_BIT(dt) (UINT32_C(1) << (unsigned)(dt))

/* Whether dev's gemm_lp takes operands of dtype dt (bf16 or f16) as they are stored: the
 * device's gemm_lp_dtypes has dt and it has a gemm_lp. False for every other dtype. */
bool fsdp__device_gemm_native(const fsdp_device_t *dev, fsdp_dtype_t dt);

/* fsdp_device_alloc() of memory whose every byte is zero: the device's alloc_zeroed when it has
 * one (which clears only memory that is not zero already), else alloc and memset. */
int fsdp__device_alloc_zeroed(fsdp_device_t *dev, fsdp_mem_cat_t cat, size_t bytes, void **out);
/* The backend's handle of stream (NULL for NULL), which the device entries get; unlike
 * fsdp_stream_native, also on the CPU. */
void *fsdp__stream_handle(const fsdp_stream_t *stream);
/* Whether dev allocates per stream (its alloc_on, record_stream and cast_on entries). */
bool fsdp__device_stream_pools(const fsdp_device_t *dev);
/* fsdp_device_alloc() from the pool of `stream` (a stream of dev; NULL: fsdp_device_alloc);
 * freed with fsdp_device_free. FSDP_ENOTSUP on a device without stream pools. */
int fsdp__device_alloc_on(fsdp_device_t *dev, fsdp_mem_cat_t cat, size_t bytes,
                          fsdp_stream_t *stream, void **out);
/* Notes that work queued on the native stream `stream` (NULL: the compute stream) uses the
 * block holding ptr, which must be a live allocation of dev from a stream pool. */
int fsdp__device_record_stream(fsdp_device_t *dev, void *ptr, void *stream);

/* The CPU device's vtable (src/device/cpu*.c). */
extern const struct fsdp_dev_ops fsdp__cpu_dev_ops;

/* fsdp_device_create with the backend's vtable already chosen: the device layer checks the
 * arguments and builds the device over ops, which is NULL when the kind is not built into this
 * libfsdp (FSDP_ENOTSUP). Which vtable serves a kind is the launch layer's choice
 * (src/launch/devices.c), so that a new device touches no file of this layer. */
int fsdp__device_create(fsdp_ctx_t *ctx, fsdp_device_kind_t kind, const struct fsdp_dev_ops *ops,
                        const fsdp_device_options_t *opts, fsdp_device_t **out);

/* The context's own CPU device (the one fsdp_ctx_device() gives while no other is set), made
 * on first use without changing the context's default device; NULL only when it cannot be
 * made. Where FSDP puts what a caller asked to have on the host (offload_to_cpu) when the
 * compute device is not a CPU and no offload host was given. */
fsdp_device_t *fsdp__ctx_cpu_device(fsdp_ctx_t *ctx);

/* Threads a CPU device uses by default for world_size ranks in this process: FSDP_NUM_THREADS
 * when set, else max(1, the CPUs the process may run on / world_size: fsdp__cpu_count). */
int fsdp__cpu_default_threads(int world_size);

#endif /* FSDP_DEVICE_IMPL_H */
