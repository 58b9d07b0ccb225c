/* SPDX-License-Identifier: MIT */
/*
 * cuda_cast.h: the CUDA device's dtype conversions, element by element, as __host__ __device__
 * functions: the cast kernel runs them on the GPU, and t_cuda_host compiles them for the host
 * and checks them bit for bit against fsdp_dtype_convert() (src/core/dtype.c), whose rules they
 * follow:
 *   - every value travels as double (the float types, exactly) or int64 (the integer types) and
 *     is rounded once into the destination, to nearest even;
 *   - f16/bf16 rounding handles subnormals and overflows to Inf; a NaN keeps its sign and the
 *     top fraction bits that fit and gets the quiet bit;
 *   - integer destinations saturate (floats are truncated toward zero first), NaN becomes 0, and
 *     bool is "not zero" (NaN is not zero).
 * Bit reinterpretation uses memcpy on the host and the CUDA intrinsics on the device. dtype
 * numbers are fsdp_dtype_t's.
 *
 * Plain C99 when not compiled by nvcc.
 */
#ifndef FSDP_CUDA_CAST_H
#define FSDP_CUDA_CAST_H

#include <stdint.h>
#include <string.h>

#include <fsdp/dtype.h>

#ifdef __CUDACC__
#define FSDP_CUDA_CAST_HD static __host__ __device__ __forceinline__
#else
#define FSDP_CUDA_CAST_HD static inline
#endif

FSDP_CUDA_CAST_HD uint64_t fsdp_cc_bits64(double d) {
#ifdef __CUDA_ARCH__
    return (uint64_t)__double_as_longlong(d);
#else
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return u;
#endif
}

FSDP_CUDA_CAST_HD double fsdp_cc_f64(uint64_t u) {
#ifdef __CUDA_ARCH__
    return __longlong_as_double((long long)u);
#else
    double d;
    memcpy(&d, &u, sizeof d);
    return d;
#endif
}

FSDP_CUDA_CAST_HD uint32_t fsdp_cc_bits32(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
#endif
}

FSDP_CUDA_CAST_HD float fsdp_cc_f32(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* Index of the highest set bit of m (m != 0). */
FSDP_CUDA_CAST_HD int fsdp_cc_high_bit(uint64_t m) {
#ifdef __CUDA_ARCH__
    return 63 - __clzll((long long)m);
#else
    return 63 - __builtin_clzll(m);
#endif
}

FSDP_CUDA_CAST_HD float fsdp_cc_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, e = (uint32_t)(h >> 10) & 0x1f, m = h & 0x3ffu;
    if (e == 0x1f) return fsdp_cc_f32(sign | 0x7f800000u | (m << 13)); /* Inf, NaN + payload */
    if (e == 0) {
        /* Subnormal (or zero): m units of 2^-24, exact in float. */
        float v = (float)m * 0x1p-24f;
        return sign ? -v : v;
    }
    return fsdp_cc_f32(sign | ((e + 112) << 23) | (m << 13));
}

FSDP_CUDA_CAST_HD float fsdp_cc_bf16_to_f32(uint16_t h) {
    return fsdp_cc_f32((uint32_t)h << 16);
}

/* f32 -> double keeping a NaN's payload (a hardware conversion may make it canonical). */
FSDP_CUDA_CAST_HD double fsdp_cc_f32_to_f64(float f) {
    if (f == f) return (double)f;
    uint32_t u = fsdp_cc_bits32(f);
    return fsdp_cc_f64(((uint64_t)(u >> 31) << 63) | ((uint64_t)0x7ff << 52) |
                       ((uint64_t)(u & 0x7fffffu) << 29));
}

/* double -> f32 as the host does it: a NaN keeps its top 22 fraction bits, quiet bit set. */
FSDP_CUDA_CAST_HD float fsdp_cc_f64_to_f32(double d) {
    if (d == d) return (float)d;
    uint64_t u = fsdp_cc_bits64(d);
    return fsdp_cc_f32(((uint32_t)(u >> 63) << 31) | 0x7fc00000u |
                       (uint32_t)((u >> 29) & 0x7fffffu));
}

/* Rounds sign * m * 2^exp2 (m > 0) to a narrow float with mb fraction bits, exponent bias
 * `bias` and all-ones exponent field emax; nearest even, subnormals, overflow to Inf. */
FSDP_CUDA_CAST_HD uint16_t fsdp_cc_round_narrow(uint32_t sign, uint64_t m, int exp2, int mb,
                                                int bias, int emax) {
    const int e = fsdp_cc_high_bit(m) + exp2; /* unbiased exponent of the value */
    const int emin = 1 - bias;
    const int q = (e < emin ? emin : e) - mb; /* exponent of the last kept bit */
    const int sft = q - exp2;                 /* bits of m below it */
    uint64_t r;
    if (sft <= 0) {
        r = m << -sft;
    } else if (sft >= 64) {
        r = 0;
    } else {
        const uint64_t rest = m & ((UINT64_C(1) << sft) - 1), half = UINT64_C(1) << (sft - 1);
        r = m >> sft;
        if (rest > half || (rest == half && (r & 1))) r++;
    }
    /* r holds the implicit bit for normals, so adding it to (e - emin) << mb encodes normals,
     * subnormals and a carry into the next binade alike. */
    uint64_t bits = e < emin ? r : ((uint64_t)(e - emin) << mb) + r;
    if (bits >= ((uint64_t)emax << mb)) bits = (uint64_t)emax << mb; /* Inf */
    return (uint16_t)((sign << 15) | bits);
}

FSDP_CUDA_CAST_HD uint16_t fsdp_cc_narrow_from_f64(double d, int mb, int bias, int emax) {
    const uint64_t u = fsdp_cc_bits64(d);
    const uint32_t sign = (uint32_t)(u >> 63);
    const uint32_t ef = (uint32_t)(u >> 52) & 0x7ff;
    const uint64_t frac = u & ((UINT64_C(1) << 52) - 1);
    if (ef == 0x7ff) {
        if (!frac) return (uint16_t)((sign << 15) | ((uint32_t)emax << mb));
        return (uint16_t)((sign << 15) | ((uint32_t)emax << mb) | (1u << (mb - 1)) |
                          (uint32_t)(frac >> (52 - mb)));
    }
    /* Zero, or a double subnormal: far below half the smallest f16/bf16 subnormal. */
    if (ef == 0) return (uint16_t)(sign << 15);
    return fsdp_cc_round_narrow(sign, frac | (UINT64_C(1) << 52), (int)ef - 1075, mb, bias, emax);
}

FSDP_CUDA_CAST_HD uint16_t fsdp_cc_narrow_from_i64(int64_t v, int mb, int bias, int emax) {
    if (v == 0) return 0;
    const uint32_t sign = v < 0;
    const uint64_t m = sign ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    return fsdp_cc_round_narrow(sign, m, 0, mb, bias, emax);
}

FSDP_CUDA_CAST_HD int fsdp_cc_is_float(int t) {
    return t == FSDP_DTYPE_F32 || t == FSDP_DTYPE_F64 || t == FSDP_DTYPE_F16 ||
           t == FSDP_DTYPE_BF16;
}

FSDP_CUDA_CAST_HD double fsdp_cc_load_f(int t, const void *x, size_t i) {
    switch (t) {
    case FSDP_DTYPE_F32:
        return fsdp_cc_f32_to_f64(((const float *)x)[i]);
    case FSDP_DTYPE_F64:
        return ((const double *)x)[i];
    case FSDP_DTYPE_F16:
        return fsdp_cc_f32_to_f64(fsdp_cc_f16_to_f32(((const uint16_t *)x)[i]));
    default:
        return fsdp_cc_f32_to_f64(fsdp_cc_bf16_to_f32(((const uint16_t *)x)[i]));
    }
}

FSDP_CUDA_CAST_HD int64_t fsdp_cc_load_i(int t, const void *x, size_t i) {
    switch (t) {
    case FSDP_DTYPE_I32:
        return ((const int32_t *)x)[i];
    case FSDP_DTYPE_I64:
        return ((const int64_t *)x)[i];
    case FSDP_DTYPE_U8:
        return ((const uint8_t *)x)[i];
    default:
        return ((const uint8_t *)x)[i] != 0;
    }
}

FSDP_CUDA_CAST_HD void fsdp_cc_store_f(int t, void *y, size_t i, double v) {
    switch (t) {
    case FSDP_DTYPE_F32:
        ((float *)y)[i] = fsdp_cc_f64_to_f32(v);
        break;
    case FSDP_DTYPE_F64:
        ((double *)y)[i] = v;
        break;
    case FSDP_DTYPE_F16:
        ((uint16_t *)y)[i] = fsdp_cc_narrow_from_f64(v, 10, 15, 0x1f);
        break;
    case FSDP_DTYPE_BF16:
        ((uint16_t *)y)[i] = fsdp_cc_narrow_from_f64(v, 7, 127, 0xff);
        break;
    case FSDP_DTYPE_I32:
        ((int32_t *)y)[i] = v != v               ? 0
                            : v >= 2147483648.0  ? INT32_MAX
                            : v <= -2147483649.0 ? INT32_MIN
                                                 : (int32_t)v;
        break;
    case FSDP_DTYPE_I64:
        ((int64_t *)y)[i] = v != v                       ? 0
                            : v >= 9223372036854775808.0 ? INT64_MAX
                            : v < -9223372036854775808.0 ? INT64_MIN
                                                         : (int64_t)v;
        break;
    case FSDP_DTYPE_U8:
        ((uint8_t *)y)[i] = !(v > -1.0) ? 0 : v >= 256.0 ? 255 : (uint8_t)v;
        break;
    default:
        ((uint8_t *)y)[i] = v != 0.0;
        break;
    }
}

FSDP_CUDA_CAST_HD void fsdp_cc_store_i(int t, void *y, size_t i, int64_t v) {
    switch (t) {
    case FSDP_DTYPE_F32:
        ((float *)y)[i] = (float)v;
        break;
    case FSDP_DTYPE_F64:
        ((double *)y)[i] = (double)v;
        break;
    case FSDP_DTYPE_F16:
        ((uint16_t *)y)[i] = fsdp_cc_narrow_from_i64(v, 10, 15, 0x1f);
        break;
    case FSDP_DTYPE_BF16:
        ((uint16_t *)y)[i] = fsdp_cc_narrow_from_i64(v, 7, 127, 0xff);
        break;
    case FSDP_DTYPE_I32:
        ((int32_t *)y)[i] = v > INT32_MAX ? INT32_MAX : v < INT32_MIN ? INT32_MIN : (int32_t)v;
        break;
    case FSDP_DTYPE_I64:
        ((int64_t *)y)[i] = v;
        break;
    case FSDP_DTYPE_U8:
        ((uint8_t *)y)[i] = v > 255 ? 255 : v < 0 ? 0 : (uint8_t)v;
        break;
    default:
        ((uint8_t *)y)[i] = v != 0;
        break;
    }
}

/* The two conversions of mixed precision, in one step each, bit for bit what
 * fsdp_cuda_cast_one gives: a float is exact in double, so rounding its bits directly to the
 * nearest even bf16 is the same single rounding (overflow to Inf, subnormals included); a NaN
 * keeps its sign and top fraction bits and gets the quiet bit, as through double. */
FSDP_CUDA_CAST_HD uint16_t fsdp_cc_f32_to_bf16(float f) {
    const uint32_t u = fsdp_cc_bits32(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

FSDP_CUDA_CAST_HD float fsdp_cc_bf16_to_f32_q(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    if ((u & 0x7fffffffu) > 0x7f800000u) u |= 0x00400000u;
    return fsdp_cc_f32(u);
}

/* y[i] = (yt) x[i]. In place (y == x, equal sizes) is safe: x[i] is read before y[i] is
 * written. */
FSDP_CUDA_CAST_HD void fsdp_cuda_cast_one(int yt, void *y, int xt, const void *x, size_t i) {
    if (fsdp_cc_is_float(xt))
        fsdp_cc_store_f(yt, y, i, fsdp_cc_load_f(xt, x, i));
    else
        fsdp_cc_store_i(yt, y, i, fsdp_cc_load_i(xt, x, i));
}

#endif /* FSDP_CUDA_CAST_H */
