/* SPDX-License-Identifier: MIT */
/*
 * fsdp-sim.c: how fast and how big an FSDP training step is on a GPU cluster, simulated here.
 *
 * For every world size (--gpus 8,64,512) and sharding strategy (--strategy full,hybrid) asked
 * for, sim_run.c runs one representative rank of the real runtime on a simulator (fsdp/vsim.h)
 * and this file prints a table, JSON lines (--json) and, through gnuplot, scaling curves and a
 * memory breakdown (--plot). docs/simulation.md explains the model, the presets and the
 * validation against published figures.
 */
#include <errno.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/launch.h>

#include "tools/sim.h"

#define MAX_POINTS 64

typedef struct opts {
    sim_config_t base;
    int gpus[MAX_POINTS];
    int ngpus;
    int strategies[8]; /* fsdp_sharding_strategy_t */
    int nstrategies;
    bool json;
    const char *plot;
    int64_t shape[6];   /* the shape options given (0: not), in shape_opts' order */
    sim_model_t custom; /* the preset with them applied */
    char custom_name[96];
} opts_t;

/* The shape options: each overrides one field of the model preset. */
static const struct shape_opt {
    const char *name;
    size_t offset;
    int lo, hi;
} shape_opts[] = {
    {"--layers", offsetof(sim_model_t, n_layer), 1, 100000},
    {"--d-model", offsetof(sim_model_t, d_model), 1, 1 << 20},
    {"--heads", offsetof(sim_model_t, n_head), 1, 1 << 16},
    {"--d-ff", offsetof(sim_model_t, d_ff), 1, 1 << 24},
    {"--vocab", offsetof(sim_model_t, vocab), 1, 1 << 24},
    {"--seq", offsetof(sim_model_t, seq), 1, 1 << 20},
};

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: fsdp-sim [options]\n"
        "Simulates FSDP training steps of a GPT preset on a GPU cluster and prints the step\n"
        "time, TFLOPS per GPU, MFU, communication and peak memory per rank.\n"
        "  --model NAME            model preset (default gpt2; --list shows them)\n"
        "  --layers N --d-model N --heads N --d-ff N --vocab N --seq N\n"
        "                          override the preset's shape (d-ff: 4 d-model by default)\n"
        "  --cluster NAME          cluster preset (default dgx-a100-80gb)\n"
        "  --gpus N[,N...]         world sizes to simulate (default 8)\n"
        "  --gpus-per-node N       GPUs per node (default 8)\n"
        "  --rank R                the simulated rank (default 0)\n"
        "  --batch N               sequences per GPU (default 1)\n"
        "  --strategy S[,S...]     full, grad-op, no-shard, hybrid, hybrid-zero2 (default full)\n"
        "  --shard-group N         hybrid: ranks per shard group (default: one node)\n"
        "  --prefetch P            backward prefetch: pre, post or none (default pre)\n"
        "  --forward-prefetch      prefetch the next unit in the forward too\n"
        "  --no-contention         collectives take no SMs from the kernels they overlap\n"
        "                          (the presets: NCCL's channels, docs/cluster-model.md)\n"
        "  --limit N               all-gathers in flight at most (default 2; 0: no limit)\n"
        "  --precision P           fp32, bf16 or fp16 (default bf16)\n"
        "  --activation-checkpointing  recompute each block in the backward\n"
        "  --grad-clip X           clip the gradient norm to X before the step (default 0: off)\n"
        "  --kernels K             libfsdp (its kernels widen f16/bf16 to f32) or native (half\n"
        "                          kernels as PyTorch's; default libfsdp)\n"
        "  --backend B             cluster cpu: the ranks' process group, sim (threads, the\n"
        "                          default) or gloo (Gloo's transport): whose collectives the\n"
        "                          calibration times. Under fsdprun -n N (--gpus N) the N\n"
        "                          processes time them, as fsdp-train's ranks run there;\n"
        "                          rank 0 prints\n"
        "  --kernel-times T        cluster cpu: measured (each call timed on this CPU, the\n"
        "                          default) or roofline (the calibrated rates)\n"
        "  --trace FILE.json       the measured step's trace in simulated time (one "
        "configuration)\n"
        "  --json                  one JSON object per line instead of the table\n"
        "  --plot FILE.svg         TFLOPS per GPU against GPUs per strategy, and peak memory\n"
        "                          per category (needs gnuplot)\n"
        "  --list                  the model and cluster presets\n"
        "  --version, --help\n");
}

static int bad(const char *opt, const char *val, const char *why) {
    fprintf(stderr, "fsdp-sim: %s %s: %s\n", opt, val ? val : "(missing)", why);
    return 2;
}

static int parse_int(const char *s, int lo, int hi, int *out) {
    if (!s || !*s) return -1;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < lo || v > hi) return -1;
    *out = (int)v;
    return 0;
}

/* A word of a fixed set: the value of `name` in names (NULL-terminated), or -1. */
typedef struct choice {
    const char *name;
    int value;
} choice_t;

static int choose(const char *v, const choice_t *names, int *out) {
    for (; v && names->name; names++)
        if (strcmp(v, names->name) == 0) {
            *out = names->value;
            return 0;
        }
    return -1;
}

static const choice_t strategies[] = {{"full", FSDP_FULL_SHARD},
                                      {"grad-op", FSDP_SHARD_GRAD_OP},
                                      {"no-shard", FSDP_NO_SHARD},
                                      {"hybrid", FSDP_HYBRID_SHARD},
                                      {"hybrid-zero2", FSDP_HYBRID_SHARD_ZERO2},
                                      {NULL, 0}};
static const choice_t prefetches[] = {{"pre", FSDP_BACKWARD_PRE},
                                      {"post", FSDP_BACKWARD_POST},
                                      {"none", FSDP_BACKWARD_PREFETCH_NONE},
                                      {NULL, 0}};
static const choice_t precisions[] = {
    {"fp32", FSDP_DTYPE_F32}, {"bf16", FSDP_DTYPE_BF16}, {"fp16", FSDP_DTYPE_F16}, {NULL, 0}};
static const choice_t kernel_libs[] = {{"libfsdp", 0}, {"native", 1}, {NULL, 0}};
static const choice_t kernel_times[] = {{"roofline", 0}, {"measured", 1}, {NULL, 0}};

/* Parses the comma-separated items of v into out[0..max) with item(); *n gets their number.
 * -1 for an empty list, too many items or a bad one. */
static int parse_list(const char *v, int max, int *out, int *n, int (*item)(const char *, int *)) {
    char *dup = v ? strdup(v) : NULL, *save = NULL;
    int rc = dup ? 0 : -1;
    *n = 0;
    for (char *t = dup ? strtok_r(dup, ",", &save) : NULL; t && rc == 0;
         t = strtok_r(NULL, ",", &save))
        rc = *n < max && item(t, &out[*n]) == 0 ? (++*n, 0) : -1;
    free(dup);
    return rc == 0 && *n > 0 ? 0 : -1;
}

static int world_item(const char *t, int *out) {
    return parse_int(t, 1, 1 << 20, out);
}

static int strategy_item(const char *t, int *out) {
    return choose(t, strategies, out);
}

static void list_presets(void) {
    printf("models:\n");
    for (size_t i = 0; i < sim_model_count(); i++) {
        const sim_model_t *m = sim_model_at(i);
        printf("  %-13s %6.2fB params, %3lld layers, d_model %5lld, seq %4lld: %s\n", m->name,
               sim_model_params(m) / 1e9, (long long)m->n_layer, (long long)m->d_model,
               (long long)m->seq, m->summary);
    }
    printf("clusters:\n");
    for (size_t i = 0; i < fsdp_cluster_preset_count(); i++)
        printf("  %-15s %s\n", fsdp_cluster_preset_name(i), fsdp_cluster_preset_summary(i));
    printf("  %-15s %s\n", "cpu", "this machine, its ranks sim threads (calibrated at start)");
}

static const struct shape_opt *shape_opt(const char *a) {
    for (size_t k = 0; k < sizeof shape_opts / sizeof shape_opts[0]; k++)
        if (!strcmp(a, shape_opts[k].name)) return &shape_opts[k];
    return NULL;
}

static int parse(int argc, char **argv, opts_t *o) {
    memset(o, 0, sizeof *o);
    sim_config_t *c = &o->base;
    c->model = sim_model_find("gpt2");
    c->cluster = "dgx-a100-80gb";
    c->gpus_per_node = 8;
    c->batch = 1;
    c->prefetch = FSDP_BACKWARD_PRE;
    c->limit = 2;
    c->dtype = FSDP_DTYPE_BF16;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int n;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            exit(0);
        } else if (!strcmp(a, "--version")) {
            printf("fsdp-sim (libfsdp) %s\n%s\n", fsdp_version_string(), fsdp_build_info());
            exit(0);
        } else if (!strcmp(a, "--list")) {
            list_presets();
            exit(0);
        } else if (!strncmp(a, "--", 2) && shape_opt(a)) {
            const struct shape_opt *so = shape_opt(a);
            int x;
            if (parse_int(v, so->lo, so->hi, &x) < 0) return bad(a, v, "needs an integer in range");
            o->shape[so - shape_opts] = x;
            i++;
        } else if (!strcmp(a, "--model")) {
            if (!v || !(c->model = sim_model_find(v)))
                return bad(a, v, "unknown model (fsdp-sim --list shows them)");
            i++;
        } else if (!strcmp(a, "--cluster")) {
            if (!v) return bad(a, v, "needs a preset name");
            c->cluster = argv[++i];
        } else if (!strcmp(a, "--gpus")) {
            if (parse_list(v, MAX_POINTS, o->gpus, &o->ngpus, world_item) < 0)
                return bad(a, v, "needs up to 64 world sizes >= 1, separated by commas");
            i++;
        } else if (!strcmp(a, "--gpus-per-node")) {
            if (parse_int(v, 1, 1024, &c->gpus_per_node) < 0) return bad(a, v, "needs 1..1024");
            i++;
        } else if (!strcmp(a, "--rank")) {
            if (parse_int(v, 0, INT_MAX, &c->rank) < 0) return bad(a, v, "needs a rank >= 0");
            i++;
        } else if (!strcmp(a, "--batch")) {
            if (parse_int(v, 1, 1 << 20, &n) < 0) return bad(a, v, "needs a batch >= 1");
            c->batch = n;
            i++;
        } else if (!strcmp(a, "--strategy")) {
            if (parse_list(v, 8, o->strategies, &o->nstrategies, strategy_item) < 0)
                return bad(a, v,
                           "strategies are full, grad-op, no-shard, hybrid, hybrid-zero2, up to "
                           "8 separated by commas");
            i++;
        } else if (!strcmp(a, "--shard-group")) {
            if (parse_int(v, 1, 1 << 20, &c->shard_group) < 0) return bad(a, v, "needs >= 1");
            i++;
        } else if (!strcmp(a, "--prefetch")) {
            if (choose(v, prefetches, &n) < 0) return bad(a, v, "is pre, post or none");
            c->prefetch = (fsdp_backward_prefetch_t)n;
            i++;
        } else if (!strcmp(a, "--forward-prefetch")) {
            c->forward_prefetch = true;
        } else if (!strcmp(a, "--no-contention")) {
            c->no_contention = true;
        } else if (!strcmp(a, "--limit")) {
            if (parse_int(v, 0, 1 << 20, &c->limit) < 0) return bad(a, v, "needs >= 0");
            i++;
        } else if (!strcmp(a, "--precision")) {
            if (choose(v, precisions, &n) < 0) return bad(a, v, "is fp32, bf16 or fp16");
            c->dtype = (fsdp_dtype_t)n;
            i++;
        } else if (!strcmp(a, "--activation-checkpointing")) {
            c->act_ckpt = true;
        } else if (!strcmp(a, "--grad-clip")) {
            char *end = NULL;
            c->grad_clip = v ? strtod(v, &end) : -1;
            if (!v || *end || !(c->grad_clip >= 0)) return bad(a, v, "needs a number >= 0");
            i++;
        } else if (!strcmp(a, "--kernels")) {
            if (choose(v, kernel_libs, &n) < 0) return bad(a, v, "is libfsdp or native");
            c->lowp_kernels = n != 0;
            i++;
        } else if (!strcmp(a, "--backend")) {
            if (!v || (strcmp(v, "sim") != 0 && strcmp(v, "gloo") != 0))
                return bad(a, v, "is sim or gloo");
            c->backend = argv[++i];
        } else if (!strcmp(a, "--kernel-times")) {
            if (choose(v, kernel_times, &n) < 0) return bad(a, v, "is measured or roofline");
            c->kernel_times = n ? SIM_KERNELS_MEASURED : SIM_KERNELS_ROOFLINE;
            i++;
        } else if (!strcmp(a, "--json")) {
            o->json = true;
        } else if (!strcmp(a, "--trace")) {
            if (!v) return bad(a, v, "needs a file name");
            c->trace = argv[++i];
        } else if (!strcmp(a, "--plot")) {
            if (!v) return bad(a, v, "needs a file name");
            o->plot = argv[++i];
        } else {
            fprintf(stderr, "fsdp-sim: unknown option %s\n", a);
            usage(stderr);
            return 2;
        }
    }
    /* The shape options apply to the preset, whichever order they came in. */
    bool custom = false;
    o->custom = *c->model;
    for (size_t k = 0; k < sizeof shape_opts / sizeof shape_opts[0]; k++)
        if (o->shape[k]) {
            *(int64_t *)((char *)&o->custom + shape_opts[k].offset) = o->shape[k];
            custom = true;
        }
    if (custom) {
        if (o->custom.d_model % o->custom.n_head != 0)
            return bad("--heads", NULL, "must divide --d-model");
        snprintf(o->custom_name, sizeof o->custom_name, "%s-custom", c->model->name);
        o->custom.name = o->custom_name;
        o->custom.summary = "a preset with its shape overridden";
        c->model = &o->custom;
    }
    if (!o->ngpus) o->gpus[o->ngpus++] = 8;
    if (!o->nstrategies) o->strategies[o->nstrategies++] = FSDP_FULL_SHARD;
    bool cpu = strcmp(c->cluster, "cpu") == 0;
    if (c->kernel_times == SIM_KERNELS_MEASURED && !cpu)
        return bad("--kernel-times", "measured",
                   "times calls on this CPU: only with --cluster cpu");
    if (c->backend && !cpu)
        return bad("--backend", c->backend,
                   "calibrates this CPU's collectives: only with --cluster cpu");
    if (c->kernel_times == SIM_KERNELS_DEFAULT)
        c->kernel_times = cpu ? SIM_KERNELS_MEASURED : SIM_KERNELS_ROOFLINE;
    if (c->trace && o->ngpus * o->nstrategies != 1)
        return bad("--trace", c->trace, "traces one configuration: give one --gpus and strategy");
    return 0;
}

static double gib(size_t b) {
    return (double)b / 1073741824.0;
}

static void print_header(const opts_t *o) {
    const sim_config_t *c = &o->base;
    printf("fsdp-sim: %s (%.2fB parameters, seq %lld), %lld sequence%s per GPU, %s, cluster %s "
           "(%d GPUs a node), %s kernels%s, %s%sbackward prefetch %s%s, limit %d%s%s\n",
           c->model->name, sim_model_params(c->model) / 1e9, (long long)c->model->seq,
           (long long)c->batch, c->batch == 1 ? "" : "s", fsdp_dtype_name(c->dtype), c->cluster,
           c->gpus_per_node, c->lowp_kernels ? "native" : "libfsdp",
           c->kernel_times == SIM_KERNELS_MEASURED ? " (times measured on this CPU)" : "",
           c->backend ? c->backend : "", c->backend ? " collectives, " : "",
           fsdp_backward_prefetch_name(c->prefetch), c->forward_prefetch ? " + forward" : "",
           c->limit, c->act_ckpt ? ", activation checkpointing" : "",
           c->no_contention ? ", no contention" : "");
    printf("%6s %-14s %9s %7s %7s %6s %8s %8s %8s | %-42s %7s\n", "GPUs", "strategy", "step s",
           "TFLOPS", "hw TF", "MFU", "comm s", "exposed", "compute",
           "peak GiB: total params grads optim act comm", "sim s");
}

static void print_row(const sim_config_t *c, const sim_result_t *r) {
    const size_t *p = r->mem.peak;
    printf("%6d %-14s %9.4f %7.1f %7.1f %5.1f%% %8.4f %8.4f %8.4f | %6.2f %6.2f %6.2f %6.2f %6.2f "
           "%6.2f %7.2f%s\n",
           c->gpus, fsdp_sharding_strategy_name(c->strategy), r->step, r->tflops, r->hw_tflops,
           100 * r->mfu, r->comm, r->exposed, r->compute, gib(r->mem.total_peak),
           gib(p[FSDP_MEM_PARAMS]), gib(p[FSDP_MEM_GRADS]), gib(p[FSDP_MEM_OPTIM]),
           gib(p[FSDP_MEM_ACTIVATIONS]), gib(p[FSDP_MEM_COMM]), r->wall,
           r->mem.total_peak > r->mem_capacity ? "  (over the GPU's memory)" : "");
}

static void print_json(const sim_config_t *c, const sim_result_t *r) {
    printf("{\"model\":\"%s\",\"params\":%.0f,\"cluster\":\"%s\",\"gpus\":%d,\"gpus_per_node\":%d,"
           "\"batch\":%lld,\"seq\":%lld,\"dtype\":\"%s\",\"strategy\":\"%s\","
           "\"backward_prefetch\":\"%s\",\"forward_prefetch\":%s,\"contention\":%s,"
           "\"limit_all_gathers\":%d,"
           "\"activation_checkpointing\":%s,\"kernels\":\"%s\",\"kernel_times\":\"%s\","
           "\"measured_calls\":%zu,\"backend\":\"%s\",\"cpu_slowdown\":%.4g,\"step_s\":%.6g,"
           "\"tflops_per_gpu\":%"
           ".6g,"
           "\"hw_tflops_per_gpu\":%.6g,\"mfu\":%.6g,\"compute_s\":%.6g,\"comm_s\":%.6g,"
           "\"exposed_comm_s\":%.6g,\"contention_s\":%.6g,\"model_flops\":%.6g,\"hw_flops\":%.6g,"
           "\"peak_bytes\":{",
           c->model->name, r->params, c->cluster, c->gpus, r->gpus_per_node, (long long)c->batch,
           (long long)c->model->seq, fsdp_dtype_name(c->dtype),
           fsdp_sharding_strategy_name(c->strategy), fsdp_backward_prefetch_name(c->prefetch),
           c->forward_prefetch ? "true" : "false", c->no_contention ? "false" : "true", c->limit,
           c->act_ckpt ? "true" : "false", c->lowp_kernels ? "native" : "libfsdp",
           c->kernel_times == SIM_KERNELS_MEASURED ? "measured" : "roofline", r->measured_calls,
           c->backend ? c->backend : "sim", r->slowdown, r->step, r->tflops, r->hw_tflops, r->mfu,
           r->compute, r->comm, r->exposed, r->contention, r->model_flops, r->hw_flops);
    for (int k = 0; k < FSDP_MEM_NCAT; k++)
        printf("\"%s\":%zu,", fsdp_mem_cat_name((fsdp_mem_cat_t)k), r->mem.peak[k]);
    printf("\"total\":%zu},\"coll\":{", r->mem.total_peak);
    for (int k = 0; k < FSDP_COLL_COUNT; k++)
        printf("%s\"%s\":{\"bytes\":%.0f,\"s\":%.6g}", k ? "," : "",
               fsdp_coll_name((fsdp_coll_kind_t)k), r->coll_bytes[k], r->coll_time[k]);
    printf("},\"kernels\":%llu,\"kernel_s\":{", (unsigned long long)r->kernels);
    for (int k = 0; k < FSDP_KERNEL_CLASS_COUNT; k++)
        printf("%s\"%s\":%.6g", k ? "," : "", fsdp_kernel_class_name((fsdp_kernel_class_t)k),
               r->class_time[k]);
    printf("},\"sim_wall_s\":%.4g}\n", r->wall);
}

/*
 * Under a launcher (fsdprun -n N, torchrun, srun, mpirun) the calibration of --cluster cpu times
 * the collectives of the launched processes, as fsdp-train's ranks are when launched the same
 * way (fsdp_calibrate_options_t.pg): rank 0 simulates and prints, and the other ranks only take
 * their part in its calibrations. Sets *ctx to the rank's context (NULL outside a launcher).
 * Returns 0, or the exit status of a usage error.
 */
static int join_launched_world(opts_t *o, fsdp_ctx_t **ctx) {
    fsdp_launch_env_t le;
    char msg[512];
    *ctx = NULL;
    if (fsdp_launch_env_read(&le, msg, sizeof msg) == 0 && strcmp(le.source, "none") == 0 &&
        !getenv("MASTER_ADDR"))
        return 0;
    sim_config_t *c = &o->base;
    if (strcmp(c->cluster, "cpu") != 0 || !c->backend || strcmp(c->backend, "gloo") != 0) {
        fprintf(stderr, "fsdp-sim: under a launcher its processes calibrate the network: give "
                        "--cluster cpu --backend gloo (or run fsdp-sim alone)\n");
        return 2;
    }
    if (setenv("FSDP_BACKEND", "gloo", 1) != 0) {
        fprintf(stderr, "fsdp-sim: cannot set FSDP_BACKEND\n");
        return 1;
    }
    if (fsdp_init_from_env(NULL, ctx, msg, sizeof msg) < 0) {
        fprintf(stderr, "fsdp-sim: joining the launched world: %s\n", msg);
        return 1;
    }
    int world = fsdp_ctx_world_size(*ctx);
    for (int g = 0; g < o->ngpus; g++)
        if (o->gpus[g] != world) {
            if (fsdp_ctx_rank(*ctx) == 0)
                fprintf(stderr,
                        "fsdp-sim: --gpus %d: the launcher started %d processes, whose "
                        "collectives are timed: give --gpus %d\n",
                        o->gpus[g], world, world);
            fsdp_ctx_destroy(*ctx);
            *ctx = NULL;
            return 2;
        }
    c->pg = fsdp_ctx_pg(*ctx);
    return 0;
}

/* Configuration k of the o->nstrategies x o->ngpus asked for, strategy by strategy. */
static sim_config_t config_at(const opts_t *o, int k) {
    sim_config_t c = o->base;
    c.gpus = o->gpus[k % o->ngpus];
    c.strategy = (fsdp_sharding_strategy_t)o->strategies[k / o->ngpus];
    if (c.rank >= c.gpus) c.rank = c.gpus - 1;
    return c;
}

/* A rank other than 0 of a launched world: its part in each of rank 0's calibrations, one per
 * configuration, in the same order. */
static int calibrate_peer(fsdp_ctx_t *ctx, const opts_t *o) {
    for (int k = 0; k < o->ngpus * o->nstrategies; k++) {
        char err[512] = "";
        sim_config_t c = config_at(o, k);
        if (sim_calibrate_peer(ctx, &c, err, sizeof err) < 0) {
            fprintf(stderr, "fsdp-sim: rank %d: %s\n", fsdp_ctx_rank(ctx), err);
            return 1;
        }
    }
    return 0;
}

int main(int argc, char **argv) {
    opts_t o;
    fsdp_ctx_t *world = NULL;
    int rc = parse(argc, argv, &o);
    if (rc) return rc;
    if ((rc = join_launched_world(&o, &world)) != 0) return rc;
    if (world && fsdp_ctx_rank(world) != 0) {
        rc = calibrate_peer(world, &o);
        /* Rank 0 serves the store: the world ends together (fsdp/launch.h). */
        fsdp_pg_barrier(fsdp_ctx_pg(world), NULL);
        fsdp_ctx_destroy(world);
        return rc;
    }
    int n = o.ngpus * o.nstrategies;
    sim_config_t *cfgs = calloc((size_t)n, sizeof *cfgs);
    sim_result_t *res = calloc((size_t)n, sizeof *res);
    if (!cfgs || !res) {
        fprintf(stderr, "fsdp-sim: out of memory\n");
        return 1;
    }
    if (!o.json) print_header(&o);
    int failed = 0;
    for (int k = 0; k < n; k++) {
        cfgs[k] = config_at(&o, k);
        if (sim_run(&cfgs[k], &res[k]) < 0) {
            fprintf(stderr, "fsdp-sim: %d GPUs, %s: %s\n", cfgs[k].gpus,
                    fsdp_sharding_strategy_name(cfgs[k].strategy), res[k].error);
            failed++;
            continue;
        }
        if (o.json)
            print_json(&cfgs[k], &res[k]);
        else
            print_row(&cfgs[k], &res[k]);
        fflush(stdout);
    }
    if (!failed && o.plot) {
        char title[160];
        snprintf(title, sizeof title, "%s, %lld seq/GPU, %s, %s", o.base.model->name,
                 (long long)o.base.batch, fsdp_dtype_name(o.base.dtype), o.base.cluster);
        if (sim_plot(o.plot, title, cfgs, res, n) < 0) failed++;
    }
    free(cfgs);
    free(res);
    if (world) {
        fsdp_pg_barrier(fsdp_ctx_pg(world), NULL);
        fsdp_ctx_destroy(world);
    }
    return failed ? 1 : 0;
}
