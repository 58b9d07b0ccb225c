/* SPDX-License-Identifier: MIT */
/*
 * bench_util.h: what the GPT step benchmarks share (bench_gpt_step on one rank,
 * bench_fsdp_step on a sim world, bench_gpt_gloo and bench_gpt_gpu one rank per process): the
 * model shape and its command-line options, the fixed token batch, one rank's FSDP-wrapped model
 * and its AdamW, one timed training step, the medians of the phases, and small timing helpers.
 * The model, its units and AdamW's parameter groups are the library's GPT recipe
 * (fsdp/gpt_recipe.h), which fsdp-train trains with too.
 *
 * Header-only (static functions) because each benchmark is one program of its own: nothing
 * here is part of the library. The batch generator must stay the same function as the one in
 * bench/gpt_step_torch.py, which draws the same tokens for the PyTorch side, and that file's
 * adamw_groups must stay the recipe's two groups.
 */
#ifndef FSDP_BENCH_UTIL_H
#define FSDP_BENCH_UTIL_H

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <fsdp/autograd.h>
#include <fsdp/context.h>
#include <fsdp/device.h>
#include <fsdp/errno.h>
#include <fsdp/fsdp.h>
#include <fsdp/gpt_recipe.h>
#include <fsdp/launch.h>
#include <fsdp/mem.h>
#include <fsdp/nn.h>
#include <fsdp/optim.h>
#include <fsdp/pg.h>
#include <fsdp/policy.h>
#include <fsdp/rng.h>
#include <fsdp/tensor.h>
#include <fsdp/transformer.h>

/* The phases of a step, timed separately, and their names in the reports. */
enum { PH_ZERO = 0, PH_FWD, PH_BWD, PH_OPT, PH_STEP, PH_COUNT };
static const char *const bench_phase_name[PH_COUNT] = {"zero_grad", "forward+loss", "backward",
                                                       "optimizer", "step"};

/* The GPT model and batch of a benchmark. */
typedef struct bench_gpt_shape {
    int64_t layers, d, heads, seq, batch, vocab;
} bench_gpt_shape_t;

/* The defaults: a ~14 M-parameter GPT-2 (6 blocks, d 384, 6 heads, T 128, B 8, vocab 8192),
 * and the --quick smoke-test shape. */
static const bench_gpt_shape_t bench_gpt_default = {6, 384, 6, 128, 8, 8192};
static const bench_gpt_shape_t bench_gpt_quick = {2, 64, 4, 32, 2, 256};

/* The usage lines of the shape options, for a benchmark's --help. */
#define BENCH_GPT_SHAPE_USAGE                                                                   \
    "  --layers N      transformer blocks (default 6)\n"                                        \
    "  --d N           model width d_model (default 384)\n"                                     \
    "  --heads N       attention heads, divides d (default 6)\n"                                \
    "  --seq N         sequence length T (default 128)\n"                                       \
    "  --batch N       sequences per batch B (default 8)\n"                                     \
    "  --vocab N       vocabulary size (default 8192)\n"

static inline double bench_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* splitmix64 (Steele, Lea and Flood); gpt_step_torch.py implements the same function. */
static inline uint64_t bench_splitmix64(uint64_t *state) {
    uint64_t z = (*state += UINT64_C(0x9E3779B97F4A7C15));
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
}

static inline int bench_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of v[0..n) (sorts v). */
static inline double bench_median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Parses an integer option value in [lo, hi]; returns 0, or -1 after printing why. */
static inline int bench_parse_i64(const char *prog, const char *opt, const char *s,
                                  int64_t lo, int64_t hi, int64_t *out) {
    char *end = NULL;
    long long v = s ? strtoll(s, &end, 10) : 0;
    if (!s || end == s || *end != '\0' || v < lo || v > hi) {
        fprintf(stderr, "%s: %s needs an integer in [%lld, %lld], got '%s'\n", prog, opt,
                (long long)lo, (long long)hi, s ? s : "");
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

/* Takes opt (with its value val) when it is one of the shape options: returns 1 when taken,
 * 0 when opt is not a shape option, -1 for a bad value (printed). */
static inline int bench_shape_option(const char *prog, const char *opt, const char *val,
                                     bench_gpt_shape_t *s) {
    static const struct {
        const char *name;
        int64_t lo, hi;
        size_t field;
    } opts[] = {
        {"--layers", 0, 1000, offsetof(bench_gpt_shape_t, layers)},
        {"--d", 1, 65536, offsetof(bench_gpt_shape_t, d)},
        {"--heads", 1, 4096, offsetof(bench_gpt_shape_t, heads)},
        {"--seq", 1, 1 << 20, offsetof(bench_gpt_shape_t, seq)},
        {"--batch", 1, 1 << 20, offsetof(bench_gpt_shape_t, batch)},
        {"--vocab", 1, INT64_C(1) << 31, offsetof(bench_gpt_shape_t, vocab)},
    };
    for (size_t i = 0; i < sizeof opts / sizeof opts[0]; i++) {
        if (strcmp(opt, opts[i].name) != 0) continue;
        int64_t v;
        if (bench_parse_i64(prog, opt, val, opts[i].lo, opts[i].hi, &v) < 0) return -1;
        memcpy((char *)s + opts[i].field, &v, sizeof v);
        return 1;
    }
    return 0;
}

/* What the AdamW header line of every report says about weight decay (the recipe's groups); the
 * PyTorch twins print the same words. */
#define BENCH_DECAY_NOTE "on matrices but wpe, not on vectors"

/* What every GPT step benchmark takes from its command line. */
typedef struct bench_common {
    bench_gpt_shape_t m;
    int steps, warmup;   /* timed steps, and untimed ones before them */
    uint64_t seed;       /* of the batches and of the initialisation */
    fsdp_adam_options_t adamw; /* the recipe's; --lr sets the learning rate */
} bench_common_t;

/* The defaults: the default shape, 10 timed steps after 2 warm-up steps, seed 1234, the GPT
 * recipe's AdamW (lr 1e-3, betas 0.9, 0.95, eps 1e-8, weight decay 0.1 on the decayed group). */
static inline bench_common_t bench_common_default(void) {
    bench_common_t c = {bench_gpt_default, 10, 2, 1234, {0}};
    fsdp_gpt_recipe_adamw_options_init(&c.adamw);
    return c;
}

/* The usage lines of the common options (the shape options come first). */
#define BENCH_COMMON_USAGE                                                                         \
    BENCH_GPT_SHAPE_USAGE                                                                          \
    "  --steps N       timed steps (default 10)\n"                                                 \
    "  --warmup N      untimed steps before them (default 2)\n"                                    \
    "  --seed N        seed of the batches and of the initialisation (default 1234)\n"             \
    "  --lr X          AdamW learning rate (default 1e-3; betas 0.9, 0.95, eps 1e-8,\n"            \
    "                  weight decay 0.1 on the matrices but wpe, none on vectors: the\n"           \
    "                  GPT recipe of fsdp-train)\n"                                                \
    "  --quick         tiny model (2 blocks, d 64, 4 heads, T 32, B 2, vocab 256),\n"              \
    "                  1 warm-up and 2 timed steps: a smoke test; later options override\n"

/*
 * Takes opt when it is a common option: returns 1 when it took opt and its value val, 2 when
 * it took opt alone (a flag), 0 when opt is not a common option, -1 for a bad value (printed).
 * max_seed bounds --seed (a benchmark that adds the rank to the seed leaves room for it).
 */
static inline int bench_common_option(const char *prog, const char *opt, const char *val,
                                      uint64_t max_seed, bench_common_t *c) {
    int64_t v;
    int rc;
    if (strcmp(opt, "--quick") == 0) {
        c->m = bench_gpt_quick;
        c->steps = 2, c->warmup = 1;
        return 2;
    }
    if ((rc = bench_shape_option(prog, opt, val, &c->m)) != 0) return rc;
    if (strcmp(opt, "--steps") == 0) {
        if (bench_parse_i64(prog, opt, val, 1, 1000000, &v) < 0) return -1;
        c->steps = (int)v;
    } else if (strcmp(opt, "--warmup") == 0) {
        if (bench_parse_i64(prog, opt, val, 0, 1000000, &v) < 0) return -1;
        c->warmup = (int)v;
    } else if (strcmp(opt, "--seed") == 0) {
        if (bench_parse_i64(prog, opt, val, 0, (int64_t)max_seed, &v) < 0) return -1;
        c->seed = (uint64_t)v;
    } else if (strcmp(opt, "--lr") == 0) {
        char *end = NULL;
        double x = val ? strtod(val, &end) : -1.0;
        if (!val || end == val || *end != '\0' || !(x >= 0.0)) {
            fprintf(stderr, "%s: --lr needs a number >= 0, got '%s'\n", prog, val ? val : "");
            return -1;
        }
        c->adamw.lr = x;
    } else {
        return 0;
    }
    return 1;
}

/* A benchmark's own options: returns 1 when it took opt and its value val, 2 when it took opt
 * alone (a flag), 0 when opt is not one of them, -1 for a bad value (printed). It also sees
 * --quick, after the common options took it, and may then change its own defaults. */
typedef int (*bench_extra_fn)(void *o, const char *prog, const char *opt, const char *val);

static inline int bench_shape_check(const char *prog, const bench_gpt_shape_t *s);

/* --threads N as a benchmark's only option of its own: a bench_extra_fn over an int (the
 * count of compute threads). */
static inline int bench_threads_option(void *threads, const char *prog, const char *opt,
                                       const char *val) {
    int64_t v = 0;
    if (strcmp(opt, "--threads") != 0) return 0;
    if (bench_parse_i64(prog, opt, val, 1, 4096, &v) < 0) return -1;
    *(int *)threads = (int)v;
    return 1;
}

/* Parses a benchmark's command line into c (the common options) and, through extra (may be
 * NULL), into o: --help or -h prints usage on stdout. Returns 0 to run, 1 after --help, -1
 * for bad options (printed). */
static inline int bench_parse_args(const char *prog, int argc, char **argv, uint64_t max_seed,
                                   bench_common_t *c, bench_extra_fn extra, void *o,
                                   void (*usage)(FILE *)) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = bench_common_option(prog, a, val, max_seed, c);
        if (rc < 0) return -1;
        if (rc == 2 && extra && extra(o, prog, a, val) < 0) return -1; /* --quick */
        if (rc == 2) continue;
        if (rc == 1) {
            i++;
            continue;
        }
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 1;
        }
        rc = extra ? extra(o, prog, a, val) : 0;
        if (rc < 0) return -1;
        if (rc == 0) {
            fprintf(stderr, "%s: unknown option '%s' (try --help)\n", prog, a);
            return -1;
        }
        if (rc == 1) i++;
    }
    return bench_shape_check(prog, &c->m);
}

/* Checks what the options cannot check one by one; returns 0, or -1 after printing why. */
static inline int bench_shape_check(const char *prog, const bench_gpt_shape_t *s) {
    if (s->d % s->heads != 0) {
        fprintf(stderr, "%s: --heads %lld must divide --d %lld\n", prog, (long long)s->heads,
                (long long)s->d);
        return -1;
    }
    return 0;
}

/* Parameters of the GPT model (the embeddings, 12 d^2 + 13 d per block, the final norm). */
static inline int64_t bench_gpt_params(const bench_gpt_shape_t *s) {
    return s->vocab * s->d + s->seq * s->d + s->layers * (12 * s->d * s->d + 13 * s->d) +
           2 * s->d;
}

/* The GPT model of the shape on ctx's device, f32, no dropout, in training mode, its weights
 * from stream 0 of the seed (the recipe's fsdp_gpt_recipe_create_model). */
static inline int bench_gpt_create(fsdp_ctx_t *ctx, const bench_gpt_shape_t *s, uint64_t seed,
                                   fsdp_module_t **out) {
    fsdp_gpt_config_t cfg;
    fsdp_gpt_config_init(&cfg);
    cfg.vocab = s->vocab;
    cfg.max_seq = s->seq;
    cfg.n_layer = s->layers;
    cfg.n_head = s->heads;
    cfg.d_model = s->d;
    cfg.d_ff = 4 * s->d;
    cfg.dropout = 0.0;
    return fsdp_gpt_recipe_create_model(ctx, &cfg, seed, out);
}

/* The batch: B sequences of T + 1 tokens from splitmix64(seed); inputs are the first T of each,
 * targets the last T (so the targets are the inputs shifted by one). */
static inline int bench_make_batch(fsdp_ctx_t *ctx, const bench_gpt_shape_t *s, uint64_t seed,
                                   fsdp_tensor_t **tokens, fsdp_tensor_t **targets) {
    int64_t b = s->batch, t = s->seq;
    size_t n = (size_t)(b * t);
    int64_t *in = malloc(n * sizeof *in), *tg = malloc(n * sizeof *tg);
    int rc = FSDP_ENOMEM;
    if (in && tg) {
        uint64_t state = seed;
        for (int64_t i = 0; i < b; i++) {
            int64_t prev = (int64_t)(bench_splitmix64(&state) % (uint64_t)s->vocab);
            for (int64_t j = 0; j < t; j++) {
                int64_t next = (int64_t)(bench_splitmix64(&state) % (uint64_t)s->vocab);
                in[i * t + j] = prev;
                tg[i * t + j] = next;
                prev = next;
            }
        }
        const int64_t shape[2] = {b, t};
        rc = fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, 2, shape, in, FSDP_MEM_OTHER, tokens);
        if (rc == 0)
            rc = fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, 2, shape, tg, FSDP_MEM_OTHER,
                                       targets);
    }
    free(in);
    free(tg);
    return rc;
}

/* The forward of a step: sets *loss (a scalar that requires grad). */
typedef int (*bench_loss_fn)(void *arg, fsdp_tensor_t **loss);

/*
 * One training step: zero_grad (set to none), loss_fn, backward, optimizer step. ph[] receives
 * the seconds of each phase, *loss the loss. On failure returns the status and sets *failed to
 * the name of the phase.
 */
static inline int bench_train_step(fsdp_optim_t *opt, bench_loss_fn loss_fn, void *arg,
                                   double ph[PH_COUNT], double *loss, const char **failed) {
    fsdp_tensor_t *l = NULL;
    int rc;
    double t0 = bench_now_s();
    if ((rc = fsdp_optim_zero_grad(opt, true)) < 0) return *failed = "zero_grad", rc;
    double t1 = bench_now_s();
    if ((rc = loss_fn(arg, &l)) < 0) return *failed = "forward", rc;
    rc = fsdp_tensor_item(l, 0, loss);
    double t2 = bench_now_s();
    if (rc == 0) rc = fsdp_backward(l, NULL);
    fsdp_tensor_release(l);
    if (rc < 0) return *failed = "backward", rc;
    double t3 = bench_now_s();
    if ((rc = fsdp_optim_step(opt)) < 0) return *failed = "optimizer step", rc;
    double t4 = bench_now_s();
    ph[PH_ZERO] = t1 - t0;
    ph[PH_FWD] = t2 - t1;
    ph[PH_BWD] = t3 - t2;
    ph[PH_OPT] = t4 - t3;
    ph[PH_STEP] = t4 - t0;
    return 0;
}

/* The median of each phase over the timed steps: t is [step][phase] for warmup + steps steps,
 * med[] receives PH_COUNT medians; *lo and *hi (when not NULL) the fastest and slowest timed
 * step. Returns 0, or -1 when out of memory. */
static inline int bench_phase_medians(const double *t, int warmup, int steps, double med[PH_COUNT],
                                      double *lo, double *hi) {
    const double *v = t + (size_t)warmup * PH_COUNT;
    double *col = calloc((size_t)steps, sizeof *col);
    if (!col) return -1;
    for (int p = 0; p < PH_COUNT; p++) {
        for (int k = 0; k < steps; k++)
            col[k] = v[(size_t)k * PH_COUNT + (size_t)p];
        med[p] = bench_median(col, steps);
    }
    free(col);
    double mn = INFINITY, mx = 0;
    for (int k = 0; k < steps; k++) {
        double x = v[(size_t)k * PH_COUNT + PH_STEP];
        if (x < mn) mn = x;
        if (x > mx) mx = x;
    }
    if (lo) *lo = mn;
    if (hi) *hi = mx;
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* One rank of a GPT benchmark: its model wrapped by FSDP, one unit per GPTBlock and the root
 * (or left unwrapped for a DDP baseline), its AdamW optimizer and its fixed batch, all by the
 * GPT recipe. */

typedef struct bench_rank {
    fsdp_ctx_t *ctx;
    fsdp_device_t *dev; /* the compute device when the benchmark made one (owned), or NULL */
    fsdp_module_t *model;
    fsdp_unit_t *root; /* NULL until bench_rank_wrap */
    fsdp_optim_t *opt;
    fsdp_tensor_t *tokens, *targets; /* (B, T) int64 */
    size_t nunits;
    int64_t nparams; /* of the model before wrapping */
    char err[768];   /* the first failure: "rank R: what failed: status (detail)" */
} bench_rank_t;

/* Makes the rank's context from the launcher's environment (fsdp_init_from_env, RANK,
 * WORLD_SIZE, FSDP_STORE, FSDP_BACKEND) with the given seed; on failure says why on stderr and
 * returns the status. */
static inline int bench_rank_init(const char *prog, bench_rank_t *s, uint64_t seed) {
    fsdp_init_options_t io;
    fsdp_init_options_init(&io);
    io.seed = seed;
    char msg[1024];
    int rc = fsdp_init_from_env(&io, &s->ctx, msg, sizeof msg);
    if (rc < 0)
        fprintf(stderr, "%s: fsdp_init_from_env failed: %s: %s\n", prog, fsdp_err_name(rc),
                msg);
    return rc;
}

/* Records the first failure of the rank in s->err; returns rc (FSDP_EINTERNAL when rc >= 0). */
static inline int bench_rank_fail(bench_rank_t *s, const char *what, int rc) {
    if (!s->err[0])
        snprintf(s->err, sizeof s->err, "rank %d: %s failed: %s (%s)", fsdp_ctx_rank(s->ctx), what,
                 fsdp_strerror(rc), fsdp_ctx_last_error(s->ctx));
    return rc < 0 ? rc : FSDP_EINTERNAL;
}

/* Records a failure (as bench_rank_fail) and prints the rank's first failure on stderr. */
static inline int bench_rank_report(const char *prog, bench_rank_t *s, const char *what, int rc) {
    rc = bench_rank_fail(s, what, rc);
    fprintf(stderr, "%s: %s\n", prog, s->err);
    return rc;
}

/* The model of shape m on the context's device, the same initial weights on every rank (the
 * context's random stream is reset to (seed, 0) first). */
static inline int bench_rank_model(bench_rank_t *s, const bench_gpt_shape_t *m, uint64_t seed) {
    int rc;
    if ((rc = bench_gpt_create(s->ctx, m, seed, &s->model)) < 0)
        return bench_rank_fail(s, "fsdp_gpt_create", rc);
    s->nparams = fsdp_module_num_params(s->model);
    return FSDP_OK;
}

/* The FSDP options every GPT benchmark starts from: FULL_SHARD, BACKWARD_PRE,
 * limit_all_gathers 2 (the caller may change any of them before bench_rank_wrap, which adds
 * the recipe's: its auto-wrap policy and use_orig_params). */
static inline void bench_fsdp_options(fsdp_options_t *fo) {
    fsdp_options_init(fo);
    fo->strategy = FSDP_FULL_SHARD;
    fo->backward_prefetch = FSDP_BACKWARD_PRE;
    fo->limit_all_gathers = 2;
}

/* Wraps the model with fo by the recipe (fsdp_gpt_recipe_wrap: every GPTBlock a unit of its
 * own, use_orig_params), and checks that wrapping made one unit per block and the root, which
 * the benchmarks' header lines say. */
static inline int bench_rank_wrap(bench_rank_t *s, const bench_gpt_shape_t *m,
                                  const fsdp_options_t *fo) {
    int rc;
    if ((rc = fsdp_gpt_recipe_wrap(s->model, fo, &s->root)) < 0)
        return bench_rank_fail(s, "fsdp_wrap", rc);
    fsdp_unit_t **units = NULL;
    if ((rc = fsdp_units(s->root, &units, &s->nunits)) < 0)
        return bench_rank_fail(s, "fsdp_units", rc);
    free(units);
    if (s->nunits != (size_t)m->layers + 1) {
        snprintf(s->err, sizeof s->err,
                 "rank %d: wrapping made %zu units, expected one per block and the root (%lld)",
                 fsdp_ctx_rank(s->ctx), s->nunits, (long long)m->layers + 1);
        return FSDP_EINTERNAL;
    }
    return FSDP_OK;
}

/* The recipe's AdamW (hyper-parameters h) over the model, wrapped or not, and the rank's batch:
 * rank r trains on its own batch drawn from splitmix64(seed + r). */
static inline int bench_rank_train_setup(bench_rank_t *s, const bench_gpt_shape_t *m,
                                         const fsdp_adam_options_t *h, uint64_t seed) {
    int rc = fsdp_gpt_recipe_create_adamw(s->model, h, &s->opt);
    if (rc < 0) return bench_rank_fail(s, "creating the optimizer", rc);
    rc = bench_make_batch(s->ctx, m, seed + (uint64_t)fsdp_ctx_rank(s->ctx), &s->tokens,
                          &s->targets);
    if (rc < 0) return bench_rank_fail(s, "making the batch", rc);
    return FSDP_OK;
}

/* Releases what the rank holds (its device last, once the context no longer uses it). */
static inline void bench_rank_teardown(bench_rank_t *s) {
    fsdp_tensor_release(s->tokens);
    fsdp_tensor_release(s->targets);
    fsdp_optim_destroy(s->opt);
    fsdp_unit_destroy(s->root);
    fsdp_module_release(s->model);
    s->tokens = s->targets = NULL;
    s->opt = NULL;
    s->root = NULL;
    s->model = NULL;
    if (s->dev) {
        fsdp_ctx_set_device(s->ctx, NULL);
        fsdp_device_destroy(s->dev);
        s->dev = NULL;
    }
}

/* The forward and mean cross-entropy of the wrapped model on the rank's batch (a
 * bench_loss_fn over a bench_rank_t). */
static inline int bench_rank_loss(void *arg, fsdp_tensor_t **loss) {
    bench_rank_t *s = arg;
    return fsdp_gpt_forward_loss(s->model, s->tokens, s->targets, loss, NULL);
}

/* The two header lines of a run: the model and its units, and the optimizer and steps. */
static inline void bench_print_setup(const bench_rank_t *s, const bench_common_t *c) {
    printf("# params %lld; %zu units (one per GPTBlock + the root); BACKWARD_PRE, "
           "limit_all_gathers 2, use_orig_params\n",
           (long long)s->nparams, s->nunits);
    printf("# AdamW lr %g betas (%g, %g) eps %g weight_decay %g (" BENCH_DECAY_NOTE "); seed "
           "%llu; %d warm-up + %d timed steps\n",
           c->adamw.lr, c->adamw.beta1, c->adamw.beta2, c->adamw.eps, c->adamw.weight_decay,
           (unsigned long long)c->seed, c->warmup, c->steps);
}

/* ---------------------------------------------------------------------------------------- */
/* The results of a multi-rank run (one rank per process or per thread) */

/* The library-counted peaks a run reports, in bytes: total, params, grads, optim, activations. */
enum { BENCH_MEM_N = 5 };
static inline void bench_mem_peaks(fsdp_ctx_t *ctx, double mem[BENCH_MEM_N]) {
    fsdp_mem_stats_t ms;
    fsdp_mem_get_stats(ctx, &ms);
    mem[0] = (double)ms.total_peak;
    mem[1] = (double)ms.peak[FSDP_MEM_PARAMS];
    mem[2] = (double)ms.peak[FSDP_MEM_GRADS];
    mem[3] = (double)ms.peak[FSDP_MEM_OPTIM];
    mem[4] = (double)ms.peak[FSDP_MEM_ACTIVATIONS];
}

/*
 * Combines the ranks' results over pg, in place: t ([step][phase], seconds) becomes the slowest
 * rank's, loss the mean over the ranks, mem[0..nmem) the largest rank's. Returns a negative
 * status when a collective failed (reported on stderr), 1 when a loss is not finite (rank 0
 * says which), else 0.
 */
static inline int bench_rank_results(bench_rank_t *s, const char *prog, double *t, double *loss,
                                     int nsteps, double *mem, size_t nmem) {
    fsdp_pg_t *pg = fsdp_ctx_pg(s->ctx);
    int rc;
    if ((rc = fsdp_pg_all_reduce(pg, t, t, (size_t)nsteps * PH_COUNT, FSDP_DTYPE_F64,
                                 FSDP_REDOP_MAX, NULL)) < 0 ||
        (rc = fsdp_pg_all_reduce(pg, loss, loss, (size_t)nsteps, FSDP_DTYPE_F64, FSDP_REDOP_AVG,
                                 NULL)) < 0 ||
        (rc = fsdp_pg_all_reduce(pg, mem, mem, nmem, FSDP_DTYPE_F64, FSDP_REDOP_MAX, NULL)) < 0)
        return bench_rank_report(prog, s, "gathering the results", rc);
    int bad = 0;
    for (int k = 0; k < nsteps; k++)
        if (!isfinite(loss[k])) {
            if (fsdp_ctx_rank(s->ctx) == 0)
                fprintf(stderr, "%s: the loss of step %d is not finite\n", prog, k + 1);
            bad = 1;
        }
    return bad;
}

/* The per-step lines of a report: loss and step time, the warm-up steps marked. */
static inline void bench_print_steps(const double *t, const double *loss, int warmup,
                                     int nsteps) {
    for (int k = 0; k < nsteps; k++)
        printf("step %3d%s loss %.6f  ms %.1f\n", k + 1, k >= warmup ? "        " : " (warmup)",
               loss[k], t[(size_t)k * PH_COUNT + PH_STEP] * 1e3);
}

/* The phase medians line ("phases median ms<note>: zero_grad x ..."), and the memory line of
 * bench_mem_peaks's values ("memory (<what> of the largest rank after the warm-up): ..."). */
static inline void bench_print_phases_mem(const char *note, const double med[PH_COUNT],
                                          const char *what, const double mem[BENCH_MEM_N]) {
    printf("phases median ms%s:", note);
    for (int p = 0; p < PH_STEP; p++)
        printf(" %s %.1f", bench_phase_name[p], med[p] * 1e3);
    printf("\n");
    printf("memory (%s of the largest rank after the warm-up): %.1f MiB (params %.1f, grads %.1f, "
           "optim %.1f, activations %.1f)\n",
           what, mem[0] / 1048576.0, mem[1] / 1048576.0, mem[2] / 1048576.0, mem[3] / 1048576.0,
           mem[4] / 1048576.0);
}

#endif /* FSDP_BENCH_UTIL_H */
