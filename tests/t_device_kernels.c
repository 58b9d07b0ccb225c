/* SPDX-License-Identifier: MIT */
/*
 * t_device_kernels.c: the CPU device's general kernels, each checked against a naive reference
 * in this file: fill and cast over every dtype, strided copies, unary ops with finite-difference
 * gradients, broadcast binary ops, axpy and where, reductions and gemm.
 */
#include <config.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "device/device_impl.h"
#include "device_util.h"
#include "tap.h"

/* ---- fill and cast ---- */

static void test_fill_cast(void) {
    fsdp_ctx_t *ctx = new_ctx(0, 1);
    fsdp_device_t *dev = fsdp_ctx_device(ctx);
    unsigned char buf[8 * 38];

    /* Fill: each element is the value converted once from double. */
    static const struct {
        fsdp_dtype_t dt;
        double value;
        uint64_t bits; /* expected element, little-endian in the low bytes */
    } fills[] = {
        {FSDP_DTYPE_F16, 1.0, 0x3c00},
        {FSDP_DTYPE_BF16, 1.0, 0x3f80},
        {FSDP_DTYPE_F16, -2.0, 0xc000},
        /* 1 + 2^-11 + 2^-40 is above the f16 tie, so a single rounding goes up; rounding to
         * f32 first would land on the tie and go to even (down). */
        {FSDP_DTYPE_F16, 1.0 + 0x1p-11 + 0x1p-40, 0x3c01},
        {FSDP_DTYPE_I32, -3.7, (uint32_t)-3},
        {FSDP_DTYPE_I64, 1e30, INT64_MAX},
        {FSDP_DTYPE_U8, 300.0, 255},
        {FSDP_DTYPE_BOOL, 0.5, 1},
    };
    for (size_t t = 0; t < sizeof fills / sizeof fills[0]; t++) {
        size_t es = fsdp_dtype_size(fills[t].dt);
        memset(buf, 0x5a, sizeof buf);
        int rc = fsdp_device_fill(dev, buf, fills[t].dt, 37, fills[t].value, NULL);
        int ok = rc == 0;
        for (size_t i = 0; i < 37 && ok; i++) {
            uint64_t got = 0;
            memcpy(&got, buf + i * es, es);
            ok = got == fills[t].bits;
        }
        ok = ok && buf[37 * es] == 0x5a;
        tap_ok(ok, "fill %s with %.17g gives 0x%llx in all 37 elements and no more",
               fsdp_dtype_name(fills[t].dt), fills[t].value, (unsigned long long)fills[t].bits);
    }
    float f[37];
    double d[37];
    fsdp_device_fill(dev, f, FSDP_DTYPE_F32, 37, 0.1, NULL);
    fsdp_device_fill(dev, d, FSDP_DTYPE_F64, 37, 0.1, NULL);
    tap_ok(f[0] == 0.1f && f[36] == 0.1f && d[0] == 0.1 && d[36] == 0.1, "fill f32 and f64");

    /* Cast: small integers are exact in every dtype, so every pair round-trips through f64. */
    int pairs_ok = 0, pairs = 0;
    double src[11], mid_back[11];
    unsigned char mid[8 * 11], out[8 * 11];
    for (int i = 0; i < 11; i++)
        src[i] = i;
    for (int a = 0; a < FSDP_DTYPE_COUNT; a++) {
        for (int b = 0; b < FSDP_DTYPE_COUNT; b++) {
            pairs++;
            /* bool holds only 0 and 1. */
            int n = (a == FSDP_DTYPE_BOOL || b == FSDP_DTYPE_BOOL) ? 2 : 11;
            int rc =
                fsdp_device_cast(dev, mid, (fsdp_dtype_t)a, src, FSDP_DTYPE_F64, (size_t)n, NULL);
            rc |=
                fsdp_device_cast(dev, out, (fsdp_dtype_t)b, mid, (fsdp_dtype_t)a, (size_t)n, NULL);
            rc |= fsdp_device_cast(dev, mid_back, FSDP_DTYPE_F64, out, (fsdp_dtype_t)b, (size_t)n,
                                   NULL);
            int ok = rc == 0;
            for (int i = 0; i < n; i++)
                ok &= mid_back[i] == src[i];
            if (!ok)
                tap_diag("cast %s -> %s failed", fsdp_dtype_name((fsdp_dtype_t)a),
                         fsdp_dtype_name((fsdp_dtype_t)b));
            pairs_ok += ok;
        }
    }
    tap_is_int(pairs_ok, pairs, "cast between every pair of dtypes");
    float fv[3] = {1.0f + 0x1p-9f, -0.0f, 65520.0f};
    uint16_t hv[3];
    fsdp_device_cast(dev, hv, FSDP_DTYPE_BF16, fv, FSDP_DTYPE_F32, 3, NULL);
    tap_ok(hv[0] == 0x3f80 && hv[1] == 0x8000, "f32 -> bf16 rounds to nearest even, keeps -0");
    fsdp_device_cast(dev, hv, FSDP_DTYPE_F16, fv, FSDP_DTYPE_F32, 3, NULL);
    tap_is_uint(hv[2], 0x7c00, "f32 65520 -> f16 overflows to Inf");
    tap_is_int(fsdp_device_cast(dev, buf + 2, FSDP_DTYPE_F32, buf, FSDP_DTYPE_F32, 4, NULL),
               FSDP_EINVAL, "cast between overlapping buffers is refused");
    fsdp_ctx_destroy(ctx);
}

/* ---- copy_strided ---- */

static void test_copy_strided(void) {
    fsdp_ctx_t *ctx = new_ctx(0, 1);
    fsdp_device_t *dev = fsdp_ctx_device(ctx);
    const struct fsdp_dev_ops *ops = dev->ops;

    /* Transpose: x is 3 x 4 row-major; y (4 x 3) = x^T. */
    float x[24], y[24];
    for (int i = 0; i < 24; i++)
        x[i] = (float)i;
    int64_t shp2[2] = {4, 3}, str2[2] = {1, 4};
    ops->copy_strided(dev, FSDP_DTYPE_F32, 2, shp2, y, x, str2);
    int ok = 1;
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++)
            ok &= y[i * 3 + j] == x[j * 4 + i];
    tap_ok(ok, "copy_strided: 2-d transpose");

    /* Permute 3-d: x (2, 3, 4); y = x.permute(2, 0, 1), shape (4, 2, 3). */
    double xd[24], yd[24];
    for (int i = 0; i < 24; i++)
        xd[i] = i * 1.5;
    int64_t shp3[3] = {4, 2, 3}, str3[3] = {1, 12, 4};
    ops->copy_strided(dev, FSDP_DTYPE_F64, 3, shp3, yd, xd, str3);
    ok = 1;
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 2; b++)
            for (int c = 0; c < 3; c++)
                ok &= yd[(a * 2 + b) * 3 + c] == xd[b * 12 + c * 4 + a];
    tap_ok(ok, "copy_strided: 3-d permute (2, 0, 1)");

    /* Broadcast a row of 4 to 3 x 4 and a column of 3 to 3 x 4. */
    int64_t shb[2] = {3, 4}, row[2] = {0, 1}, col[2] = {1, 0};
    ops->copy_strided(dev, FSDP_DTYPE_F32, 2, shb, y, x, row);
    ok = 1;
    for (int i = 0; i < 12; i++)
        ok &= y[i] == x[i % 4];
    tap_ok(ok, "copy_strided: broadcast a row");
    ops->copy_strided(dev, FSDP_DTYPE_F32, 2, shb, y, x, col);
    ok = 1;
    for (int i = 0; i < 12; i++)
        ok &= y[i] == x[i / 4];
    tap_ok(ok, "copy_strided: broadcast a column");

    /* A slice with a step, in 1-byte and 2-byte dtypes: x[1:3, ::2] of a 3 x 4 u8 matrix. */
    uint8_t xb[12], yb[4];
    uint16_t xh[12], yh[4];
    for (int i = 0; i < 12; i++)
        xb[i] = (uint8_t)(100 + i), xh[i] = (uint16_t)(1000 + i);
    int64_t shs[2] = {2, 2}, sts[2] = {4, 2};
    ops->copy_strided(dev, FSDP_DTYPE_U8, 2, shs, yb, xb + 4, sts);
    ops->copy_strided(dev, FSDP_DTYPE_BF16, 2, shs, yh, xh + 4, sts);
    tap_ok(yb[0] == 104 && yb[1] == 106 && yb[2] == 108 && yb[3] == 110,
           "copy_strided: stepped slice of u8");
    tap_ok(yh[0] == 1004 && yh[1] == 1006 && yh[2] == 1008 && yh[3] == 1010,
           "copy_strided: stepped slice of bf16");

    /* Contiguous with size-1 dims merges to one memcpy; 0-d copies one element. */
    int64_t shc[4] = {2, 1, 3, 4}, stc[4] = {12, 99, 4, 1};
    memset(y, 0, sizeof y);
    ops->copy_strided(dev, FSDP_DTYPE_F32, 4, shc, y, x, stc);
    tap_is_mem(y, x, 24 * sizeof(float), "copy_strided: contiguous 4-d with a size-1 dim");
    int64_t i64x = 77, i64y = 0;
    ops->copy_strided(dev, FSDP_DTYPE_I64, 0, NULL, &i64y, &i64x, NULL);
    tap_is_int(i64y, 77, "copy_strided: 0-d");
    int64_t sh0[2] = {3, 0};
    tap_is_int(ops->copy_strided(dev, FSDP_DTYPE_F32, 2, sh0, NULL, NULL, str2), FSDP_OK,
               "copy_strided: an empty shape touches nothing");
    fsdp_ctx_destroy(ctx);
}

/* ---- unary ---- */

/* The reference forward in long double-free plain double. */
static double unary_ref(fsdp_unary_op_t op, double x, double a) {
    switch (op) {
    case FSDP_UNARY_RELU:
        return x > 0 ? x : 0;
    case FSDP_UNARY_GELU_ERF:
        return 0.5 * x * (1 + erf(x / sqrt(2.0)));
    case FSDP_UNARY_GELU_TANH:
        return 0.5 * x * (1 + tanh(sqrt(2 / 3.14159265358979323846) * (x + 0.044715 * x * x * x)));
    case FSDP_UNARY_TANH:
        return tanh(x);
    case FSDP_UNARY_SIGMOID:
        return 1 / (1 + exp(-x));
    case FSDP_UNARY_NEG:
        return -x;
    case FSDP_UNARY_EXP:
        return exp(x);
    case FSDP_UNARY_LOG:
        return log(x);
    case FSDP_UNARY_SQRT:
        return sqrt(x);
    case FSDP_UNARY_RSQRT:
        return 1 / sqrt(x);
    case FSDP_UNARY_SQUARE:
        return x * x;
    case FSDP_UNARY_ABS:
        return fabs(x);
    case FSDP_UNARY_SCALE:
        return a * x;
    case FSDP_UNARY_ADD_SCALAR:
        return x + a;
    case FSDP_UNARY_POW:
        return pow(x, a);
    default:
        return NAN;
    }
}

static const char *const unary_names[FSDP_UNARY_COUNT] = {
    "relu", "gelu_erf", "gelu_tanh", "tanh", "sigmoid", "neg",   "exp", "log",
    "sqrt", "rsqrt",    "square",    "abs",  "scale",   "add_s", "pow"};

static void test_unary(void) {
    fsdp_ctx_t *ctx = new_ctx(0, 1);
    fsdp_device_t *dev = fsdp_ctx_device(ctx);
    const struct fsdp_dev_ops *ops = dev->ops;
    enum { N = 64 };
    double x[N], y[N], gy[N], gx[N], gx0[N], xp[N], xm[N], yp[N], ym[N], fd[N], ref[N];
    float xf[N], yf[N], gyf[N], gxf[N];
    const double h = 1e-6, alpha = 1.7;
    for (int op = 0; op < FSDP_UNARY_COUNT; op++) {
        int positive = op == FSDP_UNARY_LOG || op == FSDP_UNARY_SQRT || op == FSDP_UNARY_RSQRT ||
                       op == FSDP_UNARY_POW;
        for (int i = 0; i < N; i++) {
            x[i] = positive ? urand(0.2, 3.0) : urand(-3.0, 3.0);
            /* Keep away from the kinks of relu and abs, where the finite difference straddles. */
            if (!positive && fabs(x[i]) < 1e-3) x[i] = 0.5;
            gy[i] = urand(-2.0, 2.0);
            xp[i] = x[i] + h;
            xm[i] = x[i] - h;
            ref[i] = unary_ref((fsdp_unary_op_t)op, x[i], alpha);
        }
        int rc = ops->unary(dev, FSDP_DTYPE_F64, (fsdp_unary_op_t)op, N, alpha, x, y);
        tap_ok(rc == 0 && near_all(y, ref, N, 1e-14, 1e-15, unary_names[op]),
               "unary %s f64 forward matches libm", unary_names[op]);

        ops->unary(dev, FSDP_DTYPE_F64, (fsdp_unary_op_t)op, N, alpha, xp, yp);
        ops->unary(dev, FSDP_DTYPE_F64, (fsdp_unary_op_t)op, N, alpha, xm, ym);
        for (int i = 0; i < N; i++)
            fd[i] = gy[i] * (yp[i] - ym[i]) / (2 * h);
        rc = ops->unary_backward(dev, FSDP_DTYPE_F64, (fsdp_unary_op_t)op, N, alpha, x, y, gy, gx);
        rc |= ops->unary_backward(dev, FSDP_DTYPE_F64, (fsdp_unary_op_t)op, N, alpha, x, NULL, gy,
                                  gx0);
        tap_ok(rc == 0 && near_all(gx, fd, N, 1e-7, 1e-8, unary_names[op]),
               "unary %s f64 backward (from y) matches central differences", unary_names[op]);
        tap_ok(near_all(gx0, fd, N, 1e-7, 1e-8, unary_names[op]),
               "unary %s f64 backward (from x) matches central differences", unary_names[op]);

        /* f32 agrees with f64 evaluated at the same (rounded) inputs, to f32 precision. */
        double x32[N], gy32[N], y32[N], gx32[N], yr[N];
        for (int i = 0; i < N; i++) {
            xf[i] = (float)x[i];
            gyf[i] = (float)gy[i];
            x32[i] = xf[i];
            gy32[i] = gyf[i];
            yr[i] = unary_ref((fsdp_unary_op_t)op, x32[i], (float)alpha);
        }
        rc = ops->unary(dev, FSDP_DTYPE_F32, (fsdp_unary_op_t)op, N, alpha, xf, yf);
        rc |= ops->unary_backward(dev, FSDP_DTYPE_F32, (fsdp_unary_op_t)op, N, alpha, xf, yf, gyf,
                                  gxf);
        ops->unary_backward(dev, FSDP_DTYPE_F64, (fsdp_unary_op_t)op, N, (float)alpha, x32, NULL,
                            gy32, gx);
        for (int i = 0; i < N; i++)
            y32[i] = yf[i], gx32[i] = gxf[i];
        tap_ok(rc == 0 && near_all(y32, yr, N, 2e-6, 1e-6, unary_names[op]) &&
                   near_all(gx32, gx, N, 2e-5, 2e-5, unary_names[op]),
               "unary %s f32 forward and backward agree with f64", unary_names[op]);
    }

    /* In place: y may alias x. */
    double inpl[4] = {1, 4, 9, 16};
    ops->unary(dev, FSDP_DTYPE_F64, FSDP_UNARY_SQRT, 4, 0, inpl, inpl);
    tap_ok(inpl[0] == 1 && inpl[1] == 2 && inpl[2] == 3 && inpl[3] == 4, "unary in place");
    /* pow with exponent 0 has gradient 0 even at x = 0. */
    double z[2] = {0, 2}, g1[2] = {1, 1}, gz[2] = {-1, -1};
    ops->unary_backward(dev, FSDP_DTYPE_F64, FSDP_UNARY_POW, 2, 0.0, z, NULL, g1, gz);
    tap_ok(gz[0] == 0 && gz[1] == 0, "pow backward with exponent 0 is 0");
    fsdp_ctx_destroy(ctx);
}

/* ---- binary ---- */

static double binary_ref(fsdp_binary_op_t op, double a, double b) {
    switch (op) {
    case FSDP_BINARY_ADD:
        return a + b;
    case FSDP_BINARY_SUB:
        return a - b;
    case FSDP_BINARY_MUL:
        return a * b;
    case FSDP_BINARY_DIV:
        return a / b;
    case FSDP_BINARY_MAX:
        return isnan(a) || isnan(b) ? NAN : (a > b ? a : b);
    case FSDP_BINARY_MIN:
        return isnan(a) || isnan(b) ? NAN : (a < b ? a : b);
    default:
        return NAN;
    }
}

/* Element offset of flat output index i for strides st over shape (division is fine here). */
static int64_t offset_of(int ndim, const int64_t *shape, const int64_t *stv, int64_t i) {
    int64_t off = 0;
    for (int d = ndim - 1; d >= 0; d--) {
        off += (i % shape[d]) * stv[d];
        i /= shape[d];
    }
    return off;
}

typedef struct {
    const char *name;
    int ndim;
    int64_t shape[4];
    int64_t as[4], bs[4];
    int64_t aoff, boff; /* where a and b start inside their buffers */
} bin_case_t;

static void test_binary(void) {
    fsdp_ctx_t *ctx = new_ctx(0, 1);
    fsdp_device_t *dev = fsdp_ctx_device(ctx);
    const struct fsdp_dev_ops *ops = dev->ops;
    static const bin_case_t cases[] = {
        {"same shape", 3, {2, 3, 5}, {15, 5, 1}, {15, 5, 1}, 0, 0},
        {"b scalar", 3, {2, 3, 5}, {15, 5, 1}, {0, 0, 0}, 0, 7},
        {"a scalar", 2, {4, 6}, {0, 0}, {6, 1}, 3, 0},
        {"b row (bias)", 3, {2, 3, 5}, {15, 5, 1}, {0, 0, 1}, 0, 0},
        {"b column", 3, {2, 3, 5}, {15, 5, 1}, {3, 1, 0}, 0, 0},
        {"outer product", 2, {7, 9}, {1, 0}, {0, 1}, 0, 0},
        {"b transposed", 2, {6, 4}, {4, 1}, {1, 6}, 0, 0},
        {"permuted 4-d", 4, {2, 3, 2, 4}, {1, 8, 2, 24 / 12}, {24, 8, 4, 1}, 0, 0},
        {"size-1 dims", 4, {1, 5, 1, 3}, {99, 3, 77, 1}, {0, 0, 0, 1}, 0, 0},
        {"0-d", 0, {0}, {0}, {0}, 2, 5},
        {"negative stride", 2, {3, 4}, {4, -1}, {0, 1}, 3, 0},
    };
    /* Operand buffers big enough for every case (max offset 47 plus the start). */
    double ab[128], bb[128], y[128], want[128];
    float af[128], bf[128], yf[128];
    for (int i = 0; i < 128; i++) {
        ab[i] = urand(-3, 3);
        bb[i] = urand(0.5, 3) * (i % 2 ? 1 : -1);
        af[i] = (float)ab[i];
        bf[i] = (float)bb[i];
    }
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const bin_case_t *k = &cases[c];
        int64_t n = 1;
        for (int d = 0; d < k->ndim; d++)
            n *= k->shape[d];
        int ok64 = 1, ok32 = 1;
        for (int op = 0; op < FSDP_BINARY_COUNT; op++) {
            for (int64_t i = 0; i < n; i++)
                want[i] = binary_ref((fsdp_binary_op_t)op,
                                     ab[k->aoff + offset_of(k->ndim, k->shape, k->as, i)],
                                     bb[k->boff + offset_of(k->ndim, k->shape, k->bs, i)]);
            int rc = ops->binary(dev, FSDP_DTYPE_F64, (fsdp_binary_op_t)op, k->ndim, k->shape, y,
                                 ab + k->aoff, k->as, bb + k->boff, k->bs);
            ok64 &= rc == 0 && near_all(y, want, (size_t)n, 0, 0, k->name);
            rc = ops->binary(dev, FSDP_DTYPE_F32, (fsdp_binary_op_t)op, k->ndim, k->shape, yf,
                             af + k->aoff, k->as, bf + k->boff, k->bs);
            double yd[128];
            for (int64_t i = 0; i < n; i++)
                yd[i] = yf[i];
            ok32 &= rc == 0 && near_all(yd, want, (size_t)n, 1e-6, 1e-6, k->name);
        }
        tap_ok(ok64, "binary f64, %s: every op matches the reference", k->name);
        tap_ok(ok32, "binary f32, %s: every op matches the reference", k->name);
    }

    /* In place: y is a (contiguous), b broadcast. */
    double ip[6] = {1, 2, 3, 4, 5, 6}, bias[3] = {10, 20, 30};
    int64_t sh[2] = {2, 3}, cs[2] = {3, 1}, rs[2] = {0, 1};
    ops->binary(dev, FSDP_DTYPE_F64, FSDP_BINARY_ADD, 2, sh, ip, ip, cs, bias, rs);
    tap_ok(ip[0] == 11 && ip[2] == 33 && ip[3] == 14 && ip[5] == 36, "binary in place on a");

    /* max and min propagate NaN from either side. */
    double na[4] = {NAN, 1, 2, NAN}, nb[4] = {1, NAN, 1, NAN}, nm[4];
    int64_t s4[1] = {4}, c1[1] = {1};
    ops->binary(dev, FSDP_DTYPE_F64, FSDP_BINARY_MAX, 1, s4, nm, na, c1, nb, c1);
    tap_ok(isnan(nm[0]) && isnan(nm[1]) && nm[2] == 2 && isnan(nm[3]), "max propagates NaN");
    ops->binary(dev, FSDP_DTYPE_F64, FSDP_BINARY_MIN, 1, s4, nm, na, c1, nb, c1);
    tap_ok(isnan(nm[0]) && isnan(nm[1]) && nm[2] == 1 && isnan(nm[3]), "min propagates NaN");
    tap_is_int(ops->binary(dev, FSDP_DTYPE_F16, FSDP_BINARY_ADD, 1, s4, nm, na, c1, nb, c1),
               FSDP_ENOTSUP, "binary on f16 is not supported");
    fsdp_ctx_destroy(ctx);
}

/* ---- axpy, where ---- */

static void test_axpy_where(void) {
    fsdp_ctx_t *ctx = new_ctx(0, 1);
    fsdp_device_t *dev = fsdp_ctx_device(ctx);
    const struct fsdp_dev_ops *ops = dev->ops;
    for (int t = 0; t < 2; t++) {
        fsdp_dtype_t dt = t ? FSDP_DTYPE_F64 : FSDP_DTYPE_F32;
        double xb[8 * 2], yb[8 * 2];
        for (int i = 0; i < 8; i++)
            st(dt, xb, (size_t)i, i), st(dt, yb, (size_t)i, 100);
        ops->axpy(dev, dt, 8, 0.5, xb, yb);
        int ok = 1;
        for (int i = 0; i < 8; i++)
            ok &= ld(dt, yb, (size_t)i) == 100 + 0.5 * i;
        tap_ok(ok, "axpy %s", fsdp_dtype_name(dt));

        uint8_t cond[8] = {1, 0, 1, 1, 0, 0, 1, 0};
        double ab[8 * 2], bb[8 * 2], out[8 * 2];
        for (int i = 0; i < 8; i++)
            st(dt, ab, (size_t)i, i), st(dt, bb, (size_t)i, -i);
        int all = 1;
        for (int m = 0; m < 4; m++) {
            const void *a = m & 1 ? ab : NULL, *b = m & 2 ? bb : NULL;
            ops->where(dev, dt, 8, cond, a, 7.0, b, -7.0, out);
            for (int i = 0; i < 8; i++) {
                double w = cond[i] ? (a ? i : 7.0) : (b ? -i : -7.0);
                all &= ld(dt, out, (size_t)i) == w;
            }
        }
        tap_ok(all, "where %s with tensor and scalar operands", fsdp_dtype_name(dt));
    }
    fsdp_ctx_destroy(ctx);
}

/* ---- reductions ---- */

static void test_reduce(void) {
    fsdp_ctx_t *ctx = new_ctx(0, 1);
    fsdp_device_t *dev = fsdp_ctx_device(ctx);
    const struct fsdp_dev_ops *ops = dev->ops;
    static const size_t shapes[][3] = {{3, 5, 1}, {2, 37, 4}, {1, 100, 1}, {4, 1, 3},
                                       {2, 0, 3}, {5, 17, 1}, {1, 3, 33}};
    double x[400 * 2], y[40 * 2], want[40], yd[40];
    int64_t idx[40], widx[40];
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        size_t o = shapes[s][0], r = shapes[s][1], in = shapes[s][2];
        for (int t = 0; t < 2; t++) {
            fsdp_dtype_t dt = t ? FSDP_DTYPE_F64 : FSDP_DTYPE_F32;
            for (size_t i = 0; i < o * r * in; i++)
                st(dt, x, i, (double)(int)urand(-20, 20) / 4); /* quarters: sums are exact */
            for (size_t a = 0; a < o; a++) {
                for (size_t c = 0; c < in; c++) {
                    double sum = 0, best = -INFINITY;
                    int64_t bi = -1;
                    for (size_t j = 0; j < r; j++) {
                        double v = ld(dt, x, (a * r + j) * in + c);
                        sum += v;
                        if (v > best) best = v, bi = (int64_t)j;
                    }
                    want[a * in + c] = sum * 0.5;
                    yd[a * in + c] = best;
                    widx[a * in + c] = bi;
                }
            }
            int rc = ops->reduce_sum(dev, dt, o, r, in, 0.5, x, y);
            double got[40];
            for (size_t i = 0; i < o * in; i++)
                got[i] = ld(dt, y, i);
            tap_ok(rc == 0 && near_all(got, want, o * in, 0, 0, "reduce_sum"),
                   "reduce_sum %s over (%zu, %zu, %zu), alpha 0.5", fsdp_dtype_name(dt), o, r, in);
            rc = ops->reduce_max(dev, dt, o, r, in, x, y, idx);
            int ok = rc == 0;
            for (size_t i = 0; i < o * in; i++)
                ok &= ld(dt, y, i) == yd[i] && idx[i] == widx[i];
            tap_ok(ok, "reduce_max %s over (%zu, %zu, %zu) with first-max argmax",
                   fsdp_dtype_name(dt), o, r, in);
        }
    }
    /* Sums of many f32 values are reproducible to the bit. */
    float big[1000], s1[2], s2[2];
    for (int i = 0; i < 1000; i++)
        big[i] = (float)urand(-1, 1);
    ops->reduce_sum(dev, FSDP_DTYPE_F32, 2, 500, 1, 1.0, big, s1);
    ops->reduce_sum(dev, FSDP_DTYPE_F32, 2, 500, 1, 1.0, big, s2);
    double ref = 0;
    for (int i = 0; i < 500; i++)
        ref += big[i];
    tap_ok(memcmp(s1, s2, sizeof s1) == 0 && fabs(s1[0] - ref) < 1e-4,
           "reduce_sum f32 is deterministic and accurate (%g vs %g)", s1[0], ref);
    double nanx[3] = {1, NAN, 5}, nmax;
    int64_t nidx;
    ops->reduce_max(dev, FSDP_DTYPE_F64, 1, 3, 1, nanx, &nmax, &nidx);
    tap_ok(isnan(nmax) && nidx == 1, "reduce_max propagates NaN and points at it");

    double sq = 0;
    float sqf = 0;
    double v[7] = {1, 2, 3, 4, 5, 6, 7};
    float vf[7] = {1, 2, 3, 4, 5, 6, 7};
    ops->sum_squares(dev, FSDP_DTYPE_F64, 7, v, &sq);
    ops->sum_squares(dev, FSDP_DTYPE_F32, 7, vf, &sqf);
    tap_ok(sq == 140 && sqf == 140.0f, "sum_squares f64 and f32");
    fsdp_ctx_destroy(ctx);
}

/* ---- gemm ---- */

static void gemm_naive(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha,
                       const double *a, int64_t lda, const double *b, int64_t ldb, double beta,
                       double *c, int64_t ldc) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double acc = 0;
            for (int64_t p = 0; p < k; p++)
                acc +=
                    (ta ? a[p * lda + i] : a[i * lda + p]) * (tb ? b[j * ldb + p] : b[p * ldb + j]);
            c[i * ldc + j] = alpha * acc + (beta == 0 ? 0 : beta * c[i * ldc + j]);
        }
}

static void test_gemm(void) {
    fsdp_ctx_t *ctx = new_ctx(0, 1);
    fsdp_device_t *dev = fsdp_ctx_device(ctx);
    const struct fsdp_dev_ops *ops = dev->ops;
    enum { M = 5, N = 7, K = 6, PAD = 3, B = 3 };
    /* Each matrix has PAD extra columns, so the leading dimensions are not the widths. */
    enum { SA = 16 * 16, SB = 16 * 16, SC = 16 * 16 };
    double a[B * SA], b[B * SB], c0[B * SC], c[B * SC], want[B * SC];
    float af[B * SA], bf[B * SB], cf[B * SC];
    for (int i = 0; i < B * SA; i++)
        a[i] = urand(-1, 1), af[i] = (float)a[i];
    for (int i = 0; i < B * SB; i++)
        b[i] = urand(-1, 1), bf[i] = (float)b[i];
    for (int i = 0; i < B * SC; i++)
        c0[i] = urand(-1, 1);
    for (int tt = 0; tt < 4; tt++) {
        bool ta = tt & 1, tb = tt & 2;
        int64_t lda = (ta ? M : K) + PAD, ldb = (tb ? K : N) + PAD, ldc = N + PAD;
        for (int prec = 0; prec < 2; prec++) {
            fsdp_dtype_t dt = prec ? FSDP_DTYPE_F64 : FSDP_DTYPE_F32;
            double alpha = 1.5, beta = 0.25;
            memcpy(want, c0, sizeof c0);
            for (int i = 0; i < B * SC; i++)
                c[i] = c0[i], cf[i] = (float)c0[i];
            for (int bi = 0; bi < B; bi++)
                gemm_naive(ta, tb, M, N, K, alpha, a + bi * SA, lda, b + bi * SB, ldb, beta,
                           want + bi * SC, ldc);
            int rc;
            double got[B * SC];
            if (prec) {
                rc = ops->gemm(dev, dt, ta, tb, M, N, K, alpha, a, lda, SA, b, ldb, SB, beta, c,
                               ldc, SC, B);
                memcpy(got, c, sizeof c);
            } else {
                /* f32 inputs are the rounded f64 ones; compare against f64 of those. */
                double a32[B * SA], b32[B * SB];
                for (int i = 0; i < B * SA; i++)
                    a32[i] = af[i];
                for (int i = 0; i < B * SB; i++)
                    b32[i] = bf[i];
                for (int i = 0; i < B * SC; i++)
                    want[i] = (float)c0[i];
                for (int bi = 0; bi < B; bi++)
                    gemm_naive(ta, tb, M, N, K, alpha, a32 + bi * SA, lda, b32 + bi * SB, ldb, beta,
                               want + bi * SC, ldc);
                rc = ops->gemm(dev, dt, ta, tb, M, N, K, alpha, af, lda, SA, bf, ldb, SB, beta, cf,
                               ldc, SC, B);
                for (int i = 0; i < B * SC; i++)
                    got[i] = cf[i];
            }
            /* Entries outside the M x N windows (padding) must be untouched too. */
            tap_ok(rc == 0 && near_all(got, want, B * SC, prec ? 1e-12 : 1e-5, 1e-6, "gemm"),
                   "gemm %s trans_a=%d trans_b=%d, batch %d, padded leading dims",
                   fsdp_dtype_name(dt), ta, tb, B);
        }
    }
    /* beta = 0 ignores what C held (NaN included); k = 0 scales C by beta. */
    double cn[4] = {NAN, NAN, NAN, NAN}, one[4] = {1, 0, 0, 1}, two[4] = {1, 2, 3, 4};
    ops->gemm(dev, FSDP_DTYPE_F64, false, false, 2, 2, 2, 1.0, one, 2, 0, two, 2, 0, 0.0, cn, 2, 0,
              1);
    tap_ok(cn[0] == 1 && cn[1] == 2 && cn[2] == 3 && cn[3] == 4, "gemm with beta 0 overwrites NaN");
    ops->gemm(dev, FSDP_DTYPE_F64, false, false, 2, 2, 0, 1.0, NULL, 0, 0, NULL, 0, 0, 2.0, cn, 2,
              0, 1);
    tap_ok(cn[0] == 2 && cn[3] == 8, "gemm with k = 0 scales C by beta");
    tap_is_int(ops->gemm(dev, FSDP_DTYPE_F64, false, false, 2, 2, 2, 1.0, one, 1, 0, two, 2, 0, 0.0,
                         cn, 2, 0, 1),
               FSDP_EINVAL, "gemm with lda smaller than the row is refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "lda", "the message names lda");
    fsdp_ctx_destroy(ctx);
}

int main(void) {
    tap_plan_lazy();
    test_fill_cast();
    test_copy_strided();
    test_unary();
    test_binary();
    test_axpy_where();
    test_reduce();
    test_gemm();
    return tap_done();
}
