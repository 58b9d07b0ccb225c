/* SPDX-License-Identifier: MIT */
/*
 * t_block_cache.c: the CUDA device's caching allocator (src/device/block_cache.c) on the host.
 *
 * The allocator is generic over segments and events, so this test gives it a fake device: host
 * segments from aligned_alloc under a capacity (to make it run out), and events that complete
 * only when the test says the work of their stream has finished. Built and run in every build,
 * with or without CUDA.
 */
#include <config.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/errno.h>

#include "device/block_cache.h"
#include "tap.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

/* ---- the fake device ---- */

struct fake_ev {
    void *stream;
    int recorded, done;
};

struct fake {
    size_t cap, used;
    int fail_rc; /* != 0: the next seg_alloc fails with it */
    size_t nseg;
    void *seg[256];
    size_t seg_size[256];
    struct fake_ev *evs[256];
    size_t nev; /* events created */
    size_t ev_destroyed, records;
};

static int f_seg_alloc(void *ctx, size_t bytes, void **out) {
    struct fake *f = ctx;
    if (f->fail_rc) {
        int rc = f->fail_rc;
        f->fail_rc = 0;
        return rc;
    }
    if (f->used + bytes > f->cap || f->nseg == 256) return FSDP_ENOMEM;
    void *p = aligned_alloc(512, bytes);
    if (!p) return FSDP_ENOMEM;
    f->seg[f->nseg] = p;
    f->seg_size[f->nseg++] = bytes;
    f->used += bytes;
    *out = p;
    return FSDP_OK;
}

static void f_seg_free(void *ctx, void *ptr, size_t bytes) {
    struct fake *f = ctx;
    for (size_t i = 0; i < f->nseg; i++)
        if (f->seg[i] == ptr) {
            if (f->seg_size[i] != bytes) {
                tap_diag("fake seg_free: %p has %zu bytes, not %zu", ptr, f->seg_size[i], bytes);
                abort();
            }
            f->used -= f->seg_size[i];
            f->seg[i] = f->seg[f->nseg - 1];
            f->seg_size[i] = f->seg_size[f->nseg - 1];
            f->nseg--;
            free(ptr);
            return;
        }
    tap_diag("fake seg_free: %p is not a segment", ptr);
    abort();
}

static int f_event_create(void *ctx, void **out) {
    struct fake *f = ctx;
    if (f->nev == 256) return FSDP_ENOMEM;
    struct fake_ev *e = calloc(1, sizeof *e);
    f->evs[f->nev++] = e;
    *out = e;
    return FSDP_OK;
}

static int f_event_record(void *ctx, void *ev, void *stream) {
    struct fake *f = ctx;
    struct fake_ev *e = ev;
    e->stream = stream;
    e->recorded = 1;
    e->done = 0;
    f->records++;
    return FSDP_OK;
}

static int f_event_query(void *ctx, void *ev) {
    (void)ctx;
    return ((struct fake_ev *)ev)->done;
}

static void f_event_destroy(void *ctx, void *ev) {
    struct fake *f = ctx;
    struct fake_ev *e = ev;
    e->recorded = -1; /* the struct is freed at the end of the test */
    f->ev_destroyed++;
}

/* The work queued so far on `stream` has finished. */
static void complete(struct fake *f, void *stream) {
    for (size_t i = 0; i < f->nev; i++)
        if (f->evs[i]->recorded == 1 && f->evs[i]->stream == stream) f->evs[i]->done = 1;
}

static void fake_fini(struct fake *f) {
    for (size_t i = 0; i < f->nev; i++)
        free(f->evs[i]);
}

static const struct fsdp_bcache_ops fake_ops = {
    .seg_alloc = f_seg_alloc,
    .seg_free = f_seg_free,
    .event_create = f_event_create,
    .event_record = f_event_record,
    .event_query = f_event_query,
    .event_destroy = f_event_destroy,
};

#define S1 ((void *)0x1001)
#define S2 ((void *)0x2002)

static fsdp_bcache_t *mk(struct fake *f, size_t cap) {
    memset(f, 0, sizeof *f);
    f->cap = cap;
    fsdp_bcache_t *a = NULL;
    if (fsdp__bcache_create(&fake_ops, f, NULL, &a) < 0) tap_bail("fsdp__bcache_create failed");
    return a;
}

static void *get(fsdp_bcache_t *a, size_t n, void *stream) {
    void *p = NULL;
    int rc = fsdp__bcache_malloc(a, n, stream, &p);
    if (rc < 0) tap_diag("malloc %zu: %s", n, fsdp__bcache_last_error(a));
    return p;
}

static fsdp_bcache_stats_t stats(const fsdp_bcache_t *a) {
    fsdp_bcache_stats_t s;
    fsdp__bcache_get_stats(a, &s);
    return s;
}

static void test_reuse_rounding(void) {
    struct fake f;
    fsdp_bcache_t *a = mk(&f, 64 * MiB);
    void *p = get(a, 1000, S1);
    tap_ok(p != NULL && (uintptr_t)p % 512 == 0, "malloc 1000 gives a 512-aligned block");
    tap_is_size(fsdp__bcache_block_size(a, p), 1024, "1000 bytes round up to 1024");
    tap_is_size(stats(a).reserved[FSDP_BCACHE_POOL_SMALL], 2 * MiB,
                "the small pool reserved one 2 MiB segment");
    tap_is_int(fsdp__bcache_free(a, p), 0, "free");
    void *q = get(a, 900, S1);
    tap_ok(q == p, "a freed block is reused for a request of the same rounded size on its stream");
    tap_is_size(stats(a).seg_allocs, 1, "no second segment for the reuse");
    void *z = get(a, 0, S1);
    tap_ok(z != NULL && z != q, "malloc 0 gives a distinct valid block");
    tap_is_size(fsdp__bcache_block_size(a, z), 512, "malloc 0 holds 512 bytes");
    void *one = get(a, 1, S1);
    tap_is_size(fsdp__bcache_block_size(a, one), 512, "malloc 1 holds 512 bytes");
    tap_is_int(fsdp__bcache_free(a, z), 0, "free the 0-byte block");
    tap_is_int(fsdp__bcache_free(a, z), FSDP_EINVAL, "a second free of it is FSDP_EINVAL");
    tap_has_str(fsdp__bcache_last_error(a), "not a live block", "and the message says so");
    tap_is_int(fsdp__bcache_free(a, (char *)q + 512), FSDP_EINVAL,
               "freeing a pointer inside a block is FSDP_EINVAL");
    tap_is_int(fsdp__bcache_free(a, NULL), 0, "free(NULL) is accepted");
    fsdp__bcache_destroy(a);
    tap_is_size(f.used, 0, "destroy gives every segment back (blocks still live included)");
    fake_fini(&f);
}

static void test_split_merge_bestfit(void) {
    struct fake f;
    fsdp_bcache_t *a = mk(&f, 64 * MiB);
    char *x = get(a, 4 * KiB, S1), *y = get(a, 4 * KiB, S1), *z = get(a, 4 * KiB, S1);
    tap_ok(y == x + 4 * KiB && z == y + 4 * KiB,
           "consecutive small requests are carved in order from one segment (split)");
    char *w = get(a, 8 * KiB, S1), *v = get(a, 4 * KiB, S1), *u = get(a, 4 * KiB, S1);
    (void)u;
    tap_ok(w == z + 4 * KiB && v == w + 8 * KiB, "and so are the next ones");
    /* Holes: [x,y) 8 KiB after freeing x and y (merged), w's 8 KiB, and z's 4 KiB alone. */
    fsdp__bcache_free(a, y);
    fsdp__bcache_free(a, x);
    char *m = get(a, 8 * KiB, S1);
    tap_ok(m == x, "two freed neighbours merge into one block that serves a request of both");
    fsdp__bcache_free(a, w);
    fsdp__bcache_free(a, z);
    /* z (4 KiB) and w (8 KiB) are neighbours: they merged into 12 KiB at z. */
    char *n = get(a, 12 * KiB, S1);
    tap_ok(n == z, "a block freed between a free neighbour and a live one merges with it");
    fsdp__bcache_free(a, n);
    fsdp__bcache_free(a, v);
    /* Free now: [z, u) = 16 KiB and the segment's tail (after u, ~2 MiB). A 12 KiB request
     * takes the best fit: the 16 KiB hole, not the tail. */
    char *b = get(a, 12 * KiB, S1);
    tap_ok(b == z, "best fit: the smallest free block that fits, not the big tail");
    char *c = get(a, 4 * KiB, S1);
    tap_ok(c == z + 12 * KiB, "the 4 KiB left of the split serves the next 4 KiB request");
    tap_is_size(stats(a).seg_allocs, 1, "all of it from one segment");
    fsdp__bcache_free(a, b);
    fsdp__bcache_free(a, c);
    fsdp__bcache_free(a, m);
    fsdp__bcache_free(a, u);
    fsdp_bcache_stats_t s = stats(a);
    tap_is_size(s.allocated_total, 0, "nothing allocated after freeing everything");
    tap_is_size(s.reserved_total, 2 * MiB, "the segment stays cached");
    tap_is_size(fsdp__bcache_empty_cache(a), 2 * MiB,
                "empty_cache gives back the segment, merged whole again");
    tap_is_size(stats(a).reserved_total, 0, "nothing reserved after empty_cache");
    tap_is_size(f.used, 0, "the fake device has its memory back");
    fsdp__bcache_destroy(a);
    fake_fini(&f);
}

static void test_pools(void) {
    struct fake f;
    fsdp_bcache_t *a = mk(&f, 256 * MiB);
    void *s1 = get(a, MiB, S1);
    fsdp_bcache_stats_t s = stats(a);
    tap_ok(s.reserved[FSDP_BCACHE_POOL_SMALL] == 2 * MiB && s.reserved[FSDP_BCACHE_POOL_LARGE] == 0,
           "1 MiB is the largest small request (a 2 MiB small segment)");
    void *l1 = get(a, MiB + 1, S1);
    s = stats(a);
    tap_is_size(s.reserved[FSDP_BCACHE_POOL_LARGE], 2 * MiB,
                "1 MiB + 1 goes to the large pool, in a segment rounded to 2 MiB");
    tap_is_size(fsdp__bcache_block_size(a, l1), 2 * MiB,
                "and keeps the whole segment (a 1 MiB - 511 tail is not split off)");
    void *l2 = get(a, 5 * MiB, S1);
    tap_is_size(stats(a).reserved[FSDP_BCACHE_POOL_LARGE], 8 * MiB, "5 MiB reserves 6 MiB more");
    fsdp__bcache_free(a, l2);
    void *l3 = get(a, 3 * MiB, S1);
    tap_ok(l3 == l2, "a large request reuses a free large block");
    tap_is_size(fsdp__bcache_block_size(a, l3), 3 * MiB,
                "and splits it when more than 1 MiB remains");
    void *l4 = get(a, 3 * MiB, S1);
    tap_ok(l4 == (char *)l2 + 3 * MiB, "the 3 MiB tail serves the next 3 MiB request");
    tap_is_size(stats(a).seg_allocs, 3, "three segments in all (one small, two large)");
    void *s2 = get(a, 512 * KiB, S1);
    tap_ok((char *)s2 >= (char *)s1 && (char *)s2 < (char *)s1 + 2 * MiB,
           "small requests stay in the small segment");
    s = stats(a);
    tap_is_size(s.allocated[FSDP_BCACHE_POOL_SMALL], MiB + 512 * KiB, "small pool allocated bytes");
    tap_is_size(s.allocated[FSDP_BCACHE_POOL_LARGE], 8 * MiB, "large pool allocated bytes");
    tap_is_size(s.requested_total, MiB + MiB + 1 + 6 * MiB + 512 * KiB, "requested bytes");
    fsdp__bcache_destroy(a);
    tap_is_size(f.used, 0, "destroy gives back every segment");
    fake_fini(&f);
}

static void test_streams(void) {
    struct fake f;
    fsdp_bcache_t *a = mk(&f, 64 * MiB);
    void *p = get(a, 64 * KiB, S1);
    fsdp__bcache_free(a, p);
    void *q = get(a, 64 * KiB, S2);
    tap_ok(q != p, "a block freed on stream 1 is not handed to stream 2");
    tap_is_size(stats(a).seg_allocs, 2, "stream 2 gets its own segment");
    void *r = get(a, 64 * KiB, S1);
    tap_ok(r == p, "stream 1 gets its block back");

    /* r is used by work on stream 2 too. */
    tap_is_int(fsdp__bcache_record_stream(a, (char *)r + 100, S2), 0,
               "record_stream with a pointer inside the block");
    tap_is_int(fsdp__bcache_record_stream(a, r, S1), 0,
               "record_stream on the block's own stream is accepted (and ignored)");
    size_t rec0 = f.records;
    tap_is_int(fsdp__bcache_free(a, r), 0, "free of a block used on another stream");
    tap_is_size(f.records - rec0, 1, "records one event (stream 2 only)");
    tap_is_size(stats(a).pending_blocks, 1, "the block waits for it");
    void *s = get(a, 64 * KiB, S1);
    tap_ok(s != r, "while stream 2's work is pending the block is not reused");
    tap_is_int(fsdp__bcache_process_events(a), 0, "processing events frees nothing yet");
    complete(&f, S1);
    tap_is_int(fsdp__bcache_process_events(a), 0,
               "completing stream 1's work does not release it either");
    complete(&f, S2);
    tap_is_int(fsdp__bcache_process_events(a), 1, "completing stream 2's event releases it");
    tap_is_size(stats(a).pending_blocks, 0, "nothing pending");
    void *t = get(a, 64 * KiB, S1);
    tap_ok(t == r, "and stream 1 reuses it");

    /* Two other streams: both must complete; malloc processes events itself. */
    fsdp__bcache_record_stream(a, t, S2);
    fsdp__bcache_record_stream(a, t, (void *)0x3003);
    fsdp__bcache_free(a, t);
    complete(&f, S2);
    void *u = get(a, 64 * KiB, S1);
    tap_ok(u != t, "with one of two streams complete the block still waits");
    complete(&f, (void *)0x3003);
    void *v = get(a, 64 * KiB, S1);
    tap_ok(v == t, "malloc collects completed events by itself");
    tap_is_int(fsdp__bcache_record_stream(a, (void *)0x10, S2), FSDP_EINVAL,
               "record_stream of a pointer outside every block is FSDP_EINVAL");
    fsdp__bcache_free(a, q);
    fsdp__bcache_free(a, s);
    fsdp__bcache_free(a, u);
    fsdp__bcache_free(a, v);
    tap_is_size(fsdp__bcache_empty_cache(a), 4 * MiB, "empty_cache releases both segments");
    /* A pending block keeps its segment. */
    void *w = get(a, 4 * KiB, S1);
    fsdp__bcache_record_stream(a, w, S2);
    fsdp__bcache_free(a, w);
    tap_is_size(fsdp__bcache_empty_cache(a), 0,
                "empty_cache keeps a segment whose block waits for another stream");
    complete(&f, S2);
    tap_is_size(fsdp__bcache_empty_cache(a), 2 * MiB,
                "and releases it once the event has completed");
    fsdp__bcache_destroy(a);
    tap_is_size(f.ev_destroyed, f.nev, "every event created was destroyed");
    fake_fini(&f);
}

static void test_oom(void) {
    struct fake f;
    fsdp_bcache_t *a = mk(&f, 6 * MiB);
    void *p = get(a, 4 * MiB, S1);
    fsdp__bcache_free(a, p);
    tap_is_size(stats(a).reserved_total, 4 * MiB, "4 MiB cached for stream 1");
    void *q = get(a, 4 * MiB, S2);
    fsdp_bcache_stats_t s = stats(a);
    tap_ok(q != NULL, "a 4 MiB request on stream 2 succeeds after freeing the cache");
    tap_is_size(s.oom_retries, 1, "after one retry");
    tap_is_size(s.seg_frees, 1, "which gave back stream 1's cached segment");
    tap_is_size(s.reserved_total, 4 * MiB, "reserved stays at 4 MiB");
    void *r = NULL;
    int rc = fsdp__bcache_malloc(a, 4 * MiB, S2, &r);
    tap_is_int(rc, FSDP_ENOMEM, "a second 4 MiB does not fit in 6 MiB: FSDP_ENOMEM");
    tap_ok(r == NULL, "out is NULL");
    const char *msg = fsdp__bcache_last_error(a);
    tap_has_str(msg, "4194304 bytes", "the message gives the request");
    tap_has_str(msg, "4194304 bytes reserved", "the reserved bytes");
    tap_has_str(msg, "4194304 allocated", "and the allocated bytes");
    tap_is_size(stats(a).ooms, 1, "the failure is counted");
    void *small = get(a, KiB, S2);
    tap_ok(small != NULL, "a request that fits still succeeds after a failure");
    f.fail_rc = FSDP_EBACKEND;
    rc = fsdp__bcache_malloc(a, 8 * MiB, S1, &r);
    tap_is_int(rc, FSDP_EBACKEND, "a device failure other than out-of-memory is passed on");
    tap_is_size(stats(a).oom_retries, 2, "without emptying the cache for it");
    fsdp__bcache_free(a, q);
    fsdp__bcache_free(a, small);
    fsdp__bcache_destroy(a);
    fake_fini(&f);
}

static void test_accounting(void) {
    struct fake f;
    fsdp_bcache_t *a = mk(&f, 64 * MiB);
    void *p = get(a, 3000, S1), *q = get(a, 3 * MiB, S1);
    fsdp_bcache_stats_t s = stats(a);
    tap_is_size(s.allocated_total, 3072 + 4 * MiB, "allocated counts rounded blocks");
    tap_is_size(s.requested_total, 3000 + 3 * MiB, "requested counts the sizes asked for");
    tap_is_size(s.blocks, 2, "two live blocks");
    tap_is_size(s.reserved_total, 6 * MiB, "reserved: a small and a large segment");
    fsdp__bcache_free(a, q);
    s = stats(a);
    tap_is_size(s.allocated_total, 3072, "free lowers allocated");
    tap_is_size(s.allocated_peak_total, 3072 + 4 * MiB, "the peak stays");
    tap_is_size(s.allocated_peak[FSDP_BCACHE_POOL_LARGE], 4 * MiB, "per pool too");
    fsdp__bcache_reset_peaks(a);
    s = stats(a);
    tap_is_size(s.allocated_peak_total, 3072, "reset_peaks sets the peak to the current value");
    tap_is_size(s.reserved_peak_total, 6 * MiB, "reserved peak = reserved (still cached)");
    fsdp__bcache_empty_cache(a);
    s = stats(a);
    tap_is_size(s.reserved_total, 2 * MiB, "empty_cache keeps the segment with a live block");
    tap_is_size(s.segments, 1, "one segment held");
    fsdp__bcache_free(a, p);
    fsdp__bcache_destroy(a);
    fake_fini(&f);
}

/* Random mallocs and frees on two streams: every block keeps its own bytes (no two live blocks
 * overlap), and the pools end whole. */
static void test_random(void) {
    struct fake f;
    fsdp_bcache_t *a = mk(&f, 512 * MiB);
    enum { N = 64 };
    unsigned char *live[N] = {0};
    size_t sz[N] = {0};
    uint64_t x = 0x9E3779B97F4A7C15u;
    size_t bad = 0, fails = 0;
    for (int it = 0; it < 4000; it++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        int i = (int)(x % N);
        if (live[i]) {
            for (size_t k = 0; k < sz[i]; k += 97)
                if (live[i][k] != (unsigned char)i) bad++;
            if (fsdp__bcache_free(a, live[i]) < 0) fails++;
            live[i] = NULL;
        } else {
            size_t n = (x >> 20) % 4 == 0 ? (size_t)((x >> 24) % (3 * MiB)) + 1
                                          : (size_t)((x >> 24) % (64 * KiB)) + 1;
            void *st = (x >> 40) & 1 ? S2 : S1;
            if (fsdp__bcache_malloc(a, n, st, (void **)&live[i]) < 0) {
                fails++;
                continue;
            }
            sz[i] = n;
            memset(live[i], i, n);
        }
    }
    tap_is_size(bad, 0, "4000 random operations: no block was overwritten by another");
    tap_is_size(fails, 0, "and none failed");
    for (int i = 0; i < N; i++)
        if (live[i]) fsdp__bcache_free(a, live[i]);
    fsdp_bcache_stats_t s = stats(a);
    tap_is_size(s.allocated_total + s.requested_total + s.blocks, 0, "counters back to 0");
    size_t reserved = s.reserved_total;
    tap_is_size(fsdp__bcache_empty_cache(a), reserved,
                "every segment merged back whole and was released");
    tap_is_size(f.used, 0, "the fake device has all its memory");
    fsdp__bcache_destroy(a);
    fake_fini(&f);
}

/* ---- a CPU-like backend: zeroed segments, decommit, no events ---- */

struct decommit_log {
    size_t calls, bytes;
    void *last;
    size_t last_bytes;
};

static struct decommit_log dlog;

static int z_seg_alloc(void *ctx, size_t bytes, void **out) {
    int rc = f_seg_alloc(ctx, bytes, out);
    if (rc == 0) memset(*out, 0, bytes);
    return rc;
}

static void z_decommit(void *ctx, void *ptr, size_t bytes) {
    (void)ctx;
    memset(ptr, 0, bytes);
    dlog.calls++;
    dlog.bytes += bytes;
    dlog.last = ptr;
    dlog.last_bytes = bytes;
}

static const struct fsdp_bcache_ops zero_ops = {
    .seg_alloc = z_seg_alloc, .seg_free = f_seg_free, .decommit = z_decommit};
static const struct fsdp_bcache_ops zero_nodecommit_ops = {.seg_alloc = z_seg_alloc,
                                                           .seg_free = f_seg_free};

static fsdp_bcache_t *mk_opts(struct fake *f, const struct fsdp_bcache_ops *ops,
                              const fsdp_bcache_opts_t *o) {
    memset(f, 0, sizeof *f);
    f->cap = 256 * MiB;
    memset(&dlog, 0, sizeof dlog);
    fsdp_bcache_t *a = NULL;
    if (fsdp__bcache_create(ops, f, o, &a) < 0) tap_bail("fsdp__bcache_create failed");
    return a;
}

static void *get_clean(fsdp_bcache_t *a, size_t n, bool *clean) {
    void *p = NULL;
    if (fsdp__bcache_malloc_clean(a, n, NULL, &p, clean) < 0)
        tap_diag("malloc %zu: %s", n, fsdp__bcache_last_error(a));
    return p;
}

static int all_zero(const void *p, size_t n) {
    const unsigned char *q = p;
    for (size_t i = 0; i < n; i++)
        if (q[i]) return 0;
    return 1;
}

/* Backends without events; the zero tracking; where the rest of a large block is split. */
static void test_cpu_backend(void) {
    struct fake f;
    fsdp_bcache_t *a = NULL;
    const struct fsdp_bcache_ops half = {
        .seg_alloc = z_seg_alloc, .seg_free = f_seg_free, .event_create = f_event_create};
    tap_is_int(fsdp__bcache_create(&half, &f, NULL, &a), FSDP_EINVAL,
               "some event functions but not all: FSDP_EINVAL");
    const fsdp_bcache_opts_t zo = {.name = "cpu", .zeroed_segments = true};
    a = mk_opts(&f, &zero_nodecommit_ops, &zo);
    bool clean = false;
    char *p = get_clean(a, 2 * MiB + 512 * KiB, &clean);
    tap_ok(p && clean, "zeroed segments: a block of a new segment is clean");
    tap_is_int(fsdp__bcache_record_stream(a, p, S1), FSDP_ENOTSUP,
               "record_stream without events: FSDP_ENOTSUP");
    tap_has_str(fsdp__bcache_last_error(a), "cpu allocator", "and the message names the memory");
    /* 4 MiB segment: 2.5 handed out, 1.5 left (more than 1 MiB: split by default). */
    char *q = get_clean(a, 1536 * KiB, &clean);
    tap_ok(q == p + 2 * MiB + 512 * KiB && clean, "the split-off rest is clean too");
    memset(p, 0xee, 2 * MiB + 512 * KiB);
    memset(q, 0xdd, 1536 * KiB);
    fsdp__bcache_free(a, p);
    fsdp__bcache_free(a, q);
    char *r = get_clean(a, 4 * MiB, &clean);
    tap_ok(r == p && !clean, "memory that was handed out is not clean after it is freed");
    fsdp__bcache_free(a, r);
    /* Default split: a 1.5 MiB request in a 2 MiB segment keeps its 0.5 MiB rest. */
    fsdp__bcache_empty_cache(a);
    char *s1 = get(a, 1536 * KiB, NULL);
    tap_is_size(fsdp__bcache_block_size(a, s1), 2 * MiB,
                "default: a rest of at most 1 MiB stays with the large block");
    fsdp__bcache_destroy(a);
    fake_fini(&f);

    const fsdp_bcache_opts_t so = {.large_split_min = 64 * KiB};
    a = mk_opts(&f, &zero_nodecommit_ops, &so);
    s1 = get(a, 1536 * KiB, NULL);
    tap_is_size(fsdp__bcache_block_size(a, s1), 1536 * KiB,
                "large_split_min 64 KiB: the 0.5 MiB rest is split off");
    get_clean(a, 1536 * KiB, &clean);
    tap_ok(!clean, "without zeroed_segments nothing is clean");
    fsdp__bcache_destroy(a);
    fake_fini(&f);
}

/* bound_to_peak and max_cached. */
static void test_footprint(void) {
    struct fake f;
    /* Without decommit: before a new segment, wholly free ones go back to stay under the peak. */
    const fsdp_bcache_opts_t bo = {.bound_to_peak = true};
    fsdp_bcache_t *a = mk_opts(&f, &zero_nodecommit_ops, &bo);
    fsdp__bcache_free(a, get(a, 4 * MiB, NULL));
    void *p = get(a, 6 * MiB, NULL);
    fsdp_bcache_stats_t s = stats(a);
    tap_ok(p && s.reserved_total == 6 * MiB && s.bound_frees == 1 && s.seg_frees == 1,
           "bound_to_peak: a new 6 MiB peak gives the free 4 MiB segment back first (reserved "
           "%zu MiB)",
           s.reserved_total / MiB);
    fsdp__bcache_free(a, p);
    p = get(a, 2 * MiB, NULL);
    s = stats(a);
    tap_ok(s.reserved_total == 6 * MiB && s.seg_allocs == 2,
           "under the peak, a smaller request is carved from the cached segment");
    fsdp__bcache_destroy(a);
    fake_fini(&f);

    /* With decommit: resident bytes (segments less cold free blocks) stay within the peak. */
    const fsdp_bcache_opts_t dc = {.zeroed_segments = true, .bound_to_peak = true};
    a = mk_opts(&f, &zero_ops, &dc);
    char *x = get(a, 4 * MiB, NULL), *y = get(a, 4 * MiB, NULL);
    memset(x, 1, 4 * MiB);
    memset(y, 2, 4 * MiB);
    fsdp__bcache_free(a, x);
    fsdp__bcache_free(a, y); /* peak 8 MiB, all of it resident and free */
    char *c = get(a, 2 * MiB, NULL);
    tap_is_size(dlog.calls, 0, "a block of resident memory is handed out without a check");
    char *other = c == x ? y : x;
    bool clean = false;
    char *d = get_clean(a, 6 * MiB, &clean); /* new segment: 4 + 4 + 6 held, 8 allocated */
    s = stats(a);
    tap_ok(d && clean && s.reserved_total == 10 * MiB && s.bound_frees == 1,
           "decommit: the wholly free 4 MiB segment goes back first (reserved %zu MiB)",
           s.reserved_total / MiB);
    tap_ok(dlog.calls == 1 && dlog.last == c + 2 * MiB && dlog.last_bytes == 2 * MiB &&
               s.decommits == 1 && s.decommitted == 2 * MiB,
           "then the pages of the 2 MiB free block beside the live 2 MiB are given back");
    (void)other;
    char *e = get_clean(a, 2 * MiB, &clean);
    tap_ok(e == c + 2 * MiB && clean && all_zero(e, 2 * MiB),
           "a decommitted block reads as zero and is handed out clean");
    s = stats(a);
    tap_ok(s.decommits == 1 && s.allocated_peak_total == 10 * MiB,
           "handing it out raises the peak to what is resident: no further decommit");
    fsdp__bcache_destroy(a);
    fake_fini(&f);

    /* The same with 50% slack: 14 MiB held against a bound of 12: only the segment goes back. */
    const fsdp_bcache_opts_t sl = {
        .zeroed_segments = true, .bound_to_peak = true, .bound_slack_pct = 50};
    a = mk_opts(&f, &zero_ops, &sl);
    x = get(a, 4 * MiB, NULL);
    y = get(a, 4 * MiB, NULL);
    fsdp__bcache_free(a, x);
    fsdp__bcache_free(a, y);
    get(a, 2 * MiB, NULL);
    get(a, 6 * MiB, NULL);
    s = stats(a);
    tap_ok(s.reserved_total == 10 * MiB && s.bound_frees == 1 && s.decommits == 0,
           "bound_slack_pct 50: within 12 MiB after the segment went back, no decommit");
    fsdp__bcache_destroy(a);
    fake_fini(&f);

    /* A slack floor: 10% of the 8 MiB peak is under 1 MiB, but bound_slack_min 6 MiB lets the
     * 14 MiB held stay (8 + 6): neither the segment nor a page goes back. */
    const fsdp_bcache_opts_t sm = {.zeroed_segments = true,
                                   .bound_to_peak = true,
                                   .bound_slack_pct = 10,
                                   .bound_slack_min = 6 * MiB};
    a = mk_opts(&f, &zero_ops, &sm);
    x = get(a, 4 * MiB, NULL);
    y = get(a, 4 * MiB, NULL);
    fsdp__bcache_free(a, x);
    fsdp__bcache_free(a, y);
    get(a, 2 * MiB, NULL);
    get(a, 6 * MiB, NULL);
    s = stats(a);
    tap_ok(s.reserved_total == 14 * MiB && s.bound_frees == 0 && s.decommits == 0,
           "bound_slack_min 6 MiB over a 10%% slack: 14 MiB held within 8 + 6, nothing given back "
           "(reserved %zu MiB)",
           s.reserved_total / MiB);
    fsdp__bcache_destroy(a);
    fake_fini(&f);

    /* The learned slack. A live 8 MiB block, then every "step" a 4 MiB block touched and freed
     * and two small ones (a 2 MiB small-pool segment): 14 MiB of working set against a bound of
     * 12 + 1. A fixed slack gives a segment back every step and maps one again (the 4 MiB or
     * the small one, in turn); the learned slack takes the 1 MiB the working set needs past it
     * once the given-back 4 MiB is needed again, and from then on nothing is mapped. */
    const fsdp_bcache_opts_t ls = {.zeroed_segments = true,
                                   .bound_to_peak = true,
                                   .bound_slack_min = 1 * MiB,
                                   .large_split_min = 64 * KiB};
    a = mk_opts(&f, &zero_ops, &ls);
    memset(get(a, 8 * MiB, NULL), 3, 8 * MiB);
    size_t maps_after[6] = {0}, most_over = 0;
    for (int step = 0; step < 6; step++) {
        char *big = get(a, 4 * MiB, NULL);
        if (big) memset(big, 4, 4 * MiB);
        fsdp__bcache_free(a, big);
        char *s1 = get(a, 1 * MiB, NULL), *s2 = get(a, 1 * MiB, NULL);
        if (s1 && s2) memset(s1, 5, 1 * MiB), memset(s2, 6, 1 * MiB);
        fsdp__bcache_free(a, s1);
        fsdp__bcache_free(a, s2);
        s = stats(a);
        maps_after[step] = s.seg_allocs;
        size_t resident = s.reserved_total, bound = s.allocated_peak_total + 2 * MiB;
        if (resident > bound && resident - bound > most_over) most_over = resident - bound;
    }
    s = stats(a);
    tap_ok(s.slack_learned == 1 * MiB && s.reserved_total == 14 * MiB,
           "learned slack: the memory given back and needed again adds 1 MiB (learned %zu KiB, "
           "reserved %zu MiB)",
           s.slack_learned / KiB, s.reserved_total / MiB);
    tap_ok(maps_after[5] == maps_after[2] && maps_after[2] > maps_after[0],
           "then no step maps a segment (segments mapped after steps 1, 3, 6: %zu, %zu, %zu)",
           maps_after[0], maps_after[2], maps_after[5]);
    tap_is_size(most_over, 0, "and what is held never passed the peak plus twice the slack");
    fsdp__bcache_destroy(a);
    fake_fini(&f);

    /* max_cached: more than 3 MiB held and not allocated goes back, whole segments at a time. */
    const fsdp_bcache_opts_t mc = {.max_cached = 3 * MiB};
    a = mk_opts(&f, &zero_nodecommit_ops, &mc);
    fsdp__bcache_free(a, get(a, 4 * MiB, NULL));
    s = stats(a);
    tap_ok(s.reserved_total == 0 && s.seg_frees == 1,
           "max_cached 3 MiB: a freed 4 MiB segment goes back");
    fsdp__bcache_free(a, get(a, 2 * MiB, NULL));
    tap_is_size(stats(a).reserved_total, 2 * MiB, "a freed 2 MiB segment stays");
    fsdp__bcache_destroy(a);
    tap_is_size(f.used, 0, "every segment is given back with the size it was taken at");
    fake_fini(&f);
}

int main(void) {
    tap_plan_lazy();
    test_reuse_rounding();
    test_split_merge_bestfit();
    test_pools();
    test_streams();
    test_oom();
    test_accounting();
    test_random();
    test_cpu_backend();
    test_footprint();
    return tap_done();
}
