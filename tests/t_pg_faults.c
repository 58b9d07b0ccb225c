/* SPDX-License-Identifier: MIT */
/*
 * t_pg_faults.c: fault injection and mismatch detection on the sim backend.
 *
 * Each fault must end in an error on every rank, within a bounded time, with a message that
 * names what happened; nothing may hang. Runs are bounded by the group timeout: the tests that
 * expect a prompt failure use a long timeout (10 s) and check that the failure came much sooner.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "core/timeutil.h"
#include "tap.h"

#define MAXW 8

typedef struct {
    int rc[MAXW];
    char msg[MAXW][512];
    int64_t ms[MAXW];    /* the first collective's duration on the rank */
    int64_t end_ms[MAXW]; /* when it ended, since the run started (lower bounds use it: a
                           * rank's thread may start its collective late on a loaded machine) */
    int64_t t0;           /* the run's start */
    int after_rc[MAXW];  /* status of a second collective after the failure */
    int exiting_rank;    /* for the exit test */
    int mismatch_kind;   /* which mismatch to provoke */
} result_t;

static int64_t ms_since(int64_t t0) {
    return (fsdp__now_ns() - t0) / 1000000;
}

/* Every rank: one all_reduce, recording its status, message and duration; then another. */
static int one_all_reduce(fsdp_ctx_t *ctx, void *arg) {
    result_t *res = arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    int r = fsdp_pg_rank(pg);
    if (r == res->exiting_rank) return FSDP_OK; /* stops taking part at once */
    float x[16] = {0}, y[16];
    int64_t t0 = fsdp__now_ns();
    res->rc[r] = fsdp_pg_all_reduce(pg, x, y, 16, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    res->ms[r] = ms_since(t0);
    res->end_ms[r] = ms_since(res->t0);
    snprintf(res->msg[r], sizeof res->msg[r], "%s", fsdp_pg_last_error(pg));
    res->after_rc[r] = fsdp_pg_all_reduce(pg, x, y, 16, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    return FSDP_OK;
}

static void run(int n, int64_t timeout_ms, const fsdp_sim_fault_t *faults, size_t nfaults,
                result_t *res, int exiting_rank) {
    memset(res, 0, sizeof *res);
    res->exiting_rank = exiting_rank;
    res->t0 = fsdp__now_ns();
    fsdp_sim_options_t o;
    fsdp_sim_options_init(&o);
    o.world_size = n;
    o.timeout_ms = timeout_ms;
    o.faults = faults;
    o.nfaults = nfaults;
    fsdp_sim_run(&o, one_all_reduce, res, NULL);
}

static void test_delay_within_timeout(void) {
    fsdp_sim_fault_t f[2] = {{.kind = FSDP_SIM_DELAY_BEFORE, .rank = 2, .call = 0, .delay_ms = 200},
                             {.kind = FSDP_SIM_DELAY_AFTER, .rank = 0, .call = 0, .delay_ms = 200}};
    result_t res;
    run(4, 10000, f, 2, &res, -1);
    int ok = 1;
    for (int r = 0; r < 4; r++) ok &= res.rc[r] == FSDP_OK && res.after_rc[r] == FSDP_OK;
    tap_ok(ok, "delays shorter than the timeout only slow the collective down");
    tap_ok(res.end_ms[1] >= 180, "a peer waits for the late rank (ends at %lld ms)",
           (long long)res.end_ms[1]);
    tap_ok(res.end_ms[0] >= 380, "a delay after adds to the delayed rank's completion (%lld ms)",
           (long long)res.end_ms[0]);
}

static void test_delay_past_timeout(void) {
    fsdp_sim_fault_t f = {.kind = FSDP_SIM_DELAY_BEFORE, .rank = 1, .call = 0, .delay_ms = 1200};
    result_t res;
    int64_t t0 = fsdp__now_ns();
    run(4, 300, &f, 1, &res, -1);
    int64_t total = ms_since(t0);
    for (int r = 0; r < 4; r++) {
        if (r == 1) continue;
        tap_is_int(res.rc[r], FSDP_ETIMEDOUT, "rank %d times out waiting for the late rank", r);
        tap_has_str(res.msg[r], "rank(s) 1 did not join", "rank %d's message names rank 1", r);
        tap_ok(res.end_ms[r] >= 250 && res.ms[r] < 1100,
               "rank %d fails at its timeout, not at the end of the delay (%lld ms, ending %lld ms "
               "after the start)",
               r, (long long)res.ms[r], (long long)res.end_ms[r]);
        tap_is_int(res.after_rc[r], FSDP_EREMOTE, "rank %d: the group stays aborted", r);
    }
    tap_is_int(res.rc[1], FSDP_EREMOTE, "the late rank learns that the group was aborted");
    tap_has_str(res.msg[1], "timed out", "and why");
    tap_ok(total < 5000, "the whole run ends in bounded time (%lld ms)", (long long)total);
}

static void test_fail(void) {
    /* Rank 2's first collective fails; the others must fail promptly, not at the 10 s timeout. */
    fsdp_sim_fault_t f = {.kind = FSDP_SIM_FAIL, .rank = 2, .call = 0};
    result_t res;
    run(4, 10000, &f, 1, &res, -1);
    tap_is_int(res.rc[2], FSDP_EBACKEND, "the failing rank gets FSDP_EBACKEND");
    tap_has_str(res.msg[2], "injected fault", "with the reason");
    for (int r = 0; r < 4; r++) {
        if (r == 2) continue;
        tap_is_int(res.rc[r], FSDP_EREMOTE, "rank %d gets FSDP_EREMOTE", r);
        tap_has_str(res.msg[r], "world rank 2", "rank %d's message names rank 2", r);
        tap_ok(res.ms[r] < 2000, "rank %d fails promptly (%lld ms)", r, (long long)res.ms[r]);
    }
    /* The second collective of a failed group fails at once on every rank. */
    int all = 1;
    for (int r = 0; r < 4; r++) all &= res.after_rc[r] == FSDP_EREMOTE;
    tap_ok(all, "every later collective on the group fails with FSDP_EREMOTE");
}

static void test_fail_later_call(void) {
    /* Failing the second call: the first succeeds everywhere, the second fails everywhere. */
    fsdp_sim_fault_t f = {.kind = FSDP_SIM_FAIL, .rank = 0, .call = 1};
    result_t res;
    run(3, 10000, &f, 1, &res, -1);
    int first = 1, second = 1;
    for (int r = 0; r < 3; r++) {
        first &= res.rc[r] == FSDP_OK;
        second &= res.after_rc[r] == (r == 0 ? FSDP_EBACKEND : FSDP_EREMOTE);
    }
    tap_ok(first, "collective #0 succeeds when the fault is on #1");
    tap_ok(second, "collective #1 fails on the faulty rank and on its peers");
}

static void test_exit(void) {
    result_t res;
    run(4, 10000, NULL, 0, &res, 3);
    for (int r = 0; r < 3; r++) {
        tap_is_int(res.rc[r], FSDP_EREMOTE, "rank %d: a peer that exited gives FSDP_EREMOTE", r);
        tap_has_str(res.msg[r], "exited", "rank %d's message says the peer exited", r);
        tap_has_str(res.msg[r], "rank 3", "rank %d's message names rank 3", r);
        tap_ok(res.ms[r] < 2000, "rank %d fails promptly (%lld ms)", r, (long long)res.ms[r]);
    }
}

/* Mismatches: kind, count, dtype, op, root. */
static int mismatch_fn(fsdp_ctx_t *ctx, void *arg) {
    result_t *res = arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    int r = fsdp_pg_rank(pg), n = fsdp_pg_size(pg);
    float x[64] = {0}, y[64 * MAXW];
    int odd = r == n - 1;
    int rc;
    switch (res->mismatch_kind) {
    case 0:
        rc = odd ? fsdp_pg_all_gather(pg, x, y, 8, FSDP_DTYPE_F32, NULL)
                 : fsdp_pg_all_reduce(pg, x, y, 8, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
        break;
    case 1:
        rc = fsdp_pg_all_reduce(pg, x, y, odd ? 9 : 8, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
        break;
    case 2:
        rc = fsdp_pg_all_reduce(pg, x, y, 8, odd ? FSDP_DTYPE_I32 : FSDP_DTYPE_F32,
                                FSDP_REDOP_SUM, NULL);
        break;
    case 3:
        rc = fsdp_pg_all_reduce(pg, x, y, 8, FSDP_DTYPE_F32, odd ? FSDP_REDOP_MAX : FSDP_REDOP_SUM,
                                NULL);
        break;
    default:
        rc = fsdp_pg_broadcast(pg, x, y, 8, FSDP_DTYPE_F32, odd ? 1 : 0, NULL);
        break;
    }
    res->rc[r] = rc;
    snprintf(res->msg[r], sizeof res->msg[r], "%s", fsdp_pg_last_error(pg));
    /* The group is still usable afterwards. */
    float one = 1, sum = 0;
    res->after_rc[r] = fsdp_pg_all_reduce(pg, &one, &sum, 1, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    if (res->after_rc[r] == FSDP_OK && sum != (float)n) res->after_rc[r] = FSDP_EINTERNAL;
    return FSDP_OK;
}

static void test_mismatch(void) {
    static const char *const what[] = {"kind", "count", "dtype", "op", "root"};
    static const char *const needle[] = {"all_gather(f32, count=8)", "count=9", "all_reduce(i32",
                                         "op=max", "root=1"};
    for (int k = 0; k < 5; k++) {
        result_t res;
        memset(&res, 0, sizeof res);
        res.mismatch_kind = k;
        fsdp_sim_options_t o;
        fsdp_sim_options_init(&o);
        o.world_size = 3;
        o.timeout_ms = 10000;
        fsdp_sim_run(&o, mismatch_fn, &res, NULL);
        int all = 1, usable = 1, listed = 1;
        for (int r = 0; r < 3; r++) {
            all &= res.rc[r] == FSDP_EMISMATCH;
            usable &= res.after_rc[r] == FSDP_OK;
            listed &= strstr(res.msg[r], "rank 0:") && strstr(res.msg[r], "rank 2:") &&
                      strstr(res.msg[r], needle[k]);
        }
        tap_ok(all, "%s mismatch: every rank gets FSDP_EMISMATCH", what[k]);
        tap_ok(listed, "%s mismatch: the message lists each rank's call", what[k]);
        if (!listed) tap_diag("message: %s", res.msg[0]);
        tap_ok(usable, "%s mismatch: the group stays usable", what[k]);
    }
}

static int noop(fsdp_ctx_t *ctx, void *arg) {
    (void)ctx;
    (void)arg;
    return FSDP_OK;
}

static int fail_rank1(fsdp_ctx_t *ctx, void *arg) {
    (void)arg;
    return fsdp_ctx_rank(ctx) == 1 ? FSDP_EINTERNAL : FSDP_OK;
}

static void test_run_options(void) {
    fsdp_sim_options_t o;
    fsdp_sim_options_init(&o);
    o.world_size = 0;
    tap_is_int(fsdp_sim_run(&o, noop, NULL, NULL), FSDP_EINVAL, "world size 0 is rejected");
    o.world_size = 2;
    fsdp_sim_fault_t f = {.kind = FSDP_SIM_FAIL, .rank = 5};
    o.faults = &f;
    o.nfaults = 1;
    tap_is_int(fsdp_sim_run(&o, noop, NULL, NULL), FSDP_EINVAL, "a fault on rank 5 of 2 is rejected");
    o.faults = NULL;
    tap_is_int(fsdp_sim_run(&o, noop, NULL, NULL), FSDP_EINVAL, "nfaults without faults rejected");
    o.nfaults = 0;
    tap_is_int(fsdp_sim_run(&o, NULL, NULL, NULL), FSDP_EINVAL, "a NULL function is rejected");
    int st[2] = {1, 1};
    tap_is_int(fsdp_sim_run(&o, fail_rank1, NULL, st), FSDP_EINTERNAL,
               "the run returns the failing rank's status");
    tap_ok(st[0] == FSDP_OK && st[1] == FSDP_EINTERNAL, "and reports each rank's status");
}

int main(void) {
    tap_plan_lazy();
    test_delay_within_timeout();
    test_delay_past_timeout();
    test_fail();
    test_fail_later_call();
    test_exit();
    test_mismatch();
    test_run_options();
    return tap_done();
}
