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

/* One rank process: file store, context, Gloo world group, the job's rank function. */
typedef struct mp_job_run {
    fu_job_t *j; /* the job's copy in shared memory */
    fsdp_sim_fn fn;
} mp_job_run_t;

static int job_rank(int rank, int n, const char *dir, void *arg) {
    mp_job_run_t *run = arg;
    fu_res_t *r = &run->j->r[rank];
    fsdp_ctx_t *ctx = NULL;
    fsdp_store_t *store = NULL;
    fsdp_pg_t *pg = NULL;
    char err[600];
    int rc = fsdp_store_create_file(dir, &store);
    if (rc < 0) {
        fu_ck(r, false, "opening the file store", "%s: %s", fsdp_err_name(rc),
              fsdp_store_open_error());
        goto done;
    }
    rc = mp_gloo_rank(rank, n, run->j->seed, store, &ctx, &pg, err, sizeof err);
    if (rc < 0) {
        fu_ck(r, false, "creating the rank's context and Gloo world group", "%s", err);
        goto done;
    }
    rc = run->fn(ctx, run->j);
done:
    fsdp_ctx_destroy(ctx); /* destroys pg, the world group */
    fsdp_store_destroy(store);
    return rc < 0 ? rc : 0;
}

int mp_run_job(fu_job_t *j, size_t size, fsdp_sim_fn fn) {
    if (!fsdp_gloo_available()) return FSDP_ENOTSUP;
    mp_job_run_t run = {mp_shared_alloc(size), fn};
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
