/* SPDX-License-Identifier: MIT */
/*
 * rng.c: Philox-4x32-10 and the stream functions built on it.
 *
 * Definitions (these are the contract; tests and other backends must reproduce them):
 *   Block b of stream (seed, stream) = philox4x32_10(ctr = {lo32(b), hi32(b), lo32(stream),
 *   hi32(stream)}, key = {lo32(seed), hi32(seed)}), giving words w[4b+0..4b+3].
 *   A call that consumes k words from offset o uses blocks o, o+1, ... in order, four words a
 *   block, and sets offset = o + ceil(k / 4): the unused tail of a last partial block is
 *   dropped, so a call never shares a block with the next one.
 *   fsdp_rng_u32 (k = n):
 *     out[i] = w[i]
 *   fsdp_rng_uniform_f32 (k = n):
 *     span = hi - lo                                  in float
 *     u = (w[i] >> 8) * 2^-24                         exact, in [0, 1 - 2^-24]
 *     out[i] = (float)(lo + span * u)                 in double: the product is exact, one
 *                                                     rounding to double, one to float
 *     except that a result that rounded exactly onto hi (hi != lo) is replaced by the float
 *     next to hi in the direction of lo, which keeps the range half-open.
 *   fsdp_rng_normal_f32 (k = n rounded up to even), pair j = words (w[2j], w[2j+1]), in double:
 *     u1 = ((w[2j] >> 8) + 1) * 2^-24                 in (0, 1], so log(u1) is finite
 *     u2 = (w[2j+1] >> 8) * 2^-24                     in [0, 1)
 *     r = sqrt(-2 ln u1), z0 = r cos(2 pi u2), z1 = r sin(2 pi u2)
 *     out[2j] = (float)(mean + std * z0), out[2j+1] = (float)(mean + std * z1)
 *     An odd n uses z0 of the last pair and drops its z1.
 * The u32 words and the uniform floats are bit-exact everywhere (only IEEE basic operations,
 * with no result that depends on multiply-add contraction). The normal floats also go through
 * libm's log/sqrt/cos/sin, so different libms may differ in the last bit.
 *
 * The generator has no state of its own: an fsdp_rng_t is plain data owned by the caller, so
 * concurrent use of different fsdp_rng_t objects needs no synchronisation.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <fsdp/rng.h>

#define PHILOX_M0 UINT32_C(0xD2511F53)
#define PHILOX_M1 UINT32_C(0xCD9E8D57)
#define PHILOX_W0 UINT32_C(0x9E3779B9) /* golden ratio */
#define PHILOX_W1 UINT32_C(0xBB67AE85) /* sqrt(3) - 1 */

static inline void philox_round(uint32_t x[4], uint32_t k0, uint32_t k1) {
    uint64_t p0 = (uint64_t)PHILOX_M0 * x[0];
    uint64_t p1 = (uint64_t)PHILOX_M1 * x[2];
    uint32_t y0 = (uint32_t)(p1 >> 32) ^ x[1] ^ k0;
    uint32_t y1 = (uint32_t)p1;
    uint32_t y2 = (uint32_t)(p0 >> 32) ^ x[3] ^ k1;
    uint32_t y3 = (uint32_t)p0;
    x[0] = y0;
    x[1] = y1;
    x[2] = y2;
    x[3] = y3;
}

void fsdp_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t x[4] = {ctr[0], ctr[1], ctr[2], ctr[3]};
    uint32_t k0 = key[0], k1 = key[1];
    /* The first round uses the key as given; the Weyl increment comes before each later one. */
    for (int r = 0; r < 10; r++) {
        if (r > 0) {
            k0 += PHILOX_W0;
            k1 += PHILOX_W1;
        }
        philox_round(x, k0, k1);
    }
    /* Copied at the end so that out may alias ctr. */
    memcpy(out, x, sizeof x);
}

/* Words of block `b` of the rng's stream. */
static inline void rng_block(const fsdp_rng_t *rng, uint64_t b, uint32_t w[4]) {
    const uint32_t ctr[4] = {(uint32_t)b, (uint32_t)(b >> 32), (uint32_t)rng->stream,
                             (uint32_t)(rng->stream >> 32)};
    const uint32_t key[2] = {(uint32_t)rng->seed, (uint32_t)(rng->seed >> 32)};
    fsdp_philox4x32_10(ctr, key, w);
}

/* Blocks used by k words. Written so that k near SIZE_MAX cannot overflow. */
static inline uint64_t blocks_for(size_t k) {
    return (uint64_t)(k / 4) + (k % 4 != 0);
}

void fsdp_rng_init(fsdp_rng_t *rng, uint64_t seed, uint64_t stream) {
    if (!rng) return;
    rng->seed = seed;
    rng->stream = stream;
    rng->offset = 0;
}

void fsdp_rng_u32(fsdp_rng_t *rng, uint32_t *out, size_t n) {
    if (!rng || (!out && n > 0)) return;
    uint64_t b = rng->offset;
    size_t i = 0;
    for (; i + 4 <= n; i += 4, b++)
        rng_block(rng, b, out + i);
    if (i < n) {
        uint32_t w[4];
        rng_block(rng, b, w);
        memcpy(out + i, w, (n - i) * sizeof w[0]);
    }
    rng->offset += blocks_for(n);
}

void fsdp_rng_uniform_f32(fsdp_rng_t *rng, float *out, size_t n, float lo, float hi) {
    if (!rng || (!out && n > 0)) return;
    float span = hi - lo;
    uint64_t b = rng->offset;
    for (size_t i = 0; i < n; i += 4, b++) {
        uint32_t w[4];
        rng_block(rng, b, w);
        size_t m = n - i < 4 ? n - i : 4;
        for (size_t j = 0; j < m; j++) {
            double u = (double)(w[j] >> 8) * 0x1p-24;
            /* span * u is exact in double (24 + 24 significant bits), so the result is the same
             * whether or not the compiler fuses the multiply and add. */
            float v = (float)((double)lo + (double)span * u);
            /* u < 1, but the sum can still round up onto hi (e.g. [1, 2) and u = 1 - 2^-24). */
            if (v == hi && hi != lo) v = nextafterf(hi, lo);
            out[i + j] = v;
        }
    }
    rng->offset += blocks_for(n);
}

void fsdp_rng_normal_f32(fsdp_rng_t *rng, float *out, size_t n, float mean, float std) {
    if (!rng || (!out && n > 0)) return;
    const double two_pi = 6.283185307179586476925286766559;
    uint64_t b = rng->offset;
    for (size_t i = 0; i < n; i += 4, b++) {
        uint32_t w[4];
        rng_block(rng, b, w);
        /* One block is two pairs: outputs i..i+3. */
        for (size_t p = 0; p < 2 && i + 2 * p < n; p++) {
            double u1 = ((double)(w[2 * p] >> 8) + 1.0) * 0x1p-24;
            double u2 = (double)(w[2 * p + 1] >> 8) * 0x1p-24;
            double r = sqrt(-2.0 * log(u1));
            double z0 = r * cos(two_pi * u2);
            out[i + 2 * p] = (float)((double)mean + (double)std * z0);
            if (i + 2 * p + 1 < n) {
                double z1 = r * sin(two_pi * u2);
                out[i + 2 * p + 1] = (float)((double)mean + (double)std * z1);
            }
        }
    }
    /* The header counts n rounded up to even; for odd n that is the same number of blocks,
     * ceil((n + 1) / 4) == ceil(n / 4), and this form cannot overflow at n = SIZE_MAX. */
    rng->offset += blocks_for(n);
}
