/*
 * reduce.c: blocked reduction kernels.
 *
 * Each block of BLOCK elements is accumulated into a small stack buffer (in the accumulation
 * type: f32 for f16/bf16, the element type otherwise), then copied to every output. Working in
 * cache-sized blocks keeps the extra pass cheap and makes aliasing between inputs and outputs
 * harmless: a block is read completely before any output is written. Integer arithmetic is done
 * on unsigned types so that overflow wraps instead of being undefined. Float min and max
 * propagate NaN.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/errno.h>

#include "core/reduce.h"

#define BLOCK 2048

int fsdp__redop_supported(fsdp_dtype_t dt, fsdp_redop_t op) {
    if (!fsdp_dtype_valid((int)dt) || (int)op < 0 || op >= FSDP_REDOP_COUNT) return 0;
    return !(dt == FSDP_DTYPE_BOOL && op == FSDP_REDOP_AVG);
}

/* Binary operators per accumulation type. */
#define FOP_SUM(a, b) ((a) + (b))
#define FOP_PROD(a, b) ((a) * (b))
#define FOP_MIN(a, b) (((a) < (b) || isnan(a)) ? (a) : (b))
#define FOP_MAX(a, b) (((a) > (b) || isnan(a)) ? (a) : (b))
#define IOP_MIN(a, b) ((a) < (b) ? (a) : (b))
#define IOP_MAX(a, b) ((a) > (b) ? (a) : (b))

/*
 * Accumulates one block: acc[i] = in0[i] OP in1[i] OP ... with LOAD converting an element of
 * input k at index i to the accumulation type.
 */
#define ACCUMULATE(acc, ins, nin, m, T, LOAD, OP)                                              \
    do {                                                                                       \
        const T *in0_ = (const T *)(ins)[0];                                                   \
        if ((nin) == 1) {                                                                      \
            for (size_t i = 0; i < (m); i++) (acc)[i] = LOAD(in0_, i);                         \
        } else {                                                                               \
            const T *in1_ = (const T *)(ins)[1];                                               \
            for (size_t i = 0; i < (m); i++) (acc)[i] = OP(LOAD(in0_, i), LOAD(in1_, i));      \
            for (int k = 2; k < (nin); k++) {                                                  \
                const T *ink_ = (const T *)(ins)[k];                                           \
                for (size_t i = 0; i < (m); i++) (acc)[i] = OP((acc)[i], LOAD(ink_, i));       \
            }                                                                                  \
        }                                                                                      \
    } while (0)

#define LOAD_PLAIN(p, i) ((p)[i])
#define LOAD_F16(p, i) fsdp_f16_to_f32((p)[i])
#define LOAD_BF16(p, i) fsdp_bf16_to_f32((p)[i])

/* Integer sum and product on unsigned accumulators (so overflow wraps); min and max are
 * dispatched separately on the signed type. */
#define ACCUMULATE_WRAP(acc, ins, nin, m, T, SUM, PROD, op)                                     \
    do {                                                                                       \
        if ((op) == FSDP_REDOP_PROD) ACCUMULATE(acc, ins, nin, m, T, LOAD_PLAIN, PROD);        \
        else ACCUMULATE(acc, ins, nin, m, T, LOAD_PLAIN, SUM);                                 \
    } while (0)

/* Dispatches a reduction operator for a type whose elements are accumulated as themselves. */
#define ACCUMULATE_OPS(acc, ins, nin, m, T, LOAD, SUM, PROD, MIN, MAX, op)                      \
    do {                                                                                       \
        switch (op) {                                                                          \
        case FSDP_REDOP_SUM:                                                                   \
        case FSDP_REDOP_AVG: ACCUMULATE(acc, ins, nin, m, T, LOAD, SUM); break;                \
        case FSDP_REDOP_PROD: ACCUMULATE(acc, ins, nin, m, T, LOAD, PROD); break;              \
        case FSDP_REDOP_MIN: ACCUMULATE(acc, ins, nin, m, T, LOAD, MIN); break;                \
        case FSDP_REDOP_MAX: ACCUMULATE(acc, ins, nin, m, T, LOAD, MAX); break;                \
        default: break;                                                                        \
        }                                                                                      \
    } while (0)

#define USUM32(a, b) ((uint32_t)(a) + (uint32_t)(b))
#define UPROD32(a, b) ((uint32_t)(a) * (uint32_t)(b))
#define USUM64(a, b) ((uint64_t)(a) + (uint64_t)(b))
#define UPROD64(a, b) ((uint64_t)(a) * (uint64_t)(b))
#define USUM8(a, b) ((uint8_t)((a) + (b)))
#define UPROD8(a, b) ((uint8_t)((unsigned)(a) * (unsigned)(b)))
#define BOR(a, b) ((uint8_t)((a) | (b)))
#define BAND(a, b) ((uint8_t)((a) & (b)))
#define LOAD_BOOL(p, i) ((uint8_t)((p)[i] != 0))

/* Offsets every pointer of a list by `off` elements of `size` bytes. */
static void advance(const void **dst, const void *const *src, int n, size_t off, size_t size) {
    for (int k = 0; k < n; k++) dst[k] = (const char *)src[k] + off * size;
}

static void store_all(void *const *outs, int nout, size_t off, const void *block, size_t bytes,
                      size_t esize) {
    for (int k = 0; k < nout; k++) memcpy((char *)outs[k] + off * esize, block, bytes);
}

int fsdp__reduce(void *const *outs, int nout, const void *const *ins, int nin, size_t n,
                 fsdp_dtype_t dt, fsdp_redop_t op, int divisor) {
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
        uint64_t u64[BLOCK];
        uint8_t u8[BLOCK];
    } acc;
    uint16_t half[BLOCK];
    for (size_t off = 0; off < n; off += BLOCK) {
        size_t m = n - off < BLOCK ? n - off : BLOCK;
        advance(blk_in, ins, nin, off, esize);
        switch (dt) {
        case FSDP_DTYPE_F32:
            ACCUMULATE_OPS(acc.f32, blk_in, nin, m, float, LOAD_PLAIN, FOP_SUM, FOP_PROD, FOP_MIN,
                           FOP_MAX, op);
            if (op == FSDP_REDOP_AVG)
                for (size_t i = 0; i < m; i++) acc.f32[i] /= (float)divisor;
            store_all(outs, nout, off, acc.f32, m * 4, 4);
            break;
        case FSDP_DTYPE_F64:
            ACCUMULATE_OPS(acc.f64, blk_in, nin, m, double, LOAD_PLAIN, FOP_SUM, FOP_PROD,
                           FOP_MIN, FOP_MAX, op);
            if (op == FSDP_REDOP_AVG)
                for (size_t i = 0; i < m; i++) acc.f64[i] /= (double)divisor;
            store_all(outs, nout, off, acc.f64, m * 8, 8);
            break;
        case FSDP_DTYPE_F16:
        case FSDP_DTYPE_BF16:
            if (dt == FSDP_DTYPE_F16)
                ACCUMULATE_OPS(acc.f32, blk_in, nin, m, uint16_t, LOAD_F16, FOP_SUM, FOP_PROD,
                               FOP_MIN, FOP_MAX, op);
            else
                ACCUMULATE_OPS(acc.f32, blk_in, nin, m, uint16_t, LOAD_BF16, FOP_SUM, FOP_PROD,
                               FOP_MIN, FOP_MAX, op);
            if (op == FSDP_REDOP_AVG)
                for (size_t i = 0; i < m; i++) acc.f32[i] /= (float)divisor;
            fsdp_dtype_convert(half, dt, acc.f32, FSDP_DTYPE_F32, m);
            store_all(outs, nout, off, half, m * 2, 2);
            break;
        case FSDP_DTYPE_I32:
            if (op == FSDP_REDOP_MIN || op == FSDP_REDOP_MAX) {
                int32_t *a = (int32_t *)acc.u32;
                if (op == FSDP_REDOP_MIN)
                    ACCUMULATE(a, blk_in, nin, m, int32_t, LOAD_PLAIN, IOP_MIN);
                else
                    ACCUMULATE(a, blk_in, nin, m, int32_t, LOAD_PLAIN, IOP_MAX);
            } else {
                ACCUMULATE_WRAP(acc.u32, blk_in, nin, m, int32_t, USUM32, UPROD32, op);
                if (op == FSDP_REDOP_AVG) {
                    int32_t *a = (int32_t *)acc.u32;
                    for (size_t i = 0; i < m; i++) a[i] = (int32_t)(a[i] / divisor);
                }
            }
            store_all(outs, nout, off, acc.u32, m * 4, 4);
            break;
        case FSDP_DTYPE_I64:
            if (op == FSDP_REDOP_MIN || op == FSDP_REDOP_MAX) {
                int64_t *a = (int64_t *)acc.u64;
                if (op == FSDP_REDOP_MIN)
                    ACCUMULATE(a, blk_in, nin, m, int64_t, LOAD_PLAIN, IOP_MIN);
                else
                    ACCUMULATE(a, blk_in, nin, m, int64_t, LOAD_PLAIN, IOP_MAX);
            } else {
                ACCUMULATE_WRAP(acc.u64, blk_in, nin, m, int64_t, USUM64, UPROD64, op);
                if (op == FSDP_REDOP_AVG) {
                    int64_t *a = (int64_t *)acc.u64;
                    for (size_t i = 0; i < m; i++) a[i] = a[i] / divisor;
                }
            }
            store_all(outs, nout, off, acc.u64, m * 8, 8);
            break;
        case FSDP_DTYPE_U8:
            ACCUMULATE_OPS(acc.u8, blk_in, nin, m, uint8_t, LOAD_PLAIN, USUM8, UPROD8, IOP_MIN,
                           IOP_MAX, op);
            if (op == FSDP_REDOP_AVG)
                for (size_t i = 0; i < m; i++) acc.u8[i] = (uint8_t)(acc.u8[i] / divisor);
            store_all(outs, nout, off, acc.u8, m, 1);
            break;
        case FSDP_DTYPE_BOOL:
            ACCUMULATE_OPS(acc.u8, blk_in, nin, m, uint8_t, LOAD_BOOL, BOR, BAND, BAND, BOR, op);
            store_all(outs, nout, off, acc.u8, m, 1);
            break;
        default:
            break;
        }
    }
    if (blk_in != blk_in_small) free(blk_in);
    return FSDP_OK;
}
