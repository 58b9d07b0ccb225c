/* SPDX-License-Identifier: MIT */
/*
 * t_dtype.c: tests of fsdp/dtype.h.
 *
 * Every reference here is computed a different way from the library, so that a shared mistake
 * is unlikely: 16-bit values are decoded with ldexp() from their fields; rounding to f16 is
 * checked against the compiler's _Float16 conversions (where the compiler has the type), bf16
 * against a comparison of the two neighbouring bf16 values, and both against a search for the
 * nearest 16-bit value in a table of exact values; the 64 fsdp_dtype_convert() pairs are
 * checked against long double arithmetic, which holds every source value exactly on x86-64.
 * Exhaustive sweeps report one TAP line per category with a mismatch count and print the first
 * mismatch.
 */
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <fsdp/dtype.h>
#include <fsdp/errno.h>

#include "tap.h"

#if defined(__FLT16_MAX__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_FLOAT16 1
#else
#define HAVE_FLOAT16 0
#endif

/* ---- small helpers ---- */

static uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Mismatch counter of one category: the count and a description of the first one. */
struct mism {
    long count;
    char first[300];
};

static void mism_add(struct mism *m, const char *fmt, ...) FSDP_PRINTF(2, 3);

static void mism_add(struct mism *m, const char *fmt, ...) {
    if (m->count++ == 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(m->first, sizeof m->first, fmt, ap);
        va_end(ap);
    }
}

static void mism_report(const struct mism *m, long checked, const char *what) {
    if (m->count) tap_diag("first mismatch: %s", m->first);
    tap_ok(m->count == 0, "%s: %ld checked, %ld mismatches", what, checked, m->count);
}

/* Same float, with -0 != +0; NaNs match any NaN of the same sign. */
static int same_float(double got, double want) {
    if (isnan(want)) return isnan(got) && !signbit(got) == !signbit(want);
    return got == want && !signbit(got) == !signbit(want);
}

/* ---- independent decoding of the 16-bit formats ---- */

/* A binary format with 16 bits: mantissa bits, exponent bias, and the Inf pattern. */
struct fmt16 {
    const char *name;
    int mbits;
    int bias;
    uint16_t inf;
};

static const struct fmt16 F16 = {"f16", 10, 15, 0x7c00};
static const struct fmt16 BF16 = {"bf16", 7, 127, 0x7f80};

/* Value of a 16-bit pattern from its fields, with ldexp (NaN: a NaN of the pattern's sign). */
static double ref16_value(uint16_t h, const struct fmt16 *f) {
    int sign = h >> 15;
    int e = (h >> f->mbits) & ((1 << (15 - f->mbits)) - 1);
    int m = h & ((1 << f->mbits) - 1);
    int emax = (1 << (15 - f->mbits)) - 1;
    double v;
    if (e == emax)
        v = m ? NAN : INFINITY;
    else if (e == 0)
        v = ldexp(m, 1 - f->bias - f->mbits);
    else
        v = ldexp((1 << f->mbits) + m, e - f->bias - f->mbits);
    return sign ? -v : v;
}

/* Exact values of the positive finite patterns 0 .. inf-1 of each format, and at index inf the
 * value the next pattern would have if the exponent did not run out (the overflow tie point
 * lies halfway to it). */
static long double tab_f16[0x7c01];
static long double tab_bf16[0x7f81];

static void build_tables(void) {
    for (int h = 0; h < 0x7c00; h++)
        tab_f16[h] = ref16_value((uint16_t)h, &F16);
    tab_f16[0x7c00] = 65536.0L;
    for (int h = 0; h < 0x7f80; h++)
        tab_bf16[h] = ref16_value((uint16_t)h, &BF16);
    tab_bf16[0x7f80] = ldexpl(1.0L, 128);
}

/*
 * Reference rounding of any real (held exactly in a long double) to a 16-bit format: find the
 * largest pattern not above |x| by binary search in the table, then pick the nearer of it and
 * its successor, the even one on a tie. The differences are exact (Sterbenz) except when one
 * side is far away, where rounding cannot flip the comparison.
 */
static uint16_t ref16_round(long double x, const struct fmt16 *f) {
    const long double *tab = f == &F16 ? tab_f16 : tab_bf16;
    uint16_t sign = signbit(x) ? 0x8000 : 0;
    if (isnan(x)) return (uint16_t)(sign | f->inf | (1u << (f->mbits - 1)));
    long double a = fabsl(x);
    if (a >= tab[f->inf]) return sign | f->inf;
    int lo = 0, hi = f->inf - 1; /* tab[lo] <= a always; find the largest such */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (tab[mid] <= a)
            lo = mid;
        else
            hi = mid - 1;
    }
    if (tab[lo] == a) return (uint16_t)(sign | lo);
    long double dlo = a - tab[lo], dhi = tab[lo + 1] - a;
    int r = dlo < dhi ? lo : dhi < dlo ? lo + 1 : (lo & 1 ? lo + 1 : lo);
    return (uint16_t)(sign | r); /* r == inf pattern is the overflow */
}

/* The reference for the big bf16 sweep, cheaper than the table search: truncating the f32
 * bits gives the pattern just below |x|, and the nearer of it and the next pattern wins (the
 * even one on a tie), compared with the exact table values. */
static uint16_t ref_bf16_trunc(float x) {
    uint32_t u = bits_of(x);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint16_t t = (uint16_t)((u & 0x7fffffffu) >> 16);
    long double a = fabsl((long double)x);
    if (t >= 0x7f80) return sign | 0x7f80; /* Inf */
    if (a == tab_bf16[t]) return sign | t;
    long double dlo = a - tab_bf16[t], dhi = tab_bf16[t + 1] - a;
    uint16_t r = dlo < dhi ? t : dhi < dlo ? (uint16_t)(t + 1) : (t & 1 ? (uint16_t)(t + 1) : t);
    return sign | r;
}

/* ---- names ---- */

static void test_names(void) {
    static const struct {
        fsdp_dtype_t dt;
        size_t size;
        const char *name;
        int is_float;
    } want[FSDP_DTYPE_COUNT] = {
        {FSDP_DTYPE_F32, 4, "f32", 1}, {FSDP_DTYPE_F64, 8, "f64", 1},
        {FSDP_DTYPE_F16, 2, "f16", 1}, {FSDP_DTYPE_BF16, 2, "bf16", 1},
        {FSDP_DTYPE_I32, 4, "i32", 0}, {FSDP_DTYPE_I64, 8, "i64", 0},
        {FSDP_DTYPE_U8, 1, "u8", 0},   {FSDP_DTYPE_BOOL, 1, "bool", 0},
    };
    for (int i = 0; i < FSDP_DTYPE_COUNT; i++) {
        fsdp_dtype_t dt = want[i].dt, back = FSDP_DTYPE_COUNT;
        int rc = fsdp_dtype_from_name(fsdp_dtype_name(dt), &back);
        tap_ok(fsdp_dtype_valid((int)dt) && fsdp_dtype_size(dt) == want[i].size &&
                   strcmp(fsdp_dtype_name(dt), want[i].name) == 0 &&
                   fsdp_dtype_is_float(dt) == want[i].is_float && rc == FSDP_OK && back == dt,
               "dtype %s: valid, size %zu, is_float %d, name round-trips", want[i].name,
               want[i].size, want[i].is_float);
    }

    tap_ok(!fsdp_dtype_valid(-1) && !fsdp_dtype_valid(FSDP_DTYPE_COUNT) && !fsdp_dtype_valid(1000),
           "fsdp_dtype_valid rejects -1, COUNT, 1000");
    tap_ok(fsdp_dtype_size((fsdp_dtype_t)-1) == 0 && fsdp_dtype_size(FSDP_DTYPE_COUNT) == 0 &&
               strcmp(fsdp_dtype_name(FSDP_DTYPE_COUNT), "invalid") == 0 &&
               strcmp(fsdp_dtype_name((fsdp_dtype_t)-1), "invalid") == 0 &&
               !fsdp_dtype_is_float(FSDP_DTYPE_COUNT),
           "invalid dtype: size 0, name \"invalid\", not float");

    static const struct {
        const char *name;
        fsdp_dtype_t dt;
    } aliases[] = {
        {"float32", FSDP_DTYPE_F32},   {"float", FSDP_DTYPE_F32},   {"float64", FSDP_DTYPE_F64},
        {"double", FSDP_DTYPE_F64},    {"float16", FSDP_DTYPE_F16}, {"half", FSDP_DTYPE_F16},
        {"bfloat16", FSDP_DTYPE_BF16}, {"int32", FSDP_DTYPE_I32},   {"int64", FSDP_DTYPE_I64},
        {"uint8", FSDP_DTYPE_U8},
    };
    struct mism m = {0};
    for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; i++) {
        fsdp_dtype_t dt = FSDP_DTYPE_COUNT;
        int rc = fsdp_dtype_from_name(aliases[i].name, &dt);
        if (rc != FSDP_OK || dt != aliases[i].dt)
            mism_add(&m, "\"%s\": rc %d dt %d", aliases[i].name, rc, (int)dt);
    }
    mism_report(&m, (long)(sizeof aliases / sizeof aliases[0]), "from_name aliases");

    fsdp_dtype_t untouched = FSDP_DTYPE_I64;
    tap_ok(fsdp_dtype_from_name("f31", &untouched) == FSDP_EINVAL &&
               fsdp_dtype_from_name("", &untouched) == FSDP_EINVAL &&
               fsdp_dtype_from_name("invalid", &untouched) == FSDP_EINVAL &&
               fsdp_dtype_from_name(NULL, &untouched) == FSDP_EINVAL &&
               fsdp_dtype_from_name("f32", NULL) == FSDP_EINVAL && untouched == FSDP_DTYPE_I64,
           "from_name: unknown names and NULLs give FSDP_EINVAL and leave *out alone");
}

/* ---- every 16-bit pattern: decode and round trip ---- */

static void test_all_patterns(const struct fmt16 *f) {
    int is_f16 = f == &F16;
    struct mism dec = {0}, trip = {0};
    for (uint32_t i = 0; i < 65536; i++) {
        uint16_t h = (uint16_t)i;
        float got = is_f16 ? fsdp_f16_to_f32(h) : fsdp_bf16_to_f32(h);
        double want = ref16_value(h, f);
        if (!same_float(got, want))
            mism_add(&dec, "0x%04x -> %a (0x%08x), want %a", h, (double)got, bits_of(got), want);
        uint16_t back = is_f16 ? fsdp_f32_to_f16(got) : fsdp_f32_to_bf16(got);
        /* Non-NaNs come back bit for bit; a NaN comes back as the same NaN made quiet. */
        uint16_t want_back = isnan(want) ? (uint16_t)(h | (1u << (f->mbits - 1))) : h;
        if (back != want_back)
            mism_add(&trip, "0x%04x -> 0x%08x -> 0x%04x, want 0x%04x", h, bits_of(got), back,
                     want_back);
    }
    char what[80];
    snprintf(what, sizeof what, "all %s patterns: to f32 matches the ldexp decoding", f->name);
    mism_report(&dec, 65536, what);
    snprintf(what, sizeof what, "all %s patterns: f32 -> %s round trip", f->name, f->name);
    mism_report(&trip, 65536, what);
}

#if HAVE_FLOAT16
static uint16_t f16_bits_of(_Float16 h) {
    uint16_t u;
    memcpy(&u, &h, sizeof u);
    return u;
}

static void test_f16_decode_vs_compiler(void) {
    struct mism m = {0};
    for (uint32_t i = 0; i < 65536; i++) {
        uint16_t h = (uint16_t)i;
        _Float16 hf;
        memcpy(&hf, &h, sizeof hf);
        float want = (float)hf;
        float got = fsdp_f16_to_f32(h);
        if (!same_float(got, want))
            mism_add(&m, "0x%04x -> 0x%08x, compiler 0x%08x", h, bits_of(got), bits_of(want));
    }
    mism_report(&m, 65536, "all f16 patterns: to f32 matches _Float16");
}
#endif

/* ---- rounding between every pair of adjacent finite values ---- */

static void test_adjacent_pairs(const struct fmt16 *f) {
    int is_f16 = f == &F16;
    uint16_t (*conv)(float) = is_f16 ? fsdp_f32_to_f16 : fsdp_f32_to_bf16;
    struct mism tie = {0}, below = {0}, above = {0};
    long n = 0;
    /* Up to the pair (largest finite, Inf), whose tie is the overflow boundary; tested below. */
    for (uint32_t h = 0; h + 1 < f->inf; h++) {
        for (int s = 0; s < 2; s++) {
            uint16_t sign = s ? 0x8000 : 0;
            double lo = fabs(ref16_value((uint16_t)h, f));
            double hi = fabs(ref16_value((uint16_t)(h + 1), f));
            double mid = (lo + hi) / 2;
            float midf = (float)mid;
            if ((double)midf != mid) {
                mism_add(&tie, "midpoint %a of 0x%04x not exact in f32", mid, h);
                continue;
            }
            if (s) midf = -midf;
            uint16_t even = (uint16_t)(sign | (h & 1 ? h + 1 : h));
            uint16_t got = conv(midf);
            if (got != even)
                mism_add(&tie, "%a (between 0x%04x and next) -> 0x%04x, want 0x%04x", (double)midf,
                         sign | h, got, even);
            float dn = nextafterf(midf, 0.0f), up = nextafterf(midf, s ? -INFINITY : INFINITY);
            got = conv(dn);
            if (got != (sign | h))
                mism_add(&below, "%a -> 0x%04x, want 0x%04x", (double)dn, got, sign | h);
            got = conv(up);
            if (got != (sign | (h + 1)))
                mism_add(&above, "%a -> 0x%04x, want 0x%04x", (double)up, got, sign | (h + 1));
            n++;
        }
    }
    char what[96];
    snprintf(what, sizeof what, "f32 -> %s: exact midpoints of adjacent values tie to even",
             f->name);
    mism_report(&tie, n, what);
    snprintf(what, sizeof what, "f32 -> %s: just below each midpoint rounds down", f->name);
    mism_report(&below, n, what);
    snprintf(what, sizeof what, "f32 -> %s: just above each midpoint rounds up", f->name);
    mism_report(&above, n, what);

    /* Overflow: the largest finite value plus half an ulp is a tie between an odd mantissa
     * and Inf, so it goes to Inf; the float just below it stays finite. */
    uint16_t maxh = (uint16_t)(f->inf - 1);
    double maxv = ref16_value(maxh, f);
    double half_ulp = (maxv - ref16_value((uint16_t)(maxh - 1), f)) / 2;
    float boundary = (float)(maxv + half_ulp);
    tap_ok((double)boundary == maxv + half_ulp && conv(boundary) == f->inf &&
               conv(-boundary) == (0x8000 | f->inf),
           "f32 -> %s: max finite + half ulp (%a) rounds to +-Inf", f->name, (double)boundary);
    tap_ok(conv(nextafterf(boundary, 0)) == maxh &&
               conv(-nextafterf(boundary, 0)) == (0x8000 | maxh),
           "f32 -> %s: just below max finite + half ulp stays +-max finite", f->name);
    tap_ok(conv(FLT_MAX) == f->inf && conv(-FLT_MAX) == (0x8000 | f->inf) &&
               conv(INFINITY) == f->inf && conv(-INFINITY) == (0x8000 | f->inf),
           "f32 -> %s: FLT_MAX and Inf give Inf with the sign", f->name);
}

/* Spot values, including the subnormal boundaries, written out by hand. */
static void test_spot_values(void) {
    static const struct {
        uint32_t f32;
        uint16_t f16, bf16;
        const char *what;
    } cases[] = {
        {0x00000000u, 0x0000, 0x0000, "+0"},
        {0x80000000u, 0x8000, 0x8000, "-0"},
        {0x3f800000u, 0x3c00, 0x3f80, "1"},
        {0xbf800000u, 0xbc00, 0xbf80, "-1"},
        {0x3eaaaaabu, 0x3555, 0x3eab, "1/3"},
        {0x477fe000u, 0x7bff, 0x4780, "65504 (f16 max)"},
        {0x477fefffu, 0x7bff, 0x4780, "just below 65520"},
        {0x477ff000u, 0x7c00, 0x4780, "65520 (f16 overflow tie)"},
        {0x7f7fffffu, 0x7c00, 0x7f80, "FLT_MAX"},
        {0x33800000u, 0x0001, 0x3380, "2^-24 (f16 smallest subnormal)"},
        {0x33000000u, 0x0000, 0x3300, "2^-25 (tie to zero)"},
        {0x33000001u, 0x0001, 0x3300, "just above 2^-25"},
        {0x32ffffffu, 0x0000, 0x3300, "just below 2^-25"},
        {0x33c00000u, 0x0002, 0x33c0, "1.5 * 2^-24 (tie to 2)"},
        {0x387fc000u, 0x03ff, 0x3880, "largest f16 subnormal"},
        {0x387fe000u, 0x0400, 0x3880, "largest subnormal + half ulp (tie to smallest normal)"},
        {0x387fdfffu, 0x03ff, 0x3880, "just below that tie"},
        {0x38800000u, 0x0400, 0x3880, "2^-14 (f16 smallest normal)"},
        {0x00000001u, 0x0000, 0x0000, "smallest f32 subnormal"},
        {0x80000001u, 0x8000, 0x8000, "negative smallest f32 subnormal"},
        {0x00010000u, 0x0000, 0x0001, "2^-133 (bf16 smallest subnormal)"},
        {0x00008000u, 0x0000, 0x0000, "2^-134 (bf16 tie to zero)"},
        {0x00018000u, 0x0000, 0x0002, "1.5 * 2^-133 (bf16 tie to 2)"},
        {0x007fffffu, 0x0000, 0x0080, "largest f32 subnormal"},
        {0x3f808000u, 0x3c04, 0x3f80, "1 + 2^-8 (bf16 tie, even down)"},
        {0x3f818000u, 0x3c0c, 0x3f82, "1 + 3 * 2^-8 (bf16 tie, even up)"},
        {0x7f800000u, 0x7c00, 0x7f80, "+Inf"},
        {0xff800000u, 0xfc00, 0xff80, "-Inf"},
        {0x7fc00000u, 0x7e00, 0x7fc0, "quiet NaN"},
        {0xffc00000u, 0xfe00, 0xffc0, "negative quiet NaN"},
        {0x7f800001u, 0x7e00, 0x7fc0, "signalling NaN, payload only in low bits"},
        {0x7f802000u, 0x7e01, 0x7fc0, "signalling NaN, payload bit 13"},
        {0xffbfffffu, 0xffff, 0xffff, "negative signalling NaN, full payload"},
        {0x7fc12345u, 0x7e09, 0x7fc1, "quiet NaN with payload"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        float x = float_of(cases[i].f32);
        uint16_t h = fsdp_f32_to_f16(x), b = fsdp_f32_to_bf16(x);
        char d[200];
        snprintf(d, sizeof d, "0x%08x -> f16 0x%04x (want 0x%04x), bf16 0x%04x (want 0x%04x)",
                 cases[i].f32, h, cases[i].f16, b, cases[i].bf16);
        if (h != cases[i].f16 || b != cases[i].bf16) tap_diag("%s", d);
        tap_ok(h == cases[i].f16 && b == cases[i].bf16, "f32 %s -> f16 0x%04x, bf16 0x%04x",
               cases[i].what, cases[i].f16, cases[i].bf16);
    }
}

/* ---- sweeps over f32 bit patterns ---- */

/* The k-th sample of the sweep: every value of the top 24 bits once, with a low byte that
 * walks through all 256 values, so the bits that decide rounding vary too. */
static uint32_t sweep_bits(uint32_t k) {
    return (k << 8) | ((k * 167u + 13u) & 0xffu);
}

#define SWEEP_N (UINT32_C(1) << 24)

static void test_sweeps(void) {
#if HAVE_FLOAT16
    {
        struct mism m = {0};
        long n = 0;
        for (uint32_t k = 0; k < SWEEP_N; k++) {
            float x = float_of(sweep_bits(k));
            if (isnan(x)) continue; /* NaNs: see test_nan_sweep() */
            /* Every sample whose exponent is near the f16 range (2^-27 .. 2^18), one in 16
             * elsewhere: out there the answer is 0 or Inf, and the compiler's conversion is
             * slow (it raises underflow/overflow in software). */
            uint32_t e = (sweep_bits(k) >> 23) & 0xffu;
            if ((e < 100 || e > 145) && k % 16 != 0) continue;
            uint16_t want = f16_bits_of((_Float16)x);
            uint16_t got = fsdp_f32_to_f16(x);
            n++;
            if (got != want)
                mism_add(&m, "0x%08x (%a) -> 0x%04x, _Float16 gives 0x%04x", bits_of(x), (double)x,
                         got, want);
        }
        mism_report(&m, n, "f32 -> f16 matches _Float16 over a sweep of f32 patterns");
    }
#else
    tap_skip(1, "the compiler has no _Float16");
#endif
    {
        struct mism m = {0};
        long n = 0;
        for (uint32_t k = 0; k < SWEEP_N; k += 61) {
            float x = float_of(sweep_bits(k));
            if (isnan(x)) continue;
            uint16_t want = ref16_round(x, &F16);
            uint16_t got = fsdp_f32_to_f16(x);
            n++;
            if (got != want)
                mism_add(&m, "0x%08x (%a) -> 0x%04x, nearest-value search gives 0x%04x", bits_of(x),
                         (double)x, got, want);
        }
        mism_report(&m, n, "f32 -> f16 matches the nearest-value search (sampled)");
    }
    {
        struct mism m = {0}, m2 = {0};
        long n = 0, n2 = 0;
        for (uint32_t k = 0; k < SWEEP_N; k++) {
            float x = float_of(sweep_bits(k));
            if (isnan(x)) continue;
            uint16_t got = fsdp_f32_to_bf16(x);
            uint16_t want = ref_bf16_trunc(x);
            n++;
            if (got != want)
                mism_add(&m, "0x%08x (%a) -> 0x%04x, want 0x%04x", bits_of(x), (double)x, got,
                         want);
            if (k % 61 == 0) {
                uint16_t want2 = ref16_round(x, &BF16);
                n2++;
                if (got != want2)
                    mism_add(&m2, "0x%08x (%a) -> 0x%04x, want 0x%04x", bits_of(x), (double)x, got,
                             want2);
            }
        }
        mism_report(&m, n, "f32 -> bf16 matches the neighbour comparison over the sweep");
        mism_report(&m2, n2, "f32 -> bf16 matches the nearest-value search (sampled)");
    }
}

/*
 * fsdp_dtype_convert() has its own vectorizable loops for the f32 <-> f16/bf16 pairs; they must
 * agree bit for bit with the scalar functions checked above, NaNs included, also when a block
 * mixes f16-subnormal-range values with others.
 */
static void test_convert_matches_scalar(void) {
    enum { BATCH = 4099 }; /* not a multiple of the library's block size: exercises the tail */
    static float f[BATCH];
    static uint16_t h[BATCH], b[BATCH];
    struct mism mh = {0}, mb = {0};
    long n = 0;
    uint64_t seed = 99;
    /* A quarter of the sweep, then random patterns with exponents around the f16 range, which
     * mix subnormal-range and other values within a block. */
    for (uint32_t k0 = 0; k0 < SWEEP_N / 4 + (UINT32_C(1) << 20); k0 += BATCH) {
        for (uint32_t j = 0; j < BATCH; j++) {
            uint32_t k = k0 + j;
            if (k < SWEEP_N / 4) {
                f[j] = float_of(sweep_bits(4 * k + 1));
            } else {
                seed = seed * 6364136223846793005u + 1442695040888963407u;
                uint32_t r = (uint32_t)(seed >> 32);
                uint32_t e = 98 + (r >> 24) % 50; /* 2^-29 .. 2^19 */
                f[j] = float_of((r & 0x807fffffu) | (e << 23));
            }
        }
        fsdp_dtype_convert(h, FSDP_DTYPE_F16, f, FSDP_DTYPE_F32, BATCH);
        fsdp_dtype_convert(b, FSDP_DTYPE_BF16, f, FSDP_DTYPE_F32, BATCH);
        for (uint32_t j = 0; j < BATCH; j++) {
            uint16_t wh = fsdp_f32_to_f16(f[j]), wb = fsdp_f32_to_bf16(f[j]);
            if (h[j] != wh)
                mism_add(&mh, "0x%08x: convert 0x%04x, scalar 0x%04x", bits_of(f[j]), h[j], wh);
            if (b[j] != wb)
                mism_add(&mb, "0x%08x: convert 0x%04x, scalar 0x%04x", bits_of(f[j]), b[j], wb);
        }
        n += BATCH;
    }
    mism_report(&mh, n, "convert f32 -> f16 equals fsdp_f32_to_f16 bit for bit");
    mism_report(&mb, n, "convert f32 -> bf16 equals fsdp_f32_to_bf16 bit for bit");

    static uint16_t all[65536];
    static float out16[65536], outb[65536];
    for (uint32_t i = 0; i < 65536; i++)
        all[i] = (uint16_t)i;
    fsdp_dtype_convert(out16, FSDP_DTYPE_F32, all, FSDP_DTYPE_F16, 65536);
    fsdp_dtype_convert(outb, FSDP_DTYPE_F32, all, FSDP_DTYPE_BF16, 65536);
    struct mism m16 = {0}, m2 = {0};
    for (uint32_t i = 0; i < 65536; i++) {
        if (bits_of(out16[i]) != bits_of(fsdp_f16_to_f32((uint16_t)i)))
            mism_add(&m16, "0x%04x: convert 0x%08x", i, bits_of(out16[i]));
        if (bits_of(outb[i]) != bits_of(fsdp_bf16_to_f32((uint16_t)i)))
            mism_add(&m2, "0x%04x: convert 0x%08x", i, bits_of(outb[i]));
    }
    mism_report(&m16, 65536, "convert f16 -> f32 equals fsdp_f16_to_f32 for all patterns");
    mism_report(&m2, 65536, "convert bf16 -> f32 equals fsdp_bf16_to_f32 for all patterns");
}

/* NaN payloads: the result is a quiet NaN of the same sign carrying the top payload bits. */
static void test_nan_sweep(void) {
    struct mism mh = {0}, mb = {0};
    long n = 0;
    for (uint32_t payload = 1; payload < (UINT32_C(1) << 23); payload += 997) {
        for (int s = 0; s < 2; s++) {
            uint32_t u = (s ? 0xff800000u : 0x7f800000u) | payload;
            float x = float_of(u);
            uint16_t h = fsdp_f32_to_f16(x), b = fsdp_f32_to_bf16(x);
            uint16_t sign = s ? 0x8000 : 0;
            /* f16: quiet bit 9, then the 9 payload bits right below the f32 quiet bit. */
            uint16_t want_h = (uint16_t)(sign | 0x7e00u | ((payload >> 13) & 0x1ffu));
            uint16_t want_b = (uint16_t)(sign | 0x7fc0u | ((payload >> 16) & 0x3fu));
            n++;
            if (h != want_h || !isnan(fsdp_f16_to_f32(h)))
                mism_add(&mh, "0x%08x -> 0x%04x, want 0x%04x", u, h, want_h);
            if (b != want_b || !isnan(fsdp_bf16_to_f32(b)))
                mism_add(&mb, "0x%08x -> 0x%04x, want 0x%04x", u, b, want_b);
        }
    }
    mism_report(&mh, n, "f32 NaN -> f16: quiet NaN, same sign, top payload bits kept");
    mism_report(&mb, n, "f32 NaN -> bf16: quiet NaN, same sign, top payload bits kept");
}

/* ---- fsdp_dtype_convert ---- */

/* Source values of each type, chosen around rounding ties, saturation limits and specials. */
static const float src_f32[] = {
    0.0f,       -0.0f,      1.0f,          -1.0f,         2.5f,           -2.5f,
    3.7f,       -3.7f,      0.5f,          -0.5f,         -0.99f,         127.5f,
    255.9f,     256.0f,     300.5f,        65504.0f,      65520.0f,       1e10f,
    -1e10f,     3e9f,       2147483520.0f, 2147483648.0f, -2147483648.0f, -2147483904.0f,
    9.2e18f,    9.3e18f,    -9.3e18f,      FLT_MAX,       -FLT_MAX,       INFINITY,
    -INFINITY,  NAN,        -NAN,          1e-30f,        0x1p-24f,       0x1p-25f,
    0x1.002p0f, 0x1.006p0f, 0x1.01p0f,     FLT_TRUE_MIN,  1.0f / 3.0f,
};

static const double src_f64[] = {
    0.0,
    -0.0,
    1.0,
    -1.0,
    3.7,
    -3.7,
    -0.999,
    255.99,
    256.0,
    1e300,
    -1e300,
    DBL_MAX,
    DBL_TRUE_MIN,
    INFINITY,
    -INFINITY,
    NAN,
    -NAN,
    2147483647.9,
    2147483648.0,
    -2147483648.9,
    -2147483649.0,
    9223372036854775807.0,
    -9223372036854775808.0,
    -9223372036854777856.0,
    65519.99,
    65520.0,
    1.0 + 0x1p-11 + 0x1p-40, /* just above an f16 tie: rounding via f32 would give 1.0 */
    1.0 + 0x1p-8 + 0x1p-30,  /* same for bf16 */
    1.0 + 0x1p-24 + 0x1p-60, /* same for f32 */
    0x1p-25 + 0x1p-60,       /* just above the f16 zero/subnormal tie */
    0x1p-150,                /* f32 tie to zero */
    3.4028235677973366e38,   /* just above the f32 overflow tie */
    1.0 / 3.0,
};

static const uint16_t src_f16[] = {
    0x0000, 0x8000, 0x3c00, 0xbc00, 0x3555, 0x4170, 0xc170, 0x5bf8, 0x5c00, 0x5c02, 0x7bff,
    0xfbff, 0x0001, 0x8001, 0x03ff, 0x0400, 0x7c00, 0xfc00, 0x7e00, 0xfe00, 0x7c01, 0x3bff,
};

static const uint16_t src_bf16[] = {
    0x0000, 0x8000, 0x3f80, 0xbf80, 0x3eab, 0x4070, 0xc070, 0x437f, 0x4380, 0x4396, 0x4f00,
    0xcf00, 0x4f01, 0xcf01, 0x5f00, 0xdf00, 0x5f01, 0x7f7f, 0xff7f, 0x7f80, 0xff80, 0x7fc0,
    0xffc0, 0x7f81, 0x0001, 0x8001, 0x007f, 0x0080, 0x477f, 0x4780, 0x3f7f,
};

static const int32_t src_i32[] = {
    0,     1,        -1,        2,         127,       128,       255,           256,
    -256,  257,      259,       2049,      2051,      65504,     65519,         65520,
    65536, 16777217, -16777219, 123456789, INT32_MAX, INT32_MIN, INT32_MIN + 1,
};

static const int64_t src_i64[] = {
    0,
    1,
    -1,
    255,
    256,
    300,
    -300,
    2049,
    65520,
    INT64_C(2147483647),
    INT64_C(2147483648),
    INT64_C(-2147483649),
    (INT64_C(1) << 53) + 1,
    (INT64_C(1) << 54) + (INT64_C(1) << 30) + 1,
    (INT64_C(1) << 62) + (INT64_C(1) << 54) + 1,
    -((INT64_C(1) << 62) + (INT64_C(1) << 54) + 1),
    (INT64_C(1) << 62) + (INT64_C(1) << 54),
    INT64_MAX,
    INT64_MIN,
    INT64_MIN + 1,
};

static const uint8_t src_u8[] = {0, 1, 2, 127, 128, 200, 254, 255};
static const uint8_t src_bool[] = {0, 1, 1, 0};

#define NELEM(a) (sizeof(a) / sizeof((a)[0]))

static const void *src_values(fsdp_dtype_t t, size_t *n) {
    switch (t) {
    case FSDP_DTYPE_F32:
        *n = NELEM(src_f32);
        return src_f32;
    case FSDP_DTYPE_F64:
        *n = NELEM(src_f64);
        return src_f64;
    case FSDP_DTYPE_F16:
        *n = NELEM(src_f16);
        return src_f16;
    case FSDP_DTYPE_BF16:
        *n = NELEM(src_bf16);
        return src_bf16;
    case FSDP_DTYPE_I32:
        *n = NELEM(src_i32);
        return src_i32;
    case FSDP_DTYPE_I64:
        *n = NELEM(src_i64);
        return src_i64;
    case FSDP_DTYPE_U8:
        *n = NELEM(src_u8);
        return src_u8;
    case FSDP_DTYPE_BOOL:
        *n = NELEM(src_bool);
        return src_bool;
    default:
        *n = 0;
        return NULL;
    }
}

/* Exact value of element i of a buffer of type t, as a long double (NaNs keep their sign). */
static long double exact_value(const void *buf, fsdp_dtype_t t, size_t i) {
    switch (t) {
    case FSDP_DTYPE_F32:
        return ((const float *)buf)[i];
    case FSDP_DTYPE_F64:
        return ((const double *)buf)[i];
    case FSDP_DTYPE_F16:
        return ref16_value(((const uint16_t *)buf)[i], &F16);
    case FSDP_DTYPE_BF16:
        return ref16_value(((const uint16_t *)buf)[i], &BF16);
    case FSDP_DTYPE_I32:
        return ((const int32_t *)buf)[i];
    case FSDP_DTYPE_I64:
        return ((const int64_t *)buf)[i];
    case FSDP_DTYPE_U8:
        return ((const uint8_t *)buf)[i];
    case FSDP_DTYPE_BOOL:
        return ((const uint8_t *)buf)[i] != 0;
    default:
        return 0;
    }
}

/* Checks element i of dst (type dt) against the exact value x per the header's rules; returns
 * 1 when it matches, else describes the difference in `why`. Integer destinations saturate
 * from integers as well as from floats. */
static int check_elem(const void *dst, fsdp_dtype_t dt, size_t i, long double x, char *why,
                      size_t whylen) {
    switch (dt) {
    case FSDP_DTYPE_F32: {
        float got = ((const float *)dst)[i], want = (float)x;
        snprintf(why, whylen, "got %a, want %a", (double)got, (double)want);
        return same_float(got, want);
    }
    case FSDP_DTYPE_F64: {
        double got = ((const double *)dst)[i], want = (double)x;
        snprintf(why, whylen, "got %a, want %a", got, want);
        return same_float(got, want);
    }
    case FSDP_DTYPE_F16:
    case FSDP_DTYPE_BF16: {
        const struct fmt16 *f = dt == FSDP_DTYPE_F16 ? &F16 : &BF16;
        uint16_t got = ((const uint16_t *)dst)[i], want = ref16_round(x, f);
        snprintf(why, whylen, "got 0x%04x, want 0x%04x", got, want);
        if (isnan(x)) return same_float(ref16_value(got, f), (double)x);
        return got == want;
    }
    case FSDP_DTYPE_I32: {
        int32_t got = ((const int32_t *)dst)[i];
        int32_t want = isnan(x)              ? 0
                       : x >= 2147483648.0L  ? INT32_MAX
                       : x <= -2147483649.0L ? INT32_MIN
                                             : (int32_t)x;
        snprintf(why, whylen, "got %" PRId32 ", want %" PRId32, got, want);
        return got == want;
    }
    case FSDP_DTYPE_I64: {
        int64_t got = ((const int64_t *)dst)[i];
        int64_t want = isnan(x)                       ? 0
                       : x >= 9223372036854775808.0L  ? INT64_MAX
                       : x <= -9223372036854775809.0L ? INT64_MIN
                                                      : (int64_t)x;
        snprintf(why, whylen, "got %" PRId64 ", want %" PRId64, got, want);
        return got == want;
    }
    case FSDP_DTYPE_U8: {
        unsigned got = ((const uint8_t *)dst)[i];
        unsigned want = !(x > -1.0L) ? 0 : x >= 256.0L ? 255 : (unsigned)(uint8_t)x;
        snprintf(why, whylen, "got %u, want %u", got, want);
        return got == want;
    }
    case FSDP_DTYPE_BOOL: {
        unsigned got = ((const uint8_t *)dst)[i];
        unsigned want = x != 0.0L; /* NaN included */
        snprintf(why, whylen, "got %u, want %u", got, want);
        return got == want;
    }
    default:
        return 0;
    }
}

static void test_convert_pairs(void) {
#if LDBL_MANT_DIG < 64
    tap_skip(FSDP_DTYPE_COUNT * FSDP_DTYPE_COUNT, "long double cannot hold every source value");
    return;
#endif
    for (int st = 0; st < FSDP_DTYPE_COUNT; st++) {
        for (int dt = 0; dt < FSDP_DTYPE_COUNT; dt++) {
            size_t n;
            const void *src = src_values((fsdp_dtype_t)st, &n);
            _Alignas(16) unsigned char dst[64 * 8]; /* holds any element type */
            memset(dst, 0xa5, sizeof dst);
            int rc = fsdp_dtype_convert(dst, (fsdp_dtype_t)dt, src, (fsdp_dtype_t)st, n);
            struct mism m = {0};
            if (rc != FSDP_OK) mism_add(&m, "rc %d", rc);
            for (size_t i = 0; rc == FSDP_OK && i < n; i++) {
                long double x = exact_value(src, (fsdp_dtype_t)st, i);
                char why[120];
                if (!check_elem(dst, (fsdp_dtype_t)dt, i, x, why, sizeof why))
                    mism_add(&m, "element %zu (%La): %s", i, x, why);
            }
            /* Nothing written past the n elements. */
            size_t end = n * fsdp_dtype_size((fsdp_dtype_t)dt);
            for (size_t b = end; b < end + 16; b++)
                if (dst[b] != 0xa5) mism_add(&m, "byte %zu past the end was written", b);
            char what[64];
            snprintf(what, sizeof what, "convert %s -> %s", fsdp_dtype_name((fsdp_dtype_t)st),
                     fsdp_dtype_name((fsdp_dtype_t)dt));
            mism_report(&m, (long)n, what);
        }
    }
}

/* The header's rules on a few values, written out rather than computed. */
static void test_convert_rules(void) {
    float f[] = {3.7f, -3.7f, 1e10f, -1e10f, NAN, -0.0f, 300.5f, -0.5f, -NAN};
    int32_t i32[9];
    int64_t i64[9];
    uint8_t u8[9], bl[9];
    fsdp_dtype_convert(i32, FSDP_DTYPE_I32, f, FSDP_DTYPE_F32, 9);
    fsdp_dtype_convert(i64, FSDP_DTYPE_I64, f, FSDP_DTYPE_F32, 9);
    fsdp_dtype_convert(u8, FSDP_DTYPE_U8, f, FSDP_DTYPE_F32, 9);
    fsdp_dtype_convert(bl, FSDP_DTYPE_BOOL, f, FSDP_DTYPE_F32, 9);
    tap_ok(i32[0] == 3 && i32[1] == -3 && i64[0] == 3 && i64[1] == -3 && u8[0] == 3 && u8[1] == 0,
           "float -> int truncates toward zero");
    tap_ok(i32[2] == INT32_MAX && i32[3] == INT32_MIN && i64[2] == 10000000000 &&
               i64[3] == -10000000000 && u8[2] == 255 && u8[3] == 0 && u8[6] == 255 && u8[7] == 0,
           "float -> int saturates");
    tap_ok(i32[4] == 0 && i64[4] == 0 && u8[4] == 0 && i32[8] == 0 && i64[8] == 0 && u8[8] == 0,
           "float NaN -> int gives 0");
    tap_ok(bl[0] == 1 && bl[1] == 1 && bl[2] == 1 && bl[4] == 1 && bl[8] == 1 && bl[5] == 0 &&
               bl[7] == 1,
           "float -> bool: nonzero and NaN give 1, -0 gives 0");

    /* One rounding from f64: rounding through f32 first would land on the tie and go even. */
    double d[] = {1.0 + 0x1p-11 + 0x1p-40, 1.0 + 0x1p-8 + 0x1p-30, 65519.99, 65520.0, NAN, -NAN};
    uint16_t h[6], b[6];
    fsdp_dtype_convert(h, FSDP_DTYPE_F16, d, FSDP_DTYPE_F64, 6);
    fsdp_dtype_convert(b, FSDP_DTYPE_BF16, d, FSDP_DTYPE_F64, 6);
    tap_is_uint(h[0], 0x3c01, "f64 1 + 2^-11 + 2^-40 -> f16 rounds once, up");
    tap_is_uint(b[1], 0x3f81, "f64 1 + 2^-8 + 2^-30 -> bf16 rounds once, up");
    tap_ok(h[2] == 0x7bff && h[3] == 0x7c00, "f64 -> f16 overflow boundary at 65520");
    tap_ok(h[4] == 0x7e00 && h[5] == 0xfe00 && b[4] == 0x7fc0 && b[5] == 0xffc0,
           "f64 NaN -> f16/bf16 quiet NaN of the same sign");

    int64_t big[] = {(INT64_C(1) << 62) + (INT64_C(1) << 54) + 1, INT64_MIN, INT64_MAX,
                     (INT64_C(1) << 54) + (INT64_C(1) << 30) + 1};
    uint16_t bb[4], hh[4];
    float ff[4];
    fsdp_dtype_convert(bb, FSDP_DTYPE_BF16, big, FSDP_DTYPE_I64, 4);
    fsdp_dtype_convert(hh, FSDP_DTYPE_F16, big, FSDP_DTYPE_I64, 4);
    fsdp_dtype_convert(ff, FSDP_DTYPE_F32, big, FSDP_DTYPE_I64, 4);
    tap_ok(bb[0] == 0x5e81 && bb[1] == 0xdf00 && bb[2] == 0x5f00,
           "i64 -> bf16 rounds once (2^62 + 2^54 + 1 -> 0x5e81)");
    tap_ok(hh[0] == 0x7c00 && hh[1] == 0xfc00 && hh[2] == 0x7c00, "i64 -> f16 overflows to Inf");
    tap_is_uint(bits_of(ff[3]), bits_of(0x1.000002p54f), "i64 2^54 + 2^30 + 1 -> f32 rounds up");

    int64_t wide[] = {3000000000, -3000000000, 300, -5};
    int32_t n32[4];
    uint8_t n8[4];
    fsdp_dtype_convert(n32, FSDP_DTYPE_I32, wide, FSDP_DTYPE_I64, 4);
    fsdp_dtype_convert(n8, FSDP_DTYPE_U8, wide, FSDP_DTYPE_I64, 4);
    tap_ok(n32[0] == INT32_MAX && n32[1] == INT32_MIN && n32[2] == 300 && n8[0] == 255 &&
               n8[1] == 0 && n8[2] == 255 && n8[3] == 0,
           "i64 -> narrower ints saturates");
}

/* A simple generator for bulk inputs (the test must not depend on fsdp_rng). */
static uint32_t lcg(uint64_t *s) {
    *s = *s * 6364136223846793005u + 1442695040888963407u;
    return (uint32_t)(*s >> 32);
}

#define BULK 1003 /* several staging chunks and a ragged tail */

static void test_convert_bulk(void) {
    static float f[BULK], f2[BULK];
    static double d[BULK];
    static uint16_t h[BULK];
    uint64_t seed = 12345;
    for (int i = 0; i < BULK; i++) {
        uint32_t u = lcg(&seed);
        /* Mostly values in f16 range, some anything at all (NaN and Inf included). */
        f[i] = i % 4 ? float_of((u & 0x8fffffffu) | 0x30000000u) : float_of(u);
    }
    struct mism m = {0};
    fsdp_dtype_convert(h, FSDP_DTYPE_F16, f, FSDP_DTYPE_F32, BULK);
    for (int i = 0; i < BULK; i++)
        if (h[i] != fsdp_f32_to_f16(f[i])) mism_add(&m, "element %d", i);
    mism_report(&m, BULK, "bulk f32 -> f16 equals the scalar function");
    memset(&m, 0, sizeof m);
    fsdp_dtype_convert(f2, FSDP_DTYPE_F32, h, FSDP_DTYPE_F16, BULK);
    for (int i = 0; i < BULK; i++)
        if (!same_float(f2[i], fsdp_f16_to_f32(h[i]))) mism_add(&m, "element %d", i);
    mism_report(&m, BULK, "bulk f16 -> f32 equals the scalar function");
    memset(&m, 0, sizeof m);
    fsdp_dtype_convert(h, FSDP_DTYPE_BF16, f, FSDP_DTYPE_F32, BULK);
    for (int i = 0; i < BULK; i++)
        if (h[i] != fsdp_f32_to_bf16(f[i])) mism_add(&m, "element %d", i);
    mism_report(&m, BULK, "bulk f32 -> bf16 equals the scalar function");
    memset(&m, 0, sizeof m);
    fsdp_dtype_convert(f2, FSDP_DTYPE_F32, h, FSDP_DTYPE_BF16, BULK);
    for (int i = 0; i < BULK; i++)
        if (!same_float(f2[i], fsdp_bf16_to_f32(h[i]))) mism_add(&m, "element %d", i);
    mism_report(&m, BULK, "bulk bf16 -> f32 equals the scalar function");
    memset(&m, 0, sizeof m);
    fsdp_dtype_convert(d, FSDP_DTYPE_F64, f, FSDP_DTYPE_F32, BULK);
    fsdp_dtype_convert(f2, FSDP_DTYPE_F32, d, FSDP_DTYPE_F64, BULK);
    for (int i = 0; i < BULK; i++)
        if (!same_float(d[i], f[i]) || !same_float(f2[i], f[i])) mism_add(&m, "element %d", i);
    mism_report(&m, BULK, "bulk f32 -> f64 -> f32 is exact");
    memset(&m, 0, sizeof m);
    fsdp_dtype_convert(f2, FSDP_DTYPE_F32, f, FSDP_DTYPE_F32, BULK);
    fsdp_dtype_convert(f2, FSDP_DTYPE_F32, f2, FSDP_DTYPE_F32, BULK);
    tap_is_mem(f2, f, sizeof f, "same-type convert copies, also in place");
}

/* dst == src is allowed when the element sizes agree; the result must equal out-of-place. */
static void test_convert_in_place(void) {
    static const fsdp_dtype_t pairs[][2] = {
        {FSDP_DTYPE_F32, FSDP_DTYPE_I32},  {FSDP_DTYPE_I32, FSDP_DTYPE_F32},
        {FSDP_DTYPE_F16, FSDP_DTYPE_BF16}, {FSDP_DTYPE_BF16, FSDP_DTYPE_F16},
        {FSDP_DTYPE_F64, FSDP_DTYPE_I64},  {FSDP_DTYPE_I64, FSDP_DTYPE_F64},
        {FSDP_DTYPE_U8, FSDP_DTYPE_BOOL},  {FSDP_DTYPE_BOOL, FSDP_DTYPE_U8},
    };
    for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++) {
        fsdp_dtype_t st = pairs[p][0], dt = pairs[p][1];
        size_t es = fsdp_dtype_size(st), nv;
        const unsigned char *vals = src_values(st, &nv);
        static _Alignas(16) unsigned char buf[BULK * 8], out[BULK * 8];
        for (size_t i = 0; i < BULK; i++)
            memcpy(buf + i * es, vals + (i % nv) * es, es);
        int rc1 = fsdp_dtype_convert(out, dt, buf, st, BULK);
        int rc2 = fsdp_dtype_convert(buf, dt, buf, st, BULK);
        tap_ok(rc1 == FSDP_OK && rc2 == FSDP_OK && memcmp(out, buf, BULK * es) == 0,
               "in-place %s -> %s (%d elements) equals out-of-place", fsdp_dtype_name(st),
               fsdp_dtype_name(dt), BULK);
    }
}

static void test_convert_invalid(void) {
    float f[4] = {1, 2, 3, 4};
    double d[4];
    tap_is_int(fsdp_dtype_convert(d, (fsdp_dtype_t)-1, f, FSDP_DTYPE_F32, 4), FSDP_EINVAL,
               "convert: dst dtype -1 -> FSDP_EINVAL");
    tap_is_int(fsdp_dtype_convert(d, FSDP_DTYPE_F64, f, FSDP_DTYPE_COUNT, 4), FSDP_EINVAL,
               "convert: src dtype COUNT -> FSDP_EINVAL");
    tap_is_int(fsdp_dtype_convert(d, (fsdp_dtype_t)99, f, FSDP_DTYPE_F32, 0), FSDP_EINVAL,
               "convert: invalid dtype with n = 0 -> FSDP_EINVAL");
    tap_is_int(fsdp_dtype_convert(NULL, FSDP_DTYPE_F64, f, FSDP_DTYPE_F32, 4), FSDP_EINVAL,
               "convert: NULL dst -> FSDP_EINVAL");
    tap_is_int(fsdp_dtype_convert(d, FSDP_DTYPE_F64, NULL, FSDP_DTYPE_F32, 4), FSDP_EINVAL,
               "convert: NULL src -> FSDP_EINVAL");
    tap_is_int(fsdp_dtype_convert(NULL, FSDP_DTYPE_F64, NULL, FSDP_DTYPE_F32, 0), FSDP_OK,
               "convert: NULL pointers with n = 0 -> FSDP_OK");
    /* Overlap other than the exact same pointer with equal sizes is refused. */
    tap_is_int(fsdp_dtype_convert(f + 1, FSDP_DTYPE_F32, f, FSDP_DTYPE_F32, 3), FSDP_EINVAL,
               "convert: partially overlapping same-type buffers -> FSDP_EINVAL");
    double dd[4] = {1, 2, 3, 4};
    tap_is_int(fsdp_dtype_convert(dd, FSDP_DTYPE_F32, dd, FSDP_DTYPE_F64, 4), FSDP_EINVAL,
               "convert: dst == src with different sizes -> FSDP_EINVAL");
}

int main(void) {
    tap_plan_lazy();
    build_tables();
    test_names();
    test_all_patterns(&F16);
    test_all_patterns(&BF16);
#if HAVE_FLOAT16
    test_f16_decode_vs_compiler();
#else
    tap_skip(1, "the compiler has no _Float16");
#endif
    test_adjacent_pairs(&F16);
    test_adjacent_pairs(&BF16);
    test_spot_values();
    test_sweeps();
    test_nan_sweep();
    test_convert_matches_scalar();
    test_convert_pairs();
    test_convert_rules();
    test_convert_bulk();
    test_convert_in_place();
    test_convert_invalid();
    return tap_done();
}
