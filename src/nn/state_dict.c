/* SPDX-License-Identifier: MIT */
/*
 * state_dict.c: state dicts of module trees, loading them back, and their file format.
 *
 * A state dict lists, in pre-order, each module's parameters then its persistent buffers under
 * every name they have (PyTorch's order and aliasing). Its tensors are detached views of the
 * module's own, so saving reads the live values and the list keeps them alive.
 *
 * Loading checks everything before writing anything: a strict load with a missing key, an
 * unexpected key or a shape mismatch (and any load with a shape mismatch) fails with one
 * message naming every problem and leaves the module untouched.
 *
 * File format (all integers little-endian):
 *
 *     "FSDPSD01"                      8 bytes of magic
 *     u64 count                       number of entries
 *     count times:
 *         u16 name_len, name bytes    the fully qualified name, no terminating NUL
 *         u8 dtype                    an fsdp_dtype_t value
 *         u8 ndim                     0 .. FSDP_MAX_DIMS
 *         i64 shape[ndim]
 *         raw data                    numel * dtype size bytes, row-major, little-endian
 *
 * The reader checks every length against what is left of the file before it allocates, so a
 * truncated or corrupted file is an FSDP_EINVAL naming the entry, never a crash.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "nn/nn_impl.h"
#include "tensor/tensor_impl.h"

static const char magic[8] = {'F', 'S', 'D', 'P', 'S', 'D', '0', '1'};

/* ---- a growing string for error reports ---------------------------------------------------- */


/* ---- state dict ---------------------------------------------------------------------------- */

int fsdp_module_state_dict(const fsdp_module_t *m, fsdp_named_list_t *out) {
    fsdp_named_list_t all;
    if (!out) return fsdp__module_err(m, FSDP_EINVAL, "fsdp_module_state_dict: out is NULL");
    int rc = fsdp__module_list(m, FSDP__LIST_STATE, true, &all);
    memset(out, 0, sizeof *out);
    if (rc < 0) return rc;
    out->owned = true;
    size_t cap = 0;
    for (size_t i = 0; i < all.n; i++) {
        fsdp_tensor_t *d = NULL;
        FSDP_TRY(rc, fail, fsdp_detach(all.tensors[i], &d));
        rc = fsdp_tensor_set_name(d, all.names[i]);
        if (rc == 0) rc = fsdp__list_push(out, &cap, all.names[i], d, all.modules[i]);
        fsdp_tensor_release(d);
        if (rc < 0) {
            rc = fsdp__module_err(m, rc, "fsdp_module_state_dict: out of memory");
            goto fail;
        }
    }
    fsdp_named_list_free(&all);
    return FSDP_OK;
fail:
    fsdp_named_list_free(&all);
    fsdp_named_list_free(out);
    return rc;
}

static bool same_shape(const fsdp_tensor_t *a, const fsdp_tensor_t *b) {
    int nd = fsdp_tensor_ndim(a);
    return nd == fsdp_tensor_ndim(b) &&
           memcmp(fsdp_tensor_shape(a), fsdp_tensor_shape(b), sizeof(int64_t) * (size_t)nd) == 0;
}

/* dst = src across devices and dtypes: directly when both are on one device, else through a
 * host buffer. */
static int copy_any(fsdp_tensor_t *dst, const fsdp_tensor_t *src) {
    if (fsdp_tensor_device(dst) == fsdp_tensor_device(src) &&
        fsdp_tensor_ctx(dst) == fsdp_tensor_ctx(src))
        return fsdp_tensor_copy_(dst, src);
    size_t n = (size_t)fsdp_tensor_numel(src);
    if (n == 0) return FSDP_OK;
    size_t ss = fsdp_dtype_size(fsdp_tensor_dtype(src));
    size_t ds = fsdp_dtype_size(fsdp_tensor_dtype(dst));
    void *a = malloc(n * ss), *b = malloc(n * ds);
    int rc = FSDP_OK;
    if (!a || !b) {
        rc = fsdp__op_err(dst, FSDP_ENOMEM, "fsdp_module_load_state_dict", "out of host memory");
        goto out;
    }
    FSDP_TRY(rc, out, fsdp_tensor_to_host(src, a, n * ss));
    FSDP_TRY(rc, out, fsdp_dtype_convert(b, fsdp_tensor_dtype(dst), a, fsdp_tensor_dtype(src), n));
    rc = fsdp_tensor_copy_from_host(dst, b, n * ds);
out:
    free(a);
    free(b);
    return rc;
}

int fsdp_module_load_state_dict(fsdp_module_t *m, const fsdp_named_list_t *sd, bool strict) {
    if (!m) return fsdp__ctx_err(NULL, FSDP_EINVAL, "fsdp_module_load_state_dict: module is NULL");
    if (!sd || (sd->n > 0 && (!sd->names || !sd->tensors)))
        return fsdp__module_err(m, FSDP_EINVAL,
                                "fsdp_module_load_state_dict: the state dict is NULL or has no "
                                "names/tensors");
    fsdp_named_list_t want;
    int rc = fsdp__module_list(m, FSDP__LIST_STATE, true, &want);
    if (rc < 0) return rc;
    long *match = calloc(want.n ? want.n : 1, sizeof *match);
    bool *used = calloc(sd->n ? sd->n : 1, sizeof *used);
    fsdp__sbuf_t missing = {0}, unexpected = {0}, mismatch = {0};
    size_t nmissing = 0, nunexpected = 0, nmismatch = 0;
    if (!match || !used) {
        rc = fsdp__module_err(m, FSDP_ENOMEM, "fsdp_module_load_state_dict: out of memory");
        goto out;
    }
    for (size_t i = 0; i < want.n; i++) {
        match[i] = -1;
        for (size_t j = 0; j < sd->n; j++) {
            if (used[j] || !sd->names[j] || strcmp(sd->names[j], want.names[i]) != 0) continue;
            match[i] = (long)j;
            used[j] = true;
            break;
        }
        if (match[i] < 0) {
            fsdp__sb_add(&missing, "%s\"%s\"", nmissing++ ? ", " : "", want.names[i]);
            continue;
        }
        const fsdp_tensor_t *src = sd->tensors[match[i]];
        if (!src) {
            fsdp__sb_add(&mismatch, "%s\"%s\" (the state dict holds NULL)", nmismatch++ ? "; " : "",
                   want.names[i]);
        } else if (!same_shape(want.tensors[i], src)) {
            char a[160], b[160];
            fsdp__sb_add(&mismatch, "%s\"%s\" (module %s, state dict %s)", nmismatch++ ? "; " : "",
                   want.names[i], fsdp_tensor_describe(want.tensors[i], a, sizeof a),
                   fsdp_tensor_describe(src, b, sizeof b));
        }
    }
    for (size_t j = 0; j < sd->n; j++) {
        if (used[j]) continue;
        bool dup = false;
        for (size_t i = 0; i < want.n && !dup && sd->names[j]; i++)
            dup = strcmp(sd->names[j], want.names[i]) == 0;
        fsdp__sb_add(&unexpected, "%s\"%s\"%s", nunexpected++ ? ", " : "",
               sd->names[j] ? sd->names[j] : "(NULL)", dup ? " (a duplicate)" : "");
    }
    if (missing.oom || unexpected.oom || mismatch.oom) {
        rc = fsdp__module_err(m, FSDP_ENOMEM, "fsdp_module_load_state_dict: out of memory");
        goto out;
    }
    if (nmismatch || (strict && (nmissing || nunexpected))) {
        rc = fsdp__module_err(
            m, FSDP_EINVAL,
            "error loading state dict (%s; nothing loaded): %zu missing key(s)%s%s; %zu "
            "unexpected key(s)%s%s; %zu shape mismatch(es)%s%s",
            strict ? "strict" : "not strict", nmissing, nmissing ? ": " : "", fsdp__sb_str(&missing),
            nunexpected, nunexpected ? ": " : "", fsdp__sb_str(&unexpected), nmismatch,
            nmismatch ? ": " : "", fsdp__sb_str(&mismatch));
        goto out;
    }
    for (size_t i = 0; i < want.n; i++) {
        if (match[i] < 0) continue;
        FSDP_TRY(rc, out, copy_any(want.tensors[i], sd->tensors[match[i]]));
    }
    if (nmissing || nunexpected)
        fsdp__module_err(m, FSDP_OK,
                         "state dict loaded (not strict): %zu missing key(s)%s%s; %zu unexpected "
                         "key(s)%s%s",
                         nmissing, nmissing ? ": " : "", fsdp__sb_str(&missing), nunexpected,
                         nunexpected ? ": " : "", fsdp__sb_str(&unexpected));
    rc = FSDP_OK;
out:
    free(missing.s);
    free(unexpected.s);
    free(mismatch.s);
    free(match);
    free(used);
    fsdp_named_list_free(&want);
    return rc;
}

/* ---- file format -------------------------------------------------------------------------- */

static void put_le(unsigned char *p, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t get_le(const unsigned char *p, int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* The context to report on: the first tensor's. */
static fsdp_ctx_t *list_ctx(const fsdp_named_list_t *sd) {
    for (size_t i = 0; sd && sd->tensors && i < sd->n; i++)
        if (sd->tensors[i]) return fsdp_tensor_ctx(sd->tensors[i]);
    return NULL;
}

int fsdp_state_dict_save(const fsdp_named_list_t *sd, const char *path) {
    fsdp_ctx_t *ctx = list_ctx(sd);
    if (!sd || !path || (sd->n > 0 && (!sd->names || !sd->tensors)))
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "fsdp_state_dict_save: NULL state dict, names, tensors or path");
    for (size_t i = 0; i < sd->n; i++) {
        if (!sd->names[i] || !sd->tensors[i])
            return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_state_dict_save: entry %zu is NULL", i);
        if (strlen(sd->names[i]) > UINT16_MAX)
            return fsdp__ctx_err(ctx, FSDP_EINVAL,
                                 "fsdp_state_dict_save: the name of entry %zu is longer than %u "
                                 "bytes",
                                 i, (unsigned)UINT16_MAX);
    }
    int rc = FSDP_OK;
    void *data = NULL;
    char why[FSDP_ERR_LEN - 64];
    /* written under a temporary name and renamed over path, which must be absent or a regular
     * file (fsdp__replace): a failed save leaves the previous file, and never touches a device */
    fsdp__replace_t w;
    FILE *f = NULL;
    rc = fsdp__replace_begin(&w, AT_FDCWD, path, 0666, true, why, sizeof why);
    if (rc < 0)
        return fsdp__ctx_err(ctx, rc == FSDP_ENOMEM ? rc : FSDP_EINVAL, "fsdp_state_dict_save: %s",
                             why);
    if (!(f = fdopen(w.fd, "wb"))) {
        rc = fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_state_dict_save: '%s': fdopen failed: %s", w.tmp,
                           strerror(errno));
        goto fail;
    }
    w.fd = -1; /* f owns the descriptor now */
    unsigned char hdr[8 + 8 * FSDP_MAX_DIMS];
    bool ok = fwrite(magic, 1, sizeof magic, f) == sizeof magic;
    put_le(hdr, (uint64_t)sd->n, 8);
    ok = ok && fwrite(hdr, 1, 8, f) == 8;
    for (size_t i = 0; i < sd->n && ok; i++) {
        const fsdp_tensor_t *t = sd->tensors[i];
        size_t len = strlen(sd->names[i]);
        int nd = fsdp_tensor_ndim(t);
        fsdp_dtype_t dt = fsdp_tensor_dtype(t);
        put_le(hdr, len, 2);
        ok = fwrite(hdr, 1, 2, f) == 2 && fwrite(sd->names[i], 1, len, f) == len;
        hdr[0] = (unsigned char)dt;
        hdr[1] = (unsigned char)nd;
        for (int d = 0; d < nd; d++)
            put_le(hdr + 2 + 8 * d, (uint64_t)fsdp_tensor_shape(t)[d], 8);
        size_t hl = 2 + 8 * (size_t)nd;
        ok = ok && fwrite(hdr, 1, hl, f) == hl;
        size_t n = (size_t)fsdp_tensor_numel(t), es = fsdp_dtype_size(dt);
        if (!ok || n == 0) continue;
        data = malloc(n * es);
        if (!data) {
            rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "fsdp_state_dict_save: out of memory");
            goto fail;
        }
        FSDP_TRY(rc, fail, fsdp_tensor_to_host(t, data, n * es));
        fsdp__swap_le(data, n, es);
        ok = fwrite(data, es, n, f) == n;
        free(data);
        data = NULL;
    }
    ok = ok && fflush(f) == 0 && fsync(fileno(f)) == 0;
    int e = errno;
    if (fclose(f) != 0 && ok) {
        ok = false;
        e = errno;
    }
    f = NULL;
    if (!ok) {
        rc = fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_state_dict_save: writing '%s' failed: %s", w.tmp,
                           strerror(e));
        goto fail;
    }
    rc = fsdp__replace_commit(&w, why, sizeof why);
    if (rc < 0) return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_state_dict_save: %s", why);
    return FSDP_OK;
fail:
    free(data);
    if (f) fclose(f);
    fsdp__replace_abort(&w);
    return rc;
}

/* Reads n bytes, counting them against *left; false when the file ends first. */
static bool rd(FILE *f, void *p, size_t n, uint64_t *left) {
    if (n > *left) return false;
    if (n && fread(p, 1, n, f) != n) return false;
    *left -= n;
    return true;
}

int fsdp_state_dict_load(fsdp_ctx_t *ctx, const char *path, fsdp_named_list_t *out) {
    if (out) memset(out, 0, sizeof *out);
    if (!ctx || !path || !out)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_state_dict_load: NULL ctx, path or out");
    int rc = FSDP_OK;
    char *name = NULL;
    void *data = NULL;
    fsdp_tensor_t *t = NULL;
    size_t cap = 0;
    uint64_t i = 0, count = 0;
    struct stat stt;
    char why[256];
    /* a FIFO or a device is refused without blocking (fsdp__open_regular) */
    int fd = fsdp__open_regular(AT_FDCWD, path, O_RDONLY, 0, &stt, why, sizeof why);
    FILE *f = fd >= 0 ? fdopen(fd, "rb") : NULL;
    if (!f) {
        if (fd >= 0) {
            snprintf(why, sizeof why, "fdopen failed: %s", strerror(errno));
            close(fd);
        }
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_state_dict_load: '%s': %s", path, why);
    }
    uint64_t left = (uint64_t)stt.st_size;
    unsigned char hdr[8 * FSDP_MAX_DIMS];
    char mg[8];
    if (!rd(f, mg, 8, &left) || memcmp(mg, magic, 8) != 0) {
        rc = fsdp__ctx_err(ctx, FSDP_EINVAL,
                           "fsdp_state_dict_load: '%s' is not a state dict file (no FSDPSD01 "
                           "magic)",
                           path);
        goto fail;
    }
    if (!rd(f, hdr, 8, &left)) goto truncated;
    count = get_le(hdr, 8);
    /* Each entry takes at least 4 bytes (name length, dtype, ndim). */
    if (count > left / 4) {
        rc = fsdp__ctx_err(ctx, FSDP_EINVAL,
                           "fsdp_state_dict_load: '%s' claims %llu entries in %llu bytes", path,
                           (unsigned long long)count, (unsigned long long)left);
        goto fail;
    }
    out->owned = true;
    for (i = 0; i < count; i++) {
        if (!rd(f, hdr, 2, &left)) goto truncated;
        size_t len = (size_t)get_le(hdr, 2);
        name = malloc(len + 1);
        if (!name) goto oom;
        name[0] = 0;
        name[len] = 0;
        if (!rd(f, name, len, &left)) goto truncated;
        name[len] = 0;
        if (len == 0 || strlen(name) != len) {
            rc = fsdp__ctx_err(ctx, FSDP_EINVAL,
                               "fsdp_state_dict_load: '%s': entry %llu has an empty name or one "
                               "with a NUL byte",
                               path, (unsigned long long)i);
            goto fail;
        }
        if (!rd(f, hdr, 2, &left)) goto truncated;
        int dt = hdr[0], nd = hdr[1];
        if (!fsdp_dtype_valid(dt) || nd > FSDP_MAX_DIMS) {
            rc = fsdp__ctx_err(ctx, FSDP_EINVAL,
                               "fsdp_state_dict_load: '%s': entry '%s' has dtype %d and %d "
                               "dimensions (bad file)",
                               path, name, dt, nd);
            goto fail;
        }
        if (!rd(f, hdr, 8 * (size_t)nd, &left)) goto truncated;
        int64_t shape[FSDP_MAX_DIMS];
        size_t es = fsdp_dtype_size((fsdp_dtype_t)dt);
        bool neg = false, zero = false, big = false;
        for (int d = 0; d < nd; d++) {
            shape[d] = (int64_t)get_le(hdr + 8 * d, 8);
            if (shape[d] < 0) neg = true;
            else if (shape[d] == 0) zero = true;
        }
        if (neg) {
            rc = fsdp__ctx_err(ctx, FSDP_EINVAL,
                               "fsdp_state_dict_load: '%s': entry '%s' has a negative size "
                               "(bad file)",
                               path, name);
            goto fail;
        }
        /* At most what the rest of the file can hold, checked before multiplying on. */
        uint64_t numel = zero ? 0 : 1, max_el = left / es;
        for (int d = 0; d < nd && !zero && !big; d++) {
            uint64_t sz = (uint64_t)shape[d];
            if (numel > max_el / sz) big = true;
            else numel *= sz;
        }
        if (big || numel > max_el) goto truncated;
        size_t bytes = (size_t)numel * es;
        data = malloc(bytes ? bytes : 1);
        if (!data) goto oom;
        if (!rd(f, data, bytes, &left)) goto truncated;
        fsdp__swap_le(data, (size_t)numel, es);
        FSDP_TRY(rc, fail, fsdp_tensor_from_host(ctx, (fsdp_dtype_t)dt, nd, shape, data,
                                                 FSDP_MEM_OTHER, &t));
        FSDP_TRY(rc, fail, fsdp_tensor_set_name(t, name));
        if (fsdp__list_push(out, &cap, name, t, NULL) < 0) goto oom;
        fsdp_tensor_release(t);
        t = NULL;
        free(data);
        data = NULL;
        free(name);
        name = NULL;
    }
    if (left) {
        rc = fsdp__ctx_err(ctx, FSDP_EINVAL,
                           "fsdp_state_dict_load: '%s': %llu unexpected bytes after the last "
                           "entry",
                           path, (unsigned long long)left);
        goto fail;
    }
    fclose(f);
    return FSDP_OK;
truncated:
    rc = fsdp__ctx_err(ctx, FSDP_EINVAL,
                       "fsdp_state_dict_load: '%s' is truncated (entry %llu of %llu%s%s%s)", path,
                       (unsigned long long)i, (unsigned long long)count,
                       name && name[0] ? ", '" : "", name ? name : "",
                       name && name[0] ? "'" : "");
    goto fail;
oom:
    rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "fsdp_state_dict_load: out of memory");
fail:
    fsdp_tensor_release(t);
    free(data);
    free(name);
    fclose(f);
    fsdp_named_list_free(out);
    return rc;
}
