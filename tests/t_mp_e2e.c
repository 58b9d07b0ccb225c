/*
 * t_mp_e2e.c: seed 003's end-to-end mixed-precision procedure and the mixed-precision gradient
 * and eval behaviours (spec section 6), on the sim backend:
 *   MP-S01/U02  the e2e procedure with SHARD_GRAD_OP (no reshard after forward), f64 masters,
 *               host offload, at world sizes 2 and 1;
 *   MP-S02/U03  the e2e procedure with FULL_SHARD over the configuration table (all f16;
 *               reduce-only f16; param and buffer f16; all unset; param f16, buffer bf16,
 *               reduce f32) x offload x f32/f64 masters x the sharded gradient scaler, at
 *               world sizes 1, 2 and 4, with one forward/backward prefetch mode per job
 *               (cycled);
 *   MP-S08/U01  keep_low_precision_grads: six iterations without zero_grad, offload x
 *               use_orig_params, world sizes 2 and 1: every gradient is f16 after every
 *               backward, the first one equals the reference's, and each later one is the
 *               previous plus the first, added and rounded in f16;
 *   MP-S11      TransformerWithSharedParams (train mode, add_bn), wrapped with a layer policy
 *               or fully_shard(policy) (composable), f16 x3, cast_forward_inputs on/off,
 *               the flag on/off: the train loss is f16, every gradient after backward f32;
 *               the eval loss is f32 with the flag, f16 without;
 *   MP-S09      upstream's mixed-precision BatchNormNet (fc1, BatchNorm1d, fc2, LayerNorm, fc3,
 *               softmax) under f16 x3 with module_classes_to_ignore {batch norm, LayerNorm}
 *               and a never-wrap policy: the warning, bn and ln become units without mixed
 *               precision, fc1..fc3 stay in the root, which keeps f16; forward and backward
 *               run, and the output and every gradient match a local twin that applies the
 *               same casts by hand (f16 Linears, f32 norms between casts), world sizes 1 and 2;
 *   UOP-WB-05   SHARD_GRAD_OP, a unit per Linear, param f16, use_orig_params, the flag on/off:
 *               train forward -> summon -> forward; train forward -> eval forward; train
 *               forward and backward -> eval forward; train forward and backward, all without
 *               an error, and the parameters after the final step are bitwise those of a twin
 *               that ran only the train steps (the eval forwards and the summon change
 *               nothing);
 *   MP-S10      full precision in eval at a root that manages no parameters: the inputs its
 *               module receives are f32 with the flag, f16 without, in eval; f16 in train;
 *   MP-S12      buffers: buffer_dtype (f16) in train, their own dtype (f64) in an eval forward
 *               with the flag (f16 without), and f16 again in the next train forward;
 *   MP-S13      with param f32 and reduce f16, an eval forward and backward reduces in f32 with
 *               the flag and in f16 without (the group's byte counters), and the gradients
 *               equal the f32 reference's.
 *
 * The e2e procedure (upstream's _run_test_mixed_precision_e2e) trains a single Linear(10, 10)
 * unit and a nested one (Sequential(FSDP(Linear), Linear)), each Linear with an f64 buffer,
 * for three iterations of SGD (lr 0.1; upstream uses Adam, whose normalised update hides
 * gradient errors, so SGD here) on rand(3, 10) inputs that differ per rank, and checks at each
 * phase:
 *   after forward    buffers in buffer_dtype (f64 when unset); the loss in param_dtype (the
 *                    masters' dtype when unset); the all-gathers moved param_dtype bytes;
 *   after backward   buffers still cast; no unit holds unsharded parameter bytes; every
 *                    parameter and gradient the optimizer sees is in the masters' dtype; the
 *                    reductions moved reduce_dtype bytes (an f16 reduce-scatter half the bytes
 *                    of an f32 one); the gradients equal the reference's;
 *   after the step   inside a summon the parameters are in the masters' dtype and equal the
 *                    reference's; no unsharded compute-dtype parameter was allocated by it;
 *                    buffers still in buffer_dtype; the FULL state dict (plain, rank0_only,
 *                    offload_to_cpu) has the parameters in the masters' dtype with the
 *                    reference's values and the buffers in f64, the live buffers stay cast, and
 *                    loading it back leaves the shards bitwise as they were.
 * The reference is a local model of the same weights that applies the same casts by hand:
 * weights and input cast to param_dtype, the loss's gradient taken there, each rank's gradient
 * cast to reduce_dtype, the ranks' average taken in double, the SGD step in double. Tolerance:
 * with half precision in the path, every compared tensor is within 4e-3 of its largest
 * magnitude (+1e-6): a gradient goes through at most four roundings of 2^-11 relative (the f16
 * product's, the pre- and post-divide's and the f16 sum's), on values no larger than that
 * magnitude; with no half precision, f32 rounding only (1e-5 of it).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "models/models.h"
#include "tap.h"

#define D 10    /* Linear(D, D) */
#define BATCH 3 /* rand(BATCH, D) inputs */
#define ITERS 3 /* e2e iterations */
#define LR 0.1  /* SGD */
#define NLIN_MAX 2

/* ---- configurations -------------------------------------------------------------------------- */

typedef struct mp_cfg {
    const char *name;
    bool param, buffer; /* set to f16 (buffer: bf16 when bf16_buffer) */
    int reduce;         /* -1 unset, else the dtype */
    bool bf16_buffer;
} mp_cfg_t;

static const mp_cfg_t CFGS[] = {
    {"default_mp (all f16)", true, true, FSDP_DTYPE_F16, false},
    {"mp_only_reduce (reduce f16)", false, false, FSDP_DTYPE_F16, false},
    {"mp_only_param_and_buf (f16)", true, true, -1, false},
    {"mp_no_mixed_precision (all unset)", false, false, -1, false},
    {"mp_diff_buffer_and_reduce (param f16, buffer bf16, reduce f32)", true, true, FSDP_DTYPE_F32,
     true},
};
#define NCFG (sizeof CFGS / sizeof CFGS[0])

static void cfg_to_mp(const mp_cfg_t *c, fsdp_mixed_precision_t *mp) {
    fsdp_mixed_precision_init(mp);
    mp->enabled = true;
    if (c->param) mp->param_dtype = FSDP_DTYPE_F16;
    if (c->buffer) mp->buffer_dtype = c->bf16_buffer ? FSDP_DTYPE_BF16 : FSDP_DTYPE_F16;
    if (c->reduce >= 0) mp->reduce_dtype = (fsdp_dtype_t)c->reduce;
}

/* ---- the model ------------------------------------------------------------------------------- */

/* Parameter `name` of m replaced by a copy in dt (a leaf that requires a gradient). */
static int param_to(fsdp_module_t *m, const char *name, fsdp_dtype_t dt) {
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
static int lmp_create(fsdp_ctx_t *ctx, uint64_t seed, fsdp_dtype_t dt, fsdp_module_t **out) {
    tm_manual_seed(ctx, seed);
    fsdp_module_t *l = NULL;
    fsdp_tensor_t *b = NULL;
    const int64_t bs[2] = {1, 2};
    int rc = fsdp_linear_create(ctx, D, D, false, &l);
    if (rc == 0) rc = param_to(l, "weight", dt);
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
static int model_create(fsdp_ctx_t *ctx, bool nested, fsdp_dtype_t dt, fsdp_module_t **out) {
    *out = NULL;
    if (!nested) return lmp_create(ctx, 11, dt, out);
    fsdp_module_t *s = NULL, *l = NULL;
    int rc = fsdp_sequential_create(ctx, &s);
    for (int k = 0; k < 2 && rc == 0; k++) {
        rc = lmp_create(ctx, 11 + (uint64_t)k, dt, &l);
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

static const char *WNAME[2][NLIN_MAX] = {{"weight", NULL}, {"0.weight", "1.weight"}};

/* ---- helpers --------------------------------------------------------------------------------- */

/* max |a - e| / (rel * max |e| + abs) over n values (> 1: not close). */
static double scaled_err(const double *a, const double *e, int64_t n, double rel, double abs_) {
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
static int read_vals(const fsdp_tensor_t *t, double *v, int64_t n) {
    if (!t || fsdp_tensor_numel(t) != n) return FSDP_EINVAL;
    for (int64_t i = 0; i < n; i++) {
        int rc = fsdp_tensor_item(t, i, &v[i]);
        if (rc < 0) return rc;
    }
    return FSDP_OK;
}

/* x in dt (a new reference; the same tensor when it already is). */
static int cast_to(fsdp_tensor_t *x, fsdp_dtype_t dt, fsdp_tensor_t **out) {
    if (fsdp_tensor_dtype(x) == dt) {
        *out = fsdp_tensor_retain(x);
        return FSDP_OK;
    }
    return fsdp_to_dtype(x, dt, out);
}

/* Whether every buffer of m has dtype dt; else the first offender in why. */
static bool buffers_are(fsdp_module_t *m, fsdp_dtype_t dt, char *why, size_t len) {
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
static bool none_unsharded_bytes(fsdp_unit_t *root, char *why, size_t len) {
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
static int64_t total_padded(fsdp_unit_t *root) {
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
static const char *nm(char *buf, size_t len, const char *ph, const char *what) {
    snprintf(buf, len, "%s: %s", ph, what);
    return buf;
}
#define NM(what) nm(name, sizeof name, ph, what)

/* Summons root with its gradients (use_orig_params) and compares every gradient of m with
 * `times` x the twin's under the same name (the twin is a local model); *worst receives the
 * largest scaled_err(rel, abs_) (INFINITY when a gradient is missing, named in why). Returns a
 * library error, else 0. */
static int grads_vs_twin(fsdp_unit_t *root, fsdp_module_t *m, fsdp_module_t *twin, double times,
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
        if (!g || !tg || !a || !e || read_vals(g, a, n) < 0 || read_vals(tg, e, n) < 0) {
            *worst = INFINITY;
            snprintf(why, len, "no gradient for '%s'", tp.names[i]);
        } else {
            for (int64_t k = 0; k < n; k++)
                e[k] *= times;
            *worst = fmax(*worst, scaled_err(a, e, n, rel, abs_));
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
static void drop_iteration(fsdp_ctx_t *ctx, fsdp_tensor_t **x, fsdp_tensor_t **out,
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

/* The reference's state: the masters (per Linear, D*D doubles) of one model. */
typedef struct ref {
    int nlin;
    double w[NLIN_MAX][D * D];
} ref_t;

/*
 * Gradients of sum(model(x)) for the weights w with the same casts as FSDP: weights (and x,
 * when the root casts it) in cdt, the gradient then cast to rdt; g[k] receives them in double.
 * `local` is an unwrapped model whose weights this replaces.
 */
static int ref_grads(fsdp_ctx_t *ctx, fsdp_module_t *local, const ref_t *r, bool nested,
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
        if (rc == 0) rc = cast_to(m, mdt, &mm);
        if (rc == 0) rc = fsdp_to_dtype(mm, cdt, &c);
        if (rc == 0) rc = fsdp_tensor_set_requires_grad(c, true);
        if (rc == 0) rc = fsdp_module_set_param(local, WNAME[nested][k], c, false);
        fsdp_tensor_release(m);
        fsdp_tensor_release(mm);
        fsdp_tensor_release(c);
    }
    if (rc == 0) rc = cast_in ? cast_to(x, cdt, &xin) : cast_to(x, fsdp_tensor_dtype(x), &xin);
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
        fsdp_tensor_t *gr = fsdp_tensor_grad(fsdp_module_param(local, WNAME[nested][k])), *c = NULL;
        rc = gr ? fsdp_to_dtype(gr, rdt, &c) : FSDP_EINTERNAL;
        if (rc == 0) rc = read_vals(c, g[k], D * D);
        fsdp_tensor_release(c);
    }
    fsdp_tensor_release(xin);
    fsdp_tensor_release(out);
    fsdp_tensor_release(l);
    fsdp_tape_clear(ctx);
    return rc;
}

/* Rank q's input of iteration it, in dt. */
static int rank_input(fsdp_ctx_t *ctx, int it, int q, fsdp_dtype_t dt, fsdp_tensor_t **x) {
    fsdp_tensor_t *f = NULL;
    int rc = fu_rand_input(ctx, 1000 + 16 * (uint64_t)it + (uint64_t)q, BATCH, D, &f);
    if (rc == 0) rc = cast_to(f, dt, x);
    fsdp_tensor_release(f);
    return rc;
}

/* ---- the e2e procedure ----------------------------------------------------------------------- */

typedef struct e2e_job {
    fu_job_t j; /* first */
    const mp_cfg_t *cfg;
    fsdp_dtype_t mdt; /* the masters' dtype */
    bool nested;
    bool scaler; /* the sharded gradient scaler (init_scale 1024: a power of two, so the
                  * unscaled gradients are the unscaled path's bits and the reference holds) */
} e2e_job_t;

static int e2e_rank(fsdp_ctx_t *ctx, void *arg) {
    e2e_job_t *ej = arg;
    fu_job_t *j = &ej->j;
    fu_res_t *r = fu_res_of(j, ctx);
    const mp_cfg_t *cfg = ej->cfg;
    bool nested = ej->nested;
    fsdp_dtype_t mdt = ej->mdt;
    fsdp_dtype_t cdt = cfg->param ? FSDP_DTYPE_F16 : mdt;
    fsdp_dtype_t rdt = cfg->reduce >= 0 ? (fsdp_dtype_t)cfg->reduce : cdt;
    fsdp_dtype_t bdt =
        cfg->buffer ? (cfg->bf16_buffer ? FSDP_DTYPE_BF16 : FSDP_DTYPE_F16) : FSDP_DTYPE_F64;
    bool half = cdt != FSDP_DTYPE_F32 && cdt != FSDP_DTYPE_F64;
    half = half || (rdt != FSDP_DTYPE_F32 && rdt != FSDP_DTYPE_F64);
    double rel = half ? 4e-3 : 1e-5, absd = 1e-6;
    int world = fsdp_ctx_world_size(ctx), rank = fsdp_ctx_rank(ctx);
    fsdp_module_t *m = NULL, *local = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_grad_scaler_t *scaler = NULL;
    fsdp_named_list_t params = {0}, sdict = {0};
    fsdp_tensor_t *x = NULL, *out = NULL, *loss = NULL, *scaled = NULL;
    ref_t ref = {.nlin = nested ? 2 : 1};
    char why[760];
    int rc;
    fsdp_options_t o;
    fu_job_options(j, &o);
    o.mixed_precision = j->mp;
    o.check_exec_order = false; /* its all-gathers would count in the byte checks */
    FU_TRY(done, "setting up", model_create(ctx, nested, mdt, &m));
    FU_TRY(done, "setting up", model_create(ctx, nested, mdt, &local));
    for (int k = 0; k < ref.nlin; k++)
        FU_TRY(done, "setting up",
               read_vals(fsdp_module_param(m, WNAME[nested][k]), ref.w[k], D * D));
    if (nested) {
        fsdp_unit_t *c = NULL;
        FU_TRY(done, "wrapping", fsdp_wrap(fsdp_module_child(m, "0"), &o, &c));
    }
    FU_TRY(done, "wrapping", fsdp_wrap(m, &o, &root));
    FU_TRY(done, "setting up", fsdp_named_params(root, &params));
    FU_TRY(done, "setting up", fu_make_sgd(ctx, &params, LR, 0.0, &opt));
    if (ej->scaler) {
        fsdp_grad_scaler_options_t so;
        fsdp_grad_scaler_options_init(&so);
        so.init_scale = 1024.0;
        FU_TRY(done, "setting up", fsdp_grad_scaler_create(ctx, &so, &scaler));
    }
    fsdp_pg_t *pg = fsdp_unit_pg(root);
    int64_t padded = total_padded(root);
    for (int it = 0; it < ITERS; it++) {
        char ph[64], name[200];
        snprintf(ph, sizeof ph, "iteration %d", it + 1);
        /* reference: the average over ranks of the rank gradients, then the step */
        double g[NLIN_MAX][D * D] = {{0}}, gq[NLIN_MAX][D * D], lq = 0, my_ref_loss = 0, l1q = 0,
                               my_l1 = 0;
        for (int q = 0; q < world; q++) {
            fsdp_tensor_t *xq = NULL;
            FU_TRY(done, "reference", rank_input(ctx, it, q, mdt, &xq));
            rc = ref_grads(ctx, local, &ref, nested, mdt, cdt, rdt, cfg->param, xq, gq, &lq, &l1q);
            fsdp_tensor_release(xq);
            if (rc < 0) {
                fu_fatal(r, ctx, "reference", rc);
                goto done;
            }
            if (q == rank) {
                my_ref_loss = lq;
                my_l1 = l1q;
            }
            for (int k = 0; k < ref.nlin; k++)
                for (int e = 0; e < D * D; e++)
                    g[k][e] += gq[k][e] / world;
        }
        /* forward */
        fsdp_pg_counters_t c0, c1, c2;
        fsdp_pg_get_counters(pg, &c0);
        FU_TRY(done, "FSDP forward", rank_input(ctx, it, rank, mdt, &x));
        FU_TRY(done, "FSDP forward", fsdp_module_forward1(m, x, &out));
        FU_TRY(done, "FSDP forward", tm_sum_loss(out, &loss));
        fsdp_pg_get_counters(pg, &c1);
        fu_ck(r, buffers_are(m, bdt, why, sizeof why),
              NM("after forward the buffers are in buffer_dtype (f64, their own, when unset)"),
              "buffers are not %s: %s", fsdp_dtype_name(bdt), why);
        fu_ck(r, fsdp_tensor_dtype(loss) == cdt,
              NM("the loss is in param_dtype (the masters' dtype when unset)"),
              "the loss is %s, want %s", fsdp_dtype_name(fsdp_tensor_dtype(loss)),
              fsdp_dtype_name(cdt));
        double lv = 0;
        fsdp_tensor_item(loss, 0, &lv);
        /* the first iteration's weights are the reference's exactly; later, a sum of outputs
         * that may cancel is within the tolerance of the sum of their magnitudes */
        double lerr = fabs(lv - my_ref_loss) / (rel * my_l1 + 1e-5);
        fu_ck(r, it == 0 ? lv == my_ref_loss : lerr <= 1.0,
              NM(it == 0 ? "the loss is bitwise the reference's"
                         : "the loss matches the reference's within the half tolerance"),
              "loss %.9g, reference %.9g (%.3g of tolerance)", lv, my_ref_loss, lerr);
        uint64_t agc = c1.calls[FSDP_COLL_ALL_GATHER] - c0.calls[FSDP_COLL_ALL_GATHER];
        uint64_t agb = c1.bytes[FSDP_COLL_ALL_GATHER] - c0.bytes[FSDP_COLL_ALL_GATHER];
        if (j->strategy != FSDP_NO_SHARD && world > 1)
            fu_ck(r, agc > 0 && agb == (uint64_t)padded * fsdp_dtype_size(cdt),
                  NM("the forward all-gathers move param_dtype bytes (group byte counters)"),
                  "the all-gathers moved %llu bytes in %llu calls, want %lld elements of %s "
                  "(param_dtype)",
                  (unsigned long long)agb, (unsigned long long)agc, (long long)padded,
                  fsdp_dtype_name(cdt));
        /* backward (of the scaled loss with the scaler) */
        if (scaler) FU_TRY(done, "scaler", fsdp_grad_scaler_scale(scaler, loss, &scaled));
        FU_TRY(done, "FSDP backward", fsdp_backward(scaled ? scaled : loss, NULL));
        fsdp_pg_get_counters(pg, &c2);
        fu_ck(r, buffers_are(m, bdt, why, sizeof why),
              NM("after backward the buffers are still cast"), "buffers are not %s: %s",
              fsdp_dtype_name(bdt), why);
        fu_ck(r, none_unsharded_bytes(root, why, sizeof why),
              NM("after backward no unit holds unsharded parameter bytes"),
              "%s (the compute-dtype parameters exist only while units run)", why);
        fsdp_coll_kind_t rk =
            j->strategy == FSDP_NO_SHARD ? FSDP_COLL_ALL_REDUCE : FSDP_COLL_REDUCE_SCATTER;
        uint64_t rb = c2.bytes[rk] - c1.bytes[rk];
        if (world > 1)
            fu_ck(r, rb == (uint64_t)padded * fsdp_dtype_size(rdt),
                  NM("the gradient reductions move reduce_dtype bytes (group byte counters)"),
                  "the gradient reductions moved %llu bytes, want %lld elements of %s "
                  "(reduce_dtype)",
                  (unsigned long long)rb, (long long)padded, fsdp_dtype_name(rdt));
        bool dts = true;
        for (size_t i = 0; i < params.n && dts; i++) {
            fsdp_tensor_t *p = params.tensors[i], *gr = fsdp_tensor_grad(p);
            if (fsdp_tensor_dtype(p) != mdt || (gr && fsdp_tensor_dtype(gr) != mdt)) {
                snprintf(why, sizeof why, "'%s' is %s, its gradient %s", params.names[i],
                         fsdp_dtype_name(fsdp_tensor_dtype(p)),
                         gr ? fsdp_dtype_name(fsdp_tensor_dtype(gr)) : "none");
                dts = false;
            }
        }
        fu_ck(r, dts,
              NM("after backward every parameter and gradient the optimizer steps is in the "
                 "masters' dtype"),
              "%s; want the masters' dtype %s", why, fsdp_dtype_name(mdt));
        /* the step, and the full parameters against the reference's */
        if (scaler) {
            bool stepped = false;
            FU_TRY(done, "scaler", fsdp_grad_scaler_step(scaler, opt, &stepped));
            FU_TRY(done, "scaler", fsdp_grad_scaler_update(scaler));
            fu_ck(r, stepped && fsdp_grad_scaler_get_scale(scaler) == 1024.0,
                  NM("the scaler unscales and steps (no overflow at scale 1024)"),
                  "stepped %d, scale %g", stepped, fsdp_grad_scaler_get_scale(scaler));
            fsdp_tensor_release(scaled);
            scaled = NULL;
        } else {
            FU_TRY(done, "FSDP step", fsdp_optim_step(opt));
        }
        FU_TRY(done, "FSDP step", fsdp_optim_zero_grad(opt, true));
        for (int k = 0; k < ref.nlin; k++)
            for (int e = 0; e < D * D; e++) {
                double w = ref.w[k][e] - LR * g[k][e];
                ref.w[k][e] = mdt == FSDP_DTYPE_F32 ? (double)(float)w : w;
            }
        fsdp_summon_options_t so;
        fsdp_summon_options_init(&so);
        so.writeback = false;
        FU_TRY(done, "summon", fsdp_summon_begin(root, &so));
        double worst = 0;
        bool sdt = true;
        for (int k = 0; k < ref.nlin; k++) {
            fsdp_tensor_t *w = fsdp_module_param(m, WNAME[nested][k]);
            double v[D * D];
            sdt = sdt && fsdp_tensor_dtype(w) == mdt;
            if (read_vals(w, v, D * D) < 0)
                worst = INFINITY;
            else
                worst = fmax(worst, scaled_err(v, ref.w[k], D * D, rel, absd));
        }
        fu_ck(r, sdt, NM("inside a summon the parameters are in the masters' dtype"),
              "inside the summon the parameters are not in the masters' dtype %s",
              fsdp_dtype_name(mdt));
        fu_ck(r, worst <= 1.0,
              NM("after the SGD step the full parameters match the reference's (half tolerance)"),
              "after the step the parameters are %.3g of the tolerance from the reference's",
              worst);
        if (cdt != mdt)
            fu_ck(r, none_unsharded_bytes(root, why, sizeof why),
                  NM("a summon allocates no compute-dtype unsharded parameter"),
                  "inside the summon: %s (it gathers full precision, not the compute dtype)", why);
        fu_ck(r, buffers_are(m, bdt, why, sizeof why),
              NM("inside a summon the buffers stay in buffer_dtype"),
              "inside the summon: buffers are not %s: %s", fsdp_dtype_name(bdt), why);
        FU_TRY(done, "summon", fsdp_summon_end(root));
        /* the FULL state dict: parameters in the masters' dtype with the reference's values,
         * buffers in their own dtype (f64); the live buffers stay cast; iteration 2 asks for
         * rank 0 only, iteration 3 for host memory; loading it back changes no shard */
        fsdp_full_state_dict_options_t fo;
        fsdp_full_state_dict_options_init(&fo);
        fo.rank0_only = it == 1;
        fo.offload_to_cpu = it == 2;
        FU_TRY(done, "state dict", fsdp_full_state_dict(root, &fo, &sdict));
        if (fo.rank0_only && rank != 0) {
            fu_ck(r, sdict.n == 0, NM("FULL state dict, rank0_only: the other ranks get none"),
                  "%zu entries", sdict.n);
        } else {
            bool sd_ok = sdict.n == (size_t)(2 * ref.nlin);
            double sdw = 0;
            snprintf(why, sizeof why, "%zu entries", sdict.n);
            for (size_t i = 0; i < sdict.n && sd_ok; i++) {
                bool is_buf = strstr(sdict.names[i], "buffer") != NULL;
                fsdp_dtype_t want = is_buf ? FSDP_DTYPE_F64 : mdt;
                if (fsdp_tensor_dtype(sdict.tensors[i]) != want) {
                    snprintf(why, sizeof why, "'%s' is %s, want %s", sdict.names[i],
                             fsdp_dtype_name(fsdp_tensor_dtype(sdict.tensors[i])),
                             fsdp_dtype_name(want));
                    sd_ok = false;
                }
                for (int k = 0; k < ref.nlin && !is_buf; k++) {
                    double v[D * D];
                    if (strcmp(sdict.names[i], WNAME[nested][k]) != 0) continue;
                    if (read_vals(sdict.tensors[i], v, D * D) < 0)
                        sdw = INFINITY;
                    else
                        sdw = fmax(sdw, scaled_err(v, ref.w[k], D * D, rel, absd));
                }
            }
            fu_ck(r, sd_ok && sdw <= 1.0,
                  NM("FULL state dict: parameters in the masters' dtype with the reference's "
                     "values, buffers in their dtype from before wrapping (f64)"),
                  "%s; parameters %.3g of the tolerance", why, sdw);
        }
        fu_ck(r, buffers_are(m, bdt, why, sizeof why),
              NM("after the FULL state dict the live buffers are in buffer_dtype again"), "%s",
              why);
        if (!fo.rank0_only) {
            fsdp_named_list_t before = {0};
            FU_TRY(done, "state dict", fsdp_named_params(root, &before));
            fsdp_tensor_t **keep = calloc(before.n + 1, sizeof *keep);
            for (size_t i = 0; keep && i < before.n && rc == 0; i++)
                rc = fsdp_tensor_clone(before.tensors[i], FSDP_MEM_OTHER, &keep[i]);
            if (rc == 0 && keep) rc = fsdp_load_full_state_dict(root, &sdict, true);
            bool same = rc == 0 && keep;
            for (size_t i = 0; same && i < before.n; i++)
                same = fu_same_bits(before.tensors[i], keep[i]) == 1;
            for (size_t i = 0; keep && i < before.n; i++)
                fsdp_tensor_release(keep[i]);
            free(keep);
            fsdp_named_list_free(&before);
            fu_ck(r, same,
                  NM("loading the FULL state dict back leaves every shard bitwise as it was"),
                  "%s: %s", fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
            if (rc < 0) goto done;
        }
        fsdp_named_list_free(&sdict);
        if (nested && it == 0) {
            fsdp_unit_t *child = fsdp_unit_of(fsdp_module_child(m, "0"));
            int e1 = fsdp_full_state_dict(child, NULL, &sdict);
            fu_ck_einval(r, ctx, e1, "not a root", "0",
                         NM("the FULL state dict of a non-root unit is FSDP_EINVAL naming it"));
            int e2 = fsdp_full_state_dict(root, NULL, NULL);
            fu_ck_einval(r, ctx, e2, "out is NULL", NULL,
                         NM("the FULL state dict without an output list is FSDP_EINVAL"));
            int e3 = fsdp_load_full_state_dict(root, NULL, true);
            fu_ck_einval(r, ctx, e3, "sd is NULL", NULL,
                         NM("loading a NULL FULL state dict is FSDP_EINVAL"));
        }
        drop_iteration(ctx, &x, &out, &loss);
    }
done:
    fsdp_named_list_free(&sdict);
    fsdp_tensor_release(x);
    fsdp_tensor_release(out);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(scaled);
    fsdp_named_list_free(&params);
    fu_teardown(ctx, m, root, NULL, opt);
    fsdp_grad_scaler_destroy(scaler);
    fsdp_module_release(local);
    return rc;
}

static void run_e2e(const char *id, int world, fsdp_sharding_strategy_t s, const mp_cfg_t *cfg,
                    bool offload, fsdp_dtype_t mdt, bool nested, int prefetch_mode, bool scaler) {
    e2e_job_t *ej = calloc(1, sizeof *ej);
    if (!ej) tap_bail("out of memory");
    char prefix[160];
    snprintf(prefix, sizeof prefix, "%s %s, %s, offload %s, %s masters, %s, %s%s%s", id,
             nested ? "nested" : "simple", fsdp_sharding_strategy_name(s), offload ? "on" : "off",
             fsdp_dtype_name(mdt), cfg->name,
             fsdp_backward_prefetch_name(fu_bwd_prefetches[prefetch_mode % 3]),
             prefetch_mode >= 3 ? ", forward prefetch" : "", scaler ? ", grad scaler" : "");
    fu_job_init(&ej->j, prefix, world, s, false);
    ej->j.offload = offload;
    ej->j.bp = fu_bwd_prefetches[prefetch_mode % 3];
    ej->j.fwd_prefetch = prefetch_mode >= 3;
    cfg_to_mp(cfg, &ej->j.mp);
    ej->cfg = cfg;
    ej->mdt = mdt;
    ej->nested = nested;
    ej->scaler = scaler;
    fu_run_job(&ej->j, e2e_rank);
    free(ej);
}

/* ---- keep_low_precision_grads ---------------------------------------------------------------- */

/* upstream's MyModel: lin1, lin2 = Linear(10, 10); lin1 wrapped, then the root. */
static int s08_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL, *l = NULL, *half = NULL;
    fsdp_unit_t *root = NULL, *c = NULL;
    fsdp_named_list_t params = {0}, hp = {0};
    fsdp_tensor_t *x = NULL, *hx = NULL, *out = NULL, *loss = NULL;
    fsdp_tensor_t **first = NULL, **prev = NULL;
    char why[760];
    int rc;
    fsdp_options_t o;
    fu_job_options(j, &o);
    o.mixed_precision = j->mp;
    const int64_t xs[2] = {1, D};
    for (int pass = 0; pass < 2; pass++) {
        fsdp_module_t **dst = pass ? &half : &m;
        tm_manual_seed(ctx, 21);
        FU_TRY(done, "setting up", fsdp_sequential_create(ctx, dst));
        for (int k = 0; k < 2; k++) {
            FU_TRY(done, "setting up", fsdp_linear_create(ctx, D, D, true, &l));
            rc = fsdp_module_append(*dst, l);
            fsdp_module_release(l);
            l = NULL;
            FU_TRY(done, "setting up", rc);
        }
    }
    /* the reference: the same weights in f16, the same input, one backward */
    FU_TRY(done, "reference", fsdp_module_named_params(half, false, &hp));
    for (size_t i = 0; i < hp.n; i++)
        FU_TRY(done, "reference", param_to(half, hp.names[i], FSDP_DTYPE_F16));
    fsdp_named_list_free(&hp);
    FU_TRY(done, "reference",
           fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 2, xs, 1.0, FSDP_MEM_OTHER, &x));
    FU_TRY(done, "reference", fsdp_to_dtype(x, FSDP_DTYPE_F16, &hx));
    FU_TRY(done, "reference", fsdp_module_forward1(half, hx, &out));
    FU_TRY(done, "reference", tm_sum_loss(out, &loss));
    FU_TRY(done, "reference", fsdp_backward(loss, NULL));
    fsdp_tensor_release(out);
    fsdp_tensor_release(loss);
    out = loss = NULL;
    fsdp_tape_clear(ctx);
    FU_TRY(done, "wrapping", fsdp_wrap(fsdp_module_child(m, "0"), &o, &c));
    FU_TRY(done, "wrapping", fsdp_wrap(m, &o, &root));
    FU_TRY(done, "setting up", fsdp_named_params(root, &params));
    first = calloc(params.n + 1, sizeof *first);
    prev = calloc(params.n + 1, sizeof *prev);
    if (!first || !prev) {
        rc = fu_fatal(r, ctx, "setting up", FSDP_ENOMEM);
        goto done;
    }
    for (int it = 0; it < 6; it++) {
        char ph[64], name[200];
        snprintf(ph, sizeof ph, "iteration %d", it + 1);
        FU_TRY(done, "FSDP forward", fsdp_module_forward1(m, x, &out));
        FU_TRY(done, "FSDP forward", tm_sum_loss(out, &loss));
        FU_TRY(done, "FSDP backward", fsdp_backward(loss, NULL));
        bool f16 = true, acc = true;
        size_t ngrads = 0;
        for (size_t i = 0; i < params.n; i++) {
            fsdp_tensor_t *g = fsdp_tensor_grad(params.tensors[i]);
            if (!g) continue;
            ngrads++;
            if (fsdp_tensor_dtype(g) != FSDP_DTYPE_F16) {
                if (f16)
                    snprintf(why, sizeof why, "the gradient of '%s' is %s", params.names[i],
                             fsdp_dtype_name(fsdp_tensor_dtype(g)));
                f16 = false;
                continue;
            }
            if (it == 0) {
                fsdp_tensor_clone(g, FSDP_MEM_OTHER, &first[i]);
            } else if (prev[i] && first[i]) {
                /* the previous gradient plus the first, rounded once to f16 */
                fsdp_tensor_t *sum = NULL;
                if (fsdp_add(prev[i], first[i], &sum) == 0 && fu_same_bits(g, sum) != 1) {
                    if (acc)
                        snprintf(why, sizeof why,
                                 "the gradient of '%s' is not the previous one plus the first "
                                 "(added in f16)",
                                 params.names[i]);
                    acc = false;
                }
                fsdp_tensor_release(sum);
            }
            fsdp_tensor_release(prev[i]);
            prev[i] = NULL;
            fsdp_tensor_clone(g, FSDP_MEM_OTHER, &prev[i]);
        }
        fu_ck(r, f16 && ngrads > 0, NM("every gradient is f16 after backward"),
              "%s (%zu gradients)", f16 ? "no gradient" : why, ngrads);
        if (it > 0)
            fu_ck(r, acc, NM("each gradient is the previous plus the first, added in f16"), "%s",
                  why);
        drop_iteration(ctx, NULL, &out, &loss);
    }
    /* an SGD step with the f16 gradients (upcast for the f32 parameters, as PyTorch's type
     * promotion): each parameter moves by lr x its gradient */
    {
        fsdp_optim_t *opt = NULL;
        double worst = 0;
        FU_TRY(done, "setting up", fu_make_sgd(ctx, &params, 0.01, 0.0, &opt));
        fsdp_tensor_t **before = calloc(params.n + 1, sizeof *before);
        for (size_t i = 0; before && i < params.n && rc == 0; i++)
            rc = fsdp_tensor_clone(params.tensors[i], FSDP_MEM_OTHER, &before[i]);
        if (rc == 0 && before) rc = fsdp_optim_step(opt);
        for (size_t i = 0; before && rc == 0 && i < params.n; i++) {
            fsdp_tensor_t *g = fsdp_tensor_grad(params.tensors[i]);
            for (int64_t k = 0; g && k < fsdp_tensor_numel(g); k++) {
                double p0 = 0, p1 = 0, gv = 0;
                fsdp_tensor_item(before[i], k, &p0);
                fsdp_tensor_item(params.tensors[i], k, &p1);
                fsdp_tensor_item(g, k, &gv);
                worst = fmax(worst, fu_closeness(p1, p0 - 0.01 * gv, FU_F32_RTOL, FU_F32_ATOL));
            }
        }
        for (size_t i = 0; before && i < params.n; i++)
            fsdp_tensor_release(before[i]);
        free(before);
        fsdp_optim_destroy(opt);
        fu_ck(r, rc == 0 && worst <= 1.0,
              "an SGD step with the f16 gradients moves each f32 parameter by lr x its gradient",
              "%s: %s; %.3g of the f32 tolerance", fsdp_err_name(rc), fsdp_ctx_last_error(ctx),
              worst);
        if (rc < 0) goto done;
    }
    /* the six accumulated gradients against 6 x the reference's first: a summon with
     * gradients (use_orig_params) shows them whole; the jobs without use_orig_params check the
     * dtypes and the f16 accumulation above. The tolerance grows with the five f16 additions. */
    if (j->orig) {
        double worst = 0;
        why[0] = 0;
        FU_TRY(done, "summon",
               grads_vs_twin(root, m, half, 6.0, 6e-3, 1e-5, &worst, why, sizeof why));
        fu_ck(r, worst <= 1.0,
              "the six accumulated gradients match 6 x the reference's f16 gradients",
              "%.3g of the tolerance (6e-3 of the largest, + 1e-5) %s", worst, why);
    }
done:
    for (size_t i = 0; first && i < params.n; i++) {
        fsdp_tensor_release(first[i]);
        fsdp_tensor_release(prev[i]);
    }
    free(first);
    free(prev);
    fsdp_tensor_release(x);
    fsdp_tensor_release(hx);
    fsdp_tensor_release(out);
    fsdp_tensor_release(loss);
    fsdp_named_list_free(&params);
    fsdp_named_list_free(&hp);
    fu_teardown(ctx, m, root, NULL, NULL);
    fsdp_module_release(half);
    return rc;
}

static void run_s08(const char *id, int world, bool offload, bool orig) {
    fu_job_t *j = fu_job_new("", world, FSDP_FULL_SHARD, orig);
    snprintf(j->prefix, sizeof j->prefix,
             "%s keep_low_precision_grads, offload %s, use_orig_params %s", id,
             offload ? "on" : "off", orig ? "on" : "off");
    j->offload = offload;
    fsdp_mixed_precision_init(&j->mp);
    j->mp.enabled = true;
    j->mp.param_dtype = j->mp.reduce_dtype = j->mp.buffer_dtype = FSDP_DTYPE_F16;
    j->mp.keep_low_precision_grads = true;
    fu_run_job(j, s08_rank);
    free(j);
}

/* ---- full precision in eval ------------------------------------------------------------------ */

/* Records the dtype of a module's first input and of its buffer at each forward. */
typedef struct seen {
    int in_dt, buf_dt;
} seen_t;

static int record_pre(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t **in) {
    seen_t *s = arg;
    s->in_dt = nin > 0 && in[0] ? (int)fsdp_tensor_dtype(in[0]) : -1;
    fsdp_tensor_t *b = fsdp_module_buffer(m, "buffer");
    s->buf_dt = b ? (int)fsdp_tensor_dtype(b) : -1;
    return FSDP_OK;
}

typedef struct eval_job {
    fu_job_t j; /* first */
    bool flag;  /* use_full_prec_in_eval */
    bool s10;   /* MP-S10's model: a root that manages no parameters over one wrapped Linear */
    bool on;    /* full precision expected in eval: the option, or the environment's "1" */
} eval_job_t;

/* MP-S10 and MP-S12 on the nested model under a root that manages no parameters of its own
 * (MP-S10's MyModel{a}) or the nested model with buffers (MP-S12). */
static int eval_rank(fsdp_ctx_t *ctx, void *arg) {
    eval_job_t *ej = arg;
    fu_job_t *j = &ej->j;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL, *c = NULL;
    fsdp_tensor_t *x = NULL, *out = NULL, *loss = NULL;
    seen_t s_root = {-1, -1}, s0 = {-1, -1}, s1 = {-1, -1};
    int rc;
    fsdp_options_t o;
    fu_job_options(j, &o);
    o.mixed_precision = j->mp;
    o.use_full_prec_in_eval = ej->flag;
    if (ej->s10) {
        fsdp_module_t *a = NULL;
        FU_TRY(done, "setting up", fsdp_sequential_create(ctx, &m));
        FU_TRY(done, "setting up", lmp_create(ctx, 11, FSDP_DTYPE_F32, &a));
        rc = fsdp_module_append(m, a);
        fsdp_module_release(a);
        FU_TRY(done, "setting up", rc);
    } else {
        FU_TRY(done, "setting up", model_create(ctx, true, FSDP_DTYPE_F32, &m));
    }
    FU_TRY(done, "wrapping", fsdp_wrap(fsdp_module_child(m, "0"), &o, &c));
    FU_TRY(done, "wrapping", fsdp_wrap(m, &o, &root));
    /* after wrapping: the hooks run after FSDP's, and see what the modules' forwards see */
    FU_TRY(done, "setting up", fsdp_module_add_forward_pre_hook(m, record_pre, &s_root, NULL));
    FU_TRY(done, "setting up",
           fsdp_module_add_forward_pre_hook(fsdp_module_child(m, "0"), record_pre, &s0, NULL));
    if (!ej->s10)
        FU_TRY(done, "setting up",
               fsdp_module_add_forward_pre_hook(fsdp_module_child(m, "1"), record_pre, &s1, NULL));
    fsdp_dtype_t want_eval = ej->on ? FSDP_DTYPE_F32 : FSDP_DTYPE_F16;
    fsdp_dtype_t want_buf_eval = ej->on ? FSDP_DTYPE_F64 : FSDP_DTYPE_F16;
    for (int phase = 0; phase < 3; phase++) { /* train, eval, train */
        bool train = phase != 1;
        const char *ph = phase == 0 ? "train" : phase == 1 ? "eval" : "train again";
        fsdp_module_train(m, train);
        FU_TRY(done, "forward", fu_rand_input(ctx, 77 + (uint64_t)phase, BATCH, D, &x));
        FU_TRY(done, "forward", fsdp_module_forward1(m, x, &out));
        FU_TRY(done, "forward", tm_sum_loss(out, &loss));
        fsdp_dtype_t wi = train ? FSDP_DTYPE_F16 : want_eval;
        fsdp_dtype_t wb = train ? FSDP_DTYPE_F16 : want_buf_eval;
        if (ej->s10)
            fu_ck(r, s_root.in_dt == (int)wi && s0.in_dt == (int)wi,
                  "MP-S10: in eval the root casts no input with the flag, and in train it does",
                  "%s: the root's module received %s and the wrapped Linear %s, want %s", ph,
                  s_root.in_dt >= 0 ? fsdp_dtype_name((fsdp_dtype_t)s_root.in_dt) : "nothing",
                  s0.in_dt >= 0 ? fsdp_dtype_name((fsdp_dtype_t)s0.in_dt) : "nothing",
                  fsdp_dtype_name(wi));
        else
            fu_ck(r, s1.in_dt == (int)wi && s0.buf_dt == (int)wb && s1.buf_dt == (int)wb,
                  "MP-S12: buffers and activations are full precision in eval with the flag, "
                  "buffer_dtype otherwise",
                  "%s: the second Linear received %s (want %s); the buffers seen by the "
                  "pre-forward hooks are %s and %s, want %s",
                  ph, s1.in_dt >= 0 ? fsdp_dtype_name((fsdp_dtype_t)s1.in_dt) : "nothing",
                  fsdp_dtype_name(wi),
                  s0.buf_dt >= 0 ? fsdp_dtype_name((fsdp_dtype_t)s0.buf_dt) : "none",
                  s1.buf_dt >= 0 ? fsdp_dtype_name((fsdp_dtype_t)s1.buf_dt) : "none",
                  fsdp_dtype_name(wb));
        char why[200];
        fu_ck(r, buffers_are(m, wb, why, sizeof why),
              "MP-S12: after the forward every buffer has the phase's dtype", "%s: %s", ph, why);
        fu_ck(r, fsdp_tensor_dtype(loss) == wi,
              "the loss is f32 in eval with the flag, f16 otherwise", "%s: the loss is %s, want %s",
              ph, fsdp_dtype_name(fsdp_tensor_dtype(loss)), fsdp_dtype_name(wi));
        FU_TRY(done, "backward", fsdp_backward(loss, NULL));
        drop_iteration(ctx, &x, &out, &loss);
    }
done:
    fsdp_tensor_release(x);
    fsdp_tensor_release(out);
    fsdp_tensor_release(loss);
    fu_teardown(ctx, m, root, NULL, NULL);
    return rc;
}

/* MP-S13: param f32, reduce f16, buffer f32, module_classes_to_ignore empty; an eval forward
 * and backward reduces in f32 with the flag, f16 without, and the gradients match the f32
 * reference (exactly as f32 when the reduction is f32; within f16 tolerance otherwise). */
static int s13_rank(fsdp_ctx_t *ctx, void *arg) {
    eval_job_t *ej = arg;
    fu_job_t *j = &ej->j;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL, *local = NULL;
    fsdp_unit_t *root = NULL, *c = NULL;
    fsdp_tensor_t *x = NULL, *out = NULL, *loss = NULL;
    fsdp_named_list_t params = {0};
    ref_t ref = {.nlin = 2};
    int rc;
    fsdp_options_t o;
    fu_job_options(j, &o);
    o.mixed_precision = j->mp;
    o.use_full_prec_in_eval = ej->flag;
    int world = fsdp_ctx_world_size(ctx), rank = fsdp_ctx_rank(ctx);
    FU_TRY(done, "setting up", model_create(ctx, true, FSDP_DTYPE_F32, &m));
    FU_TRY(done, "setting up", model_create(ctx, true, FSDP_DTYPE_F32, &local));
    for (int k = 0; k < 2; k++)
        FU_TRY(done, "setting up", read_vals(fsdp_module_param(m, WNAME[1][k]), ref.w[k], D * D));
    FU_TRY(done, "wrapping", fsdp_wrap(fsdp_module_child(m, "0"), &o, &c));
    FU_TRY(done, "wrapping", fsdp_wrap(m, &o, &root));
    fsdp_module_train(m, false);
    fsdp_dtype_t rdt = ej->on ? FSDP_DTYPE_F32 : FSDP_DTYPE_F16;
    double g[NLIN_MAX][D * D] = {{0}}, gq[NLIN_MAX][D * D], lq, l1q;
    for (int q = 0; q < world; q++) {
        fsdp_tensor_t *xq = NULL;
        FU_TRY(done, "reference", rank_input(ctx, 0, q, FSDP_DTYPE_F32, &xq));
        rc = ref_grads(ctx, local, &ref, true, FSDP_DTYPE_F32, FSDP_DTYPE_F32, rdt, false, xq, gq,
                       &lq, &l1q);
        fsdp_tensor_release(xq);
        if (rc < 0) {
            fu_fatal(r, ctx, "reference", rc);
            goto done;
        }
        for (int k = 0; k < 2; k++)
            for (int e = 0; e < D * D; e++)
                g[k][e] += gq[k][e] / world;
    }
    fsdp_pg_t *pg = fsdp_unit_pg(root);
    fsdp_pg_counters_t c0, c1;
    FU_TRY(done, "forward", rank_input(ctx, 0, rank, FSDP_DTYPE_F32, &x));
    FU_TRY(done, "forward", fsdp_module_forward1(m, x, &out));
    FU_TRY(done, "forward", tm_sum_loss(out, &loss));
    fsdp_pg_get_counters(pg, &c0);
    FU_TRY(done, "backward", fsdp_backward(loss, NULL));
    fsdp_pg_get_counters(pg, &c1);
    uint64_t rb = c1.bytes[FSDP_COLL_REDUCE_SCATTER] - c0.bytes[FSDP_COLL_REDUCE_SCATTER];
    int64_t padded = total_padded(root);
    fu_ck(r, rb == (uint64_t)padded * fsdp_dtype_size(rdt),
          "an eval backward reduces in f32 with the flag, in reduce_dtype f16 without",
          "the reduce-scatters moved %llu bytes, want %lld elements of %s", (unsigned long long)rb,
          (long long)padded, fsdp_dtype_name(rdt));
    fsdp_summon_options_t so;
    fsdp_summon_options_init(&so);
    so.writeback = false;
    so.with_grads = true;
    FU_TRY(done, "summon", fsdp_summon_begin(root, &so));
    double worst = 0;
    for (int k = 0; k < 2; k++) {
        double v[D * D];
        fsdp_tensor_t *gr = fsdp_tensor_grad(fsdp_module_param(m, WNAME[1][k]));
        if (!gr || read_vals(gr, v, D * D) < 0)
            worst = INFINITY;
        else
            worst = fmax(worst, scaled_err(v, g[k], D * D, ej->on ? 1e-5 : 4e-3, 1e-6));
    }
    fu_ck(r, worst <= 1.0, "the eval backward's gradients match the reference's",
          "the gradients are %.3g of the tolerance from the %s", worst,
          ej->flag ? "f32 reference" : "reference reduced in f16");
    FU_TRY(done, "summon", fsdp_summon_end(root));
done:
    fsdp_tensor_release(x);
    fsdp_tensor_release(out);
    fsdp_tensor_release(loss);
    fsdp_named_list_free(&params);
    fu_teardown(ctx, m, root, NULL, NULL);
    fsdp_module_release(local);
    return rc;
}

/* MP-S11. */
typedef struct s11_job {
    fu_job_t j; /* first */
    bool flag, composable;
} s11_job_t;

static int s11_rank(fsdp_ctx_t *ctx, void *arg) {
    static const char *const layers[] = {"TransformerEncoderLayer", "TransformerDecoderLayer",
                                         NULL};
    s11_job_t *sj = arg;
    fu_job_t *j = &sj->j;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_policy_t *p = NULL;
    fsdp_named_list_t params = {0};
    fsdp_tensor_t *src = NULL, *tgt = NULL, *out = NULL, *loss = NULL;
    char why[300];
    int rc;
    fsdp_options_t o;
    fu_job_options(j, &o);
    o.mixed_precision = j->mp;
    o.use_full_prec_in_eval = sj->flag;
    FU_TRY(done, "setting up", tm_transformer_create(ctx, true, false, &m));
    FU_TRY(done, "setting up", fsdp_policy_module_types_create(layers, &p));
    o.auto_wrap_policy = p;
    if (sj->composable)
        FU_TRY(done, "fully_shard", fsdp_fully_shard(m, &o, &root));
    else
        FU_TRY(done, "wrapping", fsdp_wrap(m, &o, &root));
    FU_TRY(done, "setting up", fsdp_named_params(root, &params));
    FU_TRY(done, "input", tm_transformer_get_input(ctx, &src, &tgt));
    for (int phase = 0; phase < 2; phase++) {
        bool train = phase == 0;
        fsdp_module_train(m, train);
        FU_TRY(done, "forward", tm_transformer_forward(m, src, tgt, &out));
        FU_TRY(done, "forward", tm_transformer_loss(tgt, out, &loss));
        fsdp_dtype_t want = train || !sj->flag ? FSDP_DTYPE_F16 : FSDP_DTYPE_F32;
        fu_ck(r, fsdp_tensor_dtype(loss) == want,
              train ? "the train loss is f16"
                    : "the eval loss is f32 with full precision in eval, f16 without",
              "the loss is %s, want %s", fsdp_dtype_name(fsdp_tensor_dtype(loss)),
              fsdp_dtype_name(want));
        if (train) {
            FU_TRY(done, "backward", fsdp_backward(loss, NULL));
            bool f32 = true;
            size_t ng = 0;
            for (size_t i = 0; i < params.n && f32; i++) {
                fsdp_tensor_t *g = fsdp_tensor_grad(params.tensors[i]);
                if (!g) continue;
                ng++;
                if (fsdp_tensor_dtype(g) != FSDP_DTYPE_F32) {
                    snprintf(why, sizeof why, "the gradient of '%s' is %s", params.names[i],
                             fsdp_dtype_name(fsdp_tensor_dtype(g)));
                    f32 = false;
                }
            }
            fu_ck(r, f32 && ng > 0, "after the train backward every gradient is f32 (upcast)",
                  "%s (%zu gradients)", f32 ? "no gradient" : why, ng);
        }
        drop_iteration(ctx, NULL, &out, &loss);
    }
done:
    fsdp_tensor_release(src);
    fsdp_tensor_release(tgt);
    fsdp_tensor_release(out);
    fsdp_tensor_release(loss);
    fsdp_named_list_free(&params);
    fu_teardown(ctx, m, root, NULL, NULL);
    fsdp_policy_release(p);
    return rc;
}

static void run_s11(int world, bool composable, bool cast, bool flag) {
    s11_job_t *sj = calloc(1, sizeof *sj);
    if (!sj) tap_bail("out of memory");
    char prefix[160];
    snprintf(prefix, sizeof prefix, "MP-S11 %s, cast_forward_inputs %s, use_full_prec_in_eval %s",
             composable ? "fully_shard(policy)" : "wrap(policy)", cast ? "on" : "off",
             flag ? "on" : "off");
    fu_job_init(&sj->j, prefix, world, FSDP_FULL_SHARD, composable);
    fsdp_mixed_precision_init(&sj->j.mp);
    sj->j.mp.enabled = true;
    sj->j.mp.param_dtype = sj->j.mp.reduce_dtype = sj->j.mp.buffer_dtype = FSDP_DTYPE_F16;
    sj->j.mp.cast_forward_inputs = cast;
    sj->flag = flag;
    sj->composable = composable;
    fu_run_job(&sj->j, s11_rank);
    free(sj);
}

static bool bnnet_never(fsdp_module_t *m, bool recurse, int64_t numel, void *arg) {
    (void)m, (void)recurse, (void)numel, (void)arg;
    return false;
}

/* ---- MP-S09 --------------------------------------------------------------------------------- */

/* BatchNormNet's forward; impl non-NULL (the twin): the norms run in f32 between casts, as the
 * units that mixed precision leaves out do. */
static int bnnet_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                         fsdp_tensor_t **out) {
    (void)nin, (void)nout;
    bool by_hand = fsdp_module_impl(m) != NULL;
    const int64_t s3[3] = {-1, 4, 10}, s2[2] = {-1, 40};
    fsdp_tensor_t *a = NULL, *b = NULL;
    int rc = fsdp_module_forward1(fsdp_module_child(m, "fc1"), in[0], &a);
#define STEP(call)                                                                                 \
    do {                                                                                           \
        if (rc == 0) rc = (call);                                                                  \
        fsdp_tensor_release(a);                                                                    \
        a = b;                                                                                     \
        b = NULL;                                                                                  \
    } while (0)
#define NORM(name)                                                                                 \
    do {                                                                                           \
        fsdp_dtype_t was = a ? fsdp_tensor_dtype(a) : FSDP_DTYPE_F32;                              \
        if (by_hand) STEP(cast_to(a, FSDP_DTYPE_F32, &b));                                         \
        STEP(fsdp_module_forward1(fsdp_module_child(m, name), a, &b));                             \
        if (by_hand) STEP(cast_to(a, was, &b));                                                    \
    } while (0)
    STEP(fsdp_reshape(a, 3, s3, &b));
    NORM("bn");
    STEP(fsdp_reshape(a, 2, s2, &b));
    STEP(fsdp_module_forward1(fsdp_module_child(m, "fc2"), a, &b));
    NORM("ln");
    STEP(fsdp_module_forward1(fsdp_module_child(m, "fc3"), a, &b));
    STEP(fsdp_softmax(a, 1, &b));
#undef NORM
#undef STEP
    if (rc < 0) {
        fsdp_tensor_release(a);
        return rc;
    }
    out[0] = a;
    return FSDP_OK;
}

static const fsdp_module_ops_t BNNET_OPS = {"BatchNormNet", bnnet_forward, NULL};
static char by_hand_mark;

static int bnnet_create(fsdp_ctx_t *ctx, bool by_hand, fsdp_module_t **out) {
    fsdp_module_t *m = NULL, *c = NULL;
    tm_manual_seed(ctx, 31);
    int rc = fsdp_module_create(ctx, &BNNET_OPS, by_hand ? &by_hand_mark : NULL, &m);
#define CHILD(name, call)                                                                          \
    do {                                                                                           \
        if (rc == 0) rc = (call);                                                                  \
        if (rc == 0) rc = fsdp_module_add_child(m, name, c);                                       \
        fsdp_module_release(c);                                                                    \
        c = NULL;                                                                                  \
    } while (0)
    CHILD("fc1", fsdp_linear_create(ctx, 2, 40, false, &c));
    CHILD("bn", fsdp_batchnorm_create(ctx, 1, 4, 1e-5, 0.1, &c));
    CHILD("fc2", fsdp_linear_create(ctx, 40, 4, true, &c));
    CHILD("ln", fsdp_layernorm_create(ctx, 4, 1e-5, true, &c));
    CHILD("fc3", fsdp_linear_create(ctx, 4, 4, true, &c));
#undef CHILD
    /* the twin's Linears compute in f16 */
    static const char *const lin[] = {"fc1.weight", "fc2.weight", "fc2.bias", "fc3.weight",
                                      "fc3.bias"};
    for (size_t i = 0; by_hand && rc == 0 && i < sizeof lin / sizeof lin[0]; i++)
        rc = param_to(m, lin[i], FSDP_DTYPE_F16);
    if (rc < 0) {
        fsdp_module_release(m);
        m = NULL;
    }
    *out = m;
    return rc;
}

static int s09_rank(fsdp_ctx_t *ctx, void *arg) {
    static const char *const ignore[] = {FSDP_TYPE_BATCHNORM, "LayerNorm", NULL};
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL, *twin = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_policy_t *never = NULL;
    fsdp_tensor_t *x = NULL, *hx = NULL, *out = NULL, *tout = NULL, *loss = NULL, *tl = NULL;
    fsdp_named_list_t tp = {0};
    char warn[2048];
    int rc;
    fsdp_options_t o;
    fu_job_options(j, &o);
    o.mixed_precision = j->mp;
    o.mixed_precision.module_classes_to_ignore = ignore;
    FU_TRY(done, "setting up", bnnet_create(ctx, false, &m));
    FU_TRY(done, "setting up", bnnet_create(ctx, true, &twin));
    FU_TRY(done, "setting up", fsdp_policy_callback_create(bnnet_never, NULL, &never));
    o.auto_wrap_policy = never;
    uint64_t w0 = fsdp_ctx_warnings(ctx, NULL, 0);
    FU_TRY(done, "wrapping", fsdp_wrap(m, &o, &root));
    uint64_t nw = fsdp_ctx_warnings(ctx, warn, sizeof warn) - w0;
    fu_ck(r, nw >= 1 && strstr(warn, "These modules will be wrapped as separate FSDP"),
          "constructing warns \"These modules will be wrapped as separate FSDP\"",
          "%llu warnings, the last: %s", (unsigned long long)nw, nw ? warn : "none");
    bool shape = true;
    char why[300] = "";
    for (int k = 0; k < 5; k++) {
        static const char *const names[] = {"fc1", "bn", "fc2", "ln", "fc3"};
        fsdp_unit_t *u = fsdp_unit_of(fsdp_module_child(m, names[k]));
        bool want_unit = k == 1 || k == 3;
        fsdp_options_t uo;
        if (want_unit != (u != NULL) ||
            (u && (fsdp_unit_options(u, &uo) < 0 || uo.mixed_precision.enabled))) {
            snprintf(why, sizeof why, "%s %s", names[k],
                     u ? "is a unit with mixed precision or should not be one" : "is not a unit");
            shape = false;
        }
    }
    fsdp_options_t ro;
    shape = shape && fsdp_unit_options(root, &ro) == 0 && ro.mixed_precision.enabled &&
            ro.mixed_precision.param_dtype == FSDP_DTYPE_F16;
    fu_ck(r, shape,
          "bn and ln are units without mixed precision, fc1..fc3 are not units, the root keeps "
          "f16",
          "%s", why[0] ? why : "the root's mixed precision changed");
    /* the same input on every rank: the averaged gradient is the twin's */
    const int64_t xs[2] = {8, 2};
    FU_TRY(done, "input", fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, xs, FSDP_MEM_OTHER, &x));
    tm_manual_seed(ctx, 5);
    FU_TRY(done, "input", fsdp_tensor_uniform_(x, -1.0, 1.0));
    FU_TRY(done, "input", fsdp_to_dtype(x, FSDP_DTYPE_F16, &hx));
    FU_TRY(done, "FSDP forward", fsdp_module_forward1(m, x, &out));
    FU_TRY(done, "FSDP forward", tm_sum_loss(out, &loss));
    FU_TRY(done, "FSDP backward", fsdp_backward(loss, NULL));
    fsdp_tape_clear(ctx);
    FU_TRY(done, "twin", fsdp_module_forward1(twin, hx, &tout));
    FU_TRY(done, "twin", tm_sum_loss(tout, &tl));
    FU_TRY(done, "twin", fsdp_backward(tl, NULL));
    fsdp_tape_clear(ctx);
    double cl = fu_tensor_closeness(out, tout, FU_F16_RTOL, FU_F16_ATOL);
    fu_ck(r, fsdp_tensor_dtype(out) == FSDP_DTYPE_F16 && cl >= 0 && cl <= 1.0,
          "the output is f16 and matches the twin's within f16 tolerance",
          "%s output, %.3g of "
          "tolerance",
          fsdp_dtype_name(fsdp_tensor_dtype(out)), cl);
    double worst = 0;
    why[0] = 0;
    FU_TRY(done, "summon", grads_vs_twin(root, m, twin, 1.0, 4e-3, 1e-6, &worst, why, sizeof why));
    fu_ck(r, worst <= 1.0, "every gradient matches the twin's (4e-3 of the largest)",
          "%.3g of the tolerance %s", worst, why);
done:
    fsdp_tensor_release(x);
    fsdp_tensor_release(hx);
    fsdp_tensor_release(out);
    fsdp_tensor_release(tout);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(tl);
    fsdp_named_list_free(&tp);
    fu_teardown(ctx, m, root, NULL, NULL);
    fsdp_module_release(twin);
    fsdp_policy_release(never);
    return rc;
}

/* UOP-WB-05: twin 0 runs the sequence, twin 1 only its train steps. */
typedef struct wb5_job {
    fu_job_t j; /* first */
    bool flag;
} wb5_job_t;

/* One forward of m (train or eval), optionally its backward and an SGD step; the graph is
 * dropped afterwards (a C caller's equivalent of discarding the output). */
static int wb5_step(fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_optim_t *opt, bool train, bool backward,
                    uint64_t seed) {
    fsdp_tensor_t *x = NULL, *out = NULL, *loss = NULL;
    fsdp_module_train(m, train);
    int rc = fu_rand_input(ctx, seed, 4, 5, &x);
    if (rc == 0) rc = fsdp_module_forward1(m, x, &out);
    if (rc == 0 && backward) rc = tm_sum_loss(out, &loss);
    if (rc == 0 && backward) rc = fsdp_backward(loss, NULL);
    if (rc == 0 && backward) rc = fsdp_optim_step(opt);
    if (rc == 0 && backward) rc = fsdp_optim_zero_grad(opt, true);
    fsdp_tensor_release(x);
    fsdp_tensor_release(out);
    fsdp_tensor_release(loss);
    fsdp_tape_clear(ctx);
    return rc;
}

static int wb5_rank(fsdp_ctx_t *ctx, void *arg) {
    static const char *const lin[] = {"Linear", NULL};
    wb5_job_t *wj = arg;
    fu_job_t *j = &wj->j;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m[2] = {NULL, NULL};
    fsdp_unit_t *root[2] = {NULL, NULL};
    fsdp_optim_t *opt[2] = {NULL, NULL};
    fsdp_named_list_t params[2] = {{0}, {0}};
    int rc = FSDP_OK;
    fsdp_options_t o;
    fu_job_options(j, &o);
    o.mixed_precision = j->mp;
    o.use_full_prec_in_eval = wj->flag;
    for (int t = 0; t < 2; t++) {
        FU_TRY(done, "setting up", fu_linear_stack(ctx, 3, 5, &m[t]));
        FU_TRY(done, "wrapping", fu_wrap_types(m[t], &o, lin, &root[t]));
        FU_TRY(done, "setting up", fsdp_named_params(root[t], &params[t]));
        FU_TRY(done, "setting up", fu_make_sgd(ctx, &params[t], 0.05, 0.0, &opt[t]));
    }
    /* 1. train forward -> summon (empty) -> forward */
    rc = wb5_step(ctx, m[0], opt[0], true, false, 1);
    if (rc == 0) rc = fsdp_summon_begin(root[0], NULL);
    if (rc == 0) rc = fsdp_summon_end(root[0]);
    if (rc == 0) rc = wb5_step(ctx, m[0], opt[0], true, false, 2);
    fu_ck(r, rc == 0, "1. train forward, summon, forward", "%s: %s", fsdp_err_name(rc),
          fsdp_ctx_last_error(ctx));
    /* 2. train forward -> eval forward */
    if (rc == 0) rc = wb5_step(ctx, m[0], opt[0], true, false, 3);
    if (rc == 0) rc = wb5_step(ctx, m[0], opt[0], false, false, 4);
    fu_ck(r, rc == 0, "2. train forward, eval forward", "%s: %s", fsdp_err_name(rc),
          fsdp_ctx_last_error(ctx));
    /* 3. train forward and backward -> eval forward */
    if (rc == 0) rc = wb5_step(ctx, m[0], opt[0], true, true, 5);
    if (rc == 0) rc = wb5_step(ctx, m[0], opt[0], false, false, 6);
    fu_ck(r, rc == 0, "3. train step, eval forward", "%s: %s", fsdp_err_name(rc),
          fsdp_ctx_last_error(ctx));
    /* a switch to full precision while a train forward's graph awaits its backward is
     * refused, and the unit goes on once the graph is dropped */
    if (rc == 0 && wj->flag) {
        fsdp_tensor_t *x = NULL, *out = NULL, *out2 = NULL;
        fsdp_module_train(m[0], true);
        rc = fu_rand_input(ctx, 9, 4, 5, &x);
        if (rc == 0) rc = fsdp_module_forward1(m[0], x, &out);
        fsdp_module_train(m[0], false);
        int refused = rc == 0 ? fsdp_module_forward1(m[0], x, &out2) : rc;
        fu_ck_einval(r, ctx, refused, "graph", "backward",
                     "an eval forward that would switch precision under a live graph is "
                     "FSDP_EINVAL naming the graph");
        fsdp_tensor_release(out2);
        fsdp_tensor_release(out);
        out = out2 = NULL;
        fsdp_tape_clear(ctx);
        if (rc == 0) rc = fsdp_module_forward1(m[0], x, &out);
        fu_ck(r, rc == 0 && fsdp_tensor_dtype(out) == FSDP_DTYPE_F32,
              "after the graph is dropped the eval forward runs, in f32", "%s: %s",
              fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
        fsdp_tensor_release(out);
        fsdp_tensor_release(x);
        fsdp_tape_clear(ctx);
    }
    /* 5. train forward and backward */
    if (rc == 0) rc = wb5_step(ctx, m[0], opt[0], true, true, 7);
    fu_ck(r, rc == 0, "5. train step", "%s: %s", fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
    if (rc < 0) goto done;
    FU_TRY(done, "twin", wb5_step(ctx, m[1], opt[1], true, true, 5));
    FU_TRY(done, "twin", wb5_step(ctx, m[1], opt[1], true, true, 7));
    bool same = params[0].n == params[1].n;
    for (size_t i = 0; i < params[0].n && same; i++)
        same = fu_same_bits(params[0].tensors[i], params[1].tensors[i]) == 1;
    fu_ck(r, same,
          "the parameters after the train steps are bitwise a twin's that ran no eval forward "
          "and no summon",
          "they differ");
done:
    for (int t = 0; t < 2; t++) {
        fsdp_named_list_free(&params[t]);
        fu_teardown(ctx, m[t], root[t], NULL, opt[t]);
    }
    return rc;
}

static void run_wb5(int world, bool flag) {
    wb5_job_t *wj = calloc(1, sizeof *wj);
    if (!wj) tap_bail("out of memory");
    char prefix[160];
    snprintf(prefix, sizeof prefix,
             "UOP-WB-05 SHARD_GRAD_OP, param f16, use_orig_params, use_full_prec_in_eval %s",
             flag ? "on" : "off");
    fu_job_init(&wj->j, prefix, world, FSDP_SHARD_GRAD_OP, true);
    fsdp_mixed_precision_init(&wj->j.mp);
    wj->j.mp.enabled = true;
    wj->j.mp.param_dtype = FSDP_DTYPE_F16;
    wj->flag = flag;
    fu_run_job(&wj->j, wb5_rank);
    free(wj);
}

/* env: the value FSDP_USE_FULL_PREC_IN_EVAL has while the job wraps (NULL: unset). */
static void run_eval(const char *id, fsdp_sim_fn fn, int world, bool flag, const char *env,
                     bool param_half, bool s10) {
    eval_job_t *ej = calloc(1, sizeof *ej);
    if (!ej) tap_bail("out of memory");
    char prefix[160];
    snprintf(prefix, sizeof prefix, "%s use_full_prec_in_eval %s, FSDP_USE_FULL_PREC_IN_EVAL %s",
             id, flag ? "on" : "off", env ? env : "unset");
    if (env)
        setenv("FSDP_USE_FULL_PREC_IN_EVAL", env, 1); /* no rank thread runs yet */
    else
        unsetenv("FSDP_USE_FULL_PREC_IN_EVAL");
    ej->on = flag || (env && strcmp(env, "1") == 0);
    fu_job_init(&ej->j, prefix, world, FSDP_FULL_SHARD, true);
    ej->flag = flag;
    ej->s10 = s10;
    fsdp_mixed_precision_init(&ej->j.mp);
    ej->j.mp.enabled = true;
    if (param_half) {
        ej->j.mp.param_dtype = ej->j.mp.reduce_dtype = ej->j.mp.buffer_dtype = FSDP_DTYPE_F16;
        ej->j.mp.cast_forward_inputs = true;
    } else {
        ej->j.mp.param_dtype = ej->j.mp.buffer_dtype = FSDP_DTYPE_F32;
        ej->j.mp.reduce_dtype = FSDP_DTYPE_F16;
        ej->j.mp.module_classes_to_ignore = NULL;
    }
    fu_run_job(&ej->j, fn);
    unsetenv("FSDP_USE_FULL_PREC_IN_EVAL");
    free(ej);
}

int main(void) {
    tap_plan_lazy();
    /* MP-S01 / MP-U02: SHARD_GRAD_OP, offload, f64 masters, all f16 and the bf16-buffer
     * config, no prefetch */
    const int s01_cfgs[2] = {0, 4};
    for (int w = 1; w <= 2; w++)
        for (int c = 0; c < 2; c++)
            for (int nested = 0; nested < 2; nested++)
                run_e2e(w == 2 ? "MP-S01" : "MP-U02", w, FSDP_SHARD_GRAD_OP, &CFGS[s01_cfgs[c]],
                        true, FSDP_DTYPE_F64, nested, 0, false);
    /* MP-S02: FULL_SHARD over the table x offload x masters x the gradient scaler at world 2,
     * the prefetch modes and the two models cycled over the jobs; at world 4 the table with
     * f32 masters */
    int mode = 0;
    for (size_t c = 0; c < NCFG; c++)
        for (int off = 0; off < 2; off++)
            for (int f64 = 0; f64 < 2; f64++)
                for (int sc = 0; sc < 2; sc++) {
                    run_e2e("MP-S02", 2, FSDP_FULL_SHARD, &CFGS[c], off,
                            f64 ? FSDP_DTYPE_F64 : FSDP_DTYPE_F32, (mode & 1) != 0, mode % 6, sc);
                    mode++;
                }
    for (size_t c = 0; c < NCFG; c++)
        run_e2e("MP-S02", 4, FSDP_FULL_SHARD, &CFGS[c], c % 2, FSDP_DTYPE_F32, true, (int)c,
                c % 2 == 0);
    /* MP-U03: FULL_SHARD, default_mp and the bf16-buffer config, offload, f64, world 1 */
    run_e2e("MP-U03", 1, FSDP_FULL_SHARD, &CFGS[0], true, FSDP_DTYPE_F64, true, 0, false);
    run_e2e("MP-U03", 1, FSDP_FULL_SHARD, &CFGS[4], true, FSDP_DTYPE_F64, true, 0, false);
    /* NO_SHARD under the same procedure (spec F05 x mixed precision) */
    run_e2e("MP-S02", 2, FSDP_NO_SHARD, &CFGS[0], false, FSDP_DTYPE_F32, true, 0, true);
    run_e2e("MP-S02", 2, FSDP_NO_SHARD, &CFGS[4], true, FSDP_DTYPE_F64, true, 0, false);
    /* MP-S08 / MP-U01 */
    for (int w = 2; w >= 1; w--)
        for (int off = 0; off < 2; off++)
            for (int orig = 0; orig < 2; orig++)
                run_s08(w == 2 ? "MP-S08" : "MP-U01", w, off, orig);
    /* MP-S10..S13 */
    for (int flag = 0; flag < 2; flag++) {
        run_eval("MP-S10", eval_rank, 2, flag, NULL, true, true);
        run_eval("MP-S12", eval_rank, 2, flag, NULL, true, false);
        run_eval("MP-S13", s13_rank, 2, flag, NULL, false, false);
    }
    for (int comp = 0; comp < 2; comp++)
        for (int cast = 0; cast < 2; cast++)
            for (int flag = 0; flag < 2; flag++)
                run_s11(2, comp, cast, flag);
    for (int flag = 0; flag < 2; flag++)
        run_wb5(2, flag);
    for (int w = 1; w <= 2; w++) {
        fu_job_t *j = fu_job_new("MP-S09 BatchNormNet, f16 x3, norms ignored, never-wrap", w,
                                 FSDP_FULL_SHARD, true);
        fsdp_mixed_precision_init(&j->mp);
        j->mp.enabled = true;
        j->mp.param_dtype = j->mp.reduce_dtype = j->mp.buffer_dtype = FSDP_DTYPE_F16;
        fu_run_job(j, s09_rank);
        free(j);
    }
    /* the environment variable as PyTorch reads it: "1" turns it on, anything else not */
    run_eval("MP-S10", eval_rank, 2, false, "1", true, true);
    run_eval("MP-S10", eval_rank, 2, false, "0", true, true);
    run_eval("MP-S12", eval_rank, 1, false, "1", true, false);
    run_eval("MP-S13", s13_rank, 4, false, "1", false, false);
    return tap_done();
}
