/* SPDX-License-Identifier: MIT */
/*
 * fsdp/mem.h: per-rank memory accounting by category.
 *
 * Every byte libfsdp allocates for a rank is counted against that rank's context in one
 * category, so that tests and benchmarks can see what FSDP keeps in memory (sharded parameters
 * only, or full ones) and the peaks between two points of a step. Counters are atomic: a rank's
 * communication thread may allocate while its compute thread reads the statistics.
 */
#ifndef FSDP_MEM_H
#define FSDP_MEM_H

#include <stddef.h>

#include <fsdp/export.h>

FSDP_BEGIN_DECLS

typedef struct fsdp_ctx fsdp_ctx_t;

typedef enum fsdp_mem_cat {
    FSDP_MEM_PARAMS = 0,   /* parameters: sharded, and full ones while unsharded */
    FSDP_MEM_GRADS,        /* gradients */
    FSDP_MEM_OPTIM,        /* optimizer state */
    FSDP_MEM_ACTIVATIONS,  /* activations saved for backward */
    FSDP_MEM_COMM,         /* communication buffers */
    FSDP_MEM_OTHER,        /* everything else */
    FSDP_MEM_OFFLOAD,      /* host memory of offloaded parameters and gradients (CPU offload) */
    FSDP_MEM_NCAT
} fsdp_mem_cat_t;

/* A snapshot of one context's counters, in bytes. */
typedef struct fsdp_mem_stats {
    size_t current[FSDP_MEM_NCAT]; /* bytes allocated now */
    size_t peak[FSDP_MEM_NCAT];    /* most bytes allocated at once since the last reset */
    size_t total_current;          /* sum of current[] */
    size_t total_peak;             /* most bytes at once over all categories since the reset */
    size_t allocs;                 /* number of allocations since the context was created */
} fsdp_mem_stats_t;

/* "params", "grads", "optim", "activations", "comm", "other"; "invalid" otherwise. */
FSDP_EXTERN const char *fsdp_mem_cat_name(fsdp_mem_cat_t cat);

/* Counts `bytes` as allocated (or freed) in `cat`. For allocators that live outside this file
 * (device memory). Freeing more than is allocated is an internal error: the counter stays at 0
 * and FSDP_EINTERNAL is returned. */
FSDP_EXTERN int fsdp_mem_account_alloc(fsdp_ctx_t *ctx, fsdp_mem_cat_t cat, size_t bytes);
FSDP_EXTERN int fsdp_mem_account_free(fsdp_ctx_t *ctx, fsdp_mem_cat_t cat, size_t bytes);

/*
 * Allocates `bytes` of host memory aligned to 64 bytes and counts it in `cat`; *out receives the
 * pointer (NULL for bytes == 0). fsdp_mem_free() releases it and accepts NULL. Returns
 * FSDP_ENOMEM (with the size in ctx's last error) when the allocation fails.
 */
FSDP_EXTERN int fsdp_mem_alloc(fsdp_ctx_t *ctx, fsdp_mem_cat_t cat, size_t bytes, void **out);
FSDP_EXTERN void fsdp_mem_free(fsdp_ctx_t *ctx, void *ptr);

/* Reads the counters. */
FSDP_EXTERN void fsdp_mem_get_stats(const fsdp_ctx_t *ctx, fsdp_mem_stats_t *out);

/* Sets every peak (per category and total) to the current value. */
FSDP_EXTERN void fsdp_mem_reset_peaks(fsdp_ctx_t *ctx);

FSDP_END_DECLS

#endif /* FSDP_MEM_H */
