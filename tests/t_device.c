/* SPDX-License-Identifier: MIT */
/*
 * t_device.c: the device front end (creation, the context's default device, accounted memory,
 * argument checks, streams and events, copies) and the CPU device's thread count. The CPU
 * device's general kernels are t_device_kernels.c, its memory cache t_device_cache.c.
 */
#include <config.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <fsdp.h>

#include "device/cpu_impl.h"
#include "device/device_impl.h"
#include "device_util.h"
#include "tap.h"

#if defined(FSDP_HAVE_BLAS) && defined(__GNUC__)
/* Weak, as in cpu.c: NULL with a CBLAS other than OpenBLAS. */
extern int openblas_get_num_threads(void) __attribute__((weak));
#define HAVE_GET_THREADS 1
#endif

/* ---- helpers ---- */

typedef struct {
    int count;
    fsdp_log_level_t level;
    char last[1024];
} captured_t;

static void capture(void *user, int rank, fsdp_log_level_t level, const char *msg) {
    captured_t *c = user;
    (void)rank;
    c->count++;
    c->level = level;
    snprintf(c->last, sizeof c->last, "%s", msg);
}

/* ---- creation and the context's device ---- */

static void test_create(void) {
    fsdp_ctx_t *ctx = new_ctx(0, 1);
    fsdp_device_t *dev = NULL;
    tap_is_int(fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &dev), FSDP_OK,
               "a CPU device is created with default options");
    tap_ok(dev != NULL, "the device handle is set");
    tap_is_int(fsdp_device_kind(dev), FSDP_DEVICE_CPU, "its kind is CPU");
    tap_is_str(fsdp_device_name(dev), "cpu", "its name is \"cpu\"");
    tap_ok(fsdp_device_ctx(dev) == ctx, "it knows its context");
    tap_ok(fsdp_device_num_threads(dev) >= 1, "it uses at least one thread (%d)",
           fsdp_device_num_threads(dev));
    fsdp_device_destroy(dev);
    fsdp_device_destroy(NULL);

    fsdp_device_options_t o;
    fsdp_device_options_init(&o);
    tap_ok(o.num_threads == 0 && o.ordinal == 0, "options default to automatic threads, ordinal 0");
    o.num_threads = 3;
    tap_is_int(fsdp_device_create(ctx, FSDP_DEVICE_CPU, &o, &dev), FSDP_OK,
               "a CPU device with 3 threads");
    tap_is_int(fsdp_device_num_threads(dev), 3, "the requested thread count is kept");
    fsdp_device_destroy(dev);
    fsdp_ctx_destroy(ctx);
}

static void test_ctx_device(void) {
    fsdp_ctx_t *ctx = new_ctx(0, 1);
    fsdp_device_t *d1 = fsdp_ctx_device(ctx);
    tap_ok(d1 != NULL && fsdp_device_kind(d1) == FSDP_DEVICE_CPU,
           "the context's default device is a CPU device");
    tap_ok(fsdp_ctx_device(ctx) == d1, "the default device is created once");

    fsdp_device_t *d2 = NULL;
    fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &d2);
    tap_is_int(fsdp_ctx_set_device(ctx, d2), FSDP_OK, "another device of the context is set");
    tap_ok(fsdp_ctx_device(ctx) == d2, "it becomes the default");
    tap_is_int(fsdp_ctx_set_device(ctx, NULL), FSDP_OK, "NULL restores the CPU");
    tap_ok(fsdp_ctx_device(ctx) == d1, "the first CPU device is the default again");
    fsdp_ctx_set_device(ctx, d2);
    fsdp_device_destroy(d2);
    tap_ok(fsdp_ctx_device(ctx) == d1, "destroying the default device falls back to the CPU");

    fsdp_ctx_t *other = new_ctx(1, 2);
    fsdp_device_t *od = fsdp_ctx_device(other);
    tap_is_int(fsdp_ctx_set_device(ctx, od), FSDP_EINVAL, "a device of another context is refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "dev", "the message names dev");
    void *p = NULL;
    /* The context frees its own device, and with it this forgotten buffer, with a warning. */
    captured_t cap = {0};
    fsdp_ctx_set_log_sink(other, capture, &cap);
    fsdp_device_alloc(od, FSDP_MEM_OTHER, 100, &p);
    fsdp_ctx_destroy(other);
    tap_has_str(cap.last, "still has 1 allocations (100 bytes)",
                "destroying a context reclaims its device's forgotten memory");
    fsdp_ctx_destroy(ctx);
}

/* ---- memory ---- */

static void test_alloc(void) {
    fsdp_ctx_t *ctx = new_ctx(0, 1);
    fsdp_device_t *dev = fsdp_ctx_device(ctx);
    fsdp_mem_stats_t s0, s1, s2;
    fsdp_mem_get_stats(ctx, &s0);
    void *a = NULL, *b = NULL;
    tap_is_int(fsdp_device_alloc(dev, FSDP_MEM_PARAMS, 1000, &a), FSDP_OK, "alloc 1000 params");
    tap_is_int(fsdp_device_alloc(dev, FSDP_MEM_GRADS, 3000, &b), FSDP_OK, "alloc 3000 grads");
    tap_ok(((uintptr_t)a & 63) == 0 && ((uintptr_t)b & 63) == 0, "both are 64-byte aligned");
    fsdp_mem_get_stats(ctx, &s1);
    tap_is_size(s1.current[FSDP_MEM_PARAMS] - s0.current[FSDP_MEM_PARAMS], 1000,
                "params current rose by 1000");
    tap_is_size(s1.current[FSDP_MEM_GRADS] - s0.current[FSDP_MEM_GRADS], 3000,
                "grads current rose by 3000");
    tap_is_size(s1.peak[FSDP_MEM_GRADS], s0.current[FSDP_MEM_GRADS] + 3000, "grads peak too");
    memset(a, 1, 1000);
    memset(b, 2, 3000);
    fsdp_device_free(dev, a);
    fsdp_device_free(dev, b);
    fsdp_device_free(dev, NULL);
    fsdp_mem_get_stats(ctx, &s2);
    tap_is_size(s2.current[FSDP_MEM_PARAMS], s0.current[FSDP_MEM_PARAMS],
                "params current back down after free");
    tap_is_size(s2.current[FSDP_MEM_GRADS], s0.current[FSDP_MEM_GRADS],
                "grads current back down after free");
    tap_is_size(s2.peak[FSDP_MEM_PARAMS], s0.current[FSDP_MEM_PARAMS] + 1000,
                "params peak stays at 1000");

    /* Zero bytes: a valid, unique pointer. */
    void *z1 = NULL, *z2 = NULL;
    tap_is_int(fsdp_device_alloc(dev, FSDP_MEM_OTHER, 0, &z1), FSDP_OK, "alloc of 0 bytes");
    fsdp_device_alloc(dev, FSDP_MEM_OTHER, 0, &z2);
    tap_ok(z1 && z2 && z1 != z2, "zero-byte allocations are distinct non-NULL pointers");
    fsdp_device_free(dev, z1);
    fsdp_device_free(dev, z2);

    /* Many allocations freed in a scrambled order exercise the map's growth and deletion. */
    enum { N = 2000 };
    void **ps = calloc(N, sizeof *ps);
    size_t *sz = calloc(N, sizeof *sz);
    int ok = 1;
    for (int i = 0; i < N; i++) {
        sz[i] = (size_t)(i % 97) * 8 + 1;
        ok &= fsdp_device_alloc(dev, (fsdp_mem_cat_t)(i % FSDP_MEM_NCAT), sz[i], &ps[i]) == 0;
        memset(ps[i], i & 0xff, sz[i]);
    }
    fsdp_mem_get_stats(ctx, &s1);
    size_t want = s0.total_current;
    for (int i = 0; i < N; i++)
        want += sz[i];
    tap_ok(ok, "%d allocations succeed", N);
    tap_is_size(s1.total_current, want, "all %d are counted", N);
    int bytes_ok = 1;
    for (int i = 0; i < N; i++) {
        int j = (int)(((long)i * 7919) % N); /* 7919 is prime, so this permutes 0..N-1 */
        const unsigned char *q = ps[j];
        bytes_ok &= q[0] == (unsigned char)(j & 0xff) && q[sz[j] - 1] == (unsigned char)(j & 0xff);
        fsdp_device_free(dev, ps[j]);
    }
    fsdp_mem_get_stats(ctx, &s2);
    tap_ok(bytes_ok, "no allocation overlapped another");
    tap_is_size(s2.total_current, s0.total_current, "freeing all %d in another order balances", N);
    free(ps);
    free(sz);

    /* A pointer the device does not know is reported, not freed. */
    captured_t cap = {0};
    fsdp_ctx_set_log_sink(ctx, capture, &cap);
    int stack_thing = 0;
    fsdp_device_free(dev, &stack_thing);
    tap_has_str(cap.last, "not allocated", "freeing a foreign pointer logs an error");

    /* Destroying a device with live memory warns and gives the memory back. */
    fsdp_device_t *d2 = NULL;
    fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &d2);
    void *leak = NULL;
    fsdp_device_alloc(d2, FSDP_MEM_ACTIVATIONS, 4096, &leak);
    cap.count = 0;
    fsdp_device_destroy(d2);
    tap_ok(cap.count == 1 && cap.level == FSDP_LOG_WARN && strstr(cap.last, "1 allocations"),
           "destroy with a live allocation warns (%s)", cap.last);
    fsdp_mem_get_stats(ctx, &s2);
    tap_is_size(s2.current[FSDP_MEM_ACTIVATIONS], s0.current[FSDP_MEM_ACTIVATIONS],
                "and its bytes are no longer counted");
    fsdp_ctx_set_log_sink(ctx, NULL, NULL);
    fsdp_ctx_destroy(ctx);
}

/* ---- argument checks ---- */

static void test_bad_args(void) {
    fsdp_ctx_t *ctx = new_ctx(0, 1);
    fsdp_device_t *dev = fsdp_ctx_device(ctx);
    void *p = NULL;
    char buf[16];

    tap_is_int(fsdp_device_alloc(dev, FSDP_MEM_OTHER, 8, NULL), FSDP_EINVAL, "alloc: out NULL");
    tap_has_str(fsdp_ctx_last_error(ctx), "out", "the message names out");
    tap_is_int(fsdp_device_alloc(dev, (fsdp_mem_cat_t)99, 8, &p), FSDP_EINVAL, "alloc: bad cat");
    tap_has_str(fsdp_ctx_last_error(ctx), "cat", "the message names cat");
    tap_ok(p == NULL, "a failed alloc leaves *out NULL");
    tap_is_int(fsdp_device_alloc(NULL, FSDP_MEM_OTHER, 8, &p), FSDP_EINVAL, "alloc: dev NULL");

    tap_is_int(fsdp_device_memcpy(dev, NULL, buf, 4, FSDP_COPY_H2H, NULL), FSDP_EINVAL,
               "memcpy: dst NULL");
    tap_has_str(fsdp_ctx_last_error(ctx), "dst", "the message names dst");
    tap_is_int(fsdp_device_memcpy(dev, buf, NULL, 4, FSDP_COPY_H2H, NULL), FSDP_EINVAL,
               "memcpy: src NULL");
    tap_has_str(fsdp_ctx_last_error(ctx), "src", "the message names src");
    tap_is_int(fsdp_device_memcpy(dev, buf, buf, 4, (fsdp_copy_kind_t)7, NULL), FSDP_EINVAL,
               "memcpy: bad kind");
    tap_has_str(fsdp_ctx_last_error(ctx), "kind", "the message names kind");
    tap_is_int(fsdp_device_memcpy(dev, buf + 2, buf, 8, FSDP_COPY_H2H, NULL), FSDP_EINVAL,
               "memcpy: overlapping buffers");
    tap_has_str(fsdp_ctx_last_error(ctx), "overlap", "the message says overlap");
    tap_is_int(fsdp_device_memset(dev, NULL, 0, 4, NULL), FSDP_EINVAL, "memset: dst NULL");
    tap_has_str(fsdp_ctx_last_error(ctx), "dst", "the message names dst");
    tap_is_int(fsdp_device_fill(dev, buf, (fsdp_dtype_t)42, 1, 0.0, NULL), FSDP_EINVAL,
               "fill: bad dtype");
    tap_has_str(fsdp_ctx_last_error(ctx), "dt", "the message names dt");
    tap_is_int(fsdp_device_cast(dev, buf, FSDP_DTYPE_F32, buf + 8, (fsdp_dtype_t)-1, 1, NULL),
               FSDP_EINVAL, "cast: bad source dtype");
    tap_has_str(fsdp_ctx_last_error(ctx), "st", "the message names st");
    tap_is_int(fsdp_device_fill(dev, buf, FSDP_DTYPE_F64, SIZE_MAX / 4, 0.0, NULL), FSDP_EINVAL,
               "fill: a byte count that overflows");

    fsdp_device_t *d = NULL;
    tap_is_int(fsdp_device_create(ctx, (fsdp_device_kind_t)9, NULL, &d), FSDP_EINVAL,
               "create: bad kind");
    tap_has_str(fsdp_ctx_last_error(ctx), "kind", "the message names kind");
    fsdp_device_options_t o;
    fsdp_device_options_init(&o);
    o.ordinal = 1;
    tap_is_int(fsdp_device_create(ctx, FSDP_DEVICE_CPU, &o, &d), FSDP_EINVAL,
               "create: CPU ordinal 1");
    tap_has_str(fsdp_ctx_last_error(ctx), "ordinal", "the message names ordinal");
    tap_is_int(fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, NULL), FSDP_EINVAL,
               "create: out NULL");
    tap_is_int(fsdp_device_create(NULL, FSDP_DEVICE_CPU, NULL, &d), FSDP_EINVAL,
               "create: ctx NULL");

    /* A stream of one device cannot order work on another. */
    fsdp_device_t *d2 = NULL;
    fsdp_stream_t *s2 = NULL;
    fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &d2);
    fsdp_stream_create(d2, &s2);
    tap_is_int(fsdp_device_memset(dev, buf, 0, 4, s2), FSDP_EINVAL,
               "memset on a stream of another device");
    tap_has_str(fsdp_ctx_last_error(ctx), "stream", "the message names stream");
    fsdp_stream_destroy(s2);
    fsdp_device_destroy(d2);

    /* Kernels refuse dtypes they do not compute in. */
    int32_t iv[4] = {1, 2, 3, 4};
    tap_is_int(dev->ops->unary(dev, FSDP_DTYPE_I32, FSDP_UNARY_NEG, 4, 0, iv, iv), FSDP_ENOTSUP,
               "unary on i32 is not supported");
    tap_has_str(fsdp_ctx_last_error(ctx), "i32", "the message names the dtype");
    double dv[4] = {1, 2, 3, 4};
    tap_is_int(dev->ops->unary(dev, FSDP_DTYPE_F64, FSDP_UNARY_COUNT, 4, 0, dv, dv), FSDP_EINVAL,
               "an unknown unary op is refused");
    tap_is_int(
        dev->ops->unary_backward(dev, FSDP_DTYPE_F64, FSDP_UNARY_LOG, 4, 0, NULL, dv, dv, dv),
        FSDP_EINVAL, "log backward without x is refused");
    fsdp_ctx_destroy(ctx);
}

static void test_cuda_kind(void) {
    fsdp_ctx_t *ctx = new_ctx(0, 1);
    fsdp_device_t *d = NULL;
    int rc = fsdp_device_create(ctx, FSDP_DEVICE_CUDA, NULL, &d);
#ifndef FSDP_HAVE_CUDA
    tap_is_int(rc, FSDP_ENOTSUP, "a CUDA device in a CPU-only build is not supported");
    tap_has_str(fsdp_ctx_last_error(ctx), "cuda", "the message names cuda");
#else
    /* Built with CUDA: the device may exist, or not yet be registered, or no GPU be visible. */
    tap_ok(rc == FSDP_OK || rc == FSDP_ENOTSUP || rc == FSDP_EBACKEND,
           "a CUDA device in a CUDA build is created or refused cleanly (%s)", fsdp_err_name(rc));
    tap_ok(rc == FSDP_OK ? d != NULL : d == NULL, "and *out matches the result");
    fsdp_device_destroy(d);
#endif
    fsdp_ctx_destroy(ctx);
}

/* ---- copies, streams ---- */

static void test_copies(void) {
    fsdp_ctx_t *ctx = new_ctx(0, 1);
    fsdp_device_t *dev = fsdp_ctx_device(ctx);
    unsigned char h[256], back[256];
    for (int i = 0; i < 256; i++)
        h[i] = (unsigned char)(i * 7 + 3);
    void *d1 = NULL, *d2 = NULL;
    fsdp_device_alloc(dev, FSDP_MEM_OTHER, 256, &d1);
    fsdp_device_alloc(dev, FSDP_MEM_OTHER, 256, &d2);
    int rc = fsdp_device_memcpy(dev, d1, h, 256, FSDP_COPY_H2D, NULL);
    rc |= fsdp_device_memcpy(dev, d2, d1, 256, FSDP_COPY_D2D, NULL);
    rc |= fsdp_device_memcpy(dev, back, d2, 256, FSDP_COPY_D2H, NULL);
    tap_is_int(rc, 0, "H2D, D2D, D2H copies succeed");
    tap_is_mem(back, h, 256, "the bytes survive the round trip");
    tap_is_int(fsdp_device_memcpy(dev, d1, d1, 256, FSDP_COPY_D2D, NULL), FSDP_OK,
               "a copy onto itself is allowed");
    tap_is_int(fsdp_device_memcpy(dev, NULL, NULL, 0, FSDP_COPY_D2D, NULL), FSDP_OK,
               "a copy of 0 bytes needs no buffers");
    fsdp_device_memset(dev, d1, 0xab, 100, NULL);
    fsdp_device_memcpy(dev, back, d1, 256, FSDP_COPY_D2H, NULL);
    int ms_ok = 1;
    for (int i = 0; i < 256; i++)
        ms_ok &= back[i] == (i < 100 ? 0xab : h[i]);
    tap_ok(ms_ok, "memset writes exactly n bytes");

    /* Streams and events exist and order nothing on the CPU. */
    fsdp_stream_t *s = NULL;
    fsdp_event_t *ev = NULL;
    tap_is_int(fsdp_stream_create(dev, &s), FSDP_OK, "stream created");
    tap_is_int(fsdp_event_create(dev, &ev), FSDP_OK, "event created");
    rc = fsdp_device_memcpy(dev, d2, d1, 256, FSDP_COPY_D2D, s);
    rc |= fsdp_event_record(ev, s);
    rc |= fsdp_event_wait(ev, NULL);
    rc |= fsdp_event_sync(ev);
    rc |= fsdp_stream_sync(s);
    tap_is_int(rc, 0, "copy on a stream, record, wait, sync");
    tap_ok(fsdp_stream_native(s) == NULL, "a CPU stream's native handle is NULL");
    tap_is_int(fsdp_stream_sync(NULL), FSDP_EINVAL, "syncing a NULL stream is refused");
    fsdp_event_destroy(ev);
    fsdp_stream_destroy(s);
    fsdp_event_destroy(NULL);
    fsdp_stream_destroy(NULL);
    fsdp_device_free(dev, d1);
    fsdp_device_free(dev, d2);
    fsdp_ctx_destroy(ctx);
}

/* ---- threads ---- */

static void test_threads(void) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (cores < 1) cores = 1;
    unsetenv("FSDP_NUM_THREADS");
    tap_is_int(fsdp__cpu_default_threads(1), cores, "one rank uses every core");
    tap_is_int(fsdp__cpu_default_threads(2), cores / 2 > 1 ? cores / 2 : 1,
               "two ranks split the cores");
    tap_is_int(fsdp__cpu_default_threads(100000), 1, "at least one thread per rank");
    setenv("FSDP_NUM_THREADS", "3", 1);
    tap_is_int(fsdp__cpu_default_threads(4), 3, "FSDP_NUM_THREADS=3 wins");
    setenv("FSDP_NUM_THREADS", "0", 1);
    tap_is_int(fsdp__cpu_default_threads(1), cores, "FSDP_NUM_THREADS=0 is ignored");
    setenv("FSDP_NUM_THREADS", "2x", 1);
    tap_is_int(fsdp__cpu_default_threads(1), cores, "FSDP_NUM_THREADS=2x is ignored");
    setenv("FSDP_NUM_THREADS", "2", 1);
    fsdp_ctx_t *ctx = new_ctx(0, 1);
    tap_is_int(fsdp_device_num_threads(fsdp_ctx_device(ctx)), 2,
               "a device with automatic threads follows FSDP_NUM_THREADS");
#ifdef HAVE_GET_THREADS
    if (openblas_get_num_threads)
        tap_is_int(openblas_get_num_threads(), 2, "and sets OpenBLAS's thread count");
    else
        tap_skip(1, "the CBLAS is not OpenBLAS");
#else
    tap_skip(1, "built without OpenBLAS");
#endif
    fsdp_ctx_destroy(ctx);
    unsetenv("FSDP_NUM_THREADS");
}

int main(void) {
    tap_plan_lazy();
    test_create();
    test_ctx_device();
    test_alloc();
    test_bad_args();
    test_cuda_kind();
    test_copies();
    test_threads();
    return tap_done();
}
