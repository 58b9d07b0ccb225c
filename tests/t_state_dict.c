/* SPDX-License-Identifier: MIT */
/*
 * t_state_dict.c: FSDP's state dicts (spec F26; the checkpoint issue's "three types of FSDP1")
 * on TransformerWithSharedParams (tied embedding and output weights, an f32 and an i64 buffer,
 * five units under RECURSIVE wrapping), on the sim backend:
 *   - FULL: rank0_only gives the other ranks nothing; the entries are the module's state dict
 *     names; a zeroed model loaded from it gets every shard back, bitwise;
 *   - SHARDED: every rank's pieces, saved at world size 2 with FULL_SHARD, SHARD_GRAD_OP and
 *     NO_SHARD, with and without use_orig_params, load at world sizes 1, 2, 3 and 4, under
 *     RECURSIVE wrapping or the root alone, and each loaded model's FULL state dict is bitwise
 *     the saved model's (the consolidated form);
 *   - LOCAL: each rank's flat shards round-trip bitwise at the same world size and wrapping;
 *     at another world size the load is FSDP_EINVAL saying a LOCAL state dict loads only where
 *     it was written;
 *   - the optimizer's SHARDED state dict (keyed by parameter name): AdamW's state after two
 *     steps at world size 2 loads at world sizes 1, 3 and 4 into an optimizer over the other
 *     use_orig_params setting (flat or original parameters) and, at 1 and 4, the other
 *     wrapping, and the reloaded state's pieces consolidate to the saved ones bitwise;
 *   - bad pieces: an unknown name, a missing parameter, pieces that overlap, a gap in a rank's
 *     range, a piece past the tensor's end and another global shape are each FSDP_EINVAL
 *     naming the tensor, and the model is bitwise unchanged after each.
 * The saved pieces outlive the sim run that made them as host copies (a checkpoint's role).
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

/* ---- host copies of pieces and full state dicts (fu_store_t, fsdp_util.h) ------------------ */

/* Whether st holds an entry named `name` already. */
static bool stored(const fu_store_t *st, const char *name) {
    for (size_t i = 0; i < st->n; i++)
        if (strcmp(st->e[i].name, name) == 0) return true;
    return false;
}

/* ---- the jobs -------------------------------------------------------------------------------- */

typedef struct sd_job {
    fu_job_t j;         /* first */
    bool recursive;     /* RECURSIVE wrapping (5 units), else the root alone */
    int mode;           /* what the rank function does: below */
    fu_store_t *pieces; /* SHARDED or LOCAL pieces: appended (save) or read (load) */
    fu_store_t *full;   /* the consolidated FULL state dict: written by rank 0 (save) or compared */
    pthread_mutex_t *mu;
} sd_job_t;

enum {
    SAVE_SHARDED,
    LOAD_SHARDED,
    SAVE_LOCAL,
    LOAD_LOCAL,
    FULL_ROUND_TRIP,
    BAD_PIECES,
    SAVE_OPT,
    LOAD_OPT
};

/* The model, wrapped as the job says, after one SGD step on the usual input (so the shards hold
 * trained values, not the initialisation every run starts from). */
static int setup(fu_res_t *r, fsdp_ctx_t *ctx, const sd_job_t *sj, bool train, fsdp_module_t **m,
                 fsdp_unit_t **root, fsdp_optim_t **adamw) {
    int rc;
    fsdp_options_t o;
    fu_job_options(&sj->j, &o);
    o.check_exec_order = false;
    fsdp_optim_t *opt = NULL;
    fsdp_named_list_t params = {0};
    fsdp_tensor_t *out = NULL, *tgt = NULL, *loss = NULL;
    FU_TRY(done, "setting up", tm_transformer_create(ctx, false, true, m));
    if (sj->recursive)
        FU_TRY(done, "wrapping", fu_wrap_transformer_opts(*m, &o, root));
    else
        FU_TRY(done, "wrapping", fsdp_wrap(*m, &o, root));
    if (adamw) {
        /* AdamW over what FSDP hands an optimizer, two steps when training */
        FU_TRY(done, "optimizer", fsdp_named_params(*root, &params));
        FU_TRY(done, "optimizer", fsdp_optim_adam_create(ctx, NULL, true, adamw));
        FU_TRY(done, "optimizer",
               fsdp_optim_add_group(*adamw, params.n, params.tensors,
                                    (const char *const *)params.names, NULL, NULL));
    }
    if (!train) goto done;
    if (!adamw) {
        FU_TRY(done, "training", fsdp_named_params(*root, &params));
        FU_TRY(done, "training", fu_make_sgd(ctx, &params, 0.1, 0.0, &opt));
    }
    for (int step = 0; step < (adamw ? 2 : 1); step++) {
        FU_TRY(done, "training", fu_transformer_forward(ctx, *m, &out, &tgt));
        FU_TRY(done, "training", tm_transformer_loss(tgt, out, &loss));
        FU_TRY(done, "training", fsdp_backward(loss, NULL));
        FU_TRY(done, "training", fsdp_optim_step(adamw ? *adamw : opt));
        fsdp_tensor_release(out);
        fsdp_tensor_release(tgt);
        fsdp_tensor_release(loss);
        out = tgt = loss = NULL;
        fsdp_tape_clear(ctx);
    }
done:
    fsdp_tensor_release(out);
    fsdp_tensor_release(tgt);
    fsdp_tensor_release(loss);
    fsdp_tape_clear(ctx);
    fsdp_named_list_free(&params);
    fsdp_optim_destroy(opt);
    return rc;
}

/* Whether root's FULL state dict is bitwise the stored one (rank 0's); collective. */
static int full_matches(fsdp_ctx_t *ctx, fsdp_unit_t *root, const fu_store_t *full, bool *same,
                        char *why, size_t len) {
    fsdp_named_list_t sd = {0};
    int rc = fsdp_full_state_dict(root, NULL, &sd);
    *same = rc == 0 && sd.n == full->n;
    if (rc == 0 && !*same) snprintf(why, len, "%zu entries, saved %zu", sd.n, full->n);
    for (size_t i = 0; *same && i < sd.n; i++) {
        const fu_piece_t *s = &full->e[i];
        size_t bytes = (size_t)s->numel * fsdp_dtype_size(s->dt);
        void *h = malloc(bytes ? bytes : 1);
        *same = h && strcmp(sd.names[i], s->name) == 0 &&
                fsdp_tensor_dtype(sd.tensors[i]) == s->dt &&
                fsdp_tensor_numel(sd.tensors[i]) == s->numel &&
                fsdp_tensor_to_host(sd.tensors[i], h, bytes) == 0 && memcmp(h, s->data, bytes) == 0;
        if (!*same) snprintf(why, len, "'%s' differs from the saved model's", sd.names[i]);
        free(h);
    }
    (void)ctx;
    fsdp_named_list_free(&sd);
    return rc;
}

/* A snapshot of this rank's shards (to check that a failed load changed nothing). */
static int snapshot(fsdp_unit_t *root, fu_store_t *st) {
    fsdp_shard_list_t l = {0};
    int rc = fsdp_local_state_dict(root, &l);
    for (size_t i = 0; i < l.n && rc == 0; i++)
        rc = fu_store_add(st, l.e[i].name, l.e[i].t, l.e[i].ndim, l.e[i].shape, l.e[i].offset,
                          l.e[i].replicated);
    fsdp_shard_list_free(&l);
    return rc;
}

static bool same_store(const fu_store_t *a, const fu_store_t *b) {
    if (a->n != b->n) return false;
    for (size_t i = 0; i < a->n; i++)
        if (a->e[i].numel != b->e[i].numel || a->e[i].dt != b->e[i].dt ||
            memcmp(a->e[i].data, b->e[i].data, (size_t)a->e[i].numel * fsdp_dtype_size(a->e[i].dt)))
            return false;
    return true;
}

/* One bad load: rc must be FSDP_EINVAL naming `what`, and the shards unchanged. */
static void bad_load(fu_res_t *r, fsdp_ctx_t *ctx, fsdp_unit_t *root, fsdp_shard_list_t *l,
                     const char *what, const char *name) {
    fu_store_t before = {0}, after = {0};
    snapshot(root, &before);
    int rc = fsdp_load_sharded_state_dict(root, l);
    snapshot(root, &after);
    fu_ck_einval(r, ctx, rc, what, NULL, name);
    fu_ck(r, same_store(&before, &after), name, "the shards changed");
    fu_store_free(&before);
    fu_store_free(&after);
}

static int sd_rank(fsdp_ctx_t *ctx, void *arg) {
    sd_job_t *sj = arg;
    fu_job_t *j = &sj->j;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_shard_list_t l = {0};
    fsdp_named_list_t full = {0};
    char why[400] = "";
    int rank = fsdp_ctx_rank(ctx);
    bool save = sj->mode == SAVE_SHARDED || sj->mode == SAVE_LOCAL || sj->mode == FULL_ROUND_TRIP ||
                sj->mode == BAD_PIECES || sj->mode == SAVE_OPT;
    bool with_opt = sj->mode == SAVE_OPT || sj->mode == LOAD_OPT;
    fsdp_optim_t *adamw = NULL;
    int rc = setup(r, ctx, sj, save, &m, &root, with_opt ? &adamw : NULL);
    if (rc < 0) goto done;
    if (save) {
        /* the consolidated form, from rank 0 */
        fsdp_full_state_dict_options_t fo;
        fsdp_full_state_dict_options_init(&fo);
        fo.rank0_only = true;
        FU_TRY(done, "FULL state dict", fsdp_full_state_dict(root, &fo, &full));
        fu_ck(r, (rank == 0) == (full.n > 0), "FULL, rank0_only: only rank 0 gets the entries",
              "%zu entries on rank %d", full.n, rank);
        if (rank == 0 && sj->full) {
            pthread_mutex_lock(sj->mu);
            for (size_t i = 0; i < full.n && rc == 0; i++)
                rc = fu_store_add(sj->full, full.names[i], full.tensors[i],
                                  fsdp_tensor_ndim(full.tensors[i]),
                                  fsdp_tensor_shape(full.tensors[i]), 0, true);
            pthread_mutex_unlock(sj->mu);
            FU_TRY(done, "storing", rc);
        }
        /* the other ranks read what rank 0 stored only after it has */
        FU_TRY(done, "barrier", fsdp_pg_barrier(fsdp_ctx_pg(ctx), NULL));
    }
    switch (sj->mode) {
    case SAVE_OPT:
    case LOAD_OPT: {
        /* load (LOAD_OPT), then every rank's pieces of the optimizer state into the store:
         * the saved ones (SAVE_OPT: pieces) or the reloaded ones (LOAD_OPT: full) */
        if (sj->mode == LOAD_OPT) {
            FU_TRY(done, "state dict", fu_store_to_list(ctx, sj->pieces, &l));
            FU_TRY(done, "loading", fsdp_load_sharded_optim_state_dict(root, adamw, &l));
            fsdp_shard_list_free(&l);
        }
        fu_store_t *dst = sj->mode == SAVE_OPT ? sj->pieces : sj->full;
        FU_TRY(done, "optimizer state dict", fsdp_sharded_optim_state_dict(root, adamw, &l));
        pthread_mutex_lock(sj->mu);
        for (size_t i = 0; i < l.n && rc == 0; i++)
            /* a replicated entry once, from whichever rank has it (a parameter a rank holds
             * nothing of has no optimizer state there) */
            if (!l.e[i].replicated || !stored(dst, l.e[i].name))
                rc = fu_store_add(dst, l.e[i].name, l.e[i].t, l.e[i].ndim, l.e[i].shape,
                                  l.e[i].offset, l.e[i].replicated);
        pthread_mutex_unlock(sj->mu);
        FU_TRY(done, "storing", rc);
        break;
    }
    case SAVE_SHARDED:
    case SAVE_LOCAL:
        FU_TRY(done, "state dict",
               sj->mode == SAVE_SHARDED ? fsdp_sharded_state_dict(root, &l)
                                        : fsdp_local_state_dict(root, &l));
        pthread_mutex_lock(sj->mu);
        for (size_t i = 0; i < l.n && rc == 0; i++)
            /* replicated entries once (rank 0's) */
            if (!l.e[i].replicated || rank == 0)
                rc = fu_store_add(sj->pieces, l.e[i].name, l.e[i].t, l.e[i].ndim, l.e[i].shape,
                                  l.e[i].offset, l.e[i].replicated);
        pthread_mutex_unlock(sj->mu);
        FU_TRY(done, "storing", rc);
        break;
    case LOAD_SHARDED: {
        bool same = false;
        FU_TRY(done, "state dict", fu_store_to_list(ctx, sj->pieces, &l));
        FU_TRY(done, "loading", fsdp_load_sharded_state_dict(root, &l));
        FU_TRY(done, "FULL state dict", full_matches(ctx, root, sj->full, &same, why, sizeof why));
        fu_ck(r, same, "SHARDED: the loaded model's FULL state dict is bitwise the saved model's",
              "%s", why);
        break;
    }
    case LOAD_LOCAL: {
        FU_TRY(done, "state dict", fu_store_to_list(ctx, sj->pieces, &l));
        rc = fsdp_load_local_state_dict(root, &l);
        fu_ck_einval(r, ctx, rc, "LOCAL state dict loads only", NULL,
                     "LOCAL: a load at another world size is FSDP_EINVAL saying why");
        rc = FSDP_OK;
        break;
    }
    case FULL_ROUND_TRIP: {
        /* FULL: every rank's copy loads back into a zeroed model; LOCAL round trip too */
        bool same = false;
        fsdp_named_list_t every = {0};
        fu_store_t loc = {0}, loc2 = {0};
        FU_TRY(done, "FULL state dict", fsdp_full_state_dict(root, NULL, &every));
        rc = snapshot(root, &loc);
        if (rc == 0) rc = fsdp_local_state_dict(root, &l);
        fsdp_summon_options_t so;
        fsdp_summon_options_init(&so);
        if (rc == 0) rc = fsdp_summon_begin(root, &so);
        fsdp_named_list_t ps = {0};
        if (rc == 0) rc = fsdp_module_named_params(m, false, &ps);
        for (size_t i = 0; i < ps.n && rc == 0; i++)
            rc = fsdp_tensor_zero_(ps.tensors[i]);
        fsdp_named_list_free(&ps);
        if (rc == 0) rc = fsdp_summon_end(root);
        if (rc == 0) rc = fsdp_load_full_state_dict(root, &every, true);
        fsdp_named_list_free(&every);
        if (rc == 0) {
            fu_store_t *saved_full = sj->full;
            rc = full_matches(ctx, root, saved_full, &same, why, sizeof why);
        }
        fu_ck(r, rc == 0 && same,
              "FULL: a zeroed model loaded from the FULL state dict is bitwise the saved one",
              "%s %s", fsdp_err_name(rc), why);
        /* LOCAL: zero the shards, load, compare */
        if (rc == 0) rc = fsdp_summon_begin(root, &so);
        if (rc == 0) rc = fsdp_module_named_params(m, false, &ps);
        for (size_t i = 0; i < ps.n && rc == 0; i++)
            rc = fsdp_tensor_zero_(ps.tensors[i]);
        fsdp_named_list_free(&ps);
        if (rc == 0) rc = fsdp_summon_end(root);
        if (rc == 0) rc = fsdp_load_local_state_dict(root, &l);
        if (rc == 0) rc = snapshot(root, &loc2);
        fu_ck(r, rc == 0 && same_store(&loc, &loc2),
              "LOCAL: the flat shards round-trip bitwise at the same world size", "%s: %s",
              fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
        fu_store_free(&loc);
        fu_store_free(&loc2);
        break;
    }
    case BAD_PIECES: {
        FU_TRY(done, "state dict", fsdp_sharded_state_dict(root, &l));
        /* find a sharded entry of this rank with at least 2 elements */
        size_t k = l.n;
        for (size_t i = 0; i < l.n && k == l.n; i++)
            if (!l.e[i].replicated && fsdp_tensor_numel(l.e[i].t) >= 2) k = i;
        if (k == l.n) {
            fu_ck(r, false, "a sharded entry to corrupt", "none");
            break;
        }
        fsdp_shard_entry_t keep = l.e[k];
        char *name0 = l.e[k].name;
        static char unknown[] = "no.such.parameter";
        l.e[k].name = unknown;
        bad_load(r, ctx, root, &l, "no.such.parameter", "an unknown name is FSDP_EINVAL naming it");
        l.e[k].name = name0;
        l.n--; /* the last entry is replicated (a buffer): drop it */
        fsdp_shard_entry_t last = l.e[l.n];
        bad_load(r, ctx, root, &l, last.name, "a missing buffer is FSDP_EINVAL naming it");
        l.n++;
        fsdp_tensor_t *shorter = NULL;
        if (fsdp_slice(keep.t, 0, fsdp_tensor_numel(keep.t) - 1, &shorter) == 0) {
            l.e[k].t = shorter;
            bad_load(r, ctx, root, &l, "no piece", "a gap in this rank's range is FSDP_EINVAL");
            l.e[k].t = keep.t;
            fsdp_tensor_release(shorter);
        }
        l.e[k].offset = keep.offset + l.e[k].shape[0] * 1000000;
        bad_load(r, ctx, root, &l, "past", "a piece past the tensor's end is FSDP_EINVAL");
        l.e[k].offset = keep.offset;
        l.e[k].shape[0] = keep.shape[0] + 1;
        bad_load(r, ctx, root, &l, "global shape", "another global shape is FSDP_EINVAL");
        l.e[k].shape[0] = keep.shape[0];
        /* a second piece over part of it overlaps (the same piece twice would be a replica) */
        fsdp_shard_list_t two = {.n = l.n + 1, .e = calloc(l.n + 1, sizeof *two.e)};
        fsdp_tensor_t *tail = NULL;
        if (two.e && fsdp_slice(keep.t, 1, fsdp_tensor_numel(keep.t), &tail) == 0) {
            memcpy(two.e, l.e, l.n * sizeof *two.e);
            two.e[l.n] = l.e[k];
            two.e[l.n].t = tail;
            two.e[l.n].offset = keep.offset + 1;
            bad_load(r, ctx, root, &two, "overlap", "overlapping pieces are FSDP_EINVAL");
        }
        fsdp_tensor_release(tail);
        free(two.e);
        /* the same piece twice (a replica) is taken once */
        two = (fsdp_shard_list_t){.n = l.n + 1, .e = calloc(l.n + 1, sizeof *two.e)};
        if (two.e) {
            memcpy(two.e, l.e, l.n * sizeof *two.e);
            two.e[l.n] = l.e[k];
            rc = fsdp_load_sharded_state_dict(root, &two);
            fu_ck(r, rc == 0, "the same piece given twice (a replica's) is taken once", "%s: %s",
                  fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
            free(two.e);
        }
        rc = fsdp_load_sharded_state_dict(root, &l);
        fu_ck(r, rc == 0, "the uncorrupted pieces load", "%s: %s", fsdp_err_name(rc),
              fsdp_ctx_last_error(ctx));
        break;
    }
    }
done:
    fsdp_shard_list_free(&l);
    fsdp_named_list_free(&full);
    fu_teardown(ctx, m, root, NULL, adamw);
    return rc;
}

/* Whether the pieces of a and b consolidate to the same global tensors, bitwise (every global
 * tensor covered exactly by each); else the first difference in why. */
static bool same_consolidated(const fu_store_t *a, const fu_store_t *b, char *why, size_t len) {
    const fu_store_t *st[2] = {a, b};
    for (int side = 0; side < 2; side++)
        for (size_t i = 0; i < st[side]->n; i++) {
            const fu_piece_t *s = &st[side]->e[i];
            int64_t total = 1;
            for (int d = 0; d < s->ndim; d++)
                total *= s->shape[d];
            size_t es = fsdp_dtype_size(s->dt);
            unsigned char *g[2] = {calloc((size_t)total + 1, es), calloc((size_t)total + 1, es)};
            int64_t covered[2] = {0, 0};
            bool ok = g[0] && g[1];
            for (int k = 0; k < 2 && ok; k++)
                for (size_t j = 0; j < st[k]->n; j++) {
                    const fu_piece_t *x = &st[k]->e[j];
                    if (strcmp(x->name, s->name) != 0) continue;
                    if (x->dt != s->dt || x->offset + x->numel > total) {
                        ok = false;
                    } else {
                        memcpy(g[k] + (size_t)x->offset * es, x->data, (size_t)x->numel * es);
                        covered[k] += x->numel;
                    }
                }
            ok = ok && covered[0] == total && covered[1] == total &&
                 memcmp(g[0], g[1], (size_t)total * es) == 0;
            if (!ok)
                snprintf(why, len, "'%s': %lld and %lld of %lld elements, or the values differ",
                         s->name, (long long)covered[0], (long long)covered[1], (long long)total);
            free(g[0]);
            free(g[1]);
            if (!ok) return false;
        }
    return true;
}

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static void run(int mode, const char *what, int world, fsdp_sharding_strategy_t s, bool orig,
                bool recursive, fu_store_t *pieces, fu_store_t *full) {
    sd_job_t *sj = calloc(1, sizeof *sj);
    if (!sj) tap_bail("out of memory");
    char prefix[160];
    snprintf(prefix, sizeof prefix, "%s %s, use_orig_params %s, %s", what,
             fsdp_sharding_strategy_name(s), orig ? "on" : "off",
             recursive ? "RECURSIVE" : "root only");
    fu_job_init(&sj->j, prefix, world, s, orig);
    sj->recursive = recursive;
    sj->mode = mode;
    sj->pieces = pieces;
    sj->full = full;
    sj->mu = &mu;
    fu_run_job(&sj->j, sd_rank);
    free(sj);
}

int main(void) {
    tap_plan_lazy();
    for (int si = 0; si < 3; si++)
        for (int orig = 0; orig < 2; orig++) {
            fsdp_sharding_strategy_t s = fu_strategies[si];
            fu_store_t pieces = {0}, full = {0};
            run(SAVE_SHARDED, "SHARDED save at world 2:", 2, s, orig, true, &pieces, &full);
            for (int w = 1; w <= 4; w++)
                for (int rec = 0; rec < 2; rec++) {
                    char what[96];
                    snprintf(what, sizeof what, "SHARDED from world 2 loaded at world %d:", w);
                    run(LOAD_SHARDED, what, w, s, orig, rec, &pieces, &full);
                }
            fu_store_free(&pieces);
            fu_store_free(&full);
        }
    {
        fu_store_t pieces = {0}, full = {0};
        run(SAVE_LOCAL, "LOCAL save at world 2:", 2, FSDP_FULL_SHARD, true, true, &pieces, &full);
        run(LOAD_LOCAL, "LOCAL from world 2 at world 4:", 4, FSDP_FULL_SHARD, true, true, &pieces,
            &full);
        fu_store_free(&pieces);
        fu_store_free(&full);
    }
    for (int w = 1; w <= 2; w++)
        for (int si = 0; si < 3; si++) {
            fu_store_t full = {0};
            run(FULL_ROUND_TRIP, "FULL and LOCAL round trips:", w, fu_strategies[si], true, true,
                NULL, &full);
            fu_store_free(&full);
        }
    run(BAD_PIECES, "bad pieces:", 2, FSDP_FULL_SHARD, false, true, NULL, NULL);
    /* the optimizer: AdamW's state after two steps at world 2, loaded at 1, 3 and 4 under the
     * other use_orig_params setting (and, at 1 and 4, the other wrapping), consolidates to the
     * saved state bitwise */
    for (int si = 0; si < 3; si++)
        for (int orig = 0; orig < 2; orig++) {
            fsdp_sharding_strategy_t s = fu_strategies[si];
            fu_store_t saved = {0};
            run(SAVE_OPT, "optimizer SHARDED save at world 2:", 2, s, orig, true, &saved, NULL);
            for (int w = 1; w <= 4; w += w == 1 ? 2 : 1) {
                fu_store_t again = {0};
                char what[96], why[300] = "";
                snprintf(what, sizeof what,
                         "optimizer SHARDED from world 2 loaded at world %d:", w);
                run(LOAD_OPT, what, w, s, !orig, w == 3, &saved, &again);
                tap_ok(saved.n > 0 && same_consolidated(&saved, &again, why, sizeof why),
                       "optimizer SHARDED %s, use_orig_params %s at world 2 -> %s at world %d: "
                       "the AdamW state (moments, steps, groups) consolidates to the saved one "
                       "bitwise%s%s",
                       fsdp_sharding_strategy_name(s), orig ? "on" : "off", !orig ? "on" : "off", w,
                       why[0] ? ": " : "", why);
                fu_store_free(&again);
            }
            fu_store_free(&saved);
        }
    return tap_done();
}
