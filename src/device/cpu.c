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

int fsdp__cpu_init(fsdp_device_t *dev) {
    if (dev->num_threads <= 0)
        dev->num_threads = fsdp__cpu_default_threads(dev->ctx ? dev->ctx->world_size : 1);
#ifdef HAVE_SET_THREADS
    set_blas_threads(dev->num_threads);
#endif
    return FSDP_OK;
}

void fsdp__cpu_fini(fsdp_device_t *dev) {
    /* The BLAS thread count is process state other devices may rely on; it is left as it is. */
    (void)dev;
}

int fsdp__cpu_alloc(fsdp_device_t *dev, size_t bytes, void **out) {
    void *p = NULL;
    /* posix_memalign(0) may return NULL; one byte gives the unique pointer device.h promises. */
    if (posix_memalign(&p, 64, bytes ? bytes : 1) != 0) p = NULL;
    *out = p;
    return p ? FSDP_OK : FSDP_ENOMEM;
}

void fsdp__cpu_free(fsdp_device_t *dev, void *ptr) {
    (void)dev;
    free(ptr);
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
