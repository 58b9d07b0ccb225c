/* SPDX-License-Identifier: MIT */
/*
 * fuzz_data.c: a fuzz target for the token and text datasets and the batch loader
 * (src/io/data.c).
 *
 * Input: [mode] [B] [T] [flags] [file bytes...]. mode % 4 picks how the file is opened: 0 as
 * text; 1 as an llm.c token file, bytes as they are; 2 as a token file whose header is the first
 * 12 bytes (magic, version, count) padded to the header's 1024 with zeros, so that mutations
 * reach the tokens; 3 with the format detected (FSDP_DATA_AUTO), the name ending in ".bin" when
 * flags bit 7 is set. A dataset that opens must read back its tokens (each at most its maximum),
 * and split; a loader over it (world size 1 + flags % 4, rank (flags >> 2) % W, B rounded to a
 * multiple of W, T = 1 + T % 32, shuffled when flags bit 6 is set) either refuses the sizes with
 * a message or gives batches whose targets are the inputs shifted by one and, unshuffled, are the
 * dataset's tokens at the batch's place.
 */
#include <stdlib.h>
#include <string.h>

#include "fuzz/fuzz.h"

#define HEADER_BYTES (FSDP_DATA_HEADER_INTS * 4)

/* The batch at `index` of loader l (rows x T tokens of the rank), checked. */
static void check_batch(fsdp_loader_t *l, const fsdp_dataset_t *ds, uint64_t index, int64_t *in,
                        int64_t *tg, int64_t *want) {
    fsdp_ctx_t *ctx = fuzz_ctx();
    const fsdp_loader_options_t *o = fsdp_loader_options(l);
    const size_t n = (size_t)(fsdp_loader_rows(l) * o->seq_len);
    int rc = fsdp_loader_batch(l, index, in, tg);
    if (rc != FSDP_OK)
        fuzz_die("data: batch %llu: %s", (unsigned long long)index, fsdp_loader_last_error(l));
    const int64_t max = fsdp_dataset_max_token(ds);
    for (size_t i = 0; i < n; i++) {
        if (in[i] < 0 || in[i] > max || tg[i] < 0 || tg[i] > max)
            fuzz_die("data: batch %llu: a token outside [0, %lld]", (unsigned long long)index,
                     (long long)max);
        if (i + 1 < n && tg[i] != in[i + 1])
            fuzz_die("data: batch %llu: the targets are not the inputs shifted by one",
                     (unsigned long long)index);
    }
    if (o->shuffle) return;
    const uint64_t bt = (uint64_t)o->batch_size * (uint64_t)o->seq_len;
    const uint64_t start = (index % fsdp_loader_num_batches(l)) * bt +
                           (uint64_t)o->rank * (uint64_t)fsdp_loader_rows(l) * (uint64_t)o->seq_len;
    rc = fsdp_dataset_read(ctx, ds, start, n + 1, want);
    if (rc != FSDP_OK)
        fuzz_die("data: reading [%llu, +%zu): %s", (unsigned long long)start, n + 1,
                 fsdp_ctx_last_error(ctx));
    if (memcmp(in, want, n * sizeof *in) != 0 || memcmp(tg, want + 1, n * sizeof *tg) != 0)
        fuzz_die("data: batch %llu is not the tokens at %llu", (unsigned long long)index,
                 (unsigned long long)start);
}

int fuzz_data_one(const uint8_t *data, size_t size) {
    if (size < 4) return 0;
    fsdp_ctx_t *ctx = fuzz_ctx();
    const unsigned mode = data[0] % 4, flags = data[3];
    const uint8_t *body = data + 4;
    size_t n = size - 4;
    const char *path = fuzz_path(mode == 3 && (flags & 0x80) ? "in.bin" : "in.data");
    fsdp_data_format_t fmt = mode == 0   ? FSDP_DATA_TEXT
                             : mode == 3 ? FSDP_DATA_AUTO
                                         : FSDP_DATA_TOKENS;
    if (mode == 2) {
        size_t h = n < 12 ? n : 12;
        uint8_t *file = calloc(1, HEADER_BYTES + n - h);
        if (!file) fuzz_die("data: out of memory");
        memcpy(file, body, h);
        memcpy(file + HEADER_BYTES, body + h, n - h);
        fuzz_write_file(path, file, HEADER_BYTES + n - h);
        free(file);
    } else {
        fuzz_write_file(path, body, n);
    }
    fsdp_dataset_t *ds = NULL;
    int rc = fsdp_dataset_open(ctx, path, fmt, &ds);
    fuzz_check_status(rc, fsdp_ctx_last_error(ctx), "fsdp_dataset_open");
    if (rc != FSDP_OK) {
        if (ds) fuzz_die("data: the open failed but returned a dataset");
        return 0;
    }
    const uint64_t ntok = fsdp_dataset_num_tokens(ds);
    if (ntok == 0 || ntok > n)
        fuzz_die("data: %llu tokens in %zu bytes", (unsigned long long)ntok, n);
    /* the first and last tokens, and a read past the end, which must be refused */
    int64_t tok[2];
    if (fsdp_dataset_read(ctx, ds, 0, 1, tok) != FSDP_OK ||
        fsdp_dataset_read(ctx, ds, ntok - 1, 1, tok + 1) != FSDP_OK)
        fuzz_die("data: the dataset's tokens do not read: %s", fsdp_ctx_last_error(ctx));
    if (tok[0] > fsdp_dataset_max_token(ds) || tok[1] > fsdp_dataset_max_token(ds))
        fuzz_die("data: a token above the dataset's maximum");
    rc = fsdp_dataset_read(ctx, ds, ntok, 1, tok);
    if (rc == FSDP_OK) fuzz_die("data: a read past the end succeeded");
    fuzz_check_status(rc, fsdp_ctx_last_error(ctx), "fsdp_dataset_read past the end");

    fsdp_dataset_t *train = NULL, *val = NULL;
    rc = fsdp_dataset_split(ctx, ds, (double)(1 + flags % 9) / 10.0, &train, &val);
    fuzz_check_status(rc, fsdp_ctx_last_error(ctx), "fsdp_dataset_split");
    if (rc == FSDP_OK && fsdp_dataset_num_tokens(train) + fsdp_dataset_num_tokens(val) != ntok)
        fuzz_die("data: the split parts do not add up");
    fsdp_dataset_destroy(train);
    fsdp_dataset_destroy(val);

    fsdp_loader_options_t o;
    fsdp_loader_options_init(&o);
    o.world_size = 1 + (int)(flags % 4);
    o.rank = (int)((flags >> 2) % (unsigned)o.world_size);
    o.batch_size = (int64_t)o.world_size * (1 + data[1] % 8);
    o.seq_len = 1 + data[2] % 32;
    o.shuffle = flags & 0x40;
    o.seed = data[1] * 131u + data[2];
    fsdp_loader_t *l = NULL;
    rc = fsdp_loader_create(ctx, ds, &o, &l);
    fuzz_check_status(rc, fsdp_ctx_last_error(ctx), "fsdp_loader_create");
    if (rc == FSDP_OK) {
        const size_t bn = (size_t)(fsdp_loader_rows(l) * o.seq_len);
        int64_t *in = malloc(bn * sizeof *in), *tg = malloc(bn * sizeof *tg);
        int64_t *want = malloc((bn + 1) * sizeof *want);
        if (!in || !tg || !want) fuzz_die("data: out of memory");
        const uint64_t nb = fsdp_loader_num_batches(l);
        if (nb == 0) fuzz_die("data: a loader with no batch");
        check_batch(l, ds, 0, in, tg, want);
        check_batch(l, ds, nb - 1, in, tg, want);
        check_batch(l, ds, nb + 1, in, tg, want); /* the second epoch */
        free(in);
        free(tg);
        free(want);
        fsdp_loader_destroy(l);
    }
    fsdp_dataset_destroy(ds);
    return 1;
}

#ifdef FUZZ_LIBFUZZER
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_data_one(data, size);
    return 0;
}
#endif
