/* SPDX-License-Identifier: MIT */
/*
 * t_function.c: operations of the caller's with their own backward (fsdp_function_apply in
 * fsdp/autograd.h), and seed 004's custom layer built on one (DYN-SP-11):
 *   - a raw-weight matrix product with a hand-written backward gives the built-in linear's
 *     output and gradients bitwise; refusals (no backward, a NULL input, a forward leaving an
 *     output NULL) are FSDP_EINVAL naming what is wrong; a wrong-shaped gradient fails the
 *     backward naming the input; arg_free runs exactly once, recorded or not;
 *   - DYN-SP-11: the seed's model, Linear, the custom layer, Linear, under DDP and under FSDP
 *     (the custom layer a unit) at W=2: losses and parameters after 3 SGD steps equal the local
 *     run's bitwise. (The seed's bucket arithmetic for this model is in t_ddp_dyn.c.)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp_util.h"
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

int main(void) {
    tap_plan_lazy();
    test_function_api();
    test_sp11();
    return tap_done();
}
