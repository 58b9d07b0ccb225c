/* SPDX-License-Identifier: MIT */
/*
 * coll_util.h: what the collective benchmarks (bench_sim_coll, bench_gloo_coll) share: message
 * sizes as nccl-tests counts them, the bus-bandwidth factor, and the input values whose sums are
 * exact, so that every result can be checked whatever the order of the additions.
 */
#ifndef FSDP_BENCH_COLL_UTIL_H
#define FSDP_BENCH_COLL_UTIL_H

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/pg.h>

/* Elements per rank as the API counts them, for a message of `bytes` as nccl-tests counts it. */
static inline size_t bench_coll_count(fsdp_coll_kind_t k, size_t bytes, int n) {
    return k == FSDP_COLL_ALL_REDUCE ? bytes / sizeof(float) : bytes / sizeof(float) / (size_t)n;
}

/* The message size nccl-tests reports: recv size for all_gather, send size for reduce_scatter,
 * count for all_reduce (f32). */
static inline size_t bench_coll_msg_bytes(fsdp_coll_kind_t k, size_t count, int n) {
    return (k == FSDP_COLL_ALL_REDUCE ? count : count * (size_t)n) * sizeof(float);
}

/* busbw = algbw * this: 2(N-1)/N for all_reduce, (N-1)/N for all_gather and reduce_scatter. */
static inline double bench_coll_bus_factor(fsdp_coll_kind_t k, int n) {
    return k == FSDP_COLL_ALL_REDUCE ? 2.0 * (n - 1) / n : (double)(n - 1) / n;
}

/* Value of element i of rank q's send buffer. Small integers, so that every sum of up to 64 of
 * them is exact in f32 whatever the order. */
static inline float bench_coll_value(int q, size_t i) {
    return (float)(i % 1021 + 1024 * (size_t)(q + 1));
}

/* Sum over ranks 0..n-1 of bench_coll_value(q, i). */
static inline float bench_coll_value_sum(int n, size_t i) {
    return (float)((size_t)n * (i % 1021) + 1024 * (size_t)n * (size_t)(n + 1) / 2);
}

/* p[0..n) = rank q's values of elements first .. first + n - 1. */
static inline void bench_coll_fill(float *p, int q, size_t first, size_t n) {
    for (size_t i = 0; i < n; i++)
        p[i] = bench_coll_value(q, first + i);
}

/* bytes (rounded up to 64, at least 64) of 64-byte aligned memory, zeroed so that every page is
 * touched before timing; NULL on failure. free() it. */
static inline void *bench_coll_alloc(size_t bytes) {
    size_t rounded = (bytes + 63) / 64 * 64;
    void *p = aligned_alloc(64, rounded ? rounded : 64);
    if (p) memset(p, 0, rounded ? rounded : 64);
    return p;
}

#endif /* FSDP_BENCH_COLL_UTIL_H */
