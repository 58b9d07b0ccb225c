/*
 * safetensors_read.c: opening and validating safetensors files, and reading their tensors.
 *
 * fsdp_safetensors_open() checks the whole file before it returns a handle: header length, JSON
 * (parsed by jansson with JSON_REJECT_DUPLICATES, since a JSON object may legally repeat a key
 * and jansson would otherwise keep the last one), every entry, and the layout of the data
 * section. After that, the handle's entries are trusted for sizes (io_impl.h), and only the
 * results of pread are checked again. A JSON syntax error is reported with the name of the
 * top-level entry it lies in, found by a small scan of the header text (key_at), because
 * jansson's message only quotes the token where it stopped.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "io/io_impl.h"

/* ---- dtypes ------------------------------------------------------------------------------- */

/* Every safetensors dtype with whole-byte elements. The ones libfsdp has no type for can be
 * listed and read raw, not converted. */
static const struct st_dtype {
    const char *name;
    size_t size;
    fsdp_dtype_t dt;
} st_dtypes[] = {
    {"F64", 8, FSDP_DTYPE_F64},       {"F32", 4, FSDP_DTYPE_F32},
    {"F16", 2, FSDP_DTYPE_F16},       {"BF16", 2, FSDP_DTYPE_BF16},
    {"I64", 8, FSDP_DTYPE_I64},       {"I32", 4, FSDP_DTYPE_I32},
    {"U8", 1, FSDP_DTYPE_U8},         {"BOOL", 1, FSDP_DTYPE_BOOL},
    {"I16", 2, FSDP_DTYPE_COUNT},     {"I8", 1, FSDP_DTYPE_COUNT},
    {"U16", 2, FSDP_DTYPE_COUNT},     {"U32", 4, FSDP_DTYPE_COUNT},
    {"U64", 8, FSDP_DTYPE_COUNT},     {"F8_E4M3", 1, FSDP_DTYPE_COUNT},
    {"F8_E5M2", 1, FSDP_DTYPE_COUNT}, {"F8_E8M0", 1, FSDP_DTYPE_COUNT},
    {"C64", 8, FSDP_DTYPE_COUNT},
};
#define N_ST_DTYPES (sizeof st_dtypes / sizeof st_dtypes[0])

const char *fsdp__st_dtype_name(fsdp_dtype_t dt) {
    for (size_t i = 0; i < N_ST_DTYPES; i++)
        if (st_dtypes[i].dt == dt && dt != FSDP_DTYPE_COUNT) return st_dtypes[i].name;
    return NULL;
}

static const struct st_dtype *dtype_by_name(const char *s) {
    for (size_t i = 0; i < N_ST_DTYPES; i++)
        if (strcmp(st_dtypes[i].name, s) == 0) return &st_dtypes[i];
    return NULL;
}

/* ---- errors ------------------------------------------------------------------------------- */

int fsdp__st_err(fsdp_safetensors_t *st, int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fsdp__verr(st->err, rc, fmt, ap);
    va_end(ap);
    if (st->ctx) fsdp__ctx_err(st->ctx, rc, "%s", st->err);
    return rc;
}

const char *fsdp__st_shown(const char *name, char *buf, size_t cap) {
    if (!cap) return buf;
    if (!name) name = "(null)";
    size_t o = 0, lim = cap - 1 < 200 ? cap - 1 : 200;
    for (const unsigned char *p = (const unsigned char *)name; *p && o < lim; p++)
        buf[o++] = (*p < 0x20 || *p == 0x7f) ? '?' : (char)*p;
    buf[o] = 0;
    if (name[o] && o >= 3 && o == lim) memcpy(buf + o - 3, "...", 3);
    return buf;
}

/* "[2, 3]" into buf. */
static const char *shape_str(const int64_t *shape, int nd, char *buf, size_t cap) {
    size_t o = 0;
    buf[0] = 0;
    o += (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < nd && o < cap; d++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
    return buf;
}

/* ---- file access -------------------------------------------------------------------------- */

/* Reads exactly n bytes at off; `what` says what for the message. */
static int pread_all(fsdp_safetensors_t *st, void *buf, size_t n, uint64_t off, const char *what) {
    unsigned char *p = buf;
    while (n > 0) {
        size_t want = n > (1u << 30) ? (1u << 30) : n;
        ssize_t k = pread(st->fd, p, want, (off_t)off);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0)
            return fsdp__st_err(st, FSDP_EINVAL, "'%s': reading %s at byte %llu failed: %s",
                                st->path, what, (unsigned long long)off, strerror(errno));
        if (k == 0)
            return fsdp__st_err(st, FSDP_EINVAL,
                                "'%s': the file ended at byte %llu while reading %s (was it "
                                "truncated after it was opened?)",
                                st->path, (unsigned long long)off, what);
        p += k;
        n -= (size_t)k;
        off += (uint64_t)k;
    }
    return FSDP_OK;
}

/* ---- JSON error location ----------------------------------------------------------------- */

/* Finds the top-level key whose entry holds byte pos of the header (or the key just before pos,
 * for a duplicate key). Returns true with its raw token [*ks, *ke), quotes included, and the
 * nesting depth at pos. */
static bool key_at(const char *h, size_t len, size_t pos, size_t *ks, size_t *ke, int *depth) {
    int d = 0;
    bool in_str = false, esc = false, expect_key = false, is_key = false, top_obj = false;
    bool found = false;
    size_t s0 = 0;
    if (pos > len) pos = len;
    for (size_t i = 0; i < pos; i++) {
        char c = h[i];
        if (in_str) {
            if (esc)
                esc = false;
            else if (c == '\\')
                esc = true;
            else if (c == '"') {
                in_str = false;
                if (is_key && d == 1 && top_obj) {
                    *ks = s0;
                    *ke = i + 1;
                    found = true;
                }
            }
            continue;
        }
        switch (c) {
        case '"':
            in_str = true;
            s0 = i;
            is_key = expect_key;
            expect_key = false;
            break;
        case '{':
            if (d == 0) top_obj = true;
            d++;
            expect_key = true;
            break;
        case '[':
            d++;
            expect_key = false;
            break;
        case '}':
        case ']':
            d--;
            expect_key = false;
            break;
        case ',':
            expect_key = true; /* only read at depth 1, which is an object */
            break;
        case ':':
            expect_key = false;
            break;
        default:
            break;
        }
    }
    *depth = d;
    return found;
}

/* The decoded text of a raw JSON string token, printable, into buf. */
static const char *token_name(const char *tok, size_t len, char *buf, size_t cap) {
    json_error_t e;
    json_t *s = json_loadb(tok, len, JSON_DECODE_ANY, &e);
    if (s && json_is_string(s))
        fsdp__st_shown(json_string_value(s), buf, cap);
    else {
        char raw[256];
        size_t n = len < sizeof raw - 1 ? len : sizeof raw - 1;
        memcpy(raw, tok, n);
        raw[n] = 0;
        fsdp__st_shown(raw, buf, cap);
    }
    json_decref(s);
    return buf;
}

static const char *json_kind(const json_t *j) {
    switch (json_typeof(j)) {
    case JSON_OBJECT:
        return "object";
    case JSON_ARRAY:
        return "array";
    case JSON_STRING:
        return "string";
    case JSON_INTEGER:
        return "integer";
    case JSON_REAL:
        return "number";
    case JSON_TRUE:
    case JSON_FALSE:
        return "boolean";
    case JSON_NULL:
        return "null";
    }
    return "value";
}

static int json_error(fsdp_safetensors_t *st, const char *hdr, size_t len, const json_error_t *je) {
    size_t pos = je->position > 0 ? (size_t)je->position : 0, ks = 0, ke = 0;
    int depth = 0;
    char name[224];
    bool dup = json_error_code(je) == json_error_duplicate_key;
    /* Outside the top-level object (depth 0), no entry is to blame. */
    if (!key_at(hdr, len, pos, &ks, &ke, &depth) || depth < 1)
        return fsdp__st_err(st, FSDP_EINVAL, "'%s': the header is not valid JSON (byte %zu): %s",
                            st->path, pos, je->text);
    token_name(hdr + ks, ke - ks, name, sizeof name);
    if (dup && depth == 1)
        return fsdp__st_err(st, FSDP_EINVAL,
                            "'%s': tensor '%s': the name appears twice in the header (duplicate "
                            "names)",
                            st->path, name);
    return fsdp__st_err(st, FSDP_EINVAL, "'%s': %s '%s': invalid JSON in its entry (byte %zu): %s",
                        st->path, strcmp(name, "__metadata__") == 0 ? "field" : "tensor", name, pos,
                        je->text);
}

/* ---- validation --------------------------------------------------------------------------- */

static int parse_meta(fsdp_safetensors_t *st, json_t *m) {
    if (!json_is_object(m))
        return fsdp__st_err(st, FSDP_EINVAL,
                            "'%s': field '__metadata__' is a JSON %s, not an object of strings",
                            st->path, json_kind(m));
    size_t n = json_object_size(m);
    st->meta_key = calloc(n ? n : 1, sizeof *st->meta_key);
    st->meta_val = calloc(n ? n : 1, sizeof *st->meta_val);
    if (!st->meta_key || !st->meta_val)
        return fsdp__st_err(st, FSDP_ENOMEM, "'%s': out of memory for the metadata", st->path);
    const char *k;
    json_t *v;
    char shown[224];
    json_object_foreach(m, k, v) {
        if (!json_is_string(v))
            return fsdp__st_err(st, FSDP_EINVAL,
                                "'%s': field '__metadata__': entry '%s' is a JSON %s, not a "
                                "string",
                                st->path, fsdp__st_shown(k, shown, sizeof shown), json_kind(v));
        st->meta_key[st->nmeta] = strdup(k);
        st->meta_val[st->nmeta] = strdup(json_string_value(v));
        st->nmeta++;
        if (!st->meta_key[st->nmeta - 1] || !st->meta_val[st->nmeta - 1])
            return fsdp__st_err(st, FSDP_ENOMEM, "'%s': out of memory for the metadata", st->path);
    }
    return FSDP_OK;
}

/* A JSON integer in [0, INT64_MAX] into *out. */
static bool get_nonneg(const json_t *j, int64_t *out) {
    if (!json_is_integer(j) || json_integer_value(j) < 0) return false;
    *out = (int64_t)json_integer_value(j);
    return true;
}

static int parse_entry(fsdp_safetensors_t *st, const char *name, json_t *v,
                       struct fsdp__st_entry *e) {
    char nm[224], sh[256];
    fsdp__st_shown(name, nm, sizeof nm);
    if (!name[0])
        return fsdp__st_err(st, FSDP_EINVAL, "'%s': a tensor has an empty name", st->path);
    if (!json_is_object(v))
        return fsdp__st_err(st, FSDP_EINVAL,
                            "'%s': tensor '%s': its entry is a JSON %s, not an "
                            "object",
                            st->path, nm, json_kind(v));
    const char *k;
    json_t *x;
    json_object_foreach(v, k, x) {
        if (strcmp(k, "dtype") && strcmp(k, "shape") && strcmp(k, "data_offsets")) {
            char ks[224];
            return fsdp__st_err(st, FSDP_EINVAL, "'%s': tensor '%s': unexpected field '%s'",
                                st->path, nm, fsdp__st_shown(k, ks, sizeof ks));
        }
    }
    /* dtype */
    json_t *d = json_object_get(v, "dtype");
    if (!d || !json_is_string(d))
        return fsdp__st_err(st, FSDP_EINVAL, "'%s': tensor '%s': field 'dtype' is %s%s", st->path,
                            nm, d ? "a JSON " : "missing", d ? (json_kind(d)) : "");
    const struct st_dtype *dt = dtype_by_name(json_string_value(d));
    if (!dt) {
        char ds[224];
        return fsdp__st_err(st, FSDP_EINVAL,
                            "'%s': tensor '%s': field 'dtype': \"%s\" is not a safetensors dtype",
                            st->path, nm, fsdp__st_shown(json_string_value(d), ds, sizeof ds));
    }
    e->st_dtype = dt->name;
    e->dtype = dt->dt;
    e->esize = dt->size;
    /* shape */
    json_t *s = json_object_get(v, "shape");
    if (!s || !json_is_array(s))
        return fsdp__st_err(st, FSDP_EINVAL, "'%s': tensor '%s': field 'shape' is %s%s", st->path,
                            nm, s ? "a JSON " : "missing", s ? json_kind(s) : "");
    if (json_array_size(s) > FSDP_MAX_DIMS)
        return fsdp__st_err(st, FSDP_EINVAL,
                            "'%s': tensor '%s': field 'shape' has %zu dimensions (at most %d)",
                            st->path, nm, json_array_size(s), FSDP_MAX_DIMS);
    e->ndim = (int)json_array_size(s);
    bool zero = false;
    for (int i = 0; i < e->ndim; i++) {
        json_t *si = json_array_get(s, (size_t)i);
        if (json_is_integer(si) && json_integer_value(si) < 0)
            return fsdp__st_err(st, FSDP_EINVAL,
                                "'%s': tensor '%s': field 'shape': dimension %d is negative "
                                "(%lld)",
                                st->path, nm, i, (long long)json_integer_value(si));
        if (!get_nonneg(si, &e->shape[i]))
            return fsdp__st_err(st, FSDP_EINVAL,
                                "'%s': tensor '%s': field 'shape': dimension %d is a JSON %s, "
                                "not an integer",
                                st->path, nm, i, json_kind(si));
        if (e->shape[i] == 0) zero = true;
    }
    /* Element and byte counts, refusing any product that overflows 63 bits. Sizes of 0 are
     * left out of the check but not out of the count: [0, 2^40, 2^40] is refused too, so that
     * no stride computed from an accepted shape can overflow. */
    uint64_t numel = 1;
    for (int i = 0; i < e->ndim; i++) {
        uint64_t sz = (uint64_t)e->shape[i];
        if (sz == 0) continue;
        if (numel > (uint64_t)INT64_MAX / sz)
            return fsdp__st_err(st, FSDP_EINVAL,
                                "'%s': tensor '%s': field 'shape' %s overflows: more than 2^63 "
                                "elements",
                                st->path, nm, shape_str(e->shape, e->ndim, sh, sizeof sh));
        numel *= sz;
    }
    e->numel = zero ? 0 : numel;
    if (e->numel > (uint64_t)INT64_MAX / e->esize)
        return fsdp__st_err(st, FSDP_EINVAL,
                            "'%s': tensor '%s': field 'shape' %s of %s overflows: more than 2^63 "
                            "bytes",
                            st->path, nm, shape_str(e->shape, e->ndim, sh, sizeof sh), e->st_dtype);
    uint64_t nbytes = e->numel * e->esize;
    /* data_offsets */
    json_t *o = json_object_get(v, "data_offsets");
    int64_t b = 0, en = 0;
    if (!o || !json_is_array(o) || json_array_size(o) != 2 ||
        !get_nonneg(json_array_get(o, 0), &b) || !get_nonneg(json_array_get(o, 1), &en))
        return fsdp__st_err(st, FSDP_EINVAL,
                            "'%s': tensor '%s': field 'data_offsets' is %s (want [begin, end], "
                            "two non-negative integers)",
                            st->path, nm, !o ? "missing" : "malformed");
    if (b > en)
        return fsdp__st_err(st, FSDP_EINVAL,
                            "'%s': tensor '%s': field 'data_offsets' [%lld, %lld] ends before it "
                            "begins",
                            st->path, nm, (long long)b, (long long)en);
    if ((uint64_t)en > st->data_len)
        return fsdp__st_err(st, FSDP_EINVAL,
                            "'%s': tensor '%s': field 'data_offsets' [%lld, %lld] lies outside "
                            "the data section of %llu bytes",
                            st->path, nm, (long long)b, (long long)en,
                            (unsigned long long)st->data_len);
    if ((uint64_t)(en - b) != nbytes)
        return fsdp__st_err(st, FSDP_EINVAL,
                            "'%s': tensor '%s': field 'data_offsets' [%lld, %lld] holds %lld "
                            "bytes, but dtype %s and shape %s need %llu",
                            st->path, nm, (long long)b, (long long)en, (long long)(en - b),
                            e->st_dtype, shape_str(e->shape, e->ndim, sh, sizeof sh),
                            (unsigned long long)nbytes);
    e->begin = (uint64_t)b;
    e->end = (uint64_t)en;
    e->name = strdup(name);
    if (!e->name) return fsdp__st_err(st, FSDP_ENOMEM, "'%s': out of memory", st->path);
    return FSDP_OK;
}

/* qsort has no user argument, so sorts go through arrays of pointers. */
static int cmp_by_offsets(const void *a, const void *b) {
    const struct fsdp__st_entry *x = *(const struct fsdp__st_entry *const *)a;
    const struct fsdp__st_entry *y = *(const struct fsdp__st_entry *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return x < y ? -1 : x > y;
}

/* The entries must tile [0, data_len): sorted by offsets, each begins where the previous one
 * ended (empty tensors included), as the reference implementation requires. */
static int check_layout(fsdp_safetensors_t *st) {
    if (st->n == 0) {
        if (st->data_len)
            return fsdp__st_err(st, FSDP_EINVAL,
                                "'%s': %llu bytes of trailing data after a header with no "
                                "tensors",
                                st->path, (unsigned long long)st->data_len);
        return FSDP_OK;
    }
    const struct fsdp__st_entry **s = malloc(st->n * sizeof *s);
    if (!s) return fsdp__st_err(st, FSDP_ENOMEM, "'%s': out of memory", st->path);
    for (size_t i = 0; i < st->n; i++)
        s[i] = &st->e[i];
    qsort(s, st->n, sizeof *s, cmp_by_offsets);
    int rc = FSDP_OK;
    uint64_t pos = 0;
    const struct fsdp__st_entry *prev = NULL;
    char a[224], b[224];
    for (size_t i = 0; i < st->n && rc == FSDP_OK; i++) {
        const struct fsdp__st_entry *e = s[i];
        if (e->begin < pos)
            rc = fsdp__st_err(st, FSDP_EINVAL,
                              "'%s': tensor '%s': data_offsets [%llu, %llu] overlap tensor '%s' "
                              "[%llu, %llu]",
                              st->path, fsdp__st_shown(e->name, a, sizeof a),
                              (unsigned long long)e->begin, (unsigned long long)e->end,
                              fsdp__st_shown(prev->name, b, sizeof b),
                              (unsigned long long)prev->begin, (unsigned long long)prev->end);
        else if (e->begin > pos)
            rc = fsdp__st_err(st, FSDP_EINVAL,
                              "'%s': tensor '%s': data_offsets [%llu, %llu] leave a gap of %llu "
                              "bytes before them (the data section must be covered exactly)",
                              st->path, fsdp__st_shown(e->name, a, sizeof a),
                              (unsigned long long)e->begin, (unsigned long long)e->end,
                              (unsigned long long)(e->begin - pos));
        if (e->end > pos) {
            pos = e->end;
            prev = e;
        } else if (!prev) {
            prev = e;
        }
    }
    if (rc == FSDP_OK && pos != st->data_len)
        rc = fsdp__st_err(st, FSDP_EINVAL,
                          "'%s': %llu bytes of trailing data after the last tensor ('%s' ends "
                          "at %llu of %llu)",
                          st->path, (unsigned long long)(st->data_len - pos),
                          fsdp__st_shown(prev->name, a, sizeof a), (unsigned long long)pos,
                          (unsigned long long)st->data_len);
    free(s);
    return rc;
}

static int cmp_names(const void *a, const void *b) {
    return strcmp((*(const struct fsdp__st_entry *const *)a)->name,
                  (*(const struct fsdp__st_entry *const *)b)->name);
}

static int build_index(fsdp_safetensors_t *st) {
    const struct fsdp__st_entry **s = malloc((st->n ? st->n : 1) * sizeof *s);
    st->by_name = malloc((st->n ? st->n : 1) * sizeof *st->by_name);
    if (!s || !st->by_name) {
        free(s);
        return fsdp__st_err(st, FSDP_ENOMEM, "'%s': out of memory", st->path);
    }
    for (size_t i = 0; i < st->n; i++)
        s[i] = &st->e[i];
    qsort(s, st->n, sizeof *s, cmp_names);
    for (size_t i = 0; i < st->n; i++)
        st->by_name[i] = (size_t)(s[i] - st->e);
    free(s);
    return FSDP_OK;
}

static int parse_header(fsdp_safetensors_t *st, const char *hdr, size_t len) {
    json_error_t je;
    json_t *root = json_loadb(hdr, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) return json_error(st, hdr, len, &je);
    int rc = FSDP_OK;
    if (!json_is_object(root)) {
        rc = fsdp__st_err(st, FSDP_EINVAL, "'%s': the header is a JSON %s, not an object", st->path,
                          json_kind(root));
        goto out;
    }
    if (hdr[0] != '{') {
        rc = fsdp__st_err(st, FSDP_EINVAL,
                          "'%s': the header must begin with '{' (it begins with byte 0x%02x)",
                          st->path, (unsigned)(unsigned char)hdr[0]);
        goto out;
    }
    size_t n = json_object_size(root);
    st->e = calloc(n ? n : 1, sizeof *st->e);
    if (!st->e) {
        rc = fsdp__st_err(st, FSDP_ENOMEM, "'%s': out of memory for %zu entries", st->path, n);
        goto out;
    }
    const char *k;
    json_t *v;
    json_object_foreach(root, k, v) {
        if (strcmp(k, "__metadata__") == 0)
            FSDP_TRY(rc, out, parse_meta(st, v));
        else {
            FSDP_TRY(rc, out, parse_entry(st, k, v, &st->e[st->n]));
            st->n++;
        }
    }
    FSDP_TRY(rc, out, check_layout(st));
    rc = build_index(st);
out:
    json_decref(root);
    return rc;
}

/* ---- opening ------------------------------------------------------------------------------ */

int fsdp_safetensors_open(fsdp_ctx_t *ctx, const char *path, fsdp_safetensors_t **out) {
    if (out) *out = NULL;
    if (!path || !out)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_safetensors_open: NULL path or out");
    fsdp_safetensors_t *st = calloc(1, sizeof *st);
    if (!st) return fsdp__ctx_err(ctx, FSDP_ENOMEM, "fsdp_safetensors_open: out of memory");
    st->ctx = ctx;
    st->fd = -1;
    int rc = FSDP_OK;
    char *hdr = NULL;
    st->path = strdup(path);
    if (!st->path) {
        rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "fsdp_safetensors_open: out of memory");
        goto fail_quiet;
    }
    /* O_NONBLOCK: opening a FIFO must not block; fstat then refuses it. */
    st->fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (st->fd < 0) {
        rc = fsdp__st_err(st, FSDP_EINVAL, "'%s': cannot open: %s", path, strerror(errno));
        goto fail;
    }
    struct stat sb;
    if (fstat(st->fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        rc = fsdp__st_err(st, FSDP_EINVAL, "'%s': not a regular file", path);
        goto fail;
    }
    st->file_size = (uint64_t)sb.st_size;
    if (st->file_size < 8) {
        rc = fsdp__st_err(st, FSDP_EINVAL,
                          "'%s': the file has %llu bytes, fewer than the 8 of the header length "
                          "(truncated)",
                          path, (unsigned long long)st->file_size);
        goto fail;
    }
    unsigned char lenb[8];
    FSDP_TRY(rc, fail, pread_all(st, lenb, 8, 0, "the header length"));
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++)
        hlen |= (uint64_t)lenb[i] << (8 * i);
    if (hlen == 0 || hlen > FSDP_SAFETENSORS_MAX_HEADER) {
        rc = fsdp__st_err(st, FSDP_EINVAL, "'%s': header length %llu is %s (the limit is %u bytes)",
                          path, (unsigned long long)hlen, hlen ? "too large" : "zero",
                          FSDP_SAFETENSORS_MAX_HEADER);
        goto fail;
    }
    if (hlen > st->file_size - 8) {
        rc = fsdp__st_err(st, FSDP_EINVAL,
                          "'%s': header length %llu exceeds the %llu bytes that follow it "
                          "(truncated, or not a safetensors file)",
                          path, (unsigned long long)hlen, (unsigned long long)(st->file_size - 8));
        goto fail;
    }
    st->data_start = 8 + hlen;
    st->data_len = st->file_size - st->data_start;
    hdr = malloc((size_t)hlen);
    if (!hdr) {
        rc = fsdp__st_err(st, FSDP_ENOMEM, "'%s': out of memory for a %llu-byte header", path,
                          (unsigned long long)hlen);
        goto fail;
    }
    FSDP_TRY(rc, fail, pread_all(st, hdr, (size_t)hlen, 8, "the header"));
    FSDP_TRY(rc, fail, parse_header(st, hdr, (size_t)hlen));
    free(hdr);
    *out = st;
    return FSDP_OK;
fail:
    if (!ctx) fsdp_log(NULL, FSDP_LOG_ERROR, "fsdp_safetensors_open: %s", st->err);
fail_quiet:
    free(hdr);
    fsdp_safetensors_close(st);
    return rc;
}

void fsdp_safetensors_close(fsdp_safetensors_t *st) {
    if (!st) return;
    if (st->fd >= 0) close(st->fd);
    for (size_t i = 0; i < st->n; i++)
        free(st->e[i].name);
    for (size_t i = 0; i < st->nmeta; i++) {
        free(st->meta_key[i]);
        free(st->meta_val[i]);
    }
    free(st->meta_key);
    free(st->meta_val);
    free(st->e);
    free(st->by_name);
    free(st->path);
    free(st);
}

const char *fsdp_safetensors_last_error(const fsdp_safetensors_t *st) {
    return st ? st->err : "";
}

/* ---- listing ------------------------------------------------------------------------------ */

size_t fsdp_safetensors_count(const fsdp_safetensors_t *st) {
    return st ? st->n : 0;
}

const struct fsdp__st_entry *fsdp__st_lookup(const fsdp_safetensors_t *st, const char *name) {
    size_t lo = 0, hi = st->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(st->e[st->by_name[mid]].name, name);
        if (c == 0) return &st->e[st->by_name[mid]];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

static void fill_info(const fsdp_safetensors_t *st, const struct fsdp__st_entry *e,
                      fsdp_safetensors_info_t *out) {
    memset(out, 0, sizeof *out);
    out->index = (size_t)(e - st->e);
    out->name = e->name;
    out->st_dtype = e->st_dtype;
    out->dtype = e->dtype;
    out->ndim = e->ndim;
    memcpy(out->shape, e->shape, sizeof(int64_t) * (size_t)e->ndim);
    out->numel = (int64_t)e->numel;
    out->offset = st->data_start + e->begin;
    out->nbytes = e->end - e->begin;
}

int fsdp_safetensors_info(const fsdp_safetensors_t *st, size_t i, fsdp_safetensors_info_t *out) {
    if (!st || !out) return FSDP_EINVAL;
    if (i >= st->n)
        return fsdp__st_err((fsdp_safetensors_t *)st, FSDP_EINVAL,
                            "fsdp_safetensors_info: index %zu, but '%s' has %zu tensors", i,
                            st->path, st->n);
    fill_info(st, &st->e[i], out);
    return FSDP_OK;
}

/* The entry called name, or an error naming it. */
static int find_entry(fsdp_safetensors_t *st, const char *fn, const char *name,
                      const struct fsdp__st_entry **out) {
    if (!name) return fsdp__st_err(st, FSDP_EINVAL, "%s: the name is NULL", fn);
    *out = fsdp__st_lookup(st, name);
    if (*out) return FSDP_OK;
    char nm[224];
    return fsdp__st_err(st, FSDP_EINVAL, "%s: '%s' has no tensor '%s'", fn, st->path,
                        fsdp__st_shown(name, nm, sizeof nm));
}

int fsdp_safetensors_find(const fsdp_safetensors_t *st, const char *name,
                          fsdp_safetensors_info_t *out) {
    if (!st || !out) return FSDP_EINVAL;
    const struct fsdp__st_entry *e;
    int rc = find_entry((fsdp_safetensors_t *)st, "fsdp_safetensors_find", name, &e);
    if (rc < 0) return rc;
    fill_info(st, e, out);
    return FSDP_OK;
}

size_t fsdp_safetensors_metadata_count(const fsdp_safetensors_t *st) {
    return st ? st->nmeta : 0;
}

int fsdp_safetensors_metadata_at(const fsdp_safetensors_t *st, size_t i,
                                 fsdp_safetensors_kv_t *out) {
    if (!st || !out) return FSDP_EINVAL;
    if (i >= st->nmeta)
        return fsdp__st_err((fsdp_safetensors_t *)st, FSDP_EINVAL,
                            "fsdp_safetensors_metadata_at: index %zu, but '%s' has %zu metadata "
                            "entries",
                            i, st->path, st->nmeta);
    out->key = st->meta_key[i];
    out->value = st->meta_val[i];
    return FSDP_OK;
}

const char *fsdp_safetensors_metadata(const fsdp_safetensors_t *st, const char *key) {
    if (!st || !key) return NULL;
    for (size_t i = 0; i < st->nmeta; i++)
        if (strcmp(st->meta_key[i], key) == 0) return st->meta_val[i];
    return NULL;
}

/* ---- reading ------------------------------------------------------------------------------ */

int fsdp_safetensors_read_raw(fsdp_safetensors_t *st, const char *name, void *dst, size_t bytes) {
    if (!st) return FSDP_EINVAL;
    const struct fsdp__st_entry *e;
    int rc = find_entry(st, "fsdp_safetensors_read_raw", name, &e);
    if (rc < 0) return rc;
    char nm[224];
    uint64_t nb = e->end - e->begin;
    if ((uint64_t)bytes != nb || (nb && !dst))
        return fsdp__st_err(st, FSDP_EINVAL,
                            "fsdp_safetensors_read_raw: tensor '%s' has %llu bytes, the buffer "
                            "%zu%s",
                            fsdp__st_shown(e->name, nm, sizeof nm), (unsigned long long)nb, bytes,
                            dst ? "" : " (NULL)");
    char what[300];
    snprintf(what, sizeof what, "tensor '%s'", nm);
    return pread_all(st, dst, (size_t)nb, st->data_start + e->begin, what);
}

/* Bytes read per chunk when converting. */
#define CHUNK_BYTES ((size_t)1 << 20)

int fsdp__st_read_entry(fsdp_safetensors_t *st, const struct fsdp__st_entry *e, fsdp_dtype_t dt,
                        void *dst) {
    char nm[224], what[300];
    snprintf(what, sizeof what, "tensor '%s'", fsdp__st_shown(e->name, nm, sizeof nm));
    uint64_t off = st->data_start + e->begin;
    size_t n = (size_t)e->numel;
    if (n == 0) return FSDP_OK;
    if (e->dtype == dt) {
        int rc = pread_all(st, dst, n * e->esize, off, what);
        if (rc < 0) return rc;
        fsdp__swap_le(dst, n, e->esize);
        /* A BOOL byte other than 0 reads as 1, as fsdp_dtype_convert reads it. */
        if (dt == FSDP_DTYPE_BOOL)
            for (unsigned char *p = dst; p < (unsigned char *)dst + n; p++)
                *p = *p != 0;
        return FSDP_OK;
    }
    size_t per = CHUNK_BYTES / e->esize, ds = fsdp_dtype_size(dt);
    void *buf = malloc(per * e->esize);
    if (!buf) return fsdp__st_err(st, FSDP_ENOMEM, "%s: out of memory", what);
    int rc = FSDP_OK;
    for (size_t i = 0; i < n && rc == FSDP_OK; i += per) {
        size_t k = n - i < per ? n - i : per;
        rc = pread_all(st, buf, k * e->esize, off + (uint64_t)i * e->esize, what);
        if (rc < 0) break;
        fsdp__swap_le(buf, k, e->esize);
        rc = fsdp_dtype_convert((char *)dst + i * ds, dt, buf, e->dtype, k);
        if (rc < 0)
            rc = fsdp__st_err(st, rc, "%s: converting %s to %s failed", what, e->st_dtype,
                              fsdp_dtype_name(dt));
    }
    free(buf);
    return rc;
}

/* FSDP_ENOTSUP when libfsdp cannot convert e. */
static int check_convertible(fsdp_safetensors_t *st, const char *fn,
                             const struct fsdp__st_entry *e) {
    if (e->dtype != FSDP_DTYPE_COUNT) return FSDP_OK;
    char nm[224];
    return fsdp__st_err(st, FSDP_ENOTSUP,
                        "%s: '%s': tensor '%s' has dtype %s, which libfsdp cannot convert (read "
                        "it with fsdp_safetensors_read_raw)",
                        fn, st->path, fsdp__st_shown(e->name, nm, sizeof nm), e->st_dtype);
}

int fsdp_safetensors_read(fsdp_safetensors_t *st, const char *name, fsdp_dtype_t dt, void *dst,
                          size_t bytes) {
    static const char fn[] = "fsdp_safetensors_read";
    if (!st) return FSDP_EINVAL;
    const struct fsdp__st_entry *e;
    int rc = find_entry(st, fn, name, &e);
    if (rc < 0) return rc;
    FSDP_TRY(rc, out, check_convertible(st, fn, e));
    char nm[224];
    if (!fsdp_dtype_valid((int)dt))
        return fsdp__st_err(st, FSDP_EINVAL, "%s: tensor '%s': invalid dtype %d", fn,
                            fsdp__st_shown(e->name, nm, sizeof nm), (int)dt);
    uint64_t want = e->numel * fsdp_dtype_size(dt);
    if (e->numel > SIZE_MAX / fsdp_dtype_size(dt) || (uint64_t)bytes != want || (want && !dst))
        return fsdp__st_err(st, FSDP_EINVAL,
                            "%s: tensor '%s' has %llu elements, %llu bytes as %s; the buffer has "
                            "%zu%s",
                            fn, fsdp__st_shown(e->name, nm, sizeof nm),
                            (unsigned long long)e->numel, (unsigned long long)want,
                            fsdp_dtype_name(dt), bytes, dst ? "" : " (NULL)");
    rc = fsdp__st_read_entry(st, e, dt, dst);
out:
    return rc;
}

int fsdp__st_read_into(fsdp_safetensors_t *st, const struct fsdp__st_entry *e, fsdp_tensor_t *dst,
                       bool transpose) {
    fsdp_tensor_t *view = NULL;
    int rc = FSDP_OK;
    char nm[224];
    fsdp_dtype_t dt = fsdp_tensor_dtype(dst);
    size_t bytes = (size_t)e->numel * fsdp_dtype_size(dt);
    void *buf = malloc(bytes ? bytes : 1);
    if (!buf)
        return fsdp__st_err(st, FSDP_ENOMEM, "tensor '%s': out of memory (%zu bytes)",
                            fsdp__st_shown(e->name, nm, sizeof nm), bytes);
    FSDP_TRY(rc, out, fsdp__st_read_entry(st, e, dt, buf));
    if (transpose) {
        /* dst is (b, a); its transposed view has the file's (a, b) shape. */
        rc = fsdp_transpose(dst, 0, 1, &view);
        if (rc < 0) {
            rc = fsdp__st_err(st, rc, "tensor '%s': cannot transpose the destination: %s",
                              fsdp__st_shown(e->name, nm, sizeof nm),
                              fsdp_ctx_last_error(fsdp_tensor_ctx(dst)));
            goto out;
        }
    }
    rc = fsdp_tensor_copy_from_host(view ? view : dst, buf, bytes);
    if (rc < 0)
        rc = fsdp__st_err(st, rc, "tensor '%s': copying into the destination failed: %s",
                          fsdp__st_shown(e->name, nm, sizeof nm),
                          fsdp_ctx_last_error(fsdp_tensor_ctx(dst)));
out:
    fsdp_tensor_release(view);
    free(buf);
    return rc;
}

static bool shape_is(const fsdp_tensor_t *t, const struct fsdp__st_entry *e) {
    if (fsdp_tensor_ndim(t) != e->ndim) return false;
    const int64_t *s = fsdp_tensor_shape(t);
    for (int d = 0; d < e->ndim; d++)
        if (s[d] != e->shape[d]) return false;
    return true;
}

int fsdp_safetensors_read_tensor(fsdp_safetensors_t *st, const char *name, fsdp_tensor_t *dst) {
    static const char fn[] = "fsdp_safetensors_read_tensor";
    if (!st) return FSDP_EINVAL;
    if (!dst) return fsdp__st_err(st, FSDP_EINVAL, "%s: the destination tensor is NULL", fn);
    const struct fsdp__st_entry *e;
    int rc = find_entry(st, fn, name, &e);
    if (rc < 0) return rc;
    FSDP_TRY(rc, out, check_convertible(st, fn, e));
    if (!shape_is(dst, e)) {
        char nm[224], a[256], b[160];
        return fsdp__st_err(
            st, FSDP_EINVAL, "%s: tensor '%s' is %s %s in the file, the destination %s", fn,
            fsdp__st_shown(e->name, nm, sizeof nm), e->st_dtype,
            shape_str(e->shape, e->ndim, a, sizeof a), fsdp_tensor_describe(dst, b, sizeof b));
    }
    rc = fsdp__st_read_into(st, e, dst, false);
out:
    return rc;
}

int fsdp_safetensors_load_tensor(fsdp_safetensors_t *st, const char *name, fsdp_tensor_t **out) {
    static const char fn[] = "fsdp_safetensors_load_tensor";
    if (out) *out = NULL;
    if (!st) return FSDP_EINVAL;
    if (!out) return fsdp__st_err(st, FSDP_EINVAL, "%s: out is NULL", fn);
    if (!st->ctx)
        return fsdp__st_err(st, FSDP_EINVAL,
                            "%s: the handle has no context to create tensors on (open it with "
                            "one)",
                            fn);
    const struct fsdp__st_entry *e;
    int rc = find_entry(st, fn, name, &e);
    if (rc < 0) return rc;
    FSDP_TRY(rc, fail, check_convertible(st, fn, e));
    fsdp_tensor_t *t = NULL;
    rc = fsdp_tensor_empty(st->ctx, e->dtype, e->ndim, e->shape, FSDP_MEM_OTHER, &t);
    if (rc < 0) {
        char nm[224];
        rc = fsdp__st_err(st, rc, "%s: tensor '%s': %s", fn, fsdp__st_shown(e->name, nm, sizeof nm),
                          fsdp_ctx_last_error(st->ctx));
        goto fail;
    }
    rc = fsdp__st_read_into(st, e, t, false);
    if (rc == FSDP_OK) rc = fsdp_tensor_set_name(t, e->name);
    if (rc < 0) {
        fsdp_tensor_release(t);
        goto fail;
    }
    *out = t;
fail:
    return rc;
}
