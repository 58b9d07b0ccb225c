/* SPDX-License-Identifier: MIT */
/*
 * pg.c: the process-group core: argument checking, sequence numbers, counters, work handles.
 *
 * Every public collective goes through check_args() and then fsdp__pg_issue(), so backends never
 * see a bad argument. Work handles are reference-counted (the caller's handle and the backend's)
 * and their state is guarded by their group's mutex; fsdp_pg_destroy() waits until no work of
 * the group is outstanding, which the backends bound by the group's timeout.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/reduce.h"
#include "core/timeutil.h"
#include "core/trace.h"
#include "pg/pg_impl.h"

static const char *const coll_names[FSDP_COLL_COUNT] = {
    "all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "all_to_all", "barrier"};

const char *fsdp_coll_name(fsdp_coll_kind_t kind) {
    return (int)kind >= 0 && kind < FSDP_COLL_COUNT ? coll_names[kind] : "invalid";
}

static int has_op(fsdp_coll_kind_t k) {
    return k == FSDP_COLL_REDUCE_SCATTER || k == FSDP_COLL_ALL_REDUCE || k == FSDP_COLL_REDUCE;
}

static int has_root(fsdp_coll_kind_t k) {
    return k == FSDP_COLL_BROADCAST || k == FSDP_COLL_REDUCE;
}

void fsdp__coll_describe(const fsdp_coll_t *c, char *buf, size_t cap) {
    int n;
    if (c->kind == FSDP_COLL_BARRIER) {
        snprintf(buf, cap, "barrier");
        return;
    }
    n = snprintf(buf, cap, "%s(%s, count=%zu", fsdp_coll_name(c->kind), fsdp_dtype_name(c->dtype),
                 c->count);
    if (n < 0 || (size_t)n >= cap) return;
    if (has_op(c->kind)) n += snprintf(buf + n, cap - (size_t)n, ", op=%s", fsdp_redop_name(c->op));
    if (n < 0 || (size_t)n >= cap) return;
    if (has_op(c->kind) && c->prescale != 0.0)
        n += snprintf(buf + n, cap - (size_t)n, ", prescale=%g", c->prescale);
    if (n < 0 || (size_t)n >= cap) return;
    if (has_root(c->kind)) n += snprintf(buf + n, cap - (size_t)n, ", root=%d", c->root);
    if (n < 0 || (size_t)n >= cap) return;
    snprintf(buf + n, cap - (size_t)n, ")");
}

static int late_report(fsdp_pg_t *pg, const fsdp_work_t *skip);

/* The size of a collective as the counters count it (nccl-tests' sizes, fsdp_pg_counters_t). */
static size_t coll_bytes(const fsdp_coll_t *c, int size) {
    if (c->kind == FSDP_COLL_BARRIER) return 0;
    size_t bytes = c->count * fsdp_dtype_size(c->dtype);
    if (c->kind == FSDP_COLL_ALL_GATHER || c->kind == FSDP_COLL_REDUCE_SCATTER ||
        c->kind == FSDP_COLL_ALL_TO_ALL)
        bytes *= (size_t)size;
    return bytes;
}

/* ---------------------------------------------------------------------------------------- */
/* Group base */

int fsdp__pg_check_world_args(fsdp_ctx_t *ctx, const char *fn, const fsdp_store_t *store,
                              fsdp_pg_t **out, int64_t timeout_ms, int64_t *timeout) {
    if (out) *out = NULL;
    if (!ctx) return FSDP_EINVAL;
    if (!store || !out)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s (rank %d of %d): %s is NULL", fn, ctx->rank,
                             ctx->world_size, store ? "out" : "store");
    if (timeout_ms < 0)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "%s (rank %d of %d): timeout_ms %lld is negative (0 means the "
                             "default, %d ms)",
                             fn, ctx->rank, ctx->world_size, (long long)timeout_ms,
                             FSDP_PG_DEFAULT_TIMEOUT_MS);
    *timeout = timeout_ms > 0 ? timeout_ms : FSDP_PG_DEFAULT_TIMEOUT_MS;
    return FSDP_OK;
}

/* A forgotten group, destroyed with its context. */
static void destroy_child(void *obj) {
    fsdp_pg_destroy(obj);
}

int fsdp__pg_init(fsdp_pg_t *pg, const struct fsdp_pg_ops *ops, fsdp_ctx_t *ctx, int rank, int size,
                  const int *world_ranks, const char *name) {
    pg->ops = ops;
    pg->rank = rank;
    pg->size = size;
    pg->ctx = ctx;
    pg->seq = 0;
    pg->timeout_ms = FSDP_PG_DEFAULT_TIMEOUT_MS;
    memset(&pg->counters, 0, sizeof pg->counters);
    pg->pending = 0;
    pg->late_head = pg->late_tail = NULL;
    pg->err[0] = 0;
    snprintf(pg->name, sizeof pg->name, "%s", name);
    pthread_mutex_init(&pg->issue_mu, NULL);
    pthread_mutex_init(&pg->mu, NULL);
    fsdp__cond_init(&pg->cv);
    memset(&pg->child, 0, sizeof pg->child);
    pg->ctx = NULL; /* registered below, once nothing can fail */
    pg->world_ranks = malloc((size_t)size * sizeof *pg->world_ranks);
    if (!pg->world_ranks) return FSDP_ENOMEM;
    for (int i = 0; i < size; i++)
        pg->world_ranks[i] = world_ranks ? world_ranks[i] : i;
    pg->ctx = ctx;
    if (ctx) {
        pg->child = (struct fsdp__ctx_child){
            .obj = pg, .what = "process group", .name = pg->name, .destroy = destroy_child};
        fsdp__ctx_add_child(ctx, &pg->child);
    }
    return FSDP_OK;
}

void fsdp__pg_fini(fsdp_pg_t *pg) {
    if (pg->ctx) fsdp__ctx_remove_child(pg->ctx, &pg->child);
    pthread_mutex_destroy(&pg->issue_mu);
    pthread_mutex_destroy(&pg->mu);
    pthread_cond_destroy(&pg->cv);
    free(pg->world_ranks);
    pg->world_ranks = NULL;
}

int fsdp__pg_err(fsdp_pg_t *pg, int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fsdp__verr(pg->err, rc, fmt, ap);
    va_end(ap);
    fsdp_log(pg->ctx, FSDP_LOG_DEBUG, "%s: %s", fsdp_err_name(rc), pg->err);
    return rc;
}

int fsdp_pg_rank(const fsdp_pg_t *pg) {
    return pg ? pg->rank : -1;
}

int fsdp_pg_size(const fsdp_pg_t *pg) {
    return pg ? pg->size : 0;
}

const char *fsdp_pg_name(const fsdp_pg_t *pg) {
    return pg ? pg->name : "(null)";
}

const char *fsdp_pg_backend(const fsdp_pg_t *pg) {
    return pg ? pg->ops->name : "(null)";
}

int fsdp_pg_world_rank(const fsdp_pg_t *pg, int group_rank) {
    if (!pg || group_rank < 0 || group_rank >= pg->size) return -1;
    return pg->world_ranks[group_rank];
}

uint64_t fsdp_pg_seq(const fsdp_pg_t *pg) {
    if (!pg) return 0;
    fsdp_pg_t *g = (fsdp_pg_t *)pg; /* locking its mutex does not change the group */
    pthread_mutex_lock(&g->issue_mu);
    uint64_t seq = g->seq;
    pthread_mutex_unlock(&g->issue_mu);
    return seq;
}

const char *fsdp_pg_last_error(const fsdp_pg_t *pg) {
    return pg ? pg->err : "no process group";
}

int fsdp_pg_set_timeout(fsdp_pg_t *pg, int64_t timeout_ms) {
    if (!pg) return FSDP_EINVAL;
    if (timeout_ms <= 0)
        return fsdp__pg_err(pg, FSDP_EINVAL, "fsdp_pg_set_timeout: timeout_ms %lld must be > 0",
                            (long long)timeout_ms);
    pg->timeout_ms = timeout_ms;
    return FSDP_OK;
}

int64_t fsdp_pg_timeout(const fsdp_pg_t *pg) {
    return pg ? pg->timeout_ms : 0;
}

void fsdp_pg_get_counters(const fsdp_pg_t *pg, fsdp_pg_counters_t *out) {
    if (!out) return;
    if (!pg) {
        memset(out, 0, sizeof *out);
        return;
    }
    fsdp_pg_t *g = (fsdp_pg_t *)pg; /* locking its mutex does not change the group */
    pthread_mutex_lock(&g->mu);
    *out = g->counters;
    pthread_mutex_unlock(&g->mu);
}

void fsdp_pg_reset_counters(fsdp_pg_t *pg) {
    if (!pg) return;
    pthread_mutex_lock(&pg->mu);
    memset(&pg->counters, 0, sizeof pg->counters);
    pthread_mutex_unlock(&pg->mu);
}

void fsdp_pg_destroy(fsdp_pg_t *pg) {
    if (!pg) return;
    pthread_mutex_lock(&pg->mu);
    while (pg->pending > 0)
        pthread_cond_wait(&pg->cv, &pg->mu);
    pthread_mutex_unlock(&pg->mu);
    /* Late failures nobody asked for are logged, never dropped silently. */
    while (late_report(pg, NULL) < 0)
        fsdp_log(pg->ctx, FSDP_LOG_ERROR, "fsdp_pg_destroy: unreported failure: %s", pg->err);
    pg->ops->destroy(pg);
}

/* ---------------------------------------------------------------------------------------- */
/* Argument checking */

/* Half-open byte ranges [a, a + an) and [b, b + bn) overlap. */
static int overlaps(const void *a, size_t an, const void *b, size_t bn) {
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return an > 0 && bn > 0 && x < y + bn && y < x + an;
}

static int check_args(fsdp_pg_t *pg, const fsdp_coll_t *c) {
    const char *what = fsdp_coll_name(c->kind);
    if (c->kind == FSDP_COLL_BARRIER) return FSDP_OK;
    if (!fsdp_dtype_valid((int)c->dtype))
        return fsdp__pg_err(pg, FSDP_EINVAL,
                            "fsdp_pg_%s on group '%s' (rank %d): dtype %d is invalid", what,
                            pg->name, pg->rank, (int)c->dtype);
    if (has_op(c->kind) && ((int)c->op < 0 || c->op >= FSDP_REDOP_COUNT))
        return fsdp__pg_err(pg, FSDP_EINVAL, "fsdp_pg_%s on group '%s' (rank %d): op %d is invalid",
                            what, pg->name, pg->rank, (int)c->op);
    if (has_op(c->kind) && !fsdp__redop_supported(c->dtype, c->op))
        return fsdp__pg_err(pg, FSDP_EINVAL,
                            "fsdp_pg_%s on group '%s' (rank %d): op %s is not defined on %s", what,
                            pg->name, pg->rank, fsdp_redop_name(c->op), fsdp_dtype_name(c->dtype));
    if (c->prescale != 0.0) {
        if (!has_op(c->kind) || c->op != FSDP_REDOP_SUM || !fsdp_dtype_is_float(c->dtype))
            return fsdp__pg_err(pg, FSDP_EINVAL,
                                "fsdp_pg_%s on group '%s' (rank %d): prescale %g needs a sum of "
                                "f16, bf16, f32 or f64 (this is op %s on %s)",
                                what, pg->name, pg->rank, c->prescale,
                                has_op(c->kind) ? fsdp_redop_name(c->op) : "none",
                                fsdp_dtype_name(c->dtype));
        if (!isfinite(c->prescale))
            return fsdp__pg_err(pg, FSDP_EINVAL,
                                "fsdp_pg_%s on group '%s' (rank %d): prescale %g is not finite",
                                what, pg->name, pg->rank, c->prescale);
    }
    if (has_root(c->kind) && (c->root < 0 || c->root >= pg->size))
        return fsdp__pg_err(pg, FSDP_EINVAL,
                            "fsdp_pg_%s on group '%s' (rank %d): root %d is outside [0, %d)", what,
                            pg->name, pg->rank, c->root, pg->size);
    size_t es = fsdp_dtype_size(c->dtype);
    size_t n = (size_t)pg->size;
    if (c->count > SIZE_MAX / es / n)
        return fsdp__pg_err(pg, FSDP_EINVAL,
                            "fsdp_pg_%s on group '%s' (rank %d): count %zu of %s times %zu ranks "
                            "overflows size_t",
                            what, pg->name, pg->rank, c->count, fsdp_dtype_name(c->dtype), n);
    if (c->count == 0) return FSDP_OK;
    size_t one = c->count * es;
    size_t send_bytes = one, recv_bytes = one;
    int need_send = 1, need_recv = 1;
    switch (c->kind) {
    case FSDP_COLL_ALL_GATHER:
        recv_bytes = one * n;
        break;
    case FSDP_COLL_REDUCE_SCATTER:
        send_bytes = one * n;
        break;
    case FSDP_COLL_ALL_TO_ALL:
        send_bytes = recv_bytes = one * n;
        break;
    case FSDP_COLL_BROADCAST:
        need_send = pg->rank == c->root;
        break;
    case FSDP_COLL_REDUCE:
        need_recv = pg->rank == c->root;
        break;
    default:
        break;
    }
    if (need_send && !c->send)
        return fsdp__pg_err(pg, FSDP_EINVAL,
                            "fsdp_pg_%s on group '%s' (rank %d): send is NULL with "
                            "count %zu",
                            what, pg->name, pg->rank, c->count);
    if (need_recv && !c->recv)
        return fsdp__pg_err(pg, FSDP_EINVAL,
                            "fsdp_pg_%s on group '%s' (rank %d): recv is NULL with "
                            "count %zu",
                            what, pg->name, pg->rank, c->count);
    if (!need_send || !need_recv) return FSDP_OK;
    /* The in-place positions NCCL allows; any other overlap would read what is being written. */
    const char *s = c->send;
    const char *r = c->recv;
    int in_place = 0;
    switch (c->kind) {
    case FSDP_COLL_ALL_GATHER:
        in_place = s == r + (size_t)pg->rank * one;
        break;
    case FSDP_COLL_REDUCE_SCATTER:
        in_place = r == s + (size_t)pg->rank * one;
        break;
    case FSDP_COLL_ALL_TO_ALL:
        in_place = 0;
        break;
    default:
        in_place = s == r;
        break;
    }
    if (!in_place && overlaps(s, send_bytes, r, recv_bytes)) {
        const char *where = c->kind == FSDP_COLL_ALL_GATHER       ? "send == recv + rank * count"
                            : c->kind == FSDP_COLL_REDUCE_SCATTER ? "recv == send + rank * count"
                            : c->kind == FSDP_COLL_ALL_TO_ALL     ? "no overlap at all"
                                                                  : "send == recv";
        return fsdp__pg_err(
            pg, FSDP_EINVAL,
            "fsdp_pg_%s on group '%s' (rank %d): send [%p, +%zu bytes) and recv [%p, "
            "+%zu bytes) overlap; the only overlap allowed is %s",
            what, pg->name, pg->rank, (const void *)s, send_bytes, (void *)r, recv_bytes, where);
    }
    return FSDP_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Works */

static void work_unref_locked(fsdp_work_t *w) {
    if (--w->refs == 0) free(w);
}

/*
 * Late failures (fsdp_work_wait_stream in pg.h). The late list holds the works waited on a
 * stream whose status nobody has seen. late_report() drops the completed ones that succeeded
 * and reports the oldest completed failure (except `skip`'s, whose waiter gets it directly):
 * the message goes to the group's last error, the work leaves the list, the status is returned.
 * A failure after it stays listed for the next blocking point. Works still running stay too.
 */
static void late_unlink_locked(fsdp_pg_t *pg, fsdp_work_t *prev, fsdp_work_t *w) {
    if (prev)
        prev->late_next = w->late_next;
    else
        pg->late_head = w->late_next;
    if (pg->late_tail == w) pg->late_tail = prev;
    w->late_next = NULL;
    w->late = 0;
    work_unref_locked(w);
}

static int late_report(fsdp_pg_t *pg, const fsdp_work_t *skip) {
    int rc = FSDP_OK;
    char desc[160], msg[FSDP_ERR_LEN];
    uint64_t seq = 0;
    pthread_mutex_lock(&pg->mu);
    fsdp_work_t *prev = NULL, *w = pg->late_head;
    while (w) {
        fsdp_work_t *next = w->late_next;
        if (w == skip || !w->done) {
            prev = w;
        } else if (w->status == FSDP_OK) {
            late_unlink_locked(pg, prev, w);
        } else {
            rc = w->status;
            seq = w->coll.seq;
            fsdp__coll_describe(&w->coll, desc, sizeof desc);
            memcpy(msg, w->err, sizeof msg);
            late_unlink_locked(pg, prev, w);
            break;
        }
        w = next;
    }
    pthread_mutex_unlock(&pg->mu);
    if (rc == FSDP_OK) return FSDP_OK;
    return fsdp__pg_err(pg, rc,
                        "%s seq %llu on group '%s' (rank %d) failed after a stream was made to "
                        "wait for it: %.1500s",
                        desc, (unsigned long long)seq, pg->name, pg->rank, msg);
}

void fsdp__work_complete(fsdp_work_t *w, int status, const char *fmt, ...) {
    fsdp_pg_t *pg = w->pg;
    if (w->trace_issued && fsdp__tracing(pg->ctx))
        fsdp__trace_coll(pg->ctx, fsdp_coll_name(w->coll.kind), pg->name, w->coll.seq,
                         coll_bytes(&w->coll, pg->size), w->trace_issued);
    if (status < 0 && fmt) {
        va_list ap;
        va_start(ap, fmt);
        fsdp__verr(w->err, status, fmt, ap);
        va_end(ap);
    }
    pthread_mutex_lock(&pg->mu);
    w->status = status;
    w->done = 1;
    pg->pending--;
    pthread_cond_broadcast(&pg->cv);
    work_unref_locked(w);
    pthread_mutex_unlock(&pg->mu);
}

static int work_wait(fsdp_work_t *w, int64_t timeout_ms, bool span);

int fsdp__pg_issue(fsdp_pg_t *pg, const fsdp_coll_t *c, fsdp_work_t **work) {
    /* A collective that failed after a stream wait fails this one: the group is broken. */
    int late = late_report(pg, NULL);
    if (late < 0) return late;
    fsdp_work_t *w = calloc(1, sizeof *w);
    if (!w) return fsdp__pg_err(pg, FSDP_ENOMEM, "out of memory for a work handle");
    w->pg = pg;
    w->coll = *c;
    w->coll.timeout_ms = pg->timeout_ms;
    w->refs = 2;
    w->sync = work == NULL;
    bool traced = fsdp__tracing(pg->ctx);
    /* A blocking call keeps the caller waiting from here to its completion. */
    if (traced && !work) fsdp__trace_begin(pg->ctx, FSDP__TRACE_WAIT, fsdp_coll_name(c->kind));
    pthread_mutex_lock(&pg->issue_mu);
    if (traced) w->trace_issued = fsdp__now_ns();
    w->coll.seq = pg->seq;
    pthread_mutex_lock(&pg->mu);
    pg->pending++;
    pthread_mutex_unlock(&pg->mu);
    int rc = pg->ops->post(pg, w);
    if (rc < 0) {
        pthread_mutex_unlock(&pg->issue_mu);
        pthread_mutex_lock(&pg->mu);
        pg->pending--;
        pthread_mutex_unlock(&pg->mu);
        free(w);
        if (traced && !work) fsdp__trace_end(pg->ctx, FSDP__TRACE_WAIT, fsdp_coll_name(c->kind));
        return rc;
    }
    pg->seq++;
    size_t bytes = coll_bytes(c, pg->size);
    pthread_mutex_lock(&pg->mu);
    pg->counters.calls[c->kind]++;
    pg->counters.bytes[c->kind] += bytes;
    pthread_mutex_unlock(&pg->mu);
    pthread_mutex_unlock(&pg->issue_mu);
    if (work) {
        *work = w;
        return FSDP_OK;
    }
    rc = work_wait(w, -1, false);
    fsdp_work_release(w);
    if (traced) fsdp__trace_end(pg->ctx, FSDP__TRACE_WAIT, fsdp_coll_name(c->kind));
    return rc;
}

static int issue(fsdp_pg_t *pg, fsdp_coll_t *c, fsdp_work_t **work) {
    if (work) *work = NULL;
    if (!pg) return FSDP_EINVAL;
    int rc = check_args(pg, c);
    if (rc < 0) return rc;
    return fsdp__pg_issue(pg, c, work);
}

/* fsdp_work_wait; `span`: a wait that blocks is a span of the caller's compute track when its
 * rank records a trace (the blocking form of a collective records its own, around the issue). */
static int work_wait(fsdp_work_t *w, int64_t timeout_ms, bool span) {
    fsdp_pg_t *pg = w->pg;
    struct timespec deadline = fsdp__deadline_ms(timeout_ms);
    pthread_mutex_lock(&pg->mu);
    const char *traced = NULL;
    if (span && !w->done && fsdp__tracing(pg->ctx)) {
        traced = fsdp_coll_name(w->coll.kind);
        pthread_mutex_unlock(&pg->mu);
        fsdp__trace_begin(pg->ctx, FSDP__TRACE_WAIT, traced);
        pthread_mutex_lock(&pg->mu);
    }
    while (!w->done) {
        if (timeout_ms < 0) {
            pthread_cond_wait(&pg->cv, &pg->mu);
        } else if (pthread_cond_timedwait(&pg->cv, &pg->mu, &deadline) != 0 && !w->done) {
            pthread_mutex_unlock(&pg->mu);
            if (traced) fsdp__trace_end(pg->ctx, FSDP__TRACE_WAIT, traced);
            char desc[160];
            fsdp__coll_describe(&w->coll, desc, sizeof desc);
            return fsdp__pg_err(
                pg, FSDP_ETIMEDOUT,
                "fsdp_work_wait: %s seq %llu on group '%s' (rank %d) has not completed "
                "after %lld ms; it is still outstanding",
                desc, (unsigned long long)w->coll.seq, pg->name, pg->rank, (long long)timeout_ms);
        }
    }
    int status = w->status;
    /* Its own status reaches the caller now: no later blocking point reports it again. */
    if (w->late) {
        fsdp_work_t *prev = NULL;
        for (fsdp_work_t *x = pg->late_head; x && x != w; x = x->late_next)
            prev = x;
        late_unlink_locked(pg, prev, w);
    }
    if ((unsigned)w->coll.kind < FSDP_COLL_COUNT) pg->counters.host_waits[w->coll.kind]++;
    pthread_mutex_unlock(&pg->mu);
    if (traced) fsdp__trace_end(pg->ctx, FSDP__TRACE_WAIT, traced);
    if (status < 0) {
        memcpy(pg->err, w->err, sizeof pg->err);
        fsdp_log(pg->ctx, FSDP_LOG_DEBUG, "%s: %s", fsdp_err_name(status), w->err);
        return status;
    }
    if (pg->ops->host_waited) pg->ops->host_waited(pg, w);
    return late_report(pg, w);
}

int fsdp_work_wait(fsdp_work_t *w, int64_t timeout_ms) {
    if (!w) return FSDP_EINVAL;
    return work_wait(w, timeout_ms, true);
}

int fsdp_work_wait_stream(fsdp_work_t *w, void *stream) {
    if (!w) return FSDP_EINVAL;
    fsdp_pg_t *pg = w->pg;
    if (!pg->ops->wait_stream) return fsdp_work_wait(w, -1);
    pthread_mutex_lock(&pg->mu);
    int status = w->done ? w->status : FSDP_OK;
    pthread_mutex_unlock(&pg->mu);
    if (status < 0) return fsdp_work_wait(w, -1); /* failed already: reported as by a wait */
    int rc = pg->ops->wait_stream(pg, w, stream);
    if (rc != FSDP_OK) {
        /* The stream cannot wait for this one: the host does, so the caller may reuse its
         * buffers as soon as this returns, as it would after a stream wait. */
        if (rc < 0)
            fsdp_log(pg->ctx, FSDP_LOG_WARN,
                     "fsdp_work_wait_stream on group '%s' (rank %d): %s; waiting on the host",
                     pg->name, pg->rank, pg->err);
        return fsdp_work_wait(w, -1);
    }
    pthread_mutex_lock(&pg->mu);
    if (!w->late) {
        w->late = 1;
        w->refs++;
        if (pg->late_tail)
            pg->late_tail->late_next = w;
        else
            pg->late_head = w;
        pg->late_tail = w;
    }
    if ((unsigned)w->coll.kind < FSDP_COLL_COUNT) pg->counters.stream_waits[w->coll.kind]++;
    pthread_mutex_unlock(&pg->mu);
    return FSDP_OK;
}

int fsdp_pg_sync(fsdp_pg_t *pg) {
    if (!pg) return FSDP_EINVAL;
    pthread_mutex_lock(&pg->mu);
    while (pg->pending > 0)
        pthread_cond_wait(&pg->cv, &pg->mu);
    pthread_mutex_unlock(&pg->mu);
    return late_report(pg, NULL);
}

int fsdp_work_test(fsdp_work_t *w, int *done) {
    if (!w || !done) return FSDP_EINVAL;
    pthread_mutex_lock(&w->pg->mu);
    *done = w->done;
    int status = w->done ? w->status : FSDP_OK;
    pthread_mutex_unlock(&w->pg->mu);
    if (status < 0) memcpy(w->pg->err, w->err, sizeof w->pg->err);
    return status;
}

const char *fsdp_work_error(const fsdp_work_t *w) {
    if (!w) return "no work";
    /* err is written before done is set under the lock; read it under the lock too. */
    fsdp_pg_t *pg = w->pg;
    pthread_mutex_lock(&pg->mu);
    const char *e = w->done ? w->err : "";
    pthread_mutex_unlock(&pg->mu);
    return e;
}

uint64_t fsdp_work_seq(const fsdp_work_t *w) {
    return w ? w->coll.seq : 0;
}

void fsdp_work_release(fsdp_work_t *w) {
    if (!w) return;
    fsdp_pg_t *pg = w->pg;
    pthread_mutex_lock(&pg->mu);
    work_unref_locked(w);
    pthread_mutex_unlock(&pg->mu);
}

/* ---------------------------------------------------------------------------------------- */
/* Public collectives */

int fsdp_pg_collective(fsdp_pg_t *pg, const fsdp_coll_desc_t *desc, fsdp_work_t **work) {
    if (work) *work = NULL;
    if (!pg) return FSDP_EINVAL;
    if (!desc) return fsdp__pg_err(pg, FSDP_EINVAL, "fsdp_pg_collective: desc is NULL");
    if ((int)desc->kind < 0 || desc->kind >= FSDP_COLL_COUNT)
        return fsdp__pg_err(pg, FSDP_EINVAL, "fsdp_pg_collective: kind %d is not a collective",
                            (int)desc->kind);
    fsdp_coll_t c = {.kind = desc->kind,
                     .send = desc->send,
                     .recv = desc->recv,
                     .count = desc->count,
                     .dtype = desc->kind == FSDP_COLL_BARRIER ? FSDP_DTYPE_U8 : desc->dtype,
                     .op = desc->op,
                     .prescale = desc->prescale,
                     .root = desc->root,
                     .stream = desc->stream};
    return issue(pg, &c, work);
}

int fsdp_pg_all_gather(fsdp_pg_t *pg, const void *send, void *recv, size_t count, fsdp_dtype_t dt,
                       fsdp_work_t **work) {
    fsdp_coll_t c = {
        .kind = FSDP_COLL_ALL_GATHER, .send = send, .recv = recv, .count = count, .dtype = dt};
    return issue(pg, &c, work);
}

int fsdp_pg_reduce_scatter(fsdp_pg_t *pg, const void *send, void *recv, size_t count,
                           fsdp_dtype_t dt, fsdp_redop_t op, fsdp_work_t **work) {
    fsdp_coll_t c = {.kind = FSDP_COLL_REDUCE_SCATTER,
                     .send = send,
                     .recv = recv,
                     .count = count,
                     .dtype = dt,
                     .op = op};
    return issue(pg, &c, work);
}

int fsdp_pg_all_reduce(fsdp_pg_t *pg, const void *send, void *recv, size_t count, fsdp_dtype_t dt,
                       fsdp_redop_t op, fsdp_work_t **work) {
    fsdp_coll_t c = {.kind = FSDP_COLL_ALL_REDUCE,
                     .send = send,
                     .recv = recv,
                     .count = count,
                     .dtype = dt,
                     .op = op};
    return issue(pg, &c, work);
}

int fsdp_pg_broadcast(fsdp_pg_t *pg, const void *send, void *recv, size_t count, fsdp_dtype_t dt,
                      int root, fsdp_work_t **work) {
    fsdp_coll_t c = {.kind = FSDP_COLL_BROADCAST,
                     .send = send,
                     .recv = recv,
                     .count = count,
                     .dtype = dt,
                     .root = root};
    return issue(pg, &c, work);
}

int fsdp_pg_reduce(fsdp_pg_t *pg, const void *send, void *recv, size_t count, fsdp_dtype_t dt,
                   fsdp_redop_t op, int root, fsdp_work_t **work) {
    fsdp_coll_t c = {.kind = FSDP_COLL_REDUCE,
                     .send = send,
                     .recv = recv,
                     .count = count,
                     .dtype = dt,
                     .op = op,
                     .root = root};
    return issue(pg, &c, work);
}

int fsdp_pg_all_to_all(fsdp_pg_t *pg, const void *send, void *recv, size_t count, fsdp_dtype_t dt,
                       fsdp_work_t **work) {
    fsdp_coll_t c = {
        .kind = FSDP_COLL_ALL_TO_ALL, .send = send, .recv = recv, .count = count, .dtype = dt};
    return issue(pg, &c, work);
}

int fsdp_pg_barrier(fsdp_pg_t *pg, fsdp_work_t **work) {
    fsdp_coll_t c = {.kind = FSDP_COLL_BARRIER, .dtype = FSDP_DTYPE_U8};
    return issue(pg, &c, work);
}
