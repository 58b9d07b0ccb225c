/* SPDX-License-Identifier: MIT */
/*
 * t_matmul_lp.c: bf16 and f16 matrix products on a device that multiplies them natively
 * (gemm_lp_dtypes / gemm_lp in the device vtable), against the widening path every other
 * device takes.
 *
 * This build has no GPU, so the capable device is a CPU device whose vtable claims bf16 and f16
 * and whose gemm_lp is this file's reference: widen A, B and C to f32, run the CPU's f32 gemm
 * (f32 accumulation, alpha and beta in f32), round C once to nearest even into its dtype. Every
 * device of the file records its gemm and gemm_lp calls (dtypes, transpose flags, sizes, batch)
 * and its widening casts (f16/bf16 to f32):
 *   LP    claims bf16 and f16;
 *   LPBF  claims bf16 only (f16 must still widen);
 *   WIDE  claims nothing, exactly as the CPU device.
 *
 * For fsdp_linear (with and without bias, 3-d input), fsdp_matmul (2-d x 2-d in the four
 * transpose combinations, batched 3-d x 3-d, 3-d x 2-d folded into one tall product, 2-d x 3-d
 * with the shared operand's gradient summed over the batch) and a chain of two linears (whose
 * inner gradient arrives in f32), forward and backward:
 *   - on LP every product is one gemm_lp call of the operands' dtype with the expected transpose
 *     flags and sizes, output in that dtype forward and in f32 backward; no f32 gemm, no widening
 *     cast;
 *   - on WIDE (and LPBF for f16) no gemm_lp call is made, the products are f32 gemms of widened
 *     copies, and the results are bitwise those of widening by hand (fsdp_to_dtype to f32, the
 *     f32 op, rounding back): the old behaviour;
 *   - with inputs that are multiples of 1/16 (every f32 sum exact) LP's outputs and gradients
 *     are bitwise WIDE's and equal the double-precision reference rounded to the dtype;
 *   - with random inputs they are within 1e-2 relative (of the sum of the absolute terms) of
 *     WIDE's and of the double-precision reference.
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "device/device_impl.h"
#include "tap.h"

#define MAXE 256 /* elements of the largest tensor */
#define MAXCALLS 16

static fsdp_ctx_t *ctx;

/* ---- recording devices ------------------------------------------------------------------ */

struct gcall {
    bool lp;             /* gemm_lp (else gemm) */
    fsdp_dtype_t dt, ct; /* operands' and C's dtype (equal for gemm) */
    bool ta, tb;
    int64_t m, n, k, batch;
};

static struct {
    int ncalls, nwiden;
    struct gcall calls[MAXCALLS];
} rec;

static void rec_reset(void) {
    memset(&rec, 0, sizeof rec);
}

static void rec_add(struct gcall c) {
    if (rec.ncalls < MAXCALLS) rec.calls[rec.ncalls] = c;
    rec.ncalls++;
}

static int rec_gemm(fsdp_device_t *dev, fsdp_dtype_t dt, bool ta, bool tb, int64_t m, int64_t n,
                    int64_t k, double alpha, const void *a, int64_t lda, int64_t sa, const void *b,
                    int64_t ldb, int64_t sb, double beta, void *c, int64_t ldc, int64_t sc,
                    int64_t batch) {
    rec_add((struct gcall){false, dt, dt, ta, tb, m, n, k, batch});
    return fsdp__cpu_dev_ops.gemm(dev, dt, ta, tb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, c,
                                  ldc, sc, batch);
}

static int rec_cast(fsdp_device_t *dev, fsdp_dtype_t dt, void *y, fsdp_dtype_t xt, const void *x,
                    size_t n) {
    if (dt == FSDP_DTYPE_F32 && (xt == FSDP_DTYPE_BF16 || xt == FSDP_DTYPE_F16)) rec.nwiden++;
    return fsdp__cpu_dev_ops.cast(dev, dt, y, xt, x, n);
}

/* Elements spanned by `batch` stored (rows x cols) matrices with row stride ld, batch stride
 * stride (0: one matrix shared). */
static size_t span(int64_t rows, int64_t cols, int64_t ld, int64_t stride, int64_t batch) {
    if (rows == 0 || cols == 0 || batch == 0) return 0;
    return (size_t)((batch - 1) * stride + (rows - 1) * ld + cols);
}

/* The reference gemm_lp: A, B and C widened to f32, the CPU's f32 gemm, C rounded once. */
static int ref_gemm_lp(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_dtype_t ct, bool ta, bool tb,
                       int64_t m, int64_t n, int64_t k, double alpha, const void *a, int64_t lda,
                       int64_t sa, const void *b, int64_t ldb, int64_t sb, double beta, void *c,
                       int64_t ldc, int64_t sc, int64_t batch) {
    rec_add((struct gcall){true, dt, ct, ta, tb, m, n, k, batch});
    if (!fsdp__device_gemm_native(dev, dt) || (ct != dt && ct != FSDP_DTYPE_F32))
        return fsdp__ctx_err(dev->ctx, FSDP_EINVAL, "test gemm_lp: %s into %s not claimed",
                             fsdp_dtype_name(dt), fsdp_dtype_name(ct));
    if (m == 0 || n == 0 || batch == 0) return FSDP_OK;
    size_t na = span(ta ? k : m, ta ? m : k, lda, sa, batch);
    size_t nb = span(tb ? n : k, tb ? k : n, ldb, sb, batch);
    size_t nc = span(m, n, ldc, sc, batch);
    float *fa = malloc((na + 1) * sizeof *fa), *fb = malloc((nb + 1) * sizeof *fb),
          *fc = malloc((nc + 1) * sizeof *fc);
    int rc = FSDP_ENOMEM;
    if (fa && fb && fc) {
        rc = fsdp_dtype_convert(fa, FSDP_DTYPE_F32, a, dt, na);
        if (rc == 0) rc = fsdp_dtype_convert(fb, FSDP_DTYPE_F32, b, dt, nb);
        if (rc == 0) rc = fsdp_dtype_convert(fc, FSDP_DTYPE_F32, c, ct, nc);
        if (rc == 0)
            rc = fsdp__cpu_dev_ops.gemm(dev, FSDP_DTYPE_F32, ta, tb, m, n, k, alpha, fa, lda, sa,
                                        fb, ldb, sb, beta, fc, ldc, sc, batch);
        if (rc == 0) rc = fsdp_dtype_convert(c, ct, fc, FSDP_DTYPE_F32, nc);
    }
    free(fa);
    free(fb);
    free(fc);
    return rc;
}

static struct fsdp_dev_ops ops_lp, ops_lpbf, ops_wide;

enum { DEV_LP, DEV_LPBF, DEV_WIDE, NDEV };
static const char *const dev_names[NDEV] = {"LP", "LPBF", "WIDE"};
static fsdp_device_t *devs[NDEV];

static void make_devices(void) {
    ops_wide = fsdp__cpu_dev_ops;
    ops_wide.gemm = rec_gemm;
    ops_wide.cast = rec_cast;
    ops_lp = ops_wide;
    ops_lp.gemm_lp_dtypes = FSDP__DT_BIT(FSDP_DTYPE_BF16) | FSDP__DT_BIT(FSDP_DTYPE_F16);
    ops_lp.gemm_lp = ref_gemm_lp;
    ops_lpbf = ops_lp;
    ops_lpbf.gemm_lp_dtypes = FSDP__DT_BIT(FSDP_DTYPE_BF16);
    const struct fsdp_dev_ops *tab[NDEV] = {&ops_lp, &ops_lpbf, &ops_wide};
    for (int d = 0; d < NDEV; d++) {
        if (fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &devs[d]) < 0)
            tap_bail("cannot create a CPU device: %s", fsdp_ctx_last_error(ctx));
        devs[d]->ops = tab[d];
    }
}

/* Whether device d takes dt natively. */
static bool native(int d, fsdp_dtype_t dt) {
    return fsdp__device_gemm_native(devs[d], dt);
}

/* ---- values ------------------------------------------------------------------------------ */

/* Input families: multiples of 1/16 in [-2, 2) (every f32 sum of these products is exact) and
 * uniform values in [-1, 1). Both are representable in bf16 and f16. */
enum { FAM_EXACT, FAM_RANDOM };
static const char *const fam_names[2] = {"exact", "random"};

static double value(int fam, unsigned seed, int64_t i) {
    uint64_t h = (uint64_t)seed * 0x9E3779B97F4A7C15ull + (uint64_t)i * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
    h *= 0x94D049BB133111EBull;
    h ^= h >> 29;
    if (fam == FAM_EXACT) return (double)((int64_t)(h % 64) - 32) / 16.0;
    return (double)(h >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

/* v rounded to dt once. */
static double rnd(fsdp_dtype_t dt, double v) {
    double out = v;
    uint16_t h;
    fsdp_dtype_convert(&h, dt, &v, FSDP_DTYPE_F64, 1);
    fsdp_dtype_convert(&out, FSDP_DTYPE_F64, &h, dt, 1);
    return out;
}

/* A leaf of dtype dt on the context's default device holding value(fam, seed, i) rounded to dt;
 * the rounded values go to v. */
static fsdp_tensor_t *leaf(fsdp_dtype_t dt, int nd, const int64_t *shape, int fam, unsigned seed,
                           bool grad, double *v) {
    int64_t n = 1;
    for (int i = 0; i < nd; i++)
        n *= shape[i];
    double d[MAXE];
    uint16_t h[MAXE];
    for (int64_t i = 0; i < n; i++)
        d[i] = value(fam, seed, i);
    fsdp_dtype_convert(h, dt, d, FSDP_DTYPE_F64, (size_t)n);
    fsdp_dtype_convert(v, FSDP_DTYPE_F64, h, dt, (size_t)n);
    fsdp_tensor_t *t = NULL;
    if (fsdp_tensor_from_host(ctx, dt, nd, shape, h, FSDP_MEM_ACTIVATIONS, &t) < 0)
        tap_bail("cannot create a tensor: %s", fsdp_ctx_last_error(ctx));
    if (grad) fsdp_tensor_set_requires_grad(t, true);
    return t;
}

/* t's elements in row-major order of its (possibly strided) shape, as doubles; n of them. */
static int64_t host(const fsdp_tensor_t *t, double *v) {
    if (!t) return -1;
    int64_t n = fsdp_tensor_numel(t);
    fsdp_dtype_t dt = fsdp_tensor_dtype(t);
    unsigned char buf[MAXE * 8];
    if (n > MAXE || fsdp_tensor_to_host(t, buf, (size_t)n * fsdp_dtype_size(dt)) < 0) return -1;
    fsdp_dtype_convert(v, FSDP_DTYPE_F64, buf, dt, (size_t)n);
    return n;
}

/* The transpose of a leaf's gradient read in the logical order of the transposed operand. */
static int64_t host_t(const fsdp_tensor_t *g, double *v) {
    fsdp_tensor_t *t = NULL;
    if (!g || fsdp_transpose((fsdp_tensor_t *)g, -2, -1, &t) < 0) return -1;
    int64_t n = host(t, v);
    fsdp_tensor_release(t);
    return n;
}

/* ---- the double-precision reference ----------------------------------------------------- */

/* C (batch, m, n) = op(A) op(B) where A holds logical (batch, m, k) row-major, or (batch, k, m)
 * read transposed when ta, with batch stride sa (0: shared); likewise B (k, n). With `sum` C is
 * one (m, n) matrix summed over the batch. abs receives the sum of |terms| of each element. */
static void ref_mm(const double *a, bool ta, int64_t sa, const double *b, bool tb, int64_t sb,
                   int64_t batch, int64_t m, int64_t n, int64_t k, bool sum, double *c,
                   double *abs) {
    int64_t cn = sum ? 1 : batch;
    memset(c, 0, sizeof *c * (size_t)(cn * m * n));
    memset(abs, 0, sizeof *abs * (size_t)(cn * m * n));
    for (int64_t bb = 0; bb < batch; bb++)
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) {
                int64_t o = (sum ? 0 : bb) * m * n + i * n + j;
                for (int64_t p = 0; p < k; p++) {
                    double x = a[bb * sa + (ta ? p * m + i : i * k + p)];
                    double y = b[bb * sb + (tb ? j * k + p : p * n + j)];
                    c[o] += x * y;
                    abs[o] += fabs(x * y);
                }
            }
}

/* One TAP line: got (n values) against want: bitwise equal to want rounded to dt (exact family)
 * or within 1e-2 of abs (the sum of |terms|) plus 1e-6 (random family). */
static int check_ref(int fam, fsdp_dtype_t dt, int64_t ngot, const double *got, int64_t n,
                     const double *want, const double *abs, const char *what) {
    if (ngot != n)
        return tap_ok(0, "%s: %lld values read, want %lld", what, (long long)ngot, (long long)n);
    for (int64_t i = 0; i < n; i++) {
        double w = fam == FAM_EXACT ? rnd(dt, want[i]) : want[i];
        bool ok = fam == FAM_EXACT ? got[i] == w : fabs(got[i] - w) <= 1e-2 * abs[i] + 1e-6;
        if (!ok)
            return tap_ok(0, "%s: element %lld is %.9g, reference %.9g (sum |terms| %.6g)", what,
                          (long long)i, got[i], w, abs[i]);
    }
    return tap_ok(1, "%s", what);
}

/* One TAP line: LP's values against WIDE's: bitwise for the exact family, within 1e-2 of abs
 * (or of |wide| when abs is NULL) otherwise. */
static int check_pair(int fam, int64_t n, const double *lp, const double *wide, const double *abs,
                      const char *what) {
    for (int64_t i = 0; i < n; i++) {
        double scale = abs ? abs[i] : fabs(wide[i]);
        bool ok = fam == FAM_EXACT ? memcmp(&lp[i], &wide[i], sizeof lp[i]) == 0
                                   : fabs(lp[i] - wide[i]) <= 1e-2 * scale + 1e-6;
        if (!ok)
            return tap_ok(0, "%s: element %lld: native %.9g, widened %.9g", what, (long long)i,
                          lp[i], wide[i]);
    }
    return tap_ok(1, "%s", what);
}

/* One TAP line: the calls recorded match want (n of them), and no widening cast was made. */
static int check_calls(const struct gcall *want, int n, const char *what) {
    if (rec.ncalls != n || rec.nwiden != 0)
        return tap_ok(0, "%s: %d GEMM calls (want %d), %d widening casts (want 0)", what,
                      rec.ncalls, n, rec.nwiden);
    for (int i = 0; i < n; i++) {
        const struct gcall *g = &rec.calls[i], *w = &want[i];
        if (g->lp != w->lp || g->dt != w->dt || g->ct != w->ct || g->ta != w->ta ||
            g->tb != w->tb || g->m != w->m || g->n != w->n || g->k != w->k || g->batch != w->batch)
            return tap_ok(0,
                          "%s: call %d is %s %s->%s ta %d tb %d m %lld n %lld k %lld batch %lld, "
                          "want %s %s->%s ta %d tb %d m %lld n %lld k %lld batch %lld",
                          what, i, g->lp ? "gemm_lp" : "gemm", fsdp_dtype_name(g->dt),
                          fsdp_dtype_name(g->ct), g->ta, g->tb, (long long)g->m, (long long)g->n,
                          (long long)g->k, (long long)g->batch, w->lp ? "gemm_lp" : "gemm",
                          fsdp_dtype_name(w->dt), fsdp_dtype_name(w->ct), w->ta, w->tb,
                          (long long)w->m, (long long)w->n, (long long)w->k, (long long)w->batch);
    }
    return tap_ok(1, "%s", what);
}

/* One TAP line: a widening device made no gemm_lp call, only f32 gemms, and widened operands. */
static int check_widened(const char *what) {
    int lp = 0, other = 0;
    for (int i = 0; i < rec.ncalls && i < MAXCALLS; i++) {
        if (rec.calls[i].lp) lp++;
        if (!rec.calls[i].lp && rec.calls[i].dt != FSDP_DTYPE_F32) other++;
    }
    return tap_ok(rec.ncalls > 0 && lp == 0 && other == 0 && rec.nwiden > 0,
                  "%s: %d GEMM calls, all f32 gemm (gemm_lp %d, other dtypes %d), %d widening "
                  "casts",
                  what, rec.ncalls, lp, other, rec.nwiden);
}

/* ---- one product, forward and backward -------------------------------------------------- */

/* What a case computes: C = op(A) op(B) with the operands as leaves in their stored layout. */
struct mm_case {
    const char *name;
    bool linear; /* fsdp_linear(x, w, bias): A = x (rows, in), B = w^T */
    bool bias;
    int and, bnd; /* dimensions of the operands (matmul) */
    int64_t batch, m, n, k;
    bool ta, tb; /* A (B) built as the transpose of a stored leaf */
    bool a_shared, b_shared;
};

/* Results of one run (logical layouts). */
struct mm_out {
    int64_t ny, nga, ngb, ngbias;
    double y[MAXE], ga[MAXE], gb[MAXE], gbias[MAXE];
    double av[MAXE], bv[MAXE], biasv[MAXE], gyv[MAXE];
    int nfwd; /* calls recorded by the forward */
    struct gcall fwd[MAXCALLS], bwd[MAXCALLS];
    int nbwd, widen_fwd, widen_bwd;
};

/* Runs case c with dtype dt on device d, inputs of family fam: forward, then backward with a
 * gradient of the output's dtype. by_hand: widen the leaves with fsdp_to_dtype, compute in f32 and
 * round the output back (the behaviour before native products). */
static int run_case(const struct mm_case *c, fsdp_dtype_t dt, int d, int fam, bool by_hand,
                    struct mm_out *o) {
    int rc = 0;
    fsdp_ctx_set_device(ctx, devs[d]);
    fsdp_tensor_t *a = NULL, *b = NULL, *bias = NULL, *av = NULL, *bv = NULL, *y = NULL, *gy = NULL,
                  *aw = NULL, *bw = NULL, *biasw = NULL, *yw = NULL;
    int64_t as[4], bs[4], ys[4];
    int an = 0, bn = 0, yn = 0;
    if (c->linear) {
        /* x (batch, m, k), w (n, k), y (batch, m, n). */
        as[an++] = c->batch;
        as[an++] = c->m;
        as[an++] = c->k;
        bs[bn++] = c->n;
        bs[bn++] = c->k;
    } else {
        if (c->and == 3) as[an++] = c->batch;
        as[an++] = c->ta ? c->k : c->m;
        as[an++] = c->ta ? c->m : c->k;
        if (c->bnd == 3) bs[bn++] = c->batch;
        bs[bn++] = c->tb ? c->n : c->k;
        bs[bn++] = c->tb ? c->k : c->n;
    }
    if (c->linear || c->and == 3 || c->bnd == 3) ys[yn++] = c->batch;
    ys[yn++] = c->m;
    ys[yn++] = c->n;
    a = leaf(dt, an, as, fam, 11, true, o->av);
    b = leaf(dt, bn, bs, fam, 23, true, o->bv);
    if (c->bias) bias = leaf(dt, 1, &c->n, fam, 37, true, o->biasv);
    gy = leaf(dt, yn, ys, fam, 41, false, o->gyv);
    if (!c->linear && c->ta) FSDP_TRY(rc, out, fsdp_transpose(a, -2, -1, &av));
    if (!c->linear && c->tb) FSDP_TRY(rc, out, fsdp_transpose(b, -2, -1, &bv));
    fsdp_tensor_t *ua = av ? av : a, *ub = bv ? bv : b;
    if (by_hand) {
        FSDP_TRY(rc, out, fsdp_to_dtype(ua, FSDP_DTYPE_F32, &aw));
        FSDP_TRY(rc, out, fsdp_to_dtype(ub, FSDP_DTYPE_F32, &bw));
        if (bias) FSDP_TRY(rc, out, fsdp_to_dtype(bias, FSDP_DTYPE_F32, &biasw));
        ua = aw;
        ub = bw;
    }
    rec_reset();
    if (c->linear)
        FSDP_TRY(rc, out, fsdp_linear(ua, ub, by_hand ? biasw : bias, by_hand ? &yw : &y));
    else
        FSDP_TRY(rc, out, fsdp_matmul(ua, ub, by_hand ? &yw : &y));
    if (by_hand) FSDP_TRY(rc, out, fsdp_to_dtype(yw, dt, &y));
    o->nfwd = rec.ncalls;
    o->widen_fwd = rec.nwiden;
    memcpy(o->fwd, rec.calls, sizeof o->fwd);
    o->ny = host(y, o->y);
    rec_reset();
    FSDP_TRY(rc, out, fsdp_backward(y, gy));
    o->nbwd = rec.ncalls;
    o->widen_bwd = rec.nwiden;
    memcpy(o->bwd, rec.calls, sizeof o->bwd);
    o->nga = c->ta ? host_t(fsdp_tensor_grad(a), o->ga) : host(fsdp_tensor_grad(a), o->ga);
    o->ngb = c->tb ? host_t(fsdp_tensor_grad(b), o->gb) : host(fsdp_tensor_grad(b), o->gb);
    o->ngbias = bias ? host(fsdp_tensor_grad(bias), o->gbias) : 0;
out:
    if (rc < 0) tap_diag("%s on %s: %s", c->name, dev_names[d], fsdp_ctx_last_error(ctx));
    fsdp_tensor_release(yw);
    fsdp_tensor_release(biasw);
    fsdp_tensor_release(bw);
    fsdp_tensor_release(aw);
    fsdp_tensor_release(y);
    fsdp_tensor_release(gy);
    fsdp_tensor_release(av);
    fsdp_tensor_release(bv);
    fsdp_tensor_release(bias);
    fsdp_tensor_release(b);
    fsdp_tensor_release(a);
    fsdp_tape_clear(ctx);
    fsdp_ctx_set_device(ctx, NULL);
    return rc;
}

/* The calls a natively multiplying device must make for case c (forward, then backward). */
static int want_calls(const struct mm_case *c, fsdp_dtype_t dt, struct gcall *fwd, int *nf,
                      struct gcall *bwd) {
    const fsdp_dtype_t f = FSDP_DTYPE_F32;
    int nb = 0;
    *nf = 0;
    if (c->linear) {
        int64_t rows = c->batch * c->m;
        fwd[(*nf)++] = (struct gcall){true, dt, dt, false, true, rows, c->n, c->k, 1};
        bwd[nb++] = (struct gcall){true, dt, f, false, false, rows, c->k, c->n, 1}; /* gx */
        bwd[nb++] = (struct gcall){true, dt, f, true, false, c->n, c->k, rows, 1};  /* gw */
        if (c->bias) bwd[nb++] = (struct gcall){true, dt, f, false, false, 1, c->n, rows, 1};
        return nb;
    }
    if (c->b_shared) {
        /* Folded: one tall product over every batch row. */
        int64_t rows = c->batch * c->m;
        fwd[(*nf)++] = (struct gcall){true, dt, dt, c->ta, c->tb, rows, c->n, c->k, 1};
        bwd[nb++] = (struct gcall){true, dt, f, false, !c->tb, rows, c->k, c->n, 1};
        bwd[nb++] = (struct gcall){true, dt, f, !c->ta, false, c->k, c->n, rows, 1};
        return nb;
    }
    fwd[(*nf)++] = (struct gcall){true, dt, dt, c->ta, c->tb, c->m, c->n, c->k, c->batch};
    if (c->a_shared)
        for (int64_t i = 0; i < c->batch; i++)
            bwd[nb++] = (struct gcall){true, dt, f, false, !c->tb, c->m, c->k, c->n, 1};
    else
        bwd[nb++] = (struct gcall){true, dt, f, false, !c->tb, c->m, c->k, c->n, c->batch};
    bwd[nb++] = (struct gcall){true, dt, f, !c->ta, false, c->k, c->n, c->m, c->batch};
    return nb;
}

static void test_case(const struct mm_case *c, fsdp_dtype_t dt, int fam) {
    static struct mm_out lp, wide, hand;
    const char *dn = fsdp_dtype_name(dt), *fn = fam_names[fam];
    char what[200];
    int ok = run_case(c, dt, DEV_LP, fam, false, &lp) == 0;
    ok = run_case(c, dt, DEV_WIDE, fam, false, &wide) == 0 && ok;
    ok = run_case(c, dt, DEV_WIDE, fam, true, &hand) == 0 && ok;
    if (!tap_ok(ok, "%s %s %s: runs natively, widened and by hand", c->name, dn, fn)) return;

    /* The calls: checked once per case and dtype (the exact family). */
    if (fam == FAM_EXACT) {
        struct gcall wf[MAXCALLS], wb[MAXCALLS];
        int nf, nb = want_calls(c, dt, wf, &nf, wb);
        rec.ncalls = lp.nfwd;
        rec.nwiden = lp.widen_fwd;
        memcpy(rec.calls, lp.fwd, sizeof rec.calls);
        snprintf(what, sizeof what, "%s %s forward on LP: gemm_lp of %s, no widening", c->name, dn,
                 dn);
        check_calls(wf, nf, what);
        rec.ncalls = lp.nbwd;
        rec.nwiden = lp.widen_bwd;
        memcpy(rec.calls, lp.bwd, sizeof rec.calls);
        snprintf(what, sizeof what,
                 "%s %s backward on LP: gemm_lp of %s into f32 for every gradient, no widening",
                 c->name, dn, dn);
        check_calls(wb, nb, what);
        rec_reset();
        for (int i = 0; i < wide.nfwd && i < MAXCALLS; i++)
            rec_add(wide.fwd[i]);
        for (int i = 0; i < wide.nbwd && i < MAXCALLS; i++)
            rec_add(wide.bwd[i]);
        rec.nwiden = wide.widen_fwd + wide.widen_bwd;
        snprintf(what, sizeof what, "%s %s on WIDE: operands widened for f32 gemm", c->name, dn);
        check_widened(what);
    }

    /* Reference in double from the values the leaves hold. */
    double ry[MAXE], ay[MAXE], rga[MAXE], aga[MAXE], rgb[MAXE], agb[MAXE], rgs[MAXE], ags[MAXE];
    int64_t ny, nga, ngb;
    if (c->linear) {
        int64_t rows = c->batch * c->m;
        ref_mm(lp.av, false, 0, lp.bv, true, 0, 1, rows, c->n, c->k, false, ry, ay);
        for (int64_t i = 0; c->bias && i < rows * c->n; i++) {
            ry[i] += lp.biasv[i % c->n];
            ay[i] += fabs(lp.biasv[i % c->n]);
        }
        ref_mm(lp.gyv, false, 0, lp.bv, false, 0, 1, rows, c->k, c->n, false, rga, aga);
        ref_mm(lp.gyv, true, 0, lp.av, false, 0, 1, c->n, c->k, rows, false, rgb, agb);
        for (int64_t j = 0; j < c->n; j++) {
            rgs[j] = ags[j] = 0;
            for (int64_t r = 0; r < rows; r++) {
                rgs[j] += lp.gyv[r * c->n + j];
                ags[j] += fabs(lp.gyv[r * c->n + j]);
            }
        }
        ny = rows * c->n;
        nga = rows * c->k;
        ngb = c->n * c->k;
    } else {
        /* Logical operands: the leaves' values read through the transposes. */
        int64_t sa = c->a_shared ? 0 : c->m * c->k, sb = c->b_shared ? 0 : c->k * c->n;
        int64_t sg = c->m * c->n;
        ref_mm(lp.av, c->ta, sa, lp.bv, c->tb, sb, c->batch, c->m, c->n, c->k, false, ry, ay);
        /* ga = gy op(B)^T, gb = op(A)^T gy, summed over the batch for a shared operand. */
        ref_mm(lp.gyv, false, sg, lp.bv, !c->tb, sb, c->batch, c->m, c->k, c->n, c->a_shared, rga,
               aga);
        ref_mm(lp.av, !c->ta, sa, lp.gyv, false, sg, c->batch, c->k, c->n, c->m, c->b_shared, rgb,
               agb);
        ny = c->batch * c->m * c->n;
        nga = (c->a_shared ? 1 : c->batch) * c->m * c->k;
        ngb = (c->b_shared ? 1 : c->batch) * c->k * c->n;
    }
    const char *ga_name = c->linear ? "x" : "a", *gb_name = c->linear ? "w" : "b";
    snprintf(what, sizeof what, "%s %s %s: native output matches the f32-accumulated reference",
             c->name, dn, fn);
    check_ref(fam, dt, lp.ny, lp.y, ny, ry, ay, what);
    snprintf(what, sizeof what, "%s %s %s: native grad of %s matches the reference", c->name, dn,
             fn, ga_name);
    check_ref(fam, dt, lp.nga, lp.ga, nga, rga, aga, what);
    snprintf(what, sizeof what, "%s %s %s: native grad of %s matches the reference", c->name, dn,
             fn, gb_name);
    check_ref(fam, dt, lp.ngb, lp.gb, ngb, rgb, agb, what);
    if (c->bias) {
        snprintf(what, sizeof what, "%s %s %s: native grad of the bias matches the reference",
                 c->name, dn, fn);
        check_ref(fam, dt, lp.ngbias, lp.gbias, c->n, rgs, ags, what);
    }
    bool same_n =
        lp.ny == wide.ny && lp.nga == wide.nga && lp.ngb == wide.ngb && lp.ngbias == wide.ngbias;
    snprintf(what, sizeof what, "%s %s %s: native output and gradients %s the widened ones",
             c->name, dn, fn, fam == FAM_EXACT ? "are bitwise" : "are within 1e-2 of");
    if (!same_n) {
        tap_ok(0, "%s (sizes differ)", what);
    } else {
        double lpall[4 * MAXE], wall[4 * MAXE], aall[4 * MAXE];
        int64_t n = 0;
        const double *lps[4] = {lp.y, lp.ga, lp.gb, lp.gbias},
                     *ws[4] = {wide.y, wide.ga, wide.gb, wide.gbias}, *as[4] = {ay, aga, agb, ags};
        const int64_t ns[4] = {lp.ny, lp.nga, lp.ngb, lp.ngbias};
        for (int i = 0; i < 4; i++) {
            memcpy(lpall + n, lps[i], sizeof(double) * (size_t)ns[i]);
            memcpy(wall + n, ws[i], sizeof(double) * (size_t)ns[i]);
            memcpy(aall + n, as[i], sizeof(double) * (size_t)ns[i]);
            n += ns[i];
        }
        check_pair(fam, n, lpall, wall, aall, what);
    }
    /* The widening device gives the bits of widening by hand: the behaviour before. */
    bool same = wide.ny == hand.ny && wide.nga == hand.nga && wide.ngb == hand.ngb &&
                wide.ngbias == hand.ngbias &&
                memcmp(wide.y, hand.y, sizeof(double) * (size_t)wide.ny) == 0 &&
                memcmp(wide.ga, hand.ga, sizeof(double) * (size_t)wide.nga) == 0 &&
                memcmp(wide.gb, hand.gb, sizeof(double) * (size_t)wide.ngb) == 0 &&
                memcmp(wide.gbias, hand.gbias, sizeof(double) * (size_t)wide.ngbias) == 0;
    tap_ok(same, "%s %s %s: WIDE's output and gradients are bitwise those of widening by hand",
           c->name, dn, fn);
}

/* ---- a chain: the inner linear's gradient arrives in f32 -------------------------------- */

/* y2 = linear(linear(x, w1, b1), w2): the outer backward gives the inner one an f32 gradient,
 * which the native path rounds to the operands' dtype (the bias gradient sums it as it came). */
static void test_chain(fsdp_dtype_t dt) {
    const char *dn = fsdp_dtype_name(dt);
    const int64_t xs[2] = {6, 5}, w1s[2] = {4, 5}, w2s[2] = {3, 4}, ys[2] = {6, 3};
    double res[2][3][MAXE], xv[MAXE], w1v[MAXE], b1v[MAXE], w2v[MAXE], gyv[MAXE];
    int64_t n[2][3];
    int calls[2] = {0, 0}, widen[2] = {0, 0}, lp_f32_inner[2] = {0, 0};
    int devs_used[2] = {DEV_LP, DEV_WIDE};
    int rc = 0;
    for (int v = 0; v < 2; v++) {
        fsdp_ctx_set_device(ctx, devs[devs_used[v]]);
        fsdp_tensor_t *x = leaf(dt, 2, xs, FAM_RANDOM, 3, true, xv);
        fsdp_tensor_t *w1 = leaf(dt, 2, w1s, FAM_RANDOM, 5, true, w1v);
        fsdp_tensor_t *b1 = leaf(dt, 1, &w1s[0], FAM_RANDOM, 7, true, b1v);
        fsdp_tensor_t *w2 = leaf(dt, 2, w2s, FAM_RANDOM, 9, false, w2v);
        fsdp_tensor_t *gy = leaf(dt, 2, ys, FAM_RANDOM, 13, false, gyv);
        fsdp_tensor_t *y1 = NULL, *y2 = NULL;
        rc = fsdp_linear(x, w1, b1, &y1);
        if (rc == 0) rc = fsdp_linear(y1, w2, NULL, &y2);
        rec_reset();
        if (rc == 0) rc = fsdp_backward(y2, gy);
        calls[v] = rec.ncalls;
        widen[v] = rec.nwiden;
        for (int i = 0; i < rec.ncalls && i < MAXCALLS; i++)
            if (rec.calls[i].lp && rec.calls[i].dt == dt && rec.calls[i].ct == FSDP_DTYPE_F32)
                lp_f32_inner[v]++;
        n[v][0] = host(fsdp_tensor_grad(x), res[v][0]);
        n[v][1] = host(fsdp_tensor_grad(w1), res[v][1]);
        n[v][2] = host(fsdp_tensor_grad(b1), res[v][2]);
        if (rc < 0) tap_diag("chain on %s: %s", dev_names[devs_used[v]], fsdp_ctx_last_error(ctx));
        fsdp_tensor_t *all[] = {y2, y1, gy, w2, b1, w1, x};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            fsdp_tensor_release(all[i]);
        fsdp_tape_clear(ctx);
        fsdp_ctx_set_device(ctx, NULL);
    }
    /* Backward on LP: the outer gx, then the inner gx, gw and (the f32 gradient arriving) a
     * reduction for the bias: three gemm_lp calls into f32, no gemm, no widening cast. */
    tap_ok(rc == 0 && calls[0] == 3 && lp_f32_inner[0] == 3 && widen[0] == 0,
           "chain %s backward on LP: %d GEMM calls, %d of them gemm_lp of %s into f32 (want 3 "
           "and 3), %d widening casts",
           dn, calls[0], lp_f32_inner[0], dn, widen[0]);
    tap_ok(calls[1] == 3 && lp_f32_inner[1] == 0 && widen[1] > 0,
           "chain %s backward on WIDE: %d f32 GEMMs, %d widening casts", dn, calls[1], widen[1]);
    /* Reference: g1 = gy w2 (rows, 4) in double; gx = g1 w1, gw1 = g1^T x, gb1 = rows of g1. */
    double g1[MAXE], ag1[MAXE], rgx[MAXE], agx[MAXE], rgw[MAXE], agw[MAXE], rgb[MAXE], agb[MAXE];
    ref_mm(gyv, false, 0, w2v, false, 0, 1, 6, 4, 3, false, g1, ag1);
    ref_mm(g1, false, 0, w1v, false, 0, 1, 6, 5, 4, false, rgx, agx);
    ref_mm(g1, true, 0, xv, false, 0, 1, 4, 5, 6, false, rgw, agw);
    for (int j = 0; j < 4; j++) {
        rgb[j] = agb[j] = 0;
        for (int r = 0; r < 6; r++) {
            rgb[j] += g1[r * 4 + j];
            agb[j] += ag1[r * 4 + j];
        }
    }
    /* The terms' magnitudes go through g1's: scale the tolerance by |g1| sums. */
    double sgx[MAXE], sgw[MAXE];
    ref_mm(ag1, false, 0, w1v, false, 0, 1, 6, 5, 4, false, sgx, agx);
    ref_mm(ag1, true, 0, xv, false, 0, 1, 4, 5, 6, false, sgw, agw);
    for (int i = 0; i < 30; i++)
        agx[i] = fabs(sgx[i]) > agx[i] ? fabs(sgx[i]) : agx[i];
    for (int i = 0; i < 20; i++)
        agw[i] = fabs(sgw[i]) > agw[i] ? fabs(sgw[i]) : agw[i];
    const double *refs[3] = {rgx, rgw, rgb}, *abss[3] = {agx, agw, agb};
    const int64_t nn[3] = {30, 20, 4};
    const char *names[3] = {"x", "w1", "b1"};
    for (int i = 0; i < 3; i++) {
        char what[160];
        snprintf(what, sizeof what, "chain %s: native grad of %s within 1e-2 of the reference", dn,
                 names[i]);
        check_ref(FAM_RANDOM, dt, n[0][i], res[0][i], nn[i], refs[i], abss[i], what);
        snprintf(what, sizeof what, "chain %s: native grad of %s within 1e-2 of the widened one",
                 dn, names[i]);
        if (n[0][i] != n[1][i])
            tap_ok(0, "%s (sizes differ)", what);
        else
            check_pair(FAM_RANDOM, n[0][i], res[0][i], res[1][i], abss[i], what);
    }
}

/* ---- a device that claims bf16 only ------------------------------------------------------- */

static void test_partial_claim(void) {
    tap_ok(native(DEV_LPBF, FSDP_DTYPE_BF16) && !native(DEV_LPBF, FSDP_DTYPE_F16) &&
               native(DEV_LP, FSDP_DTYPE_F16) && !native(DEV_WIDE, FSDP_DTYPE_BF16) &&
               !native(DEV_LP, FSDP_DTYPE_F32) && !native(DEV_LP, FSDP_DTYPE_F64),
           "fsdp__device_gemm_native follows each device's claim, and only for bf16/f16");
    fsdp_device_t *cpu = NULL;
    fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &cpu);
    tap_ok(cpu && !fsdp__device_gemm_native(cpu, FSDP_DTYPE_BF16) &&
               !fsdp__device_gemm_native(cpu, FSDP_DTYPE_F16),
           "the CPU device multiplies neither bf16 nor f16 natively (its BLAS has no sbgemm)");
    fsdp_device_destroy(cpu);
    for (int dti = 0; dti < 2; dti++) {
        fsdp_dtype_t dt = dti ? FSDP_DTYPE_F16 : FSDP_DTYPE_BF16;
        static struct mm_out o;
        const struct mm_case c = {"linear", true, true,  0,     0,     2,    3,
                                  4,        5,    false, false, false, false};
        int rc = run_case(&c, dt, DEV_LPBF, FAM_EXACT, false, &o);
        int lp = 0;
        for (int i = 0; i < o.nfwd; i++)
            lp += o.fwd[i].lp;
        for (int i = 0; i < o.nbwd; i++)
            lp += o.bwd[i].lp;
        if (dt == FSDP_DTYPE_BF16)
            tap_ok(rc == 0 && lp == o.nfwd + o.nbwd && o.widen_fwd + o.widen_bwd == 0,
                   "LPBF: bf16 linear takes gemm_lp for all %d products, no widening",
                   o.nfwd + o.nbwd);
        else
            tap_ok(rc == 0 && lp == 0 && o.widen_fwd > 0,
                   "LPBF: f16 linear widens (%d gemm_lp calls, %d widening casts forward)", lp,
                   o.widen_fwd);
    }
}

int main(void) {
    tap_plan_lazy();
    fsdp_ctx_options_t opts;
    fsdp_ctx_options_init(&opts);
    if (fsdp_ctx_create(&opts, &ctx) < 0) tap_bail("cannot create a context");
    make_devices();

    /* name, linear, bias, and, bnd, batch, m, n, k, ta, tb, a_shared, b_shared */
    const struct mm_case cases[] = {
        {"linear with bias", true, true, 0, 0, 2, 3, 4, 5, false, false, false, false},
        {"linear without bias", true, false, 0, 0, 2, 3, 4, 5, false, false, false, false},
        {"matmul NN", false, false, 2, 2, 1, 3, 5, 4, false, false, false, false},
        {"matmul TN", false, false, 2, 2, 1, 3, 5, 4, true, false, false, false},
        {"matmul NT", false, false, 2, 2, 1, 3, 5, 4, false, true, false, false},
        {"matmul TT", false, false, 2, 2, 1, 3, 5, 4, true, true, false, false},
        {"bmm 3-d x 3-d", false, false, 3, 3, 2, 3, 5, 4, false, false, false, false},
        {"bmm 3-d x 3-d, b transposed", false, false, 3, 3, 2, 3, 5, 4, false, true, false, false},
        {"matmul 3-d x 2-d (folded)", false, false, 3, 2, 2, 3, 5, 4, false, false, false, true},
        {"matmul 2-d x 3-d (a shared)", false, false, 2, 3, 2, 3, 5, 4, false, false, true, false},
    };
    const fsdp_dtype_t dts[2] = {FSDP_DTYPE_BF16, FSDP_DTYPE_F16};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        for (int d = 0; d < 2; d++)
            for (int fam = 0; fam < 2; fam++)
                test_case(&cases[i], dts[d], fam);
    for (int d = 0; d < 2; d++)
        test_chain(dts[d]);
    test_partial_claim();

    for (int d = 0; d < NDEV; d++)
        fsdp_device_destroy(devs[d]);
    fsdp_ctx_destroy(ctx);
    return tap_done();
}
