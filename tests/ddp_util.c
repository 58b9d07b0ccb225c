/* SPDX-License-Identifier: MIT */
/*
 * ddp_util.c: the helpers t_ddp.c, t_ddp_errors.c and t_ddp_dyn.c share (see ddp_util.h).
 */
#include <math.h>

#include "ddp_util.h"

int input_seeded(fsdp_ctx_t *ctx, uint64_t seed, fsdp_tensor_t **x) {
    static const int64_t shape[2] = {4, 8};
    *x = NULL;
    tm_manual_seed(ctx, seed);
    int rc = fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, shape, FSDP_MEM_ACTIVATIONS, x);
    if (rc == 0) rc = fsdp_tensor_uniform_(*x, 0.0, 1.0);
    return rc;
}

int input_as_rank(fsdp_ctx_t *ctx, int r, fsdp_tensor_t **x) {
    return input_seeded(ctx, 1 + (uint64_t)r, x);
}

/* params_to_host() (grads false) or grads_to_host() (grads true). */
static int to_host(fsdp_module_t *m, bool grads, float *out, size_t cap, size_t *n) {
    fsdp_named_list_t l = {0};
    int rc = fsdp_module_named_params(m, false, &l);
    size_t o = 0;
    for (size_t i = 0; i < l.n && rc == 0; i++) {
        size_t k = (size_t)fsdp_tensor_numel(l.tensors[i]);
        fsdp_tensor_t *t = grads ? fsdp_tensor_grad(l.tensors[i]) : l.tensors[i];
        if (o + k > cap)
            rc = FSDP_EINVAL;
        else if (t)
            rc = fsdp_tensor_to_host(t, out + o, k * sizeof(float));
        else
            for (size_t j = 0; j < k; j++)
                out[o + j] = NAN;
        o += k;
    }
    fsdp_named_list_free(&l);
    if (n) *n = o;
    return rc;
}

int params_to_host(fsdp_module_t *m, float *out, size_t cap, size_t *n) {
    return to_host(m, false, out, cap, n);
}

int grads_to_host(fsdp_module_t *m, float *out, size_t cap, size_t *n) {
    return to_host(m, true, out, cap, n);
}

/* The end of a step: sum loss of the forward's output y (when the forward succeeded, rc 0),
 * backward; releases y. */
static int loss_backward(int rc, fsdp_tensor_t *y, double *loss_out) {
    fsdp_tensor_t *loss = NULL;
    if (rc == 0) rc = tm_sum_loss(y, &loss);
    if (rc == 0 && loss_out) rc = fsdp_tensor_item(loss, 0, loss_out);
    if (rc == 0) rc = fsdp_backward(loss, NULL);
    fsdp_tensor_release(y);
    fsdp_tensor_release(loss);
    return rc;
}

int plain_step(fsdp_module_t *m, fsdp_tensor_t *x, double *loss_out) {
    fsdp_tensor_t *y = NULL;
    int rc = fsdp_module_forward1(m, x, &y);
    return loss_backward(rc, y, loss_out);
}

int ddp_step(fsdp_ddp_t *d, fsdp_tensor_t *x, double *loss_out) {
    fsdp_tensor_t *y = NULL;
    int rc = fsdp_ddp_forward1(d, x, &y);
    return loss_backward(rc, y, loss_out);
}

void rank_release(fsdp_tensor_t *x, fsdp_ddp_t *d, fsdp_module_t *m, fsdp_module_t *m2) {
    fsdp_tensor_release(x);
    fsdp_ddp_destroy(d);
    fsdp_module_release(m);
    fsdp_module_release(m2);
}

uint64_t coll_total(fsdp_pg_t *pg) {
    fsdp_pg_counters_t c;
    uint64_t t = 0;
    fsdp_pg_get_counters(pg, &c);
    for (int k = 0; k < FSDP_COLL_COUNT; k++)
        t += c.calls[k];
    return t;
}

int run_sim(int world, fsdp_sim_fn fn, void *arg, const fsdp_sim_fault_t *faults, size_t nfaults,
            int *status) {
    fsdp_sim_options_t o;
    fsdp_sim_options_init(&o);
    o.world_size = world;
    o.seed = 7;
    o.timeout_ms = 20000;
    o.faults = faults;
    o.nfaults = nfaults;
    return fsdp_sim_run(&o, fn, arg, status);
}

int lin_plus_scale_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                           fsdp_tensor_t **out) {
    fsdp_tensor_t *y = NULL;
    if (nin != 1 || nout != 1) return FSDP_EINVAL;
    int rc = fsdp_module_forward1(fsdp_module_child(m, "lin"), in[0], &y);
    if (rc == 0) rc = fsdp_add(y, fsdp_module_buffer(m, "scale"), &out[0]);
    fsdp_tensor_release(y);
    return rc;
}
