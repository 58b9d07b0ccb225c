/* SPDX-License-Identifier: MIT */
/*
 * t_fsdp_stream.c: stream-ordered waits for collectives (fsdp_work_wait_stream, fsdp_pg_sync;
 * docs/design.md "Stream-ordered collective waits") and FSDP's use of them (spec F03: results
 * must not change with asynchronous ordering; F01: all-gather unshards, reduce-scatter reduces).
 *
 * This build has no GPU, so both ends of a stream wait are stand-ins:
 *   - the process group "stream-test" wraps a real group (the dummy group, or the rank's sim
 *     world group): every collective runs on that group at once, so the data is right, but its
 *     work completes later, from a thread of the test group, only once a stream was made to
 *     wait for it (or after a second, when nobody does), as an NCCL collective completes when
 *     the stream reaches its end event. Its wait_stream entry records each call: the kind, the
 *     stream, whether the collective had completed. Failures are injected on the n-th
 *     collective of a kind (on every rank), after it ran, and are sticky, as a communicator
 *     abort is;
 *   - the compute device S is the CPU's vtable plus a compute stream (a token per rank) and
 *     events that complete behind the host: the k-th event recorded completes once LAG more
 *     have been recorded, or when it is synchronized; event_query says which, without side
 *     effects. S's free checks every block it frees against the units' deferred lists: a
 *     buffer a collective read must not be freed while the event after its last use is pending.
 *
 * Checks:
 *   API      fsdp_work_wait_stream(NULL) is FSDP_EINVAL; on a group without stream waits (the
 *            dummy) it waits on the host (the work has completed, host_waits counts it); on
 *            the test group it returns before the collective completes (stream_waits); a
 *            backend that cannot order the stream (wait_stream returns 1) makes the core wait on
 *            the host; a late failure is reported once, with a message naming the collective,
 *            its sequence number, the group and the rank, at the next blocking point: the next
 *            collective (not run: the sequence number stays), a wait on another work of the
 *            group, fsdp_pg_sync; one never reported is logged when the group is destroyed.
 *   FSDP     world 2, Sequential(4 x Linear(6, 6)), a unit per Linear, two SGD steps, FULL_SHARD,
 *            SHARD_GRAD_OP and NO_SHARD in f32, FULL_SHARD with bf16 parameters: STREAM (device
 *            S, the test group) gives bitwise BLOCK's losses and parameters (a plain CPU device,
 *            the sim group; the host waits); in STREAM every all-gather, reduce-scatter and
 *            all-reduce FSDP issues is issued after a side stream waited for the compute stream,
 *            and waited on S's compute stream and none on the host, each before it completed;
 *            in BLOCK none on a stream. No buffer is freed before its event
 *            completed, some are held past a wait point, every wait releases what completed in
 *            the whole tree (at most LAG listed), and none is left after a backward.
 *   late     in STREAM, an injected failure of the first reduce-scatter, of the last one, and of
 *            the second all-gather of the first step is reported by that step's forward or
 *            backward, with a message naming the collective and the rank.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <config.h>
#include <fsdp.h>

#include "core/timeutil.h"
#include "device/device_impl.h"
#include "fsdp/fsdp_impl.h"
#include "fsdp_util.h"
#include "shard_parity.h"
#include "models/models.h"
#include "pg/pg_impl.h"
#include "tap.h"
#include "tensor/tensor_impl.h"

#define STEPS 2
#define NLIN 4
#define DIM 6
#define LAG 2            /* S's events complete LAG records later */
#define FALLBACK_MS 3000 /* the test group completes an unwaited collective after this */
#define QCAP 256

/* Per rank: what the compute device S saw (reset by each FSDP run). */
typedef struct srank {
    int token;                 /* the compute stream's address is the handle */
    uint64_t recorded, synced; /* tickets recorded; the highest synchronized */
    uint64_t not_ready;        /* queries that found an event pending */
    uint64_t deferred_frees, early_frees;
    size_t max_listed;         /* deferred buffers listed in the tree when an event is recorded */
    uint64_t side_waits;       /* event waits on a stream other than the compute stream */
    uint64_t posts, unordered; /* collectives posted; those with no such wait since the last */
    fsdp_unit_t *root;         /* units whose deferred lists S's free checks */
} srank_t;

static srank_t sr[FU_MAXR];

/* ---- the test process group ----------------------------------------------------------------- */

typedef struct pend {
    fsdp_work_t *w;
    int status;
    int go; /* a stream was made to wait for it */
    int64_t t0_ns;
} pend_t;

typedef struct spg {
    fsdp_pg_t base;
    fsdp_pg_t *inner; /* borrowed */
    void *want_stream;
    int cannot;              /* wait_stream answers 1: the stream cannot wait for this one */
    int fail_kind, fail_nth; /* inject: the fail_nth-th collective of fail_kind fails (-1: off) */
    int seen[FSDP_COLL_COUNT];
    int broken;
    int queue_broken; /* after the failure, later collectives fail late too (else at once) */
    int hold;         /* complete nothing while set (guarded by mu) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pend_t q[QCAP];
    size_t qh, qn;
    int stop;
    pthread_t thr;
    /* read by the test after the group is idle */
    uint64_t posts;
    uint64_t ws_calls[FSDP_COLL_COUNT];
    uint64_t ws_bad_stream, ws_done_before, completed;
} spg_t;

static void *spg_main(void *arg) {
    spg_t *g = arg;
    pthread_mutex_lock(&g->mu);
    for (;;) {
        while (!g->qn && !g->stop)
            pthread_cond_wait(&g->cv, &g->mu);
        if (!g->qn) break;
        pend_t *p = &g->q[g->qh];
        if (g->hold || (!p->go && fsdp__now_ns() - p->t0_ns < (int64_t)FALLBACK_MS * 1000000)) {
            struct timespec d = fsdp__deadline_ms(1);
            pthread_cond_timedwait(&g->cv, &g->mu, &d);
            continue;
        }
        pend_t done = *p;
        g->qh = (g->qh + 1) % QCAP;
        g->qn--;
        pthread_mutex_unlock(&g->mu);
        if (done.status < 0)
            fsdp__work_complete(done.w, done.status, "injected failure of %s on rank %d",
                                fsdp_coll_name(done.w->coll.kind), g->base.rank);
        else
            fsdp__work_complete(done.w, FSDP_OK, NULL);
        pthread_mutex_lock(&g->mu);
        /* counted once the work is complete: spg_wait_completed() then sees it done */
        g->completed++;
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

static int spg_post(fsdp_pg_t *pg, fsdp_work_t *w) {
    spg_t *g = (spg_t *)pg;
    g->posts++;
    if (g->broken && !g->queue_broken) { /* as NCCL fails what follows an abort */
        fsdp__work_complete(w, FSDP_EREMOTE,
                            "%s on group '%s' (rank %d): the group failed earlier: injected "
                            "failure of %s on rank %d",
                            fsdp_coll_name(w->coll.kind), pg->name, pg->rank,
                            fsdp_coll_name((fsdp_coll_kind_t)g->fail_kind), pg->rank);
        return FSDP_OK;
    }
    int status = g->broken ? FSDP_EREMOTE : fsdp__pg_issue(g->inner, &w->coll, NULL);
    if (status == FSDP_OK && (int)w->coll.kind == g->fail_kind &&
        ++g->seen[w->coll.kind] == g->fail_nth) {
        status = FSDP_EREMOTE;
        g->broken = 1;
    }
    /* FSDP's collectives (asynchronous ones) come after its side stream waited for the
     * compute stream. */
    srank_t *sk = &sr[pg->rank];
    if (!w->sync) {
        sk->posts++;
        if (!sk->side_waits) sk->unordered++;
        sk->side_waits = 0;
    }
    if (w->sync) { /* the caller blocks on it: no stream can wait */
        fsdp__work_complete(w, status, "injected failure of %s on rank %d",
                            fsdp_coll_name(w->coll.kind), pg->rank);
        return FSDP_OK;
    }
    pthread_mutex_lock(&g->mu);
    if (g->qn == QCAP) {
        pthread_mutex_unlock(&g->mu);
        return fsdp__pg_err(pg, FSDP_ENOMEM, "test group: queue full");
    }
    g->q[(g->qh + g->qn) % QCAP] = (pend_t){w, status, 0, fsdp__now_ns()};
    g->qn++;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    return FSDP_OK;
}

static int spg_wait_stream(fsdp_pg_t *pg, fsdp_work_t *w, void *stream) {
    spg_t *g = (spg_t *)pg;
    g->ws_calls[w->coll.kind]++;
    if (stream != g->want_stream) g->ws_bad_stream++;
    if (g->cannot) return 1;
    pthread_mutex_lock(&pg->mu);
    int done = w->done;
    pthread_mutex_unlock(&pg->mu);
    if (done) g->ws_done_before++;
    pthread_mutex_lock(&g->mu);
    for (size_t i = 0; i < g->qn; i++)
        if (g->q[(g->qh + i) % QCAP].w == w) g->q[(g->qh + i) % QCAP].go = 1;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    return FSDP_OK;
}

static void spg_destroy(fsdp_pg_t *pg) {
    spg_t *g = (spg_t *)pg;
    pthread_mutex_lock(&g->mu);
    g->stop = 1;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    pthread_join(g->thr, NULL);
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
    fsdp__pg_fini(pg);
    free(g);
}

static const struct fsdp_pg_ops spg_ops = {
    .name = "stream-test",
    .post = spg_post,
    .wait_stream = spg_wait_stream,
    .destroy = spg_destroy,
};

static spg_t *spg_create(fsdp_ctx_t *ctx, fsdp_pg_t *inner, void *want_stream) {
    spg_t *g = calloc(1, sizeof *g);
    if (!g) return NULL;
    g->inner = inner;
    g->want_stream = want_stream;
    g->fail_kind = -1;
    pthread_mutex_init(&g->mu, NULL);
    fsdp__cond_init(&g->cv);
    if (fsdp__pg_init(&g->base, &spg_ops, ctx, inner->rank, inner->size, NULL, "stream-test") < 0 ||
        pthread_create(&g->thr, NULL, spg_main, g) != 0) {
        fsdp__pg_fini(&g->base);
        free(g);
        return NULL;
    }
    return g;
}

static void spg_hold(spg_t *g, int on) {
    pthread_mutex_lock(&g->mu);
    g->hold = on;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

/* Waits until the test group has completed n collectives. */
static void spg_wait_completed(spg_t *g, uint64_t n) {
    for (;;) {
        pthread_mutex_lock(&g->mu);
        uint64_t c = g->completed;
        pthread_mutex_unlock(&g->mu);
        if (c >= n) return;
        fsdp__sleep_ms(1);
    }
}

static fsdp_pg_counters_t counters(const fsdp_pg_t *pg) {
    fsdp_pg_counters_t c;
    fsdp_pg_get_counters(pg, &c);
    return c;
}

/* ---- API checks --------------------------------------------------------------------------------
 */

static char logged[2048];
static void sink(void *user, int rank, fsdp_log_level_t level, const char *msg) {
    (void)user, (void)rank;
    if (level == FSDP_LOG_ERROR) snprintf(logged, sizeof logged, "%s", msg);
}

static bool names_late(const char *msg, const char *coll, int rank) {
    char r[32];
    snprintf(r, sizeof r, "(rank %d)", rank);
    return strstr(msg, coll) && strstr(msg, "group 'stream-test'") && strstr(msg, r) &&
           strstr(msg, "seq ") && strstr(msg, "injected failure");
}

static void api_checks(void) {
    fsdp_ctx_t *ctx = NULL;
    fsdp_ctx_options_t co;
    fsdp_ctx_options_init(&co);
    if (fsdp_ctx_create(&co, &ctx) < 0) tap_bail("cannot create a context");
    fsdp_ctx_set_log_sink(ctx, sink, NULL);
    fsdp_pg_t *dummy = NULL;
    if (fsdp_pg_create_dummy(ctx, 0, 1, FSDP_DUMMY_NOOP, &dummy) < 0)
        tap_bail("cannot create the dummy group");
    int stream_token = 0;
    void *S = &stream_token;
    float a[4] = {1, 2, 3, 4}, b[4];
    fsdp_work_t *w = NULL, *w2 = NULL;
    int done = 0;

    tap_is_int(fsdp_work_wait_stream(NULL, S), FSDP_EINVAL,
               "fsdp_work_wait_stream(NULL work) is FSDP_EINVAL");
    tap_is_int(fsdp_pg_sync(NULL), FSDP_EINVAL, "fsdp_pg_sync(NULL) is FSDP_EINVAL");

    /* A group without stream waits: the host waits. */
    fsdp_pg_reset_counters(dummy);
    fsdp_pg_all_reduce(dummy, a, b, 4, FSDP_DTYPE_F32, FSDP_REDOP_SUM, &w);
    tap_is_int(fsdp_work_wait_stream(w, S), FSDP_OK, "dummy group: fsdp_work_wait_stream is OK");
    fsdp_work_test(w, &done);
    fsdp_pg_counters_t c = counters(dummy);
    tap_ok(done && c.host_waits[FSDP_COLL_ALL_REDUCE] == 1 &&
               c.stream_waits[FSDP_COLL_ALL_REDUCE] == 0,
           "dummy group (no stream waits): the host waited; host_waits 1, stream_waits 0");
    fsdp_work_release(w);

    /* The test group: the stream waits, the host goes on. */
    spg_t *g = spg_create(ctx, dummy, S);
    if (!g) tap_bail("cannot create the test group");
    fsdp_pg_t *pg = &g->base;
    fsdp_pg_all_gather(pg, a, b, 4, FSDP_DTYPE_F32, &w);
    tap_is_int(fsdp_work_wait_stream(w, S), FSDP_OK, "test group: fsdp_work_wait_stream is OK");
    c = counters(pg);
    tap_ok(g->ws_calls[FSDP_COLL_ALL_GATHER] == 1 && g->ws_bad_stream == 0 &&
               g->ws_done_before == 0 && c.stream_waits[FSDP_COLL_ALL_GATHER] == 1 &&
               c.host_waits[FSDP_COLL_ALL_GATHER] == 0,
           "test group: the backend's wait_stream got the stream, before completion; "
           "stream_waits 1, host_waits 0");
    tap_is_int(fsdp_work_wait(w, -1), FSDP_OK, "a host wait after a stream wait is OK");
    fsdp_work_release(w);

    /* A backend that cannot order the stream: the core waits on the host. */
    g->cannot = 1;
    fsdp_pg_all_gather(pg, a, b, 4, FSDP_DTYPE_F32, &w);
    int rc = fsdp_work_wait_stream(w, S);
    fsdp_work_test(w, &done);
    c = counters(pg);
    tap_ok(rc == FSDP_OK && done && c.host_waits[FSDP_COLL_ALL_GATHER] == 2 &&
               c.stream_waits[FSDP_COLL_ALL_GATHER] == 1,
           "wait_stream answering 1: the core waited on the host (the work has completed)");
    fsdp_work_release(w);
    g->cannot = 0;

    /* A late failure reported by the next collective, once. */
    g->fail_kind = FSDP_COLL_REDUCE_SCATTER;
    g->fail_nth = 1;
    fsdp_pg_reduce_scatter(pg, a, b, 4, FSDP_DTYPE_F32, FSDP_REDOP_SUM, &w);
    uint64_t seq = fsdp_pg_seq(pg), posts = g->posts;
    tap_is_int(fsdp_work_wait_stream(w, S), FSDP_OK,
               "late: the stream wait of a collective that will fail returns OK");
    fsdp_work_release(w); /* the group keeps what it needs */
    spg_wait_completed(g, g->posts);
    rc = fsdp_pg_barrier(pg, NULL);
    tap_is_int(rc, FSDP_EREMOTE, "late: the next collective returns the failure");
    tap_ok(names_late(fsdp_pg_last_error(pg), "reduce_scatter", 0),
           "late: its message names reduce_scatter, its seq, the group and the rank");
    tap_diag("%s", fsdp_pg_last_error(pg));
    tap_ok(fsdp_pg_seq(pg) == seq && g->posts == posts,
           "late: the collective that reported it was not run");
    rc = fsdp_pg_barrier(pg, NULL);
    tap_ok(rc == FSDP_EREMOTE && !strstr(fsdp_pg_last_error(pg), "after a stream"),
           "late: reported once (the next collective fails on its own: the group is broken)");
    fsdp_pg_destroy(pg);

    /* ... by a wait on another work of the group: the one issued before completed first. */
    g = spg_create(ctx, dummy, S);
    pg = &g->base;
    g->fail_kind = FSDP_COLL_REDUCE_SCATTER;
    g->fail_nth = 1;
    fsdp_pg_all_gather(pg, a, b, 1, FSDP_DTYPE_F32, &w);
    fsdp_pg_reduce_scatter(pg, a, b, 1, FSDP_DTYPE_F32, FSDP_REDOP_SUM, &w2);
    fsdp_work_wait_stream(w2, S);
    fsdp_work_wait_stream(w, S);
    spg_wait_completed(g, 2);
    rc = fsdp_work_wait(w, -1);
    tap_ok(rc == FSDP_EREMOTE && names_late(fsdp_pg_last_error(pg), "reduce_scatter", 0),
           "late: a wait on another work (which succeeded) returns the failure, named");
    tap_ok(strcmp(fsdp_work_error(w2), "") != 0 && fsdp_work_wait(w2, -1) == FSDP_EREMOTE,
           "late: the failed work keeps its status");
    tap_is_int(fsdp_pg_sync(pg), FSDP_OK, "late: fsdp_pg_sync afterwards has nothing left");
    fsdp_work_release(w);
    fsdp_work_release(w2);
    fsdp_pg_destroy(pg);

    /* ... by fsdp_pg_sync, two failures at two calls, oldest first. */
    g = spg_create(ctx, dummy, S);
    pg = &g->base;
    g->fail_kind = FSDP_COLL_ALL_GATHER;
    g->fail_nth = 2;
    g->queue_broken = 1;
    spg_hold(g, 1);
    int ok = 1;
    for (int i = 0; i < 3; i++) {
        ok &= fsdp_pg_all_gather(pg, a, b, 1, FSDP_DTYPE_F32, &w) == FSDP_OK;
        ok &= fsdp_work_wait_stream(w, S) == FSDP_OK;
        fsdp_work_release(w);
    }
    tap_ok(ok, "late: three stream waits on collectives still running are OK");
    spg_hold(g, 0);
    rc = fsdp_pg_sync(pg);
    tap_ok(rc == FSDP_EREMOTE && names_late(fsdp_pg_last_error(pg), "all_gather", 0) &&
               strstr(fsdp_pg_last_error(pg), "seq 1 "),
           "late: fsdp_pg_sync returns the oldest failure (all_gather seq 1), named");
    tap_diag("%s", fsdp_pg_last_error(pg));
    rc = fsdp_pg_sync(pg);
    tap_ok(rc == FSDP_EREMOTE && strstr(fsdp_pg_last_error(pg), "seq 2 "),
           "late: the next fsdp_pg_sync returns the next one (all_gather seq 2)");
    tap_is_int(fsdp_pg_sync(pg), FSDP_OK, "late: then nothing is left");
    fsdp_pg_destroy(pg);

    /* ... or, never asked for, logged when the group goes. */
    g = spg_create(ctx, dummy, S);
    pg = &g->base;
    g->fail_kind = FSDP_COLL_ALL_REDUCE;
    g->fail_nth = 1;
    fsdp_pg_all_reduce(pg, a, b, 1, FSDP_DTYPE_F32, FSDP_REDOP_SUM, &w);
    fsdp_work_wait_stream(w, S);
    fsdp_work_release(w);
    logged[0] = 0;
    fsdp_pg_destroy(pg);
    tap_ok(strstr(logged, "unreported failure") && names_late(logged, "all_reduce", 0),
           "late: a failure never reported is logged as an error by fsdp_pg_destroy");

    fsdp_pg_destroy(dummy);
    fsdp_ctx_destroy(ctx);
}

/* ---- the compute device S ----------------------------------------------------------------------
 */

typedef struct tev {
    uint64_t ticket; /* 0: never recorded */
    int rank;
} tev_t;

static struct fsdp_dev_ops s_ops;

static int s_rank(fsdp_device_t *dev) {
    return fsdp_ctx_rank(dev->ctx);
}

static int s_event_create(fsdp_device_t *dev, void **out) {
    tev_t *e = calloc(1, sizeof *e);
    if (!e) return FSDP_ENOMEM;
    e->rank = s_rank(dev);
    *out = e;
    return FSDP_OK;
}

static void s_event_destroy(fsdp_device_t *dev, void *ev) {
    (void)dev;
    free(ev);
}

static int s_event_record(fsdp_device_t *dev, void *ev, void *stream) {
    (void)stream;
    srank_t *s = &sr[s_rank(dev)];
    ((tev_t *)ev)->ticket = ++s->recorded;
    size_t listed = 0;
    for (size_t i = 0; s->root && i < s->root->nall; i++)
        listed += s->root->all[i]->ndeferred;
    if (listed > s->max_listed) s->max_listed = listed;
    return FSDP_OK;
}

static bool s_done(const tev_t *e) {
    const srank_t *s = &sr[e->rank];
    return e->ticket == 0 || e->ticket + LAG <= s->recorded || e->ticket <= s->synced;
}

static int s_event_query(fsdp_device_t *dev, void *ev) {
    (void)dev;
    tev_t *e = ev;
    if (s_done(e)) return 1;
    sr[e->rank].not_ready++;
    return 0;
}

static int s_event_sync(fsdp_device_t *dev, void *ev) {
    (void)dev;
    tev_t *e = ev;
    if (e->ticket > sr[e->rank].synced) sr[e->rank].synced = e->ticket; /* in stream order */
    return FSDP_OK;
}

static int s_event_wait(fsdp_device_t *dev, void *ev, void *stream) {
    (void)ev;
    if (stream) sr[s_rank(dev)].side_waits++;
    return FSDP_OK;
}

static void *s_compute_stream(fsdp_device_t *dev) {
    return &sr[s_rank(dev)].token;
}

/* Frees ptr, checking that no deferred buffer goes before its event completed. streams.c releases
 * a deferred buffer while it is still listed, so a listed match is the release itself. */
static void s_free(fsdp_device_t *dev, void *ptr) {
    srank_t *s = &sr[s_rank(dev)];
    fsdp_unit_t *root = s->root;
    for (size_t i = 0; root && i < root->nall; i++) {
        fsdp_unit_t *u = root->all[i];
        for (size_t k = 0; k < u->ndeferred; k++) {
            if (u->deferred[k].t->st->ptr != ptr) continue;
            s->deferred_frees++;
            if (fsdp__event_query(u->deferred[k].ev) != 1) s->early_frees++;
        }
    }
    fsdp__cpu_dev_ops.free(dev, ptr);
}

/* ---- FSDP: STREAM against BLOCK ------------------------------------------------------------- */

typedef struct sjob {
    fu_job_t base;
    int fail_kind, fail_nth; /* late-failure runs: what fails (-1: none) */
    const char *fail_name;
    const char *where; /* a phrase the message must contain, or NULL */
} sjob_t;

typedef struct result {
    double loss[STEPS];
    fu_vals_t params;
} result_t;

static int wrap_linears(fsdp_ctx_t *ctx, const sjob_t *j, fsdp_device_t *dev, fsdp_pg_t *pg,
                        fsdp_module_t **m, fsdp_unit_t **root) {
    static const char *const types[] = {"Linear", NULL};
    int rc = fu_linear_stack(ctx, NLIN, DIM, m);
    if (rc < 0) return rc;
    fsdp_options_t o;
    fu_job_options(&j->base, &o);
    o.device = dev;
    o.pg = pg;
    o.check_exec_order = false;
    return fu_wrap_types(*m, &o, types, root);
}

/* One forward and backward of step s; *loss_out the loss. */
static int fwd_bwd(fsdp_ctx_t *ctx, fsdp_module_t *m, int s, double *loss_out) {
    fsdp_tensor_t *x = NULL, *y = NULL, *loss = NULL;
    int rc = fu_rand_input(ctx, 100 + 10 * (uint64_t)s + (uint64_t)fsdp_ctx_rank(ctx), 3, DIM, &x);
    if (rc == 0) rc = fsdp_module_forward1(m, x, &y);
    if (rc == 0) rc = tm_sum_loss(y, &loss);
    if (rc == 0) rc = fsdp_tensor_item(loss, 0, loss_out);
    if (rc == 0) rc = fsdp_backward(loss, NULL);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(y);
    fsdp_tensor_release(x);
    return rc;
}

static bool no_deferred(const fsdp_unit_t *root) {
    for (size_t i = 0; i < root->nall; i++)
        if (root->all[i]->ndeferred) return false;
    return true;
}

static int train(fsdp_ctx_t *ctx, sjob_t *j, bool stream, result_t *res) {
    fu_res_t *r = fu_res_of(&j->base, ctx);
    int rk = fsdp_ctx_rank(ctx);
    fsdp_device_t *dev = NULL;
    spg_t *g = NULL;
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_optim_t *opt = NULL;
    int rc = FSDP_OK;
    memset(&sr[rk], 0, sizeof sr[rk]);
    FU_TRY(out, "creating the device", fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &dev));
    if (stream) {
        dev->ops = &s_ops;
        g = spg_create(ctx, fsdp_ctx_pg(ctx), &sr[rk].token);
        if (!g) FU_TRY(out, "creating the test group", FSDP_ENOMEM);
    }
    fsdp_pg_t *pg = stream ? &g->base : fsdp_ctx_pg(ctx);
    FU_TRY(out, "building and wrapping", wrap_linears(ctx, j, dev, pg, &m, &root));
    FU_TRY(out, "fsdp_ctx_set_device", fsdp_ctx_set_device(ctx, dev));
    FU_TRY(out, "SGD", fu_make_fsdp_sgd(ctx, root, 0.05, 0.9, &opt));
    fsdp_pg_reset_counters(pg);
    sr[rk].root = root;
    bool clean = true;
    for (int s = 0; s < STEPS; s++) {
        FU_TRY(out, "forward and backward", fwd_bwd(ctx, m, s, &res->loss[s]));
        clean &= no_deferred(root);
        FU_TRY(out, "step", fsdp_optim_step(opt));
        FU_TRY(out, "zero_grad", fsdp_optim_zero_grad(opt, true));
    }
    fsdp_pg_counters_t c = counters(pg);
    const fsdp_coll_kind_t kinds[3] = {FSDP_COLL_ALL_GATHER, FSDP_COLL_REDUCE_SCATTER,
                                       FSDP_COLL_ALL_REDUCE};
    const char *tag = stream ? "STREAM" : "BLOCK";
    char name[200], why[400] = "";
    bool ok = true;
    uint64_t total = 0;
    for (int k = 0; k < 3; k++) {
        fsdp_coll_kind_t kd = kinds[k];
        total += c.calls[kd];
        uint64_t want_stream = stream ? c.calls[kd] : 0, want_host = stream ? 0 : c.calls[kd];
        if (c.stream_waits[kd] != want_stream || c.host_waits[kd] != want_host ||
            (stream && g->ws_calls[kd] != c.calls[kd])) {
            ok = false;
            fu_add_why(why, sizeof why,
                       "%s: %llu calls, %llu stream waits (%llu reached the backend), %llu host "
                       "waits; ",
                       fsdp_coll_name(kd), (unsigned long long)c.calls[kd],
                       (unsigned long long)c.stream_waits[kd],
                       (unsigned long long)(stream ? g->ws_calls[kd] : 0),
                       (unsigned long long)c.host_waits[kd]);
        }
    }
    bool want_rs = fsdp__is_sharded(j->base.strategy);
    ok = ok && total > 0 && (c.calls[FSDP_COLL_REDUCE_SCATTER] > 0) == want_rs &&
         (c.calls[FSDP_COLL_ALL_GATHER] > 0) == want_rs;
    snprintf(name, sizeof name,
             stream ? "%s (F01): every all-gather and gradient reduction is waited on the compute "
                      "stream, none on the host"
                    : "%s: every collective is waited on the host (no compute stream)",
             tag);
    fu_ck(r, ok, name, "%s", why);
    if (stream) {
        fu_ck(r, g->ws_bad_stream == 0 && g->ws_done_before == 0,
              "STREAM: each stream wait names S's compute stream and comes before its collective "
              "completed (the host did not wait)",
              "%llu waits on another stream, %llu after completion",
              (unsigned long long)g->ws_bad_stream, (unsigned long long)g->ws_done_before);
        /* NO_SHARD reduces in place into what becomes the gradient: nothing of its goes. */
        fu_ck(r, sr[rk].early_frees == 0 && (sr[rk].deferred_frees > 0) == want_rs,
              "STREAM: buffers a collective read are freed only after the event recorded after "
              "its wait completed",
              "%llu of %llu freed early", (unsigned long long)sr[rk].early_frees,
              (unsigned long long)sr[rk].deferred_frees);
        if (j->base.mp.enabled) /* a staging buffer per all-gather: reaped at later waits */
            fu_ck(r, sr[rk].not_ready > 0,
                  "STREAM: a buffer whose event was pending was kept past a wait point",
                  "no query found a pending event");
        fu_ck(r, clean, "STREAM: no buffer is left waiting after a backward", "one is");
        fu_ck(r, sr[rk].posts == total && sr[rk].unordered == 0,
              "STREAM: each collective is issued after a side stream waited for the compute "
              "stream (the compute stream is held only where the result is used)",
              "%llu of %llu posts without such a wait", (unsigned long long)sr[rk].unordered,
              (unsigned long long)sr[rk].posts);
        /* Every wait reaps the whole tree: with events LAG records late, no more than LAG are
         * listed, where reaping only the waiting unit's list would keep every unit's staging
         * shard through the forward. */
        fu_ck(r, sr[rk].max_listed <= LAG,
              "STREAM: buffers whose events completed are released at the next wait of any unit",
              "%zu listed at once", sr[rk].max_listed);
    }
    FU_TRY(out, "reading the shards", sp_shard_values(root, &res->params));
out:
    sr[rk].root = NULL;
    fsdp_ctx_set_device(ctx, NULL);
    fsdp_optim_destroy(opt);
    fsdp_unit_destroy(root);
    fsdp_module_release(m);
    if (g) fsdp_pg_destroy(&g->base);
    fsdp_device_destroy(dev);
    return rc;
}

static int parity_rank(fsdp_ctx_t *ctx, void *arg) {
    sjob_t *j = arg;
    fu_res_t *r = fu_res_of(&j->base, ctx);
    result_t blk, str;
    memset(&blk, 0, sizeof blk);
    memset(&str, 0, sizeof str);
    int rc = train(ctx, j, false, &blk);
    if (rc == 0) rc = train(ctx, j, true, &str);
    if (rc == 0)
        sp_ck_bitwise_run(r, str.loss, blk.loss, STEPS, &str.params, &blk.params, "STREAM's",
                          "BLOCK's");
    fu_vals_free(&blk.params);
    fu_vals_free(&str.params);
    return rc;
}

/* ---- late failures inside FSDP --------------------------------------------------------------- */

static int late_rank(fsdp_ctx_t *ctx, void *arg) {
    sjob_t *j = arg;
    fu_res_t *r = fu_res_of(&j->base, ctx);
    int rk = fsdp_ctx_rank(ctx);
    fsdp_device_t *dev = NULL;
    spg_t *g = NULL;
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL;
    int rc = FSDP_OK;
    memset(&sr[rk], 0, sizeof sr[rk]);
    FU_TRY(out, "creating the device", fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &dev));
    dev->ops = &s_ops;
    g = spg_create(ctx, fsdp_ctx_pg(ctx), &sr[rk].token);
    if (!g) FU_TRY(out, "creating the test group", FSDP_ENOMEM);
    FU_TRY(out, "building and wrapping", wrap_linears(ctx, j, dev, &g->base, &m, &root));
    FU_TRY(out, "fsdp_ctx_set_device", fsdp_ctx_set_device(ctx, dev));
    g->fail_kind = j->fail_kind;
    g->fail_nth = j->fail_nth;
    double loss = 0;
    int got = fwd_bwd(ctx, m, 0, &loss);
    const char *msg = fsdp_ctx_last_error(ctx);
    char want[64], name[240];
    snprintf(want, sizeof want, "(rank %d)", rk);
    snprintf(name, sizeof name,
             "late: the failure of %s is reported by the step's forward or backward, naming the "
             "collective, the group and the rank",
             j->fail_name);
    fu_ck(r,
          got == FSDP_EREMOTE && strstr(msg, fsdp_coll_name((fsdp_coll_kind_t)j->fail_kind)) &&
              strstr(msg, "injected failure") && strstr(msg, want) &&
              strstr(msg, "'stream-test'") && (!j->where || strstr(msg, j->where)),
          name, "returned %d: %s", got, msg);
    fsdp_tape_clear(ctx);
out:
    fsdp_ctx_set_device(ctx, NULL);
    fsdp_unit_destroy(root);
    fsdp_module_release(m);
    if (g) fsdp_pg_destroy(&g->base);
    fsdp_device_destroy(dev);
    return rc;
}

int main(void) {
    s_ops = fsdp__cpu_dev_ops;
    s_ops.compute_stream = s_compute_stream;
    s_ops.event_create = s_event_create;
    s_ops.event_destroy = s_event_destroy;
    s_ops.event_record = s_event_record;
    s_ops.event_query = s_event_query;
    s_ops.event_sync = s_event_sync;
    s_ops.event_wait = s_event_wait;
    s_ops.free = s_free;
    tap_plan_lazy();
    api_checks();

    static sjob_t j; /* large: off the stack */
    static const struct {
        const char *title;
        fsdp_sharding_strategy_t s;
        bool bf16;
    } cases[] = {
        {"stream FULL_SHARD", FSDP_FULL_SHARD, false},
        {"stream SHARD_GRAD_OP", FSDP_SHARD_GRAD_OP, false},
        {"stream NO_SHARD", FSDP_NO_SHARD, false},
        {"stream FULL_SHARD bf16 params", FSDP_FULL_SHARD, true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fu_job_init(&j.base, cases[i].title, 2, cases[i].s, false);
        if (cases[i].bf16) {
            j.base.mp.enabled = true;
            j.base.mp.param_dtype = FSDP_DTYPE_BF16;
        }
        fu_run_job(&j.base, parity_rank);
    }
    static const struct {
        const char *title;
        int kind, nth;
        const char *where;
    } fails[] = {
        {"late first reduce_scatter", FSDP_COLL_REDUCE_SCATTER, 1, NULL},
        /* Nothing follows it: the end of backward reports it, after its stream wait. */
        {"late last reduce_scatter (end of backward)", FSDP_COLL_REDUCE_SCATTER, NLIN,
         "end of backward: reduce_scatter"},
        {"late second all_gather", FSDP_COLL_ALL_GATHER, 2, NULL},
    };
    for (size_t i = 0; i < sizeof fails / sizeof fails[0]; i++) {
        fu_job_init(&j.base, fails[i].title, 2, FSDP_FULL_SHARD, false);
        j.fail_kind = fails[i].kind;
        j.fail_nth = fails[i].nth;
        j.fail_name = fsdp_coll_name((fsdp_coll_kind_t)fails[i].kind);
        j.where = fails[i].where;
        fu_run_job(&j.base, late_rank);
    }
    return tap_done();
}
