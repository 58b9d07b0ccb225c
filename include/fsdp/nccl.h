/* SPDX-License-Identifier: MIT */
/*
 * fsdp/nccl.h: the NCCL process group (ranks on CUDA GPUs).
 *
 * An NCCL group is one rank's handle on a group of ranks, one per GPU, that run their
 * collectives with NCCL (https://github.com/NVIDIA/nccl). The collectives are those of
 * fsdp/pg.h, with the same arguments, checks, works, timeouts and sub-groups; buffers are CUDA
 * device memory (or managed memory) of the group's device. Host memory that CUDA does not know
 * (malloc) is accepted too and staged through device memory, so that the core's own small
 * exchanges (fsdp_pg_split) work; that is slow and meant for a few bytes.
 *
 * Rendezvous. Rank 0 creates an NCCL unique id and publishes it through the store (file, Redis
 * or memory: the same interface Gloo uses); the other ranks wait for it with the group's
 * timeout. The communicator is then created non-blocking (ncclCommInitRankConfig with
 * blocking = 0) and polled, so a rank whose peers never join fails with FSDP_ETIMEDOUT instead of
 * hanging.
 *
 * Streams. Each group has its own communication stream on its device. A collective is issued on
 * it after an event recorded on the caller's stream (the stream its descriptor carries,
 * fsdp_coll_desc_t; NULL and the plain calls: the legacy default stream), so it runs after the
 * work that produced its input, and the caller's stream then waits on the collective's end
 * event, so kernels queued there later consume its output without the host waiting.
 * fsdp_work_wait() and a blocking call (work == NULL) still wait on the host until the collective
 * has completed on the GPU, as fsdp/pg.h requires; a program that only needs GPU ordering can issue
 * with a work handle and release it. A rank's collectives run in the order it issued them over all
 * its NCCL groups, as fsdp/pg.h requires: a group's stream orders its own, and a collective on
 * another group than the rank's previous one first waits for that group's last event (so they never
 * overlap on the GPU, unlike PyTorch's groups).
 *
 * Algorithms and results. all_gather, reduce_scatter, all_reduce, broadcast and reduce are
 * NCCL's; all_to_all is one NCCL group call of a send and a receive per peer; barrier is an
 * all_reduce of one byte. dtypes map to NCCL's (bool to ncclUint8) and so do sum, prod, min and
 * max; on bool, sum and max are ncclMax ("or"), prod and min are ncclMin ("and"). avg is an
 * NCCL sum followed by a division by the group size on the GPU, in the accumulation type
 * (integer division truncates), as fsdp/pg.h requires, rather than NCCL's ncclAvg, which
 * multiplies each input by 1/size first. f16 and bf16 sums, averages and products are widened
 * to f32 on the GPU, reduced by NCCL in f32 and rounded once (twice the bytes travel); their min
 * and max are exact and run in the 16-bit type. NCCL combines the ranks' values in an order that
 * depends on its algorithm (ring, tree) and the position in the buffer, so a floating-point sum
 * or product whose partial results are not exact may differ from the sim backend in the last
 * bits; integer and bool results, min and max, and exact values never differ.
 *
 * Failures. Each group has a watchdog thread that polls the end event of its oldest collective
 * (cudaEventQuery) and the communicator's asynchronous error (ncclCommGetAsyncError), and
 * completes works in issue order. A collective that has not completed within the group's
 * timeout (counted from when it reached the head of the group's queue) fails with
 * FSDP_ETIMEDOUT; an asynchronous NCCL error (a peer died, a network failure) fails it with
 * FSDP_EREMOTE. Either way the watchdog aborts the communicator (ncclCommAbort), which stops its
 * kernels, and fails every pending and later collective of the group with the same status
 * (sticky). Messages name the group, the collective and its sequence number. A CUDA error
 * gives FSDP_EBACKEND with CUDA's text.
 *
 * Sub-groups (fsdp_pg_split, fsdp_pg_new_group) are made with ncclCommSplit on the parent's
 * communicator; every rank of the parent takes part, those outside the new group with
 * NCCL_SPLIT_NOCOLOR. They inherit the parent's device and timeout.
 */
#ifndef FSDP_NCCL_H
#define FSDP_NCCL_H

#include <stddef.h>
#include <stdint.h>

#include <fsdp/export.h>

FSDP_BEGIN_DECLS

typedef struct fsdp_ctx fsdp_ctx_t;
typedef struct fsdp_pg fsdp_pg_t;
typedef struct fsdp_store fsdp_store_t;

typedef struct fsdp_nccl_options {
    /* sizeof this struct as the caller was built; set by fsdp_nccl_options_init() */
    size_t size;
    /* CUDA device ordinal of this rank; -1: $LOCAL_RANK when set, else the context's rank
     * modulo the number of visible devices. */
    int device;
    /* Milliseconds allowed for the rendezvous and the communicator's creation, and the new
     * group's collective timeout (fsdp_pg_set_timeout() changes the latter later);
     * 0: FSDP_PG_DEFAULT_TIMEOUT_MS. */
    int64_t timeout_ms;
} fsdp_nccl_options_t;

/* Fills o with the defaults: device -1, timeout 0 (the default). */
FSDP_EXTERN void fsdp_nccl_options_init(fsdp_nccl_options_t *o, size_t size);
#define fsdp_nccl_options_init(o) (fsdp_nccl_options_init)((o), sizeof *(o))

/*
 * Creates this rank's handle on the world group of ctx's rank and world size, rendezvousing
 * through `store` under the prefix "nccl.<n>/" (n counts the NCCL worlds created on that store,
 * as for Gloo). Collective over the world: every rank must call it. Blocks until the
 * communicator is ready, or fails with FSDP_ETIMEDOUT after o->timeout_ms. `store` is only used
 * during the call. o may be NULL (defaults).
 *
 * When ctx has no world group yet, the new group becomes ctx's world group (fsdp_ctx_pg()) and
 * store its store (fsdp_ctx_store()). The caller owns *out (fsdp_pg_destroy(), before ctx).
 *
 * Errors: FSDP_EINVAL (NULL ctx, store or out, negative timeout, a device ordinal that does not
 * exist), FSDP_ENOTSUP (no CUDA device is visible, libfsdp was built without NCCL, or the CUDA
 * plugin libfsdp-cuda.so that holds the backend could not be loaded: the message names the paths
 * tried and why; see FSDP_PLUGIN_DIR in fsdp/device.h),
 * FSDP_ETIMEDOUT, FSDP_EBACKEND (CUDA or NCCL failed; the message has their reason),
 * FSDP_ENOMEM. Messages go to fsdp_ctx_last_error(ctx). A failed creation leaves nothing behind.
 */
FSDP_EXTERN int fsdp_pg_create_nccl(fsdp_ctx_t *ctx, fsdp_store_t *store,
                                    const fsdp_nccl_options_t *o, fsdp_pg_t **out);

/* 1 when this build of libfsdp has the NCCL backend, else 0. It does not open the CUDA plugin
 * (only fsdp_pg_create_nccl() does), so a plugin that cannot be loaded shows there. */
FSDP_EXTERN int fsdp_nccl_available(void);

/* The CUDA device ordinal of an NCCL group; -1 for another backend or NULL. */
FSDP_EXTERN int fsdp_nccl_device(const fsdp_pg_t *pg);

FSDP_END_DECLS

#endif /* FSDP_NCCL_H */
