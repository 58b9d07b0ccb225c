/* SPDX-License-Identifier: MIT */
/*
 * ckpt_write.c: writing a checkpoint directory: the staging directory, each rank's file, and
 * rank 0's index and publication (the protocol is at the top of fsdp/checkpoint.h).
 *
 * Atomicity. Readers only ever open <dir>, and <dir> only ever changes by one rename: of a
 * complete, fsync'ed staging directory whose index was written last. Where <dir> already exists,
 * Linux's renameat2(RENAME_EXCHANGE) swaps the two in one step, so some checkpoint is at <dir> at
 * every instant; elsewhere (or on a file system without it) the old one is first renamed aside,
 * which leaves a moment with no <dir> but never a partial one. The replaced checkpoint is then
 * removed. A save killed at any point leaves <dir> as it was, and at worst a staging directory,
 * which the next save of <dir> clears.
 *
 * The index is built from the rank files' headers, not from a message of every rank: rank 0
 * reads W headers (small), so the collective part of a save is two barriers, and the index can
 * only describe bytes that really are on disk.
 */
#define _GNU_SOURCE /* renameat2 and RENAME_EXCHANGE, where the C library has them */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/ckpt_impl.h"

void fsdp_shard_list_free(fsdp_shard_list_t *l) {
    if (!l) return;
    for (size_t i = 0; i < l->n; i++) {
        free(l->e[i].name);
        fsdp_tensor_release(l->e[i].t);
    }
    free(l->e);
    *l = (fsdp_shard_list_t){0};
}

int fsdp_ckpt_staging_path(const char *dir, char *buf, size_t cap) {
    if (!dir || !dir[0] || !buf) return FSDP_EINVAL;
    int n = snprintf(buf, cap, "%s.partial", dir);
    return n > 0 && (size_t)n < cap ? FSDP_OK : FSDP_EINVAL;
}

/* Whether name is something a checkpoint writer leaves in its directory. */
static bool ours(const char *name) {
    int r = 0, w = 0, k = 0;
    /* "index.json.tmp" is the temporary index of earlier versions */
    if (strcmp(name, FSDP_CKPT_INDEX) == 0 || strcmp(name, FSDP_CKPT_INDEX ".tmp") == 0 ||
        strncmp(name, FSDP_CKPT_INDEX ".tmp-", sizeof FSDP_CKPT_INDEX + 4) == 0)
        return true;
    if (sscanf(name, "rank-%d-of-%d.safetensors%n", &r, &w, &k) == 2 && k > 0) {
        const char *rest = name + k;
        return !*rest || strncmp(rest, ".tmp-", 5) == 0; /* the safetensors writer's temp */
    }
    return false;
}

/* FSDP_OK when open directory d (path) holds only what a checkpoint writer makes. */
static int only_ours(fsdp_ctx_t *ctx, DIR *d, const char *path, const char *fn) {
    struct dirent *de;
    rewinddir(d);
    while ((de = readdir(d)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0 || ours(de->d_name))
            continue;
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "%s: '%s' holds '%s', which no checkpoint writer makes: not "
                                    "removing it (move it away and save again)",
                                    fn, path, de->d_name);
    }
    return FSDP_OK;
}

/* Removes directory path and the files in it; with check, refuses (removing nothing) when it
 * holds anything a checkpoint writer does not write. ENOENT is success. */
static int remove_dir(fsdp_ctx_t *ctx, const char *path, bool check, const char *fn) {
    struct stat sb;
    /* lstat: a symbolic link planted at path is refused, never followed into its target */
    if (lstat(path, &sb) != 0) {
        if (errno == ENOENT) return FSDP_OK;
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: cannot stat '%s': %s", fn, path,
                                    strerror(errno));
    }
    if (!S_ISDIR(sb.st_mode))
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "%s: '%s' is %s, not a directory: not removing it", fn, path,
                                    fsdp__file_kind(sb.st_mode));
    DIR *d = opendir(path);
    if (!d && errno == ENOENT) return FSDP_OK;
    if (!d)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: cannot open '%s': %s", fn, path,
                                    strerror(errno));
    int rc = check ? only_ours(ctx, d, path, fn) : FSDP_OK;
    rewinddir(d);
    struct dirent *de;
    while (rc == 0 && (de = readdir(d)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
        if (unlinkat(dirfd(d), de->d_name, 0) != 0)
            rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: cannot remove '%s/%s': %s", fn, path,
                                      de->d_name, strerror(errno));
    }
    closedir(d);
    if (rc == 0 && rmdir(path) != 0)
        rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: cannot remove '%s': %s", fn, path,
                                  strerror(errno));
    return rc;
}

/* Whether dir may be replaced by a new checkpoint: absent, or a directory holding only what a
 * checkpoint writer makes (publishing removes the replaced directory's files). */
static int replaceable(fsdp_ctx_t *ctx, const char *dir, const char *fn) {
    struct stat sb;
    /* lstat, as publish(): a link at dir is not followed (a rename would replace the link) */
    if (lstat(dir, &sb) != 0) return FSDP_OK;
    if (!S_ISDIR(sb.st_mode))
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "%s: '%s' exists and is not a directory (it is %s)", fn, dir,
                                    fsdp__file_kind(sb.st_mode));
    DIR *d = opendir(dir);
    if (!d)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: cannot open '%s': %s", fn, dir,
                                    strerror(errno));
    int rc = only_ours(ctx, d, dir, fn);
    closedir(d);
    return rc;
}

/* mkdir -p of the directory that holds path. */
static int make_parents(const char *path) {
    char *p = strdup(path);
    if (!p) return -1;
    for (char *s = p + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        if (mkdir(p, 0777) != 0 && errno != EEXIST) {
            free(p);
            return -1;
        }
        *s = '/';
    }
    free(p);
    return 0;
}

int fsdp_ckpt_remove(fsdp_ctx_t *ctx, const char *path) {
    if (!path || !path[0])
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "fsdp_ckpt_remove: path is NULL or empty");
    return remove_dir(ctx, path, true, "fsdp_ckpt_remove");
}

int fsdp_ckpt_prepare(fsdp_ctx_t *ctx, const char *dir) {
    static const char fn[] = "fsdp_ckpt_prepare";
    char stage[4096];
    if (fsdp_ckpt_staging_path(dir, stage, sizeof stage) < 0)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: the directory name is empty or too long",
                                    fn);
    int rc = replaceable(ctx, dir, fn);
    if (rc == 0) rc = remove_dir(ctx, stage, true, fn);
    if (rc < 0) return rc;
    if (make_parents(stage) != 0 || mkdir(stage, 0777) != 0)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: cannot create '%s': %s", fn, stage,
                                    strerror(errno));
    return FSDP_OK;
}

int fsdp_ckpt_write_rank(fsdp_ctx_t *ctx, const char *dir, int rank, int world,
                         const fsdp_shard_list_t *pieces) {
    return fsdp_ckpt_write_rank_meta(ctx, dir, rank, world, pieces, NULL, 0);
}

int fsdp_ckpt_write_rank_meta(fsdp_ctx_t *ctx, const char *dir, int rank, int world,
                              const fsdp_shard_list_t *pieces, const fsdp_safetensors_kv_t *cmeta,
                              size_t ncmeta) {
    static const char fn[] = "fsdp_ckpt_write_rank";
    char stage[4096], path[4200], nm[224];
    if (!pieces || world < 1 || rank < 0 || rank >= world || (ncmeta && !cmeta))
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: rank %d of world %d%s", fn, rank, world,
                                    !pieces            ? ", pieces NULL"
                                    : ncmeta && !cmeta ? ", metadata NULL"
                                                       : "");
    for (size_t i = 0; i < ncmeta; i++)
        if (!cmeta[i].key || !cmeta[i].value)
            return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                        "%s: metadata entry %zu has a NULL key or value", fn, i);
    if (fsdp_ckpt_staging_path(dir, stage, sizeof stage) < 0 ||
        snprintf(path, sizeof path, "%s/" FSDP__CKPT_RANK_FMT, stage, rank, world) >=
            (int)sizeof path)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: the directory name is empty or too long",
                                    fn);
    size_t n = pieces->n, nv = n + ncmeta;
    char **names = calloc(n ? n : 1, sizeof *names);
    fsdp_tensor_t **ts = calloc(n ? n : 1, sizeof *ts);
    fsdp_safetensors_kv_t *meta = calloc(nv ? nv : 1, sizeof *meta);
    char **vals = calloc(2 * (nv ? nv : 1), sizeof *vals);
    int rc = FSDP_OK;
    size_t k = 0;
    if (!names || !ts || !meta || !vals) {
        rc = fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        const fsdp_shard_entry_t *e = &pieces->e[i];
        int64_t total = 1, cnt = e->t ? fsdp_tensor_numel(e->t) : -1;
        for (int d = 0; d >= 0 && d < e->ndim && d < FSDP_MAX_DIMS; d++)
            total *= e->shape[d];
        fsdp__st_shown(e->name, nm, sizeof nm);
        if (!e->name || !e->t || e->ndim < 0 || e->ndim > FSDP_MAX_DIMS || e->offset < 0 ||
            cnt > total - e->offset || (e->replicated && (e->offset != 0 || cnt != total))) {
            rc = fsdp__ctx_err_or_log(
                ctx, FSDP_EINVAL,
                "%s: rank %d: piece '%s' (%" PRId64 " elements at offset %" PRId64
                "%s) does not fit its global tensor of %" PRId64 " elements",
                fn, rank, nm, cnt, e->offset, e->replicated ? ", replicated" : "", total);
            goto out;
        }
        /* a rank that holds nothing of a tensor writes nothing of it; a tensor with no elements
         * at all is written (empty), so the index lists it */
        if (cnt == 0 && total > 0) continue;
        size_t vcap = 40 + 24 * (size_t)e->ndim,
               kcap = strlen(e->name) + sizeof FSDP__CKPT_PIECE_KEY;
        vals[2 * k] = malloc(kcap);
        vals[2 * k + 1] = malloc(vcap);
        if (!vals[2 * k] || !vals[2 * k + 1]) {
            rc = fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
            k++;
            goto out;
        }
        snprintf(vals[2 * k], kcap, FSDP__CKPT_PIECE_KEY "%s", e->name);
        int len = snprintf(vals[2 * k + 1], vcap, "%d %" PRId64 " %d", e->replicated ? 1 : 0,
                           e->offset, e->ndim);
        for (int d = 0; d < e->ndim; d++)
            len += snprintf(vals[2 * k + 1] + len, vcap - (size_t)len, " %" PRId64, e->shape[d]);
        names[k] = e->name;
        ts[k] = e->t;
        meta[k] = (fsdp_safetensors_kv_t){vals[2 * k], vals[2 * k + 1]};
        k++;
    }
    /* the checkpoint's own metadata, copied into every rank file: the files of one save carry
     * the same step and run id, which the index build and every load compare */
    size_t nk = k;
    for (size_t i = 0; i < ncmeta; i++) {
        size_t kcap = strlen(cmeta[i].key) + sizeof FSDP__CKPT_META_KEY;
        if (!(vals[2 * nk] = malloc(kcap))) {
            rc = fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
            goto out;
        }
        snprintf(vals[2 * nk], kcap, FSDP__CKPT_META_KEY "%s", cmeta[i].key);
        meta[nk] = (fsdp_safetensors_kv_t){vals[2 * nk], cmeta[i].value};
        nk++;
    }
    rc = fsdp__st_write(ctx, path, k, names, ts, meta, nk, fn);
out:
    for (size_t i = 0; vals && i < 2 * nv; i++)
        free(vals[i]);
    free(vals);
    free(meta);
    free(ts);
    free(names);
    return rc;
}

/* ---- rank 0: the index ------------------------------------------------------------------------
 */

/* One piece found in a rank file's header. */
struct found {
    const char *name; /* borrowed from the open file */
    size_t file;
    fsdp_safetensors_info_t info;
    bool replicated;
    int64_t offset;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
};

static int cmp_found(const void *a, const void *b) {
    const struct found *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    if (c) return c;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    return x->file < y->file ? -1 : x->file > y->file ? 1 : 0;
}

/* Reads the pieces of open rank file st (number fi) into *fo (grown). */
static int collect(fsdp_ckpt_t *ck, fsdp_safetensors_t *st, size_t fi, struct found **fo,
                   size_t *nf, size_t *cap) {
    size_t cnt = fsdp_safetensors_count(st);
    char key[4200], nm[224];
    for (size_t i = 0; i < cnt; i++) {
        if (*nf == *cap) {
            size_t nc = *cap ? 2 * *cap : 256;
            struct found *g = realloc(*fo, nc * sizeof *g);
            if (!g) return fsdp__ckpt_err(ck, FSDP_ENOMEM, "'%s': out of memory", ck->dir);
            *fo = g;
            *cap = nc;
        }
        struct found *f = &(*fo)[*nf];
        fsdp_safetensors_info(st, i, &f->info);
        f->name = f->info.name;
        f->file = fi;
        snprintf(key, sizeof key, FSDP__CKPT_PIECE_KEY "%s", f->name);
        if (fsdp__ckpt_parse_piece(fsdp_safetensors_metadata(st, key), &f->replicated, &f->offset,
                                   &f->ndim, f->shape) < 0 ||
            (f->replicated
                 ? f->info.ndim != f->ndim ||
                       memcmp(f->info.shape, f->shape, sizeof(int64_t) * (size_t)f->ndim) != 0
                 : f->info.ndim != 1))
            return fsdp__ckpt_err(ck, FSDP_EINVAL,
                                  "'%s/%s': tensor '%s' has no valid '%s%s' metadata (a 1-D "
                                  "piece's place in its global tensor, or a replicated tensor's "
                                  "own shape)",
                                  ck->dir, ck->f[fi].name, fsdp__st_shown(f->name, nm, sizeof nm),
                                  FSDP__CKPT_PIECE_KEY, nm);
        (*nf)++;
    }
    return FSDP_OK;
}

/* Builds ck's tensors from the found pieces (sorted): equal pieces of replicas once; every piece
 * of a name must agree on dtype, shape and replication. */
static int build(fsdp_ckpt_t *ck, struct found *fo, size_t nf) {
    char nm[224], s1[200], s2[200];
    qsort(fo, nf, sizeof *fo, cmp_found);
    ck->t = calloc(nf ? nf : 1, sizeof *ck->t);
    if (!ck->t) return fsdp__ckpt_err(ck, FSDP_ENOMEM, "'%s': out of memory", ck->dir);
    for (size_t i = 0; i < nf;) {
        size_t j = i;
        while (j < nf && strcmp(fo[j].name, fo[i].name) == 0)
            j++;
        struct fsdp__ckpt_tensor *t = &ck->t[ck->n];
        *t = (struct fsdp__ckpt_tensor){0};
        t->name = strdup(fo[i].name);
        t->c = calloc(j - i, sizeof *t->c);
        ck->n++;
        if (!t->name || !t->c)
            return fsdp__ckpt_err(ck, FSDP_ENOMEM, "'%s': out of memory", ck->dir);
        t->st_dtype = fsdp__st_dtype_parse(fo[i].info.st_dtype, &t->esize, &t->dtype);
        t->ndim = fo[i].ndim;
        memcpy(t->shape, fo[i].shape, sizeof t->shape);
        t->replicated = fo[i].replicated;
        fsdp__st_shown(fo[i].name, nm, sizeof nm);
        for (size_t k = i; k < j; k++) {
            const struct found *f = &fo[k];
            bool same_shape = f->ndim == t->ndim &&
                              memcmp(f->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim) == 0;
            if (strcmp(f->info.st_dtype, t->st_dtype) != 0 || !same_shape ||
                f->replicated != t->replicated)
                return fsdp__ckpt_err(
                    ck, FSDP_EINVAL, "'%s': tensor '%s' is %s %s%s in '%s' but %s %s%s in '%s'",
                    ck->dir, nm, t->st_dtype, fsdp__st_shape_str(t->shape, t->ndim, s1, sizeof s1),
                    t->replicated ? " (replicated)" : "", ck->f[fo[i].file].name, f->info.st_dtype,
                    fsdp__st_shape_str(f->shape, f->ndim, s2, sizeof s2),
                    f->replicated ? " (replicated)" : "", ck->f[f->file].name);
            if (f->info.numel == 0) continue; /* an empty tensor: listed, with no chunk */
            if (t->nchunks > 0) {
                const struct fsdp__ckpt_chunk *p = &t->c[t->nchunks - 1];
                /* replicas wrote the same piece: index it once (the lowest rank's) */
                if (p->offset == f->offset && p->numel == f->info.numel) continue;
            }
            t->c[t->nchunks++] =
                (struct fsdp__ckpt_chunk){f->file, f->offset, f->info.numel, f->info.offset};
        }
        i = j;
    }
    return FSDP_OK;
}

/* fsyncs directory path itself. */
static int sync_this_dir(const char *path) {
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return -1;
    int rc = fsync(fd), e = errno;
    close(fd);
    if (rc != 0 && e == EINVAL) rc = 0;
    errno = e;
    return rc;
}

/* Puts staging directory stage at dir (see the top of this file). */
static int publish(fsdp_ctx_t *ctx, const char *stage, const char *dir, const char *fn) {
    struct stat sb;
    /* lstat: a symbolic link (or anything but a directory) at dir is refused, not followed; an
     * exchange with a link would publish the checkpoint while the link's target stayed */
    bool exists = lstat(dir, &sb) == 0;
    if (exists && !S_ISDIR(sb.st_mode))
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "%s: '%s' exists and is not a directory (it is %s): "
                                    "refusing to replace it",
                                    fn, dir, fsdp__file_kind(sb.st_mode));
    if (!exists) {
        if (rename(stage, dir) != 0)
            return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "%s: renaming '%s' to '%s' failed: %s",
                                        fn, stage, dir, strerror(errno));
    } else {
        bool swapped = false;
#if defined(RENAME_EXCHANGE)
        swapped = renameat2(AT_FDCWD, stage, AT_FDCWD, dir, RENAME_EXCHANGE) == 0;
#endif
        if (!swapped) {
            char aside[4200];
            snprintf(aside, sizeof aside, "%s.old", stage);
            int rc = remove_dir(ctx, aside, false, fn);
            if (rc < 0) return rc;
            if (rename(dir, aside) != 0 || rename(stage, dir) != 0)
                return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                            "%s: replacing '%s' with '%s' failed: %s", fn, dir,
                                            stage, strerror(errno));
            if (fsdp__sync_dir_of(AT_FDCWD, dir) != 0)
                return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                            "%s: syncing the directory of '%s': %s", fn, dir,
                                            strerror(errno));
            return remove_dir(ctx, aside, false, fn);
        }
    }
    if (fsdp__sync_dir_of(AT_FDCWD, dir) != 0)
        return fsdp__ctx_err_or_log(
            ctx, FSDP_EINVAL,
            "%s: '%s' is in place, but syncing its parent directory failed: "
            "%s",
            fn, dir, strerror(errno));
    /* after an exchange, the staging name holds the replaced checkpoint */
    return exists ? remove_dir(ctx, stage, false, fn) : FSDP_OK;
}

int fsdp_ckpt_finish(fsdp_ctx_t *ctx, const char *dir, int world, const fsdp_safetensors_kv_t *meta,
                     size_t nmeta) {
    static const char fn[] = "fsdp_ckpt_finish";
    char stage[4096], path[4200];
    if (world < 1 || (nmeta && !meta) || fsdp_ckpt_staging_path(dir, stage, sizeof stage) < 0)
        return fsdp__ctx_err_or_log(
            ctx, FSDP_EINVAL, "%s: world %d, %zu metadata entries%s, directory '%s'", fn, world,
            nmeta, nmeta && !meta ? " but meta NULL" : "", dir ? dir : "(null)");
    fsdp_ckpt_t *ck = fsdp__ckpt_new(ctx, stage);
    fsdp_safetensors_t **sts = calloc((size_t)world, sizeof *sts);
    struct found *fo = NULL;
    size_t nf = 0, fcap = 0;
    int rc = FSDP_OK;
    if (!ck || !sts || !(ck->f = calloc((size_t)world, sizeof *ck->f)) ||
        !(ck->mk = calloc(nmeta ? nmeta : 1, sizeof *ck->mk)) ||
        !(ck->mv = calloc(nmeta ? nmeta : 1, sizeof *ck->mv))) {
        rc = fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "%s: out of memory", fn);
        goto out;
    }
    ck->world = world;
    for (size_t i = 0; i < nmeta; i++) {
        for (size_t j = 0; j < i; j++)
            if (!meta[i].key || strcmp(meta[i].key, meta[j].key) == 0) {
                rc = fsdp__ckpt_err(ck, FSDP_EINVAL, "%s: metadata key '%s' is NULL or given twice",
                                    fn, meta[i].key ? meta[i].key : "(null)");
                goto out;
            }
        if (!meta[i].key || !meta[i].value) {
            rc = fsdp__ckpt_err(ck, FSDP_EINVAL, "%s: metadata entry %zu has a NULL key or value",
                                fn, i);
            goto out;
        }
        ck->mk[i] = strdup(meta[i].key);
        ck->mv[i] = strdup(meta[i].value);
        ck->nmeta = i + 1;
        if (!ck->mk[i] || !ck->mv[i]) {
            rc = fsdp__ckpt_err(ck, FSDP_ENOMEM, "%s: out of memory", fn);
            goto out;
        }
    }
    for (int r = 0; r < world; r++) {
        char fname[64];
        snprintf(fname, sizeof fname, FSDP__CKPT_RANK_FMT, r, world);
        snprintf(path, sizeof path, "%s/%s", stage, fname);
        ck->f[r].name = strdup(fname);
        ck->nfiles = (size_t)r + 1;
        if (!ck->f[r].name) {
            rc = fsdp__ckpt_err(ck, FSDP_ENOMEM, "%s: out of memory", fn);
            goto out;
        }
        char msg[FSDP_ERR_LEN];
        if ((rc = fsdp__st_open(NULL, path, msg, sizeof msg, &sts[r])) < 0) {
            rc = fsdp__ckpt_err(ck, rc, "%s: rank %d's file: %s", fn, r, msg);
            goto out;
        }
        ck->f[r].size = sts[r]->file_size;
        FSDP_TRY(rc, out, fsdp__ckpt_check_file_meta(ck, sts[r], path));
        FSDP_TRY(rc, out, collect(ck, sts[r], (size_t)r, &fo, &nf, &fcap));
    }
    FSDP_TRY(rc, out, build(ck, fo, nf));
    FSDP_TRY(rc, out, fsdp__ckpt_check(ck, stage));
    FSDP_TRY(rc, out, fsdp__ckpt_write_index(ck, stage));
    if (sync_this_dir(stage) != 0) {
        rc = fsdp__ckpt_err(ck, FSDP_EINVAL, "%s: syncing '%s' failed: %s", fn, stage,
                            strerror(errno));
        goto out;
    }
    rc = publish(ctx, stage, dir, fn);
out:
    free(fo); /* names borrowed from the open files, closed below */
    for (int r = 0; sts && r < world; r++)
        fsdp_safetensors_close(sts[r]);
    free(sts);
    fsdp_ckpt_close(ck);
    return rc;
}
