/* SPDX-License-Identifier: MIT */
/*
 * ckpt_util.h: a small valid checkpoint directory for the corrupted-checkpoint tests
 * (t_ckpt_corrupt.c) and the fuzz target (fuzz_ckpt.c), written with the io layer's writer
 * (fsdp_ckpt_prepare, fsdp_ckpt_write_rank for ranks 0..2 of world 3, fsdp_ckpt_finish), plus
 * file helpers.
 *
 * The checkpoint (values in host order; the files hold little-endian bytes, which is the same
 * on the little-endian hosts the tests run on):
 *   "w.f32"    F32 [4, 6], split over the 3 ranks: rank r holds elements [8r, 8r + 8);
 *   "b.bf16"   BF16 [10], 2 chunks: rank 1 holds [0, 5), rank 2 holds [5, 10);
 *   "step.i64" I64 [3], replicated, written by rank 0 only;
 *   "dup.f32"  F32 [6]: ranks 0 and 1 both wrote the identical piece [0, 3) (replicas), rank 2
 *              wrote [3, 6); the index holds it once (rank 0's).
 * Ranks 1 and 2 hold pieces of the same names, dtypes and lengths in the same order, so their
 * files have the same size and can be swapped without the sizes telling.
 */
#ifndef FSDP_TESTS_CKPT_UTIL_H
#define FSDP_TESTS_CKPT_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include <fsdp.h>

#define CKPT_UTIL_WORLD 3
#define CKPT_UTIL_NTENSORS 4

/* One tensor of the checkpoint: its global values as stored (host order). */
struct ckpt_util_tensor {
    const char *name;
    fsdp_dtype_t dtype;
    size_t esize;
    int ndim;
    int64_t shape[2];
    int64_t numel;
    const void *data;
};

/* The tensors, in name order (the order fsdp_ckpt_info lists them). */
extern const struct ckpt_util_tensor ckpt_util_tensors[CKPT_UTIL_NTENSORS];

/* Element i of t as a double (BF16 widened exactly). */
double ckpt_util_value(const struct ckpt_util_tensor *t, int64_t i);

/* Writes the checkpoint at dir (which must not exist, nor "<dir>.partial"); returns the status
 * of the first step that failed (its message is on ctx). */
int ckpt_util_build(fsdp_ctx_t *ctx, const char *dir);

/* "dir/name" into a static buffer (8 in rotation). */
const char *ckpt_util_path(const char *dir, const char *name);
/* The whole file (malloc'ed, *n its size), or NULL. */
unsigned char *ckpt_util_read_file(const char *path, size_t *n);
/* Writes n bytes as path (replacing it); 0 or -1. */
int ckpt_util_write_file(const char *path, const void *p, size_t n);
/* Copies the regular files of directory src into directory dst (created); 0 or -1. */
int ckpt_util_copy_dir(const char *src, const char *dst);
/* Removes directory path and the files in it (one level); missing is fine. */
void ckpt_util_rm_dir(const char *path);
/* The size of the file at path, or -1 when stat fails. */
int64_t ckpt_util_file_size(const char *path);
/* The first occurrence of string s in the n bytes at p, or NULL. */
unsigned char *ckpt_util_find(unsigned char *p, size_t n, const char *s);

#endif /* FSDP_TESTS_CKPT_UTIL_H */
