/* SPDX-License-Identifier: MIT */
/*
 * fsdp-train.c: trains a GPT with FSDP; libfsdp's main job.
 *
 * Every rank builds the same model (the random stream is re-seeded with stream 0, so the initial
 * weights do not depend on the rank or the world size), wraps each GPTBlock as a unit under a
 * root unit that keeps the embeddings and the final norm (the head reads wte.weight outside its
 * module, so wte must stay in the root), and steps AdamW over the original parameters
 * (use_orig_params), which is what lets weight decay apply to matrices only: the library's GPT
 * recipe (fsdp/gpt_recipe.h), which the benchmarks and tests share. The loader gives
 * every rank its rows of the same global batch, so the run does not depend on the world size up
 * to floating-point reduction order.
 *
 * Ranks are sim threads of this process (--backend sim), or this process is one rank under
 * fsdprun (--backend gloo or nccl, fsdp_init_from_env; nccl: one process per GPU, the device
 * from LOCAL_RANK). With --device cuda the units compute on the rank's GPU (options.device) and
 * the batches, activations and gradients live there; --cpu-offload keeps the shards on the host.
 * Rank 0 prints, writes the metrics file and the export. Gradient accumulation runs backward
 * grad_accum times before the step, all but the last under fsdp_no_sync_begin/_end: each unit keeps
 * an unsharded local gradient and reduces the sum once (--reduce-every-micro-batch reduces each
 * micro-batch instead, with less memory and grad_accum times the traffic).
 *
 * This file runs the steps, the output and main; train_build.c makes the model, units,
 * optimizer and loaders, train_sample.c the sample, train_ckpt.c the checkpoints and export,
 * train_flags.c the command line, train_stop.c the interruption (SIGINT, SIGTERM), the timeouts
 * and what a run takes from the checkpoint it resumes.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tools/train.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
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
static int validate_loss(rank_t *k, double *out) {
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
    if (rc < 0) return train_fail(k, "validation", rc);
    double mean = sum / (double)o->val_steps;
    if ((rc = fsdp_pg_all_reduce(k->pg, &mean, out, 1, FSDP_DTYPE_F64, FSDP_REDOP_AVG, NULL)) < 0)
        return train_fail(k, "all-reducing the validation loss", rc);
    return 0;
}

/* The same, a span of the trace. */
static int validate(rank_t *k, double *out) {
    fsdp_trace_begin(k->ctx, "validation");
    int rc = validate_loss(k, out);
    fsdp_trace_end(k->ctx, "validation");
    return rc;
}

typedef struct step_result {
    double loss, lr, norm, seconds;
    fsdp_mem_stats_t mem;
    int stop; /* the signal the ranks agreed to stop on after this step, or 0 */
} step_result_t;

static int train_step(rank_t *k, int64_t s, step_result_t *res) {
    const train_opts_t *o = k->j->o;
    int rc;
    res->lr = lr_at(o, s);
    for (int gi = 0; gi < k->ngroups; gi++)
        if ((rc = fsdp_optim_set_lr(k->opt, gi, res->lr)) < 0) return train_fail(k, "set_lr", rc);
    fsdp_mem_reset_peaks(k->ctx);
    double t0 = now_s();
    if ((rc = fsdp_optim_zero_grad(k->opt, true)) < 0) return train_fail(k, "zero_grad", rc);
    double lsum = 0;
    bool no_sync = o->grad_accum > 1 && !o->reduce_every_micro;
    if (no_sync && (rc = fsdp_no_sync_begin(k->root)) < 0) return train_fail(k, "no_sync", rc);
    for (int64_t m = 0; m < o->grad_accum; m++) {
        fsdp_tensor_t *loss = NULL, *scaled = NULL, *big = NULL;
        double v = 0;
        /* The last micro-batch's backward reduces what the others accumulated. */
        if (no_sync && m == o->grad_accum - 1 && (rc = fsdp_no_sync_end(k->root)) < 0)
            return train_fail(k, "no_sync", rc);
        if ((rc = fsdp_loader_next_tensors(k->train_ld, k->in, k->tg)) < 0)
            return train_fail(k, "reading the batch", rc);
        if ((rc = fsdp_gpt_forward_loss(k->model, k->in, k->tg, &loss, NULL)) < 0)
            return train_fail(k, "forward", rc);
        rc = fsdp_tensor_item(loss, 0, &v);
        if (rc == 0 && o->grad_accum > 1)
            rc = fsdp_scale(loss, 1.0 / (double)o->grad_accum, &scaled);
        /* f16: backward from the loss times the scaler's scale. */
        if (rc == 0 && k->scaler)
            rc = fsdp_grad_scaler_scale(k->scaler, scaled ? scaled : loss, &big);
        if (rc == 0) rc = fsdp_backward(big ? big : scaled ? scaled : loss, NULL);
        fsdp_tensor_release(big);
        fsdp_tensor_release(scaled);
        fsdp_tensor_release(loss);
        if (rc < 0) return train_fail(k, "backward", rc);
        lsum += v;
    }
    /* f16: the gradients are unscaled before they are clipped (and their norm reported); a step
     * whose gradients overflowed on any rank is skipped, its norm inf or NaN. */
    if (k->scaler && (rc = fsdp_grad_scaler_unscale(k->scaler, k->opt)) < 0)
        return train_fail(k, "unscaling the gradients", rc);
    double max_norm = o->grad_clip > 0 ? o->grad_clip : INFINITY;
    if ((rc = fsdp_unit_clip_grad_norm(k->root, max_norm, 2.0, &res->norm)) < 0)
        return train_fail(k, "clip_grad_norm", rc);
    if (k->scaler) {
        bool stepped = true;
        if ((rc = fsdp_grad_scaler_step(k->scaler, k->opt, &stepped)) < 0)
            return train_fail(k, "the optimizer step", rc);
        if ((rc = fsdp_grad_scaler_update(k->scaler)) < 0)
            return train_fail(k, "updating the gradient scale", rc);
        if (!stepped) k->skipped++;
    } else if ((rc = fsdp_optim_step(k->opt)) < 0) {
        return train_fail(k, "the optimizer step", rc);
    }
    res->seconds = now_s() - t0;
    fsdp_mem_get_stats(k->ctx, &res->mem);
    double mean = lsum / (double)o->grad_accum;
    if ((rc = fsdp_pg_all_reduce(k->pg, &mean, &res->loss, 1, FSDP_DTYPE_F64, FSDP_REDOP_AVG,
                                 NULL)) < 0)
        return train_fail(k, "all-reducing the loss", rc);
    double peak = (double)res->mem.total_peak / 1048576.0;
    if ((rc = fsdp_pg_all_gather(k->pg, &peak, k->mem_all, 1, FSDP_DTYPE_F64, NULL)) < 0)
        return train_fail(k, "gathering memory statistics", rc);
    /* Every rank's step time counts: the slowest rank's is the step's. The same all-reduce
     * carries the stop request (the largest signal number any rank got), so that every rank
     * stops after the same step without a collective of its own. */
    double t[2] = {res->seconds, (double)train_pending_signal()}, mx[2];
    if ((rc = fsdp_pg_all_reduce(k->pg, t, mx, 2, FSDP_DTYPE_F64, FSDP_REDOP_MAX, NULL)) < 0)
        return train_fail(k, "all-reducing the step time", rc);
    res->seconds = mx[0];
    res->stop = (int)mx[1];
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
    const train_opts_t *o = k->j->o;
    double tokens = (double)(o->batch_size * o->seq_len * o->grad_accum);
    json_t *rec = train_metrics_record("train"), *mem = json_object(), *peaks = json_array(),
           *comm = json_object();
    if (!rec || !mem || !peaks || !comm) {
        json_decref(mem);
        json_decref(peaks);
        json_decref(comm);
        json_decref(rec);
        train_metrics_emit(k->j, NULL);
        return;
    }
    json_object_set_new(rec, "step", json_integer(s + 1));
    json_object_set_new(rec, "loss", train_json_num(res->loss));
    json_object_set_new(rec, "lr", train_json_num(res->lr));
    json_object_set_new(rec, "grad_norm", train_json_num(res->norm));
    json_object_set_new(rec, "step_s", train_json_num(res->seconds));
    json_object_set_new(rec, "tokens_per_s", train_json_num(tokens / res->seconds));
    for (int c = 0; c < FSDP_MEM_NCAT; c++)
        json_object_set_new(mem, fsdp_mem_cat_name((fsdp_mem_cat_t)c),
                            json_integer((json_int_t)res->mem.current[c]));
    json_object_set_new(mem, "peak_total", json_integer((json_int_t)res->mem.total_peak));
    json_object_set_new(rec, "mem_rank0", mem);
    /* mem_all holds MiB (total_peak / 2^20, exact in a double): back to bytes, one unit. */
    for (int r = 0; r < k->world; r++)
        json_array_append_new(peaks, json_integer((json_int_t)(k->mem_all[r] * 1048576.0)));
    json_object_set_new(rec, "mem_peak_bytes_per_rank", peaks);
    uint64_t b[FSDP_COLL_COUNT];
    comm_bytes(k, b);
    for (int q = 0; q < FSDP_COLL_COUNT; q++)
        json_object_set_new(comm, fsdp_coll_name((fsdp_coll_kind_t)q),
                            json_integer((json_int_t)b[q]));
    json_object_set_new(rec, "comm_bytes_rank0", comm);
    if (k->scaler) {
        json_object_set_new(rec, "grad_scale",
                            train_json_num(fsdp_grad_scaler_get_scale(k->scaler)));
        json_object_set_new(rec, "skipped_steps", json_integer(k->skipped));
    }
    train_metrics_emit(k->j, rec);
}

static void write_val(const rank_t *k, int64_t s, double v) {
    if (!k->j->metrics || k->r != 0) return;
    json_t *rec = train_metrics_record("val");
    if (rec) {
        json_object_set_new(rec, "step", json_integer(s));
        json_object_set_new(rec, "val_loss", train_json_num(v));
    }
    train_metrics_emit(k->j, rec);
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
    if (k->j->tty) {
        /* One line that never wraps, or \r would no longer return to its start. */
        char line[512];
        snprintf(line, sizeof line,
                 "step %lld/%lld  loss %.4f  lr %.2e  %.0f tok/s  eta %s  mem MiB %s",
                 (long long)done, (long long)o->steps, res->loss, res->lr, tokens / res->seconds,
                 eta, mem);
        int width = k->j->columns - 1;
        if (width >= 0 && (size_t)width < strlen(line)) line[width] = '\0';
        printf("\r\033[K%s", line);
    } else
        printf("step %lld/%lld  loss %.4f  lr %.2e  norm %.3f  %.0f tok/s  eta %s  mem MiB %s\n",
               (long long)done, (long long)o->steps, res->loss, res->lr, res->norm,
               tokens / res->seconds, eta, mem);
    fflush(stdout);
}

void train_say(const rank_t *k, const char *fmt, ...) {
    if (k->r != 0) return;
    if (k->j->tty) fputs("\r\033[K", stdout);
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    fflush(stdout);
}

/* ---- export ------------------------------------------------------------------------------- */

static int export_weights(rank_t *k, int64_t steps) {
    char err[1024] = "";
    const char *path = k->j->o->export_path;
    int rc = k->j->o->export_hf
                 ? train_export_hf(k->ctx, k->root, k->model, path, steps, err, sizeof err)
                 : train_save_full(k->ctx, k->root, k->model, path, steps, err, sizeof err);
    if (rc < 0) {
        if (rc != FSDP_EREMOTE)
            fprintf(stderr, "%s: rank %d: --export: %s\n", TRAIN_PROG, k->r, err);
        return rc;
    }
    train_say(k, "exported the weights to %s%s\n", path,
              k->j->o->export_hf ? " (Hugging Face GPT-2: model.safetensors, config.json)" : "");
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
    /* The whole rank, from building the model and its units to the sample and the export. */
    if (j->trace && (rc = fsdp_trace_start(ctx, j->trace)) < 0) {
        rc = train_fail(&k, "starting the trace", rc);
        goto out;
    }
    if (!(k.mem_all = calloc((size_t)k.world, sizeof *k.mem_all))) {
        rc = train_fail(&k, "allocating", FSDP_ENOMEM);
        goto out;
    }
    if ((rc = train_build(&k)) < 0 || (rc = train_make_loaders(&k)) < 0) goto out;
    if (!o->quiet)
        train_say(
            &k,
            "%s: GPT %lld layers, %lld heads, width %lld, context %lld, vocabulary %lld: %lld "
            "parameters\n"
            "%s: %d %s ranks%s%s, %s, precision %s, %lld steps of %lld x %lld tokens%s, AdamW lr "
            "%g (%s, warm-up %lld), data %s%s (%llu train / %llu val tokens)\n",
            TRAIN_PROG, (long long)j->cfg.n_layer, (long long)j->cfg.n_head,
            (long long)j->cfg.d_model, (long long)j->cfg.max_seq, (long long)j->cfg.vocab,
            (long long)k.nparams, TRAIN_PROG, k.world, fsdp_pg_backend(k.pg), k.dev ? " on " : "",
            k.dev ? fsdp_device_name(k.dev) : "", fsdp_sharding_strategy_name(o->sharding),
            train_precision_name(o->precision), (long long)o->steps, (long long)o->batch_size,
            (long long)o->seq_len, o->grad_accum > 1 ? " (accumulated)" : "", o->lr,
            o->sched == TRAIN_SCHED_COSINE ? "cosine" : "constant", (long long)o->warmup,
            j->encoded ? (o->data ? o->data : fsdp_data_default_corpus())
                       : fsdp_dataset_path(j->train),
            j->encoded ? " encoded by --tokenizer" : "",
            (unsigned long long)fsdp_dataset_num_tokens(j->train),
            (unsigned long long)fsdp_dataset_num_tokens(j->val));
    int64_t start = 0;
    if (j->resume_path) {
        char err[1024] = "";
        train_ckpt_extra_t ex = {.scaler = k.scaler};
        rc = train_ckpt_load(ctx, k.root, k.opt, j->resume_path, &start, &ex, err, sizeof err);
        if (rc == 0 && start > o->steps) {
            snprintf(err, sizeof err, "--resume: %s is at step %lld, past --steps %lld",
                     j->resume_path, (long long)start, (long long)o->steps);
            rc = FSDP_EINVAL;
        }
        if (rc == 0) rc = fsdp_loader_set_position(k.train_ld, ex.position);
        if (rc == 0) k.skipped = ex.skipped;
        if (rc < 0) {
            fprintf(stderr, "%s: rank %d: %s\n", TRAIN_PROG, k.r, err[0] ? err : "resume");
            goto out;
        }
        train_say(&k, "resumed from %s at step %lld\n", j->resume_path, (long long)start);
    }
    if ((rc = validate(&k, &v0)) < 0) goto out;
    write_val(&k, start, v0);
    if (!o->quiet) train_say(&k, "step %lld: val loss %.4f\n", (long long)start, v0);
    double t_start = now_s();
    double v = v0;
    /* a stalled peer is noticed within the training timeout (--timeout) from here on */
    train_set_timeouts(&k, j->train_timeout_ms);
    int64_t done = start;
    int stop = 0;
    bool stopped = false; /* stop_run has run */
    for (int64_t s = start; s < o->steps && !stop; s++) {
        step_result_t res;
        char span[32];
        snprintf(span, sizeof span, "step %lld", (long long)s + 1);
        fsdp_trace_begin(ctx, span);
        rc = train_step(&k, s, &res);
        fsdp_trace_end(ctx, span);
        if (rc < 0) goto out;
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
        done = s + 1;
        if (res.stop) {
            /* every rank saw the same request after this step: stop, save, say how to resume */
            stop = res.stop;
            stopped = true;
            if ((rc = train_stop_run(&k, s + 1, stop)) < 0) goto out;
            break;
        }
        if (o->save_every > 0 && (s + 1) % o->save_every == 0 &&
            (rc = train_save_checkpoint(&k, s + 1)) < 0)
            goto out;
        bool val_now = (o->val_every > 0 && (s + 1) % o->val_every == 0) || s + 1 == o->steps;
        if (val_now) {
            if ((rc = validate(&k, &v)) < 0) goto out;
            write_val(&k, s + 1, v);
            if (!o->quiet && (s + 1 != o->steps || !j->tty))
                train_say(&k, "step %lld: val loss %.4f\n", (long long)s + 1, v);
        }
    }
    train_set_timeouts(&k, j->setup_timeout_ms);
    /* A signal after the last step's agreement: agreed on here, so that every rank skips the
     * collective sample and export alike. */
    if (!stop && (rc = train_agree_stop(&k, &stop)) < 0) goto out;
    if (stop && !stopped && (rc = train_stop_run(&k, done, stop)) < 0) goto out;
    if (stop) goto out;
    v1 = v;
    double elapsed = now_s() - t_start;
    if (j->tty && k.r == 0) putchar('\n');
    if (o->steps > start)
        train_say(&k,
                  "done: %lld steps in %.1f s; train loss %.4f -> %.4f, val loss %.4f -> %.4f\n",
                  (long long)(o->steps - start), elapsed, first, last, v0, v1);
    else /* --steps 0 (evaluate, export), or a resume at the last step: nothing was trained */
        train_say(&k, "done: no training steps; val loss %.4f\n", v1);
    if (k.scaler)
        train_say(&k,
                  "f16 gradient scaler: %lld of %lld steps skipped (inf/NaN gradients), "
                  "final scale %g\n",
                  (long long)k.skipped, (long long)(o->steps - start),
                  fsdp_grad_scaler_get_scale(k.scaler));
    if (o->sample_tokens > 0 && (rc = train_sample(&k)) < 0) goto out;
    if (o->export_path && (rc = export_weights(&k, o->steps)) < 0) goto out;
out:
    train_teardown(&k);
    fsdp_trace_stop(ctx);
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
static int resolve_model(const train_opts_t *o, bool text, int64_t tok_vocab, uint32_t max_token,
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
    if (tok_vocab) cfg->vocab = tok_vocab; /* --tokenizer: its vocabulary, unless --vocab-size */
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

/* --tokenizer DIR: GPT-2's BPE into j->bpe; exit status 2 (one line) when it does not load. */
static int load_tokenizer(const train_opts_t *o, job_t *j) {
    fsdp_ctx_t *quiet = train_quiet_ctx();
    if (!quiet) return usage_error("out of memory");
    int status = 0;
    if (fsdp_bpe_load_dir(quiet, o->tokenizer, &j->bpe) < 0)
        status = usage_error("--tokenizer: %s", fsdp_ctx_last_error(quiet));
    fsdp_ctx_destroy(quiet);
    return status;
}

/* Opens the training and validation data; exit status 2 for bad files or sizes. */
static int open_data(const train_opts_t *o, job_t *j, fsdp_dataset_t **train,
                     fsdp_dataset_t **val) {
    const char *path = o->data ? o->data : fsdp_data_default_corpus();
    if (!path) return usage_error("the default corpus is not installed; give --data FILE");
    /* A silent context holds the library's message, so that a bad file is reported once, by
     * the usage error below, and not also logged by the library. */
    fsdp_ctx_t *quiet = train_quiet_ctx();
    if (!quiet) return usage_error("out of memory");
    fsdp_dataset_t *all = NULL;
    char err[2048] = "";
    bool enc_val = false;
    int rc = train_open_data(quiet, j->bpe, path, &all, &j->encoded, err, sizeof err);
    if (rc == 0 && o->val_data)
        rc = train_open_data(quiet, j->bpe, o->val_data, val, &enc_val, err, sizeof err);
    if (rc < 0) {
        rc = usage_error("%s: %s", all ? "--val-data" : "--data", err);
        goto out;
    }
    if (o->val_data) {
        *train = all;
        all = NULL;
    } else {
        /* Each part must hold a batch: said here in the words of the flags (the split itself
         * refuses only an empty part). */
        uint64_t total = fsdp_dataset_num_tokens(all);
        uint64_t nval = (uint64_t)((double)total * FSDP_DATA_DEFAULT_VAL_FRACTION);
        uint64_t need = (uint64_t)(o->batch_size * o->seq_len) + 1;
        if (nval < need || total - nval < need) {
            rc = usage_error("%s: %llu tokens are too few for a training and a validation "
                             "batch of %lld x %lld tokens (10%% is kept for validation)",
                             path, (unsigned long long)total, (long long)o->batch_size,
                             (long long)o->seq_len);
            goto out;
        }
        rc = fsdp_dataset_split(quiet, all, FSDP_DATA_DEFAULT_VAL_FRACTION, train, val);
        if (rc < 0) {
            rc = usage_error("--data: %s", fsdp_ctx_last_error(quiet));
            goto out;
        }
    }
out:
    fsdp_dataset_destroy(all);
    fsdp_ctx_destroy(quiet);
    if (rc != 0) return rc;
    uint64_t need = (uint64_t)(o->batch_size * o->seq_len) + 1;
    if (fsdp_dataset_num_tokens(*train) < need || fsdp_dataset_num_tokens(*val) < need)
        return usage_error("the data is too short for one batch of %lld x %lld tokens "
                           "(%llu training, %llu validation tokens)",
                           (long long)o->batch_size, (long long)o->seq_len,
                           (unsigned long long)fsdp_dataset_num_tokens(*train),
                           (unsigned long long)fsdp_dataset_num_tokens(*val));
    return 0;
}

/* --device cuda: checks that this process sees a GPU before any rank starts, so that a machine
 * without one gets one line naming CUDA's error (exit status 2) rather than a failure of every
 * rank. It probes the GPU the rank will use ($LOCAL_RANK under fsdprun, as fsdp/nccl.h picks
 * it), so that no process opens a context on another rank's GPU. */
static int probe_cuda(void) {
    fsdp_ctx_t *quiet = train_quiet_ctx();
    if (!quiet) return usage_error("out of memory");
    fsdp_device_options_t d;
    fsdp_device_options_init(&d);
    const char *lr = getenv("LOCAL_RANK");
    if (lr && *lr) d.ordinal = atoi(lr);
    fsdp_device_t *dev = NULL;
    int rc = fsdp_device_create(quiet, FSDP_DEVICE_CUDA, &d, &dev);
    int status = 0;
    if (rc < 0) /* the library names CUDA's error, or says CUDA is not built in */
        status = usage_error("--device cuda: %s", fsdp_ctx_last_error(quiet));
    fsdp_device_destroy(dev);
    fsdp_ctx_destroy(quiet);
    return status;
}

/* Whether stdout takes an updating progress line (a terminal that is not TERM=dumb, which has no
 * cursor control), and how wide it is (the terminal's own size, else $COLUMNS, else 80). */
static void terminal(job_t *j) {
    const char *term = getenv("TERM");
    j->tty = isatty(STDOUT_FILENO) == 1 && term && *term && strcmp(term, "dumb") != 0;
    j->columns = 80;
    struct winsize ws;
    const char *cols = getenv("COLUMNS");
    if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0)
        j->columns = ws.ws_col;
    else if (cols && atoi(cols) > 0)
        j->columns = atoi(cols);
}

int main(int argc, char **argv) {
    train_opts_t o;
    int status = train_parse_flags(argc, argv, &o);
    if (status != 0) return status == 1 ? 0 : 2;

    job_t j = {.o = &o, .argc = argc, .argv = argv};
    terminal(&j);
    train_timeouts(&j);
    train_install_signals();
    fsdp_dataset_t *train = NULL, *val = NULL;
    fsdp_ctx_t *ctx = NULL;
    char *trace_path = NULL;
    status = 2;
    if (o.tokenizer && (status = load_tokenizer(&o, &j)) != 0) goto out;
    status = 2;
    if (open_data(&o, &j, &train, &val) != 0) goto out;
    j.train = train;
    j.val = val;
    j.text = fsdp_dataset_format(train) == FSDP_DATA_TEXT;
    uint32_t maxtok = fsdp_dataset_max_token(train);
    if (fsdp_dataset_max_token(val) > maxtok) maxtok = fsdp_dataset_max_token(val);
    if (resolve_model(&o, j.text, j.bpe ? fsdp_bpe_vocab_size(j.bpe) : 0, maxtok, &j.cfg) != 0)
        goto out;
    if (o.device == TRAIN_DEVICE_CUDA && probe_cuda() != 0) goto out;
    if (o.backend != TRAIN_BACKEND_SIM) {
        const char *name = o.backend == TRAIN_BACKEND_NCCL ? "nccl" : "gloo";
        /* The flag names the backend; fsdprun's --backend (FSDP_BACKEND) need not repeat it. */
        if (setenv("FSDP_BACKEND", name, 1) != 0) {
            status = usage_error("--backend %s: cannot set FSDP_BACKEND", name);
            goto out;
        }
        fsdp_init_options_t io;
        fsdp_init_options_init(&io);
        io.seed = o.seed;
        io.timeout_ms = j.setup_timeout_ms; /* the first rendezvous keeps the long one */
        char msg[512];
        /* Outside a launcher fsdp_init_from_env makes a world of one: a forgotten fsdprun
         * would train alone, slowly and quietly, unless a world of one is what was asked. */
        fsdp_launch_env_t le;
        bool launched = fsdp_launch_env_read(&le, msg, sizeof msg) < 0 ||
                        strcmp(le.source, "none") != 0 || getenv("MASTER_ADDR");
        if (!launched && o.world_size != 1) {
            status = usage_error("--backend %s: no launcher set RANK and WORLD_SIZE: run it as "
                                 "'fsdprun -n N " TRAIN_PROG " --backend %s ...' (or under "
                                 "torchrun, srun, mpirun), or give --world-size 1 for a world of "
                                 "one",
                                 name, name);
            goto out;
        }
        if (fsdp_init_from_env(&io, &ctx, msg, sizeof msg) < 0) {
            status = usage_error("--backend %s: %s%s", name, msg,
                                 launched ? "" : " (run it under fsdprun)");
            goto out;
        }
        j.world = fsdp_ctx_world_size(ctx);
        if ((status = train_check_world(&o, j.world)) != 0) goto out;
        if (fsdp_ctx_rank(ctx) != 0) j.tty = false;
    } else {
        j.world = o.world_size;
    }
    bool rank0 = !ctx || fsdp_ctx_rank(ctx) == 0;
    if ((status = train_start(&j, ctx)) != 0) goto out;
    status = 2;
    json_t *flags = train_opts_json(&o);
    j.flags = flags ? json_dumps(flags, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    json_decref(flags);
    if (!j.flags) {
        status = usage_error("out of memory");
        goto out;
    }
    /* A resumed run continues the file it was started with (the resume command repeats
     * --metrics): its config record and steps follow the earlier ones. */
    if (o.metrics && rank0 && !(j.metrics = fopen(o.metrics, o.resume ? "a" : "w"))) {
        status = usage_error("--metrics: cannot open %s", o.metrics);
        goto out;
    }
    train_metrics_config(&j, o.backend == TRAIN_BACKEND_SIM    ? "sim"
                             : o.backend == TRAIN_BACKEND_GLOO ? "gloo"
                                                               : "nccl");
    if (o.trace) {
        /* This process's file, opened now so that a bad path fails before the run rather than
         * after it; written when the ranks are done. */
        if (!(trace_path = train_trace_path(o.trace, ctx ? fsdp_ctx_rank(ctx) : 0)) ||
            fsdp_trace_create(NULL, &j.trace) < 0) {
            status = usage_error("--trace: out of memory");
            goto out;
        }
        /* not truncated, not followed, never blocking: fsdp_trace_write replaces it atomically
         * and refuses a target that is not a regular file */
        int fd = open(trace_path, O_WRONLY | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0666);
        struct stat sb;
        if (fd < 0 || fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
            status = usage_error("--trace: cannot open %s: %s", trace_path,
                                 fd < 0 ? strerror(errno) : "not a regular file");
            if (fd >= 0) close(fd);
            goto out;
        }
        close(fd);
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
        so.timeout_ms = j.setup_timeout_ms;
        rc = fsdp_sim_run(&so, rank_main, &j, NULL);
    }
    if (rc == 0) status = j.stop_signal ? 128 + j.stop_signal : 0;
    /* The timeline is written whether the run succeeded or not: a failed run's is the one to
     * look at. */
    if (j.trace) {
        if (fsdp_trace_write(j.trace, trace_path) < 0) {
            fprintf(stderr, TRAIN_PROG ": --trace: %s\n", fsdp_trace_last_error(j.trace));
            status = 1;
        } else if (rank0 && !o.quiet) {
            printf("wrote the trace of %s to %s (%zu events%s)\n", ctx ? "rank 0" : "every rank",
                   trace_path, fsdp_trace_num_events(j.trace),
                   ctx && j.world > 1 ? "; the other ranks' files are named with .rank<R>" : "");
        }
    }
out:
    if (train_metrics_close(&j) < 0 && status == 0) status = 1;
    fsdp_ctx_destroy(ctx);
    fsdp_trace_destroy(j.trace);
    free(trace_path);
    free(j.flags);
    free(j.resume_path);
    fsdp_dataset_destroy(train);
    fsdp_dataset_destroy(val);
    fsdp_bpe_destroy(j.bpe);
    return status;
}
