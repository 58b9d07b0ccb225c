/* SPDX-License-Identifier: MIT */
/*
 * context.c: the per-rank context that owns a rank's mutable state.
 *
 * Process groups register themselves on their context (as children, with their destructor)
 * when created and unregister when destroyed, so fsdp_ctx_destroy() can reclaim groups a rank
 * forgot (the sim runner relies on this to let a rank "exit" without leaking). The context
 * calls no layer above the core by name: it holds their state as opaque pointers with the
 * destructors they registered.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/trace.h>

#include "internal.h"

static const fsdp__abi_struct_t ctx_options_abi =
    FSDP__ABI_STRUCT(fsdp_ctx_options_t, "fsdp_ctx_options_init", log_level);

void(fsdp_ctx_options_init)(fsdp_ctx_options_t *opts, size_t size) {
    fsdp_ctx_options_t d;
    memset(&d, 0, sizeof d);
    d.rank = 0;
    d.world_size = 1;
    d.seed = 0;
    d.log_level = -1;
    fsdp__abi_init(opts, size, &d, &ctx_options_abi);
}

int fsdp_ctx_create(const fsdp_ctx_options_t *opts, fsdp_ctx_t **out) {
    if (!out) return FSDP_EINVAL;
    *out = NULL;
    int rc = fsdp__abi_check(NULL, "fsdp_ctx_create", "opts", opts, &ctx_options_abi);
    if (rc < 0) return rc;
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
    pthread_mutex_init(&ctx->children_mu, NULL);
    pthread_mutex_init(&ctx->trace_mu, NULL);
    atomic_init(&ctx->trace, NULL);
    atomic_init(&ctx->tensor_mem_cat, FSDP_MEM_ACTIVATIONS);
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

void fsdp__ctx_destroy_children(fsdp_ctx_t *ctx, const char *why) {
    if (!ctx) return;
    for (;;) {
        pthread_mutex_lock(&ctx->children_mu);
        struct fsdp__ctx_child *c = ctx->children;
        pthread_mutex_unlock(&ctx->children_mu);
        if (!c) break;
        if (why && c->obj != (void *)ctx->pg)
            fsdp_log(ctx, FSDP_LOG_WARN, "%s without destroying %s '%s'; destroying it", why,
                     c->what, c->name);
        c->destroy(c->obj); /* unregisters itself */
    }
}

void fsdp_ctx_destroy(fsdp_ctx_t *ctx) {
    if (!ctx) return;
    fsdp__ctx_destroy_children(ctx, "context destroyed");
    /* After the groups: their last collectives completed into the trace. */
    fsdp_trace_stop(ctx);
    if (ctx->store_owned && ctx->store_destroy) ctx->store_destroy(ctx->store_owned);
    ctx->store = ctx->store_owned = NULL;
    /* The tape holds tensors, which hold device memory: it goes before the device. */
    if (ctx->fsdp && ctx->fsdp_destroy) ctx->fsdp_destroy(ctx->fsdp);
    if (ctx->tape && ctx->tape_destroy) ctx->tape_destroy(ctx->tape);
    ctx->tape = NULL;
    if (ctx->dev_owned && ctx->dev_destroy) ctx->dev_destroy(ctx->dev_owned);
    ctx->dev = ctx->dev_owned = NULL;
    pthread_mutex_destroy(&ctx->log_mu);
    pthread_mutex_destroy(&ctx->trace_mu);
    /* Every shared state was released by the children that held it. */
    pthread_mutex_destroy(&ctx->children_mu);
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

/* Sets ctx's last error to the formatted text (ctx may be NULL) and logs it at debug level. */
static int ctx_verr(fsdp_ctx_t *ctx, int rc, const char *fmt, va_list ap) {
    char buf[FSDP_ERR_LEN];
    vsnprintf(buf, sizeof buf, fmt, ap);
    if (ctx) memcpy(ctx->err, buf, sizeof buf);
    fsdp_log(ctx, FSDP_LOG_DEBUG, "%s: %s", fsdp_err_name(rc), buf);
    return rc;
}

int fsdp__ctx_err(fsdp_ctx_t *ctx, int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    ctx_verr(ctx, rc, fmt, ap);
    va_end(ap);
    return rc;
}

int fsdp__ctx_err_or_log(fsdp_ctx_t *ctx, int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    if (ctx) {
        ctx_verr(ctx, rc, fmt, ap);
    } else {
        char buf[FSDP_ERR_LEN];
        vsnprintf(buf, sizeof buf, fmt, ap);
        fsdp_log(NULL, FSDP_LOG_ERROR, "%s", buf);
    }
    va_end(ap);
    return rc;
}

void fsdp__ctx_attach(fsdp_ctx_t *ctx, fsdp_pg_t *pg, fsdp_store_t *store) {
    ctx->pg = pg;
    ctx->store = store;
}

void fsdp__ctx_set_trace_clock(fsdp_ctx_t *ctx, int64_t (*fn)(void *arg), void *arg) {
    ctx->trace_clock = fn;
    ctx->trace_clock_arg = arg;
}

void fsdp__ctx_add_child(fsdp_ctx_t *ctx, struct fsdp__ctx_child *c) {
    pthread_mutex_lock(&ctx->children_mu);
    c->next = ctx->children;
    ctx->children = c;
    pthread_mutex_unlock(&ctx->children_mu);
}

void fsdp__ctx_remove_child(fsdp_ctx_t *ctx, struct fsdp__ctx_child *c) {
    pthread_mutex_lock(&ctx->children_mu);
    for (struct fsdp__ctx_child **p = &ctx->children; *p; p = &(*p)->next) {
        if (*p == c) {
            *p = c->next;
            break;
        }
    }
    if ((void *)ctx->pg == c->obj) ctx->pg = NULL;
    pthread_mutex_unlock(&ctx->children_mu);
}

int fsdp__ctx_shared_acquire(fsdp_ctx_t *ctx, const void *key,
                             int (*create)(fsdp_ctx_t *ctx, void *arg, void **obj), void *arg,
                             void **out) {
    int rc = FSDP_OK;
    *out = NULL;
    pthread_mutex_lock(&ctx->children_mu);
    struct fsdp__ctx_shared *sh = ctx->shared;
    while (sh && sh->key != key) sh = sh->next;
    if (!sh) {
        sh = calloc(1, sizeof *sh);
        if (!sh) {
            rc = FSDP_ENOMEM;
            goto out;
        }
        rc = create(ctx, arg, &sh->obj);
        if (rc < 0) {
            free(sh);
            goto out;
        }
        sh->key = key;
        sh->next = ctx->shared;
        ctx->shared = sh;
    }
    sh->refs++;
    *out = sh->obj;
out:
    pthread_mutex_unlock(&ctx->children_mu);
    return rc;
}

int fsdp__ctx_shared_release(fsdp_ctx_t *ctx, const void *key) {
    int last = 0;
    pthread_mutex_lock(&ctx->children_mu);
    for (struct fsdp__ctx_shared **p = &ctx->shared; *p; p = &(*p)->next) {
        struct fsdp__ctx_shared *sh = *p;
        if (sh->key != key) continue;
        if (--sh->refs == 0) {
            *p = sh->next;
            free(sh);
            last = 1;
        }
        break;
    }
    pthread_mutex_unlock(&ctx->children_mu);
    return last;
}
