/* SPDX-License-Identifier: MIT */
/*
 * trace.h: the trace recorder's entry points for the layers above the core (fsdp/trace.h is the
 * public side).
 *
 * Every recording point of the library is written as
 *     if (fsdp__tracing(ctx)) fsdp__trace_begin(ctx, FSDP__TRACE_FORWARD, name);
 * so that with tracing off it costs one relaxed load of the context's lane pointer and one
 * predictable branch, and nothing is called. The functions behind the test take the context's
 * trace lock, look at the pointer again (a stop may have come in between) and append to the
 * rank's lane.
 *
 * Spans nest on the compute track: fsdp__trace_end() closes the innermost open span with the same
 * category and name, closing first any span opened inside it that is still open (a hook that
 * failed half-way never ends its span), and ignores an end that matches no open span. Spans are
 * recorded on the thread that started the rank's recording only; other threads' calls are
 * ignored. fsdp__trace_coll() may come from any thread.
 */
#ifndef FSDP_CORE_TRACE_H
#define FSDP_CORE_TRACE_H

#include <stdbool.h>
#include <stdint.h>

#include <fsdp/trace.h>

#include "internal.h"

/* What a compute span is; its category in the file, and how its name is written. */
typedef enum fsdp__trace_cat {
    FSDP__TRACE_USER = 0,   /* "user": fsdp_trace_begin's spans, named as given */
    FSDP__TRACE_FORWARD,    /* "forward": a unit's forward, "forward <unit>" */
    FSDP__TRACE_BACKWARD,   /* "backward": a unit's backward, "backward <unit>" */
    FSDP__TRACE_RECOMPUTE,  /* "recompute": a unit's forward re-run in backward */
    FSDP__TRACE_OPTIM,      /* "optimizer": an optimizer step, "optimizer step" */
    FSDP__TRACE_AUTOGRAD,   /* "autograd": the backward pass of a loss, named as given */
    FSDP__TRACE_CHECKPOINT, /* "checkpoint": a recompute region re-running, named as given */
    FSDP__TRACE_WAIT,       /* "wait": blocked on a collective, "wait <collective>" */
    FSDP__TRACE_NCAT
} fsdp__trace_cat_t;

/* Whether ctx records a trace now (ctx may be NULL). */
static inline bool fsdp__tracing(const fsdp_ctx_t *ctx) {
    return ctx && atomic_load_explicit(&ctx->trace, memory_order_relaxed) != NULL;
}

/* Opens and closes a span on ctx's compute track (see the top of this file). */
void fsdp__trace_begin(fsdp_ctx_t *ctx, fsdp__trace_cat_t cat, const char *name);
void fsdp__trace_end(fsdp_ctx_t *ctx, fsdp__trace_cat_t cat, const char *name);

/*
 * Records a collective that completed now on ctx's communication track: `kind` is its name
 * ("all_gather"), `group` its group's name, seq its sequence number there, bytes its size as the
 * group's counters count it, issued_ns when it was issued (CLOCK_MONOTONIC). The span starts at
 * the later of issued_ns and the end of the rank's previous collective.
 */
void fsdp__trace_coll(fsdp_ctx_t *ctx, const char *kind, const char *group, uint64_t seq,
                      uint64_t bytes, int64_t issued_ns);

/* The same with the collective's start and end given (in the rank's trace clock, ns): a
 * virtual-time group records the simulated span. */
void fsdp__trace_coll_at(fsdp_ctx_t *ctx, const char *kind, const char *group, uint64_t seq,
                         uint64_t bytes, int64_t start_ns, int64_t end_ns);

/* A whole span [start, end] (trace clock, ns) on ctx's compute track, recorded at once: a
 * virtual-time group's "wait" span where the compute stream stood waiting for a collective. */
void fsdp__trace_span_at(fsdp_ctx_t *ctx, fsdp__trace_cat_t cat, const char *name,
                         int64_t start_ns, int64_t end_ns);

/* The time of ctx's trace clock, ns (CLOCK_MONOTONIC unless a simulator set one). */
int64_t fsdp__trace_now(const fsdp_ctx_t *ctx);

#endif /* FSDP_CORE_TRACE_H */
