/* SPDX-License-Identifier: MIT */
/*
 * t_sim_device.c: the sim backend over device memory (fsdp_sim_pg_set_device, fsdp/sim.h).
 *
 * Built twice from this file:
 *   - t_sim_device (make check): every rank's group has a CPU device whose vtable is wrapped to
 *     count memcpy, coll_reduce and stream_sync calls, so the checks see that the data really
 *     moved through the device path;
 *   - t_sim_cuda (make check-gpu, SIM_DEV_CUDA): every rank has a CUDA device on the one GPU,
 *     and the buffers are CUDA managed memory (the checker reads them from the host). Skips
 *     where no CUDA device is visible.
 *
 * 1. The F02 collective suite (coll_matrix.c: every collective x dtype x operator, counts 0, 1,
 *    1001 and a large message, in and out of place, both roots) on the device path; every element
 *    is checked bitwise against the closed forms that the host path passes (t_pg_coll).
 * 2. Bitwise parity with the host path on data where the order of accumulation matters: random
 *    f32/f64/f16/bf16 values (non-exact sums), all_reduce with sum and avg and reduce_scatter
 *    with sum, run once on host memory and once on the device path; the results must be
 *    identical bytes.
 * 3. Contract: ranks that disagree on where their buffers live get FSDP_EMISMATCH; a device of
 *    another context and a NULL group are FSDP_EINVAL; a sub-group inherits the device.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <config.h>
#include <fsdp.h>

#include "tap.h"

#if defined(SIM_DEV_CUDA) && !defined(FSDP_HAVE_CUDA)
int main(void) {
    return tap_skip_all("libfsdp was configured without CUDA");
}
#else

#include "coll_check.h"
#include "coll_matrix.h"
#include "device/device_impl.h"

#ifdef SIM_DEV_CUDA
#include <cuda_runtime_api.h>
#define DEV_KIND FSDP_DEVICE_CUDA
#define NAME "sim over cuda"
static const int worlds[] = {2, 4};
#else
#define DEV_KIND FSDP_DEVICE_CPU
#define NAME "sim over cpu device"
static const int worlds[] = {1, 2, 3, 4};
#endif
#define NWORLDS ((int)(sizeof worlds / sizeof worlds[0]))

/* ---- a device whose data movement is counted (CPU build) ------------------------------------ */

static _Atomic long n_memcpy, n_reduce, n_sync;
static struct fsdp_dev_ops counted_ops;
static const struct fsdp_dev_ops *base_ops;

static int counted_memcpy(fsdp_device_t *dev, void *dst, const void *src, size_t n,
                          fsdp_copy_kind_t kind, void *stream) {
    atomic_fetch_add(&n_memcpy, 1);
    return base_ops->memcpy(dev, dst, src, n, kind, stream);
}
static int counted_reduce(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_redop_t op, int divisor,
                          double prescale, void *const *outs, int nout, const void *const *ins,
                          int nin, size_t n, void *stream) {
    atomic_fetch_add(&n_reduce, 1);
    return base_ops->coll_reduce(dev, dt, op, divisor, prescale, outs, nout, ins, nin, n, stream);
}
static int counted_sync(fsdp_device_t *dev, void *stream) {
    atomic_fetch_add(&n_sync, 1);
    return base_ops->stream_sync(dev, stream);
}

/* The rank's device; on the CPU build its vtable is the counting copy. */
static int make_device(fsdp_ctx_t *ctx, fsdp_device_t **out) {
    int rc = fsdp_device_create(ctx, DEV_KIND, NULL, out);
    if (rc < 0) return rc;
#ifndef SIM_DEV_CUDA
    (*out)->ops = &counted_ops;
#endif
    return FSDP_OK;
}

/* ---- buffers --------------------------------------------------------------------------------- */

#ifdef SIM_DEV_CUDA
static void *buf_alloc(size_t bytes) {
    void *p = NULL;
    return cudaMallocManaged(&p, bytes ? bytes : 1, cudaMemAttachGlobal) == cudaSuccess ? p : NULL;
}
static void buf_free(void *p) {
    if (p) cudaFree(p);
}
#else
static void *buf_alloc(size_t bytes) {
    return malloc(bytes ? bytes : 1);
}
static void buf_free(void *p) {
    free(p);
}
#endif

/* ---- 1. the matrix on the device path ---------------------------------------------------------- */

typedef struct sim_call {
    cm_rank_fn fn;
    void *arg;
} sim_call_t;

static int dev_rank(fsdp_ctx_t *ctx, void *arg) {
    const sim_call_t *c = arg;
    fsdp_device_t *dev = NULL;
    int rc = make_device(ctx, &dev);
    if (rc < 0) return rc;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    rc = fsdp_sim_pg_set_device(pg, dev);
    if (rc == FSDP_OK) rc = c->fn(ctx, pg, c->arg);
    fsdp_sim_pg_set_device(pg, NULL);
    fsdp_device_destroy(dev);
    return rc;
}

static int dev_runner(int n, cm_rank_fn fn, void *arg, int *status) {
    sim_call_t c = {fn, arg};
    fsdp_sim_options_t o;
    fsdp_sim_options_init(&o);
    o.world_size = n;
    o.timeout_ms = 300000;
    return fsdp_sim_run(&o, dev_rank, &c, status);
}

/* ---- 2. bitwise parity with the host path ------------------------------------------------------ */

#define PAR_COUNT 10007 /* prime: uneven slices */
#define PAR_WORLD 4

static const fsdp_dtype_t par_dts[] = {FSDP_DTYPE_F32, FSDP_DTYPE_F64, FSDP_DTYPE_F16,
                                       FSDP_DTYPE_BF16};
#define NPAR_DT 4
/* (kind, op) cases */
static const fsdp_coll_kind_t par_kind[] = {FSDP_COLL_ALL_REDUCE, FSDP_COLL_ALL_REDUCE,
                                            FSDP_COLL_REDUCE_SCATTER};
static const fsdp_redop_t par_op[] = {FSDP_REDOP_SUM, FSDP_REDOP_AVG, FSDP_REDOP_SUM};
#define NPAR_CASE 3

typedef struct par_shared {
    int fails[NPAR_DT][NPAR_CASE];
    int errors[NPAR_DT][NPAR_CASE];
} par_shared_t;

static uint64_t mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Random values of magnitudes 2^-10 .. 2^10 and both signs: sums round at every step. */
static void fill_random(fsdp_dtype_t dt, void *p, size_t n, int rank) {
    for (size_t i = 0; i < n; i++) {
        uint64_t h = mix(((uint64_t)rank << 40) ^ i ^ ((uint64_t)dt << 56));
        double v = ((double)(h >> 11) / 9007199254740992.0 - 0.5) * (double)(1 << (h & 15)) /
                   32.0;
        fsdp_dtype_convert((char *)p + i * fsdp_dtype_size(dt), dt, &v, FSDP_DTYPE_F64, 1);
    }
}

static int run_one(fsdp_pg_t *pg, fsdp_coll_kind_t kind, fsdp_dtype_t dt, fsdp_redop_t op,
                   void *send, void *recv) {
    if (kind == FSDP_COLL_ALL_REDUCE) return fsdp_pg_all_reduce(pg, send, recv, PAR_COUNT, dt, op, NULL);
    return fsdp_pg_reduce_scatter(pg, send, recv, PAR_COUNT, dt, op, NULL);
}

static int parity_rank(fsdp_ctx_t *ctx, void *arg) {
    par_shared_t *sh = arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    int r = fsdp_pg_rank(pg), n = fsdp_pg_size(pg);
    fsdp_device_t *dev = NULL;
    int rc = make_device(ctx, &dev);
    if (rc < 0) return rc;
    size_t max_bytes = (size_t)n * PAR_COUNT * 8;
    void *hsend = malloc(max_bytes), *hrecv = malloc(max_bytes), *dres = malloc(max_bytes);
    void *dsend = buf_alloc(max_bytes), *drecv = buf_alloc(max_bytes);
    if (!hsend || !hrecv || !dres || !dsend || !drecv) rc = FSDP_ENOMEM;
    for (int di = 0; di < NPAR_DT && rc == FSDP_OK; di++) {
        fsdp_dtype_t dt = par_dts[di];
        size_t es = fsdp_dtype_size(dt);
        for (int ci = 0; ci < NPAR_CASE && rc == FSDP_OK; ci++) {
            size_t scount = par_kind[ci] == FSDP_COLL_REDUCE_SCATTER ? (size_t)n * PAR_COUNT
                                                                     : PAR_COUNT;
            fill_random(dt, hsend, scount, r);
            memcpy(dsend, hsend, scount * es);
            memset(hrecv, 0, PAR_COUNT * es);
            memset(drecv, 0, PAR_COUNT * es);
            int e1 = run_one(pg, par_kind[ci], dt, par_op[ci], hsend, hrecv);
            int e2 = fsdp_sim_pg_set_device(pg, dev);
            int e3 = run_one(pg, par_kind[ci], dt, par_op[ci], dsend, drecv);
            int e4 = fsdp_sim_pg_set_device(pg, NULL);
            if (e1 || e2 || e3 || e4) {
                __atomic_fetch_add(&sh->errors[di][ci], 1, __ATOMIC_RELAXED);
                rc = e1 ? e1 : e2 ? e2 : e3 ? e3 : e4;
                break;
            }
            memcpy(dres, drecv, PAR_COUNT * es);
            if (memcmp(dres, hrecv, PAR_COUNT * es) != 0)
                __atomic_fetch_add(&sh->fails[di][ci], 1, __ATOMIC_RELAXED);
        }
    }
    free(hsend);
    free(hrecv);
    free(dres);
    buf_free(dsend);
    buf_free(drecv);
    fsdp_device_destroy(dev);
    return rc;
}

static void test_parity(void) {
    par_shared_t sh;
    memset(&sh, 0, sizeof sh);
    fsdp_sim_options_t o;
    fsdp_sim_options_init(&o);
    o.world_size = PAR_WORLD;
    o.timeout_ms = 120000;
    int rc = fsdp_sim_run(&o, parity_rank, &sh, NULL);
    tap_is_int(rc, FSDP_OK, NAME ": parity run at world %d", PAR_WORLD);
    for (int di = 0; di < NPAR_DT; di++)
        for (int ci = 0; ci < NPAR_CASE; ci++)
            tap_ok(rc == FSDP_OK && sh.fails[di][ci] == 0 && sh.errors[di][ci] == 0,
                   NAME ": %s %s %s of random values over %d ranks is bitwise the host path's "
                   "(%d ranks differ)",
                   fsdp_coll_name(par_kind[ci]), fsdp_redop_name(par_op[ci]),
                   fsdp_dtype_name(par_dts[di]), PAR_WORLD, sh.fails[di][ci]);
}

/* ---- 3. contract ------------------------------------------------------------------------------- */

typedef struct contract {
    int mismatch_rc[2];
    int other_ctx_rc, null_rc, sub_inherits, sub_rc[2], after_rc[2];
} contract_t;

static int contract_rank(fsdp_ctx_t *ctx, void *arg) {
    contract_t *c = arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    int r = fsdp_pg_rank(pg);
    fsdp_device_t *dev = NULL;
    int rc = make_device(ctx, &dev);
    if (rc < 0) return rc;
    float *buf = buf_alloc(64 * sizeof(float));
    if (!buf) return FSDP_ENOMEM;
    for (int i = 0; i < 64; i++) buf[i] = (float)(r + i);
    /* A sub-group made after the device was set inherits it. */
    fsdp_sim_pg_set_device(pg, dev);
    fsdp_pg_t *sub = NULL;
    const int members[2] = {0, 1};
    c->sub_rc[r] = fsdp_pg_new_group(pg, members, 2, &sub);
    if (c->sub_rc[r] == FSDP_OK) {
        if (r == 0) c->sub_inherits = fsdp_sim_pg_device(sub) == dev;
        for (int i = 0; i < 64; i++) buf[i] = (float)(r + i);
        c->after_rc[r] = fsdp_pg_all_reduce(sub, buf, buf, 64, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
        for (int i = 0; i < 64 && c->after_rc[r] == FSDP_OK; i++)
            if (buf[i] != (float)(1 + 2 * i)) c->after_rc[r] = COLL_CHECK_MISMATCH;
        fsdp_pg_destroy(sub);
    }
    fsdp_sim_pg_set_device(pg, NULL);
    /* Rank 0 on the device, rank 1 on the host. */
    if (r == 0) fsdp_sim_pg_set_device(pg, dev);
    c->mismatch_rc[r] = fsdp_pg_all_reduce(pg, buf, buf, 64, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    fsdp_sim_pg_set_device(pg, NULL);
    if (r == 0) {
        /* A device of another context. */
        fsdp_ctx_t *other = NULL;
        fsdp_device_t *odev = NULL;
        fsdp_ctx_options_t co;
        fsdp_ctx_options_init(&co);
        if (fsdp_ctx_create(&co, &other) == FSDP_OK &&
            fsdp_device_create(other, DEV_KIND, NULL, &odev) == FSDP_OK)
            c->other_ctx_rc = fsdp_sim_pg_set_device(pg, odev);
        fsdp_device_destroy(odev);
        fsdp_ctx_destroy(other);
        c->null_rc = fsdp_sim_pg_set_device(NULL, dev);
    }
    fsdp_sim_pg_set_device(pg, NULL);
    buf_free(buf);
    fsdp_device_destroy(dev);
    return FSDP_OK;
}

static void test_contract(void) {
    contract_t c;
    memset(&c, 0, sizeof c);
    fsdp_sim_options_t o;
    fsdp_sim_options_init(&o);
    o.world_size = 2;
    o.timeout_ms = 60000;
    int rc = fsdp_sim_run(&o, contract_rank, &c, NULL);
    tap_is_int(rc, FSDP_OK, NAME ": contract run");
    tap_is_int(c.mismatch_rc[0], FSDP_EMISMATCH, NAME ": device on rank 0 and host on rank 1: "
                                                      "FSDP_EMISMATCH on rank 0");
    tap_is_int(c.mismatch_rc[1], FSDP_EMISMATCH, NAME ": ... and on rank 1");
    tap_is_int(c.other_ctx_rc, FSDP_EINVAL, NAME ": a device of another context is FSDP_EINVAL");
    tap_is_int(c.null_rc, FSDP_EINVAL, NAME ": a NULL group is FSDP_EINVAL");
    tap_is_int(c.sub_rc[0], FSDP_OK, NAME ": sub-group created (rank 0)");
    tap_is_int(c.sub_rc[1], FSDP_OK, NAME ": sub-group created (rank 1)");
    tap_ok(c.sub_inherits, NAME ": the sub-group keeps its buffers on the parent's device");
    tap_ok(c.after_rc[0] == FSDP_OK && c.after_rc[1] == FSDP_OK,
           NAME ": all_reduce on the sub-group through the device is right (rc %d, %d)",
           c.after_rc[0], c.after_rc[1]);
}

int main(void) {
#ifdef SIM_DEV_CUDA
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev <= 0)
        return tap_skip_all("no CUDA device");
#endif
    base_ops = &fsdp__cpu_dev_ops;
    counted_ops = fsdp__cpu_dev_ops;
    counted_ops.memcpy = counted_memcpy;
    counted_ops.coll_reduce = counted_reduce;
    counted_ops.stream_sync = counted_sync;
    coll_check_set_alloc(buf_alloc, buf_free);
    tap_plan_lazy();

    cm_options_t mo = {.name = "F02 " NAME,
                       .worlds = worlds,
                       .nworlds = NWORLDS,
                       .large = cm_large_bytes(4, 1)};
    int combos = cm_matrix(dev_runner, &mo);
    tap_diag("matrix: %d combinations per rank", combos);
#ifndef SIM_DEV_CUDA
    tap_ok(atomic_load(&n_memcpy) > 0 && atomic_load(&n_reduce) > 0 && atomic_load(&n_sync) > 0,
           NAME ": the matrix moved its data through the device (%ld memcpy, %ld coll_reduce, "
                "%ld stream_sync calls)",
           (long)atomic_load(&n_memcpy), (long)atomic_load(&n_reduce),
           (long)atomic_load(&n_sync));
    long before = atomic_load(&n_reduce);
#endif
    test_parity();
#ifndef SIM_DEV_CUDA
    tap_ok(atomic_load(&n_reduce) > before, NAME ": the parity runs reduced through the device");
#endif
    test_contract();
    return tap_done();
}

#endif /* SIM_DEV_CUDA without CUDA */
