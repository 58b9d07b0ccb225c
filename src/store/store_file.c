/* SPDX-License-Identifier: MIT */
/*
 * store_file.c: the file store, for ranks that are processes sharing a directory (on one host,
 * or on many hosts over NFS).
 *
 * Each key is one file "k.<name>" in the directory. <name> is the key with every byte outside
 * [A-Za-z0-9_-] written as %XX, so '/' never makes a subdirectory and no name is "." or "..".
 * An encoded key longer than NAME_BYTES is named by its first bytes, '~' (which encoding never
 * produces) and a 128-bit hash of the whole key.
 *
 * The directory is trusted only once verified, because another local user who controls it could
 * steer a rank: plant a key (a Gloo address pointing at their socket), plant a symbolic link (a
 * job run by root then writes through it), or move the directory to break the rendezvous. So the
 * store creates its directories 0700 whatever the umask, opens the directory itself with
 * O_DIRECTORY | O_NOFOLLOW and checks that descriptor (owned by the effective user, writable by
 * nobody else, in a parent that others cannot write to unless it is sticky, like /tmp), and does
 * every key file operation relative to that descriptor, never following a link: a key or lock
 * file that is a link or not a regular file is refused, naming it.
 *
 * Invariants:
 * - A value file is never written in place. Writers fill a temporary file
 *   "k.<name>.tmp-<pid>-<hex>" (no key's file name has a '.' after the kind) and rename it over
 *   "k.<name>" (fsdp__replace), so a reader opens either the old value or the new one, whole.
 * - Writers of one key (set and add) hold an exclusive flock() on "l.<name>" for the whole
 *   read-modify-write, which makes add atomic across threads (each locks its own open file
 *   description), processes and, over NFS, hosts. Lock files are never deleted: a writer that
 *   locked a deleted file and one that locked its replacement would not exclude each other.
 * - Readers take no lock. get and wait poll, sleeping 1 ms doubling to 50 ms between tries.
 * - The shared data holds the verified directory's descriptor (close-on-exec) and a reference
 *   count; no other descriptor stays open between calls, so a forked child may use the store
 *   too, through the same verified directory.
 */
#define _DEFAULT_SOURCE /* S_ISVTX, an XSI name that POSIX 2008 alone does not show */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/timeutil.h"
#include "store/store_file_name.h"
#include "store/store_impl.h"

/* Room for any path the store builds (directory + '/' + kind + '.' + name + suffix). */
#define PATH_CAP 4096
#define DIR_MAX (PATH_CAP - NAME_BYTES - 32)
/* Room for a key file's name: kind, '.', the encoded name. */
#define FILE_CAP (NAME_BYTES + 8)

typedef struct file_store {
    pthread_mutex_t mu; /* guards refs */
    int refs;
    int dfd;    /* the verified directory (O_NOFOLLOW); key files are opened relative to it */
    char dir[]; /* without trailing '/', except for "/" itself; for messages */
} file_store_t;

/* XSI strerror_r into buf (thread-safe, unlike strerror). */
static const char *errtext(int e, char *buf, size_t cap) {
    if (strerror_r(e, buf, cap) != 0) snprintf(buf, cap, "errno %d", e);
    return buf;
}

/* The name of key file kind ('k' value, 'l' lock) of an encoded name, relative to f->dfd. */
static void file_of(char kind, const char *name, char *file) {
    snprintf(file, FILE_CAP, "%c.%s", kind, name);
}

/* Sleeps `ms` milliseconds, but not past deadline_ns. */
static void nap_until(int64_t ms, int64_t deadline_ns) {
    int64_t left_ns = deadline_ns - fsdp__now_ns();
    int64_t ns = ms * 1000000;
    if (ns > left_ns) ns = left_ns;
    if (ns <= 0) return;
    struct timespec ts = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/*
 * Reads value file `file` of f: returns 1 when it exists (*len = its size, up to cap bytes copied
 * into buf, which may be NULL), 0 when it does not, or a status with `why` (cap bytes) naming the
 * file: FSDP_EINVAL when it is a link or not a regular file, FSDP_EBACKEND when it cannot be
 * read.
 */
static int read_value(const file_store_t *f, const char *file, void *buf, size_t cap, size_t *len,
                      char *why, size_t wcap) {
    char what[160], e[128];
    struct stat st;
    int fd = fsdp__open_regular(f->dfd, file, O_RDONLY | O_NOFOLLOW, 0, &st, what, sizeof what);
    if (fd == FSDP_EBACKEND && (errno == ENOENT || errno == ESTALE)) return 0;
    if (fd < 0) {
        snprintf(why, wcap, "key file '%s' %s", file, what);
        return fd;
    }
    int rc = 1;
    size_t size = (size_t)st.st_size, want = size < cap ? size : cap, got = 0;
    while (buf && got < want) {
        ssize_t n = read(fd, (char *)buf + got, want - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) { /* values are immutable, so an early end is a damaged file */
            snprintf(why, wcap, "cannot read key file '%s': %s", file,
                     n < 0 ? errtext(errno, e, sizeof e) : "it ended early");
            rc = FSDP_EBACKEND;
            goto out;
        }
        got += (size_t)n;
    }
    *len = size;
out:
    close(fd);
    return rc;
}

/* Atomically replaces key's value: temporary file, then rename (fsdp__replace, which refuses a
 * "k.<name>" that is not a regular file). The caller holds the lock. */
static int write_value(const file_store_t *f, const char *key, const char *name, const void *value,
                       size_t len, const char *op, char *err) {
    char file[FILE_CAP], why[FSDP_ERR_LEN / 2], e[128];
    file_of('k', name, file);
    fsdp__replace_t w;
    /* no fsync: a store holds rendezvous data for one job, not data that must survive a crash */
    int rc = fsdp__replace_begin(&w, f->dfd, file, 0600, false, why, sizeof why);
    for (size_t done = 0; rc == FSDP_OK && done < len;) {
        ssize_t n = write(w.fd, (const char *)value + done, len - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            snprintf(why, sizeof why, "'%s': cannot write: %s", w.tmp,
                     n < 0 ? errtext(errno, e, sizeof e) : "no progress");
            rc = FSDP_EBACKEND;
            break;
        }
        done += (size_t)n;
    }
    if (rc == FSDP_OK) rc = fsdp__replace_commit(&w, why, sizeof why);
    fsdp__replace_abort(&w);
    if (rc < 0)
        return fsdp__err(err, rc == FSDP_EINVAL ? FSDP_EINVAL : FSDP_EBACKEND,
                         "file store %s: %s '%s': %s", f->dir, op, key, why);
    return FSDP_OK;
}

/*
 * Opens key's lock file and locks it exclusively, polling (50 us doubling to 10 ms: the lock is
 * held for a few system calls) until the deadline. On success *fd holds the lock; close it to
 * unlock.
 */
static int lock_key(const file_store_t *f, const char *key, const char *name, int64_t timeout_ms,
                    const char *op, int *fd, char *err) {
    char file[FILE_CAP], e[128], what[160];
    file_of('l', name, file);
    int64_t deadline = fsdp__store_deadline_ns(timeout_ms);
    /* O_RDWR: over NFS an exclusive flock is a write lock, which needs a writable descriptor */
    *fd = fsdp__open_regular(f->dfd, file, O_RDWR | O_CREAT | O_NOFOLLOW, 0600, NULL, what,
                             sizeof what);
    if (*fd < 0) {
        int rc = *fd;
        *fd = -1;
        return fsdp__err(err, rc, "file store %s: %s '%s': lock file '%s' %s", f->dir, op, key,
                         file, what);
    }
    int64_t wait_us = 50;
    while (flock(*fd, LOCK_EX | LOCK_NB) != 0) {
        int saved = errno;
        if (saved != EWOULDBLOCK && saved != EINTR) {
            close(*fd);
            *fd = -1;
            return fsdp__err(err, FSDP_EBACKEND, "file store %s: %s '%s': cannot lock the key: %s",
                             f->dir, op, key, errtext(saved, e, sizeof e));
        }
        if (fsdp__now_ns() >= deadline) {
            close(*fd);
            *fd = -1;
            return fsdp__err(err, FSDP_ETIMEDOUT,
                             "file store %s: %s '%s': another writer held the key's lock for more "
                             "than %lld ms",
                             f->dir, op, key, (long long)timeout_ms);
        }
        int64_t left = deadline - fsdp__now_ns(), ns = wait_us * 1000;
        if (ns > left) ns = left;
        if (ns > 0) {
            struct timespec ts = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
            nanosleep(&ts, NULL);
        }
        wait_us = wait_us >= 5000 ? 10000 : wait_us * 2;
    }
    return FSDP_OK;
}

static void unlock_key(int fd) {
    flock(fd, LOCK_UN);
    close(fd);
}

static int file_set(void *data, const char *key, const void *value, size_t len, int64_t timeout_ms,
                    char *err) {
    file_store_t *f = data;
    char name[NAME_BYTES + 1];
    fsdp__store_file_name(key, name);
    int fd;
    int rc = lock_key(f, key, name, timeout_ms, "set", &fd, err);
    if (rc < 0) return rc;
    rc = write_value(f, key, name, value, len, "set", err);
    unlock_key(fd);
    return rc;
}

static int file_get(void *data, const char *key, void *buf, size_t cap, size_t *len,
                    int64_t timeout_ms, char *err) {
    file_store_t *f = data;
    char name[NAME_BYTES + 1], file[FILE_CAP], why[FSDP_ERR_LEN / 2];
    fsdp__store_file_name(key, name);
    file_of('k', name, file);
    int64_t deadline = fsdp__store_deadline_ns(timeout_ms), nap = 0;
    for (;;) {
        int found = read_value(f, file, buf, cap, len, why, sizeof why);
        if (found == 1) return FSDP_OK;
        if (found < 0)
            return fsdp__err(err, found, "file store %s: get '%s': %s", f->dir, key, why);
        if (fsdp__now_ns() >= deadline)
            return fsdp__err(err, FSDP_ETIMEDOUT,
                             "file store %s: key '%s' did not appear within %lld ms", f->dir, key,
                             (long long)timeout_ms);
        nap = fsdp__store_backoff_ms(nap);
        nap_until(nap, deadline);
    }
}

static int file_add(void *data, const char *key, int64_t delta, int64_t *result, int64_t timeout_ms,
                    char *err) {
    file_store_t *f = data;
    char name[NAME_BYTES + 1], file[FILE_CAP], why[FSDP_ERR_LEN / 2];
    fsdp__store_file_name(key, name);
    file_of('k', name, file);
    int fd;
    int rc = lock_key(f, key, name, timeout_ms, "add", &fd, err);
    if (rc < 0) return rc;
    char text[32];
    size_t len = 0;
    int64_t value = 0;
    int found = read_value(f, file, text, sizeof text, &len, why, sizeof why);
    if (found < 0) {
        rc = fsdp__err(err, found, "file store %s: add '%s': %s", f->dir, key, why);
    } else if (found && (len > sizeof text || fsdp__store_parse_counter(text, len, &value) != 0)) {
        rc = fsdp__err(err, FSDP_EINVAL, "file store %s: add on '%s', whose value is not a counter",
                       f->dir, key);
    } else {
        value = (int64_t)((uint64_t)value + (uint64_t)delta);
        int n = snprintf(text, sizeof text, "%" PRId64, value);
        rc = write_value(f, key, name, text, (size_t)n, "add", err);
        if (rc == FSDP_OK) *result = value;
    }
    unlock_key(fd);
    return rc;
}

static int file_check(void *data, const char *key, int *found, int64_t timeout_ms, char *err) {
    file_store_t *f = data;
    char name[NAME_BYTES + 1], file[FILE_CAP], e[128];
    fsdp__store_file_name(key, name);
    file_of('k', name, file);
    (void)timeout_ms;
    struct stat st;
    if (fstatat(f->dfd, file, &st, AT_SYMLINK_NOFOLLOW) == 0) {
        if (!S_ISREG(st.st_mode))
            return fsdp__err(err, FSDP_EINVAL,
                             "file store %s: check '%s': key file '%s' is %s, not a regular file",
                             f->dir, key, file, fsdp__file_kind(st.st_mode));
        *found = 1;
    } else if (errno == ENOENT) {
        *found = 0;
    } else {
        return fsdp__err(err, FSDP_EBACKEND, "file store %s: check '%s': cannot stat '%s': %s",
                         f->dir, key, file, errtext(errno, e, sizeof e));
    }
    return FSDP_OK;
}

static void file_retain(void *data) {
    file_store_t *f = data;
    pthread_mutex_lock(&f->mu);
    f->refs++;
    pthread_mutex_unlock(&f->mu);
}

static void file_release(void *data) {
    file_store_t *f = data;
    pthread_mutex_lock(&f->mu);
    int last = --f->refs == 0;
    pthread_mutex_unlock(&f->mu);
    if (!last) return;
    pthread_mutex_destroy(&f->mu);
    close(f->dfd);
    free(f);
}

static const struct fsdp_store_ops file_ops = {
    .name = "file",
    .set = file_set,
    .get = file_get,
    .add = file_add,
    .check = file_check,
    .retain = file_retain,
    .release = file_release,
};

/* mkdir -p: creates every missing directory of `dir`, each 0700 whatever the umask. */
static int make_dirs(fsdp_ctx_t *ctx, const char *dir) {
    char path[PATH_CAP], e[128];
    snprintf(path, sizeof path, "%s", dir);
    for (char *p = path + 1;; p++) {
        if (*p != '/' && *p != 0) continue;
        char c = *p;
        *p = 0;
        struct stat st;
        int made = mkdir(path, 0700) == 0, saved = errno;
        if (made) {
            /* The umask may only have removed bits; set them through the directory just made,
             * not through its name, which someone could have replaced by now. */
            int fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (fd >= 0) {
                fchmod(fd, 0700);
                close(fd);
            }
        } else if (saved != EEXIST && !(stat(path, &st) == 0 && S_ISDIR(st.st_mode))) {
            return fsdp__ctx_err_or_log(ctx, FSDP_EBACKEND,
                                        "fsdp_store_create_file: cannot create directory '%s' "
                                        "(for '%s'): %s",
                                        path, dir, errtext(saved, e, sizeof e));
        }
        *p = c;
        if (!c) break;
    }
    return FSDP_OK;
}

/* Refuses a parent directory that users other than its owner may write to, unless it is sticky:
 * they could rename the store's directory away and ranks started later would make another. */
static int check_parent(fsdp_ctx_t *ctx, const char *dir) {
    char parent[PATH_CAP], e[128];
    const char *slash = strrchr(dir, '/');
    if (!slash)
        snprintf(parent, sizeof parent, ".");
    else
        snprintf(parent, sizeof parent, "%.*s", slash == dir ? 1 : (int)(slash - dir), dir);
    struct stat st;
    if (stat(parent, &st) != 0)
        return fsdp__ctx_err_or_log(ctx, FSDP_EBACKEND,
                                    "fsdp_store_create_file: cannot stat '%s', the parent of '%s': "
                                    "%s",
                                    parent, dir, errtext(errno, e, sizeof e));
    if ((st.st_mode & (S_IWGRP | S_IWOTH)) && !(st.st_mode & S_ISVTX))
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "fsdp_store_create_file: '%s', the parent of '%s' (owner uid "
                                    "%u, mode %04o), is writable by its group or others and not "
                                    "sticky: another user could move the store directory away; "
                                    "use a private parent, or a sticky one like /tmp",
                                    parent, dir, (unsigned)st.st_uid,
                                    (unsigned)(st.st_mode & 07777));
    return FSDP_OK;
}

/*
 * Opens dir without following a link and checks what was opened: a directory owned by the
 * effective user that no one else may write to, in a parent that check_parent accepts. On
 * success *out is the directory's descriptor.
 */
static int open_dir(fsdp_ctx_t *ctx, const char *dir, int *out) {
    char e[128];
    struct stat st;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        int saved = errno;
        if (lstat(dir, &st) == 0 && S_ISLNK(st.st_mode))
            return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                        "fsdp_store_create_file: '%s' (owner uid %u) is a symbolic "
                                        "link: the file store does not follow one, since whoever "
                                        "can change it chooses where keys are read and written; "
                                        "give the directory itself",
                                        dir, (unsigned)st.st_uid);
        if (saved == ENOTDIR)
            return fsdp__ctx_err_or_log(ctx, FSDP_EBACKEND,
                                        "fsdp_store_create_file: '%s' exists and is not a "
                                        "directory",
                                        dir);
        return fsdp__ctx_err_or_log(ctx, FSDP_EBACKEND,
                                    "fsdp_store_create_file: cannot use '%s': %s", dir,
                                    errtext(saved, e, sizeof e));
    }
    int rc = FSDP_OK;
    uid_t me = geteuid();
    if (fstat(fd, &st) != 0) {
        rc =
            fsdp__ctx_err_or_log(ctx, FSDP_EBACKEND, "fsdp_store_create_file: cannot stat '%s': %s",
                                 dir, errtext(errno, e, sizeof e));
    } else if (st.st_uid != me) {
        rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                  "fsdp_store_create_file: '%s' (owner uid %u, mode %04o) is not "
                                  "owned by the effective user (uid %u): its owner could plant or "
                                  "replace key files; use a directory of your own",
                                  dir, (unsigned)st.st_uid, (unsigned)(st.st_mode & 07777),
                                  (unsigned)me);
    } else if (st.st_mode & (S_IWGRP | S_IWOTH)) {
        rc = fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                  "fsdp_store_create_file: '%s' (owner uid %u, mode %04o) is "
                                  "writable by %s: another user could plant key files; make it "
                                  "private (chmod 700) or use a fresh directory",
                                  dir, (unsigned)st.st_uid, (unsigned)(st.st_mode & 07777),
                                  st.st_mode & S_IWOTH ? "others" : "its group");
    } else {
        rc = check_parent(ctx, dir);
    }
    if (rc < 0) {
        close(fd);
        return rc;
    }
    *out = fd;
    return FSDP_OK;
}

/* Proves that files can be created in the directory, so that a read-only directory fails here
 * and not at the first set of a rank. */
static int probe_dir(fsdp_ctx_t *ctx, const char *dir, int dfd) {
    char file[64], e[128];
    snprintf(file, sizeof file, "t.probe.%ld.%llx", (long)getpid(),
             (unsigned long long)fsdp__now_ns());
    int fd = openat(dfd, file, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        return fsdp__ctx_err_or_log(ctx, FSDP_EBACKEND,
                                    "fsdp_store_create_file: cannot create files in '%s': %s", dir,
                                    errtext(errno, e, sizeof e));
    close(fd);
    unlinkat(dfd, file, 0);
    return FSDP_OK;
}

int fsdp_store_create_file(fsdp_ctx_t *ctx, const char *dir, fsdp_store_t **out) {
    if (!out) return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "fsdp_store_create_file: out is NULL");
    *out = NULL;
    if (!dir || !*dir)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "fsdp_store_create_file: dir is %s",
                                    dir ? "empty" : "NULL");
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/') n--;
    if (n > DIR_MAX)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "fsdp_store_create_file: dir '%.64s...' is longer than %d "
                                    "bytes",
                                    dir, DIR_MAX);
    file_store_t *f = calloc(1, sizeof *f + n + 1);
    if (!f) return fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "fsdp_store_create_file: out of memory");
    memcpy(f->dir, dir, n);
    f->dir[n] = 0;
    f->dfd = -1;
    int rc = make_dirs(ctx, f->dir);
    if (rc == FSDP_OK) rc = open_dir(ctx, f->dir, &f->dfd);
    if (rc == FSDP_OK) rc = probe_dir(ctx, f->dir, f->dfd);
    if (rc < 0) {
        if (f->dfd >= 0) close(f->dfd);
        free(f);
        return rc;
    }
    pthread_mutex_init(&f->mu, NULL);
    f->refs = 1;
    rc = fsdp__store_wrap(&file_ops, f, out);
    if (rc < 0) return fsdp__ctx_err_or_log(ctx, rc, "fsdp_store_create_file: out of memory");
    return FSDP_OK;
}
