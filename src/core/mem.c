/* SPDX-License-Identifier: MIT */
/*
 * mem.c: per-rank memory accounting and the tracked host allocator.
 *
 * Tracked host blocks carry a 64-byte header in front of the user pointer holding the size and
 * category, so fsdp_mem_free() needs only the pointer and the user pointer stays 64-byte
 * aligned. Peaks are maintained with compare-and-swap, so concurrent allocations on a rank's
 * compute and communication threads never lose a peak.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define HEADER 64
#define MAGIC 0x66736470u /* "fsdp" */

struct header {
    size_t bytes;
    uint32_t cat;
    uint32_t magic;
};

static const char *const cat_names[FSDP_MEM_NCAT] = {
    "params", "grads", "optim", "activations", "comm", "other", "offload"};

const char *fsdp_mem_cat_name(fsdp_mem_cat_t cat) {
    if ((int)cat < 0 || cat >= FSDP_MEM_NCAT) return "invalid";
    return cat_names[cat];
}

static void raise_peak(_Atomic size_t *peak, size_t value) {
    size_t old = atomic_load(peak);
    while (value > old && !atomic_compare_exchange_weak(peak, &old, value)) {
    }
}

int fsdp_mem_account_alloc(fsdp_ctx_t *ctx, fsdp_mem_cat_t cat, size_t bytes) {
    if (!ctx) return FSDP_EINVAL;
    if ((int)cat < 0 || cat >= FSDP_MEM_NCAT)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "memory category %d is not a fsdp_mem_cat_t",
                             (int)cat);
    size_t now = atomic_fetch_add(&ctx->mem_current[cat], bytes) + bytes;
    raise_peak(&ctx->mem_peak[cat], now);
    size_t total = atomic_fetch_add(&ctx->mem_total, bytes) + bytes;
    raise_peak(&ctx->mem_total_peak, total);
    atomic_fetch_add(&ctx->mem_allocs, 1);
    return FSDP_OK;
}

/* Subtracts without ever going below zero; returns 0 when the counter held enough. */
static int sub_clamped(_Atomic size_t *counter, size_t bytes) {
    size_t old = atomic_load(counter);
    for (;;) {
        size_t next = old >= bytes ? old - bytes : 0;
        if (atomic_compare_exchange_weak(counter, &old, next)) return old >= bytes ? 0 : -1;
    }
}

int fsdp_mem_account_free(fsdp_ctx_t *ctx, fsdp_mem_cat_t cat, size_t bytes) {
    if (!ctx) return FSDP_EINVAL;
    if ((int)cat < 0 || cat >= FSDP_MEM_NCAT)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "memory category %d is not a fsdp_mem_cat_t",
                             (int)cat);
    int under = sub_clamped(&ctx->mem_current[cat], bytes);
    under |= sub_clamped(&ctx->mem_total, bytes);
    if (under)
        return fsdp__ctx_err(ctx, FSDP_EINTERNAL,
                             "freeing %zu bytes of %s memory, more than is accounted", bytes,
                             cat_names[cat]);
    return FSDP_OK;
}

int fsdp_mem_alloc(fsdp_ctx_t *ctx, fsdp_mem_cat_t cat, size_t bytes, void **out) {
    if (!out) return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_mem_alloc: out is NULL");
    *out = NULL;
    if (!ctx) return FSDP_EINVAL;
    if ((int)cat < 0 || cat >= FSDP_MEM_NCAT)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "memory category %d is not a fsdp_mem_cat_t",
                             (int)cat);
    if (bytes == 0) return FSDP_OK;
    if (bytes > SIZE_MAX - 2 * HEADER)
        return fsdp__ctx_err(ctx, FSDP_ENOMEM, "cannot allocate %zu bytes of %s memory", bytes,
                             cat_names[cat]);
    size_t total = (bytes + HEADER + HEADER - 1) / HEADER * HEADER;
    unsigned char *block = aligned_alloc(HEADER, total);
    if (!block)
        return fsdp__ctx_err(ctx, FSDP_ENOMEM, "out of host memory allocating %zu bytes of %s",
                             bytes, cat_names[cat]);
    struct header *h = (struct header *)block;
    h->bytes = bytes;
    h->cat = (uint32_t)cat;
    h->magic = MAGIC;
    fsdp_mem_account_alloc(ctx, cat, bytes);
    *out = block + HEADER;
    return FSDP_OK;
}

void fsdp_mem_free(fsdp_ctx_t *ctx, void *ptr) {
    if (!ptr) return;
    unsigned char *block = (unsigned char *)ptr - HEADER;
    struct header *h = (struct header *)block;
    if (h->magic != MAGIC) {
        fsdp_log(ctx, FSDP_LOG_ERROR, "fsdp_mem_free: %p was not allocated by fsdp_mem_alloc",
                 ptr);
        return;
    }
    h->magic = 0;
    if (ctx) fsdp_mem_account_free(ctx, (fsdp_mem_cat_t)h->cat, h->bytes);
    free(block);
}

void fsdp_mem_get_stats(const fsdp_ctx_t *ctx, fsdp_mem_stats_t *out) {
    if (!out) return;
    memset(out, 0, sizeof *out);
    if (!ctx) return;
    for (int c = 0; c < FSDP_MEM_NCAT; c++) {
        out->current[c] = atomic_load(&ctx->mem_current[c]);
        out->peak[c] = atomic_load(&ctx->mem_peak[c]);
    }
    out->total_current = atomic_load(&ctx->mem_total);
    out->total_peak = atomic_load(&ctx->mem_total_peak);
    out->allocs = atomic_load(&ctx->mem_allocs);
}

void fsdp_mem_reset_peaks(fsdp_ctx_t *ctx) {
    if (!ctx) return;
    for (int c = 0; c < FSDP_MEM_NCAT; c++)
        atomic_store(&ctx->mem_peak[c], atomic_load(&ctx->mem_current[c]));
    atomic_store(&ctx->mem_total_peak, atomic_load(&ctx->mem_total));
}
