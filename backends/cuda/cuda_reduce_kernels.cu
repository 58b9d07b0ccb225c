/* SPDX-License-Identifier: MIT */
/*
 * cuda_reduce_kernels.cu: the CUDA device's reductions (sums over rows or columns, maxima with
 * their index, sums of squares accumulated in double; see cuda_kernels.h). They run in a fixed
 * order that depends only on the shape and the launch configuration (fixed here), so results
 * are bitwise reproducible from run to run; they differ from the CPU's summation order within
 * rounding.
 */
#include <math.h>
#include <stdint.h>

#include <cuda_runtime.h>

#include "backends/cuda/cuda_grid.h"
#include "backends/cuda/cuda_kernels.h"

/* ---- reductions ---- */

/* Row sums (inner == 1): one block per row, each thread a strided partial, then a tree in
 * shared memory. Columns (inner > 1): one thread per output, summing over r in order, or, for
 * at least TILE_C columns of at least TILE_R * 2 rows, col_tile_k. */
template <typename T>
__global__ static void row_sum_k(size_t outer, size_t r, T al, const T *x, T *y) {
    __shared__ T sh[THREADS];
    for (size_t o = blockIdx.x; o < outer; o += gridDim.x) {
        const T *xo = x + o * r;
        T acc = 0;
        for (size_t j = threadIdx.x; j < r; j += blockDim.x)
            acc += xo[j];
        sh[threadIdx.x] = acc;
        __syncthreads();
        for (unsigned w = blockDim.x / 2; w > 0; w >>= 1) {
            if (threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
            __syncthreads();
        }
        if (threadIdx.x == 0) y[o] = sh[0] * al;
        __syncthreads();
    }
}

template <typename T>
__global__ static void col_sum_k(size_t outer, size_t r, size_t inner, T al, const T *x, T *y) {
    GRID_LOOP(k, outer * inner) {
        size_t o = k / inner, i = k % inner;
        const T *xo = x + o * r * inner + i;
        T acc = r > 0 ? xo[0] : (T)0;
        for (size_t j = 1; j < r; j++)
            acc += xo[j * inner];
        y[k] = al == (T)1 ? acc : acc * al;
    }
}

/* Column sums of x (outer, r, inner) by tiles: block (bx, by) takes TILE_C columns of slab
 * by; thread (c, t) sums rows t, t + TILE_R, ... of its column in order, then the TILE_R
 * partials meet in a fixed tree, so the order depends only on the shape (reproducible), and a
 * warp reads TILE_C consecutive elements of a row. */
template <typename T>
__global__ static void col_tile_k(size_t outer, size_t r, size_t inner, T al, const T *x, T *y) {
    __shared__ T sh[TILE_R][TILE_C + 1];
    const unsigned c = threadIdx.x, t = threadIdx.y;
    for (size_t o = blockIdx.y; o < outer; o += gridDim.y) {
        for (size_t i0 = (size_t)blockIdx.x * TILE_C; i0 < inner; i0 += (size_t)gridDim.x * TILE_C) {
            const size_t i = i0 + c;
            T acc = 0;
            if (i < inner) {
                const T *xo = x + o * r * inner + i;
                for (size_t j = t; j < r; j += TILE_R)
                    acc += xo[j * inner];
            }
            sh[t][c] = acc;
            __syncthreads();
            for (unsigned w = TILE_R / 2; w > 0; w >>= 1) {
                if (t < w) sh[t][c] += sh[t + w][c];
                __syncthreads();
            }
            if (t == 0 && i < inner) y[o * inner + i] = al == (T)1 ? sh[0][c] : sh[0][c] * al;
            __syncthreads();
        }
    }
}

extern "C" cudaError_t fsdp__cuda_k_reduce_sum(cudaStream_t s, bool f64, size_t outer, size_t r,
                                               size_t inner, double alpha, const void *x, void *y) {
    if (inner >= TILE_C && r >= 2 * TILE_R) {
        const dim3 g(tiles_for(inner), (unsigned)(outer < 65535 ? outer : 65535));
        const dim3 blk(TILE_C, TILE_R);
        if (f64)
            col_tile_k<double>
                <<<g, blk, 0, s>>>(outer, r, inner, alpha, (const double *)x, (double *)y);
        else
            col_tile_k<float>
                <<<g, blk, 0, s>>>(outer, r, inner, (float)alpha, (const float *)x, (float *)y);
    } else if (inner == 1) {
        unsigned g = (unsigned)(outer < 65535 ? outer : 65535);
        if (f64)
            row_sum_k<double>
                <<<g, THREADS, 0, s>>>(outer, r, alpha, (const double *)x, (double *)y);
        else
            row_sum_k<float>
                <<<g, THREADS, 0, s>>>(outer, r, (float)alpha, (const float *)x, (float *)y);
    } else {
        unsigned g = blocks_for(outer * inner);
        if (f64)
            col_sum_k<double>
                <<<g, THREADS, 0, s>>>(outer, r, inner, alpha, (const double *)x, (double *)y);
        else
            col_sum_k<float>
                <<<g, THREADS, 0, s>>>(outer, r, inner, (float)alpha, (const float *)x, (float *)y);
    }
    return cudaGetLastError();
}

/* True when (v, j) beats (best, bj): bigger, or NaN over a number, or equal (both NaN included)
 * with a smaller index, so the first maximum wins as on the CPU. */
template <typename T> __device__ static bool max_better(T v, int64_t j, T best, int64_t bj) {
    bool vn = v != v, bn = best != best;
    if (vn != bn) return vn;
    if (vn || v == best) return j < bj;
    return v > best;
}

template <typename T>
__global__ static void max_k(size_t outer, size_t r, size_t inner, const T *x, T *y, int64_t *idx) {
    GRID_LOOP(k, outer * inner) {
        size_t o = k / inner, i = k % inner;
        const T *xo = x + o * r * inner + i;
        T best = r > 0 ? xo[0] : -(T)INFINITY;
        int64_t bj = r > 0 ? 0 : -1;
        for (size_t j = 1; j < r; j++) {
            T v = xo[j * inner];
            if (v > best || (v != v && best == best)) {
                best = v;
                bj = (int64_t)j;
            }
        }
        y[k] = best;
        if (idx) idx[k] = bj;
    }
}

template <typename T>
__global__ static void row_max_k(size_t outer, size_t r, const T *x, T *y, int64_t *idx) {
    __shared__ T sv[THREADS];
    __shared__ int64_t si[THREADS];
    for (size_t o = blockIdx.x; o < outer; o += gridDim.x) {
        const T *xo = x + o * r;
        T best = -(T)INFINITY;
        int64_t bj = -1;
        for (size_t j = threadIdx.x; j < r; j += blockDim.x)
            if (bj < 0 || max_better<T>(xo[j], (int64_t)j, best, bj)) {
                best = xo[j];
                bj = (int64_t)j;
            }
        sv[threadIdx.x] = best;
        si[threadIdx.x] = bj;
        __syncthreads();
        for (unsigned w = blockDim.x / 2; w > 0; w >>= 1) {
            if (threadIdx.x < w) {
                int64_t oj = si[threadIdx.x + w];
                if (oj >= 0 &&
                    (si[threadIdx.x] < 0 ||
                     max_better<T>(sv[threadIdx.x + w], oj, sv[threadIdx.x], si[threadIdx.x]))) {
                    sv[threadIdx.x] = sv[threadIdx.x + w];
                    si[threadIdx.x] = oj;
                }
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            y[o] = sv[0];
            if (idx) idx[o] = si[0];
        }
        __syncthreads();
    }
}

extern "C" cudaError_t fsdp__cuda_k_reduce_max(cudaStream_t s, bool f64, size_t outer, size_t r,
                                               size_t inner, const void *x, void *y, int64_t *idx) {
    if (inner == 1 && r >= THREADS) {
        unsigned g = (unsigned)(outer < 65535 ? outer : 65535);
        if (f64)
            row_max_k<double><<<g, THREADS, 0, s>>>(outer, r, (const double *)x, (double *)y, idx);
        else
            row_max_k<float><<<g, THREADS, 0, s>>>(outer, r, (const float *)x, (float *)y, idx);
    } else {
        unsigned g = blocks_for(outer * inner);
        if (f64)
            max_k<double>
                <<<g, THREADS, 0, s>>>(outer, r, inner, (const double *)x, (double *)y, idx);
        else
            max_k<float><<<g, THREADS, 0, s>>>(outer, r, inner, (const float *)x, (float *)y, idx);
    }
    return cudaGetLastError();
}

/* Sum of squares in double: FSDP_CUDA_SUMSQ_BLOCKS partials, then one block adds them in a
 * fixed tree (deterministic: the grid size never depends on the device). */
template <typename T> __global__ static void sumsq_part_k(size_t n, const T *x, double *part) {
    __shared__ double sh[THREADS];
    double acc = 0.0;
    GRID_LOOP(i, n) {
        double v = (double)x[i];
        acc += v * v;
    }
    sh[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned w = blockDim.x / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) part[blockIdx.x] = sh[0];
}

template <typename T> __global__ static void sumsq_final_k(const double *part, T *out) {
    __shared__ double sh[FSDP_CUDA_SUMSQ_BLOCKS];
    sh[threadIdx.x] = part[threadIdx.x];
    __syncthreads();
    for (unsigned w = blockDim.x / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[0] = (T)sh[0];
}

extern "C" cudaError_t fsdp__cuda_k_sum_squares(cudaStream_t s, bool f64, size_t n, const void *x,
                                                double *scratch, void *out) {
    if (f64) {
        sumsq_part_k<double>
            <<<FSDP_CUDA_SUMSQ_BLOCKS, THREADS, 0, s>>>(n, (const double *)x, scratch);
        sumsq_final_k<double><<<1, FSDP_CUDA_SUMSQ_BLOCKS, 0, s>>>(scratch, (double *)out);
    } else {
        sumsq_part_k<float>
            <<<FSDP_CUDA_SUMSQ_BLOCKS, THREADS, 0, s>>>(n, (const float *)x, scratch);
        sumsq_final_k<float><<<1, FSDP_CUDA_SUMSQ_BLOCKS, 0, s>>>(scratch, (float *)out);
    }
    return cudaGetLastError();
}
