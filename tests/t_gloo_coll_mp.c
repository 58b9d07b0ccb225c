/* SPDX-License-Identifier: MIT */
/*
 * t_gloo_coll_mp.c: the foundation's collective suite (seed behaviour F02, "Collectives that
 * FSDP and the references use") on Gloo worlds of real processes.
 *
 * gw_run_procs() forks one process per rank; each makes its own context, opens a file store in
 * a fresh directory the parent made, creates its Gloo world group (the ranks share a host, so
 * its collectives go through the shared-memory transport, gloo_shm.h), runs the rank function
 * and reports through memory shared with the parent (gloo_world.h, mp_fork.h). t_gloo_coll.c
 * runs the same parts of the suite (gloo_coll_suite.c) on threads over TCP.
 *
 * 1. The runner: every rank's status comes back, and the first failure is the run's.
 * 2. Bitwise agreement with the sim backend on random f32/bf16/f16 values at world sizes 2, 3
 *    and 4 (reduce_scatter and all_reduce everywhere, reduce at 2).
 * 3. The F02 matrix at world sizes 2, 3 and 4, the large message included (4 MiB, 1 MiB under
 *    ThreadSanitizer; FSDP_TEST_LARGE_MB decides, 0 leaves it out): as processes it costs what
 *    it costs on threads (about 10 s for the whole program on two cores).
 */
#define _POSIX_C_SOURCE 200809L

#include <stdio.h>
#include <unistd.h>

#include <fsdp.h>

#include "coll_prescale.h"
#include "gloo_coll_suite.h"
#include "gloo_world.h"
#include "mp_fork.h"
#include "tap.h"

#define NAME "F02 gloo processes"

/* 1. A rank's status is what its function returned; rank 1 fails after the group exists. */
static int status_rank(fsdp_ctx_t *ctx, fsdp_pg_t *pg, void *arg) {
    int *ran = arg;
    const int r = fsdp_pg_rank(pg);
    (void)ctx;
    int rc = fsdp_pg_barrier(pg, NULL);
    ran[r] = getpid();
    if (rc != FSDP_OK) return rc;
    return r == 1 ? FSDP_EINVAL : FSDP_OK;
}

static void test_runner(void) {
    int *ran = mp_shared_alloc(GW_MAX_WORLD * sizeof *ran);
    int st[GW_MAX_WORLD] = {0};
    int rc = gw_run_procs(3, status_rank, ran, st);
    tap_ok(rc == FSDP_EINVAL && st[0] == FSDP_OK && st[1] == FSDP_EINVAL && st[2] == FSDP_OK,
           NAME " runner: world 3, rank 1 returns FSDP_EINVAL after a barrier: the run returns "
                "it and every rank's status comes back");
    tap_diag("run %s; ranks %s, %s, %s", fsdp_err_name(rc), fsdp_err_name(st[0]),
             fsdp_err_name(st[1]), fsdp_err_name(st[2]));
    int distinct = ran[0] != ran[1] && ran[1] != ran[2] && ran[0] != ran[2];
    for (int r = 0; r < 3; r++)
        distinct &= ran[r] > 0 && ran[r] != getpid();
    tap_ok(distinct, NAME " runner: the ranks are three processes other than this one, and what "
                          "they write to shared memory comes back");
    mp_shared_free(ran);
}

int main(void) {
    if (!fsdp_gloo_available()) return tap_skip_all("libfsdp was built without Gloo");
    tap_plan_lazy();
    double t0 = gw_now_s();
    test_runner();
    gcs_bitwise(gw_run_procs, NAME);
    size_t large = gcs_large_bytes();
    int combos = gcs_matrix(gw_run_procs, NAME, large);
    static const int pworlds[] = {2, 3, 4};
    cp_suite(gw_run_procs, NAME " shm", pworlds, 3, cm_large_bytes(6, 0) / 4, 0);
    tap_diag("matrix: %d combinations per rank over worlds 2, 3, 4; large case %zu MiB; "
             "%.1f s in all",
             combos, large >> 20, gw_now_s() - t0);
    return tap_done();
}
