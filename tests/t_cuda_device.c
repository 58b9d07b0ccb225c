/* SPDX-License-Identifier: MIT */
/*
 * t_cuda_device.c: the CUDA device against the CPU device (make check-gpu).
 *
 * Every kernel of struct fsdp_dev_ops runs on both devices on the same fresh random inputs
 * (the CPU's memory is host memory, so its kernels run on the host copies of the buffers), and
 * the results are compared: f32 within 1e-5 relative (plus a small absolute floor for values
 * near 0), f64 within 1e-12, and bitwise where the contract makes results exact (fill, cast,
 * copies, max, embedding, the dropout mask). The low-precision products (gemm_lp) are compared
 * with the CPU's f32 gemm of the widened values, and an autograd linear on bf16 tensors (native
 * bf16 products on the GPU, widened on the CPU) within 1e-2. Then the allocator's counters,
 * streams and events, pinned host memory and record_stream.
 *
 * Skips where libfsdp was built without CUDA or no CUDA device is visible.
 */
#include <config.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "device/device_impl.h"
#include "tap.h"

#ifdef FSDP_HAVE_CUDA
#include "backends/cuda/cuda_device.h"
#endif

#ifdef FSDP_HAVE_CUDA

static fsdp_device_t *cpu, *gpu;

/* ---- buffers: a host copy (the CPU's operand) and a device copy (the GPU's) ---- */

typedef struct {
    void *h, *d;
    size_t bytes;
} buf_t;

#define MAX_BUFS 64
static buf_t bufs[MAX_BUFS];
static int nbufs;

static uint64_t rs = 0x9E3779B97F4A7C15u;
static double urand(double lo, double hi) {
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return lo + (hi - lo) * (double)(rs >> 11) * 0x1p-53;
}

static buf_t *mk(size_t bytes) {
    if (nbufs == MAX_BUFS) tap_bail("too many buffers");
    buf_t *b = &bufs[nbufs++];
    b->bytes = bytes;
    b->h = calloc(1, bytes ? bytes : 1);
    if (fsdp_device_alloc(gpu, FSDP_MEM_OTHER, bytes, &b->d) < 0)
        tap_bail("device alloc of %zu bytes: %s", bytes, fsdp_ctx_last_error(fsdp_device_ctx(gpu)));
    return b;
}

static void up(buf_t *b) {
    if (fsdp_device_memcpy(gpu, b->d, b->h, b->bytes, FSDP_COPY_H2D, NULL) < 0)
        tap_bail("upload failed");
}

/* The device copy, brought back into a fresh host buffer (freed by release()). */
static void *down(const buf_t *b) {
    if (nbufs == MAX_BUFS) tap_bail("too many buffers");
    buf_t *t = &bufs[nbufs++];
    t->bytes = 0;
    t->d = NULL;
    t->h = malloc(b->bytes ? b->bytes : 1);
    if (fsdp_device_memcpy(gpu, t->h, b->d, b->bytes, FSDP_COPY_D2H, NULL) < 0)
        tap_bail("download failed");
    return t->h;
}

static void release(void) {
    for (int i = 0; i < nbufs; i++) {
        free(bufs[i].h);
        if (bufs[i].d) fsdp_device_free(gpu, bufs[i].d);
    }
    nbufs = 0;
}

static size_t esz(fsdp_dtype_t dt) {
    return fsdp_dtype_size(dt);
}

static void set_f(fsdp_dtype_t dt, void *p, size_t i, double v) {
    if (dt == FSDP_DTYPE_F64)
        ((double *)p)[i] = v;
    else
        ((float *)p)[i] = (float)v;
}

static double get_f(fsdp_dtype_t dt, const void *p, size_t i) {
    return dt == FSDP_DTYPE_F64 ? ((const double *)p)[i] : (double)((const float *)p)[i];
}

/* n random floats of dt in [lo, hi), uploaded. */
static buf_t *rnd(fsdp_dtype_t dt, size_t n, double lo, double hi) {
    buf_t *b = mk(n * esz(dt));
    for (size_t i = 0; i < n; i++)
        set_f(dt, b->h, i, urand(lo, hi));
    up(b);
    return b;
}

static buf_t *zeros(size_t bytes) {
    buf_t *b = mk(bytes);
    up(b);
    return b;
}

static buf_t *idx_buf(size_t n, int64_t lo, int64_t hi) {
    buf_t *b = mk(n * sizeof(int64_t));
    for (size_t i = 0; i < n; i++)
        ((int64_t *)b->h)[i] = lo + (int64_t)urand(0, (double)(hi - lo));
    up(b);
    return b;
}

static const char *dn(fsdp_dtype_t dt) {
    return fsdp_dtype_name(dt);
}

/* The device copy of b against its host copy (the CPU's result), n elements of float type dt. */
static int near(const char *what, fsdp_dtype_t dt, const buf_t *b, size_t n, double atol_f32) {
    const double rtol = dt == FSDP_DTYPE_F64 ? 1e-12 : 1e-5;
    const double atol = dt == FSDP_DTYPE_F64 ? 1e-13 : atol_f32;
    const void *g = down(b);
    size_t bad = 0, worst = 0;
    double werr = 0;
    for (size_t i = 0; i < n; i++) {
        double x = get_f(dt, g, i), y = get_f(dt, b->h, i);
        if (isnan(x) && isnan(y)) continue;
        double err = fabs(x - y);
        if (!(err <= atol + rtol * fabs(y))) {
            if (!bad || err > werr) {
                werr = err;
                worst = i;
            }
            bad++;
        }
    }
    if (bad)
        tap_diag("%s: %zu of %zu differ; worst at %zu: cuda %.17g cpu %.17g", what, bad, n, worst,
                 get_f(dt, g, worst), get_f(dt, b->h, worst));
    return tap_ok(bad == 0, "%s %s: %zu values match the CPU", what, dn(dt), n);
}

static int same_bits(const char *what, const buf_t *b) {
    const void *g = down(b);
    return tap_ok(memcmp(g, b->h, b->bytes) == 0, "%s: %zu bytes equal the CPU's bitwise", what,
                  b->bytes);
}

static const fsdp_dtype_t FT[2] = {FSDP_DTYPE_F32, FSDP_DTYPE_F64};

#define BOTH(call_cpu, call_gpu, what)                                                             \
    do {                                                                                           \
        int rc_c = (call_cpu), rc_g = (call_gpu);                                                  \
        if (rc_c != 0 || rc_g != 0)                                                                \
            tap_diag("%s: cpu rc %d, cuda rc %d (%s)", what, rc_c, rc_g,                           \
                     fsdp_ctx_last_error(fsdp_device_ctx(gpu)));                                   \
    } while (0)

/* ---- elementwise ---- */

static void test_fill_cast(void) {
    for (int t = 0; t < FSDP_DTYPE_COUNT; t++) {
        const size_t n = 1001;
        buf_t *b = zeros(n * esz((fsdp_dtype_t)t));
        const double v = -3.3;
        BOTH(cpu->ops->fill(cpu, t, n, v, b->h), gpu->ops->fill(gpu, t, n, v, b->d), "fill");
        char w[64];
        snprintf(w, sizeof w, "fill %s", dn(t));
        same_bits(w, b);
    }
    release();
    /* Every pair of dtypes, from values valid in the source (specials included for floats). */
    const size_t n = 4096;
    for (int xt = 0; xt < FSDP_DTYPE_COUNT; xt++) {
        double *vals = malloc(n * sizeof *vals);
        for (size_t i = 0; i < n; i++) {
            double v = urand(-70000, 70000);
            if (i % 7 == 0) v = urand(-3, 3);
            if (i % 11 == 0) v = urand(-1e-6, 1e-6);
            if (i % 13 == 0) v = ldexp(urand(0.5, 1), -(int)urand(14, 30)); /* f16 subnormals */
            vals[i] = v;
        }
        vals[0] = INFINITY;
        vals[1] = -INFINITY;
        vals[2] = NAN;
        vals[3] = 65519.99;
        vals[4] = 65520.0;
        vals[5] = 300.5;
        buf_t *x = mk(n * esz(xt));
        if (fsdp_dtype_convert(x->h, xt, vals, FSDP_DTYPE_F64, n) < 0) tap_bail("convert");
        up(x);
        free(vals);
        for (int yt = 0; yt < FSDP_DTYPE_COUNT; yt++) {
            buf_t *y = zeros(n * esz(yt));
            BOTH(cpu->ops->cast(cpu, yt, y->h, xt, x->h, n),
                 gpu->ops->cast(gpu, yt, y->d, xt, x->d, n), "cast");
            char w[64];
            snprintf(w, sizeof w, "cast %s -> %s", dn(xt), dn(yt));
            same_bits(w, y);
        }
        release();
    }
}

static void test_copy_strided(void) {
    const fsdp_dtype_t dts[] = {FSDP_DTYPE_F32, FSDP_DTYPE_F64, FSDP_DTYPE_F16, FSDP_DTYPE_I64,
                                FSDP_DTYPE_U8};
    for (size_t k = 0; k < sizeof dts / sizeof dts[0]; k++) {
        fsdp_dtype_t dt = dts[k];
        /* x is (5, 7, 9) contiguous; y = x.permute(2, 0, 1) sliced and a broadcast dim. */
        const size_t nx = 5 * 7 * 9;
        buf_t *x = mk(nx * esz(dt));
        for (size_t i = 0; i < nx * esz(dt); i++)
            ((unsigned char *)x->h)[i] = (unsigned char)urand(0, 256);
        up(x);
        const int64_t shape[4] = {9, 5, 3, 4};
        const int64_t st[4] = {1, 63, 9 * 2, 0}; /* x[i1, 2 i2, i0], broadcast over i3 */
        size_t ny = 9 * 5 * 3 * 4;
        buf_t *y = zeros(ny * esz(dt));
        BOTH(cpu->ops->copy_strided(cpu, dt, 4, shape, y->h, x->h, st),
             gpu->ops->copy_strided(gpu, dt, 4, shape, y->d, x->d, st), "copy_strided");
        char w[64];
        snprintf(w, sizeof w, "copy_strided %s (permute, slice, broadcast)", dn(dt));
        same_bits(w, y);
        release();
    }
}

static void test_unary(void) {
    for (int k = 0; k < 2; k++) {
        fsdp_dtype_t dt = FT[k];
        const size_t n = 3000;
        for (int op = 0; op < FSDP_UNARY_COUNT; op++) {
            bool pos = op == FSDP_UNARY_LOG || op == FSDP_UNARY_SQRT || op == FSDP_UNARY_RSQRT ||
                       op == FSDP_UNARY_POW;
            double alpha = op == FSDP_UNARY_POW ? 1.7 : 0.75;
            buf_t *x = rnd(dt, n, pos ? 0.25 : -3, 3), *y = zeros(n * esz(dt));
            BOTH(cpu->ops->unary(cpu, dt, op, n, alpha, x->h, y->h),
                 gpu->ops->unary(gpu, dt, op, n, alpha, x->d, y->d), "unary");
            char w[64];
            snprintf(w, sizeof w, "unary op %d", op);
            near(w, dt, y, n, 1e-6);
            /* Backward, from x (y NULL) and with the forward output. */
            buf_t *gy = rnd(dt, n, -1, 1), *gx = zeros(n * esz(dt)), *gx2 = zeros(n * esz(dt));
            BOTH(cpu->ops->unary_backward(cpu, dt, op, n, alpha, x->h, NULL, gy->h, gx->h),
                 gpu->ops->unary_backward(gpu, dt, op, n, alpha, x->d, NULL, gy->d, gx->d),
                 "unary_backward");
            snprintf(w, sizeof w, "unary_backward op %d from x", op);
            near(w, dt, gx, n, 1e-6);
            BOTH(cpu->ops->unary_backward(cpu, dt, op, n, alpha, x->h, y->h, gy->h, gx2->h),
                 gpu->ops->unary_backward(gpu, dt, op, n, alpha, x->d, y->d, gy->d, gx2->d),
                 "unary_backward");
            snprintf(w, sizeof w, "unary_backward op %d with y", op);
            near(w, dt, gx2, n, 1e-6);
            release();
        }
    }
}

static void test_binary_axpy_where(void) {
    for (int k = 0; k < 2; k++) {
        fsdp_dtype_t dt = FT[k];
        /* y (4, 6, 8) = a (4, 6, 8) op b (6, 1) broadcast, and a scalar-broadcast case. */
        const int64_t shape[3] = {4, 6, 8};
        const int64_t as[3] = {48, 8, 1}, bs[3] = {0, 1, 0}, ss[3] = {0, 0, 0};
        const size_t n = 4 * 6 * 8;
        for (int op = 0; op < FSDP_BINARY_COUNT; op++) {
            buf_t *a = rnd(dt, n, -2, 2), *b = rnd(dt, 6, 0.5, 2), *y = zeros(n * esz(dt));
            buf_t *y2 = zeros(n * esz(dt));
            BOTH(cpu->ops->binary(cpu, dt, op, 3, shape, y->h, a->h, as, b->h, bs),
                 gpu->ops->binary(gpu, dt, op, 3, shape, y->d, a->d, as, b->d, bs), "binary");
            char w[64];
            snprintf(w, sizeof w, "binary op %d (row broadcast)", op);
            near(w, dt, y, n, 1e-6);
            BOTH(cpu->ops->binary(cpu, dt, op, 3, shape, y2->h, b->h, ss, a->h, as),
                 gpu->ops->binary(gpu, dt, op, 3, shape, y2->d, b->d, ss, a->d, as), "binary");
            snprintf(w, sizeof w, "binary op %d (scalar first operand)", op);
            near(w, dt, y2, n, 1e-6);
            release();
        }
        const size_t m = 5000;
        buf_t *x = rnd(dt, m, -1, 1), *y = rnd(dt, m, -1, 1);
        BOTH(cpu->ops->axpy(cpu, dt, m, -0.37, x->h, y->h),
             gpu->ops->axpy(gpu, dt, m, -0.37, x->d, y->d), "axpy");
        near("axpy", dt, y, m, 1e-6);
        /* where selects, so it is exact: its b is drawn afresh (axpy's y differs between the
         * two devices in the last bits, by the GPU's fused multiply-add). */
        buf_t *c = mk(m), *b = rnd(dt, m, -1, 1);
        for (size_t i = 0; i < m; i++)
            ((uint8_t *)c->h)[i] = urand(0, 1) < 0.4;
        up(c);
        for (int v = 0; v < 4; v++) {
            buf_t *out = zeros(m * esz(dt));
            const void *ah = v & 1 ? NULL : x->h, *bh = v & 2 ? NULL : b->h;
            const void *ad = v & 1 ? NULL : x->d, *bd = v & 2 ? NULL : b->d;
            BOTH(cpu->ops->where(cpu, dt, m, c->h, ah, 1.5, bh, -2.5, out->h),
                 gpu->ops->where(gpu, dt, m, c->d, ad, 1.5, bd, -2.5, out->d), "where");
            char w[64];
            snprintf(w, sizeof w, "where (a %s, b %s)", v & 1 ? "scalar" : "tensor",
                     v & 2 ? "scalar" : "tensor");
            near(w, dt, out, m, 0);
        }
        release();
    }
}

/* ---- reductions, gemm ---- */

static void test_reductions(void) {
    for (int k = 0; k < 2; k++) {
        fsdp_dtype_t dt = FT[k];
        const size_t shapes[][3] = {{7, 1000, 1}, {3, 50, 33}, {1, 30000, 1}, {64, 3, 1}};
        for (size_t s = 0; s < 4; s++) {
            size_t o = shapes[s][0], r = shapes[s][1], in = shapes[s][2];
            buf_t *x = rnd(dt, o * r * in, 0.5, 1.5), *y = zeros(o * in * esz(dt));
            buf_t *mx = zeros(o * in * esz(dt)), *ix = zeros(o * in * 8);
            /* A repeated maximum: the first index must win on both devices. */
            set_f(dt, x->h, 0, 9.0);
            set_f(dt, x->h, in * (r - 1), 9.0);
            up(x);
            BOTH(cpu->ops->reduce_sum(cpu, dt, o, r, in, 0.5, x->h, y->h),
                 gpu->ops->reduce_sum(gpu, dt, o, r, in, 0.5, x->d, y->d), "reduce_sum");
            char w[80];
            snprintf(w, sizeof w, "reduce_sum (%zu, %zu, %zu)", o, r, in);
            near(w, dt, y, o * in, 1e-6);
            BOTH(cpu->ops->reduce_max(cpu, dt, o, r, in, x->h, mx->h, ix->h),
                 gpu->ops->reduce_max(gpu, dt, o, r, in, x->d, mx->d, ix->d), "reduce_max");
            snprintf(w, sizeof w, "reduce_max (%zu, %zu, %zu) values", o, r, in);
            same_bits(w, mx);
            snprintf(w, sizeof w, "reduce_max (%zu, %zu, %zu) argmax", o, r, in);
            same_bits(w, ix);
            release();
        }
        const size_t n = 1000003;
        buf_t *x = rnd(dt, n, -1, 1), *out = zeros(esz(dt));
        BOTH(cpu->ops->sum_squares(cpu, dt, n, x->h, out->h),
             gpu->ops->sum_squares(gpu, dt, n, x->d, out->d), "sum_squares");
        near("sum_squares", dt, out, 1, 0);
        release();
    }
}

static void test_gemm(void) {
    for (int k = 0; k < 2; k++) {
        fsdp_dtype_t dt = FT[k];
        for (int t = 0; t < 4; t++) {
            bool ta = t & 1, tb = t & 2;
            const int64_t m = 37, n = 29, kk = 64, batch = 3;
            const int64_t lda = (ta ? m : kk) + 3, ldb = (tb ? kk : n) + 1, ldc = n + 2;
            const int64_t sa = (ta ? kk : m) * lda, sb = (tb ? n : kk) * ldb, sc = m * ldc + 5;
            buf_t *a = rnd(dt, (size_t)(sa * batch), 0.5, 1.5);
            buf_t *b = rnd(dt, (size_t)(sb * batch), 0.5, 1.5);
            buf_t *c = rnd(dt, (size_t)(sc * batch), -1, 1);
            BOTH(cpu->ops->gemm(cpu, dt, ta, tb, m, n, kk, 0.7, a->h, lda, sa, b->h, ldb, sb, 0.3,
                                c->h, ldc, sc, batch),
                 gpu->ops->gemm(gpu, dt, ta, tb, m, n, kk, 0.7, a->d, lda, sa, b->d, ldb, sb, 0.3,
                                c->d, ldc, sc, batch),
                 "gemm");
            char w[64];
            snprintf(w, sizeof w, "gemm trans_a %d trans_b %d, batch 3, beta 0.3", ta, tb);
            near(w, dt, c, (size_t)(sc * batch), 1e-5);
            release();
        }
        /* k = 0: C = beta C, and beta = 0 overwrites NaN. */
        buf_t *c = rnd(dt, 12, -1, 1);
        set_f(dt, c->h, 3, NAN);
        up(c);
        BOTH(cpu->ops->gemm(cpu, dt, false, false, 3, 4, 0, 1.0, NULL, 1, 0, NULL, 4, 0, 0.0, c->h,
                            4, 0, 1),
             gpu->ops->gemm(gpu, dt, false, false, 3, 4, 0, 1.0, NULL, 1, 0, NULL, 4, 0, 0.0, c->d,
                            4, 0, 1),
             "gemm k=0");
        same_bits("gemm with k = 0 and beta 0 (NaN overwritten)", c);
        release();
    }
}

/* bf16 and f16 GEMMs (cuBLASLt, f32 accumulation) against the CPU's f32 GEMM of the same
 * half-precision values, rounded once to the half type: within 1e-2 relative (bf16 has 8
 * significant bits; the accumulation order differs). */
static void test_gemm_half(void) {
    static const fsdp_dtype_t HT[2] = {FSDP_DTYPE_BF16, FSDP_DTYPE_F16};
    for (int h = 0; h < 2; h++) {
        fsdp_dtype_t dt = HT[h];
        for (int t = 0; t < 4; t++) {
            bool ta = t & 1, tb = t & 2;
            const int64_t m = 37, n = 29, kk = 64, batch = 3;
            const int64_t lda = (ta ? m : kk) + 3, ldb = (tb ? kk : n) + 1, ldc = n + 2;
            const int64_t sa = (ta ? kk : m) * lda, sb = (tb ? n : kk) * ldb, sc = m * ldc + 5;
            const size_t na = (size_t)(sa * batch), nb = (size_t)(sb * batch),
                         nc = (size_t)(sc * batch);
            /* f32 values exactly representable in dt: random, rounded through dt. */
            buf_t *a32 = rnd(FSDP_DTYPE_F32, na, 0.5, 1.5);
            buf_t *b32 = rnd(FSDP_DTYPE_F32, nb, 0.5, 1.5);
            buf_t *c32 = rnd(FSDP_DTYPE_F32, nc, -1, 1);
            buf_t *a = mk(na * 2), *b = mk(nb * 2), *c = mk(nc * 2);
            fsdp_dtype_convert(a->h, dt, a32->h, FSDP_DTYPE_F32, na);
            fsdp_dtype_convert(b->h, dt, b32->h, FSDP_DTYPE_F32, nb);
            fsdp_dtype_convert(c->h, dt, c32->h, FSDP_DTYPE_F32, nc);
            fsdp_dtype_convert(a32->h, FSDP_DTYPE_F32, a->h, dt, na);
            fsdp_dtype_convert(b32->h, FSDP_DTYPE_F32, b->h, dt, nb);
            fsdp_dtype_convert(c32->h, FSDP_DTYPE_F32, c->h, dt, nc);
            up(a);
            up(b);
            up(c);
            BOTH(cpu->ops->gemm(cpu, FSDP_DTYPE_F32, ta, tb, m, n, kk, 0.7, a32->h, lda, sa, b32->h,
                                ldb, sb, 0.3, c32->h, ldc, sc, batch),
                 gpu->ops->gemm(gpu, dt, ta, tb, m, n, kk, 0.7, a->d, lda, sa, b->d, ldb, sb, 0.3,
                                c->d, ldc, sc, batch),
                 "half gemm");
            const void *g = down(c);
            size_t bad = 0;
            for (size_t i = 0; i < nc; i++) {
                float got, want;
                fsdp_dtype_convert(&got, FSDP_DTYPE_F32, (const char *)g + 2 * i, dt, 1);
                uint16_t r;
                fsdp_dtype_convert(&r, dt, (const float *)c32->h + i, FSDP_DTYPE_F32, 1);
                fsdp_dtype_convert(&want, FSDP_DTYPE_F32, &r, dt, 1);
                if (!(fabs((double)got - want) <= 1e-2 * fabs((double)want) + 1e-3)) bad++;
            }
            tap_is_size(bad, 0, "%s gemm trans_a %d trans_b %d, batch 3, beta 0.3: within 1e-2 "
                        "of the CPU's f32 gemm of the same values", dn(dt), ta, tb);
            release();
        }
        /* k = 0: C = beta C in the half type; beta = 0 overwrites NaN. */
        uint16_t hv[12], want[12];
        for (int i = 0; i < 12; i++) {
            float f = i == 3 ? NAN : (float)(i - 6) * 0.375f, w = i == 3 ? NAN : f * 0.5f;
            fsdp_dtype_convert(&hv[i], dt, &f, FSDP_DTYPE_F32, 1);
            fsdp_dtype_convert(&want[i], dt, &w, FSDP_DTYPE_F32, 1);
        }
        for (int beta0 = 0; beta0 < 2; beta0++) {
            buf_t *c = mk(sizeof hv);
            memcpy(c->h, hv, sizeof hv);
            up(c);
            int rc = gpu->ops->gemm(gpu, dt, false, false, 3, 4, 0, 1.0, NULL, 1, 0, NULL, 4, 0,
                                    beta0 ? 0.0 : 0.5, c->d, 4, 0, 1);
            const uint16_t *g = down(c);
            bool ok = rc == 0;
            for (int i = 0; i < 12; i++) {
                float f;
                fsdp_dtype_convert(&f, FSDP_DTYPE_F32, &g[i], dt, 1);
                if (beta0)
                    ok = ok && g[i] == 0;
                else
                    ok = ok && (i == 3 ? isnan(f) : g[i] == want[i]);
            }
            tap_ok(ok, "%s gemm with k = 0 and beta %s", dn(dt),
                   beta0 ? "0 writes zeros over NaN" : "0.5 scales C (rounded once)");
            release();
        }
    }
    /* Integers have no GEMM on either device. */
    buf_t *c = zeros(64);
    int rc = gpu->ops->gemm(gpu, FSDP_DTYPE_I32, false, false, 2, 2, 2, 1.0, c->d, 2, 0, c->d, 2,
                            0, 0.0, c->d, 2, 0, 1);
    tap_is_int(rc, FSDP_ENOTSUP, "an i32 gemm is FSDP_ENOTSUP");
    tap_has_str(fsdp_ctx_last_error(fsdp_device_ctx(gpu)), "dtype i32", "naming the dtype");
    release();
}

/* gemm_lp: the CUDA device claims bf16 and f16, and its products of those operands into an f32
 * C match the CPU's f32 gemm of the same (exactly widened) values; into their own dtype they are
 * the f32 result rounded once. */
static void test_gemm_lp(void) {
    static const fsdp_dtype_t HT[2] = {FSDP_DTYPE_BF16, FSDP_DTYPE_F16};
    tap_ok(fsdp__device_gemm_native(gpu, FSDP_DTYPE_BF16) &&
               fsdp__device_gemm_native(gpu, FSDP_DTYPE_F16) &&
               !fsdp__device_gemm_native(cpu, FSDP_DTYPE_BF16),
           "the CUDA device multiplies bf16 and f16 natively, the CPU device neither");
    for (int h = 0; h < 2; h++) {
        fsdp_dtype_t dt = HT[h];
        for (int t = 0; t < 4; t++) {
            bool ta = t & 1, tb = t & 2;
            const int64_t m = 37, n = 29, kk = 64, batch = 3;
            const int64_t lda = ta ? m : kk, ldb = tb ? kk : n, ldc = n;
            const int64_t sa = m * kk, sb = kk * n, sc = m * n;
            const size_t na = (size_t)(sa * batch), nb = (size_t)(sb * batch),
                         nc = (size_t)(sc * batch);
            buf_t *a32 = rnd(FSDP_DTYPE_F32, na, 0.5, 1.5);
            buf_t *b32 = rnd(FSDP_DTYPE_F32, nb, 0.5, 1.5);
            buf_t *c32 = rnd(FSDP_DTYPE_F32, nc, -1, 1);
            buf_t *a = mk(na * 2), *b = mk(nb * 2), *c = mk(nc * 4);
            fsdp_dtype_convert(a->h, dt, a32->h, FSDP_DTYPE_F32, na);
            fsdp_dtype_convert(b->h, dt, b32->h, FSDP_DTYPE_F32, nb);
            fsdp_dtype_convert(a32->h, FSDP_DTYPE_F32, a->h, dt, na);
            fsdp_dtype_convert(b32->h, FSDP_DTYPE_F32, b->h, dt, nb);
            memcpy(c->h, c32->h, nc * 4);
            up(a);
            up(b);
            up(c);
            BOTH(cpu->ops->gemm(cpu, FSDP_DTYPE_F32, ta, tb, m, n, kk, 0.7, a32->h, lda, sa, b32->h,
                                ldb, sb, 0.3, c32->h, ldc, sc, batch),
                 gpu->ops->gemm_lp(gpu, dt, FSDP_DTYPE_F32, ta, tb, m, n, kk, 0.7, a->d, lda, sa,
                                   b->d, ldb, sb, 0.3, c->d, ldc, sc, batch),
                 "gemm_lp into f32");
            const float *g = down(c);
            size_t bad = 0;
            for (size_t i = 0; i < nc; i++) {
                float want = ((const float *)c32->h)[i];
                if (!(fabs((double)g[i] - want) <= 1e-4 * fabs((double)want) + 1e-4)) bad++;
            }
            tap_is_size(bad, 0,
                        "gemm_lp %s into f32, trans_a %d trans_b %d, batch 3, beta 0.3: within "
                        "1e-4 of the CPU's f32 gemm of the same values",
                        dn(dt), ta, tb);
            release();
        }
    }
    buf_t *c = zeros(64);
    int rc = gpu->ops->gemm_lp(gpu, FSDP_DTYPE_BF16, FSDP_DTYPE_F16, false, false, 2, 2, 2, 1.0,
                               c->d, 2, 0, c->d, 2, 0, 0.0, c->d, 2, 0, 1);
    tap_is_int(rc, FSDP_ENOTSUP, "gemm_lp of bf16 into f16 is FSDP_ENOTSUP");
    release();
}

/* gemm_lp calls of bf16 operands seen on the GPU during the linear below (gpu_counting wraps
 * the CUDA device's table), and gemm calls of any dtype. */
static int lp_bf16_calls, plain_calls;
static struct fsdp_dev_ops gpu_counting;
static const struct fsdp_dev_ops *gpu_real;

static int count_gemm_lp(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_dtype_t ct, bool ta, bool tb,
                         int64_t m, int64_t n, int64_t k, double alpha, const void *a, int64_t lda,
                         int64_t sa, const void *b, int64_t ldb, int64_t sb, double beta, void *c,
                         int64_t ldc, int64_t sc, int64_t batch) {
    if (dt == FSDP_DTYPE_BF16) lp_bf16_calls++;
    return gpu_real->gemm_lp(dev, dt, ct, ta, tb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, c,
                             ldc, sc, batch);
}

static int count_gemm(fsdp_device_t *dev, fsdp_dtype_t dt, bool ta, bool tb, int64_t m, int64_t n,
                      int64_t k, double alpha, const void *a, int64_t lda, int64_t sa,
                      const void *b, int64_t ldb, int64_t sb, double beta, void *c, int64_t ldc,
                      int64_t sc, int64_t batch) {
    plain_calls++;
    return gpu_real->gemm(dev, dt, ta, tb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, c, ldc, sc,
                          batch);
}

/* An autograd linear on bf16 tensors of the CUDA device (the native bf16 products) against the
 * same linear on the CPU device (widened to f32): output and gradients within 1e-2. */
static int lin_run(fsdp_ctx_t *ctx, fsdp_device_t *dev, const uint16_t *xv, const uint16_t *wv,
                   const uint16_t *bv, const uint16_t *gv, float *out) {
    const int64_t xs[3] = {4, 8, 32}, ws[2] = {16, 32}, bs[1] = {16}, ys[3] = {4, 8, 16};
    fsdp_tensor_t *x = NULL, *w = NULL, *b = NULL, *gy = NULL, *y = NULL;
    const fsdp_dtype_t bf = FSDP_DTYPE_BF16;
    int rc = fsdp_ctx_set_device(ctx, dev);
    if (rc == 0) rc = fsdp_tensor_from_host(ctx, bf, 3, xs, xv, FSDP_MEM_ACTIVATIONS, &x);
    if (rc == 0) rc = fsdp_tensor_from_host(ctx, bf, 2, ws, wv, FSDP_MEM_PARAMS, &w);
    if (rc == 0) rc = fsdp_tensor_from_host(ctx, bf, 1, bs, bv, FSDP_MEM_PARAMS, &b);
    if (rc == 0) rc = fsdp_tensor_from_host(ctx, bf, 3, ys, gv, FSDP_MEM_GRADS, &gy);
    if (rc == 0) rc = fsdp_tensor_set_requires_grad(x, true);
    if (rc == 0) rc = fsdp_tensor_set_requires_grad(w, true);
    if (rc == 0) rc = fsdp_tensor_set_requires_grad(b, true);
    if (rc == 0) rc = fsdp_linear(x, w, b, &y);
    if (rc == 0) rc = fsdp_backward(y, gy);
    /* y (512), then the gradients of x (1024), w (512) and b (16), as f32. */
    const fsdp_tensor_t *res[4] = {y, x ? fsdp_tensor_grad(x) : NULL,
                                   w ? fsdp_tensor_grad(w) : NULL, b ? fsdp_tensor_grad(b) : NULL};
    const size_t cnt[4] = {512, 1024, 512, 16};
    uint16_t tmp[1024];
    size_t at = 0;
    for (int i = 0; i < 4 && rc == 0; i++) {
        if (!res[i] || fsdp_tensor_dtype(res[i]) != bf) {
            rc = FSDP_EINTERNAL;
            break;
        }
        rc = fsdp_tensor_to_host(res[i], tmp, cnt[i] * 2);
        if (rc == 0) rc = fsdp_dtype_convert(out + at, FSDP_DTYPE_F32, tmp, bf, cnt[i]);
        at += cnt[i];
    }
    if (rc < 0) tap_diag("linear on %s: %s", fsdp_device_name(dev), fsdp_ctx_last_error(ctx));
    fsdp_tensor_release(y);
    fsdp_tensor_release(gy);
    fsdp_tensor_release(b);
    fsdp_tensor_release(w);
    fsdp_tensor_release(x);
    fsdp_tape_clear(ctx);
    fsdp_ctx_set_device(ctx, NULL);
    return rc;
}

static void test_linear_bf16(fsdp_ctx_t *ctx) {
    static uint16_t xv[1024], wv[512], bv[16], gv[512];
    static float on_cpu[2064], on_gpu[2064];
    float f;
    for (int i = 0; i < 1024; i++) {
        f = (float)urand(-1, 1);
        fsdp_dtype_convert(&xv[i], FSDP_DTYPE_BF16, &f, FSDP_DTYPE_F32, 1);
    }
    for (int i = 0; i < 512; i++) {
        f = (float)urand(-1, 1);
        fsdp_dtype_convert(&wv[i], FSDP_DTYPE_BF16, &f, FSDP_DTYPE_F32, 1);
        f = (float)urand(-1, 1);
        fsdp_dtype_convert(&gv[i], FSDP_DTYPE_BF16, &f, FSDP_DTYPE_F32, 1);
    }
    for (int i = 0; i < 16; i++) {
        f = (float)urand(-1, 1);
        fsdp_dtype_convert(&bv[i], FSDP_DTYPE_BF16, &f, FSDP_DTYPE_F32, 1);
    }
    int rc_c = lin_run(ctx, cpu, xv, wv, bv, gv, on_cpu);
    gpu_real = gpu->ops;
    gpu_counting = *gpu_real;
    gpu_counting.gemm_lp = count_gemm_lp;
    gpu_counting.gemm = count_gemm;
    gpu->ops = &gpu_counting;
    lp_bf16_calls = plain_calls = 0;
    int rc_g = lin_run(ctx, gpu, xv, wv, bv, gv, on_gpu);
    gpu->ops = gpu_real;
    /* Forward, grad of x, grad of w and the bias gradient (a ones-row product). */
    tap_ok(lp_bf16_calls == 4 && plain_calls == 0,
           "the GPU linear made %d bf16 gemm_lp calls (want 4) and %d f32 gemm calls (want 0)",
           lp_bf16_calls, plain_calls);
    if (!tap_ok(rc_c == 0 && rc_g == 0,
                "bf16 autograd linear runs on the CPU (rc %d) and the GPU "
                "(rc %d)",
                rc_c, rc_g))
        return;
    static const char *const names[4] = {"output", "grad of x", "grad of w", "grad of b"};
    const size_t off[5] = {0, 512, 1536, 2048, 2064};
    for (int t = 0; t < 4; t++) {
        double scale = 0;
        for (size_t i = off[t]; i < off[t + 1]; i++)
            scale = fabs(on_cpu[i]) > scale ? fabs(on_cpu[i]) : scale;
        size_t bad = 0, first = 0;
        for (size_t i = off[t]; i < off[t + 1]; i++)
            if (!(fabs((double)on_gpu[i] - on_cpu[i]) <= 1e-2 * fabs(on_cpu[i]) + 1e-3 * scale)) {
                if (!bad) first = i;
                bad++;
            }
        if (bad)
            tap_diag("first mismatch at %zu: GPU %g, CPU %g", first - off[t], on_gpu[first],
                     on_cpu[first]);
        tap_is_size(bad, 0,
                    "bf16 autograd linear (x 4x8x32, w 16x32, bias): the GPU's %s is "
                    "within 1e-2 of the CPU's",
                    names[t]);
    }
}

/* ---- nn kernels ---- */

static void test_softmax_norms(void) {
    for (int k = 0; k < 2; k++) {
        fsdp_dtype_t dt = FT[k];
        const size_t rows = 33, n = 1000;
        for (int lg = 0; lg < 2; lg++) {
            buf_t *x = rnd(dt, rows * n, -5, 5), *y = zeros(rows * n * esz(dt));
            buf_t *gy = rnd(dt, rows * n, -1, 1), *gx = zeros(rows * n * esz(dt));
            BOTH(cpu->ops->softmax(cpu, dt, lg, rows, n, x->h, y->h),
                 gpu->ops->softmax(gpu, dt, lg, rows, n, x->d, y->d), "softmax");
            near(lg ? "log_softmax" : "softmax", dt, y, rows * n, 1e-7);
            up(y); /* the backward of both devices starts from the CPU's forward output */
            BOTH(cpu->ops->softmax_backward(cpu, dt, lg, rows, n, y->h, gy->h, gx->h),
                 gpu->ops->softmax_backward(gpu, dt, lg, rows, n, y->d, gy->d, gx->d),
                 "softmax_backward");
            near(lg ? "log_softmax backward" : "softmax backward", dt, gx, rows * n, 1e-6);
            release();
        }
        const size_t r2 = 40, n2 = 777;
        for (int wb = 0; wb < 2; wb++) {
            buf_t *x = rnd(dt, r2 * n2, -2, 3), *w = rnd(dt, n2, 0.5, 1.5), *b = rnd(dt, n2, -1, 1);
            buf_t *y = zeros(r2 * n2 * esz(dt)), *mean = zeros(r2 * esz(dt)),
                  *rstd = zeros(r2 * esz(dt));
            const void *wh = wb ? w->h : NULL, *bh = wb ? b->h : NULL;
            const void *wd = wb ? w->d : NULL, *bd = wb ? b->d : NULL;
            BOTH(cpu->ops->layer_norm(cpu, dt, r2, n2, 1e-5, x->h, wh, bh, y->h, mean->h, rstd->h),
                 gpu->ops->layer_norm(gpu, dt, r2, n2, 1e-5, x->d, wd, bd, y->d, mean->d, rstd->d),
                 "layer_norm");
            near(wb ? "layer_norm (w, b)" : "layer_norm (no w, b)", dt, y, r2 * n2, 1e-5);
            near("layer_norm mean", dt, mean, r2, 1e-6);
            near("layer_norm rstd", dt, rstd, r2, 1e-6);
            buf_t *gy = rnd(dt, r2 * n2, -1, 1), *gx = zeros(r2 * n2 * esz(dt));
            buf_t *gw = rnd(dt, n2, -1, 1), *gb = rnd(dt, n2, -1, 1);
            /* The GPU gets the CPU's statistics so the backward is compared on equal inputs. */
            up(mean);
            up(rstd);
            BOTH(cpu->ops->layer_norm_backward(cpu, dt, r2, n2, x->h, wh, mean->h, rstd->h, gy->h,
                                               gx->h, gw->h, gb->h),
                 gpu->ops->layer_norm_backward(gpu, dt, r2, n2, x->d, wd, mean->d, rstd->d, gy->d,
                                               gx->d, gw->d, gb->d),
                 "layer_norm_backward");
            near("layer_norm backward gx", dt, gx, r2 * n2, 1e-5);
            near("layer_norm backward gw (accumulated)", dt, gw, n2, 1e-5);
            near("layer_norm backward gb (accumulated)", dt, gb, n2, 1e-5);
            release();
        }
        const size_t nb = 6, c = 5, l = 37;
        for (int train = 0; train < 2; train++) {
            buf_t *x = rnd(dt, nb * c * l, -2, 3), *w = rnd(dt, c, 0.5, 1.5),
                  *b = rnd(dt, c, -1, 1);
            buf_t *rm = rnd(dt, c, -0.5, 0.5), *rv = rnd(dt, c, 0.5, 2);
            buf_t *y = zeros(nb * c * l * esz(dt)), *mean = zeros(c * esz(dt)),
                  *rstd = zeros(c * esz(dt));
            BOTH(cpu->ops->batch_norm(cpu, dt, train, nb, c, l, 1e-5, 0.1, x->h, w->h, b->h, rm->h,
                                      rv->h, y->h, mean->h, rstd->h),
                 gpu->ops->batch_norm(gpu, dt, train, nb, c, l, 1e-5, 0.1, x->d, w->d, b->d, rm->d,
                                      rv->d, y->d, mean->d, rstd->d),
                 "batch_norm");
            near(train ? "batch_norm train y" : "batch_norm eval y", dt, y, nb * c * l, 1e-5);
            near("batch_norm running mean", dt, rm, c, 1e-6);
            near("batch_norm running var", dt, rv, c, 1e-6);
            near("batch_norm rstd", dt, rstd, c, 1e-6);
            up(mean);
            up(rstd);
            buf_t *gy = rnd(dt, nb * c * l, -1, 1), *gx = zeros(nb * c * l * esz(dt));
            buf_t *gw = rnd(dt, c, -1, 1), *gb = rnd(dt, c, -1, 1);
            BOTH(cpu->ops->batch_norm_backward(cpu, dt, train, nb, c, l, x->h, w->h, mean->h,
                                               rstd->h, gy->h, gx->h, gw->h, gb->h),
                 gpu->ops->batch_norm_backward(gpu, dt, train, nb, c, l, x->d, w->d, mean->d,
                                               rstd->d, gy->d, gx->d, gw->d, gb->d),
                 "batch_norm_backward");
            near("batch_norm backward gx", dt, gx, nb * c * l, 1e-5);
            near("batch_norm backward gw", dt, gw, c, 1e-5);
            near("batch_norm backward gb", dt, gb, c, 1e-5);
            release();
        }
    }
}

static void test_embedding_ce(void) {
    for (int k = 0; k < 2; k++) {
        fsdp_dtype_t dt = FT[k];
        const size_t vocab = 50, dim = 300, n = 700;
        buf_t *w = rnd(dt, vocab * dim, -1, 1), *idx = idx_buf(n, 0, (int64_t)vocab);
        buf_t *y = zeros(n * dim * esz(dt));
        BOTH(cpu->ops->embedding(cpu, dt, n, dim, idx->h, w->h, y->h),
             gpu->ops->embedding(gpu, dt, n, dim, idx->d, w->d, y->d), "embedding");
        same_bits("embedding rows", y);
        buf_t *gy = rnd(dt, n * dim, -1, 1), *gw = rnd(dt, vocab * dim, -1, 1);
        BOTH(cpu->ops->embedding_backward(cpu, dt, n, dim, idx->h, 3, gy->h, gw->h),
             gpu->ops->embedding_backward(gpu, dt, n, dim, idx->d, 3, gy->d, gw->d),
             "embedding_backward");
        same_bits("embedding backward (repeated indices, padding 3): deterministic, the CPU's "
                  "order",
                  gw);
        release();

        const size_t rows = 65, ncls = 513;
        for (int s = 0; s < 2; s++) {
            double ls = s ? 0.1 : 0.0;
            buf_t *x = rnd(dt, rows * ncls, -4, 4), *t = idx_buf(rows, 0, (int64_t)ncls);
            ((int64_t *)t->h)[5] = -100; /* ignore_index */
            up(t);
            buf_t *loss = zeros(rows * esz(dt)), *lp = zeros(rows * ncls * esz(dt));
            BOTH(cpu->ops->cross_entropy(cpu, dt, rows, ncls, x->h, t->h, -100, ls, loss->h, lp->h),
                 gpu->ops->cross_entropy(gpu, dt, rows, ncls, x->d, t->d, -100, ls, loss->d, lp->d),
                 "cross_entropy");
            near(s ? "cross_entropy loss (smoothing 0.1)" : "cross_entropy loss", dt, loss, rows,
                 1e-6);
            near("cross_entropy log-probabilities", dt, lp, rows * ncls, 1e-6);
            up(lp);
            buf_t *gl = rnd(dt, rows, 0.5, 1.5), *gx = zeros(rows * ncls * esz(dt));
            BOTH(cpu->ops->cross_entropy_backward(cpu, dt, rows, ncls, lp->h, t->h, -100, ls, gl->h,
                                                  gx->h),
                 gpu->ops->cross_entropy_backward(gpu, dt, rows, ncls, lp->d, t->d, -100, ls, gl->d,
                                                  gx->d),
                 "cross_entropy_backward");
            near("cross_entropy backward", dt, gx, rows * ncls, 1e-7);
            release();
        }
    }
}

static void test_dropout(void) {
    for (int k = 0; k < 2; k++) {
        fsdp_dtype_t dt = FT[k];
        const size_t n = 100003;
        const double ps[] = {0.0, 0.1, 0.5, 1.0};
        for (size_t a = 0; a < 4; a++) {
            buf_t *x = rnd(dt, n, -1, 1), *y = zeros(n * esz(dt)), *m = zeros(n);
            uint64_t seed = 1234 + a, stream = 77, off = UINT64_C(0xfffffff0);
            BOTH(cpu->ops->dropout(cpu, dt, n, ps[a], seed, stream, off, x->h, y->h, m->h),
                 gpu->ops->dropout(gpu, dt, n, ps[a], seed, stream, off, x->d, y->d, m->d),
                 "dropout");
            char w[64];
            snprintf(w, sizeof w, "dropout p %.1f mask (%s)", ps[a], dn(dt));
            same_bits(w, m);
            snprintf(w, sizeof w, "dropout p %.1f output", ps[a]);
            near(w, dt, y, n, 0);
            release();
        }
    }
}

static void test_optim(void) {
    for (int k = 0; k < 2; k++) {
        fsdp_dtype_t dt = FT[k];
        const size_t n = 10007;
        for (int v = 0; v < 4; v++) {
            buf_t *p = rnd(dt, n, -1, 1), *g = rnd(dt, n, -1, 1), *buf = rnd(dt, n, -1, 1);
            bool nest = v & 1, first = v & 2;
            BOTH(cpu->ops->sgd_step(cpu, dt, n, p->h, g->h, buf->h, 0.1, 0.9, 0.1, 0.01, nest,
                                    first),
                 gpu->ops->sgd_step(gpu, dt, n, p->d, g->d, buf->d, 0.1, 0.9, 0.1, 0.01, nest,
                                    first),
                 "sgd_step");
            char w[64];
            snprintf(w, sizeof w, "sgd momentum, nesterov %d, first %d: params", nest, first);
            near(w, dt, p, n, 1e-6);
            near("sgd momentum buffer", dt, buf, n, 1e-6);
            release();
        }
        for (int v = 0; v < 4; v++) {
            bool decoupled = v & 1, ams = v & 2;
            buf_t *p = rnd(dt, n, -1, 1), *g = rnd(dt, n, -1, 1), *m = rnd(dt, n, -0.1, 0.1);
            buf_t *vv = rnd(dt, n, 0, 0.01), *vm = rnd(dt, n, 0, 0.01);
            BOTH(cpu->ops->adam_step(cpu, dt, n, p->h, g->h, m->h, vv->h, ams ? vm->h : NULL, 1e-3,
                                     0.9, 0.999, 1e-8, 0.01, decoupled, ams, 7),
                 gpu->ops->adam_step(gpu, dt, n, p->d, g->d, m->d, vv->d, ams ? vm->d : NULL, 1e-3,
                                     0.9, 0.999, 1e-8, 0.01, decoupled, ams, 7),
                 "adam_step");
            char w[64];
            snprintf(w, sizeof w, "%s%s step 7: params", decoupled ? "AdamW" : "Adam",
                     ams ? " amsgrad" : "");
            near(w, dt, p, n, 1e-6);
            near("adam first moment", dt, m, n, 1e-7);
            near("adam second moment", dt, vv, n, 1e-9);
            if (ams) near("adam max second moment", dt, vm, n, 1e-9);
            release();
        }
    }
}

/* ---- memory, streams, events ---- */

static void test_memory_streams(fsdp_ctx_t *ctx) {
    fsdp_bcache_stats_t s0, s1;
    fsdp_mem_stats_t m0, m1;
    fsdp__cuda_empty_cache(gpu); /* no free block left by the kernel tests */
    fsdp__cuda_alloc_stats(gpu, &s0);
    fsdp_mem_get_stats(ctx, &m0);
    void *a = NULL, *b = NULL;
    fsdp_device_alloc(gpu, FSDP_MEM_PARAMS, 1000, &a);
    fsdp_device_alloc(gpu, FSDP_MEM_GRADS, 3 << 20, &b);
    fsdp__cuda_alloc_stats(gpu, &s1);
    fsdp_mem_get_stats(ctx, &m1);
    tap_is_size(s1.allocated_total - s0.allocated_total, 1024 + (4 << 20),
                "the allocator counts rounded blocks (1000 -> 1024, 3 MiB -> its 4 MiB segment)");
    tap_is_size(m1.current[FSDP_MEM_PARAMS] - m0.current[FSDP_MEM_PARAMS], 1000,
                "the device layer counts 1000 bytes of params");
    tap_is_size(m1.current[FSDP_MEM_GRADS] - m0.current[FSDP_MEM_GRADS], 3 << 20,
                "and 3 MiB of grads");
    fsdp_device_free(gpu, b);
    void *c = NULL;
    fsdp_device_alloc(gpu, FSDP_MEM_ACTIVATIONS, 3 << 20, &c);
    fsdp_bcache_stats_t s2;
    fsdp__cuda_alloc_stats(gpu, &s2);
    tap_ok(c == b && s2.seg_allocs == s1.seg_allocs,
           "a freed block is reused without a new cudaMalloc");
    fsdp_device_free(gpu, c);
    fsdp_device_free(gpu, a);
    tap_ok(fsdp__cuda_empty_cache(gpu) > 0, "empty_cache gives segments back");

    /* Ordering: a kernel on the compute stream, an event, a copy on a side stream after it. */
    fsdp_stream_t *side = NULL;
    fsdp_event_t *ev = NULL;
    fsdp_stream_create(gpu, &side);
    fsdp_event_create(gpu, &ev);
    const size_t n = (size_t)16 << 20;
    float *x = NULL, *y = NULL;
    fsdp_device_alloc(gpu, FSDP_MEM_OTHER, n * 4, (void **)&x);
    fsdp_device_alloc(gpu, FSDP_MEM_OTHER, n * 4, (void **)&y);
    fsdp_device_memset(gpu, y, 0, n * 4, NULL);
    for (int rep = 0; rep < 3; rep++) {
        gpu->ops->fill(gpu, FSDP_DTYPE_F32, n, 2.0 + rep, x); /* compute stream */
        fsdp_event_record(ev, NULL);
        fsdp_event_wait(ev, side);
        fsdp_device_memcpy(gpu, y, x, n * 4, FSDP_COPY_D2D, side);
    }
    fsdp__cuda_record_stream(gpu, x, fsdp_stream_native(side));
    fsdp_stream_sync(side);
    float *h = malloc(n * 4);
    fsdp_device_memcpy(gpu, h, y, n * 4, FSDP_COPY_D2H, NULL);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += h[i] != 4.0f;
    tap_is_size(bad, 0,
                "a copy on a side stream waiting on an event sees the compute stream's fill");
    /* The reverse: side-stream memset, event, compute stream waits, then a kernel reads it. */
    fsdp_device_memset(gpu, y, 0, n * 4, side);
    fsdp_event_record(ev, side);
    fsdp_event_wait(ev, NULL);
    float *z = NULL;
    fsdp_device_alloc(gpu, FSDP_MEM_OTHER, 4, (void **)&z);
    gpu->ops->sum_squares(gpu, FSDP_DTYPE_F32, n, y, z);
    float zz = -1;
    fsdp_device_memcpy(gpu, &zz, z, 4, FSDP_COPY_D2H, NULL);
    tap_ok(zz == 0.0f, "the compute stream waits for a side stream's memset (sum of squares %g)",
           (double)zz);
    tap_is_int(fsdp_event_sync(ev), 0, "event_sync");
    /* record_stream: x was used on the side stream; its free waits for an event there. */
    fsdp_bcache_stats_t s3;
    fsdp__cuda_alloc_stats(gpu, &s3);
    size_t pend0 = s3.pending_blocks;
    fsdp_device_free(gpu, x);
    fsdp__cuda_alloc_stats(gpu, &s3);
    tap_is_size(s3.pending_blocks, pend0 + 1,
                "freeing a block used on a side stream leaves it waiting for that stream's event");
    fsdp_stream_sync(side);
    fsdp__cuda_empty_cache(gpu); /* collects completed events */
    fsdp__cuda_alloc_stats(gpu, &s3);
    tap_is_size(s3.pending_blocks, 0, "once the side stream is done the block is released");
    fsdp_device_free(gpu, y);
    fsdp_device_free(gpu, z);
    free(h);
    fsdp_event_destroy(ev);
    fsdp_stream_destroy(side);

    /* Pinned host memory for offload, counted under FSDP_MEM_OFFLOAD, async copies from it. */
    fsdp_mem_get_stats(ctx, &m0);
    float *pin = NULL;
    tap_is_int(fsdp__cuda_host_alloc(gpu, FSDP_MEM_OFFLOAD, 1 << 20, (void **)&pin), 0,
               "pinned host allocation");
    fsdp_mem_get_stats(ctx, &m1);
    tap_is_size(m1.current[FSDP_MEM_OFFLOAD] - m0.current[FSDP_MEM_OFFLOAD], 1 << 20,
                "counted as offload memory");
    for (int i = 0; i < (1 << 18); i++)
        pin[i] = (float)i;
    float *d = NULL;
    fsdp_device_alloc(gpu, FSDP_MEM_OTHER, 1 << 20, (void **)&d);
    fsdp_stream_create(gpu, &side);
    fsdp_device_memcpy(gpu, d, pin, 1 << 20, FSDP_COPY_H2D, side);
    fsdp_stream_sync(side);
    memset(pin, 0, 1 << 20);
    fsdp_device_memcpy(gpu, pin, d, 1 << 20, FSDP_COPY_D2H, side);
    fsdp_stream_sync(side);
    bad = 0;
    for (int i = 0; i < (1 << 18); i++)
        bad += pin[i] != (float)i;
    tap_is_size(bad, 0, "async round trip through pinned memory");
    fsdp_stream_destroy(side);
    fsdp_device_free(gpu, d);
    fsdp__cuda_host_free(gpu, pin);
    fsdp_mem_get_stats(ctx, &m1);
    tap_is_size(m1.current[FSDP_MEM_OFFLOAD], m0.current[FSDP_MEM_OFFLOAD], "and uncounted");

    /* Out of memory: a request beyond the GPU fails with FSDP_ENOMEM, not a crash. */
    void *huge = NULL;
    int rc = fsdp_device_alloc(gpu, FSDP_MEM_OTHER, (size_t)1 << 50, &huge);
    tap_is_int(rc, FSDP_ENOMEM, "a 1 PiB request is FSDP_ENOMEM");
    tap_has_str(fsdp_ctx_last_error(ctx), "1125899906842624 bytes", "naming the size");
}

int main(void) {
    char why[256];
    if (fsdp__cuda_visible_devices(why, sizeof why) <= 0) return tap_skip_all("no CUDA device");
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    fsdp_ctx_t *ctx = NULL;
    if (fsdp_ctx_create(&o, &ctx) < 0) tap_bail("no context");
    if (fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &cpu) < 0) tap_bail("no CPU device");
    if (fsdp_device_create(ctx, FSDP_DEVICE_CUDA, NULL, &gpu) < 0)
        tap_bail("CUDA device: %s", fsdp_ctx_last_error(ctx));
    tap_plan_lazy();
    test_fill_cast();
    test_copy_strided();
    test_unary();
    test_binary_axpy_where();
    test_reductions();
    test_gemm();
    test_gemm_half();
    test_gemm_lp();
    test_linear_bf16(ctx);
    test_softmax_norms();
    test_embedding_ce();
    test_dropout();
    test_optim();
    test_memory_streams(ctx);
    release();
    fsdp_device_destroy(gpu);
    fsdp_device_destroy(cpu);
    fsdp_ctx_destroy(ctx);
    return tap_done();
}

#else

int main(void) {
    return tap_skip_all("libfsdp was configured without CUDA");
}

#endif
