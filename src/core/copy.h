/* SPDX-License-Identifier: MIT */
/*
 * copy.h: the copy that moves a large message between buffers on the CPU.
 *
 * A collective's copies (an all-gather's shards into the unsharded parameter, a reduction's
 * result into every output) write megabytes that this core will not read again before they
 * have left its cache. An ordinary store first reads each destination line into the cache
 * (read for ownership); a non-temporal store writes the line without reading it, so a copy
 * moves two bytes of memory traffic a byte instead of three. Below FSDP_COPY_STREAM_MIN the
 * destination fits the caches and is usually read back at once, so plain memcpy is kept.
 */
#ifndef FSDP_CORE_COPY_H
#define FSDP_CORE_COPY_H

#include <stddef.h>

#define FSDP_COPY_STREAM_MIN ((size_t)1 << 20)

/* memcpy(dst, src, bytes), with non-temporal stores for the bulk. Those stores are weakly
 * ordered: call fsdp__copy_fence before telling another thread the data is there. The buffers
 * must not overlap. */
void fsdp__copy_stream(void *dst, const void *src, size_t bytes);

/* Orders the non-temporal stores before this call before every store after it. */
void fsdp__copy_fence(void);

/* fsdp__copy_stream and the fence for bytes >= FSDP_COPY_STREAM_MIN, memcpy below (nothing
 * when dst == src or bytes == 0). */
void fsdp__copy_large(void *dst, const void *src, size_t bytes);

/* fsdp__copy_large into two destinations in one pass over src, which is read once: where a
 * message goes to two places (a rank's own block of an all-gather, into its recv and into the
 * slot its peers read), a third less memory traffic than two copies. Destinations aligned
 * differently modulo 16 take two passes. None of the three may overlap. */
void fsdp__copy_large2(void *dst1, void *dst2, const void *src, size_t bytes);

#endif /* FSDP_CORE_COPY_H */
