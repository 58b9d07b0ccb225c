/* SPDX-License-Identifier: MIT */
/*
 * fuzz_store_url.c: a fuzz target for the store URL parser (src/store/store_url.c).
 *
 * The input, up to its first NUL, is a URL. A refusal is FSDP_EINVAL with a message inside the
 * error buffer. What is accepted must be a well-formed result, and must mean the same when
 * written back as a URL: the file path (absolute), the user, password and key prefix
 * percent-encoded byte by byte, the host as it was (bracketed when it holds a ':'), the port and
 * the Redis database in decimal. Parsing that URL again gives the same kind, path, host, port,
 * database, user, password and prefix.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "fuzz/fuzz.h"
#include "store/store_url.h"

/* Appends s percent-encoded (every byte but letters, digits and '/') to out at *o. */
static void encode(char *out, size_t *o, size_t cap, const char *s) {
    static const char hex[] = "0123456789ABCDEF";
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (*o + 4 > cap) fuzz_die("store_url: the re-encoded URL is too long");
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
            c == '/') {
            out[(*o)++] = (char)c;
        } else {
            out[(*o)++] = '%';
            out[(*o)++] = hex[c >> 4];
            out[(*o)++] = hex[c & 15];
        }
    }
    out[*o] = 0;
}

int fuzz_store_url_one(const uint8_t *data, size_t size) {
    char *url = malloc(size + 1);
    if (!url) fuzz_die("store_url: out of memory");
    memcpy(url, data, size);
    url[size] = 0;
    static fsdp__store_url_t u, again;
    char err[FSDP_ERR_LEN];
    memset(err, 0x7f, sizeof err);
    int rc = fsdp__store_url_parse(url, &u, err);
    if (rc != FSDP_OK) {
        if (rc != FSDP_EINVAL) fuzz_die("store_url: status %d for '%s'", rc, url);
        if (!memchr(err, 0, sizeof err)) fuzz_die("store_url: the message is not terminated");
        fuzz_check_status(rc, err, "fsdp__store_url_parse");
        free(url);
        return 0;
    }
    /* the canonical form of what was accepted */
    static char
        canon[3 * sizeof u.path + 3 * (sizeof u.prefix + sizeof u.user + sizeof u.password) + 600];
    size_t o = 0;
    switch (u.kind) {
    case FSDP__STORE_URL_MEMORY:
        if (strcasecmp(url, "memory:") != 0) fuzz_die("store_url: '%s' taken as memory:", url);
        snprintf(canon, sizeof canon, "memory:");
        break;
    case FSDP__STORE_URL_FILE:
        if (u.path[0] != '/') fuzz_die("store_url: '%s' gave the relative path '%s'", url, u.path);
        o = (size_t)snprintf(canon, sizeof canon, "file://");
        encode(canon, &o, sizeof canon, u.path);
        break;
    case FSDP__STORE_URL_REDIS:
    case FSDP__STORE_URL_TCP: {
        const int redis = u.kind == FSDP__STORE_URL_REDIS;
        if (!u.host[0] || u.port < 1 || u.port > 65535)
            fuzz_die("store_url: '%s' gave host '%s' port %d", url, u.host, u.port);
        if (strpbrk(u.host, "/@?#"))
            fuzz_die("store_url: '%s' gave host '%s', which holds a delimiter", url, u.host);
        if (u.db < 0 || (!redis && (u.db || u.user[0] || u.password[0])))
            fuzz_die("store_url: '%s' gave db %d, user '%s' or a password it cannot have", url,
                     u.db, u.user);
        if (u.user[0] && !u.password[0])
            fuzz_die("store_url: '%s' gave user '%s' without a password", url, u.user);
        o = (size_t)snprintf(canon, sizeof canon, redis ? "redis://" : "tcp://");
        if (u.password[0]) {
            encode(canon, &o, sizeof canon, u.user);
            canon[o++] = ':';
            encode(canon, &o, sizeof canon, u.password);
            canon[o++] = '@';
        }
        const int br = strchr(u.host, ':') || u.host[0] == '['; /* as the parser reads it */
        o +=
            (size_t)snprintf(canon + o, sizeof canon - o, br ? "[%s]:%d" : "%s:%d", u.host, u.port);
        if (redis) o += (size_t)snprintf(canon + o, sizeof canon - o, "/%d", u.db);
        if (u.prefix[0]) {
            o += (size_t)snprintf(canon + o, sizeof canon - o, "?prefix=");
            encode(canon, &o, sizeof canon, u.prefix);
        }
        break;
    }
    default:
        fuzz_die("store_url: '%s' gave kind %d", url, (int)u.kind);
    }
    rc = fsdp__store_url_parse(canon, &again, err);
    if (rc != FSDP_OK)
        fuzz_die("store_url: '%s' was accepted, its form '%s' not: %s", url, canon, err);
    if (again.kind != u.kind || strcmp(again.path, u.path) != 0 ||
        strcmp(again.host, u.host) != 0 || again.port != u.port ||
        strcmp(again.prefix, u.prefix) != 0 || strcmp(again.user, u.user) != 0 ||
        strcmp(again.password, u.password) != 0 || again.db != u.db)
        fuzz_die("store_url: '%s' and its form '%s' mean different stores", url, canon);
    free(url);
    return 1;
}

#ifdef FUZZ_LIBFUZZER
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_store_url_one(data, size);
    return 0;
}
#endif
