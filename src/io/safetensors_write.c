/* SPDX-License-Identifier: MIT */
/*
 * safetensors_write.c: writing safetensors files atomically.
 *
 * Everything that can be checked is checked before the file system is touched (names, dtypes,
 * metadata, sizes, the JSON). Then the file is written under a temporary name in the
 * destination's directory (rename is atomic only within one file system), fsync'ed, closed
 * (some file systems report write errors only at close), renamed over the destination, and the
 * directory is fsync'ed so that the rename itself survives a power cut. Until the rename, the
 * destination is the previous file; any failure before it removes the temporary file. Only a
 * regular file is replaced: a FIFO, device, directory or symbolic link at the destination is
 * refused, before writing and again just before the rename (fsdp__replace, internal.h).
 *
 * The header is compact JSON ("__metadata__" first, then the tensors in the caller's order),
 * padded with spaces to a multiple of 8 bytes so that the data section, which starts at
 * 8 + header length, is 8-byte aligned; the tensors follow one another in the same order.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "io/io_impl.h"

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Finds a string that occurs twice among n; NULL when all differ. */
static int find_dup(const char *const *s, size_t n, const char **dup) {
    *dup = NULL;
    if (n < 2) return FSDP_OK;
    const char **c = malloc(n * sizeof *c);
    if (!c) return FSDP_ENOMEM;
    memcpy(c, s, n * sizeof *c);
    qsort(c, n, sizeof *c, cmp_str);
    for (size_t i = 1; i < n && !*dup; i++)
        if (strcmp(c[i - 1], c[i]) == 0) *dup = c[i];
    free(c);
    return FSDP_OK;
}

/* The header: compact JSON padded with spaces to a multiple of 8 bytes. */
static int build_header(fsdp_ctx_t *ctx, const char *fn, size_t n, char *const *names,
                        fsdp_tensor_t *const *tensors, const fsdp_safetensors_kv_t *meta,
                        size_t nmeta, char **text, size_t *len) {
    int rc = FSDP_OK;
    char nm[224];
    json_t *root = json_object();
    if (!root) return fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
    if (nmeta) {
        json_t *m = json_object();
        if (!m || json_object_set_new(root, "__metadata__", m) != 0) {
            rc = fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
            goto out;
        }
        for (size_t i = 0; i < nmeta; i++) {
            json_t *v = json_string(meta[i].value);
            if (!v || json_object_set_new(m, meta[i].key, v) != 0) {
                rc = fsdp__ctx_err_or_log(
                    ctx, FSDP_EINVAL,
                    "%s: metadata entry '%s': the key or the value is not valid UTF-8", fn,
                    fsdp__st_shown(meta[i].key, nm, sizeof nm));
                goto out;
            }
        }
    }
    uint64_t off = 0;
    for (size_t i = 0; i < n; i++) {
        const fsdp_tensor_t *t = tensors[i];
        int nd = fsdp_tensor_ndim(t);
        uint64_t nb = (uint64_t)fsdp_tensor_numel(t) * fsdp_dtype_size(fsdp_tensor_dtype(t));
        json_t *e = json_object(), *shape = json_array(), *offs = json_array();
        json_t *dt = json_string(fsdp__st_dtype_name(fsdp_tensor_dtype(t)));
        bool ok = e && shape && offs && dt;
        for (int d = 0; d < nd && ok; d++)
            ok = json_array_append_new(shape, json_integer(fsdp_tensor_shape(t)[d])) == 0;
        ok = ok && json_array_append_new(offs, json_integer((json_int_t)off)) == 0 &&
             json_array_append_new(offs, json_integer((json_int_t)(off + nb))) == 0;
        if (ok) {
            /* The _new setters take their value's reference even when they fail. */
            ok = json_object_set_new(e, "dtype", dt) == 0;
            ok = json_object_set_new(e, "shape", shape) == 0 && ok;
            ok = json_object_set_new(e, "data_offsets", offs) == 0 && ok;
            dt = shape = offs = NULL;
        }
        json_decref(dt);
        json_decref(shape);
        json_decref(offs);
        if (!ok) {
            json_decref(e);
            rc = fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
            goto out;
        }
        if (json_object_set_new(root, names[i], e) != 0) {
            rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                      "%s: tensor '%s': the name is not valid UTF-8", fn,
                                      fsdp__st_shown(names[i], nm, sizeof nm));
            goto out;
        }
        off += nb;
    }
    char *s = json_dumps(root, JSON_COMPACT);
    if (!s) {
        rc = fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "%s: out of memory for the header", fn);
        goto out;
    }
    size_t sl = strlen(s), pad = (8 - sl % 8) % 8;
    if (sl + pad > FSDP_SAFETENSORS_MAX_HEADER) {
        free(s);
        rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                  "%s: the header would have %zu bytes (the limit is %u)", fn,
                                  sl + pad, FSDP_SAFETENSORS_MAX_HEADER);
        goto out;
    }
    char *p = realloc(s, sl + pad + 1);
    if (!p) {
        free(s);
        rc = fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "%s: out of memory for the header", fn);
        goto out;
    }
    memset(p + sl, ' ', pad);
    p[sl + pad] = 0;
    *text = p;
    *len = sl + pad;
out:
    json_decref(root);
    return rc;
}

/* Arguments, checked before anything is written. */
static int check_args(fsdp_ctx_t *ctx, const char *fn, const char *path, size_t n,
                      char *const *names, fsdp_tensor_t *const *tensors,
                      const fsdp_safetensors_kv_t *meta, size_t nmeta) {
    char nm[224];
    if (!path || !path[0])
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: the path is NULL or empty", fn);
    if (n > 0 && (!names || !tensors))
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: the list has no names or tensors", fn);
    if (nmeta > 0 && !meta) return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: meta is NULL", fn);
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (!names[i] || !names[i][0])
            return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: entry %zu has a NULL or empty name",
                                        fn, i);
        fsdp__st_shown(names[i], nm, sizeof nm);
        if (strcmp(names[i], "__metadata__") == 0)
            return fsdp__ctx_err_or_log(
                ctx, FSDP_EINVAL, "%s: tensor '__metadata__': the name is reserved for metadata",
                fn);
        if (!tensors[i])
            return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: tensor '%s' is NULL", fn, nm);
        fsdp_dtype_t dt = fsdp_tensor_dtype(tensors[i]);
        if (!fsdp__st_dtype_name(dt))
            return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                        "%s: tensor '%s' has dtype %d, which safetensors "
                                        "cannot store",
                                        fn, nm, (int)dt);
        uint64_t nb = (uint64_t)fsdp_tensor_numel(tensors[i]) * fsdp_dtype_size(dt);
        if (nb > (uint64_t)INT64_MAX - total)
            return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                        "%s: tensor '%s': the data exceeds 2^63 bytes", fn, nm);
        total += nb;
    }
    const char *dup = NULL;
    if (find_dup((const char *const *)names, n, &dup) < 0)
        return fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
    if (dup)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: tensor '%s': the name appears twice", fn,
                                    fsdp__st_shown(dup, nm, sizeof nm));
    const char **keys = malloc((nmeta ? nmeta : 1) * sizeof *keys);
    if (!keys) return fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
    int rc = FSDP_OK;
    for (size_t i = 0; i < nmeta && rc == FSDP_OK; i++) {
        keys[i] = meta[i].key;
        if (!meta[i].key || !meta[i].value)
            rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                      "%s: metadata entry %zu has a NULL key or value", fn, i);
    }
    if (rc == FSDP_OK && find_dup(keys, nmeta, &dup) < 0)
        rc = fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
    else if (rc == FSDP_OK && dup)
        rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: metadata key '%s' appears twice", fn,
                                  fsdp__st_shown(dup, nm, sizeof nm));
    free(keys);
    return rc;
}

int fsdp__st_write(fsdp_ctx_t *ctx, const char *path, size_t n, char *const *names,
                   fsdp_tensor_t *const *tensors, const fsdp_safetensors_kv_t *meta, size_t nmeta,
                   const char *fn) {
    for (size_t i = 0; !ctx && tensors && i < n; i++)
        if (tensors[i]) ctx = fsdp_tensor_ctx(tensors[i]);
    int rc = check_args(ctx, fn, path, n, names, tensors, meta, nmeta);
    if (rc < 0) return rc;
    char *hdr = NULL, nm[224], why[FSDP_ERR_LEN - 256];
    void *buf = NULL;
    size_t hlen = 0, bufcap = 0;
    /* the temporary file, with the permissions a plain new file gets (0666 under the umask) */
    fsdp__replace_t w = {.fd = -1};
    FSDP_TRY(rc, out, build_header(ctx, fn, n, names, tensors, meta, nmeta, &hdr, &hlen));
    rc = fsdp__replace_begin(&w, AT_FDCWD, path, 0666, true, why, sizeof why);
    if (rc < 0) {
        rc = fsdp__ctx_err_or_log(ctx, rc == FSDP_ENOMEM ? rc : FSDP_EINVAL, "%s: %s", fn, why);
        goto out;
    }
    unsigned char lenb[8];
    for (int i = 0; i < 8; i++)
        lenb[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    if (fsdp__io_write_all(w.fd, lenb, 8) != 0 || fsdp__io_write_all(w.fd, hdr, hlen) != 0) {
        rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: '%s': writing the header failed: %s", fn,
                                  w.tmp, strerror(errno));
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        const fsdp_tensor_t *t = tensors[i];
        size_t es = fsdp_dtype_size(fsdp_tensor_dtype(t)), cnt = (size_t)fsdp_tensor_numel(t);
        size_t nb = cnt * es;
        if (nb == 0) continue;
        const void *direct = fsdp__io_host_bytes(t);
        if (direct) {
            /* a contiguous host tensor in file order: written from where it lies */
            if (fsdp__io_write_all(w.fd, direct, nb) != 0) {
                rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                          "%s: '%s': writing tensor '%s' failed: %s", fn, w.tmp,
                                          fsdp__st_shown(names[i], nm, sizeof nm), strerror(errno));
                goto out;
            }
            continue;
        }
        if (nb > bufcap) {
            free(buf);
            buf = malloc(nb);
            bufcap = buf ? nb : 0;
            if (!buf) {
                rc = fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM,
                                          "%s: tensor '%s': out of memory (%zu bytes)", fn,
                                          fsdp__st_shown(names[i], nm, sizeof nm), nb);
                goto out;
            }
        }
        rc = fsdp_tensor_to_host(t, buf, nb);
        if (rc < 0) {
            rc = fsdp__ctx_err_or_log(ctx, rc, "%s: tensor '%s': reading its elements failed: %s",
                                      fn, fsdp__st_shown(names[i], nm, sizeof nm),
                                      fsdp_ctx_last_error(fsdp_tensor_ctx(t)));
            goto out;
        }
        fsdp__swap_le(buf, cnt, es);
        if (fsdp__io_write_all(w.fd, buf, nb) != 0) {
            rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: '%s': writing tensor '%s' failed: %s",
                                      fn, w.tmp, fsdp__st_shown(names[i], nm, sizeof nm),
                                      strerror(errno));
            goto out;
        }
    }
    rc = fsdp__replace_commit(&w, why, sizeof why);
    if (rc < 0) rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: %s", fn, why);
out:
    fsdp__replace_abort(&w);
    free(hdr);
    free(buf);
    return rc;
}

int fsdp_safetensors_save(fsdp_ctx_t *ctx, const char *path, const fsdp_named_list_t *tensors,
                          const fsdp_safetensors_kv_t *meta, size_t nmeta) {
    static const char fn[] = "fsdp_safetensors_save";
    if (!tensors) return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: the list is NULL", fn);
    return fsdp__st_write(ctx, path, tensors->n, tensors->names, tensors->tensors, meta, nmeta, fn);
}

int fsdp__st_state_dict_unique(const fsdp_module_t *m, fsdp_named_list_t *out) {
    int rc = fsdp_module_state_dict(m, out);
    if (rc < 0) return rc;
    size_t k = 0;
    for (size_t i = 0; i < out->n; i++) {
        bool alias = false;
        for (size_t j = 0; j < k && !alias; j++)
            alias = fsdp__st_same_view(out->tensors[i], out->tensors[j]);
        if (alias) {
            free(out->names[i]);
            fsdp_tensor_release(out->tensors[i]);
            continue;
        }
        out->names[k] = out->names[i];
        out->tensors[k] = out->tensors[i];
        if (out->modules) out->modules[k] = out->modules[i];
        k++;
    }
    out->n = k;
    return FSDP_OK;
}

int fsdp_safetensors_save_module(const fsdp_module_t *m, const char *path,
                                 const fsdp_safetensors_kv_t *meta, size_t nmeta) {
    static const char fn[] = "fsdp_safetensors_save_module";
    if (!m) return fsdp__ctx_err_or_log(NULL, FSDP_EINVAL, "%s: the module is NULL", fn);
    fsdp_ctx_t *ctx = fsdp_module_ctx(m);
    fsdp_named_list_t sd;
    int rc = fsdp__st_state_dict_unique(m, &sd);
    if (rc < 0) return fsdp__ctx_err_or_log(ctx, rc, "%s: %s", fn, fsdp_ctx_last_error(ctx));
    rc = fsdp__st_write(ctx, path, sd.n, sd.names, sd.tensors, meta, nmeta, fn);
    fsdp_named_list_free(&sd);
    return rc;
}
