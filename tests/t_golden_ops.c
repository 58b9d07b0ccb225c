/* SPDX-License-Identifier: MIT */
/*
 * t_golden_ops.c: every differentiable tensor operation against PyTorch's golden vectors.
 *
 * tests/golden/ops.bin (written by tests/golden/gen.py) holds cases named "<op>/<variant>":
 * inputs, parameters under "p/", forward outputs ("out" or "out0", "out1", ...), upstream
 * gradients ("gout...") and the gradient of each differentiable input ("grad/<input>"). For each
 * case this program builds the inputs, marks those with a golden gradient as requiring one, makes
 * the same call through libfsdp, compares the output(s), runs fsdp_backward() with the golden
 * upstream gradient and compares each input's gradient. Inputs that PyTorch updated in place
 * (batch norm's running statistics) are compared with "<input>_out". Cases are discovered from
 * the file, so a case added to gen.py is tested once its op has a runner here (an op without one
 * fails).
 *
 * Tolerances: f32 |got - want| <= 1e-5 + 1.3e-6 |want| (the spec's fp32 tolerance); f64
 * 1e-12 + 1e-10 |want| (libm versus PyTorch's vectorized math, and summation order).
 *
 * The first tests check the reader itself on a built-in file and on damaged copies of ops.bin.
 */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/autograd.h>
#include <fsdp/context.h>
#include <fsdp/errno.h>
#include <fsdp/tensor.h>

#include "golden.h"
#include "tap.h"

#define MAX_IN 8
#define MAX_OUT 8

#define F32_RTOL 1.3e-6
#define F32_ATOL 1e-5
#define F64_RTOL 1e-10
#define F64_ATOL 1e-12

/* ---- case parameters -------------------------------------------------------------------- */

typedef struct run_args {
    fsdp_ctx_t *ctx;
    const golden_t *g;
    const char *cs;            /* the case's name, "<op>/<variant>" */
    fsdp_tensor_t *in[MAX_IN]; /* in the op's input order; NULL where the case has none */
    char err[256];             /* why a runner could not start (missing parameter) */
} run_args_t;

static double p_double(run_args_t *a, const char *key) {
    char k[128];
    snprintf(k, sizeof k, "p/%s", key);
    const golden_rec_t *r = golden_findf(a->g, a->cs, k);
    if (!r || r->numel != 1) {
        snprintf(a->err, sizeof a->err, "parameter %s missing or not a scalar", key);
        return NAN;
    }
    return golden_value(r, 0);
}

static int64_t p_int(run_args_t *a, const char *key) {
    double v = p_double(a, key);
    return isnan(v) ? 0 : (int64_t)v;
}

/* Reads an integer vector parameter into v (at most max); returns its length or -1. */
static int p_ints(run_args_t *a, const char *key, int64_t *v, int max) {
    char k[128];
    snprintf(k, sizeof k, "p/%s", key);
    int n = golden_ints(golden_findf(a->g, a->cs, k), v, max);
    if (n < 0) snprintf(a->err, sizeof a->err, "parameter %s missing or too long", key);
    return n;
}

static fsdp_reduction_t p_reduction(run_args_t *a) {
    return (fsdp_reduction_t)p_int(a, "reduction");
}

/* ---- runners: one per op, making exactly the call gen.py made ------------------------------- */

/* Produces the outputs of one case (new references in out[0..*nout)). */
typedef int (*run_fn)(run_args_t *a, fsdp_tensor_t **out, int *nout);

#define IN(i) (a->in[i])

static int run_add(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_add(IN(0), IN(1), o);
}
static int run_sub(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_sub(IN(0), IN(1), o);
}
static int run_mul(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_mul(IN(0), IN(1), o);
}
static int run_div(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_div(IN(0), IN(1), o);
}
static int run_scale(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_scale(IN(0), p_double(a, "alpha"), o);
}
static int run_add_scalar(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_add_scalar(IN(0), p_double(a, "alpha"), o);
}
static int run_relu(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_relu(IN(0), o);
}
static int run_gelu(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_gelu(IN(0), p_int(a, "approx") ? FSDP_GELU_TANH : FSDP_GELU_ERF, o);
}
static int run_tanh(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_tanh(IN(0), o);
}
static int run_sigmoid(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_sigmoid(IN(0), o);
}
static int run_exp(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_exp(IN(0), o);
}
static int run_log(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_ln(IN(0), o);
}

/* sum and mean: p/dims (empty: every dimension, ndims == 0) and p/keepdim. */
static int run_reduce(run_args_t *a, fsdp_tensor_t **o, int *n, bool mean) {
    int64_t d64[FSDP_MAX_DIMS];
    int dims[FSDP_MAX_DIMS];
    int nd = p_ints(a, "dims", d64, FSDP_MAX_DIMS);
    if (nd < 0) return FSDP_EINVAL;
    for (int i = 0; i < nd; i++)
        dims[i] = (int)d64[i];
    bool keep = p_int(a, "keepdim") != 0;
    *n = 1;
    return mean ? fsdp_mean(IN(0), nd, dims, keep, o) : fsdp_sum(IN(0), nd, dims, keep, o);
}
static int run_sum(run_args_t *a, fsdp_tensor_t **o, int *n) {
    return run_reduce(a, o, n, false);
}
static int run_mean(run_args_t *a, fsdp_tensor_t **o, int *n) {
    return run_reduce(a, o, n, true);
}

static int run_softmax(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_softmax(IN(0), (int)p_int(a, "dim"), o);
}
static int run_log_softmax(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_log_softmax(IN(0), (int)p_int(a, "dim"), o);
}
static int run_matmul(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_matmul(IN(0), IN(1), o);
}
static int run_linear(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_linear(IN(0), IN(1), IN(2), o);
}
static int run_layer_norm(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_layer_norm(IN(0), (int)p_int(a, "norm_ndim"), IN(1), IN(2), p_double(a, "eps"), o);
}
static int run_batch_norm(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_batch_norm(IN(0), IN(1), IN(2), IN(3), IN(4), p_int(a, "train") != 0,
                           p_double(a, "momentum"), p_double(a, "eps"), o);
}
static int run_embedding(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_embedding(IN(0), IN(1), p_int(a, "padding_idx"), o);
}
static int run_cross_entropy(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_cross_entropy(IN(0), IN(1), p_int(a, "ignore_index"), p_reduction(a),
                              p_double(a, "label_smoothing"), o);
}
static int run_mse_loss(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_mse_loss(IN(0), IN(1), p_reduction(a), o);
}
static int run_cat(run_args_t *a, fsdp_tensor_t **o, int *n) {
    int k = 0;
    while (k < MAX_IN && IN(k))
        k++;
    *n = 1;
    return fsdp_cat(a->in, k, (int)p_int(a, "dim"), o);
}
static int run_split(run_args_t *a, fsdp_tensor_t **o, int *n) {
    int64_t sizes[MAX_OUT];
    int k = p_ints(a, "sizes", sizes, MAX_OUT);
    if (k < 0) return FSDP_EINVAL;
    *n = k;
    return fsdp_split(IN(0), sizes, k, (int)p_int(a, "dim"), o);
}
static int run_where(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_where(IN(0), IN(1), IN(2), o);
}
static int run_masked_fill(run_args_t *a, fsdp_tensor_t **o, int *n) {
    *n = 1;
    return fsdp_masked_fill(IN(0), IN(1), p_double(a, "value"), o);
}

/* matmul(x.permute(perm), w) */
static int run_permute_matmul(run_args_t *a, fsdp_tensor_t **o, int *n) {
    int64_t p64[FSDP_MAX_DIMS];
    int perm[FSDP_MAX_DIMS];
    int np = p_ints(a, "perm", p64, FSDP_MAX_DIMS);
    if (np != fsdp_tensor_ndim(IN(0))) return FSDP_EINVAL;
    for (int i = 0; i < np; i++)
        perm[i] = (int)p64[i];
    fsdp_tensor_t *xp = NULL;
    int rc = fsdp_permute(IN(0), perm, &xp);
    if (rc == 0) rc = fsdp_matmul(xp, IN(1), o);
    fsdp_tensor_release(xp);
    *n = 1;
    return rc;
}

/* matmul(a.transpose(d0, d1), b) */
static int run_transpose_matmul(run_args_t *a, fsdp_tensor_t **o, int *n) {
    fsdp_tensor_t *at = NULL;
    int rc = fsdp_transpose(IN(0), (int)p_int(a, "d0"), (int)p_int(a, "d1"), &at);
    if (rc == 0) rc = fsdp_matmul(at, IN(1), o);
    fsdp_tensor_release(at);
    *n = 1;
    return rc;
}

/* x.narrow(dim, start, len) * y */
static int run_narrow_mul(run_args_t *a, fsdp_tensor_t **o, int *n) {
    fsdp_tensor_t *xn = NULL;
    int rc = fsdp_narrow(IN(0), (int)p_int(a, "dim"), p_int(a, "start"), p_int(a, "len"), &xn);
    if (rc == 0) rc = fsdp_mul(xn, IN(1), o);
    fsdp_tensor_release(xn);
    *n = 1;
    return rc;
}

/* softmax(masked_fill(q k^T * scale, mask, -inf), -1) v */
static int run_attention(run_args_t *a, fsdp_tensor_t **o, int *n) {
    fsdp_tensor_t *kt = NULL, *s = NULL, *ss = NULL, *sm = NULL, *p = NULL;
    int rc = fsdp_transpose(IN(1), 1, 2, &kt);
    if (rc == 0) rc = fsdp_matmul(IN(0), kt, &s);
    if (rc == 0) rc = fsdp_scale(s, p_double(a, "scale"), &ss);
    if (rc == 0) rc = fsdp_masked_fill(ss, IN(3), -INFINITY, &sm);
    if (rc == 0) rc = fsdp_softmax(sm, -1, &p);
    if (rc == 0) rc = fsdp_matmul(p, IN(2), o);
    fsdp_tensor_release(kt);
    fsdp_tensor_release(s);
    fsdp_tensor_release(ss);
    fsdp_tensor_release(sm);
    fsdp_tensor_release(p);
    *n = 1;
    return rc;
}

typedef struct op_spec {
    const char *op;
    run_fn run;
    const char *inputs[MAX_IN]; /* record keys in call order; a missing record passes NULL */
} op_spec_t;

static const op_spec_t OPS[] = {
    {"add", run_add, {"a", "b"}},
    {"sub", run_sub, {"a", "b"}},
    {"mul", run_mul, {"a", "b"}},
    {"div", run_div, {"a", "b"}},
    {"scale", run_scale, {"x"}},
    {"add_scalar", run_add_scalar, {"x"}},
    {"relu", run_relu, {"x"}},
    {"gelu", run_gelu, {"x"}},
    {"tanh", run_tanh, {"x"}},
    {"sigmoid", run_sigmoid, {"x"}},
    {"exp", run_exp, {"x"}},
    {"log", run_log, {"x"}},
    {"sum", run_sum, {"x"}},
    {"mean", run_mean, {"x"}},
    {"softmax", run_softmax, {"x"}},
    {"log_softmax", run_log_softmax, {"x"}},
    {"matmul", run_matmul, {"a", "b"}},
    {"linear", run_linear, {"x", "w", "b"}},
    {"layer_norm", run_layer_norm, {"x", "w", "b"}},
    {"batch_norm", run_batch_norm, {"x", "w", "b", "running_mean", "running_var"}},
    {"embedding", run_embedding, {"idx", "w"}},
    {"cross_entropy", run_cross_entropy, {"logits", "target"}},
    {"mse_loss", run_mse_loss, {"a", "b"}},
    {"cat", run_cat, {"x0", "x1", "x2", "x3", "x4", "x5", "x6", "x7"}},
    {"split", run_split, {"x"}},
    {"where", run_where, {"cond", "a", "b"}},
    {"masked_fill", run_masked_fill, {"x", "mask"}},
    {"permute_matmul", run_permute_matmul, {"x", "w"}},
    {"transpose_matmul", run_transpose_matmul, {"a", "b"}},
    {"narrow_mul", run_narrow_mul, {"x", "y"}},
    {"attention", run_attention, {"q", "k", "v", "mask"}},
};

static const op_spec_t *find_op(const char *cs) {
    size_t len = strcspn(cs, "/");
    for (size_t i = 0; i < sizeof OPS / sizeof OPS[0]; i++)
        if (strlen(OPS[i].op) == len && strncmp(OPS[i].op, cs, len) == 0) return &OPS[i];
    return NULL;
}

/* ---- the driver ----------------------------------------------------------------------------- */

static void tolerance(const golden_rec_t *r, double *rtol, double *atol) {
    bool f64 = r && r->dtype == FSDP_DTYPE_F64;
    *rtol = f64 ? F64_RTOL : F32_RTOL;
    *atol = f64 ? F64_ATOL : F32_ATOL;
}

/* The key of output k: "out" for a single-output case, else "out<k>" (same for "gout"). */
static void out_key(char *buf, size_t len, const char *base, bool multi, int k) {
    if (multi)
        snprintf(buf, len, "%s%d", base, k);
    else
        snprintf(buf, len, "%s", base);
}

/* Runs one case; its TAP lines are "<case> forward", "<case> <input> updated", and
 * "<case> grad <input>". Returns the number of failed checks. */
static int run_case(fsdp_ctx_t *ctx, const golden_t *g, const char *cs) {
    run_args_t a;
    fsdp_tensor_t *outs[MAX_OUT] = {0}, *gouts[MAX_OUT] = {0};
    int nout = 0, fails = 0, rc;
    double rtol, atol;
    memset(&a, 0, sizeof a);
    a.ctx = ctx;
    a.g = g;
    a.cs = cs;
    const op_spec_t *op = find_op(cs);
    if (!op) {
        tap_ok(0, "%s: no runner for this op in t_golden_ops.c", cs);
        return 1;
    }
    for (int i = 0; i < MAX_IN && op->inputs[i]; i++) {
        const golden_rec_t *r = golden_findf(g, cs, op->inputs[i]);
        if (!r) continue;
        a.in[i] = golden_tensor(ctx, r);
        char gk[96];
        snprintf(gk, sizeof gk, "grad/%s", op->inputs[i]);
        if (!a.in[i] ||
            (golden_findf(g, cs, gk) && fsdp_tensor_set_requires_grad(a.in[i], true) < 0)) {
            tap_ok(0, "%s: input %s: %s", cs, op->inputs[i], fsdp_ctx_last_error(ctx));
            fails++;
            goto out;
        }
    }
    rc = op->run(&a, outs, &nout);
    if (a.err[0]) {
        tap_ok(0, "%s forward: %s", cs, a.err);
        fails++;
        goto out;
    }
    if (rc < 0) {
        tap_ok(0, "%s forward: %s: %s", cs, fsdp_strerror(rc), fsdp_ctx_last_error(ctx));
        fails++;
        goto out;
    }
    bool multi = golden_findf(g, cs, "out0") != NULL;
    int want_n = multi ? 0 : 1;
    while (multi && want_n < MAX_OUT) {
        char key[32];
        snprintf(key, sizeof key, "out%d", want_n);
        if (!golden_findf(g, cs, key)) break;
        want_n++;
    }
    if (nout != want_n) {
        tap_ok(0, "%s forward: %d outputs, want %d", cs, nout, want_n);
        fails++;
        goto out;
    }
    for (int k = 0; k < nout; k++) {
        char key[32], what[512];
        out_key(key, sizeof key, "out", multi, k);
        snprintf(what, sizeof what, "%s forward%s%s", cs, multi ? " " : "", multi ? key : "");
        const golden_rec_t *want = golden_findf(g, cs, key);
        tolerance(want, &rtol, &atol);
        fails += !golden_check(what, outs[k], want, rtol, atol);
    }
    /* Inputs PyTorch updated in place. */
    for (int i = 0; i < MAX_IN && op->inputs[i]; i++) {
        char key[96], what[512];
        snprintf(key, sizeof key, "%s_out", op->inputs[i]);
        const golden_rec_t *want = golden_findf(g, cs, key);
        if (!want) continue;
        tolerance(want, &rtol, &atol);
        snprintf(what, sizeof what, "%s %s updated", cs, op->inputs[i]);
        fails += !golden_check(what, a.in[i], want, rtol, atol);
    }
    /* Backward with the golden upstream gradients, when any input has a golden gradient. */
    bool any_grad = false;
    for (int i = 0; i < MAX_IN && op->inputs[i]; i++) {
        char gk[96];
        snprintf(gk, sizeof gk, "grad/%s", op->inputs[i]);
        any_grad = any_grad || golden_findf(g, cs, gk);
    }
    if (!any_grad) goto out;
    for (int k = 0; k < nout; k++) {
        char key[32];
        out_key(key, sizeof key, "gout", multi, k);
        gouts[k] = golden_tensor(ctx, golden_findf(g, cs, key));
        if (!gouts[k]) {
            tap_ok(0, "%s backward: upstream gradient %s missing or unusable", cs, key);
            fails++;
            goto out;
        }
    }
    rc = nout == 1 ? fsdp_backward(outs[0], gouts[0]) : fsdp_backward_multi(nout, outs, gouts);
    if (rc < 0) {
        tap_ok(0, "%s backward: %s: %s", cs, fsdp_strerror(rc), fsdp_ctx_last_error(ctx));
        fails++;
        goto out;
    }
    for (int i = 0; i < MAX_IN && op->inputs[i]; i++) {
        char gk[96], what[512];
        snprintf(gk, sizeof gk, "grad/%s", op->inputs[i]);
        const golden_rec_t *want = golden_findf(g, cs, gk);
        if (!want) continue;
        tolerance(want, &rtol, &atol);
        snprintf(what, sizeof what, "%s grad %s", cs, op->inputs[i]);
        const fsdp_tensor_t *grad = a.in[i] ? fsdp_tensor_grad(a.in[i]) : NULL;
        fails += !golden_check(what, grad, want, rtol, atol);
    }
out:
    fsdp_tape_clear(ctx);
    for (int k = 0; k < MAX_OUT; k++) {
        fsdp_tensor_release(outs[k]);
        fsdp_tensor_release(gouts[k]);
    }
    for (int i = 0; i < MAX_IN; i++)
        fsdp_tensor_release(a.in[i]);
    return fails;
}

/* ---- the reader's own checks ---------------------------------------------------------------- */

typedef struct buf {
    unsigned char b[512];
    size_t n;
} buf_t;

static void put(buf_t *b, const void *p, size_t n) {
    if (b->n + n > sizeof b->b) return;
    memcpy(b->b + b->n, p, n);
    b->n += n;
}
static void put_u8(buf_t *b, unsigned v) {
    unsigned char c = (unsigned char)v;
    put(b, &c, 1);
}
static void put_le(buf_t *b, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++)
        put_u8(b, (unsigned)(v >> (8 * i)) & 0xff);
}

/* One record: name, dtype, shape, and numel elements of `es` bytes from data. */
static void put_rec(buf_t *b, const char *name, int dt, int ndim, const int64_t *shape,
                    const void *data, size_t bytes) {
    put_le(b, strlen(name), 2);
    put(b, name, strlen(name));
    put_u8(b, (unsigned)dt);
    put_u8(b, (unsigned)ndim);
    for (int d = 0; d < ndim; d++)
        put_le(b, (uint64_t)shape[d], 8);
    put(b, data, bytes);
}

/* A valid two-record file: "a/x" f32 [2, 3] and "a/p/n" i64 scalar 7. */
static void good_file(buf_t *b, uint32_t count) {
    static const float x[6] = {1, 2, 3, 4, 5, 6};
    static const int64_t shape[2] = {2, 3};
    int64_t seven = 7;
    b->n = 0;
    put(b, GOLDEN_MAGIC, 8);
    put_le(b, count, 4);
    put_rec(b, "a/x", FSDP_DTYPE_F32, 2, shape, x, sizeof x);
    put_rec(b, "a/p/n", FSDP_DTYPE_I64, 0, NULL, &seven, sizeof seven);
}

static int parse_status(const buf_t *b) {
    golden_t *g = NULL;
    char msg[256];
    int rc = golden_parse(b->b, b->n, &g, msg, sizeof msg);
    golden_free(g);
    return rc;
}

static void reader_tests(fsdp_ctx_t *ctx, const char *path) {
    buf_t b;
    golden_t *g = NULL;
    char msg[256];
    good_file(&b, 2);
    int rc = golden_parse(b.b, b.n, &g, msg, sizeof msg);
    tap_ok(rc == 0 && golden_count(g) == 2, "reader: a valid file parses (%s)", msg);
    const golden_rec_t *x = golden_find(g, "a/x");
    tap_ok(x && x->dtype == FSDP_DTYPE_F32 && x->ndim == 2 && x->shape[1] == 3 && x->numel == 6 &&
               golden_value(x, 5) == 6.0,
           "reader: record a/x has dtype, shape and data");
    int64_t v[2];
    tap_ok(golden_ints(golden_findf(g, "a", "p/n"), v, 2) == 1 && v[0] == 7 &&
               golden_find(g, "a/y") == NULL && golden_at(g, 1) == golden_find(g, "a/p/n"),
           "reader: golden_findf, golden_ints, golden_at");
    fsdp_tensor_t *t = golden_tensor(ctx, x);
    golden_check("reader: golden_tensor round trip", t, x, 0, 0);
    fsdp_tensor_t *t2 = NULL;
    fsdp_scale(t, 1.0 + 1e-3, &t2);
    char detail[512];
    tap_ok(t2 && !golden_compare(t2, x, F32_RTOL, F32_ATOL, detail, sizeof detail) &&
               strstr(detail, "[1, 2]"),
           "reader: golden_compare names the worst element");
    fsdp_tensor_release(t2);
    fsdp_tensor_release(t);
    golden_free(g);

    /* Every truncation of the small file fails cleanly. */
    size_t full = b.n, bad = 0;
    for (size_t n = 0; n < full; n++) {
        b.n = n;
        if (parse_status(&b) != FSDP_EINVAL) bad++;
    }
    tap_is_size(bad, 0, "reader: every truncation of a %zu-byte file is refused", full);

    good_file(&b, 2);
    put_u8(&b, 0);
    tap_is_int(parse_status(&b), FSDP_EINVAL, "reader: trailing bytes are refused");
    good_file(&b, 3);
    tap_is_int(parse_status(&b), FSDP_EINVAL, "reader: a count beyond the records is refused");
    good_file(&b, 0xffffffffu);
    tap_is_int(parse_status(&b), FSDP_EINVAL, "reader: an absurd count is refused");
    good_file(&b, 2);
    b.b[0] = 'X';
    tap_is_int(parse_status(&b), FSDP_EINVAL, "reader: a bad magic is refused");
    good_file(&b, 2);
    b.b[12 + 2 + 3] = 42; /* dtype of the first record */
    tap_is_int(parse_status(&b), FSDP_EINVAL, "reader: an unknown dtype is refused");
    good_file(&b, 2);
    b.b[12 + 2 + 3 + 1] = 9; /* ndim */
    tap_is_int(parse_status(&b), FSDP_EINVAL, "reader: ndim 9 is refused");
    good_file(&b, 2);
    b.b[12 + 2 + 3 + 2 + 7] = 0x80; /* first size negative */
    tap_is_int(parse_status(&b), FSDP_EINVAL, "reader: a negative size is refused");
    good_file(&b, 2);
    b.b[12 + 2 + 3 + 2 + 6] = 0x40; /* first size 2^54 + 2 */
    tap_is_int(parse_status(&b), FSDP_EINVAL, "reader: a size beyond the file is refused");
    good_file(&b, 2);
    b.b[12] = 0; /* first name length 0 */
    b.b[13] = 0;
    tap_is_int(parse_status(&b), FSDP_EINVAL, "reader: an empty name is refused");
    good_file(&b, 2);
    b.b[12 + 2 + 1] = 0; /* NUL inside the first name */
    tap_is_int(parse_status(&b), FSDP_EINVAL, "reader: a NUL in a name is refused");
    {
        static const int64_t one = 1;
        float f = 1;
        b.n = 0;
        put(&b, GOLDEN_MAGIC, 8);
        put_le(&b, 2, 4);
        put_rec(&b, "dup", FSDP_DTYPE_F32, 1, &one, &f, sizeof f);
        put_rec(&b, "dup", FSDP_DTYPE_F32, 1, &one, &f, sizeof f);
        tap_is_int(parse_status(&b), FSDP_EINVAL, "reader: duplicate names are refused");
    }
    rc = golden_load_msg(GOLDEN_DIR "/no-such-file.bin", &g, msg, sizeof msg);
    tap_ok(rc == GOLDEN_ENOENT && g == NULL, "reader: a missing file is GOLDEN_ENOENT (%s)", msg);

    /* Truncated copies of the real file, at a spread of lengths. */
    FILE *f = fopen(path, "rb");
    unsigned char *all = NULL;
    long size = -1;
    if (f && fseek(f, 0, SEEK_END) == 0 && (size = ftell(f)) > 0 && fseek(f, 0, SEEK_SET) == 0) {
        all = malloc((size_t)size);
        if (all && fread(all, 1, (size_t)size, f) != (size_t)size) size = -1;
    }
    if (f) fclose(f);
    bad = 0;
    size_t tried = 0;
    for (long n = 0; all && size > 0 && n < size; n += 1 + n / 7 + (n % 13)) {
        tried++;
        golden_t *gt = NULL;
        if (golden_parse(all, (size_t)n, &gt, NULL, 0) != FSDP_EINVAL || gt) bad++;
        golden_free(gt);
    }
    tap_ok(all && tried > 20 && bad == 0, "reader: %zu truncated copies of ops.bin are refused",
           tried);
    free(all);
}

/* Whether record `name` introduces a case (it is the case's "out" or "out0"); if so, writes the
 * case's name into cs. */
static bool case_name(const char *name, char *cs, size_t len) {
    static const char *const tails[] = {"/out", "/out0"};
    size_t n = strlen(name);
    for (int i = 0; i < 2; i++) {
        size_t t = strlen(tails[i]);
        if (n > t && strcmp(name + n - t, tails[i]) == 0 && n - t < len) {
            snprintf(cs, len, "%.*s", (int)(n - t), name);
            return true;
        }
    }
    return false;
}

int main(void) {
    const char *path = GOLDEN_DIR "/ops.bin";
    char msg[512];
    golden_t *g = NULL;
    int rc = golden_load_msg(path, &g, msg, sizeof msg);
    if (rc == GOLDEN_ENOENT)
        return tap_skip_all("no golden vectors (run tests/golden/gen.py --out tests/golden)");
    tap_plan_lazy();
    fsdp_ctx_options_t opts;
    fsdp_ctx_t *ctx = NULL;
    fsdp_ctx_options_init(&opts);
    if (fsdp_ctx_create(&opts, &ctx) < 0) tap_bail("fsdp_ctx_create failed");
    tap_ok(rc == 0, "load %s (%d records)", msg, golden_count(g));
    if (rc == 0) {
        reader_tests(ctx, path);
        int cases = 0, failed = 0;
        for (int i = 0; i < golden_count(g); i++) {
            char cs[256];
            if (!case_name(golden_at(g, i)->name, cs, sizeof cs)) continue;
            cases++;
            failed += run_case(ctx, g, cs) ? 1 : 0;
        }
        tap_ok(cases > 0, "ran %d golden cases (%d with failures)", cases, failed);
    }
    golden_free(g);
    fsdp_ctx_destroy(ctx);
    return tap_done();
}
