/* SPDX-License-Identifier: MIT */
/*
 * t_io_trust.c: the files the library reads and replaces are regular files (docs/design.md,
 * "Checkpoints (safetensors)" and "Training data").
 *
 * Reading: a FIFO given to the token loader, the safetensors reader, the checkpoint reader or the
 * state-dict loader is refused at once, naming the path and what it is; so are a directory and a
 * device. Replacing: the safetensors writer, the state-dict writer and the checkpoint index
 * writer refuse a destination that is a FIFO, a symbolic link, a directory or (as root, made with
 * mknod) a device node, and leave it as it was with no temporary file behind; a write that fails
 * (the file size limit) reports the file and keeps the previous one.
 *
 * Every call that a regression could make block (opening a FIFO) runs under a SIGALRM guard
 * (fsu_guard_start, tests/fs_util.h), which interrupts the blocked open, so such a regression fails
 * checks instead of hanging the suite. Scratch files live under one mkdtemp directory under
 * $TMPDIR, removed at the end.
 */
#define _DEFAULT_SOURCE /* mknod, makedev */
#include <config.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <fsdp.h>

#include "fs_util.h"
#include "tap.h"

/* The longest any single call here may take before it counts as a hang. */
#define GUARD_S 10

static char base[512];
static fsdp_ctx_t *ctx;

static const char *in_base(const char *name) {
    return fsu_join(base, name);
}

/* Entries of directory dir whose name contains ".tmp". */
static int temps(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        n += strstr(e->d_name, ".tmp") != NULL;
    if (d) closedir(d);
    return n;
}

static bool is_kind(const char *path, mode_t kind) {
    struct stat st;
    return lstat(path, &st) == 0 && (st.st_mode & S_IFMT) == kind;
}

static void put(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text))
        tap_bail("writing %s: %s", path, strerror(errno));
    close(fd);
}

static bool holds_text(const char *path, const char *text) {
    char buf[64];
    int fd = open(path, O_RDONLY);
    ssize_t n = fd >= 0 ? read(fd, buf, sizeof buf) : -1;
    if (fd >= 0) close(fd);
    return n == (ssize_t)strlen(text) && memcmp(buf, text, (size_t)n) == 0;
}

/* A one-tensor list {"w": n floats equal to v}. */
static void one_tensor(fsdp_named_list_t *l, int64_t n, float v) {
    float *x = malloc((size_t)n * sizeof *x);
    for (int64_t i = 0; i < n; i++)
        x[i] = v;
    memset(l, 0, sizeof *l);
    l->names = calloc(1, sizeof *l->names);
    l->tensors = calloc(1, sizeof *l->tensors);
    l->owned = true;
    l->names[0] = strdup("w");
    if (fsdp_tensor_from_host(ctx, FSDP_DTYPE_F32, 1, &n, x, FSDP_MEM_OTHER, &l->tensors[0]) < 0)
        tap_bail("from_host: %s", fsdp_ctx_last_error(ctx));
    l->n = 1;
    free(x);
}

/* The last error has every one of the (up to three) strings; prints it when not. */
static bool says(const char *msg, const char *a, const char *b, const char *c) {
    bool ok = strstr(msg, a) && (!b || strstr(msg, b)) && (!c || strstr(msg, c));
    if (!ok) tap_diag("message: %s", msg);
    return ok;
}

/* ---- reading -------------------------------------------------------------------------------- */

static void test_read_fifo(void) {
    const char *fifo = in_base("tokens.bin");
    if (mkfifo(fifo, 0600) != 0) {
        tap_skip(9, "mkfifo failed");
        return;
    }
    fsdp_dataset_t *ds = NULL;
    fsu_guard_start(GUARD_S);
    int rc = fsdp_dataset_open(ctx, fifo, FSDP_DATA_AUTO, &ds);
    fsu_guard_stop();
    tap_is_int(rc, FSDP_EINVAL, "[read] the token loader refuses a FIFO at once");
    tap_ok(says(fsdp_ctx_last_error(ctx), fifo, "FIFO", "not a regular file"),
           "[read] naming the path and saying it is a FIFO, not a regular file");
    fsu_guard_start(GUARD_S);
    rc = fsdp_dataset_open(ctx, fifo, FSDP_DATA_TEXT, &ds);
    fsu_guard_stop();
    tap_is_int(rc, FSDP_EINVAL, "[read] as text too");
    fsdp_dataset_destroy(ds);

    fsdp_safetensors_t *st = NULL;
    fsu_guard_start(GUARD_S);
    rc = fsdp_safetensors_open(ctx, fifo, &st);
    fsu_guard_stop();
    tap_is_int(rc, FSDP_EINVAL, "[read] the safetensors reader refuses a FIFO at once");
    tap_ok(says(fsdp_ctx_last_error(ctx), fifo, "FIFO", "not a regular file"),
           "[read] naming the path and saying it is a FIFO");
    fsdp_safetensors_close(st);

    fsdp_named_list_t sd;
    fsu_guard_start(GUARD_S);
    rc = fsdp_state_dict_load(ctx, fifo, &sd);
    fsu_guard_stop();
    tap_is_int(rc, FSDP_EINVAL, "[read] the state-dict loader refuses a FIFO at once");
    tap_ok(says(fsdp_ctx_last_error(ctx), fifo, "FIFO", NULL), "[read] naming it");
    if (rc == FSDP_OK) fsdp_named_list_free(&sd);

    /* index.json of a checkpoint directory */
    const char *ck = in_base("ck");
    mkdir(ck, 0700);
    if (mkfifo(in_base("ck/index.json"), 0600) != 0) tap_bail("mkfifo index.json");
    fsdp_ckpt_t *h = NULL;
    fsu_guard_start(GUARD_S);
    rc = fsdp_ckpt_open(ctx, ck, &h);
    fsu_guard_stop();
    tap_is_int(rc, FSDP_EINVAL, "[read] the checkpoint reader refuses a FIFO index.json at once");
    tap_ok(says(fsdp_ctx_last_error(ctx), "index.json", "FIFO", NULL), "[read] naming it");
    fsdp_ckpt_close(h);
}

static void test_read_others(void) {
    fsdp_dataset_t *ds = NULL;
    int rc = fsdp_dataset_open(ctx, "/dev/null", FSDP_DATA_TEXT, &ds);
    tap_is_int(rc, FSDP_EINVAL, "[read] the token loader refuses a device (/dev/null)");
    tap_ok(says(fsdp_ctx_last_error(ctx), "/dev/null", "character device", NULL),
           "[read] saying it is a character device");
    fsdp_dataset_destroy(ds);
    fsdp_safetensors_t *st = NULL;
    rc = fsdp_safetensors_open(ctx, base, &st);
    tap_is_int(rc, FSDP_EINVAL, "[read] the safetensors reader refuses a directory");
    tap_ok(says(fsdp_ctx_last_error(ctx), base, "directory", "not a regular file"),
           "[read] saying it is a directory");
    fsdp_safetensors_close(st);
}

/* ---- replacing ------------------------------------------------------------------------------ */

/* Saves {"w"} to path with the safetensors writer and the state-dict writer; expects both to be
 * refused naming path and `kind`, with path still of type mode and no temporary file beside it. */
static void expect_refused(const char *path, mode_t mode, const char *kind, const char *what) {
    fsdp_named_list_t l;
    one_tensor(&l, 4, 1.0f);
    fsu_guard_start(GUARD_S);
    int rc = fsdp_safetensors_save(ctx, path, &l, NULL, 0);
    fsu_guard_stop();
    tap_is_int(rc, FSDP_EINVAL, "[replace] the safetensors writer refuses %s", what);
    tap_ok(says(fsdp_ctx_last_error(ctx), path, kind, "not a regular file"),
           "[replace] naming the target and what it is (%s)", kind);
    tap_ok(is_kind(path, mode), "[replace] %s is left as it was", what);
    fsu_guard_start(GUARD_S);
    rc = fsdp_state_dict_save(&l, path);
    fsu_guard_stop();
    tap_is_int(rc, FSDP_EINVAL, "[replace] the state-dict writer refuses %s", what);
    tap_ok(says(fsdp_ctx_last_error(ctx), path, kind, NULL) && is_kind(path, mode),
           "[replace] naming it, and leaving it as it was");
    tap_is_int(temps(base), 0, "[replace] no temporary file is left behind");
    fsdp_named_list_free(&l);
}

static void test_replace(void) {
    const char *fifo = in_base("out-fifo.safetensors");
    if (mkfifo(fifo, 0600) == 0)
        expect_refused(fifo, S_IFIFO, "FIFO", "a FIFO");
    else
        tap_skip(6, "mkfifo failed");

    const char *target = in_base("target.txt"), *link = in_base("out-link.safetensors");
    put(target, "precious");
    if (symlink(target, link) == 0) {
        expect_refused(link, S_IFLNK, "symbolic link", "a symbolic link");
        tap_ok(holds_text(target, "precious"),
               "[replace] the file the link points to is unchanged");
    } else {
        tap_skip(7, "symlink failed");
    }

    const char *dir = in_base("out-dir.safetensors");
    mkdir(dir, 0700);
    expect_refused(dir, S_IFDIR, "directory", "a directory");

    /* A device node: made with /dev/null's numbers, so that a bug writes nowhere harmful. */
    struct stat null_st;
    const char *dev = in_base("out-dev.safetensors");
    if (geteuid() != 0) {
        tap_skip(6, "mknod of a device node needs root (not root)");
    } else if (stat("/dev/null", &null_st) != 0 ||
               mknod(dev, S_IFCHR | 0600,
                     makedev(major(null_st.st_rdev), minor(null_st.st_rdev))) != 0) {
        tap_skip(6, "mknod failed (a container without the capability?)");
    } else {
        expect_refused(dev, S_IFCHR, "character device", "a device node");
    }
}

/* The checkpoint index: a FIFO planted where the index goes is refused, not replaced. */
static void test_index_target(void) {
    const char *dir = in_base("ckpt");
    char stage[1100], idx[1200];
    fsdp_ckpt_staging_path(dir, stage, sizeof stage);
    snprintf(idx, sizeof idx, "%s/%s", stage, FSDP_CKPT_INDEX);
    fsdp_named_list_t l;
    one_tensor(&l, 4, 2.0f);
    fsdp_shard_entry_t e = {.name = strdup("w"),
                            .t = l.tensors[0],
                            .ndim = 1,
                            .shape = {4},
                            .offset = 0,
                            .replicated = true};
    l.tensors[0] = NULL;
    fsdp_shard_list_t pieces = {1, &e};
    int rc = fsdp_ckpt_prepare(ctx, dir);
    if (rc == FSDP_OK) rc = fsdp_ckpt_write_rank(ctx, dir, 0, 1, &pieces);
    if (rc != FSDP_OK) tap_bail("checkpoint set-up: %s", fsdp_ctx_last_error(ctx));
    if (mkfifo(idx, 0600) != 0) {
        tap_skip(3, "mkfifo failed");
    } else {
        fsu_guard_start(GUARD_S);
        rc = fsdp_ckpt_finish(ctx, dir, 1, NULL, 0);
        fsu_guard_stop();
        tap_is_int(rc, FSDP_EINVAL, "[replace] the index writer refuses a FIFO at index.json");
        tap_ok(says(fsdp_ctx_last_error(ctx), idx, "FIFO", NULL) && is_kind(idx, S_IFIFO),
               "[replace] naming it and leaving it as it was");
        tap_is_int(temps(stage), 0, "[replace] no temporary index is left behind");
    }
    free(e.name);
    fsdp_tensor_release(e.t);
    fsdp_named_list_free(&l);
}

/* A write that fails part-way (the file size limit, EFBIG) names the file, keeps the previous
 * file and leaves no temporary file. */
static void test_write_error(void) {
    const char *path = in_base("sd.bin");
    fsdp_named_list_t small, big;
    one_tensor(&small, 4, 1.0f);
    one_tensor(&big, 1 << 16, 2.0f); /* 256 KiB */
    tap_is_int(fsdp_state_dict_save(&small, path), FSDP_OK, "[write error] save a first file");
    struct rlimit old, rl;
    getrlimit(RLIMIT_FSIZE, &old);
    rl = old;
    rl.rlim_cur = 64 * 1024;
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    setrlimit(RLIMIT_FSIZE, &rl);
    int rc = fsdp_state_dict_save(&big, path);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, prev);
    tap_is_int(rc, FSDP_EINVAL, "[write error] a state-dict save that cannot write fails");
    tap_ok(says(fsdp_ctx_last_error(ctx), path, "failed", NULL),
           "[write error] the message names the file");
    fsdp_named_list_t back;
    rc = fsdp_state_dict_load(ctx, path, &back);
    tap_ok(rc == FSDP_OK && back.n == 1 && fsdp_tensor_numel(back.tensors[0]) == 4,
           "[write error] the previous file is still there, whole");
    if (rc == FSDP_OK) fsdp_named_list_free(&back);
    tap_is_int(temps(base), 0, "[write error] no temporary file is left behind");
    fsdp_named_list_free(&small);
    fsdp_named_list_free(&big);
}

int main(void) {
    char templ[512];
    tap_tmppath(templ, sizeof templ, "t_io_trust.XXXXXX");
    if (!mkdtemp(templ)) tap_bail("mkdtemp %s: %s", templ, strerror(errno));
    snprintf(base, sizeof base, "%s", templ);
    if (fsdp_ctx_create(NULL, &ctx) != FSDP_OK) tap_bail("fsdp_ctx_create");
    fsu_guard_install();
    test_read_fifo();
    test_read_others();
    test_replace();
    test_index_target();
    test_write_error();
    fsdp_ctx_destroy(ctx);
    fsu_remove_tree(base);
    return tap_done();
}
