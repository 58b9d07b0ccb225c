/* SPDX-License-Identifier: MIT */
/*
 * t_nccl_coll.c: the NCCL process group on GPUs (make check-gpu). Skips where libfsdp was built
 * without NCCL or no CUDA device is visible.
 *
 * Ranks are processes forked per GPU (mp_fork.h), each with its own context, a file store in a
 * directory the parent made, and an NCCL world group on device `rank`. The parent never touches
 * CUDA (a process that forks after initializing CUDA leaves its children unable to use it): it
 * counts the devices in a forked child.
 *
 * 1. The foundation's collective suite (seed behaviour F02, coll_matrix.h) at the world size of
 *    the visible GPUs (up to MP_MAX_RANKS; 1 on a single-GPU machine), on CUDA managed memory so
 *    that the checker reads and writes the buffers from the host.
 * 2. Streams: a producer's copy on the caller's stream, the collective with a work handle, and a
 *    consumer's copy on the caller's stream synchronized without waiting for the work: the
 *    consumer sees the collective's result.
 * 3. Sub-groups through ncclCommSplit: split by parity with reversed keys, and new_group of rank
 *    0 alone; each runs an all_reduce.
 * 4. A rank that does not join: the communicator's creation fails with FSDP_ETIMEDOUT after the
 *    timeout; with two GPUs or more, a collective that a peer never issues times out, and the
 *    failure is sticky.
 * 5. With two GPUs or more, a peer killed after creation: the survivor's collective fails
 *    (FSDP_EREMOTE, or FSDP_ETIMEDOUT where NCCL cannot see the death), and so does the next one.
 */
#define _POSIX_C_SOURCE 200809L

#include <config.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <fsdp.h>

#include "coll_check.h"
#include "coll_matrix.h"
#include "mp_fork.h"
#include "tap.h"

#ifdef FSDP_HAVE_NCCL
#include <cuda_runtime.h>

#define NAME "F02 nccl"
#define COLL_TIMEOUT_MS 60000

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *managed_alloc(size_t bytes) {
    void *p = NULL;
    return cudaMallocManaged(&p, bytes, cudaMemAttachGlobal) == cudaSuccess ? p : NULL;
}

static void managed_free(void *p) {
    if (p) cudaFree(p);
}

static int probe_rank(int rank, int n, const char *dir, void *arg) {
    int *ndev = arg, k = 0;
    (void)rank, (void)n, (void)dir;
    if (cudaGetDeviceCount(&k) != cudaSuccess) k = 0;
    *ndev = k;
    return FSDP_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* The runner: one process per GPU, each with an NCCL world group */

typedef struct runner {
    cm_rank_fn fn;
    void *arg;
    int world;          /* the context's world size (n, or more to leave ranks missing) */
    int64_t timeout_ms; /* creation */
} runner_t;

static fsdp_ctx_t *make_ctx(int rank, int size) {
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    o.rank = rank;
    o.world_size = size;
    fsdp_ctx_t *ctx = NULL;
    return fsdp_ctx_create(&o, &ctx) == FSDP_OK ? ctx : NULL;
}

static int nccl_rank(int rank, int n, const char *dir, void *arg) {
    const runner_t *ru = arg;
    fsdp_store_t *store = NULL;
    fsdp_pg_t *pg = NULL;
    int rc = fsdp_store_create_file(NULL, dir, &store);
    if (rc < 0) return rc;
    fsdp_ctx_t *ctx = make_ctx(rank, ru->world ? ru->world : n);
    if (!ctx) {
        fsdp_store_destroy(store);
        return FSDP_ENOMEM;
    }
    fsdp_nccl_options_t o;
    fsdp_nccl_options_init(&o);
    o.device = rank;
    o.timeout_ms = ru->timeout_ms ? ru->timeout_ms : COLL_TIMEOUT_MS;
    rc = fsdp_pg_create_nccl(ctx, store, &o, &pg);
    if (rc < 0) {
        tap_diag("rank %d: fsdp_pg_create_nccl: %s: %s", rank, fsdp_err_name(rc),
                 fsdp_ctx_last_error(ctx));
    } else {
        coll_check_set_alloc(managed_alloc, managed_free);
        rc = ru->fn(ctx, pg, ru->arg);
    }
    fsdp_ctx_destroy(ctx); /* and its groups */
    fsdp_store_destroy(store);
    return rc;
}

static int run_nccl(int n, cm_rank_fn fn, void *arg, int *status) {
    runner_t ru = {fn, arg, 0, 0};
    return mp_fork_ranks(n, nccl_rank, &ru, 300, status);
}

/* ---------------------------------------------------------------------------------------- */
/* 2. Streams */

typedef struct shared_res {
    int rc[MP_MAX_RANKS];
    int bad[MP_MAX_RANKS];
    double dt[MP_MAX_RANKS];
    char msg[MP_MAX_RANKS][600];
    char msg2[MP_MAX_RANKS][600];
} shared_res_t;

#define STREAM_COUNT ((size_t)1 << 22)

static int stream_rank(fsdp_ctx_t *ctx, fsdp_pg_t *pg, void *arg) {
    shared_res_t *res = arg;
    const int r = fsdp_pg_rank(pg), n = fsdp_pg_size(pg);
    const size_t bytes = STREAM_COUNT * sizeof(float);
    (void)ctx;
    cudaStream_t s = NULL;
    float *dev = NULL, *in = NULL, *out = NULL;
    int rc = FSDP_EBACKEND;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess ||
        cudaMalloc((void **)&dev, bytes) != cudaSuccess ||
        cudaMallocHost((void **)&in, bytes) != cudaSuccess ||
        cudaMallocHost((void **)&out, bytes) != cudaSuccess)
        goto out;
    for (size_t i = 0; i < STREAM_COUNT; i++) {
        in[i] = (float)(r + 1) + (float)(i % 7);
        out[i] = -1.0f;
    }
    cudaMemcpyAsync(dev, in, bytes, cudaMemcpyHostToDevice, s); /* the producer */
    fsdp_work_t *w = NULL;
    /* The stream travels with the collective (fsdp_coll_desc_t), not with the group. */
    fsdp_coll_desc_t d = {.kind = FSDP_COLL_ALL_REDUCE,
                          .send = dev,
                          .recv = dev,
                          .count = STREAM_COUNT,
                          .dtype = FSDP_DTYPE_F32,
                          .op = FSDP_REDOP_SUM,
                          .stream = s};
    rc = fsdp_pg_collective(pg, &d, &w);
    if (rc < 0) {
        snprintf(res->msg[r], sizeof res->msg[r], "%s", fsdp_pg_last_error(pg));
        goto out;
    }
    cudaMemcpyAsync(out, dev, bytes, cudaMemcpyDeviceToHost, s); /* the consumer */
    cudaStreamSynchronize(s);                                    /* not the work */
    int bad = 0;
    for (size_t i = 0; i < STREAM_COUNT; i++) {
        float want = (float)(n * (n + 1) / 2) + (float)n * (float)(i % 7);
        if (out[i] != want && bad++ == 0)
            snprintf(res->msg[r], sizeof res->msg[r], "out[%zu] = %g, want %g", i, out[i], want);
    }
    res->bad[r] = bad;
    rc = fsdp_work_wait(w, -1);
    fsdp_work_release(w);
out:
    if (s) cudaStreamDestroy(s);
    cudaFree(dev);
    cudaFreeHost(in);
    cudaFreeHost(out);
    res->rc[r] = rc;
    return rc;
}

static void test_streams(int n) {
    shared_res_t *res = mp_shared_alloc(sizeof *res);
    int rc = run_nccl(n, stream_rank, res, NULL);
    int bad = 0;
    for (int r = 0; r < n; r++) {
        bad += res->bad[r];
        if (res->msg[r][0]) tap_diag("rank %d: %s", r, res->msg[r]);
    }
    tap_ok(rc == FSDP_OK && bad == 0,
           "streams, world %d: a copy queued on the caller's stream after an asynchronous "
           "all_reduce, synchronized without waiting for the work, sees the %zu sums",
           n, STREAM_COUNT);
    mp_shared_free(res);
}

/* ---------------------------------------------------------------------------------------- */
/* 3. Sub-groups */

/* all_reduce sum of (world rank + 1) over g on managed memory; returns the sum or -1. */
static long sum_of_world_ranks(fsdp_pg_t *g, char *msg, size_t cap) {
    int64_t *v = managed_alloc(sizeof *v);
    if (!v) return -1;
    *v = fsdp_pg_world_rank(g, fsdp_pg_rank(g)) + 1;
    int rc = fsdp_pg_all_reduce(g, v, v, 1, FSDP_DTYPE_I64, FSDP_REDOP_SUM, NULL);
    long got = rc == FSDP_OK ? (long)*v : -1;
    if (rc < 0) snprintf(msg, cap, "%s", fsdp_pg_last_error(g));
    managed_free(v);
    return got;
}

static int groups_rank(fsdp_ctx_t *ctx, fsdp_pg_t *pg, void *arg) {
    shared_res_t *res = arg;
    const int r = fsdp_pg_rank(pg), n = fsdp_pg_size(pg);
    (void)ctx;
    fsdp_pg_t *sub = NULL, *solo = NULL;
    int rc = fsdp_pg_split(pg, r % 2, -r, &sub);
    int bad = 0;
    if (rc < 0) {
        snprintf(res->msg[r], sizeof res->msg[r], "split: %s", fsdp_pg_last_error(pg));
        goto out;
    }
    /* Members of my parity in decreasing rank order. */
    int members = 0, want_rank = 0;
    long want_sum = 0;
    for (int q = n - 1; q >= 0; q--) {
        if (q % 2 != r % 2) continue;
        if (q > r) want_rank++;
        members++;
        want_sum += q + 1;
    }
    bad += !sub || fsdp_pg_size(sub) != members || fsdp_pg_rank(sub) != want_rank ||
           strcmp(fsdp_pg_backend(sub), "nccl") != 0 || fsdp_nccl_device(sub) != r;
    long got = sub ? sum_of_world_ranks(sub, res->msg[r], sizeof res->msg[r]) : -1;
    if (got != want_sum) {
        bad++;
        snprintf(res->msg2[r], sizeof res->msg2[r], "split sum %ld, want %ld", got, want_sum);
    }
    int zero = 0;
    rc = fsdp_pg_new_group(pg, &zero, 1, &solo);
    if (rc < 0) {
        snprintf(res->msg[r], sizeof res->msg[r], "new_group: %s", fsdp_pg_last_error(pg));
        goto out;
    }
    if (r == 0) {
        got = solo ? sum_of_world_ranks(solo, res->msg[r], sizeof res->msg[r]) : -1;
        bad += !solo || fsdp_pg_size(solo) != 1 || got != 1;
    } else {
        bad += solo != NULL;
    }
    /* The world group still works after both. */
    got = sum_of_world_ranks(pg, res->msg[r], sizeof res->msg[r]);
    bad += got != (long)n * (n + 1) / 2;
out:
    fsdp_pg_destroy(solo);
    fsdp_pg_destroy(sub);
    res->bad[r] = bad;
    res->rc[r] = rc;
    return rc;
}

static void test_groups(int n) {
    shared_res_t *res = mp_shared_alloc(sizeof *res);
    int rc = run_nccl(n, groups_rank, res, NULL);
    int bad = 0;
    for (int r = 0; r < n; r++) {
        bad += res->bad[r];
        if (res->msg[r][0]) tap_diag("rank %d: %s", r, res->msg[r]);
        if (res->msg2[r][0]) tap_diag("rank %d: %s", r, res->msg2[r]);
    }
    tap_ok(rc == FSDP_OK && bad == 0,
           "sub-groups, world %d: split by parity with reversed keys and new_group({0}) (through "
           "ncclCommSplit) have the right ranks and sums; the world group still works",
           n);
    mp_shared_free(res);
}

/* ---------------------------------------------------------------------------------------- */
/* 4 and 5. Failures */

static int lonely_rank(int rank, int n, const char *dir, void *arg) {
    shared_res_t *res = arg;
    (void)n;
    fsdp_store_t *store = NULL;
    if (fsdp_store_create_file(NULL, dir, &store) < 0) return FSDP_EBACKEND;
    fsdp_ctx_t *ctx = make_ctx(rank, 2); /* rank 1 never comes */
    fsdp_nccl_options_t o;
    fsdp_nccl_options_init(&o);
    o.device = 0;
    o.timeout_ms = 3000;
    fsdp_pg_t *pg = NULL;
    double t0 = now_s();
    res->rc[0] = fsdp_pg_create_nccl(ctx, store, &o, &pg);
    res->dt[0] = now_s() - t0;
    snprintf(res->msg[0], sizeof res->msg[0], "%s", fsdp_ctx_last_error(ctx));
    res->bad[0] = pg != NULL || fsdp_ctx_pg(ctx) != NULL;
    fsdp_ctx_destroy(ctx);
    fsdp_store_destroy(store);
    return FSDP_OK;
}

static void test_creation_timeout(void) {
    shared_res_t *res = mp_shared_alloc(sizeof *res);
    /* Rank 0 publishes the id, so its communicator's creation is what has to time out. */
    mp_fork_ranks(1, lonely_rank, res, 120, NULL);
    tap_is_int(res->rc[0], FSDP_ETIMEDOUT,
               "rank 0 of 2 alone: fsdp_pg_create_nccl fails with FSDP_ETIMEDOUT");
    tap_diag("%s", res->msg[0]);
    tap_ok(res->dt[0] >= 2.9 && res->dt[0] < 30.0 && !res->bad[0],
           "... after the 3 s timeout (%.2f s), leaving no group", res->dt[0]);
    tap_has_str(res->msg[0], "did not join", "... saying a rank did not join");
    mp_shared_free(res);
}

/* Rank 1 never issues the all_reduce: it waits until rank 0 has seen its failure. */
typedef struct fail_arg {
    shared_res_t res;
    volatile int done; /* set by rank 0 */
    int kill_peer;     /* 5: rank 1 kills itself instead */
} fail_arg_t;

static int fail_rank(fsdp_ctx_t *ctx, fsdp_pg_t *pg, void *arg) {
    fail_arg_t *fa = arg;
    const int r = fsdp_pg_rank(pg);
    (void)ctx;
    int rc = fsdp_pg_barrier(pg, NULL);
    if (rc < 0) return rc;
    if (r != 0) {
        if (fa->kill_peer) raise(SIGKILL);
        for (int i = 0; i < 600 && !fa->done; i++)
            sleep_ms(100);
        return FSDP_OK;
    }
    if (fa->kill_peer) sleep_ms(500); /* let it die */
    fsdp_pg_set_timeout(pg, fa->kill_peer ? 20000 : 3000);
    float *v = managed_alloc(sizeof *v);
    *v = 1.0f;
    double t0 = now_s();
    fa->res.rc[0] = fsdp_pg_all_reduce(pg, v, v, 1, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    fa->res.dt[0] = now_s() - t0;
    snprintf(fa->res.msg[0], sizeof fa->res.msg[0], "%s", fsdp_pg_last_error(pg));
    fa->res.rc[1] = fsdp_pg_barrier(pg, NULL);
    snprintf(fa->res.msg2[0], sizeof fa->res.msg2[0], "%s", fsdp_pg_last_error(pg));
    managed_free(v);
    fa->done = 1;
    return FSDP_OK;
}

static void test_collective_timeout(int n) {
    fail_arg_t *fa = mp_shared_alloc(sizeof *fa);
    runner_t ru = {fail_rank, fa, 0, 0};
    mp_fork_ranks(2, nccl_rank, &ru, 300, NULL);
    (void)n;
    tap_is_int(fa->res.rc[0], FSDP_ETIMEDOUT,
               "rank 1 skips an all_reduce: rank 0's fails with FSDP_ETIMEDOUT");
    tap_diag("%s", fa->res.msg[0]);
    tap_ok(fa->res.dt[0] >= 2.9 && fa->res.dt[0] < 30.0, "... after the 3 s timeout (%.2f s)",
           fa->res.dt[0]);
    tap_has_str(fa->res.msg[0], "all_reduce(f32, count=1, op=sum) seq 1 on group 'world'",
                "... naming the collective, its sequence number and the group");
    tap_is_int(fa->res.rc[1], FSDP_ETIMEDOUT, "... and the next barrier fails the same way");
    tap_has_str(fa->res.msg2[0], "failed earlier", "... saying the group failed earlier");
    mp_shared_free(fa);
}

static void test_killed_peer(void) {
    fail_arg_t *fa = mp_shared_alloc(sizeof *fa);
    fa->kill_peer = 1;
    runner_t ru = {fail_rank, fa, 0, 0};
    mp_fork_ranks(2, nccl_rank, &ru, 300, NULL);
    tap_ok(fa->res.rc[0] == FSDP_EREMOTE || fa->res.rc[0] == FSDP_ETIMEDOUT,
           "rank 1 killed: rank 0's all_reduce fails (%s after %.2f s)",
           fsdp_err_name(fa->res.rc[0]), fa->res.dt[0]);
    tap_diag("%s", fa->res.msg[0]);
    tap_ok(fa->res.rc[1] == fa->res.rc[0], "... and so does the next barrier (%s)",
           fsdp_err_name(fa->res.rc[1]));
    mp_shared_free(fa);
}
#endif

int main(void) {
#ifndef FSDP_HAVE_NCCL
    return tap_skip_all("libfsdp was configured without NCCL");
#else
    int *ndev = mp_shared_alloc(sizeof *ndev);
    mp_fork_ranks(1, probe_rank, ndev, 60, NULL);
    int n = *ndev;
    mp_shared_free(ndev);
    if (n <= 0) return tap_skip_all("no CUDA device");
    if (n > MP_MAX_RANKS) n = MP_MAX_RANKS;
    tap_plan_lazy();
    tap_diag("%d CUDA device(s): worlds of %d rank process(es)", n, n);
    double t0 = now_s();
    const int worlds[1] = {n};
    cm_options_t o = {.name = NAME,
                      .worlds = worlds,
                      .nworlds = 1,
                      .large = cm_large_bytes(16, 4),
                      .timeout_ms = COLL_TIMEOUT_MS};
    int combos = cm_matrix(run_nccl, &o);
    tap_diag("matrix: %d combinations per rank; %.1f s", combos, now_s() - t0);
    test_streams(n);
    test_groups(n);
    test_creation_timeout();
    if (n >= 2) {
        test_collective_timeout(n);
        test_killed_peer();
    } else {
        tap_skip(7, "one GPU: a peer that does not join a collective or dies needs two");
    }
    return tap_done();
#endif
}
