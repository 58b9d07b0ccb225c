/* SPDX-License-Identifier: MIT */
/*
 * fsdp/data.h: training data: token datasets and the batch loader of fsdp-train.
 *
 * A dataset is a read-only sequence of tokens read from one file, in one of two formats:
 *   - an llm.c token file: a header of 256 little-endian int32 (header[0] = 20240520, the magic;
 *     header[1] = 1, the version; header[2] = the token count), then exactly that many
 *     little-endian uint16 tokens;
 *   - raw text with a byte-level vocabulary of 256: every byte is one token.
 * Views (fsdp_dataset_view, fsdp_dataset_split) are datasets over a range of another one's
 * tokens, sharing its open file; train and validation data can be two files or two views of one.
 *
 * A loader cuts a dataset into batches exactly as llm.c's loader reads it sequentially: global
 * batch i holds the B*T+1 tokens starting at token i*B*T; its inputs are B rows of T tokens and
 * its targets the same tokens shifted by one. Each rank of a world of W reads only its own rows
 * of every global batch, rows [r*B/W, (r+1)*B/W), so the global batch, and with it the training
 * run, is the same for any world size.
 *
 * Wrap-around. An epoch is the E = floor((N - 1) / (B*T)) batches that fit in the N tokens; batch
 * i is batch i mod E of epoch i / E, so after the last full batch the loader starts again at
 * token 0 (as llm.c's loader does) and the last (N - 1) mod (B*T) tokens are never read as
 * inputs. With shuffling, epoch e visits the E batch positions in the order of a permutation
 * that depends only on (seed, e): the same on every rank, different in every epoch, and
 * computable for any batch index without state, so a position alone resumes a run.
 *
 * Errors. Datasets are immutable after opening and may be shared by every rank thread, so they
 * hold no error text: the dataset calls and fsdp_loader_create take the calling rank's context
 * and leave their message there (fsdp_ctx_last_error); with a NULL context the message is
 * logged at error level instead (FSDP_LOG). A loader belongs to one rank and keeps its own text
 * (fsdp_loader_last_error). Every message names the file; a bad header names the field.
 *
 * Files are read with pread(), never mapped, so a file that shrinks while it is read gives an
 * error instead of a signal.
 */
#ifndef FSDP_DATA_H
#define FSDP_DATA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/export.h>

FSDP_BEGIN_DECLS

typedef struct fsdp_ctx fsdp_ctx_t;
typedef struct fsdp_tensor fsdp_tensor_t;
typedef struct fsdp_dataset fsdp_dataset_t;
typedef struct fsdp_loader fsdp_loader_t;

/* The llm.c token-file header. */
#define FSDP_DATA_MAGIC 20240520
#define FSDP_DATA_VERSION 1
#define FSDP_DATA_HEADER_INTS 256
#define FSDP_DATA_HEADER_BYTES (FSDP_DATA_HEADER_INTS * 4)
/* Vocabulary of a text dataset: one token per byte value. */
#define FSDP_DATA_TEXT_VOCAB 256
/* fsdp-train's share of the corpus kept for validation (the last 10% of its tokens). */
#define FSDP_DATA_DEFAULT_VAL_FRACTION 0.1

typedef enum fsdp_data_format {
    FSDP_DATA_AUTO = 0, /* llm.c tokens when the file starts with the magic or its name ends in
                           ".bin" (so a damaged token file reports its header), else text */
    FSDP_DATA_TOKENS,   /* an llm.c token file */
    FSDP_DATA_TEXT,     /* raw bytes */
} fsdp_data_format_t;

/* ---- datasets ----------------------------------------------------------------------------- */

/*
 * Opens the dataset in the file at `path`. A token file's header is checked against the file:
 * the magic, the version, a count that is positive and equals the number of uint16 that follow
 * the header (fewer bytes than that is a truncated file; more is an error too, as in llm.c).
 * Opening reads the whole file once, to find the largest token (fsdp_dataset_max_token). A
 * dataset with no tokens (an empty text file, a token count of 0) is refused.
 *
 * ctx (may be NULL) receives the error message. The caller owns *out (NULL on failure) and
 * frees it with fsdp_dataset_destroy(). Errors: FSDP_EINVAL for a bad argument or a bad file (the
 * message names the path and the header field), or a path that is not a regular file (a FIFO, a
 * device, a directory: refused without blocking, the message says which), FSDP_EBACKEND when the
 * file cannot be opened or read (with the system's reason), FSDP_ENOMEM. Blocking (file I/O).
 * Thread-safe.
 */
FSDP_EXTERN int fsdp_dataset_open(fsdp_ctx_t *ctx, const char *path, fsdp_data_format_t format,
                                  fsdp_dataset_t **out);

/*
 * A dataset over tokens [first, first + count) of ds, sharing its file: it stays valid after ds
 * is destroyed. count must be positive and the range inside ds. The caller owns *out.
 * Reads the range once (its largest token). ctx (may be NULL) receives the error message.
 * Thread-safe.
 */
FSDP_EXTERN int fsdp_dataset_view(fsdp_ctx_t *ctx, const fsdp_dataset_t *ds, uint64_t first,
                                  uint64_t count, fsdp_dataset_t **out);

/*
 * Splits ds into a training view, its first N - V tokens, and a validation view, its last
 * V = floor(N * val_fraction) tokens, with 0 < val_fraction < 1 and both parts non-empty.
 * fsdp-train uses FSDP_DATA_DEFAULT_VAL_FRACTION. The caller owns *train and *val (both NULL on
 * failure). ctx (may be NULL) receives the error message. Thread-safe.
 */
FSDP_EXTERN int fsdp_dataset_split(fsdp_ctx_t *ctx, const fsdp_dataset_t *ds, double val_fraction,
                                   fsdp_dataset_t **train, fsdp_dataset_t **val);

/* Frees a dataset (the file is closed with its last view); NULL is accepted. */
FSDP_EXTERN void fsdp_dataset_destroy(fsdp_dataset_t *ds);

/* Number of tokens (> 0); 0 for NULL. */
FSDP_EXTERN uint64_t fsdp_dataset_num_tokens(const fsdp_dataset_t *ds);
/* FSDP_DATA_TOKENS or FSDP_DATA_TEXT (what AUTO detected). */
FSDP_EXTERN fsdp_data_format_t fsdp_dataset_format(const fsdp_dataset_t *ds);
/* The path the file was opened with (borrowed, lives as long as ds). */
FSDP_EXTERN const char *fsdp_dataset_path(const fsdp_dataset_t *ds);
/* The largest token of ds: a model needs a vocabulary of at least this + 1. */
FSDP_EXTERN uint32_t fsdp_dataset_max_token(const fsdp_dataset_t *ds);

/* Copies tokens [first, first + n) of ds into out[0..n). ctx (may be NULL) receives the error
 * message. Blocking. Thread-safe. */
FSDP_EXTERN int fsdp_dataset_read(fsdp_ctx_t *ctx, const fsdp_dataset_t *ds, uint64_t first,
                                  size_t n, int64_t *out);

/*
 * The default corpus of fsdp-train (data/corpus.txt in the source tree: English-like text made
 * by data/gen_corpus.py, about 300 KB). Returns the installed copy, $(pkgdatadir)/corpus.txt, when
 * it is readable, else, for a program run from a build tree before `make install`, that tree's
 * data/corpus.txt (found from the program's location, never from a path compiled in), else
 * NULL. The string is static. Thread-safe.
 */
FSDP_EXTERN const char *fsdp_data_default_corpus(void);

/* ---- loaders ------------------------------------------------------------------------------ */

typedef struct fsdp_loader_options {
    /* sizeof this struct as the caller was built; set by fsdp_loader_options_init() */
    size_t size;
    int64_t batch_size; /* B: rows of a global batch, a multiple of world_size; default 8 */
    int64_t seq_len;    /* T: tokens per row; default 64 */
    int rank;           /* this rank, 0 <= rank < world_size; default 0 */
    int world_size;     /* W; default 1 */
    bool shuffle;       /* visit each epoch's batches in a seeded order; default false */
    uint64_t seed;      /* seed of that order, the same on every rank; default 0 */
} fsdp_loader_options_t;

/* Fills opts with the defaults above. */
FSDP_EXTERN void fsdp_loader_options_init(fsdp_loader_options_t *opts, size_t size);
#define fsdp_loader_options_init(opts) (fsdp_loader_options_init)((opts), sizeof *(opts))

/*
 * Creates rank opts->rank's loader over ds, at position 0. The loader keeps its own reference to
 * the dataset's file, so ds may be destroyed first. ctx (may be NULL) receives the error message
 * of this call, and the loader's error messages too; when it is given, the loader must be used
 * by ctx's rank thread only.
 *
 * The caller owns *out (NULL on failure). Errors (FSDP_EINVAL, message on ctx): batch_size or
 * seq_len not positive, a rank outside [0, world_size), a batch_size that world_size does not
 * divide, a dataset shorter than one batch (B*T + 1 tokens); FSDP_ENOMEM. Thread-safe.
 */
FSDP_EXTERN int fsdp_loader_create(fsdp_ctx_t *ctx, const fsdp_dataset_t *ds,
                                   const fsdp_loader_options_t *opts, fsdp_loader_t **out);

/* Frees a loader; NULL is accepted. */
FSDP_EXTERN void fsdp_loader_destroy(fsdp_loader_t *l);

/* The options the loader was created with (borrowed; their size is this library's). */
FSDP_EXTERN const fsdp_loader_options_t *fsdp_loader_options(const fsdp_loader_t *l);
/* Rows of this rank's part of a batch: batch_size / world_size. */
FSDP_EXTERN int64_t fsdp_loader_rows(const fsdp_loader_t *l);
/* Batches per epoch: floor((N - 1) / (B*T)), at least 1. */
FSDP_EXTERN uint64_t fsdp_loader_num_batches(const fsdp_loader_t *l);

/* The index of the next global batch fsdp_loader_next* will return; save it in a checkpoint. */
FSDP_EXTERN uint64_t fsdp_loader_get_position(const fsdp_loader_t *l);
/* Sets the index of the next batch (any value: past the end is a later epoch). Resuming from a
 * saved position returns the same batches as the run that saved it. */
FSDP_EXTERN int fsdp_loader_set_position(fsdp_loader_t *l, uint64_t position);

/*
 * Reads this rank's rows of global batch `index` without moving the position: inputs and
 * targets each receive rows * T tokens (row-major (rows, T)); targets[k] is the token after
 * inputs[k]. Either may be NULL. Blocking (file I/O). Errors go to fsdp_loader_last_error().
 */
FSDP_EXTERN int fsdp_loader_batch(fsdp_loader_t *l, uint64_t index, int64_t *inputs,
                                  int64_t *targets);

/* Reads the batch at the position, then advances the position by one (on success only). */
FSDP_EXTERN int fsdp_loader_next(fsdp_loader_t *l, int64_t *inputs, int64_t *targets);

/*
 * Same, into tensors of shape (rows, T) and dtype FSDP_DTYPE_I64 or FSDP_DTYPE_I32 on any device
 * (what fsdp_gpt_forward and fsdp_gpt_loss take: i64 targets). Either may be NULL. Nothing is
 * written and the position stays when a shape or dtype is wrong (FSDP_EINVAL).
 */
FSDP_EXTERN int fsdp_loader_next_tensors(fsdp_loader_t *l, fsdp_tensor_t *inputs,
                                         fsdp_tensor_t *targets);

/* The last error of this loader ("" when none). */
FSDP_EXTERN const char *fsdp_loader_last_error(const fsdp_loader_t *l);

FSDP_END_DECLS

#endif /* FSDP_DATA_H */
