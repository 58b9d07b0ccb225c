/* SPDX-License-Identifier: MIT */
/*
 * store_url.c: fsdp_store_open_url(): one string that names a store, for launchers and
 * environment variables.
 *
 *   memory:                          a new in-memory store
 *   file:///abs/path                 the file store in /abs/path ("file://localhost/..." too)
 *   redis://host[:port][/prefix]     the Redis store (port 6379; "[v6addr]" for IPv6 hosts)
 *
 * Schemes are case-insensitive. The path and the prefix are percent-decoded; the host is not.
 * User names, passwords, queries and fragments are refused rather than ignored.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "store/store_impl.h"
#include "store/store_url.h"

#define FORMS "file:///abs/path, redis://host[:port][/prefix] or memory:"

static int bad(char *err, const char *url, const char *why) {
    return fsdp__err(err, FSDP_EINVAL, "fsdp_store_open_url: '%.200s': %s; accepted forms are " FORMS,
                     url, why);
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Percent-decodes the n bytes at s into out (cap bytes); -1 on a bad escape, %00 or overflow. */
static int decode(const char *s, size_t n, char *out, size_t cap) {
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (c == '%') {
            if (i + 2 >= n) return -1;
            int a = hexval(s[i + 1]), b = hexval(s[i + 2]);
            if (a < 0 || b < 0 || (a == 0 && b == 0)) return -1;
            c = (char)(a * 16 + b);
            i += 2;
        }
        if (o + 1 >= cap) return -1;
        out[o++] = c;
    }
    out[o] = 0;
    return 0;
}

static int parse_file(const char *url, const char *rest, fsdp__store_url_t *out, char *err) {
    if (strncmp(rest, "//", 2) != 0)
        return bad(err, url, "a file URL starts with file:// and has an absolute path");
    rest += 2;
    const char *path = strchr(rest, '/');
    size_t host_len = path ? (size_t)(path - rest) : strlen(rest);
    if (host_len && !(host_len == 9 && strncasecmp(rest, "localhost", 9) == 0))
        return bad(err, url, "a file URL names no host (write file:///abs/path, with three '/')");
    if (!path || !path[0])
        return bad(err, url, "the path is missing");
    if (decode(path, strlen(path), out->path, sizeof out->path) != 0)
        return bad(err, url, "the path has a bad %-escape, an encoded NUL or is too long");
    out->kind = FSDP__STORE_URL_FILE;
    return FSDP_OK;
}

static int parse_redis(const char *url, const char *rest, fsdp__store_url_t *out, char *err) {
    if (strncmp(rest, "//", 2) != 0) return bad(err, url, "a redis URL starts with redis://");
    rest += 2;
    const char *slash = strchr(rest, '/');
    size_t auth_len = slash ? (size_t)(slash - rest) : strlen(rest);
    if (memchr(rest, '@', auth_len))
        return bad(err, url, "user names and passwords are not supported");
    const char *host = rest, *end = rest + auth_len, *colon;
    size_t host_len;
    if (*host == '[') { /* [IPv6]:port */
        const char *close = memchr(host, ']', auth_len);
        if (!close) return bad(err, url, "the IPv6 host has no closing ']'");
        host_len = (size_t)(close - host - 1);
        host++;
        colon = close + 1;
        if (colon < end && *colon != ':')
            return bad(err, url, "only ':port' may follow the IPv6 host");
        if (colon >= end) colon = NULL;
    } else {
        colon = memchr(host, ':', auth_len);
        host_len = colon ? (size_t)(colon - host) : auth_len;
    }
    if (host_len == 0) return bad(err, url, "the host is missing");
    if (host_len >= sizeof out->host) return bad(err, url, "the host is too long");
    memcpy(out->host, host, host_len);
    out->host[host_len] = 0;
    out->port = 6379;
    if (colon) {
        const char *p = colon + 1;
        if (p == end) return bad(err, url, "the port is empty");
        long port = 0;
        for (; p < end; p++) {
            if (*p < '0' || *p > '9') return bad(err, url, "the port is not a number");
            port = port * 10 + (*p - '0');
            if (port > 65535) break;
        }
        if (port < 1 || port > 65535) return bad(err, url, "the port is outside 1..65535");
        out->port = (int)port;
    }
    out->prefix[0] = 0;
    if (slash && decode(slash + 1, strlen(slash + 1), out->prefix, sizeof out->prefix) != 0)
        return bad(err, url, "the prefix has a bad %-escape, an encoded NUL or is too long");
    out->kind = FSDP__STORE_URL_REDIS;
    return FSDP_OK;
}

int fsdp__store_url_parse(const char *url, fsdp__store_url_t *out, char *err) {
    if (!url) return fsdp__err(err, FSDP_EINVAL, "fsdp_store_open_url: url is NULL");
    memset(out, 0, sizeof *out);
    if (strpbrk(url, "?#")) return bad(err, url, "queries and fragments are not supported");
    const char *colon = strchr(url, ':');
    if (!colon) return bad(err, url, "there is no scheme");
    size_t n = (size_t)(colon - url);
    const char *rest = colon + 1;
    if (n == 6 && strncasecmp(url, "memory", 6) == 0) {
        if (*rest) return bad(err, url, "nothing may follow 'memory:'");
        out->kind = FSDP__STORE_URL_MEMORY;
        return FSDP_OK;
    }
    if (n == 4 && strncasecmp(url, "file", 4) == 0) return parse_file(url, rest, out, err);
    if (n == 5 && strncasecmp(url, "redis", 5) == 0) return parse_redis(url, rest, out, err);
    return bad(err, url, "the scheme is not file, redis or memory");
}

int fsdp_store_open_url(fsdp_ctx_t *ctx, const char *url, fsdp_store_t **out) {
    if (!out) return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "fsdp_store_open_url: out is NULL");
    *out = NULL;
    fsdp__store_url_t *u = malloc(sizeof *u);
    if (!u) return fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "fsdp_store_open_url: out of memory");
    char err[FSDP_ERR_LEN];
    int rc = fsdp__store_url_parse(url, u, err);
    if (rc < 0) {
        rc = fsdp__ctx_err_or_log(ctx, rc, "%s", err);
    } else if (u->kind == FSDP__STORE_URL_MEMORY) {
        rc = fsdp_store_create_memory(ctx, out);
    } else if (u->kind == FSDP__STORE_URL_FILE) {
        rc = fsdp_store_create_file(ctx, u->path, out);
    } else {
        rc = fsdp_store_create_redis(ctx, u->host, u->port, u->prefix, out);
    }
    free(u);
    return rc;
}
