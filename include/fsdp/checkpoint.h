/* SPDX-License-Identifier: MIT */
/*
 * fsdp/checkpoint.h: sharded checkpoints that load at any world size: a directory of per-rank
 * safetensors files and one JSON index.
 *
 * A tensor of a checkpoint is a global tensor (a name, a dtype, a shape) cut into pieces: the
 * elements [offset, offset + numel) of the tensor taken in row-major order, each stored as a 1-D
 * tensor in one rank's file. A replicated tensor (a buffer, a step count) is stored whole, once.
 * The directory holds
 *   rank-R-of-W.safetensors  rank R's pieces (names are the global tensors' names; each piece's
 *                            place is in the file's metadata under "piece:<name>" as
 *                            "<replicated 0|1> <offset> <ndim> <dims...>"), so every file is a
 *                            plain safetensors file any reader opens;
 *   index.json               {"format": "libfsdp-checkpoint", "version": 1, "world_size": W,
 *                             "metadata": {string: string},
 *                             "files": [{"name": ..., "size": bytes}, ...],
 *                             "tensors": {name: {"dtype": "F32", "shape": [...],
 *                                                "replicated": false,
 *                                                "chunks": [[file, offset, numel, byte], ...]}}}
 *                            where a chunk is a piece: elements [offset, offset + numel) stored
 *                            in file number `file` from byte `byte` of that file on.
 * A reader needs the index and the byte ranges it wants, nothing else: loading at any world
 * size reads, per rank, only the chunks that overlap its part (pread, never a whole file).
 *
 * Writing (each step below on the ranks named; fsdp_checkpoint_save in fsdp/fsdp.h runs them
 * with the collectives between): rank 0 prepares a staging directory "<dir>.partial" (a stale
 * one from a killed save is removed first); every rank writes its file into it (atomically and
 * fsync'ed, by the safetensors writer); rank 0 builds the index from the files' headers (a piece
 * that replicas wrote twice is indexed once), checks that the pieces of every tensor tile it
 * exactly, writes index.json, and publishes the directory: fsync, then an atomic rename to
 * <dir> (exchanged with an existing <dir>, which is removed afterwards: the first step refuses
 * a <dir> that holds other files than a checkpoint's), then fsync of the parent. A save killed at
 * any point leaves any earlier <dir> whole and loadable.
 *
 * Reading validates before use. fsdp_ckpt_open checks the whole index: the format and version,
 * file names (plain names, no '/', unique), each tensor's dtype, shape and byte counts (no
 * overflow), chunks whose element ranges tile the tensor exactly (no overlap, no gap, nothing
 * past the end) and whose byte ranges lie inside their file's recorded size; and that every file
 * exists with that size. The first read from a file opens it and checks its safetensors header
 * against the index (each chunk there under the tensor's name, with its dtype, length and byte
 * offset, and the piece metadata agreeing). Every error is FSDP_EINVAL naming the tensor and the
 * file. fsdp_ckpt_verify does the header check for every file and reads every byte.
 *
 * Thread-safety: a handle is used by one thread at a time; handles are independent.
 */
#ifndef FSDP_CHECKPOINT_H
#define FSDP_CHECKPOINT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/context.h>
#include <fsdp/dtype.h>
#include <fsdp/export.h>
#include <fsdp/safetensors.h>
#include <fsdp/tensor.h>

FSDP_BEGIN_DECLS

/* ---- pieces of global tensors -----------------------------------------------------------------
 */

/*
 * One piece of a global tensor: the elements [offset, offset + numel(t)) taken in row-major
 * order, as a 1-D tensor; a replicated entry holds the whole tensor (its own shape, offset 0)
 * and is the same on every rank. FSDP's sharded state dicts are lists of these (fsdp/fsdp.h).
 */
typedef struct fsdp_shard_entry {
    char *name;                   /* the global tensor's name */
    fsdp_tensor_t *t;             /* the piece (a reference the list owns) */
    int ndim;                     /* of the global tensor */
    int64_t shape[FSDP_MAX_DIMS]; /* the global shape */
    int64_t offset;               /* of the piece's first element in the global tensor */
    bool replicated;
} fsdp_shard_entry_t;

typedef struct fsdp_shard_list {
    size_t n;
    fsdp_shard_entry_t *e;
} fsdp_shard_list_t;

/* Releases the pieces and names; the list is empty afterwards. NULL is accepted. */
FSDP_EXTERN void fsdp_shard_list_free(fsdp_shard_list_t *l);

/* ---- writing ----------------------------------------------------------------------------------
 */

/* The index's file name. */
#define FSDP_CKPT_INDEX "index.json"

/* The staging directory of dir ("<dir>.partial") into buf; FSDP_EINVAL when it does not fit. */
FSDP_EXTERN int fsdp_ckpt_staging_path(const char *dir, char *buf, size_t cap);
/* Rank 0's first step: refuses a dir that exists and is not a directory or holds anything a
 * checkpoint writer does not make (publishing replaces dir and removes the old one's files);
 * removes a stale staging directory of dir (its files only: rank files, the index and the
 * writer's temporary files; anything else there is an error, nothing is removed) and creates it
 * empty. */
FSDP_EXTERN int fsdp_ckpt_prepare(fsdp_ctx_t *ctx, const char *dir);
/* Writes rank's pieces into dir's staging directory as "rank-<rank>-of-<world>.safetensors"
 * (names unique; pieces of one global tensor on one rank must be one piece). */
FSDP_EXTERN int fsdp_ckpt_write_rank(fsdp_ctx_t *ctx, const char *dir, int rank, int world,
                                     const fsdp_shard_list_t *pieces);
/* The same, with the checkpoint's metadata (the meta that fsdp_ckpt_finish will be given, on
 * every rank) copied into the file as "meta:<key>" entries. fsdp_ckpt_finish and every load
 * check that a file's copies are exactly the index's metadata, so a file left by another save
 * (another step or run id) is never taken for part of this one. */
FSDP_EXTERN int fsdp_ckpt_write_rank_meta(fsdp_ctx_t *ctx, const char *dir, int rank, int world,
                                          const fsdp_shard_list_t *pieces,
                                          const fsdp_safetensors_kv_t *meta, size_t nmeta);
/* Rank 0's last step, once every rank's file is in the staging directory: builds and checks the
 * index (meta: nmeta strings for its "metadata"), writes it and publishes the directory. */
FSDP_EXTERN int fsdp_ckpt_finish(fsdp_ctx_t *ctx, const char *dir, int world,
                                 const fsdp_safetensors_kv_t *meta, size_t nmeta);

/* Removes path, a checkpoint directory or the staging directory of a save that died
 * ("<dir>.partial", "<dir>.partial.old"), when it holds nothing but what a checkpoint writer
 * makes; anything else there (or path being a symbolic link or not a directory) is FSDP_EINVAL
 * and nothing is removed. An absent path is success. Not collective: one process calls it. */
FSDP_EXTERN int fsdp_ckpt_remove(fsdp_ctx_t *ctx, const char *path);

/* ---- reading ----------------------------------------------------------------------------------
 */

typedef struct fsdp_ckpt fsdp_ckpt_t;

/* One tensor of a checkpoint (strings borrowed from the handle). */
typedef struct fsdp_ckpt_info {
    size_t index; /* 0 .. count-1, in name order */
    const char *name;
    const char *st_dtype; /* the stored dtype: "F32", "BF16", ... */
    fsdp_dtype_t dtype;   /* FSDP_DTYPE_COUNT when libfsdp has no such type */
    size_t esize;         /* bytes per stored element */
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    int64_t numel;
    bool replicated;
    size_t nchunks;
} fsdp_ckpt_info_t;

/* One chunk of a tensor. */
typedef struct fsdp_ckpt_chunk {
    const char *file; /* name inside the directory (borrowed) */
    size_t file_index;
    int64_t offset, numel; /* elements of the global tensor */
    uint64_t byte;         /* where they start in the file */
} fsdp_ckpt_chunk_t;

/* Opens and validates the checkpoint directory dir (see the top of this file). ctx may be NULL;
 * errors are reported on it when given. The caller closes *out. */
FSDP_EXTERN int fsdp_ckpt_open(fsdp_ctx_t *ctx, const char *dir, fsdp_ckpt_t **out);
FSDP_EXTERN void fsdp_ckpt_close(fsdp_ckpt_t *ck);
/* The last error on the handle ("" when none). */
FSDP_EXTERN const char *fsdp_ckpt_last_error(const fsdp_ckpt_t *ck);

FSDP_EXTERN int fsdp_ckpt_world_size(const fsdp_ckpt_t *ck);
FSDP_EXTERN size_t fsdp_ckpt_file_count(const fsdp_ckpt_t *ck);
/* File i's name and recorded size. */
FSDP_EXTERN int fsdp_ckpt_file(const fsdp_ckpt_t *ck, size_t i, const char **name, uint64_t *size);
FSDP_EXTERN size_t fsdp_ckpt_count(const fsdp_ckpt_t *ck);
FSDP_EXTERN int fsdp_ckpt_info(const fsdp_ckpt_t *ck, size_t i, fsdp_ckpt_info_t *out);
/* FSDP_EINVAL naming name when the checkpoint has no such tensor. */
FSDP_EXTERN int fsdp_ckpt_find(const fsdp_ckpt_t *ck, const char *name, fsdp_ckpt_info_t *out);
FSDP_EXTERN int fsdp_ckpt_chunk_at(const fsdp_ckpt_t *ck, size_t tensor, size_t j,
                                   fsdp_ckpt_chunk_t *out);
FSDP_EXTERN size_t fsdp_ckpt_metadata_count(const fsdp_ckpt_t *ck);
FSDP_EXTERN int fsdp_ckpt_metadata_at(const fsdp_ckpt_t *ck, size_t i, fsdp_safetensors_kv_t *out);
/* The value of key in the index's metadata (borrowed), or NULL. */
FSDP_EXTERN const char *fsdp_ckpt_metadata(const fsdp_ckpt_t *ck, const char *key);

/* Reads the elements [offset, offset + numel) of tensor name into dst in its stored dtype
 * (little-endian bytes as stored), bytes = numel * esize exactly. Only the chunks that overlap
 * are read. */
FSDP_EXTERN int fsdp_ckpt_read_raw(fsdp_ckpt_t *ck, const char *name, int64_t offset, int64_t numel,
                                   void *dst, size_t bytes);
/* The same, converted to dt in host byte order (bytes = numel * size(dt)). FSDP_ENOTSUP for a
 * stored dtype libfsdp has no type for. */
FSDP_EXTERN int fsdp_ckpt_read(fsdp_ckpt_t *ck, const char *name, int64_t offset, int64_t numel,
                               fsdp_dtype_t dt, void *dst, size_t bytes);
/* Fills every entry of want from the tensor called prefix + name (prefix may be NULL): its
 * elements [offset, offset + numel(t)) converted to the entry's dtype, into the entry's tensor
 * (any device). Each entry's global shape must be the stored one (FSDP_EINVAL naming both
 * otherwise); everything is checked before anything is read. */
FSDP_EXTERN int fsdp_ckpt_read_pieces(fsdp_ckpt_t *ck, const char *prefix,
                                      const fsdp_shard_list_t *want);
/* Checks every file's header against the index (its pieces, and its copy of the metadata: a
 * file of another save is refused) without reading the data: cheap, for choosing a checkpoint. */
FSDP_EXTERN int fsdp_ckpt_check_files(fsdp_ckpt_t *ck);
/* Checks every file's header against the index and reads every byte of every chunk. */
FSDP_EXTERN int fsdp_ckpt_verify(fsdp_ckpt_t *ck);

FSDP_END_DECLS

#endif /* FSDP_CHECKPOINT_H */
