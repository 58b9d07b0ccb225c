/* SPDX-License-Identifier: MIT */
/*
 * fsdp/sim.h: the sim backend, N ranks as N threads of one process.
 *
 * fsdp_sim_run() starts one thread per rank, gives each a context with its world process group
 * and a handle on a shared in-memory store, and runs fn on each. Collectives move data by
 * reading peers' buffers directly; reductions run in rank order, so results are bitwise
 * deterministic. Each rank has a communication thread that executes its collectives in issue
 * order, so a caller can overlap compute with outstanding works.
 *
 * A network latency can be simulated: with comm_latency_us > 0 every collective (any kind, on
 * any group, on every rank) takes at least that long, because the rank waits that long before
 * executing it. The wait happens where the collective executes: on the rank's communication
 * thread, so a caller that issued it asynchronously keeps computing meanwhile (which is what
 * lets prefetching be measured), or, for a blocking call with nothing else outstanding, on the
 * caller's thread, which blocks as usual. A rank's collectives execute one after the other, so
 * k collectives issued back to back take at least k times the latency. The latency changes
 * timing only: results stay bitwise the same.
 *
 * Faults can be injected to test error paths: a rank can be delayed before or after its k-th
 * collective, or its k-th collective can fail. A rank whose fn returns stops taking part: peers
 * waiting for it get FSDP_EREMOTE at once, and nothing hangs.
 */
#ifndef FSDP_SIM_H
#define FSDP_SIM_H

#include <stddef.h>
#include <stdint.h>

#include <fsdp/context.h>
#include <fsdp/device.h>
#include <fsdp/export.h>

FSDP_BEGIN_DECLS

typedef enum fsdp_sim_fault_kind {
    FSDP_SIM_DELAY_BEFORE = 0, /* sleep delay_ms before the collective starts */
    FSDP_SIM_DELAY_AFTER,      /* sleep delay_ms after it completed, before the work completes */
    FSDP_SIM_FAIL              /* the collective fails on this rank (FSDP_EBACKEND) */
} fsdp_sim_fault_kind_t;

typedef struct fsdp_sim_fault {
    fsdp_sim_fault_kind_t kind;
    int rank;         /* world rank the fault applies to */
    uint64_t call;    /* index of the rank's collective, from 0, counted over all its groups */
    int64_t delay_ms; /* for the delays */
} fsdp_sim_fault_t;

typedef struct fsdp_sim_options {
    /* sizeof this struct as the caller was built; set by fsdp_sim_options_init() */
    size_t size;
    int world_size;                 /* >= 1 */
    int64_t timeout_ms;             /* timeout of the world group; 0 for the default */
    uint64_t seed;                  /* seed of every rank's context */
    const fsdp_sim_fault_t *faults; /* may be NULL */
    size_t nfaults;
    /* Simulated latency of every collective, in microseconds (>= 0; 0: none). Applied before
     * the collective starts, on each rank, so every collective takes at least this long. Keep
     * it well below timeout_ms: the latency of a peer counts against the collective's timeout. */
    int64_t comm_latency_us;
} fsdp_sim_options_t;

/* Fills opts with world size 1, the default timeout, seed 0, no faults and no latency. */
FSDP_EXTERN void fsdp_sim_options_init(fsdp_sim_options_t *opts, size_t size);
#define fsdp_sim_options_init(opts) (fsdp_sim_options_init)((opts), sizeof *(opts))

/* What each rank runs. Return FSDP_OK or a negative status. */
typedef int (*fsdp_sim_fn)(fsdp_ctx_t *ctx, void *arg);

/*
 * Runs fn on world_size threads and waits for all of them. rank_status (may be NULL) receives
 * each rank's return value. Returns FSDP_OK when every rank returned FSDP_OK, the status of the
 * lowest failing rank otherwise, or FSDP_EINVAL / FSDP_ENOMEM when the run could not start
 * (FSDP_EINVAL, logged with the name of the field, for a world_size out of range, a negative
 * timeout_ms or comm_latency_us, or a bad fault).
 * Groups a rank created and did not destroy are destroyed when its fn returns.
 */
FSDP_EXTERN int fsdp_sim_run(const fsdp_sim_options_t *opts, fsdp_sim_fn fn, void *arg,
                             int *rank_status);

/*
 * Where a sim group's buffers live. By default (dev NULL) they are host memory: collectives copy
 * with memcpy and reduce with the CPU's rank-ordered reduction. With a device, every buffer
 * this rank passes to the group's collectives is memory of dev (CUDA memory for a CUDA device,
 * so that several ranks can run FSDP on the memory of one GPU, which NCCL cannot), and every
 * data movement of this rank's share of a collective goes through dev: copies with its memcpy
 * (device to device: the ranks are threads of one process, so a rank reads its peers' buffers
 * directly) and reductions with its collective-reduction kernel, in rank order with the
 * semantics of fsdp/pg.h, so the results are bitwise those of the host path, for every dtype
 * and operator, with one exception on CUDA: a NaN produced by a float sum, product or average
 * is the GPU's canonical NaN, where the CPU keeps an input's payload (min and max return an
 * input, so their NaNs match). Before a collective joins, the rank's device work queued so far (on its compute stream)
 * completes; the copies and kernels run on the compute stream and are waited for, so a
 * completed collective means the data is in place, as with host memory.
 *
 * Every rank of the group sets a device of the same kind, or none: a collective whose ranks
 * disagree fails with FSDP_EMISMATCH on every rank. dev must be a device of the rank's context
 * (the one that owns pg), and the group must have no outstanding collective (FSDP_EINVAL
 * otherwise, as for a pg that is not a sim group). Sub-groups created from pg afterwards inherit
 * its device. dev is borrowed: set NULL (or destroy the group) before destroying it. A CUDA
 * device reduces at most 64 ranks' inputs (a larger group fails with FSDP_ENOTSUP).
 */
FSDP_EXTERN int fsdp_sim_pg_set_device(fsdp_pg_t *pg, fsdp_device_t *dev);

/* The device set with fsdp_sim_pg_set_device() (NULL: host memory, or pg is not a sim group). */
FSDP_EXTERN fsdp_device_t *fsdp_sim_pg_device(const fsdp_pg_t *pg);

FSDP_END_DECLS

#endif /* FSDP_SIM_H */
