/*
 * train.h: fsdp-train's options and the parts of the program that share them.
 *
 * train_flags.c turns argv into a train_opts_t (every hyper-parameter is a flag, a bad flag
 * is one line on stderr and exit status 2); fsdp-train.c runs the job: one rank per sim thread,
 * or this process's rank under fsdprun for the gloo backend.
 */
#ifndef FSDP_TOOLS_TRAIN_H
#define FSDP_TOOLS_TRAIN_H

#include <stdbool.h>
#include <stdint.h>

#include <fsdp.h>

#define TRAIN_PROG "fsdp-train"

typedef enum train_sched { TRAIN_SCHED_CONSTANT = 0, TRAIN_SCHED_COSINE } train_sched_t;
typedef enum train_backend { TRAIN_BACKEND_SIM = 0, TRAIN_BACKEND_GLOO } train_backend_t;

typedef struct train_opts {
    /* optimisation */
    double lr;           /* peak learning rate */
    train_sched_t sched; /* after the warm-up */
    int64_t warmup;      /* steps of linear warm-up from lr / warmup to lr */
    double min_lr_frac;  /* cosine ends at lr * this */
    double weight_decay; /* AdamW's, on matrices only (see decays()) */
    double beta1, beta2, eps;
    double grad_clip;   /* max global norm; 0 = off */
    int64_t batch_size; /* rows of one global micro-batch, a multiple of the world size */
    int64_t seq_len;    /* tokens per row */
    int64_t steps;      /* optimizer steps */
    int64_t grad_accum; /* micro-batches per optimizer step */
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
    fsdp_sharding_strategy_t sharding;
    bool cpu_offload;
    fsdp_backward_prefetch_t backward_prefetch;
    bool forward_prefetch;
    int limit_all_gathers;
    /* evaluation and output */
    int64_t val_every;     /* 0: only at the start and the end */
    int64_t val_steps;     /* batches per validation */
    int64_t sample_tokens; /* 0: no sample */
    double temperature;    /* 0: greedy */
    int64_t top_k;         /* 0: the whole vocabulary */
    const char *prompt;
    const char *metrics; /* JSON lines, one per step; NULL: none */
    int64_t log_every;   /* plain-output progress lines; 0: automatic */
    bool quiet;
    /* checkpoints */
    const char *export_path;
    const char *init_path;
    int64_t save_every; /* 0: no periodic checkpoints */
    const char *checkpoint_dir;
    const char *resume; /* a step directory written by --save-every */
} train_opts_t;

/* Parses argv into *o. Returns 0 to run, 1 after --help or --version (printed), 2 after a bad
 * flag (one line printed on stderr). */
int train_parse_flags(int argc, char **argv, train_opts_t *o);

/* train_ckpt.c: saves this rank's shard, optimizer state and loader position to
 * dir/step-<step>/rank-R-of-W.safetensors, then waits for every rank (collective). */
int train_ckpt_save(fsdp_ctx_t *ctx, fsdp_unit_t *root, fsdp_optim_t *opt, const char *dir,
                    int64_t step, uint64_t position, char *err, size_t cap);
/* Loads what train_ckpt_save wrote into this rank's shard and optimizer; *step and *position
 * receive where to continue. Nothing is modified on a validation error. */
int train_ckpt_load(fsdp_ctx_t *ctx, fsdp_unit_t *root, fsdp_optim_t *opt, const char *sdir,
                    int64_t *step, uint64_t *position, char *err, size_t cap);

#endif /* FSDP_TOOLS_TRAIN_H */
