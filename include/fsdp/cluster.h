/* SPDX-License-Identifier: MIT */
/*
 * fsdp/cluster.h: cost models of a GPU cluster (network and compute) and presets of real ones.
 *
 * These are the models a virtual-time simulation charges its collectives and kernels with: one
 * representative rank of a world of N runs the real FSDP runtime on a shape-only device, and
 * every collective and kernel it issues completes after the time given here. Apart from
 * fsdp_cluster_calibrate_cpu(), which measures this machine, the functions are arithmetic on the
 * caller's descriptions: they keep no state, allocate nothing (but fsdp_net_group_from_ranks()'s
 * scratch copy), and are safe from any thread. docs/cluster-model.md gives the sources of every
 * preset figure.
 *
 * Units and conventions. Times are seconds, sizes bytes, bandwidths bytes per second in one
 * direction (a datasheet's bidirectional NVLink figure is halved), compute rates FLOP per
 * second, one multiply-add counting as 2 FLOPs. The bytes of a collective are those of
 * nccl-tests and of fsdp_pg_counters_t (fsdp/pg.h): the whole message, n * count elements for
 * all_gather, reduce_scatter and all_to_all, count elements for all_reduce, broadcast and reduce
 * (fsdp_net_coll_bytes() computes them).
 *
 * Network model (alpha-beta per link class). A group of n ranks has r ranks on each of the
 * N = n / r nodes it spans (fsdp_net_group_t). Its bottleneck bandwidth B is
 *     B_intra = intra_bw * intra_eff                       (NVLink, per GPU)
 *     B_nic   = nics_per_node * nic_bw * inter_eff / gpus_per_node  (a GPU's share of the NICs)
 *     B       = B_intra                      when N == 1
 *     B       = min(B_intra, r * B_nic)      when N > 1 (B_intra left out when r == 1)
 * A ring crosses each node boundary once per channel, so a node's NICs carry one rank's share
 * of the ring traffic, spread over the node's r ranks; every GPU of a node is assumed to run
 * a collective at the same time (all ranks of an FSDP step do, and so do the gpus_per_node / r
 * replicate groups of HYBRID_SHARD), so a group gets r GPUs' share of the NICs, never more.
 * With S the message bytes (see above) and the nccl-tests bus factor f
 *     f = (n-1)/n  for all_gather, reduce_scatter, all_to_all;  2(n-1)/n for all_reduce;
 *     f = 1        for broadcast and reduce;
 * the algorithms cost
 *     ring  (every kind but all_to_all and barrier):
 *         time = base_latency + h_intra * intra_latency + h_inter * inter_latency + S * f / B
 *         hops of the slowest chunk: all_gather, reduce_scatter: n-1, of which
 *         h_inter = min(N, n-1) when N > 1 (else 0); all_reduce: twice those; broadcast and
 *         reduce (a pipelined chain): n-1, of which h_inter = N-1.
 *     tree  (all_reduce only; NCCL's double binary tree across nodes, a chain inside a node):
 *         time = base_latency + 2 * ((r-1) * intra_latency + ceil(log2 N) * inter_latency)
 *                + 2 * S / (B * tree_eff)
 *     direct (all_to_all: concurrent point-to-point sends, which cannot pool a node's NICs):
 *         time = base_latency + (N > 1 ? inter_latency : intra_latency)
 *                + max((r-1)/n * S / B_intra, (n-r)/n * S / B_nic)
 *     barrier: the latency of an all_reduce of 0 bytes (S is ignored).
 * FSDP_NET_ALGO_AUTO takes the faster of ring and tree for all_reduce (the tree wins on small
 * messages over many nodes, the ring on large ones; inside one node the ring always does), the
 * ring for the other kinds. A group of one rank costs 0 s (FSDP_NET_ALGO_LOCAL). Not modeled:
 * NCCL's protocols (LL, LL128, Simple: the latencies of the presets are Simple's, the protocol
 * of the large messages FSDP sends), NVLink SHARP and CollNet, congestion and stragglers.
 *
 * Compute model (a roofline). A kernel is described by its class, its dtype, its FLOPs and the
 * bytes it moves through device memory (fsdp_kernel_cost_t; the fsdp_kernel_* helpers fill one
 * for each operation FSDP training runs). With e = eff[class]:
 *     peak = matmul_flops[dtype]   for FSDP_KERNEL_MATMUL and FSDP_KERNEL_ATTENTION
 *            (tf32_flops for f32 when allow_tf32 is set), vector_flops for the other classes;
 *     time = launch + max(flops / (peak * e), bytes / (mem_bw * e))
 *            (+ matmul_launch for FSDP_KERNEL_MATMUL)
 * so a kernel is memory-bound below the ridge point, flops / bytes < peak / mem_bw, and
 * compute-bound above it.
 *
 * Errors. Every fallible function returns FSDP_OK or FSDP_EINVAL (FSDP_ENOTSUP for an algorithm
 * a collective does not have, FSDP_ENOMEM from fsdp_net_group_from_ranks(), and what a device
 * call or the sim run returns from fsdp_cluster_calibrate_cpu()) and never aborts. The message,
 * which names the calling function, the bad field and its value ("fsdp_net_coll_time:
 * net.nic_bw is 0 (must be > 0 B/s and finite)", "group.ranks_per_node 3 does not divide
 * group.size 8", "unknown cluster preset \"x\"; known: ..."), goes to ctx's last error, or is
 * logged at error level when ctx is NULL. Outputs are left untouched on failure.
 */
#ifndef FSDP_CLUSTER_H
#define FSDP_CLUSTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/dtype.h>
#include <fsdp/export.h>
#include <fsdp/pg.h>

FSDP_BEGIN_DECLS

typedef struct fsdp_ctx fsdp_ctx_t;

/* ---------------------------------------------------------------------------------------------
 * Descriptions */

/* The network of a cluster: nodes of GPUs joined by an intra-node fabric (NVLink/NVSwitch), and
 * the nodes joined by NICs (InfiniBand, RoCE). */
typedef struct fsdp_net_model {
    int nodes;            /* nodes in the cluster, >= 1 */
    int gpus_per_node;    /* GPUs (ranks) per node, >= 1 */
    double intra_bw;      /* B/s per GPU and direction over the intra-node fabric, > 0 */
    double intra_eff;     /* (0, 1]: the fraction of intra_bw a collective's transfers reach */
    double intra_latency; /* s per hop between two GPUs of a node, >= 0 */
    int nics_per_node;    /* >= 1 */
    double nic_bw;        /* B/s per NIC and direction, > 0 */
    double inter_eff;     /* (0, 1]: the fraction of nic_bw a collective's transfers reach */
    double inter_latency; /* s per hop between two nodes, >= 0 */
    double base_latency;  /* s paid once by every collective of two or more ranks, >= 0 */
    double tree_eff;      /* (0, 1]: the tree's bandwidth as a fraction of B (NCCL: 0.92) */
    /* SMs (NCCL channels, one thread block each, never shared with a compute kernel) that a
     * running collective holds on each of its GPUs, for a group inside one node and for a group
     * that spans nodes; >= 0. 0: the collective takes nothing from the compute kernels (the CPU
     * model when a core is spare). Against the compute model's `sms` they give the share of the
     * compute throughput a collective takes while it overlaps kernels (docs/cluster-model.md,
     * "Contention"); at most sms, which stops the kernels it overlaps (a CPU whose cores the
     * ranks fill). */
    int intra_channels;
    int inter_channels;
} fsdp_net_model_t;

/* Kernel classes: each has its own efficiency, and the first two use the matrix units. */
typedef enum fsdp_kernel_class {
    FSDP_KERNEL_MATMUL = 0,  /* matrix products (tensor cores for the 16-bit types) */
    FSDP_KERNEL_ATTENTION,   /* fused attention (FlashAttention-style) */
    FSDP_KERNEL_ELEMENTWISE, /* element-wise maps, casts, copies, optimizer updates */
    FSDP_KERNEL_ROWWISE,     /* row reductions: softmax, layer norm, cross-entropy */
    FSDP_KERNEL_CLASS_COUNT
} fsdp_kernel_class_t;

/* "matmul", "attention", "elementwise", "rowwise"; "invalid" otherwise. */
FSDP_EXTERN const char *fsdp_kernel_class_name(fsdp_kernel_class_t cls);

/* One accelerator (or the CPU of fsdp_cluster_calibrate_cpu()). */
typedef struct fsdp_compute_model {
    /* Dense matrix-product FLOP/s per dtype (indexed by fsdp_dtype_t); 0 where the device has
     * no matrix product of that dtype (the integer types on the presets). */
    double matmul_flops[FSDP_DTYPE_COUNT];
    double tf32_flops;   /* FLOP/s of f32 products on TF32 tensor cores; 0: none */
    bool allow_tf32;     /* f32 products at tf32_flops (PyTorch's default since 1.12 is off) */
    double vector_flops; /* FLOP/s of the non-matrix classes (CUDA cores, f32 arithmetic), > 0 */
    double mem_bw;       /* B/s of device memory, > 0 */
    size_t mem_bytes;    /* device memory capacity in bytes (for an out-of-memory check) */
    double launch;       /* s per kernel launch, >= 0 */
    double eff[FSDP_KERNEL_CLASS_COUNT]; /* (0, 1] per class, on both roofline terms */
    /* The kernel library's element-wise, row, reduction and loss kernels read and write f16 and
     * bf16 as stored, accumulating in f32 inside the kernel (PyTorch's CUDA kernels). false:
     * libfsdp's CPU and CUDA devices, which widen such tensors to f32 around each of those
     * kernels (two casts and f32 traffic). A simulator's shape-only device follows it
     * (fsdp/vsim.h). The presets set false. */
    bool lowp_kernels;
    /* s of fixed cost per matrix product on top of `launch`, >= 0: a CPU BLAS waking its
     * threads and packing its panels (fsdp_cluster_calibrate_cpu measures it); 0 on the GPU
     * presets, whose launch covers it. */
    double matmul_launch;
    /* Streaming multiprocessors of the GPU, >= 0: a kernel that overlaps a collective holding
     * c of them (fsdp_net_estimate_t.channels) runs at (sms - c) / sms of its speed. 0: no
     * contention is modelled (the CPU model, whose collectives' cost the calibration measures
     * with the ranks computing). */
    int sms;
} fsdp_compute_model_t;

/* A whole cluster: what a preset fills. */
typedef struct fsdp_cluster {
    char name[32]; /* the preset's name ("dgx-a100-80gb", "cpu"), or the caller's */
    fsdp_net_model_t net;
    fsdp_compute_model_t compute;
} fsdp_cluster_t;

/* Checks every field named above (fsdp_cluster_check checks both parts and the name's
 * termination); the message names the first bad field and its value. */
FSDP_EXTERN int fsdp_net_model_check(fsdp_ctx_t *ctx, const fsdp_net_model_t *net);
FSDP_EXTERN int fsdp_compute_model_check(fsdp_ctx_t *ctx, const fsdp_compute_model_t *m);
FSDP_EXTERN int fsdp_cluster_check(fsdp_ctx_t *ctx, const fsdp_cluster_t *cl);

/* ---------------------------------------------------------------------------------------------
 * Presets */

/* The number of presets and the name of preset i (NULL when i >= count): "dgx-a100-80gb",
 * "dgx-h100", "fsdp-paper-a100". Static strings. */
FSDP_EXTERN size_t fsdp_cluster_preset_count(void);
FSDP_EXTERN const char *fsdp_cluster_preset_name(size_t i);
/* A one-line description of preset i (NULL when i >= count). */
FSDP_EXTERN const char *fsdp_cluster_preset_summary(size_t i);

/* Fills *out with the preset `name` at `nodes` nodes (>= 1). An unknown name is FSDP_EINVAL
 * listing the known ones. */
FSDP_EXTERN int fsdp_cluster_preset(fsdp_ctx_t *ctx, const char *name, int nodes,
                                    fsdp_cluster_t *out);

/* Options of fsdp_cluster_calibrate_cpu(). */
typedef struct fsdp_calibrate_options {
    /* sizeof this struct as the caller was built; set by fsdp_calibrate_options_init() */
    size_t size;
    /* Ranks (sim threads) that time the collectives, and the result's gpus_per_node; in
     * [2, 1024], or 0 to skip the collective measurement: the result then has one GPU per node,
     * links at half the copy bandwidth (a copy reads and writes) and no latency. */
    int ranks;
    /* The process group the collectives are timed on: "sim" (NULL: the default; sim threads
     * sharing memory) or "gloo" (each of the ranks threads a Gloo group of its own, through
     * Gloo's transport between ranks of one host, rendezvousing through an in-memory store;
     * FSDP_ENOTSUP in a build without Gloo). */
    const char *backend;
    /* Bytes of output of the large all_gather timed (0: 4 MiB). The network model is linear in
     * the bytes and a real transport is not quite, so it fits best at the size the caller's
     * collectives have (a unit's parameters, for FSDP). */
    size_t coll_bytes;
    /* A process group to time the collectives on instead of threads of this process (NULL:
     * none). Ranks that are processes cost more than threads where they share cores (every
     * switch between them changes address space), so a world of processes, as fsdprun starts
     * them, is best measured as one. Every rank of pg calls fsdp_cluster_calibrate_cpu with the
     * same coll_bytes: rank 0 measures the device while the others wait, all of them time the
     * collectives, and every rank receives rank 0's cluster. ranks and backend are then
     * ignored; the cluster has one node of fsdp_pg_size(pg) "GPUs" (a group of one times no
     * collectives, as ranks = 0). */
    fsdp_pg_t *pg;
} fsdp_calibrate_options_t;

/* Fills opts with ranks = 2, backend NULL (sim), coll_bytes 0 (4 MiB) and pg NULL. */
FSDP_EXTERN void fsdp_calibrate_options_init(fsdp_calibrate_options_t *opts, size_t size);
#define fsdp_calibrate_options_init(opts) (fsdp_calibrate_options_init)((opts), sizeof *(opts))

/*
 * Fills *out ("cpu", one node of opts->ranks "GPUs") from measurements of this machine, in well
 * under a second: f32 and f64 matrix products through the CPU device's gemm (matmul_flops; bf16
 * and f16 get the f32 rate, since the CPU device widens them to f32), the fixed cost of a
 * product (matmul_launch: the time of a 128 x 128 x 128 product beyond its FLOPs at the large
 * products' rate), the element-wise rate (vector_flops: the device's tanh GELU over 256 Ki f32
 * elements that stay in cache, counted at 8 FLOPs an element, as the shape-only device charges
 * it), a 32 MiB device copy (mem_bw, counting read and written bytes), the time of a
 * one-element fill (launch), and opts->backend's all_gather of one f32 element per rank and
 * of opts->coll_bytes of output over opts->ranks threads, each call after a barrier and 1 ms
 * of CPU time that every rank spends computing, as ranks compute between collectives in a step
 * (the mean of several; a stall now and then is part of the cost)
 * (base_latency from the first, per-hop latencies 0, intra_bw from the difference through the
 * ring formula). The inter-node link
 * copies the intra-node one (nothing to measure); efficiencies are 1. mem_bytes is the
 * physical memory. Timings are the best of a few repetitions. ctx's CPU device does the work
 * when ctx's default device is the CPU; otherwise a CPU device is created for the measurement.
 * Blocking; it runs opts->ranks threads of its own, or times opts->pg's collectives (above).
 * opts may be NULL (defaults). Returns FSDP_EINVAL for bad options, or the failure of a device
 * call, of the sim run or of opts->pg's collectives (on every rank: a failure of rank 0's
 * device measurement reaches the others as FSDP_EREMOTE).
 */
FSDP_EXTERN int fsdp_cluster_calibrate_cpu(fsdp_ctx_t *ctx, const fsdp_calibrate_options_t *opts,
                                           fsdp_cluster_t *out);

/* ---------------------------------------------------------------------------------------------
 * Network */

/* How a group's ranks lie over the nodes. World ranks are numbered node by node: world rank w
 * is on node w / gpus_per_node. */
typedef struct fsdp_net_group {
    int size;           /* ranks in the group, >= 1 */
    int ranks_per_node; /* the group's ranks on each node it spans: divides size, at most
                         * gpus_per_node */
    int stride;         /* world-rank distance between the group's consecutive ranks on one node,
                         * >= 1, with (ranks_per_node - 1) * stride < gpus_per_node */
} fsdp_net_group_t;

/* The group of world ranks {0, stride, 2 * stride, ...} (size of them), as HYBRID_SHARD builds
 * them: stride 1 gives a shard group (the world when size is the world size), stride = shard
 * group size a replicate group. A stride below gpus_per_node must divide it, one above must be a
 * multiple of it; the group must fit the cluster. */
FSDP_EXTERN int fsdp_net_group_strided(fsdp_ctx_t *ctx, const fsdp_net_model_t *net, int size,
                                       int stride, fsdp_net_group_t *out);

/* The group made of these world ranks (distinct, in any order), as a process group's
 * fsdp_pg_world_rank() gives them. Every node it touches must hold the same number of its
 * ranks, evenly spaced; another layout is FSDP_EINVAL naming the node. */
FSDP_EXTERN int fsdp_net_group_from_ranks(fsdp_ctx_t *ctx, const fsdp_net_model_t *net,
                                          const int *world_ranks, int n, fsdp_net_group_t *out);

/* Checks a group against a network (the message names the field). */
FSDP_EXTERN int fsdp_net_group_check(fsdp_ctx_t *ctx, const fsdp_net_model_t *net,
                                     const fsdp_net_group_t *g);

typedef enum fsdp_net_algo {
    FSDP_NET_ALGO_AUTO = 0, /* as NCCL roughly: the faster of ring and tree for all_reduce */
    FSDP_NET_ALGO_RING,
    FSDP_NET_ALGO_TREE,   /* all_reduce (and barrier) only */
    FSDP_NET_ALGO_DIRECT, /* all_to_all only (its only algorithm) */
    FSDP_NET_ALGO_LOCAL,  /* reported for a group of one rank: nothing moves */
    FSDP_NET_ALGO_COUNT
} fsdp_net_algo_t;

/* "auto", "ring", "tree", "direct", "local"; "invalid" otherwise. */
FSDP_EXTERN const char *fsdp_net_algo_name(fsdp_net_algo_t algo);

/* The time of one collective and its parts. */
typedef struct fsdp_net_estimate {
    double seconds;       /* latency + transfer */
    double latency;       /* s: base_latency and the hops */
    double transfer;      /* s: the bytes at link_bw */
    double link_bw;       /* B/s: the bottleneck bandwidth the transfer runs at (B above) */
    double alg_bw;        /* B/s: bytes / seconds, nccl-tests' algbw (0 when seconds is 0) */
    double bus_bw;        /* B/s: alg_bw * the bus factor, nccl-tests' busbw */
    fsdp_net_algo_t algo; /* the algorithm charged (never AUTO) */
    int nodes;            /* nodes the group spans */
    int intra_hops;       /* hops counted at intra_latency */
    int inter_hops;       /* hops counted at inter_latency */
    int channels;         /* SMs the collective holds on each GPU while it runs: intra_channels
                           * or inter_channels by the nodes it spans; 0 on one rank */
} fsdp_net_estimate_t;

/*
 * The time of collective `kind` of `bytes` (the nccl-tests size, see above) on group g with
 * algorithm `algo`. TREE on a kind other than all_reduce and barrier, and RING or TREE on
 * all_to_all (DIRECT elsewhere), are FSDP_ENOTSUP; a bad model, group or kind is FSDP_EINVAL.
 */
FSDP_EXTERN int fsdp_net_coll_time(fsdp_ctx_t *ctx, const fsdp_net_model_t *net,
                                   const fsdp_net_group_t *g, fsdp_coll_kind_t kind, size_t bytes,
                                   fsdp_net_algo_t algo, fsdp_net_estimate_t *out);

/* nccl-tests' bus bandwidth factor of `kind` on n ranks (see above; 0 for barrier, for n < 1
 * and for an invalid kind; all_reduce on one rank gives 0 as the formula does). */
FSDP_EXTERN double fsdp_net_bus_factor(fsdp_coll_kind_t kind, int n);

/* The bytes of a collective of `count` elements of dt (NCCL's count, per rank for all_gather and
 * reduce_scatter) on n ranks, as nccl-tests and fsdp_pg_counters_t count them. Overflow, n < 1,
 * a bad dtype or kind are FSDP_EINVAL. */
FSDP_EXTERN int fsdp_net_coll_bytes(fsdp_ctx_t *ctx, fsdp_coll_kind_t kind, int n, size_t count,
                                    fsdp_dtype_t dt, size_t *out);

/* ---------------------------------------------------------------------------------------------
 * Compute */

/* What one kernel does, for the roofline. Fill it with a helper below or by hand. */
typedef struct fsdp_kernel_cost {
    fsdp_kernel_class_t cls;
    fsdp_dtype_t dtype; /* picks the matrix rate of MATMUL and ATTENTION kernels */
    double flops;       /* FLOPs, >= 0 */
    double bytes;       /* bytes read and written in device memory, >= 0 */
} fsdp_kernel_cost_t;

typedef struct fsdp_kernel_estimate {
    double seconds;    /* launch + max(compute, memory) */
    double launch;     /* s */
    double compute;    /* s: flops / (peak * eff) */
    double memory;     /* s: bytes / (mem_bw * eff) */
    double peak_flops; /* FLOP/s: the rate before efficiency */
    double intensity;  /* FLOP/B: flops / bytes (0 when bytes is 0) */
    double ridge;      /* FLOP/B: peak_flops / mem_bw, where the two terms meet */
    bool memory_bound; /* memory > compute */
} fsdp_kernel_estimate_t;

/* The roofline time of kernel k on device m. A dtype whose rate is 0 for k's class is
 * FSDP_EINVAL naming the field (compute.matmul_flops[i32]). */
FSDP_EXTERN int fsdp_compute_kernel_time(fsdp_ctx_t *ctx, const fsdp_compute_model_t *m,
                                         const fsdp_kernel_cost_t *k, fsdp_kernel_estimate_t *out);

/*
 * FLOPs and bytes of the kernels FSDP training runs, so that a device can charge each operation
 * with one call. Element sizes come from dt; negative sizes and invalid dtypes are FSDP_EINVAL.
 * Counts (FLOPs per element are the operations of a straightforward kernel; exp, sqrt and
 * division count as one):
 *   matmul       batch x (m x k) @ (k x n): 2 m n k batch FLOPs; reads A and B, writes C once:
 *                (m k + k n + m n) batch elements (accumulating into C reads it too: not counted).
 *   elementwise  numel elements, `inputs` read and `outputs` written arrays of dt, flops_per_elem.
 *   softmax      rows x cols, forward 5 FLOPs/element (max, subtract, exp, sum, scale), reads x
 *                and writes y; backward 4 FLOPs/element, reads y and dy, writes dx.
 *   layer_norm   rows x cols with weight and bias, forward 8 FLOPs/element (mean 1, variance 3,
 *                normalize and affine 4), reads x, w, b, writes y and f32 mean and rstd per row;
 *                backward 13 FLOPs/element, reads x, dy, w, mean, rstd, writes dx, dw, db.
 *   cross_entropy rows x classes logits with i64 targets, forward 4 FLOPs/logit (max, subtract,
 *                exp, sum), reads logits and targets, writes an f32 loss per row; backward
 *                3 FLOPs/logit, reads logits and targets, writes the logits' gradient.
 *   attention    fused attention of batch x heads, seq_q queries, seq_k keys, head_dim:
 *                forward 4 batch heads seq_q seq_k head_dim FLOPs (QK^T and PV), half of it
 *                when causal; backward 2.5 times the forward (FlashAttention-2's convention:
 *                five products instead of two); forward reads Q, K, V and writes O, backward
 *                reads Q, K, V, O, dO and writes dQ, dK, dV (no seq_q x seq_k matrix in memory).
 *   optimizer    one update of numel parameters of dt with state of dt: SGD 2 FLOPs, 3 arrays
 *                (p, g read, p written); SGD with momentum 4 FLOPs, 5 arrays (p, g, buf read,
 *                p, buf written); AdamW 13 FLOPs, 7 arrays (p, g, m, v read, p, m, v written).
 */
FSDP_EXTERN int fsdp_kernel_matmul(fsdp_ctx_t *ctx, int64_t m, int64_t n, int64_t k, int64_t batch,
                                   fsdp_dtype_t dt, fsdp_kernel_cost_t *out);
FSDP_EXTERN int fsdp_kernel_elementwise(fsdp_ctx_t *ctx, int64_t numel, int inputs, int outputs,
                                        double flops_per_elem, fsdp_dtype_t dt,
                                        fsdp_kernel_cost_t *out);
FSDP_EXTERN int fsdp_kernel_softmax(fsdp_ctx_t *ctx, int64_t rows, int64_t cols, bool backward,
                                    fsdp_dtype_t dt, fsdp_kernel_cost_t *out);
FSDP_EXTERN int fsdp_kernel_layer_norm(fsdp_ctx_t *ctx, int64_t rows, int64_t cols, bool backward,
                                       fsdp_dtype_t dt, fsdp_kernel_cost_t *out);
FSDP_EXTERN int fsdp_kernel_cross_entropy(fsdp_ctx_t *ctx, int64_t rows, int64_t classes,
                                          bool backward, fsdp_dtype_t dt, fsdp_kernel_cost_t *out);
FSDP_EXTERN int fsdp_kernel_attention(fsdp_ctx_t *ctx, int64_t batch, int64_t heads, int64_t seq_q,
                                      int64_t seq_k, int64_t head_dim, bool causal, bool backward,
                                      fsdp_dtype_t dt, fsdp_kernel_cost_t *out);

typedef enum fsdp_kernel_optim {
    FSDP_KERNEL_OPTIM_SGD = 0,
    FSDP_KERNEL_OPTIM_SGD_MOMENTUM,
    FSDP_KERNEL_OPTIM_ADAMW, /* Adam too: the same traffic, within a FLOP */
    FSDP_KERNEL_OPTIM_COUNT
} fsdp_kernel_optim_t;

FSDP_EXTERN int fsdp_kernel_optimizer(fsdp_ctx_t *ctx, fsdp_kernel_optim_t kind, int64_t numel,
                                      fsdp_dtype_t dt, fsdp_kernel_cost_t *out);

FSDP_END_DECLS

#endif /* FSDP_CLUSTER_H */
