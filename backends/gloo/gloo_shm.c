/* SPDX-License-Identifier: MIT */
/*
 * gloo_shm.c: the collectives of the gloo process group's shared-memory transport (see
 * gloo_shm.h; gloo_shm_create.c makes the group and its segment).
 *
 * Every collective runs in chunks that fit the slots. A chunk is: each rank copies its part into
 * its own slot; a barrier; each rank reads what it needs (and, for reductions, reduces its share
 * of the chunk in rank order); a barrier before the slots are written again. All-reduce adds a
 * third step: the shares are reduced into the result area, a barrier, then every rank copies the
 * whole chunk out.
 *
 * With cross-memory attach (decided at creation, gloo_shm_create.c: every rank could read each
 * peer's memory with process_vm_readv and found that cheaper than the slots, or FSDP_GLOO_CMA=1
 * asked for it), all-gather and reduce-scatter skip the slots: each rank publishes its send
 * buffer's address, and after a barrier every rank has the kernel copy what
 * it needs from its peers' buffers (an all-gather's blocks straight into recv; a reduce-scatter's
 * segments a block at a time into its own slot, reduced with its own part in rank order); a
 * second barrier keeps the send buffers until every rank has read them.
 *
 * The barrier is a generation count in shared memory: the last rank to arrive resets the count,
 * advances the generation and wakes the others with a futex (not private: the waiters are other
 * processes). A waiter spins briefly (not at all when the group's ranks outnumber the CPUs:
 * gloo_shm_create.c), then sleeps on the futex in slices of at most 50 ms, and
 * between slices checks the group's closed mark, its peers' processes (kill(pid, 0)) and the
 * collective's deadline.
 */
#define _GNU_SOURCE

#include <errno.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <fsdp/errno.h>

#include "backends/gloo/gloo_shm_impl.h"
#include "core/copy.h"
#include "core/reduce.h"
#include "core/timeutil.h"

/* Bytes of a peer's segment a reduce-scatter reads at a time with cross-memory attach: small
 * enough that the copies stay in this core's cache until they are reduced. */
#define CMA_BLOCK ((size_t)256 << 10)
#define SLICE_NS 50000000LL /* longest futex sleep between liveness checks */

/* ---- the barrier --------------------------------------------------------------------------- */

static void futex_wait(_Atomic uint32_t *addr, uint32_t val, int64_t ns) {
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000), .tv_nsec = (long)(ns % 1000000000)};
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Whether process p has ended: gone, or a zombie its parent has not reaped yet. */
static int gone(pid_t p) {
    if (kill(p, 0) != 0) return errno == ESRCH;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)p);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *paren = strrchr(buf, ')'); /* the state follows the command name */
    return paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

/* Why a barrier cannot complete, or FSDP_OK: the group closed, a peer's process gone. */
static int broken(fsdp_gloo_shm_t *s, int *peer, char *msg, size_t cap) {
    /* An ended process first: a rank that saw it end closes the group too, and the process is
     * the cause to name. */
    for (int q = 0; q < s->size; q++) {
        if (q == s->rank || s->pid[q] <= 0) continue;
        if (s->pid[q] != (int32_t)getpid() && gone((pid_t)s->pid[q])) {
            *peer = q;
            snprintf(msg, cap, "rank %d's process (pid %d) has exited", q, (int)s->pid[q]);
            return FSDP_EREMOTE;
        }
    }
    uint32_t c = atomic_load_explicit(&s->h->closed, memory_order_acquire);
    if (c) {
        *peer = (int)c - 1;
        snprintf(msg, cap, "rank %d closed the group's shared memory", (int)c - 1);
        return FSDP_EREMOTE;
    }
    return FSDP_OK;
}

static int barrier(fsdp_gloo_shm_t *s, int64_t deadline, int64_t timeout_ms, int *peer,
                   char *msg, size_t cap) {
    struct shm_hdr *h = s->h;
    const uint32_t g = atomic_load_explicit(&h->gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&h->count, 1, memory_order_acq_rel) == (uint32_t)s->size - 1) {
        atomic_store_explicit(&h->count, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&h->gen, 1, memory_order_release);
        futex_wake_all(&h->gen);
        return FSDP_OK;
    }
    for (int i = 0; i < s->spin; i++) {
        if (atomic_load_explicit(&h->gen, memory_order_acquire) != g) return FSDP_OK;
        cpu_relax();
    }
    for (;;) {
        if (atomic_load_explicit(&h->gen, memory_order_acquire) != g) return FSDP_OK;
        int rc = broken(s, peer, msg, cap);
        /* A peer may complete the barrier, then close the group or exit at once: its mark comes
         * after the generation it advanced, so look again before blaming it. */
        if (rc < 0) return atomic_load_explicit(&h->gen, memory_order_acquire) != g ? FSDP_OK : rc;
        int64_t left = deadline - fsdp__now_ns();
        if (left <= 0) {
            snprintf(msg, cap, "timed out after %lld ms waiting for the other ranks at a barrier "
                               "of the shared-memory transport",
                     (long long)timeout_ms);
            return FSDP_ETIMEDOUT;
        }
        futex_wait(&h->gen, g, left < SLICE_NS ? left : SLICE_NS);
    }
}

/* ---- collectives --------------------------------------------------------------------------- */

typedef struct run {
    fsdp_gloo_shm_t *s;
    int64_t deadline, timeout_ms;
    int *peer;
    char *msg;
    size_t cap;
} run_t;

#define SYNC(r)                                                                                    \
    do {                                                                                           \
        int src_ = barrier((r)->s, (r)->deadline, (r)->timeout_ms, (r)->peer, (r)->msg,            \
                           (r)->cap);                                                              \
        if (src_ < 0) return src_;                                                                 \
    } while (0)

static char *slot_of(fsdp_gloo_shm_t *s, int q) {
    return s->slots + (size_t)q * s->slot;
}

/* One input pointer per rank for a reduction: on the stack up to MAX_INS ranks. */
enum { MAX_INS = 64 };
struct ins {
    const void *small[MAX_INS];
    const void **p;
};

static int ins_init(run_t *r, struct ins *in) {
    const size_t n = (size_t)r->s->size;
    in->p = n <= MAX_INS ? in->small : malloc(n * sizeof *in->p);
    if (in->p) return FSDP_OK;
    snprintf(r->msg, r->cap, "out of memory");
    return FSDP_ENOMEM;
}

static void ins_fini(struct ins *in) {
    if (in->p != in->small) free(in->p);
}

/* Reduces n elements of every rank's input in rank order (in->p[q]) into the nout outputs. */
static int reduce_ins(run_t *r, const fsdp_gloo_op_t *op, const struct ins *in, size_t n,
                      void *const *outs, int nout) {
    int size = r->s->size;
    int rc = fsdp__reduce(outs, nout, in->p, size, n, op->dtype, op->op, size, op->prescale);
    if (rc < 0) snprintf(r->msg, r->cap, "out of memory reducing");
    return rc;
}

/* Reduces element range [e, e + n) of chunk `base` (an element offset into each slot) over
 * every slot, in rank order, into the nout outputs; the rank's own input is `own` (its send
 * buffer, which it did not copy into its slot). */
static int reduce_slots(run_t *r, const fsdp_gloo_op_t *op, size_t es, size_t base, size_t n,
                        const void *own, void *const *outs, int nout) {
    fsdp_gloo_shm_t *s = r->s;
    struct ins in;
    int rc = ins_init(r, &in);
    if (rc < 0) return rc;
    for (int q = 0; q < s->size; q++)
        in.p[q] = q == s->rank ? own : slot_of(s, q) + base * es;
    rc = reduce_ins(r, op, &in, n, outs, nout);
    ins_fini(&in);
    return rc;
}

/* A failed read of peer q's memory: the peer's end names it, anything else is the kernel's. */
static int cma_fail(run_t *r, int q, const char *what) {
    int e = errno;
    int rc = broken(r->s, r->peer, r->msg, r->cap);
    if (rc < 0) return rc;
    *r->peer = q;
    snprintf(r->msg, r->cap, "%s: reading rank %d's buffer (process_vm_readv): %s", what, q,
             strerror(e));
    return e == ESRCH ? FSDP_EREMOTE : FSDP_EBACKEND;
}

/* With cross-memory attach: each rank publishes its send buffer; after a barrier every rank
 * reads each peer's block straight into recv (one copy, by the kernel, instead of one into the
 * slot and one out of it), and a second barrier keeps the send buffers until all have read. */
static int all_gather_cma(run_t *r, const fsdp_gloo_op_t *op, size_t es) {
    fsdp_gloo_shm_t *s = r->s;
    const size_t bytes = op->count * es;
    char *recv = op->recv;
    s->addr[s->rank] = (uint64_t)(uintptr_t)op->send;
    SYNC(r);
    for (int q = 0; q < s->size; q++) {
        char *dst = recv + (size_t)q * bytes;
        if (q == s->rank)
            fsdp__copy_large(dst, op->send, bytes);
        else if (fsdp__gloo_shm_cma_read((pid_t)s->pid[q], dst, s->addr[q], bytes) != 0)
            return cma_fail(r, q, "all_gather");
    }
    SYNC(r);
    return FSDP_OK;
}

static int all_gather(run_t *r, const fsdp_gloo_op_t *op, size_t es) {
    fsdp_gloo_shm_t *s = r->s;
    const size_t bytes = op->count * es;
    const char *send = op->send;
    char *recv = op->recv;
    if (s->cma) return all_gather_cma(r, op, es);
    for (size_t off = 0; off < bytes; off += s->slot) {
        const size_t len = bytes - off < s->slot ? bytes - off : s->slot;
        /* This rank's block goes into its slot and, unless in place, its recv in one pass. */
        char *own = recv + (size_t)s->rank * bytes + off;
        if (own != send + off)
            fsdp__copy_large2(slot_of(s, s->rank), own, send + off, len);
        else
            fsdp__copy_large(slot_of(s, s->rank), send + off, len);
        SYNC(r);
        for (int q = 0; q < s->size; q++)
            if (q != s->rank)
                fsdp__copy_large(recv + (size_t)q * bytes + off, slot_of(s, q), len);
        SYNC(r);
    }
    return FSDP_OK;
}

static int broadcast(run_t *r, const fsdp_gloo_op_t *op, size_t es) {
    fsdp_gloo_shm_t *s = r->s;
    const size_t bytes = op->count * es;
    for (size_t off = 0; off < bytes; off += s->slot) {
        const size_t len = bytes - off < s->slot ? bytes - off : s->slot;
        if (s->rank == op->root)
            fsdp__copy_large(slot_of(s, op->root), (const char *)op->send + off, len);
        SYNC(r);
        if (s->rank != op->root || op->send != op->recv)
            fsdp__copy_large((char *)op->recv + off, slot_of(s, op->root), len);
        SYNC(r);
    }
    return FSDP_OK;
}

/* send: size blocks of count elements; block q goes to rank q; recv block q comes from q. */
static int all_to_all(run_t *r, const fsdp_gloo_op_t *op, size_t es) {
    fsdp_gloo_shm_t *s = r->s;
    const size_t n = (size_t)s->size, bytes = op->count * es;
    const size_t part = s->slot / n / es * es; /* bytes of each block per chunk */
    for (size_t off = 0; off < bytes; off += part) {
        const size_t len = bytes - off < part ? bytes - off : part;
        for (size_t q = 0; q < n; q++)
            fsdp__copy_large(slot_of(s, s->rank) + q * part,
                             (const char *)op->send + q * bytes + off, len);
        SYNC(r);
        for (size_t q = 0; q < n; q++)
            fsdp__copy_large((char *)op->recv + q * bytes + off,
                             slot_of(s, (int)q) + (size_t)s->rank * part, len);
        SYNC(r);
    }
    return FSDP_OK;
}

/* With cross-memory attach: each rank publishes its send buffer; every rank reads its own
 * segment of each peer's, a block at a time, into its own slot (which no peer reads in this
 * mode) and reduces it with its own in rank order. The peers copy nothing for it. */
static int reduce_scatter_cma(run_t *r, const fsdp_gloo_op_t *op, size_t es) {
    fsdp_gloo_shm_t *s = r->s;
    const size_t n = (size_t)s->size, me = (size_t)s->rank;
    size_t per = (s->slot / n < CMA_BLOCK ? s->slot / n : CMA_BLOCK) / es;
    if (per == 0) per = 1;
    struct ins in;
    int rc = ins_init(r, &in);
    if (rc < 0) return rc;
    s->addr[me] = (uint64_t)(uintptr_t)op->send;
    rc = barrier(s, r->deadline, r->timeout_ms, r->peer, r->msg, r->cap);
    for (size_t e = 0; e < op->count && rc == FSDP_OK; e += per) {
        const size_t m = op->count - e < per ? op->count - e : per;
        const size_t at = (me * op->count + e) * es; /* this rank's segment, chunk e */
        for (size_t q = 0; q < n && rc == FSDP_OK; q++) {
            char *tmp = slot_of(s, s->rank) + q * per * es;
            in.p[q] = q == me ? (const void *)((const char *)op->send + at) : tmp;
            if (q != me &&
                fsdp__gloo_shm_cma_read((pid_t)s->pid[q], tmp, s->addr[q] + at, m * es) != 0)
                rc = cma_fail(r, (int)q, "reduce_scatter");
        }
        void *outs[1] = {(char *)op->recv + e * es};
        if (rc == FSDP_OK) rc = reduce_ins(r, op, &in, m, outs, 1);
    }
    ins_fini(&in);
    if (rc < 0) return rc;
    SYNC(r);
    return FSDP_OK;
}

/* send: size segments of count elements; rank q's result is segment q reduced over the ranks.
 * A rank copies into its slot only the segments the others reduce, and reads its own from its
 * send buffer: 1/size less copying, the same inputs in the same order. */
static int reduce_scatter(run_t *r, const fsdp_gloo_op_t *op, size_t es) {
    fsdp_gloo_shm_t *s = r->s;
    const size_t n = (size_t)s->size, per = s->slot / n / es; /* elements of a segment a chunk */
    const size_t me = (size_t)s->rank;
    if (s->cma) return reduce_scatter_cma(r, op, es);
    for (size_t e = 0; e < op->count; e += per) {
        const size_t m = op->count - e < per ? op->count - e : per;
        for (size_t q = 0; q < n; q++)
            if (q != me)
                fsdp__copy_large(slot_of(s, s->rank) + q * per * es,
                                 (const char *)op->send + (q * op->count + e) * es, m * es);
        SYNC(r);
        void *outs[1] = {(char *)op->recv + e * es};
        int rc = reduce_slots(r, op, es, me * per, m,
                              (const char *)op->send + (me * op->count + e) * es, outs, 1);
        if (rc < 0) return rc;
        SYNC(r);
    }
    return FSDP_OK;
}

/* All-reduce (root < 0) or reduce to root: chunks of a slot; each rank reduces its share of the
 * chunk into the result area, then every rank (or the root) copies the chunk out. A rank's own
 * share is read from its send buffer (it copies only the rest into its slot) and, when the rank
 * keeps the result, written into recv as well as the result area. */
static int reduce_all(run_t *r, const fsdp_gloo_op_t *op, size_t es, int root) {
    fsdp_gloo_shm_t *s = r->s;
    const size_t n = (size_t)s->size, chunk = s->slot / es;
    const bool keep = root < 0 || s->rank == root;
    for (size_t e = 0; e < op->count; e += chunk) {
        const size_t m = op->count - e < chunk ? op->count - e : chunk;
        /* Rank q's share of the m elements: [q m / n, (q + 1) m / n). */
        const size_t lo = (size_t)s->rank * m / n, hi = ((size_t)s->rank + 1) * m / n;
        const char *send = (const char *)op->send + e * es;
        /* A non-root's recv of reduce may be NULL: no pointer is made from it. */
        char *recv = keep ? (char *)op->recv + e * es : NULL;
        fsdp__copy_large(slot_of(s, s->rank), send, lo * es);
        fsdp__copy_large(slot_of(s, s->rank) + hi * es, send + hi * es, (m - hi) * es);
        SYNC(r);
        if (hi > lo) {
            void *outs[2] = {s->result + lo * es, keep ? recv + lo * es : NULL};
            int rc = reduce_slots(r, op, es, lo, hi - lo, send + lo * es, outs, keep ? 2 : 1);
            if (rc < 0) return rc;
        }
        SYNC(r);
        if (keep) {
            fsdp__copy_large(recv, s->result, lo * es);
            fsdp__copy_large(recv + hi * es, s->result + hi * es, (m - hi) * es);
        }
        SYNC(r);
    }
    return FSDP_OK;
}

int fsdp__gloo_shm_run(fsdp_gloo_shm_t *s, const fsdp_gloo_op_t *op, int *peer, char *msg,
                       size_t cap) {
    run_t r = {s, fsdp__now_ns() + op->timeout_ms * 1000000LL, op->timeout_ms, peer, msg, cap};
    const size_t es = fsdp_dtype_size(op->dtype);
    *peer = -1;
    switch (op->kind) {
    case FSDP_COLL_BARRIER:
        SYNC(&r);
        return FSDP_OK;
    case FSDP_COLL_ALL_GATHER:
        return all_gather(&r, op, es);
    case FSDP_COLL_BROADCAST:
        return broadcast(&r, op, es);
    case FSDP_COLL_ALL_TO_ALL:
        return all_to_all(&r, op, es);
    case FSDP_COLL_REDUCE_SCATTER:
        return reduce_scatter(&r, op, es);
    case FSDP_COLL_ALL_REDUCE:
        return reduce_all(&r, op, es, -1);
    case FSDP_COLL_REDUCE:
        return reduce_all(&r, op, es, op->root);
    default:
        snprintf(msg, cap, "collective kind %d is not supported", (int)op->kind);
        return FSDP_EBACKEND;
    }
}

void fsdp__gloo_shm_close(fsdp_gloo_shm_t *s) {
    uint32_t none = 0;
    if (s) atomic_compare_exchange_strong(&s->h->closed, &none, (uint32_t)s->rank + 1);
}

void fsdp__gloo_shm_destroy(fsdp_gloo_shm_t *s) {
    if (!s) return;
    /* Peers still waiting on this rank (it left a collective early) fail at once; after a
     * clean end nobody waits, and the mark is never read again. */
    fsdp__gloo_shm_close(s);
    futex_wake_all(&s->h->gen);
    fsdp__gloo_shm_unmap(s);
}
