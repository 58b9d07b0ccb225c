/* SPDX-License-Identifier: MIT */
/*
 * t_ckpt_complete.c: complete checkpoints only (issue 26 item 6, "Complete checkpoints only"),
 * and the two atomic-write fixes that came with it.
 *   - every rank file of a checkpoint carries the checkpoint's metadata ("meta:<key>"), and the
 *     index build (fsdp_ckpt_finish) refuses a rank file of another save, naming it and the key;
 *   - a published checkpoint whose rank file was replaced by another save's (same size, so the
 *     index's sizes do not tell) is refused by fsdp_ckpt_check_files and by a read, naming the
 *     file, the key and both values; rank files written without copies are still accepted;
 *   - a save refuses a symbolic link at the checkpoint's name, found first (fsdp_ckpt_prepare)
 *     or planted after the rank files were written (publishing: lstat, not stat), and leaves the
 *     link's target untouched; fsdp_ckpt_remove removes a checkpoint, refuses a directory
 *     holding a foreign file and a symbolic link (keeping both), and takes an absent path;
 *   - fsdp_trace_write replaces its file atomically (fsdp__replace): a FIFO and a symbolic link
 *     at the path are refused without blocking or writing through, a regular file is replaced
 *     and no temporary file is left;
 *   - fsdp-train's resume (train_ckpt_resolve, linked in): a step of 2^63 in the metadata is
 *     refused with a message naming the value, not wrapped; a directory named step-N whose
 *     metadata says another step is refused.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fsdp.h>

#include "fs_util.h"
#include "tap.h"
#include "tools/train.h"

static char root[512];
/* When set, write_ckpt plants a symbolic link to it at dir between the rank files and
 * fsdp_ckpt_finish, as another user could. */
static const char *plant_link;

/* Writes a two-rank checkpoint at dir: "w" F32 [4], rank r holding [2r, 2r + 2) with value
 * fill + element; its metadata step and run_id, copied into the rank files when copies; rank 1
 * writes step1 instead of step when step1 is not NULL (a file of another save). */
static int write_ckpt(fsdp_ctx_t *ctx, const char *dir, const char *step, const char *step1,
                      bool copies, float fill) {
    fsdp_safetensors_kv_t meta[3] = {
        {"step", step}, {"run_id", "0123456789abcdef"}, {"loader_position", "0"}};
    int rc = fsdp_ckpt_prepare(ctx, dir);
    for (int r = 0; rc == 0 && r < 2; r++) {
        float v[2] = {fill + 2.0f * (float)r, fill + 2.0f * (float)r + 1.0f};
        int64_t two = 2;
        fsdp_shard_entry_t e = {.name = "w", .ndim = 1, .shape = {4}, .offset = 2 * r};
        rc = fsdp_tensor_from_host(ctx, FSDP_DTYPE_F32, 1, &two, v, FSDP_MEM_OTHER, &e.t);
        fsdp_shard_list_t l = {1, &e};
        fsdp_safetensors_kv_t mine[3] = {meta[0], meta[1], meta[2]};
        if (r == 1 && step1) mine[0].value = step1;
        if (rc == 0)
            rc = copies ? fsdp_ckpt_write_rank_meta(ctx, dir, r, 2, &l, mine, 3)
                        : fsdp_ckpt_write_rank(ctx, dir, r, 2, &l);
        fsdp_tensor_release(e.t);
    }
    if (rc == 0 && plant_link && symlink(plant_link, dir) != 0) rc = -1;
    if (rc == 0) rc = fsdp_ckpt_finish(ctx, dir, 2, meta, 3);
    return rc;
}

static int copy_file(const char *from, const char *to) {
    FILE *a = fopen(from, "rb"), *b = a ? fopen(to, "wb") : NULL;
    char buf[4096];
    size_t n;
    int rc = a && b ? 0 : -1;
    while (rc == 0 && (n = fread(buf, 1, sizeof buf, a)) > 0)
        if (fwrite(buf, 1, n, b) != n) rc = -1;
    if (a) fclose(a);
    if (b && fclose(b) != 0) rc = -1;
    return rc;
}

static void test_copies(fsdp_ctx_t *ctx) {
    char a[600], b[600], c[600];
    snprintf(a, sizeof a, "%s/a", root);
    snprintf(b, sizeof b, "%s/b", root);
    snprintf(c, sizeof c, "%s/c", root);
    tap_is_int(write_ckpt(ctx, a, "2", NULL, true, 0), 0,
               "a checkpoint with metadata copies saves");
    fsdp_safetensors_t *st = NULL;
    int rc = fsdp_safetensors_open(ctx, fsu_join(a, "rank-1-of-2.safetensors"), &st);
    tap_ok(rc == 0 && st && fsdp_safetensors_metadata(st, "meta:step") &&
               strcmp(fsdp_safetensors_metadata(st, "meta:step"), "2") == 0 &&
               fsdp_safetensors_metadata(st, "meta:run_id") &&
               strcmp(fsdp_safetensors_metadata(st, "meta:run_id"), "0123456789abcdef") == 0,
           "rank 1's file carries the checkpoint's step and run id (meta:step, meta:run_id)");
    fsdp_safetensors_close(st);

    /* another save of step 4 with the same layout; then rank 1's file of step 2 put into it */
    tap_is_int(write_ckpt(ctx, b, "4", NULL, true, 10), 0, "a second checkpoint (step 4) saves");
    fsdp_ckpt_t *ck = NULL;
    rc = fsdp_ckpt_open(ctx, b, &ck);
    tap_ok(rc == 0 && fsdp_ckpt_check_files(ck) == 0, "its files agree with its index");
    fsdp_ckpt_close(ck);
    ck = NULL;
    copy_file(fsu_join(a, "rank-1-of-2.safetensors"), fsu_join(b, "rank-1-of-2.safetensors"));
    rc = fsdp_ckpt_open(ctx, b, &ck);
    tap_is_int(rc, 0, "with step 2's rank 1 file (the same size) the index still opens");
    rc = ck ? fsdp_ckpt_check_files(ck) : -1;
    const char *why = ck ? fsdp_ckpt_last_error(ck) : "";
    tap_ok_why(rc == FSDP_EINVAL &&
                   strstr(why, "rank-1-of-2.safetensors' belongs to another save") &&
                   strstr(why, "'step' is '2' where the checkpoint's is '4'"),
               why,
               "fsdp_ckpt_check_files refuses the mixed checkpoint, naming the file, the key and "
               "both values");
    float got[4];
    rc = ck ? fsdp_ckpt_read(ck, "w", 2, 2, FSDP_DTYPE_F32, got, sizeof got / 2) : -1;
    tap_is_int(rc, FSDP_EINVAL, "a read of rank 1's elements refuses it too");
    rc = ck ? fsdp_ckpt_read(ck, "w", 0, 2, FSDP_DTYPE_F32, got, sizeof got / 2) : -1;
    tap_ok(rc == 0 && got[0] == 10.0f && got[1] == 11.0f, "rank 0's own elements still read");
    fsdp_ckpt_close(ck);

    /* the index build refuses a staging directory mixed from two saves */
    rc = write_ckpt(ctx, c, "6", "8", true, 0);
    struct stat sb;
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_ctx_last_error(ctx), "rank-1-of-2.safetensors") &&
               strstr(fsdp_ctx_last_error(ctx), "another save") && lstat(c, &sb) != 0,
           "fsdp_ckpt_finish refuses rank files of two saves and publishes nothing (%s)",
           fsdp_ctx_last_error(ctx));

    /* rank files without copies (fsdp_ckpt_write_rank, earlier writers) are accepted */
    char d[600];
    snprintf(d, sizeof d, "%s/d", root);
    rc = write_ckpt(ctx, d, "2", NULL, false, 0);
    ck = NULL;
    if (rc == 0) rc = fsdp_ckpt_open(ctx, d, &ck);
    tap_ok(rc == 0 && fsdp_ckpt_check_files(ck) == 0,
           "a checkpoint whose files carry no copies (an earlier writer) still opens and checks");
    fsdp_ckpt_close(ck);
}

static void test_links(fsdp_ctx_t *ctx) {
    char target[600], link[600], foreign[600];
    snprintf(target, sizeof target, "%s/target", root);
    snprintf(link, sizeof link, "%s/link", root);
    snprintf(foreign, sizeof foreign, "%s/foreign", root);
    mkdir(target, 0700);
    if (symlink(target, link) != 0) tap_bail("symlink: %s", strerror(errno));
    int rc = write_ckpt(ctx, link, "2", NULL, true, 0);
    struct stat sb;
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_ctx_last_error(ctx), "(it is a symbolic link)") &&
               lstat(link, &sb) == 0 && S_ISLNK(sb.st_mode) &&
               lstat(fsu_join(target, "index.json"), &sb) != 0,
           "a save to a name that is a symbolic link is refused; the link and its target stay (%s)",
           fsdp_ctx_last_error(ctx));
    char late[600];
    snprintf(late, sizeof late, "%s/late", root);
    plant_link = target;
    rc = write_ckpt(ctx, late, "2", NULL, true, 0);
    plant_link = NULL;
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_ctx_last_error(ctx), "(it is a symbolic link)") &&
               lstat(late, &sb) == 0 && S_ISLNK(sb.st_mode) &&
               lstat(fsu_join(target, "index.json"), &sb) != 0,
           "a link planted at the name after the files were written is refused when publishing "
           "(lstat), and its target is untouched (%s)",
           fsdp_ctx_last_error(ctx));
    char a[600];
    snprintf(a, sizeof a, "%s/a", root);
    if (symlink(a, fsu_join(root, "link-a")) != 0) tap_bail("symlink: %s", strerror(errno));
    rc = fsdp_ckpt_remove(ctx, fsu_join(root, "link-a"));
    tap_ok(rc == FSDP_EINVAL && lstat(fsu_join(a, "index.json"), &sb) == 0,
           "fsdp_ckpt_remove refuses a symbolic link to a checkpoint and keeps the checkpoint");
    tap_is_int(write_ckpt(ctx, foreign, "2", NULL, true, 0), 0, "another checkpoint saves");
    FILE *f = fopen(fsu_join(foreign, "notes.txt"), "w");
    if (f) fclose(f);
    rc = fsdp_ckpt_remove(ctx, foreign);
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_ctx_last_error(ctx), "notes.txt") &&
               lstat(fsu_join(foreign, "index.json"), &sb) == 0,
           "fsdp_ckpt_remove refuses a directory holding a foreign file, naming it, and removes "
           "nothing");
    unlink(fsu_join(foreign, "notes.txt"));
    tap_ok(fsdp_ckpt_remove(ctx, foreign) == 0 && lstat(foreign, &sb) != 0 &&
               fsdp_ckpt_remove(ctx, foreign) == 0,
           "and removes a checkpoint whole (an absent path is success)");
}

/* Whether directory dir holds an entry whose name contains part. */
static bool has_entry(const char *dir, const char *part) {
    DIR *d = opendir(dir);
    struct dirent *e;
    bool found = false;
    while (d && (e = readdir(d)))
        if (strstr(e->d_name, part)) found = true;
    if (d) closedir(d);
    return found;
}

static void test_trace(void) {
    char dir[600], fifo[700], link[700], reg[700], victim[600];
    snprintf(dir, sizeof dir, "%s/trace", root);
    mkdir(dir, 0700);
    snprintf(fifo, sizeof fifo, "%s/fifo.json", dir);
    snprintf(link, sizeof link, "%s/link.json", dir);
    snprintf(reg, sizeof reg, "%s/t.json", dir);
    snprintf(victim, sizeof victim, "%s/victim", root);
    fsdp_trace_t *t = NULL;
    if (fsdp_trace_create(NULL, &t) < 0) tap_bail("fsdp_trace_create");
    if (mkfifo(fifo, 0600) != 0) tap_bail("mkfifo: %s", strerror(errno));
    fsu_guard_start(2);
    int rc = fsdp_trace_write(t, fifo);
    fsu_guard_stop();
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_trace_last_error(t), "not a regular file"),
           "fsdp_trace_write refuses a FIFO at its path without blocking (%s)",
           fsdp_trace_last_error(t));
    FILE *f = fopen(victim, "w");
    if (f) fputs("keep", f), fclose(f);
    if (symlink(victim, link) != 0) tap_bail("symlink: %s", strerror(errno));
    rc = fsdp_trace_write(t, link);
    size_t n = 0;
    f = fopen(victim, "r");
    char buf[16] = "";
    if (f) n = fread(buf, 1, sizeof buf - 1, f), fclose(f);
    tap_ok(rc == FSDP_EINVAL && n == 4 && strcmp(buf, "keep") == 0,
           "a symbolic link at its path is refused and its target is not written through");
    f = fopen(reg, "w");
    if (f) fputs("old", f), fclose(f);
    rc = fsdp_trace_write(t, reg);
    struct stat sb;
    tap_ok(rc == 0 && stat(reg, &sb) == 0 && sb.st_size > 10 && !has_entry(dir, ".tmp-"),
           "a regular file is replaced whole, and no temporary file is left");
    fsdp_trace_destroy(t);
}

/* train_ckpt_resolve's verdict on --resume dir and what it printed on stderr (into out). */
static int resolve(const char *dir, char *out, size_t cap) {
    char *argv[] = {"fsdp-train", "--resume", (char *)dir, NULL};
    train_opts_t o;
    if (train_parse_flags(3, argv, &o) != 0) return -1;
    char errf[600], path[4096], rid[64];
    snprintf(errf, sizeof errf, "%s/stderr.txt", root);
    fflush(stderr);
    int saved = dup(2), fd = open(errf, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd, 2);
    close(fd);
    int st = train_ckpt_resolve(&o, true, path, sizeof path, rid, sizeof rid);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    FILE *f = fopen(errf, "r");
    size_t n = f ? fread(out, 1, cap - 1, f) : 0;
    out[n] = '\0';
    if (f) fclose(f);
    return st;
}

static void test_range(fsdp_ctx_t *ctx) {
    char big[600], msg[2048];
    snprintf(big, sizeof big, "%s/big", root);
    tap_is_int(write_ckpt(ctx, big, "9223372036854775808", NULL, true, 0), 0,
               "a checkpoint whose metadata says step 2^63 is written");
    int st = resolve(big, msg, sizeof msg);
    tap_ok_why(
        st == 2 && strstr(msg, "step is '9223372036854775808', not a step count from 0 to 2^40") &&
            !strstr(msg, "-9223372036854775808"),
        msg, "--resume refuses step 2^63 with a message naming it (no wrap to a negative step)");
    char named[600];
    snprintf(named, sizeof named, "%s/step-5", root);
    tap_is_int(write_ckpt(ctx, named, "4", NULL, true, 0), 0,
               "a checkpoint of step 4 named step-5");
    st = resolve(named, msg, sizeof msg);
    tap_ok_why(st == 2 && strstr(msg, "named step 5 but its metadata says step 4"), msg,
               "--resume refuses a step-N directory whose metadata says another step");
}

int main(void) {
    tap_plan(23);
    char tmpl[sizeof root];
    tap_tmppath(tmpl, sizeof tmpl, "t_ckpt_complete.XXXXXX");
    if (!mkdtemp(tmpl)) tap_bail("mkdtemp: %s", strerror(errno));
    snprintf(root, sizeof root, "%s", tmpl);
    fsu_guard_install();
    fsdp_ctx_options_t co;
    fsdp_ctx_options_init(&co);
    co.log_level = FSDP_LOG_OFF;
    fsdp_ctx_t *ctx = NULL;
    if (fsdp_ctx_create(&co, &ctx) < 0) tap_bail("fsdp_ctx_create");
    test_copies(ctx);
    test_links(ctx);
    test_trace();
    test_range(ctx);
    fsdp_ctx_destroy(ctx);
    fsu_remove_tree(root);
    return tap_done();
}
