/*
 * bench_gpt_step.c: time of one training step of the GPT model on one rank, on the CPU.
 *
 * A step is what a training loop does per batch: zero_grad (set to none), forward, mean
 * cross-entropy loss, backward, AdamW step. The default model is a small GPT-2 (6 blocks,
 * d_model 384, 6 heads, sequence 128, vocabulary 8192, tied head: 13,842,432 parameters) in f32
 * without dropout, trained on batches of 8 sequences. bench/gpt_step_torch.py runs the same
 * model, batch and optimizer in PyTorch and prints its numbers in the same format, and
 * bench/gpt_step.sh runs both and prints the ratio.
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

#include <fsdp/autograd.h>
#include <fsdp/context.h>
#include <fsdp/device.h>
#include <fsdp/errno.h>
#include <fsdp/mem.h>
#include <fsdp/nn.h>
#include <fsdp/optim.h>
#include <fsdp/tensor.h>
#include <fsdp/transformer.h>

/* The phases of a step, timed separately. */
enum { PH_ZERO = 0, PH_FWD, PH_BWD, PH_OPT, PH_STEP, PH_COUNT };
static const char *const phase_name[PH_COUNT] = {"zero_grad", "forward+loss", "backward",
                                                 "optimizer", "step"};

typedef struct options {
    int64_t layers, d, heads, seq, batch, vocab;
    int steps, warmup, threads;
    uint64_t seed;
    double lr, beta1, beta2, eps, wd;
} options_t;

/* ---------------------------------------------------------------------------------------- */
/* Helpers */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* splitmix64 (Steele, Lea and Flood); gpt_step_torch.py implements the same function. */
static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += UINT64_C(0x9E3779B97F4A7C15));
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of v[0..n) (sorts v). */
static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

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
            "usage: bench_gpt_step [options]\n"
            "  --layers N    transformer blocks (default 6)\n"
            "  --d N         model width d_model (default 384)\n"
            "  --heads N     attention heads, divides d (default 6)\n"
            "  --seq N       sequence length T (default 128)\n"
            "  --batch N     sequences per batch B (default 8)\n"
            "  --vocab N     vocabulary size (default 8192)\n"
            "  --steps N     timed steps (default 10)\n"
            "  --warmup N    untimed steps before them (default 2)\n"
            "  --threads N   compute threads (default FSDP_NUM_THREADS, else all cores)\n"
            "  --seed N      seed of the batch and of the initialisation (default 1234)\n"
            "  --lr X        AdamW learning rate (default 1e-3; betas 0.9, 0.95, eps 1e-8,\n"
            "                weight decay 0.1 on every parameter)\n"
            "  --quick       tiny model (2 blocks, d 64, 4 heads, T 32, B 2, vocab 256),\n"
            "                1 warm-up and 2 timed steps: a smoke test; later options override\n"
            "  --help        this text\n");
}

/* Parses a positive integer option value; returns 0 on success. */
static int parse_i64(const char *opt, const char *s, int64_t lo, int64_t hi, int64_t *out) {
    char *end = NULL;
    long long v = s ? strtoll(s, &end, 10) : 0;
    if (!s || end == s || *end != '\0' || v < lo || v > hi) {
        fprintf(stderr, "bench_gpt_step: %s needs an integer in [%lld, %lld], got '%s'\n", opt,
                (long long)lo, (long long)hi, s ? s : "");
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

/* Returns 0 to run, 1 after --help, -1 for bad options. */
static int parse_options(int argc, char **argv, options_t *o) {
    *o = (options_t){.layers = 6,
                     .d = 384,
                     .heads = 6,
                     .seq = 128,
                     .batch = 8,
                     .vocab = 8192,
                     .steps = 10,
                     .warmup = 2,
                     .threads = default_threads(),
                     .seed = 1234,
                     .lr = 1e-3,
                     .beta1 = 0.9,
                     .beta2 = 0.95,
                     .eps = 1e-8,
                     .wd = 0.1};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        int64_t v = 0;
        int rc = 0;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 1;
        } else if (strcmp(a, "--quick") == 0) {
            o->layers = 2, o->d = 64, o->heads = 4, o->seq = 32, o->batch = 2, o->vocab = 256;
            o->steps = 2, o->warmup = 1;
            continue;
        } else if (strcmp(a, "--lr") == 0) {
            char *end = NULL;
            double x = val ? strtod(val, &end) : -1.0;
            if (!val || end == val || *end != '\0' || !(x >= 0.0)) {
                fprintf(stderr, "bench_gpt_step: --lr needs a number >= 0\n");
                return -1;
            }
            o->lr = x;
        } else if (strcmp(a, "--layers") == 0) {
            if ((rc = parse_i64(a, val, 0, 1000, &v)) == 0) o->layers = v;
        } else if (strcmp(a, "--d") == 0) {
            if ((rc = parse_i64(a, val, 1, 65536, &v)) == 0) o->d = v;
        } else if (strcmp(a, "--heads") == 0) {
            if ((rc = parse_i64(a, val, 1, 4096, &v)) == 0) o->heads = v;
        } else if (strcmp(a, "--seq") == 0) {
            if ((rc = parse_i64(a, val, 1, 1 << 20, &v)) == 0) o->seq = v;
        } else if (strcmp(a, "--batch") == 0) {
            if ((rc = parse_i64(a, val, 1, 1 << 20, &v)) == 0) o->batch = v;
        } else if (strcmp(a, "--vocab") == 0) {
            if ((rc = parse_i64(a, val, 1, INT64_C(1) << 31, &v)) == 0) o->vocab = v;
        } else if (strcmp(a, "--steps") == 0) {
            if ((rc = parse_i64(a, val, 1, 1000000, &v)) == 0) o->steps = (int)v;
        } else if (strcmp(a, "--warmup") == 0) {
            if ((rc = parse_i64(a, val, 0, 1000000, &v)) == 0) o->warmup = (int)v;
        } else if (strcmp(a, "--threads") == 0) {
            if ((rc = parse_i64(a, val, 1, 4096, &v)) == 0) o->threads = (int)v;
        } else if (strcmp(a, "--seed") == 0) {
            if ((rc = parse_i64(a, val, 0, INT64_MAX, &v)) == 0) o->seed = (uint64_t)v;
        } else {
            fprintf(stderr, "bench_gpt_step: unknown option '%s' (try --help)\n", a);
            return -1;
        }
        if (rc < 0) return -1;
        i++; /* the option's value */
    }
    if (o->d % o->heads != 0) {
        fprintf(stderr, "bench_gpt_step: --heads %lld must divide --d %lld\n",
                (long long)o->heads, (long long)o->d);
        return -1;
    }
    return 0;
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
    fprintf(stderr, "bench_gpt_step: %s failed: %s (%s)\n", what, fsdp_strerror(rc),
            r->ctx ? fsdp_ctx_last_error(r->ctx) : "");
    return rc;
}

/* The batch: B sequences of T + 1 tokens from splitmix64(seed); inputs are the first T of each,
 * targets the last T. */
static int make_batch(run_t *r, const options_t *o) {
    int64_t b = o->batch, t = o->seq;
    size_t n = (size_t)(b * t);
    int64_t *in = malloc(n * sizeof *in), *tg = malloc(n * sizeof *tg);
    int rc = FSDP_ENOMEM;
    if (in && tg) {
        uint64_t state = o->seed;
        for (int64_t i = 0; i < b; i++) {
            int64_t prev = (int64_t)(splitmix64(&state) % (uint64_t)o->vocab);
            for (int64_t j = 0; j < t; j++) {
                int64_t next = (int64_t)(splitmix64(&state) % (uint64_t)o->vocab);
                in[i * t + j] = prev;
                tg[i * t + j] = next;
                prev = next;
            }
        }
        const int64_t shape[2] = {b, t};
        rc = fsdp_tensor_from_host(r->ctx, FSDP_DTYPE_I64, 2, shape, in, FSDP_MEM_OTHER,
                                   &r->tokens);
        if (rc == 0)
            rc = fsdp_tensor_from_host(r->ctx, FSDP_DTYPE_I64, 2, shape, tg, FSDP_MEM_OTHER,
                                       &r->targets);
    }
    free(in);
    free(tg);
    return rc;
}

static int setup(run_t *r, const options_t *o) {
    fsdp_ctx_options_t copts;
    fsdp_ctx_options_init(&copts);
    copts.seed = o->seed;
    int rc = fsdp_ctx_create(&copts, &r->ctx);
    if (rc < 0) return fail_msg(r, "fsdp_ctx_create", rc);

    fsdp_device_options_t dopts;
    fsdp_device_options_init(&dopts);
    dopts.num_threads = o->threads;
    if ((rc = fsdp_device_create(r->ctx, FSDP_DEVICE_CPU, &dopts, &r->dev)) < 0)
        return fail_msg(r, "fsdp_device_create", rc);
    if ((rc = fsdp_ctx_set_device(r->ctx, r->dev)) < 0)
        return fail_msg(r, "fsdp_ctx_set_device", rc);

    fsdp_gpt_config_t cfg;
    fsdp_gpt_config_init(&cfg);
    cfg.vocab = o->vocab;
    cfg.max_seq = o->seq;
    cfg.n_layer = o->layers;
    cfg.n_head = o->heads;
    cfg.d_model = o->d;
    cfg.d_ff = 4 * o->d;
    cfg.dropout = 0.0;
    if ((rc = fsdp_gpt_create(r->ctx, &cfg, &r->model)) < 0)
        return fail_msg(r, "fsdp_gpt_create", rc);
    fsdp_module_train(r->model, true);

    fsdp_adam_options_t aopts;
    fsdp_adamw_options_init(&aopts);
    aopts.lr = o->lr;
    aopts.beta1 = o->beta1;
    aopts.beta2 = o->beta2;
    aopts.eps = o->eps;
    aopts.weight_decay = o->wd;
    if ((rc = fsdp_optim_adam_create(r->ctx, &aopts, true, &r->opt)) < 0)
        return fail_msg(r, "fsdp_optim_adam_create", rc);
    fsdp_named_list_t params = {0};
    if ((rc = fsdp_module_named_params(r->model, false, &params)) < 0)
        return fail_msg(r, "fsdp_module_named_params", rc);
    rc = fsdp_optim_add_group(r->opt, params.n, params.tensors,
                              (const char *const *)params.names, NULL, NULL);
    fsdp_named_list_free(&params);
    if (rc < 0) return fail_msg(r, "fsdp_optim_add_group", rc);

    if ((rc = make_batch(r, o)) < 0) return fail_msg(r, "making the batch", rc);
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

/* One training step; ph[] receives the seconds of each phase, *loss the loss. */
static int train_step(run_t *r, double ph[PH_COUNT], double *loss) {
    fsdp_tensor_t *l = NULL;
    int rc;
    double t0 = now_s();
    if ((rc = fsdp_optim_zero_grad(r->opt, true)) < 0) return fail_msg(r, "zero_grad", rc);
    double t1 = now_s();
    if ((rc = fsdp_gpt_forward_loss(r->model, r->tokens, r->targets, &l, NULL)) < 0)
        return fail_msg(r, "forward", rc);
    rc = fsdp_tensor_item(l, 0, loss);
    double t2 = now_s();
    if (rc == 0) rc = fsdp_backward(l, NULL);
    fsdp_tensor_release(l);
    if (rc < 0) return fail_msg(r, "backward", rc);
    double t3 = now_s();
    if ((rc = fsdp_optim_step(r->opt)) < 0) return fail_msg(r, "optimizer step", rc);
    double t4 = now_s();
    ph[PH_ZERO] = t1 - t0;
    ph[PH_FWD] = t2 - t1;
    ph[PH_BWD] = t3 - t2;
    ph[PH_OPT] = t4 - t3;
    ph[PH_STEP] = t4 - t0;
    return 0;
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
        if (!(times[p] = calloc((size_t)o.steps, sizeof(double)))) goto out;

    int64_t nparams = fsdp_module_num_params(r.model);
    double tokens = (double)(o.batch * o.seq);
    printf("# bench_gpt_step: libfsdp, GPT %lld layers, d %lld, %lld heads, seq %lld, batch %lld, "
           "vocab %lld, f32, %d threads\n",
           (long long)o.layers, (long long)o.d, (long long)o.heads, (long long)o.seq,
           (long long)o.batch, (long long)o.vocab, o.threads);
    printf("# params %lld\n", (long long)nparams);
    printf("# AdamW lr %g betas (%g, %g) eps %g weight_decay %g; seed %llu; %d warm-up + %d "
           "timed steps\n",
           o.lr, o.beta1, o.beta2, o.eps, o.wd, (unsigned long long)o.seed, o.warmup, o.steps);
    fflush(stdout);

    size_t allocs_sum = 0;
    fsdp_mem_stats_t ms;
    fsdp_mem_reset_peaks(r.ctx);
    for (int s = 0; s < o.warmup + o.steps; s++) {
        double ph[PH_COUNT], loss = NAN;
        fsdp_mem_get_stats(r.ctx, &ms);
        size_t a0 = ms.allocs;
        if (train_step(&r, ph, &loss) < 0) goto out;
        fsdp_mem_get_stats(r.ctx, &ms);
        bool timed = s >= o.warmup;
        if (timed) {
            for (int p = 0; p < PH_COUNT; p++)
                times[p][s - o.warmup] = ph[p];
            allocs_sum += ms.allocs - a0;
        }
        printf("step %3d%s loss %.6f  ms %.1f\n", s + 1, timed ? "        " : " (warmup)", loss,
               ph[PH_STEP] * 1e3);
        fflush(stdout);
        if (!isfinite(loss)) {
            fprintf(stderr, "bench_gpt_step: the loss is not finite\n");
            goto out;
        }
    }

    double step_min = times[PH_STEP][0], step_max = times[PH_STEP][0];
    for (int i = 1; i < o.steps; i++) {
        if (times[PH_STEP][i] < step_min) step_min = times[PH_STEP][i];
        if (times[PH_STEP][i] > step_max) step_max = times[PH_STEP][i];
    }
    double med[PH_COUNT];
    for (int p = 0; p < PH_COUNT; p++)
        med[p] = median(times[p], o.steps);
    printf("phases median ms:");
    for (int p = 0; p < PH_STEP; p++)
        printf(" %s %.1f", phase_name[p], med[p] * 1e3);
    printf("\n");
    fsdp_mem_get_stats(r.ctx, &ms);
    printf("memory: %.1f allocations/step, peak %.1f MiB (params %.1f, grads %.1f, optim %.1f, "
           "activations %.1f)\n",
           (double)allocs_sum / o.steps, (double)ms.total_peak / 1048576.0,
           (double)ms.peak[FSDP_MEM_PARAMS] / 1048576.0,
           (double)ms.peak[FSDP_MEM_GRADS] / 1048576.0,
           (double)ms.peak[FSDP_MEM_OPTIM] / 1048576.0,
           (double)ms.peak[FSDP_MEM_ACTIVATIONS] / 1048576.0);
    printf("ms/step median %.2f (min %.2f, max %.2f) over %d steps\n", med[PH_STEP] * 1e3,
           step_min * 1e3, step_max * 1e3, o.steps);
    printf("tokens/s %.0f\n", tokens / med[PH_STEP]);
    status = 0;
out:
    for (int p = 0; p < PH_COUNT; p++)
        free(times[p]);
    teardown(&r);
    return status;
}
