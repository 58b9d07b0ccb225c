/* SPDX-License-Identifier: MIT */
/*
 * fuzz_ckpt.c: a fuzz target for the checkpoint-directory reader (include/fsdp/checkpoint.h):
 * corrupted and truncated files give errors, never a crash.
 *
 * fuzz_ckpt_one(data, size) reads its input as
 *   [index.json text] [0x00 [records of 8 bytes]]
 * The text (the valid index when empty) becomes index.json of a scratch directory beside a
 * valid checkpoint (tests/ckpt_util.c); each record mutates one rank file there (op, file,
 * position, value, count: flip a bit, set, insert or delete bytes, truncate, or put a number
 * such as -1 or 2^63 in place of the digits at a position), and the mutated file's new size
 * replaces the number after "size": that follows its name in the text, so that mutations get
 * past fsdp_ckpt_open's size check (t_ckpt_corrupt tests that check). It then runs fsdp_ckpt_open,
 * fsdp_ckpt_verify and reads of every tensor (raw, as f64, and a middle range), and asserts only
 * that each call returns a known status with a message when it fails, and that a checkpoint that
 * verified reads whole. A crash, an out-of-bounds access or a leak (ASan/LSan in the sanitizer
 * build) is the failure; the function aborts on a broken assertion. It returns 1 when the
 * checkpoint opened and verified, 0 when it was refused (fuzz/fuzz.h).
 *
 * Built three ways from this file:
 *   tests/t_fuzz_ckpt.tap (make check): the deterministic driver at the bottom mutates the valid
 *     index and rank files with a seeded splitmix64 (FUZZ_CKPT_N inputs, default 20,000: about
 *     2 s, and 5 s under ASan and UBSan; FUZZ_CKPT_SEED; FUZZ_CKPT_DEBUG=1 prints each refusal
 *     at open to stderr);
 *   tests/t_fuzz_corpus.tap (make check, -DFUZZ_REPLAY): no main; fuzz/replay.c replays the
 *     corpus fuzz/corpus/ckpt/ through fuzz_ckpt_one;
 *   fuzz/fuzz_ckpt (configure --enable-fuzzing, -DFUZZ_LIBFUZZER): a libFuzzer binary whose
 *     LLVMFuzzerTestOneInput is fuzz_ckpt_one (make fuzz; docs/fuzzing.md).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <fsdp.h>

#include "ckpt_util.h"

int fuzz_ckpt_one(const uint8_t *data, size_t size);

/* Mutation records per input, and the largest read of one tensor (the index can only describe
 * bytes that are in the files, but chunks may share them). */
#define MAX_RECORDS 64
#define MAX_READ (64u << 20)

/* Numbers a record or the driver puts in place of digits. */
static const char *const specials[] = {"-1",
                                       "0",
                                       "1",
                                       "2",
                                       "3",
                                       "7",
                                       "8",
                                       "9",
                                       "255",
                                       "4294967295",
                                       "4294967296",
                                       "9223372036854775807",
                                       "9223372036854775808",
                                       "18446744073709551615",
                                       "4611686018427387904",
                                       "-9223372036854775808",
                                       "1e400",
                                       "2.5",
                                       "99999999999999999999999"};
#define NSPECIALS (sizeof specials / sizeof *specials)

static struct {
    bool ready;
    fsdp_ctx_t *ctx;
    char base[160], good[192], scratch[192];
    unsigned char *file[CKPT_UTIL_WORLD]; /* the valid rank files */
    size_t len[CKPT_UTIL_WORLD];
    char *index; /* the valid index.json */
    size_t index_len;
    bool dirty[CKPT_UTIL_WORLD]; /* the scratch copy differs from the valid file */
    /* outcomes */
    size_t runs, opened, refused_open, refused_verify, reads_ok, reads_refused;
} fz;

static void die(const char *fmt, ...) FSDP_PRINTF(1, 2);
static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("fuzz_ckpt: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}

static const char *rank_name(int r) {
    static char buf[64];
    snprintf(buf, sizeof buf, "rank-%d-of-%d.safetensors", r, CKPT_UTIL_WORLD);
    return buf;
}

static void teardown(void) {
    if (!fz.ready) return;
    ckpt_util_rm_dir(fz.scratch);
    ckpt_util_rm_dir(fz.good);
    rmdir(fz.base);
    for (int r = 0; r < CKPT_UTIL_WORLD; r++)
        free(fz.file[r]);
    free(fz.index);
    fsdp_ctx_destroy(fz.ctx);
    fz.ready = false;
}

static void setup(void) {
    if (fz.ready) return;
    const char *tmp = getenv("TMPDIR");
    int n = snprintf(fz.base, sizeof fz.base, "%s/fuzz_ckpt.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (n < 0 || (size_t)n >= sizeof fz.base) die("TMPDIR %s is too long", tmp);
    if (!mkdtemp(fz.base)) die("mkdtemp: %s", strerror(errno));
    snprintf(fz.good, sizeof fz.good, "%s/good", fz.base);
    snprintf(fz.scratch, sizeof fz.scratch, "%s/scratch", fz.base);
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    if (fsdp_ctx_create(&o, &fz.ctx) < 0) die("fsdp_ctx_create failed");
    fsdp_ctx_set_log_level(fz.ctx, FSDP_LOG_ERROR);
    if (ckpt_util_build(fz.ctx, fz.good) != 0)
        die("writing the checkpoint: %s", fsdp_ctx_last_error(fz.ctx));
    for (int r = 0; r < CKPT_UTIL_WORLD; r++)
        if (!(fz.file[r] = ckpt_util_read_file(ckpt_util_path(fz.good, rank_name(r)), &fz.len[r])))
            die("reading %s failed", rank_name(r));
    fz.index = (char *)ckpt_util_read_file(ckpt_util_path(fz.good, "index.json"), &fz.index_len);
    if (!fz.index || ckpt_util_copy_dir(fz.good, fz.scratch) != 0) die("copying the checkpoint");
    fz.ready = true;
    atexit(teardown);
}

/* Applies record rec (8 bytes) to the buffer *p of *n bytes (capacity cap). */
static void apply_record(const uint8_t *rec, unsigned char *p, size_t *n, size_t cap) {
    uint32_t pos =
        (uint32_t)rec[2] | (uint32_t)rec[3] << 8 | (uint32_t)rec[4] << 16 | (uint32_t)rec[5] << 24;
    uint8_t val = rec[6];
    size_t cnt = (size_t)rec[7] % 16 + 1, len = *n;
    switch (rec[0] % 6) {
    case 0: /* flip a bit */
        if (len) p[pos % len] ^= (unsigned char)(1u << (val & 7));
        break;
    case 1: /* set a byte */
        if (len) p[pos % len] = val;
        break;
    case 2: { /* insert cnt bytes */
        size_t at = pos % (len + 1);
        if (len + cnt > cap) break;
        memmove(p + at + cnt, p + at, len - at);
        memset(p + at, val, cnt);
        *n = len + cnt;
        break;
    }
    case 3: { /* delete up to cnt bytes */
        if (!len) break;
        size_t at = pos % len, k = cnt < len - at ? cnt : len - at;
        memmove(p + at, p + at + k, len - at - k);
        *n = len - k;
        break;
    }
    case 4: /* truncate */
        *n = pos % (len + 1);
        break;
    default: { /* the digits at or after the position become a special number */
        if (!len) break;
        size_t at = pos % len, end = at + 64 < len ? at + 64 : len;
        while (at < end && (p[at] < '0' || p[at] > '9'))
            at++;
        if (at == end) break;
        size_t k = 0;
        while (at + k < len && p[at + k] >= '0' && p[at + k] <= '9')
            k++;
        const char *s = specials[val % NSPECIALS];
        size_t sl = strlen(s);
        if (len - k + sl > cap) break;
        memmove(p + at + sl, p + at + k, len - at - k);
        memcpy(p + at, s, sl);
        *n = len - k + sl;
        break;
    }
    }
}

/* A failing call must say why: a known status and a message. */
static void check_status(int rc, const char *msg, const char *what) {
    if (rc == 0) return;
    if (rc != FSDP_EINVAL && rc != FSDP_ENOTSUP && rc != FSDP_ENOMEM)
        die("%s returned %d (%s)", what, rc, msg ? msg : "");
    if (!msg || !msg[0]) die("%s failed (%d) with no message", what, rc);
}

/* Reads [off, off + cnt) of tensor i raw and, where libfsdp has its dtype, as f64; returns
 * the number of reads that failed. */
static int read_range(fsdp_ckpt_t *ck, const fsdp_ckpt_info_t *in, int64_t off, int64_t cnt) {
    int failed = 0;
    if ((uint64_t)cnt > MAX_READ / 8) return 0;
    size_t nb = (size_t)cnt * in->esize;
    void *buf = malloc(nb ? nb : 1);
    if (!buf) die("out of memory");
    int rc = fsdp_ckpt_read_raw(ck, in->name, off, cnt, buf, nb);
    check_status(rc, fsdp_ckpt_last_error(ck), "fsdp_ckpt_read_raw");
    failed += rc != 0;
    free(buf);
    buf = malloc(cnt ? (size_t)cnt * sizeof(double) : 1);
    if (!buf) die("out of memory");
    rc = fsdp_ckpt_read(ck, in->name, off, cnt, FSDP_DTYPE_F64, buf, (size_t)cnt * sizeof(double));
    check_status(rc, fsdp_ckpt_last_error(ck), "fsdp_ckpt_read");
    if (rc == FSDP_ENOTSUP && in->dtype != FSDP_DTYPE_COUNT)
        die("fsdp_ckpt_read: ENOTSUP for a dtype libfsdp has (%s)", in->st_dtype);
    failed += rc != 0 && rc != FSDP_ENOTSUP;
    free(buf);
    return failed;
}

int fuzz_ckpt_one(const uint8_t *data, size_t size) {
    setup();
    fz.runs++;
    const uint8_t *nul = memchr(data, 0, size);
    size_t ilen = nul ? (size_t)(nul - data) : size;
    const uint8_t *rec = nul ? nul + 1 : NULL;
    size_t nrec = nul ? (size - ilen - 1) / 8 : 0;
    if (nrec > MAX_RECORDS) nrec = MAX_RECORDS;

    /* the rank files: mutated copies where a record names them, else the valid ones */
    size_t sizes[CKPT_UTIL_WORLD];
    for (int r = 0; r < CKPT_UTIL_WORLD; r++) {
        sizes[r] = fz.len[r];
        bool mine = false;
        for (size_t i = 0; i < nrec && !mine; i++)
            mine = rec[8 * i + 1] % CKPT_UTIL_WORLD == r;
        if (!mine && !fz.dirty[r]) continue;
        size_t cap = fz.len[r] + MAX_RECORDS * 32, n = fz.len[r];
        unsigned char *p = malloc(cap);
        if (!p) die("out of memory");
        memcpy(p, fz.file[r], n);
        for (size_t i = 0; mine && i < nrec; i++)
            if (rec[8 * i + 1] % CKPT_UTIL_WORLD == r) apply_record(rec + 8 * i, p, &n, cap);
        sizes[r] = n;
        if (ckpt_util_write_file(ckpt_util_path(fz.scratch, rank_name(r)), p, n) != 0)
            die("writing %s failed: %s", rank_name(r), strerror(errno));
        fz.dirty[r] = mine;
        free(p);
    }
    /* the index: the text, or the valid one when there is none; either way, a rank file mutated
     * here gets its new size in the index (the number after its name), so that mutations reach
     * past the size check of fsdp_ckpt_open to the header checks and the reads */
    const char *src = ilen ? (const char *)data : fz.index;
    size_t tlen = ilen ? ilen : fz.index_len;
    char *itext = malloc(tlen + 64 * CKPT_UTIL_WORLD + 1);
    if (!itext) die("out of memory");
    memcpy(itext, src, tlen);
    itext[tlen] = 0; /* the text holds no NUL: it ended at the first one */
    for (int r = 0; r < CKPT_UTIL_WORLD; r++) {
        char *at = fz.dirty[r] ? strstr(itext, rank_name(r)) : NULL;
        at = at ? strstr(at, "\"size\": ") : NULL;
        if (!at) continue;
        at += 8;
        size_t k = strspn(at, "0123456789");
        char num[24];
        int sl = snprintf(num, sizeof num, "%zu", sizes[r]);
        memmove(at + sl, at + k, tlen + 1 - (size_t)(at - itext) - k);
        memcpy(at, num, (size_t)sl);
        tlen = tlen - k + (size_t)sl;
    }
    if (ckpt_util_write_file(ckpt_util_path(fz.scratch, "index.json"), itext, tlen) != 0)
        die("writing index.json failed: %s", strerror(errno));
    free(itext);

    fsdp_ckpt_t *ck = NULL;
    int rc = fsdp_ckpt_open(fz.ctx, fz.scratch, &ck);
    check_status(rc, fsdp_ctx_last_error(fz.ctx), "fsdp_ckpt_open");
    if (rc < 0) {
        if (ck) die("fsdp_ckpt_open failed but returned a handle");
        if (getenv("FUZZ_CKPT_DEBUG")) fprintf(stderr, "open: %s\n", fsdp_ctx_last_error(fz.ctx));
        fz.refused_open++;
        return 0;
    }
    fz.opened++;
    int vrc = fsdp_ckpt_verify(ck);
    check_status(vrc, fsdp_ckpt_last_error(ck), "fsdp_ckpt_verify");
    fz.refused_verify += vrc != 0;
    int failed = 0;
    for (size_t i = 0; i < fsdp_ckpt_count(ck); i++) {
        fsdp_ckpt_info_t in;
        if (fsdp_ckpt_info(ck, i, &in) != 0) die("fsdp_ckpt_info(%zu) failed", i);
        int f = read_range(ck, &in, 0, in.numel);
        if (in.numel > 2) f += read_range(ck, &in, in.numel / 3, in.numel / 2);
        if (f)
            fz.reads_refused++;
        else
            fz.reads_ok++;
        failed += f;
    }
    if (vrc == 0 && failed)
        die("the checkpoint verified, but %d reads failed: %s", failed, fsdp_ckpt_last_error(ck));
    fsdp_ckpt_close(ck);
    return vrc == 0;
}

#if defined(FUZZ_LIBFUZZER)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_ckpt_one(data, size);
    return 0;
}

#elif !defined(FUZZ_REPLAY) /* the deterministic driver of make check */

#include "tap.h"

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += UINT64_C(0x9e3779b97f4a7c15));
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

/* JSON fragments the driver splices in: structure a byte flip rarely makes. */
static const char *const fragments[] = {"[[0, 0, 1, 0]]",
                                        "[[7, 0, 24, 0]]",
                                        "[[0, 0, 24, 0], [1, 0, 24, 0]]",
                                        "[1, 2, 3, 4, 5, 6, 7, 8, 9]",
                                        "[4611686018427387904, 4]",
                                        "[-1]",
                                        "[]",
                                        "{}",
                                        "\"x\": 1, ",
                                        "\"F33\"",
                                        "\"I8\"",
                                        "true",
                                        "null",
                                        "\"../rank-0-of-3.safetensors\"",
                                        "\"index.json\"",
                                        "{\"name\": \"a\", \"size\": 0}, ",
                                        "\"\\u0000\"",
                                        "\"\xff\xfe\""};
#define NFRAGMENTS (sizeof fragments / sizeof *fragments)

/* Puts s (sl bytes) in place of k bytes at `at` of p (n bytes, capacity cap). */
static void splice(char *p, size_t *n, size_t cap, size_t at, size_t k, const char *s, size_t sl) {
    if (at > *n || k > *n - at || *n - k + sl > cap) return;
    memmove(p + at + sl, p + at + k, *n - at - k);
    memcpy(p + at, s, sl);
    *n = *n - k + sl;
}

/* One mutation of the index text p. */
static void mutate_index(char *p, size_t *n, size_t cap, uint64_t *s) {
    uint64_t r = splitmix64(s);
    size_t len = *n, at = len ? (size_t)(splitmix64(s) % len) : 0;
    switch (r % 8) {
    case 0: /* bit flip */
        if (len) p[at] ^= (char)(1u << (r >> 8) % 8);
        break;
    case 1: { /* a syntax byte */
        static const char syn[] = "{}[]\",:-09 e.\\";
        char c = syn[(r >> 8) % (sizeof syn - 1)];
        splice(p, n, cap, at, (r >> 16) % 2, &c, 1);
        break;
    }
    case 2: { /* delete a range */
        size_t k = (size_t)((r >> 8) % 16 + 1);
        splice(p, n, cap, at, k < len - at ? k : len - at, "", 0);
        break;
    }
    case 3: /* truncate */
        *n = at;
        break;
    case 4:
    case 5: { /* a number becomes a special one (valid JSON, wrong meaning) */
        size_t i = at;
        while (i < len && (p[i] < '0' || p[i] > '9'))
            i++;
        size_t k = 0;
        while (i + k < len && p[i + k] >= '0' && p[i + k] <= '9')
            k++;
        if (k) {
            const char *sp = specials[(r >> 8) % NSPECIALS];
            splice(p, n, cap, i, k, sp, strlen(sp));
        }
        break;
    }
    case 6: { /* a fragment after a '[', ',' or ':' */
        size_t i = at;
        while (i < len && p[i] != '[' && p[i] != ',' && p[i] != ':')
            i++;
        if (i < len) {
            const char *f = fragments[(r >> 8) % NFRAGMENTS];
            size_t k = (r >> 16) % 2 ? strcspn(p + i + 1, ",]}") : 0;
            splice(p, n, cap, i + 1, k, f, strlen(f));
        }
        break;
    }
    default: { /* a range copied elsewhere (duplicate keys, entries, chunks) */
        size_t from = len ? (size_t)(splitmix64(s) % len) : 0, k = (r >> 8) % 200;
        if (k > len - from) k = len - from;
        char tmp[200];
        memcpy(tmp, p + from, k);
        splice(p, n, cap, at, 0, tmp, k);
        break;
    }
    }
}

int main(void) {
    const char *e = getenv("FUZZ_CKPT_N"), *es = getenv("FUZZ_CKPT_SEED");
    long n_inputs = e ? atol(e) : 20000;
    uint64_t seed = es ? strtoull(es, NULL, 0) : 20261127, s = seed;
    alarm(900); /* a hang fails the test instead of the run */
    tap_plan_lazy();
    setup();

    fuzz_ckpt_one((const uint8_t *)"", 0);
    tap_ok(fz.opened == 1 && fz.refused_verify == 0 && fz.reads_refused == 0,
           "[fuzz] the valid checkpoint (empty input) opens, verifies and reads");

    size_t icap = 2 * fz.index_len + 8192;
    char *buf = malloc(icap + 1 + 8 * MAX_RECORDS);
    if (!buf) tap_bail("out of memory");
    size_t idx_only = 0, rank_only = 0, both = 0;
    for (long k = 0; k < n_inputs; k++) {
        uint64_t mode = splitmix64(&s) % 4; /* 0: index, 1: rank files, 2 and 3: both */
        size_t n = 0;
        if (mode != 1) {
            memcpy(buf, fz.index, fz.index_len);
            n = fz.index_len;
            int m = 1 + (int)(splitmix64(&s) % 4);
            for (int i = 0; i < m; i++)
                mutate_index(buf, &n, icap, &s);
            for (size_t i = 0; i < n; i++)
                if (!buf[i]) buf[i] = ' '; /* NUL ends the text */
            if (!n) buf[n++] = ' ';
        }
        if (mode != 0) {
            buf[n++] = 0;
            int m = 1 + (int)(splitmix64(&s) % 3);
            for (int i = 0; i < m; i++) {
                uint64_t r = splitmix64(&s), pos = splitmix64(&s);
                unsigned char *rec = (unsigned char *)buf + n;
                /* ops 0..5 of apply_record, weighted: flips, sets and numbers mostly keep
                 * the header parseable, so they reach the checks against the index */
                static const unsigned char ops[20] = {0, 0, 0, 0, 0, 0, 1, 1, 1, 1,
                                                      5, 5, 5, 5, 5, 2, 2, 3, 3, 4};
                rec[0] = ops[r % 20];
                rec[1] = (unsigned char)(r >> 8);
                /* most positions in the header, where a change means something */
                pos = (r >> 16) % 4 ? pos % 400 : pos;
                for (int b = 0; b < 4; b++)
                    rec[2 + b] = (unsigned char)(pos >> (8 * b));
                rec[6] = (unsigned char)(r >> 24);
                rec[7] = (unsigned char)(r >> 32);
                n += 8;
            }
        }
        idx_only += mode == 0;
        rank_only += mode == 1;
        both += mode >= 2;
        fuzz_ckpt_one((const uint8_t *)buf, n);
    }
    free(buf);
    tap_ok(fz.runs == (size_t)n_inputs + 1,
           "[fuzz] corrupted and truncated files give errors, never a crash: %ld inputs (seed "
           "%" PRIu64 "; %zu mutate index.json, %zu rank files, %zu both)",
           n_inputs, seed, idx_only, rank_only, both);
    tap_diag("opened %zu, refused at open %zu, refused by verify %zu; tensor reads: %zu whole, "
             "%zu refused",
             fz.opened, fz.refused_open, fz.refused_verify, fz.reads_ok, fz.reads_refused);
    tap_ok(n_inputs < 100 || (fz.opened > 1 && fz.refused_open > 0 && fz.refused_verify > 0),
           "[fuzz] the inputs reach every stage: %zu opened, %zu refused at open, %zu refused "
           "by verify or a read",
           fz.opened, fz.refused_open, fz.refused_verify);
    teardown();
    return tap_done();
}

#endif
