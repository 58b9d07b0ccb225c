/* SPDX-License-Identifier: MIT */
/*
 * t_reshard.c: the resharding matrix of the SHARDED state dicts (spec F26, with F27's tied
 * weight), the checkpoint issue's test: "A resharding matrix: save at world sizes {1,2,3,4} x
 * {FULL_SHARD, SHARD_GRAD_OP, HYBRID}, then load at every other world size. Parameters and
 * optimizer state must equal, bitwise, the consolidated form."
 *
 * The model is TransformerWithSharedParams (tied embedding and output weights, an f32 and an
 * i64 buffer) under RECURSIVE wrapping (five units), trained two steps with AdamW on the sim
 * backend. For each of the 12 saves (world 1..4 x FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD) the
 * model's fsdp_sharded_state_dict and the optimizer's fsdp_sharded_optim_state_dict are saved,
 * and the saving run goes on with an uninterrupted third step. Each save then loads into a
 * fresh model and AdamW at every world size x every strategy (all 12 cells: the other world
 * sizes, the same world size under the other strategies, and the saving cell itself, the plain
 * resume), and:
 *   - the saved pieces consolidate (assembled here on host arrays, independently of the
 *     library's load): every element of every tensor given once, pieces that overlap are the
 *     same range and bitwise equal (replicas), and each sharded piece appears once per replica
 *     (world / shard size times) and each replicated entry once per rank (at most: an
 *     optimizer over original parameters has no step for a parameter a rank holds none of);
 *   - the loaded model's FULL state dict (an all-gather, not the sharded path) equals the
 *     consolidated model bitwise (the tied weight's second name equals its first), and the
 *     loaded model's and optimizer's pieces, saved again, consolidate to the saved form bitwise;
 *   - one step after the load equals the uninterrupted third step: bitwise in the saving cell
 *     (determinism of resume), within fp32 tolerance (rtol 1.3e-6, atol 1e-5, assert_close's)
 *     in every other cell, whose gradient reductions add the ranks' terms in another order.
 *     Every rank trains on the same batch, so the cells differ only by rounding.
 *
 * Every other cell wraps with use_orig_params (the TAP lines say "orig", else "flat"), so AdamW
 * steps over the original parameters there and over the flat ones elsewhere, and most loads
 * cross from one to the other; the resume cell keeps its own.
 *
 * HYBRID_SHARD's groups (fu_hybrid_groups: shard groups of consecutive ranks, replicate groups
 * across them) use shard size world / 2 at even worlds and 1 at odd ones: 2 x 2 at world 4 and
 * whole parameters replicated at worlds 2 and 3, so every world but 1 (which cannot have a
 * replica) saves and loads pieces that replicas gave twice or more, and world 4 has both a
 * split parameter and replicas of every piece.
 *
 * Save and load go through one seam, two functions, and through the on-disk checkpoint format:
 * save_all() writes the checkpoint directory (fsdp_checkpoint_save: every rank's file and the
 * index) and keeps every rank's pieces as host copies merged in one saved_t (the test's record
 * of what was saved, which the consolidation reads, independently of the files); load_from()
 * opens the directory and loads it (fsdp_checkpoint_load: each rank reads the byte ranges of
 * its part). So the bitwise checks below hold for the files, read at another world size.
 */
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "models/models.h"
#include "tap.h"

#define NSTRAT 3
static const fsdp_sharding_strategy_t strategies[NSTRAT] = {FSDP_FULL_SHARD, FSDP_SHARD_GRAD_OP,
                                                            FSDP_HYBRID_SHARD};

/* HYBRID_SHARD's shard group size at a world (see the header comment). */
static int hybrid_shard_size(int world) {
    return world % 2 == 0 ? world / 2 : 1;
}

/* How many ranks hold each sharded piece alike: the replicate group's size. */
static int replicas(int world, fsdp_sharding_strategy_t s) {
    return s == FSDP_HYBRID_SHARD ? world / hybrid_shard_size(world) : 1;
}

/* ---- host copies: pieces (a checkpoint) and whole tensors ------------------------------------ */

typedef struct piece {
    char name[160];
    int rank; /* that gave it */
    fsdp_dtype_t dt;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS]; /* global */
    int64_t offset, numel;        /* of the piece in the global tensor, row-major */
    bool replicated;
    void *data; /* numel elements of dt */
} piece_t;

typedef struct plist {
    size_t n, cap;
    piece_t *p;
} plist_t;

/* A checkpoint: every rank's pieces of the model and of the optimizer's state. */
typedef struct saved {
    int world;
    fsdp_sharding_strategy_t s;
    char dir[300]; /* the checkpoint directory it was written to */
    plist_t model, optim;
    pthread_mutex_t mu; /* ranks append concurrently */
} saved_t;

/* Whole tensors (a consolidated form, or a FULL state dict). */
typedef struct whole {
    char name[160];
    fsdp_dtype_t dt;
    int64_t numel;
    void *data;
} whole_t;

typedef struct wlist {
    size_t n, cap;
    whole_t *w;
} wlist_t;

static void plist_free(plist_t *l) {
    for (size_t i = 0; i < l->n; i++)
        free(l->p[i].data);
    free(l->p);
    *l = (plist_t){0};
}

static void wlist_free(wlist_t *l) {
    for (size_t i = 0; i < l->n; i++)
        free(l->w[i].data);
    free(l->w);
    *l = (wlist_t){0};
}

static void *grow(void *a, size_t *cap, size_t n, size_t size) {
    if (n < *cap) return a;
    size_t nc = *cap ? 2 * *cap : 64;
    void *na = realloc(a, nc * size);
    if (!na) tap_bail("out of memory");
    *cap = nc;
    return na;
}

/* Host copy of t's elements (malloc'ed; the bytes in *bytes). */
static int host_copy(const fsdp_tensor_t *t, void **data, size_t *bytes) {
    *bytes = (size_t)fsdp_tensor_numel(t) * fsdp_dtype_size(fsdp_tensor_dtype(t));
    *data = malloc(*bytes ? *bytes : 1);
    if (!*data) return FSDP_ENOMEM;
    int rc = fsdp_tensor_to_host(t, *data, *bytes);
    if (rc < 0) {
        free(*data);
        *data = NULL;
    }
    return rc;
}

static int wlist_add(wlist_t *l, const char *name, const fsdp_tensor_t *t) {
    l->w = grow(l->w, &l->cap, l->n, sizeof *l->w);
    whole_t *w = &l->w[l->n];
    snprintf(w->name, sizeof w->name, "%s", name);
    w->dt = fsdp_tensor_dtype(t);
    w->numel = fsdp_tensor_numel(t);
    size_t bytes;
    int rc = host_copy(t, &w->data, &bytes);
    if (rc == 0) l->n++;
    return rc;
}

static const whole_t *wfind(const wlist_t *l, const char *name) {
    for (size_t i = 0; i < l->n; i++)
        if (strcmp(l->w[i].name, name) == 0) return &l->w[i];
    return NULL;
}

static bool same_whole(const whole_t *a, const whole_t *b) {
    return a->dt == b->dt && a->numel == b->numel &&
           memcmp(a->data, b->data, (size_t)a->numel * fsdp_dtype_size(a->dt)) == 0;
}

/* ---- the seam: save_all and load_from -------------------------------------------------------- */

static int plist_add(plist_t *l, int rank, const fsdp_shard_entry_t *e) {
    l->p = grow(l->p, &l->cap, l->n, sizeof *l->p);
    piece_t *p = &l->p[l->n];
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "%s", e->name);
    p->rank = rank;
    p->dt = fsdp_tensor_dtype(e->t);
    p->ndim = e->ndim;
    memcpy(p->shape, e->shape, sizeof p->shape);
    p->offset = e->offset;
    p->numel = fsdp_tensor_numel(e->t);
    p->replicated = e->replicated;
    size_t bytes;
    int rc = host_copy(e->t, &p->data, &bytes);
    if (rc == 0) l->n++;
    return rc;
}

/* This rank's pieces of root's model and of opt's state, copied into out (merged with the
 * other ranks' under out->mu; every rank calls it). Not collective. */
static int save_all(fsdp_ctx_t *ctx, fsdp_unit_t *root, const fsdp_optim_t *opt, saved_t *out) {
    fsdp_shard_list_t ml = {0}, ol = {0};
    int rank = fsdp_ctx_rank(ctx);
    int rc = fsdp_sharded_state_dict(root, &ml);
    if (rc == 0) rc = fsdp_sharded_optim_state_dict(root, opt, &ol);
    pthread_mutex_lock(&out->mu);
    for (size_t i = 0; i < ml.n && rc == 0; i++)
        rc = plist_add(&out->model, rank, &ml.e[i]);
    for (size_t i = 0; i < ol.n && rc == 0; i++)
        rc = plist_add(&out->optim, rank, &ol.e[i]);
    pthread_mutex_unlock(&out->mu);
    fsdp_shard_list_free(&ml);
    fsdp_shard_list_free(&ol);
    /* the directory, collectively (every rank gets there: a failure above is reported after) */
    int crc = fsdp_checkpoint_save(root, opt, out->dir, NULL, 0);
    return rc < 0 ? rc : crc;
}

/* Loads the saved model and optimizer state into root's tree and opt (this rank's part of
 * them). Not collective. */
static int load_from(const saved_t *in, fsdp_ctx_t *ctx, fsdp_unit_t *root, fsdp_optim_t *opt) {
    fsdp_ckpt_t *ck = NULL;
    int rc = fsdp_ckpt_open(ctx, in->dir, &ck);
    if (rc == 0) rc = fsdp_checkpoint_load(root, opt, ck);
    fsdp_ckpt_close(ck);
    return rc;
}

/* ---- consolidation (host arrays only) -------------------------------------------------------- */

static int cmp_piece(const void *a, const void *b) {
    const piece_t *x = *(piece_t *const *)a, *y = *(piece_t *const *)b;
    int c = strcmp(x->name, y->name);
    if (c) return c;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    if (x->numel != y->numel) return x->numel < y->numel ? -1 : 1;
    return x->rank - y->rank;
}

static int64_t total_of(const piece_t *p) {
    int64_t t = 1;
    for (int d = 0; d < p->ndim; d++)
        t *= p->shape[d];
    return t;
}

/*
 * Assembles the pieces of `in` into whole tensors (out, sorted by name): every element given
 * by exactly one range of pieces; pieces over the same range (replicas) must be bitwise equal
 * and are taken once; any other overlap, a gap, a piece past the end or pieces of one name that
 * disagree on dtype or global shape fail. Each sharded range must come from exactly `copies`
 * ranks, each replicated entry from `ranks` ranks (at most `ranks` unless every: an optimizer
 * over original parameters has no state, so no step, for a parameter a rank holds none of;
 * such a rank gives no entry for it). On failure returns false
 * with the first problem in why.
 */
static bool consolidate(const plist_t *in, int copies, int ranks, bool every, wlist_t *out,
                        char *why, size_t len) {
    *out = (wlist_t){0};
    const piece_t **ix = malloc((in->n + 1) * sizeof *ix);
    if (!ix) tap_bail("out of memory");
    for (size_t i = 0; i < in->n; i++)
        ix[i] = &in->p[i];
    qsort(ix, in->n, sizeof *ix, cmp_piece);
    bool ok = in->n > 0;
    if (!ok) snprintf(why, len, "no pieces");
    for (size_t i = 0; i < in->n && ok;) {
        const piece_t *first = ix[i];
        size_t es = fsdp_dtype_size(first->dt);
        int64_t total = total_of(first), end = 0;
        out->w = grow(out->w, &out->cap, out->n, sizeof *out->w);
        whole_t *w = &out->w[out->n++];
        snprintf(w->name, sizeof w->name, "%s", first->name);
        w->dt = first->dt;
        w->numel = total;
        w->data = calloc((size_t)total + 1, es);
        if (!w->data) tap_bail("out of memory");
        for (; i < in->n && ok && strcmp(ix[i]->name, first->name) == 0;) {
            const piece_t *p = ix[i];
            size_t k = i + 1; /* p's replicas: the same range, adjacent after the sort */
            while (k < in->n && strcmp(ix[k]->name, p->name) == 0 && ix[k]->offset == p->offset &&
                   ix[k]->numel == p->numel)
                k++;
            int want = p->replicated ? ranks : copies, got = (int)(k - i);
            if (p->dt != first->dt || p->ndim != first->ndim ||
                memcmp(p->shape, first->shape, sizeof p->shape) != 0)
                snprintf(why, len, "'%s': pieces of another dtype or global shape", p->name);
            else if (p->offset != end)
                snprintf(why, len, "'%s': a piece at %lld where %lld was expected (%s)", p->name,
                         (long long)p->offset, (long long)end, p->offset < end ? "overlap" : "gap");
            else if (p->offset + p->numel > total)
                snprintf(why, len, "'%s': a piece runs past the tensor's %lld elements", p->name,
                         (long long)total);
            else if (p->replicated && (p->offset != 0 || p->numel != total))
                snprintf(why, len, "'%s': a replicated entry is not the whole tensor", p->name);
            else if (p->replicated && !every ? got > want : got != want)
                snprintf(why, len, "'%s' [%lld, +%lld): given by %d ranks, want %s%d", p->name,
                         (long long)p->offset, (long long)p->numel, got,
                         p->replicated && !every ? "at most " : "", want);
            else
                why[0] = 0;
            ok = why[0] == 0;
            for (size_t r = i + 1; r < k && ok; r++)
                if (memcmp(ix[r]->data, p->data, (size_t)p->numel * es) != 0) {
                    snprintf(
                        why, len, "'%s' [%lld, +%lld): rank %d's replica differs from rank %d's",
                        p->name, (long long)p->offset, (long long)p->numel, ix[r]->rank, p->rank);
                    ok = false;
                }
            if (ok)
                memcpy((char *)w->data + (size_t)p->offset * es, p->data, (size_t)p->numel * es);
            end = p->offset + p->numel;
            i = k;
        }
        if (ok && end != total) {
            snprintf(why, len, "'%s': elements [%lld, %lld) are in no piece", first->name,
                     (long long)end, (long long)total);
            ok = false;
        }
    }
    free(ix);
    return ok;
}

/* Whether two consolidated forms are bitwise equal (same names, dtypes, sizes, bits). */
static bool same_wlist(const wlist_t *a, const wlist_t *b, char *why, size_t len) {
    if (a->n != b->n) {
        snprintf(why, len, "%zu tensors, saved %zu", a->n, b->n);
        return false;
    }
    for (size_t i = 0; i < a->n; i++)
        if (strcmp(a->w[i].name, b->w[i].name) != 0 || !same_whole(&a->w[i], &b->w[i])) {
            snprintf(why, len, "'%s' differs from the saved '%s'", a->w[i].name, b->w[i].name);
            return false;
        }
    return true;
}

/* Whether a FULL state dict holds the consolidated model bitwise: every consolidated tensor
 * under its name, and any other name (the tied weight's second one) bitwise equal to a
 * consolidated tensor; *aliases counts those. */
static bool full_is(const wlist_t *full, const wlist_t *cons, int *aliases, char *why, size_t len) {
    *aliases = 0;
    for (size_t i = 0; i < cons->n; i++) {
        const whole_t *f = wfind(full, cons->w[i].name);
        if (!f || !same_whole(f, &cons->w[i])) {
            snprintf(why, len, "'%s' %s", cons->w[i].name, f ? "differs" : "is missing");
            return false;
        }
    }
    for (size_t i = 0; i < full->n; i++) {
        if (wfind(cons, full->w[i].name)) continue;
        bool twin = false;
        for (size_t k = 0; k < cons->n && !twin; k++)
            twin = same_whole(&full->w[i], &cons->w[k]);
        if (!twin) {
            snprintf(why, len, "'%s' is in no piece and equals no saved tensor", full->w[i].name);
            return false;
        }
        (*aliases)++;
    }
    return true;
}

/* The worst fu_closeness() of b's f32 tensors against a's (other dtypes must be bitwise equal:
 * INFINITY otherwise); *bitwise says whether everything was bitwise equal. */
static double closeness(const wlist_t *got, const wlist_t *want, bool *bitwise, char *why,
                        size_t len) {
    double worst = 0;
    *bitwise = got->n == want->n;
    if (!*bitwise) {
        snprintf(why, len, "%zu tensors, want %zu", got->n, want->n);
        return INFINITY;
    }
    for (size_t i = 0; i < got->n; i++) {
        const whole_t *g = &got->w[i], *w = wfind(want, g->name);
        if (!w || w->dt != g->dt || w->numel != g->numel) {
            snprintf(why, len, "'%s' has no counterpart", g->name);
            *bitwise = false;
            return INFINITY;
        }
        if (same_whole(g, w)) continue;
        *bitwise = false;
        if (g->dt != FSDP_DTYPE_F32) {
            snprintf(why, len, "'%s' (not f32) differs", g->name);
            return INFINITY;
        }
        const float *x = g->data, *y = w->data;
        for (int64_t e = 0; e < g->numel; e++) {
            double c = fu_closeness(x[e], y[e], FU_F32_RTOL, FU_F32_ATOL);
            if (isnan(c)) c = INFINITY;
            if (c > worst) {
                worst = c;
                snprintf(why, len, "'%s'[%lld]: %.9g, want %.9g", g->name, (long long)e, x[e],
                         y[e]);
            }
        }
    }
    return worst;
}

/* ---- the sim runs ---------------------------------------------------------------------------- */

typedef struct rs_job {
    fu_job_t j;       /* first */
    bool save;        /* SAVE: train two steps, save_all, a third step; LOAD: load_from, one step */
    saved_t *ck;      /* SAVE: written; LOAD: read */
    saved_t *again;   /* LOAD: the loaded model and optimizer, saved again */
    wlist_t *full;    /* LOAD: rank 0's FULL state dict right after the load */
    wlist_t *stepped; /* rank 0's FULL state dict after the last step (the third, or the one
                       * after the load) */
} rs_job_t;

/* Rank 0's FULL state dict into *dst (every rank calls: collective). */
static int full_to(fsdp_ctx_t *ctx, fsdp_unit_t *root, wlist_t *dst) {
    fsdp_full_state_dict_options_t fo;
    fsdp_full_state_dict_options_init(&fo);
    fo.rank0_only = true;
    fsdp_named_list_t sd = {0};
    int rc = fsdp_full_state_dict(root, &fo, &sd);
    for (size_t i = 0; i < sd.n && rc == 0 && fsdp_ctx_rank(ctx) == 0; i++)
        rc = wlist_add(dst, sd.names[i], sd.tensors[i]);
    fsdp_named_list_free(&sd);
    return rc;
}

static int rs_rank(fsdp_ctx_t *ctx, void *arg) {
    rs_job_t *rj = arg;
    fu_job_t *j = &rj->j;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_optim_t *adamw = NULL;
    fsdp_pg_t *shard_pg = NULL, *rep_pg = NULL;
    fsdp_named_list_t params = {0};
    fsdp_options_t o;
    int rc;
    fu_job_options(j, &o);
    o.check_exec_order = false;
    if (j->strategy == FSDP_HYBRID_SHARD) {
        FU_TRY(done, "hybrid groups",
               fu_hybrid_groups(ctx, hybrid_shard_size(j->world), &shard_pg, &rep_pg));
        o.pg = shard_pg;
        o.replicate_pg = rep_pg;
    }
    FU_TRY(done, "building the model", tm_transformer_create(ctx, false, true, &m));
    FU_TRY(done, "wrapping", fu_wrap_transformer_opts(m, &o, &root));
    FU_TRY(done, "AdamW", fsdp_named_params(root, &params));
    FU_TRY(done, "AdamW", fsdp_optim_adam_create(ctx, NULL, true, &adamw));
    FU_TRY(done, "AdamW",
           fsdp_optim_add_group(adamw, params.n, params.tensors, (const char *const *)params.names,
                                NULL, NULL));
    if (rj->save) {
        for (int s = 0; s < 2; s++)
            FU_TRY(done, "training two steps", fu_transformer_step(ctx, m, adamw));
        FU_TRY(done, "save_all", save_all(ctx, root, adamw, rj->ck));
    } else {
        FU_TRY(done, "load_from", load_from(rj->ck, ctx, root, adamw));
        FU_TRY(done, "FULL state dict after the load", full_to(ctx, root, rj->full));
        FU_TRY(done, "saving the loaded state again", save_all(ctx, root, adamw, rj->again));
    }
    FU_TRY(done, "the step", fu_transformer_step(ctx, m, adamw));
    FU_TRY(done, "FULL state dict after the step", full_to(ctx, root, rj->stepped));
done:
    fsdp_named_list_free(&params);
    fu_teardown(ctx, m, root, NULL, adamw);
    fsdp_pg_destroy(shard_pg);
    fsdp_pg_destroy(rep_pg);
    return rc;
}

static const char *sname(fsdp_sharding_strategy_t s) {
    return fsdp_sharding_strategy_name(s);
}

/* Whether the cell's units use original parameters (use_orig_params: AdamW then steps over
 * them, not over the flat parameters): in every other cell, so each world has both kinds and
 * most loads cross from one to the other. */
static bool orig_of(int world, fsdp_sharding_strategy_t s) {
    int k = 0;
    while (k < NSTRAT - 1 && strategies[k] != s)
        k++;
    return (world + k) % 2 == 1;
}

/* "world 4 HYBRID_SHARD (shard 2 x replicate 2), orig" */
static void cell(char *buf, size_t len, int world, fsdp_sharding_strategy_t s) {
    char hyb[48] = "";
    if (s == FSDP_HYBRID_SHARD)
        snprintf(hyb, sizeof hyb, " (shard %d x replicate %d)", hybrid_shard_size(world),
                 replicas(world, s));
    snprintf(buf, len, "world %d %s%s, %s", world, sname(s), hyb,
             orig_of(world, s) ? "orig" : "flat");
}

static void run(rs_job_t *rj, const char *prefix, int world, fsdp_sharding_strategy_t s) {
    fu_job_init(&rj->j, prefix, world, s, orig_of(world, s));
    fu_run_job(&rj->j, rs_rank);
}

static char tmpdir[200];

static void saved_init(saved_t *ck, int world, fsdp_sharding_strategy_t s) {
    static int seq;
    memset(ck, 0, sizeof *ck);
    ck->world = world;
    ck->s = s;
    snprintf(ck->dir, sizeof ck->dir, "%s/ck-%d", tmpdir, seq++);
    pthread_mutex_init(&ck->mu, NULL);
}

static void saved_free(saved_t *ck) {
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", ck->dir);
    if (system(cmd) != 0) tap_diag("could not remove %s", ck->dir);
    plist_free(&ck->model);
    plist_free(&ck->optim);
    pthread_mutex_destroy(&ck->mu);
}

/* One TAP line; on failure why (when not empty) as a comment before it. */
static void check(bool ok, const char *why, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void check(bool ok, const char *why, const char *fmt, ...) {
    char desc[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(desc, sizeof desc, fmt, ap);
    va_end(ap);
    if (!ok && why[0]) tap_diag("%s", why);
    tap_ok(ok, "%s", desc);
}

/* One save (world w, strategy s): its TAP lines, its consolidated model and optimizer state and
 * the uninterrupted third step; then every load of it. */
static void save_and_load_all(int w, fsdp_sharding_strategy_t s, double *worst) {
    static rs_job_t rj; /* large (the per-rank check lists): not on the stack */
    saved_t ck;
    wlist_t cm = {0}, co = {0}, third = {0};
    char from[64], prefix[160], why[400] = "";
    saved_init(&ck, w, s);
    cell(from, sizeof from, w, s);
    snprintf(prefix, sizeof prefix, "F26 reshard: save at %s", from);
    memset(&rj, 0, sizeof rj);
    rj.save = true;
    rj.ck = &ck;
    rj.stepped = &third;
    run(&rj, prefix, w, s);
    int rep = replicas(w, s);
    why[0] = 0;
    bool ok = consolidate(&ck.model, rep, w, true, &cm, why, sizeof why);
    check(ok, why,
          "F26 reshard: save at %s: the model's pieces consolidate (every element once; each "
          "piece from %d replica%s, bitwise equal; buffers from all %d ranks)",
          from, rep, rep > 1 ? "s" : "", w);
    ok = consolidate(&ck.optim, rep, w, false, &co, why, sizeof why);
    check(ok, why,
          "F26 reshard: save at %s: AdamW's pieces (exp_avg, exp_avg_sq, step, group, "
          "hyper-parameters) consolidate (every element once; replicas bitwise equal)",
          from);
    for (int lw = 1; lw <= 4; lw++)
        for (int ls = 0; ls < NSTRAT; ls++) {
            fsdp_sharding_strategy_t t = strategies[ls];
            saved_t again;
            wlist_t full = {0}, stepped = {0}, am = {0}, ao = {0};
            char to[64];
            int aliases = 0;
            bool bitwise = false, home = lw == w && t == s;
            saved_init(&again, lw, t);
            cell(to, sizeof to, lw, t);
            snprintf(prefix, sizeof prefix, "F26 reshard: %s -> %s", from, to);
            memset(&rj, 0, sizeof rj);
            rj.ck = &ck;
            rj.again = &again;
            rj.full = &full;
            rj.stepped = &stepped;
            run(&rj, prefix, lw, t);
            why[0] = 0;
            ok = cm.n > 0 && full_is(&full, &cm, &aliases, why, sizeof why);
            if (ok && aliases != 1)
                snprintf(why, sizeof why, "%d names beyond the pieces' ones, want 1", aliases);
            check(ok && aliases == 1, why,
                  "%s: the loaded model's FULL state dict is the consolidated saved model, bitwise "
                  "(and the tied weight's second name equals it)",
                  prefix);
            ok = consolidate(&again.model, replicas(lw, t), lw, true, &am, why, sizeof why) &&
                 same_wlist(&am, &cm, why, sizeof why) &&
                 consolidate(&again.optim, replicas(lw, t), lw, false, &ao, why, sizeof why) &&
                 same_wlist(&ao, &co, why, sizeof why);
            check(ok, why,
                  "%s: the loaded parameters and AdamW state, saved again, consolidate to the "
                  "saved form bitwise",
                  prefix);
            why[0] = 0;
            double c = closeness(&stepped, &third, &bitwise, why, sizeof why);
            if (home)
                check(bitwise, why,
                      "%s: one step after the load (a resume) equals the uninterrupted run's "
                      "third step bitwise",
                      prefix);
            else
                check(c <= 1, why,
                      "%s: one step after the load is within fp32 tolerance of the "
                      "uninterrupted %s's third step (closeness %.3g%s)",
                      prefix, from, c, bitwise ? ", bitwise" : "");
            if (!home && c > *worst) *worst = c;
            saved_free(&again);
            wlist_free(&full);
            wlist_free(&stepped);
            wlist_free(&am);
            wlist_free(&ao);
        }
    saved_free(&ck);
    wlist_free(&cm);
    wlist_free(&co);
    wlist_free(&third);
}

int main(void) {
    tap_plan_lazy();
    snprintf(tmpdir, sizeof tmpdir, "%s/t_reshard.XXXXXX",
             getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(tmpdir)) {
        printf("Bail out! cannot create a temporary directory\n");
        return 1;
    }
    double worst = 0;
    for (int w = 1; w <= 4; w++)
        for (int s = 0; s < NSTRAT; s++)
            save_and_load_all(w, strategies[s], &worst);
    tap_diag("worst closeness of a step after a load in another cell: %.3g (<= 1 passes)", worst);
    rmdir(tmpdir);
    return tap_done();
}
