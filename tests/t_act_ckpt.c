/* SPDX-License-Identifier: MIT */
/*
 * t_act_ckpt.c: activation checkpointing (fsdp_apply_activation_checkpointing in fsdp/nn.h) on
 * a GPT with dropout, alone, under DDP and under FSDP, each run against the same run without it:
 *   - losses, gradients and parameters after three AdamW steps are bitwise equal (the
 *     recomputation draws the same dropout masks and runs the same kernels in the same order);
 *   - the peak of the activations category falls (a test asserts by how much);
 *   - under FSDP the unit that a region re-runs is gathered again for the recomputation when it
 *     was resharded after forward (FULL_SHARD: the all-gather the backward would have issued
 *     anyway, so the per-step count is unchanged), and kept when it was not (SHARD_GRAD_OP:
 *     no extra all-gather); a forward pre-hook on a block sees the unit's all-gather count at
 *     both runs of its call;
 *   - checkpointing a module inside a unit (the recomputation runs inside the unit's backward),
 *     blocks under a single root unit, and units under bf16 mixed precision (the re-run casts
 *     its inputs again);
 *   - the API's refusals and counts.
 * Seed behaviours: DYN-MP-06 (DDP with activation checkpointing), DYN-MP-10 (FSDP with
 * activation checkpointing), DYN-SP-14 (checkpointed regions under DDP with small buckets: each
 * bucket is launched once its gradients, recomputed ones included, are ready, and the results
 * are those of the plain run).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "tap.h"

#define STEPS 3
#define LAYERS 4
#define MAXW 4

typedef enum { WRAP_NONE, WRAP_DDP, WRAP_FSDP } wrap_t;

typedef struct ac_case {
    const char *name; /* TAP prefix, with the seed IDs */
    int world;
    wrap_t wrap;
    fsdp_sharding_strategy_t strategy;
    bool per_block;      /* FSDP: one unit per GPTBlock under the root (else the root only) */
    const char *ac_type; /* the module type checkpointed */
    size_t bucket_cap;   /* DDP: bytes per bucket (0: the default) */
    bool bf16;           /* FSDP: mixed precision, bf16 parameters, f32 reduction */
} ac_case_t;

/* What one run of the model gives on one rank. */
typedef struct run_out {
    float loss[STEPS];
    float *grads; /* every parameter's gradient after the first backward, in order */
    size_t ngrads;
    float *params; /* every parameter after the last step, in order */
    size_t nparams;
    uint64_t ag[STEPS]; /* all-gathers issued by the step */
    size_t act_peak;    /* the largest activations peak of a step */
    size_t nac;         /* modules turned on by fsdp_apply_activation_checkpointing */
    /* The hook on h.1: the unit's all-gather count at the first run of the call and at its
     * re-run (during backward) in the first step. */
    uint64_t ag_first, ag_rerun;
    int hook_calls, hook_reruns;
    uint64_t prefetches; /* FSDP: all-gathers issued as prefetch, over every unit and step */
    /* DDP: buckets, and those launched from grad hooks while backward still ran (last step). */
    size_t buckets;
    uint64_t early;
} run_out_t;

typedef struct rank_res {
    int rc;
    char what[256];
    run_out_t plain, ac;
} rank_res_t;

static const ac_case_t *cur;
static rank_res_t res[MAXW];

static void gpt_config(fsdp_gpt_config_t *cfg) {
    fsdp_gpt_config_init(cfg);
    cfg->vocab = 64;
    cfg->max_seq = 16;
    cfg->n_layer = LAYERS;
    cfg->n_head = 4;
    cfg->d_model = 32;
    cfg->dropout = 0.1; /* the recomputation must draw the same masks */
}

/* Appends every tensor's values (or its gradient's; zeros for none) to *buf. */
static int append_values(const fsdp_named_list_t *l, bool grads, float **buf, size_t *n) {
    size_t total = 0;
    for (size_t i = 0; i < l->n; i++)
        total += (size_t)fsdp_tensor_numel(l->tensors[i]);
    float *v = calloc(total ? total : 1, sizeof *v), *p = v;
    if (!v) return FSDP_ENOMEM;
    for (size_t i = 0; i < l->n; i++) {
        size_t k = (size_t)fsdp_tensor_numel(l->tensors[i]);
        fsdp_tensor_t *t = grads ? fsdp_tensor_grad(l->tensors[i]) : l->tensors[i];
        if (t && k && fsdp_tensor_to_host(t, p, k * sizeof *p) < 0) {
            free(v);
            return FSDP_EINTERNAL;
        }
        p += k;
    }
    *buf = v;
    *n = total;
    return FSDP_OK;
}

static int hook_h1(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t **in) {
    (void)m, (void)nin, (void)in;
    run_out_t *o = arg;
    fsdp_unit_t *u = fsdp_unit_of(m);
    fsdp_unit_stats_t st = {0};
    if (u) fsdp_unit_get_stats(u, &st);
    if (o->hook_calls == 0 && o->hook_reruns == 0) o->ag_first = st.all_gathers;
    if (fsdp_in_backward(fsdp_module_ctx(m))) {
        if (o->hook_reruns++ == 0) o->ag_rerun = st.all_gathers;
    } else {
        o->hook_calls++;
    }
    return 0;
}

#define TRY(call, label)                                                                           \
    do {                                                                                           \
        if ((rc = (call)) < 0) {                                                                   \
            snprintf(rr->what, sizeof rr->what, "%s: %s", label, fsdp_ctx_last_error(ctx));        \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)

/* STEPS AdamW steps of the GPT as the case says, with or without checkpointing. */
static int run_model(fsdp_ctx_t *ctx, const ac_case_t *c, bool ac, rank_res_t *rr, run_out_t *o) {
    int rank = fsdp_ctx_rank(ctx), rc = FSDP_OK;
    const int64_t B = 2, T = 16;
    fsdp_gpt_config_t cfg;
    gpt_config(&cfg);
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_ddp_t *ddp = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_named_list_t l = {0};
    fsdp_tensor_t *tok = NULL, *tgt = NULL, *logits = NULL, *loss = NULL;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);

    TRY(fsdp_gpt_recipe_create_model(ctx, &cfg, 11, &m), "create the model");
    if (c->wrap == WRAP_FSDP) {
        fsdp_options_t fo;
        fsdp_options_init(&fo);
        fo.strategy = c->strategy;
        fo.check_exec_order = true;
        if (c->bf16) {
            fo.mixed_precision.enabled = true;
            fo.mixed_precision.param_dtype = FSDP_DTYPE_BF16;
            fo.mixed_precision.reduce_dtype = FSDP_DTYPE_F32;
            fo.mixed_precision.buffer_dtype = FSDP_DTYPE_BF16;
            fo.mixed_precision.cast_forward_inputs = true;
        }
        if (c->per_block) {
            TRY(fsdp_gpt_recipe_wrap(m, &fo, &root), "wrap");
        } else {
            fo.use_orig_params = true;
            TRY(fsdp_wrap(m, &fo, &root), "wrap");
        }
    } else if (c->wrap == WRAP_DDP) {
        fsdp_ddp_options_t dop;
        fsdp_ddp_options_init(&dop);
        if (c->bucket_cap) dop.bucket_cap_bytes = c->bucket_cap;
        TRY(fsdp_ddp_create(m, pg, &dop, &ddp), "DDP");
    }
    /* After wrapping, as PyTorch's recipes do: FSDP's hooks are part of each checkpointed call. */
    if (ac) TRY(fsdp_apply_activation_checkpointing(m, c->ac_type, NULL, NULL, &o->nac), "apply");
    TRY(fsdp_module_add_forward_pre_hook(fsdp_module_child(m, "h.1"), hook_h1, o, NULL), "hook");
    TRY(fsdp_gpt_recipe_create_adamw(m, NULL, &opt), "AdamW");

    int64_t shape[2] = {B, T}, ids[2 * 16], next[2 * 16];
    for (int s = 0; s < STEPS; s++) {
        for (int64_t i = 0; i < B * T; i++) {
            ids[i] = (i * 7 + s * 13 + rank * 29 + (i * i) % 5) % cfg.vocab;
            next[i] = (ids[i] * 3 + 1) % cfg.vocab;
        }
        TRY(fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, 2, shape, ids, FSDP_MEM_OTHER, &tok),
            "tokens");
        TRY(fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, 2, shape, next, FSDP_MEM_OTHER, &tgt),
            "tgt");
        /* Every run of a step draws its dropout masks from the same place of the stream. */
        fsdp_rng_init(fsdp_ctx_rng(ctx), 100 + (uint64_t)s, (uint64_t)rank);
        fsdp_pg_counters_t before = {0}, after = {0};
        if (pg) fsdp_pg_get_counters(pg, &before);
        fsdp_mem_reset_peaks(ctx);
        if (ddp) {
            TRY(fsdp_ddp_forward1(ddp, tok, &logits), "forward");
            TRY(fsdp_gpt_loss(logits, tgt, &loss), "loss");
        } else {
            TRY(fsdp_gpt_forward_loss(m, tok, tgt, &loss, NULL), "forward");
        }
        double lv = 0;
        TRY(fsdp_tensor_item(loss, 0, &lv), "item");
        o->loss[s] = (float)lv;
        TRY(fsdp_backward(loss, NULL), "backward");
        fsdp_mem_stats_t ms;
        fsdp_mem_get_stats(ctx, &ms);
        if (ms.peak[FSDP_MEM_ACTIVATIONS] > o->act_peak)
            o->act_peak = ms.peak[FSDP_MEM_ACTIVATIONS];
        if (pg) fsdp_pg_get_counters(pg, &after);
        o->ag[s] = after.calls[FSDP_COLL_ALL_GATHER] - before.calls[FSDP_COLL_ALL_GATHER];
        if (s == 0) {
            TRY(root ? fsdp_named_params(root, &l) : fsdp_module_named_params(m, false, &l),
                "params");
            TRY(append_values(&l, true, &o->grads, &o->ngrads), "grads");
            fsdp_named_list_free(&l);
        }
        TRY(fsdp_optim_step(opt), "step");
        TRY(fsdp_optim_zero_grad(opt, true), "zero_grad");
        fsdp_tensor_release(tok), fsdp_tensor_release(tgt), fsdp_tensor_release(logits);
        fsdp_tensor_release(loss);
        tok = tgt = logits = loss = NULL;
    }
    TRY(root ? fsdp_named_params(root, &l) : fsdp_module_named_params(m, false, &l), "params");
    TRY(append_values(&l, false, &o->params, &o->nparams), "params");
    if (root) {
        fsdp_unit_t **units = NULL;
        size_t nu = 0;
        TRY(fsdp_units(root, &units, &nu), "units");
        for (size_t i = 0; i < nu; i++) {
            fsdp_unit_stats_t us;
            fsdp_unit_get_stats(units[i], &us);
            o->prefetches += us.prefetches;
        }
        free(units);
    }
    if (ddp) {
        fsdp_ddp_stats_t st;
        TRY(fsdp_ddp_get_stats(ddp, &st), "stats");
        o->buckets = st.num_buckets;
        o->early = st.last_early_launches;
    }
out:
    fsdp_named_list_free(&l);
    fsdp_tensor_release(tok), fsdp_tensor_release(tgt), fsdp_tensor_release(logits);
    fsdp_tensor_release(loss);
    fsdp_optim_destroy(opt);
    fsdp_ddp_destroy(ddp);
    fsdp_unit_destroy(root);
    fsdp_module_release(m);
    return rc;
}

static int rank_fn(fsdp_ctx_t *ctx, void *arg) {
    (void)arg;
    rank_res_t *rr = &res[fsdp_ctx_rank(ctx)];
    rr->rc = run_model(ctx, cur, false, rr, &rr->plain);
    if (rr->rc == 0) rr->rc = run_model(ctx, cur, true, rr, &rr->ac);
    return rr->rc;
}

static bool same_floats(const float *a, size_t na, const float *b, size_t nb) {
    return a && b && na == nb && na > 0 && memcmp(a, b, na * sizeof *a) == 0;
}

/* Runs the case and prints its checks; min_drop is the least fraction by which the
 * activations peak must fall. */
static void run_case(const ac_case_t *c, double min_drop) {
    memset(res, 0, sizeof res);
    cur = c;
    int rc;
    if (c->world == 1) {
        fsdp_ctx_t *ctx = NULL;
        if (fsdp_ctx_create(NULL, &ctx) < 0) tap_bail("fsdp_ctx_create");
        rc = rank_fn(ctx, NULL);
        fsdp_ctx_destroy(ctx);
    } else {
        fsdp_sim_options_t so;
        fsdp_sim_options_init(&so);
        so.world_size = c->world;
        rc = fsdp_sim_run(&so, rank_fn, NULL, NULL);
    }
    tap_is_int(rc, FSDP_OK, "%s: both runs complete", c->name);
    for (int r = 0; r < c->world; r++) {
        rank_res_t *rr = &res[r];
        if (rr->rc < 0) tap_diag("rank %d: %s", r, rr->what);
        run_out_t *p = &rr->plain, *a = &rr->ac;
        tap_is_size(a->nac, c->ac_type && strcmp(c->ac_type, "GPTBlock") == 0 ? LAYERS : LAYERS,
                    "%s rank %d: one module checkpointed per block", c->name, r);
        tap_ok(memcmp(p->loss, a->loss, sizeof p->loss) == 0,
               "%s rank %d: the %d losses are bitwise equal (%.9g %.9g %.9g)", c->name, r, STEPS,
               (double)a->loss[0], (double)a->loss[1], (double)a->loss[2]);
        tap_ok(same_floats(p->grads, p->ngrads, a->grads, a->ngrads),
               "%s rank %d: the first backward's gradients are bitwise equal (%zu values)", c->name,
               r, a->ngrads);
        tap_ok(same_floats(p->params, p->nparams, a->params, a->nparams),
               "%s rank %d: the parameters after %d AdamW steps are bitwise equal", c->name, r,
               STEPS);
        double drop = p->act_peak ? 1.0 - (double)a->act_peak / (double)p->act_peak : 0;
        tap_ok(drop >= min_drop,
               "%s rank %d: the activations peak falls by %.0f%% (%zu -> %zu bytes; at least "
               "%.0f%%)",
               c->name, r, 100 * drop, p->act_peak, a->act_peak, 100 * min_drop);
        tap_ok(p->hook_calls == STEPS && a->hook_calls == STEPS && p->hook_reruns == 0 &&
                   a->hook_reruns == (strcmp(c->ac_type, "GPTBlock") == 0 ? STEPS : 0),
               "%s rank %d: h.1's forward pre-hook runs once a step, and again in backward only "
               "when h.1 itself is checkpointed (plain %d+%d, checkpointed %d+%d)",
               c->name, r, p->hook_calls, p->hook_reruns, a->hook_calls, a->hook_reruns);
        if (c->wrap == WRAP_DDP && c->bucket_cap)
            tap_ok(a->buckets > 2 && a->buckets == p->buckets && a->early > 0,
                   "%s rank %d: %zu buckets of at most %zu bytes, %llu of them launched from "
                   "gradient hooks while the recomputing backward ran (plain: %llu)",
                   c->name, r, a->buckets, c->bucket_cap, (unsigned long long)a->early,
                   (unsigned long long)p->early);
        if (c->wrap != WRAP_FSDP) continue;
        tap_ok(memcmp(p->ag, a->ag, sizeof p->ag) == 0,
               "%s rank %d: all-gathers per step unchanged (%llu %llu %llu, plain %llu %llu %llu)",
               c->name, r, (unsigned long long)a->ag[0], (unsigned long long)a->ag[1],
               (unsigned long long)a->ag[2], (unsigned long long)p->ag[0],
               (unsigned long long)p->ag[1], (unsigned long long)p->ag[2]);
        if (c->per_block && c->strategy == FSDP_FULL_SHARD)
            tap_ok(a->prefetches == p->prefetches && p->prefetches > 0,
                   "%s rank %d: backward prefetch reaches the units a region re-runs (%llu "
                   "prefetches, plain %llu)",
                   c->name, r, (unsigned long long)a->prefetches,
                   (unsigned long long)p->prefetches);
        if (!c->per_block || strcmp(c->ac_type, "GPTBlock") != 0) continue;
        uint64_t want = c->strategy == FSDP_FULL_SHARD ? 1 : 0;
        tap_ok(
            a->ag_rerun == a->ag_first + want,
            "%s rank %d: h.1's unit %s for the recomputation (all-gathers %llu at the first run, "
            "%llu at the re-run)",
            c->name, r, want ? "is gathered again" : "kept its parameters",
            (unsigned long long)a->ag_first, (unsigned long long)a->ag_rerun);
    }
    for (int r = 0; r < c->world; r++) {
        free(res[r].plain.grads), free(res[r].plain.params);
        free(res[r].ac.grads), free(res[r].ac.params);
    }
}

/* ---- the API -----------------------------------------------------------------------------------
 */

static bool only_h2(fsdp_module_t *m, const char *fqn, void *arg) {
    (void)m, (void)arg;
    return strcmp(fqn, "h.2") == 0;
}

static void test_api(void) {
    fsdp_ctx_t *ctx = NULL;
    if (fsdp_ctx_create(NULL, &ctx) < 0) tap_bail("fsdp_ctx_create");
    fsdp_gpt_config_t cfg;
    gpt_config(&cfg);
    fsdp_module_t *m = NULL;
    if (fsdp_gpt_recipe_create_model(ctx, &cfg, 1, &m) < 0) tap_bail("model");
    size_t n = 99;
    tap_is_int(fsdp_apply_activation_checkpointing(NULL, "GPTBlock", NULL, NULL, &n), FSDP_EINVAL,
               "a NULL root is refused");
    tap_is_size(n, 0, "and the count is 0");
    tap_is_int(fsdp_apply_activation_checkpointing(m, NULL, NULL, NULL, NULL), FSDP_EINVAL,
               "neither a type nor a check function is refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "type", "and the error says what to give");
    tap_is_int(fsdp_apply_activation_checkpointing(m, NULL, only_h2, NULL, &n), FSDP_OK,
               "a check function alone");
    tap_ok(n == 1 && fsdp_module_activation_checkpointing(fsdp_module_child(m, "h.2")) &&
               !fsdp_module_activation_checkpointing(fsdp_module_child(m, "h.1")),
           "selects h.2 only (count %zu)", n);
    tap_is_int(fsdp_apply_activation_checkpointing(m, "GPTBlock", NULL, NULL, &n), FSDP_OK,
               "by type");
    tap_is_size(n, LAYERS - 1, "counts the blocks it turned on (h.2 was on)");
    tap_ok(!fsdp_module_activation_checkpointing(m), "the root itself is never selected");
    tap_is_int(fsdp_apply_activation_checkpointing(m, "MLP", only_h2, NULL, &n), FSDP_OK,
               "type and check together");
    tap_is_size(n, 0, "select nothing here (no MLP is named h.2)");
    tap_is_int(fsdp_module_set_activation_checkpointing(NULL, true), FSDP_EINVAL,
               "set on a NULL module is refused");
    tap_ok(!fsdp_module_activation_checkpointing(NULL), "and a NULL module is not checkpointed");
    fsdp_module_set_activation_checkpointing(fsdp_module_child(m, "h.0"), false);
    tap_ok(!fsdp_module_activation_checkpointing(fsdp_module_child(m, "h.0")), "turned off again");
    fsdp_named_list_t a = {0};
    fsdp_module_named_params(m, false, &a);
    tap_is_str(a.n ? a.names[0] : "", "wte.weight", "parameter names are unchanged");
    fsdp_named_list_free(&a);

    /* Under no_grad a checkpointed call runs as usual and records nothing. */
    int64_t shape[2] = {1, 4}, ids[4] = {1, 2, 3, 4};
    fsdp_tensor_t *tok = NULL, *y = NULL;
    fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, 2, shape, ids, FSDP_MEM_OTHER, &tok);
    bool was = fsdp_set_grad_enabled(ctx, false);
    tap_is_int(fsdp_gpt_forward(m, tok, &y), FSDP_OK, "a forward without grad");
    fsdp_set_grad_enabled(ctx, was);
    tap_is_size(fsdp_tape_size(ctx), 0, "records nothing");
    fsdp_tensor_release(y);
    fsdp_tensor_release(tok);
    fsdp_module_release(m);
    fsdp_ctx_destroy(ctx);
}

int main(void) {
    tap_plan_lazy();
    test_api();
    static const ac_case_t cases[] = {
        {"no wrapper", 1, WRAP_NONE, FSDP_FULL_SHARD, false, "GPTBlock", 0, false},
        {"DYN-MP-06 DDP W=2", 2, WRAP_DDP, FSDP_FULL_SHARD, false, "GPTBlock", 0, false},
        {"DYN-SP-14 DDP with small buckets W=2", 2, WRAP_DDP, FSDP_FULL_SHARD, false, "GPTBlock",
         16384, false},
        {"DYN-MP-10 FSDP FULL_SHARD unit per block W=2", 2, WRAP_FSDP, FSDP_FULL_SHARD, true,
         "GPTBlock", 0, false},
        {"DYN-MP-10 FSDP SHARD_GRAD_OP unit per block W=2", 2, WRAP_FSDP, FSDP_SHARD_GRAD_OP, true,
         "GPTBlock", 0, false},
        {"FSDP FULL_SHARD, the MLP inside each unit W=2", 2, WRAP_FSDP, FSDP_FULL_SHARD, true,
         "MLP", 0, false},
        {"FSDP root unit only W=4", 4, WRAP_FSDP, FSDP_FULL_SHARD, false, "GPTBlock", 0, false},
        {"DYN-MP-10 FSDP FULL_SHARD bf16 mixed precision W=2", 2, WRAP_FSDP, FSDP_FULL_SHARD, true,
         "GPTBlock", 0, true},
    };
    /* A checkpointed block keeps its input only; checkpointed MLPs keep less. */
    static const double drops[] = {0.4, 0.4, 0.4, 0.4, 0.4, 0.15, 0.4, 0.4};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(&cases[i], drops[i]);
    return tap_done();
}
