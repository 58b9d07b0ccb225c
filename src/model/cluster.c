/* SPDX-License-Identifier: MIT */
/*
 * cluster.c: the checks of a cluster description and the presets of real clusters.
 *
 * Presets are immutable tables; fsdp_cluster_preset() copies one and sets the node count.
 * Every figure is cited in docs/cluster-model.md: datasheet figures as printed (bidirectional
 * NVLink halved, "with sparsity" tensor rates halved), NCCL's own tuning figures for
 * latencies and efficiencies, and the few assumptions marked as such there.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "model/model_impl.h"

const char *fsdp_kernel_class_name(fsdp_kernel_class_t cls) {
    switch (cls) {
    case FSDP_KERNEL_MATMUL:
        return "matmul";
    case FSDP_KERNEL_ATTENTION:
        return "attention";
    case FSDP_KERNEL_ELEMENTWISE:
        return "elementwise";
    case FSDP_KERNEL_ROWWISE:
        return "rowwise";
    default:
        return "invalid";
    }
}

/* ---------------------------------------------------------------------------------------------
 * Checks. A value is refused when it is NaN or infinite, so every comparison is written so that
 * NaN fails it. */

static int check_positive(fsdp_ctx_t *ctx, const char *who, const char *field, double v,
                          const char *unit) {
    if (isfinite(v) && v > 0) return FSDP_OK;
    return fsdp__model_err(ctx, FSDP_EINVAL, "%s: %s is %g (must be > 0 %s and finite)", who, field,
                           v, unit);
}

static int check_nonneg(fsdp_ctx_t *ctx, const char *who, const char *field, double v,
                        const char *unit) {
    if (isfinite(v) && v >= 0) return FSDP_OK;
    return fsdp__model_err(ctx, FSDP_EINVAL, "%s: %s is %g (must be >= 0 %s and finite)", who,
                           field, v, unit);
}

static int check_fraction(fsdp_ctx_t *ctx, const char *who, const char *field, double v) {
    if (v > 0 && v <= 1) return FSDP_OK;
    return fsdp__model_err(ctx, FSDP_EINVAL, "%s: %s is %g (must be in (0, 1])", who, field, v);
}

static int check_count(fsdp_ctx_t *ctx, const char *who, const char *field, int v) {
    if (v >= 1) return FSDP_OK;
    return fsdp__model_err(ctx, FSDP_EINVAL, "%s: %s is %d (must be >= 1)", who, field, v);
}

static int check_count0(fsdp_ctx_t *ctx, const char *who, const char *field, int v) {
    if (v >= 0) return FSDP_OK;
    return fsdp__model_err(ctx, FSDP_EINVAL, "%s: %s is %d (must be >= 0)", who, field, v);
}

int fsdp__net_model_check(fsdp_ctx_t *ctx, const char *who, const fsdp_net_model_t *net) {
    int rc;
    if (!net) return fsdp__model_err(ctx, FSDP_EINVAL, "%s: net is NULL", who);
    if ((rc = check_count(ctx, who, "net.nodes", net->nodes)) < 0) return rc;
    if ((rc = check_count(ctx, who, "net.gpus_per_node", net->gpus_per_node)) < 0) return rc;
    if (net->nodes > INT32_MAX / net->gpus_per_node)
        return fsdp__model_err(ctx, FSDP_EINVAL,
                               "%s: net.nodes %d * net.gpus_per_node %d GPUs do not fit an int",
                               who, net->nodes, net->gpus_per_node);
    if ((rc = check_positive(ctx, who, "net.intra_bw", net->intra_bw, "B/s")) < 0) return rc;
    if ((rc = check_fraction(ctx, who, "net.intra_eff", net->intra_eff)) < 0) return rc;
    if ((rc = check_nonneg(ctx, who, "net.intra_latency", net->intra_latency, "s")) < 0) return rc;
    if ((rc = check_count(ctx, who, "net.nics_per_node", net->nics_per_node)) < 0) return rc;
    if ((rc = check_positive(ctx, who, "net.nic_bw", net->nic_bw, "B/s")) < 0) return rc;
    if ((rc = check_fraction(ctx, who, "net.inter_eff", net->inter_eff)) < 0) return rc;
    if ((rc = check_nonneg(ctx, who, "net.inter_latency", net->inter_latency, "s")) < 0) return rc;
    if ((rc = check_nonneg(ctx, who, "net.base_latency", net->base_latency, "s")) < 0) return rc;
    if ((rc = check_fraction(ctx, who, "net.tree_eff", net->tree_eff)) < 0) return rc;
    if ((rc = check_count0(ctx, who, "net.intra_channels", net->intra_channels)) < 0) return rc;
    if ((rc = check_count0(ctx, who, "net.inter_channels", net->inter_channels)) < 0) return rc;
    return FSDP_OK;
}

int fsdp__compute_model_check(fsdp_ctx_t *ctx, const char *who, const fsdp_compute_model_t *m) {
    int rc;
    char field[64];
    if (!m) return fsdp__model_err(ctx, FSDP_EINVAL, "%s: compute is NULL", who);
    /* The field's name is formatted only for the message: a simulator checks a model per call. */
    for (int i = 0; i < FSDP_DTYPE_COUNT; i++) {
        if (isfinite(m->matmul_flops[i]) && m->matmul_flops[i] >= 0) continue;
        snprintf(field, sizeof field, "compute.matmul_flops[%s]", fsdp_dtype_name((fsdp_dtype_t)i));
        return check_nonneg(ctx, who, field, m->matmul_flops[i], "FLOP/s");
    }
    if ((rc = check_nonneg(ctx, who, "compute.tf32_flops", m->tf32_flops, "FLOP/s")) < 0) return rc;
    if (m->allow_tf32 && m->tf32_flops == 0)
        return fsdp__model_err(ctx, FSDP_EINVAL,
                               "%s: compute.allow_tf32 is set but compute.tf32_flops is 0", who);
    if ((rc = check_positive(ctx, who, "compute.vector_flops", m->vector_flops, "FLOP/s")) < 0)
        return rc;
    if ((rc = check_positive(ctx, who, "compute.mem_bw", m->mem_bw, "B/s")) < 0) return rc;
    if ((rc = check_nonneg(ctx, who, "compute.launch", m->launch, "s")) < 0) return rc;
    if ((rc = check_nonneg(ctx, who, "compute.matmul_launch", m->matmul_launch, "s")) < 0)
        return rc;
    if ((rc = check_count0(ctx, who, "compute.sms", m->sms)) < 0) return rc;
    for (int c = 0; c < FSDP_KERNEL_CLASS_COUNT; c++) {
        if (m->eff[c] > 0 && m->eff[c] <= 1) continue;
        snprintf(field, sizeof field, "compute.eff[%s]",
                 fsdp_kernel_class_name((fsdp_kernel_class_t)c));
        return check_fraction(ctx, who, field, m->eff[c]);
    }
    return FSDP_OK;
}

int fsdp_net_model_check(fsdp_ctx_t *ctx, const fsdp_net_model_t *net) {
    return fsdp__net_model_check(ctx, "fsdp_net_model_check", net);
}

int fsdp_compute_model_check(fsdp_ctx_t *ctx, const fsdp_compute_model_t *m) {
    return fsdp__compute_model_check(ctx, "fsdp_compute_model_check", m);
}

int fsdp_cluster_check(fsdp_ctx_t *ctx, const fsdp_cluster_t *cl) {
    static const char who[] = "fsdp_cluster_check";
    if (!cl) return fsdp__model_err(ctx, FSDP_EINVAL, "%s: cluster is NULL", who);
    if (!memchr(cl->name, 0, sizeof cl->name))
        return fsdp__model_err(ctx, FSDP_EINVAL, "%s: name is not terminated within %zu bytes", who,
                               sizeof cl->name);
    int rc = fsdp__net_model_check(ctx, who, &cl->net);
    if (rc < 0) return rc;
    if ((rc = fsdp__compute_model_check(ctx, who, &cl->compute)) < 0) return rc;
    /* A collective holds at most every SM: with all of them (a CPU whose cores the ranks'
     * compute already fills) the kernels it overlaps wait for it. */
    int sms = cl->compute.sms, ch = cl->net.intra_channels > cl->net.inter_channels
                                        ? cl->net.intra_channels
                                        : cl->net.inter_channels;
    if (sms > 0 && ch > sms)
        return fsdp__model_err(ctx, FSDP_EINVAL,
                               "%s: net.%s_channels is %d, more than compute.sms (%d)", who,
                               ch == cl->net.intra_channels ? "intra" : "inter", ch, sms);
    return FSDP_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Presets (sources: docs/cluster-model.md). */

#define GB 1e9
#define TFLOPS 1e12
#define US 1e-6
#define GIB ((size_t)1 << 30)

/* NCCL's tuning model (src/graph/tuning.cc): the base latency of a ring collective and the
 * latency of one hop over NVLink and over the network, for the Simple protocol. */
#define NCCL_BASE_LAT (8.4 * US)
#define NCCL_NVLINK_HOP (3.4 * US)
#define NCCL_NET_HOP (14.0 * US)
/* NCCL's tuning model scales the tree's bus bandwidth by 0.92 against the ring's. */
#define NCCL_TREE_EFF 0.92
/* Assumed (docs/cluster-model.md): a kernel launch, and the fraction of the roofline each class
 * reaches where no measurement is cited. */
#define LAUNCH (4.0 * US)
#define EFF_MATMUL 0.8
#define EFF_ELEMENTWISE 0.85
#define EFF_ROWWISE 0.7

/* NVIDIA A100 80GB SXM (datasheet): dense tensor-core rates, FP32 on CUDA cores, HBM2e. */
#define A100_COMPUTE                                                                               \
    {                                                                                              \
        .matmul_flops = {[FSDP_DTYPE_F32] = 19.5 * TFLOPS,                                         \
                         [FSDP_DTYPE_F64] = 19.5 * TFLOPS,                                         \
                         [FSDP_DTYPE_F16] = 312 * TFLOPS,                                          \
                         [FSDP_DTYPE_BF16] = 312 * TFLOPS},                                        \
        .tf32_flops = 156 * TFLOPS, .allow_tf32 = false, .vector_flops = 19.5 * TFLOPS,            \
        .mem_bw = 2039 * GB, .mem_bytes = 80 * GIB, .launch = LAUNCH, .sms = 108,                  \
        .eff = {[FSDP_KERNEL_MATMUL] = EFF_MATMUL,                                                 \
                [FSDP_KERNEL_ATTENTION] = 0.6, /* FlashAttention-2: 50-73% on A100 */              \
                [FSDP_KERNEL_ELEMENTWISE] = EFF_ELEMENTWISE,                                       \
                [FSDP_KERNEL_ROWWISE] = EFF_ROWWISE},                                              \
    }

/* NVLink 3 on A100: 600 GB/s bidirectional per GPU; NCCL reaches about 235 GB/s of the 300.
 * NCCL runs 24 channels (SMs) over an HGX A100's NVSwitch, and 16 on a DGX with 8 NICs. */
#define A100_NVLINK                                                                                \
    .intra_bw = 300 * GB, .intra_eff = 0.78, .intra_latency = NCCL_NVLINK_HOP,                     \
    .intra_channels = 24, .inter_channels = 16

typedef struct preset {
    const char *name;
    const char *summary;
    fsdp_cluster_t cl; /* nodes is set by fsdp_cluster_preset() */
} preset_t;

static const preset_t presets[] = {
    {
        "dgx-a100-80gb",
        "NVIDIA DGX A100: 8 A100 80GB SXM, NVLink 600 GB/s, 8 x 200 Gb/s HDR InfiniBand",
        {
            .name = "dgx-a100-80gb",
            .net = {.gpus_per_node = 8,
                    A100_NVLINK,
                    .nics_per_node = 8,
                    .nic_bw = 25 * GB,
                    .inter_eff = 0.96,
                    .inter_latency = NCCL_NET_HOP,
                    .base_latency = NCCL_BASE_LAT,
                    .tree_eff = NCCL_TREE_EFF},
            .compute = A100_COMPUTE,
        },
    },
    {
        "dgx-h100",
        "NVIDIA DGX H100: 8 H100 80GB SXM, NVLink 900 GB/s, 8 x 400 Gb/s NDR InfiniBand",
        {
            .name = "dgx-h100",
            .net = {.gpus_per_node = 8,
                    .intra_bw = 450 * GB,
                    .intra_eff = 0.82,
                    .intra_latency = NCCL_NVLINK_HOP,
                    .intra_channels = 24, /* an all-gather's blocks on H100 (132 SMs) */
                    .inter_channels = 16, /* assumed: as on a DGX A100 with 8 NICs */
                    .nics_per_node = 8,
                    .nic_bw = 50 * GB,
                    .inter_eff = 0.97,
                    .inter_latency = NCCL_NET_HOP,
                    .base_latency = NCCL_BASE_LAT,
                    .tree_eff = NCCL_TREE_EFF},
            .compute =
                {
                    .matmul_flops = {[FSDP_DTYPE_F32] = 67 * TFLOPS,
                                     [FSDP_DTYPE_F64] = 67 * TFLOPS,
                                     [FSDP_DTYPE_F16] = 989.5 * TFLOPS,
                                     [FSDP_DTYPE_BF16] = 989.5 * TFLOPS},
                    .tf32_flops = 494.5 * TFLOPS,
                    .allow_tf32 = false,
                    .vector_flops = 67 * TFLOPS,
                    .mem_bw = 3350 * GB,
                    .mem_bytes = 80 * GIB,
                    .launch = LAUNCH,
                    .sms = 132,
                    .eff = {[FSDP_KERNEL_MATMUL] = EFF_MATMUL,
                            [FSDP_KERNEL_ATTENTION] = 0.35, /* FlashAttention-2 on H100 */
                            [FSDP_KERNEL_ELEMENTWISE] = EFF_ELEMENTWISE,
                            [FSDP_KERNEL_ROWWISE] = EFF_ROWWISE},
                },
        },
    },
    {
        "fsdp-paper-a100",
        "The PyTorch FSDP paper's cluster: A100 80GB, 8 per node (assumed), 2 Tb/s RoCE per node",
        {
            .name = "fsdp-paper-a100",
            .net = {.gpus_per_node = 8,
                    A100_NVLINK,
                    .nics_per_node = 8,
                    .nic_bw = 31.25 * GB,
                    .inter_eff = 0.96,
                    .inter_latency = NCCL_NET_HOP,
                    .base_latency = NCCL_BASE_LAT,
                    .tree_eff = NCCL_TREE_EFF},
            .compute = A100_COMPUTE,
        },
    },
};

#define NPRESETS (sizeof presets / sizeof presets[0])

size_t fsdp_cluster_preset_count(void) {
    return NPRESETS;
}

const char *fsdp_cluster_preset_name(size_t i) {
    return i < NPRESETS ? presets[i].name : NULL;
}

const char *fsdp_cluster_preset_summary(size_t i) {
    return i < NPRESETS ? presets[i].summary : NULL;
}

int fsdp_cluster_preset(fsdp_ctx_t *ctx, const char *name, int nodes, fsdp_cluster_t *out) {
    static const char who[] = "fsdp_cluster_preset";
    if (!name) return fsdp__model_err(ctx, FSDP_EINVAL, "%s: name is NULL", who);
    if (!out) return fsdp__model_err(ctx, FSDP_EINVAL, "%s: out is NULL", who);
    if (nodes < 1)
        return fsdp__model_err(ctx, FSDP_EINVAL, "%s: nodes is %d (must be >= 1)", who, nodes);
    for (size_t i = 0; i < NPRESETS; i++) {
        if (strcmp(presets[i].name, name) != 0) continue;
        if (nodes > INT32_MAX / presets[i].cl.net.gpus_per_node)
            return fsdp__model_err(ctx, FSDP_EINVAL, "%s: %d nodes of %d GPUs do not fit an int",
                                   who, nodes, presets[i].cl.net.gpus_per_node);
        *out = presets[i].cl;
        out->net.nodes = nodes;
        return FSDP_OK;
    }
    char known[256] = "";
    size_t len = 0;
    for (size_t i = 0; i < NPRESETS && len < sizeof known; i++)
        len += (size_t)snprintf(known + len, sizeof known - len, "%s%s", i ? ", " : "",
                                presets[i].name);
    return fsdp__model_err(ctx, FSDP_EINVAL,
                           "%s: unknown cluster preset \"%.64s\"; known: %s (and \"cpu\", "
                           "measured by fsdp_cluster_calibrate_cpu)",
                           who, name, known);
}
