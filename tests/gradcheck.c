/* SPDX-License-Identifier: MIT */
/*
 * gradcheck.c: finite-difference gradient checks (see gradcheck.h).
 *
 * The loss is sum(out * w) with w fixed pseudo-random weights, so every output element counts
 * with a different weight and a gradient that is right only in sum cannot pass. The analytical
 * side goes through the library (fsdp_mul, fsdp_sum, fsdp_backward); the numerical side
 * perturbs each input element in place on the host (CPU tensors only) with grad mode off and
 * evaluates the same loss in double on the host, so it shares no code with the backward.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gradcheck.h"
#include "tap.h"

/* splitmix64: a tiny generator with good output for any seed, independent of the library. */
static uint64_t gc_next(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

fsdp_tensor_t *gc_rand(fsdp_ctx_t *ctx, int ndim, const int64_t *shape, double lo, double hi,
                       unsigned seed) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= shape[i];
    double *v = malloc((size_t)(n > 0 ? n : 1) * sizeof *v);
    if (!v) return NULL;
    uint64_t s = (uint64_t)seed * 0x2545F4914F6CDD1Dull + 1;
    for (int64_t i = 0; i < n; i++)
        v[i] = lo + (hi - lo) * ((double)(gc_next(&s) >> 11) * (1.0 / 9007199254740992.0));
    fsdp_tensor_t *t = NULL;
    if (fsdp_tensor_from_host(ctx, FSDP_DTYPE_F64, ndim, shape, v, FSDP_MEM_OTHER, &t) < 0)
        t = NULL;
    free(v);
    return t;
}

/* sum_j out[j] * w[j] on the host, or NaN when fn fails. */
static double host_loss(gc_fn fn, void *arg, int nin, fsdp_tensor_t *const *in, const double *w,
                        int64_t nw) {
    fsdp_tensor_t *out = NULL;
    if (fn(arg, nin, in, &out) < 0 || !out) return NAN;
    double loss = 0;
    int64_t n = fsdp_tensor_numel(out);
    for (int64_t j = 0; j < n && j < nw; j++) {
        double v = NAN;
        fsdp_tensor_item(out, j, &v);
        loss += v * w[j];
    }
    if (n != nw) loss = NAN;
    fsdp_tensor_release(out);
    return loss;
}

/* The analytical gradients: backward of sum(out * w). Fills ana[i] (numel of in[i]) for every
 * checked input, and the host copy of w (its element count in *nw). */
static int analytical(fsdp_ctx_t *ctx, gc_fn fn, void *arg, int nin, fsdp_tensor_t *const *in,
                      const bool *chk, double **ana, double **w_host, int64_t *nw) {
    fsdp_tensor_t *out = NULL, *w = NULL, *wc = NULL, *prod = NULL, *loss = NULL;
    const char *stage = "the function";
    int rc = fn(arg, nin, in, &out);
    if (rc >= 0 && !out) rc = FSDP_EINVAL;
    if (rc < 0) goto done;
    stage = "making the weights";
    w = gc_rand(ctx, fsdp_tensor_ndim(out), fsdp_tensor_shape(out), -1.0, 1.0, 977);
    if (!w) {
        rc = FSDP_ENOMEM;
        goto done;
    }
    /* Weights in the output's dtype, so fsdp_mul accepts them (an f32 output in a round-trip). */
    if (fsdp_tensor_dtype(out) != FSDP_DTYPE_F64) {
        if ((rc = fsdp_to_dtype(w, fsdp_tensor_dtype(out), &wc)) < 0) goto done;
    } else {
        wc = fsdp_tensor_retain(w);
    }
    *nw = fsdp_tensor_numel(wc);
    *w_host = calloc((size_t)(*nw > 0 ? *nw : 1), sizeof **w_host);
    if (!*w_host) {
        rc = FSDP_ENOMEM;
        goto done;
    }
    for (int64_t j = 0; j < *nw; j++)
        if ((rc = fsdp_tensor_item(wc, j, &(*w_host)[j])) < 0) goto done;
    stage = "the loss sum(out * w)";
    if ((rc = fsdp_mul(out, wc, &prod)) < 0) goto done;
    if ((rc = fsdp_sum(prod, 0, NULL, false, &loss)) < 0) goto done;
    stage = "backward";
    if ((rc = fsdp_backward(loss, NULL)) < 0) goto done;
    stage = "reading the gradients";
    for (int i = 0; i < nin; i++) {
        if (!chk[i]) continue;
        fsdp_tensor_t *g = fsdp_tensor_grad(in[i]);
        int64_t n = fsdp_tensor_numel(in[i]);
        /* No gradient at all means zeros (the output does not depend on this input). */
        for (int64_t j = 0; j < n && g; j++)
            if ((rc = fsdp_tensor_item(g, j, &ana[i][j])) < 0) goto done;
    }
done:
    if (rc < 0)
        tap_diag("gradcheck: %s failed (%s): %s", stage, fsdp_err_name(rc),
                 fsdp_ctx_last_error(ctx));
    fsdp_tensor_release(loss);
    fsdp_tensor_release(prod);
    fsdp_tensor_release(wc);
    fsdp_tensor_release(w);
    fsdp_tensor_release(out);
    return rc;
}

int gc_check(fsdp_ctx_t *ctx, const char *name, gc_fn fn, void *arg, int nin,
             fsdp_tensor_t *const *in, const bool *wrt, double h, double rtol, double atol) {
    int failed = 0;
    bool *chk = calloc((size_t)(nin > 0 ? nin : 1), sizeof *chk);
    bool *had_rg = calloc((size_t)(nin > 0 ? nin : 1), sizeof *had_rg);
    fsdp_tensor_t **prev = calloc((size_t)(nin > 0 ? nin : 1), sizeof *prev);
    double **ana = calloc((size_t)(nin > 0 ? nin : 1), sizeof *ana);
    double *w = NULL;
    int64_t nw = 0;
    if (!chk || !had_rg || !prev || !ana) {
        tap_ok(0, "gradcheck %s: out of memory", name);
        failed = 1;
        goto done;
    }
    for (int i = 0; i < nin; i++) {
        bool want = wrt ? wrt[i] : in[i] && fsdp_dtype_is_float(fsdp_tensor_dtype(in[i]));
        if (!want) continue;
        if (!in[i] || fsdp_tensor_dtype(in[i]) != FSDP_DTYPE_F64 ||
            !fsdp_tensor_is_contiguous(in[i]) || !fsdp_tensor_is_leaf(in[i])) {
            tap_ok(0, "gradcheck %s: input %d is a contiguous f64 leaf", name, i);
            failed++;
            continue;
        }
        ana[i] = calloc((size_t)(fsdp_tensor_numel(in[i]) + 1), sizeof **ana);
        if (!ana[i]) {
            tap_ok(0, "gradcheck %s: out of memory for input %d", name, i);
            failed++;
            continue;
        }
        chk[i] = true;
        /* Start from no gradient, and give back the caller's afterwards. */
        had_rg[i] = fsdp_tensor_requires_grad(in[i]);
        prev[i] = fsdp_tensor_retain(fsdp_tensor_grad(in[i]));
        fsdp_tensor_set_grad(in[i], NULL);
        fsdp_tensor_set_requires_grad(in[i], true);
    }

    bool was = fsdp_set_grad_enabled(ctx, true);
    int rc = analytical(ctx, fn, arg, nin, in, chk, ana, &w, &nw);
    fsdp_set_grad_enabled(ctx, false);
    for (int i = 0; i < nin; i++) {
        if (!chk[i]) continue;
        if (rc < 0) {
            tap_ok(0, "gradcheck %s: d/d input %d (analytical gradient unavailable)", name, i);
            failed++;
            continue;
        }
        double *x = fsdp_tensor_data(in[i]);
        int64_t n = fsdp_tensor_numel(in[i]), worst = -1;
        double worst_excess = -INFINITY, worst_num = 0;
        for (int64_t j = 0; j < n; j++) {
            double orig = x[j];
            x[j] = orig + h;
            double lp = host_loss(fn, arg, nin, in, w, nw);
            x[j] = orig - h;
            double lm = host_loss(fn, arg, nin, in, w, nw);
            x[j] = orig;
            double num = (lp - lm) / (2 * h);
            double excess = fabs(ana[i][j] - num) - (atol + rtol * fabs(num));
            if (isnan(excess)) excess = INFINITY;
            if (excess > worst_excess) {
                worst_excess = excess;
                worst = j;
                worst_num = num;
            }
        }
        int pass = worst < 0 || worst_excess <= 0;
        tap_ok(pass, "gradcheck %s: d/d input %d", name, i);
        if (!pass)
            tap_diag("worst element %lld of %lld: analytical %.12g, numerical %.12g "
                     "(rtol %g, atol %g, h %g)",
                     (long long)worst, (long long)n, ana[i][worst], worst_num, rtol, atol, h);
        failed += !pass;
    }
    fsdp_set_grad_enabled(ctx, was);
    for (int i = 0; i < nin; i++) {
        if (!chk[i]) continue;
        fsdp_tensor_set_requires_grad(in[i], had_rg[i]);
        fsdp_tensor_set_grad(in[i], prev[i]);
        fsdp_tensor_release(prev[i]);
    }
done:
    if (ana)
        for (int i = 0; i < nin; i++)
            free(ana[i]);
    free(ana);
    free(w);
    free(prev);
    free(had_rg);
    free(chk);
    return failed;
}
