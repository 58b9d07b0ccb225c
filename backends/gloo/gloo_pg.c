/* SPDX-License-Identifier: MIT */
/*
 * gloo_pg.c: the gloo process group: the vtable, the rank's worker, failures and the mismatch
 * check. The transports are behind gloo_comm.h (Gloo over TCP, in C++) and gloo_shm.h (shared
 * memory, for a group whose ranks all run on one host; it carries the collectives whenever the
 * group has it, and the Gloo comm then serves the mismatch check).
 *
 * Threads and ordering. pg.h requires that a rank's collectives execute in the order the rank
 * issued them, over all its groups. Every context that has Gloo groups gets one communication
 * worker (src/pg/pg_worker.h: a queue, an execution slot and a thread, held by the context as a
 * shared state under rank_key) for all those groups; whoever holds the slot runs one collective
 * at a time (execute()), on the group's own Gloo context, and a blocking call runs on the
 * caller's thread when the worker is idle. One worker per rank rather than one per group plus a
 * rank-wide ticket: the ticket would make per-group workers wait for each other anyway, so they
 * would only add threads.
 *
 * Everything a collective touches in a gloo_pg (the sticky failure, the comm) is used only by
 * the slot's holder, and the slot passes between threads under the worker's mutex, so no other
 * locking is needed. The worker never touches a work or its group after completing it: the
 * group may be destroyed as soon as its last work completes.
 *
 * SIGPIPE. Gloo writes with writev(), which raises SIGPIPE when a peer has reset its connection,
 * and SIGPIPE kills the process by default. The library leaves process-wide dispositions alone;
 * instead, every thread that may write on a Gloo socket runs with SIGPIPE blocked, so the write
 * fails with EPIPE and Gloo reports it: the worker and Gloo's event-loop threads for good (they
 * are created while their creator blocks it, and inherit the mask), the caller's thread only
 * while it runs a collective or a rendezvous, consuming a SIGPIPE it raised before unblocking.
 */
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <fsdp/gloo.h>

#include "backends/gloo/gloo_comm.h"
#include "backends/gloo/gloo_mesh.h"
#include "backends/gloo/gloo_shm.h"
#include "core/timeutil.h"
#include "pg/pg_impl.h"
#include "pg/pg_worker.h"

typedef struct gloo_pg {
    fsdp_pg_t base;
    fsdp__pg_worker_t *worker; /* the rank's, shared by its Gloo groups */
    fsdp_gloo_comm_t *comm;
    fsdp_gloo_shm_t *shm; /* NULL: the collectives go over TCP */
    fsdp_store_t *store; /* "gloo.<world number>" on the user's store; sub-groups clone it */
    int check;           /* FSDP_GLOO_CHECK: exchange descriptors before each collective */
    /* Where the group's ranks listen, and the job's key their connections prove (gloo_mesh.h);
     * sub-groups take both from their parent. */
    struct sockaddr_storage addr;
    socklen_t addrlen;
    uint8_t key[FSDP_GLOO_KEY_BYTES];
    /* Sticky failure (0: none) and its message; used only in the execution slot. */
    int broken_rc;
    char broken_msg[FSDP_ERR_LEN];
} gloo_pg_t;

/* An EREMOTE that comes after the collective has waited this fraction of its timeout is
 * reported as a timeout: see fail(). */
#define REMOTE_AS_TIMEOUT_NUM 3
#define REMOTE_AS_TIMEOUT_DEN 4

/* ---------------------------------------------------------------------------------------- */
/* SIGPIPE */

typedef struct sigpipe_guard {
    sigset_t old;
    int pending_before;
} sigpipe_guard_t;

static void sigpipe_block(sigpipe_guard_t *g) {
    sigset_t set, pending;
    sigemptyset(&set);
    sigaddset(&set, SIGPIPE);
    sigpending(&pending);
    g->pending_before = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &set, &g->old);
}

/* Restores the mask, first consuming a SIGPIPE raised since sigpipe_block() when the thread had
 * it unblocked (it would be delivered, and kill, on unblocking). */
static void sigpipe_restore(sigpipe_guard_t *g) {
    sigset_t set, pending;
    sigemptyset(&set);
    sigaddset(&set, SIGPIPE);
    sigpending(&pending);
    if (!g->pending_before && sigismember(&pending, SIGPIPE) == 1 &&
        sigismember(&g->old, SIGPIPE) == 0) {
        const struct timespec zero = {0, 0};
        while (sigtimedwait(&set, NULL, &zero) < 0 && errno == EINTR) {
        }
    }
    pthread_sigmask(SIG_SETMASK, &g->old, NULL);
}

/* ---------------------------------------------------------------------------------------- */
/* Failures */

static int has_op(fsdp_coll_kind_t k) {
    return k == FSDP_COLL_REDUCE_SCATTER || k == FSDP_COLL_ALL_REDUCE || k == FSDP_COLL_REDUCE;
}

static int has_root(fsdp_coll_kind_t k) {
    return k == FSDP_COLL_BROADCAST || k == FSDP_COLL_REDUCE;
}

/*
 * Completes w with a transport failure, marks the group broken and, unless the failure is a
 * timeout, closes the group's connections so that peers blocked on this rank fail at once
 * (after a timeout Gloo has already closed them).
 *
 * When a peer times out first it closes its connections, and a rank that was waiting on it sees
 * a closed connection a moment before its own timeout. If the collective had already waited for
 * REMOTE_AS_TIMEOUT_NUM / REMOTE_AS_TIMEOUT_DEN of its timeout, that closure is reported as the
 * timeout it almost certainly is, so that every rank that joined reports FSDP_ETIMEDOUT.
 */
static void fail(gloo_pg_t *gp, fsdp_work_t *w, int rc, int peer, const char *why,
                 int64_t waited_ms) {
    const fsdp_coll_t *c = &w->coll;
    fsdp_pg_t *pg = &gp->base;
    char desc[160], who[160], host[64], msg[FSDP_ERR_LEN];
    fsdp__coll_describe(c, desc, sizeof desc);
    who[0] = 0;
    if (peer >= 0 && peer < pg->size) {
        fsdp__gloo_comm_peer_host(gp->comm, peer, host, sizeof host);
        snprintf(who, sizeof who, "peer rank %d (world rank %d%s%s)", peer, pg->world_ranks[peer],
                 host[0] ? ", host " : "", host);
    }
    if (rc == FSDP_EREMOTE &&
        waited_ms * REMOTE_AS_TIMEOUT_DEN >= c->timeout_ms * REMOTE_AS_TIMEOUT_NUM) {
        fsdp__err(msg, FSDP_ETIMEDOUT,
                  "timed out after %lld ms in %s seq %llu on group '%s' (rank %d): %s closed its "
                  "connection after waiting as long (gloo: %s)",
                  (long long)c->timeout_ms, desc, (unsigned long long)c->seq, pg->name, pg->rank,
                  who[0] ? who : "a peer", why);
        rc = FSDP_ETIMEDOUT;
    } else if (rc == FSDP_ETIMEDOUT) {
        fsdp__err(msg, rc,
                  "timed out after %lld ms in %s seq %llu on group '%s' (rank %d): a peer did "
                  "not join or stalled (gloo: %s)",
                  (long long)c->timeout_ms, desc, (unsigned long long)c->seq, pg->name, pg->rank,
                  why);
    } else if (rc == FSDP_EREMOTE) {
        fsdp__err(msg, rc,
                  "%s seq %llu on group '%s' (rank %d): %s failed or closed its connection "
                  "(gloo: %s)",
                  desc, (unsigned long long)c->seq, pg->name, pg->rank, who[0] ? who : "a peer",
                  why);
    } else {
        fsdp__err(msg, rc, "%s seq %llu on group '%s' (rank %d) failed: %s", desc,
                  (unsigned long long)c->seq, pg->name, pg->rank, why);
    }
    gp->broken_rc = rc;
    memcpy(gp->broken_msg, msg, sizeof msg);
    if (rc != FSDP_ETIMEDOUT) {
        fsdp__gloo_comm_close(gp->comm);
        fsdp__gloo_shm_close(gp->shm);
    }
    fsdp_log(pg->ctx, FSDP_LOG_DEBUG, "gloo: %s: %s", fsdp_err_name(rc), msg);
    fsdp__work_complete(w, rc, "%s", msg);
}

/* ---------------------------------------------------------------------------------------- */
/* The mismatch check (FSDP_GLOO_CHECK=1) */

enum { DESC_KIND, DESC_COUNT, DESC_DTYPE, DESC_OP, DESC_ROOT, DESC_SEQ, DESC_PRESCALE, DESC_LEN };

static void describe_desc(const int64_t *d, char *buf, size_t cap) {
    fsdp_coll_t c;
    memset(&c, 0, sizeof c);
    c.kind = (fsdp_coll_kind_t)d[DESC_KIND];
    c.count = (size_t)d[DESC_COUNT];
    c.dtype = (fsdp_dtype_t)d[DESC_DTYPE];
    c.op = (fsdp_redop_t)d[DESC_OP];
    c.root = (int)d[DESC_ROOT];
    memcpy(&c.prescale, &d[DESC_PRESCALE], sizeof c.prescale); /* its bits, as exchanged */
    fsdp__coll_describe(&c, buf, cap);
}

/*
 * All-gathers every rank's descriptor of w's collective. Returns FSDP_OK when they agree,
 * FSDP_EMISMATCH with every rank's call in msg when they do not (every rank sees the same
 * descriptors, so all fail alike), or the transport's failure with *peer and Gloo's reason.
 */
static int check_descriptors(gloo_pg_t *gp, const fsdp_coll_t *c, int *peer, char *msg,
                             size_t cap) {
    fsdp_pg_t *pg = &gp->base;
    int64_t mine[DESC_LEN] = {c->kind, 0, -1, -1, -1, (int64_t)c->seq, 0};
    if (c->kind != FSDP_COLL_BARRIER) {
        mine[DESC_COUNT] = (int64_t)c->count;
        mine[DESC_DTYPE] = c->dtype;
    }
    if (has_op(c->kind)) {
        mine[DESC_OP] = c->op;
        memcpy(&mine[DESC_PRESCALE], &c->prescale, sizeof c->prescale);
    }
    if (has_root(c->kind)) mine[DESC_ROOT] = c->root;
    int64_t *all = malloc((size_t)pg->size * sizeof mine);
    if (!all) {
        snprintf(msg, cap, "out of memory for the descriptors of %d ranks", pg->size);
        return FSDP_ENOMEM;
    }
    fsdp_gloo_op_t op = {.kind = FSDP_COLL_ALL_GATHER,
                         .send = mine,
                         .recv = all,
                         .count = DESC_LEN,
                         .dtype = FSDP_DTYPE_I64,
                         .tag = (uint32_t)c->seq,
                         .timeout_ms = c->timeout_ms};
    int rc = fsdp__gloo_comm_run(gp->comm, &op, peer, msg, cap);
    if (rc < 0) goto out;
    int same = 1;
    for (int q = 0; q < pg->size && same; q++)
        same = memcmp(&all[(size_t)q * DESC_LEN], mine, sizeof mine) == 0;
    if (same) goto out;
    rc = FSDP_EMISMATCH;
    size_t n =
        (size_t)snprintf(msg, cap, "ranks of group '%s' issued different collectives:", pg->name);
    for (int q = 0; q < pg->size && n < cap; q++) {
        char d[160];
        const int64_t *dq = &all[(size_t)q * DESC_LEN];
        describe_desc(dq, d, sizeof d);
        n += (size_t)snprintf(msg + n, cap - n, "%s rank %d: %s seq %lld", q ? ";" : "", q, d,
                              (long long)dq[DESC_SEQ]);
    }
out:
    free(all);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* Execution */

static void execute(fsdp_work_t *w) {
    gloo_pg_t *gp = (gloo_pg_t *)w->pg;
    fsdp_pg_t *pg = &gp->base;
    const fsdp_coll_t *c = &w->coll;
    char why[FSDP_ERR_LEN], desc[160];
    int peer = -1, rc;

    if (gp->broken_rc < 0) {
        fsdp__coll_describe(c, desc, sizeof desc);
        fsdp__work_complete(w, gp->broken_rc,
                            "%s seq %llu on group '%s' (rank %d) was not run: the group failed "
                            "earlier: %s",
                            desc, (unsigned long long)c->seq, pg->name, pg->rank, gp->broken_msg);
        return;
    }
    int64_t t0 = fsdp__now_ns();
    if (gp->check) {
        rc = check_descriptors(gp, c, &peer, why, sizeof why);
        if (rc == FSDP_EMISMATCH) {
            fsdp_log(pg->ctx, FSDP_LOG_DEBUG, "gloo: %s", why);
            fsdp__work_complete(w, rc, "%s", why);
            return;
        }
        if (rc < 0) {
            fail(gp, w, rc, peer, why, (fsdp__now_ns() - t0) / 1000000);
            return;
        }
    }
    if (c->count == 0 && c->kind != FSDP_COLL_BARRIER) {
        fsdp__work_complete(w, FSDP_OK, NULL);
        return;
    }
    fsdp_gloo_op_t op = {.kind = c->kind,
                         .send = c->send,
                         .recv = c->recv,
                         .count = c->count,
                         .dtype = c->dtype,
                         .op = c->op,
                         .prescale = c->prescale,
                         .root = c->root,
                         .tag = (uint32_t)c->seq,
                         .timeout_ms = c->timeout_ms};
    rc = gp->shm ? fsdp__gloo_shm_run(gp->shm, &op, &peer, why, sizeof why)
                 : fsdp__gloo_comm_run(gp->comm, &op, &peer, why, sizeof why);
    if (rc < 0)
        fail(gp, w, rc, peer, why, (fsdp__now_ns() - t0) / 1000000);
    else
        fsdp__work_complete(w, FSDP_OK, NULL);
}

/* The worker's execute callback. On the caller's thread (a blocking call run inline) SIGPIPE is
 * blocked only meanwhile; the worker's thread has it blocked for good (see acquire_worker). */
static void gloo_execute(void *arg, fsdp_work_t *w, int on_caller) {
    (void)arg;
    if (!on_caller) {
        execute(w);
        return;
    }
    sigpipe_guard_t guard;
    sigpipe_block(&guard);
    execute(w);
    sigpipe_restore(&guard);
}

/* The key of the rank's worker among the context's shared states. */
static const char rank_key;

/* Takes a reference on ctx's worker, starting it for the rank's first Gloo group with SIGPIPE
 * blocked. */
static int acquire_worker(fsdp_ctx_t *ctx, fsdp__pg_worker_t **out) {
    sigset_t sigpipe;
    sigemptyset(&sigpipe);
    sigaddset(&sigpipe, SIGPIPE);
    return fsdp__pg_worker_acquire(ctx, &rank_key, gloo_execute, NULL, &sigpipe, out);
}

/* ---------------------------------------------------------------------------------------- */
/* The backend */

static int gloo_post(fsdp_pg_t *pg, fsdp_work_t *w) {
    int rc = fsdp__pg_worker_post(((gloo_pg_t *)pg)->worker, w);
    if (rc < 0)
        return fsdp__pg_err(pg, rc, "gloo: rank %d's worker has stopped (group '%s')", pg->rank,
                            pg->name);
    return FSDP_OK;
}

static void gloo_destroy(fsdp_pg_t *pg) {
    gloo_pg_t *gp = (gloo_pg_t *)pg;
    fsdp_ctx_t *ctx = pg->ctx;
    fsdp__pg_worker_t *worker = gp->worker;
    fsdp__gloo_shm_destroy(gp->shm);
    fsdp__gloo_comm_destroy(gp->comm);
    fsdp_store_destroy(gp->store);
    fsdp__pg_fini(pg);
    if (worker) fsdp__pg_worker_release(ctx, &rank_key, worker);
    free(gp);
}

static int gloo_create_subgroup(fsdp_pg_t *parent, const int *members, int n, int new_rank,
                                const char *name, fsdp_pg_t **out);

static const struct fsdp_pg_ops gloo_ops = {
    .name = "gloo",
    .post = gloo_post,
    .create_subgroup = gloo_create_subgroup,
    .destroy = gloo_destroy,
};

/* Appends to msg the ranks (and their world ranks) whose arrival mark is not in the rendezvous
 * store: those that never called the creation. */
static void name_absent_ranks(fsdp_store_t *rdv, int size, const int *world_ranks, char *msg,
                              size_t cap) {
    size_t n = strlen(msg);
    int absent = 0;
    for (int q = 0; q < size && n + 48 < cap; q++) {
        char key[32];
        int found = 1;
        snprintf(key, sizeof key, "joined/%d", q);
        if (fsdp_store_check(rdv, key, &found) < 0 || found) continue;
        int w = world_ranks ? world_ranks[q] : q;
        n += (size_t)snprintf(msg + n, cap - n, "%s %d", absent ? "," : "; never joined: rank", q);
        if (w != q) n += (size_t)snprintf(msg + n, cap - n, " (world rank %d)", w);
        absent++;
    }
    if (absent == 0 && n + 64 < cap)
        snprintf(msg + n, cap - n, "; every rank joined the rendezvous (a connection failed)");
}

/*
 * The common part of creating a world group or a sub-group: the base, the worker reference and
 * the comm (rendezvous under `name` on `store`, which gp takes over). `parent` is NULL for a
 * world group. On failure everything is freed and msg says why.
 */
static int create_group(fsdp_ctx_t *ctx, fsdp_store_t *store, const gloo_pg_t *parent,
                        const char *name, int rank, int size, const int *world_ranks,
                        const char *hostname, const char *iface, int64_t timeout_ms, int check,
                        gloo_pg_t **out, char *msg, size_t cap) {
    fsdp_store_t *rdv = NULL;
    gloo_pg_t *gp = calloc(1, sizeof *gp);
    if (!gp) {
        fsdp_store_destroy(store);
        snprintf(msg, cap, "out of memory");
        return FSDP_ENOMEM;
    }
    gp->store = store;
    gp->check = check;
    int rc = fsdp__pg_init(&gp->base, &gloo_ops, ctx, rank, size, world_ranks, name);
    if (rc < 0) {
        snprintf(msg, cap, "out of memory");
        goto fail;
    }
    rc = acquire_worker(ctx, &gp->worker);
    if (rc < 0) {
        snprintf(msg, cap, "cannot start the rank's Gloo worker thread");
        goto fail;
    }
    rc = fsdp_store_clone(store, name, &rdv);
    if (rc < 0) {
        snprintf(msg, cap, "store: %s", fsdp_store_last_error(store));
        goto fail;
    }
    /* A mark of this rank's arrival, so that a rendezvous that times out can say which ranks
     * never came (Gloo's own message names only the key it waited for). */
    char key[32];
    snprintf(key, sizeof key, "joined/%d", rank);
    rc = fsdp_store_set(rdv, key, "1", 1);
    if (rc < 0) {
        snprintf(msg, cap, "store: %s", fsdp_store_last_error(rdv));
        fsdp_store_destroy(rdv);
        goto fail;
    }
    if (parent) {
        gp->addr = parent->addr;
        gp->addrlen = parent->addrlen;
        memcpy(gp->key, parent->key, sizeof gp->key);
    } else {
        rc = fsdp__gloo_resolve(hostname, iface, &gp->addr, &gp->addrlen, msg, cap);
        if (rc == FSDP_OK) rc = fsdp__gloo_mesh_key(gp->store, rank, gp->key, msg, cap);
    }
    int *fds = rc == FSDP_OK ? malloc((size_t)size * sizeof *fds) : NULL;
    if (rc == FSDP_OK && !fds) {
        snprintf(msg, cap, "out of memory");
        rc = FSDP_ENOMEM;
    }
    int dropped = 0;
    if (rc == FSDP_OK)
        rc = fsdp__gloo_mesh_connect(ctx, rdv, rank, size, (const struct sockaddr *)&gp->addr,
                                     gp->addrlen, gp->key, timeout_ms, fds, &dropped, msg, cap);
    if (rc == FSDP_OK) {
        /* Gloo's event-loop thread, started with the device, inherits the blocked SIGPIPE. */
        sigpipe_guard_t guard;
        sigpipe_block(&guard);
        if (parent)
            rc = fsdp__gloo_comm_create_sub(parent->comm, rank, size, fds, timeout_ms, &gp->comm,
                                            msg, cap);
        else
            rc = fsdp__gloo_comm_create(rank, size, hostname, iface, fds, timeout_ms, &gp->comm,
                                        msg, cap);
        sigpipe_restore(&guard);
    }
    free(fds);
    if (rc == FSDP_ETIMEDOUT) name_absent_ranks(rdv, size, world_ranks, msg, cap);
    if (rc == FSDP_OK) {
        /* Shared memory when every rank is on this host (gloo_shm.h); else TCP alone. */
        char why[256];
        rc = fsdp__gloo_shm_create(rdv, rank, size, &gp->shm, why, sizeof why);
        if (rc < 0)
            snprintf(msg, cap, "agreeing on shared memory: %s", why);
        else
            fsdp_log(ctx, FSDP_LOG_DEBUG, "gloo: group '%s' (rank %d of %d): %s: %s", name,
                     rank, size, gp->shm ? "collectives through shared memory" : "TCP only",
                     why);
    }
    fsdp_store_destroy(rdv);
    if (rc < 0) goto fail;
    *out = gp;
    return FSDP_OK;
fail:
    gloo_destroy(&gp->base);
    return rc;
}

static int gloo_create_subgroup(fsdp_pg_t *parent, const int *members, int n, int new_rank,
                                const char *name, fsdp_pg_t **out) {
    gloo_pg_t *pp = (gloo_pg_t *)parent;
    char msg[FSDP_ERR_LEN];
    fsdp_store_t *store = NULL;
    int *world_ranks = malloc((size_t)n * sizeof *world_ranks);
    if (!world_ranks) return fsdp__pg_err(parent, FSDP_ENOMEM, "gloo: out of memory");
    for (int i = 0; i < n; i++)
        world_ranks[i] = parent->world_ranks[members[i]];
    int rc = fsdp_store_clone(pp->store, NULL, &store);
    if (rc < 0) {
        free(world_ranks);
        return fsdp__pg_err(parent, rc, "gloo: cannot create group '%s': store: %s", name,
                            fsdp_store_last_error(pp->store));
    }
    gloo_pg_t *gp = NULL;
    rc = create_group(parent->ctx, store, pp, name, new_rank, n, world_ranks, NULL, NULL,
                      parent->timeout_ms, pp->check, &gp, msg, sizeof msg);
    free(world_ranks);
    if (rc < 0)
        return fsdp__pg_err(parent, rc, "gloo: cannot create group '%s' (rank %d of %d): %s", name,
                            new_rank, n, msg);
    *out = &gp->base;
    return FSDP_OK;
}

int fsdp__gloo_pg_shm(const fsdp_pg_t *pg) {
    if (!pg || pg->ops != &gloo_ops) return -1;
    const fsdp_gloo_shm_t *shm = ((const gloo_pg_t *)pg)->shm;
    return shm ? 1 + fsdp__gloo_shm_cma(shm) : 0;
}

int fsdp__gloo_pg_spin(const fsdp_pg_t *pg) {
    const int gloo = pg && pg->ops == &gloo_ops;
    return fsdp__gloo_shm_spin(gloo ? ((const gloo_pg_t *)pg)->shm : NULL);
}

int fsdp__gloo_pg_cma_price(const fsdp_pg_t *pg, int64_t *read_ns, int64_t *copy_ns) {
    const int gloo = pg && pg->ops == &gloo_ops;
    return fsdp__gloo_shm_cma_price(gloo ? ((const gloo_pg_t *)pg)->shm : NULL, read_ns, copy_ns);
}

/* ---------------------------------------------------------------------------------------- */
/* Public API */

static const fsdp__abi_struct_t gloo_options_abi =
    FSDP__ABI_STRUCT(fsdp_gloo_options_t, "fsdp_gloo_options_init", timeout_ms);

void(fsdp_gloo_options_init)(fsdp_gloo_options_t *o, size_t size) {
    fsdp_gloo_options_t d;
    memset(&d, 0, sizeof d);
    fsdp__abi_init(o, size, &d, &gloo_options_abi);
}

int fsdp_gloo_available(void) {
    return 1;
}

static int env_flag(const char *name) {
    const char *v = getenv(name);
    return v && *v && strcmp(v, "0") != 0;
}

int fsdp_pg_create_gloo(fsdp_ctx_t *ctx, fsdp_store_t *store, const fsdp_gloo_options_t *o,
                        fsdp_pg_t **out) {
    int rc = fsdp__abi_check(ctx, "fsdp_pg_create_gloo", "o", o, &gloo_options_abi);
    if (rc < 0) {
        if (out) *out = NULL;
        return rc;
    }
    fsdp_gloo_options_t defaults;
    if (!o) {
        fsdp_gloo_options_init(&defaults);
        o = &defaults;
    }
    int64_t timeout = 0;
    rc = fsdp__pg_check_world_args(ctx, "fsdp_pg_create_gloo", store, out, o->timeout_ms, &timeout);
    if (rc < 0) return rc;
    const char *iface = o->iface ? o->iface : getenv("FSDP_GLOO_IFNAME");
    const char *host = o->hostname ? o->hostname : getenv("FSDP_GLOO_HOST");
    if (!host || !*host) host = "127.0.0.1";
    int rank = ctx->rank, size = ctx->world_size;

    /* Number the Gloo worlds made on this store, so that a second world on the same store
     * rendezvouses under fresh keys. A rank finishes creating world k only once every rank has
     * published its address, which each does after counting itself, so the counts of world
     * k + 1 all come after those of world k. */
    int64_t n;
    rc = fsdp_store_add(store, "gloo.worlds", 1, &n);
    if (rc < 0)
        return fsdp__ctx_err(ctx, rc, "fsdp_pg_create_gloo (rank %d of %d): store: %s", rank, size,
                             fsdp_store_last_error(store));
    char prefix[48];
    snprintf(prefix, sizeof prefix, "gloo.%lld", (long long)((n - 1) / size));
    fsdp_store_t *mine = NULL;
    rc = fsdp_store_clone(store, prefix, &mine);
    if (rc < 0)
        return fsdp__ctx_err(ctx, rc, "fsdp_pg_create_gloo (rank %d of %d): store: %s", rank, size,
                             fsdp_store_last_error(store));
    fsdp_store_set_timeout(mine, timeout);

    char msg[FSDP_ERR_LEN];
    gloo_pg_t *gp = NULL;
    rc = create_group(ctx, mine, NULL, "world", rank, size, NULL, host, iface, timeout,
                      env_flag("FSDP_GLOO_CHECK"), &gp, msg, sizeof msg);
    if (rc < 0)
        return fsdp__ctx_err(ctx, rc,
                             "fsdp_pg_create_gloo (rank %d of %d, %s %s, timeout %lld ms): %s",
                             rank, size, iface && *iface ? "interface" : "host",
                             iface && *iface ? iface : host, (long long)timeout, msg);
    fsdp_pg_set_timeout(&gp->base, timeout);
    if (!ctx->pg) fsdp__ctx_attach(ctx, &gp->base, store);
    *out = &gp->base;
    return FSDP_OK;
}
