/* SPDX-License-Identifier: MIT */
/*
 * coll_check.c: closed-form inputs and expected values for the collective suite, and the checker
 * that runs one collective on one rank and verifies every element (see coll_check.h).
 *
 * The checker precomputes one period of every pattern it needs (inputs of the ranks involved,
 * expected reductions, and their bitwise complements, used to pre-fill destinations so that an
 * element the collective forgot to write can never look right), then fills and compares
 * buffers with memcpy/memcmp runs. That keeps a 16 MiB check at memory speed whatever the dtype.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coll_check.h"

/* Bytes of guard before and after every buffer, and their value. */
#define GUARD 64
#define GUARD_BYTE 0xC3

/* ---------------------------------------------------------------------------------------- */
/* Closed forms */

/* A 64-bit hash of (rank, index, salt); a few integer operations. */
static uint64_t mix(int rank, size_t k, uint64_t salt) {
    uint64_t x = (uint64_t)k * UINT64_C(0x9E3779B97F4A7C15) +
                 (uint64_t)(unsigned)rank * UINT64_C(0xD1B54A32D192ED03) + salt;
    x ^= x >> 31;
    x *= UINT64_C(0xBF58476D1CE4E5B9);
    x ^= x >> 29;
    x *= UINT64_C(0x94D049BB133111EB);
    x ^= x >> 32;
    return x;
}

/* 1 when the values of (dt, op) are reasoned about as real numbers (a double), 0 when as bits
 * of an integer type (uint64_t, truncated to the type's width). */
static int real_valued(fsdp_dtype_t dt, fsdp_redop_t op) {
    return fsdp_dtype_is_float(dt) && op != COLL_CHECK_MOVE;
}

/* Small signed integer in [lo, lo + n) from a hash. */
static int64_t small(uint64_t h, int lo, unsigned n) {
    return (int64_t)lo + (int64_t)(h % n);
}

/* The real value of rank `rank` at period index k (real_valued() types). */
static double real_value(fsdp_redop_t op, int rank, size_t k) {
    static const double factors[7] = {1.0, -1.0, 2.0, 0.5, 1.5, -3.0, -0.5};
    uint64_t h = mix(rank, k, 0x5eed0000u + (uint64_t)op);
    switch (op) {
    case FSDP_REDOP_SUM:
    case FSDP_REDOP_AVG: {
        /* Quarter-integers in [-8, 8), and 2048 on rank 0 at every fifth index: exact in every
         * float type; 2048 plus the others' quarters is where f16/bf16 results round. */
        if (rank == 0 && k % 5 == 0) return 2048.0;
        return (double)small(h, -32, 64) / 4.0;
    }
    case FSDP_REDOP_MIN:
    case FSDP_REDOP_MAX:
        return (double)small(h, -120, 241) / 2.0;
    case FSDP_REDOP_PROD:
        /* At most 8 non-unit factors: |product| in [2^-8, 3^8], exact in f32. */
        if (rank >= 8) return (h & 1) ? 1.0 : -1.0;
        return factors[h % 7];
    default:
        return 0.0;
    }
}

/* The bits of rank `rank` at period index k (integer types, bool, and COLL_CHECK_MOVE). */
static uint64_t bits_value(fsdp_dtype_t dt, fsdp_redop_t op, int rank, size_t k) {
    uint64_t h = mix(rank, k, 0xb175000u + (uint64_t)op * 16u + (uint64_t)dt);
    if (op == COLL_CHECK_MOVE) {
        /* Any bit pattern but NaN and infinity: flip an exponent bit of those. */
        switch (dt) {
        case FSDP_DTYPE_F32:
            if ((h & 0x7F800000u) == 0x7F800000u) h ^= 0x40000000u;
            return h & 0xFFFFFFFFu;
        case FSDP_DTYPE_F64:
            if ((h & UINT64_C(0x7FF0000000000000)) == UINT64_C(0x7FF0000000000000))
                h ^= UINT64_C(0x4000000000000000);
            return h;
        case FSDP_DTYPE_F16:
            if ((h & 0x7C00u) == 0x7C00u) h ^= 0x4000u;
            return h & 0xFFFFu;
        case FSDP_DTYPE_BF16:
            if ((h & 0x7F80u) == 0x7F80u) h ^= 0x4000u;
            return h & 0xFFFFu;
        case FSDP_DTYPE_BOOL:
            return h & 1u;
        default:
            return h;
        }
    }
    switch (dt) {
    case FSDP_DTYPE_I32:
    case FSDP_DTYPE_I64: {
        int wide = dt == FSDP_DTYPE_I64;
        uint64_t full = wide ? h : (uint64_t)(int64_t)(int32_t)(uint32_t)h;
        uint64_t lo_ext = wide ? (uint64_t)INT64_MIN : (uint64_t)(int64_t)INT32_MIN;
        uint64_t hi_ext = wide ? (uint64_t)INT64_MAX : (uint64_t)(int64_t)INT32_MAX;
        switch (op) {
        case FSDP_REDOP_SUM:
        case FSDP_REDOP_AVG:
            /* Full-range values at every third index make the sums wrap around. */
            return k % 3 == 0 ? full : (uint64_t)small(h >> 8, -50, 101);
        case FSDP_REDOP_MIN:
        case FSDP_REDOP_MAX:
            if (k % 7 == 0) return rank % 2 ? lo_ext : hi_ext;
            if (k % 7 == 1) return (uint64_t)small(h >> 8, -50, 101);
            return full;
        case FSDP_REDOP_PROD:
            return k % 4 == 0 ? (full | 1u) : (uint64_t)small(h >> 8, -5, 11);
        default:
            return full;
        }
    }
    case FSDP_DTYPE_U8:
        return h & 0xFFu; /* every op: sums and products wrap, min and max are unsigned */
    case FSDP_DTYPE_BOOL: {
        /* One rank at most (rank % 11 == k % 11) differs from the others. */
        int odd_one = (size_t)(rank % 11) == k % 11;
        if (op == FSDP_REDOP_PROD || op == FSDP_REDOP_MIN) return odd_one ? 0u : 1u;
        return odd_one ? 1u : 0u;
    }
    default:
        return h;
    }
}

/* Stores a real value as one element of the float type dt. */
static void store_real(fsdp_dtype_t dt, double v, void *out) {
    float f = (float)v;
    uint16_t h;
    switch (dt) {
    case FSDP_DTYPE_F64:
        memcpy(out, &v, 8);
        break;
    case FSDP_DTYPE_F32:
        memcpy(out, &f, 4);
        break;
    case FSDP_DTYPE_F16:
        h = fsdp_f32_to_f16(f);
        memcpy(out, &h, 2);
        break;
    case FSDP_DTYPE_BF16:
        h = fsdp_f32_to_bf16(f);
        memcpy(out, &h, 2);
        break;
    default:
        break;
    }
}

/* Stores the low bits of u as one element of dt. */
static void store_bits(fsdp_dtype_t dt, uint64_t u, void *out) {
    uint32_t w32 = (uint32_t)u;
    uint16_t w16 = (uint16_t)u;
    uint8_t w8 = (uint8_t)u;
    switch (fsdp_dtype_size(dt)) {
    case 8:
        memcpy(out, &u, 8);
        break;
    case 4:
        memcpy(out, &w32, 4);
        break;
    case 2:
        memcpy(out, &w16, 2);
        break;
    case 1:
        memcpy(out, &w8, 1);
        break;
    default:
        break;
    }
}

void coll_check_value(fsdp_dtype_t dt, int rank, size_t index, fsdp_redop_t op, void *out) {
    size_t k = index % COLL_CHECK_PERIOD;
    if (real_valued(dt, op))
        store_real(dt, real_value(op, rank, k), out);
    else
        store_bits(dt, bits_value(dt, op, rank, k), out);
}

/* Two's complement reinterpretations (C's conversions to signed types are
 * implementation-defined for out-of-range values; memcpy is not). */
static int32_t as_i32(uint32_t u) {
    int32_t s;
    memcpy(&s, &u, sizeof s);
    return s;
}

static int64_t as_i64(uint64_t u) {
    int64_t s;
    memcpy(&s, &u, sizeof s);
    return s;
}

static void expected_real(fsdp_dtype_t dt, fsdp_redop_t op, int size, size_t k, void *out) {
    /* Exact in double (see coll_check.h), so the order of the ranks does not matter here. */
    double acc = real_value(op, 0, k);
    for (int q = 1; q < size; q++) {
        double v = real_value(op, q, k);
        switch (op) {
        case FSDP_REDOP_SUM:
        case FSDP_REDOP_AVG:
            acc += v;
            break;
        case FSDP_REDOP_PROD:
            acc *= v;
            break;
        case FSDP_REDOP_MIN:
            acc = v < acc ? v : acc;
            break;
        case FSDP_REDOP_MAX:
            acc = v > acc ? v : acc;
            break;
        default:
            break;
        }
    }
    if (dt == FSDP_DTYPE_F64) {
        if (op == FSDP_REDOP_AVG) acc /= (double)size;
        memcpy(out, &acc, 8);
        return;
    }
    /* f32, and the f32 accumulator of f16/bf16: the exact result, divided in f32 for avg, then
     * (16-bit types) rounded once. */
    float s = (float)acc;
    if (op == FSDP_REDOP_AVG) s = s / (float)size;
    store_real(dt, s, out); /* float -> double -> float is exact */
}

/* Signed value of the low `bits` bits of x (32 or 64). */
static int64_t as_signed(uint64_t x, int bits) {
    return bits == 32 ? (int64_t)as_i32((uint32_t)x) : as_i64(x);
}

/*
 * The rank-order reduction of a 32- or 64-bit integer element. Sums and products are computed
 * modulo 2^64 and truncated, which equals wrapping at 32 bits; min and max compare the values
 * as signed numbers of the element's width; avg divides the wrapped sum, truncating toward 0.
 */
static int64_t expected_int(fsdp_dtype_t dt, fsdp_redop_t op, int size, size_t k, int bits) {
    uint64_t acc = bits_value(dt, op, 0, k);
    for (int q = 1; q < size; q++) {
        uint64_t v = bits_value(dt, op, q, k);
        switch (op) {
        case FSDP_REDOP_SUM:
        case FSDP_REDOP_AVG:
            acc += v;
            break;
        case FSDP_REDOP_PROD:
            acc *= v;
            break;
        case FSDP_REDOP_MIN:
            acc = as_signed(v, bits) < as_signed(acc, bits) ? v : acc;
            break;
        case FSDP_REDOP_MAX:
            acc = as_signed(v, bits) > as_signed(acc, bits) ? v : acc;
            break;
        default:
            break;
        }
    }
    int64_t s = as_signed(acc, bits);
    return op == FSDP_REDOP_AVG ? s / size : s;
}

static void expected_bits(fsdp_dtype_t dt, fsdp_redop_t op, int size, size_t k, void *out) {
    if (dt == FSDP_DTYPE_I32) {
        int32_t s = (int32_t)expected_int(dt, op, size, k, 32);
        memcpy(out, &s, 4);
    } else if (dt == FSDP_DTYPE_I64) {
        int64_t s = expected_int(dt, op, size, k, 64);
        memcpy(out, &s, 8);
    } else if (dt == FSDP_DTYPE_U8) {
        unsigned acc = (unsigned)bits_value(dt, op, 0, k);
        for (int q = 1; q < size; q++) {
            unsigned v = (unsigned)bits_value(dt, op, q, k);
            switch (op) {
            case FSDP_REDOP_SUM:
            case FSDP_REDOP_AVG:
                acc = (acc + v) & 0xFFu;
                break;
            case FSDP_REDOP_PROD:
                acc = (acc * v) & 0xFFu;
                break;
            case FSDP_REDOP_MIN:
                acc = v < acc ? v : acc;
                break;
            case FSDP_REDOP_MAX:
                acc = v > acc ? v : acc;
                break;
            default:
                break;
            }
        }
        if (op == FSDP_REDOP_AVG) acc /= (unsigned)size;
        uint8_t b = (uint8_t)acc;
        memcpy(out, &b, 1);
    } else if (dt == FSDP_DTYPE_BOOL) {
        int and_op = op == FSDP_REDOP_PROD || op == FSDP_REDOP_MIN;
        unsigned acc = (unsigned)bits_value(dt, op, 0, k);
        for (int q = 1; q < size; q++) {
            unsigned v = (unsigned)bits_value(dt, op, q, k);
            acc = and_op ? (acc & v) : (acc | v);
        }
        uint8_t b = (uint8_t)(acc != 0);
        memcpy(out, &b, 1);
    }
}

void coll_check_expected(fsdp_dtype_t dt, fsdp_redop_t op, int size, size_t index, void *out) {
    size_t k = index % COLL_CHECK_PERIOD;
    if (op == COLL_CHECK_MOVE) {
        /* Nothing is reduced: rank 0's value. */
        coll_check_value(dt, 0, k, op, out);
        return;
    }
    if (real_valued(dt, op))
        expected_real(dt, op, size, k, out);
    else
        expected_bits(dt, op, size, k, out);
}

void coll_check_format(fsdp_dtype_t dt, const void *elem, char *buf, size_t cap) {
    float f;
    double d;
    uint16_t h;
    uint32_t u32;
    uint64_t u64;
    int32_t i32;
    int64_t i64;
    uint8_t u8;
    switch (dt) {
    case FSDP_DTYPE_F32:
        memcpy(&f, elem, 4);
        memcpy(&u32, elem, 4);
        snprintf(buf, cap, "%.9g (0x%08" PRIx32 ")", (double)f, u32);
        break;
    case FSDP_DTYPE_F64:
        memcpy(&d, elem, 8);
        memcpy(&u64, elem, 8);
        snprintf(buf, cap, "%.17g (0x%016" PRIx64 ")", d, u64);
        break;
    case FSDP_DTYPE_F16:
    case FSDP_DTYPE_BF16:
        memcpy(&h, elem, 2);
        f = dt == FSDP_DTYPE_F16 ? fsdp_f16_to_f32(h) : fsdp_bf16_to_f32(h);
        snprintf(buf, cap, "%.6g (0x%04x)", (double)f, (unsigned)h);
        break;
    case FSDP_DTYPE_I32:
        memcpy(&i32, elem, 4);
        snprintf(buf, cap, "%" PRId32, i32);
        break;
    case FSDP_DTYPE_I64:
        memcpy(&i64, elem, 8);
        snprintf(buf, cap, "%" PRId64, i64);
        break;
    case FSDP_DTYPE_U8:
    case FSDP_DTYPE_BOOL:
        memcpy(&u8, elem, 1);
        snprintf(buf, cap, "%u", (unsigned)u8);
        break;
    default:
        snprintf(buf, cap, "?");
        break;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Kinds */

int coll_check_has_op(fsdp_coll_kind_t kind) {
    return kind == FSDP_COLL_REDUCE_SCATTER || kind == FSDP_COLL_ALL_REDUCE ||
           kind == FSDP_COLL_REDUCE;
}

int coll_check_has_root(fsdp_coll_kind_t kind) {
    return kind == FSDP_COLL_BROADCAST || kind == FSDP_COLL_REDUCE;
}

int coll_check_has_in_place(fsdp_coll_kind_t kind) {
    return kind != FSDP_COLL_ALL_TO_ALL && kind != FSDP_COLL_BARRIER && kind < FSDP_COLL_COUNT;
}

/* 1 when the message of the kind is size * count elements. */
static int per_rank_chunks(fsdp_coll_kind_t kind) {
    return kind == FSDP_COLL_ALL_GATHER || kind == FSDP_COLL_REDUCE_SCATTER ||
           kind == FSDP_COLL_ALL_TO_ALL;
}

size_t coll_check_count_for_bytes(fsdp_coll_kind_t kind, fsdp_dtype_t dt, int size, size_t bytes) {
    size_t es = fsdp_dtype_size(dt);
    if (es == 0 || size < 1) return 0;
    return bytes / es / (per_rank_chunks(kind) ? (size_t)size : 1u);
}

/* ---------------------------------------------------------------------------------------- */
/* Patterns: one period of a sequence of elements, compared and filled by runs */

typedef struct pattern {
    unsigned char *p; /* period elements */
    size_t period;
} pattern_t;

typedef struct job {
    fsdp_pg_t *pg;
    coll_check_args_t a;
    int rank, size;
    size_t es;
    size_t period;
    fsdp_redop_t pop; /* op of the patterns: a->op or COLL_CHECK_MOVE */
    char *why;
    size_t cap;
    int failed;
    /* Tables; NULL where not needed. */
    pattern_t *v;    /* size entries: the inputs of each rank */
    pattern_t *vinv; /* their complements */
    pattern_t e, einv;
} job_t;

static void describe(const job_t *j, char *buf, size_t cap) {
    const coll_check_args_t *a = &j->a;
    int n = snprintf(buf, cap, "%s(%s", fsdp_coll_name(a->kind), fsdp_dtype_name(a->dtype));
    if (n < 0 || (size_t)n >= cap) return;
    if (coll_check_has_op(a->kind))
        n += snprintf(buf + n, cap - (size_t)n, ", %s", fsdp_redop_name(a->op));
    if (n < 0 || (size_t)n >= cap) return;
    n += snprintf(buf + n, cap - (size_t)n, ", count %zu", a->count);
    if (n < 0 || (size_t)n >= cap) return;
    if (coll_check_has_root(a->kind)) n += snprintf(buf + n, cap - (size_t)n, ", root %d", a->root);
    if (n < 0 || (size_t)n >= cap) return;
    snprintf(buf + n, cap - (size_t)n, ", %s%s%s) on rank %d of %d",
             a->in_place ? "in place" : "out of place", a->null_unused ? ", NULL unused" : "",
             a->async ? ", async" : "", j->rank, j->size);
}

/* Records the first problem of the job; returns rc. */
static int fail(job_t *j, int rc, const char *fmt, ...) FSDP_PRINTF(3, 4);
static int fail(job_t *j, int rc, const char *fmt, ...) {
    if (j->failed) return rc;
    j->failed = 1;
    char head[256], body[512];
    describe(j, head, sizeof head);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(body, sizeof body, fmt, ap);
    va_end(ap);
    if (j->cap) snprintf(j->why, j->cap, "%s: %s", head, body);
    return rc;
}

static int pattern_alloc(pattern_t *pt, size_t period, size_t es) {
    pt->period = period;
    pt->p = malloc(period * es);
    return pt->p ? 0 : -1;
}

static void pattern_invert(pattern_t *dst, const pattern_t *src, size_t es) {
    for (size_t i = 0; i < src->period * es; i++)
        dst->p[i] = (unsigned char)~src->p[i];
}

/* dst[i] = pat[(start + i) % period] for i in [0, n). */
static void fill(unsigned char *dst, size_t n, const pattern_t *pt, size_t start, size_t es) {
    size_t k = start % pt->period;
    while (n > 0) {
        size_t m = pt->period - k < n ? pt->period - k : n;
        memcpy(dst, pt->p + k * es, m * es);
        dst += m * es;
        n -= m;
        k = 0;
    }
}

/*
 * Compares buf[i] with pat[(start + i) % period] for i in [0, n); on the first difference
 * records "<what>[base + i] = got, want W (note)" and returns COLL_CHECK_MISMATCH.
 */
static int compare(job_t *j, const char *what, const unsigned char *buf, size_t n, size_t base,
                   const pattern_t *pt, size_t start, const char *note) {
    size_t es = j->es, k = start % pt->period, done = 0;
    while (done < n) {
        size_t m = pt->period - k < n - done ? pt->period - k : n - done;
        if (memcmp(buf + done * es, pt->p + k * es, m * es) != 0) {
            size_t i = 0;
            while (memcmp(buf + (done + i) * es, pt->p + (k + i) * es, es) == 0)
                i++;
            char got[64], want[64];
            coll_check_format(j->a.dtype, buf + (done + i) * es, got, sizeof got);
            coll_check_format(j->a.dtype, pt->p + (k + i) * es, want, sizeof want);
            return fail(j, COLL_CHECK_MISMATCH, "%s[%zu] = %s, want %s%s%s", what, base + done + i,
                        got, want, note ? " " : "", note ? note : "");
        }
        done += m;
        k = 0;
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Guarded buffers */

typedef struct gbuf {
    unsigned char *base; /* GUARD bytes | n elements | GUARD bytes */
    unsigned char *data;
    size_t bytes;
} gbuf_t;

/* The calling thread's buffers, kept from one check to the next: mapping and faulting in fresh
 * pages for every 16 MiB check would cost more than the check. coll_check_release() frees
 * them. */
static _Thread_local struct {
    unsigned char *p[2];
    size_t cap[2];
} tl_bufs;

/* The allocator of the buffers the collectives see (coll_check_set_alloc()). */
static void *(*buf_alloc)(size_t bytes) = malloc;
static void (*buf_free)(void *p) = free;

void coll_check_set_alloc(void *(*alloc)(size_t bytes), void (*release)(void *p)) {
    buf_alloc = alloc ? alloc : malloc;
    buf_free = release ? release : free;
}

void coll_check_release(void) {
    for (int i = 0; i < 2; i++) {
        buf_free(tl_bufs.p[i]);
        tl_bufs.p[i] = NULL;
        tl_bufs.cap[i] = 0;
    }
}

/* Takes buffer `slot` (0 or 1) of the thread for n elements with guards on both sides. */
static int gbuf_alloc(gbuf_t *b, int slot, size_t n, size_t es) {
    size_t need = n * es + 2 * GUARD;
    if (tl_bufs.cap[slot] < need) {
        buf_free(tl_bufs.p[slot]);
        tl_bufs.cap[slot] = 0;
        tl_bufs.p[slot] = buf_alloc(need);
        if (!tl_bufs.p[slot]) return -1;
        tl_bufs.cap[slot] = need;
    }
    b->bytes = n * es;
    b->base = tl_bufs.p[slot];
    b->data = b->base + GUARD;
    memset(b->base, GUARD_BYTE, GUARD);
    memset(b->data + b->bytes, GUARD_BYTE, GUARD);
    return 0;
}

static int gbuf_guards(job_t *j, const char *what, const gbuf_t *b) {
    if (!b->base) return 0;
    for (size_t i = 0; i < GUARD; i++) {
        if (b->base[i] != GUARD_BYTE)
            return fail(j, COLL_CHECK_MISMATCH,
                        "%s: byte %zu before the buffer was overwritten (0x%02x)", what, GUARD - i,
                        (unsigned)b->base[i]);
        if (b->data[b->bytes + i] != GUARD_BYTE)
            return fail(j, COLL_CHECK_MISMATCH,
                        "%s: byte %zu after the end of the buffer was overwritten (0x%02x)", what,
                        i, (unsigned)b->data[b->bytes + i]);
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* The checker */

static int build_tables(job_t *j, int need_all_ranks, int need_expected) {
    fsdp_dtype_t dt = j->a.dtype;
    size_t es = j->es;
    j->v = calloc((size_t)j->size, sizeof *j->v);
    j->vinv = calloc((size_t)j->size, sizeof *j->vinv);
    if (!j->v || !j->vinv) return -1;
    for (int q = 0; q < j->size; q++) {
        int need =
            need_all_ranks || q == j->rank || (coll_check_has_root(j->a.kind) && q == j->a.root);
        if (!need) continue;
        if (pattern_alloc(&j->v[q], j->period, es) || pattern_alloc(&j->vinv[q], j->period, es))
            return -1;
        for (size_t k = 0; k < j->period; k++)
            coll_check_value(dt, q, k, j->pop, j->v[q].p + k * es);
        pattern_invert(&j->vinv[q], &j->v[q], es);
    }
    if (need_expected) {
        if (pattern_alloc(&j->e, j->period, es) || pattern_alloc(&j->einv, j->period, es))
            return -1;
        for (size_t k = 0; k < j->period; k++)
            coll_check_expected(dt, j->pop, j->size, k, j->e.p + k * es);
        pattern_invert(&j->einv, &j->e, es);
    }
    return 0;
}

static void free_tables(job_t *j) {
    for (int q = 0; j->v && q < j->size; q++)
        free(j->v[q].p);
    for (int q = 0; j->vinv && q < j->size; q++)
        free(j->vinv[q].p);
    free(j->v);
    free(j->vinv);
    free(j->e.p);
    free(j->einv.p);
}

static int issue(job_t *j, const void *send, void *recv, fsdp_work_t **work) {
    const coll_check_args_t *a = &j->a;
    switch (a->kind) {
    case FSDP_COLL_ALL_GATHER:
        return fsdp_pg_all_gather(j->pg, send, recv, a->count, a->dtype, work);
    case FSDP_COLL_REDUCE_SCATTER:
        return fsdp_pg_reduce_scatter(j->pg, send, recv, a->count, a->dtype, a->op, work);
    case FSDP_COLL_ALL_REDUCE:
        return fsdp_pg_all_reduce(j->pg, send, recv, a->count, a->dtype, a->op, work);
    case FSDP_COLL_BROADCAST:
        return fsdp_pg_broadcast(j->pg, send, recv, a->count, a->dtype, a->root, work);
    case FSDP_COLL_REDUCE:
        return fsdp_pg_reduce(j->pg, send, recv, a->count, a->dtype, a->op, a->root, work);
    case FSDP_COLL_ALL_TO_ALL:
        return fsdp_pg_all_to_all(j->pg, send, recv, a->count, a->dtype, work);
    case FSDP_COLL_BARRIER:
        return fsdp_pg_barrier(j->pg, work);
    default:
        return FSDP_EINVAL;
    }
}

/*
 * Runs the call, blocking or through a work handle, and checks the sequence number and the
 * counters. reject: NULL when the call must succeed; otherwise it must be rejected with
 * FSDP_EINVAL, consume no sequence number, count nothing, and its error must contain `reject`.
 * Returns 0 when the call behaved, else the status to return.
 */
static int call(job_t *j, const void *send, void *recv, const char *reject) {
    const coll_check_args_t *a = &j->a;
    uint64_t seq0 = fsdp_pg_seq(j->pg);
    fsdp_pg_counters_t c0, c1;
    fsdp_pg_get_counters(j->pg, &c0);
    int rc;
    if (a->async) {
        fsdp_work_t *w = NULL;
        rc = issue(j, send, recv, &w);
        if (rc == FSDP_OK) {
            if (!w) return fail(j, COLL_CHECK_MISMATCH, "returned FSDP_OK without a work");
            uint64_t wseq = fsdp_work_seq(w);
            rc = fsdp_work_wait(w, -1);
            fsdp_work_release(w);
            if (rc == FSDP_OK && wseq != seq0)
                return fail(j, COLL_CHECK_MISMATCH, "the work has seq %" PRIu64 ", want %" PRIu64,
                            wseq, seq0);
        } else if (w) {
            return fail(j, COLL_CHECK_MISMATCH, "rejected with %s but *work is not NULL",
                        fsdp_err_name(rc));
        }
    } else {
        rc = issue(j, send, recv, NULL);
    }
    uint64_t seq1 = fsdp_pg_seq(j->pg);
    fsdp_pg_get_counters(j->pg, &c1);
    if (reject) {
        if (rc != FSDP_EINVAL)
            return fail(j, rc < 0 ? rc : COLL_CHECK_MISMATCH, "returned %s, want FSDP_EINVAL (%s)",
                        fsdp_err_name(rc), reject);
        if (!strstr(fsdp_pg_last_error(j->pg), reject))
            return fail(j, COLL_CHECK_MISMATCH, "the error does not say '%s': \"%s\"", reject,
                        fsdp_pg_last_error(j->pg));
        if (seq1 != seq0)
            return fail(j, COLL_CHECK_MISMATCH,
                        "a rejected call moved the sequence number from %" PRIu64 " to %" PRIu64,
                        seq0, seq1);
        if (memcmp(&c0, &c1, sizeof c0) != 0)
            return fail(j, COLL_CHECK_MISMATCH, "a rejected call changed the counters");
        return 0;
    }
    if (rc != FSDP_OK)
        return fail(j, rc, "returned %s: %s", fsdp_err_name(rc), fsdp_pg_last_error(j->pg));
    if (seq1 != seq0 + 1)
        return fail(j, COLL_CHECK_MISMATCH,
                    "the sequence number went from %" PRIu64 " to %" PRIu64 ", want +1", seq0,
                    seq1);
    uint64_t bytes = (uint64_t)a->count * j->es * (per_rank_chunks(a->kind) ? (size_t)j->size : 1u);
    if (a->kind == FSDP_COLL_BARRIER) bytes = 0;
    for (int k = 0; k < FSDP_COLL_COUNT; k++) {
        uint64_t dc = c1.calls[k] - c0.calls[k], db = c1.bytes[k] - c0.bytes[k];
        uint64_t wc = k == (int)a->kind ? 1 : 0, wb = k == (int)a->kind ? bytes : 0;
        if (dc != wc || db != wb)
            return fail(j, COLL_CHECK_MISMATCH,
                        "counters of %s grew by %" PRIu64 " calls and %" PRIu64
                        " bytes, want %" PRIu64 " and %" PRIu64,
                        fsdp_coll_name((fsdp_coll_kind_t)k), dc, db, wc, wb);
    }
    return 0;
}

/* The body of coll_check_run_args() once the tables are built; buffers are freed by caller. */
static int run_kind(job_t *j, gbuf_t *sb, gbuf_t *rb) {
    const coll_check_args_t *a = &j->a;
    const int r = j->rank, n = j->size;
    const size_t c = a->count, es = j->es, nc = (size_t)n * c;
    const int ip = a->in_place;
    int rc = 0;
    if (a->kind == FSDP_COLL_BARRIER) return call(j, NULL, NULL, NULL);

    if (coll_check_has_op(a->kind) && a->dtype == FSDP_DTYPE_BOOL && a->op == FSDP_REDOP_AVG) {
        /* avg is not defined on bool: rejected whatever the count, buffers untouched. */
        if (gbuf_alloc(sb, 0, nc, es) || gbuf_alloc(rb, 1, nc, es)) goto nomem;
        fill(sb->data, nc, &j->v[r], 0, es);
        fill(rb->data, nc, &j->vinv[r], 0, es);
        if ((rc = call(j, sb->data, rb->data, "avg"))) return rc;
        rc = compare(j, "send", sb->data, nc, 0, &j->v[r], 0, "(changed by a rejected call)");
        if (!rc)
            rc =
                compare(j, "recv", rb->data, nc, 0, &j->vinv[r], 0, "(changed by a rejected call)");
        return rc;
    }

    switch (a->kind) {
    case FSDP_COLL_ALL_GATHER:
        /* recv: rank q's send at q * count. In place: send = recv + rank * count. */
        if (gbuf_alloc(rb, 1, nc, es) || (!ip && gbuf_alloc(sb, 0, c, es))) break;
        for (int q = 0; q < n; q++)
            fill(rb->data + (size_t)q * c * es, c, ip && q == r ? &j->v[q] : &j->vinv[q], 0, es);
        if (!ip) fill(sb->data, c, &j->v[r], 0, es);
        if ((rc = call(j, ip ? rb->data + (size_t)r * c * es : sb->data, rb->data, NULL)))
            return rc;
        for (int q = 0; q < n && !rc; q++)
            rc = compare(j, "recv", rb->data + (size_t)q * c * es, c, (size_t)q * c, &j->v[q], 0,
                         NULL);
        if (!ip && !rc) rc = compare(j, "send", sb->data, c, 0, &j->v[r], 0, "(send changed)");
        return rc;

    case FSDP_COLL_REDUCE_SCATTER:
        /* recv: the reduction of every rank's send[rank * count, +count). In place:
         * recv = send + rank * count. */
        if (gbuf_alloc(sb, 0, nc, es) || (!ip && gbuf_alloc(rb, 1, c, es))) break;
        fill(sb->data, nc, &j->v[r], 0, es);
        if (!ip) fill(rb->data, c, &j->einv, (size_t)r * c, es);
        {
            unsigned char *recv = ip ? sb->data + (size_t)r * c * es : rb->data;
            if ((rc = call(j, sb->data, recv, NULL))) return rc;
            rc = compare(j, "recv", recv, c, 0, &j->e, (size_t)r * c, NULL);
        }
        /* The rest of send is not the destination and must not change. */
        if (!rc && ip) {
            rc = compare(j, "send", sb->data, (size_t)r * c, 0, &j->v[r], 0, "(send changed)");
            if (!rc)
                rc = compare(j, "send", sb->data + (size_t)(r + 1) * c * es,
                             (size_t)(n - r - 1) * c, (size_t)(r + 1) * c, &j->v[r],
                             (size_t)(r + 1) * c, "(send changed outside the in-place chunk)");
        } else if (!rc) {
            rc = compare(j, "send", sb->data, nc, 0, &j->v[r], 0, "(send changed)");
        }
        return rc;

    case FSDP_COLL_ALL_REDUCE:
        if (gbuf_alloc(sb, 0, c, es) || (!ip && gbuf_alloc(rb, 1, c, es))) break;
        fill(sb->data, c, &j->v[r], 0, es);
        if (!ip) fill(rb->data, c, &j->einv, 0, es);
        if ((rc = call(j, sb->data, ip ? sb->data : rb->data, NULL))) return rc;
        rc = compare(j, "recv", ip ? sb->data : rb->data, c, 0, &j->e, 0, NULL);
        if (!rc && !ip) rc = compare(j, "send", sb->data, c, 0, &j->v[r], 0, "(send changed)");
        return rc;

    case FSDP_COLL_BROADCAST: {
        /* Every rank's recv gets the root's send. Non-roots' send is not read (NULL when
         * null_unused) and must not change. */
        const int root = a->root;
        const int nosend = !ip && a->null_unused && r != root;
        if (gbuf_alloc(rb, 1, c, es) || (!ip && !nosend && gbuf_alloc(sb, 0, c, es))) break;
        if (ip) {
            fill(rb->data, c, r == root ? &j->v[root] : &j->vinv[root], 0, es);
        } else {
            fill(rb->data, c, &j->vinv[root], 0, es);
            if (!nosend) fill(sb->data, c, &j->v[r], 0, es);
        }
        if ((rc = call(j, ip ? rb->data : sb->data, rb->data, NULL))) return rc;
        rc = compare(j, "recv", rb->data, c, 0, &j->v[root], 0, NULL);
        if (!rc && !ip && !nosend)
            rc = compare(j, "send", sb->data, c, 0, &j->v[r], 0, "(send changed)");
        return rc;
    }

    case FSDP_COLL_REDUCE: {
        /* Only the root's recv receives the result; a non-root's recv is not touched (NULL when
         * null_unused). */
        const int root = a->root;
        const int norecv = !ip && a->null_unused && r != root;
        if (gbuf_alloc(sb, 0, c, es) || (!ip && !norecv && gbuf_alloc(rb, 1, c, es))) break;
        fill(sb->data, c, &j->v[r], 0, es);
        if (!ip && !norecv) fill(rb->data, c, &j->einv, 0, es);
        if ((rc = call(j, sb->data, ip ? sb->data : (norecv ? NULL : rb->data), NULL))) return rc;
        if (ip) {
            if (r == root)
                rc = compare(j, "recv", sb->data, c, 0, &j->e, 0, NULL);
            else
                rc = compare(j, "recv", sb->data, c, 0, &j->v[r], 0, "(non-root buffer changed)");
            return rc;
        }
        if (r == root)
            rc = compare(j, "recv", rb->data, c, 0, &j->e, 0, NULL);
        else if (!norecv)
            rc = compare(j, "recv", rb->data, c, 0, &j->einv, 0, "(non-root recv was touched)");
        if (!rc) rc = compare(j, "send", sb->data, c, 0, &j->v[r], 0, "(send changed)");
        return rc;
    }

    case FSDP_COLL_ALL_TO_ALL:
        /* Rank q's send[r * count, +count) lands in rank r's recv[q * count, +count). */
        if (ip) {
            /* No in-place form: send == recv overlaps and is rejected (unless count is 0). */
            if (gbuf_alloc(sb, 0, nc, es)) break;
            fill(sb->data, nc, &j->v[r], 0, es);
            if ((rc = call(j, sb->data, sb->data, c > 0 ? "overlap" : NULL))) return rc;
            return compare(j, "send", sb->data, nc, 0, &j->v[r], 0, "(changed by a rejected call)");
        }
        if (gbuf_alloc(sb, 0, nc, es) || gbuf_alloc(rb, 1, nc, es)) break;
        fill(sb->data, nc, &j->v[r], 0, es);
        for (int q = 0; q < n; q++)
            fill(rb->data + (size_t)q * c * es, c, &j->vinv[q], (size_t)r * c, es);
        if ((rc = call(j, sb->data, rb->data, NULL))) return rc;
        for (int q = 0; q < n && !rc; q++)
            rc = compare(j, "recv", rb->data + (size_t)q * c * es, c, (size_t)q * c, &j->v[q],
                         (size_t)r * c, NULL);
        if (!rc) rc = compare(j, "send", sb->data, nc, 0, &j->v[r], 0, "(send changed)");
        return rc;

    default:
        return fail(j, FSDP_EINVAL, "unknown collective kind %d", (int)a->kind);
    }
nomem:
    return fail(j, FSDP_ENOMEM, "out of memory for the buffers");
}

int coll_check_run_args(fsdp_pg_t *pg, const coll_check_args_t *args, char *why, size_t cap) {
    job_t j;
    memset(&j, 0, sizeof j);
    j.pg = pg;
    j.a = *args;
    j.why = why;
    j.cap = cap;
    if (cap) why[0] = 0;
    j.rank = fsdp_pg_rank(pg);
    j.size = fsdp_pg_size(pg);
    j.es = fsdp_dtype_size(args->dtype);
    if (!pg || j.size < 1 || (args->kind != FSDP_COLL_BARRIER && j.es == 0))
        return fail(&j, FSDP_EINVAL, "bad group or dtype");
    int rc = 0;
    gbuf_t sb = {0}, rb = {0};
    if (args->kind != FSDP_COLL_BARRIER) {
        int reduces = coll_check_has_op(args->kind);
        j.pop = reduces ? args->op : COLL_CHECK_MOVE;
        size_t span = per_rank_chunks(args->kind) ? (size_t)j.size * args->count : args->count;
        j.period = span < COLL_CHECK_PERIOD ? span : COLL_CHECK_PERIOD;
        if (j.period == 0) j.period = 1;
        int all_ranks = args->kind == FSDP_COLL_ALL_GATHER || args->kind == FSDP_COLL_ALL_TO_ALL;
        if (build_tables(&j, all_ranks, reduces) < 0) {
            rc = fail(&j, FSDP_ENOMEM, "out of memory for the patterns");
            goto out;
        }
    }
    rc = run_kind(&j, &sb, &rb);
    if (!rc) rc = gbuf_guards(&j, "send", &sb);
    if (!rc) rc = gbuf_guards(&j, "recv", &rb);
out:
    free_tables(&j);
    return rc;
}

int coll_check_run(fsdp_pg_t *pg, fsdp_coll_kind_t kind, fsdp_dtype_t dt, fsdp_redop_t op,
                   size_t count, int in_place, int root, char *why, size_t cap) {
    coll_check_args_t a;
    memset(&a, 0, sizeof a);
    a.kind = kind;
    a.dtype = dt;
    a.op = op;
    a.count = count;
    a.in_place = in_place;
    a.root = root;
    return coll_check_run_args(pg, &a, why, cap);
}
