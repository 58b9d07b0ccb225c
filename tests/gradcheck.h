/* SPDX-License-Identifier: MIT */
/*
 * gradcheck.h: finite-difference gradient checks for the operation tests.
 *
 * gc_check() runs fn on f64 inputs, contracts the output with fixed pseudo-random weights
 * (loss = sum(out * w)), backpropagates, and compares each checked input's gradient with
 * central differences of the same loss (step h). One TAP line per checked input.
 */
#ifndef FSDP_TEST_GRADCHECK_H
#define FSDP_TEST_GRADCHECK_H

#include <stdbool.h>

#include <fsdp.h>

/* Builds the output of the operation under test from the inputs (a new reference in *out). */
typedef int (*gc_fn)(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out);

/* Checks d loss / d in[i] for every i with wrt[i] (wrt NULL: every float input). The inputs
 * must be contiguous f64 leaves; the function sets and restores requires_grad on them. Returns
 * the number of failed inputs (0 when all passed). */
int gc_check(fsdp_ctx_t *ctx, const char *name, gc_fn fn, void *arg, int nin,
             fsdp_tensor_t *const *in, const bool *wrt, double h, double rtol, double atol);

/* A contiguous f64 tensor of the given shape with values uniform in [lo, hi) from a fixed
 * generator keyed by seed (independent of the context's stream). */
fsdp_tensor_t *gc_rand(fsdp_ctx_t *ctx, int ndim, const int64_t *shape, double lo, double hi,
                       unsigned seed);

#endif /* FSDP_TEST_GRADCHECK_H */
