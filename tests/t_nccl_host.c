/* SPDX-License-Identifier: MIT */
/*
 * t_nccl_host.c: the parts of the NCCL process group that run without a GPU (fsdp/nccl.h).
 *
 * 1. The unique-id rendezvous (backends/nccl/nccl_id.c) with made-up 128-byte ids over the
 *    memory and file stores: every rank gets rank 0's bytes, worlds on one store are numbered,
 *    a missing rank 0 times out within the store's timeout, a value of the wrong length is
 *    refused.
 * 2. The dtype and operator table (nccl_map.c): every dtype and operator of fsdp/pg.h, with
 *    f16/bf16 widened for sum, avg and prod, avg as a sum and a division, bool's or/and as
 *    max/min, and FSDP_ENOTSUP for what NCCL cannot run. (NCCL builds only.)
 * 3. fsdp_pg_create_nccl: argument errors; on a host with no GPU, a clear FSDP_ENOTSUP at once
 *    that leaves no group, no store key and no thread behind; without NCCL, FSDP_ENOTSUP naming
 *    the missing build option.
 * 4. FSDP_BACKEND=nccl in fsdp_init_from_env: the same errors, through the launcher's path.
 */
#define _POSIX_C_SOURCE 200809L

#include <config.h>

#include <dirent.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <fsdp.h>

#include "backends/nccl/nccl_id.h"
#include "tap.h"

#ifdef FSDP_HAVE_NCCL
#include <cuda_runtime.h>

#include "backends/nccl/nccl_map.h"
#endif

#define ID_LEN 128 /* NCCL_UNIQUE_ID_BYTES */
#define NRANKS 4

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---------------------------------------------------------------------------------------- */
/* 1. The rendezvous */

typedef struct xrank {
    pthread_t thread;
    int rank;
    fsdp_store_t *store; /* this rank's handle */
    int64_t timeout_ms;
    unsigned char id[ID_LEN];
    char world[64]; /* the prefix the world store got: the value of a probe key */
    int rc;
    char msg[512];
} xrank_t;

static void fake_id(unsigned char *id, unsigned seed) {
    for (int i = 0; i < ID_LEN; i++)
        id[i] = (unsigned char)((seed * 2654435761u + (unsigned)i * 40503u) >> 7);
}

static void *xrank_main(void *arg) {
    xrank_t *x = arg;
    fsdp_store_t *ws = NULL;
    x->rc = fsdp__nccl_world_store(x->store, NRANKS, x->timeout_ms, &ws, x->msg, sizeof x->msg);
    if (x->rc < 0) return NULL;
    if (x->rank == 0) fake_id(x->id, 7);
    x->rc = fsdp__nccl_id_exchange(ws, "id", x->rank, x->id, ID_LEN, x->msg, sizeof x->msg);
    fsdp_store_destroy(ws);
    return NULL;
}

/* Runs one world of NRANKS threads over clones of `store`. */
static int run_world(fsdp_store_t *store, xrank_t *x) {
    for (int r = 0; r < NRANKS; r++) {
        memset(&x[r], 0, sizeof x[r]);
        x[r].rank = r;
        x[r].timeout_ms = 20000;
        if (fsdp_store_clone(store, NULL, &x[r].store) != FSDP_OK) tap_bail("fsdp_store_clone");
        pthread_create(&x[r].thread, NULL, xrank_main, &x[r]);
    }
    int rc = FSDP_OK;
    for (int r = 0; r < NRANKS; r++) {
        pthread_join(x[r].thread, NULL);
        fsdp_store_destroy(x[r].store);
        if (x[r].rc < 0 && rc == FSDP_OK) rc = x[r].rc;
        if (x[r].rc < 0) tap_diag("rank %d: %s", r, x[r].msg);
    }
    return rc;
}

static void test_exchange_on(fsdp_store_t *store, const char *what) {
    xrank_t x[NRANKS];
    unsigned char want[ID_LEN];
    fake_id(want, 7);
    int rc = run_world(store, x);
    int same = 1;
    for (int r = 0; r < NRANKS; r++)
        same &= memcmp(x[r].id, want, ID_LEN) == 0;
    tap_ok(rc == FSDP_OK && same, "%s store: %d rank threads all get rank 0's 128-byte id (%s)",
           what, NRANKS, fsdp_err_name(rc));
    /* The id sits under "nccl.0/id"; a second world on the same store uses "nccl.1/id". */
    int found0 = 0, found1 = 0;
    fsdp_store_check(store, "nccl.0/id", &found0);
    fsdp_store_check(store, "nccl.1/id", &found1);
    tap_ok(found0 && !found1, "%s store: the first world's id is under nccl.0/id", what);
    rc = run_world(store, x);
    fsdp_store_check(store, "nccl.1/id", &found1);
    int64_t worlds = 0;
    fsdp_store_add(store, "nccl.worlds", 0, &worlds);
    tap_ok(rc == FSDP_OK && found1 && worlds == 2 * NRANKS,
           "%s store: a second world on the same store rendezvouses under nccl.1/ (%lld counts)",
           what, (long long)worlds);
}

static void test_exchange(void) {
    fsdp_store_t *mem = NULL;
    if (fsdp_store_create_memory(NULL, &mem) != FSDP_OK) tap_bail("memory store");
    test_exchange_on(mem, "memory");
    fsdp_store_destroy(mem);

    char dir[192];
    tap_tmppath(dir, sizeof dir, "t_nccl_host.XXXXXX");
    if (!mkdtemp(dir)) tap_bail("mkdtemp");
    fsdp_store_t *file = NULL;
    if (fsdp_store_create_file(NULL, dir, &file) != FSDP_OK) tap_bail("file store");
    test_exchange_on(file, "file");
    fsdp_store_destroy(file);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) tap_diag("could not remove %s", dir);

    /* Rank 0 never comes: rank 1 gives up after the store's timeout, naming the key. */
    fsdp_store_create_memory(NULL, &mem);
    fsdp_store_t *ws = NULL;
    char msg[512] = "";
    int rc = fsdp__nccl_world_store(mem, 2, 300, &ws, msg, sizeof msg);
    unsigned char id[ID_LEN];
    double t0 = now_s();
    if (rc == FSDP_OK) rc = fsdp__nccl_id_exchange(ws, "id", 1, id, ID_LEN, msg, sizeof msg);
    double dt = now_s() - t0;
    tap_is_int(rc, FSDP_ETIMEDOUT, "rank 0 missing: rank 1 fails with FSDP_ETIMEDOUT");
    tap_ok(dt >= 0.25 && dt < 5.0, "... after the 300 ms timeout (%.2f s)", dt);
    tap_has_str(msg, "did not get the NCCL unique id from rank 0",
                "... and says what it waited for");
    tap_diag("%s", msg);
    /* A value of the wrong length under the key is refused, not truncated or padded. */
    fsdp_store_set(ws, "id", "short", 5);
    rc = fsdp__nccl_id_exchange(ws, "id", 1, id, ID_LEN, msg, sizeof msg);
    tap_is_int(rc, FSDP_EBACKEND, "a 5-byte id is refused with FSDP_EBACKEND");
    tap_has_str(msg, "has 5 bytes, want 128", "... saying both lengths");
    unsigned char big[ID_LEN + 8];
    memset(big, 1, sizeof big);
    fsdp_store_set(ws, "id", big, sizeof big);
    rc = fsdp__nccl_id_exchange(ws, "id", 1, id, ID_LEN, msg, sizeof msg);
    tap_is_int(rc, FSDP_EBACKEND, "a 136-byte id is refused with FSDP_EBACKEND");
    fsdp_store_destroy(ws);
    fsdp_store_destroy(mem);
}

/* ---------------------------------------------------------------------------------------- */
/* 2. The table */

#ifdef FSDP_HAVE_NCCL
static void test_map(void) {
    static const ncclDataType_t type_of[FSDP_DTYPE_COUNT] = {
        [FSDP_DTYPE_F32] = ncclFloat32, [FSDP_DTYPE_F64] = ncclFloat64,
        [FSDP_DTYPE_F16] = ncclFloat16, [FSDP_DTYPE_BF16] = ncclBfloat16,
        [FSDP_DTYPE_I32] = ncclInt32,   [FSDP_DTYPE_I64] = ncclInt64,
        [FSDP_DTYPE_U8] = ncclUint8,    [FSDP_DTYPE_BOOL] = ncclUint8};
    static const ncclRedOp_t op_of[FSDP_REDOP_COUNT] = {[FSDP_REDOP_SUM] = ncclSum,
                                                        [FSDP_REDOP_AVG] = ncclSum,
                                                        [FSDP_REDOP_MIN] = ncclMin,
                                                        [FSDP_REDOP_MAX] = ncclMax,
                                                        [FSDP_REDOP_PROD] = ncclProd};
    char msg[256];
    fsdp_nccl_plan_t p;
    int bad = 0, checked = 0;
    for (int dt = 0; dt < FSDP_DTYPE_COUNT; dt++) {
        for (int op = 0; op < FSDP_REDOP_COUNT; op++) {
            if (dt == FSDP_DTYPE_BOOL && op == FSDP_REDOP_AVG) continue;
            int half = dt == FSDP_DTYPE_F16 || dt == FSDP_DTYPE_BF16;
            int wide = half && op != FSDP_REDOP_MIN && op != FSDP_REDOP_MAX;
            ncclRedOp_t want_op = op_of[op];
            if (dt == FSDP_DTYPE_BOOL)
                want_op = op == FSDP_REDOP_SUM || op == FSDP_REDOP_MAX ? ncclMax : ncclMin;
            ncclDataType_t want_type = wide ? ncclFloat32 : type_of[dt];
            for (int k = FSDP_COLL_REDUCE_SCATTER; k <= FSDP_COLL_REDUCE; k++) {
                if (k == FSDP_COLL_BROADCAST) continue;
                int rc = fsdp__nccl_plan((fsdp_coll_kind_t)k, (fsdp_dtype_t)dt, (fsdp_redop_t)op,
                                         &p, msg, sizeof msg);
                checked++;
                if (rc != FSDP_OK || p.type != want_type || p.op != want_op || p.widen != wide ||
                    p.divide != (op == FSDP_REDOP_AVG)) {
                    if (bad++ < 3)
                        tap_diag("%s %s %s: got %s %s %s widen=%d divide=%d",
                                 fsdp_coll_name((fsdp_coll_kind_t)k),
                                 fsdp_dtype_name((fsdp_dtype_t)dt),
                                 fsdp_redop_name((fsdp_redop_t)op), fsdp_err_name(rc),
                                 fsdp__nccl_type_name(p.type), fsdp__nccl_op_name(p.op), p.widen,
                                 p.divide);
                }
            }
        }
    }
    tap_ok(bad == 0 && checked == 3 * (FSDP_DTYPE_COUNT * FSDP_REDOP_COUNT - 1),
           "every dtype x operator of the three reductions maps as documented (%d cases)", checked);
    fsdp__nccl_plan(FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_BF16, FSDP_REDOP_SUM, &p, msg, sizeof msg);
    tap_ok(p.widen && p.type == ncclFloat32 && p.op == ncclSum,
           "bf16 sum runs as an f32 ncclSum on widened values");
    fsdp__nccl_plan(FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_F16, FSDP_REDOP_MAX, &p, msg, sizeof msg);
    tap_ok(!p.widen && p.type == ncclFloat16 && p.op == ncclMax,
           "f16 max runs in f16 (exact), not widened");
    fsdp__nccl_plan(FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_I32, FSDP_REDOP_AVG, &p, msg, sizeof msg);
    tap_ok(p.op == ncclSum && p.divide && !p.widen && p.type == ncclInt32,
           "i32 avg is an ncclSum then a division, not ncclAvg");
    int bad_move = 0;
    for (int dt = 0; dt < FSDP_DTYPE_COUNT; dt++) {
        fsdp_coll_kind_t moves[3] = {FSDP_COLL_ALL_GATHER, FSDP_COLL_BROADCAST,
                                     FSDP_COLL_ALL_TO_ALL};
        for (int i = 0; i < 3; i++) {
            /* The op argument is ignored where nothing is reduced, even an invalid one. */
            int rc =
                fsdp__nccl_plan(moves[i], (fsdp_dtype_t)dt, (fsdp_redop_t)99, &p, msg, sizeof msg);
            bad_move += rc != FSDP_OK || p.type != type_of[dt] || p.widen || p.divide;
        }
    }
    tap_is_int(bad_move, 0, "all_gather, broadcast and all_to_all move every dtype as its type");
    int rc =
        fsdp__nccl_plan(FSDP_COLL_ALL_REDUCE, FSDP_DTYPE_BOOL, FSDP_REDOP_AVG, &p, msg, sizeof msg);
    tap_is_int(rc, FSDP_ENOTSUP, "avg on bool is FSDP_ENOTSUP");
    tap_has_str(msg, "avg is not defined on bool", "... saying why");
    rc = fsdp__nccl_plan(FSDP_COLL_ALL_REDUCE, (fsdp_dtype_t)FSDP_DTYPE_COUNT, FSDP_REDOP_SUM, &p,
                         msg, sizeof msg);
    tap_is_int(rc, FSDP_ENOTSUP, "a dtype outside the list is FSDP_ENOTSUP");
    tap_has_str(msg, "has no NCCL type", "... saying so");
    rc = fsdp__nccl_plan(FSDP_COLL_REDUCE, FSDP_DTYPE_F32, (fsdp_redop_t)FSDP_REDOP_COUNT, &p, msg,
                         sizeof msg);
    tap_is_int(rc, FSDP_ENOTSUP, "an operator outside the list is FSDP_ENOTSUP");
    tap_ok(strcmp(fsdp__nccl_type_name(ncclBfloat16), "ncclBfloat16") == 0 &&
               strcmp(fsdp__nccl_op_name(ncclProd), "ncclProd") == 0,
           "NCCL's names for messages");
}

/* Threads in this process (a proxy for the watchdog and helper threads a failed creation must
 * not leave behind). */
static int thread_count(void) {
    DIR *d = opendir("/proc/self/task");
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n;
}

static int visible_gpus(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}
#endif

/* ---------------------------------------------------------------------------------------- */
/* 3. Creation */

static fsdp_ctx_t *make_ctx(int rank, int size) {
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    o.rank = rank;
    o.world_size = size;
    fsdp_ctx_t *ctx = NULL;
    if (fsdp_ctx_create(&o, &ctx) != FSDP_OK) tap_bail("fsdp_ctx_create");
    return ctx;
}

static void test_create(void) {
    fsdp_nccl_options_t o;
    memset(&o, 0x5a, sizeof o);
    fsdp_nccl_options_init(&o);
    tap_ok(o.device == -1 && o.timeout_ms == 0, "options_init: device -1 (LOCAL_RANK), timeout 0");

    fsdp_ctx_t *ctx = make_ctx(0, 2);
    fsdp_store_t *store = NULL;
    fsdp_store_create_memory(NULL, &store);
    fsdp_pg_t *pg = (fsdp_pg_t *)&o; /* must be reset to NULL */
    int rc;
#ifndef FSDP_HAVE_NCCL
    rc = fsdp_pg_create_nccl(ctx, store, NULL, &pg);
    tap_is_int(rc, FSDP_ENOTSUP, "built without NCCL: fsdp_pg_create_nccl is FSDP_ENOTSUP");
    tap_ok(pg == NULL, "... and *out is NULL");
    tap_has_str(fsdp_ctx_last_error(ctx), "built without NCCL", "... naming what is missing");
    tap_has_str(fsdp_ctx_last_error(ctx), "--with-nccl", "... and how to get it");
    tap_ok(!fsdp_nccl_available() && fsdp_nccl_device(NULL) == -1, "fsdp_nccl_available() is 0");
#else
    tap_ok(fsdp_nccl_available(), "built with NCCL: fsdp_nccl_available() is 1");
    rc = fsdp_pg_create_nccl(ctx, NULL, NULL, &pg);
    tap_is_int(rc, FSDP_EINVAL, "a NULL store is FSDP_EINVAL");
    tap_ok(pg == NULL, "... and *out is NULL");
    tap_has_str(fsdp_ctx_last_error(ctx), "store is NULL", "... naming the argument");
    fsdp_nccl_options_init(&o);
    o.timeout_ms = -5;
    rc = fsdp_pg_create_nccl(ctx, store, &o, &pg);
    tap_is_int(rc, FSDP_EINVAL, "a negative timeout is FSDP_EINVAL");
    tap_has_str(fsdp_ctx_last_error(ctx), "timeout_ms -5 is negative", "... quoting it");
    tap_is_int(fsdp_pg_create_nccl(NULL, store, NULL, &pg), FSDP_EINVAL,
               "a NULL ctx is FSDP_EINVAL");
    if (visible_gpus() > 0) {
        tap_skip(4, "a CUDA device is visible: the no-GPU path is not reachable here");
    } else {
        int threads0 = thread_count();
        fsdp_nccl_options_init(&o);
        o.timeout_ms = 2000;
        double t0 = now_s();
        rc = fsdp_pg_create_nccl(ctx, store, &o, &pg);
        double dt = now_s() - t0;
        tap_is_int(rc, FSDP_ENOTSUP, "no GPU: fsdp_pg_create_nccl is FSDP_ENOTSUP");
        tap_diag("%s", fsdp_ctx_last_error(ctx));
        tap_has_str(fsdp_ctx_last_error(ctx), "no CUDA device is visible", "... saying why");
        int found = 1;
        fsdp_store_check(store, "nccl.worlds", &found);
        tap_ok(pg == NULL && fsdp_ctx_pg(ctx) == NULL && !found,
               "... without a group, a world group on the context or a key in the store");
        tap_ok(dt < 2.0 && thread_count() == threads0,
               "... at once (%.3f s, within the 2 s timeout) and without a thread left (%d)", dt,
               thread_count());
    }
#endif
    fsdp_store_destroy(store);
    fsdp_ctx_destroy(ctx);
}

/* ---------------------------------------------------------------------------------------- */
/* 4. FSDP_BACKEND=nccl */

static void test_init_env(void) {
    static const char *const vars[] = {
        "RANK",       "WORLD_SIZE",   "LOCAL_RANK",     "LOCAL_WORLD_SIZE",
        "FSDP_STORE", "FSDP_BACKEND", "FSDP_TIMEOUT_MS"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
        unsetenv(vars[i]);
    setenv("RANK", "0", 1);
    setenv("WORLD_SIZE", "1", 1);
    setenv("FSDP_BACKEND", "nccl", 1);
    setenv("FSDP_TIMEOUT_MS", "2000", 1);
    fsdp_ctx_t *ctx = NULL;
    char msg[1024];
    int rc = fsdp_init_from_env(NULL, &ctx, msg, sizeof msg);
    tap_diag("%s", msg[0] ? msg : "(no message)");
#ifndef FSDP_HAVE_NCCL
    tap_is_int(rc, FSDP_ENOTSUP, "FSDP_BACKEND=nccl without NCCL: FSDP_ENOTSUP");
    tap_has_str(msg, "built without NCCL", "... naming the missing backend");
    tap_ok(ctx == NULL, "... and no context");
#else
    if (visible_gpus() > 0) {
        tap_is_int(rc, FSDP_OK, "FSDP_BACKEND=nccl with a GPU: a world of one rank");
        tap_ok(ctx && strcmp(fsdp_pg_backend(fsdp_ctx_pg(ctx)), "nccl") == 0,
               "... whose world group is an nccl group");
        tap_ok(ctx && fsdp_nccl_device(fsdp_ctx_pg(ctx)) == 0, "... on device 0");
    } else {
        tap_is_int(rc, FSDP_ENOTSUP, "FSDP_BACKEND=nccl on a host without GPU: FSDP_ENOTSUP");
        tap_has_str(msg, "no CUDA device is visible", "... saying so");
        tap_ok(ctx == NULL, "... and no context");
    }
#endif
    fsdp_ctx_destroy(ctx);
    setenv("FSDP_BACKEND", "no-such-backend", 1);
    rc = fsdp_init_from_env(NULL, &ctx, msg, sizeof msg);
    tap_is_int(rc, FSDP_EINVAL, "an unknown FSDP_BACKEND is FSDP_EINVAL");
    tap_has_str(msg, fsdp_nccl_available() ? "(gloo, nccl)" : "(gloo)",
                "... listing the backends this build has");
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
        unsetenv(vars[i]);
}

int main(void) {
    tap_plan_lazy();
    test_exchange();
#ifdef FSDP_HAVE_NCCL
    test_map();
#endif
    test_create();
    test_init_env();
    return tap_done();
}
