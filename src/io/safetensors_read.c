/* SPDX-License-Identifier: MIT */
/*
 * safetensors_read.c: opening safetensors files, listing their entries and reading their
 * tensors.
 *
 * fsdp_safetensors_open() checks the whole file before it returns a handle: the header length
 * here, the header and the layout of the data section in safetensors_header.c. After that, the
 * handle's entries are trusted for sizes (io_impl.h), and only the results of pread are checked
 * again, since the file may change under an open handle. A read that converts dtypes goes
 * through a buffer of CHUNK_BYTES of the file's bytes, not a copy of the whole tensor.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/io_impl.h"

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

const char *fsdp__st_shape_str(const int64_t *shape, int nd, char *buf, size_t cap) {
    size_t o = 0;
    buf[0] = 0;
    o += (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < nd && o < cap; d++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
    return buf;
}

/* ---- file access -------------------------------------------------------------------------- */

int fsdp__io_pread_all(int fd, void *buf, size_t n, uint64_t off) {
    unsigned char *p = buf;
    while (n > 0) {
        size_t want = n > (1u << 30) ? (1u << 30) : n;
        ssize_t k = pread(fd, p, want, (off_t)off);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return -1;
        if (k == 0) return 1;
        p += k;
        n -= (size_t)k;
        off += (uint64_t)k;
    }
    return 0;
}

void *fsdp__io_host_bytes(const fsdp_tensor_t *t) {
    const uint16_t probe = 1;
    bool little = *(const unsigned char *)&probe == 1;
    if (!little || !t || !fsdp_tensor_is_contiguous(t) ||
        fsdp_device_kind(fsdp_tensor_device(t)) != FSDP_DEVICE_CPU)
        return NULL;
    return fsdp_tensor_data(t);
}

int fsdp__io_write_all(int fd, const void *p, size_t n) {
    const unsigned char *b = p;
    while (n > 0) {
        /* at most 1 MiB per call: on Linux one write of tens of megabytes into the page cache
         * ran ten times slower here than the same bytes in 1 MiB writes (bench/bench_ckpt) */
        ssize_t k = write(fd, b, n > (1u << 20) ? (1u << 20) : n);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return -1;
        if (k == 0) {
            errno = EIO;
            return -1;
        }
        b += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Reads exactly n bytes at off; `what` says what for the message. */
static int pread_all(fsdp_safetensors_t *st, void *buf, size_t n, uint64_t off, const char *what) {
    int rc = fsdp__io_pread_all(st->fd, buf, n, off);
    if (rc < 0)
        return fsdp__st_err(st, FSDP_EINVAL, "'%s': reading %s at byte %llu failed: %s", st->path,
                            what, (unsigned long long)off, strerror(errno));
    if (rc > 0)
        return fsdp__st_err(st, FSDP_EINVAL,
                            "'%s': the file ended while reading %s at byte %llu (was it "
                            "truncated after it was opened?)",
                            st->path, what, (unsigned long long)off);
    return FSDP_OK;
}

/* ---- opening ------------------------------------------------------------------------------ */

int fsdp_safetensors_open(fsdp_ctx_t *ctx, const char *path, fsdp_safetensors_t **out) {
    return fsdp__st_open(ctx, path, NULL, 0, out);
}

int fsdp__st_open(fsdp_ctx_t *ctx, const char *path, char *err, size_t cap,
                  fsdp_safetensors_t **out) {
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
    /* a FIFO or a device is refused without blocking (fsdp__open_regular) */
    struct stat sb;
    char why[256];
    st->fd = fsdp__open_regular(AT_FDCWD, path, O_RDONLY, 0, &sb, why, sizeof why);
    if (st->fd < 0) {
        st->fd = -1;
        rc = fsdp__st_err(st, FSDP_EINVAL, "'%s': %s", path, why);
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
    FSDP_TRY(rc, fail, fsdp__st_parse_header(st, hdr, (size_t)hlen));
    free(hdr);
    *out = st;
    return FSDP_OK;
fail:
    if (err && cap)
        snprintf(err, cap, "%s", st->err);
    else if (!ctx)
        fsdp_log(NULL, FSDP_LOG_ERROR, "fsdp_safetensors_open: %s", st->err);
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
        return fsdp__st_err(st, FSDP_EINVAL,
                            "%s: tensor '%s' is %s %s in the file, the destination %s", fn,
                            fsdp__st_shown(e->name, nm, sizeof nm), e->st_dtype,
                            fsdp__st_shape_str(e->shape, e->ndim, a, sizeof a),
                            fsdp_tensor_describe(dst, b, sizeof b));
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
