/* SPDX-License-Identifier: MIT */
/*
 * coll_prescale.h: the prescaled sums of the collective contract (pg.h, fsdp_coll_desc_t's
 * prescale, NCCL's PreMulSum), for every backend and runner that coll_matrix.h serves: sim
 * threads (t_pg_coll.c), Gloo threads over TCP (t_gloo_coll.c) and Gloo processes over shared
 * memory (t_gloo_coll_mp.c).
 *
 * At each world size, every rank runs reduce_scatter, all_reduce and reduce (root size - 1) of
 * f32, f64, bf16 and f16 with prescales 0.5, 0.25 and 0.3, on 1, 1001 and (f32, all_reduce and
 * reduce_scatter) `large` elements, in place and out of place, over inexact values that differ by
 * rank and element, and compares every element bitwise with the closed form computed here: the
 * sum in rank order of each input times the prescale rounded to the dtype (f16 and bf16 summed
 * in f32 and rounded once). With the powers of two it also compares with what FSDP did before
 * the prescale existed: each rank divides its input in place by 1 / prescale, then a plain sum.
 * Then the rejections: a prescale with max, on i32, on all_gather, NaN and infinity are
 * FSDP_EINVAL naming the prescale; and, where the backend compares the ranks' calls
 * (check_mismatch), ranks that disagree on the prescale get FSDP_EMISMATCH.
 */
#ifndef FSDP_TESTS_COLL_PRESCALE_H
#define FSDP_TESTS_COLL_PRESCALE_H

#include <stddef.h>

#include "coll_matrix.h"

/* Runs the suite at each of the nworlds world sizes, started by `run`, and prints one TAP line
 * per world ("<name> prescale world <n>: ...") and one for the mismatch when check_mismatch. */
void cp_suite(cm_runner_fn run, const char *name, const int *worlds, int nworlds, size_t large,
              int check_mismatch);

#endif /* FSDP_TESTS_COLL_PRESCALE_H */
