/* SPDX-License-Identifier: MIT */
/*
 * pg_worker.c: the per-rank communication worker (see pg_worker.h for the ordering contract).
 *
 * Invariants: the slot (`busy`) is taken only under `mu`, and only when nothing is queued (by an
 * inline post) or by the worker's thread for the queue's head; whoever took it executes one work
 * and gives it back under `mu`. Only the worker's thread waits on `cv`, so one signal suffices:
 * an inline executor signals on giving the slot back when works were queued meanwhile, a post
 * signals when it queues. The thread exits only when stop is set and the queue is empty; a
 * queued work waits for the slot even then, so stopping never runs two works at once.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "pg/pg_worker.h"

void fsdp__thread_name(pthread_t t, const char *prefix, int index) {
#if defined(__linux__) && defined(__GLIBC__)
    char name[16];
    snprintf(name, sizeof name, "%s%d", prefix, index);
    (void)pthread_setname_np(t, name);
#else
    (void)t, (void)prefix, (void)index;
#endif
}

void fsdp__pg_worker_init(fsdp__pg_worker_t *wk, fsdp__pg_exec_fn exec, void *arg) {
    pthread_mutex_init(&wk->mu, NULL);
    pthread_cond_init(&wk->cv, NULL);
    wk->head = wk->tail = NULL;
    wk->busy = 0;
    wk->stop = 0;
    wk->started = 0;
    wk->exec = exec;
    wk->arg = arg;
}

static void *worker_main(void *arg) {
    fsdp__pg_worker_t *wk = arg;
    pthread_mutex_lock(&wk->mu);
    for (;;) {
        while ((!wk->head || wk->busy) && !(wk->stop && !wk->head))
            pthread_cond_wait(&wk->cv, &wk->mu);
        fsdp_work_t *w = wk->head;
        if (!w) break; /* stopped with an empty queue */
        wk->head = w->next;
        if (!wk->head) wk->tail = NULL;
        wk->busy = 1;
        pthread_mutex_unlock(&wk->mu);
        wk->exec(wk->arg, w, 0);
        pthread_mutex_lock(&wk->mu);
        wk->busy = 0; /* this thread is the only waiter: it looks at the queue next */
    }
    pthread_mutex_unlock(&wk->mu);
    return NULL;
}

int fsdp__pg_worker_start(fsdp__pg_worker_t *wk, const sigset_t *blocked) {
    sigset_t old;
    if (blocked) pthread_sigmask(SIG_BLOCK, blocked, &old); /* the new thread inherits it */
    int rc = pthread_create(&wk->thread, NULL, worker_main, wk);
    if (blocked) pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) return FSDP_ENOMEM;
    wk->started = 1;
    return FSDP_OK;
}

int fsdp__pg_worker_post(fsdp__pg_worker_t *wk, fsdp_work_t *w) {
    w->next = NULL;
    pthread_mutex_lock(&wk->mu);
    if (wk->stop) {
        pthread_mutex_unlock(&wk->mu);
        return FSDP_EINTERNAL;
    }
    if (w->sync && !wk->head && !wk->busy) {
        /* Nothing of this rank is queued or running: run it here. The worker's thread sees busy
         * and leaves what is queued meanwhile until the slot is given back. */
        wk->busy = 1;
        pthread_mutex_unlock(&wk->mu);
        wk->exec(wk->arg, w, 1);
        pthread_mutex_lock(&wk->mu);
        wk->busy = 0;
        if (wk->head) pthread_cond_signal(&wk->cv);
        pthread_mutex_unlock(&wk->mu);
        return FSDP_OK;
    }
    if (wk->tail)
        wk->tail->next = w;
    else
        wk->head = w;
    wk->tail = w;
    pthread_cond_signal(&wk->cv);
    pthread_mutex_unlock(&wk->mu);
    return FSDP_OK;
}

void fsdp__pg_worker_stop(fsdp__pg_worker_t *wk) {
    pthread_mutex_lock(&wk->mu);
    wk->stop = 1;
    pthread_cond_signal(&wk->cv);
    pthread_mutex_unlock(&wk->mu);
    if (wk->started) {
        pthread_join(wk->thread, NULL);
        wk->started = 0;
    }
}

void fsdp__pg_worker_fini(fsdp__pg_worker_t *wk) {
    pthread_mutex_destroy(&wk->mu);
    pthread_cond_destroy(&wk->cv);
}

/* ---------------------------------------------------------------------------------------- */
/* A worker shared by a rank's groups */

struct make_args {
    fsdp__pg_exec_fn exec;
    void *arg;
    const sigset_t *blocked;
};

/* Makes and starts the worker (under the context's lock, for the first group). */
static int make_worker(fsdp_ctx_t *ctx, void *arg, void **obj) {
    const struct make_args *m = arg;
    fsdp__pg_worker_t *wk = malloc(sizeof *wk);
    if (!wk) return FSDP_ENOMEM;
    fsdp__pg_worker_init(wk, m->exec, m->arg);
    int rc = fsdp__pg_worker_start(wk, m->blocked);
    if (rc < 0) {
        fsdp__pg_worker_fini(wk);
        free(wk);
        return rc;
    }
    fsdp__thread_name(wk->thread, "fsdp-comm", fsdp_ctx_rank(ctx));
    *obj = wk;
    return FSDP_OK;
}

int fsdp__pg_worker_acquire(fsdp_ctx_t *ctx, const void *key, fsdp__pg_exec_fn exec, void *arg,
                            const sigset_t *blocked, fsdp__pg_worker_t **out) {
    struct make_args m = {exec, arg, blocked};
    void *obj = NULL;
    int rc = fsdp__ctx_shared_acquire(ctx, key, make_worker, &m, &obj);
    *out = obj;
    return rc;
}

void fsdp__pg_worker_release(fsdp_ctx_t *ctx, const void *key, fsdp__pg_worker_t *wk) {
    if (!fsdp__ctx_shared_release(ctx, key)) return;
    fsdp__pg_worker_stop(wk);
    fsdp__pg_worker_fini(wk);
    free(wk);
}
