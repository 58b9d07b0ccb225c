/*
 * context.c: the per-rank context that owns a rank's mutable state.
 *
 * Process groups register themselves on their context when created and unregister when
 * destroyed, so fsdp_ctx_destroy() can reclaim groups a rank forgot (the sim runner relies on
 * this to let a rank "exit" without leaking).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "pg/pg_impl.h"

void fsdp_ctx_options_init(fsdp_ctx_options_t *opts) {
    if (!opts) return;
    memset(opts, 0, sizeof *opts);
    opts->rank = 0;
    opts->world_size = 1;
    opts->seed = 0;
    opts->log_level = -1;
}

int fsdp_ctx_create(const fsdp_ctx_options_t *opts, fsdp_ctx_t **out) {
    if (!out) return FSDP_EINVAL;
    *out = NULL;
    fsdp_ctx_options_t defaults;
    if (!opts) {
        fsdp_ctx_options_init(&defaults);
        opts = &defaults;
    }
    if (opts->world_size < 1) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "fsdp_ctx_create: world_size %d must be >= 1",
                 opts->world_size);
        return FSDP_EINVAL;
    }
    if (opts->rank < 0 || opts->rank >= opts->world_size) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "fsdp_ctx_create: rank %d is outside [0, %d)",
                 opts->rank, opts->world_size);
        return FSDP_EINVAL;
    }
    if (opts->log_level < -1 || opts->log_level > FSDP_LOG_DEBUG) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "fsdp_ctx_create: log_level %d is not a level",
                 opts->log_level);
        return FSDP_EINVAL;
    }
    fsdp_ctx_t *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return FSDP_ENOMEM;
    ctx->rank = opts->rank;
    ctx->world_size = opts->world_size;
    fsdp_rng_init(&ctx->rng, opts->seed, (uint64_t)opts->rank);
    atomic_init(&ctx->log_level,
                opts->log_level < 0 ? (int)fsdp_log_level_from_env() : opts->log_level);
    pthread_mutex_init(&ctx->log_mu, NULL);
    pthread_mutex_init(&ctx->groups_mu, NULL);
    for (int c = 0; c < FSDP_MEM_NCAT; c++) {
        atomic_init(&ctx->mem_current[c], 0);
        atomic_init(&ctx->mem_peak[c], 0);
    }
    atomic_init(&ctx->mem_total, 0);
    atomic_init(&ctx->mem_total_peak, 0);
    atomic_init(&ctx->mem_allocs, 0);
    *out = ctx;
    return FSDP_OK;
}

void fsdp__ctx_destroy_groups(fsdp_ctx_t *ctx, const char *why) {
    if (!ctx) return;
    for (;;) {
        pthread_mutex_lock(&ctx->groups_mu);
        fsdp_pg_t *pg = ctx->groups;
        pthread_mutex_unlock(&ctx->groups_mu);
        if (!pg) break;
        if (why && pg != ctx->pg)
            fsdp_log(ctx, FSDP_LOG_WARN, "%s without destroying process group '%s'; destroying it",
                     why, pg->name);
        fsdp_pg_destroy(pg); /* unregisters itself */
    }
}

void fsdp_ctx_destroy(fsdp_ctx_t *ctx) {
    if (!ctx) return;
    fsdp__ctx_destroy_groups(ctx, "context destroyed");
    if (ctx->store_owned && ctx->store_destroy) ctx->store_destroy(ctx->store_owned);
    ctx->store = ctx->store_owned = NULL;
    /* The tape holds tensors, which hold device memory: it goes before the device. */
    if (ctx->fsdp && ctx->fsdp_destroy) ctx->fsdp_destroy(ctx->fsdp);
    if (ctx->tape && ctx->tape_destroy) ctx->tape_destroy(ctx->tape);
    ctx->tape = NULL;
    if (ctx->dev_owned && ctx->dev_destroy) ctx->dev_destroy(ctx->dev_owned);
    ctx->dev = ctx->dev_owned = NULL;
    pthread_mutex_destroy(&ctx->log_mu);
    pthread_mutex_destroy(&ctx->groups_mu);
    free(ctx);
}

int fsdp_ctx_rank(const fsdp_ctx_t *ctx) {
    return ctx ? ctx->rank : -1;
}

int fsdp_ctx_world_size(const fsdp_ctx_t *ctx) {
    return ctx ? ctx->world_size : 0;
}

fsdp_pg_t *fsdp_ctx_pg(const fsdp_ctx_t *ctx) {
    return ctx ? ctx->pg : NULL;
}

fsdp_store_t *fsdp_ctx_store(const fsdp_ctx_t *ctx) {
    return ctx ? ctx->store : NULL;
}

fsdp_rng_t *fsdp_ctx_rng(fsdp_ctx_t *ctx) {
    return ctx ? &ctx->rng : NULL;
}

const char *fsdp_ctx_last_error(const fsdp_ctx_t *ctx) {
    return ctx ? ctx->err : "no context";
}

fsdp_log_level_t fsdp_ctx_log_level(const fsdp_ctx_t *ctx) {
    return ctx ? (fsdp_log_level_t)atomic_load(&ctx->log_level) : fsdp_log_level_from_env();
}

void fsdp_ctx_set_log_level(fsdp_ctx_t *ctx, fsdp_log_level_t level) {
    if (ctx && (int)level >= 0 && level <= FSDP_LOG_DEBUG) atomic_store(&ctx->log_level, level);
}

void fsdp_ctx_set_log_sink(fsdp_ctx_t *ctx, fsdp_log_sink_fn fn, void *user) {
    if (!ctx) return;
    pthread_mutex_lock(&ctx->log_mu);
    ctx->sink = fn;
    ctx->sink_user = user;
    pthread_mutex_unlock(&ctx->log_mu);
}

int fsdp__ctx_err(fsdp_ctx_t *ctx, int rc, const char *fmt, ...) {
    char buf[FSDP_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (ctx) memcpy(ctx->err, buf, sizeof buf);
    fsdp_log(ctx, FSDP_LOG_DEBUG, "%s: %s", fsdp_err_name(rc), buf);
    return rc;
}

void fsdp__ctx_attach(fsdp_ctx_t *ctx, fsdp_pg_t *pg, fsdp_store_t *store) {
    ctx->pg = pg;
    ctx->store = store;
}

void fsdp__ctx_add_group(fsdp_ctx_t *ctx, fsdp_pg_t *pg) {
    pthread_mutex_lock(&ctx->groups_mu);
    pg->ctx_next = ctx->groups;
    ctx->groups = pg;
    pthread_mutex_unlock(&ctx->groups_mu);
}

void fsdp__ctx_remove_group(fsdp_ctx_t *ctx, fsdp_pg_t *pg) {
    pthread_mutex_lock(&ctx->groups_mu);
    for (fsdp_pg_t **p = &ctx->groups; *p; p = &(*p)->ctx_next) {
        if (*p == pg) {
            *p = pg->ctx_next;
            break;
        }
    }
    if (ctx->pg == pg) ctx->pg = NULL;
    pthread_mutex_unlock(&ctx->groups_mu);
}
