/* SPDX-License-Identifier: MIT */
/*
 * t_fsdp_memory.c: what a rank keeps in memory, and what FSDP leaves out of its units.
 *
 *   F05/F06 memory  FULL_SHARD GPT per block, limit_all_gathers 1 and 2: peak unsharded bytes
 *                   (bound derived above memory_rank) and per-rank state against NO_SHARD;
 *   F14 ignored     the ignored Linear is in no unit, full size everywhere, trains locally: its
 *                   gradient and its SGD step match the unwrapped model run on this rank's input.
 *
 * Ranks are threads of a sim run (world 2, and 3 for uneven padding). The rank functions record
 * checks per rank and fu_run_job() prints one TAP line per check (see fsdp_util.h). The other
 * summon-era tests (F25, rank0_only, offload_to_cpu, with_grads, unshard/reshard,
 * sync_module_states) are in t_fsdp_summon.c.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "models/models.h"
#include "tap.h"

#define GPT_LAYERS 4 /* tm_gpt_tiny_config has 2; with 4 "all blocks at once" exceeds the bound */

/* Every unit IDLE and none holding its unsharded parameters (all units here are FULL_SHARD). */
static bool idle_and_sharded(fsdp_unit_t *const *u, size_t n, char *why, size_t len) {
    return fu_all_idle(u, n, why, len) && fu_none_unsharded(u, n, why, len);
}

/* ---- F14: ignored modules -------------------------------------------------------------------- */

/* Options that leave m's child "ignored" out of FSDP (*ign receives it and must outlive o). */
static void ignored_options(fsdp_module_t *m, fsdp_module_t **ign, fsdp_options_t *o) {
    *ign = fsdp_module_child(m, "ignored");
    fsdp_options_init(o);
    o->check_exec_order = true;
    o->ignored_modules = ign;
    o->num_ignored_modules = 1;
}

/* The ignored Linear's parameters (grads: their gradients) in m and in the unwrapped ref:
 * bitwise the same when exact, else close under the fp32 tolerance; otherwise false with the
 * offender in why. */
static bool ignored_match(const fsdp_module_t *m, const fsdp_module_t *ref, bool grads, bool exact,
                          char *why, size_t len) {
    static const char *const names[] = {"ignored.l.weight", "ignored.l.bias"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        const fsdp_tensor_t *a = fsdp_module_param(m, names[i]);
        const fsdp_tensor_t *b = fsdp_module_param(ref, names[i]);
        if (grads && a && b) {
            a = fsdp_tensor_grad(a);
            b = fsdp_tensor_grad(b);
        }
        double c = !a || !b ? -1
                   : exact  ? (fu_same_bits(a, b) == 1 ? 0 : 2)
                            : fu_tensor_closeness(a, b, FU_F32_RTOL, FU_F32_ATOL);
        if (c < 0 || c > 1) {
            snprintf(why, len, "'%s'%s: %s", names[i], grads ? " (gradient)" : "",
                     c < 0   ? "missing or not comparable"
                     : exact ? "not bitwise the unwrapped model's"
                             : "not close to the unwrapped model's");
            return false;
        }
    }
    return true;
}

/* Forward of this rank's input x and the backward of sum(m(x)). */
static int sum_backward(fsdp_module_t *m, fsdp_tensor_t *x) {
    fsdp_tensor_t *y = NULL, *loss = NULL;
    int rc = fsdp_module_forward1(m, x, &y);
    if (rc == 0) rc = tm_sum_loss(y, &loss);
    if (rc == 0) rc = fsdp_backward(loss, NULL);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(y);
    return rc;
}

/* The value every element of a rank's ignored.l.weight and l1.weight gets before wrapping. */
static double rank_fill(int rank, bool ignored) {
    return (ignored ? 10.0 : 20.0) + rank;
}

/* Whether every element of t equals v. */
static bool all_equal(const fsdp_tensor_t *t, double v) {
    int64_t n = 0;
    float *h = t ? fu_host_f32(t, &n) : NULL;
    bool ok = h != NULL;
    for (int64_t i = 0; ok && i < n; i++)
        ok = h[i] == (float)v;
    free(h);
    return ok;
}

/* F14 with sync_module_states: rank 0's managed parameters reach every rank, but the ignored
 * module is left out of the broadcast as it is left out of everything else. */
static int ignored_sync_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    int rank = fsdp_ctx_rank(ctx), rc;
    fsdp_module_t *m = NULL, *ign = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *buf = NULL;
    fsdp_options_t o;
    static const int64_t bshape[1] = {8};
    static const char *const built = "building the model with rank-dependent weights";
    FU_TRY(out, built, tm_ignored_create(ctx, &m));
    /* A buffer in the ignored module too: buffers are broadcast module by module. */
    FU_TRY(out, built,
           fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 1, bshape, rank_fill(rank, true), FSDP_MEM_OTHER,
                            &buf));
    FU_TRY(out, built, fsdp_module_add_buffer(fsdp_module_child(m, "ignored"), "stat", buf, true));
    FU_TRY(out, built,
           fsdp_tensor_fill_(fsdp_module_param(m, "ignored.l.weight"), rank_fill(rank, true)));
    FU_TRY(out, built,
           fsdp_tensor_fill_(fsdp_module_param(m, "l1.weight"), rank_fill(rank, false)));
    ignored_options(m, &ign, &o);
    o.sync_module_states = true;
    FU_TRY(out, "wrapping with sync_module_states and ignored_modules, and summoning",
           fsdp_wrap(m, &o, &root));
    FU_TRY(out, "wrapping with sync_module_states and ignored_modules, and summoning",
           fu_summon_nowb(root));
    fu_ck(r, all_equal(fsdp_module_param(m, "l1.weight"), rank_fill(0, false)),
          "F14: sync_module_states gives every rank rank 0's managed parameters", "rank %d", rank);
    fu_ck(r, all_equal(fsdp_module_param(m, "ignored.l.weight"), rank_fill(rank, true)),
          "F14: sync_module_states leaves the ignored module's parameters as they were",
          "rank %d: the ignored weight is not this rank's own", rank);
    fu_ck(r, all_equal(fsdp_module_buffer(m, "ignored.stat"), rank_fill(rank, true)),
          "F14: sync_module_states leaves the ignored module's buffers as they were",
          "rank %d: the ignored buffer is not this rank's own", rank);
    FU_TRY(out, "fsdp_summon_end", fsdp_summon_end(root));
out:
    fsdp_tensor_release(buf);
    fsdp_unit_destroy(root);
    fsdp_module_release(m);
    return rc < 0 ? rc : 0;
}

static int ignored_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL, *ref = NULL, *ign = NULL;
    fsdp_unit_t *root = NULL, **units = NULL;
    size_t nu = 0;
    fsdp_named_list_t fl = {0}, rl = {0};
    fsdp_tensor_t *x = NULL;
    fsdp_optim_t *opt = NULL, *ref_opt = NULL;
    fsdp_options_t o;
    char why[300] = "";
    int rc;

    FU_TRY(out, "building the model and the reference", tm_ignored_create(ctx, &m));
    FU_TRY(out, "building the model and the reference", tm_ignored_create(ctx, &ref));
    ignored_options(m, &ign, &o);
    FU_TRY(out, "wrapping with ignored_modules", fsdp_wrap(m, &o, &root));
    FU_TRY(out, "wrapping with ignored_modules", fsdp_units(root, &units, &nu));
    {
        /* Not flattened: one unit with l1's and l2's four parameters, 2 x 10100 elements. */
        for (size_t i = 0; i < fsdp_unit_num_params(root) && !why[0]; i++) {
            fsdp_param_info_t pi;
            if (fsdp_unit_param_info(root, i, &pi) == 0 && strncmp(pi.fqn, "ignored", 7) == 0)
                snprintf(why, sizeof why, "the unit manages '%s'", pi.fqn);
        }
        fsdp_flat_sizes_t fs;
        fsdp_unit_flat_sizes(root, &fs);
        fu_ck(r,
              !why[0] && nu == 1 && !fsdp_unit_of(ign) && fsdp_unit_num_params(root) == 4 &&
                  fs.unpadded_numel == 20200 && fs.shard_numel * j->world == fs.padded_numel,
              "F14: the ignored module's parameters are in no unit (flat param of 20200)",
              "%s; %zu units, %zu managed params, unpadded %lld, padded %lld", why, nu,
              fsdp_unit_num_params(root), (long long)fs.unpadded_numel, (long long)fs.padded_numel);
    }
    fsdp_tensor_t *wt = fsdp_module_param(m, "ignored.l.weight");
    fsdp_tensor_t *bt = fsdp_module_param(m, "ignored.l.bias");
    fu_ck(r,
          wt && bt && fsdp_tensor_ndim(wt) == 2 && fsdp_tensor_numel(wt) == 10000 &&
              fsdp_tensor_numel(bt) == 100,
          "F14: the ignored parameters stay full size on every rank", "%s", "wrong shapes");
    fu_ck(r, ignored_match(m, ref, false, true, why, sizeof why),
          "F14: the ignored parameters keep their values", "%s", why);
    FU_TRY(out, "fsdp_named_params", fsdp_named_params(root, &fl));
    {
        bool lw = false, lb = false;
        for (size_t i = 0; i < fl.n; i++) {
            lw |= strcmp(fl.names[i], "ignored.l.weight") == 0 && fl.tensors[i] == wt;
            lb |= strcmp(fl.names[i], "ignored.l.bias") == 0 && fl.tensors[i] == bt;
        }
        fu_ck(r, lw && lb && fl.n == 3,
              "F14: fsdp_named_params lists the flat parameter and the ignored parameters "
              "themselves",
              "%zu entries, weight %d, bias %d", fl.n, lw, lb);
    }
    /* Training on this rank's input: the ignored gradient stays local (not reduced). */
    static const char *const fb = "forward and backward of the model and the reference";
    FU_TRY(out, fb, fu_rand_input(ctx, 1 + (uint64_t)fsdp_ctx_rank(ctx), 2, 100, &x));
    FU_TRY(out, fb, sum_backward(m, x));
    FU_TRY(out, fb, sum_backward(ref, x));
    fu_ck(r, ignored_match(m, ref, true, false, why, sizeof why),
          "F14: the ignored gradient is this rank's own (not reduced)", "%s", why);
    /* SGD(lr 0.1) over what FSDP hands the optimizer, and over the reference's ignored Linear. */
    FU_TRY(out, "SGD steps", fu_make_sgd(ctx, &fl, 0.1, 0.0, &opt));
    FU_TRY(out, "SGD steps", fsdp_optim_step(opt));
    FU_TRY(out, "SGD steps",
           fsdp_module_named_params(fsdp_module_child(ref, "ignored"), false, &rl));
    FU_TRY(out, "SGD steps", fu_make_sgd(ctx, &rl, 0.1, 0.0, &ref_opt));
    FU_TRY(out, "SGD steps", fsdp_optim_step(ref_opt));
    fu_ck(r, ignored_match(m, ref, false, false, why, sizeof why),
          "F14: the step updates the ignored parameters locally", "%s", why);
    fu_ck(r, idle_and_sharded(units, nu, why, sizeof why),
          "F14: the unit trains normally around the ignored module", "%s", why);
out:
    free(units);
    fsdp_tensor_release(x);
    fsdp_named_list_free(&fl);
    fsdp_named_list_free(&rl);
    fsdp_optim_destroy(opt);
    fsdp_optim_destroy(ref_opt);
    fsdp_unit_destroy(root);
    fsdp_module_release(m);
    fsdp_module_release(ref);
    return rc < 0 ? rc : 0;
}

/* ---- F05/F06 memory: FULL_SHARD GPT per block ------------------------------------------------ */

/* The memory job: limit_all_gathers is the one setting fu_job_t has no field for. */
typedef struct mem_job {
    fu_job_t base; /* first: the rank function gets &base and casts back */
    int limit;     /* limit_all_gathers */
} mem_job_t;

typedef struct gpt_run {
    fsdp_module_t *m;
    fsdp_unit_t *root;
    fsdp_optim_t *opt;
    fsdp_named_list_t params;
    fsdp_tensor_t *tok, *tgt, *loss;
} gpt_run_t;

static void gpt_free(gpt_run_t *g) {
    fsdp_tensor_release(g->loss);
    fsdp_tensor_release(g->tok);
    fsdp_tensor_release(g->tgt);
    fsdp_optim_destroy(g->opt);
    fsdp_named_list_free(&g->params);
    fsdp_unit_destroy(g->root);
    fsdp_module_release(g->m);
    memset(g, 0, sizeof *g);
}

/* The tiny GPT with GPT_LAYERS blocks, each a unit, AdamW, and this rank's tokens (2, 8). Not
 * the GPT recipe (fsdp/gpt_recipe.h) on purpose: F06's law is the flat parameters' (AdamW state
 * is two moments of the whole padded shard), while the recipe's use_orig_params keeps moments
 * only for the elements of parameters, which alignment padding makes uneven across ranks. */
static int gpt_setup(fsdp_ctx_t *ctx, fsdp_sharding_strategy_t s, int limit, gpt_run_t *g) {
    static const char *const blocks[] = {"GPTBlock", NULL};
    enum { B = 2, T = 8 };
    fsdp_gpt_config_t cfg;
    tm_gpt_tiny_config(&cfg);
    cfg.n_layer = GPT_LAYERS;
    tm_manual_seed(ctx, 0);
    fsdp_options_t o;
    fsdp_options_init(&o);
    o.strategy = s;
    o.limit_all_gathers = limit;
    o.check_exec_order = true;
    int rc = fsdp_gpt_create(ctx, &cfg, &g->m);
    if (rc == 0) rc = fu_wrap_types(g->m, &o, blocks, &g->root);
    if (rc == 0) rc = fsdp_named_params(g->root, &g->params);
    if (rc == 0) rc = fsdp_optim_adam_create(ctx, NULL, true, &g->opt);
    if (rc == 0)
        rc = fsdp_optim_add_group(g->opt, g->params.n, g->params.tensors,
                                  (const char *const *)g->params.names, NULL, NULL);
    int64_t tok[B * T], tgt[B * T];
    const int64_t shape[2] = {B, T};
    for (int i = 0; i < B * T; i++) {
        tok[i] = (i * 7 + fsdp_ctx_rank(ctx) * 3) % cfg.vocab;
        tgt[i] = (tok[i] + 1) % cfg.vocab;
    }
    if (rc == 0)
        rc = fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, 2, shape, tok, FSDP_MEM_OTHER, &g->tok);
    if (rc == 0)
        rc = fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, 2, shape, tgt, FSDP_MEM_OTHER, &g->tgt);
    return rc;
}

static size_t ppo_bytes(const fsdp_mem_stats_t *s) {
    return s->current[FSDP_MEM_PARAMS] + s->current[FSDP_MEM_GRADS] + s->current[FSDP_MEM_OPTIM];
}

/*
 * The bound on unsharded parameter bytes, derived from src/fsdp/unshard.c and hooks.c:
 *   forward   a unit is unsharded in its forward pre-hook and resharded in its forward hook,
 *             except the root, which stays unsharded until its backward (as PyTorch keeps the
 *             root for backward); no forward prefetch here: root + 1 block;
 *   backward  (BACKWARD_PRE, the default) a unit's pre-backward hook unshards it, waits for its
 *             all-gather, then issues at most one prefetch (the unit before it in the forward
 *             order); its post-backward hook reshards it before the next unit's pre-hook:
 *             root + the current block + the prefetched block.
 * limit_all_gathers = k caps the all-gathers issued and not yet waited for (the root's queue),
 * not the unsharded units: each unit waits for its own gather before computing, so with one
 * prefetch at most one gather is outstanding and k = 1 and k = 2 give the same peak. Hence
 *   peak_unsharded <= full(root) + 2 * max full(block) <= 3 * largest unit,
 * which is (k+1) * largest for k = 2 but not for k = 1 (root + 2 blocks is reached). A block
 * never resharded would show root + GPT_LAYERS blocks, above the bound.
 * Per-rank state: params, grads and AdamW's two moments are 4 f32 per element of the local
 * shard, so W x (per-rank bytes) = NO_SHARD bytes + 16 x (padding elements of all units).
 */
static int memory_rank(fsdp_ctx_t *ctx, void *arg) {
    mem_job_t *j = arg;
    fu_res_t *r = fu_res_of(&j->base, ctx);
    int rank = fsdp_ctx_rank(ctx), rc = 0;
    gpt_run_t g = {0};
    fsdp_unit_t **units = NULL;
    size_t nu = 0, noshard = 0;
    fsdp_mem_stats_t b0, s;
    char why[300];

    for (int fs = 0; fs < 2; fs++) { /* NO_SHARD first, as the reference */
        fsdp_mem_get_stats(ctx, &b0);
        const char *what = fs ? "FULL_SHARD GPT" : "NO_SHARD GPT";
        FU_TRY(out, what, gpt_setup(ctx, fs ? FSDP_FULL_SHARD : FSDP_NO_SHARD, j->limit, &g));
        FU_TRY(out, what, fsdp_units(g.root, &units, &nu));
        size_t shard = 0, root_full = 0, block_full = 0, largest = 0, pad = 0;
        for (size_t i = 0; i < nu; i++) {
            fsdp_flat_sizes_t f;
            fsdp_unit_flat_sizes(units[i], &f);
            size_t full = (size_t)f.padded_numel * sizeof(float);
            shard += (size_t)f.shard_numel * sizeof(float);
            pad += (size_t)(f.padded_numel - f.unpadded_numel);
            root_full = i == 0 ? full : root_full;
            block_full = i > 0 && full > block_full ? full : block_full;
            largest = full > largest ? full : largest;
        }
        fsdp_mem_get_stats(ctx, &s);
        size_t params = s.current[FSDP_MEM_PARAMS] - b0.current[FSDP_MEM_PARAMS];
        if (fs)
            fu_ck(r, params == shard && nu == 1 + GPT_LAYERS,
                  "F06: after wrapping a rank's parameter bytes are its shards only",
                  "%zu parameter bytes, shards %zu; %zu units", params, shard, nu);
        fsdp_mem_reset_peaks(ctx);
        FU_TRY(out, "forward and backward",
               fsdp_gpt_forward_loss(g.m, g.tok, g.tgt, &g.loss, NULL));
        FU_TRY(out, "forward and backward", fsdp_backward(g.loss, NULL));
        fsdp_mem_get_stats(ctx, &s);
        if (fs) {
            size_t peak = s.peak[FSDP_MEM_PARAMS] - b0.current[FSDP_MEM_PARAMS] - shard;
            size_t bound = root_full + 2 * block_full;
            if (rank == 0 && j->limit == 1)
                tap_diag("W=%d: peak unsharded %zu bytes; root %zu, block %zu", j->base.world, peak,
                         root_full, block_full);
            fu_ck(r, peak <= bound && peak <= 3 * largest,
                  "F05: peak unsharded parameter bytes <= root + 2 blocks <= 3 x largest unit",
                  "peak %zu bytes; bound %zu (root %zu, block %zu), 3 x largest %zu", peak, bound,
                  root_full, block_full, 3 * largest);
            fu_ck(r, peak >= root_full + block_full,
                  "F05: the peak sees the root and a block gathered (the measure is not vacuous)",
                  "peak %zu < %zu", peak, root_full + block_full);
            params = s.current[FSDP_MEM_PARAMS] - b0.current[FSDP_MEM_PARAMS];
            why[0] = 0;
            fu_ck(r, params == shard && idle_and_sharded(units, nu, why, sizeof why),
                  "F05: after backward every unit is resharded",
                  "%zu parameter bytes, shards %zu%s%s", params, shard, why[0] ? "; " : "", why);
        }
        free(units);
        units = NULL;
        FU_TRY(out, "AdamW step", fsdp_optim_step(g.opt));
        fsdp_mem_get_stats(ctx, &s);
        size_t bytes = ppo_bytes(&s) - ppo_bytes(&b0), w = (size_t)j->base.world;
        if (!fs)
            noshard = bytes;
        else
            fu_ck(r, bytes * w <= noshard + 16 * pad && bytes * w >= noshard,
                  "F06: params+grads+AdamW state per rank <= (NO_SHARD + padding) / W",
                  "%zu bytes x W = %zu; NO_SHARD %zu, padding %zu", bytes, bytes * w, noshard,
                  16 * pad);
        gpt_free(&g);
    }
out:
    free(units);
    gpt_free(&g);
    return rc < 0 ? rc : 0;
}

/* Runs memory_rank on `world` ranks with limit_all_gathers = limit. */
static void run_memory(int world, int limit) {
    static mem_job_t j; /* large: off the stack */
    char prefix[64];
    snprintf(prefix, sizeof prefix, "memory limit_all_gathers=%d", limit);
    fu_job_init(&j.base, prefix, world, FSDP_FULL_SHARD, false); /* memory_rank reads the world */
    j.limit = limit;
    fu_run_job(&j.base, memory_rank);
}

/* ---- main ------------------------------------------------------------------------------------ */

int main(void) {
    tap_plan_lazy();
    for (int w = 2; w <= 3; w++) {
        fu_run("ignored_modules", w, FSDP_FULL_SHARD, false, ignored_rank);
        fu_run("ignored_modules + sync_module_states", w, FSDP_FULL_SHARD, false,
               ignored_sync_rank);
        for (int k = 1; k <= 2; k++)
            run_memory(w, k);
    }
    return tap_done();
}
