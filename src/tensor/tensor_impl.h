/* SPDX-License-Identifier: MIT */
/*
 * tensor_impl.h: what tensors look like inside, and the helpers every operation shares.
 *
 * Invariants:
 *   - A tensor's elements are storage->ptr + (offset + sum_i idx_i * stride_i) * dtype size.
 *   - A tensor requires grad iff it is a leaf marked by the user, or it is the output of a node
 *     recorded on its context's tape (then slot >= 0 and tape_gen names that tape's lifetime).
 *   - Storage and tensor reference counts are atomic only so that a comm thread may release a
 *     tensor it borrowed; a tensor is otherwise used by one thread.
 */
#ifndef FSDP_TENSOR_IMPL_H
#define FSDP_TENSOR_IMPL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "device/device_impl.h"
#include "internal.h"
#include <fsdp/tensor.h>

struct fsdp_storage {
    _Atomic long refs;
    fsdp_device_t *dev;
    void *ptr;           /* NULL after a resize to 0 bytes */
    size_t bytes;        /* allocated bytes (0 when freed by a resize) */
    size_t full_bytes;   /* size at creation: what a resize may bring back */
    fsdp_mem_cat_t cat;
    bool owned;          /* false: wrapped user memory, never freed */
};

struct fsdp_grad_hook {
    fsdp_grad_hook_fn fn;
    void *arg;
    struct fsdp_grad_hook *next;
};

struct fsdp_tensor {
    _Atomic long refs;
    fsdp_ctx_t *ctx;
    fsdp_device_t *dev;
    struct fsdp_storage *st;
    int64_t offset;                /* elements from st->ptr */
    fsdp_dtype_t dt;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    int64_t stride[FSDP_MAX_DIMS]; /* elements */
    /* autograd */
    bool requires_grad;
    bool grad_native;              /* leaf: backward leaves its gradient in the dtype the graph
                                    * gave it (a recompute region's inputs), not the leaf's */
    int64_t slot;                  /* gradient slot on the tape, -1 for leaves and constants */
    uint64_t tape_gen;             /* generation of the tape that gave the slot */
    fsdp_tensor_t *grad;           /* accumulated gradient of a leaf (owned reference) */
    /* leaf: grad's contents are not read before backward writes it (FSDP's view into its new
     * unsharded gradient, which is zeroed after backward only where backward wrote nothing), so
     * backward's first gradient is copied into it, rounded to its dtype, instead of added to
     * it; cleared by that first write. */
    bool grad_fresh;
    struct fsdp_grad_hook *hooks;
    char *name;
};

/* ---- construction helpers ---- */

/* A new contiguous tensor like the given shape on dev (uninitialised). */
int fsdp__tensor_new(fsdp_ctx_t *ctx, fsdp_device_t *dev, fsdp_dtype_t dt, int ndim,
                     const int64_t *shape, fsdp_mem_cat_t cat, fsdp_tensor_t **out);
/* The same, every element zero (every bit: +0.0 for floats). Cheaper than a fill where the
 * device knows that new memory is zero already (see fsdp__device_alloc_zeroed). */
int fsdp__tensor_new_zeroed(fsdp_ctx_t *ctx, fsdp_device_t *dev, fsdp_dtype_t dt, int ndim,
                            const int64_t *shape, fsdp_mem_cat_t cat, fsdp_tensor_t **out);
/* A new tensor header viewing t's storage with the given geometry (no autograd state). */
int fsdp__tensor_view(fsdp_tensor_t *t, int64_t offset, int ndim, const int64_t *shape,
                      const int64_t *stride, fsdp_tensor_t **out);
/* Points t at src's elements (storage, offset, shape, strides), keeping t's identity, name,
 * autograd state and gradient: PyTorch's `t.data = src`. dtype, device and context must match. */
int fsdp__tensor_set_data(fsdp_tensor_t *t, fsdp_tensor_t *src);
/* fsdp_tensor_storage_resize(t, its full size) with the memory from the pool of `stream`
 * (fsdp__device_alloc_on; NULL: the compute stream's, as the resize does). The storage must be
 * freed (0 bytes) and owned. */
int fsdp__tensor_storage_alloc_on(fsdp_tensor_t *t, fsdp_stream_t *stream);
/* Contiguous strides of shape into stride. */
void fsdp__contiguous_strides(int ndim, const int64_t *shape, int64_t *stride);
int64_t fsdp__shape_numel(int ndim, const int64_t *shape);
/* Memory category for tensors an operation creates now: activations in forward, grads during
 * backward. */
fsdp_mem_cat_t fsdp__op_cat(const fsdp_ctx_t *ctx);

/* The dtype kernels compute in for dt: f32 for f32/f16/bf16, f64 for f64, -1 otherwise. */
int fsdp__compute_dtype(fsdp_dtype_t dt);
/* The dtype dt's tensors reach dev's element-wise, row, reduction and loss kernels in: dt
 * itself when dev computes it natively (its lp_native mask), else fsdp__compute_dtype(dt) (-1
 * for a dtype that is not a float). */
fsdp_dtype_t fsdp__kernel_dtype(const fsdp_device_t *dev, fsdp_dtype_t dt);
/* A contiguous tensor with t's values in dtype dt: t itself (retained) when it already is one,
 * else a converted copy. Not recorded. */
int fsdp__as_contig(fsdp_tensor_t *t, fsdp_dtype_t dt, fsdp_tensor_t **out);
/* Whether a backward may write its outgoing gradient over g, an incoming gradient or a tensor
 * its node saved: nobody else holds g or its storage (the backward engine hands a node its only
 * reference to the gradient, and drops the node once it has run), and it is a contiguous tensor
 * of dtype dt and the given shape covering its whole storage. The kernel must read each element
 * before writing it, as element-wise kernels do; the memory the new gradient would have taken,
 * and its first writes, are saved. */
bool fsdp__overwritable(const fsdp_tensor_t *g, fsdp_dtype_t dt, int ndim, const int64_t *shape);
/* Rounds a compute-dtype result to dt in place of *t (replacing *t by a converted tensor when
 * dt differs). */
int fsdp__round_to(fsdp_tensor_t **t, fsdp_dtype_t dt);

/* Describes a shape as "[2, 3]" into buf. */
char *fsdp__shape_str(int ndim, const int64_t *shape, char *buf, size_t len);
/* Error on t's context, prefixed by the operation name. */
int fsdp__op_err(const fsdp_tensor_t *t, int rc, const char *op, const char *fmt, ...)
    FSDP_PRINTF(4, 5);
/* Checks t is non-NULL (naming argument `arg` of `op`); rc on failure. */
int fsdp__check_tensor(fsdp_ctx_t *ctx, const fsdp_tensor_t *t, const char *op, const char *arg);
/* Checks one float input: non-NULL (as fsdp__check_tensor), a float dtype (f32, f16, bf16 or
 * f64), storage present (not freed by a resize). */
int fsdp__check_float(fsdp_ctx_t *ctx, const fsdp_tensor_t *t, const char *op, const char *arg);
/* Checks that a and b are on the same context and device. */
int fsdp__check_same_device(const fsdp_tensor_t *a, const fsdp_tensor_t *b, const char *op);

/* Broadcast shape of a and b (NumPy rules) into out; FSDP_EINVAL naming both shapes. */
int fsdp__broadcast_shape(const fsdp_tensor_t *a, const fsdp_tensor_t *b, const char *op,
                          int *ndim, int64_t *shape);
/* Strides to read t as if broadcast to (ndim, shape): 0 on broadcast dimensions. */
void fsdp__broadcast_strides(const fsdp_tensor_t *t, int ndim, const int64_t *shape,
                             int64_t *stride);
/* Sums g (shape of a broadcast result) down to shape (ndim, shape) over broadcast dimensions:
 * the gradient of a broadcast input. Returns g retained when nothing is summed. */
int fsdp__sum_to_shape(fsdp_tensor_t *g, int ndim, const int64_t *shape, fsdp_tensor_t **out);

/* Normalises dim (negative counts from the end) for a tensor of ndim dimensions. */
int fsdp__norm_dim(const fsdp_tensor_t *t, int dim, int ndim, const char *op, int *out);

#endif /* FSDP_TENSOR_IMPL_H */
