/* SPDX-License-Identifier: MIT */
/*
 * fsdp/vsim.h: virtual-time simulation of one rank of a GPU cluster.
 *
 * A simulator (fsdp_vsim_t) is one representative rank of a world of N ranks on a cluster
 * described by fsdp/cluster.h. It gives that rank a shape-only device and a world process group,
 * and the caller runs the real runtime on them: the same model, wrap, FSDP units, hooks,
 * prefetch, rate limit, sharding strategy, mixed precision and optimizer as on a real cluster,
 * none of it re-implemented. Nothing is computed and no byte moves; instead every kernel and
 * every collective advances a simulated clock by the time the cost models give, so the step
 * time, the overlap of communication with compute and the memory of each category (exact, from
 * the context's accounting) come out as on the cluster, in seconds of this machine's time for a
 * model of any size.
 *
 * The shape-only device (FSDP_DEVICE_META). Its tensors have shapes, dtypes and memory
 * categories, and their allocations are counted by the accounting (fsdp/mem.h) but backed by no
 * memory: a pointer of it is a unique address that must never be dereferenced. Kernels do no
 * arithmetic. Copies to the host write zeros, so a loss, a norm or a flag read back is 0 (a
 * found-inf flag says "finite", a clipped norm is never scaled). Random initialisation draws
 * nothing. With the compute model's lowp_kernels, f16 and bf16 tensors reach the element-wise,
 * row and loss kernels as stored (as on a device with native half kernels) instead of widened
 * to f32. fsdp_device_create(ctx, FSDP_DEVICE_META, ...) gives one that charges no time; a
 * simulator's charges its clock. It has a compute stream, so FSDP orders collectives on streams
 * as on CUDA.
 *
 * The clock. The rank has a host (which issues work and is infinitely fast: its time moves only
 * when it blocks, and it blocks when 1024 operations wait on the compute stream, as CUDA's launch
 * queue makes it), a compute stream, every stream the runtime creates, and the network. A kernel
 * starts when both its stream and the host have reached it and lasts the compute model's time
 * (fsdp_compute_kernel_time of the kernel's FLOPs and bytes); copies are charged at the device's
 * memory bandwidth on their own stream. A collective starts when its stream (or the host, for one
 * issued without a stream), the host and the network are free, and lasts fsdp_net_coll_time on
 * its group's layout over the nodes; collectives are serialized on the network. Events record a
 * stream's time, stream and event waits take the later of two times, and host blocking (a stream
 * or event synchronization, a host wait on a collective, a blocking collective, a copy to the
 * host) moves the host's time forward. The other ranks are assumed to do the same at the same
 * times (a symmetric SPMD step), so a collective never waits for a straggler.
 *
 * Data that does live on the host (a collective on host buffers, as fsdp_pg_split's exchange)
 * is completed as if every rank had passed the same values: all_gather and all_to_all repeat
 * the input, sum multiplies it by the group's size (avg, min, max keep it), broadcast and
 * reduce keep it. So fsdp_pg_split on the world puts every rank in one group: make the shard and
 * replicate groups of HYBRID_SHARD with fsdp_vsim_group() instead.
 *
 * Traces (fsdp/trace.h). While a simulator lives, its context's trace runs on simulated time:
 * spans on the compute track take the compute stream's time (when the work queued so far ends),
 * so a unit's span covers its kernels' simulated execution, and collectives are spans of their
 * simulated start and end on the communication track. Start and stop the recording with the
 * simulator alive.
 *
 * Thread-safety: a simulator, its device and its groups belong to one thread (a rank).
 */
#ifndef FSDP_VSIM_H
#define FSDP_VSIM_H

#include <stdint.h>

#include <fsdp/cluster.h>
#include <fsdp/device.h>
#include <fsdp/export.h>
#include <fsdp/pg.h>

FSDP_BEGIN_DECLS

typedef struct fsdp_vsim fsdp_vsim_t;

/*
 * Creates a simulator of ctx's rank of a world of ctx's world size (fsdp_ctx_options_t) on
 * cluster cl (copied; checked with fsdp_cluster_check). The world must fit the cluster:
 * world_size is at most cl->net.nodes * cl->net.gpus_per_node, and a world of several nodes fills
 * whole nodes. World ranks lie node by node. The simulator owns its device and its world group,
 * which becomes ctx's world group (fsdp_ctx_pg) when ctx has none; both live until
 * fsdp_vsim_destroy(), which must come before fsdp_ctx_destroy(ctx). Needs 64-bit pointers
 * (FSDP_ENOTSUP otherwise).
 */
FSDP_EXTERN int fsdp_vsim_create(fsdp_ctx_t *ctx, const fsdp_cluster_t *cl, fsdp_vsim_t **out);
/* Destroys the simulator, its groups and its device (which must hold no tensor any more); NULL
 * is accepted. */
FSDP_EXTERN void fsdp_vsim_destroy(fsdp_vsim_t *vs);

/* The shape-only device whose kernels advance the clock, and the world group ("vsim"). */
FSDP_EXTERN fsdp_device_t *fsdp_vsim_device(fsdp_vsim_t *vs);
FSDP_EXTERN fsdp_pg_t *fsdp_vsim_world(fsdp_vsim_t *vs);
FSDP_EXTERN const fsdp_cluster_t *fsdp_vsim_cluster(const fsdp_vsim_t *vs);

/*
 * This rank's handle on the group of world ranks {first, first + stride, ...} (size of them)
 * that contains the simulated rank, where first = the simulated rank's position modulo stride
 * within its block of size * stride ranks: stride 1 gives the shard groups of HYBRID_SHARD
 * (size = ranks per shard group), stride = the shard group's size gives the replicate groups.
 * The layout over the nodes is fsdp_net_group_strided's. size must divide the world into whole
 * blocks. The group is owned by the simulator (do not destroy it).
 */
FSDP_EXTERN int fsdp_vsim_group(fsdp_vsim_t *vs, int size, int stride, fsdp_pg_t **out);

/* What the clock has seen since the simulator was made or last reset. Times are seconds. */
typedef struct fsdp_vsim_stats {
    double start;        /* the time the statistics started from (0, or the last reset) */
    double now;          /* the latest time of the host, any stream and the network */
    double compute_busy; /* time the compute stream was busy (kernels, and copies and fills
                          * queued on it) */
    double copy_busy;    /* time copies and fills took, on any stream */
    double comm_busy;    /* time the network spent in collectives */
    double compute_idle; /* time the compute stream stood idle between its first and last
                          * kernel and up to `now`: waiting for collectives (the exposed
                          * communication) or copies, as the host never holds it back */
    double contention;   /* part of compute_busy that the kernels lost to the SMs of the
                          * collectives they overlapped (fsdp_compute_model_t.sms) */
    double flops;        /* FLOPs of the kernels (all classes) */
    double matmul_flops; /* FLOPs of the matrix products */
    double class_time[FSDP_KERNEL_CLASS_COUNT]; /* compute_busy per kernel class */
    uint64_t kernels;                           /* kernels charged */
    uint64_t collectives;               /* collectives charged (of every group of the simulator) */
    double coll_bytes[FSDP_COLL_COUNT]; /* bytes per kind (nccl-tests sizes) */
    double coll_time[FSDP_COLL_COUNT];  /* network time per kind */
} fsdp_vsim_stats_t;

FSDP_EXTERN int fsdp_vsim_stats(const fsdp_vsim_t *vs, fsdp_vsim_stats_t *out);

/*
 * Kernel times measured on this machine instead of the roofline. From this call on, each kernel,
 * copy and fill of the simulated rank costs what the same call costs on dev, a CPU device: the
 * first time a call of its sizes, dtypes and flags is seen, it runs on dev over zeroed scratch
 * buffers (a warm-up, then five timed runs, each after the core's cache has been flushed of the
 * buffers, of which the median is kept) and later calls of the
 * same description cost the same. scale (> 0, finite) multiplies every measured time: above 1
 * when the ranks of the simulated world have more threads together than the machine has cores.
 * Calls the CPU device does not run as asked keep the roofline: 16-bit products (the CPU device
 * widens their operands first), batch norm, the reductions inside collectives, copies between the
 * host and the device, and calls whose buffers pass 256 MiB together. dev NULL returns to the
 * roofline. dev must outlive the simulator or the next call of this function. FSDP_EINVAL when
 * dev is not a CPU device or scale is not > 0.
 */
FSDP_EXTERN int fsdp_vsim_measure_kernels(fsdp_vsim_t *vs, fsdp_device_t *dev, double scale);

/* Distinct calls measured so far (0 when kernels are priced by the roofline). */
FSDP_EXTERN size_t fsdp_vsim_measured_calls(const fsdp_vsim_t *vs);

/* Waits (in simulated time) for every stream and the network: the host's time becomes `now`.
 * Call it at the end of a step, as a training loop's host waits for the loss. */
FSDP_EXTERN void fsdp_vsim_sync(fsdp_vsim_t *vs);

/* Syncs, then starts the statistics again from the current time (the clock keeps running), so
 * that a measured step excludes the first one's warm-up. */
FSDP_EXTERN void fsdp_vsim_reset_stats(fsdp_vsim_t *vs);

FSDP_END_DECLS

#endif /* FSDP_VSIM_H */
