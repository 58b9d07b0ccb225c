/* SPDX-License-Identifier: MIT */
/*
 * sim_pg.c: collectives of the sim backend.
 *
 * Data moves directly between the ranks' own buffers, with no staging copy: after the arrive
 * barrier every rank can read every peer's descriptor. Work is split so that the ranks run in
 * parallel: in all-gather and all-to-all each rank fills its own receive buffer; in
 * reduce-scatter each rank reduces its own chunk; in all-reduce and reduce rank r reduces the
 * r-th slice of the buffer and writes it to every destination. Reductions go through
 * fsdp__reduce() in rank order, so results do not depend on timing.
 *
 * Invariants: a descriptor posted by rank q stays valid until q passes the depart barrier; the
 * depart barrier never times out, because once every rank has arrived nobody waits for anything
 * but memory copies. Only the arrive barrier can time out or see a dead peer, and a failure there
 * marks the group broken before anybody has touched a buffer.
 *
 * The simulated latency (fsdp_sim_options_t.comm_latency_us) is a sleep at the start of
 * execute(), on whichever thread executes the collective, before the arrive barrier: it delays
 * when the rank joins, never what is moved.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/copy.h"
#include "core/reduce.h"
#include "core/timeutil.h"
#include "sim/sim.h"

#ifdef __SSE2__
#include <emmintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

/* How long a barrier spins before it sleeps on the condition variable. */
#define SPIN_NS 50000

/* ---------------------------------------------------------------------------------------- */
/* Group shared state */

static void group_free(sim_group_t *g) {
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
    free(g->world_ranks);
    free(g->posted);
    free(g->posted_gen);
    free(g->posted_dev);
    free(g);
}

static sim_group_t *group_new(const char *name, int size, const int *world_ranks) {
    sim_group_t *g = calloc(1, sizeof *g);
    if (!g) return NULL;
    g->world_ranks = malloc((size_t)size * sizeof *g->world_ranks);
    g->posted = calloc((size_t)size, sizeof *g->posted);
    g->posted_gen = malloc((size_t)size * sizeof *g->posted_gen);
    g->posted_dev = calloc((size_t)size, sizeof *g->posted_dev);
    if (!g->world_ranks || !g->posted || !g->posted_gen || !g->posted_dev) {
        free(g->world_ranks);
        free(g->posted);
        free(g->posted_gen);
        free(g->posted_dev);
        free(g);
        return NULL;
    }
    snprintf(g->name, sizeof g->name, "%s", name);
    g->size = size;
    for (int i = 0; i < size; i++) {
        g->world_ranks[i] = world_ranks ? world_ranks[i] : i;
        g->posted_gen[i] = UINT64_MAX;
    }
    g->mismatch_gen = 0;
    atomic_init(&g->arrive_gen, 0);
    atomic_init(&g->depart_gen, 0);
    pthread_mutex_init(&g->mu, NULL);
    fsdp__cond_init(&g->cv);
    return g;
}

/* ---------------------------------------------------------------------------------------- */
/* Barriers */

/* Marks the group broken (the caller holds g->mu) and wakes everybody. */
static void break_group(sim_group_t *g, int rc, const char *reason) {
    if (g->broken) return;
    g->broken = 1;
    g->broken_rc = rc;
    snprintf(g->reason, sizeof g->reason, "%s", reason);
    pthread_cond_broadcast(&g->cv);
}

/* Lists the members that have not posted for generation gen ("1, 3"). */
static void missing_ranks(const sim_group_t *g, uint64_t gen, char *buf, size_t cap) {
    size_t n = 0;
    buf[0] = 0;
    for (int q = 0; q < g->size && n + 16 < cap; q++)
        if (g->posted_gen[q] != gen)
            n += (size_t)snprintf(buf + n, cap - n, "%s%d", n ? ", " : "", q);
}

/* Fills g->mismatch when the posted descriptors disagree; returns 1 then. */
static int check_mismatch(sim_group_t *g) {
    const fsdp_coll_t *a = g->posted[0];
    int bad = 0;
    for (int q = 1; q < g->size && !bad; q++) {
        const fsdp_coll_t *b = g->posted[q];
        bad = a->kind != b->kind || a->seq != b->seq;
        if (!bad && a->kind != FSDP_COLL_BARRIER)
            bad = a->dtype != b->dtype || a->count != b->count;
        if (!bad && (a->kind == FSDP_COLL_REDUCE_SCATTER || a->kind == FSDP_COLL_ALL_REDUCE ||
                     a->kind == FSDP_COLL_REDUCE))
            bad = a->op != b->op || a->prescale != b->prescale;
        if (!bad && (a->kind == FSDP_COLL_BROADCAST || a->kind == FSDP_COLL_REDUCE))
            bad = a->root != b->root;
    }
    /* The ranks' buffers must all be host memory or all be memory of devices of one kind. */
    int dev_bad = 0;
    for (int q = 1; q < g->size && !bad && !dev_bad; q++) {
        const fsdp_device_t *d0 = g->posted_dev[0], *dq = g->posted_dev[q];
        dev_bad = (d0 == NULL) != (dq == NULL) || (d0 && dq && d0->kind != dq->kind);
    }
    if (dev_bad) {
        size_t n = (size_t)snprintf(g->mismatch, sizeof g->mismatch,
                                    "ranks of group '%s' keep their buffers in different memory "
                                    "(fsdp_sim_pg_set_device):",
                                    g->name);
        for (int q = 0; q < g->size && n < sizeof g->mismatch; q++)
            n += (size_t)snprintf(g->mismatch + n, sizeof g->mismatch - n, "%s rank %d: %s",
                                  q ? ";" : "", q,
                                  g->posted_dev[q] ? fsdp_device_name(g->posted_dev[q]) : "host");
        return 1;
    }
    if (!bad) return 0;
    size_t n = (size_t)snprintf(g->mismatch, sizeof g->mismatch,
                                "ranks of group '%s' issued different collectives:", g->name);
    for (int q = 0; q < g->size && n < sizeof g->mismatch; q++) {
        char d[160];
        fsdp__coll_describe(g->posted[q], d, sizeof d);
        n += (size_t)snprintf(g->mismatch + n, sizeof g->mismatch - n, "%s rank %d: %s seq %llu",
                              q ? ";" : "", q, d, (unsigned long long)g->posted[q]->seq);
    }
    return 1;
}

/* With the group's lock released, spins for at most SPIN_NS while *gen_p still reads gen (only
 * when the world has a CPU per rank). The caller takes the lock again and re-checks. */
static void spin_while(const sim_world_t *w, _Atomic uint64_t *gen_p, uint64_t gen) {
    if (!w->spin) return;
    int64_t end = fsdp__now_ns() + SPIN_NS;
    for (unsigned i = 1; atomic_load_explicit(gen_p, memory_order_acquire) == gen; i++) {
        if ((i & 63) == 0 && fsdp__now_ns() > end) return;
        CPU_RELAX();
    }
}

/*
 * Posts rank r's descriptor and waits for every member. Returns FSDP_OK when all arrived with
 * matching calls; otherwise a failure with its message in msg.
 */
static int arrive(sim_world_t *w, sim_group_t *g, int r, const fsdp_coll_t *c,
                  fsdp_device_t *dev, char *msg) {
    struct timespec deadline = fsdp__deadline_ms(c->timeout_ms);
    char d[160];
    int rc = FSDP_OK;
    pthread_mutex_lock(&g->mu);
    if (g->broken) {
        rc = fsdp__err(msg, FSDP_EREMOTE, "group '%s' was aborted by an earlier failure: %s",
                       g->name, g->reason);
        goto out;
    }
    uint64_t gen = atomic_load(&g->arrive_gen);
    g->posted[r] = c;
    g->posted_gen[r] = gen;
    g->posted_dev[r] = dev;
    if (++g->arrived == g->size) {
        g->arrived = 0;
        if (check_mismatch(g)) g->mismatch_gen = gen + 1;
        atomic_store(&g->arrive_gen, gen + 1);
        pthread_cond_broadcast(&g->cv);
    } else {
        pthread_mutex_unlock(&g->mu);
        spin_while(w, &g->arrive_gen, gen);
        pthread_mutex_lock(&g->mu);
        while (atomic_load(&g->arrive_gen) == gen && !g->broken) {
            /* A member that exited without posting will never come. */
            for (int q = 0; q < g->size; q++) {
                sim_rank_t *peer = &w->ranks[g->world_ranks[q]];
                if (g->posted_gen[q] != gen && atomic_load(&peer->exited)) {
                    char reason[FSDP_ERR_LEN];
                    fsdp__coll_describe(c, d, sizeof d);
                    snprintf(reason, sizeof reason,
                             "rank %d of group '%s' (world rank %d) exited with status %s "
                             "without joining %s seq %llu",
                             q, g->name, g->world_ranks[q], fsdp_err_name(peer->exit_status), d,
                             (unsigned long long)c->seq);
                    break_group(g, FSDP_EREMOTE, reason);
                    break;
                }
            }
            if (g->broken) break;
            if (pthread_cond_timedwait(&g->cv, &g->mu, &deadline) != 0 &&
                atomic_load(&g->arrive_gen) == gen && !g->broken) {
                char missing[256], reason[FSDP_ERR_LEN];
                missing_ranks(g, gen, missing, sizeof missing);
                fsdp__coll_describe(c, d, sizeof d);
                snprintf(reason, sizeof reason,
                         "timed out after %lld ms in %s seq %llu on group '%s': rank(s) %s did "
                         "not join",
                         (long long)c->timeout_ms, d, (unsigned long long)c->seq, g->name,
                         missing);
                break_group(g, FSDP_ETIMEDOUT, reason);
            }
        }
        if (atomic_load(&g->arrive_gen) == gen) {
            rc = fsdp__err(msg, g->broken_rc, "%s", g->reason);
            goto out;
        }
    }
    if (g->mismatch_gen == gen + 1) rc = fsdp__err(msg, FSDP_EMISMATCH, "%s", g->mismatch);
out:
    pthread_mutex_unlock(&g->mu);
    return rc;
}

static void depart(const sim_world_t *w, sim_group_t *g) {
    pthread_mutex_lock(&g->mu);
    uint64_t gen = atomic_load(&g->depart_gen);
    if (++g->departed == g->size) {
        g->departed = 0;
        atomic_store(&g->depart_gen, gen + 1);
        pthread_cond_broadcast(&g->cv);
    } else {
        pthread_mutex_unlock(&g->mu);
        spin_while(w, &g->depart_gen, gen);
        pthread_mutex_lock(&g->mu);
        while (atomic_load(&g->depart_gen) == gen) pthread_cond_wait(&g->cv, &g->mu);
    }
    pthread_mutex_unlock(&g->mu);
}

/* ---------------------------------------------------------------------------------------- */
/* Data movement */

/* Rank r's slice [lo, hi) of count elements split over n ranks. */
static void slice(size_t count, int n, int r, size_t *lo, size_t *hi) {
    size_t base = count / (size_t)n, rem = count % (size_t)n;
    *lo = (size_t)r * base + ((size_t)r < rem ? (size_t)r : rem);
    *hi = *lo + base + ((size_t)r < rem ? 1 : 0);
}

/*
 * The data moves through host memory (dev NULL: memcpy and fsdp__reduce) or, when the rank's
 * group has a device, through that device: its memcpy (device to device; every rank of a run
 * shares the process, so a rank's thread reads its peers' device buffers directly) and its
 * coll_reduce, both on the device's compute stream and synchronous, so the data is in place when
 * they return.
 */
static int copy(fsdp_device_t *dev, void *dst, const void *src, size_t bytes) {
    if (!bytes || dst == src) return FSDP_OK;
    if (!dev) {
        fsdp__copy_large(dst, src, bytes);
        return FSDP_OK;
    }
    return dev->ops->memcpy(dev, dst, src, bytes, FSDP_COPY_D2D, NULL);
}

static int reduce(fsdp_device_t *dev, void *const *outs, int nout, const void *const *ins,
                  int nin, size_t n, const fsdp_coll_t *c, int divisor) {
    if (!dev) return fsdp__reduce(outs, nout, ins, nin, n, c->dtype, c->op, divisor, c->prescale);
    return dev->ops->coll_reduce(dev, c->dtype, c->op, divisor, c->prescale, outs, nout, ins, nin,
                                 n, NULL);
}

/* Moves rank r's share of the data; every descriptor in g->posted is valid. */
static int move_data(sim_group_t *g, int r, char *msg) {
    enum { MAXN = 64 };
    const fsdp_coll_t *me = g->posted[r];
    fsdp_device_t *dev = g->posted_dev[r];
    int n = g->size;
    size_t es = fsdp_dtype_size(me->dtype);
    size_t bytes = me->count * es;
    if (me->kind == FSDP_COLL_BARRIER || me->count == 0) return FSDP_OK;
    const void *ins_small[MAXN];
    void *outs_small[MAXN];
    const void **ins = ins_small;
    void **outs = outs_small;
    int rc = FSDP_OK;
    if (n > MAXN) {
        ins = malloc((size_t)n * sizeof *ins);
        outs = malloc((size_t)n * sizeof *outs);
        if (!ins || !outs) {
            rc = fsdp__err(msg, FSDP_ENOMEM, "sim: out of memory for %d rank pointers", n);
            goto out;
        }
    }
    size_t lo, hi;
    switch (me->kind) {
    case FSDP_COLL_ALL_GATHER:
        for (int q = 0; q < n && rc == FSDP_OK; q++)
            rc = copy(dev, (char *)me->recv + (size_t)q * bytes, g->posted[q]->send, bytes);
        break;
    case FSDP_COLL_ALL_TO_ALL:
        for (int q = 0; q < n && rc == FSDP_OK; q++)
            rc = copy(dev, (char *)me->recv + (size_t)q * bytes,
                      (const char *)g->posted[q]->send + (size_t)r * bytes, bytes);
        break;
    case FSDP_COLL_BROADCAST:
        rc = copy(dev, me->recv, g->posted[me->root]->send, bytes);
        break;
    case FSDP_COLL_REDUCE_SCATTER:
        for (int q = 0; q < n; q++) ins[q] = (const char *)g->posted[q]->send + (size_t)r * bytes;
        outs[0] = me->recv;
        rc = reduce(dev, outs, 1, ins, n, me->count, me, n);
        break;
    case FSDP_COLL_ALL_REDUCE:
    case FSDP_COLL_REDUCE:
        slice(me->count, n, r, &lo, &hi);
        if (hi == lo) break;
        for (int q = 0; q < n; q++) ins[q] = (const char *)g->posted[q]->send + lo * es;
        if (me->kind == FSDP_COLL_REDUCE) {
            /* Only the root's recv exists (non-roots may pass NULL). */
            outs[0] = (char *)g->posted[me->root]->recv + lo * es;
            rc = reduce(dev, outs, 1, ins, n, hi - lo, me, n);
        } else {
            for (int q = 0; q < n; q++) outs[q] = (char *)g->posted[q]->recv + lo * es;
            rc = reduce(dev, outs, n, ins, n, hi - lo, me, n);
        }
        break;
    default:
        break;
    }
    if (rc < 0 && dev) {
        char d[160];
        fsdp__coll_describe(me, d, sizeof d);
        fsdp__err(msg, rc, "sim: rank %d of group '%s' could not move the data of %s on %s (%s)",
                  r, g->name, d, fsdp_device_name(dev), fsdp_err_name(rc));
    } else if (rc < 0) {
        fsdp__err(msg, rc, "sim: out of memory while reducing");
    }
out:
    if (ins != ins_small) free(ins);
    if (outs != outs_small) free(outs);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* Execution, in the rank's worker (on its thread or inline on the caller's) */

static const fsdp_sim_fault_t *find_fault(const sim_world_t *w, int rank, uint64_t call,
                                          fsdp_sim_fault_kind_t kind) {
    for (size_t i = 0; i < w->nfaults; i++) {
        const fsdp_sim_fault_t *f = &w->faults[i];
        if (f->rank == rank && f->call == call && f->kind == kind) return f;
    }
    return NULL;
}

/* Sleeps ns nanoseconds on CLOCK_MONOTONIC. An absolute deadline makes a sleep interrupted by
 * a signal resume for the rest of the time only, and never return early. */
static void sleep_ns(int64_t ns) {
    int64_t end = fsdp__now_ns() + ns;
    struct timespec ts = {.tv_sec = (time_t)(end / 1000000000),
                          .tv_nsec = (long)(end % 1000000000)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) != 0) {
        if (fsdp__now_ns() >= end) break; /* only EINTR is possible here; be safe anyway */
    }
}

void fsdp__sim_execute(void *arg, fsdp_work_t *work, int on_caller) {
    sim_rank_t *self = arg;
    sim_pg_t *sp = (sim_pg_t *)work->pg;
    sim_world_t *w = sp->world;
    sim_group_t *g = sp->grp;
    const fsdp_coll_t *c = &work->coll;
    /* The core's own exchanges (c->host) use host memory even on a group with a device. */
    fsdp_device_t *dev = c->host ? NULL : sp->dev;
    int r = sp->base.rank;
    uint64_t call = self->calls++;
    char msg[FSDP_ERR_LEN], d[160];
    const fsdp_sim_fault_t *f;
    (void)on_caller; /* the same on either thread */

    /* The simulated latency comes first, so that it delays every collective, failing ones too. */
    if (w->latency_ns > 0) sleep_ns(w->latency_ns);
    if ((f = find_fault(w, self->index, call, FSDP_SIM_DELAY_BEFORE)))
        fsdp__sleep_ms(f->delay_ms);
    if (find_fault(w, self->index, call, FSDP_SIM_FAIL)) {
        char reason[FSDP_ERR_LEN];
        fsdp__coll_describe(c, d, sizeof d);
        snprintf(reason, sizeof reason,
                 "rank %d of group '%s' (world rank %d) failed %s seq %llu: injected fault on "
                 "its collective #%llu",
                 r, g->name, self->index, d, (unsigned long long)c->seq,
                 (unsigned long long)call);
        pthread_mutex_lock(&g->mu);
        break_group(g, FSDP_EREMOTE, reason);
        pthread_mutex_unlock(&g->mu);
        fsdp__work_complete(work, FSDP_EBACKEND, "%s", reason);
        return;
    }
    /* The rank's earlier device work (what wrote its send buffer, what reads its recv buffer)
     * completes before any peer touches its buffers. */
    if (dev) {
        int src = dev->ops->stream_sync(dev, NULL);
        if (src < 0) {
            char reason[FSDP_ERR_LEN];
            fsdp__coll_describe(c, d, sizeof d);
            snprintf(reason, sizeof reason,
                     "rank %d of group '%s' (world rank %d) failed %s seq %llu: its device %s "
                     "could not synchronize (%s)",
                     r, g->name, self->index, d, (unsigned long long)c->seq,
                     fsdp_device_name(dev), fsdp_err_name(src));
            pthread_mutex_lock(&g->mu);
            break_group(g, FSDP_EREMOTE, reason);
            pthread_mutex_unlock(&g->mu);
            fsdp__work_complete(work, src, "%s", reason);
            return;
        }
    }
    int rc = arrive(w, g, r, c, dev, msg);
    if (rc == FSDP_OK) {
        rc = move_data(g, r, msg);
        depart(w, g);
    }
    if ((f = find_fault(w, self->index, call, FSDP_SIM_DELAY_AFTER))) fsdp__sleep_ms(f->delay_ms);
    if (rc < 0) {
        fsdp_log(sp->base.ctx, FSDP_LOG_DEBUG, "sim: %s", msg);
        fsdp__work_complete(work, rc, "%s", msg);
    } else {
        fsdp__work_complete(work, FSDP_OK, NULL);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* The backend */

static int sim_post(fsdp_pg_t *pg, fsdp_work_t *work) {
    sim_pg_t *sp = (sim_pg_t *)pg;
    sim_rank_t *self = &sp->world->ranks[pg->world_ranks[pg->rank]];
    int rc = fsdp__pg_worker_post(&self->worker, work);
    if (rc < 0)
        return fsdp__pg_err(pg, rc, "sim: rank %d's worker has stopped (group '%s')", self->index,
                            pg->name);
    return FSDP_OK;
}

static int sim_create_subgroup(fsdp_pg_t *parent, const int *members, int n, int new_rank,
                               const char *name, fsdp_pg_t **out) {
    sim_pg_t *sp = (sim_pg_t *)parent;
    int *world_ranks = malloc((size_t)n * sizeof *world_ranks);
    if (!world_ranks) return fsdp__err(parent->err, FSDP_ENOMEM, "sim: out of memory");
    for (int i = 0; i < n; i++) world_ranks[i] = parent->world_ranks[members[i]];
    int rc = fsdp__sim_pg_create(sp->world, parent->ctx, name, n, new_rank, world_ranks, out);
    free(world_ranks);
    if (rc < 0) return fsdp__err(parent->err, rc, "sim: cannot create group '%s'", name);
    ((sim_pg_t *)*out)->dev = sp->dev; /* a sub-group keeps its buffers where its parent does */
    return FSDP_OK;
}

static void sim_destroy(fsdp_pg_t *pg) {
    sim_pg_t *sp = (sim_pg_t *)pg;
    sim_world_t *w = sp->world;
    sim_group_t *g = sp->grp;
    pthread_mutex_lock(&w->reg_mu);
    int last = --g->refs == 0;
    if (last) {
        for (sim_group_t **p = &w->groups; *p; p = &(*p)->next)
            if (*p == g) {
                *p = g->next;
                break;
            }
    }
    pthread_mutex_unlock(&w->reg_mu);
    if (last) group_free(g);
    fsdp__pg_fini(pg);
    free(sp);
}

static const struct fsdp_pg_ops sim_ops = {
    .name = "sim",
    .post = sim_post,
    .create_subgroup = sim_create_subgroup,
    .destroy = sim_destroy,
};

int fsdp__sim_pg_create(sim_world_t *w, fsdp_ctx_t *ctx, const char *name, int size, int rank,
                        const int *world_ranks, fsdp_pg_t **out) {
    sim_pg_t *sp = calloc(1, sizeof *sp);
    if (!sp) return FSDP_ENOMEM;
    /* Find the shared state the first member created, or create it. A group leaves the lookup
     * once all its members attached, so a name can never match a finished group. */
    pthread_mutex_lock(&w->reg_mu);
    sim_group_t *g = w->groups;
    while (g && !(strcmp(g->name, name) == 0 && g->attached < g->size)) g = g->next;
    if (!g) {
        g = group_new(name, size, world_ranks);
        if (!g) {
            pthread_mutex_unlock(&w->reg_mu);
            free(sp);
            return FSDP_ENOMEM;
        }
        g->next = w->groups;
        w->groups = g;
    }
    g->attached++;
    g->refs++;
    pthread_mutex_unlock(&w->reg_mu);
    sp->world = w;
    sp->grp = g;
    int rc = fsdp__pg_init(&sp->base, &sim_ops, ctx, rank, size, world_ranks, name);
    if (rc < 0) {
        sim_destroy(&sp->base);
        return rc;
    }
    *out = &sp->base;
    return FSDP_OK;
}

void fsdp__sim_notify_exit(sim_world_t *w, int r) {
    pthread_mutex_lock(&w->reg_mu);
    for (sim_group_t *g = w->groups; g; g = g->next) {
        for (int q = 0; q < g->size; q++) {
            if (g->world_ranks[q] != r) continue;
            pthread_mutex_lock(&g->mu);
            pthread_cond_broadcast(&g->cv);
            pthread_mutex_unlock(&g->mu);
            break;
        }
    }
    pthread_mutex_unlock(&w->reg_mu);
}

int fsdp_sim_pg_set_device(fsdp_pg_t *pg, fsdp_device_t *dev) {
    if (!pg || pg->ops != &sim_ops) {
        fsdp_log(pg ? pg->ctx : NULL, FSDP_LOG_ERROR,
                 "fsdp_sim_pg_set_device: pg is %s, not a group of the sim backend",
                 pg ? pg->ops->name : "NULL");
        return FSDP_EINVAL;
    }
    if (dev && dev->ctx != pg->ctx)
        return fsdp__pg_err(pg, FSDP_EINVAL,
                            "fsdp_sim_pg_set_device: device %s belongs to another context than "
                            "rank %d's group '%s'",
                            fsdp_device_name(dev), pg->rank, pg->name);
    pthread_mutex_lock(&pg->mu);
    size_t pending = pg->pending;
    pthread_mutex_unlock(&pg->mu);
    if (pending)
        return fsdp__pg_err(pg, FSDP_EINVAL,
                            "fsdp_sim_pg_set_device: rank %d's group '%s' has %zu outstanding "
                            "collective(s); wait for them first",
                            pg->rank, pg->name, pending);
    ((sim_pg_t *)pg)->dev = dev;
    return FSDP_OK;
}

fsdp_device_t *fsdp_sim_pg_device(const fsdp_pg_t *pg) {
    return pg && pg->ops == &sim_ops ? ((const sim_pg_t *)pg)->dev : NULL;
}
