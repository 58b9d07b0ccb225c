/* SPDX-License-Identifier: MIT */
/*
 * device.c: the public device API (include/fsdp/device.h) over the device vtable.
 *
 * This file checks arguments once, so backends contain only memory and compute code, and does
 * the bookkeeping every backend needs: the accounting of device memory on the rank's context,
 * streams and events as small owned objects around the backend's native handles, and the
 * context's default device.
 *
 * Invariants:
 * - Every live pointer returned by fsdp_device_alloc() is in its device's allocation map with its
 *   size and category, so fsdp_device_free() needs only the pointer (device memory cannot carry
 *   a header the way host blocks of mem.c do: it is not host-addressable on a GPU).
 * - The map is touched only by the thread using the device (see device.h), so it has no lock;
 *   live_allocs mirrors its count atomically for readers on other threads.
 * - ctx->dev == NULL means "the CPU device"; fsdp_ctx_device() creates ctx->dev_owned on first
 *   use. Destroying a device that is the context's default puts the default back to the CPU.
 */
#include <config.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/device_impl.h"

static const char *const kind_names[FSDP_DEVICE_KIND_COUNT] = {"cpu", "cuda", "meta"};

int fsdp__gemm_check(fsdp_device_t *dev, const char *who, bool trans_a, bool trans_b, int64_t m,
                     int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, int64_t batch) {
    if (m < 0 || n < 0 || k < 0 || batch < 0)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL,
                             "%s gemm: negative size (m %lld, n %lld, k %lld, batch %lld)", who,
                             (long long)m, (long long)n, (long long)k, (long long)batch);
    if (m == 0 || n == 0 || batch == 0) return 1;
    int64_t a_cols = trans_a ? m : k, b_cols = trans_b ? k : n;
    if (ldc < n || (k > 0 && (lda < a_cols || ldb < b_cols)))
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL,
                             "%s gemm: leading dimensions too small (lda %lld for %lld columns, "
                             "ldb %lld for %lld, ldc %lld for %lld)",
                             who, (long long)lda, (long long)a_cols, (long long)ldb,
                             (long long)b_cols, (long long)ldc, (long long)n);
    return 0;
}

bool fsdp__device_gemm_native(const fsdp_device_t *dev, fsdp_dtype_t dt) {
    if (dt != FSDP_DTYPE_BF16 && dt != FSDP_DTYPE_F16) return false;
    return dev->ops->gemm_lp && (dev->ops->gemm_lp_dtypes & FSDP__DT_BIT(dt)) != 0;
}

/* ---- allocation map: open addressing, linear probing, backward-shift deletion ---- */

struct alloc_entry {
    void *ptr; /* NULL: empty slot */
    size_t bytes;
    fsdp_mem_cat_t cat;
    const struct fsdp_dev_ops *host_ops; /* made by host_ops->host_alloc; NULL: dev->ops->alloc */
};

struct alloc_map {
    struct alloc_entry *slots;
    size_t cap; /* power of two */
    size_t count;
};

/* The front end's view of a device: the struct backends see, plus the map. */
struct device {
    struct fsdp_device base; /* first, so fsdp_device_t * and struct device * convert */
    struct alloc_map map;
};

struct fsdp_stream {
    fsdp_device_t *dev;
    void *handle; /* the backend's stream */
};

struct fsdp_event {
    fsdp_device_t *dev;
    void *handle; /* the backend's event */
};

#define MAP_MIN_CAP 64

static size_t map_hash(const void *ptr, size_t cap) {
    /* Allocations are 64-byte aligned, so the low bits carry nothing; Fibonacci hashing spreads
     * the rest over the table. */
    uint64_t h = ((uint64_t)(uintptr_t)ptr >> 6) * UINT64_C(0x9e3779b97f4a7c15);
    return (size_t)(h >> 32) & (cap - 1);
}

static struct alloc_entry *map_find(const struct alloc_map *m, const void *ptr) {
    for (size_t i = map_hash(ptr, m->cap);; i = (i + 1) & (m->cap - 1)) {
        if (m->slots[i].ptr == ptr) return &m->slots[i];
        if (!m->slots[i].ptr) return NULL;
    }
}

/* Inserts without growing; the caller made room. */
static void map_put(struct alloc_map *m, struct alloc_entry e) {
    size_t i = map_hash(e.ptr, m->cap);
    while (m->slots[i].ptr)
        i = (i + 1) & (m->cap - 1);
    m->slots[i] = e;
    m->count++;
}

static int map_init(struct alloc_map *m, size_t cap) {
    m->slots = calloc(cap, sizeof *m->slots);
    m->cap = cap;
    m->count = 0;
    return m->slots ? FSDP_OK : FSDP_ENOMEM;
}

/* Makes room for one more entry, keeping the load factor at most 1/2. */
static int map_reserve(struct alloc_map *m) {
    if ((m->count + 1) * 2 <= m->cap) return FSDP_OK;
    struct alloc_map bigger;
    if (m->cap > SIZE_MAX / 2 / sizeof *m->slots) return FSDP_ENOMEM;
    if (map_init(&bigger, m->cap * 2) < 0) return FSDP_ENOMEM;
    for (size_t i = 0; i < m->cap; i++)
        if (m->slots[i].ptr) map_put(&bigger, m->slots[i]);
    free(m->slots);
    *m = bigger;
    return FSDP_OK;
}

/* Removes the entry at e and shifts later members of its probe chain back, so lookups never
 * need tombstones. */
static void map_remove(struct alloc_map *m, struct alloc_entry *e) {
    size_t mask = m->cap - 1;
    size_t hole = (size_t)(e - m->slots);
    for (size_t i = (hole + 1) & mask; m->slots[i].ptr; i = (i + 1) & mask) {
        size_t home = map_hash(m->slots[i].ptr, m->cap);
        /* The entry at i may move into the hole when its home is not in (hole, i]. */
        int stays = hole <= i ? (home > hole && home <= i) : (home > hole || home <= i);
        if (stays) continue;
        m->slots[hole] = m->slots[i];
        hole = i;
    }
    m->slots[hole].ptr = NULL;
    m->count--;
}

/* ---- creation ---- */

static const fsdp__abi_struct_t device_options_abi =
    FSDP__ABI_STRUCT(fsdp_device_options_t, "fsdp_device_options_init", ordinal);

void(fsdp_device_options_init)(fsdp_device_options_t *opts, size_t size) {
    fsdp_device_options_t d;
    memset(&d, 0, sizeof d);
    d.num_threads = 0;
    d.ordinal = 0;
    fsdp__abi_init(opts, size, &d, &device_options_abi);
}

int fsdp__device_create(fsdp_ctx_t *ctx, fsdp_device_kind_t kind, const struct fsdp_dev_ops *ops,
                        const fsdp_device_options_t *opts, fsdp_device_t **out) {
    int rc = FSDP_OK;
    struct device *d = NULL;
    if (!out) return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_device_create: out is NULL");
    *out = NULL;
    if (!ctx) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_device_create: ctx is NULL");
    if ((int)kind < 0 || kind >= FSDP_DEVICE_KIND_COUNT)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_device_create: kind %d is not a device kind",
                             (int)kind);
    if ((rc = fsdp__abi_check(ctx, "fsdp_device_create", "opts", opts, &device_options_abi)) < 0)
        return rc;
    fsdp_device_options_t defaults;
    if (!opts) {
        fsdp_device_options_init(&defaults);
        opts = &defaults;
    }
    if (!ops)
        return fsdp__ctx_err(ctx, FSDP_ENOTSUP,
                             "fsdp_device_create: the %s device is not built into this libfsdp",
                             kind_names[kind]);
    if (opts->ordinal < 0 || (kind != FSDP_DEVICE_CUDA && opts->ordinal != 0))
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_device_create: opts->ordinal %d is not a %s device",
                             opts->ordinal, kind_names[kind]);

    d = calloc(1, sizeof *d);
    if (!d) {
        rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "fsdp_device_create: out of host memory");
        goto fail;
    }
    if (map_init(&d->map, MAP_MIN_CAP) < 0) {
        rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "fsdp_device_create: out of host memory");
        goto fail;
    }
    fsdp_device_t *dev = &d->base;
    dev->ops = ops;
    dev->ctx = ctx;
    dev->kind = kind;
    dev->ordinal = opts->ordinal;
    /* <= 0 asks the backend's init for its default. */
    dev->num_threads = opts->num_threads > 0 ? opts->num_threads : 0;
    atomic_init(&dev->live_allocs, 0);
    if (kind != FSDP_DEVICE_CUDA)
        snprintf(dev->name, sizeof dev->name, "%s", ops->name);
    else
        snprintf(dev->name, sizeof dev->name, "%s:%d", ops->name, opts->ordinal);
    if (ops->init) {
        rc = ops->init(dev);
        if (rc < 0) goto fail;
    }
    *out = dev;
    return FSDP_OK;

fail:
    if (d) free(d->map.slots);
    free(d);
    return rc;
}

void fsdp_device_destroy(fsdp_device_t *dev) {
    if (!dev) return;
    struct device *d = (struct device *)dev;
    fsdp_ctx_t *ctx = dev->ctx;
    if (d->map.count > 0) {
        /* Freed here so that a rank that forgot buffers leaks nothing; pointers the caller still
         * holds dangle, which is the caller's bug being reported. */
        size_t bytes = 0;
        for (size_t i = 0; i < d->map.cap; i++)
            if (d->map.slots[i].ptr) bytes += d->map.slots[i].bytes;
        fsdp_log(ctx, FSDP_LOG_WARN,
                 "fsdp_device_destroy: device %s still has %zu allocations (%zu bytes); freeing "
                 "them",
                 dev->name, d->map.count, bytes);
        for (size_t i = 0; i < d->map.cap; i++) {
            struct alloc_entry *e = &d->map.slots[i];
            if (!e->ptr) continue;
            if (e->host_ops)
                e->host_ops->host_free(dev, e->ptr);
            else
                dev->ops->free(dev, e->ptr);
            fsdp_mem_account_free(ctx, e->cat, e->bytes);
            e->ptr = NULL;
        }
        d->map.count = 0;
        atomic_store(&dev->live_allocs, 0);
    }
    if (dev->ops->fini) dev->ops->fini(dev);
    if (ctx) {
        if (ctx->dev == dev) ctx->dev = NULL;
        if (ctx->dev_owned == dev) ctx->dev_owned = NULL;
    }
    free(d->map.slots);
    free(d);
}

fsdp_device_t *fsdp__ctx_cpu_device(fsdp_ctx_t *ctx) {
    if (!ctx) return NULL;
    if (!ctx->dev_owned) {
        fsdp_device_t *dev = NULL;
        if (fsdp__device_create(ctx, FSDP_DEVICE_CPU, &fsdp__cpu_dev_ops, NULL, &dev) < 0)
            return NULL;
        ctx->dev_owned = dev;
        ctx->dev_destroy = fsdp_device_destroy;
    }
    return ctx->dev_owned;
}

fsdp_device_t *fsdp_ctx_device(fsdp_ctx_t *ctx) {
    if (!ctx) return NULL;
    if (!ctx->dev) ctx->dev = fsdp__ctx_cpu_device(ctx);
    return ctx->dev;
}

int fsdp_ctx_set_device(fsdp_ctx_t *ctx, fsdp_device_t *dev) {
    if (!ctx) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_ctx_set_device: ctx is NULL");
    if (dev && dev->ctx != ctx)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_ctx_set_device: dev %s belongs to the context of rank %d, not "
                             "to this one (rank %d)",
                             dev->name, dev->ctx ? dev->ctx->rank : -1, ctx->rank);
    /* NULL means the CPU device, created lazily by fsdp_ctx_device(). */
    ctx->dev = dev && dev != ctx->dev_owned ? dev : NULL;
    return FSDP_OK;
}

fsdp_device_kind_t fsdp_device_kind(const fsdp_device_t *dev) {
    return dev ? dev->kind : FSDP_DEVICE_CPU;
}

const char *fsdp_device_name(const fsdp_device_t *dev) {
    return dev ? dev->name : "(null)";
}

fsdp_ctx_t *fsdp_device_ctx(const fsdp_device_t *dev) {
    return dev ? dev->ctx : NULL;
}

int fsdp_device_num_threads(const fsdp_device_t *dev) {
    return dev ? dev->num_threads : 0;
}

/* ---- memory ---- */

int fsdp__device_pin_offload(fsdp_device_t *host, fsdp_device_t *compute) {
    if (!host || !compute)
        return fsdp__ctx_err(host ? host->ctx : compute ? compute->ctx : NULL, FSDP_EINVAL,
                             "fsdp__device_pin_offload: %s is NULL", host ? "compute" : "host");
    if (host->ctx != compute->ctx)
        return fsdp__ctx_err(host->ctx, FSDP_EINVAL,
                             "fsdp__device_pin_offload: host %s and compute device %s belong to "
                             "different contexts",
                             host->name, compute->name);
    if (host->kind != FSDP_DEVICE_CPU)
        return fsdp__ctx_err(host->ctx, FSDP_EINVAL,
                             "fsdp__device_pin_offload: %s is not a host device", host->name);
    if (!compute->ops->host_alloc || !compute->ops->host_free) return 0;
    host->offload_ops = compute->ops;
    return 1;
}

/* fsdp_device_alloc, fsdp__device_alloc_zeroed when zero is set, and fsdp__device_alloc_on when
 * stream (the backend's handle of a stream of dev) is not NULL. */
static int device_alloc(fsdp_device_t *dev, fsdp_mem_cat_t cat, size_t bytes, bool zero,
                        void *stream, void **out) {
    if (!dev) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_device_alloc: dev is NULL");
    if (!out) return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "fsdp_device_alloc: out is NULL");
    *out = NULL;
    if ((int)cat < 0 || cat >= FSDP_MEM_NCAT)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL,
                             "fsdp_device_alloc: cat %d is not a fsdp_mem_cat_t", (int)cat);
    struct device *d = (struct device *)dev;
    /* Room in the map first: once the memory exists, recording it must not fail. */
    if (map_reserve(&d->map) < 0)
        return fsdp__ctx_err(dev->ctx, FSDP_ENOMEM,
                             "fsdp_device_alloc: out of host memory for the allocation map of %s",
                             dev->name);
    void *p = NULL;
    /* Offloaded parameters and gradients of a host device come from the compute device's host
     * memory when fsdp__device_pin_offload asked for it. */
    const struct fsdp_dev_ops *host_ops = cat == FSDP_MEM_OFFLOAD ? dev->offload_ops : NULL;
    bool cleared = zero && !host_ops && dev->ops->alloc_zeroed;
    int rc = host_ops  ? host_ops->host_alloc(dev, bytes, &p)
             : stream  ? dev->ops->alloc_on(dev, bytes, stream, &p)
             : cleared ? dev->ops->alloc_zeroed(dev, bytes, &p)
                       : dev->ops->alloc(dev, bytes, &p);
    if (rc == FSDP_ENOMEM || (rc >= 0 && !p))
        return fsdp__ctx_err(dev->ctx, FSDP_ENOMEM,
                             "fsdp_device_alloc: out of %s memory allocating %zu bytes of %s",
                             dev->name, bytes, fsdp_mem_cat_name(cat));
    if (rc < 0) return rc; /* the backend described its failure */
    if (zero && !cleared && bytes > 0 && (rc = dev->ops->memset(dev, p, 0, bytes, NULL)) < 0) {
        if (host_ops)
            host_ops->host_free(dev, p);
        else
            dev->ops->free(dev, p);
        return rc;
    }
    map_put(&d->map, (struct alloc_entry){p, bytes, cat, host_ops});
    atomic_store(&dev->live_allocs, d->map.count);
    fsdp_mem_account_alloc(dev->ctx, cat, bytes);
    *out = p;
    return FSDP_OK;
}

int fsdp_device_alloc(fsdp_device_t *dev, fsdp_mem_cat_t cat, size_t bytes, void **out) {
    return device_alloc(dev, cat, bytes, false, NULL, out);
}

int fsdp__device_alloc_zeroed(fsdp_device_t *dev, fsdp_mem_cat_t cat, size_t bytes, void **out) {
    return device_alloc(dev, cat, bytes, true, NULL, out);
}

bool fsdp__device_stream_pools(const fsdp_device_t *dev) {
    return dev && dev->ops->alloc_on && dev->ops->record_stream && dev->ops->cast_on;
}

int fsdp__device_alloc_on(fsdp_device_t *dev, fsdp_mem_cat_t cat, size_t bytes,
                          fsdp_stream_t *stream, void **out) {
    if (!stream) return device_alloc(dev, cat, bytes, false, NULL, out);
    if (out) *out = NULL;
    if (!fsdp__device_stream_pools(dev))
        return fsdp__ctx_err(dev ? dev->ctx : NULL, FSDP_ENOTSUP,
                             "fsdp__device_alloc_on: device %s has no per-stream pools",
                             dev ? dev->name : "(null)");
    if (stream->dev != dev)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL,
                             "fsdp__device_alloc_on: stream belongs to device %s, not %s",
                             stream->dev->name, dev->name);
    if (cat == FSDP_MEM_OFFLOAD)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL,
                             "fsdp__device_alloc_on: offloaded memory has no stream pool");
    return device_alloc(dev, cat, bytes, false, stream->handle, out);
}

int fsdp__device_record_stream(fsdp_device_t *dev, void *ptr, void *stream) {
    if (!fsdp__device_stream_pools(dev))
        return fsdp__ctx_err(dev ? dev->ctx : NULL, FSDP_ENOTSUP,
                             "fsdp__device_record_stream: device %s has no per-stream pools",
                             dev ? dev->name : "(null)");
    if (!ptr)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "fsdp__device_record_stream: ptr is NULL");
    return dev->ops->record_stream(dev, ptr, stream ? stream : fsdp__device_compute_stream(dev));
}

void fsdp_device_free(fsdp_device_t *dev, void *ptr) {
    if (!ptr) return;
    if (!dev) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "fsdp_device_free: dev is NULL (ptr %p leaked)", ptr);
        return;
    }
    struct device *d = (struct device *)dev;
    struct alloc_entry *e = map_find(&d->map, ptr);
    if (!e) {
        /* Freeing it anyway could corrupt the heap or another device; reporting is safer. */
        fsdp_log(dev->ctx, FSDP_LOG_ERROR,
                 "fsdp_device_free: %p was not allocated on device %s (or was freed already)", ptr,
                 dev->name);
        return;
    }
    size_t bytes = e->bytes;
    fsdp_mem_cat_t cat = e->cat;
    const struct fsdp_dev_ops *host_ops = e->host_ops;
    map_remove(&d->map, e);
    atomic_store(&dev->live_allocs, d->map.count);
    if (host_ops)
        host_ops->host_free(dev, ptr);
    else
        dev->ops->free(dev, ptr);
    fsdp_mem_account_free(dev->ctx, cat, bytes);
}

/* Checks that stream is NULL or belongs to dev; gives its native handle. */
static int stream_handle(fsdp_device_t *dev, fsdp_stream_t *stream, const char *fn, void **out) {
    *out = NULL;
    if (!stream) return FSDP_OK;
    if (stream->dev != dev)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "%s: stream belongs to device %s, not %s", fn,
                             stream->dev->name, dev->name);
    *out = stream->handle;
    return FSDP_OK;
}

/* 1 when [a, a+n) and [b, b+n) overlap without being the same range. */
static int partial_overlap(const void *a, const void *b, size_t n) {
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return x != y && x < y + n && y < x + n;
}

int fsdp_device_memcpy(fsdp_device_t *dev, void *dst, const void *src, size_t n,
                       fsdp_copy_kind_t kind, fsdp_stream_t *stream) {
    static const char fn[] = "fsdp_device_memcpy";
    void *sh = NULL;
    if (!dev) return fsdp__ctx_err(NULL, FSDP_EINVAL, "%s: dev is NULL", fn);
    if ((int)kind < 0 || kind > FSDP_COPY_H2H)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "%s: kind %d is not a fsdp_copy_kind_t", fn,
                             (int)kind);
    if (n > 0 && !dst)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "%s: dst is NULL for %zu bytes", fn, n);
    if (n > 0 && !src)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "%s: src is NULL for %zu bytes", fn, n);
    /* Host and device addresses of a GPU never share a space with each other's ranges, so only
     * same-space copies can overlap. */
    if ((kind == FSDP_COPY_D2D || kind == FSDP_COPY_H2H) && partial_overlap(dst, src, n))
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "%s: dst %p and src %p overlap (%zu bytes)", fn,
                             dst, (const void *)src, n);
    int rc = stream_handle(dev, stream, fn, &sh);
    if (rc < 0) return rc;
    if (n == 0) return FSDP_OK;
    return dev->ops->memcpy(dev, dst, src, n, kind, sh);
}

int fsdp_device_memset(fsdp_device_t *dev, void *dst, int byte, size_t n, fsdp_stream_t *stream) {
    static const char fn[] = "fsdp_device_memset";
    void *sh = NULL;
    if (!dev) return fsdp__ctx_err(NULL, FSDP_EINVAL, "%s: dev is NULL", fn);
    if (n > 0 && !dst)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "%s: dst is NULL for %zu bytes", fn, n);
    int rc = stream_handle(dev, stream, fn, &sh);
    if (rc < 0) return rc;
    if (n == 0) return FSDP_OK;
    return dev->ops->memset(dev, dst, byte, n, sh);
}

/* Checks a dtype and that n elements of it have a byte count. */
static int check_elems(fsdp_device_t *dev, const char *fn, const char *what, fsdp_dtype_t dt,
                       size_t n) {
    if (!fsdp_dtype_valid((int)dt))
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "%s: %s %d is not a fsdp_dtype_t", fn, what,
                             (int)dt);
    if (n > SIZE_MAX / fsdp_dtype_size(dt))
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "%s: n = %zu elements of %s overflow size_t",
                             fn, n, fsdp_dtype_name(dt));
    return FSDP_OK;
}

int fsdp_device_fill(fsdp_device_t *dev, void *dst, fsdp_dtype_t dt, size_t n, double value,
                     fsdp_stream_t *stream) {
    static const char fn[] = "fsdp_device_fill";
    void *sh = NULL;
    int rc;
    if (!dev) return fsdp__ctx_err(NULL, FSDP_EINVAL, "%s: dev is NULL", fn);
    FSDP_TRY(rc, out, check_elems(dev, fn, "dt", dt, n));
    if (n > 0 && !dst) {
        rc = fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "%s: dst is NULL for %zu elements", fn, n);
        goto out;
    }
    FSDP_TRY(rc, out, stream_handle(dev, stream, fn, &sh));
    /* The kernel members take no stream: a device runs kernels in issue order on its own
     * compute stream, so the stream is only checked here. On the CPU that orders everything. */
    (void)sh;
    if (n > 0) rc = dev->ops->fill(dev, dt, n, value, dst);
out:
    return rc;
}

int fsdp_device_cast(fsdp_device_t *dev, void *dst, fsdp_dtype_t dt, const void *src,
                     fsdp_dtype_t st, size_t n, fsdp_stream_t *stream) {
    static const char fn[] = "fsdp_device_cast";
    void *sh = NULL;
    int rc;
    if (!dev) return fsdp__ctx_err(NULL, FSDP_EINVAL, "%s: dev is NULL", fn);
    FSDP_TRY(rc, out, check_elems(dev, fn, "dt", dt, n));
    FSDP_TRY(rc, out, check_elems(dev, fn, "st", st, n));
    if (n > 0 && !dst) {
        rc = fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "%s: dst is NULL for %zu elements", fn, n);
        goto out;
    }
    if (n > 0 && !src) {
        rc = fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "%s: src is NULL for %zu elements", fn, n);
        goto out;
    }
    FSDP_TRY(rc, out, stream_handle(dev, stream, fn, &sh));
    /* On a stream of its own when the device can queue the kernel there; else in order with
     * the compute stream's work (the CPU's is done when the call returns). */
    if (n > 0)
        rc = sh && dev->ops->cast_on ? dev->ops->cast_on(dev, dt, dst, st, src, n, sh)
                                     : dev->ops->cast(dev, dt, dst, st, src, n);
out:
    return rc;
}

/* ---- streams and events ---- */

int fsdp_stream_create(fsdp_device_t *dev, fsdp_stream_t **out) {
    int rc = FSDP_OK;
    fsdp_stream_t *s = NULL;
    if (!dev) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_stream_create: dev is NULL");
    if (!out) return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "fsdp_stream_create: out is NULL");
    *out = NULL;
    s = calloc(1, sizeof *s);
    if (!s) {
        rc = fsdp__ctx_err(dev->ctx, FSDP_ENOMEM, "fsdp_stream_create: out of host memory");
        goto fail;
    }
    s->dev = dev;
    FSDP_TRY(rc, fail, dev->ops->stream_create(dev, &s->handle));
    *out = s;
    return FSDP_OK;
fail:
    free(s);
    return rc;
}

void fsdp_stream_destroy(fsdp_stream_t *stream) {
    if (!stream) return;
    stream->dev->ops->stream_destroy(stream->dev, stream->handle);
    free(stream);
}

int fsdp_stream_sync(fsdp_stream_t *stream) {
    if (!stream) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_stream_sync: stream is NULL");
    return stream->dev->ops->stream_sync(stream->dev, stream->handle);
}

void *fsdp__stream_handle(const fsdp_stream_t *stream) {
    return stream ? stream->handle : NULL;
}

void *fsdp_stream_native(const fsdp_stream_t *stream) {
    /* CPU work has completed when its call returns, which is what process groups take a NULL
     * stream to mean; the CPU backend's placeholder handle must not reach them. */
    if (!stream || stream->dev->kind == FSDP_DEVICE_CPU) return NULL;
    return stream->handle;
}

int fsdp_event_create(fsdp_device_t *dev, fsdp_event_t **out) {
    int rc = FSDP_OK;
    fsdp_event_t *ev = NULL;
    if (!dev) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_event_create: dev is NULL");
    if (!out) return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "fsdp_event_create: out is NULL");
    *out = NULL;
    ev = calloc(1, sizeof *ev);
    if (!ev) {
        rc = fsdp__ctx_err(dev->ctx, FSDP_ENOMEM, "fsdp_event_create: out of host memory");
        goto fail;
    }
    ev->dev = dev;
    FSDP_TRY(rc, fail, dev->ops->event_create(dev, &ev->handle));
    *out = ev;
    return FSDP_OK;
fail:
    free(ev);
    return rc;
}

void fsdp_event_destroy(fsdp_event_t *ev) {
    if (!ev) return;
    ev->dev->ops->event_destroy(ev->dev, ev->handle);
    free(ev);
}

int fsdp_event_record(fsdp_event_t *ev, fsdp_stream_t *stream) {
    void *sh = NULL;
    if (!ev) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_event_record: ev is NULL");
    int rc = stream_handle(ev->dev, stream, "fsdp_event_record", &sh);
    if (rc < 0) return rc;
    return ev->dev->ops->event_record(ev->dev, ev->handle, sh);
}

int fsdp_event_wait(fsdp_event_t *ev, fsdp_stream_t *stream) {
    void *sh = NULL;
    if (!ev) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_event_wait: ev is NULL");
    int rc = stream_handle(ev->dev, stream, "fsdp_event_wait", &sh);
    if (rc < 0) return rc;
    return ev->dev->ops->event_wait(ev->dev, ev->handle, sh);
}

int fsdp__event_query(fsdp_event_t *ev) {
    if (!ev) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp__event_query: ev is NULL");
    if (!ev->dev->ops->event_query) return 1;
    return ev->dev->ops->event_query(ev->dev, ev->handle); /* a failure sets the error */
}

void *fsdp__device_compute_stream(fsdp_device_t *dev) {
    return dev && dev->ops->compute_stream ? dev->ops->compute_stream(dev) : NULL;
}

int fsdp_event_sync(fsdp_event_t *ev) {
    if (!ev) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_event_sync: ev is NULL");
    return ev->dev->ops->event_sync(ev->dev, ev->handle);
}
