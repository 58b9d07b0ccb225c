/* SPDX-License-Identifier: MIT */
/*
 * store_impl.h: the interface between the store front end (store.c) and store backends.
 *
 * The front end owns the handle (prefix, timeout, last error) and checks arguments; a backend
 * owns the shared data, reference-counted so that clones share it. Keys reaching a backend are
 * complete (prefix applied). The counter of fsdp_store_add() is stored as decimal text, so a
 * get of a counter key returns "42", as in PyTorch's stores.
 */
#ifndef FSDP_STORE_IMPL_H
#define FSDP_STORE_IMPL_H

#include <fsdp/store.h>

#include "internal.h"

/*
 * Every operation gets the handle's timeout: get waits up to timeout_ms for the key to appear,
 * and backends that talk to something outside the process (a lock held by another process, a
 * Redis server) give up after timeout_ms instead of blocking forever. Errors are written into
 * `err` (FSDP_ERR_LEN bytes) and name the key.
 */
struct fsdp_store_ops {
    const char *name;
    int (*set)(void *data, const char *key, const void *value, size_t len, int64_t timeout_ms,
               char *err);
    int (*get)(void *data, const char *key, void *buf, size_t cap, size_t *len,
               int64_t timeout_ms, char *err);
    int (*add)(void *data, const char *key, int64_t delta, int64_t *result, int64_t timeout_ms,
               char *err);
    int (*check)(void *data, const char *key, int *found, int64_t timeout_ms, char *err);
    void (*retain)(void *data);
    void (*release)(void *data);
};

struct fsdp_store {
    const struct fsdp_store_ops *ops;
    void *data;
    char prefix[256];
    int64_t timeout_ms;
    char err[FSDP_ERR_LEN];
};

/* Makes a handle over backend data (takes over one reference). */
int fsdp__store_wrap(const struct fsdp_store_ops *ops, void *data, fsdp_store_t **out);

/* The monotonic time (ns) timeout_ms from now, saturating instead of overflowing. */
int64_t fsdp__store_deadline_ns(int64_t timeout_ms);

/* The wait between two polls of a key: starts at 1 ms and doubles up to 50 ms. */
int64_t fsdp__store_backoff_ms(int64_t prev_ms);

/* Parses decimal counter text; returns 0 when `len` bytes at v are a whole int64. */
int fsdp__store_parse_counter(const void *v, size_t len, int64_t *out);

#endif /* FSDP_STORE_IMPL_H */
