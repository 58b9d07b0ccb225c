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

void fsdp__copy_stream(void *dst, const void *src, size_t bytes) {
#ifdef __SSE2__
    char *d = dst;
    const char *s = src;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > bytes) head = bytes;
    memcpy(d, s, head);
    size_t i = head;
    for (; i + 64 <= bytes; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(const void *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(s + i + 48));
        _mm_stream_si128((__m128i *)(void *)(d + i), a);
        _mm_stream_si128((__m128i *)(void *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(void *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(void *)(d + i + 48), e);
    }
    for (; i + 16 <= bytes; i += 16)
        _mm_stream_si128((__m128i *)(void *)(d + i),
                         _mm_loadu_si128((const __m128i *)(const void *)(s + i)));
    memcpy(d + i, s + i, bytes - i);
#else
    memcpy(dst, src, bytes);
#endif
}

void fsdp__copy_stream2(void *dst1, void *dst2, const void *src, size_t bytes) {
#ifdef __SSE2__
    /* Both destinations aligned alike take the vector loop; otherwise two passes. */
    if ((((uintptr_t)dst1 ^ (uintptr_t)dst2) & 15) != 0) {
        fsdp__copy_stream(dst1, src, bytes);
        fsdp__copy_stream(dst2, src, bytes);
        return;
    }
    char *d1 = dst1, *d2 = dst2;
    const char *s = src;
    size_t head = (16 - ((uintptr_t)d1 & 15)) & 15;
    if (head > bytes) head = bytes;
    memcpy(d1, s, head);
    memcpy(d2, s, head);
    size_t i = head;
    for (; i + 64 <= bytes; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(const void *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(s + i + 48));
        _mm_stream_si128((__m128i *)(void *)(d1 + i), a);
        _mm_stream_si128((__m128i *)(void *)(d1 + i + 16), b);
        _mm_stream_si128((__m128i *)(void *)(d1 + i + 32), c);
        _mm_stream_si128((__m128i *)(void *)(d1 + i + 48), e);
        _mm_stream_si128((__m128i *)(void *)(d2 + i), a);
        _mm_stream_si128((__m128i *)(void *)(d2 + i + 16), b);
        _mm_stream_si128((__m128i *)(void *)(d2 + i + 32), c);
        _mm_stream_si128((__m128i *)(void *)(d2 + i + 48), e);
    }
    memcpy(d1 + i, s + i, bytes - i);
    memcpy(d2 + i, s + i, bytes - i);
#else
    memcpy(dst1, src, bytes);
    memcpy(dst2, src, bytes);
#endif
}

void fsdp__copy_fence(void) {
#ifdef __SSE2__
    _mm_sfence();
#endif
}

void fsdp__copy_large2(void *dst1, void *dst2, const void *src, size_t bytes) {
    if (bytes == 0) return;
    if (bytes >= FSDP_COPY_STREAM_MIN) {
        fsdp__copy_stream2(dst1, dst2, src, bytes);
        fsdp__copy_fence();
    } else {
        memcpy(dst1, src, bytes);
        memcpy(dst2, src, bytes);
    }
}

void fsdp__copy_large(void *dst, const void *src, size_t bytes) {
    if (dst == src || bytes == 0) return;
    if (bytes >= FSDP_COPY_STREAM_MIN) {
        fsdp__copy_stream(dst, src, bytes);
        fsdp__copy_fence();
    } else {
        memcpy(dst, src, bytes);
    }
}
