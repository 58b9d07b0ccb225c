/*
 * bench_util.h: what the GPT step benchmarks share (bench_gpt_step on one rank,
 * bench_fsdp_step on a sim world): the model shape and its command-line options, the fixed
 * token batch, the AdamW optimizer, one timed training step, and small timing helpers.
 *
 * Header-only (static functions) because each benchmark is one program of its own: nothing
 * here is part of the library. The batch generator must stay the same function as the one in
 * bench/gpt_step_torch.py, which draws the same tokens for the PyTorch side.
 */
#ifndef FSDP_BENCH_UTIL_H
#define FSDP_BENCH_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <fsdp/autograd.h>
#include <fsdp/context.h>
#include <fsdp/errno.h>
#include <fsdp/nn.h>
#include <fsdp/optim.h>
#include <fsdp/tensor.h>
#include <fsdp/transformer.h>

/* The phases of a step, timed separately. */
enum { PH_ZERO = 0, PH_FWD, PH_BWD, PH_OPT, PH_STEP, PH_COUNT };

/* The GPT model and batch of a benchmark. */
typedef struct bench_gpt_shape {
    int64_t layers, d, heads, seq, batch, vocab;
} bench_gpt_shape_t;

/* AdamW's hyper-parameters (weight decay on every parameter). */
typedef struct bench_adamw {
    double lr, beta1, beta2, eps, wd;
} bench_adamw_t;

/* The defaults: a ~14 M-parameter GPT-2 (6 blocks, d 384, 6 heads, T 128, B 8, vocab 8192),
 * and the --quick smoke-test shape. */
static const bench_gpt_shape_t bench_gpt_default = {6, 384, 6, 128, 8, 8192};
static const bench_gpt_shape_t bench_gpt_quick = {2, 64, 4, 32, 2, 256};
static const bench_adamw_t bench_adamw_default = {1e-3, 0.9, 0.95, 1e-8, 0.1};

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

/* What every GPT step benchmark takes from its command line. */
typedef struct bench_common {
    bench_gpt_shape_t m;
    int steps, warmup;   /* timed steps, and untimed ones before them */
    uint64_t seed;       /* of the batches and of the initialisation */
    bench_adamw_t adamw; /* --lr sets the learning rate */
} bench_common_t;

/* The defaults: the default shape, 10 timed steps after 2 warm-up steps, seed 1234. */
static inline bench_common_t bench_common_default(void) {
    return (bench_common_t){bench_gpt_default, 10, 2, 1234, bench_adamw_default};
}

/* The usage lines of the common options (the shape options come first). */
#define BENCH_COMMON_USAGE                                                                      \
    BENCH_GPT_SHAPE_USAGE                                                                       \
    "  --steps N       timed steps (default 10)\n"                                              \
    "  --warmup N      untimed steps before them (default 2)\n"                                 \
    "  --seed N        seed of the batches and of the initialisation (default 1234)\n"         \
    "  --lr X          AdamW learning rate (default 1e-3; betas 0.9, 0.95, eps 1e-8,\n"        \
    "                  weight decay 0.1 on every parameter)\n"                                  \
    "  --quick         tiny model (2 blocks, d 64, 4 heads, T 32, B 2, vocab 256),\n"          \
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

/* The GPT model of the shape on ctx's device, f32, no dropout, in training mode. */
static inline int bench_gpt_create(fsdp_ctx_t *ctx, const bench_gpt_shape_t *s,
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
    int rc = fsdp_gpt_create(ctx, &cfg, out);
    if (rc == 0) fsdp_module_train(*out, true);
    return rc;
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

/* AdamW over params, one group. */
static inline int bench_adamw_create(fsdp_ctx_t *ctx, const bench_adamw_t *h,
                                     const fsdp_named_list_t *params, fsdp_optim_t **out) {
    fsdp_adam_options_t a;
    fsdp_adamw_options_init(&a);
    a.lr = h->lr;
    a.beta1 = h->beta1;
    a.beta2 = h->beta2;
    a.eps = h->eps;
    a.weight_decay = h->wd;
    int rc = fsdp_optim_adam_create(ctx, &a, true, out);
    if (rc == 0)
        rc = fsdp_optim_add_group(*out, params->n, params->tensors,
                                  (const char *const *)params->names, NULL, NULL);
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

#endif /* FSDP_BENCH_UTIL_H */
