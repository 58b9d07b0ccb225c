/* SPDX-License-Identifier: MIT */
/*
 * trace_check.c: checks a trace file the way t_trace.c does and prints what it holds, for the
 * shell tests (t_fsdp_train.sh runs it on fsdp-train --trace's files).
 *
 *   trace_check FILE
 *
 * Exit status 0 when FILE is valid JSON in the Trace Event Format with well-formed events and
 * spans that nest on every track, printing:
 *   ranks N                   processes named in the file
 *   memory M                  memory counter samples with every category
 *   dropped D                 events the recorder dropped
 *   rank R CAT N ...          per rank, the spans of each category on the compute track
 *                             (user forward backward recompute optimizer autograd checkpoint
 *                             wait) and "comm N bytes B" for the communication track
 *   unit R NAME F B C         per rank and unit, its forward, backward and recompute spans
 * Exit status 1 with the reason on stderr otherwise, 2 for a bad command line.
 */
#include <stdio.h>
#include <string.h>

#include "trace_json.h"

static const char *const cats[] = {"user",      "forward",  "backward",   "recompute",
                                   "optimizer", "autograd", "checkpoint", "wait"};
#define NCATS (sizeof cats / sizeof cats[0])

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: trace_check FILE\n");
        return 2;
    }
    tj_trace_t t;
    char err[1024] = "";
    if (tj_load(argv[1], &t) < 0) {
        fprintf(stderr, "trace_check: %s\n", t.err);
        tj_free(&t);
        return 1;
    }
    if (tj_check_nesting(&t, err, sizeof err) < 0) {
        fprintf(stderr, "trace_check: %s: %s\n", argv[1], err);
        tj_free(&t);
        return 1;
    }
    printf("ranks %d\nmemory %zu\ndropped %llu\n", t.npids, t.nmem_counters,
           (unsigned long long)t.dropped);
    for (int i = 0; i < t.npids; i++) {
        int r = t.pids[i];
        printf("rank %d", r);
        for (size_t c = 0; c < NCATS; c++)
            printf(" %s %zu", cats[c], tj_count(&t, r, 1, cats[c], NULL));
        unsigned long long bytes = 0;
        for (size_t k = 0; k < t.nspans; k++)
            if (t.spans[k].pid == r && t.spans[k].tid == 2) bytes += t.spans[k].bytes;
        printf(" comm %zu bytes %llu\n", tj_count(&t, r, 2, NULL, NULL), bytes);
        /* Units, in order of first appearance. */
        for (size_t k = 0; k < t.nspans; k++) {
            const tj_span_t *s = &t.spans[k];
            if (s->pid != r || !s->unit[0]) continue;
            bool seen = false;
            for (size_t q = 0; q < k && !seen; q++)
                seen = t.spans[q].pid == r && strcmp(t.spans[q].unit, s->unit) == 0;
            if (seen) continue;
            printf("unit %d %s %zu %zu %zu\n", r, s->unit, tj_count(&t, r, 1, "forward", s->unit),
                   tj_count(&t, r, 1, "backward", s->unit),
                   tj_count(&t, r, 1, "recompute", s->unit));
        }
    }
    tj_free(&t);
    return 0;
}
