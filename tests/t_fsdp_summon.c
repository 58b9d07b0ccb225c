/* SPDX-License-Identifier: MIT */
/*
 * t_fsdp_summon.c: FSDP units outside forward and backward.
 *
 *   F25 summon      the unwrapped model's full parameters; with writeback each element keeps
 *                   the value written by the rank whose shard holds it; without, changes are
 *                   discarded except under NO_SHARD (fsdp-reference 1.12); recurse=false; the
 *                   refusals; training afterwards uses the written values;
 *   rank0_only      full parameters on rank 0 only; with writeback FSDP_EINVAL, unit usable;
 *   offload_to_cpu  the copy is in FSDP_MEM_OFFLOAD, FSDP_MEM_PARAMS keeps no full copy;
 *   with_grads      gradients equal DDP's (fp32 tol); the documented errors;
 *   unshard/reshard a submodule runs as unwrapped; the unit's own module is refused; reshard
 *                   keeps this rank's part of a change;
 *   sync_module_states  ranks built differently end up with rank 0's parameters and buffers;
 *   F19             every unit IDLE after a backward that follows a summon.
 *
 * Ranks are threads of a sim run (world 2, and 3 for uneven padding). The rank functions record
 * checks per rank and fu_run_job() prints one TAP line per check (see fsdp_util.h). F05/F06
 * (memory) and F14 (ignored modules) are in t_fsdp_memory.c.
 *
 * Two regressions are covered: a refused fsdp_summon_begin (the unit already summoned) must
 * leave the summon in progress alone, and with use_orig_params, once every original gradient
 * is set to none, with_grads must not show the old flat gradient.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "models/models.h"
#include "tap.h"

/* Every job of this file; only sync_module_states uses the value arrays. */
typedef struct job {
    fu_job_t base; /* first: rank functions get &base and cast back */
    /* sync_module_states: each rank's values before wrapping */
    fu_vals_t params[FU_MAXR], bufs[FU_MAXR];
} job_t;

/* ---- values ---------------------------------------------------------------------------------- */

/* The full parameters (or, with_grads, their gradients) of root's tree, read under summon. */
static int full_values(fsdp_unit_t *root, bool with_grads, fu_vals_t *out) {
    fsdp_summon_options_t so;
    fsdp_summon_options_init(&so);
    so.writeback = false;
    so.with_grads = with_grads;
    int rc = fsdp_summon_begin(root, &so);
    if (rc < 0) return rc;
    rc = fu_module_values(fsdp_unit_module(root), false, with_grads, out);
    int rc2 = fsdp_summon_end(root);
    return rc ? rc : rc2;
}

/* The first index where got and want differ beyond rtol/atol (0, 0: bitwise), got->n when they
 * agree, SIZE_MAX when their sizes differ. */
static size_t vdiff(const fu_vals_t *got, const fu_vals_t *want, double rtol, double atol) {
    if (got->n != want->n) return SIZE_MAX;
    size_t d = 0;
    while (d < got->n &&
           (got->v[d] == want->v[d] || fu_closeness(got->v[d], want->v[d], rtol, atol) <= 1))
        d++;
    return d;
}

static bool ck_close(fu_res_t *r, const fu_vals_t *got, const fu_vals_t *want, double rtol,
                     double atol, const char *name) {
    size_t d = vdiff(got, want, rtol, atol);
    bool in = d < got->n;
    return fu_ck(r, d == got->n, name,
                 "%zu values, want %zu; first difference at %zu: %.9g vs %.9g", got->n, want->n, d,
                 in ? got->v[d] : 0.0, in ? want->v[d] : 0.0);
}

/* The value a rank tagged `tag` writes into element e of parameter p. */
static float pat(size_t p, int64_t e, int tag) {
    return (float)(0.25 * tag + 0.01 * (double)p + 1e-4 * (double)(e % 101));
}

/* What store() writes: the values of src in order, or with src NULL pat(p, e, tag). */
typedef struct store_arg {
    const fu_vals_t *src;
    int tag;
} store_arg_t;

static int store_val(void *arg, size_t p, int64_t e, size_t k, float *v) {
    const store_arg_t *a = arg;
    if (a->src && k >= a->src->n) return FSDP_EINVAL;
    *v = a->src ? (float)a->src->v[k] : pat(p, e, a->tag);
    return FSDP_OK;
}

/* Writes into m's parameters (full tensors while summoned), in named order: the values of src,
 * or with src NULL pat(p, e, tag). */
static int store(fsdp_module_t *m, const fu_vals_t *src, int tag) {
    return fu_store_params(m, store_val, &(store_arg_t){src, tag});
}

/* ---- units ----------------------------------------------------------------------------------- */

/* Where a parameter (an original object, listed outside summon) lies in its unit. */
typedef struct place {
    const fsdp_unit_t *unit; /* NULL: no unit manages it */
    bool sharded;            /* the unit's layout spans the group (not NO_SHARD) */
    int64_t offset;          /* in the unsharded flat parameter */
    int64_t shard_numel, numel;
    int64_t intra_start; /* first element this rank's shard holds */
    int64_t numel_in_shard;
} place_t;

static int places(const fsdp_unit_t *root, const fsdp_named_list_t *l, place_t *out) {
    fsdp_unit_t **units = NULL;
    size_t nu = 0;
    int rc = fsdp_units(root, &units, &nu);
    memset(out, 0, l->n * sizeof *out);
    for (size_t u = 0; u < nu && rc == 0; u++) {
        fsdp_flat_sizes_t fs;
        fsdp_unit_flat_sizes(units[u], &fs);
        for (size_t i = 0; i < fsdp_unit_num_params(units[u]) && rc == 0; i++) {
            fsdp_param_info_t pi;
            rc = fsdp_unit_param_info(units[u], i, &pi);
            for (size_t k = 0; k < l->n && rc == 0; k++)
                if (l->tensors[k] == pi.param)
                    out[k] =
                        (place_t){units[u],         fs.world > 1, pi.offset,
                                  fs.shard_numel,   pi.numel,     pi.in_shard ? pi.intra_start : 0,
                                  pi.numel_in_shard};
        }
    }
    free(units);
    return rc;
}

/* The rank whose shard holds element e of parameter p (self for an unsharded layout). */
static int owner(const place_t *p, int64_t e, int self) {
    return p->sharded ? (int)((p->offset + e) / p->shard_numel) : self;
}

/* ---- NestedWrappedModule fixture ------------------------------------------------------------- */

typedef struct fx {
    fsdp_module_t *m, *ref; /* the wrapped model, an unwrapped deterministic copy */
    fsdp_unit_t *root;
    fsdp_named_list_t l; /* m's original parameter objects */
    place_t *pl;
} fx_t;

/* NestedWrappedModule with upstream's units (module.1.0, module.1, module.2, then the root). */
static int fx_init(fsdp_ctx_t *ctx, fsdp_sharding_strategy_t s, bool orig, fx_t *f) {
    static const char *const inner[] = {"module.1.0", "module.1", "module.2", NULL};
    fsdp_options_t o;
    fsdp_options_init(&o);
    o.strategy = s;
    o.use_orig_params = orig;
    o.check_exec_order = true;
    int rc = tm_nested_wrapped_create(ctx, true, &f->ref);
    if (rc == 0) rc = tm_nested_wrapped_create(ctx, true, &f->m);
    if (rc == 0) rc = fu_wrap_listed(f->m, inner, &o, NULL, NULL);
    if (rc == 0) rc = fsdp_wrap(f->m, &o, &f->root);
    if (rc == 0) rc = fsdp_module_named_params(f->m, false, &f->l);
    if (rc == 0 && !(f->pl = calloc(f->l.n, sizeof *f->pl))) rc = FSDP_ENOMEM;
    if (rc == 0) rc = places(f->root, &f->l, f->pl);
    return rc;
}

static void fx_fini(fx_t *f) {
    free(f->pl);
    fsdp_named_list_free(&f->l);
    fsdp_unit_destroy(f->root);
    fsdp_module_release(f->m);
    fsdp_module_release(f->ref);
}

/* m on this rank's input (rand(4, 8) seeded 1 + rank): without loss a no-grad forward (output
 * into *y when y is not NULL), with loss a forward and the backward of sum(m(x)). */
static int fx_run(fsdp_ctx_t *ctx, fsdp_module_t *m, fu_vals_t *y, bool loss) {
    fsdp_tensor_t *x = NULL, *out = NULL, *l = NULL;
    bool was = fsdp_set_grad_enabled(ctx, loss);
    int rc = tm_nested_wrapped_get_input(ctx, &x);
    if (rc == 0) rc = fsdp_module_forward1(m, x, &out);
    if (rc == 0 && y) rc = fu_list_values(&(fsdp_named_list_t){.n = 1, .tensors = &out}, false, y);
    if (rc == 0 && loss) rc = tm_sum_loss(out, &l);
    if (rc == 0 && loss) rc = fsdp_backward(l, NULL);
    fsdp_set_grad_enabled(ctx, was);
    fsdp_tensor_release(l);
    fsdp_tensor_release(out);
    fsdp_tensor_release(x);
    return rc;
}

/* Loads the wrapped model's full parameters into ref; a no-grad forward of both must agree. */
static int ck_forward(fu_res_t *r, fsdp_ctx_t *ctx, fx_t *f, const char *name) {
    fu_vals_t v = {0}, a = {0}, b = {0};
    int rc = full_values(f->root, false, &v);
    if (rc == 0) rc = store(f->ref, &v, 0);
    if (rc == 0) rc = fx_run(ctx, f->m, &a, false);
    if (rc == 0) rc = fx_run(ctx, f->ref, &b, false);
    if (rc == 0) ck_close(r, &a, &b, FU_F32_RTOL, FU_F32_ATOL, name);
    fu_vals_free(&v);
    fu_vals_free(&a);
    fu_vals_free(&b);
    return rc;
}

/* The full parameters must hold, per element, the tag of its owner for sharded units (the last
 * writeback) and self_tag elsewhere; prefix: only parameters whose name starts with it, indexed
 * from 0 among them as store() on that submodule does. */
static int ck_tags(fu_res_t *r, fx_t *f, const char *prefix, int self_tag, const char *name) {
    fu_vals_t v = {0};
    int rc = full_values(f->root, false, &v);
    char why[300] = "";
    size_t k = 0, q = 0;
    for (size_t p = 0; p < f->l.n && rc == 0 && !why[0]; k += (size_t)f->pl[p].numel, p++) {
        if (strncmp(f->l.names[p], prefix, strlen(prefix)) != 0) continue;
        for (int64_t e = 0; e < f->pl[p].numel && !why[0]; e++) {
            int tag = owner(&f->pl[p], e, self_tag);
            double want = pat(q, e, tag), got = k + (size_t)e < v.n ? v.v[k + (size_t)e] : NAN;
            if (got != want)
                snprintf(why, sizeof why, "'%s'[%lld] is %.9g, want %.9g (tag %d)", f->l.names[p],
                         (long long)e, got, want, tag);
        }
        q++;
    }
    if (rc == 0) fu_ck(r, !why[0], name, "%s", why);
    fu_vals_free(&v);
    return rc;
}

/* ---- F25: summon, writeback, recurse --------------------------------------------------------- */

static int summon_rank(fsdp_ctx_t *ctx, void *arg) {
    job_t *j = arg;
    int rank = fsdp_ctx_rank(ctx), rc = 0;
    fu_res_t *r = fu_res_of(&j->base, ctx);
    fx_t f = {0};
    fu_vals_t v = {0}, rv = {0};
    bool sharded = j->base.strategy != FSDP_NO_SHARD;
    fsdp_summon_options_t so;
    fsdp_named_list_t s = {0};

    FU_TRY(out, "wrapping", fx_init(ctx, j->base.strategy, false, &f));
    FU_TRY(out, "summon", full_values(f.root, false, &v));
    FU_TRY(out, "reference", fu_module_values(f.ref, false, false, &rv));
    ck_close(r, &v, &rv, 0, 0, "F25: summoned parameters are the unwrapped model's");
    fu_ck(r, v.n == TM_NESTED_NUM_PARAMS, "F25: summoned parameters are full size", "%zu", v.n);

    /* writeback on: every rank writes its own values and keeps only its part. */
    FU_TRY(out, "summon", fsdp_summon_begin(f.root, NULL));
    fu_ck(r, fu_tree_in_state(f.root, FSDP_STATE_SUMMON, true),
          "F25: while summoned every unit is SUMMON and unsharded", "%s", "a unit is not");
    FU_TRY(out, "writing under summon", store(f.m, NULL, rank));
    FU_TRY(out, "summon end", fsdp_summon_end(f.root));
    fu_ck(r, fu_tree_idle(f.root), "F25: after the end every unit is IDLE and sharded again", "%s",
          "a unit is still summoned or unsharded");
    FU_TRY(
        out, "reading back",
        ck_tags(r, &f, "", rank,
                sharded
                    ? "F25 writeback: each element keeps the value of the rank whose shard holds it"
                    : "F25 writeback (NO_SHARD): each rank's whole change persists"));

    /* writeback off: discarded, except under NO_SHARD (fsdp-reference 1.12). */
    fsdp_summon_options_init(&so);
    so.writeback = false;
    FU_TRY(out, "summon", fsdp_summon_begin(f.root, &so));
    FU_TRY(out, "writing under summon", store(f.m, NULL, 9));
    FU_TRY(out, "summon end", fsdp_summon_end(f.root));
    FU_TRY(out, "reading back",
           ck_tags(r, &f, "", sharded ? rank : 9,
                   sharded ? "F25 writeback=false: the change is discarded"
                           : "F25 writeback=false (NO_SHARD): the change persists anyway"));

    /* recurse off: the root's parameters show full size, the nested units' their shard views. */
    so.recurse = false;
    FU_TRY(out, "summon recurse=false", fsdp_summon_begin(f.root, &so));
    FU_TRY(out, "listing", fsdp_module_named_params(f.m, false, &s));
    {
        char why[300] = "";
        for (size_t p = 0; p < s.n && !why[0]; p++) {
            const fsdp_unit_t *u = f.pl[p].unit;
            bool full = u == f.root || !sharded;
            int64_t want = full ? f.pl[p].numel : f.pl[p].numel_in_shard;
            if (fsdp_tensor_numel(s.tensors[p]) != want ||
                (!full && s.tensors[p] != f.l.tensors[p]))
                snprintf(why, sizeof why, "'%s' shows %lld elements, want %lld", s.names[p],
                         (long long)fsdp_tensor_numel(s.tensors[p]), (long long)want);
            else if (u != f.root && (fsdp_unit_state(u) != FSDP_STATE_IDLE ||
                                     (sharded && fsdp_unit_is_unsharded(u))))
                snprintf(why, sizeof why, "unit '%s' is summoned or unsharded", fsdp_unit_fqn(u));
        }
        fu_ck(r,
              !why[0] && fsdp_unit_is_unsharded(f.root) &&
                  fsdp_unit_state(f.root) == FSDP_STATE_SUMMON,
              "F25 recurse=false: only the root is summoned; nested units keep their shards", "%s",
              why[0] ? why : "the root is not summoned");
    }
    FU_TRY(out, "summon end", fsdp_summon_end(f.root));

    /* Refusals, then training resumes with the summoned values. */
    so.recurse = true;
    FU_TRY(out, "summon", fsdp_summon_begin(f.root, &so));
    fu_ck_einval(r, ctx, fx_run(ctx, f.m, NULL, false), "summon", NULL,
                 "F25: forward while summoned is FSDP_EINVAL");
    fu_ck_einval(r, ctx, fsdp_summon_begin(f.root, &so), "already", NULL,
                 "F25: summoning a summoned unit is FSDP_EINVAL");
    fu_ck(r, fu_tree_in_state(f.root, FSDP_STATE_SUMMON, true),
          "F25: the refused second begin leaves the first summon in place", "%s",
          "the refused begin ended the summon in progress");
    if (fsdp_unit_state(f.root) == FSDP_STATE_SUMMON)
        FU_TRY(out, "summon end", fsdp_summon_end(f.root));
    fu_ck_einval(r, ctx, fsdp_summon_end(f.root), "without", NULL,
                 "F25: fsdp_summon_end without a begin is FSDP_EINVAL");
    FU_TRY(out, "training after summon", fx_run(ctx, f.m, NULL, true));
    fu_ck(r, fu_tree_idle(f.root), "F19: IDLE after a backward that follows a summon", "%s",
          "not idle");
    FU_TRY(out, "forward",
           ck_forward(r, ctx, &f, "F25: forward after summon uses the written values"));
out:
    fsdp_named_list_free(&s);
    fu_vals_free(&v);
    fu_vals_free(&rv);
    fx_fini(&f);
    return rc < 0 ? rc : 0;
}

/* ---- rank0_only and offload_to_cpu ----------------------------------------------------------- */

static int rank0_offload_rank(fsdp_ctx_t *ctx, void *arg) {
    job_t *j = arg;
    int rank = fsdp_ctx_rank(ctx), rc = 0;
    fu_res_t *r = fu_res_of(&j->base, ctx);
    fx_t f = {0};
    fsdp_named_list_t s = {0};
    fu_vals_t v = {0}, rv = {0};
    fsdp_optim_t *opt = NULL;
    fsdp_summon_options_t so;
    fsdp_mem_stats_t m0, m1;
    fsdp_unit_t **units = NULL;
    size_t nu = 0, all_full = 0, largest = 0;

    FU_TRY(out, "wrapping", fx_init(ctx, FSDP_FULL_SHARD, false, &f));
    FU_TRY(out, "reference", fu_module_values(f.ref, false, false, &rv));
    FU_TRY(out, "listing", fsdp_units(f.root, &units, &nu));
    for (size_t i = 0; i < nu; i++) {
        fsdp_flat_sizes_t fs;
        fsdp_unit_flat_sizes(units[i], &fs);
        size_t b = (size_t)fs.padded_numel * sizeof(float);
        all_full += b;
        largest = b > largest ? b : largest;
    }

    /* rank0_only: rank 0 shows full parameters, the others their shard views. */
    fsdp_summon_options_init(&so);
    so.rank0_only = true;
    so.writeback = false;
    FU_TRY(out, "summon rank0_only", fsdp_summon_begin(f.root, &so));
    FU_TRY(out, "listing", fsdp_module_named_params(f.m, false, &s));
    {
        char why[300] = "";
        for (size_t p = 0; p < s.n && !why[0]; p++) {
            int64_t want = rank == 0 ? f.pl[p].numel : f.pl[p].numel_in_shard;
            if (fsdp_tensor_numel(s.tensors[p]) != want ||
                (rank != 0) != (s.tensors[p] == f.l.tensors[p]))
                snprintf(why, sizeof why, "'%s' shows %lld elements (%s), want %lld", s.names[p],
                         (long long)fsdp_tensor_numel(s.tensors[p]),
                         s.tensors[p] == f.l.tensors[p] ? "the shard view" : "a full tensor",
                         (long long)want);
        }
        fu_ck(r, !why[0] && fsdp_unit_is_unsharded(f.root) == (rank == 0),
              "rank0_only: rank 0 sees full parameters, other ranks keep their shards", "%s",
              why[0] ? why : "the root's unsharded state is wrong");
    }
    FU_TRY(out, "reading", fu_list_values(&s, false, &v));
    size_t d = vdiff(&v, &rv, 0, 0);
    fu_ck(r, rank != 0 || d == v.n,
          "rank0_only: rank 0's full parameters are the unwrapped model's",
          "first difference at %zu", d);
    FU_TRY(out, "summon end", fsdp_summon_end(f.root));

    /* rank0_only with writeback is refused and leaves the unit usable. */
    so.writeback = true;
    fu_ck_einval(r, ctx, fsdp_summon_begin(f.root, &so), "rank0_only", NULL,
                 "rank0_only with writeback is FSDP_EINVAL naming rank0_only");
    fu_ck(r, fu_tree_idle(f.root), "rank0_only with writeback leaves every unit IDLE and sharded",
          "%s", "a unit was left summoned or unsharded");
    FU_TRY(out, "parameters after the refusal", full_values(f.root, false, &v));
    ck_close(r, &v, &rv, 0, 0, "rank0_only with writeback changes no parameter");
    FU_TRY(
        out, "forward after the refusal",
        ck_forward(r, ctx, &f, "rank0_only with writeback: a later forward is the unwrapped one"));
    {
        FU_TRY(out, "SGD", fu_make_fsdp_sgd(ctx, f.root, 0.05, 0.0, &opt));
        FU_TRY(out, "training after the refusal", fx_run(ctx, f.m, NULL, true));
        FU_TRY(out, "step after the refusal", fsdp_optim_step(opt));
        FU_TRY(out, "parameters after the step", full_values(f.root, false, &v));
        fu_ck(r, vdiff(&v, &rv, 0, 0) < v.n && fu_tree_idle(f.root),
              "rank0_only with writeback: a later step works", "%s",
              "the step changed nothing or a unit is not IDLE");
    }

    /* offload_to_cpu: the shown copy is host memory; device parameters keep only the shards. */
    FU_TRY(out, "parameters", full_values(f.root, false, &rv));
    for (int r0 = 0; r0 < 2; r0++) {
        fsdp_summon_options_init(&so);
        so.offload_to_cpu = true;
        so.writeback = false;
        so.rank0_only = r0;
        fsdp_mem_get_stats(ctx, &m0);
        fsdp_mem_reset_peaks(ctx);
        FU_TRY(out, "summon offload_to_cpu", fsdp_summon_begin(f.root, &so));
        fsdp_mem_get_stats(ctx, &m1);
        size_t want = r0 && rank != 0 ? 0 : all_full;
        size_t off = m1.current[FSDP_MEM_OFFLOAD] - m0.current[FSDP_MEM_OFFLOAD];
        fu_ck(r, m1.current[FSDP_MEM_OFFLOAD] >= m0.current[FSDP_MEM_OFFLOAD] && off == want,
              r0 ? "offload_to_cpu+rank0_only: only rank 0 holds the full copy in FSDP_MEM_OFFLOAD"
                 : "offload_to_cpu: the full parameters are counted in FSDP_MEM_OFFLOAD",
              "%zu offloaded bytes more, want %zu", off, want);
        fu_ck(r,
              m1.current[FSDP_MEM_PARAMS] == m0.current[FSDP_MEM_PARAMS] &&
                  m1.peak[FSDP_MEM_PARAMS] <= m0.current[FSDP_MEM_PARAMS] + largest,
              r0 ? "offload_to_cpu+rank0_only: device parameter bytes do not grow"
                 : "offload_to_cpu: device parameter bytes do not grow by the full size",
              "params %zu -> %zu (peak %zu), largest unit %zu bytes", m0.current[FSDP_MEM_PARAMS],
              m1.current[FSDP_MEM_PARAMS], m1.peak[FSDP_MEM_PARAMS], largest);
        if (!r0) {
            FU_TRY(out, "reading", fu_module_values(f.m, false, false, &v));
            ck_close(r, &v, &rv, 0, 0, "offload_to_cpu: the host copy holds the full parameters");
        }
        FU_TRY(out, "summon end", fsdp_summon_end(f.root));
        fsdp_mem_get_stats(ctx, &m1);
        fu_ck(
            r,
            m1.current[FSDP_MEM_OFFLOAD] == m0.current[FSDP_MEM_OFFLOAD] &&
                m1.current[FSDP_MEM_PARAMS] == m0.current[FSDP_MEM_PARAMS] && fu_tree_idle(f.root),
            r0 ? "offload_to_cpu+rank0_only: memory back to before after the end"
               : "offload_to_cpu: memory back to before after the end",
            "offload %zu -> %zu, params %zu -> %zu", m0.current[FSDP_MEM_OFFLOAD],
            m1.current[FSDP_MEM_OFFLOAD], m0.current[FSDP_MEM_PARAMS], m1.current[FSDP_MEM_PARAMS]);
    }
    /* offload_to_cpu with writeback: each rank's part of the host copy goes back to its shard. */
    fsdp_summon_options_init(&so);
    so.offload_to_cpu = true;
    FU_TRY(out, "summon offload_to_cpu", fsdp_summon_begin(f.root, &so));
    FU_TRY(out, "writing under summon", store(f.m, NULL, rank));
    FU_TRY(out, "summon end", fsdp_summon_end(f.root));
    FU_TRY(out, "reading back",
           ck_tags(r, &f, "", rank,
                   "offload_to_cpu writeback: each element keeps the value of the rank whose shard "
                   "holds it"));
out:
    free(units);
    fu_vals_free(&v);
    fu_vals_free(&rv);
    fsdp_named_list_free(&s);
    fsdp_optim_destroy(opt);
    fx_fini(&f);
    return rc < 0 ? rc : 0;
}

/* ---- with_grads against DDP ------------------------------------------------------------------ */

static int with_grads_rank(fsdp_ctx_t *ctx, void *arg) {
    job_t *j = arg;
    int rc = 0;
    fu_res_t *r = fu_res_of(&j->base, ctx);
    fx_t f = {0}, nf = {0};
    fsdp_module_t *dm = NULL;
    fsdp_ddp_t *ddp = NULL;
    fsdp_tensor_t *x = NULL, *y = NULL, *loss = NULL;
    fu_vals_t g = {0}, dg = {0};
    fsdp_summon_options_t so;

    FU_TRY(out, "wrapping (use_orig_params)", fx_init(ctx, FSDP_FULL_SHARD, true, &f));
    FU_TRY(out, "building the DDP reference", tm_nested_wrapped_create(ctx, true, &dm));
    FU_TRY(out, "creating DDP", fsdp_ddp_create(dm, NULL, NULL, &ddp));
    /* The same per-rank input through both; DDP all-reduces, FSDP reduce-scatters. */
    FU_TRY(out, "input", tm_nested_wrapped_get_input(ctx, &x));
    FU_TRY(out, "DDP forward", fsdp_ddp_forward1(ddp, x, &y));
    FU_TRY(out, "DDP loss", tm_sum_loss(y, &loss));
    FU_TRY(out, "DDP backward", fsdp_backward(loss, NULL));
    FU_TRY(out, "DDP gradients", fu_module_values(dm, false, true, &dg));
    FU_TRY(out, "FSDP forward and backward", fx_run(ctx, f.m, NULL, true));

    FU_TRY(out, "summon with_grads", full_values(f.root, true, &g));
    ck_close(r, &g, &dg, FU_F32_RTOL, FU_F32_ATOL,
             "with_grads: summoned gradients equal DDP's (fp32 tol)");
    {
        /* The original parameters' gradients are views of their part of the sharded gradient. */
        char why[300] = "";
        size_t base = 0;
        for (size_t p = 0; p < f.l.n && !why[0]; base += (size_t)f.pl[p].numel, p++) {
            fsdp_tensor_t *gr = fsdp_tensor_grad(f.l.tensors[p]);
            int64_t k = f.pl[p].numel_in_shard;
            /* A parameter with no local elements has no gradient (PyTorch's None). */
            if (k == 0 ? gr != NULL : !gr || fsdp_tensor_numel(gr) != k)
                snprintf(why, sizeof why, "'%s': gradient of %lld elements, want %s%lld",
                         f.l.names[p], gr ? (long long)fsdp_tensor_numel(gr) : -1LL,
                         k == 0 ? "none (-1), not " : "", (long long)k);
            for (int64_t e = 0; e < k && !why[0]; e++) {
                double a = NAN, b = dg.v[base + (size_t)(f.pl[p].intra_start + e)];
                fsdp_tensor_item(gr, e, &a);
                if (!(fu_closeness(a, b, FU_F32_RTOL, FU_F32_ATOL) <= 1))
                    snprintf(why, sizeof why, "'%s'[%lld]: %.9g, DDP %.9g", f.l.names[p],
                             (long long)(f.pl[p].intra_start + e), a, b);
            }
        }
        fu_ck(r, !why[0],
              "with_grads: afterwards each rank's gradient views hold its part of DDP's", "%s",
              why);
    }

    /* Documented errors. */
    fsdp_summon_options_init(&so);
    so.with_grads = true;
    so.writeback = false;
    so.offload_to_cpu = true;
    fu_ck_einval(r, ctx, fsdp_summon_begin(f.root, &so), "offload_to_cpu", NULL,
                 "with_grads with offload_to_cpu is FSDP_EINVAL naming offload_to_cpu");
    fu_ck(r, fu_tree_idle(f.root), "with_grads: the refusal leaves every unit IDLE and sharded",
          "%s", "a unit is not");
    so.offload_to_cpu = false;
    FU_TRY(out, "wrapping without use_orig_params", fx_init(ctx, FSDP_FULL_SHARD, false, &nf));
    fu_ck_einval(r, ctx, fsdp_summon_begin(nf.root, &so), "use_orig_params", NULL,
                 "with_grads without use_orig_params is FSDP_EINVAL naming use_orig_params");

    /* zero_grad(set_to_none) on every original parameter: "zeros where a rank has none". */
    FU_TRY(out, "zero_grad", fsdp_module_zero_grad(f.m, true));
    FU_TRY(out, "summon with_grads", full_values(f.root, true, &g));
    {
        size_t d = 0;
        while (d < g.n && (g.v[d] == 0.0 || isnan(g.v[d])))
            d++;
        fu_ck(r, d == g.n, "with_grads after zero_grad(set_to_none) shows no stale gradient",
              "element %zu of the summoned gradients is %.9g", d, d < g.n ? g.v[d] : 0.0);
    }
out:
    fu_vals_free(&g);
    fu_vals_free(&dg);
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    fsdp_tensor_release(loss);
    fsdp_ddp_destroy(ddp);
    fsdp_module_release(dm);
    fx_fini(&nf);
    fx_fini(&f);
    return rc < 0 ? rc : 0;
}

/* ---- explicit unshard and reshard ------------------------------------------------------------ */

static int unshard_rank(fsdp_ctx_t *ctx, void *arg) {
    job_t *j = arg;
    int rank = fsdp_ctx_rank(ctx), rc = 0;
    fu_res_t *r = fu_res_of(&j->base, ctx);
    fx_t f = {0};
    fsdp_unit_t *u = NULL, *inner = NULL;
    fsdp_tensor_t *x = NULL, *y = NULL;
    fu_vals_t a = {0}, b = {0};
    bool was = true;

    FU_TRY(out, "wrapping", fx_init(ctx, FSDP_FULL_SHARD, false, &f));
    u = fsdp_unit_of(fsdp_module_child(f.m, "module.1"));
    inner = fsdp_unit_of(fsdp_module_child(f.m, "module.1.0"));
    if (!fu_ck(r, u && inner, "units module.1 and module.1.0 exist", "%s", "missing")) goto out;

    fu_ck_einval(r, ctx, fsdp_unit_reshard(u), "without", NULL,
                 "fsdp_unit_reshard without fsdp_unit_unshard is FSDP_EINVAL");
    FU_TRY(out, "fsdp_unit_unshard", fsdp_unit_unshard(u));
    fu_ck(r,
          fsdp_unit_is_unsharded(u) && !fsdp_unit_is_unsharded(inner) &&
              !fsdp_unit_is_unsharded(f.root) && fsdp_unit_state(inner) == FSDP_STATE_IDLE,
          "fsdp_unit_unshard unshards the given unit only", "module.1 %d, module.1.0 %d, root %d",
          fsdp_unit_is_unsharded(u), fsdp_unit_is_unsharded(inner), fsdp_unit_is_unsharded(f.root));
    fu_ck_einval(r, ctx, fsdp_unit_unshard(u), "already", NULL,
                 "fsdp_unit_unshard of an unsharded unit is FSDP_EINVAL");

    /* module.1.1 (Linear(16, 16)) belongs to unit module.1 but is not its module: it runs. */
    was = fsdp_set_grad_enabled(ctx, false);
    rc = fu_rand_input(ctx, 77 + (uint64_t)rank, 4, 16, &x);
    for (int k = 0; k < 2 && rc == 0; k++) {
        rc = fsdp_module_forward1(fsdp_module_child(k ? f.ref : f.m, "module.1.1"), x, &y);
        if (rc == 0)
            rc = fu_list_values(&(fsdp_named_list_t){.n = 1, .tensors = &y}, false, k ? &b : &a);
        fsdp_tensor_release(y);
        y = NULL;
    }
    if (rc == 0)
        ck_close(r, &a, &b, FU_F32_RTOL, FU_F32_ATOL,
                 "a submodule of an unsharded unit equals the unwrapped one");
    rc = fsdp_module_forward1(fsdp_module_child(f.m, "module.1"), x, &y);
    fu_ck_einval(r, ctx, rc, "module.1", NULL,
                 "running the unsharded unit's own module is FSDP_EINVAL naming the unit");
    fu_ck_einval(r, ctx, fx_run(ctx, f.m, NULL, false), "module.1", NULL,
                 "running the root while a unit is unsharded is FSDP_EINVAL naming the unit");
    fsdp_set_grad_enabled(ctx, was);

    /* Every rank writes its own values; reshard keeps this rank's part. */
    FU_TRY(out, "writing", store(fsdp_module_child(f.m, "module.1.1"), NULL, rank));
    FU_TRY(out, "fsdp_unit_reshard", fsdp_unit_reshard(u));
    fu_ck(r, fu_tree_idle(f.root), "after fsdp_unit_reshard every unit is IDLE and sharded", "%s",
          "not");
    FU_TRY(out, "reading back",
           ck_tags(r, &f, "module.1.1.", rank,
                   "fsdp_unit_reshard writes this rank's part of a change back"));
    FU_TRY(out, "training after reshard", fx_run(ctx, f.m, NULL, true));
    FU_TRY(out, "forward",
           ck_forward(r, ctx, &f, "a forward after reshard uses the written values"));
out:
    fu_vals_free(&a);
    fu_vals_free(&b);
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    fx_fini(&f);
    return rc < 0 ? rc : 0;
}

/* ---- sync_module_states ---------------------------------------------------------------------- */

static int sync_rank(fsdp_ctx_t *ctx, void *arg) {
    job_t *j = arg;
    int rank = fsdp_ctx_rank(ctx), rc = 0;
    fu_res_t *r = fu_res_of(&j->base, ctx);
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_named_list_t bl = {0};
    fu_vals_t v = {0};

    /* Different seeds, and every buffer filled with rank-dependent values. */
    tm_manual_seed(ctx, 1000 + (uint64_t)rank);
    FU_TRY(out, "building TransformerWithSharedParams",
           tm_transformer_create(ctx, true, false, &m));
    FU_TRY(out, "listing buffers", fsdp_module_named_buffers(m, false, &bl));
    for (size_t i = 0; i < bl.n; i++) {
        bool fl = fsdp_dtype_is_float(fsdp_tensor_dtype(bl.tensors[i]));
        FU_TRY(
            out, "filling buffers",
            fsdp_tensor_fill_(bl.tensors[i], fl ? 0.5 * (rank + 1) + (double)i : 3.0 * rank + i));
    }
    FU_TRY(out, "reading", fu_module_values(m, false, false, &j->params[rank]));
    FU_TRY(out, "reading", fu_module_values(m, true, false, &j->bufs[rank]));
    FU_TRY(out, "barrier", fsdp_pg_barrier(fsdp_ctx_pg(ctx), NULL));
    fu_ck(r,
          rank == 0 || (vdiff(&j->params[rank], &j->params[0], 0, 0) < j->params[0].n &&
                        vdiff(&j->bufs[rank], &j->bufs[0], 0, 0) < j->bufs[0].n),
          "before wrapping the ranks' parameters and buffers differ", "%s",
          "this rank starts equal to rank 0: the test would prove nothing");

    fsdp_options_t o;
    fsdp_options_init(&o);
    o.sync_module_states = true;
    o.check_exec_order = true;
    FU_TRY(out, "wrapping with sync_module_states", fu_wrap_transformer_opts(m, &o, &root));
    FU_TRY(out, "reading full parameters", full_values(root, false, &v));
    ck_close(r, &v, &j->params[0], 0, 0, "every rank's full parameters are rank 0's");
    FU_TRY(out, "reading buffers", fu_module_values(m, true, false, &v));
    ck_close(r, &v, &j->bufs[0], 0, 0, "every rank's buffers (float and int64) are rank 0's");
out:
    fu_vals_free(&v);
    fsdp_named_list_free(&bl);
    fsdp_unit_destroy(root);
    fsdp_module_release(m);
    return rc < 0 ? rc : 0;
}

/* ---- main ---------------------------------------------------------------------------------- */

/* Runs fn as job `prefix` on `world` ranks (strategy s), then frees the values it kept. */
static void run(const char *prefix, int world, fsdp_sharding_strategy_t s, fsdp_sim_fn fn) {
    static job_t j; /* large: off the stack */
    memset(&j, 0, sizeof j);
    fu_job_init(&j.base, prefix, world, s, false); /* the rank functions read world, strategy */
    fu_run_job(&j.base, fn);
    for (int r = 0; r < FU_MAXR; r++) {
        fu_vals_free(&j.params[r]);
        fu_vals_free(&j.bufs[r]);
    }
}

int main(void) {
    char prefix[64];
    tap_plan_lazy();
    for (int w = 2; w <= 3; w++) {
        for (size_t s = 0; s < sizeof fu_strategies / sizeof *fu_strategies; s++) {
            snprintf(prefix, sizeof prefix, "summon %s",
                     fsdp_sharding_strategy_name(fu_strategies[s]));
            run(prefix, w, fu_strategies[s], summon_rank);
        }
        run("rank0_only/offload_to_cpu", w, FSDP_FULL_SHARD, rank0_offload_rank);
        run("with_grads", w, FSDP_FULL_SHARD, with_grads_rank);
        run("unshard/reshard", w, FSDP_FULL_SHARD, unshard_rank);
        run("sync_module_states", w, FSDP_FULL_SHARD, sync_rank);
    }
    return tap_done();
}
