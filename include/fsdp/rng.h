/* SPDX-License-Identifier: MIT */
/*
 * fsdp/rng.h: a counter-based random number generator (Philox-4x32-10).
 *
 * A Philox stream is a pure function of (seed, stream, offset): block b of the stream is
 * philox4x32_10(counter = {lo(b), hi(b), lo(stream), hi(stream)}, key = {lo(seed), hi(seed)}),
 * and each block gives four 32-bit words. The numbers therefore do not depend on thread
 * scheduling, or on how a request is split into calls: a rank can draw its part of a global
 * tensor by starting at the right offset.
 */
#ifndef FSDP_RNG_H
#define FSDP_RNG_H

#include <stddef.h>
#include <stdint.h>

#include <fsdp/export.h>

FSDP_BEGIN_DECLS

/* One Philox-4x32 block with 10 rounds, as published by Salmon et al. (Random123). */
FSDP_EXTERN void fsdp_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2],
                                    uint32_t out[4]);

/* A position in a Philox stream. Caller-allocated; plain data, may be copied. */
typedef struct fsdp_rng {
    uint64_t seed;   /* the key */
    uint64_t stream; /* the upper half of the counter, e.g. a rank or a tensor id */
    uint64_t offset; /* index of the next unused 4-word block */
} fsdp_rng_t;

/* Starts a stream at block 0. */
FSDP_EXTERN void fsdp_rng_init(fsdp_rng_t *rng, uint64_t seed, uint64_t stream);

/*
 * Fills out[0..n) with the words of blocks offset, offset+1, ... (four words a block, in order)
 * and advances offset by ceil(n / 4) blocks, so a call never shares a block with the next one.
 */
FSDP_EXTERN void fsdp_rng_u32(fsdp_rng_t *rng, uint32_t *out, size_t n);

/* Uniform floats in [lo, hi): each word w gives lo + (hi - lo) * (w >> 8) * 2^-24, computed in
 * double (exact, so fused or unfused multiply-add give the same bits) and rounded once to float;
 * a result that rounds up to hi is replaced by the float next to hi toward lo. Advances the
 * stream like fsdp_rng_u32(). Bitwise the same on every platform. */
FSDP_EXTERN void fsdp_rng_uniform_f32(fsdp_rng_t *rng, float *out, size_t n, float lo, float hi);

/* Normal floats (Box-Muller on pairs of words, computed in double): mean + std * z. Advances
 * the stream like fsdp_rng_u32() for n rounded up to even. The words are platform-independent,
 * but log/sqrt/cos/sin come from the C library, so another libm (or a GPU) may differ in the
 * last bit. */
FSDP_EXTERN void fsdp_rng_normal_f32(fsdp_rng_t *rng, float *out, size_t n, float mean,
                                     float std);

FSDP_END_DECLS

#endif /* FSDP_RNG_H */
