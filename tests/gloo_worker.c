/* SPDX-License-Identifier: MIT */
/*
 * gloo_worker.c: a rank program for the multi-process tests (t_gloo_launch.sh). It makes its
 * rank with fsdp_init_from_env, as a user's program does under fsdprun, srun or mpirun, and runs
 * one of:
 *   allreduce      an all_reduce of rank + 1 over 1000 floats, checked against W(W+1)/2, then
 *                  a barrier; prints "rank R of W: allreduce ok".
 *   train [steps]  FULL_SHARD over Sequential(3 x Linear(16, 16)), SGD, printing each step's
 *                  loss. With FSDP_TEST_DIE_RANK=r and FSDP_TEST_DIE_STEP=s, rank r kills
 *                  itself with SIGKILL at the start of step s (the peer failure of the fault
 *                  tests).
 * Any failure prints "rank R: <what> failed: <status>: <message>" on stderr and exits 1; bad
 * usage exits 2.
 */
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp_util.h"

static int fail(fsdp_ctx_t *ctx, const char *what, int rc) {
    fprintf(stderr, "rank %d: %s failed: %s: %s\n", fsdp_ctx_rank(ctx), what, fsdp_err_name(rc),
            fsdp_ctx_last_error(ctx));
    return 1;
}

static int allreduce(fsdp_ctx_t *ctx) {
    int rank = fsdp_ctx_rank(ctx), w = fsdp_ctx_world_size(ctx);
    float v[1000];
    for (int i = 0; i < 1000; i++)
        v[i] = (float)(rank + 1);
    int rc = fsdp_pg_all_reduce(fsdp_ctx_pg(ctx), v, v, 1000, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    if (rc < 0) return fail(ctx, "all_reduce", rc);
    for (int i = 0; i < 1000; i++)
        if (v[i] != (float)(w * (w + 1) / 2)) {
            fprintf(stderr, "rank %d: element %d is %g, not %d\n", rank, i, v[i], w * (w + 1) / 2);
            return 1;
        }
    if ((rc = fsdp_pg_barrier(fsdp_ctx_pg(ctx), NULL)) < 0) return fail(ctx, "barrier", rc);
    printf("rank %d of %d: allreduce ok (%s)\n", rank, w, fsdp_pg_backend(fsdp_ctx_pg(ctx)));
    return 0;
}

static int train(fsdp_ctx_t *ctx, int steps) {
    int rank = fsdp_ctx_rank(ctx), rc, status = 1;
    const char *dr = getenv("FSDP_TEST_DIE_RANK"), *ds = getenv("FSDP_TEST_DIE_STEP");
    int die_rank = dr ? atoi(dr) : -1, die_step = ds ? atoi(ds) : -1;
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_tensor_t *x = NULL, *y = NULL, *loss = NULL;
    if ((rc = fu_linear_stack(ctx, 3, 16, &m)) < 0) {
        fail(ctx, "building the model", rc);
        goto done;
    }
    fsdp_options_t o;
    fsdp_options_init(&o);
    if ((rc = fsdp_wrap(m, &o, &root)) < 0 ||
        (rc = fu_make_fsdp_sgd(ctx, root, 0.01, 0.9, &opt)) < 0) {
        fail(ctx, "wrapping", rc);
        goto done;
    }
    for (int s = 0; s < steps; s++) {
        if (rank == die_rank && s == die_step) {
            fflush(stdout);
            raise(SIGKILL);
        }
        double v = NAN;
        if ((rc = fu_rand_input(ctx, 100 + (uint64_t)(s * 8 + rank), 4, 16, &x)) < 0 ||
            (rc = fsdp_module_forward1(m, x, &y)) < 0 ||
            (rc = fsdp_mse_loss(x, y, FSDP_REDUCTION_MEAN, &loss)) < 0 ||
            (rc = fsdp_backward(loss, NULL)) < 0 || (rc = fsdp_optim_step(opt)) < 0 ||
            (rc = fsdp_optim_zero_grad(opt, true)) < 0 ||
            (rc = fsdp_tensor_item(loss, 0, &v)) < 0) {
            char what[32];
            snprintf(what, sizeof what, "step %d", s);
            fail(ctx, what, rc);
            goto done;
        }
        printf("rank %d step %d loss %.9g\n", rank, s, v);
        fflush(stdout);
        fsdp_tensor_release(x);
        fsdp_tensor_release(y);
        fsdp_tensor_release(loss);
        x = y = loss = NULL;
    }
    status = 0;
done:
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    fsdp_tensor_release(loss);
    fsdp_tape_clear(ctx);
    fsdp_optim_destroy(opt);
    fsdp_unit_destroy(root);
    fsdp_module_release(m);
    return status;
}

int main(int argc, char **argv) {
    if (argc < 2 || (strcmp(argv[1], "allreduce") != 0 && strcmp(argv[1], "train") != 0)) {
        fprintf(stderr, "usage: gloo_worker allreduce | train [steps]\n");
        return 2;
    }
    char msg[2048];
    fsdp_ctx_t *ctx = NULL;
    int rc = fsdp_init_from_env(NULL, &ctx, msg, sizeof msg);
    if (rc < 0) {
        fprintf(stderr, "init failed: %s: %s\n", fsdp_err_name(rc), msg);
        return 1;
    }
    int status = strcmp(argv[1], "allreduce") == 0 ? allreduce(ctx)
                                                   : train(ctx, argc > 2 ? atoi(argv[2]) : 4);
    fsdp_ctx_destroy(ctx);
    return status;
}
