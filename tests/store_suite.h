/* SPDX-License-Identifier: MIT */
/*
 * store_suite.h: one suite of rendezvous-store tests, run over every backend (memory, file,
 * Redis) through a factory, so that every backend is held to the contract of fsdp/store.h.
 */
#ifndef FSDP_TESTS_STORE_SUITE_H
#define FSDP_TESTS_STORE_SUITE_H

#include <fsdp.h>

/*
 * Opens a new handle on namespace `ns` of the store under test. For backends whose data outlives
 * a handle (file, Redis), two opens of one ns, from any process, see the same data and different
 * namespaces share no keys. The memory factory returns a new, empty store for every call.
 */
typedef int (*store_open_fn)(void *arg, const char *ns, fsdp_store_t **out);

typedef struct store_factory {
    const char *name; /* "memory", "file", "redis": the prefix of every test name */
    store_open_fn open;
    void *arg;
} store_factory_t;

/* The backend-independent suite: set/get/overwrite, empty values, check, add and counters,
 * timeouts that name keys, buffers too small, odd keys, prefixed clones, whole values under
 * concurrent overwrites, and ranks as threads. */
void store_suite_run(const store_factory_t *f);

/* One process sets a key another waits for, and the other answers (processes share an ns). */
void store_suite_two_processes(const store_factory_t *f);

/* nproc forked children each add 1 to one counter `adds` times and set a key of their own; the
 * parent checks the total and every key. */
void store_suite_cross_process(const store_factory_t *f, int nproc, int adds);

/* A namespace name unique within this test program ("<tag>-<pid>-<n>"). */
void store_suite_ns(const char *tag, char *buf, size_t cap);

/* Milliseconds on the monotonic clock. */
double store_suite_now_ms(void);

/* A context with logging off, for the tests that check a constructor's message: the store
 * constructors leave it on the context they are given (made on first use, destroyed at exit). */
fsdp_ctx_t *store_suite_ctx(void);

#endif /* FSDP_TESTS_STORE_SUITE_H */
