/* SPDX-License-Identifier: MIT */
/*
 * cpu_kernels.c: the CPU device's elementwise kernels, reductions and matrix products.
 *
 * The CPU device is the reference every other device is tested against, so these kernels favour
 * plain, deterministic arithmetic: each result is computed in the dtype's own precision (except
 * sum_squares, which the header fixes at f64) and in an order that depends only on the shapes,
 * never on threads or alignment. Matrix products go to BLAS when configure found one.
 *
 * Kernels other than fill, cast and copy_strided are written once per float type through the
 * DEF_* macros below, instantiated for float (f32) and double (f64). <tgmath.h> makes exp, erf,
 * tanh, ... pick the float or double function from the argument, so the f32 kernels stay in f32.
 *
 * Strided kernels (copy_strided, binary) first simplify the shape: size-1 dimensions go, and
 * neighbours that are contiguous for every operand merge. Then an N-d counter walks the outer
 * dimensions with running offsets (no division per element) and a tight loop runs over the last
 * one, specialised for the common stride patterns (contiguous, broadcast scalar).
 */
#include <config.h>

#include <limits.h>
#include <string.h>
#include <tgmath.h>

#include "core/reduce.h"
#include "device/cpu_impl.h"
#include "device/cpu_vec.h"

#ifdef FSDP_HAVE_BLAS
#include <cblas.h>
#endif

#define SQRT1_2 0.70710678118654752440        /* 1 / sqrt(2) */
#define SQRT_2_OVER_PI 0.79788456080286535588 /* sqrt(2 / pi) */
#define INV_SQRT_2PI 0.39894228040143267794   /* 1 / sqrt(2 pi) */
#define GELU_KAPPA 0.044715

int fsdp__cpu_bad_dtype(fsdp_device_t *dev, const char *fn, fsdp_dtype_t dt, const char *takes) {
    return fsdp__ctx_err(dev->ctx, FSDP_ENOTSUP,
                         "cpu %s: dtype %s is not supported (the kernel takes %s)", fn,
                         fsdp_dtype_name(dt), takes);
}

static int bad_dtype(fsdp_device_t *dev, const char *fn, fsdp_dtype_t dt) {
    return fsdp__cpu_bad_dtype(dev, fn, dt, "f32 or f64");
}

/* ---- fill and cast (every dtype) ---- */

/* Stores the element `one` (es bytes) n times; memcpy keeps it free of aliasing questions and
 * compiles to plain stores because es is a constant in each case. */
/* clang-format off */
#define FILL_ES(ES)                                                                            \
    for (size_t i = 0; i < n; i++) memcpy(yb + i * (ES), one, (ES))
/* clang-format on */

int fsdp__cpu_fill(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, double value, void *y) {
    unsigned char one[8];
    unsigned char *yb = y;
    /* One conversion from double rounds once, as fsdp_device_fill() promises. */
    int rc = fsdp_dtype_convert(one, dt, &value, FSDP_DTYPE_F64, 1);
    if (rc < 0)
        return fsdp__ctx_err(dev->ctx, rc, "cpu fill: dtype %d is not a fsdp_dtype_t", (int)dt);
    const size_t es = fsdp_dtype_size(dt);
    static const unsigned char zero[8];
    if (memcmp(one, zero, es) == 0) {
        /* +0 in every dtype is all zero bytes: memset runs at memory bandwidth, while the loop
         * below stores one element at a time (zero-filled gradients are megabytes per step). */
        memset(yb, 0, n * es);
        return FSDP_OK;
    }
    switch (es) {
    case 1:
        memset(yb, one[0], n);
        break;
    case 2:
        FILL_ES(2);
        break;
    case 4:
        FILL_ES(4);
        break;
    default:
        FILL_ES(8);
        break;
    }
    return FSDP_OK;
}

int fsdp__cpu_cast(fsdp_device_t *dev, fsdp_dtype_t dt, void *y, fsdp_dtype_t xt, const void *x,
                   size_t n) {
    int rc = fsdp_dtype_convert(y, dt, x, xt, n);
    if (rc < 0)
        return fsdp__ctx_err(dev->ctx, rc,
                             "cpu cast: cannot convert %zu elements from %s to %s (invalid dtype, "
                             "or y and x overlap other than in place with equal sizes)",
                             n, fsdp_dtype_name(xt), fsdp_dtype_name(dt));
    return FSDP_OK;
}

/* ---- N-d iteration ---- */

struct nd_plan {
    int nd;                       /* >= 1; the last dimension is the inner loop */
    int64_t shape[FSDP_MAX_DIMS]; /* simplified shape, every entry > 1 unless nd == 1 */
    int64_t st[2][FSDP_MAX_DIMS]; /* element strides of up to two operands (0 when unused) */
};

/*
 * Simplifies a shape read by nops (1 or 2) strided operands and written contiguously: drops
 * size-1 dimensions and merges a dimension into its outer neighbour when every operand is
 * contiguous across the pair. Returns the element count (0: nothing to do).
 */
static int64_t nd_plan_init(struct nd_plan *p, int ndim, const int64_t *shape, int nops,
                            const int64_t *s0, const int64_t *s1) {
    const int64_t *src[2] = {s0, s1};
    int64_t total = 1;
    memset(p, 0, sizeof *p);
    for (int d = 0; d < ndim; d++) {
        if (shape[d] == 0) return 0;
        total *= shape[d];
        if (shape[d] == 1) continue;
        int k = p->nd;
        int merge = k > 0;
        for (int o = 0; o < nops && merge; o++)
            merge = p->st[o][k - 1] == src[o][d] * shape[d];
        if (merge) {
            p->shape[k - 1] *= shape[d];
            for (int o = 0; o < nops; o++)
                p->st[o][k - 1] = src[o][d];
            continue;
        }
        p->shape[k] = shape[d];
        for (int o = 0; o < nops; o++)
            p->st[o][k] = src[o][d];
        p->nd++;
    }
    if (p->nd == 0) {
        p->nd = 1; /* a single element, strides 0 */
        p->shape[0] = 1;
    }
    return total;
}

/* Moves the running offsets to the next row (the outer dimensions count like an odometer). */
static inline void nd_advance(const struct nd_plan *p, int64_t *idx, int64_t *off) {
    for (int d = p->nd - 2; d >= 0; d--) {
        off[0] += p->st[0][d];
        off[1] += p->st[1][d];
        if (++idx[d] < p->shape[d]) return;
        off[0] -= p->st[0][d] * p->shape[d];
        off[1] -= p->st[1][d] * p->shape[d];
        idx[d] = 0;
    }
}

static int check_ndim(fsdp_device_t *dev, const char *fn, int ndim) {
    if (ndim < 0 || ndim > FSDP_MAX_DIMS)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "cpu %s: ndim %d is outside [0, %d]", fn, ndim,
                             FSDP_MAX_DIMS);
    return FSDP_OK;
}

/* ---- copy_strided (every dtype, by element size) ---- */

/* clang-format off */
#define COPY_ROW_ES(ES)                                                                        \
    for (int64_t i = 0; i < n; i++) memcpy(y + i * (ES), x + i * sx * (ES), (ES))
/* clang-format on */

static void copy_row(size_t es, int64_t n, unsigned char *y, const unsigned char *x, int64_t sx) {
    if (sx == 1) {
        memcpy(y, x, (size_t)n * es);
        return;
    }
    switch (es) {
    case 1:
        COPY_ROW_ES(1);
        break;
    case 2:
        COPY_ROW_ES(2);
        break;
    case 4:
        COPY_ROW_ES(4);
        break;
    default:
        COPY_ROW_ES(8);
        break;
    }
}

int fsdp__cpu_copy_strided(fsdp_device_t *dev, fsdp_dtype_t dt, int ndim, const int64_t *shape,
                           void *y, const void *x, const int64_t *xstride) {
    struct nd_plan p;
    int rc = check_ndim(dev, "copy_strided", ndim);
    if (rc < 0) return rc;
    size_t es = fsdp_dtype_size(dt);
    if (es == 0)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "cpu copy_strided: dtype %d is not valid",
                             (int)dt);
    int64_t total = nd_plan_init(&p, ndim, shape, 1, xstride, NULL);
    if (total == 0) return FSDP_OK;
    int64_t inner = p.shape[p.nd - 1], rows = total / inner, sx = p.st[0][p.nd - 1];
    int64_t idx[FSDP_MAX_DIMS] = {0}, off[2] = {0, 0};
    unsigned char *yb = y;
    const unsigned char *xb = x;
    for (int64_t r = 0; r < rows; r++) {
        copy_row(es, inner, yb + (size_t)(r * inner) * es, xb + off[0] * (int64_t)es, sx);
        nd_advance(&p, idx, off);
    }
    return FSDP_OK;
}

/* ---- unary ---- */

/* Loops over n elements; v is x[i], u is y[i] (the forward output), g is gy[i]. */
/* clang-format off */
#define UN_LOOP(T, EXPR)                                                                       \
    for (size_t i = 0; i < n; i++) {                                                           \
        const T v = x[i];                                                                      \
        y[i] = (EXPR);                                                                         \
    }
#define BWX_LOOP(T, EXPR)                                                                      \
    for (size_t i = 0; i < n; i++) {                                                           \
        const T v = x[i], g = gy[i];                                                           \
        gx[i] = (EXPR);                                                                        \
    }
#define BWY_LOOP(T, EXPR)                                                                      \
    for (size_t i = 0; i < n; i++) {                                                           \
        const T u = y[i], g = gy[i];                                                           \
        gx[i] = (EXPR);                                                                        \
    }
#define BW0_LOOP(T, EXPR)                                                                      \
    for (size_t i = 0; i < n; i++) {                                                           \
        const T g = gy[i];                                                                     \
        gx[i] = (EXPR);                                                                        \
    }
/* clang-format on */

/* Returns 0, or -1 for an op that is not a fsdp_unary_op_t. y may alias x (elementwise). */
/* clang-format off */
#define DEF_UNARY(T, SFX)                                                                      \
    static int unary_##SFX(fsdp_unary_op_t op, size_t n, T al, const T *x, T *y) {             \
        const T half = (T)0.5, one = (T)1, zero = (T)0;                                        \
        switch (op) {                                                                          \
        case FSDP_UNARY_RELU: UN_LOOP(T, v < zero ? zero : v) break;                           \
        case FSDP_UNARY_GELU_ERF: UN_LOOP(T, half * v * (one + erf(v * (T)SQRT1_2))) break;    \
        case FSDP_UNARY_GELU_TANH:                                                             \
            UN_LOOP(T, half * v *                                                              \
                           (one + tanh((T)SQRT_2_OVER_PI * (v + (T)GELU_KAPPA * v * v * v))))  \
            break;                                                                             \
        case FSDP_UNARY_TANH: UN_LOOP(T, tanh(v)) break;                                       \
        case FSDP_UNARY_SIGMOID: UN_LOOP(T, one / (one + exp(-v))) break;                      \
        case FSDP_UNARY_NEG: UN_LOOP(T, -v) break;                                             \
        case FSDP_UNARY_EXP: UN_LOOP(T, exp(v)) break;                                         \
        case FSDP_UNARY_LOG: UN_LOOP(T, log(v)) break;                                         \
        case FSDP_UNARY_SQRT: UN_LOOP(T, sqrt(v)) break;                                       \
        case FSDP_UNARY_RSQRT: UN_LOOP(T, one / sqrt(v)) break;                                \
        case FSDP_UNARY_SQUARE: UN_LOOP(T, v * v) break;                                       \
        case FSDP_UNARY_ABS: UN_LOOP(T, fabs(v)) break;                                        \
        case FSDP_UNARY_SCALE: UN_LOOP(T, al * v) break;                                       \
        case FSDP_UNARY_ADD_SCALAR: UN_LOOP(T, v + al) break;                                  \
        case FSDP_UNARY_POW: UN_LOOP(T, pow(v, al)) break;                                     \
        default: return -1;                                                                    \
        }                                                                                      \
        return 0;                                                                              \
    }
/* clang-format on */

/*
 * gx = gy * op'(x). Ops whose derivative is a function of the output use y when it is given
 * (cheaper, and what autograd saves) and recompute from x otherwise. Returns 0, -1 for an
 * unknown op, -2 when the op needs x and x is NULL.
 */
/* clang-format off */
#define DEF_UNARY_BWD(T, SFX)                                                                  \
    static int unary_bwd_##SFX(fsdp_unary_op_t op, size_t n, T al, const T *x, const T *y,     \
                               const T *gy, T *gx) {                                           \
        const T half = (T)0.5, one = (T)1, zero = (T)0, two = (T)2;                            \
        const T beta = (T)SQRT_2_OVER_PI, kappa = (T)GELU_KAPPA;                               \
        if ((int)op < 0 || op >= FSDP_UNARY_COUNT) return -1;                                  \
        switch (op) {                                                                          \
        case FSDP_UNARY_NEG: BW0_LOOP(T, -g) return 0;                                         \
        case FSDP_UNARY_SCALE: BW0_LOOP(T, al * g) return 0;                                   \
        case FSDP_UNARY_ADD_SCALAR: BW0_LOOP(T, g) return 0;                                   \
        case FSDP_UNARY_RELU:                                                                  \
            if (y) {                                                                           \
                BWY_LOOP(T, u > zero ? g : zero)                                               \
                return 0;                                                                      \
            }                                                                                  \
            break;                                                                             \
        case FSDP_UNARY_TANH:                                                                  \
            if (y) {                                                                           \
                BWY_LOOP(T, g * (one - u * u))                                                 \
                return 0;                                                                      \
            }                                                                                  \
            break;                                                                             \
        case FSDP_UNARY_SIGMOID:                                                               \
            if (y) {                                                                           \
                BWY_LOOP(T, g * u * (one - u))                                                 \
                return 0;                                                                      \
            }                                                                                  \
            break;                                                                             \
        case FSDP_UNARY_EXP:                                                                   \
            if (y) {                                                                           \
                BWY_LOOP(T, g * u)                                                             \
                return 0;                                                                      \
            }                                                                                  \
            break;                                                                             \
        case FSDP_UNARY_SQRT:                                                                  \
            if (y) {                                                                           \
                BWY_LOOP(T, g * half / u)                                                      \
                return 0;                                                                      \
            }                                                                                  \
            break;                                                                             \
        case FSDP_UNARY_RSQRT:                                                                 \
            if (y) {                                                                           \
                BWY_LOOP(T, -half * g * u * u * u)                                             \
                return 0;                                                                      \
            }                                                                                  \
            break;                                                                             \
        default: break;                                                                        \
        }                                                                                      \
        if (!x) return -2;                                                                     \
        switch (op) {                                                                          \
        case FSDP_UNARY_RELU: BWX_LOOP(T, v > zero ? g : zero) break;                          \
        case FSDP_UNARY_TANH:                                                                  \
            for (size_t i = 0; i < n; i++) {                                                   \
                const T t = tanh(x[i]);                                                        \
                gx[i] = gy[i] * (one - t * t);                                                 \
            }                                                                                  \
            break;                                                                             \
        case FSDP_UNARY_SIGMOID:                                                               \
            for (size_t i = 0; i < n; i++) {                                                   \
                const T s = one / (one + exp(-x[i]));                                          \
                gx[i] = gy[i] * s * (one - s);                                                 \
            }                                                                                  \
            break;                                                                             \
        case FSDP_UNARY_EXP: BWX_LOOP(T, g * exp(v)) break;                                    \
        case FSDP_UNARY_SQRT: BWX_LOOP(T, g * half / sqrt(v)) break;                           \
        case FSDP_UNARY_RSQRT: BWX_LOOP(T, -half * g / (v * sqrt(v))) break;                   \
        case FSDP_UNARY_GELU_ERF:                                                              \
            /* Phi(x) + x phi(x). */                                                           \
            BWX_LOOP(T, g * (half * (one + erf(v * (T)SQRT1_2)) +                              \
                             v * (T)INV_SQRT_2PI * exp(-half * v * v)))                        \
            break;                                                                             \
        case FSDP_UNARY_GELU_TANH:                                                             \
            /* PyTorch's formula: d/dx of 0.5 x (1 + tanh(beta (x + kappa x^3))). */           \
            for (size_t i = 0; i < n; i++) {                                                   \
                const T v = x[i], t = tanh(beta * (v + kappa * v * v * v));                    \
                const T left = half * (one + t);                                               \
                const T right = half * v * (one - t * t) * beta * (one + (T)3 * kappa * v * v); \
                gx[i] = gy[i] * (left + right);                                                \
            }                                                                                  \
            break;                                                                             \
        case FSDP_UNARY_LOG: BWX_LOOP(T, g / v) break;                                         \
        case FSDP_UNARY_SQUARE: BWX_LOOP(T, two * v * g) break;                                \
        case FSDP_UNARY_ABS: BWX_LOOP(T, v > zero ? g : (v < zero ? -g : zero)) break;         \
        case FSDP_UNARY_POW:                                                                   \
            /* As PyTorch: an exponent of 0 has gradient 0 even where x^-1 is infinite. */     \
            if (al == zero) {                                                                  \
                for (size_t i = 0; i < n; i++) gx[i] = zero;                                   \
            } else {                                                                           \
                BWX_LOOP(T, g * al * pow(v, al - one))                                         \
            }                                                                                  \
            break;                                                                             \
        default: break;                                                                        \
        }                                                                                      \
        return 0;                                                                              \
    }
/* clang-format on */

DEF_UNARY(float, f32)
DEF_UNARY(double, f64)
DEF_UNARY_BWD(float, f32)
DEF_UNARY_BWD(double, f64)

int fsdp__cpu_unary(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_unary_op_t op, size_t n, double alpha,
                    const void *x, void *y) {
    int r;
    if (dt == FSDP_DTYPE_F32 && op == FSDP_UNARY_GELU_TANH) {
        /* The SIMD kernels of cpu_vec.c (within 3 ulp of libm's tanh and exp). */
        fsdp__vec_gelu_tanh_f32(n, x, y);
        return FSDP_OK;
    }
    if (dt == FSDP_DTYPE_F32 && op == FSDP_UNARY_TANH) {
        fsdp__vec_tanh_f32(n, x, y);
        return FSDP_OK;
    }
    if (dt == FSDP_DTYPE_F32 && op == FSDP_UNARY_EXP) {
        fsdp__vec_exp_f32(n, x, 0.0f, y);
        return FSDP_OK;
    }
    if (dt == FSDP_DTYPE_F32)
        r = unary_f32(op, n, (float)alpha, x, y);
    else if (dt == FSDP_DTYPE_F64)
        r = unary_f64(op, n, alpha, x, y);
    else
        return bad_dtype(dev, "unary", dt);
    if (r < 0)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "cpu unary: op %d is not a fsdp_unary_op_t",
                             (int)op);
    return FSDP_OK;
}

int fsdp__cpu_unary_backward(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_unary_op_t op, size_t n,
                             double alpha, const void *x, const void *y, const void *gy, void *gx) {
    int r;
    if (dt == FSDP_DTYPE_F32 && op == FSDP_UNARY_GELU_TANH && x) {
        fsdp__vec_gelu_tanh_bwd_f32(n, x, gy, gx);
        return FSDP_OK;
    }
    if (dt == FSDP_DTYPE_F32)
        r = unary_bwd_f32(op, n, (float)alpha, x, y, gy, gx);
    else if (dt == FSDP_DTYPE_F64)
        r = unary_bwd_f64(op, n, alpha, x, y, gy, gx);
    else
        return bad_dtype(dev, "unary_backward", dt);
    if (r == -1)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL,
                             "cpu unary_backward: op %d is not a fsdp_unary_op_t", (int)op);
    if (r == -2)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL,
                             "cpu unary_backward: op %d needs the input x, which is NULL", (int)op);
    return FSDP_OK;
}

/* ---- binary with broadcast strides ---- */

/* One row of n outputs; A and B are the operands. The stride patterns that dominate training
 * (same shape; a row or column broadcast; a scalar) get loops without stride multiplies. */
/* clang-format off */
#define BIN_ROW(T, EXPR)                                                                       \
    if (sa == 1 && sb == 1) {                                                                  \
        for (int64_t i = 0; i < n; i++) {                                                      \
            const T A = a[i], B = b[i];                                                        \
            y[i] = (EXPR);                                                                     \
        }                                                                                      \
    } else if (sa == 1 && sb == 0) {                                                           \
        const T B = b[0];                                                                      \
        for (int64_t i = 0; i < n; i++) {                                                      \
            const T A = a[i];                                                                  \
            y[i] = (EXPR);                                                                     \
        }                                                                                      \
    } else if (sa == 0 && sb == 1) {                                                           \
        const T A = a[0];                                                                      \
        for (int64_t i = 0; i < n; i++) {                                                      \
            const T B = b[i];                                                                  \
            y[i] = (EXPR);                                                                     \
        }                                                                                      \
    } else {                                                                                   \
        for (int64_t i = 0; i < n; i++) {                                                      \
            const T A = a[i * sa], B = b[i * sb];                                              \
            y[i] = (EXPR);                                                                     \
        }                                                                                      \
    }
/* clang-format on */

/* max and min propagate NaN (either operand), as torch.maximum / torch.minimum do. */
/* clang-format off */
#define DEF_BINARY(T, SFX)                                                                     \
    FSDP_CPU_CLONES                                                                            \
    static void binary_row_##SFX(fsdp_binary_op_t op, int64_t n, T *y, const T *a, int64_t sa, \
                                 const T *b, int64_t sb) {                                     \
        switch (op) {                                                                          \
        case FSDP_BINARY_ADD: BIN_ROW(T, A + B) break;                                         \
        case FSDP_BINARY_SUB: BIN_ROW(T, A - B) break;                                         \
        case FSDP_BINARY_MUL: BIN_ROW(T, A * B) break;                                         \
        case FSDP_BINARY_DIV: BIN_ROW(T, A / B) break;                                         \
        case FSDP_BINARY_MAX: BIN_ROW(T, (A > B || A != A) ? A : B) break;                     \
        case FSDP_BINARY_MIN: BIN_ROW(T, (A < B || A != A) ? A : B) break;                     \
        default: break;                                                                        \
        }                                                                                      \
    }                                                                                          \
    static void binary_##SFX(fsdp_binary_op_t op, const struct nd_plan *p, int64_t total, T *y, \
                             const T *a, const T *b) {                                         \
        int64_t inner = p->shape[p->nd - 1], rows = total / inner;                             \
        int64_t sa = p->st[0][p->nd - 1], sb = p->st[1][p->nd - 1];                            \
        int64_t idx[FSDP_MAX_DIMS] = {0}, off[2] = {0, 0};                                     \
        for (int64_t r = 0; r < rows; r++) {                                                   \
            binary_row_##SFX(op, inner, y + r * inner, a + off[0], sa, b + off[1], sb);        \
            nd_advance(p, idx, off);                                                           \
        }                                                                                      \
    }
/* clang-format on */

DEF_BINARY(float, f32)
DEF_BINARY(double, f64)

int fsdp__cpu_binary(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_binary_op_t op, int ndim,
                     const int64_t *shape, void *y, const void *a, const int64_t *astride,
                     const void *b, const int64_t *bstride) {
    struct nd_plan p;
    if (dt != FSDP_DTYPE_F32 && dt != FSDP_DTYPE_F64) return bad_dtype(dev, "binary", dt);
    if ((int)op < 0 || op >= FSDP_BINARY_COUNT)
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "cpu binary: op %d is not a fsdp_binary_op_t",
                             (int)op);
    int rc = check_ndim(dev, "binary", ndim);
    if (rc < 0) return rc;
    int64_t total = nd_plan_init(&p, ndim, shape, 2, astride, bstride);
    if (total == 0) return FSDP_OK;
    if (dt == FSDP_DTYPE_F32)
        binary_f32(op, &p, total, y, a, b);
    else
        binary_f64(op, &p, total, y, a, b);
    return FSDP_OK;
}

/* ---- axpy, where ---- */

/* clang-format off */
#define DEF_AXPY_WHERE(T, SFX)                                                                 \
    FSDP_CPU_CLONES                                                                            \
    static void axpy_##SFX(size_t n, T al, const T *x, T *y) {                                 \
        for (size_t i = 0; i < n; i++) y[i] += al * x[i];                                      \
    }                                                                                          \
    static void where_##SFX(size_t n, const uint8_t *c, const T *a, T av, const T *b, T bv,    \
                            T *y) {                                                            \
        if (a && b)                                                                            \
            for (size_t i = 0; i < n; i++) y[i] = c[i] ? a[i] : b[i];                          \
        else if (a)                                                                            \
            for (size_t i = 0; i < n; i++) y[i] = c[i] ? a[i] : bv;                            \
        else if (b)                                                                            \
            for (size_t i = 0; i < n; i++) y[i] = c[i] ? av : b[i];                            \
        else                                                                                   \
            for (size_t i = 0; i < n; i++) y[i] = c[i] ? av : bv;                              \
    }
/* clang-format on */

DEF_AXPY_WHERE(float, f32)
DEF_AXPY_WHERE(double, f64)

int fsdp__cpu_axpy(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, double alpha, const void *x,
                   void *y) {
    if (dt == FSDP_DTYPE_F32)
        axpy_f32(n, (float)alpha, x, y);
    else if (dt == FSDP_DTYPE_F64)
        axpy_f64(n, alpha, x, y);
    else
        return bad_dtype(dev, "axpy", dt);
    return FSDP_OK;
}

int fsdp__cpu_where(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, const uint8_t *cond,
                    const void *a, double av, const void *b, double bv, void *y) {
    if (dt == FSDP_DTYPE_F32)
        where_f32(n, cond, a, (float)av, b, (float)bv, y);
    else if (dt == FSDP_DTYPE_F64)
        where_f64(n, cond, a, av, b, bv, y);
    else
        return bad_dtype(dev, "where", dt);
    return FSDP_OK;
}

/* ---- reductions ---- */

/*
 * Sum over r of x (outer, r, inner). With inner == 1 (row sums) eight partial sums run in
 * lockstep and are combined pairwise, which is both faster and more accurate than one chain;
 * otherwise whole rows of inner elements are added in r order. Either way the order depends only
 * on the shape, so results are bitwise reproducible. r == 0 gives 0.
 */
/* clang-format off */
#define DEF_REDUCE(T, SFX)                                                                     \
    FSDP_CPU_CLONES                                                                            \
    static void reduce_sum_##SFX(size_t outer, size_t r, size_t inner, T al, const T *x,       \
                                 T *y) {                                                       \
        for (size_t o = 0; o < outer; o++) {                                                   \
            const T *xo = x + o * r * inner;                                                   \
            T *yo = y + o * inner;                                                             \
            if (inner == 1) {                                                                  \
                T acc[8] = {0};                                                                \
                size_t j = 0;                                                                  \
                for (; j + 8 <= r; j += 8)                                                     \
                    for (int l = 0; l < 8; l++) acc[l] += xo[j + l];                           \
                T s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) +                                \
                      ((acc[4] + acc[5]) + (acc[6] + acc[7]));                                 \
                for (; j < r; j++) s += xo[j];                                                 \
                yo[0] = s * al;                                                                \
                continue;                                                                      \
            }                                                                                  \
            for (size_t i = 0; i < inner; i++) yo[i] = r > 0 ? xo[i] : (T)0;                   \
            for (size_t j = 1; j < r; j++) {                                                   \
                const T *row = xo + j * inner;                                                 \
                for (size_t i = 0; i < inner; i++) yo[i] += row[i];                            \
            }                                                                                  \
            if (al != (T)1)                                                                    \
                for (size_t i = 0; i < inner; i++) yo[i] *= al;                                \
        }                                                                                      \
    }                                                                                          \
    /* Max over r; NaN wins over numbers, and the first of equal maxima (or NaNs) wins. */     \
    static void reduce_max_##SFX(size_t outer, size_t r, size_t inner, const T *x, T *y,       \
                                 int64_t *idx) {                                               \
        for (size_t o = 0; o < outer; o++) {                                                   \
            const T *xo = x + o * r * inner;                                                   \
            T *yo = y + o * inner;                                                             \
            int64_t *io = idx ? idx + o * inner : NULL;                                        \
            for (size_t i = 0; i < inner; i++) {                                               \
                yo[i] = r > 0 ? xo[i] : -(T)INFINITY;                                          \
                if (io) io[i] = r > 0 ? 0 : -1;                                                \
            }                                                                                  \
            for (size_t j = 1; j < r; j++) {                                                   \
                const T *row = xo + j * inner;                                                 \
                for (size_t i = 0; i < inner; i++) {                                           \
                    T v = row[i], best = yo[i];                                                \
                    if (v > best || (v != v && best == best)) {                                \
                        yo[i] = v;                                                             \
                        if (io) io[i] = (int64_t)j;                                            \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    static double sum_squares_##SFX(size_t n, const T *x) {                                    \
        double acc[4] = {0, 0, 0, 0};                                                          \
        size_t i = 0;                                                                          \
        for (; i + 4 <= n; i += 4)                                                             \
            for (int l = 0; l < 4; l++) acc[l] += (double)x[i + l] * (double)x[i + l];         \
        double s = (acc[0] + acc[1]) + (acc[2] + acc[3]);                                      \
        for (; i < n; i++) s += (double)x[i] * (double)x[i];                                   \
        return s;                                                                              \
    }
/* clang-format on */

DEF_REDUCE(float, f32)
DEF_REDUCE(double, f64)

int fsdp__cpu_reduce_sum(fsdp_device_t *dev, fsdp_dtype_t dt, size_t outer, size_t r, size_t inner,
                         double alpha, const void *x, void *y) {
    if (dt == FSDP_DTYPE_F32)
        reduce_sum_f32(outer, r, inner, (float)alpha, x, y);
    else if (dt == FSDP_DTYPE_F64)
        reduce_sum_f64(outer, r, inner, alpha, x, y);
    else
        return bad_dtype(dev, "reduce_sum", dt);
    return FSDP_OK;
}

int fsdp__cpu_reduce_max(fsdp_device_t *dev, fsdp_dtype_t dt, size_t outer, size_t r, size_t inner,
                         const void *x, void *y, int64_t *idx) {
    if (dt == FSDP_DTYPE_F32)
        reduce_max_f32(outer, r, inner, x, y, idx);
    else if (dt == FSDP_DTYPE_F64)
        reduce_max_f64(outer, r, inner, x, y, idx);
    else
        return bad_dtype(dev, "reduce_max", dt);
    return FSDP_OK;
}

int fsdp__cpu_sum_squares(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, const void *x, void *out) {
    if (dt == FSDP_DTYPE_F32)
        *(float *)out = (float)sum_squares_f32(n, x);
    else if (dt == FSDP_DTYPE_F64)
        *(double *)out = sum_squares_f64(n, x);
    else
        return bad_dtype(dev, "sum_squares", dt);
    return FSDP_OK;
}

/* The collectives' reduction is the one every CPU backend uses: one copy of the logic. */
int fsdp__cpu_coll_reduce(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_redop_t op, int divisor,
                          double prescale, void *const *outs, int nout, const void *const *ins,
                          int nin, size_t n, void *stream) {
    (void)stream;
    int rc = fsdp__reduce(outs, nout, ins, nin, n, dt, op, divisor, prescale);
    if (rc < 0)
        return fsdp__ctx_err(dev->ctx, rc, "cpu coll_reduce: out of memory for %d input pointers",
                             nin);
    return FSDP_OK;
}

/* ---- gemm ---- */

/* C = beta C for an m x n matrix (k == 0); beta == 0 overwrites, so NaNs in C do not survive,
 * as BLAS does. */
/* clang-format off */
#define DEF_SCALE_C(T, SFX)                                                                    \
    static void scale_c_##SFX(int64_t m, int64_t n, T beta, T *c, int64_t ldc) {               \
        for (int64_t i = 0; i < m; i++)                                                        \
            for (int64_t j = 0; j < n; j++)                                                    \
                c[i * ldc + j] = beta == (T)0 ? (T)0 : beta * c[i * ldc + j];                  \
    }
/* clang-format on */

DEF_SCALE_C(float, f32)
DEF_SCALE_C(double, f64)

#ifndef FSDP_HAVE_BLAS
/* The reference product, only built without BLAS: each C entry is one dot product over k in
 * ascending order. */
/* clang-format off */
#define DEF_GEMM_REF(T, SFX)                                                                   \
    static void gemm_ref_##SFX(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha,     \
                               const T *a, int64_t lda, const T *b, int64_t ldb, T beta, T *c, \
                               int64_t ldc) {                                                  \
        for (int64_t i = 0; i < m; i++) {                                                      \
            for (int64_t j = 0; j < n; j++) {                                                  \
                T acc = 0;                                                                     \
                for (int64_t p = 0; p < k; p++) {                                              \
                    T av = ta ? a[p * lda + i] : a[i * lda + p];                               \
                    T bv = tb ? b[j * ldb + p] : b[p * ldb + j];                               \
                    acc += av * bv;                                                            \
                }                                                                              \
                T *cij = &c[i * ldc + j];                                                      \
                *cij = beta == (T)0 ? alpha * acc : alpha * acc + beta * *cij;                 \
            }                                                                                  \
        }                                                                                      \
    }
/* clang-format on */

DEF_GEMM_REF(float, f32)
DEF_GEMM_REF(double, f64)
#endif

int fsdp__cpu_gemm(fsdp_device_t *dev, fsdp_dtype_t dt, bool trans_a, bool trans_b, int64_t m,
                   int64_t n, int64_t k, double alpha, const void *a, int64_t lda, int64_t stride_a,
                   const void *b, int64_t ldb, int64_t stride_b, double beta, void *c, int64_t ldc,
                   int64_t stride_c, int64_t batch) {
    if (dt != FSDP_DTYPE_F32 && dt != FSDP_DTYPE_F64) return bad_dtype(dev, "gemm", dt);
    int chk = fsdp__gemm_check(dev, "cpu", trans_a, trans_b, m, n, k, lda, ldb, ldc, batch);
    if (chk != 0) return chk < 0 ? chk : FSDP_OK;
    for (int64_t i = 0; i < batch; i++) {
        if (dt == FSDP_DTYPE_F32) {
            float *cb = (float *)c + i * stride_c;
            if (k == 0) { /* a and b may be NULL: no offset is applied to them */
                scale_c_f32(m, n, (float)beta, cb, ldc);
                continue;
            }
            const float *ab = (const float *)a + i * stride_a;
            const float *bb = (const float *)b + i * stride_b;
#ifdef FSDP_HAVE_BLAS
            if (m > INT_MAX || n > INT_MAX || k > INT_MAX || lda > INT_MAX || ldb > INT_MAX ||
                ldc > INT_MAX)
                goto too_big;
            cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                        trans_b ? CblasTrans : CblasNoTrans, (int)m, (int)n, (int)k, (float)alpha,
                        ab, (int)lda, bb, (int)ldb, (float)beta, cb, (int)ldc);
#else
            gemm_ref_f32(trans_a, trans_b, m, n, k, (float)alpha, ab, lda, bb, ldb, (float)beta, cb,
                         ldc);
#endif
        } else {
            double *cb = (double *)c + i * stride_c;
            if (k == 0) { /* a and b may be NULL: no offset is applied to them */
                scale_c_f64(m, n, beta, cb, ldc);
                continue;
            }
            const double *ab = (const double *)a + i * stride_a;
            const double *bb = (const double *)b + i * stride_b;
#ifdef FSDP_HAVE_BLAS
            if (m > INT_MAX || n > INT_MAX || k > INT_MAX || lda > INT_MAX || ldb > INT_MAX ||
                ldc > INT_MAX)
                goto too_big;
            cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                        trans_b ? CblasTrans : CblasNoTrans, (int)m, (int)n, (int)k, alpha, ab,
                        (int)lda, bb, (int)ldb, beta, cb, (int)ldc);
#else
            gemm_ref_f64(trans_a, trans_b, m, n, k, alpha, ab, lda, bb, ldb, beta, cb, ldc);
#endif
        }
    }
    return FSDP_OK;

#ifdef FSDP_HAVE_BLAS
too_big:
    return fsdp__ctx_err(dev->ctx, FSDP_ENOTSUP,
                         "cpu gemm: sizes beyond a 32-bit BLAS (m %lld, n %lld, k %lld, lda %lld, "
                         "ldb %lld, ldc %lld)",
                         (long long)m, (long long)n, (long long)k, (long long)lda, (long long)ldb,
                         (long long)ldc);
#endif
}
