/* SPDX-License-Identifier: MIT */
/*
 * t_bert_parity.c: the BERT encoder (fsdp/bert.h) trained data-parallel against a single-process
 * run, seed 004's BERT behaviours as C analogs.
 *
 * The reference is one process training the unwrapped model on the global batch (every rank's
 * sequences together) with SGD (lr 0.1, momentum 0.9) for 3 steps. Each rank then trains a model
 * made from the same seed on its own sequences, wrapped as:
 *   - DDP (DYN-MP-02, DYN-MP-04; DYN-MP-01's baseline on this model);
 *   - DDP with static_graph (DYN-MP-03, DYN-MP-05);
 *   - DDP with every BertLayer activation-checkpointed (DYN-MP-06 on BERT);
 *   - FSDP FULL_SHARD with one unit per BertLayer (DYN-MP-11);
 *   - the same with every BertLayer activation-checkpointed (DYN-MP-12);
 * at world sizes 2 and 4. Every sequence holds the same number of masked-LM labels, so the mean
 * of the ranks' losses is the global loss and the averaged gradient the global one. Checked:
 * the mean of the ranks' losses at every step equals the reference's, and every parameter after
 * the last step (gathered for FSDP) equals the reference's, within the fp32 tolerance (rtol
 * 1.3e-6, atol 1e-5); the checkpointed runs equal their plain twins bitwise. The batches carry
 * padding, so the attention mask takes part. Dropout is 0: the reference and the ranks see the
 * sequences in different batches, so their dropout masks would differ (t_act_ckpt checks
 * checkpointing with dropout).
 * DYN-FK-01/02: DDP over a one-rank group gives the unwrapped model's logits and loss bitwise.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "tap.h"

#define MAXW 4
#define STEPS 3
#define BPR 2 /* sequences per rank */
#define SEQ 12
#define RTOL 1.3e-6
#define ATOL 1e-5

typedef enum { K_DDP, K_DDP_STATIC, K_DDP_AC, K_FSDP, K_FSDP_AC, K_COUNT } kind_t;

static const char *const kind_name[K_COUNT] = {
    "DYN-MP-02 DYN-MP-04 DDP",
    "DYN-MP-03 DYN-MP-05 DDP static_graph",
    "DYN-MP-06 DDP, BertLayers activation-checkpointed",
    "DYN-MP-11 FSDP FULL_SHARD, a unit per BertLayer",
    "DYN-MP-12 FSDP FULL_SHARD, a unit per BertLayer, activation-checkpointed",
};

static void bert_config(fsdp_bert_config_t *cfg) {
    fsdp_bert_config_init(cfg);
    cfg->vocab_size = 64;
    cfg->hidden_size = 32;
    cfg->num_hidden_layers = 2;
    cfg->num_attention_heads = 4;
    cfg->intermediate_size = 64;
    cfg->max_position_embeddings = 16;
    cfg->type_vocab_size = 2;
    cfg->hidden_dropout_prob = 0;
    cfg->attention_probs_dropout_prob = 0;
}

/* Sequences [first, first + n) of the global batch: ids, attention mask (the last g % 3
 * positions of sequence g are padding), token types (second half 1) and labels (positions 1, 4
 * and 7 of every sequence, the rest ignored). */
static int make_batch(fsdp_ctx_t *ctx, int first, int n, fsdp_tensor_t **ids, fsdp_tensor_t **mask,
                      fsdp_tensor_t **types, fsdp_tensor_t **labels) {
    int64_t vi[4 * MAXW * SEQ], vm[4 * MAXW * SEQ], vt[4 * MAXW * SEQ], vl[4 * MAXW * SEQ];
    for (int k = 0; k < n; k++) {
        int g = first + k;
        for (int s = 0; s < SEQ; s++) {
            int64_t i = (int64_t)k * SEQ + s;
            bool pad = s >= SEQ - g % 3;
            vi[i] = pad ? 0 : 1 + (g * 17 + s * 5 + (g * s) % 7) % 63;
            vm[i] = !pad;
            vt[i] = s >= SEQ / 2;
            vl[i] = (s == 1 || s == 4 || s == 7) ? (g * 3 + s * 11) % 64 : FSDP_BERT_IGNORE_INDEX;
        }
    }
    const int64_t shape[2] = {n, SEQ};
    int rc = fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, 2, shape, vi, FSDP_MEM_OTHER, ids);
    if (rc == 0)
        rc = fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, 2, shape, vm, FSDP_MEM_OTHER, mask);
    if (rc == 0)
        rc = fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, 2, shape, vt, FSDP_MEM_OTHER, types);
    if (rc == 0)
        rc = fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, 2, shape, vl, FSDP_MEM_OTHER, labels);
    return rc;
}

static int make_model(fsdp_ctx_t *ctx, fsdp_module_t **m) {
    fsdp_bert_config_t cfg;
    bert_config(&cfg);
    fsdp_rng_init(fsdp_ctx_rng(ctx), 2024, 0);
    int rc = fsdp_bert_create(ctx, &cfg, m);
    if (rc == 0) fsdp_module_train(*m, true);
    return rc;
}

/* What one run gives. */
typedef struct run_out {
    double loss[STEPS];
    fu_vals_t params; /* every parameter after the last step, full, in named order */
    char err[256];
} run_out_t;

/* Trains m (wrapped by ddp or root, or neither) on sequences [first, first + n) for STEPS SGD
 * steps. */
static int train(fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_ddp_t *ddp, fsdp_unit_t *root, int first,
                 int n, run_out_t *o) {
    int rc = FSDP_OK;
    fsdp_named_list_t l = {0};
    fsdp_optim_t *opt = NULL;
    fsdp_tensor_t *ids = NULL, *mask = NULL, *types = NULL, *labels = NULL, *logits = NULL,
                  *loss = NULL;
    const char *what = "params";
    rc = root ? fsdp_named_params(root, &l) : fsdp_module_named_params(m, false, &l);
    if (rc == 0) what = "SGD", rc = fu_make_sgd(ctx, &l, 0.1, 0.9, &opt);
    if (rc == 0) what = "batch", rc = make_batch(ctx, first, n, &ids, &mask, &types, &labels);
    for (int s = 0; s < STEPS && rc == 0; s++) {
        if (ddp) {
            fsdp_tensor_t *in[3] = {ids, mask, types};
            what = "DDP forward";
            rc = fsdp_ddp_forward(ddp, 3, in, 1, &logits);
            if (rc == 0) rc = fsdp_bert_mlm_loss(logits, labels, &loss);
        } else {
            what = "forward";
            rc = fsdp_bert_forward_loss(m, ids, mask, types, labels, &loss, NULL, NULL);
        }
        if (rc == 0) rc = fsdp_tensor_item(loss, 0, &o->loss[s]);
        if (rc == 0) what = "backward", rc = fsdp_backward(loss, NULL);
        if (rc == 0) what = "step", rc = fsdp_optim_step(opt);
        if (rc == 0) rc = fsdp_optim_zero_grad(opt, true);
        fsdp_tensor_release(logits), fsdp_tensor_release(loss);
        logits = loss = NULL;
    }
    if (rc == 0 && root) what = "summon", rc = fu_summon_nowb(root);
    if (rc == 0) what = "values", rc = fu_module_values(m, false, false, &o->params);
    if (root) {
        int r2 = fsdp_summon_end(root);
        if (rc == 0) rc = r2;
    }
    if (rc < 0) snprintf(o->err, sizeof o->err, "%s: %s", what, fsdp_ctx_last_error(ctx));
    fsdp_tensor_release(ids), fsdp_tensor_release(mask), fsdp_tensor_release(types);
    fsdp_tensor_release(labels);
    fsdp_optim_destroy(opt);
    fsdp_named_list_free(&l);
    return rc;
}

static bool do_ac(fsdp_module_t *m, const char *fqn, void *arg) {
    (void)m, (void)fqn, (void)arg;
    return true;
}

static kind_t cur_kind;
static run_out_t outs[MAXW];

static int rank_fn(fsdp_ctx_t *ctx, void *arg) {
    (void)arg;
    int r = fsdp_ctx_rank(ctx), rc;
    run_out_t *o = &outs[r];
    fsdp_module_t *m = NULL;
    fsdp_ddp_t *ddp = NULL;
    fsdp_unit_t *root = NULL;
    kind_t k = cur_kind;
    if ((rc = make_model(ctx, &m)) < 0) goto out;
    if (k == K_FSDP || k == K_FSDP_AC) {
        fsdp_options_t fo;
        fsdp_options_init(&fo);
        fo.use_orig_params = true;
        fo.check_exec_order = true;
        rc = fu_wrap_types(m, &fo, (const char *const[]){"BertLayer", NULL}, &root);
    } else {
        fsdp_ddp_options_t dop;
        fsdp_ddp_options_init(&dop);
        dop.static_graph = k == K_DDP_STATIC;
        dop.bucket_cap_bytes = 8192; /* several buckets on this small model */
        rc = fsdp_ddp_create(m, fsdp_ctx_pg(ctx), &dop, &ddp);
    }
    if (rc == 0 && (k == K_DDP_AC || k == K_FSDP_AC))
        rc = fsdp_apply_activation_checkpointing(m, "BertLayer", do_ac, NULL, NULL);
    if (rc < 0) goto out;
    rc = train(ctx, m, ddp, root, r * BPR, BPR, o);
out:
    if (rc < 0 && !o->err[0]) snprintf(o->err, sizeof o->err, "%s", fsdp_ctx_last_error(ctx));
    fsdp_ddp_destroy(ddp);
    fsdp_unit_destroy(root);
    fsdp_module_release(m);
    return rc;
}

/* The worst closeness (|a - b| / (atol + rtol |b|), <= 1 passes) of a against b. */
static double closeness(const fu_vals_t *a, const fu_vals_t *b) {
    if (a->n != b->n || a->n == 0) return INFINITY;
    double worst = 0;
    for (size_t i = 0; i < a->n; i++) {
        double c = fabs(a->v[i] - b->v[i]) / (ATOL + RTOL * fabs(b->v[i]));
        if (!(c <= worst)) worst = c;
    }
    return worst;
}

static run_out_t refs[MAXW + 1]; /* the reference of each world size (index: W) */
static run_out_t plain[MAXW];    /* the plain twin of a checkpointed run, per rank */

static void reference(int w) {
    fsdp_ctx_t *ctx = NULL;
    fsdp_module_t *m = NULL;
    if (fsdp_ctx_create(NULL, &ctx) < 0) tap_bail("fsdp_ctx_create");
    int rc = make_model(ctx, &m);
    if (rc == 0) rc = train(ctx, m, NULL, NULL, 0, w * BPR, &refs[w]);
    tap_is_int(rc, FSDP_OK, "the single-process reference on %d sequences trains %d steps%s%s",
               w * BPR, STEPS, rc ? ": " : "", rc ? refs[w].err : "");
    fsdp_module_release(m);
    fsdp_ctx_destroy(ctx);
}

static void run_kind(kind_t k, int w) {
    cur_kind = k;
    for (int r = 0; r < MAXW; r++) {
        fu_vals_free(&outs[r].params);
        memset(&outs[r], 0, sizeof outs[r]);
    }
    fsdp_sim_options_t so;
    fsdp_sim_options_init(&so);
    so.world_size = w;
    int rc = fsdp_sim_run(&so, rank_fn, NULL, NULL);
    tap_ok(rc == 0, "%s W=%d: the ranks train %d steps%s%s", kind_name[k], w, STEPS, rc ? ": " : "",
           rc ? outs[0].err : "");
    double worst = 0;
    char steps[160] = "";
    for (int s = 0; s < STEPS; s++) {
        double mean = 0;
        for (int r = 0; r < w; r++)
            mean += outs[r].loss[s] / w;
        double c = fabs(mean - refs[w].loss[s]) / (ATOL + RTOL * fabs(refs[w].loss[s]));
        if (!(c <= worst)) worst = c;
        size_t len = strlen(steps);
        snprintf(steps + len, sizeof steps - len, "%s%.7f/%.7f", s ? " " : "", mean,
                 refs[w].loss[s]);
    }
    tap_ok(worst <= 1.0,
           "%s W=%d: the mean loss of every step equals the single-process run's (%s; "
           "closeness %.2g)",
           kind_name[k], w, steps, worst);
    double pw = 0;
    bool same_ranks = true;
    for (int r = 0; r < w; r++) {
        double c = closeness(&outs[r].params, &refs[w].params);
        if (!(c <= pw)) pw = c;
        same_ranks = same_ranks && outs[r].params.n == outs[0].params.n &&
                     memcmp(outs[r].params.v, outs[0].params.v,
                            outs[0].params.n * sizeof *outs[0].params.v) == 0;
    }
    tap_ok(pw <= 1.0,
           "%s W=%d: every parameter after %d steps equals the single-process run's (%zu "
           "values, closeness %.2g)",
           kind_name[k], w, STEPS, outs[0].params.n, pw);
    tap_ok(same_ranks, "%s W=%d: every rank holds the same parameters", kind_name[k], w);
    if (k == K_DDP_AC || k == K_FSDP_AC) {
        bool same = true;
        for (int r = 0; r < w; r++)
            same = same && memcmp(outs[r].loss, plain[r].loss, sizeof outs[r].loss) == 0 &&
                   outs[r].params.n == plain[r].params.n &&
                   memcmp(outs[r].params.v, plain[r].params.v,
                          plain[r].params.n * sizeof *plain[r].params.v) == 0;
        tap_ok(same, "%s W=%d: losses and parameters equal the run without checkpointing bitwise",
               kind_name[k], w);
    }
    if (k == K_DDP || k == K_FSDP)
        for (int r = 0; r < w; r++) {
            fu_vals_free(&plain[r].params);
            plain[r] = outs[r];
            outs[r].params = (fu_vals_t){0}; /* moved */
        }
}

/* DYN-FK-01/02: DDP over one rank is the unwrapped model. */
static void test_world_one(void) {
    fsdp_ctx_t *ctx = NULL;
    fsdp_module_t *a = NULL, *b = NULL;
    fsdp_ddp_t *ddp = NULL;
    fsdp_tensor_t *ids = NULL, *mask = NULL, *types = NULL, *labels = NULL;
    fsdp_tensor_t *la = NULL, *lb = NULL, *ga = NULL, *gb = NULL;
    if (fsdp_ctx_create(NULL, &ctx) < 0) tap_bail("fsdp_ctx_create");
    int rc = make_model(ctx, &a);
    if (rc == 0) rc = make_model(ctx, &b);
    if (rc == 0) rc = fsdp_ddp_create(b, NULL, NULL, &ddp);
    if (rc == 0) rc = make_batch(ctx, 0, 3, &ids, &mask, &types, &labels);
    if (rc == 0) rc = fsdp_bert_forward(a, ids, mask, types, &la, NULL);
    if (rc == 0) rc = fsdp_bert_mlm_loss(la, labels, &ga);
    fsdp_tensor_t *in[3] = {ids, mask, types};
    if (rc == 0) rc = fsdp_ddp_forward(ddp, 3, in, 1, &lb);
    if (rc == 0) rc = fsdp_bert_mlm_loss(lb, labels, &gb);
    tap_is_int(rc, FSDP_OK, "DYN-FK-01 DYN-FK-02 BERT under DDP over a world of one runs");
    tap_ok(rc == 0 && fu_same_bits(la, lb) == 1 && fu_same_bits(ga, gb) == 1,
           "DYN-FK-01 DYN-FK-02 its logits and loss equal the unwrapped model's bitwise");
    fsdp_tensor_release(ids), fsdp_tensor_release(mask), fsdp_tensor_release(types);
    fsdp_tensor_release(labels), fsdp_tensor_release(la), fsdp_tensor_release(lb);
    fsdp_tensor_release(ga), fsdp_tensor_release(gb);
    fsdp_ddp_destroy(ddp);
    fsdp_module_release(a), fsdp_module_release(b);
    fsdp_ctx_destroy(ctx);
}

int main(void) {
    tap_plan_lazy();
    test_world_one();
    static const int worlds[] = {2, 4};
    for (size_t i = 0; i < sizeof worlds / sizeof worlds[0]; i++) {
        int w = worlds[i];
        reference(w);
        for (int k = 0; k < K_COUNT; k++)
            run_kind((kind_t)k, w);
    }
    for (int r = 0; r < MAXW; r++) {
        fu_vals_free(&outs[r].params);
        fu_vals_free(&plain[r].params);
    }
    for (int w = 0; w <= MAXW; w++)
        fu_vals_free(&refs[w].params);
    return tap_done();
}
