/* SPDX-License-Identifier: MIT */
/*
 * copy.c: non-temporal copies of large messages (see copy.h).
 *
 * The loop stores 16-byte SSE2 vectors (every x86-64 CPU has them); wider stores would not move
 * the data faster, since memory, not the core, bounds a copy this large. Elsewhere it is memcpy.
 */
#include <stdint.h>
#include <string.h>

#include "core/copy.h"

#ifdef __SSE2__
#include <emmintrin.h>
#endif

#ifdef __SSE2__
/* Copies bytes of s to d1 and, when d2 is not NULL, to d2 (aligned as d1 modulo 16): one load a
 * vector, non-temporal stores to each destination. The branch on d2 is the same every pass;
 * memory, not the core, bounds the loop. */
static void stream(char *d1, char *d2, const char *s, size_t bytes) {
    size_t head = (16 - ((uintptr_t)d1 & 15)) & 15;
    if (head > bytes) head = bytes;
    memcpy(d1, s, head);
    if (d2) memcpy(d2, s, head);
    size_t i = head;
#define LOAD(k) _mm_loadu_si128((const __m128i *)(const void *)(s + i + 16 * (k)))
#define STORE(d, k, v) _mm_stream_si128((__m128i *)(void *)((d) + i + 16 * (k)), (v))
    for (; i + 64 <= bytes; i += 64) {
        const __m128i a = LOAD(0), b = LOAD(1), c = LOAD(2), e = LOAD(3);
        STORE(d1, 0, a), STORE(d1, 1, b), STORE(d1, 2, c), STORE(d1, 3, e);
        if (d2) STORE(d2, 0, a), STORE(d2, 1, b), STORE(d2, 2, c), STORE(d2, 3, e);
    }
    for (; i + 16 <= bytes; i += 16) {
        const __m128i v = LOAD(0);
        STORE(d1, 0, v);
        if (d2) STORE(d2, 0, v);
    }
#undef LOAD
#undef STORE
    memcpy(d1 + i, s + i, bytes - i);
    if (d2) memcpy(d2 + i, s + i, bytes - i);
}
#endif

/* The non-temporal copy into d1 and, when not NULL, d2: one pass where the two destinations
 * are aligned alike modulo 16, two passes otherwise; memcpy without SSE2. */
static void stream_to(char *d1, char *d2, const char *s, size_t bytes) {
#ifdef __SSE2__
    if (d2 && (((uintptr_t)d1 ^ (uintptr_t)d2) & 15) != 0) {
        stream(d1, NULL, s, bytes);
        stream(d2, NULL, s, bytes);
    } else {
        stream(d1, d2, s, bytes);
    }
#else
    memcpy(d1, s, bytes);
    if (d2) memcpy(d2, s, bytes);
#endif
}

void fsdp__copy_stream(void *dst, const void *src, size_t bytes) {
    stream_to(dst, NULL, src, bytes);
}

void fsdp__copy_fence(void) {
#ifdef __SSE2__
    _mm_sfence();
#endif
}

/* fsdp__copy_large into d1 and, when not NULL, d2. */
static void copy_large(char *d1, char *d2, const char *src, size_t bytes) {
    if (bytes >= FSDP_COPY_STREAM_MIN) {
        stream_to(d1, d2, src, bytes);
        fsdp__copy_fence();
    } else {
        memcpy(d1, src, bytes);
        if (d2) memcpy(d2, src, bytes);
    }
}

void fsdp__copy_large(void *dst, const void *src, size_t bytes) {
    if (dst != src && bytes > 0) copy_large(dst, NULL, src, bytes);
}

void fsdp__copy_large2(void *dst1, void *dst2, const void *src, size_t bytes) {
    if (bytes > 0) copy_large(dst1, dst2, src, bytes);
}
