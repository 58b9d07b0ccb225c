/* SPDX-License-Identifier: MIT */
/*
 * trace_json.h: reads a Chrome / Perfetto trace file (fsdp_trace_write's JSON, the Trace Event
 * Format) back for the tests: tests/t_trace.c, and tests/trace_check, the command that
 * t_fsdp_train.sh runs on fsdp-train --trace's files.
 *
 * tj_load() parses the file with jansson, strictly (RFC 8259: no trailing commas, NaN, bare
 * control characters or duplicate keys) and checks every event's fields: "X" spans need numeric
 * ts and dur >= 0, pid and tid; "B"/"E" pairs are matched per track (same pid and tid, E closes
 * the innermost B, with the same name when the E has one) and become spans; "C" counters need an
 * object of numbers as args; "M" metadata a name and args. tj_check_nesting() checks that spans
 * on one track never partially overlap. Times are kept in integer nanoseconds (the file's
 * microseconds carry three decimals).
 *
 * The interval helpers compute, for one rank, how much of its communication time its compute
 * track spent computing: covered by some compute span and by no "wait" span.
 */
#ifndef FSDP_TEST_TRACE_JSON_H
#define FSDP_TEST_TRACE_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct tj_span {
    int pid, tid;
    int64_t ts, dur; /* ns */
    char name[160];
    char cat[32];
    char unit[128]; /* args.unit ("" when none) */
    char group[96]; /* args.group of a collective */
    uint64_t bytes; /* args.bytes of a collective */
    bool has_bytes;
} tj_span_t;

typedef struct tj_trace {
    tj_span_t *spans;
    size_t nspans;
    size_t ncounters;     /* "C" events */
    size_t nmem_counters; /* "C" events named "memory" with every category of fsdp/mem.h */
    size_t nmeta;         /* "M" events */
    int pids[64];         /* distinct pids of process_name metadata, in file order */
    int npids;
    uint64_t dropped; /* otherData.dropped_events */
    char err[1024];
} tj_trace_t;

/* Loads and checks path; 0, or -1 with the reason in t->err. Free with tj_free (also after a
 * failure). */
int tj_load(const char *path, tj_trace_t *t);
void tj_free(tj_trace_t *t);

/* 0 when no two spans of one (pid, tid) partially overlap; -1 with the first offender in
 * err. */
int tj_check_nesting(const tj_trace_t *t, char *err, size_t cap);

/* Whether span a lies within span b (same track, a's interval inside b's). */
bool tj_within(const tj_span_t *a, const tj_span_t *b);

/* Number of spans of (pid, tid) with category cat (NULL: any) and, when not NULL, unit. */
size_t tj_count(const tj_trace_t *t, int pid, int tid, const char *cat, const char *unit);

/* Of rank pid's communication time (its tid-2 spans), the fraction during which its compute track
 * (tid 1) was inside some span and inside no "wait" span; *comm_ns (may be NULL) receives the
 * total communication time. 0 when there is none. */
double tj_overlap_fraction(const tj_trace_t *t, int pid, int64_t *comm_ns);

/* The same over the collectives named `name` (NULL: all) that start inside a backward pass (a
 * compute span of category "autograd") when in_backward. */
double tj_overlap_fraction_of(const tj_trace_t *t, int pid, const char *name, bool in_backward,
                              int64_t *comm_ns);

#endif /* FSDP_TEST_TRACE_JSON_H */
