/* SPDX-License-Identifier: MIT */
/*
 * cuda_nn_kernels.cu: the CUDA device's neural-network kernels: softmax, layer and batch norm,
 * embedding, cross-entropy, dropout, SGD and Adam steps (contracts in device_impl.h).
 *
 * They follow the CPU reference (src/device/cpu_nn_kernels.c): element arithmetic in the
 * element type in PyTorch's order, sums over a row or a channel accumulated in double and
 * rounded once, scalar coefficients computed in double on the host and rounded once to the
 * element type. Row and channel kernels use one block per row (channel) and a fixed-shape tree
 * in shared memory, so results are bitwise reproducible run to run.
 *
 * Deterministic embedding backward: one thread per column of the embedding adds the rows of gy
 * in index order i = 0, 1, ..., exactly the CPU's order, so no atomics and the same floats.
 *
 * Dropout uses the Philox layout of src/core/rng.c through cuda_philox.h: its masks are bitwise
 * the CPU device's.
 */
#include <math.h>
#include <stdint.h>

#include <cuda_runtime.h>

#include "backends/cuda/cuda_grid.h"
#include "backends/cuda/cuda_kernels.h"
#include "backends/cuda/cuda_philox.h"

#define MAX_GRID_Y 65535

static unsigned rows_grid(size_t rows) {
    return (unsigned)(rows < MAX_GRID_Y ? (rows ? rows : 1) : MAX_GRID_Y);
}


/* Block-wide sum of one double per thread; every thread gets the total. sh has THREADS
 * entries. */
__device__ static double block_sum(double v, double *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned w = blockDim.x / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    double t = sh[0];
    __syncthreads();
    return t;
}

template <typename T> __device__ static T block_max(T v, T *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned w = blockDim.x / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w && sh[threadIdx.x + w] > sh[threadIdx.x])
            sh[threadIdx.x] = sh[threadIdx.x + w];
        __syncthreads();
    }
    T t = sh[0];
    __syncthreads();
    return t;
}

/* ---- softmax ---- */

/* One row: m = max, softmax = exp(x - m) * (1 / sum), log-softmax = (x - m) - log(sum). y may
 * alias x: every thread reads its elements before the barrier that precedes the writes. */
template <typename T>
__device__ static void softmax_row(bool lg, size_t n, const T *x, T *y, double *shd, T *sht) {
    T mx = n ? x[0] : (T)0;
    for (size_t j = threadIdx.x; j < n; j += blockDim.x)
        if (x[j] > mx) mx = x[j];
    mx = block_max<T>(mx, sht);
    double s = 0.0;
    for (size_t j = threadIdx.x; j < n; j += blockDim.x)
        s += (double)exp(x[j] - mx);
    s = block_sum(s, shd);
    if (lg) {
        const T lse = (T)log(s);
        for (size_t j = threadIdx.x; j < n; j += blockDim.x)
            y[j] = x[j] - mx - lse;
    } else {
        const T inv = (T)(1.0 / s);
        for (size_t j = threadIdx.x; j < n; j += blockDim.x)
            y[j] = exp(x[j] - mx) * inv;
    }
    __syncthreads();
}

template <typename T>
__global__ static void softmax_k(bool lg, size_t rows, size_t n, const T *x, T *y) {
    __shared__ double shd[THREADS];
    __shared__ T sht[THREADS];
    for (size_t r = blockIdx.x; r < rows; r += gridDim.x)
        softmax_row<T>(lg, n, x + r * n, y + r * n, shd, sht);
}

extern "C" cudaError_t fsdp__cuda_k_softmax(cudaStream_t s, bool f64, bool lg, size_t rows,
                                            size_t n, const void *x, void *y) {
    if (f64)
        softmax_k<double>
            <<<rows_grid(rows), THREADS, 0, s>>>(lg, rows, n, (const double *)x, (double *)y);
    else
        softmax_k<float>
            <<<rows_grid(rows), THREADS, 0, s>>>(lg, rows, n, (const float *)x, (float *)y);
    return cudaGetLastError();
}

template <typename T>
__global__ static void softmax_bwd_k(bool lg, size_t rows, size_t n, const T *y, const T *gy,
                                     T *gx) {
    __shared__ double shd[THREADS];
    for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *yr = y + r * n, *gr = gy + r * n;
        T *xr = gx + r * n;
        double s = 0.0;
        for (size_t j = threadIdx.x; j < n; j += blockDim.x)
            s += lg ? (double)gr[j] : (double)gr[j] * (double)yr[j];
        const T st = (T)block_sum(s, shd);
        for (size_t j = threadIdx.x; j < n; j += blockDim.x)
            xr[j] = lg ? gr[j] - exp(yr[j]) * st : yr[j] * (gr[j] - st);
    }
}

extern "C" cudaError_t fsdp__cuda_k_softmax_backward(cudaStream_t s, bool f64, bool lg, size_t rows,
                                                     size_t n, const void *y, const void *gy,
                                                     void *gx) {
    if (f64)
        softmax_bwd_k<double><<<rows_grid(rows), THREADS, 0, s>>>(lg, rows, n, (const double *)y,
                                                                  (const double *)gy, (double *)gx);
    else
        softmax_bwd_k<float><<<rows_grid(rows), THREADS, 0, s>>>(lg, rows, n, (const float *)y,
                                                                 (const float *)gy, (float *)gx);
    return cudaGetLastError();
}

/* ---- layer norm ---- */

template <typename T>
__global__ static void layer_norm_k(size_t rows, size_t n, double eps, const T *x, const T *w,
                                    const T *b, T *y, T *mean, T *rstd) {
    __shared__ double shd[THREADS];
    for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = x + r * n;
        T *yr = y + r * n;
        double s = 0.0;
        for (size_t j = threadIdx.x; j < n; j += blockDim.x)
            s += (double)xr[j];
        s = block_sum(s, shd);
        const double mu = n ? s / (double)n : 0.0;
        double ss = 0.0;
        for (size_t j = threadIdx.x; j < n; j += blockDim.x) {
            double d = (double)xr[j] - mu;
            ss += d * d;
        }
        ss = block_sum(ss, shd);
        const double var = n ? ss / (double)n : 0.0;
        const T mt = (T)mu, rt = (T)(1.0 / sqrt(var + eps));
        if (threadIdx.x == 0) {
            mean[r] = mt;
            rstd[r] = rt;
        }
        for (size_t j = threadIdx.x; j < n; j += blockDim.x) {
            T v = (xr[j] - mt) * rt;
            if (w) v *= w[j];
            if (b) v += b[j];
            yr[j] = v;
        }
    }
}

extern "C" cudaError_t fsdp__cuda_k_layer_norm(cudaStream_t s, bool f64, size_t rows, size_t n,
                                               double eps, const void *x, const void *w,
                                               const void *b, void *y, void *mean, void *rstd) {
    if (f64)
        layer_norm_k<double><<<rows_grid(rows), THREADS, 0, s>>>(
            rows, n, eps, (const double *)x, (const double *)w, (const double *)b, (double *)y,
            (double *)mean, (double *)rstd);
    else
        layer_norm_k<float><<<rows_grid(rows), THREADS, 0, s>>>(
            rows, n, eps, (const float *)x, (const float *)w, (const float *)b, (float *)y,
            (float *)mean, (float *)rstd);
    return cudaGetLastError();
}

template <typename T>
__global__ static void layer_norm_gx_k(size_t rows, size_t n, const T *x, const T *w, const T *mean,
                                       const T *rstd, const T *gy, T *gx) {
    __shared__ double shd[THREADS];
    for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = x + r * n, *gr = gy + r * n;
        T *dr = gx + r * n;
        const T mt = mean[r], rt = rstd[r];
        double sg = 0.0, sgx = 0.0;
        for (size_t j = threadIdx.x; j < n; j += blockDim.x) {
            T xh = (xr[j] - mt) * rt;
            T g = w ? gr[j] * w[j] : gr[j];
            sg += (double)g;
            sgx += (double)g * (double)xh;
        }
        sg = block_sum(sg, shd);
        sgx = block_sum(sgx, shd);
        const T c1 = (T)(sg / (double)n), c2 = (T)(sgx / (double)n);
        for (size_t j = threadIdx.x; j < n; j += blockDim.x) {
            T xh = (xr[j] - mt) * rt;
            T g = w ? gr[j] * w[j] : gr[j];
            dr[j] = (g - c1 - xh * c2) * rt;
        }
    }
}

/* gw, gb: a block of TILE_C x TILE_R threads per TILE_C columns. Thread (c, t) sums rows t,
 * t + TILE_R, ... of column c in double, in order; the TILE_R partials of a column are then
 * added in a fixed tree. The order depends only on the shape, so the sums are reproducible; the
 * block reads TILE_C consecutive floats of a row per warp (coalesced). */
template <typename T>
__global__ static void layer_norm_gwb_k(size_t rows, size_t n, const T *x, const T *mean,
                                        const T *rstd, const T *gy, T *gw, T *gb) {
    __shared__ double shw[TILE_R][TILE_C + 1], shb[TILE_R][TILE_C + 1];
    const unsigned c = threadIdx.x, t = threadIdx.y;
    for (size_t j0 = (size_t)blockIdx.x * TILE_C; j0 < n; j0 += (size_t)gridDim.x * TILE_C) {
        const size_t j = j0 + c;
        double aw = 0.0, ab = 0.0;
        if (j < n)
            for (size_t r = t; r < rows; r += TILE_R) {
                const T g = gy[r * n + j];
                const T xh = (x[r * n + j] - mean[r]) * rstd[r];
                aw += (double)g * (double)xh;
                ab += (double)g;
            }
        shw[t][c] = aw;
        shb[t][c] = ab;
        __syncthreads();
        for (unsigned w = TILE_R / 2; w > 0; w >>= 1) {
            if (t < w) {
                shw[t][c] += shw[t + w][c];
                shb[t][c] += shb[t + w][c];
            }
            __syncthreads();
        }
        if (t == 0 && j < n) {
            if (gw) gw[j] += (T)shw[0][c];
            if (gb) gb[j] += (T)shb[0][c];
        }
        __syncthreads();
    }
}

extern "C" cudaError_t fsdp__cuda_k_layer_norm_backward(cudaStream_t s, bool f64, size_t rows,
                                                        size_t n, const void *x, const void *w,
                                                        const void *mean, const void *rstd,
                                                        const void *gy, void *gx, void *gw,
                                                        void *gb) {
    if (gx && n > 0) {
        if (f64)
            layer_norm_gx_k<double><<<rows_grid(rows), THREADS, 0, s>>>(
                rows, n, (const double *)x, (const double *)w, (const double *)mean,
                (const double *)rstd, (const double *)gy, (double *)gx);
        else
            layer_norm_gx_k<float><<<rows_grid(rows), THREADS, 0, s>>>(
                rows, n, (const float *)x, (const float *)w, (const float *)mean,
                (const float *)rstd, (const float *)gy, (float *)gx);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
    }
    if (gw || gb) {
        const dim3 blk(TILE_C, TILE_R);
        if (f64)
            layer_norm_gwb_k<double><<<tiles_for(n), blk, 0, s>>>(
                rows, n, (const double *)x, (const double *)mean, (const double *)rstd,
                (const double *)gy, (double *)gw, (double *)gb);
        else
            layer_norm_gwb_k<float><<<tiles_for(n), blk, 0, s>>>(
                rows, n, (const float *)x, (const float *)mean, (const float *)rstd,
                (const float *)gy, (float *)gw, (float *)gb);
    }
    return cudaGetLastError();
}

/* ---- batch norm: x (nb, c, l); one block per channel ---- */

template <typename T>
__global__ static void batch_norm_k(bool train, size_t nb, size_t c, size_t l, double eps,
                                    double momentum, const T *x, const T *w, const T *b, T *rmean,
                                    T *rvar, T *y, T *mean, T *rstd) {
    __shared__ double shd[THREADS];
    const size_t cnt = nb * l;
    for (size_t ch = blockIdx.x; ch < c; ch += gridDim.x) {
        double mu, rs;
        if (train) {
            double s = 0.0, ss = 0.0;
            for (size_t k = threadIdx.x; k < cnt; k += blockDim.x)
                s += (double)x[((k / l) * c + ch) * l + k % l];
            s = block_sum(s, shd);
            mu = cnt ? s / (double)cnt : 0.0;
            for (size_t k = threadIdx.x; k < cnt; k += blockDim.x) {
                double d = (double)x[((k / l) * c + ch) * l + k % l] - mu;
                ss += d * d;
            }
            ss = block_sum(ss, shd);
            rs = 1.0 / sqrt((cnt ? ss / (double)cnt : 0.0) + eps);
            if (threadIdx.x == 0) {
                if (cnt > 0 && rmean)
                    rmean[ch] = (T)(momentum * mu + (1.0 - momentum) * (double)rmean[ch]);
                if (cnt > 0 && rvar)
                    rvar[ch] = (T)(momentum * (ss / ((double)cnt - 1.0)) +
                                   (1.0 - momentum) * (double)rvar[ch]);
            }
        } else {
            mu = (double)rmean[ch];
            rs = 1.0 / sqrt((double)rvar[ch] + eps);
        }
        const T mt = (T)mu, rt = (T)rs;
        if (threadIdx.x == 0) {
            mean[ch] = mt;
            rstd[ch] = rt;
        }
        const T alpha = w ? rt * w[ch] : rt, beta = b ? b[ch] : (T)0;
        for (size_t k = threadIdx.x; k < cnt; k += blockDim.x) {
            size_t off = ((k / l) * c + ch) * l + k % l;
            y[off] = (x[off] - mt) * alpha + beta;
        }
        __syncthreads();
    }
}

extern "C" cudaError_t fsdp__cuda_k_batch_norm(cudaStream_t s, bool f64, bool train, size_t nb,
                                               size_t c, size_t l, double eps, double momentum,
                                               const void *x, const void *w, const void *b,
                                               void *rmean, void *rvar, void *y, void *mean,
                                               void *rstd) {
    if (f64)
        batch_norm_k<double><<<rows_grid(c), THREADS, 0, s>>>(
            train, nb, c, l, eps, momentum, (const double *)x, (const double *)w, (const double *)b,
            (double *)rmean, (double *)rvar, (double *)y, (double *)mean, (double *)rstd);
    else
        batch_norm_k<float><<<rows_grid(c), THREADS, 0, s>>>(
            train, nb, c, l, eps, momentum, (const float *)x, (const float *)w, (const float *)b,
            (float *)rmean, (float *)rvar, (float *)y, (float *)mean, (float *)rstd);
    return cudaGetLastError();
}

template <typename T>
__global__ static void batch_norm_bwd_k(bool train, size_t nb, size_t c, size_t l, const T *x,
                                        const T *w, const T *mean, const T *rstd, const T *gy,
                                        T *gx, T *gw, T *gb) {
    __shared__ double shd[THREADS];
    const size_t cnt = nb * l;
    for (size_t ch = blockIdx.x; ch < c; ch += gridDim.x) {
        const T mt = mean[ch], rt = rstd[ch];
        const double mu = (double)mt, rs = (double)rt;
        double sg = 0.0, dot = 0.0;
        for (size_t k = threadIdx.x; k < cnt; k += blockDim.x) {
            size_t off = ((k / l) * c + ch) * l + k % l;
            sg += (double)gy[off];
            dot += (double)gy[off] * ((double)x[off] - mu);
        }
        sg = block_sum(sg, shd);
        dot = block_sum(dot, shd);
        if (gx) {
            const T scale = w ? rt * w[ch] : rt;
            const bool full = train && cnt > 0;
            const T kc = full ? (T)(dot * rs * rs / (double)cnt) : (T)0;
            const T gm = full ? (T)(sg / (double)cnt) : (T)0;
            for (size_t k = threadIdx.x; k < cnt; k += blockDim.x) {
                size_t off = ((k / l) * c + ch) * l + k % l;
                gx[off] = full ? (gy[off] - gm - (x[off] - mt) * kc) * scale : gy[off] * scale;
            }
        }
        if (threadIdx.x == 0) {
            if (gw) gw[ch] += (T)(dot * rs);
            if (gb) gb[ch] += (T)sg;
        }
        __syncthreads();
    }
}

extern "C" cudaError_t
fsdp__cuda_k_batch_norm_backward(cudaStream_t s, bool f64, bool train, size_t nb, size_t c,
                                 size_t l, const void *x, const void *w, const void *mean,
                                 const void *rstd, const void *gy, void *gx, void *gw, void *gb) {
    if (f64)
        batch_norm_bwd_k<double><<<rows_grid(c), THREADS, 0, s>>>(
            train, nb, c, l, (const double *)x, (const double *)w, (const double *)mean,
            (const double *)rstd, (const double *)gy, (double *)gx, (double *)gw, (double *)gb);
    else
        batch_norm_bwd_k<float><<<rows_grid(c), THREADS, 0, s>>>(
            train, nb, c, l, (const float *)x, (const float *)w, (const float *)mean,
            (const float *)rstd, (const float *)gy, (float *)gx, (float *)gw, (float *)gb);
    return cudaGetLastError();
}

/* ---- embedding ---- */

template <typename T>
__global__ static void embedding_k(size_t n, size_t dim, const int64_t *idx, const T *w, T *y) {
    GRID_LOOP(k, n * dim) {
        size_t i = k / dim, j = k % dim;
        y[k] = w[(size_t)idx[i] * dim + j];
    }
}

extern "C" cudaError_t fsdp__cuda_k_embedding(cudaStream_t s, bool f64, size_t n, size_t dim,
                                              const int64_t *idx, const void *w, void *y) {
    unsigned g = blocks_for(n * dim);
    if (f64)
        embedding_k<double><<<g, THREADS, 0, s>>>(n, dim, idx, (const double *)w, (double *)y);
    else
        embedding_k<float><<<g, THREADS, 0, s>>>(n, dim, idx, (const float *)w, (float *)y);
    return cudaGetLastError();
}

/* Thread (j, b) owns column j of the rows t of gw with t % nb == b: it alone writes them, in
 * index order, so every element gets its additions in the same order as with one thread per
 * column (the result does not depend on nb), while dim * nb threads share the work. Each scans
 * every index; a warp's threads read the same one. */
template <typename T>
__global__ static void embedding_bwd_k(size_t n, size_t dim, size_t nb, const int64_t *idx,
                                       int64_t pad, const T *gy, T *gw) {
    GRID_LOOP(k, dim * nb) {
        const size_t j = k % dim, b = k / dim;
        for (size_t i = 0; i < n; i++) {
            const int64_t t = idx[i];
            if ((pad >= 0 && t == pad) || (size_t)t % nb != b) continue;
            gw[(size_t)t * dim + j] += gy[i * dim + j];
        }
    }
}

extern "C" cudaError_t fsdp__cuda_k_embedding_backward(cudaStream_t s, bool f64, size_t n,
                                                       size_t dim, const int64_t *idx,
                                                       int64_t padding_idx, const void *gy,
                                                       void *gw) {
    /* About 64K threads in all, at most 256 row classes. */
    size_t nb = dim > 0 ? 65536 / dim : 1;
    nb = nb < 1 ? 1 : nb > 256 ? 256 : nb;
    unsigned g = blocks_for(dim * nb);
    if (f64)
        embedding_bwd_k<double><<<g, THREADS, 0, s>>>(n, dim, nb, idx, padding_idx,
                                                      (const double *)gy, (double *)gw);
    else
        embedding_bwd_k<float><<<g, THREADS, 0, s>>>(n, dim, nb, idx, padding_idx,
                                                     (const float *)gy, (float *)gw);
    return cudaGetLastError();
}

/* ---- cross-entropy ---- */

/* A target outside [0, n) (and not ignore_index) cannot be reported from a kernel without a
 * synchronization, so its row's loss is NaN, which the training loop sees in the loss. */
template <typename T>
__global__ static void cross_entropy_k(size_t rows, size_t n, const T *logits,
                                       const int64_t *target, int64_t ignore, double ls, T *loss,
                                       T *logp) {
    __shared__ double shd[THREADS];
    __shared__ T sht[THREADS];
    for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
        T *lp = logp + r * n;
        softmax_row<T>(true, n, logits + r * n, lp, shd, sht);
        const int64_t t = target[r];
        double s = 0.0;
        if (ls != 0.0)
            for (size_t j = threadIdx.x; j < n; j += blockDim.x)
                s += (double)lp[j];
        s = block_sum(s, shd);
        if (threadIdx.x == 0) {
            if (t == ignore) {
                loss[r] = (T)0;
            } else if (t < 0 || (uint64_t)t >= (uint64_t)n) {
                loss[r] = (T)NAN;
            } else {
                double v = -(1.0 - ls) * (double)lp[t];
                if (ls != 0.0) v -= ls / (double)n * s;
                loss[r] = (T)v;
            }
        }
    }
}

extern "C" cudaError_t fsdp__cuda_k_cross_entropy(cudaStream_t s, bool f64, size_t rows, size_t n,
                                                  const void *logits, const int64_t *target,
                                                  int64_t ignore_index, double ls, void *loss,
                                                  void *logp) {
    if (f64)
        cross_entropy_k<double><<<rows_grid(rows), THREADS, 0, s>>>(rows, n, (const double *)logits,
                                                                    target, ignore_index, ls,
                                                                    (double *)loss, (double *)logp);
    else
        cross_entropy_k<float><<<rows_grid(rows), THREADS, 0, s>>>(
            rows, n, (const float *)logits, target, ignore_index, ls, (float *)loss, (float *)logp);
    return cudaGetLastError();
}

template <typename T>
__global__ static void cross_entropy_bwd_k(size_t rows, size_t n, const T *logp,
                                           const int64_t *target, int64_t ignore, T smooth,
                                           T onehot, const T *gloss, T *gx) {
    GRID_LOOP(k, rows * n) {
        size_t r = k / n, j = k % n;
        const int64_t t = target[r];
        if (t == ignore) {
            gx[k] = (T)0;
        } else if (t < 0 || (uint64_t)t >= (uint64_t)n) {
            gx[k] = (T)NAN;
        } else {
            T v = exp(logp[k]) - smooth;
            if ((int64_t)j == t) v -= onehot;
            gx[k] = gloss[r] * v;
        }
    }
}

extern "C" cudaError_t fsdp__cuda_k_cross_entropy_backward(cudaStream_t s, bool f64, size_t rows,
                                                           size_t n, const void *logp,
                                                           const int64_t *target,
                                                           int64_t ignore_index, double ls,
                                                           const void *gloss, void *gx) {
    unsigned g = blocks_for(rows * n);
    if (f64)
        cross_entropy_bwd_k<double><<<g, THREADS, 0, s>>>(rows, n, (const double *)logp, target,
                                                          ignore_index, ls / (double)n, 1.0 - ls,
                                                          (const double *)gloss, (double *)gx);
    else
        cross_entropy_bwd_k<float><<<g, THREADS, 0, s>>>(
            rows, n, (const float *)logp, target, ignore_index, (float)(ls / (double)n),
            (float)(1.0 - ls), (const float *)gloss, (float *)gx);
    return cudaGetLastError();
}

/* ---- dropout: one thread per Philox block of four elements ---- */

template <typename T>
__global__ static void dropout_k(size_t n, int mode, uint32_t thr, T scale, uint64_t seed,
                                 uint64_t stream, uint64_t offset, const T *x, T *y,
                                 uint8_t *mask) {
    GRID_LOOP(q, (n + 3) / 4) {
        size_t i0 = q * 4;
        size_t m = n - i0 < 4 ? n - i0 : 4;
        uint32_t w[4] = {0, 0, 0, 0};
        if (mode == 0) fsdp_cuda_philox_block(seed, stream, offset + (uint64_t)q, w);
        for (size_t j = 0; j < m; j++) {
            /* mode 1: p <= 0 keeps all (y = x); mode 2: p >= 1 drops all. */
            bool keep = mode == 1 ? true : mode == 2 ? false : fsdp_cuda_dropout_keep(w[j], thr);
            y[i0 + j] = mode == 1 ? x[i0 + j] : keep ? x[i0 + j] * scale : (T)0;
            if (mask) mask[i0 + j] = (uint8_t)keep;
        }
    }
}

extern "C" cudaError_t fsdp__cuda_k_dropout(cudaStream_t s, bool f64, size_t n, int mode,
                                            uint32_t thr, double p, uint64_t seed, uint64_t stream,
                                            uint64_t offset, const void *x, void *y,
                                            uint8_t *mask) {
    unsigned g = blocks_for((n + 3) / 4);
    if (f64) {
        const double scale = mode == 0 ? 1.0 / (1.0 - p) : 1.0;
        dropout_k<double><<<g, THREADS, 0, s>>>(n, mode, thr, scale, seed, stream, offset,
                                                (const double *)x, (double *)y, mask);
    } else {
        /* (T)1 / (T)(1 - p), as the CPU: 1 - p rounded to float first. */
        const float scale = mode == 0 ? 1.0f / (float)(1.0 - p) : 1.0f;
        dropout_k<float><<<g, THREADS, 0, s>>>(n, mode, thr, scale, seed, stream, offset,
                                               (const float *)x, (float *)y, mask);
    }
    return cudaGetLastError();
}

/* ---- optimizers ---- */

template <typename T>
__global__ static void sgd_k(size_t n, T *p, const T *g, T *buf, T wdt, T mom, T damp, T nlr,
                             bool use_wd, bool use_mom, bool nesterov, bool first) {
    GRID_LOOP(i, n) {
        T d = g[i];
        if (use_wd) d = d + wdt * p[i];
        if (use_mom) {
            T bv = first ? d : buf[i] * mom + damp * d;
            buf[i] = bv;
            d = nesterov ? d + mom * bv : bv;
        }
        p[i] = p[i] + nlr * d;
    }
}

extern "C" cudaError_t fsdp__cuda_k_sgd_step(cudaStream_t s, bool f64, size_t n, void *p,
                                             const void *g, void *buf, double lr, double momentum,
                                             double dampening, double wd, bool nesterov,
                                             bool first) {
    unsigned gr = blocks_for(n);
    const bool use_wd = wd != 0.0, use_mom = momentum != 0.0;
    if (f64)
        sgd_k<double><<<gr, THREADS, 0, s>>>(n, (double *)p, (const double *)g, (double *)buf, wd,
                                             momentum, 1.0 - dampening, -lr, use_wd, use_mom,
                                             nesterov, first);
    else
        sgd_k<float><<<gr, THREADS, 0, s>>>(n, (float *)p, (const float *)g, (float *)buf,
                                            (float)wd, (float)momentum, (float)(1.0 - dampening),
                                            (float)(-lr), use_wd, use_mom, nesterov, first);
    return cudaGetLastError();
}

template <typename T> struct adam_coef { T b1, omb1, b2, omb2, bc2_sqrt, eps, nstep, wd, decay; };

template <typename T>
__global__ static void adam_k(size_t n, T *p, const T *g, T *m, T *v, T *vmax, adam_coef<T> c,
                              bool decoupled, bool couple_wd, bool amsgrad) {
    GRID_LOOP(i, n) {
        T gi = g[i];
        if (decoupled)
            p[i] = p[i] * c.decay;
        else if (couple_wd)
            gi = gi + c.wd * p[i];
        const T mi = m[i] * c.b1 + c.omb1 * gi;
        const T vi = v[i] * c.b2 + c.omb2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        T vs = vi;
        if (amsgrad) {
            T a = vmax[i];
            vs = (a > vi || a != a) ? a : vi;
            vmax[i] = vs;
        }
        const T denom = sqrt(vs) / c.bc2_sqrt + c.eps;
        p[i] = p[i] + c.nstep * mi / denom;
    }
}

template <typename T>
static adam_coef<T> adam_coefs(double lr, double beta1, double beta2, double eps, double wd,
                               int64_t t) {
    const double bc1 = 1.0 - pow(beta1, (double)t), bc2 = 1.0 - pow(beta2, (double)t);
    adam_coef<T> c;
    c.b1 = (T)beta1;
    c.omb1 = (T)(1.0 - beta1);
    c.b2 = (T)beta2;
    c.omb2 = (T)(1.0 - beta2);
    c.bc2_sqrt = (T)sqrt(bc2);
    c.eps = (T)eps;
    c.nstep = (T)(-(lr / bc1));
    c.wd = (T)wd;
    c.decay = (T)(1.0 - lr * wd);
    return c;
}

extern "C" cudaError_t fsdp__cuda_k_adam_step(cudaStream_t s, bool f64, size_t n, void *p,
                                              const void *g, void *m, void *v, void *vmax,
                                              double lr, double beta1, double beta2, double eps,
                                              double wd, bool decoupled, bool amsgrad, int64_t t) {
    unsigned gr = blocks_for(n);
    const bool couple_wd = !decoupled && wd != 0.0;
    if (f64)
        adam_k<double><<<gr, THREADS, 0, s>>>(
            n, (double *)p, (const double *)g, (double *)m, (double *)v, (double *)vmax,
            adam_coefs<double>(lr, beta1, beta2, eps, wd, t), decoupled, couple_wd, amsgrad);
    else
        adam_k<float><<<gr, THREADS, 0, s>>>(
            n, (float *)p, (const float *)g, (float *)m, (float *)v, (float *)vmax,
            adam_coefs<float>(lr, beta1, beta2, eps, wd, t), decoupled, couple_wd, amsgrad);
    return cudaGetLastError();
}
