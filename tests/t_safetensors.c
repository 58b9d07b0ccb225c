/* SPDX-License-Identifier: MIT */
/*
 * t_safetensors.c: the safetensors reader and writer (include/fsdp/safetensors.h).
 *
 * Checks, named after the requirements in the TAP descriptions:
 *   [round trip]   every dtype, empty tensors, 0-d scalars, strided sources, conversions;
 *   [metadata]     string metadata in and out;
 *   [golden]       tests/golden/ref.safetensors, written by hand by gen_safetensors.py
 *                  (numpy + json), read back value for value;
 *   [header length], [json object], [__metadata__], [dtype], [shape], [data_offsets],
 *   [overlap], [length], [duplicates], [trailing]: a hostile corpus built here, every file
 *                  refused with a message naming the tensor or field, plus every truncation of
 *                  a valid file and thousands of corrupted copies (run under ASan in CI);
 *   [atomic write] a writer killed mid-file (SIGXFSZ) and a write that fails (EFBIG) leave the
 *                  previous file whole;
 *   [load]         strict and non-strict loading into named lists and modules: missing,
 *                  unexpected, shape mismatches, tied weights;
 *   [gpt2 hf]      a tiny GPT saved in Hugging Face's layout and loaded back, Conv1D weights
 *                  transposed, HF's extra buffers skipped.
 *
 * `t_safetensors.tap --write FILE` writes the golden tensors with libfsdp's writer and exits;
 * t_safetensors_py.sh checks that file with the Python reader of gen_safetensors.py.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fsdp.h>

#include "tap.h"

#ifndef GOLDEN_DIR
#define GOLDEN_DIR "tests/golden"
#endif

static fsdp_ctx_t *ctx;
static char dir[160];

/* ---- helpers ----------------------------------------------------------------------------- */

static fsdp_ctx_t *new_ctx(uint64_t seed) {
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    o.seed = seed;
    fsdp_ctx_t *c = NULL;
    if (fsdp_ctx_create(&o, &c) < 0) tap_bail("fsdp_ctx_create failed");
    return c;
}

static const char *in_dir(const char *name) {
    static char buf[8][256];
    static int k;
    char *p = buf[k++ % 8];
    snprintf(p, 256, "%s/%s", dir, name);
    return p;
}

static void write_file(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n || fclose(f) != 0) tap_bail("writing %s failed", path);
}

static unsigned char *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *p = malloc(sz > 0 ? (size_t)sz : 1);
    if (!p || fread(p, 1, (size_t)sz, f) != (size_t)sz) tap_bail("reading %s failed", path);
    fclose(f);
    *n = (size_t)sz;
    return p;
}

/* A safetensors file: header length hlen (the JSON's when ~0), JSON, dlen bytes of data. */
static void make_st(const char *path, uint64_t hlen, const char *json, size_t dlen) {
    size_t jl = strlen(json);
    if (hlen == ~(uint64_t)0) hlen = jl;
    unsigned char *b = calloc(1, 8 + jl + dlen + 1);
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)(hlen >> (8 * i));
    memcpy(b + 8, json, jl);
    for (size_t i = 0; i < dlen; i++)
        b[8 + jl + i] = (unsigned char)(i * 7 + 1);
    write_file(path, b, 8 + jl + dlen);
    free(b);
}

static fsdp_tensor_t *from_host(fsdp_ctx_t *c, fsdp_dtype_t dt, int nd, const int64_t *shape,
                                const void *v) {
    fsdp_tensor_t *t = NULL;
    if (fsdp_tensor_from_host(c, dt, nd, shape, v, FSDP_MEM_OTHER, &t) < 0)
        tap_bail("from_host: %s", fsdp_ctx_last_error(c));
    return t;
}

/* A list that owns copies of names and references to tensors. */
static void list_init(fsdp_named_list_t *l, size_t cap) {
    memset(l, 0, sizeof *l);
    l->names = calloc(cap, sizeof *l->names);
    l->tensors = calloc(cap, sizeof *l->tensors);
    l->owned = true;
}

/* Appends (takes the caller's reference to t). */
static void list_add(fsdp_named_list_t *l, const char *name, fsdp_tensor_t *t) {
    l->names[l->n] = strdup(name);
    l->tensors[l->n] = t;
    l->n++;
}

static size_t count_temps(const char *base) {
    DIR *d = opendir(dir);
    size_t n = 0, bl = strlen(base);
    struct dirent *e;
    while (d && (e = readdir(d)))
        if (strncmp(e->d_name, base, bl) == 0 && strncmp(e->d_name + bl, ".tmp-", 5) == 0) n++;
    if (d) closedir(d);
    return n;
}

static void remove_dir(void) {
    DIR *d = opendir(dir);
    struct dirent *e;
    char p[512];
    while (d && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        unlink(p);
    }
    if (d) closedir(d);
    rmdir(dir);
}

/* Whether needle occurs in the n bytes of hay. */
static bool has_bytes(const unsigned char *hay, size_t n, const char *needle) {
    size_t k = strlen(needle);
    for (size_t i = 0; i + k <= n; i++)
        if (memcmp(hay + i, needle, k) == 0) return true;
    return false;
}

static bool same_bytes(const fsdp_tensor_t *a, const fsdp_tensor_t *b) {
    if (fsdp_tensor_dtype(a) != fsdp_tensor_dtype(b) ||
        fsdp_tensor_numel(a) != fsdp_tensor_numel(b))
        return false;
    size_t n = (size_t)fsdp_tensor_numel(a) * fsdp_dtype_size(fsdp_tensor_dtype(a));
    void *x = malloc(n + 1), *y = malloc(n + 1);
    bool ok = fsdp_tensor_to_host(a, x, n) == 0 && fsdp_tensor_to_host(b, y, n) == 0 &&
              memcmp(x, y, n) == 0;
    free(x);
    free(y);
    return ok;
}

/* ---- the golden tensors (mirrors TENSORS and METADATA of gen_safetensors.py) --------------- */

static const float v_f32[] = {-1.5f, -0.75f, 0.0f, 0.75f, 1.5f, 2.25f};
static const double v_f64[] = {1.0 / 3.0, -2.5e300, 3.141592653589793, -0.0};
static const uint16_t v_f16[] = {0x3c00, 0xc100, 0x7bff, 0x0001};
static const uint16_t v_bf16[] = {0x3f80, 0xc049, 0x7180};
static const int32_t v_i32[] = {INT32_MIN, -1, 0, 1, INT32_MAX};
static const int64_t v_i64[] = {INT64_MIN, 1234567890123LL, INT64_MAX};
static const uint8_t v_u8[] = {0, 1, 128, 255};
static const uint8_t v_bool[] = {1, 0, 0, 1};
static const float v_scalar[] = {42.5f};
static const float v_h0w[] = {0.5f, -0.5f, 0x1p-10f, 0x1.8p127f};

static const struct tcase {
    const char *name;
    fsdp_dtype_t dt;
    const char *st;
    int ndim;
    int64_t shape[3];
    const void *data;
} cases[] = {
    {"a.f32", FSDP_DTYPE_F32, "F32", 2, {2, 3}, v_f32},
    {"a.f64", FSDP_DTYPE_F64, "F64", 1, {4}, v_f64},
    {"a.f16", FSDP_DTYPE_F16, "F16", 2, {2, 2}, v_f16},
    {"a.bf16", FSDP_DTYPE_BF16, "BF16", 1, {3}, v_bf16},
    {"a.i32", FSDP_DTYPE_I32, "I32", 1, {5}, v_i32},
    {"a.i64", FSDP_DTYPE_I64, "I64", 1, {3}, v_i64},
    {"a.u8", FSDP_DTYPE_U8, "U8", 1, {4}, v_u8},
    {"a.bool", FSDP_DTYPE_BOOL, "BOOL", 2, {2, 2}, v_bool},
    {"scalar", FSDP_DTYPE_F32, "F32", 0, {0}, v_scalar},
    {"empty", FSDP_DTYPE_F32, "F32", 2, {0, 3}, NULL},
    {"h.0.w", FSDP_DTYPE_F32, "F32", 3, {2, 1, 2}, v_h0w},
};
#define NCASES (sizeof cases / sizeof cases[0])

static const fsdp_safetensors_kv_t golden_meta[] = {
    {"format", "pt"},
    {"producer", "gen_safetensors.py"},
    {"note", "na\xc3\xafve \"quoted\"\n"},
};

static int64_t numel_of(const struct tcase *c) {
    int64_t n = 1;
    for (int d = 0; d < c->ndim; d++)
        n *= c->shape[d];
    return n;
}

static void build_cases(fsdp_ctx_t *c, fsdp_named_list_t *l) {
    list_init(l, NCASES + 4);
    for (size_t i = 0; i < NCASES; i++)
        list_add(l, cases[i].name,
                 from_host(c, cases[i].dt, cases[i].ndim, cases[i].shape, cases[i].data));
}

/* Checks tensor c of an open file: listing, values (as stored and as a new tensor). */
static void check_case(fsdp_safetensors_t *st, const struct tcase *c, const char *tag) {
    fsdp_safetensors_info_t in;
    int rc = fsdp_safetensors_find(st, c->name, &in);
    size_t nb = (size_t)numel_of(c) * fsdp_dtype_size(c->dt);
    bool meta_ok = rc == 0 && in.dtype == c->dt && strcmp(in.st_dtype, c->st) == 0 &&
                   in.ndim == c->ndim && in.numel == numel_of(c) && in.nbytes == nb &&
                   memcmp(in.shape, c->shape, sizeof(int64_t) * (size_t)c->ndim) == 0;
    tap_ok(meta_ok, "[%s] %s: dtype %s, %d dimensions, %zu bytes", tag, c->name, c->st, c->ndim,
           nb);
    void *buf = malloc(nb + 1);
    rc = fsdp_safetensors_read(st, c->name, c->dt, buf, nb);
    tap_ok(rc == 0 && (nb == 0 || memcmp(buf, c->data, nb) == 0),
           "[%s] %s: the values are exactly the ones written", tag, c->name);
    fsdp_tensor_t *t = NULL;
    rc = fsdp_safetensors_load_tensor(st, c->name, &t);
    bool ok = rc == 0 && t && fsdp_tensor_dtype(t) == c->dt && fsdp_tensor_ndim(t) == c->ndim &&
              fsdp_tensor_to_host(t, buf, nb) == 0 && (nb == 0 || memcmp(buf, c->data, nb) == 0);
    tap_ok(ok, "[%s] %s: load_tensor gives the same tensor", tag, c->name);
    fsdp_tensor_release(t);
    free(buf);
}

/* ---- round trip and metadata --------------------------------------------------------------- */

static void test_round_trip(void) {
    fsdp_named_list_t l;
    build_cases(ctx, &l);
    /* A strided source: the transpose of a (2, 3) tensor is written row-major as (3, 2). */
    int64_t s23[2] = {2, 3};
    fsdp_tensor_t *base = from_host(ctx, FSDP_DTYPE_F32, 2, s23, v_f32), *tr = NULL;
    if (fsdp_transpose(base, 0, 1, &tr) < 0) tap_bail("transpose");
    fsdp_tensor_release(base);
    list_add(&l, "strided", tr);
    const char *path = in_dir("rt.safetensors");
    int rc = fsdp_safetensors_save(ctx, path, &l, golden_meta, 3);
    tap_is_int(rc, 0, "[round trip] save every dtype, an empty tensor, a scalar, a strided view");
    if (rc) tap_diag("%s", fsdp_ctx_last_error(ctx));
    fsdp_safetensors_t *st = NULL;
    rc = fsdp_safetensors_open(ctx, path, &st);
    tap_is_int(rc, 0, "[round trip] open what was saved");
    if (rc) {
        tap_diag("%s", fsdp_ctx_last_error(ctx));
        fsdp_named_list_free(&l);
        return;
    }
    tap_is_size(fsdp_safetensors_count(st), NCASES + 1, "[round trip] every tensor is listed");
    bool order = true;
    for (size_t i = 0; i < NCASES + 1; i++) {
        fsdp_safetensors_info_t in;
        order = order && fsdp_safetensors_info(st, i, &in) == 0 && in.index == i &&
                strcmp(in.name, l.names[i]) == 0;
    }
    tap_ok(order, "[round trip] the header lists tensors in the order saved");
    for (size_t i = 0; i < NCASES; i++)
        check_case(st, &cases[i], "round trip");
    float got[6], want[6] = {-1.5f, 0.75f, -0.75f, 1.5f, 0.0f, 2.25f};
    fsdp_safetensors_info_t in;
    rc = fsdp_safetensors_find(st, "strided", &in);
    tap_ok(rc == 0 && in.ndim == 2 && in.shape[0] == 3 && in.shape[1] == 2 &&
               fsdp_safetensors_read(st, "strided", FSDP_DTYPE_F32, got, sizeof got) == 0 &&
               memcmp(got, want, sizeof got) == 0,
           "[round trip] a transposed view is written row-major in its own shape");
    /* Conversions on read. */
    double d[6];
    rc = fsdp_safetensors_read(st, "a.f32", FSDP_DTYPE_F64, d, sizeof d);
    tap_ok(rc == 0 && d[0] == -1.5 && d[5] == 2.25, "[round trip] F32 read as f64");
    float f[3];
    rc = fsdp_safetensors_read(st, "a.bf16", FSDP_DTYPE_F32, f, sizeof f);
    tap_ok(rc == 0 && f[0] == 1.0f && f[1] == -3.140625f && f[2] == 0x1p100f,
           "[round trip] BF16 read as f32");
    int64_t s22[2] = {2, 2};
    fsdp_tensor_t *dst = NULL;
    fsdp_tensor_empty(ctx, FSDP_DTYPE_F64, 2, s22, FSDP_MEM_OTHER, &dst);
    rc = fsdp_safetensors_read_tensor(st, "a.f16", dst);
    double h[4];
    fsdp_tensor_to_host(dst, h, sizeof h);
    tap_ok(rc == 0 && h[0] == 1.0 && h[1] == -2.5 && h[2] == 65504.0 && h[3] == 0x1p-24,
           "[round trip] F16 read into an f64 tensor");
    rc = fsdp_safetensors_read_tensor(st, "a.f32", dst);
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_safetensors_last_error(st), "a.f32"),
           "[round trip] reading into a tensor of another shape is refused, naming the tensor");
    fsdp_tensor_release(dst);
    unsigned char raw[8];
    rc = fsdp_safetensors_read_raw(st, "a.f16", raw, sizeof raw);
    tap_ok(rc == 0 && raw[0] == 0x00 && raw[1] == 0x3c && raw[6] == 0x01 && raw[7] == 0x00,
           "[round trip] read_raw gives the little-endian bytes");
    tap_is_int(fsdp_safetensors_read_raw(st, "a.f16", raw, 7), FSDP_EINVAL,
               "[round trip] read_raw refuses a buffer of the wrong size");
    tap_is_int(fsdp_safetensors_read(st, "nope", FSDP_DTYPE_F32, f, 4), FSDP_EINVAL,
               "[round trip] an absent tensor is an error");
    tap_has_str(fsdp_safetensors_last_error(st), "'nope'",
                "[round trip] the error names the absent tensor");
    fsdp_named_list_t all;
    rc = fsdp_safetensors_load_all(st, &all);
    bool all_ok = rc == 0 && all.n == l.n && all.owned;
    for (size_t i = 0; all_ok && i < l.n; i++)
        all_ok = strcmp(all.names[i], l.names[i]) == 0 && same_bytes(all.tensors[i], l.tensors[i]);
    tap_ok(all_ok, "[round trip] load_all gives every tensor back, in order");
    fsdp_named_list_free(&all);
    fsdp_safetensors_close(st);

    /* Alignment: the data section starts at a multiple of 8, the JSON padded with spaces. */
    size_t n = 0;
    unsigned char *b = read_file(path, &n);
    uint64_t hl = 0;
    for (int i = 0; i < 8; i++)
        hl |= (uint64_t)b[i] << (8 * i);
    bool pad_ok = (8 + hl) % 8 == 0 && b[8] == '{';
    size_t end = 8 + (size_t)hl;
    while (end > 8 && b[end - 1] == ' ')
        end--;
    pad_ok = pad_ok && b[end - 1] == '}' && 8 + hl - end < 8;
    tap_ok(pad_ok, "[alignment] the header is padded with spaces to a multiple of 8 (%llu bytes)",
           (unsigned long long)hl);
    free(b);
    fsdp_named_list_free(&l);
}

static void test_metadata(void) {
    fsdp_safetensors_t *st = NULL;
    int rc = fsdp_safetensors_open(ctx, in_dir("rt.safetensors"), &st);
    if (rc) tap_bail("open rt: %s", fsdp_ctx_last_error(ctx));
    tap_is_size(fsdp_safetensors_metadata_count(st), 3, "[metadata] three entries");
    fsdp_safetensors_kv_t kv;
    bool ok = true;
    for (size_t i = 0; i < 3; i++)
        ok = ok && fsdp_safetensors_metadata_at(st, i, &kv) == 0 &&
             strcmp(kv.key, golden_meta[i].key) == 0 && strcmp(kv.value, golden_meta[i].value) == 0;
    tap_ok(ok, "[metadata] keys and values come back in order, escapes and UTF-8 intact");
    tap_is_str(fsdp_safetensors_metadata(st, "format"), "pt", "[metadata] lookup by key");
    tap_ok(fsdp_safetensors_metadata(st, "absent") == NULL, "[metadata] an absent key is NULL");
    tap_is_int(fsdp_safetensors_metadata_at(st, 3, &kv), FSDP_EINVAL,
               "[metadata] an index out of range is an error");
    fsdp_safetensors_close(st);
    /* No metadata: no __metadata__ key is written at all. */
    int64_t one = 1;
    float x = 1.0f;
    fsdp_named_list_t l;
    list_init(&l, 1);
    list_add(&l, "x", from_host(ctx, FSDP_DTYPE_F32, 1, &one, &x));
    rc = fsdp_safetensors_save(ctx, in_dir("nometa.safetensors"), &l, NULL, 0);
    size_t n = 0;
    unsigned char *b = read_file(in_dir("nometa.safetensors"), &n);
    tap_ok(rc == 0 && b && !has_bytes(b, n, "__metadata__"),
           "[metadata] without metadata, the header has no __metadata__");
    free(b);
    rc = fsdp_safetensors_open(ctx, in_dir("nometa.safetensors"), &st);
    tap_ok(rc == 0 && fsdp_safetensors_metadata_count(st) == 0,
           "[metadata] a file without metadata lists none");
    fsdp_safetensors_close(st);
    /* Bad metadata is refused before anything is written. */
    fsdp_safetensors_kv_t dup[2] = {{"k", "1"}, {"k", "2"}};
    rc = fsdp_safetensors_save(ctx, in_dir("badmeta.safetensors"), &l, dup, 2);
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_ctx_last_error(ctx), "'k'") &&
               access(in_dir("badmeta.safetensors"), F_OK) != 0,
           "[metadata] a duplicate key is refused by name and nothing is written");
    fsdp_safetensors_kv_t bad_utf8[1] = {{"k", "\xff\xfe"}};
    rc = fsdp_safetensors_save(ctx, in_dir("badmeta.safetensors"), &l, bad_utf8, 1);
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_ctx_last_error(ctx), "'k'"),
           "[metadata] a value that is not UTF-8 is refused by key");
    fsdp_named_list_free(&l);
}

/* ---- the golden file ---------------------------------------------------------------------- */

static void test_golden(void) {
    fsdp_safetensors_t *st = NULL;
    int rc = fsdp_safetensors_open(ctx, GOLDEN_DIR "/ref.safetensors", &st);
    tap_is_int(rc, 0, "[golden] open ref.safetensors (written by gen_safetensors.py)");
    if (rc) {
        tap_diag("%s", fsdp_ctx_last_error(ctx));
        return;
    }
    tap_is_size(fsdp_safetensors_count(st), NCASES, "[golden] %zu tensors", NCASES);
    for (size_t i = 0; i < NCASES; i++)
        check_case(st, &cases[i], "golden");
    bool meta = fsdp_safetensors_metadata_count(st) == 3;
    for (size_t i = 0; meta && i < 3; i++) {
        const char *v = fsdp_safetensors_metadata(st, golden_meta[i].key);
        meta = v && strcmp(v, golden_meta[i].value) == 0;
    }
    tap_ok(meta, "[golden] metadata, with JSON escapes (\\u00ef, \\\", \\n), is decoded");
    /* The data section is laid out in reverse header order there. */
    fsdp_safetensors_info_t a, b;
    fsdp_safetensors_info(st, 0, &a);
    fsdp_safetensors_info(st, NCASES - 1, &b);
    tap_ok(a.offset > b.offset, "[golden] data order differs from header order and still reads");
    fsdp_safetensors_close(st);
}

/* ---- the hostile corpus ------------------------------------------------------------------- */

/* Opening path must fail with rc, no handle, and a message holding each non-NULL string. */
static void expect_reject(const char *path, int want, const char *s1, const char *s2,
                          const char *what) {
    fsdp_safetensors_t *st = (fsdp_safetensors_t *)1;
    int rc = fsdp_safetensors_open(ctx, path, &st);
    const char *msg = fsdp_ctx_last_error(ctx);
    bool ok = rc == want && st == NULL && (!s1 || strstr(msg, s1)) && (!s2 || strstr(msg, s2));
    char detail[64];
    snprintf(detail, sizeof detail, "rc %d", rc);
    tap_ok(ok, "%s", what);
    if (!ok) tap_diag("%s; message: %s", detail, msg);
    if (rc == 0) fsdp_safetensors_close(st);
}

struct bad {
    const char *what; /* the TAP description, tagged with the check */
    const char *json;
    size_t dlen;
    const char *s1, *s2; /* what the message must hold */
};

#define W4 "\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}"

static const struct bad corpus[] = {
    {"[json object] an array is refused", "[1,2]", 0, "not an object", NULL},
    {"[json object] a bare number is refused", "42", 0, "not valid JSON", NULL},
    {"[json object] a syntax error names the tensor it is in",
     "{" W4 ",\"v\":{\"dtype\":\"F32\",,}}", 4, "tensor 'v'", "invalid JSON"},
    {"[json object] text after the JSON object is refused", "{" W4 "} x", 4, "not valid JSON",
     NULL},
    {"[json object] a header not starting with '{' is refused", " {" W4 "}", 4, "begin with '{'",
     NULL},
    {"[json object] invalid UTF-8 is refused", "{\"w\xff\":{}}", 0, "JSON", NULL},
    {"[json object] a \\u0000 in a name is refused", "{\"a\\u0000b\":{}}", 0, "JSON", NULL},
    {"[json object] an entry that is not an object is refused by name", "{\"w\":[1]}", 0,
     "tensor 'w'", "not an object"},
    {"[json object] an empty tensor name is refused",
     "{\"\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "empty name", NULL},
    {"[json object] an unexpected field is refused by name",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"strides\":[1]}}", 4,
     "tensor 'w'", "'strides'"},
    {"[__metadata__] an array is refused", "{\"__metadata__\":[1]}", 0, "__metadata__",
     "not an object"},
    {"[__metadata__] a value that is not a string is refused by key",
     "{\"__metadata__\":{\"epoch\":3}}", 0, "__metadata__", "'epoch'"},
    {"[dtype] an unknown dtype is refused by tensor and value",
     "{\"w\":{\"dtype\":\"F17\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "tensor 'w'", "F17"},
    {"[dtype] a dtype that is not a string is refused",
     "{\"w\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "tensor 'w'", "'dtype'"},
    {"[dtype] a missing dtype is refused", "{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
     "tensor 'w'", "'dtype' is missing"},
    {"[shape] a negative size is refused",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[2,-1],\"data_offsets\":[0,4]}}", 4, "tensor 'w'",
     "dimension 1 is negative"},
    {"[shape] a fractional size is refused",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[2.5],\"data_offsets\":[0,4]}}", 4, "tensor 'w'",
     "'shape'"},
    {"[shape] an element count that overflows is refused",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],\"data_offsets\":[0,4]}}", 4,
     "tensor 'w'", "overflows"},
    {"[shape] an overflowing count is refused even beside a size of 0",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[0,4611686018427387904,4],\"data_offsets\":[0,0]}}", 0,
     "tensor 'w'", "overflows"},
    {"[shape] a byte count that overflows is refused",
     "{\"w\":{\"dtype\":\"F64\",\"shape\":[2305843009213693952],\"data_offsets\":[0,4]}}", 4,
     "tensor 'w'", "overflows"},
    {"[shape] a size beyond 64 bits is refused by tensor",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[99999999999999999999],\"data_offsets\":[0,4]}}", 4,
     "tensor 'w'", "too big"},
    {"[shape] nine dimensions are refused",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4,
     "tensor 'w'", "9 dimensions"},
    {"[shape] a missing shape is refused", "{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4,
     "tensor 'w'", "'shape' is missing"},
    {"[data_offsets] an end beyond the data section is refused",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[100],\"data_offsets\":[0,400]}}", 16, "tensor 'w'",
     "outside the data section"},
    {"[data_offsets] reversed offsets are refused",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,4]}}", 8, "tensor 'w'",
     "ends before it begins"},
    {"[data_offsets] a negative offset is refused",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 4, "tensor 'w'",
     "'data_offsets'"},
    {"[data_offsets] one offset is refused",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4]}}", 4, "tensor 'w'",
     "'data_offsets'"},
    {"[data_offsets] missing offsets are refused", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4,
     "tensor 'w'", "'data_offsets' is missing"},
    {"[length] a byte count that does not match dtype and shape is refused",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, "tensor 'w'",
     "need 12"},
    {"[overlap] overlapping tensors are refused, naming both",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
     "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
     12, "tensor 'b'", "overlap tensor 'a'"},
    {"[overlap] two tensors on the same bytes are refused",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
     "\"b\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
     4, "overlap", "'a'"},
    {"[overlap] a gap between tensors is refused",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
     "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
     12, "tensor 'b'", "gap of 4 bytes"},
    {"[duplicates] a tensor name given twice is refused by name", "{" W4 "," W4 "}", 4,
     "tensor 'w'", "appears twice"},
    {"[duplicates] an escaped duplicate (\\u0077 is w) is refused by name",
     "{" W4 ",\"\\u0077\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
     "tensor 'w'", "appears twice"},
    {"[duplicates] a field given twice in an entry is refused by tensor",
     "{\"w\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
     "tensor 'w'", "duplicate"},
    {"[trailing] bytes after the last tensor are refused", "{" W4 "}", 12,
     "8 bytes of trailing data", "'w'"},
    {"[trailing] data after a header without tensors is refused", "{}", 4,
     "4 bytes of trailing data", NULL},
};
#define NCORPUS (sizeof corpus / sizeof corpus[0])

/* Deterministic pseudo-random numbers for the corruption sweep. */
static uint64_t lcg(uint64_t *s) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return *s >> 33;
}

static void test_hostile(void) {
    const char *p = in_dir("bad.safetensors");
    /* Header length. */
    write_file(p, "\x05\x00\x00", 3);
    expect_reject(p, FSDP_EINVAL, "fewer than the 8", NULL,
                  "[header length] a 3-byte file is refused as truncated");
    make_st(p, 0, "", 8);
    expect_reject(p, FSDP_EINVAL, "header length 0", NULL, "[header length] zero is refused");
    make_st(p, (uint64_t)1 << 63, "{}", 0);
    expect_reject(p, FSDP_EINVAL, "9223372036854775808", "limit",
                  "[header length] 2^63 is refused against the cap");
    make_st(p, (uint64_t)FSDP_SAFETENSORS_MAX_HEADER + 1, "{}", 0);
    expect_reject(p, FSDP_EINVAL, "too large", NULL,
                  "[header length] one byte over the 100 MB cap is refused");
    make_st(p, 500, "{" W4 "}", 4);
    expect_reject(p, FSDP_EINVAL, "header length 500 exceeds", NULL,
                  "[header length] a length past the end of the file is refused");
    make_st(p, 10, "{" W4 "}", 4);
    expect_reject(p, FSDP_EINVAL, "JSON", NULL,
                  "[header length] a length that cuts the JSON short is refused");
    for (size_t i = 0; i < NCORPUS; i++) {
        make_st(p, ~(uint64_t)0, corpus[i].json, corpus[i].dlen);
        expect_reject(p, FSDP_EINVAL, corpus[i].s1, corpus[i].s2, corpus[i].what);
    }
    expect_reject(in_dir("does-not-exist"), FSDP_EINVAL, "does-not-exist", "cannot open",
                  "[open] a missing file is refused by path");
    expect_reject(dir, FSDP_EINVAL, "not a regular file", NULL, "[open] a directory is refused");
    if (mkfifo(in_dir("fifo"), 0600) == 0)
        expect_reject(in_dir("fifo"), FSDP_EINVAL, "not a regular file", NULL,
                      "[open] a FIFO is refused without blocking");
    else
        tap_skip(1, "mkfifo failed");

    /* A dtype libfsdp has no type for: listed and readable raw, not converted. */
    make_st(p, ~(uint64_t)0, "{\"i\":{\"dtype\":\"I16\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4);
    fsdp_safetensors_t *st = NULL;
    int rc = fsdp_safetensors_open(ctx, p, &st);
    fsdp_safetensors_info_t in;
    tap_ok(rc == 0 && fsdp_safetensors_info(st, 0, &in) == 0 && in.dtype == FSDP_DTYPE_COUNT &&
               strcmp(in.st_dtype, "I16") == 0 && in.nbytes == 4,
           "[dtype] I16 is listed with its safetensors name and no libfsdp dtype");
    float f[2];
    unsigned char raw[4];
    tap_ok(st && fsdp_safetensors_read(st, "i", FSDP_DTYPE_F32, f, sizeof f) == FSDP_ENOTSUP &&
               strstr(fsdp_safetensors_last_error(st), "'i'") &&
               fsdp_safetensors_read_raw(st, "i", raw, 4) == 0 && raw[0] == 1 && raw[1] == 8,
           "[dtype] I16 cannot be converted (FSDP_ENOTSUP naming it) but reads raw");
    fsdp_safetensors_close(st);

    /* Every truncation of a valid file is refused. */
    size_t n = 0;
    unsigned char *good = read_file(in_dir("rt.safetensors"), &n);
    size_t refused = 0;
    for (size_t len = 0; len < n; len++) {
        write_file(p, good, len);
        st = NULL;
        rc = fsdp_safetensors_open(ctx, p, &st);
        if (rc == FSDP_EINVAL && !st && fsdp_ctx_last_error(ctx)[0]) refused++;
        fsdp_safetensors_close(st);
    }
    tap_is_size(refused, n,
                "[header length] every one of the %zu truncations of a valid file is "
                "refused with a message",
                n);

    /* Corrupted copies: opening either refuses with a message or gives a handle whose every
     * tensor reads; nothing crashes (ASan and UBSan builds check the rest). */
    unsigned char *c = malloc(n);
    uint64_t seed = 12345;
    size_t opened = 0, rejected = 0, bad_reads = 0;
    const int rounds = 3000;
    for (int r = 0; r < rounds; r++) {
        memcpy(c, good, n);
        int flips = 1 + (int)(lcg(&seed) % 3);
        for (int k = 0; k < flips; k++) {
            size_t at = (size_t)(lcg(&seed) % n);
            /* Mostly the header, where parsing happens. */
            if (lcg(&seed) % 4) at = at % (size_t)(8 + 600 < n ? 608 : n);
            c[at] = (unsigned char)lcg(&seed);
        }
        write_file(p, c, n);
        st = NULL;
        rc = fsdp_safetensors_open(ctx, p, &st);
        if (rc == 0) {
            opened++;
            fsdp_named_list_t all;
            int lr = fsdp_safetensors_load_all(st, &all);
            if (lr != 0 && lr != FSDP_ENOTSUP) bad_reads++;
            fsdp_named_list_free(&all);
        } else if (fsdp_ctx_last_error(ctx)[0]) {
            rejected++;
        }
        fsdp_safetensors_close(st);
    }
    tap_ok(opened + rejected == (size_t)rounds && bad_reads == 0,
           "[corruption] %d corrupted copies: %zu refused with a message, %zu valid and readable",
           rounds, rejected, opened);
    free(c);

    /* A file that shrinks after it was opened: the read fails cleanly. */
    write_file(p, good, n);
    rc = fsdp_safetensors_open(ctx, p, &st);
    if (rc) tap_bail("open: %s", fsdp_ctx_last_error(ctx));
    if (truncate(p, (off_t)(n - 10)) != 0) tap_bail("truncate: %s", strerror(errno));
    float last[6];
    rc = fsdp_safetensors_read(st, "strided", FSDP_DTYPE_F32, last, sizeof last);
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_safetensors_last_error(st), "'strided'") &&
               strstr(fsdp_safetensors_last_error(st), "truncated after it was opened"),
           "[length] a file truncated after opening fails the read, naming the tensor");
    fsdp_safetensors_close(st);
    free(good);

    /* Without a context, a refused open still returns cleanly (the reason is logged). */
    make_st(p, ~(uint64_t)0, "[1]", 0);
    st = (fsdp_safetensors_t *)1;
    tap_ok(fsdp_safetensors_open(NULL, p, &st) == FSDP_EINVAL && st == NULL,
           "[open] a NULL context is allowed; the error is still returned");
}

/* ---- atomic writes ------------------------------------------------------------------------ */

/* A list of one f32 tensor "w" of n elements, all equal to v. */
static void one_tensor(fsdp_named_list_t *l, int64_t n, float v) {
    float *x = malloc((size_t)n * sizeof *x);
    for (int64_t i = 0; i < n; i++)
        x[i] = v;
    list_init(l, 1);
    list_add(l, "w", from_host(ctx, FSDP_DTYPE_F32, 1, &n, x));
    free(x);
}

/* Whether path holds "w" of n elements all equal to v. */
static bool holds(const char *path, int64_t n, float v) {
    fsdp_safetensors_t *st = NULL;
    if (fsdp_safetensors_open(ctx, path, &st) != 0) return false;
    fsdp_safetensors_info_t in;
    bool ok = fsdp_safetensors_find(st, "w", &in) == 0 && in.numel == n;
    float *x = malloc((size_t)n * sizeof *x);
    ok = ok && fsdp_safetensors_read(st, "w", FSDP_DTYPE_F32, x, (size_t)n * sizeof *x) == 0;
    for (int64_t i = 0; ok && i < n; i++)
        ok = x[i] == v;
    free(x);
    fsdp_safetensors_close(st);
    return ok;
}

static void test_atomic(void) {
    const char *path = in_dir("ckpt.safetensors");
    fsdp_named_list_t v1, v2;
    one_tensor(&v1, 16, 1.0f);
    one_tensor(&v2, 1 << 16, 2.0f); /* 256 KiB */
    tap_is_int(fsdp_safetensors_save(ctx, path, &v1, NULL, 0), 0, "[atomic write] save v1");
    tap_is_size(count_temps("ckpt.safetensors"), 0,
                "[atomic write] a successful save leaves no temporary file");

    /* A writer killed part-way: the file size limit raises SIGXFSZ in the child. */
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        struct rlimit rl = {0, 0};
        setrlimit(RLIMIT_CORE, &rl); /* SIGXFSZ dumps core by default; no core file here */
        getrlimit(RLIMIT_FSIZE, &rl);
        rl.rlim_cur = 64 * 1024;
        setrlimit(RLIMIT_FSIZE, &rl);
        signal(SIGXFSZ, SIG_DFL);
        int rc = fsdp_safetensors_save(ctx, path, &v2, NULL, 0);
        _exit(rc == 0 ? 0 : 3);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    tap_ok(WIFSIGNALED(status) && WTERMSIG(status) == SIGXFSZ,
           "[atomic write] simulated crash: the writer dies in the middle of the data");
    tap_is_size(count_temps("ckpt.safetensors"), 1,
                "[atomic write] the crash leaves its temporary file behind");
    tap_ok(holds(path, 16, 1.0f),
           "[atomic write] after the crash the previous file is whole and opens");

    /* A write that fails (EFBIG) in this process: an error, old file intact, temp removed. */
    struct rlimit old, rl;
    getrlimit(RLIMIT_FSIZE, &old);
    rl = old;
    rl.rlim_cur = 64 * 1024;
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    setrlimit(RLIMIT_FSIZE, &rl);
    int rc = fsdp_safetensors_save(ctx, path, &v2, NULL, 0);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, prev);
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_ctx_last_error(ctx), "writing tensor 'w' failed"),
           "[atomic write] a failed write is an error naming the tensor");
    if (rc != FSDP_EINVAL) tap_diag("rc %d: %s", rc, fsdp_ctx_last_error(ctx));
    tap_ok(holds(path, 16, 1.0f), "[atomic write] after a failed write the previous file is whole");
    tap_is_size(count_temps("ckpt.safetensors"), 1,
                "[atomic write] the failed write removed its own temporary file");

    /* The stale temporary file does not get in the way of the next save. */
    tap_is_int(fsdp_safetensors_save(ctx, path, &v2, NULL, 0), 0,
               "[atomic write] the next save succeeds beside the stale temporary file");
    tap_ok(holds(path, 1 << 16, 2.0f), "[atomic write] and replaces the file");

    /* Refused arguments leave the file alone. */
    fsdp_named_list_t dup;
    list_init(&dup, 2);
    list_add(&dup, "w", fsdp_tensor_retain(v1.tensors[0]));
    list_add(&dup, "w", fsdp_tensor_retain(v1.tensors[0]));
    rc = fsdp_safetensors_save(ctx, path, &dup, NULL, 0);
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_ctx_last_error(ctx), "'w'") &&
               holds(path, 1 << 16, 2.0f),
           "[duplicates] saving a name twice is refused by name; the file is untouched");
    free(dup.names[1]);
    dup.names[1] = strdup("__metadata__");
    rc = fsdp_safetensors_save(ctx, path, &dup, NULL, 0);
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_ctx_last_error(ctx), "reserved"),
           "[json object] a tensor called __metadata__ is refused");
    fsdp_named_list_free(&dup);
    rc = fsdp_safetensors_save(ctx, in_dir("no/such/dir/x.safetensors"), &v1, NULL, 0);
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_ctx_last_error(ctx), "no/such/dir"),
           "[atomic write] a missing directory is an error naming the path");
    tap_is_size(count_temps("ckpt.safetensors"), 1, "[atomic write] no temporary file was added");
    fsdp_named_list_free(&v1);
    fsdp_named_list_free(&v2);
}

/* ---- loading into lists and modules -------------------------------------------------------- */

static fsdp_module_t *mlp(fsdp_ctx_t *c) {
    fsdp_module_t *seq = NULL, *a = NULL, *b = NULL;
    if (fsdp_sequential_create(c, &seq) < 0 || fsdp_linear_create(c, 3, 4, true, &a) < 0 ||
        fsdp_linear_create(c, 4, 2, true, &b) < 0 || fsdp_module_append(seq, a) < 0 ||
        fsdp_module_append(seq, b) < 0)
        tap_bail("mlp: %s", fsdp_ctx_last_error(c));
    fsdp_module_release(a);
    fsdp_module_release(b);
    return seq;
}

/* Whether every state-dict entry of a and b holds the same bytes. */
static bool same_state(const fsdp_module_t *a, const fsdp_module_t *b) {
    fsdp_named_list_t x, y;
    if (fsdp_module_state_dict(a, &x) || fsdp_module_state_dict(b, &y)) return false;
    bool ok = x.n == y.n;
    for (size_t i = 0; ok && i < x.n; i++)
        ok = strcmp(x.names[i], y.names[i]) == 0 && same_bytes(x.tensors[i], y.tensors[i]);
    fsdp_named_list_free(&x);
    fsdp_named_list_free(&y);
    return ok;
}

/* A copy of m's state dict (an owned list of clones). */
static void snapshot(const fsdp_module_t *m, fsdp_named_list_t *out) {
    fsdp_named_list_t sd;
    fsdp_module_state_dict(m, &sd);
    list_init(out, sd.n ? sd.n : 1);
    for (size_t i = 0; i < sd.n; i++) {
        fsdp_tensor_t *t = NULL;
        fsdp_tensor_clone(sd.tensors[i], FSDP_MEM_OTHER, &t);
        list_add(out, sd.names[i], t);
    }
    fsdp_named_list_free(&sd);
}

/* Whether m still holds the values of snapshot s. */
static bool unchanged(const fsdp_module_t *m, const fsdp_named_list_t *s) {
    fsdp_named_list_t sd;
    fsdp_module_state_dict(m, &sd);
    bool ok = sd.n == s->n;
    for (size_t i = 0; ok && i < sd.n; i++)
        ok = strcmp(sd.names[i], s->names[i]) == 0 && same_bytes(sd.tensors[i], s->tensors[i]);
    fsdp_named_list_free(&sd);
    return ok;
}

/* Writes m's state dict without entry `drop` (may be NULL) and with an extra entry `extra`. */
static void save_variant(const fsdp_module_t *m, const char *path, const char *drop,
                         const char *extra) {
    fsdp_named_list_t sd;
    fsdp_module_state_dict(m, &sd);
    fsdp_named_list_t l;
    list_init(&l, sd.n + 1);
    for (size_t i = 0; i < sd.n; i++)
        if (!drop || strcmp(sd.names[i], drop) != 0)
            list_add(&l, sd.names[i], fsdp_tensor_retain(sd.tensors[i]));
    if (extra) {
        int64_t one = 1;
        float x = 7.0f;
        list_add(&l, extra, from_host(fsdp_module_ctx(m), FSDP_DTYPE_F32, 1, &one, &x));
    }
    if (fsdp_safetensors_save(NULL, path, &l, NULL, 0) != 0)
        tap_bail("save_variant: %s", fsdp_ctx_last_error(fsdp_module_ctx(m)));
    fsdp_named_list_free(&l);
    fsdp_named_list_free(&sd);
}

static void test_load(void) {
    fsdp_ctx_t *c1 = new_ctx(1), *c2 = new_ctx(2);
    fsdp_module_t *a = mlp(c1), *b = mlp(c2);
    const char *path = in_dir("mlp.safetensors");
    tap_is_int(fsdp_safetensors_save_module(a, path, NULL, 0), 0, "[load] save a module");
    tap_ok(!same_state(a, b), "[load] two differently seeded modules differ");
    fsdp_safetensors_t *st = NULL;
    fsdp_safetensors_open(c2, path, &st);
    tap_is_int(fsdp_safetensors_load_module(st, b, true), 0, "[load] strict load into a module");
    tap_ok(same_state(a, b), "[load] the module now holds the saved values");
    fsdp_safetensors_close(st);

    /* Missing. */
    fsdp_module_t *c = mlp(c2);
    fsdp_named_list_t snap0;
    snapshot(c, &snap0);
    save_variant(a, path, "1.bias", NULL);
    fsdp_safetensors_open(c2, path, &st);
    int rc = fsdp_safetensors_load_module(st, c, true);
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_safetensors_last_error(st), "1 missing") &&
               strstr(fsdp_safetensors_last_error(st), "\"1.bias\""),
           "[missing] a strict load names the missing tensor");
    tap_ok(unchanged(c, &snap0), "[missing] and loads nothing");
    fsdp_named_list_free(&snap0);
    rc = fsdp_safetensors_load_module(st, c, false);
    tap_ok(rc == 0 && strstr(fsdp_ctx_last_error(c2), "\"1.bias\""),
           "[missing] a non-strict load succeeds and reports the name");
    fsdp_named_list_t sa, sc;
    fsdp_module_state_dict(a, &sa);
    fsdp_module_state_dict(c, &sc);
    tap_ok(same_bytes(sa.tensors[0], sc.tensors[0]) && !same_bytes(sa.tensors[3], sc.tensors[3]),
           "[missing] the others are loaded, the missing one keeps its value");
    fsdp_named_list_free(&sa);
    fsdp_named_list_free(&sc);
    fsdp_safetensors_close(st);

    /* Unexpected. */
    save_variant(a, path, NULL, "extra.scale");
    fsdp_safetensors_open(c2, path, &st);
    rc = fsdp_safetensors_load_module(st, b, true);
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_safetensors_last_error(st), "1 unexpected") &&
               strstr(fsdp_safetensors_last_error(st), "\"extra.scale\""),
           "[unexpected] a strict load names the unexpected tensor");
    tap_is_int(fsdp_safetensors_load_module(st, b, false), 0,
               "[unexpected] a non-strict load ignores it");
    fsdp_safetensors_close(st);

    /* Shape mismatch: always an error, nothing written. */
    fsdp_module_t *d = NULL;
    fsdp_linear_create(c1, 3, 5, true, &d);
    fsdp_named_list_t sd;
    fsdp_module_state_dict(d, &sd);
    free(sd.names[0]);
    sd.names[0] = strdup("0.weight");
    free(sd.names[1]);
    sd.names[1] = strdup("0.bias");
    fsdp_safetensors_save(c1, path, &sd, NULL, 0);
    fsdp_named_list_free(&sd);
    fsdp_module_release(d);
    fsdp_module_t *e = mlp(c2);
    fsdp_named_list_t snap;
    snapshot(e, &snap);
    fsdp_safetensors_open(c2, path, &st);
    rc = fsdp_safetensors_load_module(st, e, false);
    tap_ok(rc == FSDP_EINVAL &&
               strstr(fsdp_safetensors_last_error(st), "\"0.weight\" (file F32 [5, 3]"),
           "[load] a shape mismatch is an error even without strict, naming the tensor");
    tap_ok(unchanged(e, &snap), "[load] and the module is untouched");
    fsdp_named_list_free(&snap);
    fsdp_safetensors_close(st);
    fsdp_module_release(e);

    /* Dtype conversion: bf16 in the file, f32 in the module. */
    fsdp_module_state_dict(a, &sd);
    fsdp_named_list_t low;
    list_init(&low, sd.n);
    for (size_t i = 0; i < sd.n; i++) {
        fsdp_tensor_t *t = NULL;
        fsdp_to_dtype(sd.tensors[i], FSDP_DTYPE_BF16, &t);
        list_add(&low, sd.names[i], t);
    }
    fsdp_safetensors_save(c1, path, &low, NULL, 0);
    fsdp_safetensors_open(c2, path, &st);
    rc = fsdp_safetensors_load_module(st, c, true);
    fsdp_named_list_t sc2;
    fsdp_module_state_dict(c, &sc2);
    bool conv = rc == 0;
    for (size_t i = 0; conv && i < sd.n; i++) {
        fsdp_tensor_t *t = NULL;
        fsdp_to_dtype(low.tensors[i], FSDP_DTYPE_F32, &t);
        conv = same_bytes(t, sc2.tensors[i]);
        fsdp_tensor_release(t);
    }
    tap_ok(conv, "[load] BF16 tensors load into f32 parameters, converted");
    fsdp_named_list_free(&sc2);
    fsdp_named_list_free(&low);
    fsdp_named_list_free(&sd);
    fsdp_safetensors_close(st);

    /* A tied weight is saved once and satisfies both names on a strict load. */
    fsdp_module_t *t1 = mlp(c1), *t2 = mlp(c2);
    fsdp_module_add_param(t1, "tied", fsdp_module_param(t1, "0.weight"));
    fsdp_module_add_param(t2, "tied", fsdp_module_param(t2, "0.weight"));
    fsdp_safetensors_save_module(t1, path, NULL, 0);
    fsdp_safetensors_open(c2, path, &st);
    fsdp_safetensors_info_t in;
    tap_ok(fsdp_safetensors_count(st) == 4 && fsdp_safetensors_find(st, "0.weight", &in) != 0,
           "[load] save_module writes a tied weight once, under its first name");
    tap_is_int(fsdp_safetensors_load_module(st, t2, true), 0,
               "[load] a strict load accepts the alias as present");
    tap_ok(same_state(t1, t2), "[load] and both names hold the values");
    fsdp_safetensors_close(st);
    fsdp_module_release(t1);
    fsdp_module_release(t2);

    /* A named list, not a module: plain tensors of the caller's. */
    fsdp_named_list_t l;
    list_init(&l, 1);
    int64_t s42[2] = {4, 3};
    fsdp_tensor_t *w = NULL;
    fsdp_tensor_zeros(c2, FSDP_DTYPE_F64, 2, s42, FSDP_MEM_OTHER, &w);
    list_add(&l, "0.weight", w);
    save_variant(a, path, NULL, NULL);
    fsdp_safetensors_open(c2, path, &st);
    rc = fsdp_safetensors_load_into(st, &l, false);
    double wv[12];
    float av[12];
    fsdp_tensor_to_host(w, wv, sizeof wv);
    fsdp_tensor_to_host(fsdp_module_param(a, "0.weight"), av, sizeof av);
    bool eq = rc == 0;
    for (int i = 0; eq && i < 12; i++)
        eq = wv[i] == (double)av[i];
    tap_ok(eq, "[load] load_into fills a caller's f64 tensor by name");
    tap_is_int(fsdp_safetensors_load_into(st, &l, true), FSDP_EINVAL,
               "[unexpected] load_into with strict refuses the file's other names");
    fsdp_safetensors_close(st);
    fsdp_named_list_free(&l);

    fsdp_module_release(a);
    fsdp_module_release(b);
    fsdp_module_release(c);
    fsdp_ctx_destroy(c1);
    fsdp_ctx_destroy(c2);
}

/* ---- Hugging Face GPT-2 -------------------------------------------------------------------- */

static fsdp_module_t *tiny_gpt(fsdp_ctx_t *c) {
    fsdp_gpt_config_t cfg;
    fsdp_gpt_config_init(&cfg);
    cfg.vocab = 11;
    cfg.max_seq = 8;
    cfg.n_layer = 2;
    cfg.n_head = 2;
    cfg.d_model = 8;
    fsdp_module_t *m = NULL;
    if (fsdp_gpt_create(c, &cfg, &m) < 0) tap_bail("gpt_create: %s", fsdp_ctx_last_error(c));
    return m;
}

static void test_gpt2_names(void) {
    char buf[128];
    tap_ok(fsdp_gpt2_hf_name("h.0.attn.c_attn.weight", buf, sizeof buf) == 0 &&
               strcmp(buf, "transformer.h.0.attn.c_attn.weight") == 0,
           "[gpt2 hf] h.0.attn.c_attn.weight is transformer.h.0.attn.c_attn.weight");
    tap_is_int(fsdp_gpt2_hf_name("wte.weight", buf, 10), FSDP_EINVAL,
               "[gpt2 hf] a name that does not fit is an error");
    tap_ok(fsdp_gpt2_name_from_hf("transformer.ln_f.bias", buf, sizeof buf) == 0 &&
               strcmp(buf, "ln_f.bias") == 0,
           "[gpt2 hf] transformer.ln_f.bias maps to ln_f.bias");
    tap_ok(fsdp_gpt2_name_from_hf("h.11.mlp.c_fc.bias", buf, sizeof buf) == 0 &&
               strcmp(buf, "h.11.mlp.c_fc.bias") == 0,
           "[gpt2 hf] GPT2Model names (no prefix) map to themselves");
    tap_ok(fsdp_gpt2_name_from_hf("transformer.h.3.attn.bias", buf, sizeof buf) == 1 &&
               fsdp_gpt2_name_from_hf("h.0.attn.masked_bias", buf, sizeof buf) == 1 &&
               fsdp_gpt2_name_from_hf("lm_head.weight", buf, sizeof buf) == 1,
           "[gpt2 hf] attn.bias, attn.masked_bias and lm_head.weight are skipped");
    tap_ok(fsdp_gpt2_hf_is_conv1d("h.0.attn.c_attn.weight") &&
               fsdp_gpt2_hf_is_conv1d("h.12.attn.c_proj.weight") &&
               fsdp_gpt2_hf_is_conv1d("h.1.mlp.c_fc.weight") &&
               fsdp_gpt2_hf_is_conv1d("h.1.mlp.c_proj.weight"),
           "[gpt2 hf] the four Conv1D weights are recognised");
    tap_ok(!fsdp_gpt2_hf_is_conv1d("h.0.attn.c_attn.bias") &&
               !fsdp_gpt2_hf_is_conv1d("h.0.ln_1.weight") &&
               !fsdp_gpt2_hf_is_conv1d("wte.weight") &&
               !fsdp_gpt2_hf_is_conv1d("h.x.attn.c_attn.weight") &&
               !fsdp_gpt2_hf_is_conv1d("hh.0.attn.c_attn.weight"),
           "[gpt2 hf] biases, norms, embeddings and malformed names are not Conv1D");
}

/* Logits of m for a fixed sequence, as host floats (caller frees). */
static float *logits_of(fsdp_module_t *m, size_t *n) {
    int64_t shape[2] = {1, 5};
    int64_t tok[5] = {1, 4, 9, 0, 10};
    fsdp_tensor_t *t = from_host(fsdp_module_ctx(m), FSDP_DTYPE_I64, 2, shape, tok), *y = NULL;
    if (fsdp_gpt_forward(m, t, &y) < 0)
        tap_bail("gpt forward: %s", fsdp_ctx_last_error(fsdp_module_ctx(m)));
    *n = (size_t)fsdp_tensor_numel(y);
    float *v = malloc(*n * sizeof *v);
    fsdp_tensor_to_host(y, v, *n * sizeof *v);
    fsdp_tensor_release(y);
    fsdp_tensor_release(t);
    return v;
}

/* Saves `src` (an open HF file) renamed/extended: strip the prefix, add HF's extras, or
 * replace one tensor by its transpose. */
enum variant { V_EXTRAS, V_NO_PREFIX, V_UNTRANSPOSED, V_BOTH_NAMES };

static void hf_variant(fsdp_ctx_t *c, fsdp_safetensors_t *src, enum variant v, const char *path) {
    fsdp_named_list_t all, l;
    if (fsdp_safetensors_load_all(src, &all) != 0) tap_bail("load_all");
    list_init(&l, all.n + 8);
    for (size_t i = 0; i < all.n; i++) {
        const char *name = all.names[i];
        fsdp_tensor_t *t = fsdp_tensor_retain(all.tensors[i]);
        if (v == V_NO_PREFIX && strncmp(name, "transformer.", 12) == 0) name += 12;
        if (v == V_UNTRANSPOSED && strcmp(name, "transformer.h.1.mlp.c_fc.weight") == 0) {
            fsdp_tensor_t *tt = NULL;
            fsdp_transpose(t, 0, 1, &tt);
            fsdp_tensor_release(t);
            t = tt;
        }
        list_add(&l, name, t);
    }
    if (v == V_EXTRAS) {
        int64_t ms[4] = {1, 1, 8, 8}, one = 1;
        fsdp_tensor_t *mask = NULL, *mb = NULL, *head = NULL;
        fsdp_tensor_full(c, FSDP_DTYPE_U8, 4, ms, 1, FSDP_MEM_OTHER, &mask);
        fsdp_tensor_full(c, FSDP_DTYPE_F32, 1, &one, -1e4, FSDP_MEM_OTHER, &mb);
        fsdp_safetensors_load_tensor(src, "transformer.wte.weight", &head);
        list_add(&l, "transformer.h.0.attn.bias", mask);
        fsdp_tensor_t *mask2 = NULL;
        fsdp_tensor_clone(mask, FSDP_MEM_OTHER, &mask2);
        list_add(&l, "transformer.h.1.attn.bias", mask2);
        list_add(&l, "transformer.h.0.attn.masked_bias", mb);
        list_add(&l, "lm_head.weight", head);
    }
    if (v == V_BOTH_NAMES) {
        fsdp_tensor_t *t = NULL;
        fsdp_safetensors_load_tensor(src, "transformer.wte.weight", &t);
        list_add(&l, "wte.weight", t);
    }
    if (fsdp_safetensors_save(c, path, &l, NULL, 0) != 0)
        tap_bail("hf_variant: %s", fsdp_ctx_last_error(c));
    fsdp_named_list_free(&l);
    fsdp_named_list_free(&all);
}

static void test_gpt2(void) {
    test_gpt2_names();
    fsdp_ctx_t *c1 = new_ctx(11), *c2 = new_ctx(22);
    fsdp_module_t *a = tiny_gpt(c1), *b = tiny_gpt(c2);
    const char *path = in_dir("gpt2.safetensors");
    fsdp_safetensors_kv_t meta[1] = {{"step", "100"}};
    int rc = fsdp_gpt2_hf_save(a, path, meta, 1);
    tap_is_int(rc, 0, "[gpt2 hf] save a tiny GPT in Hugging Face's layout");
    if (rc) tap_diag("%s", fsdp_ctx_last_error(c1));
    fsdp_safetensors_t *st = NULL;
    if (fsdp_safetensors_open(c2, path, &st) != 0) tap_bail("open: %s", fsdp_ctx_last_error(c2));
    fsdp_named_list_t sd;
    fsdp_module_state_dict(a, &sd);
    bool names = fsdp_safetensors_count(st) == sd.n;
    for (size_t i = 0; names && i < fsdp_safetensors_count(st); i++) {
        fsdp_safetensors_info_t in;
        fsdp_safetensors_info(st, i, &in);
        names = strncmp(in.name, "transformer.", 12) == 0 && strcmp(in.name + 12, sd.names[i]) == 0;
    }
    tap_ok(names, "[gpt2 hf] every parameter is written once, under transformer.<name>");
    fsdp_safetensors_info_t in;
    tap_ok(fsdp_safetensors_find(st, "lm_head.weight", &in) != 0,
           "[gpt2 hf] no lm_head.weight is written (it is tied to wte)");
    tap_ok(fsdp_safetensors_metadata(st, "format") &&
               !strcmp(fsdp_safetensors_metadata(st, "format"), "pt") &&
               fsdp_safetensors_metadata(st, "step") &&
               !strcmp(fsdp_safetensors_metadata(st, "step"), "100"),
           "[gpt2 hf] metadata has format=pt and the caller's entries");
    rc = fsdp_safetensors_find(st, "transformer.h.0.attn.c_attn.weight", &in);
    tap_ok(rc == 0 && in.ndim == 2 && in.shape[0] == 8 && in.shape[1] == 24,
           "[gpt2 hf] c_attn.weight is stored (in, out) = (8, 24), Conv1D's layout");
    float file[8 * 24], ours[24 * 8];
    fsdp_safetensors_read(st, "transformer.h.0.attn.c_attn.weight", FSDP_DTYPE_F32, file,
                          sizeof file);
    fsdp_tensor_to_host(fsdp_module_param(a, "h.0.attn.c_attn.weight"), ours, sizeof ours);
    tap_ok(file[3 * 24 + 17] == ours[17 * 8 + 3] && file[3 * 24 + 17] != 0.0f,
           "[gpt2 hf] Conv1D transposition: file[3][17] == ours[17][3] (%g)",
           (double)file[3 * 24 + 17]);
    int bad = 0;
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 24; j++)
            bad += file[i * 24 + j] != ours[j * 8 + i];
    tap_is_int(bad, 0, "[gpt2 hf] Conv1D transposition holds for every element of c_attn");
    rc = fsdp_safetensors_find(st, "transformer.h.1.mlp.c_proj.weight", &in);
    tap_ok(rc == 0 && in.shape[0] == 32 && in.shape[1] == 8,
           "[gpt2 hf] mlp.c_proj.weight is stored (d_ff, d) = (32, 8)");
    rc = fsdp_safetensors_find(st, "transformer.wte.weight", &in);
    tap_ok(rc == 0 && in.shape[0] == 11 && in.shape[1] == 8,
           "[gpt2 hf] wte.weight keeps its (vocab, d) shape");

    tap_ok(!same_state(a, b), "[gpt2 hf] a fresh GPT starts with other weights");
    rc = fsdp_gpt2_hf_load(b, st, true);
    tap_is_int(rc, 0, "[gpt2 hf] strict load into a fresh GPT");
    if (rc) tap_diag("%s", fsdp_safetensors_last_error(st));
    tap_ok(same_state(a, b), "[gpt2 hf] every parameter equals the saved model's");
    size_t na = 0, nb = 0;
    float *la = logits_of(a, &na), *lb = logits_of(b, &nb);
    tap_ok(na == nb && memcmp(la, lb, na * sizeof *la) == 0,
           "[gpt2 hf] the loaded GPT computes the same logits, bit for bit");
    free(la);
    free(lb);
    fsdp_named_list_free(&sd);

    /* HF's extras: skipped on a strict load. */
    const char *p2 = in_dir("gpt2_extra.safetensors");
    hf_variant(c2, st, V_EXTRAS, p2);
    fsdp_module_t *c = tiny_gpt(c2);
    fsdp_safetensors_t *s2 = NULL;
    fsdp_safetensors_open(c2, p2, &s2);
    rc = fsdp_gpt2_hf_load(c, s2, true);
    tap_ok(rc == 0 && same_state(a, c),
           "[gpt2 hf] attn.bias, attn.masked_bias and lm_head.weight are skipped on a strict "
           "load");
    fsdp_safetensors_close(s2);
    fsdp_module_release(c);

    /* GPT2Model names. */
    hf_variant(c2, st, V_NO_PREFIX, p2);
    c = tiny_gpt(c2);
    fsdp_safetensors_open(c2, p2, &s2);
    rc = fsdp_gpt2_hf_load(c, s2, true);
    tap_ok(rc == 0 && same_state(a, c), "[gpt2 hf] a file with GPT2Model names (no prefix) loads");
    fsdp_safetensors_close(s2);
    fsdp_module_release(c);

    /* A weight stored the wrong way round. */
    hf_variant(c2, st, V_UNTRANSPOSED, p2);
    c = tiny_gpt(c2);
    fsdp_named_list_t snap;
    snapshot(c, &snap);
    fsdp_safetensors_open(c2, p2, &s2);
    rc = fsdp_gpt2_hf_load(c, s2, false);
    tap_ok(rc == FSDP_EINVAL &&
               strstr(fsdp_safetensors_last_error(s2), "\"h.1.mlp.c_fc.weight\"") &&
               strstr(fsdp_safetensors_last_error(s2), "stored transposed"),
           "[gpt2 hf] a Conv1D weight in Linear layout is a shape mismatch naming it");
    tap_ok(unchanged(c, &snap), "[gpt2 hf] and nothing is loaded");
    fsdp_named_list_free(&snap);
    fsdp_safetensors_close(s2);

    /* The same parameter under both spellings is ambiguous. */
    hf_variant(c2, st, V_BOTH_NAMES, p2);
    fsdp_safetensors_open(c2, p2, &s2);
    rc = fsdp_gpt2_hf_load(c, s2, false);
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_safetensors_last_error(s2), "both load 'wte.weight'"),
           "[duplicates] wte.weight and transformer.wte.weight in one file are refused");
    fsdp_safetensors_close(s2);

    /* Not a GPT; a file in libfsdp's own layout. */
    fsdp_safetensors_open(c2, path, &s2);
    fsdp_module_t *seq = mlp(c2);
    tap_ok(fsdp_gpt2_hf_load(seq, s2, true) == FSDP_EINVAL &&
               strstr(fsdp_safetensors_last_error(s2), "not a GPT"),
           "[gpt2 hf] loading into a module that is not a GPT is refused");
    fsdp_module_release(seq);
    fsdp_safetensors_close(s2);
    save_variant(a, p2, NULL, NULL); /* libfsdp names: nothing carries the prefix */
    fsdp_safetensors_open(c2, p2, &s2);
    rc = fsdp_gpt2_hf_load(c, s2, true);
    tap_ok(rc == FSDP_EINVAL, "[gpt2 hf] libfsdp names with untransposed Conv1D weights are "
                              "refused");
    fsdp_safetensors_close(s2);

    fsdp_safetensors_close(st);
    fsdp_module_release(a);
    fsdp_module_release(b);
    fsdp_module_release(c);
    fsdp_ctx_destroy(c1);
    fsdp_ctx_destroy(c2);
}

/* ---- main --------------------------------------------------------------------------------- */

/* --write FILE: the golden tensors through libfsdp's writer, for t_safetensors_py.sh. */
static int write_mode(const char *path) {
    fsdp_ctx_t *c = new_ctx(0);
    fsdp_named_list_t l;
    build_cases(c, &l);
    int rc = fsdp_safetensors_save(c, path, &l, golden_meta, 3);
    if (rc) fprintf(stderr, "t_safetensors --write: %s\n", fsdp_ctx_last_error(c));
    fsdp_named_list_free(&l);
    fsdp_ctx_destroy(c);
    return rc ? 1 : 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "--write") == 0) return write_mode(argv[2]);
    tap_plan_lazy();
    tap_tmppath(dir, sizeof dir, "t_safetensors.XXXXXX");
    if (!mkdtemp(dir)) tap_bail("mkdtemp: %s", strerror(errno));
    ctx = new_ctx(7);
    /* Refused opens log at debug level only; keep the output to the TAP lines. */
    fsdp_ctx_set_log_level(ctx, FSDP_LOG_ERROR);
    test_round_trip();
    test_metadata();
    test_golden();
    test_hostile();
    test_atomic();
    test_load();
    test_gpt2();
    fsdp_ctx_destroy(ctx);
    remove_dir();
    return tap_done();
}
