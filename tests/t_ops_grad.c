/* SPDX-License-Identifier: MIT */
/*
 * t_ops_grad.c: gradients of the element-wise operations, reductions, cat and split; gradient
 * accumulation and grad mode.
 *
 * Every differentiable operation of t_ops.c is gradient-checked in f64 against central
 * differences (gradcheck.c), on the same operation tables and broadcasting patterns
 * (ops_util.c), plus transposed views and inputs used twice in one graph. Then come gradient
 * accumulation over backwards (f64 and a bf16 leaf), grad mode, element-wise backwards that
 * overwrite a gradient nobody else holds, and a check that every byte allocated by the tests
 * has been given back.
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include <fsdp.h>

#include "gradcheck.h"
#include "ops_util.h"
#include "tap.h"

/* ---- helpers ------------------------------------------------------------------------------ */

static int gc_tol(const char *name, gc_fn fn, void *arg, int nin, fsdp_tensor_t *const *in,
                  const bool *wrt, double h, double rtol, double atol) {
    return gc_check(ops_ctx, name, fn, arg, nin, in, wrt, h, rtol, atol);
}

static int gc(const char *name, gc_fn fn, void *arg, int nin, fsdp_tensor_t *const *in,
              const bool *wrt) {
    return gc_tol(name, fn, arg, nin, in, wrt, 1e-6, 1e-5, 1e-7);
}

static fsdp_tensor_t *rnd64(int nd, const int64_t *shape, double lo, double hi, unsigned seed) {
    return gc_rand(ops_ctx, nd, shape, lo, hi, seed);
}

/* ---- gradient checks ---------------------------------------------------------------------------
 */

static int gfn_bin(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    (void)nin;
    return ((const struct binop *)arg)->fn(in[0], in[1], out);
}

static int gfn_un(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    (void)nin;
    return ((const struct unop *)arg)->fn(in[0], out);
}

static int gfn_where(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    (void)arg;
    (void)nin;
    return fsdp_where(in[0], in[1], in[2], out);
}

static int gfn_masked_fill(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    (void)arg;
    (void)nin;
    return fsdp_masked_fill(in[0], in[1], -7.0, out);
}

/* x -> to_dtype(x, *arg) -> back to f64 (f64 itself: one same-dtype conversion). */
static int gfn_to_dtype(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    (void)nin;
    fsdp_dtype_t dt = *(const fsdp_dtype_t *)arg;
    fsdp_tensor_t *t = NULL;
    int rc = fsdp_to_dtype(in[0], dt, &t);
    if (rc < 0) return rc;
    rc = fsdp_to_dtype(t, FSDP_DTYPE_F64, out);
    fsdp_tensor_release(t);
    return rc;
}

static int gfn_mse(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    (void)nin;
    return fsdp_mse_loss(in[0], in[1], *(const fsdp_reduction_t *)arg, out);
}

static int gfn_reduce(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    (void)nin;
    const struct red_case *c = arg;
    return (c->mean ? fsdp_mean : fsdp_sum)(in[0], c->ndims, c->dims, c->keepdim, out);
}

static int gfn_cat(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    return fsdp_cat(in, nin, *(const int *)arg, out);
}

/* Split (2,6) into 2 + 1 + 3 along dim 1 and return cat(piece 2, piece 0): piece 1 gets no
 * gradient, so zeros stand in for it. */
static int gfn_split_cat(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    (void)arg;
    (void)nin;
    fsdp_tensor_t *p[3] = {0};
    int rc = fsdp_split(in[0], (const int64_t[]){2, 1, 3}, 3, 1, p);
    if (rc == 0) rc = fsdp_cat((fsdp_tensor_t *[]){p[2], p[0]}, 2, 1, out);
    release_all(3, p);
    return rc;
}

/* Split (4,3) into 2 + 2 along dim 0 and multiply the halves. */
static int gfn_split_mul(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    (void)arg;
    (void)nin;
    fsdp_tensor_t *p[2] = {0};
    int rc = fsdp_split(in[0], (const int64_t[]){2, 2}, 2, 0, p);
    if (rc == 0) rc = fsdp_mul(p[0], p[1], out);
    release_all(2, p);
    return rc;
}

/* Operations on a transposed view of the first input. */
static int gfn_transposed(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    int which = *(const int *)arg;
    fsdp_tensor_t *t = NULL;
    int rc = fsdp_transpose(in[0], 0, 1, &t);
    if (rc < 0) return rc;
    if (which == 0)
        rc = fsdp_exp(t, out);
    else if (which == 1)
        rc = fsdp_add(t, in[1], out);
    else if (which == 2)
        rc = fsdp_sum(t, 1, (const int[]){0}, false, out);
    else
        rc = fsdp_mul(t, in[nin - 1], out);
    fsdp_tensor_release(t);
    return rc;
}

/* x used twice in one graph: tanh(x) * x, and x + x. */
static int gfn_reuse(void *arg, int nin, fsdp_tensor_t *const *in, fsdp_tensor_t **out) {
    (void)nin;
    if (*(const int *)arg == 1) return fsdp_add(in[0], in[0], out);
    fsdp_tensor_t *t = NULL;
    int rc = fsdp_tanh(in[0], &t);
    if (rc == 0) rc = fsdp_mul(t, in[0], out);
    fsdp_tensor_release(t);
    return rc;
}

static void test_grad_binary(void) {
    char name[128];
    for (int o = 0; o < 4; o++) {
        const struct binop *op = &binops[o];
        for (int p = 0; p < 4; p++) {
            const struct pattern *pt = &patterns[p];
            fsdp_tensor_t *in[2] = {rnd64(pt->an, pt->as, -2, 2, 200 + p),
                                    rnd64(pt->bn, pt->bs, 0.5, 2, 210 + p)};
            snprintf(name, sizeof name, "%s %s (broadcast gradients summed back)", op->name,
                     pt->what);
            gc(name, gfn_bin, (void *)op, 2, in, NULL);
            release_all(2, in);
        }
    }
    /* The broadcast operand first: (3) op (2,3). */
    for (int o = 0; o < 4; o++) {
        fsdp_tensor_t *in[2] = {rnd64(1, (const int64_t[]){3}, 0.5, 2, 220),
                                rnd64(2, (const int64_t[]){2, 3}, 0.5, 2, 221)};
        snprintf(name, sizeof name, "%s (3) with (2,3)", binops[o].name);
        gc(name, gfn_bin, (void *)&binops[o], 2, in, NULL);
        release_all(2, in);
    }
}

static void test_grad_unary(void) {
    char name[128];
    for (int u = 0; u < 9; u++) {
        fsdp_tensor_t *in[1] = {
            rnd64(2, (const int64_t[]){3, 4}, unops[u].lo, unops[u].hi, 230 + u)};
        snprintf(name, sizeof name, "%s of (3,4)", unops[u].name);
        gc(name, gfn_un, (void *)&unops[u], 1, in, NULL);
        release_all(1, in);
    }
}

static void test_grad_misc(void) {
    const int64_t s34[2] = {3, 4};
    /* where: the gradient goes to a where cond is set, to b elsewhere. */
    fsdp_tensor_t *w[3] = {mk(FSDP_DTYPE_U8, 2, (const int64_t[]){3, 1}, (const double[]){0, 1, 1}),
                           rnd64(2, s34, -1, 1, 240), rnd64(2, s34, -1, 1, 241)};
    gc("where (cond (3,1)): gradient to a where set, to b elsewhere", gfn_where, NULL, 3, w, NULL);
    release_all(3, w);
    /* masked_fill: no gradient where the mask is set. */
    fsdp_tensor_t *m[2] = {
        rnd64(3, (const int64_t[]){2, 3, 4}, -1, 1, 242),
        mk(FSDP_DTYPE_BOOL, 2, (const int64_t[]){3, 1}, (const double[]){1, 0, 1})};
    gc("masked_fill: zero gradient where masked", gfn_masked_fill, NULL, 2, m, NULL);
    release_all(2, m);
    /* to_dtype: same dtype exactly; through f32 with a step large enough for f32 rounding. */
    fsdp_tensor_t *t[1] = {rnd64(2, s34, -2, 2, 243)};
    fsdp_dtype_t f64 = FSDP_DTYPE_F64, f32 = FSDP_DTYPE_F32;
    gc("to_dtype f64 -> f64 -> f64", gfn_to_dtype, &f64, 1, t, NULL);
    gc_tol("to_dtype f64 -> f32 -> f64 (gradient converted back)", gfn_to_dtype, &f32, 1, t, NULL,
           1e-2, 1e-4, 1e-4);
    release_all(1, t);
    /* mse_loss, each reduction. */
    const fsdp_reduction_t reds[3] = {FSDP_REDUCTION_MEAN, FSDP_REDUCTION_SUM, FSDP_REDUCTION_NONE};
    const char *rn[3] = {"mean", "sum", "none"};
    for (int r = 0; r < 3; r++) {
        fsdp_tensor_t *in[2] = {rnd64(2, (const int64_t[]){2, 3}, -2, 2, 250 + r),
                                rnd64(2, (const int64_t[]){2, 3}, -2, 2, 260 + r)};
        char name[64];
        snprintf(name, sizeof name, "mse_loss (%s)", rn[r]);
        gc(name, gfn_mse, (void *)&reds[r], 2, in, NULL);
        release_all(2, in);
    }
}

static void test_grad_reduce(void) {
    const struct red_case cases[] = {
        {false, 1, {1}, false, 0, {0}, 0, "sum over dim 1"},
        {false, 2, {0, 2}, true, 0, {0}, 0, "sum over dims {0, 2} keepdim"},
        {false, 0, {0}, false, 0, {0}, 0, "sum over everything"},
        {true, 1, {-1}, false, 0, {0}, 0, "mean over dim -1"},
        {true, 0, {0}, true, 0, {0}, 0, "mean over everything keepdim"},
        {true, 2, {1, 0}, false, 0, {0}, 0, "mean over dims {1, 0}"},
    };
    char name[96];
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        fsdp_tensor_t *in[1] = {rnd64(3, (const int64_t[]){2, 3, 4}, -2, 2, 270 + (unsigned)k)};
        snprintf(name, sizeof name, "%s of (2,3,4)", cases[k].what);
        gc(name, gfn_reduce, (void *)&cases[k], 1, in, NULL);
        release_all(1, in);
    }
    fsdp_tensor_t *s[1] = {rnd64(0, NULL, -2, 2, 279)};
    gc("sum of a scalar", gfn_reduce, (void *)&cases[2], 1, s, NULL);
    release_all(1, s);
}

static void test_grad_cat_split(void) {
    int d1 = 1, d0 = 0;
    fsdp_tensor_t *c[3] = {rnd64(2, (const int64_t[]){2, 3}, -1, 1, 280),
                           rnd64(2, (const int64_t[]){2, 1}, -1, 1, 281),
                           rnd64(2, (const int64_t[]){2, 2}, -1, 1, 282)};
    gc("cat along dim 1: each input gets its columns", gfn_cat, &d1, 3, c, NULL);
    release_all(3, c);
    fsdp_tensor_t *r[2] = {rnd64(3, (const int64_t[]){1, 2, 2}, -1, 1, 283),
                           rnd64(3, (const int64_t[]){2, 2, 2}, -1, 1, 284)};
    gc("cat along dim 0 of 3-d", gfn_cat, &d0, 2, r, NULL);
    /* Only the second input asks for a gradient. */
    gc("cat with one input not requiring grad", gfn_cat, &d0, 2, r, (const bool[]){false, true});
    release_all(2, r);
    /* More inputs than a node keeps shapes for (8): the sizes travel with the node. */
    fsdp_tensor_t *many[10];
    bool wrt10[10] = {false};
    for (int i = 0; i < 10; i++)
        many[i] = rnd64(2, (const int64_t[]){1 + i % 2, 2}, -1, 1, 290 + (unsigned)i);
    wrt10[0] = wrt10[8] = wrt10[9] = true;
    gc("cat of 10 inputs, gradients to inputs 0, 8 and 9", gfn_cat, &d0, 10, many, wrt10);
    release_all(10, many);
    fsdp_tensor_t *s[1] = {rnd64(2, (const int64_t[]){2, 6}, -1, 1, 285)};
    gc("split with an unused piece (zeros stand in)", gfn_split_cat, NULL, 1, s, NULL);
    release_all(1, s);
    fsdp_tensor_t *q[1] = {rnd64(2, (const int64_t[]){4, 3}, -1, 1, 286)};
    gc("split along dim 0, halves multiplied", gfn_split_mul, NULL, 1, q, NULL);
    release_all(1, q);
}

static void test_grad_views_and_reuse(void) {
    int k0 = 0, k1 = 1, k2 = 2, k3 = 3;
    fsdp_tensor_t *x[2] = {rnd64(2, (const int64_t[]){4, 3}, -1, 1, 290),
                           rnd64(2, (const int64_t[]){3, 4}, -1, 1, 291)};
    gc("exp of a transposed view", gfn_transposed, &k0, 1, x, NULL);
    gc("add of a transposed view and a contiguous tensor", gfn_transposed, &k1, 2, x, NULL);
    gc("sum over dim 0 of a transposed view", gfn_transposed, &k2, 1, x, NULL);
    release_all(2, x);
    fsdp_tensor_t *y[2] = {rnd64(2, (const int64_t[]){4, 3}, -1, 1, 292),
                           rnd64(1, (const int64_t[]){4}, -1, 1, 293)};
    gc("mul of a transposed view by a broadcast row", gfn_transposed, &k3, 2, y, NULL);
    release_all(2, y);
    fsdp_tensor_t *z[1] = {rnd64(2, (const int64_t[]){2, 3}, -1, 1, 294)};
    int r0 = 0, r1 = 1;
    gc("tanh(x) * x: both uses of x accumulate", gfn_reuse, &r0, 1, z, NULL);
    gc("x + x: both operands are the same tensor", gfn_reuse, &r1, 1, z, NULL);
    release_all(1, z);
}

/* ---- accumulation and grad mode ------------------------------------------------------------ */

/* Backward of reduce(op(x, x)), reduce being a full mean or sum; returns backward's status. */
static int self_backward(fsdp_tensor_t *x, binop_fn op, bool mean) {
    fsdp_tensor_t *y = NULL, *l = NULL;
    op(x, x, &y);
    (mean ? fsdp_mean : fsdp_sum)(y, 0, NULL, false, &l);
    int rc = fsdp_backward(l, NULL);
    fsdp_tensor_release(y);
    fsdp_tensor_release(l);
    return rc;
}

static void test_accumulation(void) {
    const int64_t s23[2] = {2, 3};
    double v[6], want[6];
    fsdp_tensor_t *x = mk_rand(FSDP_DTYPE_F64, 2, s23, -1, 1, 300, v);
    fsdp_tensor_set_requires_grad(x, true);
    tap_is_int(self_backward(x, fsdp_add, false), FSDP_OK, "backward of sum(x + x)");
    for (int i = 0; i < 6; i++)
        want[i] = 2;
    check_vals(fsdp_tensor_grad(x), FSDP_DTYPE_F64, 2, s23, want, 0, 0,
               "x used twice in add: gradient 2");
    self_backward(x, fsdp_add, false);
    for (int i = 0; i < 6; i++)
        want[i] = 4;
    check_vals(fsdp_tensor_grad(x), FSDP_DTYPE_F64, 2, s23, want, 0, 0,
               "a second backward accumulates into the gradient: 4");
    fsdp_tensor_zero_grad(x, true);
    self_backward(x, fsdp_mul, true);
    for (int i = 0; i < 6; i++)
        want[i] = 2 * v[i] / 6;
    check_vals(fsdp_tensor_grad(x), FSDP_DTYPE_F64, 2, s23, want, 1e-15, 1e-15,
               "mean(x * x): gradient 2x / n");
    fsdp_tensor_release(x);

    /* A bf16 leaf: the gradient is computed in f32 and lands as bf16. */
    x = mk_rand(FSDP_DTYPE_BF16, 2, s23, -1, 1, 301, v);
    fsdp_tensor_set_requires_grad(x, true);
    self_backward(x, fsdp_mul, false);
    for (int i = 0; i < 6; i++)
        want[i] = rnd(FSDP_DTYPE_BF16, 2 * v[i]);
    check_vals(fsdp_tensor_grad(x), FSDP_DTYPE_BF16, 2, s23, want, 0, 0,
               "bf16 leaf: gradient of sum(x * x) is 2x in bf16");
    fsdp_tensor_release(x);
}

static void test_grad_mode(void) {
    const int64_t s23[2] = {2, 3};
    fsdp_tensor_t *x = mk_rand(FSDP_DTYPE_F32, 2, s23, -1, 1, 310, NULL), *y = NULL;
    fsdp_tensor_set_requires_grad(x, true);
    fsdp_tape_clear(ops_ctx);
    bool was = fsdp_set_grad_enabled(ops_ctx, false);
    fsdp_mul(x, x, &y);
    tap_ok(y && !fsdp_tensor_requires_grad(y) && fsdp_tape_size(ops_ctx) == 0,
           "grad mode off: nothing recorded, output requires no gradient");
    fsdp_tensor_release(y);
    fsdp_set_grad_enabled(ops_ctx, was);
    fsdp_sigmoid(x, &y);
    tap_ok(y && fsdp_tensor_requires_grad(y) && !fsdp_tensor_is_leaf(y) &&
               fsdp_tape_size(ops_ctx) == 1,
           "grad mode on: one node recorded, output is a non-leaf requiring grad");
    fsdp_tensor_release(y);
    fsdp_tensor_t *z = mk_rand(FSDP_DTYPE_F32, 2, s23, -1, 1, 311, NULL);
    fsdp_add(z, z, &y);
    tap_ok(y && !fsdp_tensor_requires_grad(y) && fsdp_tape_size(ops_ctx) == 1,
           "inputs without grad: nothing recorded");
    fsdp_tensor_release(y);
    fsdp_tape_clear(ops_ctx);
    fsdp_tensor_release(x);
    fsdp_tensor_release(z);
}

/* An element-wise backward overwrites an incoming gradient that nobody else holds
 * (fsdp__grad_reusable), and only such a one: through sigmoid(tanh(sigmoid(x))) with a
 * grad_output the caller keeps, the caller's tensor is left as it was, the gradient is the
 * chain rule's, and the two inner nodes allocate nothing. */
static void test_grad_in_place(void) {
    const int64_t s[2] = {4, 5};
    double v[20], gv[20], want[20];
    fsdp_tensor_t *x = mk_rand(FSDP_DTYPE_F64, 2, s, -2, 2, 320, v);
    fsdp_tensor_t *gy = mk_rand(FSDP_DTYPE_F64, 2, s, -1, 1, 321, gv);
    fsdp_tensor_t *a = NULL, *b = NULL, *c = NULL;
    fsdp_tensor_set_requires_grad(x, true);
    fsdp_sigmoid(x, &a);
    fsdp_tanh(a, &b);
    fsdp_sigmoid(b, &c);
    fsdp_mem_stats_t m0, m1;
    fsdp_mem_get_stats(ops_ctx, &m0);
    tap_is_int(c ? fsdp_backward(c, gy) : FSDP_EINVAL, FSDP_OK, "backward of a chain of three");
    fsdp_mem_get_stats(ops_ctx, &m1);
    for (int i = 0; i < 20; i++) {
        double sa = 1 / (1 + exp(-v[i])), tb = tanh(sa), sc = 1 / (1 + exp(-tb));
        want[i] = gv[i] * sc * (1 - sc) * (1 - tb * tb) * sa * (1 - sa);
    }
    check_vals(fsdp_tensor_grad(x), FSDP_DTYPE_F64, 2, s, want, 1e-14, 1e-15,
               "the gradient through the chain is the chain rule's");
    check_vals(gy, FSDP_DTYPE_F64, 2, s, gv, 0, 0, "the caller's grad_output is unchanged");
    tap_ok(m1.allocs - m0.allocs <= 2,
           "backward allocated %zu tensors: the first node's gradient (the caller holds its "
           "input) and at most the leaf's",
           m1.allocs - m0.allocs);
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    fsdp_tensor_release(c);
    fsdp_tensor_release(gy);
    fsdp_tensor_release(x);
    fsdp_tape_clear(ops_ctx);
}

int main(void) {
    ops_begin();
    test_grad_binary();
    test_grad_unary();
    test_grad_misc();
    test_grad_reduce();
    test_grad_cat_split();
    test_grad_views_and_reuse();
    test_accumulation();
    test_grad_mode();
    test_grad_in_place();
    return ops_end();
}
