/* SPDX-License-Identifier: MIT */
/*
 * t_fsdp.c: FSDP units against an independent reference (CORE-P01, CORE-P03, CORE-P04 and the
 * runtime properties the seed-000 matrix relies on).
 *
 * The parity recipe (spec section 2.3, _test_fsdp_parity): every sim rank builds the model
 * three times from the same seed and trains each with SGD (lr 0.01, momentum 0.9):
 *   - DDP over the same group (fsdp_ddp_create), as upstream;
 *   - a replica trained without any collective, which each step runs the inputs of all W
 *     ranks one after the other and averages the gradients (what DDP computes), so a bug
 *     shared by the communication layer cannot hide;
 *   - the FSDP model, on this rank's input only.
 * FSDP is compared with both references. Each step the losses must agree (fp32 tolerance:
 * rtol 1.3e-6, atol 1e-5), the units must be IDLE, and the parameters go through a full
 * round trip (summon with writeback, zero, restore); at the end the full parameters gathered
 * with fsdp_summon_begin must equal the reference's.
 *
 * MixtureOfExperts (CORE-P07/P08) cannot be emulated without collectives (each rank's expert
 * differs); its reference is upstream's: DummyDDP plus the model's own all-reduce of the
 * non-expert gradients over the same group (tm_moe_run_backward).
 *
 * Alongside, per step: the all-gathers, reduce-scatters and all-reduces on every group (calls
 * and bytes) equal the closed form of each unit's strategy and flat sizes, and after forward
 * FULL_SHARD has freed every non-root unit's unsharded parameters while SHARD_GRAD_OP still
 * holds them. Variants add
 * gradient clipping (both norms must agree and clipping must bite), hybrid sharding over 2x2
 * groups, and injected delays (CORE-P05, P06, P08) that must not change a single bit.
 * CORE-P02 (the same matrix under mixed precision) is in t_fsdp_mp.c.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "models/models.h"
#include "tap.h"

#define MAX_ITERS 4

typedef enum {
    M_NESTED = 0,
    M_ALWAYS,
    M_TRANSFORMER,
    M_DELAY_LOSS,   /* NestedWrappedModuleWithDelay(delay_after_loss_ms) */
    M_DELAY_REDUCE, /* NestedWrappedModuleWithDelay(delay_before_reduction_ms) */
    M_MOE,
    M_MOE_DELAY,    /* MixtureOfExperts(delay_before_free_ms) */
    M_COUNT
} model_kind_t;
static const char *const model_names[M_COUNT] = {
    "NestedWrappedModule",          "AlwaysWrapNestedWrappedModule",
    "TransformerWithSharedParams",  "NestedWrappedModuleWithDelay(after loss)",
    "NestedWrappedModuleWithDelay(before reduction)", "MixtureOfExperts",
    "MixtureOfExperts(delay before free)"};
static const char *const model_ids[M_COUNT] = {"CORE-P01", "CORE-P03", "CORE-P04", "CORE-P05",
                                               "CORE-P06", "CORE-P07", "CORE-P08"};
#define DELAY_MS 3

static bool is_moe(model_kind_t k) { return k == M_MOE || k == M_MOE_DELAY; }

typedef struct cfg {
    model_kind_t model;
    fsdp_sharding_strategy_t strategy;
    fsdp_backward_prefetch_t bp;
    bool fwd_prefetch;
    bool orig;
    int world;
    int iters;
    bool save_model;
    bool hybrid;  /* HYBRID strategies over (rank / 2, rank % 2) groups of a world of 4 */
    double clip;  /* 0: none; else the norm type (INFINITY for the max norm) */
    bool offload; /* CPU offload of parameters (and so gradients) */
} cfg_t;

#define CLIP_MAX_NORM 0.05

typedef struct rank_out {
    char err[768];
    double ref_loss[MAX_ITERS], fsdp_loss[MAX_ITERS], ddp_loss[MAX_ITERS];
    double worst_loss;  /* |a - b| / (atol + rtol |b|), worst over steps (norms included) */
    double worst_param; /* same over every parameter element */
    uint64_t checksum;  /* bits of the final parameters, for determinism */
} rank_out_t;

typedef struct run {
    cfg_t c;
    rank_out_t r[8];
} run_t;

/* ---- models ------------------------------------------------------------------------------- */

static int build(fsdp_ctx_t *ctx, model_kind_t k, fsdp_module_t **m) {
    if (k == M_TRANSFORMER) return tm_transformer_create(ctx, true, true, m);
    if (is_moe(k)) return tm_moe_create(ctx, true, m);
    return tm_nested_wrapped_create(ctx, true, m);
}

/* Rank r's input, as get_input draws it on rank r. */
static int input_for(fsdp_ctx_t *ctx, model_kind_t k, int r, fsdp_tensor_t *in[2]) {
    in[0] = in[1] = NULL;
    if (k == M_TRANSFORMER) return tm_transformer_get_input(ctx, &in[0], &in[1]);
    const int64_t shape[2] = {4, 8};
    tm_manual_seed(ctx, 1 + (uint64_t)r);
    int rc = fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, shape, FSDP_MEM_ACTIVATIONS, &in[0]);
    if (rc == 0) rc = fsdp_tensor_uniform_(in[0], 0.0, 1.0);
    return rc;
}

static int forward_loss(model_kind_t k, fsdp_module_t *m, fsdp_tensor_t *in[2],
                        fsdp_tensor_t **loss) {
    fsdp_tensor_t *out = NULL;
    int rc;
    if (k == M_TRANSFORMER) {
        rc = tm_transformer_forward(m, in[0], in[1], &out);
        if (rc == 0) rc = tm_transformer_loss(in[1], out, loss);
    } else {
        rc = fsdp_module_forward1(m, in[0], &out);
        if (rc == 0) rc = tm_sum_loss(out, loss);
    }
    fsdp_tensor_release(out);
    return rc;
}

/* The same through DDP (or DummyDDP). */
static int forward_loss_ddp(model_kind_t k, fsdp_ddp_t *d, fsdp_tensor_t *in[2],
                            fsdp_tensor_t **loss) {
    fsdp_tensor_t *out = NULL;
    int rc = fsdp_ddp_forward(d, k == M_TRANSFORMER ? 2 : 1, in, 1, &out);
    if (rc == 0)
        rc = k == M_TRANSFORMER ? tm_transformer_loss(in[1], out, loss) : tm_sum_loss(out, loss);
    fsdp_tensor_release(out);
    return rc;
}

typedef struct groups {
    fsdp_pg_t *shard, *rep; /* hybrid */
    fsdp_pg_t *self;        /* MixtureOfExperts: this rank alone */
} groups_t;

/* Wraps m as upstream's RECURSIVE init does, then the root. */
static int wrap(const cfg_t *c, const groups_t *g, fsdp_module_t *m, fsdp_unit_t **root) {
    fsdp_options_t o;
    fsdp_options_init(&o);
    o.strategy = c->strategy;
    o.backward_prefetch = c->bp;
    o.forward_prefetch = c->fwd_prefetch;
    o.use_orig_params = c->orig;
    o.check_exec_order = true;
    o.cpu_offload = c->offload;
    if (c->hybrid) {
        o.pg = g->shard;
        o.replicate_pg = g->rep;
    }
    if (c->model == M_DELAY_REDUCE) o.delay_before_reduce_ms = DELAY_MS;
    if (c->model == M_MOE_DELAY) o.delay_before_free_ms = DELAY_MS;
    static const char *const layer_types[] = {"TransformerEncoderLayer", "TransformerDecoderLayer",
                                              NULL};
    if (c->model == M_NESTED || c->model == M_DELAY_LOSS || c->model == M_DELAY_REDUCE) {
        int rc = fu_wrap_listed(m, tm_nested_wrapped_units(), &o, NULL, NULL);
        if (rc < 0) return rc;
    } else if (is_moe(c->model)) {
        int rc = fu_wrap_listed(m, tm_moe_units(), &o, "module.2", g->self);
        if (rc < 0) return rc;
    } else if (c->model == M_ALWAYS) {
        fsdp_policy_t *always = NULL;
        int rc = fsdp_policy_always_create(&always);
        if (rc < 0) return rc;
        o.auto_wrap_policy = always;
        rc = fsdp_wrap(m, &o, root);
        fsdp_policy_release(always);
        return rc;
    } else {
        return fu_wrap_types(m, &o, layer_types, root);
    }
    return fsdp_wrap(m, &o, root);
}

/* ---- helpers ------------------------------------------------------------------------------- */

static int fail(rank_out_t *out, fsdp_ctx_t *ctx, const char *what, int rc) {
    if (!out->err[0])
        snprintf(out->err, sizeof out->err, "rank %d: %s: %s (%s)", fsdp_ctx_rank(ctx), what,
                 fsdp_strerror(rc), fsdp_ctx_last_error(ctx));
    return rc < 0 ? rc : FSDP_EINTERNAL;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* a against the reference b at fp32 tolerance (<= 1: close). */
static double closeness(double a, double b) {
    return fu_closeness(a, b, FU_F32_RTOL, FU_F32_ATOL);
}

/* Every model here trains with SGD(lr 0.01, momentum 0.9), as upstream's harness. */
static int make_sgd(fsdp_ctx_t *ctx, const fsdp_named_list_t *params, fsdp_optim_t **opt) {
    return fu_make_sgd(ctx, params, 0.01, 0.9, opt);
}

/* Divides every gradient of list by w in place. */
static int average_grads(const fsdp_named_list_t *l, int w) {
    for (size_t i = 0; i < l->n; i++) {
        fsdp_tensor_t *g = fsdp_tensor_grad(l->tensors[i]), *s = NULL;
        if (!g) continue;
        int rc = fsdp_scale(g, 1.0 / w, &s);
        if (rc == 0) rc = fsdp_tensor_copy_(g, s);
        fsdp_tensor_release(s);
        if (rc < 0) return rc;
    }
    return FSDP_OK;
}

/* The collectives (calls and bytes, as the group counters count them) one training step must
 * issue, in closed form from each unit's strategy, group and flat sizes. */
typedef struct coll {
    uint64_t ag, rs, ar;       /* calls */
    uint64_t agb, rsb, arb;    /* bytes */
} coll_t;

static void expected_collectives(fsdp_unit_t *const *units, size_t n, bool clip, coll_t *e) {
    *e = (coll_t){0};
    for (size_t i = 0; i < n; i++) {
        fsdp_unit_t *u = units[i];
        if (fsdp_unit_num_params(u) == 0 || fsdp_pg_size(fsdp_unit_pg(u)) == 1) continue;
        fsdp_flat_sizes_t fs;
        fsdp_unit_flat_sizes(u, &fs);
        uint64_t full = (uint64_t)fs.padded_numel * 4, shard = (uint64_t)fs.shard_numel * 4;
        uint64_t gathers = fsdp_unit_is_root(u) ? 1 : 2;
        switch (fsdp_unit_strategy(u)) {
        case FSDP_NO_SHARD: e->ar += 1, e->arb += full; break;
        case FSDP_FULL_SHARD:
            e->ag += gathers, e->agb += gathers * full, e->rs += 1, e->rsb += full;
            break;
        case FSDP_HYBRID_SHARD:
            e->ag += gathers, e->agb += gathers * full, e->rs += 1, e->rsb += full;
            e->ar += 1, e->arb += shard;
            break;
        case FSDP_SHARD_GRAD_OP: e->ag += 1, e->agb += full, e->rs += 1, e->rsb += full; break;
        case FSDP_HYBRID_SHARD_ZERO2:
            e->ag += 1, e->agb += full, e->rs += 1, e->rsb += full, e->ar += 1, e->arb += shard;
            break;
        default: break;
        }
    }
    if (clip && fsdp_pg_size(fsdp_unit_pg(units[0])) > 1) e->ar += 1, e->arb += 8;
}

static void counters_add(fsdp_pg_t *pg, coll_t *c) {
    if (!pg) return;
    fsdp_pg_counters_t pc;
    fsdp_pg_get_counters(pg, &pc);
    c->ag += pc.calls[FSDP_COLL_ALL_GATHER];
    c->rs += pc.calls[FSDP_COLL_REDUCE_SCATTER];
    c->ar += pc.calls[FSDP_COLL_ALL_REDUCE];
    c->agb += pc.bytes[FSDP_COLL_ALL_GATHER];
    c->rsb += pc.bytes[FSDP_COLL_REDUCE_SCATTER];
    c->arb += pc.bytes[FSDP_COLL_ALL_REDUCE];
}

/* ---- the parity run -------------------------------------------------------------------------- */

static int parity_rank(fsdp_ctx_t *ctx, void *arg) {
    run_t *run = arg;
    const cfg_t *c = &run->c;
    int rank = fsdp_ctx_rank(ctx);
    rank_out_t *out = &run->r[rank];
    fsdp_module_t *ref = NULL, *m = NULL, *dm = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_ddp_t *ddp = NULL;
    fsdp_optim_t *ref_opt = NULL, *opt = NULL, *ddp_opt = NULL;
    fsdp_named_list_t ref_params = {0}, params = {0}, full = {0}, ddp_params = {0};
    fsdp_tensor_t *in[2] = {NULL, NULL}, *loss = NULL;
    fsdp_unit_t **units = NULL;
    size_t nall = 0;
    fu_vals_t a = {0}, b = {0}, d = {0}; /* full parameters: FSDP's, the replica's, DDP's */
    groups_t g = {0};
    fsdp_pg_t *world = fsdp_ctx_pg(ctx);
    int rc;

    if (c->hybrid && (rc = fu_hybrid_groups(ctx, 2, &g.shard, &g.rep)) < 0) {
        fail(out, ctx, "hybrid groups", rc);
        goto done;
    }
    if (is_moe(c->model) && (rc = fsdp_pg_split(world, rank, 0, &g.self)) < 0) {
        fail(out, ctx, "expert group", rc);
        goto done;
    }
    if ((rc = build(ctx, c->model, &ref)) < 0) {
        fail(out, ctx, "building the reference", rc);
        goto done;
    }
    if ((rc = build(ctx, c->model, &m)) < 0) {
        fail(out, ctx, "building the model", rc);
        goto done;
    }
    /* The DDP reference over the same group (DummyDDP for the mixture of experts). */
    fsdp_ddp_options_t dopt;
    fsdp_ddp_options_init(&dopt);
    dopt.dummy = is_moe(c->model);
    if ((rc = build(ctx, c->model, &dm)) < 0 || (rc = fsdp_ddp_create(dm, world, &dopt, &ddp)) < 0 ||
        (rc = fsdp_module_named_params(dm, false, &ddp_params)) < 0 ||
        (rc = make_sgd(ctx, &ddp_params, &ddp_opt)) < 0) {
        fail(out, ctx, "building the DDP reference", rc);
        goto done;
    }
    if ((rc = wrap(c, &g, m, &root)) < 0) {
        fail(out, ctx, "wrapping", rc);
        goto done;
    }
    if ((rc = fsdp_module_named_params(ref, false, &ref_params)) < 0 ||
        (rc = make_sgd(ctx, &ref_params, &ref_opt)) < 0) {
        fail(out, ctx, "reference optimizer", rc);
        goto done;
    }
    if ((rc = fsdp_named_params(root, &params)) < 0 || (rc = make_sgd(ctx, &params, &opt)) < 0) {
        fail(out, ctx, "FSDP optimizer", rc);
        goto done;
    }
    fsdp_units(root, &units, &nall);
    /* CPU offload: the shards, and after backward their gradients, are all the host memory. */
    size_t shard_bytes = 0;
    for (size_t i = 0; i < nall; i++) {
        fsdp_flat_sizes_t fs;
        fsdp_unit_flat_sizes(units[i], &fs);
        shard_bytes += (size_t)fs.shard_numel * sizeof(float);
    }
    fsdp_mem_stats_t ms;
    fsdp_mem_get_stats(ctx, &ms);
    if (ms.current[FSDP_MEM_OFFLOAD] != (c->offload ? shard_bytes : 0))
        snprintf(out->err, sizeof out->err, "rank %d: %zu bytes of offloaded memory after "
                 "wrapping; want %zu", rank, ms.current[FSDP_MEM_OFFLOAD],
                 c->offload ? shard_bytes : (size_t)0);

    for (int it = 0; it < c->iters && !out->err[0]; it++) {
        fsdp_optim_zero_grad(ref_opt, true);
        if (is_moe(c->model)) {
            /* DummyDDP: own input, the model averages its shared gradients itself. */
            if ((rc = input_for(ctx, c->model, rank, in)) < 0 ||
                (rc = forward_loss(c->model, ref, in, &loss)) < 0) {
                fail(out, ctx, "reference forward", rc);
                break;
            }
            fsdp_tensor_item(loss, 0, &out->ref_loss[it]);
            rc = tm_moe_run_backward(ref, loss, world);
            fsdp_tensor_release(loss);
            fsdp_tensor_release(in[0]);
            loss = in[0] = NULL;
            if (rc < 0) {
                fail(out, ctx, "reference backward", rc);
                break;
            }
        } else {
            /* Every rank's input through the replica, gradients averaged. */
            for (int r = 0; r < c->world; r++) {
                if ((rc = input_for(ctx, c->model, r, in)) < 0 ||
                    (rc = forward_loss(c->model, ref, in, &loss)) < 0) {
                    fail(out, ctx, "reference forward", rc);
                    break;
                }
                if (r == rank) fsdp_tensor_item(loss, 0, &out->ref_loss[it]);
                rc = fsdp_backward(loss, NULL);
                fsdp_tensor_release(loss);
                fsdp_tensor_release(in[0]);
                fsdp_tensor_release(in[1]);
                loss = in[0] = in[1] = NULL;
                if (rc < 0) {
                    fail(out, ctx, "reference backward", rc);
                    break;
                }
            }
            if (out->err[0]) break;
            if ((rc = average_grads(&ref_params, c->world)) < 0) {
                fail(out, ctx, "reference averaging", rc);
                break;
            }
        }
        double ref_norm = 0, fsdp_norm = 0;
        if (c->clip != 0 &&
            (rc = fsdp_clip_grad_norm(ctx, ref_params.n, ref_params.tensors, CLIP_MAX_NORM,
                                      c->clip, &ref_norm)) < 0) {
            fail(out, ctx, "reference clip", rc);
            break;
        }
        if ((rc = fsdp_optim_step(ref_opt)) < 0) {
            fail(out, ctx, "reference step", rc);
            break;
        }

        /* DDP: this rank's input, gradients averaged by DDP (or by the model under DummyDDP). */
        fsdp_optim_zero_grad(ddp_opt, true);
        if ((rc = input_for(ctx, c->model, rank, in)) < 0 ||
            (rc = forward_loss_ddp(c->model, ddp, in, &loss)) < 0) {
            fail(out, ctx, "DDP forward", rc);
            break;
        }
        fsdp_tensor_item(loss, 0, &out->ddp_loss[it]);
        rc = is_moe(c->model) ? tm_moe_run_backward(dm, loss, world) : fsdp_backward(loss, NULL);
        fsdp_tensor_release(loss);
        fsdp_tensor_release(in[0]);
        fsdp_tensor_release(in[1]);
        loss = in[0] = in[1] = NULL;
        double ddp_norm = 0;
        if (rc == 0 && c->clip != 0)
            rc = fsdp_clip_grad_norm(ctx, ddp_params.n, ddp_params.tensors, CLIP_MAX_NORM,
                                     c->clip, &ddp_norm);
        if (rc == 0) rc = fsdp_optim_step(ddp_opt);
        if (rc < 0) {
            fail(out, ctx, "DDP step", rc);
            break;
        }

        /* FSDP: this rank's input only. */
        fsdp_pg_reset_counters(world);
        if (g.shard) fsdp_pg_reset_counters(g.shard);
        if (g.rep) fsdp_pg_reset_counters(g.rep);
        if (g.self) fsdp_pg_reset_counters(g.self);
        fsdp_optim_zero_grad(opt, true);
        if ((rc = input_for(ctx, c->model, rank, in)) < 0 ||
            (rc = forward_loss(c->model, m, in, &loss)) < 0) {
            fail(out, ctx, "FSDP forward", rc);
            break;
        }
        fsdp_tensor_item(loss, 0, &out->fsdp_loss[it]);
        if (c->model == M_DELAY_LOSS && rank == 0) sleep_ms(DELAY_MS);
        /* Memory after forward: FULL_SHARD freed every non-root unit, SHARD_GRAD_OP did not. */
        for (size_t i = 1; i < nall && !out->err[0]; i++) {
            if (fsdp_unit_num_params(units[i]) == 0) continue;
            fsdp_sharding_strategy_t st = fsdp_unit_strategy(units[i]);
            bool held = fsdp_unit_is_unsharded(units[i]);
            bool want = !(st == FSDP_FULL_SHARD || st == FSDP_HYBRID_SHARD);
            if (held != want)
                snprintf(out->err, sizeof out->err,
                         "rank %d: after forward unit '%s' is %s under %s", rank,
                         fsdp_unit_fqn(units[i]), held ? "unsharded" : "sharded",
                         fsdp_sharding_strategy_name(st));
        }
        rc = fsdp_backward(loss, NULL);
        fsdp_tensor_release(loss);
        fsdp_tensor_release(in[0]);
        fsdp_tensor_release(in[1]);
        loss = in[0] = in[1] = NULL;
        if (rc < 0) {
            fail(out, ctx, "FSDP backward", rc);
            break;
        }
        fsdp_mem_get_stats(ctx, &ms);
        if (ms.current[FSDP_MEM_OFFLOAD] != (c->offload ? 2 * shard_bytes : 0) && !out->err[0])
            snprintf(out->err, sizeof out->err, "rank %d: %zu bytes of offloaded memory after "
                     "backward; want %zu (shards and their gradients)", rank,
                     ms.current[FSDP_MEM_OFFLOAD], c->offload ? 2 * shard_bytes : (size_t)0);
        for (size_t i = 0; i < nall; i++)
            if (fsdp_unit_state(units[i]) != FSDP_STATE_IDLE && !out->err[0])
                snprintf(out->err, sizeof out->err, "rank %d: unit '%s' not IDLE after backward",
                         rank, fsdp_unit_fqn(units[i]));
        if (c->clip != 0) {
            if ((rc = fsdp_unit_clip_grad_norm(root, CLIP_MAX_NORM, c->clip, &fsdp_norm)) < 0) {
                fail(out, ctx, "FSDP clip", rc);
                break;
            }
            double cl = closeness(fsdp_norm, ref_norm);
            if (cl > out->worst_loss) out->worst_loss = cl;
            if (!(ref_norm > CLIP_MAX_NORM) && !out->err[0])
                snprintf(out->err, sizeof out->err, "rank %d: the gradient norm %g does not "
                         "exceed %g: clipping is not exercised", rank, ref_norm, CLIP_MAX_NORM);
        }
        if ((rc = fsdp_optim_step(opt)) < 0) {
            fail(out, ctx, "FSDP step", rc);
            break;
        }
        /* Collectives of the step, in closed form. */
        coll_t got = {0}, want;
        counters_add(world, &got);
        counters_add(g.shard, &got);
        counters_add(g.rep, &got);
        counters_add(g.self, &got);
        expected_collectives(units, nall, c->clip != 0, &want);
        /* check_exec_order: one all-gather of an index per unit in the first iteration */
        int rw = fsdp_pg_size(fsdp_unit_pg(root));
        if (it == 0 && rw > 1) want.ag += nall, want.agb += nall * 8 * (uint64_t)rw;
        if (!out->err[0] && memcmp(&got, &want, sizeof got) != 0)
            snprintf(out->err, sizeof out->err,
                     "rank %d step %d: collectives all-gather %llu (%llu B), reduce-scatter %llu "
                     "(%llu B), all-reduce %llu (%llu B); want %llu (%llu B), %llu (%llu B), %llu "
                     "(%llu B)",
                     rank, it, (unsigned long long)got.ag, (unsigned long long)got.agb,
                     (unsigned long long)got.rs, (unsigned long long)got.rsb,
                     (unsigned long long)got.ar, (unsigned long long)got.arb,
                     (unsigned long long)want.ag, (unsigned long long)want.agb,
                     (unsigned long long)want.rs, (unsigned long long)want.rsb,
                     (unsigned long long)want.ar, (unsigned long long)want.arb);
        if (c->save_model && !out->err[0] && (rc = fu_state_round_trip(root)) < 0) {
            fail(out, ctx, "state round trip", rc);
            break;
        }
        double cl = closeness(out->fsdp_loss[it], out->ref_loss[it]);
        if (cl > out->worst_loss) out->worst_loss = cl;
        cl = closeness(out->fsdp_loss[it], out->ddp_loss[it]);
        if (cl > out->worst_loss) out->worst_loss = cl;
    }

    /* Full parameters against the reference. */
    if (!out->err[0]) {
        if ((rc = fu_summon_nowb(root)) < 0) {
            fail(out, ctx, "summon", rc);
            goto done;
        }
        rc = fsdp_module_named_params(m, false, &full);
        if (rc == 0) rc = fu_list_values(&full, false, &a);
        if (rc == 0) rc = fu_list_values(&ref_params, false, &b);
        if (rc == 0) rc = fu_list_values(&ddp_params, false, &d);
        if (rc == 0 && d.n != b.n) rc = FSDP_EINTERNAL;
        int rc2 = fsdp_summon_end(root);
        if (rc == 0) rc = rc2;
        if (rc < 0) {
            fail(out, ctx, "gathering full parameters", rc);
            goto done;
        }
        if (a.n != b.n || full.n != ref_params.n) {
            snprintf(out->err, sizeof out->err, "rank %d: %zu full parameters (%zu elements), "
                     "reference %zu (%zu)", rank, full.n, a.n, ref_params.n, b.n);
            goto done;
        }
        for (size_t i = 0; i < full.n; i++)
            if (strcmp(full.names[i], ref_params.names[i]) != 0) {
                snprintf(out->err, sizeof out->err, "rank %d: parameter %zu is '%s', reference "
                         "'%s'", rank, i, full.names[i], ref_params.names[i]);
                goto done;
            }
        uint64_t h = 1469598103934665603ull;
        for (size_t i = 0; i < a.n; i++) {
            double cl = fmax(closeness(a.v[i], b.v[i]), closeness(a.v[i], d.v[i]));
            if (cl > out->worst_param || isnan(cl)) out->worst_param = isnan(cl) ? INFINITY : cl;
            float f = (float)a.v[i];
            uint32_t bits;
            memcpy(&bits, &f, 4);
            h = (h ^ bits) * 1099511628211ull;
        }
        out->checksum = h;
    }
done:
    free(units);
    fu_vals_free(&a);
    fu_vals_free(&b);
    fu_vals_free(&d);
    fsdp_named_list_free(&ddp_params);
    fsdp_optim_destroy(ddp_opt);
    fsdp_ddp_destroy(ddp);
    fsdp_module_release(dm);
    fsdp_named_list_free(&full);
    fsdp_named_list_free(&params);
    fsdp_named_list_free(&ref_params);
    fsdp_optim_destroy(opt);
    fsdp_optim_destroy(ref_opt);
    fsdp_unit_destroy(root);
    fsdp_module_release(m);
    fsdp_module_release(ref);
    fsdp_pg_destroy(g.shard);
    fsdp_pg_destroy(g.rep);
    fsdp_pg_destroy(g.self);
    return out->err[0] ? FSDP_EINTERNAL : FSDP_OK;
}

static void describe(const cfg_t *c, char *buf, size_t len) {
    char clip[32] = "";
    if (c->clip != 0) snprintf(clip, sizeof clip, " clip_grad_norm(%g)", c->clip);
    snprintf(buf, len,
             "%s %s W=%d%s %s offload=%d bwd_prefetch=%s fwd_prefetch=%d use_orig_params=%d%s",
             model_ids[c->model], model_names[c->model], c->world, c->hybrid ? " (2x2)" : "",
             fsdp_sharding_strategy_name(c->strategy), c->offload,
             fsdp_backward_prefetch_name(c->bp), c->fwd_prefetch, c->orig, clip);
}

/* Runs one configuration and reports it; returns the run (caller frees). */
static run_t *parity(const cfg_t *c) {
    run_t *run = calloc(1, sizeof *run);
    run->c = *c;
    fsdp_sim_options_t so;
    fsdp_sim_options_init(&so);
    so.world_size = c->world;
    so.seed = 7;
    int rc = fsdp_sim_run(&so, parity_rank, run, NULL);
    char name[256];
    describe(c, name, sizeof name);
    const char *err = NULL;
    double wl = 0, wp = 0;
    for (int r = 0; r < c->world; r++) {
        if (run->r[r].err[0] && !err) err = run->r[r].err;
        if (run->r[r].worst_loss > wl) wl = run->r[r].worst_loss;
        if (run->r[r].worst_param > wp) wp = run->r[r].worst_param;
    }
    if (rc < 0 && !err) err = "the sim run failed";
    if (err) tap_diag("%s", err);
    if (err || wl > 1.0 || wp > 1.0)
        for (int r = 0; r < c->world; r++)
            for (int it = 0; it < c->iters; it++)
                tap_diag("rank %d step %d: loss %.9g, reference %.9g", r, it,
                         run->r[r].fsdp_loss[it], run->r[r].ref_loss[it]);
    tap_ok(!err && wl <= 1.0 && wp <= 1.0,
           "parity %s: losses and full parameters match the reference (worst %.3g, %.3g of "
           "tolerance)",
           name, wl, wp);
    return run;
}

/* ---- execution order ------------------------------------------------------------------------- */

/* A module that runs its children "a" and "b" in an order that the test chooses per rank and
 * per iteration: order[rank] is 0 for a-then-b, 1 for b-then-a. */
typedef struct swap_impl {
    int order;
} swap_impl_t;

static int swap_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                        fsdp_tensor_t **out) {
    (void)nin, (void)nout;
    swap_impl_t *impl = fsdp_module_impl(m);
    fsdp_module_t *first = fsdp_module_child(m, impl->order ? "b" : "a");
    fsdp_module_t *second = fsdp_module_child(m, impl->order ? "a" : "b");
    fsdp_tensor_t *h = NULL;
    int rc = fsdp_module_forward1(first, in[0], &h);
    if (rc == 0) rc = fsdp_module_forward1(second, h, &out[0]);
    fsdp_tensor_release(h);
    return rc;
}

static void swap_destroy(void *impl) { free(impl); }

static const fsdp_module_ops_t swap_ops = {"Swap", swap_forward, swap_destroy};

typedef struct order_case {
    bool per_rank;      /* rank 1 runs b first in the first iteration */
    bool change_later;  /* every rank runs b first in the second iteration */
    bool fwd_prefetch;
    int rc[8];
    char msg[8][512];
} order_case_t;

static int order_rank(fsdp_ctx_t *ctx, void *arg) {
    order_case_t *oc = arg;
    int rank = fsdp_ctx_rank(ctx);
    swap_impl_t *impl = calloc(1, sizeof *impl);
    fsdp_module_t *m = NULL, *a = NULL, *b = NULL;
    fsdp_unit_t *root = NULL, *ua = NULL, *ub = NULL;
    fsdp_tensor_t *x = NULL, *y = NULL;
    const int64_t shape[2] = {2, 4};
    tm_manual_seed(ctx, 3);
    int rc = impl ? fsdp_module_create(ctx, &swap_ops, impl, &m) : FSDP_ENOMEM;
    if (rc < 0) free(impl);
    if (rc == 0) rc = fsdp_linear_create(ctx, 4, 4, true, &a);
    if (rc == 0) rc = fsdp_linear_create(ctx, 4, 4, true, &b);
    if (rc == 0) rc = fsdp_module_add_child(m, "a", a);
    if (rc == 0) rc = fsdp_module_add_child(m, "b", b);
    fsdp_options_t o;
    fsdp_options_init(&o);
    o.check_exec_order = true;
    o.forward_prefetch = oc->fwd_prefetch;
    if (rc == 0) rc = fsdp_wrap(a, &o, &ua);
    if (rc == 0) rc = fsdp_wrap(b, &o, &ub);
    if (rc == 0) rc = fsdp_wrap(m, &o, &root);
    if (rc == 0) rc = fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 2, shape, 0.5, FSDP_MEM_OTHER, &x);
    for (int it = 0; it < 2 && rc == 0; it++) {
        impl->order = it == 0 ? (oc->per_rank && rank == 1) : oc->change_later;
        fsdp_tensor_t *loss = NULL;
        rc = fsdp_module_forward1(m, x, &y);
        if (rc == 0) rc = tm_sum_loss(y, &loss);
        if (rc == 0) rc = fsdp_backward(loss, NULL);
        fsdp_tensor_release(loss);
        fsdp_tensor_release(y);
        y = NULL;
    }
    oc->rc[rank] = rc;
    snprintf(oc->msg[rank], sizeof oc->msg[rank], "%s", rc < 0 ? fsdp_ctx_last_error(ctx) : "");
    fsdp_tape_clear(ctx);
    fsdp_tensor_release(x);
    fsdp_unit_destroy(root);
    if (!root) {
        fsdp_unit_destroy(ua);
        fsdp_unit_destroy(ub);
    }
    fsdp_module_release(a);
    fsdp_module_release(b);
    fsdp_module_release(m);
    return FSDP_OK;
}

static void exec_order_tests(void) {
    fsdp_sim_options_t so;
    fsdp_sim_options_init(&so);
    so.world_size = 2;
    so.timeout_ms = 20000;
    order_case_t oc = {.per_rank = true};
    fsdp_sim_run(&so, order_rank, &oc, NULL);
    bool named = true;
    for (int r = 0; r < 2; r++)
        named &= oc.rc[r] == FSDP_EINVAL && strstr(oc.msg[r], "different orders") &&
                 strstr(oc.msg[r], "'a'") && strstr(oc.msg[r], "'b'") &&
                 strstr(oc.msg[r], "rank 1");
    if (!named) tap_diag("rank 0: %d %s\nrank 1: %d %s", oc.rc[0], oc.msg[0], oc.rc[1], oc.msg[1]);
    tap_ok(named, "execution order: ranks running units in different orders both get an error "
           "naming the units and the rank (no hang, no silent exchange of shards)");

    order_case_t ch = {.change_later = true, .fwd_prefetch = true};
    fsdp_sim_run(&so, order_rank, &ch, NULL);
    bool err = ch.rc[0] == FSDP_EINVAL && strstr(ch.msg[0], "forward order changed") &&
               strstr(ch.msg[0], "forward prefetch");
    if (!err) tap_diag("rank 0: %d %s", ch.rc[0], ch.msg[0]);
    tap_ok(err, "execution order: a forward order that changes while forward prefetch relies on "
           "it is an error");

    order_case_t ok = {.change_later = true, .fwd_prefetch = false};
    fsdp_sim_run(&so, order_rank, &ok, NULL);
    tap_ok(ok.rc[0] == 0 && ok.rc[1] == 0,
           "execution order: without forward prefetch a changed order only warns (rc %d, %d: %s)",
           ok.rc[0], ok.rc[1], ok.msg[0]);
}

int main(void) {
    tap_plan_lazy();
    /* The seed-000 axes. */
    const fsdp_sharding_strategy_t *strategies = fu_strategies;
    const fsdp_backward_prefetch_t *bps = fu_bwd_prefetches;
    /* cfg_t fields in order: model, strategy, backward prefetch, forward prefetch,
     * use_orig_params, world, iterations, save_model, hybrid, clip, offload. */
    /* clang-format off */
    /* The seed-000 matrix at world sizes 2 and 3. */
    for (int model = 0; model < M_COUNT; model++)
        for (int w = 2; w <= 3; w++)
            for (int off = 0; off < 2; off++)
                for (int s = 0; s < 3; s++)
                    for (int b = 0; b < 3; b++)
                        for (int fp = 0; fp < 2; fp++)
                            for (int orig = 0; orig < 2; orig++) {
                                cfg_t c = {(model_kind_t)model, strategies[s], bps[b], fp, orig,
                                           w, 2, true, false, 0, off};
                                free(parity(&c));
                            }
    /* A subset at 4 and 8 ranks. */
    for (int model = 0; model < M_COUNT; model++)
        for (int s = 0; s < 3; s++) {
            cfg_t c = {(model_kind_t)model, strategies[s], FSDP_BACKWARD_PRE, true, s != 1, 4, 2,
                       true, false, 0, s == 0};
            free(parity(&c));
        }
    {
        cfg_t c = {M_NESTED, FSDP_FULL_SHARD, FSDP_BACKWARD_POST, false, true, 8, 2, true, false,
                   0, true};
        free(parity(&c));
        c.model = M_TRANSFORMER;
        c.orig = false;
        free(parity(&c));
    }
    /* Hybrid sharding at 4 = 2 x 2. */
    const fsdp_sharding_strategy_t hybrids[] = {FSDP_HYBRID_SHARD, FSDP_HYBRID_SHARD_ZERO2};
    const model_kind_t hmodels[] = {M_NESTED, M_ALWAYS, M_TRANSFORMER};
    for (int mi = 0; mi < 3; mi++)
        for (int s = 0; s < 2; s++)
            for (int b = 0; b < 3; b++)
                for (int orig = 0; orig < 2; orig++) {
                    cfg_t c = {hmodels[mi], hybrids[s], bps[b], b == 1, orig, 4, 2, true, true,
                               0, b == 2};
                    free(parity(&c));
                }
    /* clip_grad_norm over shards, 2-norm and max norm. Not MixtureOfExperts: there each rank's
     * norm includes its own expert, so ranks clip the shared shards by different factors (as in
     * PyTorch) and no per-rank replica reproduces that. */
    const double norms[] = {2.0, INFINITY};
    const model_kind_t cmodels[] = {M_NESTED, M_TRANSFORMER, M_ALWAYS};
    for (int mi = 0; mi < 3; mi++)
        for (int ni = 0; ni < 2; ni++)
            for (int s = 0; s < 3; s++)
                for (int w = 2; w <= 3; w++) {
                    cfg_t c = {cmodels[mi], strategies[s], FSDP_BACKWARD_PRE, false, s == 0, w, 2,
                               false, false, norms[ni], ni == 1};
                    free(parity(&c));
                }
    for (int ni = 0; ni < 2; ni++) {
        cfg_t c = {M_TRANSFORMER, FSDP_HYBRID_SHARD, FSDP_BACKWARD_PRE, false, true, 4, 2, false,
                   true, norms[ni], false};
        free(parity(&c));
    }
    /* Bitwise determinism: the same configuration twice. */
    for (int model = 0; model < M_COUNT; model++) {
        cfg_t c = {(model_kind_t)model, FSDP_FULL_SHARD, FSDP_BACKWARD_PRE, true, true, 3, 3,
                   false, false, 0, model % 2 == 1};
        /* clang-format on */
        run_t *x = parity(&c), *y = parity(&c);
        bool same = true;
        for (int r = 0; r < c.world; r++) {
            same &= x->r[r].checksum == y->r[r].checksum && x->r[r].checksum != 0;
            same &= memcmp(x->r[r].fsdp_loss, y->r[r].fsdp_loss, sizeof x->r[r].fsdp_loss) == 0;
        }
        tap_ok(same, "determinism %s: two runs give bitwise the same losses and parameters",
               model_names[model]);
        free(x);
        free(y);
    }
    exec_order_tests();
    return tap_done();
}
