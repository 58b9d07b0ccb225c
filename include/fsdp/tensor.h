/* SPDX-License-Identifier: MIT */
/*
 * fsdp/tensor.h: tensors, views and the differentiable operations on them.
 *
 * A tensor is a view: (storage, offset, dtype, shape, strides) on one device. Storages are
 * reference-counted and shared by every view into them, so a parameter can be a view into a
 * flat buffer (FSDP's flat parameter) and a gradient can be a view into a flat gradient.
 *
 * Ownership. Every function that produces a tensor hands the caller one reference
 * (`fsdp_tensor_t **out`); the caller gives it back with fsdp_tensor_release(). Inputs are
 * borrowed. The autograd tape takes its own references to what it saves.
 *
 * Autograd. While grad mode is on (the default, see autograd.h), an operation with an input
 * that requires a gradient records a node on its context's tape, and its output requires a
 * gradient too. fsdp_backward() walks the tape in reverse. Leaves are tensors on which
 * fsdp_tensor_set_requires_grad() was called; their gradients accumulate in fsdp_tensor_grad().
 *
 * Dtypes. Operations compute on f32 and f64; f16 and bf16 inputs are computed in f32 and the
 * output is rounded to the input dtype. Integer tensors are indices (embedding, targets) and
 * masks (u8/bool).
 *
 * Errors. Every fallible function returns 0 or a negative FSDP_E* code and leaves a message on
 * the tensor's context (fsdp_ctx_last_error) naming the operation, the argument and the
 * shapes. On failure *out is NULL and nothing is recorded.
 *
 * Thread-safety: tensors belong to one context (rank); only that rank's thread uses them.
 */
#ifndef FSDP_TENSOR_H
#define FSDP_TENSOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/device.h>
#include <fsdp/dtype.h>
#include <fsdp/export.h>
#include <fsdp/mem.h>

FSDP_BEGIN_DECLS

typedef struct fsdp_ctx fsdp_ctx_t;
typedef struct fsdp_tensor fsdp_tensor_t;

/* ---- creation ---------------------------------------------------------------------------- */

/* An uninitialised contiguous tensor on the context's default device, its storage counted
 * under `cat`. ndim may be 0 (a scalar); 0 <= ndim <= FSDP_MAX_DIMS; every size >= 0. */
FSDP_EXTERN int fsdp_tensor_empty(fsdp_ctx_t *ctx, fsdp_dtype_t dt, int ndim,
                                  const int64_t *shape, fsdp_mem_cat_t cat, fsdp_tensor_t **out);
/* Same, filled with `value`. */
FSDP_EXTERN int fsdp_tensor_full(fsdp_ctx_t *ctx, fsdp_dtype_t dt, int ndim, const int64_t *shape,
                                 double value, fsdp_mem_cat_t cat, fsdp_tensor_t **out);
FSDP_EXTERN int fsdp_tensor_zeros(fsdp_ctx_t *ctx, fsdp_dtype_t dt, int ndim,
                                  const int64_t *shape, fsdp_mem_cat_t cat, fsdp_tensor_t **out);
/* A contiguous tensor holding a copy of `numel * dtype size` bytes of host memory. */
FSDP_EXTERN int fsdp_tensor_from_host(fsdp_ctx_t *ctx, fsdp_dtype_t dt, int ndim,
                                      const int64_t *shape, const void *data, fsdp_mem_cat_t cat,
                                      fsdp_tensor_t **out);
/* A tensor over memory the caller owns (device memory of dev, contiguous); the memory must
 * outlive every view of it and is never freed by the library. */
FSDP_EXTERN int fsdp_tensor_wrap(fsdp_device_t *dev, void *data, fsdp_dtype_t dt, int ndim,
                                 const int64_t *shape, fsdp_tensor_t **out);
/* Uniform [lo, hi) and normal(mean, std) f32/f64 values from the context's random stream, drawn
 * in row-major order (f64 tensors get the f32 draws widened). */
FSDP_EXTERN int fsdp_tensor_uniform_(fsdp_tensor_t *t, double lo, double hi);
FSDP_EXTERN int fsdp_tensor_normal_(fsdp_tensor_t *t, double mean, double std);

/* Adds a reference; returns t. */
FSDP_EXTERN fsdp_tensor_t *fsdp_tensor_retain(fsdp_tensor_t *t);
/* Drops a reference; the last one frees the tensor (and its storage when no view is left).
 * NULL is accepted. */
FSDP_EXTERN void fsdp_tensor_release(fsdp_tensor_t *t);

/* ---- properties ---------------------------------------------------------------------------- */

FSDP_EXTERN fsdp_ctx_t *fsdp_tensor_ctx(const fsdp_tensor_t *t);
FSDP_EXTERN fsdp_device_t *fsdp_tensor_device(const fsdp_tensor_t *t);
FSDP_EXTERN fsdp_dtype_t fsdp_tensor_dtype(const fsdp_tensor_t *t);
FSDP_EXTERN int fsdp_tensor_ndim(const fsdp_tensor_t *t);
/* Size of dimension d; negative d counts from the end. 0 for a bad d. */
FSDP_EXTERN int64_t fsdp_tensor_size(const fsdp_tensor_t *t, int d);
/* The shape and strides (in elements): ndim entries, valid while t lives. */
FSDP_EXTERN const int64_t *fsdp_tensor_shape(const fsdp_tensor_t *t);
FSDP_EXTERN const int64_t *fsdp_tensor_strides(const fsdp_tensor_t *t);
FSDP_EXTERN int64_t fsdp_tensor_numel(const fsdp_tensor_t *t);
FSDP_EXTERN bool fsdp_tensor_is_contiguous(const fsdp_tensor_t *t);
/* Offset of the first element in the storage, in elements. */
FSDP_EXTERN int64_t fsdp_tensor_storage_offset(const fsdp_tensor_t *t);
/* Whether a and b view the same storage. */
FSDP_EXTERN bool fsdp_tensor_same_storage(const fsdp_tensor_t *a, const fsdp_tensor_t *b);
/* Bytes of t's storage (0 after fsdp_tensor_storage_resize(t, 0)). */
FSDP_EXTERN size_t fsdp_tensor_storage_bytes(const fsdp_tensor_t *t);
/* Device pointer to the first element (not to be dereferenced on the host for CUDA tensors). */
FSDP_EXTERN void *fsdp_tensor_data(const fsdp_tensor_t *t);
/* A name used in error messages (parameters get their fully qualified name). */
FSDP_EXTERN int fsdp_tensor_set_name(fsdp_tensor_t *t, const char *name);
FSDP_EXTERN const char *fsdp_tensor_name(const fsdp_tensor_t *t); /* "" when unnamed */
/* Writes "f32[4, 8]" into buf (always NUL-terminated); returns buf. */
FSDP_EXTERN char *fsdp_tensor_describe(const fsdp_tensor_t *t, char *buf, size_t len);

/* ---- data movement (not differentiable) --------------------------------------------------- */

/* Copies t's elements in row-major order into host memory of `bytes` (must equal
 * numel * dtype size), whatever t's strides. */
FSDP_EXTERN int fsdp_tensor_to_host(const fsdp_tensor_t *t, void *dst, size_t bytes);
/* Overwrites t's elements (row-major) from host memory; t may be any view. Used to load weights
 * from a buffer. Refused for a non-leaf that requires grad. */
FSDP_EXTERN int fsdp_tensor_copy_from_host(fsdp_tensor_t *t, const void *src, size_t bytes);
/* dst = src element-wise (shapes equal, dtypes may differ: converted). Not differentiable. */
FSDP_EXTERN int fsdp_tensor_copy_(fsdp_tensor_t *dst, const fsdp_tensor_t *src);
FSDP_EXTERN int fsdp_tensor_fill_(fsdp_tensor_t *t, double value);
FSDP_EXTERN int fsdp_tensor_zero_(fsdp_tensor_t *t);
/* A contiguous copy with its own storage, counted under cat; not recorded. */
FSDP_EXTERN int fsdp_tensor_clone(const fsdp_tensor_t *t, fsdp_mem_cat_t cat, fsdp_tensor_t **out);
/* Converts to dtype dt (a new tensor; differentiable between float dtypes). */
FSDP_EXTERN int fsdp_to_dtype(fsdp_tensor_t *t, fsdp_dtype_t dt, fsdp_tensor_t **out);
/* Reads element i (row-major index) as a double (tests and losses). */
FSDP_EXTERN int fsdp_tensor_item(const fsdp_tensor_t *t, int64_t i, double *out);
/* Frees (bytes == 0) or reallocates (bytes == the original size) a tensor's storage, keeping
 * every view: FSDP frees unsharded parameters this way between uses. Contents are lost. */
FSDP_EXTERN int fsdp_tensor_storage_resize(fsdp_tensor_t *t, size_t bytes);

/* ---- views (share storage; differentiable) ------------------------------------------------ */

/* Same elements with a new shape; one size may be -1. t must be contiguous. */
FSDP_EXTERN int fsdp_view(fsdp_tensor_t *t, int ndim, const int64_t *shape, fsdp_tensor_t **out);
/* Like fsdp_view, copying first when t is not contiguous. */
FSDP_EXTERN int fsdp_reshape(fsdp_tensor_t *t, int ndim, const int64_t *shape,
                             fsdp_tensor_t **out);
FSDP_EXTERN int fsdp_transpose(fsdp_tensor_t *t, int d0, int d1, fsdp_tensor_t **out);
/* dims is a permutation of 0..ndim-1: out dimension i is t's dimension dims[i]. */
FSDP_EXTERN int fsdp_permute(fsdp_tensor_t *t, const int *dims, fsdp_tensor_t **out);
/* Elements [start, start + len) along dimension dim. */
FSDP_EXTERN int fsdp_narrow(fsdp_tensor_t *t, int dim, int64_t start, int64_t len,
                            fsdp_tensor_t **out);
/* Rows [start, end) along dimension 0. */
FSDP_EXTERN int fsdp_slice(fsdp_tensor_t *t, int64_t start, int64_t end, fsdp_tensor_t **out);
/* Insert or remove a dimension of size 1. */
FSDP_EXTERN int fsdp_unsqueeze(fsdp_tensor_t *t, int dim, fsdp_tensor_t **out);
FSDP_EXTERN int fsdp_squeeze(fsdp_tensor_t *t, int dim, fsdp_tensor_t **out);
/* Broadcast view (stride 0) to shape. */
FSDP_EXTERN int fsdp_expand(fsdp_tensor_t *t, int ndim, const int64_t *shape,
                            fsdp_tensor_t **out);
/* t itself (retained) when contiguous, else a contiguous copy (differentiable). */
FSDP_EXTERN int fsdp_contiguous(fsdp_tensor_t *t, fsdp_tensor_t **out);
/* A view of `base`'s storage at element `offset` with a contiguous `shape`, not recorded and
 * not requiring grad: how flat parameters hand out per-parameter views. */
FSDP_EXTERN int fsdp_tensor_view_of(fsdp_tensor_t *base, int64_t offset, int ndim,
                                    const int64_t *shape, fsdp_tensor_t **out);
/* The same data, cut from the tape (requires no grad). */
FSDP_EXTERN int fsdp_detach(fsdp_tensor_t *t, fsdp_tensor_t **out);
/* PyTorch's `t.data = src`: t keeps its identity (name, requires_grad, gradient, the module
 * slots holding it) and from now on views src's elements (storage, offset, shape, strides);
 * src is unchanged and shares its storage with t. Both must be on one context and device and of
 * one dtype (FSDP_EINVAL naming t otherwise); shapes may differ. Not recorded. An FSDP original
 * parameter changed this way is written back into its shard before the unit next gathers its
 * parameters (fsdp/fsdp.h). */
FSDP_EXTERN int fsdp_tensor_set_data(fsdp_tensor_t *t, fsdp_tensor_t *src);

/* ---- gradients ------------------------------------------------------------------------------ */

/* Marks a leaf as requiring (or not) a gradient. Refused for a non-leaf. */
FSDP_EXTERN int fsdp_tensor_set_requires_grad(fsdp_tensor_t *t, bool requires_grad);
FSDP_EXTERN bool fsdp_tensor_requires_grad(const fsdp_tensor_t *t);
/* Whether t is a leaf: true for tensors no recorded operation produced (user tensors,
 * parameters, constants), false for the outputs of recorded operations. */
FSDP_EXTERN bool fsdp_tensor_is_leaf(const fsdp_tensor_t *t);
/* The accumulated gradient (borrowed), or NULL ("none"). */
FSDP_EXTERN fsdp_tensor_t *fsdp_tensor_grad(const fsdp_tensor_t *t);
/* Sets the gradient (retained; same shape as t, float dtype) or, with NULL, sets it to none. A
 * gradient may be a view (FSDP points it into a flat gradient); backward accumulates into it in
 * place. */
FSDP_EXTERN int fsdp_tensor_set_grad(fsdp_tensor_t *t, fsdp_tensor_t *grad);
/* zero_grad: set_to_none drops the gradient, otherwise it is filled with zeros. */
FSDP_EXTERN int fsdp_tensor_zero_grad(fsdp_tensor_t *t, bool set_to_none);

/* A hook on a leaf, run by backward (fsdp/autograd.h) right after it has accumulated into the
 * leaf's gradient. */
typedef int (*fsdp_grad_hook_fn)(fsdp_tensor_t *leaf, void *arg);
FSDP_EXTERN int fsdp_tensor_add_grad_hook(fsdp_tensor_t *leaf, fsdp_grad_hook_fn fn, void *arg);
/* Removes every hook of leaf registered with this (fn, arg); returns how many (0 when none). */
FSDP_EXTERN int fsdp_tensor_remove_grad_hook(fsdp_tensor_t *leaf, fsdp_grad_hook_fn fn, void *arg);
/* Whether leaf has a hook with this fn (any arg). */
FSDP_EXTERN bool fsdp_tensor_has_grad_hook(const fsdp_tensor_t *leaf, fsdp_grad_hook_fn fn);

/* ---- operations (differentiable) ---------------------------------------------------------- */

/* Element-wise with NumPy broadcasting. */
FSDP_EXTERN int fsdp_add(fsdp_tensor_t *a, fsdp_tensor_t *b, fsdp_tensor_t **out);
FSDP_EXTERN int fsdp_sub(fsdp_tensor_t *a, fsdp_tensor_t *b, fsdp_tensor_t **out);
FSDP_EXTERN int fsdp_mul(fsdp_tensor_t *a, fsdp_tensor_t *b, fsdp_tensor_t **out);
FSDP_EXTERN int fsdp_div(fsdp_tensor_t *a, fsdp_tensor_t *b, fsdp_tensor_t **out);
/* alpha * a, and a + alpha. */
FSDP_EXTERN int fsdp_scale(fsdp_tensor_t *a, double alpha, fsdp_tensor_t **out);
FSDP_EXTERN int fsdp_add_scalar(fsdp_tensor_t *a, double alpha, fsdp_tensor_t **out);

FSDP_EXTERN int fsdp_relu(fsdp_tensor_t *x, fsdp_tensor_t **out);
typedef enum fsdp_gelu_approx { FSDP_GELU_ERF = 0, FSDP_GELU_TANH } fsdp_gelu_approx_t;
FSDP_EXTERN int fsdp_gelu(fsdp_tensor_t *x, fsdp_gelu_approx_t approx, fsdp_tensor_t **out);
FSDP_EXTERN int fsdp_tanh(fsdp_tensor_t *x, fsdp_tensor_t **out);
FSDP_EXTERN int fsdp_sigmoid(fsdp_tensor_t *x, fsdp_tensor_t **out);
FSDP_EXTERN int fsdp_exp(fsdp_tensor_t *x, fsdp_tensor_t **out);
/* Natural logarithm (named fsdp_ln because fsdp_log is the logging function). */
FSDP_EXTERN int fsdp_ln(fsdp_tensor_t *x, fsdp_tensor_t **out);

/* Matrix product with PyTorch's matmul rules for ndim >= 1 operands: 2-d x 2-d; n-d x 2-d (the
 * leading dimensions of a are batch); n-d x n-d with equal batch dimensions (batched). */
FSDP_EXTERN int fsdp_matmul(fsdp_tensor_t *a, fsdp_tensor_t *b, fsdp_tensor_t **out);
/* x (..., in) W^T (out, in) + b (out), b may be NULL. */
FSDP_EXTERN int fsdp_linear(fsdp_tensor_t *x, fsdp_tensor_t *w, fsdp_tensor_t *b,
                            fsdp_tensor_t **out);

/* Sum or mean over the ndims dimensions in dims (negative counts from the end; ndims == 0:
 * every dimension, giving a scalar), keeping them as size 1 when keepdim. */
FSDP_EXTERN int fsdp_sum(fsdp_tensor_t *x, int ndims, const int *dims, bool keepdim,
                         fsdp_tensor_t **out);
FSDP_EXTERN int fsdp_mean(fsdp_tensor_t *x, int ndims, const int *dims, bool keepdim,
                          fsdp_tensor_t **out);

/* Softmax and log-softmax along dim. */
FSDP_EXTERN int fsdp_softmax(fsdp_tensor_t *x, int dim, fsdp_tensor_t **out);
FSDP_EXTERN int fsdp_log_softmax(fsdp_tensor_t *x, int dim, fsdp_tensor_t **out);

/* Layer norm over the last `norm_ndim` dimensions; w and b (shape of those dimensions) may be
 * NULL. */
FSDP_EXTERN int fsdp_layer_norm(fsdp_tensor_t *x, int norm_ndim, fsdp_tensor_t *w,
                                fsdp_tensor_t *b, double eps, fsdp_tensor_t **out);
/* Batch norm of x (N, C, ...) over channels C. train: batch statistics, and running_mean/var
 * (C, may be NULL) updated in place with momentum; otherwise the running statistics. */
FSDP_EXTERN int fsdp_batch_norm(fsdp_tensor_t *x, fsdp_tensor_t *w, fsdp_tensor_t *b,
                                fsdp_tensor_t *running_mean, fsdp_tensor_t *running_var,
                                bool train, double momentum, double eps, fsdp_tensor_t **out);
/* Rows of w (num, dim) picked by int64 (or i32) indices of any shape: out (..., dim). Indices
 * out of range are an error naming the first bad one. No gradient flows to the padding_idx row
 * (padding_idx < 0: none). */
FSDP_EXTERN int fsdp_embedding(fsdp_tensor_t *idx, fsdp_tensor_t *w, int64_t padding_idx,
                               fsdp_tensor_t **out);
/* Inverted dropout with probability p from the context's random stream (advanced by the call,
 * so a run is reproducible from the seed). When !train or p == 0, out is x itself (retained). */
FSDP_EXTERN int fsdp_dropout(fsdp_tensor_t *x, double p, bool train, fsdp_tensor_t **out);

/* Concatenation of n tensors along dim; split of x into n pieces of sizes[i] along dim. */
FSDP_EXTERN int fsdp_cat(fsdp_tensor_t *const *ts, int n, int dim, fsdp_tensor_t **out);
FSDP_EXTERN int fsdp_split(fsdp_tensor_t *x, const int64_t *sizes, int n, int dim,
                           fsdp_tensor_t **outs);

/* where(cond, a, b) with cond u8/bool broadcast to a's shape (a and b same shape). */
FSDP_EXTERN int fsdp_where(fsdp_tensor_t *cond, fsdp_tensor_t *a, fsdp_tensor_t *b,
                           fsdp_tensor_t **out);
/* x with `value` where mask (u8/bool, broadcast to x) is set. */
FSDP_EXTERN int fsdp_masked_fill(fsdp_tensor_t *x, fsdp_tensor_t *mask, double value,
                                 fsdp_tensor_t **out);
/* (L, L) f32 additive causal mask: 0 on and below the diagonal, -inf above (PyTorch's
 * generate_square_subsequent_mask). */
FSDP_EXTERN int fsdp_causal_mask(fsdp_ctx_t *ctx, int64_t l, fsdp_tensor_t **out);

typedef enum fsdp_reduction {
    FSDP_REDUCTION_MEAN = 0,
    FSDP_REDUCTION_SUM,
    FSDP_REDUCTION_NONE
} fsdp_reduction_t;

/* Cross-entropy of logits (N, C) (or (C) with a scalar target) against int64 class indices
 * (N). Targets equal to ignore_index contribute nothing (mean divides by the others);
 * label_smoothing in [0, 1]. Other targets out of [0, C) are an error naming the first. */
FSDP_EXTERN int fsdp_cross_entropy(fsdp_tensor_t *logits, fsdp_tensor_t *target,
                                   int64_t ignore_index, fsdp_reduction_t reduction,
                                   double label_smoothing, fsdp_tensor_t **out);
/* Mean squared error between a and b (same shape). */
FSDP_EXTERN int fsdp_mse_loss(fsdp_tensor_t *a, fsdp_tensor_t *b, fsdp_reduction_t reduction,
                              fsdp_tensor_t **out);

FSDP_END_DECLS

#endif /* FSDP_TENSOR_H */
