/* SPDX-License-Identifier: MIT */
/*
 * mp_run.c: see mp_run.h. The processes come from mp_fork_ranks().
 */
#include "mp_run.h"

#include <stdio.h>
#include <string.h>

#include "mp_fork.h"
#include "tap.h"

/* How long a whole run may take before its processes are killed. */
#define MP_DEADLINE_S 240

/* One rank process: file store, context, world group (and for NCCL the GPU as the context's
 * device), the job's rank function. */
typedef struct mp_job_run {
    fu_job_t *j; /* the job's copy in shared memory */
    fsdp_sim_fn fn;
    mp_backend_t be;
} mp_job_run_t;

static int job_rank(int rank, int n, const char *dir, void *arg) {
    mp_job_run_t *run = arg;
    fu_res_t *r = &run->j->r[rank];
    fsdp_ctx_t *ctx = NULL;
    fsdp_store_t *store = NULL;
    fsdp_pg_t *pg = NULL;
    fsdp_device_t *dev = NULL;
    char err[600];
    int rc = fsdp_store_create_file(NULL, dir, &store); /* a failure is logged */
    if (rc < 0) {
        fu_ck(r, false, "opening the file store", "%s", fsdp_err_name(rc));
        goto done;
    }
    if (run->be == MP_NCCL)
        rc = mp_nccl_rank(rank, n, run->j->seed, store, &ctx, &dev, err, sizeof err);
    else
        rc = mp_gloo_rank(rank, n, run->j->seed, store, &ctx, &pg, err, sizeof err);
    if (rc < 0) {
        fu_ck(r, false, "creating the rank's context and world group", "%s", err);
        goto done;
    }
    rc = run->fn(ctx, run->j);
done:
    if (ctx && dev) fsdp_ctx_set_device(ctx, NULL);
    fsdp_device_destroy(dev);
    fsdp_ctx_destroy(ctx); /* destroys the world group */
    fsdp_store_destroy(store);
    return rc < 0 ? rc : 0;
}

int mp_run_job(fu_job_t *j, size_t size, fsdp_sim_fn fn) {
    return mp_run_job_on(j, size, fn, MP_GLOO);
}

int mp_run_job_on(fu_job_t *j, size_t size, fsdp_sim_fn fn, mp_backend_t be) {
    if (be == MP_GLOO ? !fsdp_gloo_available() : !fsdp_nccl_available()) return FSDP_ENOTSUP;
    mp_job_run_t run = {mp_shared_alloc(size), fn, be};
    memcpy(run.j, j, size);
    for (int r = 0; r < FU_MAXR; r++)
        run.j->r[r].n = 0;
    int st[FU_MAXR] = {0};
    int rc = mp_fork_ranks(j->world, job_rank, &run, MP_DEADLINE_S, st);
    memcpy(j, run.j, size);
    mp_shared_free(run.j);
    fu_report_job(j, rc, st);
    return rc;
}

/* Counts the CUDA devices by creating them in turn (the child's exit status carries it). */
static int count_rank(int rank, int n, const char *dir, void *arg) {
    (void)rank, (void)n, (void)dir, (void)arg;
    fsdp_ctx_t *ctx = NULL;
    int k = 0;
    if (fsdp_ctx_create(NULL, &ctx) < 0) return 0;
    for (; k < MP_MAX_RANKS; k++) {
        fsdp_device_options_t d;
        fsdp_device_options_init(&d);
        d.ordinal = k;
        fsdp_device_t *dev = NULL;
        if (fsdp_device_create(ctx, FSDP_DEVICE_CUDA, &d, &dev) < 0) break;
        fsdp_device_destroy(dev);
    }
    fsdp_ctx_destroy(ctx);
    return k;
}

int mp_cuda_devices(void) {
    int st[1] = {0};
    int rc = mp_fork_ranks(1, count_rank, NULL, 60, st);
    return rc == 0 && st[0] > 0 ? st[0] : 0;
}
