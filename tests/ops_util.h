/* SPDX-License-Identifier: MIT */
/*
 * ops_util.h: what the operation tests (t_ops.c: forward values and errors; t_ops_grad.c:
 * gradient checks, accumulation, grad mode) share.
 *
 * One context per test program (ops_ctx), created by ops_begin() and destroyed by ops_end(),
 * which also checks that every byte the tests allocated between the two has been given back.
 * Inputs are deterministic in a seed; expected values are computed by the tests in double.
 * The tables list the operations both programs run: the four binary operations, the
 * broadcasting patterns they are tried on, and the unary operations with their references.
 */
#ifndef FSDP_TEST_OPS_UTIL_H
#define FSDP_TEST_OPS_UTIL_H

#include <stdbool.h>
#include <stdint.h>

#include <fsdp.h>

/* The largest tensor these tests build. */
#define MAXN 256

/* The context every tensor of the tests lives in. */
extern fsdp_ctx_t *ops_ctx;

/* Starts the program: a lazy TAP plan, the context (bails out without one) and the memory
 * baseline, taken after the default device exists so that its own allocations do not count. */
void ops_begin(void);

/* Ends the program: clears the tape, reports one TAP line saying whether every byte allocated
 * since ops_begin() was freed (with the categories that differ as comments), destroys the
 * context. Returns tap_done()'s exit status. */
int ops_end(void);

int64_t numel_of(int nd, const int64_t *shape);

/* v rounded to dt (once, as the library's conversions do) and read back. */
double rnd(fsdp_dtype_t dt, double v);

/* A contiguous tensor of dtype dt holding v (converted); NULL on failure. */
fsdp_tensor_t *mk(fsdp_dtype_t dt, int nd, const int64_t *shape, const double *v);

/* Random values in [lo, hi) from seed, rounded to dt (vals receives exactly what the tensor
 * holds; may be NULL). At most MAXN elements. */
fsdp_tensor_t *mk_rand(fsdp_dtype_t dt, int nd, const int64_t *shape, double lo, double hi,
                       unsigned seed, double *vals);

/* One TAP line: t exists, has dtype dt and shape (nd, shape), and every value is within
 * atol + rtol |want| of want (equal infinities and NaNs match). */
int check_vals(const fsdp_tensor_t *t, fsdp_dtype_t dt, int nd, const int64_t *shape,
               const double *want, double rtol, double atol, const char *fmt, ...);

/* Releases ts[0 .. n) and sets them to NULL. */
void release_all(int n, fsdp_tensor_t **ts);

/* ---- operation tables ---- */

typedef int (*binop_fn)(fsdp_tensor_t *a, fsdp_tensor_t *b, fsdp_tensor_t **out);
typedef int (*unop_fn)(fsdp_tensor_t *x, fsdp_tensor_t **out);

struct binop {
    const char *name;
    binop_fn fn;
    char sym;
};

/* add, sub, mul, div. */
extern const struct binop binops[4];

struct unop {
    const char *name;
    unop_fn fn;
    double (*ref)(double);
    double lo, hi; /* input range: the function is smooth there */
};

/* relu, gelu (erf and tanh), tanh, sigmoid, exp, ln, scale(2.5), add_scalar(-1.5). */
extern const struct unop unops[9];

/* Operand shapes a (an, as) and b (bn, bs) broadcasting to (on, os). */
struct pattern {
    int an;
    int64_t as[3];
    int bn;
    int64_t bs[3];
    int on;
    int64_t os[3];
    const char *what;
};

extern const struct pattern patterns[4];

/* A sum or mean over dims (ndims of them; 0: every dim), its output shape (on, os) and the
 * reduced dimensions as a bit mask (for the reference). */
struct red_case {
    bool mean;
    int ndims;
    int dims[3];
    bool keepdim;
    int on;
    int64_t os[3];
    unsigned mask;
    const char *what;
};

#endif /* FSDP_TEST_OPS_UTIL_H */
