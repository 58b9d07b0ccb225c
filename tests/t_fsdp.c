/*
 * t_fsdp.c: FSDP units against an independent reference (CORE-P01, CORE-P03, CORE-P04 and the
 * runtime properties the seed-000 matrix relies on).
 *
 * The parity recipe (spec section 2.3, _test_fsdp_parity): every sim rank builds the model
 * twice from the same seed. The reference is trained without FSDP and without any collective:
 * each step it runs the inputs of all W ranks through its own replica one after the other,
 * averages the gradients (what DDP computes) and takes an SGD step (lr 0.01, momentum 0.9).
 * The FSDP model runs only this rank's input. Each step the losses must agree (fp32 tolerance:
 * rtol 1.3e-6, atol 1e-5), the units must be IDLE, and the parameters go through a full
 * round trip (summon with writeback, zero, restore); at the end the full parameters gathered
 * with fsdp_summon_begin must equal the reference's.
 *
 * Alongside, per step: the number of all-gathers, reduce-scatters and all-reduces on the group
 * equals the closed form of the strategy, and after forward FULL_SHARD has freed every
 * non-root unit's unsharded parameters while SHARD_GRAD_OP still holds them.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "models/models.h"
#include "tap.h"

#define RTOL 1.3e-6
#define ATOL 1e-5
#define MAX_ITERS 4

typedef enum { M_NESTED = 0, M_ALWAYS, M_TRANSFORMER, M_COUNT } model_kind_t;
static const char *const model_names[M_COUNT] = {"NestedWrappedModule",
                                                 "AlwaysWrapNestedWrappedModule",
                                                 "TransformerWithSharedParams"};
static const char *const model_ids[M_COUNT] = {"CORE-P01", "CORE-P03", "CORE-P04"};

typedef struct cfg {
    model_kind_t model;
    fsdp_sharding_strategy_t strategy;
    fsdp_backward_prefetch_t bp;
    bool fwd_prefetch;
    bool orig;
    int world;
    int iters;
    bool save_model;
} cfg_t;

typedef struct rank_out {
    char err[768];
    double ref_loss[MAX_ITERS], fsdp_loss[MAX_ITERS];
    double worst_loss;  /* |a - b| / (atol + rtol |b|), worst over steps */
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

static bool always(fsdp_module_t *m, const char *fqn, int64_t n, void *arg) {
    (void)m, (void)fqn, (void)n, (void)arg;
    return true;
}

static int depth(const char *fqn) {
    int d = 0;
    for (; *fqn; fqn++) d += *fqn == '.';
    return d;
}

/* Wraps m as upstream's RECURSIVE init does, then the root. */
static int wrap(fsdp_ctx_t *ctx, const cfg_t *c, fsdp_module_t *m, fsdp_unit_t **root) {
    fsdp_options_t o;
    fsdp_options_init(&o);
    o.strategy = c->strategy;
    o.backward_prefetch = c->bp;
    o.forward_prefetch = c->fwd_prefetch;
    o.use_orig_params = c->orig;
    (void)ctx;
    static const char *const layer_types[] = {"TransformerEncoderLayer",
                                              "TransformerDecoderLayer", NULL};
    if (c->model == M_NESTED) {
        /* Hand nesting, innermost first. */
        const char *const *units = tm_nested_wrapped_units();
        int n = 0;
        while (units[n]) n++;
        for (int d = 8; d >= 0; d--)
            for (int i = 0; i < n; i++) {
                if (depth(units[i]) != d) continue;
                fsdp_unit_t *u = NULL;
                int rc = fsdp_wrap(fsdp_module_child(m, units[i]), &o, &u);
                if (rc < 0) return rc;
            }
    } else if (c->model == M_ALWAYS) {
        o.policy = always;
    } else {
        o.wrap_types = layer_types;
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

static double closeness(double a, double b) { return fabs(a - b) / (ATOL + RTOL * fabs(b)); }

static int make_sgd(fsdp_ctx_t *ctx, const fsdp_named_list_t *params, fsdp_optim_t **opt) {
    fsdp_sgd_options_t so;
    fsdp_sgd_options_init(&so);
    so.lr = 0.01;
    so.momentum = 0.9;
    int rc = fsdp_optim_sgd_create(ctx, &so, &opt[0]);
    if (rc == 0)
        rc = fsdp_optim_add_group(*opt, params->n, params->tensors,
                                  (const char *const *)params->names, NULL, NULL);
    return rc;
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

/* Every tensor's values as doubles (n elements each), in list order. */
static int values(const fsdp_named_list_t *l, double **out, size_t *n) {
    size_t total = 0;
    for (size_t i = 0; i < l->n; i++) total += (size_t)fsdp_tensor_numel(l->tensors[i]);
    double *v = malloc((total ? total : 1) * sizeof *v);
    if (!v) return FSDP_ENOMEM;
    size_t k = 0;
    for (size_t i = 0; i < l->n; i++)
        for (int64_t j = 0; j < fsdp_tensor_numel(l->tensors[i]); j++) {
            int rc = fsdp_tensor_item(l->tensors[i], j, &v[k++]);
            if (rc < 0) {
                free(v);
                return rc;
            }
        }
    *out = v;
    *n = total;
    return FSDP_OK;
}

/* Full state round trip under summon (PyTorch's save_model: state_dict, zero under
 * summon_full_params, load_state_dict). */
static int round_trip(fsdp_unit_t *root) {
    fsdp_module_t *m = fsdp_unit_module(root);
    fsdp_named_list_t sd = {0}, saved = {0};
    int rc = fsdp_summon_begin(root, true, true);
    if (rc < 0) return rc;
    rc = fsdp_module_state_dict(m, &sd);
    saved.owned = true;
    saved.n = sd.n;
    saved.names = calloc(sd.n ? sd.n : 1, sizeof *saved.names);
    saved.tensors = calloc(sd.n ? sd.n : 1, sizeof *saved.tensors);
    if (!saved.names || !saved.tensors) rc = rc < 0 ? rc : FSDP_ENOMEM;
    for (size_t i = 0; i < sd.n && rc == 0; i++) {
        saved.names[i] = strdup(sd.names[i]);
        rc = fsdp_tensor_clone(sd.tensors[i], FSDP_MEM_OTHER, &saved.tensors[i]);
    }
    /* Zeroed only once everything is saved: tied parameters appear under several names. */
    for (size_t i = 0; i < sd.n && rc == 0; i++)
        if (fsdp_dtype_is_float(fsdp_tensor_dtype(sd.tensors[i])))
            rc = fsdp_tensor_zero_(sd.tensors[i]);
    int rc2 = fsdp_summon_end(root);
    if (rc == 0) rc = rc2;
    fsdp_named_list_free(&sd);
    if (rc == 0) rc = fsdp_summon_begin(root, true, true);
    if (rc == 0) {
        rc = fsdp_module_load_state_dict(m, &saved, true);
        rc2 = fsdp_summon_end(root);
        if (rc == 0) rc = rc2;
    }
    fsdp_named_list_free(&saved);
    return rc;
}

static int count_param_units(fsdp_unit_t *root, bool *root_has) {
    fsdp_unit_t **units = NULL;
    size_t n = 0;
    fsdp_units(root, &units, &n);
    int k = 0;
    for (size_t i = 0; i < n; i++) k += fsdp_unit_num_params(units[i]) > 0;
    *root_has = fsdp_unit_num_params(root) > 0;
    free(units);
    return k;
}

/* ---- the parity run -------------------------------------------------------------------------- */

static int parity_rank(fsdp_ctx_t *ctx, void *arg) {
    run_t *run = arg;
    const cfg_t *c = &run->c;
    int rank = fsdp_ctx_rank(ctx);
    rank_out_t *out = &run->r[rank];
    fsdp_module_t *ref = NULL, *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_optim_t *ref_opt = NULL, *opt = NULL;
    fsdp_named_list_t ref_params = {0}, params = {0}, full = {0};
    fsdp_tensor_t *in[2] = {NULL, NULL}, *loss = NULL;
    double *a = NULL, *b = NULL;
    int rc;

    if ((rc = build(ctx, c->model, &ref)) < 0) return fail(out, ctx, "building the reference", rc);
    if ((rc = build(ctx, c->model, &m)) < 0) return fail(out, ctx, "building the model", rc);
    if ((rc = wrap(ctx, c, m, &root)) < 0) {
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
    bool root_has = false;
    int nunits = count_param_units(root, &root_has);
    fsdp_unit_t **units = NULL;
    size_t nall = 0;
    fsdp_units(root, &units, &nall);

    for (int it = 0; it < c->iters && !out->err[0]; it++) {
        /* Reference: every rank's input through the replica, gradients averaged. */
        fsdp_optim_zero_grad(ref_opt, true);
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
        if ((rc = average_grads(&ref_params, c->world)) < 0 ||
            (rc = fsdp_optim_step(ref_opt)) < 0) {
            fail(out, ctx, "reference step", rc);
            break;
        }

        /* FSDP: this rank's input only. */
        fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
        fsdp_pg_reset_counters(pg);
        fsdp_optim_zero_grad(opt, true);
        if ((rc = input_for(ctx, c->model, rank, in)) < 0 ||
            (rc = forward_loss(c->model, m, in, &loss)) < 0) {
            fail(out, ctx, "FSDP forward", rc);
            break;
        }
        fsdp_tensor_item(loss, 0, &out->fsdp_loss[it]);
        /* Memory after forward: FULL_SHARD freed every non-root unit, SHARD_GRAD_OP did not. */
        for (size_t i = 1; i < nall && !out->err[0]; i++) {
            if (fsdp_unit_num_params(units[i]) == 0) continue;
            bool held = fsdp_unit_is_unsharded(units[i]);
            bool want = c->strategy != FSDP_FULL_SHARD || c->world == 1;
            if (held != want)
                snprintf(out->err, sizeof out->err,
                         "rank %d: after forward unit '%s' is %s under %s", rank,
                         fsdp_unit_fqn(units[i]), held ? "unsharded" : "sharded",
                         fsdp_sharding_strategy_name(c->strategy));
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
        for (size_t i = 0; i < nall; i++)
            if (fsdp_unit_state(units[i]) != FSDP_STATE_IDLE && !out->err[0])
                snprintf(out->err, sizeof out->err, "rank %d: unit '%s' not IDLE after backward",
                         rank, fsdp_unit_fqn(units[i]));
        if ((rc = fsdp_optim_step(opt)) < 0) {
            fail(out, ctx, "FSDP step", rc);
            break;
        }
        /* Collectives of the step, in closed form. */
        fsdp_pg_counters_t pc;
        fsdp_pg_get_counters(pg, &pc);
        uint64_t ag = 0, rs = 0, ar = 0;
        if (c->world == 1) {
            /* one rank: nothing to communicate */
        } else if (c->strategy == FSDP_NO_SHARD) {
            ar = (uint64_t)nunits;
        } else if (c->strategy == FSDP_FULL_SHARD) {
            ag = (uint64_t)(2 * nunits - (root_has ? 1 : 0));
            rs = (uint64_t)nunits;
        } else {
            ag = rs = (uint64_t)nunits;
        }
        if (!out->err[0] && (pc.calls[FSDP_COLL_ALL_GATHER] != ag ||
                             pc.calls[FSDP_COLL_REDUCE_SCATTER] != rs ||
                             pc.calls[FSDP_COLL_ALL_REDUCE] != ar))
            snprintf(out->err, sizeof out->err,
                     "rank %d step %d: collectives all-gather %llu, reduce-scatter %llu, "
                     "all-reduce %llu; want %llu, %llu, %llu (%d units with parameters)",
                     rank, it, (unsigned long long)pc.calls[FSDP_COLL_ALL_GATHER],
                     (unsigned long long)pc.calls[FSDP_COLL_REDUCE_SCATTER],
                     (unsigned long long)pc.calls[FSDP_COLL_ALL_REDUCE], (unsigned long long)ag,
                     (unsigned long long)rs, (unsigned long long)ar, nunits);
        if (c->save_model && !out->err[0] && (rc = round_trip(root)) < 0) {
            fail(out, ctx, "state round trip", rc);
            break;
        }
        double cl = closeness(out->fsdp_loss[it], out->ref_loss[it]);
        if (cl > out->worst_loss) out->worst_loss = cl;
    }
    free(units);

    /* Full parameters against the reference. */
    if (!out->err[0]) {
        size_t na = 0, nb = 0;
        if ((rc = fsdp_summon_begin(root, true, false)) < 0) {
            fail(out, ctx, "summon", rc);
            goto done;
        }
        rc = fsdp_module_named_params(m, false, &full);
        if (rc == 0) rc = values(&full, &a, &na);
        if (rc == 0) rc = values(&ref_params, &b, &nb);
        int rc2 = fsdp_summon_end(root);
        if (rc == 0) rc = rc2;
        if (rc < 0) {
            fail(out, ctx, "gathering full parameters", rc);
            goto done;
        }
        if (na != nb || full.n != ref_params.n) {
            snprintf(out->err, sizeof out->err, "rank %d: %zu full parameters (%zu elements), "
                     "reference %zu (%zu)", rank, full.n, na, ref_params.n, nb);
            goto done;
        }
        for (size_t i = 0; i < full.n; i++)
            if (strcmp(full.names[i], ref_params.names[i]) != 0) {
                snprintf(out->err, sizeof out->err, "rank %d: parameter %zu is '%s', reference "
                         "'%s'", rank, i, full.names[i], ref_params.names[i]);
                goto done;
            }
        uint64_t h = 1469598103934665603ull;
        for (size_t i = 0; i < na; i++) {
            double cl = closeness(a[i], b[i]);
            if (cl > out->worst_param || isnan(cl)) out->worst_param = isnan(cl) ? INFINITY : cl;
            float f = (float)a[i];
            uint32_t bits;
            memcpy(&bits, &f, 4);
            h = (h ^ bits) * 1099511628211ull;
        }
        out->checksum = h;
    }
done:
    free(a);
    free(b);
    fsdp_named_list_free(&full);
    fsdp_named_list_free(&params);
    fsdp_named_list_free(&ref_params);
    fsdp_optim_destroy(opt);
    fsdp_optim_destroy(ref_opt);
    fsdp_destroy(root);
    fsdp_module_release(m);
    fsdp_module_release(ref);
    return out->err[0] ? FSDP_EINTERNAL : FSDP_OK;
}

static void describe(const cfg_t *c, char *buf, size_t len) {
    snprintf(buf, len, "%s %s W=%d %s bwd_prefetch=%s fwd_prefetch=%d use_orig_params=%d",
             model_ids[c->model], model_names[c->model], c->world,
             fsdp_sharding_strategy_name(c->strategy), fsdp_backward_prefetch_name(c->bp),
             c->fwd_prefetch, c->orig);
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

int main(int argc, char **argv) {
    (void)argc, (void)argv;
    tap_plan_lazy();
    const fsdp_sharding_strategy_t strategies[] = {FSDP_FULL_SHARD, FSDP_SHARD_GRAD_OP,
                                                   FSDP_NO_SHARD};
    const fsdp_backward_prefetch_t bps[] = {FSDP_BACKWARD_PREFETCH_NONE, FSDP_BACKWARD_PRE,
                                            FSDP_BACKWARD_POST};
    /* The seed-000 matrix at world sizes 2 and 3. */
    for (int model = 0; model < M_COUNT; model++)
        for (int w = 2; w <= 3; w++)
            for (int s = 0; s < 3; s++)
                for (int b = 0; b < 3; b++)
                    for (int fp = 0; fp < 2; fp++)
                        for (int orig = 0; orig < 2; orig++) {
                            cfg_t c = {(model_kind_t)model, strategies[s], bps[b], fp, orig, w,
                                       2, true};
                            free(parity(&c));
                        }
    /* A subset at 4 and 8 ranks. */
    for (int model = 0; model < M_COUNT; model++)
        for (int s = 0; s < 3; s++) {
            cfg_t c = {(model_kind_t)model, strategies[s], FSDP_BACKWARD_PRE, true, s != 1, 4, 2,
                       true};
            free(parity(&c));
        }
    {
        cfg_t c = {M_NESTED, FSDP_FULL_SHARD, FSDP_BACKWARD_POST, false, true, 8, 2, true};
        free(parity(&c));
        c.model = M_TRANSFORMER;
        c.orig = false;
        free(parity(&c));
    }
    /* Bitwise determinism: the same configuration twice. */
    for (int model = 0; model < M_COUNT; model++) {
        cfg_t c = {(model_kind_t)model, FSDP_FULL_SHARD, FSDP_BACKWARD_PRE, true, true, 3, 3,
                   false};
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
    return tap_done();
}
