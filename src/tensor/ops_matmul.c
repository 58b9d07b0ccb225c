/* SPDX-License-Identifier: MIT */
/*
 * ops_matmul.c: matrix products (fsdp_matmul, fsdp_linear) and their gradients.
 *
 * Every product goes to the device's strided batched GEMM. An operand is passed as it is stored
 * whenever its last two dimensions form a plain row-major matrix or the transpose of one (the
 * GEMM's transpose flag and leading dimension absorb the view) and its batch dimensions step by
 * one stride; only other layouts are materialized.
 * When the second operand has no batch dimensions, the first operand's batch and row dimensions
 * are folded into one tall matrix, so n-d x 2-d is a single GEMM forward and backward (the
 * weight gradient sums over every row inside that GEMM).
 *
 * f16/bf16 operands go to the device's gemm_lp as they are stored when the device multiplies
 * that dtype natively (fsdp__device_gemm_native: the CUDA device), with f32 accumulation: the
 * forward output is written in the operands' dtype, rounded once; the gradients are written in
 * f32 as always, the incoming gradient being brought to the operands' dtype first (a bias
 * gradient sums the incoming gradient as it arrived). On other devices (the CPU) such operands
 * are widened to f32 copies for gemm and the output rounded afterwards, which rounds the same
 * f32-accumulated value once; only the order of the additions may differ between the two.
 *
 * Outputs and gradients are new contiguous tensors. Those without a bias start as zeros
 * (fsdp__tensor_new_zeroed, which costs nothing for memory the device has just mapped) and the
 * GEMM runs with beta = 1: the bits of beta = 0, whose separate pass clearing C OpenBLAS would
 * otherwise run over every output. Backward saves the inputs as given (views,
 * no copies), which is what lets FSDP free and re-gather a parameter between forward and
 * backward.
 */
#include <stdio.h>

#include "autograd/autograd_impl.h"
#include "tensor/tensor_impl.h"

/* One GEMM operand: the logical matrix (rows x cols) of each batch entry is op(stored). */
struct mm_arg {
    fsdp_tensor_t *own; /* a converted or materialized copy held by the plan, else NULL */
    const char *p;      /* first element */
    bool trans;         /* stored as the transpose of the logical matrix */
    int64_t ld;         /* row stride of the stored matrix */
    int64_t bstride;    /* elements between batch entries; 0 when shared by every entry */
};

/* How a product C (batch, m, n) = A (batch, m, k) B (batch, k, n) maps onto the GEMM. */
struct mm_plan {
    fsdp_dtype_t cdt; /* compute dtype: the gradients' */
    fsdp_dtype_t odt; /* the operands' dtype as the GEMM takes them (mm_operand_dt) */
    int64_t batch, m, n, k;
    bool a_shared, b_shared; /* operand without batch dimensions used by every batch entry */
    struct mm_arg a, b;
    int ndim; /* output geometry */
    int64_t shape[FSDP_MAX_DIMS];
};

static void mm_plan_fini(struct mm_plan *pl) {
    fsdp_tensor_release(pl->a.own);
    fsdp_tensor_release(pl->b.own);
    pl->a.own = pl->b.own = NULL;
}

/* The dtype in which operands of dtype dt reach dev's GEMM: dt itself when the device multiplies
 * it natively (gemm_lp), else the compute dtype (f16/bf16 widened to f32). */
static fsdp_dtype_t mm_operand_dt(const fsdp_device_t *dev, fsdp_dtype_t dt) {
    return fsdp__device_gemm_native(dev, dt) ? dt : (fsdp_dtype_t)fsdp__compute_dtype(dt);
}

/* Whether the n dimensions (shape, stride) enumerate their elements in row-major order at one
 * fixed step; size-1 dimensions never move and are ignored. */
static bool collapse(int n, const int64_t *shape, const int64_t *stride, int64_t *count,
                     int64_t *step) {
    int64_t cnt = 1, st = 0;
    bool have = false, ok = true;
    for (int i = n - 1; i >= 0; i--) {
        if (shape[i] == 1) continue;
        if (!have) {
            st = stride[i];
            have = true;
        } else if (stride[i] != st * cnt) {
            ok = false;
        }
        cnt *= shape[i];
    }
    *count = cnt;
    *step = st;
    return ok || cnt == 0;
}

/* Whether a (r x c) matrix with element strides (sr, sc) is a plain row-major matrix or the
 * transpose of one, as BLAS needs (leading dimension >= the stored row length). */
static bool mat_layout(int64_t r, int64_t c, int64_t sr, int64_t sc, bool *trans, int64_t *ld) {
    int64_t r1 = FSDP_MAX(r, 1), c1 = FSDP_MAX(c, 1);
    if ((c <= 1 || sc == 1) && (r <= 1 || sr >= c1)) {
        *trans = false;
        *ld = r <= 1 ? c1 : sr;
        return true;
    }
    if ((r <= 1 || sr == 1) && (c <= 1 || sc >= r1)) {
        *trans = true;
        *ld = c <= 1 ? r1 : sc;
        return true;
    }
    return false;
}

/* The logical 2-d geometry of a matmul operand: a 1-d `a` is a row (1, k), a 1-d `b` a column
 * (k, 1); the last two dimensions otherwise. Returns the number of batch dimensions. */
static int mat_dims(const fsdp_tensor_t *t, bool is_a, int64_t *rows, int64_t *cols, int64_t *srow,
                    int64_t *scol) {
    if (t->ndim == 1) {
        *rows = is_a ? 1 : t->shape[0];
        *cols = is_a ? t->shape[0] : 1;
        *srow = is_a ? 0 : t->stride[0];
        *scol = is_a ? t->stride[0] : 0;
        return 0;
    }
    *rows = t->shape[t->ndim - 2];
    *cols = t->shape[t->ndim - 1];
    *srow = t->stride[t->ndim - 2];
    *scol = t->stride[t->ndim - 1];
    return t->ndim - 2;
}

/* Describes t as a batched operand (per-entry matrix plus batch stride), or as one tall matrix
 * when fold is set (batch and row dimensions together). False when the layout does not fit. */
static bool describe(const fsdp_tensor_t *t, bool is_a, bool fold, struct mm_arg *arg) {
    int64_t r, c, sr, sc, nb, sb;
    int nbat = mat_dims(t, is_a, &r, &c, &sr, &sc);
    arg->p = fsdp_tensor_data(t);
    if (fold) {
        /* Rows of every batch entry as one matrix: the rows must step by one stride. */
        if (t->ndim >= 2 && !collapse(nbat + 1, t->shape, t->stride, &r, &sr)) return false;
        arg->bstride = 0;
        return mat_layout(r, c, sr, sc, &arg->trans, &arg->ld);
    }
    if (nbat == 0) {
        sb = 0;
    } else if (!collapse(nbat, t->shape, t->stride, &nb, &sb)) {
        return false;
    }
    arg->bstride = sb;
    return mat_layout(r, c, sr, sc, &arg->trans, &arg->ld);
}

/* Describes t, materializing a contiguous copy of dtype odt (the GEMM's operand dtype) when its
 * dtype or layout does not fit the GEMM as it is. */
static int prepare_arg(fsdp_tensor_t *t, fsdp_dtype_t odt, bool is_a, bool fold,
                       struct mm_arg *arg) {
    int rc = 0;
    arg->own = NULL;
    if (t->dt == odt && describe(t, is_a, fold, arg)) return 0;
    FSDP_TRY(rc, fail, fsdp__as_contig(t, odt, &arg->own));
    if (!describe(arg->own, is_a, fold, arg))
        return fsdp__op_err(t, FSDP_EINTERNAL, "matmul", "contiguous operand has no GEMM layout");
    return 0;
fail:
    return rc;
}

/* Validates a and b for matmul and works out the product's geometry and operands. */
static int mm_prepare(fsdp_tensor_t *a, fsdp_tensor_t *b, struct mm_plan *pl) {
    int rc = 0;
    char da[96], db[96];
    pl->a.own = pl->b.own = NULL;
    if (a->ndim < 1 || b->ndim < 1) {
        return fsdp__op_err(
            a, FSDP_EINVAL, "matmul", "a %s and b %s: operands need at least 1 dimension",
            fsdp_tensor_describe(a, da, sizeof da), fsdp_tensor_describe(b, db, sizeof db));
    }
    /* PyTorch's wording, which callers (and the mixed-precision tests) match: a half activation
     * reaching a full-precision weight is an error, never an implicit cast. */
    if (a->dt != b->dt) {
        return fsdp__op_err(a, FSDP_EINVAL, "matmul",
                            "a %s and b %s: mat1 and mat2 must have the same dtype, but got %s "
                            "and %s",
                            fsdp_tensor_describe(a, da, sizeof da),
                            fsdp_tensor_describe(b, db, sizeof db), fsdp_dtype_name(a->dt),
                            fsdp_dtype_name(b->dt));
    }
    int64_t ar, ac, br, bc, s0, s1;
    int abat = mat_dims(a, true, &ar, &ac, &s0, &s1);
    int bbat = mat_dims(b, false, &br, &bc, &s0, &s1);
    if (ac != br) {
        return fsdp__op_err(a, FSDP_EINVAL, "matmul",
                            "a %s and b %s: inner dimensions differ (%lld vs %lld)",
                            fsdp_tensor_describe(a, da, sizeof da),
                            fsdp_tensor_describe(b, db, sizeof db), (long long)ac, (long long)br);
    }
    bool bad = abat > 0 && bbat > 0 && abat != bbat;
    for (int i = 0; !bad && abat > 0 && bbat > 0 && i < abat; i++)
        bad = a->shape[i] != b->shape[i];
    if (bad) {
        return fsdp__op_err(a, FSDP_EINVAL, "matmul",
                            "a %s and b %s: batch dimensions differ (broadcasting them is not "
                            "supported)",
                            fsdp_tensor_describe(a, da, sizeof da),
                            fsdp_tensor_describe(b, db, sizeof db));
    }
    /* Output shape: batch dimensions, then m unless a is 1-d, then n unless b is 1-d. */
    const fsdp_tensor_t *bt = abat > 0 ? a : b;
    int nbat = FSDP_MAX(abat, bbat);
    pl->ndim = 0;
    pl->batch = 1;
    for (int i = 0; i < nbat; i++) {
        pl->shape[pl->ndim++] = bt->shape[i];
        pl->batch *= bt->shape[i];
    }
    if (a->ndim > 1) pl->shape[pl->ndim++] = ar;
    if (b->ndim > 1) pl->shape[pl->ndim++] = bc;
    pl->cdt = (fsdp_dtype_t)fsdp__compute_dtype(a->dt);
    pl->odt = mm_operand_dt(a->dev, a->dt);
    pl->m = ar;
    pl->n = bc;
    pl->k = ac;
    pl->a_shared = abat == 0 && nbat > 0;
    pl->b_shared = bbat == 0 && nbat > 0;

    if (bbat == 0) {
        /* n-d x 2-d: one tall GEMM when a's rows step uniformly; else batched with b shared;
         * else a contiguous copy of a, which always folds. */
        if (a->dt == pl->odt && describe(a, true, true, &pl->a)) {
            pl->m = pl->batch * ar;
            pl->batch = 1;
            pl->b_shared = false;
        } else if (!(a->dt == pl->odt && describe(a, true, false, &pl->a))) {
            FSDP_TRY(rc, fail, prepare_arg(a, pl->odt, true, true, &pl->a));
            pl->m = pl->batch * ar;
            pl->batch = 1;
            pl->b_shared = false;
        }
    } else {
        FSDP_TRY(rc, fail, prepare_arg(a, pl->odt, true, false, &pl->a));
    }
    FSDP_TRY(rc, fail, prepare_arg(b, pl->odt, false, false, &pl->b));
    return 0;
fail:
    mm_plan_fini(pl);
    return rc;
}

/* One call of dev's GEMM with operands of dtype odt and C of dtype ct: gemm when both are the
 * same f32/f64, gemm_lp for f16/bf16 operands (which mm_operand_dt chose only for a device that
 * has it). */
static int gemm_call(fsdp_device_t *dev, fsdp_dtype_t odt, fsdp_dtype_t ct, bool ta, bool tb,
                     int64_t m, int64_t n, int64_t k, const void *a, int64_t lda, int64_t sa,
                     const void *b, int64_t ldb, int64_t sb, double beta, void *c, int64_t sc,
                     int64_t batch) {
    if (odt == FSDP_DTYPE_F32 || odt == FSDP_DTYPE_F64)
        return dev->ops->gemm(dev, odt, ta, tb, m, n, k, 1.0, a, lda, sa, b, ldb, sb, beta, c, n,
                              sc, batch);
    return dev->ops->gemm_lp(dev, odt, ct, ta, tb, m, n, k, 1.0, a, lda, sa, b, ldb, sb, beta, c, n,
                             sc, batch);
}

/* C (batch, m, n, contiguous, dtype ct) = x (m, k) y (k, n) + beta C for every batch entry, the
 * operands of dtype odt. When `sum`, C is one (m, n) matrix receiving the sum over the batch (the
 * gradient of a shared operand), accumulated in C. */
static int mm_gemm(fsdp_device_t *dev, fsdp_dtype_t odt, fsdp_dtype_t ct, int64_t batch, int64_t m,
                   int64_t n, int64_t k, const struct mm_arg *x, const struct mm_arg *y,
                   double beta, bool sum, void *c) {
    int64_t cn = sum ? 1 : batch;
    if (m == 0 || n == 0 || cn == 0) return 0;
    if (k == 0 || batch == 0)
        return beta == 0 ? dev->ops->fill(dev, ct, (size_t)(cn * m * n), 0.0, c) : 0;
    if (!sum || batch == 1) {
        return gemm_call(dev, odt, ct, x->trans, y->trans, m, n, k, x->p, x->ld, x->bstride, y->p,
                         y->ld, y->bstride, beta, c, m * n, batch);
    }
    /* Accumulating over the batch: GEMMs into the same C, the first one overwriting. */
    size_t es = fsdp_dtype_size(odt);
    for (int64_t i = 0; i < batch; i++) {
        int rc = gemm_call(
            dev, odt, ct, x->trans, y->trans, m, n, k, x->p + (size_t)(i * x->bstride) * es, x->ld,
            0, y->p + (size_t)(i * y->bstride) * es, y->ld, 0, i == 0 ? beta : 1.0, c, 0, 1);
        if (rc < 0) return rc;
    }
    return 0;
}

/* The logical transpose of an operand: same storage, the other flag. */
static struct mm_arg mm_t(struct mm_arg x) {
    x.trans = !x.trans;
    return x;
}

/* A contiguous (batch, rows, cols) matrix as an operand. */
static struct mm_arg mm_plain(const fsdp_tensor_t *t, int64_t rows, int64_t cols) {
    struct mm_arg x = {NULL, fsdp_tensor_data(t), false, FSDP_MAX(cols, 1), rows * cols};
    return x;
}

/* ---- matmul ---- */

static int matmul_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                           fsdp_tensor_t **gin) {
    fsdp_tensor_t *a = node->saved[0], *b = node->saved[1], *gy = NULL;
    fsdp_ctx_t *ctx = a->ctx;
    struct mm_plan pl;
    int rc = 0;
    FSDP_TRY(rc, fail0, mm_prepare(a, b, &pl));
    /* The incoming gradient joins the operands in the GEMM's operand dtype; the gradients are
     * written in the compute dtype. */
    FSDP_TRY(rc, fail, fsdp__as_contig(gout[0], pl.odt, &gy));
    struct mm_arg g = mm_plain(gy, pl.m, pl.n);
    if (node->needs[0]) {
        /* ga = gy b^T, summed over the batch when a was shared. */
        FSDP_TRY(rc, fail,
                 fsdp__tensor_new_zeroed(ctx, a->dev, pl.cdt, a->ndim, a->shape, fsdp__op_cat(ctx),
                                         &gin[0]));
        struct mm_arg bt = mm_t(pl.b);
        FSDP_TRY(rc, fail,
                 mm_gemm(a->dev, pl.odt, pl.cdt, pl.batch, pl.m, pl.k, pl.n, &g, &bt, 1.0,
                         pl.a_shared, fsdp_tensor_data(gin[0])));
    }
    if (node->needs[1]) {
        /* gb = a^T gy; in the folded case one GEMM sums over every row. */
        FSDP_TRY(rc, fail,
                 fsdp__tensor_new_zeroed(ctx, b->dev, pl.cdt, b->ndim, b->shape, fsdp__op_cat(ctx),
                                         &gin[1]));
        struct mm_arg at = mm_t(pl.a);
        FSDP_TRY(rc, fail,
                 mm_gemm(b->dev, pl.odt, pl.cdt, pl.batch, pl.k, pl.n, pl.m, &at, &g, 1.0,
                         pl.b_shared, fsdp_tensor_data(gin[1])));
    }
    fsdp_tensor_release(gy);
    mm_plan_fini(&pl);
    return 0;
fail:
    fsdp_tensor_release(gy);
    mm_plan_fini(&pl);
fail0:
    for (int i = 0; i < 2; i++) {
        fsdp_tensor_release(gin[i]);
        gin[i] = NULL;
    }
    return rc;
}

static const struct fsdp__op_def def_matmul = {"matmul", matmul_backward};

int fsdp_matmul(fsdp_tensor_t *a, fsdp_tensor_t *b, fsdp_tensor_t **out) {
    fsdp_tensor_t *y = NULL;
    struct mm_plan pl;
    struct fsdp__node *node = NULL;
    int rc = 0;
    if (out) *out = NULL;
    FSDP_TRY(rc, fail0, fsdp__check_float(NULL, a, "matmul", "a"));
    FSDP_TRY(rc, fail0, fsdp__check_float(a->ctx, b, "matmul", "b"));
    FSDP_TRY(rc, fail0, fsdp__check_same_device(a, b, "matmul"));
    if (!out) return fsdp__op_err(a, FSDP_EINVAL, "matmul", "out is NULL");
    FSDP_TRY(rc, fail0, mm_prepare(a, b, &pl));
    /* The product is written in the operands' dtype: a's own when the device multiplies it
     * natively, else the compute dtype, rounded to a's dtype below. */
    FSDP_TRY(rc, fail,
             fsdp__tensor_new_zeroed(a->ctx, a->dev, pl.odt, pl.ndim, pl.shape,
                                     fsdp__op_cat(a->ctx), &y));
    FSDP_TRY(rc, fail,
             mm_gemm(a->dev, pl.odt, pl.odt, pl.batch, pl.m, pl.n, pl.k, &pl.a, &pl.b, 1.0, false,
                     fsdp_tensor_data(y)));
    mm_plan_fini(&pl);
    FSDP_TRY(rc, fail0, fsdp__round_to(&y, a->dt));
    FSDP_TRY(rc, fail0, fsdp__record(&def_matmul, 2, (fsdp_tensor_t *[]){a, b}, 1, &y, &node));
    if (node) {
        FSDP_TRY(rc, fail0, fsdp__node_save(node, a));
        FSDP_TRY(rc, fail0, fsdp__node_save(node, b));
    }
    *out = y;
    return 0;
fail:
    mm_plan_fini(&pl);
fail0:
    fsdp_tensor_release(y);
    return rc;
}

/* ---- linear ---- */

/* x (..., in) as one (rows, in) operand, materialized when its rows do not step uniformly. */
static int linear_x(fsdp_tensor_t *x, fsdp_dtype_t odt, int64_t *rows, struct mm_arg *arg) {
    int64_t r = 1;
    for (int i = 0; i < x->ndim - 1; i++)
        r *= x->shape[i];
    *rows = r;
    return prepare_arg(x, odt, true, true, arg);
}

static int linear_backward(struct fsdp__node *node, fsdp_tensor_t *const *gout,
                           fsdp_tensor_t **gin) {
    fsdp_tensor_t *x = node->saved[0], *w = node->saved[1], *gy = NULL, *gyc = NULL, *ones = NULL;
    fsdp_ctx_t *ctx = x->ctx;
    fsdp_dtype_t cdt = (fsdp_dtype_t)fsdp__compute_dtype(x->dt);
    fsdp_mem_cat_t cat = fsdp__op_cat(ctx);
    fsdp_device_t *dev = x->dev;
    fsdp_dtype_t odt = mm_operand_dt(dev, x->dt);
    struct mm_arg xa = {0}, wa = {0};
    int64_t rows = 1, nout = w->shape[0], nin = w->shape[1];
    int rc = 0;
    for (int i = 0; i < x->ndim - 1; i++)
        rows *= x->shape[i];
    /* gy in the GEMM's operand dtype; gx and gw are written in the compute dtype. */
    FSDP_TRY(rc, fail, fsdp__as_contig(gout[0], odt, &gy));
    struct mm_arg g = mm_plain(gy, rows, nout);
    if (node->needs[0]) {
        /* gx (rows, in) = gy (rows, out) w (out, in). */
        FSDP_TRY(rc, fail, prepare_arg(w, odt, true, false, &wa));
        FSDP_TRY(rc, fail, fsdp__tensor_new_zeroed(ctx, dev, cdt, x->ndim, x->shape, cat, &gin[0]));
        FSDP_TRY(rc, fail,
                 mm_gemm(dev, odt, cdt, 1, rows, nin, nout, &g, &wa, 1.0, false,
                         fsdp_tensor_data(gin[0])));
    }
    if (node->needs[1]) {
        /* gw (out, in) = gy^T (out, rows) x (rows, in): every row in one GEMM. */
        FSDP_TRY(rc, fail, linear_x(x, odt, &rows, &xa));
        FSDP_TRY(rc, fail, fsdp__tensor_new_zeroed(ctx, dev, cdt, 2, w->shape, cat, &gin[1]));
        struct mm_arg gt = mm_t(g);
        FSDP_TRY(rc, fail,
                 mm_gemm(dev, odt, cdt, 1, nout, nin, rows, &gt, &xa, 1.0, false,
                         fsdp_tensor_data(gin[1])));
    }
    if (node->nin > 2 && node->needs[2]) {
        /* gb = sum of the rows of the gradient as it arrived, in the compute dtype. */
        FSDP_TRY(rc, fail, fsdp__tensor_new(ctx, dev, cdt, 1, &nout, cat, &gin[2]));
        if (rows == 0 && nout > 0) {
            FSDP_TRY(rc, fail,
                     dev->ops->fill(dev, cdt, (size_t)nout, 0.0, fsdp_tensor_data(gin[2])));
        } else if (nout > 0 && (odt == cdt || gout[0]->dt == cdt)) {
            const fsdp_tensor_t *gs = gy;
            if (odt != cdt) {
                FSDP_TRY(rc, fail, fsdp__as_contig(gout[0], cdt, &gyc));
                gs = gyc;
            }
            FSDP_TRY(rc, fail,
                     dev->ops->reduce_sum(dev, cdt, 1, (size_t)rows, (size_t)nout, 1.0,
                                          fsdp_tensor_data(gs), fsdp_tensor_data(gin[2])));
        } else if (nout > 0) {
            /* A low-precision gy the device multiplies natively: gb (1, out) = ones (1, rows)
             * gy (rows, out), summed in f32 by the GEMM instead of a widened copy of gy. */
            FSDP_TRY(rc, fail, fsdp__tensor_new(ctx, dev, odt, 1, &rows, cat, &ones));
            FSDP_TRY(rc, fail, dev->ops->fill(dev, odt, (size_t)rows, 1.0, fsdp_tensor_data(ones)));
            struct mm_arg oa = mm_plain(ones, 1, rows);
            FSDP_TRY(rc, fail,
                     mm_gemm(dev, odt, cdt, 1, 1, nout, rows, &oa, &g, 0.0, false,
                             fsdp_tensor_data(gin[2])));
        }
    }
    fsdp_tensor_release(xa.own);
    fsdp_tensor_release(wa.own);
    fsdp_tensor_release(gy);
    fsdp_tensor_release(gyc);
    fsdp_tensor_release(ones);
    return 0;
fail:
    fsdp_tensor_release(xa.own);
    fsdp_tensor_release(wa.own);
    fsdp_tensor_release(gy);
    fsdp_tensor_release(gyc);
    fsdp_tensor_release(ones);
    for (int i = 0; i < node->nin; i++) {
        fsdp_tensor_release(gin[i]);
        gin[i] = NULL;
    }
    return rc;
}

static const struct fsdp__op_def def_linear = {"linear", linear_backward};

/* Shape checks of linear: x (..., in), w (out, in), b (out). */
static int linear_check(fsdp_tensor_t *x, fsdp_tensor_t *w, fsdp_tensor_t *b) {
    int rc = 0;
    char dx[96], dw[96], dbias[96];
    FSDP_TRY(rc, fail, fsdp__check_float(NULL, x, "linear", "x"));
    FSDP_TRY(rc, fail, fsdp__check_float(x->ctx, w, "linear", "w"));
    FSDP_TRY(rc, fail, fsdp__check_same_device(x, w, "linear"));
    if (b) {
        FSDP_TRY(rc, fail, fsdp__check_float(x->ctx, b, "linear", "b"));
        FSDP_TRY(rc, fail, fsdp__check_same_device(x, b, "linear"));
    }
    fsdp_tensor_describe(x, dx, sizeof dx);
    fsdp_tensor_describe(w, dw, sizeof dw);
    if (b)
        fsdp_tensor_describe(b, dbias, sizeof dbias);
    else
        snprintf(dbias, sizeof dbias, "none");
    if (x->ndim < 1 || w->ndim != 2 || x->shape[x->ndim - 1] != w->shape[1])
        return fsdp__op_err(x, FSDP_EINVAL, "linear",
                            "x %s and w %s: need x (..., in) and w (out, in)", dx, dw);
    if (b && (b->ndim != 1 || b->shape[0] != w->shape[0]))
        return fsdp__op_err(x, FSDP_EINVAL, "linear", "b %s must be (out) for w %s", dbias, dw);
    /* PyTorch's wording (see mm_prepare): x is mat1, w mat2, b the bias. */
    if (w->dt != x->dt)
        return fsdp__op_err(x, FSDP_EINVAL, "linear",
                            "x %s, w %s and b %s: mat1 and mat2 must have the same dtype, but got "
                            "%s and %s",
                            dx, dw, dbias, fsdp_dtype_name(x->dt), fsdp_dtype_name(w->dt));
    if (b && b->dt != x->dt)
        return fsdp__op_err(x, FSDP_EINVAL, "linear",
                            "x %s, w %s and b %s: the bias and mat1 must have the same dtype, but "
                            "got %s and %s",
                            dx, dw, dbias, fsdp_dtype_name(b->dt), fsdp_dtype_name(x->dt));
    return 0;
fail:
    return rc;
}

int fsdp_linear(fsdp_tensor_t *x, fsdp_tensor_t *w, fsdp_tensor_t *b, fsdp_tensor_t **out) {
    fsdp_tensor_t *y = NULL, *bc = NULL;
    struct mm_arg xa = {0}, wa = {0};
    struct fsdp__node *node = NULL;
    int rc = 0;
    if (out) *out = NULL;
    FSDP_TRY(rc, fail, linear_check(x, w, b));
    if (!out) return fsdp__op_err(x, FSDP_EINVAL, "linear", "out is NULL");
    fsdp_device_t *dev = x->dev;
    /* The operands' dtype as the GEMM takes them, which is also the output's until the final
     * rounding to x's dtype (a no-op when the device multiplies x's dtype natively). */
    fsdp_dtype_t odt = mm_operand_dt(dev, x->dt);
    int64_t rows, nout = w->shape[0], nin = w->shape[1];
    int64_t shape[FSDP_MAX_DIMS];
    for (int i = 0; i < x->ndim - 1; i++)
        shape[i] = x->shape[i];
    shape[x->ndim - 1] = nout;
    FSDP_TRY(rc, fail, linear_x(x, odt, &rows, &xa));
    FSDP_TRY(rc, fail, prepare_arg(w, odt, true, false, &wa));
    /* Without a bias the output starts as zeros (free for a new mapping, see
     * fsdp__tensor_new_zeroed) and the GEMM adds onto them, which gives the bits of beta = 0. */
    if (b)
        FSDP_TRY(rc, fail,
                 fsdp__tensor_new(x->ctx, dev, odt, x->ndim, shape, fsdp__op_cat(x->ctx), &y));
    else
        FSDP_TRY(
            rc, fail,
            fsdp__tensor_new_zeroed(x->ctx, dev, odt, x->ndim, shape, fsdp__op_cat(x->ctx), &y));
    if (b && rows > 0 && nout > 0) {
        /* Every row starts as the bias (a stride-0 read of b) and the GEMM adds onto it. */
        const fsdp_tensor_t *bs = b;
        if (b->dt != odt) {
            FSDP_TRY(rc, fail, fsdp__as_contig(b, odt, &bc));
            bs = bc;
        }
        FSDP_TRY(rc, fail,
                 dev->ops->copy_strided(dev, odt, 2, (const int64_t[]){rows, nout},
                                        fsdp_tensor_data(y), fsdp_tensor_data(bs),
                                        (const int64_t[]){0, bs->stride[0]}));
    }
    struct mm_arg wt = mm_t(wa);
    FSDP_TRY(rc, fail,
             mm_gemm(dev, odt, odt, 1, rows, nout, nin, &xa, &wt, 1.0, false, fsdp_tensor_data(y)));
    fsdp_tensor_release(bc);
    fsdp_tensor_release(xa.own);
    fsdp_tensor_release(wa.own);
    bc = xa.own = wa.own = NULL;
    FSDP_TRY(rc, fail, fsdp__round_to(&y, x->dt));
    FSDP_TRY(rc, fail,
             fsdp__record(&def_linear, b ? 3 : 2, (fsdp_tensor_t *[]){x, w, b}, 1, &y, &node));
    if (node) {
        FSDP_TRY(rc, fail, fsdp__node_save(node, x));
        FSDP_TRY(rc, fail, fsdp__node_save(node, w));
    }
    *out = y;
    return 0;
fail:
    fsdp_tensor_release(bc);
    fsdp_tensor_release(xa.own);
    fsdp_tensor_release(wa.own);
    fsdp_tensor_release(y);
    return rc;
}
