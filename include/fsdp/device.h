/* SPDX-License-Identifier: MIT */
/*
 * fsdp/device.h: where tensors live and where their kernels run.
 *
 * A device is one rank's handle on a memory space and a compute engine: the CPU (always
 * present) or, in later builds, a CUDA GPU. Everything above this layer (tensors, autograd,
 * modules, optimizers, FSDP) reaches memory and compute only through a device, so the same code
 * runs on either. Device memory is accounted on the rank's context by category (see mem.h).
 *
 * Streams and events order work on devices that run asynchronously. On the CPU every call has
 * completed when it returns, so streams and events exist (they can be created, recorded,
 * waited on) but order nothing.
 *
 * Thread-safety: a device belongs to one rank (one context) and is used by one thread at a time;
 * devices of different ranks may be used concurrently.
 */
#ifndef FSDP_DEVICE_H
#define FSDP_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#include <fsdp/dtype.h>
#include <fsdp/export.h>
#include <fsdp/mem.h>

FSDP_BEGIN_DECLS

typedef struct fsdp_ctx fsdp_ctx_t;
typedef struct fsdp_device fsdp_device_t;
typedef struct fsdp_stream fsdp_stream_t;
typedef struct fsdp_event fsdp_event_t;

/* Largest number of dimensions of a tensor (and so of a strided kernel). */
#define FSDP_MAX_DIMS 8

typedef enum fsdp_device_kind {
    FSDP_DEVICE_CPU = 0,
    FSDP_DEVICE_CUDA,
    /* Shape-only tensors: allocations are counted, not backed, and kernels compute nothing
     * (fsdp/vsim.h). Copies to the host give zeros. */
    FSDP_DEVICE_META,
    FSDP_DEVICE_KIND_COUNT
} fsdp_device_kind_t;

/* Direction of a copy between host memory and device memory. */
typedef enum fsdp_copy_kind {
    FSDP_COPY_H2D = 0, /* host to device */
    FSDP_COPY_D2H,     /* device to host */
    FSDP_COPY_D2D,     /* device to device */
    FSDP_COPY_H2H      /* host to host */
} fsdp_copy_kind_t;

typedef struct fsdp_device_options {
    /* sizeof this struct as the caller was built; set by fsdp_device_options_init() */
    size_t size;
    int num_threads; /* compute threads (BLAS); <= 0: FSDP_NUM_THREADS, else cores / world_size */
    int ordinal;     /* which device of its kind (CUDA), 0 for the CPU */
} fsdp_device_options_t;

/* Fills opts with the defaults: num_threads 0 (automatic), ordinal 0. */
FSDP_EXTERN void fsdp_device_options_init(fsdp_device_options_t *opts, size_t size);
#define fsdp_device_options_init(opts) (fsdp_device_options_init)((opts), sizeof *(opts))

/* Creates a device of `kind` for the rank of ctx. A kind that was not compiled in returns
 * FSDP_ENOTSUP. The device borrows ctx, which must outlive it. opts may be NULL.
 *
 * The CUDA device (like the NCCL group) lives in the plugin libfsdp-cuda.so, which the first
 * creation opens (thread-safe; it stays loaded): from $FSDP_PLUGIN_DIR when that is set, else
 * beside libfsdp in a build tree, else from the directory it was installed in. A plugin that is
 * missing, cannot be loaded or belongs to another libfsdp version is FSDP_ENOTSUP, the message
 * naming the paths tried and dlerror()'s text; the next creation tries again. */
FSDP_EXTERN int fsdp_device_create(fsdp_ctx_t *ctx, fsdp_device_kind_t kind,
                                   const fsdp_device_options_t *opts, fsdp_device_t **out);

/* Destroys a device; NULL is accepted. Memory still allocated on it is a caller bug and is
 * reported as a warning. */
FSDP_EXTERN void fsdp_device_destroy(fsdp_device_t *dev);

/* The context's default device: the one set with fsdp_ctx_set_device(), or a CPU device
 * created on first use and destroyed with the context. NULL only when memory runs out. */
FSDP_EXTERN fsdp_device_t *fsdp_ctx_device(fsdp_ctx_t *ctx);

/* Makes dev (borrowed, of the same context) the default device of ctx; NULL restores the CPU. */
FSDP_EXTERN int fsdp_ctx_set_device(fsdp_ctx_t *ctx, fsdp_device_t *dev);

FSDP_EXTERN fsdp_device_kind_t fsdp_device_kind(const fsdp_device_t *dev);
FSDP_EXTERN const char *fsdp_device_name(const fsdp_device_t *dev); /* "cpu", "cuda:0", "meta" */
FSDP_EXTERN fsdp_ctx_t *fsdp_device_ctx(const fsdp_device_t *dev);
/* Compute threads the device uses (the BLAS thread count on the CPU). */
FSDP_EXTERN int fsdp_device_num_threads(const fsdp_device_t *dev);

/* Allocates `bytes` (64-byte aligned) of device memory counted under `cat`. bytes == 0 gives a
 * valid pointer that must still be freed. FSDP_ENOMEM names the size and category. */
FSDP_EXTERN int fsdp_device_alloc(fsdp_device_t *dev, fsdp_mem_cat_t cat, size_t bytes,
                                  void **out);
/* Frees what fsdp_device_alloc() returned; NULL is accepted. */
FSDP_EXTERN void fsdp_device_free(fsdp_device_t *dev, void *ptr);

/* Copies n bytes; ordered on `stream` (NULL: the default stream, synchronous). */
FSDP_EXTERN int fsdp_device_memcpy(fsdp_device_t *dev, void *dst, const void *src, size_t n,
                                   fsdp_copy_kind_t kind, fsdp_stream_t *stream);
/* Sets n bytes of device memory to `byte`. */
FSDP_EXTERN int fsdp_device_memset(fsdp_device_t *dev, void *dst, int byte, size_t n,
                                   fsdp_stream_t *stream);
/* Sets n elements of dtype dt to `value` (converted to dt; f16/bf16 rounded to nearest even). */
FSDP_EXTERN int fsdp_device_fill(fsdp_device_t *dev, void *dst, fsdp_dtype_t dt, size_t n,
                                 double value, fsdp_stream_t *stream);
/* Converts n elements from st to dt (device memory on both sides), queued on `stream` where the
 * device has per-stream kernels (CUDA), else in order with its compute stream. */
FSDP_EXTERN int fsdp_device_cast(fsdp_device_t *dev, void *dst, fsdp_dtype_t dt, const void *src,
                                 fsdp_dtype_t st, size_t n, fsdp_stream_t *stream);

/* Streams: ordered queues of device work. On the CPU they order nothing. */
FSDP_EXTERN int fsdp_stream_create(fsdp_device_t *dev, fsdp_stream_t **out);
FSDP_EXTERN void fsdp_stream_destroy(fsdp_stream_t *stream);
/* Blocks until all work queued on stream has finished. */
FSDP_EXTERN int fsdp_stream_sync(fsdp_stream_t *stream);
/* The native stream handle (cudaStream_t on CUDA, NULL on the CPU), for fsdp_pg calls. */
FSDP_EXTERN void *fsdp_stream_native(const fsdp_stream_t *stream);

/* Events: a point in a stream that other streams or the host can wait for. */
FSDP_EXTERN int fsdp_event_create(fsdp_device_t *dev, fsdp_event_t **out);
FSDP_EXTERN void fsdp_event_destroy(fsdp_event_t *ev);
FSDP_EXTERN int fsdp_event_record(fsdp_event_t *ev, fsdp_stream_t *stream);
/* Makes later work on stream wait for ev (does not block the host). */
FSDP_EXTERN int fsdp_event_wait(fsdp_event_t *ev, fsdp_stream_t *stream);
/* Blocks the host until ev has completed. */
FSDP_EXTERN int fsdp_event_sync(fsdp_event_t *ev);

FSDP_END_DECLS

#endif /* FSDP_DEVICE_H */
