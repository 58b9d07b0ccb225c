/* SPDX-License-Identifier: MIT */
/*
 * t_data.c: datasets and the batch loader (include/fsdp/data.h).
 *
 * Token files are written into a temporary directory with tokens tok(k) = 7919 k + 17 (mod 2^16),
 * which is one-to-one for k < 2^16: the first input token of a batch tells which position of the
 * stream the batch came from. Hostile files check that every header error is refused with a
 * message naming the file and the field.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fsdp.h>

#include "tap.h"

#ifndef DATA_DIR
#define DATA_DIR "data"
#endif

/* A context with logging off: the calls whose messages are checked leave them on it. */
static fsdp_ctx_t *quiet;

static char tmpdir[256];
static char paths[32][320];
static int npaths;

static uint16_t tok(uint64_t k) {
    return (uint16_t)(k * 7919u + 17u);
}

/* A new file name in the temporary directory, removed at the end. */
static const char *tmp_path(const char *name) {
    char *p = paths[npaths++];
    snprintf(p, sizeof paths[0], "%s/%s", tmpdir, name);
    return p;
}

static void write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f || (n && fwrite(data, 1, n, f) != n) || fclose(f) != 0)
        tap_bail("cannot write %s: %s", path, strerror(errno));
}

static void put32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

/*
 * Writes an llm.c token file with the given header fields and `ntok` tokens tok(0..ntok), cut to
 * `cut` bytes when cut is not SIZE_MAX.
 */
static const char *write_tokens(const char *name, int32_t magic, int32_t version, int32_t count,
                                size_t ntok, size_t cut) {
    size_t n = FSDP_DATA_HEADER_BYTES + 2 * ntok;
    unsigned char *buf = calloc(1, n);
    if (!buf) tap_bail("out of memory");
    put32(buf, (uint32_t)magic);
    put32(buf + 4, (uint32_t)version);
    put32(buf + 8, (uint32_t)count);
    for (size_t k = 0; k < ntok; k++) {
        buf[FSDP_DATA_HEADER_BYTES + 2 * k] = (unsigned char)(tok(k) & 0xff);
        buf[FSDP_DATA_HEADER_BYTES + 2 * k + 1] = (unsigned char)(tok(k) >> 8);
    }
    const char *path = tmp_path(name);
    write_bytes(path, buf, cut < n ? cut : n);
    free(buf);
    return path;
}

/* Opening must fail with `rc`, and the message must contain the path and every needle. */
static void check_refused(const char *what, const char *path, fsdp_data_format_t fmt, int rc,
                          const char *needle1, const char *needle2) {
    fsdp_dataset_t *ds = (fsdp_dataset_t *)1;
    int got = fsdp_dataset_open(quiet, path, fmt, &ds);
    const char *msg = fsdp_ctx_last_error(quiet);
    int ok = got == rc && ds == NULL && strstr(msg, path) && (!needle1 || strstr(msg, needle1)) &&
             (!needle2 || strstr(msg, needle2));
    tap_ok(ok, "%s is refused (%s) naming the file%s%s", what, fsdp_err_name(rc),
           needle1 ? " and " : "", needle1 ? needle1 : "");
    if (!ok) tap_diag("rc %d (%s), message: %s", got, fsdp_err_name(got), msg);
    fsdp_dataset_destroy(ds == (fsdp_dataset_t *)1 ? NULL : ds);
}

static void test_token_files(void) {
    const size_t n = 20000; /* more than one 16 KiB read chunk */
    const char *path = write_tokens("good.tok", FSDP_DATA_MAGIC, 1, (int32_t)n, n, SIZE_MAX);
    fsdp_dataset_t *ds = NULL;
    fsdp_ctx_t *fresh = NULL;
    fsdp_ctx_create(NULL, &fresh);
    tap_is_int(fsdp_dataset_open(fresh, path, FSDP_DATA_TOKENS, &ds), 0, "open an llm.c file");
    tap_is_str(fsdp_ctx_last_error(fresh), "", "no error text on the context after success");
    fsdp_ctx_destroy(fresh);
    tap_is_uint(fsdp_dataset_num_tokens(ds), n, "token count from the header");
    tap_is_int(fsdp_dataset_format(ds), FSDP_DATA_TOKENS, "format is tokens");
    tap_is_str(fsdp_dataset_path(ds), path, "path is kept");
    uint32_t max = 0;
    for (size_t k = 0; k < n; k++)
        if (tok(k) > max) max = tok(k);
    tap_is_uint(fsdp_dataset_max_token(ds), max, "largest token");
    int64_t *all = malloc(n * sizeof *all);
    tap_is_int(fsdp_dataset_read(NULL, ds, 0, n, all), 0, "read every token");
    size_t bad = 0;
    for (size_t k = 0; k < n; k++)
        bad += all[k] != tok(k);
    tap_is_size(bad, 0, "token values (uint16, little-endian) across read chunks");
    tap_is_int(fsdp_dataset_read(quiet, ds, n - 3, 4, all), FSDP_EINVAL,
               "read past the end refused");
    tap_has_str(fsdp_ctx_last_error(quiet), "are outside the dataset's", "the context says why");
    tap_is_int(fsdp_dataset_read(NULL, ds, n - 3, 3, all), 0, "read up to the end");
    tap_ok(all[2] == tok(n - 1), "last token");
    free(all);
    fsdp_dataset_destroy(ds);

    /* AUTO detects the magic whatever the name. */
    ds = NULL;
    tap_is_int(fsdp_dataset_open(NULL, path, FSDP_DATA_AUTO, &ds), 0, "AUTO opens it");
    tap_is_int(fsdp_dataset_format(ds), FSDP_DATA_TOKENS, "AUTO found the magic");
    fsdp_dataset_destroy(ds);
}

static void test_hostile(void) {
    const size_t n = 100;
    const char *p;
    p = write_tokens("magic.tok", 20240521, 1, (int32_t)n, n, SIZE_MAX);
    check_refused("bad magic", p, FSDP_DATA_TOKENS, FSDP_EINVAL, "header[0]", "magic");
    p = write_tokens("magic.bin", 12345, 1, (int32_t)n, n, SIZE_MAX);
    check_refused("bad magic in a .bin under AUTO", p, FSDP_DATA_AUTO, FSDP_EINVAL, "header[0]",
                  "20240520");
    p = write_tokens("version.tok", FSDP_DATA_MAGIC, 2, (int32_t)n, n, SIZE_MAX);
    check_refused("bad version", p, FSDP_DATA_TOKENS, FSDP_EINVAL, "header[1]", "version");
    p = write_tokens("count.tok", FSDP_DATA_MAGIC, 1, (int32_t)n + 1, n, SIZE_MAX);
    check_refused("count larger than the file", p, FSDP_DATA_TOKENS, FSDP_EINVAL, "header[2]",
                  "truncated");
    p = write_tokens("huge.tok", FSDP_DATA_MAGIC, 1, INT32_MAX, n, SIZE_MAX);
    check_refused("count of INT32_MAX", p, FSDP_DATA_TOKENS, FSDP_EINVAL, "header[2]", "truncated");
    p = write_tokens("short.tok", FSDP_DATA_MAGIC, 1, (int32_t)n, n,
                     FSDP_DATA_HEADER_BYTES + 2 * n - 1);
    check_refused("odd-sized truncated tokens", p, FSDP_DATA_TOKENS, FSDP_EINVAL, "header[2]",
                  "truncated");
    p = write_tokens("extra.tok", FSDP_DATA_MAGIC, 1, (int32_t)n - 5, n, SIZE_MAX);
    check_refused("count smaller than the file", p, FSDP_DATA_TOKENS, FSDP_EINVAL, "header[2]",
                  "too many");
    p = write_tokens("negative.tok", FSDP_DATA_MAGIC, 1, -4, n, SIZE_MAX);
    check_refused("negative count", p, FSDP_DATA_TOKENS, FSDP_EINVAL, "header[2]", "-4");
    p = write_tokens("zero.tok", FSDP_DATA_MAGIC, 1, 0, 0, SIZE_MAX);
    check_refused("zero tokens", p, FSDP_DATA_TOKENS, FSDP_EINVAL, "header[2]", "positive");
    p = write_tokens("header.tok", FSDP_DATA_MAGIC, 1, (int32_t)n, n, 100);
    check_refused("truncated header", p, FSDP_DATA_TOKENS, FSDP_EINVAL, "truncated header", "100");
    p = write_tokens("header2.tok", FSDP_DATA_MAGIC, 1, (int32_t)n, n, 6);
    check_refused("truncated header under AUTO", p, FSDP_DATA_AUTO, FSDP_EINVAL, "truncated header",
                  NULL);
    p = tmp_path("empty.tok");
    write_bytes(p, "", 0);
    check_refused("empty token file", p, FSDP_DATA_TOKENS, FSDP_EINVAL, "empty", "header");
    check_refused("empty text file", p, FSDP_DATA_TEXT, FSDP_EINVAL, "empty", NULL);
    check_refused("empty file under AUTO", p, FSDP_DATA_AUTO, FSDP_EINVAL, "empty", NULL);
    p = tmp_path("missing.tok");
    check_refused("missing file", p, FSDP_DATA_AUTO, FSDP_EBACKEND, "cannot open", NULL);
    check_refused("a directory", tmpdir, FSDP_DATA_AUTO, FSDP_EINVAL, "not a regular file", NULL);

    fsdp_dataset_t *ds = NULL;
    tap_is_int(fsdp_dataset_open(NULL, NULL, FSDP_DATA_AUTO, &ds), FSDP_EINVAL, "NULL path");
    tap_is_int(fsdp_dataset_open(NULL, p, (fsdp_data_format_t)7, &ds), FSDP_EINVAL,
               "unknown format");

    /* With a context, the message lands on it too. */
    fsdp_ctx_t *ctx = NULL;
    fsdp_ctx_create(NULL, &ctx);
    p = write_tokens("version2.tok", FSDP_DATA_MAGIC, 3, (int32_t)n, n, SIZE_MAX);
    tap_is_int(fsdp_dataset_open(ctx, p, FSDP_DATA_AUTO, &ds), FSDP_EINVAL, "bad version, ctx");
    tap_has_str(fsdp_ctx_last_error(ctx), "header[1] (version) is 3", "context has the message");
    fsdp_ctx_destroy(ctx);
}

static void test_text(void) {
    const unsigned char text[] = "Hello, world.\n\xc3\xa9\xff";
    size_t n = sizeof text - 1;
    const char *p = tmp_path("hello.txt");
    write_bytes(p, text, n);
    fsdp_dataset_t *ds = NULL;
    tap_is_int(fsdp_dataset_open(NULL, p, FSDP_DATA_AUTO, &ds), 0, "open a text file");
    tap_is_int(fsdp_dataset_format(ds), FSDP_DATA_TEXT, "AUTO: text");
    tap_is_uint(fsdp_dataset_num_tokens(ds), n, "one token per byte");
    tap_is_uint(fsdp_dataset_max_token(ds), 255, "largest byte");
    int64_t got[32];
    fsdp_dataset_read(NULL, ds, 0, n, got);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += got[i] != text[i];
    tap_is_size(bad, 0, "tokens are the bytes (unsigned)");
    fsdp_dataset_destroy(ds);

    /* A token file forced to text is just bytes. */
    p = write_tokens("astext.tok", FSDP_DATA_MAGIC, 1, 4, 4, SIZE_MAX);
    tap_is_int(fsdp_dataset_open(NULL, p, FSDP_DATA_TEXT, &ds), 0, "TEXT forces bytes");
    tap_is_uint(fsdp_dataset_num_tokens(ds), FSDP_DATA_HEADER_BYTES + 8, "every byte counted");
    fsdp_dataset_destroy(ds);
}

static void test_views(void) {
    const size_t n = 1000;
    const char *p = write_tokens("views.tok", FSDP_DATA_MAGIC, 1, (int32_t)n, n, SIZE_MAX);
    fsdp_dataset_t *ds = NULL, *train = NULL, *val = NULL, *v = NULL;
    fsdp_dataset_open(NULL, p, FSDP_DATA_TOKENS, &ds);
    tap_is_int(fsdp_dataset_split(NULL, ds, FSDP_DATA_DEFAULT_VAL_FRACTION, &train, &val), 0,
               "split");
    tap_is_uint(fsdp_dataset_num_tokens(train), 900, "train: first 90%%");
    tap_is_uint(fsdp_dataset_num_tokens(val), 100, "val: last 10%%");
    tap_is_int(fsdp_dataset_view(NULL, val, 10, 20, &v), 0, "view of a view");
    fsdp_dataset_destroy(ds); /* views keep the file */
    int64_t t[2];
    fsdp_dataset_read(NULL, val, 0, 1, t);
    fsdp_dataset_read(NULL, v, 0, 1, t + 1);
    tap_ok(t[0] == tok(900) && t[1] == tok(910), "views start where they should, parent gone");
    tap_is_int(fsdp_dataset_view(quiet, val, 90, 11, &ds), FSDP_EINVAL,
               "view past the end refused");
    tap_ok(ds == NULL, "no view on failure");
    tap_has_str(fsdp_ctx_last_error(quiet), p, "view error names the file");
    tap_is_int(fsdp_dataset_view(quiet, val, 0, 0, &ds), FSDP_EINVAL, "empty view refused");
    tap_is_int(fsdp_dataset_split(quiet, train, 1.0, &ds, &ds), FSDP_EINVAL, "fraction 1 refused");
    tap_has_str(fsdp_ctx_last_error(quiet), "val_fraction 1 is not in (0, 1)",
                "the context says why");
    tap_is_int(fsdp_dataset_split(quiet, train, 0.0001, &ds, &ds), FSDP_EINVAL,
               "empty part refused");
    fsdp_dataset_destroy(train);
    fsdp_dataset_destroy(val);
    fsdp_dataset_destroy(v);
}

static fsdp_loader_t *make_loader(const fsdp_dataset_t *ds, int64_t b, int64_t t, int rank,
                                  int world, bool shuffle, uint64_t seed) {
    fsdp_loader_options_t o;
    fsdp_loader_options_init(&o);
    o.batch_size = b;
    o.seq_len = t;
    o.rank = rank;
    o.world_size = world;
    o.shuffle = shuffle;
    o.seed = seed;
    fsdp_loader_t *l = NULL;
    int rc = fsdp_loader_create(quiet, ds, &o, &l);
    if (rc < 0) tap_bail("fsdp_loader_create: %s", fsdp_ctx_last_error(quiet));
    return l;
}

static void test_sequential(const fsdp_dataset_t *ds) {
    const int64_t b = 4, t = 16;
    const uint64_t n = fsdp_dataset_num_tokens(ds), bt = (uint64_t)(b * t);
    fsdp_loader_t *l = make_loader(ds, b, t, 0, 1, false, 0);
    const uint64_t nb = fsdp_loader_num_batches(l);
    tap_is_uint(nb, (n - 1) / bt, "batches per epoch = floor((N - 1) / (B*T))");
    tap_is_int(fsdp_loader_rows(l), b, "one rank reads every row");
    int64_t in[64], tg[64];
    size_t bad = 0;
    for (uint64_t i = 0; i < nb; i++) {
        if (fsdp_loader_next(l, in, tg) < 0) bad++;
        for (int64_t j = 0; j < b; j++)
            for (int64_t c = 0; c < t; c++) {
                uint64_t k = i * bt + (uint64_t)(j * t + c);
                bad += in[j * t + c] != tok(k) || tg[j * t + c] != tok(k + 1);
            }
    }
    tap_is_size(bad, 0, "batch i = tokens [i*B*T, i*B*T + B*T + 1), targets shifted by one");
    tap_is_uint(fsdp_loader_get_position(l), nb, "position counts batches");
    /* The last batch of the epoch ends at or before the last token. */
    tap_ok(nb * bt + 1 <= n && (nb + 1) * bt + 1 > n, "the epoch uses every whole batch");
    fsdp_loader_next(l, in, tg);
    tap_ok(in[0] == tok(0) && tg[0] == tok(1), "wrap-around: batch E starts again at token 0");
    int64_t a[64], a2[64];
    fsdp_loader_batch(l, 3, a, NULL);
    fsdp_loader_batch(l, 3 + 5 * nb, a2, NULL);
    tap_is_mem(a, a2, sizeof a, "batch i + k*E == batch i");
    tap_is_uint(fsdp_loader_get_position(l), nb + 1, "fsdp_loader_batch leaves the position");
    fsdp_loader_destroy(l);
}

/* Global batch `index` assembled from every rank of a world of size w. */
static void global_batch(const fsdp_dataset_t *ds, int64_t b, int64_t t, int w, bool shuffle,
                         uint64_t seed, uint64_t index, int64_t *in, int64_t *tg) {
    for (int r = 0; r < w; r++) {
        fsdp_loader_t *l = make_loader(ds, b, t, r, w, shuffle, seed);
        int64_t off = r * (b / w) * t;
        fsdp_loader_set_position(l, index);
        fsdp_loader_next(l, in + off, tg + off);
        fsdp_loader_destroy(l);
    }
}

static void test_ranks(const fsdp_dataset_t *ds) {
    const int64_t b = 8, t = 12;
    int64_t in1[96], tg1[96], in[96], tg[96];
    for (int shuffle = 0; shuffle < 2; shuffle++) {
        size_t bad = 0;
        for (uint64_t i = 0; i < 40; i += 3) {
            global_batch(ds, b, t, 1, shuffle, 7, i, in1, tg1);
            for (int w = 2; w <= 4; w *= 2) {
                global_batch(ds, b, t, w, shuffle, 7, i, in, tg);
                bad += memcmp(in, in1, sizeof in) != 0 || memcmp(tg, tg1, sizeof tg) != 0;
            }
        }
        tap_is_size(bad, 0, "%s: rank slices of W = 2 and 4 concatenate to the W = 1 batch",
                    shuffle ? "shuffled" : "sequential");
    }
    fsdp_loader_t *l = make_loader(ds, b, t, 2, 4, false, 0);
    tap_is_int(fsdp_loader_rows(l), 2, "rank reads B/W rows");
    fsdp_loader_next(l, in, tg);
    tap_ok(in[0] == tok(2 * 2 * 12), "rank 2 of 4 starts at row 4");
    fsdp_loader_destroy(l);
}

/* The stream position each batch of the next `count` batches starts at (from its first token). */
static int positions(fsdp_loader_t *l, uint64_t count, uint64_t *out) {
    const fsdp_loader_options_t *o = fsdp_loader_options(l);
    int64_t in[256];
    if (fsdp_loader_rows(l) * o->seq_len > 256) return -1;
    for (uint64_t i = 0; i < count; i++) {
        if (fsdp_loader_next(l, in, NULL) < 0) return -1;
        /* tok is one-to-one below 2^16: invert by search over the stream. */
        out[i] = UINT64_MAX;
        for (uint64_t k = 0; k < 65536; k++)
            if (tok(k) == in[0]) {
                out[i] = k;
                break;
            }
    }
    return 0;
}

static void test_shuffle(const fsdp_dataset_t *ds) {
    const int64_t b = 2, t = 50;
    fsdp_loader_t *l1 = make_loader(ds, b, t, 0, 1, true, 42);
    fsdp_loader_t *l2 = make_loader(ds, b, t, 0, 1, true, 42);
    fsdp_loader_t *l3 = make_loader(ds, b, t, 0, 1, true, 43);
    const uint64_t nb = fsdp_loader_num_batches(l1), bt = (uint64_t)(b * t);
    uint64_t *p1 = calloc(3 * nb, sizeof *p1), *p2 = calloc(3 * nb, sizeof *p2),
             *p3 = calloc(3 * nb, sizeof *p3);
    positions(l1, 3 * nb, p1);
    positions(l2, 3 * nb, p2);
    positions(l3, 3 * nb, p3);
    tap_is_mem(p1, p2, 3 * nb * sizeof *p1, "same seed, same order (%llu batches an epoch)",
               (unsigned long long)nb);
    tap_ok(memcmp(p1, p3, nb * sizeof *p1) != 0, "another seed, another order");
    tap_ok(memcmp(p1, p1 + nb, nb * sizeof *p1) != 0, "another epoch, another order");
    int perm = 1, identity = 1;
    for (int e = 0; e < 3; e++) {
        char *seen = calloc(nb, 1);
        for (uint64_t i = 0; i < nb; i++) {
            uint64_t pos = p1[e * nb + i];
            if (pos % bt != 0 || pos / bt >= nb || seen[pos / bt])
                perm = 0;
            else
                seen[pos / bt] = 1;
            if (pos != i * bt) identity = 0;
        }
        free(seen);
    }
    tap_ok(perm, "every epoch visits each batch position once");
    tap_ok(!identity, "the order is not the sequential one");
    free(p1);
    free(p2);
    free(p3);
    fsdp_loader_destroy(l1);
    fsdp_loader_destroy(l2);
    fsdp_loader_destroy(l3);
}

static void test_position(const fsdp_dataset_t *ds) {
    for (int shuffle = 0; shuffle < 2; shuffle++) {
        fsdp_loader_t *a = make_loader(ds, 4, 16, 1, 2, shuffle, 99);
        const uint64_t nb = fsdp_loader_num_batches(a);
        int64_t in[32], tg[32], in2[32], tg2[32];
        for (uint64_t i = 0; i < nb - 2; i++)
            fsdp_loader_next(a, in, tg);
        uint64_t saved = fsdp_loader_get_position(a);
        fsdp_loader_t *b = make_loader(ds, 4, 16, 1, 2, shuffle, 99);
        tap_is_int(fsdp_loader_set_position(b, saved), 0, "set_position");
        size_t bad = 0;
        for (int i = 0; i < 6; i++) { /* across the epoch boundary */
            fsdp_loader_next(a, in, tg);
            fsdp_loader_next(b, in2, tg2);
            bad += memcmp(in, in2, sizeof in) != 0 || memcmp(tg, tg2, sizeof tg) != 0;
        }
        tap_is_size(bad, 0, "%s: a resumed loader returns the same next batches",
                    shuffle ? "shuffled" : "sequential");
        tap_is_uint(fsdp_loader_get_position(b), saved + 6, "positions agree");
        fsdp_loader_destroy(a);
        fsdp_loader_destroy(b);
    }
}

static void test_loader_errors(const fsdp_dataset_t *ds) {
    fsdp_loader_options_t o;
    fsdp_loader_options_init(&o);
    fsdp_loader_t *l = (fsdp_loader_t *)1;
    o.batch_size = 6;
    o.world_size = 4;
    o.rank = 1;
    tap_is_int(fsdp_loader_create(NULL, ds, &o, &l), FSDP_EINVAL,
               "B = 6 on W = 4 refused (no context: logged)");
    tap_ok(l == NULL, "no loader on failure");
    fsdp_ctx_t *ctx = NULL;
    fsdp_ctx_create(NULL, &ctx);
    tap_is_int(fsdp_loader_create(ctx, ds, &o, &l), FSDP_EINVAL, "same with a context");
    tap_has_str(fsdp_ctx_last_error(ctx), "batch_size 6 is not divisible by world_size 4",
                "the context has the message");
    o.batch_size = 8;
    o.rank = 4;
    tap_is_int(fsdp_loader_create(NULL, ds, &o, &l), FSDP_EINVAL, "rank 4 of 4 refused");
    o.rank = 0;
    o.seq_len = 0;
    tap_is_int(fsdp_loader_create(NULL, ds, &o, &l), FSDP_EINVAL, "seq_len 0 refused");
    o.seq_len = (int64_t)fsdp_dataset_num_tokens(ds);
    tap_is_int(fsdp_loader_create(ctx, ds, &o, &l), FSDP_EINVAL, "a dataset shorter than a batch");
    tap_has_str(fsdp_ctx_last_error(ctx), "fewer than one batch", "the message says why");
    o.batch_size = 1;
    o.world_size = 1;
    o.seq_len = (int64_t)fsdp_dataset_num_tokens(ds) - 1;
    tap_is_int(fsdp_loader_create(NULL, ds, &o, &l), 0, "exactly one batch fits");
    tap_is_uint(fsdp_loader_num_batches(l), 1, "one batch an epoch");
    fsdp_loader_destroy(l);
    fsdp_ctx_destroy(ctx);
}

static void test_tensors(const fsdp_dataset_t *ds) {
    fsdp_ctx_t *ctx = NULL;
    fsdp_ctx_create(NULL, &ctx);
    fsdp_loader_options_t o;
    fsdp_loader_options_init(&o);
    o.batch_size = 4;
    o.seq_len = 8;
    o.world_size = 2;
    o.rank = 1;
    fsdp_loader_t *l = NULL;
    fsdp_loader_create(ctx, ds, &o, &l);
    int64_t shape[2] = {2, 8}, bad_shape[2] = {4, 8};
    fsdp_tensor_t *in = NULL, *tg = NULL, *in32 = NULL, *wrong = NULL;
    fsdp_tensor_empty(ctx, FSDP_DTYPE_I64, 2, shape, FSDP_MEM_OTHER, &in);
    fsdp_tensor_empty(ctx, FSDP_DTYPE_I64, 2, shape, FSDP_MEM_OTHER, &tg);
    fsdp_tensor_empty(ctx, FSDP_DTYPE_I32, 2, shape, FSDP_MEM_OTHER, &in32);
    fsdp_tensor_empty(ctx, FSDP_DTYPE_I64, 2, bad_shape, FSDP_MEM_OTHER, &wrong);
    int64_t want_in[16], want_tg[16], got[16];
    fsdp_loader_batch(l, 0, want_in, want_tg);
    tap_is_int(fsdp_loader_next_tensors(l, in, tg), 0, "next into i64 tensors (rows, T)");
    fsdp_tensor_to_host(in, got, sizeof got);
    tap_is_mem(got, want_in, sizeof got, "inputs tensor");
    fsdp_tensor_to_host(tg, got, sizeof got);
    tap_is_mem(got, want_tg, sizeof got, "targets tensor");
    fsdp_loader_batch(l, 1, want_in, NULL);
    tap_is_int(fsdp_loader_next_tensors(l, in32, NULL), 0, "next into an i32 tensor");
    int32_t got32[16];
    fsdp_tensor_to_host(in32, got32, sizeof got32);
    size_t bad = 0;
    for (int i = 0; i < 16; i++)
        bad += got32[i] != want_in[i];
    tap_is_size(bad, 0, "i32 inputs");
    tap_is_int(fsdp_loader_next_tensors(l, wrong, NULL), FSDP_EINVAL, "wrong shape refused");
    tap_has_str(fsdp_loader_last_error(l), "expected (2, 8)", "the message gives the shape");
    tap_is_uint(fsdp_loader_get_position(l), 2, "a refused call keeps the position");
    fsdp_tensor_release(in);
    fsdp_tensor_release(tg);
    fsdp_tensor_release(in32);
    fsdp_tensor_release(wrong);
    fsdp_loader_destroy(l);
    fsdp_ctx_destroy(ctx);
}

static void test_shrunk_file(void) {
    const size_t n = 4000;
    const char *p = write_tokens("shrink.tok", FSDP_DATA_MAGIC, 1, (int32_t)n, n, SIZE_MAX);
    fsdp_dataset_t *ds = NULL;
    fsdp_dataset_open(NULL, p, FSDP_DATA_TOKENS, &ds);
    fsdp_loader_t *l = make_loader(ds, 2, 100, 0, 1, false, 0);
    fsdp_dataset_destroy(ds);
    if (truncate(p, FSDP_DATA_HEADER_BYTES + 1000) != 0) tap_bail("truncate: %s", strerror(errno));
    int64_t in[200];
    tap_is_int(fsdp_loader_batch(l, 10, in, NULL), FSDP_EBACKEND, "a file cut after opening");
    tap_has_str(fsdp_loader_last_error(l), "ended early", "is an error, not a signal");
    tap_is_int(fsdp_loader_batch(l, 0, in, NULL), 0, "what is left still reads");
    fsdp_loader_destroy(l);
}

static void test_corpus(void) {
    const char *path = DATA_DIR "/corpus.txt";
    FILE *f = fopen(path, "rb");
    tap_ok(f != NULL, "the corpus %s exists", path);
    if (!f) {
        tap_skip(6, "no corpus");
        return;
    }
    size_t n = 0, bad = 0, lines = 0;
    int c;
    while ((c = fgetc(f)) != EOF) {
        n++;
        if (c == '\n')
            lines++;
        else if (c < 0x20 || c > 0x7e)
            bad++;
    }
    fclose(f);
    tap_ok(n >= 100 * 1024 && n <= 400 * 1024, "corpus size %zu bytes is within 100-400 KiB", n);
    tap_is_size(bad, 0, "plain printable ASCII (so UTF-8) with newlines");
    tap_ok(lines > 100, "%zu lines", lines);
    const char *def = fsdp_data_default_corpus();
    tap_ok(def && access(def, R_OK) == 0, "fsdp_data_default_corpus() finds it: %s",
           def ? def : "(null)");
    /* Uninstalled, that is the build tree's copy (found from this program's location; a tree
     * built outside the sources has its own), with the source's bytes. */
    char *a = NULL, *b = NULL;
    size_t na = 0, nb = 0;
    FILE *fa = fopen(path, "rb"), *fb = def ? fopen(def, "rb") : NULL;
    if (fa && fb) {
        a = malloc(n + 1);
        b = malloc(n + 1);
        if (a && b) {
            na = fread(a, 1, n + 1, fa);
            nb = fread(b, 1, n + 1, fb);
        }
    }
    tap_ok(a && b && na == n && nb == n && memcmp(a, b, n) == 0,
           "the default corpus has the source's %zu bytes", n);
    free(a);
    free(b);
    if (fa) fclose(fa);
    if (fb) fclose(fb);
    fsdp_dataset_t *ds = NULL;
    fsdp_dataset_open(NULL, path, FSDP_DATA_AUTO, &ds);
    tap_ok(ds && fsdp_dataset_format(ds) == FSDP_DATA_TEXT && fsdp_dataset_max_token(ds) < 128,
           "it opens as text with tokens < 128");
    fsdp_dataset_destroy(ds);
}

int main(void) {
    tap_plan_lazy();
    snprintf(tmpdir, sizeof tmpdir, "%s/t_data.XXXXXX",
             getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(tmpdir)) tap_bail("mkdtemp: %s", strerror(errno));
    fsdp_ctx_options_t co;
    fsdp_ctx_options_init(&co);
    co.log_level = FSDP_LOG_OFF;
    if (fsdp_ctx_create(&co, &quiet) < 0) tap_bail("fsdp_ctx_create");

    test_token_files();
    test_hostile();
    test_text();
    test_views();

    /* The loader tests share one stream of 3001 tokens (not a multiple of any B*T + 1). */
    const char *p = write_tokens("stream.tok", FSDP_DATA_MAGIC, 1, 3001, 3001, SIZE_MAX);
    fsdp_dataset_t *ds = NULL;
    if (fsdp_dataset_open(quiet, p, FSDP_DATA_AUTO, &ds) < 0)
        tap_bail("%s", fsdp_ctx_last_error(quiet));
    test_sequential(ds);
    test_ranks(ds);
    test_shuffle(ds);
    test_position(ds);
    test_loader_errors(ds);
    test_tensors(ds);
    fsdp_dataset_destroy(ds);
    test_shrunk_file();
    test_corpus();

    for (int i = 0; i < npaths; i++)
        unlink(paths[i]);
    rmdir(tmpdir);
    fsdp_ctx_destroy(quiet);
    return tap_done();
}
