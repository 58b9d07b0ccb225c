/* SPDX-License-Identifier: MIT */
/*
 * coll_matrix.c: the F02 matrix for every backend and runner (see coll_matrix.h).
 */
#define _POSIX_C_SOURCE 200809L

#include "coll_matrix.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coll_check.h"
#include "core/sanitizer.h"
#include "mp_fork.h"
#include "tap.h"

#define KEEP_MSGS 3

const fsdp_coll_kind_t cm_kinds[CM_NKINDS] = {FSDP_COLL_ALL_GATHER, FSDP_COLL_REDUCE_SCATTER,
                                              FSDP_COLL_ALL_REDUCE, FSDP_COLL_BROADCAST,
                                              FSDP_COLL_REDUCE,     FSDP_COLL_ALL_TO_ALL};

size_t cm_large_bytes(long mb, long tsan_mb) {
    const char *e = getenv("FSDP_TEST_LARGE_MB");
    if (FSDP_UNDER_TSAN) mb = tsan_mb;
    if (e && *e) mb = strtol(e, NULL, 10);
    if (mb < 0) mb = 0;
    return (size_t)mb << 20;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

typedef struct cell {
    int combos; /* combinations run (counted on rank 0) */
    int fails;  /* failed (combination, rank) pairs */
    char msg[KEEP_MSGS][640];
} cell_t;

/* One world's results, in mp_shared_alloc() memory: the ranks may be processes. */
typedef struct matrix {
    size_t large;       /* bytes of the large message; 0 for none */
    int64_t timeout_ms; /* of the group; 0: as the runner made it */
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

/*
 * The large case reduces with sum and one other operator only. It is there for what depends on
 * the size of the buffers (blocking in the reduction kernels, slicing of the work over ranks,
 * offsets deep into large buffers), not for the operators' semantics, which the small counts
 * check for every operator; running all five operators at size would multiply the run time by
 * 2.5. The second operator rotates over dtypes and worlds so that each is run at size.
 */
static int large_op_wanted(fsdp_dtype_t dt, fsdp_redop_t op, int world) {
    static const fsdp_redop_t others[4] = {FSDP_REDOP_AVG, FSDP_REDOP_MIN, FSDP_REDOP_MAX,
                                           FSDP_REDOP_PROD};
    fsdp_redop_t other = others[((int)dt + world) % 4];
    if (dt == FSDP_DTYPE_BOOL && other == FSDP_REDOP_AVG) other = FSDP_REDOP_PROD;
    return op == FSDP_REDOP_SUM || op == other;
}

/* Every combination of one (collective, dtype) cell, on this rank. */
static void run_cell(matrix_t *m, fsdp_pg_t *pg, fsdp_coll_kind_t kind, fsdp_dtype_t dt) {
    const int r = fsdp_pg_rank(pg), n = fsdp_pg_size(pg);
    const int nops = coll_check_has_op(kind) ? FSDP_REDOP_COUNT : 1;
    const int nroots = coll_check_has_root(kind) && n > 1 ? 2 : 1;
    cell_t *cell = &m->cell[kind][dt];
    size_t counts[4] = {0, 1, CM_ODD_COUNT, 0};
    int ncounts = 3;
    char why[1024];
    if (m->large) counts[ncounts++] = coll_check_count_for_bytes(kind, dt, n, m->large);
    for (int ci = 0; ci < ncounts; ci++) {
        const int large = ci == 3;
        for (int opi = 0; opi < nops; opi++) {
            fsdp_redop_t op = (fsdp_redop_t)opi;
            if (large && coll_check_has_op(kind) && !large_op_wanted(dt, op, n)) continue;
            for (int ip = 0; ip < 2; ip++) {
                for (int ri = 0; ri < nroots; ri++) {
                    /* Large: root 0 out of place, root size-1 in place (the root does not change
                     * how the data is cut, and this halves the time). */
                    if (large && nroots == 2 && ri != ip) continue;
                    /* Broadcast and reduce out of place also run with NULL for the buffers the
                     * contract does not use (the odd count). */
                    int nnull = coll_check_has_root(kind) && !ip && counts[ci] == CM_ODD_COUNT;
                    for (int nu = 0; nu <= nnull; nu++) {
                        coll_check_args_t a;
                        memset(&a, 0, sizeof a);
                        a.kind = kind;
                        a.dtype = dt;
                        a.op = op;
                        a.count = counts[ci];
                        a.in_place = ip;
                        a.root = ri == 0 ? 0 : n - 1;
                        a.null_unused = nu;
                        a.async = counts[ci] == 1; /* the count-1 cases go through a work */
                        int rc = coll_check_run_args(pg, &a, why, sizeof why);
                        record(m, cell, r, rc, why);
                    }
                }
            }
        }
    }
}

static int matrix_rank(fsdp_ctx_t *ctx, fsdp_pg_t *pg, void *arg) {
    matrix_t *m = arg;
    char why[1024];
    (void)ctx;
    if (m->timeout_ms > 0) fsdp_pg_set_timeout(pg, m->timeout_ms);
    for (int ki = 0; ki < CM_NKINDS; ki++)
        for (int dt = 0; dt < FSDP_DTYPE_COUNT; dt++)
            run_cell(m, pg, cm_kinds[ki], (fsdp_dtype_t)dt);
    for (int i = 0; i < 3; i++) {
        int rc = coll_check_run(pg, FSDP_COLL_BARRIER, FSDP_DTYPE_U8, FSDP_REDOP_SUM, 0, 0, 0, why,
                                sizeof why);
        record(m, &m->barrier, fsdp_pg_rank(pg), rc, why);
    }
    coll_check_release();
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

int cm_matrix(cm_runner_fn run, const cm_options_t *o) {
    int total = 0;
    char counts[64];
    if (o->large)
        snprintf(counts, sizeof counts, "0, 1, %d, %zu MiB", CM_ODD_COUNT, o->large >> 20);
    else
        snprintf(counts, sizeof counts, "0, 1, %d", CM_ODD_COUNT);
    for (int wi = 0; wi < o->nworlds; wi++) {
        const int n = o->worlds[wi];
        matrix_t *m = mp_shared_alloc(sizeof *m);
        m->large = o->large;
        m->timeout_ms = o->timeout_ms;
        mp_mutex_init(&m->mu);
        double t0 = now_s();
        int rc = run(n, matrix_rank, m, NULL);
        tap_is_int(rc, FSDP_OK, "%s world %d: the matrix ran on every rank (%.1f s)", o->name, n,
                   now_s() - t0);
        for (int ki = 0; ki < CM_NKINDS; ki++) {
            fsdp_coll_kind_t kind = cm_kinds[ki];
            for (int dt = 0; dt < FSDP_DTYPE_COUNT; dt++) {
                const cell_t *c = &m->cell[kind][dt];
                report_cell(c, "%s world %d: %s %s: %d combinations (%scounts %s%s%s)", o->name, n,
                            fsdp_coll_name(kind), fsdp_dtype_name((fsdp_dtype_t)dt), c->combos,
                            coll_check_has_op(kind) ? "5 ops x " : "", counts,
                            coll_check_has_root(kind) ? " x roots 0, size-1" : "",
                            kind == FSDP_COLL_ALL_TO_ALL ? "; send == recv rejected"
                                                         : " x in/out of place");
                total += c->combos;
            }
        }
        report_cell(&m->barrier, "%s world %d: barrier", o->name, n);
        total += m->barrier.combos;
        pthread_mutex_destroy(&m->mu);
        mp_shared_free(m);
    }
    return total;
}
