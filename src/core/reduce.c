/* SPDX-License-Identifier: MIT */
/*
 * reduce.c: blocked reduction kernels.
 *
 * Each block of BLOCK elements is accumulated into a small stack buffer (in the accumulation
 * type: f32 for f16/bf16, the element type otherwise), then copied to every output. Working in
 * cache-sized blocks keeps the extra pass cheap and makes aliasing between inputs and outputs
 * harmless: a block is read completely before any output is written.
 *
 * The per-operator kernels take restrict pointers and run full blocks with a constant trip
 * count: that is what lets GCC vectorize them at -O2, whose cheap cost model gives up on loops
 * that need a run-time alias check or an epilogue. Vectorizing is elementwise, so every element
 * is still reduced in rank order and the results are bitwise those of the scalar loop. f16 and
 * bf16 blocks are widened to f32 with the (vectorized) converter and reduced by the f32
 * kernels. Integer sums and products use unsigned types so that overflow wraps instead of being
 * undefined; float min and max propagate NaN; bool inputs are normalized (nonzero is true).
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/errno.h>

#include "core/copy.h"
#include "core/reduce.h"

#define BLOCK 2048
/* Messages of at least this many bytes are written with non-temporal stores: their outputs are
 * read later (often by another rank), so pulling them into this core's cache only costs the
 * read-for-ownership traffic that all-reduce, writing every slice N times, is bound by. */
#define STREAM_MIN_BYTES FSDP_COPY_STREAM_MIN

static const char *const redop_names[FSDP_REDOP_COUNT] = {"sum", "avg", "min", "max", "prod"};

const char *fsdp_redop_name(fsdp_redop_t op) {
    return (int)op >= 0 && op < FSDP_REDOP_COUNT ? redop_names[op] : "invalid";
}

int fsdp__redop_supported(fsdp_dtype_t dt, fsdp_redop_t op) {
    if (!fsdp_dtype_valid((int)dt) || (int)op < 0 || op >= FSDP_REDOP_COUNT) return 0;
    return !(dt == FSDP_DTYPE_BOOL && op == FSDP_REDOP_AVG);
}

/* Binary operators. */
#define OP_SUM(a, b) ((a) + (b))
#define OP_PROD(a, b) ((a) * (b))
#define OP_FMIN(a, b) (((a) < (b) || (a) != (a)) ? (a) : (b))
#define OP_FMAX(a, b) (((a) > (b) || (a) != (a)) ? (a) : (b))
#define OP_MIN(a, b) ((a) < (b) ? (a) : (b))
#define OP_MAX(a, b) ((a) > (b) ? (a) : (b))
#define OP_U8SUM(a, b) ((uint8_t)((a) + (b)))
#define OP_U8PROD(a, b) ((uint8_t)((unsigned)(a) * (unsigned)(b)))
#define OP_OR(a, b) ((uint8_t)(((a) != 0) | ((b) != 0)))
#define OP_AND(a, b) ((uint8_t)(((a) != 0) & ((b) != 0)))

/*
 * NAME(acc, ins, nin, m): acc[i] = ins[0][i] OP ins[1][i] OP ... for i < m, left to right.
 * NAME_first and NAME_next are the two passes; their full-block branch has a constant count.
 */
#define DEF_KERNEL(NAME, T, OP)                                                                    \
    static void NAME##_first(T *restrict acc, const T *restrict a, const T *restrict b,            \
                             size_t m) {                                                           \
        if (m == BLOCK)                                                                            \
            for (size_t i = 0; i < BLOCK; i++)                                                     \
                acc[i] = OP(a[i], b[i]);                                                           \
        else                                                                                       \
            for (size_t i = 0; i < m; i++)                                                         \
                acc[i] = OP(a[i], b[i]);                                                           \
    }                                                                                              \
    static void NAME##_next(T *restrict acc, const T *restrict a, size_t m) {                      \
        if (m == BLOCK)                                                                            \
            for (size_t i = 0; i < BLOCK; i++)                                                     \
                acc[i] = OP(acc[i], a[i]);                                                         \
        else                                                                                       \
            for (size_t i = 0; i < m; i++)                                                         \
                acc[i] = OP(acc[i], a[i]);                                                         \
    }                                                                                              \
    static void NAME(T *acc, const void *const *ins, int nin, size_t m) {                          \
        if (nin == 1) {                                                                            \
            memcpy(acc, ins[0], m * sizeof(T));                                                    \
            return;                                                                                \
        }                                                                                          \
        NAME##_first(acc, (const T *)ins[0], (const T *)ins[1], m);                                \
        for (int k = 2; k < nin; k++)                                                              \
            NAME##_next(acc, (const T *)ins[k], m);                                                \
    }

DEF_KERNEL(f32_sum, float, OP_SUM)
DEF_KERNEL(f32_prod, float, OP_PROD)
DEF_KERNEL(f32_min, float, OP_FMIN)
DEF_KERNEL(f32_max, float, OP_FMAX)
DEF_KERNEL(f64_sum, double, OP_SUM)
DEF_KERNEL(f64_prod, double, OP_PROD)
DEF_KERNEL(f64_min, double, OP_FMIN)
DEF_KERNEL(f64_max, double, OP_FMAX)
DEF_KERNEL(u32_sum, uint32_t, OP_SUM)
DEF_KERNEL(u32_prod, uint32_t, OP_PROD)
DEF_KERNEL(i32_min, int32_t, OP_MIN)
DEF_KERNEL(i32_max, int32_t, OP_MAX)
DEF_KERNEL(u64_sum, uint64_t, OP_SUM)
DEF_KERNEL(u64_prod, uint64_t, OP_PROD)
DEF_KERNEL(i64_min, int64_t, OP_MIN)
DEF_KERNEL(i64_max, int64_t, OP_MAX)
DEF_KERNEL(u8_sum, uint8_t, OP_U8SUM)
DEF_KERNEL(u8_prod, uint8_t, OP_U8PROD)
DEF_KERNEL(u8_min, uint8_t, OP_MIN)
DEF_KERNEL(u8_max, uint8_t, OP_MAX)
DEF_KERNEL(bool_or, uint8_t, OP_OR)
DEF_KERNEL(bool_and, uint8_t, OP_AND)

/* Picks the kernel of `op` among the four given (sum/avg, prod, min, max). */
#define DISPATCH(acc, ins, nin, m, op, SUM, PROD, MIN, MAX)                                        \
    do {                                                                                           \
        switch (op) {                                                                              \
        case FSDP_REDOP_PROD:                                                                      \
            PROD(acc, ins, nin, m);                                                                \
            break;                                                                                 \
        case FSDP_REDOP_MIN:                                                                       \
            MIN(acc, ins, nin, m);                                                                 \
            break;                                                                                 \
        case FSDP_REDOP_MAX:                                                                       \
            MAX(acc, ins, nin, m);                                                                 \
            break;                                                                                 \
        default:                                                                                   \
            SUM(acc, ins, nin, m);                                                                 \
            break;                                                                                 \
        }                                                                                          \
    } while (0)

/* Prescaled sums: acc[i] = ins[0][i] * s + ins[1][i] * s + ..., left to right, each product
 * rounded to T before it is added (what dividing every input by 1 / s first, then summing,
 * gives when s is a power of two). */
#define DEF_PRESCALED(NAME, T)                                                                     \
    static void NAME##_first(T *restrict acc, const T *restrict a, T s, size_t m) {                \
        if (m == BLOCK)                                                                            \
            for (size_t i = 0; i < BLOCK; i++)                                                     \
                acc[i] = a[i] * s;                                                                 \
        else                                                                                       \
            for (size_t i = 0; i < m; i++)                                                         \
                acc[i] = a[i] * s;                                                                 \
    }                                                                                              \
    static void NAME##_next(T *restrict acc, const T *restrict a, T s, size_t m) {                 \
        if (m == BLOCK)                                                                            \
            for (size_t i = 0; i < BLOCK; i++)                                                     \
                acc[i] += a[i] * s;                                                                \
        else                                                                                       \
            for (size_t i = 0; i < m; i++)                                                         \
                acc[i] += a[i] * s;                                                                \
    }                                                                                              \
    static void NAME(T *acc, const void *const *ins, int nin, size_t m, T s) {                     \
        NAME##_first(acc, (const T *)ins[0], s, m);                                                \
        for (int k = 1; k < nin; k++)                                                              \
            NAME##_next(acc, (const T *)ins[k], s, m);                                             \
    }

DEF_PRESCALED(f32_presum, float)
DEF_PRESCALED(f64_presum, double)

/* The same for integers: sums and products wrap on the unsigned accumulator `uacc`, min and max
 * compare on the signed view `sacc` of the same storage. */
#define DISPATCH_INT(uacc, sacc, ins, nin, m, op, SUM, PROD, MIN, MAX)                         \
    do {                                                                                       \
        switch (op) {                                                                          \
        case FSDP_REDOP_PROD: PROD(uacc, ins, nin, m); break;                                  \
        case FSDP_REDOP_MIN: MIN(sacc, ins, nin, m); break;                                    \
        case FSDP_REDOP_MAX: MAX(sacc, ins, nin, m); break;                                    \
        default: SUM(uacc, ins, nin, m); break;                                                \
        }                                                                                      \
    } while (0)

/* f16/bf16 prescaled sum: each input block widened, multiplied by s in f32 and rounded back to
 * its type (as dividing it in place first would leave it), then widened and added in f32. */
static void half_presum(float *acc, float *tmp, uint16_t *half, const void *const *ins, int nin,
                        size_t m, fsdp_dtype_t dt, float s) {
    for (int k = 0; k < nin; k++) {
        float *dst = k == 0 ? acc : tmp;
        fsdp_dtype_convert(dst, FSDP_DTYPE_F32, ins[k], dt, m);
        for (size_t i = 0; i < m; i++)
            dst[i] *= s;
        fsdp_dtype_convert(half, dt, dst, FSDP_DTYPE_F32, m);
        fsdp_dtype_convert(dst, FSDP_DTYPE_F32, half, dt, m);
        if (k > 0) f32_sum_next(acc, tmp, m);
    }
}

/* f16/bf16: widen every input block to f32 and reduce with the f32 kernels, in rank order. */
static void half_reduce(float *acc, float *tmp, const void *const *ins, int nin, size_t m,
                        fsdp_dtype_t dt, fsdp_redop_t op) {
    fsdp_dtype_convert(acc, FSDP_DTYPE_F32, ins[0], dt, m);
    for (int k = 1; k < nin; k++) {
        fsdp_dtype_convert(tmp, FSDP_DTYPE_F32, ins[k], dt, m);
        switch (op) {
        case FSDP_REDOP_PROD:
            f32_prod_next(acc, tmp, m);
            break;
        case FSDP_REDOP_MIN:
            f32_min_next(acc, tmp, m);
            break;
        case FSDP_REDOP_MAX:
            f32_max_next(acc, tmp, m);
            break;
        default:
            f32_sum_next(acc, tmp, m);
            break;
        }
    }
}

/* Offsets every pointer of a list by `off` elements of `size` bytes. */
static void advance(const void **dst, const void *const *src, int n, size_t off, size_t size) {
    for (int k = 0; k < n; k++)
        dst[k] = (const char *)src[k] + off * size;
}

static void store_all(void *const *outs, int nout, size_t off, const void *block, size_t bytes,
                      size_t esize, int stream) {
    for (int k = 0; k < nout; k++) {
        char *dst = (char *)outs[k] + off * esize;
        if (stream)
            fsdp__copy_stream(dst, block, bytes);
        else
            memcpy(dst, block, bytes);
    }
}

int fsdp__reduce(void *const *outs, int nout, const void *const *ins, int nin, size_t n,
                 fsdp_dtype_t dt, fsdp_redop_t op, int divisor, double prescale) {
    const bool pre = prescale != 0.0 && op == FSDP_REDOP_SUM;
    enum { MAXIN = 64 };
    const void *blk_in_small[MAXIN];
    const void **blk_in = blk_in_small;
    if (nin > MAXIN) {
        blk_in = malloc((size_t)nin * sizeof *blk_in);
        if (!blk_in) return FSDP_ENOMEM;
    }
    size_t esize = fsdp_dtype_size(dt);
    union {
        float f32[BLOCK];
        double f64[BLOCK];
        uint32_t u32[BLOCK];
        int32_t i32[BLOCK];
        uint64_t u64[BLOCK];
        int64_t i64[BLOCK];
        uint8_t u8[BLOCK];
    } acc;
    float tmp[BLOCK];
    uint16_t half[BLOCK];
    int stream = n * esize >= STREAM_MIN_BYTES;
    for (size_t off = 0; off < n; off += BLOCK) {
        size_t m = n - off < BLOCK ? n - off : BLOCK;
        advance(blk_in, ins, nin, off, esize);
        const void *const *in = blk_in;
        switch (dt) {
        case FSDP_DTYPE_F32:
            if (pre)
                f32_presum(acc.f32, in, nin, m, (float)prescale);
            else
                DISPATCH(acc.f32, in, nin, m, op, f32_sum, f32_prod, f32_min, f32_max);
            if (op == FSDP_REDOP_AVG)
                for (size_t i = 0; i < m; i++)
                    acc.f32[i] /= (float)divisor;
            store_all(outs, nout, off, acc.f32, m * 4, 4, stream);
            break;
        case FSDP_DTYPE_F64:
            if (pre)
                f64_presum(acc.f64, in, nin, m, prescale);
            else
                DISPATCH(acc.f64, in, nin, m, op, f64_sum, f64_prod, f64_min, f64_max);
            if (op == FSDP_REDOP_AVG)
                for (size_t i = 0; i < m; i++)
                    acc.f64[i] /= (double)divisor;
            store_all(outs, nout, off, acc.f64, m * 8, 8, stream);
            break;
        case FSDP_DTYPE_F16:
        case FSDP_DTYPE_BF16:
            if (pre)
                half_presum(acc.f32, tmp, half, in, nin, m, dt, (float)prescale);
            else
                half_reduce(acc.f32, tmp, in, nin, m, dt, op);
            if (op == FSDP_REDOP_AVG)
                for (size_t i = 0; i < m; i++)
                    acc.f32[i] /= (float)divisor;
            fsdp_dtype_convert(half, dt, acc.f32, FSDP_DTYPE_F32, m);
            store_all(outs, nout, off, half, m * 2, 2, stream);
            break;
        case FSDP_DTYPE_I32:
            DISPATCH_INT(acc.u32, acc.i32, in, nin, m, op, u32_sum, u32_prod, i32_min, i32_max);
            if (op == FSDP_REDOP_AVG)
                for (size_t i = 0; i < m; i++)
                    acc.i32[i] = (int32_t)(acc.i32[i] / divisor);
            store_all(outs, nout, off, acc.u32, m * 4, 4, stream);
            break;
        case FSDP_DTYPE_I64:
            DISPATCH_INT(acc.u64, acc.i64, in, nin, m, op, u64_sum, u64_prod, i64_min, i64_max);
            if (op == FSDP_REDOP_AVG)
                for (size_t i = 0; i < m; i++)
                    acc.i64[i] = acc.i64[i] / divisor;
            store_all(outs, nout, off, acc.u64, m * 8, 8, stream);
            break;
        case FSDP_DTYPE_U8:
            DISPATCH(acc.u8, in, nin, m, op, u8_sum, u8_prod, u8_min, u8_max);
            if (op == FSDP_REDOP_AVG)
                for (size_t i = 0; i < m; i++)
                    acc.u8[i] = (uint8_t)(acc.u8[i] / divisor);
            store_all(outs, nout, off, acc.u8, m, 1, stream);
            break;
        case FSDP_DTYPE_BOOL:
            DISPATCH(acc.u8, in, nin, m, op, bool_or, bool_and, bool_and, bool_or);
            if (nin == 1) /* a lone input did not pass through an operator */
                for (size_t i = 0; i < m; i++)
                    acc.u8[i] = acc.u8[i] != 0;
            store_all(outs, nout, off, acc.u8, m, 1, stream);
            break;
        default:
            break;
        }
    }
    /* Non-temporal stores are weakly ordered: make them visible before anybody is told. */
    if (stream) fsdp__copy_fence();
    if (blk_in != blk_in_small) free(blk_in);
    return FSDP_OK;
}
