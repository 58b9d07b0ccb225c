/* SPDX-License-Identifier: MIT */
/*
 * store_counter.h: the decimal text of a store counter (fsdp_store_add), read the same way by
 * every store and by the TCP store's server, which fsdprun links without the rest of the library.
 */
#ifndef FSDP_STORE_COUNTER_H
#define FSDP_STORE_COUNTER_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Parses decimal counter text; returns 0 when `len` bytes at v are a whole int64. */
static inline int fsdp__store_parse_counter(const void *v, size_t len, int64_t *out) {
    char buf[32];
    if (len == 0 || len >= sizeof buf) return -1;
    memcpy(buf, v, len);
    buf[len] = 0;
    char *end;
    errno = 0;
    long long x = strtoll(buf, &end, 10);
    if (errno || *end) return -1;
    *out = (int64_t)x;
    return 0;
}

#endif /* FSDP_STORE_COUNTER_H */
