/* SPDX-License-Identifier: MIT */
/*
 * gloo_coll_suite.c: the F02 matrix and the bitwise comparison with sim on Gloo worlds of
 * threads or processes (see gloo_coll_suite.h).
 */
#define _POSIX_C_SOURCE 200809L

#include "gloo_coll_suite.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coll_matrix.h"
#include "mp_fork.h"
#include "tap.h"

#define MAX_WORLD GW_MAX_WORLD

size_t gcs_large_bytes(void) {
    return cm_large_bytes(4, 1);
}

int gcs_matrix(gw_runner_fn run, const char *name, size_t large) {
    static const int worlds[] = {2, 3, 4};
    const cm_options_t o = {
        .name = name, .worlds = worlds, .nworlds = 3, .large = large, .timeout_ms = 60000};
    return cm_matrix(run, &o);
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
    /* all_reduce and reduce reduce in rank order (the reduce-scatter, then an all-gather or a
     * gather at the root) at every size, so they are checked at 2, 3 and 4 ranks. */
    (void)n;
    for (int di = 0; di < 3; di++) {
        fsdp_redop_t op = di == 1 ? FSDP_REDOP_AVG : FSDP_REDOP_SUM;
        bw_add(b, FSDP_COLL_ALL_REDUCE, dts[di], op, BW_AR_COUNT);
        bw_add(b, FSDP_COLL_REDUCE, dts[di], op, BW_AR_COUNT);
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
