/* SPDX-License-Identifier: MIT */
/*
 * checkpoint.c: FSDP's checkpoints that reshard (fsdp_checkpoint_save, fsdp_checkpoint_load):
 * a model's SHARDED state dict and its optimizer's SHARDED state dict keyed by parameter name,
 * written as one checkpoint directory (fsdp/checkpoint.h) and read back by byte ranges at any
 * world size, wrapping or strategy.
 *
 * Names in the directory: "model.<fqn>" for the model's entries, "optim.<key>" for the
 * optimizer's ("optim.<fqn>.exp_avg", "optim.<fqn>.step", "optim.group.0.lr", ...), as PyTorch's
 * distributed checkpoint keeps a model and an optimizer in one store.
 *
 * Saving is collective over the context's world group: after each step that can fail on some
 * rank (preparing the staging directory, writing the rank files, the index), the ranks exchange
 * their status with one all-gather, so every rank returns the same verdict, and the others name
 * the rank that failed. The model's replicated entries are written by rank 0 only. The
 * optimizer's replicated entries (scalars: a parameter's step count and group, the groups'
 * hyper-parameters) are written by every rank that has them, because a rank holding nothing of
 * a parameter (use_orig_params at a large world size) has no state for it, so rank 0 may lack
 * a step count others have; the index keeps one copy. Pieces that replicas (HYBRID) hold twice
 * are written only by the first rank of the replicate group when every unit of the tree shares
 * that replication, and are otherwise indexed once.
 *
 * Loading is not collective: a rank takes its part of every parameter as this tree holds it now
 * (the template is its own SHARDED state dict as views of its shards, so the pieces are read
 * into the shards where they lie), and the optimizer entries of the parameters it holds part
 * of, at the same offsets. The optimizer is loaded first (optim_state.c checks everything
 * before it changes anything, and adopts the state it assembled without a copy); then the
 * model's pieces are checked against the checkpoint and read, and the sharded load of
 * state_dict.c finds the parameters in place and copies the replicated entries. An I/O error
 * while the model is read can leave it partly read.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp/fsdp_impl.h"
#include "tensor/tensor_impl.h"

#define MODEL_PREFIX "model."
#define OPTIM_PREFIX "optim."

/* Every rank learns whether every rank succeeded: a rank whose own step failed returns its error,
 * the others FSDP_EREMOTE naming the first rank that failed. */
static int agree(fsdp_ctx_t *ctx, int rc, const char *fn, const char *what) {
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    int w = pg ? fsdp_pg_size(pg) : 1;
    if (w <= 1) return rc;
    int32_t mine = rc < 0 ? rc : 0, *all = calloc((size_t)w, sizeof *all);
    if (!all) return fsdp__ctx_err(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
    int crc = fsdp_pg_all_gather(pg, &mine, all, 1, FSDP_DTYPE_I32, NULL);
    int bad = -1;
    for (int r = 0; crc == 0 && r < w && bad < 0; r++)
        if (all[r] < 0) bad = r;
    int32_t code = bad >= 0 ? all[bad] : 0;
    free(all);
    if (rc < 0) return rc;
    if (crc < 0)
        return fsdp__ctx_err(ctx, crc, "%s: exchanging the status after %s: %s", fn, what,
                             fsdp_pg_last_error(pg));
    if (bad >= 0)
        return fsdp__ctx_err(ctx, FSDP_EREMOTE,
                             "%s: rank %d failed %s (%s; its message is on that rank)", fn, bad,
                             what, fsdp_strerror(code));
    return FSDP_OK;
}

/* Prefixes every name of l with p. */
static int prefix_names(fsdp_shard_list_t *l, const char *p) {
    size_t pl = strlen(p);
    for (size_t i = 0; i < l->n; i++) {
        size_t nl = strlen(l->e[i].name);
        char *s = malloc(pl + nl + 1);
        if (!s) return FSDP_ENOMEM;
        memcpy(s, p, pl);
        memcpy(s + pl, l->e[i].name, nl + 1);
        free(l->e[i].name);
        l->e[i].name = s;
    }
    return FSDP_OK;
}

/* Whether this rank's non-replicated pieces duplicate another rank's: every unit of the tree has
 * a replicate group, the same one, where this rank is not the first. */
static bool replica_copy(fsdp_unit_t *root) {
    fsdp_unit_t **units = NULL;
    size_t n = 0, cap = 0;
    if (fsdp__collect_units(root, &units, &n, &cap) < 0) return false;
    bool dup = n > 0;
    for (size_t i = 0; dup && i < n; i++)
        dup = units[i]->replicate_pg && units[i]->replicate_pg == units[0]->replicate_pg &&
              fsdp_pg_rank(units[i]->replicate_pg) != 0;
    free(units);
    return dup;
}

/* Drops the entries this rank need not write (see the top of this file). */
static void drop_copies(fsdp_shard_list_t *l, int rank, bool replica) {
    size_t k = 0;
    for (size_t i = 0; i < l->n; i++) {
        fsdp_shard_entry_t *e = &l->e[i];
        bool optim = strncmp(e->name, OPTIM_PREFIX, sizeof OPTIM_PREFIX - 1) == 0;
        if ((e->replicated && rank != 0 && !optim) || (!e->replicated && replica)) {
            free(e->name);
            fsdp_tensor_release(e->t);
            continue;
        }
        l->e[k++] = *e;
    }
    l->n = k;
}

int fsdp_checkpoint_save(fsdp_unit_t *root, const fsdp_optim_t *opt, const char *dir,
                         const fsdp_safetensors_kv_t *meta, size_t nmeta) {
    static const char fn[] = "fsdp_checkpoint_save";
    int rc = fsdp__sd_check_root(root, fn);
    if (rc < 0) return rc;
    fsdp_ctx_t *ctx = root->ctx;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    int rank = pg ? fsdp_pg_rank(pg) : 0, world = pg ? fsdp_pg_size(pg) : 1;
    if (!dir || !dir[0] || (nmeta && !meta))
        rc = fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: %s", fn,
                           !dir || !dir[0] ? "dir is NULL or empty" : "nmeta > 0 but meta NULL");
    if (rc == 0 && rank == 0) rc = fsdp_ckpt_prepare(ctx, dir);
    if ((rc = agree(ctx, rc, fn, "preparing the staging directory")) < 0) return rc;

    fsdp_shard_list_t all = {0}, o = {0};
    /* views of the shards and of the optimizer's state: written before anything changes them */
    rc = fsdp__sharded_state_dict_views(root, &all);
    if (rc == 0) rc = prefix_names(&all, MODEL_PREFIX);
    if (rc == 0 && opt) {
        rc = fsdp__sharded_optim_state_dict(root, opt, false, &o);
        if (rc == 0) rc = prefix_names(&o, OPTIM_PREFIX);
        fsdp_shard_entry_t *g = rc == 0 ? realloc(all.e, (all.n + o.n + 1) * sizeof *g) : NULL;
        if (rc == 0 && !g) rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
        if (g) {
            all.e = g;
            memcpy(all.e + all.n, o.e, o.n * sizeof *o.e);
            all.n += o.n;
            free(o.e); /* the entries moved to all */
            o = (fsdp_shard_list_t){0};
        }
    }
    if (rc == 0) {
        drop_copies(&all, rank, replica_copy(root));
        rc = fsdp_ckpt_write_rank_meta(ctx, dir, rank, world, &all, meta, nmeta);
    }
    fsdp_shard_list_free(&o);
    fsdp_shard_list_free(&all);
    if ((rc = agree(ctx, rc, fn, "writing its file")) < 0) return rc;
    if (rank == 0) rc = fsdp_ckpt_finish(ctx, dir, world, meta, nmeta);
    return agree(ctx, rc, fn, "writing the index and publishing the directory");
}

/* The entry of the model template called fqn (its first len bytes), or NULL. */
static const fsdp_shard_entry_t *template_of(const fsdp_shard_list_t *tmpl, const char *fqn,
                                             size_t len) {
    for (size_t i = 0; i < tmpl->n; i++) {
        const char *nm = tmpl->e[i].name;
        if (strncmp(nm, fqn, len) == 0 && nm[len] == 0) return &tmpl->e[i];
    }
    return NULL;
}

/* This rank's optimizer entries: every replicated "optim." tensor whole, and of every other the
 * range this rank holds of the parameter it belongs to ("<fqn>.<state>"), as new host tensors. */
static int optim_want(fsdp_ctx_t *ctx, fsdp_ckpt_t *ck, const fsdp_shard_list_t *tmpl,
                      fsdp_shard_list_t *out, const char *fn) {
    size_t n = fsdp_ckpt_count(ck), cap = 0;
    int rc = FSDP_OK;
    for (size_t i = 0; rc == 0 && i < n; i++) {
        fsdp_ckpt_info_t in;
        fsdp_ckpt_info(ck, i, &in);
        if (strncmp(in.name, OPTIM_PREFIX, sizeof OPTIM_PREFIX - 1) != 0) continue;
        const char *key = in.name + sizeof OPTIM_PREFIX - 1, *dot = strrchr(key, '.');
        int64_t off = 0, cnt = in.numel;
        if (!in.replicated) {
            const fsdp_shard_entry_t *p = dot ? template_of(tmpl, key, (size_t)(dot - key)) : NULL;
            if (!p) {
                /* this rank holds nothing of that parameter (or it is not one of root's: the
                 * optimizer's load ignores it): an empty piece says the state exists, since the
                 * load wants an entry for every parameter a flat parameter covers */
                cnt = 0;
            } else if (p->ndim != in.ndim ||
                       memcmp(p->shape, in.shape, sizeof(int64_t) * (size_t)in.ndim) != 0) {
                char s1[200], s2[200];
                rc = fsdp__ctx_err(ctx, FSDP_EINVAL,
                                   "%s: optimizer state '%s' is %s in the checkpoint, but its "
                                   "parameter is %s here",
                                   fn, key, fsdp__shape_str(in.ndim, in.shape, s1, sizeof s1),
                                   fsdp__shape_str(p->ndim, p->shape, s2, sizeof s2));
                break;
            } else {
                off = p->offset;
                cnt = fsdp_tensor_numel(p->t);
            }
        }
        if (in.dtype == FSDP_DTYPE_COUNT) {
            rc = fsdp__ctx_err(ctx, FSDP_ENOTSUP, "%s: optimizer state '%s' is stored as %s", fn,
                               key, in.st_dtype);
            break;
        }
        if (out->n == cap) {
            cap = cap ? 2 * cap : 64;
            fsdp_shard_entry_t *g = realloc(out->e, cap * sizeof *g);
            if (!g) {
                rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
                break;
            }
            out->e = g;
        }
        fsdp_shard_entry_t *e = &out->e[out->n];
        *e = (fsdp_shard_entry_t){.ndim = in.ndim, .offset = off, .replicated = in.replicated};
        memcpy(e->shape, in.shape, sizeof e->shape);
        int64_t one = cnt;
        rc = in.replicated
                 ? fsdp_tensor_empty(ctx, in.dtype, in.ndim, in.shape, FSDP_MEM_OPTIM, &e->t)
                 : fsdp_tensor_empty(ctx, in.dtype, 1, &one, FSDP_MEM_OPTIM, &e->t);
        e->name = strdup(key);
        out->n++;
        if (rc == 0 && !e->name) rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
    }
    return rc;
}

int fsdp_checkpoint_load(fsdp_unit_t *root, fsdp_optim_t *opt, fsdp_ckpt_t *ck) {
    static const char fn[] = "fsdp_checkpoint_load";
    int rc = fsdp__sd_check_root(root, fn);
    if (rc < 0) return rc;
    fsdp_ctx_t *ctx = root->ctx;
    if (!ck) return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: the checkpoint handle is NULL", fn);
    fsdp_shard_list_t tmpl = {0}, o = {0};
    /* the template: views of this rank's shards (and copies of the replicated entries), so the
     * model's pieces are read where they lie and the load below finds them in place */
    FSDP_TRY(rc, out, fsdp__sharded_state_dict_views(root, &tmpl));
    if (opt) {
        /* the optimizer first: its load checks everything before it changes anything */
        FSDP_TRY(rc, out, optim_want(ctx, ck, &tmpl, &o, fn));
        if ((rc = fsdp_ckpt_read_pieces(ck, OPTIM_PREFIX, &o)) < 0) {
            rc = fsdp__ctx_err(ctx, rc, "%s: %s", fn, fsdp_ckpt_last_error(ck));
            goto out;
        }
        FSDP_TRY(rc, out, fsdp_load_sharded_optim_state_dict(root, opt, &o));
    }
    /* then the model: every piece is checked against the checkpoint before any is read */
    if ((rc = fsdp_ckpt_read_pieces(ck, MODEL_PREFIX, &tmpl)) < 0) {
        rc = fsdp__ctx_err(ctx, rc, "%s: %s", fn, fsdp_ckpt_last_error(ck));
        goto out;
    }
    rc = fsdp_load_sharded_state_dict(root, &tmpl);
out:
    fsdp_shard_list_free(&o);
    fsdp_shard_list_free(&tmpl);
    return rc;
}
