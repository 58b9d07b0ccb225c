/* SPDX-License-Identifier: MIT */
/*
 * t_autograd.c: the tape: gradients of small graphs, accumulation, no-grad mode, marks and
 * their hooks, final callbacks, leaf hooks, gradients into views of a flat gradient, freed
 * graphs, recompute regions (activation checkpointing, including dropout), and several ranks
 * running their own tapes at once (run under ThreadSanitizer in CI).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "tap.h"

static fsdp_ctx_t *ctx;

static fsdp_tensor_t *vec(fsdp_ctx_t *c, int64_t n, const double *v, bool grad) {
    fsdp_tensor_t *t = NULL;
    fsdp_tensor_from_host(c, FSDP_DTYPE_F64, 1, &n, v, FSDP_MEM_PARAMS, &t);
    if (grad) fsdp_tensor_set_requires_grad(t, true);
    return t;
}

static double grad_at(const fsdp_tensor_t *t, int64_t i) {
    double x = NAN;
    if (fsdp_tensor_grad(t)) fsdp_tensor_item(fsdp_tensor_grad(t), i, &x);
    return x;
}

/* loss = sum(x * x + 3 x) -> grad 2x + 3. */
static void simple(void) {
    double v[3] = {1, -2, 0.5};
    fsdp_tensor_t *x = vec(ctx, 3, v, true), *xx = NULL, *x3 = NULL, *s = NULL, *loss = NULL;
    fsdp_mul(x, x, &xx);
    fsdp_scale(x, 3.0, &x3);
    fsdp_add(xx, x3, &s);
    fsdp_sum(s, 0, NULL, false, &loss);
    tap_ok(fsdp_tensor_requires_grad(loss) && !fsdp_tensor_is_leaf(loss), "loss is recorded");
    tap_ok(fsdp_tape_size(ctx) == 4, "four nodes on the tape (got %zu)", fsdp_tape_size(ctx));
    tap_is_int(fsdp_backward(loss, NULL), 0, "backward");
    tap_ok(grad_at(x, 0) == 5 && grad_at(x, 1) == -1 && grad_at(x, 2) == 4,
           "x used three times gets the summed gradient 2x + 3");
    tap_ok(fsdp_tape_size(ctx) == 0, "backward clears the tape");
    tap_is_int(fsdp_backward(loss, NULL), FSDP_EINVAL, "a second backward is an error");
    tap_has_str(fsdp_ctx_last_error(ctx), "already freed", "saying the graph was freed");
    fsdp_tensor_t *again = NULL;
    tap_is_int(fsdp_add(s, x, &again), FSDP_EINVAL, "a freed graph cannot be extended");
    /* Gradients accumulate over backwards until zeroed. */
    fsdp_tensor_t *l2 = NULL;
    fsdp_sum(x, 0, NULL, false, &l2);
    fsdp_backward(l2, NULL);
    tap_ok(grad_at(x, 0) == 6, "a second backward accumulates into .grad");
    fsdp_tensor_zero_grad(x, false);
    tap_ok(grad_at(x, 0) == 0, "zero_grad keeps a zero gradient");
    fsdp_tensor_release(l2);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(s);
    fsdp_tensor_release(x3);
    fsdp_tensor_release(xx);
    fsdp_tensor_release(x);
}

static void no_grad_and_errors(void) {
    double v[2] = {1, 2};
    fsdp_tensor_t *x = vec(ctx, 2, v, true), *y = NULL, *z = NULL;
    bool was = fsdp_set_grad_enabled(ctx, false);
    tap_ok(was, "grad mode is on by default");
    fsdp_mul(x, x, &y);
    tap_ok(!fsdp_tensor_requires_grad(y) && fsdp_tape_size(ctx) == 0,
           "no-grad mode records nothing");
    fsdp_set_grad_enabled(ctx, was);
    tap_is_int(fsdp_backward(y, NULL), FSDP_EINVAL, "backward of an unrecorded tensor");
    fsdp_mul(x, x, &z);
    tap_is_int(fsdp_backward(z, NULL), FSDP_EINVAL, "a non-scalar needs grad_output");
    tap_has_str(fsdp_ctx_last_error(ctx), "grad_output", "message names grad_output");
    fsdp_tensor_t *go = vec(ctx, 2, (double[]){1, 10}, false);
    tap_is_int(fsdp_backward(z, go), 0, "backward with grad_output");
    tap_ok(grad_at(x, 0) == 2 && grad_at(x, 1) == 40, "vector-Jacobian product");
    fsdp_tensor_release(go);
    fsdp_tensor_release(z);
    fsdp_tensor_release(y);
    fsdp_tensor_release(x);
}

/* Gradients through views land in the base; a leaf's gradient can be a flat-buffer view. */
static void views_and_flat_grads(void) {
    double v[6] = {1, 2, 3, 4, 5, 6};
    int64_t n = 6, shape[2] = {2, 3};
    fsdp_tensor_t *flat = vec(ctx, 6, v, false), *w = NULL, *wt = NULL, *row = NULL, *loss = NULL;
    fsdp_tensor_view_of(flat, 0, 2, shape, &w);
    fsdp_tensor_set_requires_grad(w, true);
    fsdp_tensor_t *fg = NULL, *gview = NULL;
    fsdp_tensor_zeros(ctx, FSDP_DTYPE_F64, 1, &n, FSDP_MEM_GRADS, &fg);
    fsdp_tensor_view_of(fg, 0, 2, shape, &gview);
    fsdp_tensor_set_grad(w, gview);
    fsdp_transpose(w, 0, 1, &wt);
    fsdp_narrow(wt, 0, 1, 1, &row); /* column 1 of w: w[0][1], w[1][1] */
    fsdp_tensor_t *sq = NULL;
    fsdp_mul(row, row, &sq);
    fsdp_sum(sq, 0, NULL, false, &loss);
    tap_is_int(fsdp_backward(loss, NULL), 0, "backward through transpose and narrow");
    double g[6];
    fsdp_tensor_to_host(fg, g, sizeof g);
    tap_ok(g[0] == 0 && g[1] == 4 && g[4] == 10 && g[2] == 0,
           "the gradient accumulated in place into the flat gradient");
    tap_ok(fsdp_tensor_grad(w) == gview, "the leaf keeps the given gradient view");
    fsdp_tensor_release(sq);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(row);
    fsdp_tensor_release(wt);
    fsdp_tensor_release(gview);
    fsdp_tensor_release(fg);
    fsdp_tensor_release(w);
    fsdp_tensor_release(flat);
}

typedef struct {
    char log[256];
    int calls;
} trace_t;

static void trace(trace_t *t, const char *s) {
    strncat(t->log, s, sizeof t->log - strlen(t->log) - 1);
}

static int mark_hook(fsdp_ctx_t *c, void *arg, bool has_grad) {
    (void)c;
    trace_t *t = *(trace_t **)arg;
    trace(t, ((const char **)arg)[1]);
    trace(t, has_grad ? "+ " : "- ");
    return 0;
}

static int final_cb(fsdp_ctx_t *c, void *arg) {
    trace_t *t = arg;
    trace(t, "final ");
    tap_ok(fsdp_in_backward(c), "final callback runs inside the backward");
    return 0;
}

static int queue_final(fsdp_ctx_t *c, void *arg, bool has_grad) {
    (void)has_grad;
    return fsdp_queue_callback(c, final_cb, *(trace_t **)arg);
}

static int leaf_hook(fsdp_tensor_t *leaf, void *arg) {
    (void)leaf;
    trace((trace_t *)arg, "leaf ");
    return 0;
}

static int failing_hook(fsdp_ctx_t *c, void *arg, bool has_grad) {
    (void)arg;
    (void)has_grad;
    (void)c;
    return FSDP_EREMOTE;
}

static void marks(void) {
    trace_t tr = {{0}, 0};
    double v[2] = {1, 2};
    fsdp_tensor_t *x = vec(ctx, 2, v, true), *h = NULL, *y = NULL, *loss = NULL, *unused = NULL;
    void *enter[2] = {&tr, "enter"}, *exit_[2] = {&tr, "exit"}, *side[2] = {&tr, "side"};
    void *fin[1] = {&tr};
    fsdp_tensor_add_grad_hook(x, leaf_hook, &tr);
    fsdp_tape_mark(ctx, "unit.enter", 1, &x, mark_hook, enter, NULL);
    fsdp_mul(x, x, &h);
    fsdp_scale(h, 2.0, &y);
    fsdp_tape_mark(ctx, "unit.exit", 1, &y, mark_hook, exit_, NULL);
    fsdp_scale(x, 5.0, &unused);
    fsdp_tape_mark(ctx, "side", 1, &unused, mark_hook, side, NULL);
    fsdp_tape_mark(ctx, "final", 0, NULL, queue_final, fin, NULL);
    fsdp_sum(y, 0, NULL, false, &loss);
    tap_is_int(fsdp_backward(loss, NULL), 0, "backward with marks");
    tap_is_str(tr.log, "side- exit+ leaf enter+ final ",
               "marks fire in reverse order with has_grad; the leaf hook fires on accumulation; "
               "the final callback runs last");
    tap_ok(grad_at(x, 1) == 8, "gradients unchanged by marks");
    fsdp_tensor_release(loss);
    fsdp_tensor_release(unused);
    fsdp_tensor_release(y);
    fsdp_tensor_release(h);
    fsdp_tensor_release(x);
    tap_is_int(fsdp_queue_callback(ctx, final_cb, &tr), FSDP_EINVAL,
               "callbacks can only be queued during backward");

    /* A failing hook stops the backward with its status, and the tape is still cleared. */
    x = vec(ctx, 2, v, true);
    fsdp_mul(x, x, &h);
    fsdp_tape_mark(ctx, "fails", 0, NULL, failing_hook, NULL, NULL);
    fsdp_sum(h, 0, NULL, false, &loss);
    tap_is_int(fsdp_backward(loss, NULL), FSDP_EREMOTE, "a failing hook's status is returned");
    tap_ok(fsdp_tape_size(ctx) == 0, "and the tape is cleared");
    tap_ok(fsdp_tensor_grad(x) == NULL, "no gradient reached the leaf past the failure");
    fsdp_tensor_release(loss);
    fsdp_tensor_release(h);
    fsdp_tensor_release(x);
}

/* A region: y = dropout(x * w) * w, recomputed at backward. */
typedef struct {
    fsdp_tensor_t *w;
    int runs;
    double p;
} region_t;

static int region_fn(fsdp_ctx_t *c, void *arg, int nin, fsdp_tensor_t *const *in, int nout,
                     fsdp_tensor_t **out) {
    (void)c;
    (void)nin;
    (void)nout;
    region_t *r = arg;
    r->runs++;
    fsdp_tensor_t *a = NULL, *d = NULL;
    int rc = fsdp_mul(in[0], r->w, &a);
    if (rc == 0) rc = fsdp_dropout(a, r->p, true, &d);
    if (rc == 0) rc = fsdp_mul(d, r->w, &out[0]);
    fsdp_tensor_release(a);
    fsdp_tensor_release(d);
    return rc;
}

static void run_region(bool checkpointed, bool input_grad, double p, double *gx, double *gw,
                       double *loss_out) {
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    o.seed = 7;
    fsdp_ctx_t *c = NULL;
    fsdp_ctx_create(&o, &c);
    double xv[64], wv[64];
    for (int i = 0; i < 64; i++) {
        xv[i] = 0.1 * i - 3;
        wv[i] = 1.0 + 0.01 * i;
    }
    region_t r = {vec(c, 64, wv, true), 0, p};
    fsdp_tensor_t *x = vec(c, 64, xv, input_grad), *y = NULL, *loss = NULL;
    if (checkpointed)
        fsdp_checkpoint(c, region_fn, &r, 1, &x, 1, &y);
    else
        region_fn(c, &r, 1, &x, 1, &y);
    fsdp_sum(y, 0, NULL, false, &loss);
    fsdp_tensor_item(loss, 0, loss_out);
    int rc = fsdp_backward(loss, NULL);
    if (rc) tap_diag("backward: %s", fsdp_ctx_last_error(c));
    if (input_grad) fsdp_tensor_to_host(fsdp_tensor_grad(x), gx, 64 * sizeof(double));
    fsdp_tensor_to_host(fsdp_tensor_grad(r.w), gw, 64 * sizeof(double));
    if (checkpointed) tap_is_int(r.runs, 2, "the region ran in forward and again in backward");
    fsdp_tensor_release(loss);
    fsdp_tensor_release(y);
    fsdp_tensor_release(x);
    fsdp_tensor_release(r.w);
    fsdp_ctx_destroy(c);
}

static void checkpoint(void) {
    double gx0[64], gw0[64], gx1[64], gw1[64], l0, l1;
    run_region(false, true, 0.3, gx0, gw0, &l0);
    run_region(true, true, 0.3, gx1, gw1, &l1);
    tap_ok(l0 == l1, "checkpointed forward gives the same loss");
    tap_is_mem(gx1, gx0, sizeof gx0, "same input gradient (dropout mask replayed)");
    tap_is_mem(gw1, gw0, sizeof gw0, "same parameter gradient");
    run_region(false, false, 0.0, gx0, gw0, &l0);
    run_region(true, false, 0.0, gx1, gw1, &l1);
    tap_is_mem(gw1, gw0, sizeof gw0,
               "parameters inside a region get gradients even when no input requires one");
}

/* Several ranks train their own tiny model at once; each must get its own exact gradient. */
static int rank_fn(fsdp_ctx_t *c, void *arg) {
    int *bad = arg;
    int r = fsdp_ctx_rank(c);
    double v[32];
    for (int i = 0; i < 32; i++) v[i] = r + 0.5 * i;
    for (int step = 0; step < 20; step++) {
        fsdp_tensor_t *x = vec(c, 32, v, true), *y = NULL, *loss = NULL;
        fsdp_mul(x, x, &y);
        fsdp_sum(y, 0, NULL, false, &loss);
        fsdp_backward(loss, NULL);
        for (int i = 0; i < 32; i++)
            if (grad_at(x, i) != 2 * v[i]) bad[r] = 1;
        fsdp_tensor_release(loss);
        fsdp_tensor_release(y);
        fsdp_tensor_release(x);
    }
    return 0;
}

static void ranks(void) {
    fsdp_sim_options_t o;
    fsdp_sim_options_init(&o);
    o.world_size = 4;
    int bad[4] = {0};
    tap_is_int(fsdp_sim_run(&o, rank_fn, bad, NULL), 0, "4 ranks run their tapes at once");
    tap_ok(!bad[0] && !bad[1] && !bad[2] && !bad[3], "each rank gets its own gradients");
}

int main(void) {
    tap_plan_lazy();
    fsdp_ctx_create(NULL, &ctx);
    simple();
    no_grad_and_errors();
    views_and_flat_grads();
    marks();
    checkpoint();
    ranks();
    fsdp_ctx_destroy(ctx);
    return tap_done();
}
