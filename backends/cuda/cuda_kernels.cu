/* SPDX-License-Identifier: MIT */
/*
 * cuda_kernels.cu: the CUDA device's elementwise kernels, strided copies, the gemm helper and
 * the reduction of a collective (see cuda_kernels.h; device_impl.h has each kernel's contract).
 * The reductions over a tensor's rows or columns are in cuda_reduce_kernels.cu.
 *
 * Numerics follow the CPU reference (src/device/cpu_kernels.c): element arithmetic in the
 * element type.
 *
 * Grids are grid-stride loops over at most MAX_BLOCKS blocks of THREADS threads (cuda_grid.h).
 */
#include <math.h>
#include <stdint.h>

#include <cuda_runtime.h>

#include <fsdp/dtype.h>

#include "backends/cuda/cuda_cast.h"
#include "backends/cuda/cuda_grid.h"
#include "backends/cuda/cuda_kernels.h"


/* ---- fill ---- */

template <typename U> __global__ void fill_k(U *y, U v, size_t n) {
    GRID_LOOP(i, n) y[i] = v;
}

extern "C" cudaError_t fsdp__cuda_k_fill(cudaStream_t s, size_t es, uint64_t bits, size_t n,
                                         void *y) {
    unsigned g = blocks_for(n);
    switch (es) {
    case 1:
        fill_k<<<g, THREADS, 0, s>>>((uint8_t *)y, (uint8_t)bits, n);
        break;
    case 2:
        fill_k<<<g, THREADS, 0, s>>>((uint16_t *)y, (uint16_t)bits, n);
        break;
    case 4:
        fill_k<<<g, THREADS, 0, s>>>((uint32_t *)y, (uint32_t)bits, n);
        break;
    default:
        fill_k<<<g, THREADS, 0, s>>>((uint64_t *)y, (uint64_t)bits, n);
        break;
    }
    return cudaGetLastError();
}

/* In place (y == x with equal sizes) is safe: each element is read before it is written by the
 * same thread. */
__global__ static void cast_k(int yt, void *y, int xt, const void *x, size_t n) {
    GRID_LOOP(i, n) fsdp_cuda_cast_one(yt, y, xt, x, i);
}

/* f32 <-> bf16, the casts of mixed precision: four elements per thread with 16- and 8-byte
 * accesses when both buffers are aligned for them (vec), else one. The first threads of the
 * grid take the n % 4 elements after the last group. X4 and Y4 are the four-element vector
 * types of X and Y; F converts one element. */
struct to_bf16 {
    __device__ uint16_t operator()(float f) const {
        return fsdp_cc_f32_to_bf16(f);
    }
};
struct from_bf16 {
    __device__ float operator()(uint16_t h) const {
        return fsdp_cc_bf16_to_f32_q(h);
    }
};

template <typename Y, typename X, typename Y4, typename X4, typename F>
__global__ static void cast4_k(Y *y, const X *x, size_t n, bool vec) {
    const F f;
    if (!vec) {
        GRID_LOOP(i, n) y[i] = f(x[i]);
        return;
    }
    const size_t n4 = n / 4, tail = (size_t)blockIdx.x * blockDim.x + threadIdx.x + n4 * 4;
    GRID_LOOP(i, n4) {
        const X4 v = ((const X4 *)x)[i];
        Y4 o;
        o.x = f(v.x);
        o.y = f(v.y);
        o.z = f(v.z);
        o.w = f(v.w);
        ((Y4 *)y)[i] = o;
    }
    if (tail < n) y[tail] = f(x[tail]);
}

static bool aligned(const void *p, size_t a) {
    return (uintptr_t)p % a == 0;
}

extern "C" cudaError_t fsdp__cuda_k_cast(cudaStream_t s, int yt, void *y, int xt, const void *x,
                                         size_t n) {
    if (xt == FSDP_DTYPE_F32 && yt == FSDP_DTYPE_BF16) {
        const bool vec = aligned(x, 16) && aligned(y, 8);
        cast4_k<uint16_t, float, ushort4, float4, to_bf16>
            <<<blocks_for(vec ? (n + 3) / 4 : n), THREADS, 0, s>>>((uint16_t *)y,
                                                                  (const float *)x, n, vec);
    } else if (xt == FSDP_DTYPE_BF16 && yt == FSDP_DTYPE_F32) {
        const bool vec = aligned(x, 8) && aligned(y, 16);
        cast4_k<float, uint16_t, float4, ushort4, from_bf16>
            <<<blocks_for(vec ? (n + 3) / 4 : n), THREADS, 0, s>>>((float *)y,
                                                                  (const uint16_t *)x, n, vec);
    } else {
        cast_k<<<blocks_for(n), THREADS, 0, s>>>(yt, y, xt, x, n);
    }
    return cudaGetLastError();
}

/* ---- strided copy and binary ---- */

/* Offsets of the element with linear (row-major) index i in the operands, in index type I
 * (int32_t when the plan says every offset fits: 64-bit division is several times slower). */
template <typename I>
__device__ static void nd_offsets(const fsdp_cuda_nd &p, I i, I *o0, I *o1) {
    I a = 0, b = 0;
    for (int d = p.nd - 1; d >= 0; d--) {
        const I sh = (I)p.shape[d];
        const I c = i % sh;
        i /= sh;
        a += c * (I)p.st[0][d];
        b += c * (I)p.st[1][d];
    }
    *o0 = a;
    *o1 = b;
}

template <typename U, typename I>
__global__ static void copy_strided_k(fsdp_cuda_nd p, int64_t total, U *y, const U *x) {
    GRID_LOOP(i, (size_t)total) {
        I ox, unused;
        nd_offsets<I>(p, (I)i, &ox, &unused);
        y[i] = x[ox];
    }
}

template <typename U>
static void launch_copy_strided(cudaStream_t s, const fsdp_cuda_nd *p, int64_t total, void *y,
                                const void *x) {
    const unsigned g = blocks_for((size_t)total);
    if (p->i32)
        copy_strided_k<U, int32_t><<<g, THREADS, 0, s>>>(*p, total, (U *)y, (const U *)x);
    else
        copy_strided_k<U, int64_t><<<g, THREADS, 0, s>>>(*p, total, (U *)y, (const U *)x);
}

extern "C" cudaError_t fsdp__cuda_k_copy_strided(cudaStream_t s, size_t es,
                                                 const struct fsdp_cuda_nd *p, int64_t total,
                                                 void *y, const void *x) {
    switch (es) {
    case 1:
        launch_copy_strided<uint8_t>(s, p, total, y, x);
        break;
    case 2:
        launch_copy_strided<uint16_t>(s, p, total, y, x);
        break;
    case 4:
        launch_copy_strided<uint32_t>(s, p, total, y, x);
        break;
    default:
        launch_copy_strided<uint64_t>(s, p, total, y, x);
        break;
    }
    return cudaGetLastError();
}

template <typename T> __device__ static T bin_op(int op, T A, T B) {
    switch (op) {
    case FSDP_CUDA_BIN_ADD:
        return A + B;
    case FSDP_CUDA_BIN_SUB:
        return A - B;
    case FSDP_CUDA_BIN_MUL:
        return A * B;
    case FSDP_CUDA_BIN_DIV:
        return A / B;
    case FSDP_CUDA_BIN_MAX:
        return (A > B || A != A) ? A : B;
    default:
        return (A < B || A != A) ? A : B;
    }
}

template <typename T, typename I>
__global__ static void binary_k(int op, fsdp_cuda_nd p, int64_t total, T *y, const T *a,
                                const T *b) {
    GRID_LOOP(i, (size_t)total) {
        I oa, ob;
        nd_offsets<I>(p, (I)i, &oa, &ob);
        y[i] = bin_op<T>(op, a[oa], b[ob]);
    }
}

template <typename T>
static void launch_binary(cudaStream_t s, int op, const fsdp_cuda_nd *p, int64_t total, void *y,
                          const void *a, const void *b) {
    const unsigned g = blocks_for((size_t)total);
    if (p->i32)
        binary_k<T, int32_t>
            <<<g, THREADS, 0, s>>>(op, *p, total, (T *)y, (const T *)a, (const T *)b);
    else
        binary_k<T, int64_t>
            <<<g, THREADS, 0, s>>>(op, *p, total, (T *)y, (const T *)a, (const T *)b);
}

extern "C" cudaError_t fsdp__cuda_k_binary(cudaStream_t s, bool f64, int op,
                                           const struct fsdp_cuda_nd *p, int64_t total, void *y,
                                           const void *a, const void *b) {
    if (f64)
        launch_binary<double>(s, op, p, total, y, a, b);
    else
        launch_binary<float>(s, op, p, total, y, a, b);
    return cudaGetLastError();
}

/* ---- unary ---- */

#define SQRT1_2 0.70710678118654752440
#define SQRT_2_OVER_PI 0.79788456080286535588
#define INV_SQRT_2PI 0.39894228040143267794
#define GELU_KAPPA 0.044715

template <typename T> __device__ static T unary_f(int op, T v, T al) {
    const T half = (T)0.5, one = (T)1, zero = (T)0;
    switch (op) {
    case FSDP_CUDA_UN_RELU:
        return v < zero ? zero : v;
    case FSDP_CUDA_UN_GELU_ERF:
        return half * v * (one + erf(v * (T)SQRT1_2));
    case FSDP_CUDA_UN_GELU_TANH:
        return half * v * (one + tanh((T)SQRT_2_OVER_PI * (v + (T)GELU_KAPPA * v * v * v)));
    case FSDP_CUDA_UN_TANH:
        return tanh(v);
    case FSDP_CUDA_UN_SIGMOID:
        return one / (one + exp(-v));
    case FSDP_CUDA_UN_NEG:
        return -v;
    case FSDP_CUDA_UN_EXP:
        return exp(v);
    case FSDP_CUDA_UN_LOG:
        return log(v);
    case FSDP_CUDA_UN_SQRT:
        return sqrt(v);
    case FSDP_CUDA_UN_RSQRT:
        return one / sqrt(v);
    case FSDP_CUDA_UN_SQUARE:
        return v * v;
    case FSDP_CUDA_UN_ABS:
        return fabs(v);
    case FSDP_CUDA_UN_SCALE:
        return al * v;
    case FSDP_CUDA_UN_ADD_SCALAR:
        return v + al;
    default:
        return pow(v, al);
    }
}

template <typename T> __global__ static void unary_k(int op, size_t n, T al, const T *x, T *y) {
    GRID_LOOP(i, n) y[i] = unary_f<T>(op, x[i], al);
}

extern "C" cudaError_t fsdp__cuda_k_unary(cudaStream_t s, bool f64, int op, size_t n, double alpha,
                                          const void *x, void *y) {
    unsigned g = blocks_for(n);
    if (f64)
        unary_k<double><<<g, THREADS, 0, s>>>(op, n, alpha, (const double *)x, (double *)y);
    else
        unary_k<float><<<g, THREADS, 0, s>>>(op, n, (float)alpha, (const float *)x, (float *)y);
    return cudaGetLastError();
}

/* gx for one element; x may be NULL where the op's derivative comes from y (the device layer
 * checked that the op has what it needs). */
template <typename T>
__device__ static T unary_bwd_f(int op, T al, const T *x, const T *y, T g, size_t i) {
    const T half = (T)0.5, one = (T)1, zero = (T)0, two = (T)2;
    const T beta = (T)SQRT_2_OVER_PI, kappa = (T)GELU_KAPPA;
    switch (op) {
    case FSDP_CUDA_UN_NEG:
        return -g;
    case FSDP_CUDA_UN_SCALE:
        return al * g;
    case FSDP_CUDA_UN_ADD_SCALAR:
        return g;
    default:
        break;
    }
    if (y) {
        const T u = y[i];
        switch (op) {
        case FSDP_CUDA_UN_RELU:
            return u > zero ? g : zero;
        case FSDP_CUDA_UN_TANH:
            return g * (one - u * u);
        case FSDP_CUDA_UN_SIGMOID:
            return g * u * (one - u);
        case FSDP_CUDA_UN_EXP:
            return g * u;
        case FSDP_CUDA_UN_SQRT:
            return g * half / u;
        case FSDP_CUDA_UN_RSQRT:
            return -half * g * u * u * u;
        default:
            break;
        }
    }
    const T v = x[i];
    switch (op) {
    case FSDP_CUDA_UN_RELU:
        return v > zero ? g : zero;
    case FSDP_CUDA_UN_TANH: {
        const T t = tanh(v);
        return g * (one - t * t);
    }
    case FSDP_CUDA_UN_SIGMOID: {
        const T sg = one / (one + exp(-v));
        return g * sg * (one - sg);
    }
    case FSDP_CUDA_UN_EXP:
        return g * exp(v);
    case FSDP_CUDA_UN_SQRT:
        return g * half / sqrt(v);
    case FSDP_CUDA_UN_RSQRT:
        return -half * g / (v * sqrt(v));
    case FSDP_CUDA_UN_GELU_ERF:
        return g * (half * (one + erf(v * (T)SQRT1_2)) + v * (T)INV_SQRT_2PI * exp(-half * v * v));
    case FSDP_CUDA_UN_GELU_TANH: {
        const T t = tanh(beta * (v + kappa * v * v * v));
        const T left = half * (one + t);
        const T right = half * v * (one - t * t) * beta * (one + (T)3 * kappa * v * v);
        return g * (left + right);
    }
    case FSDP_CUDA_UN_LOG:
        return g / v;
    case FSDP_CUDA_UN_SQUARE:
        return two * v * g;
    case FSDP_CUDA_UN_ABS:
        return v > zero ? g : (v < zero ? -g : zero);
    default:
        return al == zero ? zero : g * al * pow(v, al - one);
    }
}

template <typename T>
__global__ static void unary_bwd_k(int op, size_t n, T al, const T *x, const T *y, const T *gy,
                                   T *gx) {
    GRID_LOOP(i, n) gx[i] = unary_bwd_f<T>(op, al, x, y, gy[i], i);
}

extern "C" cudaError_t fsdp__cuda_k_unary_backward(cudaStream_t s, bool f64, int op, size_t n,
                                                   double alpha, const void *x, const void *y,
                                                   const void *gy, void *gx) {
    unsigned g = blocks_for(n);
    if (f64)
        unary_bwd_k<double><<<g, THREADS, 0, s>>>(
            op, n, alpha, (const double *)x, (const double *)y, (const double *)gy, (double *)gx);
    else
        unary_bwd_k<float><<<g, THREADS, 0, s>>>(op, n, (float)alpha, (const float *)x,
                                                 (const float *)y, (const float *)gy, (float *)gx);
    return cudaGetLastError();
}

/* ---- axpy, where ---- */

template <typename T> __global__ static void axpy_k(size_t n, T al, const T *x, T *y) {
    GRID_LOOP(i, n) y[i] += al * x[i];
}

extern "C" cudaError_t fsdp__cuda_k_axpy(cudaStream_t s, bool f64, size_t n, double alpha,
                                         const void *x, void *y) {
    unsigned g = blocks_for(n);
    if (f64)
        axpy_k<double><<<g, THREADS, 0, s>>>(n, alpha, (const double *)x, (double *)y);
    else
        axpy_k<float><<<g, THREADS, 0, s>>>(n, (float)alpha, (const float *)x, (float *)y);
    return cudaGetLastError();
}

template <typename T>
__global__ static void where_k(size_t n, const uint8_t *c, const T *a, T av, const T *b, T bv,
                               T *y) {
    GRID_LOOP(i, n) y[i] = c[i] ? (a ? a[i] : av) : (b ? b[i] : bv);
}

extern "C" cudaError_t fsdp__cuda_k_where(cudaStream_t s, bool f64, size_t n, const uint8_t *cond,
                                          const void *a, double av, const void *b, double bv,
                                          void *y) {
    unsigned g = blocks_for(n);
    if (f64)
        where_k<double><<<g, THREADS, 0, s>>>(n, cond, (const double *)a, av, (const double *)b, bv,
                                              (double *)y);
    else
        where_k<float><<<g, THREADS, 0, s>>>(n, cond, (const float *)a, (float)av, (const float *)b,
                                             (float)bv, (float *)y);
    return cudaGetLastError();
}

/* ---- C = beta C (gemm with k == 0) ---- */

template <typename T>
__global__ static void scale_c_k(int64_t m, int64_t n, T beta, T *c, int64_t ldc, int64_t sc,
                                 int64_t batch) {
    GRID_LOOP(k, (size_t)(m * n * batch)) {
        int64_t b = (int64_t)k / (m * n), rem = (int64_t)k % (m * n);
        T *e = c + b * sc + (rem / n) * ldc + rem % n;
        *e = beta == (T)0 ? (T)0 : beta * *e;
    }
}

/* bf16/f16 elements: widened exactly, scaled in f32, rounded once as the CPU's casts round. */
__global__ static void scale_c_half_k(int dt, int64_t m, int64_t n, float beta, uint16_t *c,
                                      int64_t ldc, int64_t sc, int64_t batch) {
    GRID_LOOP(k, (size_t)(m * n * batch)) {
        int64_t b = (int64_t)k / (m * n), rem = (int64_t)k % (m * n);
        size_t at = (size_t)(b * sc + (rem / n) * ldc + rem % n);
        float v = dt == FSDP_DTYPE_F16 ? fsdp_cc_f16_to_f32(c[at]) : fsdp_cc_bf16_to_f32(c[at]);
        fsdp_cc_store_f(dt, c, at, beta == 0.0f ? 0.0 : (double)__fmul_rn(beta, v));
    }
}

extern "C" cudaError_t fsdp__cuda_k_scale_c(cudaStream_t s, int dt, int64_t m, int64_t n,
                                            double beta, void *c, int64_t ldc, int64_t stride_c,
                                            int64_t batch) {
    unsigned g = blocks_for((size_t)(m * n * batch));
    switch (dt) {
    case FSDP_DTYPE_F64:
        scale_c_k<double><<<g, THREADS, 0, s>>>(m, n, beta, (double *)c, ldc, stride_c, batch);
        break;
    case FSDP_DTYPE_BF16:
    case FSDP_DTYPE_F16:
        scale_c_half_k<<<g, THREADS, 0, s>>>(dt, m, n, (float)beta, (uint16_t *)c, ldc, stride_c,
                                             batch);
        break;
    default:
        scale_c_k<float><<<g, THREADS, 0, s>>>(m, n, (float)beta, (float *)c, ldc, stride_c, batch);
        break;
    }
    return cudaGetLastError();
}

/* ---- the reduction of a collective (device_impl.h, coll_reduce) ---- */

/*
 * One thread per element reads the element of every input, combines them left to right (rank
 * order) in the accumulation type, and writes the result to every output: an output aliasing an
 * input at the same offsets is read before it is written. The float operations are the
 * round-to-nearest intrinsics, so nothing is contracted or flushed and each step is the one
 * IEEE operation the CPU's loop does (core/reduce.c): every result is bitwise the CPU's, except
 * that a NaN made by a float sum, product or division is the GPU's canonical NaN where the CPU
 * propagates an input's payload (min and max return an input, NaNs included, bit for bit).
 * Integer sums and products wrap in unsigned types; min and max compare the signed view.
 */
struct cr_f32 {
    typedef float A;
    __device__ static A load(const void *p, size_t i) { return ((const float *)p)[i]; }
    __device__ static void store(void *p, size_t i, A v) { ((float *)p)[i] = v; }
    __device__ static A sum(A a, A b) { return __fadd_rn(a, b); }
    __device__ static A prod(A a, A b) { return __fmul_rn(a, b); }
    __device__ static A mn(A a, A b) { return (a < b || a != a) ? a : b; }
    __device__ static A mx(A a, A b) { return (a > b || a != a) ? a : b; }
    __device__ static A avg(A a, int d) { return __fdiv_rn(a, (float)d); }
    /* An input times the sum's prescale, rounded to the input's type (pg.h). */
    __device__ static A pre(A a, double s) { return __fmul_rn(a, (float)s); }
};
struct cr_f64 {
    typedef double A;
    __device__ static A load(const void *p, size_t i) { return ((const double *)p)[i]; }
    __device__ static void store(void *p, size_t i, A v) { ((double *)p)[i] = v; }
    __device__ static A sum(A a, A b) { return __dadd_rn(a, b); }
    __device__ static A prod(A a, A b) { return __dmul_rn(a, b); }
    __device__ static A mn(A a, A b) { return (a < b || a != a) ? a : b; }
    __device__ static A mx(A a, A b) { return (a > b || a != a) ? a : b; }
    __device__ static A avg(A a, int d) { return __ddiv_rn(a, (double)d); }
    __device__ static A pre(A a, double s) { return __dmul_rn(a, s); }
};
/* f16 and bf16: widened exactly to f32, reduced as f32, rounded once (cuda_cast.h's rules,
 * bitwise those of fsdp_dtype_convert). */
template <int DT> struct cr_half : cr_f32 {
    __device__ static A load(const void *p, size_t i) {
        uint16_t h = ((const uint16_t *)p)[i];
        return DT == FSDP_DTYPE_F16 ? fsdp_cc_f16_to_f32(h) : fsdp_cc_bf16_to_f32(h);
    }
    __device__ static void store(void *p, size_t i, A v) { fsdp_cc_store_f(DT, p, i, (double)v); }
    __device__ static A pre(A a, double s) {
        uint16_t h;
        store(&h, 0, __fmul_rn(a, (float)s));
        return load(&h, 0);
    }
};
template <typename U, typename S> struct cr_int {
    typedef U A;
    __device__ static A load(const void *p, size_t i) { return ((const U *)p)[i]; }
    __device__ static void store(void *p, size_t i, A v) { ((U *)p)[i] = v; }
    __device__ static A sum(A a, A b) { return (A)(a + b); }
    __device__ static A prod(A a, A b) { return (A)((A)a * (A)b); }
    __device__ static A mn(A a, A b) { return (S)a < (S)b ? a : b; }
    __device__ static A mx(A a, A b) { return (S)a > (S)b ? a : b; }
    __device__ static A avg(A a, int d) { return (A)(S)((S)a / (S)d); }
    __device__ static A pre(A a, double) { return a; } /* sums of floats only (pg.c checks) */
};
/* u8 arithmetic goes through unsigned int and is truncated back, as the CPU's. */
struct cr_u8 : cr_int<uint8_t, uint8_t> {
    __device__ static A sum(A a, A b) { return (uint8_t)((unsigned)a + (unsigned)b); }
    __device__ static A prod(A a, A b) { return (uint8_t)((unsigned)a * (unsigned)b); }
    __device__ static A avg(A a, int d) { return (uint8_t)((unsigned)a / (unsigned)d); }
};
/* bool: inputs normalized (nonzero is true); sum and max are "or", prod and min "and". */
struct cr_bool : cr_u8 {
    __device__ static A load(const void *p, size_t i) { return ((const uint8_t *)p)[i] != 0; }
    __device__ static A sum(A a, A b) { return a | b; }
    __device__ static A prod(A a, A b) { return a & b; }
    __device__ static A mn(A a, A b) { return a & b; }
    __device__ static A mx(A a, A b) { return a | b; }
};

template <typename T>
__global__ void coll_reduce_k(struct fsdp_cuda_coll_ptrs p, int nin, int nout, int op, int divisor,
                              double prescale, size_t n) {
    const bool pre = prescale != 0.0 && op == FSDP_CUDA_REDOP_SUM;
    GRID_LOOP(i, n) {
        typename T::A acc = T::load(p.in[0], i);
        if (pre) acc = T::pre(acc, prescale);
        for (int k = 1; k < nin; k++) {
            typename T::A x = T::load(p.in[k], i);
            if (pre) x = T::pre(x, prescale);
            switch (op) {
            case FSDP_CUDA_REDOP_PROD:
                acc = T::prod(acc, x);
                break;
            case FSDP_CUDA_REDOP_MIN:
                acc = T::mn(acc, x);
                break;
            case FSDP_CUDA_REDOP_MAX:
                acc = T::mx(acc, x);
                break;
            default:
                acc = T::sum(acc, x);
                break;
            }
        }
        if (op == FSDP_CUDA_REDOP_AVG) acc = T::avg(acc, divisor);
        for (int k = 0; k < nout; k++) T::store(p.out[k], i, acc);
    }
}

extern "C" cudaError_t fsdp__cuda_k_coll_reduce(cudaStream_t s, int dt, int op, int divisor,
                                                double pre, const struct fsdp_cuda_coll_ptrs *p,
                                                int nin, int nout, size_t n) {
    unsigned g = blocks_for(n);
#define COLL_REDUCE(...)                                                                           \
    coll_reduce_k<__VA_ARGS__><<<g, THREADS, 0, s>>>(*p, nin, nout, op, divisor, pre, n)
    switch (dt) {
    case FSDP_DTYPE_F32:
        COLL_REDUCE(cr_f32);
        break;
    case FSDP_DTYPE_F64:
        COLL_REDUCE(cr_f64);
        break;
    case FSDP_DTYPE_F16:
        COLL_REDUCE(cr_half<FSDP_DTYPE_F16>);
        break;
    case FSDP_DTYPE_BF16:
        COLL_REDUCE(cr_half<FSDP_DTYPE_BF16>);
        break;
    case FSDP_DTYPE_I32:
        COLL_REDUCE(cr_int<uint32_t, int32_t>);
        break;
    case FSDP_DTYPE_I64:
        COLL_REDUCE(cr_int<uint64_t, int64_t>);
        break;
    case FSDP_DTYPE_U8:
        COLL_REDUCE(cr_u8);
        break;
    default:
        COLL_REDUCE(cr_bool);
        break;
    }
#undef COLL_REDUCE
    return cudaGetLastError();
}
