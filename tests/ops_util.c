/* SPDX-License-Identifier: MIT */
/*
 * ops_util.c: the helpers and tables that t_ops.c and t_ops_grad.c share (see ops_util.h).
 */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "ops_util.h"
#include "tap.h"

fsdp_ctx_t *ops_ctx;

/* Memory in use when ops_begin() returned. */
static fsdp_mem_stats_t baseline;

void ops_begin(void) {
    tap_plan_lazy();
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    if (fsdp_ctx_create(&o, &ops_ctx) < 0) tap_bail("cannot create a context");
    /* Create the default device before the baseline, so its own allocations do not count. */
    fsdp_tensor_t *warm = mk(FSDP_DTYPE_F32, 1, (const int64_t[]){1}, (const double[]){0});
    if (!warm) tap_bail("cannot create a tensor: %s", fsdp_ctx_last_error(ops_ctx));
    fsdp_tensor_release(warm);
    fsdp_mem_get_stats(ops_ctx, &baseline);
}

int ops_end(void) {
    fsdp_mem_stats_t after;
    fsdp_tape_clear(ops_ctx);
    fsdp_mem_get_stats(ops_ctx, &after);
    tap_is_size(after.total_current, baseline.total_current,
                "every byte allocated by the operations has been freed");
    for (int c = 0; c < FSDP_MEM_NCAT; c++)
        if (after.current[c] != baseline.current[c])
            tap_diag("%s: %zu bytes before, %zu after", fsdp_mem_cat_name((fsdp_mem_cat_t)c),
                     baseline.current[c], after.current[c]);
    fsdp_ctx_destroy(ops_ctx);
    return tap_done();
}

int64_t numel_of(int nd, const int64_t *shape) {
    int64_t n = 1;
    for (int i = 0; i < nd; i++)
        n *= shape[i];
    return n;
}

static char *shape_str(int nd, const int64_t *shape, char *buf, size_t len) {
    size_t at = (size_t)snprintf(buf, len, "[");
    for (int i = 0; i < nd && at < len; i++)
        at += (size_t)snprintf(buf + at, len - at, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (at < len) snprintf(buf + at, len - at, "]");
    return buf;
}

double rnd(fsdp_dtype_t dt, double v) {
    unsigned char buf[8];
    double r = 0;
    fsdp_dtype_convert(buf, dt, &v, FSDP_DTYPE_F64, 1);
    fsdp_dtype_convert(&r, FSDP_DTYPE_F64, buf, dt, 1);
    return r;
}

/* Deterministic values in [lo, hi) (a 64-bit LCG, top 53 bits). */
static void fill_vals(double *v, int64_t n, double lo, double hi, unsigned seed) {
    uint64_t s = (uint64_t)seed * 2654435761u + 12345;
    for (int64_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        v[i] = lo + (hi - lo) * ((double)(s >> 11) / 9007199254740992.0);
    }
}

fsdp_tensor_t *mk(fsdp_dtype_t dt, int nd, const int64_t *shape, const double *v) {
    int64_t n = numel_of(nd, shape);
    void *buf = malloc((size_t)(n > 0 ? n : 1) * 8);
    fsdp_tensor_t *t = NULL;
    if (buf && fsdp_dtype_convert(buf, dt, v, FSDP_DTYPE_F64, (size_t)n) == 0)
        fsdp_tensor_from_host(ops_ctx, dt, nd, shape, buf, FSDP_MEM_OTHER, &t);
    free(buf);
    return t;
}

fsdp_tensor_t *mk_rand(fsdp_dtype_t dt, int nd, const int64_t *shape, double lo, double hi,
                       unsigned seed, double *vals) {
    double tmp[MAXN];
    double *v = vals ? vals : tmp;
    int64_t n = numel_of(nd, shape);
    if (n > MAXN) return NULL;
    fill_vals(v, n, lo, hi, seed);
    for (int64_t i = 0; i < n; i++)
        v[i] = rnd(dt, v[i]);
    return mk(dt, nd, shape, v);
}

int check_vals(const fsdp_tensor_t *t, fsdp_dtype_t dt, int nd, const int64_t *shape,
               const double *want, double rtol, double atol, const char *fmt, ...) {
    char detail[600] = "", g[200], w[200];
    int pass = 1;
    if (!t) {
        pass = 0;
        snprintf(detail, sizeof detail, "no tensor; last error: %s", fsdp_ctx_last_error(ops_ctx));
    } else if (fsdp_tensor_dtype(t) != dt || fsdp_tensor_ndim(t) != nd ||
               (nd > 0 && memcmp(fsdp_tensor_shape(t), shape, sizeof(int64_t) * (size_t)nd))) {
        pass = 0;
        snprintf(detail, sizeof detail, "got %s, want %s%s", fsdp_tensor_describe(t, g, sizeof g),
                 fsdp_dtype_name(dt), shape_str(nd, shape, w, sizeof w));
    } else {
        int64_t n = fsdp_tensor_numel(t);
        for (int64_t i = 0; i < n; i++) {
            double got = NAN;
            fsdp_tensor_item(t, i, &got);
            int ok = got == want[i] || (isnan(got) && isnan(want[i])) ||
                     fabs(got - want[i]) <= atol + rtol * fabs(want[i]);
            if (!ok) {
                pass = 0;
                snprintf(detail, sizeof detail,
                         "element %lld of %lld: got %.17g, want %.17g (rtol %g, atol %g)",
                         (long long)i, (long long)n, got, want[i], rtol, atol);
                break;
            }
        }
    }
    va_list ap;
    va_start(ap, fmt);
    int r = tap_report(pass, detail[0] ? detail : NULL, fmt, ap);
    va_end(ap);
    return r;
}

void release_all(int n, fsdp_tensor_t **ts) {
    for (int i = 0; i < n; i++) {
        fsdp_tensor_release(ts[i]);
        ts[i] = NULL;
    }
}

/* ---- operation tables ------------------------------------------------------------------------ */

const struct binop binops[4] = {
    {"add", fsdp_add, '+'}, {"sub", fsdp_sub, '-'}, {"mul", fsdp_mul, '*'}, {"div", fsdp_div, '/'}};

static int op_gelu_erf(fsdp_tensor_t *x, fsdp_tensor_t **out) {
    return fsdp_gelu(x, FSDP_GELU_ERF, out);
}
static int op_gelu_tanh(fsdp_tensor_t *x, fsdp_tensor_t **out) {
    return fsdp_gelu(x, FSDP_GELU_TANH, out);
}
static int op_scale(fsdp_tensor_t *x, fsdp_tensor_t **out) {
    return fsdp_scale(x, 2.5, out);
}
static int op_add_scalar(fsdp_tensor_t *x, fsdp_tensor_t **out) {
    return fsdp_add_scalar(x, -1.5, out);
}

static double r_relu(double v) {
    return v > 0 ? v : 0;
}
static double r_gelu_erf(double v) {
    return 0.5 * v * (1 + erf(v / sqrt(2.0)));
}
static double r_gelu_tanh(double v) {
    return 0.5 * v * (1 + tanh(sqrt(2.0 / 3.14159265358979323846) * (v + 0.044715 * v * v * v)));
}
static double r_sigmoid(double v) {
    return 1 / (1 + exp(-v));
}
static double r_scale(double v) {
    return 2.5 * v;
}
static double r_add_scalar(double v) {
    return v - 1.5;
}

const struct unop unops[9] = {
    {"relu", fsdp_relu, r_relu, -2, 2},
    {"gelu(erf)", op_gelu_erf, r_gelu_erf, -3, 3},
    {"gelu(tanh)", op_gelu_tanh, r_gelu_tanh, -3, 3},
    {"tanh", fsdp_tanh, tanh, -2, 2},
    {"sigmoid", fsdp_sigmoid, r_sigmoid, -4, 4},
    {"exp", fsdp_exp, exp, -2, 2},
    {"ln", fsdp_ln, log, 0.25, 3},
    {"scale(2.5)", op_scale, r_scale, -2, 2},
    {"add_scalar(-1.5)", op_add_scalar, r_add_scalar, -2, 2},
};

const struct pattern patterns[4] = {
    {3, {2, 3, 4}, 1, {4}, 3, {2, 3, 4}, "(2,3,4) with (4)"},
    {3, {2, 1, 4}, 2, {3, 1}, 3, {2, 3, 4}, "(2,1,4) with (3,1)"},
    {0, {0}, 2, {2, 3}, 2, {2, 3}, "scalar with (2,3)"},
    {2, {2, 3}, 0, {0}, 2, {2, 3}, "(2,3) with scalar"},
};
