/* SPDX-License-Identifier: MIT */
/*
 * store.c: the store front end: handles, key prefixes, argument checks and waiting on many
 * keys.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/timeutil.h"
#include "store/store_impl.h"

int fsdp__store_wrap(const struct fsdp_store_ops *ops, void *data, fsdp_store_t **out) {
    fsdp_store_t *s = calloc(1, sizeof *s);
    if (!s) {
        ops->release(data);
        return FSDP_ENOMEM;
    }
    s->ops = ops;
    s->data = data;
    s->timeout_ms = FSDP_STORE_DEFAULT_TIMEOUT_MS;
    *out = s;
    return FSDP_OK;
}

int64_t fsdp__store_deadline_ns(int64_t timeout_ms) {
    int64_t now = fsdp__now_ns();
    if (timeout_ms <= 0) return now;
    if (timeout_ms > (INT64_MAX - now) / 1000000) return INT64_MAX;
    return now + timeout_ms * 1000000;
}

int64_t fsdp__store_backoff_ms(int64_t prev_ms) {
    if (prev_ms < 1) return 1;
    return prev_ms >= 25 ? 50 : prev_ms * 2;
}

/* Writes prefix/key into buf; fails when the key is empty or the result does not fit. */
static int full_key(fsdp_store_t *s, const char *key, char *buf, size_t cap, const char *fn) {
    if (!key || !*key) return fsdp__err(s->err, FSDP_EINVAL, "%s: the key is empty", fn);
    int n = s->prefix[0] ? snprintf(buf, cap, "%s/%s", s->prefix, key)
                         : snprintf(buf, cap, "%s", key);
    if (n < 0 || (size_t)n >= cap)
        return fsdp__err(s->err, FSDP_EINVAL, "%s: key '%.64s...' is longer than %zu bytes", fn,
                         key, cap - 1);
    return FSDP_OK;
}

#define KEY_CAP 512

int fsdp_store_clone(fsdp_store_t *store, const char *prefix, fsdp_store_t **out) {
    if (!out) return FSDP_EINVAL;
    *out = NULL;
    if (!store) return FSDP_EINVAL;
    char p[sizeof store->prefix];
    int n = (!prefix || !*prefix) ? snprintf(p, sizeof p, "%s", store->prefix)
            : store->prefix[0]    ? snprintf(p, sizeof p, "%s/%s", store->prefix, prefix)
                                  : snprintf(p, sizeof p, "%s", prefix);
    if (n < 0 || (size_t)n >= sizeof p)
        return fsdp__err(store->err, FSDP_EINVAL, "fsdp_store_clone: prefix longer than %zu",
                         sizeof p - 1);
    store->ops->retain(store->data);
    int rc = fsdp__store_wrap(store->ops, store->data, out);
    if (rc < 0) return fsdp__err(store->err, rc, "fsdp_store_clone: out of memory");
    memcpy((*out)->prefix, p, sizeof p);
    (*out)->timeout_ms = store->timeout_ms;
    return FSDP_OK;
}

void fsdp_store_destroy(fsdp_store_t *store) {
    if (!store) return;
    store->ops->release(store->data);
    free(store);
}

int fsdp_store_set_timeout(fsdp_store_t *store, int64_t timeout_ms) {
    if (!store) return FSDP_EINVAL;
    if (timeout_ms <= 0)
        return fsdp__err(store->err, FSDP_EINVAL,
                         "fsdp_store_set_timeout: timeout_ms %lld must be > 0",
                         (long long)timeout_ms);
    store->timeout_ms = timeout_ms;
    return FSDP_OK;
}

int fsdp_store_set(fsdp_store_t *store, const char *key, const void *value, size_t len) {
    if (!store) return FSDP_EINVAL;
    char k[KEY_CAP];
    int rc = full_key(store, key, k, sizeof k, "fsdp_store_set");
    if (rc < 0) return rc;
    if (len > 0 && !value)
        return fsdp__err(store->err, FSDP_EINVAL, "fsdp_store_set('%s'): value is NULL with "
                         "length %zu", k, len);
    return store->ops->set(store->data, k, value, len, store->timeout_ms, store->err);
}

int fsdp_store_get(fsdp_store_t *store, const char *key, void *buf, size_t cap, size_t *len) {
    if (!store) return FSDP_EINVAL;
    char k[KEY_CAP];
    int rc = full_key(store, key, k, sizeof k, "fsdp_store_get");
    if (rc < 0) return rc;
    if ((cap > 0 && !buf) || !len)
        return fsdp__err(store->err, FSDP_EINVAL, "fsdp_store_get('%s'): buf or len is NULL", k);
    rc = store->ops->get(store->data, k, buf, cap, len, store->timeout_ms, store->err);
    if (rc == FSDP_OK && *len > cap)
        return fsdp__err(store->err, FSDP_EINVAL,
                         "fsdp_store_get('%s'): the value has %zu bytes but the buffer only %zu",
                         k, *len, cap);
    return rc;
}

int fsdp_store_wait(fsdp_store_t *store, const char *const *keys, size_t n) {
    if (!store) return FSDP_EINVAL;
    if (n > 0 && !keys)
        return fsdp__err(store->err, FSDP_EINVAL, "fsdp_store_wait: keys is NULL with n = %zu",
                         n);
    int64_t end = fsdp__store_deadline_ns(store->timeout_ms);
    for (size_t i = 0; i < n; i++) {
        char k[KEY_CAP];
        int rc = full_key(store, keys[i], k, sizeof k, "fsdp_store_wait");
        if (rc < 0) return rc;
        int64_t left = (end - fsdp__now_ns()) / 1000000;
        size_t len;
        rc = store->ops->get(store->data, k, NULL, 0, &len, left > 0 ? left : 0, store->err);
        if (rc == FSDP_ETIMEDOUT)
            return fsdp__err(store->err, rc,
                             "fsdp_store_wait: key '%s' did not appear within %lld ms", k,
                             (long long)store->timeout_ms);
        if (rc < 0) return rc;
    }
    return FSDP_OK;
}

int fsdp_store_add(fsdp_store_t *store, const char *key, int64_t delta, int64_t *result) {
    if (!store) return FSDP_EINVAL;
    char k[KEY_CAP];
    int rc = full_key(store, key, k, sizeof k, "fsdp_store_add");
    if (rc < 0) return rc;
    int64_t value;
    rc = store->ops->add(store->data, k, delta, &value, store->timeout_ms, store->err);
    if (rc == FSDP_OK && result) *result = value;
    return rc;
}

int fsdp_store_check(fsdp_store_t *store, const char *key, int *found) {
    if (!store) return FSDP_EINVAL;
    char k[KEY_CAP];
    int rc = full_key(store, key, k, sizeof k, "fsdp_store_check");
    if (rc < 0) return rc;
    if (!found) return fsdp__err(store->err, FSDP_EINVAL, "fsdp_store_check: found is NULL");
    return store->ops->check(store->data, k, found, store->timeout_ms, store->err);
}

const char *fsdp_store_last_error(const fsdp_store_t *store) {
    return store ? store->err : "no store";
}
