/* SPDX-License-Identifier: MIT */
/*
 * fsdp/pg.h: the process group, the only way ranks talk to each other.
 *
 * A process group is one rank's handle on a set of ranks that run collectives together. Every
 * backend (sim, gloo, nccl, dummy) sits behind this one interface; arguments are checked here,
 * once, before a backend sees them.
 *
 * Argument meanings are NCCL's:
 *   all_gather     send: count elements; recv: size * count elements, rank q's send lands at
 *                  recv + q * count. In place when send == recv + rank * count.
 *   reduce_scatter send: size * count elements; recv: count elements, the reduction of every
 *                  rank's send[rank * count, (rank + 1) * count). In place when
 *                  recv == send + rank * count.
 *   all_reduce     send, recv: count elements. In place when send == recv.
 *   broadcast      root's send (count elements) is copied into every rank's recv; send is read
 *                  on the root only. In place when send == recv.
 *   reduce         like all_reduce, but only the root's recv receives the result (recv is not
 *                  touched elsewhere and may be NULL there). In place when send == recv.
 *   all_to_all     send and recv: size * count elements; rank q's send[r * count, ...) lands in
 *                  rank r's recv[q * count, ...). Not in place: the buffers must not overlap.
 *   barrier        no data.
 * Other overlaps between send and recv are rejected with FSDP_EINVAL.
 *
 * Reductions are computed in rank order (((x0 + x1) + x2) + ...), so a result is bitwise the
 * same whatever the thread or network timing. f16 and bf16 are accumulated in f32 and rounded
 * once. avg is the sum divided by the group size in the accumulation type (f32 for the 16-bit
 * floats, the type itself otherwise; integer division truncates). Integer sums and products
 * wrap around modulo 2^bits. For bool, sum and max are "or", prod and min are "and", and avg is
 * rejected.
 *
 * Completion. Every collective takes `fsdp_work_t **work`. With work == NULL the call blocks
 * until the collective has completed and returns its status. Otherwise *work receives a handle
 * and the call returns at once; the collective runs in the background and the caller must not
 * touch send or recv until fsdp_work_wait() or fsdp_work_test() reports completion. Works on a
 * process group complete in the order they were issued, and a rank's collectives on all its
 * groups are executed in the order it issued them (like one CUDA stream).
 *
 * Timeouts. Each group has a timeout (default 300 s, fsdp_pg_set_timeout()). A collective whose
 * peers do not all join within the timeout fails on every rank that joined with FSDP_ETIMEDOUT,
 * naming the missing ranks; a rank that failed or exited makes its peers fail with
 * FSDP_EREMOTE. Such a failure is sticky: every later collective on the group fails the same
 * way, as a communicator abort does in NCCL. Ranks that issue different collectives at the same
 * sequence number all get FSDP_EMISMATCH with a message listing every rank's call; the group
 * stays usable.
 *
 * Thread-safety: a process group handle belongs to one rank. Its collectives may be issued from
 * several threads at once: each call is numbered and handed to the backend as one step, so the
 * sequence numbers follow the order in which the calls reached the group (an order the caller
 * must make the same on every rank). Waiting on works, the counters and fsdp_pg_seq() are safe
 * from any thread; the rest (splitting, setting the timeout, destroying) is done by one thread
 * at a time.
 */
#ifndef FSDP_PG_H
#define FSDP_PG_H

#include <stddef.h>
#include <stdint.h>

#include <fsdp/dtype.h>
#include <fsdp/export.h>
#include <fsdp/redop.h>

FSDP_BEGIN_DECLS

typedef struct fsdp_ctx fsdp_ctx_t;
typedef struct fsdp_pg fsdp_pg_t;
typedef struct fsdp_work fsdp_work_t;

typedef enum fsdp_coll_kind {
    FSDP_COLL_ALL_GATHER = 0,
    FSDP_COLL_REDUCE_SCATTER,
    FSDP_COLL_ALL_REDUCE,
    FSDP_COLL_BROADCAST,
    FSDP_COLL_REDUCE,
    FSDP_COLL_ALL_TO_ALL,
    FSDP_COLL_BARRIER,
    FSDP_COLL_COUNT
} fsdp_coll_kind_t;

/* "all_gather", "reduce_scatter", ...; "invalid" otherwise. */
FSDP_EXTERN const char *fsdp_coll_name(fsdp_coll_kind_t kind);

/* The default timeout of a new group, in milliseconds. */
#define FSDP_PG_DEFAULT_TIMEOUT_MS 300000

/* Queries. */
FSDP_EXTERN int fsdp_pg_rank(const fsdp_pg_t *pg);
FSDP_EXTERN int fsdp_pg_size(const fsdp_pg_t *pg);
/* The group's name: "world" for a world group, "<parent>.<seq>c<color>" for a sub-group. */
FSDP_EXTERN const char *fsdp_pg_name(const fsdp_pg_t *pg);
/* The backend's name: "sim", "dummy", "gloo", "nccl". */
FSDP_EXTERN const char *fsdp_pg_backend(const fsdp_pg_t *pg);
/* The rank in the world group of this group's rank `group_rank`; -1 when out of range. */
FSDP_EXTERN int fsdp_pg_world_rank(const fsdp_pg_t *pg, int group_rank);
/* Number of collectives issued on the group so far; the next one gets this sequence number. */
FSDP_EXTERN uint64_t fsdp_pg_seq(const fsdp_pg_t *pg);
/* Text of the last error on this group ("" when none). */
FSDP_EXTERN const char *fsdp_pg_last_error(const fsdp_pg_t *pg);

/* Timeout for collectives issued from now on, in milliseconds (> 0). */
FSDP_EXTERN int fsdp_pg_set_timeout(fsdp_pg_t *pg, int64_t timeout_ms);
FSDP_EXTERN int64_t fsdp_pg_timeout(const fsdp_pg_t *pg);

/*
 * A collective described whole, as NCCL's calls take it: the stream it is issued on travels
 * with the call, so a group that several users share (the units of an FSDP tree) holds no
 * stream of its own. `stream` is a native stream handle (a cudaStream_t for nccl, where NULL is
 * the legacy default stream) and is ignored by the CPU backends; op is read by the reductions,
 * root by broadcast and reduce. Zero-initialize it and set what the kind needs.
 *
 * `prescale`, when not 0, makes a sum (op FSDP_REDOP_SUM of a reduction on f16, bf16, f32 or
 * f64) multiply every rank's input by it before adding, each product rounded to the dtype, as
 * NCCL's ncclRedOpCreatePreMulSum does: FSDP's gradient pre-division without a pass of its own.
 * With a power of two it gives the bits of dividing each input by 1 / prescale in place and then
 * summing. Every rank must give the same value; it must be finite.
 */
typedef struct fsdp_coll_desc {
    fsdp_coll_kind_t kind;
    const void *send;
    void *recv;
    size_t count;
    fsdp_dtype_t dtype;
    fsdp_redop_t op;
    int root;
    void *stream;
    double prescale;
} fsdp_coll_desc_t;

/* Issues the collective desc describes (checked as the calls below are). */
FSDP_EXTERN int fsdp_pg_collective(fsdp_pg_t *pg, const fsdp_coll_desc_t *desc, fsdp_work_t **work);

/* Collectives on the default stream; see the top of this file for the meaning of each
 * argument. */
FSDP_EXTERN int fsdp_pg_all_gather(fsdp_pg_t *pg, const void *send, void *recv, size_t count,
                                   fsdp_dtype_t dt, fsdp_work_t **work);
FSDP_EXTERN int fsdp_pg_reduce_scatter(fsdp_pg_t *pg, const void *send, void *recv, size_t count,
                                       fsdp_dtype_t dt, fsdp_redop_t op, fsdp_work_t **work);
FSDP_EXTERN int fsdp_pg_all_reduce(fsdp_pg_t *pg, const void *send, void *recv, size_t count,
                                   fsdp_dtype_t dt, fsdp_redop_t op, fsdp_work_t **work);
FSDP_EXTERN int fsdp_pg_broadcast(fsdp_pg_t *pg, const void *send, void *recv, size_t count,
                                  fsdp_dtype_t dt, int root, fsdp_work_t **work);
FSDP_EXTERN int fsdp_pg_reduce(fsdp_pg_t *pg, const void *send, void *recv, size_t count,
                               fsdp_dtype_t dt, fsdp_redop_t op, int root, fsdp_work_t **work);
FSDP_EXTERN int fsdp_pg_all_to_all(fsdp_pg_t *pg, const void *send, void *recv, size_t count,
                                   fsdp_dtype_t dt, fsdp_work_t **work);
FSDP_EXTERN int fsdp_pg_barrier(fsdp_pg_t *pg, fsdp_work_t **work);

/*
 * Waits for a work. timeout_ms < 0 waits until the collective completes (its group's timeout
 * bounds that); timeout_ms >= 0 returns FSDP_ETIMEDOUT if it has not completed by then, and the
 * work stays outstanding (wait again, or release it). Returns the collective's status; the
 * message of a failure is fsdp_work_error() and also the group's last error.
 */
FSDP_EXTERN int fsdp_work_wait(fsdp_work_t *work, int64_t timeout_ms);

/*
 * Stream-ordered wait: makes later work on `stream` (a native stream handle: a cudaStream_t for
 * nccl, where NULL is the legacy default stream) wait for the work's collective without blocking
 * the host, so that a device computes while the collective runs and reads its result in order.
 * Backends without device streams (sim, gloo, dummy) wait on the host instead, exactly as
 * fsdp_work_wait(work, -1) does; so does nccl for a collective whose buffers it staged through
 * host memory, and any backend that fails to enqueue the wait. Returns FSDP_OK once the stream
 * is ordered after the collective (or the collective has completed), or the work's failure when
 * it is known already. The work handle may be released right after; the group keeps what it
 * needs to report a late failure.
 *
 * Late failures. A collective that fails after its stream wait was enqueued keeps its status
 * (fsdp_work_error()), and its group reports the failure once, at the group's next blocking
 * point: fsdp_work_wait() on any work of the group (which returns it when that work itself
 * succeeded), the next collective issued on the group (which is then not run and returns it:
 * the group has failed, and a failure is sticky), or fsdp_pg_sync(). The message names the
 * collective, its sequence number, the group and the rank. A failure still unreported when the
 * group is destroyed is logged as an error. Two late failures are reported at two blocking
 * points, oldest first.
 */
FSDP_EXTERN int fsdp_work_wait_stream(fsdp_work_t *work, void *stream);

/* Waits on the host until every collective issued on the group so far has completed, then
 * returns the oldest late failure not yet reported (see fsdp_work_wait_stream), or FSDP_OK. */
FSDP_EXTERN int fsdp_pg_sync(fsdp_pg_t *pg);

/* Sets *done to 1 when the work has completed, else 0; returns FSDP_OK or the work's failure. */
FSDP_EXTERN int fsdp_work_test(fsdp_work_t *work, int *done);

/* Text of the work's failure ("" while running or after success). */
FSDP_EXTERN const char *fsdp_work_error(const fsdp_work_t *work);

/* The sequence number the work's collective got on its group. */
FSDP_EXTERN uint64_t fsdp_work_seq(const fsdp_work_t *work);

/* Releases the caller's handle; NULL is accepted. A work released before completion still
 * completes, and its buffers stay borrowed until then (fsdp_pg_destroy() waits for it). */
FSDP_EXTERN void fsdp_work_release(fsdp_work_t *work);

/*
 * Sub-groups. Both are collective over `pg`: every rank of pg must call, in the same order
 * relative to its other collectives on pg.
 *
 * fsdp_pg_split: ranks passing the same color form one new group, ordered by (key, rank in
 * pg). A rank passing FSDP_PG_NO_COLOR gets *out = NULL.
 * fsdp_pg_new_group: the listed ranks of pg (n distinct ranks in any order; the new group's
 * rank i is ranks[i]) form a new group; every rank of pg must pass the same list, and ranks not
 * in it get *out = NULL.
 * The caller owns *out and frees it with fsdp_pg_destroy() before its context.
 */
#define FSDP_PG_NO_COLOR (-1)
FSDP_EXTERN int fsdp_pg_split(fsdp_pg_t *pg, int color, int key, fsdp_pg_t **out);
FSDP_EXTERN int fsdp_pg_new_group(fsdp_pg_t *pg, const int *ranks, int n, fsdp_pg_t **out);

/* Waits for the group's outstanding works, then frees it; NULL is accepted. */
FSDP_EXTERN void fsdp_pg_destroy(fsdp_pg_t *pg);

/* Calls, bytes and waits per collective kind since creation or the last reset. Bytes are the
 * size of the whole message as nccl-tests counts it: size * count elements for all_gather,
 * reduce_scatter and all_to_all, count elements for the others. */
typedef struct fsdp_pg_counters {
    uint64_t calls[FSDP_COLL_COUNT];
    uint64_t bytes[FSDP_COLL_COUNT];
    /* Waits per kind of the waited collective: on the host (fsdp_work_wait, the blocking form
     * of a collective, and fsdp_work_wait_stream where it falls back to the host) and on a
     * stream (fsdp_work_wait_stream's wait that left the host free). */
    uint64_t host_waits[FSDP_COLL_COUNT];
    uint64_t stream_waits[FSDP_COLL_COUNT];
} fsdp_pg_counters_t;
FSDP_EXTERN void fsdp_pg_get_counters(const fsdp_pg_t *pg, fsdp_pg_counters_t *out);
FSDP_EXTERN void fsdp_pg_reset_counters(fsdp_pg_t *pg);

/*
 * The dummy process group: rank and size only, for construction-only code and tests (PyTorch's
 * DummyProcessGroup). With FSDP_DUMMY_NOOP every collective completes at once without touching
 * its buffers; with FSDP_DUMMY_FAIL every collective fails with FSDP_ENOTSUP. Splitting is not
 * supported. ctx may be NULL.
 */
typedef enum fsdp_dummy_mode { FSDP_DUMMY_NOOP = 0, FSDP_DUMMY_FAIL } fsdp_dummy_mode_t;
FSDP_EXTERN int fsdp_pg_create_dummy(fsdp_ctx_t *ctx, int rank, int size, fsdp_dummy_mode_t mode,
                                     fsdp_pg_t **out);

FSDP_END_DECLS

#endif /* FSDP_PG_H */
