/* SPDX-License-Identifier: MIT */
/*
 * cuda_device.c: the CUDA device's vtable (see cuda_device.h): creation, memory through the
 * caching allocator, copies and streams through the CUDA runtime, the elementwise and reduction
 * kernels through the launchers of cuda_kernels.h, pinned host memory, and the vtable itself.
 * Matrix products are in cuda_gemm.c (cuBLASLt for f32, bf16 and f16, accumulated in f32;
 * cuBLAS for f64), the row, norm, loss and optimizer kernels in cuda_nn.c; cuda_impl.h holds
 * what the three share.
 *
 * Error translation happens in exactly one function, cuda_fail() (and blas_fail() for cuBLAS
 * statuses): a CUDA error becomes FSDP_EBACKEND (FSDP_ENOMEM for an allocation) with a message on
 * the rank's context naming the device, the operation and the runtime's text.
 *
 * Every entry point makes the device's GPU current first (cudaSetDevice is cheap when it already
 * is), so ranks of one process that drive different GPUs from their own threads, or one thread
 * that drives two devices, launch on the right GPU.
 *
 * Kernels take no stream: they run on the device's compute stream in issue order. memcpy and
 * memset run on the stream given, or on the compute stream followed by a synchronization when
 * none is given (fsdp_device_memcpy() promises a NULL stream is synchronous).
 */
#include <config.h>

#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cuda/cuda_impl.h"
#include "backends/cuda/cuda_kernels.h"

_Static_assert(FSDP_CUDA_UN_POW == (int)FSDP_UNARY_POW &&
                   FSDP_CUDA_UN_RELU == (int)FSDP_UNARY_RELU &&
                   FSDP_CUDA_UN_GELU_TANH == (int)FSDP_UNARY_GELU_TANH &&
                   FSDP_CUDA_UN_SQUARE == (int)FSDP_UNARY_SQUARE &&
                   FSDP_CUDA_UN_COUNT == (int)FSDP_UNARY_COUNT,
               "cuda_kernels.h's unary ops follow fsdp_unary_op_t");
_Static_assert(FSDP_CUDA_BIN_MIN == (int)FSDP_BINARY_MIN &&
                   FSDP_CUDA_BIN_DIV == (int)FSDP_BINARY_DIV &&
                   FSDP_CUDA_BIN_COUNT == (int)FSDP_BINARY_COUNT,
               "cuda_kernels.h's binary ops follow fsdp_binary_op_t");
_Static_assert(FSDP_CUDA_REDOP_SUM == (int)FSDP_REDOP_SUM &&
                   FSDP_CUDA_REDOP_AVG == (int)FSDP_REDOP_AVG &&
                   FSDP_CUDA_REDOP_MIN == (int)FSDP_REDOP_MIN &&
                   FSDP_CUDA_REDOP_MAX == (int)FSDP_REDOP_MAX &&
                   FSDP_CUDA_REDOP_PROD == (int)FSDP_REDOP_PROD && FSDP_REDOP_COUNT == 5,
               "cuda_kernels.h's reduction operators follow fsdp_redop_t");
_Static_assert(FSDP_CUDA_MAX_DIMS == FSDP_MAX_DIMS, "strided kernels take FSDP_MAX_DIMS dims");

/* ---- the allocator's raw interface over the CUDA runtime ---- */

static int raw_seg_alloc(void *ctx, size_t bytes, void **out) {
    (void)ctx;
    cudaError_t e = cudaMalloc(out, bytes);
    if (e == cudaSuccess) return FSDP_OK;
    cudaGetLastError();
    *out = NULL;
    return e == cudaErrorMemoryAllocation ? FSDP_ENOMEM : FSDP_EBACKEND;
}

static void raw_seg_free(void *ctx, void *ptr, size_t bytes) {
    (void)ctx, (void)bytes;
    cudaFree(ptr);
}

static int raw_event_create(void *ctx, void **out) {
    (void)ctx;
    return cudaEventCreateWithFlags((cudaEvent_t *)out, cudaEventDisableTiming) == cudaSuccess
               ? FSDP_OK
               : FSDP_EBACKEND;
}

static int raw_event_record(void *ctx, void *ev, void *stream) {
    (void)ctx;
    return cudaEventRecord(ev, stream) == cudaSuccess ? FSDP_OK : FSDP_EBACKEND;
}

static int raw_event_query(void *ctx, void *ev) {
    (void)ctx;
    cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) return 1;
    if (e == cudaErrorNotReady) return 0;
    cudaGetLastError();
    return FSDP_EBACKEND;
}

static void raw_event_destroy(void *ctx, void *ev) {
    (void)ctx;
    cudaEventDestroy(ev);
}

static const struct fsdp_bcache_ops raw_ops = {
    .seg_alloc = raw_seg_alloc,
    .seg_free = raw_seg_free,
    .event_create = raw_event_create,
    .event_record = raw_event_record,
    .event_query = raw_event_query,
    .event_destroy = raw_event_destroy,
};

/* ---- creation ---- */

int fsdp__cuda_visible_devices(char *why, size_t cap) {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        if (why && cap) snprintf(why, cap, "%s (%s)", cudaGetErrorString(e), cudaGetErrorName(e));
        cudaGetLastError();
        return 0;
    }
    if (why && cap) snprintf(why, cap, "%d device(s)", count);
    return count;
}

static void cuda_teardown(struct cuda_dev *cd) {
    if (!cd) return;
    cudaSetDevice(cd->ordinal);
    if (cd->compute) cudaStreamSynchronize(cd->compute);
    fsdp__bcache_destroy(cd->alloc);
    if (cd->lt) cublasLtDestroy(cd->lt);
    if (cd->blas) cublasDestroy(cd->blas);
    cudaFree(cd->lt_ws);
    cudaFree(cd->scratch);
    if (cd->compute) cudaStreamDestroy(cd->compute);
    free(cd);
}

static int cuda_init(fsdp_device_t *dev) {
    char why[256];
    int count = fsdp__cuda_visible_devices(why, sizeof why);
    int rank = dev->ctx ? dev->ctx->rank : -1;
    if (count <= 0)
        return fsdp__ctx_err(dev->ctx, FSDP_ENOTSUP,
                             "fsdp_device_create: no CUDA device is visible to rank %d "
                             "(cudaGetDeviceCount: %s)",
                             rank, why);
    if (dev->ordinal >= count)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL,
                             "fsdp_device_create: opts->ordinal %d is not a CUDA device of rank %d "
                             "(%d visible)",
                             dev->ordinal, rank, count);
    struct cuda_dev *cd = calloc(1, sizeof *cd);
    if (!cd) return fsdp__ctx_err(dev->ctx, FSDP_ENOMEM, "fsdp_device_create: out of host memory");
    cd->dev = dev;
    cd->ordinal = dev->ordinal;
    dev->impl = cd;
    int rc = FSDP_OK;
    cudaError_t e;
    cublasStatus_t st;
    if ((e = cudaSetDevice(cd->ordinal)) != cudaSuccess) {
        rc = cuda_fail(dev, e, "cudaSetDevice");
        goto fail;
    }
    /* A blocking stream: work that others put on the legacy default stream (a process group
     * given no stream) is ordered with the kernels here. Side streams are non-blocking. */
    if ((e = cudaStreamCreateWithFlags(&cd->compute, cudaStreamDefault)) != cudaSuccess) {
        rc = cuda_fail(dev, e, "creating the compute stream");
        goto fail;
    }
    if ((st = cublasCreate(&cd->blas)) != CUBLAS_STATUS_SUCCESS) {
        rc = blas_fail(dev, st, "cublasCreate");
        goto fail;
    }
    if ((st = cublasSetStream(cd->blas, cd->compute)) != CUBLAS_STATUS_SUCCESS) {
        rc = blas_fail(dev, st, "cublasSetStream");
        goto fail;
    }
    if ((st = cublasLtCreate(&cd->lt)) != CUBLAS_STATUS_SUCCESS) {
        rc = blas_fail(dev, st, "cublasLtCreate");
        goto fail;
    }
    if ((e = cudaMalloc(&cd->lt_ws, LT_WORKSPACE)) != cudaSuccess ||
        (e = cudaMalloc((void **)&cd->scratch, FSDP_CUDA_SUMSQ_BLOCKS * sizeof(double))) !=
            cudaSuccess) {
        rc = cuda_fail(dev, e, "allocating the cuBLASLt workspace");
        goto fail;
    }
    const fsdp_bcache_opts_t opts = {.name = "cuda"};
    if (fsdp__bcache_create(&raw_ops, cd, &opts, &cd->alloc) < 0) {
        rc = fsdp__ctx_err(dev->ctx, FSDP_ENOMEM, "fsdp_device_create: out of host memory");
        goto fail;
    }
    const char *tf = getenv("FSDP_CUDA_TF32");
    cd->tf32 = tf && strcmp(tf, "1") == 0;
    if (dev->num_threads <= 0) dev->num_threads = 1;
    return FSDP_OK;
fail:
    cuda_teardown(cd);
    dev->impl = NULL;
    return rc;
}

static void cuda_fini(fsdp_device_t *dev) {
    cuda_teardown(cd_of(dev));
    dev->impl = NULL;
}

/* ---- memory, copies, streams, events ---- */

/* A block for work on stream s (NULL: the compute stream), from s's pool. */
static int cuda_alloc_on(fsdp_device_t *dev, size_t bytes, void *s, void **out) {
    USE(cd, dev);
    int rc = fsdp__bcache_malloc(cd->alloc, bytes, s ? s : (void *)cd->compute, out);
    if (rc < 0) {
        /* The allocator's message has the reserved and allocated bytes; the device layer
         * replaces an FSDP_ENOMEM message with its own, so it goes to the log as well. */
        fsdp_log(dev->ctx, FSDP_LOG_WARN, "%s: %s", dev->name,
                 fsdp__bcache_last_error(cd->alloc));
        return fsdp__ctx_err(dev->ctx, rc, "%s: %s", dev->name,
                             fsdp__bcache_last_error(cd->alloc));
    }
    return FSDP_OK;
}

static int cuda_alloc(fsdp_device_t *dev, size_t bytes, void **out) {
    return cuda_alloc_on(dev, bytes, NULL, out);
}

static void cuda_free(fsdp_device_t *dev, void *ptr) {
    int rc;
    struct cuda_dev *cd = use(dev, &rc);
    if (!cd) return;
    if (fsdp__bcache_free(cd->alloc, ptr) < 0)
        fsdp_log(dev->ctx, FSDP_LOG_ERROR, "%s: %s", dev->name,
                 fsdp__bcache_last_error(cd->alloc));
}

static int cuda_memcpy(fsdp_device_t *dev, void *dst, const void *src, size_t n,
                       fsdp_copy_kind_t kind, void *stream) {
    static const enum cudaMemcpyKind kinds[] = {cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost,
                                                cudaMemcpyDeviceToDevice, cudaMemcpyHostToHost};
    USE(cd, dev);
    cudaStream_t s = stream ? stream : cd->compute;
    cudaError_t e = cudaMemcpyAsync(dst, src, n, kinds[kind], s);
    if (e == cudaSuccess && !stream) e = cudaStreamSynchronize(s);
    return e == cudaSuccess ? FSDP_OK : cuda_fail(dev, e, "memcpy");
}

static int cuda_memset(fsdp_device_t *dev, void *dst, int byte, size_t n, void *stream) {
    USE(cd, dev);
    cudaStream_t s = stream ? stream : cd->compute;
    cudaError_t e = cudaMemsetAsync(dst, byte, n, s);
    if (e == cudaSuccess && !stream) e = cudaStreamSynchronize(s);
    return e == cudaSuccess ? FSDP_OK : cuda_fail(dev, e, "memset");
}

static int cuda_stream_create(fsdp_device_t *dev, void **out) {
    USE(cd, dev);
    (void)cd;
    cudaError_t e = cudaStreamCreateWithFlags((cudaStream_t *)out, cudaStreamNonBlocking);
    return e == cudaSuccess ? FSDP_OK : cuda_fail(dev, e, "cudaStreamCreate");
}

static void cuda_stream_destroy(fsdp_device_t *dev, void *stream) {
    int rc;
    if (use(dev, &rc)) cudaStreamDestroy(stream);
}

static int cuda_stream_sync(fsdp_device_t *dev, void *stream) {
    USE(cd, dev);
    cudaError_t e = cudaStreamSynchronize(stream ? stream : cd->compute);
    return e == cudaSuccess ? FSDP_OK : cuda_fail(dev, e, "cudaStreamSynchronize");
}

static int cuda_event_create(fsdp_device_t *dev, void **out) {
    USE(cd, dev);
    (void)cd;
    cudaError_t e = cudaEventCreateWithFlags((cudaEvent_t *)out, cudaEventDisableTiming);
    return e == cudaSuccess ? FSDP_OK : cuda_fail(dev, e, "cudaEventCreate");
}

static void cuda_event_destroy(fsdp_device_t *dev, void *ev) {
    int rc;
    if (use(dev, &rc)) cudaEventDestroy(ev);
}

static int cuda_event_record(fsdp_device_t *dev, void *ev, void *stream) {
    USE(cd, dev);
    cudaError_t e = cudaEventRecord(ev, stream ? stream : cd->compute);
    return e == cudaSuccess ? FSDP_OK : cuda_fail(dev, e, "cudaEventRecord");
}

static int cuda_event_wait(fsdp_device_t *dev, void *ev, void *stream) {
    USE(cd, dev);
    cudaError_t e = cudaStreamWaitEvent(stream ? stream : cd->compute, ev, 0);
    return e == cudaSuccess ? FSDP_OK : cuda_fail(dev, e, "cudaStreamWaitEvent");
}

static int cuda_event_sync(fsdp_device_t *dev, void *ev) {
    USE(cd, dev);
    (void)cd;
    cudaError_t e = cudaEventSynchronize(ev);
    return e == cudaSuccess ? FSDP_OK : cuda_fail(dev, e, "cudaEventSynchronize");
}

static int cuda_event_query(fsdp_device_t *dev, void *ev) {
    USE(cd, dev);
    (void)cd;
    cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) return 1;
    if (e == cudaErrorNotReady) return 0;
    return cuda_fail(dev, e, "cudaEventQuery");
}

/* ---- elementwise ---- */

static int cuda_fill(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, double value, void *y) {
    uint64_t bits = 0;
    /* The element is converted on the host by the same routine as the CPU's fill, so the two
     * devices store the same bits. */
    int rc = fsdp_dtype_convert(&bits, dt, &value, FSDP_DTYPE_F64, 1);
    if (rc < 0) return fsdp__ctx_err(dev->ctx, rc, "cuda fill: dtype %d is not valid", (int)dt);
    size_t es = fsdp_dtype_size(dt);
    uint64_t pattern = 0;
    memcpy(&pattern, &bits, es); /* the element's bytes, little-endian, in the low bytes */
    USE(cd, dev);
    return launched(dev, fsdp__cuda_k_fill(cd->compute, es, pattern, n, y), "fill kernel");
}

/* cast's kernel on stream s (NULL: the compute stream). */
static int cuda_cast_on(fsdp_device_t *dev, fsdp_dtype_t dt, void *y, fsdp_dtype_t xt,
                        const void *x, size_t n, void *s) {
    if (!fsdp_dtype_valid((int)dt) || !fsdp_dtype_valid((int)xt))
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "cuda cast: invalid dtype (%d from %d)",
                             (int)dt, (int)xt);
    size_t ys = fsdp_dtype_size(dt), xs = fsdp_dtype_size(xt);
    uintptr_t a = (uintptr_t)y, b = (uintptr_t)x;
    if (y != x && a < b + n * xs && b < a + n * ys)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL,
                             "cuda cast: y and x overlap other than in place (%zu elements from "
                             "%s to %s)",
                             n, fsdp_dtype_name(xt), fsdp_dtype_name(dt));
    if (y == x && ys != xs)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL,
                             "cuda cast: in place from %s to %s needs equal element sizes",
                             fsdp_dtype_name(xt), fsdp_dtype_name(dt));
    USE(cd, dev);
    cudaStream_t st = s ? (cudaStream_t)s : cd->compute;
    return launched(dev, fsdp__cuda_k_cast(st, (int)dt, y, (int)xt, x, n), "cast kernel");
}

static int cuda_cast(fsdp_device_t *dev, fsdp_dtype_t dt, void *y, fsdp_dtype_t xt, const void *x,
                     size_t n) {
    return cuda_cast_on(dev, dt, y, xt, x, n, NULL);
}

/* Fills an nd plan from a shape and one or two stride arrays; returns the element count. The
 * plan drops dimensions of size 1 and merges a dimension into the one before it where both
 * operands step over it contiguously (stride[d - 1] == stride[d] * shape[d]), so a contiguous
 * operand is one dimension and a broadcast row two: fewer divisions per element. */
static int64_t nd_fill(struct fsdp_cuda_nd *p, int ndim, const int64_t *shape, const int64_t *s0,
                       const int64_t *s1) {
    int64_t total = 1;
    memset(p, 0, sizeof *p);
    int n = 0;
    for (int d = 0; d < ndim; d++) {
        total *= shape[d];
        if (shape[d] == 1) continue;
        const int64_t a = s0[d], b = s1 ? s1[d] : 0;
        if (n > 0 && p->st[0][n - 1] == a * shape[d] && p->st[1][n - 1] == b * shape[d]) {
            p->shape[n - 1] *= shape[d];
            p->st[0][n - 1] = a;
            p->st[1][n - 1] = b;
            continue;
        }
        p->shape[n] = shape[d];
        p->st[0][n] = a;
        p->st[1][n] = b;
        n++;
    }
    if (n == 0) {
        n = 1;
        p->shape[0] = 1;
    }
    p->nd = n;
    /* 32-bit indexing when the count and the farthest offset of each operand fit. */
    double far[2] = {0, 0};
    for (int d = 0; d < n; d++)
        for (int k = 0; k < 2; k++)
            far[k] += (double)(p->shape[d] - 1) * fabs((double)p->st[k][d]);
    p->i32 = total >= 0 && total <= INT32_MAX && far[0] <= INT32_MAX && far[1] <= INT32_MAX;
    return total;
}

static int cuda_copy_strided(fsdp_device_t *dev, fsdp_dtype_t dt, int ndim, const int64_t *shape,
                             void *y, const void *x, const int64_t *xstride) {
    struct fsdp_cuda_nd p;
    if (ndim < 0 || ndim > FSDP_MAX_DIMS || !fsdp_dtype_valid((int)dt))
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "cuda copy_strided: ndim %d or dtype %d", ndim,
                             (int)dt);
    int64_t total = nd_fill(&p, ndim, shape, xstride, NULL);
    if (total <= 0) return FSDP_OK;
    USE(cd, dev);
    return launched(dev,
                    fsdp__cuda_k_copy_strided(cd->compute, fsdp_dtype_size(dt), &p, total, y, x),
                    "copy_strided kernel");
}

static int cuda_unary(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_unary_op_t op, size_t n,
                      double alpha, const void *x, void *y) {
    FLOAT_DT(dev, "unary", dt);
    if ((int)op < 0 || op >= FSDP_UNARY_COUNT)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "cuda unary: op %d is not a fsdp_unary_op_t",
                             (int)op);
    if (n == 0) return FSDP_OK;
    USE(cd, dev);
    return launched(dev,
                    fsdp__cuda_k_unary(cd->compute, dt == FSDP_DTYPE_F64, (int)op, n, alpha, x, y),
                    "unary kernel");
}

static int cuda_unary_backward(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_unary_op_t op, size_t n,
                               double alpha, const void *x, const void *y, const void *gy,
                               void *gx) {
    FLOAT_DT(dev, "unary_backward", dt);
    if ((int)op < 0 || op >= FSDP_UNARY_COUNT)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL,
                             "cuda unary_backward: op %d is not a fsdp_unary_op_t", (int)op);
    bool from_y = op == FSDP_UNARY_RELU || op == FSDP_UNARY_TANH || op == FSDP_UNARY_SIGMOID ||
                  op == FSDP_UNARY_EXP || op == FSDP_UNARY_SQRT || op == FSDP_UNARY_RSQRT;
    bool no_input = op == FSDP_UNARY_NEG || op == FSDP_UNARY_SCALE || op == FSDP_UNARY_ADD_SCALAR;
    if (!no_input && !x && !(from_y && y))
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL,
                             "cuda unary_backward: op %d needs the input x, which is NULL",
                             (int)op);
    if (n == 0) return FSDP_OK;
    USE(cd, dev);
    return launched(dev,
                    fsdp__cuda_k_unary_backward(cd->compute, dt == FSDP_DTYPE_F64, (int)op, n,
                                                alpha, x, from_y ? y : NULL, gy, gx),
                    "unary_backward kernel");
}

static int cuda_binary(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_binary_op_t op, int ndim,
                       const int64_t *shape, void *y, const void *a, const int64_t *astride,
                       const void *b, const int64_t *bstride) {
    struct fsdp_cuda_nd p;
    FLOAT_DT(dev, "binary", dt);
    if ((int)op < 0 || op >= FSDP_BINARY_COUNT || ndim < 0 || ndim > FSDP_MAX_DIMS)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "cuda binary: op %d or ndim %d out of range",
                             (int)op, ndim);
    int64_t total = nd_fill(&p, ndim, shape, astride, bstride);
    if (total <= 0) return FSDP_OK;
    USE(cd, dev);
    return launched(
        dev, fsdp__cuda_k_binary(cd->compute, dt == FSDP_DTYPE_F64, (int)op, &p, total, y, a, b),
        "binary kernel");
}

static int cuda_axpy(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, double alpha, const void *x,
                     void *y) {
    FLOAT_DT(dev, "axpy", dt);
    if (n == 0) return FSDP_OK;
    USE(cd, dev);
    return launched(dev, fsdp__cuda_k_axpy(cd->compute, dt == FSDP_DTYPE_F64, n, alpha, x, y),
                    "axpy kernel");
}

static int cuda_where(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, const uint8_t *cond,
                      const void *a, double av, const void *b, double bv, void *y) {
    FLOAT_DT(dev, "where", dt);
    if (n == 0) return FSDP_OK;
    USE(cd, dev);
    return launched(dev,
                    fsdp__cuda_k_where(cd->compute, dt == FSDP_DTYPE_F64, n, cond, a, av, b, bv, y),
                    "where kernel");
}

/* ---- reductions ---- */

static int cuda_reduce_sum(fsdp_device_t *dev, fsdp_dtype_t dt, size_t outer, size_t r,
                           size_t inner, double alpha, const void *x, void *y) {
    FLOAT_DT(dev, "reduce_sum", dt);
    if (outer == 0 || inner == 0) return FSDP_OK;
    USE(cd, dev);
    return launched(
        dev,
        fsdp__cuda_k_reduce_sum(cd->compute, dt == FSDP_DTYPE_F64, outer, r, inner, alpha, x, y),
        "reduce_sum kernel");
}

static int cuda_reduce_max(fsdp_device_t *dev, fsdp_dtype_t dt, size_t outer, size_t r,
                           size_t inner, const void *x, void *y, int64_t *idx) {
    FLOAT_DT(dev, "reduce_max", dt);
    if (outer == 0 || inner == 0) return FSDP_OK;
    USE(cd, dev);
    return launched(
        dev, fsdp__cuda_k_reduce_max(cd->compute, dt == FSDP_DTYPE_F64, outer, r, inner, x, y, idx),
        "reduce_max kernel");
}

static int cuda_sum_squares(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, const void *x,
                            void *out) {
    FLOAT_DT(dev, "sum_squares", dt);
    USE(cd, dev);
    return launched(
        dev, fsdp__cuda_k_sum_squares(cd->compute, dt == FSDP_DTYPE_F64, n, x, cd->scratch, out),
        "sum_squares kernel");
}

/* Outputs beyond the kernel's pointer table get further launches over the same inputs: the
 * result of an element does not depend on the launch, so every output gets the same bits. */
static int cuda_coll_reduce(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_redop_t op, int divisor,
                            double prescale, void *const *outs, int nout, const void *const *ins,
                            int nin, size_t n, void *stream) {
    USE(cd, dev);
    if (nin < 1 || nin > FSDP_CUDA_COLL_MAX_PTRS)
        return fsdp__ctx_err(dev->ctx, FSDP_ENOTSUP,
                             "%s coll_reduce: %d inputs (a group of %d ranks) is more than the "
                             "%d the kernel takes",
                             dev->name, nin, nin, FSDP_CUDA_COLL_MAX_PTRS);
    if (n == 0 || nout <= 0) return FSDP_OK;
    cudaStream_t s = stream ? stream : cd->compute;
    struct fsdp_cuda_coll_ptrs p;
    memset(&p, 0, sizeof p);
    for (int k = 0; k < nin; k++) p.in[k] = ins[k];
    for (int done = 0; done < nout;) {
        int m = nout - done < FSDP_CUDA_COLL_MAX_PTRS ? nout - done : FSDP_CUDA_COLL_MAX_PTRS;
        for (int k = 0; k < m; k++) p.out[k] = outs[done + k];
        cudaError_t e =
            fsdp__cuda_k_coll_reduce(s, (int)dt, (int)op, divisor, prescale, &p, nin, m, n);
        if (e != cudaSuccess) return cuda_fail(dev, e, "coll_reduce kernel");
        done += m;
    }
    if (!stream) {
        cudaError_t e = cudaStreamSynchronize(s);
        if (e != cudaSuccess) return cuda_fail(dev, e, "cudaStreamSynchronize");
    }
    return FSDP_OK;
}

/* ---- host memory for the offload of FSDP units (the vtable's host_alloc/host_free) ---- */

/* Pinned, portable (usable with every GPU of the process), page aligned. It needs no state of
 * the device: the block belongs to the host device `host`, may outlive the CUDA device object
 * that set up the routing, and is allocated in whatever CUDA context is current on the thread
 * (the process's primary context of the device last used, or of GPU 0). */
static int cuda_host_alloc_raw(fsdp_device_t *host, size_t bytes, void **out) {
    *out = NULL;
    if (bytes == 0) bytes = 1;
    cudaError_t e = cudaHostAlloc(out, bytes, cudaHostAllocPortable);
    if (e == cudaSuccess) return FSDP_OK;
    cudaGetLastError();
    *out = NULL;
    if (e == cudaErrorMemoryAllocation) return FSDP_ENOMEM; /* device.c words the message */
    return fsdp__ctx_err(host->ctx, FSDP_EBACKEND,
                         "%s: cannot pin %zu bytes of host memory: %s (%s)", host->name, bytes,
                         cudaGetErrorString(e), cudaGetErrorName(e));
}

static void cuda_host_free_raw(fsdp_device_t *host, void *ptr) {
    cudaError_t e = cudaFreeHost(ptr);
    if (e != cudaSuccess) {
        cudaGetLastError();
        fsdp_log(host->ctx, FSDP_LOG_ERROR, "%s: cudaFreeHost(%p): %s", host->name, ptr,
                 cudaGetErrorString(e));
    }
}

/* ---- beyond the vtable ---- */

/* A pinned block starts with this header (host memory, so it can carry one). */
struct pinned_header {
    size_t bytes;
    fsdp_mem_cat_t cat;
};
#define PINNED_HEADER 64

int fsdp__cuda_host_alloc(fsdp_device_t *dev, fsdp_mem_cat_t cat, size_t bytes, void **out) {
    *out = NULL;
    if ((int)cat < 0 || cat >= FSDP_MEM_NCAT)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "cuda host_alloc: cat %d is not valid",
                             (int)cat);
    if (bytes == 0) return FSDP_OK;
    if (bytes > SIZE_MAX - PINNED_HEADER)
        return fsdp__ctx_err(dev->ctx, FSDP_ENOMEM, "cuda host_alloc: %zu bytes", bytes);
    USE(cd, dev);
    (void)cd;
    void *p = NULL;
    cudaError_t e = cudaHostAlloc(&p, bytes + PINNED_HEADER, cudaHostAllocPortable);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return fsdp__ctx_err(dev->ctx, e == cudaErrorMemoryAllocation ? FSDP_ENOMEM : FSDP_EBACKEND,
                             "%s: cannot pin %zu bytes of host memory for %s: %s", dev->name, bytes,
                             fsdp_mem_cat_name(cat), cudaGetErrorString(e));
    }
    struct pinned_header h = {bytes, cat};
    memcpy(p, &h, sizeof h);
    fsdp_mem_account_alloc(dev->ctx, cat, bytes);
    *out = (char *)p + PINNED_HEADER;
    return FSDP_OK;
}

void fsdp__cuda_host_free(fsdp_device_t *dev, void *ptr) {
    if (!ptr) return;
    char *base = (char *)ptr - PINNED_HEADER;
    struct pinned_header h;
    memcpy(&h, base, sizeof h);
    fsdp_mem_account_free(dev->ctx, h.cat, h.bytes);
    cudaFreeHost(base);
}

int fsdp__cuda_record_stream(fsdp_device_t *dev, void *ptr, void *stream) {
    struct cuda_dev *cd = cd_of(dev);
    int rc = fsdp__bcache_record_stream(cd->alloc, ptr, stream);
    if (rc < 0)
        return fsdp__ctx_err(dev->ctx, rc, "%s: %s", dev->name,
                             fsdp__bcache_last_error(cd->alloc));
    return FSDP_OK;
}

void fsdp__cuda_alloc_stats(fsdp_device_t *dev, fsdp_bcache_stats_t *out) {
    fsdp__bcache_get_stats(cd_of(dev)->alloc, out);
}

size_t fsdp__cuda_empty_cache(fsdp_device_t *dev) {
    int rc;
    struct cuda_dev *cd = use(dev, &rc);
    return cd ? fsdp__bcache_empty_cache(cd->alloc) : 0;
}

void fsdp__cuda_set_tf32(fsdp_device_t *dev, bool on) {
    cd_of(dev)->tf32 = on;
}

void *fsdp__cuda_compute_stream(fsdp_device_t *dev) {
    return cd_of(dev)->compute;
}

const struct fsdp_dev_ops fsdp__cuda_dev_ops = {
    .name = "cuda",
    .kind = FSDP_DEVICE_CUDA,

    .alloc = cuda_alloc,
    .alloc_on = cuda_alloc_on,
    .record_stream = fsdp__cuda_record_stream,
    .cast_on = cuda_cast_on,
    .free = cuda_free,
    .memcpy = cuda_memcpy,
    .memset = cuda_memset,
    .stream_create = cuda_stream_create,
    .stream_destroy = cuda_stream_destroy,
    .stream_sync = cuda_stream_sync,
    .event_create = cuda_event_create,
    .event_destroy = cuda_event_destroy,
    .event_record = cuda_event_record,
    .event_wait = cuda_event_wait,
    .event_sync = cuda_event_sync,
    .event_query = cuda_event_query,
    .compute_stream = fsdp__cuda_compute_stream,
    .init = cuda_init,
    .fini = cuda_fini,
    .host_alloc = cuda_host_alloc_raw,
    .host_free = cuda_host_free_raw,

    .fill = cuda_fill,
    .cast = cuda_cast,
    .copy_strided = cuda_copy_strided,
    .unary = cuda_unary,
    .unary_backward = cuda_unary_backward,
    .binary = cuda_binary,
    .axpy = cuda_axpy,
    .where = cuda_where,

    .reduce_sum = cuda_reduce_sum,
    .reduce_max = cuda_reduce_max,
    .sum_squares = cuda_sum_squares,
    .coll_reduce = cuda_coll_reduce,

    .gemm = fsdp__cuda_gemm,
    .gemm_lp_dtypes = FSDP__DT_BIT(FSDP_DTYPE_BF16) | FSDP__DT_BIT(FSDP_DTYPE_F16),
    .gemm_lp = fsdp__cuda_gemm_lp,

    .softmax = fsdp__cuda_softmax,
    .softmax_backward = fsdp__cuda_softmax_backward,
    .layer_norm = fsdp__cuda_layer_norm,
    .layer_norm_backward = fsdp__cuda_layer_norm_backward,
    .batch_norm = fsdp__cuda_batch_norm,
    .batch_norm_backward = fsdp__cuda_batch_norm_backward,
    .embedding = fsdp__cuda_embedding,
    .embedding_backward = fsdp__cuda_embedding_backward,
    .cross_entropy = fsdp__cuda_cross_entropy,
    .cross_entropy_backward = fsdp__cuda_cross_entropy_backward,
    .dropout = fsdp__cuda_dropout,
    .sgd_step = fsdp__cuda_sgd_step,
    .adam_step = fsdp__cuda_adam_step,
};
