/* SPDX-License-Identifier: MIT */
/*
 * t_ops.c: the element-wise operations, reductions, cat and split: forward values and errors.
 *
 * Forward values are compared with naive references computed here in double (broadcasting by
 * index arithmetic, reductions by accumulation into the kept index), on small shapes that cover
 * broadcasting, scalars (ndim 0) and transposed (non-contiguous) operands. f16/bf16 results are
 * compared with the f32 computation rounded once to the 16-bit type. Then come error cases, and
 * a check that every byte allocated by the tests has been given back. The gradients of the same
 * operations are checked in t_ops_grad.c; the helpers both use are in ops_util.c.
 */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "ops_util.h"
#include "tap.h"

/* ---- helpers ------------------------------------------------------------------------------ */

/* Index into an operand of shape (ond, oshape) broadcast to (nd, shape), for the output's
 * row-major index i. */
static int64_t bcast_index(int64_t i, int nd, const int64_t *shape, int ond,
                           const int64_t *oshape) {
    int64_t off = 0, mul = 1, rem = i;
    for (int d = nd - 1; d >= 0; d--) {
        int64_t idx = rem % shape[d];
        rem /= shape[d];
        int od = d - (nd - ond);
        if (od < 0) continue;
        if (oshape[od] != 1) off += idx * mul;
        mul *= oshape[od];
    }
    return off;
}

/* Contiguous values of the transpose (dims d0, d1) of a contiguous (nd, shape) array. */
static void transpose_vals(int nd, const int64_t *shape, const double *v, int d0, int d1,
                           double *out) {
    int64_t ts[8], n = numel_of(nd, shape);
    memcpy(ts, shape, sizeof(int64_t) * (size_t)nd);
    ts[d0] = shape[d1];
    ts[d1] = shape[d0];
    for (int64_t i = 0; i < n; i++) {
        int64_t idx[8], rem = i, src = 0, mul = 1;
        for (int d = nd - 1; d >= 0; d--) {
            idx[d] = rem % ts[d];
            rem /= ts[d];
        }
        int64_t t = idx[d0];
        idx[d0] = idx[d1];
        idx[d1] = t;
        for (int d = nd - 1; d >= 0; d--) {
            src += idx[d] * mul;
            mul *= shape[d];
        }
        out[i] = v[src];
    }
}

static fsdp_tensor_t *transposed(fsdp_tensor_t *t, int d0, int d1) {
    fsdp_tensor_t *v = NULL;
    fsdp_transpose(t, d0, d1, &v);
    return v;
}

/* The reference of a binary operation, in double and in float. */
static double ref_bin(char sym, double a, double b) {
    switch (sym) {
    case '+':
        return a + b;
    case '-':
        return a - b;
    case '*':
        return a * b;
    default:
        return a / b;
    }
}

static float ref_bin_f(char sym, float a, float b) {
    switch (sym) {
    case '+':
        return a + b;
    case '-':
        return a - b;
    case '*':
        return a * b;
    default:
        return a / b;
    }
}

/* ---- binary forward -------------------------------------------------------------------------- */

static void test_binary_forward(void) {
    double av[MAXN], bv[MAXN], want[MAXN];
    for (int o = 0; o < 4; o++) {
        const struct binop *op = &binops[o];
        for (int p = 0; p < 4; p++) {
            const struct pattern *pt = &patterns[p];
            fsdp_dtype_t dt = p == 0 ? FSDP_DTYPE_F64 : FSDP_DTYPE_F32;
            double tol = dt == FSDP_DTYPE_F64 ? 1e-15 : 1e-6;
            fsdp_tensor_t *a = mk_rand(dt, pt->an, pt->as, -2, 2, 10 + p, av);
            /* b stays away from zero so that division is tame. */
            fsdp_tensor_t *b = mk_rand(dt, pt->bn, pt->bs, 0.5, 2, 20 + p, bv);
            fsdp_tensor_t *y = NULL;
            int64_t n = numel_of(pt->on, pt->os);
            for (int64_t i = 0; i < n; i++)
                want[i] = ref_bin(op->sym, av[bcast_index(i, pt->on, pt->os, pt->an, pt->as)],
                                  bv[bcast_index(i, pt->on, pt->os, pt->bn, pt->bs)]);
            op->fn(a, b, &y);
            check_vals(y, dt, pt->on, pt->os, want, tol, tol, "%s %s %s broadcasts to %s",
                       fsdp_dtype_name(dt), op->name, pt->what, pt->on == 3 ? "(2,3,4)" : "(2,3)");
            fsdp_tensor_release(a);
            fsdp_tensor_release(b);
            fsdp_tensor_release(y);
        }
    }

    /* Transposed operands are read through their strides. */
    double base[12], bt[12], at[12];
    for (int o = 0; o < 4; o++) {
        const struct binop *op = &binops[o];
        fsdp_tensor_t *A = mk_rand(FSDP_DTYPE_F32, 2, (const int64_t[]){4, 3}, -2, 2, 31, base);
        fsdp_tensor_t *B = mk_rand(FSDP_DTYPE_F32, 2, (const int64_t[]){4, 3}, 0.5, 2, 32, bv);
        fsdp_tensor_t *c = mk_rand(FSDP_DTYPE_F32, 1, (const int64_t[]){4}, 0.5, 2, 33, av);
        fsdp_tensor_t *ta = transposed(A, 0, 1), *tb = transposed(B, 0, 1), *y = NULL, *z = NULL;
        transpose_vals(2, (const int64_t[]){4, 3}, base, 0, 1, at);
        transpose_vals(2, (const int64_t[]){4, 3}, bv, 0, 1, bt);
        for (int i = 0; i < 12; i++)
            want[i] = ref_bin(op->sym, at[i], av[i % 4]);
        op->fn(ta, c, &y);
        check_vals(y, FSDP_DTYPE_F32, 2, (const int64_t[]){3, 4}, want, 1e-6, 1e-6,
                   "f32 %s of a transposed (3,4) and a (4) row", op->name);
        for (int i = 0; i < 12; i++)
            want[i] = ref_bin(op->sym, at[i], bt[i]);
        op->fn(ta, tb, &z);
        check_vals(z, FSDP_DTYPE_F32, 2, (const int64_t[]){3, 4}, want, 1e-6, 1e-6,
                   "f32 %s of two transposed (3,4) operands", op->name);
        fsdp_tensor_t *all[] = {A, B, c, ta, tb, y, z};
        release_all(7, all);
    }

    /* Two scalars give a scalar. */
    fsdp_tensor_t *s = mk(FSDP_DTYPE_F64, 0, NULL, (const double[]){1.5});
    fsdp_tensor_t *t = mk(FSDP_DTYPE_F64, 0, NULL, (const double[]){-4});
    fsdp_tensor_t *y = NULL;
    fsdp_mul(s, t, &y);
    check_vals(y, FSDP_DTYPE_F64, 0, NULL, (const double[]){-6}, 0, 0,
               "scalar * scalar is a scalar");
    fsdp_tensor_t *all[] = {s, t, y};
    release_all(3, all);
}

/* f16/bf16: computed in f32, rounded once; a single f32 operation, so the result is exact. */
static void test_binary_half(void) {
    const fsdp_dtype_t dts[2] = {FSDP_DTYPE_F16, FSDP_DTYPE_BF16};
    double av[24], bv[4], want[24];
    for (int k = 0; k < 2; k++) {
        fsdp_dtype_t dt = dts[k];
        for (int o = 0; o < 4; o++) {
            const struct binop *op = &binops[o];
            fsdp_tensor_t *a = mk_rand(dt, 3, (const int64_t[]){2, 3, 4}, -8, 8, 40 + o, av);
            fsdp_tensor_t *b = mk_rand(dt, 1, (const int64_t[]){4}, 0.3, 3, 50 + o, bv);
            fsdp_tensor_t *y = NULL;
            for (int i = 0; i < 24; i++)
                want[i] = rnd(dt, ref_bin_f(op->sym, (float)av[i], (float)bv[i % 4]));
            op->fn(a, b, &y);
            check_vals(y, dt, 3, (const int64_t[]){2, 3, 4}, want, 0, 0,
                       "%s %s: f32 result rounded once to %s", fsdp_dtype_name(dt), op->name,
                       fsdp_dtype_name(dt));
            fsdp_tensor_t *all[] = {a, b, y};
            release_all(3, all);
        }
    }
}

/* ---- unary forward ------------------------------------------------------------------------------
 */

static void test_unary_forward(void) {
    double xv[12], xt[12], want[12];
    const int64_t s34[2] = {3, 4}, s43[2] = {4, 3};
    for (int u = 0; u < 9; u++) {
        const struct unop *op = &unops[u];
        for (int k = 0; k < 2; k++) {
            fsdp_dtype_t dt = k ? FSDP_DTYPE_F64 : FSDP_DTYPE_F32;
            double tol = k ? 1e-14 : 2e-6;
            fsdp_tensor_t *x = mk_rand(dt, 2, s34, op->lo, op->hi, 60 + u, xv), *y = NULL;
            for (int i = 0; i < 12; i++)
                want[i] = op->ref(xv[i]);
            op->fn(x, &y);
            check_vals(y, dt, 2, s34, want, tol, tol, "%s %s matches libm", fsdp_dtype_name(dt),
                       op->name);
            fsdp_tensor_release(x);
            fsdp_tensor_release(y);
        }
        /* A transposed input is made contiguous first. */
        fsdp_tensor_t *x = mk_rand(FSDP_DTYPE_F64, 2, s43, op->lo, op->hi, 70 + u, xv);
        fsdp_tensor_t *tx = transposed(x, 0, 1), *y = NULL;
        transpose_vals(2, s43, xv, 0, 1, xt);
        for (int i = 0; i < 12; i++)
            want[i] = op->ref(xt[i]);
        op->fn(tx, &y);
        check_vals(y, FSDP_DTYPE_F64, 2, s34, want, 1e-14, 1e-14, "f64 %s of a transposed input",
                   op->name);
        fsdp_tensor_t *all[] = {x, tx, y};
        release_all(3, all);
    }
    /* Half types: the f32 value rounded; allow one unit in the last place of the 16-bit type for
     * the libm/kernel difference in f32. */
    const int half_ops[3] = {2, 4, 5};
    for (int k = 0; k < 2; k++) {
        fsdp_dtype_t dt = k ? FSDP_DTYPE_BF16 : FSDP_DTYPE_F16;
        double ulp = k ? 1.0 / 128 : 1.0 / 1024;
        for (int j = 0; j < 3; j++) {
            const struct unop *op = &unops[half_ops[j]];
            fsdp_tensor_t *x = mk_rand(dt, 2, s34, op->lo, op->hi, 80 + j, xv), *y = NULL;
            for (int i = 0; i < 12; i++)
                want[i] = rnd(dt, (float)op->ref(xv[i]));
            op->fn(x, &y);
            check_vals(y, dt, 2, s34, want, ulp, 1e-4, "%s %s is the rounded f32 value",
                       fsdp_dtype_name(dt), op->name);
            fsdp_tensor_release(x);
            fsdp_tensor_release(y);
        }
    }
}

/* ---- where, masked_fill, causal mask ------------------------------------------------------ */

static void test_where_mask(void) {
    double av[24], bv[24], want[24];
    const int64_t s34[2] = {3, 4};
    /* cond (3, 1) broadcast along rows. */
    fsdp_tensor_t *c = mk(FSDP_DTYPE_U8, 2, (const int64_t[]){3, 1}, (const double[]){1, 0, 1});
    fsdp_tensor_t *a = mk_rand(FSDP_DTYPE_F32, 2, s34, -1, 1, 90, av);
    fsdp_tensor_t *b = mk_rand(FSDP_DTYPE_F32, 2, s34, -1, 1, 91, bv);
    fsdp_tensor_t *y = NULL;
    for (int i = 0; i < 12; i++)
        want[i] = (i / 4) != 1 ? av[i] : bv[i];
    fsdp_where(c, a, b, &y);
    check_vals(y, FSDP_DTYPE_F32, 2, s34, want, 0, 0, "where: u8 cond (3,1) broadcast to (3,4)");
    fsdp_tensor_t *l1[] = {c, a, b, y};
    release_all(4, l1);

    /* A bool cond of the full shape, f64. */
    double cv[12];
    for (int i = 0; i < 12; i++)
        cv[i] = i % 3 == 0;
    c = mk(FSDP_DTYPE_BOOL, 2, s34, cv);
    a = mk_rand(FSDP_DTYPE_F64, 2, s34, -1, 1, 92, av);
    b = mk_rand(FSDP_DTYPE_F64, 2, s34, -1, 1, 93, bv);
    for (int i = 0; i < 12; i++)
        want[i] = cv[i] ? av[i] : bv[i];
    fsdp_where(c, a, b, &y);
    check_vals(y, FSDP_DTYPE_F64, 2, s34, want, 0, 0, "where: bool cond of the same shape");
    fsdp_tensor_t *l2[] = {c, a, b, y};
    release_all(4, l2);

    /* A scalar cond picks one side everywhere; bf16 values pass through unchanged. */
    c = mk(FSDP_DTYPE_U8, 0, NULL, (const double[]){1});
    a = mk_rand(FSDP_DTYPE_BF16, 2, s34, -1, 1, 94, av);
    b = mk_rand(FSDP_DTYPE_BF16, 2, s34, -1, 1, 95, bv);
    fsdp_where(c, a, b, &y);
    check_vals(y, FSDP_DTYPE_BF16, 2, s34, av, 0, 0, "where: scalar cond, bf16 values exact");
    fsdp_tensor_t *l3[] = {c, a, b, y};
    release_all(4, l3);

    /* masked_fill with a (4) mask over (2, 3, 4), and a (2, 1, 4) bool mask with -inf. */
    const int64_t s234[3] = {2, 3, 4};
    fsdp_tensor_t *x = mk_rand(FSDP_DTYPE_F32, 3, s234, -1, 1, 96, av);
    fsdp_tensor_t *m = mk(FSDP_DTYPE_U8, 1, (const int64_t[]){4}, (const double[]){0, 1, 0, 1});
    for (int i = 0; i < 24; i++)
        want[i] = (i % 4) % 2 ? -1e4 : av[i];
    fsdp_masked_fill(x, m, -1e4, &y);
    check_vals(y, FSDP_DTYPE_F32, 3, s234, want, 0, 0, "masked_fill: (4) mask over (2,3,4)");
    fsdp_tensor_release(m);
    fsdp_tensor_release(y);
    double mv[8] = {1, 0, 0, 0, 0, 0, 1, 1};
    m = mk(FSDP_DTYPE_BOOL, 3, (const int64_t[]){2, 1, 4}, mv);
    for (int i = 0; i < 24; i++)
        want[i] = mv[(i / 12) * 4 + i % 4] ? -INFINITY : av[i];
    fsdp_masked_fill(x, m, -INFINITY, &y);
    check_vals(y, FSDP_DTYPE_F32, 3, s234, want, 0, 0, "masked_fill: (2,1,4) bool mask fills -inf");
    fsdp_tensor_t *l4[] = {x, m, y};
    release_all(3, l4);

    /* The causal mask. */
    double cm[16];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++)
            cm[i * 4 + j] = j > i ? -INFINITY : 0;
    fsdp_causal_mask(ops_ctx, 4, &y);
    check_vals(y, FSDP_DTYPE_F32, 2, (const int64_t[]){4, 4}, cm, 0, 0,
               "causal_mask(4): 0 on and below the diagonal, -inf above");
    tap_ok(y && !fsdp_tensor_requires_grad(y), "causal_mask needs no gradient");
    fsdp_tensor_release(y);
    fsdp_causal_mask(ops_ctx, 0, &y);
    check_vals(y, FSDP_DTYPE_F32, 2, (const int64_t[]){0, 0}, cm, 0, 0,
               "causal_mask(0) is an empty (0,0) tensor");
    fsdp_tensor_release(y);
}

/* ---- dtype conversion -------------------------------------------------------------------------
 */

static void test_to_dtype(void) {
    double v[12], want[12], vt[12];
    const int64_t s34[2] = {3, 4}, s43[2] = {4, 3};
    fsdp_tensor_t *x = mk_rand(FSDP_DTYPE_F32, 2, s34, -3, 3, 100, v), *y = NULL;
    for (int i = 0; i < 12; i++)
        want[i] = rnd(FSDP_DTYPE_BF16, v[i]);
    fsdp_to_dtype(x, FSDP_DTYPE_BF16, &y);
    check_vals(y, FSDP_DTYPE_BF16, 2, s34, want, 0, 0, "to_dtype f32 -> bf16 rounds to nearest");
    fsdp_tensor_release(y);
    fsdp_to_dtype(x, FSDP_DTYPE_F32, &y);
    check_vals(y, FSDP_DTYPE_F32, 2, s34, v, 0, 0, "to_dtype to the same dtype copies the values");
    tap_ok(y && !fsdp_tensor_same_storage(x, y), "to_dtype to the same dtype is a new tensor");
    fsdp_tensor_release(y);
    for (int i = 0; i < 12; i++)
        want[i] = trunc(v[i]);
    fsdp_tensor_set_requires_grad(x, true);
    fsdp_to_dtype(x, FSDP_DTYPE_I32, &y);
    check_vals(y, FSDP_DTYPE_I32, 2, s34, want, 0, 0, "to_dtype f32 -> i32 truncates");
    tap_ok(y && !fsdp_tensor_requires_grad(y), "an integer conversion carries no gradient");
    fsdp_tensor_release(y);
    fsdp_tensor_release(x);
    fsdp_tape_clear(ops_ctx);

    x = mk_rand(FSDP_DTYPE_F64, 2, s43, -3, 3, 101, v);
    fsdp_tensor_t *tx = transposed(x, 0, 1);
    transpose_vals(2, s43, v, 0, 1, vt);
    for (int i = 0; i < 12; i++)
        want[i] = rnd(FSDP_DTYPE_F32, vt[i]);
    fsdp_to_dtype(tx, FSDP_DTYPE_F32, &y);
    check_vals(y, FSDP_DTYPE_F32, 2, s34, want, 0, 0, "to_dtype of a transposed f64 to f32");
    fsdp_tensor_release(y);
    fsdp_to_dtype(tx, FSDP_DTYPE_F64, &y);
    check_vals(y, FSDP_DTYPE_F64, 2, s34, vt, 0, 0, "to_dtype of a transposed f64 to f64");
    fsdp_tensor_t *all[] = {x, tx, y};
    release_all(3, all);

    x = mk_rand(FSDP_DTYPE_F16, 2, s34, -3, 3, 102, v);
    fsdp_to_dtype(x, FSDP_DTYPE_F32, &y);
    check_vals(y, FSDP_DTYPE_F32, 2, s34, v, 0, 0, "to_dtype f16 -> f32 is exact");
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
}

/* ---- mse_loss ----------------------------------------------------------------------------------
 */

static void test_mse(void) {
    double av[6], bv[6], sq[6], sum = 0;
    const int64_t s23[2] = {2, 3};
    fsdp_tensor_t *a = mk_rand(FSDP_DTYPE_F64, 2, s23, -2, 2, 110, av);
    fsdp_tensor_t *b = mk_rand(FSDP_DTYPE_F64, 2, s23, -2, 2, 111, bv), *y = NULL;
    for (int i = 0; i < 6; i++) {
        sq[i] = (av[i] - bv[i]) * (av[i] - bv[i]);
        sum += sq[i];
    }
    fsdp_mse_loss(a, b, FSDP_REDUCTION_MEAN, &y);
    check_vals(y, FSDP_DTYPE_F64, 0, NULL, (const double[]){sum / 6}, 1e-15, 0,
               "mse_loss mean is a scalar");
    fsdp_tensor_release(y);
    fsdp_mse_loss(a, b, FSDP_REDUCTION_SUM, &y);
    check_vals(y, FSDP_DTYPE_F64, 0, NULL, (const double[]){sum}, 1e-15, 0, "mse_loss sum");
    fsdp_tensor_release(y);
    fsdp_mse_loss(a, b, FSDP_REDUCTION_NONE, &y);
    check_vals(y, FSDP_DTYPE_F64, 2, s23, sq, 1e-15, 0, "mse_loss none is element-wise");
    fsdp_tensor_t *all[] = {a, b, y};
    release_all(3, all);

    a = mk_rand(FSDP_DTYPE_F16, 2, s23, -2, 2, 112, av);
    b = mk_rand(FSDP_DTYPE_F16, 2, s23, -2, 2, 113, bv);
    float fs = 0;
    for (int i = 0; i < 6; i++)
        fs += ((float)av[i] - (float)bv[i]) * ((float)av[i] - (float)bv[i]);
    fsdp_mse_loss(a, b, FSDP_REDUCTION_MEAN, &y);
    check_vals(y, FSDP_DTYPE_F16, 0, NULL, (const double[]){rnd(FSDP_DTYPE_F16, fs / 6)}, 1e-3, 0,
               "f16 mse_loss mean computed in f32");
    fsdp_tensor_t *all2[] = {a, b, y};
    release_all(3, all2);
}

/* ---- sum and mean ------------------------------------------------------------------------------
 */

/* Sum or mean of v (nd, shape) over the dimensions in mask, in keepdim row-major order. */
static void ref_reduce(int nd, const int64_t *shape, const double *v, unsigned mask, bool mean,
                       double *out) {
    int64_t ks[8], n = numel_of(nd, shape), count = 1;
    for (int d = 0; d < nd; d++) {
        ks[d] = (mask >> d) & 1 ? 1 : shape[d];
        if ((mask >> d) & 1) count *= shape[d];
    }
    int64_t on = numel_of(nd, ks);
    for (int64_t j = 0; j < on; j++)
        out[j] = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t rem = i, oi = 0, mul = 1;
        for (int d = nd - 1; d >= 0; d--) {
            int64_t idx = rem % shape[d];
            rem /= shape[d];
            if (!((mask >> d) & 1)) oi += idx * mul;
            mul *= ks[d];
        }
        out[oi] += v[i];
    }
    if (mean)
        for (int64_t j = 0; j < on; j++)
            out[j] /= (double)count;
}

static void test_reduce(void) {
    double v[24], vt[24], want[24];
    const int64_t s234[3] = {2, 3, 4};
    const struct red_case cases[] = {
        {false, 1, {1}, false, 2, {2, 4}, 2, "sum over dim 1"},
        {false, 2, {0, 2}, false, 1, {3}, 5, "sum over dims {0, 2}"},
        {false, 2, {2, 0}, true, 3, {1, 3, 1}, 5, "sum over dims {2, 0} keepdim"},
        {false, 1, {-1}, false, 2, {2, 3}, 4, "sum over dim -1"},
        {false, 0, {0}, false, 0, {0}, 7, "sum over every dim is a scalar"},
        {false, 2, {1, 2}, true, 3, {2, 1, 1}, 6, "sum over dims {1, 2} keepdim"},
        {true, 2, {1, 2}, false, 1, {2}, 6, "mean over dims {1, 2}"},
        {true, 0, {0}, true, 3, {1, 1, 1}, 7, "mean over every dim keepdim"},
        {true, 1, {0}, false, 2, {3, 4}, 1, "mean over dim 0"},
        {true, 3, {0, 1, 2}, false, 0, {0}, 7, "mean over all three dims listed"},
    };
    fsdp_tensor_t *x = mk_rand(FSDP_DTYPE_F64, 3, s234, -2, 2, 120, v);
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const struct red_case *c = &cases[k];
        fsdp_tensor_t *y = NULL;
        ref_reduce(3, s234, v, c->mask, c->mean, want);
        (c->mean ? fsdp_mean : fsdp_sum)(x, c->ndims, c->dims, c->keepdim, &y);
        check_vals(y, FSDP_DTYPE_F64, c->on, c->os, want, 1e-14, 1e-14, "f64 %s of (2,3,4)",
                   c->what);
        fsdp_tensor_release(y);
    }
    fsdp_tensor_release(x);

    /* A transposed input: (2,3,4) viewed as (4,3,2), summed over its middle dim. */
    fsdp_tensor_t *y = NULL;
    x = mk_rand(FSDP_DTYPE_F64, 3, s234, -2, 2, 121, v);
    fsdp_tensor_t *tx = transposed(x, 0, 2);
    transpose_vals(3, s234, v, 0, 2, vt);
    ref_reduce(3, (const int64_t[]){4, 3, 2}, vt, 2, false, want);
    fsdp_sum(tx, 1, (const int[]){1}, false, &y);
    check_vals(y, FSDP_DTYPE_F64, 2, (const int64_t[]){4, 2}, want, 1e-14, 1e-14,
               "sum over dim 1 of a transposed (4,3,2)");
    fsdp_tensor_t *l1[] = {x, tx, y};
    release_all(3, l1);

    /* Scalars reduce to themselves. */
    x = mk(FSDP_DTYPE_F64, 0, NULL, (const double[]){2.5});
    fsdp_sum(x, 0, NULL, false, &y);
    check_vals(y, FSDP_DTYPE_F64, 0, NULL, (const double[]){2.5}, 0, 0, "sum of a scalar");
    fsdp_tensor_release(y);
    fsdp_mean(x, 0, NULL, true, &y);
    check_vals(y, FSDP_DTYPE_F64, 0, NULL, (const double[]){2.5}, 0, 0, "mean of a scalar");
    fsdp_tensor_t *l2[] = {x, y};
    release_all(2, l2);

    /* f32, f16 and bf16: f32 accumulation, one rounding. */
    x = mk_rand(FSDP_DTYPE_F32, 3, s234, -2, 2, 122, v);
    ref_reduce(3, s234, v, 2, false, want);
    fsdp_sum(x, 1, (const int[]){1}, false, &y);
    check_vals(y, FSDP_DTYPE_F32, 2, (const int64_t[]){2, 4}, want, 1e-6, 1e-6,
               "f32 sum over dim 1");
    fsdp_tensor_t *l3[] = {x, y};
    release_all(2, l3);
    x = mk_rand(FSDP_DTYPE_F16, 3, s234, -2, 2, 123, v);
    ref_reduce(3, s234, v, 4, false, want);
    for (int i = 0; i < 6; i++)
        want[i] = rnd(FSDP_DTYPE_F16, (float)want[i]);
    fsdp_sum(x, 1, (const int[]){2}, false, &y);
    check_vals(y, FSDP_DTYPE_F16, 2, (const int64_t[]){2, 3}, want, 1.0 / 1024, 1e-3,
               "f16 sum over dim 2 is the rounded f32 sum");
    fsdp_tensor_t *l4[] = {x, y};
    release_all(2, l4);
    x = mk_rand(FSDP_DTYPE_BF16, 3, s234, -2, 2, 124, v);
    ref_reduce(3, s234, v, 7, true, want);
    want[0] = rnd(FSDP_DTYPE_BF16, (float)want[0]);
    fsdp_mean(x, 0, NULL, false, &y);
    check_vals(y, FSDP_DTYPE_BF16, 0, NULL, want, 1.0 / 128, 1e-3, "bf16 mean of everything");
    fsdp_tensor_t *l5[] = {x, y};
    release_all(2, l5);

    /* Empty dimensions: a sum over nothing is 0, a mean over nothing NaN, no rows no output. */
    x = mk(FSDP_DTYPE_F32, 3, (const int64_t[]){2, 0, 3}, v);
    double zeros[6] = {0}, nans[1] = {NAN};
    fsdp_sum(x, 1, (const int[]){1}, false, &y);
    check_vals(y, FSDP_DTYPE_F32, 2, (const int64_t[]){2, 3}, zeros, 0, 0,
               "sum over an empty dim gives zeros");
    fsdp_tensor_release(y);
    fsdp_mean(x, 0, NULL, false, &y);
    check_vals(y, FSDP_DTYPE_F32, 0, NULL, nans, 0, 0, "mean of an empty tensor is NaN");
    fsdp_tensor_release(y);
    fsdp_sum(x, 1, (const int[]){0}, false, &y);
    check_vals(y, FSDP_DTYPE_F32, 2, (const int64_t[]){0, 3}, zeros, 0, 0,
               "sum of a (2,0,3) over dim 0 is (0,3)");
    fsdp_tensor_t *l6[] = {x, y};
    release_all(2, l6);
}

/* ---- cat and split -----------------------------------------------------------------------------
 */

static void test_cat_split(void) {
    double av[24], bv[24], cv[24], want[64];
    fsdp_tensor_t *y = NULL;
    /* Along dim 1 of 2-d: rows interleave (the path through a transposed buffer). */
    fsdp_tensor_t *a = mk_rand(FSDP_DTYPE_F32, 2, (const int64_t[]){2, 3}, -1, 1, 130, av);
    fsdp_tensor_t *b = mk_rand(FSDP_DTYPE_F32, 2, (const int64_t[]){2, 1}, -1, 1, 131, bv);
    fsdp_tensor_t *c = mk_rand(FSDP_DTYPE_F32, 2, (const int64_t[]){2, 2}, -1, 1, 132, cv);
    for (int r = 0; r < 2; r++) {
        for (int j = 0; j < 3; j++)
            want[r * 6 + j] = av[r * 3 + j];
        want[r * 6 + 3] = bv[r];
        for (int j = 0; j < 2; j++)
            want[r * 6 + 4 + j] = cv[r * 2 + j];
    }
    fsdp_cat((fsdp_tensor_t *[]){a, b, c}, 3, 1, &y);
    check_vals(y, FSDP_DTYPE_F32, 2, (const int64_t[]){2, 6}, want, 0, 0,
               "cat of (2,3), (2,1), (2,2) along dim 1");
    fsdp_tensor_release(y);
    fsdp_cat((fsdp_tensor_t *[]){a, b, c}, 3, -1, &y);
    check_vals(y, FSDP_DTYPE_F32, 2, (const int64_t[]){2, 6}, want, 0, 0,
               "cat along dim -1 is the same");
    fsdp_tensor_release(y);

    /* Split it back. */
    fsdp_tensor_t *whole = mk(FSDP_DTYPE_F32, 2, (const int64_t[]){2, 6}, want), *p[3] = {0};
    int rc = fsdp_split(whole, (const int64_t[]){3, 1, 2}, 3, 1, p);
    tap_is_int(rc, FSDP_OK, "split of (2,6) into 3 + 1 + 2 along dim 1");
    check_vals(p[0], FSDP_DTYPE_F32, 2, (const int64_t[]){2, 3}, av, 0, 0, "split piece 0");
    check_vals(p[1], FSDP_DTYPE_F32, 2, (const int64_t[]){2, 1}, bv, 0, 0, "split piece 1");
    check_vals(p[2], FSDP_DTYPE_F32, 2, (const int64_t[]){2, 2}, cv, 0, 0, "split piece 2");
    release_all(3, p);
    fsdp_tensor_t *l1[] = {a, b, c, whole};
    release_all(4, l1);

    /* Along dim 0: blocks one after the other (the direct path). */
    a = mk_rand(FSDP_DTYPE_F64, 2, (const int64_t[]){2, 3}, -1, 1, 133, av);
    b = mk_rand(FSDP_DTYPE_F64, 2, (const int64_t[]){1, 3}, -1, 1, 134, bv);
    memcpy(want, av, 6 * sizeof *want);
    memcpy(want + 6, bv, 3 * sizeof *want);
    fsdp_cat((fsdp_tensor_t *[]){a, b}, 2, 0, &y);
    check_vals(y, FSDP_DTYPE_F64, 2, (const int64_t[]){3, 3}, want, 0, 0,
               "cat of (2,3) and (1,3) along dim 0");
    rc = fsdp_split(y, (const int64_t[]){0, 1, 2}, 3, 0, p);
    tap_ok(rc == 0 && fsdp_tensor_size(p[0], 0) == 0, "split allows an empty piece");
    check_vals(p[1], FSDP_DTYPE_F64, 2, (const int64_t[]){1, 3}, av, 0, 0,
               "split along dim 0: piece 1");
    check_vals(p[2], FSDP_DTYPE_F64, 2, (const int64_t[]){2, 3}, want + 3, 0, 0,
               "split along dim 0: piece 2");
    release_all(3, p);
    fsdp_tensor_t *l2[] = {a, b, y};
    release_all(3, l2);

    /* 3-d along the middle dim with a transposed input: (2,1,4) and (4,2,2)^T(0,2) = (2,2,4). */
    a = mk_rand(FSDP_DTYPE_F32, 3, (const int64_t[]){2, 1, 4}, -1, 1, 135, av);
    b = mk_rand(FSDP_DTYPE_F32, 3, (const int64_t[]){4, 2, 2}, -1, 1, 136, bv);
    fsdp_tensor_t *tb = transposed(b, 0, 2);
    transpose_vals(3, (const int64_t[]){4, 2, 2}, bv, 0, 2, cv);
    for (int i = 0; i < 2; i++) {
        for (int k = 0; k < 4; k++)
            want[i * 12 + k] = av[i * 4 + k];
        for (int j = 0; j < 2; j++)
            for (int k = 0; k < 4; k++)
                want[i * 12 + 4 + j * 4 + k] = cv[i * 8 + j * 4 + k];
    }
    fsdp_cat((fsdp_tensor_t *[]){a, tb}, 2, 1, &y);
    check_vals(y, FSDP_DTYPE_F32, 3, (const int64_t[]){2, 3, 4}, want, 0, 0,
               "cat along the middle dim with a transposed input");
    /* Split a transposed view: (2,3,4)^T(1,2) = (2,4,3) into 1 + 3 along dim 1. */
    fsdp_tensor_t *ty = transposed(y, 1, 2);
    transpose_vals(3, (const int64_t[]){2, 3, 4}, want, 1, 2, cv);
    rc = fsdp_split(ty, (const int64_t[]){1, 3}, 2, 1, p);
    for (int i = 0; i < 2; i++)
        for (int k = 0; k < 3; k++)
            bv[i * 3 + k] = cv[i * 12 + k];
    check_vals(p[0], FSDP_DTYPE_F32, 3, (const int64_t[]){2, 1, 3}, bv, 0, 0,
               "split of a transposed view: piece 0");
    for (int i = 0; i < 2; i++)
        for (int k = 0; k < 9; k++)
            bv[i * 9 + k] = cv[i * 12 + 3 + k];
    check_vals(p[1], FSDP_DTYPE_F32, 3, (const int64_t[]){2, 3, 3}, bv, 0, 0,
               "split of a transposed view: piece 1");
    release_all(2, p);
    fsdp_tensor_t *l3[] = {a, b, tb, y, ty};
    release_all(5, l3);

    /* Any dtype: cat of int64 and u8 tensors moves bits. */
    a = mk(FSDP_DTYPE_I64, 1, (const int64_t[]){2}, (const double[]){7, -3});
    b = mk(FSDP_DTYPE_I64, 1, (const int64_t[]){3}, (const double[]){1, 2, 1e15});
    fsdp_cat((fsdp_tensor_t *[]){a, b}, 2, 0, &y);
    check_vals(y, FSDP_DTYPE_I64, 1, (const int64_t[]){5}, (const double[]){7, -3, 1, 2, 1e15}, 0,
               0, "cat of i64 tensors");
    fsdp_tensor_t *l4[] = {a, b, y};
    release_all(3, l4);
    a = mk_rand(FSDP_DTYPE_BF16, 2, (const int64_t[]){2, 2}, -1, 1, 137, av);
    fsdp_cat((fsdp_tensor_t *[]){a}, 1, 1, &y);
    check_vals(y, FSDP_DTYPE_BF16, 2, (const int64_t[]){2, 2}, av, 0, 0,
               "cat of one bf16 tensor is a copy");
    tap_ok(y && !fsdp_tensor_same_storage(a, y), "cat of one tensor has its own storage");
    fsdp_tensor_t *l5[] = {a, y};
    release_all(2, l5);
}

/* ---- errors -------------------------------------------------------------------------------------
 */

/* Stands in *out before a call that must fail, so that the test sees it set to NULL. */
static char sentinel_byte;
#define SENTINEL ((fsdp_tensor_t *)(void *)&sentinel_byte)

static void expect_err(int rc, fsdp_tensor_t **out, const char *needle, const char *what) {
    tap_ok(rc == FSDP_EINVAL && *out == NULL, "%s: FSDP_EINVAL and *out NULL (rc %d)", what, rc);
    if (needle)
        tap_has_str(fsdp_ctx_last_error(ops_ctx), needle, "%s: the message says \"%s\"", what,
                    needle);
    /* An unexpected success must not leak into the memory check at the end. */
    if (*out != SENTINEL) fsdp_tensor_release(*out);
    *out = SENTINEL;
}

static void test_errors(void) {
    fsdp_tensor_t *a = mk_rand(FSDP_DTYPE_F32, 2, (const int64_t[]){2, 3}, -1, 1, 320, NULL);
    fsdp_tensor_t *b = mk_rand(FSDP_DTYPE_F32, 1, (const int64_t[]){4}, -1, 1, 321, NULL);
    fsdp_tensor_t *d = mk_rand(FSDP_DTYPE_F64, 2, (const int64_t[]){2, 3}, -1, 1, 322, NULL);
    fsdp_tensor_t *i32 = mk(FSDP_DTYPE_I32, 1, (const int64_t[]){2}, (const double[]){1, 2});
    fsdp_tensor_t *u8 = mk(FSDP_DTYPE_U8, 1, (const int64_t[]){2}, (const double[]){1, 0});
    fsdp_tensor_t *y = SENTINEL, *p[2];
    int rc;

    fsdp_tensor_set_requires_grad(a, true);
    fsdp_tape_clear(ops_ctx);
    rc = fsdp_add(a, b, &y);
    expect_err(rc, &y, "[2, 3]", "add (2,3) + (4)");
    tap_has_str(fsdp_ctx_last_error(ops_ctx), "[4]",
                "add (2,3) + (4): the message has both shapes");
    tap_has_str(fsdp_ctx_last_error(ops_ctx), "fsdp_add", "add (2,3) + (4): the message names add");
    tap_is_size(fsdp_tape_size(ops_ctx), 0, "a failed operation records nothing");
    rc = fsdp_mul(NULL, b, &y);
    expect_err(rc, &y, "'a'", "mul with a NULL");
    rc = fsdp_sub(a, NULL, &y);
    expect_err(rc, &y, "'b'", "sub with b NULL");
    tap_is_int(fsdp_div(a, a, NULL), FSDP_EINVAL, "div with out NULL: FSDP_EINVAL");
    rc = fsdp_add(a, d, &y);
    expect_err(rc, &y, "f64", "add of f32 and f64");
    rc = fsdp_relu(i32, &y);
    expect_err(rc, &y, "float", "relu of an i32 tensor");
    rc = fsdp_sum(i32, 0, NULL, false, &y);
    expect_err(rc, &y, "float", "sum of an i32 tensor");
    rc = fsdp_exp(NULL, &y);
    expect_err(rc, &y, NULL, "exp of NULL");
    rc = fsdp_gelu(a, (fsdp_gelu_approx_t)7, &y);
    expect_err(rc, &y, "approx", "gelu with an unknown approximation");

    rc = fsdp_sum(a, 1, (const int[]){2}, false, &y);
    expect_err(rc, &y, "dim 2", "sum over dim 2 of a 2-d tensor");
    rc = fsdp_mean(a, 2, (const int[]){1, -1}, false, &y);
    expect_err(rc, &y, "twice", "mean over dims {1, -1} (the same dim)");
    rc = fsdp_sum(a, 1, NULL, false, &y);
    expect_err(rc, &y, "NULL", "sum with dims NULL");

    rc = fsdp_cat((fsdp_tensor_t *[]){a, d}, 2, 0, &y);
    expect_err(rc, &y, "ts[1]", "cat of f32 and f64");
    fsdp_tensor_t *e = mk_rand(FSDP_DTYPE_F32, 2, (const int64_t[]){3, 2}, -1, 1, 323, NULL);
    rc = fsdp_cat((fsdp_tensor_t *[]){a, e}, 2, 0, &y);
    expect_err(rc, &y, "[3, 2]", "cat of (2,3) and (3,2) along dim 0");
    rc = fsdp_cat((fsdp_tensor_t *[]){a}, 0, 0, &y);
    expect_err(rc, &y, NULL, "cat of no tensors");
    rc = fsdp_cat((fsdp_tensor_t *[]){a, NULL}, 2, 0, &y);
    expect_err(rc, &y, "ts[1]", "cat with a NULL tensor");
    rc = fsdp_cat((fsdp_tensor_t *[]){a, e}, 2, 2, &y);
    expect_err(rc, &y, "dim 2", "cat along dim 2 of 2-d tensors");
    p[0] = p[1] = SENTINEL;
    rc = fsdp_split(a, (const int64_t[]){1, 1}, 2, 1, p);
    tap_ok(rc == FSDP_EINVAL && !p[0] && !p[1], "split sizes 1 + 1 of a dim of 3: FSDP_EINVAL, "
                                                "outputs NULL");
    tap_has_str(fsdp_ctx_last_error(ops_ctx), "add up to 2", "split: the message gives the sum");
    rc = fsdp_split(a, (const int64_t[]){4, -1}, 2, 1, p);
    tap_ok(rc == FSDP_EINVAL && !p[0] && !p[1], "split with a negative size: FSDP_EINVAL");

    rc = fsdp_where(a, a, a, &y);
    expect_err(rc, &y, "u8 or bool", "where with an f32 cond");
    rc = fsdp_where(u8, a, a, &y);
    expect_err(rc, &y, "does not broadcast", "where with a (2) cond over (2,3)");
    fsdp_tensor_t *c1 = mk(FSDP_DTYPE_U8, 1, (const int64_t[]){1}, (const double[]){1});
    rc = fsdp_where(c1, a, e, &y);
    expect_err(rc, &y, "same shape", "where with a and b of different shapes");
    rc = fsdp_masked_fill(a, u8, 0.0, &y);
    expect_err(rc, &y, "u8[2]", "masked_fill with a (2) mask over (2,3)");
    rc = fsdp_masked_fill(a, NULL, 0.0, &y);
    expect_err(rc, &y, "'mask'", "masked_fill with mask NULL");
    rc = fsdp_causal_mask(ops_ctx, -1, &y);
    expect_err(rc, &y, "-1", "causal_mask of length -1");
    rc = fsdp_to_dtype(a, (fsdp_dtype_t)99, &y);
    expect_err(rc, &y, "99", "to_dtype to dtype 99");
    rc = fsdp_mse_loss(a, e, FSDP_REDUCTION_MEAN, &y);
    expect_err(rc, &y, "[3, 2]", "mse_loss of (2,3) and (3,2)");
    rc = fsdp_mse_loss(a, a, (fsdp_reduction_t)9, &y);
    expect_err(rc, &y, "reduction", "mse_loss with reduction 9");
    tap_is_size(fsdp_tape_size(ops_ctx), 0, "none of the failed operations recorded anything");

    fsdp_tensor_t *all[] = {a, b, d, i32, u8, e, c1};
    release_all(7, all);
}

/* ---- main
 * ---------------------------------------------------------------------------------------- */

int main(void) {
    ops_begin();
    test_binary_forward();
    test_binary_half();
    test_unary_forward();
    test_where_mask();
    test_to_dtype();
    test_mse();
    test_reduce();
    test_cat_split();
    test_errors();
    return ops_end();
}
