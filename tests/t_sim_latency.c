/* SPDX-License-Identifier: MIT */
/*
 * t_sim_latency.c: the sim backend's simulated network latency (fsdp_sim_options_t's
 * comm_latency_us).
 *
 * With latency L every collective takes at least L: a blocking call returns no earlier than L
 * after it was made, and since a rank executes its collectives one after the other, k
 * collectives issued back to back complete no earlier than k * L after the first was issued.
 * An asynchronous call does not wait for its collective, so the caller can compute meanwhile.
 * Results are bitwise those of a run without latency. Negative values are refused.
 *
 * Only lower bounds on time are asserted: the machines that run the tests are shared and
 * noisy, so a collective can always take longer than planned; times that should be short are
 * printed as diagnostics, never checked.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <fsdp.h>

#include "core/timeutil.h"
#include "tap.h"

/* The latency of the timing tests: long enough to stand out from scheduling noise in a lower
 * bound, short enough to keep the program fast. */
#define LAT_US 20000
#define LAT_NS ((int64_t)LAT_US * 1000)

/* The library's FSDP_TRY, which lives in a private header. */
#define TRY(rc, label, call)                                                                       \
    do {                                                                                           \
        (rc) = (call);                                                                             \
        if ((rc) < 0) goto label;                                                                  \
    } while (0)

static int run_world(int world, int64_t latency_us, fsdp_sim_fn fn, void *arg, int *st) {
    fsdp_sim_options_t o;
    fsdp_sim_options_init(&o);
    o.world_size = world;
    o.seed = 7;
    o.comm_latency_us = latency_us;
    return fsdp_sim_run(&o, fn, arg, st);
}

/* ---------------------------------------------------------------------------------------- */
/* Options */

static int noop(fsdp_ctx_t *ctx, void *arg) {
    (void)ctx;
    (void)arg;
    return FSDP_OK;
}

/* Runs fsdp_sim_run with stderr sent to a temporary file, whose text lands in buf. */
static int run_capturing_stderr(const fsdp_sim_options_t *o, char *buf, size_t cap) {
    buf[0] = 0;
    FILE *tmp = tmpfile();
    if (!tmp) return fsdp_sim_run(o, noop, NULL, NULL);
    fflush(stderr);
    int saved = dup(STDERR_FILENO);
    dup2(fileno(tmp), STDERR_FILENO);
    int rc = fsdp_sim_run(o, noop, NULL, NULL);
    fflush(stderr);
    dup2(saved, STDERR_FILENO);
    close(saved);
    rewind(tmp);
    size_t n = fread(buf, 1, cap - 1, tmp);
    buf[n] = 0;
    fclose(tmp);
    return rc;
}

static void test_options(void) {
    fsdp_sim_options_t o;
    memset(&o, 0x5a, sizeof o);
    fsdp_sim_options_init(&o);
    tap_is_int(o.comm_latency_us, 0, "fsdp_sim_options_init sets no latency");

    char err[2048];
    bool logged = fsdp_log_level_from_env() >= FSDP_LOG_ERROR;
    o.world_size = 2;
    o.comm_latency_us = -1;
    tap_is_int(run_capturing_stderr(&o, err, sizeof err), FSDP_EINVAL,
               "a negative comm_latency_us is rejected");
    if (logged)
        tap_has_str(err, "comm_latency_us", "the message names the field");
    else
        tap_skip(1, "FSDP_LOG turns error messages off");
    o.comm_latency_us = INT64_MIN;
    tap_is_int(run_capturing_stderr(&o, err, sizeof err), FSDP_EINVAL, "INT64_MIN is rejected");
    o.comm_latency_us = INT64_MAX;
    tap_is_int(run_capturing_stderr(&o, err, sizeof err), FSDP_EINVAL,
               "a latency that overflows in nanoseconds is rejected");
    if (logged)
        tap_has_str(err, "comm_latency_us", "the message names the field");
    else
        tap_skip(1, "FSDP_LOG turns error messages off");
    o.comm_latency_us = 1;
    tap_is_int(fsdp_sim_run(&o, noop, NULL, NULL), FSDP_OK, "1 us is accepted");
}

/* ---------------------------------------------------------------------------------------- */
/* Timing: lower bounds */

typedef struct timing {
    int64_t ns[4][16]; /* [rank][measurement] */
    int bad[4];
} timing_t;

/* Measurement slots of blocking(). */
enum {
    T_ALL_REDUCE = 0,
    T_ALL_GATHER,
    T_REDUCE_SCATTER,
    T_BROADCAST,
    T_REDUCE,
    T_ALL_TO_ALL,
    T_BARRIER,
    T_SUBGROUP,
    T_BLOCKING_COUNT
};
static const char *const t_name[T_BLOCKING_COUNT] = {
    "all_reduce", "all_gather", "reduce_scatter", "broadcast",
    "reduce",     "all_to_all", "barrier",        "all_reduce on a sub-group"};

/* One blocking call of every kind, each timed on its own. */
static int blocking(fsdp_ctx_t *ctx, void *arg) {
    timing_t *t = arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx), *sub = NULL;
    int r = fsdp_pg_rank(pg), n = fsdp_pg_size(pg);
    float send[64], recv[64];
    for (int i = 0; i < 64; i++)
        send[i] = (float)(r * 64 + i);
    int rc = FSDP_OK;
    /* Split before timing: split issues collectives of its own. */
    TRY(rc, out, fsdp_pg_split(pg, 0, r, &sub));
    for (int k = 0; k < T_BLOCKING_COUNT && rc == FSDP_OK; k++) {
        int64_t t0 = fsdp__now_ns();
        switch (k) {
        case T_ALL_REDUCE:
            rc = fsdp_pg_all_reduce(pg, send, recv, 8, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
            break;
        case T_ALL_GATHER:
            rc = fsdp_pg_all_gather(pg, send, recv, 8, FSDP_DTYPE_F32, NULL);
            break;
        case T_REDUCE_SCATTER:
            rc = fsdp_pg_reduce_scatter(pg, send, recv, 8, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
            break;
        case T_BROADCAST:
            rc = fsdp_pg_broadcast(pg, send, recv, 8, FSDP_DTYPE_F32, 0, NULL);
            break;
        case T_REDUCE:
            rc = fsdp_pg_reduce(pg, send, recv, 8, FSDP_DTYPE_F32, FSDP_REDOP_SUM, n - 1, NULL);
            break;
        case T_ALL_TO_ALL:
            rc = fsdp_pg_all_to_all(pg, send, recv, 8, FSDP_DTYPE_F32, NULL);
            break;
        case T_BARRIER:
            rc = fsdp_pg_barrier(pg, NULL);
            break;
        case T_SUBGROUP:
            rc = fsdp_pg_all_reduce(sub, send, recv, 8, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
            break;
        }
        t->ns[r][k] = fsdp__now_ns() - t0;
    }
out:
    fsdp_pg_destroy(sub);
    return rc;
}

static void test_blocking(void) {
    timing_t t;
    memset(&t, 0, sizeof t);
    int st[2] = {1, 1};
    tap_is_int(run_world(2, LAT_US, blocking, &t, st), FSDP_OK,
               "world 2, latency %d us: one blocking call of each kind", LAT_US);
    for (int k = 0; k < T_BLOCKING_COUNT; k++) {
        int64_t lo = t.ns[0][k] < t.ns[1][k] ? t.ns[0][k] : t.ns[1][k];
        tap_ok(lo >= LAT_NS, "a blocking %s takes at least the latency on every rank (%.2f ms)",
               t_name[k], (double)lo / 1e6);
    }
}

/* Two asynchronous all-reduces issued back to back, then waited; then an asynchronous one
 * followed by a blocking one. */
static int back_to_back(fsdp_ctx_t *ctx, void *arg) {
    timing_t *t = arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    int r = fsdp_pg_rank(pg);
    float a[16], b[16], ya[16], yb[16];
    for (int i = 0; i < 16; i++)
        a[i] = (float)(i + r), b[i] = (float)(i * r);
    fsdp_work_t *wa = NULL, *wb = NULL;
    int64_t t0 = fsdp__now_ns();
    int rc = fsdp_pg_all_reduce(pg, a, ya, 16, FSDP_DTYPE_F32, FSDP_REDOP_SUM, &wa);
    if (rc == FSDP_OK) rc = fsdp_pg_all_gather(pg, b, yb, 8, FSDP_DTYPE_F32, &wb);
    t->ns[r][0] = fsdp__now_ns() - t0; /* issuing both */
    if (rc == FSDP_OK) rc = fsdp_work_wait(wb, -1);
    t->ns[r][1] = fsdp__now_ns() - t0; /* the second completed */
    int rc2 = wa ? fsdp_work_wait(wa, -1) : FSDP_OK;
    if (rc == FSDP_OK) rc = rc2;
    fsdp_work_release(wa);
    fsdp_work_release(wb);
    if (rc < 0) return rc;
    for (int i = 0; i < 16; i++)
        if (ya[i] != (float)(2 * i + 1)) t->bad[r] |= 1;

    /* A blocking call queued behind an outstanding asynchronous one waits for both. */
    t0 = fsdp__now_ns();
    rc = fsdp_pg_all_reduce(pg, a, ya, 16, FSDP_DTYPE_F32, FSDP_REDOP_SUM, &wa);
    if (rc == FSDP_OK) rc = fsdp_pg_all_reduce(pg, b, yb, 16, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    t->ns[r][2] = fsdp__now_ns() - t0;
    rc2 = wa ? fsdp_work_wait(wa, -1) : FSDP_OK;
    fsdp_work_release(wa);
    return rc < 0 ? rc : rc2;
}

static void test_back_to_back(void) {
    timing_t t;
    memset(&t, 0, sizeof t);
    tap_is_int(run_world(2, LAT_US, back_to_back, &t, NULL), FSDP_OK,
               "world 2, latency %d us: collectives issued back to back", LAT_US);
    for (int r = 0; r < 2; r++) {
        tap_ok(t.ns[r][1] >= 2 * LAT_NS,
               "rank %d: two asynchronous collectives issued back to back take at least twice "
               "the latency (%.2f ms)",
               r, (double)t.ns[r][1] / 1e6);
        tap_ok(t.ns[r][2] >= 2 * LAT_NS,
               "rank %d: a blocking call behind an outstanding one takes at least twice the "
               "latency (%.2f ms)",
               r, (double)t.ns[r][2] / 1e6);
        tap_diag("rank %d: issuing the two asynchronous calls took %.3f ms (latency %.1f ms)", r,
                 (double)t.ns[r][0] / 1e6, (double)LAT_NS / 1e6);
    }
    tap_ok(t.bad[0] == 0 && t.bad[1] == 0, "their results are right");
}

/* ---------------------------------------------------------------------------------------- */
/* The caller is not blocked by an asynchronous call */

typedef struct handoff {
    _Atomic int issued; /* rank 0's asynchronous call returned */
    int saw_issued;     /* rank 1 saw that before joining */
    int64_t compute_ns; /* rank 0's compute while the collective was outstanding */
    int64_t total_ns;   /* rank 0: issue to completion */
    int done_before;    /* rank 0: the work was not yet complete when its compute ended */
} handoff_t;

/*
 * Rank 0 issues an asynchronous all-reduce; rank 1 joins only after rank 0's call has returned
 * (it waits for a flag, for at most 60 s). If the call blocked until completion, rank 1 would
 * see no flag before its deadline. No upper bound on time is involved.
 */
static int no_block(fsdp_ctx_t *ctx, void *arg) {
    handoff_t *h = arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    int r = fsdp_pg_rank(pg);
    double x[4] = {1, 2, 3, 4}, y[4] = {0};
    fsdp_work_t *w = NULL;
    int rc;
    if (r == 0) {
        int64_t t0 = fsdp__now_ns();
        rc = fsdp_pg_all_reduce(pg, x, y, 4, FSDP_DTYPE_F64, FSDP_REDOP_SUM, &w);
        atomic_store(&h->issued, 1);
        if (rc < 0) return rc;
        /* Compute while the collective is outstanding. */
        int64_t c0 = fsdp__now_ns();
        volatile double acc = 0;
        for (int i = 0; i < 200000; i++)
            acc += sqrt((double)i);
        (void)acc; /* only its volatile writes matter (clang: set but not used) */
        h->compute_ns = fsdp__now_ns() - c0;
        fsdp_work_test(w, &h->done_before);
        rc = fsdp_work_wait(w, -1);
        h->total_ns = fsdp__now_ns() - t0;
        fsdp_work_release(w);
    } else {
        int64_t deadline = fsdp__now_ns() + INT64_C(60) * 1000000000;
        while (!atomic_load(&h->issued) && fsdp__now_ns() < deadline)
            fsdp__sleep_ms(1);
        h->saw_issued = atomic_load(&h->issued);
        rc = fsdp_pg_all_reduce(pg, x, y, 4, FSDP_DTYPE_F64, FSDP_REDOP_SUM, NULL);
    }
    if (rc == FSDP_OK && (y[0] != 2 || y[3] != 8)) rc = FSDP_EINTERNAL;
    return rc;
}

static void test_no_block(void) {
    handoff_t h;
    memset(&h, 0, sizeof h);
    atomic_init(&h.issued, 0);
    tap_is_int(run_world(2, LAT_US, no_block, &h, NULL), FSDP_OK,
               "an asynchronous call with latency completes with the right result");
    tap_ok(h.saw_issued, "the asynchronous call returned before its collective could complete");
    tap_ok(h.total_ns >= LAT_NS, "and the collective still took at least the latency (%.2f ms)",
           (double)h.total_ns / 1e6);
    tap_diag("compute while outstanding %.2f ms, work %s then, issue to completion %.2f ms",
             (double)h.compute_ns / 1e6, h.done_before ? "done" : "not done",
             (double)h.total_ns / 1e6);
}

/* ---------------------------------------------------------------------------------------- */
/* Results are bitwise those without latency */

#define NB 1000 /* elements per rank and collective */
#define NOUT (NB * 3 * 6 + NB * 3 + 16)

typedef struct results {
    float out[3][NOUT];
    int64_t ns[3];
    uint64_t calls[3]; /* collectives each rank issued, over both its groups */
} results_t;

/* Values whose sums depend on the order of the additions. */
static float value(int r, int i, int salt) {
    return (float)(sin(0.37 * i + 1.3 * r + 0.11 * salt) * pow(10.0, (i + r + salt) % 7 - 3));
}

/* A mix of blocking and asynchronous collectives over the world and a sub-group, world 3. */
static int mix(fsdp_ctx_t *ctx, void *arg) {
    results_t *res = arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx), *sub = NULL;
    int r = fsdp_pg_rank(pg), n = fsdp_pg_size(pg);
    float *send = malloc((size_t)n * NB * sizeof *send);
    float *o = res->out[r];
    fsdp_work_t *w[4] = {NULL};
    int rc = FSDP_ENOMEM;
    if (!send) goto out;
    for (int i = 0; i < n * NB; i++)
        send[i] = value(r, i, 0);
    memset(o, 0, sizeof res->out[r]);
    int64_t t0 = fsdp__now_ns();
    float *p = o;
    TRY(rc, out, fsdp_pg_all_reduce(pg, send, p, NB, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL));
    p += NB;
    TRY(rc, out, fsdp_pg_all_reduce(pg, send + NB, p, NB, FSDP_DTYPE_F32, FSDP_REDOP_AVG, &w[0]));
    p += NB;
    TRY(rc, out, fsdp_pg_reduce_scatter(pg, send, p, NB, FSDP_DTYPE_F32, FSDP_REDOP_SUM, &w[1]));
    p += NB;
    TRY(rc, out, fsdp_pg_all_gather(pg, send, p, NB, FSDP_DTYPE_F32, &w[2]));
    p += (size_t)n * NB;
    TRY(rc, out, fsdp_pg_all_to_all(pg, send, p, NB, FSDP_DTYPE_F32, &w[3]));
    p += (size_t)n * NB;
    for (int k = 0; k < 4; k++)
        TRY(rc, out, fsdp_work_wait(w[k], -1));
    TRY(rc, out, fsdp_pg_broadcast(pg, send, p, NB, FSDP_DTYPE_F32, 1, NULL));
    p += NB;
    TRY(rc, out, fsdp_pg_reduce(pg, send, p, NB, FSDP_DTYPE_F32, FSDP_REDOP_MAX, 2, NULL));
    p += NB;
    /* Ranks 0 and 2 form one sub-group, rank 1 another. */
    TRY(rc, out, fsdp_pg_split(pg, r % 2, r, &sub));
    TRY(rc, out,
        fsdp_pg_all_reduce(sub, send + 2 * NB, p, 16, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL));
    TRY(rc, out, fsdp_pg_barrier(pg, NULL));
    res->ns[r] = fsdp__now_ns() - t0;
    res->calls[r] = fsdp_pg_seq(pg) + fsdp_pg_seq(sub);
out:
    for (int k = 0; k < 4; k++)
        fsdp_work_release(w[k]);
    fsdp_pg_destroy(sub);
    free(send);
    return rc;
}

static void test_bitwise(void) {
    results_t *plain = calloc(1, sizeof *plain), *slow = calloc(1, sizeof *slow);
    if (!plain || !slow) {
        tap_ok(0, "out of memory for the results");
        free(plain);
        free(slow);
        return;
    }
    tap_is_int(run_world(3, 0, mix, plain, NULL), FSDP_OK,
               "world 3 without latency: a mix of "
               "blocking and asynchronous collectives");
    tap_is_int(run_world(3, 3000, mix, slow, NULL), FSDP_OK, "the same with a latency of 3000 us");
    for (int r = 0; r < 3; r++)
        tap_is_mem(slow->out[r], plain->out[r], sizeof plain->out[r],
                   "rank %d: results with latency are bitwise those without", r);
    /* A sanity check that the comparison compares something: the world all-reduce is equal on
     * every rank and not all zero. */
    int nonzero = 0;
    for (int i = 0; i < NB; i++)
        nonzero |= plain->out[0][i] != 0.0f;
    tap_ok(nonzero && memcmp(plain->out[0], plain->out[2], NB * sizeof(float)) == 0,
           "the all-reduce results are non-trivial and agree across ranks");
    /* 0 means no added delay; times are printed, not checked (the machine may be busy). */
    uint64_t k = slow->calls[0];
    tap_diag("world 3, %llu collectives on rank 0: %.2f ms without latency, %.2f ms with 3 ms "
             "each",
             (unsigned long long)k, (double)plain->ns[0] / 1e6, (double)slow->ns[0] / 1e6);
    tap_ok(k >= 10 && slow->ns[0] >= (int64_t)k * 3000000,
           "with latency the %llu collectives of rank 0 take at least %llu times it (%.2f ms)",
           (unsigned long long)k, (unsigned long long)k, (double)slow->ns[0] / 1e6);
    free(plain);
    free(slow);
}

int main(void) {
    tap_plan_lazy();
    test_options();
    test_blocking();
    test_back_to_back();
    test_no_block();
    test_bitwise();
    return tap_done();
}
