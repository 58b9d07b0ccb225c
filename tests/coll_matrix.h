/* SPDX-License-Identifier: MIT */
/*
 * coll_matrix.h: the matrix of the foundation's collective suite (seed behaviour F02,
 * "Collectives that FSDP and the references use"), for every backend and runner: sim threads
 * (t_pg_coll.c), Gloo threads (t_gloo_coll.c) and Gloo processes (t_gloo_coll_mp.c).
 *
 * At each world size one run of `run` executes the whole matrix on every rank: every collective
 * x dtype x reduce op, counts 0, 1, CM_ODD_COUNT and (optionally) a large message, in place and
 * out of place, broadcast and reduce with root 0 and root size-1, every element checked against
 * the closed forms of coll_check.h. CM_ODD_COUNT elements split unevenly over 2, 3, 4 and 8
 * ranks; the large case is a message of that many bytes as the counters count it (size * count
 * elements for all_gather, reduce_scatter and all_to_all). To keep the run short the large case
 * reduces with sum and one other operator, and runs broadcast and reduce with root 0 out of place
 * and root size-1 in place. The count-1 cases go through work handles, the others block.
 * Broadcast and reduce out of place also run with NULL for the buffers the contract does not use.
 * avg on bool is checked to be rejected; all_to_all, which has no in-place form, is checked to
 * reject send == recv. Barrier runs three times.
 *
 * Ranks record into mp_shared_alloc() memory under a process-shared lock, so a runner may fork
 * its ranks. The results become one TAP line per (world, collective, dtype), with the first
 * failing combinations as comments.
 */
#ifndef FSDP_TESTS_COLL_MATRIX_H
#define FSDP_TESTS_COLL_MATRIX_H

#include <stddef.h>
#include <stdint.h>

#include <fsdp.h>

/* Uneven over 2, 3, 4 and 8 ranks: 1001 = 7 * 11 * 13. */
#define CM_ODD_COUNT 1001

/* Every collective that moves data, in the matrix's order. */
#define CM_NKINDS 6
extern const fsdp_coll_kind_t cm_kinds[CM_NKINDS];

/* A rank of a run: its context and the group to check (the world group). */
typedef int (*cm_rank_fn)(fsdp_ctx_t *ctx, fsdp_pg_t *pg, void *arg);
/* Runs fn on n ranks and returns the first failing rank's status (gloo_world.h's gw_run() and
 * gw_run_procs() are runners). */
typedef int (*cm_runner_fn)(int n, cm_rank_fn fn, void *arg, int *status);

/* FSDP_TEST_LARGE_MB MiB in bytes when it is set, else mb, or tsan_mb under ThreadSanitizer
 * (which checks every byte that memcpy and memcmp touch); 0 leaves the large case out. */
size_t cm_large_bytes(long mb, long tsan_mb);

typedef struct cm_options {
    const char *name;  /* starts every TAP line: "<name> world <n>: ..." */
    const int *worlds; /* world sizes, one run each */
    int nworlds;
    size_t large;       /* bytes of the large message; 0 for none */
    int64_t timeout_ms; /* set on the group by every rank first; 0 keeps the runner's */
} cm_options_t;

/* Runs and reports the matrix; returns the number of combinations each rank ran, summed over the
 * worlds. */
int cm_matrix(cm_runner_fn run, const cm_options_t *o);

#endif /* FSDP_TESTS_COLL_MATRIX_H */
