/* SPDX-License-Identifier: MIT */
/*
 * t_pg_coll.c: the collective suite on the sim backend (seed behaviour F02, "Collectives that
 * FSDP and the references use").
 *
 * 1. The matrix of coll_matrix.h (shared with the gloo tests): every collective x dtype x
 *    reduce op x world size {1, 2, 3, 4, 8} x counts {0, 1, 1001, 16 MiB}, in place and out of
 *    place, broadcast and reduce with root 0 and root size-1, every element checked against the
 *    closed forms of coll_check.h. One fsdp_sim_run per world size runs the whole matrix on
 *    every rank; the results become one TAP line per (world, collective, dtype), with the first
 *    failing combinations as comments.
 * 2. Determinism: random (non-integer) f32, f16 and bf16 sums with all_reduce and reduce_scatter
 *    over 4 and 8 ranks, repeated under different thread timings, are bitwise identical and
 *    equal to a sequential rank-order reference computed here.
 * 3. Argument checking through the public API: every rejection is FSDP_EINVAL, consumes no
 *    sequence number and says what is wrong.
 * 4. Counters after a known sequence of collectives, and their reset.
 * 5. The checker itself fails a backend that moves no data (the dummy group).
 * 6. Prescaled sums (coll_prescale.h), and ranks that disagree on the prescale.
 *
 * FSDP_TEST_LARGE_MB sets the size of the large case in MiB (default 16, 2 under
 * ThreadSanitizer; 0 leaves it out).
 */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <fsdp.h>

#include "coll_check.h"
#include "coll_matrix.h"
#include "coll_prescale.h"
#include "tap.h"

#define ODD_COUNT CM_ODD_COUNT

static const int worlds[] = {1, 2, 3, 4, 8};
#define NWORLDS ((int)(sizeof worlds / sizeof worlds[0]))

static void sleep_us(long us) {
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---------------------------------------------------------------------------------------- */
/* 1. The matrix (coll_matrix.c) on sim threads */

typedef struct sim_call {
    cm_rank_fn fn;
    void *arg;
} sim_call_t;

static int sim_rank(fsdp_ctx_t *ctx, void *arg) {
    const sim_call_t *c = arg;
    return c->fn(ctx, fsdp_ctx_pg(ctx), c->arg);
}

static int sim_runner(int n, cm_rank_fn fn, void *arg, int *status) {
    sim_call_t c = {fn, arg};
    fsdp_sim_options_t o;
    fsdp_sim_options_init(&o);
    o.world_size = n;
    o.timeout_ms = 120000;
    return fsdp_sim_run(&o, sim_rank, &c, status);
}

/* ---------------------------------------------------------------------------------------- */
/* 2. Determinism */

#define DET_REPS 5
#define DET_AR_COUNT 10007 /* prime: the slices of the ranks differ in size */
#define DET_RS_COUNT 2503

typedef struct det {
    fsdp_coll_kind_t kind;
    fsdp_dtype_t dt;
    size_t count;
    pthread_mutex_t mu;
    int fails;
    char msg[512];
} det_t;

static void det_fail(det_t *d, const char *fmt, ...) FSDP_PRINTF(2, 3);
static void det_fail(det_t *d, const char *fmt, ...) {
    pthread_mutex_lock(&d->mu);
    if (d->fails++ == 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(d->msg, sizeof d->msg, fmt, ap);
        va_end(ap);
    }
    pthread_mutex_unlock(&d->mu);
}

/* Rank q's input: uniform floats in [-1, 1) from the Philox stream (seed, q), converted to dt. */
static void det_input(fsdp_dtype_t dt, int q, size_t len, float *tmp, void *out) {
    fsdp_rng_t rng;
    fsdp_rng_init(&rng, 0x5eedf00dULL, (uint64_t)q);
    fsdp_rng_uniform_f32(&rng, tmp, len, -1.0f, 1.0f);
    fsdp_dtype_convert(out, dt, tmp, FSDP_DTYPE_F32, len);
}

static float det_load(fsdp_dtype_t dt, const void *p, size_t i) {
    if (dt == FSDP_DTYPE_F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return dt == FSDP_DTYPE_F16 ? fsdp_f16_to_f32(h) : fsdp_bf16_to_f32(h);
}

static int det_rank(fsdp_ctx_t *ctx, void *arg) {
    det_t *d = arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    const int r = fsdp_pg_rank(pg), n = fsdp_pg_size(pg);
    const size_t es = fsdp_dtype_size(d->dt), c = d->count;
    const int rs = d->kind == FSDP_COLL_REDUCE_SCATTER;
    const size_t len = rs ? (size_t)n * c : c; /* send elements */
    const size_t off = rs ? (size_t)r * c : 0; /* first element this rank receives */
    float *tmp = malloc(len * sizeof *tmp), *acc = malloc(c * sizeof *acc);
    unsigned char *send = malloc(len * es), *peer = malloc(len * es);
    unsigned char *ref = malloc(c * es), *first = malloc(c * es), *recv = malloc(c * es);
    if (!tmp || !acc || !send || !peer || !ref || !first || !recv) {
        det_fail(d, "rank %d: out of memory", r);
        free(tmp), free(acc), free(send), free(peer), free(ref), free(first), free(recv);
        return FSDP_ENOMEM;
    }
    /* The sequential reference: ((x0 + x1) + x2) + ... in f32, rounded once to dt. */
    for (int q = 0; q < n; q++) {
        det_input(d->dt, q, len, tmp, peer);
        for (size_t i = 0; i < c; i++) {
            float x = det_load(d->dt, peer, off + i);
            acc[i] = q == 0 ? x : acc[i] + x;
        }
    }
    fsdp_dtype_convert(ref, d->dt, acc, FSDP_DTYPE_F32, c);
    det_input(d->dt, r, len, tmp, send);

    for (int it = 0; it < DET_REPS; it++) {
        /* A different rank arrives last in each repetition: sleeps of 0 to ~700 us. */
        sleep_us((long)((r * 7 + it * 3) % n) * 100 + ((r * 131 + it * 257) % 97));
        memset(recv, 0xEE, c * es);
        fsdp_work_t *w = NULL;
        int rc = rs ? fsdp_pg_reduce_scatter(pg, send, recv, c, d->dt, FSDP_REDOP_SUM, &w)
                    : fsdp_pg_all_reduce(pg, send, recv, c, d->dt, FSDP_REDOP_SUM, &w);
        if (rc == FSDP_OK) {
            /* Some more jitter between issuing and waiting. */
            if ((r + it) % 2) sleep_us(50 + 40 * r);
            rc = fsdp_work_wait(w, -1);
            fsdp_work_release(w);
        }
        if (rc != FSDP_OK) {
            det_fail(d, "rank %d, repetition %d: %s: %s", r, it, fsdp_err_name(rc),
                     fsdp_pg_last_error(pg));
            break;
        }
        if (it == 0)
            memcpy(first, recv, c * es);
        else if (memcmp(first, recv, c * es) != 0)
            det_fail(d, "rank %d: repetition %d differs bitwise from repetition 0", r, it);
        if (memcmp(ref, recv, c * es) != 0) {
            size_t i = 0;
            while (memcmp(ref + i * es, recv + i * es, es) == 0)
                i++;
            char got[64], want[64];
            coll_check_format(d->dt, recv + i * es, got, sizeof got);
            coll_check_format(d->dt, ref + i * es, want, sizeof want);
            det_fail(d, "rank %d, repetition %d: recv[%zu] = %s, sequential reference %s", r, it, i,
                     got, want);
        }
    }
    free(tmp), free(acc), free(send), free(peer), free(ref), free(first), free(recv);
    return FSDP_OK;
}

static void test_determinism(void) {
    static const fsdp_dtype_t dts[] = {FSDP_DTYPE_F32, FSDP_DTYPE_BF16, FSDP_DTYPE_F16};
    static const fsdp_coll_kind_t kinds[] = {FSDP_COLL_ALL_REDUCE, FSDP_COLL_REDUCE_SCATTER};
    static const int sizes[] = {4, 8};
    for (int si = 0; si < 2; si++) {
        for (int ki = 0; ki < 2; ki++) {
            for (int di = 0; di < 3; di++) {
                det_t d;
                memset(&d, 0, sizeof d);
                d.kind = kinds[ki];
                d.dt = dts[di];
                d.count = d.kind == FSDP_COLL_ALL_REDUCE ? DET_AR_COUNT : DET_RS_COUNT;
                pthread_mutex_init(&d.mu, NULL);
                fsdp_sim_options_t o;
                fsdp_sim_options_init(&o);
                o.world_size = sizes[si];
                o.timeout_ms = 60000;
                int rc = fsdp_sim_run(&o, det_rank, &d, NULL);
                tap_ok(rc == FSDP_OK && d.fails == 0,
                       "determinism: world %d %s sum of random %s: %d timings bitwise identical "
                       "and equal to the sequential rank-order reference",
                       sizes[si], fsdp_coll_name(d.kind), fsdp_dtype_name(d.dt), DET_REPS);
                if (d.fails) tap_diag("%d failures; the first: %s", d.fails, d.msg);
                if (rc != FSDP_OK) tap_diag("fsdp_sim_run returned %s", fsdp_err_name(rc));
                pthread_mutex_destroy(&d.mu);
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* 3. Argument checking */

/* Rank 0 reports each check as a TAP line; the other ranks run the same calls and count. */
typedef struct vshared {
    pthread_mutex_t mu;
    int checks; /* on ranks other than 0 */
    int fails;
    char msg[512];
} vshared_t;

typedef struct vrank {
    vshared_t *sh;
    fsdp_pg_t *pg;
    int rank;
} vrank_t;

static void vcheck(vrank_t *v, int pass, const char *detail, const char *name) {
    if (v->rank == 0) {
        tap_ok(pass, "%s", name);
        if (!pass) tap_diag("%s", detail);
        return;
    }
    pthread_mutex_lock(&v->sh->mu);
    v->sh->checks++;
    if (!pass && v->sh->fails++ == 0)
        snprintf(v->sh->msg, sizeof v->sh->msg, "rank %d: %s: %s", v->rank, name, detail);
    pthread_mutex_unlock(&v->sh->mu);
}

/* The call returned rc with the group at sequence number seq0 before it. */
static void expect_einval(vrank_t *v, int rc, uint64_t seq0, const char *needle, const char *name) {
    char detail[700];
    const char *err = fsdp_pg_last_error(v->pg);
    uint64_t seq1 = fsdp_pg_seq(v->pg);
    int pass = rc == FSDP_EINVAL && seq1 == seq0 && strstr(err, needle) != NULL;
    char full[300];
    snprintf(detail, sizeof detail,
             "returned %s (want FSDP_EINVAL), seq %llu -> %llu, error \"%.400s\" (want \"%s\")",
             fsdp_err_name(rc), (unsigned long long)seq0, (unsigned long long)seq1, err, needle);
    snprintf(full, sizeof full, "rejected: %s", name);
    vcheck(v, pass, detail, full);
}

#define REJECT(v, needle, name, call)                                                              \
    do {                                                                                           \
        uint64_t seq0_ = fsdp_pg_seq((v)->pg);                                                     \
        expect_einval((v), (call), seq0_, (needle), (name));                                       \
    } while (0)

static int validation_rank(fsdp_ctx_t *ctx, void *arg) {
    vrank_t v = {arg, fsdp_ctx_pg(ctx), fsdp_ctx_rank(ctx)};
    fsdp_pg_t *pg = v.pg;
    const int r = v.rank, n = fsdp_pg_size(pg);
    enum { C = 4 };
    float a[3 * 2 * C], b[3 * 2 * C];
    uint8_t ba[C] = {1, 0, 1, 0}, bb[C];
    const fsdp_dtype_t F = FSDP_DTYPE_F32;
    memset(a, 0, sizeof a);
    fsdp_pg_counters_t c0, c1;
    fsdp_pg_get_counters(pg, &c0);
    uint64_t seq_start = fsdp_pg_seq(pg);

    /* NULL buffers with count > 0. */
    REJECT(&v, "send is NULL", "all_gather with send NULL",
           fsdp_pg_all_gather(pg, NULL, b, C, F, NULL));
    REJECT(&v, "recv is NULL", "all_gather with recv NULL",
           fsdp_pg_all_gather(pg, a, NULL, C, F, NULL));
    REJECT(&v, "send is NULL", "reduce_scatter with send NULL",
           fsdp_pg_reduce_scatter(pg, NULL, b, C, F, FSDP_REDOP_SUM, NULL));
    REJECT(&v, "recv is NULL", "reduce_scatter with recv NULL",
           fsdp_pg_reduce_scatter(pg, a, NULL, C, F, FSDP_REDOP_SUM, NULL));
    REJECT(&v, "send is NULL", "all_reduce with send NULL",
           fsdp_pg_all_reduce(pg, NULL, b, C, F, FSDP_REDOP_SUM, NULL));
    REJECT(&v, "recv is NULL", "all_reduce with recv NULL",
           fsdp_pg_all_reduce(pg, a, NULL, C, F, FSDP_REDOP_SUM, NULL));
    REJECT(&v, "recv is NULL", "broadcast with recv NULL",
           fsdp_pg_broadcast(pg, a, NULL, C, F, 0, NULL));
    /* The root's send is needed on the root only; the others make no call here. */
    if (r == 0)
        REJECT(&v, "send is NULL", "broadcast with the root's send NULL",
               fsdp_pg_broadcast(pg, NULL, b, C, F, 0, NULL));
    REJECT(&v, "send is NULL", "reduce with send NULL",
           fsdp_pg_reduce(pg, NULL, b, C, F, FSDP_REDOP_SUM, 0, NULL));
    if (r == 0)
        REJECT(&v, "recv is NULL", "reduce with the root's recv NULL",
               fsdp_pg_reduce(pg, a, NULL, C, F, FSDP_REDOP_SUM, 0, NULL));
    REJECT(&v, "send is NULL", "all_to_all with send NULL",
           fsdp_pg_all_to_all(pg, NULL, b, C, F, NULL));
    REJECT(&v, "recv is NULL", "all_to_all with recv NULL",
           fsdp_pg_all_to_all(pg, a, NULL, C, F, NULL));

    /* A rejected asynchronous call returns no work. */
    {
        fsdp_work_t *w = (fsdp_work_t *)(void *)&v; /* anything but NULL */
        uint64_t s0 = fsdp_pg_seq(pg);
        int rc = fsdp_pg_all_reduce(pg, NULL, b, C, F, FSDP_REDOP_SUM, &w);
        expect_einval(&v, rc, s0, "NULL", "all_reduce with send NULL and a work pointer");
        vcheck(&v, w == NULL, "*work was not set to NULL", "a rejected call sets *work to NULL");
    }

    /* Bad dtype, bad op, avg on bool. */
    REJECT(&v, "dtype", "all_reduce with dtype FSDP_DTYPE_COUNT",
           fsdp_pg_all_reduce(pg, a, b, C, (fsdp_dtype_t)FSDP_DTYPE_COUNT, FSDP_REDOP_SUM, NULL));
    REJECT(&v, "dtype", "all_gather with dtype -1",
           fsdp_pg_all_gather(pg, a, b, C, (fsdp_dtype_t)-1, NULL));
    REJECT(&v, "dtype", "broadcast with dtype 99",
           fsdp_pg_broadcast(pg, a, b, C, (fsdp_dtype_t)99, 0, NULL));
    REJECT(&v, "op", "all_reduce with op FSDP_REDOP_COUNT",
           fsdp_pg_all_reduce(pg, a, b, C, F, (fsdp_redop_t)FSDP_REDOP_COUNT, NULL));
    REJECT(&v, "op", "reduce_scatter with op -1",
           fsdp_pg_reduce_scatter(pg, a, b, C, F, (fsdp_redop_t)-1, NULL));
    REJECT(&v, "op", "reduce with op 42",
           fsdp_pg_reduce(pg, a, b, C, F, (fsdp_redop_t)42, 0, NULL));
    REJECT(&v, "avg", "all_reduce avg on bool",
           fsdp_pg_all_reduce(pg, ba, bb, C, FSDP_DTYPE_BOOL, FSDP_REDOP_AVG, NULL));
    REJECT(&v, "bool", "reduce_scatter avg on bool (the error names the dtype)",
           fsdp_pg_reduce_scatter(pg, ba, bb, 1, FSDP_DTYPE_BOOL, FSDP_REDOP_AVG, NULL));
    REJECT(&v, "avg", "reduce avg on bool",
           fsdp_pg_reduce(pg, ba, bb, C, FSDP_DTYPE_BOOL, FSDP_REDOP_AVG, 0, NULL));
    REJECT(&v, "avg", "all_reduce avg on bool with count 0",
           fsdp_pg_all_reduce(pg, ba, bb, 0, FSDP_DTYPE_BOOL, FSDP_REDOP_AVG, NULL));

    /* Roots out of range. */
    REJECT(&v, "root", "broadcast with root == size", fsdp_pg_broadcast(pg, a, b, C, F, n, NULL));
    REJECT(&v, "root", "broadcast with root -1", fsdp_pg_broadcast(pg, a, b, C, F, -1, NULL));
    REJECT(&v, "root", "reduce with root == size",
           fsdp_pg_reduce(pg, a, b, C, F, FSDP_REDOP_SUM, n, NULL));
    REJECT(&v, "root", "reduce with root -7",
           fsdp_pg_reduce(pg, a, b, C, F, FSDP_REDOP_SUM, -7, NULL));

    /* Overlaps other than the in-place positions. */
    REJECT(&v, "overlap", "all_gather with send = recv + rank * count + 1",
           fsdp_pg_all_gather(pg, b + (size_t)r * C + 1, b, C, F, NULL));
    if (r > 0)
        REJECT(&v, "overlap", "all_gather with send = recv (rank > 0)",
               fsdp_pg_all_gather(pg, b, b, C, F, NULL));
    REJECT(&v, "overlap", "reduce_scatter with recv = send + rank * count + 1",
           fsdp_pg_reduce_scatter(pg, a, a + (size_t)r * C + 1, C, F, FSDP_REDOP_SUM, NULL));
    REJECT(&v, "overlap", "all_reduce with send = recv + 1",
           fsdp_pg_all_reduce(pg, b + 1, b, C, F, FSDP_REDOP_SUM, NULL));
    REJECT(&v, "overlap", "all_reduce with recv = send + 3",
           fsdp_pg_all_reduce(pg, b, b + 3, C, F, FSDP_REDOP_MAX, NULL));
    /* On non-roots broadcast's send and reduce's recv are not used, so only the root objects. */
    if (r == 0) {
        REJECT(&v, "overlap", "broadcast on the root with send = recv + 1",
               fsdp_pg_broadcast(pg, b + 1, b, C, F, 0, NULL));
        REJECT(&v, "overlap", "reduce on the root with recv = send + 1",
               fsdp_pg_reduce(pg, b, b + 1, C, F, FSDP_REDOP_SUM, 0, NULL));
    }
    REJECT(&v, "overlap", "all_to_all with send == recv", fsdp_pg_all_to_all(pg, b, b, C, F, NULL));
    REJECT(&v, "overlap", "all_to_all with recv = send + 1",
           fsdp_pg_all_to_all(pg, b, b + 1, 2, F, NULL));

    /* A count whose size * count elements overflow size_t. */
    REJECT(&v, "overflow", "all_gather with count SIZE_MAX / 2",
           fsdp_pg_all_gather(pg, a, b, SIZE_MAX / 2, F, NULL));

    /* Nothing above consumed a sequence number or counted; the group still works. */
    fsdp_pg_get_counters(pg, &c1);
    vcheck(&v, memcmp(&c0, &c1, sizeof c0) == 0, "the counters changed",
           "the rejected calls counted nothing");
    for (int i = 0; i < n * C; i++)
        a[i] = (float)(r + 1);
    int rc = fsdp_pg_all_reduce(pg, a, b, C, F, FSDP_REDOP_SUM, NULL);
    char detail[256];
    snprintf(detail, sizeof detail, "rc %s, b[0] %g, seq %llu (start %llu)", fsdp_err_name(rc),
             (double)b[0], (unsigned long long)fsdp_pg_seq(pg), (unsigned long long)seq_start);
    vcheck(
        &v, rc == FSDP_OK && b[0] == (float)(n * (n + 1) / 2) && fsdp_pg_seq(pg) == seq_start + 1,
        detail, "after the rejections a valid all_reduce gets the first sequence number and works");
    return FSDP_OK;
}

static void test_validation(void) {
    vshared_t sh;
    memset(&sh, 0, sizeof sh);
    pthread_mutex_init(&sh.mu, NULL);
    fsdp_sim_options_t o;
    fsdp_sim_options_init(&o);
    o.world_size = 3;
    o.timeout_ms = 30000;
    int rc = fsdp_sim_run(&o, validation_rank, &sh, NULL);
    tap_is_int(rc, FSDP_OK, "validation: every rank returned");
    tap_ok(sh.fails == 0 && sh.checks > 0, "validation: ranks 1 and 2 saw the same (%d checks)",
           sh.checks);
    if (sh.fails) tap_diag("%d failures; the first: %s", sh.fails, sh.msg);
    pthread_mutex_destroy(&sh.mu);
}

/* ---------------------------------------------------------------------------------------- */
/* 4. Counters */

typedef struct cshared {
    pthread_mutex_t mu;
    int fails;
    char msg[512];
} cshared_t;

static void cfail(cshared_t *s, int rank, const char *what, uint64_t got, uint64_t want) {
    pthread_mutex_lock(&s->mu);
    if (s->fails++ == 0)
        snprintf(s->msg, sizeof s->msg, "rank %d: %s = %llu, want %llu", rank, what,
                 (unsigned long long)got, (unsigned long long)want);
    pthread_mutex_unlock(&s->mu);
}

static int counters_rank(fsdp_ctx_t *ctx, void *arg) {
    cshared_t *s = arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    const int r = fsdp_pg_rank(pg), n = fsdp_pg_size(pg);
    const uint64_t N = (uint64_t)n;
    unsigned char src[4096], dst[4096];
    memset(src, 1, sizeof src);
    int rc = FSDP_OK;
    /* Something before the reset, so that the reset has something to clear. */
    rc |= fsdp_pg_all_reduce(pg, src, dst, 3, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    fsdp_pg_reset_counters(pg);
    uint64_t seq0 = fsdp_pg_seq(pg);
    rc |= fsdp_pg_all_gather(pg, src, dst, 5, FSDP_DTYPE_F32, NULL);
    rc |= fsdp_pg_reduce_scatter(pg, src, dst, 7, FSDP_DTYPE_F16, FSDP_REDOP_SUM, NULL);
    rc |= fsdp_pg_reduce_scatter(pg, src, dst, 7, FSDP_DTYPE_BF16, FSDP_REDOP_MAX, NULL);
    rc |= fsdp_pg_all_reduce(pg, src, dst, 10, FSDP_DTYPE_F64, FSDP_REDOP_SUM, NULL);
    rc |= fsdp_pg_all_reduce(pg, src, dst, 0, FSDP_DTYPE_F64, FSDP_REDOP_SUM, NULL);
    rc |= fsdp_pg_broadcast(pg, src, dst, 3, FSDP_DTYPE_I32, n - 1, NULL);
    rc |= fsdp_pg_reduce(pg, src, dst, 9, FSDP_DTYPE_U8, FSDP_REDOP_MAX, 0, NULL);
    rc |= fsdp_pg_all_to_all(pg, src, dst, 2, FSDP_DTYPE_I64, NULL);
    for (int i = 0; i < 3; i++)
        rc |= fsdp_pg_barrier(pg, NULL);
    /* A rejected call is no collective: not counted. */
    if (fsdp_pg_broadcast(pg, src, dst, 3, FSDP_DTYPE_I32, n, NULL) != FSDP_EINVAL)
        cfail(s, r, "broadcast with a bad root was not rejected", 0, 0);
    if (rc != FSDP_OK) cfail(s, r, "a collective failed", (uint64_t)rc, 0);
    fsdp_pg_counters_t got;
    fsdp_pg_get_counters(pg, &got);
    const uint64_t calls[FSDP_COLL_COUNT] = {1, 2, 2, 1, 1, 1, 3};
    const uint64_t bytes[FSDP_COLL_COUNT] = {N * 5 * 4, 2 * N * 7 * 2, 10 * 8, 3 * 4,
                                             9,         N * 2 * 8,     0};
    char what[64];
    for (int k = 0; k < FSDP_COLL_COUNT; k++) {
        const char *name = fsdp_coll_name((fsdp_coll_kind_t)k);
        snprintf(what, sizeof what, "calls[%s]", name);
        if (got.calls[k] != calls[k]) cfail(s, r, what, got.calls[k], calls[k]);
        snprintf(what, sizeof what, "bytes[%s]", name);
        if (got.bytes[k] != bytes[k]) cfail(s, r, what, got.bytes[k], bytes[k]);
    }
    if (fsdp_pg_seq(pg) != seq0 + 11) cfail(s, r, "seq advance", fsdp_pg_seq(pg) - seq0, 11);
    fsdp_pg_reset_counters(pg);
    fsdp_pg_get_counters(pg, &got);
    for (int k = 0; k < FSDP_COLL_COUNT; k++) {
        const char *name = fsdp_coll_name((fsdp_coll_kind_t)k);
        snprintf(what, sizeof what, "calls[%s] after reset", name);
        if (got.calls[k] != 0) cfail(s, r, what, got.calls[k], 0);
        snprintf(what, sizeof what, "bytes[%s] after reset", name);
        if (got.bytes[k] != 0) cfail(s, r, what, got.bytes[k], 0);
    }
    if (fsdp_pg_seq(pg) != seq0 + 11)
        cfail(s, r, "seq advance after a reset", fsdp_pg_seq(pg) - seq0, 11);
    return FSDP_OK;
}

static void test_counters(void) {
    for (int n = 1; n <= 3; n += 2) {
        cshared_t s;
        memset(&s, 0, sizeof s);
        pthread_mutex_init(&s.mu, NULL);
        fsdp_sim_options_t o;
        fsdp_sim_options_init(&o);
        o.world_size = n;
        o.timeout_ms = 30000;
        int rc = fsdp_sim_run(&o, counters_rank, &s, NULL);
        tap_ok(rc == FSDP_OK && s.fails == 0,
               "counters: world %d: calls and bytes per kind after a known sequence (bytes as "
               "nccl-tests count them), zero after a reset, seq unaffected",
               n);
        if (s.fails) tap_diag("%d mismatches; the first: %s", s.fails, s.msg);
        pthread_mutex_destroy(&s.mu);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* 5. The checker itself: it must fail a backend that moves no data. */

static void test_checker_self(void) {
    fsdp_pg_t *noop = NULL, *failing = NULL;
    if (fsdp_pg_create_dummy(NULL, 0, 2, FSDP_DUMMY_NOOP, &noop) != FSDP_OK ||
        fsdp_pg_create_dummy(NULL, 0, 2, FSDP_DUMMY_FAIL, &failing) != FSDP_OK)
        tap_bail("cannot create dummy groups");
    char why[1024];
    for (int ki = 0; ki < CM_NKINDS; ki++) {
        fsdp_coll_kind_t kind = cm_kinds[ki];
        /* Rank 0 is the root of reduce (its recv must change) and not of broadcast. */
        int root = kind == FSDP_COLL_BROADCAST ? 1 : 0;
        int rc = coll_check_run(noop, kind, FSDP_DTYPE_F32, FSDP_REDOP_SUM, ODD_COUNT, 0, root, why,
                                sizeof why);
        tap_ok(rc == COLL_CHECK_MISMATCH && strstr(why, "recv[") != NULL,
               "checker: %s on a no-op backend is caught", fsdp_coll_name(kind));
        if (rc != COLL_CHECK_MISMATCH) tap_diag("rc %d: %s", rc, why);
    }
    int rc = coll_check_run(failing, FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_F32, FSDP_REDOP_SUM, 4, 0, 0,
                            why, sizeof why);
    tap_ok(rc == FSDP_ENOTSUP && strstr(why, "FSDP_ENOTSUP") != NULL,
           "checker: a failing call returns its status and names it");
    coll_check_release();
    fsdp_pg_destroy(noop);
    fsdp_pg_destroy(failing);
}

/* ---------------------------------------------------------------------------------------- */

int main(void) {
    tap_plan_lazy();
    double t0 = now_s();
    test_checker_self();
    test_validation();
    test_counters();
    test_determinism();
    /* 16 MiB; 2 under ThreadSanitizer, where it would take minutes. */
    const cm_options_t mo = {
        .name = "F02 sim", .worlds = worlds, .nworlds = NWORLDS, .large = cm_large_bytes(16, 2)};
    int combos = cm_matrix(sim_runner, &mo);
    static const int pworlds[] = {1, 2, 3, 4};
    cp_suite(sim_runner, "F02 sim", pworlds, 4, cm_large_bytes(6, 0) / 4, 1);
    tap_diag("matrix: %d combinations per rank over worlds 1, 2, 3, 4, 8; large case %zu MiB; "
             "%.1f s in all",
             combos, mo.large >> 20, now_s() - t0);
    return tap_done();
}
