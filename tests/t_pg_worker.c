/* SPDX-License-Identifier: MIT */
/*
 * t_pg_worker.c: the per-rank communication worker (src/pg/pg_worker.h) on its own, with a fake
 * execute callback that records which work ran, on which thread, in which order, and whether
 * two ran at once.
 *
 * The contract under test is pg.h's "Completion" paragraph as the worker implements it for the
 * sim and gloo backends: a rank's collectives execute in the order the rank issued them, over
 * all its groups, like one CUDA stream (the stream semantics that seed behaviour F03, robustness
 * to asynchronous ordering, relies on, and SIMPG's asynchronous completion with a work handle).
 * In detail:
 *   - one execution slot: two works of one worker never execute at once;
 *   - FIFO: works execute in post order whatever their group; a queued work is never overtaken,
 *     not even by a blocking call posted while the slot is free;
 *   - a blocking work posted while nothing is queued or executing runs inline on the caller's
 *     thread; an asynchronous work, or one posted while the worker is busy, is queued and runs
 *     on the worker's thread, and a post never waits for another work;
 *   - a work posted while another executes (on the worker's thread or inline on another caller)
 *     waits until that one is done;
 *   - stop drains what is queued, returns at once on an empty queue, and refuses later posts;
 *   - many threads posting to one worker: each thread's works execute in its issue order, each
 *     exactly once, one at a time; several workers (ranks) run independently;
 *   - the context's shared worker: one per key, started with the asked signals blocked.
 * An alarm turns a deadlock into a failure.
 */
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <fsdp.h>

#include "core/timeutil.h"
#include "pg/pg_worker.h"
#include "tap.h"

/* How long a negative check ("has not started") watches, and how long a wait may take (a gate
 * opens by itself after that, so that a worker that runs a gated work on the wrong thread makes
 * checks fail instead of deadlocking the test). */
#define QUIET_MS 50
#define WAIT_MS 10000

/* ---------------------------------------------------------------------------------------- */
/* The fake backend */

typedef struct gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int open;
} gate_t;

static void gate_init(gate_t *g) {
    pthread_mutex_init(&g->mu, NULL);
    fsdp__cond_init(&g->cv);
    g->open = 0;
}

static void gate_open(gate_t *g) {
    pthread_mutex_lock(&g->mu);
    g->open = 1;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static void gate_pass(gate_t *g) {
    struct timespec deadline = fsdp__deadline_ms(WAIT_MS);
    pthread_mutex_lock(&g->mu);
    while (!g->open && pthread_cond_timedwait(&g->cv, &g->mu, &deadline) == 0) {
    }
    pthread_mutex_unlock(&g->mu);
}

static void gate_fini(gate_t *g) {
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
}

typedef struct fake_work {
    fsdp_work_t base; /* first: the worker sees only this */
    int group;        /* the "group" that posted it (the worker knows nothing of groups) */
    int id;           /* issue index within its group or thread */
    gate_t *gate;     /* when set, execution blocks until the gate opens */
    /* Written by the execute callback under the recorder's lock. */
    int started, done, on_caller, order;
    pthread_t thread;
    int sigpipe_blocked; /* SIGPIPE was blocked on the executing thread */
} fake_work_t;

/* Everything one worker executed. */
typedef struct recorder {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n;               /* works executed */
    fake_work_t **order; /* [cap]: the works in execution order */
    int cap;
    _Atomic int running;  /* works inside the callback now */
    _Atomic int overlaps; /* times a work started while another was running */
} recorder_t;

static void rec_init(recorder_t *r, int cap) {
    pthread_mutex_init(&r->mu, NULL);
    fsdp__cond_init(&r->cv); /* rec_wait's deadline is on CLOCK_MONOTONIC */
    r->n = 0;
    r->cap = cap;
    r->order = calloc((size_t)cap, sizeof *r->order);
    atomic_init(&r->running, 0);
    atomic_init(&r->overlaps, 0);
}

static void rec_fini(recorder_t *r) {
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r->order);
}

static void fake_exec(void *arg, fsdp_work_t *w, int on_caller) {
    recorder_t *r = arg;
    fake_work_t *fw = (fake_work_t *)w;
    if (atomic_fetch_add(&r->running, 1) != 0) atomic_fetch_add(&r->overlaps, 1);
    sigset_t cur;
    pthread_sigmask(SIG_BLOCK, NULL, &cur);
    pthread_mutex_lock(&r->mu);
    fw->started = 1;
    fw->on_caller = on_caller;
    fw->thread = pthread_self();
    fw->sigpipe_blocked = sigismember(&cur, SIGPIPE) == 1;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    if (fw->gate) gate_pass(fw->gate);
    /* A little work, so that queues build up behind it and races have room to show. */
    for (volatile int i = 0; i < 200; i++) {
    }
    atomic_fetch_sub(&r->running, 1);
    pthread_mutex_lock(&r->mu);
    fw->order = r->n;
    if (r->n < r->cap) r->order[r->n] = fw;
    r->n++;
    fw->done = 1;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

static void fw_init(fake_work_t *fw, int group, int id, int sync, gate_t *gate) {
    memset(fw, 0, sizeof *fw);
    fw->group = group;
    fw->id = id;
    fw->base.sync = sync;
    fw->gate = gate;
    fw->order = -1;
}

/* Waits until *flag (a field of a work, under r->mu) is set; 0 after WAIT_MS. */
static int rec_wait(recorder_t *r, const int *flag) {
    struct timespec deadline = fsdp__deadline_ms(WAIT_MS);
    int ok = 1;
    pthread_mutex_lock(&r->mu);
    while (!*flag && ok)
        ok = pthread_cond_timedwait(&r->cv, &r->mu, &deadline) == 0 || *flag;
    pthread_mutex_unlock(&r->mu);
    return ok;
}

static int rec_get(recorder_t *r, const int *field) {
    pthread_mutex_lock(&r->mu);
    int v = *field;
    pthread_mutex_unlock(&r->mu);
    return v;
}

/* Waits (up to WAIT_MS) until the worker has nothing queued and its slot is free: a work's
 * "done" flag is set inside its execution, a moment before the worker's thread lets go of the
 * slot. */
static int worker_idle(fsdp__pg_worker_t *wk) {
    int64_t deadline = fsdp__now_ns() + (int64_t)WAIT_MS * 1000000;
    for (;;) {
        pthread_mutex_lock(&wk->mu);
        int idle = !wk->busy && !wk->head;
        pthread_mutex_unlock(&wk->mu);
        if (idle) return 1;
        if (fsdp__now_ns() >= deadline) return 0;
        fsdp__sleep_ms(1);
    }
}

static int ran_on_thread(recorder_t *r, fake_work_t *fw, pthread_t t) {
    pthread_mutex_lock(&r->mu);
    int same = fw->started && pthread_equal(fw->thread, t);
    pthread_mutex_unlock(&r->mu);
    return same;
}

/* ---------------------------------------------------------------------------------------- */
/* Inline versus queued */

typedef struct poster {
    fsdp__pg_worker_t *wk;
    fake_work_t *fw;
    int rc;
} poster_t;

static void *post_main(void *arg) {
    poster_t *p = arg;
    p->rc = fsdp__pg_worker_post(p->wk, &p->fw->base);
    return NULL;
}

static void test_inline_and_queued(void) {
    recorder_t rec;
    fsdp__pg_worker_t wk;
    gate_t gate;
    rec_init(&rec, 16);
    gate_init(&gate);
    fsdp__pg_worker_init(&wk, fake_exec, &rec);
    tap_is_int(fsdp__pg_worker_start(&wk, NULL), FSDP_OK, "a worker starts");
    pthread_t me = pthread_self();

    /* A blocking work on an idle worker runs inline, before post returns. */
    fake_work_t a;
    fw_init(&a, 0, 0, 1, NULL);
    tap_is_int(fsdp__pg_worker_post(&wk, &a.base), FSDP_OK, "post of a blocking work");
    tap_ok(rec_get(&rec, &a.done) && a.on_caller == 1 && pthread_equal(a.thread, me),
           "a blocking work on an idle worker ran inline on the caller before post returned");

    /* An asynchronous work never runs inline, even on an idle worker. */
    fake_work_t b0;
    fw_init(&b0, 0, 1, 0, NULL);
    fsdp__pg_worker_post(&wk, &b0.base);
    tap_ok(rec_wait(&rec, &b0.done) && b0.on_caller == 0 && !pthread_equal(b0.thread, me),
           "an asynchronous work on an idle worker runs on the worker's thread");
    fake_work_t b;
    fw_init(&b, 0, 2, 0, &gate);
    fsdp__pg_worker_post(&wk, &b.base);
    tap_ok(!rec_get(&rec, &b.done), "post of an asynchronous work returns before it executed");
    tap_ok(rec_wait(&rec, &b.started) && b.on_caller == 0 && !pthread_equal(b.thread, me),
           "and it runs on the worker's thread");

    /* b holds the slot on the worker's thread: a blocking work is queued, not run inline. */
    fake_work_t c;
    fw_init(&c, 1, 0, 1, NULL);
    fsdp__pg_worker_post(&wk, &c.base);
    tap_ok(!rec_get(&rec, &c.started),
           "a blocking work posted while another executes is queued (post does not run it)");
    fsdp__sleep_ms(QUIET_MS);
    tap_ok(!rec_get(&rec, &c.started), "and it does not start while the other one executes");
    gate_open(&gate);
    tap_ok(rec_wait(&rec, &c.done), "it executes once the other one is done");
    tap_ok(b.order < c.order && c.on_caller == 0,
           "after it (order %d < %d), on the worker's thread (on_caller %d)", b.order, c.order,
           c.on_caller);

    /* A blocking work holds the slot inline on thread t: a work posted meanwhile by anyone waits
     * (the worker's thread must respect a slot held by another thread), and a blocking one
     * posted meanwhile is queued behind it. */
    gate_t g2;
    gate_init(&g2);
    fake_work_t d, e, f;
    fw_init(&d, 2, 0, 1, &g2);
    fw_init(&e, 0, 3, 0, NULL);
    fw_init(&f, 1, 1, 1, NULL);
    poster_t p = {&wk, &d, -1};
    pthread_t t;
    int idle = worker_idle(&wk);
    pthread_create(&t, NULL, post_main, &p);
    tap_ok(idle && rec_wait(&rec, &d.started) && ran_on_thread(&rec, &d, t) && d.on_caller == 1,
           "a blocking work posted by another thread on an idle worker runs inline there");
    fsdp__pg_worker_post(&wk, &e.base);
    fsdp__pg_worker_post(&wk, &f.base);
    tap_ok(!rec_get(&rec, &f.started),
           "a blocking work posted while another runs inline elsewhere is queued");
    fsdp__sleep_ms(QUIET_MS);
    tap_ok(!rec_get(&rec, &e.started) && !rec_get(&rec, &f.started),
           "the worker's thread leaves queued works alone while a caller holds the slot");
    gate_open(&g2);
    pthread_join(t, NULL);
    tap_is_int(p.rc, FSDP_OK, "the inline post returned FSDP_OK once its work was done");
    tap_ok(rec_wait(&rec, &e.done) && rec_wait(&rec, &f.done), "the queued works then execute");
    tap_ok(d.order < e.order && e.order < f.order && e.on_caller == 0 && f.on_caller == 0,
           "in post order (%d, %d, %d), on the worker's thread", d.order, e.order, f.order);
    tap_is_int(atomic_load(&rec.overlaps), 0, "no two works executed at once");

    fsdp__pg_worker_stop(&wk);
    fsdp__pg_worker_fini(&wk);
    gate_fini(&gate);
    gate_fini(&g2);
    rec_fini(&rec);
}

/* With works queued and the slot free (the thread has not started yet), a blocking call must
 * queue behind them instead of overtaking them inline. */
static void test_no_overtaking(void) {
    recorder_t rec;
    fsdp__pg_worker_t wk;
    rec_init(&rec, 8);
    fsdp__pg_worker_init(&wk, fake_exec, &rec);
    fake_work_t a, b, c;
    fw_init(&a, 0, 0, 0, NULL);
    fw_init(&b, 1, 0, 0, NULL);
    fw_init(&c, 2, 0, 1, NULL);
    fsdp__pg_worker_post(&wk, &a.base);
    fsdp__pg_worker_post(&wk, &b.base);
    fsdp__pg_worker_post(&wk, &c.base);
    tap_ok(!rec_get(&rec, &c.started),
           "a blocking work posted behind queued ones, with the slot free, is not run inline");
    tap_is_int(fsdp__pg_worker_start(&wk, NULL), FSDP_OK, "the worker starts after the posts");
    tap_ok(rec_wait(&rec, &c.done), "the queue executes");
    tap_ok(a.order == 0 && b.order == 1 && c.order == 2 && !c.on_caller,
           "in post order over three groups (%d, %d, %d), on the worker's thread", a.order, b.order,
           c.order);
    fsdp__pg_worker_stop(&wk);
    fsdp__pg_worker_fini(&wk);
    rec_fini(&rec);
}

/* ---------------------------------------------------------------------------------------- */
/* FIFO over several groups */

#define FIFO_N 400
#define FIFO_GROUPS 4

static void test_fifo_groups(void) {
    recorder_t rec;
    fsdp__pg_worker_t wk;
    rec_init(&rec, FIFO_N);
    fsdp__pg_worker_init(&wk, fake_exec, &rec);
    fsdp__pg_worker_start(&wk, NULL);
    fake_work_t *fw = calloc(FIFO_N, sizeof *fw);
    int next[FIFO_GROUPS] = {0};
    unsigned s = 12345;
    for (int i = 0; i < FIFO_N; i++) {
        s = s * 1103515245u + 12345u;
        int g = (int)((s >> 16) % FIFO_GROUPS);
        int sync = (s >> 8) % 7 == 0; /* a blocking call now and then, as FSDP mixes them */
        fw_init(&fw[i], g, next[g]++, sync, NULL);
        fsdp__pg_worker_post(&wk, &fw[i].base);
        if (sync) rec_wait(&rec, &fw[i].done); /* the core waits for a blocking call */
    }
    rec_wait(&rec, &fw[FIFO_N - 1].done);
    int in_order = 1, inl = 0, queued = 0, bad = -1;
    pthread_mutex_lock(&rec.mu);
    for (int i = 0; i < FIFO_N; i++) {
        if (fw[i].order != i && bad < 0) bad = i;
        in_order = in_order && fw[i].order == i;
        inl += fw[i].on_caller;
        queued += !fw[i].on_caller;
    }
    pthread_mutex_unlock(&rec.mu);
    tap_is_int(rec_get(&rec, &rec.n), FIFO_N, "%d works over %d groups all executed", FIFO_N,
               FIFO_GROUPS);
    tap_ok(in_order,
           "in post order across the groups (first out of place: %d; %d inline, %d "
           "on the worker's thread)",
           bad, inl, queued);
    tap_is_int(atomic_load(&rec.overlaps), 0, "one at a time");
    fsdp__pg_worker_stop(&wk);
    fsdp__pg_worker_fini(&wk);
    free(fw);
    rec_fini(&rec);
}

/* ---------------------------------------------------------------------------------------- */
/* Many threads, several workers (ranks) */

#define MT_RANKS 3
#define MT_THREADS 4
#define MT_N 300

typedef struct mt_thread {
    fsdp__pg_worker_t *wk;
    recorder_t *rec;
    fake_work_t *fw; /* [MT_N] */
    int index;
} mt_thread_t;

static void *mt_main(void *arg) {
    mt_thread_t *t = arg;
    unsigned s = 777u + (unsigned)t->index;
    for (int i = 0; i < MT_N; i++) {
        s = s * 1103515245u + 12345u;
        int sync = (s >> 8) % 5 == 0;
        fw_init(&t->fw[i], t->index, i, sync, NULL);
        fsdp__pg_worker_post(t->wk, &t->fw[i].base);
        if (sync) rec_wait(t->rec, &t->fw[i].done);
    }
    return NULL;
}

static void test_many_threads(void) {
    recorder_t rec[MT_RANKS];
    fsdp__pg_worker_t wk[MT_RANKS];
    mt_thread_t th[MT_RANKS][MT_THREADS];
    pthread_t tid[MT_RANKS][MT_THREADS];
    fake_work_t *fw = calloc((size_t)MT_RANKS * MT_THREADS * MT_N, sizeof *fw);
    for (int r = 0; r < MT_RANKS; r++) {
        rec_init(&rec[r], MT_THREADS * MT_N);
        fsdp__pg_worker_init(&wk[r], fake_exec, &rec[r]);
        fsdp__pg_worker_start(&wk[r], NULL);
    }
    for (int r = 0; r < MT_RANKS; r++)
        for (int k = 0; k < MT_THREADS; k++) {
            th[r][k] = (mt_thread_t){&wk[r], &rec[r], &fw[((size_t)r * MT_THREADS + k) * MT_N], k};
            pthread_create(&tid[r][k], NULL, mt_main, &th[r][k]);
        }
    for (int r = 0; r < MT_RANKS; r++)
        for (int k = 0; k < MT_THREADS; k++)
            pthread_join(tid[r][k], NULL);
    for (int r = 0; r < MT_RANKS; r++) {
        /* Stopping drains, so afterwards every work has executed. */
        fsdp__pg_worker_stop(&wk[r]);
        int total = rec[r].n, once = 1, ordered = 1, inl = 0;
        for (int k = 0; k < MT_THREADS; k++) {
            const fake_work_t *mine = th[r][k].fw;
            for (int i = 0; i < MT_N; i++) {
                once = once && mine[i].done && mine[i].order >= 0 && mine[i].order < total &&
                       rec[r].order[mine[i].order] == &mine[i];
                ordered = ordered && (i == 0 || mine[i - 1].order < mine[i].order);
                inl += mine[i].on_caller;
            }
        }
        tap_is_int(total, MT_THREADS * MT_N, "rank %d: %d threads posted %d works, all executed", r,
                   MT_THREADS, MT_THREADS * MT_N);
        tap_ok(once, "rank %d: each exactly once", r);
        tap_ok(ordered, "rank %d: each thread's works in its issue order (%d ran inline)", r, inl);
        tap_is_int(atomic_load(&rec[r].overlaps), 0, "rank %d: one at a time", r);
        fsdp__pg_worker_fini(&wk[r]);
        rec_fini(&rec[r]);
    }
    free(fw);
}

/* ---------------------------------------------------------------------------------------- */
/* Stop and drain */

static void *open_later(void *arg) {
    fsdp__sleep_ms(QUIET_MS);
    gate_open(arg);
    return NULL;
}

static void test_stop(void) {
    recorder_t rec;
    fsdp__pg_worker_t wk;
    rec_init(&rec, 8);

    fsdp__pg_worker_init(&wk, fake_exec, &rec);
    fsdp__pg_worker_stop(&wk);
    tap_ok(1, "stop of a worker that never started returns");
    fsdp__pg_worker_fini(&wk);

    fsdp__pg_worker_init(&wk, fake_exec, &rec);
    fsdp__pg_worker_start(&wk, NULL);
    int64_t t0 = fsdp__now_ns();
    fsdp__pg_worker_stop(&wk);
    tap_ok(!wk.started, "stop with an empty queue joins the thread (%lld us)",
           (long long)((fsdp__now_ns() - t0) / 1000));
    fsdp__pg_worker_stop(&wk);
    tap_ok(1, "a second stop is harmless");
    fake_work_t late;
    fw_init(&late, 0, 0, 1, NULL);
    tap_is_int(fsdp__pg_worker_post(&wk, &late.base), FSDP_EINTERNAL,
               "a post after stop is refused");
    tap_ok(!late.started, "and the work is not executed");
    fsdp__pg_worker_fini(&wk);

    /* Stop while a work executes and others are queued: they all execute first, in order. */
    gate_t gate;
    gate_init(&gate);
    fsdp__pg_worker_init(&wk, fake_exec, &rec);
    fsdp__pg_worker_start(&wk, NULL);
    fake_work_t fw[4];
    for (int i = 0; i < 4; i++) {
        fw_init(&fw[i], i % 2, i, 0, i == 0 ? &gate : NULL);
        fsdp__pg_worker_post(&wk, &fw[i].base);
    }
    rec_wait(&rec, &fw[0].started);
    pthread_t t;
    pthread_create(&t, NULL, open_later, &gate);
    fsdp__pg_worker_stop(&wk);
    int drained = 1;
    for (int i = 0; i < 4; i++)
        drained = drained && fw[i].done && fw[i].order == i;
    tap_ok(drained, "stop drains the queue in order before it returns");
    pthread_join(t, NULL);
    fsdp__pg_worker_fini(&wk);
    gate_fini(&gate);
    rec_fini(&rec);
}

/* ---------------------------------------------------------------------------------------- */
/* The context's shared worker */

static const char key_a, key_b;

static void test_shared(void) {
    fsdp_ctx_t *ctx = NULL;
    fsdp_ctx_options_t co;
    fsdp_ctx_options_init(&co);
    tap_is_int(fsdp_ctx_create(&co, &ctx), FSDP_OK, "context");
    recorder_t rec;
    rec_init(&rec, 8);
    sigset_t pipe_set, before, after;
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, NULL, &before);
    fsdp__pg_worker_t *w1 = NULL, *w2 = NULL, *w3 = NULL;
    tap_is_int(fsdp__pg_worker_acquire(ctx, &key_a, fake_exec, &rec, &pipe_set, &w1), FSDP_OK,
               "acquire makes the rank's worker");
    pthread_sigmask(SIG_BLOCK, NULL, &after);
    tap_is_int(sigismember(&after, SIGPIPE), sigismember(&before, SIGPIPE),
               "the caller's signal mask is unchanged");
    fsdp__pg_worker_acquire(ctx, &key_a, NULL, NULL, NULL, &w2);
    tap_ok(w1 && w1 == w2, "a second acquire under the same key shares it");
    fsdp__pg_worker_acquire(ctx, &key_b, fake_exec, &rec, NULL, &w3);
    tap_ok(w3 && w3 != w1, "another key has its own worker");
    fsdp__pg_worker_release(ctx, &key_b, w3);

    fsdp__pg_worker_release(ctx, &key_a, w1);
    fake_work_t a;
    fw_init(&a, 0, 0, 0, NULL);
    tap_is_int(fsdp__pg_worker_post(w2, &a.base), FSDP_OK, "still usable after one release");
    tap_ok(rec_wait(&rec, &a.done) && !a.on_caller && a.sigpipe_blocked,
           "its thread executes with the asked signal (SIGPIPE) blocked");
    fsdp__pg_worker_release(ctx, &key_a, w2);
    fsdp_ctx_destroy(ctx);
    rec_fini(&rec);
}

int main(void) {
    alarm(300); /* a deadlock fails the test instead of hanging it */
    tap_plan_lazy();
    test_inline_and_queued();
    test_no_overtaking();
    test_fifo_groups();
    test_many_threads();
    test_stop();
    test_shared();
    return tap_done();
}
