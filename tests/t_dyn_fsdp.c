/*
 * t_dyn_fsdp.c: the corner cases of seed 004 (test_dynamo_distributed.py) that have a C analog,
 * each under DDP or FSDP on sim ranks against the same module run locally:
 *   - DYN-SP-11: a custom layer with its own backward (fsdp_function_apply, a raw-weight
 *     matrix product) between Linear layers: its gradients equal the built-in linear's bitwise,
 *     and under DDP and FSDP the outputs, gradients and parameters after SGD steps equal the
 *     local run's; the function API's refusals, a wrong-shaped gradient, and arg_free running
 *     exactly once whatever happens;
 *   - DYN-SP-18: a module that reads one buffer twice and keeps a plain (unregistered) tensor
 *     attribute, under FSDP: neither is flattened, and the output equals the local one;
 *   - DYN-SP-19: one buffer registered under two modules, doubled in place by every forward:
 *     after wrapping it is still one storage, 15 forwards under FSDP give the local values
 *     exactly, and the state dict lists it under both names;
 *   - DYN-MP-08: a forward that sets a module attribute: the change persists under FSDP, the
 *     output is 2 * net(x), and the root stays the root (lazy init once);
 *   - DYN-MP-07, DYN-MP-09: the dynamo ToyModel (hidden 501, so every shard is padded) under
 *     FSDP as one root unit and as a unit per Linear at world sizes 1, 2 and 4: the output
 *     equals the unwrapped model's;
 *   - DYN-SP-08: DDP and FSDP wrappers called with batch sizes 100, 200 and 300 in turn give
 *     the local output each time;
 *   - DYN-FK-03: a module without parameters (randn(3) * randn(3)) under DDP and FSDP: no
 *     bucket, no flat parameter, no collective after creation, the local output.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "models/models.h"
#include "tap.h"

#define W 2

/* ---- a raw-weight layer with its own backward ---------------------------------------------- */

static int arg_frees; /* arg_free calls, counted by the function-API checks */

static void count_free(void *arg) {
    (void)arg;
    arg_frees++;
}

/* y = x W^T for x (N, in) and W (out, in). */
static int raw_forward(fsdp_ctx_t *ctx, void *arg, int nin, fsdp_tensor_t *const *in, int nout,
                       fsdp_tensor_t **out) {
    (void)ctx, (void)arg, (void)nin, (void)nout;
    fsdp_tensor_t *wt = NULL;
    int rc = fsdp_transpose(in[1], 0, 1, &wt);
    if (rc == 0) rc = fsdp_matmul(in[0], wt, &out[0]);
    fsdp_tensor_release(wt);
    return rc;
}

/* dx = dy W, dW = dy^T x. */
static int raw_backward(fsdp_ctx_t *ctx, void *arg, int nin, fsdp_tensor_t *const *in,
                        const bool *needs, int nout, fsdp_tensor_t *const *gout,
                        fsdp_tensor_t **gin) {
    (void)ctx, (void)arg, (void)nin, (void)nout;
    int rc = FSDP_OK;
    if (needs[0]) rc = fsdp_matmul(gout[0], in[1], &gin[0]);
    if (rc == 0 && needs[1]) {
        fsdp_tensor_t *gt = NULL;
        rc = fsdp_transpose(gout[0], 0, 1, &gt);
        if (rc == 0) rc = fsdp_matmul(gt, in[0], &gin[1]);
        fsdp_tensor_release(gt);
    }
    return rc;
}

static const fsdp_function_t raw_fn = {"raw_linear", raw_forward, raw_backward};

/* A backward that returns dW transposed, (in, out) for a W of (out, in), and no dx. */
static int bad_backward(fsdp_ctx_t *ctx, void *arg, int nin, fsdp_tensor_t *const *in,
                        const bool *needs, int nout, fsdp_tensor_t *const *gout,
                        fsdp_tensor_t **gin) {
    (void)ctx, (void)arg, (void)nin, (void)nout, (void)needs;
    fsdp_tensor_t *xt = NULL;
    int rc = fsdp_transpose(in[0], 0, 1, &xt);
    if (rc == 0) rc = fsdp_matmul(xt, gout[0], &gin[1]);
    fsdp_tensor_release(xt);
    return rc;
}

static const fsdp_function_t bad_fn = {"bad_shape", raw_forward, bad_backward};

static int null_forward(fsdp_ctx_t *ctx, void *arg, int nin, fsdp_tensor_t *const *in, int nout,
                        fsdp_tensor_t **out) {
    (void)ctx, (void)arg, (void)nin, (void)in, (void)nout, (void)out;
    return 0;
}

static const fsdp_function_t null_fn = {"leaves_null", null_forward, raw_backward};

/* The module: parameter "weight" (out, in), forward through raw_fn. */
static int rawlin_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                          fsdp_tensor_t **out) {
    (void)nin, (void)nout;
    fsdp_tensor_t *args[2] = {in[0], fsdp_module_param(m, "weight")};
    return fsdp_function_apply(fsdp_module_ctx(m), &raw_fn, NULL, NULL, 2, args, 1, out);
}

static const fsdp_module_ops_t rawlin_ops = {"RawLinear", rawlin_forward, NULL};

static int rawlin_create(fsdp_ctx_t *ctx, int64_t in, int64_t out, fsdp_module_t **m) {
    fsdp_tensor_t *w = NULL;
    int rc =
        fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, (const int64_t[]){out, in}, FSDP_MEM_PARAMS, &w);
    if (rc == 0) rc = fsdp_tensor_normal_(w, 0, 1.0 / sqrt((double)in));
    if (rc == 0) rc = fsdp_module_create(ctx, &rawlin_ops, NULL, m);
    if (rc == 0) rc = fsdp_module_add_param(*m, "weight", w);
    fsdp_tensor_release(w);
    return rc;
}

/* The seed's custom model: relu(x + l2(relu(raw(relu(l1(x)))))). */
typedef struct custom_net {
    fsdp_module_t *l1, *raw, *l2;
} custom_net_t;

static int custom_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                          fsdp_tensor_t **out) {
    (void)nin, (void)nout;
    custom_net_t *c = fsdp_module_impl(m);
    fsdp_tensor_t *a = NULL, *b = NULL, *d = NULL, *e = NULL, *f = NULL, *g = NULL;
    int rc = fsdp_module_forward1(c->l1, in[0], &a);
    if (rc == 0) rc = fsdp_relu(a, &b);
    if (rc == 0) rc = fsdp_module_forward1(c->raw, b, &d);
    if (rc == 0) rc = fsdp_relu(d, &e);
    if (rc == 0) rc = fsdp_module_forward1(c->l2, e, &f);
    if (rc == 0) rc = fsdp_add(in[0], f, &g);
    if (rc == 0) rc = fsdp_relu(g, &out[0]);
    fsdp_tensor_release(a), fsdp_tensor_release(b), fsdp_tensor_release(d);
    fsdp_tensor_release(e), fsdp_tensor_release(f), fsdp_tensor_release(g);
    return rc;
}

static void custom_destroy(void *impl) {
    free(impl);
}

static const fsdp_module_ops_t custom_ops = {"CustomNet", custom_forward, custom_destroy};

/* The model with weights from (seed, stream 0), the same on every rank. */
static int custom_create(fsdp_ctx_t *ctx, int64_t d, fsdp_module_t **out) {
    fsdp_rng_init(fsdp_ctx_rng(ctx), 42, 0);
    custom_net_t *c = calloc(1, sizeof *c);
    fsdp_module_t *m = NULL;
    int rc = c ? FSDP_OK : FSDP_ENOMEM;
    if (rc == 0) rc = fsdp_linear_create(ctx, d, d, true, &c->l1);
    if (rc == 0) rc = rawlin_create(ctx, d, d, &c->raw);
    if (rc == 0) rc = fsdp_linear_create(ctx, d, d, true, &c->l2);
    if (rc == 0) rc = fsdp_module_create(ctx, &custom_ops, c, &m);
    if (rc == 0) {
        fsdp_module_add_child(m, "l1", c->l1);
        fsdp_module_add_child(m, "raw", c->raw);
        fsdp_module_add_child(m, "l2", c->l2);
    }
    if (c) { /* the tree holds the children now */
        fsdp_module_release(c->l1), fsdp_module_release(c->raw), fsdp_module_release(c->l2);
    }
    if (rc < 0) {
        if (!m) free(c);
        fsdp_module_release(m);
        return rc;
    }
    *out = m;
    return FSDP_OK;
}

static void test_function_api(void) {
    fsdp_ctx_t *ctx = NULL;
    if (fsdp_ctx_create(NULL, &ctx) < 0) tap_bail("fsdp_ctx_create");
    fsdp_rng_init(fsdp_ctx_rng(ctx), 3, 0);
    fsdp_tensor_t *x = NULL, *w = NULL, *y = NULL, *s = NULL;
    fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, (const int64_t[]){5, 3}, FSDP_MEM_OTHER, &x);
    fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, (const int64_t[]){4, 3}, FSDP_MEM_PARAMS, &w);
    fsdp_tensor_normal_(x, 0, 1);
    fsdp_tensor_normal_(w, 0, 1);
    fsdp_tensor_set_requires_grad(x, true);
    fsdp_tensor_set_requires_grad(w, true);

    /* The built-in linear, then the custom function: the same values and gradients. */
    float gx_ref[15], gw_ref[12], y_ref[20], gx[15], gw[12], yv[20];
    int rc = fsdp_linear(x, w, NULL, &y);
    if (rc == 0) rc = fsdp_tensor_to_host(y, y_ref, sizeof y_ref);
    if (rc == 0) rc = fsdp_sum(y, 0, NULL, false, &s);
    if (rc == 0) rc = fsdp_backward(s, NULL);
    if (rc == 0) rc = fsdp_tensor_to_host(fsdp_tensor_grad(x), gx_ref, sizeof gx_ref);
    if (rc == 0) rc = fsdp_tensor_to_host(fsdp_tensor_grad(w), gw_ref, sizeof gw_ref);
    tap_is_int(rc, FSDP_OK, "DYN-SP-11 the built-in linear runs");
    fsdp_tensor_release(s), fsdp_tensor_release(y);
    s = y = NULL;
    fsdp_tensor_zero_grad(x, true);
    fsdp_tensor_zero_grad(w, true);
    arg_frees = 0;
    rc = fsdp_function_apply(ctx, &raw_fn, NULL, count_free, 2, (fsdp_tensor_t *[]){x, w}, 1, &y);
    tap_is_int(rc, FSDP_OK, "DYN-SP-11 fsdp_function_apply records the custom layer");
    tap_ok(y && fsdp_tensor_requires_grad(y), "its output requires a gradient");
    tap_is_int(arg_frees, 0, "arg is kept while the tape holds the operation");
    if (rc == 0) rc = fsdp_tensor_to_host(y, yv, sizeof yv);
    if (rc == 0) rc = fsdp_sum(y, 0, NULL, false, &s);
    if (rc == 0) rc = fsdp_backward(s, NULL);
    tap_is_int(rc, FSDP_OK, "backward through the custom function");
    tap_is_int(arg_frees, 1, "arg_free runs once when the tape lets go");
    if (rc == 0) rc = fsdp_tensor_to_host(fsdp_tensor_grad(x), gx, sizeof gx);
    if (rc == 0) rc = fsdp_tensor_to_host(fsdp_tensor_grad(w), gw, sizeof gw);
    tap_ok(rc == 0 && memcmp(yv, y_ref, sizeof yv) == 0 && memcmp(gx, gx_ref, sizeof gx) == 0 &&
               memcmp(gw, gw_ref, sizeof gw) == 0,
           "DYN-SP-11 its output and both gradients equal the built-in linear's bitwise");
    fsdp_tensor_release(s), fsdp_tensor_release(y);
    s = y = NULL;

    /* Without grad nothing is recorded and arg goes at once. */
    arg_frees = 0;
    bool was = fsdp_set_grad_enabled(ctx, false);
    rc = fsdp_function_apply(ctx, &raw_fn, NULL, count_free, 2, (fsdp_tensor_t *[]){x, w}, 1, &y);
    fsdp_set_grad_enabled(ctx, was);
    tap_ok(rc == 0 && y && !fsdp_tensor_requires_grad(y) && fsdp_tape_size(ctx) == 0 &&
               arg_frees == 1,
           "without grad: computed, not recorded, arg freed at once");
    fsdp_tensor_release(y);
    y = NULL;

    /* Refusals, each freeing arg. */
    arg_frees = 0;
    fsdp_function_t nobw = raw_fn;
    nobw.backward = NULL;
    rc = fsdp_function_apply(ctx, &nobw, NULL, count_free, 2, (fsdp_tensor_t *[]){x, w}, 1, &y);
    tap_ok(rc == FSDP_EINVAL && !y && arg_frees == 1,
           "a function without backward is FSDP_EINVAL, arg freed");
    tap_has_str(fsdp_ctx_last_error(ctx), "raw_linear", "and the error names the function");
    rc =
        fsdp_function_apply(ctx, &raw_fn, NULL, count_free, 2, (fsdp_tensor_t *[]){x, NULL}, 1, &y);
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_ctx_last_error(ctx), "input 1") && arg_frees == 2,
           "a NULL input is FSDP_EINVAL naming it (%s)", fsdp_ctx_last_error(ctx));
    rc = fsdp_function_apply(ctx, &null_fn, NULL, count_free, 2, (fsdp_tensor_t *[]){x, w}, 1, &y);
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_ctx_last_error(ctx), "output 0") && arg_frees == 3,
           "a forward that leaves an output NULL is FSDP_EINVAL (%s)", fsdp_ctx_last_error(ctx));

    /* A wrong-shaped gradient fails the backward, naming the input. */
    rc = fsdp_function_apply(ctx, &bad_fn, NULL, NULL, 2, (fsdp_tensor_t *[]){x, w}, 1, &y);
    if (rc == 0) rc = fsdp_sum(y, 0, NULL, false, &s);
    if (rc == 0) rc = fsdp_backward(s, NULL);
    tap_is_int(rc, FSDP_EINVAL, "a backward that returns a wrong-shaped gradient fails");
    tap_has_str(fsdp_ctx_last_error(ctx), "input 1", "and the error names the input (%s)",
                fsdp_ctx_last_error(ctx));
    tap_is_size(fsdp_tape_size(ctx), 0, "the tape is cleared after the failed backward");
    fsdp_tensor_release(s), fsdp_tensor_release(y);
    fsdp_tensor_release(x), fsdp_tensor_release(w);
    fsdp_ctx_destroy(ctx);
}

/* ---- DYN-SP-11 under DDP and FSDP ------------------------------------------------------------ */

typedef struct sp11_job {
    fu_job_t j; /* first */
    bool fsdp;
} sp11_job_t;

#define SP11_D 32
#define SP11_STEPS 3

/* SGD steps of the model on the same batch on every rank (so the average over ranks of the
 * gradient is the local gradient exactly); losses into loss[], then every parameter (full)
 * into *params. */
static int sp11_train(fsdp_ctx_t *ctx, fsdp_module_t *m, fsdp_ddp_t *ddp, fsdp_unit_t *root,
                      float *loss, fu_vals_t *params) {
    int rc = FSDP_OK;
    fsdp_named_list_t l = {0};
    fsdp_optim_t *opt = NULL;
    fsdp_tensor_t *x = NULL, *y = NULL, *s = NULL;
    if (root)
        rc = fsdp_named_params(root, &l);
    else
        rc = fsdp_module_named_params(m, false, &l);
    if (rc == 0) rc = fu_make_sgd(ctx, &l, 0.05, 0.9, &opt);
    for (int step = 0; step < SP11_STEPS && rc == 0; step++) {
        fsdp_rng_init(fsdp_ctx_rng(ctx), 7, (uint64_t)step); /* the batch: the same on every rank */
        rc = fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, (const int64_t[]){6, SP11_D}, FSDP_MEM_OTHER,
                               &x);
        if (rc == 0) rc = fsdp_tensor_normal_(x, 0, 1);
        if (rc == 0) rc = ddp ? fsdp_ddp_forward1(ddp, x, &y) : fsdp_module_forward1(m, x, &y);
        if (rc == 0) rc = fsdp_mean(y, 0, NULL, false, &s);
        double v = 0;
        if (rc == 0) rc = fsdp_tensor_item(s, 0, &v);
        loss[step] = (float)v;
        if (rc == 0) rc = fsdp_backward(s, NULL);
        if (rc == 0) rc = fsdp_optim_step(opt);
        if (rc == 0) rc = fsdp_optim_zero_grad(opt, true);
        fsdp_tensor_release(x), fsdp_tensor_release(y), fsdp_tensor_release(s);
        x = y = s = NULL;
    }
    fsdp_optim_destroy(opt);
    fsdp_named_list_free(&l);
    if (rc == 0 && root) rc = fu_summon_nowb(root);
    if (rc == 0) rc = fu_module_values(m, false, false, params);
    if (root) {
        int r2 = fsdp_summon_end(root);
        if (rc == 0) rc = r2;
    }
    return rc;
}

static int sp11_rank(fsdp_ctx_t *ctx, void *arg) {
    sp11_job_t *sj = arg;
    fu_res_t *r = fu_res_of(&sj->j, ctx);
    int rc = FSDP_OK;
    fsdp_module_t *local = NULL, *m = NULL;
    fsdp_ddp_t *ddp = NULL;
    fsdp_unit_t *root = NULL;
    float lref[SP11_STEPS], lgot[SP11_STEPS];
    fu_vals_t pref = {0}, pgot = {0};
    FU_TRY(out, "the local model", custom_create(ctx, SP11_D, &local));
    FU_TRY(out, "the local run", sp11_train(ctx, local, NULL, NULL, lref, &pref));
    FU_TRY(out, "the wrapped model", custom_create(ctx, SP11_D, &m));
    if (sj->fsdp) {
        fsdp_options_t o;
        fu_job_options(&sj->j, &o);
        FU_TRY(out, "wrap", fu_wrap_types(m, &o, (const char *const[]){"RawLinear", NULL}, &root));
        fu_ck(r, fsdp_unit_of(fsdp_module_child(m, "raw")) != NULL, "the custom layer is a unit",
              "not wrapped");
    } else {
        FU_TRY(out, "DDP", fsdp_ddp_create(m, fsdp_ctx_pg(ctx), NULL, &ddp));
    }
    FU_TRY(out, "the wrapped run", sp11_train(ctx, m, ddp, root, lgot, &pgot));
    fu_ck(r, memcmp(lref, lgot, sizeof lref) == 0, "the losses equal the local run's",
          "%.9g %.9g %.9g vs %.9g %.9g %.9g", (double)lgot[0], (double)lgot[1], (double)lgot[2],
          (double)lref[0], (double)lref[1], (double)lref[2]);
    fu_ck(r, pref.n == pgot.n && pref.n > 0 && memcmp(pref.v, pgot.v, pref.n * sizeof *pref.v) == 0,
          "the parameters after the SGD steps equal the local run's bitwise", "%zu vs %zu values",
          pgot.n, pref.n);
out:
    fu_vals_free(&pref), fu_vals_free(&pgot);
    fsdp_ddp_destroy(ddp);
    fsdp_unit_destroy(root);
    fsdp_module_release(m);
    fsdp_module_release(local);
    return rc;
}

static void test_sp11(void) {
    for (int k = 0; k < 2; k++) {
        sp11_job_t sj;
        fu_job_init(&sj.j, k ? "DYN-SP-11 FSDP, the custom layer a unit" : "DYN-SP-11 DDP", W,
                    FSDP_FULL_SHARD, true);
        sj.fsdp = k == 1;
        fu_run_job(&sj.j, sp11_rank);
    }
}

/* ---- DYN-SP-18: one buffer read twice, a plain tensor attribute ------------------------------ */

typedef struct dup_mod {
    fsdp_tensor_t *plain; /* not registered: FSDP must leave it alone */
} dup_mod_t;

static int dup_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                       fsdp_tensor_t **out) {
    (void)nin, (void)nout;
    dup_mod_t *d = fsdp_module_impl(m);
    fsdp_tensor_t *buf = fsdp_module_buffer(m, "_buf"), *a = NULL, *b = NULL, *pp = NULL;
    int rc = fsdp_add(in[0], buf, &a);
    if (rc == 0) rc = fsdp_add(a, buf, &b);
    if (rc == 0) rc = fsdp_add(d->plain, d->plain, &pp);
    if (rc == 0) rc = fsdp_add(b, pp, &out[0]);
    fsdp_tensor_release(a), fsdp_tensor_release(b), fsdp_tensor_release(pp);
    return rc;
}

static void dup_destroy(void *impl) {
    dup_mod_t *d = impl;
    fsdp_tensor_release(d->plain);
    free(d);
}

static const fsdp_module_ops_t dup_ops = {"DuplicateModule", dup_forward, dup_destroy};

/* A tensor of n values start, start + 1, ... */
static int ramp(fsdp_ctx_t *ctx, int64_t n, float start, fsdp_mem_cat_t cat, fsdp_tensor_t **out) {
    float v[16];
    for (int64_t i = 0; i < n && i < 16; i++)
        v[i] = start + (float)i;
    return fsdp_tensor_from_host(ctx, FSDP_DTYPE_F32, 1, (const int64_t[]){n}, v, cat, out);
}

static int dup_create(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    dup_mod_t *d = calloc(1, sizeof *d);
    fsdp_tensor_t *buf = NULL;
    int rc = d ? ramp(ctx, 4, 0.5f, FSDP_MEM_OTHER, &d->plain) : FSDP_ENOMEM;
    if (rc == 0) rc = ramp(ctx, 4, -2.0f, FSDP_MEM_OTHER, &buf);
    if (rc == 0) rc = fsdp_module_create(ctx, &dup_ops, d, out);
    if (rc == 0) rc = fsdp_module_add_buffer(*out, "_buf", buf, true);
    if (rc < 0 && !*out && d) dup_destroy(d);
    fsdp_tensor_release(buf);
    return rc;
}

static int sp18_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_res_t *r = fu_res_of(arg, ctx);
    int rc = FSDP_OK;
    fsdp_module_t *local = NULL, *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *x = NULL, *yl = NULL, *y = NULL;
    fsdp_named_list_t l = {0};
    FU_TRY(out, "models", dup_create(ctx, &local));
    FU_TRY(out, "models", dup_create(ctx, &m));
    fsdp_tensor_t *plain = ((dup_mod_t *)fsdp_module_impl(m))->plain;
    fsdp_options_t o;
    fu_job_options(arg, &o);
    FU_TRY(out, "wrap", fsdp_wrap(m, &o, &root));
    FU_TRY(out, "input", ramp(ctx, 4, 10.0f, FSDP_MEM_OTHER, &x));
    FU_TRY(out, "local forward", fsdp_module_forward1(local, x, &yl));
    FU_TRY(out, "FSDP forward", fsdp_module_forward1(m, x, &y));
    fu_ck(r, fu_same_bits(y, yl) == 1, "x + buf + buf + (p + p) equals the local output",
          "differs");
    FU_TRY(out, "named params", fsdp_named_params(root, &l));
    fsdp_flat_sizes_t fs;
    fsdp_unit_flat_sizes(root, &fs);
    fu_ck(r, l.n == 0 && fs.unpadded_numel == 0,
          "neither the buffer nor the plain attribute is flattened",
          "%zu parameters, %lld flat elements", l.n, (long long)fs.unpadded_numel);
    fu_ck(r,
          fsdp_module_buffer(m, "_buf") != NULL &&
              ((dup_mod_t *)fsdp_module_impl(m))->plain == plain,
          "the buffer stays registered and the attribute is the same tensor", "changed");
out:
    fsdp_named_list_free(&l);
    fsdp_tensor_release(x), fsdp_tensor_release(yl), fsdp_tensor_release(y);
    fsdp_unit_destroy(root);
    fsdp_module_release(m), fsdp_module_release(local);
    return rc;
}

/* ---- DYN-SP-19: one buffer under two modules, doubled in place ---------------------------------
 */

static int bufmod_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                          fsdp_tensor_t **out) {
    (void)nin, (void)nout;
    return fsdp_add(in[0], fsdp_module_buffer(m, "_buf"), &out[0]);
}

static const fsdp_module_ops_t bufmod_ops = {"BufModule", bufmod_forward, NULL};

static int shared_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                          fsdp_tensor_t **out) {
    (void)nin, (void)nout;
    fsdp_tensor_t *buf = fsdp_module_buffer(m, "_buf"), *dbl = NULL, *a = NULL, *b = NULL;
    bool was = fsdp_set_grad_enabled(fsdp_module_ctx(m), false); /* buf.mul_(2) */
    int rc = fsdp_scale(buf, 2.0, &dbl);
    if (rc == 0) rc = fsdp_tensor_copy_(buf, dbl);
    fsdp_set_grad_enabled(fsdp_module_ctx(m), was);
    if (rc == 0) rc = fsdp_add(in[0], buf, &a);
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(m, "_buf_module"), a, &b);
    if (rc == 0) rc = fsdp_add(b, fsdp_module_param(m, "_param"), &out[0]);
    fsdp_tensor_release(dbl), fsdp_tensor_release(a), fsdp_tensor_release(b);
    return rc;
}

static const fsdp_module_ops_t shared_ops = {"SharedBufModel", shared_forward, NULL};

static int shared_create(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_module_t *m = NULL, *c = NULL;
    fsdp_tensor_t *buf = NULL, *p = NULL;
    int rc = ramp(ctx, 4, 1.0f, FSDP_MEM_OTHER, &buf);
    if (rc == 0) rc = ramp(ctx, 1, 0.25f, FSDP_MEM_PARAMS, &p);
    if (rc == 0) rc = fsdp_module_create(ctx, &shared_ops, NULL, &m);
    if (rc == 0) rc = fsdp_module_create(ctx, &bufmod_ops, NULL, &c);
    if (rc == 0) rc = fsdp_module_add_param(m, "_param", p);
    if (rc == 0) rc = fsdp_module_add_buffer(c, "_buf", buf, true);
    if (rc == 0) rc = fsdp_module_add_child(m, "_buf_module", c);
    if (rc == 0) rc = fsdp_module_add_buffer(m, "_buf", buf, true);
    fsdp_module_release(c), fsdp_tensor_release(buf), fsdp_tensor_release(p);
    if (rc < 0) {
        fsdp_module_release(m);
        return rc;
    }
    *out = m;
    return FSDP_OK;
}

static int sp19_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_res_t *r = fu_res_of(arg, ctx);
    int rc = FSDP_OK;
    fsdp_module_t *local = NULL, *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *x = NULL;
    fsdp_named_list_t sd = {0};
    FU_TRY(out, "models", shared_create(ctx, &local));
    FU_TRY(out, "models", shared_create(ctx, &m));
    fsdp_options_t o;
    fu_job_options(arg, &o);
    FU_TRY(out, "wrap", fsdp_wrap(m, &o, &root));
    FU_TRY(out, "input", ramp(ctx, 4, 3.0f, FSDP_MEM_OTHER, &x));
    int same = 0;
    for (int k = 0; k < 15; k++) {
        fsdp_tensor_t *yl = NULL, *y = NULL;
        rc = fsdp_module_forward1(local, x, &yl);
        if (rc == 0) rc = fsdp_module_forward1(m, x, &y);
        if (rc == 0 && fu_same_bits(y, yl) == 1) same++;
        fsdp_tensor_release(yl), fsdp_tensor_release(y);
        fsdp_tape_clear(ctx); /* the graph of a forward without backward is dropped */
        if (rc < 0) {
            fu_fatal(r, ctx, "forward", rc);
            goto out;
        }
    }
    fu_ck(r, same == 15, "15 forwards that double a shared buffer equal the local ones",
          "%d of 15 equal", same);
    fsdp_tensor_t *a = fsdp_module_buffer(m, "_buf"),
                  *b = fsdp_module_buffer(m, "_buf_module._buf");
    fu_ck(r, a && a == b && fsdp_tensor_data(a) == fsdp_tensor_data(b),
          "after wrapping the buffer is one tensor under both names", "two tensors");
    float v[4];
    fu_ck(r, a && fsdp_tensor_to_host(a, v, sizeof v) == 0 && v[0] == 32768.0f && v[3] == 131072.0f,
          "the in-place doublings all landed in it (1 * 2^15)", "%g", (double)v[0]);
    FU_TRY(out, "state dict", fsdp_module_state_dict(m, &sd));
    int hits = 0;
    for (size_t i = 0; i < sd.n; i++)
        if (strcmp(sd.names[i], "_buf") == 0 || strcmp(sd.names[i], "_buf_module._buf") == 0)
            hits += sd.tensors[i] && fsdp_tensor_data(sd.tensors[i]) == fsdp_tensor_data(a);
    fu_ck(r, hits == 2, "the state dict lists the shared buffer under both names", "%d of 2", hits);
out:
    fsdp_named_list_free(&sd);
    fsdp_tensor_release(x);
    fsdp_unit_destroy(root);
    fsdp_module_release(m), fsdp_module_release(local);
    return rc;
}

/* ---- DYN-MP-08: a forward that sets an attribute -----------------------------------------------
 */

typedef struct mutating {
    int state;
} mutating_t;

static int mutating_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                            fsdp_tensor_t **out) {
    (void)nin, (void)nout;
    mutating_t *mt = fsdp_module_impl(m);
    mt->state = 2; /* self.state = 2 */
    fsdp_tensor_t *y = NULL;
    int rc = fsdp_module_forward1(fsdp_module_child(m, "net"), in[0], &y);
    if (rc == 0) rc = fsdp_scale(y, (double)mt->state, &out[0]);
    fsdp_tensor_release(y);
    return rc;
}

static void mutating_destroy(void *impl) {
    free(impl);
}

static const fsdp_module_ops_t mutating_ops = {"MutatingModel", mutating_forward, mutating_destroy};

static int mutating_create(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_rng_init(fsdp_ctx_rng(ctx), 5, 0);
    mutating_t *mt = calloc(1, sizeof *mt);
    fsdp_module_t *net = NULL;
    int rc = mt ? fsdp_linear_create(ctx, 8, 8, true, &net) : FSDP_ENOMEM;
    if (mt) mt->state = 1;
    if (rc == 0) rc = fsdp_module_create(ctx, &mutating_ops, mt, out);
    if (rc == 0)
        rc = fsdp_module_add_child(*out, "net", net);
    else
        free(mt);
    fsdp_module_release(net);
    return rc;
}

static int mp08_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_res_t *r = fu_res_of(arg, ctx);
    int rc = FSDP_OK;
    fsdp_module_t *local = NULL, *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *x = NULL, *yn = NULL, *y2 = NULL, *y = NULL;
    FU_TRY(out, "models", mutating_create(ctx, &local));
    FU_TRY(out, "models", mutating_create(ctx, &m));
    fsdp_options_t o;
    fu_job_options(arg, &o);
    FU_TRY(out, "wrap", fu_wrap_types(m, &o, (const char *const[]){"Linear", NULL}, &root));
    FU_TRY(out, "input", ramp(ctx, 8, -1.0f, FSDP_MEM_OTHER, &x));
    FU_TRY(out, "net(x)", fsdp_module_forward1(fsdp_module_child(local, "net"), x, &yn));
    FU_TRY(out, "2 net(x)", fsdp_scale(yn, 2.0, &y2));
    int same = 0, roots = 0;
    for (int k = 0; k < 3; k++) {
        rc = fsdp_module_forward1(m, x, &y);
        if (rc == 0 && fu_same_bits(y, y2) == 1) same++;
        roots += fsdp_unit_is_root(root) &&
                 !fsdp_unit_is_root(fsdp_unit_of(fsdp_module_child(m, "net")));
        fsdp_tensor_release(y);
        y = NULL;
        fsdp_tape_clear(ctx);
        if (rc < 0) {
            fu_fatal(r, ctx, "forward", rc);
            goto out;
        }
    }
    fu_ck(r, ((mutating_t *)fsdp_module_impl(m))->state == 2,
          "the attribute set inside forward persists under FSDP", "state %d",
          ((mutating_t *)fsdp_module_impl(m))->state);
    fu_ck(r, same == 3, "the output is 2 * net(x) in each of 3 forwards", "%d of 3", same);
    fu_ck(r, roots == 3, "the root stays the root and the child a child (lazy init once)",
          "%d of 3", roots);
out:
    fsdp_tensor_release(x), fsdp_tensor_release(yn), fsdp_tensor_release(y2);
    fsdp_unit_destroy(root);
    fsdp_module_release(m), fsdp_module_release(local);
    return rc;
}

/* ---- DYN-FK-03: no parameters ------------------------------------------------------------------
 */

static int noparam_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                           fsdp_tensor_t **out) {
    (void)nin, (void)in, (void)nout;
    fsdp_ctx_t *ctx = fsdp_module_ctx(m);
    fsdp_tensor_t *a = NULL, *b = NULL;
    const int64_t n[1] = {3};
    int rc = fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 1, n, FSDP_MEM_OTHER, &a);
    if (rc == 0) rc = fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 1, n, FSDP_MEM_OTHER, &b);
    if (rc == 0) rc = fsdp_tensor_normal_(a, 0, 1);
    if (rc == 0) rc = fsdp_tensor_normal_(b, 0, 1);
    if (rc == 0) rc = fsdp_mul(a, b, &out[0]);
    fsdp_tensor_release(a), fsdp_tensor_release(b);
    return rc;
}

static const fsdp_module_ops_t noparam_ops = {"NoParams", noparam_forward, NULL};

static int fk03_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_res_t *r = fu_res_of(arg, ctx);
    int rc = FSDP_OK;
    fsdp_module_t *local = NULL, *md = NULL, *mf = NULL;
    fsdp_ddp_t *ddp = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *x = NULL, *yl = NULL, *yd = NULL, *yf = NULL;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    FU_TRY(out, "models", fsdp_module_create(ctx, &noparam_ops, NULL, &local));
    FU_TRY(out, "models", fsdp_module_create(ctx, &noparam_ops, NULL, &md));
    FU_TRY(out, "models", fsdp_module_create(ctx, &noparam_ops, NULL, &mf));
    FU_TRY(out, "DDP", fsdp_ddp_create(md, pg, NULL, &ddp));
    fsdp_options_t o;
    fsdp_options_init(&o);
    o.use_orig_params = true;
    FU_TRY(out, "FSDP", fsdp_wrap(mf, &o, &root));
    FU_TRY(out, "input", ramp(ctx, 3, 0, FSDP_MEM_OTHER, &x));
    fsdp_pg_counters_t c0, c1;
    fsdp_pg_get_counters(pg, &c0);
    fsdp_rng_init(fsdp_ctx_rng(ctx), 9, 0);
    FU_TRY(out, "local", fsdp_module_forward1(local, x, &yl));
    fsdp_rng_init(fsdp_ctx_rng(ctx), 9, 0);
    FU_TRY(out, "DDP forward", fsdp_ddp_forward1(ddp, x, &yd));
    fsdp_rng_init(fsdp_ctx_rng(ctx), 9, 0);
    FU_TRY(out, "FSDP forward", fsdp_module_forward1(mf, x, &yf));
    fsdp_pg_get_counters(pg, &c1);
    fsdp_ddp_stats_t st;
    fsdp_ddp_get_stats(ddp, &st);
    fsdp_flat_sizes_t fs;
    fsdp_unit_flat_sizes(root, &fs);
    fu_ck(r, st.num_buckets == 0 && st.num_params == 0 && fs.padded_numel == 0,
          "no bucket and no flat parameter", "%zu buckets, %lld flat elements", st.num_buckets,
          (long long)fs.padded_numel);
    uint64_t bytes = 0;
    for (int k = 0; k < FSDP_COLL_COUNT; k++)
        bytes += c1.bytes[k] - c0.bytes[k];
    fu_ck(r, bytes == 0, "the forwards move no bytes", "%llu bytes", (unsigned long long)bytes);
    fu_ck(r, fu_same_bits(yd, yl) == 1 && fu_same_bits(yf, yl) == 1,
          "randn(3) * randn(3) under DDP and FSDP equals the local output", "differs");
out:
    fsdp_tensor_release(x), fsdp_tensor_release(yl), fsdp_tensor_release(yd);
    fsdp_tensor_release(yf);
    fsdp_ddp_destroy(ddp);
    fsdp_unit_destroy(root);
    fsdp_module_release(local), fsdp_module_release(md), fsdp_module_release(mf);
    return rc;
}

/* ---- DYN-MP-07 / DYN-MP-09: ToyModel forward parity, root only and a unit per Linear ----------
 */

typedef struct toy_job {
    fu_job_t j; /* first */
    bool per_linear;
} toy_job_t;

/* hidden 501: a flat parameter whose size no world size here divides, so shards are padded. */
#define TOY_HIDDEN 501

static int toy_rank(fsdp_ctx_t *ctx, void *arg) {
    toy_job_t *tj = arg;
    fu_res_t *r = fu_res_of(&tj->j, ctx);
    int rc = FSDP_OK;
    fsdp_module_t *local = NULL, *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *x = NULL, *yl = NULL, *y = NULL;
    FU_TRY(out, "models", tm_toy_create(ctx, TM_TOY_IN, TOY_HIDDEN, TM_TOY_OUT, &local));
    FU_TRY(out, "models", tm_toy_create(ctx, TM_TOY_IN, TOY_HIDDEN, TM_TOY_OUT, &m));
    fsdp_options_t o;
    fu_job_options(&tj->j, &o);
    if (tj->per_linear)
        FU_TRY(out, "wrap", fu_wrap_types(m, &o, (const char *const[]){"Linear", NULL}, &root));
    else
        FU_TRY(out, "wrap", fsdp_wrap(m, &o, &root));
    size_t nunits = 0;
    fsdp_unit_t **units = NULL;
    FU_TRY(out, "units", fsdp_units(root, &units, &nunits));
    free(units);
    fu_ck(r, nunits == (tj->per_linear ? 5u : 1u), "the units", "%zu", nunits);
    fsdp_rng_init(fsdp_ctx_rng(ctx), 20, 0);
    FU_TRY(out, "input",
           fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, (const int64_t[]){20, TM_TOY_IN},
                             FSDP_MEM_OTHER, &x));
    FU_TRY(out, "input", fsdp_tensor_normal_(x, 0, 1));
    int same = 0;
    for (int k = 0; k < 2; k++) {
        FU_TRY(out, "local", fsdp_module_forward1(local, x, &yl));
        FU_TRY(out, "FSDP", fsdp_module_forward1(m, x, &y));
        same += fu_same_bits(y, yl) == 1;
        fsdp_tensor_release(yl), fsdp_tensor_release(y);
        yl = y = NULL;
        fsdp_tape_clear(ctx);
    }
    fu_ck(r, same == 2, "the output equals the unwrapped model's bitwise, twice", "%d of 2", same);
out:
    fsdp_tensor_release(x), fsdp_tensor_release(yl), fsdp_tensor_release(y);
    fsdp_unit_destroy(root);
    fsdp_module_release(m), fsdp_module_release(local);
    return rc;
}

static void test_toy(void) {
    static const int worlds[] = {1, 2, 4};
    for (int k = 0; k < 2; k++)
        for (size_t i = 0; i < sizeof worlds / sizeof worlds[0]; i++) {
            toy_job_t tj;
            fu_job_init(&tj.j,
                        k ? "DYN-MP-07 DYN-MP-09 ToyModel, a unit per Linear"
                          : "DYN-MP-07 DYN-MP-09 ToyModel, one root unit",
                        worlds[i], FSDP_FULL_SHARD, true);
            tj.per_linear = k == 1;
            fu_run_job(&tj.j, toy_rank);
        }
}

/* ---- DYN-SP-08: batch sizes that change from call to call -------------------------------------
 */

#define FOO_N 30
#define FOO_D 50
#define FOO_K 70
#define FOO_OUT 64

/* Foo: linear1(flatten(linear0(x^T))) for x (B, N, D): linear0 N -> K on (B, D, N), then
 * (B, D * K) -> FOO_OUT. */
static int foo_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                       fsdp_tensor_t **out) {
    (void)nin, (void)nout;
    fsdp_tensor_t *t = NULL, *a = NULL, *f = NULL;
    int64_t b = fsdp_tensor_shape(in[0])[0];
    int rc = fsdp_transpose(in[0], 1, 2, &t);
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(m, "linear0"), t, &a);
    if (rc == 0) rc = fsdp_reshape(a, 2, (const int64_t[]){b, FOO_D * FOO_K}, &f);
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(m, "linear1"), f, &out[0]);
    fsdp_tensor_release(t), fsdp_tensor_release(a), fsdp_tensor_release(f);
    return rc;
}

static const fsdp_module_ops_t foo_ops = {"Foo", foo_forward, NULL};

static int foo_create(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_rng_init(fsdp_ctx_rng(ctx), 8, 0);
    fsdp_module_t *m = NULL, *l0 = NULL, *l1 = NULL;
    int rc = fsdp_linear_create(ctx, FOO_N, FOO_K, true, &l0);
    if (rc == 0) rc = fsdp_linear_create(ctx, FOO_D * FOO_K, FOO_OUT, true, &l1);
    if (rc == 0) rc = fsdp_module_create(ctx, &foo_ops, NULL, &m);
    if (rc == 0) rc = fsdp_module_add_child(m, "linear0", l0);
    if (rc == 0) rc = fsdp_module_add_child(m, "linear1", l1);
    fsdp_module_release(l0), fsdp_module_release(l1);
    if (rc < 0) {
        fsdp_module_release(m);
        return rc;
    }
    *out = m;
    return FSDP_OK;
}

static int sp08_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_res_t *r = fu_res_of(arg, ctx);
    int rc = FSDP_OK;
    fsdp_module_t *local = NULL, *md = NULL, *mf = NULL;
    fsdp_ddp_t *ddp = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *x = NULL, *yl = NULL, *yd = NULL, *yf = NULL;
    FU_TRY(out, "models", foo_create(ctx, &local));
    FU_TRY(out, "models", foo_create(ctx, &md));
    FU_TRY(out, "models", foo_create(ctx, &mf));
    FU_TRY(out, "DDP", fsdp_ddp_create(md, fsdp_ctx_pg(ctx), NULL, &ddp));
    fsdp_options_t o;
    fu_job_options(arg, &o);
    FU_TRY(out, "wrap", fu_wrap_types(mf, &o, (const char *const[]){"Linear", NULL}, &root));
    static const int64_t sizes[] = {100, 200, 300};
    for (int k = 0; k < 3; k++) {
        fsdp_rng_init(fsdp_ctx_rng(ctx), 30, (uint64_t)k);
        FU_TRY(out, "input",
               fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 3, (const int64_t[]){sizes[k], FOO_N, FOO_D},
                                 FSDP_MEM_OTHER, &x));
        FU_TRY(out, "input", fsdp_tensor_normal_(x, 0, 1));
        FU_TRY(out, "local", fsdp_module_forward1(local, x, &yl));
        FU_TRY(out, "DDP", fsdp_ddp_forward1(ddp, x, &yd));
        FU_TRY(out, "FSDP", fsdp_module_forward1(mf, x, &yf));
        fu_ck(r, fu_same_bits(yd, yl) == 1 && fu_same_bits(yf, yl) == 1,
              sizes[k] == 100   ? "batch 100: DDP and FSDP give the local output bitwise"
              : sizes[k] == 200 ? "batch 200 on the same wrappers: the local output bitwise"
                                : "batch 300 on the same wrappers: the local output bitwise",
              "differs");
        fsdp_tensor_release(x), fsdp_tensor_release(yl), fsdp_tensor_release(yd);
        fsdp_tensor_release(yf);
        x = yl = yd = yf = NULL;
        fsdp_tape_clear(ctx);
    }
out:
    fsdp_tensor_release(x), fsdp_tensor_release(yl), fsdp_tensor_release(yd);
    fsdp_tensor_release(yf);
    fsdp_ddp_destroy(ddp);
    fsdp_unit_destroy(root);
    fsdp_module_release(local), fsdp_module_release(md), fsdp_module_release(mf);
    return rc;
}

int main(void) {
    tap_plan_lazy();
    test_function_api();
    test_sp11();
    fu_run("DYN-SP-18 FSDP", W, FSDP_FULL_SHARD, true, sp18_rank);
    fu_run("DYN-SP-19 FSDP", W, FSDP_FULL_SHARD, true, sp19_rank);
    fu_run("DYN-MP-08 FSDP", W, FSDP_FULL_SHARD, true, mp08_rank);
    fu_run("DYN-FK-03", W, FSDP_FULL_SHARD, true, fk03_rank);
    test_toy();
    fu_run("DYN-SP-08 DDP and FSDP", W, FSDP_FULL_SHARD, true, sp08_rank);
    return tap_done();
}
