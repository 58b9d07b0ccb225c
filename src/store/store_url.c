/* SPDX-License-Identifier: MIT */
/*
 * store_url.c: fsdp_store_open_url(): one string that names a store, for launchers and
 * environment variables.
 *
 *   memory:                                          a new in-memory store
 *   file:///abs/path                                 the file store in /abs/path
 *                                                    ("file://localhost/..." too)
 *   redis://[[user]:password@]host[:port][/db][?prefix=P]
 *                                                    the Redis store (port 6379, db 0)
 *   tcp://host:port[?prefix=P]                       the TCP store served at host:port
 *
 * IPv6 hosts are written "[v6addr]". Schemes are case-insensitive. The path, user, password and
 * prefix are percent-decoded; the host is not. The user information is what precedes the last
 * '@' before the query (so a password may hold ':', '/' or '@'; one holding '?' must write %3F).
 * Fragments and queries other than one prefix= are refused rather than ignored. Messages quote
 * the URL through fsdp__store_url_redact, never with its password.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "store/store_impl.h"
#include "store/store_url.h"

#define FORMS                                                                                      \
    "file:///abs/path, redis://[[user]:password@]host[:port][/db][?prefix=P], "                    \
    "tcp://host:port[?prefix=P] or memory:"

void fsdp__store_url_redact(const char *url, char *out, size_t cap) {
    if (!cap) return;
    const char *sep = url ? strstr(url, "://") : NULL;
    const char *at = sep ? strrchr(sep + 3, '@') : NULL;
    if (!at) {
        snprintf(out, cap, "%s", url ? url : "(null)");
        return;
    }
    const char *ui = sep + 3, *colon = memchr(ui, ':', (size_t)(at - ui));
    const char *keep_end = colon ? colon + 1 : ui; /* the user name stays, the password goes */
    snprintf(out, cap, "%.*s***%s", (int)(keep_end - url), url, at);
}

static int bad(char *err, const char *url, const char *why) {
    char shown[600];
    fsdp__store_url_redact(url, shown, sizeof shown);
    return fsdp__err(err, FSDP_EINVAL,
                     "fsdp_store_open_url: '%.200s': %s; accepted forms are " FORMS, shown, why);
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
    if (!path || !path[0]) return bad(err, url, "the path is missing");
    if (decode(path, strlen(path), out->path, sizeof out->path) != 0)
        return bad(err, url, "the path has a bad %-escape, an encoded NUL or is too long");
    out->kind = FSDP__STORE_URL_FILE;
    return FSDP_OK;
}

/* Parses "host[:port]" (n bytes at s; "[v6]" for IPv6) into out->host and out->port. */
static int parse_hostport(const char *url, const char *s, size_t n, int default_port,
                          fsdp__store_url_t *out, char *err) {
    const char *host = s, *end = s + n, *colon;
    size_t host_len;
    if (n && *host == '[') { /* [IPv6]:port */
        const char *close = memchr(host, ']', n);
        if (!close) return bad(err, url, "the IPv6 host has no closing ']'");
        host_len = (size_t)(close - host - 1);
        host++;
        colon = close + 1;
        if (colon < end && *colon != ':')
            return bad(err, url, "only ':port' may follow the IPv6 host");
        if (colon >= end) colon = NULL;
    } else {
        colon = memchr(host, ':', n);
        host_len = colon ? (size_t)(colon - host) : n;
    }
    if (host_len == 0) return bad(err, url, "the host is missing");
    if (host_len >= sizeof out->host) return bad(err, url, "the host is too long");
    memcpy(out->host, host, host_len);
    out->host[host_len] = 0;
    out->port = default_port;
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
    if (out->port == 0) return bad(err, url, "the port is missing (tcp://host:port)");
    return FSDP_OK;
}

/* Parses the query (after '?', may be NULL): nothing, or one prefix=P. */
static int parse_query(const char *url, const char *q, fsdp__store_url_t *out, char *err) {
    out->prefix[0] = 0;
    if (!q) return FSDP_OK;
    if (strncmp(q, "prefix=", 7) != 0 || strchr(q, '&'))
        return bad(err, url, "the only query is one ?prefix=P");
    q += 7;
    if (decode(q, strlen(q), out->prefix, sizeof out->prefix) != 0)
        return bad(err, url, "the prefix has a bad %-escape, an encoded NUL or is too long");
    return FSDP_OK;
}

/* redis://[[user]:password@]host[:port][/db][?prefix=P] and tcp://host:port[?prefix=P]. */
static int parse_net(const char *url, const char *rest, int redis, fsdp__store_url_t *out,
                     char *err) {
    if (strncmp(rest, "//", 2) != 0)
        return bad(err, url,
                   redis ? "a redis URL starts with redis://" : "a tcp URL starts with tcp://");
    rest += 2;
    const char *query = strchr(rest, '?');
    size_t before_q = query ? (size_t)(query - rest) : strlen(rest);
    const char *at = NULL;
    for (size_t i = 0; i < before_q; i++)
        if (rest[i] == '@') at = rest + i;
    if (at) {
        if (!redis) return bad(err, url, "a tcp URL has no user name or password");
        const char *colon = memchr(rest, ':', (size_t)(at - rest));
        if (!colon) return bad(err, url, "a user name needs a password (user:password@)");
        if (decode(rest, (size_t)(colon - rest), out->user, sizeof out->user) != 0 ||
            decode(colon + 1, (size_t)(at - colon - 1), out->password, sizeof out->password) != 0)
            return bad(err, url,
                       "the user or password has a bad %-escape, an encoded NUL or is too long");
        if (!out->password[0]) return bad(err, url, "the password is empty");
        rest = at + 1;
        before_q = query ? (size_t)(query - rest) : strlen(rest);
    }
    if (memchr(rest, '#', strlen(rest))) return bad(err, url, "fragments are not supported");
    const char *slash = memchr(rest, '/', before_q);
    size_t hp_len = slash ? (size_t)(slash - rest) : before_q;
    int rc = parse_hostport(url, rest, hp_len, redis ? 6379 : 0, out, err);
    if (rc < 0) return rc;
    if (slash) {
        const char *p = slash + 1, *end = rest + before_q;
        if (!redis && p < end) return bad(err, url, "a tcp URL has no path (keys: ?prefix=P)");
        long db = 0;
        for (; p < end; p++) {
            if (*p < '0' || *p > '9' || db > 1000000)
                return bad(err, url,
                           "the path is the database number, a whole number (the key prefix is "
                           "?prefix=P)");
            db = db * 10 + (*p - '0');
        }
        out->db = (int)db;
    }
    rc = parse_query(url, query ? query + 1 : NULL, out, err);
    if (rc < 0) return rc;
    out->kind = redis ? FSDP__STORE_URL_REDIS : FSDP__STORE_URL_TCP;
    return FSDP_OK;
}

int fsdp__store_url_parse(const char *url, fsdp__store_url_t *out, char *err) {
    if (!url) return fsdp__err(err, FSDP_EINVAL, "fsdp_store_open_url: url is NULL");
    memset(out, 0, sizeof *out);
    const char *colon = strchr(url, ':');
    if (!colon) return bad(err, url, "there is no scheme");
    size_t n = (size_t)(colon - url);
    const char *rest = colon + 1;
    if (n == 6 && strncasecmp(url, "memory", 6) == 0) {
        if (*rest) return bad(err, url, "nothing may follow 'memory:'");
        out->kind = FSDP__STORE_URL_MEMORY;
        return FSDP_OK;
    }
    if (n == 4 && strncasecmp(url, "file", 4) == 0) {
        if (strpbrk(url, "?#")) return bad(err, url, "queries and fragments are not supported");
        return parse_file(url, rest, out, err);
    }
    if (n == 5 && strncasecmp(url, "redis", 5) == 0) return parse_net(url, rest, 1, out, err);
    if (n == 3 && strncasecmp(url, "tcp", 3) == 0) return parse_net(url, rest, 0, out, err);
    return bad(err, url, "the scheme is not file, redis, tcp or memory");
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
    } else if (u->kind == FSDP__STORE_URL_TCP) {
        rc = fsdp_store_create_tcp(ctx, u->host, u->port, u->prefix, out);
    } else {
        fsdp__redis_auth_t auth = {u->user, u->password, u->db};
        rc = fsdp__store_create_redis_auth(ctx, u->host, u->port, u->prefix, &auth, out);
    }
    memset(u->password, 0, sizeof u->password);
    free(u);
    return rc;
}
