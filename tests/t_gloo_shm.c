/* SPDX-License-Identifier: MIT */
/*
 * t_gloo_shm.c: the gloo group's shared-memory transport (backends/gloo/gloo_shm.h) on worlds
 * of real processes (gw_run_procs), for seed behaviour F02 ("Collectives that FSDP and the
 * references use") on the gloo backend. t_gloo_coll_mp.c runs the whole F02 suite over it;
 * this file checks what is particular to it:
 *
 * 1. Ranks of one host take it: every rank of a world of 3 and of its sub-groups reports shared
 *    memory; with FSDP_GLOO_SHM=0 every rank reports TCP, and both give the same bits for every
 *    collective on random f32 values (the reductions are in rank order either way).
 *    Every rank makes the same cross-memory attach decision; FSDP_GLOO_CMA=0 keeps the slots,
 *    with the same bits. A barrier's waiters spin only when the ranks have a CPU each (pinned
 *    to one CPU they sleep at once); FSDP_GLOO_SPIN forces the count; the bits stay.
 * 2. Messages of several chunks (a slot is 4 MiB at these world sizes): all-gather,
 *    reduce-scatter, all-reduce, reduce, broadcast and all-to-all of 1.5 to 3.3 million f32 of
 *    exact values at world 3, in place and out of place, every element checked, with peers'
 *    buffers read in place and through the slots.
 * 3. A peer whose process exits while the others wait: FSDP_EREMOTE naming it, well before the
 *    group's timeout; a peer that destroys a sub-group mid-run: FSDP_EREMOTE naming it; a peer
 *    that never joins: FSDP_ETIMEDOUT after the timeout.
 * 4. Nothing is left in /dev/shm by any run.
 */
#define _GNU_SOURCE

#include <dirent.h>
#include <math.h>
#include <sched.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <fsdp.h>

#include "backends/gloo/gloo_shm.h"
#include "cpu_pin.h"
#include "gloo_world.h"
#include "mp_fork.h"
#include "tap.h"

#define NAME "F02 gloo shared memory"

/* Shared with the rank processes. */
typedef struct shared {
    int pid[8];
    int shm[8], sub_shm[8];
    int vote[8];                    /* fsdp__gloo_pg_cma_price's vote, -1 when not priced */
    int spin[8];                    /* fsdp__gloo_pg_spin */
    long long read_ns[8], copy_ns[8]; /* and its prices */
    int rc[8];
    double waited[8];
    char msg[8][400];
    float out[8][6][64]; /* per rank, per collective: the first 64 values */
    int bad[8];          /* elements that differ from the expected value */
} shared_t;

/* Rank 0's process ids of the runs: segments are named after them (fsdp-gloo.<pid>.), and
 * test_leftovers looks for theirs. */
static int creators[16], ncreators;

static void note_creator(int pid) {
    if (pid > 0 && ncreators < 16) creators[ncreators++] = pid;
}

/* ---- 1. who takes it, and the same bits both ways ---- */

static int which_rank(fsdp_ctx_t *ctx, fsdp_pg_t *pg, void *arg) {
    shared_t *sh = arg;
    const int r = fsdp_pg_rank(pg), n = fsdp_pg_size(pg);
    (void)ctx;
    sh->pid[r] = (int)getpid();
    sh->shm[r] = fsdp__gloo_pg_shm(pg);
    int64_t rd = 0, cp = 0;
    sh->vote[r] = fsdp__gloo_pg_cma_price(pg, &rd, &cp);
    sh->spin[r] = fsdp__gloo_pg_spin(pg);
    sh->read_ns[r] = rd;
    sh->copy_ns[r] = cp;
    fsdp_pg_t *sub = NULL;
    int rc = fsdp_pg_split(pg, r < 2 ? 0 : 1, r, &sub);
    if (rc < 0) return rc;
    sh->sub_shm[r] = fsdp__gloo_pg_shm(sub);
    fsdp_pg_destroy(sub);
    /* Every collective on random values; the first 64 results kept for the comparison. */
    enum { C = 5000 };
    float *in = malloc((size_t)n * C * sizeof *in), *out = malloc((size_t)n * C * sizeof *out);
    if (!in || !out) {
        free(in);
        free(out);
        return FSDP_ENOMEM;
    }
    fsdp_rng_t g; /* random values of [-1, 1), its own stream a rank */
    fsdp_rng_init(&g, 1234, (uint64_t)r);
    fsdp_rng_uniform_f32(&g, in, (size_t)n * C, -1.0f, 1.0f);
    for (int k = 0; k < 6 && rc == FSDP_OK; k++) {
        memset(out, 0, (size_t)n * C * sizeof *out);
        switch (k) {
        case 0:
            rc = fsdp_pg_all_reduce(pg, in, out, C, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
            break;
        case 1:
            rc = fsdp_pg_reduce_scatter(pg, in, out, C, FSDP_DTYPE_F32, FSDP_REDOP_AVG, NULL);
            break;
        case 2:
            rc = fsdp_pg_all_gather(pg, in, out, C, FSDP_DTYPE_F32, NULL);
            break;
        case 3:
            rc = fsdp_pg_reduce(pg, in, out, C, FSDP_DTYPE_F32, FSDP_REDOP_MAX, 1, NULL);
            break;
        case 4:
            rc = fsdp_pg_broadcast(pg, in, out, C, FSDP_DTYPE_F32, 2, NULL);
            break;
        default:
            rc = fsdp_pg_all_reduce(pg, in, out, C, FSDP_DTYPE_F32, FSDP_REDOP_PROD, NULL);
            break;
        }
        /* The last values of a result, where a chunking error would show first. */
        memcpy(sh->out[r][k], out + C - 64, sizeof sh->out[r][k]);
    }
    free(in);
    free(out);
    return rc;
}

static void test_which(void) {
    shared_t *a = mp_shared_alloc(sizeof *a), *b = mp_shared_alloc(sizeof *b);
    int rca = gw_run_procs(3, which_rank, a, NULL);
    setenv("FSDP_GLOO_SHM", "0", 1);
    int rcb = gw_run_procs(3, which_rank, b, NULL);
    unsetenv("FSDP_GLOO_SHM");
    tap_ok(rca == FSDP_OK && a->shm[0] >= 1 && a->shm[1] >= 1 && a->shm[2] >= 1 &&
               a->sub_shm[0] >= 1 && a->sub_shm[1] >= 1 && a->sub_shm[2] == 0,
           NAME ": world 3 on one host: every rank's world group and its sub-group of 2 use "
                "shared memory, the sub-group of 1 does not (run %s; %d %d %d, sub %d %d %d)",
           fsdp_err_name(rca), a->shm[0], a->shm[1], a->shm[2], a->sub_shm[0], a->sub_shm[1],
           a->sub_shm[2]);
    tap_ok(rcb == FSDP_OK && b->shm[0] == 0 && b->shm[1] == 0 && b->shm[2] == 0 &&
               b->sub_shm[0] == 0,
           NAME ": FSDP_GLOO_SHM=0: every group on TCP (run %s; %d %d %d)", fsdp_err_name(rcb),
           b->shm[0], b->shm[1], b->shm[2]);
    note_creator(a->pid[0]);
    note_creator(b->pid[0]);
    tap_ok(memcmp(a->out, b->out, sizeof a->out) == 0,
           NAME ": all_reduce sum and product, reduce_scatter avg, all_gather, reduce max, "
                "broadcast of random f32: the same bits through shared memory and TCP");
    /* Cross-memory attach is decided by all ranks together: FSDP_GLOO_CMA=0 keeps the slots,
     * FSDP_GLOO_CMA=1 reads in place wherever the kernel lets it, and unset, each rank prices
     * a read against a copy and the group reads in place only when every rank voted for it.
     * Every way gives the same bits. */
    shared_t *c = mp_shared_alloc(sizeof *c), *d = mp_shared_alloc(sizeof *d);
    setenv("FSDP_GLOO_CMA", "0", 1);
    int rcc = gw_run_procs(3, which_rank, c, NULL);
    setenv("FSDP_GLOO_CMA", "1", 1);
    int rcd = gw_run_procs(3, which_rank, d, NULL);
    unsetenv("FSDP_GLOO_CMA");
    note_creator(c->pid[0]);
    note_creator(d->pid[0]);
    const bool avail = d->shm[0] == 2;
    tap_diag("cross-memory attach %s here; priced: read 4 MiB %.2f %.2f %.2f ms, copy %.2f %.2f "
             "%.2f ms (votes %d %d %d)",
             avail ? "is available" : "is not available", a->read_ns[0] / 1e6,
             a->read_ns[1] / 1e6, a->read_ns[2] / 1e6, a->copy_ns[0] / 1e6, a->copy_ns[1] / 1e6,
             a->copy_ns[2] / 1e6, a->vote[0], a->vote[1], a->vote[2]);
    tap_ok(rcc == FSDP_OK && rcd == FSDP_OK && a->shm[1] == a->shm[0] &&
               a->shm[2] == a->shm[0] && a->sub_shm[1] == a->sub_shm[0] && c->shm[0] == 1 &&
               c->shm[1] == 1 && c->shm[2] == 1 && d->shm[1] == d->shm[0] &&
               d->shm[2] == d->shm[0] && memcmp(a->out, c->out, sizeof a->out) == 0 &&
               memcmp(a->out, d->out, sizeof a->out) == 0,
           NAME ": every rank makes the same cross-memory attach decision (world %d %d %d, sub "
                "%d %d; with FSDP_GLOO_CMA=1 %d %d %d); FSDP_GLOO_CMA=0 keeps the slots on "
                "every rank (%d %d %d, runs %s %s), with the same bits every way",
           a->shm[0], a->shm[1], a->shm[2], a->sub_shm[0], a->sub_shm[1], d->shm[0], d->shm[1],
           d->shm[2], c->shm[0], c->shm[1], c->shm[2], fsdp_err_name(rcc), fsdp_err_name(rcd));
    /* Priced where the kernel allows it, and only then: every rank measured both (a read costs
     * something), voted by the rule (a read under one and a half copies), and the group reads
     * in place exactly when all three voted so. Forced or off, nobody prices. */
    int priced = 1, rule = 1, all = 1;
    for (int q = 0; q < 3; q++) {
        priced &= avail ? a->vote[q] >= 0 && a->read_ns[q] > 0 && a->copy_ns[q] > 0
                        : a->vote[q] == -1;
        rule &= a->vote[q] == (avail ? 2 * a->read_ns[q] < 3 * a->copy_ns[q] : -1);
        all &= a->vote[q] == 1;
        priced &= c->vote[q] == -1 && d->vote[q] == -1;
    }
    tap_ok(priced && rule && a->shm[0] == (avail && all ? 2 : 1),
           NAME ": unset, FSDP_GLOO_CMA prices reading in place on every rank (%s), each rank "
                "votes by the rule (%s), the group reads in place only when every rank voted "
                "for it (%d); set to 0 or 1, nobody prices",
           priced ? "yes" : "no", rule ? "yes" : "no", a->shm[0]);
    /* A barrier's waiters spin only when the group's ranks have a CPU each: on one CPU the
     * three ranks sleep at once, and FSDP_GLOO_SPIN forces a count; the bits never change. */
    int cpus = 0;
    cpu_set_t mask;
    if (sched_getaffinity(0, sizeof mask, &mask) == 0) cpus = CPU_COUNT(&mask);
    bool rule_ok = true;
    for (int q = 0; q < 3; q++)
        rule_ok &= a->spin[q] == (cpus >= 3 ? 4000 : 0) && b->spin[q] == -1;
    tap_ok(cpus > 0 && rule_ok,
           NAME ": unset, FSDP_GLOO_SPIN: with %d CPUs for 3 ranks the waiters %s (%d %d %d); "
                "groups on TCP have none (%d)",
           cpus, cpus >= 3 ? "spin 4000 times" : "sleep at once", a->spin[0], a->spin[1],
           a->spin[2], b->spin[0]);
    shared_t *e = mp_shared_alloc(sizeof *e), *f = mp_shared_alloc(sizeof *f);
    int pinned = cpu_pin_one(&mask);
    int rce = gw_run_procs(3, which_rank, e, NULL);
    if (pinned == 0) cpu_unpin(&mask);
    setenv("FSDP_GLOO_SPIN", "123", 1);
    int rcf = gw_run_procs(3, which_rank, f, NULL);
    unsetenv("FSDP_GLOO_SPIN");
    note_creator(e->pid[0]);
    note_creator(f->pid[0]);
    tap_ok(pinned == 0 && rce == FSDP_OK && rcf == FSDP_OK && e->spin[0] == 0 && e->spin[1] == 0 &&
               e->spin[2] == 0 && f->spin[0] == 123 && f->spin[1] == 123 && f->spin[2] == 123 &&
               memcmp(a->out, e->out, sizeof a->out) == 0 &&
               memcmp(a->out, f->out, sizeof a->out) == 0,
           NAME ": 3 ranks pinned to one CPU sleep at once (%d %d %d), FSDP_GLOO_SPIN=123 spins "
                "123 times (%d %d %d), with the same bits (pinned %d, runs %s %s)",
           e->spin[0], e->spin[1], e->spin[2], f->spin[0], f->spin[1], f->spin[2], pinned,
           fsdp_err_name(rce), fsdp_err_name(rcf));
    mp_shared_free(a);
    mp_shared_free(b);
    mp_shared_free(c);
    mp_shared_free(d);
    mp_shared_free(e);
    mp_shared_free(f);
}

/* ---- 2. several chunks ---- */

/* Exact inputs: small integers, so every order of summation gives the same value. */
static float val(int r, size_t i) {
    return (float)((int)((i * 7 + (size_t)r * 13) % 29) - 14);
}

static int chunks_rank(fsdp_ctx_t *ctx, fsdp_pg_t *pg, void *arg) {
    shared_t *sh = arg;
    const int r = fsdp_pg_rank(pg), n = fsdp_pg_size(pg);
    (void)ctx;
    const size_t C = 3300001; /* 12.6 MB a rank: four chunks of a 4 MiB slot */
    float *in = malloc((size_t)n * C * sizeof *in), *out = malloc((size_t)n * C * sizeof *out);
    if (!in || !out) {
        free(in);
        free(out);
        return FSDP_ENOMEM;
    }
    int rc = FSDP_OK, bad = 0;
    /* all_reduce, out of place then in place */
    for (int inplace = 0; inplace < 2 && rc == FSDP_OK; inplace++) {
        for (size_t i = 0; i < C; i++)
            in[i] = val(r, i);
        float *dst = inplace ? in : out;
        rc = fsdp_pg_all_reduce(pg, in, dst, C, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
        for (size_t i = 0; i < C && rc == FSDP_OK; i++) {
            float want = 0;
            for (int q = 0; q < n; q++)
                want += val(q, i);
            bad += dst[i] != want;
        }
    }
    /* reduce_scatter: segment r summed over the ranks */
    const size_t S = 1500007;
    for (size_t i = 0; i < (size_t)n * S; i++)
        in[i] = val(r, i);
    if (rc == FSDP_OK) rc = fsdp_pg_reduce_scatter(pg, in, out, S, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    for (size_t i = 0; i < S && rc == FSDP_OK; i++) {
        float want = 0;
        for (int q = 0; q < n; q++)
            want += val(q, (size_t)r * S + i);
        bad += out[i] != want;
    }
    /* all_gather in place: rank q's block is val(q, .) */
    for (size_t i = 0; i < S; i++)
        out[(size_t)r * S + i] = val(r, i);
    if (rc == FSDP_OK)
        rc = fsdp_pg_all_gather(pg, out + (size_t)r * S, out, S, FSDP_DTYPE_F32, NULL);
    for (int q = 0; q < n && rc == FSDP_OK; q++)
        for (size_t i = 0; i < S; i++)
            bad += out[(size_t)q * S + i] != val(q, i);
    /* all_gather out of place, into recv at two alignments: through the slots, a rank's own
     * block goes to its slot and its recv in one pass (fsdp__copy_large2), whose destinations
     * are then aligned alike or not */
    for (size_t i = 0; i < S; i++)
        in[i] = val(r, i);
    for (int shift = 0; shift < 2 && rc == FSDP_OK; shift++) {
        float *recv = out + shift;
        memset(out, 0, ((size_t)n * S + 1) * sizeof *out);
        rc = fsdp_pg_all_gather(pg, in, recv, S, FSDP_DTYPE_F32, NULL);
        for (int q = 0; q < n && rc == FSDP_OK; q++)
            for (size_t i = 0; i < S; i++)
                bad += recv[(size_t)q * S + i] != val(q, i);
    }
    /* reduce to rank 1, broadcast from rank 2 */
    for (size_t i = 0; i < C; i++)
        in[i] = val(r, i);
    if (rc == FSDP_OK)
        rc = fsdp_pg_reduce(pg, in, r == 1 ? out : NULL, C, FSDP_DTYPE_F32, FSDP_REDOP_SUM, 1,
                            NULL);
    for (size_t i = 0; i < C && rc == FSDP_OK && r == 1; i++) {
        float want = 0;
        for (int q = 0; q < n; q++)
            want += val(q, i);
        bad += out[i] != want;
    }
    if (rc == FSDP_OK) rc = fsdp_pg_broadcast(pg, in, out, C, FSDP_DTYPE_F32, 2, NULL);
    for (size_t i = 0; i < C && rc == FSDP_OK; i++)
        bad += out[i] != val(2, i);
    /* all_to_all: block q of rank r holds val(r, q S + i); rank r receives block r of each q */
    for (size_t i = 0; i < (size_t)n * S; i++)
        in[i] = val(r, i);
    if (rc == FSDP_OK) rc = fsdp_pg_all_to_all(pg, in, out, S, FSDP_DTYPE_F32, NULL);
    for (int q = 0; q < n && rc == FSDP_OK; q++)
        for (size_t i = 0; i < S; i++)
            bad += out[(size_t)q * S + i] != val(q, (size_t)r * S + i);
    sh->bad[r] = bad;
    sh->shm[r] = fsdp__gloo_pg_shm(pg);
    free(in);
    free(out);
    return rc;
}

static void test_chunks(void) {
    for (int cma = 1; cma >= 0; cma--) {
        shared_t *sh = mp_shared_alloc(sizeof *sh);
        setenv("FSDP_GLOO_CMA", cma ? "1" : "0", 1);
        int rc = gw_run_procs(3, chunks_rank, sh, NULL);
        unsetenv("FSDP_GLOO_CMA");
        note_creator(sh->pid[0]);
        tap_ok(rc == FSDP_OK && sh->shm[0] >= 1 && sh->bad[0] == 0 && sh->bad[1] == 0 &&
                   sh->bad[2] == 0,
               NAME ": world 3, %s, messages of 1.5 and 3.3 million f32 (several 4 MiB chunks): "
                    "all_reduce (in and out of place), reduce_scatter, all_gather (in place, and "
                    "out of place at two alignments), reduce, broadcast, all_to_all give every element (run %s; %d %d %d wrong)",
               sh->shm[0] == 2 ? "peers' buffers read in place" : "through the slots",
               fsdp_err_name(rc), sh->bad[0], sh->bad[1], sh->bad[2]);
        mp_shared_free(sh);
    }
}

/* ---- 3. failures ---- */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_s(double s) {
    struct timespec ts = {(time_t)s, (long)((s - floor(s)) * 1e9)};
    nanosleep(&ts, NULL);
}

/* mode 0: rank 2 exits; 1: rank 1 destroys a sub-group; 2: rank 1 never joins. */
static int fail_mode;

static int fail_rank(fsdp_ctx_t *ctx, fsdp_pg_t *pg, void *arg) {
    shared_t *sh = arg;
    const int r = fsdp_pg_rank(pg);
    float buf[256] = {0};
    (void)ctx;
    sh->pid[r] = (int)getpid();
    if (fail_mode == 0) {
        fsdp_pg_set_timeout(pg, 60000);
        if (r == 2) {
            sleep_s(0.3);
            _exit(0); /* the process ends with the group still open */
        }
        double t0 = now_s();
        sh->rc[r] = fsdp_pg_all_reduce(pg, buf, buf, 256, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
        sh->waited[r] = now_s() - t0;
        snprintf(sh->msg[r], sizeof sh->msg[r], "%s", fsdp_pg_last_error(pg));
        return FSDP_OK;
    }
    fsdp_pg_t *sub = NULL;
    int rc = fsdp_pg_split(pg, 0, r, &sub);
    if (rc < 0) return rc;
    fsdp_pg_set_timeout(sub, fail_mode == 1 ? 60000 : 1000);
    if (r == 1) {
        if (fail_mode == 1) {
            sleep_s(0.3);
            fsdp_pg_destroy(sub);
        } else {
            sleep_s(2.5);
            fsdp_pg_destroy(sub);
        }
        return FSDP_OK;
    }
    double t0 = now_s();
    sh->rc[r] = fsdp_pg_all_reduce(sub, buf, buf, 256, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    sh->waited[r] = now_s() - t0;
    snprintf(sh->msg[r], sizeof sh->msg[r], "%s", fsdp_pg_last_error(sub));
    fsdp_pg_destroy(sub);
    return FSDP_OK;
}

static void test_failures(void) {
    shared_t *sh = mp_shared_alloc(sizeof *sh);
    fail_mode = 0;
    gw_run_procs(3, fail_rank, sh, NULL);
    note_creator(sh->pid[0]);
    int ok = 1;
    for (int r = 0; r < 2; r++)
        ok &= sh->rc[r] == FSDP_EREMOTE && sh->waited[r] < 10 && strstr(sh->msg[r], "rank 2");
    tap_ok(ok, NAME ": rank 2's process exits during an all_reduce: ranks 0 and 1 fail with "
                    "FSDP_EREMOTE naming rank 2 in %.2f and %.2f s (timeout 60 s)",
           sh->waited[0], sh->waited[1]);
    for (int r = 0; r < 2; r++)
        tap_diag("rank %d: %s: %s", r, fsdp_err_name(sh->rc[r]), sh->msg[r]);

    memset(sh, 0, sizeof *sh);
    fail_mode = 1;
    int rc = gw_run_procs(2, fail_rank, sh, NULL);
    note_creator(sh->pid[0]);
    tap_ok(rc == FSDP_OK && sh->rc[0] == FSDP_EREMOTE && sh->waited[0] < 10 &&
               strstr(sh->msg[0], "rank 1"),
           NAME ": rank 1 destroys a sub-group while rank 0 waits in it: FSDP_EREMOTE naming "
                "rank 1 after %.2f s (timeout 60 s)",
           sh->waited[0]);
    tap_diag("rank 0: %s: %s", fsdp_err_name(sh->rc[0]), sh->msg[0]);

    memset(sh, 0, sizeof *sh);
    fail_mode = 2;
    rc = gw_run_procs(2, fail_rank, sh, NULL);
    note_creator(sh->pid[0]);
    tap_ok(rc == FSDP_OK && sh->rc[0] == FSDP_ETIMEDOUT && sh->waited[0] >= 0.9 &&
               sh->waited[0] < 2.4,
           NAME ": rank 1 never joins: rank 0 fails with FSDP_ETIMEDOUT after %.2f s "
                "(timeout 1 s)",
           sh->waited[0]);
    tap_diag("rank 0: %s: %s", fsdp_err_name(sh->rc[0]), sh->msg[0]);
    mp_shared_free(sh);
}

/* ---- 4. nothing left behind ---- */

static void test_leftovers(void) {
    DIR *d = opendir("/dev/shm");
    int left = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        for (int i = 0; i < ncreators; i++) {
            char prefix[40];
            snprintf(prefix, sizeof prefix, "fsdp-gloo.%d.", creators[i]);
            left += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
        }
    if (d) closedir(d);
    tap_ok(d && ncreators >= 4 && left == 0,
           NAME ": no segment of the %d runs' rank 0 left in /dev/shm (%d found)", ncreators,
           left);
}

int main(void) {
    if (!fsdp_gloo_available()) return tap_skip_all("libfsdp was built without Gloo");
    if (access("/dev/shm", W_OK) != 0) return tap_skip_all("no writable /dev/shm");
    unsetenv("FSDP_GLOO_SHM");
    tap_plan_lazy();
    test_which();
    test_chunks();
    test_failures();
    test_leftovers();
    return tap_done();
}
