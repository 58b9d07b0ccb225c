/* SPDX-License-Identifier: MIT */
/*
 * fsdp/gloo.h: the Gloo process group (ranks connected over TCP, or shared memory on one host).
 *
 * A Gloo group is one rank's handle on a group of ranks that talk over TCP through Gloo
 * (https://github.com/facebookincubator/gloo). Ranks may be processes on one or many hosts, or
 * threads of one process (each with its own context), as the tests and benchmarks do. Ranks
 * find each other through a rendezvous store (fsdp/store.h): each publishes the addresses it
 * listens on, then every pair connects. The collectives are those of fsdp/pg.h, with the same
 * arguments, checks, works, timeouts and sub-groups; buffers are CPU memory.
 *
 * Execution. Each rank (context) has one worker thread shared by all its Gloo groups, which runs
 * its collectives one at a time in the order the rank issued them, so the ordering rule of
 * fsdp/pg.h holds across groups. A blocking call runs on the caller's thread when nothing of the
 * rank is queued or running. Buffers are borrowed until the call returns (blocking) or until
 * fsdp_work_wait()/fsdp_work_test() reports completion.
 *
 * Algorithms and results.
 *   all_gather, broadcast, all_to_all, barrier: Gloo's (ring all-gather, binomial-tree
 *       broadcast, pairwise all-to-all).
 *   reduce_scatter: every rank sends each peer the peer's chunk of its input and reduces the
 *       chunks it receives, in rank order, with libfsdp's kernels. Each rank sends and receives
 *       (size - 1) / size of its input, as a ring does, and the result is bitwise that of the
 *       sim backend at every group size.
 *   all_reduce: that reduce-scatter over size nearly equal chunks of the buffer, then Gloo's
 *       allgatherv in place: 2 (size - 1) / size of the buffer each way, as a ring, and bitwise
 *       the sim backend's result at every group size.
 *   reduce: the reduce-scatter of all_reduce (each rank reduces one chunk in rank order), then
 *       every rank sends its chunk to the root: each rank sends about (size - 1) / size of the
 *       buffer plus its chunk, as Gloo's ring reduce does, and the root's result is bitwise the
 *       sim backend's at every group size. Non-roots' recv is not touched (it may be NULL).
 *   f16 and bf16 reductions accumulate in f32 and round once, as fsdp/pg.h requires: the
 *   16-bit values travel as they are and are widened when reduced.
 *   avg divides the sum by the group size in the accumulation type; integer arithmetic wraps.
 *
 * Failures. A creation (world or sub-group) whose rendezvous times out fails with
 * FSDP_ETIMEDOUT and names the ranks that never called it (each rank marks its arrival in the
 * store first). A collective that does not complete within the group's timeout fails with
 * FSDP_ETIMEDOUT; a peer that closed its connection (it failed, exited or destroyed its group)
 * gives FSDP_EREMOTE, naming the peer where Gloo's message lets us tell which one. A peer's reset
 * connection never raises SIGPIPE in the process: the threads that write on Gloo's sockets block
 * it while they do (the process's signal dispositions are left alone). Messages name
 * the group, the collective and its sequence number. Any failure other than a mismatch is sticky:
 * every later collective on the group fails at once with the same status. A rank whose
 * collective fails for any reason but a timeout closes its connections of that group, so its
 * peers fail at once instead of at their timeout.
 *
 * Shared memory. A group whose ranks all run on one host (the same boot id, IPC and PID
 * namespaces) moves its collectives through a POSIX shared-memory segment instead of TCP
 * loopback: the same results bit for bit (reductions in rank order with the same kernels), a
 * few MiB of /dev/shm per group (4 MiB a rank and 4 MiB more up to 8 ranks), named only until
 * every rank has mapped it. A peer whose process ends, or that fails or destroys the group, is
 * reported as FSDP_EREMOTE within about 50 ms instead of at the timeout. FSDP_GLOO_SHM=0 in the
 * environment of any rank when a group is created keeps that group on TCP; so does a /dev/shm
 * that cannot hold the segment. As with NCCL, ranks that issue collectives of different sizes
 * may then get wrong data rather than a timeout: FSDP_GLOO_CHECK=1 catches that.
 * Where the kernel lets ranks read each other's memory (process_vm_readv), a group may have
 * all-gathers and reduce-scatters read peers' buffers in place instead of through the segment;
 * each rank prices such a read against a local copy when the group is created (a few ms), and
 * the group reads in place only when every rank found it cheap enough. FSDP_GLOO_CMA=1 reads in
 * place without the pricing, FSDP_GLOO_CMA=0 never does. The results are the same bits.
 * A rank waiting at the transport's barrier spins briefly before it sleeps, unless the group has
 * more ranks than the CPUs the process may run on (sched_getaffinity), where the spin would take
 * the core a peer needs; FSDP_GLOO_SPIN=N (0 to 1000000 pause iterations) forces the spin.
 *
 * Mismatch check. With the environment variable FSDP_GLOO_CHECK=1 when a group is created, each
 * collective of that group (and of its sub-groups) first all-gathers every rank's descriptor
 * (kind, count, dtype, op, root, sequence number). When they differ, every rank fails with
 * FSDP_EMISMATCH and a message listing every rank's call, no data moves, and the group stays
 * usable. The check costs one extra round trip per collective, so it is off by default;
 * without it, ranks that issue different collectives block until the timeout.
 */
#ifndef FSDP_GLOO_H
#define FSDP_GLOO_H

#include <stddef.h>
#include <stdint.h>

#include <fsdp/export.h>

FSDP_BEGIN_DECLS

typedef struct fsdp_ctx fsdp_ctx_t;
typedef struct fsdp_pg fsdp_pg_t;
typedef struct fsdp_store fsdp_store_t;

typedef struct fsdp_gloo_options {
    /* sizeof this struct as the caller was built; set by fsdp_gloo_options_init() */
    size_t size;
    /* Address this rank listens on and advertises to its peers; NULL: $FSDP_GLOO_HOST, else
     * 127.0.0.1. Ignored when an interface is given. */
    const char *hostname;
    /* Or a network interface name (e.g. "eth0") whose address is used; NULL: $FSDP_GLOO_IFNAME
     * (unset or empty: none). */
    const char *iface;
    /* Milliseconds allowed for the rendezvous and connections, and the new group's collective
     * timeout (fsdp_pg_set_timeout() changes the latter later); 0: FSDP_PG_DEFAULT_TIMEOUT_MS. */
    int64_t timeout_ms;
} fsdp_gloo_options_t;

/* Fills o with the defaults: no hostname, no interface, timeout 0 (the default). */
FSDP_EXTERN void fsdp_gloo_options_init(fsdp_gloo_options_t *o, size_t size);
#define fsdp_gloo_options_init(o) (fsdp_gloo_options_init)((o), sizeof *(o))

/*
 * Creates this rank's handle on the world group of ctx's rank and world size, rendezvousing
 * through `store`, and connects to every peer. Collective over the world: every rank must call
 * it, with stores sharing the same data (clones of one in-memory store for threads of one
 * process). Blocks until all ranks are connected, or fails with FSDP_ETIMEDOUT after
 * o->timeout_ms. `store` is borrowed for the group's lifetime; the group and its sub-groups use
 * clones of it, under the prefix "gloo.<n>/" where n counts the Gloo worlds created on that
 * store, so a store can serve several worlds one after the other. After a failed creation that
 * count may be off on the ranks that did call, so retry on a fresh store (or a clone with a new
 * prefix). o may be NULL (defaults).
 *
 * When ctx has no world group yet, the new group becomes ctx's world group (fsdp_ctx_pg()) and
 * store its store (fsdp_ctx_store()). The caller owns *out (fsdp_pg_destroy(), before ctx).
 *
 * Errors: FSDP_EINVAL (NULL ctx, store or out, negative timeout), FSDP_ETIMEDOUT, FSDP_EREMOTE
 * (a peer closed a connection during the rendezvous), FSDP_EBACKEND (Gloo could not listen or
 * connect; the message has Gloo's reason), FSDP_ENOMEM, and
 * FSDP_ENOTSUP with a message when libfsdp was built without Gloo. Messages go to
 * fsdp_ctx_last_error(ctx).
 */
FSDP_EXTERN int fsdp_pg_create_gloo(fsdp_ctx_t *ctx, fsdp_store_t *store,
                                    const fsdp_gloo_options_t *o, fsdp_pg_t **out);

/* 1 when this build of libfsdp has the Gloo backend, else 0. */
FSDP_EXTERN int fsdp_gloo_available(void);

FSDP_END_DECLS

#endif /* FSDP_GLOO_H */
