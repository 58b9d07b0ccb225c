/* SPDX-License-Identifier: MIT */
/*
 * store_memory.c: the in-memory store, for ranks that are threads of one process.
 *
 * One mutex guards a list of entries; one condition variable wakes getters when a key is set.
 * The list is fine for rendezvous traffic (a few keys per rank).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/timeutil.h"
#include "store/store_impl.h"

typedef struct entry {
    struct entry *next;
    char *key;
    unsigned char *value;
    size_t len;
} entry_t;

typedef struct mem_store {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    entry_t *entries;
    int refs; /* guarded by mu */
} mem_store_t;

static entry_t *find(mem_store_t *m, const char *key) {
    for (entry_t *e = m->entries; e; e = e->next)
        if (strcmp(e->key, key) == 0) return e;
    return NULL;
}

/* Replaces (or creates) key's value; the caller holds the lock. */
static int put(mem_store_t *m, const char *key, const void *value, size_t len, char *err) {
    unsigned char *copy = malloc(len ? len : 1);
    if (!copy) return fsdp__err(err, FSDP_ENOMEM, "store: out of memory for '%s'", key);
    if (len) memcpy(copy, value, len);
    entry_t *e = find(m, key);
    if (!e) {
        e = calloc(1, sizeof *e);
        char *k = strdup(key);
        if (!e || !k) {
            free(e);
            free(k);
            free(copy);
            return fsdp__err(err, FSDP_ENOMEM, "store: out of memory for '%s'", key);
        }
        e->key = k;
        e->next = m->entries;
        m->entries = e;
    } else {
        free(e->value);
    }
    e->value = copy;
    e->len = len;
    pthread_cond_broadcast(&m->cv);
    return FSDP_OK;
}

static int mem_set(void *data, const char *key, const void *value, size_t len, int64_t timeout_ms,
                   char *err) {
    (void)timeout_ms; /* never blocks for long */
    mem_store_t *m = data;
    pthread_mutex_lock(&m->mu);
    int rc = put(m, key, value, len, err);
    pthread_mutex_unlock(&m->mu);
    return rc;
}

static int mem_get(void *data, const char *key, void *buf, size_t cap, size_t *len,
                   int64_t timeout_ms, char *err) {
    mem_store_t *m = data;
    struct timespec deadline = fsdp__deadline_ms(timeout_ms);
    int rc = FSDP_OK;
    pthread_mutex_lock(&m->mu);
    entry_t *e;
    while (!(e = find(m, key))) {
        if (pthread_cond_timedwait(&m->cv, &m->mu, &deadline) == ETIMEDOUT && !find(m, key)) {
            rc = fsdp__err(err, FSDP_ETIMEDOUT, "store: key '%s' did not appear within %lld ms",
                           key, (long long)timeout_ms);
            break;
        }
    }
    if (e) {
        *len = e->len;
        if (buf && cap) memcpy(buf, e->value, e->len < cap ? e->len : cap);
    }
    pthread_mutex_unlock(&m->mu);
    return rc;
}

static int mem_add(void *data, const char *key, int64_t delta, int64_t *result, int64_t timeout_ms,
                   char *err) {
    (void)timeout_ms;
    mem_store_t *m = data;
    int rc = FSDP_OK;
    pthread_mutex_lock(&m->mu);
    entry_t *e = find(m, key);
    int64_t value = 0;
    if (e && fsdp__store_parse_counter(e->value, e->len, &value) != 0) {
        rc = fsdp__err(err, FSDP_EINVAL, "store: add on '%s', whose value is not a counter", key);
    } else {
        value = (int64_t)((uint64_t)value + (uint64_t)delta);
        char text[32];
        int n = snprintf(text, sizeof text, "%" PRId64, value);
        rc = put(m, key, text, (size_t)n, err);
        *result = value;
    }
    pthread_mutex_unlock(&m->mu);
    return rc;
}

static int mem_check(void *data, const char *key, int *found, int64_t timeout_ms, char *err) {
    (void)timeout_ms;
    (void)err;
    mem_store_t *m = data;
    pthread_mutex_lock(&m->mu);
    *found = find(m, key) != NULL;
    pthread_mutex_unlock(&m->mu);
    return FSDP_OK;
}

static void mem_retain(void *data) {
    mem_store_t *m = data;
    pthread_mutex_lock(&m->mu);
    m->refs++;
    pthread_mutex_unlock(&m->mu);
}

static void mem_release(void *data) {
    mem_store_t *m = data;
    pthread_mutex_lock(&m->mu);
    int last = --m->refs == 0;
    pthread_mutex_unlock(&m->mu);
    if (!last) return;
    for (entry_t *e = m->entries, *next; e; e = next) {
        next = e->next;
        free(e->key);
        free(e->value);
        free(e);
    }
    pthread_mutex_destroy(&m->mu);
    pthread_cond_destroy(&m->cv);
    free(m);
}

static const struct fsdp_store_ops mem_ops = {
    .name = "memory",
    .set = mem_set,
    .get = mem_get,
    .add = mem_add,
    .check = mem_check,
    .retain = mem_retain,
    .release = mem_release,
};

int fsdp_store_create_memory(fsdp_ctx_t *ctx, fsdp_store_t **out) {
    if (!out)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "fsdp_store_create_memory: out is NULL");
    *out = NULL;
    mem_store_t *m = calloc(1, sizeof *m);
    if (!m)
        return fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "fsdp_store_create_memory: out of memory");
    pthread_mutex_init(&m->mu, NULL);
    fsdp__cond_init(&m->cv);
    m->refs = 1;
    int rc = fsdp__store_wrap(&mem_ops, m, out);
    if (rc < 0) return fsdp__ctx_err_or_log(ctx, rc, "fsdp_store_create_memory: out of memory");
    return FSDP_OK;
}
