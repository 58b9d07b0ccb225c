/* SPDX-License-Identifier: MIT */
/*
 * golden.c: the golden-vector reader declared in golden.h (format described there).
 *
 * Parsing is two passes over the bytes: the first validates every length against what is left
 * and sizes one arena, the second copies names and data into it (each 16-byte aligned). A file
 * therefore either loads completely or not at all. Records are also indexed by name (sorted),
 * which finds duplicates and makes golden_find() a binary search.
 */
#include "golden.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAGIC_LEN 8
#define HEADER_LEN (MAGIC_LEN + 4)
#define MIN_RECORD_LEN 5 /* name_len, one name byte, dtype, ndim */
#define ALIGN16(n) (((n) + 15) & ~(size_t)15)

struct golden {
    int n;
    golden_rec_t *recs;          /* n, file order */
    const golden_rec_t **sorted; /* n pointers into recs, ordered by name */
    unsigned char *arena;
};

static void set_msg(char *msg, size_t len, const char *fmt, ...) {
    if (!msg || len == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, len, fmt, ap);
    va_end(ap);
}

static uint16_t rd_u16(const unsigned char *p) {
    return (uint16_t)(p[0] | (p[1] << 8));
}

static uint32_t rd_u32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static int64_t rd_i64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return (int64_t)v;
}

/* One record's header as parsed from the bytes at `p` (pointers into the caller's buffer). */
typedef struct raw_rec {
    const unsigned char *name;
    size_t name_len;
    int dtype, ndim;
    int64_t shape[GOLDEN_MAX_DIMS];
    int64_t numel;
    size_t bytes;
    const unsigned char *data;
} raw_rec_t;

/* Parses the record starting at buf[*pos], advancing *pos past it; FSDP_EINVAL with a message
 * when it does not fit in len or is malformed. */
static int parse_rec(const unsigned char *buf, size_t len, size_t *pos, uint32_t idx, raw_rec_t *r,
                     char *msg, size_t msglen) {
    size_t p = *pos;
    if (len - p < 2) goto truncated;
    r->name_len = rd_u16(buf + p);
    p += 2;
    if (r->name_len == 0) {
        set_msg(msg, msglen, "record %u at byte %zu: empty name", idx, *pos);
        return FSDP_EINVAL;
    }
    if (len - p < r->name_len) goto truncated;
    r->name = buf + p;
    if (memchr(r->name, 0, r->name_len)) {
        set_msg(msg, msglen, "record %u at byte %zu: NUL byte in the name", idx, *pos);
        return FSDP_EINVAL;
    }
    p += r->name_len;
    if (len - p < 2) goto truncated;
    r->dtype = buf[p];
    r->ndim = buf[p + 1];
    p += 2;
    if (!fsdp_dtype_valid(r->dtype)) {
        set_msg(msg, msglen, "record %u (%.*s): unknown dtype code %d", idx, (int)r->name_len,
                (const char *)r->name, r->dtype);
        return FSDP_EINVAL;
    }
    if (r->ndim > GOLDEN_MAX_DIMS) {
        set_msg(msg, msglen, "record %u (%.*s): %d dimensions (at most %d)", idx, (int)r->name_len,
                (const char *)r->name, r->ndim, GOLDEN_MAX_DIMS);
        return FSDP_EINVAL;
    }
    if ((len - p) / 8 < (size_t)r->ndim) goto truncated;
    bool zero = false;
    for (int d = 0; d < GOLDEN_MAX_DIMS; d++)
        r->shape[d] = 0;
    for (int d = 0; d < r->ndim; d++) {
        r->shape[d] = rd_i64(buf + p + 8 * (size_t)d);
        if (r->shape[d] < 0) {
            set_msg(msg, msglen, "record %u (%.*s): negative size %lld in dimension %d", idx,
                    (int)r->name_len, (const char *)r->name, (long long)r->shape[d], d);
            return FSDP_EINVAL;
        }
        if (r->shape[d] == 0) zero = true;
    }
    p += 8 * (size_t)r->ndim;
    /* The data must fit in what is left, which bounds numel long before int64 overflows. */
    size_t esize = fsdp_dtype_size((fsdp_dtype_t)r->dtype);
    size_t cap = (len - p) / esize;
    r->numel = zero ? 0 : 1;
    for (int d = 0; d < r->ndim && !zero; d++) {
        if ((uint64_t)r->shape[d] > cap || (uint64_t)r->numel > cap / (uint64_t)r->shape[d]) {
            set_msg(msg, msglen,
                    "record %u (%.*s): data truncated or size absurd (dimension %d "
                    "is %lld, %zu bytes left)",
                    idx, (int)r->name_len, (const char *)r->name, d, (long long)r->shape[d],
                    len - p);
            return FSDP_EINVAL;
        }
        r->numel *= r->shape[d];
    }
    if ((uint64_t)r->numel > cap) goto truncated;
    r->bytes = (size_t)r->numel * esize;
    r->data = buf + p;
    p += r->bytes;
    *pos = p;
    return 0;
truncated:
    set_msg(msg, msglen, "record %u at byte %zu: truncated (file is %zu bytes)", idx, *pos, len);
    return FSDP_EINVAL;
}

static int cmp_rec(const void *a, const void *b) {
    return strcmp((*(const golden_rec_t *const *)a)->name, (*(const golden_rec_t *const *)b)->name);
}

int golden_parse(const void *vbuf, size_t len, golden_t **out, char *msg, size_t msglen) {
    const unsigned char *buf = vbuf;
    golden_t *g = NULL;
    int rc;
    set_msg(msg, msglen, "ok");
    if (!out) return FSDP_EINVAL;
    *out = NULL;
    if (!buf && len) return FSDP_EINVAL;
    if (len < HEADER_LEN || memcmp(buf, GOLDEN_MAGIC, MAGIC_LEN) != 0) {
        set_msg(msg, msglen, "not a golden file (%zu bytes, magic " GOLDEN_MAGIC " expected)", len);
        return FSDP_EINVAL;
    }
    uint32_t count = rd_u32(buf + MAGIC_LEN);
    if (count > (len - HEADER_LEN) / MIN_RECORD_LEN || count > INT32_MAX) {
        set_msg(msg, msglen, "record count %u cannot fit in %zu bytes", count, len);
        return FSDP_EINVAL;
    }
    /* Pass 1: validate and size the arena. */
    size_t pos = HEADER_LEN, arena = 0;
    for (uint32_t i = 0; i < count; i++) {
        raw_rec_t r;
        rc = parse_rec(buf, len, &pos, i, &r, msg, msglen);
        if (rc < 0) return rc;
        arena += ALIGN16(r.name_len + 1) + ALIGN16(r.bytes);
    }
    if (pos != len) {
        set_msg(msg, msglen, "%zu bytes after the last of %u records", len - pos, count);
        return FSDP_EINVAL;
    }
    /* Pass 2: copy. */
    rc = FSDP_ENOMEM;
    g = calloc(1, sizeof *g);
    if (!g) goto fail;
    g->n = (int)count;
    g->recs = calloc(count ? count : 1, sizeof *g->recs);
    g->sorted = calloc(count ? count : 1, sizeof *g->sorted);
    g->arena = arena ? aligned_alloc(16, arena) : NULL; /* arena is a multiple of 16 */
    if (!g->recs || !g->sorted || (arena && !g->arena)) goto fail;
    pos = HEADER_LEN;
    size_t at = 0;
    for (uint32_t i = 0; i < count; i++) {
        raw_rec_t r;
        parse_rec(buf, len, &pos, i, &r, NULL, 0); /* cannot fail: pass 1 accepted it */
        golden_rec_t *gr = &g->recs[i];
        char *name = (char *)g->arena + at;
        memcpy(name, r.name, r.name_len);
        name[r.name_len] = 0;
        at += ALIGN16(r.name_len + 1);
        gr->name = name;
        gr->dtype = (fsdp_dtype_t)r.dtype;
        gr->ndim = r.ndim;
        memcpy(gr->shape, r.shape, sizeof gr->shape);
        gr->numel = r.numel;
        gr->bytes = r.bytes;
        gr->data = NULL;
        if (r.bytes) {
            memcpy(g->arena + at, r.data, r.bytes);
            gr->data = g->arena + at;
            at += ALIGN16(r.bytes);
        }
        g->sorted[i] = gr;
    }
    qsort(g->sorted, count, sizeof *g->sorted, cmp_rec);
    for (uint32_t i = 1; i < count; i++) {
        if (strcmp(g->sorted[i - 1]->name, g->sorted[i]->name) == 0) {
            set_msg(msg, msglen, "duplicate record name \"%s\"", g->sorted[i]->name);
            rc = FSDP_EINVAL;
            goto fail;
        }
    }
    *out = g;
    return 0;
fail:
    if (rc == FSDP_ENOMEM) set_msg(msg, msglen, "out of memory (%zu bytes of records)", arena);
    golden_free(g);
    return rc;
}

int golden_load_msg(const char *path, golden_t **out, char *msg, size_t msglen) {
    unsigned char *buf = NULL;
    int rc;
    if (!out) return FSDP_EINVAL;
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) {
        int e = errno;
        set_msg(msg, msglen, "%s: %s", path, strerror(e));
        return e == ENOENT ? GOLDEN_ENOENT : GOLDEN_EIO;
    }
    rc = GOLDEN_EIO;
    if (fseek(f, 0, SEEK_END) != 0) goto io_fail;
    long size = ftell(f);
    if (size < 0 || fseek(f, 0, SEEK_SET) != 0) goto io_fail;
    buf = malloc(size ? (size_t)size : 1);
    if (!buf) {
        set_msg(msg, msglen, "%s: out of memory (%ld bytes)", path, size);
        rc = FSDP_ENOMEM;
        goto out;
    }
    if (fread(buf, 1, (size_t)size, f) != (size_t)size) goto io_fail;
    char inner[512];
    rc = golden_parse(buf, (size_t)size, out, inner, sizeof inner);
    set_msg(msg, msglen, "%s: %s", path, inner);
    goto out;
io_fail:
    set_msg(msg, msglen, "%s: read error: %s", path, strerror(errno));
out:
    free(buf);
    fclose(f);
    return rc;
}

int golden_load(const char *path, golden_t **out) {
    return golden_load_msg(path, out, NULL, 0);
}

void golden_free(golden_t *g) {
    if (!g) return;
    free(g->recs);
    free(g->sorted);
    free(g->arena);
    free(g);
}

int golden_count(const golden_t *g) {
    return g ? g->n : 0;
}

const golden_rec_t *golden_at(const golden_t *g, int i) {
    return g && i >= 0 && i < g->n ? &g->recs[i] : NULL;
}

const golden_rec_t *golden_find(const golden_t *g, const char *name) {
    if (!g || !name) return NULL;
    int lo = 0, hi = g->n;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        const golden_rec_t *r = g->sorted[mid];
        int c = strcmp(r->name, name);
        if (c == 0) return r;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

const golden_rec_t *golden_findf(const golden_t *g, const char *prefix, const char *key) {
    char name[1024];
    int n = snprintf(name, sizeof name, "%s/%s", prefix, key);
    if (n < 0 || (size_t)n >= sizeof name) return NULL;
    return golden_find(g, name);
}

double golden_value(const golden_rec_t *r, int64_t i) {
    double v = NAN;
    if (!r || i < 0 || i >= r->numel) return v;
    size_t es = fsdp_dtype_size(r->dtype);
    fsdp_dtype_convert(&v, FSDP_DTYPE_F64, (const unsigned char *)r->data + (size_t)i * es,
                       r->dtype, 1);
    return v;
}

int golden_ints(const golden_rec_t *r, int64_t *v, int max) {
    if (!r || r->numel > max) return -1;
    for (int64_t i = 0; i < r->numel; i++)
        v[i] = (int64_t)golden_value(r, i);
    return (int)r->numel;
}

fsdp_tensor_t *golden_tensor(fsdp_ctx_t *ctx, const golden_rec_t *r) {
    fsdp_tensor_t *t = NULL;
    if (!ctx || !r) return NULL;
    if (fsdp_tensor_from_host(ctx, r->dtype, r->ndim, r->shape, r->data, FSDP_MEM_OTHER, &t) < 0)
        return NULL;
    return t;
}

/* Formats a row-major index as "[i, j, k]". */
static void fmt_index(char *buf, size_t len, int ndim, const int64_t *shape, int64_t flat) {
    int64_t idx[GOLDEN_MAX_DIMS];
    for (int d = ndim - 1; d >= 0; d--) {
        idx[d] = shape[d] ? flat % shape[d] : 0;
        flat = shape[d] ? flat / shape[d] : 0;
    }
    size_t o = (size_t)snprintf(buf, len, "[");
    for (int d = 0; d < ndim && o < len; d++)
        o += (size_t)snprintf(buf + o, len - o, "%s%lld", d ? ", " : "", (long long)idx[d]);
    if (o < len) snprintf(buf + o, len - o, "]");
}

static void fmt_shape(char *buf, size_t len, int ndim, const int64_t *shape) {
    size_t o = (size_t)snprintf(buf, len, "[");
    for (int d = 0; d < ndim && o < len; d++)
        o += (size_t)snprintf(buf + o, len - o, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (o < len) snprintf(buf + o, len - o, "]");
}

/* How far outside its tolerance an element is: <= 1 passes, infinity for a NaN or infinity
 * mismatch. */
static double excess(double g, double w, double rtol, double atol) {
    if (isnan(g) || isnan(w)) return isnan(g) && isnan(w) ? 0 : INFINITY;
    if (g == w) return 0;
    if (isinf(g) || isinf(w)) return INFINITY;
    double tol = atol + rtol * fabs(w);
    double err = fabs(g - w);
    return tol > 0 ? err / tol : INFINITY;
}

int golden_compare(const fsdp_tensor_t *got, const golden_rec_t *want, double rtol, double atol,
                   char *detail, size_t len) {
    char gs[160], ws[160];
    set_msg(detail, len, "ok");
    if (!got || !want) {
        set_msg(detail, len, "%s missing", got ? "golden record" : "tensor");
        return 0;
    }
    int ndim = fsdp_tensor_ndim(got);
    const int64_t *shape = fsdp_tensor_shape(got);
    fmt_shape(gs, sizeof gs, ndim, shape);
    fmt_shape(ws, sizeof ws, want->ndim, want->shape);
    bool same = ndim == want->ndim;
    for (int d = 0; same && d < ndim; d++)
        same = shape[d] == want->shape[d];
    if (!same) {
        set_msg(detail, len, "%s: shape %s, want %s", want->name, gs, ws);
        return 0;
    }
    fsdp_dtype_t gdt = fsdp_tensor_dtype(got);
    if (gdt != want->dtype) {
        set_msg(detail, len, "%s: dtype %s, want %s", want->name, fsdp_dtype_name(gdt),
                fsdp_dtype_name(want->dtype));
        return 0;
    }
    int64_t n = want->numel;
    if (n == 0) return 1;
    size_t es = fsdp_dtype_size(gdt);
    void *raw = malloc((size_t)n * es);
    double *gv = malloc((size_t)n * sizeof *gv);
    double *wv = malloc((size_t)n * sizeof *wv);
    int pass = 0;
    if (!raw || !gv || !wv) {
        set_msg(detail, len, "%s: out of memory comparing %lld elements", want->name, (long long)n);
        goto out;
    }
    int rc = fsdp_tensor_to_host(got, raw, (size_t)n * es);
    if (rc < 0) {
        set_msg(detail, len, "%s: fsdp_tensor_to_host failed: %s (%s)", want->name,
                fsdp_strerror(rc), fsdp_ctx_last_error(fsdp_tensor_ctx(got)));
        goto out;
    }
    fsdp_dtype_convert(gv, FSDP_DTYPE_F64, raw, gdt, (size_t)n);
    fsdp_dtype_convert(wv, FSDP_DTYPE_F64, want->data, want->dtype, (size_t)n);
    int64_t worst = 0, bad = 0;
    double worst_x = -1;
    for (int64_t i = 0; i < n; i++) {
        double x = excess(gv[i], wv[i], rtol, atol);
        if (x > 1) bad++;
        if (x > worst_x) {
            worst_x = x;
            worst = i;
        }
    }
    pass = bad == 0;
    if (!pass) {
        char is[160];
        fmt_index(is, sizeof is, ndim, shape, worst);
        set_msg(detail, len,
                "%s %s: %lld of %lld elements off (rtol %g, atol %g)\n"
                "worst at %s: got %.9g, want %.9g, |diff| %.3g (%.3g x tolerance)",
                want->name, ws, (long long)bad, (long long)n, rtol, atol, is, gv[worst], wv[worst],
                fabs(gv[worst] - wv[worst]), worst_x);
    }
out:
    free(raw);
    free(gv);
    free(wv);
    return pass;
}
