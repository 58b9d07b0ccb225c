/*
 * calibrate.c: the "cpu" cluster, measured on this machine (fsdp_cluster_calibrate_cpu).
 *
 * The model itself (src/model/) sits just above the process group and uses nothing of the
 * backends; this file measures the CPU device and the sim backend, so it belongs to the launch
 * layer, which knows the concrete backends (docs/design.md, "Cost models of a cluster").
 *
 * Every measurement keeps the best of a few repetitions: on a shared machine a run can only be
 * slowed down by others, so the fastest is the closest to what the hardware does. Sizes are
 * chosen so that the whole calibration takes a few hundred milliseconds.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <fsdp/cluster.h>
#include <fsdp/device.h>
#include <fsdp/pg.h>
#include <fsdp/sim.h>

#include "core/timeutil.h"
#include "device/device_impl.h"
#include "model/model_impl.h"

#define REPS 3
/* A product is timed once it takes this long (or at the largest size), so that the timer's
 * resolution and the call's overhead do not count. */
#define GEMM_MIN_S 2e-3
#define GEMM_MAX_N 1024
#define COPY_BYTES ((size_t)32 << 20)
#define LAUNCH_CALLS 256
#define VEC_ELEMS ((size_t)1 << 18)
/* The sim all_reduce timed: one f32 element (latency) and 4 MiB (bandwidth). */
#define COLL_SMALL_REPS 50
#define COLL_LARGE_COUNT ((size_t)1 << 20)
#define COLL_LARGE_REPS 5

void fsdp_calibrate_options_init(fsdp_calibrate_options_t *opts) {
    if (!opts) return;
    memset(opts, 0, sizeof *opts);
    opts->ranks = 2;
}

static double seconds_since(int64_t t0) {
    return (double)(fsdp__now_ns() - t0) * 1e-9;
}

/* FLOP/s of square products of dt, doubling the size from 64 until one takes GEMM_MIN_S. */
static int time_gemm(fsdp_device_t *dev, fsdp_dtype_t dt, double *flops) {
    int rc = FSDP_OK;
    size_t es = fsdp_dtype_size(dt);
    for (int64_t n = 64;; n *= 2) {
        void *a = NULL, *b = NULL, *c = NULL;
        size_t bytes = (size_t)(n * n) * es;
        double best = 0;
        if ((rc = fsdp_device_alloc(dev, FSDP_MEM_OTHER, bytes, &a)) < 0) goto next;
        if ((rc = fsdp_device_alloc(dev, FSDP_MEM_OTHER, bytes, &b)) < 0) goto next;
        if ((rc = fsdp_device_alloc(dev, FSDP_MEM_OTHER, bytes, &c)) < 0) goto next;
        if ((rc = fsdp_device_fill(dev, a, dt, (size_t)(n * n), 0.5, NULL)) < 0) goto next;
        if ((rc = fsdp_device_fill(dev, b, dt, (size_t)(n * n), 0.25, NULL)) < 0) goto next;
        for (int i = 0; i <= REPS; i++) { /* the first call warms up and is not counted */
            int64_t t0 = fsdp__now_ns();
            rc = dev->ops->gemm(dev, dt, false, false, n, n, n, 1.0, a, n, 0, b, n, 0, 0.0, c, n, 0,
                                1);
            double t = seconds_since(t0);
            if (rc < 0) goto next;
            if (i > 0 && (best == 0 || t < best)) best = t;
        }
    next:
        fsdp_device_free(dev, a);
        fsdp_device_free(dev, b);
        fsdp_device_free(dev, c);
        if (rc < 0) return rc;
        if (best >= GEMM_MIN_S || n >= GEMM_MAX_N) {
            *flops = 2.0 * (double)n * (double)n * (double)n / (best > 0 ? best : 1e-9);
            return FSDP_OK;
        }
    }
}

/* The fixed cost of one product: a 128 x 128 x 128 gemm's best time beyond its FLOPs at `rate`
 * (the large products' rate), 0 when there is none. */
static int time_gemm_fixed(fsdp_device_t *dev, double rate, double *fixed) {
    const int64_t n = 128;
    size_t bytes = (size_t)(n * n) * sizeof(float);
    void *a = NULL, *b = NULL, *c = NULL;
    double best = 0;
    int rc = fsdp_device_alloc(dev, FSDP_MEM_OTHER, bytes, &a);
    if (rc == 0) rc = fsdp_device_alloc(dev, FSDP_MEM_OTHER, bytes, &b);
    if (rc == 0) rc = fsdp_device_alloc(dev, FSDP_MEM_OTHER, bytes, &c);
    if (rc == 0) rc = fsdp_device_fill(dev, a, FSDP_DTYPE_F32, (size_t)(n * n), 0.5, NULL);
    if (rc == 0) rc = fsdp_device_fill(dev, b, FSDP_DTYPE_F32, (size_t)(n * n), 0.25, NULL);
    for (int i = 0; i <= 4 * REPS && rc == 0; i++) {
        int64_t t0 = fsdp__now_ns();
        rc = dev->ops->gemm(dev, FSDP_DTYPE_F32, false, false, n, n, n, 1.0, a, n, 0, b, n, 0, 0.0,
                            c, n, 0, 1);
        double t = seconds_since(t0);
        if (i > 0 && (best == 0 || t < best)) best = t;
    }
    fsdp_device_free(dev, a);
    fsdp_device_free(dev, b);
    fsdp_device_free(dev, c);
    if (rc < 0) return rc;
    double extra = best - 2.0 * (double)(n * n * n) / rate;
    *fixed = extra > 0 ? extra : 0;
    return FSDP_OK;
}

/* The element-wise rate: the device's tanh GELU over VEC_ELEMS f32 elements (cache-resident),
 * at 8 FLOPs an element. */
static int time_vector(fsdp_device_t *dev, double *flops) {
    void *x = NULL, *y = NULL;
    double best = 0;
    int rc = fsdp_device_alloc(dev, FSDP_MEM_OTHER, VEC_ELEMS * sizeof(float), &x);
    if (rc == 0) rc = fsdp_device_alloc(dev, FSDP_MEM_OTHER, VEC_ELEMS * sizeof(float), &y);
    if (rc == 0) rc = fsdp_device_fill(dev, x, FSDP_DTYPE_F32, VEC_ELEMS, 0.5, NULL);
    for (int i = 0; i <= REPS && rc == 0; i++) {
        int64_t t0 = fsdp__now_ns();
        rc = dev->ops->unary(dev, FSDP_DTYPE_F32, FSDP_UNARY_GELU_TANH, VEC_ELEMS, 0, x, y);
        double t = seconds_since(t0);
        if (i > 0 && (best == 0 || t < best)) best = t;
    }
    fsdp_device_free(dev, x);
    fsdp_device_free(dev, y);
    if (rc < 0) return rc;
    *flops = 8.0 * (double)VEC_ELEMS / (best > 0 ? best : 1e-9);
    return FSDP_OK;
}

/* Device memory bandwidth from a COPY_BYTES copy, counting read and written bytes. */
static int time_copy(fsdp_device_t *dev, double *bw) {
    void *src = NULL, *dst = NULL;
    double best = 0;
    int rc = fsdp_device_alloc(dev, FSDP_MEM_OTHER, COPY_BYTES, &src);
    if (rc < 0) goto out;
    if ((rc = fsdp_device_alloc(dev, FSDP_MEM_OTHER, COPY_BYTES, &dst)) < 0) goto out;
    /* Touch every page first, so that the copies time the memory, not page faults. */
    if ((rc = fsdp_device_memset(dev, src, 1, COPY_BYTES, NULL)) < 0) goto out;
    if ((rc = fsdp_device_memset(dev, dst, 0, COPY_BYTES, NULL)) < 0) goto out;
    for (int i = 0; i < REPS; i++) {
        int64_t t0 = fsdp__now_ns();
        rc = fsdp_device_memcpy(dev, dst, src, COPY_BYTES, FSDP_COPY_D2D, NULL);
        double t = seconds_since(t0);
        if (rc < 0) goto out;
        if (best == 0 || t < best) best = t;
    }
    *bw = 2.0 * (double)COPY_BYTES / (best > 0 ? best : 1e-9);
out:
    fsdp_device_free(dev, src);
    fsdp_device_free(dev, dst);
    return rc;
}

/* The cost of one kernel call: a fill of one element, averaged over LAUNCH_CALLS calls. */
static int time_launch(fsdp_device_t *dev, double *launch) {
    void *p = NULL;
    double best = 0;
    int rc = fsdp_device_alloc(dev, FSDP_MEM_OTHER, 64, &p);
    if (rc < 0) return rc;
    for (int i = 0; i < REPS && rc == FSDP_OK; i++) {
        int64_t t0 = fsdp__now_ns();
        for (int j = 0; j < LAUNCH_CALLS && rc == FSDP_OK; j++)
            rc = fsdp_device_fill(dev, p, FSDP_DTYPE_F32, 1, 1.0, NULL);
        double t = seconds_since(t0) / LAUNCH_CALLS;
        if (best == 0 || t < best) best = t;
    }
    fsdp_device_free(dev, p);
    if (rc < 0) return rc;
    /* A clock that does not advance over the calls would give 0; a launch costs something. */
    *launch = best > 0 ? best : 1e-9;
    return FSDP_OK;
}

/* What the sim ranks measure; rank 0 writes the times, read after fsdp_sim_run has joined. */
typedef struct coll_times {
    double small, large; /* best seconds of an all_reduce of 1 and COLL_LARGE_COUNT f32 */
} coll_times_t;

static int time_allreduce(fsdp_pg_t *pg, float *buf, size_t count, int reps, double *best) {
    *best = 0;
    for (int i = 0; i <= reps; i++) { /* the first call warms up and is not counted */
        int64_t t0 = fsdp__now_ns();
        int rc = fsdp_pg_all_reduce(pg, buf, buf, count, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
        double t = seconds_since(t0);
        if (rc < 0) return rc;
        if (i > 0 && (*best == 0 || t < *best)) *best = t;
    }
    return FSDP_OK;
}

static int coll_rank(fsdp_ctx_t *ctx, void *arg) {
    coll_times_t *out = arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    /* Zeros sum to zeros: the values never overflow or turn into NaN. */
    float *buf = calloc(COLL_LARGE_COUNT, sizeof *buf);
    if (!buf) return FSDP_ENOMEM;
    double small, large;
    int rc = time_allreduce(pg, buf, 1, COLL_SMALL_REPS, &small);
    if (rc == FSDP_OK) rc = time_allreduce(pg, buf, COLL_LARGE_COUNT, COLL_LARGE_REPS, &large);
    free(buf);
    if (rc == FSDP_OK && fsdp_ctx_rank(ctx) == 0) {
        out->small = small;
        out->large = large;
    }
    return rc;
}

int fsdp_cluster_calibrate_cpu(fsdp_ctx_t *ctx, const fsdp_calibrate_options_t *opts,
                               fsdp_cluster_t *out) {
    static const char who[] = "fsdp_cluster_calibrate_cpu";
    fsdp_calibrate_options_t defaults;
    fsdp_ctx_t *own_ctx = NULL;
    fsdp_device_t *own_dev = NULL, *dev;
    fsdp_cluster_t cl;
    fsdp_compute_model_t *m = &cl.compute;
    fsdp_net_model_t *net = &cl.net;
    int rc;
    memset(&cl, 0, sizeof cl);
    if (!opts) {
        fsdp_calibrate_options_init(&defaults);
        opts = &defaults;
    }
    if (!out) return fsdp__model_err(ctx, FSDP_EINVAL, "%s: out is NULL", who);
    if (opts->ranks != 0 && (opts->ranks < 2 || opts->ranks > 1024))
        return fsdp__model_err(ctx, FSDP_EINVAL,
                               "%s: opts.ranks is %d (must be 0, to skip the collectives, or in "
                               "[2, 1024])",
                               who, opts->ranks);
    if (!ctx) {
        /* The measurement needs a context for its device; its messages are logged at the end. */
        if ((rc = fsdp_ctx_create(NULL, &own_ctx)) < 0)
            return fsdp__model_err(NULL, rc, "%s: no context for the measurement", who);
        ctx = own_ctx;
    }
    dev = fsdp_ctx_device(ctx);
    if (!dev || fsdp_device_kind(dev) != FSDP_DEVICE_CPU) {
        if ((rc = fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &own_dev)) < 0) goto out;
        dev = own_dev;
    }

    snprintf(cl.name, sizeof cl.name, "cpu");
    if ((rc = time_gemm(dev, FSDP_DTYPE_F32, &m->matmul_flops[FSDP_DTYPE_F32])) < 0) goto out;
    if ((rc = time_gemm(dev, FSDP_DTYPE_F64, &m->matmul_flops[FSDP_DTYPE_F64])) < 0) goto out;
    /* The CPU device widens bf16 and f16 operands to f32 for its products. */
    m->matmul_flops[FSDP_DTYPE_BF16] = m->matmul_flops[FSDP_DTYPE_F32];
    m->matmul_flops[FSDP_DTYPE_F16] = m->matmul_flops[FSDP_DTYPE_F32];
    if ((rc = time_gemm_fixed(dev, m->matmul_flops[FSDP_DTYPE_F32], &m->matmul_launch)) < 0)
        goto out;
    if ((rc = time_vector(dev, &m->vector_flops)) < 0) goto out;
    if ((rc = time_copy(dev, &m->mem_bw)) < 0) goto out;
    if ((rc = time_launch(dev, &m->launch)) < 0) goto out;
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    m->mem_bytes = pages > 0 && page > 0 ? (size_t)pages * (size_t)page : 0;
    for (int c = 0; c < FSDP_KERNEL_CLASS_COUNT; c++)
        m->eff[c] = 1;

    net->nodes = 1;
    net->intra_eff = net->inter_eff = net->tree_eff = 1;
    if (opts->ranks == 0) {
        /* No measurement: one "GPU" per node, links as fast as a copy, no latency. */
        net->gpus_per_node = 1;
        net->intra_bw = m->mem_bw / 2;
    } else {
        fsdp_sim_options_t so;
        fsdp_sim_options_init(&so);
        so.world_size = opts->ranks;
        coll_times_t t = {0, 0};
        if ((rc = fsdp_sim_run(&so, coll_rank, &t, NULL)) < 0) {
            rc = fsdp__model_err(ctx, rc, "%s: the sim run of %d ranks failed: %s", who,
                                 opts->ranks, fsdp_strerror(rc));
            goto out;
        }
        /* All of the small collective is latency; the large one adds its bytes, which the
         * ring formula moves at 2 (n - 1) / n * S / B. Noise can make the difference vanish. */
        double S = (double)(COLL_LARGE_COUNT * sizeof(float)), n = opts->ranks;
        double transfer = t.large > t.small ? t.large - t.small : t.large;
        net->gpus_per_node = opts->ranks;
        net->base_latency = t.small;
        net->intra_bw = 2 * (n - 1) / n * S / (transfer > 0 ? transfer : 1e-9);
    }
    net->nics_per_node = net->gpus_per_node;
    net->nic_bw = net->intra_bw;
    /* The sim group is not a ring: its cost does not grow per hop, so all of it is the base. */
    net->intra_latency = net->inter_latency = 0;

    if ((rc = fsdp__net_model_check(ctx, who, net)) < 0) goto out;
    if ((rc = fsdp__compute_model_check(ctx, who, m)) < 0) goto out;
    *out = cl;
out:
    if (rc < 0 && own_ctx) fsdp__model_err(NULL, rc, "%s", fsdp_ctx_last_error(own_ctx));
    fsdp_device_destroy(own_dev);
    fsdp_ctx_destroy(own_ctx);
    return rc;
}
