/* SPDX-License-Identifier: MIT */
/*
 * ckpt_read.c: reading a checkpoint directory by byte ranges.
 *
 * Opening reads index.json only (and stats every file); a rank file is opened at its first use,
 * and then its safetensors header is checked against every chunk the index places in it, so a
 * file swapped in from another checkpoint, or rewritten, is caught before a byte of it is used.
 * A read of elements [offset, offset + numel) of a tensor finds the first overlapping chunk by
 * binary search and preads exactly the overlapping bytes of each chunk from there on: a rank
 * loading its shard at another world size reads its part and nothing more.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/ckpt_impl.h"

/* The largest index.json read (a million tensors of several chunks fit). */
#define MAX_INDEX_BYTES (1u << 30)

static char *join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static int read_index(fsdp_ckpt_t *ck) {
    char *path = join(ck->dir, FSDP_CKPT_INDEX);
    if (!path) return fsdp__ckpt_err(ck, FSDP_ENOMEM, "out of memory");
    /* a FIFO or a device is refused without blocking (fsdp__open_regular) */
    char *text = NULL, why[256];
    struct stat sb;
    int rc = FSDP_OK, fd = fsdp__open_regular(AT_FDCWD, path, O_RDONLY, 0, &sb, why, sizeof why);
    if (fd == FSDP_EINVAL) {
        rc = fsdp__ckpt_err(ck, FSDP_EINVAL, "'%s': %s", path, why);
        goto out;
    }
    if (fd < 0) {
        rc = fsdp__ckpt_err(ck, FSDP_EINVAL,
                            "'%s': %s (a checkpoint directory holds %s, written last: was the "
                            "save interrupted, or is this not a checkpoint?)",
                            path, strerror(errno), FSDP_CKPT_INDEX);
        goto out;
    }
    if (sb.st_size <= 0 || (uint64_t)sb.st_size > MAX_INDEX_BYTES) {
        rc = fsdp__ckpt_err(ck, FSDP_EINVAL, "'%s': not a regular file of 1 to %u bytes", path,
                            MAX_INDEX_BYTES);
        goto out;
    }
    size_t len = (size_t)sb.st_size;
    text = malloc(len);
    if (!text) {
        rc = fsdp__ckpt_err(ck, FSDP_ENOMEM, "'%s': out of memory (%zu bytes)", path, len);
        goto out;
    }
    int pr = fsdp__io_pread_all(fd, text, len, 0);
    if (pr != 0) {
        rc = fsdp__ckpt_err(ck, FSDP_EINVAL, "'%s': reading failed: %s", path,
                            pr < 0 ? strerror(errno) : "the file shrank while it was read");
        goto out;
    }
    rc = fsdp__ckpt_parse_index(ck, text, len, path);
out:
    if (fd >= 0) close(fd);
    free(text);
    free(path);
    return rc;
}

int fsdp_ckpt_open(fsdp_ctx_t *ctx, const char *dir, fsdp_ckpt_t **out) {
    if (!out || !dir || !dir[0]) {
        if (out) *out = NULL;
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "fsdp_ckpt_open: %s is NULL or empty",
                                    out ? "dir" : "out");
    }
    *out = NULL;
    fsdp_ckpt_t *ck = fsdp__ckpt_new(ctx, dir);
    if (!ck) return fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "fsdp_ckpt_open: out of memory");
    int rc = read_index(ck);
    for (size_t i = 0; rc == 0 && i < ck->nfiles; i++) {
        char *path = join(dir, ck->f[i].name);
        struct stat sb;
        if (!path)
            rc = fsdp__ckpt_err(ck, FSDP_ENOMEM, "out of memory");
        else if (stat(path, &sb) != 0)
            rc = fsdp__ckpt_err(ck, FSDP_EINVAL, "'%s': %s (the index lists it)", path,
                                strerror(errno));
        else if (!S_ISREG(sb.st_mode) || (uint64_t)sb.st_size != ck->f[i].size)
            rc = fsdp__ckpt_err(ck, FSDP_EINVAL,
                                "'%s' holds %" PRIu64 " bytes; the index says %" PRIu64
                                " (truncated, or from another save?)",
                                path, (uint64_t)sb.st_size, ck->f[i].size);
        free(path);
    }
    if (rc < 0) {
        if (!ctx) fsdp__ctx_err_or_log(NULL, rc, "%s", ck->err);
        fsdp_ckpt_close(ck);
        return rc;
    }
    *out = ck;
    return FSDP_OK;
}

const char *fsdp_ckpt_last_error(const fsdp_ckpt_t *ck) {
    return ck ? ck->err : "";
}
int fsdp_ckpt_world_size(const fsdp_ckpt_t *ck) {
    return ck ? ck->world : 0;
}
size_t fsdp_ckpt_file_count(const fsdp_ckpt_t *ck) {
    return ck ? ck->nfiles : 0;
}
size_t fsdp_ckpt_count(const fsdp_ckpt_t *ck) {
    return ck ? ck->n : 0;
}
size_t fsdp_ckpt_metadata_count(const fsdp_ckpt_t *ck) {
    return ck ? ck->nmeta : 0;
}

int fsdp_ckpt_file(const fsdp_ckpt_t *ck, size_t i, const char **name, uint64_t *size) {
    if (!ck || i >= ck->nfiles) return FSDP_EINVAL;
    if (name) *name = ck->f[i].name;
    if (size) *size = ck->f[i].size;
    return FSDP_OK;
}

static void fill_info(const fsdp_ckpt_t *ck, size_t i, fsdp_ckpt_info_t *o) {
    const struct fsdp__ckpt_tensor *t = &ck->t[i];
    *o = (fsdp_ckpt_info_t){.index = i,
                            .name = t->name,
                            .st_dtype = t->st_dtype,
                            .dtype = t->dtype,
                            .esize = t->esize,
                            .ndim = t->ndim,
                            .numel = t->numel,
                            .replicated = t->replicated,
                            .nchunks = t->nchunks};
    memcpy(o->shape, t->shape, sizeof o->shape);
}

int fsdp_ckpt_info(const fsdp_ckpt_t *ck, size_t i, fsdp_ckpt_info_t *out) {
    if (!ck || !out || i >= ck->n) return FSDP_EINVAL;
    fill_info(ck, i, out);
    return FSDP_OK;
}

int fsdp_ckpt_find(const fsdp_ckpt_t *ck, const char *name, fsdp_ckpt_info_t *out) {
    if (!ck || !name || !out) return FSDP_EINVAL;
    const struct fsdp__ckpt_tensor *t = fsdp__ckpt_lookup(ck, name);
    char nm[224];
    if (!t)
        return fsdp__ckpt_err((fsdp_ckpt_t *)ck, FSDP_EINVAL, "'%s' holds no tensor '%s'", ck->dir,
                              fsdp__st_shown(name, nm, sizeof nm));
    fill_info(ck, (size_t)(t - ck->t), out);
    return FSDP_OK;
}

int fsdp_ckpt_chunk_at(const fsdp_ckpt_t *ck, size_t tensor, size_t j, fsdp_ckpt_chunk_t *out) {
    if (!ck || !out || tensor >= ck->n || j >= ck->t[tensor].nchunks) return FSDP_EINVAL;
    const struct fsdp__ckpt_chunk *c = &ck->t[tensor].c[j];
    *out = (fsdp_ckpt_chunk_t){ck->f[c->file].name, c->file, c->offset, c->numel, c->byte};
    return FSDP_OK;
}

int fsdp_ckpt_metadata_at(const fsdp_ckpt_t *ck, size_t i, fsdp_safetensors_kv_t *out) {
    if (!ck || !out || i >= ck->nmeta) return FSDP_EINVAL;
    *out = (fsdp_safetensors_kv_t){ck->mk[i], ck->mv[i]};
    return FSDP_OK;
}

const char *fsdp_ckpt_metadata(const fsdp_ckpt_t *ck, const char *key) {
    for (size_t i = 0; ck && key && i < ck->nmeta; i++)
        if (strcmp(ck->mk[i], key) == 0) return ck->mv[i];
    return NULL;
}

/* ---- files ------------------------------------------------------------------------------------
 */

/* Opens file fi at its first use and checks its header against every chunk the index puts in
 * it. */
static int file_ready(fsdp_ckpt_t *ck, size_t fi) {
    struct fsdp__ckpt_file *f = &ck->f[fi];
    if (f->st) return FSDP_OK;
    char *path = join(ck->dir, f->name), nm[224], key[4200];
    if (!path) return fsdp__ckpt_err(ck, FSDP_ENOMEM, "out of memory");
    fsdp_safetensors_t *st = NULL;
    char msg[FSDP_ERR_LEN];
    int rc = fsdp__st_open(NULL, path, msg, sizeof msg, &st);
    if (rc < 0) {
        /* the handle is gone: its message comes back in msg */
        rc = fsdp__ckpt_err(ck, rc, "%s", msg);
        free(path);
        return rc;
    }
    if (st->file_size != f->size)
        rc =
            fsdp__ckpt_err(ck, FSDP_EINVAL, "'%s' holds %" PRIu64 " bytes; the index says %" PRIu64,
                           path, st->file_size, f->size);
    if (rc == 0) rc = fsdp__ckpt_check_file_meta(ck, st, path);
    for (size_t i = 0; rc == 0 && i < ck->n; i++) {
        const struct fsdp__ckpt_tensor *t = &ck->t[i];
        for (size_t j = 0; rc == 0 && j < t->nchunks; j++) {
            const struct fsdp__ckpt_chunk *c = &t->c[j];
            if (c->file != fi) continue;
            fsdp__st_shown(t->name, nm, sizeof nm);
            fsdp_safetensors_info_t in;
            bool repl = false;
            int64_t off = -1, shape[FSDP_MAX_DIMS];
            int nd = -1;
            snprintf(key, sizeof key, FSDP__CKPT_PIECE_KEY "%s", t->name);
            if (fsdp_safetensors_find(st, t->name, &in) < 0)
                rc = fsdp__ckpt_err(ck, FSDP_EINVAL,
                                    "'%s' holds no tensor '%s' (the index says it does)", path, nm);
            else if (strcmp(in.st_dtype, t->st_dtype) != 0 || in.numel != c->numel ||
                     in.offset != c->byte ||
                     fsdp__ckpt_parse_piece(fsdp_safetensors_metadata(st, key), &repl, &off, &nd,
                                            shape) < 0 ||
                     repl != t->replicated || off != c->offset || nd != t->ndim ||
                     memcmp(shape, t->shape, sizeof(int64_t) * (size_t)nd) != 0)
                rc = fsdp__ckpt_err(ck, FSDP_EINVAL,
                                    "'%s': tensor '%s' is not the piece the index describes (%s, "
                                    "%" PRId64 " elements at element %" PRId64 ", byte %" PRIu64
                                    "): the file holds %s, %" PRId64 " elements at byte %" PRIu64,
                                    path, nm, t->st_dtype, c->numel, c->offset, c->byte,
                                    in.st_dtype, in.numel, in.offset);
        }
    }
    free(path);
    if (rc < 0) {
        fsdp_safetensors_close(st);
        return rc;
    }
    f->st = st;
    return FSDP_OK;
}

/* ---- reads ------------------------------------------------------------------------------------
 */

/* Checks a read of [offset, offset + numel) of name; *out is the tensor. */
static int check_range(fsdp_ckpt_t *ck, const char *name, int64_t offset, int64_t numel,
                       const struct fsdp__ckpt_tensor **out) {
    char nm[224];
    const struct fsdp__ckpt_tensor *t = name ? fsdp__ckpt_lookup(ck, name) : NULL;
    if (!t)
        return fsdp__ckpt_err(ck, FSDP_EINVAL, "'%s' holds no tensor '%s'", ck->dir,
                              fsdp__st_shown(name, nm, sizeof nm));
    if (offset < 0 || numel < 0 || numel > t->numel || offset > t->numel - numel)
        return fsdp__ckpt_err(ck, FSDP_EINVAL,
                              "'%s': tensor '%s' has %" PRId64 " elements; elements [%" PRId64
                              ", %" PRId64 ") were asked for",
                              ck->dir, fsdp__st_shown(name, nm, sizeof nm), t->numel, offset,
                              offset + numel);
    *out = t;
    return FSDP_OK;
}

int fsdp_ckpt_read_raw(fsdp_ckpt_t *ck, const char *name, int64_t offset, int64_t numel, void *dst,
                       size_t bytes) {
    if (!ck) return FSDP_EINVAL;
    const struct fsdp__ckpt_tensor *t;
    int rc = check_range(ck, name, offset, numel, &t);
    if (rc < 0) return rc;
    char nm[224];
    if (bytes != (size_t)numel * t->esize || (numel && !dst))
        return fsdp__ckpt_err(ck, FSDP_EINVAL,
                              "'%s': tensor '%s': %" PRId64 " elements of %zu bytes need %zu "
                              "bytes; the buffer has %zu%s",
                              ck->dir, fsdp__st_shown(name, nm, sizeof nm), numel, t->esize,
                              (size_t)numel * t->esize, bytes, dst ? "" : " (NULL)");
    /* the first chunk that ends after offset */
    size_t lo = 0, hi = t->nchunks;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (t->c[mid].offset + t->c[mid].numel <= offset)
            lo = mid + 1;
        else
            hi = mid;
    }
    int64_t end = offset + numel;
    for (size_t j = lo; j < t->nchunks && t->c[j].offset < end; j++) {
        const struct fsdp__ckpt_chunk *c = &t->c[j];
        if ((rc = file_ready(ck, c->file)) < 0) {
            char msg[FSDP_ERR_LEN];
            snprintf(msg, sizeof msg, "%s", ck->err);
            return fsdp__ckpt_err(ck, rc, "reading tensor '%s': %s",
                                  fsdp__st_shown(name, nm, sizeof nm), msg);
        }
        int64_t a = c->offset > offset ? c->offset : offset;
        int64_t b = c->offset + c->numel < end ? c->offset + c->numel : end;
        uint64_t at = c->byte + (uint64_t)(a - c->offset) * t->esize;
        int pr = fsdp__io_pread_all(ck->f[c->file].st->fd,
                                    (unsigned char *)dst + (size_t)(a - offset) * t->esize,
                                    (size_t)(b - a) * t->esize, at);
        if (pr != 0)
            return fsdp__ckpt_err(ck, FSDP_EINVAL,
                                  "'%s/%s': reading tensor '%s' at byte %" PRIu64 " failed: %s",
                                  ck->dir, ck->f[c->file].name, fsdp__st_shown(name, nm, sizeof nm),
                                  at, pr < 0 ? strerror(errno) : "the file is shorter than that");
    }
    return FSDP_OK;
}

int fsdp_ckpt_read(fsdp_ckpt_t *ck, const char *name, int64_t offset, int64_t numel,
                   fsdp_dtype_t dt, void *dst, size_t bytes) {
    if (!ck) return FSDP_EINVAL;
    const struct fsdp__ckpt_tensor *t;
    int rc = check_range(ck, name, offset, numel, &t);
    if (rc < 0) return rc;
    char nm[224];
    size_t ds = fsdp_dtype_size(dt);
    if (ds == 0 || bytes != (size_t)numel * ds || (numel && !dst))
        return fsdp__ckpt_err(ck, FSDP_EINVAL,
                              "'%s': tensor '%s': reading %" PRId64
                              " elements as dtype %d needs a buffer of their size; it has %zu "
                              "bytes",
                              ck->dir, fsdp__st_shown(name, nm, sizeof nm), numel, (int)dt, bytes);
    if (t->dtype == FSDP_DTYPE_COUNT)
        return fsdp__ckpt_err(ck, FSDP_ENOTSUP,
                              "'%s': tensor '%s' is stored as %s, which libfsdp cannot convert "
                              "(fsdp_ckpt_read_raw reads it as stored)",
                              ck->dir, fsdp__st_shown(name, nm, sizeof nm), t->st_dtype);
    if (t->dtype == dt) {
        if ((rc = fsdp_ckpt_read_raw(ck, name, offset, numel, dst, bytes)) < 0) return rc;
        fsdp__swap_le(dst, (size_t)numel, ds);
        return FSDP_OK;
    }
    /* another dtype: through a bounded buffer */
    const int64_t step = (int64_t)((1u << 20) / t->esize);
    void *buf = malloc((size_t)(numel < step ? (numel ? numel : 1) : step) * t->esize);
    if (!buf) return fsdp__ckpt_err(ck, FSDP_ENOMEM, "out of memory");
    for (int64_t i = 0; rc == 0 && i < numel; i += step) {
        int64_t k = numel - i < step ? numel - i : step;
        rc = fsdp_ckpt_read_raw(ck, name, offset + i, k, buf, (size_t)k * t->esize);
        if (rc == 0) {
            fsdp__swap_le(buf, (size_t)k, t->esize);
            rc = fsdp_dtype_convert((unsigned char *)dst + (size_t)i * ds, dt, buf, t->dtype,
                                    (size_t)k);
        }
    }
    free(buf);
    return rc;
}

int fsdp_ckpt_read_pieces(fsdp_ckpt_t *ck, const char *prefix, const fsdp_shard_list_t *want) {
    if (!ck || !want) return FSDP_EINVAL;
    size_t plen = prefix ? strlen(prefix) : 0, cap = 0;
    char *full = NULL, nm[224], s1[200], s2[200];
    int rc = FSDP_OK;
    /* everything checked first, then read */
    for (int pass = 0; pass < 2 && rc == 0; pass++) {
        for (size_t i = 0; rc == 0 && i < want->n; i++) {
            const fsdp_shard_entry_t *e = &want->e[i];
            size_t need = plen + (e->name ? strlen(e->name) : 0) + 1;
            if (need > cap) {
                char *g = realloc(full, need);
                if (!g) {
                    rc = fsdp__ckpt_err(ck, FSDP_ENOMEM, "out of memory");
                    break;
                }
                full = g;
                cap = need;
            }
            snprintf(full, cap, "%s%s", prefix ? prefix : "", e->name ? e->name : "");
            fsdp__st_shown(full, nm, sizeof nm);
            const struct fsdp__ckpt_tensor *t = fsdp__ckpt_lookup(ck, full);
            int64_t cnt = e->t ? fsdp_tensor_numel(e->t) : 0;
            if (pass == 0) {
                if (!t) {
                    rc = fsdp__ckpt_err(ck, FSDP_EINVAL, "'%s' holds no tensor '%s'", ck->dir, nm);
                } else if (!e->t || e->ndim != t->ndim ||
                           memcmp(e->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim) != 0) {
                    rc = fsdp__ckpt_err(ck, FSDP_EINVAL,
                                        "'%s': tensor '%s' is %s there but %s here%s", ck->dir, nm,
                                        fsdp__st_shape_str(t->shape, t->ndim, s1, sizeof s1),
                                        fsdp__st_shape_str(e->shape, e->ndim, s2, sizeof s2),
                                        e->t ? "" : " (and the piece is NULL)");
                } else if (e->offset < 0 || cnt > t->numel - e->offset) {
                    rc = fsdp__ckpt_err(ck, FSDP_EINVAL,
                                        "'%s': tensor '%s': elements [%" PRId64 ", %" PRId64
                                        ") asked of %" PRId64,
                                        ck->dir, nm, e->offset, e->offset + cnt, t->numel);
                } else if (t->dtype == FSDP_DTYPE_COUNT) {
                    rc = fsdp__ckpt_err(ck, FSDP_ENOTSUP,
                                        "'%s': tensor '%s' is stored as %s, which libfsdp cannot "
                                        "convert",
                                        ck->dir, nm, t->st_dtype);
                }
                continue;
            }
            if (cnt == 0) continue;
            fsdp_dtype_t dt = fsdp_tensor_dtype(e->t);
            size_t nb = (size_t)cnt * fsdp_dtype_size(dt);
            void *direct = t->dtype == dt ? fsdp__io_host_bytes(e->t) : NULL;
            if (direct) {
                /* a contiguous host tensor of the stored dtype: read into it where it lies */
                rc = fsdp_ckpt_read_raw(ck, full, e->offset, cnt, direct, nb);
                continue;
            }
            void *buf = malloc(nb);
            if (!buf) {
                rc = fsdp__ckpt_err(ck, FSDP_ENOMEM, "'%s': out of memory (%zu bytes)", nm, nb);
                break;
            }
            rc = fsdp_ckpt_read(ck, full, e->offset, cnt, dt, buf, nb);
            if (rc == 0 && (rc = fsdp_tensor_copy_from_host(e->t, buf, nb)) < 0)
                rc = fsdp__ckpt_err(ck, rc, "'%s': copying tensor '%s' into place: %s", ck->dir, nm,
                                    fsdp_ctx_last_error(fsdp_tensor_ctx(e->t)));
            free(buf);
        }
    }
    free(full);
    return rc;
}

int fsdp_ckpt_check_files(fsdp_ckpt_t *ck) {
    if (!ck) return FSDP_EINVAL;
    int rc = FSDP_OK;
    for (size_t i = 0; rc == 0 && i < ck->nfiles; i++)
        rc = file_ready(ck, i);
    return rc;
}

int fsdp_ckpt_verify(fsdp_ckpt_t *ck) {
    int rc = fsdp_ckpt_check_files(ck);
    if (rc < 0) return rc;
    const size_t bufsz = 4u << 20;
    unsigned char *buf = rc == 0 ? malloc(bufsz) : NULL;
    if (rc == 0 && !buf) rc = fsdp__ckpt_err(ck, FSDP_ENOMEM, "out of memory");
    for (size_t i = 0; rc == 0 && i < ck->n; i++) {
        const struct fsdp__ckpt_tensor *t = &ck->t[i];
        int64_t step = (int64_t)(bufsz / t->esize);
        for (int64_t o = 0; rc == 0 && o < t->numel; o += step) {
            int64_t k = t->numel - o < step ? t->numel - o : step;
            rc = fsdp_ckpt_read_raw(ck, t->name, o, k, buf, (size_t)k * t->esize);
        }
    }
    free(buf);
    return rc;
}
