/* SPDX-License-Identifier: MIT */
/*
 * gloo_coll_suite.h: the parts of the foundation's collective suite (seed behaviour F02,
 * "Collectives that FSDP and the references use") that run on Gloo worlds of threads
 * (t_gloo_coll.c, gw_run()) and of processes (t_gloo_coll_mp.c, gw_run_procs()) alike: the
 * matrix of coll_matrix.h as Gloo runs it, and the bitwise comparison with sim.
 *
 * Everything a rank records lives in mp_shared_alloc() memory, so the same rank functions serve
 * both runners.
 */
#ifndef FSDP_TESTS_GLOO_COLL_SUITE_H
#define FSDP_TESTS_GLOO_COLL_SUITE_H

#include <stddef.h>

#include "gloo_world.h"

/* The matrix's large message in bytes: FSDP_TEST_LARGE_MB MiB, by default 4 (1 under
 * ThreadSanitizer); 0 leaves it out. */
size_t gcs_large_bytes(void);

/* coll_matrix.h's matrix at world sizes 2, 3 and 4, each world started by `run`, with a large
 * message of `large` bytes (0: none) and a 60 s collective timeout; TAP lines start with
 * "<name> world <n>:". Returns the number of combinations each rank ran. */
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
