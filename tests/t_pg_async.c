/* SPDX-License-Identifier: MIT */
/*
 * t_pg_async.c: asynchronous works on the sim backend: a call returns before its collective
 * completes, many works can be outstanding, they complete in issue order, wait honours its
 * timeout, test polls, and a released work still completes. The threads are named: a rank
 * runs on "fsdp-rank<r>", its collectives on "fsdp-comm<r>" (what top -H and perf show).
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "core/timeutil.h"
#include "tap.h"

#define NWORKS 64
#define COUNT 1024

static int64_t ms_since(int64_t t0) {
    return (fsdp__now_ns() - t0) / 1000000;
}

/* Rank 1 is delayed by 300 ms before its first collective (fault injection), so rank 0's
 * asynchronous call must return long before the collective can complete. */
static int overlap(fsdp_ctx_t *ctx, void *arg) {
    (void)arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    int r = fsdp_pg_rank(pg);
    float x[4] = {1, 2, 3, 4}, y[4] = {0};
    fsdp_work_t *w = NULL;
    int64_t t0 = fsdp__now_ns();
    int rc = fsdp_pg_all_reduce(pg, x, y, 4, FSDP_DTYPE_F32, FSDP_REDOP_SUM, &w);
    if (r == 0) {
        tap_ok(rc == FSDP_OK && ms_since(t0) < 150,
               "an asynchronous all_reduce returns at once (%lld ms) while a peer is late",
               (long long)ms_since(t0));
        int done = -1;
        tap_is_int(fsdp_work_test(w, &done), FSDP_OK, "test on a running work is OK");
        tap_is_int(done, 0, "and reports it as not done");
        tap_is_int(fsdp_work_wait(w, 20), FSDP_ETIMEDOUT, "a short wait times out");
        tap_has_str(fsdp_pg_last_error(pg), "still outstanding", "the message says so");
        /* Compute overlaps the collective: the work keeps running meanwhile. */
        volatile double acc = 0;
        for (int i = 0; i < 100000; i++) acc += i * 0.5;
        (void)acc; /* only its volatile writes matter (clang: set but not used) */
        tap_is_int(fsdp_work_wait(w, -1), FSDP_OK, "waiting again completes the work");
        tap_ok(ms_since(t0) >= 250, "it completed only after the late peer joined (%lld ms)",
               (long long)ms_since(t0));
        fsdp_work_test(w, &done);
        tap_is_int(done, 1, "test reports done afterwards");
        tap_ok(y[0] == 2 && y[3] == 8, "and the result is there");
        tap_is_str(fsdp_work_error(w), "", "no error text on success");
        tap_is_uint(fsdp_work_seq(w), 0, "the first work has sequence number 0");
    } else {
        rc = fsdp_work_wait(w, -1);
    }
    fsdp_work_release(w);
    return rc;
}

/* NWORKS works outstanding at once, issued back to back, waited in reverse order. */
static int many(fsdp_ctx_t *ctx, void *arg) {
    int *bad = arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    int r = fsdp_pg_rank(pg), n = fsdp_pg_size(pg);
    int32_t *send = malloc(NWORKS * COUNT * sizeof *send);
    int32_t *recv = malloc(NWORKS * COUNT * sizeof *recv);
    fsdp_work_t *w[NWORKS];
    for (int k = 0; k < NWORKS * COUNT; k++) send[k] = r + k;
    int rc = FSDP_OK;
    for (int k = 0; k < NWORKS && rc == FSDP_OK; k++)
        rc = fsdp_pg_all_reduce(pg, send + k * COUNT, recv + k * COUNT, COUNT, FSDP_DTYPE_I32,
                                FSDP_REDOP_SUM, &w[k]);
    if (rc) return rc;
    if (fsdp_pg_seq(pg) != NWORKS) bad[r] |= 1;
    /* Issue order: once the last work is done, every earlier one is done too. */
    rc = fsdp_work_wait(w[NWORKS - 1], -1);
    for (int k = 0; k < NWORKS; k++) {
        int done = 0;
        fsdp_work_test(w[k], &done);
        if (!done) bad[r] |= 2;
        if (fsdp_work_seq(w[k]) != (uint64_t)k) bad[r] |= 4;
    }
    for (int k = NWORKS - 1; k >= 0; k--) {
        if (fsdp_work_wait(w[k], -1) != FSDP_OK) bad[r] |= 8;
        fsdp_work_release(w[k]);
    }
    /* sum over ranks q of (q + k) = n*k + n(n-1)/2 */
    for (int k = 0; k < NWORKS * COUNT; k++)
        if (recv[k] != n * k + n * (n - 1) / 2) {
            bad[r] |= 16;
            break;
        }
    free(send);
    free(recv);
    return rc;
}

/* A work released before completion still completes, and its group waits for it. */
static int released(fsdp_ctx_t *ctx, void *arg) {
    int *bad = arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    int r = fsdp_pg_rank(pg);
    static const int root = 1;
    double *buf = malloc(4096 * sizeof *buf);
    for (int i = 0; i < 4096; i++) buf[i] = r == root ? i * 0.25 : -1;
    fsdp_work_t *w = NULL;
    int rc = fsdp_pg_broadcast(pg, buf, buf, 4096, FSDP_DTYPE_F64, root, &w);
    fsdp_work_release(w);
    /* A synchronous barrier after it: it completes after the broadcast (issue order). */
    if (rc == FSDP_OK) rc = fsdp_pg_barrier(pg, NULL);
    for (int i = 0; i < 4096; i++)
        if (buf[i] != i * 0.25) {
            bad[r] = 1;
            break;
        }
    free(buf);
    return rc;
}

/* Reads a thread's name from its comm file under /proc into buf. */
static int thread_comm(const char *path, char *buf, size_t cap) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int ok = fgets(buf, (int)cap, f) != NULL;
    fclose(f);
    if (!ok) return -1;
    buf[strcspn(buf, "\n")] = 0;
    return 0;
}

/* bad[r]: 1 when rank r's thread is misnamed, 2 when rank 0 finds a worker's name missing. */
static int names(fsdp_ctx_t *ctx, void *arg) {
    int *bad = arg, r = fsdp_ctx_rank(ctx), n = fsdp_ctx_world_size(ctx);
    char want[32], got[64];
    snprintf(want, sizeof want, "fsdp-rank%d", r);
    if (thread_comm("/proc/thread-self/comm", got, sizeof got) != 0 || strcmp(got, want) != 0)
        bad[r] |= 1;
    if (r == 0) {
        int seen = 0;
        DIR *d = opendir("/proc/self/task");
        for (struct dirent *e; d && (e = readdir(d));) {
            char path[300];
            snprintf(path, sizeof path, "/proc/self/task/%s/comm", e->d_name);
            int q = -1;
            if (thread_comm(path, got, sizeof got) == 0 && sscanf(got, "fsdp-comm%d", &q) == 1 &&
                q >= 0 && q < n)
                seen |= 1 << q;
        }
        if (d) closedir(d);
        if (seen != (1 << n) - 1) bad[0] |= 2;
    }
    return fsdp_pg_barrier(fsdp_ctx_pg(ctx), NULL);
}

int main(void) {
    tap_plan_lazy();
    {
        fsdp_sim_options_t o;
        fsdp_sim_options_init(&o);
        o.world_size = 3;
        int bad[3] = {0};
        char self[64];
        if (thread_comm("/proc/thread-self/comm", self, sizeof self) != 0) {
            tap_skip(2, "no /proc/thread-self/comm: thread names are not readable here");
        } else {
            tap_is_int(fsdp_sim_run(&o, names, bad, NULL), FSDP_OK, "thread names: run");
            tap_ok((bad[0] | bad[1] | bad[2]) == 0,
                   "every rank runs on fsdp-rank<r> and every rank's worker is fsdp-comm<r> "
                   "(flags %d %d %d)",
                   bad[0], bad[1], bad[2]);
        }
    }
    fsdp_sim_options_t o;
    fsdp_sim_options_init(&o);
    o.world_size = 2;
    fsdp_sim_fault_t late = {.kind = FSDP_SIM_DELAY_BEFORE, .rank = 1, .call = 0, .delay_ms = 300};
    o.faults = &late;
    o.nfaults = 1;
    tap_is_int(fsdp_sim_run(&o, overlap, NULL, NULL), FSDP_OK, "overlap run succeeds");

    for (int n = 1; n <= 8; n *= 2) {
        int bad[8] = {0};
        fsdp_sim_options_init(&o);
        o.world_size = n;
        tap_is_int(fsdp_sim_run(&o, many, bad, NULL), FSDP_OK, "%d outstanding works, world %d",
                   NWORKS, n);
        int any = 0;
        for (int r = 0; r < n; r++) any |= bad[r];
        tap_is_int(any & 1, 0, "world %d: sequence number counts the works", n);
        tap_is_int(any & 6, 0, "world %d: works complete in issue order with their seq", n);
        tap_is_int(any & 8, 0, "world %d: every work waits OK", n);
        tap_is_int(any & 16, 0, "world %d: every result is right", n);
    }

    int bad[3] = {0};
    fsdp_sim_options_init(&o);
    o.world_size = 3;
    tap_is_int(fsdp_sim_run(&o, released, bad, NULL), FSDP_OK, "released work run");
    tap_is_int(bad[0] | bad[1] | bad[2], 0, "a released work still completes (broadcast data)");
    return tap_done();
}
