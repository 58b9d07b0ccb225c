/* SPDX-License-Identifier: MIT */
/*
 * dtype.c: element types, the scalar f16/bf16 conversions and fsdp_dtype_convert().
 *
 * Invariants:
 * - Conversions to f16/bf16 (from f32, f64 and integers) are done on bit patterns with integer
 *   operations only, so they round to nearest even whatever the caller's FP environment
 *   (rounding mode, FTZ/DAZ) is. Decoding f16/bf16 is exact (one float operation, a small
 *   integer times a power of two). Conversions to f32/f64 from f64/i64 are plain C casts,
 *   correctly rounded in the current rounding mode (IEEE 754 / C Annex F), which is
 *   nearest-even unless the caller changed it.
 * - Every value is rounded at most once on its way from source to destination. f32, f16 and
 *   bf16 are exact in double, so the generic path carries floats as double; a 64-bit integer is
 *   carried as an int64_t and rounded once by the routine that produces the destination type
 *   (see int_to_narrow()).
 * - NaN never turns into Inf: narrowing a NaN keeps its sign and the top payload bits that fit
 *   and sets the quiet bit, which is what makes the result a NaN even when the kept payload bits
 *   are zero.
 * - Integer destinations saturate (from floats after truncation toward zero, and from wider
 *   integers too); NaN becomes 0. No out-of-range float-to-int cast is ever executed.
 * - fsdp_dtype_convert() refuses (FSDP_EINVAL) buffers that overlap in any way other than the
 *   one the header allows, dst == src with equal element sizes, rather than corrupt them.
 * The only state is the immutable name tables.
 */
#include <stdint.h>
#include <string.h>

#include <fsdp/dtype.h>
#include <fsdp/errno.h>

static const size_t dtype_sizes[FSDP_DTYPE_COUNT] = {4, 8, 2, 2, 4, 8, 1, 1};

static const char *const dtype_names[FSDP_DTYPE_COUNT] = {"f32", "f64", "f16", "bf16",
                                                          "i32", "i64", "u8",  "bool"};

/* Accepted spellings; the first entry of each type is its fsdp_dtype_name(). */
static const struct {
    const char *name;
    fsdp_dtype_t dt;
} dtype_aliases[] = {
    {"f32", FSDP_DTYPE_F32},   {"float32", FSDP_DTYPE_F32},   {"float", FSDP_DTYPE_F32},
    {"f64", FSDP_DTYPE_F64},   {"float64", FSDP_DTYPE_F64},   {"double", FSDP_DTYPE_F64},
    {"f16", FSDP_DTYPE_F16},   {"float16", FSDP_DTYPE_F16},   {"half", FSDP_DTYPE_F16},
    {"bf16", FSDP_DTYPE_BF16}, {"bfloat16", FSDP_DTYPE_BF16}, {"i32", FSDP_DTYPE_I32},
    {"int32", FSDP_DTYPE_I32}, {"i64", FSDP_DTYPE_I64},       {"int64", FSDP_DTYPE_I64},
    {"u8", FSDP_DTYPE_U8},     {"uint8", FSDP_DTYPE_U8},      {"bool", FSDP_DTYPE_BOOL},
};

int fsdp_dtype_valid(int dt) {
    return dt >= 0 && dt < (int)FSDP_DTYPE_COUNT;
}

size_t fsdp_dtype_size(fsdp_dtype_t dt) {
    return fsdp_dtype_valid((int)dt) ? dtype_sizes[dt] : 0;
}

const char *fsdp_dtype_name(fsdp_dtype_t dt) {
    return fsdp_dtype_valid((int)dt) ? dtype_names[dt] : "invalid";
}

int fsdp_dtype_is_float(fsdp_dtype_t dt) {
    return dt == FSDP_DTYPE_F32 || dt == FSDP_DTYPE_F64 || dt == FSDP_DTYPE_F16 ||
           dt == FSDP_DTYPE_BF16;
}

int fsdp_dtype_from_name(const char *name, fsdp_dtype_t *out) {
    if (!name || !out) return FSDP_EINVAL;
    for (size_t i = 0; i < sizeof dtype_aliases / sizeof dtype_aliases[0]; i++) {
        if (strcmp(name, dtype_aliases[i].name) == 0) {
            *out = dtype_aliases[i].dt;
            return FSDP_OK;
        }
    }
    return FSDP_EINVAL;
}

/* ---- bit access (memcpy is the aliasing-safe way and compiles to a register move) ---- */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint64_t f64_bits(double d) {
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return u;
}

/* ---- f32 <-> bf16 ---- */

static inline uint16_t bf16_from_bits32(uint32_t x) {
    /* Adding 0x7fff plus the lsb that survives rounds to nearest even; a carry out of the
     * mantissa bumps the exponent, and FLT_MAX-ish values carry into the Inf pattern, which is
     * the correct overflow. No finite or infinite input can wrap around 2^32. */
    uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    /* A NaN keeps sign and top 7 payload bits, plus the quiet bit so it stays a NaN. */
    uint32_t quiet = (x >> 16) | 0x40u;
    int is_nan = (x & 0x7fffffffu) > 0x7f800000u;
    return (uint16_t)(is_nan ? quiet : rounded);
}

static inline float bf16_to_f32_inline(uint16_t h) {
    return f32_from_bits((uint32_t)h << 16);
}

/* ---- f32 <-> f16 ---- */

/* Shifts m right by s (1 <= s <= 63) rounding to nearest, ties to even. */
static inline uint64_t shift_rne64(uint64_t m, unsigned s) {
    uint64_t half_minus_one = (UINT64_C(1) << (s - 1)) - 1;
    return (m + half_minus_one + ((m >> s) & 1u)) >> s;
}

/* The exact conversion, one value at a time. */
static inline uint16_t f16_from_bits32(uint32_t x) {
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t a = x & 0x7fffffffu;
    uint32_t h;
    if (a >= 0x38800000u && a < 0x477ff000u) {
        /* Normal f16 range [2^-14, 65520): rebias the exponent (127 -> 15) and round away the
         * low 13 bits; a carry out of the mantissa moves to the next binade, as it should. */
        h = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
    } else if (a > 0x7f800000u) {
        h = 0x7e00u | ((a >> 13) & 0x1ffu); /* NaN: quiet bit, then the top 9 payload bits */
    } else if (a >= 0x477ff000u) {
        h = 0x7c00u; /* 65520 = 65504 + half an ulp ties to the even Inf; and up, and Inf */
    } else if (a > 0x33000000u) {
        /* Subnormal f16 range (2^-25, 2^-14): the result counts units of 2^-24. With the
         * implicit bit restored, value = m * 2^(e - 150), so units = m >> (126 - e), where
         * 14 <= 126 - e <= 24. Rounding up to 0x400 gives the smallest normal, as it should. */
        uint32_t sh = 126u - (a >> 23);
        uint32_t m = (a & 0x7fffffu) | 0x800000u;
        h = (m + (1u << (sh - 1)) - 1u + ((m >> sh) & 1u)) >> sh;
    } else {
        h = 0; /* up to 2^-25, whose tie goes to the even zero */
    }
    return (uint16_t)(sign | h);
}

/* 1 when x converts to an f16 subnormal (or rounds up to the smallest normal from below). */
static inline uint32_t f16_subnormal_range(uint32_t x) {
    return (x & 0x7fffffffu) - 0x33000001u < 0x38800000u - 0x33000001u;
}

/*
 * The same conversion for everything but the f16 subnormal range, which it maps to +-0:
 * the cases are selected with masks instead of branches and the subnormal case (the only one
 * that needs a per-element shift count) is left out, so a loop over this vectorizes on any
 * SIMD level. Callers redo the subnormal-range elements with f16_from_bits32().
 */
static inline uint16_t f16_from_bits32_nosub(uint32_t x) {
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t a = x & 0x7fffffffu;
    uint32_t nan_h = 0x7e00u | ((a >> 13) & 0x1ffu);
    uint32_t norm_h = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
    uint32_t is_nan = 0u - (uint32_t)(a > 0x7f800000u);
    uint32_t is_inf = ~is_nan & (0u - (uint32_t)(a >= 0x477ff000u));
    uint32_t is_norm = (0u - (uint32_t)(a >= 0x38800000u)) & ~is_nan & ~is_inf;
    return (uint16_t)(sign | (nan_h & is_nan) | (0x7c00u & is_inf) | (norm_h & is_norm));
}

static inline float f16_to_f32_inline(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu;
    uint32_t m = h & 0x3ffu;
    uint32_t special = 0x7f800000u | (m << 13);       /* Inf, or NaN with its payload */
    uint32_t normal = ((e + 112u) << 23) | (m << 13); /* rebias 15 -> 127 */
    uint32_t sub = f32_bits((float)m * 0x1p-24f);     /* zero or subnormal: exact in f32 */
    /* Selected with masks rather than branches, so that loops over it vectorize. */
    uint32_t is_special = 0u - (uint32_t)(e == 0x1fu);
    uint32_t is_sub = 0u - (uint32_t)(e == 0);
    uint32_t is_normal = ~(is_special | is_sub);
    return f32_from_bits(sign | (special & is_special) | (normal & is_normal) | (sub & is_sub));
}

uint16_t fsdp_f32_to_f16(float x) {
    return f16_from_bits32(f32_bits(x));
}
float fsdp_f16_to_f32(uint16_t h) {
    return f16_to_f32_inline(h);
}
uint16_t fsdp_f32_to_bf16(float x) {
    return bf16_from_bits32(f32_bits(x));
}
float fsdp_bf16_to_f32(uint16_t h) {
    return bf16_to_f32_inline(h);
}

/* ---- one rounding from double or int64 to f16 / bf16 ---- */

/* Layout of a narrow binary format: mantissa bits (without the implicit one), exponent bias,
 * the all-ones exponent field. f16: 10, 15, 31. bf16: 7, 127, 255. */
struct narrow_fmt {
    unsigned mbits;
    int bias;
    uint32_t emax_field;
};

static const struct narrow_fmt fmt_f16 = {10, 15, 0x1f};
static const struct narrow_fmt fmt_bf16 = {7, 127, 0xff};

/* Index of the highest set bit of m != 0. */
static inline int highest_bit(uint64_t m) {
#if defined(__GNUC__) || defined(__clang__)
    return 63 - __builtin_clzll(m);
#else
    int top = 63;
    while (!(m >> top))
        top--;
    return top;
#endif
}

/*
 * Rounds sign * m * 2^exp2 (0 < m <= 2^63, so the rounding add cannot carry out of 64 bits)
 * to the narrow format in one step. The significand is shifted so that its units are the
 * destination's ulp at that exponent (or the subnormal quantum, below the normal range) and
 * rounded there to nearest even; the rounded significand still holds the implicit bit, so
 * adding it onto (biased exponent - 1) << mbits lets a carry move into the next binade, and
 * into the Inf pattern at the top.
 */
static uint16_t round_to_narrow(uint32_t sign, uint64_t m, int exp2, const struct narrow_fmt *f) {
    int top = highest_bit(m);
    int e = exp2 + top; /* value in [2^e, 2^(e+1)) */
    uint32_t inf = sign | (f->emax_field << f->mbits);
    if (e + f->bias >= (int)f->emax_field) return (uint16_t)inf;
    int min_e = 1 - f->bias;                             /* exponent of the smallest normal */
    int q_exp = (e < min_e ? min_e : e) - (int)f->mbits; /* exponent of one unit of the result */
    int s = q_exp - exp2;                                /* right shift that makes those units */
    uint64_t q;
    if (s <= 0) {
        q = m << -s; /* exact; only happens for small integers, which fit easily */
    } else if (s > 63) {
        q = 0; /* below half the smallest subnormal: m < 2^53 there (a double), 2^(s-1) >= 2^63 */
    } else {
        q = shift_rne64(m, (unsigned)s);
    }
    uint64_t r = e < min_e ? q : ((uint64_t)(e + f->bias - 1) << f->mbits) + q;
    if (r >= ((uint64_t)f->emax_field << f->mbits)) return (uint16_t)inf;
    return (uint16_t)(sign | (uint32_t)r);
}

/*
 * double -> f16/bf16 with a single rounding, straight from the double's fields. Rounding the
 * double to float first would round twice and can give the wrong answer next to a tie.
 */
static uint16_t f64_to_narrow(double d, const struct narrow_fmt *f) {
    uint64_t x = f64_bits(d);
    uint32_t sign = (uint32_t)(x >> 48) & 0x8000u;
    uint64_t a = x & UINT64_C(0x7fffffffffffffff);
    uint32_t exp_field = (uint32_t)(a >> 52);
    uint64_t frac = a & UINT64_C(0xfffffffffffff);
    if (exp_field == 0x7ffu) {
        if (frac == 0) return (uint16_t)(sign | (f->emax_field << f->mbits));
        uint32_t payload = (uint32_t)(frac >> (52 - f->mbits)); /* the top mbits of it */
        uint32_t quiet = 1u << (f->mbits - 1);
        return (uint16_t)(sign | (f->emax_field << f->mbits) | quiet | payload);
    }
    if (exp_field == 0) {
        /* Zero or a double subnormal (< 2^-1022): far below half the smallest f16/bf16 value. */
        return (uint16_t)sign;
    }
    return round_to_narrow(sign, frac | (UINT64_C(1) << 52), (int)exp_field - 1075, f);
}

/* int64 -> f16/bf16 with a single rounding (through double would round twice above 2^53). */
static uint16_t int_to_narrow(int64_t v, const struct narrow_fmt *f) {
    if (v == 0) return 0;
    uint32_t sign = v < 0 ? 0x8000u : 0;
    uint64_t m = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v; /* INT64_MIN: 2^63 */
    return round_to_narrow(sign, m, 0, f);
}

/* ---- saturating conversions to integers ---- */

/* Comparisons are done in double first, so the cast only ever sees in-range values: casting an
 * out-of-range or NaN float to an integer is undefined behaviour in C. */
static inline int32_t sat_i32_from_f64(double v) {
    if (v != v) return 0;
    if (v >= 2147483648.0) return INT32_MAX;
    if (v <= -2147483649.0) return INT32_MIN;
    return (int32_t)v;
}

static inline int64_t sat_i64_from_f64(double v) {
    if (v != v) return 0;
    if (v >= 9223372036854775808.0) return INT64_MAX;
    if (v < -9223372036854775808.0) return INT64_MIN;
    return (int64_t)v;
}

static inline uint8_t sat_u8_from_f64(double v) {
    if (!(v > -1.0)) return 0; /* NaN too; (-1, 0) truncates to 0 below */
    if (v >= 256.0) return 255;
    return (uint8_t)v;
}

static inline int32_t sat_i32_from_i64(int64_t v) {
    return v > INT32_MAX ? INT32_MAX : v < INT32_MIN ? INT32_MIN : (int32_t)v;
}

static inline uint8_t sat_u8_from_i64(int64_t v) {
    return v > 255 ? 255 : v < 0 ? 0 : (uint8_t)v;
}

/* ---- fsdp_dtype_convert ---- */

/* The generic path moves this many elements through a staging buffer at a time. Reading a
 * whole chunk before writing any of it is what makes dst == src safe for equal sizes. */
#define CHUNK 256

/* Loads a chunk of a float type as double (exact for every float type). */
static void load_f64(double *v, const void *src, fsdp_dtype_t st, size_t i0, size_t n) {
    switch (st) {
    case FSDP_DTYPE_F32: {
        const float *p = (const float *)src + i0;
        for (size_t i = 0; i < n; i++)
            v[i] = p[i];
        break;
    }
    case FSDP_DTYPE_F64: {
        const double *p = (const double *)src + i0;
        for (size_t i = 0; i < n; i++)
            v[i] = p[i];
        break;
    }
    case FSDP_DTYPE_F16: {
        const uint16_t *p = (const uint16_t *)src + i0;
        for (size_t i = 0; i < n; i++)
            v[i] = f16_to_f32_inline(p[i]);
        break;
    }
    case FSDP_DTYPE_BF16: {
        const uint16_t *p = (const uint16_t *)src + i0;
        for (size_t i = 0; i < n; i++)
            v[i] = bf16_to_f32_inline(p[i]);
        break;
    }
    default:
        break;
    }
}

/* Loads a chunk of an integer type (bool: any nonzero byte reads as 1). */
static void load_i64(int64_t *v, const void *src, fsdp_dtype_t st, size_t i0, size_t n) {
    switch (st) {
    case FSDP_DTYPE_I32: {
        const int32_t *p = (const int32_t *)src + i0;
        for (size_t i = 0; i < n; i++)
            v[i] = p[i];
        break;
    }
    case FSDP_DTYPE_I64: {
        const int64_t *p = (const int64_t *)src + i0;
        for (size_t i = 0; i < n; i++)
            v[i] = p[i];
        break;
    }
    case FSDP_DTYPE_U8: {
        const uint8_t *p = (const uint8_t *)src + i0;
        for (size_t i = 0; i < n; i++)
            v[i] = p[i];
        break;
    }
    case FSDP_DTYPE_BOOL: {
        const uint8_t *p = (const uint8_t *)src + i0;
        for (size_t i = 0; i < n; i++)
            v[i] = p[i] != 0;
        break;
    }
    default:
        break;
    }
}

static void store_from_f64(void *dst, fsdp_dtype_t dt, size_t i0, const double *v, size_t n) {
    switch (dt) {
    case FSDP_DTYPE_F32: {
        float *p = (float *)dst + i0;
        for (size_t i = 0; i < n; i++)
            p[i] = (float)v[i]; /* correctly rounded (Annex F) */
        break;
    }
    case FSDP_DTYPE_F64: {
        double *p = (double *)dst + i0;
        for (size_t i = 0; i < n; i++)
            p[i] = v[i];
        break;
    }
    case FSDP_DTYPE_F16: {
        uint16_t *p = (uint16_t *)dst + i0;
        for (size_t i = 0; i < n; i++)
            p[i] = f64_to_narrow(v[i], &fmt_f16);
        break;
    }
    case FSDP_DTYPE_BF16: {
        uint16_t *p = (uint16_t *)dst + i0;
        for (size_t i = 0; i < n; i++)
            p[i] = f64_to_narrow(v[i], &fmt_bf16);
        break;
    }
    case FSDP_DTYPE_I32: {
        int32_t *p = (int32_t *)dst + i0;
        for (size_t i = 0; i < n; i++)
            p[i] = sat_i32_from_f64(v[i]);
        break;
    }
    case FSDP_DTYPE_I64: {
        int64_t *p = (int64_t *)dst + i0;
        for (size_t i = 0; i < n; i++)
            p[i] = sat_i64_from_f64(v[i]);
        break;
    }
    case FSDP_DTYPE_U8: {
        uint8_t *p = (uint8_t *)dst + i0;
        for (size_t i = 0; i < n; i++)
            p[i] = sat_u8_from_f64(v[i]);
        break;
    }
    case FSDP_DTYPE_BOOL: {
        uint8_t *p = (uint8_t *)dst + i0;
        for (size_t i = 0; i < n; i++)
            p[i] = v[i] != 0.0; /* NaN != 0 is true: NaN -> 1 */
        break;
    }
    default:
        break;
    }
}

static void store_from_i64(void *dst, fsdp_dtype_t dt, size_t i0, const int64_t *v, size_t n) {
    switch (dt) {
    case FSDP_DTYPE_F32: {
        float *p = (float *)dst + i0;
        for (size_t i = 0; i < n; i++)
            p[i] = (float)v[i]; /* one correctly rounded step */
        break;
    }
    case FSDP_DTYPE_F64: {
        double *p = (double *)dst + i0;
        for (size_t i = 0; i < n; i++)
            p[i] = (double)v[i];
        break;
    }
    case FSDP_DTYPE_F16: {
        uint16_t *p = (uint16_t *)dst + i0;
        for (size_t i = 0; i < n; i++)
            p[i] = int_to_narrow(v[i], &fmt_f16);
        break;
    }
    case FSDP_DTYPE_BF16: {
        uint16_t *p = (uint16_t *)dst + i0;
        for (size_t i = 0; i < n; i++)
            p[i] = int_to_narrow(v[i], &fmt_bf16);
        break;
    }
    case FSDP_DTYPE_I32: {
        int32_t *p = (int32_t *)dst + i0;
        for (size_t i = 0; i < n; i++)
            p[i] = sat_i32_from_i64(v[i]);
        break;
    }
    case FSDP_DTYPE_I64: {
        int64_t *p = (int64_t *)dst + i0;
        for (size_t i = 0; i < n; i++)
            p[i] = v[i];
        break;
    }
    case FSDP_DTYPE_U8: {
        uint8_t *p = (uint8_t *)dst + i0;
        for (size_t i = 0; i < n; i++)
            p[i] = sat_u8_from_i64(v[i]);
        break;
    }
    case FSDP_DTYPE_BOOL: {
        uint8_t *p = (uint8_t *)dst + i0;
        for (size_t i = 0; i < n; i++)
            p[i] = v[i] != 0;
        break;
    }
    default:
        break;
    }
}

/*
 * The hot pairs (optimizer state and communication buffers). Each runs in blocks of VBLOCK
 * elements with a constant inner trip count, which is what lets GCC vectorize them even at -O2
 * (its cheap cost model refuses loops that would need a scalar epilogue); the element
 * functions are branch-free. The sizes of the two types differ, so dst and src never alias.
 */
#define VBLOCK 16

static void f32_to_bf16_loop(uint16_t *restrict d, const float *restrict s, size_t n) {
    size_t i = 0;
    for (; i + VBLOCK <= n; i += VBLOCK)
        for (size_t j = 0; j < VBLOCK; j++)
            d[i + j] = bf16_from_bits32(f32_bits(s[i + j]));
    for (; i < n; i++)
        d[i] = bf16_from_bits32(f32_bits(s[i]));
}

static void bf16_to_f32_loop(float *restrict d, const uint16_t *restrict s, size_t n) {
    size_t i = 0;
    for (; i + VBLOCK <= n; i += VBLOCK)
        for (size_t j = 0; j < VBLOCK; j++)
            d[i + j] = bf16_to_f32_inline(s[i + j]);
    for (; i < n; i++)
        d[i] = bf16_to_f32_inline(s[i]);
}

static void f32_to_f16_loop(uint16_t *restrict d, const float *restrict s, size_t n) {
    size_t i = 0;
    for (; i + VBLOCK <= n; i += VBLOCK) {
        uint32_t any_sub = 0;
        for (size_t j = 0; j < VBLOCK; j++) {
            uint32_t x = f32_bits(s[i + j]);
            d[i + j] = f16_from_bits32_nosub(x);
            any_sub |= f16_subnormal_range(x);
        }
        /* Rare in most data (|x| < 2^-14), so fixing those elements up afterwards is cheaper
         * than giving up vectorization for every element. */
        if (any_sub) {
            for (size_t j = 0; j < VBLOCK; j++) {
                uint32_t x = f32_bits(s[i + j]);
                if (f16_subnormal_range(x)) d[i + j] = f16_from_bits32(x);
            }
        }
    }
    for (; i < n; i++)
        d[i] = f16_from_bits32(f32_bits(s[i]));
}

static void f16_to_f32_loop(float *restrict d, const uint16_t *restrict s, size_t n) {
    size_t i = 0;
    for (; i + VBLOCK <= n; i += VBLOCK)
        for (size_t j = 0; j < VBLOCK; j++)
            d[i + j] = f16_to_f32_inline(s[i + j]);
    for (; i < n; i++)
        d[i] = f16_to_f32_inline(s[i]);
}

static void f32_to_f64_loop(double *restrict d, const float *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++)
        d[i] = s[i];
}

static void f64_to_f32_loop(float *restrict d, const double *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++)
        d[i] = (float)s[i];
}

/* 1 when [a, a+na) and [b, b+nb) share a byte. Compared as integers: relational operators on
 * pointers into different objects are undefined. */
static int ranges_overlap(const void *a, size_t na, const void *b, size_t nb) {
    uintptr_t pa = (uintptr_t)a, pb = (uintptr_t)b;
    return pa < pb + nb && pb < pa + na;
}

int fsdp_dtype_convert(void *dst, fsdp_dtype_t dt, const void *src, fsdp_dtype_t st, size_t n) {
    if (!fsdp_dtype_valid((int)dt) || !fsdp_dtype_valid((int)st)) return FSDP_EINVAL;
    if (n == 0) return FSDP_OK;
    if (!dst || !src) return FSDP_EINVAL;
    size_t dsize = dtype_sizes[dt], ssize = dtype_sizes[st];
    if (n > SIZE_MAX / 8) return FSDP_EINVAL; /* n * size would not be a size */
    /* Partial overlap cannot be converted in place safely; the documented exception is the
     * same pointer with equal element sizes. Refusing is cheaper than a silent corruption. */
    if (ranges_overlap(dst, n * dsize, src, n * ssize) && !(dst == src && dsize == ssize))
        return FSDP_EINVAL;

    if (dt == st) {
        if (dst != src) memcpy(dst, src, n * dsize);
        return FSDP_OK;
    }
    if (st == FSDP_DTYPE_F32 && dt == FSDP_DTYPE_BF16) {
        f32_to_bf16_loop(dst, src, n);
        return FSDP_OK;
    }
    if (st == FSDP_DTYPE_BF16 && dt == FSDP_DTYPE_F32) {
        bf16_to_f32_loop(dst, src, n);
        return FSDP_OK;
    }
    if (st == FSDP_DTYPE_F32 && dt == FSDP_DTYPE_F16) {
        f32_to_f16_loop(dst, src, n);
        return FSDP_OK;
    }
    if (st == FSDP_DTYPE_F16 && dt == FSDP_DTYPE_F32) {
        f16_to_f32_loop(dst, src, n);
        return FSDP_OK;
    }
    if (st == FSDP_DTYPE_F32 && dt == FSDP_DTYPE_F64) {
        f32_to_f64_loop(dst, src, n);
        return FSDP_OK;
    }
    if (st == FSDP_DTYPE_F64 && dt == FSDP_DTYPE_F32) {
        f64_to_f32_loop(dst, src, n);
        return FSDP_OK;
    }

    /* Everything else goes through a staging chunk: floats as double, integers as int64_t. */
    if (fsdp_dtype_is_float(st)) {
        double v[CHUNK];
        for (size_t i0 = 0; i0 < n; i0 += CHUNK) {
            size_t m = n - i0 < CHUNK ? n - i0 : CHUNK;
            load_f64(v, src, st, i0, m);
            store_from_f64(dst, dt, i0, v, m);
        }
    } else {
        int64_t v[CHUNK];
        for (size_t i0 = 0; i0 < n; i0 += CHUNK) {
            size_t m = n - i0 < CHUNK ? n - i0 : CHUNK;
            load_i64(v, src, st, i0, m);
            store_from_i64(dst, dt, i0, v, m);
        }
    }
    return FSDP_OK;
}
