/* SPDX-License-Identifier: MIT */
/*
 * t_cuda_host.c: the parts of the CUDA device that can be checked without a GPU, in every
 * build:
 *   - the Philox function the dropout kernel runs (backends/cuda/cuda_philox.h, compiled here
 *     for the host) gives fsdp_philox4x32_10's words bit for bit;
 *   - the cast kernel's element conversion (backends/cuda/cuda_cast.h, compiled here for the host)
 *     gives fsdp_dtype_convert's bits for every pair of dtypes, and its one-step f32 <-> bf16
 *     conversions give the general path's bits;
 *   - dropout masks built from that header with the kernel's layout (one Philox block per four
 *     elements, block offset + i / 4) equal the CPU device's masks bit for bit;
 *   - the GEMM planning of backends/cuda/cuda_gemm.h: the dtype dispatch table (f32, bf16, f16
 *     through cuBLASLt, f64 through cuBLAS, the rest refused), the column-major operands handed
 *     to the library (a column-major reference GEMM over the plan gives the row-major product
 *     exactly, for every transpose pair, leading dimension and batch stride), and the operand
 *     alignment told to the heuristic for 2-, 4- and 8-byte elements;
 *   - fsdp_device_create(FSDP_DEVICE_CUDA) fails cleanly where there is no GPU (FSDP_ENOTSUP and
 *     a message) or no CUDA build, and rejects an ordinal past the visible devices.
 */
#include <config.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "backends/cuda/cuda_cast.h"
#include "backends/cuda/cuda_gemm.h"
#include "backends/cuda/cuda_philox.h"
#include "device/device_impl.h"
#include "tap.h"

#ifdef FSDP_HAVE_CUDA
#include "backends/cuda/cuda_device.h"
#endif

static uint64_t rs = 0x243F6A8885A308D3u;

static uint64_t next64(void) {
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return rs;
}

static fsdp_ctx_t *new_ctx(void) {
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    fsdp_ctx_t *ctx = NULL;
    if (fsdp_ctx_create(&o, &ctx) < 0) tap_bail("cannot create a context");
    return ctx;
}

static void test_philox(void) {
    size_t bad = 0;
    const uint32_t edge[] = {0, 1, 0x7fffffffu, 0x80000000u, 0xffffffffu};
    for (int it = 0; it < 20000; it++) {
        uint32_t c[4], k[2], want[4], got[4];
        for (int j = 0; j < 4; j++)
            c[j] = it < 625 ? edge[(it / (j == 0   ? 1
                                          : j == 1 ? 5
                                          : j == 2 ? 25
                                                   : 125)) %
                                   5]
                            : (uint32_t)next64();
        k[0] = it % 3 == 0 ? 0xffffffffu : (uint32_t)next64();
        k[1] = it % 5 == 0 ? 0 : (uint32_t)next64();
        fsdp_philox4x32_10(c, k, want);
        fsdp_cuda_philox(c, k[0], k[1], got);
        if (memcmp(want, got, sizeof want) != 0) bad++;
    }
    tap_is_size(bad, 0, "cuda_philox.h gives fsdp_philox4x32_10's words for 20000 counters/keys");

    /* A known stream through the public generator: blocks 0.. of (seed, stream). */
    fsdp_rng_t rng;
    fsdp_rng_init(&rng, UINT64_C(0x0123456789abcdef), UINT64_C(0xfedcba9876543210));
    uint32_t words[64];
    fsdp_rng_u32(&rng, words, 64);
    bad = 0;
    for (uint64_t b = 0; b < 16; b++) {
        uint32_t w[4];
        fsdp_cuda_philox_block(UINT64_C(0x0123456789abcdef), UINT64_C(0xfedcba9876543210), b, w);
        if (memcmp(w, words + 4 * b, sizeof w) != 0) bad++;
    }
    tap_is_size(bad, 0, "fsdp_cuda_philox_block(seed, stream, b) is block b of fsdp_rng_u32");
}

/* The mask the dropout kernel computes, element by element as its threads do. */
static void kernel_mask(size_t n, double p, uint64_t seed, uint64_t stream, uint64_t offset,
                        uint8_t *mask) {
    uint32_t thr = fsdp_cuda_dropout_threshold(p);
    for (size_t q = 0; q < (n + 3) / 4; q++) {
        uint32_t w[4];
        fsdp_cuda_philox_block(seed, stream, offset + (uint64_t)q, w);
        for (size_t j = 0; j < 4 && 4 * q + j < n; j++)
            mask[4 * q + j] = (uint8_t)fsdp_cuda_dropout_keep(w[j], thr);
    }
}

static void test_dropout_layout(void) {
    fsdp_ctx_t *ctx = new_ctx();
    fsdp_device_t *cpu = NULL;
    if (fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &cpu) < 0) tap_bail("no CPU device");
    const size_t n = 4099; /* not a multiple of 4: the last block is partial */
    float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
    uint8_t *m_cpu = malloc(n), *m_k = malloc(n);
    for (size_t i = 0; i < n; i++)
        x[i] = (float)i;
    const double ps[] = {0.1, 0.5, 0.9, 1.0 / 3.0, 0x1p-24, 1.0 - 0x1p-24};
    const uint64_t offsets[] = {0, 7, UINT64_C(0xfffffffe), UINT64_MAX - 2};
    for (size_t a = 0; a < sizeof ps / sizeof ps[0]; a++) {
        for (size_t b = 0; b < sizeof offsets / sizeof offsets[0]; b++) {
            uint64_t seed = next64(), stream = b == 3 ? UINT64_MAX : next64();
            int rc = cpu->ops->dropout(cpu, FSDP_DTYPE_F32, n, ps[a], seed, stream, offsets[b], x,
                                       y, m_cpu);
            kernel_mask(n, ps[a], seed, stream, offsets[b], m_k);
            size_t kept = 0;
            for (size_t i = 0; i < n; i++)
                kept += m_k[i];
            tap_ok(rc == 0 && memcmp(m_cpu, m_k, n) == 0,
                   "p %.9g offset %llu: the kernel's mask equals the CPU's bitwise (%zu of %zu "
                   "kept)",
                   ps[a], (unsigned long long)offsets[b], kept, n);
        }
    }
    fsdp_device_destroy(cpu);
    fsdp_ctx_destroy(ctx);
    free(x);
    free(y);
    free(m_cpu);
    free(m_k);
}

static void test_cast(void) {
    enum { N = 20000 };
    double *vals = malloc(N * sizeof *vals);
    for (size_t i = 0; i < N; i++) {
        uint64_t r = next64();
        double v;
        switch (i % 6) {
        case 0:
            v = ldexp((double)(r >> 11) * 0x1p-53 - 0.5, (int)(r % 80) - 40);
            break;
        case 1:
            v = (double)(int64_t)r;
            break; /* beyond every integer range */
        case 2:
            v = (double)((int64_t)(r % 600) - 300) + (double)(r >> 60) / 16.0;
            break;
        case 3:
            v = ldexp(1.0 + (double)(r >> 40) * 0x1p-24, (int)(r % 40) - 30);
            break;
        case 4: {
            /* Any double bit pattern: NaNs with payloads, subnormals, infinities. */
            memcpy(&v, &r, sizeof v);
            break;
        }
        default:
            v = ldexp((double)(r >> 11) * 0x1p-53, (int)(r % 300) - 150);
            break;
        }
        vals[i] = v;
    }
    const double special[] = {0.0,
                              -0.0,
                              65504.0,
                              65519.99,
                              65520.0,
                              -65520.0,
                              0x1p-24,
                              0x1p-25,
                              0x1.8p-25,
                              0x1p-14,
                              0x1.ffcp-15,
                              3.3895313892515355e38,
                              INFINITY,
                              -INFINITY,
                              NAN,
                              2147483647.5,
                              -2147483648.5,
                              255.9,
                              -0.9,
                              9223372036854775807.0,
                              -9223372036854775808.0,
                              0.5,
                              1.5,
                              2.5};
    for (size_t i = 0; i < sizeof special / sizeof special[0]; i++)
        vals[i] = special[i];
    for (int xt = 0; xt < FSDP_DTYPE_COUNT; xt++) {
        size_t xs = fsdp_dtype_size(xt);
        unsigned char *x = malloc(N * xs);
        if (xt == FSDP_DTYPE_I64) {
            /* Whole int64 range, not only what a double holds. */
            for (size_t i = 0; i < N; i++) {
                int64_t v = (int64_t)next64() >> (next64() % 63);
                memcpy(x + i * 8, &v, 8);
            }
        } else if (fsdp_dtype_convert(x, xt, vals, FSDP_DTYPE_F64, N) < 0) {
            tap_bail("convert to %s", fsdp_dtype_name(xt));
        }
        for (int yt = 0; yt < FSDP_DTYPE_COUNT; yt++) {
            size_t ys = fsdp_dtype_size(yt);
            unsigned char *want = calloc(N, ys), *got = calloc(N, ys);
            int rc = fsdp_dtype_convert(want, yt, x, xt, N);
            for (size_t i = 0; i < N; i++)
                fsdp_cuda_cast_one(yt, got, xt, x, i);
            size_t bad = 0, first = 0;
            for (size_t i = 0; i < N; i++)
                if (memcmp(want + i * ys, got + i * ys, ys) != 0 && bad++ == 0) first = i;
            if (bad)
                tap_diag("first difference at %zu (source value %.17g)", first,
                         xt == FSDP_DTYPE_I64 ? 0.0 : vals[first]);
            tap_ok(rc == 0 && bad == 0, "cast kernel %s -> %s: %d values bitwise dtype.c's",
                   fsdp_dtype_name(xt), fsdp_dtype_name(yt), N);
            free(want);
            free(got);
        }
        free(x);
    }
    free(vals);
}

/* The one-step f32 <-> bf16 conversions of the mixed-precision cast kernels give the general
 * path's bits: every bf16 (65536) and, for every upper half of a float, the lower halves at and
 * around the rounding points plus random ones (every sign, exponent, NaN payload and tie). */
static void test_cast_fast(void) {
    size_t bad = 0, n = 0;
    uint32_t first = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        uint16_t b = (uint16_t)h;
        float want, got = fsdp_cc_bf16_to_f32_q(b);
        fsdp_cuda_cast_one(FSDP_DTYPE_F32, &want, FSDP_DTYPE_BF16, &b, 0);
        n++;
        if (memcmp(&want, &got, 4) != 0 && bad++ == 0) first = h;
    }
    if (bad) tap_diag("bf16 0x%04x: %zu differ", (unsigned)first, bad);
    tap_ok(bad == 0, "bf16 -> f32 in one step: all %zu values bitwise the general cast's", n);
    const uint32_t lows[] = {0, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0x4000, 0xc000};
    bad = n = 0;
    for (uint32_t hi = 0; hi < 65536; hi++) {
        for (size_t k = 0; k < sizeof lows / sizeof lows[0] + 4; k++) {
            uint32_t lo = k < sizeof lows / sizeof lows[0] ? lows[k] : (uint32_t)next64() & 0xffff;
            uint32_t u = hi << 16 | lo;
            float f;
            memcpy(&f, &u, 4);
            uint16_t want, got = fsdp_cc_f32_to_bf16(f);
            fsdp_cuda_cast_one(FSDP_DTYPE_BF16, &want, FSDP_DTYPE_F32, &f, 0);
            n++;
            if (want != got && bad++ == 0) first = u;
        }
    }
    if (bad) tap_diag("f32 bits 0x%08x: %zu differ", (unsigned)first, bad);
    tap_ok(bad == 0, "f32 -> bf16 in one step: %zu values bitwise the general cast's", n);
}

/* ---- GEMM planning (cuda_gemm.h) ---- */

/* Which matrices of a product go through padded copies: GPT-2's head (vocabulary 50257) in
 * bf16, forward (the logits, the library's C) and backward (the logits' gradient, our A, as
 * the library's B), padded to 16 bytes; an f32 result to 4 elements; never an aligned matrix,
 * a small product or a batch. */
static void test_gemm_pad(void) {
    static char buf[64];
    /* One product each: element and result sizes, flags, m n k, lda ldb ldc, batch, and the
     * padded leading dimension expected for the library's A, B and C. */
    static const struct {
        size_t size, csize;
        bool ta, tb;
        int64_t m, n, k, lda, ldb, ldc, batch, want[3];
        const char *what;
    } cases[] = {
        {2, 2, false, true, 8192, 50257, 768, 768, 768, 50257, 1, {0, 0, 50264},
         "head forward, bf16 (logits = x W^T): only C padded, to 50264"},
        {2, 4, false, true, 8192, 50257, 768, 768, 768, 50257, 1, {0, 0, 50260},
         "head forward, bf16 into f32: C padded to 50260"},
        {2, 2, false, false, 8192, 768, 50257, 50257, 768, 768, 1, {0, 50264, 0},
         "head backward dx = g W: only the gradient (the library's B) padded"},
        {2, 4, true, false, 50257, 768, 8192, 50257, 768, 768, 1, {0, 50264, 0},
         "head backward dW = g^T x: g^T padded, the f32 result not"},
        {2, 2, false, true, 16, 50257, 768, 768, 768, 50257, 1, {0, 0, 0},
         "a small product (16 x 50257 x 768) is not padded"},
        {2, 2, false, true, 8192, 50257, 768, 768, 768, 50257, 2, {0, 0, 0},
         "a batched product is not padded"},
        {2, 2, false, true, 8192, 50264, 768, 768, 768, 50264, 1, {0, 0, 0},
         "aligned matrices are not padded"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fsdp_cuda_lt_plan_t pl;
        int64_t pad[3];
        const int64_t sc = cases[i].batch > 1 ? cases[i].m * cases[i].ldc : 0;
        fsdp__cuda_lt_plan(&pl, cases[i].size, cases[i].csize, cases[i].ta, cases[i].tb,
                           cases[i].m, cases[i].n, cases[i].k, buf, cases[i].lda, 0, buf,
                           cases[i].ldb, 0, buf, cases[i].ldc, sc, cases[i].batch);
        fsdp__cuda_lt_pad(&pl, cases[i].size, cases[i].csize, cases[i].m, cases[i].n, cases[i].k,
                          cases[i].batch, pad);
        tap_ok(pad[0] == cases[i].want[0] && pad[1] == cases[i].want[1] &&
                   pad[2] == cases[i].want[2],
               "%s (got %lld %lld %lld)", cases[i].what, (long long)pad[0], (long long)pad[1],
               (long long)pad[2]);
    }
}

static void test_gemm_table(void) {
    static const struct {
        fsdp_dtype_t dt;
        fsdp_cuda_gemm_path_t path;
        fsdp_cuda_lt_elem_t elem;
        bool tf32;
    } want[] = {
        {FSDP_DTYPE_F32, FSDP_CUDA_GEMM_LT, FSDP_CUDA_LT_R32F, true},
        {FSDP_DTYPE_F64, FSDP_CUDA_GEMM_DGEMM, FSDP_CUDA_LT_R32F, false},
        {FSDP_DTYPE_F16, FSDP_CUDA_GEMM_LT, FSDP_CUDA_LT_R16F, false},
        {FSDP_DTYPE_BF16, FSDP_CUDA_GEMM_LT, FSDP_CUDA_LT_R16BF, false},
        {FSDP_DTYPE_I32, FSDP_CUDA_GEMM_NONE, FSDP_CUDA_LT_R32F, false},
        {FSDP_DTYPE_I64, FSDP_CUDA_GEMM_NONE, FSDP_CUDA_LT_R32F, false},
        {FSDP_DTYPE_U8, FSDP_CUDA_GEMM_NONE, FSDP_CUDA_LT_R32F, false},
        {FSDP_DTYPE_BOOL, FSDP_CUDA_GEMM_NONE, FSDP_CUDA_LT_R32F, false},
    };
    _Static_assert(sizeof want / sizeof want[0] == FSDP_DTYPE_COUNT, "one row per dtype");
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        fsdp_cuda_gemm_type_t t = fsdp__cuda_gemm_type(want[i].dt);
        const char *nm = fsdp_dtype_name(want[i].dt);
        tap_is_int(t.path, want[i].path, "gemm of %s takes path %d", nm, (int)want[i].path);
        if (t.path == FSDP_CUDA_GEMM_NONE) continue;
        tap_is_size(t.size, fsdp_dtype_size(want[i].dt), "gemm of %s: element size", nm);
        if (t.path == FSDP_CUDA_GEMM_LT)
            tap_is_int(t.elem, want[i].elem, "gemm of %s: cuBLASLt element type", nm);
        tap_ok(t.tf32_allowed == want[i].tf32, "gemm of %s: TF32 %s", nm,
               want[i].tf32 ? "may apply" : "never applies");
    }
    tap_is_int(fsdp__cuda_gemm_type((fsdp_dtype_t)FSDP_DTYPE_COUNT).path, FSDP_CUDA_GEMM_NONE,
               "an unknown dtype has no gemm");
    /* gemm_lp: bf16 or f16 operands, C of their dtype or f32; every other pair is refused. */
    int wrong = 0;
    for (int d = 0; d < FSDP_DTYPE_COUNT; d++)
        for (int c = 0; c < FSDP_DTYPE_COUNT; c++) {
            fsdp_dtype_t dt = (fsdp_dtype_t)d, ct = (fsdp_dtype_t)c;
            bool lp = dt == FSDP_DTYPE_BF16 || dt == FSDP_DTYPE_F16;
            bool ok = lp && (ct == dt || ct == FSDP_DTYPE_F32);
            fsdp_cuda_gemm_type_t t = fsdp__cuda_gemm_lp_type(dt, ct);
            if (!ok) {
                if (t.path != FSDP_CUDA_GEMM_NONE) {
                    tap_diag("gemm_lp of %s into %s has path %d", fsdp_dtype_name(dt),
                             fsdp_dtype_name(ct), (int)t.path);
                    wrong++;
                }
                continue;
            }
            fsdp_cuda_gemm_type_t base = fsdp__cuda_gemm_type(dt), cbase = fsdp__cuda_gemm_type(ct);
            tap_ok(t.path == FSDP_CUDA_GEMM_LT && t.elem == base.elem && t.size == 2 &&
                       t.celem == cbase.elem && t.csize == fsdp_dtype_size(ct) && !t.tf32_allowed,
                   "gemm_lp of %s into %s: cuBLASLt, operands %d (%zu bytes), C %d (%zu bytes)",
                   fsdp_dtype_name(dt), fsdp_dtype_name(ct), (int)t.elem, t.size, (int)t.celem,
                   t.csize);
        }
    tap_is_int(wrong, 0,
               "gemm_lp refuses every pair but bf16/f16 operands into their dtype or f32");
}

/* Element (r, c) of a stored column-major matrix with op applied: op(X)(r, c). */
static double lt_at(const fsdp_cuda_lt_mat_t *x, const double *base, int64_t batch, uint64_t r,
                    uint64_t c, int *bad) {
    uint64_t sr = x->trans ? c : r, scol = x->trans ? r : c;
    if (sr >= x->rows || scol >= x->cols || (int64_t)x->rows > x->ld) {
        (*bad)++;
        return 0;
    }
    return base[batch * x->stride + (int64_t)(sr + scol * (uint64_t)x->ld)];
}

/* The column-major library's C (n x m) = alpha op(LA) op(LB) + beta C over a plan, the way
 * cuBLASLt reads it; `*bad` counts any index the plan's shapes would not allow. */
static void lt_reference(const fsdp_cuda_lt_plan_t *pl, int64_t m, int64_t n, int64_t k,
                         double alpha, double beta, int64_t batch, int *bad) {
    const fsdp_cuda_lt_mat_t *la = &pl->mat[0], *lb = &pl->mat[1], *lc = &pl->mat[2];
    const double *pa = (const double *)la->ptr, *pb = (const double *)lb->ptr;
    double *pc = (double *)lc->ptr;
    if (lc->rows != (uint64_t)n || lc->cols != (uint64_t)m) (*bad)++;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < m; j++) {
                double acc = 0;
                for (int64_t p = 0; p < k; p++)
                    acc += lt_at(la, pa, b, (uint64_t)i, (uint64_t)p, bad) *
                           lt_at(lb, pb, b, (uint64_t)p, (uint64_t)j, bad);
                double *e = pc + b * lc->stride + i + j * lc->ld;
                *e = alpha * acc + beta * *e;
            }
}

static void test_gemm_plan(void) {
    const int64_t m = 5, n = 4, k = 3, batch = 2;
    for (int t = 0; t < 4; t++) {
        bool ta = t & 1, tb = t & 2;
        const int64_t lda = (ta ? m : k) + 2, ldb = (tb ? k : n) + 1, ldc = n + 3;
        const int64_t sa = (ta ? k : m) * lda + 1, sb = (tb ? n : k) * ldb + 2, sc = m * ldc + 1;
        double *a = calloc((size_t)(sa * batch), sizeof *a);
        double *b = calloc((size_t)(sb * batch), sizeof *b);
        double *c = calloc((size_t)(sc * batch), sizeof *c);
        double *want = calloc((size_t)(sc * batch), sizeof *want);
        if (!a || !b || !c || !want) tap_bail("out of memory");
        /* Small integers: every product and sum is exact, so the orders cannot differ. */
        for (int64_t i = 0; i < sa * batch; i++) a[i] = (double)((i * 7) % 11) - 5;
        for (int64_t i = 0; i < sb * batch; i++) b[i] = (double)((i * 5) % 13) - 6;
        for (int64_t i = 0; i < sc * batch; i++) c[i] = want[i] = (double)(i % 9) - 4;
        /* Row-major reference: C_b[i][j] = 2 sum_p op(A_b)[i][p] op(B_b)[p][j] + 0.5 C_b[i][j]. */
        for (int64_t bb = 0; bb < batch; bb++)
            for (int64_t i = 0; i < m; i++)
                for (int64_t j = 0; j < n; j++) {
                    double acc = 0;
                    for (int64_t p = 0; p < k; p++)
                        acc += a[bb * sa + (ta ? p * lda + i : i * lda + p)] *
                               b[bb * sb + (tb ? j * ldb + p : p * ldb + j)];
                    double *e = want + bb * sc + i * ldc + j;
                    *e = 2 * acc + 0.5 * *e;
                }
        fsdp_cuda_lt_plan_t pl;
        fsdp__cuda_lt_plan(&pl, sizeof(double), sizeof(double), ta, tb, m, n, k, a, lda, sa, b, ldb,
                           sb, c, ldc, sc, batch);
        int bad = 0;
        lt_reference(&pl, m, n, k, 2.0, 0.5, batch, &bad);
        tap_is_int(bad, 0, "trans_a %d trans_b %d: the plan's shapes cover every index", ta, tb);
        tap_is_mem(c, want, (size_t)(sc * batch) * sizeof *c,
                   "trans_a %d trans_b %d: column-major C^T = op(B)^T op(A)^T over the plan is "
                   "the row-major product (batch 2, padded strides)",
                   ta, tb);
        tap_ok(pl.mat[0].ptr == (uintptr_t)b && pl.mat[1].ptr == (uintptr_t)a,
               "trans_a %d trans_b %d: the library's first operand is B, its second A", ta, tb);
        free(a);
        free(b);
        free(c);
        free(want);
    }
}

static void test_gemm_align(void) {
    /* 256-byte aligned bases: a single matrix is 256-aligned whatever its size. */
    tap_is_uint(fsdp__cuda_lt_align(0x10000, 3, 2, 1), 256, "batch 1: the stride does not count");
    tap_is_uint(fsdp__cuda_lt_align(0x10000, 3, 2, 2), 2, "bf16, batch stride 3: 2-byte aligned");
    tap_is_uint(fsdp__cuda_lt_align(0x10000, 3, 4, 2), 4, "f32, batch stride 3: 4-byte aligned");
    tap_is_uint(fsdp__cuda_lt_align(0x10000, 64, 2, 4), 128, "bf16, batch stride 64: 128 bytes");
    tap_is_uint(fsdp__cuda_lt_align(0x10000, 1024, 2, 4), 256, "capped at 256 bytes");
    tap_is_uint(fsdp__cuda_lt_align(0x10006, 1024, 2, 4), 2, "a view 3 bf16 elements in: 2");
    tap_is_uint(fsdp__cuda_lt_align(0x10008, 0, 8, 3), 8, "an 8-byte offset, shared matrix: 8");
    fsdp_cuda_lt_plan_t pl;
    fsdp__cuda_lt_plan(&pl, 2, 2, false, false, 8, 8, 8, (void *)0x1002, 8, 64, (void *)0x2000, 8,
                       64, (void *)0x3010, 8, 64, 2);
    tap_ok(pl.align[0] == 128 && pl.align[1] == 2 && pl.align[2] == 16,
           "the plan aligns B (%u), A (%u) and C (%u) separately", pl.align[0], pl.align[1],
           pl.align[2]);
    /* gemm_lp with an f32 C: C's batch stride counts in 4-byte elements, the operands' in 2. */
    fsdp__cuda_lt_plan(&pl, 2, 4, false, false, 8, 8, 8, (void *)0x1000, 8, 2, (void *)0x2000, 8, 2,
                       (void *)0x3000, 8, 2, 2);
    tap_ok(pl.align[0] == 4 && pl.align[1] == 4 && pl.align[2] == 8,
           "bf16 operands, f32 C, batch stride 2: B %u, A %u, C %u bytes (want 4, 4, 8)",
           pl.align[0], pl.align[1], pl.align[2]);
}

static void test_create(void) {
    fsdp_ctx_t *ctx = new_ctx();
    fsdp_device_t *dev = (fsdp_device_t *)&dev; /* must be reset to NULL on failure */
    int rc = fsdp_device_create(ctx, FSDP_DEVICE_CUDA, NULL, &dev);
#ifndef FSDP_HAVE_CUDA
    tap_is_int(rc, FSDP_ENOTSUP, "without CUDA, creating a CUDA device is FSDP_ENOTSUP");
    tap_ok(dev == NULL, "and *out is NULL");
    tap_has_str(fsdp_ctx_last_error(ctx), "not built", "the message says it was not built");
#else
    char why[256];
    int count = fsdp__cuda_visible_devices(why, sizeof why);
    tap_diag("CUDA devices visible: %d (%s)", count, why);
    if (count == 0) {
        tap_is_int(rc, FSDP_ENOTSUP, "no GPU: creating a CUDA device is FSDP_ENOTSUP, no crash");
        tap_ok(dev == NULL, "and *out is NULL");
        tap_has_str(fsdp_ctx_last_error(ctx), "no CUDA device is visible",
                    "the message says no device is visible");
        tap_diag("message: %s", fsdp_ctx_last_error(ctx));
        fsdp_device_options_t o;
        fsdp_device_options_init(&o);
        o.ordinal = 1;
        rc = fsdp_device_create(ctx, FSDP_DEVICE_CUDA, &o, &dev);
        tap_is_int(rc, FSDP_ENOTSUP, "ordinal 1 without a GPU: FSDP_ENOTSUP as well");
    } else {
        tap_is_int(rc, 0, "a GPU is visible: the CUDA device is created");
        tap_is_str(fsdp_device_name(dev), "cuda:0", "named cuda:0");
        fsdp_device_destroy(dev);
        fsdp_device_options_t o;
        fsdp_device_options_init(&o);
        o.ordinal = count;
        rc = fsdp_device_create(ctx, FSDP_DEVICE_CUDA, &o, &dev);
        tap_is_int(rc, FSDP_EINVAL, "ordinal %d of %d visible devices is FSDP_EINVAL", count,
                   count);
        tap_has_str(fsdp_ctx_last_error(ctx), "is not a CUDA device", "with a message");
    }
    fsdp_device_options_t neg;
    fsdp_device_options_init(&neg);
    neg.ordinal = -1;
    rc = fsdp_device_create(ctx, FSDP_DEVICE_CUDA, &neg, &dev);
    tap_is_int(rc, FSDP_EINVAL, "a negative ordinal is FSDP_EINVAL");
#endif
    fsdp_ctx_destroy(ctx);
}

int main(void) {
    tap_plan_lazy();
    test_philox();
    test_dropout_layout();
    test_cast();
    test_cast_fast();
    test_gemm_table();
    test_gemm_plan();
    test_gemm_align();
    test_gemm_pad();
    test_create();
    return tap_done();
}
