/* SPDX-License-Identifier: MIT */
/*
 * bench_trace.c: what tracing (fsdp/trace.h) costs the FULL_SHARD GPT step at world size 2 on
 * the sim backend, with tracing off and on in the same process.
 *
 * For each batch size of --batches (sequences per rank; default 2 and 8) one sim run: every rank
 * builds the benchmarks' GPT (bench_util.h: the GPT recipe, one unit per GPTBlock under the root,
 * BACKWARD_PRE, limit_all_gathers 2, AdamW), runs --warmup untraced steps, then --steps pairs
 * of steps, one with tracing off and one with every rank recording into one shared recorder
 * (started before the step's barrier and stopped after the step, outside the timed region), the
 * order within a pair alternating so that neither side always runs first. A step's time is the
 * slowest rank's. Reported per batch: the medians of the steps off and on, their ratio, and the
 * median of the pairs' ratios (each pair ran back to back, so a drift of the machine cancels);
 * the events a rank records per step and the bytes they take in the file.
 *
 * Tracing off cannot be timed against a library without the recording points in the same
 * process, so its cost is bounded from below instead: a recording point with tracing off is a
 * load of the context's lane pointer and a branch; the public fsdp_trace_begin/fsdp_trace_end,
 * which add a function call each, are timed 10^7 times on a context that does not record, and
 * that cost times twice the events of a traced step (a begin and an end per span, an issue and a
 * completion per collective, which overcounts) is set against the step time. A point with
 * tracing on is timed the same way, which estimates the on cost below the timings' noise.
 * Target: the pairs' median ratio <= 1.02 at every batch (the exit status is 1 otherwise).
 * Run with --help for the options.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fsdp.h>

#include "bench_util.h"

#define PROG "bench_trace"
#define WORLD 2
#define MAX_BATCHES 8
#define TARGET_RATIO 1.02

typedef struct options {
    bench_common_t c;
    int64_t batches[MAX_BATCHES];
    int nbatches;
    const char *out; /* --trace-out: keep the last run's trace there */
} options_t;

static void usage(FILE *f) {
    fprintf(f, "usage: " PROG " [options]\n" BENCH_COMMON_USAGE
               "  --batches LIST  sequences per rank to sweep, comma-separated (default 2,8);\n"
               "                  --batch is ignored\n"
               "  --trace-out F   keep the last batch's trace in F (default: a temporary file,\n"
               "                  removed)\n"
               "  --help          this text\n"
               "--steps counts pairs of steps (one off, one on). Compute threads per rank:\n"
               "FSDP_NUM_THREADS, else the online cores / 2.\n");
}

static int own_option(void *arg, const char *prog, const char *opt, const char *val) {
    options_t *o = arg;
    if (strcmp(opt, "--trace-out") == 0) {
        if (!val || !*val) {
            fprintf(stderr, "%s: --trace-out needs a file name\n", prog);
            return -1;
        }
        o->out = val;
        return 1;
    }
    if (strcmp(opt, "--batches") != 0) return strcmp(opt, "--quick") == 0 ? 2 : 0;
    o->nbatches = 0;
    const char *p = val ? val : "";
    while (*p) {
        char *end = NULL;
        long long v = strtoll(p, &end, 10);
        if (end == p || v < 1 || v > 4096 || o->nbatches == MAX_BATCHES ||
            (*end != ',' && *end != '\0')) {
            fprintf(stderr, "%s: --batches needs up to %d integers in [1, 4096], got '%s'\n", prog,
                    MAX_BATCHES, val ? val : "");
            return -1;
        }
        o->batches[o->nbatches++] = v;
        p = *end ? end + 1 : end;
    }
    if (o->nbatches == 0) {
        fprintf(stderr, "%s: --batches is empty\n", prog);
        return -1;
    }
    return 1;
}

/* ---------------------------------------------------------------------------------------- */
/* One run */

typedef struct job {
    const options_t *o;
    bench_gpt_shape_t m;
    fsdp_trace_t *trace;
    int npairs;
    double *t; /* [pair][2]: seconds, slowest rank; [.][0] off, [.][1] on (rank 0 fills) */
    char err[WORLD][768];
} job_t;

static int rank_main(fsdp_ctx_t *ctx, void *arg) {
    job_t *j = arg;
    const options_t *o = j->o;
    bench_rank_t s = {.ctx = ctx};
    int r = fsdp_ctx_rank(ctx), rc;
    fsdp_pg_t *world = fsdp_ctx_pg(ctx);
    fsdp_options_t fo;
    bench_fsdp_options(&fo);
    if ((rc = bench_rank_model(&s, &j->m, o->c.seed)) < 0 ||
        (rc = bench_rank_wrap(&s, &j->m, &fo)) < 0 ||
        (rc = bench_rank_train_setup(&s, &j->m, &o->c.adamw, o->c.seed)) < 0)
        goto out;
    int total = o->c.warmup + 2 * j->npairs;
    for (int k = 0; k < total; k++) {
        int pair = (k - o->c.warmup) / 2, half = (k - o->c.warmup) % 2;
        bool on = k >= o->c.warmup && (pair % 2 == 0 ? half == 1 : half == 0);
        if (on && (rc = fsdp_trace_start(ctx, j->trace)) < 0) {
            bench_rank_fail(&s, "fsdp_trace_start", rc);
            goto out;
        }
        if ((rc = fsdp_pg_barrier(world, NULL)) < 0) {
            bench_rank_fail(&s, "barrier", rc);
            goto out;
        }
        double ph[PH_COUNT], loss;
        const char *failed = NULL;
        rc = bench_train_step(s.opt, bench_rank_loss, &s, ph, &loss, &failed);
        if (on) fsdp_trace_stop(ctx);
        if (rc < 0) {
            bench_rank_fail(&s, failed, rc);
            goto out;
        }
        double t = ph[PH_STEP];
        if ((rc = fsdp_pg_all_reduce(world, &t, &t, 1, FSDP_DTYPE_F64, FSDP_REDOP_MAX, NULL)) < 0) {
            bench_rank_fail(&s, "all-reducing the step time", rc);
            goto out;
        }
        if (r == 0 && k >= o->c.warmup) j->t[pair * 2 + (on ? 1 : 0)] = t;
    }
out:
    if (rc < 0) snprintf(j->err[r], sizeof j->err[r], "%s", s.err);
    bench_rank_teardown(&s);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* The off and on paths alone */

/* Nanoseconds per fsdp_trace_begin or fsdp_trace_end call on a context, tracing on or off. */
static double point_ns(bool on, int n) {
    fsdp_ctx_t *ctx = NULL;
    fsdp_trace_t *tr = NULL;
    fsdp_trace_options_t opt;
    fsdp_trace_options_init(&opt);
    opt.max_events = (size_t)n + 16;
    if (fsdp_ctx_create(NULL, &ctx) < 0 || fsdp_trace_create(&opt, &tr) < 0) return -1;
    if (on) fsdp_trace_start(ctx, tr);
    double t0 = bench_now_s();
    for (int i = 0; i < n; i++) {
        fsdp_trace_begin(ctx, "span");
        fsdp_trace_end(ctx, "span");
    }
    double t = bench_now_s() - t0;
    fsdp_trace_stop(ctx);
    fsdp_trace_destroy(tr);
    fsdp_ctx_destroy(ctx);
    return t * 1e9 / (2.0 * n);
}

int main(int argc, char **argv) {
    options_t o = {.c = bench_common_default(), .batches = {2, 8}, .nbatches = 2};
    o.c.steps = 10;
    int prc = bench_parse_args(PROG, argc, argv, INT64_MAX - WORLD, &o.c, own_option, &o, usage);
    if (prc != 0) return prc > 0 ? 0 : 2;

    printf("# " PROG ": libfsdp, sim backend, world %d, FSDP FULL_SHARD GPT %lld layers, d %lld, "
           "%lld heads, seq %lld, vocab %lld, f32; %d warm-up steps, then %d pairs of steps "
           "(tracing off, on)\n",
           WORLD, (long long)o.c.m.layers, (long long)o.c.m.d, (long long)o.c.m.heads,
           (long long)o.c.m.seq, (long long)o.c.m.vocab, o.c.warmup, o.c.steps);
    printf("# params %lld\n", (long long)bench_gpt_params(&o.c.m));
    double off_ns = point_ns(false, 10000000), on_ns = point_ns(true, 1000000);
    printf("recording point, tracing off: %.2f ns (fsdp_trace_begin/end: a call, a load and a "
           "branch)\n",
           off_ns);
    printf("recording point, tracing on:  %.1f ns (half a span: the locks, the clock, the name, "
           "a memory sample)\n\n",
           on_ns);
    printf("%-6s %9s %9s %8s %11s %15s %12s %11s %10s %10s\n", "batch", "off ms", "on ms", "on/off",
           "pair ratio", "quartiles", "events/step", "bytes/step", "on est.", "off est.");
    int status = 0;
    char tmp[256];
    snprintf(tmp, sizeof tmp, "%s/bench_trace.%ld.json",
             getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (long)getpid());
    for (int b = 0; b < o.nbatches; b++) {
        job_t *j = calloc(1, sizeof *j);
        if (!j) return 1;
        j->o = &o;
        j->m = o.c.m;
        j->m.batch = o.batches[b];
        j->npairs = o.c.steps;
        j->t = calloc((size_t)j->npairs * 2, sizeof *j->t);
        if (!j->t || fsdp_trace_create(NULL, &j->trace) < 0) return 1;
        fsdp_sim_options_t so;
        fsdp_sim_options_init(&so);
        so.world_size = WORLD;
        so.seed = o.c.seed;
        int rc = fsdp_sim_run(&so, rank_main, j, NULL);
        if (rc < 0) {
            fprintf(stderr, PROG ": batch %lld failed: %s\n  %s\n  %s\n", (long long)j->m.batch,
                    fsdp_strerror(rc), j->err[0], j->err[1]);
            status = 1;
        } else {
            double *off = malloc((size_t)j->npairs * sizeof *off);
            double *on = malloc((size_t)j->npairs * sizeof *on);
            double *pr = malloc((size_t)j->npairs * sizeof *pr);
            for (int p = 0; p < j->npairs; p++) {
                off[p] = j->t[2 * p];
                on[p] = j->t[2 * p + 1];
                pr[p] = on[p] / off[p];
            }
            double moff = bench_median(off, j->npairs), mon = bench_median(on, j->npairs);
            double mpr = bench_median(pr, j->npairs); /* sorts pr: the quartiles follow */
            double q1 = pr[j->npairs / 4],
                   q3 = pr[(3 * j->npairs) / 4 < j->npairs ? (3 * j->npairs) / 4 : j->npairs - 1];
            const char *path = o.out && b == o.nbatches - 1 ? o.out : tmp;
            size_t events = fsdp_trace_num_events(j->trace);
            double per_step = (double)events / (double)(WORLD * j->npairs);
            struct stat st;
            double bytes = fsdp_trace_write(j->trace, path) == 0 && stat(path, &st) == 0
                               ? (double)st.st_size / (double)(WORLD * j->npairs)
                               : 0;
            if (path == tmp) remove(tmp);
            /* The recording points of a rank-step (at most twice its events) at the measured cost
             * of one, as a fraction of the step: what the timings cannot resolve. */
            double est_on = 2.0 * per_step * on_ns * 1e-9 / moff;
            double est_off = 2.0 * per_step * off_ns * 1e-9 / moff;
            printf("%-6lld %9.1f %9.1f %8.4f %11.4f   %.3f, %.3f %12.0f %11.0f %10.2e %10.2e\n",
                   (long long)j->m.batch, moff * 1e3, mon * 1e3, mon / moff, mpr, q1, q3, per_step,
                   bytes, est_on, est_off);
            if (mpr > TARGET_RATIO) status = 1;
            free(off);
            free(on);
            free(pr);
        }
        fsdp_trace_destroy(j->trace);
        free(j->t);
        free(j);
    }
    printf("(times: median step of the slowest rank; pair ratio: median of on/off over pairs run "
           "back to back, and its quartiles (the noise); events/step and bytes/step: one rank's; "
           "on est. and off est.: the "
           "recording points' cost, tracing on and off, as a fraction of the off step)\n");
    printf("target: pair ratio <= %.2f: %s\n", TARGET_RATIO, status ? "MISS" : "PASS");
    return status;
}
