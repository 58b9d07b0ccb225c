/* SPDX-License-Identifier: MIT */
/*
 * bench_gpt_gloo.c: one FSDP training step of the GPT model, one rank per process, over the gloo
 * backend. Run it under a launcher:
 *
 *     tools/fsdprun -n 2 bench/bench_gpt_gloo
 *
 * Each process makes its rank with fsdp_init_from_env (RANK, WORLD_SIZE, FSDP_STORE), builds
 * the GPT model of bench_gpt_step (same shape options and defaults: 6 blocks, d_model 384, 6
 * heads, sequence 128, vocabulary 8192, tied head, 13,842,432 parameters; f32, no dropout) and
 * wraps it with FSDP FULL_SHARD (--strategy no-shard: NO_SHARD, for the cost of sharding alone)
 * by the GPT recipe (fsdp/gpt_recipe.h, as fsdp-train): every
 * GPTBlock a unit of its own and the root keeping the embeddings and the final norm, with
 * use_orig_params (backward prefetch BACKWARD_PRE, limit_all_gathers 2, as bench_fsdp_step).
 * The recipe's AdamW steps over the original parameters in two groups: weight decay on the
 * matrices but the position table, none on vectors. bench/gpt_gloo_torch.py is the PyTorch DDP
 * twin (the same two groups), bench/gpt_gloo.sh runs both and prints the ratios.
 *
 * Every rank builds the model from the same seed (its random stream is reset to (seed, 0)), so
 * the initial weights agree without a broadcast, and trains on its own fixed batch drawn from
 * splitmix64(seed + rank), as bench_fsdp_step draws it. A step is zero_grad (set to none),
 * forward, mean cross-entropy, backward, AdamW step; every step starts after a barrier, and a
 * step's time is the slowest rank's.
 *
 * Only rank 0 prints (fsdprun --no-prefix keeps the lines bare): the loss of every step (the
 * mean over the ranks), the medians of the phases, the median, minimum and maximum step time,
 * tokens per second over all ranks, the library's peak memory by category (the largest rank),
 * and each rank's peak resident set size (VmHWM of /proc/self/status, read after the last
 * step) with their maximum. Run with --help for the options.
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <fsdp.h>

#include "bench_util.h"

#define PROG "bench_gpt_gloo"
#define MAX_WORLD 256

typedef struct options {
    bench_common_t c; /* the shape's batch is per rank */
    int threads;      /* 0: FSDP_NUM_THREADS, else the online cores / the world size */
    fsdp_sharding_strategy_t strategy;
} options_t;

static void usage(FILE *f) {
    fprintf(f, "usage: fsdprun -n N " PROG " [options]\n" BENCH_COMMON_USAGE
               "  --threads N     compute threads per rank (default FSDP_NUM_THREADS, else the\n"
               "                  online cores divided by the world size)\n"
               "  --strategy S    full (FULL_SHARD, the default) or no-shard (NO_SHARD)\n"
               "  --help          this text\n"
               "The batch is per rank. Without a launcher the program runs as a world of one.\n");
}

/* --threads (bench_util.h's) and --strategy. */
static int own_option(void *p, const char *prog, const char *opt, const char *val) {
    options_t *o = p;
    if (strcmp(opt, "--strategy") != 0) return bench_threads_option(&o->threads, prog, opt, val);
    if (val && strcmp(val, "full") == 0) {
        o->strategy = FSDP_FULL_SHARD;
    } else if (val && strcmp(val, "no-shard") == 0) {
        o->strategy = FSDP_NO_SHARD;
    } else {
        fprintf(stderr, "%s: --strategy %s: full or no-shard\n", prog, val ? val : "(missing)");
        return -1;
    }
    return 1;
}

/* Returns 0 to run, 1 after --help, -1 for bad options. */
static int parse_options(int argc, char **argv, options_t *o) {
    *o = (options_t){.c = bench_common_default(), .strategy = FSDP_FULL_SHARD};
    return bench_parse_args(PROG, argc, argv, INT64_MAX - MAX_WORLD, &o->c, own_option, o, usage);
}

/* The thread count when --threads is not given: FSDP_NUM_THREADS, else the online cores shared
 * by the ranks of this node (LOCAL_WORLD_SIZE, else WORLD_SIZE, as set by the launcher). */
static int default_threads(void) {
    const char *env = getenv("FSDP_NUM_THREADS");
    if (env && *env) {
        long v = strtol(env, NULL, 10);
        if (v > 0 && v <= 4096) return (int)v;
    }
    const char *lw = getenv("LOCAL_WORLD_SIZE");
    if (!lw || !*lw) lw = getenv("WORLD_SIZE");
    long ranks = lw && *lw ? strtol(lw, NULL, 10) : 1;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    long per = (cores > 0 ? cores : 1) / (ranks > 0 ? ranks : 1);
    return per > 1 ? (int)per : 1;
}

/* ---------------------------------------------------------------------------------------- */
/* The rank */

/* The rank: the model, wrapped as the file's header says. */
static int setup(bench_rank_t *s, const options_t *o) {
    int rc;
    if ((rc = bench_rank_model(s, &o->c.m, o->c.seed)) < 0) return rc;
    fsdp_options_t fo;
    bench_fsdp_options(&fo);
    fo.strategy = o->strategy;
    if ((rc = bench_rank_wrap(s, &o->c.m, &fo)) < 0) return rc;
    return bench_rank_train_setup(s, &o->c.m, &o->c.adamw, o->c.seed);
}

/* Peak resident set size of this process in KiB (VmHWM), or -1 when it cannot be read. */
static double peak_rss_kib(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    double kib = -1;
    if (!f) return -1;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "VmHWM:", 6) == 0) {
            kib = strtod(line + 6, NULL);
            break;
        }
    fclose(f);
    return kib;
}

/* ---------------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
    options_t o;
    int prc = parse_options(argc, argv, &o);
    if (prc != 0) return prc > 0 ? 0 : 2;
    int threads = o.threads > 0 ? o.threads : default_threads();
    /* Before the CPU device exists (it is made on first use), so that it uses the count. */
    char nbuf[32];
    snprintf(nbuf, sizeof nbuf, "%d", threads);
    setenv("FSDP_NUM_THREADS", nbuf, 1);

    bench_rank_t s = {0};
    int rc = bench_rank_init(PROG, &s, o.c.seed);
    if (rc < 0) return 1;
    const int rank = fsdp_ctx_rank(s.ctx), world = fsdp_ctx_world_size(s.ctx);
    const int nsteps = o.c.warmup + o.c.steps;
    fsdp_pg_t *pg = fsdp_ctx_pg(s.ctx);
    double *t = calloc((size_t)nsteps * PH_COUNT, sizeof *t); /* [step][phase], seconds */
    double *loss = calloc((size_t)nsteps, sizeof *loss);
    double *rss = calloc((size_t)world, sizeof *rss); /* KiB, one per rank */
    double *med = calloc(PH_COUNT, sizeof *med);
    int status = 1;
    if (world > MAX_WORLD) {
        fprintf(stderr, PROG ": at most %d ranks\n", MAX_WORLD);
        goto out;
    }
    if (!t || !loss || !rss || !med) {
        fprintf(stderr, PROG ": out of memory\n");
        goto out;
    }
    if (setup(&s, &o) < 0) {
        fprintf(stderr, PROG ": %s\n", s.err);
        goto out;
    }
    if (rank == 0) {
        printf("# " PROG ": libfsdp FSDP %s over gloo, world %d (processes), GPT %lld "
               "layers, d %lld, %lld heads, seq %lld, batch %lld per rank, vocab %lld, f32, %d "
               "thread(s) per rank\n",
               fsdp_sharding_strategy_name(o.strategy), world, (long long)o.c.m.layers,
               (long long)o.c.m.d, (long long)o.c.m.heads, (long long)o.c.m.seq,
               (long long)o.c.m.batch, (long long)o.c.m.vocab, threads);
        bench_print_setup(&s, &o.c);
        fflush(stdout);
    }

    for (int k = 0; k < nsteps; k++) {
        if (k == o.c.warmup) fsdp_mem_reset_peaks(s.ctx);
        /* Every step starts together, so the slowest rank's time is the step's. */
        if ((rc = fsdp_pg_barrier(pg, NULL)) < 0) {
            bench_rank_report(PROG, &s, "barrier", rc);
            goto out;
        }
        const char *failed = NULL;
        rc = bench_train_step(s.opt, bench_rank_loss, &s, &t[(size_t)k * PH_COUNT], &loss[k],
                              &failed);
        if (rc < 0) {
            bench_rank_report(PROG, &s, failed, rc);
            goto out;
        }
    }

    /* Gather the results: the slowest rank's phases, the mean loss, every rank's peaks. */
    double mem[BENCH_MEM_N];
    bench_mem_peaks(s.ctx, mem);
    rss[rank] = peak_rss_kib();
    if ((rc = fsdp_pg_all_gather(pg, &rss[rank], rss, 1, FSDP_DTYPE_F64, NULL)) < 0) {
        bench_rank_report(PROG, &s, "gathering the peak RSS", rc);
        goto out;
    }
    rc = bench_rank_results(&s, PROG, t, loss, nsteps, mem, BENCH_MEM_N);
    if (rc < 0) goto out;
    status = rc;
    if (rank != 0) goto out;

    bench_print_steps(t, loss, o.c.warmup, nsteps);
    double step_min = 0, step_max = 0;
    if (bench_phase_medians(t, o.c.warmup, o.c.steps, med, &step_min, &step_max) < 0) {
        status = 1;
        goto out;
    }
    bench_print_phases_mem("", med, "library-counted peak", mem);
    double rss_max = 0;
    printf("peak RSS MiB per rank:");
    for (int r = 0; r < world; r++) {
        printf(" %.1f", rss[r] / 1024.0);
        if (rss[r] > rss_max) rss_max = rss[r];
    }
    printf("\n");
    printf("peak RSS MiB max %.1f\n", rss_max / 1024.0);
    printf("ms/step median %.2f (min %.2f, max %.2f) over %d steps\n", med[PH_STEP] * 1e3,
           step_min * 1e3, step_max * 1e3, o.c.steps);
    printf("tokens/s %.0f (all ranks)\n", (double)(o.c.m.batch * o.c.m.seq) * world / med[PH_STEP]);
    fflush(stdout);
out:
    bench_rank_teardown(&s);
    fsdp_ctx_destroy(s.ctx);
    free(t);
    free(loss);
    free(rss);
    free(med);
    return status;
}
