/* SPDX-License-Identifier: MIT */
/*
 * coll_prescale.c: the prescaled sums of the collective contract (see coll_prescale.h).
 */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "coll_prescale.h"
#include "mp_fork.h"
#include "tap.h"

#define MAXR 8

typedef struct cp_shared {
    size_t large;
    int bad_rank; /* for the mismatch run: the rank whose prescale differs */
    long checked[MAXR], failed[MAXR];
    int mismatch_rc[MAXR];
    char msg[MAXR][320];
} cp_shared_t;

static const fsdp_dtype_t dtypes[] = {FSDP_DTYPE_F32, FSDP_DTYPE_F64, FSDP_DTYPE_BF16,
                                      FSDP_DTYPE_F16};
static const fsdp_coll_kind_t kinds[] = {FSDP_COLL_REDUCE_SCATTER, FSDP_COLL_ALL_REDUCE,
                                         FSDP_COLL_REDUCE};
static const double scales[] = {0.5, 0.25, 0.3};

/* Rank q's input element i, before it is stored in a dtype: inexact in every dtype. */
static double raw(int q, size_t i) {
    long k = (long)((i * 7919u + (size_t)q * 104729u) % 2001u) - 1000;
    return (double)k * 0.001237 + (double)q * 0.013 + 1e-7 * (double)(i % 7);
}

/* x rounded to dt and read back as a double (exact). */
static double stored(fsdp_dtype_t dt, double x) {
    if (dt == FSDP_DTYPE_F64) return x;
    float f = (float)x;
    if (dt == FSDP_DTYPE_F32) return f;
    uint16_t h;
    fsdp_dtype_convert(&h, dt, &f, FSDP_DTYPE_F32, 1);
    fsdp_dtype_convert(&f, FSDP_DTYPE_F32, &h, dt, 1);
    return f;
}

/* Writes v (exact in dt) as element i of a dt buffer. */
static void put(fsdp_dtype_t dt, void *buf, size_t i, double v) {
    if (dt == FSDP_DTYPE_F64) {
        ((double *)buf)[i] = v;
    } else {
        float f = (float)v;
        if (dt == FSDP_DTYPE_F32)
            ((float *)buf)[i] = f;
        else
            fsdp_dtype_convert((uint16_t *)buf + i, dt, &f, FSDP_DTYPE_F32, 1);
    }
}

/* Σ over q in rank order of round_dt(x_q * s), in f32 for f32/f16/bf16 and f64 for f64, rounded
 * to dt at the end (exact as a double). */
static double expect(fsdp_dtype_t dt, int n, size_t i, double s) {
    if (dt == FSDP_DTYPE_F64) {
        double acc = 0;
        for (int q = 0; q < n; q++) {
            double p = stored(dt, raw(q, i)) * s;
            acc = q == 0 ? p : acc + p;
        }
        return acc;
    }
    float acc = 0;
    for (int q = 0; q < n; q++) {
        float p = (float)stored(dt, raw(q, i)) * (float)s;
        if (dt != FSDP_DTYPE_F32) p = (float)stored(dt, p);
        acc = q == 0 ? p : acc + p;
    }
    return stored(dt, acc);
}

static void fail(cp_shared_t *sh, int r, const char *fmt, ...) FSDP_PRINTF(3, 4);
static void fail(cp_shared_t *sh, int r, const char *fmt, ...) {
    sh->failed[r]++;
    if (sh->msg[r][0]) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(sh->msg[r], sizeof sh->msg[r], fmt, ap);
    va_end(ap);
}

/* What FSDP did before the prescale: x divided in place by q (2 or 4) in its dtype (f16 and
 * bf16 in f32, rounded back). */
static double predivided(fsdp_dtype_t dt, double x, double q) {
    if (dt == FSDP_DTYPE_F64) return x / q;
    return stored(dt, (float)x / (float)q);
}

/* One prescaled collective and its check; with a power-of-two s also the divide-then-sum form. */
static void one(cp_shared_t *sh, fsdp_pg_t *pg, fsdp_coll_kind_t kind, fsdp_dtype_t dt, double s,
                size_t count, int in_place) {
    const int n = fsdp_pg_size(pg), r = fsdp_pg_rank(pg), root = n - 1;
    const size_t es = fsdp_dtype_size(dt);
    const size_t nin = kind == FSDP_COLL_REDUCE_SCATTER ? count * (size_t)n : count;
    char *send = malloc(nin * es), *recv = malloc(nin * es), *ref = malloc(count * es);
    char *keep = malloc(count * es);
    if (!send || !recv || !ref || !keep) {
        fail(sh, r, "out of memory for %zu elements", nin);
        goto out;
    }
    const int pow2 = s == 0.5 || s == 0.25;
    const int mine = kind != FSDP_COLL_REDUCE || r == root; /* this rank gets a result */
    const size_t base = kind == FSDP_COLL_REDUCE_SCATTER ? (size_t)r * count : 0;
    for (int pass = 0; pass < (pow2 ? 2 : 1); pass++) {
        /* pass 1: FSDP's former pre-divide in place, then a plain sum */
        for (size_t i = 0; i < nin; i++) {
            double x = stored(dt, raw(r, i));
            put(dt, send, i, pass ? predivided(dt, x, 1.0 / s) : x);
        }
        char *out = !in_place ? recv
                    : kind == FSDP_COLL_REDUCE_SCATTER ? send + (size_t)r * count * es
                                                         : send;
        fsdp_coll_desc_t d = {.kind = kind,
                              .send = send,
                              .recv = out,
                              .count = count,
                              .dtype = dt,
                              .op = FSDP_REDOP_SUM,
                              .root = root,
                              .prescale = pass ? 0.0 : s};
        int rc = fsdp_pg_collective(pg, &d, NULL);
        if (rc != FSDP_OK) {
            fail(sh, r, "%s %s prescale %g count %zu: %s: %s", fsdp_coll_name(kind),
                 fsdp_dtype_name(dt), s, count, fsdp_err_name(rc), fsdp_pg_last_error(pg));
            goto out;
        }
        if (!mine) continue;
        if (pass == 0) {
            for (size_t j = 0; j < count; j++)
                put(dt, ref, j, expect(dt, n, base + j, s));
            if (memcmp(out, ref, count * es) != 0) {
                fail(sh, r,
                     "%s %s prescale %g count %zu %s: not the rank-order sum of the rounded "
                     "products",
                     fsdp_coll_name(kind), fsdp_dtype_name(dt), s, count,
                     in_place ? "in place" : "out of place");
                goto out;
            }
            memcpy(keep, out, count * es);
        } else if (memcmp(out, keep, count * es) != 0) {
            fail(sh, r,
                 "%s %s prescale %g count %zu: differs from dividing each input by %g first, "
                 "then summing",
                 fsdp_coll_name(kind), fsdp_dtype_name(dt), s, count, 1.0 / s);
            goto out;
        }
        sh->checked[r]++;
    }
out:
    free(send);
    free(recv);
    free(ref);
    free(keep);
}

/* Each rejection: FSDP_EINVAL naming the prescale, with no collective issued. */
static void rejections(cp_shared_t *sh, fsdp_pg_t *pg) {
    const int r = fsdp_pg_rank(pg);
    float a[4] = {0}, b[4 * MAXR] = {0};
    int32_t ia[4] = {0}, ib[4] = {0};
    const struct {
        fsdp_coll_kind_t kind;
        fsdp_dtype_t dt;
        fsdp_redop_t op;
        double s;
        const char *needle;
    } bad[] = {
        {FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_F32, FSDP_REDOP_MAX, 0.5, "needs a sum"},
        {FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_F32, FSDP_REDOP_AVG, 0.5, "needs a sum"},
        {FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_I32, FSDP_REDOP_SUM, 0.5, "needs a sum"},
        {FSDP_COLL_ALL_GATHER, FSDP_DTYPE_F32, FSDP_REDOP_SUM, 0.5, "needs a sum"},
        {FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NAN, "not finite"},
        {FSDP_COLL_REDUCE_SCATTER, FSDP_DTYPE_F32, FSDP_REDOP_SUM, INFINITY, "not finite"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        uint64_t seq = fsdp_pg_seq(pg);
        const int ints = bad[k].dt == FSDP_DTYPE_I32;
        fsdp_coll_desc_t d = {.kind = bad[k].kind,
                              .send = ints ? (void *)ia : (void *)a,
                              .recv = ints ? (void *)ib : (void *)b,
                              .count = 4,
                              .dtype = bad[k].dt,
                              .op = bad[k].op,
                              .prescale = bad[k].s};
        int rc = fsdp_pg_collective(pg, &d, NULL);
        if (rc != FSDP_EINVAL || !strstr(fsdp_pg_last_error(pg), "prescale") ||
            !strstr(fsdp_pg_last_error(pg), bad[k].needle) || fsdp_pg_seq(pg) != seq)
            fail(sh, r, "rejection %zu (%s): got %s, '%s'", k, bad[k].needle, fsdp_err_name(rc),
                 fsdp_pg_last_error(pg));
        else
            sh->checked[r]++;
    }
}

static int cp_rank(fsdp_ctx_t *ctx, fsdp_pg_t *pg, void *arg) {
    (void)ctx;
    cp_shared_t *sh = arg;
    for (size_t a = 0; a < sizeof dtypes / sizeof dtypes[0]; a++)
        for (size_t b = 0; b < sizeof kinds / sizeof kinds[0]; b++)
            for (size_t c = 0; c < sizeof scales / sizeof scales[0]; c++) {
                one(sh, pg, kinds[b], dtypes[a], scales[c], 1, 0);
                one(sh, pg, kinds[b], dtypes[a], scales[c], CM_ODD_COUNT, (int)(c & 1));
            }
    if (sh->large) {
        one(sh, pg, FSDP_COLL_REDUCE_SCATTER, FSDP_DTYPE_F32, 0.5, sh->large, 0);
        one(sh, pg, FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_F32, 0.25, sh->large, 1);
    }
    rejections(sh, pg);
    return FSDP_OK;
}

/* Every rank sums with prescale 0.5, but bad_rank with 0.25. */
static int cp_mismatch_rank(fsdp_ctx_t *ctx, fsdp_pg_t *pg, void *arg) {
    (void)ctx;
    cp_shared_t *sh = arg;
    float a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, b[8];
    const int r = fsdp_pg_rank(pg);
    fsdp_coll_desc_t d = {.kind = FSDP_COLL_ALL_REDUCE,
                          .send = a,
                          .recv = b,
                          .count = 8,
                          .dtype = FSDP_DTYPE_F32,
                          .op = FSDP_REDOP_SUM,
                          .prescale = r == sh->bad_rank ? 0.25 : 0.5};
    sh->mismatch_rc[r] = fsdp_pg_collective(pg, &d, NULL);
    if (sh->mismatch_rc[r] != FSDP_OK && !sh->msg[r][0])
        snprintf(sh->msg[r], sizeof sh->msg[r], "%s", fsdp_pg_last_error(pg));
    return FSDP_OK;
}

void cp_suite(cm_runner_fn run, const char *name, const int *worlds, int nworlds, size_t large,
              int check_mismatch) {
    for (int w = 0; w < nworlds; w++) {
        const int n = worlds[w];
        if (n > MAXR) continue;
        cp_shared_t *sh = mp_shared_alloc(sizeof *sh);
        if (!sh) {
            tap_ok(0, "%s prescale world %d: shared memory", name, n);
            continue;
        }
        sh->large = large;
        int status[MAXR] = {0};
        int rc = run(n, cp_rank, sh, status);
        long checked = 0, failed = 0;
        for (int r = 0; r < n; r++) {
            checked += sh->checked[r];
            failed += sh->failed[r];
            if (sh->msg[r][0]) tap_diag("rank %d: %s", r, sh->msg[r]);
        }
        tap_ok(rc == FSDP_OK && failed == 0 && checked > 0,
               "%s prescale world %d: %ld prescaled sums and rejections as the closed form says "
               "(reduce_scatter, all_reduce, reduce; f32, f64, bf16, f16; %zu-element large "
               "case), %ld wrong, run %s",
               name, n, checked, large, failed, fsdp_err_name(rc));
        mp_shared_free(sh);
    }
    if (!check_mismatch) return;
    cp_shared_t *sh = mp_shared_alloc(sizeof *sh);
    if (!sh) return;
    sh->bad_rank = 1;
    run(3, cp_mismatch_rank, sh, NULL);
    int all = 1;
    for (int r = 0; r < 3; r++)
        all = all && sh->mismatch_rc[r] == FSDP_EMISMATCH && strstr(sh->msg[r], "prescale=0.25");
    tap_ok(all, "%s prescale: ranks that disagree on the prescale (rank 1 0.25, the others 0.5) "
           "all get FSDP_EMISMATCH naming both (rank 0: %s)",
           name, sh->msg[0]);
    mp_shared_free(sh);
}
