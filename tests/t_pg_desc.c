/* SPDX-License-Identifier: MIT */
/*
 * t_pg_desc.c: collectives described whole (fsdp_pg_collective, fsdp/pg.h): the stream travels
 * with each collective, as NCCL's calls take it, and a group keeps no stream of its own.
 *
 * A recording backend (built on the group core of pg_impl.h, like the dummy group) keeps, for
 * every collective posted to it, the descriptor the core handed over, and completes it at once.
 *   - Every field of a descriptor reaches the backend unchanged (kind, buffers, count, dtype,
 *     op, root, stream), for every kind.
 *   - The plain calls (fsdp_pg_all_gather, ...) carry no stream, also right after a described
 *     call that carried one: nothing is left behind on the group.
 *   - Two threads issuing on one group at once, each with its own stream, each see only their
 *     own stream on their collectives (the shared-group race that a group-wide stream had;
 *     ThreadSanitizer checks the rest).
 *   - A NULL descriptor or a kind outside the enum is FSDP_EINVAL with a message naming it, and
 *     the work handle is NULL; a bad argument inside the descriptor is refused by the same
 *     checks as the plain calls and does not reach the backend.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "pg/pg_impl.h"
#include "tap.h"

#define MAXREC 4096
#define THREAD_CALLS 500

typedef struct rec_pg {
    fsdp_pg_t base;
    pthread_mutex_t mu;
    fsdp_coll_t rec[MAXREC];
    size_t n;
} rec_pg_t;

static int rec_post(fsdp_pg_t *pg, fsdp_work_t *w) {
    rec_pg_t *g = (rec_pg_t *)pg;
    pthread_mutex_lock(&g->mu);
    if (g->n < MAXREC) g->rec[g->n++] = w->coll;
    pthread_mutex_unlock(&g->mu);
    fsdp__work_complete(w, FSDP_OK, NULL);
    return FSDP_OK;
}

static void rec_destroy(fsdp_pg_t *pg) {
    rec_pg_t *g = (rec_pg_t *)pg;
    pthread_mutex_destroy(&g->mu);
    fsdp__pg_fini(pg);
    free(g);
}

static const struct fsdp_pg_ops rec_ops = {
    .name = "record", .post = rec_post, .destroy = rec_destroy};

static rec_pg_t *rec_create(fsdp_ctx_t *ctx) {
    rec_pg_t *g = calloc(1, sizeof *g);
    if (!g) return NULL;
    pthread_mutex_init(&g->mu, NULL);
    if (fsdp__pg_init(&g->base, &rec_ops, ctx, 0, 1, NULL, "record") < 0) {
        rec_destroy(&g->base);
        return NULL;
    }
    return g;
}

/* The streams: any distinct addresses (the CPU backends never look at them). */
static char stream_a, stream_b;

typedef struct racer {
    rec_pg_t *g;
    void *stream;
    float buf[4];
    int rc;
} racer_t;

static void *race(void *arg) {
    racer_t *r = arg;
    for (int i = 0; i < THREAD_CALLS && r->rc == 0; i++) {
        fsdp_coll_desc_t d = {.kind = FSDP_COLL_ALL_REDUCE,
                              .send = r->buf,
                              .recv = r->buf,
                              .count = 4,
                              .dtype = FSDP_DTYPE_F32,
                              .op = FSDP_REDOP_SUM,
                              .stream = r->stream};
        r->rc = fsdp_pg_collective(&r->g->base, &d, NULL);
    }
    return NULL;
}

int main(void) {
    tap_plan(13);
    fsdp_ctx_t *ctx = NULL;
    if (fsdp_ctx_create(NULL, &ctx) < 0) tap_bail("fsdp_ctx_create failed");
    rec_pg_t *g = rec_create(ctx);
    if (!g) tap_bail("creating the recording group failed");
    fsdp_pg_t *pg = &g->base;

    /* Every kind, described, with a stream each. */
    float send[8] = {1, 2, 3, 4, 5, 6, 7, 8}, recv[8] = {0};
    static const fsdp_coll_kind_t kinds[] = {
        FSDP_COLL_ALL_GATHER, FSDP_COLL_REDUCE_SCATTER, FSDP_COLL_ALL_REDUCE, FSDP_COLL_BROADCAST,
        FSDP_COLL_REDUCE,     FSDP_COLL_ALL_TO_ALL,     FSDP_COLL_BARRIER};
    const size_t nk = sizeof kinds / sizeof kinds[0];
    int rc = FSDP_OK, bad = 0;
    for (size_t i = 0; i < nk && rc == 0; i++) {
        fsdp_coll_desc_t d = {.kind = kinds[i],
                              .send = send,
                              .recv = recv,
                              .count = kinds[i] == FSDP_COLL_BARRIER ? 0 : 8,
                              .dtype = FSDP_DTYPE_F32,
                              .op = FSDP_REDOP_MAX,
                              .root = 0,
                              .stream = i % 2 ? (void *)&stream_b : (void *)&stream_a};
        fsdp_work_t *w = NULL;
        rc = fsdp_pg_collective(pg, &d, &w);
        if (rc == 0) rc = fsdp_work_wait(w, -1);
        fsdp_work_release(w);
        if (rc < 0) tap_diag("%s: %s", fsdp_coll_name(kinds[i]), fsdp_pg_last_error(pg));
        const fsdp_coll_t *c = &g->rec[i];
        bool barrier = kinds[i] == FSDP_COLL_BARRIER;
        if (rc == 0 && (g->n != i + 1 || c->kind != kinds[i] || c->stream != d.stream ||
                        (!barrier && (c->send != (const void *)send || c->recv != (void *)recv ||
                                      c->count != 8 || c->dtype != FSDP_DTYPE_F32)))) {
            bad++;
            tap_diag("%s: recorded kind %s, stream %p (want %p), count %zu",
                     fsdp_coll_name(kinds[i]), fsdp_coll_name(c->kind), c->stream, d.stream,
                     c->count);
        }
        bool has_op = kinds[i] == FSDP_COLL_REDUCE_SCATTER || kinds[i] == FSDP_COLL_ALL_REDUCE ||
                      kinds[i] == FSDP_COLL_REDUCE;
        if (rc == 0 && has_op && c->op != FSDP_REDOP_MAX) bad++;
    }
    tap_ok(rc == 0, "fsdp_pg_collective issues every kind (%zu kinds)", nk);
    tap_is_int(bad, 0,
               "each descriptor reaches the backend whole: kind, buffers, count, dtype, op "
               "and its own stream");

    /* The plain calls carry no stream, also right after a described call that carried one. */
    size_t before = g->n;
    rc = fsdp_pg_all_reduce(pg, send, recv, 8, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    if (rc == 0) rc = fsdp_pg_all_gather(pg, send, recv, 8, FSDP_DTYPE_F32, NULL);
    if (rc == 0) rc = fsdp_pg_barrier(pg, NULL);
    tap_ok(rc == 0 && g->n == before + 3, "the plain calls are issued (%zu recorded)",
           g->n - before);
    bool none = true;
    for (size_t i = before; i < g->n; i++)
        none = none && g->rec[i].stream == NULL;
    tap_ok(none, "the plain calls carry no stream: the group kept none from the described ones");

    /* Two threads on one group, each with its own stream. */
    g->n = 0;
    racer_t r[2] = {{g, &stream_a, {1, 2, 3, 4}, 0}, {g, &stream_b, {5, 6, 7, 8}, 0}};
    pthread_t t[2];
    for (int i = 0; i < 2; i++)
        if (pthread_create(&t[i], NULL, race, &r[i]) != 0) tap_bail("pthread_create failed");
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    tap_ok(r[0].rc == 0 && r[1].rc == 0 && g->n == 2 * THREAD_CALLS,
           "two threads issue %d collectives each on one group (%zu recorded)", THREAD_CALLS, g->n);
    size_t mism = 0, on_a = 0, on_b = 0;
    for (size_t i = 0; i < g->n; i++) {
        const fsdp_coll_t *c = &g->rec[i];
        bool from_a = c->send == (const void *)r[0].buf;
        on_a += from_a;
        on_b += !from_a;
        if (c->stream != (from_a ? (void *)&stream_a : (void *)&stream_b)) mism++;
    }
    tap_ok(mism == 0 && on_a == THREAD_CALLS && on_b == THREAD_CALLS,
           "each thread's collectives carry its own stream (%zu on another thread's)", mism);

    /* Refusals. */
    fsdp_work_t *w = (fsdp_work_t *)&stream_a;
    before = g->n;
    rc = fsdp_pg_collective(pg, NULL, &w);
    tap_ok(rc == FSDP_EINVAL && w == NULL, "a NULL descriptor is FSDP_EINVAL and *work is NULL");
    tap_has_str(fsdp_pg_last_error(pg), "desc is NULL", "the message says the descriptor is NULL");
    fsdp_coll_desc_t bogus = {.kind = (fsdp_coll_kind_t)42, .stream = &stream_a};
    rc = fsdp_pg_collective(pg, &bogus, NULL);
    tap_ok(rc == FSDP_EINVAL, "a kind outside the enum is FSDP_EINVAL");
    tap_has_str(fsdp_pg_last_error(pg), "kind 42", "the message names the kind");
    fsdp_coll_desc_t badop = {.kind = FSDP_COLL_ALL_REDUCE,
                              .send = send,
                              .recv = recv,
                              .count = 8,
                              .dtype = FSDP_DTYPE_F32,
                              .op = (fsdp_redop_t)99,
                              .stream = &stream_b};
    rc = fsdp_pg_collective(pg, &badop, NULL);
    tap_ok(rc == FSDP_EINVAL,
           "a bad reduction operator in a descriptor is refused like the "
           "plain calls refuse it: %s",
           fsdp_pg_last_error(pg));
    tap_ok(g->n == before, "no refused descriptor reached the backend");
    tap_is_uint(fsdp_pg_seq(pg), 2 * THREAD_CALLS + nk + 3,
                "refused calls consume no sequence number");

    fsdp_pg_destroy(pg);
    fsdp_ctx_destroy(ctx);
    return tap_done();
}
