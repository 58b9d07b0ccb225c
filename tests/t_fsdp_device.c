/* SPDX-License-Identifier: MIT */
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
 * MOVE and OFF must give bitwise REF's losses, gradient norms and full parameters (on a GPU A,
 * OFF's norms and parameters within the fp32 tolerance: its optimizer runs on the host), at world 2
 * and 3, FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, and at world 2 with use_orig_params, with
 * bf16 mixed precision, and with every unit given the device (instead of nested units taking
 * it from the root). summon_full_params with offload_to_cpu shows OFF's parameters on H.
 *
 * Offload host memory: a job whose device A has host memory of its own (A's vtable is the CPU's
 * plus host_alloc/host_free that count per rank, as a CUDA device's pinned memory would be)
 * must take every FSDP_MEM_OFFLOAD byte of OFF (shards, sharded gradients, offload_to_cpu
 * summons) from that hook, and nothing else (the optimizer's state on H stays ordinary memory),
 * give every block back through host_free by the end, send the shards to A on a stream (the
 * asynchronous copy; with bf16 parameters the cast happens on A after it), and still give
 * REF's bits.
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
 * HOST, a fourth variant, builds, wraps and trains on H alone (no options.device): an
 * independent reference that REF must match within the spec's f32 tolerance (rtol 1.3e-6,
 * atol 1e-5; bf16 parameters: rtol 1.6e-2, atol 1e-5).
 *
 * Built twice from this file:
 *   - t_fsdp_device (make check): A and H are two CPU device objects, as described above;
 *   - t_fsdp_cuda (make check-gpu, FSDP_DEV_CUDA): A is a CUDA device on the one GPU (every
 *     rank's), the world group's buffers live on it (fsdp_sim_pg_set_device) for REF, MOVE and
 *     OFF, and HOST trains on the CPU: the FSDP parity matrix on the sim backend over CUDA
 *     memory, at world sizes 2 and 4, against the CPU within tolerance. Skips where no CUDA
 *     device is visible.
 *
 * Ranks are threads of a sim run. The rank functions record checks per rank and fu_run_job()
 * prints one TAP line per check (see fsdp_util.h).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <config.h>
#include <fsdp.h>

#include "device/device_impl.h"
#include "fsdp/fsdp_impl.h"
#include "fsdp_util.h"
#include "models/models.h"
#include "tap.h"

#define STEPS 2

#ifdef FSDP_DEV_CUDA
#define A_KIND FSDP_DEVICE_CUDA
#define A_NAME "the GPU A"
#define W_BIG 4 /* the larger world of the matrix */
#else
#define A_KIND FSDP_DEVICE_CPU
#define A_NAME "the device A"
#define W_BIG 3
#endif

/* A job of this file: the strategy, use_orig_params and mixed precision of fu_job_t, plus how
 * the nested units get the device. */
typedef struct dev_job {
    fu_job_t base; /* first: rank functions get &base and cast back */
    bool every;    /* every unit gets options.device (else nested units take the root's) */
    bool pinned;   /* A has host memory of its own (pin_ops) */
} dev_job_t;

/* ---- a device with host memory of its own (what a CUDA device's pinned memory is) ---------- */

#define MAX_RANKS 4
static _Atomic size_t pinned_bytes[MAX_RANKS], pinned_calls[MAX_RANKS], stream_h2d[MAX_RANKS];
static struct fsdp_dev_ops pin_ops; /* the CPU's table plus the two below (set in main) */

/* Blocks carry their size in front (64 bytes, so the block stays 64-byte aligned). */
static int pin_alloc(fsdp_device_t *host, size_t bytes, void **out) {
    int r = fsdp_ctx_rank(host->ctx);
    char *p = aligned_alloc(64, 64 + ((bytes + 63) & ~(size_t)63));
    *out = NULL;
    if (!p) return FSDP_ENOMEM;
    memcpy(p, &bytes, sizeof bytes);
    pinned_bytes[r] += bytes;
    pinned_calls[r]++;
    *out = p + 64;
    return FSDP_OK;
}

/* The CPU's memcpy, counting host-to-device copies given a stream (the asynchronous ones). */
static int pin_memcpy(fsdp_device_t *dev, void *dst, const void *src, size_t n,
                      fsdp_copy_kind_t kind, void *stream) {
    if (stream && kind == FSDP_COPY_H2D) stream_h2d[fsdp_ctx_rank(dev->ctx)]++;
    return fsdp__cpu_dev_ops.memcpy(dev, dst, src, n, kind, stream);
}

static void pin_free(fsdp_device_t *host, void *ptr) {
    size_t bytes;
    char *p = (char *)ptr - 64;
    memcpy(&bytes, p, sizeof bytes);
    pinned_bytes[fsdp_ctx_rank(host->ctx)] -= bytes;
    free(p);
}

/* ---- helpers --------------------------------------------------------------------------------- */

/* fu_list_values() of the parameters of m's tree (grads: of their gradients, where a missing one
 * is FSDP_EINVAL); *all_on (may be NULL) says whether every one of them is on dev (dev NULL: on
 * a host device, any of them). */
static int module_values(const fsdp_module_t *m, bool grads, const fsdp_device_t *dev, bool *all_on,
                         fu_vals_t *out) {
    fsdp_named_list_t l = {0};
    int rc = fsdp_module_named_params(m, false, &l);
    if (rc == 0) rc = fu_list_values(&l, grads, out);
    if (all_on) *all_on = true;
    for (size_t i = 0; i < l.n; i++) {
        const fsdp_tensor_t *t = grads ? fsdp_tensor_grad(l.tensors[i]) : l.tensors[i];
        if (!t && rc == 0) rc = FSDP_EINVAL;
        if (all_on && t &&
            (dev ? fsdp_tensor_device(t) != dev
                 : fsdp_device_kind(fsdp_tensor_device(t)) != FSDP_DEVICE_CPU))
            *all_on = false;
    }
    fsdp_named_list_free(&l);
    return rc;
}

/* The value written into element k (in named order) of the full parameters (fu_store_params). */
static float pat(size_t k) {
    return (float)(0.25 + 1e-3 * (double)(k % 997));
}

static int pat_at(void *arg, size_t p, int64_t e, size_t k, float *v) {
    (void)arg, (void)p, (void)e;
    *v = pat(k);
    return FSDP_OK;
}

/* Bitwise equality of a per-step series (`what`: loss or norm) with REF's; the first
 * difference into why. */
static bool same_steps(const double *a, const double *ref, const char *what, char *why,
                       size_t len) {
    for (int s = 0; s < STEPS; s++)
        if (memcmp(&a[s], &ref[s], sizeof a[s]) != 0) {
            snprintf(why, len, "step %d: %s %.9g, REF %.9g", s, what, a[s], ref[s]);
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

enum { V_REF, V_MOVE, V_OFF, V_HOST, V_COUNT };
static const char *const vname[V_COUNT] = {"REF", "MOVE (F07 device)", "OFF (F08 offload)",
                                           "HOST (CPU only)"};

typedef struct result {
    double loss[STEPS], norm[STEPS];
    fu_vals_t params;
    fu_vals_t grads; /* use_orig_params: the full gradients of the last step (summon with_grads) */
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

/* Adds a persistent f32 buffer `name` of 3 elements (value v) to m, on the context's device. */
static int add_buffer(fsdp_ctx_t *ctx, fsdp_module_t *m, const char *name, double v) {
    const int64_t n[1] = {3};
    fsdp_tensor_t *b = NULL;
    int rc = fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 1, n, v, FSDP_MEM_OTHER, &b);
    if (rc == 0) rc = fsdp_module_add_buffer(m, name, b, true);
    fsdp_tensor_release(b);
    return rc;
}

static void wrap_options(const dev_job_t *j, int v, fsdp_device_t *A, fsdp_options_t *o) {
    fu_job_options(&j->base, o);
    o->cpu_offload = v == V_OFF;
    o->device = v == V_REF || v == V_HOST ? NULL : A;
}

/* NestedWrappedModule with buffers, built on `build`, wrapped for variant v. */
static int build_wrapped(fsdp_ctx_t *ctx, const dev_job_t *j, int v, fsdp_device_t *build,
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

static int train(fsdp_ctx_t *ctx, dev_job_t *j, int v, fsdp_device_t *A, fsdp_device_t *H,
                 result_t *res) {
    fu_res_t *r = fu_res_of(&j->base, ctx);
    fsdp_device_t *build = v == V_REF ? A : H;
    /* HOST: everything on H, as if A did not exist. */
    if (v == V_HOST) A = H;
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_tensor_t *x = NULL, *y = NULL, *loss = NULL;
    probe_t probe[2] = {{A, 8 * 4, 0, 0}, {A, 16 * 4, 0, 0}};
    fsdp_module_t *probed[2] = {NULL, NULL};
    int hooks[2] = {0, 0};
    char why[300] = "", name[200];
    fsdp_mem_stats_t ms;
    int rc = FSDP_OK;

    FU_TRY(out, "building and wrapping", build_wrapped(ctx, j, v, build, A, &m, &root));
    if (v == V_MOVE || v == V_OFF) {
        snprintf(name, sizeof name, "%s: original parameters on %s after wrap", vname[v],
                 v == V_OFF ? "the host H" : A_NAME);
        fu_ck(r, tree_on(m, false, v == V_OFF ? H : A, why, sizeof why), name, "%s", why);
        snprintf(name, sizeof name, "%s: buffers moved to A", vname[v]);
        fu_ck(r, tree_on(m, true, A, why, sizeof why), name, "%s", why);
        snprintf(name, sizeof name, "%s: flat parameters on %s, unsharded ones on A", vname[v],
                 v == V_OFF ? "H" : "A");
        fu_ck(r, units_on(root, v == V_OFF ? H : A, A, false, why, sizeof why), name, "%s", why);
    }
    fsdp_mem_get_stats(ctx, &ms);
    if (v == V_OFF) {
        fu_ck(r, ms.current[FSDP_MEM_OFFLOAD] == shard_bytes(root),
              "OFF (F08 offload): FSDP_MEM_OFFLOAD holds exactly the shards after wrap",
              "%zu bytes, shards %zu", ms.current[FSDP_MEM_OFFLOAD], shard_bytes(root));
        size_t pb = pinned_bytes[fsdp_ctx_rank(ctx)];
        if (j->pinned)
            fu_ck(r, pb == ms.current[FSDP_MEM_OFFLOAD] && pb > 0,
                  "OFF: every offloaded byte comes from the compute device's host memory",
                  "host_alloc holds %zu bytes, FSDP_MEM_OFFLOAD %zu", pb,
                  ms.current[FSDP_MEM_OFFLOAD]);
        else
            fu_ck(r, pb == 0, "OFF on a plain CPU compute device: ordinary host memory",
                  "%zu bytes through host_alloc", pb);
    }

    /* Train on A: the context's device is the compute device (torch.cuda.set_device). */
    FU_TRY(out, "fsdp_ctx_set_device(A)", fsdp_ctx_set_device(ctx, A));
    const char *paths[2] = {"module.0", "module.1.0"};
    for (int i = 0; i < 2; i++) {
        probed[i] = fsdp_module_child(m, paths[i]);
        FU_TRY(out, "adding the probe",
               fsdp_module_add_forward_pre_hook(probed[i], probe_hook, &probe[i], &hooks[i]));
    }
    FU_TRY(out, "SGD over fsdp_named_params", fu_make_fsdp_sgd(ctx, root, 0.05, 0.9, &opt));
    bool idle = true, grads_ok = true, mem_ok = true;
    for (int s = 0; s < STEPS; s++) {
        /* The input is made on the build device: the root moves it to A. */
        FU_TRY(out, "fsdp_ctx_set_device(build)", fsdp_ctx_set_device(ctx, build));
        FU_TRY(out, "making the input", tm_nested_wrapped_get_input(ctx, &x));
        FU_TRY(out, "fsdp_ctx_set_device(A)", fsdp_ctx_set_device(ctx, A));
        FU_TRY(out, "forward", fsdp_module_forward1(m, x, &y));
        FU_TRY(out, "loss", tm_sum_loss(y, &loss));
        FU_TRY(out, "reading the loss", fsdp_tensor_item(loss, 0, &res->loss[s]));
        FU_TRY(out, "backward", fsdp_backward(loss, NULL));
        if ((v == V_MOVE || v == V_OFF) &&
            !units_on(root, v == V_OFF ? H : A, A, true, why, sizeof why)) {
            grads_ok = false;
            fu_ck(r, false, "sharded gradients where the shards are", "step %d: %s", s, why);
        }
        fsdp_mem_get_stats(ctx, &ms);
        size_t want = v == V_OFF ? 2 * shard_bytes(root) : 0;
        if (ms.current[FSDP_MEM_OFFLOAD] != want) {
            mem_ok = false;
            fu_ck(r, false, "FSDP_MEM_OFFLOAD after backward", "step %d: %zu bytes, want %zu", s,
                  ms.current[FSDP_MEM_OFFLOAD], want);
        }
        size_t pb = pinned_bytes[fsdp_ctx_rank(ctx)];
        if (pb != (j->pinned ? want : 0)) {
            mem_ok = false;
            fu_ck(r, false, "offload memory through host_alloc after backward",
                  "step %d: %zu bytes, want %zu", s, pb, j->pinned ? want : 0);
        }
        FU_TRY(out, "clip_grad_norm", fsdp_unit_clip_grad_norm(root, 0.5, 2.0, &res->norm[s]));
        if (j->base.orig && s == STEPS - 1) {
            /* summon with_grads: an offloaded gradient is gathered on A. */
            fsdp_summon_options_t sg;
            fsdp_summon_options_init(&sg);
            sg.writeback = false;
            sg.with_grads = true;
            bool on = false;
            FU_TRY(out, "summon with_grads", fsdp_summon_begin(root, &sg));
            rc = module_values(m, true, A, &on, &res->grads);
            int rc2 = fsdp_summon_end(root);
            FU_TRY(out, "reading the full gradients", rc ? rc : rc2);
            snprintf(name, sizeof name, "%s: summon with_grads shows full gradients on A",
                     vname[v]);
            fu_ck(r, on, name, "a gradient is not on A");
        }
        FU_TRY(out, "optimizer step", fsdp_optim_step(opt));
        FU_TRY(out, "zero_grad", fsdp_optim_zero_grad(opt, false));
        idle &= fu_tree_idle(root);
        fsdp_tensor_release(loss);
        fsdp_tensor_release(y);
        fsdp_tensor_release(x);
        loss = y = x = NULL;
    }
    snprintf(name, sizeof name, "%s: every unit idle and resharded after each step", vname[v]);
    fu_ck(r, idle, name, "a unit was left running or unsharded");
    if (v == V_MOVE || v == V_OFF) {
        snprintf(name, sizeof name, "%s: sharded gradients stay on %s after each backward",
                 vname[v], v == V_OFF ? "H" : "A");
        if (grads_ok) fu_ck(r, true, name, "-");
        snprintf(name, sizeof name, "%s: FSDP_MEM_OFFLOAD holds %s after each backward", vname[v],
                 v == V_OFF ? "exactly shards and gradients" : "nothing");
        if (mem_ok) fu_ck(r, true, name, "-");
        snprintf(name, sizeof name,
                 "%s: during forward the modules compute with unsharded parameters and inputs "
                 "on A",
                 vname[v]);
        fu_ck(r,
              probe[0].calls == STEPS && probe[1].calls == STEPS && !probe[0].bad && !probe[1].bad,
              name, "probe calls %d/%d, bad %d/%d", probe[0].calls, probe[1].calls, probe[0].bad,
              probe[1].bad);
    }

    /* The full parameters (summon without writeback; with offload they are unsharded on A). */
    fsdp_summon_options_t sm;
    fsdp_summon_options_init(&sm);
    sm.writeback = false;
    bool on = false;
    FU_TRY(out, "summon", fsdp_summon_begin(root, &sm));
    rc = module_values(m, false, A, &on, &res->params);
    int rc2 = fsdp_summon_end(root);
    FU_TRY(out, "reading the full parameters", rc ? rc : rc2);
    snprintf(name, sizeof name, "%s: summoned full parameters on %s", vname[v],
             v == V_HOST ? "H" : "A");
    fu_ck(r, on, name, "a full parameter is not on A");
    /* offload_to_cpu: on the offload host H with offload, else on A when it is a host device,
     * else on a host device of the context. */
    sm.offload_to_cpu = true;
    fu_vals_t host = {0};
    FU_TRY(out, "summon offload_to_cpu", fsdp_summon_begin(root, &sm));
    rc = module_values(m, false,
                       v == V_OFF                               ? H
                       : fsdp_device_kind(A) == FSDP_DEVICE_CPU ? A
                                                                : NULL,
                       &on, &host);
    rc2 = fsdp_summon_end(root);
    if (rc == 0) rc = rc2;
    if (rc < 0) fu_vals_free(&host);
    FU_TRY(out, "reading the offloaded full parameters", rc);
    snprintf(name, sizeof name, "%s: summon offload_to_cpu shows the same values on %s", vname[v],
             v == V_OFF || v == V_HOST                ? "H"
             : fsdp_device_kind(A) == FSDP_DEVICE_CPU ? "A"
                                                      : "the host");
    fu_ck(r, on && fu_vals_same(&host, &res->params, why, sizeof why), name, "%s",
          on ? why : "a parameter is on the wrong device");
    fu_vals_free(&host);

    /* summon with writeback: each rank's part of a change reaches its shard (on H with
     * offload), and the next summon shows it. */
    sm.offload_to_cpu = false;
    sm.writeback = true;
    FU_TRY(out, "summon writeback", fsdp_summon_begin(root, &sm));
    rc = fu_store_params(m, pat_at, NULL);
    rc2 = fsdp_summon_end(root);
    FU_TRY(out, "writing the full parameters", rc ? rc : rc2);
    sm.writeback = false;
    FU_TRY(out, "summon", fsdp_summon_begin(root, &sm));
    rc = module_values(m, false, NULL, NULL, &host);
    rc2 = fsdp_summon_end(root);
    if (rc == 0) rc = rc2;
    if (rc < 0) fu_vals_free(&host);
    FU_TRY(out, "reading the written parameters", rc);
    size_t bad = 0;
    while (bad < host.n && host.v[bad] == (double)pat(bad))
        bad++;
    snprintf(name, sizeof name, "%s: a summon writeback reaches the shards", vname[v]);
    fu_ck(r, host.n > 0 && bad == host.n, name, "element %zu of %zu reads %.9g, wrote %.9g", bad,
          host.n, bad < host.n ? host.v[bad] : 0.0, bad < host.n ? (double)pat(bad) : 0.0);
    fu_vals_free(&host);
out:
    for (int i = 0; i < 2; i++)
        if (hooks[i] > 0) fsdp_module_remove_hook(probed[i], hooks[i]);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(y);
    fsdp_tensor_release(x);
    fsdp_tape_clear(ctx);
    fsdp_optim_destroy(opt);
    fsdp_unit_destroy(root);
    fsdp_module_release(m);
    fsdp_ctx_set_device(ctx, NULL);
    return rc;
}

static int train_rank(fsdp_ctx_t *ctx, void *arg) {
    dev_job_t *j = arg;
    fu_res_t *r = fu_res_of(&j->base, ctx);
    fsdp_device_t *A = NULL, *H = NULL;
    result_t res[V_COUNT];
    memset(res, 0, sizeof res);
    int rc = FSDP_OK;
    FU_TRY(out, "creating device A", fsdp_device_create(ctx, A_KIND, NULL, &A));
    FU_TRY(out, "creating device H", fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &H));
    if (j->pinned) A->ops = &pin_ops;
    int rk = fsdp_ctx_rank(ctx);
    size_t calls0 = pinned_calls[rk], h2d0 = stream_h2d[rk];
    for (int v = 0; v < V_COUNT; v++) {
#ifdef FSDP_DEV_CUDA
        /* The collectives' buffers: on the GPU, except HOST's. */
        FU_TRY(out, "fsdp_sim_pg_set_device",
               fsdp_sim_pg_set_device(fsdp_ctx_pg(ctx), v == V_HOST ? NULL : A));
#endif
        if ((rc = train(ctx, j, v, A, H, &res[v])) < 0) goto out;
    }
    if (j->pinned) {
        fu_ck(r, pinned_bytes[rk] == 0 && pinned_calls[rk] > calls0,
              "offload host memory: blocks taken through host_alloc are all given back through "
              "host_free once the units are destroyed",
              "%zu bytes still held after %zu blocks", (size_t)pinned_bytes[rk],
              (size_t)(pinned_calls[rk] - calls0));
        fu_ck(r, stream_h2d[rk] > h2d0,
              "offload host memory: the shards go to the compute device on a copy stream",
              "no H2D copy was given a stream");
    }
    /* REF against the CPU-only run: within tolerance (bitwise where A is a CPU device too). */
    const bool bf16 = j->base.mp.enabled;
    const double rtol = bf16 ? 1.6e-2 : 1.3e-6, atol = 1e-5;
    char why0[300] = "";
    fu_ck(r,
          fu_series_close(res[V_REF].loss, res[V_HOST].loss, STEPS, rtol, atol, "loss of step", why0,
                     sizeof why0) &&
              fu_series_close(res[V_REF].norm, res[V_HOST].norm, STEPS, rtol, atol, "norm of step", why0,
                         sizeof why0),
          "REF on A: losses and clip_grad_norm totals match HOST (CPU only) within tolerance", "%s",
          why0);
    fu_ck(r,
          res[V_REF].params.n == res[V_HOST].params.n && res[V_REF].params.n > 0 &&
              fu_series_close(res[V_REF].params.v, res[V_HOST].params.v, res[V_REF].params.n, rtol, atol,
                         "parameter element", why0, sizeof why0),
          "REF on A: full parameters after training match HOST (CPU only) within tolerance", "%s",
          why0[0] ? why0 : "different counts");
    for (int v = V_MOVE; v <= V_OFF; v++) {
        char why[300] = "", name[200];
        /* OFF steps the optimizer and sums the gradient norm on the host H: with A a GPU that
         * is another processor's arithmetic (its fused multiply-adds), so from the first
         * update on OFF matches REF within the fp32 tolerance; on a CPU A it is bitwise. */
        const bool exact = v != V_OFF || A_KIND == FSDP_DEVICE_CPU;
        const char *how = exact ? "bitwise equal to" : "within fp32 tolerance of";
        snprintf(name, sizeof name, "%s: losses bitwise equal to REF (model built on A)", vname[v]);
        fu_ck(r, same_steps(res[v].loss, res[V_REF].loss, "loss", why, sizeof why), name, "%s",
              why);
        snprintf(name, sizeof name, "%s: clip_grad_norm totals %s REF", vname[v], how);
        fu_ck(r,
              exact ? same_steps(res[v].norm, res[V_REF].norm, "norm", why, sizeof why)
                    : fu_series_close(res[v].norm, res[V_REF].norm, STEPS, 1.3e-6, 1e-5,
                                 "norm of step", why, sizeof why),
              name, "%s", why);
        snprintf(name, sizeof name, "%s: full parameters after %d steps %s REF", vname[v], STEPS,
                 how);
        fu_ck(r, exact ? fu_vals_same(&res[v].params, &res[V_REF].params, why, sizeof why)
                       : fu_vals_close(&res[v].params, &res[V_REF].params, 1.3e-6, 1e-5, why, sizeof why),
              name, "%s", why);
        if (j->base.orig) {
            snprintf(name, sizeof name, "%s: full gradients (with_grads) %s REF", vname[v], how);
            fu_ck(r, exact ? fu_vals_same(&res[v].grads, &res[V_REF].grads, why, sizeof why)
                           : fu_vals_close(&res[v].grads, &res[V_REF].grads, 1.3e-6, 1e-5, why, sizeof why),
                  name, "%s", why);
        }
    }
out:
    for (int v = 0; v < V_COUNT; v++) {
        fu_vals_free(&res[v].params);
        fu_vals_free(&res[v].grads);
    }
    fsdp_ctx_set_device(ctx, NULL);
#ifdef FSDP_DEV_CUDA
    fsdp_sim_pg_set_device(fsdp_ctx_pg(ctx), NULL);
#endif
    fsdp_device_destroy(H);
    fsdp_device_destroy(A);
    return rc;
}

/* ---- errors ---------------------------------------------------------------------------------- */

/* Wraps NestedWrappedModule built on H (options as job j, variant v), moves `param` to `to`
 * and checks that the first forward is refused naming it and `key`, with nothing run. */
static void refused_after_move(fsdp_ctx_t *ctx, fu_res_t *r, dev_job_t *j, int v, fsdp_device_t *A,
                               fsdp_device_t *H, fsdp_device_t *to, const char *param,
                               const char *key, const char *name) {
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *x = NULL, *y = NULL;
    int rc = FSDP_OK;
    FU_TRY(out, "building and wrapping", build_wrapped(ctx, j, v, H, A, &m, &root));
    FU_TRY(out, "fsdp_ctx_set_device(A)", fsdp_ctx_set_device(ctx, A));
    FU_TRY(out, "making the input", tm_nested_wrapped_get_input(ctx, &x));
    /* The move PyTorch's `.cuda()` after wrapping makes (CUDA_AFTER). */
    FU_TRY(out, "moving the parameter", fsdp__tensor_move(fsdp_module_param(m, param), to));
    rc = fsdp_module_forward1(m, x, &y);
    fu_ck_einval(r, ctx, rc, key, param, name);
    fu_ck(r, fu_tree_idle(root) && fsdp_tape_size(ctx) == 0,
          "after the refusal every unit is idle and sharded, nothing recorded", "state changed");
out:
    fsdp_tensor_release(y);
    fsdp_tensor_release(x);
    fsdp_tape_clear(ctx);
    fsdp_unit_destroy(root);
    fsdp_module_release(m);
    fsdp_ctx_set_device(ctx, NULL);
}

static int error_rank(fsdp_ctx_t *ctx, void *arg) {
    dev_job_t *j = arg;
    fu_res_t *r = fu_res_of(&j->base, ctx);
    fsdp_device_t *A = NULL, *H = NULL, *other_dev = NULL;
    fsdp_ctx_t *other = NULL;
    fsdp_module_t *m = NULL;
    fsdp_unit_t *u = NULL;
    int rc = FSDP_OK;
    FU_TRY(out, "creating device A", fsdp_device_create(ctx, A_KIND, NULL, &A));
    FU_TRY(out, "creating device H", fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &H));
#ifdef FSDP_DEV_CUDA
    FU_TRY(out, "fsdp_sim_pg_set_device", fsdp_sim_pg_set_device(fsdp_ctx_pg(ctx), A));
#endif

    /* options.device of another context (another rank's device). */
    FU_TRY(out, "creating another context", fsdp_ctx_create(NULL, &other));
    FU_TRY(out, "creating its device",
           fsdp_device_create(other, FSDP_DEVICE_CPU, NULL, &other_dev));
    FU_TRY(out, "fsdp_ctx_set_device(H)", fsdp_ctx_set_device(ctx, H));
    FU_TRY(out, "building the model", tm_nested_wrapped_create(ctx, true, &m));
    fsdp_options_t o;
    fsdp_options_init(&o);
    o.device = other_dev;
    rc = fsdp_wrap(m, &o, &u);
    fu_ck_einval(r, ctx, rc, "options.device", "context",
                 "F07: options.device of another context is refused naming the option");
    o.cpu_offload = true;
    rc = fsdp_wrap(m, &o, &u);
    fu_ck_einval(r, ctx, rc, "options.device", NULL, "F07: ... also with cpu_offload");
    o.cpu_offload = false;
    rc = fu_wrap_types(m, &o, (const char *const[]){"Linear", NULL}, &u);
    fu_ck_einval(r, ctx, rc, "options.device", NULL,
                 "F07: ... also with an auto-wrap policy (before any child is wrapped)");
    char why[300] = "";
    bool alone = u == NULL && fsdp_unit_of(fsdp_module_child(m, "module.0")) == NULL &&
                 fsdp_unit_of(m) == NULL;
    fu_ck(r, alone && tree_on(m, false, H, why, sizeof why),
          "F07: the refused wraps left the module alone (no unit, parameters on H)", "%s",
          alone ? why : "a unit was made");
    o.device = A;
    rc = fsdp_wrap(m, &o, &u);
    fu_ck(r, rc == 0 && fsdp_unit_compute_device(u) == A,
          "F07: the same module wraps with a device of its own context", "rc %s: %s",
          fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
    fsdp_unit_destroy(u);
    u = NULL;
    fsdp_module_release(m);
    m = NULL;
    FU_TRY(out, "fsdp_ctx_set_device(NULL)", fsdp_ctx_set_device(ctx, NULL));

    /* A parameter moved after wrapping is refused at lazy init. */
    refused_after_move(ctx, r, j, V_OFF, A, H, A, "module.0.weight",
                       "CPU offloading enabled has parameters on",
                       "F08: offload, a parameter moved off the host after wrapping (CUDA_AFTER): "
                       "the first forward is refused naming it");
    refused_after_move(ctx, r, j, V_MOVE, A, H, H, "module.3.bias", "must not be moved",
                       "F07: device A, a parameter moved off A after wrapping: the first forward "
                       "is refused naming it");
    rc = FSDP_OK;
out:
    fsdp_unit_destroy(u);
    fsdp_module_release(m);
    fsdp_ctx_set_device(ctx, NULL);
    fsdp_device_destroy(other_dev);
    fsdp_ctx_destroy(other);
#ifdef FSDP_DEV_CUDA
    fsdp_sim_pg_set_device(fsdp_ctx_pg(ctx), NULL);
#endif
    fsdp_device_destroy(H);
    fsdp_device_destroy(A);
    return rc;
}

/* ---- main ------------------------------------------------------------------------------------ */

#if defined(FSDP_DEV_CUDA) && defined(FSDP_HAVE_CUDA)
/* Whether the library can make a CUDA device here (a GPU is visible and works). */
static bool cuda_visible(void) {
    fsdp_ctx_t *ctx = NULL;
    fsdp_device_t *d = NULL;
    bool ok = fsdp_ctx_create(NULL, &ctx) == 0 &&
              fsdp_device_create(ctx, FSDP_DEVICE_CUDA, NULL, &d) == 0;
    fsdp_device_destroy(d);
    fsdp_ctx_destroy(ctx);
    return ok;
}
#endif

int main(void) {
#ifdef FSDP_DEV_CUDA
#ifndef FSDP_HAVE_CUDA
    return tap_skip_all("libfsdp was configured without CUDA");
#else
    if (!cuda_visible()) return tap_skip_all("no CUDA device");
#endif
#endif
    static const struct dev_case {
        const char *title;
        int world;
        fsdp_sharding_strategy_t strategy;
        bool orig;   /* use_orig_params */
        bool bf16;   /* bf16 parameters */
        bool every;  /* every unit gets options.device */
        bool pinned; /* device A has host memory of its own */
        bool errors; /* the error-path job instead of training */
    } cases[] = {
        {.title = "F07/F08 FULL_SHARD", .world = 2, .strategy = FSDP_FULL_SHARD},
        {.title = "F07/F08 SHARD_GRAD_OP", .world = 2, .strategy = FSDP_SHARD_GRAD_OP},
        {.title = "F07/F08 NO_SHARD", .world = 2, .strategy = FSDP_NO_SHARD},
        {.title = "F07/F08 FULL_SHARD", .world = W_BIG, .strategy = FSDP_FULL_SHARD},
        {.title = "F07/F08 SHARD_GRAD_OP", .world = W_BIG, .strategy = FSDP_SHARD_GRAD_OP},
        {.title = "F07/F08 NO_SHARD", .world = W_BIG, .strategy = FSDP_NO_SHARD},
        {.title = "F07/F08 FULL_SHARD use_orig_params",
         .world = 2,
         .strategy = FSDP_FULL_SHARD,
         .orig = true},
        {.title = "F07/F08 NO_SHARD use_orig_params",
         .world = W_BIG,
         .strategy = FSDP_NO_SHARD,
         .orig = true},
        {.title = "F07/F08 FULL_SHARD bf16 params",
         .world = 2,
         .strategy = FSDP_FULL_SHARD,
         .bf16 = true},
        {.title = "F07/F08 SHARD_GRAD_OP device on every unit",
         .world = 2,
         .strategy = FSDP_SHARD_GRAD_OP,
         .every = true},
        {.title = "F08 offload into the compute device's host memory FULL_SHARD",
         .world = 2,
         .strategy = FSDP_FULL_SHARD,
         .pinned = true},
        {.title = "F08 offload into the compute device's host memory NO_SHARD use_orig_params",
         .world = 3,
         .strategy = FSDP_NO_SHARD,
         .orig = true,
         .pinned = true},
        {.title = "F08 offload into the compute device's host memory FULL_SHARD bf16 params",
         .world = 2,
         .strategy = FSDP_FULL_SHARD,
         .bf16 = true,
         .pinned = true},
        {.title = "F07/F08 errors", .world = 2, .strategy = FSDP_FULL_SHARD, .errors = true},
    };
    static dev_job_t j; /* large: off the stack */
    pin_ops = fsdp__cpu_dev_ops;
    pin_ops.host_alloc = pin_alloc;
    pin_ops.host_free = pin_free;
    pin_ops.memcpy = pin_memcpy;
    tap_plan_lazy();
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const struct dev_case *c = &cases[i];
#ifdef FSDP_DEV_CUDA
        if (c->pinned) continue; /* a CPU device's stand-in for what the GPU has itself */
#endif
        fu_job_init(&j.base, c->title, c->world, c->strategy, c->orig);
        j.base.seed = 11;
        if (c->bf16) {
            j.base.mp.enabled = true;
            j.base.mp.param_dtype = FSDP_DTYPE_BF16;
        }
        j.every = c->every;
        j.pinned = c->pinned;
        fu_run_job(&j.base, c->errors ? error_rank : train_rank);
    }
    return tap_done();
}
