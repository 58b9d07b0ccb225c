/* SPDX-License-Identifier: MIT */
/*
 * t_bpe.c: GPT-2's byte-level BPE (fsdp/bpe.h; issue 25, "A GPT-2 BPE tokenizer in C").
 *   - the test writes its own encoder.json and vocab.bpe: the 256 byte tokens in GPT-2's order
 *     (id 0 is "!", the space's "Ġ" is 220, as in GPT-2's file), the merges of
 *     tests/golden/bpe_golden.h as 256 + rank, and <|endoftext|>;
 *   - every golden case encodes to the ids of GPT-2's published algorithm (tests/golden/gen_bpe.py,
 *     a reference implementation in Python with the regex module): contractions, single and
 *     repeated spaces, whitespace before words, tabs and newlines, digits, punctuation, Latin,
 *     CJK, Arabic digits, Devanagari with its marks, emoji, Unicode spaces, repeated merges
 *     ("aaaa" from "aa" + "aa"), invalid UTF-8 (stray, truncated, overlong, surrogate, too large)
 *     and control bytes; and decodes back to its bytes;
 *   - decode(encode(x)) == x for 300 arbitrary byte strings, with at most one id per byte;
 *   - the special token decodes to its text and is never produced by encoding its text;
 *   - errors: an id outside the vocabulary (or one encoder.json does not use) named with its
 *     position, an output too small, a vocabulary without a byte, a merge of unknown symbols, a
 *     repeated merge, a name outside the byte alphabet, bad JSON, a missing file; each message
 *     names the file and the line or entry;
 *   - fsdp_bpe_encode_file writes an llm.c token file (magic, version, count, uint16 tokens) that
 *     fsdp_dataset_open reads back as the same ids.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <fsdp.h>
#include <jansson.h>

#include "fs_util.h"
#include "golden/bpe_golden.h"
#include "tap.h"

#define NMERGES (sizeof golden_merges / sizeof golden_merges[0])
#define NCASES (sizeof golden_cases / sizeof golden_cases[0])

static char dir[512];

/* GPT-2's byte alphabet, written out here independently of the library's. */
static uint32_t byte_cp(unsigned x) {
    if ((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE) return x;
    uint32_t n = 0;
    for (unsigned y = 0; y < x; y++)
        n += !((y >= '!' && y <= '~') || (y >= 0xA1 && y <= 0xAC) || y >= 0xAE);
    return 256 + n;
}

static void put_utf8(char *out, uint32_t cp) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        out[1] = 0;
    } else {
        out[0] = (char)(0xC0 | cp >> 6);
        out[1] = (char)(0x80 | (cp & 0x3F));
        out[2] = 0;
    }
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f || fputs(text, f) < 0 || fclose(f) != 0) tap_bail("writing %s", path);
}

/* encoder.json and vocab.bpe of the golden vocabulary in dir/sub; `drop_byte` (0..255) leaves
 * that byte's token out, `extra_merge` is appended to vocab.bpe (NULL: none). */
static void write_vocab(const char *sub, int drop_byte, const char *extra_merge) {
    char d[600], p[700];
    snprintf(d, sizeof d, "%s/%s", dir, sub);
    if (mkdir(d, 0777) != 0 && errno != EEXIST) tap_bail("mkdir %s", d);
    json_t *enc = json_object();
    int id = 0;
    for (uint32_t cp = 0; cp < 256 + 68; cp++) /* the byte tokens in code point order */
        for (unsigned x = 0; x < 256; x++)
            if (byte_cp(x) == cp) {
                char name[4];
                put_utf8(name, cp);
                if ((int)x != drop_byte) json_object_set_new(enc, name, json_integer(id));
                id++;
            }
    for (size_t k = 0; k < NMERGES; k++) {
        char name[256];
        snprintf(name, sizeof name, "%s%s", golden_merges[k][0], golden_merges[k][1]);
        json_object_set_new(enc, name, json_integer(256 + (json_int_t)k));
    }
    json_object_set_new(enc, "<|endoftext|>", json_integer(256 + (json_int_t)NMERGES));
    snprintf(p, sizeof p, "%s/encoder.json", d);
    if (json_dump_file(enc, p, 0) != 0) tap_bail("writing %s", p);
    json_decref(enc);
    snprintf(p, sizeof p, "%s/vocab.bpe", d);
    FILE *f = fopen(p, "w");
    if (!f) tap_bail("writing %s", p);
    fprintf(f, "#version: 0.2\n");
    for (size_t k = 0; k < NMERGES; k++)
        fprintf(f, "%s %s\n", golden_merges[k][0], golden_merges[k][1]);
    if (extra_merge) fprintf(f, "%s\n", extra_merge);
    fclose(f);
}

/* fsdp_bpe_load_dir of dir/sub on a silent context: the status, the message in msg. */
static int load(const char *sub, fsdp_bpe_t **out, char *msg, size_t cap) {
    fsdp_ctx_options_t co;
    fsdp_ctx_options_init(&co);
    co.log_level = FSDP_LOG_OFF;
    fsdp_ctx_t *ctx = NULL;
    if (fsdp_ctx_create(&co, &ctx) < 0) tap_bail("ctx");
    char d[600];
    snprintf(d, sizeof d, "%s/%s", dir, sub);
    int rc = fsdp_bpe_load_dir(ctx, d, out);
    snprintf(msg, cap, "%s", fsdp_ctx_last_error(ctx));
    fsdp_ctx_destroy(ctx);
    return rc;
}

static uint64_t rng = 0x243F6A8885A308D3ULL;
static uint64_t next(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* Arbitrary bytes, weighted to what text has (letters, spaces, apostrophes, digits, UTF-8 of
 * several lengths) with any byte mixed in. */
static size_t arbitrary(unsigned char *buf, size_t max) {
    static const char *const bits[] = {"a",  "aa", " ",        "  ",   "'s",   "'",  "the",
                                       "\n", "\t", "1",        "23",   "!",    ".",  "é",
                                       "東", "👍",  "\xe6\x9d", "\xff", "\xc3", "ll", "Ⅻ"};
    size_t n = 0, want = (size_t)(next() % max);
    while (n < want) {
        if (next() % 4 == 0) {
            buf[n++] = (unsigned char)next();
            continue;
        }
        const char *b = bits[next() % (sizeof bits / sizeof bits[0])];
        size_t k = strlen(b);
        if (n + k > want) break;
        memcpy(buf + n, b, k);
        n += k;
    }
    return n;
}

/* t_tokenize.sh's helpers: --write-vocab DIR writes the golden vocabulary into DIR; --decode DIR
 * reads ids from stdin and prints their text as fsdp-train prints a sample (control characters
 * other than newline and tab as '?'). */
static int helper(char **argv) {
    snprintf(dir, sizeof dir, "%s", argv[2]);
    if (strcmp(argv[1], "--write-vocab") == 0) {
        write_vocab(".", -1, NULL);
        return 0;
    }
    char msg[2048];
    fsdp_bpe_t *bpe = NULL;
    if (load(".", &bpe, msg, sizeof msg) < 0) {
        fprintf(stderr, "%s\n", msg);
        return 1;
    }
    long long id;
    while (scanf("%lld", &id) == 1) {
        const char *b;
        size_t len;
        if (fsdp_bpe_token_bytes(bpe, id, &b, &len) < 0) return 1;
        for (size_t i = 0; i < len; i++) {
            unsigned char c = (unsigned char)b[i];
            putchar(c == '\n' || c == '\t' || (c >= 32 && c != 127) ? c : '?');
        }
    }
    putchar('\n');
    fsdp_bpe_destroy(bpe);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3) return helper(argv);
    tap_plan_lazy();
    char tmpl[512], msg[2048];
    tap_tmppath(tmpl, sizeof tmpl, "t_bpe-XXXXXX");
    if (!mkdtemp(tmpl)) tap_bail("mkdtemp: %s", strerror(errno));
    snprintf(dir, sizeof dir, "%s", tmpl);

    write_vocab("good", -1, NULL);
    fsdp_bpe_t *bpe = NULL;
    tap_is_int(load("good", &bpe, msg, sizeof msg), 0, "the vocabulary loads (%s)", msg);
    if (!bpe) tap_bail("no tokenizer");
    tap_is_int(fsdp_bpe_vocab_size(bpe), 256 + (int64_t)NMERGES + 1,
               "vocabulary: 256 bytes, the merges and <|endoftext|>");
    tap_is_size(fsdp_bpe_num_merges(bpe), NMERGES, "every merge line is read");

    int32_t ids[4096];
    char back[4096];
    size_t n = 0, len = 0;
    tap_ok(fsdp_bpe_encode(bpe, "!", 1, ids, 4, &n) == 0 && n == 1 && ids[0] == 0,
           "\"!\" is id 0, as in GPT-2's encoder.json");
    tap_ok(fsdp_bpe_encode(bpe, " ", 1, ids, 4, &n) == 0 && n == 1 && ids[0] == 220,
           "a space alone is id 220 (\"\\u0120\"), as in GPT-2's encoder.json");

    /* ---- the golden cases -------------------------------------------------------------------- */
    for (size_t c = 0; c < NCASES; c++) {
        const golden_case_t *g = &golden_cases[c];
        int rc = fsdp_bpe_encode(bpe, g->text, g->len, ids, g->len, &n);
        bool same = rc == 0 && n == g->n && memcmp(ids, g->ids, n * sizeof ids[0]) == 0;
        char first[64] = "";
        for (size_t i = 0; i < g->len && i < 20; i++)
            first[i] = g->text[i] >= 32 && g->text[i] < 127 ? g->text[i] : '.';
        if (!same) {
            tap_diag("case %zu: rc %d, %zu ids, want %zu", c, rc, n, g->n);
            for (size_t i = 0; i < n || i < g->n; i++)
                tap_diag("  %zu: got %d want %d", i, i < n ? ids[i] : -1,
                         i < g->n ? g->ids[i] : -1);
        }
        tap_ok(same, "case %zu \"%s\": the %zu ids of GPT-2's algorithm", c, first, g->n);
        rc = fsdp_bpe_decode(bpe, ids, n, back, sizeof back, &len);
        tap_ok(rc == 0 && len == g->len && memcmp(back, g->text, len) == 0,
               "case %zu: decodes to its %zu bytes", c, g->len);
    }

    /* ---- arbitrary bytes --------------------------------------------------------------------- */
    int bad = 0;
    size_t total = 0, ntok = 0;
    for (int t = 0; t < 300; t++) {
        unsigned char in[600];
        size_t k = arbitrary(in, sizeof in);
        int rc = fsdp_bpe_encode(bpe, in, k, ids, k, &n);
        if (rc == 0) rc = fsdp_bpe_decode(bpe, ids, n, back, sizeof back, &len);
        if (rc != 0 || len != k || memcmp(back, in, k) != 0 || n > k) {
            if (!bad++) tap_diag("string %d (%zu bytes): rc %d, %zu back", t, k, rc, len);
        }
        total += k;
        ntok += n;
    }
    tap_is_int(bad, 0, "decode(encode(x)) == x for 300 arbitrary byte strings (%zu bytes, %zu ids)",
               total, ntok);

    /* ---- the special token ------------------------------------------------------------------- */
    const char *sp = NULL;
    int32_t eot = 256 + (int32_t)NMERGES;
    tap_ok(fsdp_bpe_token_bytes(bpe, eot, &sp, &len) == 0 && len == 13 &&
               memcmp(sp, "<|endoftext|>", 13) == 0,
           "<|endoftext|> decodes to its text");
    fsdp_bpe_encode(bpe, "<|endoftext|>", 13, ids, 13, &n);
    bool has_eot = false;
    for (size_t i = 0; i < n; i++)
        has_eot = has_eot || ids[i] == eot;
    tap_ok(!has_eot && n > 1, "encoding its text gives ordinary tokens (%zu), as GPT-2's does", n);

    /* ---- errors --------------------------------------------------------------------------------
     */
    int32_t out_of[3] = {0, 1, 99999};
    tap_is_int(fsdp_bpe_decode(bpe, out_of, 3, back, sizeof back, &len), FSDP_EINVAL,
               "decoding an id outside the vocabulary fails");
    tap_has_str(fsdp_bpe_last_error(bpe), "id 2 of 3: token 99999",
                "... naming its position and the id");
    tap_is_int(fsdp_bpe_encode(bpe, "Hello world", 11, ids, 1, &n), FSDP_EINVAL,
               "an output too small for the ids is refused");
    tap_has_str(fsdp_bpe_last_error(bpe), "full", "... saying the output is full");
    fsdp_bpe_destroy(bpe);

    fsdp_bpe_t *b2 = NULL;
    write_vocab("nobyte", 'q', NULL);
    tap_is_int(load("nobyte", &b2, msg, sizeof msg), FSDP_EINVAL, "a vocabulary without a byte");
    tap_has_str(msg, "no token for byte 0x71 (\"q\")", "... names the byte (%s)", msg);
    tap_ok(b2 == NULL, "... and gives no tokenizer");
    write_vocab("unknown", -1, "zq\xc4\xa0 x");
    tap_is_int(load("unknown", &b2, msg, sizeof msg), FSDP_EINVAL, "a merge of an unknown symbol");
    char line[32];
    snprintf(line, sizeof line, "line %zu", NMERGES + 2); /* after "#version" and the merges */
    tap_has_str(msg, line, "... names the line (%s)", msg);
    tap_has_str(msg, "zq", "... and the symbol");
    char rep[256];
    snprintf(rep, sizeof rep, "%s %s", golden_merges[2][0], golden_merges[2][1]);
    write_vocab("repeat", -1, rep);
    tap_is_int(load("repeat", &b2, msg, sizeof msg), FSDP_EINVAL, "a repeated merge");
    tap_has_str(msg, "repeats the merge", "... says so (%s)", msg);
    write_vocab("foreign", -1, NULL);
    char p[700];
    snprintf(p, sizeof p, "%s/foreign/encoder.json", dir);
    write_text(p, "{\"!\": 0, \"\xe2\x82\xac\": 1}");
    tap_is_int(load("foreign", &b2, msg, sizeof msg), FSDP_EINVAL,
               "a name outside the byte alphabet");
    tap_has_str(msg, "U+20AC", "... names the character (%s)", msg);
    write_text(p, "{\"!\": 0,\n \"a\": }");
    tap_is_int(load("foreign", &b2, msg, sizeof msg), FSDP_EINVAL, "JSON that does not parse");
    tap_has_str(msg, "line 2", "... names the line (%s)", msg);
    tap_is_int(load("missing", &b2, msg, sizeof msg), FSDP_EINVAL, "a missing directory");
    tap_has_str(msg, "missing/encoder.json", "... names the file (%s)", msg);

    /* ---- llm.c token files ------------------------------------------------------------------ */
    if (load("good", &bpe, msg, sizeof msg) < 0) tap_bail("reload");
    char txt[700], bin[700];
    snprintf(txt, sizeof txt, "%s/in.txt", dir);
    snprintf(bin, sizeof bin, "%s/out.bin", dir);
    const golden_case_t *g = &golden_cases[2];
    FILE *f = fopen(txt, "wb");
    if (!f || fwrite(g->text, 1, g->len, f) != g->len || fclose(f) != 0) tap_bail("in.txt");
    uint64_t count = 0;
    tap_is_int(fsdp_bpe_encode_file(bpe, txt, bin, &count), 0, "fsdp_bpe_encode_file");
    tap_is_uint(count, g->n, "... counts the tokens");
    int32_t header[256] = {0};
    uint16_t toks[256] = {0};
    f = fopen(bin, "rb");
    size_t got = f ? fread(header, 4, 256, f) : 0;
    size_t gt = f ? fread(toks, 2, 256, f) : 0;
    if (f) fclose(f);
    tap_ok(got == 256 && header[0] == 20240520 && header[1] == 1 && header[2] == (int32_t)g->n,
           "... header: magic 20240520, version 1, the count");
    bool eq = gt == g->n;
    for (size_t i = 0; eq && i < g->n; i++)
        eq = toks[i] == (uint16_t)g->ids[i];
    tap_ok(eq, "... then the ids as uint16");
    fsdp_dataset_t *ds = NULL;
    int64_t rd[256];
    tap_ok(fsdp_dataset_open(NULL, bin, FSDP_DATA_AUTO, &ds) == 0 &&
               fsdp_dataset_num_tokens(ds) == g->n &&
               fsdp_dataset_read(NULL, ds, 0, g->n, rd) == 0 && rd[0] == g->ids[0] &&
               rd[g->n - 1] == g->ids[g->n - 1],
           "fsdp_dataset_open reads the file as the same tokens");
    fsdp_dataset_destroy(ds);
    tap_is_int(fsdp_bpe_encode_file(bpe, fsu_join(dir, "nope.txt"), bin, &count), FSDP_EINVAL,
               "a missing text file");
    tap_has_str(fsdp_bpe_last_error(bpe), "nope.txt", "... is named");
    fsdp_bpe_destroy(bpe);
    fsu_remove_tree(dir);
    return tap_done();
}
