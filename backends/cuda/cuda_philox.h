/* SPDX-License-Identifier: MIT */
/*
 * cuda_philox.h: Philox-4x32-10 and dropout's keep rule as __host__ __device__ functions, so
 * that the CUDA kernels and a host test (which checks them bit for bit against
 * fsdp_philox4x32_10 and the CPU device's dropout) compile the same code.
 *
 * The layout is src/core/rng.c's and the CPU dropout's (src/device/cpu_nn_kernels.c): element
 * i of a dropout call with (seed, stream, offset) uses word i % 4 of block offset + i / 4, block
 * b being philox(ctr = {lo32(b), hi32(b), lo32(stream), hi32(stream)}, key = {lo32(seed),
 * hi32(seed)}); it is kept iff (word >> 8) >= ceil(p * 2^24). Only integer arithmetic, so it is
 * bitwise the same on every device and compiler.
 *
 * Plain C99 when not compiled by nvcc.
 */
#ifndef FSDP_CUDA_PHILOX_H
#define FSDP_CUDA_PHILOX_H

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define FSDP_CUDA_HD static __host__ __device__ __forceinline__
#else
#define FSDP_CUDA_HD static inline
#endif

/* Philox-4x32-10 of counter c and key k into out (out may alias c). */
FSDP_CUDA_HD void fsdp_cuda_philox(const uint32_t c[4], uint32_t k0, uint32_t k1, uint32_t out[4]) {
    uint32_t x0 = c[0], x1 = c[1], x2 = c[2], x3 = c[3];
    for (int r = 0; r < 10; r++) {
        /* The first round uses the key as given; later rounds bump it by the Weyl constants. */
        if (r > 0) {
            k0 += UINT32_C(0x9E3779B9);
            k1 += UINT32_C(0xBB67AE85);
        }
        const uint64_t p0 = (uint64_t)UINT32_C(0xD2511F53) * x0;
        const uint64_t p1 = (uint64_t)UINT32_C(0xCD9E8D57) * x2;
        const uint32_t y0 = (uint32_t)(p1 >> 32) ^ x1 ^ k0;
        const uint32_t y2 = (uint32_t)(p0 >> 32) ^ x3 ^ k1;
        x1 = (uint32_t)p1;
        x3 = (uint32_t)p0;
        x0 = y0;
        x2 = y2;
    }
    out[0] = x0;
    out[1] = x1;
    out[2] = x2;
    out[3] = x3;
}

/* The four words of block `b` of the stream (seed, stream). */
FSDP_CUDA_HD void fsdp_cuda_philox_block(uint64_t seed, uint64_t stream, uint64_t b,
                                         uint32_t w[4]) {
    const uint32_t c[4] = {(uint32_t)b, (uint32_t)(b >> 32), (uint32_t)stream,
                           (uint32_t)(stream >> 32)};
    fsdp_cuda_philox(c, (uint32_t)seed, (uint32_t)(seed >> 32), w);
}

/* Dropout's integer threshold for 0 < p < 1: ceil(p * 2^24), in [1, 2^24] (p * 2^24 is exact
 * in double). Host side: computed once per call and passed to the kernel. */
static inline uint32_t fsdp_cuda_dropout_threshold(double p) {
    return (uint32_t)ceil(p * 16777216.0);
}

/* Whether a word keeps its element. */
FSDP_CUDA_HD int fsdp_cuda_dropout_keep(uint32_t word, uint32_t thr) {
    return (word >> 8) >= thr;
}

#endif /* FSDP_CUDA_PHILOX_H */
