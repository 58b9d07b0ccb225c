/* SPDX-License-Identifier: MIT */
/*
 * ddp_util.h: helpers shared by the DDP tests (t_ddp.c: parity, buckets, no_sync, unused
 * parameters; t_ddp_errors.c: states, small cases and error paths; t_ddp_dyn.c: seed 004's
 * bucket arithmetic and parameters_to_ignore; t_ddp_static.c: launch order, static_graph, a
 * world of one).
 *
 * Every multi-rank case runs over sim ranks (threads) through run_sim(). Ranks store what they
 * saw in per-rank slots of a result struct (at most MAXW ranks); the main thread reports after
 * run_sim() returns. Inputs are those of NestedWrappedModule: rand(4, 8) drawn after seeding the
 * context, so each rank's input can be drawn again on any rank for an undistributed reference.
 * Every helper borrows its arguments; the tensors it returns are new references.
 */
#ifndef FSDP_TEST_DDP_UTIL_H
#define FSDP_TEST_DDP_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include <fsdp.h>

#include "models/models.h"

/* The largest world a case runs at. */
#define MAXW 4
/* Elements of every parameter of NestedWrappedModule together. */
#define NP TM_NESTED_NUM_PARAMS

/* rc = call; on failure jump to label (a rank function's cleanup). */
#define CHECK(rc, label, call)                                                                     \
    do {                                                                                           \
        (rc) = (call);                                                                             \
        if ((rc) < 0) goto label;                                                                  \
    } while (0)

/* The forward of the small buffered modules of the tests: lin(x) + scale, for a module with a
 * child "lin" and a buffer "scale" (one input, one output; FSDP_EINVAL otherwise). */
int lin_plus_scale_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                           fsdp_tensor_t **out);

/* A new f32 (4, 8) tensor of uniform [0, 1) values drawn after tm_manual_seed(ctx, seed). */
int input_seeded(fsdp_ctx_t *ctx, uint64_t seed, fsdp_tensor_t **x);

/* The input rank r draws in tm_nested_wrapped_get_input: input_seeded() with seed 1 + r. */
int input_as_rank(fsdp_ctx_t *ctx, int r, fsdp_tensor_t **x);

/* Every parameter of m (named_params order) concatenated as f32 into out (room for cap
 * elements); *n (may be NULL) gets the count. FSDP_EINVAL when they do not fit. */
int params_to_host(fsdp_module_t *m, float *out, size_t cap, size_t *n);

/* The same for the parameters' gradients; a parameter without one reads as NaN. */
int grads_to_host(fsdp_module_t *m, float *out, size_t cap, size_t *n);

/* forward + sum loss + backward on a plain module; *loss_out (may be NULL) gets the loss. */
int plain_step(fsdp_module_t *m, fsdp_tensor_t *x, double *loss_out);

/* The same through the DDP wrapper d. */
int ddp_step(fsdp_ddp_t *d, fsdp_tensor_t *x, double *loss_out);

/* The end of a rank function: releases x, destroys d, releases m and m2, in that order (each
 * may be NULL). */
void rank_release(fsdp_tensor_t *x, fsdp_ddp_t *d, fsdp_module_t *m, fsdp_module_t *m2);

/* Collectives of every kind pg has issued since its counters were reset. */
uint64_t coll_total(fsdp_pg_t *pg);

/* fsdp_sim_run() of fn over `world` ranks with seed 7, a 20 s timeout and the given faults. */
int run_sim(int world, fsdp_sim_fn fn, void *arg, const fsdp_sim_fault_t *faults, size_t nfaults,
            int *status);

#endif /* FSDP_TEST_DDP_UTIL_H */
