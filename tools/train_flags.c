/* SPDX-License-Identifier: MIT */
/*
 * train_flags.c: fsdp-train's command line.
 *
 * Every flag takes "--name VALUE" or "--name=VALUE"; booleans take no value. Numbers are parsed
 * whole (trailing junk, overflow and NaN are refused) and checked against their range here, so
 * that a bad value is one line on stderr naming the flag and the value, and exit status 2,
 * before any rank starts. Checks that need the data (the vocabulary) happen later, in the
 * ranks, and are reported the same way.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/train.h"

static const char usage_text[] =
    "usage: " TRAIN_PROG " [options]\n"
    "Trains a GPT with FSDP on simulated ranks (threads) or, with --backend gloo or nccl under\n"
    "fsdprun, on processes (nccl: one per GPU). With no options: a 4-layer GPT on 4 sim ranks, "
    "FULL_SHARD, on the corpus\n"
    "that ships with libfsdp, about a minute on two cores.\n"
    "\n"
    "optimisation:\n"
    "  --lr X                  peak learning rate (1e-3)\n"
    "  --lr-schedule S         constant | cosine (cosine, down to lr/10 at the last step)\n"
    "  --warmup N              linear warm-up steps (30)\n"
    "  --weight-decay X        AdamW decay of matrices (0.1); biases, LayerNorm parameters and\n"
    "                          the position embedding are not decayed\n"
    "  --beta1 X --beta2 X --eps X   AdamW (0.9, 0.95, 1e-8)\n"
    "  --grad-clip X           clip the global gradient norm to X; 0 = off (1.0)\n"
    "  --batch-size N          rows of a global micro-batch, a multiple of the world size (16)\n"
    "  --seq-len N             tokens per row (64)\n"
    "  --steps N               optimizer steps (500)\n"
    "  --grad-accum N          micro-batches per step (1); all but the last run under FSDP's\n"
    "                          no_sync, so gradients are reduced once per step\n"
    "  --reduce-every-micro-batch   reduce after every micro-batch instead (less memory: no\n"
    "                          unsharded gradient is kept between micro-batches)\n"
    "model:\n"
    "  --model M               tiny | gpt2 | gpt2-medium (tiny: 4 layers, 4 heads, width 128)\n"
    "  --n-layer N --n-head N --n-embd N --block-size N --vocab-size N   override the preset\n"
    "                          (vocabulary: 256 for text, 50257 for llm.c token files)\n"
    "  --dropout X             (0)\n"
    "data:\n"
    "  --data FILE             text or llm.c .bin tokens (the corpus that ships with libfsdp)\n"
    "  --val-data FILE         validation data (the last 10% of --data)\n"
    "  --shuffle               visit each epoch's batches in a seeded order\n"
    "  --seed N                model initialisation, shuffling and sampling (1337)\n"
    "distribution:\n"
    "  --backend B             sim | gloo | nccl (sim); gloo and nccl read the rank from\n"
    "                          fsdprun's environment; nccl runs one rank per GPU\n"
    "  --device D              cpu | cuda: where the model, its units and the batches live\n"
    "                          (cuda for nccl, else cpu); cuda needs --backend nccl\n"
    "  --world-size N          sim ranks (4)\n"
    "  --sharding S            full | grad-op | no-shard | hybrid (full); hybrid shards within\n"
    "                          groups of --shard-group-size ranks and replicates across them\n"
    "  --shard-group-size N    hybrid: ranks per shard group, a divisor of the world size\n"
    "                          (half the world)\n"
    "  --cpu-offload           keep shards, gradients and optimizer state on the host device\n"
    "  --backward-prefetch P   pre | post | none (pre)\n"
    "  --forward-prefetch\n"
    "  --activation-checkpointing\n"
    "                          recompute each GPTBlock's activations in backward instead of\n"
    "                          keeping them: less memory for about one more forward\n"
    "  --limit-all-gathers N   all-gathers in flight; 0 = no limit (2)\n"
    "  --precision P           f32 | bf16 | f16 | bf16-reduce-f32 (f32): FSDP mixed precision\n"
    "                          with f32 master weights and optimizer state; bf16 and f16\n"
    "                          all-gather, compute and reduce gradients in the half type (f16\n"
    "                          with a gradient scaler that skips steps whose gradients\n"
    "                          overflow); bf16-reduce-f32 computes in bf16 and reduces in f32\n"
    "evaluation and output:\n"
    "  --val-every K           validate every K steps (100); 0 = at the start and end only\n"
    "  --val-steps N           batches per validation (8)\n"
    "  --sample-tokens N       tokens to sample at the end; 0 = none (200)\n"
    "  --temperature T         sampling temperature; 0 = greedy (0.8)\n"
    "  --top-k K               sample among the K likeliest tokens; 0 = all (40)\n"
    "  --prompt TEXT           start of the sample (\"The \")\n"
    "  --metrics FILE          one JSON record per step (JSON lines)\n"
    "  --trace FILE            a timeline of the run for ui.perfetto.dev or chrome://tracing:\n"
    "                          every rank's unit forward/backward/recompute spans, optimizer\n"
    "                          steps, collectives with their bytes and memory by category\n"
    "                          (sim: all ranks in FILE; gloo and nccl: rank 0 in FILE, rank R\n"
    "                          in FILE with .json replaced by .rankR.json, else FILE.rankR)\n"
    "  --log-every N           progress lines when stdout is not a terminal (auto)\n"
    "  --quiet                 only the summary lines\n"
    "  --tokenizer DIR         GPT-2 BPE from DIR/encoder.json and DIR/vocab.bpe: encodes text\n"
    "                          --data, --val-data and --prompt, and decodes the sample\n"
    "checkpoints:\n"
    "  --export PATH           write the final weights: a safetensors file in the libfsdp\n"
    "                          layout, or with --export-format hf the directory PATH holding\n"
    "                          model.safetensors and config.json (from_pretrained(PATH))\n"
    "  --export-format F       libfsdp or hf (Hugging Face GPT2LMHeadModel, Conv1D) (libfsdp)\n"
    "  --init PATH             start from these weights: a safetensors file (or a directory\n"
    "                          holding model.safetensors) in the libfsdp layout or either\n"
    "                          Hugging Face GPT-2 layout (found from the file; said on stdout)\n"
    "  --save-every K          every K steps, write the checkpoint directory DIR/step-<step>/\n"
    "                          (each rank's shard and optimizer state, an index, the data\n"
    "                          position; fsdp-ckpt reads it) (0 = never)\n"
    "  --checkpoint-dir DIR    where --save-every and an interruption write (checkpoints)\n"
    "  --resume DIR|latest     continue from a checkpoint written by --save-every (latest: the\n"
    "                          newest complete one in --checkpoint-dir), with the same flags\n"
    "                          (any world size, sharding, backend)\n"
    "  --resume-override F,..  flags that may differ from the checkpoint's record (lr,steps)\n"
    "  --keep-last N           after each save, keep the newest N checkpoints (0 = all)\n"
    "  --on-save-error A       stop | continue after a failed save (stop: exit status 1)\n"
    "  --timeout S             collective timeout while training, in seconds (60); setup and\n"
    "                          saves keep $FSDP_TIMEOUT_MS, or 300 s\n"
    "  --version               the version, git revision and what is compiled in\n"
    "  --help                  this text\n";

static int bad(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs(TRAIN_PROG ": ", stderr);
    vfprintf(stderr, fmt, ap);
    fputs(" (try --help)\n", stderr);
    va_end(ap);
    return 2;
}

int train_check_world(const train_opts_t *o, int world) {
    if (o->batch_size % world != 0)
        return bad("--batch-size %lld is not a multiple of the world size %d",
                   (long long)o->batch_size, world);
    if (o->sharding != FSDP_HYBRID_SHARD) return 0;
    int64_t g = train_shard_group_size(o, world);
    if (world < 2 || g < 1 || g > world || world % g != 0)
        return bad("--sharding hybrid: %s %lld does not divide the world size %d into shard "
                   "groups%s",
                   o->shard_group_size ? "--shard-group-size" : "half the world, ", (long long)g,
                   world, o->shard_group_size ? "" : " (give --shard-group-size)");
    return 0;
}

char *train_trace_path(const char *path, int rank) {
    size_t n = strlen(path);
    char *out = malloc(n + 32);
    if (!out) return NULL;
    if (rank == 0)
        memcpy(out, path, n + 1);
    else if (n > 5 && strcmp(path + n - 5, ".json") == 0)
        snprintf(out, n + 32, "%.*s.rank%d.json", (int)(n - 5), path, rank);
    else
        snprintf(out, n + 32, "%s.rank%d", path, rank);
    return out;
}

static const char *const precision_names[TRAIN_PRECISION_COUNT] = {
    [TRAIN_PRECISION_F32] = "f32",
    [TRAIN_PRECISION_BF16] = "bf16",
    [TRAIN_PRECISION_F16] = "f16",
    [TRAIN_PRECISION_BF16_REDUCE_F32] = "bf16-reduce-f32",
};

const char *train_precision_name(train_precision_t p) {
    return p >= 0 && p < TRAIN_PRECISION_COUNT ? precision_names[p] : "invalid";
}

int64_t train_shard_group_size(const train_opts_t *o, int world) {
    return o->shard_group_size ? o->shard_group_size : world / 2;
}

static int parse_i64(const char *flag, const char *v, int64_t lo, int64_t hi, int64_t *out) {
    char *end = NULL;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno != 0 || end == v || *end != '\0') return bad("%s: '%s' is not an integer", flag, v);
    if (x < lo || x > hi)
        return bad("%s: %s is out of range [%lld, %lld]", flag, v, (long long)lo, (long long)hi);
    *out = x;
    return 0;
}

static int parse_f64(const char *flag, const char *v, double lo, double hi, bool hi_open,
                     double *out) {
    char *end = NULL;
    errno = 0;
    double x = strtod(v, &end);
    if (errno != 0 || end == v || *end != '\0' || isnan(x))
        return bad("%s: '%s' is not a number", flag, v);
    if (x < lo || x > hi || (hi_open && x == hi))
        return bad("%s: %s is out of range [%g, %g%c", flag, v, lo, hi, hi_open ? ')' : ']');
    *out = x;
    return 0;
}

/* AdamW's defaults are the GPT recipe's (fsdp_gpt_recipe_adamw_options_init), which the usage
 * text above spells out. */
static void defaults(train_opts_t *o) {
    fsdp_adam_options_t a;
    fsdp_gpt_recipe_adamw_options_init(&a);
    *o = (train_opts_t){
        .lr = a.lr,
        .sched = TRAIN_SCHED_COSINE,
        .warmup = 30,
        .min_lr_frac = 0.1,
        .weight_decay = a.weight_decay,
        .beta1 = a.beta1,
        .beta2 = a.beta2,
        .eps = a.eps,
        .grad_clip = 1.0,
        .batch_size = 16,
        .seq_len = 64,
        .steps = 500,
        .grad_accum = 1,
        .model = "tiny",
        .seed = 1337,
        .backend = TRAIN_BACKEND_SIM,
        .world_size = 4,
        .sharding = FSDP_FULL_SHARD,
        .backward_prefetch = FSDP_BACKWARD_PRE,
        .limit_all_gathers = 2,
        .precision = TRAIN_PRECISION_F32,
        .val_every = 100,
        .val_steps = 8,
        .sample_tokens = 200,
        .temperature = 0.8,
        .top_k = 40,
        .prompt = "The ",
    };
}

/* Flags that take a value. */
static const char *const valued[] = {"--lr",
                                     "--lr-schedule",
                                     "--warmup",
                                     "--weight-decay",
                                     "--beta1",
                                     "--beta2",
                                     "--eps",
                                     "--grad-clip",
                                     "--batch-size",
                                     "--seq-len",
                                     "--steps",
                                     "--grad-accum",
                                     "--shard-group-size",
                                     "--model",
                                     "--n-layer",
                                     "--n-head",
                                     "--n-embd",
                                     "--block-size",
                                     "--vocab-size",
                                     "--dropout",
                                     "--data",
                                     "--val-data",
                                     "--seed",
                                     "--backend",
                                     "--device",
                                     "--world-size",
                                     "--sharding",
                                     "--backward-prefetch",
                                     "--limit-all-gathers",
                                     "--precision",
                                     "--val-every",
                                     "--val-steps",
                                     "--sample-tokens",
                                     "--temperature",
                                     "--top-k",
                                     "--prompt",
                                     "--metrics",
                                     "--trace",
                                     "--log-every",
                                     "--export",
                                     "--export-format",
                                     "--tokenizer",
                                     "--init",
                                     "--save-every",
                                     "--checkpoint-dir",
                                     "--resume",
                                     "--resume-override",
                                     "--keep-last",
                                     "--on-save-error",
                                     "--timeout",
                                     NULL};

static bool takes_value(const char *name) {
    for (int i = 0; valued[i]; i++)
        if (strcmp(valued[i], name) == 0) return true;
    return false;
}

/* One flag with its value (NULL for booleans). */
static int apply(train_opts_t *o, const char *f, const char *v) {
    int64_t n = 0;
    int rc = 0;
    const int64_t big = INT64_C(1) << 40;
#define I64(name, lo, hi, field)                                                                   \
    if (strcmp(f, name) == 0) {                                                                    \
        if ((rc = parse_i64(f, v, lo, hi, &n)) != 0) return rc;                                    \
        o->field = n;                                                                              \
        return 0;                                                                                  \
    }
#define F64(name, lo, hi, open, field)                                                             \
    if (strcmp(f, name) == 0) return parse_f64(f, v, lo, hi, open, &o->field);
    F64("--lr", 0, 10, false, lr)
    I64("--warmup", 0, big, warmup)
    F64("--weight-decay", 0, 10, false, weight_decay)
    F64("--beta1", 0, 1, true, beta1)
    F64("--beta2", 0, 1, true, beta2)
    F64("--eps", 0, 1, false, eps)
    F64("--grad-clip", 0, 1e30, false, grad_clip)
    I64("--batch-size", 1, 1 << 20, batch_size)
    I64("--seq-len", 1, 1 << 20, seq_len)
    I64("--steps", 0, big, steps)
    I64("--grad-accum", 1, 1 << 20, grad_accum)
    I64("--shard-group-size", 1, 1 << 20, shard_group_size)
    I64("--n-layer", 1, 1024, n_layer)
    I64("--n-head", 1, 1024, n_head)
    I64("--n-embd", 1, 1 << 16, n_embd)
    I64("--block-size", 1, 1 << 20, block_size)
    I64("--vocab-size", 1, 1 << 24, vocab_size)
    F64("--dropout", 0, 1, true, dropout)
    I64("--val-every", 0, big, val_every)
    I64("--val-steps", 1, big, val_steps)
    I64("--sample-tokens", 0, 1 << 20, sample_tokens)
    F64("--temperature", 0, 100, false, temperature)
    I64("--top-k", 0, 1 << 24, top_k)
    I64("--log-every", 0, big, log_every)
    I64("--save-every", 0, big, save_every)
    I64("--keep-last", 0, big, keep_last)
    F64("--timeout", 1, 1e7, false, timeout_s)
#undef I64
#undef F64
    if (strcmp(f, "--seed") == 0) {
        if ((rc = parse_i64(f, v, 0, INT64_MAX, &n)) != 0) return rc;
        o->seed = (uint64_t)n;
    } else if (strcmp(f, "--world-size") == 0) {
        if ((rc = parse_i64(f, v, 1, 256, &n)) != 0) return rc;
        o->world_size = (int)n;
    } else if (strcmp(f, "--limit-all-gathers") == 0) {
        if ((rc = parse_i64(f, v, 0, 1 << 20, &n)) != 0) return rc;
        o->limit_all_gathers = (int)n;
    } else if (strcmp(f, "--lr-schedule") == 0) {
        if (strcmp(v, "constant") == 0)
            o->sched = TRAIN_SCHED_CONSTANT;
        else if (strcmp(v, "cosine") == 0)
            o->sched = TRAIN_SCHED_COSINE;
        else
            return bad("%s: '%s' is not constant or cosine", f, v);
    } else if (strcmp(f, "--model") == 0) {
        if (strcmp(v, "tiny") && strcmp(v, "gpt2") && strcmp(v, "gpt2-medium"))
            return bad("%s: '%s' is not tiny, gpt2 or gpt2-medium", f, v);
        o->model = v;
    } else if (strcmp(f, "--backend") == 0) {
        if (strcmp(v, "sim") == 0)
            o->backend = TRAIN_BACKEND_SIM;
        else if (strcmp(v, "gloo") == 0)
            o->backend = TRAIN_BACKEND_GLOO;
        else if (strcmp(v, "nccl") == 0)
            o->backend = TRAIN_BACKEND_NCCL;
        else
            return bad("%s: '%s' is not sim, gloo or nccl", f, v);
    } else if (strcmp(f, "--device") == 0) {
        if (strcmp(v, "cpu") == 0)
            o->device = TRAIN_DEVICE_CPU;
        else if (strcmp(v, "cuda") == 0)
            o->device = TRAIN_DEVICE_CUDA;
        else
            return bad("%s: '%s' is not cpu or cuda", f, v);
    } else if (strcmp(f, "--sharding") == 0) {
        if (strcmp(v, "full") == 0)
            o->sharding = FSDP_FULL_SHARD;
        else if (strcmp(v, "grad-op") == 0)
            o->sharding = FSDP_SHARD_GRAD_OP;
        else if (strcmp(v, "no-shard") == 0)
            o->sharding = FSDP_NO_SHARD;
        else if (strcmp(v, "hybrid") == 0)
            o->sharding = FSDP_HYBRID_SHARD;
        else
            return bad("%s: '%s' is not full, grad-op, no-shard or hybrid", f, v);
    } else if (strcmp(f, "--backward-prefetch") == 0) {
        if (strcmp(v, "pre") == 0)
            o->backward_prefetch = FSDP_BACKWARD_PRE;
        else if (strcmp(v, "post") == 0)
            o->backward_prefetch = FSDP_BACKWARD_POST;
        else if (strcmp(v, "none") == 0)
            o->backward_prefetch = FSDP_BACKWARD_PREFETCH_NONE;
        else
            return bad("%s: '%s' is not pre, post or none", f, v);
    } else if (strcmp(f, "--precision") == 0) {
        int p = 0;
        while (p < TRAIN_PRECISION_COUNT && strcmp(v, precision_names[p]) != 0)
            p++;
        if (p == TRAIN_PRECISION_COUNT)
            return bad("%s: '%s' is not f32, bf16, f16 or bf16-reduce-f32", f, v);
        o->precision = (train_precision_t)p;
    } else if (strcmp(f, "--data") == 0) {
        o->data = v;
    } else if (strcmp(f, "--val-data") == 0) {
        o->val_data = v;
    } else if (strcmp(f, "--prompt") == 0) {
        o->prompt = v;
    } else if (strcmp(f, "--metrics") == 0) {
        o->metrics = v;
    } else if (strcmp(f, "--trace") == 0) {
        if (!*v) return bad("--trace: the file name is empty");
        o->trace = v;
    } else if (strcmp(f, "--export") == 0) {
        o->export_path = v;
    } else if (strcmp(f, "--export-format") == 0) {
        if (strcmp(v, "libfsdp") && strcmp(v, "hf"))
            return bad("%s: '%s' is not libfsdp or hf", f, v);
        o->export_hf = strcmp(v, "hf") == 0;
    } else if (strcmp(f, "--tokenizer") == 0) {
        o->tokenizer = v;
    } else if (strcmp(f, "--init") == 0) {
        o->init_path = v;
    } else if (strcmp(f, "--checkpoint-dir") == 0) {
        o->checkpoint_dir = v;
    } else if (strcmp(f, "--resume") == 0) {
        if (!*v) return bad("--resume: give a checkpoint directory or 'latest'");
        o->resume = v;
    } else if (strcmp(f, "--resume-override") == 0) {
        o->resume_override = v;
    } else if (strcmp(f, "--on-save-error") == 0) {
        if (strcmp(v, "stop") && strcmp(v, "continue"))
            return bad("%s: '%s' is not stop or continue", f, v);
        o->save_error_continue = strcmp(v, "continue") == 0;
    } else {
        return bad("internal: unhandled flag %s", f);
    }
    return 0;
}

static const char *const sched_names[] = {"constant", "cosine"};
static const char *const backend_names[] = {"sim", "gloo", "nccl"};
static const char *const device_names[] = {"auto", "cpu", "cuda"};

static const char *sharding_name(fsdp_sharding_strategy_t s) {
    switch (s) {
    case FSDP_FULL_SHARD:
        return "full";
    case FSDP_SHARD_GRAD_OP:
        return "grad-op";
    case FSDP_NO_SHARD:
        return "no-shard";
    case FSDP_HYBRID_SHARD:
        return "hybrid";
    default:
        return "other";
    }
}

static const char *prefetch_name(fsdp_backward_prefetch_t p) {
    return p == FSDP_BACKWARD_PRE ? "pre" : p == FSDP_BACKWARD_POST ? "post" : "none";
}

static json_t *str_or_null(const char *s) {
    return s ? json_string(s) : json_null();
}

/* Keep in step with apply() and the booleans of train_parse_flags: t_fsdp_train.sh checks that
 * every flag of --help is a key. */
json_t *train_opts_json(const train_opts_t *o) {
    json_t *f = json_object();
    if (!f) return NULL;
#define SET(k, v) json_object_set_new(f, k, v)
    SET("lr", json_real(o->lr));
    SET("lr-schedule", json_string(sched_names[o->sched]));
    SET("warmup", json_integer(o->warmup));
    SET("weight-decay", json_real(o->weight_decay));
    SET("beta1", json_real(o->beta1));
    SET("beta2", json_real(o->beta2));
    SET("eps", json_real(o->eps));
    SET("grad-clip", json_real(o->grad_clip));
    SET("batch-size", json_integer(o->batch_size));
    SET("seq-len", json_integer(o->seq_len));
    SET("steps", json_integer(o->steps));
    SET("grad-accum", json_integer(o->grad_accum));
    SET("reduce-every-micro-batch", json_boolean(o->reduce_every_micro));
    SET("model", json_string(o->model));
    SET("n-layer", json_integer(o->n_layer));
    SET("n-head", json_integer(o->n_head));
    SET("n-embd", json_integer(o->n_embd));
    SET("block-size", json_integer(o->block_size));
    SET("vocab-size", json_integer(o->vocab_size));
    SET("dropout", json_real(o->dropout));
    SET("data", str_or_null(o->data));
    SET("val-data", str_or_null(o->val_data));
    SET("shuffle", json_boolean(o->shuffle));
    SET("seed", json_integer((json_int_t)o->seed));
    SET("backend", json_string(backend_names[o->backend]));
    SET("world-size", json_integer(o->world_size));
    SET("device", json_string(device_names[o->device]));
    SET("sharding", json_string(sharding_name(o->sharding)));
    SET("shard-group-size", json_integer(o->shard_group_size));
    SET("cpu-offload", json_boolean(o->cpu_offload));
    SET("backward-prefetch", json_string(prefetch_name(o->backward_prefetch)));
    SET("forward-prefetch", json_boolean(o->forward_prefetch));
    SET("activation-checkpointing", json_boolean(o->activation_checkpointing));
    SET("limit-all-gathers", json_integer(o->limit_all_gathers));
    SET("precision", json_string(train_precision_name(o->precision)));
    SET("val-every", json_integer(o->val_every));
    SET("val-steps", json_integer(o->val_steps));
    SET("sample-tokens", json_integer(o->sample_tokens));
    SET("temperature", json_real(o->temperature));
    SET("top-k", json_integer(o->top_k));
    SET("prompt", str_or_null(o->prompt));
    SET("metrics", str_or_null(o->metrics));
    SET("trace", str_or_null(o->trace));
    SET("log-every", json_integer(o->log_every));
    SET("quiet", json_boolean(o->quiet));
    SET("export", str_or_null(o->export_path));
    SET("export-format", json_string(o->export_hf ? "hf" : "libfsdp"));
    SET("tokenizer", str_or_null(o->tokenizer));
    SET("init", str_or_null(o->init_path));
    SET("save-every", json_integer(o->save_every));
    SET("checkpoint-dir", str_or_null(o->checkpoint_dir));
    SET("resume", str_or_null(o->resume));
    SET("resume-override", str_or_null(o->resume_override));
    SET("keep-last", json_integer(o->keep_last));
    SET("on-save-error", json_string(o->save_error_continue ? "continue" : "stop"));
    SET("timeout", json_real(o->timeout_s > 0 ? o->timeout_s : TRAIN_TIMEOUT_DEFAULT_S));
#undef SET
    return f;
}

/* Flags that do not change the trained weights: a resume may change them freely. */
static const char *const resume_free[] = {"backend",
                                          "world-size",
                                          "device",
                                          "sharding",
                                          "shard-group-size",
                                          "cpu-offload",
                                          "backward-prefetch",
                                          "forward-prefetch",
                                          "activation-checkpointing",
                                          "limit-all-gathers",
                                          "reduce-every-micro-batch",
                                          "val-every",
                                          "val-steps",
                                          "sample-tokens",
                                          "temperature",
                                          "top-k",
                                          "prompt",
                                          "metrics",
                                          "trace",
                                          "log-every",
                                          "quiet",
                                          "export",
                                          "export-format",
                                          "init",
                                          "save-every",
                                          "checkpoint-dir",
                                          "resume",
                                          "resume-override",
                                          "keep-last",
                                          "on-save-error",
                                          "timeout",
                                          NULL};

bool train_flag_resume_free(const char *name) {
    for (int i = 0; resume_free[i]; i++)
        if (strcmp(resume_free[i], name) == 0) return true;
    return false;
}

/* --resume-override: every name (dashes optional) must be a flag of train_opts_json. */
static int check_override(const train_opts_t *o) {
    if (!o->resume_override) return 0;
    if (!o->resume) return bad("--resume-override applies to --resume only");
    json_t *all = train_opts_json(o);
    if (!all) return bad("out of memory");
    int rc = 0;
    const char *p = o->resume_override;
    while (rc == 0 && *p) {
        while (*p == '-')
            p++;
        size_t len = strcspn(p, ",");
        char name[64];
        if (len == 0 || len >= sizeof name) {
            rc = bad("--resume-override: '%s' is not a list of flags (lr,batch-size,...)",
                     o->resume_override);
            break;
        }
        memcpy(name, p, len);
        name[len] = '\0';
        if (!json_object_get(all, name))
            rc = bad("--resume-override: '%s' is not a flag of " TRAIN_PROG, name);
        p += len;
        if (*p == ',') p++;
    }
    json_decref(all);
    return rc;
}

int train_parse_flags(int argc, char **argv, train_opts_t *o) {
    defaults(o);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            fputs(usage_text, stdout);
            return 1;
        }
        if (strcmp(a, "--version") == 0) {
            printf("fsdp-train (libfsdp) %s\n%s\n", fsdp_version_string(), fsdp_build_info());
            return 1;
        }
        if (strncmp(a, "--", 2) != 0) return bad("unexpected argument '%s'", a);
        char name[64];
        const char *eq = strchr(a, '=');
        size_t len = eq ? (size_t)(eq - a) : strlen(a);
        if (len >= sizeof name) return bad("unknown option '%s'", a);
        memcpy(name, a, len);
        name[len] = '\0';
        bool is_bool = strcmp(name, "--shuffle") == 0 || strcmp(name, "--cpu-offload") == 0 ||
                       strcmp(name, "--forward-prefetch") == 0 || strcmp(name, "--quiet") == 0 ||
                       strcmp(name, "--reduce-every-micro-batch") == 0 ||
                       strcmp(name, "--activation-checkpointing") == 0;
        if (is_bool) {
            if (eq) return bad("%s takes no value", name);
            if (strcmp(name, "--shuffle") == 0)
                o->shuffle = true;
            else if (strcmp(name, "--cpu-offload") == 0)
                o->cpu_offload = true;
            else if (strcmp(name, "--forward-prefetch") == 0)
                o->forward_prefetch = true;
            else if (strcmp(name, "--reduce-every-micro-batch") == 0)
                o->reduce_every_micro = true;
            else if (strcmp(name, "--activation-checkpointing") == 0)
                o->activation_checkpointing = true;
            else
                o->quiet = true;
            continue;
        }
        if (!takes_value(name)) return bad("unknown option '%s'", name);
        const char *v = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
        if (!v) return bad("%s needs a value", name);
        int rc = apply(o, name, v);
        if (rc != 0) return rc;
    }
    /* Checks between flags that need no data (the world size of gloo and nccl is known later). */
    if (o->backend == TRAIN_BACKEND_NCCL && !fsdp_nccl_available())
        return bad("--backend nccl: this build of libfsdp has no NCCL (configure it with "
                   "--with-cuda and --with-nccl)");
    if (o->device == TRAIN_DEVICE_AUTO)
        o->device = o->backend == TRAIN_BACKEND_NCCL ? TRAIN_DEVICE_CUDA : TRAIN_DEVICE_CPU;
    if (o->device == TRAIN_DEVICE_CPU && o->backend == TRAIN_BACKEND_NCCL)
        return bad("--device cpu: the nccl backend's collectives run on GPUs; use --device cuda, "
                   "or --backend gloo for processes on the CPU");
    /* The sim backend has no device memory yet: its ranks, threads of one process, would have
     * to share the GPU through it (docs/design.md, "fsdp-train on GPUs"). */
    if (o->device == TRAIN_DEVICE_CUDA && o->backend == TRAIN_BACKEND_SIM)
        return bad("--device cuda: the sim backend cannot run collectives on GPU memory yet; use "
                   "--backend nccl under fsdprun (one process per GPU)");
    if (o->device == TRAIN_DEVICE_CUDA && o->backend == TRAIN_BACKEND_GLOO)
        return bad("--device cuda: the gloo backend's collectives take host memory; use "
                   "--backend nccl under fsdprun");
    if (o->shard_group_size && o->sharding != FSDP_HYBRID_SHARD)
        return bad("--shard-group-size applies to --sharding hybrid only");
    if (o->backend == TRAIN_BACKEND_SIM) {
        int rc = train_check_world(o, o->world_size);
        if (rc != 0) return rc;
    }
    if (o->n_head && o->n_embd && o->n_embd % o->n_head != 0)
        return bad("--n-head %lld does not divide --n-embd %lld", (long long)o->n_head,
                   (long long)o->n_embd);
    /* Checkpoints: --save-every and --resume latest use "checkpoints" unless told otherwise;
     * with none of them, an interruption saves nothing. */
    if (!o->checkpoint_dir &&
        (o->save_every > 0 || o->keep_last > 0 || (o->resume && strcmp(o->resume, "latest") == 0)))
        o->checkpoint_dir = "checkpoints";
    if (o->checkpoint_dir && !*o->checkpoint_dir) return bad("--checkpoint-dir: the name is empty");
    return check_override(o);
}
