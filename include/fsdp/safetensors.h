/* SPDX-License-Identifier: MIT */
/*
 * fsdp/safetensors.h: checkpoints in the safetensors format, and Hugging Face GPT-2 layouts.
 *
 * A safetensors file is an 8-byte little-endian header length N, N bytes of JSON, and a data
 * section. The JSON is an object mapping each tensor name to {"dtype", "shape", "data_offsets"}
 * (offsets relative to the data section), plus an optional "__metadata__" object of strings.
 * Elements are row-major and little-endian.
 *
 * Reading validates the whole file when it is opened, before any tensor is read: the header
 * length (at most FSDP_SAFETENSORS_MAX_HEADER and what the file holds), the JSON (an object, no
 * duplicate names), every entry (a known dtype, a shape of at most FSDP_MAX_DIMS non-negative
 * sizes whose byte count does not overflow, offsets inside the data section whose length
 * matches dtype and shape), and the layout of the data section (no two tensors overlap, no gap
 * between them, nothing after the last one). Every message names the file and the tensor or
 * field at fault. Data is read with pread(2) and every read is checked again, so a file that
 * shrinks after it was opened gives an error, never a crash.
 *
 * Writing goes to a temporary file in the destination's directory ("<path>.tmp-<pid>-<n>"),
 * which is written, fsync'ed and renamed over the destination; then the directory is fsync'ed.
 * A crash or a failed write at any point leaves the previous file whole (and perhaps a stale
 * temporary file beside it, which no reader ever opens). The header is padded with spaces so
 * that the data section starts at a multiple of 8 bytes, as the format recommends.
 *
 * Errors: every function returns 0 or a negative FSDP_E* code. The message goes to the handle
 * (fsdp_safetensors_last_error) and, when the handle or the call has a context, to
 * fsdp_ctx_last_error(). Format problems and failing system calls are FSDP_EINVAL, a dtype that
 * libfsdp cannot represent FSDP_ENOTSUP, a failed allocation FSDP_ENOMEM.
 *
 * Thread-safety: one handle is used by one thread at a time; different handles (on the same
 * file or not) are independent.
 */
#ifndef FSDP_SAFETENSORS_H
#define FSDP_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/context.h>
#include <fsdp/device.h>
#include <fsdp/dtype.h>
#include <fsdp/export.h>
#include <fsdp/nn.h>
#include <fsdp/tensor.h>

FSDP_BEGIN_DECLS

/* The largest JSON header accepted (the reference implementation's limit), in bytes. */
#define FSDP_SAFETENSORS_MAX_HEADER 100000000u

typedef struct fsdp_safetensors fsdp_safetensors_t;

/* One tensor of an open file. Strings are borrowed from the handle and live until it closes. */
typedef struct fsdp_safetensors_info {
    size_t index;         /* position in the header, 0 .. count-1 */
    const char *name;     /* the tensor's name in the file */
    const char *st_dtype; /* the file's dtype string: "F32", "BF16", "I16", ... */
    fsdp_dtype_t dtype;   /* the libfsdp dtype; FSDP_DTYPE_COUNT when libfsdp has none */
    int ndim;             /* 0 (a scalar) .. FSDP_MAX_DIMS */
    int64_t shape[FSDP_MAX_DIMS];
    int64_t numel;   /* product of the shape (1 for a scalar) */
    uint64_t offset; /* where the data starts, in bytes from the start of the file */
    uint64_t nbytes; /* numel * element size */
} fsdp_safetensors_info_t;

/* A metadata entry (both strings borrowed). */
typedef struct fsdp_safetensors_kv {
    const char *key;
    const char *value;
} fsdp_safetensors_kv_t;

/* ---- reading ----------------------------------------------------------------------------- */

/*
 * Opens and validates path (see the top of this file). ctx may be NULL; with a context, errors
 * are reported on it, and fsdp_safetensors_load_tensor() creates tensors on its default device.
 * The caller owns *out (NULL on failure) and closes it with fsdp_safetensors_close(). Reads the
 * header only; blocks on the file system.
 */
FSDP_EXTERN int fsdp_safetensors_open(fsdp_ctx_t *ctx, const char *path, fsdp_safetensors_t **out);
/* Closes the file and frees the handle; NULL is accepted. */
FSDP_EXTERN void fsdp_safetensors_close(fsdp_safetensors_t *st);
/* The last error reported on the handle ("" when none); valid until the next failing call. */
FSDP_EXTERN const char *fsdp_safetensors_last_error(const fsdp_safetensors_t *st);

/* Number of tensors in the file (0 for NULL). */
FSDP_EXTERN size_t fsdp_safetensors_count(const fsdp_safetensors_t *st);
/* The i-th tensor in header order. FSDP_EINVAL when i >= count. */
FSDP_EXTERN int fsdp_safetensors_info(const fsdp_safetensors_t *st, size_t i,
                                      fsdp_safetensors_info_t *out);
/* The tensor called name. FSDP_EINVAL naming it when the file has none. */
FSDP_EXTERN int fsdp_safetensors_find(const fsdp_safetensors_t *st, const char *name,
                                      fsdp_safetensors_info_t *out);

/* Number of "__metadata__" entries, and the i-th in header order (FSDP_EINVAL out of range). */
FSDP_EXTERN size_t fsdp_safetensors_metadata_count(const fsdp_safetensors_t *st);
FSDP_EXTERN int fsdp_safetensors_metadata_at(const fsdp_safetensors_t *st, size_t i,
                                             fsdp_safetensors_kv_t *out);
/* The metadata value of key (borrowed), or NULL when absent. */
FSDP_EXTERN const char *fsdp_safetensors_metadata(const fsdp_safetensors_t *st, const char *key);

/* Copies the stored bytes of tensor `name` (little-endian, the file's dtype, whatever it is)
 * into dst, which must hold exactly info.nbytes bytes. */
FSDP_EXTERN int fsdp_safetensors_read_raw(fsdp_safetensors_t *st, const char *name, void *dst,
                                          size_t bytes);
/* Reads tensor `name` converted to dtype dt (fsdp_dtype_convert's rules; host byte order) into
 * dst, which must hold exactly numel * fsdp_dtype_size(dt) bytes. FSDP_ENOTSUP when the file's
 * dtype has no libfsdp equivalent. */
FSDP_EXTERN int fsdp_safetensors_read(fsdp_safetensors_t *st, const char *name, fsdp_dtype_t dt,
                                      void *dst, size_t bytes);
/* Overwrites the elements of dst (any device, dtype and strides; the shape must be the
 * file's) with tensor `name`, converted to dst's dtype. Not recorded by autograd; refused, as
 * fsdp_tensor_copy_from_host() is, for a non-leaf that requires grad. */
FSDP_EXTERN int fsdp_safetensors_read_tensor(fsdp_safetensors_t *st, const char *name,
                                             fsdp_tensor_t *dst);
/* A new contiguous tensor holding tensor `name` in the file's dtype, on the default device of
 * the handle's context (FSDP_EINVAL when the handle has none), counted under FSDP_MEM_OTHER.
 * The caller owns *out. */
FSDP_EXTERN int fsdp_safetensors_load_tensor(fsdp_safetensors_t *st, const char *name,
                                             fsdp_tensor_t **out);
/* Every tensor of the file, in header order, as new tensors (see load_tensor) in a list that
 * owns them (free it with fsdp_named_list_free). */
FSDP_EXTERN int fsdp_safetensors_load_all(fsdp_safetensors_t *st, fsdp_named_list_t *out);

/*
 * Copies the file's tensors into the tensors of dst by name (a state dict from
 * fsdp_module_state_dict() loads a module), converting dtypes. Everything is checked before
 * anything is written: a shape mismatch, a NULL tensor or a dtype libfsdp cannot read is always
 * an error; with strict, so is a name of dst missing from the file or a name of the file
 * missing from dst. The error lists every problem by name and nothing is modified. Without
 * strict, missing and unexpected names are listed in the last-error text of the handle (and
 * context), with status 0. A name of dst whose tensor is a view of the same elements as an
 * entry that was loaded (a tied weight saved once) does not count as missing. An I/O error
 * part-way through leaves the entries before it loaded.
 */
FSDP_EXTERN int fsdp_safetensors_load_into(fsdp_safetensors_t *st, const fsdp_named_list_t *dst,
                                           bool strict);
/* fsdp_safetensors_load_into() with m's state dict. */
FSDP_EXTERN int fsdp_safetensors_load_module(fsdp_safetensors_t *st, fsdp_module_t *m, bool strict);

/* ---- writing ------------------------------------------------------------------------------ */

/*
 * Writes the tensors of `tensors` (any devices and strides; names unique, non-empty, valid
 * UTF-8 and not "__metadata__") and nmeta metadata strings (keys unique) to path, atomically
 * (see the top of this file). The data section follows the list's order. Reports on ctx, or
 * when ctx is NULL on the first tensor's context. Blocks until the file and its directory are
 * on stable storage. On failure the temporary file is removed and path is untouched. Only a
 * regular file is replaced: a path that is a FIFO, a device, a directory or a symbolic link is
 * refused (FSDP_EINVAL, naming it and what it is), checked before writing and before the rename.
 */
FSDP_EXTERN int fsdp_safetensors_save(fsdp_ctx_t *ctx, const char *path,
                                      const fsdp_named_list_t *tensors,
                                      const fsdp_safetensors_kv_t *meta, size_t nmeta);
/* Saves m's state dict, each shared (tied) tensor once, under its first name. */
FSDP_EXTERN int fsdp_safetensors_save_module(const fsdp_module_t *m, const char *path,
                                             const fsdp_safetensors_kv_t *meta, size_t nmeta);

/* ---- Hugging Face GPT-2 -------------------------------------------------------------------- */
/*
 * Hugging Face's GPT2LMHeadModel names libfsdp's GPT parameters (fsdp_gpt_create) with a
 * "transformer." prefix ("wte.weight" is "transformer.wte.weight", "h.0.attn.c_attn.weight" is
 * "transformer.h.0.attn.c_attn.weight"), and stores the weights of attn.c_attn, attn.c_proj,
 * mlp.c_fc and mlp.c_proj as Conv1D weights: (in, out), the transpose of libfsdp's Linear
 * (out, in). Its files also hold buffers that are not parameters (h.<i>.attn.bias and
 * h.<i>.attn.masked_bias, the causal mask) and, in some, lm_head.weight, a copy of wte.weight.
 */

/* Writes the Hugging Face name of libfsdp GPT parameter fqn into buf (cap bytes). FSDP_EINVAL
 * when it does not fit. */
FSDP_EXTERN int fsdp_gpt2_hf_name(const char *fqn, char *buf, size_t cap);
/* The libfsdp name of a Hugging Face GPT-2 entry, with or without the "transformer." prefix
 * (GPT2Model files have none). Returns 0 with the name in buf, 1 (buf set to "") for an entry
 * that loading skips (attn.bias, attn.masked_bias, lm_head.weight), or FSDP_EINVAL when it does
 * not fit. */
FSDP_EXTERN int fsdp_gpt2_name_from_hf(const char *hf, char *buf, size_t cap);
/* Whether libfsdp GPT parameter fqn is stored transposed (a Conv1D weight) by Hugging Face. */
FSDP_EXTERN bool fsdp_gpt2_hf_is_conv1d(const char *fqn);

/* Saves GPT m (made by fsdp_gpt_create) in Hugging Face's GPT2LMHeadModel layout: prefixed
 * names, Conv1D weights transposed, no buffers and no lm_head.weight (it is tied to wte), and
 * the metadata given plus {"format": "pt"} unless meta sets "format". */
FSDP_EXTERN int fsdp_gpt2_hf_save(const fsdp_module_t *m, const char *path,
                                  const fsdp_safetensors_kv_t *meta, size_t nmeta);
/* Loads a Hugging Face GPT-2 file (GPT2LMHeadModel or GPT2Model names) into GPT m, transposing
 * Conv1D weights and skipping attn.bias, attn.masked_bias and lm_head.weight; strict as in
 * fsdp_safetensors_load_into(). */
FSDP_EXTERN int fsdp_gpt2_hf_load(fsdp_module_t *m, fsdp_safetensors_t *st, bool strict);

FSDP_END_DECLS

#endif /* FSDP_SAFETENSORS_H */
