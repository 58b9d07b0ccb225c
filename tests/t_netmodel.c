/* SPDX-License-Identifier: MIT */
/*
 * t_netmodel.c: the network model of fsdp/cluster.h, its groups and its presets.
 *
 * Most expectations are computed by hand on a toy network with round numbers (tests/toy_cluster.h),
 * so that each one can be checked with pencil and paper against the formulas of the header: 4 nodes
 * of 8 GPUs, NVLink 100 GB/s per GPU, 4 NICs of 20 GB/s per node (10 GB/s per GPU), hops of 1 us
 * inside a node and 10 us between nodes, 5 us per collective, the tree at 0.8 of the ring's
 * bandwidth, every efficiency 1. Then the presets: their figures are the documented ones
 * (docs/cluster-model.md), and two DGX A100 all-reduces are worked out. Then properties that
 * must hold on every preset, and every error path.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <fsdp.h>
#include <fsdp/cluster.h>

#include "tap.h"
#include "toy_cluster.h"

#define US 1e-6
#define GIB 1073741824.0

static fsdp_ctx_t *ctx;

static fsdp_net_model_t toy(void) {
    return toy_net(4);
}

static fsdp_net_group_t grp(int size, int rpn, int stride) {
    fsdp_net_group_t g = {size, rpn, stride};
    return g;
}

/* The estimate of a collective that must succeed; a failure is reported and gives -1 s. */
static fsdp_net_estimate_t est(const fsdp_net_model_t *net, fsdp_net_group_t g,
                               fsdp_coll_kind_t kind, double bytes, fsdp_net_algo_t algo) {
    fsdp_net_estimate_t e;
    memset(&e, 0, sizeof e);
    int rc = fsdp_net_coll_time(ctx, net, &g, kind, (size_t)bytes, algo, &e);
    if (rc < 0) {
        tap_ok(0, "fsdp_net_coll_time(%s, n=%d, %g B) failed: %s", fsdp_coll_name(kind), g.size,
               bytes, fsdp_ctx_last_error(ctx));
        e.seconds = -1;
    }
    return e;
}

/* One hand-computed case: total time, latency and algorithm. */
static void is_case(fsdp_net_estimate_t e, double latency, double transfer, fsdp_net_algo_t algo,
                    const char *what) {
    tap_is_near(e.latency, latency, 1e-12, 1e-15, "%s: latency", what);
    tap_is_near(e.transfer, transfer, 1e-12, 1e-15, "%s: transfer", what);
    tap_is_near(e.seconds, latency + transfer, 1e-12, 1e-15, "%s: seconds", what);
    tap_is_str(fsdp_net_algo_name(e.algo), fsdp_net_algo_name(algo), "%s: algorithm", what);
}

/* ---------------------------------------------------------------------------------------------
 * Bus bandwidth factors and message bytes (nccl-tests' PERFORMANCE.md) */

static void test_bus_factors(void) {
    tap_is_near(fsdp_net_bus_factor(FSDP_COLL_ALL_REDUCE, 8), 2.0 * 7 / 8, 0, 0,
                "all_reduce bus factor 2(n-1)/n at n=8");
    tap_is_near(fsdp_net_bus_factor(FSDP_COLL_ALL_REDUCE, 64), 2.0 * 63 / 64, 0, 0,
                "all_reduce bus factor at n=64");
    tap_is_near(fsdp_net_bus_factor(FSDP_COLL_ALL_GATHER, 8), 7.0 / 8, 0, 0,
                "all_gather bus factor (n-1)/n");
    tap_is_near(fsdp_net_bus_factor(FSDP_COLL_REDUCE_SCATTER, 16), 15.0 / 16, 0, 0,
                "reduce_scatter bus factor (n-1)/n");
    tap_is_near(fsdp_net_bus_factor(FSDP_COLL_ALL_TO_ALL, 4), 3.0 / 4, 0, 0,
                "all_to_all bus factor (n-1)/n");
    tap_is_near(fsdp_net_bus_factor(FSDP_COLL_BROADCAST, 8), 1, 0, 0, "broadcast bus factor 1");
    tap_is_near(fsdp_net_bus_factor(FSDP_COLL_REDUCE, 8), 1, 0, 0, "reduce bus factor 1");
    tap_is_near(fsdp_net_bus_factor(FSDP_COLL_BARRIER, 8), 0, 0, 0, "barrier bus factor 0");
    tap_is_near(fsdp_net_bus_factor(FSDP_COLL_ALL_REDUCE, 1), 0, 0, 0,
                "all_reduce on one rank: factor 0");
    tap_is_near(fsdp_net_bus_factor(FSDP_COLL_ALL_REDUCE, 0), 0, 0, 0, "n = 0 gives 0");
    tap_is_near(fsdp_net_bus_factor(FSDP_COLL_COUNT, 8), 0, 0, 0, "an invalid kind gives 0");

    /* The bytes pg.h's counters record: the whole message. */
    size_t b = 0;
    tap_is_int(fsdp_net_coll_bytes(ctx, FSDP_COLL_ALL_GATHER, 8, 10, FSDP_DTYPE_F32, &b), 0,
               "coll_bytes all_gather");
    tap_is_size(b, 8 * 10 * 4, "all_gather of 10 f32 per rank on 8 ranks: 320 B");
    fsdp_net_coll_bytes(ctx, FSDP_COLL_REDUCE_SCATTER, 4, 3, FSDP_DTYPE_BF16, &b);
    tap_is_size(b, 4 * 3 * 2, "reduce_scatter: recvcount * n * 2 B");
    fsdp_net_coll_bytes(ctx, FSDP_COLL_ALL_TO_ALL, 4, 3, FSDP_DTYPE_F64, &b);
    tap_is_size(b, 4 * 3 * 8, "all_to_all: n * count elements");
    fsdp_net_coll_bytes(ctx, FSDP_COLL_ALL_REDUCE, 8, 10, FSDP_DTYPE_F32, &b);
    tap_is_size(b, 40, "all_reduce: count elements");
    fsdp_net_coll_bytes(ctx, FSDP_COLL_BROADCAST, 8, 10, FSDP_DTYPE_I64, &b);
    tap_is_size(b, 80, "broadcast: count elements");
    fsdp_net_coll_bytes(ctx, FSDP_COLL_BARRIER, 8, 10, FSDP_DTYPE_F32, &b);
    tap_is_size(b, 0, "barrier: no bytes");
}

/* ---------------------------------------------------------------------------------------------
 * Ring and tree on the toy network, by hand */

static void test_ring_intra(void) {
    fsdp_net_model_t net = toy();
    /* 8 GPUs of one node: B = 100 GB/s, hops of 1 us. */
    fsdp_net_estimate_t e = est(&net, grp(8, 8, 1), FSDP_COLL_ALL_GATHER, 8e8, FSDP_NET_ALGO_AUTO);
    is_case(e, (5 + 7) * US, 8e8 * 7 / 8 / 100e9, FSDP_NET_ALGO_RING,
            "all_gather 800 MB over 8 GPUs of a node");
    tap_is_near(e.link_bw, 100e9, 1e-15, 0, "  at the NVLink bandwidth");
    tap_is_int(e.nodes, 1, "  one node");
    tap_is_int(e.intra_hops, 7, "  7 intra-node hops");
    tap_is_int(e.inter_hops, 0, "  no inter-node hop");
    tap_is_near(e.alg_bw, 8e8 / e.seconds, 1e-15, 0, "  algbw = S / t");
    tap_is_near(e.bus_bw, e.alg_bw * 7 / 8, 1e-15, 0, "  busbw = algbw (n-1)/n");

    e = est(&net, grp(8, 8, 1), FSDP_COLL_REDUCE_SCATTER, 8e8, FSDP_NET_ALGO_RING);
    is_case(e, 12 * US, 7e-3, FSDP_NET_ALGO_RING, "reduce_scatter costs what all_gather does");

    e = est(&net, grp(4, 4, 1), FSDP_COLL_ALL_GATHER, 4e8, FSDP_NET_ALGO_AUTO);
    is_case(e, (5 + 3) * US, 4e8 * 3 / 4 / 100e9, FSDP_NET_ALGO_RING,
            "all_gather 400 MB over 4 GPUs of a node");

    e = est(&net, grp(2, 2, 4), FSDP_COLL_ALL_GATHER, 2e6, FSDP_NET_ALGO_AUTO);
    is_case(e, (5 + 1) * US, 2e6 / 2 / 100e9, FSDP_NET_ALGO_RING,
            "all_gather 2 MB over 2 GPUs 4 apart");

    /* all_reduce of 1 GB on 8 GPUs: ring 19 us + 17.5 ms; the tree (a chain in a node) has
     * the same hops and a slower transfer (2 S / (0.8 B) = 25 ms), so the ring wins. */
    e = est(&net, grp(8, 8, 1), FSDP_COLL_ALL_REDUCE, 1e9, FSDP_NET_ALGO_AUTO);
    is_case(e, (5 + 14) * US, 1e9 * 1.75 / 100e9, FSDP_NET_ALGO_RING, "all_reduce 1 GB, 8 GPUs");
    tap_is_int(e.intra_hops, 14, "  14 hops (2 (n-1))");
    fsdp_net_estimate_t t = est(&net, grp(8, 8, 1), FSDP_COLL_ALL_REDUCE, 1e9, FSDP_NET_ALGO_TREE);
    is_case(t, (5 + 2 * 7) * US, 2e9 / (0.8 * 100e9), FSDP_NET_ALGO_TREE,
            "the tree forced inside a node: a chain of 2 (r-1) hops");
    tap_is_near(t.link_bw, 80e9, 1e-15, 0, "  at tree_eff times B");
    e = est(&net, grp(8, 8, 1), FSDP_COLL_ALL_REDUCE, 8, FSDP_NET_ALGO_AUTO);
    tap_is_int(e.algo, FSDP_NET_ALGO_RING, "inside a node the ring wins at 8 bytes too");

    /* Broadcast and reduce: a chain of n - 1 hops moving S once. */
    e = est(&net, grp(8, 8, 1), FSDP_COLL_BROADCAST, 1e8, FSDP_NET_ALGO_AUTO);
    is_case(e, 12 * US, 1e8 / 100e9, FSDP_NET_ALGO_RING, "broadcast 100 MB, 8 GPUs");
    e = est(&net, grp(8, 8, 1), FSDP_COLL_REDUCE, 1e8, FSDP_NET_ALGO_RING);
    is_case(e, 12 * US, 1e-3, FSDP_NET_ALGO_RING, "reduce 100 MB, 8 GPUs");
}

static void test_ring_inter(void) {
    fsdp_net_model_t net = toy();
    /* 16 GPUs on 2 nodes (mixed): B = min(100, 8 * 10) = 80 GB/s; the slowest chunk of an
     * all_gather crosses both node boundaries: 13 NVLink hops and 2 network hops. */
    fsdp_net_estimate_t e =
        est(&net, grp(16, 8, 1), FSDP_COLL_ALL_GATHER, 1.6e9, FSDP_NET_ALGO_AUTO);
    is_case(e, (5 + 13 + 2 * 10) * US, 1.6e9 * 15 / 16 / 80e9, FSDP_NET_ALGO_RING,
            "all_gather 1.6 GB over 2 nodes x 8");
    tap_is_near(e.link_bw, 80e9, 1e-15, 0, "  at r times a GPU's NIC share (80 GB/s)");
    tap_is_int(e.nodes, 2, "  two nodes");
    tap_is_int(e.inter_hops, 2, "  2 inter-node hops");

    /* The whole toy cluster, 32 GPUs: all_reduce of 1 GB. Ring: 62 hops, 8 across nodes,
     * 5 + 54 + 80 = 139 us; 1.9375 GB at 80 GB/s. Tree: 5 + 2 (7 + 2 * 10) = 59 us; 2 GB at
     * 64 GB/s = 31.25 ms. The ring wins. */
    e = est(&net, grp(32, 8, 1), FSDP_COLL_ALL_REDUCE, 1e9, FSDP_NET_ALGO_AUTO);
    is_case(e, 139 * US, 1e9 * 62 / 32 / 80e9, FSDP_NET_ALGO_RING, "all_reduce 1 GB, 4 nodes x 8");
    fsdp_net_estimate_t t = est(&net, grp(32, 8, 1), FSDP_COLL_ALL_REDUCE, 1e9, FSDP_NET_ALGO_TREE);
    is_case(t, 59 * US, 2e9 / 64e9, FSDP_NET_ALGO_TREE, "the same all_reduce on the tree");
    tap_is_int(t.inter_hops, 4, "  the tree: 2 log2(4) inter-node hops");
    tap_is_int(t.intra_hops, 14, "  and 2 (r-1) intra-node hops");

    /* Tree against ring: they cross where 80 us of latency equal S (2/64e9 - 1.9375/80e9),
     * S = 11.38 MB. */
    e = est(&net, grp(32, 8, 1), FSDP_COLL_ALL_REDUCE, 1000, FSDP_NET_ALGO_AUTO);
    is_case(e, 59 * US, 2e3 / 64e9, FSDP_NET_ALGO_TREE, "1 kB all_reduce over 4 nodes: the tree");
    e = est(&net, grp(32, 8, 1), FSDP_COLL_ALL_REDUCE, 8e6, FSDP_NET_ALGO_AUTO);
    tap_is_int(e.algo, FSDP_NET_ALGO_TREE, "8 MB: still the tree");
    e = est(&net, grp(32, 8, 1), FSDP_COLL_ALL_REDUCE, 16e6, FSDP_NET_ALGO_AUTO);
    tap_is_int(e.algo, FSDP_NET_ALGO_RING, "16 MB: the ring");
    fsdp_net_estimate_t r =
        est(&net, grp(32, 8, 1), FSDP_COLL_ALL_REDUCE, 16e6, FSDP_NET_ALGO_RING);
    t = est(&net, grp(32, 8, 1), FSDP_COLL_ALL_REDUCE, 16e6, FSDP_NET_ALGO_TREE);
    tap_ok(e.seconds == r.seconds && r.seconds < t.seconds, "auto charges the faster of the two");

    /* Broadcast over 4 nodes: an open chain of 31 hops, 3 of them between nodes. */
    e = est(&net, grp(32, 8, 1), FSDP_COLL_BROADCAST, 1e8, FSDP_NET_ALGO_AUTO);
    is_case(e, (5 + 28 + 30) * US, 1e8 / 80e9, FSDP_NET_ALGO_RING, "broadcast over 4 nodes");

    /* NVLink can be the bottleneck of a spanning group: with 8 NICs of 160 GB/s a GPU's share
     * is 160 GB/s, more than NVLink's 100. */
    fsdp_net_model_t fat = toy();
    fat.nics_per_node = 8;
    fat.nic_bw = 160e9;
    e = est(&fat, grp(16, 8, 1), FSDP_COLL_ALL_GATHER, 1.6e9, FSDP_NET_ALGO_AUTO);
    tap_is_near(e.link_bw, 100e9, 1e-15, 0, "a fast network leaves NVLink the bottleneck");
    /* Efficiencies scale the links they belong to. */
    fat = toy();
    fat.intra_eff = 0.5;
    fat.inter_eff = 0.25;
    e = est(&fat, grp(8, 8, 1), FSDP_COLL_ALL_GATHER, 1e9, FSDP_NET_ALGO_AUTO);
    tap_is_near(e.link_bw, 50e9, 1e-15, 0, "intra_eff scales NVLink");
    e = est(&fat, grp(16, 8, 1), FSDP_COLL_ALL_GATHER, 1e9, FSDP_NET_ALGO_AUTO);
    tap_is_near(e.link_bw, 20e9, 1e-15, 0, "inter_eff scales the NICs (8 x 2.5 GB/s)");
}

/* HYBRID_SHARD: shard groups inside a node, replicate groups across nodes. */
static void test_hybrid(void) {
    fsdp_net_model_t net = toy();
    fsdp_net_group_t shard, repl;
    /* Shard group = a node (8), replicate group = one rank per node (4, stride 8). */
    tap_is_int(fsdp_net_group_strided(ctx, &net, 8, 1, &shard), 0, "the shard group of a node");
    tap_ok(shard.size == 8 && shard.ranks_per_node == 8 && shard.stride == 1,
           "  size 8, 8 per node, stride 1 (got %d, %d, %d)", shard.size, shard.ranks_per_node,
           shard.stride);
    tap_is_int(fsdp_net_group_strided(ctx, &net, 4, 8, &repl), 0, "the replicate group");
    tap_ok(repl.size == 4 && repl.ranks_per_node == 1 && repl.stride == 8,
           "  size 4, 1 per node, stride 8 (got %d, %d, %d)", repl.size, repl.ranks_per_node,
           repl.stride);
    /* One rank per node has a GPU's share of its NICs, 10 GB/s, and no NVLink hop. all_reduce
     * of 100 MB: ring 6 hops, all between nodes: 65 us + 150 MB at 10 GB/s. Tree:
     * 5 + 2 * 2 * 10 = 45 us + 200 MB at 8 GB/s. */
    fsdp_net_estimate_t e = est(&net, repl, FSDP_COLL_ALL_REDUCE, 1e8, FSDP_NET_ALGO_AUTO);
    is_case(e, 65 * US, 1.5e8 / 10e9, FSDP_NET_ALGO_RING, "replicate all_reduce of 100 MB");
    tap_is_near(e.link_bw, 10e9, 1e-15, 0, "  at one GPU's NIC share");
    tap_is_int(e.inter_hops, 6, "  6 hops, all between nodes");
    e = est(&net, repl, FSDP_COLL_ALL_REDUCE, 1e4, FSDP_NET_ALGO_AUTO);
    is_case(e, 45 * US, 2e4 / 8e9, FSDP_NET_ALGO_TREE, "replicate all_reduce of 10 kB: the tree");

    /* Shard groups of 4 (half a node), replicate groups of 8 at stride 4: 2 ranks per node,
     * 4 nodes, 2 GPUs' share of the NICs (20 GB/s). */
    tap_is_int(fsdp_net_group_strided(ctx, &net, 4, 1, &shard), 0, "shard group of 4");
    tap_is_int(shard.ranks_per_node, 4, "  4 per node");
    tap_is_int(fsdp_net_group_strided(ctx, &net, 8, 4, &repl), 0, "replicate group at stride 4");
    tap_ok(repl.ranks_per_node == 2 && repl.stride == 4, "  2 per node at stride 4 (got %d, %d)",
           repl.ranks_per_node, repl.stride);
    e = est(&net, repl, FSDP_COLL_ALL_REDUCE, 8e8, FSDP_NET_ALGO_RING);
    /* 14 hops, 2 * min(4, 7) = 8 across nodes: 5 + 6 + 80 = 91 us. */
    is_case(e, 91 * US, 8e8 * 14 / 8 / 20e9, FSDP_NET_ALGO_RING, "replicate of 8 at stride 4");
    tap_is_near(e.link_bw, 20e9, 1e-15, 0, "  at 2 x 10 GB/s");

    /* A shard group spanning two nodes (16) and replicate pairs at stride 16. */
    tap_is_int(fsdp_net_group_strided(ctx, &net, 16, 1, &shard), 0, "shard group of 16");
    tap_is_int(shard.ranks_per_node, 8, "  8 per node on 2 nodes");
    tap_is_int(fsdp_net_group_strided(ctx, &net, 2, 16, &repl), 0, "replicate pair, stride 16");
    tap_is_int(repl.ranks_per_node, 1, "  1 per node");
    e = est(&net, repl, FSDP_COLL_ALL_REDUCE, 1e8, FSDP_NET_ALGO_RING);
    /* n = 2: 2 hops, both between nodes. */
    is_case(e, 25 * US, 1e8 / 10e9, FSDP_NET_ALGO_RING, "replicate pair all_reduce");

    /* Groups from world ranks, as a process group knows them. */
    int node0[] = {3, 1, 0, 2, 7, 5, 6, 4};
    fsdp_net_group_t g;
    tap_is_int(fsdp_net_group_from_ranks(ctx, &net, node0, 8, &g), 0, "from ranks: a node");
    tap_ok(g.size == 8 && g.ranks_per_node == 8 && g.stride == 1, "  8 per node, stride 1");
    int across[] = {24, 0, 16, 8};
    tap_is_int(fsdp_net_group_from_ranks(ctx, &net, across, 4, &g), 0, "from ranks: across");
    tap_ok(g.size == 4 && g.ranks_per_node == 1 && g.stride == 1,
           "  1 per node (stride 1 when alone), got %d %d %d", g.size, g.ranks_per_node, g.stride);
    int evens[] = {0, 2, 4, 6, 8, 10, 12, 14};
    tap_is_int(fsdp_net_group_from_ranks(ctx, &net, evens, 8, &g), 0, "from ranks: even ranks");
    tap_ok(g.ranks_per_node == 4 && g.stride == 2, "  4 per node at stride 2 (got %d, %d)",
           g.ranks_per_node, g.stride);
    int one = 13;
    tap_is_int(fsdp_net_group_from_ranks(ctx, &net, &one, 1, &g), 0, "from ranks: one rank");
    e = est(&net, g, FSDP_COLL_ALL_GATHER, 1e9, FSDP_NET_ALGO_AUTO);
    is_case(e, 0, 0, FSDP_NET_ALGO_LOCAL, "a group of one rank costs nothing");
    tap_is_near(e.alg_bw, 0, 0, 0, "  algbw 0");
}

static void test_all_to_all_and_barrier(void) {
    fsdp_net_model_t net = toy();
    /* 16 GPUs on 2 nodes, 1.6 GB per rank: 7/16 of it over NVLink (7 ms), 8/16 through the
     * GPU's own 10 GB/s (80 ms), which sets the time. busbw = 2 x 10 x 15/16 GB/s, as nccl-tests
     * expects on 2 nodes (N / (N-1) times a GPU's network bandwidth). */
    fsdp_net_estimate_t e =
        est(&net, grp(16, 8, 1), FSDP_COLL_ALL_TO_ALL, 1.6e9, FSDP_NET_ALGO_AUTO);
    is_case(e, 15 * US, 0.08, FSDP_NET_ALGO_DIRECT, "all_to_all 1.6 GB over 2 nodes");
    tap_is_near(e.bus_bw, 1.6e9 / (0.08 + 15 * US) * 15 / 16, 1e-12, 0, "  busbw");
    e = est(&net, grp(8, 8, 1), FSDP_COLL_ALL_TO_ALL, 8e8, FSDP_NET_ALGO_DIRECT);
    is_case(e, 6 * US, 8e8 * 7 / 8 / 100e9, FSDP_NET_ALGO_DIRECT, "all_to_all inside a node");
    /* A barrier is the all_reduce of nothing: inside a node ring and tree tie and the ring is
     * charged; across 4 nodes the tree's 59 us win. Its bytes are ignored. */
    e = est(&net, grp(8, 8, 1), FSDP_COLL_BARRIER, 12345, FSDP_NET_ALGO_AUTO);
    is_case(e, 19 * US, 0, FSDP_NET_ALGO_RING, "barrier of 8 GPUs");
    tap_is_near(e.bus_bw, 0, 0, 0, "  busbw 0");
    e = est(&net, grp(32, 8, 1), FSDP_COLL_BARRIER, 0, FSDP_NET_ALGO_AUTO);
    is_case(e, 59 * US, 0, FSDP_NET_ALGO_TREE, "barrier of 32 GPUs on 4 nodes");
}

/* ---------------------------------------------------------------------------------------------
 * Presets */

static void test_presets(void) {
    tap_is_size(fsdp_cluster_preset_count(), 3, "three presets");
    tap_is_str(fsdp_cluster_preset_name(0), "dgx-a100-80gb", "preset 0");
    tap_is_str(fsdp_cluster_preset_name(1), "dgx-h100", "preset 1");
    tap_is_str(fsdp_cluster_preset_name(2), "fsdp-paper-a100", "preset 2");
    tap_ok(fsdp_cluster_preset_name(3) == NULL && fsdp_cluster_preset_summary(3) == NULL,
           "no preset 3");
    for (size_t i = 0; i < fsdp_cluster_preset_count(); i++) {
        fsdp_cluster_t cl;
        const char *name = fsdp_cluster_preset_name(i);
        tap_is_int(fsdp_cluster_preset(ctx, name, 4, &cl), 0, "%s loads", name);
        tap_is_int(fsdp_cluster_check(ctx, &cl), 0, "%s passes the checks", name);
        tap_is_str(cl.name, name, "%s names itself", name);
        tap_is_int(cl.net.nodes, 4, "%s at the nodes asked", name);
        tap_ok(fsdp_cluster_preset_summary(i) && *fsdp_cluster_preset_summary(i),
               "%s has a summary", name);
    }

    /* The documented figures (docs/cluster-model.md). */
    fsdp_cluster_t a, h, p;
    fsdp_cluster_preset(ctx, "dgx-a100-80gb", 1, &a);
    fsdp_cluster_preset(ctx, "dgx-h100", 1, &h);
    fsdp_cluster_preset(ctx, "fsdp-paper-a100", 1, &p);
    tap_ok(a.net.gpus_per_node == 8 && a.net.intra_bw == 300e9 && a.net.intra_eff == 0.78 &&
               a.net.nics_per_node == 8 && a.net.nic_bw == 25e9 && a.net.inter_eff == 0.96,
           "DGX A100: 8 GPUs, NVLink 600/2 GB/s at 0.78, 8 x 200 Gb/s HDR at 0.96");
    tap_ok(h.net.gpus_per_node == 8 && h.net.intra_bw == 450e9 && h.net.intra_eff == 0.82 &&
               h.net.nics_per_node == 8 && h.net.nic_bw == 50e9 && h.net.inter_eff == 0.97,
           "DGX H100: 8 GPUs, NVLink 900/2 GB/s at 0.82, 8 x 400 Gb/s NDR at 0.97");
    tap_ok(p.net.gpus_per_node == 8 && p.net.intra_bw == 300e9 &&
               p.net.nics_per_node * p.net.nic_bw == 250e9,
           "FSDP paper: A100 NVLink, 2 Tb/s per node");
    tap_ok(a.net.base_latency == 8.4 * US && a.net.intra_latency == 3.4 * US &&
               a.net.inter_latency == 14 * US && a.net.tree_eff == 0.92,
           "latencies and tree factor from NCCL's tuning model");
    tap_ok(h.net.base_latency == a.net.base_latency && h.net.inter_latency == 14 * US,
           "the same on the DGX H100");
    tap_ok(a.compute.sms == 108 && a.net.intra_channels == 24 && a.net.inter_channels == 16 &&
               p.compute.sms == 108 && p.net.inter_channels == 16,
           "A100: 108 SMs; NCCL holds 24 of them inside a node, 16 across nodes of 8 NICs");
    tap_ok(h.compute.sms == 132 && h.net.intra_channels == 24, "H100: 132 SMs, 24 for NVLink");

    /* A collective's estimate says how many SMs it holds: by the nodes it spans, none alone. */
    fsdp_cluster_t two;
    fsdp_cluster_preset(ctx, "dgx-a100-80gb", 2, &two);
    fsdp_net_group_t in, across, one;
    fsdp_net_estimate_t e;
    fsdp_net_group_strided(ctx, &two.net, 8, 1, &in);
    fsdp_net_group_strided(ctx, &two.net, 16, 1, &across);
    fsdp_net_group_strided(ctx, &two.net, 1, 1, &one);
    fsdp_net_coll_time(ctx, &two.net, &in, FSDP_COLL_ALL_GATHER, 1 << 20, FSDP_NET_ALGO_AUTO, &e);
    tap_is_int(e.channels, 24, "an all_gather inside a node holds intra_channels");
    fsdp_net_coll_time(ctx, &two.net, &across, FSDP_COLL_ALL_REDUCE, 1 << 20, FSDP_NET_ALGO_AUTO,
                       &e);
    tap_is_int(e.channels, 16, "an all_reduce across nodes holds inter_channels");
    fsdp_net_coll_time(ctx, &two.net, &one, FSDP_COLL_ALL_GATHER, 1 << 20, FSDP_NET_ALGO_AUTO, &e);
    tap_is_int(e.channels, 0, "one rank holds none");
}

/* The report's examples: all_reduce of 1 GiB on DGX A100s, worked out from the figures. */
static void test_dgx_examples(void) {
    fsdp_cluster_t a;
    fsdp_cluster_preset(ctx, "dgx-a100-80gb", 8, &a);
    fsdp_net_group_t g8, g64;
    fsdp_net_group_strided(ctx, &a.net, 8, 1, &g8);
    fsdp_net_group_strided(ctx, &a.net, 64, 1, &g64);
    /* One node: B = 300 x 0.78 = 234 GB/s; 14 hops of 3.4 us after 8.4 us. */
    fsdp_net_estimate_t e = est(&a.net, g8, FSDP_COLL_ALL_REDUCE, GIB, FSDP_NET_ALGO_AUTO);
    is_case(e, (8.4 + 14 * 3.4) * US, GIB * 1.75 / 234e9, FSDP_NET_ALGO_RING,
            "DGX A100, 8 GPUs, all_reduce 1 GiB");
    tap_diag("all_reduce 1 GiB, 8 x A100: %.3f ms (%s, busbw %.1f GB/s)", e.seconds * 1e3,
             fsdp_net_algo_name(e.algo), e.bus_bw / 1e9);
    /* 8 nodes: B = min(234, 8 x 25 x 0.96 = 192) GB/s; ring 126 hops, 16 of them at 14 us:
     * 8.4 + 110 x 3.4 + 16 x 14 = 606.4 us; the tree's 140 us do not make up for its transfer
     * (2 GiB at 0.92 x 192 GB/s). */
    e = est(&a.net, g64, FSDP_COLL_ALL_REDUCE, GIB, FSDP_NET_ALGO_AUTO);
    is_case(e, 606.4 * US, GIB * 2 * 63 / 64 / 192e9, FSDP_NET_ALGO_RING,
            "DGX A100, 8 nodes x 8, all_reduce 1 GiB");
    fsdp_net_estimate_t t = est(&a.net, g64, FSDP_COLL_ALL_REDUCE, GIB, FSDP_NET_ALGO_TREE);
    tap_is_near(t.latency, (8.4 + 2 * (7 * 3.4 + 3 * 14)) * US, 1e-12, 0, "  the tree's latency");
    tap_diag("all_reduce 1 GiB, 64 x A100 on 8 nodes: %.3f ms (%s, busbw %.1f GB/s; tree %.3f "
             "ms)",
             e.seconds * 1e3, fsdp_net_algo_name(e.algo), e.bus_bw / 1e9, t.seconds * 1e3);
    /* nccl-tests' busbw approaches the link bandwidth on large messages. */
    e = est(&a.net, g8, FSDP_COLL_ALL_REDUCE, 1e12, FSDP_NET_ALGO_AUTO);
    tap_is_near(e.bus_bw, 234e9, 1e-4, 0, "busbw of a 1 TB all_reduce -> B");
    e = est(&a.net, g64, FSDP_COLL_ALL_GATHER, 1e12, FSDP_NET_ALGO_AUTO);
    tap_is_near(e.bus_bw, 192e9, 1e-4, 0, "busbw of a 1 TB all_gather over 8 nodes -> B");
}

/* ---------------------------------------------------------------------------------------------
 * Properties on every preset */

static void test_monotonic(void) {
    static const fsdp_coll_kind_t kinds[] = {FSDP_COLL_ALL_GATHER, FSDP_COLL_REDUCE_SCATTER,
                                             FSDP_COLL_ALL_REDUCE, FSDP_COLL_BROADCAST,
                                             FSDP_COLL_REDUCE,     FSDP_COLL_ALL_TO_ALL};
    for (size_t i = 0; i < fsdp_cluster_preset_count(); i++) {
        const char *name = fsdp_cluster_preset_name(i);
        fsdp_cluster_t cl;
        fsdp_cluster_preset(ctx, name, 128, &cl);
        /* More bytes never go faster, on groups of every shape. */
        const int shapes[][2] = {{2, 1}, {8, 1}, {4, 8}, {16, 1}, {128, 8}, {1024, 1}, {64, 16}};
        int bad = 0, checked = 0;
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            fsdp_net_group_t g;
            if (fsdp_net_group_strided(ctx, &cl.net, shapes[s][0], shapes[s][1], &g) < 0) {
                bad++;
                continue;
            }
            for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
                double prev = -1;
                for (double b = 0; b <= 1e12; b = b < 1 ? 1 : b * 3) {
                    fsdp_net_estimate_t e = est(&cl.net, g, kinds[k], b, FSDP_NET_ALGO_AUTO);
                    if (e.seconds < prev) bad++;
                    prev = e.seconds;
                    checked++;
                }
            }
        }
        tap_ok(bad == 0 && checked > 1000, "%s: more bytes never faster (%d cases, %d bad)", name,
               checked, bad);
        /* All-gather at a fixed size per GPU never gets faster with more GPUs, from one node up
         * to 128; reduce-scatter alike. */
        bad = 0;
        for (size_t k = 0; k < 2; k++) {
            for (double per = 1; per <= 1e9; per *= 1000) {
                double prev = -1;
                for (int n = 8; n <= 1024; n *= 2) {
                    fsdp_net_group_t g;
                    fsdp_net_group_strided(ctx, &cl.net, n, 1, &g);
                    fsdp_net_estimate_t e = est(&cl.net, g, kinds[k], per * n, FSDP_NET_ALGO_AUTO);
                    if (e.seconds < prev) bad++;
                    prev = e.seconds;
                }
            }
        }
        tap_is_int(bad, 0,
                   "%s: more GPUs at a fixed size per GPU never faster (all_gather, "
                   "reduce_scatter)",
                   name);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Errors */

/* Expects FSDP_EINVAL (or `want`) with `needle` in the context's message. */
static void is_err(int rc, int want, const char *needle, const char *what) {
    tap_is_int(rc, want, "%s fails", what);
    tap_has_str(fsdp_ctx_last_error(ctx), needle, "  and says so");
}

static void test_net_errors(void) {
    fsdp_net_model_t n;
    fsdp_net_estimate_t e;
    fsdp_net_group_t g8 = grp(8, 8, 1);

    n = toy();
    n.intra_bw = 0;
    is_err(fsdp_net_model_check(ctx, &n), FSDP_EINVAL, "net.intra_bw is 0", "zero NVLink bw");
    n = toy();
    n.nic_bw = 0;
    is_err(fsdp_net_coll_time(ctx, &n, &g8, FSDP_COLL_ALL_REDUCE, 1, FSDP_NET_ALGO_AUTO, &e),
           FSDP_EINVAL, "fsdp_net_coll_time: net.nic_bw is 0", "a collective on zero NIC bw");
    n = toy();
    n.nic_bw = NAN;
    is_err(fsdp_net_model_check(ctx, &n), FSDP_EINVAL, "net.nic_bw is nan", "NaN NIC bw");
    n = toy();
    n.intra_bw = INFINITY;
    is_err(fsdp_net_model_check(ctx, &n), FSDP_EINVAL, "net.intra_bw is inf", "infinite bw");
    n = toy();
    n.intra_eff = 1.5;
    is_err(fsdp_net_model_check(ctx, &n), FSDP_EINVAL, "net.intra_eff is 1.5", "efficiency > 1");
    n = toy();
    n.inter_eff = 0;
    is_err(fsdp_net_model_check(ctx, &n), FSDP_EINVAL, "net.inter_eff is 0", "efficiency 0");
    n = toy();
    n.tree_eff = NAN;
    is_err(fsdp_net_model_check(ctx, &n), FSDP_EINVAL, "net.tree_eff", "NaN tree factor");
    n = toy();
    n.inter_latency = -1e-6;
    is_err(fsdp_net_model_check(ctx, &n), FSDP_EINVAL, "net.inter_latency is -1e-06",
           "negative latency");
    n = toy();
    n.base_latency = NAN;
    is_err(fsdp_net_model_check(ctx, &n), FSDP_EINVAL, "net.base_latency", "NaN base latency");
    n = toy();
    n.intra_latency = -1;
    is_err(fsdp_net_model_check(ctx, &n), FSDP_EINVAL, "net.intra_latency", "negative hop");
    n = toy();
    n.nodes = 0;
    is_err(fsdp_net_model_check(ctx, &n), FSDP_EINVAL, "net.nodes is 0", "no nodes");
    n = toy();
    n.gpus_per_node = -2;
    is_err(fsdp_net_model_check(ctx, &n), FSDP_EINVAL, "net.gpus_per_node is -2", "no GPUs");
    n = toy();
    n.nics_per_node = 0;
    is_err(fsdp_net_model_check(ctx, &n), FSDP_EINVAL, "net.nics_per_node is 0", "no NICs");
    n = toy();
    n.nodes = 1 << 28;
    is_err(fsdp_net_model_check(ctx, &n), FSDP_EINVAL, "do not fit an int", "too many GPUs");
    is_err(fsdp_net_model_check(ctx, NULL), FSDP_EINVAL, "net is NULL", "a NULL network");

    /* Groups. */
    n = toy();
    fsdp_net_group_t g = grp(8, 3, 1);
    is_err(fsdp_net_group_check(ctx, &n, &g), FSDP_EINVAL,
           "group.ranks_per_node 3 does not divide group.size 8", "ranks per node not dividing");
    g = grp(40, 8, 1);
    is_err(fsdp_net_coll_time(ctx, &n, &g, FSDP_COLL_ALL_GATHER, 1, FSDP_NET_ALGO_AUTO, &e),
           FSDP_EINVAL, "the group is larger than the cluster", "a group larger than the cluster");
    g = grp(16, 16, 1);
    is_err(fsdp_net_group_check(ctx, &n, &g), FSDP_EINVAL, "group.ranks_per_node is 16",
           "more ranks per node than GPUs");
    g = grp(0, 1, 1);
    is_err(fsdp_net_group_check(ctx, &n, &g), FSDP_EINVAL, "group.size is 0", "an empty group");
    g = grp(8, 8, 0);
    is_err(fsdp_net_group_check(ctx, &n, &g), FSDP_EINVAL, "group.stride is 0", "stride 0");
    g = grp(4, 4, 3);
    is_err(fsdp_net_group_check(ctx, &n, &g), FSDP_EINVAL, "do not fit a node",
           "4 ranks at stride 3 in 8 GPUs");
    is_err(fsdp_net_group_check(ctx, &n, NULL), FSDP_EINVAL, "group is NULL", "a NULL group");

    fsdp_net_group_t out = grp(-7, -7, -7);
    is_err(fsdp_net_group_strided(ctx, &n, 4, 3, &out), FSDP_EINVAL,
           "stride 3 does not divide net.gpus_per_node 8", "a stride that splits nodes unevenly");
    is_err(fsdp_net_group_strided(ctx, &n, 2, 12, &out), FSDP_EINVAL,
           "stride 12 is not a multiple of net.gpus_per_node 8", "a stride across nodes");
    is_err(fsdp_net_group_strided(ctx, &n, 12, 1, &out), FSDP_EINVAL, "unevenly",
           "12 contiguous ranks on nodes of 8");
    is_err(fsdp_net_group_strided(ctx, &n, 33, 1, &out), FSDP_EINVAL,
           "the group is larger than the cluster", "33 ranks on 32 GPUs");
    is_err(fsdp_net_group_strided(ctx, &n, 5, 8, &out), FSDP_EINVAL, "world rank 32",
           "5 ranks at stride 8 on 4 nodes");
    is_err(fsdp_net_group_strided(ctx, &n, 0, 1, &out), FSDP_EINVAL, "size is 0", "size 0");
    is_err(fsdp_net_group_strided(ctx, &n, 2, 0, &out), FSDP_EINVAL, "stride is 0", "stride 0");
    int dup[] = {0, 1, 1, 2};
    is_err(fsdp_net_group_from_ranks(ctx, &n, dup, 4, &out), FSDP_EINVAL,
           "world rank 1 appears twice", "a rank twice");
    int far[] = {0, 32};
    is_err(fsdp_net_group_from_ranks(ctx, &n, far, 2, &out), FSDP_EINVAL,
           "world_ranks[1] is 32, outside the cluster's [0, 32)", "a rank outside the cluster");
    int uneven[] = {0, 1, 2, 8};
    is_err(fsdp_net_group_from_ranks(ctx, &n, uneven, 4, &out), FSDP_EINVAL,
           "node 1 holds 1 of the group's ranks, another node 3", "uneven counts per node");
    int spaced[] = {0, 1, 3, 8, 9, 11};
    is_err(fsdp_net_group_from_ranks(ctx, &n, spaced, 6, &out), FSDP_EINVAL, "not evenly spaced",
           "uneven spacing");
    int mixed[] = {0, 2, 8, 9};
    is_err(fsdp_net_group_from_ranks(ctx, &n, mixed, 4, &out), FSDP_EINVAL, "not evenly spaced",
           "spacing that differs between nodes");
    is_err(fsdp_net_group_from_ranks(ctx, &n, NULL, 4, &out), FSDP_EINVAL, "world_ranks is NULL",
           "NULL ranks");
    is_err(fsdp_net_group_from_ranks(ctx, &n, dup, 0, &out), FSDP_EINVAL, "n is 0", "no ranks");
    tap_ok(out.size == -7 && out.ranks_per_node == -7 && out.stride == -7,
           "failed group calls leave *out alone");

    /* Collectives. */
    memset(&e, 0x5a, sizeof e);
    fsdp_net_estimate_t before = e;
    is_err(fsdp_net_coll_time(ctx, &n, &g8, FSDP_COLL_ALL_GATHER, 1, FSDP_NET_ALGO_TREE, &e),
           FSDP_ENOTSUP, "all_gather has no tree algorithm", "the tree on all_gather");
    is_err(fsdp_net_coll_time(ctx, &n, &g8, FSDP_COLL_ALL_TO_ALL, 1, FSDP_NET_ALGO_RING, &e),
           FSDP_ENOTSUP, "all_to_all has no ring algorithm", "the ring on all_to_all");
    is_err(fsdp_net_coll_time(ctx, &n, &g8, FSDP_COLL_ALL_REDUCE, 1, FSDP_NET_ALGO_DIRECT, &e),
           FSDP_ENOTSUP, "all_reduce has no direct algorithm", "direct on all_reduce");
    is_err(fsdp_net_coll_time(ctx, &n, &g8, FSDP_COLL_ALL_REDUCE, 1, FSDP_NET_ALGO_LOCAL, &e),
           FSDP_EINVAL, "algo 4 is not one of", "asking for local");
    is_err(fsdp_net_coll_time(ctx, &n, &g8, FSDP_COLL_COUNT, 1, FSDP_NET_ALGO_AUTO, &e),
           FSDP_EINVAL, "kind 7 is not a collective", "an invalid kind");
    tap_is_mem(&e, &before, sizeof e, "failed estimates leave *out alone");
    is_err(fsdp_net_coll_time(ctx, &n, &g8, FSDP_COLL_ALL_REDUCE, 1, FSDP_NET_ALGO_AUTO, NULL),
           FSDP_EINVAL, "out is NULL", "a NULL estimate");

    size_t b = 99;
    is_err(
        fsdp_net_coll_bytes(ctx, FSDP_COLL_ALL_GATHER, 1 << 20, SIZE_MAX / 2, FSDP_DTYPE_F32, &b),
        FSDP_EINVAL, "overflows size_t", "an overflowing size");
    is_err(fsdp_net_coll_bytes(ctx, FSDP_COLL_ALL_GATHER, 8, 1, FSDP_DTYPE_COUNT, &b), FSDP_EINVAL,
           "dtype 8 is not a dtype", "a bad dtype");
    is_err(fsdp_net_coll_bytes(ctx, FSDP_COLL_COUNT, 8, 1, FSDP_DTYPE_F32, &b), FSDP_EINVAL,
           "kind 7 is not a collective", "a bad kind");
    is_err(fsdp_net_coll_bytes(ctx, FSDP_COLL_ALL_REDUCE, 0, 1, FSDP_DTYPE_F32, &b), FSDP_EINVAL,
           "n is 0", "no ranks");
    tap_is_size(b, 99, "failed byte counts leave *out alone");
}

static void test_preset_errors(void) {
    fsdp_cluster_t cl;
    memset(&cl, 0x11, sizeof cl);
    fsdp_cluster_t before = cl;
    is_err(fsdp_cluster_preset(ctx, "dgx-b200", 1, &cl), FSDP_EINVAL,
           "unknown cluster preset \"dgx-b200\"; known: dgx-a100-80gb, dgx-h100, fsdp-paper-a100",
           "an unknown preset");
    tap_has_str(fsdp_ctx_last_error(ctx), "fsdp_cluster_calibrate_cpu", "  pointing at the CPU");
    is_err(fsdp_cluster_preset(ctx, "dgx-h100", 0, &cl), FSDP_EINVAL, "nodes is 0", "zero nodes");
    is_err(fsdp_cluster_preset(ctx, "dgx-h100", 1 << 29, &cl), FSDP_EINVAL, "do not fit an int",
           "too many nodes");
    is_err(fsdp_cluster_preset(ctx, NULL, 1, &cl), FSDP_EINVAL, "name is NULL", "a NULL name");
    tap_is_mem(&cl, &before, sizeof cl, "failed presets leave *out alone");
    is_err(fsdp_cluster_preset(ctx, "dgx-h100", 1, NULL), FSDP_EINVAL, "out is NULL", "NULL out");

    fsdp_cluster_preset(ctx, "dgx-a100-80gb", 2, &cl);
    memset(cl.name, 'x', sizeof cl.name);
    is_err(fsdp_cluster_check(ctx, &cl), FSDP_EINVAL, "name is not terminated", "a long name");
    fsdp_cluster_preset(ctx, "dgx-a100-80gb", 2, &cl);
    cl.compute.mem_bw = 0;
    is_err(fsdp_cluster_check(ctx, &cl), FSDP_EINVAL, "fsdp_cluster_check: compute.mem_bw is 0",
           "the cluster check reaches the compute model");
    is_err(fsdp_cluster_check(ctx, NULL), FSDP_EINVAL, "cluster is NULL", "a NULL cluster");

    /* Without a context the message is logged, and the call still fails cleanly. */
    fsdp_net_model_t n = toy();
    n.nic_bw = 0;
    fprintf(stderr, "# t_netmodel: an error log line is expected next\n");
    tap_is_int(fsdp_net_model_check(NULL, &n), FSDP_EINVAL, "a NULL context: still EINVAL");
}

int main(void) {
    tap_plan_lazy();
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    if (fsdp_ctx_create(&o, &ctx) < 0) {
        printf("Bail out! no context\n");
        return 1;
    }
    test_bus_factors();
    test_ring_intra();
    test_ring_inter();
    test_hybrid();
    test_all_to_all_and_barrier();
    test_presets();
    test_dgx_examples();
    test_monotonic();
    test_net_errors();
    test_preset_errors();
    fsdp_ctx_destroy(ctx);
    return tap_done();
}
