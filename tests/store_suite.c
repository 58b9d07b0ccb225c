/* SPDX-License-Identifier: MIT */
/*
 * store_suite.c: the store tests every backend runs (see store_suite.h).
 *
 * Each part opens a fresh namespace, so parts never see each other's keys, even on a file
 * directory or Redis server that outlives the handles. Test names start with the backend's name.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "store_suite.h"
#include "tap.h"

void store_suite_ns(const char *tag, char *buf, size_t cap) {
    static int counter;
    snprintf(buf, cap, "%s-%ld-%d", tag, (long)getpid(), ++counter);
}

double store_suite_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static fsdp_ctx_t *quiet;

static void quiet_destroy(void) {
    fsdp_ctx_destroy(quiet);
    quiet = NULL;
}

fsdp_ctx_t *store_suite_ctx(void) {
    if (!quiet) {
        fsdp_ctx_options_t co;
        fsdp_ctx_options_init(&co);
        co.log_level = FSDP_LOG_OFF;
        if (fsdp_ctx_create(&co, &quiet) < 0) tap_bail("fsdp_ctx_create");
        atexit(quiet_destroy);
    }
    return quiet;
}

static fsdp_store_t *open_fresh(const store_factory_t *f, const char *tag) {
    char ns[96];
    store_suite_ns(tag, ns, sizeof ns);
    fsdp_store_t *s = NULL;
    int rc = f->open(f->arg, ns, &s);
    if (!tap_is_int(rc, FSDP_OK, "%s: open namespace %s", f->name, ns))
        tap_diag("%s (the library logged why)", fsdp_err_name(rc));
    return rc == FSDP_OK ? s : NULL;
}

static void test_values(const store_factory_t *f) {
    fsdp_store_t *s = open_fresh(f, "values");
    if (!s) return;
    const char *n = f->name;
    fsdp_store_set_timeout(s, 200);
    tap_is_int(fsdp_store_set(s, "addr", "10.0.0.1:29500", 14), FSDP_OK, "%s: set a key", n);
    char buf[64];
    size_t len = 0;
    tap_is_int(fsdp_store_get(s, "addr", buf, sizeof buf, &len), FSDP_OK, "%s: get it back", n);
    tap_is_size(len, 14, "%s: length of the value", n);
    tap_is_mem(buf, "10.0.0.1:29500", 14, "%s: value bytes", n);
    tap_is_int(fsdp_store_set(s, "addr", "x", 1), FSDP_OK, "%s: overwrite", n);
    fsdp_store_get(s, "addr", buf, sizeof buf, &len);
    tap_ok(len == 1 && buf[0] == 'x', "%s: the overwritten value is returned", n);
    tap_is_int(fsdp_store_set(s, "empty", NULL, 0), FSDP_OK, "%s: an empty value is allowed", n);
    len = 99;
    tap_is_int(fsdp_store_get(s, "empty", buf, sizeof buf, &len), FSDP_OK, "%s: get empty value",
               n);
    tap_is_size(len, 0, "%s: its length is 0", n);
    unsigned char bin[5] = {0, 255, 0, 10, 13};
    fsdp_store_set(s, "bin", bin, sizeof bin);
    fsdp_store_get(s, "bin", buf, sizeof buf, &len);
    tap_ok(len == 5 && memcmp(buf, bin, 5) == 0, "%s: values are binary-safe (NUL, 0xff)", n);
    int found = -1;
    tap_is_int(fsdp_store_check(s, "empty", &found), FSDP_OK, "%s: check succeeds", n);
    tap_is_int(found, 1, "%s: check finds an existing key", n);
    fsdp_store_check(s, "nope", &found);
    tap_is_int(found, 0, "%s: check does not find a missing key", n);

    int64_t v = 0;
    tap_is_int(fsdp_store_add(s, "ctr", 5, &v), FSDP_OK, "%s: add creates a counter", n);
    tap_is_int(v, 5, "%s: the counter starts at 0 + 5", n);
    fsdp_store_add(s, "ctr", -2, &v);
    tap_is_int(v, 3, "%s: add -2 gives 3", n);
    tap_is_int(fsdp_store_add(s, "ctr", 0, NULL), FSDP_OK, "%s: add with a NULL result", n);
    fsdp_store_get(s, "ctr", buf, sizeof buf, &len);
    tap_ok(len == 1 && buf[0] == '3', "%s: a counter reads back as decimal text", n);
    fsdp_store_set(s, "preset", "40", 2);
    fsdp_store_add(s, "preset", 2, &v);
    tap_is_int(v, 42, "%s: add continues a counter written by set as text", n);
    fsdp_store_add(s, "big", INT64_C(5000000000), &v);
    tap_is_int(v, INT64_C(5000000000), "%s: counters are 64-bit", n);
    tap_is_int(fsdp_store_add(s, "addr", 1, &v), FSDP_EINVAL, "%s: add on a non-counter fails", n);
    tap_has_str(fsdp_store_last_error(s), "addr", "%s: and the error names the key", n);

    char small[4];
    fsdp_store_set(s, "long", "0123456789", 10);
    tap_is_int(fsdp_store_get(s, "long", small, sizeof small, &len), FSDP_EINVAL,
               "%s: a buffer too small is reported", n);
    tap_is_size(len, 10, "%s: with the full length", n);
    tap_is_mem(small, "0123", 4, "%s: and the first bytes copied", n);
    tap_has_str(fsdp_store_last_error(s), "long", "%s: the error names the key", n);
    tap_is_int(fsdp_store_set(s, "", "x", 1), FSDP_EINVAL, "%s: an empty key is rejected", n);
    tap_is_int(fsdp_store_set_timeout(s, 0), FSDP_EINVAL, "%s: a zero timeout is rejected", n);
    fsdp_store_destroy(s);
}

static void test_timeouts(const store_factory_t *f) {
    fsdp_store_t *s = open_fresh(f, "timeouts");
    if (!s) return;
    const char *n = f->name;
    char buf[16];
    size_t len;
    fsdp_store_set_timeout(s, 200);
    fsdp_store_set(s, "here", "1", 1);
    double t0 = store_suite_now_ms();
    tap_is_int(fsdp_store_get(s, "missing", buf, sizeof buf, &len), FSDP_ETIMEDOUT,
               "%s: get of a missing key times out", n);
    double ms = store_suite_now_ms() - t0;
    tap_ok(ms >= 150 && ms < 5000, "%s: after about the timeout (%.0f ms for 200 ms)", n, ms);
    tap_has_str(fsdp_store_last_error(s), "missing", "%s: the timeout names the key", n);
    const char *keys[2] = {"here", "never"};
    tap_is_int(fsdp_store_wait(s, keys, 2), FSDP_ETIMEDOUT,
               "%s: wait times out on a missing key", n);
    tap_has_str(fsdp_store_last_error(s), "never", "%s: the wait error names the missing key", n);
    tap_is_int(fsdp_store_wait(s, keys, 1), FSDP_OK, "%s: wait on present keys returns", n);
    tap_is_int(fsdp_store_wait(s, NULL, 0), FSDP_OK, "%s: wait on no keys returns", n);
    fsdp_store_destroy(s);
}

/* Keys that a naive file mapping would confuse: '/', '%', dots, spaces, high bytes, long keys. */
static void test_keys(const store_factory_t *f) {
    fsdp_store_t *s = open_fresh(f, "keys");
    if (!s) return;
    const char *n = f->name;
    fsdp_store_set_timeout(s, 200);
    char long_a[401], long_b[401], long_c[401];
    memset(long_a, 'k', 400);
    long_a[400] = 0;
    memcpy(long_b, long_a, sizeof long_a);
    long_b[399] = 'z';
    memcpy(long_c, long_a, sizeof long_a);
    long_c[0] = '/';
    const char *keys[] = {"a/b", "a%2Fb", "a%b", "a", ".", "..", "./a", "a b", "a\tb",
                          "\xc3\xa9t\xc3\xa9", "~a", "A/B", "a_b", "a-b", long_a, long_b, long_c};
    size_t nk = sizeof keys / sizeof keys[0];
    int set_ok = 1, get_ok = 1;
    for (size_t i = 0; i < nk; i++) {
        char val[16];
        int len = snprintf(val, sizeof val, "v%zu", i);
        if (fsdp_store_set(s, keys[i], val, (size_t)len) != FSDP_OK) {
            set_ok = 0;
            tap_diag("%s: set #%zu: %s", n, i, fsdp_store_last_error(s));
        }
    }
    tap_ok(set_ok, "%s: keys with '/', '%%', dots, spaces, UTF-8 and 400 bytes can be set", n);
    for (size_t i = 0; i < nk; i++) {
        char val[16], buf[16];
        int len = snprintf(val, sizeof val, "v%zu", i);
        size_t got = 0;
        int rc = fsdp_store_get(s, keys[i], buf, sizeof buf, &got);
        if (rc != FSDP_OK || got != (size_t)len || memcmp(buf, val, got) != 0) {
            get_ok = 0;
            tap_diag("%s: key #%zu: rc %d, %s", n, i, rc, fsdp_store_last_error(s));
        }
    }
    tap_ok(get_ok, "%s: each of %zu such keys reads back its own value", n, nk);
    fsdp_store_destroy(s);
}

static void test_clones(const store_factory_t *f) {
    fsdp_store_t *s = open_fresh(f, "clones");
    if (!s) return;
    const char *n = f->name;
    fsdp_store_set_timeout(s, 200);
    fsdp_store_t *a = NULL, *b = NULL;
    tap_is_int(fsdp_store_clone(s, "groupA", &a), FSDP_OK, "%s: clone with a prefix", n);
    fsdp_store_clone(s, "groupB", &b);
    if (!a || !b) {
        fsdp_store_destroy(a);
        fsdp_store_destroy(b);
        fsdp_store_destroy(s);
        return;
    }
    char buf[8] = "";
    size_t len;
    fsdp_store_set(a, "id", "A", 1);
    fsdp_store_set(b, "id", "B", 1);
    fsdp_store_get(a, "id", buf, sizeof buf, &len);
    tap_ok(buf[0] == 'A', "%s: prefixed handle A sees its own key", n);
    fsdp_store_get(b, "id", buf, sizeof buf, &len);
    tap_ok(buf[0] == 'B', "%s: prefixed handle B sees its own key", n);
    fsdp_store_get(s, "groupA/id", buf, sizeof buf, &len);
    tap_ok(buf[0] == 'A', "%s: the parent sees the clone's key under the prefix", n);
    int found = -1;
    fsdp_store_check(s, "id", &found);
    tap_is_int(found, 0, "%s: the parent has no unprefixed key 'id'", n);
    fsdp_store_destroy(s); /* the clones keep the data alive */
    buf[0] = 0;
    fsdp_store_get(b, "id", buf, sizeof buf, &len);
    tap_ok(buf[0] == 'B', "%s: data outlives the handle it was created with", n);
    fsdp_store_destroy(a);
    fsdp_store_destroy(b);
    fsdp_store_destroy(NULL);
}

/* ---- concurrency: ranks as threads, each with its own handle on the same data ---- */

#define NRANKS 8
#define RANK_ADDS 100
#define BIG 65536
#define OVERWRITES 100

typedef struct rank_arg {
    fsdp_store_t *s;
    int rank;
    int rc;
    char why[600];
} rank_arg_t;

static void *rank_main(void *p) {
    rank_arg_t *a = p;
    fsdp_store_t *s = a->s;
    char key[32], val[32], buf[32];
    int64_t v;
    a->rc = FSDP_OK;
    for (int i = 0; i < RANK_ADDS && a->rc == FSDP_OK; i++) a->rc = fsdp_store_add(s, "hits", 1, &v);
    snprintf(key, sizeof key, "addr/%d", a->rank);
    snprintf(val, sizeof val, "host-%d", a->rank * 7);
    if (a->rc == FSDP_OK) a->rc = fsdp_store_set(s, key, val, strlen(val));
    if (a->rc == FSDP_OK) a->rc = fsdp_store_add(s, "joined", 1, &v);
    for (int q = 0; q < NRANKS && a->rc == FSDP_OK; q++) {
        size_t len;
        snprintf(key, sizeof key, "addr/%d", q);
        a->rc = fsdp_store_get(s, key, buf, sizeof buf, &len);
        snprintf(val, sizeof val, "host-%d", q * 7);
        if (a->rc == FSDP_OK && (len != strlen(val) || memcmp(buf, val, len) != 0))
            a->rc = FSDP_EINTERNAL;
    }
    if (a->rc != FSDP_OK)
        snprintf(a->why, sizeof a->why, "rank %d: %s", a->rank, fsdp_store_last_error(s));
    return NULL;
}

static void test_ranks(const store_factory_t *f) {
    fsdp_store_t *s = open_fresh(f, "ranks");
    if (!s) return;
    const char *n = f->name;
    fsdp_store_set_timeout(s, 20000);
    rank_arg_t args[NRANKS];
    pthread_t th[NRANKS];
    int started = 0, ok = 1;
    for (int r = 0; r < NRANKS; r++) {
        args[r] = (rank_arg_t){.rank = r};
        if (fsdp_store_clone(s, NULL, &args[r].s) != FSDP_OK) break;
        if (pthread_create(&th[r], NULL, rank_main, &args[r]) != 0) {
            fsdp_store_destroy(args[r].s);
            break;
        }
        started++;
    }
    for (int r = 0; r < started; r++) {
        pthread_join(th[r], NULL);
        if (args[r].rc != FSDP_OK) {
            ok = 0;
            tap_diag("%s", args[r].why);
        }
        fsdp_store_destroy(args[r].s);
    }
    tap_is_int(started, NRANKS, "%s: %d rank threads started", n, NRANKS);
    tap_ok(ok, "%s: %d rank threads count, publish and read every address", n, NRANKS);
    char buf[32];
    size_t len = 0;
    fsdp_store_get(s, "hits", buf, sizeof buf, &len);
    buf[len < sizeof buf ? len : sizeof buf - 1] = 0;
    char want[32];
    snprintf(want, sizeof want, "%d", NRANKS * RANK_ADDS);
    tap_is_str(buf, want, "%s: concurrent adds lose no update", n);
    fsdp_store_destroy(s);
}

typedef struct overwrite_arg {
    fsdp_store_t *s;
    int rc;
    int torn; /* reads that mixed two values */
} overwrite_arg_t;

static void *overwriter(void *p) {
    overwrite_arg_t *a = p;
    static unsigned char vals[2][BIG];
    memset(vals[0], 'A', BIG);
    memset(vals[1], 'B', BIG);
    for (int i = 0; i < OVERWRITES && a->rc == FSDP_OK; i++)
        a->rc = fsdp_store_set(a->s, "big", vals[i & 1], BIG);
    return NULL;
}

static void test_whole_values(const store_factory_t *f) {
    fsdp_store_t *s = open_fresh(f, "whole");
    if (!s) return;
    const char *n = f->name;
    fsdp_store_set_timeout(s, 20000);
    static unsigned char init[BIG], buf[BIG];
    memset(init, 'A', BIG);
    fsdp_store_set(s, "big", init, BIG);
    overwrite_arg_t w = {.rc = FSDP_OK};
    fsdp_store_clone(s, NULL, &w.s);
    pthread_t th;
    int started = w.s && pthread_create(&th, NULL, overwriter, &w) == 0;
    int rc = FSDP_OK, torn = 0;
    for (int i = 0; i < OVERWRITES && rc == FSDP_OK; i++) {
        size_t len = 0;
        rc = fsdp_store_get(s, "big", buf, sizeof buf, &len);
        if (rc != FSDP_OK) break;
        size_t same = 0;
        while (same < len && buf[same] == buf[0]) same++;
        if (len != BIG || same != len || (buf[0] != 'A' && buf[0] != 'B')) torn++;
    }
    if (started) pthread_join(th, NULL);
    tap_ok(started, "%s: writer thread started", n);
    tap_is_int(w.rc, FSDP_OK, "%s: %d overwrites of a 64 KiB value", n, OVERWRITES);
    tap_is_int(rc, FSDP_OK, "%s: concurrent reads succeed", n);
    tap_is_int(torn, 0, "%s: no read sees part of a value or a mix of two", n);
    fsdp_store_destroy(w.s);
    fsdp_store_destroy(s);
}

void store_suite_run(const store_factory_t *f) {
    test_values(f);
    test_timeouts(f);
    test_keys(f);
    test_clones(f);
    test_ranks(f);
    test_whole_values(f);
}

/* ---- processes ---- */

/* Child side of store_suite_two_processes: waits for "ping", answers "pong". */
static int ping_child(const store_factory_t *f, const char *ns) {
    fsdp_store_t *s = NULL;
    if (f->open(f->arg, ns, &s) != FSDP_OK) return 10;
    fsdp_store_set_timeout(s, 20000);
    char buf[64];
    size_t len;
    int rc = fsdp_store_get(s, "ping", buf, sizeof buf - 1, &len);
    int status = 0;
    if (rc != FSDP_OK || len != 11 || memcmp(buf, "from-parent", 11) != 0) {
        fprintf(stderr, "# child: get ping: %s\n", fsdp_store_last_error(s));
        status = 11;
    } else if (fsdp_store_set(s, "pong", "from-child", 10) != FSDP_OK) {
        fprintf(stderr, "# child: set pong: %s\n", fsdp_store_last_error(s));
        status = 12;
    }
    fsdp_store_destroy(s);
    return status;
}

void store_suite_two_processes(const store_factory_t *f) {
    const char *n = f->name;
    char ns[96];
    store_suite_ns("twoproc", ns, sizeof ns);
    fsdp_store_t *s = NULL;
    if (!tap_is_int(f->open(f->arg, ns, &s), FSDP_OK, "%s: open %s in the parent", n, ns)) return;
    fsdp_store_set_timeout(s, 20000);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) _exit(ping_child(f, ns));
    if (!tap_ok(pid > 0, "%s: fork a second process", n)) {
        fsdp_store_destroy(s);
        return;
    }
    struct timespec pause = {0, 50 * 1000000L};
    nanosleep(&pause, NULL); /* let the child start waiting */
    tap_is_int(fsdp_store_set(s, "ping", "from-parent", 11), FSDP_OK, "%s: the parent sets ping",
               n);
    char buf[64];
    size_t len = 0;
    int rc = fsdp_store_get(s, "pong", buf, sizeof buf, &len);
    tap_is_int(rc, FSDP_OK, "%s: the parent gets the child's pong", n);
    tap_ok(rc == FSDP_OK && len == 10 && memcmp(buf, "from-child", 10) == 0,
           "%s: a value written by one process is read by another, both ways", n);
    int status = 0;
    waitpid(pid, &status, 0);
    tap_ok(WIFEXITED(status) && WEXITSTATUS(status) == 0, "%s: the child saw ping (status %d)", n,
           WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    fsdp_store_destroy(s);
}

/* Child side of store_suite_cross_process. */
static int adder_child(const store_factory_t *f, const char *ns, int index, int adds) {
    fsdp_store_t *s = NULL;
    int rc = f->open(f->arg, ns, &s);
    if (rc != FSDP_OK) {
        fprintf(stderr, "# child %d: open: %s (the library logged why)\n", index,
                fsdp_err_name(rc));
        return 10;
    }
    fsdp_store_set_timeout(s, 60000);
    int status = 0;
    for (int i = 0; i < adds && !status; i++) {
        if (fsdp_store_add(s, "counter", 1, NULL) != FSDP_OK) {
            fprintf(stderr, "# child %d: add: %s\n", index, fsdp_store_last_error(s));
            status = 11;
        }
    }
    char key[32], val[32];
    snprintf(key, sizeof key, "child/%d", index);
    int len = snprintf(val, sizeof val, "pid %d index %d", (int)getpid(), index);
    if (!status && fsdp_store_set(s, key, val, (size_t)len) != FSDP_OK) {
        fprintf(stderr, "# child %d: set: %s\n", index, fsdp_store_last_error(s));
        status = 12;
    }
    fsdp_store_destroy(s);
    return status;
}

void store_suite_cross_process(const store_factory_t *f, int nproc, int adds) {
    const char *n = f->name;
    char ns[96];
    store_suite_ns("xproc", ns, sizeof ns);
    pid_t pids[64];
    if (nproc > 64) nproc = 64;
    int forked = 0, clean = 1;
    fflush(stdout);
    fflush(stderr);
    double t0 = store_suite_now_ms();
    for (int i = 0; i < nproc; i++) {
        pid_t pid = fork();
        if (pid == 0) _exit(adder_child(f, ns, i, adds));
        if (pid < 0) break;
        pids[forked++] = pid;
    }
    for (int i = 0; i < forked; i++) {
        int status = 0;
        waitpid(pids[i], &status, 0);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            clean = 0;
            tap_diag("%s: child %d ended with status 0x%x", n, i, status);
        }
    }
    double ms = store_suite_now_ms() - t0;
    tap_is_int(forked, nproc, "%s: forked %d processes", n, nproc);
    tap_ok(clean, "%s: %d processes each added %d times and set a key (%.0f ms)", n, nproc, adds,
           ms);
    fsdp_store_t *s = NULL;
    if (!tap_is_int(f->open(f->arg, ns, &s), FSDP_OK, "%s: reopen %s", n, ns)) return;
    fsdp_store_set_timeout(s, 2000);
    char buf[64], want[64];
    size_t len = 0;
    int rc = fsdp_store_get(s, "counter", buf, sizeof buf - 1, &len);
    buf[rc == FSDP_OK ? len : 0] = 0;
    snprintf(want, sizeof want, "%d", nproc * adds);
    tap_is_str(buf, want, "%s: the shared counter holds every add of every process", n);
    int keys_ok = 1;
    for (int i = 0; i < forked; i++) {
        char key[32];
        snprintf(key, sizeof key, "child/%d", i);
        snprintf(want, sizeof want, "pid %d index %d", (int)pids[i], i);
        rc = fsdp_store_get(s, key, buf, sizeof buf - 1, &len);
        if (rc != FSDP_OK || len != strlen(want) || memcmp(buf, want, len) != 0) {
            keys_ok = 0;
            tap_diag("%s: %s: rc %d: %s", n, key, rc, fsdp_store_last_error(s));
        }
    }
    tap_ok(keys_ok, "%s: every process's key holds its value", n);
    fsdp_store_destroy(s);
}
