/* SPDX-License-Identifier: MIT */
/*
 * store_url.h: parsing of store URLs (fsdp_store_open_url), apart from opening, so that tests can
 * check what a URL means without a server.
 */
#ifndef FSDP_STORE_URL_H
#define FSDP_STORE_URL_H

#include "internal.h"

typedef enum fsdp__store_url_kind {
    FSDP__STORE_URL_MEMORY,
    FSDP__STORE_URL_FILE,
    FSDP__STORE_URL_REDIS,
    FSDP__STORE_URL_TCP,
} fsdp__store_url_kind_t;

typedef struct fsdp__store_url {
    fsdp__store_url_kind_t kind;
    char path[4096];    /* file: the absolute directory, percent-decoded */
    char host[256];     /* redis, tcp: host name or address (IPv6 without its brackets) */
    int port;           /* redis, tcp: 1..65535; redis: 6379 when the URL has none */
    char prefix[256];   /* redis, tcp: key prefix (?prefix=), percent-decoded, "" when none */
    char user[256];     /* redis: user name, percent-decoded, "" when none */
    char password[256]; /* redis: password, percent-decoded, "" when none (never printed) */
    int db;             /* redis: database number (the path), 0 when none */
} fsdp__store_url_t;

/* Parses url into *out. FSDP_EINVAL with a message in err (FSDP_ERR_LEN bytes) that quotes the
 * URL, its password redacted, and lists the accepted forms. */
int fsdp__store_url_parse(const char *url, fsdp__store_url_t *out, char *err);

/*
 * Copies url into out (cap bytes, always terminated) with its password replaced by "***": the
 * user information of a URL "scheme://userinfo@..." is what precedes the last '@'; its part
 * after the first ':' (all of it when there is no ':') is the password. Every message that
 * shows a store URL shows it through this function (the parser splits the same way, so what
 * it takes for the password is always what is hidden).
 */
void fsdp__store_url_redact(const char *url, char *out, size_t cap);

#endif /* FSDP_STORE_URL_H */
