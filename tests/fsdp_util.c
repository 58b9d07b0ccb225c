/* SPDX-License-Identifier: MIT */
/*
 * fsdp_util.c: helpers shared by the FSDP unit tests (see fsdp_util.h).
 *
 * Nothing here checks a behaviour by itself: the helpers build, run and compare, and the test
 * programs decide what must hold. Helpers that run a model are collective exactly when the
 * library calls they make are.
 */
#include "fsdp_util.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/models.h"
#include "tap.h"

const fsdp_sharding_strategy_t fu_strategies[3] = {FSDP_FULL_SHARD, FSDP_SHARD_GRAD_OP,
                                                   FSDP_NO_SHARD};
const fsdp_backward_prefetch_t fu_bwd_prefetches[3] = {FSDP_BACKWARD_PREFETCH_NONE,
                                                       FSDP_BACKWARD_PRE, FSDP_BACKWARD_POST};

/* ---- per-rank check lists -------------------------------------------------------------------- */

void fu_job_init(fu_job_t *j, const char *prefix, int world, fsdp_sharding_strategy_t s,
                 bool orig) {
    memset(j, 0, sizeof *j);
    snprintf(j->prefix, sizeof j->prefix, "%s", prefix);
    j->world = world;
    j->strategy = s;
    j->bp = FSDP_BACKWARD_PRE;
    j->orig = orig;
    fsdp_mixed_precision_init(&j->mp);
    j->seed = 5;
}

fu_job_t *fu_job_new(const char *prefix, int world, fsdp_sharding_strategy_t s, bool orig) {
    fu_job_t *j = malloc(sizeof *j);
    if (!j) tap_bail("out of memory");
    fu_job_init(j, prefix, world, s, orig);
    return j;
}

void fu_job_options(const fu_job_t *j, fsdp_options_t *o) {
    fsdp_options_init(o);
    o->strategy = j->strategy;
    o->backward_prefetch = j->bp;
    o->forward_prefetch = j->fwd_prefetch;
    o->use_orig_params = j->orig;
    o->cpu_offload = j->offload;
    o->mixed_precision = j->mp;
    o->check_exec_order = true;
}

fu_res_t *fu_res_of(fu_job_t *j, fsdp_ctx_t *ctx) {
    return &j->r[fsdp_ctx_rank(ctx)];
}

bool fu_ck(fu_res_t *r, bool ok, const char *name, const char *fmt, ...) {
    if (r->n >= FU_MAXC) return ok;
    fu_rec_t *c = &r->c[r->n++];
    snprintf(c->name, sizeof c->name, "%s", name);
    c->ok = ok;
    c->why[0] = 0;
    if (!ok) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->why, sizeof c->why, fmt, ap);
        va_end(ap);
    }
    return ok;
}

int fu_fatal(fu_res_t *r, fsdp_ctx_t *ctx, const char *what, int rc) {
    fu_ck(r, false, what, "%s: %s (%s)", fsdp_err_name(rc), fsdp_strerror(rc),
          fsdp_ctx_last_error(ctx));
    return rc < 0 ? rc : FSDP_EINTERNAL;
}

void fu_ck_einval(fu_res_t *r, fsdp_ctx_t *ctx, int rc, const char *k1, const char *k2,
                  const char *name) {
    const char *msg = fsdp_ctx_last_error(ctx);
    fu_ck(r, rc == FSDP_EINVAL && msg && strstr(msg, k1) && (!k2 || strstr(msg, k2)), name,
          "rc %s, message \"%s\"; want EINVAL naming \"%s\"%s%s", fsdp_err_name(rc), msg ? msg : "",
          k1, k2 ? " and " : "", k2 ? k2 : "");
}

void fu_run_job(fu_job_t *j, fsdp_sim_fn fn) {
    fsdp_sim_options_t so;
    fsdp_sim_options_init(&so);
    so.world_size = j->world;
    so.seed = j->seed;
    so.timeout_ms = 60000;
    int st[FU_MAXR] = {0};
    for (int r = 0; r < FU_MAXR; r++)
        j->r[r].n = 0;
    int rc = fsdp_sim_run(&so, fn, j, st);
    fu_report_job(j, rc, st);
}

void fu_report_job(const fu_job_t *j, int rc, const int *st) {
    int n = 0;
    for (int r = 0; r < j->world; r++)
        if (j->r[r].n > n) n = j->r[r].n;
    for (int i = 0; i < n; i++) {
        const char *name = NULL;
        bool ok = true;
        for (int r = 0; r < j->world; r++) {
            if (i >= j->r[r].n) {
                ok = false;
                continue;
            }
            if (!name) name = j->r[r].c[i].name;
            ok &= j->r[r].c[i].ok;
        }
        if (!ok)
            for (int r = 0; r < j->world; r++) {
                if (i >= j->r[r].n)
                    tap_diag("rank %d did not get to this check", r);
                else if (!j->r[r].c[i].ok)
                    tap_diag("rank %d: %s", r, j->r[r].c[i].why);
            }
        tap_ok(ok, "%s W=%d: %s", j->prefix, j->world, name ? name : "?");
    }
    bool done = rc == 0;
    for (int r = 0; r < j->world; r++) {
        if (st[r] != 0) tap_diag("rank %d returned %s", r, fsdp_err_name(st[r]));
        done &= st[r] == 0;
    }
    tap_ok(done, "%s W=%d: every rank ran to the end without a library error", j->prefix, j->world);
}

void fu_run(const char *prefix, int world, fsdp_sharding_strategy_t s, bool orig, fsdp_sim_fn fn) {
    fu_job_t *j = fu_job_new(prefix, world, s, orig);
    fu_run_job(j, fn);
    free(j);
}

void fu_add_why(char *why, size_t len, const char *fmt, ...) {
    size_t used = strlen(why);
    if (used + 8 >= len) return;
    if (used) {
        snprintf(why + used, len - used, "; ");
        used += 2;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why + used, len - used, fmt, ap);
    va_end(ap);
}

/* ---- comparing values ------------------------------------------------------------------------ */

double fu_closeness(double actual, double expected, double rtol, double atol) {
    return fabs(actual - expected) / (atol + rtol * fabs(expected));
}

float *fu_host_f32(const fsdp_tensor_t *t, int64_t *n) {
    *n = fsdp_tensor_numel(t);
    float *v = malloc((size_t)(*n > 0 ? *n : 1) * sizeof *v);
    if (!v) return NULL;
    if (fsdp_tensor_dtype(t) == FSDP_DTYPE_F32) {
        if (fsdp_tensor_to_host(t, v, (size_t)*n * sizeof *v) < 0) {
            free(v);
            v = NULL;
        }
        return v;
    }
    /* f16 and bf16 widen exactly; element reads record nothing on the tape. */
    for (int64_t i = 0; i < *n; i++) {
        double d;
        if (fsdp_tensor_item(t, i, &d) < 0) {
            free(v);
            return NULL;
        }
        v[i] = (float)d;
    }
    return v;
}

int fu_same_bits(const fsdp_tensor_t *a, const fsdp_tensor_t *b) {
    int64_t na, nb;
    float *x = fu_host_f32(a, &na), *y = fu_host_f32(b, &nb);
    int r = (!x || !y) ? -1
                       : (fsdp_tensor_dtype(a) == fsdp_tensor_dtype(b) && na == nb &&
                          memcmp(x, y, (size_t)na * sizeof *x) == 0);
    free(x);
    free(y);
    return r;
}

double fu_tensor_closeness(const fsdp_tensor_t *actual, const fsdp_tensor_t *expected, double rtol,
                           double atol) {
    int64_t na, ne;
    float *x = fu_host_f32(actual, &na), *y = fu_host_f32(expected, &ne);
    double worst = -1;
    if (x && y && na == ne) {
        worst = 0;
        for (int64_t i = 0; i < na; i++) {
            double d = fu_closeness(x[i], y[i], rtol, atol);
            if (d > worst || isnan(d)) worst = isnan(d) ? INFINITY : d;
        }
    }
    free(x);
    free(y);
    return worst;
}

void fu_vals_free(fu_vals_t *a) {
    free(a->v);
    *a = (fu_vals_t){0};
}

bool fu_vals_same(const fu_vals_t *a, const fu_vals_t *b, char *why, size_t len) {
    if (a->n != b->n) {
        snprintf(why, len, "%zu values, want %zu", a->n, b->n);
        return false;
    }
    for (size_t i = 0; i < a->n; i++)
        if (memcmp(&a->v[i], &b->v[i], sizeof a->v[i]) != 0) {
            snprintf(why, len, "first difference at %zu: %.9g vs %.9g", i, a->v[i], b->v[i]);
            return false;
        }
    return true;
}

bool fu_series_close(const double *a, const double *b, size_t n, double rtol, double atol,
                     const char *what, char *why, size_t len) {
    for (size_t i = 0; i < n; i++)
        if (!(fu_closeness(a[i], b[i], rtol, atol) <= 1.0)) {
            snprintf(why, len, "%s %zu: %.9g vs %.9g", what, i, a[i], b[i]);
            return false;
        }
    return true;
}

bool fu_vals_close(const fu_vals_t *a, const fu_vals_t *b, double rtol, double atol, char *why,
                   size_t len) {
    if (a->n != b->n || a->n == 0) {
        snprintf(why, len, "%zu values, want %zu", a->n, b->n);
        return false;
    }
    return fu_series_close(a->v, b->v, a->n, rtol, atol, "element", why, len);
}

int fu_list_values(const fsdp_named_list_t *l, bool grads, fu_vals_t *out) {
    fu_vals_free(out);
    for (size_t i = 0; i < l->n; i++)
        out->n += (size_t)fsdp_tensor_numel(l->tensors[i]);
    if (!(out->v = malloc((out->n ? out->n : 1) * sizeof *out->v))) return FSDP_ENOMEM;
    size_t k = 0;
    int rc = FSDP_OK;
    for (size_t i = 0; i < l->n && rc == 0; i++) {
        const fsdp_tensor_t *t = grads ? fsdp_tensor_grad(l->tensors[i]) : l->tensors[i];
        for (int64_t e = 0; e < fsdp_tensor_numel(l->tensors[i]) && rc == 0; e++, k++)
            if (t)
                rc = fsdp_tensor_item(t, e, &out->v[k]);
            else
                out->v[k] = NAN;
    }
    return rc;
}

int fu_module_values(const fsdp_module_t *m, bool buffers, bool grads, fu_vals_t *out) {
    fsdp_named_list_t l = {0};
    int rc =
        buffers ? fsdp_module_named_buffers(m, false, &l) : fsdp_module_named_params(m, false, &l);
    if (rc == 0) rc = fu_list_values(&l, grads, out);
    fsdp_named_list_free(&l);
    return rc;
}

int fu_store_params(fsdp_module_t *m, fu_val_fn val, void *arg) {
    fsdp_named_list_t l = {0};
    int rc = fsdp_module_named_params(m, false, &l);
    size_t k = 0;
    for (size_t p = 0; p < l.n && rc == 0; p++) {
        int64_t n = fsdp_tensor_numel(l.tensors[p]);
        float *f = malloc((size_t)(n ? n : 1) * sizeof *f);
        if (!f) rc = FSDP_ENOMEM;
        for (int64_t e = 0; e < n && rc == 0; e++, k++)
            rc = val(arg, p, e, k, &f[e]);
        if (rc == 0) rc = fsdp_tensor_copy_from_host(l.tensors[p], f, (size_t)n * sizeof *f);
        free(f);
    }
    fsdp_named_list_free(&l);
    return rc;
}

/* ---- harness pieces -------------------------------------------------------------------------- */

int fu_make_sgd(fsdp_ctx_t *ctx, const fsdp_named_list_t *l, double lr, double momentum,
                fsdp_optim_t **opt) {
    fsdp_sgd_options_t so;
    fsdp_sgd_options_init(&so);
    so.lr = lr;
    so.momentum = momentum;
    int rc = fsdp_optim_sgd_create(ctx, &so, opt);
    if (rc == 0)
        rc =
            fsdp_optim_add_group(*opt, l->n, l->tensors, (const char *const *)l->names, NULL, NULL);
    return rc;
}

int fu_make_fsdp_sgd(fsdp_ctx_t *ctx, fsdp_unit_t *root, double lr, double momentum,
                     fsdp_optim_t **opt) {
    fsdp_named_list_t l = {0};
    int rc = fsdp_named_params(root, &l);
    if (rc == 0) rc = fu_make_sgd(ctx, &l, lr, momentum, opt);
    fsdp_named_list_free(&l);
    return rc;
}

int fu_summon_nowb(fsdp_unit_t *root) {
    fsdp_summon_options_t o;
    fsdp_summon_options_init(&o);
    o.writeback = false;
    return fsdp_summon_begin(root, &o);
}

int fu_state_round_trip(fsdp_unit_t *root) {
    fsdp_module_t *m = fsdp_unit_module(root);
    fsdp_named_list_t sd = {0}, saved = {0};
    int rc = fsdp_summon_begin(root, NULL);
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
    if (rc == 0) rc = fsdp_summon_begin(root, NULL);
    if (rc == 0) {
        rc = fsdp_module_load_state_dict(m, &saved, true);
        rc2 = fsdp_summon_end(root);
        if (rc == 0) rc = rc2;
    }
    fsdp_named_list_free(&saved);
    return rc;
}

static int depth(const char *fqn) {
    int d = 0;
    for (; *fqn; fqn++)
        d += *fqn == '.';
    return d;
}

int fu_wrap_listed(fsdp_module_t *m, const char *const *units, const fsdp_options_t *o,
                   const char *expert, fsdp_pg_t *expert_pg) {
    int n = 0;
    while (units[n])
        n++;
    for (int d = 8; d >= 0; d--)
        for (int i = 0; i < n; i++) {
            if (depth(units[i]) != d) continue;
            fsdp_options_t uo = *o;
            if (expert && strcmp(units[i], expert) == 0) uo.pg = expert_pg;
            fsdp_unit_t *u = NULL;
            int rc = fsdp_wrap(fsdp_module_child(m, units[i]), &uo, &u);
            if (rc < 0) return rc;
        }
    return FSDP_OK;
}

int fu_wrap_types(fsdp_module_t *m, const fsdp_options_t *o, const char *const *types,
                  fsdp_unit_t **root) {
    fsdp_policy_t *p = NULL;
    int rc = fsdp_policy_module_types_create(types, &p);
    if (rc < 0) return rc;
    fsdp_options_t lo = *o;
    lo.auto_wrap_policy = p;
    rc = fsdp_wrap(m, &lo, root);
    fsdp_policy_release(p);
    return rc;
}

int fu_wrap_transformer_opts(fsdp_module_t *m, const fsdp_options_t *o, fsdp_unit_t **root) {
    static const char *const layer_types[] = {"TransformerEncoderLayer", "TransformerDecoderLayer",
                                              NULL};
    /* Without the batch-norm rule of mixed precision: t_fsdp_mp.c compares these units with a
     * twin wrapped without mixed precision, unit by unit (upstream would make bn a sixth unit;
     * t_wrap.c tests the rule). */
    fsdp_options_t lo = *o;
    lo.mixed_precision.module_classes_to_ignore = NULL;
    return fu_wrap_types(m, &lo, layer_types, root);
}

int fu_wrap_transformer(fsdp_module_t *m, const fu_job_t *j, fsdp_unit_t **root) {
    fsdp_options_t o;
    fu_job_options(j, &o);
    return fu_wrap_transformer_opts(m, &o, root);
}

int fu_transformer_setup(fu_res_t *r, fsdp_ctx_t *ctx, const fu_job_t *j, bool deterministic,
                         fsdp_module_t **m, fsdp_unit_t **root, fsdp_unit_t ***u, size_t *n,
                         fsdp_optim_t **opt) {
    int rc;
    tm_manual_seed(ctx, 0);
    if ((rc = tm_transformer_create(ctx, true, deterministic, m)) < 0)
        return fu_fatal(r, ctx, "building TransformerWithSharedParams", rc);
    if ((rc = fu_wrap_transformer(*m, j, root)) < 0 || (rc = fsdp_units(*root, u, n)) < 0 ||
        (rc = fu_make_fsdp_sgd(ctx, *root, 0.01, 0.9, opt)) < 0)
        return fu_fatal(r, ctx, "wrapping and the optimizer", rc);
    return FSDP_OK;
}

void fu_teardown(fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_unit_t *root, fsdp_unit_t **u,
                 fsdp_optim_t *opt) {
    fsdp_tape_clear(ctx);
    free(u);
    fsdp_optim_destroy(opt);
    fsdp_unit_destroy(root);
    fsdp_module_release(m);
}

int fu_linear_stack(fsdp_ctx_t *ctx, int n, int64_t d, fsdp_module_t **out) {
    fsdp_module_t *m = NULL, *l = NULL;
    tm_manual_seed(ctx, 0);
    int rc = fsdp_sequential_create(ctx, &m);
    for (int i = 0; i < n && rc == 0; i++) {
        rc = fsdp_linear_create(ctx, d, d, true, &l);
        if (rc == 0) rc = fsdp_module_append(m, l);
        fsdp_module_release(l);
        l = NULL;
    }
    if (rc < 0) {
        fsdp_module_release(m);
        m = NULL;
    }
    *out = m;
    return rc;
}

int fu_rand_input(fsdp_ctx_t *ctx, uint64_t seed, int64_t d0, int64_t d1, fsdp_tensor_t **x) {
    const int64_t shape[2] = {d0, d1};
    *x = NULL;
    tm_manual_seed(ctx, seed);
    int rc = fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, shape, FSDP_MEM_ACTIVATIONS, x);
    if (rc == 0) rc = fsdp_tensor_uniform_(*x, -1.0, 1.0);
    if (rc < 0) {
        fsdp_tensor_release(*x);
        *x = NULL;
    }
    return rc;
}

int fu_hybrid_groups(fsdp_ctx_t *ctx, int shard_size, fsdp_pg_t **shard_pg,
                     fsdp_pg_t **replicate_pg) {
    *shard_pg = *replicate_pg = NULL;
    fsdp_pg_t *world = fsdp_ctx_pg(ctx);
    int rank = fsdp_ctx_rank(ctx);
    if (shard_size < 1 || fsdp_pg_size(world) % shard_size != 0) return FSDP_EINVAL;
    int rc = fsdp_pg_split(world, rank / shard_size, rank, shard_pg);
    if (rc == 0) rc = fsdp_pg_split(world, rank % shard_size, rank, replicate_pg);
    if (rc < 0) {
        fsdp_pg_destroy(*shard_pg);
        fsdp_pg_destroy(*replicate_pg);
        *shard_pg = *replicate_pg = NULL;
    }
    return rc;
}

int fu_transformer_forward(fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_tensor_t **out,
                           fsdp_tensor_t **tgt_out) {
    fsdp_tensor_t *src = NULL, *tgt = NULL;
    int rc = tm_transformer_get_input(ctx, &src, &tgt);
    if (rc == 0) rc = tm_transformer_forward(m, src, tgt, out);
    fsdp_tensor_release(src);
    if (tgt_out && rc == 0)
        *tgt_out = tgt;
    else
        fsdp_tensor_release(tgt);
    return rc;
}

int fu_no_grad_forward(fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_tensor_t **out) {
    bool was = fsdp_set_grad_enabled(ctx, false);
    int rc = fu_transformer_forward(ctx, m, out, NULL);
    fsdp_set_grad_enabled(ctx, was);
    return rc;
}

int fu_change_root_shard(fu_res_t *r, fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_unit_t *root,
                         bool orig, uint64_t seed) {
    fsdp_tensor_t *flat = fsdp_unit_flat_param(root);
    int rc;
    if (!fu_ck(r, flat && fsdp_tensor_numel(flat) > 0, "the root unit has a non-empty local shard",
               "flat parameter %p with %lld elements", (void *)flat,
               flat ? (long long)fsdp_tensor_numel(flat) : 0LL))
        return 1;
    tm_manual_seed(ctx, seed);
    if (!orig) {
        if ((rc = fsdp_tensor_normal_(flat, 0.0, 1.0)) < 0)
            return fu_fatal(r, ctx, "normal_ into the root's flat parameter", rc);
        return FSDP_OK;
    }
    /* The tied embedding weight, managed by the root unit: outside forward the module's slot
     * holds the original object as a 1-D view of this rank's part of the shard. */
    fsdp_tensor_t *p = fsdp_module_param(m, "embed_tokens.weight");
    fsdp_param_info_t info = {0};
    bool found = false;
    for (size_t i = 0; i < fsdp_unit_num_params(root) && !found; i++)
        if (fsdp_unit_param_info(root, i, &info) == 0 && info.param == p) found = true;
    fu_ck(r,
          p && found && fsdp_tensor_ndim(p) == 1 && fsdp_tensor_numel(p) == info.numel_in_shard &&
              (info.numel_in_shard == 0 ||
               (fsdp_tensor_same_storage(p, flat) &&
                fsdp_tensor_storage_offset(p) ==
                    fsdp_tensor_storage_offset(flat) + info.offset_in_shard)),
          "use_orig_params: embed_tokens.weight is the root's original object, a 1-D view of "
          "its part of the local shard",
          "param %p found %d ndim %d numel %lld (in shard %lld), same storage %d, offset %lld "
          "(flat %lld + %lld)",
          (void *)p, found, p ? fsdp_tensor_ndim(p) : -1,
          p ? (long long)fsdp_tensor_numel(p) : -1LL, (long long)info.numel_in_shard,
          p ? fsdp_tensor_same_storage(p, flat) : 0,
          p ? (long long)fsdp_tensor_storage_offset(p) : -1LL,
          (long long)fsdp_tensor_storage_offset(flat), (long long)info.offset_in_shard);
    if (!p) return 1;
    if (fsdp_tensor_numel(p) > 0 && (rc = fsdp_tensor_normal_(p, 0.0, 1.0)) < 0)
        return fu_fatal(r, ctx, "normal_ into embed_tokens.weight's shard view", rc);
    return FSDP_OK;
}

/* ---- unit state and hooks -------------------------------------------------------------------- */

bool fu_tree_in_state(const fsdp_unit_t *root, fsdp_training_state_t st, bool unsharded) {
    fsdp_unit_t **units = NULL;
    size_t nu = 0;
    bool ok = fsdp_units(root, &units, &nu) == 0;
    for (size_t i = 0; i < nu && ok; i++)
        ok = fsdp_unit_state(units[i]) == st && (fsdp_unit_is_unsharded(units[i]) == unsharded ||
                                                 fsdp_unit_strategy(units[i]) == FSDP_NO_SHARD);
    free(units);
    return ok;
}

bool fu_tree_idle(const fsdp_unit_t *root) {
    return fu_tree_in_state(root, FSDP_STATE_IDLE, false);
}

bool fu_all_idle(fsdp_unit_t *const *u, size_t n, char *why, size_t len) {
    for (size_t i = 0; i < n; i++)
        if (fsdp_unit_state(u[i]) != FSDP_STATE_IDLE) {
            snprintf(why, len, "unit '%s' is in state %d, not IDLE", fsdp_unit_fqn(u[i]),
                     (int)fsdp_unit_state(u[i]));
            return false;
        }
    return true;
}

bool fu_none_unsharded(fsdp_unit_t *const *u, size_t n, char *why, size_t len) {
    for (size_t i = 0; i < n; i++)
        if (fsdp_unit_is_unsharded(u[i])) {
            snprintf(why, len, "unit '%s' (%s) kept its unsharded parameters", fsdp_unit_fqn(u[i]),
                     fsdp_unit_is_root(u[i]) ? "root" : "not root");
            return false;
        }
    return true;
}

bool fu_counters_are(fsdp_unit_t *const *u, size_t n, const int *post_mult, uint64_t k, char *why,
                     size_t len) {
    bool ok = true;
    why[0] = 0;
    for (size_t i = 0; i < n; i++) {
        fsdp_unit_stats_t s;
        fsdp_unit_get_stats(u[i], &s);
        uint64_t post = k * (uint64_t)post_mult[i];
        if (s.n_pre_bwd_registered != k || s.n_post_bwd_registered != post) {
            fu_add_why(why, len,
                       "unit '%s': n_pre_bwd_registered %llu, n_post_bwd_registered %llu "
                       "(want %llu, %llu)",
                       fsdp_unit_fqn(u[i]), (unsigned long long)s.n_pre_bwd_registered,
                       (unsigned long long)s.n_post_bwd_registered, (unsigned long long)k,
                       (unsigned long long)post);
            ok = false;
        }
    }
    return ok;
}

static int watch_backward(fsdp_module_t *m, void *arg, bool has_grad) {
    (void)m, (void)has_grad;
    fu_bwd_watch_t *w = arg;
    w->calls++;
    if (fsdp_unit_num_params(w->u) > 0 && fsdp_unit_is_unsharded(w->u)) w->unsharded_after++;
    return FSDP_OK;
}

int fu_watch_units(fsdp_unit_t *const *u, size_t n, fu_bwd_watch_t *w) {
    for (size_t i = 0; i < n; i++) {
        w[i] = (fu_bwd_watch_t){u[i], 0, 0};
        int h;
        int rc = fsdp_module_add_backward_hook(fsdp_unit_module(u[i]), watch_backward, &w[i], &h);
        if (rc < 0) return rc;
    }
    return FSDP_OK;
}

bool fu_watched(const fu_bwd_watch_t *w, size_t n, int calls, char *why, size_t len) {
    bool ok = true;
    why[0] = 0;
    for (size_t i = 0; i < n; i++)
        if (w[i].calls != calls || w[i].unsharded_after != 0) {
            fu_add_why(why, len,
                       "unit '%s': left by backward %d times (want %d), still unsharded "
                       "after %d of them",
                       fsdp_unit_fqn(w[i].u), w[i].calls, calls, w[i].unsharded_after);
            ok = false;
        }
    return ok;
}

/* The reference module's parameter ... */
fsdp_tensor_t *fu_ref_param(void *arg, const char *fqn) {
    return fsdp_module_param(arg, fqn);
}
/* ... or its gradient. */
fsdp_tensor_t *fu_ref_grad(void *arg, const char *fqn) {
    fsdp_tensor_t *p = fsdp_module_param(arg, fqn);
    return p ? fsdp_tensor_grad(p) : NULL;
}

/* Compares this rank's part of every parameter (grads: of every sharded gradient) of root's
 * units (only: of that unit alone, when not NULL) with the matching elements of the expected
 * full tensors. Returns the worst
 * fu_closeness() (> 1: not close), or INFINITY with the reason in why when something is missing
 * or of another dtype than f32 (sharded parameters and gradients are the parameters' f32). */
double fu_shards_vs(fsdp_unit_t *root, const fsdp_unit_t *only, bool grads, fu_expect_fn expect,
                    void *arg, double rtol, double atol, char *why, size_t len) {
    fsdp_unit_t **u = NULL;
    size_t nu = 0;
    double worst = 0;
    why[0] = 0;
    if (fsdp_units(root, &u, &nu) < 0) {
        snprintf(why, len, "fsdp_units failed");
        return INFINITY;
    }
    for (size_t i = 0; i < nu; i++) {
        fsdp_tensor_t *flat = only && u[i] != only ? NULL : fsdp_unit_flat_param(u[i]);
        for (size_t k = 0; flat && k < fsdp_unit_num_params(u[i]); k++) {
            fsdp_param_info_t pi;
            char fqn[256];
            if (fsdp_unit_param_info(u[i], k, &pi) < 0 || !pi.in_shard) continue;
            const char *ufqn = fsdp_unit_fqn(u[i]);
            snprintf(fqn, sizeof fqn, "%s%s%s", ufqn, ufqn[0] ? "." : "", pi.fqn);
            fsdp_tensor_t *src = grads ? fsdp_tensor_grad(flat) : flat;
            int64_t base = pi.offset_in_shard;
            if (grads && !src && pi.param) { /* use_orig_params: the original's 1-D view */
                src = fsdp_tensor_grad(pi.param);
                base = 0;
            }
            fsdp_tensor_t *e = expect(arg, fqn);
            if (!src || !e) {
                fu_add_why(why, len, "'%s': %s", fqn, !src ? "no sharded value" : "no reference");
                worst = INFINITY;
                continue;
            }
            if (fsdp_tensor_dtype(src) != FSDP_DTYPE_F32) {
                fu_add_why(why, len, "'%s' is %s, not f32", fqn,
                           fsdp_dtype_name(fsdp_tensor_dtype(src)));
                worst = INFINITY;
                continue;
            }
            int64_t na = 0, ne = 0;
            float *a = fu_host_f32(src, &na), *x = fu_host_f32(e, &ne);
            if (!a || !x || base + pi.numel_in_shard > na ||
                pi.intra_start + pi.numel_in_shard > ne) {
                fu_add_why(why, len, "'%s': cannot read the values", fqn);
                worst = INFINITY;
            } else {
                for (int64_t j = 0; j < pi.numel_in_shard; j++) {
                    double c = fu_closeness(a[base + j], x[pi.intra_start + j], rtol, atol);
                    if (isnan(c)) c = INFINITY;
                    if (c > worst) worst = c;
                    if (c > 1.0 && !why[0])
                        fu_add_why(why, len, "'%s'[%lld] is %.9g, reference %.9g", fqn,
                                   (long long)(pi.intra_start + j), a[base + j],
                                   x[pi.intra_start + j]);
                }
            }
            free(a);
            free(x);
        }
    }
    free(u);
    return worst;
}

/* ---- host copies of state-dict entries ------------------------------------------------------- */

void fu_store_free(fu_store_t *st) {
    for (size_t i = 0; i < st->n; i++)
        free(st->e[i].data);
    free(st->e);
    *st = (fu_store_t){0};
}

int fu_store_add(fu_store_t *st, const char *name, const fsdp_tensor_t *t, int ndim,
                 const int64_t *shape, int64_t offset, bool replicated) {
    if (st->n == st->cap) {
        size_t nc = st->cap ? 2 * st->cap : 64;
        fu_piece_t *ne = realloc(st->e, nc * sizeof *ne);
        if (!ne) return FSDP_ENOMEM;
        st->e = ne;
        st->cap = nc;
    }
    fu_piece_t *e = &st->e[st->n];
    memset(e, 0, sizeof *e);
    snprintf(e->name, sizeof e->name, "%s", name);
    e->dt = fsdp_tensor_dtype(t);
    e->ndim = ndim;
    if (ndim > 0) memcpy(e->shape, shape, (size_t)ndim * sizeof *shape);
    e->offset = offset;
    e->replicated = replicated;
    e->numel = fsdp_tensor_numel(t);
    size_t bytes = (size_t)e->numel * fsdp_dtype_size(e->dt);
    e->data = malloc(bytes ? bytes : 1);
    if (!e->data) return FSDP_ENOMEM;
    int rc = fsdp_tensor_to_host(t, e->data, bytes);
    if (rc == 0)
        st->n++;
    else
        free(e->data);
    return rc;
}

int fu_store_to_list(fsdp_ctx_t *ctx, const fu_store_t *st, fsdp_shard_list_t *out) {
    *out = (fsdp_shard_list_t){0};
    out->e = calloc(st->n + 1, sizeof *out->e);
    if (!out->e) return FSDP_ENOMEM;
    int rc = FSDP_OK;
    for (size_t i = 0; i < st->n && rc == 0; i++) {
        const fu_piece_t *s = &st->e[i];
        fsdp_shard_entry_t *e = &out->e[out->n];
        int nd = s->replicated ? s->ndim : 1;
        const int64_t *shape = s->replicated ? s->shape : &s->numel;
        rc = fsdp_tensor_from_host(ctx, s->dt, nd, shape, s->data, FSDP_MEM_OTHER, &e->t);
        if (rc < 0) break;
        e->name = strdup(s->name);
        e->ndim = s->ndim;
        memcpy(e->shape, s->shape, sizeof e->shape);
        e->offset = s->offset;
        e->replicated = s->replicated;
        out->n++;
        if (!e->name) rc = FSDP_ENOMEM;
    }
    return rc;
}

int fu_transformer_step(fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_optim_t *opt) {
    fsdp_tensor_t *out = NULL, *tgt = NULL, *loss = NULL;
    int rc = fsdp_optim_zero_grad(opt, true);
    if (rc == 0) rc = fu_transformer_forward(ctx, m, &out, &tgt);
    if (rc == 0) rc = tm_transformer_loss(tgt, out, &loss);
    if (rc == 0) rc = fsdp_backward(loss, NULL);
    if (rc == 0) rc = fsdp_optim_step(opt);
    fsdp_tensor_release(out);
    fsdp_tensor_release(tgt);
    fsdp_tensor_release(loss);
    fsdp_tape_clear(ctx);
    return rc;
}
