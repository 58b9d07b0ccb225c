/* SPDX-License-Identifier: MIT */
/*
 * golden.h: reading golden vectors (reference tensors written by PyTorch) in tests.
 *
 * A golden file is a flat list of named tensors. Little-endian throughout:
 *
 *   magic     8 bytes   "FSDPGLD1"
 *   count     u32       number of records
 *   count records, each:
 *     name_len  u16       bytes of the name, >= 1
 *     name      name_len  UTF-8, no NUL; hierarchical ("linear/bias/grad/x"), unique in the file
 *     dtype     u8        an fsdp_dtype_t code (F32=0 F64=1 F16=2 BF16=3 I32=4 I64=5 U8=6 BOOL=7)
 *     ndim      u8        0..8 (0: a scalar with one element)
 *     shape     ndim x i64, each >= 0
 *     data      numel * dtype size bytes, row-major; no padding between records
 *
 * Nothing may follow the last record. The generator is tests/golden/gen.py; the format is
 * also described in tests/golden/README.md.
 *
 * The loader copies everything it keeps, validates every length against the bytes that are
 * left, and fails cleanly (an error code and a message, never a crash) on a truncated or corrupt
 * file. A loaded golden_t is immutable, so several threads may read it.
 *
 * golden_check() is a static inline function (not in golden.c) on purpose: tap.h keeps its
 * counters in a static per translation unit, so the TAP line must be emitted from the test
 * program's own translation unit to be numbered with its other tests.
 */
#ifndef FSDP_TEST_GOLDEN_H
#define FSDP_TEST_GOLDEN_H

#include <stddef.h>
#include <stdint.h>

#include <fsdp/context.h>
#include <fsdp/dtype.h>
#include <fsdp/errno.h>
#include <fsdp/tensor.h>

#include "tap.h"

#define GOLDEN_MAGIC "FSDPGLD1"
#define GOLDEN_MAX_DIMS 8

/* golden_load() statuses besides 0 and the FSDP_E* codes (FSDP_EINVAL: corrupt file,
 * FSDP_ENOMEM). */
#define GOLDEN_ENOENT (-100) /* the file does not exist */
#define GOLDEN_EIO (-101)    /* it exists but could not be read */

typedef struct golden_rec {
    const char *name; /* NUL-terminated copy of the record's name */
    fsdp_dtype_t dtype;
    int ndim;                       /* 0..GOLDEN_MAX_DIMS */
    int64_t shape[GOLDEN_MAX_DIMS]; /* entries past ndim are 0 */
    int64_t numel;                  /* product of shape (1 for ndim 0) */
    size_t bytes;                   /* numel * dtype size */
    const void *data;               /* bytes of row-major data, 16-byte aligned; NULL if 0 */
} golden_rec_t;

typedef struct golden golden_t;

/* Loads a golden file. On success *out owns every record (free with golden_free). On failure
 * *out is NULL and the status is GOLDEN_ENOENT, GOLDEN_EIO, FSDP_EINVAL (corrupt or truncated)
 * or FSDP_ENOMEM; golden_load_msg() also writes a one-line reason into msg (msg may be NULL). */
int golden_load(const char *path, golden_t **out);
int golden_load_msg(const char *path, golden_t **out, char *msg, size_t msglen);
/* Parses a golden file held in memory (copied; buf may be freed afterwards). Same statuses
 * except the I/O ones. */
int golden_parse(const void *buf, size_t len, golden_t **out, char *msg, size_t msglen);
/* Frees a loaded file and all its records; NULL is accepted. */
void golden_free(golden_t *g);

/* Number of records, and record i (0 <= i < count, in file order; NULL otherwise). */
int golden_count(const golden_t *g);
const golden_rec_t *golden_at(const golden_t *g, int i);
/* The record with exactly this name, or NULL. */
const golden_rec_t *golden_find(const golden_t *g, const char *name);
/* golden_find() of the name "prefix/key" (a case's member). */
const golden_rec_t *golden_findf(const golden_t *g, const char *prefix, const char *key);

/* Reads element i of a record as a double (any dtype); NaN when i is out of range. */
double golden_value(const golden_rec_t *r, int64_t i);
/* Reads a parameter record as integers: up to max values into v, returns the number of elements
 * (-1 when r is NULL or has more than max elements). Float records are truncated. */
int golden_ints(const golden_rec_t *r, int64_t *v, int max);

/* A new contiguous tensor on ctx's device holding a copy of the record (same dtype and shape),
 * counted under FSDP_MEM_OTHER; NULL on failure (the reason is on ctx). The caller releases it. */
fsdp_tensor_t *golden_tensor(fsdp_ctx_t *ctx, const golden_rec_t *r);

/* Compares a tensor with a record: same dtype, same shape, and every element within
 * |got - want| <= atol + rtol * |want| (NaN matches NaN, infinities match when equal). Returns 1
 * when it matches; otherwise 0 and, when detail is not NULL, a few lines naming the first
 * difference in kind or the worst element (index, values, error, how many are off). */
int golden_compare(const fsdp_tensor_t *got, const golden_rec_t *want, double rtol, double atol,
                   char *detail, size_t len);

/* golden_compare() reported as one TAP test named `what`, with the detail as a diagnostic on
 * failure (a NULL got or want fails, naming which). Returns 1 when it passed. */
static inline int golden_check(const char *what, const fsdp_tensor_t *got, const golden_rec_t *want,
                               double rtol, double atol) {
    char detail[1024];
    int pass;
    if (!want) {
        snprintf(detail, sizeof detail, "golden record missing");
        pass = 0;
    } else if (!got) {
        snprintf(detail, sizeof detail, "no tensor to compare with %s", want->name);
        pass = 0;
    } else {
        pass = golden_compare(got, want, rtol, atol, detail, sizeof detail);
    }
    tap_ok(pass, "%s", what);
    if (!pass) tap_diag("%s", detail);
    return pass;
}

#endif /* FSDP_TEST_GOLDEN_H */
