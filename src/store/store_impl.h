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

#include "store/store_counter.h"
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
    int (*get)(void *data, const char *key, void *buf, size_t cap, size_t *len, int64_t timeout_ms,
               char *err);
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


/* What a Redis URL adds to fsdp_store_create_redis: AUTH ("" user: the password alone) and
 * SELECT db. Strings may be "" (none), never NULL. */
typedef struct fsdp__redis_auth {
    const char *user;
    const char *password;
    int db;
} fsdp__redis_auth_t;

/* fsdp_store_create_redis with AUTH and SELECT on every connection (auth NULL: neither). */
int fsdp__store_create_redis_auth(fsdp_ctx_t *ctx, const char *host, int port, const char *prefix,
                                  const fsdp__redis_auth_t *auth, fsdp_store_t **out);

/*
 * Starts a TCP store server on bind_host:port (fsdp_store_server_start's rules) and returns a
 * TCP store handle connected to it as host (the address clients use); the server stops when the
 * last handle on that data is destroyed. For the rank that serves a job's store.
 */
int fsdp__store_tcp_serve(fsdp_ctx_t *ctx, const char *bind_host, const char *host, int port,
                          fsdp_store_t **out);

#endif /* FSDP_STORE_IMPL_H */
