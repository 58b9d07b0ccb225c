/* SPDX-License-Identifier: MIT */
/*
 * plugin_entry.c: the entry point of libfsdp-cuda.so and the core functions it borrows.
 *
 * Only the loadable module has this file. Its code calls libfsdp's public functions through
 * libfsdp.so, which it links like any program; the internal ones (fsdp__*, which libfsdp.so
 * does not export) are defined here over the table the core passes to the entry point, so the
 * plugin's other files call them by their usual names. The variadic ones format here and pass
 * the text on as "%s", which keeps the table free of va_list.
 *
 * `core` is written once, by the loading thread under src/launch/plugin.c's lock, before the plugin's
 * table is published; every other use comes after that publication.
 */
#include <config.h>

#include <stdarg.h>
#include <stdio.h>

#include "backends/plugin_abi.h"
#include "device/device_impl.h"
#include "pg/pg_impl.h"

static const struct fsdp_plugin_core *core;

FSDP_EXTERN const struct fsdp_plugin *fsdp_cuda_plugin_v1(const struct fsdp_plugin_core *c);

const struct fsdp_plugin *fsdp_cuda_plugin_v1(const struct fsdp_plugin_core *c) {
    if (!c || c->abi != FSDP_PLUGIN_ABI || c->size < sizeof *c) return NULL;
    core = c;
    return &fsdp__cuda_plugin;
}

int fsdp__ctx_err(fsdp_ctx_t *ctx, int rc, const char *fmt, ...) {
    char buf[FSDP_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return core->ctx_err(ctx, rc, "%s", buf);
}

void fsdp__ctx_attach(fsdp_ctx_t *ctx, fsdp_pg_t *pg, fsdp_store_t *store) {
    core->ctx_attach(ctx, pg, store);
}

int fsdp__gemm_check(fsdp_device_t *dev, const char *who, bool trans_a, bool trans_b, int64_t m,
                     int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, int64_t batch) {
    return core->gemm_check(dev, who, trans_a, trans_b, m, n, k, lda, ldb, ldc, batch);
}

int fsdp__pg_init(fsdp_pg_t *pg, const struct fsdp_pg_ops *ops, fsdp_ctx_t *ctx, int rank,
                  int size, const int *world_ranks, const char *name) {
    return core->pg_init(pg, ops, ctx, rank, size, world_ranks, name);
}

void fsdp__pg_fini(fsdp_pg_t *pg) {
    core->pg_fini(pg);
}

int fsdp__pg_err(fsdp_pg_t *pg, int rc, const char *fmt, ...) {
    char buf[FSDP_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return core->pg_err(pg, rc, "%s", buf);
}

void fsdp__work_complete(fsdp_work_t *w, int status, const char *fmt, ...) {
    if (!fmt) {
        core->work_complete(w, status, NULL);
        return;
    }
    char buf[FSDP_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    core->work_complete(w, status, "%s", buf);
}

void fsdp__coll_describe(const fsdp_coll_t *c, char *buf, size_t cap) {
    core->coll_describe(c, buf, cap);
}

int fsdp__ctx_shared_acquire(fsdp_ctx_t *ctx, const void *key,
                             int (*create)(fsdp_ctx_t *ctx, void *arg, void **obj), void *arg,
                             void **out) {
    return core->shared_acquire(ctx, key, create, arg, out);
}

int fsdp__ctx_shared_release(fsdp_ctx_t *ctx, const void *key) {
    return core->shared_release(ctx, key);
}
