/* SPDX-License-Identifier: MIT */
/*
 * fuzz_util.c: what the fuzz targets share (fuzz.h): aborting on a broken promise, checking a
 * refusal's status and message, one quiet context, and a scratch directory for targets whose
 * parser reads files.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fuzz/fuzz.h"

void fuzz_die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("fuzz: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}

void fuzz_check_status(int rc, const char *msg, const char *what) {
    if (rc == FSDP_OK) return;
    if (rc != FSDP_EINVAL && rc != FSDP_ENOTSUP && rc != FSDP_ENOMEM && rc != FSDP_EBACKEND)
        fuzz_die("%s returned %d (%s)", what, rc, msg ? msg : "no message");
    if (!msg || !msg[0]) fuzz_die("%s failed (%d) with no message", what, rc);
}

static fsdp_ctx_t *ctx;
static char dir[256];

static void cleanup(void) {
    if (dir[0]) {
        DIR *d = opendir(dir);
        struct dirent *e;
        while (d && (e = readdir(d)))
            if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
                unlinkat(dirfd(d), e->d_name, 0);
        if (d) closedir(d);
        rmdir(dir);
        dir[0] = 0;
    }
    fsdp_ctx_destroy(ctx);
    ctx = NULL;
}

fsdp_ctx_t *fuzz_ctx(void) {
    if (ctx) return ctx;
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    if (fsdp_ctx_create(&o, &ctx) < 0) fuzz_die("fsdp_ctx_create failed");
    fsdp_ctx_set_log_level(ctx, FSDP_LOG_OFF);
    atexit(cleanup);
    return ctx;
}

const char *fuzz_path(const char *name) {
    static char path[512];
    if (!dir[0]) {
        fuzz_ctx(); /* registers the cleanup */
        const char *tmp = getenv("TMPDIR");
        int n = snprintf(dir, sizeof dir, "%s/fsdp-fuzz.XXXXXX", tmp && *tmp ? tmp : "/tmp");
        if (n < 0 || (size_t)n >= sizeof dir) fuzz_die("TMPDIR %s is too long", tmp);
        if (!mkdtemp(dir)) fuzz_die("mkdtemp %s: %s", dir, strerror(errno));
    }
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return path;
}

void fuzz_write_file(const char *path, const void *p, size_t n) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) fuzz_die("open %s: %s", path, strerror(errno));
    const char *c = p;
    while (n) {
        ssize_t w = write(fd, c, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) fuzz_die("write %s: %s", path, strerror(errno));
        c += w;
        n -= (size_t)w;
    }
    if (close(fd) != 0) fuzz_die("close %s: %s", path, strerror(errno));
}
