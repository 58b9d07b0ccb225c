/* SPDX-License-Identifier: MIT */
/*
 * log.c: leveled logging with a rank prefix and an optional per-context sink.
 *
 * A message is formatted whole and written with one fputs, so lines from rank threads never
 * interleave within a line.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "internal.h"

static const char *const level_names[] = {"off", "error", "warn", "info", "debug"};

const char *fsdp_log_level_name(fsdp_log_level_t level) {
    if ((int)level < 0 || level > FSDP_LOG_DEBUG) return "invalid";
    return level_names[level];
}

int fsdp_log_level_parse(const char *name, fsdp_log_level_t *out) {
    static const struct {
        const char *name;
        fsdp_log_level_t level;
    } table[] = {
        {"off", FSDP_LOG_OFF},   {"none", FSDP_LOG_OFF},     {"error", FSDP_LOG_ERROR},
        {"warn", FSDP_LOG_WARN}, {"warning", FSDP_LOG_WARN}, {"info", FSDP_LOG_INFO},
        {"debug", FSDP_LOG_DEBUG}, {"trace", FSDP_LOG_DEBUG},
    };
    if (!name || !out) return FSDP_EINVAL;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        if (strcasecmp(name, table[i].name) == 0) {
            *out = table[i].level;
            return FSDP_OK;
        }
    }
    return FSDP_EINVAL;
}

bool fsdp__env_is(const char *name, const char *value) {
    const char *e = getenv(name);
    return e && strcmp(e, value) == 0;
}

fsdp_log_level_t fsdp_log_level_from_env(void) {
    fsdp_log_level_t level = FSDP_LOG_WARN;
    const char *env = getenv("FSDP_LOG");
    if (env && *env) fsdp_log_level_parse(env, &level);
    return level;
}

void fsdp_log(const fsdp_ctx_t *ctx, fsdp_log_level_t level, const char *fmt, ...) {
    fsdp_log_level_t limit = ctx ? (fsdp_log_level_t)atomic_load(&ctx->log_level)
                                 : fsdp_log_level_from_env();
    bool shown = level != FSDP_LOG_OFF && level <= limit;
    bool kept = ctx && level == FSDP_LOG_WARN; /* counted even when not shown */
    if (!shown && !kept) return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (ctx) {
        /* The sink and warning fields are only touched under log_mu; const is cast away for
         * the lock and the warning record only. */
        fsdp_ctx_t *c = (fsdp_ctx_t *)ctx;
        pthread_mutex_lock(&c->log_mu);
        if (kept) {
            c->nwarn++;
            memcpy(c->last_warn, msg, sizeof c->last_warn);
        }
        if (!shown) {
            pthread_mutex_unlock(&c->log_mu);
            return;
        }
        fsdp_log_sink_fn sink = c->sink;
        if (sink) {
            sink(c->sink_user, c->rank, level, msg);
            pthread_mutex_unlock(&c->log_mu);
            return;
        }
        pthread_mutex_unlock(&c->log_mu);
    }
    char line[1100];
    if (ctx)
        snprintf(line, sizeof line, "fsdp[rank %d] %s: %s\n", ctx->rank,
                 fsdp_log_level_name(level), msg);
    else
        snprintf(line, sizeof line, "fsdp[rank ?] %s: %s\n", fsdp_log_level_name(level), msg);
    fputs(line, stderr);
}

uint64_t fsdp_ctx_warnings(const fsdp_ctx_t *ctx, char *buf, size_t cap) {
    if (!ctx) {
        if (buf && cap) buf[0] = 0;
        return 0;
    }
    fsdp_ctx_t *c = (fsdp_ctx_t *)ctx;
    pthread_mutex_lock(&c->log_mu);
    uint64_t n = c->nwarn;
    if (buf && cap) snprintf(buf, cap, "%s", c->last_warn);
    pthread_mutex_unlock(&c->log_mu);
    return n;
}
