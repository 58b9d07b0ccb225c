/* SPDX-License-Identifier: MIT */
/*
 * t_ranks.c: per-rank state. Four sim ranks train a small GPT at the same time (each with its
 * own context: tape, random stream, device and memory accounting); every rank's losses and
 * final parameters must be bitwise those of the same rank trained alone, afterwards, on the
 * main thread. Runs under ThreadSanitizer in CI: any shared mutable state in the tensor, tape,
 * nn or optim layers shows up as a race here. Also checks that a second run of the same seed
 * gives the same bits (determinism).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "tap.h"

#define WORLD 4
#define STEPS 3

typedef struct {
    double loss[STEPS];
    double checksum;  /* sum of |p| over every parameter after the steps */
    double first[8];  /* the first elements of wte */
    int rc;
    size_t leaked;    /* bytes still accounted when the model is gone */
} result_t;

static int train(fsdp_ctx_t *ctx, result_t *res) {
    fsdp_gpt_config_t cfg;
    fsdp_gpt_config_init(&cfg);
    cfg.vocab = 32;
    cfg.max_seq = 8;
    cfg.n_layer = 2;
    cfg.n_head = 2;
    cfg.d_model = 16;
    cfg.dropout = 0.1; /* exercises each rank's random stream */
    fsdp_module_t *m = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_tensor_t *tok = NULL, *tgt = NULL;
    fsdp_named_list_t params = {0};
    fsdp_mem_stats_t before, after;
    fsdp_ctx_device(ctx); /* created first, so its own bookkeeping is in the baseline */
    fsdp_mem_get_stats(ctx, &before);
    int r = fsdp_ctx_rank(ctx), rc;
    int64_t shape[2] = {2, 8}, tv[16], gv[16];
    for (int i = 0; i < 16; i++) {
        tv[i] = (i * 7 + r * 3) % 32;
        gv[i] = (i * 5 + r + 1) % 32;
    }
    rc = fsdp_gpt_create(ctx, &cfg, &m);
    if (rc) goto out;
    fsdp_module_train(m, true);
    rc = fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, 2, shape, tv, FSDP_MEM_OTHER, &tok);
    if (rc == 0) rc = fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, 2, shape, gv, FSDP_MEM_OTHER, &tgt);
    if (rc == 0) rc = fsdp_module_named_params(m, false, &params);
    if (rc == 0) rc = fsdp_optim_adam_create(ctx, NULL, true, &opt);
    if (rc == 0)
        rc = fsdp_optim_add_group(opt, params.n, params.tensors, (const char *const *)params.names,
                                  NULL, NULL);
    for (int s = 0; s < STEPS && rc == 0; s++) {
        fsdp_tensor_t *loss = NULL;
        rc = fsdp_optim_zero_grad(opt, true);
        if (rc == 0) rc = fsdp_gpt_forward_loss(m, tok, tgt, &loss, NULL);
        if (rc == 0) rc = fsdp_tensor_item(loss, 0, &res->loss[s]);
        if (rc == 0) rc = fsdp_backward(loss, NULL);
        if (rc == 0) rc = fsdp_optim_step(opt);
        fsdp_tensor_release(loss);
    }
    res->checksum = 0;
    for (size_t i = 0; i < params.n && rc == 0; i++) {
        int64_t n = fsdp_tensor_numel(params.tensors[i]);
        float *v = malloc((size_t)n * sizeof *v);
        rc = fsdp_tensor_to_host(params.tensors[i], v, (size_t)n * sizeof *v);
        for (int64_t j = 0; j < n && rc == 0; j++) res->checksum += fabs((double)v[j]);
        if (i == 0)
            for (int j = 0; j < 8 && j < n; j++) res->first[j] = v[j];
        free(v);
    }
out:
    fsdp_named_list_free(&params);
    fsdp_optim_destroy(opt);
    fsdp_tensor_release(tok);
    fsdp_tensor_release(tgt);
    fsdp_module_release(m);
    fsdp_mem_get_stats(ctx, &after);
    res->leaked = after.total_current - before.total_current;
    res->rc = rc;
    return rc;
}

static result_t par[WORLD], seq[WORLD], again[WORLD];

static int rank_fn(fsdp_ctx_t *ctx, void *arg) {
    result_t *out = arg;
    return train(ctx, &out[fsdp_ctx_rank(ctx)]);
}

int main(void) {
    tap_plan_lazy();
    fsdp_sim_options_t o;
    fsdp_sim_options_init(&o);
    o.world_size = WORLD;
    o.seed = 1234;
    tap_is_int(fsdp_sim_run(&o, rank_fn, par, NULL), 0, "%d ranks train a GPT at once", WORLD);
    tap_is_int(fsdp_sim_run(&o, rank_fn, again, NULL), 0, "and again with the same seed");
    for (int r = 0; r < WORLD; r++) {
        fsdp_ctx_options_t co;
        fsdp_ctx_options_init(&co);
        co.rank = r;
        co.world_size = WORLD;
        co.seed = 1234;
        fsdp_ctx_t *ctx = NULL;
        fsdp_ctx_create(&co, &ctx);
        train(ctx, &seq[r]);
        fsdp_ctx_destroy(ctx);
    }
    for (int r = 0; r < WORLD; r++) {
        tap_is_int(par[r].rc, 0, "rank %d trained", r);
        tap_is_mem(par[r].loss, seq[r].loss, sizeof par[r].loss,
                   "rank %d: concurrent losses bitwise equal the rank trained alone", r);
        tap_ok(par[r].checksum == seq[r].checksum && par[r].checksum > 0,
               "rank %d: concurrent parameters bitwise equal the rank trained alone (%.17g)", r,
               par[r].checksum);
        tap_is_mem(again[r].loss, par[r].loss, sizeof par[r].loss,
                   "rank %d: a second run of the same seed gives the same losses", r);
        tap_ok(par[r].loss[STEPS - 1] < par[r].loss[0], "rank %d: the loss goes down (%g -> %g)",
               r, par[r].loss[0], par[r].loss[STEPS - 1]);
        tap_is_size(par[r].leaked, 0, "rank %d: every byte accounted is returned", r);
    }
    tap_ok(memcmp(par[0].first, par[1].first, sizeof par[0].first) != 0,
           "ranks draw from their own random streams (different initial weights)");
    return tap_done();
}
