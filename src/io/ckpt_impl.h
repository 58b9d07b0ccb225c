/* SPDX-License-Identifier: MIT */
/*
 * ckpt_impl.h: what the checkpoint-directory files of the io layer share (ckpt_index.c,
 * ckpt_write.c, ckpt_read.c): the in-memory index, which the writer builds from the rank files'
 * headers and the reader from index.json, and the one validation both run on it.
 *
 * Invariant of a handle that passed fsdp__ckpt_check: tensors are sorted by name (unique);
 * every tensor's chunks are sorted by offset and tile [0, numel) exactly; every chunk's byte
 * range [byte, byte + numel * esize) lies inside its file's recorded size; a replicated tensor
 * has one chunk.
 */
#ifndef FSDP_CKPT_IMPL_H
#define FSDP_CKPT_IMPL_H

#include <fsdp/checkpoint.h>

#include "io/io_impl.h"

#define FSDP__CKPT_FORMAT "libfsdp-checkpoint"
#define FSDP__CKPT_VERSION 1
/* The rank files' name pattern and the piece metadata's key prefix. */
#define FSDP__CKPT_RANK_FMT "rank-%d-of-%d.safetensors"
#define FSDP__CKPT_PIECE_KEY "piece:"
/* The prefix of the checkpoint's metadata copied into every rank file ("meta:step", ...). */
#define FSDP__CKPT_META_KEY "meta:"

struct fsdp__ckpt_chunk {
    size_t file;
    int64_t offset, numel;
    uint64_t byte;
};

struct fsdp__ckpt_tensor {
    char *name;
    const char *st_dtype; /* static */
    fsdp_dtype_t dtype;
    size_t esize;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    int64_t numel;
    bool replicated;
    size_t nchunks, cap;
    struct fsdp__ckpt_chunk *c;
};

struct fsdp__ckpt_file {
    char *name;
    uint64_t size;
    fsdp_safetensors_t *st; /* opened and checked against the index at first use */
};

struct fsdp_ckpt {
    fsdp_ctx_t *ctx; /* borrowed; may be NULL */
    char *dir;
    int world;
    size_t nfiles;
    struct fsdp__ckpt_file *f;
    size_t n, cap;
    struct fsdp__ckpt_tensor *t;
    size_t nmeta;
    char **mk, **mv;
    char err[FSDP_ERR_LEN];
};

/* Formats an error into ck->err and onto ck->ctx; returns rc. */
int fsdp__ckpt_err(fsdp_ckpt_t *ck, int rc, const char *fmt, ...) FSDP_PRINTF(3, 4);
/* A new empty handle for dir (NULL when out of memory). */
fsdp_ckpt_t *fsdp__ckpt_new(fsdp_ctx_t *ctx, const char *dir);
/* The tensor called name, or NULL (ck->t sorted). */
struct fsdp__ckpt_tensor *fsdp__ckpt_lookup(const fsdp_ckpt_t *ck, const char *name);
/* Sorts the tensors by name and each tensor's chunks by offset, then checks the invariant
 * above (plus dtype, shape and overflow of every count); errors name src (where the index came
 * from: index.json's path, or the staging directory whose headers it was built from), the
 * tensor and the rank file. */
int fsdp__ckpt_check(fsdp_ckpt_t *ck, const char *src);
/* Parses index.json's text into ck (then fsdp__ckpt_check). */
int fsdp__ckpt_parse_index(fsdp_ckpt_t *ck, const char *text, size_t len, const char *path);
/* Writes ck as index.json into directory dir (atomically, fsync'ed). */
int fsdp__ckpt_write_index(fsdp_ckpt_t *ck, const char *dir);
/* Checks that rank file st (path) belongs to the checkpoint ck describes: its "meta:<key>" copies
 * are exactly ck's metadata (same keys, same values), so that a file of another save (another
 * step, another run) is refused, naming the key and both values. A file with no copy at all was
 * written without them (by fsdp_ckpt_write_rank, or an earlier libfsdp) and is accepted. */
int fsdp__ckpt_check_file_meta(fsdp_ckpt_t *ck, const fsdp_safetensors_t *st, const char *path);
/* Parses a "piece:<name>" metadata value. */
int fsdp__ckpt_parse_piece(const char *v, bool *replicated, int64_t *offset, int *ndim,
                           int64_t *shape);

#endif /* FSDP_CKPT_IMPL_H */
