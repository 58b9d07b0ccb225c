/* SPDX-License-Identifier: MIT */
/*
 * train.h: fsdp-train's options and the parts of the program that share them.
 *
 * train_flags.c turns argv into a train_opts_t (every hyper-parameter is a flag, a bad flag
 * is one line on stderr and exit status 2); fsdp-train.c runs the job: one rank per sim thread,
 * or this process's rank under fsdprun for the gloo and nccl backends.
 */
#ifndef FSDP_TOOLS_TRAIN_H
#define FSDP_TOOLS_TRAIN_H

#include <stdbool.h>
#include <stdio.h>
#include <stdint.h>

#include <fsdp.h>
#include <fsdp/grad_scaler.h>
#include <jansson.h>

#define TRAIN_PROG "fsdp-train"

typedef enum train_sched { TRAIN_SCHED_CONSTANT = 0, TRAIN_SCHED_COSINE } train_sched_t;
typedef enum train_backend {
    TRAIN_BACKEND_SIM = 0,
    TRAIN_BACKEND_GLOO,
    TRAIN_BACKEND_NCCL
} train_backend_t;
/* --device: where the model computes. AUTO is resolved by train_parse_flags (cuda for nccl,
 * cpu otherwise), so the rest of the program sees CPU or CUDA only. */
typedef enum train_device {
    TRAIN_DEVICE_AUTO = 0,
    TRAIN_DEVICE_CPU,
    TRAIN_DEVICE_CUDA
} train_device_t;

/* --precision: FSDP mixed precision (fsdp_mixed_precision_t), f32 master weights in every case.
 * F32: none (mixed precision off); BF16 and F16: parameters, gradient reduction and buffers in
 * the half type (F16 with a gradient scaler); BF16_REDUCE_F32: bf16 parameters and buffers,
 * gradients reduced in f32. */
typedef enum train_precision {
    TRAIN_PRECISION_F32 = 0,
    TRAIN_PRECISION_BF16,
    TRAIN_PRECISION_F16,
    TRAIN_PRECISION_BF16_REDUCE_F32,
    TRAIN_PRECISION_COUNT
} train_precision_t;

/* The --precision value of p ("f32", "bf16", "f16", "bf16-reduce-f32"). */
const char *train_precision_name(train_precision_t p);

typedef struct train_opts {
    /* optimisation */
    double lr;           /* peak learning rate */
    train_sched_t sched; /* after the warm-up */
    int64_t warmup;      /* steps of linear warm-up from lr / warmup to lr */
    double min_lr_frac;  /* cosine ends at lr * this */
    double weight_decay; /* AdamW's, on matrices only (fsdp_gpt_recipe_decays) */
    double beta1, beta2, eps;
    double grad_clip;        /* max global norm; 0 = off */
    int64_t batch_size;      /* rows of one global micro-batch, a multiple of the world size */
    int64_t seq_len;         /* tokens per row */
    int64_t steps;           /* optimizer steps */
    int64_t grad_accum;      /* micro-batches per optimizer step */
    bool reduce_every_micro; /* no no_sync: reduce gradients after every micro-batch */
    /* model */
    const char *model;                                       /* preset name */
    int64_t n_layer, n_head, n_embd, block_size, vocab_size; /* 0: from the preset / data */
    double dropout;
    /* data */
    const char *data;     /* NULL: fsdp_data_default_corpus() */
    const char *val_data; /* NULL: the last 10% of data */
    bool shuffle;
    uint64_t seed;
    /* distribution */
    train_backend_t backend;
    int world_size; /* sim only */
    train_device_t device;
    fsdp_sharding_strategy_t sharding;
    int64_t shard_group_size; /* hybrid: ranks per shard group; 0: half the world */
    bool cpu_offload;
    fsdp_backward_prefetch_t backward_prefetch;
    bool forward_prefetch;
    bool activation_checkpointing; /* every GPTBlock recomputed in backward */
    int limit_all_gathers;
    train_precision_t precision;
    /* evaluation and output */
    int64_t val_every;     /* 0: only at the start and the end */
    int64_t val_steps;     /* batches per validation */
    int64_t sample_tokens; /* 0: no sample */
    double temperature;    /* 0: greedy */
    int64_t top_k;         /* 0: the whole vocabulary */
    const char *prompt;
    const char *metrics; /* JSON lines, one per step; NULL: none */
    const char *trace;   /* --trace: the timeline's file (rank 0's); NULL: no tracing */
    int64_t log_every;   /* plain-output progress lines; 0: automatic */
    bool quiet;
    const char *tokenizer; /* --tokenizer: the directory of encoder.json and vocab.bpe */
    /* checkpoints */
    const char *export_path; /* a file (libfsdp layout) or, with export_hf, a directory */
    bool export_hf;          /* --export-format hf: Hugging Face's GPT-2 (see train_export_hf) */
    const char *init_path;
    int64_t save_every; /* 0: no periodic checkpoints */
    /* where checkpoints go: NULL when neither --checkpoint-dir nor --save-every was given (no
     * checkpoint on an interruption); "checkpoints" when only --save-every was */
    const char *checkpoint_dir;
    const char *resume;          /* "latest" or a step directory written by --save-every */
    const char *resume_override; /* comma-separated flags a resume may change; NULL: none */
    int64_t keep_last;           /* keep this many checkpoints after each save; 0: all */
    bool save_error_continue;    /* --on-save-error continue (default: stop) */
    double timeout_s;            /* --timeout: the collectives' timeout in training; 0: default */
} train_opts_t;

/* The default collective timeout while training (a stalled peer is noticed within it); setup,
 * loading and saving keep the longer one of $FSDP_TIMEOUT_MS or FSDP_PG_DEFAULT_TIMEOUT_MS. */
#define TRAIN_TIMEOUT_DEFAULT_S 60.0

/* Parses argv into *o. Returns 0 to run, 1 after --help or --version (printed), 2 after a bad
 * flag (one line printed on stderr). */
int train_parse_flags(int argc, char **argv, train_opts_t *o);

/* Every flag's value in *o as a JSON object keyed by the flag's name without its dashes (enums by
 * their flag value, unset paths as null); NULL when out of memory. The metrics' config record
 * and the checkpoints' record of the run are made of it. */
json_t *train_opts_json(const train_opts_t *o);

/* Whether a resume may change flag `name` (a key of train_opts_json) without --resume-override:
 * the flags of distribution (backend, world size, sharding, ...), of evaluation and of output,
 * which do not change the trained weights. Every other flag is recorded in a checkpoint and
 * compared on a resume. */
bool train_flag_resume_free(const char *name);

/* Checks the flags that depend on the world size (batch rows, hybrid groups); prints one line
 * and returns 2 when they do not fit, else 0. */
int train_check_world(const train_opts_t *o, int world);
/* Ranks per shard group of --sharding hybrid at this world size. */
int64_t train_shard_group_size(const train_opts_t *o, int world);

/* The "layout" metadata value of each export (and what --init reads first). */
#define TRAIN_LAYOUT_LIBFSDP "libfsdp"
#define TRAIN_LAYOUT_HF "huggingface-gpt2"

/* train_ckpt.c: gathers the full model to rank 0, which writes it to path (safetensors,
 * libfsdp names and layout, the step, the producer and "layout": "libfsdp" in the metadata).
 * Collective. */
int train_save_full(fsdp_ctx_t *ctx, fsdp_unit_t *root, const fsdp_module_t *model,
                    const char *path, int64_t step, char *err, size_t cap);
/* The same in Hugging Face's layout (--export-format hf): rank 0 makes the directory dir (or
 * uses it when it exists) and writes dir/model.safetensors (fsdp_gpt2_hf_save: GPT2LMHeadModel
 * names, Conv1D weights, "format": "pt", "layout": "huggingface-gpt2") and dir/config.json.
 * Collective. */
int train_export_hf(fsdp_ctx_t *ctx, fsdp_unit_t *root, const fsdp_module_t *model, const char *dir,
                    int64_t step, char *err, size_t cap);
/* What a checkpoint holds besides the model and the optimizer: the loader position, and with
 * --precision f16 the gradient scaler (NULL otherwise) and the steps it skipped so far. */
typedef struct train_ckpt_extra {
    uint64_t position;
    fsdp_grad_scaler_t *scaler;
    int64_t skipped;
    const char *run_id; /* save: the run's id (a resumed run keeps its checkpoint's) */
    const char *flags;  /* save: train_opts_json as compact JSON text */
} train_ckpt_extra_t;

/* The most steps a checkpoint's metadata may claim (--steps' bound). */
#define TRAIN_MAX_STEPS (INT64_C(1) << 40)

/* Before any rank starts. With --resume latest: the newest complete checkpoint of
 * --checkpoint-dir into path (incomplete ones, staging directories of saves that died and
 * checkpoints that do not open are skipped, each said on stderr when `say`); else --resume's
 * directory, refused when it is a staging directory or incomplete. Then the flags: every flag
 * recorded in the checkpoint that a resume may not change (train_flag_resume_free) must have
 * the value given now, unless --resume-override names it; otherwise every difference is listed
 * (flag, saved value, given value). run_id receives the checkpoint's run id ("" when it has
 * none). 0, or 2 after the reason was printed (when `say`). */
int train_ckpt_resolve(const train_opts_t *o, bool say, char *path, size_t cap, char *run_id,
                       size_t idcap);
/* Rank 0, before a save into dir: removes the staging directories of saves that died
 * (step-N.partial, step-N.partial.old), saying so on stderr; a failure is only warned about. */
void train_ckpt_cleanup(const char *dir);
/* Rank 0, after the save of step `kept`: removes all but the newest keep checkpoints of dir
 * (by step; the one just saved is always kept). Failures are warned about. */
void train_ckpt_prune(const char *dir, int64_t keep, int64_t kept);
/* Writes the checkpoint of `step` as the checkpoint directory dir/step-<step>/ (sharded model and
 * optimizer, the loader position and the gradient scaler's state in the index's metadata).
 * Collective; every rank returns the same status. */
int train_ckpt_save(fsdp_ctx_t *ctx, fsdp_unit_t *root, fsdp_optim_t *opt, const char *dir,
                    int64_t step, const train_ckpt_extra_t *extra, char *err, size_t cap);
/* Loads a checkpoint directory written by train_ckpt_save, at any world size, backend or
 * strategy, into this rank's shard, optimizer and gradient scaler (extra->scaler, when the run
 * has one: the checkpoint must hold its state); *step and extra's position and skipped steps
 * receive where to continue. Nothing is modified on a validation error of the scaler or of the
 * optimizer state; the model is checked completely before it is written. */
int train_ckpt_load(fsdp_ctx_t *ctx, fsdp_unit_t *root, fsdp_optim_t *opt, const char *sdir,
                    int64_t *step, train_ckpt_extra_t *extra, char *err, size_t cap);

/* ---- one run and its ranks (fsdp-train.c, train_build.c, train_sample.c) ---- */

/* What every rank of a run shares. */
typedef struct job {
    const train_opts_t *o;
    fsdp_gpt_config_t cfg;
    const fsdp_dataset_t *train, *val;
    bool text;         /* byte-level data: the sample is printed as text */
    fsdp_bpe_t *bpe;   /* --tokenizer: text data encoded with it, the sample decoded by it */
    bool encoded;      /* the data was text that bpe encoded (train_open_data) */
    bool tty;          /* stdout is a terminal (not TERM=dumb): one updating progress line */
    int columns;       /* its width: the progress line is cut to fit */
    FILE *metrics;     /* rank 0's */
    int metrics_errno; /* the first write to metrics that failed (0: none) */
    int world;
    fsdp_trace_t *trace; /* --trace: the recorder every rank of this process records into */
    /* checkpoints and interruption (fsdp-train.c) */
    int argc; /* the command line, for the resume command */
    char **argv;
    char *resume_path;        /* --resume resolved (latest: the newest complete checkpoint) */
    char run_id[40];          /* this run's id, kept across resumes; in every checkpoint */
    char *flags;              /* train_opts_json as compact text, recorded in checkpoints */
    int64_t setup_timeout_ms; /* collectives of setup, loading, saving and the end */
    int64_t train_timeout_ms; /* collectives of the steps (--timeout) */
    int stop_signal;          /* the signal the ranks agreed to stop on (0: none) */
} job_t;

/* train_metrics.c: the --metrics file (its header comment says what each record holds). */
/* v as a JSON number, or null when it is not finite. */
json_t *train_json_num(double v);
/* A new record {"type": type, "time": now}; NULL when out of memory. */
json_t *train_metrics_record(const char *type);
/* Writes rec (its reference is taken) as one line; a failure is kept in j->metrics_errno. */
void train_metrics_emit(job_t *j, json_t *rec);
/* The first record: version, build, world, backend, device, the model and every flag. */
void train_metrics_config(job_t *j, const char *backend);
/* Closes the file; -1 (after one line on stderr naming the file and the error) when any write
 * failed, else 0. */
int train_metrics_close(job_t *j);

/* One rank's state. */
typedef struct rank {
    job_t *j;
    fsdp_ctx_t *ctx;
    fsdp_pg_t *pg, *shard_pg, *rep_pg;
    fsdp_device_t *dev; /* --device cuda: this rank's GPU (the context's default device) */
    int r, world;
    fsdp_module_t *model;
    fsdp_unit_t *root;
    fsdp_optim_t *opt;
    fsdp_grad_scaler_t *scaler; /* --precision f16 only */
    int64_t skipped;            /* steps the scaler skipped (inf/NaN gradients) */
    int ngroups;
    int64_t nparams;
    fsdp_loader_t *train_ld, *val_ld;
    fsdp_tensor_t *in, *tg, *vin, *vtg; /* (rows, T) int64 */
    double *mem_all;                    /* world entries, peak MiB per rank */
} rank_t;

/* The file --trace writes for `rank` of a run with a process per rank: path itself for rank 0,
 * else path with a final ".json" replaced by ".rank<R>.json" (or ".rank<R>" appended). malloc'ed;
 * NULL when out of memory. */
char *train_trace_path(const char *path, int rank);

/* train_stop.c: interruption, timeouts and the start of a run (its header says how). */
/* Installs the SIGINT and SIGTERM handlers (an ignored SIGINT stays ignored). */
void train_install_signals(void);
/* The first signal received (SIGINT or SIGTERM), 0 when none. */
int train_pending_signal(void);
/* j's setup and training timeouts from --timeout and $FSDP_TIMEOUT_MS. */
void train_timeouts(job_t *j);
/* Before the ranks: --resume resolved into j->resume_path (malloc'ed), the flags checked
 * against the checkpoint's, j->run_id set; rank 0 decides (and prints), ctx's world receives it.
 * 0, or the exit status. */
int train_start(job_t *j, fsdp_ctx_t *ctx);
/* The collectives' timeout on every group of rank k. */
void train_set_timeouts(rank_t *k, int64_t ms);
/* Every rank learns the same stop request (the largest signal number any rank got, or 0). */
int train_agree_stop(rank_t *k, int *stop);
/* Saves the checkpoint of `step` (collective): 0 when saved; 1 when it failed and the run goes
 * on (--on-save-error continue); < 0 when it failed and the run stops. */
int train_save_checkpoint(rank_t *k, int64_t step);
/* After the ranks agreed to stop on signal sig after `step`: saves (with a checkpoint
 * directory), and rank 0 prints the resume command. */
int train_stop_run(rank_t *k, int64_t step, int sig);

/* Reports a failure of rank k on stderr (a peer's failure seen as FSDP_EREMOTE is left to the
 * rank that caused it) and returns rc (FSDP_EINTERNAL when rc is not an error). */
int train_fail(const rank_t *k, const char *what, int rc);
/* Rank 0 prints (clearing the progress line on a terminal); other ranks print nothing. */
void train_say(const rank_t *k, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* train_build.c: the compute device (--device cuda: the NCCL group's GPU, made the context's
 * default device after the model is wrapped); the model (from the seed, or --init), its FSDP units
 * (a GPTBlock each under a root; hybrid groups split from the world), AdamW with decay on matrices
 * (all three by the library's GPT recipe, fsdp/gpt_recipe.h); the loaders and the batch tensors;
 * and their release. Failures are reported with train_fail. */
int train_build(rank_t *k);
/* The FSDP mixed-precision options of --precision p (mixed precision off for f32). */
void train_mixed_precision(train_precision_t p, fsdp_mixed_precision_t *mp);
int train_make_loaders(rank_t *k);
void train_teardown(rank_t *k);

/* train_tok.c: opens the dataset at path (fsdp_dataset_open, FSDP_DATA_AUTO, on the silent
 * context quiet); with a tokenizer, a text file is first encoded with it into a token file under
 * $TMPDIR, which is opened and unlinked (*encoded says so). The message of a failure goes to err.
 */
int train_open_data(fsdp_ctx_t *quiet, fsdp_bpe_t *bpe, const char *path, fsdp_dataset_t **out,
                    bool *encoded, char *err, size_t cap);

/* train_sample.c: rank 0 prints --sample-tokens tokens after --prompt (every rank runs the
 * forwards, which are collective). */
int train_sample(rank_t *k);

/* A context that logs nothing, to hold the library's message of a check whose failure the tool
 * reports itself, in one line; NULL when out of memory. */
static inline fsdp_ctx_t *train_quiet_ctx(void) {
    fsdp_ctx_options_t co;
    fsdp_ctx_options_init(&co);
    co.log_level = FSDP_LOG_OFF;
    fsdp_ctx_t *quiet = NULL;
    return fsdp_ctx_create(&co, &quiet) < 0 ? NULL : quiet;
}

#endif /* FSDP_TOOLS_TRAIN_H */
