/*
 * t_mp_inputs.c: mixed precision at a unit's inputs (spec section 6, seed 003):
 *   MP-S03..S06  TransformerWithSharedParams (integer token inputs) under one FSDP unit with
 *                MixedPrecision reduce-only f16 (S03), param + buffer f16 (S04), all f16 (S05),
 *                param f16 + reduce f32 + buffer f16 (S06), FULL_SHARD at W = 1, 2, 4: the
 *                integer inputs reach the model uncast (a forward pre-hook records them), the
 *                loss has param_dtype (f32 when unset), and 6 SGD steps (lr 0.1) follow a local
 *                reference that applies the same casts by hand (parameters and floating buffers
 *                in param_dtype, the gradient rounded to reduce_dtype before it reaches the f32
 *                masters): losses and final parameters within fp16 tolerance. The reduce dtype
 *                is read off the group's byte counters (one reduce-scatter of padded_numel
 *                elements of reduce_dtype per step; an f16 one moves half the bytes of an f32
 *                one) and the all-gather's off param_dtype; at W=1, where nothing is
 *                communicated, S03's f16 reduction shows in the gradient's values (every one an
 *                f16 value);
 *   MP-S14       Linear(D, D, no bias) under MixedPrecision(param f16, reduce f32, buffer f32),
 *                3 strategies x use_orig_params at W = 1, 2, 4: an f32 input that requires grad
 *                gets its gradient back in f32, equal to a reference that casts by hand, and the
 *                sharded weight gradient equals the reference's f32 reduction of every rank's
 *                f16 gradient;
 *   MP-DP-01..06 per-unit precision on SaveForwardInputsModel (and DP-06's ToyModel): input
 *                dtypes recorded by forward pre-hooks added after wrapping (so they see what the
 *                module receives); the dtype errors the seed expects come from the linear kernel
 *                ("mat1 and mat2 must have the same dtype") with no output; the outputs that do
 *                run match a local reference of the same weights with the same casts (fp16
 *                tolerance), and DP-05 (at W = 1, 2, 4) also c2's and c1's sharded gradients,
 *                stored in f32;
 *   MP-IG-01     ModelWithIgnoredModule with `ignored` in ignored_modules under param f16: the
 *                f32 Linear inside the ignored module receives f16 activations and the forward
 *                fails with the kernel's dtype error (PyTorch's behaviour, docs/design.md
 *                "Mixed precision: inputs, per-unit precision, ignored modules"); the ignored
 *                parameters stay f32 and whole, the model can be torn down, and a second forward
 *                fails the same way instead of computing anything;
 *   kernel       fsdp_linear and fsdp_matmul refuse operands of different dtypes with PyTorch's
 *                message, record nothing and return no output.
 *
 * Tolerances (spec section 0): fp32 rtol 1.3e-6 atol 1e-5; fp16 rtol 1e-3 atol 1e-5. Every rank
 * records its checks and fu_run_job() prints one TAP line per check (fsdp_util.h).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "models/models.h"
#include "nn/nn_impl.h" /* the reference's buffer casts: there is no public buffer setter */
#include "tap.h"

#define DTYPE_PHRASE "must have the same dtype"
#define MAT_PHRASE "mat1 and mat2 must have the same dtype"

/* ---- helpers --------------------------------------------------------------------------------- */

/* PyTorch's gradient pre- and post-divide factors for a world of w ranks
 * (_get_gradient_predivide_factor): pre is the largest power of two with pre * pre < w ... */
static void divide_factors(int w, double *pre, double *post) {
    int f = 1;
    while (w % f == 0 && w / f > f)
        f *= 2;
    *pre = f;
    *post = (double)w / f;
}

/* Replaces every parameter of m's tree with a leaf copy in dt that requires grad (tied
 * parameters stay tied): the reference's "parameters in param_dtype". */
static int params_to(fsdp_module_t *m, fsdp_dtype_t dt) {
    fsdp_named_list_t ps = {0};
    int rc = fsdp_module_named_params(m, true, &ps);
    /* Under no-grad, so that the copies are new leaves rather than nodes of a graph. */
    bool was = fsdp_set_grad_enabled(fsdp_module_ctx(m), false);
    fsdp_tensor_t **from = calloc(ps.n + 1, sizeof *from), **to = calloc(ps.n + 1, sizeof *to);
    size_t nd = 0;
    if (!from || !to) rc = FSDP_ENOMEM;
    for (size_t i = 0; i < ps.n && rc == 0; i++) {
        fsdp_tensor_t *h = NULL;
        for (size_t k = 0; k < nd; k++)
            if (from[k] == ps.tensors[i]) h = to[k];
        if (!h) {
            if ((rc = fsdp_to_dtype(ps.tensors[i], dt, &h)) < 0) break;
            if ((rc = fsdp_tensor_set_requires_grad(h, true)) < 0) {
                fsdp_tensor_release(h);
                break;
            }
            from[nd] = ps.tensors[i];
            to[nd++] = h;
        }
        rc = fsdp_module_set_param(m, ps.names[i], h, false);
    }
    for (size_t k = 0; k < nd; k++)
        fsdp_tensor_release(to[k]);
    fsdp_set_grad_enabled(fsdp_module_ctx(m), was);
    free(from);
    free(to);
    fsdp_named_list_free(&ps);
    return rc;
}

/* Casts every floating buffer of m's tree to dt, as FSDP's buffer_dtype does (through the
 * module's slots: nn.h has no buffer setter). */
static int buffers_to(fsdp_module_t *m, fsdp_dtype_t dt) {
    int rc = FSDP_OK;
    for (size_t i = 0; i < m->nbuffers && rc == 0; i++) {
        fsdp_tensor_t *b = m->buffers[i].t, *c = NULL;
        if (!fsdp_dtype_is_float(fsdp_tensor_dtype(b)) || fsdp_tensor_dtype(b) == dt) continue;
        if ((rc = fsdp_to_dtype(b, dt, &c)) < 0) break;
        fsdp_tensor_release(b);
        m->buffers[i].t = c;
    }
    for (size_t i = 0; i < m->nchildren && rc == 0; i++)
        rc = buffers_to(m->children[i].m, dt);
    return rc;
}

/* Returns the tensor holding the expected full values for parameter `fqn` (fully qualified
 * under the root module), borrowed; NULL when there is none. */

/* The dtypes a module received, recorded by a forward pre-hook. */
typedef struct seen {
    int calls;
    int n;
    fsdp_dtype_t dt[4];
} seen_t;

static int record_inputs(fsdp_module_t *m, void *arg, int nin, fsdp_tensor_t **in) {
    (void)m;
    seen_t *s = arg;
    s->calls++;
    s->n = nin < 4 ? nin : 4;
    for (int i = 0; i < s->n; i++)
        s->dt[i] = in[i] ? fsdp_tensor_dtype(in[i]) : FSDP_DTYPE_COUNT;
    return 0;
}

static int watch(fsdp_module_t *m, seen_t *s) {
    memset(s, 0, sizeof *s);
    int h;
    return fsdp_module_add_forward_pre_hook(m, record_inputs, s, &h);
}

static const char *dt_name(const seen_t *s, int i) {
    return s->calls == 0 || i >= s->n ? "(not run)" : fsdp_dtype_name(s->dt[i]);
}

static bool saw(const seen_t *s, int i, fsdp_dtype_t dt) {
    return s->calls > 0 && i < s->n && s->dt[i] == dt;
}

/* The message says MAT_PHRASE (or, for a bias, DTYPE_PHRASE) and names the linear op. */
static bool dtype_error(int rc, const char *msg, bool mat) {
    return rc == FSDP_EINVAL && msg && strstr(msg, mat ? MAT_PHRASE : DTYPE_PHRASE) &&
           strstr(msg, "linear");
}

static void mp_init(fsdp_mixed_precision_t *mp, fsdp_dtype_t param, fsdp_dtype_t reduce,
                    fsdp_dtype_t buffer) {
    fsdp_mixed_precision_init(mp);
    mp->enabled = true;
    mp->param_dtype = param;
    mp->reduce_dtype = reduce;
    mp->buffer_dtype = buffer;
}

/* ---- kernel checks --------------------------------------------------------------------------- */

static int kernel_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    const int64_t sx[2] = {2, 3}, sw[2] = {4, 3}, sb[1] = {4};
    fsdp_tensor_t *x32 = NULL, *x16 = NULL, *w32 = NULL, *w16 = NULL, *b16 = NULL, *y = NULL;
    fsdp_tensor_t *wt32 = NULL;
    int rc;
    FU_TRY(done, "setting up",
           fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 2, sx, 0.5, FSDP_MEM_ACTIVATIONS, &x32));
    FU_TRY(done, "setting up",
           fsdp_tensor_full(ctx, FSDP_DTYPE_F16, 2, sx, 0.5, FSDP_MEM_ACTIVATIONS, &x16));
    FU_TRY(done, "setting up",
           fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 2, sw, 0.25, FSDP_MEM_ACTIVATIONS, &w32));
    FU_TRY(done, "setting up",
           fsdp_tensor_full(ctx, FSDP_DTYPE_F16, 2, sw, 0.25, FSDP_MEM_ACTIVATIONS, &w16));
    FU_TRY(done, "setting up",
           fsdp_tensor_full(ctx, FSDP_DTYPE_F16, 1, sb, 1.0, FSDP_MEM_ACTIVATIONS, &b16));
    FU_TRY(done, "setting up", fsdp_tensor_set_requires_grad(w32, true));
    FU_TRY(done, "setting up", fsdp_transpose(w32, 0, 1, &wt32));
    size_t tape0 = fsdp_tape_size(ctx);
    y = (fsdp_tensor_t *)1;
    rc = fsdp_linear(x16, w32, NULL, &y);
    fu_ck(r, dtype_error(rc, fsdp_ctx_last_error(ctx), true) && !y,
          "MP-DP-03 kernel: linear(x f16, w f32) is EINVAL \"" MAT_PHRASE "\" with no output",
          "rc %s, out %p, message \"%s\"", fsdp_err_name(rc), (void *)y, fsdp_ctx_last_error(ctx));
    fu_ck(r, fsdp_tape_size(ctx) == tape0, "kernel: the refused linear recorded nothing",
          "tape %zu -> %zu", tape0, fsdp_tape_size(ctx));
    rc = fsdp_linear(x32, w16, NULL, &y);
    fu_ck(r, dtype_error(rc, fsdp_ctx_last_error(ctx), true) && !y,
          "kernel: linear(x f32, w f16) is EINVAL \"" MAT_PHRASE "\"", "rc %s, message \"%s\"",
          fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
    rc = fsdp_linear(x16, w16, b16, &y);
    fu_ck(r, rc == 0 && y && fsdp_tensor_dtype(y) == FSDP_DTYPE_F16,
          "kernel: linear(x f16, w f16, b f16) runs and is f16 (control)", "rc %s (%s)",
          fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
    double v = 0;
    if (y) fsdp_tensor_item(y, 0, &v);
    fu_ck(r, v == 0.5 * 0.25 * 3 + 1.0, "kernel: the f16 control's value is 1.375", "got %.9g", v);
    fsdp_tensor_release(y);
    y = NULL;
    const int64_t sb32[1] = {4};
    fsdp_tensor_t *b32 = NULL;
    FU_TRY(done, "setting up",
           fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 1, sb32, 1.0, FSDP_MEM_ACTIVATIONS, &b32));
    rc = fsdp_linear(x16, w16, b32, &y);
    fsdp_tensor_release(b32);
    fu_ck(r, dtype_error(rc, fsdp_ctx_last_error(ctx), false) && !y,
          "kernel: linear(x f16, w f16, b f32) is EINVAL \"" DTYPE_PHRASE "\" with no output",
          "rc %s, message \"%s\"", fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
    tape0 = fsdp_tape_size(ctx);
    rc = fsdp_matmul(x16, wt32, &y);
    const char *msg = fsdp_ctx_last_error(ctx);
    fu_ck(r,
          rc == FSDP_EINVAL && !y && strstr(msg, MAT_PHRASE) && strstr(msg, "matmul") &&
              fsdp_tape_size(ctx) == tape0,
          "kernel: matmul(a f16, b f32) is EINVAL \"" MAT_PHRASE "\", records nothing",
          "rc %s, message \"%s\"", fsdp_err_name(rc), msg);
    rc = FSDP_OK;
done:
    fsdp_tensor_release(x32);
    fsdp_tensor_release(x16);
    fsdp_tensor_release(w32);
    fsdp_tensor_release(w16);
    fsdp_tensor_release(b16);
    fsdp_tensor_release(wt32);
    fsdp_tape_clear(ctx);
    return rc;
}

/* ---- MP-S03..S06 ----------------------------------------------------------------------------- */

#define EMB_STEPS 6
#define EMB_LR 0.1

typedef struct emb_job {
    fu_job_t j; /* first */
    const char *id;
} emb_job_t;

/* x rounded to dt (f16 or f32). */
static float round_to(float x, fsdp_dtype_t dt) {
    return dt == FSDP_DTYPE_F16 ? fsdp_f16_to_f32(fsdp_f32_to_f16(x)) : x;
}

/* The f32 gradient FSDP stores when every one of `world` ranks has the compute gradient g:
 * g in the reduce dtype, pre-divided there, summed in f32 in rank order and rounded to the
 * reduce dtype (the sim's reduction), post-divided there, widened to f32. Mimicking each
 * rounding matters: a pre-divided f16 subnormal loses its last bit, and over the steps such
 * differences in the masters flip f16 roundings of the weights. */
static int reduced_grad(const fsdp_tensor_t *g, fsdp_dtype_t rdt, int world, fsdp_tensor_t **out) {
    double pre, post;
    divide_factors(world, &pre, &post);
    int64_t n = 0;
    float *v = fu_host_f32(g, &n);
    if (!v) return FSDP_ENOMEM;
    for (int64_t k = 0; k < n; k++) {
        float x = round_to(round_to(v[k], rdt) / (float)pre, rdt), acc = x;
        for (int q = 1; q < world; q++)
            acc += x;
        v[k] = round_to(round_to(acc, rdt) / (float)post, rdt);
    }
    int rc = fsdp_tensor_from_host(fsdp_tensor_ctx(g), FSDP_DTYPE_F32, fsdp_tensor_ndim(g),
                                   fsdp_tensor_shape(g), v, FSDP_MEM_GRADS, out);
    free(v);
    return rc;
}

/* One reference step: masters -> the compute model (param dtype), forward, backward, the
 * compute model's gradients reduced as FSDP does (reduced_grad) into the masters' .grad, SGD. */
static int ref_step(fsdp_ctx_t *ctx, int world, fsdp_module_t *master, fsdp_module_t *comp,
                    fsdp_optim_t *opt, fsdp_dtype_t rdt, double *loss_v) {
    fsdp_named_list_t mp = {0}, cp = {0};
    fsdp_tensor_t *src = NULL, *tgt = NULL, *out = NULL, *loss = NULL;
    int rc;
    if ((rc = fsdp_module_named_params(master, false, &mp)) < 0) goto done;
    if ((rc = fsdp_module_named_params(comp, false, &cp)) < 0) goto done;
    if (mp.n != cp.n) {
        rc = FSDP_EINTERNAL;
        goto done;
    }
    for (size_t i = 0; i < mp.n && rc == 0; i++) {
        rc = fsdp_tensor_copy_(cp.tensors[i], mp.tensors[i]);
        if (rc == 0) rc = fsdp_tensor_zero_grad(cp.tensors[i], true);
    }
    if (rc < 0) goto done;
    if ((rc = tm_transformer_get_input(ctx, &src, &tgt)) < 0) goto done;
    if ((rc = tm_transformer_forward(comp, src, tgt, &out)) < 0) goto done;
    if ((rc = tm_transformer_loss(tgt, out, &loss)) < 0) goto done;
    if ((rc = fsdp_tensor_item(loss, 0, loss_v)) < 0) goto done;
    if ((rc = fsdp_backward(loss, NULL)) < 0) goto done;
    for (size_t i = 0; i < mp.n && rc == 0; i++) {
        fsdp_tensor_t *g = fsdp_tensor_grad(cp.tensors[i]), *gf = NULL;
        if (!g) {
            rc = fsdp_tensor_zero_grad(mp.tensors[i], true);
            continue;
        }
        rc = reduced_grad(g, rdt, world, &gf);
        if (rc == 0) rc = fsdp_tensor_set_grad(mp.tensors[i], gf);
        fsdp_tensor_release(gf);
    }
    if (rc == 0) rc = fsdp_optim_step(opt);
done:
    fsdp_tensor_release(src);
    fsdp_tensor_release(tgt);
    fsdp_tensor_release(out);
    fsdp_tensor_release(loss);
    fsdp_named_list_free(&mp);
    fsdp_named_list_free(&cp);
    return rc;
}

/* Every element of t is an f16 value (a round trip through f16 changes nothing). */
static bool all_f16_values(const fsdp_tensor_t *t) {
    int64_t n = 0;
    float *v = fu_host_f32(t, &n);
    bool ok = v != NULL;
    for (int64_t i = 0; ok && i < n; i++)
        ok = fsdp_f16_to_f32(fsdp_f32_to_f16(v[i])) == v[i];
    free(v);
    return ok;
}

static int emb_rank(fsdp_ctx_t *ctx, void *arg) {
    emb_job_t *ej = arg;
    fu_job_t *j = &ej->j;
    fu_res_t *r = fu_res_of(j, ctx);
    const fsdp_mixed_precision_t *mp = &j->mp;
    fsdp_dtype_t pdt = mp->param_dtype == FSDP_MP_UNSET ? FSDP_DTYPE_F32 : mp->param_dtype;
    fsdp_dtype_t rdt = mp->reduce_dtype == FSDP_MP_UNSET ? pdt : mp->reduce_dtype;
    fsdp_dtype_t bdt = mp->buffer_dtype == FSDP_MP_UNSET ? FSDP_DTYPE_F32 : mp->buffer_dtype;
    fsdp_module_t *m = NULL, *master = NULL, *comp = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_optim_t *opt = NULL, *ref_opt = NULL;
    fsdp_named_list_t params = {0}, mparams = {0};
    fsdp_tensor_t *out = NULL, *tgt = NULL, *loss = NULL;
    seen_t in_root;
    char name[200], why[760];
    fsdp_options_t o;
    fu_job_options(j, &o);
    int rc;
    FU_TRY(done, "building", tm_transformer_create(ctx, true, true, &m));
    FU_TRY(done, "building the reference", tm_transformer_create(ctx, true, true, &master));
    FU_TRY(done, "building the reference", tm_transformer_create(ctx, true, true, &comp));
    FU_TRY(done, "building the reference", params_to(comp, pdt));
    FU_TRY(done, "building the reference", buffers_to(comp, bdt));
    /* One top-level unit (NO_FSDP model under FSDP(mixed_precision=cfg)), as the seed. */
    FU_TRY(done, "wrapping", fsdp_wrap(m, &o, &root));
    FU_TRY(done, "watching the root's inputs", watch(m, &in_root));
    FU_TRY(done, "optimizers", fsdp_named_params(root, &params));
    FU_TRY(done, "optimizers", fu_make_sgd(ctx, &params, EMB_LR, 0.0, &opt));
    FU_TRY(done, "optimizers", fsdp_module_named_params(master, false, &mparams));
    FU_TRY(done, "optimizers", fu_make_sgd(ctx, &mparams, EMB_LR, 0.0, &ref_opt));
    fsdp_pg_t *pg = fsdp_unit_pg(root);
    fsdp_flat_sizes_t fs;
    fsdp_unit_flat_sizes(root, &fs);
    const uint64_t pn = (uint64_t)fs.padded_numel;
    char gwhy[760] = "";
    bool grad_ok = true;
    bool ints = true, ldt_ok = true, loss_ok = true, ag_ok = true, rs_ok = true, f16g = true;
    double first = 0, last = 0;
    why[0] = 0;
    for (int it = 0; it < EMB_STEPS; it++) {
        double lv = 0, rv = 0;
        fsdp_pg_counters_t c0, c1, c2;
        fsdp_optim_zero_grad(opt, true);
        fsdp_pg_get_counters(pg, &c0);
        FU_TRY(done, "FSDP forward", fu_transformer_forward(ctx, m, &out, &tgt));
        fsdp_pg_get_counters(pg, &c1);
        FU_TRY(done, "FSDP loss", tm_transformer_loss(tgt, out, &loss));
        FU_TRY(done, "FSDP loss", fsdp_tensor_item(loss, 0, &lv));
        ints &= saw(&in_root, 0, FSDP_DTYPE_I64) && saw(&in_root, 1, FSDP_DTYPE_I64);
        if (fsdp_tensor_dtype(loss) != pdt && ldt_ok) {
            ldt_ok = false;
            fu_add_why(why, sizeof why, "step %d: the loss is %s", it,
                       fsdp_dtype_name(fsdp_tensor_dtype(loss)));
        }
        FU_TRY(done, "FSDP backward", fsdp_backward(loss, NULL));
        fsdp_pg_get_counters(pg, &c2);
        FU_TRY(done, "FSDP step", fsdp_optim_step(opt));
        FU_TRY(done, "reference step", ref_step(ctx, j->world, master, comp, ref_opt, rdt, &rv));
        {
            char w2[760];
            double gc = fu_shards_vs(root, NULL, true, fu_ref_grad, master, FU_F16_RTOL,
                                     FU_F16_ATOL, w2, sizeof w2);
            if (!(gc <= 1.0) && grad_ok) {
                grad_ok = false;
                fu_add_why(gwhy, sizeof gwhy, "step %d: worst %.3g of tolerance: %s", it, gc, w2);
            }
        }
        if (it == 0) first = lv;
        last = lv;
        double cl = fu_closeness(lv, rv, FU_F16_RTOL, FU_F16_ATOL);
        if (!(cl <= 1.0) && loss_ok) {
            loss_ok = false;
            fu_add_why(why, sizeof why, "step %d: loss %.9g, reference %.9g", it, lv, rv);
        }
        /* The first forward also runs the execution-order check's small all-gathers. */
        uint64_t ag_calls = c1.calls[FSDP_COLL_ALL_GATHER] - c0.calls[FSDP_COLL_ALL_GATHER];
        uint64_t ag_bytes = c1.bytes[FSDP_COLL_ALL_GATHER] - c0.bytes[FSDP_COLL_ALL_GATHER];
        uint64_t rs_calls = c2.calls[FSDP_COLL_REDUCE_SCATTER] - c1.calls[FSDP_COLL_REDUCE_SCATTER];
        uint64_t rs_bytes = c2.bytes[FSDP_COLL_REDUCE_SCATTER] - c1.bytes[FSDP_COLL_REDUCE_SCATTER];
        uint64_t ar_calls = c2.calls[FSDP_COLL_ALL_REDUCE] - c1.calls[FSDP_COLL_ALL_REDUCE];
        if (j->world > 1) {
            if (it > 0 && (ag_calls != 1 || ag_bytes != pn * fsdp_dtype_size(pdt)) && ag_ok) {
                ag_ok = false;
                fu_add_why(why, sizeof why,
                           "step %d: %llu all-gathers of %llu bytes, want 1 of %llu (%s)", it,
                           (unsigned long long)ag_calls, (unsigned long long)ag_bytes,
                           (unsigned long long)(pn * fsdp_dtype_size(pdt)), fsdp_dtype_name(pdt));
            }
            if ((rs_calls != 1 || rs_bytes != pn * fsdp_dtype_size(rdt)) && rs_ok) {
                rs_ok = false;
                fu_add_why(why, sizeof why,
                           "step %d: %llu reduce-scatters of %llu bytes, want 1 of %llu (%s)", it,
                           (unsigned long long)rs_calls, (unsigned long long)rs_bytes,
                           (unsigned long long)(pn * fsdp_dtype_size(rdt)), fsdp_dtype_name(rdt));
            }
        } else if ((ag_calls | rs_calls | ar_calls) != 0 && rs_ok) {
            rs_ok = false;
            fu_add_why(why, sizeof why, "step %d: W=1 communicated (%llu %llu %llu calls)", it,
                       (unsigned long long)ag_calls, (unsigned long long)rs_calls,
                       (unsigned long long)ar_calls);
        }
        fsdp_tensor_t *g = fsdp_tensor_grad(fsdp_unit_flat_param(root));
        if (rdt == FSDP_DTYPE_F16 && (!g || !all_f16_values(g))) f16g = false;
        fsdp_tensor_release(out);
        fsdp_tensor_release(tgt);
        fsdp_tensor_release(loss);
        out = tgt = loss = NULL;
    }
    snprintf(name, sizeof name,
             "%s: the integer token inputs reach the model uncast (i64 and i64 seen by a pre-hook "
             "after FSDP's) on all %d steps",
             ej->id, EMB_STEPS);
    fu_ck(r, ints && in_root.calls == EMB_STEPS, name, "last seen %s, %s in %d calls",
          dt_name(&in_root, 0), dt_name(&in_root, 1), in_root.calls);
    snprintf(name, sizeof name, "%s: the loss is %s (param_dtype%s) on every step", ej->id,
             fsdp_dtype_name(pdt), mp->param_dtype == FSDP_MP_UNSET ? " unset" : "");
    fu_ck(r, ldt_ok, name, "%s", why);
    snprintf(name, sizeof name,
             "%s: 6 SGD steps (lr 0.1): every loss matches the hand-cast reference within fp16 "
             "tolerance",
             ej->id);
    fu_ck(r, loss_ok, name, "%s", why);
    snprintf(name, sizeof name,
             "%s: on every step this rank's sharded gradient (f32) matches the reference's "
             "gradient rounded to the reduce dtype (fp16 tolerance)",
             ej->id);
    fu_ck(r, grad_ok, name, "%s", gwhy);
    fu_ck(r, fabs(first - last) > 1e-3 * fabs(first), "training moved the loss",
          "first %.9g, last %.9g", first, last);
    double cl = fu_shards_vs(root, NULL, false, fu_ref_param, master, FU_F16_RTOL, FU_F16_ATOL, why,
                             sizeof why);
    snprintf(name, sizeof name,
             "%s: after 6 steps this rank's shard of every parameter (f32) matches the reference "
             "masters within fp16 tolerance",
             ej->id);
    fu_ck(r, cl <= 1.0, name, "worst %.3g of tolerance: %s", cl, why);
    if (j->world > 1) {
        snprintf(name, sizeof name,
                 "%s: each step all-gathers padded_numel %s elements (param_dtype) once", ej->id,
                 fsdp_dtype_name(pdt));
        fu_ck(r, ag_ok, name, "%s", why);
        snprintf(name, sizeof name,
                 "%s: each step reduce-scatters padded_numel %s elements (%s bytes each: the "
                 "reduce dtype) once",
                 ej->id, fsdp_dtype_name(rdt), rdt == FSDP_DTYPE_F16 ? "2" : "4");
        fu_ck(r, rs_ok, name, "%s", why);
    } else {
        fu_ck(r, rs_ok, "W=1: nothing is communicated (NO_SHARD in effect)", "%s", why);
    }
    if (rdt == FSDP_DTYPE_F16) {
        snprintf(name, sizeof name,
                 "%s: every sharded gradient value is an f16 value (reduced in f16, stored in f32)",
                 ej->id);
        fu_ck(r, f16g, name, "a gradient value is not representable in f16");
    }
done:
    fsdp_tensor_release(out);
    fsdp_tensor_release(tgt);
    fsdp_tensor_release(loss);
    fsdp_named_list_free(&params);
    fsdp_named_list_free(&mparams);
    fsdp_optim_destroy(ref_opt);
    fu_teardown(ctx, m, root, NULL, opt);
    fsdp_module_release(master);
    fsdp_module_release(comp);
    return rc;
}

/* ---- MP-S14 ---------------------------------------------------------------------------------- */

#define S14_ROWS 32

typedef struct s14_job {
    fu_job_t j; /* first */
    int64_t d;
} s14_job_t;

static fsdp_tensor_t *expect_tensor(void *arg, const char *fqn) {
    return strcmp(fqn, "weight") == 0 ? arg : NULL;
}

static int s14_rank(fsdp_ctx_t *ctx, void *arg) {
    s14_job_t *sj = arg;
    fu_job_t *j = &sj->j;
    fu_res_t *r = fu_res_of(j, ctx);
    const int64_t d = sj->d;
    const int rank = fsdp_ctx_rank(ctx);
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *x = NULL, *y = NULL, *loss = NULL, *xr = NULL, *xh = NULL, *expect = NULL;
    float *acc = NULL, *gx_ref = NULL;
    int64_t ngx = 0;
    char why[760];
    fsdp_options_t o;
    fu_job_options(j, &o);
    int rc;
    tm_manual_seed(ctx, 0);
    FU_TRY(done, "building", fsdp_linear_create(ctx, d, d, false, &m));
    tm_manual_seed(ctx, 0);
    FU_TRY(done, "building the reference", fsdp_linear_create(ctx, d, d, false, &ref));
    FU_TRY(done, "building the reference", params_to(ref, FSDP_DTYPE_F16));
    FU_TRY(done, "wrapping", fsdp_wrap(m, &o, &root));
    FU_TRY(done, "input", fu_rand_input(ctx, 1 + (uint64_t)rank, S14_ROWS, d, &x));
    FU_TRY(done, "input", fsdp_tensor_set_requires_grad(x, true));
    FU_TRY(done, "FSDP forward", fsdp_module_forward1(m, x, &y));
    fu_ck(r, fsdp_tensor_dtype(y) == FSDP_DTYPE_F16, "MP-S14: the output is f16 (param_dtype)",
          "it is %s", fsdp_dtype_name(fsdp_tensor_dtype(y)));
    FU_TRY(done, "FSDP backward", tm_sum_loss(y, &loss));
    FU_TRY(done, "FSDP backward", fsdp_backward(loss, NULL));
    fsdp_tensor_t *gx = fsdp_tensor_grad(x);
    fu_ck(r, gx && fsdp_tensor_dtype(gx) == FSDP_DTYPE_F32,
          "MP-S14: the f32 input that requires grad gets its gradient, in f32 (through the cast)",
          "grad %s", gx ? fsdp_dtype_name(fsdp_tensor_dtype(gx)) : "none");

    /* The reference: every rank's input cast to f16 by hand through the f16 weights; this
     * rank's input gradient, and the weight gradients summed as the f32 reduction does (each
     * rank's f16 gradient in f32, pre-divided, summed in rank order, post-divided). */
    double pre, post;
    divide_factors(j->world, &pre, &post);
    fsdp_tensor_t *w16 = fsdp_module_param(ref, "weight");
    acc = calloc((size_t)(d * d), sizeof *acc);
    if (!acc) FU_TRY(done, "reference", FSDP_ENOMEM);
    for (int q = 0; q < j->world; q++) {
        FU_TRY(done, "reference", fsdp_tensor_zero_grad(w16, true));
        FU_TRY(done, "reference", fu_rand_input(ctx, 1 + (uint64_t)q, S14_ROWS, d, &xr));
        FU_TRY(done, "reference", fsdp_tensor_set_requires_grad(xr, true));
        FU_TRY(done, "reference", fsdp_to_dtype(xr, FSDP_DTYPE_F16, &xh));
        fsdp_tensor_release(y);
        fsdp_tensor_release(loss);
        y = loss = NULL;
        FU_TRY(done, "reference", fsdp_linear(xh, w16, NULL, &y));
        FU_TRY(done, "reference", tm_sum_loss(y, &loss));
        FU_TRY(done, "reference", fsdp_backward(loss, NULL));
        int64_t n = 0;
        float *g = fu_host_f32(fsdp_tensor_grad(w16), &n);
        if (!g || n != d * d) {
            free(g);
            FU_TRY(done, "reference", FSDP_EINTERNAL);
        }
        for (int64_t k = 0; k < n; k++) {
            float v = (float)(g[k] / pre);
            acc[k] = q == 0 ? v : acc[k] + v;
        }
        free(g);
        if (q == rank) gx_ref = fu_host_f32(fsdp_tensor_grad(xr), &ngx);
        fsdp_tensor_release(xr);
        fsdp_tensor_release(xh);
        xr = xh = NULL;
    }
    for (int64_t k = 0; k < d * d; k++)
        acc[k] = (float)(acc[k] / post);
    double worst = -1;
    if (gx && gx_ref) {
        int64_t n = 0;
        float *a = fu_host_f32(gx, &n);
        worst = a && n == ngx ? 0 : INFINITY;
        for (int64_t k = 0; a && k < n && n == ngx; k++) {
            double c = fu_closeness(a[k], gx_ref[k], FU_F32_RTOL, FU_F32_ATOL);
            if (!(c <= worst)) worst = isnan(c) ? INFINITY : c;
        }
        free(a);
    }
    fu_ck(r, worst >= 0 && worst <= 1.0,
          "MP-S14: the input gradient equals the hand-cast reference's (fp32 tolerance)",
          "worst element %.3g of tolerance", worst);
    const int64_t shape[2] = {d, d};
    FU_TRY(
        done, "reference",
        fsdp_tensor_from_host(ctx, FSDP_DTYPE_F32, 2, shape, acc, FSDP_MEM_ACTIVATIONS, &expect));
    double cl = fu_shards_vs(root, NULL, true, expect_tensor, expect, FU_F32_RTOL, FU_F32_ATOL, why,
                             sizeof why);
    fu_ck(r, cl <= 1.0,
          "MP-S14: the sharded weight gradient (f32) equals every rank's f16 gradient reduced in "
          "f32 (reduce_dtype), fp32 tolerance",
          "worst %.3g of tolerance: %s", cl, why);
done:
    free(acc);
    free(gx_ref);
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(xr);
    fsdp_tensor_release(xh);
    fsdp_tensor_release(expect);
    fu_teardown(ctx, m, root, NULL, NULL);
    fsdp_module_release(ref);
    return rc;
}

/* ---- MP-DP-01..06 ---------------------------------------------------------------------------- */

enum dp_case { DP01 = 1, DP02, DP03, DP04, DP05, DP06 };

typedef struct dp_job {
    fu_job_t j; /* first */
    enum dp_case c;
} dp_job_t;

/* The local reference of SaveForwardInputsModel: c1 in f32, c2's weights and input cast to f16
 * by hand; output and loss (sum) with its backward run. ref's c2 is converted in place. */
static int dp_reference(fsdp_ctx_t *ctx, fsdp_module_t *ref, fsdp_tensor_t *x,
                        fsdp_tensor_t **out) {
    fsdp_tensor_t *h = NULL, *hh = NULL, *loss = NULL;
    int rc = params_to(fsdp_module_child(ref, "c2"), FSDP_DTYPE_F16);
    (void)ctx;
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(ref, "c1"), x, &h);
    if (rc == 0) rc = fsdp_to_dtype(h, FSDP_DTYPE_F16, &hh);
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(ref, "c2"), hh, out);
    if (rc == 0) rc = tm_sum_loss(*out, &loss);
    if (rc == 0) rc = fsdp_backward(loss, NULL);
    fsdp_tensor_release(h);
    fsdp_tensor_release(hh);
    fsdp_tensor_release(loss);
    return rc;
}

/* DP-06's reference: every weight and the input in f16 (the root casts x; l2 gets l1's f16
 * output); y is not used by the computation. */
static int dp6_reference(fsdp_module_t *ref, fsdp_tensor_t *x, fsdp_tensor_t **out) {
    fsdp_tensor_t *xh = NULL, *h = NULL, *loss = NULL;
    int rc = params_to(ref, FSDP_DTYPE_F16);
    if (rc == 0) rc = fsdp_to_dtype(x, FSDP_DTYPE_F16, &xh);
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(ref, "l1"), xh, &h);
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(ref, "l2.l"), h, out);
    if (rc == 0) rc = tm_sum_loss(*out, &loss);
    if (rc == 0) rc = fsdp_backward(loss, NULL);
    fsdp_tensor_release(xh);
    fsdp_tensor_release(h);
    fsdp_tensor_release(loss);
    return rc;
}

static const char *const dp_ids[] = {"",         "MP-DP-01", "MP-DP-02", "MP-DP-03",
                                     "MP-DP-04", "MP-DP-05", "MP-DP-06"};

static int dp_rank(fsdp_ctx_t *ctx, void *arg) {
    dp_job_t *dj = arg;
    fu_job_t *j = &dj->j;
    fu_res_t *r = fu_res_of(j, ctx);
    const char *id = dp_ids[dj->c];
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_unit_t *root = NULL, *child = NULL;
    fsdp_tensor_t *x = NULL, *y = NULL, *loss = NULL, *ry = NULL;
    seen_t s_model, s_a, s_b;
    char name[200], why[760];
    fsdp_options_t o_root, o_child;
    fu_job_options(j, &o_root);
    o_child = o_root;
    int rc;
    fsdp_mixed_precision_t f16, f32;
    mp_init(&f16, FSDP_DTYPE_F16, FSDP_MP_UNSET, FSDP_MP_UNSET);
    mp_init(&f32, FSDP_DTYPE_F32, FSDP_MP_UNSET, FSDP_MP_UNSET);
    bool self_cast = dj->c == DP02;
    const char *wrapped = dj->c == DP04 ? "c1" : "c2";
    if (dj->c == DP06) {
        FU_TRY(done, "building", tm_external_inputs_create(ctx, &m));
        FU_TRY(done, "building the reference", tm_external_inputs_create(ctx, &ref));
        wrapped = "l2";
    } else {
        FU_TRY(done, "building", tm_save_inputs_create(ctx, self_cast, &m));
        FU_TRY(done, "building the reference", tm_save_inputs_create(ctx, false, &ref));
    }
    /* The child unit's and the root's configurations, as the seed's. */
    o_child.mixed_precision = f16;
    o_child.mixed_precision.cast_forward_inputs = dj->c == DP01 || dj->c == DP04 || dj->c == DP05;
    fsdp_mixed_precision_init(&o_root.mixed_precision);
    if (dj->c == DP04 || dj->c == DP05) {
        o_root.mixed_precision = f32;
        o_root.mixed_precision.cast_forward_inputs = true;
    } else if (dj->c == DP06) {
        o_root.mixed_precision = f16;
    }
    FU_TRY(done, "wrapping the child", fsdp_wrap(fsdp_module_child(m, wrapped), &o_child, &child));
    FU_TRY(done, "wrapping the root", fsdp_wrap(m, &o_root, &root));
    /* Hooks added after wrapping run after FSDP's: they see what the module's forward gets. */
    FU_TRY(done, "hooks", watch(m, &s_model));
    FU_TRY(done, "hooks", watch(fsdp_module_child(m, dj->c == DP06 ? "l1" : "c1"), &s_a));
    FU_TRY(done, "hooks", watch(fsdp_module_child(m, dj->c == DP06 ? "l2" : "c2"), &s_b));
    FU_TRY(done, "input", fu_rand_input(ctx, 7, 2, 100, &x));

    rc = fsdp_module_forward1(m, x, &y);
    if (dj->c == DP03 || dj->c == DP04) {
        const char *msg = fsdp_ctx_last_error(ctx);
        snprintf(name, sizeof name,
                 "%s: the forward fails with the linear kernel's \"" MAT_PHRASE "\" (EINVAL), no "
                 "output",
                 id);
        fu_ck(r, dtype_error(rc, msg, true) && !y, name, "rc %s, output %p, message \"%s\"",
              fsdp_err_name(rc), (void *)y, msg);
        snprintf(name, sizeof name, "%s: the message names the f16 and f32 operands", id);
        fu_ck(r, msg && strstr(msg, "f16[") && strstr(msg, "f32["), name, "message \"%s\"", msg);
        /* Which module got what: c1 ran (DP-04: in f16 after its cast), c2 was entered. */
        snprintf(name, sizeof name, "%s: recorded inputs model f32, c1 %s, c2 %s", id,
                 dj->c == DP04 ? "f16" : "f32", dj->c == DP04 ? "f16" : "f32");
        fu_ck(r,
              saw(&s_model, 0, FSDP_DTYPE_F32) &&
                  saw(&s_a, 0, dj->c == DP04 ? FSDP_DTYPE_F16 : FSDP_DTYPE_F32) &&
                  saw(&s_b, 0, dj->c == DP04 ? FSDP_DTYPE_F16 : FSDP_DTYPE_F32),
              name, "model %s, c1 %s, c2 %s", dt_name(&s_model, 0), dt_name(&s_a, 0),
              dt_name(&s_b, 0));
        fsdp_tape_clear(ctx);
        rc = fsdp_module_forward1(m, x, &y);
        msg = fsdp_ctx_last_error(ctx);
        snprintf(name, sizeof name,
                 "%s: a second forward fails the same way (no state left behind, no output)", id);
        fu_ck(r, dtype_error(rc, msg, true) && !y, name, "rc %s, message \"%s\"", fsdp_err_name(rc),
              msg);
        fsdp_tape_clear(ctx);
        rc = FSDP_OK;
        goto done;
    }
    if (rc < 0) FU_TRY(done, "FSDP forward", rc);
    FU_TRY(done, "FSDP backward", tm_sum_loss(y, &loss));
    FU_TRY(done, "FSDP backward", fsdp_backward(loss, NULL));
    if (dj->c == DP06) {
        fu_ck(
            r,
            saw(&s_model, 0, FSDP_DTYPE_F16) && saw(&s_b, 0, FSDP_DTYPE_F16) &&
                saw(&s_b, 1, FSDP_DTYPE_F32),
            "MP-DP-06: recorded model_input_x f16 (the root casts), l2_input_x f16 (l1's output), "
            "l2_input_y f32 (made in the parent's forward; a non-root unit does not cast)",
            "model_input_x %s, l2_input_x %s, l2_input_y %s", dt_name(&s_model, 0),
            dt_name(&s_b, 0), dt_name(&s_b, 1));
        FU_TRY(done, "reference", dp6_reference(ref, x, &ry));
    } else {
        fsdp_dtype_t c2_dt = dj->c == DP02 ? FSDP_DTYPE_F32 : FSDP_DTYPE_F16;
        snprintf(name, sizeof name, "%s: recorded inputs model f32, c1 f32, c2 %s%s", id,
                 fsdp_dtype_name(c2_dt),
                 dj->c == DP02 ? " (the unit does not cast; the module casts inside)" : "");
        fu_ck(r,
              saw(&s_model, 0, FSDP_DTYPE_F32) && saw(&s_a, 0, FSDP_DTYPE_F32) &&
                  saw(&s_b, 0, c2_dt),
              name, "model %s, c1 %s, c2 %s", dt_name(&s_model, 0), dt_name(&s_a, 0),
              dt_name(&s_b, 0));
        FU_TRY(done, "reference", dp_reference(ctx, ref, x, &ry));
    }
    snprintf(name, sizeof name,
             "%s: the output is f16 and matches the hand-cast local reference (fp16 tolerance)",
             id);
    double cl = fu_tensor_closeness(y, ry, FU_F16_RTOL, FU_F16_ATOL);
    fu_ck(r, fsdp_tensor_dtype(y) == FSDP_DTYPE_F16 && cl >= 0 && cl <= 1.0, name,
          "%s output, worst element %.3g of tolerance", fsdp_dtype_name(fsdp_tensor_dtype(y)), cl);
    snprintf(name, sizeof name,
             "%s: forward and backward complete; every unit IDLE and resharded afterwards", id);
    fu_ck(r, fu_tree_idle(root), name, "a unit is not");
    if (dj->c == DP05 || dj->c == DP06 || dj->c == DP01) {
        /* The same input on every rank: the reduction averages equal gradients. */
        cl = fu_shards_vs(root, child, true, fu_ref_grad, ref, FU_F16_RTOL, FU_F16_ATOL, why,
                          sizeof why);
        snprintf(name, sizeof name,
                 "%s: %s's sharded gradients are full precision (f32) and match the reference's "
                 "(fp16 tolerance)",
                 id, wrapped);
        fu_ck(r, cl <= 1.0, name, "worst %.3g of tolerance: %s", cl, why);
        cl = fu_shards_vs(root, NULL, true, fu_ref_grad, ref, FU_F16_RTOL, FU_F16_ATOL, why,
                          sizeof why);
        snprintf(name, sizeof name,
                 "%s: every sharded gradient of the tree (f32) matches the reference's, through "
                 "the f16 cast (fp16 tolerance)",
                 id);
        fu_ck(r, cl <= 1.0, name, "worst %.3g of tolerance: %s", cl, why);
    }
done:
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    fsdp_tensor_release(ry);
    fsdp_tensor_release(loss);
    fu_teardown(ctx, m, root, NULL, NULL);
    fsdp_module_release(ref);
    return rc;
}

/* ---- MP-IG-01 -------------------------------------------------------------------------------- */

static int ig_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_job_t *j = arg;
    fu_res_t *r = fu_res_of(j, ctx);
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *x = NULL, *y = NULL;
    fsdp_options_t o;
    fu_job_options(j, &o);
    int rc;
    FU_TRY(done, "building", tm_ignored_create(ctx, &m));
    fsdp_module_t *ign = fsdp_module_child(m, "ignored");
    fsdp_module_t *const ignored[1] = {ign};
    o.ignored_modules = ignored;
    o.num_ignored_modules = 1;
    FU_TRY(done, "wrapping", fsdp_wrap(m, &o, &root));
    fsdp_tensor_t *w = fsdp_module_param(ign, "l.weight");
    const int64_t x_shape[2] = {2, 100};
    FU_TRY(done, "input",
           fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 2, x_shape, 1.0, FSDP_MEM_ACTIVATIONS, &x));
    rc = fsdp_module_forward1(m, x, &y);
    const char *msg = fsdp_ctx_last_error(ctx);
    fu_ck(r, dtype_error(rc, msg, true) && !y,
          "MP-IG-01: the ignored f32 Linear receiving f16 activations fails with the kernel's "
          "\"" MAT_PHRASE "\" (EINVAL), no output",
          "rc %s, output %p, message \"%s\"", fsdp_err_name(rc), (void *)y, msg);
    fu_ck(r, msg && strstr(msg, "f16[2, 100]") && strstr(msg, "f32[100, 100]"),
          "MP-IG-01: the message names the f16 activation and the f32 weight", "message \"%s\"",
          msg);
    fu_ck(r,
          w == fsdp_module_param(ign, "l.weight") && fsdp_tensor_dtype(w) == FSDP_DTYPE_F32 &&
              fsdp_tensor_numel(w) == 100 * 100,
          "MP-IG-01: the ignored parameters stay the module's own, f32 and whole (not flattened)",
          "weight %s with %lld elements",
          fsdp_dtype_name(fsdp_tensor_dtype(fsdp_module_param(ign, "l.weight"))),
          (long long)fsdp_tensor_numel(fsdp_module_param(ign, "l.weight")));
    fsdp_tape_clear(ctx);
    rc = fsdp_module_forward1(m, x, &y);
    msg = fsdp_ctx_last_error(ctx);
    fu_ck(r, dtype_error(rc, msg, true) && !y,
          "MP-IG-01: a second forward fails the same way (nothing computed with the wrong dtype)",
          "rc %s, message \"%s\"", fsdp_err_name(rc), msg);
    fsdp_tape_clear(ctx);
    rc = fsdp_unit_destroy(root);
    root = NULL;
    fu_ck(r, rc == 0, "MP-IG-01: the wrapped model is torn down cleanly after the failures",
          "rc %s (%s)", fsdp_err_name(rc), fsdp_ctx_last_error(ctx));
    rc = FSDP_OK;
done:
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    fu_teardown(ctx, m, root, NULL, NULL);
    return rc;
}

/* ---- main ------------------------------------------------------------------------------------ */

static const int worlds[3] = {1, 2, 4};

int main(void) {
    tap_plan_lazy();
    char prefix[160];
    {
        fu_job_t *j = fu_job_new("kernel dtype checks", 1, FSDP_FULL_SHARD, false);
        fu_run_job(j, kernel_rank);
        free(j);
    }
    static const struct {
        const char *id, *what;
        fsdp_dtype_t p, rd, b;
    } cfgs[4] = {
        {"MP-S03", "reduce f16 only", FSDP_MP_UNSET, FSDP_DTYPE_F16, FSDP_MP_UNSET},
        {"MP-S04", "param + buffer f16", FSDP_DTYPE_F16, FSDP_MP_UNSET, FSDP_DTYPE_F16},
        {"MP-S05", "param, reduce, buffer f16", FSDP_DTYPE_F16, FSDP_DTYPE_F16, FSDP_DTYPE_F16},
        {"MP-S06", "param f16, reduce f32, buffer f16", FSDP_DTYPE_F16, FSDP_DTYPE_F32,
         FSDP_DTYPE_F16},
    };
    for (int c = 0; c < 4; c++)
        for (int w = 0; w < 3; w++) {
            emb_job_t *ej = calloc(1, sizeof *ej);
            if (!ej) tap_bail("out of memory");
            snprintf(prefix, sizeof prefix, "%s TransformerWithSharedParams (%s) FULL_SHARD",
                     cfgs[c].id, cfgs[c].what);
            fu_job_init(&ej->j, prefix, worlds[w], FSDP_FULL_SHARD, false);
            mp_init(&ej->j.mp, cfgs[c].p, cfgs[c].rd, cfgs[c].b);
            ej->id = cfgs[c].id;
            fu_run_job(&ej->j, emb_rank);
            free(ej);
        }
    for (int w = 0; w < 3; w++)
        for (int s = 0; s < 3; s++)
            for (int orig = 0; orig < 2; orig++) {
                s14_job_t *sj = calloc(1, sizeof *sj);
                if (!sj) tap_bail("out of memory");
                /* The seed's Linear(1024, 1024) at its world size 2; smaller elsewhere. */
                sj->d = worlds[w] == 2 ? 1024 : 256;
                snprintf(prefix, sizeof prefix,
                         "MP-S14 Linear(%lld, %lld) param f16 reduce f32 %s use_orig_params=%d",
                         (long long)sj->d, (long long)sj->d,
                         fsdp_sharding_strategy_name(fu_strategies[s]), orig);
                fu_job_init(&sj->j, prefix, worlds[w], fu_strategies[s], orig);
                mp_init(&sj->j.mp, FSDP_DTYPE_F16, FSDP_DTYPE_F32, FSDP_DTYPE_F32);
                fu_run_job(&sj->j, s14_rank);
                free(sj);
            }
    static const char *const dp_what[] = {
        "",
        "c2 f16 (cast_forward_inputs) under a root without mixed precision",
        "c2 f16 without cast_forward_inputs, modules cast themselves",
        "c2 f16 without cast_forward_inputs, modules do not cast",
        "c1 f16 (cast) then c2 in an f32 root",
        "c2 f16 (cast) under an f32 root",
        "l2 f16 under an f16 root, y made inside the parent",
    };
    for (int c = DP01; c <= DP06; c++)
        for (int w = 0; w < 3; w++) {
            if (c != DP05 && worlds[w] != 2) continue; /* the seed's world size 2 */
            dp_job_t *dj = calloc(1, sizeof *dj);
            if (!dj) tap_bail("out of memory");
            snprintf(prefix, sizeof prefix, "%s %s", dp_ids[c], dp_what[c]);
            fu_job_init(&dj->j, prefix, worlds[w], FSDP_FULL_SHARD, false);
            dj->c = (enum dp_case)c;
            fu_run_job(&dj->j, dp_rank);
            free(dj);
        }
    for (int w = 1; w <= 2; w++) {
        fu_job_t *j = fu_job_new("MP-IG-01 ModelWithIgnoredModule param f16, ignored_modules = "
                                 "[ignored]",
                                 w, FSDP_FULL_SHARD, false);
        mp_init(&j->mp, FSDP_DTYPE_F16, FSDP_MP_UNSET, FSDP_MP_UNSET);
        fu_run_job(j, ig_rank);
        free(j);
    }
    return tap_done();
}
