/* SPDX-License-Identifier: MIT */
/*
 * safetensors_header.c: parsing and validating the JSON header of a safetensors file.
 *
 * The header is parsed by jansson with JSON_REJECT_DUPLICATES, since a JSON object may legally
 * repeat a key and jansson would otherwise keep the last one. Every entry is checked (dtype,
 * shape, data_offsets, and byte counts that cannot overflow), then the layout: the entries must
 * tile the data section exactly. Only a header that passes all of it fills the handle, which
 * from then on trusts its entries for sizes (io_impl.h). A JSON syntax error is reported with
 * the name of the top-level entry it lies in, found by a small scan of the header text (key_at),
 * because jansson's message only quotes the token where it stopped. This is the only file that
 * reads JSON.
 */
#include <stdlib.h>
#include <string.h>

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

const char *fsdp__st_dtype_parse(const char *s, size_t *esize, fsdp_dtype_t *dt) {
    const struct st_dtype *d = s ? dtype_by_name(s) : NULL;
    if (!d) return NULL;
    *esize = d->size;
    *dt = d->dt;
    return d->name;
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
                                st->path, nm, fsdp__st_shape_str(e->shape, e->ndim, sh, sizeof sh));
        numel *= sz;
    }
    e->numel = zero ? 0 : numel;
    if (e->numel > (uint64_t)INT64_MAX / e->esize)
        return fsdp__st_err(st, FSDP_EINVAL,
                            "'%s': tensor '%s': field 'shape' %s of %s overflows: more than 2^63 "
                            "bytes",
                            st->path, nm, fsdp__st_shape_str(e->shape, e->ndim, sh, sizeof sh),
                            e->st_dtype);
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
                            e->st_dtype, fsdp__st_shape_str(e->shape, e->ndim, sh, sizeof sh),
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

int fsdp__st_parse_header(fsdp_safetensors_t *st, const char *hdr, size_t len) {
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
