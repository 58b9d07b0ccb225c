/* SPDX-License-Identifier: MIT */
/*
 * t_sd_type.c: the state-dict type set per model (the checkpoint issue's "Each type is set per
 * model and can be got and loaded"; PyTorch's FSDP.set_state_dict_type), on
 * TransformerWithSharedParams (RECURSIVE wrapping, AdamW after two steps) at world size 2 under
 * FULL_SHARD and SHARD_GRAD_OP, on the sim backend:
 *   - a new root's type is FULL; set to SHARDED or LOCAL, fsdp_unit_state_dict gives exactly
 *     fsdp_sharded_state_dict's or fsdp_local_state_dict's entries (names, geometry, bits), and
 *     the optimizer's, fsdp_sharded_optim_state_dict's;
 *   - FULL gives fsdp_full_state_dict's and fsdp_full_optim_state_dict's entries, each a whole
 *     tensor as a replicated piece at offset 0; with rank0_only set, rank 1 gets none;
 *   - for each type, a second model (other weights, an AdamW that never stepped) loads the
 *     first's model and optimizer state dicts through fsdp_unit_load_state_dict and
 *     fsdp_unit_load_optim_state_dict (the model: this rank's own entries; the sharded
 *     optimizer state: every rank's pieces, as a checkpoint holds them), and one more training
 *     step of both gives bitwise the same FULL state dict;
 *   - errors: an unknown type, a child unit, and a FULL load given a piece are FSDP_EINVAL
 *     naming what is wrong.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "models/models.h"
#include "tap.h"

/* every rank's optimizer pieces, pooled for the sharded loads */
static fu_store_t pool;
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;

static const fsdp_state_dict_type_t types[3] = {FSDP_STATE_DICT_FULL, FSDP_STATE_DICT_SHARDED,
                                                FSDP_STATE_DICT_LOCAL};
static const char *const type_names[3] = {"FULL", "SHARDED", "LOCAL"};

/* Whether two piece lists are equal: names, geometry and bits. */
static bool same_lists(const fsdp_shard_list_t *a, const fsdp_shard_list_t *b, char *why,
                       size_t cap) {
    if (a->n != b->n) {
        snprintf(why, cap, "%zu entries against %zu", a->n, b->n);
        return false;
    }
    for (size_t i = 0; i < a->n; i++) {
        const fsdp_shard_entry_t *x = &a->e[i], *y = &b->e[i];
        if (strcmp(x->name, y->name) != 0 || x->ndim != y->ndim || x->offset != y->offset ||
            x->replicated != y->replicated ||
            memcmp(x->shape, y->shape, sizeof(int64_t) * (size_t)x->ndim) != 0 ||
            fu_same_bits(x->t, y->t) != 1) {
            snprintf(why, cap, "entry %zu ('%s' against '%s') differs", i, x->name, y->name);
            return false;
        }
    }
    return true;
}

/* A named list of whole tensors against a list of pieces that must hold them whole. */
static bool same_whole(const fsdp_named_list_t *a, const fsdp_shard_list_t *b, char *why,
                       size_t cap) {
    if (a->n != b->n) {
        snprintf(why, cap, "%zu entries against %zu", a->n, b->n);
        return false;
    }
    for (size_t i = 0; i < a->n; i++) {
        const fsdp_shard_entry_t *y = &b->e[i];
        if (strcmp(a->names[i], y->name) != 0 || !y->replicated || y->offset != 0 ||
            y->ndim != fsdp_tensor_ndim(a->tensors[i]) || fu_same_bits(a->tensors[i], y->t) != 1) {
            snprintf(why, cap, "'%s' is not the whole tensor '%s'", y->name, a->names[i]);
            return false;
        }
    }
    return true;
}

/* The model (weights from `seed`), wrapped, its AdamW, and `steps` training steps. */
static int build(fu_res_t *r, fsdp_ctx_t *ctx, const fu_job_t *j, uint64_t seed, int steps,
                 fsdp_module_t **m, fsdp_unit_t **root, fsdp_optim_t **opt) {
    fsdp_options_t o;
    fsdp_named_list_t params = {0};
    int rc;
    fu_job_options(j, &o);
    o.check_exec_order = false;
    tm_manual_seed(ctx, seed);
    FU_TRY(done, "model", tm_transformer_create(ctx, false, true, m));
    FU_TRY(done, "wrapping", fu_wrap_transformer_opts(*m, &o, root));
    FU_TRY(done, "AdamW", fsdp_named_params(*root, &params));
    FU_TRY(done, "AdamW", fsdp_optim_adam_create(ctx, NULL, true, opt));
    FU_TRY(done, "AdamW",
           fsdp_optim_add_group(*opt, params.n, params.tensors, (const char *const *)params.names,
                                NULL, NULL));
    for (int s = 0; s < steps; s++)
        FU_TRY(done, "training", fu_transformer_step(ctx, *m, *opt));
done:
    fsdp_named_list_free(&params);
    return rc;
}

static int type_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL, *m2 = NULL;
    fsdp_unit_t *root = NULL, *root2 = NULL, **units = NULL;
    fsdp_optim_t *opt = NULL, *opt2 = NULL;
    fsdp_shard_list_t got = {0}, want = {0}, osd = {0}, owant = {0};
    fsdp_named_list_t full = {0}, ofull = {0}, a = {0}, b = {0};
    size_t nu = 0;
    char why[300] = "";
    int rc, rank = fsdp_ctx_rank(ctx);
    if ((rc = build(r, ctx, j, 1, 2, &m, &root, &opt)) < 0) goto done;
    fu_ck(r, fsdp_get_state_dict_type(root) == FSDP_STATE_DICT_FULL, "a new root's type is FULL",
          "type %d", (int)fsdp_get_state_dict_type(root));
    for (int k = 0; k < 3; k++) {
        char name[120];
        FU_TRY(done, "setting the type", fsdp_set_state_dict_type(root, types[k], NULL));
        FU_TRY(done, "state dict", fsdp_unit_state_dict(root, &got));
        FU_TRY(done, "optimizer state dict", fsdp_unit_optim_state_dict(root, opt, &osd));
        bool same = false, osame = false;
        if (types[k] == FSDP_STATE_DICT_FULL) {
            FU_TRY(done, "FULL", fsdp_full_state_dict(root, NULL, &full));
            FU_TRY(done, "FULL", fsdp_full_optim_state_dict(root, opt, NULL, &ofull));
            same = same_whole(&full, &got, why, sizeof why);
            osame = same && same_whole(&ofull, &osd, why, sizeof why);
        } else {
            FU_TRY(done, "state dict",
                   types[k] == FSDP_STATE_DICT_SHARDED ? fsdp_sharded_state_dict(root, &want)
                                                       : fsdp_local_state_dict(root, &want));
            FU_TRY(done, "optimizer state dict", fsdp_sharded_optim_state_dict(root, opt, &owant));
            same = same_lists(&want, &got, why, sizeof why);
            osame = same && same_lists(&owant, &osd, why, sizeof why);
        }
        snprintf(name, sizeof name,
                 "%s: the model's and the optimizer's state dicts are the %s "
                 "functions' (bits, names, geometry)",
                 type_names[k], type_names[k]);
        fu_ck(r, same && osame, name, "%s", why);
        /* a second model, other weights, an AdamW that never stepped, loads both */
        FU_TRY(done, "second model", build(r, ctx, j, 99, 0, &m2, &root2, &opt2));
        FU_TRY(done, "setting the type", fsdp_set_state_dict_type(root2, types[k], NULL));
        if (types[k] == FSDP_STATE_DICT_FULL) {
            FU_TRY(done, "loading", fsdp_unit_load_optim_state_dict(root2, opt2, &osd));
        } else {
            /* the sharded optimizer load takes the pieces of every rank (as a checkpoint
             * holds them): with flat parameters it wants an entry for every parameter a flat
             * parameter covers, including those this rank holds nothing of */
            fsdp_shard_list_t all = {0};
            pthread_mutex_lock(&pool_mu);
            for (size_t i = 0; i < osd.n && rc == 0; i++)
                rc = fu_store_add(&pool, osd.e[i].name, osd.e[i].t, osd.e[i].ndim, osd.e[i].shape,
                                  osd.e[i].offset, osd.e[i].replicated);
            pthread_mutex_unlock(&pool_mu);
            FU_TRY(done, "pooling", rc);
            FU_TRY(done, "barrier", fsdp_pg_barrier(fsdp_ctx_pg(ctx), NULL));
            rc = fu_store_to_list(ctx, &pool, &all);
            if (rc == 0) rc = fsdp_unit_load_optim_state_dict(root2, opt2, &all);
            fsdp_shard_list_free(&all);
            FU_TRY(done, "loading", rc);
            FU_TRY(done, "barrier", fsdp_pg_barrier(fsdp_ctx_pg(ctx), NULL));
            if (rank == 0) fu_store_free(&pool);
            FU_TRY(done, "barrier", fsdp_pg_barrier(fsdp_ctx_pg(ctx), NULL));
        }
        FU_TRY(done, "loading", fsdp_unit_load_state_dict(root2, &got, true));
        FU_TRY(done, "one more step", fu_transformer_step(ctx, m, opt));
        FU_TRY(done, "one more step", fu_transformer_step(ctx, m2, opt2));
        FU_TRY(done, "FULL", fsdp_full_state_dict(root, NULL, &a));
        FU_TRY(done, "FULL", fsdp_full_state_dict(root2, NULL, &b));
        same = a.n == b.n && a.n > 0;
        for (size_t i = 0; same && i < a.n; i++)
            same = fu_same_bits(a.tensors[i], b.tensors[i]) == 1;
        snprintf(name, sizeof name,
                 "%s: a second model loads both, and a step after gives bitwise the first's",
                 type_names[k]);
        fu_ck(r, same, name, "the models differ after the step");
        fsdp_shard_list_free(&got);
        fsdp_shard_list_free(&want);
        fsdp_shard_list_free(&osd);
        fsdp_shard_list_free(&owant);
        fsdp_named_list_free(&full);
        fsdp_named_list_free(&ofull);
        fsdp_named_list_free(&a);
        fsdp_named_list_free(&b);
        fu_teardown(ctx, m2, root2, NULL, opt2);
        m2 = NULL, root2 = NULL, opt2 = NULL;
    }
    /* FULL with rank0_only */
    fsdp_full_state_dict_options_t fo;
    fsdp_full_state_dict_options_init(&fo);
    fo.rank0_only = true;
    FU_TRY(done, "setting the type", fsdp_set_state_dict_type(root, FSDP_STATE_DICT_FULL, &fo));
    FU_TRY(done, "state dict", fsdp_unit_state_dict(root, &got));
    fu_ck(r, (rank == 0) == (got.n > 0), "FULL with rank0_only: only rank 0 gets entries",
          "%zu entries on rank %d", got.n, rank);
    /* errors */
    rc = fsdp_set_state_dict_type(root, (fsdp_state_dict_type_t)7, NULL);
    fu_ck_einval(r, ctx, rc, "type 7", NULL, "an unknown type is FSDP_EINVAL naming it");
    FU_TRY(done, "units", fsdp_units(root, &units, &nu));
    rc = nu > 1 ? fsdp_set_state_dict_type(units[1], FSDP_STATE_DICT_SHARDED, NULL) : 0;
    fu_ck_einval(r, ctx, rc, "not a root unit", NULL, "a child unit is FSDP_EINVAL");
    FU_TRY(done, "setting the type", fsdp_set_state_dict_type(root, FSDP_STATE_DICT_FULL, NULL));
    FU_TRY(done, "state dict", fsdp_sharded_state_dict(root, &want));
    rc = fsdp_unit_load_state_dict(root, &want, true);
    fu_ck_einval(r, ctx, rc, "is a piece", NULL,
                 "a FULL load given pieces is FSDP_EINVAL naming the entry");
    rc = 0;
done:
    free(units);
    fsdp_shard_list_free(&got);
    fsdp_shard_list_free(&want);
    fsdp_shard_list_free(&osd);
    fsdp_shard_list_free(&owant);
    fsdp_named_list_free(&full);
    fsdp_named_list_free(&ofull);
    fsdp_named_list_free(&a);
    fsdp_named_list_free(&b);
    fu_teardown(ctx, m2, root2, NULL, opt2);
    fu_teardown(ctx, m, root, NULL, opt);
    return rc < 0 ? rc : 0;
}

int main(void) {
    tap_plan_lazy();
    fu_run("set_state_dict_type, FULL_SHARD", 2, FSDP_FULL_SHARD, false, type_rank);
    fu_run("set_state_dict_type, SHARD_GRAD_OP, use_orig_params", 2, FSDP_SHARD_GRAD_OP, true,
           type_rank);
    return tap_done();
}
