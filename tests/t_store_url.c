/* SPDX-License-Identifier: MIT */
/*
 * t_store_url.c: what a store URL means (fsdp__store_url_parse), without any server: memory:,
 * file:, redis: with AUTH, database number and ?prefix= (issue 25 item 4), tcp: (item 1), and
 * the redaction of passwords from every message that quotes a URL (issue 26).
 */
#include <config.h>

#include <stdio.h>
#include <string.h>

#include <fsdp.h>

#include "store/store_url.h"
#include "store_suite.h"
#include "tap.h"

typedef struct want {
    fsdp__store_url_kind_t kind;
    const char *a; /* path (file) or host */
    int port;
    const char *prefix;
    const char *user, *password;
    int db;
} want_t;

static void parse_ok(const char *url, want_t w) {
    fsdp__store_url_t u;
    char err[FSDP_ERR_LEN] = "";
    int rc = fsdp__store_url_parse(url, &u, err);
    int same = rc == FSDP_OK && u.kind == w.kind;
    if (same && w.kind == FSDP__STORE_URL_FILE) same = strcmp(u.path, w.a) == 0;
    if (same && (w.kind == FSDP__STORE_URL_REDIS || w.kind == FSDP__STORE_URL_TCP))
        same = strcmp(u.host, w.a) == 0 && u.port == w.port &&
               strcmp(u.prefix, w.prefix ? w.prefix : "") == 0 &&
               strcmp(u.user, w.user ? w.user : "") == 0 &&
               strcmp(u.password, w.password ? w.password : "") == 0 && u.db == w.db;
    if (!tap_ok(same, "URL '%s' parses", url))
        tap_diag("rc %d, kind %d, path '%s', host '%s', port %d, prefix '%s', user '%s', db %d: %s",
                 rc, u.kind, u.path, u.host, u.port, u.prefix, u.user, u.db, err);
}

/* Refused with a message that quotes the URL as `shown`, says why and lists the forms. */
static void parse_bad_as(const char *url, const char *shown, const char *why) {
    fsdp__store_url_t u;
    char err[FSDP_ERR_LEN] = "";
    int rc = fsdp__store_url_parse(url, &u, err);
    int good = rc == FSDP_EINVAL && strstr(err, shown) && strstr(err, why) &&
               strstr(err, "file:///abs/path") &&
               strstr(err, "redis://[[user]:password@]host[:port][/db][?prefix=P]") &&
               strstr(err, "tcp://host:port[?prefix=P]") && strstr(err, "memory:");
    if (!tap_ok(good, "URL '%s' is refused: %s", shown, why)) tap_diag("rc %d: %s", rc, err);
}

static void parse_bad(const char *url, const char *why) {
    parse_bad_as(url, url, why);
}

#define R FSDP__STORE_URL_REDIS
#define T FSDP__STORE_URL_TCP

static void test_parse(void) {
    parse_ok("memory:", (want_t){.kind = FSDP__STORE_URL_MEMORY});
    parse_ok("MEMORY:", (want_t){.kind = FSDP__STORE_URL_MEMORY});
    parse_ok("file:///tmp/x", (want_t){.kind = FSDP__STORE_URL_FILE, .a = "/tmp/x"});
    parse_ok("file:///", (want_t){.kind = FSDP__STORE_URL_FILE, .a = "/"});
    parse_ok("File://localhost/tmp/x", (want_t){.kind = FSDP__STORE_URL_FILE, .a = "/tmp/x"});
    parse_ok("file:///tmp/a%20b%2Fc", (want_t){.kind = FSDP__STORE_URL_FILE, .a = "/tmp/a b/c"});

    parse_ok("redis://h", (want_t){.kind = R, .a = "h", .port = 6379});
    parse_ok("redis://h/", (want_t){.kind = R, .a = "h", .port = 6379});
    /* item 4: the path is the database number, the prefix a query */
    parse_ok("redis://h:1234/3", (want_t){.kind = R, .a = "h", .port = 1234, .db = 3});
    parse_ok(
        "redis://redis.example.org:1234/15?prefix=job/42",
        (want_t){.kind = R, .a = "redis.example.org", .port = 1234, .prefix = "job/42", .db = 15});
    parse_ok("redis://10.0.0.1:65535?prefix=p%3Aq",
             (want_t){.kind = R, .a = "10.0.0.1", .port = 65535, .prefix = "p:q"});
    parse_ok("redis://[::1]:7000/2?prefix=p",
             (want_t){.kind = R, .a = "::1", .port = 7000, .prefix = "p", .db = 2});
    parse_ok("redis://[fe80::1]", (want_t){.kind = R, .a = "fe80::1", .port = 6379});
    /* item 4: AUTH from the URL */
    parse_ok("redis://:s3cret@h:7000",
             (want_t){.kind = R, .a = "h", .port = 7000, .password = "s3cret"});
    parse_ok(
        "redis://alice:s3cret@h/4",
        (want_t){
            .kind = R, .a = "h", .port = 6379, .user = "alice", .password = "s3cret", .db = 4});
    parse_ok("redis://:p%40ss%3Aw%2Fd@h",
             (want_t){.kind = R, .a = "h", .port = 6379, .password = "p@ss:w/d"});
    parse_ok("redis://:a:b@c/d@h:1",
             (want_t){.kind = R, .a = "h", .port = 1, .password = "a:b@c/d"});
    parse_ok("redis://:pw@[::1]:7000?prefix=x",
             (want_t){.kind = R, .a = "::1", .port = 7000, .prefix = "x", .password = "pw"});

    /* item 1: tcp */
    parse_ok("tcp://127.0.0.1:29500", (want_t){.kind = T, .a = "127.0.0.1", .port = 29500});
    parse_ok("TCP://node0:1/", (want_t){.kind = T, .a = "node0", .port = 1});
    parse_ok("tcp://[::1]:5?prefix=job%2F7",
             (want_t){.kind = T, .a = "::1", .port = 5, .prefix = "job/7"});

    parse_bad("", "no scheme");
    parse_bad("memory", "no scheme");
    parse_bad("/tmp/x", "no scheme");
    parse_bad("memory:x", "nothing may follow");
    parse_bad("memory://", "nothing may follow");
    parse_bad("http://h/x", "scheme is not file, redis, tcp or memory");
    parse_bad("file:tmp/x", "file://");
    parse_bad("file://", "path is missing");
    parse_bad("file://tmp/x", "names no host");
    parse_bad("file:///tmp/%zz", "bad %-escape");
    parse_bad("file:///tmp/%00", "encoded NUL");
    parse_bad("file:///tmp/%4", "bad %-escape");
    parse_bad("file:///tmp/x?y", "queries");
    parse_bad("redis:h:1", "redis://");
    parse_bad("redis://", "host is missing");
    parse_bad("redis://:6379", "host is missing");
    parse_bad("redis://h:", "port is empty");
    parse_bad("redis://h:0", "outside 1..65535");
    parse_bad("redis://h:65536", "outside 1..65535");
    parse_bad("redis://h:99999999999999999999", "outside 1..65535");
    parse_bad("redis://h:12ab", "not a number");
    parse_bad("redis://h:-1", "not a number");
    parse_bad("redis://h:1/job", "the path is the database number");
    parse_bad("redis://h:1/3/x", "the path is the database number");
    parse_bad("redis://h:1?db=2", "the only query is one ?prefix=P");
    parse_bad("redis://h:1?prefix=a&x=b", "the only query is one ?prefix=P");
    parse_bad("redis://h:1?prefix=%zz", "bad %-escape");
    parse_bad("redis://h#frag", "fragments");
    parse_bad("redis://[::1:7000", "closing ']'");
    parse_bad("redis://[::1]7000", "':port'");
    parse_bad_as("redis://alice@h", "redis://***@h", "a user name needs a password");
    parse_bad_as("redis://alice:@h", "redis://alice:***@h", "the password is empty");
    parse_bad("tcp:h:1", "tcp://");
    parse_bad("tcp://h", "the port is missing");
    parse_bad("tcp://h:0", "outside 1..65535");
    parse_bad("tcp://h:1/x", "a tcp URL has no path");
    parse_bad_as("tcp://u:pw@h:1", "tcp://u:***@h:1", "no user name or password");

    fsdp__store_url_t u;
    char err[FSDP_ERR_LEN];
    tap_is_int(fsdp__store_url_parse(NULL, &u, err), FSDP_EINVAL, "a NULL URL is refused");
}

static void redacts(const char *url, const char *want) {
    char out[256];
    fsdp__store_url_redact(url, out, sizeof out);
    tap_is_str(out, want, "redact('%s')", want);
}

/* Issue 26: no message shows a password. */
static void test_redaction(void) {
    redacts("redis://:s3cret@h:1/2", "redis://:***@h:1/2");
    redacts("redis://alice:s3cret@h", "redis://alice:***@h");
    redacts("redis://s3cret@h", "redis://***@h");
    redacts("redis://:a:b@c/d@h:1", "redis://:***@h:1");
    redacts("redis://:pw@h?prefix=a@b", "redis://:***@b");
    redacts("redis://h:1/2?prefix=x", "redis://h:1/2?prefix=x");
    redacts("file:///tmp/x", "file:///tmp/x");
    redacts("memory:", "memory:");

    /* A password in a URL that fails to parse: the message hides it. */
    const char *bad[] = {"redis://:hunter2@h:99999", "redis://:hunter2@h/notadb",
                         "redis://u:hunter2@h?x=1", "redis://:hunter2@", "redis://:hunter2@h#f"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fsdp__store_url_t u;
        char err[FSDP_ERR_LEN] = "";
        int rc = fsdp__store_url_parse(bad[i], &u, err);
        tap_ok(rc == FSDP_EINVAL && !strstr(err, "hunter2") && strstr(err, "***"),
               "the refusal of URL #%zu hides its password: %s", i, err);
    }
    fsdp_ctx_t *ctx = store_suite_ctx();
    fsdp_store_t *s = NULL;
    tap_is_int(fsdp_store_open_url(ctx, "redis://:hunter2@h:0", &s), FSDP_EINVAL,
               "open_url of a bad URL with a password");
    tap_ok(!strstr(fsdp_ctx_last_error(ctx), "hunter2") &&
               strstr(fsdp_ctx_last_error(ctx), "redis://:***@h:0"),
           "the context's message shows the URL without the password: %s",
           fsdp_ctx_last_error(ctx));
}

int main(void) {
    tap_plan_lazy();
    test_parse();
    test_redaction();
    return tap_done();
}
