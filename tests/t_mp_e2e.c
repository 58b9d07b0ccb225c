/* SPDX-License-Identifier: MIT */
/*
 * t_mp_e2e.c: seed 003's end-to-end mixed-precision procedure and low-precision gradients
 * (spec section 6), on the sim backend (t_mp_eval.c has the eval and per-module behaviours; the
 * models and the reference are mp_util.c's):
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
 *               previous plus the first, added and rounded in f16.
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
#include "mp_util.h"
#include "tap.h"

#define ITERS 3 /* e2e iterations */
#define LR 0.1  /* SGD */

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
    mpt_ref_t ref = {.nlin = nested ? 2 : 1};
    char why[760];
    int rc;
    fsdp_options_t o;
    fu_job_options(j, &o);
    o.mixed_precision = j->mp;
    o.check_exec_order = false; /* its all-gathers would count in the byte checks */
    FU_TRY(done, "setting up", mpt_model_create(ctx, nested, mdt, &m));
    FU_TRY(done, "setting up", mpt_model_create(ctx, nested, mdt, &local));
    for (int k = 0; k < ref.nlin; k++)
        FU_TRY(done, "setting up",
               mpt_read_vals(fsdp_module_param(m, mpt_WNAME[nested][k]), ref.w[k], D * D));
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
    int64_t padded = mpt_total_padded(root);
    for (int it = 0; it < ITERS; it++) {
        char ph[64], name[200];
        snprintf(ph, sizeof ph, "iteration %d", it + 1);
        /* reference: the average over ranks of the rank gradients, then the step */
        double g[NLIN_MAX][D * D] = {{0}}, gq[NLIN_MAX][D * D], lq = 0, my_ref_loss = 0, l1q = 0,
                               my_l1 = 0;
        for (int q = 0; q < world; q++) {
            fsdp_tensor_t *xq = NULL;
            FU_TRY(done, "reference", mpt_rank_input(ctx, it, q, mdt, &xq));
            rc = mpt_ref_grads(ctx, local, &ref, nested, mdt, cdt, rdt, cfg->param, xq, gq, &lq,
                               &l1q);
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
        FU_TRY(done, "FSDP forward", mpt_rank_input(ctx, it, rank, mdt, &x));
        FU_TRY(done, "FSDP forward", fsdp_module_forward1(m, x, &out));
        FU_TRY(done, "FSDP forward", tm_sum_loss(out, &loss));
        fsdp_pg_get_counters(pg, &c1);
        fu_ck(r, mpt_buffers_are(m, bdt, why, sizeof why),
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
        fu_ck(r, mpt_buffers_are(m, bdt, why, sizeof why),
              NM("after backward the buffers are still cast"), "buffers are not %s: %s",
              fsdp_dtype_name(bdt), why);
        fu_ck(r, mpt_none_unsharded_bytes(root, why, sizeof why),
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
            fsdp_tensor_t *w = fsdp_module_param(m, mpt_WNAME[nested][k]);
            double v[D * D];
            sdt = sdt && fsdp_tensor_dtype(w) == mdt;
            if (mpt_read_vals(w, v, D * D) < 0)
                worst = INFINITY;
            else
                worst = fmax(worst, mpt_scaled_err(v, ref.w[k], D * D, rel, absd));
        }
        fu_ck(r, sdt, NM("inside a summon the parameters are in the masters' dtype"),
              "inside the summon the parameters are not in the masters' dtype %s",
              fsdp_dtype_name(mdt));
        fu_ck(r, worst <= 1.0,
              NM("after the SGD step the full parameters match the reference's (half tolerance)"),
              "after the step the parameters are %.3g of the tolerance from the reference's",
              worst);
        if (cdt != mdt)
            fu_ck(r, mpt_none_unsharded_bytes(root, why, sizeof why),
                  NM("a summon allocates no compute-dtype unsharded parameter"),
                  "inside the summon: %s (it gathers full precision, not the compute dtype)", why);
        fu_ck(r, mpt_buffers_are(m, bdt, why, sizeof why),
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
                    if (strcmp(sdict.names[i], mpt_WNAME[nested][k]) != 0) continue;
                    if (mpt_read_vals(sdict.tensors[i], v, D * D) < 0)
                        sdw = INFINITY;
                    else
                        sdw = fmax(sdw, mpt_scaled_err(v, ref.w[k], D * D, rel, absd));
                }
            }
            fu_ck(r, sd_ok && sdw <= 1.0,
                  NM("FULL state dict: parameters in the masters' dtype with the reference's "
                     "values, buffers in their dtype from before wrapping (f64)"),
                  "%s; parameters %.3g of the tolerance", why, sdw);
        }
        fu_ck(r, mpt_buffers_are(m, bdt, why, sizeof why),
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
        mpt_drop_iteration(ctx, &x, &out, &loss);
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
        FU_TRY(done, "reference", mpt_param_to(half, hp.names[i], FSDP_DTYPE_F16));
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
        mpt_drop_iteration(ctx, NULL, &out, &loss);
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
               mpt_grads_vs_twin(root, m, half, 6.0, 6e-3, 1e-5, &worst, why, sizeof why));
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
    return tap_done();
}
