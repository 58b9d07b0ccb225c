/* SPDX-License-Identifier: MIT */
/*
 * t_ops_nn.c: tests of the matrix and neural-network operations (ops_matmul.c, ops_nn.c).
 *
 * Each forward is compared with a naive double-precision reference written here on small
 * shapes; every differentiable input of every operation goes through a finite-difference check
 * in f64 (gradcheck.h); dropout, whose forward draws new random numbers on every call, is checked
 * against its own mask instead. Errors must name the shapes (and the bad index); f16 and bf16
 * forwards must equal the f32 computation rounded once. Everything runs in well under a second.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "gradcheck.h"
#include "tap.h"

static fsdp_ctx_t *ctx;

#define F64 FSDP_DTYPE_F64
#define F32 FSDP_DTYPE_F32
#define CAT FSDP_MEM_OTHER
#define GC_H 1e-6
#define GC_RTOL 1e-5
#define GC_ATOL 1e-7

/* Stops the run when a call that must succeed fails: later checks would only cascade. */
static void must(int rc, const char *what) {
    if (rc < 0) tap_bail("%s failed: %s (%s)", what, fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
}

static void gc(const char *name, gc_fn fn, void *arg, int nin, fsdp_tensor_t *const *in,
               double rtol, double atol) {
    gc_check(ctx, name, fn, arg, nin, in, NULL, GC_H, rtol, atol);
}

/* ---- host helpers ---- */

static uint64_t lcg_state;

static double urand(double lo, double hi) {
    lcg_state = lcg_state * 6364136223846793005ull + 1442695040888963407ull;
    return lo + (hi - lo) * (double)(lcg_state >> 11) * (1.0 / 9007199254740992.0);
}

static void fill_rand(double *v, int64_t n, unsigned seed, double lo, double hi) {
    lcg_state = seed * 0x9E3779B97F4A7C15ull + 7;
    for (int64_t i = 0; i < n; i++)
        v[i] = urand(lo, hi);
}

static int64_t numel_of(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= shape[i];
    return n;
}

/* A tensor of dtype dt holding v (rounded to dt). */
static fsdp_tensor_t *mk(fsdp_dtype_t dt, int ndim, const int64_t *shape, const double *v) {
    fsdp_tensor_t *t64 = NULL, *t = NULL;
    must(fsdp_tensor_from_host(ctx, F64, ndim, shape, v, CAT, &t64), "from_host");
    if (dt == F64) return t64;
    must(fsdp_tensor_empty(ctx, dt, ndim, shape, CAT, &t), "empty");
    must(fsdp_tensor_copy_(t, t64), "copy_");
    fsdp_tensor_release(t64);
    return t;
}

/* A random f64 tensor (values in [lo, hi)); v (may be NULL) receives the values. */
static fsdp_tensor_t *mkrand(int ndim, const int64_t *shape, unsigned seed, double lo, double hi,
                             double *v) {
    int64_t n = numel_of(ndim, shape);
    double *buf = v ? v : malloc((size_t)(n + 1) * sizeof *buf);
    fill_rand(buf, n, seed, lo, hi);
    fsdp_tensor_t *t = mk(F64, ndim, shape, buf);
    if (!v) free(buf);
    return t;
}

static fsdp_tensor_t *mk_i64(int ndim, const int64_t *shape, const int64_t *v) {
    fsdp_tensor_t *t = NULL;
    must(fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, ndim, shape, v, CAT, &t), "from_host i64");
    return t;
}

/* Element i of t as a double (NaN when it cannot be read). */
static double at(const fsdp_tensor_t *t, int64_t i) {
    double v = NAN;
    if (fsdp_tensor_item(t, i, &v) < 0) return NAN;
    return v;
}

/* One TAP line: t has the shape (ndim, shape) and every element within tol of want. */
static int check_vals(const fsdp_tensor_t *t, int ndim, const int64_t *shape, const double *want,
                      double tol, const char *name) {
    if (!t) return tap_ok(0, "%s (no tensor: %s)", name, fsdp_ctx_last_error(ctx));
    if (fsdp_tensor_ndim(t) != ndim ||
        (ndim > 0 && memcmp(fsdp_tensor_shape(t), shape, sizeof(int64_t) * (size_t)ndim) != 0)) {
        char d[128];
        tap_diag("%s: got shape %s", name, fsdp_tensor_describe(t, d, sizeof d));
        return tap_ok(0, "%s: shape", name);
    }
    int64_t n = numel_of(ndim, shape), bad = -1;
    for (int64_t i = 0; i < n && bad < 0; i++) {
        double g = at(t, i);
        bool same_nan = isnan(g) && isnan(want[i]);
        if (!same_nan && !(fabs(g - want[i]) <= tol * (1 + fabs(want[i])))) bad = i;
    }
    if (bad >= 0)
        tap_diag("%s: element %lld is %.12g, want %.12g", name, (long long)bad, at(t, bad),
                 want[bad]);
    return tap_ok(bad < 0, "%s", name);
}

/* ---- naive references ---- */

/* C[b] = A[b] B[b] for contiguous row-major operands; an operand with bstride 0 is shared. */
static void ref_mm(const double *a, int64_t sa, const double *b, int64_t sb, int64_t batch,
                   int64_t m, int64_t k, int64_t n, double *c) {
    for (int64_t q = 0; q < batch; q++)
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) {
                double s = 0;
                for (int64_t l = 0; l < k; l++)
                    s += a[q * sa + i * k + l] * b[q * sb + l * n + j];
                c[(q * m + i) * n + j] = s;
            }
}

/* The transpose of an r x c row-major matrix (each of `batch` of them). */
static void transpose(const double *x, int64_t batch, int64_t r, int64_t c, double *y) {
    for (int64_t q = 0; q < batch; q++)
        for (int64_t i = 0; i < r; i++)
            for (int64_t j = 0; j < c; j++)
                y[q * r * c + j * r + i] = x[q * r * c + i * c + j];
}

/* Softmax (or log-softmax) of x viewed as (outer, n, inner) along n. */
static void ref_softmax(const double *x, int64_t outer, int64_t n, int64_t inner, bool take_log,
                        double *y) {
    for (int64_t o = 0; o < outer; o++)
        for (int64_t in = 0; in < inner; in++) {
            const double *xr = x + o * n * inner + in;
            double *yr = y + o * n * inner + in;
            double mx = -INFINITY, s = 0;
            for (int64_t j = 0; j < n; j++)
                mx = fmax(mx, xr[j * inner]);
            for (int64_t j = 0; j < n; j++)
                s += exp(xr[j * inner] - mx);
            for (int64_t j = 0; j < n; j++)
                yr[j * inner] =
                    take_log ? xr[j * inner] - mx - log(s) : exp(xr[j * inner] - mx) / s;
        }
}

/* Cross-entropy loss of each row (0 for ignored rows). */
static void ref_ce(const double *x, const int64_t *t, int64_t rows, int64_t c, int64_t ignore,
                   double ls, double *loss) {
    for (int64_t i = 0; i < rows; i++) {
        const double *xr = x + i * c;
        if (t[i] == ignore) {
            loss[i] = 0;
            continue;
        }
        double mx = -INFINITY, s = 0, sum_logp = 0;
        for (int64_t j = 0; j < c; j++)
            mx = fmax(mx, xr[j]);
        for (int64_t j = 0; j < c; j++)
            s += exp(xr[j] - mx);
        double lse = mx + log(s);
        for (int64_t j = 0; j < c; j++)
            sum_logp += xr[j] - lse;
        loss[i] = -(1 - ls) * (xr[t[i]] - lse) - ls / (double)c * sum_logp;
    }
}

/* ---- matmul ---- */

static int fn_matmul(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    (void)arg;
    (void)nin;
    return fsdp_matmul(in[0], in[1], out);
}

/* matmul of transpose(in[0]) (last two dims) and transpose(in[1]): the strided-operand path. */
static int fn_matmul_tt(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    fsdp_tensor_t *at_ = NULL, *bt = NULL;
    (void)arg;
    (void)nin;
    int na = fsdp_tensor_ndim(in[0]), nb = fsdp_tensor_ndim(in[1]);
    int rc = fsdp_transpose(in[0], na - 2, na - 1, &at_);
    if (rc == 0) rc = fsdp_transpose(in[1], nb - 2, nb - 1, &bt);
    if (rc == 0) rc = fsdp_matmul(at_, bt, out);
    fsdp_tensor_release(at_);
    fsdp_tensor_release(bt);
    return rc;
}

/* matmul of permute(in[0], (1, 0, 2)) with in[1]: rows that do not fold into one matrix. */
static int fn_matmul_perm(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    fsdp_tensor_t *ap = NULL;
    (void)arg;
    (void)nin;
    int rc = fsdp_permute(in[0], (const int[]){1, 0, 2}, &ap);
    if (rc == 0) rc = fsdp_matmul(ap, in[1], out);
    fsdp_tensor_release(ap);
    return rc;
}

/* One matmul case: shapes of a and b, and the reference's batch geometry. */
struct mm_case {
    const char *name;
    int an, bn;
    int64_t as[4], bs[4];
    int yn;
    int64_t ys[4];
    int64_t batch, m, k, n, sa, sb; /* reference: A (batch|1, m, k), B (batch|1, k, n) */
};

static void test_matmul_shapes(void) {
    static const struct mm_case cases[] = {
        {"2-d x 2-d", 2, 2, {3, 4}, {4, 5}, 2, {3, 5}, 1, 3, 4, 5, 0, 0},
        {"3-d x 2-d (folded rows)", 3, 2, {2, 3, 4}, {4, 5}, 3, {2, 3, 5}, 1, 6, 4, 5, 0, 0},
        {"3-d x 3-d (batched)", 3, 3, {2, 3, 4}, {2, 4, 5}, 3, {2, 3, 5}, 2, 3, 4, 5, 12, 20},
        {"4-d x 4-d (batched)",
         4,
         4,
         {2, 2, 3, 4},
         {2, 2, 4, 2},
         4,
         {2, 2, 3, 2},
         4,
         3,
         4,
         2,
         12,
         8},
        {"2-d x 3-d (a shared)", 2, 3, {3, 4}, {2, 4, 5}, 3, {2, 3, 5}, 2, 3, 4, 5, 0, 20},
        {"1-d x 2-d", 1, 2, {4}, {4, 5}, 1, {5}, 1, 1, 4, 5, 0, 0},
        {"3-d x 1-d", 3, 1, {2, 3, 4}, {4}, 2, {2, 3}, 1, 6, 4, 1, 0, 0},
        {"1-d x 1-d", 1, 1, {4}, {4}, 0, {0}, 1, 1, 4, 1, 0, 0},
        {"1-d x 3-d", 1, 3, {4}, {2, 4, 5}, 2, {2, 5}, 2, 1, 4, 5, 0, 20},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const struct mm_case *k = &cases[c];
        double a[64], b[64], want[64];
        fsdp_tensor_t *ta = mkrand(k->an, k->as, 10 + (unsigned)c, -1, 1, a);
        fsdp_tensor_t *tb = mkrand(k->bn, k->bs, 20 + (unsigned)c, -1, 1, b);
        ref_mm(a, k->sa, b, k->sb, k->batch, k->m, k->k, k->n, want);
        fsdp_tensor_t *y = NULL;
        fsdp_matmul(ta, tb, &y);
        check_vals(y, k->yn, k->ys, want, 1e-12, k->name);
        char nm[96];
        snprintf(nm, sizeof nm, "matmul %s", k->name);
        gc(nm, fn_matmul, NULL, 2, (fsdp_tensor_t *[]){ta, tb}, GC_RTOL, GC_ATOL);
        fsdp_tensor_release(y);
        fsdp_tensor_release(ta);
        fsdp_tensor_release(tb);
    }
}

static void test_matmul_strided(void) {
    double xa[64], xb[64], a[64], b[64], want[64];
    fsdp_tensor_t *y = NULL, *at_ = NULL, *bt = NULL;

    /* 2-d: a = Xa^T with Xa (4, 3), b = Xb^T with Xb (5, 4). */
    fsdp_tensor_t *ta = mkrand(2, (const int64_t[]){4, 3}, 31, -1, 1, xa);
    fsdp_tensor_t *tb = mkrand(2, (const int64_t[]){5, 4}, 32, -1, 1, xb);
    transpose(xa, 1, 4, 3, a);
    transpose(xb, 1, 5, 4, b);
    ref_mm(a, 0, b, 0, 1, 3, 4, 5, want);
    must(fsdp_transpose(ta, 0, 1, &at_), "transpose");
    must(fsdp_transpose(tb, 0, 1, &bt), "transpose");
    tap_ok(!fsdp_tensor_is_contiguous(at_) && !fsdp_tensor_is_contiguous(bt),
           "transposed operands are not contiguous");
    /* The transposed views go to the GEMM as they are: one allocation, the output's. */
    fsdp_mem_stats_t s0, s1, s2;
    fsdp_tensor_t *e = NULL;
    fsdp_mem_get_stats(ctx, &s0);
    must(fsdp_tensor_empty(ctx, F64, 2, (const int64_t[]){3, 5}, CAT, &e), "empty");
    fsdp_mem_get_stats(ctx, &s1);
    fsdp_matmul(at_, bt, &y);
    fsdp_mem_get_stats(ctx, &s2);
    tap_is_size(s2.allocs - s1.allocs, s1.allocs - s0.allocs,
                "matmul of transposed views allocates only its output");
    check_vals(y, 2, (const int64_t[]){3, 5}, want, 1e-12, "matmul a^T b^T (2-d, strided)");
    fsdp_tensor_release(e);
    fsdp_tensor_release(y);
    fsdp_tensor_release(at_);
    fsdp_tensor_release(bt);
    gc("matmul a^T b^T (2-d)", fn_matmul_tt, NULL, 2, (fsdp_tensor_t *[]){ta, tb}, GC_RTOL,
       GC_ATOL);
    fsdp_tensor_release(ta);
    fsdp_tensor_release(tb);

    /* Batched: a = transpose(Xa (2, 4, 3)), b = transpose(Xb (2, 5, 4)). */
    ta = mkrand(3, (const int64_t[]){2, 4, 3}, 33, -1, 1, xa);
    tb = mkrand(3, (const int64_t[]){2, 5, 4}, 34, -1, 1, xb);
    transpose(xa, 2, 4, 3, a);
    transpose(xb, 2, 5, 4, b);
    ref_mm(a, 12, b, 20, 2, 3, 4, 5, want);
    fn_matmul_tt(NULL, 2, (fsdp_tensor_t *[]){ta, tb}, &y);
    check_vals(y, 3, (const int64_t[]){2, 3, 5}, want, 1e-12, "matmul a^T b^T (batched)");
    fsdp_tensor_release(y);
    gc("matmul a^T b^T (batched)", fn_matmul_tt, NULL, 2, (fsdp_tensor_t *[]){ta, tb}, GC_RTOL,
       GC_ATOL);
    fsdp_tensor_release(ta);
    fsdp_tensor_release(tb);

    /* Rows that do not fold: a = permute(Xa (3, 2, 4), (1, 0, 2)) times b (4, 5). */
    ta = mkrand(3, (const int64_t[]){3, 2, 4}, 35, -1, 1, xa);
    tb = mkrand(2, (const int64_t[]){4, 5}, 36, -1, 1, b);
    for (int q = 0; q < 2; q++)
        for (int i = 0; i < 3; i++)
            for (int l = 0; l < 4; l++)
                a[(q * 3 + i) * 4 + l] = xa[(i * 2 + q) * 4 + l];
    ref_mm(a, 0, b, 0, 1, 6, 4, 5, want);
    fn_matmul_perm(NULL, 2, (fsdp_tensor_t *[]){ta, tb}, &y);
    check_vals(y, 3, (const int64_t[]){2, 3, 5}, want, 1e-12, "matmul permuted a x 2-d b");
    fsdp_tensor_release(y);
    gc("matmul permuted a x 2-d b", fn_matmul_perm, NULL, 2, (fsdp_tensor_t *[]){ta, tb}, GC_RTOL,
       GC_ATOL);
    fsdp_tensor_release(ta);

    /* A broadcast (stride 0) operand has no GEMM layout and is materialized. */
    fsdp_tensor_t *row = mkrand(2, (const int64_t[]){1, 4}, 37, -1, 1, xa), *ex = NULL;
    must(fsdp_expand(row, 2, (const int64_t[]){3, 4}, &ex), "expand");
    for (int i = 0; i < 3; i++)
        memcpy(a + i * 4, xa, 4 * sizeof *a);
    ref_mm(a, 0, b, 0, 1, 3, 4, 5, want);
    fsdp_matmul(ex, tb, &y);
    check_vals(y, 2, (const int64_t[]){3, 5}, want, 1e-12, "matmul expanded a x b");
    fsdp_tensor_release(y);
    fsdp_tensor_release(ex);
    fsdp_tensor_release(row);

    /* An empty inner dimension gives zeros. */
    fsdp_tensor_t *z0 = NULL, *z1 = NULL;
    must(fsdp_tensor_empty(ctx, F64, 2, (const int64_t[]){2, 0}, CAT, &z0), "empty");
    must(fsdp_tensor_empty(ctx, F64, 2, (const int64_t[]){0, 3}, CAT, &z1), "empty");
    fsdp_matmul(z0, z1, &y);
    check_vals(y, 2, (const int64_t[]){2, 3}, (const double[]){0, 0, 0, 0, 0, 0}, 0,
               "matmul with k = 0 is zeros");
    fsdp_tensor_release(y);
    fsdp_tensor_release(z0);
    fsdp_tensor_release(z1);
    fsdp_tensor_release(tb);
}

static void test_matmul_errors(void) {
    fsdp_tensor_t *a = mkrand(2, (const int64_t[]){2, 3}, 40, 0, 1, NULL);
    fsdp_tensor_t *b = mkrand(2, (const int64_t[]){4, 5}, 41, 0, 1, NULL);
    fsdp_tensor_t *c = mkrand(3, (const int64_t[]){3, 3, 2}, 42, 0, 1, NULL);
    fsdp_tensor_t *d = mkrand(3, (const int64_t[]){2, 2, 3}, 43, 0, 1, NULL);
    fsdp_tensor_t *y = (fsdp_tensor_t *)&y;
    int rc = fsdp_matmul(a, b, &y);
    tap_ok(rc == FSDP_EINVAL && y == NULL, "matmul (2,3) x (4,5) is EINVAL with out NULL");
    const char *msg = fsdp_ctx_last_error(ctx);
    tap_ok(strstr(msg, "matmul") && strstr(msg, "[2, 3]") && strstr(msg, "[4, 5]"),
           "matmul error names the op and both shapes");
    if (!strstr(msg, "[2, 3]")) tap_diag("message: %s", msg);
    rc = fsdp_matmul(d, c, &y);
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_ctx_last_error(ctx), "[3, 3, 2]"),
           "matmul with different batch dimensions is EINVAL naming the shapes");
    rc = fsdp_linear(a, b, NULL, &y);
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_ctx_last_error(ctx), "[2, 3]") &&
               strstr(fsdp_ctx_last_error(ctx), "[4, 5]"),
           "linear x (2,3) w (4,5) is EINVAL naming both shapes");
    fsdp_tensor_t *w = mkrand(2, (const int64_t[]){4, 3}, 44, 0, 1, NULL);
    fsdp_tensor_t *bias = mkrand(1, (const int64_t[]){5}, 45, 0, 1, NULL);
    rc = fsdp_linear(a, w, bias, &y);
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_ctx_last_error(ctx), "[5]"),
           "linear with a bias of the wrong size is EINVAL naming it");
    fsdp_tensor_t *idx = mk_i64(1, (const int64_t[]){2}, (const int64_t[]){0, 1});
    rc = fsdp_matmul(a, idx, &y);
    tap_ok(rc == FSDP_EINVAL && y == NULL, "matmul of an integer tensor is EINVAL");
    fsdp_tensor_release(idx);
    fsdp_tensor_release(w);
    fsdp_tensor_release(bias);
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    fsdp_tensor_release(c);
    fsdp_tensor_release(d);
}

/* ---- linear ---- */

static int fn_linear(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    (void)arg;
    return fsdp_linear(in[0], in[1], nin > 2 ? in[2] : NULL, out);
}

/* linear with w given as the transpose of in[1] (in, out): a transposed weight view. */
static int fn_linear_wt(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    fsdp_tensor_t *wt = NULL;
    (void)arg;
    int rc = fsdp_transpose(in[1], 0, 1, &wt);
    if (rc == 0) rc = fsdp_linear(in[0], wt, nin > 2 ? in[2] : NULL, out);
    fsdp_tensor_release(wt);
    return rc;
}

/* linear with x given as the transpose of in[0] (in, rows): a transposed 2-d input view. */
static int fn_linear_xt(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    fsdp_tensor_t *xt = NULL;
    (void)arg;
    int rc = fsdp_transpose(in[0], 0, 1, &xt);
    if (rc == 0) rc = fsdp_linear(xt, in[1], nin > 2 ? in[2] : NULL, out);
    fsdp_tensor_release(xt);
    return rc;
}

static void test_linear(void) {
    double x[64], w[64], b[8], wt[64], want[64];
    fsdp_tensor_t *tx = mkrand(3, (const int64_t[]){2, 3, 4}, 50, -1, 1, x);
    fsdp_tensor_t *tw = mkrand(2, (const int64_t[]){5, 4}, 51, -1, 1, w);
    fsdp_tensor_t *tb = mkrand(1, (const int64_t[]){5}, 52, -1, 1, b);
    fsdp_tensor_t *y = NULL;
    transpose(w, 1, 5, 4, wt);
    ref_mm(x, 0, wt, 0, 1, 6, 4, 5, want);
    fsdp_linear(tx, tw, NULL, &y);
    check_vals(y, 3, (const int64_t[]){2, 3, 5}, want, 1e-12, "linear without bias");
    fsdp_tensor_release(y);
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < 5; j++)
            want[i * 5 + j] += b[j];

    /* Contiguous f64 operands: the output is the only allocation (no grad recorded). */
    fsdp_mem_stats_t s0, s1, s2;
    fsdp_tensor_t *e = NULL;
    fsdp_mem_get_stats(ctx, &s0);
    must(fsdp_tensor_empty(ctx, F64, 3, (const int64_t[]){2, 3, 5}, CAT, &e), "empty");
    fsdp_mem_get_stats(ctx, &s1);
    fsdp_linear(tx, tw, tb, &y);
    fsdp_mem_get_stats(ctx, &s2);
    tap_is_size(s2.allocs - s1.allocs, s1.allocs - s0.allocs,
                "linear with bias allocates only its output");
    fsdp_tensor_release(e);
    check_vals(y, 3, (const int64_t[]){2, 3, 5}, want, 1e-12, "linear with bias");
    fsdp_tensor_release(y);

    /* A transposed weight view (stored (in, out)) gives the same result. */
    fsdp_tensor_t *twt = mk(F64, 2, (const int64_t[]){4, 5}, wt);
    fn_linear_wt(NULL, 3, (fsdp_tensor_t *[]){tx, twt, tb}, &y);
    check_vals(y, 3, (const int64_t[]){2, 3, 5}, want, 1e-12, "linear with a transposed weight");
    fsdp_tensor_release(y);

    gc("linear with bias", fn_linear, NULL, 3, (fsdp_tensor_t *[]){tx, tw, tb}, GC_RTOL, GC_ATOL);
    gc("linear without bias", fn_linear, NULL, 2, (fsdp_tensor_t *[]){tx, tw}, GC_RTOL, GC_ATOL);
    gc("linear with a transposed weight", fn_linear_wt, NULL, 3, (fsdp_tensor_t *[]){tx, twt, tb},
       GC_RTOL, GC_ATOL);

    /* A transposed input view: x stored as (in, rows). */
    fsdp_tensor_t *txt = mkrand(2, (const int64_t[]){4, 6}, 54, -1, 1, x);
    double xr[24];
    transpose(x, 1, 4, 6, xr);
    ref_mm(xr, 0, wt, 0, 1, 6, 4, 5, want);
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < 5; j++)
            want[i * 5 + j] += b[j];
    fn_linear_xt(NULL, 3, (fsdp_tensor_t *[]){txt, tw, tb}, &y);
    check_vals(y, 2, (const int64_t[]){6, 5}, want, 1e-12, "linear of a transposed input");
    fsdp_tensor_release(y);
    gc("linear of a transposed input", fn_linear_xt, NULL, 3, (fsdp_tensor_t *[]){txt, tw, tb},
       GC_RTOL, GC_ATOL);
    fsdp_tensor_release(txt);

    /* 1-d input: (in) -> (out). */
    fsdp_tensor_t *x1 = mkrand(1, (const int64_t[]){4}, 53, -1, 1, x);
    ref_mm(x, 0, wt, 0, 1, 1, 4, 5, want);
    for (int j = 0; j < 5; j++)
        want[j] += b[j];
    fsdp_linear(x1, tw, tb, &y);
    check_vals(y, 1, (const int64_t[]){5}, want, 1e-12, "linear of a 1-d input");
    fsdp_tensor_release(y);
    gc("linear of a 1-d input", fn_linear, NULL, 3, (fsdp_tensor_t *[]){x1, tw, tb}, GC_RTOL,
       GC_ATOL);
    fsdp_tensor_release(x1);
    fsdp_tensor_release(twt);
    fsdp_tensor_release(tx);
    fsdp_tensor_release(tw);
    fsdp_tensor_release(tb);
}

/* ---- softmax ---- */

struct sm_arg {
    int dim;
    bool log;
};

static int fn_softmax(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    const struct sm_arg *s = arg;
    (void)nin;
    return s->log ? fsdp_log_softmax(in[0], s->dim, out) : fsdp_softmax(in[0], s->dim, out);
}

static void test_softmax(void) {
    const int64_t shape[3] = {3, 4, 5};
    double x[60], want[60];
    fsdp_tensor_t *tx = mkrand(3, shape, 60, -2, 2, x);
    for (int log = 0; log < 2; log++)
        for (int dim = -1; dim < 3; dim++) {
            int d = dim < 0 ? 2 : dim;
            int64_t outer = 1, inner = 1;
            for (int i = 0; i < d; i++)
                outer *= shape[i];
            for (int i = d + 1; i < 3; i++)
                inner *= shape[i];
            ref_softmax(x, outer, shape[d], inner, log, want);
            fsdp_tensor_t *y = NULL;
            struct sm_arg a = {dim, log != 0};
            fn_softmax(&a, 1, &tx, &y);
            char nm[64];
            snprintf(nm, sizeof nm, "%s along dim %d", log ? "log_softmax" : "softmax", dim);
            check_vals(y, 3, shape, want, 1e-12, nm);
            fsdp_tensor_release(y);
            if (dim >= 0 && dim != 1 && log) continue; /* gradients: a sample of the cases */
            gc(nm, fn_softmax, &a, 1, &tx, GC_RTOL, GC_ATOL);
        }
    fsdp_tensor_t *y = (fsdp_tensor_t *)&y;
    int rc = fsdp_softmax(tx, 3, &y);
    tap_ok(rc == FSDP_EINVAL && y == NULL && strstr(fsdp_ctx_last_error(ctx), "[3, 4, 5]"),
           "softmax along dim 3 of a 3-d tensor is EINVAL naming the shape");
    fsdp_tensor_release(tx);
}

/* ---- layer norm ---- */

struct ln_arg {
    int nd;
};

static int fn_layer_norm(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    const struct ln_arg *a = arg;
    return fsdp_layer_norm(in[0], a->nd, nin > 1 ? in[1] : NULL, nin > 2 ? in[2] : NULL, 1e-5, out);
}

static void ref_layer_norm(const double *x, int64_t rows, int64_t n, const double *w,
                           const double *b, double eps, double *y) {
    for (int64_t r = 0; r < rows; r++) {
        double mean = 0, var = 0;
        for (int64_t j = 0; j < n; j++)
            mean += x[r * n + j];
        mean /= (double)n;
        for (int64_t j = 0; j < n; j++)
            var += (x[r * n + j] - mean) * (x[r * n + j] - mean);
        var /= (double)n;
        for (int64_t j = 0; j < n; j++)
            y[r * n + j] =
                (x[r * n + j] - mean) / sqrt(var + eps) * (w ? w[j] : 1) + (b ? b[j] : 0);
    }
}

static void test_layer_norm(void) {
    const int64_t shape[3] = {2, 3, 4};
    double x[24], w[12], b[12], want[24];
    fsdp_tensor_t *tx = mkrand(3, shape, 70, -2, 2, x);
    for (int nd = 1; nd <= 2; nd++) {
        int64_t n = nd == 1 ? 4 : 12;
        fsdp_tensor_t *tw = mkrand(nd, shape + 3 - nd, 71, 0.5, 1.5, w);
        fsdp_tensor_t *tb = mkrand(nd, shape + 3 - nd, 72, -1, 1, b);
        struct ln_arg a = {nd};
        fsdp_tensor_t *y = NULL;
        char nm[64];
        ref_layer_norm(x, 24 / n, n, w, b, 1e-5, want);
        fn_layer_norm(&a, 3, (fsdp_tensor_t *[]){tx, tw, tb}, &y);
        snprintf(nm, sizeof nm, "layer_norm over %d dims with w, b", nd);
        check_vals(y, 3, shape, want, 1e-10, nm);
        fsdp_tensor_release(y);
        gc(nm, fn_layer_norm, &a, 3, (fsdp_tensor_t *[]){tx, tw, tb}, 1e-4, 1e-6);
        ref_layer_norm(x, 24 / n, n, NULL, NULL, 1e-5, want);
        fn_layer_norm(&a, 1, &tx, &y);
        snprintf(nm, sizeof nm, "layer_norm over %d dims without w, b", nd);
        check_vals(y, 3, shape, want, 1e-10, nm);
        fsdp_tensor_release(y);
        if (nd == 1) gc(nm, fn_layer_norm, &a, 1, &tx, 1e-4, 1e-6);
        fsdp_tensor_release(tw);
        fsdp_tensor_release(tb);
    }
    fsdp_tensor_t *bad = mkrand(1, (const int64_t[]){5}, 73, 0, 1, NULL);
    fsdp_tensor_t *y = (fsdp_tensor_t *)&y;
    int rc = fsdp_layer_norm(tx, 1, bad, NULL, 1e-5, &y);
    tap_ok(rc == FSDP_EINVAL && y == NULL && strstr(fsdp_ctx_last_error(ctx), "[5]") &&
               strstr(fsdp_ctx_last_error(ctx), "[2, 3, 4]"),
           "layer_norm with a w of the wrong shape is EINVAL naming both shapes");
    fsdp_tensor_release(bad);
    fsdp_tensor_release(tx);
}

/* ---- batch norm ---- */

struct bn_arg {
    bool train;
    fsdp_tensor_t *rm, *rv;
};

static int fn_batch_norm(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    const struct bn_arg *a = arg;
    return fsdp_batch_norm(in[0], nin > 1 ? in[1] : NULL, nin > 2 ? in[2] : NULL, a->rm, a->rv,
                           a->train, 0.1, 1e-5, out);
}

static void test_batch_norm(void) {
    enum { N = 4, C = 3, L = 2 };
    const int64_t shape[3] = {N, C, L};
    double x[N * C * L], w[C], b[C], rm0[C], rv0[C], want[N * C * L];
    fsdp_tensor_t *tx = mkrand(3, shape, 80, -2, 2, x);
    fsdp_tensor_t *tw = mkrand(1, (const int64_t[]){C}, 81, 0.5, 1.5, w);
    fsdp_tensor_t *tb = mkrand(1, (const int64_t[]){C}, 82, -1, 1, b);
    fsdp_tensor_t *rm = mkrand(1, (const int64_t[]){C}, 83, -0.5, 0.5, rm0);
    fsdp_tensor_t *rv = mkrand(1, (const int64_t[]){C}, 84, 0.5, 2, rv0);
    double mean[C], var[C], rm1[C], rv1[C];
    for (int c = 0; c < C; c++) {
        double s = 0, q = 0;
        for (int n = 0; n < N; n++)
            for (int l = 0; l < L; l++)
                s += x[(n * C + c) * L + l];
        mean[c] = s / (N * L);
        for (int n = 0; n < N; n++)
            for (int l = 0; l < L; l++)
                q += (x[(n * C + c) * L + l] - mean[c]) * (x[(n * C + c) * L + l] - mean[c]);
        var[c] = q / (N * L);
        rm1[c] = 0.9 * rm0[c] + 0.1 * mean[c];
        rv1[c] = 0.9 * rv0[c] + 0.1 * q / (N * L - 1);
        for (int n = 0; n < N; n++)
            for (int l = 0; l < L; l++) {
                int i = (n * C + c) * L + l;
                want[i] = (x[i] - mean[c]) / sqrt(var[c] + 1e-5) * w[c] + b[c];
            }
    }
    struct bn_arg a = {true, rm, rv};
    fsdp_tensor_t *y = NULL;
    fn_batch_norm(&a, 3, (fsdp_tensor_t *[]){tx, tw, tb}, &y);
    check_vals(y, 3, shape, want, 1e-10, "batch_norm train");
    fsdp_tensor_release(y);
    check_vals(rm, 1, (const int64_t[]){C}, rm1, 1e-12, "batch_norm train updates running_mean");
    check_vals(rv, 1, (const int64_t[]){C}, rv1, 1e-12,
               "batch_norm train updates running_var (unbiased)");

    for (int i = 0; i < N * C * L; i++) {
        int c = (i / L) % C;
        want[i] = (x[i] - rm1[c]) / sqrt(rv1[c] + 1e-5) * w[c] + b[c];
    }
    struct bn_arg e = {false, rm, rv};
    fn_batch_norm(&e, 3, (fsdp_tensor_t *[]){tx, tw, tb}, &y);
    check_vals(y, 3, shape, want, 1e-10, "batch_norm eval uses the running statistics");
    fsdp_tensor_release(y);
    check_vals(rm, 1, (const int64_t[]){C}, rm1, 0, "batch_norm eval leaves running_mean");

    struct bn_arg t0 = {true, NULL, NULL};
    gc("batch_norm train", fn_batch_norm, &t0, 3, (fsdp_tensor_t *[]){tx, tw, tb}, 1e-4, 1e-6);
    gc("batch_norm train without w, b", fn_batch_norm, &t0, 1, &tx, 1e-4, 1e-6);
    gc("batch_norm eval", fn_batch_norm, &e, 3, (fsdp_tensor_t *[]){tx, tw, tb}, 1e-4, 1e-6);

    fsdp_tensor_t *bad = mkrand(1, (const int64_t[]){C + 1}, 85, 0, 1, NULL);
    y = (fsdp_tensor_t *)&y;
    int rc = fsdp_batch_norm(tx, bad, NULL, NULL, NULL, true, 0.1, 1e-5, &y);
    tap_ok(rc == FSDP_EINVAL && y == NULL && strstr(fsdp_ctx_last_error(ctx), "[4]") &&
               strstr(fsdp_ctx_last_error(ctx), "[4, 3, 2]"),
           "batch_norm with a w of the wrong size is EINVAL naming both shapes");
    rc = fsdp_batch_norm(tx, NULL, NULL, NULL, NULL, false, 0.1, 1e-5, &y);
    tap_ok(rc == FSDP_EINVAL && y == NULL, "batch_norm eval without running statistics is EINVAL");
    fsdp_tensor_release(bad);
    fsdp_tensor_release(tx);
    fsdp_tensor_release(tw);
    fsdp_tensor_release(tb);
    fsdp_tensor_release(rm);
    fsdp_tensor_release(rv);
}

/* ---- embedding ---- */

struct emb_arg {
    fsdp_tensor_t *idx;
    int64_t pad;
};

static int fn_embedding(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    const struct emb_arg *a = arg;
    (void)nin;
    return fsdp_embedding(a->idx, in[0], a->pad, out);
}

static void test_embedding(void) {
    enum { NUM = 5, DIM = 3 };
    double w[NUM * DIM], want[6 * DIM];
    const int64_t iv[6] = {1, 0, 4, 1, 2, 0};
    fsdp_tensor_t *tw = mkrand(2, (const int64_t[]){NUM, DIM}, 90, -1, 1, w);
    fsdp_tensor_t *idx = mk_i64(2, (const int64_t[]){2, 3}, iv);
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < DIM; j++)
            want[i * DIM + j] = w[iv[i] * DIM + j];
    fsdp_tensor_t *y = NULL;
    fsdp_embedding(idx, tw, 0, &y);
    check_vals(y, 3, (const int64_t[]){2, 3, DIM}, want, 0, "embedding rows (i64 indices)");
    fsdp_tensor_release(y);

    /* i32 indices are accepted too. */
    fsdp_tensor_t *idx32 = NULL;
    must(fsdp_tensor_empty(ctx, FSDP_DTYPE_I32, 2, (const int64_t[]){2, 3}, CAT, &idx32),
         "empty i32");
    must(fsdp_tensor_copy_(idx32, idx), "copy_ i32");
    fsdp_embedding(idx32, tw, -1, &y);
    check_vals(y, 3, (const int64_t[]){2, 3, DIM}, want, 0, "embedding rows (i32 indices)");
    fsdp_tensor_release(y);

    /* Gradient with padding_idx 0: rows accumulate, the padding row gets nothing. */
    double g[6 * DIM], gw[NUM * DIM] = {0};
    fsdp_tensor_t *tg = mkrand(3, (const int64_t[]){2, 3, DIM}, 91, -1, 1, g);
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < DIM && iv[i] != 0; j++)
            gw[iv[i] * DIM + j] += g[i * DIM + j];
    must(fsdp_tensor_set_requires_grad(tw, true), "requires_grad");
    must(fsdp_embedding(idx, tw, 0, &y), "embedding");
    must(fsdp_backward(y, tg), "backward");
    check_vals(fsdp_tensor_grad(tw), 2, (const int64_t[]){NUM, DIM}, gw, 1e-15,
               "embedding gradient skips padding_idx and sums repeats");
    fsdp_tensor_release(y);
    must(fsdp_tensor_set_grad(tw, NULL), "set_grad");
    must(fsdp_tensor_set_requires_grad(tw, false), "requires_grad");
    /* The padding row gets no gradient although the output depends on it, so the finite-difference
     * check uses a padding_idx that no index hits; the test above covers the padding row. */
    struct emb_arg a = {idx, 3}, b = {idx32, -1};
    gc("embedding with padding_idx 3 (unused)", fn_embedding, &a, 1, &tw, GC_RTOL, GC_ATOL);
    gc("embedding without padding_idx (i32)", fn_embedding, &b, 1, &tw, GC_RTOL, GC_ATOL);

    fsdp_tensor_t *badi = mk_i64(1, (const int64_t[]){4}, (const int64_t[]){1, 2, 9, -1});
    y = (fsdp_tensor_t *)&y;
    int rc = fsdp_embedding(badi, tw, -1, &y);
    const char *msg = fsdp_ctx_last_error(ctx);
    tap_ok(rc == FSDP_EINVAL && y == NULL, "embedding with an index out of range is EINVAL");
    tap_ok(strstr(msg, "index 9") && strstr(msg, "5 rows"),
           "embedding error names the first bad index and the table size");
    if (!strstr(msg, "index 9")) tap_diag("message: %s", msg);
    fsdp_tensor_release(badi);
    fsdp_tensor_release(tg);
    fsdp_tensor_release(idx32);
    fsdp_tensor_release(idx);
    fsdp_tensor_release(tw);
}

/* ---- dropout ---- */

static void test_dropout(void) {
    enum { N = 4000 };
    const double p = 0.3;
    double *x = malloc(N * sizeof *x), *g = malloc(N * sizeof *g), *want = malloc(N * sizeof *want);
    fsdp_tensor_t *tx = mkrand(1, (const int64_t[]){N}, 100, 0.5, 1.5, x);
    fsdp_tensor_t *tg = mkrand(1, (const int64_t[]){N}, 101, -1, 1, g);
    fsdp_rng_t *rng = fsdp_ctx_rng(ctx);
    uint64_t off0 = rng->offset;
    fsdp_tensor_t *y1 = NULL, *y2 = NULL, *y3 = NULL;
    must(fsdp_tensor_set_requires_grad(tx, true), "requires_grad");
    must(fsdp_dropout(tx, p, true, &y1), "dropout");
    tap_is_uint(rng->offset, off0 + (N + 3) / 4, "dropout advances the context's rng by n/4");
    must(fsdp_backward(y1, tg), "backward");

    /* Kept elements are x / (1 - p), dropped ones 0; the gradient follows the same mask. */
    int64_t kept = 0, wrong = 0;
    for (int64_t i = 0; i < N; i++) {
        double v = at(y1, i);
        bool keep = v != 0;
        kept += keep;
        if (keep && fabs(v - x[i] / (1 - p)) > 1e-12) wrong++;
        want[i] = keep ? g[i] / (1 - p) : 0;
    }
    tap_is_int(wrong, 0, "dropout keeps x / (1 - p) and zeros the rest");
    double frac = (double)kept / N;
    tap_ok(fabs(frac - (1 - p)) < 0.03, "dropout keeps about 1 - p (%.4f)", frac);
    check_vals(fsdp_tensor_grad(tx), 1, (const int64_t[]){N}, want, 1e-12,
               "dropout gradient is mask / (1 - p) times upstream");
    must(fsdp_tensor_set_grad(tx, NULL), "set_grad");
    must(fsdp_tensor_set_requires_grad(tx, false), "requires_grad");

    /* The same rng position gives the same output; the next one differs. */
    rng->offset = off0;
    must(fsdp_dropout(tx, p, true, &y2), "dropout");
    must(fsdp_dropout(tx, p, true, &y3), "dropout");
    int64_t same = 0, diff = 0;
    for (int64_t i = 0; i < N; i++) {
        same += at(y1, i) == at(y2, i);
        diff += at(y1, i) != at(y3, i);
    }
    tap_is_int(same, N, "dropout from the same rng position is reproducible");
    tap_ok(diff > N / 10, "consecutive dropout calls draw different masks");
    fsdp_tensor_release(y1);
    fsdp_tensor_release(y2);
    fsdp_tensor_release(y3);

    uint64_t off1 = rng->offset;
    must(fsdp_dropout(tx, p, false, &y1), "dropout eval");
    must(fsdp_dropout(tx, 0, true, &y2), "dropout p = 0");
    tap_ok(y1 == tx && y2 == tx && rng->offset == off1,
           "dropout in eval or with p = 0 returns x itself and draws nothing");
    fsdp_tensor_release(y1);
    fsdp_tensor_release(y2);
    must(fsdp_dropout(tx, 1, true, &y1), "dropout p = 1");
    int64_t nz = 0;
    for (int64_t i = 0; i < N; i++)
        nz += at(y1, i) != 0;
    tap_is_int(nz, 0, "dropout with p = 1 gives zeros");
    fsdp_tensor_release(y1);
    y1 = (fsdp_tensor_t *)&y1;
    int rc = fsdp_dropout(tx, 1.5, true, &y1);
    tap_ok(rc == FSDP_EINVAL && y1 == NULL, "dropout with p = 1.5 is EINVAL");
    rc = fsdp_dropout(tx, -0.1, true, &y1);
    tap_ok(rc == FSDP_EINVAL && y1 == NULL, "dropout with p = -0.1 is EINVAL");
    fsdp_tensor_release(tx);
    fsdp_tensor_release(tg);
    free(x);
    free(g);
    free(want);
}

/* ---- cross-entropy ---- */

struct ce_arg {
    fsdp_tensor_t *target;
    int64_t ignore;
    fsdp_reduction_t red;
    double ls;
};

static int fn_ce(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    const struct ce_arg *a = arg;
    (void)nin;
    return fsdp_cross_entropy(in[0], a->target, a->ignore, a->red, a->ls, out);
}

static void test_cross_entropy(void) {
    enum { R = 5, C = 4 };
    double x[R * C], loss[R];
    const int64_t tv[R] = {1, -100, 3, 0, 2};
    fsdp_tensor_t *tx = mkrand(2, (const int64_t[]){R, C}, 110, -2, 2, x);
    fsdp_tensor_t *tt = mk_i64(1, (const int64_t[]){R}, tv);
    static const char *const rn[3] = {"mean", "sum", "none"};
    for (int ls_i = 0; ls_i < 2; ls_i++) {
        double ls = ls_i ? 0.1 : 0;
        ref_ce(x, tv, R, C, -100, ls, loss);
        double sum = 0;
        for (int i = 0; i < R; i++)
            sum += loss[i];
        for (int red = 0; red < 3; red++) {
            struct ce_arg a = {tt, -100, (fsdp_reduction_t)red, ls};
            fsdp_tensor_t *y = NULL;
            char nm[96];
            snprintf(nm, sizeof nm, "cross_entropy %s, ignore_index, label_smoothing %g", rn[red],
                     ls);
            fn_ce(&a, 1, &tx, &y);
            if (red == FSDP_REDUCTION_NONE)
                check_vals(y, 1, (const int64_t[]){R}, loss, 1e-12, nm);
            else
                check_vals(y, 0, NULL, (const double[]){red == 0 ? sum / 4 : sum}, 1e-12, nm);
            fsdp_tensor_release(y);
            gc(nm, fn_ce, &a, 1, &tx, GC_RTOL, GC_ATOL);
        }
    }

    /* Logits (C) with a scalar target. */
    fsdp_tensor_t *x1 = mkrand(1, (const int64_t[]){C}, 111, -2, 2, x);
    fsdp_tensor_t *t1 = mk_i64(0, NULL, (const int64_t[]){2});
    ref_ce(x, (const int64_t[]){2}, 1, C, -100, 0, loss);
    struct ce_arg a1 = {t1, -100, FSDP_REDUCTION_MEAN, 0};
    fsdp_tensor_t *y = NULL;
    fn_ce(&a1, 1, &x1, &y);
    check_vals(y, 0, NULL, loss, 1e-12, "cross_entropy of 1-d logits and a scalar target");
    fsdp_tensor_release(y);
    gc("cross_entropy of 1-d logits", fn_ce, &a1, 1, &x1, GC_RTOL, GC_ATOL);

    /* Every target ignored: mean is 0 / 0 = NaN, sum is 0. */
    fsdp_tensor_t *tall = mk_i64(1, (const int64_t[]){R}, (const int64_t[]){7, 7, 7, 7, 7});
    struct ce_arg an = {tall, 7, FSDP_REDUCTION_MEAN, 0};
    fn_ce(&an, 1, &tx, &y);
    tap_ok(y && isnan(at(y, 0)), "cross_entropy mean with every target ignored is NaN");
    fsdp_tensor_release(y);
    an.red = FSDP_REDUCTION_SUM;
    fn_ce(&an, 1, &tx, &y);
    tap_ok(y && at(y, 0) == 0, "cross_entropy sum with every target ignored is 0");
    fsdp_tensor_release(y);

    fsdp_tensor_t *tbad = mk_i64(1, (const int64_t[]){R}, (const int64_t[]){0, 1, 4, 2, 9});
    y = (fsdp_tensor_t *)&y;
    int rc = fsdp_cross_entropy(tx, tbad, -100, FSDP_REDUCTION_MEAN, 0, &y);
    tap_ok(rc == FSDP_EINVAL && y == NULL && strstr(fsdp_ctx_last_error(ctx), "target 4") &&
               strstr(fsdp_ctx_last_error(ctx), "4 classes"),
           "cross_entropy names the first target out of range and the class count");
    rc = fsdp_cross_entropy(tx, t1, -100, FSDP_REDUCTION_MEAN, 0, &y);
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_ctx_last_error(ctx), "[5, 4]"),
           "cross_entropy with mismatched target shape is EINVAL naming the shapes");
    rc = fsdp_cross_entropy(tx, tt, -100, FSDP_REDUCTION_MEAN, 1.5, &y);
    tap_ok(rc == FSDP_EINVAL, "cross_entropy with label_smoothing 1.5 is EINVAL");
    fsdp_tensor_release(tbad);
    fsdp_tensor_release(tall);
    fsdp_tensor_release(t1);
    fsdp_tensor_release(x1);
    fsdp_tensor_release(tt);
    fsdp_tensor_release(tx);
}

/* ---- f16 / bf16 ---- */

/* Whether a and b hold the same values (compared as doubles, NaN equal to NaN). */
static bool same_values(const fsdp_tensor_t *a, const fsdp_tensor_t *b) {
    if (!a || !b || fsdp_tensor_numel(a) != fsdp_tensor_numel(b)) return false;
    for (int64_t i = 0; i < fsdp_tensor_numel(a); i++) {
        double x = at(a, i), y = at(b, i);
        if (!(x == y || (isnan(x) && isnan(y)))) return false;
    }
    return true;
}

/* An f32 tensor with the values of t (exact for f16/bf16). */
static fsdp_tensor_t *widen(const fsdp_tensor_t *t) {
    fsdp_tensor_t *w = NULL;
    must(fsdp_tensor_empty(ctx, F32, fsdp_tensor_ndim(t), fsdp_tensor_shape(t), CAT, &w), "empty");
    must(fsdp_tensor_copy_(w, t), "copy_");
    return w;
}

static void test_half(void) {
    const fsdp_dtype_t dts[2] = {FSDP_DTYPE_F16, FSDP_DTYPE_BF16};
    double x[24], w[20], b[5];
    fill_rand(x, 24, 120, -2, 2);
    fill_rand(w, 20, 121, -1, 1);
    fill_rand(b, 5, 122, -1, 1);
    for (int i = 0; i < 2; i++) {
        fsdp_dtype_t dt = dts[i];
        const char *dn = fsdp_dtype_name(dt);
        fsdp_tensor_t *hx = mk(dt, 3, (const int64_t[]){2, 3, 4}, x);
        fsdp_tensor_t *hw = mk(dt, 2, (const int64_t[]){5, 4}, w);
        fsdp_tensor_t *hb = mk(dt, 1, (const int64_t[]){5}, b);
        fsdp_tensor_t *fx = widen(hx), *fw = widen(hw), *fb = widen(hb);
        fsdp_tensor_t *hy = NULL, *fy = NULL, *fyr = NULL;

        must(fsdp_tensor_set_requires_grad(hw, true), "requires_grad");
        must(fsdp_tensor_set_requires_grad(fw, true), "requires_grad");
        fsdp_linear(hx, hw, hb, &hy);
        must(fsdp_linear(fx, fw, fb, &fy), "linear f32");
        must(fsdp_to_dtype(fy, dt, &fyr), "to_dtype");
        tap_ok(hy && fsdp_tensor_dtype(hy) == dt && same_values(hy, fyr),
               "%s linear equals the f32 linear rounded to %s", dn, dn);
        /* Backward in f32 too: the weight gradient is the f32 one, rounded. */
        fsdp_tensor_t *hs = NULL, *fs = NULL;
        must(fsdp_sum(hy, 0, NULL, false, &hs), "sum");
        must(fsdp_sum(fy, 0, NULL, false, &fs), "sum");
        must(fsdp_backward_multi(2, (fsdp_tensor_t *[]){hs, fs}, (fsdp_tensor_t *[]){NULL, NULL}),
             "backward");
        const fsdp_tensor_t *hg = fsdp_tensor_grad(hw), *fg = fsdp_tensor_grad(fw);
        bool close = hg && fg && fsdp_tensor_dtype(hg) == dt;
        for (int64_t j = 0; close && j < 20; j++)
            close = fabs(at(hg, j) - at(fg, j)) <= 1e-2 * (1 + fabs(at(fg, j)));
        tap_ok(close, "%s linear weight gradient is %s and matches f32", dn, dn);
        must(fsdp_tensor_set_requires_grad(hw, false), "requires_grad");
        must(fsdp_tensor_set_requires_grad(fw, false), "requires_grad");
        fsdp_tensor_release(hs);
        fsdp_tensor_release(fs);
        fsdp_tensor_release(hy);
        fsdp_tensor_release(fy);
        fsdp_tensor_release(fyr);

        for (int dim = 0; dim < 3; dim += 2) {
            fsdp_softmax(hx, dim, &hy);
            must(fsdp_softmax(fx, dim, &fy), "softmax f32");
            must(fsdp_to_dtype(fy, dt, &fyr), "to_dtype");
            tap_ok(hy && fsdp_tensor_dtype(hy) == dt && same_values(hy, fyr),
                   "%s softmax along dim %d equals the f32 softmax rounded", dn, dim);
            fsdp_tensor_release(hy);
            fsdp_tensor_release(fy);
            fsdp_tensor_release(fyr);
        }
        fsdp_tensor_release(hx);
        fsdp_tensor_release(hw);
        fsdp_tensor_release(hb);
        fsdp_tensor_release(fx);
        fsdp_tensor_release(fw);
        fsdp_tensor_release(fb);
    }
}

/* Nothing is recorded with grad mode off, and the tape stays clean after each test. */
static void test_no_record(void) {
    fsdp_tensor_t *a = mkrand(2, (const int64_t[]){2, 3}, 130, 0, 1, NULL);
    fsdp_tensor_t *b = mkrand(2, (const int64_t[]){3, 2}, 131, 0, 1, NULL), *y = NULL;
    must(fsdp_tensor_set_requires_grad(a, true), "requires_grad");
    bool was = fsdp_set_grad_enabled(ctx, false);
    must(fsdp_matmul(a, b, &y), "matmul");
    tap_ok(fsdp_tape_size(ctx) == 0 && !fsdp_tensor_requires_grad(y),
           "matmul with grad mode off records nothing");
    fsdp_set_grad_enabled(ctx, was);
    fsdp_tensor_release(y);
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
}

int main(void) {
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    o.seed = 1234;
    if (fsdp_ctx_create(&o, &ctx) < 0) tap_bail("context creation failed");
    tap_plan_lazy();
    test_matmul_shapes();
    test_matmul_strided();
    test_matmul_errors();
    test_linear();
    test_softmax();
    test_layer_norm();
    test_batch_norm();
    test_embedding();
    test_dropout();
    test_cross_entropy();
    test_half();
    test_no_record();
    tap_is_size(fsdp_tape_size(ctx), 0, "the tape is empty at the end");
    fsdp_ctx_destroy(ctx);
    return tap_done();
}
