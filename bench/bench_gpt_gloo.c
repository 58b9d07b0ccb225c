/*
 * bench_gpt_gloo.c: one FSDP training step of the GPT model, one rank per process, over the gloo
 * backend. Run it under a launcher:
 *
 *     tools/fsdprun -n 2 bench/bench_gpt_gloo
 *
 * Each process makes its rank with fsdp_init_from_env (RANK, WORLD_SIZE, FSDP_STORE), builds
 * the GPT model of bench_gpt_step (same shape options and defaults: 6 blocks, d_model 384, 6
 * heads, sequence 128, vocabulary 8192, tied head, 13,842,432 parameters; f32, no dropout) and
 * wraps it with FSDP FULL_SHARD, every GPTBlock a unit of its own through the module-types
 * auto-wrap policy and the root keeping the embeddings and the final norm (backward prefetch
 * BACKWARD_PRE, limit_all_gathers 2, as bench_fsdp_step). AdamW steps over the flat parameters.
 * bench/gpt_gloo_torch.py is the PyTorch DDP twin, bench/gpt_gloo.sh runs both and prints the
 * ratios.
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

static const char *const phase_name[PH_COUNT] = {"zero_grad", "forward+loss", "backward",
                                                 "optimizer", "step"};

typedef struct options {
    bench_common_t c; /* the shape's batch is per rank */
    int threads;      /* 0: FSDP_NUM_THREADS, else the online cores / the world size */
} options_t;

static void usage(FILE *f) {
    fprintf(f, "usage: fsdprun -n N " PROG " [options]\n" BENCH_COMMON_USAGE
               "  --threads N     compute threads per rank (default FSDP_NUM_THREADS, else the\n"
               "                  online cores divided by the world size)\n"
               "  --help          this text\n"
               "The batch is per rank. Without a launcher the program runs as a world of one.\n");
}

/* Returns 0 to run, 1 after --help, -1 for bad options. */
static int parse_options(int argc, char **argv, options_t *o) {
    *o = (options_t){.c = bench_common_default()};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        int64_t v = 0;
        int rc = bench_common_option(PROG, a, val, INT64_MAX - MAX_WORLD, &o->c);
        if (rc < 0) return -1;
        if (rc == 2) continue;
        if (rc == 1) {
            i++;
        } else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 1;
        } else if (strcmp(a, "--threads") == 0) {
            if (bench_parse_i64(PROG, a, val, 1, 4096, &v) < 0) return -1;
            o->threads = (int)v;
            i++;
        } else {
            fprintf(stderr, PROG ": unknown option '%s' (try --help)\n", a);
            return -1;
        }
    }
    return bench_shape_check(PROG, &o->c.m);
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

typedef struct rank_state {
    fsdp_ctx_t *ctx;
    fsdp_module_t *model;
    fsdp_unit_t *root;
    fsdp_optim_t *opt;
    fsdp_tensor_t *tokens, *targets; /* (B, T) int64 */
    size_t nunits;
    int64_t nparams; /* of the model before wrapping */
} rank_state_t;

static int fail_msg(const rank_state_t *s, const char *what, int rc) {
    fprintf(stderr, PROG ": rank %d: %s failed: %s (%s)\n", fsdp_ctx_rank(s->ctx), what,
            fsdp_strerror(rc), fsdp_ctx_last_error(s->ctx));
    return rc < 0 ? rc : FSDP_EINTERNAL;
}

static int setup(rank_state_t *s, const options_t *o) {
    int r = fsdp_ctx_rank(s->ctx), rc;
    /* The same initial weights on every rank. */
    fsdp_rng_init(fsdp_ctx_rng(s->ctx), o->c.seed, 0);
    if ((rc = bench_gpt_create(s->ctx, &o->c.m, &s->model)) < 0)
        return fail_msg(s, "fsdp_gpt_create", rc);
    s->nparams = fsdp_module_num_params(s->model);

    static const char *const block_types[] = {"GPTBlock", NULL};
    fsdp_policy_t *blocks = NULL;
    if ((rc = fsdp_policy_module_types_create(block_types, &blocks)) < 0)
        return fail_msg(s, "fsdp_policy_module_types_create", rc);
    fsdp_options_t fo;
    fsdp_options_init(&fo);
    fo.strategy = FSDP_FULL_SHARD;
    fo.backward_prefetch = FSDP_BACKWARD_PRE;
    fo.limit_all_gathers = 2;
    fo.auto_wrap_policy = blocks;
    rc = fsdp_wrap(s->model, &fo, &s->root);
    fsdp_policy_release(blocks);
    if (rc < 0) return fail_msg(s, "fsdp_wrap", rc);
    fsdp_unit_t **units = NULL;
    if ((rc = fsdp_units(s->root, &units, &s->nunits)) < 0) return fail_msg(s, "fsdp_units", rc);
    free(units);
    if (s->nunits != (size_t)o->c.m.layers + 1) {
        fprintf(stderr, PROG ": rank %d: wrapping made %zu units, expected %lld\n", r, s->nunits,
                (long long)o->c.m.layers + 1);
        return FSDP_EINTERNAL;
    }

    fsdp_named_list_t params = {0};
    if ((rc = fsdp_named_params(s->root, &params)) < 0) return fail_msg(s, "fsdp_named_params", rc);
    rc = bench_adamw_create(s->ctx, &o->c.adamw, &params, &s->opt);
    fsdp_named_list_free(&params);
    if (rc < 0) return fail_msg(s, "creating the optimizer", rc);
    rc = bench_make_batch(s->ctx, &o->c.m, o->c.seed + (uint64_t)r, &s->tokens, &s->targets);
    if (rc < 0) return fail_msg(s, "making the batch", rc);
    return FSDP_OK;
}

static void teardown(rank_state_t *s) {
    fsdp_tensor_release(s->tokens);
    fsdp_tensor_release(s->targets);
    fsdp_optim_destroy(s->opt);
    fsdp_destroy(s->root);
    fsdp_module_release(s->model);
}

static int step_loss(void *arg, fsdp_tensor_t **loss) {
    rank_state_t *s = arg;
    return fsdp_gpt_forward_loss(s->model, s->tokens, s->targets, loss, NULL);
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

    fsdp_init_options_t io;
    fsdp_init_options_init(&io);
    io.seed = o.c.seed;
    char msg[1024];
    rank_state_t s = {0};
    int rc = fsdp_init_from_env(&io, &s.ctx, msg, sizeof msg);
    if (rc < 0) {
        fprintf(stderr, PROG ": fsdp_init_from_env failed: %s: %s\n", fsdp_err_name(rc), msg);
        return 1;
    }
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
    if (setup(&s, &o) < 0) goto out;
    if (rank == 0) {
        printf("# " PROG ": libfsdp FSDP FULL_SHARD over gloo, world %d (processes), GPT %lld "
               "layers, d %lld, %lld heads, seq %lld, batch %lld per rank, vocab %lld, f32, %d "
               "thread(s) per rank\n",
               world, (long long)o.c.m.layers, (long long)o.c.m.d, (long long)o.c.m.heads,
               (long long)o.c.m.seq, (long long)o.c.m.batch, (long long)o.c.m.vocab, threads);
        printf("# params %lld; %zu units (one per GPTBlock + the root); BACKWARD_PRE, "
               "limit_all_gathers 2\n",
               (long long)s.nparams, s.nunits);
        printf("# AdamW lr %g betas (%g, %g) eps %g weight_decay %g; seed %llu; %d warm-up + %d "
               "timed steps\n",
               o.c.adamw.lr, o.c.adamw.beta1, o.c.adamw.beta2, o.c.adamw.eps, o.c.adamw.wd,
               (unsigned long long)o.c.seed, o.c.warmup, o.c.steps);
        fflush(stdout);
    }

    for (int k = 0; k < nsteps; k++) {
        if (k == o.c.warmup) fsdp_mem_reset_peaks(s.ctx);
        /* Every step starts together, so the slowest rank's time is the step's. */
        if ((rc = fsdp_pg_barrier(pg, NULL)) < 0) {
            fail_msg(&s, "barrier", rc);
            goto out;
        }
        const char *failed = NULL;
        rc = bench_train_step(s.opt, step_loss, &s, &t[(size_t)k * PH_COUNT], &loss[k], &failed);
        if (rc < 0) {
            fail_msg(&s, failed, rc);
            goto out;
        }
    }

    /* Gather the results: the slowest rank's phases, the mean loss, every rank's peaks. */
    fsdp_mem_stats_t ms;
    fsdp_mem_get_stats(s.ctx, &ms);
    double mem[5] = {(double)ms.total_peak, (double)ms.peak[FSDP_MEM_PARAMS],
                     (double)ms.peak[FSDP_MEM_GRADS], (double)ms.peak[FSDP_MEM_OPTIM],
                     (double)ms.peak[FSDP_MEM_ACTIVATIONS]};
    rss[rank] = peak_rss_kib();
    if ((rc = fsdp_pg_all_reduce(pg, t, t, (size_t)nsteps * PH_COUNT, FSDP_DTYPE_F64,
                                 FSDP_REDOP_MAX, NULL)) < 0 ||
        (rc = fsdp_pg_all_reduce(pg, loss, loss, (size_t)nsteps, FSDP_DTYPE_F64, FSDP_REDOP_AVG,
                                 NULL)) < 0 ||
        (rc = fsdp_pg_all_reduce(pg, mem, mem, 5, FSDP_DTYPE_F64, FSDP_REDOP_MAX, NULL)) < 0 ||
        (rc = fsdp_pg_all_gather(pg, &rss[rank], rss, 1, FSDP_DTYPE_F64, NULL)) < 0) {
        fail_msg(&s, "gathering the results", rc);
        goto out;
    }
    status = 0;
    for (int k = 0; k < nsteps; k++)
        if (!isfinite(loss[k])) {
            if (rank == 0) fprintf(stderr, PROG ": the loss of step %d is not finite\n", k + 1);
            status = 1;
        }
    if (rank != 0) goto out;

    for (int k = 0; k < nsteps; k++)
        printf("step %3d%s loss %.6f  ms %.1f\n", k + 1, k >= o.c.warmup ? "        " : " (warmup)",
               loss[k], t[(size_t)k * PH_COUNT + PH_STEP] * 1e3);
    double step_min = INFINITY, step_max = 0;
    double *v = t + (size_t)o.c.warmup * PH_COUNT; /* the timed steps */
    for (int k = 0; k < o.c.steps; k++) {
        double x = v[(size_t)k * PH_COUNT + PH_STEP];
        if (x < step_min) step_min = x;
        if (x > step_max) step_max = x;
    }
    double *col = calloc((size_t)o.c.steps, sizeof *col);
    if (!col) {
        status = 1;
        goto out;
    }
    for (int p = 0; p < PH_COUNT; p++) {
        for (int k = 0; k < o.c.steps; k++)
            col[k] = v[(size_t)k * PH_COUNT + (size_t)p];
        med[p] = bench_median(col, o.c.steps);
    }
    free(col);
    printf("phases median ms:");
    for (int p = 0; p < PH_STEP; p++)
        printf(" %s %.1f", phase_name[p], med[p] * 1e3);
    printf("\n");
    printf("memory (library-counted peak of the largest rank after the warm-up): %.1f MiB "
           "(params %.1f, grads %.1f, optim %.1f, activations %.1f)\n",
           mem[0] / 1048576.0, mem[1] / 1048576.0, mem[2] / 1048576.0, mem[3] / 1048576.0,
           mem[4] / 1048576.0);
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
    teardown(&s);
    fsdp_ctx_destroy(s.ctx);
    free(t);
    free(loss);
    free(rss);
    free(med);
    return status;
}
