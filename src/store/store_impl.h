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

#include "internal.h"

struct fsdp_store_ops {
    const char *name;
    int (*set)(void *data, const char *key, const void *value, size_t len, char *err);
    /* Waits up to timeout_ms for the key. */
    int (*get)(void *data, const char *key, void *buf, size_t cap, size_t *len,
               int64_t timeout_ms, char *err);
    int (*add)(void *data, const char *key, int64_t delta, int64_t *result, char *err);
    int (*check)(void *data, const char *key, int *found, char *err);
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

/* Parses decimal counter text; returns 0 when `len` bytes at v are a whole int64. */
int fsdp__store_parse_counter(const void *v, size_t len, int64_t *out);

#endif /* FSDP_STORE_IMPL_H */
