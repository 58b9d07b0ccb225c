/* SPDX-License-Identifier: MIT */
/*
 * bench_mp_step.c: FSDP mixed precision against f32 on the GPT training step, world size 2 on the
 * sim backend: collective bytes, unsharded-parameter memory and step time, one process.
 *
 * The model is fsdp-train's "10M" of bench/train_table.sh (6 blocks, width 384, 6 heads, sequence
 * 128, the byte vocabulary of 256: 10,795,008 parameters), built, wrapped and optimized by the GPT
 * recipe as every GPT benchmark does (bench_util.h: one unit per GPTBlock under the root,
 * use_orig_params, BACKWARD_PRE, limit_all_gathers 2, FULL_SHARD, the recipe's AdamW). Three
 * configurations, each from the same seed on every rank, rank r training on its own fixed batch:
 *   f32               mixed precision off (the baseline);
 *   bf16              fsdp_mixed_precision_t param_dtype = reduce_dtype = buffer_dtype = bf16,
 *                     f32 master weights (what fsdp-train --precision bf16 sets);
 *   bf16-reduce-f32   param and buffer dtype bf16, reduce_dtype f32 (--precision
 *                     bf16-reduce-f32).
 * Every configuration runs at each batch size of --batches (sequences per rank; default 1, 2
 * and 8) and --rounds times (default 2, the order of the configurations reversed every other
 * round so that a drifting machine favours none); the timed steps of the rounds are pooled.
 *
 * Measured per step on each rank, after a barrier:
 *   - the bytes of all-gather and reduce-scatter, from the world group's counters
 *     (fsdp_pg_get_counters, reset before the step): nccl-tests' message size, so per-rank
 *     traffic in proportion; target: exactly 0.5x f32 for bf16 (both) and for the
 *     all-gather of bf16-reduce-f32, whose reduce-scatter stays at 1.0x;
 *   - the peak of unsharded-parameter memory: the FSDP_MEM_PARAMS peak of the step (peaks reset
 *     before it) minus the PARAMS bytes held at its start (the rank's f32 shard, which every
 *     configuration keeps for the optimizer); what is left is what unsharding adds: the
 *     all-gathered parameters of the units in flight and, under mixed precision, the transient
 *     low-precision shard cast from the f32 one. Target: <= 0.55x f32;
 *   - the step time (the slowest rank's; zero_grad, forward and loss, backward, AdamW), and the
 *     total peak of the memory libfsdp counts.
 * Ratios are against the f32 row of the same batch size, run in the same process. On the CPU a
 * bf16 operation widens its operands to f32, computes and rounds the result (the CPU device has
 * no native half GEMM: docs/design.md, "Native low-precision matrix products"), so mixed
 * precision costs time here; what it saves is communication and memory.
 *
 * The exit status is 0 when every run succeeded and the losses of the first step agree with f32
 * within 2e-2 relative (a few bf16 roundings; more means a bug), 1 otherwise, 2 for bad options.
 * A missed target does not change it. Run with --help for the options.
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

#define PROG "bench_mp_step"
#define WORLD 2
#define MAX_ROUNDS 16
#define MAX_BATCHES 8

#define TARGET_BYTES_RATIO 0.5      /* bf16 / f32 all-gather (and bf16 reduce-scatter) bytes */
#define TARGET_UNSHARDED_RATIO 0.55 /* bf16 / f32 peak of unsharded-parameter memory */
/* bf16 loss at step 1 against f32's, relative: the logits and the loss are rounded to bf16
 * (2^-9 relative each) after a few bf16 roundings of the activations. */
#define LOSS_RTOL 2e-2

typedef struct options {
    bench_common_t c; /* c.m.batch is replaced by each entry of batches[] */
    int64_t batches[MAX_BATCHES];
    int nbatches;
    int rounds;
} options_t;

/* One mixed-precision configuration. */
typedef struct config {
    const char *name;
    bool mp;
    fsdp_dtype_t param, reduce;
} config_t;

enum { C_F32 = 0, C_BF16, C_BF16_R32, NCFG };
static const config_t cfgs[NCFG] = {
    {.name = "f32"},
    {.name = "bf16", .mp = true, .param = FSDP_DTYPE_BF16, .reduce = FSDP_DTYPE_BF16},
    {.name = "bf16-reduce-f32", .mp = true, .param = FSDP_DTYPE_BF16, .reduce = FSDP_DTYPE_F32},
};

/* What one rank records of one step. */
typedef struct step_rec {
    double ph[PH_COUNT]; /* seconds */
    double loss;
    uint64_t ag, rs;  /* bytes of all-gather and reduce-scatter */
    size_t unsharded; /* PARAMS peak minus PARAMS at the start of the step */
    size_t total_peak;
} step_rec_t;

/* One run of a configuration at one batch size: shared by its rank threads, each writing its
 * own slots. */
typedef struct job {
    const options_t *o;
    bench_gpt_shape_t m;
    const config_t *cfg;
    int nsteps;      /* warm-up + timed */
    step_rec_t *rec; /* [WORLD][nsteps] */
    int64_t nparams;
    char err[WORLD][sizeof(((bench_rank_t *)0)->err)];
} job_t;

/* A configuration at one batch size, over its rounds. */
typedef struct summary {
    double step_ms, fwd_ms, bwd_ms, opt_ms; /* medians over the pooled timed steps */
    double ag, rs;                          /* bytes per step (the same every step) */
    bool bytes_constant;                    /* every timed step of every rank moved the same */
    double unsharded, total_peak;           /* largest over steps, ranks and rounds, bytes */
    double loss_first, loss_last;           /* first round, mean over the ranks */
} summary_t;

static double mib(double bytes) {
    return bytes / 1048576.0;
}

static int threads_per_rank(void) {
    const char *env = getenv("FSDP_NUM_THREADS");
    if (env && *env) {
        long v = strtol(env, NULL, 10);
        if (v > 0 && v <= 4096) return (int)v;
    }
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    long per = (cores > 0 ? cores : 1) / WORLD;
    return per > 1 ? (int)per : 1;
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: " PROG " [options]\n" BENCH_COMMON_USAGE
            "  --batches LIST  sequences per rank to sweep, comma-separated (default 1,2,8;\n"
            "                  --quick: 1,2); replaces --batch\n"
            "  --rounds N      runs of every configuration, in alternating order; the timed\n"
            "                  steps of all rounds are pooled (default 2, at most 16)\n"
            "  --help          this text\n"
            "Defaults differ from the other GPT benchmarks in the vocabulary (256, fsdp-train's\n"
            "bytes: the 10M model of train_table.sh) and the steps (2 warm-up + 5 timed).\n"
            "World size 2 on the sim backend. Compute threads per rank: FSDP_NUM_THREADS,\n"
            "else the online cores / 2.\n");
}

static int parse_batches(const char *val, options_t *o) {
    const char *p = val ? val : "";
    int n = 0;
    while (*p) {
        char *end = NULL;
        long long v = strtoll(p, &end, 10);
        if (end == p || v < 1 || v > 4096 || n == MAX_BATCHES || (*end && *end != ',')) {
            fprintf(stderr,
                    PROG ": --batches needs up to %d integers in [1, 4096] separated by commas, "
                         "got '%s'\n",
                    MAX_BATCHES, val ? val : "");
            return -1;
        }
        o->batches[n++] = v;
        p = *end ? end + 1 : end;
    }
    if (n == 0) {
        fprintf(stderr, PROG ": --batches needs at least one batch size\n");
        return -1;
    }
    o->nbatches = n;
    return 0;
}

/* bench_mp_step's own options (a bench_extra_fn). */
static int own_option(void *arg, const char *prog, const char *opt, const char *val) {
    options_t *o = arg;
    int64_t v = 0;
    if (strcmp(opt, "--quick") == 0) {
        o->batches[0] = 1, o->batches[1] = 2, o->nbatches = 2;
        return 2;
    }
    if (strcmp(opt, "--batches") == 0) return parse_batches(val, o) < 0 ? -1 : 1;
    if (strcmp(opt, "--rounds") == 0) {
        if (bench_parse_i64(prog, opt, val, 1, MAX_ROUNDS, &v) < 0) return -1;
        o->rounds = (int)v;
        return 1;
    }
    return 0;
}

/* Returns 0 to run, 1 after --help, -1 for bad options. */
static int parse_options(int argc, char **argv, options_t *o) {
    *o = (options_t){.c = bench_common_default(), .batches = {1, 2, 8}, .nbatches = 3, .rounds = 2};
    o->c.m.vocab = 256;
    o->c.steps = 5;
    return bench_parse_args(PROG, argc, argv, INT64_MAX - WORLD, &o->c, own_option, o, usage);
}

/* ---------------------------------------------------------------------------------------- */
/* One rank of one run */

static int keep_err(job_t *j, const bench_rank_t *s, int rc) {
    int r = fsdp_ctx_rank(s->ctx);
    if (!j->err[r][0]) snprintf(j->err[r], sizeof j->err[r], "%s", s->err);
    return rc;
}

static int setup(job_t *j, bench_rank_t *s) {
    int rc;
    if ((rc = bench_rank_model(s, &j->m, j->o->c.seed)) < 0) return rc;
    if (fsdp_ctx_rank(s->ctx) == 0) j->nparams = s->nparams;
    fsdp_options_t fo;
    bench_fsdp_options(&fo);
    if (j->cfg->mp) {
        fo.mixed_precision.enabled = true;
        fo.mixed_precision.param_dtype = j->cfg->param;
        fo.mixed_precision.buffer_dtype = j->cfg->param;
        fo.mixed_precision.reduce_dtype = j->cfg->reduce;
    }
    if ((rc = bench_rank_wrap(s, &j->m, &fo)) < 0) return rc;
    return bench_rank_train_setup(s, &j->m, &j->o->c.adamw, j->o->c.seed);
}

static int rank_main(fsdp_ctx_t *ctx, void *arg) {
    job_t *j = arg;
    bench_rank_t s = {.ctx = ctx};
    int r = fsdp_ctx_rank(ctx);
    fsdp_pg_t *world = fsdp_ctx_pg(ctx);
    int rc = setup(j, &s);
    for (int k = 0; rc == FSDP_OK && k < j->nsteps; k++) {
        step_rec_t *rec = &j->rec[(size_t)r * (size_t)j->nsteps + (size_t)k];
        /* Every step starts together, so the slowest rank's time is the step's. */
        if ((rc = fsdp_pg_barrier(world, NULL)) < 0) {
            bench_rank_fail(&s, "barrier", rc);
            break;
        }
        fsdp_pg_reset_counters(world);
        fsdp_mem_reset_peaks(ctx);
        fsdp_mem_stats_t before, after;
        fsdp_mem_get_stats(ctx, &before);
        const char *failed = NULL;
        if ((rc = bench_train_step(s.opt, bench_rank_loss, &s, rec->ph, &rec->loss, &failed)) < 0) {
            bench_rank_fail(&s, failed, rc);
            break;
        }
        fsdp_pg_counters_t c;
        fsdp_pg_get_counters(world, &c);
        fsdp_mem_get_stats(ctx, &after);
        rec->ag = c.bytes[FSDP_COLL_ALL_GATHER];
        rec->rs = c.bytes[FSDP_COLL_REDUCE_SCATTER];
        rec->unsharded = after.peak[FSDP_MEM_PARAMS] - before.current[FSDP_MEM_PARAMS];
        rec->total_peak = after.total_peak;
    }
    if (rc < 0) keep_err(j, &s, rc);
    bench_rank_teardown(&s);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* Runs and summaries */

static void job_free(job_t *j) {
    if (j) free(j->rec);
    free(j);
}

static job_t *run_job(const options_t *o, const config_t *cfg, int64_t batch, int round) {
    job_t *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    j->o = o;
    j->m = o->c.m;
    j->m.batch = batch;
    j->cfg = cfg;
    j->nsteps = o->c.warmup + o->c.steps;
    if (!(j->rec = calloc((size_t)WORLD * (size_t)j->nsteps, sizeof *j->rec))) {
        fprintf(stderr, PROG ": out of memory\n");
        job_free(j);
        return NULL;
    }
    fsdp_sim_options_t so;
    fsdp_sim_options_init(&so);
    so.world_size = WORLD;
    so.seed = o->c.seed;
    int rc = fsdp_sim_run(&so, rank_main, j, NULL);
    if (rc < 0) {
        fprintf(stderr, PROG ": %s at batch %lld (round %d) failed: %s\n", cfg->name,
                (long long)batch, round + 1, fsdp_strerror(rc));
        for (int r = 0; r < WORLD; r++)
            if (j->err[r][0]) fprintf(stderr, "  %s\n", j->err[r]);
        job_free(j);
        return NULL;
    }
    for (int r = 0; r < WORLD; r++)
        for (int k = 0; k < j->nsteps; k++)
            if (!isfinite(j->rec[(size_t)r * (size_t)j->nsteps + (size_t)k].loss)) {
                fprintf(stderr,
                        PROG ": %s at batch %lld: the loss of rank %d at step %d is not "
                             "finite\n",
                        cfg->name, (long long)batch, r, k + 1);
                job_free(j);
                return NULL;
            }
    printf("  %-16s B=%-4lld round %d: step 1 loss %.6f, last %.6f\n", cfg->name, (long long)batch,
           round + 1, 0.5 * (j->rec[0].loss + j->rec[j->nsteps].loss),
           0.5 * (j->rec[j->nsteps - 1].loss + j->rec[2 * j->nsteps - 1].loss));
    fflush(stdout);
    return j;
}

/* The slowest rank's value of phase p at step k of job j. */
static double slowest(const job_t *j, int k, int p) {
    double t = 0;
    for (int r = 0; r < WORLD; r++) {
        double x = j->rec[(size_t)r * (size_t)j->nsteps + (size_t)k].ph[p];
        if (x > t) t = x;
    }
    return t;
}

/* Summarises the rounds js[0..nr) of one configuration at one batch size. Returns -1 when out
 * of memory. */
static int summarise(job_t *const *js, int nr, summary_t *sm) {
    const job_t *j0 = js[0];
    const int warm = j0->o->c.warmup, steps = j0->o->c.steps;
    double *v = malloc((size_t)(nr * steps) * sizeof *v);
    if (!v) return -1;
    memset(sm, 0, sizeof *sm);
    double *const med[] = {&sm->step_ms, &sm->fwd_ms, &sm->bwd_ms, &sm->opt_ms};
    const int phases[] = {PH_STEP, PH_FWD, PH_BWD, PH_OPT};
    for (int i = 0; i < 4; i++) {
        for (int q = 0; q < nr; q++)
            for (int k = 0; k < steps; k++)
                v[q * steps + k] = slowest(js[q], warm + k, phases[i]);
        *med[i] = bench_median(v, nr * steps) * 1e3;
    }
    free(v);
    const step_rec_t *ref = &j0->rec[warm];
    sm->ag = (double)ref->ag;
    sm->rs = (double)ref->rs;
    sm->bytes_constant = true;
    for (int q = 0; q < nr; q++)
        for (int r = 0; r < WORLD; r++)
            for (int k = 0; k < js[q]->nsteps; k++) {
                const step_rec_t *x = &js[q]->rec[(size_t)r * (size_t)js[q]->nsteps + (size_t)k];
                if (k >= warm && (x->ag != ref->ag || x->rs != ref->rs)) sm->bytes_constant = false;
                if (k >= warm && (double)x->unsharded > sm->unsharded)
                    sm->unsharded = (double)x->unsharded;
                if (k >= warm && (double)x->total_peak > sm->total_peak)
                    sm->total_peak = (double)x->total_peak;
            }
    for (int r = 0; r < WORLD; r++) {
        sm->loss_first += j0->rec[(size_t)r * (size_t)j0->nsteps].loss / WORLD;
        sm->loss_last +=
            j0->rec[(size_t)r * (size_t)j0->nsteps + (size_t)j0->nsteps - 1].loss / WORLD;
    }
    return 0;
}

static const char *verdict(bool ok) {
    return ok ? "PASS" : "MISS";
}

/* Runs the three configurations at one batch size and prints their table. Returns 0 when they
 * ran and the losses agree, 1 otherwise. */
static int batch_section(const options_t *o, int64_t batch) {
    job_t *jobs[MAX_ROUNDS][NCFG] = {{NULL}};
    summary_t sm[NCFG];
    int status = 1;
    printf("\n== batch %lld per rank (%lld tokens per rank and step)\n", (long long)batch,
           (long long)(batch * o->c.m.seq));
    fflush(stdout);
    for (int q = 0; q < o->rounds; q++)
        for (int k = 0; k < NCFG; k++) {
            int i = q % 2 ? NCFG - 1 - k : k;
            if (!(jobs[q][i] = run_job(o, &cfgs[i], batch, q))) goto out;
        }
    for (int i = 0; i < NCFG; i++) {
        job_t *mine[MAX_ROUNDS];
        for (int q = 0; q < o->rounds; q++)
            mine[q] = jobs[q][i];
        if (summarise(mine, o->rounds, &sm[i]) < 0) {
            fprintf(stderr, PROG ": out of memory\n");
            goto out;
        }
    }
    if (jobs[0][C_F32]->nparams != bench_gpt_params(&jobs[0][C_F32]->m)) {
        fprintf(stderr, PROG ": the model has %lld parameters, the header said %lld\n",
                (long long)jobs[0][C_F32]->nparams,
                (long long)bench_gpt_params(&jobs[0][C_F32]->m));
        goto out;
    }
    const summary_t *b = &sm[C_F32];
    printf("%-16s %8s %6s %8s %8s %8s %11s %6s %11s %6s %10s %6s %9s %10s %10s\n", "precision",
           "step ms", "ratio", "fwd", "bwd", "optim", "AG B/step", "ratio", "RS B/step", "ratio",
           "unsh. MiB", "ratio", "peak MiB", "loss@1", "loss@end");
    for (int i = 0; i < NCFG; i++) {
        const summary_t *s = &sm[i];
        printf("%-16s %8.1f %6.3f %8.1f %8.1f %8.1f %11.0f %6.3f %11.0f %6.3f %10.2f %6.3f %9.1f "
               "%10.6f %10.6f%s\n",
               cfgs[i].name, s->step_ms, s->step_ms / b->step_ms, s->fwd_ms, s->bwd_ms, s->opt_ms,
               s->ag, s->ag / b->ag, s->rs, s->rs / b->rs, mib(s->unsharded),
               s->unsharded / b->unsharded, mib(s->total_peak), s->loss_first, s->loss_last,
               s->bytes_constant ? "" : "  (bytes varied between steps)");
    }
    printf("(step: median over the timed steps of the slowest rank; AG, RS: all-gather and "
           "reduce-scatter bytes per rank and step (nccl-tests' size); unsh.: peak of the "
           "unsharded-parameter memory, the largest rank's; peak: libfsdp's total peak)\n");
    double ag = sm[C_BF16].ag / b->ag, rs = sm[C_BF16].rs / b->rs;
    double ag32 = sm[C_BF16_R32].ag / b->ag, rs32 = sm[C_BF16_R32].rs / b->rs;
    double un = sm[C_BF16].unsharded / b->unsharded;
    double un32 = sm[C_BF16_R32].unsharded / b->unsharded;
    printf("ratio bf16/f32 all-gather bytes:              %.4f (target %.2f exactly) %s\n", ag,
           TARGET_BYTES_RATIO, verdict(ag == TARGET_BYTES_RATIO));
    printf("ratio bf16/f32 reduce-scatter bytes:          %.4f (target %.2f exactly) %s\n", rs,
           TARGET_BYTES_RATIO, verdict(rs == TARGET_BYTES_RATIO));
    printf("ratio bf16-reduce-f32/f32 all-gather bytes:   %.4f (target %.2f exactly) %s; "
           "reduce-scatter %.4f (expected 1)\n",
           ag32, TARGET_BYTES_RATIO, verdict(ag32 == TARGET_BYTES_RATIO), rs32);
    printf("ratio bf16/f32 unsharded-parameter peak:      %.4f (target <= %.2f) %s; "
           "bf16-reduce-f32 %.4f %s\n",
           un, TARGET_UNSHARDED_RATIO, verdict(un <= TARGET_UNSHARDED_RATIO), un32,
           verdict(un32 <= TARGET_UNSHARDED_RATIO));
    printf("ratio bf16/f32 step time:                     %.3f; bf16-reduce-f32 %.3f\n",
           sm[C_BF16].step_ms / b->step_ms, sm[C_BF16_R32].step_ms / b->step_ms);
    double worst = 0;
    for (int i = C_BF16; i < NCFG; i++) {
        double d = fabs(sm[i].loss_first - b->loss_first) / fabs(b->loss_first);
        if (!(d <= worst)) worst = d;
    }
    bool ok = worst <= LOSS_RTOL;
    printf("loss at step 1 vs f32: max relative difference %.3g (%s: bf16 rounding, at most "
           "%.0e)\n",
           worst, ok ? "OK" : "TOO LARGE: a bug", LOSS_RTOL);
    status = ok ? 0 : 1;
out:
    for (int q = 0; q < MAX_ROUNDS; q++)
        for (int i = 0; i < NCFG; i++)
            job_free(jobs[q][i]);
    fflush(stdout);
    return status;
}

int main(int argc, char **argv) {
    options_t o;
    int prc = parse_options(argc, argv, &o);
    if (prc != 0) return prc > 0 ? 0 : 2;
    printf("# " PROG ": libfsdp, sim backend, world %d, GPT %lld layers, d %lld, %lld heads, "
           "seq %lld, vocab %lld (%lld params), batches per rank",
           WORLD, (long long)o.c.m.layers, (long long)o.c.m.d, (long long)o.c.m.heads,
           (long long)o.c.m.seq, (long long)o.c.m.vocab, (long long)bench_gpt_params(&o.c.m));
    for (int i = 0; i < o.nbatches; i++)
        printf("%s%lld", i ? "," : " ", (long long)o.batches[i]);
    printf(", %d compute thread(s) per rank\n", threads_per_rank());
    printf("# FSDP FULL_SHARD, one unit per GPTBlock + the root, BACKWARD_PRE, limit_all_gathers "
           "2, use_orig_params; mixed precision: f32 master weights, buffers in the param dtype\n");
    printf("# AdamW lr %g betas (%g, %g) eps %g weight_decay %g (" BENCH_DECAY_NOTE "); seed "
           "%llu; %d warm-up + %d timed steps, %d round(s) per configuration\n",
           o.c.adamw.lr, o.c.adamw.beta1, o.c.adamw.beta2, o.c.adamw.eps, o.c.adamw.weight_decay,
           (unsigned long long)o.c.seed, o.c.warmup, o.c.steps, o.rounds);
    fflush(stdout);
    double t0 = bench_now_s();
    int status = 0;
    for (int i = 0; i < o.nbatches; i++)
        status |= batch_section(&o, o.batches[i]);
    printf("total %.1f s\n", bench_now_s() - t0);
    if (status) fprintf(stderr, PROG ": a run failed or the losses disagree\n");
    return status;
}
