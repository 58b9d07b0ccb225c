/*
 * t_store.c: the in-memory rendezvous store: set/get/wait/add/check, prefixes, timeouts,
 * and concurrent ranks.
 */
#include <string.h>

#include <fsdp.h>

#include "tap.h"

static void test_basic(void) {
    fsdp_store_t *s = NULL;
    tap_is_int(fsdp_store_create_memory(&s), FSDP_OK, "create an in-memory store");
    fsdp_store_set_timeout(s, 200);
    tap_is_int(fsdp_store_set(s, "addr", "10.0.0.1:29500", 14), FSDP_OK, "set a key");
    char buf[64];
    size_t len = 0;
    tap_is_int(fsdp_store_get(s, "addr", buf, sizeof buf, &len), FSDP_OK, "get it back");
    tap_is_size(len, 14, "length of the value");
    tap_is_mem(buf, "10.0.0.1:29500", 14, "value bytes");
    tap_is_int(fsdp_store_set(s, "addr", "x", 1), FSDP_OK, "overwrite");
    fsdp_store_get(s, "addr", buf, sizeof buf, &len);
    tap_ok(len == 1 && buf[0] == 'x', "overwritten value is returned");
    tap_is_int(fsdp_store_set(s, "empty", NULL, 0), FSDP_OK, "an empty value is allowed");
    tap_is_int(fsdp_store_get(s, "empty", buf, sizeof buf, &len), FSDP_OK, "get empty value");
    tap_is_size(len, 0, "its length is 0");
    int found = -1;
    fsdp_store_check(s, "empty", &found);
    tap_is_int(found, 1, "check finds an existing key");
    fsdp_store_check(s, "nope", &found);
    tap_is_int(found, 0, "check does not find a missing key");

    int64_t v = 0;
    tap_is_int(fsdp_store_add(s, "ctr", 5, &v), FSDP_OK, "add creates a counter");
    tap_is_int(v, 5, "counter starts at 0 + 5");
    fsdp_store_add(s, "ctr", -2, &v);
    tap_is_int(v, 3, "add -2 gives 3");
    fsdp_store_get(s, "ctr", buf, sizeof buf, &len);
    tap_ok(len == 1 && buf[0] == '3', "a counter reads back as decimal text");
    tap_is_int(fsdp_store_add(s, "addr", 1, &v), FSDP_EINVAL, "add on a non-counter fails");
    tap_has_str(fsdp_store_last_error(s), "addr", "and the error names the key");

    tap_is_int(fsdp_store_get(s, "missing", buf, sizeof buf, &len), FSDP_ETIMEDOUT,
               "get of a missing key times out");
    tap_has_str(fsdp_store_last_error(s), "missing", "the timeout names the key");
    const char *keys[2] = {"ctr", "never"};
    tap_is_int(fsdp_store_wait(s, keys, 2), FSDP_ETIMEDOUT, "wait times out on a missing key");
    tap_has_str(fsdp_store_last_error(s), "never", "the wait error names the missing key");
    tap_is_int(fsdp_store_wait(s, keys, 1), FSDP_OK, "wait on present keys returns");

    char small[4];
    fsdp_store_set(s, "long", "0123456789", 10);
    tap_is_int(fsdp_store_get(s, "long", small, sizeof small, &len), FSDP_EINVAL,
               "a buffer too small is reported");
    tap_is_size(len, 10, "with the full length");
    tap_is_int(fsdp_store_set(s, "", "x", 1), FSDP_EINVAL, "an empty key is rejected");
    tap_is_int(fsdp_store_set_timeout(s, 0), FSDP_EINVAL, "a zero timeout is rejected");

    /* Prefixed clones share data but not keys. */
    fsdp_store_t *a = NULL, *b = NULL;
    fsdp_store_clone(s, "groupA", &a);
    fsdp_store_clone(s, "groupB", &b);
    fsdp_store_set(a, "id", "A", 1);
    fsdp_store_set(b, "id", "B", 1);
    fsdp_store_get(a, "id", buf, sizeof buf, &len);
    tap_ok(buf[0] == 'A', "prefixed handle A sees its own key");
    fsdp_store_get(b, "id", buf, sizeof buf, &len);
    tap_ok(buf[0] == 'B', "prefixed handle B sees its own key");
    fsdp_store_get(s, "groupA/id", buf, sizeof buf, &len);
    tap_ok(buf[0] == 'A', "the parent sees the clone's key under the prefix");
    fsdp_store_destroy(s); /* the clones keep the data alive */
    fsdp_store_get(b, "id", buf, sizeof buf, &len);
    tap_ok(buf[0] == 'B', "data outlives the handle it was created with");
    fsdp_store_destroy(a);
    fsdp_store_destroy(b);
    fsdp_store_destroy(NULL);
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

static void test_concurrent(void) {
    fsdp_sim_options_t o;
    fsdp_sim_options_init(&o);
    o.world_size = 8;
    int st[8];
    tap_is_int(fsdp_sim_run(&o, rendezvous, NULL, st), FSDP_OK,
               "8 rank threads rendezvous through the shared store");
}

int main(void) {
    tap_plan_lazy();
    test_basic();
    test_concurrent();
    return tap_done();
}
