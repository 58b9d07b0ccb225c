/* SPDX-License-Identifier: MIT */
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
#include <time.h>
#include <unistd.h>

#include <fsdp/cluster.h>
#include <fsdp/device.h>
#include <fsdp/gloo.h>
#include <fsdp/pg.h>
#include <fsdp/sim.h>
#include <fsdp/store.h>

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
/* The all_gathers timed: one f32 element per rank (latency) and an output of opts->coll_bytes
 * (bandwidth; 4 MiB by default), each call after a barrier and a pause of COLL_PAUSE_NS of
 * CPU time spent computing. */
#define COLL_SMALL_REPS 31
#define COLL_LARGE_BYTES ((size_t)4 << 20)
#define COLL_LARGE_REPS 63
#define COLL_PAUSE_NS 1000000

static const fsdp__abi_struct_t calibrate_options_abi =
    FSDP__ABI_STRUCT(fsdp_calibrate_options_t, "fsdp_calibrate_options_init", pg);

void(fsdp_calibrate_options_init)(fsdp_calibrate_options_t *opts, size_t size) {
    fsdp_calibrate_options_t d;
    memset(&d, 0, sizeof d);
    d.ranks = 2;
    d.backend = NULL;
    d.coll_bytes = 0;
    d.pg = NULL;
    fsdp__abi_init(opts, size, &d, &calibrate_options_abi);
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
    fsdp_store_t *store; /* non-NULL: time Gloo groups rendezvousing through clones of it */
    size_t large_count;  /* f32 elements each rank contributes to the large all_gather */
    double small, large; /* mean seconds of the small and the large all_gather */
} coll_times_t;

/* Spends COLL_PAUSE_NS of this thread's CPU time computing. */
static void compute_pause(void) {
    const int64_t t0 = fsdp__thread_cpu_ns();
    while (fsdp__thread_cpu_ns() - t0 < COLL_PAUSE_NS) {
        /* spin: the pause stands for a rank's computing */
    }
}

/* Seconds from a barrier to the end of reps rounds of a compute pause, each followed by an
 * all_gather of count f32 elements per rank when count > 0. */
static int rounds(fsdp_pg_t *pg, float *buf, size_t count, int reps, double *seconds) {
    char *send = (char *)buf + (size_t)fsdp_pg_rank(pg) * count * sizeof *buf;
    int rc = fsdp_pg_barrier(pg, NULL);
    int64_t t0 = fsdp__now_ns();
    for (int i = 0; i < reps && rc == FSDP_OK; i++) {
        compute_pause();
        if (count > 0) rc = fsdp_pg_all_gather(pg, send, buf, count, FSDP_DTYPE_F32, NULL);
    }
    *seconds = seconds_since(t0);
    return rc;
}

/*
 * What an all_gather of count f32 elements per rank adds to a round of computing: reps rounds
 * of COLL_PAUSE_NS of each rank's CPU time followed by the all_gather, less the same rounds
 * without it, per round (the mean; 0 at least). In a training step the ranks compute between
 * collectives, and a collective timed alone, back to back or after a sleep, hides what it costs
 * there: the transport's threads wait for cores the ranks hold, and what a rank's send has left
 * to do after its call returned delays the peers' next call instead. On this machine a Gloo
 * all_gather of 0.8 MB between two ranks takes 0.2 to 0.3 ms back to back and adds 3 ms or so to
 * a round, as in fsdp-train's steps (docs/simulation.md). The pause counts CPU time, not wall
 * time, so that ranks sharing cores end it together, as ranks sharing cores through a step do.
 */
static int time_all_gather(fsdp_pg_t *pg, float *buf, size_t count, int reps, double *mean) {
    double with = 0, without = 0, warm;
    int rc = rounds(pg, buf, count, 1, &warm);
    if (rc == FSDP_OK) rc = rounds(pg, buf, 0, reps, &without);
    if (rc == FSDP_OK) rc = rounds(pg, buf, count, reps, &with);
    *mean = with > without ? (with - without) / reps : 0;
    return rc;
}

/* Every rank of pg times the small and the large all_gather; t receives rank 0's times. */
static int time_colls(fsdp_pg_t *pg, coll_times_t *t) {
    /* Zeros sum to zeros: the values never overflow or turn into NaN. */
    float *buf = calloc(t->large_count * (size_t)fsdp_pg_size(pg), sizeof *buf);
    if (!buf) return FSDP_ENOMEM;
    double small, large;
    int rc = time_all_gather(pg, buf, 1, COLL_SMALL_REPS, &small);
    if (rc == FSDP_OK) rc = time_all_gather(pg, buf, t->large_count, COLL_LARGE_REPS, &large);
    free(buf);
    if (rc == FSDP_OK && fsdp_pg_rank(pg) == 0) {
        t->small = small;
        t->large = large;
    }
    return rc;
}

static int coll_rank(fsdp_ctx_t *ctx, void *arg) {
    coll_times_t *out = arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx), *gloo = NULL;
    fsdp_store_t *store = NULL;
    int rc = FSDP_OK;
    if (out->store) {
        /* A Gloo group of this thread's own, rendezvousing through a clone of the shared store;
         * its collectives are the ones timed. */
        if ((rc = fsdp_store_clone(out->store, "calibrate/", &store)) < 0) return rc;
        if ((rc = fsdp_pg_create_gloo(ctx, store, NULL, &gloo)) < 0) goto out;
        pg = gloo;
    }
    rc = time_colls(pg, out);
out:
    fsdp_pg_destroy(gloo);
    fsdp_store_destroy(store);
    return rc;
}

/* The device's rates: everything of the compute model. */
static int measure_device(fsdp_device_t *dev, fsdp_compute_model_t *m) {
    int rc;
    if ((rc = time_gemm(dev, FSDP_DTYPE_F32, &m->matmul_flops[FSDP_DTYPE_F32])) < 0) return rc;
    if ((rc = time_gemm(dev, FSDP_DTYPE_F64, &m->matmul_flops[FSDP_DTYPE_F64])) < 0) return rc;
    /* The CPU device widens bf16 and f16 operands to f32 for its products. */
    m->matmul_flops[FSDP_DTYPE_BF16] = m->matmul_flops[FSDP_DTYPE_F32];
    m->matmul_flops[FSDP_DTYPE_F16] = m->matmul_flops[FSDP_DTYPE_F32];
    if ((rc = time_gemm_fixed(dev, m->matmul_flops[FSDP_DTYPE_F32], &m->matmul_launch)) < 0)
        return rc;
    if ((rc = time_vector(dev, &m->vector_flops)) < 0) return rc;
    if ((rc = time_copy(dev, &m->mem_bw)) < 0) return rc;
    if ((rc = time_launch(dev, &m->launch)) < 0) return rc;
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    m->mem_bytes = pages > 0 && page > 0 ? (size_t)pages * (size_t)page : 0;
    for (int c = 0; c < FSDP_KERNEL_CLASS_COUNT; c++)
        m->eff[c] = 1;
    return FSDP_OK;
}

/* The network of `ranks` ranks from the all_gathers' times t (mem_bw: the device's copy rate). */
static void fit_net(fsdp_net_model_t *net, int ranks, const coll_times_t *t, double mem_bw) {
    /* All of the small collective is latency; the large one adds its bytes, which the ring
     * formula moves at (n - 1) / n * S / B for an all_gather of S bytes of output. Where the
     * transport's start-up costs swamp its bytes (Gloo on ranks that share cores), noise can
     * make the large one no slower than the small one, or by less than a copy of its bytes
     * takes: then all of it is latency, the bytes move at the copy bandwidth, and the model still
     * gives the large all_gather the time it took. */
    double n = ranks, S = (double)(t->large_count * sizeof(float)) * n;
    net->gpus_per_node = ranks;
    if (t->large - t->small > S / mem_bw) { /* no faster than a copy of the bytes */
        net->base_latency = t->small;
        net->intra_bw = (n - 1) / n * S / (t->large - t->small);
    } else {
        net->base_latency = t->large;
        net->intra_bw = mem_bw / 2;
    }
}

/* What rank 0 of opts.pg sends the others: its status, and the cluster when that is 0. */
typedef struct pg_result {
    int32_t rc;
    fsdp_cluster_t cl;
} pg_result_t;

/* Rank 0's status (and with it its cluster) to every rank of pg; on the others a failure of rank
 * 0 becomes FSDP_EREMOTE. Returns the broadcast's own failure first. */
static int share_result(fsdp_ctx_t *ctx, const char *who, fsdp_pg_t *pg, pg_result_t *res) {
    pg_result_t mine = *res;
    int rc = fsdp_pg_broadcast(pg, &mine, res, sizeof *res, FSDP_DTYPE_U8, 0, NULL);
    if (rc < 0)
        return fsdp__model_err(ctx, rc, "%s: opts.pg: sharing rank 0's measurement: %s", who,
                               fsdp_strerror(rc));
    if (fsdp_pg_rank(pg) != 0 && res->rc < 0)
        return fsdp__model_err(ctx, FSDP_EREMOTE,
                               "%s: rank 0 of opts.pg failed to measure this machine (%s)", who,
                               fsdp_strerror(res->rc));
    return res->rc;
}

int fsdp_cluster_calibrate_cpu(fsdp_ctx_t *ctx, const fsdp_calibrate_options_t *opts,
                               fsdp_cluster_t *out) {
    static const char who[] = "fsdp_cluster_calibrate_cpu";
    fsdp_calibrate_options_t defaults;
    fsdp_ctx_t *own_ctx = NULL;
    fsdp_device_t *own_dev = NULL, *dev;
    pg_result_t res;
    fsdp_cluster_t *cl = &res.cl;
    fsdp_net_model_t *net = &cl->net;
    int rc;
    memset(&res, 0, sizeof res);
    if ((rc = fsdp__abi_check(ctx, who, "opts", opts, &calibrate_options_abi)) < 0) return rc;
    if (!opts) {
        fsdp_calibrate_options_init(&defaults);
        opts = &defaults;
    }
    if (!out) return fsdp__model_err(ctx, FSDP_EINVAL, "%s: out is NULL", who);
    fsdp_pg_t *pg = opts->pg;
    bool gloo = !pg && opts->backend && strcmp(opts->backend, "gloo") == 0;
    if (!pg && opts->backend && !gloo && strcmp(opts->backend, "sim") != 0)
        return fsdp__model_err(ctx, FSDP_EINVAL, "%s: opts.backend is \"%s\" (sim or gloo)", who,
                               opts->backend);
    if (gloo && !fsdp_gloo_available())
        return fsdp__model_err(ctx, FSDP_ENOTSUP,
                               "%s: opts.backend is gloo, and this build of "
                               "libfsdp has no Gloo backend",
                               who);
    if (!pg && opts->ranks != 0 && (opts->ranks < 2 || opts->ranks > 1024))
        return fsdp__model_err(ctx, FSDP_EINVAL,
                               "%s: opts.ranks is %d (must be 0, to skip the collectives, or in "
                               "[2, 1024])",
                               who, opts->ranks);
    int ranks = pg ? fsdp_pg_size(pg) : opts->ranks;
    bool shared = pg && ranks > 1; /* rank 0 measures, the others receive */
    bool measures = !pg || fsdp_pg_rank(pg) == 0;
    if (ranks < 2) ranks = 0;
    if (!ctx) {
        /* The measurement needs a context for its device; its messages are logged at the end. */
        if ((rc = fsdp_ctx_create(NULL, &own_ctx)) < 0)
            return fsdp__model_err(NULL, rc, "%s: no context for the measurement", who);
        ctx = own_ctx;
    }
    if (measures) {
        dev = fsdp_ctx_device(ctx);
        if (!dev || fsdp_device_kind(dev) != FSDP_DEVICE_CPU) {
            if ((rc = fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &own_dev)) == 0) dev = own_dev;
        }
        if (rc == 0) rc = measure_device(dev, &cl->compute);
    }
    /* The others wait here, while rank 0 measures alone on the machine. */
    if (shared) {
        res.rc = rc;
        if ((rc = share_result(ctx, who, pg, &res)) < 0) goto out;
    } else if (rc < 0) {
        goto out;
    }

    snprintf(cl->name, sizeof cl->name, "cpu");
    net->nodes = 1;
    net->intra_eff = net->inter_eff = net->tree_eff = 1;
    if (ranks == 0) {
        /* No measurement: one "GPU" per node, links as fast as a copy, no latency. */
        net->gpus_per_node = 1;
        net->intra_bw = cl->compute.mem_bw / 2;
    } else {
        size_t bytes = opts->coll_bytes ? opts->coll_bytes : COLL_LARGE_BYTES;
        coll_times_t t = {NULL, 0, 0, 0};
        t.large_count = bytes / sizeof(float) / (size_t)ranks;
        if (t.large_count == 0) t.large_count = 1;
        if (pg) {
            if ((rc = time_colls(pg, &t)) < 0) {
                rc =
                    fsdp__model_err(ctx, rc, "%s: timing the collectives of opts.pg (%d ranks): %s",
                                    who, ranks, fsdp_strerror(rc));
                goto out;
            }
        } else {
            fsdp_sim_options_t so;
            fsdp_sim_options_init(&so);
            so.world_size = ranks;
            if (gloo && (rc = fsdp_store_create_memory(ctx, &t.store)) < 0) goto out;
            rc = fsdp_sim_run(&so, coll_rank, &t, NULL);
            fsdp_store_destroy(t.store);
            if (rc < 0) {
                rc = fsdp__model_err(ctx, rc, "%s: the %s run of %d ranks failed: %s", who,
                                     gloo ? "gloo" : "sim", ranks, fsdp_strerror(rc));
                goto out;
            }
        }
        fit_net(net, ranks, &t, cl->compute.mem_bw);
    }
    net->nics_per_node = net->gpus_per_node;
    net->nic_bw = net->intra_bw;
    /* The sim group is not a ring: its cost does not grow per hop, so all of it is the base. */
    net->intra_latency = net->inter_latency = 0;

    if (measures) {
        if ((rc = fsdp__net_model_check(ctx, who, net)) == 0)
            rc = fsdp__compute_model_check(ctx, who, &cl->compute);
    }
    if (shared) {
        res.rc = rc;
        rc = share_result(ctx, who, pg, &res);
    }
    if (rc == 0) *out = *cl;
out:
    if (rc < 0 && own_ctx) fsdp__model_err(NULL, rc, "%s", fsdp_ctx_last_error(own_ctx));
    fsdp_device_destroy(own_dev);
    fsdp_ctx_destroy(own_ctx);
    return rc;
}
