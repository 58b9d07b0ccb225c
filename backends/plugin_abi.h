/* SPDX-License-Identifier: MIT */
/*
 * plugin_abi.h: the interface of the CUDA plugin (libfsdp-cuda.so), which holds the CUDA device
 * and the NCCL process group so that libfsdp.so itself links none of cudart, cuBLAS, cuBLASLt or
 * NCCL. Both sides include it: the plugin's entry (backends/cuda/plugin_entry.c, cuda_plugin.c)
 * and libfsdp's loader (src/launch/plugin.c), which sits above the backends.
 *
 * libfsdp opens the plugin with dlopen the first time something reaches CUDA or NCCL
 * (fsdp__plugin_get, src/launch/plugin.h) and keeps it loaded for the life of the process. The
 * handshake is one exported function, FSDP_PLUGIN_ENTRY: libfsdp passes it the table of the core's
 * internal functions the plugin needs (struct fsdp_plugin_core) and gets back the plugin's table
 * (struct fsdp_plugin). Both tables start with the ABI number and their size, and the plugin
 * also names the libfsdp version it was built with; any difference is refused, because the
 * plugin is compiled against libfsdp's private structures (contexts, groups, devices).
 *
 * Programs that link the convenience libraries statically (the tests, the benchmarks) link the
 * plugin's table in as fsdp__cuda_plugin (a weak reference here) and never dlopen anything.
 */
#ifndef FSDP_PLUGIN_ABI_H
#define FSDP_PLUGIN_ABI_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>

#include <fsdp/device.h>
#include <fsdp/nccl.h>
#include <fsdp/pg.h>
#include <fsdp/store.h>

#include "internal.h"

struct fsdp_dev_ops;
struct fsdp_pg_ops;
struct fsdp_coll;

/* Bumped whenever either table, or a structure the plugin reads, changes shape (4: the public
 * options structs start with their size, docs/design.md "ABI policy"; 5: the device ops' stream
 * pools, alloc_on, record_stream and cast_on; 6: the collectives' prescale, in fsdp_coll_t and
 * coll_reduce). */
#define FSDP_PLUGIN_ABI 6
/* The file name of the plugin and its entry point (versioned by name as well). */
#define FSDP_PLUGIN_FILE "libfsdp-cuda.so"
#define FSDP_PLUGIN_ENTRY "fsdp_cuda_plugin_v1"
/* The environment variable naming the directory to load the plugin from. */
#define FSDP_PLUGIN_DIR_ENV "FSDP_PLUGIN_DIR"

/* What the core lends the plugin: the internal functions of libfsdp that its code calls (the
 * public ones it links from libfsdp.so like any user). */
struct fsdp_plugin_core {
    uint32_t abi;  /* FSDP_PLUGIN_ABI */
    uint32_t size; /* sizeof(struct fsdp_plugin_core) */
    int (*ctx_err)(fsdp_ctx_t *ctx, int rc, const char *fmt, ...);
    void (*ctx_attach)(fsdp_ctx_t *ctx, fsdp_pg_t *pg, fsdp_store_t *store);
    int (*gemm_check)(fsdp_device_t *dev, const char *who, bool trans_a, bool trans_b, int64_t m,
                      int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, int64_t batch);
    int (*pg_init)(fsdp_pg_t *pg, const struct fsdp_pg_ops *ops, fsdp_ctx_t *ctx, int rank,
                   int size, const int *world_ranks, const char *name);
    void (*pg_fini)(fsdp_pg_t *pg);
    int (*pg_err)(fsdp_pg_t *pg, int rc, const char *fmt, ...);
    void (*work_complete)(fsdp_work_t *w, int status, const char *fmt, ...);
    void (*coll_describe)(const struct fsdp_coll *c, char *buf, size_t cap);
    int (*shared_acquire)(fsdp_ctx_t *ctx, const void *key,
                          int (*create)(fsdp_ctx_t *ctx, void *arg, void **obj), void *arg,
                          void **out);
    int (*shared_release)(fsdp_ctx_t *ctx, const void *key);
};

/* What the plugin gives back. */
struct fsdp_plugin {
    uint32_t abi;        /* FSDP_PLUGIN_ABI */
    uint32_t size;       /* sizeof(struct fsdp_plugin) */
    const char *version; /* the PACKAGE_VERSION it was built with */
    const struct fsdp_dev_ops *cuda_dev_ops;
    /* The NCCL group (fsdp/nccl.h); NULL when the plugin was built without NCCL. */
    int (*nccl_create)(fsdp_ctx_t *ctx, fsdp_store_t *store, const fsdp_nccl_options_t *o,
                       fsdp_pg_t **out);
    int (*nccl_device)(const fsdp_pg_t *pg);
};

/* The type of the entry point: NULL when the core's table is refused (another ABI). */
typedef const struct fsdp_plugin *(*fsdp_plugin_entry_fn)(const struct fsdp_plugin_core *core);

/* The table linked into a program that has the plugin's code statically (tests, benchmarks). */
extern const struct fsdp_plugin fsdp__cuda_plugin;

#endif /* FSDP_PLUGIN_ABI_H */
