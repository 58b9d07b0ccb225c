/* SPDX-License-Identifier: MIT */
/*
 * bench_fsdp_step.c: one training step of the GPT model at world size 2 on the sim backend,
 * with DDP and with FSDP's sharding strategies, one configuration after the other in one
 * process.
 *
 * A step is what bench_gpt_step times on one rank (zero_grad set to none, forward, mean
 * cross-entropy, backward, AdamW step), now on every rank of a sim world (fsdp_sim_run: ranks
 * are threads) with the gradients averaged over the ranks:
 *   DDP            fsdp_ddp_create over the world group; the optimizer steps over the
 *                  module's parameters;
 *   NO_SHARD,      FSDP units by the GPT recipe (fsdp_gpt_recipe_wrap): every GPT block
 *   FULL_SHARD,    ("h.N", module type "GPTBlock") a unit of its own, then the root (which
 *   SHARD_GRAD_OP  keeps the embeddings and the final norm), use_orig_params; backward prefetch
 *                  BACKWARD_PRE, limit_all_gathers 2; the optimizer steps over the original
 *                  parameters (views of the rank's shard).
 * The optimizer is the recipe's AdamW in every configuration: weight decay on the matrices but
 * the position table, none on vectors (fsdp_gpt_recipe_create_adamw).
 * The default model is the one of bench_gpt_step (6 blocks, d_model 384, 6 heads, sequence 128,
 * vocabulary 8192, tied head: 13,842,432 parameters), f32, no dropout, 8 sequences per rank.
 *
 * Every configuration builds the model from the same seed on every rank (the context's random
 * stream is reset to (seed, stream 0) before the model is created), so the initial weights are
 * identical everywhere; rank r trains on its own fixed batch drawn from splitmix64(seed + r),
 * as bench_gpt_step draws its batch. The losses of all configurations must therefore agree: the
 * first step's exactly, later ones up to the rounding of the different gradient reductions.
 *
 * Every configuration runs --rounds times (default 2), the order reversed every other round,
 * so that a machine that slows down or speeds up during the run does not favour the
 * configurations that ran first; the timed steps of all rounds are pooled.
 *
 * Reported per configuration: the median step time (each step's time is the slowest rank's;
 * every step starts after a barrier), the medians of the phases, each rank's peak memory per
 * category after the warm-up steps (the maximum over the ranks is printed), and each rank's
 * parameter + gradient + optimizer-state bytes at the end of a step. Two ratios are checked
 * against targets (FULL_SHARD / NO_SHARD step time, FULL_SHARD / DDP parameter, gradient and
 * optimizer memory), and a second section runs FULL_SHARD with and without prefetching under
 * the sim backend's simulated network latency (fsdp_sim_options_t.comm_latency_us).
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

#include <fsdp.h>

#include "bench_util.h"

#define PROG "bench_fsdp_step"
#define MAX_WORLD 64
#define MAX_ROUNDS 16

/* Targets of the summary (the FULL_SHARD rows). */
#define TARGET_STEP_RATIO 1.15 /* FULL_SHARD step / NO_SHARD step */
#define TARGET_MEM_RATIO 0.55  /* FULL_SHARD (params + grads + optim) / DDP's, at world 2 */
/* A final loss further than this from DDP's (relative) means a bug, not rounding. */
#define LOSS_RTOL 1e-3

/* Memory categories in the table, in this order. */
static const fsdp_mem_cat_t mem_cats[] = {FSDP_MEM_PARAMS,      FSDP_MEM_GRADS, FSDP_MEM_OPTIM,
                                          FSDP_MEM_ACTIVATIONS, FSDP_MEM_COMM,  FSDP_MEM_OFFLOAD};
#define NMEMCATS ((int)(sizeof mem_cats / sizeof mem_cats[0]))
#define ACT 3 /* mem_cats[ACT] is FSDP_MEM_ACTIVATIONS */

typedef struct options {
    bench_common_t c; /* the shape's batch is per rank */
    int world;
    int rounds; /* each configuration runs this many times, alternating the order */
    int64_t latency_us;
    unsigned sections; /* SECTION_* */
} options_t;

enum { SECTION_MAIN = 1, SECTION_PREFETCH = 2, SECTION_AC = 4 };

/* One configuration of the benchmark. */
typedef struct config {
    const char *name;
    bool ddp; /* DDP; otherwise FSDP with the fields below */
    fsdp_sharding_strategy_t strategy;
    fsdp_backward_prefetch_t bp;
    bool fwd_prefetch;
    int64_t latency_us; /* the sim backend's simulated latency */
    bool ac;            /* activation checkpointing of every GPTBlock */
} config_t;

/* A configuration's run: shared by its rank threads, each writing its own slots. */
typedef struct job {
    const options_t *o;
    const bench_gpt_shape_t *m;
    config_t cfg;
    int nsteps;   /* warm-up + timed */
    double *t;    /* [world][nsteps][PH_COUNT] seconds */
    double *loss; /* [world][nsteps] */
    fsdp_mem_stats_t mem[MAX_WORLD];
    size_t pgo_end[MAX_WORLD]; /* params + grads + optim bytes after the last step */
    int64_t nparams;
    size_t nunits[MAX_WORLD];
    char err[MAX_WORLD][sizeof(((bench_rank_t *)0)->err)];
} job_t;

/* The summary of a finished job. */
typedef struct summary {
    double med[PH_COUNT]; /* medians over the timed steps of the slowest rank's phase, s */
    double step_min, step_max;
    double loss_first, loss_last;               /* mean over the ranks */
    size_t peak[NMEMCATS], total_peak, pgo_end; /* max over the ranks, bytes */
} summary_t;

/* ---------------------------------------------------------------------------------------- */
/* Helpers */

/* The compute threads each rank's CPU device uses (what the library picks: FSDP_NUM_THREADS,
 * else the online cores divided by the world size, at least 1). For the header only. */
static int threads_per_rank(int world) {
    const char *env = getenv("FSDP_NUM_THREADS");
    if (env && *env) {
        long v = strtol(env, NULL, 10);
        if (v > 0 && v <= 4096) return (int)v;
    }
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    long per = (cores > 0 ? cores : 1) / (world > 0 ? world : 1);
    return per > 1 ? (int)per : 1;
}

static double mib(size_t bytes) {
    return (double)bytes / 1048576.0;
}

static void usage(FILE *f) {
    fprintf(f, "usage: " PROG " [options]\n" BENCH_COMMON_USAGE
               "  --world N       ranks of the sim world (default 2)\n"
               "  --rounds N      runs of every configuration, in alternating order; the timed\n"
               "                  steps of all rounds are pooled (default 2, at most 16)\n"
               "  --latency-us N  simulated latency of every collective in the prefetch section\n"
               "                  (default 5000; 0 for none)\n"
               "  --only S        run one section only: main (DDP and the strategies),\n"
               "                  prefetch (prefetching under latency) or ac (activation\n"
               "                  checkpointing at 1, 2, 4 and 8 sequences per rank)\n"
               "  --help          this text\n"
               "Compute threads per rank: FSDP_NUM_THREADS, else the online cores / world size.\n");
}

/* bench_fsdp_step's own options (a bench_extra_fn); each takes a value. */
static int own_option(void *arg, const char *prog, const char *opt, const char *val) {
    options_t *o = arg;
    int64_t v = 0;
    if (strcmp(opt, "--world") == 0) {
        if (bench_parse_i64(prog, opt, val, 1, MAX_WORLD, &v) < 0) return -1;
        o->world = (int)v;
    } else if (strcmp(opt, "--rounds") == 0) {
        if (bench_parse_i64(prog, opt, val, 1, MAX_ROUNDS, &v) < 0) return -1;
        o->rounds = (int)v;
    } else if (strcmp(opt, "--latency-us") == 0) {
        if (bench_parse_i64(prog, opt, val, 0, 10000000, &v) < 0) return -1;
        o->latency_us = v;
    } else if (strcmp(opt, "--only") == 0 && val && strcmp(val, "main") == 0) {
        o->sections = SECTION_MAIN;
    } else if (strcmp(opt, "--only") == 0 && val && strcmp(val, "prefetch") == 0) {
        o->sections = SECTION_PREFETCH;
    } else if (strcmp(opt, "--only") == 0 && val && strcmp(val, "ac") == 0) {
        o->sections = SECTION_AC;
    } else if (strcmp(opt, "--only") == 0) {
        fprintf(stderr, PROG ": --only needs main, prefetch or ac, got '%s'\n", val ? val : "");
        return -1;
    } else {
        return strcmp(opt, "--quick") == 0 ? 2 : 0;
    }
    return 1;
}

/* Returns 0 to run, 1 after --help, -1 for bad options. */
static int parse_options(int argc, char **argv, options_t *o) {
    *o = (options_t){.c = bench_common_default(),
                     .world = 2,
                     .rounds = 2,
                     .latency_us = 5000,
                     .sections = SECTION_MAIN | SECTION_PREFETCH | SECTION_AC};
    return bench_parse_args(PROG, argc, argv, INT64_MAX - MAX_WORLD, &o->c, own_option, o, usage);
}

/* ---------------------------------------------------------------------------------------- */
/* One rank of one configuration */

typedef struct rank_state {
    bench_rank_t b; /* first: step_loss gets a rank_state_t through bench_train_step */
    fsdp_ddp_t *ddp;
} rank_state_t;

/* Keeps the rank's first failure (s->b.err, recorded by bench_rank_*) for the job's report. */
static int keep_err(job_t *j, const rank_state_t *s, int rc) {
    int r = fsdp_ctx_rank(s->b.ctx);
    if (!j->err[r][0]) snprintf(j->err[r], sizeof j->err[r], "%s", s->b.err);
    return rc;
}

static int rank_fail(job_t *j, rank_state_t *s, const char *what, int rc) {
    return keep_err(j, s, bench_rank_fail(&s->b, what, rc));
}

static int setup(job_t *j, rank_state_t *s) {
    const options_t *o = j->o;
    const bench_gpt_shape_t *m = j->m;
    int r = fsdp_ctx_rank(s->b.ctx), rc;

    /* The same initial weights on every rank and in every configuration. */
    if ((rc = bench_rank_model(&s->b, m, o->c.seed)) < 0) return keep_err(j, s, rc);
    if (r == 0) j->nparams = s->b.nparams;
    if (!j->cfg.ddp) {
        fsdp_options_t fo;
        bench_fsdp_options(&fo);
        fo.strategy = j->cfg.strategy;
        fo.backward_prefetch = j->cfg.bp;
        fo.forward_prefetch = j->cfg.fwd_prefetch;
        rc = bench_rank_wrap(&s->b, m, &fo);
        j->nunits[r] = s->b.nunits;
        if (rc < 0) return keep_err(j, s, rc);
        if (j->cfg.ac && (rc = fsdp_apply_activation_checkpointing(s->b.model, "GPTBlock", NULL,
                                                                   NULL, NULL)) < 0)
            return rank_fail(j, s, "fsdp_apply_activation_checkpointing", rc);
        rc = bench_rank_train_setup(&s->b, m, &o->c.adamw, o->c.seed);
        return rc < 0 ? keep_err(j, s, rc) : FSDP_OK;
    }
    if ((rc = fsdp_ddp_create(s->b.model, NULL, NULL, &s->ddp)) < 0)
        return rank_fail(j, s, "fsdp_ddp_create", rc);
    rc = bench_rank_train_setup(&s->b, m, &o->c.adamw, o->c.seed);
    return rc < 0 ? keep_err(j, s, rc) : FSDP_OK;
}

static void teardown(rank_state_t *s) {
    fsdp_ddp_destroy(s->ddp); /* before the model it wraps */
    s->ddp = NULL;
    bench_rank_teardown(&s->b);
}

/* The forward and loss of a step, through the DDP wrapper or the FSDP-wrapped model. */
static int step_loss(void *arg, fsdp_tensor_t **loss) {
    rank_state_t *s = arg;
    if (!s->ddp) return bench_rank_loss(&s->b, loss);
    /* What fsdp_gpt_forward_loss does, through the DDP wrapper's forward. */
    fsdp_tensor_t *logits = NULL;
    int rc = fsdp_ddp_forward1(s->ddp, s->b.tokens, &logits);
    if (rc == 0) rc = fsdp_gpt_loss(logits, s->b.targets, loss);
    fsdp_tensor_release(logits);
    return rc;
}

/* One training step; ph[] receives the seconds of each phase, *loss the loss. */
static int train_step(job_t *j, rank_state_t *s, double ph[PH_COUNT], double *loss) {
    const char *failed = NULL;
    int rc = bench_train_step(s->b.opt, step_loss, s, ph, loss, &failed);
    return rc < 0 ? rank_fail(j, s, failed, rc) : FSDP_OK;
}

static int rank_main(fsdp_ctx_t *ctx, void *arg) {
    job_t *j = arg;
    rank_state_t s = {.b = {.ctx = ctx}};
    int r = fsdp_ctx_rank(ctx);
    fsdp_pg_t *world = fsdp_ctx_pg(ctx);
    int rc = setup(j, &s);
    for (int k = 0; rc == FSDP_OK && k < j->nsteps; k++) {
        if (k == j->o->c.warmup) fsdp_mem_reset_peaks(ctx);
        /* Every step starts together, so the slowest rank's time is the step's. */
        if ((rc = fsdp_pg_barrier(world, NULL)) < 0) {
            rank_fail(j, &s, "barrier", rc);
            break;
        }
        double *ph = &j->t[((size_t)r * (size_t)j->nsteps + (size_t)k) * PH_COUNT];
        rc = train_step(j, &s, ph, &j->loss[(size_t)r * (size_t)j->nsteps + (size_t)k]);
    }
    if (rc == FSDP_OK) {
        fsdp_mem_get_stats(ctx, &j->mem[r]);
        j->pgo_end[r] = j->mem[r].current[FSDP_MEM_PARAMS] + j->mem[r].current[FSDP_MEM_GRADS] +
                        j->mem[r].current[FSDP_MEM_OPTIM];
    }
    teardown(&s);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* Running and summarising a configuration */

static void job_free(job_t *j) {
    free(j->t);
    free(j->loss);
    free(j);
}

/* Runs one configuration and prints its steps. Returns the job (NULL on failure). */
static job_t *run_config(const options_t *o, const bench_gpt_shape_t *m, const config_t *cfg,
                         int round) {
    job_t *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    j->o = o;
    j->m = m;
    j->cfg = *cfg;
    j->nsteps = o->c.warmup + o->c.steps;
    j->t = calloc((size_t)o->world * (size_t)j->nsteps * PH_COUNT, sizeof *j->t);
    j->loss = calloc((size_t)o->world * (size_t)j->nsteps, sizeof *j->loss);
    if (!j->t || !j->loss) {
        fprintf(stderr, PROG ": out of memory\n");
        job_free(j);
        return NULL;
    }
    fsdp_sim_options_t so;
    fsdp_sim_options_init(&so);
    so.world_size = o->world;
    so.seed = o->c.seed;
    so.comm_latency_us = cfg->latency_us;
    printf("== %s (round %d of %d)\n", cfg->name, round + 1, o->rounds);
    fflush(stdout);
    int st[MAX_WORLD];
    int rc = fsdp_sim_run(&so, rank_main, j, st);
    if (rc < 0) {
        fprintf(stderr, PROG ": %s failed: %s\n", cfg->name, fsdp_strerror(rc));
        for (int r = 0; r < o->world; r++)
            if (j->err[r][0]) fprintf(stderr, "  %s\n", j->err[r]);
        job_free(j);
        return NULL;
    }
    for (int k = 0; k < j->nsteps; k++) {
        double tmax = 0, lsum = 0;
        for (int r = 0; r < o->world; r++) {
            double t = j->t[((size_t)r * (size_t)j->nsteps + (size_t)k) * PH_COUNT + PH_STEP];
            if (t > tmax) tmax = t;
            lsum += j->loss[(size_t)r * (size_t)j->nsteps + (size_t)k];
        }
        printf("step %3d%s loss %.6f  ms %.1f\n", k + 1,
               k >= o->c.warmup ? "        " : " (warmup)", lsum / o->world, tmax * 1e3);
    }
    fflush(stdout);
    for (int r = 0; r < o->world; r++)
        for (int k = 0; k < j->nsteps; k++)
            if (!isfinite(j->loss[(size_t)r * (size_t)j->nsteps + (size_t)k])) {
                fprintf(stderr, PROG ": %s: the loss of rank %d at step %d is not finite\n",
                        cfg->name, r, k + 1);
                job_free(j);
                return NULL;
            }
    return j;
}

/* Summarises the rounds js[0..nr) of one configuration: the timed steps of all rounds pooled;
 * the losses of the first round (every round trains from the same start); memory maxima. */
static void summarise(job_t *const *js, int nr, summary_t *sm) {
    const options_t *o = js[0]->o;
    const int steps = o->c.steps, nv = nr * steps;
    memset(sm, 0, sizeof *sm);
    double *v = malloc((size_t)nv * sizeof *v);
    for (int p = 0; p < PH_COUNT && v; p++) {
        for (int q = 0; q < nr; q++) {
            const job_t *j = js[q];
            for (int k = 0; k < steps; k++) {
                double tmax = 0;
                for (int r = 0; r < o->world; r++) {
                    size_t i =
                        ((size_t)r * (size_t)j->nsteps + (size_t)(o->c.warmup + k)) * PH_COUNT;
                    if (j->t[i + (size_t)p] > tmax) tmax = j->t[i + (size_t)p];
                }
                v[q * steps + k] = tmax;
            }
        }
        if (p == PH_STEP) {
            sm->step_min = sm->step_max = v[0];
            for (int k = 1; k < nv; k++) {
                if (v[k] < sm->step_min) sm->step_min = v[k];
                if (v[k] > sm->step_max) sm->step_max = v[k];
            }
        }
        sm->med[p] = bench_median(v, nv);
    }
    free(v);
    const job_t *j = js[0];
    for (int r = 0; r < o->world; r++) {
        sm->loss_first += j->loss[(size_t)r * (size_t)j->nsteps] / o->world;
        sm->loss_last += j->loss[(size_t)r * (size_t)j->nsteps + (size_t)j->nsteps - 1] / o->world;
        for (int q = 0; q < nr; q++) {
            const job_t *jq = js[q];
            for (int c = 0; c < NMEMCATS; c++)
                if (jq->mem[r].peak[mem_cats[c]] > sm->peak[c])
                    sm->peak[c] = jq->mem[r].peak[mem_cats[c]];
            if (jq->mem[r].total_peak > sm->total_peak) sm->total_peak = jq->mem[r].total_peak;
            if (jq->pgo_end[r] > sm->pgo_end) sm->pgo_end = jq->pgo_end[r];
        }
    }
}

/*
 * Runs the n configurations cfgs on model m o->rounds times, in the given order in even rounds
 * and in reverse order in odd ones (so that a slow drift of the machine does not favour one
 * configuration), and summarises each over its rounds into sm[i]. jobs[q * n + i] is round q
 * of configuration i. Returns 0, or -1 when a run failed.
 */
static int run_rounds(const options_t *o, const bench_gpt_shape_t *m, const config_t *cfgs, int n,
                      job_t **jobs, summary_t *sm) {
    for (int q = 0; q < o->rounds; q++)
        for (int k = 0; k < n; k++) {
            int i = q % 2 ? n - 1 - k : k;
            if (!(jobs[q * n + i] = run_config(o, m, &cfgs[i], q))) return -1;
        }
    job_t *mine[MAX_ROUNDS];
    for (int i = 0; i < n; i++) {
        for (int q = 0; q < o->rounds; q++)
            mine[q] = jobs[q * n + i];
        summarise(mine, o->rounds, &sm[i]);
    }
    return 0;
}

/* Largest relative difference between rank losses of two jobs at step k (0-based). */
static double loss_rel_diff(const job_t *a, const job_t *b, int k) {
    double worst = 0;
    for (int r = 0; r < a->o->world; r++) {
        double x = a->loss[(size_t)r * (size_t)a->nsteps + (size_t)k];
        double y = b->loss[(size_t)r * (size_t)b->nsteps + (size_t)k];
        double d = fabs(x - y) / (fabs(y) > 0 ? fabs(y) : 1.0);
        if (!(d <= worst)) worst = d; /* NaN propagates as the worst */
    }
    return worst;
}

static void print_time_table(const config_t *cfgs, const summary_t *sm, int n) {
    printf("%-28s %9s %9s %9s %9s %9s %9s %11s %11s\n", "configuration", "step ms", "min", "max",
           "fwd", "bwd", "optim", "loss@1", "loss@end");
    for (int i = 0; i < n; i++)
        printf("%-28s %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %11.6f %11.6f\n", cfgs[i].name,
               sm[i].med[PH_STEP] * 1e3, sm[i].step_min * 1e3, sm[i].step_max * 1e3,
               sm[i].med[PH_FWD] * 1e3, sm[i].med[PH_BWD] * 1e3, sm[i].med[PH_OPT] * 1e3,
               sm[i].loss_first, sm[i].loss_last);
}

static void print_mem_table(const config_t *cfgs, const summary_t *sm, int n) {
    printf("%-28s", "peak MiB per rank");
    for (int c = 0; c < NMEMCATS; c++)
        printf(" %11s", fsdp_mem_cat_name(mem_cats[c]));
    printf(" %9s %13s\n", "total", "p+g+o at end");
    for (int i = 0; i < n; i++) {
        printf("%-28s", cfgs[i].name);
        for (int c = 0; c < NMEMCATS; c++)
            printf(" %11.2f", mib(sm[i].peak[c]));
        printf(" %9.2f %13.2f\n", mib(sm[i].total_peak), mib(sm[i].pgo_end));
    }
}

/* ---------------------------------------------------------------------------------------- */

/* The main section: DDP and the three strategies on the model of the options. Returns 0 when
 * it ran and the losses agree, 1 otherwise. */
static int main_section(const options_t *o) {
    enum { C_DDP = 0, C_NO_SHARD, C_FULL_SHARD, C_SHARD_GRAD_OP, NMAIN };
    const config_t cfgs[NMAIN] = {
        {.name = "DDP", .ddp = true},
        {.name = "FSDP NO_SHARD", .strategy = FSDP_NO_SHARD, .bp = FSDP_BACKWARD_PRE},
        {.name = "FSDP FULL_SHARD", .strategy = FSDP_FULL_SHARD, .bp = FSDP_BACKWARD_PRE},
        {.name = "FSDP SHARD_GRAD_OP", .strategy = FSDP_SHARD_GRAD_OP, .bp = FSDP_BACKWARD_PRE},
    };
    job_t *jobs[MAX_ROUNDS * NMAIN] = {NULL};
    summary_t sm[NMAIN];
    int status = 1;

    printf("# FSDP: one unit per GPTBlock + the root; backward_prefetch BACKWARD_PRE, "
           "limit_all_gathers 2, use_orig_params\n");
    fflush(stdout);
    if (run_rounds(o, &o->c.m, cfgs, NMAIN, jobs, sm) < 0) goto out;
    if (jobs[0]->nparams != bench_gpt_params(&o->c.m)) {
        fprintf(stderr, PROG ": the model has %lld parameters, the header said %lld\n",
                (long long)jobs[0]->nparams, (long long)bench_gpt_params(&o->c.m));
        goto out;
    }
    printf("\n");
    print_time_table(cfgs, sm, NMAIN);
    printf("(times: median over the timed steps of the slowest rank; fwd includes the loss)\n\n");
    print_mem_table(cfgs, sm, NMAIN);
    printf("(peaks after the warm-up, the largest rank's; p+g+o: params + grads + optim after "
           "the optimizer step)\n\n");

    double step_ratio = sm[C_FULL_SHARD].med[PH_STEP] / sm[C_NO_SHARD].med[PH_STEP];
    double ddp_ratio = sm[C_FULL_SHARD].med[PH_STEP] / sm[C_DDP].med[PH_STEP];
    double mem_ratio = (double)sm[C_FULL_SHARD].pgo_end / (double)sm[C_DDP].pgo_end;
    double peak_ratio = (double)sm[C_FULL_SHARD].total_peak / (double)sm[C_DDP].total_peak;
    printf("ratio FULL_SHARD/NO_SHARD step time:              %.3f (target <= %.2f) %s\n",
           step_ratio, TARGET_STEP_RATIO, step_ratio <= TARGET_STEP_RATIO ? "PASS" : "MISS");
    printf("ratio FULL_SHARD/DDP step time:                   %.3f\n", ddp_ratio);
    printf("ratio FULL_SHARD/DDP params+grads+optim per rank: %.3f (target <= %.2f%s) %s\n",
           mem_ratio, TARGET_MEM_RATIO, o->world == 2 ? "" : ", set for world 2",
           mem_ratio <= TARGET_MEM_RATIO ? "PASS" : "MISS");
    printf("ratio FULL_SHARD/DDP total peak per rank:         %.3f\n", peak_ratio);
    double worst_first = 0, worst_last = 0;
    for (int i = 1; i < NMAIN; i++) {
        double a = loss_rel_diff(jobs[i], jobs[C_DDP], 0);
        double b = loss_rel_diff(jobs[i], jobs[C_DDP], jobs[C_DDP]->nsteps - 1);
        if (!(a <= worst_first)) worst_first = a;
        if (!(b <= worst_last)) worst_last = b;
    }
    bool ok = worst_first <= LOSS_RTOL && worst_last <= LOSS_RTOL;
    printf("loss vs DDP, max relative difference over configurations and ranks: step 1 %.3g, "
           "final step %.3g (sanity: expected ~1e-6; %s)\n",
           worst_first, worst_last, ok ? "OK" : "TOO LARGE: a bug");
    status = ok ? 0 : 1;
out:
    for (int i = 0; i < MAX_ROUNDS * NMAIN; i++)
        if (jobs[i]) job_free(jobs[i]);
    fflush(stdout);
    return status;
}

/*
 * The prefetch section: FULL_SHARD with and without prefetching under the simulated latency, on
 * a smaller model (4 blocks of width 256, T 64, B 4) unless the options' model is smaller
 * still, so that a collective's latency is of the order of a unit's compute: that is when
 * prefetching can hide it. The last row, without latency, is what full overlap would give.
 * Returns 0 when it ran and the losses agree, 1 otherwise.
 */
static int prefetch_section(const options_t *o) {
    enum { P_NONE = 0, P_BWD, P_FWD, P_BOTH, P_NOLAT, NPF };
    const int64_t lat = o->latency_us;
    const config_t cfgs[NPF] = {
        {.name = "no prefetch", .bp = FSDP_BACKWARD_PREFETCH_NONE, .latency_us = lat},
        {.name = "BACKWARD_PRE", .bp = FSDP_BACKWARD_PRE, .latency_us = lat},
        {.name = "forward_prefetch",
         .bp = FSDP_BACKWARD_PREFETCH_NONE,
         .fwd_prefetch = true,
         .latency_us = lat},
        {.name = "BACKWARD_PRE + forward",
         .bp = FSDP_BACKWARD_PRE,
         .fwd_prefetch = true,
         .latency_us = lat},
        {.name = "both, no latency (ref.)", .bp = FSDP_BACKWARD_PRE, .fwd_prefetch = true},
    };
    bench_gpt_shape_t pm = {
        .layers = 4, .d = 256, .heads = 4, .seq = 64, .batch = 4, .vocab = o->c.m.vocab};
    if (o->c.m.layers * o->c.m.d * o->c.m.d * o->c.m.seq * o->c.m.batch <=
        pm.layers * pm.d * pm.d * pm.seq * pm.batch)
        pm = o->c.m;
    job_t *jobs[MAX_ROUNDS * NPF] = {NULL};
    summary_t sm[NPF];
    int status = 1;

    printf("\n# prefetch overlap: FSDP FULL_SHARD, simulated latency %lld us per collective, "
           "GPT %lld layers, d %lld, %lld heads, seq %lld, batch %lld, vocab %lld\n",
           (long long)lat, (long long)pm.layers, (long long)pm.d, (long long)pm.heads,
           (long long)pm.seq, (long long)pm.batch, (long long)pm.vocab);
    fflush(stdout);
    if (run_rounds(o, &pm, cfgs, NPF, jobs, sm) < 0) goto out;
    printf("\n");
    print_time_table(cfgs, sm, NPF);
    for (int i = P_BWD; i <= P_BOTH; i++)
        printf("ratio %s / no prefetch: %.3f (expected < 1)\n", cfgs[i].name,
               sm[i].med[PH_STEP] / sm[P_NONE].med[PH_STEP]);
    printf("exposed latency per step (step time minus the reference without latency): "
           "no prefetch %.1f ms, BACKWARD_PRE %.1f ms, forward_prefetch %.1f ms, both %.1f ms\n",
           (sm[P_NONE].med[PH_STEP] - sm[P_NOLAT].med[PH_STEP]) * 1e3,
           (sm[P_BWD].med[PH_STEP] - sm[P_NOLAT].med[PH_STEP]) * 1e3,
           (sm[P_FWD].med[PH_STEP] - sm[P_NOLAT].med[PH_STEP]) * 1e3,
           (sm[P_BOTH].med[PH_STEP] - sm[P_NOLAT].med[PH_STEP]) * 1e3);
    double worst = 0;
    for (int i = 1; i < NPF; i++) {
        double d = loss_rel_diff(jobs[i], jobs[0], jobs[0]->nsteps - 1);
        if (!(d <= worst)) worst = d;
    }
    bool ok = worst <= LOSS_RTOL;
    printf("loss vs no prefetch, final step: max relative difference %.3g (%s)\n", worst,
           ok ? "OK" : "TOO LARGE: a bug");
    status = ok ? 0 : 1;
out:
    for (int i = 0; i < MAX_ROUNDS * NPF; i++)
        if (jobs[i]) job_free(jobs[i]);
    fflush(stdout);
    return status;
}

/*
 * The activation-checkpointing section: FULL_SHARD with and without activation checkpointing
 * of every GPTBlock, on the options' model at 1, 2, 4 and 8 sequences per rank (the largest
 * the options' batch when it is larger). For each batch: the median step times, the forward
 * and backward times, the peaks of the activations category and of all memory, and their
 * ratios (checkpointed / plain). The cost should be near one more forward of the blocks. The
 * losses must agree bitwise (the recomputation is exact); returns 1 when they do not or a run
 * failed.
 */
static int ac_section(const options_t *o) {
    static const int64_t batches[] = {1, 2, 4, 8};
    const config_t cfgs[2] = {
        {.name = "FULL_SHARD", .strategy = FSDP_FULL_SHARD, .bp = FSDP_BACKWARD_PRE},
        {.name = "FULL_SHARD + act. ckpt",
         .strategy = FSDP_FULL_SHARD,
         .bp = FSDP_BACKWARD_PRE,
         .ac = true},
    };
    enum { NB = (int)(sizeof batches / sizeof batches[0]) };
    summary_t sm[NB][2];
    int status = 0;
    printf("\n# activation checkpointing: FSDP FULL_SHARD, every GPTBlock recomputed in "
           "backward; GPT %lld layers, d %lld, seq %lld\n",
           (long long)o->c.m.layers, (long long)o->c.m.d, (long long)o->c.m.seq);
    for (int b = 0; b < NB; b++) {
        bench_gpt_shape_t m = o->c.m;
        m.batch = b == NB - 1 && o->c.m.batch > batches[b] ? o->c.m.batch : batches[b];
        job_t *jobs[MAX_ROUNDS * 2] = {NULL};
        printf("## batch %lld per rank\n", (long long)m.batch);
        fflush(stdout);
        if (run_rounds(o, &m, cfgs, 2, jobs, sm[b]) < 0) {
            status = 1;
        } else {
            for (int k = 0; k < jobs[0]->nsteps; k++)
                for (int r = 0; r < o->world; r++)
                    if (jobs[0]->loss[(size_t)r * (size_t)jobs[0]->nsteps + (size_t)k] !=
                        jobs[1]->loss[(size_t)r * (size_t)jobs[1]->nsteps + (size_t)k])
                        status = 1;
        }
        for (int i = 0; i < MAX_ROUNDS * 2; i++)
            if (jobs[i]) job_free(jobs[i]);
        if (status) break;
    }
    if (status) {
        fprintf(stderr, PROG ": activation checkpointing: a run failed or a loss differs\n");
        return status;
    }
    printf("\n%-6s %9s %9s %7s %9s %9s %9s %9s %8s %9s %9s %7s\n", "batch", "step ms", "ckpt ms",
           "ratio", "fwd ms", "ckpt fwd", "bwd ms", "ckpt bwd", "act MiB", "ckpt act", "ratio",
           "total");
    for (int b = 0; b < NB; b++) {
        const summary_t *p = &sm[b][0], *a = &sm[b][1];
        int64_t batch = b == NB - 1 && o->c.m.batch > batches[b] ? o->c.m.batch : batches[b];
        printf("%-6lld %9.1f %9.1f %7.3f %9.1f %9.1f %9.1f %9.1f %8.2f %9.2f %7.3f %7.3f\n",
               (long long)batch, p->med[PH_STEP] * 1e3, a->med[PH_STEP] * 1e3,
               a->med[PH_STEP] / p->med[PH_STEP], p->med[PH_FWD] * 1e3, a->med[PH_FWD] * 1e3,
               p->med[PH_BWD] * 1e3, a->med[PH_BWD] * 1e3, mib(p->peak[ACT]), mib(a->peak[ACT]),
               (double)a->peak[ACT] / (double)p->peak[ACT],
               (double)a->total_peak / (double)p->total_peak);
    }
    printf("(ratios: checkpointed / plain; act: peak of the activations category, total: of all "
           "memory, the largest rank's; losses equal bitwise at every step)\n");
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv) {
    options_t o;
    int prc = parse_options(argc, argv, &o);
    if (prc != 0) return prc > 0 ? 0 : 2;

    printf("# " PROG ": libfsdp, sim backend, world %d, GPT %lld layers, d %lld, %lld heads, "
           "seq %lld, batch %lld per rank, vocab %lld, f32, %d compute thread(s) per rank\n",
           o.world, (long long)o.c.m.layers, (long long)o.c.m.d, (long long)o.c.m.heads,
           (long long)o.c.m.seq, (long long)o.c.m.batch, (long long)o.c.m.vocab,
           threads_per_rank(o.world));
    printf("# params %lld\n", (long long)bench_gpt_params(&o.c.m));
    printf("# AdamW lr %g betas (%g, %g) eps %g weight_decay %g (" BENCH_DECAY_NOTE "); seed "
           "%llu; %d warm-up + %d timed steps per configuration\n",
           o.c.adamw.lr, o.c.adamw.beta1, o.c.adamw.beta2, o.c.adamw.eps, o.c.adamw.weight_decay,
           (unsigned long long)o.c.seed, o.c.warmup, o.c.steps);
    double t0 = bench_now_s();
    int status = 0;
    if (o.sections & SECTION_MAIN) status |= main_section(&o);
    if (o.sections & SECTION_PREFETCH) status |= prefetch_section(&o);
    if (o.sections & SECTION_AC) status |= ac_section(&o);
    printf("total %.1f s\n", bench_now_s() - t0);
    if (status) fprintf(stderr, PROG ": a configuration failed or the losses disagree\n");
    return status;
}
