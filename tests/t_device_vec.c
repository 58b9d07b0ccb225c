/* SPDX-License-Identifier: MIT */
/*
 * t_device_vec.c: the f32 SIMD kernels of the CPU device (src/device/cpu_vec.c).
 *
 * exp and tanh are swept over a dense set of floats (every 97th bit pattern between the
 * thresholds, both signs) and compared in ulps with the double functions of libm rounded to
 * float; the special values (0, -0, +-inf, NaN, overflow and underflow edges) are checked
 * exactly. GELU and its derivative are compared with a double evaluation of the same formulas.
 * The reductions are compared with long double sums. Finally every kernel must give the same
 * bits for an element whether it sits in a full vector or in the tail, and whatever the length
 * of the array (the property that keeps results independent of shapes and of the vector width),
 * and every instruction set the build and the CPU have (AVX-512, AVX2, the baseline) must give
 * the baseline's bits in every kernel (issue 26, item 9: the run-time dispatch that replaced
 * target_clones so that clang builds the file).
 */
#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "device/cpu_vec.h"
#include "device/device_impl.h"
#include "tap.h"

#define MAX_ULP 3.0 /* the bound cpu_vec.h promises for exp and tanh */

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

/* The error of got in ulps of the float nearest to the exact value want. */
static double ulp_err(float got, double want) {
    if (isinf(want) || isinf(got)) return (double)got == want ? 0.0 : INFINITY;
    const float w = (float)want;
    int e;
    frexpf(w == 0.0f ? FLT_MIN : w, &e);
    double ulp = ldexp(1.0, e - 24);
    if (ulp < ldexp(1.0, -149)) ulp = ldexp(1.0, -149);
    return fabs((double)got - want) / ulp;
}

/* Sweeps bit patterns of |x| in [lo, hi] (every `step`-th), both signs, through fn; returns the
 * largest ulp error against ref and stores where it happened. */
typedef void (*vec_fn)(size_t n, const float *x, float *y);

static void exp_plain(size_t n, const float *x, float *y) {
    fsdp__vec_exp_f32(n, x, 0.0f, y);
}

static double sweep(vec_fn fn, double (*ref)(double), float lo, float hi, uint32_t step,
                    float *worst_x) {
    enum { CHUNK = 4099 }; /* odd, so every call has a tail */
    static float xs[CHUNK], ys[CHUNK];
    double worst = 0.0;
    *worst_x = 0.0f;
    size_t m = 0;
    for (int sign = 0; sign < 2; sign++) {
        for (uint32_t u = bits_of(lo); u <= bits_of(hi); u += step) {
            xs[m++] = sign ? -float_of(u) : float_of(u);
            if (m == CHUNK || u + step > bits_of(hi)) {
                fn(m, xs, ys);
                for (size_t i = 0; i < m; i++) {
                    const double e = ulp_err(ys[i], ref((double)xs[i]));
                    if (!(e <= worst)) {
                        worst = e;
                        *worst_x = xs[i];
                    }
                }
                m = 0;
            }
            if (u + step < u) break;
        }
    }
    return worst;
}

static double gelu_ref(double v) {
    return 0.5 * v * (1.0 + tanh(0.79788456080286535588 * (v + 0.044715 * v * v * v)));
}

static double gelu_grad_ref(double v) {
    const double b = 0.79788456080286535588, k = 0.044715;
    const double t = tanh(b * (v + k * v * v * v));
    return 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * b * (1.0 + 3.0 * k * v * v);
}

static uint64_t rng = 0x243F6A8885A308D3u;
static float uniform(float lo, float hi) {
    rng = rng * 6364136223846793005u + 1442695040888963407u;
    return lo + (hi - lo) * (float)((rng >> 40) * 0x1p-24);
}

static void test_exp(void) {
    float wx;
    /* From the smallest result that is not 0 to the largest that is finite. */
    double e = sweep(exp_plain, exp, 0.0f, 88.7f, 97, &wx);
    tap_ok(e <= MAX_ULP, "exp: |x| <= 88.7 (every 97th float) within %.0f ulp (worst %.3f at %a)",
           MAX_ULP, e, wx);
    const float sp[] = {0.0f,  -0.0f,   INFINITY, -INFINITY, NAN,     88.72f,
                        89.0f, 1000.0f, -87.3f,   -103.0f,   -104.0f, -200.0f};
    float y[12];
    fsdp__vec_exp_f32(12, sp, 0.0f, y);
    tap_ok(y[0] == 1.0f && y[1] == 1.0f, "exp(+-0) = 1");
    tap_ok(isinf(y[2]) && y[2] > 0 && y[3] == 0.0f, "exp(inf) = inf, exp(-inf) = 0");
    tap_ok(isnan(y[4]), "exp(NaN) is NaN");
    tap_ok(y[5] == expf(88.72f) && isinf(y[6]) && isinf(y[7]),
           "exp overflows exactly where libm does (%a %a %a)", y[5], y[6], y[7]);
    tap_ok(ulp_err(y[8], exp((double)sp[8])) <= MAX_ULP &&
               ulp_err(y[9], exp((double)sp[9])) <= 1.0 && y[10] == 0.0f && y[11] == 0.0f,
           "exp underflows through the subnormals to 0 (%a %a %a)", y[8], y[9], y[10]);
    /* exp(x - sub) is exp of the rounded difference. */
    const float xs[3] = {1.5f, -2.25f, 7.0f};
    float a[3], b[3], d[3];
    for (int i = 0; i < 3; i++)
        d[i] = xs[i] - 3.0f;
    fsdp__vec_exp_f32(3, xs, 3.0f, a);
    fsdp__vec_exp_f32(3, d, 0.0f, b);
    tap_is_mem(a, b, sizeof a, "exp(x - sub) is exp of the difference");
}

static void test_tanh(void) {
    float wx;
    double e = sweep(fsdp__vec_tanh_f32, tanh, 0.0f, 12.0f, 97, &wx);
    tap_ok(e <= MAX_ULP, "tanh: |x| <= 12 (every 97th float) within %.0f ulp (worst %.3f at %a)",
           MAX_ULP, e, wx);
    const float sp[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-30f, -1e-42f, 9.5f, -20.0f};
    float y[9];
    fsdp__vec_tanh_f32(9, sp, y);
    tap_ok(y[0] == 0.0f && !signbit(y[0]) && y[1] == 0.0f && signbit(y[1]), "tanh(+-0) = +-0");
    tap_ok(y[2] == 1.0f && y[3] == -1.0f, "tanh(+-inf) = +-1");
    tap_ok(isnan(y[4]), "tanh(NaN) is NaN");
    tap_ok(y[5] == 1e-30f && y[6] == -1e-42f, "tanh of tiny and subnormal x is x (%a %a)", y[5],
           y[6]);
    tap_ok(y[7] == 1.0f && y[8] == -1.0f, "tanh saturates to +-1 (%a %a)", y[7], y[8]);
}

static void test_gelu(void) {
    enum { N = 20001 };
    static float x[N], y[N], g[N], gx[N];
    for (int i = 0; i < N; i++) {
        x[i] = -12.0f + 24.0f * (float)i / (float)(N - 1);
        g[i] = uniform(-2.0f, 2.0f);
    }
    fsdp__vec_gelu_tanh_f32(N, x, y);
    fsdp__vec_gelu_tanh_bwd_f32(N, x, g, gx);
    /* The golden tests' f32 tolerance against PyTorch: rtol 1.3e-6, atol 1e-5. */
    double worst_f = 0.0, worst_b = 0.0;
    int bad_f = 0, bad_b = 0;
    for (int i = 0; i < N; i++) {
        const double rf = gelu_ref(x[i]), rb = (double)g[i] * gelu_grad_ref(x[i]);
        const double ef = fabs(y[i] - rf), eb = fabs(gx[i] - rb);
        if (ef > 1e-5 + 1.3e-6 * fabs(rf)) bad_f++;
        if (eb > 1e-5 + 1.3e-6 * fabs(rb)) bad_b++;
        if (ef / (1e-5 + 1.3e-6 * fabs(rf)) > worst_f) worst_f = ef / (1e-5 + 1.3e-6 * fabs(rf));
        if (eb / (1e-5 + 1.3e-6 * fabs(rb)) > worst_b) worst_b = eb / (1e-5 + 1.3e-6 * fabs(rb));
    }
    tap_ok(bad_f == 0,
           "gelu_tanh forward on [-12, 12] within rtol 1.3e-6 atol 1e-5 of double "
           "(%d outside, worst %.3f of the tolerance)",
           bad_f, worst_f);
    tap_ok(bad_b == 0,
           "gelu_tanh backward on [-12, 12] within rtol 1.3e-6 atol 1e-5 of double "
           "(%d outside, worst %.3f of the tolerance)",
           bad_b, worst_b);
    /* In place gives the same bits. */
    static float z[N];
    memcpy(z, x, sizeof z);
    fsdp__vec_gelu_tanh_f32(N, z, z);
    tap_is_mem(z, y, sizeof z, "gelu_tanh in place (y == x) gives the same bits");
}

static void test_reductions(void) {
    enum { N = 1037 };
    static float a[N], b[N];
    long double s = 0, d = 0;
    for (int i = 0; i < N; i++) {
        a[i] = uniform(-3.0f, 5.0f);
        b[i] = uniform(-1.0f, 1.0f);
        s += a[i];
        d += (long double)a[i] * b[i];
    }
    const double mu = (double)(s / N);
    long double ss = 0;
    for (int i = 0; i < N; i++)
        ss += ((long double)a[i] - mu) * ((long double)a[i] - mu);
    tap_is_near(fsdp__vec_sum_f32(N, a), (double)s, 1e-14, 1e-12, "sum in double");
    tap_is_near(fsdp__vec_dot_f32(N, a, b), (double)d, 1e-14, 1e-12, "dot in double");
    tap_is_near(fsdp__vec_sumsq_dev_f32(N, a, mu), (double)ss, 1e-14, 1e-12,
                "sum of squared deviations in double");
    float mx = a[0];
    for (int i = 1; i < N; i++)
        if (a[i] > mx) mx = a[i];
    tap_ok(fsdp__vec_max_f32(N, a) == mx && fsdp__vec_max_f32(1, a) == a[0], "max");
    long double es = 0;
    for (int i = 0; i < N; i++)
        es += expl((long double)a[i] - 5.0L);
    tap_is_near(fsdp__vec_exp_sum_f32(N, a, 5.0f, NULL), (double)es, 1e-6, 0.0,
                "exp_sum without storing");
    /* Layer norm's row gradient against a double evaluation of its formula. */
    static float w[N], gx[N];
    const float mt = (float)mu, rt = 0.75f;
    double sg = 0, sgx = 0;
    for (int i = 0; i < N; i++) {
        w[i] = uniform(0.5f, 1.5f);
        const float xh = (a[i] - mt) * rt, g = b[i] * w[i];
        sg += g;
        sgx += (double)g * xh;
    }
    fsdp__vec_ln_bwd_row_f32(N, a, w, mt, rt, b, gx);
    int bad = 0;
    for (int i = 0; i < N; i++) {
        const double xh = ((double)a[i] - mt) * rt, g = (double)b[i] * w[i];
        const double want = (g - sg / N - xh * (sgx / N)) * rt;
        if (fabs(gx[i] - want) > 1e-6 + 1e-5 * fabs(want)) bad++;
    }
    tap_is_int(bad, 0, "layer norm row gradient matches the formula in double");
}

/* Every kernel gives an element the same bits at every offset and array length. */
static void test_position_independent(void) {
    enum { N = 77 };
    float x[N], g[N], ref[4][N], got[N];
    for (int i = 0; i < N; i++) {
        x[i] = uniform(-6.0f, 6.0f);
        g[i] = uniform(-1.0f, 1.0f);
    }
    fsdp__vec_exp_f32(N, x, 0.5f, ref[0]);
    fsdp__vec_tanh_f32(N, x, ref[1]);
    fsdp__vec_gelu_tanh_f32(N, x, ref[2]);
    fsdp__vec_gelu_tanh_bwd_f32(N, x, g, ref[3]);
    int bad = 0;
    for (int off = 0; off < N; off += 5) {
        for (size_t len = 1; off + len <= N; len += 7) {
            fsdp__vec_exp_f32(len, x + off, 0.5f, got);
            bad += memcmp(got, ref[0] + off, len * sizeof(float)) != 0;
            fsdp__vec_tanh_f32(len, x + off, got);
            bad += memcmp(got, ref[1] + off, len * sizeof(float)) != 0;
            fsdp__vec_gelu_tanh_f32(len, x + off, got);
            bad += memcmp(got, ref[2] + off, len * sizeof(float)) != 0;
            fsdp__vec_gelu_tanh_bwd_f32(len, x + off, g + off, got);
            bad += memcmp(got, ref[3] + off, len * sizeof(float)) != 0;
        }
    }
    tap_is_int(bad, 0, "exp, tanh, gelu and its gradient: same bits at every offset and length");
}

/* Runs every kernel over inputs of many lengths and appends the result bits to out (at most
 * cap bytes); returns the number of bytes. x holds wide-ranging finite values, then infinities,
 * NaN, zeros and subnormals; g is finite (two different NaNs meeting could keep either). */
static size_t run_all_kernels(unsigned char *out, size_t cap) {
    enum { N = 203 };
    static float x[N], fin[N], g[N], w[N], y[N];
    uint64_t s = 0x9E3779B97F4A7C15u;
    for (int i = 0; i < N; i++) {
        s = s * 6364136223846793005u + 1442695040888963407u;
        const float m = (float)(s >> 40) / (float)(1u << 24) * 2.0f - 1.0f; /* [-1, 1) */
        x[i] = ldexpf(m, (int)(s >> 20) % 16 - 6); /* |x| up to 512: exp overflows */
        g[i] = ldexpf(m, (int)(s >> 28) % 8 - 4);
        w[i] = 1.0f - m / 4.0f;
    }
    memcpy(fin, x, sizeof fin); /* finite, for the reductions (inf - inf has no sign to agree on) */
    const float sp[] = {INFINITY, -INFINITY, NAN, 0.0f, -0.0f, 1e-42f, -3e-39f, 88.72f, -103.9f};
    memcpy(x + N - 9, sp, sizeof sp);
    size_t n = 0;
#define PUTN(p, bytes)                                                                             \
    do {                                                                                           \
        if (n + (bytes) <= cap) memcpy(out + n, (p), (bytes));                                     \
        n += (bytes);                                                                              \
    } while (0)
#define PUT(v) PUTN(&(v), sizeof(v))
#define PUTY() PUTN(y, len * sizeof(float))
    for (size_t len = 1; len <= N; len += len < 40 ? 1 : 23) {
        const float *xs = x + (N - len); /* the specials are in every length's tail */
        fsdp__vec_exp_f32(len, xs, 0.25f, y);
        PUTY();
        double d = fsdp__vec_exp_sum_f32(len, fin, 3.0f, y);
        PUT(d);
        PUTY();
        fsdp__vec_tanh_f32(len, xs, y);
        PUTY();
        fsdp__vec_gelu_tanh_f32(len, xs, y);
        PUTY();
        fsdp__vec_gelu_tanh_bwd_f32(len, xs, g, y);
        PUTY();
        float f = fsdp__vec_max_f32(len, fin);
        PUT(f);
        d = fsdp__vec_sum_f32(len, fin);
        PUT(d);
        d = fsdp__vec_sumsq_dev_f32(len, fin, 0.125);
        PUT(d);
        d = fsdp__vec_dot_f32(len, fin, g);
        PUT(d);
        fsdp__vec_ln_bwd_row_f32(len, fin, w, 0.5f, 1.5f, g, y);
        PUTY();
        fsdp__vec_ln_bwd_row_f32(len, fin, NULL, -0.5f, 0.75f, g, y);
        PUTY();
    }
#undef PUTY
#undef PUT
#undef PUTN
    return n;
}

/* The dispatch picks the best instruction set the CPU has, and every one gives the same bits. */
static void test_instruction_sets(void) {
    const int chosen = fsdp__vec_isa();
    int best = FSDP_VEC_BASE;
    for (int isa = FSDP_VEC_BASE; isa < FSDP_VEC_NISA; isa++)
        if (fsdp__vec_set_isa(isa) == 0) best = isa;
    tap_is_int(chosen, best,
               "the kernels run on the best instruction set of this CPU and build (%s)",
               fsdp__vec_isa_name(chosen));
    tap_ok(fsdp__vec_set_isa(-1) != 0 && fsdp__vec_set_isa(FSDP_VEC_NISA) != 0,
           "an unknown instruction set is refused");

    static unsigned char ref[1 << 20], got[1 << 20];
    if (fsdp__vec_set_isa(FSDP_VEC_BASE) != 0) tap_bail("the baseline kernels are missing");
    const size_t n = run_all_kernels(ref, sizeof ref);
    if (n > sizeof ref) tap_bail("run_all_kernels needs %zu bytes", n);
    uint64_t h = 1469598103934665603u; /* FNV-1a of the bits, to compare builds by eye */
    for (size_t i = 0; i < n; i++)
        h = (h ^ ref[i]) * 1099511628211u;
    tap_diag("base: %zu bytes of results, FNV-1a %016llx", n, (unsigned long long)h);
    for (int isa = FSDP_VEC_AVX2; isa < FSDP_VEC_NISA; isa++) {
        if (fsdp__vec_set_isa(isa) != 0) {
            char why[64];
            snprintf(why, sizeof why, "this CPU or build has no %s", fsdp__vec_isa_name(isa));
            tap_skip(1, why);
            continue;
        }
        const size_t m = run_all_kernels(got, sizeof got);
        tap_ok(m == n && memcmp(got, ref, n) == 0,
               "%s gives the baseline's bits in all ten kernels (%zu bytes compared)",
               fsdp__vec_isa_name(isa), n);
    }
    fsdp__vec_set_isa(chosen);
}

/* The software prefetch (cpu_vec.h) changes no bit: GELU forward and backward, and exp, over
 * lengths around the prefetch distance (512 floats), with and without it, on every instruction
 * set. */
static void test_prefetch(void) {
    const char *env = getenv("FSDP_PREFETCH");
    const bool want = !(env && strcmp(env, "0") == 0);
    tap_ok(fsdp__vec_prefetch_on() == want, "prefetch is %s by default (FSDP_PREFETCH %s)",
           want ? "on" : "off", env ? env : "unset");
    fsdp__vec_set_prefetch(false);
    const bool off = !fsdp__vec_prefetch_on();
    fsdp__vec_set_prefetch(true);
    tap_ok(off && fsdp__vec_prefetch_on(), "fsdp__vec_set_prefetch turns it off and on");

    enum { N = 70001 };
    static float x[N], g[N], y0[N], y1[N], gx0[N], gx1[N], e0[N], e1[N];
    for (size_t i = 0; i < N; i++) {
        x[i] = uniform(-6.0f, 6.0f);
        g[i] = uniform(-1.0f, 1.0f);
    }
    const size_t lens[] = {1, 511, 512, 513, 527, 528, 529, 4099, N};
    const int chosen = fsdp__vec_isa();
    for (int isa = FSDP_VEC_BASE; isa < FSDP_VEC_NISA; isa++) {
        if (fsdp__vec_set_isa(isa) != 0) continue;
        bool same = true;
        for (size_t c = 0; c < sizeof lens / sizeof lens[0]; c++) {
            const size_t n = lens[c];
            fsdp__vec_set_prefetch(false);
            fsdp__vec_gelu_tanh_f32(n, x, y0);
            fsdp__vec_gelu_tanh_bwd_f32(n, x, g, gx0);
            fsdp__vec_exp_f32(n, x, 0.5f, e0);
            fsdp__vec_set_prefetch(true);
            fsdp__vec_gelu_tanh_f32(n, x, y1);
            fsdp__vec_gelu_tanh_bwd_f32(n, x, g, gx1);
            fsdp__vec_exp_f32(n, x, 0.5f, e1);
            same = same && memcmp(y0, y1, n * sizeof *y0) == 0 &&
                   memcmp(gx0, gx1, n * sizeof *gx0) == 0 && memcmp(e0, e1, n * sizeof *e0) == 0;
        }
        tap_ok(same,
               "%s: GELU, its backward and exp give the same bits with and without prefetch, "
               "at lengths 1 to %d",
               fsdp__vec_isa_name(isa), N);
    }
    fsdp__vec_set_isa(chosen);
    fsdp__vec_set_prefetch(want);
}

/* Layer norm's backward prefetches the rows two ahead (cpu_nn_kernels.c): the same bits of gx
 * and gw with and without it, f32 and f64, with and without a weight. */
static void test_prefetch_layer_norm(void) {
    enum { R = 9, C = 384 };
    const struct fsdp_dev_ops *ops = &fsdp__cpu_dev_ops;
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    fsdp_ctx_t *ctx = NULL;
    fsdp_device_t *dev = NULL;
    if (fsdp_ctx_create(&o, &ctx) < 0 || fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &dev) < 0)
        tap_bail("no CPU device");
    static float fx[R * C], fg[R * C], fw[C], fy[R * C], fm[R], fs[R];
    static double dx[R * C], dg[R * C], dw[C], dy[R * C], dm[R], ds[R];
    for (size_t i = 0; i < R * C; i++) {
        dx[i] = fx[i] = uniform(-2.0f, 2.0f);
        dg[i] = fg[i] = uniform(-1.0f, 1.0f);
    }
    for (size_t j = 0; j < C; j++)
        dw[j] = fw[j] = uniform(0.0f, 2.0f);
    ops->layer_norm(dev, FSDP_DTYPE_F32, R, C, 1e-5, fx, fw, NULL, fy, fm, fs);
    ops->layer_norm(dev, FSDP_DTYPE_F64, R, C, 1e-5, dx, dw, NULL, dy, dm, ds);
    bool same = true;
    for (int wt = 0; wt < 2; wt++) {
        static float sgx[2][R * C], sgw[2][C];
        static double dgx[2][R * C], dgw[2][C];
        memset(sgw, 0, sizeof sgw);
        memset(dgw, 0, sizeof dgw);
        for (int on = 0; on < 2; on++) {
            fsdp__vec_set_prefetch(on);
            ops->layer_norm_backward(dev, FSDP_DTYPE_F32, R, C, fx, wt ? fw : NULL, fm, fs, fg,
                                     sgx[on], sgw[on], NULL);
            ops->layer_norm_backward(dev, FSDP_DTYPE_F64, R, C, dx, wt ? dw : NULL, dm, ds, dg,
                                     dgx[on], dgw[on], NULL);
        }
        same = same && memcmp(sgx[0], sgx[1], sizeof sgx[0]) == 0 &&
               memcmp(sgw[0], sgw[1], sizeof sgw[0]) == 0 &&
               memcmp(dgx[0], dgx[1], sizeof dgx[0]) == 0 &&
               memcmp(dgw[0], dgw[1], sizeof dgw[0]) == 0;
    }
    fsdp__vec_set_prefetch(true);
    tap_ok(same,
           "layer_norm backward: the same bits with and without prefetch (%d rows of %d, f32 and "
           "f64, with and without a weight)",
           R, C);
    fsdp_device_destroy(dev);
    fsdp_ctx_destroy(ctx);
}

int main(void) {
    tap_plan_lazy();
    test_instruction_sets();
    test_exp();
    test_tanh();
    test_gelu();
    test_reductions();
    test_position_independent();
    test_prefetch();
    test_prefetch_layer_norm();
    return tap_done();
}
