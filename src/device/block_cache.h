/* SPDX-License-Identifier: MIT */
/*
 * block_cache.h: the caching allocator of the CPU and CUDA devices, written over a small
 * raw-memory interface (segments, and events for multi-stream use) so that one piece of code
 * serves both and is tested on the host with a fake backend.
 *
 * The allocator asks the backend for large segments and carves blocks out of them, so a training
 * step that frees and reallocates the same activation sizes never reaches the system allocator
 * (cudaMalloc/cudaFree, which synchronize a GPU; mmap/munmap and the page faults of new pages on
 * a CPU). Sizes are rounded up to 512 bytes. Two pools:
 *   - small: rounded sizes up to 1 MiB, carved from 2 MiB segments;
 *   - large: bigger sizes, each from a segment of its size rounded up to 2 MiB (or from a free
 *     block of a large segment carved earlier).
 * A request takes the best fit (the smallest free block of its pool and stream that is big
 * enough, lowest address on ties); the rest of the block is split off when it is at least 512
 * bytes (small) or more than 1 MiB (large), and a freed block merges with free neighbours of its
 * segment, so memory freed as one set of sizes serves another.
 *
 * Streams: every segment, and so every block carved from it, belongs to the stream it was first
 * allocated on, and is reused only for requests on that stream: work queued on one stream is
 * ordered after earlier work on it, so a block freed by the host can be handed out again at once
 * on that stream. When a block was also used on other streams (fsdp__bcache_record_stream),
 * freeing it records an event on each of them, and the block becomes free only when every such
 * event has completed (queried, never waited for by guessing a delay). A backend without events
 * (the CPU, whose work is done when its call returns) leaves them NULL.
 *
 * Footprint (options): `bound_to_peak` keeps the segments held within the most ever allocated at
 * once: before a new segment is taken, wholly free segments are given back until it fits under
 * that peak (or none are left). With a backend that decommits, resident bytes are kept within the
 * peak plus a slack, which grows by what was given back and then needed again (at most doubling),
 * so a step whose working set sits just above the slack does not fault its pages in every step.
 * `max_cached` gives wholly free segments back whenever more than that many bytes are held and not
 * allocated. Without either, segments are kept until empty_cache or an out-of-memory retry (the
 * CUDA device's choice, like PyTorch's).
 *
 * Zeroed memory: when the backend's segments come zeroed (`zeroed_segments`, a CPU mmap), the
 * allocator knows which free bytes nobody has written since, and fsdp__bcache_malloc_clean says
 * whether the block it hands out is still all zero, so a caller that needs zeros clears only
 * blocks that were used before.
 *
 * Out of memory: when the backend cannot give a segment, the allocator collects completed
 * events, gives back every cached segment that is wholly free, and tries once more; then it
 * fails with FSDP_ENOMEM and a message naming the request and the reserved and allocated bytes.
 *
 * Thread-safety: none; an allocator belongs to one device, used by one thread at a time.
 */
#ifndef FSDP_BLOCK_CACHE_H
#define FSDP_BLOCK_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FSDP_BCACHE_ROUND ((size_t)512)           /* every block is a multiple of this */
#define FSDP_BCACHE_SMALL_MAX ((size_t)1 << 20)   /* largest size of the small pool */
#define FSDP_BCACHE_SMALL_SEG ((size_t)2 << 20)   /* size of a small-pool segment */
#define FSDP_BCACHE_LARGE_ROUND ((size_t)2 << 20) /* large segments are multiples of this */

/*
 * What the allocator needs from the device: segments and events. Every function gets `ctx`
 * back; seg_free gets the size seg_alloc was asked for. The four event functions are all given
 * or all NULL (then record_stream is FSDP_ENOTSUP). seg_alloc returns 0, FSDP_ENOMEM when the
 * memory is exhausted (the allocator then frees its cache and retries), or another negative FSDP_E*
 * code (a device failure, passed on). event_query returns 1 when the event has completed, 0 when
 * not yet, or a negative code.
 */
struct fsdp_bcache_ops {
    int (*seg_alloc)(void *ctx, size_t bytes, void **out);
    void (*seg_free)(void *ctx, void *ptr, size_t bytes);
    int (*event_create)(void *ctx, void **out);
    int (*event_record)(void *ctx, void *ev, void *stream);
    int (*event_query)(void *ctx, void *ev);
    void (*event_destroy)(void *ctx, void *ev);
    /* Optional: gives the pages of [ptr, ptr + bytes) (inside a segment) back to the system and
     * leaves the range reading as zero; used by bound_to_peak on what is free but resident. */
    void (*decommit)(void *ctx, void *ptr, size_t bytes);
};

enum { FSDP_BCACHE_POOL_SMALL = 0, FSDP_BCACHE_POOL_LARGE = 1, FSDP_BCACHE_NPOOLS = 2 };

/* Counters, in bytes unless said otherwise; index [pool] and the totals. "Allocated" counts
 * rounded block sizes handed out; "requested" the sizes asked for; "reserved" the segments
 * held from the backend. The per-category accounting (params, grads, ...) is the device
 * layer's (fsdp_mem_get_stats); these say what the cache adds on top. */
typedef struct fsdp_bcache_stats {
    size_t allocated[FSDP_BCACHE_NPOOLS], allocated_peak[FSDP_BCACHE_NPOOLS];
    size_t reserved[FSDP_BCACHE_NPOOLS], reserved_peak[FSDP_BCACHE_NPOOLS];
    size_t allocated_total, allocated_peak_total;
    size_t reserved_total, reserved_peak_total;
    size_t requested_total; /* sum of the sizes asked for by live blocks */
    size_t segments;        /* segments held now */
    size_t seg_allocs;      /* seg_alloc calls that succeeded, ever */
    size_t seg_frees;       /* segments given back, ever */
    size_t bound_frees;     /* of them, given back by bound_to_peak or max_cached */
    size_t decommits;       /* free blocks whose pages bound_to_peak gave back, ever */
    size_t decommitted;     /* their bytes, ever */
    size_t slack_learned;   /* bytes bound_to_peak added to its slack after memory it had given
                             * back was needed again (block_cache.c, keep_to_peak) */
    size_t blocks;          /* live blocks handed out */
    size_t pending_blocks;  /* freed blocks waiting on events of other streams */
    size_t oom_retries;     /* times the cache was emptied to retry a failed seg_alloc */
    size_t ooms;            /* requests that failed for lack of memory */
} fsdp_bcache_stats_t;

typedef struct fsdp_bcache fsdp_bcache_t;

/* Policy of one allocator (see the top of this file); all zero is the CUDA device's. */
typedef struct fsdp_bcache_opts {
    const char *name;         /* the memory's name in messages ("cuda", "cpu"); NULL: "device" */
    bool zeroed_segments;     /* the backend's new segments are all zero */
    bool bound_to_peak;       /* segments held stay within the peak of bytes allocated */
    size_t max_cached;        /* 0: no limit; else wholly free segments past this go back */
    unsigned bound_slack_pct; /* bound_to_peak with decommit: resident may exceed the peak by
                               * this percentage of it before free pages are given back */
    size_t bound_slack_min;   /* ... or by this many bytes, whichever is more */
    size_t large_split_min;   /* the least rest split off a large block; 0: more than 1 MiB */
} fsdp_bcache_opts_t;

/* Creates an allocator over `ops` (borrowed, must outlive it) with backend context ctx and the
 * policy `opts` (copied; NULL: all zero). */
int fsdp__bcache_create(const struct fsdp_bcache_ops *ops, void *ctx,
                        const fsdp_bcache_opts_t *opts, fsdp_bcache_t **out);
/* Gives every segment back and frees the allocator; NULL is accepted. Blocks still handed out
 * are freed with it (their pointers dangle). Pending events are destroyed without waiting. */
void fsdp__bcache_destroy(fsdp_bcache_t *a);

/* Allocates `bytes` (0 gives a block of 512) for use on `stream` (NULL is a stream too: the
 * backend's default). 0, FSDP_ENOMEM or a backend code; the message is in
 * fsdp__bcache_last_error(). */
int fsdp__bcache_malloc(fsdp_bcache_t *a, size_t bytes, void *stream, void **out);
/* The same, and *clean tells whether the block's first `bytes` bytes are all zero (only ever
 * true with `zeroed_segments`: memory of a new segment that no block handed out has covered). */
int fsdp__bcache_malloc_clean(fsdp_bcache_t *a, size_t bytes, void *stream, void **out,
                              bool *clean);
/* Frees a block (NULL accepted). FSDP_EINVAL when ptr is not a live block of this allocator;
 * a backend code when recording an event failed (the block is then kept pending until its
 * other events completed, or forever: it is never reused early). */
int fsdp__bcache_free(fsdp_bcache_t *a, void *ptr);
/* Notes that the block holding ptr is used by work on `stream`, so that its memory is not
 * reused before that work has completed (like torch's Tensor.record_stream). A stream equal to
 * the block's own is ignored. FSDP_EINVAL when ptr is not inside a live block. */
int fsdp__bcache_record_stream(fsdp_bcache_t *a, void *ptr, void *stream);
/* Moves blocks whose events have all completed to the free pools (also done by every malloc
 * and by empty_cache). Returns how many became free, or a negative backend code. */
int fsdp__bcache_process_events(fsdp_bcache_t *a);
/* Gives back every segment that is wholly free. Returns the bytes released. */
size_t fsdp__bcache_empty_cache(fsdp_bcache_t *a);

void fsdp__bcache_get_stats(const fsdp_bcache_t *a, fsdp_bcache_stats_t *out);
/* Sets the peaks to the current values. */
void fsdp__bcache_reset_peaks(fsdp_bcache_t *a);
/* Size of the block holding ptr (rounded), 0 when ptr is not a live block. */
size_t fsdp__bcache_block_size(const fsdp_bcache_t *a, const void *ptr);
/* The message of the last failure ("" if none). */
const char *fsdp__bcache_last_error(const fsdp_bcache_t *a);

#ifdef __cplusplus
}
#endif

#endif /* FSDP_BLOCK_CACHE_H */
