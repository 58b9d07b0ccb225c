/* SPDX-License-Identifier: MIT */
/*
 * bench_gpt_step.c: time of one training step of the GPT model on one rank, on the CPU.
 *
 * A step is what a training loop does per batch: zero_grad (set to none), forward, mean
 * cross-entropy loss, backward, AdamW step. The default model is a small GPT-2 (6 blocks,
 * d_model 384, 6 heads, sequence 128, vocabulary 8192, tied head: 13,842,432 parameters) in f32
 * without dropout, trained on batches of 8 sequences with the GPT recipe's AdamW (weight decay
 * on the matrices but the position table, none on vectors: fsdp/gpt_recipe.h).
 * bench/gpt_step_torch.py runs the same model, batch and optimizer (the same two parameter
 * groups) in PyTorch and prints its numbers in the same format, and bench/gpt_step.sh runs both
 * and prints the ratio.
 *
 * The batch is one fixed set of token sequences drawn from a splitmix64 stream of the seed
 * (the Python side draws the same tokens), with the targets the inputs shifted by one, so the
 * loss falls step after step as the model memorises it: the printed losses show that training
 * works and, for a given seed and thread count, are the same from run to run.
 *
 * Reported: the median, minimum and maximum wall-clock time of the timed steps (warm-up steps
 * are run and printed but not counted), tokens per second at the median, the median of each
 * phase of the step, and the allocations and peak memory the library counted per step.
 * Run with --help for the options.
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <fsdp/device.h>
#include <fsdp/mem.h>

#include "bench_util.h"

#define PROG "bench_gpt_step"

typedef struct options {
    bench_common_t c;
    int threads;
} options_t;

/* ---------------------------------------------------------------------------------------- */
/* Helpers */

static int default_threads(void) {
    const char *env = getenv("FSDP_NUM_THREADS");
    if (env && *env) {
        long v = strtol(env, NULL, 10);
        if (v > 0 && v <= 4096) return (int)v;
    }
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    return cores > 0 ? (int)cores : 1;
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: " PROG " [options]\n"
            BENCH_COMMON_USAGE
            "  --threads N     compute threads (default FSDP_NUM_THREADS, else all cores)\n"
            "  --help          this text\n");
}

/* Returns 0 to run, 1 after --help, -1 for bad options. */
static int parse_options(int argc, char **argv, options_t *o) {
    *o = (options_t){.c = bench_common_default(), .threads = default_threads()};
    return bench_parse_args(PROG, argc, argv, INT64_MAX, &o->c, bench_threads_option,
                            &o->threads, usage);
}

/* ---------------------------------------------------------------------------------------- */
/* The benchmark */

typedef struct run {
    fsdp_ctx_t *ctx;
    fsdp_device_t *dev;
    fsdp_module_t *model;
    fsdp_optim_t *opt;
    fsdp_tensor_t *tokens, *targets; /* (B, T) int64 */
} run_t;

static int fail_msg(const run_t *r, const char *what, int rc) {
    fprintf(stderr, PROG ": %s failed: %s (%s)\n", what, fsdp_strerror(rc),
            r->ctx ? fsdp_ctx_last_error(r->ctx) : "");
    return rc;
}

static int setup(run_t *r, const options_t *o) {
    fsdp_ctx_options_t copts;
    fsdp_ctx_options_init(&copts);
    copts.seed = o->c.seed;
    int rc = fsdp_ctx_create(&copts, &r->ctx);
    if (rc < 0) return fail_msg(r, "fsdp_ctx_create", rc);

    fsdp_device_options_t dopts;
    fsdp_device_options_init(&dopts);
    dopts.num_threads = o->threads;
    if ((rc = fsdp_device_create(r->ctx, FSDP_DEVICE_CPU, &dopts, &r->dev)) < 0)
        return fail_msg(r, "fsdp_device_create", rc);
    if ((rc = fsdp_ctx_set_device(r->ctx, r->dev)) < 0)
        return fail_msg(r, "fsdp_ctx_set_device", rc);
    if ((rc = bench_gpt_create(r->ctx, &o->c.m, o->c.seed, &r->model)) < 0)
        return fail_msg(r, "fsdp_gpt_create", rc);
    if ((rc = fsdp_gpt_recipe_create_adamw(r->model, &o->c.adamw, &r->opt)) < 0)
        return fail_msg(r, "creating the optimizer", rc);

    if ((rc = bench_make_batch(r->ctx, &o->c.m, o->c.seed, &r->tokens, &r->targets)) < 0)
        return fail_msg(r, "making the batch", rc);
    return 0;
}

static void teardown(run_t *r) {
    fsdp_tensor_release(r->tokens);
    fsdp_tensor_release(r->targets);
    fsdp_optim_destroy(r->opt);
    fsdp_module_release(r->model);
    if (r->ctx && r->dev) fsdp_ctx_set_device(r->ctx, NULL);
    fsdp_device_destroy(r->dev);
    fsdp_ctx_destroy(r->ctx);
}

static int gpt_loss(void *arg, fsdp_tensor_t **loss) {
    run_t *r = arg;
    return fsdp_gpt_forward_loss(r->model, r->tokens, r->targets, loss, NULL);
}

/* One training step; ph[] receives the seconds of each phase, *loss the loss. */
static int train_step(run_t *r, double ph[PH_COUNT], double *loss) {
    const char *failed = NULL;
    int rc = bench_train_step(r->opt, gpt_loss, r, ph, loss, &failed);
    return rc < 0 ? fail_msg(r, failed, rc) : 0;
}

int main(int argc, char **argv) {
    options_t o;
    int prc = parse_options(argc, argv, &o);
    if (prc != 0) return prc > 0 ? 0 : 2;
    /* Before any device exists, so that every device the library creates uses the count. */
    char nbuf[32];
    snprintf(nbuf, sizeof nbuf, "%d", o.threads);
    setenv("FSDP_NUM_THREADS", nbuf, 1);

    run_t r = {0};
    double *times[PH_COUNT] = {NULL};
    int status = 1;
    if (setup(&r, &o) < 0) goto out;
    for (int p = 0; p < PH_COUNT; p++)
        if (!(times[p] = calloc((size_t)o.c.steps, sizeof(double)))) goto out;

    int64_t nparams = fsdp_module_num_params(r.model);
    double tokens = (double)(o.c.m.batch * o.c.m.seq);
    printf("# bench_gpt_step: libfsdp, GPT %lld layers, d %lld, %lld heads, seq %lld, batch %lld, "
           "vocab %lld, f32, %d threads\n",
           (long long)o.c.m.layers, (long long)o.c.m.d, (long long)o.c.m.heads,
           (long long)o.c.m.seq,
           (long long)o.c.m.batch, (long long)o.c.m.vocab, o.threads);
    printf("# params %lld\n", (long long)nparams);
    printf("# AdamW lr %g betas (%g, %g) eps %g weight_decay %g (" BENCH_DECAY_NOTE "); seed "
           "%llu; %d warm-up + %d timed steps\n",
           o.c.adamw.lr, o.c.adamw.beta1, o.c.adamw.beta2, o.c.adamw.eps, o.c.adamw.weight_decay,
           (unsigned long long)o.c.seed, o.c.warmup, o.c.steps);
    fflush(stdout);

    size_t allocs_sum = 0;
    fsdp_mem_stats_t ms;
    fsdp_mem_reset_peaks(r.ctx);
    for (int s = 0; s < o.c.warmup + o.c.steps; s++) {
        double ph[PH_COUNT], loss = NAN;
        fsdp_mem_get_stats(r.ctx, &ms);
        size_t a0 = ms.allocs;
        if (train_step(&r, ph, &loss) < 0) goto out;
        fsdp_mem_get_stats(r.ctx, &ms);
        bool timed = s >= o.c.warmup;
        if (timed) {
            for (int p = 0; p < PH_COUNT; p++)
                times[p][s - o.c.warmup] = ph[p];
            allocs_sum += ms.allocs - a0;
        }
        printf("step %3d%s loss %.6f  ms %.1f\n", s + 1, timed ? "        " : " (warmup)", loss,
               ph[PH_STEP] * 1e3);
        fflush(stdout);
        if (!isfinite(loss)) {
            fprintf(stderr, PROG ": the loss is not finite\n");
            goto out;
        }
    }

    double step_min = times[PH_STEP][0], step_max = times[PH_STEP][0];
    for (int i = 1; i < o.c.steps; i++) {
        if (times[PH_STEP][i] < step_min) step_min = times[PH_STEP][i];
        if (times[PH_STEP][i] > step_max) step_max = times[PH_STEP][i];
    }
    double med[PH_COUNT];
    for (int p = 0; p < PH_COUNT; p++)
        med[p] = bench_median(times[p], o.c.steps);
    printf("phases median ms:");
    for (int p = 0; p < PH_STEP; p++)
        printf(" %s %.1f", bench_phase_name[p], med[p] * 1e3);
    printf("\n");
    fsdp_mem_get_stats(r.ctx, &ms);
    printf("memory: %.1f allocations/step, peak %.1f MiB (params %.1f, grads %.1f, optim %.1f, "
           "activations %.1f)\n",
           (double)allocs_sum / o.c.steps, (double)ms.total_peak / 1048576.0,
           (double)ms.peak[FSDP_MEM_PARAMS] / 1048576.0,
           (double)ms.peak[FSDP_MEM_GRADS] / 1048576.0,
           (double)ms.peak[FSDP_MEM_OPTIM] / 1048576.0,
           (double)ms.peak[FSDP_MEM_ACTIVATIONS] / 1048576.0);
    printf("ms/step median %.2f (min %.2f, max %.2f) over %d steps\n", med[PH_STEP] * 1e3,
           step_min * 1e3, step_max * 1e3, o.c.steps);
    printf("tokens/s %.0f\n", tokens / med[PH_STEP]);
    status = 0;
out:
    for (int p = 0; p < PH_COUNT; p++)
        free(times[p]);
    teardown(&r);
    return status;
}
