/* SPDX-License-Identifier: MIT */
/*
 * ckpt_index.c: a checkpoint directory's index: parsing index.json, writing it, and the one
 * validation the reader (after parsing) and the writer (after building it from the rank files'
 * headers) both run, so that a writer never publishes an index a reader would refuse.
 *
 * The JSON is read with jansson under JSON_REJECT_DUPLICATES (two entries of one tensor must not
 * silently become one) and strictly: an unknown key anywhere is an error, as in the safetensors
 * header, so a field from a newer writer is never ignored. Every message names index.json's
 * path and the tensor, file or key at fault.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "io/ckpt_impl.h"

int fsdp__ckpt_err(fsdp_ckpt_t *ck, int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fsdp__verr(ck->err, rc, fmt, ap);
    va_end(ap);
    if (ck->ctx) fsdp__ctx_err(ck->ctx, rc, "%s", ck->err);
    return rc;
}

fsdp_ckpt_t *fsdp__ckpt_new(fsdp_ctx_t *ctx, const char *dir) {
    fsdp_ckpt_t *ck = calloc(1, sizeof *ck);
    if (!ck) return NULL;
    ck->ctx = ctx;
    ck->dir = strdup(dir ? dir : "");
    if (!ck->dir) {
        free(ck);
        return NULL;
    }
    return ck;
}

void fsdp_ckpt_close(fsdp_ckpt_t *ck) {
    if (!ck) return;
    for (size_t i = 0; i < ck->nfiles; i++) {
        free(ck->f[i].name);
        fsdp_safetensors_close(ck->f[i].st);
    }
    for (size_t i = 0; i < ck->n; i++) {
        free(ck->t[i].name);
        free(ck->t[i].c);
    }
    for (size_t i = 0; i < ck->nmeta; i++) {
        free(ck->mk[i]);
        free(ck->mv[i]);
    }
    free(ck->mk);
    free(ck->mv);
    free(ck->f);
    free(ck->t);
    free(ck->dir);
    free(ck);
}

static int cmp_tensor(const void *a, const void *b) {
    return strcmp(((const struct fsdp__ckpt_tensor *)a)->name,
                  ((const struct fsdp__ckpt_tensor *)b)->name);
}

static int cmp_chunk(const void *a, const void *b) {
    const struct fsdp__ckpt_chunk *x = a, *y = b;
    return x->offset < y->offset ? -1 : x->offset > y->offset ? 1 : 0;
}

struct fsdp__ckpt_tensor *fsdp__ckpt_lookup(const fsdp_ckpt_t *ck, const char *name) {
    size_t lo = 0, hi = ck->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(ck->t[mid].name, name);
        if (c == 0) return &ck->t[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

/* Element count of a shape, or -1 when it is invalid or overflows 2^62 (elements or bytes). */
static int64_t shape_numel(const int64_t *shape, int nd, size_t esize) {
    int64_t n = 1;
    for (int d = 0; d < nd; d++) {
        if (shape[d] < 0) return -1;
        if (shape[d] && n > (INT64_C(1) << 62) / shape[d]) return -1;
        n *= shape[d];
    }
    if (esize && n > (INT64_C(1) << 62) / (int64_t)esize) return -1;
    return n;
}

int fsdp__ckpt_check(fsdp_ckpt_t *ck, const char *src) {
    char nm[224], sh[200];
    if (ck->n) qsort(ck->t, ck->n, sizeof *ck->t, cmp_tensor);
    for (size_t i = 0; i < ck->n; i++) {
        struct fsdp__ckpt_tensor *t = &ck->t[i];
        fsdp__st_shown(t->name, nm, sizeof nm);
        if (!t->name[0]) return fsdp__ckpt_err(ck, FSDP_EINVAL, "'%s': a tensor has no name", src);
        if (i > 0 && strcmp(ck->t[i - 1].name, t->name) == 0)
            return fsdp__ckpt_err(ck, FSDP_EINVAL, "'%s': tensor '%s' is listed twice", src, nm);
        if (t->ndim < 0 || t->ndim > FSDP_MAX_DIMS ||
            (t->numel = shape_numel(t->shape, t->ndim, t->esize)) < 0)
            return fsdp__ckpt_err(ck, FSDP_EINVAL,
                                  "'%s': tensor '%s': invalid shape %s (at most %d non-negative "
                                  "sizes whose byte count fits in 62 bits)",
                                  src, nm, fsdp__st_shape_str(t->shape, t->ndim, sh, sizeof sh),
                                  FSDP_MAX_DIMS);
        if (t->nchunks) qsort(t->c, t->nchunks, sizeof *t->c, cmp_chunk);
        if (t->replicated && t->nchunks != 1 && t->numel > 0)
            return fsdp__ckpt_err(ck, FSDP_EINVAL,
                                  "'%s': tensor '%s' is replicated but has %zu chunks (one holds "
                                  "it whole)",
                                  src, nm, t->nchunks);
        int64_t next = 0;
        for (size_t j = 0; j < t->nchunks; j++) {
            const struct fsdp__ckpt_chunk *c = &t->c[j];
            const char *fname = c->file < ck->nfiles ? ck->f[c->file].name : "?";
            if (c->file >= ck->nfiles)
                return fsdp__ckpt_err(ck, FSDP_EINVAL,
                                      "'%s': tensor '%s': a chunk names file %zu of %zu", src, nm,
                                      c->file, ck->nfiles);
            if (c->numel <= 0 || c->offset < 0)
                return fsdp__ckpt_err(ck, FSDP_EINVAL,
                                      "'%s': tensor '%s': a chunk in '%s' has offset %" PRId64
                                      " and %" PRId64 " elements",
                                      src, nm, fname, c->offset, c->numel);
            if (c->offset != next)
                return fsdp__ckpt_err(
                    ck, FSDP_EINVAL,
                    "'%s': tensor '%s': the chunk at element %" PRId64 " (in '%s') %s: elements "
                    "[%" PRId64 ", %" PRId64 ") are %s",
                    src, nm, c->offset, fname,
                    c->offset > next ? "leaves a gap" : "overlaps the one before it",
                    c->offset > next ? next : c->offset, c->offset > next ? c->offset : next,
                    c->offset > next ? "in no chunk" : "in two chunks");
            if (c->numel > t->numel - c->offset)
                return fsdp__ckpt_err(ck, FSDP_EINVAL,
                                      "'%s': tensor '%s': the chunk at element %" PRId64
                                      " (in '%s') of %" PRId64
                                      " elements runs past the tensor's %" PRId64 " elements",
                                      src, nm, c->offset, fname, c->numel, t->numel);
            uint64_t nb = (uint64_t)c->numel * t->esize, fs = ck->f[c->file].size;
            if (c->byte > fs || nb > fs - c->byte)
                return fsdp__ckpt_err(ck, FSDP_EINVAL,
                                      "'%s': tensor '%s': the chunk at element %" PRId64
                                      " lies at bytes [%" PRIu64 ", %" PRIu64 ") of '%s', "
                                      "which holds %" PRIu64 " bytes",
                                      src, nm, c->offset, c->byte, c->byte + nb, fname, fs);
            next = c->offset + c->numel;
        }
        if (next != t->numel)
            return fsdp__ckpt_err(ck, FSDP_EINVAL,
                                  "'%s': tensor '%s': elements [%" PRId64 ", %" PRId64
                                  ") of its %" PRId64 " are in no chunk",
                                  src, nm, next, t->numel, t->numel);
    }
    return FSDP_OK;
}

int fsdp__ckpt_check_file_meta(fsdp_ckpt_t *ck, const fsdp_safetensors_t *st, const char *path) {
    const size_t plen = sizeof FSDP__CKPT_META_KEY - 1;
    size_t copies = 0, n = fsdp_safetensors_metadata_count(st);
    char ks[224], v1[160], v2[160];
    for (size_t i = 0; i < n; i++) {
        fsdp_safetensors_kv_t kv;
        if (fsdp_safetensors_metadata_at(st, i, &kv) < 0 ||
            strncmp(kv.key, FSDP__CKPT_META_KEY, plen) != 0)
            continue;
        copies++;
        const char *key = kv.key + plen, *want = NULL;
        for (size_t j = 0; j < ck->nmeta && !want; j++)
            if (strcmp(ck->mk[j], key) == 0) want = ck->mv[j];
        if (!want || strcmp(want, kv.value) != 0)
            return fsdp__ckpt_err(
                ck, FSDP_EINVAL,
                "'%s' belongs to another save: its metadata '%s' is '%s' where the checkpoint's "
                "is %s%s%s (a checkpoint mixed from two saves is refused)",
                path, fsdp__st_shown(key, ks, sizeof ks), fsdp__st_shown(kv.value, v1, sizeof v1),
                want ? "'" : "", want ? fsdp__st_shown(want, v2, sizeof v2) : "absent",
                want ? "'" : "");
    }
    if (copies != 0 && copies != ck->nmeta)
        return fsdp__ckpt_err(ck, FSDP_EINVAL,
                              "'%s' belongs to another save: it carries %zu of the checkpoint's "
                              "%zu metadata entries",
                              path, copies, ck->nmeta);
    return FSDP_OK;
}

int fsdp__ckpt_parse_piece(const char *v, bool *replicated, int64_t *offset, int *ndim,
                           int64_t *shape) {
    int repl = 0, nd = 0, used = 0;
    long long off = 0;
    if (!v || sscanf(v, "%d %lld %d%n", &repl, &off, &nd, &used) < 3 || (repl != 0 && repl != 1) ||
        off < 0 || nd < 0 || nd > FSDP_MAX_DIMS)
        return FSDP_EINVAL;
    const char *p = v + used;
    for (int d = 0; d < nd; d++) {
        long long x = 0;
        int k = 0;
        if (sscanf(p, "%lld%n", &x, &k) < 1 || x < 0) return FSDP_EINVAL;
        shape[d] = x;
        p += k;
    }
    while (*p == ' ')
        p++;
    if (*p) return FSDP_EINVAL;
    *replicated = repl != 0;
    *offset = off;
    *ndim = nd;
    return FSDP_OK;
}

/* ---- parsing ----------------------------------------------------------------------------------
 */

/* A non-negative JSON integer, or -1. */
static int64_t json_nonneg(const json_t *v) {
    if (!json_is_integer(v)) return -1;
    json_int_t x = json_integer_value(v);
    return x < 0 ? -1 : (int64_t)x;
}

static int cmp_name(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* The first key of object o that is not in the NULL-terminated list known, or NULL. */
static const char *unknown_key(json_t *o, const char *const *known) {
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v) {
        size_t i = 0;
        while (known[i] && strcmp(known[i], key) != 0)
            i++;
        if (!known[i]) return key;
    }
    return NULL;
}

static int parse_files(fsdp_ckpt_t *ck, json_t *files, const char *path) {
    if (!json_is_array(files))
        return fsdp__ckpt_err(ck, FSDP_EINVAL, "'%s': \"files\" is not an array", path);
    size_t n = json_array_size(files);
    ck->f = calloc(n ? n : 1, sizeof *ck->f);
    if (!ck->f) return fsdp__ckpt_err(ck, FSDP_ENOMEM, "'%s': out of memory", path);
    for (size_t i = 0; i < n; i++) {
        json_t *o = json_array_get(files, i), *nm = json_object_get(o, "name"),
               *sz = json_object_get(o, "size");
        const char *s = json_string_value(nm);
        if (!json_is_object(o) || json_object_size(o) != 2 || !s || json_nonneg(sz) < 0)
            return fsdp__ckpt_err(ck, FSDP_EINVAL,
                                  "'%s': files[%zu] is not {\"name\": string, \"size\": bytes}",
                                  path, i);
        char shown[224];
        if (!s[0] || strchr(s, '/') || strcmp(s, ".") == 0 || strcmp(s, "..") == 0 ||
            strlen(s) > 255)
            return fsdp__ckpt_err(ck, FSDP_EINVAL,
                                  "'%s': files[%zu]: '%s' is not a plain file name", path, i,
                                  fsdp__st_shown(s, shown, sizeof shown));
        ck->f[i].name = strdup(s);
        ck->f[i].size = (uint64_t)json_nonneg(sz);
        ck->nfiles = i + 1;
        if (!ck->f[i].name) return fsdp__ckpt_err(ck, FSDP_ENOMEM, "'%s': out of memory", path);
    }
    /* duplicates by sorting the names: comparing every pair took minutes for a hostile index
     * of a few hundred thousand names */
    const char **names = malloc((n ? n : 1) * sizeof *names);
    if (!names) return fsdp__ckpt_err(ck, FSDP_ENOMEM, "'%s': out of memory", path);
    for (size_t i = 0; i < n; i++)
        names[i] = ck->f[i].name;
    qsort(names, n, sizeof *names, cmp_name);
    int rc = FSDP_OK;
    for (size_t i = 1; rc == 0 && i < n; i++)
        if (strcmp(names[i - 1], names[i]) == 0) {
            char shown[224];
            rc = fsdp__ckpt_err(ck, FSDP_EINVAL, "'%s': file '%s' is listed twice", path,
                                fsdp__st_shown(names[i], shown, sizeof shown));
        }
    free(names);
    return rc;
}

static int parse_tensor(fsdp_ckpt_t *ck, const char *name, json_t *o, const char *path) {
    char nm[224];
    fsdp__st_shown(name, nm, sizeof nm);
    struct fsdp__ckpt_tensor *t = &ck->t[ck->n];
    *t = (struct fsdp__ckpt_tensor){0};
    t->name = strdup(name);
    if (!t->name) return fsdp__ckpt_err(ck, FSDP_ENOMEM, "'%s': out of memory", path);
    ck->n++;
    json_t *dt = json_object_get(o, "dtype"), *shape = json_object_get(o, "shape"),
           *repl = json_object_get(o, "replicated"), *chunks = json_object_get(o, "chunks");
    static const char *const keys[] = {"dtype", "shape", "replicated", "chunks", NULL};
    const char *uk = json_is_object(o) ? unknown_key(o, keys) : NULL;
    char ks[224];
    if (uk)
        return fsdp__ckpt_err(ck, FSDP_EINVAL,
                              "'%s': tensor '%s': unknown key '%s' (a field this reader does not "
                              "know is not ignored)",
                              path, nm, fsdp__st_shown(uk, ks, sizeof ks));
    if (!json_is_object(o) || json_object_size(o) != 4 || !json_is_string(dt) ||
        !json_is_array(shape) || !json_is_boolean(repl) || !json_is_array(chunks))
        return fsdp__ckpt_err(ck, FSDP_EINVAL,
                              "'%s': tensor '%s' is not {\"dtype\", \"shape\", \"replicated\", "
                              "\"chunks\"}",
                              path, nm);
    t->st_dtype = fsdp__st_dtype_parse(json_string_value(dt), &t->esize, &t->dtype);
    char ds[64];
    if (!t->st_dtype)
        return fsdp__ckpt_err(ck, FSDP_EINVAL, "'%s': tensor '%s': unknown dtype '%s'", path, nm,
                              fsdp__st_shown(json_string_value(dt), ds, sizeof ds));
    if (json_array_size(shape) > FSDP_MAX_DIMS)
        return fsdp__ckpt_err(ck, FSDP_EINVAL, "'%s': tensor '%s' has %zu dimensions (at most %d)",
                              path, nm, json_array_size(shape), FSDP_MAX_DIMS);
    t->ndim = (int)json_array_size(shape);
    for (int d = 0; d < t->ndim; d++)
        if ((t->shape[d] = json_nonneg(json_array_get(shape, (size_t)d))) < 0)
            return fsdp__ckpt_err(ck, FSDP_EINVAL,
                                  "'%s': tensor '%s': shape[%d] is not a non-negative integer",
                                  path, nm, d);
    t->replicated = json_is_true(repl);
    size_t nc = json_array_size(chunks);
    t->c = calloc(nc ? nc : 1, sizeof *t->c);
    if (!t->c) return fsdp__ckpt_err(ck, FSDP_ENOMEM, "'%s': out of memory", path);
    for (size_t j = 0; j < nc; j++) {
        json_t *c = json_array_get(chunks, j);
        int64_t v[4];
        bool ok = json_is_array(c) && json_array_size(c) == 4;
        for (size_t k = 0; ok && k < 4; k++)
            ok = (v[k] = json_nonneg(json_array_get(c, k))) >= 0;
        if (!ok)
            return fsdp__ckpt_err(ck, FSDP_EINVAL,
                                  "'%s': tensor '%s': chunks[%zu] is not [file, offset, numel, "
                                  "byte] of non-negative integers",
                                  path, nm, j);
        t->c[j] = (struct fsdp__ckpt_chunk){(size_t)v[0], v[1], v[2], (uint64_t)v[3]};
    }
    t->nchunks = nc;
    return FSDP_OK;
}

int fsdp__ckpt_parse_index(fsdp_ckpt_t *ck, const char *text, size_t len, const char *path) {
    json_error_t je;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return fsdp__ckpt_err(ck, FSDP_EINVAL, "'%s': not valid JSON (line %d: %s)", path, je.line,
                              je.text);
    int rc = FSDP_OK;
    json_t *fmt = json_object_get(root, "format"), *ver = json_object_get(root, "version"),
           *world = json_object_get(root, "world_size"), *meta = json_object_get(root, "metadata"),
           *files = json_object_get(root, "files"), *tensors = json_object_get(root, "tensors");
    if (!json_is_object(root) || !json_is_string(fmt) ||
        strcmp(json_string_value(fmt), FSDP__CKPT_FORMAT) != 0) {
        rc = fsdp__ckpt_err(ck, FSDP_EINVAL,
                            "'%s' is not a libfsdp checkpoint index (no \"format\": \"%s\")", path,
                            FSDP__CKPT_FORMAT);
        goto out;
    }
    if (json_nonneg(ver) != FSDP__CKPT_VERSION) {
        rc = fsdp__ckpt_err(ck, FSDP_EINVAL, "'%s': version %lld; this libfsdp reads version %d",
                            path, json_is_integer(ver) ? (long long)json_integer_value(ver) : -1LL,
                            FSDP__CKPT_VERSION);
        goto out;
    }
    static const char *const keys[] = {"format", "version", "world_size", "metadata",
                                       "files",  "tensors", NULL};
    const char *uk = unknown_key(root, keys);
    if (uk) {
        char ks[224];
        rc = fsdp__ckpt_err(ck, FSDP_EINVAL,
                            "'%s': unknown key '%s' (a field this reader does not know is not "
                            "ignored)",
                            path, fsdp__st_shown(uk, ks, sizeof ks));
        goto out;
    }
    if (json_object_size(root) != 6 || json_nonneg(world) < 1 || json_nonneg(world) > INT32_MAX ||
        !json_is_object(meta) || !json_is_object(tensors)) {
        rc = fsdp__ckpt_err(ck, FSDP_EINVAL,
                            "'%s': expected exactly format, version, world_size (>= 1), "
                            "metadata (an object), files and tensors (an object)",
                            path);
        goto out;
    }
    ck->world = (int)json_nonneg(world);
    FSDP_TRY(rc, out, parse_files(ck, files, path));
    if (ck->nfiles != (size_t)ck->world) {
        rc =
            fsdp__ckpt_err(ck, FSDP_EINVAL,
                           "'%s': world_size %d but %zu files (a checkpoint has one file per rank)",
                           path, ck->world, ck->nfiles);
        goto out;
    }
    size_t nm = json_object_size(meta);
    ck->mk = calloc(nm ? nm : 1, sizeof *ck->mk);
    ck->mv = calloc(nm ? nm : 1, sizeof *ck->mv);
    if (!ck->mk || !ck->mv) {
        rc = fsdp__ckpt_err(ck, FSDP_ENOMEM, "'%s': out of memory", path);
        goto out;
    }
    const char *key;
    json_t *val;
    json_object_foreach(meta, key, val) {
        if (!json_is_string(val)) {
            char shown[224];
            rc = fsdp__ckpt_err(ck, FSDP_EINVAL, "'%s': metadata '%s' is not a string", path,
                                fsdp__st_shown(key, shown, sizeof shown));
            goto out;
        }
        ck->mk[ck->nmeta] = strdup(key);
        ck->mv[ck->nmeta] = strdup(json_string_value(val));
        if (!ck->mk[ck->nmeta++] || !ck->mv[ck->nmeta - 1]) {
            rc = fsdp__ckpt_err(ck, FSDP_ENOMEM, "'%s': out of memory", path);
            goto out;
        }
    }
    size_t nt = json_object_size(tensors);
    ck->t = calloc(nt ? nt : 1, sizeof *ck->t);
    ck->cap = nt;
    if (!ck->t) {
        rc = fsdp__ckpt_err(ck, FSDP_ENOMEM, "'%s': out of memory", path);
        goto out;
    }
    json_object_foreach(tensors, key, val) FSDP_TRY(rc, out, parse_tensor(ck, key, val, path));
    rc = fsdp__ckpt_check(ck, path);
out:
    json_decref(root);
    return rc;
}

/* ---- writing ----------------------------------------------------------------------------------
 */

static json_t *tensor_json(const struct fsdp__ckpt_tensor *t) {
    json_t *o = json_object(), *shape = json_array(), *chunks = json_array();
    bool ok = o && shape && chunks;
    for (int d = 0; ok && d < t->ndim; d++)
        ok = json_array_append_new(shape, json_integer(t->shape[d])) == 0;
    for (size_t j = 0; ok && j < t->nchunks; j++) {
        const struct fsdp__ckpt_chunk *c = &t->c[j];
        json_t *a = json_pack("[IIII]", (json_int_t)c->file, (json_int_t)c->offset,
                              (json_int_t)c->numel, (json_int_t)c->byte);
        ok = a && json_array_append_new(chunks, a) == 0;
    }
    if (ok)
        ok = json_object_set_new(o, "dtype", json_string(t->st_dtype)) == 0 &&
             json_object_set(o, "shape", shape) == 0 &&
             json_object_set_new(o, "replicated", json_boolean(t->replicated)) == 0 &&
             json_object_set(o, "chunks", chunks) == 0;
    json_decref(shape);
    json_decref(chunks);
    if (!ok) {
        json_decref(o);
        return NULL;
    }
    return o;
}

static json_t *index_json(const fsdp_ckpt_t *ck) {
    json_t *root = json_object(), *meta = json_object(), *files = json_array(),
           *tensors = json_object();
    bool ok = root && meta && files && tensors;
    for (size_t i = 0; ok && i < ck->nmeta; i++)
        ok = json_object_set_new(meta, ck->mk[i], json_string(ck->mv[i])) == 0;
    for (size_t i = 0; ok && i < ck->nfiles; i++) {
        json_t *f =
            json_pack("{s:s,s:I}", "name", ck->f[i].name, "size", (json_int_t)ck->f[i].size);
        ok = f && json_array_append_new(files, f) == 0;
    }
    for (size_t i = 0; ok && i < ck->n; i++) {
        json_t *t = tensor_json(&ck->t[i]);
        ok = t && json_object_set_new(tensors, ck->t[i].name, t) == 0;
    }
    if (ok)
        ok = json_object_set_new(root, "format", json_string(FSDP__CKPT_FORMAT)) == 0 &&
             json_object_set_new(root, "version", json_integer(FSDP__CKPT_VERSION)) == 0 &&
             json_object_set_new(root, "world_size", json_integer(ck->world)) == 0 &&
             json_object_set(root, "metadata", meta) == 0 &&
             json_object_set(root, "files", files) == 0 &&
             json_object_set(root, "tensors", tensors) == 0;
    json_decref(meta);
    json_decref(files);
    json_decref(tensors);
    if (!ok) {
        json_decref(root);
        return NULL;
    }
    return root;
}

int fsdp__ckpt_write_index(fsdp_ckpt_t *ck, const char *dir) {
    json_t *root = index_json(ck);
    /* one tensor per line keeps a large index readable and diffable */
    char *text = root ? json_dumps(root, JSON_INDENT(1) | JSON_PRESERVE_ORDER) : NULL;
    json_decref(root);
    if (!text)
        return fsdp__ckpt_err(ck, FSDP_ENOMEM, "'%s': building %s: out of memory", dir,
                              FSDP_CKPT_INDEX);
    size_t plen = strlen(dir) + sizeof FSDP_CKPT_INDEX + 16;
    char *path = malloc(plen), why[FSDP_ERR_LEN - 64];
    fsdp__replace_t w = {.fd = -1};
    int rc = FSDP_OK;
    if (!path) {
        rc = fsdp__ckpt_err(ck, FSDP_ENOMEM, "'%s': out of memory", dir);
        goto out;
    }
    snprintf(path, plen, "%s/%s", dir, FSDP_CKPT_INDEX);
    /* written under a temporary name and renamed, like a rank file (fsdp__replace) */
    rc = fsdp__replace_begin(&w, AT_FDCWD, path, 0666, true, why, sizeof why);
    size_t len = strlen(text);
    if (rc == FSDP_OK &&
        (fsdp__io_write_all(w.fd, text, len) != 0 || fsdp__io_write_all(w.fd, "\n", 1) != 0)) {
        snprintf(why, sizeof why, "'%s': writing failed: %s", w.tmp, strerror(errno));
        fsdp__replace_abort(&w);
        rc = FSDP_EINVAL;
    }
    if (rc == FSDP_OK) rc = fsdp__replace_commit(&w, why, sizeof why);
    if (rc < 0) rc = fsdp__ckpt_err(ck, rc == FSDP_ENOMEM ? rc : FSDP_EINVAL, "%s", why);
out:
    fsdp__replace_abort(&w);
    free(path);
    free(text);
    return rc;
}
