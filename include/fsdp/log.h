/* SPDX-License-Identifier: MIT */
/*
 * fsdp/log.h: leveled logging, prefixed with the rank.
 *
 * The level comes from FSDP_LOG (error, warn, info, debug, or off), read when a context is
 * created; the default is warn, so a successful run prints nothing. Lines go to stderr as
 * "fsdp[rank R] LEVEL: message", one write each, or to a sink installed on the context.
 */
#ifndef FSDP_LOG_H
#define FSDP_LOG_H

#include <fsdp/export.h>

FSDP_BEGIN_DECLS

typedef struct fsdp_ctx fsdp_ctx_t;

typedef enum fsdp_log_level {
    FSDP_LOG_OFF = 0,
    FSDP_LOG_ERROR,
    FSDP_LOG_WARN,
    FSDP_LOG_INFO,
    FSDP_LOG_DEBUG
} fsdp_log_level_t;

/* "error", "warn", "info", "debug" or "off". */
FSDP_EXTERN const char *fsdp_log_level_name(fsdp_log_level_t level);

/* Parses a level name (case-insensitive; "warning" and "trace" are accepted too). Returns
 * FSDP_EINVAL for anything else. */
FSDP_EXTERN int fsdp_log_level_parse(const char *name, fsdp_log_level_t *out);

/* The level FSDP_LOG asks for, or FSDP_LOG_WARN when it is unset or not a level name. */
FSDP_EXTERN fsdp_log_level_t fsdp_log_level_from_env(void);

/*
 * Logs one message at `level` through ctx's sink when ctx's level lets it through. ctx may be
 * NULL: the message then goes to stderr with rank "?" at the FSDP_LOG level. Messages longer
 * than 1 KiB are cut. Thread-safe.
 */
FSDP_EXTERN void fsdp_log(const fsdp_ctx_t *ctx, fsdp_log_level_t level, const char *fmt, ...)
    FSDP_PRINTF(3, 4);

FSDP_END_DECLS

#endif /* FSDP_LOG_H */
