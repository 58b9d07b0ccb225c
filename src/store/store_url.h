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
} fsdp__store_url_kind_t;

typedef struct fsdp__store_url {
    fsdp__store_url_kind_t kind;
    char path[4096];  /* file: the absolute directory, percent-decoded */
    char host[256];   /* redis: host name or address (IPv6 without its brackets) */
    int port;         /* redis: 1..65535, 6379 when the URL has none */
    char prefix[256]; /* redis: key prefix, percent-decoded, "" when none */
} fsdp__store_url_t;

/* Parses url into *out. FSDP_EINVAL with a message in err (FSDP_ERR_LEN bytes) that quotes the
 * URL and lists the accepted forms. */
int fsdp__store_url_parse(const char *url, fsdp__store_url_t *out, char *err);

#endif /* FSDP_STORE_URL_H */
