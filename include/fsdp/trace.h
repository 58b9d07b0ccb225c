/* SPDX-License-Identifier: MIT */
/*
 * fsdp/trace.h: a timeline of a run, written as a Chrome / Perfetto trace.
 *
 * A trace recorder collects what the ranks of a process do and writes it at the end as one JSON
 * file in the Trace Event Format, which ui.perfetto.dev and chrome://tracing open as they are.
 * Tracing is off unless a rank is started on a recorder; off, each point the library would
 * record at costs one test of a pointer of the context. One recorder may serve every rank of
 * the process (the sim backend's rank threads: one file holds the whole world) or one rank (a
 * process per rank under gloo or nccl: one file per rank, which can be merged, since every
 * event is stamped with CLOCK_MONOTONIC, the same clock for every process of a host).
 *
 * What is recorded, per rank (the rank is the trace's process id, "rank R"):
 *   - track "compute" (tid 1), the thread that started the rank's recording: spans, properly
 *     nested, of every FSDP unit's forward (forward pre-hook to forward hook), backward
 *     (backward pre-hook to the end of its post-backward) and recompute (the unit's forward
 *     run again during backward under activation checkpointing), the optimizer step, the
 *     autograd backward pass, activation checkpointing's recompute regions, the time this
 *     thread spends blocked waiting for a collective ("wait all_gather", ...), and the spans the
 *     program adds with fsdp_trace_begin()/fsdp_trace_end();
 *   - track "communication" (tid 2): one span per collective on any of the rank's groups, from
 *     when it could start (its issue, or the end of the rank's previous collective: a rank's
 *     collectives run one at a time in issue order) to its completion, wherever it executes
 *     (the rank's communication thread, or inline on the caller), with its size in bytes (as
 *     fsdp_pg_counters_t counts them), group, sequence number and issue time in args;
 *   - a counter "memory": the rank's bytes per memory category (fsdp/mem.h), sampled at the
 *     boundaries of compute spans when they changed.
 * Timestamps are microseconds of CLOCK_MONOTONIC with nanosecond digits.
 *
 * Thread-safety: a recorder may be shared by any number of ranks and threads; recording,
 * fsdp_trace_write() and the queries may run concurrently (a write sees the spans closed so
 * far). fsdp_trace_start() and fsdp_trace_stop() on a context are called by the thread that
 * computes for the rank (the compute track is that thread: spans of other threads go to the
 * communication track if they are collectives and are dropped otherwise); the rank's
 * communication thread may complete collectives meanwhile. A context keeps the recorder alive
 * while it records into it, so the recorder's owner may destroy it at any time.
 */
#ifndef FSDP_TRACE_H
#define FSDP_TRACE_H

#include <stdbool.h>
#include <stddef.h>

#include <fsdp/export.h>

FSDP_BEGIN_DECLS

typedef struct fsdp_ctx fsdp_ctx_t;
typedef struct fsdp_trace fsdp_trace_t;

typedef struct fsdp_trace_options {
    /* sizeof this struct as the caller was built; set by fsdp_trace_options_init() */
    size_t size;
    /* Events kept per rank (spans, collectives and memory samples together); later events are
     * dropped and counted (otherData.dropped_events in the file). 0 means the default, 1 << 20
     * (88 bytes an event: about 90 MiB per rank at most). */
    size_t max_events;
    /* Record the memory counter (default true). */
    bool memory;
} fsdp_trace_options_t;

/* Fills opts with the defaults above. */
FSDP_EXTERN void fsdp_trace_options_init(fsdp_trace_options_t *opts, size_t size);
#define fsdp_trace_options_init(opts) (fsdp_trace_options_init)((opts), sizeof *(opts))

/* Creates an empty recorder (opts NULL: the defaults). The caller owns *out and frees it with
 * fsdp_trace_destroy(). Returns FSDP_EINVAL for out NULL, FSDP_ENOMEM. */
FSDP_EXTERN int fsdp_trace_create(const fsdp_trace_options_t *opts, fsdp_trace_t **out);

/* Drops the caller's handle; NULL is accepted. The memory goes when the last context recording
 * into the recorder stops (or is destroyed). */
FSDP_EXTERN void fsdp_trace_destroy(fsdp_trace_t *trace);

/*
 * Starts recording ctx's rank into trace, with the calling thread as the rank's compute track.
 * A rank started again on the same recorder continues its process in the file. Returns
 * FSDP_EINVAL (with ctx's last error) when an argument is NULL, when ctx records already, or
 * when another context of the same rank records into trace now; FSDP_ENOMEM.
 */
FSDP_EXTERN int fsdp_trace_start(fsdp_ctx_t *ctx, fsdp_trace_t *trace);

/* Stops recording ctx: spans still open are closed now. A no-op when ctx does not record or is
 * NULL. fsdp_ctx_destroy() stops a context that still records. */
FSDP_EXTERN void fsdp_trace_stop(fsdp_ctx_t *ctx);

/* Whether ctx records now. */
FSDP_EXTERN bool fsdp_trace_enabled(const fsdp_ctx_t *ctx);

/*
 * A span of the program's own on ctx's compute track (category "user"), such as a training step.
 * fsdp_trace_end() closes the innermost open span of that name, and spans opened inside it that
 * are still open, so the track always nests. Both are no-ops when ctx does not record, on
 * another thread than the compute track's, or for a NULL name; they never fail.
 */
FSDP_EXTERN void fsdp_trace_begin(fsdp_ctx_t *ctx, const char *name);
FSDP_EXTERN void fsdp_trace_end(fsdp_ctx_t *ctx, const char *name);

/*
 * Writes everything recorded so far to `path` (created or truncated) as one JSON object:
 * {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}. Ranks in ascending
 * order, each rank's events sorted by time. Returns FSDP_OK; FSDP_EINVAL for a NULL argument
 * or a file that cannot be opened or written (fsdp_trace_last_error() names the path and the
 * system's reason; a partial file is removed), as the checkpoint writers report a bad path;
 * FSDP_ENOMEM. Never aborts.
 */
FSDP_EXTERN int fsdp_trace_write(fsdp_trace_t *trace, const char *path);

/* The text of the recorder's last failure ("" when none). Valid until its next call that fails. */
FSDP_EXTERN const char *fsdp_trace_last_error(const fsdp_trace_t *trace);

/* Events recorded so far over all ranks (spans, collectives, memory samples), and those dropped
 * beyond max_events. */
FSDP_EXTERN size_t fsdp_trace_num_events(const fsdp_trace_t *trace);
FSDP_EXTERN size_t fsdp_trace_dropped_events(const fsdp_trace_t *trace);

FSDP_END_DECLS

#endif /* FSDP_TRACE_H */
