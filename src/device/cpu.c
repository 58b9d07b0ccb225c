/*
 * cpu.c: the CPU device's memory, copies, streams and events, its thread count, and its vtable.
 *
 * CPU memory is host memory from posix_memalign (64-byte aligned, so vector loads of a row never
 * split a cache line at its start). Every CPU call has finished when it returns, so streams and
 * events are placeholders: creating one gives a non-NULL handle, and waiting on it returns at
 * once.
 *
 * Threads: the CPU's only internal parallelism is BLAS. OpenBLAS keeps one thread count for the
 * whole process, so all CPU devices of a process share it and the last device created sets it.
 * The default for N ranks in one process (the sim backend's threads) is cores / N per device;
 * every rank computes the same value, so the shared setting is the one each rank wants and N
 * ranks running matrix products at once do not oversubscribe the cores.
 */
#include <config.h>

#include <errno.h>
#include <stdint.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
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
 * A cache of freed large blocks. A training step allocates and frees the same activation sizes
 * every step; handing each back to the C library returns the pages to the kernel, and the next
 * step pays a page fault per 4 KiB again (about a tenth of a GPT step on this machine). Freed
 * blocks of at least CACHE_MIN bytes are kept per device, up to FSDP_CPU_CACHE_MB (default 512,
 * 0 disables), and reused for an allocation of the same rounded size. Accounting in device.c
 * counts what tensors hold, not what the cache keeps, like PyTorch's allocated vs. reserved.
 * Under AddressSanitizer the cache is off, so use-after-free stays detectable.
 *
 * Every block carries a 64-byte header with its rounded size, so free() knows where it goes.
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

struct cpu_cache {
    size_t limit;           /* bytes the cache may hold */
    size_t held;            /* bytes it holds */
    size_t n;               /* blocks in use of the slots */
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

static void cache_drain(struct cpu_cache *c) {
    for (size_t i = 0; i < c->n; i++) free(c->block[i]);
    c->n = 0;
    c->held = 0;
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

int fsdp__cpu_alloc(fsdp_device_t *dev, size_t bytes, void **out) {
    struct cpu_cache *c = dev->impl;
    size_t want = bytes < CACHE_MIN ? bytes : (bytes + CACHE_ROUND - 1) / CACHE_ROUND * CACHE_ROUND;
    *out = NULL;
    if (c && want >= CACHE_MIN) {
        /* Newest first: the block freed last is the likeliest to be warm in cache. */
        for (size_t i = c->n; i-- > 0;) {
            if (c->size[i] != want) continue;
            char *b = c->block[i];
            c->held -= want;
            c->n--;
            c->block[i] = c->block[c->n];
            c->size[i] = c->size[c->n];
            *out = b + HEADER;
            return FSDP_OK;
        }
    }
    void *p = NULL;
    if (want > SIZE_MAX - HEADER || posix_memalign(&p, 64, HEADER + (want ? want : 1)) != 0)
        return FSDP_ENOMEM;
    memcpy(p, &want, sizeof want);
    *out = (char *)p + HEADER;
    return FSDP_OK;
}

void fsdp__cpu_free(fsdp_device_t *dev, void *ptr) {
    if (!ptr) return;
    struct cpu_cache *c = dev->impl;
    char *b = (char *)ptr - HEADER;
    size_t size;
    memcpy(&size, b, sizeof size);
    if (c && size >= CACHE_MIN && size <= c->limit) {
        /* Make room: evict the oldest blocks until this one fits. */
        while (c->n > 0 && (c->n == CACHE_SLOTS || c->held + size > c->limit)) {
            free(c->block[0]);
            c->held -= c->size[0];
            c->n--;
            memmove(c->block, c->block + 1, c->n * sizeof *c->block);
            memmove(c->size, c->size + 1, c->n * sizeof *c->size);
        }
        c->block[c->n] = b;
        c->size[c->n++] = size;
        c->held += size;
        return;
    }
    free(b);
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
