/* SPDX-License-Identifier: MIT */
/*
 * device_util.h: what the device tests share (t_device.c, t_device_kernels.c): a fixed random
 * stream, a context, element access to f32/f64 buffers and a tolerance check.
 */
#ifndef FSDP_TEST_DEVICE_UTIL_H
#define FSDP_TEST_DEVICE_UTIL_H

#include <math.h>
#include <stdint.h>

#include <fsdp.h>

#include "tap.h"

static uint64_t rng_state = 0x2545f4914f6cdd1dULL;

/* Uniform in [lo, hi), from a fixed xorshift stream so every run sees the same inputs. */
static inline double urand(double lo, double hi) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return lo + (hi - lo) * (double)(rng_state >> 11) * 0x1p-53;
}

static inline fsdp_ctx_t *new_ctx(int rank, int world) {
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    o.rank = rank;
    o.world_size = world;
    fsdp_ctx_t *ctx = NULL;
    if (fsdp_ctx_create(&o, &ctx) < 0) tap_bail("cannot create a context");
    return ctx;
}

/* |got - want| <= atol + rtol |want| over n doubles; prints the first failure. */
static inline int near_all(const double *got, const double *want, size_t n, double rtol,
                           double atol, const char *what) {
    for (size_t i = 0; i < n; i++) {
        int nan_ok = isnan(got[i]) && isnan(want[i]);
        if (!nan_ok && !(fabs(got[i] - want[i]) <= atol + rtol * fabs(want[i]))) {
            tap_diag("%s: element %zu: got %.17g, want %.17g", what, i, got[i], want[i]);
            return 0;
        }
    }
    return 1;
}

/* Loads element i of an f32 or f64 buffer as double. */
static inline double ld(fsdp_dtype_t dt, const void *p, size_t i) {
    return dt == FSDP_DTYPE_F32 ? (double)((const float *)p)[i] : ((const double *)p)[i];
}

static inline void st(fsdp_dtype_t dt, void *p, size_t i, double v) {
    if (dt == FSDP_DTYPE_F32)
        ((float *)p)[i] = (float)v;
    else
        ((double *)p)[i] = v;
}

#endif /* FSDP_TEST_DEVICE_UTIL_H */
