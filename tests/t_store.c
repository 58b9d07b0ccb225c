/* SPDX-License-Identifier: MIT */
/*
 * t_store.c: the in-memory rendezvous store: the common store suite (store_suite.c), and the
 * store the sim runner gives its rank threads.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <fsdp.h>

#include "store_suite.h"
#include "tap.h"

/* Every open is a new, empty store: memory stores share nothing but through clones. */
static int open_memory(void *arg, const char *ns, fsdp_store_t **out) {
    (void)arg;
    (void)ns;
    return fsdp_store_create_memory(NULL, out);
}

/* Every rank adds to a counter, publishes its address, then reads all others'. */
static int rendezvous(fsdp_ctx_t *ctx, void *arg) {
    (void)arg;
    fsdp_store_t *s = fsdp_ctx_store(ctx);
    int r = fsdp_ctx_rank(ctx), n = fsdp_ctx_world_size(ctx);
    int64_t v;
    int rc = fsdp_store_add(s, "joined", 1, &v);
    if (rc) return rc;
    char key[32], val[32], buf[32];
    snprintf(key, sizeof key, "addr/%d", r);
    snprintf(val, sizeof val, "host-%d", r * 7);
    fsdp_store_set(s, key, val, strlen(val));
    for (int q = 0; q < n; q++) {
        size_t len;
        snprintf(key, sizeof key, "addr/%d", q);
        rc = fsdp_store_get(s, key, buf, sizeof buf, &len);
        if (rc) return rc;
        snprintf(val, sizeof val, "host-%d", q * 7);
        if (len != strlen(val) || memcmp(buf, val, len)) return FSDP_EINTERNAL;
    }
    return FSDP_OK;
}

static void test_sim_store(void) {
    fsdp_sim_options_t o;
    fsdp_sim_options_init(&o);
    o.world_size = 8;
    int st[8];
    tap_is_int(fsdp_sim_run(&o, rendezvous, NULL, st), FSDP_OK,
               "8 sim rank threads rendezvous through the store of their contexts");
}

/* Runs create_memory(NULL, NULL) with stderr sent to a file; returns what was written. */
static char *stderr_of_failed_create(int *rc) {
    static char text[2048];
    char path[192];
    tap_tmppath(path, sizeof path, "t_store.XXXXXX");
    int fd = mkstemp(path);
    if (fd < 0) tap_bail("mkstemp");
    fflush(stderr);
    int saved = dup(2);
    dup2(fd, 2);
    *rc = fsdp_store_create_memory(NULL, NULL);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    ssize_t n = pread(fd, text, sizeof text - 1, 0);
    text[n > 0 ? n : 0] = 0;
    close(fd);
    unlink(path);
    return text;
}

static void test_create_errors(void) {
    fsdp_ctx_t *ctx = store_suite_ctx();
    tap_is_int(fsdp_store_create_memory(ctx, NULL), FSDP_EINVAL,
               "create_memory(ctx, NULL) is EINVAL");
    tap_has_str(fsdp_ctx_last_error(ctx), "fsdp_store_create_memory: out is NULL",
                "and the context's last error says why");
    const char *env = getenv("FSDP_LOG");
    if (env && *env) {
        tap_skip(2, "FSDP_LOG is set: the level of context-less messages is the environment's");
        return;
    }
    int rc = 0;
    const char *logged = stderr_of_failed_create(&rc);
    tap_is_int(rc, FSDP_EINVAL, "without a context it fails the same");
    tap_has_str(logged, "fsdp_store_create_memory: out is NULL",
                "and the reason is logged at error level instead");
}

int main(void) {
    tap_plan_lazy();
    store_factory_t f = {"memory", open_memory, NULL};
    store_suite_run(&f);
    test_sim_store();
    test_create_errors();
    return tap_done();
}
