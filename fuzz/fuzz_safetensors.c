/* SPDX-License-Identifier: MIT */
/*
 * fuzz_safetensors.c: a fuzz target for the safetensors reader (src/io/safetensors_*.c).
 *
 * The input is a whole file. fsdp_safetensors_open either refuses it (a known status and a
 * message) or accepts it, and then everything it describes must hold: each tensor's bytes lie
 * inside the file and have numel x element size bytes, a lookup by name finds the same entry,
 * the metadata reads back, and every tensor reads whole, raw (equal to the file's bytes at its
 * offset) and converted to f64 (or FSDP_ENOTSUP for a dtype libfsdp lacks).
 */
#include <stdlib.h>
#include <string.h>

#include "fuzz/fuzz.h"

int fuzz_safetensors_one(const uint8_t *data, size_t size) {
    fsdp_ctx_t *ctx = fuzz_ctx();
    const char *path = fuzz_path("in.safetensors");
    fuzz_write_file(path, data, size);
    fsdp_safetensors_t *st = NULL;
    int rc = fsdp_safetensors_open(ctx, path, &st);
    fuzz_check_status(rc, fsdp_ctx_last_error(ctx), "fsdp_safetensors_open");
    if (rc != FSDP_OK) {
        if (st) fuzz_die("safetensors: the open failed but returned a handle");
        return 0;
    }
    for (size_t i = 0; i < fsdp_safetensors_metadata_count(st); i++) {
        fsdp_safetensors_kv_t kv;
        if (fsdp_safetensors_metadata_at(st, i, &kv) != FSDP_OK || !kv.key || !kv.value)
            fuzz_die("safetensors: metadata %zu does not read", i);
        if (fsdp_safetensors_metadata(st, kv.key) == NULL)
            fuzz_die("safetensors: metadata key '%s' is not found by name", kv.key);
    }
    for (size_t i = 0; i < fsdp_safetensors_count(st); i++) {
        fsdp_safetensors_info_t in, by_name;
        if (fsdp_safetensors_info(st, i, &in) != FSDP_OK) fuzz_die("safetensors: info %zu", i);
        if (fsdp_safetensors_find(st, in.name, &by_name) != FSDP_OK || by_name.index != i)
            fuzz_die("safetensors: tensor %zu is not found by its name", i);
        if (in.ndim < 0 || in.ndim > FSDP_MAX_DIMS || in.numel < 0 || in.offset > size ||
            in.nbytes > size - in.offset)
            fuzz_die("safetensors: tensor %zu: ndim %d numel %lld at %llu + %llu bytes of %zu", i,
                     in.ndim, (long long)in.numel, (unsigned long long)in.offset,
                     (unsigned long long)in.nbytes, size);
        int64_t numel = 1;
        for (int d = 0; d < in.ndim; d++) {
            if (in.shape[d] < 0) fuzz_die("safetensors: tensor %zu has a negative dimension", i);
            numel = in.shape[d] ? (numel > INT64_MAX / in.shape[d] ? -1 : numel * in.shape[d]) : 0;
            if (numel < 0) fuzz_die("safetensors: tensor %zu: the shape overflows", i);
        }
        if (numel != in.numel) fuzz_die("safetensors: tensor %zu: numel is not the shape's", i);
        if (in.numel && in.nbytes % (uint64_t)in.numel != 0)
            fuzz_die("safetensors: tensor %zu: %llu bytes for %lld elements", i,
                     (unsigned long long)in.nbytes, (long long)in.numel);
        unsigned char *raw = malloc(in.nbytes ? in.nbytes : 1);
        double *f = malloc(in.numel ? (size_t)in.numel * sizeof *f : 1);
        if (!raw || !f) fuzz_die("safetensors: out of memory");
        rc = fsdp_safetensors_read_raw(st, in.name, raw, in.nbytes);
        if (rc != FSDP_OK)
            fuzz_die("safetensors: tensor '%s' was accepted but does not read: %s", in.name,
                     fsdp_safetensors_last_error(st));
        if (memcmp(raw, data + in.offset, in.nbytes) != 0)
            fuzz_die("safetensors: tensor '%s' read other bytes than the file's", in.name);
        rc = fsdp_safetensors_read(st, in.name, FSDP_DTYPE_F64, f, (size_t)in.numel * sizeof *f);
        if (rc == FSDP_ENOTSUP ? in.dtype != FSDP_DTYPE_COUNT : rc != FSDP_OK)
            fuzz_die("safetensors: tensor '%s' (%s) does not read as f64 (%d): %s", in.name,
                     in.st_dtype, rc, fsdp_safetensors_last_error(st));
        free(raw);
        free(f);
    }
    fsdp_safetensors_close(st);
    return 1;
}

#ifdef FUZZ_LIBFUZZER
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_safetensors_one(data, size);
    return 0;
}
#endif
