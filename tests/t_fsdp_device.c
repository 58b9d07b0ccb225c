/*
 * t_fsdp_device.c: the wrapper's compute device (options.device, PyTorch's device_id; spec F07)
 * and CPU offload with a compute device other than the host (F08).
 *
 * This build has no GPU, so each rank makes two distinct CPU device objects: H (the "host",
 * where the model is built) and A (the "accelerator", options.device). The library tells
 * devices apart by object, never by kind, so everything that would cross PCIe on a GPU build
 * crosses between H and A here: a tensor on the wrong one is refused by every operation.
 *
 * NestedWrappedModule with upstream's units (module.1.0, module.1, module.2, then the root),
 * plus a buffer in the root's part and one in a nested unit, trained 2 SGD steps (momentum,
 * clip_grad_norm, zero_grad without set_to_none, so step 2 accumulates into the existing
 * sharded gradient) in three variants per rank:
 *   REF  built on A, wrapped without options.device, no offload;
 *   MOVE built on H, wrapped with device A (F07): parameters, flat parameters and buffers end up
 *        on A; the inputs, made on H, are moved by the root;
 *   OFF  built on H, wrapped with device A and cpu_offload (F08): shards, original parameters
 *        and sharded gradients on H (FSDP_MEM_OFFLOAD, byte-exact), unsharded parameters and
 *        compute views on A (checked from a forward pre-hook of a managed Linear);
 * MOVE and OFF must give bitwise REF's losses, gradient norms and full parameters, at world 2
 * and 3, FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, and at world 2 with use_orig_params, with
 * bf16 mixed precision, and with every unit given the device (instead of nested units taking
 * it from the root). summon_full_params with offload_to_cpu shows OFF's parameters on H.
 *
 * Errors: options.device of another context is FSDP_EINVAL naming the option; a parameter
 * moved after wrapping is refused at the root's lazy init (the first forward): off the host with
 * offload (PyTorch's "An FSDP-managed module with parameter CPU offloading enabled has
 * parameters on cuda", the CUDA_AFTER case), and off the compute device without. The public
 * API has no module.to(device); the move goes through fsdp__tensor_move, the internal path
 * fsdp_wrap itself uses for options.device. Offload with parameters on a non-host device at
 * wrap time (CUDA_BEFORE + offload, refused by fsdp_wrap) needs a CUDA device and is not built
 * here.
 *
 * Ranks are threads of a sim run. Every rank makes the same checks in the same order into its
 * own log; the main thread prints one TAP line per check, passing when every rank passed it.
 */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp/fsdp_impl.h"
#include "models/models.h"
#include "tap.h"

#define MAXR 3
#define MAXC 64
#define STEPS 2

/* ---- per-rank check logs (as t_fsdp_summon.c) ------------------------------------------------ */

typedef struct check {
    char name[200];
    bool ok;
    char why[600];
} check_t;

typedef struct ranklog {
    int n;
    check_t c[MAXC];
} ranklog_t;

typedef struct job {
    const char *title;
    int world;
    fsdp_sharding_strategy_t strategy;
    bool orig;   /* use_orig_params */
    bool mp;     /* bf16 parameters */
    bool every;  /* every unit gets options.device (else nested units take the root's) */
    bool errors; /* the error-path job instead of training */
    ranklog_t log[MAXR];
} job_t;

static bool ck(ranklog_t *L, bool ok, const char *name, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static bool ck(ranklog_t *L, bool ok, const char *name, const char *fmt, ...) {
    if (L->n >= MAXC) return ok;
    check_t *c = &L->c[L->n++];
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

#define TRY(label, what, call)                                                                     \
    do {                                                                                           \
        rc = (call);                                                                               \
        if (rc < 0) {                                                                              \
            ck(L, false, what, "%s failed: %s (%s)", what, fsdp_err_name(rc),                      \
               fsdp_ctx_last_error(ctx));                                                          \
            goto label;                                                                            \
        }                                                                                          \
    } while (0)

static void run(job_t *j, fsdp_sim_fn fn) {
    fsdp_sim_options_t so;
    fsdp_sim_options_init(&so);
    so.world_size = j->world;
    so.seed = 11;
    so.timeout_ms = 60000;
    int st[MAXR] = {0}, n = 0;
    int rc = fsdp_sim_run(&so, fn, j, st);
    for (int r = 0; r < j->world; r++)
        if (j->log[r].n > n) n = j->log[r].n;
    for (int i = 0; i < n; i++) {
        const char *name = "?";
        bool ok = true;
        for (int r = j->world - 1; r >= 0; r--) {
            if (i >= j->log[r].n) {
                ok = false;
                continue;
            }
            name = j->log[r].c[i].name;
            ok &= j->log[r].c[i].ok;
        }
        for (int r = 0; r < j->world && !ok; r++) {
            if (i >= j->log[r].n)
                tap_diag("rank %d did not get to this check", r);
            else if (!j->log[r].c[i].ok)
                tap_diag("rank %d: %s", r, j->log[r].c[i].why);
        }
        tap_ok(ok, "%s W=%d: %s", j->title, j->world, name);
    }
    bool done = rc == 0;
    for (int r = 0; r < j->world; r++) {
        if (st[r] != 0) tap_diag("rank %d returned %s", r, fsdp_err_name(st[r]));
        done &= st[r] == 0;
    }
    tap_ok(done, "%s W=%d: every rank ran to the end", j->title, j->world);
}

/* ---- helpers --------------------------------------------------------------------------------- */

typedef struct vals {
    double *v;
    size_t n;
} vals_t;

static void vfree(vals_t *a) {
    free(a->v);
    *a = (vals_t){0};
}

/* The elements of every parameter (grads: of its gradient) of m's tree, concatenated; *all_on
 * (may be NULL) says whether every one of them is on dev. A missing gradient is FSDP_EINVAL. */
static int module_values(const fsdp_module_t *m, bool grads, const fsdp_device_t *dev, bool *all_on,
                         vals_t *out) {
    fsdp_named_list_t l = {0};
    int rc = fsdp_module_named_params(m, false, &l);
    vfree(out);
    if (all_on) *all_on = true;
    for (size_t i = 0; i < l.n; i++)
        out->n += (size_t)fsdp_tensor_numel(l.tensors[i]);
    if (rc == 0 && !(out->v = malloc((out->n ? out->n : 1) * sizeof *out->v))) rc = FSDP_ENOMEM;
    size_t k = 0;
    for (size_t i = 0; i < l.n && rc == 0; i++) {
        const fsdp_tensor_t *t = grads ? fsdp_tensor_grad(l.tensors[i]) : l.tensors[i];
        if (!t) rc = FSDP_EINVAL;
        if (all_on && t && fsdp_tensor_device(t) != dev) *all_on = false;
        for (int64_t e = 0; e < fsdp_tensor_numel(l.tensors[i]) && rc == 0; e++)
            rc = fsdp_tensor_item(t, e, &out->v[k++]);
    }
    fsdp_named_list_free(&l);
    return rc;
}

/* The value written into element k (in named order) of the full parameters. */
static float pat(size_t k) {
    return (float)(0.25 + 1e-3 * (double)(k % 997));
}

/* Writes pat() into every parameter of m's tree (full tensors while summoned). */
static int store_pattern(fsdp_module_t *m) {
    fsdp_named_list_t l = {0};
    int rc = fsdp_module_named_params(m, false, &l);
    size_t k = 0;
    for (size_t i = 0; i < l.n && rc == 0; i++) {
        int64_t n = fsdp_tensor_numel(l.tensors[i]);
        float *f = malloc((size_t)(n ? n : 1) * sizeof *f);
        if (!f) rc = FSDP_ENOMEM;
        for (int64_t e = 0; e < n && rc == 0; e++)
            f[e] = pat(k++);
        if (rc == 0) rc = fsdp_tensor_copy_from_host(l.tensors[i], f, (size_t)n * sizeof *f);
        free(f);
    }
    fsdp_named_list_free(&l);
    return rc;
}

/* Bitwise equality of two value lists; the first difference into why. */
static bool same_vals(const vals_t *a, const vals_t *b, char *why, size_t len) {
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

/* Whether every parameter and buffer of m's tree is on dev (names the first that is not). */
static bool tree_on(const fsdp_module_t *m, bool buffers, const fsdp_device_t *dev, char *why,
                    size_t len) {
    fsdp_named_list_t l = {0};
    int rc =
        buffers ? fsdp_module_named_buffers(m, false, &l) : fsdp_module_named_params(m, false, &l);
    bool ok = rc == 0 && l.n > 0;
    if (!ok) snprintf(why, len, "listing failed or empty (rc %d, %zu)", rc, l.n);
    for (size_t i = 0; i < l.n && ok; i++)
        if (fsdp_tensor_device(l.tensors[i]) != dev) {
            snprintf(why, len, "'%s' is on another device", l.names[i]);
            ok = false;
        }
    fsdp_named_list_free(&l);
    return ok;
}

/* ---- one training run ------------------------------------------------------------------------ */

enum { V_REF, V_MOVE, V_OFF, V_COUNT };
static const char *const vname[V_COUNT] = {"REF", "MOVE (F07 device)", "OFF (F08 offload)"};

typedef struct result {
    double loss[STEPS], norm[STEPS];
    vals_t params;
    vals_t grads; /* use_orig_params: the full gradients of the last step (summon with_grads) */
} result_t;

/* A forward pre-hook on a managed Linear, run after the unit's own: what the module computes
 * with. */
typedef struct probe {
    const fsdp_device_t *want;
    int64_t full_numel; /* of the weight */
    int calls, bad;
} probe_t;

static int probe_hook(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t **in) {
    probe_t *p = arg;
    fsdp_tensor_t *w = fsdp_module_param(m, "weight");
    p->calls++;
    if (!w || fsdp_tensor_device(w) != p->want || fsdp_tensor_numel(w) != p->full_numel ||
        nin < 1 || fsdp_tensor_device(in[0]) != p->want)
        p->bad++;
    return FSDP_OK;
}

/* Bytes of every unit's local shard (the flat parameter). */
static size_t shard_bytes(const fsdp_unit_t *root) {
    fsdp_unit_t **units = NULL;
    size_t nu = 0, b = 0;
    if (fsdp_units(root, &units, &nu) < 0) return 0;
    for (size_t i = 0; i < nu; i++) {
        fsdp_tensor_t *f = fsdp_unit_flat_param(units[i]);
        if (f) b += (size_t)fsdp_tensor_numel(f) * fsdp_dtype_size(fsdp_tensor_dtype(f));
    }
    free(units);
    return b;
}

/* Whether every unit's flat parameter (and, with grads, its gradient) is on flat_dev, its
 * unsharded parameter and compute device on dev. */
static bool units_on(const fsdp_unit_t *root, const fsdp_device_t *flat_dev,
                     const fsdp_device_t *dev, bool grads, char *why, size_t len) {
    fsdp_unit_t **units = NULL;
    size_t nu = 0;
    bool ok = fsdp_units(root, &units, &nu) == 0;
    for (size_t i = 0; i < nu && ok; i++) {
        fsdp_tensor_t *f = fsdp_unit_flat_param(units[i]);
        const char *what = NULL;
        if (fsdp_unit_compute_device(units[i]) != dev)
            what = "compute device";
        else if (f && fsdp_tensor_device(f) != flat_dev)
            what = "flat parameter";
        else if (f && fsdp_tensor_device(fsdp_unit_full_param(units[i])) != dev)
            what = "unsharded parameter";
        else if (f && grads &&
                 (!fsdp_tensor_grad(f) || fsdp_tensor_device(fsdp_tensor_grad(f)) != flat_dev))
            what = "sharded gradient";
        if (what) {
            snprintf(why, len, "unit '%s': %s on the wrong device (or missing)",
                     fsdp_unit_fqn(units[i]), what);
            ok = false;
        }
    }
    free(units);
    return ok;
}

static bool all_idle(const fsdp_unit_t *root) {
    fsdp_unit_t **units = NULL;
    size_t nu = 0;
    bool ok = fsdp_units(root, &units, &nu) == 0;
    for (size_t i = 0; i < nu && ok; i++)
        ok = fsdp_unit_state(units[i]) == FSDP_STATE_IDLE &&
             (!fsdp_unit_is_unsharded(units[i]) || fsdp_unit_strategy(units[i]) == FSDP_NO_SHARD);
    free(units);
    return ok;
}

/* Adds a persistent f32 buffer `name` of 3 elements (value v) to m, on the context's device. */
static int add_buffer(fsdp_ctx_t *ctx, fsdp_module_t *m, const char *name, double v) {
    const int64_t n[1] = {3};
    fsdp_tensor_t *b = NULL;
    int rc = fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 1, n, v, FSDP_MEM_OTHER, &b);
    if (rc == 0) rc = fsdp_module_add_buffer(m, name, b, true);
    fsdp_tensor_release(b);
    return rc;
}

static void wrap_options(const job_t *j, int v, fsdp_device_t *A, fsdp_options_t *o) {
    fsdp_options_init(o);
    o->strategy = j->strategy;
    o->use_orig_params = j->orig;
    o->check_exec_order = true;
    o->cpu_offload = v == V_OFF;
    o->device = v == V_REF ? NULL : A;
    if (j->mp) {
        o->mixed_precision.enabled = true;
        o->mixed_precision.param_dtype = FSDP_DTYPE_BF16;
    }
}

/* NestedWrappedModule with buffers, built on `build`, wrapped for variant v. */
static int build_wrapped(fsdp_ctx_t *ctx, const job_t *j, int v, fsdp_device_t *build,
                         fsdp_device_t *A, fsdp_module_t **m, fsdp_unit_t **root) {
    static const char *const inner[] = {"module.1.0", "module.1", "module.2"};
    fsdp_options_t o, oi;
    wrap_options(j, v, A, &o);
    oi = o;
    if (!j->every) oi.device = NULL; /* nested units take the root's device */
    int rc = fsdp_ctx_set_device(ctx, build);
    if (rc == 0) rc = tm_nested_wrapped_create(ctx, true, m);
    if (rc == 0) rc = add_buffer(ctx, fsdp_module_child(*m, "module.0"), "stat", 1.5);
    if (rc == 0) rc = add_buffer(ctx, fsdp_module_child(*m, "module.1.0"), "stat", 2.5);
    for (int i = 0; i < 3 && rc == 0; i++) {
        fsdp_unit_t *u = NULL;
        rc = fsdp_wrap(fsdp_module_child(*m, inner[i]), &oi, &u);
    }
    if (rc == 0) rc = fsdp_wrap(*m, &o, root);
    return rc;
}

static int train(fsdp_ctx_t *ctx, job_t *j, int v, fsdp_device_t *A, fsdp_device_t *H,
                 result_t *res) {
    ranklog_t *L = &j->log[fsdp_ctx_rank(ctx)];
    fsdp_device_t *build = v == V_REF ? A : H;
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_named_list_t np = {0};
    fsdp_tensor_t *x = NULL, *y = NULL, *loss = NULL;
    probe_t probe[2] = {{A, 8 * 4, 0, 0}, {A, 16 * 4, 0, 0}};
    fsdp_module_t *probed[2] = {NULL, NULL};
    int hooks[2] = {0, 0};
    char why[300] = "", name[200];
    fsdp_mem_stats_t ms;
    int rc = FSDP_OK;

    TRY(out, "building and wrapping", build_wrapped(ctx, j, v, build, A, &m, &root));
    if (v != V_REF) {
        snprintf(name, sizeof name, "%s: original parameters on %s after wrap", vname[v],
                 v == V_OFF ? "the host H" : "the device A");
        ck(L, tree_on(m, false, v == V_OFF ? H : A, why, sizeof why), name, "%s", why);
        snprintf(name, sizeof name, "%s: buffers moved to A", vname[v]);
        ck(L, tree_on(m, true, A, why, sizeof why), name, "%s", why);
        snprintf(name, sizeof name, "%s: flat parameters on %s, unsharded ones on A", vname[v],
                 v == V_OFF ? "H" : "A");
        ck(L, units_on(root, v == V_OFF ? H : A, A, false, why, sizeof why), name, "%s", why);
    }
    fsdp_mem_get_stats(ctx, &ms);
    if (v == V_OFF) {
        ck(L, ms.current[FSDP_MEM_OFFLOAD] == shard_bytes(root),
           "OFF (F08 offload): FSDP_MEM_OFFLOAD holds exactly the shards after wrap",
           "%zu bytes, shards %zu", ms.current[FSDP_MEM_OFFLOAD], shard_bytes(root));
    }

    /* Train on A: the context's device is the compute device (torch.cuda.set_device). */
    TRY(out, "fsdp_ctx_set_device(A)", fsdp_ctx_set_device(ctx, A));
    const char *paths[2] = {"module.0", "module.1.0"};
    for (int i = 0; i < 2; i++) {
        probed[i] = fsdp_module_child(m, paths[i]);
        TRY(out, "adding the probe",
            fsdp_module_add_forward_pre_hook(probed[i], probe_hook, &probe[i], &hooks[i]));
    }
    fsdp_sgd_options_t so;
    fsdp_sgd_options_init(&so);
    so.lr = 0.05;
    so.momentum = 0.9;
    TRY(out, "fsdp_named_params", fsdp_named_params(root, &np));
    TRY(out, "creating SGD", fsdp_optim_sgd_create(ctx, &so, &opt));
    TRY(out, "adding the parameters",
        fsdp_optim_add_group(opt, np.n, np.tensors, (const char *const *)np.names, NULL, NULL));
    bool idle = true, grads_ok = true, mem_ok = true;
    for (int s = 0; s < STEPS; s++) {
        /* The input is made on the build device: the root moves it to A. */
        TRY(out, "fsdp_ctx_set_device(build)", fsdp_ctx_set_device(ctx, build));
        TRY(out, "making the input", tm_nested_wrapped_get_input(ctx, &x));
        TRY(out, "fsdp_ctx_set_device(A)", fsdp_ctx_set_device(ctx, A));
        TRY(out, "forward", fsdp_module_forward1(m, x, &y));
        TRY(out, "loss", tm_sum_loss(y, &loss));
        TRY(out, "reading the loss", fsdp_tensor_item(loss, 0, &res->loss[s]));
        TRY(out, "backward", fsdp_backward(loss, NULL));
        if (v != V_REF && !units_on(root, v == V_OFF ? H : A, A, true, why, sizeof why)) {
            grads_ok = false;
            ck(L, false, "sharded gradients where the shards are", "step %d: %s", s, why);
        }
        fsdp_mem_get_stats(ctx, &ms);
        size_t want = v == V_OFF ? 2 * shard_bytes(root) : 0;
        if (ms.current[FSDP_MEM_OFFLOAD] != want) {
            mem_ok = false;
            ck(L, false, "FSDP_MEM_OFFLOAD after backward", "step %d: %zu bytes, want %zu", s,
               ms.current[FSDP_MEM_OFFLOAD], want);
        }
        TRY(out, "clip_grad_norm", fsdp_unit_clip_grad_norm(root, 0.5, 2.0, &res->norm[s]));
        if (j->orig && s == STEPS - 1) {
            /* summon with_grads: an offloaded gradient is gathered on A. */
            fsdp_summon_options_t sg;
            fsdp_summon_options_init(&sg);
            sg.writeback = false;
            sg.with_grads = true;
            bool on = false;
            TRY(out, "summon with_grads", fsdp_summon_begin(root, &sg));
            rc = module_values(m, true, A, &on, &res->grads);
            int rc2 = fsdp_summon_end(root);
            TRY(out, "reading the full gradients", rc ? rc : rc2);
            snprintf(name, sizeof name, "%s: summon with_grads shows full gradients on A",
                     vname[v]);
            ck(L, on, name, "a gradient is not on A");
        }
        TRY(out, "optimizer step", fsdp_optim_step(opt));
        TRY(out, "zero_grad", fsdp_optim_zero_grad(opt, false));
        idle &= all_idle(root);
        fsdp_tensor_release(loss);
        fsdp_tensor_release(y);
        fsdp_tensor_release(x);
        loss = y = x = NULL;
    }
    snprintf(name, sizeof name, "%s: every unit idle and resharded after each step", vname[v]);
    ck(L, idle, name, "a unit was left running or unsharded");
    if (v != V_REF) {
        snprintf(name, sizeof name, "%s: sharded gradients stay on %s after each backward",
                 vname[v], v == V_OFF ? "H" : "A");
        if (grads_ok) ck(L, true, name, "-");
        snprintf(name, sizeof name, "%s: FSDP_MEM_OFFLOAD holds %s after each backward", vname[v],
                 v == V_OFF ? "exactly shards and gradients" : "nothing");
        if (mem_ok) ck(L, true, name, "-");
        snprintf(name, sizeof name,
                 "%s: during forward the modules compute with unsharded parameters and inputs "
                 "on A",
                 vname[v]);
        ck(L, probe[0].calls == STEPS && probe[1].calls == STEPS && !probe[0].bad && !probe[1].bad,
           name, "probe calls %d/%d, bad %d/%d", probe[0].calls, probe[1].calls, probe[0].bad,
           probe[1].bad);
    }

    /* The full parameters (summon without writeback; with offload they are unsharded on A). */
    fsdp_summon_options_t sm;
    fsdp_summon_options_init(&sm);
    sm.writeback = false;
    bool on = false;
    TRY(out, "summon", fsdp_summon_begin(root, &sm));
    rc = module_values(m, false, A, &on, &res->params);
    int rc2 = fsdp_summon_end(root);
    TRY(out, "reading the full parameters", rc ? rc : rc2);
    snprintf(name, sizeof name, "%s: summoned full parameters on A", vname[v]);
    ck(L, on, name, "a full parameter is not on A");
    /* offload_to_cpu: on the offload host H with offload, else on the (host-kind) device A. */
    sm.offload_to_cpu = true;
    vals_t host = {0};
    TRY(out, "summon offload_to_cpu", fsdp_summon_begin(root, &sm));
    rc = module_values(m, false, v == V_OFF ? H : A, &on, &host);
    rc2 = fsdp_summon_end(root);
    if (rc == 0) rc = rc2;
    if (rc < 0) vfree(&host);
    TRY(out, "reading the offloaded full parameters", rc);
    snprintf(name, sizeof name, "%s: summon offload_to_cpu shows the same values on %s", vname[v],
             v == V_OFF ? "H" : "A");
    ck(L, on && same_vals(&host, &res->params, why, sizeof why), name, "%s",
       on ? why : "a parameter is on the wrong device");
    vfree(&host);

    /* summon with writeback: each rank's part of a change reaches its shard (on H with
     * offload), and the next summon shows it. */
    sm.offload_to_cpu = false;
    sm.writeback = true;
    TRY(out, "summon writeback", fsdp_summon_begin(root, &sm));
    rc = store_pattern(m);
    rc2 = fsdp_summon_end(root);
    TRY(out, "writing the full parameters", rc ? rc : rc2);
    sm.writeback = false;
    TRY(out, "summon", fsdp_summon_begin(root, &sm));
    rc = module_values(m, false, NULL, NULL, &host);
    rc2 = fsdp_summon_end(root);
    if (rc == 0) rc = rc2;
    if (rc < 0) vfree(&host);
    TRY(out, "reading the written parameters", rc);
    size_t bad = 0;
    while (bad < host.n && host.v[bad] == (double)pat(bad))
        bad++;
    snprintf(name, sizeof name, "%s: a summon writeback reaches the shards", vname[v]);
    ck(L, host.n > 0 && bad == host.n, name, "element %zu of %zu reads %.9g, wrote %.9g", bad,
       host.n, bad < host.n ? host.v[bad] : 0.0, bad < host.n ? (double)pat(bad) : 0.0);
    vfree(&host);
out:
    for (int i = 0; i < 2; i++)
        if (hooks[i] > 0) fsdp_module_remove_hook(probed[i], hooks[i]);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(y);
    fsdp_tensor_release(x);
    fsdp_tape_clear(ctx);
    fsdp_optim_destroy(opt);
    fsdp_named_list_free(&np);
    fsdp_destroy(root);
    fsdp_module_release(m);
    fsdp_ctx_set_device(ctx, NULL);
    return rc;
}

static int train_rank(fsdp_ctx_t *ctx, void *arg) {
    job_t *j = arg;
    ranklog_t *L = &j->log[fsdp_ctx_rank(ctx)];
    fsdp_device_t *A = NULL, *H = NULL;
    result_t res[V_COUNT];
    memset(res, 0, sizeof res);
    int rc = FSDP_OK;
    TRY(out, "creating device A", fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &A));
    TRY(out, "creating device H", fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &H));
    for (int v = 0; v < V_COUNT; v++)
        if ((rc = train(ctx, j, v, A, H, &res[v])) < 0) goto out;
    for (int v = V_MOVE; v < V_COUNT; v++) {
        char why[300] = "", name[200];
        bool same = true;
        for (int s = 0; s < STEPS && same; s++)
            if (memcmp(&res[v].loss[s], &res[V_REF].loss[s], sizeof(double)) != 0) {
                snprintf(why, sizeof why, "step %d: loss %.9g, REF %.9g", s, res[v].loss[s],
                         res[V_REF].loss[s]);
                same = false;
            }
        snprintf(name, sizeof name, "%s: losses bitwise equal to REF (model built on A)", vname[v]);
        ck(L, same, name, "%s", why);
        same = true;
        for (int s = 0; s < STEPS && same; s++)
            if (memcmp(&res[v].norm[s], &res[V_REF].norm[s], sizeof(double)) != 0) {
                snprintf(why, sizeof why, "step %d: norm %.9g, REF %.9g", s, res[v].norm[s],
                         res[V_REF].norm[s]);
                same = false;
            }
        snprintf(name, sizeof name, "%s: clip_grad_norm totals bitwise equal to REF", vname[v]);
        ck(L, same, name, "%s", why);
        snprintf(name, sizeof name, "%s: full parameters after %d steps bitwise equal to REF",
                 vname[v], STEPS);
        ck(L, same_vals(&res[v].params, &res[V_REF].params, why, sizeof why), name, "%s", why);
        if (j->orig) {
            snprintf(name, sizeof name, "%s: full gradients (with_grads) bitwise equal to REF",
                     vname[v]);
            ck(L, same_vals(&res[v].grads, &res[V_REF].grads, why, sizeof why), name, "%s", why);
        }
    }
out:
    for (int v = 0; v < V_COUNT; v++) {
        vfree(&res[v].params);
        vfree(&res[v].grads);
    }
    fsdp_ctx_set_device(ctx, NULL);
    fsdp_device_destroy(H);
    fsdp_device_destroy(A);
    return rc;
}

/* ---- errors ---------------------------------------------------------------------------------- */

/* rc must be FSDP_EINVAL with a message holding every key. */
static void ck_einval(ranklog_t *L, fsdp_ctx_t *ctx, int rc, const char *k1, const char *k2,
                      const char *name) {
    const char *msg = fsdp_ctx_last_error(ctx);
    ck(L, rc == FSDP_EINVAL && msg && strstr(msg, k1) && (!k2 || strstr(msg, k2)), name,
       "rc %s, message \"%s\"; want EINVAL naming \"%s\"%s%s", fsdp_err_name(rc), msg ? msg : "",
       k1, k2 ? " and " : "", k2 ? k2 : "");
}

/* Wraps NestedWrappedModule built on H (options as job j, variant v), moves `param` to `to`
 * and checks that the first forward is refused naming it and `key`, with nothing run. */
static void refused_after_move(fsdp_ctx_t *ctx, ranklog_t *L, job_t *j, int v, fsdp_device_t *A,
                               fsdp_device_t *H, fsdp_device_t *to, const char *param,
                               const char *key, const char *name) {
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *x = NULL, *y = NULL;
    int rc = FSDP_OK;
    TRY(out, "building and wrapping", build_wrapped(ctx, j, v, H, A, &m, &root));
    TRY(out, "fsdp_ctx_set_device(A)", fsdp_ctx_set_device(ctx, A));
    TRY(out, "making the input", tm_nested_wrapped_get_input(ctx, &x));
    /* The move PyTorch's `.cuda()` after wrapping makes (CUDA_AFTER). */
    TRY(out, "moving the parameter", fsdp__tensor_move(fsdp_module_param(m, param), to));
    rc = fsdp_module_forward1(m, x, &y);
    ck_einval(L, ctx, rc, key, param, name);
    ck(L, all_idle(root) && fsdp_tape_size(ctx) == 0,
       "after the refusal every unit is idle and sharded, nothing recorded", "state changed");
out:
    fsdp_tensor_release(y);
    fsdp_tensor_release(x);
    fsdp_tape_clear(ctx);
    fsdp_destroy(root);
    fsdp_module_release(m);
    fsdp_ctx_set_device(ctx, NULL);
}

static int error_rank(fsdp_ctx_t *ctx, void *arg) {
    job_t *j = arg;
    ranklog_t *L = &j->log[fsdp_ctx_rank(ctx)];
    fsdp_device_t *A = NULL, *H = NULL, *other_dev = NULL;
    fsdp_ctx_t *other = NULL;
    fsdp_module_t *m = NULL;
    fsdp_unit_t *u = NULL;
    int rc = FSDP_OK;
    TRY(out, "creating device A", fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &A));
    TRY(out, "creating device H", fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &H));

    /* options.device of another context (another rank's device). */
    TRY(out, "creating another context", fsdp_ctx_create(NULL, &other));
    TRY(out, "creating its device", fsdp_device_create(other, FSDP_DEVICE_CPU, NULL, &other_dev));
    TRY(out, "fsdp_ctx_set_device(H)", fsdp_ctx_set_device(ctx, H));
    TRY(out, "building the model", tm_nested_wrapped_create(ctx, true, &m));
    fsdp_options_t o;
    fsdp_options_init(&o);
    o.device = other_dev;
    rc = fsdp_wrap(m, &o, &u);
    ck_einval(L, ctx, rc, "options.device", "context",
              "F07: options.device of another context is refused naming the option");
    o.cpu_offload = true;
    rc = fsdp_wrap(m, &o, &u);
    ck_einval(L, ctx, rc, "options.device", NULL, "F07: ... also with cpu_offload");
    o.cpu_offload = false;
    o.wrap_types = (const char *const[]){"Linear", NULL};
    rc = fsdp_wrap(m, &o, &u);
    ck_einval(L, ctx, rc, "options.device", NULL,
              "F07: ... also with an auto-wrap policy (before any child is wrapped)");
    char why[300] = "";
    bool alone = u == NULL && fsdp_unit_of(fsdp_module_child(m, "module.0")) == NULL &&
                 fsdp_unit_of(m) == NULL;
    ck(L, alone && tree_on(m, false, H, why, sizeof why),
       "F07: the refused wraps left the module alone (no unit, parameters on H)", "%s",
       alone ? why : "a unit was made");
    o.wrap_types = NULL;
    o.device = A;
    rc = fsdp_wrap(m, &o, &u);
    ck(L, rc == 0 && fsdp_unit_compute_device(u) == A,
       "F07: the same module wraps with a device of its own context", "rc %s: %s",
       fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
    fsdp_destroy(u);
    u = NULL;
    fsdp_module_release(m);
    m = NULL;
    TRY(out, "fsdp_ctx_set_device(NULL)", fsdp_ctx_set_device(ctx, NULL));

    /* A parameter moved after wrapping is refused at lazy init. */
    refused_after_move(ctx, L, j, V_OFF, A, H, A, "module.0.weight",
                       "CPU offloading enabled has parameters on",
                       "F08: offload, a parameter moved off the host after wrapping (CUDA_AFTER): "
                       "the first forward is refused naming it");
    refused_after_move(ctx, L, j, V_MOVE, A, H, H, "module.3.bias", "must not be moved",
                       "F07: device A, a parameter moved off A after wrapping: the first forward "
                       "is refused naming it");
    rc = FSDP_OK;
out:
    fsdp_destroy(u);
    fsdp_module_release(m);
    fsdp_ctx_set_device(ctx, NULL);
    fsdp_device_destroy(other_dev);
    fsdp_ctx_destroy(other);
    fsdp_device_destroy(H);
    fsdp_device_destroy(A);
    return rc;
}

/* ---- main ------------------------------------------------------------------------------------ */

int main(void) {
    tap_plan_lazy();
    static job_t jobs[] = {
        {.title = "F07/F08 FULL_SHARD", .world = 2, .strategy = FSDP_FULL_SHARD},
        {.title = "F07/F08 SHARD_GRAD_OP", .world = 2, .strategy = FSDP_SHARD_GRAD_OP},
        {.title = "F07/F08 NO_SHARD", .world = 2, .strategy = FSDP_NO_SHARD},
        {.title = "F07/F08 FULL_SHARD", .world = 3, .strategy = FSDP_FULL_SHARD},
        {.title = "F07/F08 SHARD_GRAD_OP", .world = 3, .strategy = FSDP_SHARD_GRAD_OP},
        {.title = "F07/F08 NO_SHARD", .world = 3, .strategy = FSDP_NO_SHARD},
        {.title = "F07/F08 FULL_SHARD use_orig_params",
         .world = 2,
         .strategy = FSDP_FULL_SHARD,
         .orig = true},
        {.title = "F07/F08 NO_SHARD use_orig_params",
         .world = 3,
         .strategy = FSDP_NO_SHARD,
         .orig = true},
        {.title = "F07/F08 FULL_SHARD bf16 params",
         .world = 2,
         .strategy = FSDP_FULL_SHARD,
         .mp = true},
        {.title = "F07/F08 SHARD_GRAD_OP device on every unit",
         .world = 2,
         .strategy = FSDP_SHARD_GRAD_OP,
         .every = true},
        {.title = "F07/F08 errors", .world = 2, .strategy = FSDP_FULL_SHARD, .errors = true},
    };
    for (size_t i = 0; i < sizeof jobs / sizeof jobs[0]; i++)
        run(&jobs[i], jobs[i].errors ? error_rank : train_rank);
    return tap_done();
}
