/* SPDX-License-Identifier: MIT */
/*
 * bpe.c: GPT-2's byte-level BPE tokenizer (fsdp/bpe.h): reading encoder.json and vocab.bpe,
 * the pre-tokenizer, the merges, encoding and decoding.
 *
 * Invariants of a loaded tokenizer:
 * - every id below `vocab` either has no token (len UINT32_MAX) or its bytes at bytes + off[id];
 * - byte_id[b] is the id of the one-byte token b, for all 256 bytes (loading refuses otherwise),
 *   so the symbols of any piece of text start as ids, and encoding never fails for lack of one;
 * - the merge table maps the pair of ids (left, right) to its rank and to the id of the merged
 *   token, which loading checked is in the vocabulary: a merge never leaves the vocabulary.
 * Encoding therefore works on ids alone. The merge loop is the published algorithm's: find the
 * pair of lowest rank, merge all its occurrences left to right, repeat; its cost grows with the
 * square of a piece's length, which the pre-tokenizer keeps short for text (a piece is one
 * word, number, punctuation run or whitespace run).
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fsdp/bpe.h>
#include <jansson.h>

#include "internal.h"
#include "io/bpe_impl.h"

/* Neither file of GPT-2 is near this (1 MB and 0.5 MB); it bounds what a wrong path reads. */
#define BPE_MAX_FILE ((size_t)256 << 20)
#define NO_TOKEN UINT32_MAX
#define ALPHABET_END (256 + 68) /* the code points of GPT-2's byte alphabet */

struct fsdp_bpe {
    char err[FSDP_ERR_LEN];
    int64_t vocab; /* the largest id + 1 */
    uint32_t *off; /* (vocab) where token id's bytes start in bytes[] */
    uint32_t *len; /* (vocab) their length; NO_TOKEN for an id encoder.json does not use */
    char *bytes;   /* every token's bytes, one after another */
    int32_t byte_id[256];
    uint32_t cp[256];              /* GPT-2's alphabet (alphabet()) */
    int16_t byte_of[ALPHABET_END]; /* and its inverse */
    uint64_t *mkey;                /* (mmask + 1) (left << 32 | right) + 1; 0 marks an empty slot */
    int32_t *mrank;                /* (mmask + 1) the merge's line among the merges, from 0 */
    int32_t *mres;                 /* (mmask + 1) the merged token's id */
    size_t mmask;
    size_t nmerges;
};

/* ---- GPT-2's byte alphabet and UTF-8 ------------------------------------------------------ */

/* GPT-2's alphabet: byte x stands for code point cp[x]. The printable bytes of Latin-1
 * ('!'..'~', 0xA1..0xAC, 0xAE..0xFF) stand for themselves, the other 68 for U+0100.. in increasing
 * byte order; byte_of is the inverse (-1 for a code point of none). */
static void alphabet(uint32_t cp[256], int16_t byte_of[ALPHABET_END]) {
    uint32_t n = 0;
    for (int c = 0; c < ALPHABET_END; c++)
        byte_of[c] = -1;
    for (unsigned x = 0; x < 256; x++) {
        bool printable = (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE;
        cp[x] = printable ? x : 256 + n++;
        byte_of[cp[x]] = (int16_t)x;
    }
}

/* The code point starting at s[i] (i < n) with its length in *k, or -1 with *k = 1 when s[i]
 * does not start a valid UTF-8 sequence (stray continuation byte, C0/C1/F5..FF, a truncated or
 * overlong sequence, an encoded surrogate, a value above U+10FFFF), as Python's decoder says. */
static int32_t utf8_at(const unsigned char *s, size_t n, size_t i, size_t *k) {
    unsigned c = s[i];
    size_t need;
    uint32_t cp;
    *k = 1;
    if (c < 0x80) return (int32_t)c;
    if (c >= 0xC2 && c <= 0xDF) {
        need = 1;
        cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
        need = 2;
        cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 3;
        cp = c & 0x07;
    } else {
        return -1;
    }
    if (n - i - 1 < need) return -1;
    for (size_t j = 1; j <= need; j++) {
        unsigned d = s[i + j];
        if ((d & 0xC0) != 0x80) return -1;
        cp = cp << 6 | (d & 0x3F);
    }
    if ((need == 2 && cp < 0x800) || (need == 3 && (cp < 0x10000 || cp > 0x10FFFF)) ||
        (cp >= 0xD800 && cp <= 0xDFFF))
        return -1;
    *k = need + 1;
    return (int32_t)cp;
}

/* A name of encoder.json or vocab.bpe (UTF-8 in GPT-2's alphabet) as bytes, into out (which
 * holds at least strlen(name) bytes); its length, or -1 when a character is outside the
 * alphabet (the code point in *bad). */
static long name_bytes(const fsdp_bpe_t *b, const char *name, size_t n, char *out, uint32_t *bad) {
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        size_t k;
        int32_t c = utf8_at((const unsigned char *)name, n, i, &k);
        int x = c < 0 || c >= ALPHABET_END ? -1 : b->byte_of[c];
        if (x < 0) {
            *bad = c < 0 ? (unsigned char)name[i] : (uint32_t)c;
            return -1;
        }
        out[o++] = (char)x;
        i += k;
    }
    return (long)o;
}

/* ---- reading the files -------------------------------------------------------------------- */

/* Reports a failure of fn: into buf when it is not NULL (a tokenizer's), else on ctx (or logged
 * without one). Returns rc. */
static int fail(fsdp_ctx_t *ctx, char *buf, int rc, const char *fmt, ...) FSDP_PRINTF(4, 5);
static int fail(fsdp_ctx_t *ctx, char *buf, int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    if (buf) {
        fsdp__verr(buf, rc, fmt, ap);
    } else {
        char msg[FSDP_ERR_LEN];
        vsnprintf(msg, sizeof msg, fmt, ap);
        fsdp__ctx_err_or_log(ctx, rc, "%s", msg);
    }
    va_end(ap);
    return rc;
}

/* The whole of the regular file path (malloc'ed, NUL-terminated, *n bytes); errors as fail()
 * says, prefixed with fn. */
static int slurp(fsdp_ctx_t *ctx, char *buf, const char *fn, const char *path, char **out,
                 size_t *n) {
    char why[256];
    struct stat sb;
    *out = NULL;
    int fd = fsdp__open_regular(AT_FDCWD, path, O_RDONLY, 0, &sb, why, sizeof why);
    if (fd < 0) return fail(ctx, buf, FSDP_EINVAL, "%s: %s: %s", fn, path, why);
    if ((uint64_t)sb.st_size > BPE_MAX_FILE) {
        close(fd);
        return fail(ctx, buf, FSDP_EINVAL, "%s: %s: %lld bytes, more than the %zu this reads", fn,
                    path, (long long)sb.st_size, BPE_MAX_FILE);
    }
    size_t size = (size_t)sb.st_size, got = 0;
    char *data = malloc(size + 1);
    if (!data) {
        close(fd);
        return fail(ctx, buf, FSDP_ENOMEM, "%s: %s: out of memory", fn, path);
    }
    while (got < size) {
        ssize_t r = read(fd, data + got, size - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            int e = r < 0 ? errno : 0;
            free(data);
            close(fd);
            return fail(ctx, buf, FSDP_EINVAL, "%s: %s: %s", fn, path,
                        e ? strerror(e) : "the file shrank while it was read");
        }
        got += (size_t)r;
    }
    close(fd);
    data[size] = 0;
    *out = data;
    *n = size;
    return FSDP_OK;
}

/* A table from token bytes to id, used while the merges are read. */
typedef struct name_map {
    int32_t *slot; /* id + 1; 0 empty */
    size_t mask;
} name_map_t;

static uint64_t hash_bytes(const char *p, size_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)p[i]) * 1099511628211ULL;
    return h;
}

static int32_t map_find(const fsdp_bpe_t *b, const name_map_t *m, const char *p, size_t n) {
    for (size_t s = hash_bytes(p, n) & m->mask;; s = (s + 1) & m->mask) {
        int32_t id = m->slot[s] - 1;
        if (id < 0) return -1;
        if (b->len[id] == n && memcmp(b->bytes + b->off[id], p, n) == 0) return id;
    }
}

static uint64_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return x;
}

/* The slot of the merge (l, r): its own, or the empty one where it would go. */
static size_t merge_slot(const fsdp_bpe_t *b, int32_t l, int32_t r) {
    uint64_t key = ((uint64_t)(uint32_t)l << 32 | (uint32_t)r) + 1;
    size_t s = mix(key) & b->mmask;
    while (b->mkey[s] && b->mkey[s] != key)
        s = (s + 1) & b->mmask;
    return s;
}

/* encoder.json: ids, token bytes, byte_id, and the name map. */
static int read_encoder(fsdp_ctx_t *ctx, fsdp_bpe_t *b, const char *path, name_map_t *m) {
    char *text = NULL;
    size_t n = 0;
    int rc = slurp(ctx, NULL, "fsdp_bpe_load", path, &text, &n);
    if (rc < 0) return rc;
    json_error_t je;
    json_t *root = json_loadb(text, n, JSON_REJECT_DUPLICATES, &je);
    free(text);
    const char *key;
    json_t *v;
    size_t total = 0;
    if (!root || !json_is_object(root) || json_object_size(root) == 0) {
        rc = root ? fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                         "fsdp_bpe_load: %s: not a JSON object of tokens", path)
                  : fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "fsdp_bpe_load: %s: line %d: %s", path,
                                         je.line, je.text);
        goto out;
    }
    json_object_foreach(root, key, v) {
        json_int_t id = json_is_integer(v) ? json_integer_value(v) : -1;
        if (id < 0 || id >= INT32_MAX) {
            rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                      "fsdp_bpe_load: %s: the id of \"%s\" is not an integer in "
                                      "[0, 2^31 - 1)",
                                      path, key);
            goto out;
        }
        if (id + 1 > b->vocab) b->vocab = id + 1;
        total += strlen(key);
    }
    if (total >= UINT32_MAX) {
        rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "fsdp_bpe_load: %s: too large", path);
        goto out;
    }
    size_t cap = 16;
    while (cap < 2 * json_object_size(root))
        cap *= 2;
    b->off = malloc((size_t)b->vocab * sizeof *b->off);
    b->len = malloc((size_t)b->vocab * sizeof *b->len);
    b->bytes = malloc(total + 1);
    m->slot = calloc(cap, sizeof *m->slot);
    m->mask = cap - 1;
    if (!b->off || !b->len || !b->bytes || !m->slot) {
        rc = fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "fsdp_bpe_load: %s: out of memory", path);
        goto out;
    }
    for (int64_t i = 0; i < b->vocab; i++)
        b->len[i] = NO_TOKEN;
    for (int i = 0; i < 256; i++)
        b->byte_id[i] = -1;
    size_t used = 0;
    json_object_foreach(root, key, v) {
        int32_t id = (int32_t)json_integer_value(v);
        uint32_t bad = 0;
        long k = name_bytes(b, key, strlen(key), b->bytes + used, &bad);
        if (k == 0) {
            rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "fsdp_bpe_load: %s: an empty token (id %d)",
                                      path, id);
            goto out;
        }
        if (k < 0) {
            rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                      "fsdp_bpe_load: %s: token \"%s\" has U+%04X, outside GPT-2's "
                                      "byte-to-unicode alphabet",
                                      path, key, bad);
            goto out;
        }
        if (b->len[id] != NO_TOKEN) {
            rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                      "fsdp_bpe_load: %s: id %d is given to two tokens, \"%s\" "
                                      "and another",
                                      path, id, key);
            goto out;
        }
        b->off[id] = (uint32_t)used;
        b->len[id] = (uint32_t)k;
        if (k == 1) b->byte_id[(unsigned char)b->bytes[used]] = id;
        size_t s = hash_bytes(b->bytes + used, (size_t)k) & m->mask;
        while (m->slot[s])
            s = (s + 1) & m->mask;
        m->slot[s] = id + 1;
        used += (size_t)k;
    }
    for (int x = 0; x < 256; x++)
        if (b->byte_id[x] < 0) {
            /* its name in the alphabet: every code point of which is below U+0800 */
            uint32_t cp = b->cp[x];
            char c[3] = {(char)(0xC0 | cp >> 6), (char)(0x80 | (cp & 0x3F)), 0};
            if (cp < 0x80) c[0] = (char)cp, c[1] = 0;
            rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                      "fsdp_bpe_load: %s: no token for byte 0x%02X (\"%s\"): "
                                      "GPT-2's vocabulary holds all 256 bytes, so that any text "
                                      "encodes",
                                      path, (unsigned)x, c);
            goto out;
        }
out:
    json_decref(root);
    return rc;
}

/* vocab.bpe: one merge "A B" per line in rank order, after an optional "#version" line; blank
 * lines are skipped. Both symbols and their concatenation must be tokens of encoder.json. */
static int read_merges(fsdp_ctx_t *ctx, fsdp_bpe_t *b, const char *path, const name_map_t *m) {
    char *text = NULL, *scratch = NULL;
    size_t n = 0, lines = 0;
    int rc = slurp(ctx, NULL, "fsdp_bpe_load", path, &text, &n);
    if (rc < 0) return rc;
    for (size_t i = 0; i < n; i++)
        lines += text[i] == '\n';
    size_t cap = 16;
    while (cap < 2 * (lines + 1))
        cap *= 2;
    b->mkey = calloc(cap, sizeof *b->mkey);
    b->mrank = malloc(cap * sizeof *b->mrank);
    b->mres = malloc(cap * sizeof *b->mres);
    b->mmask = cap - 1;
    scratch = malloc(n + 1);
    if (!b->mkey || !b->mrank || !b->mres || !scratch) {
        rc = fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "fsdp_bpe_load: %s: out of memory", path);
        goto out;
    }
    size_t lineno = 0;
    for (char *p = text, *next; p < text + n; p = next) {
        char *nl = memchr(p, '\n', (size_t)(text + n - p));
        char *end = nl ? nl : text + n;
        next = nl ? nl + 1 : text + n;
        lineno++;
        if (end > p && end[-1] == '\r') end--;
        if (end == p || (lineno == 1 && end - p >= 8 && memcmp(p, "#version", 8) == 0)) continue;
        char *sp = memchr(p, ' ', (size_t)(end - p));
        if (!sp || sp == p || sp + 1 == end || memchr(sp + 1, ' ', (size_t)(end - sp - 1))) {
            rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                      "fsdp_bpe_load: %s: line %zu: \"%.*s\" is not two symbols "
                                      "separated by one space",
                                      path, lineno, (int)(end - p < 80 ? end - p : 80), p);
            goto out;
        }
        uint32_t bad = 0;
        long la = name_bytes(b, p, (size_t)(sp - p), scratch, &bad);
        long lb = la < 0 ? -1 : name_bytes(b, sp + 1, (size_t)(end - sp - 1), scratch + la, &bad);
        if (la < 0 || lb < 0) {
            rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                      "fsdp_bpe_load: %s: line %zu: U+%04X is outside GPT-2's "
                                      "byte-to-unicode alphabet",
                                      path, lineno, bad);
            goto out;
        }
        int32_t l = map_find(b, m, scratch, (size_t)la);
        int32_t r = map_find(b, m, scratch + la, (size_t)lb);
        int32_t res = map_find(b, m, scratch, (size_t)(la + lb));
        if (l < 0 || r < 0 || res < 0) {
            rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                      "fsdp_bpe_load: %s: line %zu: the merge \"%.*s\" needs "
                                      "\"%.*s\" in the vocabulary, which has no such token",
                                      path, lineno, (int)(end - p), p,
                                      l < 0   ? (int)(sp - p)
                                      : r < 0 ? (int)(end - sp - 1)
                                              : (int)(end - p),
                                      l < 0   ? p
                                      : r < 0 ? sp + 1
                                              : p);
            goto out;
        }
        size_t s = merge_slot(b, l, r);
        if (b->mkey[s]) {
            rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                      "fsdp_bpe_load: %s: line %zu repeats the merge \"%.*s\" "
                                      "(rank %d)",
                                      path, lineno, (int)(end - p), p, b->mrank[s]);
            goto out;
        }
        if (b->nmerges >= INT32_MAX) break;
        b->mkey[s] = ((uint64_t)(uint32_t)l << 32 | (uint32_t)r) + 1;
        b->mrank[s] = (int32_t)b->nmerges++;
        b->mres[s] = res;
    }
out:
    free(scratch);
    free(text);
    return rc;
}

int fsdp_bpe_load(fsdp_ctx_t *ctx, const char *encoder_json, const char *vocab_bpe,
                  fsdp_bpe_t **out) {
    if (!out || !encoder_json || !vocab_bpe) {
        if (out) *out = NULL;
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "fsdp_bpe_load: encoder_json, vocab_bpe and out must not be "
                                    "NULL");
    }
    *out = NULL;
    fsdp_bpe_t *b = calloc(1, sizeof *b);
    if (!b) return fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "fsdp_bpe_load: out of memory");
    alphabet(b->cp, b->byte_of);
    name_map_t m = {0};
    int rc = read_encoder(ctx, b, encoder_json, &m);
    if (rc == 0) rc = read_merges(ctx, b, vocab_bpe, &m);
    free(m.slot);
    if (rc < 0) {
        fsdp_bpe_destroy(b);
        return rc;
    }
    *out = b;
    return FSDP_OK;
}

int fsdp_bpe_load_dir(fsdp_ctx_t *ctx, const char *dir, fsdp_bpe_t **out) {
    if (out) *out = NULL;
    if (!dir) return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "fsdp_bpe_load_dir: dir is NULL");
    size_t n = strlen(dir) + 16;
    char *e = malloc(n), *v = malloc(n);
    int rc;
    if (!e || !v) {
        rc = fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "fsdp_bpe_load_dir: out of memory");
    } else {
        snprintf(e, n, "%s/encoder.json", dir);
        snprintf(v, n, "%s/vocab.bpe", dir);
        rc = fsdp_bpe_load(ctx, e, v, out);
    }
    free(e);
    free(v);
    return rc;
}

void fsdp_bpe_destroy(fsdp_bpe_t *b) {
    if (!b) return;
    free(b->off);
    free(b->len);
    free(b->bytes);
    free(b->mkey);
    free(b->mrank);
    free(b->mres);
    free(b);
}

int64_t fsdp_bpe_vocab_size(const fsdp_bpe_t *b) {
    return b ? b->vocab : 0;
}
size_t fsdp_bpe_num_merges(const fsdp_bpe_t *b) {
    return b ? b->nmerges : 0;
}
const char *fsdp_bpe_last_error(const fsdp_bpe_t *b) {
    return b ? b->err : "";
}

/* ---- encoding ----------------------------------------------------------------------------- */

static fsdp__uni_class_t class_at(const unsigned char *s, size_t n, size_t i, size_t *k) {
    int32_t c = utf8_at(s, n, i, k);
    return c < 0 ? FSDP__UNI_OTHER : fsdp__uni_class((uint32_t)c);
}

/* Where the run of characters of class c that starts at i ends. */
static size_t run_end(const unsigned char *s, size_t n, size_t i, fsdp__uni_class_t c) {
    size_t k;
    while (i < n && class_at(s, n, i, &k) == c)
        i += k;
    return i;
}

/* The length of the piece of GPT-2's pattern that starts at i < n: the first alternative of
 * 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ that matches. */
static size_t piece(const unsigned char *s, size_t n, size_t i) {
    static const char *const contraction[] = {"s", "t", "re", "ve", "m", "ll", "d"};
    if (s[i] == '\'')
        for (int q = 0; q < 7; q++) {
            size_t len = strlen(contraction[q]);
            if (n - i - 1 >= len && memcmp(s + i + 1, contraction[q], len) == 0) return len + 1;
        }
    size_t k;
    if (s[i] == ' ' && i + 1 < n) { /* the optional space of the letter, number, other runs */
        fsdp__uni_class_t c = class_at(s, n, i + 1, &k);
        if (c != FSDP__UNI_SPACE) return run_end(s, n, i + 1, c) - i;
    }
    fsdp__uni_class_t c = class_at(s, n, i, &k);
    if (c != FSDP__UNI_SPACE) return run_end(s, n, i, c) - i;
    size_t e = run_end(s, n, i, FSDP__UNI_SPACE);
    if (e == n) return e - i;
    /* \s+(?!\S) before a non-space backs off by its last character, which then starts the
     * next piece (" word"); a single whitespace character is \s+ alone. */
    size_t last = i;
    for (size_t p = i; p < e; p += k) {
        class_at(s, n, p, &k);
        last = p;
    }
    return last > i ? last - i : e - i;
}

/* Merges the symbols of w (nw ids) by rank; returns the new count. */
static size_t merge(const fsdp_bpe_t *b, int32_t *w, size_t nw) {
    while (nw > 1) {
        int32_t best = INT32_MAX, bl = 0, br = 0, res = 0;
        for (size_t p = 0; p + 1 < nw; p++) {
            size_t s = merge_slot(b, w[p], w[p + 1]);
            if (b->mkey[s] && b->mrank[s] < best) {
                best = b->mrank[s];
                bl = w[p];
                br = w[p + 1];
                res = b->mres[s];
            }
        }
        if (best == INT32_MAX) break;
        size_t o = 0;
        for (size_t p = 0; p < nw;) {
            if (p + 1 < nw && w[p] == bl && w[p + 1] == br) {
                w[o++] = res;
                p += 2;
            } else {
                w[o++] = w[p++];
            }
        }
        nw = o;
    }
    return nw;
}

int fsdp_bpe_encode(fsdp_bpe_t *b, const void *text, size_t len, int32_t *out, size_t cap,
                    size_t *n) {
    if (n) *n = 0;
    if (!b) return FSDP_EINVAL;
    if (!n || (!text && len) || (!out && cap))
        return fsdp__err(b->err, FSDP_EINVAL, "fsdp_bpe_encode: n, text or out is NULL");
    const unsigned char *s = text;
    size_t o = 0;
    for (size_t i = 0; i < len;) {
        size_t k = piece(s, len, i);
        /* The piece's symbols are merged in place at the end of out when they fit there, which
         * they do whenever cap >= len; else in a buffer of their own. */
        int32_t stack[64], *w = o + k <= cap ? out + o : k <= 64 ? stack : malloc(k * sizeof *w);
        if (!w) return fsdp__err(b->err, FSDP_ENOMEM, "fsdp_bpe_encode: out of memory");
        for (size_t p = 0; p < k; p++)
            w[p] = b->byte_id[s[i + p]];
        size_t nw = merge(b, w, k);
        if (w != out + o) {
            size_t fit = nw <= cap - o ? nw : cap - o;
            memcpy(out + o, w, fit * sizeof *w);
            if (w != stack) free(w);
            if (fit < nw) {
                *n = o + fit;
                return fsdp__err(b->err, FSDP_EINVAL,
                                 "fsdp_bpe_encode: the output of %zu ids is full at byte %zu of "
                                 "%zu (cap >= len always suffices)",
                                 cap, i, len);
            }
        }
        o += nw;
        i += k;
    }
    *n = o;
    return FSDP_OK;
}

/* ---- decoding ----------------------------------------------------------------------------- */

int fsdp_bpe_token_bytes(fsdp_bpe_t *b, int64_t id, const char **bytes, size_t *len) {
    if (!b) return FSDP_EINVAL;
    if (!bytes || !len)
        return fsdp__err(b->err, FSDP_EINVAL, "fsdp_bpe_token_bytes: bytes or len is NULL");
    if (id < 0 || id >= b->vocab || b->len[id] == NO_TOKEN)
        return fsdp__err(b->err, FSDP_EINVAL, "token %lld is not in the vocabulary (%lld ids%s)",
                         (long long)id, (long long)b->vocab,
                         id >= 0 && id < b->vocab ? "; encoder.json does not use this one" : "");
    *bytes = b->bytes + b->off[id];
    *len = b->len[id];
    return FSDP_OK;
}

int fsdp_bpe_decode(fsdp_bpe_t *b, const int32_t *ids, size_t n, void *out, size_t cap,
                    size_t *len) {
    if (len) *len = 0;
    if (!b) return FSDP_EINVAL;
    if (!len || (!ids && n) || (!out && cap))
        return fsdp__err(b->err, FSDP_EINVAL, "fsdp_bpe_decode: len, ids or out is NULL");
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        const char *p;
        size_t k;
        if (fsdp_bpe_token_bytes(b, ids[i], &p, &k) < 0) {
            char msg[256];
            snprintf(msg, sizeof msg, "%.200s", b->err);
            return fsdp__err(b->err, FSDP_EINVAL, "fsdp_bpe_decode: id %zu of %zu: %s", i, n, msg);
        }
        if (o + k <= cap) memcpy((char *)out + o, p, k);
        o += k;
    }
    *len = o;
    if (o > cap)
        return fsdp__err(b->err, FSDP_EINVAL,
                         "fsdp_bpe_decode: %zu bytes do not fit in the %zu of out", o, cap);
    return FSDP_OK;
}

/* ---- llm.c token files -------------------------------------------------------------------- */

/* Writes all n bytes of buf to fd; 0 or -1 with errno. */
static int write_all(int fd, const void *buf, size_t n) {
    const char *p = buf;
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

int fsdp_bpe_encode_file(fsdp_bpe_t *b, const char *text_path, const char *bin_path,
                         uint64_t *ntokens) {
    static const char fn[] = "fsdp_bpe_encode_file";
    if (ntokens) *ntokens = 0;
    if (!b) return FSDP_EINVAL;
    if (!text_path || !bin_path)
        return fsdp__err(b->err, FSDP_EINVAL, "%s: text_path and bin_path must not be NULL", fn);
    if (b->vocab > 65536)
        return fsdp__err(b->err, FSDP_EINVAL,
                         "%s: a vocabulary of %lld ids does not fit the uint16 tokens of an llm.c "
                         "token file (at most 65536)",
                         fn, (long long)b->vocab);
    char *text = NULL, why[512];
    size_t len = 0, n = 0;
    int rc = slurp(NULL, b->err, fn, text_path, &text, &len);
    if (rc < 0) return rc;
    int32_t *ids = malloc((len ? len : 1) * sizeof *ids);
    uint16_t *tok = malloc((len ? len : 1) * sizeof *tok);
    fsdp__replace_t r = {.fd = -1};
    if (!ids || !tok) {
        rc = fsdp__err(b->err, FSDP_ENOMEM, "%s: out of memory for %s", fn, text_path);
        goto out;
    }
    if ((rc = fsdp_bpe_encode(b, text, len, ids, len, &n)) < 0) goto out;
    if (n > INT32_MAX) {
        rc = fsdp__err(b->err, FSDP_EINVAL,
                       "%s: %s gives %zu tokens, more than the int32 count of the header holds", fn,
                       text_path, n);
        goto out;
    }
    int32_t header[256] = {20240520, 1, (int32_t)n};
    for (size_t i = 0; i < n; i++)
        tok[i] = (uint16_t)ids[i];
    fsdp__swap_le(header, 256, sizeof header[0]);
    fsdp__swap_le(tok, n, sizeof tok[0]);
    if ((rc = fsdp__replace_begin(&r, AT_FDCWD, bin_path, 0666, true, why, sizeof why)) < 0) {
        rc = fsdp__err(b->err, rc, "%s: %s", fn, why);
        goto out;
    }
    if (write_all(r.fd, header, sizeof header) < 0 || write_all(r.fd, tok, n * sizeof *tok) < 0) {
        rc = fsdp__err(b->err, FSDP_EBACKEND, "%s: writing %s: %s", fn, bin_path, strerror(errno));
        fsdp__replace_abort(&r);
        goto out;
    }
    if ((rc = fsdp__replace_commit(&r, why, sizeof why)) < 0) {
        rc = fsdp__err(b->err, rc, "%s: %s", fn, why);
        goto out;
    }
    if (ntokens) *ntokens = n;
out:
    free(text);
    free(ids);
    free(tok);
    return rc;
}
