/* SPDX-License-Identifier: MIT */
/*
 * t_store_trust.c: the file store trusts no directory it did not verify (docs/design.md,
 * "Rendezvous stores"): the modes of the directories it makes, directories that others may
 * write to or own, a store directory that is a symbolic link, and key and lock files planted as
 * links or FIFOs.
 *
 * Everything lives under one mkdtemp directory under $TMPDIR, removed at the end. The checks that
 * need a second user chown to an unused uid, which only root may do; they are skipped otherwise.
 * Calls that a regression could make block (a FIFO planted as a key) run under a SIGALRM guard
 * (fsu_guard_start, tests/fs_util.h), so such a regression fails checks instead of hanging the
 * suite.
 */
#define _DEFAULT_SOURCE /* S_ISVTX, chown of a directory to another uid in the root-only checks */
#include <config.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <fsdp.h>

#include "fs_util.h"
#include "tap.h"

/* A uid no account on a test machine uses, for the directory of "another user". */
#define OTHER_UID 54321

/* The longest any single call here may take before it counts as blocked. */
#define GUARD_S 10

static char base[512];
static fsdp_ctx_t *ctx;

static const char *in_base(const char *name) {
    return fsu_join(base, name);
}

static unsigned mode_of(const char *path) {
    struct stat st;
    return lstat(path, &st) == 0 ? (unsigned)(st.st_mode & 07777) : 0xffffu;
}

static int exists(const char *path) {
    struct stat st;
    return lstat(path, &st) == 0;
}

/* Entries of directory path other than "." and "..". */
static int entries(const char *path) {
    DIR *d = opendir(path);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    if (d) closedir(d);
    return n;
}

/* create_file on dir: its status, the store closed again when it opened. */
static int try_create(const char *dir) {
    fsdp_store_t *s = NULL;
    int rc = fsdp_store_create_file(ctx, dir, &s);
    fsdp_store_destroy(s);
    return rc;
}

static void test_modes(void) {
    mode_t old = umask(0);
    fsdp_store_t *s = NULL;
    int rc = fsdp_store_create_file(ctx, in_base("made/by/mkdir-p"), &s);
    umask(old);
    tap_is_int(rc, FSDP_OK, "under umask 000 the store makes its directory and parents");
    fsdp_store_destroy(s);
    tap_is_uint(mode_of(in_base("made/by/mkdir-p")), 0700, "the store's directory is 0700");
    tap_ok(mode_of(in_base("made")) == 0700 && mode_of(in_base("made/by")) == 0700,
           "and so are the parents it made (%04o, %04o)", mode_of(in_base("made")),
           mode_of(in_base("made/by")));
}

static void test_dir_modes(void) {
    const char *open_dir = in_base("open");
    mkdir(open_dir, 0700);
    chmod(open_dir, 0777);
    tap_is_int(try_create(open_dir), FSDP_EINVAL,
               "a directory of mode 0777 (not sticky) is refused");
    const char *msg = fsdp_ctx_last_error(ctx);
    tap_ok(strstr(msg, open_dir) && strstr(msg, "mode 0777") && strstr(msg, "owner uid") &&
               strstr(msg, "writable by others"),
           "the message names the path, its owner and mode, and what is wrong");
    if (!strstr(msg, "mode 0777")) tap_diag("%s", msg);
    tap_is_int(entries(open_dir), 0, "nothing was written into it");

    chmod(open_dir, 01777);
    tap_is_int(try_create(open_dir), FSDP_EINVAL,
               "a sticky world-writable store directory is refused too (others may add keys)");
    const char *grp = in_base("group");
    mkdir(grp, 0700);
    chmod(grp, 0770);
    tap_is_int(try_create(grp), FSDP_EINVAL, "a group-writable directory is refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "its group", "the message says who may write");

    const char *mine = in_base("mine");
    mkdir(mine, 0700);
    chmod(mine, 0755);
    tap_is_int(try_create(mine), FSDP_OK, "a directory of mode 0755 owned by the user is accepted");
    tap_is_uint(mode_of(mine), 0755, "and an existing directory keeps its mode");

    /* The parent: sticky and world-writable (like /tmp) is fine; writable and not sticky is not. */
    const char *tmp_like = in_base("tmp-like");
    mkdir(tmp_like, 0700);
    chmod(tmp_like, 01777);
    tap_is_int(try_create(in_base("tmp-like/job")), FSDP_OK,
               "a private store directory in a sticky world-writable parent is accepted");
    tap_is_uint(mode_of(in_base("tmp-like/job")), 0700, "and it was made 0700");
    const char *loose = in_base("loose");
    mkdir(loose, 0700);
    mkdir(in_base("loose/job"), 0700);
    chmod(loose, 0777);
    tap_is_int(try_create(in_base("loose/job")), FSDP_EINVAL,
               "a private store directory in a world-writable parent without the sticky bit is "
               "refused");
    msg = fsdp_ctx_last_error(ctx);
    tap_ok(strstr(msg, loose) && strstr(msg, "mode 0777") && strstr(msg, "not sticky"),
           "the message names the parent, its mode and why");
    if (!strstr(msg, "not sticky")) tap_diag("%s", msg);
}

static void test_other_owner(void) {
    if (geteuid() != 0) {
        tap_skip(3, "a directory of another user needs root to chown (not root)");
        return;
    }
    const char *theirs = in_base("theirs");
    mkdir(theirs, 0700);
    if (chown(theirs, OTHER_UID, OTHER_UID) != 0) {
        tap_skip(3, "chown to another uid failed");
        return;
    }
    tap_is_int(try_create(theirs), FSDP_EINVAL, "a directory owned by another user is refused");
    const char *msg = fsdp_ctx_last_error(ctx);
    tap_ok(strstr(msg, theirs) && strstr(msg, "owner uid 54321") && strstr(msg, "mode 0700") &&
               strstr(msg, "not owned by the effective user"),
           "the message names the path, the owner uid and mode, and what is wrong");
    if (!strstr(msg, "54321")) tap_diag("%s", msg);
    tap_is_int(entries(theirs), 0, "nothing was written into it");
}

static void test_symlink_dir(void) {
    const char *real = in_base("real"), *link = in_base("link");
    mkdir(real, 0700);
    if (symlink(real, link) != 0) {
        tap_skip(3, "symlink failed");
        return;
    }
    fsdp_store_t *s = NULL;
    int rc = fsdp_store_create_file(ctx, link, &s);
    tap_is_int(rc, FSDP_EINVAL, "a store directory that is a symbolic link is refused");
    tap_ok(strstr(fsdp_ctx_last_error(ctx), link) &&
               strstr(fsdp_ctx_last_error(ctx), "symbolic link"),
           "the message names it and says it is a link");
    if (s) fsdp_store_set(s, "k", "v", 1);
    fsdp_store_destroy(s);
    tap_is_int(entries(real), 0, "nothing was created in the directory it points to");
}

/* Writes text into path (creating it 0600). */
static void put(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) {
        if (write(fd, text, strlen(text)) < 0) tap_diag("write %s: %s", path, strerror(errno));
        close(fd);
    }
}

static void test_planted_files(void) {
    const char *dir = in_base("store"), *outside = in_base("outside");
    mkdir(outside, 0700);
    fsdp_store_t *s = NULL;
    if (fsdp_store_create_file(ctx, dir, &s) != FSDP_OK) tap_bail("create_file %s", dir);
    fsdp_store_set_timeout(s, 300);

    /* A value file that is a link to a file outside: neither read nor replaced. */
    char target[1100], key[1100], buf[64];
    snprintf(target, sizeof target, "%s/addr", outside);
    put(target, "evil");
    snprintf(key, sizeof key, "%s/k.addr", dir);
    if (symlink(target, key) != 0) tap_bail("symlink %s", key);
    size_t len = 0;
    int rc = fsdp_store_get(s, "addr", buf, sizeof buf, &len);
    tap_is_int(rc, FSDP_EINVAL, "get of a key whose file is a symbolic link is refused");
    const char *msg = fsdp_store_last_error(s);
    tap_ok(strstr(msg, "k.addr") && strstr(msg, "symbolic link"),
           "the message names the key file and says it is a link");
    if (!strstr(msg, "k.addr")) tap_diag("%s", msg);
    tap_is_int(fsdp_store_set(s, "addr", "mine", 4), FSDP_EINVAL,
               "set over a key file that is a symbolic link is refused");
    tap_has_str(fsdp_store_last_error(s), "k.addr", "naming it");
    struct stat st;
    tap_ok(lstat(key, &st) == 0 && S_ISLNK(st.st_mode), "the link is left as it was");
    int fd = open(target, O_RDONLY);
    ssize_t n = fd >= 0 ? read(fd, buf, sizeof buf) : -1;
    if (fd >= 0) close(fd);
    tap_ok(n == 4 && memcmp(buf, "evil", 4) == 0, "the file outside is unchanged");
    int found = -1;
    tap_is_int(fsdp_store_check(s, "addr", &found), FSDP_EINVAL, "check refuses it too");

    /* A lock file that is a dangling link: following it would create a file outside. */
    char lock[1100], made[1100];
    snprintf(made, sizeof made, "%s/created-through-lock", outside);
    snprintf(lock, sizeof lock, "%s/l.count", dir);
    if (symlink(made, lock) != 0) tap_bail("symlink %s", lock);
    int64_t v = 0;
    tap_is_int(fsdp_store_add(s, "count", 1, &v), FSDP_EINVAL,
               "add through a lock file that is a symbolic link is refused");
    tap_has_str(fsdp_store_last_error(s), "l.count", "naming the lock file");
    tap_ok(!exists(made), "the file the link points to was not created");

    /* A FIFO planted as a value file: refused at once, not waited on. */
    char fifo[1100];
    snprintf(fifo, sizeof fifo, "%s/k.pipe", dir);
    if (mkfifo(fifo, 0600) == 0) {
        fsu_guard_start(GUARD_S);
        rc = fsdp_store_get(s, "pipe", buf, sizeof buf, &len);
        fsu_guard_stop();
        tap_is_int(rc, FSDP_EINVAL,
                   "get of a key whose file is a FIFO is refused without blocking");
        tap_ok(strstr(fsdp_store_last_error(s), "k.pipe") &&
                   strstr(fsdp_store_last_error(s), "FIFO"),
               "the message names the file and says it is a FIFO");
    } else {
        tap_skip(2, "mkfifo failed");
    }

    /* Keys written by the store itself still work, and their files are private. */
    tap_is_int(fsdp_store_set(s, "ok", "1", 1), FSDP_OK, "an ordinary key is set");
    tap_is_uint(mode_of(in_base("store/k.ok")), 0600, "its file is 0600");
    tap_is_int(fsdp_store_add(s, "n", 2, &v), FSDP_OK, "an ordinary counter is added to");
    fsdp_store_destroy(s);
}

int main(void) {
    char templ[512];
    tap_tmppath(templ, sizeof templ, "t_store_trust.XXXXXX");
    if (!mkdtemp(templ)) tap_bail("mkdtemp %s: %s", templ, strerror(errno));
    snprintf(base, sizeof base, "%s", templ);
    if (fsdp_ctx_create(NULL, &ctx) != FSDP_OK) tap_bail("fsdp_ctx_create");
    fsu_guard_install();
    test_modes();
    test_dir_modes();
    test_other_owner();
    test_symlink_dir();
    test_planted_files();
    fsdp_ctx_destroy(ctx);
    fsu_remove_tree(base);
    return tap_done();
}
