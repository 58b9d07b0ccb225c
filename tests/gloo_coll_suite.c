/*
 * gloo_coll_suite.c: the F02 matrix and the bitwise comparison with sim on Gloo worlds of
 * threads or processes (see gloo_coll_suite.h).
 */
#define _POSIX_C_SOURCE 200809L

#include "gloo_coll_suite.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coll_check.h"
#include "mp_fork.h"
#include "tap.h"

#define ODD_COUNT GCS_ODD_COUNT
#define MAX_WORLD GW_MAX_WORLD
#define KEEP_MSGS REC_KEEP

#if defined(__SANITIZE_THREAD__)
#define LARGE_MB_DEFAULT 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define LARGE_MB_DEFAULT 1
#endif
#endif
#ifndef LARGE_MB_DEFAULT
#define LARGE_MB_DEFAULT 4
#endif

size_t gcs_large_bytes(void) {
    const char *e = getenv("FSDP_TEST_LARGE_MB");
    long mb = LARGE_MB_DEFAULT;
    if (e && *e) mb = strtol(e, NULL, 10);
    if (mb < 0) mb = 0;
    return (size_t)mb << 20;
}

/* ---------------------------------------------------------------------------------------- */
/* 1. The F02 matrix */

const fsdp_coll_kind_t gcs_kinds[GCS_NKINDS] = {FSDP_COLL_ALL_GATHER, FSDP_COLL_REDUCE_SCATTER,
                                                FSDP_COLL_ALL_REDUCE, FSDP_COLL_BROADCAST,
                                                FSDP_COLL_REDUCE,     FSDP_COLL_ALL_TO_ALL};

typedef struct cell {
    int combos;
    int fails;
    char msg[KEEP_MSGS][640];
} cell_t;

/* In mp_shared_alloc() memory: the ranks may be processes. */
typedef struct matrix {
    size_t large;
    pthread_mutex_t mu; /* process-shared */
    cell_t cell[FSDP_COLL_COUNT][FSDP_DTYPE_COUNT];
    cell_t barrier;
} matrix_t;

static void record(matrix_t *m, cell_t *c, int rank, int rc, const char *why) {
    pthread_mutex_lock(&m->mu);
    if (rank == 0) c->combos++;
    if (rc != 0) {
        if (c->fails < KEEP_MSGS) snprintf(c->msg[c->fails], sizeof c->msg[0], "%.630s", why);
        c->fails++;
    }
    pthread_mutex_unlock(&m->mu);
}

/* The large message reduces with sum and one other operator, rotating over dtypes and worlds,
 * as in t_pg_coll.c: the operators' semantics are covered by the small counts. */
static int large_op_wanted(fsdp_dtype_t dt, fsdp_redop_t op, int world) {
    static const fsdp_redop_t others[4] = {FSDP_REDOP_AVG, FSDP_REDOP_MIN, FSDP_REDOP_MAX,
                                           FSDP_REDOP_PROD};
    fsdp_redop_t other = others[((int)dt + world) % 4];
    if (dt == FSDP_DTYPE_BOOL && other == FSDP_REDOP_AVG) other = FSDP_REDOP_PROD;
    return op == FSDP_REDOP_SUM || op == other;
}

static int matrix_rank(fsdp_ctx_t *ctx, fsdp_pg_t *pg, void *arg) {
    matrix_t *m = arg;
    const int r = fsdp_pg_rank(pg), n = fsdp_pg_size(pg);
    char why[1024];
    (void)ctx;
    fsdp_pg_set_timeout(pg, 60000);
    for (int ki = 0; ki < GCS_NKINDS; ki++) {
        fsdp_coll_kind_t kind = gcs_kinds[ki];
        int nops = coll_check_has_op(kind) ? FSDP_REDOP_COUNT : 1;
        int nroots = coll_check_has_root(kind) ? 2 : 1;
        for (int dti = 0; dti < FSDP_DTYPE_COUNT; dti++) {
            fsdp_dtype_t dt = (fsdp_dtype_t)dti;
            cell_t *cell = &m->cell[kind][dt];
            size_t counts[4] = {0, 1, ODD_COUNT, 0};
            int ncounts = 3;
            if (m->large) counts[ncounts++] = coll_check_count_for_bytes(kind, dt, n, m->large);
            for (int ci = 0; ci < ncounts; ci++) {
                int large = ci == 3;
                for (int opi = 0; opi < nops; opi++) {
                    fsdp_redop_t op = (fsdp_redop_t)opi;
                    if (large && coll_check_has_op(kind) && !large_op_wanted(dt, op, n)) continue;
                    for (int ip = 0; ip < 2; ip++) {
                        for (int ri = 0; ri < nroots; ri++) {
                            if (large && nroots == 2 && ri != ip) continue;
                            int nnull =
                                coll_check_has_root(kind) && !ip && counts[ci] == ODD_COUNT ? 2 : 1;
                            for (int nu = 0; nu < nnull; nu++) {
                                coll_check_args_t a;
                                memset(&a, 0, sizeof a);
                                a.kind = kind;
                                a.dtype = dt;
                                a.op = op;
                                a.count = counts[ci];
                                a.in_place = ip;
                                a.root = ri == 0 ? 0 : n - 1;
                                a.null_unused = nu;
                                a.async = counts[ci] == 1;
                                int rc = coll_check_run_args(pg, &a, why, sizeof why);
                                record(m, cell, r, rc, why);
                            }
                        }
                    }
                }
            }
        }
    }
    for (int i = 0; i < 3; i++) {
        int rc = coll_check_run(pg, FSDP_COLL_BARRIER, FSDP_DTYPE_U8, FSDP_REDOP_SUM, 0, 0, 0, why,
                                sizeof why);
        record(m, &m->barrier, r, rc, why);
    }
    return FSDP_OK;
}

static void report_cell(const cell_t *c, const char *fmt, ...) FSDP_PRINTF(2, 3);
static void report_cell(const cell_t *c, const char *fmt, ...) {
    char name[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    tap_ok(c->fails == 0 && c->combos > 0, "%s", name);
    if (c->fails) {
        tap_diag("%d failing (combination, rank) pairs; the first:", c->fails);
        for (int i = 0; i < c->fails && i < KEEP_MSGS; i++)
            tap_diag("  %s", c->msg[i]);
    }
}

int gcs_matrix(gw_runner_fn run, const char *name, size_t large) {
    static const int worlds[] = {2, 3, 4};
    int total = 0;
    for (int wi = 0; wi < 3; wi++) {
        int n = worlds[wi];
        matrix_t *m = mp_shared_alloc(sizeof *m);
        m->large = large;
        mp_mutex_init(&m->mu);
        double t0 = gw_now_s();
        int rc = run(n, matrix_rank, m, NULL);
        tap_is_int(rc, FSDP_OK, "%s world %d: the matrix ran on every rank (%.1f s)", name, n,
                   gw_now_s() - t0);
        for (int ki = 0; ki < GCS_NKINDS; ki++) {
            fsdp_coll_kind_t kind = gcs_kinds[ki];
            for (int dt = 0; dt < FSDP_DTYPE_COUNT; dt++) {
                const cell_t *c = &m->cell[kind][dt];
                char counts[64];
                if (large)
                    snprintf(counts, sizeof counts, "0, 1, %d, %zu MiB", ODD_COUNT, large >> 20);
                else
                    snprintf(counts, sizeof counts, "0, 1, %d", ODD_COUNT);
                report_cell(c, "%s world %d: %s %s: %d combinations (%scounts %s%s%s)", name, n,
                            fsdp_coll_name(kind), fsdp_dtype_name((fsdp_dtype_t)dt), c->combos,
                            coll_check_has_op(kind) ? "5 ops x " : "", counts,
                            coll_check_has_root(kind) ? " x roots 0, size-1" : "",
                            kind == FSDP_COLL_ALL_TO_ALL ? "; send == recv rejected"
                                                         : " x in/out of place");
                total += c->combos;
            }
        }
        report_cell(&m->barrier, "%s world %d: barrier", name, n);
        total += m->barrier.combos;
        pthread_mutex_destroy(&m->mu);
        mp_shared_free(m);
    }
    return total;
}

/* ---------------------------------------------------------------------------------------- */
/* Bitwise agreement with sim */

#define BW_RS_COUNT 300007 /* per rank; over 512 KiB for f32, so several segments */
#define BW_AR_COUNT 100003
#define BW_MAX_CASES 16

typedef struct bw_case {
    fsdp_coll_kind_t kind;
    fsdp_dtype_t dt;
    fsdp_redop_t op;
    size_t count;
} bw_case_t;

/*
 * One world's cases, in mp_shared_alloc() memory. The sim ranks (threads of this process) run
 * first and leave their results in sim[][]; the gloo ranks run the same cases and compare their
 * results with those (a rank process reads them as they were at the fork). Every rank writes
 * only its own slots, so nothing here needs a lock.
 */
typedef struct bw {
    int ncases;
    bw_case_t c[BW_MAX_CASES];
    unsigned char *sim[BW_MAX_CASES][MAX_WORLD]; /* each sim rank's result (malloc'ed) */
    long diff[BW_MAX_CASES][MAX_WORLD]; /* elements whose bits differ from sim's; -1: not run */
    char msg[MAX_WORLD][256];           /* a rank's failure */
} bw_t;

/* Runs case c on pg with inputs from the rank's random stream; returns recv (malloc'ed, count
 * elements) or NULL after writing the failure into msg. */
static unsigned char *bw_run_case(fsdp_pg_t *pg, const bw_case_t *k, char *msg, size_t cap) {
    const int r = fsdp_pg_rank(pg), n = fsdp_pg_size(pg);
    const size_t es = fsdp_dtype_size(k->dt), c = k->count;
    const int rs = k->kind == FSDP_COLL_REDUCE_SCATTER;
    const size_t len = rs ? (size_t)n * c : c;
    float *tmp = malloc(len * sizeof *tmp);
    unsigned char *send = malloc(len * es), *recv = malloc(c * es);
    int rc = FSDP_ENOMEM;
    if (tmp && send && recv) {
        fsdp_rng_t rng;
        fsdp_rng_init(&rng, 0xb17b17ULL, (uint64_t)r);
        fsdp_rng_uniform_f32(&rng, tmp, len, -1.0f, 1.0f);
        fsdp_dtype_convert(send, k->dt, tmp, FSDP_DTYPE_F32, len);
        memset(recv, 0xEE, c * es);
        if (rs)
            rc = fsdp_pg_reduce_scatter(pg, send, recv, c, k->dt, k->op, NULL);
        else if (k->kind == FSDP_COLL_REDUCE)
            rc = fsdp_pg_reduce(pg, send, recv, c, k->dt, k->op, 0, NULL);
        else
            rc = fsdp_pg_all_reduce(pg, send, recv, c, k->dt, k->op, NULL);
    }
    if (rc != FSDP_OK) {
        snprintf(msg, cap, "rank %d: %s %s: %s: %.150s", r, fsdp_pg_backend(pg),
                 fsdp_coll_name(k->kind), fsdp_err_name(rc), fsdp_pg_last_error(pg));
        free(recv);
        recv = NULL;
    }
    free(tmp);
    free(send);
    return recv;
}

static int bw_body(fsdp_pg_t *pg, bw_t *b, int gloo) {
    const int r = fsdp_pg_rank(pg);
    for (int i = 0; i < b->ncases; i++) {
        const bw_case_t *k = &b->c[i];
        unsigned char *out = bw_run_case(pg, k, b->msg[r], sizeof b->msg[r]);
        if (!out) return FSDP_EREMOTE; /* the peers fail too, or time out */
        if (!gloo) {
            b->sim[i][r] = out;
            continue;
        }
        const size_t es = fsdp_dtype_size(k->dt);
        long d = 0;
        if (k->kind != FSDP_COLL_REDUCE || r == 0)
            for (size_t e = 0; e < k->count; e++)
                d += memcmp(out + e * es, b->sim[i][r] + e * es, es) != 0;
        b->diff[i][r] = d;
        free(out);
    }
    return FSDP_OK;
}

static int bw_sim_rank(fsdp_ctx_t *ctx, void *arg) {
    return bw_body(fsdp_ctx_pg(ctx), arg, 0);
}

static int bw_gloo_rank(fsdp_ctx_t *ctx, fsdp_pg_t *pg, void *arg) {
    (void)ctx;
    return bw_body(pg, arg, 1);
}

static void bw_add(bw_t *b, fsdp_coll_kind_t kind, fsdp_dtype_t dt, fsdp_redop_t op,
                   size_t count) {
    if (b->ncases == BW_MAX_CASES) tap_bail("bitwise: too many cases");
    bw_case_t *k = &b->c[b->ncases++];
    k->kind = kind;
    k->dt = dt;
    k->op = op;
    k->count = count;
}

/* The cases of a world of n ranks. */
static void bw_cases(bw_t *b, int n) {
    static const fsdp_dtype_t dts[] = {FSDP_DTYPE_F32, FSDP_DTYPE_BF16, FSDP_DTYPE_F16};
    for (int di = 0; di < 3; di++) {
        bw_add(b, FSDP_COLL_REDUCE_SCATTER, dts[di], FSDP_REDOP_SUM, BW_RS_COUNT);
        bw_add(b, FSDP_COLL_REDUCE_SCATTER, dts[di], FSDP_REDOP_AVG, BW_RS_COUNT);
    }
    /* all_reduce reduces in rank order (the reduce-scatter plus an all-gather) at every size;
     * reduce is Gloo's ring, whose order is rank order only at 2 ranks. */
    for (int di = 0; di < 3; di++) {
        fsdp_redop_t op = di == 1 ? FSDP_REDOP_AVG : FSDP_REDOP_SUM;
        bw_add(b, FSDP_COLL_ALL_REDUCE, dts[di], op, BW_AR_COUNT);
        if (n == 2) bw_add(b, FSDP_COLL_REDUCE, dts[di], op, BW_AR_COUNT);
    }
}

static void bw_report(const bw_t *b, int n, const char *name) {
    for (int i = 0; i < b->ncases; i++) {
        const bw_case_t *k = &b->c[i];
        long d = 0;
        for (int r = 0; r < n && d >= 0; r++)
            d = b->diff[i][r] < 0 ? -1 : d + b->diff[i][r];
        char what[160];
        snprintf(what, sizeof what, "%s bitwise: world %d %s %s of random %s", name, n,
                 fsdp_coll_name(k->kind), fsdp_redop_name(k->op), fsdp_dtype_name(k->dt));
        tap_ok(d == 0, "%s (%zu elements%s) equals the sim backend's bits", what, k->count,
               k->kind == FSDP_COLL_REDUCE_SCATTER ? " per rank" : "");
        if (d > 0) tap_diag("%ld elements differ", d);
    }
}

void gcs_bitwise(gw_runner_fn run, const char *name) {
    for (int n = 2; n <= 4; n++) {
        bw_t *b = mp_shared_alloc(sizeof *b);
        bw_cases(b, n);
        for (int i = 0; i < b->ncases; i++)
            for (int r = 0; r < n; r++)
                b->diff[i][r] = -1;
        fsdp_sim_options_t o;
        fsdp_sim_options_init(&o);
        o.world_size = n;
        o.timeout_ms = 60000;
        int rc = fsdp_sim_run(&o, bw_sim_rank, b, NULL);
        if (rc == FSDP_OK) rc = run(n, bw_gloo_rank, b, NULL);
        if (rc != FSDP_OK) {
            tap_diag("world %d: %s", n, fsdp_err_name(rc));
            for (int r = 0; r < n; r++)
                if (b->msg[r][0]) tap_diag("%s", b->msg[r]);
        }
        bw_report(b, n, name);
        for (int i = 0; i < b->ncases; i++)
            for (int r = 0; r < n; r++)
                free(b->sim[i][r]);
        mp_shared_free(b);
    }
}
