/* SPDX-License-Identifier: MIT */
/*
 * toy_cluster.h: the toy cluster of round numbers that the cost-model tests share (t_netmodel.c,
 * t_compute_model.c, t_vsim.c), so that each expectation can be worked out with pencil and
 * paper from the formulas of fsdp/cluster.h.
 *
 * Network: nodes of 8 GPUs, NVLink 100 GB/s per GPU, 4 NICs of 20 GB/s per node (10 GB/s per
 * GPU), hops of 1 us inside a node and 10 us between nodes, 5 us per collective, the tree at 0.8
 * of the ring's bandwidth, every efficiency 1. Compute: 100 TFLOP/s bf16 and f16 products, 10
 * f32 (50 with TF32, off), 5 TFLOP/s element-wise, 1 TB/s of memory (1 GiB of it), 1 us a
 * launch, every efficiency 1.
 */
#ifndef FSDP_TEST_TOY_CLUSTER_H
#define FSDP_TEST_TOY_CLUSTER_H

#include <stdio.h>
#include <string.h>

#include <fsdp/cluster.h>

static inline fsdp_net_model_t toy_net(int nodes) {
    fsdp_net_model_t n = {
        .nodes = nodes,
        .gpus_per_node = 8,
        .intra_bw = 100e9,
        .intra_eff = 1,
        .intra_latency = 1e-6,
        .nics_per_node = 4,
        .nic_bw = 20e9,
        .inter_eff = 1,
        .inter_latency = 10e-6,
        .base_latency = 5e-6,
        .tree_eff = 0.8,
    };
    return n;
}

static inline fsdp_compute_model_t toy_compute(void) {
    fsdp_compute_model_t m;
    memset(&m, 0, sizeof m);
    m.matmul_flops[FSDP_DTYPE_BF16] = 100e12;
    m.matmul_flops[FSDP_DTYPE_F16] = 100e12;
    m.matmul_flops[FSDP_DTYPE_F32] = 10e12;
    m.tf32_flops = 50e12;
    m.vector_flops = 5e12;
    m.mem_bw = 1e12;
    m.mem_bytes = 1 << 30;
    m.launch = 1e-6;
    for (int c = 0; c < FSDP_KERNEL_CLASS_COUNT; c++)
        m.eff[c] = 1;
    return m;
}

/* Both, named "toy". */
static inline fsdp_cluster_t toy_cluster(int nodes) {
    fsdp_cluster_t cl;
    memset(&cl, 0, sizeof cl);
    snprintf(cl.name, sizeof cl.name, "toy");
    cl.net = toy_net(nodes);
    cl.compute = toy_compute();
    return cl;
}

#endif /* FSDP_TEST_TOY_CLUSTER_H */
