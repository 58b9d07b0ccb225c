/* SPDX-License-Identifier: MIT */
/*
 * mp_util.c: the mixed-precision test programs' shared models, reference and checks
 * (mp_util.h).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "models/models.h"
#include "mp_util.h"

/* ---- the model ------------------------------------------------------------------------------- */

/* Parameter `name` of m replaced by a copy in dt (a leaf that requires a gradient). */
int mpt_param_to(fsdp_module_t *m, const char *name, fsdp_dtype_t dt) {
    fsdp_tensor_t *t = fsdp_module_param(m, name), *c = NULL, *d = NULL;
    if (!t) return FSDP_EINVAL;
    if (fsdp_tensor_dtype(t) == dt) return FSDP_OK;
    int rc = fsdp_detach(t, &d); /* the copy is a leaf of its own */
    if (rc == 0) rc = fsdp_to_dtype(d, dt, &c);
    fsdp_tensor_release(d);
    if (rc == 0) rc = fsdp_tensor_set_requires_grad(c, true);
    if (rc == 0) rc = fsdp_module_set_param(m, name, c, false);
    fsdp_tensor_release(c);
    return rc;
}

/* Linear(D, D, no bias) with its weight in dt and an f64 buffer "buffer" (1, 2), as upstream's
 * LinearMixedPrecision; drawn after tm_manual_seed(ctx, seed). */
int mpt_lmp_create(fsdp_ctx_t *ctx, uint64_t seed, fsdp_dtype_t dt, fsdp_module_t **out) {
    tm_manual_seed(ctx, seed);
    fsdp_module_t *l = NULL;
    fsdp_tensor_t *b = NULL;
    const int64_t bs[2] = {1, 2};
    int rc = fsdp_linear_create(ctx, D, D, false, &l);
    if (rc == 0) rc = mpt_param_to(l, "weight", dt);
    if (rc == 0) rc = fsdp_tensor_empty(ctx, FSDP_DTYPE_F64, 2, bs, FSDP_MEM_OTHER, &b);
    if (rc == 0) rc = fsdp_tensor_normal_(b, 0.0, 1.0);
    if (rc == 0) rc = fsdp_module_add_buffer(l, "buffer", b, true);
    fsdp_tensor_release(b);
    if (rc < 0) {
        fsdp_module_release(l);
        l = NULL;
    }
    *out = l;
    return rc;
}

/* The simple model (one Linear) or the nested one (Sequential of two). */
int mpt_model_create(fsdp_ctx_t *ctx, bool nested, fsdp_dtype_t dt, fsdp_module_t **out) {
    *out = NULL;
    if (!nested) return mpt_lmp_create(ctx, 11, dt, out);
    fsdp_module_t *s = NULL, *l = NULL;
    int rc = fsdp_sequential_create(ctx, &s);
    for (int k = 0; k < 2 && rc == 0; k++) {
        rc = mpt_lmp_create(ctx, 11 + (uint64_t)k, dt, &l);
        if (rc == 0) rc = fsdp_module_append(s, l);
        fsdp_module_release(l);
        l = NULL;
    }
    if (rc < 0) {
        fsdp_module_release(s);
        s = NULL;
    }
    *out = s;
    return rc;
}

const char *const mpt_WNAME[2][NLIN_MAX] = {{"weight", NULL}, {"0.weight", "1.weight"}};

/* ---- helpers --------------------------------------------------------------------------------- */

/* max |a - e| / (rel * max |e| + abs) over n values (> 1: not close). */
double mpt_scaled_err(const double *a, const double *e, int64_t n, double rel, double abs_) {
    double mx = 0, err = 0;
    for (int64_t i = 0; i < n; i++)
        mx = fmax(mx, fabs(e[i]));
    for (int64_t i = 0; i < n; i++) {
        double d = fabs(a[i] - e[i]);
        if (isnan(d)) d = INFINITY;
        err = fmax(err, d);
    }
    return err / (rel * mx + abs_);
}

/* t's elements as doubles (n of them; t must have exactly n). */
int mpt_read_vals(const fsdp_tensor_t *t, double *v, int64_t n) {
    if (!t || fsdp_tensor_numel(t) != n) return FSDP_EINVAL;
    for (int64_t i = 0; i < n; i++) {
        int rc = fsdp_tensor_item(t, i, &v[i]);
        if (rc < 0) return rc;
    }
    return FSDP_OK;
}

/* x in dt (a new reference; the same tensor when it already is). */
int mpt_cast_to(fsdp_tensor_t *x, fsdp_dtype_t dt, fsdp_tensor_t **out) {
    if (fsdp_tensor_dtype(x) == dt) {
        *out = fsdp_tensor_retain(x);
        return FSDP_OK;
    }
    return fsdp_to_dtype(x, dt, out);
}

/* Whether every buffer of m has dtype dt; else the first offender in why. */
bool mpt_buffers_are(fsdp_module_t *m, fsdp_dtype_t dt, char *why, size_t len) {
    fsdp_named_list_t b = {0};
    if (fsdp_module_named_buffers(m, false, &b) < 0) {
        snprintf(why, len, "listing the buffers failed");
        return false;
    }
    bool ok = b.n > 0;
    if (!ok) snprintf(why, len, "no buffers");
    for (size_t i = 0; i < b.n && ok; i++)
        if (fsdp_tensor_dtype(b.tensors[i]) != dt) {
            snprintf(why, len, "buffer '%s' is %s", b.names[i],
                     fsdp_dtype_name(fsdp_tensor_dtype(b.tensors[i])));
            ok = false;
        }
    fsdp_named_list_free(&b);
    return ok;
}

/* Whether no unit of root's tree holds unsharded parameter bytes. */
bool mpt_none_unsharded_bytes(fsdp_unit_t *root, char *why, size_t len) {
    fsdp_unit_t **u = NULL;
    size_t n = 0;
    if (fsdp_units(root, &u, &n) < 0) return false;
    bool ok = true;
    for (size_t i = 0; i < n && ok; i++) {
        fsdp_tensor_t *full = fsdp_unit_full_param(u[i]);
        size_t bytes = full ? fsdp_tensor_storage_bytes(full) : 0;
        fsdp_flat_sizes_t fs;
        fsdp_unit_flat_sizes(u[i], &fs);
        /* NO_SHARD without mixed precision computes on the shard itself (no separate copy). */
        bool shares = fsdp_unit_strategy(u[i]) == FSDP_NO_SHARD && full &&
                      fsdp_tensor_same_storage(full, fsdp_unit_flat_param(u[i]));
        if (bytes != 0 && !shares) {
            snprintf(why, len, "unit '%s' holds %zu bytes of unsharded %s parameters",
                     fsdp_unit_fqn(u[i]), bytes, fsdp_dtype_name(fsdp_tensor_dtype(full)));
            ok = false;
        }
    }
    free(u);
    return ok;
}

/* Sum over root's units of their padded flat numel. */
int64_t mpt_total_padded(fsdp_unit_t *root) {
    fsdp_unit_t **u = NULL;
    size_t n = 0;
    int64_t t = 0;
    if (fsdp_units(root, &u, &n) < 0) return -1;
    for (size_t i = 0; i < n; i++) {
        fsdp_flat_sizes_t fs;
        fsdp_unit_flat_sizes(u[i], &fs);
        t += fs.padded_numel;
    }
    free(u);
    return t;
}

/* "<phase>: <what>" in buf (a check's name). */
const char *mpt_nm(char *buf, size_t len, const char *ph, const char *what) {
    snprintf(buf, len, "%s: %s", ph, what);
    return buf;
}

/* Summons root with its gradients (use_orig_params) and compares every gradient of m with
 * `times` x the twin's under the same name (the twin is a local model); *worst receives the
 * largest mpt_scaled_err(rel, abs_) (INFINITY when a gradient is missing, named in why). Returns a
 * library error, else 0. */
int mpt_grads_vs_twin(fsdp_unit_t *root, fsdp_module_t *m, fsdp_module_t *twin, double times,
                      double rel, double abs_, double *worst, char *why, size_t len) {
    fsdp_summon_options_t so;
    fsdp_summon_options_init(&so);
    so.writeback = false;
    so.with_grads = true;
    fsdp_named_list_t tp = {0};
    *worst = 0;
    int rc = fsdp_summon_begin(root, &so);
    if (rc < 0) return rc;
    rc = fsdp_module_named_params(twin, false, &tp);
    for (size_t i = 0; i < tp.n && rc == 0; i++) {
        fsdp_tensor_t *g = fsdp_tensor_grad(fsdp_module_param(m, tp.names[i]));
        fsdp_tensor_t *tg = fsdp_tensor_grad(tp.tensors[i]);
        int64_t n = tg ? fsdp_tensor_numel(tg) : 0;
        double *a = calloc((size_t)n + 1, sizeof *a), *e = calloc((size_t)n + 1, sizeof *e);
        if (!g || !tg || !a || !e || mpt_read_vals(g, a, n) < 0 || mpt_read_vals(tg, e, n) < 0) {
            *worst = INFINITY;
            snprintf(why, len, "no gradient for '%s'", tp.names[i]);
        } else {
            for (int64_t k = 0; k < n; k++)
                e[k] *= times;
            *worst = fmax(*worst, mpt_scaled_err(a, e, n, rel, abs_));
        }
        free(a);
        free(e);
    }
    fsdp_named_list_free(&tp);
    int rc2 = fsdp_summon_end(root);
    return rc < 0 ? rc : rc2;
}

/* The end of an iteration: its tensors released (those given; the pointers cleared) and the
 * graph dropped. */
void mpt_drop_iteration(fsdp_ctx_t *ctx, fsdp_tensor_t **x, fsdp_tensor_t **out,
                        fsdp_tensor_t **loss) {
    fsdp_tensor_t **t[3] = {x, out, loss};
    for (int i = 0; i < 3; i++)
        if (t[i]) {
            fsdp_tensor_release(*t[i]);
            *t[i] = NULL;
        }
    fsdp_tape_clear(ctx);
}

/* ---- the reference --------------------------------------------------------------------------- */

/*
 * Gradients of sum(model(x)) for the weights w with the same casts as FSDP: weights (and x,
 * when the root casts it) in cdt, the gradient then cast to rdt; g[k] receives them in double.
 * `local` is an unwrapped model whose weights this replaces.
 */
int mpt_ref_grads(fsdp_ctx_t *ctx, fsdp_module_t *local, const mpt_ref_t *r, bool nested,
                  fsdp_dtype_t mdt, fsdp_dtype_t cdt, fsdp_dtype_t rdt, bool cast_in,
                  fsdp_tensor_t *x, double g[NLIN_MAX][D * D], double *loss, double *l1) {
    int rc = FSDP_OK;
    fsdp_tensor_t *xin = NULL, *out = NULL, *l = NULL;
    const int64_t ws[2] = {D, D};
    for (int k = 0; k < r->nlin && rc == 0; k++) {
        fsdp_tensor_t *m = NULL, *c = NULL;
        rc = fsdp_tensor_empty(ctx, FSDP_DTYPE_F64, 2, ws, FSDP_MEM_OTHER, &m);
        if (rc == 0) rc = fsdp_tensor_copy_from_host(m, r->w[k], sizeof r->w[k]);
        /* masters in their dtype first (the FSDP masters are stored in it), then cdt */
        fsdp_tensor_t *mm = NULL;
        if (rc == 0) rc = mpt_cast_to(m, mdt, &mm);
        if (rc == 0) rc = fsdp_to_dtype(mm, cdt, &c);
        if (rc == 0) rc = fsdp_tensor_set_requires_grad(c, true);
        if (rc == 0) rc = fsdp_module_set_param(local, mpt_WNAME[nested][k], c, false);
        fsdp_tensor_release(m);
        fsdp_tensor_release(mm);
        fsdp_tensor_release(c);
    }
    if (rc == 0)
        rc = cast_in ? mpt_cast_to(x, cdt, &xin) : mpt_cast_to(x, fsdp_tensor_dtype(x), &xin);
    if (rc == 0) rc = fsdp_module_forward1(local, xin, &out);
    if (rc == 0) rc = tm_sum_loss(out, &l);
    if (rc == 0) rc = fsdp_tensor_item(l, 0, loss);
    *l1 = 0;
    for (int64_t i = 0; rc == 0 && i < fsdp_tensor_numel(out); i++) {
        double v = 0;
        rc = fsdp_tensor_item(out, i, &v);
        *l1 += fabs(v);
    }
    if (rc == 0) rc = fsdp_backward(l, NULL);
    for (int k = 0; k < r->nlin && rc == 0; k++) {
        fsdp_tensor_t *gr = fsdp_tensor_grad(fsdp_module_param(local, mpt_WNAME[nested][k])),
                      *c = NULL;
        rc = gr ? fsdp_to_dtype(gr, rdt, &c) : FSDP_EINTERNAL;
        if (rc == 0) rc = mpt_read_vals(c, g[k], D * D);
        fsdp_tensor_release(c);
    }
    fsdp_tensor_release(xin);
    fsdp_tensor_release(out);
    fsdp_tensor_release(l);
    fsdp_tape_clear(ctx);
    return rc;
}

/* Rank q's input of iteration it, in dt. */
int mpt_rank_input(fsdp_ctx_t *ctx, int it, int q, fsdp_dtype_t dt, fsdp_tensor_t **x) {
    fsdp_tensor_t *f = NULL;
    int rc = fu_rand_input(ctx, 1000 + 16 * (uint64_t)it + (uint64_t)q, BATCH, D, &f);
    if (rc == 0) rc = mpt_cast_to(f, dt, x);
    fsdp_tensor_release(f);
    return rc;
}
