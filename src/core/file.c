/* SPDX-License-Identifier: MIT */
/*
 * file.c: the file helpers the layers share (internal.h): opening a file to read that must be a
 * regular file, and replacing a file atomically without ever replacing anything but a regular
 * file.
 *
 * They exist because a path can name something other than a file: a FIFO, whose open blocks
 * until a writer comes; a device, whose open or replacement has effects (as root, a rename over
 * /dev/full replaced the device node); a symbolic link planted by another user. So every open
 * for reading is non-blocking and checked with fstat before a byte is read, and every
 * replacement checks the destination with lstat before writing and again just before the
 * rename. The helpers put their reason into the caller's buffer and never log: each caller
 * reports through its own object.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

/* XSI strerror_r into buf (thread-safe, unlike strerror). */
static const char *errtext(int e, char *buf, size_t cap) {
    if (strerror_r(e, buf, cap) != 0) snprintf(buf, cap, "errno %d", e);
    return buf;
}

const char *fsdp__file_kind(unsigned mode) {
    mode_t m = (mode_t)mode;
    if (S_ISREG(m)) return "a regular file";
    if (S_ISDIR(m)) return "a directory";
    if (S_ISFIFO(m)) return "a FIFO (named pipe)";
    if (S_ISCHR(m)) return "a character device";
    if (S_ISBLK(m)) return "a block device";
    if (S_ISSOCK(m)) return "a socket";
    if (S_ISLNK(m)) return "a symbolic link";
    return "a file of unknown type";
}

int fsdp__open_regular(int dirfd, const char *path, int flags, unsigned mode, struct stat *out,
                       char *why, size_t cap) {
    char e[128];
    int saved, fd = openat(dirfd, path, flags | O_NONBLOCK | O_NOCTTY | O_CLOEXEC, (mode_t)mode);
    struct stat st;
    if (fd < 0) {
        saved = errno;
        /* Name what is there when it is the reason (a socket is ENXIO, a link under O_NOFOLLOW
         * ELOOP, a directory opened for writing EISDIR), rather than quote the errno. */
        int at = flags & O_NOFOLLOW ? AT_SYMLINK_NOFOLLOW : 0;
        if (saved != ENOENT && fstatat(dirfd, path, &st, at) == 0 && !S_ISREG(st.st_mode)) {
            snprintf(why, cap, "is %s, not a regular file%s", fsdp__file_kind(st.st_mode),
                     S_ISLNK(st.st_mode) ? " (links are not followed here)" : "");
            errno = saved;
            return FSDP_EINVAL;
        }
        snprintf(why, cap, "cannot open: %s", errtext(saved, e, sizeof e));
        errno = saved;
        return FSDP_EBACKEND;
    }
    int rc = FSDP_EBACKEND;
    if (fstat(fd, &st) != 0) {
        saved = errno;
        snprintf(why, cap, "cannot stat: %s", errtext(saved, e, sizeof e));
        goto fail;
    }
    if (!S_ISREG(st.st_mode)) {
        saved = EINVAL;
        rc = FSDP_EINVAL;
        snprintf(why, cap, "is %s, not a regular file", fsdp__file_kind(st.st_mode));
        goto fail;
    }
    /* A regular file never blocks, but callers may hand the descriptor to stdio. */
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        saved = errno;
        snprintf(why, cap, "cannot clear O_NONBLOCK: %s", errtext(saved, e, sizeof e));
        goto fail;
    }
    if (out) *out = st;
    return fd;
fail:
    close(fd);
    errno = saved;
    return rc;
}

/* FSDP_OK when path (relative to dirfd) is absent or a regular file; FSDP_EINVAL when it is
 * anything else (a link is not followed), FSDP_EBACKEND when it cannot be looked at. */
static int check_target(int dirfd, const char *path, char *why, size_t cap) {
    struct stat st;
    char e[128];
    if (fstatat(dirfd, path, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno == ENOENT) return FSDP_OK;
        snprintf(why, cap, "'%s': cannot stat: %s", path, errtext(errno, e, sizeof e));
        return FSDP_EBACKEND;
    }
    if (S_ISREG(st.st_mode)) return FSDP_OK;
    snprintf(why, cap, "'%s' is %s, not a regular file: refusing to replace it", path,
             fsdp__file_kind(st.st_mode));
    return FSDP_EINVAL;
}

int fsdp__sync_dir_of(int dirfd, const char *path) {
    const char *slash = strrchr(path, '/');
    int fd;
    if (!slash && dirfd != AT_FDCWD) {
        fd = dup(dirfd);
    } else {
        char *dir = slash ? strndup(path, slash == path ? 1 : (size_t)(slash - path)) : strdup(".");
        if (!dir) {
            errno = ENOMEM;
            return -1;
        }
        fd = openat(dirfd, dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        free(dir);
    }
    if (fd < 0) return -1;
    int rc = fsync(fd), e = errno;
    close(fd);
    if (rc != 0 && e == EINVAL) rc = 0;
    errno = e;
    return rc;
}

int fsdp__replace_begin(fsdp__replace_t *r, int dirfd, const char *path, unsigned mode, bool sync,
                        char *why, size_t cap) {
    *r = (fsdp__replace_t){.dirfd = dirfd, .path = path, .fd = -1, .sync = sync};
    int rc = check_target(dirfd, path, why, cap);
    if (rc < 0) return rc;
    size_t len = strlen(path) + 64;
    char *tmp = malloc(len), e[128];
    if (!tmp) {
        snprintf(why, cap, "'%s': out of memory", path);
        return FSDP_ENOMEM;
    }
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    unsigned long long k =
        (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
    for (int attempt = 0; attempt < 100; attempt++, k++) {
        snprintf(tmp, len, "%s.tmp-%ld-%llx", path, (long)getpid(), k);
        /* O_EXCL and O_NOFOLLOW: never a file or a link that someone put there */
        r->fd =
            openat(dirfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, (mode_t)mode);
        if (r->fd >= 0) {
            r->tmp = tmp;
            return FSDP_OK;
        }
        if (errno != EEXIST) break;
    }
    int saved = errno;
    snprintf(why, cap, "'%s': cannot create a temporary file beside it ('%s'): %s", path, tmp,
             errtext(saved, e, sizeof e));
    free(tmp);
    errno = saved;
    return FSDP_EBACKEND;
}

int fsdp__replace_commit(fsdp__replace_t *r, char *why, size_t cap) {
    char e[128];
    int rc = FSDP_EBACKEND;
    if (r->fd >= 0) {
        if (r->sync && fsync(r->fd) != 0) {
            snprintf(why, cap, "'%s': fsync failed: %s", r->tmp, errtext(errno, e, sizeof e));
            goto fail;
        }
        int closed = close(r->fd);
        r->fd = -1;
        /* some file systems (NFS) report write errors only at close */
        if (closed != 0) {
            snprintf(why, cap, "'%s': close failed: %s", r->tmp, errtext(errno, e, sizeof e));
            goto fail;
        }
    }
    /* Again: the destination may have been replaced while the file was written. */
    if ((rc = check_target(r->dirfd, r->path, why, cap)) < 0) goto fail;
    if (renameat(r->dirfd, r->tmp, r->dirfd, r->path) != 0) {
        rc = FSDP_EBACKEND;
        snprintf(why, cap, "renaming '%s' to '%s' failed: %s", r->tmp, r->path,
                 errtext(errno, e, sizeof e));
        goto fail;
    }
    free(r->tmp);
    r->tmp = NULL;
    if (r->sync && fsdp__sync_dir_of(r->dirfd, r->path) != 0) {
        snprintf(why, cap,
                 "'%s' is in place, but syncing its directory failed, so the rename may not "
                 "survive a crash: %s",
                 r->path, errtext(errno, e, sizeof e));
        return FSDP_EBACKEND;
    }
    return FSDP_OK;
fail:
    fsdp__replace_abort(r);
    return rc;
}

void fsdp__replace_abort(fsdp__replace_t *r) {
    int saved = errno;
    if (r->fd >= 0) close(r->fd);
    r->fd = -1;
    if (r->tmp) unlinkat(r->dirfd, r->tmp, 0);
    free(r->tmp);
    r->tmp = NULL;
    errno = saved;
}
