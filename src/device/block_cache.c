/* SPDX-License-Identifier: MIT */
/*
 * block_cache.c: the caching allocator of the CPU and CUDA devices (see block_cache.h for the
 * policy).
 *
 * Structures:
 *   - segments: what the backend gave, in a list; each holds its blocks as a doubly linked list
 *     in address order (so a freed block finds its neighbours in O(1));
 *   - free blocks: one array per pool, sorted by (stream, size, address); best fit is a binary
 *     search for the first entry not below (stream, size, 0);
 *   - live blocks: a hash map from the pointer handed out to its block, for free();
 *   - pending blocks: freed blocks still waiting for events on other streams, in a list that
 *     every malloc, process_events and empty_cache walks.
 * Invariants: a block is in exactly one of {free array, live map, pending list}; two free
 * neighbours never stay unmerged; the counters equal the sums over the blocks and segments; a
 * block marked clean is free and its bytes are zero (only with zeroed segments).
 */
#include <config.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/errno.h>

#include "device/block_cache.h"

enum blk_state { BLK_FREE = 0, BLK_LIVE, BLK_PENDING };

struct seg;

struct blk {
    uintptr_t ptr;
    size_t size; /* rounded, a multiple of FSDP_BCACHE_ROUND */
    size_t req;  /* bytes asked for (live blocks) */
    struct seg *seg;
    struct blk *prev, *next; /* neighbours in the segment, address order */
    enum blk_state state;
    bool clean;  /* free, and nobody has written its bytes since its segment was made */
    bool cold;   /* free, and its pages are not resident (never touched, or given back) */
    void **uses; /* other streams the block was used on (live blocks) */
    size_t nuse, capuse;
    void **evs; /* events still to complete (pending blocks) */
    size_t nev, capev;
    struct blk *pend_next; /* pending list */
};

struct seg {
    uintptr_t base;
    size_t size;
    int pool;
    void *stream;
    struct blk *first;
    struct seg *next;
};

struct free_list {
    struct blk **v;
    size_t n, cap;
};

struct live_map {
    struct blk **slots; /* NULL: empty */
    size_t cap;         /* power of two */
    size_t count;
};

struct fsdp_bcache {
    const struct fsdp_bcache_ops *ops;
    void *ctx;
    fsdp_bcache_opts_t opts;
    struct seg *segs;
    struct free_list free[FSDP_BCACHE_NPOOLS];
    struct live_map live;
    struct blk *pending;
    void **spare_evs; /* completed events kept for reuse */
    size_t nspare, capspare;
    fsdp_bcache_stats_t st;
    size_t given_back; /* bytes keep_to_peak gave back that no cold block has taken since */
    char err[512];
};

static int set_err(fsdp_bcache_t *a, int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(a->err, sizeof a->err, fmt, ap);
    va_end(ap);
    return rc;
}

static size_t round_up(size_t n, size_t to) {
    return (n + to - 1) / to * to;
}

static int grow(void **v, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return FSDP_OK;
    size_t nc = *cap ? *cap * 2 : 16;
    while (nc < need)
        nc *= 2;
    void *p = realloc(*v, nc * elem);
    if (!p) return FSDP_ENOMEM;
    *v = p;
    *cap = nc;
    return FSDP_OK;
}

/* ---- free lists ---- */

/* Orders (stream, size, ptr). */
static int blk_cmp(const void *s1, size_t z1, uintptr_t p1, const struct blk *b) {
    uintptr_t a = (uintptr_t)s1, c = (uintptr_t)b->seg->stream;
    if (a != c) return a < c ? -1 : 1;
    if (z1 != b->size) return z1 < b->size ? -1 : 1;
    if (p1 != b->ptr) return p1 < b->ptr ? -1 : 1;
    return 0;
}

/* First index whose entry is not below the key. */
static size_t fl_lower(const struct free_list *fl, const void *stream, size_t size, uintptr_t ptr) {
    size_t lo = 0, hi = fl->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (blk_cmp(stream, size, ptr, fl->v[mid]) > 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static int fl_insert(struct free_list *fl, struct blk *b) {
    if (grow((void **)&fl->v, &fl->cap, fl->n + 1, sizeof *fl->v) < 0) return FSDP_ENOMEM;
    size_t i = fl_lower(fl, b->seg->stream, b->size, b->ptr);
    memmove(fl->v + i + 1, fl->v + i, (fl->n - i) * sizeof *fl->v);
    fl->v[i] = b;
    fl->n++;
    return FSDP_OK;
}

static void fl_remove(struct free_list *fl, struct blk *b) {
    size_t i = fl_lower(fl, b->seg->stream, b->size, b->ptr);
    if (i < fl->n && fl->v[i] == b) {
        memmove(fl->v + i, fl->v + i + 1, (fl->n - i - 1) * sizeof *fl->v);
        fl->n--;
    }
}

/* ---- live map: open addressing, linear probing, backward-shift deletion ---- */

static size_t lm_hash(uintptr_t p, size_t cap) {
    uint64_t h = ((uint64_t)p >> 9) * UINT64_C(0x9e3779b97f4a7c15);
    return (size_t)(h >> 32) & (cap - 1);
}

static struct blk **lm_find(const struct live_map *m, uintptr_t p) {
    if (!m->cap) return NULL;
    for (size_t i = lm_hash(p, m->cap);; i = (i + 1) & (m->cap - 1)) {
        if (!m->slots[i]) return NULL;
        if (m->slots[i]->ptr == p) return &m->slots[i];
    }
}

static void lm_put_nogrow(struct live_map *m, struct blk *b) {
    size_t i = lm_hash(b->ptr, m->cap);
    while (m->slots[i])
        i = (i + 1) & (m->cap - 1);
    m->slots[i] = b;
    m->count++;
}

static int lm_reserve(struct live_map *m) {
    if ((m->count + 1) * 2 <= m->cap) return FSDP_OK;
    struct live_map nm = {NULL, m->cap ? m->cap * 2 : 64, 0};
    nm.slots = calloc(nm.cap, sizeof *nm.slots);
    if (!nm.slots) return FSDP_ENOMEM;
    for (size_t i = 0; i < m->cap; i++)
        if (m->slots[i]) lm_put_nogrow(&nm, m->slots[i]);
    free(m->slots);
    *m = nm;
    return FSDP_OK;
}

static void lm_remove(struct live_map *m, struct blk **slot) {
    size_t mask = m->cap - 1, hole = (size_t)(slot - m->slots);
    for (size_t i = (hole + 1) & mask; m->slots[i]; i = (i + 1) & mask) {
        size_t home = lm_hash(m->slots[i]->ptr, m->cap);
        int stays = hole <= i ? (home > hole && home <= i) : (home > hole || home <= i);
        if (stays) continue;
        m->slots[hole] = m->slots[i];
        hole = i;
    }
    m->slots[hole] = NULL;
    m->count--;
}

/* ---- counters ---- */

static void count_alloc(fsdp_bcache_t *a, int pool, size_t size, size_t req) {
    fsdp_bcache_stats_t *s = &a->st;
    s->allocated[pool] += size;
    if (s->allocated[pool] > s->allocated_peak[pool]) s->allocated_peak[pool] = s->allocated[pool];
    s->allocated_total += size;
    if (s->allocated_total > s->allocated_peak_total) s->allocated_peak_total = s->allocated_total;
    s->requested_total += req;
    s->blocks++;
}

static void count_free(fsdp_bcache_t *a, int pool, size_t size, size_t req) {
    a->st.allocated[pool] -= size;
    a->st.allocated_total -= size;
    a->st.requested_total -= req;
    a->st.blocks--;
}

static void count_seg(fsdp_bcache_t *a, int pool, size_t size, bool add) {
    fsdp_bcache_stats_t *s = &a->st;
    if (add) {
        s->reserved[pool] += size;
        if (s->reserved[pool] > s->reserved_peak[pool]) s->reserved_peak[pool] = s->reserved[pool];
        s->reserved_total += size;
        if (s->reserved_total > s->reserved_peak_total) s->reserved_peak_total = s->reserved_total;
        s->segments++;
        s->seg_allocs++;
    } else {
        s->reserved[pool] -= size;
        s->reserved_total -= size;
        s->segments--;
        s->seg_frees++;
    }
}

/* ---- creation ---- */

int fsdp__bcache_create(const struct fsdp_bcache_ops *ops, void *ctx,
                        const fsdp_bcache_opts_t *opts, fsdp_bcache_t **out) {
    if (!out) return FSDP_EINVAL;
    *out = NULL;
    if (!ops || !ops->seg_alloc || !ops->seg_free) return FSDP_EINVAL;
    int nev = !!ops->event_create + !!ops->event_record + !!ops->event_query + !!ops->event_destroy;
    if (nev != 0 && nev != 4) return FSDP_EINVAL;
    fsdp_bcache_t *a = calloc(1, sizeof *a);
    if (!a) return FSDP_ENOMEM;
    a->ops = ops;
    a->ctx = ctx;
    if (opts) a->opts = *opts;
    if (!a->opts.name) a->opts.name = "device";
    *out = a;
    return FSDP_OK;
}

static void blk_destroy(struct blk *b) {
    free(b->uses);
    free(b->evs);
    free(b);
}

void fsdp__bcache_destroy(fsdp_bcache_t *a) {
    if (!a) return;
    for (struct blk *b = a->pending; b; b = b->pend_next)
        for (size_t i = 0; i < b->nev; i++)
            a->ops->event_destroy(a->ctx, b->evs[i]);
    for (size_t i = 0; i < a->nspare; i++)
        a->ops->event_destroy(a->ctx, a->spare_evs[i]);
    for (struct seg *s = a->segs, *sn; s; s = sn) {
        sn = s->next;
        for (struct blk *b = s->first, *bn; b; b = bn) {
            bn = b->next;
            blk_destroy(b);
        }
        a->ops->seg_free(a->ctx, (void *)s->base, s->size);
        free(s);
    }
    for (int p = 0; p < FSDP_BCACHE_NPOOLS; p++)
        free(a->free[p].v);
    free(a->live.slots);
    free(a->spare_evs);
    free(a);
}

static void release_free_segs(fsdp_bcache_t *a, size_t limit);

/* ---- freeing into the pools ---- */

/* Absorbs b's next neighbour n (free, in the free list) into b. */
static void absorb_next(fsdp_bcache_t *a, struct blk *b) {
    struct blk *n = b->next;
    fl_remove(&a->free[b->seg->pool], n);
    b->size += n->size;
    b->clean = b->clean && n->clean;
    b->cold = b->cold && n->cold;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    blk_destroy(n);
}

/* Makes b free: merges it with free neighbours and files it. */
static int make_free(fsdp_bcache_t *a, struct blk *b) {
    struct free_list *fl = &a->free[b->seg->pool];
    b->state = BLK_FREE;
    b->clean = false; /* it was handed out */
    b->cold = false;
    b->req = 0;
    b->nuse = 0;
    if (b->prev && b->prev->state == BLK_FREE) {
        struct blk *p = b->prev;
        fl_remove(fl, p);
        p->size += b->size;
        p->clean = false;
        p->cold = false;
        p->next = b->next;
        if (b->next) b->next->prev = p;
        blk_destroy(b);
        b = p;
    }
    if (b->next && b->next->state == BLK_FREE) absorb_next(a, b);
    if (fl_insert(fl, b) < 0) {
        /* Not in the list, the block is lost to reuse until empty_cache or destroy; memory is
         * still accounted in its segment. Host memory is what ran out here. */
        return set_err(a, FSDP_ENOMEM, "%s allocator: out of host memory for its free list",
                       a->opts.name);
    }
    return FSDP_OK;
}

int fsdp__bcache_process_events(fsdp_bcache_t *a) {
    int freed = 0, err = FSDP_OK;
    struct blk **link = &a->pending;
    while (*link) {
        struct blk *b = *link;
        size_t k = 0;
        for (size_t i = 0; i < b->nev; i++) {
            int q = a->ops->event_query(a->ctx, b->evs[i]);
            if (q < 0 && err == FSDP_OK)
                err = set_err(a, q, "%s allocator: querying an event of a freed block failed",
                              a->opts.name);
            if (q <= 0) {
                b->evs[k++] = b->evs[i];
                continue;
            }
            /* Completed: keep the event for the next free. */
            if (grow((void **)&a->spare_evs, &a->capspare, a->nspare + 1, sizeof(void *)) == 0)
                a->spare_evs[a->nspare++] = b->evs[i];
            else
                a->ops->event_destroy(a->ctx, b->evs[i]);
        }
        b->nev = k;
        if (k > 0) {
            link = &b->pend_next;
            continue;
        }
        *link = b->pend_next;
        b->pend_next = NULL;
        a->st.pending_blocks--;
        int rc = make_free(a, b);
        if (rc < 0 && err == FSDP_OK) err = rc;
        freed++;
    }
    return err < 0 ? err : freed;
}

static int event_get(fsdp_bcache_t *a, void **out) {
    if (a->nspare > 0) {
        *out = a->spare_evs[--a->nspare];
        return FSDP_OK;
    }
    return a->ops->event_create(a->ctx, out);
}

int fsdp__bcache_free(fsdp_bcache_t *a, void *ptr) {
    if (!ptr) return FSDP_OK;
    struct blk **slot = lm_find(&a->live, (uintptr_t)ptr);
    if (!slot)
        return set_err(a, FSDP_EINVAL, "%s allocator: %p is not a live block (freed twice?)",
                       a->opts.name, ptr);
    struct blk *b = *slot;
    lm_remove(&a->live, slot);
    count_free(a, b->seg->pool, b->size, b->req);
    if (b->nuse == 0) {
        int rc = make_free(a, b);
        if (a->opts.max_cached) release_free_segs(a, a->st.allocated_total + a->opts.max_cached);
        return rc;
    }
    /* Used on other streams: the block waits for an event on each. */
    int rc = FSDP_OK;
    b->state = BLK_PENDING;
    b->nev = 0;
    if (grow((void **)&b->evs, &b->capev, b->nuse, sizeof(void *)) < 0) {
        rc = set_err(a, FSDP_ENOMEM, "%s allocator: out of host memory for the events of %p",
                     a->opts.name, ptr);
    } else {
        for (size_t i = 0; i < b->nuse && rc == FSDP_OK; i++) {
            void *ev = NULL;
            rc = event_get(a, &ev);
            if (rc == FSDP_OK) {
                rc = a->ops->event_record(a->ctx, ev, b->uses[i]);
                if (rc < 0)
                    a->ops->event_destroy(a->ctx, ev);
                else
                    b->evs[b->nev++] = ev;
            }
            if (rc < 0)
                set_err(a, rc,
                        "%s allocator: recording an event for %p on stream %p failed; the "
                        "block is never reused",
                        a->opts.name, ptr, b->uses[i]);
        }
    }
    b->nuse = 0;
    if (rc < 0) {
        /* Without an event for every stream there is no telling when the memory is idle, so
         * the block stays out of the pools (and its segment stays reserved) until destroy. */
        for (size_t i = 0; i < b->nev; i++)
            a->ops->event_destroy(a->ctx, b->evs[i]);
        b->nev = 0;
        return rc;
    }
    b->pend_next = a->pending;
    a->pending = b;
    a->st.pending_blocks++;
    return FSDP_OK;
}

int fsdp__bcache_record_stream(fsdp_bcache_t *a, void *ptr, void *stream) {
    if (!a->ops->event_record)
        return set_err(a, FSDP_ENOTSUP,
                       "%s allocator: record_stream: this memory has no streams to order",
                       a->opts.name);
    struct blk **slot = lm_find(&a->live, (uintptr_t)ptr);
    struct blk *b = slot ? *slot : NULL;
    if (!b) {
        /* A view into a block: look for the live block that contains it. */
        uintptr_t p = (uintptr_t)ptr;
        for (struct seg *s = a->segs; s && !b; s = s->next) {
            if (p < s->base || p >= s->base + s->size) continue;
            for (struct blk *c = s->first; c; c = c->next)
                if (p >= c->ptr && p < c->ptr + c->size) {
                    if (c->state == BLK_LIVE) b = c;
                    break;
                }
        }
    }
    if (!b)
        return set_err(a, FSDP_EINVAL, "%s allocator: record_stream: %p is not in a live block",
                       a->opts.name, ptr);
    if (stream == b->seg->stream) return FSDP_OK;
    for (size_t i = 0; i < b->nuse; i++)
        if (b->uses[i] == stream) return FSDP_OK;
    if (grow((void **)&b->uses, &b->capuse, b->nuse + 1, sizeof(void *)) < 0)
        return set_err(a, FSDP_ENOMEM, "cuda allocator: out of host memory in record_stream");
    b->uses[b->nuse++] = stream;
    return FSDP_OK;
}

/* ---- segments ---- */

static void seg_release(fsdp_bcache_t *a, struct seg *s) {
    struct seg **link = &a->segs;
    while (*link != s)
        link = &(*link)->next;
    *link = s->next;
    fl_remove(&a->free[s->pool], s->first);
    blk_destroy(s->first);
    count_seg(a, s->pool, s->size, false);
    a->ops->seg_free(a->ctx, (void *)s->base, s->size);
    free(s);
}

/* Whether s holds one free block spanning it. */
static bool seg_wholly_free(const struct seg *s) {
    const struct blk *b = s->first;
    return b->state == BLK_FREE && !b->next && b->size == s->size;
}

/* The oldest wholly free segment (segments are listed newest first), or NULL. */
static struct seg *oldest_free_seg(const fsdp_bcache_t *a) {
    struct seg *oldest = NULL;
    for (struct seg *s = a->segs; s; s = s->next)
        if (seg_wholly_free(s)) oldest = s;
    return oldest;
}

size_t fsdp__bcache_empty_cache(fsdp_bcache_t *a) {
    size_t released = 0;
    (void)fsdp__bcache_process_events(a);
    for (struct seg *s = a->segs, *sn; s; s = sn) {
        sn = s->next;
        if (seg_wholly_free(s)) {
            released += s->size;
            seg_release(a, s);
        }
    }
    return released;
}

/* Gives back wholly free segments, oldest first, until at most `limit` bytes are reserved or
 * none is left. */
static void release_free_segs(fsdp_bcache_t *a, size_t limit) {
    while (a->st.reserved_total > limit) {
        struct seg *oldest = oldest_free_seg(a);
        if (!oldest) return;
        a->st.bound_frees++;
        seg_release(a, oldest);
    }
}

/* Bytes of free blocks whose pages are not resident. */
static size_t cold_bytes(const fsdp_bcache_t *a) {
    size_t n = 0;
    for (int p = 0; p < FSDP_BCACHE_NPOOLS; p++)
        for (size_t i = 0; i < a->free[p].n; i++)
            if (a->free[p].v[i]->cold) n += a->free[p].v[i]->size;
    return n;
}

/*
 * bound_to_peak with a backend that decommits, after a block whose pages were not resident was
 * handed out: the memory held and resident as far as the allocator knows (segments less cold
 * free blocks) must stay within the most ever allocated at once, plus the slack. Wholly free
 * segments go back first, oldest first; then the pages of the largest resident free blocks,
 * which stay carved and are faulted in again when used. (Without decommit, the check is made
 * before a new segment is taken, on the segments alone.)
 *
 * The slack is bound_slack_pct of the peak (at least bound_slack_min), and what the cache has
 * learned on top of it (stats.slack_learned). A step's mix of sizes can leave its working set,
 * fragmentation included, a little above any fixed slack: then every step gives back a segment
 * to map a block and maps one again for the next, and each time pays a fault per page (in a
 * sim world of two ranks with a vocabulary of 8192, a 12 MiB segment a step; on a virtual
 * machine that shadows page tables, tens of milliseconds). So memory given back that is needed
 * again (a cold block handed out while given-back bytes are outstanding) raises the learned
 * slack by that much, up to the configured slack once more; a working set that fits under twice
 * the slack stops faulting after a step or two, and one that does not stays bounded.
 */
static size_t slack_of(const fsdp_bcache_t *a) {
    size_t slack = a->st.allocated_peak_total / 100 * a->opts.bound_slack_pct;
    return slack < a->opts.bound_slack_min ? a->opts.bound_slack_min : slack;
}

/* A cold block of `size` bytes was handed out: what of it keep_to_peak had given back is now
 * learned slack (see above). */
static void learn_slack(fsdp_bcache_t *a, size_t size) {
    size_t room = slack_of(a), grow = size < a->given_back ? size : a->given_back;
    room = room > a->st.slack_learned ? room - a->st.slack_learned : 0;
    if (grow > room) grow = room;
    a->st.slack_learned += grow;
    a->given_back -= grow;
}

static void keep_to_peak(fsdp_bcache_t *a) {
    size_t bound = a->st.allocated_peak_total + slack_of(a) + a->st.slack_learned;
    size_t cold = cold_bytes(a);
    while (a->st.reserved_total - cold > bound) {
        struct seg *oldest = oldest_free_seg(a);
        if (!oldest) break;
        if (oldest->first->cold) {
            cold -= oldest->first->size;
        } else {
            a->given_back += oldest->size;
        }
        a->st.bound_frees++;
        seg_release(a, oldest);
    }
    while (a->st.reserved_total - cold > bound) {
        struct blk *big = NULL;
        for (int p = 0; p < FSDP_BCACHE_NPOOLS; p++)
            for (size_t i = 0; i < a->free[p].n; i++) {
                struct blk *b = a->free[p].v[i];
                if (!b->cold && (!big || b->size > big->size)) big = b;
            }
        if (!big) break;
        a->ops->decommit(a->ctx, (void *)big->ptr, big->size);
        big->cold = true;
        big->clean = true;
        cold += big->size;
        a->given_back += big->size;
        a->st.decommits++;
        a->st.decommitted += big->size;
    }
}

/* Gets a new segment of `size` for pool/stream, with one free block spanning it (not filed). */
static int seg_new(fsdp_bcache_t *a, int pool, size_t size, void *stream, struct blk **out) {
    void *mem = NULL;
    struct seg *s = calloc(1, sizeof *s);
    struct blk *b = calloc(1, sizeof *b);
    if (!s || !b) {
        free(s);
        free(b);
        return set_err(a, FSDP_ENOMEM, "%s allocator: out of host memory", a->opts.name);
    }
    int rc = a->ops->seg_alloc(a->ctx, size, &mem);
    if (rc == FSDP_ENOMEM) {
        a->st.oom_retries++;
        fsdp__bcache_empty_cache(a);
        rc = a->ops->seg_alloc(a->ctx, size, &mem);
    }
    if (rc < 0 || !mem) {
        free(s);
        free(b);
        return rc < 0 ? rc : FSDP_ENOMEM;
    }
    s->base = (uintptr_t)mem;
    s->size = size;
    s->pool = pool;
    s->stream = stream;
    s->first = b;
    s->next = a->segs;
    a->segs = s;
    b->ptr = s->base;
    b->size = size;
    b->seg = s;
    b->state = BLK_FREE;
    b->clean = a->opts.zeroed_segments;
    b->cold = a->ops->decommit != NULL;
    count_seg(a, pool, size, true);
    *out = b;
    return FSDP_OK;
}

int fsdp__bcache_malloc(fsdp_bcache_t *a, size_t bytes, void *stream, void **out) {
    bool clean;
    return fsdp__bcache_malloc_clean(a, bytes, stream, out, &clean);
}

int fsdp__bcache_malloc_clean(fsdp_bcache_t *a, size_t bytes, void *stream, void **out,
                              bool *clean) {
    *out = NULL;
    *clean = false;
    a->err[0] = 0;
    if (bytes > SIZE_MAX - FSDP_BCACHE_LARGE_ROUND)
        return set_err(a, FSDP_ENOMEM, "%s allocator: %zu bytes cannot be rounded", a->opts.name,
                       bytes);
    size_t size = bytes ? round_up(bytes, FSDP_BCACHE_ROUND) : FSDP_BCACHE_ROUND;
    int pool = size <= FSDP_BCACHE_SMALL_MAX ? FSDP_BCACHE_POOL_SMALL : FSDP_BCACHE_POOL_LARGE;
    int rc = fsdp__bcache_process_events(a);
    if (rc < 0) return rc;
    if (lm_reserve(&a->live) < 0)
        return set_err(a, FSDP_ENOMEM, "%s allocator: out of host memory for its block map",
                       a->opts.name);

    struct free_list *fl = &a->free[pool];
    struct blk *b = NULL;
    size_t i = fl_lower(fl, stream, size, 0);
    if (i < fl->n && fl->v[i]->seg->stream == stream) {
        b = fl->v[i];
        fl_remove(fl, b);
    } else {
        size_t seg_size = pool == FSDP_BCACHE_POOL_SMALL ? FSDP_BCACHE_SMALL_SEG
                                                         : round_up(size, FSDP_BCACHE_LARGE_ROUND);
        if (a->opts.bound_to_peak && !a->ops->decommit) {
            size_t peak = a->st.allocated_peak_total, need = a->st.allocated_total + size;
            size_t bound = need > peak ? need : peak;
            release_free_segs(a, bound > seg_size ? bound - seg_size : 0);
        }
        rc = seg_new(a, pool, seg_size, stream, &b);
        if (rc == FSDP_ENOMEM) {
            a->st.ooms++;
            size_t cached = 0;
            for (int p = 0; p < FSDP_BCACHE_NPOOLS; p++)
                for (size_t j = 0; j < a->free[p].n; j++)
                    cached += a->free[p].v[j]->size;
            return set_err(a, FSDP_ENOMEM,
                           "out of %s memory: tried to allocate %zu bytes (a %zu-byte "
                           "segment) after emptying the cache; %zu bytes reserved in %zu "
                           "segments, %zu allocated to %zu live blocks, %zu free in the cache "
                           "(fragmented or on other streams), %zu waiting for other streams",
                           a->opts.name, bytes, seg_size, a->st.reserved_total, a->st.segments,
                           a->st.allocated_total, a->st.blocks, cached, a->st.pending_blocks);
        }
        if (rc < 0)
            return set_err(a, rc, "%s allocator: the device failed to give a %zu-byte segment",
                           a->opts.name, seg_size);
    }

    /* Split the rest off when it is worth keeping as a block of its own. */
    size_t rest = b->size - size;
    size_t split_min =
        a->opts.large_split_min ? a->opts.large_split_min : FSDP_BCACHE_SMALL_MAX + 1;
    bool split = pool == FSDP_BCACHE_POOL_SMALL ? rest >= FSDP_BCACHE_ROUND : rest >= split_min;
    if (split) {
        struct blk *r = calloc(1, sizeof *r);
        if (r) {
            r->ptr = b->ptr + size;
            r->size = rest;
            r->seg = b->seg;
            r->prev = b;
            r->next = b->next;
            if (b->next) b->next->prev = r;
            b->next = r;
            b->size = size;
            r->state = BLK_FREE;
            r->clean = b->clean;
            r->cold = b->cold;
            if (fl_insert(fl, r) < 0) {
                /* Undo: the block keeps its tail. */
                b->size += r->size;
                b->next = r->next;
                if (r->next) r->next->prev = b;
                free(r);
            }
        }
    }
    *clean = b->clean;
    bool was_cold = b->cold;
    b->clean = false;
    b->cold = false;
    b->state = BLK_LIVE;
    b->req = bytes;
    b->nuse = 0;
    lm_put_nogrow(&a->live, b);
    count_alloc(a, pool, b->size, bytes);
    *out = (void *)b->ptr;
    if (was_cold && a->opts.bound_to_peak && a->ops->decommit) {
        learn_slack(a, b->size);
        keep_to_peak(a);
    }
    return FSDP_OK;
}

/* ---- queries ---- */

void fsdp__bcache_get_stats(const fsdp_bcache_t *a, fsdp_bcache_stats_t *out) {
    *out = a->st;
}

void fsdp__bcache_reset_peaks(fsdp_bcache_t *a) {
    fsdp_bcache_stats_t *s = &a->st;
    for (int p = 0; p < FSDP_BCACHE_NPOOLS; p++) {
        s->allocated_peak[p] = s->allocated[p];
        s->reserved_peak[p] = s->reserved[p];
    }
    s->allocated_peak_total = s->allocated_total;
    s->reserved_peak_total = s->reserved_total;
}

size_t fsdp__bcache_block_size(const fsdp_bcache_t *a, const void *ptr) {
    struct blk **slot = lm_find(&a->live, (uintptr_t)ptr);
    return slot ? (*slot)->size : 0;
}

const char *fsdp__bcache_last_error(const fsdp_bcache_t *a) {
    return a ? a->err : "";
}
