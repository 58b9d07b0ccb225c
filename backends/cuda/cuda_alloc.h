/*
 * cuda_alloc.h: the caching allocator of the CUDA device, written over a small raw-memory
 * interface so that it runs (and is tested) on the host with a fake backend.
 *
 * The allocator asks the backend for large segments and carves blocks out of them, so a training
 * step that frees and reallocates the same activation sizes never reaches cudaMalloc/cudaFree
 * (which synchronize the device). Sizes are rounded up to 512 bytes. Two pools:
 *   - small: rounded sizes up to 1 MiB, carved from 2 MiB segments;
 *   - large: bigger sizes, each from a segment of its size rounded up to 2 MiB (or from a free
 *     block of a large segment carved earlier).
 * A request takes the best fit (the smallest free block of its pool and stream that is big
 * enough, lowest address on ties); the rest of the block is split off when it is at least 512
 * bytes (small) or more than 1 MiB (large), and a freed block merges with free neighbours of its
 * segment.
 *
 * Streams: every segment, and so every block carved from it, belongs to the stream it was first
 * allocated on, and is reused only for requests on that stream: work queued on one stream is
 * ordered after earlier work on it, so a block freed by the host can be handed out again at once
 * on that stream. When a block was also used on other streams (fsdp__cuda_alloc_record_stream),
 * freeing it records an event on each of them, and the block becomes free only when every such
 * event has completed (queried, never waited for by guessing a delay).
 *
 * Out of memory: when the backend cannot give a segment, the allocator collects completed
 * events, gives back every cached segment that is wholly free, and tries once more; then it
 * fails with FSDP_ENOMEM and a message naming the request and the reserved and allocated bytes.
 *
 * Thread-safety: none; an allocator belongs to one device, used by one thread at a time.
 */
#ifndef FSDP_CUDA_ALLOC_H
#define FSDP_CUDA_ALLOC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FSDP_CUDA_ALLOC_ROUND ((size_t)512)           /* every block is a multiple of this */
#define FSDP_CUDA_ALLOC_SMALL_MAX ((size_t)1 << 20)   /* largest size of the small pool */
#define FSDP_CUDA_ALLOC_SMALL_SEG ((size_t)2 << 20)   /* size of a small-pool segment */
#define FSDP_CUDA_ALLOC_LARGE_ROUND ((size_t)2 << 20) /* large segments are multiples of this */

/*
 * What the allocator needs from the device: segments and events. Every function gets `ctx`
 * back. seg_alloc returns 0, FSDP_ENOMEM when the memory is exhausted (the allocator then frees
 * its cache and retries), or another negative FSDP_E* code (a device failure, passed on).
 * event_query returns 1 when the event has completed, 0 when not yet, or a negative code.
 */
struct fsdp_cuda_raw_ops {
    int (*seg_alloc)(void *ctx, size_t bytes, void **out);
    void (*seg_free)(void *ctx, void *ptr);
    int (*event_create)(void *ctx, void **out);
    int (*event_record)(void *ctx, void *ev, void *stream);
    int (*event_query)(void *ctx, void *ev);
    void (*event_destroy)(void *ctx, void *ev);
};

enum { FSDP_CUDA_POOL_SMALL = 0, FSDP_CUDA_POOL_LARGE = 1, FSDP_CUDA_NPOOLS = 2 };

/* Counters, in bytes unless said otherwise; index [pool] and the totals. "Allocated" counts
 * rounded block sizes handed out; "requested" the sizes asked for; "reserved" the segments
 * held from the backend. The per-category accounting (params, grads, ...) is the device
 * layer's (fsdp_mem_get_stats); these say what the cache adds on top. */
typedef struct fsdp_cuda_alloc_stats {
    size_t allocated[FSDP_CUDA_NPOOLS], allocated_peak[FSDP_CUDA_NPOOLS];
    size_t reserved[FSDP_CUDA_NPOOLS], reserved_peak[FSDP_CUDA_NPOOLS];
    size_t allocated_total, allocated_peak_total;
    size_t reserved_total, reserved_peak_total;
    size_t requested_total; /* sum of the sizes asked for by live blocks */
    size_t segments;        /* segments held now */
    size_t seg_allocs;      /* seg_alloc calls that succeeded, ever */
    size_t seg_frees;       /* segments given back, ever */
    size_t blocks;          /* live blocks handed out */
    size_t pending_blocks;  /* freed blocks waiting on events of other streams */
    size_t oom_retries;     /* times the cache was emptied to retry a failed seg_alloc */
    size_t ooms;            /* requests that failed for lack of memory */
} fsdp_cuda_alloc_stats_t;

typedef struct fsdp_cuda_alloc fsdp_cuda_alloc_t;

/* Creates an allocator over `ops` (borrowed, must outlive it) with backend context ctx. */
int fsdp__cuda_alloc_create(const struct fsdp_cuda_raw_ops *ops, void *ctx,
                            fsdp_cuda_alloc_t **out);
/* Gives every segment back and frees the allocator; NULL is accepted. Blocks still handed out
 * are freed with it (their pointers dangle). Pending events are destroyed without waiting. */
void fsdp__cuda_alloc_destroy(fsdp_cuda_alloc_t *a);

/* Allocates `bytes` (0 gives a block of 512) for use on `stream` (NULL is a stream too: the
 * backend's default). 0, FSDP_ENOMEM or a backend code; the message is in
 * fsdp__cuda_alloc_last_error(). */
int fsdp__cuda_alloc_malloc(fsdp_cuda_alloc_t *a, size_t bytes, void *stream, void **out);
/* Frees a block (NULL accepted). FSDP_EINVAL when ptr is not a live block of this allocator;
 * a backend code when recording an event failed (the block is then kept pending until its
 * other events completed, or forever: it is never reused early). */
int fsdp__cuda_alloc_free(fsdp_cuda_alloc_t *a, void *ptr);
/* Notes that the block holding ptr is used by work on `stream`, so that its memory is not
 * reused before that work has completed (like torch's Tensor.record_stream). A stream equal to
 * the block's own is ignored. FSDP_EINVAL when ptr is not inside a live block. */
int fsdp__cuda_alloc_record_stream(fsdp_cuda_alloc_t *a, void *ptr, void *stream);
/* Moves blocks whose events have all completed to the free pools (also done by every malloc
 * and by empty_cache). Returns how many became free, or a negative backend code. */
int fsdp__cuda_alloc_process_events(fsdp_cuda_alloc_t *a);
/* Gives back every segment that is wholly free. Returns the bytes released. */
size_t fsdp__cuda_alloc_empty_cache(fsdp_cuda_alloc_t *a);

void fsdp__cuda_alloc_get_stats(const fsdp_cuda_alloc_t *a, fsdp_cuda_alloc_stats_t *out);
/* Sets the peaks to the current values. */
void fsdp__cuda_alloc_reset_peaks(fsdp_cuda_alloc_t *a);
/* Size of the block holding ptr (rounded), 0 when ptr is not a live block. */
size_t fsdp__cuda_alloc_block_size(const fsdp_cuda_alloc_t *a, const void *ptr);
/* The message of the last failure ("" if none). */
const char *fsdp__cuda_alloc_last_error(const fsdp_cuda_alloc_t *a);

#ifdef __cplusplus
}
#endif

#endif /* FSDP_CUDA_ALLOC_H */
