/* SPDX-License-Identifier: MIT */
/*
 * uop_util.h: what the use_orig_params tests share (t_uop.c, t_uop_access.c): their job, Adam
 * over a list, the loss of a forward, and the comparisons of the parameters with DDP's.
 */
#ifndef FSDP_TEST_UOP_UTIL_H
#define FSDP_TEST_UOP_UTIL_H

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "models/models.h"
#include "tap.h"

#define RTOL FU_F32_RTOL
#define ATOL FU_F32_ATOL
#define ITERS 10

/* A job with the axes of this file. */
typedef struct uop_job {
    fu_job_t j; /* first: fu_res_of and fu_run_job see a fu_job_t */
    int kind;
    bool set_to_none;
    bool optim_before_wrap;
    bool flag; /* per test: summon between forwards (UR), change data (WB), ... */
    int which; /* per test: which parameter or gradient is changed */
} uop_job_t;

/* Adam (lr 1e-2, PyTorch's other defaults) over the tensors of l, one group. */
static inline int adam_over(fsdp_ctx_t *ctx, const fsdp_named_list_t *l, fsdp_optim_t **out) {
    fsdp_adam_options_t ao;
    fsdp_adam_options_init(&ao);
    ao.lr = 1e-2;
    int rc = fsdp_optim_adam_create(ctx, &ao, false, out);
    if (rc == 0)
        rc =
            fsdp_optim_add_group(*out, l->n, l->tensors, (const char *const *)l->names, NULL, NULL);
    return rc;
}

static inline uop_job_t *uop_new(const char *prefix, int world, fsdp_sharding_strategy_t s) {
    uop_job_t *u = calloc(1, sizeof *u);
    if (!u) tap_bail("out of memory");
    fu_job_init(&u->j, prefix, world, s, true);
    return u;
}

static inline void uop_run(uop_job_t *u, fsdp_sim_fn fn) {
    fu_run_job(&u->j, fn);
    free(u);
}

/* loss = sum(model(x)), through DDP when d is given. */
static inline int fwd_loss(fsdp_module_t *m, fsdp_ddp_t *d, fsdp_tensor_t *x, fsdp_tensor_t **out,
                           fsdp_tensor_t **loss) {
    fsdp_tensor_t *y = NULL;
    int rc = d ? fsdp_ddp_forward1(d, x, &y) : fsdp_module_forward1(m, x, &y);
    if (rc == 0) rc = tm_sum_loss(y, loss);
    if (out && rc == 0)
        *out = y;
    else
        fsdp_tensor_release(y);
    return rc;
}

static inline double item(const fsdp_tensor_t *t) {
    double v = NAN;
    if (t) fsdp_tensor_item(t, 0, &v);
    return v;
}

/* Under a summon without writeback, the largest closeness of m's parameters to ref's. */
static inline double summoned_vs(fsdp_unit_t *root, fsdp_module_t *m, const fsdp_module_t *ref,
                                 char *why, size_t len) {
    fu_vals_t a = {0}, b = {0};
    double worst = INFINITY;
    why[0] = 0;
    int rc = fu_summon_nowb(root);
    if (rc < 0) {
        snprintf(why, len, "summon: %s", fsdp_ctx_last_error(fsdp_module_ctx(m)));
        return worst;
    }
    rc = fu_module_values(m, false, false, &a);
    int rc2 = fsdp_summon_end(root);
    if (rc == 0) rc = rc2;
    if (rc == 0) rc = fu_module_values(ref, false, false, &b);
    if (rc == 0 && a.n == b.n) {
        worst = 0;
        for (size_t i = 0; i < a.n; i++) {
            double c = fu_closeness(a.v[i], b.v[i], RTOL, ATOL);
            if (isnan(c)) c = INFINITY;
            if (c > 1.0 && !why[0])
                snprintf(why, len, "element %zu: %.9g, DDP %.9g", i, a.v[i], b.v[i]);
            if (c > worst) worst = c;
        }
    } else {
        snprintf(why, len, "rc %d, %zu values against DDP's %zu", rc, a.n, b.n);
    }
    fu_vals_free(&a);
    fu_vals_free(&b);
    return worst;
}

/* Records the two parameter parity checks: this rank's shards against DDP's full parameters,
 * and (under a summon) the full parameters. */
static inline void ck_params(fu_res_t *r, fsdp_unit_t *root, fsdp_module_t *m, fsdp_module_t *ref,
                             const char *when) {
    char why[800], name[200];
    double c = fu_shards_vs(root, NULL, false, fu_ref_param, ref, RTOL, ATOL, why, sizeof why);
    snprintf(name, sizeof name, "%s: this rank's shards equal DDP's parameters", when);
    fu_ck(r, c <= 1.0, name, "closeness %.3g: %s", c, why);
    c = summoned_vs(root, m, ref, why, sizeof why);
    snprintf(name, sizeof name, "%s: summoned parameters equal DDP's", when);
    fu_ck(r, c <= 1.0, name, "closeness %.3g: %s", c, why);
}

#endif /* FSDP_TEST_UOP_UTIL_H */
