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
    const char *better = __builtin_cpu_supports("avx512f")  ? "SkylakeX"
                         : __builtin_cpu_supports("avx2") ? "Haswell"
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
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (cores < 1) cores = 1;
    if (world_size < 1) world_size = 1;
    long per_rank = cores / world_size;
    return per_rank > 1 ? (int)per_rank : 1;
}

/*
 * Large blocks and their cache. A training step allocates and frees the same activation sizes
 * every step; handing each back to the system returns the pages to the kernel, and the next step
 * pays a page fault per 4 KiB again (about a tenth of a GPT step on this machine). So freed
 * blocks of at least CACHE_MIN bytes are kept per device, up to FSDP_CPU_CACHE_MB (default 512,
 * 0 disables), and reused for an allocation of the same rounded size. Accounting in device.c
 * counts what tensors hold, not what the cache keeps, like PyTorch's allocated vs. reserved.
 * Under AddressSanitizer the cache is off, so use-after-free stays detectable.
 *
 * The cache never makes the device's footprint larger than the most it has needed: live large
 * blocks plus cached ones stay within `live_peak`, the most bytes of large blocks live at once.
 * Without that bound, blocks freed in one phase of a step (the backward's gradients) sit in the
 * cache while the next phase allocates other sizes (the forward's activations), and the
 * process's peak resident memory grows by what the cache holds at the peak (180 MiB of 545 per
 * rank in bench_gpt_gloo's default model). The price is that at the peak the cache is empty, so
 * a step maps again what it needs after the peak and did not free after it (up to 300 MiB per
 * step and rank there; 2-4% of the step time).
 *
 * So a miss, in order: takes a cached block of at most twice the size and gives its tail back
 * (munmap of the pages past the new size; the pages kept were touched already); else evicts the
 * oldest cached blocks until the new block fits under the bound, and maps a new one.
 *
 * With the cache on, large blocks come from mmap and go back with munmap, so an evicted block
 * leaves the process at once. From malloc they would not: glibc serves freed sizes below its
 * (rising) mmap threshold from its heap afterwards, where freed blocks between live ones stay
 * resident (another 70 MiB per rank in that benchmark). New mappings are populated in the mmap
 * call (MAP_POPULATE, where the system has it): one system call instead of a fault per page,
 * which takes a third off the kernel time a step spends getting memory; every byte of a tensor
 * is written soon after it is allocated anyway.
 *
 * Every block carries a 64-byte header with its rounded size and whether it is mapped, so free()
 * knows where it goes.
 */
#define CACHE_MIN ((size_t)64 << 10)
#define CACHE_ROUND ((size_t)4 << 10)
#define CACHE_SLOTS 512
#define HEADER 64

#if defined(__SANITIZE_ADDRESS__)
#define CACHE_DEFAULT_MB 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CACHE_DEFAULT_MB 0
#endif
#endif
#ifndef CACHE_DEFAULT_MB
#define CACHE_DEFAULT_MB 512
#endif

#if !defined(MAP_ANONYMOUS) && defined(MAP_ANON)
#define MAP_ANONYMOUS MAP_ANON
#endif
#ifndef MAP_POPULATE
#define MAP_POPULATE 0
#endif

struct block_header {
    size_t size; /* bytes after the header, rounded to CACHE_ROUND for large blocks */
    int mapped;  /* 1: mmap'd (HEADER + size bytes), 0: posix_memalign */
};

struct cpu_cache {
    size_t limit;     /* bytes the cache may hold; 0: no cache, large blocks are malloc'd */
    size_t page;      /* the system's page size */
    size_t held;      /* bytes it holds */
    size_t live;      /* bytes of large blocks handed out and not freed */
    size_t live_peak; /* the most `live` has been */
    size_t n;         /* blocks in use of the slots, oldest first */
    void *block[CACHE_SLOTS];
    size_t size[CACHE_SLOTS];
};

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

static struct block_header block_header_of(const void *b) {
    struct block_header h;
    memcpy(&h, b, sizeof h);
    return h;
}

/* Gives block b (header included) back to the system. */
static void block_release(void *b) {
#ifdef MAP_ANONYMOUS
    struct block_header h = block_header_of(b);
    if (h.mapped) {
        munmap(b, HEADER + h.size);
        return;
    }
#endif
    free(b);
}

/* A new block of HEADER + want bytes, 64-byte aligned; mapped (and populated) when map is true
 * and the system has anonymous mappings. NULL when out of memory. */
static void *block_new(size_t want, bool map) {
    struct block_header h = {want, 0};
    void *p = NULL;
    if (want > SIZE_MAX - HEADER) return NULL;
#ifdef MAP_ANONYMOUS
    if (map) {
        p = mmap(NULL, HEADER + want, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        if (p == MAP_FAILED) return NULL;
        h.mapped = 1;
    }
#else
    (void)map;
#endif
    if (!p && posix_memalign(&p, 64, HEADER + (want ? want : 1)) != 0) return NULL;
    memcpy(p, &h, sizeof h);
    return p;
}

/* Removes slot i from the cache and returns its block; keeps the others in age order. */
static char *cache_take(struct cpu_cache *c, size_t i) {
    char *b = c->block[i];
    c->held -= c->size[i];
    c->n--;
    memmove(c->block + i, c->block + i + 1, (c->n - i) * sizeof *c->block);
    memmove(c->size + i, c->size + i + 1, (c->n - i) * sizeof *c->size);
    return b;
}

static void cache_drain(struct cpu_cache *c) {
    for (size_t i = 0; i < c->n; i++)
        block_release(c->block[i]);
    c->n = 0;
    c->held = 0;
}

/* A large block of want bytes (a multiple of CACHE_ROUND): from the cache when it can. *fresh
 * tells whether it is a new mapping, whose pages the system has zeroed and nobody has written. */
static char *large_alloc(struct cpu_cache *c, size_t want, bool *fresh) {
    char *b = NULL;
    *fresh = false;
    size_t fit = SIZE_MAX;
    /* Newest first: the block freed last is the likeliest to be warm in cache. */
    for (size_t i = c->n; i-- > 0 && !b;) {
        if (c->size[i] == want)
            b = cache_take(c, i);
        else if (c->size[i] > want && c->size[i] / 2 <= want &&
                 (fit == SIZE_MAX || c->size[i] < c->size[fit]) &&
                 block_header_of(c->block[i]).mapped)
            fit = i;
    }
    if (!b && fit != SIZE_MAX) {
        /* Shrink the closest larger block: its pages past the new size go back. */
        size_t old_len = (HEADER + c->size[fit] + c->page - 1) / c->page * c->page;
        size_t new_len = (HEADER + want + c->page - 1) / c->page * c->page;
        b = cache_take(c, fit);
        if (new_len < old_len) munmap(b + new_len, old_len - new_len);
        struct block_header h = {want, 1};
        memcpy(b, &h, sizeof h);
    }
    if (!b) {
        /* Keep live + held within the live peak this allocation makes. */
        size_t live = c->live + want;
        size_t peak = live > c->live_peak ? live : c->live_peak;
        while (c->n > 0 && live + c->held > peak)
            block_release(cache_take(c, 0));
        if (!(b = block_new(want, true))) return NULL;
        *fresh = block_header_of(b).mapped != 0;
    }
    c->live += want;
    if (c->live > c->live_peak) c->live_peak = c->live;
    return b;
}

int fsdp__cpu_init(fsdp_device_t *dev) {
    if (dev->num_threads <= 0)
        dev->num_threads = fsdp__cpu_default_threads(dev->ctx ? dev->ctx->world_size : 1);
#ifdef HAVE_SET_THREADS
    set_blas_threads(dev->num_threads);
    pthread_once(&blas_core_once, check_blas_core);
#endif
    struct cpu_cache *c = calloc(1, sizeof *c);
    if (!c) return FSDP_ENOMEM;
    c->limit = cache_limit_from_env();
    long page = sysconf(_SC_PAGESIZE);
    c->page = page > 0 ? (size_t)page : 4096;
    dev->impl = c;
    return FSDP_OK;
}

void fsdp__cpu_fini(fsdp_device_t *dev) {
    /* The BLAS thread count is process state other devices may rely on; it is left as it is. */
    struct cpu_cache *c = dev->impl;
    if (c) {
        cache_drain(c);
        free(c);
        dev->impl = NULL;
    }
}

/* A block for `bytes`; *fresh as in large_alloc (false for blocks from the heap or the cache). */
static char *cpu_block(fsdp_device_t *dev, size_t bytes, bool *fresh) {
    struct cpu_cache *c = dev->impl;
    size_t want = bytes < CACHE_MIN ? bytes : (bytes + CACHE_ROUND - 1) / CACHE_ROUND * CACHE_ROUND;
    *fresh = false;
    return c && c->limit > 0 && want >= CACHE_MIN ? large_alloc(c, want, fresh)
                                                  : block_new(want, false);
}

int fsdp__cpu_alloc(fsdp_device_t *dev, size_t bytes, void **out) {
    bool fresh;
    char *b = cpu_block(dev, bytes, &fresh);
    *out = b ? b + HEADER : NULL;
    return b ? FSDP_OK : FSDP_ENOMEM;
}

/* Zeroed memory. A new mapping is zero already (the kernel cleared its pages when MAP_POPULATE
 * touched them, or will on first touch), so only blocks from the heap or the cache are cleared
 * here: callers that would zero a new buffer themselves (the GEMM's beta = 0 pass, a gradient
 * about to be scattered into) skip that pass for every block the cache could not provide. */
int fsdp__cpu_alloc_zeroed(fsdp_device_t *dev, size_t bytes, void **out) {
    bool fresh;
    char *b = cpu_block(dev, bytes, &fresh);
    *out = b ? b + HEADER : NULL;
    if (!b) return FSDP_ENOMEM;
    if (!fresh && bytes > 0) memset(b + HEADER, 0, bytes);
    return FSDP_OK;
}

void fsdp__cpu_cache_bytes(const fsdp_device_t *dev, size_t *held, size_t *live,
                           size_t *live_peak) {
    const struct cpu_cache *c = dev->impl;
    bool on = c && c->limit > 0;
    *held = on ? c->held : 0;
    *live = on ? c->live : 0;
    *live_peak = on ? c->live_peak : 0;
}

void fsdp__cpu_free(fsdp_device_t *dev, void *ptr) {
    if (!ptr) return;
    struct cpu_cache *c = dev->impl;
    char *b = (char *)ptr - HEADER;
    size_t size = block_header_of(b).size;
    if (c && c->limit > 0 && size >= CACHE_MIN) {
        c->live -= size;
        if (size <= c->limit) {
            /* Make room: evict the oldest blocks until this one fits. */
            while (c->n > 0 && (c->n == CACHE_SLOTS || c->held + size > c->limit))
                block_release(cache_take(c, 0));
            c->block[c->n] = b;
            c->size[c->n++] = size;
            c->held += size;
            return;
        }
    }
    block_release(b);
}

int fsdp__cpu_memcpy(fsdp_device_t *dev, void *dst, const void *src, size_t n,
                     fsdp_copy_kind_t kind, void *stream) {
    (void)dev, (void)kind, (void)stream;
    /* dst == src is allowed by the front end and is a no-op; memcpy would be undefined. */
    if (dst != src && n > 0) memcpy(dst, src, n);
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
