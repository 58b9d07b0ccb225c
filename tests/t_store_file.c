/* SPDX-License-Identifier: MIT */
/*
 * t_store_file.c: the file store (the common suite, processes sharing a directory, key file
 * names, directory errors) and fsdp_store_open_url (the parsing of URLs is t_store_url.c).
 *
 * Everything lives under one mkdtemp directory, removed at the end.
 */
#include <config.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fsdp.h>

#include "store_suite.h"
#include "fs_util.h"
#include "tap.h"

/* What create_redis returns for a bad port: EINVAL, or ENOTSUP before any check without hiredis. */
#if FSDP_HAVE_HIREDIS
#define REDIS_BAD_PORT FSDP_EINVAL
#else
#define REDIS_BAD_PORT FSDP_ENOTSUP
#endif

static char base[512];

/* Each namespace is a directory under base. */
static int open_file(void *arg, const char *ns, fsdp_store_t **out) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/%s", (const char *)arg, ns);
    return fsdp_store_create_file(NULL, dir, out);
}

static int exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

static void test_layout(void) {
    char dir[1024], path[1200];
    snprintf(dir, sizeof dir, "%s/made/by/mkdir-p", base);
    fsdp_store_t *s = NULL;
    fsdp_ctx_t *fresh = NULL;
    fsdp_ctx_create(NULL, &fresh);
    tap_is_int(fsdp_store_create_file(fresh, dir, &s), FSDP_OK,
               "create_file makes a missing directory and its parents");
    tap_ok(exists(dir), "the directory exists afterwards");
    tap_is_str(fsdp_ctx_last_error(fresh), "", "no error on the context after a success");
    fsdp_ctx_destroy(fresh);
    fsdp_store_set(s, "a/b", "1", 1);
    snprintf(path, sizeof path, "%s/a", dir);
    tap_ok(!exists(path), "a key with '/' makes no subdirectory");
    snprintf(path, sizeof path, "%s/k.a%%2Fb", dir);
    tap_ok(exists(path), "it is one file with the '/' %%-encoded (k.a%%2Fb)");
    fsdp_store_add(s, "n", 1, NULL);
    snprintf(path, sizeof path, "%s/l.n", dir);
    tap_ok(exists(path), "add locks the key through its own lock file (l.n)");
    fsdp_store_destroy(s);

    /* A second handle opened on the same directory sees the data (trailing '/' ignored). */
    char again[1100];
    snprintf(again, sizeof again, "%s/", dir);
    tap_is_int(fsdp_store_create_file(NULL, again, &s), FSDP_OK,
               "reopen the directory (with a '/')");
    char buf[4];
    size_t len = 0;
    fsdp_store_set_timeout(s, 200);
    tap_is_int(fsdp_store_get(s, "a/b", buf, sizeof buf, &len), FSDP_OK,
               "a new handle on the directory sees the old data");
    fsdp_store_destroy(s);
}

static void test_dir_errors(void) {
    char file[1024], dir[1100];
    snprintf(file, sizeof file, "%s/plain-file", base);
    int fd = open(file, O_CREAT | O_WRONLY, 0644);
    if (fd >= 0) close(fd);
    snprintf(dir, sizeof dir, "%s/sub/dir", file);
    fsdp_ctx_t *ctx = store_suite_ctx();
    fsdp_store_t *s = (fsdp_store_t *)1;
    int rc = fsdp_store_create_file(ctx, dir, &s);
    tap_is_int(rc, FSDP_EBACKEND, "a directory under a regular file cannot be made");
    tap_ok(s == NULL, "and *out is NULL");
    tap_has_str(fsdp_ctx_last_error(ctx), file, "the error names the path");
    tap_has_str(fsdp_ctx_last_error(ctx), "Not a directory", "and the system's reason");
    rc = fsdp_store_create_file(ctx, file, &s);
    tap_is_int(rc, FSDP_EBACKEND, "a regular file is not a store directory");
    tap_has_str(fsdp_ctx_last_error(ctx), "is not a directory", "and the error says so");
    tap_is_int(fsdp_store_create_file(ctx, "", &s), FSDP_EINVAL, "an empty dir is EINVAL");
    tap_is_int(fsdp_store_create_file(ctx, NULL, &s), FSDP_EINVAL, "a NULL dir is EINVAL");
    tap_has_str(fsdp_ctx_last_error(ctx), "NULL", "and the error says which");
    tap_is_int(fsdp_store_create_file(ctx, base, NULL), FSDP_EINVAL, "a NULL out is EINVAL");
    if (geteuid() != 0) {
        char ro[1024];
        snprintf(ro, sizeof ro, "%s/read-only", base);
        mkdir(ro, 0555);
        rc = fsdp_store_create_file(ctx, ro, &s);
        tap_is_int(rc, FSDP_EBACKEND, "a read-only directory is refused at creation");
        tap_has_str(fsdp_ctx_last_error(ctx), ro, "the error names it");
        chmod(ro, 0755);
    } else {
        tap_skip(2, "root may write to a read-only directory");
    }
}

/* ---- URLs ---- */

static void test_open_url(void) {
    fsdp_ctx_t *ctx = store_suite_ctx();
    fsdp_store_t *s = NULL, *t = NULL;
    char buf[8];
    size_t len = 0;
    tap_is_int(fsdp_store_open_url(NULL, "memory:", &s), FSDP_OK, "open_url(memory:)");
    if (s) {
        fsdp_store_set(s, "k", "m", 1);
        tap_is_int(fsdp_store_get(s, "k", buf, sizeof buf, &len), FSDP_OK,
                   "memory: URL gives a working store");
        fsdp_store_destroy(s);
        s = NULL;
    }

    char url[1100], dir[1024];
    snprintf(dir, sizeof dir, "%s/by-url", base);
    snprintf(url, sizeof url, "file://%s", dir);
    tap_is_int(fsdp_store_open_url(NULL, url, &s), FSDP_OK, "open_url(file://<abs path>)");
    tap_is_int(fsdp_store_create_file(NULL, dir, &t), FSDP_OK, "create_file on the same directory");
    if (s && t) {
        fsdp_store_set_timeout(t, 200);
        fsdp_store_set(s, "k", "f", 1);
        len = 0;
        tap_ok(fsdp_store_get(t, "k", buf, sizeof buf, &len) == FSDP_OK && len == 1 &&
                   buf[0] == 'f',
               "the file: URL opens the file store of that directory");
    }
    fsdp_store_destroy(s);
    fsdp_store_destroy(t);

    s = (fsdp_store_t *)1;
    tap_is_int(fsdp_store_open_url(ctx, "ftp://x/y", &s), FSDP_EINVAL, "open_url of a bad URL");
    tap_ok(s == NULL, "leaves *out NULL");
    tap_has_str(fsdp_ctx_last_error(ctx), "'ftp://x/y'", "the error on the context quotes the URL");
    tap_has_str(fsdp_ctx_last_error(ctx),
                "file:///abs/path, redis://[[user]:password@]host[:port][/db][?prefix=P], "
                "tcp://host:port[?prefix=P] or memory:",
                "and lists the accepted forms");
    tap_is_int(fsdp_store_open_url(ctx, NULL, &s), FSDP_EINVAL, "open_url(NULL) is EINVAL");
    tap_is_int(fsdp_store_open_url(ctx, "memory:", NULL), FSDP_EINVAL, "a NULL out is EINVAL");

    snprintf(url, sizeof url, "file://%s/plain-file/x", base);
    tap_is_int(fsdp_store_open_url(ctx, url, &s), FSDP_EBACKEND,
               "a file: URL under a regular file fails like create_file");
    tap_has_str(fsdp_ctx_last_error(ctx), "fsdp_store_create_file", "with create_file's message");

#if FSDP_HAVE_HIREDIS
    /* The Redis store connects lazily, so this needs no server; t_store_redis.c talks to one. */
    tap_is_int(fsdp_store_open_url(NULL, "redis://127.0.0.1:6390/1?prefix=job", &s), FSDP_OK,
               "open_url(redis://...) gives a Redis store (it connects on first use)");
    fsdp_store_destroy(s);
#else
    tap_is_int(fsdp_store_open_url(ctx, "redis://127.0.0.1:6390/1?prefix=job", &s), FSDP_ENOTSUP,
               "open_url(redis://...) is ENOTSUP without hiredis");
    tap_has_str(fsdp_ctx_last_error(ctx), "built without hiredis", "and the error says why");
#endif
    tap_is_int(fsdp_store_create_redis(ctx, "h", 0, NULL, &s), REDIS_BAD_PORT,
               "create_redis checks the port (or is ENOTSUP without hiredis)");
}

int main(void) {
    tap_plan_lazy();
    const char *tmp = getenv("TMPDIR");
    snprintf(base, sizeof base, "%s/t_store_file.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(base)) {
        tap_bail("mkdtemp(%s): %s", base, strerror(errno));
    }
    store_factory_t f = {"file", open_file, base};
    store_suite_run(&f);
    store_suite_two_processes(&f);
    store_suite_cross_process(&f, 4, 1000);
    test_layout();
    test_dir_errors();
    test_open_url();
    fsu_remove_tree(base);
    return tap_done();
}
