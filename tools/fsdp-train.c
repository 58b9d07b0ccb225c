/*
 * fsdp-train.c: trains a GPT with FSDP; libfsdp's main job.
 *
 * Every rank builds the same model (the random stream is re-seeded with stream 0, so the initial
 * weights do not depend on the rank or the world size), wraps each GPTBlock as a unit under a
 * root unit that keeps the embeddings and the final norm (the head reads wte.weight outside its
 * module, so wte must stay in the root), and steps AdamW over the original parameters
 * (use_orig_params), which is what lets weight decay apply to matrices only. The loader gives
 * every rank its rows of the same global batch, so the run does not depend on the world size up
 * to floating-point reduction order.
 *
 * Ranks are sim threads of this process (--backend sim), or this process is one rank under
 * fsdprun (--backend gloo, fsdp_init_from_env). Rank 0 prints, writes the metrics file and the
 * export. Gradient accumulation runs backward grad_accum times before the step: FSDP has no
 * no_sync, so gradients are reduce-scattered after every micro-batch (the result is the same,
 * the traffic grad_accum times larger).
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "train.h"

typedef struct job {
    const train_opts_t *o;
    fsdp_gpt_config_t cfg;
    const fsdp_dataset_t *train, *val;
    bool text;     /* byte-level data: the sample is printed as text */
    bool tty;      /* stdout is a terminal: one updating progress line */
    FILE *metrics; /* rank 0's */
    int world;
} job_t;

typedef struct rank {
    job_t *j;
    fsdp_ctx_t *ctx;
    fsdp_pg_t *pg, *shard_pg, *rep_pg;
    int r, world;
    fsdp_module_t *model;
    fsdp_unit_t *root;
    fsdp_optim_t *opt;
    int ngroups;
    int64_t nparams;
    fsdp_loader_t *train_ld, *val_ld;
    fsdp_tensor_t *in, *tg, *vin, *vtg; /* (rows, T) int64 */
    double *mem_all;                    /* world entries, peak MiB per rank */
} rank_t;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Reports a failure of rank r; a peer's failure seen as FSDP_EREMOTE is a consequence and is
 * left to the rank that caused it. */
static int fail(const rank_t *k, const char *what, int rc) {
    if (rc != FSDP_EREMOTE)
        fprintf(stderr, TRAIN_PROG ": rank %d: %s failed: %s (%s)\n", k->r, what, fsdp_strerror(rc),
                k->ctx ? fsdp_ctx_last_error(k->ctx) : "");
    return rc < 0 ? rc : FSDP_EINTERNAL;
}

/* ---- model and optimizer ------------------------------------------------------------------ */

/* The weight-decay rule: AdamW decays matrices (every parameter with two or more dimensions)
 * except the position table wpe.weight; vectors (biases, LayerNorm weights and biases) are not
 * decayed. wte.weight, the token embedding and tied head, is a matrix and is decayed. */
static bool decays(const char *name, int ndim) {
    return ndim >= 2 && strcmp(name, "wpe.weight") != 0;
}

static int load_init(rank_t *k) {
    fsdp_safetensors_t *st = NULL;
    int rc = fsdp_safetensors_open(k->ctx, k->j->o->init_path, &st);
    if (rc < 0) return fail(k, "opening --init", rc);
    fsdp_safetensors_info_t info;
    if (fsdp_safetensors_find(st, "wte.weight", &info) == 0)
        rc = fsdp_safetensors_load_module(st, k->model, true);
    else
        rc = fsdp_gpt2_hf_load(k->model, st, true);
    fsdp_safetensors_close(st);
    return rc < 0 ? fail(k, "loading --init", rc) : 0;
}

static int build(rank_t *k) {
    const train_opts_t *o = k->j->o;
    int rc;
    fsdp_rng_init(fsdp_ctx_rng(k->ctx), o->seed, 0);
    if ((rc = fsdp_gpt_create(k->ctx, &k->j->cfg, &k->model)) < 0)
        return fail(k, "fsdp_gpt_create", rc);
    fsdp_module_train(k->model, true);
    k->nparams = fsdp_module_num_params(k->model);
    if (o->init_path && (rc = load_init(k)) < 0) return rc;

    /* Which names decay, decided on the unwrapped shapes. */
    fsdp_named_list_t orig = {0};
    if ((rc = fsdp_module_named_params(k->model, false, &orig)) < 0)
        return fail(k, "fsdp_module_named_params", rc);
    bool *decay = calloc(orig.n ? orig.n : 1, sizeof *decay);
    if (!decay) {
        fsdp_named_list_free(&orig);
        return fail(k, "allocating", FSDP_ENOMEM);
    }
    for (size_t i = 0; i < orig.n; i++)
        decay[i] = decays(orig.names[i], fsdp_tensor_ndim(orig.tensors[i]));

    fsdp_options_t fo;
    fsdp_options_init(&fo);
    fo.strategy = o->sharding;
    fo.cpu_offload = o->cpu_offload;
    fo.backward_prefetch = o->backward_prefetch;
    fo.forward_prefetch = o->forward_prefetch;
    fo.limit_all_gathers = o->limit_all_gathers;
    fo.use_orig_params = true;
    if (o->sharding == FSDP_HYBRID_SHARD) {
        /* Shard within each half of the world, replicate across the halves. */
        int half = k->world / 2;
        if ((rc = fsdp_pg_split(k->pg, k->r / half, k->r, &k->shard_pg)) < 0 ||
            (rc = fsdp_pg_split(k->pg, k->r % half, k->r, &k->rep_pg)) < 0) {
            free(decay);
            fsdp_named_list_free(&orig);
            return fail(k, "fsdp_pg_split", rc);
        }
        fo.pg = k->shard_pg;
        fo.replicate_pg = k->rep_pg;
    }
    static const char *const block_types[] = {"GPTBlock", NULL};
    fsdp_policy_t *blocks = NULL;
    if ((rc = fsdp_policy_module_types_create(block_types, &blocks)) == 0) {
        fo.auto_wrap_policy = blocks;
        rc = fsdp_wrap(k->model, &fo, &k->root);
        fsdp_policy_release(blocks);
    }
    if (rc < 0) {
        free(decay);
        fsdp_named_list_free(&orig);
        return fail(k, "fsdp_wrap", rc);
    }

    /* AdamW: group 0 decays, group 1 does not. With use_orig_params the optimizer's tensors
     * are the original parameter objects (now views of this rank's shard), in the same
     * order and under the same names as before wrapping. */
    fsdp_named_list_t params = {0};
    fsdp_tensor_t **g[2] = {NULL, NULL};
    const char **gn[2] = {NULL, NULL};
    size_t gcount[2] = {0, 0};
    if ((rc = fsdp_named_params(k->root, &params)) < 0) {
        fail(k, "fsdp_named_params", rc);
        goto out;
    }
    for (int i = 0; i < 2; i++) {
        g[i] = calloc(params.n + 1, sizeof *g[i]);
        gn[i] = calloc(params.n + 1, sizeof *gn[i]);
        if (!g[i] || !gn[i]) {
            rc = fail(k, "allocating", FSDP_ENOMEM);
            goto out;
        }
    }
    for (size_t i = 0; i < params.n; i++) {
        bool d = false;
        for (size_t q = 0; q < orig.n; q++)
            if (strcmp(orig.names[q], params.names[i]) == 0) d = decay[q];
        int gi = d ? 0 : 1;
        g[gi][gcount[gi]] = params.tensors[i];
        gn[gi][gcount[gi]++] = params.names[i];
    }
    fsdp_adam_options_t a;
    fsdp_adamw_options_init(&a);
    a.lr = o->lr;
    a.beta1 = o->beta1;
    a.beta2 = o->beta2;
    a.eps = o->eps;
    a.weight_decay = o->weight_decay;
    if ((rc = fsdp_optim_adam_create(k->ctx, &a, true, &k->opt)) < 0) {
        fail(k, "creating AdamW", rc);
        goto out;
    }
    fsdp_adam_options_t nd = a;
    nd.weight_decay = 0;
    if ((rc = fsdp_optim_add_group(k->opt, gcount[0], g[0], gn[0], NULL, NULL)) < 0 ||
        (rc = fsdp_optim_add_group(k->opt, gcount[1], g[1], gn[1], &nd, NULL)) < 0) {
        fail(k, "fsdp_optim_add_group", rc);
        goto out;
    }
    k->ngroups = 2;
out:
    for (int i = 0; i < 2; i++) {
        free(g[i]);
        free(gn[i]);
    }
    fsdp_named_list_free(&params);
    fsdp_named_list_free(&orig);
    free(decay);
    return rc;
}

static int make_loaders(rank_t *k) {
    const train_opts_t *o = k->j->o;
    fsdp_loader_options_t lo;
    fsdp_loader_options_init(&lo);
    lo.batch_size = o->batch_size;
    lo.seq_len = o->seq_len;
    lo.rank = k->r;
    lo.world_size = k->world;
    lo.shuffle = o->shuffle;
    lo.seed = o->seed;
    int rc = fsdp_loader_create(k->ctx, k->j->train, &lo, &k->train_ld);
    if (rc < 0) return fail(k, "the training loader", rc);
    lo.shuffle = false;
    if ((rc = fsdp_loader_create(k->ctx, k->j->val, &lo, &k->val_ld)) < 0)
        return fail(k, "the validation loader", rc);
    const int64_t shape[2] = {fsdp_loader_rows(k->train_ld), o->seq_len};
    if ((rc = fsdp_tensor_empty(k->ctx, FSDP_DTYPE_I64, 2, shape, FSDP_MEM_OTHER, &k->in)) < 0 ||
        (rc = fsdp_tensor_empty(k->ctx, FSDP_DTYPE_I64, 2, shape, FSDP_MEM_OTHER, &k->tg)) < 0 ||
        (rc = fsdp_tensor_empty(k->ctx, FSDP_DTYPE_I64, 2, shape, FSDP_MEM_OTHER, &k->vin)) < 0 ||
        (rc = fsdp_tensor_empty(k->ctx, FSDP_DTYPE_I64, 2, shape, FSDP_MEM_OTHER, &k->vtg)) < 0)
        return fail(k, "allocating the batch", rc);
    return 0;
}

static void teardown(rank_t *k) {
    fsdp_tensor_release(k->in);
    fsdp_tensor_release(k->tg);
    fsdp_tensor_release(k->vin);
    fsdp_tensor_release(k->vtg);
    fsdp_loader_destroy(k->train_ld);
    fsdp_loader_destroy(k->val_ld);
    fsdp_optim_destroy(k->opt);
    fsdp_destroy(k->root);
    fsdp_module_release(k->model);
    fsdp_pg_destroy(k->shard_pg);
    fsdp_pg_destroy(k->rep_pg);
    free(k->mem_all);
}

/* ---- the steps ---------------------------------------------------------------------------- */

static double lr_at(const train_opts_t *o, int64_t s) {
    if (s < o->warmup) return o->lr * (double)(s + 1) / (double)o->warmup;
    if (o->sched == TRAIN_SCHED_CONSTANT) return o->lr;
    int64_t span = o->steps - o->warmup - 1;
    double p = span > 0 ? (double)(s - o->warmup) / (double)span : 1.0;
    double lo = o->lr * o->min_lr_frac;
    return lo + 0.5 * (1.0 + cos(3.14159265358979323846 * p)) * (o->lr - lo);
}

/* The mean loss over the first val_steps validation batches, the same on every rank. */
static int validate(rank_t *k, double *out) {
    const train_opts_t *o = k->j->o;
    bool was = fsdp_set_grad_enabled(k->ctx, false);
    fsdp_module_train(k->model, false);
    int rc = fsdp_loader_set_position(k->val_ld, 0);
    double sum = 0;
    for (int64_t i = 0; rc == 0 && i < o->val_steps; i++) {
        fsdp_tensor_t *loss = NULL;
        double v = 0;
        rc = fsdp_loader_next_tensors(k->val_ld, k->vin, k->vtg);
        if (rc == 0) rc = fsdp_gpt_forward_loss(k->model, k->vin, k->vtg, &loss, NULL);
        if (rc == 0) rc = fsdp_tensor_item(loss, 0, &v);
        fsdp_tensor_release(loss);
        sum += v;
    }
    fsdp_module_train(k->model, true);
    fsdp_set_grad_enabled(k->ctx, was);
    if (rc < 0) return fail(k, "validation", rc);
    double mean = sum / (double)o->val_steps;
    if ((rc = fsdp_pg_all_reduce(k->pg, &mean, out, 1, FSDP_DTYPE_F64, FSDP_REDOP_AVG, NULL)) < 0)
        return fail(k, "all-reducing the validation loss", rc);
    return 0;
}

typedef struct step_result {
    double loss, lr, norm, seconds;
    fsdp_mem_stats_t mem;
} step_result_t;

static int train_step(rank_t *k, int64_t s, step_result_t *res) {
    const train_opts_t *o = k->j->o;
    int rc;
    res->lr = lr_at(o, s);
    for (int gi = 0; gi < k->ngroups; gi++)
        if ((rc = fsdp_optim_set_lr(k->opt, gi, res->lr)) < 0) return fail(k, "set_lr", rc);
    fsdp_mem_reset_peaks(k->ctx);
    double t0 = now_s();
    if ((rc = fsdp_optim_zero_grad(k->opt, true)) < 0) return fail(k, "zero_grad", rc);
    double lsum = 0;
    for (int64_t m = 0; m < o->grad_accum; m++) {
        fsdp_tensor_t *loss = NULL, *scaled = NULL;
        double v = 0;
        if ((rc = fsdp_loader_next_tensors(k->train_ld, k->in, k->tg)) < 0)
            return fail(k, "reading the batch", rc);
        if ((rc = fsdp_gpt_forward_loss(k->model, k->in, k->tg, &loss, NULL)) < 0)
            return fail(k, "forward", rc);
        rc = fsdp_tensor_item(loss, 0, &v);
        if (rc == 0 && o->grad_accum > 1)
            rc = fsdp_scale(loss, 1.0 / (double)o->grad_accum, &scaled);
        if (rc == 0) rc = fsdp_backward(scaled ? scaled : loss, NULL);
        fsdp_tensor_release(scaled);
        fsdp_tensor_release(loss);
        if (rc < 0) return fail(k, "backward", rc);
        lsum += v;
    }
    double max_norm = o->grad_clip > 0 ? o->grad_clip : INFINITY;
    if ((rc = fsdp_unit_clip_grad_norm(k->root, max_norm, 2.0, &res->norm)) < 0)
        return fail(k, "clip_grad_norm", rc);
    if ((rc = fsdp_optim_step(k->opt)) < 0) return fail(k, "the optimizer step", rc);
    res->seconds = now_s() - t0;
    fsdp_mem_get_stats(k->ctx, &res->mem);
    double mean = lsum / (double)o->grad_accum;
    if ((rc = fsdp_pg_all_reduce(k->pg, &mean, &res->loss, 1, FSDP_DTYPE_F64, FSDP_REDOP_AVG,
                                 NULL)) < 0)
        return fail(k, "all-reducing the loss", rc);
    double peak = (double)res->mem.total_peak / 1048576.0;
    if ((rc = fsdp_pg_all_gather(k->pg, &peak, k->mem_all, 1, FSDP_DTYPE_F64, NULL)) < 0)
        return fail(k, "gathering memory statistics", rc);
    /* Every rank's step time counts: the slowest rank's is the step's. */
    double t = res->seconds;
    if ((rc = fsdp_pg_all_reduce(k->pg, &t, &res->seconds, 1, FSDP_DTYPE_F64, FSDP_REDOP_MAX,
                                 NULL)) < 0)
        return fail(k, "all-reducing the step time", rc);
    return 0;
}

/* ---- output (rank 0) ---------------------------------------------------------------------- */

static void comm_bytes(const rank_t *k, uint64_t out[FSDP_COLL_COUNT]) {
    fsdp_pg_t *groups[3] = {k->pg, k->shard_pg, k->rep_pg};
    memset(out, 0, sizeof(uint64_t) * FSDP_COLL_COUNT);
    for (int i = 0; i < 3; i++) {
        if (!groups[i]) continue;
        fsdp_pg_counters_t c;
        fsdp_pg_get_counters(groups[i], &c);
        for (int q = 0; q < FSDP_COLL_COUNT; q++)
            out[q] += c.bytes[q];
    }
}

static void write_metrics(const rank_t *k, int64_t s, const step_result_t *res) {
    FILE *f = k->j->metrics;
    const train_opts_t *o = k->j->o;
    double tokens = (double)(o->batch_size * o->seq_len * o->grad_accum);
    fprintf(f,
            "{\"type\":\"train\",\"step\":%lld,\"loss\":%.17g,\"lr\":%.17g,\"grad_norm\":%.17g,"
            "\"step_s\":%.6f,\"tokens_per_s\":%.1f,\"mem_rank0\":{",
            (long long)s + 1, res->loss, res->lr, res->norm, res->seconds, tokens / res->seconds);
    for (int c = 0; c < FSDP_MEM_NCAT; c++)
        fprintf(f, "\"%s\":%zu,", fsdp_mem_cat_name((fsdp_mem_cat_t)c), res->mem.current[c]);
    fprintf(f, "\"peak_total\":%zu},\"mem_peak_mib_per_rank\":[", res->mem.total_peak);
    for (int r = 0; r < k->world; r++)
        fprintf(f, "%s%.3f", r ? "," : "", k->mem_all[r]);
    fprintf(f, "],\"comm_bytes_rank0\":{");
    uint64_t b[FSDP_COLL_COUNT];
    comm_bytes(k, b);
    for (int q = 0; q < FSDP_COLL_COUNT; q++)
        fprintf(f, "%s\"%s\":%llu", q ? "," : "", fsdp_coll_name((fsdp_coll_kind_t)q),
                (unsigned long long)b[q]);
    fprintf(f, "}}\n");
    fflush(f);
}

static void write_val(const rank_t *k, int64_t s, double v) {
    if (!k->j->metrics || k->r != 0) return;
    fprintf(k->j->metrics, "{\"type\":\"val\",\"step\":%lld,\"val_loss\":%.17g}\n", (long long)s,
            v);
    fflush(k->j->metrics);
}

static void fmt_duration(double s, char *buf, size_t cap) {
    long t = (long)(s + 0.5);
    if (t >= 3600)
        snprintf(buf, cap, "%ldh%02ldm", t / 3600, t / 60 % 60);
    else if (t >= 60)
        snprintf(buf, cap, "%ldm%02lds", t / 60, t % 60);
    else
        snprintf(buf, cap, "%lds", t);
}

static void progress(const rank_t *k, int64_t s, const step_result_t *res, double elapsed) {
    const train_opts_t *o = k->j->o;
    if (o->quiet) return;
    int64_t done = s + 1;
    int64_t every = o->log_every > 0 ? o->log_every : (o->steps >= 12 ? o->steps / 12 : 1);
    bool plain_line = done == 1 || done == o->steps || done % every == 0;
    if (!k->j->tty && !plain_line) return;
    char eta[32];
    fmt_duration(elapsed / (double)done * (double)(o->steps - done), eta, sizeof eta);
    double tokens = (double)(o->batch_size * o->seq_len * o->grad_accum);
    char mem[256];
    size_t n = 0;
    for (int r = 0; r < k->world && n + 16 < sizeof mem; r++)
        n += (size_t)snprintf(mem + n, sizeof mem - n, "%s%.1f", r ? "/" : "", k->mem_all[r]);
    if (k->j->tty)
        printf("\r\033[Kstep %lld/%lld  loss %.4f  lr %.2e  %.0f tok/s  eta %s  mem MiB %s",
               (long long)done, (long long)o->steps, res->loss, res->lr, tokens / res->seconds, eta,
               mem);
    else
        printf("step %lld/%lld  loss %.4f  lr %.2e  norm %.3f  %.0f tok/s  eta %s  mem MiB %s\n",
               (long long)done, (long long)o->steps, res->loss, res->lr, res->norm,
               tokens / res->seconds, eta, mem);
    fflush(stdout);
}

static void say(const rank_t *k, const char *fmt, ...) {
    if (k->r != 0) return;
    if (k->j->tty) fputs("\r\033[K", stdout);
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    fflush(stdout);
}

/* ---- sampling and export ------------------------------------------------------------------ */

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Draws the next token from the last row of logits (rank 0's choice, made from its RNG). */
static int64_t pick(const train_opts_t *o, float *logit, int64_t v, uint64_t *rng) {
    int64_t best = 0;
    for (int64_t i = 1; i < v; i++)
        if (logit[i] > logit[best]) best = i;
    if (o->temperature == 0) return best;
    /* Keep the top_k largest: find the k-th largest by repeated selection on a copy. */
    float cut = -INFINITY;
    if (o->top_k > 0 && o->top_k < v) {
        float *tmp = malloc((size_t)v * sizeof *tmp);
        if (!tmp) return best;
        memcpy(tmp, logit, (size_t)v * sizeof *tmp);
        for (int64_t kk = 0; kk < o->top_k; kk++) {
            int64_t m = 0;
            for (int64_t i = 1; i < v; i++)
                if (tmp[i] > tmp[m]) m = i;
            cut = tmp[m];
            tmp[m] = -INFINITY;
        }
        free(tmp);
    }
    double sum = 0, top = logit[best]; /* kept: the loop below overwrites logit[] */
    for (int64_t i = 0; i < v; i++) {
        double p = logit[i] >= cut ? exp((logit[i] - top) / o->temperature) : 0.0;
        logit[i] = (float)p;
        sum += p;
    }
    double u = (double)(splitmix64(rng) >> 11) * 0x1.0p-53 * sum, acc = 0;
    for (int64_t i = 0; i < v; i++) {
        acc += logit[i];
        if (u < acc) return i;
    }
    return best;
}

static void print_token(const job_t *j, int64_t t) {
    if (!j->text) {
        printf("%lld ", (long long)t);
        return;
    }
    int c = (int)t;
    putchar(c == '\n' || c == '\t' || (c >= 32 && c < 127) ? c : '?');
}

static int sample(rank_t *k) {
    const train_opts_t *o = k->j->o;
    const fsdp_gpt_config_t *cfg = &k->j->cfg;
    int64_t cap = 0, n = 0;
    int64_t total = (int64_t)strlen(o->prompt) + o->sample_tokens + 1;
    int64_t *toks = malloc((size_t)total * sizeof *toks);
    float *row = malloc((size_t)cfg->vocab * sizeof *row);
    int rc = 0;
    if (!toks || !row) {
        free(toks);
        free(row);
        return fail(k, "allocating the sample", FSDP_ENOMEM);
    }
    cap = total;
    if (k->j->text && o->prompt[0]) {
        for (const char *p = o->prompt; *p; p++)
            toks[n++] = (unsigned char)*p;
    } else {
        rc = fsdp_dataset_read(k->j->val, 0, 1, toks);
        n = 1;
        if (rc < 0) goto out;
    }
    say(k, "sample (%lld tokens, temperature %g, top-k %lld):\n", (long long)o->sample_tokens,
        o->temperature, (long long)o->top_k);
    if (k->r == 0)
        for (int64_t i = 0; i < n; i++)
            print_token(k->j, toks[i]);
    bool was = fsdp_set_grad_enabled(k->ctx, false);
    fsdp_module_train(k->model, false);
    uint64_t rng = o->seed ^ 0x5eedULL;
    for (int64_t i = 0; rc == 0 && i < o->sample_tokens && n < cap; i++) {
        int64_t len = n < cfg->max_seq ? n : cfg->max_seq;
        const int64_t shape[2] = {1, len};
        fsdp_tensor_t *in = NULL, *logits = NULL, *last = NULL;
        rc = fsdp_tensor_from_host(k->ctx, FSDP_DTYPE_I64, 2, shape, toks + (n - len),
                                   FSDP_MEM_OTHER, &in);
        if (rc == 0) rc = fsdp_gpt_forward(k->model, in, &logits);
        if (rc == 0) rc = fsdp_narrow(logits, 1, len - 1, 1, &last);
        if (rc == 0) rc = fsdp_tensor_to_host(last, row, (size_t)cfg->vocab * sizeof *row);
        fsdp_tensor_release(last);
        fsdp_tensor_release(logits);
        fsdp_tensor_release(in);
        int64_t next = 0;
        if (rc == 0 && k->r == 0) next = pick(o, row, cfg->vocab, &rng);
        if (rc == 0) rc = fsdp_pg_broadcast(k->pg, &next, &next, 1, FSDP_DTYPE_I64, 0, NULL);
        if (rc == 0) {
            toks[n++] = next;
            if (k->r == 0) print_token(k->j, next);
        }
    }
    fsdp_module_train(k->model, true);
    fsdp_set_grad_enabled(k->ctx, was);
    if (k->r == 0) {
        putchar('\n');
        fflush(stdout);
    }
out:
    free(toks);
    free(row);
    return rc < 0 ? fail(k, "sampling", rc) : 0;
}

static int export_weights(rank_t *k, int64_t steps) {
    fsdp_summon_options_t so;
    fsdp_summon_options_init(&so);
    so.writeback = false;
    so.rank0_only = true;
    int rc = fsdp_summon_begin(k->root, &so);
    if (rc < 0) return fail(k, "summoning the full parameters", rc);
    int save_rc = 0;
    if (k->r == 0) {
        char step[32];
        snprintf(step, sizeof step, "%lld", (long long)steps);
        fsdp_safetensors_kv_t meta[] = {{"step", step}, {"producer", TRAIN_PROG}};
        save_rc = fsdp_safetensors_save_module(k->model, k->j->o->export_path, meta, 2);
        if (save_rc < 0) fail(k, "--export", save_rc);
    }
    rc = fsdp_summon_end(k->root);
    if (rc < 0) return fail(k, "ending the summon", rc);
    if (save_rc < 0) return save_rc;
    say(k, "exported the weights to %s\n", k->j->o->export_path);
    return 0;
}

/* ---- one rank ----------------------------------------------------------------------------- */

static int rank_main(fsdp_ctx_t *ctx, void *arg) {
    job_t *j = arg;
    const train_opts_t *o = j->o;
    rank_t k = {.j = j,
                .ctx = ctx,
                .pg = fsdp_ctx_pg(ctx),
                .r = fsdp_ctx_rank(ctx),
                .world = fsdp_ctx_world_size(ctx)};
    int rc = 0;
    double v0 = NAN, v1 = NAN, first = NAN, last = NAN;
    if (!(k.mem_all = calloc((size_t)k.world, sizeof *k.mem_all))) {
        rc = fail(&k, "allocating", FSDP_ENOMEM);
        goto out;
    }
    if ((rc = build(&k)) < 0 || (rc = make_loaders(&k)) < 0) goto out;
    if (!o->quiet)
        say(&k,
            "%s: GPT %lld layers, %lld heads, width %lld, context %lld, vocabulary %lld: %lld "
            "parameters\n"
            "%s: %d %s ranks, %s, %lld steps of %lld x %lld tokens%s, AdamW lr %g (%s, warm-up "
            "%lld), data %s (%llu train / %llu val tokens)\n",
            TRAIN_PROG, (long long)j->cfg.n_layer, (long long)j->cfg.n_head,
            (long long)j->cfg.d_model, (long long)j->cfg.max_seq, (long long)j->cfg.vocab,
            (long long)k.nparams, TRAIN_PROG, k.world, fsdp_pg_backend(k.pg),
            fsdp_sharding_strategy_name(o->sharding), (long long)o->steps, (long long)o->batch_size,
            (long long)o->seq_len, o->grad_accum > 1 ? " (accumulated)" : "", o->lr,
            o->sched == TRAIN_SCHED_COSINE ? "cosine" : "constant", (long long)o->warmup,
            fsdp_dataset_path(j->train), (unsigned long long)fsdp_dataset_num_tokens(j->train),
            (unsigned long long)fsdp_dataset_num_tokens(j->val));
    int64_t start = 0;
    if (o->resume) {
        char err[1024] = "";
        uint64_t pos = 0;
        rc = train_ckpt_load(ctx, k.root, k.opt, o->resume, &start, &pos, err, sizeof err);
        if (rc == 0) rc = fsdp_loader_set_position(k.train_ld, pos);
        if (rc < 0) {
            fprintf(stderr, "%s: rank %d: %s\n", TRAIN_PROG, k.r, err[0] ? err : "resume");
            goto out;
        }
        say(&k, "resumed from %s at step %lld\n", o->resume, (long long)start);
    }
    if ((rc = validate(&k, &v0)) < 0) goto out;
    write_val(&k, start, v0);
    if (!o->quiet) say(&k, "step %lld: val loss %.4f\n", (long long)start, v0);
    double t_start = now_s();
    double v = v0;
    for (int64_t s = start; s < o->steps; s++) {
        step_result_t res;
        if ((rc = train_step(&k, s, &res)) < 0) goto out;
        if (!isfinite(res.loss)) {
            if (k.r == 0)
                fprintf(stderr, "\n%s: the loss is not finite at step %lld\n", TRAIN_PROG,
                        (long long)s + 1);
            rc = FSDP_EINVAL;
            goto out;
        }
        if (s == start) first = res.loss;
        last = res.loss;
        if (k.r == 0) {
            if (j->metrics) write_metrics(&k, s, &res);
            progress(&k, s, &res, now_s() - t_start);
        }
        if (o->save_every > 0 && (s + 1) % o->save_every == 0) {
            char err[1024] = "";
            rc = train_ckpt_save(ctx, k.root, k.opt, o->checkpoint_dir, s + 1,
                                 fsdp_loader_get_position(k.train_ld), err, sizeof err);
            if (rc < 0) {
                if (rc != FSDP_EREMOTE) fprintf(stderr, "%s: rank %d: %s\n", TRAIN_PROG, k.r, err);
                goto out;
            }
            if (!o->quiet && !j->tty)
                say(&k, "step %lld: saved %s/step-%lld\n", (long long)s + 1, o->checkpoint_dir,
                    (long long)s + 1);
        }
        bool val_now = (o->val_every > 0 && (s + 1) % o->val_every == 0) || s + 1 == o->steps;
        if (val_now) {
            if ((rc = validate(&k, &v)) < 0) goto out;
            write_val(&k, s + 1, v);
            if (!o->quiet && (s + 1 != o->steps || !j->tty))
                say(&k, "step %lld: val loss %.4f\n", (long long)s + 1, v);
        }
    }
    v1 = v;
    double elapsed = now_s() - t_start;
    if (j->tty && k.r == 0) putchar('\n');
    say(&k, "done: %lld steps in %.1f s; train loss %.4f -> %.4f, val loss %.4f -> %.4f\n",
        (long long)(o->steps - start), elapsed, first, last, v0, v1);
    if (o->sample_tokens > 0 && (rc = sample(&k)) < 0) goto out;
    if (o->export_path && (rc = export_weights(&k, o->steps)) < 0) goto out;
out:
    teardown(&k);
    return rc;
}

/* ---- main --------------------------------------------------------------------------------- */

static int usage_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs(TRAIN_PROG ": ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 2;
}

/* Fills the model configuration from the preset, the flags and the data. */
static int resolve_model(const train_opts_t *o, bool text, uint32_t max_token,
                         fsdp_gpt_config_t *cfg) {
    fsdp_gpt_config_init(cfg);
    if (strcmp(o->model, "tiny") == 0) {
        cfg->n_layer = 4;
        cfg->n_head = 4;
        cfg->d_model = 128;
        cfg->max_seq = 64;
        cfg->vocab = text ? FSDP_DATA_TEXT_VOCAB : 50257;
    } else if (strcmp(o->model, "gpt2-medium") == 0) {
        cfg->n_layer = 24;
        cfg->n_head = 16;
        cfg->d_model = 1024;
    } /* gpt2: fsdp_gpt_config_init's GPT-2 small */
    if (o->n_layer) cfg->n_layer = o->n_layer;
    if (o->n_head) cfg->n_head = o->n_head;
    if (o->n_embd) cfg->d_model = o->n_embd;
    if (o->block_size) cfg->max_seq = o->block_size;
    if (o->vocab_size) cfg->vocab = o->vocab_size;
    if (!o->block_size && cfg->max_seq < o->seq_len) cfg->max_seq = o->seq_len;
    cfg->d_ff = 0;
    cfg->dropout = o->dropout;
    if (cfg->d_model % cfg->n_head != 0)
        return usage_error("%lld heads do not divide the width %lld", (long long)cfg->n_head,
                           (long long)cfg->d_model);
    if (o->seq_len > cfg->max_seq)
        return usage_error("--seq-len %lld is longer than the block size %lld",
                           (long long)o->seq_len, (long long)cfg->max_seq);
    if ((int64_t)max_token >= cfg->vocab)
        return usage_error("the data has token %u, outside the vocabulary of %lld (--vocab-size)",
                           max_token, (long long)cfg->vocab);
    return 0;
}

/* Opens the training and validation data; exit status 2 for bad files or sizes. */
static int open_data(const train_opts_t *o, fsdp_dataset_t **train, fsdp_dataset_t **val) {
    const char *path = o->data ? o->data : fsdp_data_default_corpus();
    if (!path) return usage_error("the default corpus is not installed; give --data FILE");
    /* A silent context, so that a bad file is reported once, by the usage error below, and not
     * also logged by the library. */
    fsdp_ctx_options_t co;
    fsdp_ctx_options_init(&co);
    co.log_level = FSDP_LOG_OFF;
    fsdp_ctx_t *quiet = NULL;
    if (fsdp_ctx_create(&co, &quiet) < 0) return usage_error("out of memory");
    fsdp_dataset_t *all = NULL;
    int rc = fsdp_dataset_open(quiet, path, FSDP_DATA_AUTO, &all);
    if (rc == 0 && o->val_data) rc = fsdp_dataset_open(quiet, o->val_data, FSDP_DATA_AUTO, val);
    fsdp_ctx_destroy(quiet);
    if (rc < 0) {
        fsdp_dataset_destroy(all);
        return usage_error("%s: %s", all ? "--val-data" : "--data", fsdp_data_last_error());
    }
    if (o->val_data) {
        *train = all;
    } else {
        /* Checked here because the split, having no context, would also log its refusal. */
        uint64_t total = fsdp_dataset_num_tokens(all);
        uint64_t nval = (uint64_t)((double)total * FSDP_DATA_DEFAULT_VAL_FRACTION);
        uint64_t need = (uint64_t)(o->batch_size * o->seq_len) + 1;
        if (nval < need || total - nval < need) {
            fsdp_dataset_destroy(all);
            return usage_error("%s: %llu tokens are too few for a training and a validation "
                               "batch of %lld x %lld tokens (10%% is kept for validation)",
                               path, (unsigned long long)total, (long long)o->batch_size,
                               (long long)o->seq_len);
        }
        rc = fsdp_dataset_split(all, FSDP_DATA_DEFAULT_VAL_FRACTION, train, val);
        fsdp_dataset_destroy(all);
        if (rc < 0) return usage_error("--data: %s", fsdp_data_last_error());
    }
    uint64_t need = (uint64_t)(o->batch_size * o->seq_len) + 1;
    if (fsdp_dataset_num_tokens(*train) < need || fsdp_dataset_num_tokens(*val) < need)
        return usage_error("the data is too short for one batch of %lld x %lld tokens "
                           "(%llu training, %llu validation tokens)",
                           (long long)o->batch_size, (long long)o->seq_len,
                           (unsigned long long)fsdp_dataset_num_tokens(*train),
                           (unsigned long long)fsdp_dataset_num_tokens(*val));
    return 0;
}

int main(int argc, char **argv) {
    train_opts_t o;
    int status = train_parse_flags(argc, argv, &o);
    if (status != 0) return status == 1 ? 0 : 2;

    job_t j = {.o = &o, .tty = isatty(STDOUT_FILENO) == 1};
    fsdp_dataset_t *train = NULL, *val = NULL;
    fsdp_ctx_t *ctx = NULL;
    status = 2;
    if (open_data(&o, &train, &val) != 0) goto out;
    j.train = train;
    j.val = val;
    j.text = fsdp_dataset_format(train) == FSDP_DATA_TEXT;
    uint32_t maxtok = fsdp_dataset_max_token(train);
    if (fsdp_dataset_max_token(val) > maxtok) maxtok = fsdp_dataset_max_token(val);
    if (resolve_model(&o, j.text, maxtok, &j.cfg) != 0) goto out;
    if (o.backend == TRAIN_BACKEND_GLOO) {
        fsdp_init_options_t io;
        fsdp_init_options_init(&io);
        io.seed = o.seed;
        char msg[512];
        if (fsdp_init_from_env(&io, &ctx, msg, sizeof msg) < 0) {
            status = usage_error("--backend gloo: %s (run it under fsdprun)", msg);
            goto out;
        }
        j.world = fsdp_ctx_world_size(ctx);
        if (o.batch_size % j.world != 0) {
            status = usage_error("--batch-size %lld is not a multiple of the world size %d",
                                 (long long)o.batch_size, j.world);
            goto out;
        }
        if (o.sharding == FSDP_HYBRID_SHARD && (j.world < 2 || j.world % 2 != 0)) {
            status = usage_error("--sharding hybrid needs an even world size, not %d", j.world);
            goto out;
        }
        if (fsdp_ctx_rank(ctx) != 0) j.tty = false;
    } else {
        j.world = o.world_size;
    }
    bool rank0 = !ctx || fsdp_ctx_rank(ctx) == 0;
    if (o.metrics && rank0 && !(j.metrics = fopen(o.metrics, "w"))) {
        status = usage_error("--metrics: cannot open %s", o.metrics);
        goto out;
    }
    status = 1;
    int rc;
    if (ctx) {
        rc = rank_main(ctx, &j);
    } else {
        fsdp_sim_options_t so;
        fsdp_sim_options_init(&so);
        so.world_size = o.world_size;
        so.seed = o.seed;
        rc = fsdp_sim_run(&so, rank_main, &j, NULL);
    }
    if (rc == 0) status = 0;
out:
    if (j.metrics && fclose(j.metrics) != 0 && status == 0) {
        fprintf(stderr, TRAIN_PROG ": --metrics: writing %s failed\n", o.metrics);
        status = 1;
    }
    fsdp_ctx_destroy(ctx);
    fsdp_dataset_destroy(train);
    fsdp_dataset_destroy(val);
    return status;
}
