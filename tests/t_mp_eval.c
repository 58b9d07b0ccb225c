/* SPDX-License-Identifier: MIT */
/*
 * t_mp_eval.c: seed 003's full precision in eval, module kinds left out of mixed precision and
 * the no-reshard writeback sequence (spec section 6), on the sim backend, with the models and
 * the reference of mp_util.c:
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
#include "tap.h"

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
        FU_TRY(done, "setting up", mpt_lmp_create(ctx, 11, FSDP_DTYPE_F32, &a));
        rc = fsdp_module_append(m, a);
        fsdp_module_release(a);
        FU_TRY(done, "setting up", rc);
    } else {
        FU_TRY(done, "setting up", mpt_model_create(ctx, true, FSDP_DTYPE_F32, &m));
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
        fu_ck(r, mpt_buffers_are(m, wb, why, sizeof why),
              "MP-S12: after the forward every buffer has the phase's dtype", "%s: %s", ph, why);
        fu_ck(r, fsdp_tensor_dtype(loss) == wi,
              "the loss is f32 in eval with the flag, f16 otherwise", "%s: the loss is %s, want %s",
              ph, fsdp_dtype_name(fsdp_tensor_dtype(loss)), fsdp_dtype_name(wi));
        FU_TRY(done, "backward", fsdp_backward(loss, NULL));
        mpt_drop_iteration(ctx, &x, &out, &loss);
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
    mpt_ref_t ref = {.nlin = 2};
    int rc;
    fsdp_options_t o;
    fu_job_options(j, &o);
    o.mixed_precision = j->mp;
    o.use_full_prec_in_eval = ej->flag;
    int world = fsdp_ctx_world_size(ctx), rank = fsdp_ctx_rank(ctx);
    FU_TRY(done, "setting up", mpt_model_create(ctx, true, FSDP_DTYPE_F32, &m));
    FU_TRY(done, "setting up", mpt_model_create(ctx, true, FSDP_DTYPE_F32, &local));
    for (int k = 0; k < 2; k++)
        FU_TRY(done, "setting up",
               mpt_read_vals(fsdp_module_param(m, mpt_WNAME[1][k]), ref.w[k], D * D));
    FU_TRY(done, "wrapping", fsdp_wrap(fsdp_module_child(m, "0"), &o, &c));
    FU_TRY(done, "wrapping", fsdp_wrap(m, &o, &root));
    fsdp_module_train(m, false);
    fsdp_dtype_t rdt = ej->on ? FSDP_DTYPE_F32 : FSDP_DTYPE_F16;
    double g[NLIN_MAX][D * D] = {{0}}, gq[NLIN_MAX][D * D], lq, l1q;
    for (int q = 0; q < world; q++) {
        fsdp_tensor_t *xq = NULL;
        FU_TRY(done, "reference", mpt_rank_input(ctx, 0, q, FSDP_DTYPE_F32, &xq));
        rc = mpt_ref_grads(ctx, local, &ref, true, FSDP_DTYPE_F32, FSDP_DTYPE_F32, rdt, false, xq,
                           gq, &lq, &l1q);
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
    FU_TRY(done, "forward", mpt_rank_input(ctx, 0, rank, FSDP_DTYPE_F32, &x));
    FU_TRY(done, "forward", fsdp_module_forward1(m, x, &out));
    FU_TRY(done, "forward", tm_sum_loss(out, &loss));
    fsdp_pg_get_counters(pg, &c0);
    FU_TRY(done, "backward", fsdp_backward(loss, NULL));
    fsdp_pg_get_counters(pg, &c1);
    uint64_t rb = c1.bytes[FSDP_COLL_REDUCE_SCATTER] - c0.bytes[FSDP_COLL_REDUCE_SCATTER];
    int64_t padded = mpt_total_padded(root);
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
        fsdp_tensor_t *gr = fsdp_tensor_grad(fsdp_module_param(m, mpt_WNAME[1][k]));
        if (!gr || mpt_read_vals(gr, v, D * D) < 0)
            worst = INFINITY;
        else
            worst = fmax(worst, mpt_scaled_err(v, g[k], D * D, ej->on ? 1e-5 : 4e-3, 1e-6));
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
        mpt_drop_iteration(ctx, NULL, &out, &loss);
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
        if (by_hand) STEP(mpt_cast_to(a, FSDP_DTYPE_F32, &b));                                     \
        STEP(fsdp_module_forward1(fsdp_module_child(m, name), a, &b));                             \
        if (by_hand) STEP(mpt_cast_to(a, was, &b));                                                \
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
        rc = mpt_param_to(m, lin[i], FSDP_DTYPE_F16);
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
    FU_TRY(done, "summon",
           mpt_grads_vs_twin(root, m, twin, 1.0, 4e-3, 1e-6, &worst, why, sizeof why));
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
