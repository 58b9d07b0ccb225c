/*
 * t_fsdp_core.c: the unit behaviours of test_fsdp_core.py other than parity (spec section 3):
 *   CORE-PI-01  a write into the local shard after wrapping reaches the next forward (the flat
 *               parameter, and with use_orig_params an original parameter's shard view);
 *   CORE-H01/H03 the backward-hook registration counters: none before the first forward, one
 *               per unit and forward with grad (post only for units with trainable
 *               parameters), unchanged by backward and by the optimizer step, one more per
 *               iteration, one per forward even when a unit runs twice in it;
 *   CORE-H02    the same after a full state-dict round trip under summon;
 *   CORE-NG-01  an eval forward equals a no-grad forward bitwise; no-grad records nothing and
 *               leaves every unit sharded; training goes on normally after a forward whose graph
 *               was dropped;
 *   CORE-AG-01  during a unit's forward its modules' parameter slots are views into the
 *               unsharded flat parameter at the parameters' offsets, and the original objects
 *               (views into the local shard) again afterwards; backward starts unsharded and
 *               frees after the unit's backward; over strategy x use_orig_params x
 *               forward_prefetch x backward_prefetch;
 *   F19         every unit IDLE after each step;
 *   fsdp_wrap error paths: NULL module, bad options, wrapping twice or inside a tree, mixed
 *               dtypes, a parameter shared by two units; the module stays usable afterwards.
 *
 * Every rank of a sim run (world 2, and 3 where cheap) runs the same checks in the same order
 * and records each into its own list; the main thread prints one TAP line per check, passing
 * only when every rank passed it, with each failing rank's detail as comments. The upstream
 * mixed-precision and cuda_first variants have no C counterpart (no MixedPrecision options, no
 * CUDA init modes on the sim backend).
 */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "models/models.h"
#include "tap.h"

#define MAXR 3
#define MAXC 96
#define RTOL 1.3e-6
#define ATOL 1e-5

/* ---- per-rank check lists -------------------------------------------------------------------- */

typedef struct rec {
    char name[200];
    bool ok;
    char why[800];
} rec_t;

typedef struct res {
    int n;
    rec_t c[MAXC];
} res_t;

typedef struct job {
    char prefix[160];
    int world;
    fsdp_sharding_strategy_t strategy;
    fsdp_backward_prefetch_t bp;
    bool fwd_prefetch;
    bool orig;
    res_t r[MAXR];
} job_t;

/* summon_full_params(recurse=True, writeback=False) */
static int summon_nowb(fsdp_unit_t *root) {
    fsdp_summon_options_t o;
    fsdp_summon_options_init(&o);
    o.writeback = false;
    return fsdp_summon_begin(root, &o);
}

static res_t *res_of(job_t *j, fsdp_ctx_t *ctx) {
    return &j->r[fsdp_ctx_rank(ctx)];
}

/* Records check `name` on this rank; fmt is the detail shown when it failed. */
static bool ck(res_t *r, bool ok, const char *name, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static bool ck(res_t *r, bool ok, const char *name, const char *fmt, ...) {
    if (r->n >= MAXC) return ok;
    rec_t *c = &r->c[r->n++];
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

/* A library call failed where it must not: recorded as a failed check; returns rc. */
static int fatal(res_t *r, fsdp_ctx_t *ctx, const char *what, int rc) {
    ck(r, false, what, "%s: %s (%s)", fsdp_err_name(rc), fsdp_strerror(rc),
       fsdp_ctx_last_error(ctx));
    return rc < 0 ? rc : FSDP_EINTERNAL;
}

static void run_job(job_t *j, fsdp_sim_fn fn) {
    fsdp_sim_options_t so;
    fsdp_sim_options_init(&so);
    so.world_size = j->world;
    so.seed = 5;
    so.timeout_ms = 60000;
    int st[MAXR] = {0};
    for (int r = 0; r < MAXR; r++)
        j->r[r].n = 0;
    int rc = fsdp_sim_run(&so, fn, j, st);
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

/* ---- helpers --------------------------------------------------------------------------------- */

static const char *const layer_types[] = {"TransformerEncoderLayer", "TransformerDecoderLayer",
                                          NULL};

static void job_options(const job_t *j, fsdp_options_t *o) {
    fsdp_options_init(o);
    o->strategy = j->strategy;
    o->backward_prefetch = j->bp;
    o->forward_prefetch = j->fwd_prefetch;
    o->use_orig_params = j->orig;
    o->check_exec_order = true;
}

/* TransformerWithSharedParams as upstream's RECURSIVE init wraps it: the encoder and decoder
 * layers, then the root (5 units). */
static int wrap_transformer(fsdp_module_t *m, const job_t *j, fsdp_unit_t **root) {
    fsdp_options_t o;
    job_options(j, &o);
    o.wrap_types = layer_types;
    return fsdp_wrap(m, &o, root);
}

static int transformer_forward(fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_tensor_t **out,
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

/* SGD over what FSDP hands the optimizer. */
static int make_sgd(fsdp_ctx_t *ctx, const fsdp_named_list_t *l, double lr, double momentum,
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

static int make_fsdp_sgd(fsdp_ctx_t *ctx, fsdp_unit_t *root, double lr, double momentum,
                         fsdp_optim_t **opt) {
    fsdp_named_list_t l = {0};
    int rc = fsdp_named_params(root, &l);
    if (rc == 0) rc = make_sgd(ctx, &l, lr, momentum, opt);
    fsdp_named_list_free(&l);
    return rc;
}

/* A tensor's values as floats (malloc'ed; NULL on failure). */
static float *host_f32(const fsdp_tensor_t *t, int64_t *n) {
    *n = fsdp_tensor_numel(t);
    float *v = malloc((size_t)(*n > 0 ? *n : 1) * sizeof *v);
    if (v && fsdp_tensor_to_host(t, v, (size_t)*n * sizeof *v) < 0) {
        free(v);
        v = NULL;
    }
    return v;
}

/* 1: bitwise equal, 0: not, -1: could not compare. */
static int same_bits(const fsdp_tensor_t *a, const fsdp_tensor_t *b) {
    int64_t na, nb;
    float *x = host_f32(a, &na), *y = host_f32(b, &nb);
    int r = (!x || !y) ? -1 : (na == nb && memcmp(x, y, (size_t)na * sizeof *x) == 0);
    free(x);
    free(y);
    return r;
}

/* The largest |a - b| / (atol + rtol |a|) over the elements (> 1: not close); -1 when the
 * tensors cannot be compared. */
static double closeness(const fsdp_tensor_t *a, const fsdp_tensor_t *b) {
    int64_t na, nb;
    float *x = host_f32(a, &na), *y = host_f32(b, &nb);
    double worst = -1;
    if (x && y && na == nb) {
        worst = 0;
        for (int64_t i = 0; i < na; i++) {
            double d = fabs((double)x[i] - y[i]) / (ATOL + RTOL * fabs((double)x[i]));
            if (d > worst || isnan(d)) worst = isnan(d) ? INFINITY : d;
        }
    }
    free(x);
    free(y);
    return worst;
}

static bool all_idle(fsdp_unit_t *const *u, size_t n, char *why, size_t len) {
    for (size_t i = 0; i < n; i++)
        if (fsdp_unit_state(u[i]) != FSDP_STATE_IDLE) {
            snprintf(why, len, "unit '%s' is in state %d, not IDLE", fsdp_unit_fqn(u[i]),
                     (int)fsdp_unit_state(u[i]));
            return false;
        }
    return true;
}

/* Appends to a diagnostic (the first few problems, separated by "; "). */
static void add_why(char *why, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void add_why(char *why, size_t len, const char *fmt, ...) {
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

/* Every unit's registration counters: pre == k, post == k * post_mult[i]. */
static bool counters_are(fsdp_unit_t *const *u, size_t n, const int *post_mult, uint64_t k,
                         char *why, size_t len) {
    bool ok = true;
    why[0] = 0;
    for (size_t i = 0; i < n; i++) {
        fsdp_unit_stats_t s;
        fsdp_unit_get_stats(u[i], &s);
        uint64_t post = k * (uint64_t)post_mult[i];
        if (s.n_pre_bwd_registered != k || s.n_post_bwd_registered != post) {
            add_why(why, len,
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

/* A unit's per-backward hooks ran exactly k times each. */
static bool hooks_ran(fsdp_unit_t *const *u, size_t n, uint64_t k, char *why, size_t len) {
    for (size_t i = 0; i < n; i++) {
        fsdp_unit_stats_t s;
        fsdp_unit_get_stats(u[i], &s);
        if (s.pre_backward_hooks != k || s.post_backward_hooks != k) {
            snprintf(why, len,
                     "unit '%s': pre_backward_hooks %llu, post_backward_hooks %llu; "
                     "want %llu each",
                     fsdp_unit_fqn(u[i]), (unsigned long long)s.pre_backward_hooks,
                     (unsigned long long)s.post_backward_hooks, (unsigned long long)k);
            return false;
        }
    }
    return true;
}

/* A backward hook on a unit's module, registered after wrapping (so it runs after FSDP's):
 * counts the unit's backward passes and whether its parameters were still unsharded then. */
typedef struct bwd_watch {
    fsdp_unit_t *u;
    int calls;
    int unsharded_after;
} bwd_watch_t;

static int watch_backward(fsdp_module_t *m, void *arg, bool has_grad) {
    (void)m, (void)has_grad;
    bwd_watch_t *w = arg;
    w->calls++;
    if (fsdp_unit_num_params(w->u) > 0 && fsdp_unit_is_unsharded(w->u)) w->unsharded_after++;
    return FSDP_OK;
}

static int watch_units(fsdp_unit_t *const *u, size_t n, bwd_watch_t *w) {
    for (size_t i = 0; i < n; i++) {
        w[i] = (bwd_watch_t){u[i], 0, 0};
        int h;
        int rc = fsdp_module_add_backward_hook(fsdp_unit_module(u[i]), watch_backward, &w[i], &h);
        if (rc < 0) return rc;
    }
    return FSDP_OK;
}

/* Each watched unit went through backward `calls` times in all and was resharded every time. */
static bool watched(const bwd_watch_t *w, size_t n, int calls, char *why, size_t len) {
    bool ok = true;
    why[0] = 0;
    for (size_t i = 0; i < n; i++)
        if (w[i].calls != calls || w[i].unsharded_after != 0) {
            add_why(why, len,
                    "unit '%s': left by backward %d times (want %d), still unsharded "
                    "after %d of them",
                    fsdp_unit_fqn(w[i].u), w[i].calls, calls, w[i].unsharded_after);
            ok = false;
        }
    return ok;
}

/* ---- CORE-PI-01 ------------------------------------------------------------------------------ */

/* Three twins A, B, C; B is changed through its local shard after wrapping. */
static int pi_rank(fsdp_ctx_t *ctx, void *arg) {
    job_t *j = arg;
    res_t *r = res_of(j, ctx);
    fsdp_module_t *m[3] = {NULL, NULL, NULL};
    fsdp_unit_t *root[3] = {NULL, NULL, NULL};
    fsdp_tensor_t *out[3] = {NULL, NULL, NULL};
    int rc = FSDP_OK;
    for (int i = 0; i < 3 && rc == 0; i++) {
        if ((rc = tm_transformer_create(ctx, true, true, &m[i])) < 0)
            fatal(r, ctx, "building TransformerWithSharedParams", rc);
        else if ((rc = wrap_transformer(m[i], j, &root[i])) < 0)
            fatal(r, ctx, "wrapping TransformerWithSharedParams", rc);
    }
    if (rc < 0) goto done;

    fsdp_tensor_t *flat = fsdp_unit_flat_param(root[1]);
    if (!ck(r, flat && fsdp_tensor_numel(flat) > 0, "the root unit has a non-empty local shard",
            "flat parameter %p with %lld elements", (void *)flat,
            flat ? (long long)fsdp_tensor_numel(flat) : 0LL))
        goto done;
    if (!j->orig) {
        rc = fsdp_tensor_normal_(flat, 0.0, 1.0);
        if (rc < 0) {
            fatal(r, ctx, "normal_ into the root's flat parameter", rc);
            goto done;
        }
    } else {
        /* The tied embedding weight, managed by the root unit: outside forward the module's
         * slot holds the original object as a 1-D view of this rank's part of the shard. */
        fsdp_tensor_t *p = fsdp_module_param(m[1], "embed_tokens.weight");
        fsdp_param_info_t info = {0};
        bool found = false;
        for (size_t i = 0; i < fsdp_unit_num_params(root[1]) && !found; i++)
            if (fsdp_unit_param_info(root[1], i, &info) == 0 && info.param == p) found = true;
        ck(r,
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
        if (!p) goto done;
        if (fsdp_tensor_numel(p) > 0 && (rc = fsdp_tensor_normal_(p, 0.0, 1.0)) < 0) {
            fatal(r, ctx, "normal_ into embed_tokens.weight's shard view", rc);
            goto done;
        }
    }

    for (int i = 0; i < 3; i++)
        if ((rc = transformer_forward(ctx, m[i], &out[i], NULL)) < 0) {
            fatal(r, ctx, "forward", rc);
            goto done;
        }
    int same = same_bits(out[0], out[2]);
    ck(r, same == 1, "control: an unchanged twin gives bitwise the same output",
       "same_bits returned %d", same);
    double cl = closeness(out[0], out[1]);
    ck(r, cl > 1.0,
       j->orig ? "CORE-PI-01 (use_orig_params): a write into an original parameter's shard view "
                 "reaches the next forward"
               : "CORE-PI-01: a write into the root's flat parameter (local shard) reaches the "
                 "next forward",
       "new_output did not reflect change to param after init (outputs within fp32 tolerance: "
       "worst %.3g of tolerance)",
       cl);
done:
    for (int i = 0; i < 3; i++)
        fsdp_tensor_release(out[i]);
    fsdp_tape_clear(ctx);
    for (int i = 0; i < 3; i++) {
        fsdp_destroy(root[i]);
        fsdp_module_release(m[i]);
    }
    return rc;
}

/* ---- CORE-H01, CORE-H02, CORE-H03 on TransformerWithSharedParams ----------------------------- */

/* PyTorch's save_model step: clone the full state dict under summon, zero every parameter,
 * load the clone back. */
static int state_round_trip(fsdp_unit_t *root) {
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

static int no_grad_forward(fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_tensor_t **out) {
    bool was = fsdp_set_grad_enabled(ctx, false);
    int rc = transformer_forward(ctx, m, out, NULL);
    fsdp_set_grad_enabled(ctx, was);
    return rc;
}

static int hooks_rank(fsdp_ctx_t *ctx, void *arg) {
    job_t *j = arg;
    res_t *r = res_of(j, ctx);
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL, **u = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_tensor_t *out = NULL, *tgt = NULL, *loss = NULL, *before = NULL, *after = NULL;
    size_t n = 0;
    int post_mult[8];
    bwd_watch_t w[8];
    char why[760], name[200];
    int rc;
    if ((rc = tm_transformer_create(ctx, true, true, &m)) < 0)
        return fatal(r, ctx, "building TransformerWithSharedParams", rc);
    if ((rc = wrap_transformer(m, j, &root)) < 0 || (rc = fsdp_units(root, &u, &n)) < 0 ||
        (rc = make_fsdp_sgd(ctx, root, 0.01, 0.9, &opt)) < 0) {
        fatal(r, ctx, "wrapping and the optimizer", rc);
        goto done;
    }
    if (!ck(r, n == 5, "5 units (4 layers and the root)", "%zu units", n)) goto done;
    if ((rc = watch_units(u, n, w)) < 0) {
        fatal(r, ctx, "adding backward hooks", rc);
        goto done;
    }
    bool trainable = true;
    for (size_t i = 0; i < n; i++) {
        post_mult[i] = 1;
        trainable &=
            fsdp_unit_flat_param(u[i]) && fsdp_tensor_requires_grad(fsdp_unit_flat_param(u[i]));
    }
    ck(r, trainable, "every unit has trainable parameters", "a unit has none");
    ck(r, counters_are(u, n, post_mult, 0, why, sizeof why),
       "CORE-H03: no pre- or post-backward registration before the first forward", "%s", why);

    for (int it = 1; it <= 3; it++) {
        if (it == 3) {
            /* CORE-H02: a full state-dict round trip between iterations 2 and 3. */
            if ((rc = no_grad_forward(ctx, m, &before)) < 0) {
                fatal(r, ctx, "no-grad forward before the round trip", rc);
                goto done;
            }
            if ((rc = state_round_trip(root)) < 0) {
                fatal(r, ctx, "CORE-H02: state-dict round trip under summon", rc);
                goto done;
            }
            ck(r, all_idle(u, n, why, sizeof why), "CORE-H02: every unit IDLE after the round trip",
               "%s", why);
            ck(r, counters_are(u, n, post_mult, 2, why, sizeof why),
               "CORE-H02: the round trip (and a no-grad forward) registered nothing", "%s", why);
            if ((rc = no_grad_forward(ctx, m, &after)) < 0) {
                fatal(r, ctx, "no-grad forward after the round trip", rc);
                goto done;
            }
            int same = same_bits(before, after);
            ck(r, same == 1, "CORE-H02: the round trip restored every parameter (same output)",
               "same_bits returned %d", same);
        }
        const char *id = it == 3 ? "CORE-H02" : "CORE-H01/H03";
        fsdp_optim_zero_grad(opt, true);
        if ((rc = transformer_forward(ctx, m, &out, &tgt)) < 0 ||
            (rc = tm_transformer_loss(tgt, out, &loss)) < 0) {
            fatal(r, ctx, "forward", rc);
            goto done;
        }
        snprintf(name, sizeof name,
                 "%s: after forward %d every unit registered pre- and post-backward %d times", id,
                 it, it);
        ck(r, counters_are(u, n, post_mult, (uint64_t)it, why, sizeof why), name, "%s", why);
        if ((rc = fsdp_backward(loss, NULL)) < 0) {
            fatal(r, ctx, "backward", rc);
            goto done;
        }
        snprintf(name, sizeof name, "%s: iteration %d: backward leaves the counters alone", id, it);
        ck(r, counters_are(u, n, post_mult, (uint64_t)it, why, sizeof why), name, "%s", why);
        snprintf(name, sizeof name,
                 "%s: iteration %d: each unit's pre- and post-backward hook ran once", id, it);
        ck(r, hooks_ran(u, n, (uint64_t)it, why, sizeof why), name, "%s", why);
        snprintf(name, sizeof name,
                 "%s: iteration %d: each unit freed its parameters when backward left it", id, it);
        ck(r, watched(w, n, it, why, sizeof why), name, "%s", why);
        if ((rc = fsdp_optim_step(opt)) < 0) {
            fatal(r, ctx, "optimizer step", rc);
            goto done;
        }
        snprintf(name, sizeof name,
                 "%s: iteration %d: the optimizer step leaves the counters "
                 "alone",
                 id, it);
        ck(r, counters_are(u, n, post_mult, (uint64_t)it, why, sizeof why), name, "%s", why);
        snprintf(name, sizeof name, "F19: every unit IDLE after step %d", it);
        ck(r, all_idle(u, n, why, sizeof why), name, "%s", why);
        fsdp_tensor_release(out);
        fsdp_tensor_release(tgt);
        fsdp_tensor_release(loss);
        out = tgt = loss = NULL;
    }
done:
    fsdp_tensor_release(out);
    fsdp_tensor_release(tgt);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(before);
    fsdp_tensor_release(after);
    fsdp_tape_clear(ctx);
    free(u);
    fsdp_optim_destroy(opt);
    fsdp_destroy(root);
    fsdp_module_release(m);
    return rc;
}

/* ---- CORE-H01 sub-case: a unit run twice in one forward, and a frozen unit ------------------- */

/*
 * TwiceModel: children lin (Linear(4, 4), a unit), frozen (Linear(4, 4) with requires_grad off,
 * a unit) and head (Linear(4, 4), managed by the root). forward(x) = head(frozen(lin(lin(x)))).
 */
static int twice_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                         fsdp_tensor_t **out) {
    if (nin != 1 || nout != 1) return FSDP_EINVAL;
    fsdp_tensor_t *a = NULL, *b = NULL, *c = NULL;
    int rc = fsdp_module_forward1(fsdp_module_child(m, "lin"), in[0], &a);
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(m, "lin"), a, &b);
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(m, "frozen"), b, &c);
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(m, "head"), c, &out[0]);
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    fsdp_tensor_release(c);
    return rc;
}

static const fsdp_module_ops_t twice_ops = {"TwiceModel", twice_forward, NULL};

static int twice_create(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_module_t *m = NULL, *c = NULL;
    tm_manual_seed(ctx, 3);
    int rc = fsdp_module_create(ctx, &twice_ops, NULL, &m);
    const char *names[3] = {"lin", "frozen", "head"};
    for (int i = 0; i < 3 && rc == 0; i++) {
        rc = fsdp_linear_create(ctx, 4, 4, true, &c);
        if (rc == 0 && i == 1) rc = fsdp_module_requires_grad_(c, false);
        if (rc == 0) rc = fsdp_module_add_child(m, names[i], c);
        fsdp_module_release(c);
        c = NULL;
    }
    if (rc < 0) {
        fsdp_module_release(m);
        m = NULL;
    }
    *out = m;
    return rc;
}

static int twice_rank(fsdp_ctx_t *ctx, void *arg) {
    job_t *j = arg;
    res_t *r = res_of(j, ctx);
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_unit_t *root = NULL, *ul = NULL, *uf = NULL, **u = NULL;
    fsdp_optim_t *opt = NULL, *ref_opt = NULL;
    fsdp_named_list_t ref_params = {0}, full = {0};
    fsdp_tensor_t *x = NULL, *out = NULL, *loss = NULL;
    size_t n = 0;
    int post_mult[3];
    bwd_watch_t w[3];
    char why[760], name[200];
    int rc;
    const int64_t xs[2] = {3, 4};
    if ((rc = twice_create(ctx, &m)) < 0 || (rc = twice_create(ctx, &ref)) < 0)
        return fatal(r, ctx, "building TwiceModel", rc);
    fsdp_options_t o;
    job_options(j, &o);
    if ((rc = fsdp_wrap(fsdp_module_child(m, "lin"), &o, &ul)) < 0 ||
        (rc = fsdp_wrap(fsdp_module_child(m, "frozen"), &o, &uf)) < 0 ||
        (rc = fsdp_wrap(m, &o, &root)) < 0 || (rc = fsdp_units(root, &u, &n)) < 0 ||
        (rc = make_fsdp_sgd(ctx, root, 0.1, 0.0, &opt)) < 0 ||
        (rc = fsdp_module_named_params(ref, false, &ref_params)) < 0 ||
        (rc = make_sgd(ctx, &ref_params, 0.1, 0.0, &ref_opt)) < 0) {
        fatal(r, ctx, "wrapping TwiceModel and the optimizers", rc);
        goto done;
    }
    if (!ck(r, n == 3 && u[0] == root, "TwiceModel has 3 units, the root first", "%zu units", n))
        goto done;
    for (size_t i = 0; i < n; i++)
        post_mult[i] = u[i] == uf ? 0 : 1;
    if ((rc = watch_units(u, n, w)) < 0) {
        fatal(r, ctx, "adding backward hooks", rc);
        goto done;
    }
    tm_manual_seed(ctx, 9);
    if ((rc = fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, xs, FSDP_MEM_ACTIVATIONS, &x)) < 0 ||
        (rc = fsdp_tensor_uniform_(x, -1.0, 1.0)) < 0) {
        fatal(r, ctx, "input", rc);
        goto done;
    }
    ck(r, counters_are(u, n, post_mult, 0, why, sizeof why),
       "CORE-H03: nothing registered before the first forward", "%s", why);
    for (int it = 1; it <= 2; it++) {
        double l_ref = 0, l = 0;
        fsdp_optim_zero_grad(ref_opt, true);
        if ((rc = fsdp_module_forward1(ref, x, &out)) < 0 || (rc = tm_sum_loss(out, &loss)) < 0 ||
            (rc = fsdp_tensor_item(loss, 0, &l_ref)) < 0 || (rc = fsdp_backward(loss, NULL)) < 0 ||
            (rc = fsdp_optim_step(ref_opt)) < 0) {
            fatal(r, ctx, "reference step", rc);
            goto done;
        }
        fsdp_tensor_release(out);
        fsdp_tensor_release(loss);
        out = loss = NULL;
        fsdp_optim_zero_grad(opt, true);
        if ((rc = fsdp_module_forward1(m, x, &out)) < 0 || (rc = tm_sum_loss(out, &loss)) < 0 ||
            (rc = fsdp_tensor_item(loss, 0, &l)) < 0) {
            fatal(r, ctx, "forward", rc);
            goto done;
        }
        snprintf(name, sizeof name,
                 "CORE-H01: forward %d: one registration per unit although 'lin' ran twice; "
                 "none for the frozen unit's post-backward",
                 it);
        ck(r, counters_are(u, n, post_mult, (uint64_t)it, why, sizeof why), name, "%s", why);
        if ((rc = fsdp_backward(loss, NULL)) < 0) {
            fatal(r, ctx, "backward", rc);
            goto done;
        }
        snprintf(name, sizeof name, "CORE-H01: iteration %d: backward leaves the counters alone",
                 it);
        ck(r, counters_are(u, n, post_mult, (uint64_t)it, why, sizeof why), name, "%s", why);
        snprintf(name, sizeof name,
                 "iteration %d: backward passed 'lin' twice and freed it only after its first "
                 "invocation",
                 it);
        bool okw = true;
        for (size_t i = 0; i < n; i++) {
            int want = (u[i] == ul ? 2 : 1) * it;
            if (w[i].calls != want || w[i].unsharded_after != (u[i] == ul ? it : 0)) {
                snprintf(why, sizeof why,
                         "unit '%s': %d backward passes (want %d), still unsharded after %d",
                         fsdp_unit_fqn(u[i]), w[i].calls, want, w[i].unsharded_after);
                okw = false;
                break;
            }
        }
        ck(r, okw, name, "%s", why);
        if ((rc = fsdp_optim_step(opt)) < 0) {
            fatal(r, ctx, "optimizer step", rc);
            goto done;
        }
        snprintf(name, sizeof name, "F19: every unit IDLE after step %d", it);
        ck(r, all_idle(u, n, why, sizeof why), name, "%s", why);
        snprintf(name, sizeof name, "iteration %d: loss matches the unwrapped model", it);
        ck(r, fabs(l - l_ref) <= ATOL + RTOL * fabs(l_ref), name, "loss %.9g, reference %.9g", l,
           l_ref);
        fsdp_tensor_release(out);
        fsdp_tensor_release(loss);
        out = loss = NULL;
    }
    /* The parameters after two steps against the reference's. */
    if ((rc = summon_nowb(root)) < 0) {
        fatal(r, ctx, "summon", rc);
        goto done;
    }
    rc = fsdp_module_named_params(m, false, &full);
    double worst = full.n == ref_params.n ? 0 : INFINITY;
    for (size_t i = 0; rc == 0 && i < full.n && i < ref_params.n; i++) {
        double c = strcmp(full.names[i], ref_params.names[i]) == 0
                       ? closeness(ref_params.tensors[i], full.tensors[i])
                       : INFINITY;
        if (c < 0 || c > worst) worst = c < 0 ? INFINITY : c;
    }
    int rc2 = fsdp_summon_end(root);
    if (rc == 0) rc = rc2;
    if (rc < 0) {
        fatal(r, ctx, "reading the full parameters", rc);
        goto done;
    }
    ck(r, worst <= 1.0,
       "after 2 steps the full parameters match the unwrapped model (twice-run unit's gradient "
       "accumulated over both uses, frozen unit unchanged)",
       "worst element %.3g of fp32 tolerance", worst);
done:
    fsdp_tensor_release(x);
    fsdp_tensor_release(out);
    fsdp_tensor_release(loss);
    fsdp_tape_clear(ctx);
    fsdp_named_list_free(&full);
    fsdp_named_list_free(&ref_params);
    free(u);
    fsdp_optim_destroy(opt);
    fsdp_optim_destroy(ref_opt);
    fsdp_destroy(root);
    if (!root) {
        fsdp_destroy(ul);
        fsdp_destroy(uf);
    }
    fsdp_module_release(m);
    fsdp_module_release(ref);
    return rc;
}

/* ---- CORE-NG-01 ------------------------------------------------------------------------------ */

static int ng_rank(fsdp_ctx_t *ctx, void *arg) {
    job_t *j = arg;
    res_t *r = res_of(j, ctx);
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL, **u = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_tensor_t *out = NULL, *tgt = NULL, *loss = NULL, *ng = NULL, *ev = NULL;
    size_t n = 0;
    int post_mult[8];
    bwd_watch_t w[8];
    fsdp_unit_stats_t s0;
    char why[760];
    int rc;
    /* Not deterministic: training mode, so dropout is active (seeded alike on every rank). */
    tm_manual_seed(ctx, 0);
    if ((rc = tm_transformer_create(ctx, true, false, &m)) < 0)
        return fatal(r, ctx, "building TransformerWithSharedParams", rc);
    if ((rc = wrap_transformer(m, j, &root)) < 0 || (rc = fsdp_units(root, &u, &n)) < 0 ||
        (rc = make_fsdp_sgd(ctx, root, 0.01, 0.9, &opt)) < 0) {
        fatal(r, ctx, "wrapping and the optimizer", rc);
        goto done;
    }
    if (!ck(r, n == 5, "5 units", "%zu units", n)) goto done;
    for (size_t i = 0; i < n; i++)
        post_mult[i] = 1;
    if ((rc = watch_units(u, n, w)) < 0) {
        fatal(r, ctx, "adding backward hooks", rc);
        goto done;
    }
    ck(r, fsdp_module_is_training(m), "the model trains with dropout", "it is in eval mode");

    /* One training step. */
    fsdp_optim_zero_grad(opt, true);
    if ((rc = transformer_forward(ctx, m, &out, &tgt)) < 0 ||
        (rc = tm_transformer_loss(tgt, out, &loss)) < 0 || (rc = fsdp_backward(loss, NULL)) < 0 ||
        (rc = fsdp_optim_step(opt)) < 0) {
        fatal(r, ctx, "training step", rc);
        goto done;
    }
    fsdp_tensor_release(out);
    fsdp_tensor_release(tgt);
    fsdp_tensor_release(loss);
    out = tgt = loss = NULL;
    ck(r, all_idle(u, n, why, sizeof why), "F19: every unit IDLE after the step", "%s", why);

    fsdp_module_train(m, false);
    fsdp_unit_get_stats(root, &s0);
    size_t tape0 = fsdp_tape_size(ctx);
    if ((rc = no_grad_forward(ctx, m, &ng)) < 0) {
        fatal(r, ctx, "no-grad forward", rc);
        goto done;
    }
    ck(r, tape0 == 0 && fsdp_tape_size(ctx) == 0,
       "CORE-NG-01: a no-grad forward records nothing on the tape",
       "tape size %zu before, %zu after", tape0, fsdp_tape_size(ctx));
    ck(r, !fsdp_tensor_requires_grad(ng), "CORE-NG-01: the no-grad output requires no gradient",
       "it does");
    bool sharded = true;
    for (size_t i = 0; i < n && sharded; i++)
        if (fsdp_unit_is_unsharded(u[i])) {
            sharded = false;
            snprintf(why, sizeof why, "unit '%s' (%s) kept its unsharded parameters",
                     fsdp_unit_fqn(u[i]), fsdp_unit_is_root(u[i]) ? "root" : "not root");
        }
    ck(r, sharded, "CORE-NG-01: after a no-grad forward no unit (root included) is unsharded", "%s",
       why);
    ck(r, all_idle(u, n, why, sizeof why), "CORE-NG-01: every unit IDLE after the no-grad forward",
       "%s", why);
    ck(r, counters_are(u, n, post_mult, 1, why, sizeof why),
       "CORE-NG-01: a no-grad forward registers no backward hooks", "%s", why);

    /* Eval mode with grad on: records, and must compute the same. */
    if ((rc = transformer_forward(ctx, m, &ev, NULL)) < 0) {
        fatal(r, ctx, "eval forward", rc);
        goto done;
    }
    ck(r, fsdp_tape_size(ctx) > 0 && fsdp_tensor_requires_grad(ev),
       "control: the eval forward with grad on recorded its graph", "tape size %zu",
       fsdp_tape_size(ctx));
    int same = same_bits(ev, ng);
    ck(r, same == 1, "CORE-NG-01: eval forward and no-grad forward give bitwise the same output",
       "same_bits returned %d (closeness %.3g of fp32 tolerance)", same, closeness(ev, ng));
    ck(r, all_idle(u, n, why, sizeof why), "CORE-NG-01: every unit IDLE after the eval forward",
       "%s", why);
    ck(r, counters_are(u, n, post_mult, 2, why, sizeof why),
       "a forward with grad in eval mode registers once per unit", "%s", why);

    /* The eval graph is dropped unused (no backward); training goes on. */
    fsdp_tensor_release(ev);
    ev = NULL;
    fsdp_tape_clear(ctx);
    fsdp_module_train(m, true);
    fsdp_optim_zero_grad(opt, true);
    if ((rc = transformer_forward(ctx, m, &out, &tgt)) < 0 ||
        (rc = tm_transformer_loss(tgt, out, &loss)) < 0) {
        fatal(r, ctx, "forward after the dropped eval graph", rc);
        goto done;
    }
    ck(r, counters_are(u, n, post_mult, 3, why, sizeof why),
       "after a forward whose graph was dropped (fsdp_tape_clear), the next forward registers "
       "pre- and post-backward again",
       "%s", why);
    if ((rc = fsdp_backward(loss, NULL)) < 0 || (rc = fsdp_optim_step(opt)) < 0) {
        fatal(r, ctx, "training step after the dropped eval graph", rc);
        goto done;
    }
    ck(r, watched(w, n, 2, why, sizeof why),
       "after a dropped eval graph, backward frees each unit when it leaves it (not only in the "
       "final callback)",
       "%s", why);
    ck(r, all_idle(u, n, why, sizeof why), "F19: every unit IDLE after the next step", "%s", why);
done:
    fsdp_tensor_release(out);
    fsdp_tensor_release(tgt);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(ng);
    fsdp_tensor_release(ev);
    fsdp_tape_clear(ctx);
    free(u);
    fsdp_optim_destroy(opt);
    fsdp_destroy(root);
    fsdp_module_release(m);
    return rc;
}

/* ---- CORE-AG-01 ------------------------------------------------------------------------------ */

/* What the hooks on one Linear saw. */
typedef struct lin_watch {
    fsdp_unit_t *u;
    fsdp_sharding_strategy_t strategy;
    int fwd_pre, fwd_post, bwd_pre, bwd_post;
    char err_fwd[400], err_after[400], err_bwd_pre[400], err_bwd_post[400];
} lin_watch_t;

static void set_err(char *dst, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void set_err(char *dst, size_t len, const char *fmt, ...) {
    if (dst[0]) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(dst, len, fmt, ap);
    va_end(ap);
}

/* In compute: every managed slot is a view into the unsharded flat parameter at its offset. */
static int ag_fwd_pre(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t **in) {
    (void)nin, (void)in;
    lin_watch_t *h = arg;
    h->fwd_pre++;
    fsdp_unit_t *u = h->u;
    fsdp_tensor_t *full = fsdp_unit_full_param(u);
    fsdp_flat_sizes_t fs;
    fsdp_unit_flat_sizes(u, &fs);
    if (!fsdp_unit_is_unsharded(u) || !full) {
        set_err(h->err_fwd, sizeof h->err_fwd, "forward %d: the unit is not unsharded", h->fwd_pre);
        return FSDP_OK;
    }
    size_t es = fsdp_dtype_size(fsdp_tensor_dtype(full));
    if (fsdp_tensor_storage_bytes(full) < (size_t)fs.padded_numel * es) {
        set_err(h->err_fwd, sizeof h->err_fwd,
                "forward %d: the unsharded flat parameter has %zu bytes, want %zu", h->fwd_pre,
                fsdp_tensor_storage_bytes(full), (size_t)fs.padded_numel * es);
        return FSDP_OK;
    }
    const char *lo = fsdp_tensor_data(full), *hi = lo + (size_t)fs.padded_numel * es;
    for (size_t i = 0; i < fsdp_unit_num_params(u); i++) {
        fsdp_param_info_t info;
        if (fsdp_unit_param_info(u, i, &info) < 0) {
            set_err(h->err_fwd, sizeof h->err_fwd, "param_info %zu failed", i);
            break;
        }
        fsdp_tensor_t *s = fsdp_module_param(m, info.fqn);
        const char *p = s ? fsdp_tensor_data(s) : NULL;
        int64_t ne = s ? fsdp_tensor_numel(s) : 0;
        if (!s || s == info.param)
            set_err(h->err_fwd, sizeof h->err_fwd,
                    "forward %d: slot '%s' holds %s, not a compute view", h->fwd_pre, info.fqn,
                    s ? "the original parameter object" : "nothing");
        else if (p < lo || p + (size_t)ne * es > hi)
            set_err(h->err_fwd, sizeof h->err_fwd,
                    "forward %d: slot '%s' data %p..+%lld elements is outside the unsharded flat "
                    "parameter [%p, %p)",
                    h->fwd_pre, info.fqn, (const void *)p, (long long)ne, (const void *)lo,
                    (const void *)hi);
        else if (p != lo + (size_t)info.offset * es || ne != info.numel ||
                 fsdp_tensor_ndim(s) != info.ndim ||
                 memcmp(fsdp_tensor_shape(s), info.shape, sizeof(int64_t) * (size_t)info.ndim))
            set_err(h->err_fwd, sizeof h->err_fwd,
                    "forward %d: slot '%s' is at element %lld with %lld elements, %d-d; want "
                    "offset %lld, %lld elements, %d-d",
                    h->fwd_pre, info.fqn, (long long)((p - lo) / (ptrdiff_t)es), (long long)ne,
                    fsdp_tensor_ndim(s), (long long)info.offset, (long long)info.numel, info.ndim);
    }
    return FSDP_OK;
}

/* After compute: the original objects, 1-D views into the local shard (or empty). */
static void check_originals(lin_watch_t *h, fsdp_module_t *m, char *err, size_t len,
                            const char *when) {
    fsdp_unit_t *u = h->u;
    fsdp_tensor_t *flat = fsdp_unit_flat_param(u);
    fsdp_flat_sizes_t fs;
    fsdp_unit_flat_sizes(u, &fs);
    size_t es = fsdp_dtype_size(fsdp_tensor_dtype(flat));
    const char *lo = fsdp_tensor_data(flat), *hi = lo + (size_t)fs.shard_numel * es;
    for (size_t i = 0; i < fsdp_unit_num_params(u); i++) {
        fsdp_param_info_t info;
        if (fsdp_unit_param_info(u, i, &info) < 0) {
            set_err(err, len, "param_info %zu failed", i);
            return;
        }
        fsdp_tensor_t *s = fsdp_module_param(m, info.fqn);
        if (s != info.param) {
            set_err(err, len, "%s: slot '%s' does not hold the original parameter object", when,
                    info.fqn);
            continue;
        }
        int64_t ne = fsdp_tensor_numel(s);
        const char *p = fsdp_tensor_data(s);
        if (ne != info.numel_in_shard || (ne > 0 && (p < lo || p + (size_t)ne * es > hi ||
                                                     p != lo + (size_t)info.offset_in_shard * es)))
            set_err(err, len,
                    "%s: '%s' has %lld elements at %p; want %lld in the local shard [%p, %p) at "
                    "element %lld",
                    when, info.fqn, (long long)ne, (const void *)p, (long long)info.numel_in_shard,
                    (const void *)lo, (const void *)hi, (long long)info.offset_in_shard);
    }
}

static int ag_fwd_post(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t *const *in, int nout,
                       fsdp_tensor_t **out) {
    (void)nin, (void)in, (void)nout, (void)out;
    lin_watch_t *h = arg;
    h->fwd_post++;
    check_originals(h, m, h->err_after, sizeof h->err_after, "after its forward");
    bool held = fsdp_unit_is_unsharded(h->u);
    bool want = h->strategy == FSDP_SHARD_GRAD_OP;
    if (held != want)
        set_err(h->err_after, sizeof h->err_after, "after forward %d the unit is %s under %s",
                h->fwd_post, held ? "unsharded" : "sharded",
                fsdp_sharding_strategy_name(h->strategy));
    return FSDP_OK;
}

static int ag_bwd_pre(fsdp_module_t *m, void *arg, bool has_grad) {
    (void)m, (void)has_grad;
    lin_watch_t *h = arg;
    h->bwd_pre++;
    fsdp_flat_sizes_t fs;
    fsdp_unit_flat_sizes(h->u, &fs);
    fsdp_tensor_t *full = fsdp_unit_full_param(h->u);
    size_t want = full ? (size_t)fs.padded_numel * fsdp_dtype_size(fsdp_tensor_dtype(full)) : 1;
    if (!fsdp_unit_is_unsharded(h->u) || !full || fsdp_tensor_storage_bytes(full) != want)
        set_err(h->err_bwd_pre, sizeof h->err_bwd_pre,
                "backward %d started with the unit %s (unsharded storage %zu bytes, want %zu)",
                h->bwd_pre, fsdp_unit_is_unsharded(h->u) ? "unsharded" : "sharded",
                full ? fsdp_tensor_storage_bytes(full) : 0, want);
    return FSDP_OK;
}

static int ag_bwd_post(fsdp_module_t *m, void *arg, bool has_grad) {
    (void)m, (void)has_grad;
    lin_watch_t *h = arg;
    h->bwd_post++;
    if (fsdp_unit_is_unsharded(h->u))
        set_err(h->err_bwd_post, sizeof h->err_bwd_post,
                "backward %d left the unit with its parameters unsharded", h->bwd_post);
    return FSDP_OK;
}

#define AG_LAYERS 5
#define AG_ITERS 3

static int ag_rank(fsdp_ctx_t *ctx, void *arg) {
    job_t *j = arg;
    res_t *r = res_of(j, ctx);
    fsdp_module_t *m = NULL, *lin = NULL;
    fsdp_unit_t *root = NULL, **u = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_tensor_t *x = NULL, *out = NULL, *loss = NULL;
    lin_watch_t h[AG_LAYERS];
    size_t n = 0;
    int post_mult[AG_LAYERS + 1];
    char why[760];
    int rc;
    const int64_t xs[2] = {2, 3};
    static const char *const lin_types[] = {"Linear", NULL};

    memset(h, 0, sizeof h);
    tm_manual_seed(ctx, 0);
    rc = fsdp_sequential_create(ctx, &m);
    for (int i = 0; i < AG_LAYERS && rc == 0; i++) {
        rc = fsdp_linear_create(ctx, 3, 3, true, &lin);
        if (rc == 0) rc = fsdp_module_append(m, lin);
        fsdp_module_release(lin);
        lin = NULL;
    }
    if (rc < 0) {
        fatal(r, ctx, "building Sequential(5 x Linear(3, 3))", rc);
        goto done;
    }
    fsdp_options_t o;
    job_options(j, &o);
    o.wrap_types = lin_types;
    if ((rc = fsdp_wrap(m, &o, &root)) < 0 || (rc = fsdp_units(root, &u, &n)) < 0 ||
        (rc = make_fsdp_sgd(ctx, root, 0.01, 0.9, &opt)) < 0) {
        fatal(r, ctx, "wrapping and the optimizer", rc);
        goto done;
    }
    if (!ck(r, n == AG_LAYERS + 1, "fsdp_units lists exactly 6 units", "%zu units", n)) goto done;
    /* Hooks after wrapping, so they run after FSDP's. */
    for (int i = 0; i < AG_LAYERS; i++) {
        char idx[8];
        snprintf(idx, sizeof idx, "%d", i);
        fsdp_module_t *l = fsdp_module_child(m, idx);
        h[i].u = fsdp_unit_of(l);
        h[i].strategy = j->strategy;
        int hd;
        if (!h[i].u || fsdp_unit_num_params(h[i].u) != 2) {
            ck(r, false, "each Linear is a unit with its weight and bias",
               "Linear %d: unit %p with %zu parameters", i, (void *)h[i].u,
               fsdp_unit_num_params(h[i].u));
            goto done;
        }
        if ((rc = fsdp_module_add_forward_pre_hook(l, ag_fwd_pre, &h[i], &hd)) < 0 ||
            (rc = fsdp_module_add_forward_hook(l, ag_fwd_post, &h[i], &hd)) < 0 ||
            (rc = fsdp_module_add_backward_pre_hook(l, ag_bwd_pre, &h[i], &hd)) < 0 ||
            (rc = fsdp_module_add_backward_hook(l, ag_bwd_post, &h[i], &hd)) < 0) {
            fatal(r, ctx, "adding hooks", rc);
            goto done;
        }
    }
    for (size_t i = 0; i < n; i++)
        post_mult[i] = fsdp_unit_num_params(u[i]) > 0;
    ck(r, fsdp_unit_num_params(root) == 0 && post_mult[0] == 0, "the root manages no parameters",
       "root has %zu", fsdp_unit_num_params(root));
    tm_manual_seed(ctx, 1 + (uint64_t)fsdp_ctx_rank(ctx));
    if ((rc = fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, xs, FSDP_MEM_ACTIVATIONS, &x)) < 0 ||
        (rc = fsdp_tensor_uniform_(x, -1.0, 1.0)) < 0) {
        fatal(r, ctx, "input", rc);
        goto done;
    }
    bool counters_ok = true, idle_ok = true, orig_ok = true;
    char cwhy[600] = "", iwhy[600] = "", owhy[600] = "";
    for (int it = 1; it <= AG_ITERS; it++) {
        fsdp_optim_zero_grad(opt, true);
        if ((rc = fsdp_module_forward1(m, x, &out)) < 0 || (rc = tm_sum_loss(out, &loss)) < 0) {
            fatal(r, ctx, "forward", rc);
            goto done;
        }
        /* Outside compute, every Linear's slots hold the original objects again. */
        for (int i = 0; i < AG_LAYERS && orig_ok; i++) {
            char idx[8];
            snprintf(idx, sizeof idx, "%d", i);
            check_originals(&h[i], fsdp_module_child(m, idx), owhy, sizeof owhy,
                            "after the model's forward");
            orig_ok = owhy[0] == 0;
        }
        if (counters_ok && !counters_are(u, n, post_mult, (uint64_t)it, cwhy, sizeof cwhy))
            counters_ok = false;
        if ((rc = fsdp_backward(loss, NULL)) < 0 || (rc = fsdp_optim_step(opt)) < 0) {
            fatal(r, ctx, "backward and step", rc);
            goto done;
        }
        if (idle_ok && !all_idle(u, n, iwhy, sizeof iwhy)) idle_ok = false;
        fsdp_tensor_release(out);
        fsdp_tensor_release(loss);
        out = loss = NULL;
    }
    static const char *const hook_checks[4] = {
        "CORE-AG-01: in forward the slots are views into the unsharded flat parameter at the "
        "parameters' offsets",
        "CORE-AG-01: after a unit's forward its slots hold the original objects, views into the "
        "local shard",
        "CORE-AG-01: a unit's backward starts with it unsharded",
        "a unit's parameters are freed when backward leaves it"};
    for (int k = 0; k < 4; k++) {
        bool ok = true;
        for (int i = 0; i < AG_LAYERS && ok; i++) {
            const char *e[4] = {h[i].err_fwd, h[i].err_after, h[i].err_bwd_pre, h[i].err_bwd_post};
            int calls[4] = {h[i].fwd_pre, h[i].fwd_post, h[i].bwd_pre, h[i].bwd_post};
            if (e[k][0] || calls[k] != AG_ITERS) {
                ok = false;
                snprintf(why, sizeof why, "Linear %d: hook ran %d times (want %d)%s%s", i, calls[k],
                         AG_ITERS, e[k][0] ? ": " : "", e[k]);
            }
        }
        ck(r, ok, hook_checks[k], "%s", why);
    }
    ck(r, orig_ok, "CORE-AG-01: after the model's forward every slot holds its original object",
       "%s", owhy);
    ck(r, counters_ok,
       "CORE-H03: registrations once per unit and iteration (the parameterless root: pre only)",
       "%s", cwhy);
    ck(r, idle_ok, "F19: every unit IDLE after each step", "%s", iwhy);
done:
    fsdp_tensor_release(x);
    fsdp_tensor_release(out);
    fsdp_tensor_release(loss);
    fsdp_tape_clear(ctx);
    free(u);
    fsdp_optim_destroy(opt);
    fsdp_destroy(root);
    fsdp_module_release(m);
    return rc;
}

/* ---- fsdp_wrap error paths ------------------------------------------------------------------- */

/* Tied: one parameter "tied_w" (registered by the caller); forward x W^T. */
static int tied_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                        fsdp_tensor_t **out) {
    if (nin != 1 || nout != 1) return FSDP_EINVAL;
    return fsdp_linear(in[0], fsdp_module_param(m, "tied_w"), NULL, &out[0]);
}

static const fsdp_module_ops_t tied_ops = {"Tied", tied_forward, NULL};

/* Sequential(Linear(3, 3), Linear(3, 3)) seeded 0 (so two builds are equal). */
static int seq2(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_module_t *m = NULL, *l = NULL;
    tm_manual_seed(ctx, 0);
    int rc = fsdp_sequential_create(ctx, &m);
    for (int i = 0; i < 2 && rc == 0; i++) {
        rc = fsdp_linear_create(ctx, 3, 3, true, &l);
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

/* Sequential(Linear(3, 3), Tied) where Tied's tied_w is the Linear's weight. */
static int tied_model(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_module_t *m = NULL, *l = NULL, *t = NULL;
    tm_manual_seed(ctx, 0);
    int rc = fsdp_sequential_create(ctx, &m);
    if (rc == 0) rc = fsdp_linear_create(ctx, 3, 3, true, &l);
    if (rc == 0) rc = fsdp_module_append(m, l);
    if (rc == 0) rc = fsdp_module_create(ctx, &tied_ops, NULL, &t);
    if (rc == 0) rc = fsdp_module_add_param(t, "tied_w", fsdp_module_param(l, "weight"));
    if (rc == 0) rc = fsdp_module_append(m, t);
    fsdp_module_release(l);
    fsdp_module_release(t);
    if (rc < 0) {
        fsdp_module_release(m);
        m = NULL;
    }
    *out = m;
    return rc;
}

static fsdp_tensor_t *test_input(fsdp_ctx_t *ctx) {
    const int64_t xs[2] = {2, 3};
    fsdp_tensor_t *x = NULL;
    tm_manual_seed(ctx, 17);
    if (fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, xs, FSDP_MEM_ACTIVATIONS, &x) < 0) return NULL;
    if (fsdp_tensor_uniform_(x, -1.0, 1.0) < 0) {
        fsdp_tensor_release(x);
        return NULL;
    }
    return x;
}

/* Forward of m and of ref on the same input agree (fp32 tolerance): 1, 0, or -1 on failure. */
static int forward_matches(fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_module_t *ref) {
    fsdp_tensor_t *x = test_input(ctx), *a = NULL, *b = NULL;
    int res = -1;
    if (x && fsdp_module_forward1(m, x, &a) == 0 && fsdp_module_forward1(ref, x, &b) == 0) {
        double c = closeness(b, a);
        res = c >= 0 && c <= 1.0;
    }
    fsdp_tensor_release(x);
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    fsdp_tape_clear(ctx);
    return res;
}

static bool shape_is(const fsdp_tensor_t *t, int64_t d0, int64_t d1) {
    return t && fsdp_tensor_ndim(t) == 2 && fsdp_tensor_size(t, 0) == d0 &&
           fsdp_tensor_size(t, 1) == d1;
}

static int err_rank(fsdp_ctx_t *ctx, void *arg) {
    job_t *j = arg;
    res_t *r = res_of(j, ctx);
    fsdp_module_t *m = NULL, *ref = NULL, *m2 = NULL;
    fsdp_unit_t *u = NULL, *u2 = NULL, *u3 = NULL;
    fsdp_tensor_t *f64 = NULL, *bias = NULL;
    fsdp_options_t o;
    const char *msg;
    int rc, ret = FSDP_OK;
    job_options(j, &o);

    /* NULL module (and NULL out). */
    u = (fsdp_unit_t *)&u2; /* any non-NULL value: must be cleared */
    rc = fsdp_wrap(NULL, &o, &u);
    ck(r, rc == FSDP_EINVAL && u == NULL,
       "fsdp_wrap(NULL module) is FSDP_EINVAL and sets *out "
       "to NULL",
       "rc %s, out %p", fsdp_err_name(rc), (void *)u);
    u = NULL;

    if ((rc = seq2(ctx, &m)) < 0 || (rc = seq2(ctx, &ref)) < 0) {
        ret = fatal(r, ctx, "building Sequential(Linear, Linear)", rc);
        goto done;
    }
    rc = fsdp_wrap(m, &o, NULL);
    ck(r, rc == FSDP_EINVAL && fsdp_unit_of(m) == NULL,
       "fsdp_wrap with out NULL is FSDP_EINVAL and wraps nothing", "rc %s", fsdp_err_name(rc));

    /* Bad options. */
    fsdp_options_t bad = o;
    bad.limit_all_gathers = -1;
    rc = fsdp_wrap(m, &bad, &u);
    msg = fsdp_ctx_last_error(ctx);
    ck(r, rc == FSDP_EINVAL && u == NULL && strstr(msg, "limit_all_gathers"),
       "a negative limit_all_gathers is FSDP_EINVAL naming the option", "rc %s, message '%s'",
       fsdp_err_name(rc), msg);
    bad = o;
    bad.strategy = FSDP_SHARDING_COUNT;
    rc = fsdp_wrap(m, &bad, &u);
    ck(r, rc == FSDP_EINVAL && u == NULL, "an invalid sharding strategy is FSDP_EINVAL", "rc %s",
       fsdp_err_name(rc));
    ck(r,
       fsdp_unit_of(m) == NULL && fsdp_unit_of(fsdp_module_child(m, "0")) == NULL &&
           shape_is(fsdp_module_param(m, "0.weight"), 3, 3),
       "after refused options the module is untouched (no unit, parameters as registered)",
       "unit %p, 0.weight 2-d (3, 3): %d", (void *)fsdp_unit_of(m),
       shape_is(fsdp_module_param(m, "0.weight"), 3, 3));
    int fm = forward_matches(ctx, m, ref);
    ck(r, fm == 1, "after refused options the module still computes what it did", "%d", fm);

    /* Wrapping twice, and wrapping a module inside a wrapped tree. */
    if ((rc = fsdp_wrap(m, &o, &u)) < 0) {
        ret = fatal(r, ctx, "wrapping Sequential(Linear, Linear)", rc);
        goto done;
    }
    rc = fsdp_wrap(m, &o, &u2);
    msg = fsdp_ctx_last_error(ctx);
    ck(r, rc == FSDP_EINVAL && u2 == NULL && strstr(msg, "already"),
       "wrapping a unit's module again is FSDP_EINVAL ('already a unit')", "rc %s, message '%s'",
       fsdp_err_name(rc), msg);
    rc = fsdp_wrap(fsdp_module_child(m, "1"), &o, &u2);
    msg = fsdp_ctx_last_error(ctx);
    ck(r, rc == FSDP_EINVAL && u2 == NULL && strstr(msg, "weight"),
       "wrapping a submodule whose parameters a unit already manages is FSDP_EINVAL naming the "
       "parameter",
       "rc %s, message '%s'", fsdp_err_name(rc), msg);
    ck(r,
       fsdp_unit_of(m) == u && fsdp_unit_is_root(u) &&
           fsdp_unit_of(fsdp_module_child(m, "1")) == NULL,
       "after the refused wraps the first unit is intact", "unit of m %p (want %p)",
       (void *)fsdp_unit_of(m), (void *)u);
    fm = forward_matches(ctx, m, ref);
    ck(r, fm == 1, "after the refused wraps the unit still computes the unwrapped model's output",
       "%d", fm);
    fsdp_destroy(u);
    u = NULL;
    fsdp_module_release(m);
    m = NULL;

    /* Mixed dtypes. */
    if ((rc = seq2(ctx, &m)) < 0) {
        ret = fatal(r, ctx, "building Sequential(Linear, Linear)", rc);
        goto done;
    }
    const int64_t three[1] = {3};
    bias = fsdp_tensor_retain(fsdp_module_param(m, "1.bias"));
    if ((rc = fsdp_tensor_zeros(ctx, FSDP_DTYPE_F64, 1, three, FSDP_MEM_PARAMS, &f64)) < 0 ||
        (rc = fsdp_tensor_copy_(f64, bias)) < 0 ||
        (rc = fsdp_tensor_set_requires_grad(f64, true)) < 0 ||
        (rc = fsdp_module_set_param(m, "1.bias", f64, false)) < 0) {
        ret = fatal(r, ctx, "making 1.bias f64", rc);
        goto done;
    }
    rc = fsdp_wrap(m, &o, &u);
    msg = fsdp_ctx_last_error(ctx);
    ck(r,
       rc == FSDP_EINVAL && u == NULL && strstr(msg, "1.bias") &&
           (strstr(msg, "0.weight") || strstr(msg, "0.bias") || strstr(msg, "1.weight")) &&
           strstr(msg, "f64"),
       "mixed dtypes: FSDP_EINVAL naming the f64 parameter and an f32 one", "rc %s, message '%s'",
       fsdp_err_name(rc), msg);
    ck(r,
       fsdp_unit_of(m) == NULL && fsdp_module_param(m, "1.bias") == f64 &&
           shape_is(fsdp_module_param(m, "0.weight"), 3, 3),
       "after the mixed-dtype refusal the module is untouched", "unit %p", (void *)fsdp_unit_of(m));
    if ((rc = fsdp_module_set_param(m, "1.bias", bias, false)) < 0) {
        ret = fatal(r, ctx, "restoring 1.bias", rc);
        goto done;
    }
    rc = fsdp_wrap(m, &o, &u);
    ck(r, rc == 0 && u, "with the dtype fixed the same module wraps", "rc %s (%s)",
       fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
    fm = u ? forward_matches(ctx, m, ref) : 0;
    ck(r, fm == 1, "and computes the unwrapped model's output", "%d", fm);
    fsdp_destroy(u);
    u = NULL;
    fsdp_module_release(m);
    m = NULL;

    /* A parameter shared by two units: Linear's weight is also Tied's tied_w. */
    if ((rc = tied_model(ctx, &m)) < 0 || (rc = tied_model(ctx, &m2)) < 0) {
        ret = fatal(r, ctx, "building the tied model", rc);
        goto done;
    }
    fsdp_module_t *c0 = fsdp_module_child(m, "0"), *c1 = fsdp_module_child(m, "1");
    int rc0 = fsdp_wrap(c0, &o, &u);
    char msg0[600];
    snprintf(msg0, sizeof msg0, "%s", fsdp_ctx_last_error(ctx));
    int rc1 = fsdp_wrap(c1, &o, &u2);
    msg = rc0 < 0 ? msg0 : fsdp_ctx_last_error(ctx);
    ck(r, (rc0 < 0 || rc1 < 0) && (strstr(msg, "tied_w") || strstr(msg, "weight")),
       "a parameter shared by two units: wrapping the second (or the first) is refused, naming "
       "the parameter",
       "wrap of '0' %s, of '1' %s; message '%s'", fsdp_err_name(rc0), fsdp_err_name(rc1), msg);
    if (rc0 == 0 && rc1 < 0) {
        rc = fsdp_wrap(m, &o, &u3);
        msg = fsdp_ctx_last_error(ctx);
        ck(r, rc < 0 && u3 == NULL && strstr(msg, "tied_w"),
           "wrapping the root over a unit whose parameter a sibling shares is refused, naming it",
           "rc %s, message '%s'", fsdp_err_name(rc), msg);
        ck(r,
           fsdp_unit_of(c0) == u && fsdp_unit_parent(u) == NULL && fsdp_unit_of(m) == NULL &&
               fsdp_unit_of(c1) == NULL,
           "after the refusals the first unit stands alone and nothing else is a unit",
           "unit of '0' %p (want %p), parent %p, unit of root %p, of '1' %p",
           (void *)fsdp_unit_of(c0), (void *)u, (void *)fsdp_unit_parent(u),
           (void *)fsdp_unit_of(m), (void *)fsdp_unit_of(c1));
        fm = forward_matches(ctx, c0, fsdp_module_child(m2, "0"));
        ck(r, fm == 1, "the first unit still computes its Linear", "%d", fm);
    }
    fsdp_destroy(u3);
    fsdp_destroy(u2);
    fsdp_destroy(u);
    u = u2 = u3 = NULL;
    fsdp_module_release(m);
    m = NULL;

    /* The same sharing met by an auto-wrap policy ({"Linear"}): the Linear becomes a unit, then
     * the root's wrap is refused, naming the parameter. (Whether the Linear's unit survives the
     * refusal is not promised; it is destroyed here if it did.) */
    if ((rc = tied_model(ctx, &m)) < 0) {
        ret = fatal(r, ctx, "building the tied model", rc);
        goto done;
    }
    static const char *const lin_types[] = {"Linear", NULL};
    fsdp_options_t po = o;
    po.wrap_types = lin_types;
    rc = fsdp_wrap(m, &po, &u);
    msg = fsdp_ctx_last_error(ctx);
    ck(r, rc == FSDP_EINVAL && u == NULL && strstr(msg, "tied_w"),
       "a parameter shared across units chosen by a wrap policy: FSDP_EINVAL naming it",
       "rc %s, message '%s'", fsdp_err_name(rc), msg);
    ck(r, fsdp_unit_of(m) == NULL, "the refused root is not a unit", "it is");
    fsdp_destroy(u);
    u = NULL;
    fsdp_unit_t *left = fsdp_unit_of(fsdp_module_child(m, "0"));
    if (left && fsdp_unit_is_root(left)) fsdp_destroy(left);
    fsdp_module_release(m);
    m = NULL;

    /* Control: a tensor shared inside one unit is fine (tied weights, as in the transformer). */
    if ((rc = tied_model(ctx, &m)) < 0) {
        ret = fatal(r, ctx, "building the tied model", rc);
        goto done;
    }
    rc = fsdp_wrap(m, &o, &u);
    ck(r, rc == 0 && u && fsdp_unit_num_params(u) == 2,
       "control: a parameter shared inside one unit wraps, flattened once",
       "rc %s (%s), %zu parameters", fsdp_err_name(rc), fsdp_ctx_last_error(ctx),
       fsdp_unit_num_params(u));
    fm = u ? forward_matches(ctx, m, m2) : 0;
    ck(r, fm == 1, "control: and computes the unwrapped tied model's output", "%d", fm);
done:
    fsdp_tensor_release(f64);
    fsdp_tensor_release(bias);
    fsdp_destroy(u3);
    fsdp_destroy(u2);
    fsdp_destroy(u);
    fsdp_module_release(m);
    fsdp_module_release(m2);
    fsdp_module_release(ref);
    return ret;
}

/* ---- main ------------------------------------------------------------------------------------ */

static job_t *new_job(const char *prefix, int world, fsdp_sharding_strategy_t s, bool orig) {
    job_t *j = calloc(1, sizeof *j);
    if (!j) tap_bail("out of memory");
    snprintf(j->prefix, sizeof j->prefix, "%s", prefix);
    j->world = world;
    j->strategy = s;
    j->bp = FSDP_BACKWARD_PRE;
    j->orig = orig;
    return j;
}

int main(int argc, char **argv) {
    (void)argc, (void)argv;
    tap_plan_lazy();
    for (int w = 2; w <= 3; w++) {
        job_t *j = new_job("CORE-PI-01 FULL_SHARD", w, FSDP_FULL_SHARD, false);
        run_job(j, pi_rank);
        free(j);
        j = new_job("CORE-PI-01 FULL_SHARD use_orig_params", w, FSDP_FULL_SHARD, true);
        run_job(j, pi_rank);
        free(j);
        j = new_job("CORE-H01/H02/H03 TransformerWithSharedParams FULL_SHARD", w, FSDP_FULL_SHARD,
                    false);
        run_job(j, hooks_rank);
        free(j);
        j = new_job("CORE-H01 TwiceModel FULL_SHARD", w, FSDP_FULL_SHARD, false);
        run_job(j, twice_rank);
        free(j);
        j = new_job("CORE-NG-01 TransformerWithSharedParams FULL_SHARD", w, FSDP_FULL_SHARD, false);
        run_job(j, ng_rank);
        free(j);
    }
    {
        job_t *j = new_job("CORE-H01 TwiceModel SHARD_GRAD_OP use_orig_params", 2,
                           FSDP_SHARD_GRAD_OP, true);
        run_job(j, twice_rank);
        free(j);
    }
    const fsdp_sharding_strategy_t strategies[2] = {FSDP_FULL_SHARD, FSDP_SHARD_GRAD_OP};
    const fsdp_backward_prefetch_t bps[3] = {FSDP_BACKWARD_PREFETCH_NONE, FSDP_BACKWARD_PRE,
                                             FSDP_BACKWARD_POST};
    for (int w = 2; w <= 3; w++)
        for (int s = 0; s < 2; s++)
            for (int orig = 0; orig < 2; orig++)
                for (int fp = 0; fp < 2; fp++)
                    for (int b = 0; b < 3; b++) {
                        char prefix[160];
                        snprintf(prefix, sizeof prefix,
                                 "CORE-AG-01 %s use_orig_params=%d forward_prefetch=%d "
                                 "backward_prefetch=%s",
                                 fsdp_sharding_strategy_name(strategies[s]), orig, fp,
                                 fsdp_backward_prefetch_name(bps[b]));
                        job_t *j = new_job(prefix, w, strategies[s], orig);
                        j->fwd_prefetch = fp;
                        j->bp = bps[b];
                        run_job(j, ag_rank);
                        free(j);
                    }
    for (int orig = 0; orig < 2; orig++) {
        job_t *j = new_job(orig ? "fsdp_wrap errors use_orig_params" : "fsdp_wrap errors", 2,
                           FSDP_FULL_SHARD, orig);
        run_job(j, err_rank);
        free(j);
    }
    return tap_done();
}
