/*
 * gloo_coll_suite.h: the parts of the foundation's collective suite (seed behaviour F02,
 * "Collectives that FSDP and the references use") that run on Gloo worlds of threads
 * (t_gloo_coll.c, gw_run()) and of processes (t_gloo_coll_mp.c, gw_run_procs()) alike.
 *
 * Everything a rank records lives in mp_shared_alloc() memory, with process-shared locks, so
 * the same rank functions serve both runners.
 */
#ifndef FSDP_TESTS_GLOO_COLL_SUITE_H
#define FSDP_TESTS_GLOO_COLL_SUITE_H

#include <stddef.h>

#include <fsdp.h>

#include "gloo_world.h"

/* The odd count of the matrix (and of many checks of t_gloo_coll.c). */
#define GCS_ODD_COUNT 1001

/* Every collective that moves data, in the matrix's order. */
extern const fsdp_coll_kind_t gcs_kinds[];
#define GCS_NKINDS 6

/* The matrix's large message in bytes: FSDP_TEST_LARGE_MB MiB, by default 4 (1 under
 * ThreadSanitizer); 0 leaves it out. */
size_t gcs_large_bytes(void);

/*
 * The F02 matrix of coll_check.h at world sizes 2, 3 and 4, each world started by `run`: every
 * collective x dtype x reduce op, in place and out of place, counts 0, 1, GCS_ODD_COUNT and
 * (when large > 0) a message of `large` bytes, roots 0 and size-1, NULL for the buffers the
 * contract does not use, the count-1 cases through works; barrier. Prints one TAP line per world
 * ("<name> world <n>: the matrix ran on every rank"), per (collective, dtype) and for barrier;
 * returns the number of combinations each rank ran.
 */
int gcs_matrix(gw_runner_fn run, const char *name, size_t large);

/*
 * Bitwise agreement with the sim backend on random (inexact) f32/bf16/f16 values, in one world
 * of each size 2, 3 and 4 started by `run` (after the same cases ran on sim threads):
 * reduce_scatter sum and avg at every size (it reduces in rank order), all_reduce and reduce
 * at size 2 must give sim's bits; at 3 and 4 ranks all_reduce combines in ring order, and the
 * number of elements that differ is printed as information. One TAP line per case, each
 * starting with "<name> bitwise:".
 */
void gcs_bitwise(gw_runner_fn run, const char *name);

#endif /* FSDP_TESTS_GLOO_COLL_SUITE_H */
