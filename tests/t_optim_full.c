/* SPDX-License-Identifier: MIT */
/*
 * t_optim_full.c: the optimizer's FULL state dict keyed by parameter name (the checkpoint
 * issue's "optimizer state dicts keyed by parameter name: full: gathered to rank 0, as
 * optim_state_dict returns it"; spec F26 covers the model's state dicts, no seed behaviour ID
 * names the optimizer's) and its load, on TransformerWithSharedParams (five units under
 * RECURSIVE wrapping, the batch norm an ignored module, so its parameters are ones no unit
 * manages) with AdamW over two parameter groups (the encoder's at another lr and weight decay),
 * on the sim backend:
 *   - after two steps at world sizes 1..4 under FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, and at 2
 *     and 4 under HYBRID_SHARD and HYBRID_SHARD_ZERO2 (shard groups of rank / 2, replicate
 *     groups of rank % 2), with and without use_orig_params, every rank's full dict is bitwise
 *     the consolidation of every rank's SHARDED pieces (exp_avg, exp_avg_sq, step, group and the
 *     hyper-parameters), also once every state holds -0.0 and NaN payloads;
 *   - rank0_only gives the other ranks an empty list and rank 0 the same entries; offload_to_cpu
 *     gives host tensors with the same bits;
 *   - at world 8 (a Linear stack, root only) ranks that hold no part of a parameter;
 *   - a dict saved at world 2 loads at world sizes 1, 3 and 4, into the other use_orig_params
 *     setting, another strategy and the root-only wrapping, and the reloaded optimizer's full
 *     dict is bitwise the saved one; reloaded into a fresh model at world 2 (with the model's
 *     FULL state dict), one more step gives bitwise the uninterrupted run's model;
 *   - a missing state, a state of another shape, a parameter put in an unknown group, an
 *     unknown group's hyper-parameter and an unknown parameter are FSDP_EINVAL naming the entry,
 *     and the optimizer's state is bitwise unchanged after each.
 * The saved dicts outlive the sim run that made them as host copies (a checkpoint's role).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "models/models.h"
#include "tap.h"

/* ---- host copies of entries ------------------------------------------------------------------ */

/* Appends host copies of a named list's whole tensors to st (under mu when given). */
static int store_list(fu_store_t *st, const fsdp_named_list_t *l, pthread_mutex_t *mu) {
    int rc = FSDP_OK;
    if (mu) pthread_mutex_lock(mu);
    for (size_t i = 0; i < l->n && rc == 0; i++)
        rc = fu_store_add(st, l->names[i], l->tensors[i], fsdp_tensor_ndim(l->tensors[i]),
                          fsdp_tensor_shape(l->tensors[i]), 0, true);
    if (mu) pthread_mutex_unlock(mu);
    return rc;
}

/* The stored whole tensors as a named list on ctx (owned). */
static int fu_store_to_named(fsdp_ctx_t *ctx, const fu_store_t *st, fsdp_named_list_t *out) {
    *out = (fsdp_named_list_t){.owned = true};
    out->names = calloc(st->n + 1, sizeof *out->names);
    out->tensors = calloc(st->n + 1, sizeof *out->tensors);
    if (!out->names || !out->tensors) return FSDP_ENOMEM;
    int rc = FSDP_OK;
    for (size_t i = 0; i < st->n && rc == 0; i++) {
        const fu_piece_t *e = &st->e[i];
        rc = fsdp_tensor_from_host(ctx, e->dt, e->ndim, e->shape, e->data, FSDP_MEM_OTHER,
                                   &out->tensors[i]);
        if (rc == 0) out->names[out->n++] = strdup(e->name);
    }
    return rc;
}

static int64_t numel_of(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= shape[d];
    return n;
}

/* The global tensor `name` assembled from st's pieces into *out (malloc'ed, its geometry in
 * *g): every element covered, pieces given twice (replicas) bitwise equal. */
static bool consolidate(const fu_store_t *st, const char *name, fu_piece_t *g, unsigned char **out,
                        char *why, size_t len) {
    const fu_piece_t *first = NULL;
    for (size_t i = 0; i < st->n && !first; i++)
        if (strcmp(st->e[i].name, name) == 0) first = &st->e[i];
    *out = NULL;
    if (!first) {
        snprintf(why, len, "'%s': no piece", name);
        return false;
    }
    *g = *first;
    g->offset = 0;
    g->numel = numel_of(first->ndim, first->shape);
    size_t es = fsdp_dtype_size(first->dt);
    unsigned char *buf = calloc((size_t)g->numel + 1, es), *seen = calloc((size_t)g->numel + 1, 1);
    bool ok = buf && seen;
    for (size_t i = 0; i < st->n && ok; i++) {
        const fu_piece_t *e = &st->e[i];
        if (strcmp(e->name, name) != 0) continue;
        if (e->dt != first->dt || e->offset + e->numel > g->numel) {
            snprintf(why, len, "'%s': a piece of another dtype or past the end", name);
            ok = false;
        }
        for (int64_t k = 0; k < e->numel && ok; k++) {
            unsigned char *dst = buf + (size_t)(e->offset + k) * es;
            const unsigned char *src = (const unsigned char *)e->data + (size_t)k * es;
            if (seen[e->offset + k] && memcmp(dst, src, es) != 0) {
                snprintf(why, len, "'%s': replicas differ at element %lld", name,
                         (long long)(e->offset + k));
                ok = false;
            }
            memcpy(dst, src, es);
            seen[e->offset + k] = 1;
        }
    }
    for (int64_t k = 0; k < g->numel && ok; k++)
        if (!seen[k]) {
            snprintf(why, len, "'%s': element %lld is in no piece", name, (long long)k);
            ok = false;
        }
    free(seen);
    if (ok)
        *out = buf;
    else
        free(buf);
    return ok;
}

/* Whether full (whole tensors) holds exactly the tensors st's pieces consolidate to, bitwise. */
static bool full_vs_pieces(const fu_store_t *full, const fu_store_t *st, char *why, size_t len) {
    size_t names = 0;
    for (size_t i = 0; i < st->n; i++) {
        bool again = false;
        for (size_t k = 0; k < i && !again; k++)
            again = strcmp(st->e[k].name, st->e[i].name) == 0;
        names += !again;
    }
    if (names != full->n) {
        snprintf(why, len, "%zu entries, the pieces have %zu names", full->n, names);
        return false;
    }
    for (size_t i = 0; i < full->n; i++) {
        const fu_piece_t *f = &full->e[i];
        fu_piece_t g;
        unsigned char *want = NULL;
        if (!consolidate(st, f->name, &g, &want, why, len)) return false;
        bool ok = f->dt == g.dt && f->ndim == g.ndim && f->numel == g.numel &&
                  memcmp(f->shape, g.shape, (size_t)f->ndim * sizeof *f->shape) == 0 &&
                  memcmp(f->data, want, (size_t)f->numel * fsdp_dtype_size(f->dt)) == 0;
        free(want);
        if (!ok) {
            snprintf(why, len, "'%s' differs (dtype, shape or bits)", f->name);
            return false;
        }
    }
    return true;
}

/* Whether a and b hold the same entries (by name, in any order), bitwise. */
static bool same_full(const fu_store_t *a, const fu_store_t *b, char *why, size_t len) {
    if (a->n != b->n) {
        snprintf(why, len, "%zu entries, want %zu", a->n, b->n);
        return false;
    }
    for (size_t i = 0; i < a->n; i++) {
        const fu_piece_t *x = &a->e[i], *y = NULL;
        for (size_t k = 0; k < b->n && !y; k++)
            if (strcmp(b->e[k].name, x->name) == 0) y = &b->e[k];
        if (!y || x->dt != y->dt || x->numel != y->numel || x->ndim != y->ndim ||
            memcmp(x->shape, y->shape, (size_t)x->ndim * sizeof *x->shape) != 0 ||
            memcmp(x->data, y->data, (size_t)x->numel * fsdp_dtype_size(x->dt)) != 0) {
            snprintf(why, len, "'%s' %s", x->name, y ? "differs" : "is not in the other");
            return false;
        }
    }
    return true;
}

/* Every rank's SHARDED pieces of opt's state into st (under mu); collective. poke: every f32
 * moment piece gets -0.0 and NaNs with payloads at elements chosen by their global index (so
 * replicas stay equal), and every rank loads all the pieces back into opt. */
static int store_pieces(fsdp_ctx_t *ctx, fsdp_unit_t *root, fsdp_optim_t *opt, bool poke,
                        fu_store_t *st, pthread_mutex_t *mu) {
    fsdp_shard_list_t l = {0};
    int rc = fsdp_sharded_optim_state_dict(root, opt, &l);
    for (size_t i = 0; i < l.n && rc == 0 && poke; i++) {
        fsdp_shard_entry_t *e = &l.e[i];
        int64_t n = fsdp_tensor_numel(e->t);
        if (!strstr(e->name, ".exp_avg") || fsdp_tensor_dtype(e->t) != FSDP_DTYPE_F32) continue;
        float *h = malloc((size_t)(n + 1) * sizeof *h);
        if (!h) return FSDP_ENOMEM;
        rc = fsdp_tensor_to_host(e->t, h, (size_t)n * sizeof *h);
        for (int64_t k = 0; k < n && rc == 0; k++) {
            int64_t gi = e->offset + k;
            uint32_t bits = gi % 3 == 0 ? 0x80000000u : 0x7fc00000u | (uint32_t)(gi & 0xffff);
            if (gi % 3 != 2) memcpy(&h[k], &bits, sizeof bits);
        }
        if (rc == 0) rc = fsdp_tensor_copy_from_host(e->t, h, (size_t)n * sizeof *h);
        free(h);
    }
    pthread_mutex_lock(mu);
    for (size_t i = 0; i < l.n && rc == 0; i++)
        rc = fu_store_add(st, l.e[i].name, l.e[i].t, l.e[i].ndim, l.e[i].shape, l.e[i].offset,
                          l.e[i].replicated);
    pthread_mutex_unlock(mu);
    fsdp_shard_list_free(&l);
    if (rc == 0) rc = fsdp_pg_barrier(fsdp_ctx_pg(ctx), NULL);
    if (rc == 0 && poke) rc = fu_store_to_list(ctx, st, &l);
    if (rc == 0 && poke) rc = fsdp_load_sharded_optim_state_dict(root, opt, &l);
    fsdp_shard_list_free(&l);
    return rc;
}

/* ---- the model and its training -------------------------------------------------------------- */

typedef struct of_job {
    fu_job_t j; /* first */
    int mode;   /* below */
    bool hybrid, recursive;
    fu_store_t *full;  /* GATHER: rank 0's dict after two steps (written); LOAD: the dict to load */
    fu_store_t *model; /* rank 0's FULL model state dict after two steps */
    fu_store_t *after3; /* rank 0's FULL model state dict after a third step */
    bool resume;        /* LOAD: one more step, compared with after3 */
    pthread_mutex_t *mu;
    fu_store_t pieces[2]; /* every rank's pieces: plain, then with special values */
} of_job_t;

enum { GATHER, LOAD, BAD };

typedef struct rig {
    fsdp_pg_t *shard, *rep;
    fsdp_module_t *m;
    fsdp_unit_t *root;
    fsdp_optim_t *opt;
} rig_t;

static int train(fsdp_ctx_t *ctx, rig_t *g, int steps) {
    int rc = FSDP_OK;
    for (int s = 0; s < steps && rc == 0; s++) {
        fsdp_tensor_t *out = NULL, *tgt = NULL, *loss = NULL;
        rc = fsdp_optim_zero_grad(g->opt, true);
        if (rc == 0) rc = fu_transformer_forward(ctx, g->m, &out, &tgt);
        if (rc == 0) rc = tm_transformer_loss(tgt, out, &loss);
        if (rc == 0) rc = fsdp_backward(loss, NULL);
        if (rc == 0) rc = fsdp_optim_step(g->opt);
        fsdp_tensor_release(out);
        fsdp_tensor_release(tgt);
        fsdp_tensor_release(loss);
        fsdp_tape_clear(ctx);
    }
    return rc;
}

/* The model wrapped as the job says (bn ignored), AdamW over two groups: the encoder layers' (lr
 * 5e-3, weight decay 0.1) and the rest (lr 1e-2, weight decay 1e-2). */
static int setup(fsdp_ctx_t *ctx, const of_job_t *oj, rig_t *g) {
    int rank = fsdp_ctx_rank(ctx), rc;
    fsdp_named_list_t params = {0};
    fsdp_tensor_t **ts = NULL;
    const char **names = NULL;
    if (oj->hybrid && ((rc = fsdp_pg_split(fsdp_ctx_pg(ctx), rank / 2, rank, &g->shard)) < 0 ||
                       (rc = fsdp_pg_split(fsdp_ctx_pg(ctx), rank % 2, rank, &g->rep)) < 0))
        return rc;
    if ((rc = tm_transformer_create(ctx, true, true, &g->m)) < 0) return rc;
    fsdp_options_t o;
    fu_job_options(&oj->j, &o);
    o.check_exec_order = false;
    fsdp_module_t *bn = fsdp_module_child(g->m, "bn");
    o.ignored_modules = &bn;
    o.num_ignored_modules = 1;
    if (oj->hybrid) {
        o.pg = g->shard;
        o.replicate_pg = g->rep;
    }
    rc = oj->recursive ? fu_wrap_transformer_opts(g->m, &o, &g->root)
                       : fsdp_wrap(g->m, &o, &g->root);
    if (rc == 0) rc = fsdp_named_params(g->root, &params);
    if (rc == 0) rc = fsdp_optim_adam_create(ctx, NULL, true, &g->opt);
    ts = calloc(params.n + 1, sizeof *ts);
    names = calloc(params.n + 1, sizeof *names);
    if (rc == 0 && (!ts || !names)) rc = FSDP_ENOMEM;
    for (int grp = 0; grp < 2 && rc == 0; grp++) {
        size_t n = 0;
        for (size_t i = 0; i < params.n; i++)
            if ((strstr(params.names[i], "encoder.layers") != NULL) == (grp == 1)) {
                ts[n] = params.tensors[i];
                names[n++] = params.names[i];
            }
        fsdp_adam_options_t a;
        fsdp_adamw_options_init(&a);
        a.lr = grp ? 5e-3 : 1e-2;
        a.weight_decay = grp ? 0.1 : 1e-2;
        rc = fsdp_optim_add_group(g->opt, n, ts, names, &a, NULL);
    }
    free(ts);
    free(names);
    fsdp_named_list_free(&params);
    return rc;
}

static void rig_free(fsdp_ctx_t *ctx, rig_t *g) {
    fu_teardown(ctx, g->m, g->root, NULL, g->opt);
    fsdp_pg_destroy(g->shard);
    fsdp_pg_destroy(g->rep);
}

/* The full optimizer dict with options o as host copies in *st. */
static int full_dict(fsdp_unit_t *root, fsdp_optim_t *opt, bool rank0_only, bool offload,
                     fu_store_t *st, bool *on_host) {
    fsdp_full_state_dict_options_t o;
    fsdp_full_state_dict_options_init(&o);
    o.rank0_only = rank0_only;
    o.offload_to_cpu = offload;
    fsdp_named_list_t l = {0};
    int rc = fsdp_full_optim_state_dict(root, opt, &o, &l);
    if (on_host) *on_host = true;
    for (size_t i = 0; i < l.n && on_host; i++)
        *on_host &= fsdp_device_kind(fsdp_tensor_device(l.tensors[i])) == FSDP_DEVICE_CPU;
    if (rc == 0) rc = store_list(st, &l, NULL);
    fsdp_named_list_free(&l);
    return rc;
}

/* Rank 0's FULL model state dict into st (collective). */
static int save_model(fsdp_ctx_t *ctx, fsdp_unit_t *root, fu_store_t *st, pthread_mutex_t *mu) {
    fsdp_full_state_dict_options_t o;
    fsdp_full_state_dict_options_init(&o);
    o.rank0_only = true;
    fsdp_named_list_t l = {0};
    int rc = fsdp_full_state_dict(root, &o, &l);
    if (rc == 0 && fsdp_ctx_rank(ctx) == 0) rc = store_list(st, &l, mu);
    fsdp_named_list_free(&l);
    return rc;
}

/* The optimizer's own state as host copies (to see that a failed load changed nothing). */
static int snapshot(fsdp_optim_t *opt, fu_store_t *st) {
    fsdp_named_list_t l = {0};
    int rc = fsdp_optim_state_dict(opt, &l);
    if (rc == 0) rc = store_list(st, &l, NULL);
    fsdp_named_list_free(&l);
    return rc;
}

/* ---- the rank functions ---------------------------------------------------------------------- */

static void gather_checks(fu_res_t *r, fsdp_ctx_t *ctx, of_job_t *oj, rig_t *g) {
    int rc, rank = fsdp_ctx_rank(ctx);
    char why[400] = "";
    fu_store_t a = {0}, b = {0}, c = {0};
    bool host = false;
    FU_TRY(done, "sharded pieces",
           store_pieces(ctx, g->root, g->opt, false, &oj->pieces[0], oj->mu));
    FU_TRY(done, "full dict", full_dict(g->root, g->opt, false, false, &a, NULL));
    fu_ck(r, full_vs_pieces(&a, &oj->pieces[0], why, sizeof why),
          "the full dict is bitwise the consolidation of every rank's SHARDED pieces", "%s", why);
    size_t want[3] = {0, 0, 0};
    for (size_t i = 0; i < a.n; i++) {
        want[0] += strstr(a.e[i].name, ".exp_avg") != NULL;
        want[1] += strstr(a.e[i].name, ".step") != NULL;
        want[2] += strcmp(a.e[i].name, "bn.weight.exp_avg_sq") == 0;
    }
    fu_ck(r, want[0] > 0 && want[1] > 0 && want[2] == 1,
          "it holds exp_avg, exp_avg_sq and step, and the state of bn.weight (no unit's)",
          "%zu moments, %zu steps, %zu bn.weight.exp_avg_sq", want[0], want[1], want[2]);
    FU_TRY(done, "full dict", full_dict(g->root, g->opt, true, false, &b, NULL));
    fu_ck(r, rank == 0 ? same_full(&b, &a, why, sizeof why) : b.n == 0,
          "rank0_only: rank 0 gets the same entries, the other ranks none", "%zu entries: %s", b.n,
          why);
    FU_TRY(done, "full dict", full_dict(g->root, g->opt, false, true, &c, &host));
    fu_ck(r, host && same_full(&c, &a, why, sizeof why),
          "offload_to_cpu: host tensors with the same bits", "on the host: %d; %s", host, why);
    if (rank == 0 && oj->full) { /* the saved dict, for the load jobs */
        *oj->full = a;
        a = (fu_store_t){0};
    }
done:
    fu_store_free(&a);
    fu_store_free(&b);
    fu_store_free(&c);
}

/* One bad load: FSDP_EINVAL naming `what`, and the optimizer's state bitwise unchanged. */
static void bad_load(fu_res_t *r, fsdp_ctx_t *ctx, fsdp_optim_t *opt, fsdp_unit_t *root,
                     const fsdp_named_list_t *l, const char *what, const char *name) {
    fu_store_t before = {0}, after = {0};
    char why[300] = "";
    int rc = snapshot(opt, &before);
    if (rc == 0) rc = fsdp_load_full_optim_state_dict(root, opt, l);
    fu_ck_einval(r, ctx, rc, what, NULL, name);
    rc = snapshot(opt, &after);
    fu_ck(r, rc == 0 && same_full(&after, &before, why, sizeof why),
          "... and the optimizer's state is bitwise unchanged", "%s", why);
    fu_store_free(&before);
    fu_store_free(&after);
}

/* The bad inputs, each a change of a borrowed copy of the good dict l. */
static void bad_inputs(fu_res_t *r, fsdp_ctx_t *ctx, rig_t *g, const fsdp_named_list_t *l) {
    fsdp_named_list_t v = {.n = l->n, .owned = false};
    v.names = calloc(l->n + 1, sizeof *v.names);
    v.tensors = calloc(l->n + 1, sizeof *v.tensors);
    size_t st = l->n, sh = l->n, gr = l->n; /* a moment, a 2-D parameter's, a group entry */
    for (size_t i = 0; i < l->n; i++) {
        const char *nm = l->names[i];
        bool managed = strncmp(nm, "transformer.", 12) == 0;
        if (managed && st == l->n && strstr(nm, ".exp_avg") && !strstr(nm, "exp_avg_sq")) st = i;
        if (managed && sh == l->n && strstr(nm, ".exp_avg_sq") &&
            fsdp_tensor_ndim(l->tensors[i]) == 2)
            sh = i;
        if (managed && gr == l->n && strstr(nm, ".group")) gr = i;
    }
    if (!fu_ck(r, v.names && v.tensors && st < l->n && sh < l->n && gr < l->n,
               "the dict has a moment, a 2-D moment and a group entry to corrupt", "%zu %zu %zu",
               st, sh, gr))
        goto out;
    memcpy(v.names, l->names, l->n * sizeof *v.names);
    memcpy(v.tensors, l->tensors, l->n * sizeof *v.tensors);
    /* a missing state: drop it (the last entry takes its place) */
    v.names[st] = l->names[l->n - 1];
    v.tensors[st] = l->tensors[l->n - 1];
    v.n--;
    bad_load(r, ctx, g->opt, g->root, &v, l->names[st], "a missing state is FSDP_EINVAL naming it");
    v.n++;
    v.names[st] = l->names[st];
    v.tensors[st] = l->tensors[st];
    /* another shape: the moment flattened */
    fsdp_tensor_t *flat = NULL;
    const int64_t m1[1] = {-1};
    if (fsdp_reshape(l->tensors[sh], 1, m1, &flat) == 0) {
        v.tensors[sh] = flat;
        bad_load(r, ctx, g->opt, g->root, &v, l->names[sh],
                 "a state of another shape is FSDP_EINVAL naming it");
        v.tensors[sh] = l->tensors[sh];
    }
    fsdp_tensor_release(flat);
    /* a parameter put in a group the optimizer does not have */
    fsdp_tensor_t *seven = NULL;
    char fqn[160];
    snprintf(fqn, sizeof fqn, "%.*s", (int)(strlen(l->names[gr]) - strlen(".group")), l->names[gr]);
    if (fsdp_tensor_full(ctx, FSDP_DTYPE_F64, 0, NULL, 7.0, FSDP_MEM_OTHER, &seven) == 0) {
        v.tensors[gr] = seven;
        bad_load(r, ctx, g->opt, g->root, &v, fqn,
                 "a parameter in an unknown group is FSDP_EINVAL naming it");
        v.tensors[gr] = l->tensors[gr];
        /* an unknown group's hyper-parameter */
        v.names[v.n] = "group.7.lr";
        v.tensors[v.n++] = seven;
        bad_load(r, ctx, g->opt, g->root, &v, "group.7.lr",
                 "an unknown group's hyper-parameter is FSDP_EINVAL naming it");
        v.n--;
    }
    fsdp_tensor_release(seven);
    /* a parameter the model does not have */
    v.names[st] = "no.such.param.exp_avg";
    bad_load(r, ctx, g->opt, g->root, &v, "no.such.param",
             "an unknown parameter is FSDP_EINVAL naming it");
    v.names[st] = l->names[st];
    /* and the untouched dict loads, giving back the full dict it came from (a rank's local
     * state may gain empty states for parameters it holds no part of) */
    fu_store_t before = {0}, after = {0};
    char why[300] = "";
    int rc = full_dict(g->root, g->opt, false, false, &before, NULL);
    if (rc == 0) rc = fsdp_load_full_optim_state_dict(g->root, g->opt, &v);
    if (rc == 0) rc = full_dict(g->root, g->opt, false, false, &after, NULL);
    fu_ck(r, rc == 0 && same_full(&after, &before, why, sizeof why),
          "the untouched dict loads and gives the full dict it came from, bitwise", "%s: %s %s",
          fsdp_err_name(rc), fsdp_ctx_last_error(ctx), why);
    fu_store_free(&before);
    fu_store_free(&after);
out:
    free(v.names);
    free(v.tensors);
}

static int of_rank(fsdp_ctx_t *ctx, void *arg) {
    of_job_t *oj = arg;
    fu_res_t *r = fu_res_of(&oj->j, ctx);
    rig_t g = {0};
    char why[400] = "";
    fu_store_t a = {0}, b = {0};
    fsdp_named_list_t l = {0};
    int rank = fsdp_ctx_rank(ctx), rc;
    FU_TRY(done, "setting up", setup(ctx, oj, &g));
    switch (oj->mode) {
    case GATHER:
        FU_TRY(done, "training", train(ctx, &g, 2));
        gather_checks(r, ctx, oj, &g);
        if (oj->model) FU_TRY(done, "saving the model", save_model(ctx, g.root, oj->model, oj->mu));
        FU_TRY(done, "training", train(ctx, &g, 1));
        if (oj->after3)
            FU_TRY(done, "saving the model", save_model(ctx, g.root, oj->after3, oj->mu));
        FU_TRY(done, "special values",
               store_pieces(ctx, g.root, g.opt, true, &oj->pieces[1], oj->mu));
        FU_TRY(done, "full dict", full_dict(g.root, g.opt, false, false, &a, NULL));
        fu_ck(r, full_vs_pieces(&a, &oj->pieces[1], why, sizeof why),
              "with -0.0 and NaN payloads in the moments, still bitwise the consolidation", "%s",
              why);
        break;
    case LOAD:
        FU_TRY(done, "the model's dict", fu_store_to_named(ctx, oj->model, &l));
        FU_TRY(done, "loading the model", fsdp_load_full_state_dict(g.root, &l, true));
        fsdp_named_list_free(&l);
        FU_TRY(done, "the optimizer's dict", fu_store_to_named(ctx, oj->full, &l));
        FU_TRY(done, "loading the dict saved at world 2",
               fsdp_load_full_optim_state_dict(g.root, g.opt, &l));
        FU_TRY(done, "full dict", full_dict(g.root, g.opt, false, false, &a, NULL));
        fu_ck(r, same_full(&a, oj->full, why, sizeof why),
              "the reloaded optimizer's full dict is bitwise the saved one", "%s", why);
        if (!oj->resume) break;
        FU_TRY(done, "training", train(ctx, &g, 1));
        FU_TRY(done, "the model's dict", save_model(ctx, g.root, &b, NULL));
        fu_ck(r, rank != 0 || same_full(&b, oj->after3, why, sizeof why),
              "one more step gives bitwise the uninterrupted run's model", "%s", why);
        break;
    case BAD:
        FU_TRY(done, "training", train(ctx, &g, 2));
        FU_TRY(done, "full dict", full_dict(g.root, g.opt, false, false, &a, NULL));
        FU_TRY(done, "the dict", fu_store_to_named(ctx, &a, &l));
        bad_inputs(r, ctx, &g, &l);
        break;
    }
done:
    fsdp_named_list_free(&l);
    fu_store_free(&a);
    fu_store_free(&b);
    rig_free(ctx, &g);
    return rc;
}

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

/* One job; returns it for the caller's stores (free()). */
static void run(int mode, const char *what, int world, fsdp_sharding_strategy_t s, bool orig,
                bool recursive, fu_store_t *full, fu_store_t *model, fu_store_t *after3,
                bool resume) {
    of_job_t *oj = calloc(1, sizeof *oj);
    if (!oj) tap_bail("out of memory");
    char prefix[160];
    snprintf(prefix, sizeof prefix, "%s %s, use_orig_params %s, %s", what,
             fsdp_sharding_strategy_name(s), orig ? "on" : "off",
             recursive ? "RECURSIVE" : "root only");
    fu_job_init(&oj->j, prefix, world, s, orig);
    oj->mode = mode;
    oj->hybrid = s == FSDP_HYBRID_SHARD || s == FSDP_HYBRID_SHARD_ZERO2;
    oj->recursive = recursive;
    oj->full = full;
    oj->model = model;
    oj->after3 = after3;
    oj->resume = resume;
    oj->mu = &mu;
    fu_run_job(&oj->j, of_rank);
    fu_store_free(&oj->pieces[0]);
    fu_store_free(&oj->pieces[1]);
    free(oj);
}

/* ---- world 8: ranks that hold no part of a parameter ----------------------------------------- */

typedef struct w8 {
    bool orig;
    fu_store_t pieces;
    bool ok[8], empty[8];
    char why[8][300];
} w8_t;

static int w8_rank(fsdp_ctx_t *ctx, void *arg) {
    w8_t *w = arg;
    int rank = fsdp_ctx_rank(ctx);
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_named_list_t params = {0};
    fu_store_t a = {0};
    fsdp_options_t o;
    fsdp_options_init(&o);
    o.use_orig_params = w->orig;
    int rc = fu_linear_stack(ctx, 2, 3, &m);
    if (rc == 0) rc = fsdp_wrap(m, &o, &root);
    if (rc == 0) rc = fsdp_named_params(root, &params);
    if (rc == 0) rc = fsdp_optim_adam_create(ctx, NULL, true, &opt);
    if (rc == 0)
        rc = fsdp_optim_add_group(opt, params.n, params.tensors, (const char *const *)params.names,
                                  NULL, NULL);
    for (int s = 0; s < 2 && rc == 0; s++) {
        fsdp_tensor_t *x = NULL, *y = NULL, *loss = NULL;
        rc = fu_rand_input(ctx, 7, 4, 3, &x);
        if (rc == 0) rc = fsdp_module_forward1(m, x, &y);
        if (rc == 0) rc = tm_sum_loss(y, &loss);
        if (rc == 0) rc = fsdp_backward(loss, NULL);
        if (rc == 0) rc = fsdp_optim_step(opt);
        fsdp_tensor_release(x);
        fsdp_tensor_release(y);
        fsdp_tensor_release(loss);
        fsdp_tape_clear(ctx);
    }
    if (rc == 0) rc = store_pieces(ctx, root, opt, false, &w->pieces, &mu);
    if (rc == 0) rc = full_dict(root, opt, true, false, &a, NULL);
    if (rc == 0) {
        /* pieces of exp_avg this rank gave, against the 4 parameters */
        size_t mine = 0, n = 0;
        fsdp_shard_list_t l = {0};
        if (fsdp_sharded_optim_state_dict(root, opt, &l) == 0)
            for (size_t i = 0; i < l.n; i++)
                mine += strstr(l.e[i].name, ".exp_avg") && !strstr(l.e[i].name, "_sq");
        fsdp_shard_list_free(&l);
        for (size_t i = 0; i < a.n; i++)
            n += strstr(a.e[i].name, ".exp_avg") && !strstr(a.e[i].name, "_sq");
        w->empty[rank] = mine < 4;
        w->ok[rank] =
            rank == 0 ? n == 4 && full_vs_pieces(&a, &w->pieces, w->why[rank], 300) : a.n == 0;
    } else {
        snprintf(w->why[rank], 300, "%s: %s", fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
    }
    fu_store_free(&a);
    fsdp_named_list_free(&params);
    fsdp_tape_clear(ctx);
    fsdp_optim_destroy(opt);
    fsdp_unit_destroy(root);
    fsdp_module_release(m);
    return rc;
}

static void run8(bool orig) {
    w8_t *w = calloc(1, sizeof *w);
    if (!w) tap_bail("out of memory");
    w->orig = orig;
    fsdp_sim_options_t so;
    fsdp_sim_options_init(&so);
    so.world_size = 8;
    so.timeout_ms = 60000;
    int st[8] = {0};
    int rc = fsdp_sim_run(&so, w8_rank, w, st);
    bool ok = rc == 0, empty = false;
    for (int r = 0; r < 8; r++) {
        ok &= w->ok[r];
        empty |= w->empty[r];
        if (!w->ok[r]) tap_diag("rank %d: %s", r, w->why[r]);
    }
    tap_ok(ok && empty,
           "world 8, FULL_SHARD, use_orig_params %s, 2 x Linear(3, 3): ranks that hold no part of "
           "a parameter (some: %s); rank 0's rank0_only full dict is bitwise the consolidation",
           orig ? "on" : "off", empty ? "yes" : "no");
    fu_store_free(&w->pieces);
    free(w);
}

int main(void) {
    tap_plan_lazy();
    static const fsdp_sharding_strategy_t all[5] = {FSDP_FULL_SHARD, FSDP_SHARD_GRAD_OP,
                                                    FSDP_NO_SHARD, FSDP_HYBRID_SHARD,
                                                    FSDP_HYBRID_SHARD_ZERO2};
    /* the gather over every strategy and world size */
    for (int si = 0; si < 5; si++)
        for (int orig = 0; orig < 2; orig++)
            for (int w = 1; w <= 4; w++) {
                if (si >= 3 && w != 2 && w != 4) continue; /* hybrid: 2 x 1 and 2 x 2 */
                if (si < 3 && w == 2) continue;            /* below, with the saves */
                run(GATHER, "full dict after two AdamW steps:", w, all[si], orig, true, NULL, NULL,
                    NULL, false);
            }
    /* saved at world 2 (FULL_SHARD and SHARD_GRAD_OP, both use_orig_params settings), loaded
     * elsewhere */
    for (int si = 0; si < 3; si++)
        for (int orig = 0; orig < 2; orig++) {
            fsdp_sharding_strategy_t s = all[si];
            fu_store_t full = {0}, model = {0}, after3 = {0};
            run(GATHER, "full dict after two AdamW steps:", 2, s, orig, true, &full, &model,
                &after3, false);
            if (si == 2) {
                fu_store_free(&full);
                fu_store_free(&model);
                fu_store_free(&after3);
                continue;
            }
            static const char what[] = "the dict saved at world 2 loaded:";
            run(LOAD, what, 2, s, orig, true, &full, &model, &after3, true);
            run(LOAD, what, 1, s, !orig, true, &full, &model, NULL, false);
            run(LOAD, what, 3, FSDP_NO_SHARD, orig, true, &full, &model, NULL, false);
            run(LOAD, what, 4, all[1 - si], !orig, true, &full, &model, NULL, false);
            run(LOAD, what, 3, s, true, false, &full, &model, NULL, false);
            run(LOAD, what, 4, FSDP_HYBRID_SHARD, orig, true, &full, &model, NULL, false);
            fu_store_free(&full);
            fu_store_free(&model);
            fu_store_free(&after3);
        }
    run(BAD, "bad dicts:", 2, FSDP_FULL_SHARD, true, true, NULL, NULL, NULL, false);
    run8(false);
    run8(true);
    return tap_done();
}
