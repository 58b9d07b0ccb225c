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
 * Invariants:
 * - A value file is never written in place. Writers fill a temporary file "t.<name>.XXXXXX" and
 *   rename() it over "k.<name>", so a reader opens either the old value or the new one, whole.
 * - Writers of one key (set and add) hold an exclusive flock() on "l.<name>" for the whole
 *   read-modify-write, which makes add atomic across threads (each locks its own open file
 *   description), processes and, over NFS, hosts. Lock files are never deleted: a writer that
 *   locked a deleted file and one that locked its replacement would not exclude each other.
 * - Readers take no lock. get and wait poll, sleeping 1 ms doubling to 50 ms between tries.
 * - The shared data holds only the directory and a reference count; no descriptor stays open
 *   between calls, so a forked child may use the store too.
 */
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
#include "store/store_impl.h"

/* Longest encoded name: "t." + name + ".XXXXXX" stays well below NAME_MAX (255). */
#define NAME_BYTES 200
/* Bytes of the encoded key kept in front of the hash of a long name. */
#define NAME_HEAD 160
/* Room for any path the store builds (directory + '/' + kind + '.' + name + suffix). */
#define PATH_CAP 4096
#define DIR_MAX (PATH_CAP - NAME_BYTES - 32)

typedef struct file_store {
    pthread_mutex_t mu; /* guards refs */
    int refs;
    char dir[]; /* without trailing '/', except for "/" itself */
} file_store_t;

/* XSI strerror_r into buf (thread-safe, unlike strerror). */
static const char *errtext(int e, char *buf, size_t cap) {
    if (strerror_r(e, buf, cap) != 0) snprintf(buf, cap, "errno %d", e);
    return buf;
}

/* A 64-bit FNV-1a hash of s from `seed`, finished with a strong mixer. */
static uint64_t hash64(const char *s, uint64_t seed) {
    uint64_t h = 0xcbf29ce484222325ULL ^ seed;
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 0x100000001b3ULL;
    }
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

/* Writes key's file name (without the kind) into name (NAME_BYTES + 1 bytes). */
static void encode_name(const char *key, char *name) {
    static const char hex[] = "0123456789ABCDEF";
    char full[3 * 512 + 1];
    size_t n = 0;
    for (const unsigned char *p = (const unsigned char *)key; *p && n + 4 < sizeof full; p++) {
        int plain = (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') ||
                    (*p >= '0' && *p <= '9') || *p == '_' || *p == '-';
        if (plain) {
            full[n++] = (char)*p;
        } else {
            full[n++] = '%';
            full[n++] = hex[*p >> 4];
            full[n++] = hex[*p & 15];
        }
    }
    full[n] = 0;
    if (n <= NAME_BYTES) {
        memcpy(name, full, n + 1);
        return;
    }
    snprintf(name, NAME_BYTES + 1, "%.*s~%016" PRIx64 "%016" PRIx64, NAME_HEAD, full,
             hash64(key, 0), hash64(key, 0x9e3779b97f4a7c15ULL));
}

static void path_of(const file_store_t *f, char kind, const char *name, char *path) {
    snprintf(path, PATH_CAP, "%s/%c.%s", f->dir, kind, name);
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
 * Reads a value file: returns 1 when it exists (*len = its size, up to cap bytes copied into buf,
 * which may be NULL), 0 when it does not, or -errno.
 */
static int read_value(const char *path, void *buf, size_t cap, size_t *len) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return (errno == ENOENT || errno == ESTALE) ? 0 : -errno;
    int rc = 1;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        rc = -errno;
        goto out;
    }
    size_t size = (size_t)st.st_size, want = size < cap ? size : cap, got = 0;
    while (buf && got < want) {
        ssize_t n = read(fd, (char *)buf + got, want - got);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            rc = -errno;
            goto out;
        }
        if (n == 0) { /* values are immutable, so this is a damaged file */
            rc = -EIO;
            goto out;
        }
        got += (size_t)n;
    }
    *len = size;
out:
    close(fd);
    return rc;
}

/* Atomically replaces key's value: temporary file, then rename(). The caller holds the lock. */
static int write_value(const file_store_t *f, const char *key, const char *name, const void *value,
                       size_t len, const char *op, char *err) {
    char tmp[PATH_CAP], final[PATH_CAP], e[128];
    snprintf(tmp, sizeof tmp, "%s/t.%s.XXXXXX", f->dir, name);
    path_of(f, 'k', name, final);
    const char *step = "create a temporary file";
    int fd = mkstemp(tmp), created = fd >= 0;
    if (fd < 0) goto fail;
    fcntl(fd, F_SETFD, FD_CLOEXEC);
    step = "write the temporary file";
    for (size_t done = 0; done < len;) {
        ssize_t n = write(fd, (const char *)value + done, len - done);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) goto fail;
        done += (size_t)n;
    }
    /* NFS reports deferred write errors at close. */
    int closed = close(fd);
    fd = -1;
    if (closed != 0) goto fail;
    step = "rename the temporary file into place";
    if (rename(tmp, final) != 0) goto fail;
    return FSDP_OK;
fail:;
    int saved = errno;
    if (fd >= 0) close(fd);
    if (created) unlink(tmp);
    return fsdp__err(err, FSDP_EBACKEND, "file store %s: %s '%s': cannot %s: %s", f->dir, op, key,
                     step, errtext(saved, e, sizeof e));
}

/*
 * Opens key's lock file and locks it exclusively, polling (50 us doubling to 10 ms: the lock is
 * held for a few system calls) until the deadline. On success *fd holds the lock; close it to
 * unlock.
 */
static int lock_key(const file_store_t *f, const char *key, const char *name, int64_t timeout_ms,
                    const char *op, int *fd, char *err) {
    char path[PATH_CAP], e[128];
    path_of(f, 'l', name, path);
    int64_t deadline = fsdp__store_deadline_ns(timeout_ms);
    *fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (*fd < 0)
        return fsdp__err(err, FSDP_EBACKEND, "file store %s: %s '%s': cannot open the lock file: %s",
                         f->dir, op, key, errtext(errno, e, sizeof e));
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
    encode_name(key, name);
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
    char name[NAME_BYTES + 1], path[PATH_CAP], e[128];
    encode_name(key, name);
    path_of(f, 'k', name, path);
    int64_t deadline = fsdp__store_deadline_ns(timeout_ms), nap = 0;
    for (;;) {
        int found = read_value(path, buf, cap, len);
        if (found == 1) return FSDP_OK;
        if (found < 0)
            return fsdp__err(err, FSDP_EBACKEND, "file store %s: get '%s': cannot read %s: %s",
                             f->dir, key, path, errtext(-found, e, sizeof e));
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
    char name[NAME_BYTES + 1], path[PATH_CAP], e[128];
    encode_name(key, name);
    path_of(f, 'k', name, path);
    int fd;
    int rc = lock_key(f, key, name, timeout_ms, "add", &fd, err);
    if (rc < 0) return rc;
    char text[32];
    size_t len = 0;
    int64_t value = 0;
    int found = read_value(path, text, sizeof text, &len);
    if (found < 0) {
        rc = fsdp__err(err, FSDP_EBACKEND, "file store %s: add '%s': cannot read %s: %s", f->dir,
                       key, path, errtext(-found, e, sizeof e));
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
    char name[NAME_BYTES + 1], path[PATH_CAP], e[128];
    encode_name(key, name);
    path_of(f, 'k', name, path);
    struct stat st;
    if (stat(path, &st) == 0) {
        *found = 1;
    } else if (errno == ENOENT) {
        *found = 0;
    } else {
        return fsdp__err(err, FSDP_EBACKEND, "file store %s: check '%s': cannot stat %s: %s",
                         f->dir, key, path, errtext(errno, e, sizeof e));
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

/* mkdir -p: creates every missing directory of `dir`. */
static int make_dirs(fsdp_ctx_t *ctx, const char *dir) {
    char path[PATH_CAP], e[128];
    snprintf(path, sizeof path, "%s", dir);
    for (char *p = path + 1;; p++) {
        if (*p != '/' && *p != 0) continue;
        char c = *p;
        *p = 0;
        struct stat st;
        int made = mkdir(path, 0777) == 0, saved = errno;
        if (!made && saved != EEXIST && !(stat(path, &st) == 0 && S_ISDIR(st.st_mode)))
            return fsdp__ctx_err_or_log(ctx, FSDP_EBACKEND,
                                        "fsdp_store_create_file: cannot create directory '%s' "
                                        "(for '%s'): %s",
                                        path, dir, errtext(saved, e, sizeof e));
        *p = c;
        if (!c) break;
    }
    struct stat st;
    if (stat(dir, &st) != 0)
        return fsdp__ctx_err_or_log(ctx, FSDP_EBACKEND,
                                    "fsdp_store_create_file: cannot use '%s': %s", dir,
                                    errtext(errno, e, sizeof e));
    if (!S_ISDIR(st.st_mode))
        return fsdp__ctx_err_or_log(
            ctx, FSDP_EBACKEND, "fsdp_store_create_file: '%s' exists and is not a directory", dir);
    return FSDP_OK;
}

/* Proves that files can be created in dir, so that a read-only directory fails here and not at
 * the first set of a rank. */
static int probe_dir(fsdp_ctx_t *ctx, const char *dir) {
    char path[PATH_CAP], e[128];
    snprintf(path, sizeof path, "%s/t.probe.XXXXXX", dir);
    int fd = mkstemp(path);
    if (fd < 0)
        return fsdp__ctx_err_or_log(ctx, FSDP_EBACKEND,
                                    "fsdp_store_create_file: cannot create files in '%s': %s", dir,
                                    errtext(errno, e, sizeof e));
    close(fd);
    unlink(path);
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
    int rc = make_dirs(ctx, f->dir);
    if (rc == FSDP_OK) rc = probe_dir(ctx, f->dir);
    if (rc < 0) {
        free(f);
        return rc;
    }
    pthread_mutex_init(&f->mu, NULL);
    f->refs = 1;
    rc = fsdp__store_wrap(&file_ops, f, out);
    if (rc < 0) return fsdp__ctx_err_or_log(ctx, rc, "fsdp_store_create_file: out of memory");
    return FSDP_OK;
}
