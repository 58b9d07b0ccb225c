/* SPDX-License-Identifier: MIT */
/*
 * fsdp/context.h: the per-rank context.
 *
 * A context owns every piece of a rank's mutable state: its rank and world size, its world
 * process group, its rendezvous store, its random stream, its memory accounting, its logging
 * level and sink, the trace it records into (fsdp/trace.h), and its last-error text. Two ranks never share a context, so N ranks can run
 * as N threads of one process (the sim backend) with exactly the code they run as N processes.
 * A context is used by its rank's threads only; its statistics and logging are thread-safe, the
 * rest is not.
 */
#ifndef FSDP_CONTEXT_H
#define FSDP_CONTEXT_H

#include <stddef.h>
#include <stdint.h>

#include <fsdp/export.h>
#include <fsdp/log.h>
#include <fsdp/rng.h>

FSDP_BEGIN_DECLS

typedef struct fsdp_ctx fsdp_ctx_t;
typedef struct fsdp_pg fsdp_pg_t;
typedef struct fsdp_store fsdp_store_t;

typedef struct fsdp_ctx_options {
    /* sizeof this struct as the caller was built; set by fsdp_ctx_options_init() */
    size_t size;
    int rank;       /* this rank, 0 <= rank < world_size */
    int world_size; /* number of ranks, >= 1 */
    uint64_t seed;  /* seed of the context's random stream (stream id = rank) */
    int log_level;  /* a fsdp_log_level_t, or -1 for the level FSDP_LOG asks for */
} fsdp_ctx_options_t;

/* Fills opts with rank 0 of 1, seed 0, the FSDP_LOG level. */
FSDP_EXTERN void fsdp_ctx_options_init(fsdp_ctx_options_t *opts, size_t size);
#define fsdp_ctx_options_init(opts) (fsdp_ctx_options_init)((opts), sizeof *(opts))

/* Creates a context. Returns FSDP_EINVAL (the message names the field) for bad options and
 * FSDP_ENOMEM. The caller owns *out and frees it with fsdp_ctx_destroy(). */
FSDP_EXTERN int fsdp_ctx_create(const fsdp_ctx_options_t *opts, fsdp_ctx_t **out);

/* Destroys a context; NULL is accepted. Process groups created on the context and not yet
 * destroyed are destroyed first (their outstanding collectives are waited for), with a warning. */
FSDP_EXTERN void fsdp_ctx_destroy(fsdp_ctx_t *ctx);

FSDP_EXTERN int fsdp_ctx_rank(const fsdp_ctx_t *ctx);
FSDP_EXTERN int fsdp_ctx_world_size(const fsdp_ctx_t *ctx);

/* The context's world process group (NULL until one is attached). Borrowed. */
FSDP_EXTERN fsdp_pg_t *fsdp_ctx_pg(const fsdp_ctx_t *ctx);

/* The context's rendezvous store (NULL until one is attached). Borrowed. */
FSDP_EXTERN fsdp_store_t *fsdp_ctx_store(const fsdp_ctx_t *ctx);

/* The context's random stream (seed from the options, stream = rank). */
FSDP_EXTERN fsdp_rng_t *fsdp_ctx_rng(fsdp_ctx_t *ctx);

/* Text of the last error reported on this context ("" when none). Valid until the next call
 * that fails on the same context. */
FSDP_EXTERN const char *fsdp_ctx_last_error(const fsdp_ctx_t *ctx);

/* The number of warnings logged on ctx so far, counted whether or not its level let them
 * through to the sink or stderr; buf (cap bytes; may be NULL) receives the last one's text (cut
 * at 1 KiB, "" when none). For tests and monitoring. Thread-safe; ctx NULL gives 0. */
FSDP_EXTERN uint64_t fsdp_ctx_warnings(const fsdp_ctx_t *ctx, char *buf, size_t cap);

FSDP_EXTERN fsdp_log_level_t fsdp_ctx_log_level(const fsdp_ctx_t *ctx);
FSDP_EXTERN void fsdp_ctx_set_log_level(fsdp_ctx_t *ctx, fsdp_log_level_t level);

/*
 * A log sink receives each message that passes the context's level (without the prefix or a
 * trailing newline) instead of stderr. It may be called from the rank's communication thread as
 * well as from the rank's own thread, never from two at once (calls are serialized by a lock
 * of the context, so a sink must not log through the same context). Pass fn = NULL to go back
 * to stderr.
 */
typedef void (*fsdp_log_sink_fn)(void *user, int rank, fsdp_log_level_t level, const char *msg);
FSDP_EXTERN void fsdp_ctx_set_log_sink(fsdp_ctx_t *ctx, fsdp_log_sink_fn fn, void *user);

FSDP_END_DECLS

#endif /* FSDP_CONTEXT_H */
