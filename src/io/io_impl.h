/* SPDX-License-Identifier: MIT */
/*
 * io_impl.h: what the files of the io layer (src/io/) share: the open safetensors handle, its
 * error reporting, and the mapped load and the writer that the Hugging Face GPT-2 helpers reuse.
 *
 * Invariant of an open handle: every entry was validated when the file was opened, so
 * begin <= end <= data_len, end - begin == numel * esize, and the entries tile the data
 * section exactly. Reads still check what pread returns, because the file may change.
 */
#ifndef FSDP_IO_IMPL_H
#define FSDP_IO_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/data.h>
#include <fsdp/nn.h>
#include <fsdp/safetensors.h>
#include <fsdp/tensor.h>
#include <fsdp/transformer.h>

#include "internal.h"

/* One tensor of the header. */
struct fsdp__st_entry {
    char *name;
    const char *st_dtype; /* static string: "F32", ... */
    fsdp_dtype_t dtype;   /* FSDP_DTYPE_COUNT when libfsdp has no such type */
    size_t esize;         /* bytes per element in the file */
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    uint64_t numel;
    uint64_t begin, end; /* data_offsets, relative to the data section */
};

struct fsdp_safetensors {
    fsdp_ctx_t *ctx; /* borrowed; may be NULL */
    int fd;
    char *path;
    uint64_t file_size;
    uint64_t data_start; /* 8 + header length */
    uint64_t data_len;   /* file_size - data_start */
    size_t n;
    struct fsdp__st_entry *e; /* header order */
    size_t *by_name;          /* indices of e sorted by name, for lookups */
    size_t nmeta;
    char **meta_key, **meta_val; /* header order */
    char err[FSDP_ERR_LEN];
};

/* Formats an error into st->err and onto st->ctx (when set); returns rc. rc == FSDP_OK records
 * a report (a non-strict load's list) without an error. */
int fsdp__st_err(fsdp_safetensors_t *st, int rc, const char *fmt, ...) FSDP_PRINTF(3, 4);

/* The safetensors name of a libfsdp dtype ("F32", ...); NULL for an invalid one. */
const char *fsdp__st_dtype_name(fsdp_dtype_t dt);

/* The static name of safetensors dtype string s ("F32", ...) with its element size and libfsdp
 * dtype (FSDP_DTYPE_COUNT when libfsdp has none); NULL for an unknown string. */
const char *fsdp__st_dtype_parse(const char *s, size_t *esize, fsdp_dtype_t *dt);

/* The host memory of t's elements, in file order (little-endian, row-major), when t can be read
 * or written in place: a contiguous tensor on a CPU device, on a little-endian host; else NULL. */
void *fsdp__io_host_bytes(const fsdp_tensor_t *t);

/* Writes all n bytes to fd (0, or -1 with errno). */
int fsdp__io_write_all(int fd, const void *p, size_t n);
/* Reads exactly n bytes at off: 0, -1 with errno on an error, or 1 when the file ends first. */
int fsdp__io_pread_all(int fd, void *buf, size_t n, uint64_t off);

/* A printable copy of a name taken from a file, for messages: control bytes become '?', and a
 * name over about 200 bytes is cut with "...". Returns buf. */
const char *fsdp__st_shown(const char *name, char *buf, size_t cap);

/* "[2, 3]" into buf of cap bytes; returns buf. */
const char *fsdp__st_shape_str(const int64_t *shape, int nd, char *buf, size_t cap);

/* fsdp_safetensors_open(), and when err is given, a failure's message copied there (cap bytes)
 * instead of logged: the checkpoint reader opens rank files without a context and reports the
 * message on its own handle. */
int fsdp__st_open(fsdp_ctx_t *ctx, const char *path, char *err, size_t cap,
                  fsdp_safetensors_t **out);

/* Parses and validates the header hdr of len bytes of st (whose path and data_len are set):
 * fills the entries, the index by name and the metadata, or returns an error reported on st. */
int fsdp__st_parse_header(fsdp_safetensors_t *st, const char *hdr, size_t len);

/* The entry called name, or NULL. */
const struct fsdp__st_entry *fsdp__st_lookup(const fsdp_safetensors_t *st, const char *name);

/* Reads entry e converted to dtype dt (host byte order) into dst of numel * size(dt) bytes;
 * caller-checked sizes. */
int fsdp__st_read_entry(fsdp_safetensors_t *st, const struct fsdp__st_entry *e, fsdp_dtype_t dt,
                        void *dst);
/* Writes entry e into dst, whose shape is e's, or e's transposed when transpose (2-d only). */
int fsdp__st_read_into(fsdp_safetensors_t *st, const struct fsdp__st_entry *e, fsdp_tensor_t *dst,
                       bool transpose);

/* Maps a file's entry name to the name of the destination entry it loads. Returns 0 with the
 * name in out (cap bytes: the file name's length plus 64) and *transpose set, 1 to skip the
 * entry silently, or a negative status. */
typedef int (*fsdp__st_map_fn)(const char *file_name, void *arg, char *out, size_t cap,
                               bool *transpose);
/* fsdp_safetensors_load_into() through a map (NULL: names are equal, nothing transposed);
 * `fn` names the public function in messages. */
int fsdp__st_load_mapped(fsdp_safetensors_t *st, const fsdp_named_list_t *dst, bool strict,
                         fsdp__st_map_fn map, void *arg, const char *fn);

/* The writer behind fsdp_safetensors_save(): n entries of parallel names and tensors. */
int fsdp__st_write(fsdp_ctx_t *ctx, const char *path, size_t n, char *const *names,
                   fsdp_tensor_t *const *tensors, const fsdp_safetensors_kv_t *meta, size_t nmeta,
                   const char *fn);

/* m's state dict with each shared tensor once, under its first name (an owned list). */
int fsdp__st_state_dict_unique(const fsdp_module_t *m, fsdp_named_list_t *out);

/* Whether a and b are views of the same elements (same storage, offset, shape and strides). */
bool fsdp__st_same_view(const fsdp_tensor_t *a, const fsdp_tensor_t *b);

#endif /* FSDP_IO_IMPL_H */
