/* SPDX-License-Identifier: MIT */
/*
 * sim_run.c: fsdp_sim_run(), the lifecycle of a simulated world.
 *
 * Start-up creates, for every rank, a context, a handle on the shared in-memory store, the world
 * group handle, and the rank's communication worker (src/pg/pg_worker.h), whose thread starts
 * once every rank is set up; then the rank threads run fn. When a rank's fn returns, its groups
 * are destroyed (which waits for its outstanding collectives), and only then is it marked exited,
 * so a peer blocked on it fails at once instead of at its timeout.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/cpus.h"
#include "core/timeutil.h"
#include "sim/sim.h"

#define MAX_WORLD 4096

static const fsdp__abi_struct_t sim_options_abi =
    FSDP__ABI_STRUCT(fsdp_sim_options_t, "fsdp_sim_options_init", comm_latency_us);

void(fsdp_sim_options_init)(fsdp_sim_options_t *opts, size_t size) {
    fsdp_sim_options_t d;
    memset(&d, 0, sizeof d);
    d.world_size = 1;
    fsdp__abi_init(opts, size, &d, &sim_options_abi);
}

static void *rank_main(void *arg) {
    sim_rank_t *self = arg;
    sim_world_t *w = self->world;
    fsdp__thread_name(pthread_self(), "fsdp-rank", self->index);
    self->status = w->fn(self->ctx, w->arg);
    fsdp__ctx_destroy_children(self->ctx, "rank exited");
    self->exit_status = self->status;
    atomic_store(&self->exited, 1);
    fsdp__sim_notify_exit(w, self->index);
    return NULL;
}

static int check_options(const fsdp_sim_options_t *o, fsdp_sim_fn fn) {
    if (!o || !fn) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "fsdp_sim_run: %s is NULL", o ? "fn" : "opts");
        return FSDP_EINVAL;
    }
    int rc = fsdp__abi_check(NULL, "fsdp_sim_run", "opts", o, &sim_options_abi);
    if (rc < 0) return rc;
    if (o->world_size < 1 || o->world_size > MAX_WORLD) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "fsdp_sim_run: world_size %d is outside [1, %d]",
                 o->world_size, MAX_WORLD);
        return FSDP_EINVAL;
    }
    if (o->timeout_ms < 0) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "fsdp_sim_run: timeout_ms %lld is negative",
                 (long long)o->timeout_ms);
        return FSDP_EINVAL;
    }
    /* The upper bound keeps the conversion to nanoseconds from overflowing (about an hour). */
    if (o->comm_latency_us < 0 || o->comm_latency_us > INT64_C(3600000000)) {
        fsdp_log(NULL, FSDP_LOG_ERROR,
                 "fsdp_sim_run: comm_latency_us %lld is outside [0, 3600000000]",
                 (long long)o->comm_latency_us);
        return FSDP_EINVAL;
    }
    if (o->nfaults > 0 && !o->faults) {
        fsdp_log(NULL, FSDP_LOG_ERROR, "fsdp_sim_run: faults is NULL with nfaults %zu",
                 o->nfaults);
        return FSDP_EINVAL;
    }
    for (size_t i = 0; i < o->nfaults; i++) {
        const fsdp_sim_fault_t *f = &o->faults[i];
        if (f->rank < 0 || f->rank >= o->world_size || (int)f->kind < 0 ||
            f->kind > FSDP_SIM_FAIL || f->delay_ms < 0) {
            fsdp_log(NULL, FSDP_LOG_ERROR,
                     "fsdp_sim_run: faults[%zu] (kind %d, rank %d, delay %lld ms) is invalid "
                     "for world size %d",
                     i, (int)f->kind, f->rank, (long long)f->delay_ms, o->world_size);
            return FSDP_EINVAL;
        }
    }
    return FSDP_OK;
}

int fsdp_sim_run(const fsdp_sim_options_t *opts, fsdp_sim_fn fn, void *arg, int *rank_status) {
    int rc = check_options(opts, fn);
    if (rc < 0) return rc;
    int n = opts->world_size;
    sim_world_t w;
    memset(&w, 0, sizeof w);
    w.size = n;
    w.faults = opts->faults;
    w.nfaults = opts->nfaults;
    w.latency_ns = opts->comm_latency_us * 1000;
    w.fn = fn;
    w.arg = arg;
    w.spin = n <= fsdp__cpu_count();
    pthread_mutex_init(&w.reg_mu, NULL);
    fsdp_store_t *store = NULL;
    pthread_t *threads = calloc((size_t)n, sizeof *threads);
    w.ranks = calloc((size_t)n, sizeof *w.ranks);
    int comm_started = 0, ranks_started = 0;
    if (!threads || !w.ranks) {
        rc = FSDP_ENOMEM;
        goto out;
    }
    FSDP_TRY(rc, out, fsdp_store_create_memory(NULL, &store));
    for (int r = 0; r < n; r++) {
        sim_rank_t *self = &w.ranks[r];
        self->world = &w;
        self->index = r;
        fsdp__pg_worker_init(&self->worker, fsdp__sim_execute, self);
        atomic_init(&self->exited, 0);
        fsdp_ctx_options_t co;
        fsdp_ctx_options_init(&co);
        co.rank = r;
        co.world_size = n;
        co.seed = opts->seed;
        FSDP_TRY(rc, out, fsdp_ctx_create(&co, &self->ctx));
        FSDP_TRY(rc, out, fsdp_store_clone(store, NULL, &self->store));
        fsdp_pg_t *pg = NULL;
        FSDP_TRY(rc, out, fsdp__sim_pg_create(&w, self->ctx, "world", n, r, NULL, &pg));
        if (opts->timeout_ms > 0) fsdp_pg_set_timeout(pg, opts->timeout_ms);
        fsdp__ctx_attach(self->ctx, pg, self->store);
    }
    for (; comm_started < n; comm_started++) {
        if (fsdp__pg_worker_start(&w.ranks[comm_started].worker, NULL) < 0) {
            fsdp_log(NULL, FSDP_LOG_ERROR, "fsdp_sim_run: cannot start thread %d of %d",
                     comm_started, n);
            rc = FSDP_ENOMEM;
            goto out;
        }
        fsdp__thread_name(w.ranks[comm_started].worker.thread, "fsdp-comm", comm_started);
    }
    for (; ranks_started < n; ranks_started++) {
        if (pthread_create(&threads[ranks_started], NULL, rank_main, &w.ranks[ranks_started])) {
            fsdp_log(NULL, FSDP_LOG_ERROR, "fsdp_sim_run: cannot start rank %d of %d",
                     ranks_started, n);
            rc = FSDP_ENOMEM;
            /* The ranks that never ran count as exited, so the others fail instead of hang. */
            for (int r = ranks_started; r < n; r++) {
                fsdp__ctx_destroy_children(w.ranks[r].ctx, NULL);
                w.ranks[r].exit_status = FSDP_ENOMEM;
                atomic_store(&w.ranks[r].exited, 1);
                fsdp__sim_notify_exit(&w, r);
            }
            break;
        }
    }
    for (int r = 0; r < ranks_started; r++) pthread_join(threads[r], NULL);
    if (ranks_started == n) {
        for (int r = 0; r < n; r++) {
            if (rank_status) rank_status[r] = w.ranks[r].status;
            if (rc == FSDP_OK && w.ranks[r].status < 0) rc = w.ranks[r].status;
        }
    }
out:
    if (w.ranks) {
        /* No rank runs any more, and each waited for its works: every queue is empty. */
        for (int r = 0; r < comm_started; r++)
            fsdp__pg_worker_stop(&w.ranks[r].worker);
        for (int r = 0; r < n; r++) {
            sim_rank_t *self = &w.ranks[r];
            fsdp_ctx_destroy(self->ctx);
            fsdp_store_destroy(self->store);
            if (self->world) fsdp__pg_worker_fini(&self->worker);
        }
    }
    fsdp_store_destroy(store);
    pthread_mutex_destroy(&w.reg_mu);
    free(w.ranks);
    free(threads);
    return rc;
}
