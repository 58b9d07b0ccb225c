/* SPDX-License-Identifier: MIT */
/*
 * cuda_grid.h: the launch geometry every kernel file of the CUDA device shares: THREADS a block,
 * grid-stride loops over at most MAX_BLOCKS blocks (blocks_for, GRID_LOOP), and the 32 x 32
 * thread tiles of the column reductions (TILE_C columns, TILE_R rows; tiles_for). Included by
 * .cu files only.
 */
#ifndef FSDP_CUDA_GRID_H
#define FSDP_CUDA_GRID_H

#include <stddef.h>

#define THREADS 256
#define MAX_BLOCKS 4096
#define TILE_C 32
#define TILE_R 32

/* Blocks of THREADS for n elements, at least 1, at most MAX_BLOCKS. */
static inline unsigned blocks_for(size_t n) {
    size_t b = (n + THREADS - 1) / THREADS;
    if (b == 0) b = 1;
    return (unsigned)(b < MAX_BLOCKS ? b : MAX_BLOCKS);
}

/* Tiles of TILE_C columns for n columns, at least 1, at most MAX_BLOCKS. */
static inline unsigned tiles_for(size_t n) {
    size_t b = (n + TILE_C - 1) / TILE_C;
    return (unsigned)(b == 0 ? 1 : b < MAX_BLOCKS ? b : MAX_BLOCKS);
}

#define GRID_LOOP(i, n)                                                                            \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                        \
         i += (size_t)gridDim.x * blockDim.x)

#endif /* FSDP_CUDA_GRID_H */
