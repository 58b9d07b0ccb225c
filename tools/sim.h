/* SPDX-License-Identifier: MIT */
/*
 * sim.h: what fsdp-sim's files share: the model presets, one configuration and its result.
 */
#ifndef FSDP_TOOLS_SIM_H
#define FSDP_TOOLS_SIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp.h>

typedef struct sim_model {
    const char *name;
    int64_t n_layer, d_model, n_head, d_ff, vocab, seq;
    const char *summary;
} sim_model_t;

size_t sim_model_count(void);
const sim_model_t *sim_model_at(size_t i);
const sim_model_t *sim_model_find(const char *name); /* NULL: unknown */
double sim_model_params(const sim_model_t *m);
double sim_model_flops(const sim_model_t *m, double tokens);

/* How kernels are priced: the roofline of the cluster's compute model, or (cluster "cpu") each
 * call timed on this machine's CPU device (fsdp_vsim_measure_kernels). */
typedef enum sim_kernel_times {
    SIM_KERNELS_DEFAULT = 0, /* measured on "cpu", the roofline elsewhere */
    SIM_KERNELS_ROOFLINE,
    SIM_KERNELS_MEASURED,
} sim_kernel_times_t;

typedef struct sim_config {
    const sim_model_t *model;
    const char *cluster; /* a preset of fsdp/cluster.h, or "cpu": this machine, calibrated */
    int gpus;            /* world size */
    int gpus_per_node;
    int rank;      /* the simulated rank */
    int64_t batch; /* sequences per GPU */
    fsdp_sharding_strategy_t strategy;
    int shard_group; /* hybrid: ranks per shard group (0: a node) */
    fsdp_backward_prefetch_t prefetch;
    bool forward_prefetch;
    bool no_contention; /* collectives take no SMs from the kernels (compute.sms = 0) */
    int limit;          /* limit_all_gathers */
    fsdp_dtype_t dtype; /* compute dtype: f32, or bf16/f16 mixed precision */
    bool act_ckpt;
    bool lowp_kernels; /* the compute model's lowp_kernels: half kernels as PyTorch's */
    double grad_clip;  /* clip the gradient norm to it before the step (0: no clipping) */
    sim_kernel_times_t kernel_times;
    const char *backend; /* cluster "cpu": the group whose collectives are calibrated (NULL: sim) */
    fsdp_pg_t *pg;       /* cluster "cpu" under a launcher: the world's group of processes, whose
                          * collectives the calibration times (NULL: threads of this process) */
    const char *trace;   /* write the measured step's trace (simulated time) there; NULL: none */
} sim_config_t;

typedef struct sim_result {
    double step;        /* s of the measured step */
    double compute;     /* s the compute stream ran kernels */
    double comm;        /* s the network ran collectives */
    double exposed;     /* s the compute stream waited */
    double contention;  /* s of `compute` lost to collectives holding SMs */
    double model_flops; /* per GPU per step */
    double hw_flops;
    double params;
    double peak_flops;
    double tflops, hw_tflops, mfu;
    fsdp_mem_stats_t mem;
    size_t mem_capacity;
    int gpus_per_node; /* of the cluster simulated */
    double coll_bytes[FSDP_COLL_COUNT], coll_time[FSDP_COLL_COUNT];
    double class_time[FSDP_KERNEL_CLASS_COUNT];
    uint64_t kernels;
    size_t measured_calls; /* distinct calls timed on this CPU */
    double slowdown; /* cluster "cpu": the world's ranks computing at once against one alone */
    double wall;     /* s of this machine's time for the whole simulation */
    char error[512];
} sim_result_t;

/* Simulates c (two steps, the second measured) into *r. Returns 0, or a negative FSDP_E* code
 * with r->error saying what failed. */
int sim_run(const sim_config_t *c, sim_result_t *r);

/* A rank other than 0 of c->pg: takes its part in the calibration rank 0's sim_run(c) makes
 * (fsdp_calibrate_options_t.pg) and nothing else. Returns 0, or a negative FSDP_E* code with
 * err saying what failed. */
int sim_calibrate_peer(fsdp_ctx_t *ctx, const sim_config_t *c, char *err, size_t cap);

/* Draws the n results into the SVG `path` through gnuplot (sim_plot.c); -1 with a message on
 * stderr when the name is not .svg or gnuplot is missing or fails. */
int sim_plot(const char *path, const char *title, const sim_config_t *cfgs, const sim_result_t *res,
             int n);

#endif /* FSDP_TOOLS_SIM_H */
