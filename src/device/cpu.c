/* SPDX-License-Identifier: MIT */
/*
 * cpu.c: the CPU device's memory, copies, streams and events, its thread count, and its vtable.
 *
 * CPU memory is host memory, 64-byte aligned (so vector loads of a row never split a cache line
 * at its start): small blocks from posix_memalign, large ones from mmap through a cache (below).
 * Every CPU call has finished when it returns, so streams and events are placeholders: creating
 * one gives a non-NULL handle, and waiting on it returns at once.
 *
 * Threads: the CPU's only internal parallelism is BLAS. OpenBLAS keeps one thread count for the
 * whole process, so all CPU devices of a process share it and the last device created sets it.
 * The default for N ranks in one process (the sim backend's threads) is cores / N per device;
 * every rank computes the same value, so the shared setting is the one each rank wants and N
 * ranks running matrix products at once do not oversubscribe the cores.
 */
/* MAP_ANONYMOUS is not in POSIX 2008; glibc shows it with _DEFAULT_SOURCE. */
#define _DEFAULT_SOURCE

#include <config.h>

#include <errno.h>
#include <stdint.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/copy.h"
#include "core/cpus.h"
#include "core/sanitizer.h"
#include "device/cpu_impl.h"

#if defined(FSDP_HAVE_BLAS) && defined(__GNUC__)
/* Weak, so that a CBLAS other than OpenBLAS (without this function) still links: the address is
 * then NULL and the thread count is left to that library. */
extern void openblas_set_num_threads(int num_threads) __attribute__((weak));
#define HAVE_SET_THREADS 1

/* The one piece of mutable process state here, mirroring OpenBLAS's own: the ranks of a sim run
 * create their devices at the same moment, and OpenBLAS may resize its thread pool on the call,
 * so calls are serialized and a value already set is not set again. */
static pthread_mutex_t blas_threads_mu = PTHREAD_MUTEX_INITIALIZER;
static int blas_threads_set; /* 0: never set by libfsdp */

static void set_blas_threads(int n) {
    if (!openblas_set_num_threads) return;
    pthread_mutex_lock(&blas_threads_mu);
    if (blas_threads_set != n) {
        openblas_set_num_threads(n);
        blas_threads_set = n;
    }
    pthread_mutex_unlock(&blas_threads_mu);
}

/*
 * OpenBLAS picks its kernels from CPUID at load time; a version older than the CPU (0.3.21 on
 * Sapphire Rapids, for one) falls back to its generic "Prescott" SSE3 kernels, which run matrix
 * products 3 to 4 times slower than the AVX2/AVX-512 ones the CPU supports. The choice can only
 * be overridden before the library loads (OPENBLAS_CORETYPE), so libfsdp says so, once per
 * process, instead of training slowly without a word.
 */
extern char *openblas_get_corename(void) __attribute__((weak));
static pthread_once_t blas_core_once = PTHREAD_ONCE_INIT;

static void check_blas_core(void) {
    if (!openblas_get_corename || getenv("OPENBLAS_CORETYPE")) return;
    const char *core = openblas_get_corename();
    if (!core || strcmp(core, "Prescott") != 0) return;
    __builtin_cpu_init();
    const char *better = __builtin_cpu_supports("avx512f") ? "SkylakeX"
                         : __builtin_cpu_supports("avx2")  ? "Haswell"
                                                           : NULL;
    if (better)
        fsdp_log(NULL, FSDP_LOG_WARN,
                 "OpenBLAS chose its generic '%s' kernels on a CPU with %s: matrix products run "
                 "several times slower than they could; set OPENBLAS_CORETYPE=%s in the "
                 "environment before starting the program",
                 core, strcmp(better, "SkylakeX") == 0 ? "AVX-512" : "AVX2", better);
}
#endif

/* Placeholder handles: their addresses are the handles, their contents are never touched. */
static char cpu_stream_tag;
static char cpu_event_tag;

int fsdp__cpu_default_threads(int world_size) {
    const char *env = getenv("FSDP_NUM_THREADS");
    if (env && *env) {
        char *end = NULL;
        errno = 0;
        long v = strtol(env, &end, 10);
        if (errno == 0 && end != env && *end == '\0' && v > 0 && v <= 4096) return (int)v;
    }
    long cores = fsdp__cpu_count();
    if (world_size < 1) world_size = 1;
    long per_rank = cores / world_size;
    return per_rank > 1 ? (int)per_rank : 1;
}

/*
 * Memory and its cache. A training step allocates and frees the same activation sizes every
 * step; handing each back to the system returns the pages to the kernel, and the next step pays
 * for mapping them again: a fault per 4 KiB page and the kernel clearing it, and on a virtual
 * machine whose hypervisor shadows the guest's page tables, more faults that the guest counts
 * as its own user time. So CPU memory comes from the block cache the CUDA device uses too
 * (block_cache.h): segments from mmap, blocks carved out of them by best fit and merged again
 * when freed, so what the backward freed as gradient sizes serves the next forward's
 * activations. FSDP_CPU_CACHE_MB (default 512, 0 disables) bounds the bytes held and not
 * allocated. Under AddressSanitizer the cache is off, so use-after-free stays detectable; with
 * it off, blocks come from posix_memalign.
 *
 * The cache keeps the device's resident memory near the most it has needed (`bound_to_peak`):
 * when a block whose pages were never touched (or were given back) is handed out and the
 * segments' resident bytes would pass the peak of bytes allocated by more than SLACK_PCT, it
 * gives back wholly free segments, then the pages of the largest free blocks (MADV_DONTNEED;
 * the blocks stay carved and fault in again when used). Without the bound, segments freed in one
 * phase of a step stay resident while the next phase maps others. Without the slack, the few
 * percent of the peak that the step's mix of sizes leaves fragmented are given back and faulted
 * in again every step (in bench_gpt_gloo's model: 12% of the peak, 70 MiB a step with 6% slack,
 * none once the warm-up is over with 12%). Activation checkpointing lowers the peak and
 * fragments more, and needs 25% (docs/design.md, "The slack"); the slack is also at least
 * SLACK_MIN, a few small-pool segments, which a small model's percentage would not reach.
 * Where even that leaves a step just over the bound, the cache learns the difference (memory
 * given back and needed again widens the slack, at most to twice SLACK_PCT; block_cache.c).
 *
 * New segments are zero, and the cache says which blocks are still untouched (or were given
 * back), so fsdp__cpu_alloc_zeroed clears only memory that was used before.
 *
 * Accounting in device.c counts what tensors hold, not what the cache keeps, like PyTorch's
 * allocated vs. reserved.
 */
#if FSDP_UNDER_ASAN
#define CACHE_DEFAULT_MB 0
#else
#define CACHE_DEFAULT_MB 512
#endif

#if !defined(MAP_ANONYMOUS) && defined(MAP_ANON)
#define MAP_ANONYMOUS MAP_ANON
#endif

/* The least rest split off a large block: a CPU has no allocation granularity to respect, and
 * a tail kept unsplit is memory nobody else can use until the block is freed. */
#define SPLIT_MIN ((size_t)64 << 10)
/* How far above the peak of bytes allocated the cache's resident memory may go (see above). */
#define SLACK_PCT 25u
#define SLACK_MIN ((size_t)16 << 20)

static size_t cache_limit_from_env(void) {
    const char *env = getenv("FSDP_CPU_CACHE_MB");
    if (env && *env) {
        char *end = NULL;
        errno = 0;
        long v = strtol(env, &end, 10);
        if (errno == 0 && end != env && *end == '\0' && v >= 0 && v <= (1L << 20))
            return (size_t)v << 20;
    }
    return (size_t)CACHE_DEFAULT_MB << 20;
}

/* The block cache's segments: anonymous mappings, zero, their pages faulted in when touched. */
static int seg_map(void *ctx, size_t bytes, void **out) {
    (void)ctx;
    *out = NULL;
#ifdef MAP_ANONYMOUS
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return FSDP_ENOMEM;
    *out = p;
    return FSDP_OK;
#else
    /* Without anonymous mappings, zeroed heap memory keeps the cache's zero-segment promise. */
    return (*out = calloc(1, bytes)) ? FSDP_OK : FSDP_ENOMEM;
#endif
}

static void seg_unmap(void *ctx, void *p, size_t bytes) {
    (void)ctx;
#ifdef MAP_ANONYMOUS
    munmap(p, bytes);
#else
    (void)bytes;
    free(p);
#endif
}

/* Gives back the whole pages inside [p, p + bytes) (a private anonymous mapping reads as zero
 * after MADV_DONTNEED) and clears the partial pages at its ends. */
static void seg_decommit(void *ctx, void *p, size_t bytes) {
    size_t page = *(const size_t *)ctx;
    uintptr_t lo = (uintptr_t)p, hi = lo + bytes;
    uintptr_t in_lo = (lo + page - 1) / page * page, in_hi = hi / page * page;
#if defined(MAP_ANONYMOUS) && defined(MADV_DONTNEED)
    if (in_lo < in_hi && madvise((void *)in_lo, in_hi - in_lo, MADV_DONTNEED) == 0) {
        memset(p, 0, in_lo - lo);
        memset((void *)in_hi, 0, hi - in_hi);
        return;
    }
#else
    (void)in_lo, (void)in_hi;
#endif
    memset(p, 0, bytes);
}

static const struct fsdp_bcache_ops cpu_seg_ops = {
    .seg_alloc = seg_map, .seg_free = seg_unmap, .decommit = seg_decommit};
static size_t page_size;
static pthread_once_t page_size_once = PTHREAD_ONCE_INIT;
static void read_page_size(void) {
    long v = sysconf(_SC_PAGESIZE);
    page_size = v > 0 ? (size_t)v : 4096;
}

int fsdp__cpu_init(fsdp_device_t *dev) {
    if (dev->num_threads <= 0)
        dev->num_threads = fsdp__cpu_default_threads(dev->ctx ? dev->ctx->world_size : 1);
#ifdef HAVE_SET_THREADS
    set_blas_threads(dev->num_threads);
    pthread_once(&blas_core_once, check_blas_core);
#endif
    size_t limit = cache_limit_from_env();
    dev->impl = NULL;
    dev->attn_fused = FSDP__DT_BIT(FSDP_DTYPE_F32); /* cpu_attention.c */
    if (limit > 0) {
        const fsdp_bcache_opts_t opts = {.name = "cpu",
                                         .zeroed_segments = true,
                                         .bound_to_peak = true,
                                         .max_cached = limit,
                                         .bound_slack_pct = SLACK_PCT,
                                         .bound_slack_min = SLACK_MIN,
                                         .large_split_min = SPLIT_MIN};
        pthread_once(&page_size_once, read_page_size);
        fsdp_bcache_t *cache = NULL;
        if (fsdp__bcache_create(&cpu_seg_ops, &page_size, &opts, &cache) < 0) return FSDP_ENOMEM;
        dev->impl = cache;
    }
    return FSDP_OK;
}

void fsdp__cpu_fini(fsdp_device_t *dev) {
    /* The BLAS thread count is process state other devices may rely on; it is left as it is. */
    fsdp__bcache_destroy(dev->impl);
    dev->impl = NULL;
}

/* A block of `bytes`, 64-byte aligned (the cache's are 512-byte aligned); *clean when it is
 * known to be zero. */
static int cpu_block(fsdp_device_t *dev, size_t bytes, void **out, bool *clean) {
    fsdp_bcache_t *cache = dev->impl;
    *clean = false;
    if (cache) {
        int rc = fsdp__bcache_malloc_clean(cache, bytes, NULL, out, clean);
        if (rc < 0 && rc != FSDP_ENOMEM)
            fsdp_log(dev->ctx, FSDP_LOG_WARN, "%s", fsdp__bcache_last_error(cache));
        return rc < 0 ? FSDP_ENOMEM : FSDP_OK;
    }
    if (posix_memalign(out, 64, bytes ? bytes : 1) != 0) {
        *out = NULL;
        return FSDP_ENOMEM;
    }
    return FSDP_OK;
}

int fsdp__cpu_alloc(fsdp_device_t *dev, size_t bytes, void **out) {
    bool clean;
    return cpu_block(dev, bytes, out, &clean);
}

#if defined(MAP_ANONYMOUS) && defined(__linux__) && !defined(MADV_POPULATE_WRITE)
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

/* Makes the whole pages of a clean block resident and writable, zero, in one call. An untouched
 * page that is read first (a GEMM accumulating into a zeroed gradient, beta = 1) is mapped to
 * the shared zero page, and the write after it copies that page and flushes its old mapping
 * from every core the process runs on: with the ranks of a sim world as threads of one
 * process, those flushes (inter-processor interrupts) cost more than the faults. Populated
 * first, the pages are written in place. Where the kernel lacks it, the pages fault as before. */
static void populate(void *p, size_t bytes) {
#if defined(MADV_POPULATE_WRITE)
    const size_t page = page_size ? page_size : 4096;
    uintptr_t lo = ((uintptr_t)p + page - 1) / page * page,
              hi = ((uintptr_t)p + bytes) / page * page;
    if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_POPULATE_WRITE);
#endif
    (void)p, (void)bytes;
}

/* Zeroed memory: only blocks the cache cannot vouch for are cleared here, so callers that would
 * zero a new buffer themselves (the GEMM's beta = 0 pass, a gradient about to be scattered into)
 * skip that pass for every block of a new segment; the clean block's pages are populated
 * writable instead (populate). */
int fsdp__cpu_alloc_zeroed(fsdp_device_t *dev, size_t bytes, void **out) {
    bool clean;
    int rc = cpu_block(dev, bytes, out, &clean);
    if (rc == FSDP_OK && bytes > 0) {
        if (!clean)
            memset(*out, 0, bytes);
        else
            populate(*out, bytes);
    }
    return rc;
}

bool fsdp__cpu_cache_stats(const fsdp_device_t *dev, fsdp_bcache_stats_t *out) {
    memset(out, 0, sizeof *out);
    if (!dev->impl) return false;
    fsdp__bcache_get_stats(dev->impl, out);
    return true;
}

void fsdp__cpu_free(fsdp_device_t *dev, void *ptr) {
    if (!ptr) return;
    fsdp_bcache_t *cache = dev->impl;
    if (!cache) {
        free(ptr);
        return;
    }
    if (fsdp__bcache_free(cache, ptr) < 0)
        fsdp_log(dev->ctx, FSDP_LOG_WARN, "%s", fsdp__bcache_last_error(cache));
}

int fsdp__cpu_memcpy(fsdp_device_t *dev, void *dst, const void *src, size_t n,
                     fsdp_copy_kind_t kind, void *stream) {
    (void)dev, (void)kind, (void)stream;
    /* dst == src is allowed by the front end and is a no-op (fsdp__copy_large skips it). A
     * copy of a megabyte or more writes around the cache (core/copy.h): the sim backend's
     * collectives and the tensor layer's large copies go through here. */
    fsdp__copy_large(dst, src, n);
    return FSDP_OK;
}

int fsdp__cpu_memset(fsdp_device_t *dev, void *dst, int byte, size_t n, void *stream) {
    (void)dev, (void)stream;
    if (n > 0) memset(dst, byte, n);
    return FSDP_OK;
}

int fsdp__cpu_stream_create(fsdp_device_t *dev, void **out) {
    (void)dev;
    *out = &cpu_stream_tag;
    return FSDP_OK;
}

void fsdp__cpu_stream_destroy(fsdp_device_t *dev, void *stream) {
    (void)dev, (void)stream;
}

int fsdp__cpu_stream_sync(fsdp_device_t *dev, void *stream) {
    (void)dev, (void)stream;
    return FSDP_OK;
}

int fsdp__cpu_event_create(fsdp_device_t *dev, void **out) {
    (void)dev;
    *out = &cpu_event_tag;
    return FSDP_OK;
}

void fsdp__cpu_event_destroy(fsdp_device_t *dev, void *ev) {
    (void)dev, (void)ev;
}

int fsdp__cpu_event_record(fsdp_device_t *dev, void *ev, void *stream) {
    (void)dev, (void)ev, (void)stream;
    return FSDP_OK;
}

int fsdp__cpu_event_wait(fsdp_device_t *dev, void *ev, void *stream) {
    (void)dev, (void)ev, (void)stream;
    return FSDP_OK;
}

int fsdp__cpu_event_sync(fsdp_device_t *dev, void *ev) {
    (void)dev, (void)ev;
    return FSDP_OK;
}

const struct fsdp_dev_ops fsdp__cpu_dev_ops = {
    .name = "cpu",
    .kind = FSDP_DEVICE_CPU,

    .alloc = fsdp__cpu_alloc,
    .alloc_zeroed = fsdp__cpu_alloc_zeroed,
    .free = fsdp__cpu_free,
    .memcpy = fsdp__cpu_memcpy,
    .memset = fsdp__cpu_memset,
    .stream_create = fsdp__cpu_stream_create,
    .stream_destroy = fsdp__cpu_stream_destroy,
    .stream_sync = fsdp__cpu_stream_sync,
    .event_create = fsdp__cpu_event_create,
    .event_destroy = fsdp__cpu_event_destroy,
    .event_record = fsdp__cpu_event_record,
    .event_wait = fsdp__cpu_event_wait,
    .event_sync = fsdp__cpu_event_sync,
    .init = fsdp__cpu_init,
    .fini = fsdp__cpu_fini,

    .fill = fsdp__cpu_fill,
    .cast = fsdp__cpu_cast,
    .copy_strided = fsdp__cpu_copy_strided,
    .unary = fsdp__cpu_unary,
    .unary_backward = fsdp__cpu_unary_backward,
    .binary = fsdp__cpu_binary,
    .axpy = fsdp__cpu_axpy,
    .where = fsdp__cpu_where,

    .reduce_sum = fsdp__cpu_reduce_sum,
    .reduce_max = fsdp__cpu_reduce_max,
    .sum_squares = fsdp__cpu_sum_squares,
    .coll_reduce = fsdp__cpu_coll_reduce,

    .gemm = fsdp__cpu_gemm,

    .softmax = fsdp__cpu_softmax,
    .softmax_backward = fsdp__cpu_softmax_backward,
    .attention = fsdp__cpu_attention,
    .attention_backward = fsdp__cpu_attention_backward,
    .layer_norm = fsdp__cpu_layer_norm,
    .layer_norm_backward = fsdp__cpu_layer_norm_backward,
    .batch_norm = fsdp__cpu_batch_norm,
    .batch_norm_backward = fsdp__cpu_batch_norm_backward,
    .embedding = fsdp__cpu_embedding,
    .embedding_backward = fsdp__cpu_embedding_backward,
    .cross_entropy = fsdp__cpu_cross_entropy,
    .cross_entropy_backward = fsdp__cpu_cross_entropy_backward,
    .dropout = fsdp__cpu_dropout,
    .sgd_step = fsdp__cpu_sgd_step,
    .adam_step = fsdp__cpu_adam_step,
};
