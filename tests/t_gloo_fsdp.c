/* SPDX-License-Identifier: MIT */
/*
 * t_gloo_fsdp.c: FSDP over the Gloo backend, rank processes on loopback, against the same runs on
 * the sim backend (issue: "FSDP parity on Gloo"; seed 000's CORE-P01..P08 subset: FULL_SHARD,
 * SHARD_GRAD_OP and NO_SHARD at world 2, HYBRID_SHARD and _HYBRID_SHARD_ZERO2 as 2 x 2 at
 * world 4, FULL_SHARD and NO_SHARD at world 3).
 *
 * One rank function trains TransformerWithSharedParams (wrapped as upstream's RECURSIVE init
 * does: 5 units) for 3 SGD(0.01, momentum 0.9) steps and records every rank's losses and, after
 * the steps, the summoned full parameters. mp_run_job() runs it on Gloo processes, fu_run_job()
 * on sim threads, with the same seed. The Gloo backend's reduce-scatter and all-reduce add in
 * rank order as the sim's do, and all-gathers and broadcasts only move bytes, so every strategy
 * must agree with the sim backend bit for bit at any world size (on a mismatch the closeness
 * under spec section 0's fp32 tolerances is printed too).
 *
 * Built a second time as t_nccl_fsdp (make check-gpu, GP_NCCL): the same rank function on NCCL
 * processes, one per GPU, each with its GPU as the context's device, so that the model, the
 * shards and every collective live on the GPUs; FULL_SHARD, SHARD_GRAD_OP and NO_SHARD at the
 * world size of the GPUs present (1 on a single-GPU machine, up to 4), and HYBRID_SHARD 2 x 2
 * with 4 GPUs or more. The reference is the sim run on the CPU at the same world size: the GPU's
 * kernels are not the CPU's, so losses and parameters must agree within the fp32 tolerances
 * (rtol 1.3e-6, atol 1e-5), not bitwise. Skips without NCCL or a GPU.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "mp_run.h"
#include "models/models.h"
#include "tap.h"

#define GP_STEPS 3
#define GP_MAXP 32768

typedef struct gp_job {
    fu_job_t base; /* first */
    bool hybrid;   /* 2 x 2: shard within (rank / 2), replicate across (rank % 2) */
    double loss[FU_MAXR][GP_STEPS];
    size_t nparams;
    double params[GP_MAXP]; /* rank 0's summoned full parameters after the steps */
} gp_job_t;

static int gp_rank(fsdp_ctx_t *ctx, void *arg) {
    gp_job_t *j = arg;
    fu_res_t *r = fu_res_of(&j->base, ctx);
    int rank = fsdp_ctx_rank(ctx), rc;
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_pg_t *shard = NULL, *repl = NULL;
    fsdp_tensor_t *out = NULL, *tgt = NULL, *loss = NULL;
    fu_vals_t vals = {0};
    bool summoned = false;
    fsdp_options_t o;
    fu_job_options(&j->base, &o);
    if (j->hybrid) {
        FU_TRY(done, "the shard groups", fsdp_pg_split(fsdp_ctx_pg(ctx), rank / 2, rank, &shard));
        FU_TRY(done, "the replica groups", fsdp_pg_split(fsdp_ctx_pg(ctx), rank % 2, rank, &repl));
        o.pg = shard;
        o.replicate_pg = repl;
    }
    tm_manual_seed(ctx, 0);
    FU_TRY(done, "TransformerWithSharedParams", tm_transformer_create(ctx, true, true, &m));
    FU_TRY(done, "wrapping", fu_wrap_transformer_opts(m, &o, &root));
    FU_TRY(done, "the optimizer", fu_make_fsdp_sgd(ctx, root, 0.01, 0.9, &opt));
    for (int s = 0; s < GP_STEPS; s++) {
        double v = NAN;
        FU_TRY(done, "forward", fu_transformer_forward(ctx, m, &out, &tgt));
        FU_TRY(done, "loss", tm_transformer_loss(tgt, out, &loss));
        FU_TRY(done, "backward", fsdp_backward(loss, NULL));
        FU_TRY(done, "step", fsdp_optim_step(opt));
        FU_TRY(done, "zero_grad", fsdp_optim_zero_grad(opt, true));
        FU_TRY(done, "reading the loss", fsdp_tensor_item(loss, 0, &v));
        j->loss[rank][s] = v;
        fsdp_tensor_release(out);
        fsdp_tensor_release(tgt);
        fsdp_tensor_release(loss);
        out = tgt = loss = NULL;
    }
    fu_ck(r, fu_tree_idle(root), "after 3 steps every unit is idle and resharded",
          "a unit was left running");
    FU_TRY(done, "summon", fu_summon_nowb(root));
    summoned = true;
    FU_TRY(done, "reading the parameters", fu_module_values(m, false, false, &vals));
    fu_ck(r, vals.n > 0 && vals.n <= GP_MAXP, "the full parameters fit the job", "%zu values",
          vals.n);
    if (rank == 0 && vals.n <= GP_MAXP) {
        memcpy(j->params, vals.v, vals.n * sizeof *vals.v);
        j->nparams = vals.n;
    }
done:
    if (summoned) fsdp_summon_end(root);
    fu_vals_free(&vals);
    fsdp_tensor_release(out);
    fsdp_tensor_release(tgt);
    fsdp_tensor_release(loss);
    fu_teardown(ctx, m, root, NULL, opt);
    fsdp_pg_destroy(shard);
    fsdp_pg_destroy(repl);
    return rc < 0 ? rc : FSDP_OK;
}

#ifdef GP_NCCL
#define GP_BACKEND MP_NCCL
#define GP_NAME "nccl"
#else
#define GP_BACKEND MP_GLOO
#define GP_NAME "gloo"
#endif

/* Compares the Gloo run g with the sim run s, bit for bit; the closeness under the fp32
 * tolerances is shown when they differ. NCCL: within the tolerances. */
static void compare(const gp_job_t *g, const gp_job_t *s, const char *what) {
    int w = g->base.world;
    bool bits = g->nparams == s->nparams && g->nparams > 0 &&
                memcmp(g->params, s->params, g->nparams * sizeof(double)) == 0;
    double worst = 0;
    for (int r = 0; r < w; r++)
        for (int k = 0; k < GP_STEPS; k++) {
            bits &= memcmp(&g->loss[r][k], &s->loss[r][k], sizeof(double)) == 0;
            double c = fu_closeness(g->loss[r][k], s->loss[r][k], FU_F32_RTOL, FU_F32_ATOL);
            if (!(c <= worst)) worst = isnan(c) ? INFINITY : c;
        }
    double worst_p = g->nparams == s->nparams && g->nparams > 0 ? 0 : INFINITY;
    for (size_t i = 0; i < g->nparams && i < s->nparams; i++) {
        double c = fu_closeness(g->params[i], s->params[i], FU_F32_RTOL, FU_F32_ATOL);
        if (!(c <= worst_p)) worst_p = isnan(c) ? INFINITY : c;
    }
#ifdef GP_NCCL
    tap_ok(worst <= 1.0 && worst_p <= 1.0,
           "%s W=%d nccl on GPUs vs sim on the CPU: every rank's 3 losses and the %zu trained "
           "parameters agree within rtol 1.3e-6, atol 1e-5 (worst closeness %.3g, %.3g)",
           what, w, g->nparams, worst, worst_p);
    return;
#endif
    tap_ok(bits,
           "%s W=%d gloo vs sim: every rank's 3 losses and the %zu trained parameters are "
           "bitwise the same",
           what, w, g->nparams);
    if (!bits)
        tap_diag("worst closeness (rtol 1.3e-6, atol 1e-5): losses %.3g, parameters %.3g", worst,
                 worst_p);
}

static void run_case(const char *what, int world, fsdp_sharding_strategy_t st, bool hybrid) {
    gp_job_t *g = calloc(1, sizeof *g), *s = calloc(1, sizeof *s);
    if (!g || !s) tap_bail("out of memory");
    char prefix[160];
    snprintf(prefix, sizeof prefix, "%s " GP_NAME, what);
    fu_job_init(&g->base, prefix, world, st, false);
    g->hybrid = hybrid;
    int rc = mp_run_job_on(&g->base, sizeof *g, gp_rank, GP_BACKEND);
    snprintf(prefix, sizeof prefix, "%s sim", what);
    fu_job_init(&s->base, prefix, world, st, false);
    s->hybrid = hybrid;
    fu_run_job(&s->base, gp_rank);
    if (rc == 0)
        compare(g, s, what);
    else
        tap_ok(false, "%s W=%d " GP_NAME " vs sim: the " GP_NAME " run failed (%s)", what, world,
               fsdp_err_name(rc));
    free(g);
    free(s);
}

int main(void) {
    setenv("FSDP_LOG", "warn", 1);
#ifdef GP_NCCL
    if (!fsdp_nccl_available()) return tap_skip_all("libfsdp was built without NCCL");
    int ngpu = mp_cuda_devices();
    if (ngpu < 1) return tap_skip_all("no CUDA device");
    int w = ngpu < FU_MAXR ? ngpu : FU_MAXR;
    tap_plan_lazy();
    run_case("CORE-P01 FULL_SHARD", w, FSDP_FULL_SHARD, false);
    run_case("CORE-P01 SHARD_GRAD_OP", w, FSDP_SHARD_GRAD_OP, false);
    run_case("CORE-P01 NO_SHARD", w, FSDP_NO_SHARD, false);
    if (ngpu >= 4) run_case("CORE-P01 HYBRID_SHARD 2x2", 4, FSDP_HYBRID_SHARD, true);
    return tap_done();
#endif
    if (!fsdp_gloo_available()) return tap_skip_all("libfsdp was built without Gloo");
    tap_plan_lazy();
    run_case("CORE-P01 FULL_SHARD", 2, FSDP_FULL_SHARD, false);
    run_case("CORE-P01 SHARD_GRAD_OP", 2, FSDP_SHARD_GRAD_OP, false);
    run_case("CORE-P01 NO_SHARD", 2, FSDP_NO_SHARD, false);
    run_case("CORE-P01 HYBRID_SHARD 2x2", 4, FSDP_HYBRID_SHARD, true);
    run_case("CORE-P01 _HYBRID_SHARD_ZERO2 2x2", 4, FSDP_HYBRID_SHARD_ZERO2, true);
    run_case("CORE-P01 FULL_SHARD", 3, FSDP_FULL_SHARD, false);
    run_case("CORE-P01 NO_SHARD", 3, FSDP_NO_SHARD, false);
    return tap_done();
}
