/* SPDX-License-Identifier: MIT */
/*
 * fuzz.h: the fuzz targets of libfsdp's parsers (docs/fuzzing.md) and what they share.
 *
 * Each target is a function fuzz_NAME_one(data, size) that feeds one input to a parser and checks
 * what the library promises about any input: no crash, no out-of-bounds access, no leak (ASan,
 * UBSan and LSan in the sanitizer builds), a refusal is a known status with a message, and what
 * is accepted is consistent. It aborts (fuzz_die) on a broken promise, and returns 1 when the
 * input was accepted, 0 when it was refused. Each is built two ways:
 *   - with libFuzzer (configure --enable-fuzzing, FUZZ_LIBFUZZER defined): fuzz/fuzz_NAME, whose
 *     LLVMFuzzerTestOneInput calls the function (make fuzz);
 *   - in every build, linked into tests/t_fuzz_corpus.tap (fuzz/replay.c), which replays the
 *     committed corpus fuzz/corpus/NAME/ through it (make check).
 */
#ifndef FSDP_FUZZ_H
#define FSDP_FUZZ_H

#include <stddef.h>
#include <stdint.h>

#include <fsdp.h>

int fuzz_safetensors_one(const uint8_t *data, size_t size);
int fuzz_data_one(const uint8_t *data, size_t size);
int fuzz_store_url_one(const uint8_t *data, size_t size);
int fuzz_ckpt_one(const uint8_t *data, size_t size); /* tests/fuzz_ckpt.c */

/* Prints "fuzz: NAME: message" to stderr and aborts, so that libFuzzer saves the input. */
void fuzz_die(const char *fmt, ...) FSDP_PRINTF(1, 2) __attribute__((noreturn));

/* A refusal must say why: rc is FSDP_OK, or one of the statuses a parser gives for bad input
 * (FSDP_EINVAL, FSDP_ENOTSUP, FSDP_ENOMEM, FSDP_EBACKEND), and then msg is a non-empty string. */
void fuzz_check_status(int rc, const char *msg, const char *what);

/* A context that logs nothing, made once for the process. */
fsdp_ctx_t *fuzz_ctx(void);

/* The path of `name` in a private scratch directory under $TMPDIR, made at the first call and
 * removed with its files at exit. */
const char *fuzz_path(const char *name);

/* Writes the n bytes at p to path (replacing it); aborts on failure. */
void fuzz_write_file(const char *path, const void *p, size_t n);

#endif
