/* SPDX-License-Identifier: MIT */
/*
 * t_device_nn.c: the CPU device's nn kernels (softmax, layer/batch norm, embedding,
 * cross-entropy, dropout, SGD, Adam) called through the vtable.
 *
 * Every forward is compared with a naive double-precision reference written here, every
 * backward with central finite differences of a scalar loss sum(out * r) in f64, and every f32
 * kernel with its f64 twin on the same (float-representable) inputs. Dropout is checked for
 * reproducibility and against the documented Philox mapping, which a CUDA kernel must follow
 * bit for bit. Inputs come from a fixed generator, so a failure reproduces.
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "device/device_impl.h"
#include "tap.h"

#define F32 FSDP_DTYPE_F32
#define F64 FSDP_DTYPE_F64

/* Central-difference step, and the tolerance a kernel's gradient must meet against it: the
 * step's truncation error is ~h^2 and its rounding error ~1e-16 / h, both far below these. */
#define FD_H 1e-6
#define FD_RTOL 1e-6
#define FD_ATOL 1e-7

/* f32 kernels against their f64 twins: a few float ulps of accumulated rounding. */
#define F32_RTOL 1e-5
#define F32_ATOL 1e-6

static fsdp_device_t *dev;
static const struct fsdp_dev_ops *ops = &fsdp__cpu_dev_ops;

/* ---- helpers ---- */

static uint64_t rng_state = 0x9E3779B97F4A7C15u;

/* xorshift64*, mapped to [lo, hi) and rounded through float, so that the f32 and f64 kernels
 * see the same inputs. */
static double urand(double lo, double hi) {
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    uint64_t r = rng_state * 0x2545F4914F6CDD1Du;
    double u = (double)(r >> 11) * 0x1p-53;
    return (double)(float)(lo + (hi - lo) * u);
}

static double *dvec(size_t n) {
    return calloc(n ? n : 1, sizeof(double));
}

static double *drand_vec(size_t n, double lo, double hi) {
    double *a = dvec(n);
    for (size_t i = 0; i < n; i++)
        a[i] = urand(lo, hi);
    return a;
}

static float *to_f32(const double *a, size_t n) {
    float *f = calloc(n ? n : 1, sizeof(float));
    for (size_t i = 0; i < n; i++)
        f[i] = (float)a[i];
    return f;
}

static double *from_f32(const float *f, size_t n) {
    double *a = dvec(n);
    for (size_t i = 0; i < n; i++)
        a[i] = f[i];
    return a;
}

static double dot(const double *a, const double *b, size_t n) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}

/* One TAP line for an array: passes when every |got - want| <= atol + rtol |want|, and on
 * failure prints the worst element. */
static void check_close(const double *got, const double *want, size_t n, double rtol, double atol,
                        const char *name) {
    size_t worst = 0;
    double wr = -1.0;
    for (size_t i = 0; i < n; i++) {
        double r = fabs(got[i] - want[i]) / (atol + rtol * fabs(want[i]));
        if (isnan(got[i]) != isnan(want[i])) r = INFINITY;
        if (r > wr) {
            wr = r;
            worst = i;
        }
    }
    if (n == 0) {
        tap_ok(1, "%s (empty)", name);
        return;
    }
    tap_is_near(got[worst], want[worst], rtol, atol, "%s (worst of %zu at %zu)", name, n, worst);
}

/* Same for an f32 result against a double reference. */
static void check_close_f32(const float *got, const double *want, size_t n, double rtol,
                            double atol, const char *name) {
    double *g = from_f32(got, n);
    check_close(g, want, n, rtol, atol, name);
    free(g);
}

/* d f / d param[i] by central differences; f reads param through its argument. */
typedef double (*objective_fn)(void *arg);

static void fd_grad(objective_fn f, void *arg, double *param, size_t n, double *out) {
    for (size_t i = 0; i < n; i++) {
        double s = param[i];
        param[i] = s + FD_H;
        double lp = f(arg);
        param[i] = s - FD_H;
        double lm = f(arg);
        param[i] = s;
        out[i] = (lp - lm) / (2.0 * FD_H);
    }
}

/* ---- softmax ---- */

static void ref_softmax(bool lg, size_t rows, size_t n, const double *x, double *y) {
    for (size_t r = 0; r < rows; r++) {
        const double *xr = x + r * n;
        double m = xr[0], s = 0.0;
        for (size_t j = 1; j < n; j++)
            m = fmax(m, xr[j]);
        for (size_t j = 0; j < n; j++)
            s += exp(xr[j] - m);
        for (size_t j = 0; j < n; j++)
            y[r * n + j] = lg ? xr[j] - m - log(s) : exp(xr[j] - m) / s;
    }
}

typedef struct {
    bool lg;
    size_t rows, n;
    double *x, *y, *r;
} softmax_arg_t;

static double softmax_obj(void *p) {
    softmax_arg_t *a = p;
    ops->softmax(dev, F64, a->lg, a->rows, a->n, a->x, a->y);
    return dot(a->y, a->r, a->rows * a->n);
}

static void test_softmax(void) {
    const size_t rows = 5, n = 7, sz = rows * n;
    for (int lg = 0; lg <= 1; lg++) {
        const char *nm = lg ? "log_softmax" : "softmax";
        char name[128];
        double *x = drand_vec(sz, -3.0, 3.0);
        /* A row far from 0 overflows exp() unless the maximum is subtracted first. */
        for (size_t j = 0; j < n; j++)
            x[2 * n + j] = (double)(float)(x[2 * n + j] + 1000.0);
        double *y = dvec(sz), *want = dvec(sz);
        ref_softmax(lg, rows, n, x, want);
        tap_is_int(ops->softmax(dev, F64, lg, rows, n, x, y), FSDP_OK, "%s f64 returns 0", nm);
        snprintf(name, sizeof name, "%s f64 matches the reference", nm);
        check_close(y, want, sz, 1e-13, 1e-15, name);

        float *xf = to_f32(x, sz), *yf = calloc(sz, sizeof(float));
        ops->softmax(dev, F32, lg, rows, n, xf, yf);
        snprintf(name, sizeof name, "%s f32 matches the reference", nm);
        check_close_f32(yf, want, sz, 2e-6, 1e-6, name);
        bool finite = true;
        for (size_t i = 0; i < sz; i++)
            finite = finite && isfinite(yf[i]);
        tap_ok(finite, "%s f32 stays finite for logits near 1000", nm);
        /* In place (y aliases x) gives the same bits. */
        float *inplace = to_f32(x, sz);
        ops->softmax(dev, F32, lg, rows, n, inplace, inplace);
        tap_is_mem(inplace, yf, sz * sizeof(float), "%s f32 in place is bitwise the same", nm);
        free(inplace);

        /* Backward: loss = sum(y * r). */
        double *r = drand_vec(sz, -1.0, 1.0), *gx = dvec(sz), *fd = dvec(sz);
        softmax_arg_t a = {lg, rows, n, x, dvec(sz), r};
        ops->softmax(dev, F64, lg, rows, n, x, y);
        tap_is_int(ops->softmax_backward(dev, F64, lg, rows, n, y, r, gx), FSDP_OK,
                   "%s backward f64 returns 0", nm);
        fd_grad(softmax_obj, &a, x, sz, fd);
        snprintf(name, sizeof name, "%s backward f64 matches finite differences", nm);
        check_close(gx, fd, sz, FD_RTOL, FD_ATOL, name);

        float *rf = to_f32(r, sz), *gxf = calloc(sz, sizeof(float));
        ops->softmax(dev, F32, lg, rows, n, xf, yf);
        ops->softmax_backward(dev, F32, lg, rows, n, yf, rf, gxf);
        snprintf(name, sizeof name, "%s backward f32 matches f64", nm);
        check_close_f32(gxf, gx, sz, F32_RTOL, F32_ATOL, name);

        free(x);
        free(y);
        free(want);
        free(xf);
        free(yf);
        free(r);
        free(gx);
        free(fd);
        free(a.y);
        free(rf);
        free(gxf);
    }
}

/* ---- layer norm ---- */

static void ref_layer_norm(size_t rows, size_t n, double eps, const double *x, const double *w,
                           const double *b, double *y, double *mean, double *rstd) {
    for (size_t r = 0; r < rows; r++) {
        const double *xr = x + r * n;
        double m = 0.0, v = 0.0;
        for (size_t j = 0; j < n; j++)
            m += xr[j];
        m /= (double)n;
        for (size_t j = 0; j < n; j++)
            v += (xr[j] - m) * (xr[j] - m);
        v /= (double)n;
        double rs = 1.0 / sqrt(v + eps);
        mean[r] = m;
        rstd[r] = rs;
        for (size_t j = 0; j < n; j++)
            y[r * n + j] = (xr[j] - m) * rs * (w ? w[j] : 1.0) + (b ? b[j] : 0.0);
    }
}

typedef struct {
    size_t rows, n;
    double eps;
    double *x, *w, *b, *y, *mean, *rstd, *r;
} ln_arg_t;

static double ln_obj(void *p) {
    ln_arg_t *a = p;
    ops->layer_norm(dev, F64, a->rows, a->n, a->eps, a->x, a->w, a->b, a->y, a->mean, a->rstd);
    return dot(a->y, a->r, a->rows * a->n);
}

static void test_layer_norm(void) {
    const size_t rows = 4, n = 9, sz = rows * n;
    const double eps = 1e-5;
    double *x = drand_vec(sz, -2.0, 3.0), *w = drand_vec(n, 0.5, 1.5), *b = drand_vec(n, -1, 1);
    double *y = dvec(sz), *mean = dvec(rows), *rstd = dvec(rows);
    double *wy = dvec(sz), *wmean = dvec(rows), *wrstd = dvec(rows);

    ref_layer_norm(rows, n, eps, x, w, b, wy, wmean, wrstd);
    tap_is_int(ops->layer_norm(dev, F64, rows, n, eps, x, w, b, y, mean, rstd), FSDP_OK,
               "layer_norm f64 returns 0");
    check_close(y, wy, sz, 1e-13, 1e-14, "layer_norm f64 y matches the reference");
    check_close(mean, wmean, rows, 1e-14, 1e-15, "layer_norm f64 mean matches");
    check_close(rstd, wrstd, rows, 1e-14, 1e-15, "layer_norm f64 rstd matches");
    ref_layer_norm(rows, n, eps, x, NULL, NULL, wy, wmean, wrstd);
    ops->layer_norm(dev, F64, rows, n, eps, x, NULL, NULL, y, mean, rstd);
    check_close(y, wy, sz, 1e-13, 1e-14, "layer_norm f64 without weight and bias");
    ref_layer_norm(rows, n, eps, x, NULL, b, wy, wmean, wrstd);
    ops->layer_norm(dev, F64, rows, n, eps, x, NULL, b, y, mean, rstd);
    check_close(y, wy, sz, 1e-13, 1e-14, "layer_norm f64 with bias only");

    float *xf = to_f32(x, sz), *wf = to_f32(w, n), *bf = to_f32(b, n);
    float *yf = calloc(sz, sizeof(float)), *mf = calloc(rows, sizeof(float));
    float *rf = calloc(rows, sizeof(float));
    ref_layer_norm(rows, n, eps, x, w, b, wy, wmean, wrstd);
    ops->layer_norm(dev, F32, rows, n, eps, xf, wf, bf, yf, mf, rf);
    check_close_f32(yf, wy, sz, 2e-6, 2e-6, "layer_norm f32 y matches the reference");
    check_close_f32(rf, wrstd, rows, 2e-7, 0, "layer_norm f32 rstd matches");

    /* Backward against finite differences, with gw and gb accumulating onto 0.5 and -0.25. */
    double *r = drand_vec(sz, -1.0, 1.0), *fd = dvec(sz), *gx = dvec(sz);
    double *gw = dvec(n), *gb = dvec(n);
    for (size_t j = 0; j < n; j++) {
        gw[j] = 0.5;
        gb[j] = -0.25;
    }
    ln_arg_t a = {rows, n, eps, x, w, b, dvec(sz), dvec(rows), dvec(rows), r};
    ops->layer_norm(dev, F64, rows, n, eps, x, w, b, y, mean, rstd);
    tap_is_int(ops->layer_norm_backward(dev, F64, rows, n, x, w, mean, rstd, r, gx, gw, gb),
               FSDP_OK, "layer_norm backward f64 returns 0");
    fd_grad(ln_obj, &a, x, sz, fd);
    check_close(gx, fd, sz, FD_RTOL, FD_ATOL, "layer_norm backward gx matches finite diffs");
    for (size_t j = 0; j < n; j++) {
        gw[j] -= 0.5;
        gb[j] += 0.25;
    }
    fd_grad(ln_obj, &a, w, n, fd);
    check_close(gw, fd, n, FD_RTOL, FD_ATOL, "layer_norm backward gw accumulates the gradient");
    fd_grad(ln_obj, &a, b, n, fd);
    check_close(gb, fd, n, FD_RTOL, FD_ATOL, "layer_norm backward gb accumulates the gradient");

    /* gx may be skipped; the weight gradients do not change. */
    double *gw2 = dvec(n);
    ops->layer_norm_backward(dev, F64, rows, n, x, w, mean, rstd, r, NULL, gw2, NULL);
    check_close(gw2, gw, n, 1e-15, 0, "layer_norm backward without gx gives the same gw");

    /* Without a weight. */
    a.w = NULL;
    ops->layer_norm(dev, F64, rows, n, eps, x, NULL, b, y, mean, rstd);
    ops->layer_norm_backward(dev, F64, rows, n, x, NULL, mean, rstd, r, gx, NULL, NULL);
    fd_grad(ln_obj, &a, x, sz, fd);
    check_close(gx, fd, sz, FD_RTOL, FD_ATOL, "layer_norm backward without weight: gx");

    /* f32 backward against f64. */
    ops->layer_norm(dev, F64, rows, n, eps, x, w, b, y, mean, rstd);
    memset(gw, 0, n * sizeof *gw);
    memset(gb, 0, n * sizeof *gb);
    ops->layer_norm_backward(dev, F64, rows, n, x, w, mean, rstd, r, gx, gw, gb);
    float *rrf = to_f32(r, sz), *gxf = calloc(sz, sizeof(float));
    float *gwf = calloc(n, sizeof(float)), *gbf = calloc(n, sizeof(float));
    ops->layer_norm(dev, F32, rows, n, eps, xf, wf, bf, yf, mf, rf);
    ops->layer_norm_backward(dev, F32, rows, n, xf, wf, mf, rf, rrf, gxf, gwf, gbf);
    check_close_f32(gxf, gx, sz, F32_RTOL, F32_ATOL, "layer_norm backward f32 gx matches f64");
    check_close_f32(gwf, gw, n, F32_RTOL, F32_ATOL, "layer_norm backward f32 gw matches f64");
    check_close_f32(gbf, gb, n, F32_RTOL, F32_ATOL, "layer_norm backward f32 gb matches f64");

    /* Rows wider than the kernel's column chunk: gw and gb against direct sums. */
    const size_t r2 = 3, n2 = 300, sz2 = r2 * n2;
    double *x2 = drand_vec(sz2, -1, 1), *g2 = drand_vec(sz2, -1, 1), *y2 = dvec(sz2);
    double *m2 = dvec(r2), *s2 = dvec(r2), *gw3 = dvec(n2), *gb3 = dvec(n2);
    double *ww = dvec(n2), *wb = dvec(n2);
    ops->layer_norm(dev, F64, r2, n2, eps, x2, NULL, NULL, y2, m2, s2);
    ops->layer_norm_backward(dev, F64, r2, n2, x2, NULL, m2, s2, g2, NULL, gw3, gb3);
    for (size_t i = 0; i < r2; i++)
        for (size_t j = 0; j < n2; j++) {
            ww[j] += g2[i * n2 + j] * (x2[i * n2 + j] - m2[i]) * s2[i];
            wb[j] += g2[i * n2 + j];
        }
    check_close(gw3, ww, n2, 1e-13, 1e-14, "layer_norm backward gw over 300 columns");
    check_close(gb3, wb, n2, 1e-13, 1e-14, "layer_norm backward gb over 300 columns");

    free(x), free(w), free(b), free(y), free(mean), free(rstd), free(wy), free(wmean);
    free(wrstd), free(xf), free(wf), free(bf), free(yf), free(mf), free(rf), free(r), free(fd);
    free(gx), free(gw), free(gb), free(a.y), free(a.mean), free(a.rstd), free(gw2), free(rrf);
    free(gxf), free(gwf), free(gbf), free(x2), free(g2), free(y2), free(m2), free(s2);
    free(gw3), free(gb3), free(ww), free(wb);
}

/* ---- batch norm ---- */

static void ref_batch_norm(bool train, size_t nb, size_t c, size_t l, double eps, double momentum,
                           const double *x, const double *w, const double *b, double *rm,
                           double *rv, double *y, double *mean, double *rstd) {
    const double cnt = (double)(nb * l);
    for (size_t ch = 0; ch < c; ch++) {
        double m = 0.0, v = 0.0;
        if (train) {
            for (size_t i = 0; i < nb; i++)
                for (size_t k = 0; k < l; k++)
                    m += x[(i * c + ch) * l + k];
            m /= cnt;
            for (size_t i = 0; i < nb; i++)
                for (size_t k = 0; k < l; k++) {
                    double d = x[(i * c + ch) * l + k] - m;
                    v += d * d;
                }
            if (rm) rm[ch] = (1 - momentum) * rm[ch] + momentum * m;
            if (rv) rv[ch] = (1 - momentum) * rv[ch] + momentum * v / (cnt - 1);
            v /= cnt;
        } else {
            m = rm[ch];
            v = rv[ch];
        }
        mean[ch] = m;
        rstd[ch] = 1.0 / sqrt(v + eps);
        for (size_t i = 0; i < nb; i++)
            for (size_t k = 0; k < l; k++) {
                size_t e = (i * c + ch) * l + k;
                y[e] = (x[e] - m) * rstd[ch] * (w ? w[ch] : 1.0) + (b ? b[ch] : 0.0);
            }
    }
}

typedef struct {
    bool train;
    size_t nb, c, l;
    double eps;
    double *x, *w, *b, *rm, *rv, *y, *mean, *rstd, *r;
} bn_arg_t;

static double bn_obj(void *p) {
    bn_arg_t *a = p;
    ops->batch_norm(dev, F64, a->train, a->nb, a->c, a->l, a->eps, 0.1, a->x, a->w, a->b, a->rm,
                    a->rv, a->y, a->mean, a->rstd);
    return dot(a->y, a->r, a->nb * a->c * a->l);
}

static void test_batch_norm(void) {
    const size_t nb = 3, c = 4, l = 5, sz = nb * c * l;
    const double eps = 1e-5, mom = 0.1;
    double *x = drand_vec(sz, -1.0, 2.0), *w = drand_vec(c, 0.5, 1.5), *b = drand_vec(c, -1, 1);
    double *rm0 = drand_vec(c, -0.5, 0.5), *rv0 = drand_vec(c, 0.5, 2.0);
    double *rm = dvec(c), *rv = dvec(c), *wrm = dvec(c), *wrv = dvec(c);
    double *y = dvec(sz), *mean = dvec(c), *rstd = dvec(c);
    double *wy = dvec(sz), *wmean = dvec(c), *wrstd = dvec(c);
    const size_t cb = c * sizeof(double);

    /* Training forward, running statistics updated with the unbiased variance. */
    memcpy(rm, rm0, cb), memcpy(rv, rv0, cb), memcpy(wrm, rm0, cb), memcpy(wrv, rv0, cb);
    ref_batch_norm(true, nb, c, l, eps, mom, x, w, b, wrm, wrv, wy, wmean, wrstd);
    tap_is_int(ops->batch_norm(dev, F64, true, nb, c, l, eps, mom, x, w, b, rm, rv, y, mean, rstd),
               FSDP_OK, "batch_norm train f64 returns 0");
    check_close(y, wy, sz, 1e-13, 1e-14, "batch_norm train f64 y matches the reference");
    check_close(mean, wmean, c, 1e-14, 1e-15, "batch_norm train f64 mean matches");
    check_close(rstd, wrstd, c, 1e-14, 1e-15, "batch_norm train f64 rstd matches");
    check_close(rm, wrm, c, 1e-14, 1e-15, "batch_norm running_mean update matches");
    check_close(rv, wrv, c, 1e-14, 1e-15, "batch_norm running_var update (unbiased) matches");

    float *xf = to_f32(x, sz), *wf = to_f32(w, c), *bf = to_f32(b, c);
    float *rmf = to_f32(rm0, c), *rvf = to_f32(rv0, c), *yf = calloc(sz, sizeof(float));
    float *mf = calloc(c, sizeof(float)), *sf = calloc(c, sizeof(float));
    ops->batch_norm(dev, F32, true, nb, c, l, eps, mom, xf, wf, bf, rmf, rvf, yf, mf, sf);
    check_close_f32(yf, wy, sz, 2e-6, 2e-6, "batch_norm train f32 y matches the reference");
    check_close_f32(rmf, wrm, c, 2e-7, 1e-7, "batch_norm f32 running_mean matches");
    check_close_f32(rvf, wrv, c, 2e-7, 1e-7, "batch_norm f32 running_var matches");

    /* Evaluation: the running statistics normalize and are left alone. */
    ref_batch_norm(false, nb, c, l, eps, mom, x, w, b, rm0, rv0, wy, wmean, wrstd);
    memcpy(rm, rm0, cb), memcpy(rv, rv0, cb);
    ops->batch_norm(dev, F64, false, nb, c, l, eps, mom, x, w, b, rm, rv, y, mean, rstd);
    check_close(y, wy, sz, 1e-13, 1e-14, "batch_norm eval f64 y uses the running stats");
    check_close(rstd, wrstd, c, 1e-14, 1e-15, "batch_norm eval rstd from running_var");
    tap_ok(memcmp(rm, rm0, cb) == 0 && memcmp(rv, rv0, cb) == 0,
           "batch_norm eval leaves the running stats unchanged");
    tap_is_int(
        ops->batch_norm(dev, F64, false, nb, c, l, eps, mom, x, w, b, NULL, NULL, y, mean, rstd),
        FSDP_EINVAL, "batch_norm eval without running stats is rejected");

    /* Backward, both modes, against finite differences of the matching forward. */
    double *r = drand_vec(sz, -1.0, 1.0), *fd = dvec(sz), *gx = dvec(sz);
    double *gw = dvec(c), *gb = dvec(c);
    for (int train = 1; train >= 0; train--) {
        const char *md = train ? "train" : "eval";
        char name[128];
        bn_arg_t a = {
            train,    nb,      c,       l, eps, x, w, b, train ? NULL : rm0, train ? NULL : rv0,
            dvec(sz), dvec(c), dvec(c), r};
        for (size_t j = 0; j < c; j++) {
            gw[j] = 0.5;
            gb[j] = -0.25;
        }
        bn_obj(&a);
        tap_is_int(ops->batch_norm_backward(dev, F64, train, nb, c, l, x, w, a.mean, a.rstd, r, gx,
                                            gw, gb),
                   FSDP_OK, "batch_norm backward %s returns 0", md);
        for (size_t j = 0; j < c; j++) {
            gw[j] -= 0.5;
            gb[j] += 0.25;
        }
        fd_grad(bn_obj, &a, x, sz, fd);
        snprintf(name, sizeof name, "batch_norm backward %s gx matches finite diffs", md);
        check_close(gx, fd, sz, FD_RTOL, FD_ATOL, name);
        fd_grad(bn_obj, &a, w, c, fd);
        snprintf(name, sizeof name, "batch_norm backward %s gw accumulates the gradient", md);
        check_close(gw, fd, c, FD_RTOL, FD_ATOL, name);
        fd_grad(bn_obj, &a, b, c, fd);
        snprintf(name, sizeof name, "batch_norm backward %s gb accumulates the gradient", md);
        check_close(gb, fd, c, FD_RTOL, FD_ATOL, name);

        /* f32 against f64 (gw and gb start from 0 here). */
        float *rrf = to_f32(r, sz), *gxf = calloc(sz, sizeof(float));
        float *gwf = calloc(c, sizeof(float)), *gbf = calloc(c, sizeof(float));
        float *rm0f = to_f32(rm0, c), *rv0f = to_f32(rv0, c);
        ops->batch_norm(dev, F32, train, nb, c, l, eps, mom, xf, wf, bf, train ? NULL : rm0f,
                        train ? NULL : rv0f, yf, mf, sf);
        ops->batch_norm_backward(dev, F32, train, nb, c, l, xf, wf, mf, sf, rrf, gxf, gwf, gbf);
        snprintf(name, sizeof name, "batch_norm backward %s f32 gx matches f64", md);
        check_close_f32(gxf, gx, sz, F32_RTOL, F32_ATOL, name);
        snprintf(name, sizeof name, "batch_norm backward %s f32 gw matches f64", md);
        check_close_f32(gwf, gw, c, F32_RTOL, F32_ATOL, name);

        /* gx may be skipped. */
        double *gw2 = dvec(c);
        ops->batch_norm_backward(dev, F64, train, nb, c, l, x, w, a.mean, a.rstd, r, NULL, gw2,
                                 NULL);
        snprintf(name, sizeof name, "batch_norm backward %s without gx gives the same gw", md);
        check_close(gw2, gw, c, 1e-14, 1e-15, name);

        free(a.y), free(a.mean), free(a.rstd), free(rrf), free(gxf), free(gwf), free(gbf);
        free(rm0f), free(rv0f), free(gw2);
    }

    free(x), free(w), free(b), free(rm0), free(rv0), free(rm), free(rv), free(wrm), free(wrv);
    free(y), free(mean), free(rstd), free(wy), free(wmean), free(wrstd), free(xf), free(wf);
    free(bf), free(rmf), free(rvf), free(yf), free(mf), free(sf), free(r), free(fd), free(gx);
    free(gw), free(gb);
}

/* ---- embedding ---- */

typedef struct {
    size_t n, dim;
    const int64_t *idx;
    double *w, *y, *r;
} emb_arg_t;

static double emb_obj(void *p) {
    emb_arg_t *a = p;
    ops->embedding(dev, F64, a->n, a->dim, a->idx, a->w, a->y);
    return dot(a->y, a->r, a->n * a->dim);
}

static void test_embedding(void) {
    const size_t vocab = 6, dim = 3, n = 8;
    const int64_t idx[8] = {1, 4, 2, 1, 0, 2, 5, 1}; /* repeats, and the padding index 2 */
    const int64_t pad = 2;
    double *w = drand_vec(vocab * dim, -1, 1), *y = dvec(n * dim), *want = dvec(n * dim);
    for (size_t i = 0; i < n; i++)
        memcpy(want + i * dim, w + idx[i] * dim, dim * sizeof(double));
    tap_is_int(ops->embedding(dev, F64, n, dim, idx, w, y), FSDP_OK, "embedding f64 returns 0");
    tap_is_mem(y, want, n * dim * sizeof(double), "embedding f64 gathers rows (padding too)");
    float *wf = to_f32(w, vocab * dim), *yf = calloc(n * dim, sizeof(float));
    float *wantf = to_f32(want, n * dim);
    ops->embedding(dev, F32, n, dim, idx, wf, yf);
    tap_is_mem(yf, wantf, n * dim * sizeof(float), "embedding f32 gathers rows");

    /* Backward: finite differences on every row but the padding one, which keeps its value. */
    double *r = drand_vec(n * dim, -1, 1), *gw = dvec(vocab * dim), *fd = dvec(vocab * dim);
    for (size_t i = 0; i < vocab * dim; i++)
        gw[i] = 0.125 * (double)i;
    emb_arg_t a = {n, dim, idx, w, dvec(n * dim), r};
    tap_is_int(ops->embedding_backward(dev, F64, n, dim, idx, pad, r, gw), FSDP_OK,
               "embedding backward f64 returns 0");
    fd_grad(emb_obj, &a, w, vocab * dim, fd);
    for (size_t i = 0; i < vocab * dim; i++) {
        if (i / dim == (size_t)pad) fd[i] = 0.0;
        gw[i] -= 0.125 * (double)i;
    }
    check_close(gw, fd, vocab * dim, FD_RTOL, FD_ATOL,
                "embedding backward accumulates the gradient and skips padding_idx");
    /* padding_idx < 0: every row, the padding one included, gets its gradient. */
    memset(gw, 0, vocab * dim * sizeof(double));
    ops->embedding_backward(dev, F64, n, dim, idx, -1, r, gw);
    fd_grad(emb_obj, &a, w, vocab * dim, fd);
    check_close(gw, fd, vocab * dim, FD_RTOL, FD_ATOL, "embedding backward without padding");

    /* Determinism: f32 sums repeated indices in index order, exactly like a serial loop. */
    float *rf = to_f32(r, n * dim), *gwf = calloc(vocab * dim, sizeof(float));
    float *wantg = calloc(vocab * dim, sizeof(float));
    for (size_t i = 0; i < vocab * dim; i++)
        gwf[i] = wantg[i] = 0.1f * (float)i;
    for (size_t i = 0; i < n; i++)
        if (idx[i] != pad)
            for (size_t j = 0; j < dim; j++)
                wantg[idx[i] * dim + j] += rf[i * dim + j];
    ops->embedding_backward(dev, F32, n, dim, idx, pad, rf, gwf);
    tap_is_mem(gwf, wantg, vocab * dim * sizeof(float),
               "embedding backward f32 applies indices in order (bitwise)");

    free(w), free(y), free(want), free(wf), free(yf), free(wantf), free(r), free(gw), free(fd);
    free(a.y), free(rf), free(gwf), free(wantg);
}

/* ---- cross-entropy ---- */

static void ref_cross_entropy(size_t rows, size_t n, const double *x, const int64_t *t, int64_t ign,
                              double ls, double *loss, double *logp) {
    ref_softmax(true, rows, n, x, logp);
    for (size_t r = 0; r < rows; r++) {
        const double *lp = logp + r * n;
        if (t[r] == ign) {
            loss[r] = 0.0;
            continue;
        }
        double s = 0.0;
        for (size_t j = 0; j < n; j++)
            s += lp[j];
        loss[r] = -(1.0 - ls) * lp[t[r]] - ls / (double)n * s;
    }
}

typedef struct {
    size_t rows, n;
    double *x;
    const int64_t *t;
    int64_t ign;
    double ls;
    double *loss, *logp, *gl;
} ce_arg_t;

static double ce_obj(void *p) {
    ce_arg_t *a = p;
    ops->cross_entropy(dev, F64, a->rows, a->n, a->x, a->t, a->ign, a->ls, a->loss, a->logp);
    return dot(a->loss, a->gl, a->rows);
}

static void test_cross_entropy(void) {
    const size_t rows = 6, n = 5, sz = rows * n;
    const int64_t t[6] = {0, 4, -100, 2, 2, 1}; /* row 2 is ignored */
    const int64_t ign = -100;
    const double lss[2] = {0.0, 0.1};
    double *x = drand_vec(sz, -3, 3), *gl = drand_vec(rows, 0.5, 1.5);
    for (int k = 0; k < 2; k++) {
        const double ls = lss[k];
        char name[128];
        double *loss = dvec(rows), *logp = dvec(sz), *wl = dvec(rows), *wlp = dvec(sz);
        ref_cross_entropy(rows, n, x, t, ign, ls, wl, wlp);
        tap_is_int(ops->cross_entropy(dev, F64, rows, n, x, t, ign, ls, loss, logp), FSDP_OK,
                   "cross_entropy ls=%g f64 returns 0", ls);
        snprintf(name, sizeof name, "cross_entropy ls=%g f64 loss matches the reference", ls);
        check_close(loss, wl, rows, 1e-13, 1e-15, name);
        snprintf(name, sizeof name, "cross_entropy ls=%g f64 logp is the log-softmax", ls);
        check_close(logp, wlp, sz, 1e-13, 1e-15, name);
        tap_ok(loss[2] == 0.0, "cross_entropy ls=%g: the ignored row has loss 0", ls);

        float *xf = to_f32(x, sz), *lf = calloc(rows, sizeof(float));
        float *lpf = calloc(sz, sizeof(float)), *glf = to_f32(gl, rows);
        float *gxf = calloc(sz, sizeof(float));
        ops->cross_entropy(dev, F32, rows, n, xf, t, ign, ls, lf, lpf);
        snprintf(name, sizeof name, "cross_entropy ls=%g f32 loss matches the reference", ls);
        check_close_f32(lf, wl, rows, 2e-6, 1e-6, name);

        double *gx = dvec(sz), *fd = dvec(sz);
        ce_arg_t a = {rows, n, x, t, ign, ls, dvec(rows), dvec(sz), gl};
        tap_is_int(ops->cross_entropy_backward(dev, F64, rows, n, logp, t, ign, ls, gl, gx),
                   FSDP_OK, "cross_entropy backward ls=%g returns 0", ls);
        fd_grad(ce_obj, &a, x, sz, fd);
        snprintf(name, sizeof name, "cross_entropy backward ls=%g matches finite diffs", ls);
        check_close(gx, fd, sz, FD_RTOL, FD_ATOL, name);
        bool zero = true;
        for (size_t j = 0; j < n; j++)
            zero = zero && gx[2 * n + j] == 0.0;
        tap_ok(zero, "cross_entropy backward ls=%g: the ignored row gets 0", ls);
        ops->cross_entropy_backward(dev, F32, rows, n, lpf, t, ign, ls, glf, gxf);
        snprintf(name, sizeof name, "cross_entropy backward ls=%g f32 matches f64", ls);
        check_close_f32(gxf, gx, sz, F32_RTOL, F32_ATOL, name);

        free(loss), free(logp), free(wl), free(wlp), free(xf), free(lf), free(lpf), free(glf);
        free(gxf), free(gx), free(fd), free(a.loss), free(a.logp);
    }

    /* An ignore_index that is also a class: rows with that target are skipped. */
    const int64_t t2[6] = {0, 4, 0, 2, 2, 1};
    double *loss = dvec(rows), *logp = dvec(sz), *wl = dvec(rows), *wlp = dvec(sz);
    double *gx = dvec(sz);
    ref_cross_entropy(rows, n, x, t2, 0, 0.0, wl, wlp);
    ops->cross_entropy(dev, F64, rows, n, x, t2, 0, 0.0, loss, logp);
    check_close(loss, wl, rows, 1e-13, 1e-15, "cross_entropy with ignore_index 0");
    ops->cross_entropy_backward(dev, F64, rows, n, logp, t2, 0, 0.0, gl, gx);
    tap_ok(gx[0] == 0.0 && gx[2 * n + 4] == 0.0 && gx[n + 4] != 0.0,
           "cross_entropy backward with ignore_index 0 zeroes exactly those rows");
    const int64_t bad[6] = {0, 5, 0, 2, 2, 1};
    tap_is_int(ops->cross_entropy(dev, F64, rows, n, x, bad, -100, 0.0, loss, logp), FSDP_EINVAL,
               "cross_entropy rejects a target out of range");
    free(x), free(gl), free(loss), free(logp), free(wl), free(wlp), free(gx);
}

/* ---- dropout ---- */

static void test_dropout(void) {
    const size_t n = 1001; /* not a multiple of 4: the last block is partial */
    const double p = 0.3;
    const uint64_t seed = 0x123456789ABCDEF0u, stream = 7, off = 10;
    double *x = drand_vec(n, -2, 2);
    float *xf = to_f32(x, n), *y1 = calloc(n, sizeof(float)), *y2 = calloc(n, sizeof(float));
    uint8_t *m1 = calloc(n, 1), *m2 = calloc(n, 1), *want = calloc(n, 1);

    tap_is_int(ops->dropout(dev, F32, n, p, seed, stream, off, xf, y1, m1), FSDP_OK,
               "dropout f32 returns 0");
    ops->dropout(dev, F32, n, p, seed, stream, off, xf, y2, m2);
    tap_ok(memcmp(y1, y2, n * sizeof(float)) == 0 && memcmp(m1, m2, n) == 0,
           "dropout: the same seed, stream and offset give the same bits");

    /* The documented mapping: element i <- word i%4 of block offset + i/4, keep iff
     * (word >> 8) * 2^-24 >= p. */
    for (size_t i = 0; i < n; i++) {
        uint64_t blk = off + i / 4;
        uint32_t ctr[4] = {(uint32_t)blk, (uint32_t)(blk >> 32), (uint32_t)stream,
                           (uint32_t)(stream >> 32)};
        uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)}, wd[4];
        fsdp_philox4x32_10(ctr, key, wd);
        want[i] = (double)(wd[i % 4] >> 8) * 0x1p-24 >= p;
    }
    tap_is_mem(m1, want, n, "dropout mask follows the documented Philox mapping");
    bool vals = true;
    const float scale = 1.0f / (float)(1.0 - p);
    for (size_t i = 0; i < n; i++)
        vals = vals && y1[i] == (m1[i] ? xf[i] * scale : 0.0f);
    tap_ok(vals, "dropout: kept elements are x / (1 - p), dropped ones 0");

    /* Consistency with fsdp_rng: the words come from the same stream as fsdp_rng_u32. */
    fsdp_rng_t rng;
    fsdp_rng_init(&rng, seed, stream);
    rng.offset = off;
    uint32_t *words = calloc(n, sizeof(uint32_t));
    fsdp_rng_u32(&rng, words, n);
    bool same = true;
    for (size_t i = 0; i < n; i++)
        same = same && (uint8_t)((words[i] >> 8) >= 5033165u) == m1[i];
    tap_ok(same, "dropout mask equals thresholding fsdp_rng_u32 words at ceil(p 2^24)");
    free(words);

    /* A call split at a block boundary continues the same stream. */
    ops->dropout(dev, F32, 8, p, seed, stream, off, xf, y2, m2);
    ops->dropout(dev, F32, n - 8, p, seed, stream, off + 2, xf + 8, y2 + 8, m2 + 8);
    tap_ok(memcmp(m1, m2, n) == 0 && memcmp(y1, y2, n * sizeof(float)) == 0,
           "dropout split into offsets o and o + 2 equals one call");

    ops->dropout(dev, F32, n, p, seed, stream, off + 1, xf, y2, m2);
    tap_ok(memcmp(m1, m2, n) != 0, "dropout: another offset gives another mask");
    ops->dropout(dev, F32, n, p, seed, stream + 1, off, xf, y2, m2);
    tap_ok(memcmp(m1, m2, n) != 0, "dropout: another stream gives another mask");
    ops->dropout(dev, F32, n, p, seed + 1, stream, off, xf, y2, m2);
    tap_ok(memcmp(m1, m2, n) != 0, "dropout: another seed gives another mask");

    double *yd = dvec(n);
    ops->dropout(dev, F64, n, p, seed, stream, off, x, yd, m2);
    tap_is_mem(m2, m1, n, "dropout f64 draws the same mask as f32");
    bool vd = true;
    for (size_t i = 0; i < n; i++)
        vd = vd && yd[i] == (m2[i] ? x[i] * (1.0 / (1.0 - p)) : 0.0);
    tap_ok(vd, "dropout f64 scales kept elements by 1 / (1 - p)");

    /* Keep rate over 100k elements: within 5 sigma of 1 - p. */
    const size_t big = 100000;
    float *bx = calloc(big, sizeof(float)), *by = calloc(big, sizeof(float));
    uint8_t *bm = calloc(big, 1);
    for (size_t i = 0; i < big; i++)
        bx[i] = 1.0f;
    ops->dropout(dev, F32, big, p, 42, 0, 0, bx, by, bm);
    size_t kept = 0;
    for (size_t i = 0; i < big; i++)
        kept += bm[i];
    double frac = (double)kept / (double)big, sigma = sqrt(p * (1 - p) / (double)big);
    tap_is_near(frac, 1 - p, 0, 5 * sigma, "dropout keeps a fraction 1 - p of 100k elements");

    /* p = 0 keeps everything unchanged; p = 1 drops everything without dividing by zero. */
    ops->dropout(dev, F32, n, 0.0, seed, stream, off, xf, y2, m2);
    bool all1 = true;
    for (size_t i = 0; i < n; i++)
        all1 = all1 && m2[i] == 1;
    tap_ok(memcmp(y2, xf, n * sizeof(float)) == 0 && all1, "dropout p = 0 is the identity");
    ops->dropout(dev, F32, n, 1.0, seed, stream, off, xf, y2, m2);
    bool all0 = true;
    for (size_t i = 0; i < n; i++)
        all0 = all0 && m2[i] == 0 && y2[i] == 0.0f;
    tap_ok(all0, "dropout p = 1 gives zeros and an empty mask");
    ops->dropout(dev, F64, n, 1.0, seed, stream, off, x, yd, NULL);
    bool d0 = true;
    for (size_t i = 0; i < n; i++)
        d0 = d0 && yd[i] == 0.0;
    tap_ok(d0, "dropout f64 p = 1 gives zeros (mask may be NULL)");

    free(x), free(xf), free(y1), free(y2), free(m1), free(m2), free(want), free(yd), free(bx);
    free(by), free(bm);
}

/* ---- optimizers ---- */

typedef struct {
    const char *name;
    double lr, momentum, dampening, wd;
    bool nesterov;
} sgd_case_t;

/* Straightforward SGD in double, as in torch.optim.SGD. */
static void ref_sgd(const sgd_case_t *k, size_t n, double *p, const double *g, double *buf,
                    bool first) {
    for (size_t i = 0; i < n; i++) {
        double d = g[i] + k->wd * p[i];
        if (k->momentum != 0) {
            buf[i] = first ? d : k->momentum * buf[i] + (1 - k->dampening) * d;
            d = k->nesterov ? d + k->momentum * buf[i] : buf[i];
        }
        p[i] -= k->lr * d;
    }
}

static void test_sgd(void) {
    const size_t n = 7, steps = 3;
    const sgd_case_t cases[] = {
        {"plain", 0.1, 0, 0, 0, false},
        {"weight decay", 0.1, 0, 0, 0.01, false},
        {"momentum", 0.05, 0.9, 0, 0, false},
        {"momentum, dampening, weight decay", 0.05, 0.9, 0.3, 0.05, false},
        {"nesterov, weight decay", 0.05, 0.9, 0, 0.01, true},
    };
    double *p0 = drand_vec(n, -1, 1), *g[3];
    for (size_t s = 0; s < steps; s++)
        g[s] = drand_vec(n, -1, 1);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const sgd_case_t *k = &cases[c];
        char name[128];
        double *p = dvec(n), *pw = dvec(n), *buf = dvec(n), *bw = dvec(n);
        float *pf = to_f32(p0, n), *bf = calloc(n, sizeof(float));
        memcpy(p, p0, n * sizeof(double));
        memcpy(pw, p0, n * sizeof(double));
        bool use_buf = k->momentum != 0;
        int rc = 0;
        for (size_t s = 0; s < steps; s++) {
            float *gf = to_f32(g[s], n);
            ref_sgd(k, n, pw, g[s], bw, s == 0);
            rc |= ops->sgd_step(dev, F64, n, p, g[s], use_buf ? buf : NULL, k->lr, k->momentum,
                                k->dampening, k->wd, k->nesterov, s == 0);
            rc |= ops->sgd_step(dev, F32, n, pf, gf, use_buf ? bf : NULL, k->lr, k->momentum,
                                k->dampening, k->wd, k->nesterov, s == 0);
            free(gf);
        }
        tap_is_int(rc, FSDP_OK, "sgd %s returns 0", k->name);
        snprintf(name, sizeof name, "sgd %s: f64 params after 3 steps", k->name);
        check_close(p, pw, n, 1e-14, 1e-15, name);
        snprintf(name, sizeof name, "sgd %s: f32 params after 3 steps", k->name);
        check_close_f32(pf, pw, n, 1e-6, 1e-7, name);
        if (use_buf) {
            snprintf(name, sizeof name, "sgd %s: momentum buffer", k->name);
            check_close(buf, bw, n, 1e-14, 1e-15, name);
        }
        free(p), free(pw), free(buf), free(bw), free(pf), free(bf);
    }
    free(p0);
    for (size_t s = 0; s < steps; s++)
        free(g[s]);
}

typedef struct {
    const char *name;
    double lr, wd;
    bool decoupled, amsgrad;
} adam_case_t;

/* Straightforward Adam/AdamW in double, as in torch.optim.Adam/AdamW. */
static void ref_adam(const adam_case_t *k, size_t n, double *p, const double *g, double *m,
                     double *v, double *vmax, int64_t t) {
    const double b1 = 0.9, b2 = 0.999, eps = 1e-8;
    for (size_t i = 0; i < n; i++) {
        double gi = g[i];
        if (k->decoupled)
            p[i] *= 1 - k->lr * k->wd;
        else
            gi += k->wd * p[i];
        m[i] = b1 * m[i] + (1 - b1) * gi;
        v[i] = b2 * v[i] + (1 - b2) * gi * gi;
        double vv = v[i];
        if (k->amsgrad) vv = vmax[i] = fmax(vmax[i], v[i]);
        double mhat = m[i] / (1 - pow(b1, (double)t)), vhat = vv / (1 - pow(b2, (double)t));
        p[i] -= k->lr * mhat / (sqrt(vhat) + eps);
    }
}

static void test_adam(void) {
    const size_t n = 9;
    const int64_t steps = 3;
    const adam_case_t cases[] = {
        {"Adam", 0.1, 0, false, false},           {"Adam weight decay", 0.1, 0.05, false, false},
        {"AdamW", 0.1, 0.05, true, false},        {"Adam amsgrad", 0.1, 0.0, false, true},
        {"AdamW amsgrad", 0.1, 0.05, true, true},
    };
    double *p0 = drand_vec(n, -1, 1), *g[3];
    for (int64_t s = 0; s < steps; s++) {
        /* Shrinking gradients make v decrease, so amsgrad's running maximum matters. */
        g[s] = drand_vec(n, -1, 1);
        for (size_t i = 0; i < n; i++)
            g[s][i] = (double)(float)(g[s][i] / (double)(1 + 4 * s));
    }
    double *plain = dvec(n);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const adam_case_t *k = &cases[c];
        char name[128];
        double *p = dvec(n), *m = dvec(n), *v = dvec(n), *vm = dvec(n);
        double *pw = dvec(n), *mw = dvec(n), *vw = dvec(n), *vmw = dvec(n);
        float *pf = to_f32(p0, n), *mf = calloc(n, sizeof(float)), *vf = calloc(n, sizeof(float));
        float *vmf = calloc(n, sizeof(float));
        memcpy(p, p0, n * sizeof(double));
        memcpy(pw, p0, n * sizeof(double));
        int rc = 0;
        for (int64_t t = 1; t <= steps; t++) {
            float *gf = to_f32(g[t - 1], n);
            ref_adam(k, n, pw, g[t - 1], mw, vw, vmw, t);
            rc |= ops->adam_step(dev, F64, n, p, g[t - 1], m, v, k->amsgrad ? vm : NULL, k->lr, 0.9,
                                 0.999, 1e-8, k->wd, k->decoupled, k->amsgrad, t);
            rc |= ops->adam_step(dev, F32, n, pf, gf, mf, vf, k->amsgrad ? vmf : NULL, k->lr, 0.9,
                                 0.999, 1e-8, k->wd, k->decoupled, k->amsgrad, t);
            free(gf);
        }
        tap_is_int(rc, FSDP_OK, "%s returns 0", k->name);
        snprintf(name, sizeof name, "%s: f64 params after 3 steps", k->name);
        check_close(p, pw, n, 1e-13, 1e-15, name);
        snprintf(name, sizeof name, "%s: f64 exp_avg and exp_avg_sq", k->name);
        double mv[18], mvw[18];
        memcpy(mv, m, n * sizeof(double)), memcpy(mv + n, v, n * sizeof(double));
        memcpy(mvw, mw, n * sizeof(double)), memcpy(mvw + n, vw, n * sizeof(double));
        check_close(mv, mvw, 2 * n, 1e-14, 1e-16, name);
        snprintf(name, sizeof name, "%s: f32 params after 3 steps", k->name);
        check_close_f32(pf, pw, n, 1e-6, 1e-6, name);
        if (k->amsgrad) {
            snprintf(name, sizeof name, "%s: max_exp_avg_sq", k->name);
            check_close(vm, vmw, n, 1e-14, 1e-16, name);
            double diff = 0.0;
            for (size_t i = 0; i < n; i++)
                diff = fmax(diff, fabs(p[i] - plain[i]));
            if (!k->decoupled)
                tap_ok(diff > 1e-6, "%s differs from plain Adam (max |dp| %g)", k->name, diff);
        }
        if (c == 0) memcpy(plain, p, n * sizeof(double));
        free(p), free(m), free(v), free(vm), free(pw), free(mw), free(vw), free(vmw), free(pf);
        free(mf), free(vf), free(vmf);
    }
    free(p0), free(plain);
    for (int64_t s = 0; s < steps; s++)
        free(g[s]);
}

/* ---- dtypes the kernels do not take ---- */

static void test_unsupported(void) {
    float x[4] = {0}, y[4];
    uint16_t h[4] = {0};
    tap_is_int(ops->softmax(dev, FSDP_DTYPE_BF16, false, 1, 4, h, h), FSDP_ENOTSUP,
               "softmax on bf16 is not supported");
    tap_is_int(ops->dropout(dev, FSDP_DTYPE_F16, 4, 0.5, 1, 0, 0, h, h, NULL), FSDP_ENOTSUP,
               "dropout on f16 is not supported");
    tap_is_int(ops->adam_step(dev, FSDP_DTYPE_I32, 4, x, y, x, x, NULL, 0.1, 0.9, 0.999, 1e-8, 0,
                              false, false, 1),
               FSDP_ENOTSUP, "adam_step on i32 is not supported");
}

int main(void) {
    tap_plan_lazy();
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    fsdp_ctx_t *ctx = NULL;
    if (fsdp_ctx_create(&o, &ctx) < 0) tap_bail("fsdp_ctx_create failed");
    if (fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &dev) < 0)
        tap_bail("fsdp_device_create(cpu) failed");

    test_softmax();
    test_layer_norm();
    test_batch_norm();
    test_embedding();
    test_cross_entropy();
    test_dropout();
    test_sgd();
    test_adam();
    test_unsupported();

    fsdp_device_destroy(dev);
    fsdp_ctx_destroy(ctx);
    return tap_done();
}
