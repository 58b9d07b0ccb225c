/* SPDX-License-Identifier: MIT */
/*
 * ckpt_util.c: the small valid checkpoint of ckpt_util.h, written with the io layer's writer
 * exactly as fsdp_checkpoint_save drives it (prepare, one file per rank, finish), and the file
 * helpers the corrupted-checkpoint tests share.
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_util.h"

static const float v_w[24] = {-1.5f, 0.25f,  3.0f,   -0.0f, 1e-30f, 7.5f,      -2.125f, 100.0f,
                              0.5f,  -0.5f,  1e30f,  42.0f, -7.0f,  0x1p-130f, 9.75f,   -3.25f,
                              11.0f, -12.5f, 0.125f, 6.0f,  -1.0f,  65504.0f,  2.5f,    -0.0625f};
static const uint16_t v_b[10] = {0x3f80, 0xc049, 0x7180, 0x0001, 0x8000,
                                 0x3e80, 0x4049, 0xbf00, 0x7f7f, 0x0080};
static const int64_t v_step[3] = {INT64_MIN, 1234567890123LL, INT64_MAX};
static const float v_dup[6] = {0.5f, -0.25f, 8.0f, 3.5f, -9.0f, 1e-3f};

const struct ckpt_util_tensor ckpt_util_tensors[CKPT_UTIL_NTENSORS] = {
    {"b.bf16", FSDP_DTYPE_BF16, 2, 1, {10, 0}, 10, v_b},
    {"dup.f32", FSDP_DTYPE_F32, 4, 1, {6, 0}, 6, v_dup},
    {"step.i64", FSDP_DTYPE_I64, 8, 1, {3, 0}, 3, v_step},
    {"w.f32", FSDP_DTYPE_F32, 4, 2, {4, 6}, 24, v_w},
};

double ckpt_util_value(const struct ckpt_util_tensor *t, int64_t i) {
    switch (t->dtype) {
    case FSDP_DTYPE_F32:
        return ((const float *)t->data)[i];
    case FSDP_DTYPE_I64:
        return (double)((const int64_t *)t->data)[i];
    case FSDP_DTYPE_BF16: {
        uint32_t u = (uint32_t)((const uint16_t *)t->data)[i] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    default:
        return 0;
    }
}

/* One piece: elements [off, off + n) of tensor k of ckpt_util_tensors. */
struct piece {
    int k;
    int64_t off, n;
    bool replicated;
};

/* The pieces of each rank, in the order they are written. */
static const struct piece rank_pieces[CKPT_UTIL_WORLD][3] = {
    {{3, 0, 8, false}, {2, 0, 3, true}, {1, 0, 3, false}},
    {{3, 8, 8, false}, {0, 0, 5, false}, {1, 0, 3, false}},
    {{3, 16, 8, false}, {0, 5, 5, false}, {1, 3, 3, false}},
};

static int add_piece(fsdp_ctx_t *ctx, fsdp_shard_list_t *l, const struct piece *p) {
    const struct ckpt_util_tensor *t = &ckpt_util_tensors[p->k];
    fsdp_shard_entry_t *e = &l->e[l->n];
    memset(e, 0, sizeof *e);
    int rc = fsdp_tensor_from_host(ctx, t->dtype, 1, &p->n,
                                   (const unsigned char *)t->data + (size_t)p->off * t->esize,
                                   FSDP_MEM_OTHER, &e->t);
    if (rc < 0) return rc;
    e->name = strdup(t->name);
    if (!e->name) {
        fsdp_tensor_release(e->t);
        return FSDP_ENOMEM;
    }
    e->ndim = t->ndim;
    memcpy(e->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim);
    e->offset = p->off;
    e->replicated = p->replicated;
    l->n++;
    return FSDP_OK;
}

int ckpt_util_build(fsdp_ctx_t *ctx, const char *dir) {
    static const fsdp_safetensors_kv_t meta[] = {{"step", "7"}, {"note", "corrupt me"}};
    int rc = fsdp_ckpt_prepare(ctx, dir);
    for (int r = 0; rc == 0 && r < CKPT_UTIL_WORLD; r++) {
        fsdp_shard_entry_t e[3];
        fsdp_shard_list_t l = {0, e};
        for (int i = 0; rc == 0 && i < 3; i++)
            rc = add_piece(ctx, &l, &rank_pieces[r][i]);
        if (rc == 0) rc = fsdp_ckpt_write_rank(ctx, dir, r, CKPT_UTIL_WORLD, &l);
        for (size_t i = 0; i < l.n; i++) {
            free(e[i].name);
            fsdp_tensor_release(e[i].t);
        }
    }
    if (rc == 0) rc = fsdp_ckpt_finish(ctx, dir, CKPT_UTIL_WORLD, meta, 2);
    return rc;
}

const char *ckpt_util_path(const char *dir, const char *name) {
    static char buf[8][512];
    static int k;
    char *p = buf[k++ % 8];
    snprintf(p, sizeof buf[0], "%s/%s", dir, name);
    return p;
}

unsigned char *ckpt_util_read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    unsigned char *p = NULL;
    long sz = -1;
    if (fseek(f, 0, SEEK_END) == 0 && (sz = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0)
        p = malloc(sz > 0 ? (size_t)sz : 1);
    if (p && fread(p, 1, (size_t)sz, f) != (size_t)sz) {
        free(p);
        p = NULL;
    }
    fclose(f);
    if (p) *n = (size_t)sz;
    return p;
}

int ckpt_util_write_file(const char *path, const void *p, size_t n) {
    /* a new file rather than a truncated one: ext4 (auto_da_alloc) flushes a file rewritten by
     * truncation at close, which made thousands of rewrites take seconds */
    unlink(path);
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    int ok = fwrite(p, 1, n, f) == n;
    return fclose(f) == 0 && ok ? 0 : -1;
}

int ckpt_util_copy_dir(const char *src, const char *dst) {
    DIR *d = opendir(src);
    if (!d || (mkdir(dst, 0777) != 0 && errno != EEXIST)) {
        if (d) closedir(d);
        return -1;
    }
    int rc = 0;
    struct dirent *e;
    while (rc == 0 && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        size_t n = 0;
        unsigned char *p = ckpt_util_read_file(ckpt_util_path(src, e->d_name), &n);
        rc = p ? ckpt_util_write_file(ckpt_util_path(dst, e->d_name), p, n) : -1;
        free(p);
    }
    closedir(d);
    return rc;
}

void ckpt_util_rm_dir(const char *path) {
    DIR *d = opendir(path);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        unlink(ckpt_util_path(path, e->d_name));
    }
    if (d) closedir(d);
    rmdir(path);
}

int64_t ckpt_util_file_size(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 ? (int64_t)sb.st_size : -1;
}

unsigned char *ckpt_util_find(unsigned char *p, size_t n, const char *s) {
    size_t k = strlen(s);
    for (size_t i = 0; i + k <= n; i++)
        if (memcmp(p + i, s, k) == 0) return p + i;
    return NULL;
}
