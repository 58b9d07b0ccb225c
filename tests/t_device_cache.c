/* SPDX-License-Identifier: MIT */
/*
 * t_device_cache.c: the CPU device's memory cache (block_cache.c under cpu.c): freed blocks come
 * back for the same size and stay aligned while accounting follows what is in use; the bound
 * that keeps resident memory near the allocation peak (a freed block serves smaller requests,
 * a new peak gives back what would pass it, FSDP_CPU_CACHE_MB); zeroed allocations clear only
 * memory used before. Under AddressSanitizer the cache is off, and the checks say so.
 */
#include <config.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "core/sanitizer.h"
#include "device/cpu_impl.h"
#include "device/device_impl.h"
#include "tap.h"

/* Freed blocks are kept per device and handed back for the same size, so a training step does
 * not fault its activations' pages in again; accounting still follows what is in use. */
static void test_cache(void) {
    fsdp_ctx_t *c = NULL;
    fsdp_device_t *d = NULL;
    fsdp_ctx_create(NULL, &c);
    fsdp_device_create(c, FSDP_DEVICE_CPU, NULL, &d);
    void *a = NULL, *b = NULL, *small = NULL;
    fsdp_device_alloc(d, FSDP_MEM_ACTIVATIONS, (size_t)1 << 20, &a);
    fsdp_device_free(d, a);
    fsdp_mem_stats_t st;
    fsdp_mem_get_stats(c, &st);
    tap_is_size(st.current[FSDP_MEM_ACTIVATIONS], 0, "cache: a freed block is not counted");
    fsdp_device_alloc(d, FSDP_MEM_GRADS, (size_t)1 << 20, &b);
#if FSDP_UNDER_ASAN
    tap_ok(1, "cache: off under AddressSanitizer (use-after-free stays visible)");
#else
    tap_ok(a == b, "cache: the same size gets the cached block back");
#endif
    tap_ok(((uintptr_t)b & 63) == 0, "cache: blocks stay 64-byte aligned");
    fsdp_device_alloc(d, FSDP_MEM_OTHER, 100, &small);
    tap_ok(small && ((uintptr_t)small & 63) == 0, "cache: small blocks are 64-byte aligned too");
    fsdp_device_free(d, small);
    fsdp_device_free(d, b);
    fsdp_device_destroy(d);
    fsdp_ctx_destroy(c);
}

/* Fills n bytes at p and checks them: the pages of a (reused, shrunk) block are there. */
static int touch(void *p, size_t n, unsigned char v) {
    memset(p, v, n);
    const unsigned char *q = p;
    for (size_t i = 0; i < n; i += 4093)
        if (q[i] != v) return 0;
    return q[n - 1] == v;
}

/* The CPU device's block cache (block_cache.h, tested on its own in t_block_cache): memory freed
 * as one size serves others, the segments held stay within the peak of bytes allocated, and
 * FSDP_CPU_CACHE_MB bounds what is held unallocated. */
static void test_cache_bound(void) {
    const size_t M = (size_t)1 << 20;
    fsdp_ctx_t *c = NULL;
    fsdp_device_t *d = NULL;
    fsdp_bcache_stats_t st;
    fsdp_ctx_create(NULL, &c);
    fsdp_device_create(c, FSDP_DEVICE_CPU, NULL, &d);
#if FSDP_UNDER_ASAN
    tap_ok(!fsdp__cpu_cache_stats(d, &st), "cache bound: off under AddressSanitizer");
    tap_skip(6, "the cache is off under AddressSanitizer");
#else
    tap_ok(fsdp__cpu_cache_stats(d, &st) && st.reserved_total == 0, "cache bound: on, and empty");
    fsdp_bcache_stats_t st0;
    void *e = NULL, *f = NULL, *g = NULL, *x = NULL, *y = NULL;
    fsdp_device_alloc(d, FSDP_MEM_ACTIVATIONS, 80 * M, &e);
    fsdp_device_free(d, e);
    fsdp__cpu_cache_stats(d, &st0);
    /* Two 30 MiB blocks out of the freed 80 MiB one: no new mapping. (Sizes well above the
     * slack's 16 MiB floor, so that the bound can be seen at work.) */
    fsdp_device_alloc(d, FSDP_MEM_ACTIVATIONS, 30 * M, &f);
    fsdp_device_alloc(d, FSDP_MEM_ACTIVATIONS, 30 * M, &g);
    fsdp__cpu_cache_stats(d, &st);
    char *lo = e, *hi = (char *)e + 80 * M;
    tap_ok(st.seg_allocs == st0.seg_allocs && (char *)f >= lo && (char *)f + 30 * M <= hi &&
               (char *)g >= lo && (char *)g + 30 * M <= hi && f != g,
           "cache bound: a freed 80 MiB block serves two 30 MiB requests (%zu segments mapped)",
           st.seg_allocs - st0.seg_allocs);
    tap_ok(f && g && touch(f, 30 * M, 0x11) && touch(g, 30 * M, 0x22) &&
               ((unsigned char *)f)[30 * M - 1] == 0x11,
           "cache bound: the two blocks are usable and do not overlap");
    fsdp_device_free(d, f);
    fsdp_device_free(d, g);
    fsdp_device_alloc(d, FSDP_MEM_ACTIVATIONS, 80 * M, &x);
    fsdp__cpu_cache_stats(d, &st);
    tap_ok(x == e && st.seg_allocs == st0.seg_allocs,
           "cache bound: freed, they merge back into the 80 MiB block");
    fsdp_device_free(d, x);
    /* 100 MiB: with the freed 80 MiB segment, more than the new peak plus its slack (125 MiB),
     * so the wholly free segment goes back first. */
    fsdp_device_alloc(d, FSDP_MEM_ACTIVATIONS, 100 * M, &y);
    fsdp__cpu_cache_stats(d, &st);
    tap_ok(st.reserved_total == 100 * M && st.allocated_peak_total == 100 * M &&
               st.bound_frees == st0.bound_frees + 1,
           "cache bound: a new peak gives back what would exceed it (reserved %zu MiB, peak %zu "
           "MiB)",
           st.reserved_total / M, st.allocated_peak_total / M);
    tap_ok(y && touch(y, 100 * M, 0x5a), "cache bound: the new block is usable");
    fsdp_device_free(d, y);
    fsdp__cpu_cache_stats(d, &st);
    tap_ok(st.allocated_total == 0 && st.reserved_total == 100 * M,
           "cache bound: freed, it stays cached under the limit (reserved %zu MiB)",
           st.reserved_total / M);
#endif
    fsdp_device_destroy(d);
    fsdp_ctx_destroy(c);

    /* FSDP_CPU_CACHE_MB=2: a freed 4 MiB segment is more than may be held, and goes back. */
    setenv("FSDP_CPU_CACHE_MB", "2", 1);
    fsdp_ctx_create(NULL, &c);
    fsdp_device_create(c, FSDP_DEVICE_CPU, NULL, &d);
#if !FSDP_UNDER_ASAN
    void *h = NULL;
    fsdp_device_alloc(d, FSDP_MEM_ACTIVATIONS, 4 * M, &h);
    fsdp_device_free(d, h);
    fsdp__cpu_cache_stats(d, &st);
    tap_ok(st.reserved_total == 0 && st.seg_frees == 1,
           "cache limit: FSDP_CPU_CACHE_MB=2 gives a freed 4 MiB segment back (reserved %zu)",
           st.reserved_total);
    fsdp_device_alloc(d, FSDP_MEM_ACTIVATIONS, M / 2, &h);
    fsdp_device_free(d, h);
    fsdp__cpu_cache_stats(d, &st);
    tap_ok(st.reserved_total == 2 * M, "cache limit: a 2 MiB small-pool segment stays (%zu)",
           st.reserved_total);
#else
    tap_skip(2, "the cache is off under AddressSanitizer");
#endif
    fsdp_device_destroy(d);
    fsdp_ctx_destroy(c);

    /* Off: nothing is cached or counted. */
    setenv("FSDP_CPU_CACHE_MB", "0", 1);
    fsdp_ctx_create(NULL, &c);
    fsdp_device_create(c, FSDP_DEVICE_CPU, NULL, &d);
    void *k = NULL;
    fsdp_device_alloc(d, FSDP_MEM_ACTIVATIONS, M, &k);
    int usable = k && touch(k, M, 3) && ((uintptr_t)k & 63) == 0;
    fsdp_device_free(d, k);
    tap_ok(usable && !fsdp__cpu_cache_stats(d, &st) && st.reserved_total == 0,
           "cache off (FSDP_CPU_CACHE_MB=0): blocks come and go uncounted");
    fsdp_device_destroy(d);
    fsdp_ctx_destroy(c);
    unsetenv("FSDP_CPU_CACHE_MB");
}

/* Whether n bytes at p are all zero. */
static int all_zero(const void *p, size_t n) {
    const unsigned char *q = p;
    for (size_t i = 0; i < n; i++)
        if (q[i]) return 0;
    return 1;
}

/* fsdp__device_alloc_zeroed gives zeroed memory however the block was obtained: a new mapping
 * (zero from the system), a dirty block back from the cache, a shrunk cached block, a small
 * heap block, and with the cache off; and it is counted like any allocation. */
static void test_alloc_zeroed(void) {
    const size_t M = (size_t)1 << 20;
    fsdp_ctx_t *c = NULL;
    fsdp_device_t *d = NULL;
    fsdp_ctx_create(NULL, &c);
    fsdp_device_create(c, FSDP_DEVICE_CPU, NULL, &d);
    void *a = NULL, *b = NULL, *e = NULL, *s = NULL;
    int rc = fsdp__device_alloc_zeroed(d, FSDP_MEM_GRADS, M + 100, &a);
    tap_ok(rc == 0 && a && all_zero(a, M + 100), "alloc_zeroed: a new large block is zero");
    fsdp_mem_stats_t st;
    fsdp_mem_get_stats(c, &st);
    tap_is_size(st.current[FSDP_MEM_GRADS], M + 100, "alloc_zeroed: counted at the bytes asked");
    memset(a, 0xab, M + 100);
    fsdp_device_free(d, a);
    rc = fsdp__device_alloc_zeroed(d, FSDP_MEM_GRADS, M + 100, &b);
    tap_ok(rc == 0 && b && all_zero(b, M + 100),
           "alloc_zeroed: a dirty block back from the cache is cleared");
    memset(b, 0xcd, M + 100);
    fsdp_device_free(d, b);
    /* At least half of the cached block: it is shrunk and handed out, and must be cleared. */
    rc = fsdp__device_alloc_zeroed(d, FSDP_MEM_GRADS, M * 3 / 4, &e);
    tap_ok(rc == 0 && e && all_zero(e, M * 3 / 4), "alloc_zeroed: a shrunk cached block is zero");
    rc = fsdp__device_alloc_zeroed(d, FSDP_MEM_GRADS, 100, &s);
    tap_ok(rc == 0 && s && ((uintptr_t)s & 63) == 0 && all_zero(s, 100),
           "alloc_zeroed: a small block is zero and aligned");
    fsdp_device_free(d, e);
    fsdp_device_free(d, s);
    fsdp_device_destroy(d);
    fsdp_ctx_destroy(c);

    setenv("FSDP_CPU_CACHE_MB", "0", 1);
    fsdp_ctx_create(NULL, &c);
    fsdp_device_create(c, FSDP_DEVICE_CPU, NULL, &d);
    int ok = 1;
    for (int i = 0; i < 3; i++) {
        rc = fsdp__device_alloc_zeroed(d, FSDP_MEM_ACTIVATIONS, M, &a);
        ok = ok && rc == 0 && a && all_zero(a, M);
        if (a) memset(a, 0x77, M);
        fsdp_device_free(d, a);
    }
    tap_ok(ok, "alloc_zeroed: zero with the cache off (FSDP_CPU_CACHE_MB=0)");
    fsdp_device_destroy(d);
    fsdp_ctx_destroy(c);
    unsetenv("FSDP_CPU_CACHE_MB");
}

int main(void) {
    tap_plan(20);
    test_cache();
    test_cache_bound();
    test_alloc_zeroed();
    return tap_done();
}
