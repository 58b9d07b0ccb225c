/* SPDX-License-Identifier: MIT */
/*
 * t_store_redis.c: the Redis store against a redis-server this test starts on a free port (the
 * common suite, processes, prefixes), and against no server at all (unreachable, server gone).
 *
 * Skips itself when libfsdp was built without hiredis or redis-server is not installed. The
 * server is stopped (SIGTERM, then waitpid) on every way out: at the end, from an atexit handler
 * if the test exits early, and by the kernel (PR_SET_PDEATHSIG) if the test dies.
 */
#include <config.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <fsdp.h>

#include "tap.h"

#if !FSDP_HAVE_HIREDIS

int main(void) {
    return tap_skip_all("libfsdp was built without hiredis");
}

#else

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>

#include "store_suite.h"

static pid_t server_pid = -1; /* the redis-server child, -1 when none runs */
static pid_t owner_pid;       /* the test process (forked children must not stop the server) */
static char server_log[256];

typedef struct redis_target {
    const char *host;
    int port;
} redis_target_t;

static int open_redis(void *arg, const char *ns, fsdp_store_t **out) {
    const redis_target_t *t = arg;
    return fsdp_store_create_redis(NULL, t->host, t->port, ns, out);
}

/* A port nothing listens on now: bind port 0 on loopback, read the port, close. */
static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t n = sizeof a;
    int port = -1;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &n) == 0)
        port = ntohs(a.sin_port);
    close(fd);
    return port;
}

static int can_connect(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return 0;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int ok = connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
    close(fd);
    return ok;
}

/* Path of prog on PATH, or NULL. */
static const char *find_program(const char *prog, char *buf, size_t cap) {
    const char *path = getenv("PATH");
    if (!path || !*path) path = "/usr/local/bin:/usr/bin:/bin";
    while (*path) {
        const char *end = strchr(path, ':');
        size_t n = end ? (size_t)(end - path) : strlen(path);
        snprintf(buf, cap, "%.*s/%s", (int)n, n ? path : ".", prog);
        if (access(buf, X_OK) == 0) return buf;
        path += n + (end ? 1 : 0);
    }
    return NULL;
}

static void stop_server(void) {
    if (server_pid <= 0 || getpid() != owner_pid) return;
    kill(server_pid, SIGTERM);
    int status;
    while (waitpid(server_pid, &status, 0) < 0 && errno == EINTR) {
    }
    server_pid = -1;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Starts redis-server on `port` and waits until it accepts connections (10 s at most).
 * Returns 0, or -1 with why filled in. */
static int start_server(const char *exe, int port, const char *pass, char *why, size_t cap) {
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) {
        snprintf(why, cap, "fork: %s", strerror(errno));
        return -1;
    }
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        int fd = open(server_log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        if (pass)
            execl(exe, exe, "--port", portstr, "--save", "", "--appendonly", "no", "--bind",
                  "127.0.0.1", "--daemonize", "no", "--requirepass", pass, (char *)NULL);
        else
            execl(exe, exe, "--port", portstr, "--save", "", "--appendonly", "no", "--bind",
                  "127.0.0.1", "--daemonize", "no", (char *)NULL);
        _exit(127);
    }
    server_pid = pid;
    for (int waited = 0; waited < 10000; waited += 20) {
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) {
            server_pid = -1;
            snprintf(why, cap, "redis-server exited with status 0x%x (log: %s)", status,
                     server_log);
            return -1;
        }
        if (can_connect(port)) {
            /* Someone else may have taken the port: then our server exits at once on bind. */
            sleep_ms(50);
            if (waitpid(pid, &status, WNOHANG) == 0) return 0;
            server_pid = -1;
            snprintf(why, cap, "port %d was taken; redis-server exited with status 0x%x", port,
                     status);
            return -1;
        }
        sleep_ms(20);
    }
    stop_server();
    snprintf(why, cap, "redis-server did not accept connections on port %d within 10 s", port);
    return -1;
}

/* An unreachable server (a closed port): an error naming host:port, not a hang. */
static void test_unreachable(void) {
    int port = free_port();
    fsdp_store_t *s = NULL;
    tap_is_int(fsdp_store_create_redis(NULL, "127.0.0.1", port, "x", &s), FSDP_OK,
               "create_redis does not connect (port %d is closed)", port);
    if (!s) return;
    fsdp_store_set_timeout(s, 300);
    char where[64];
    snprintf(where, sizeof where, "127.0.0.1:%d", port);
    double t0 = store_suite_now_ms();
    int rc = fsdp_store_set(s, "k", "v", 1);
    double ms = store_suite_now_ms() - t0;
    tap_is_int(rc, FSDP_ETIMEDOUT, "set on an unreachable server times out");
    tap_has_str(fsdp_store_last_error(s), where, "the error names host:port");
    tap_ok(ms < 5000, "it returns (%.0f ms for a 300 ms timeout; 5 s is the hang guard)", ms);
    char buf[4];
    size_t len;
    t0 = store_suite_now_ms();
    rc = fsdp_store_get(s, "k", buf, sizeof buf, &len);
    ms = store_suite_now_ms() - t0;
    tap_is_int(rc, FSDP_ETIMEDOUT, "get on an unreachable server times out");
    tap_has_str(fsdp_store_last_error(s), where, "the get error names host:port");
    tap_ok(ms < 5000, "get returns too (%.0f ms)", ms);
    fsdp_store_destroy(s);

    fsdp_ctx_t *ctx = store_suite_ctx();
    tap_is_int(fsdp_store_create_redis(ctx, "", 6379, NULL, &s), FSDP_EINVAL,
               "an empty host is EINVAL");
    tap_is_int(fsdp_store_create_redis(ctx, "h", 70000, NULL, &s), FSDP_EINVAL,
               "a port above 65535 is EINVAL");
    tap_has_str(fsdp_ctx_last_error(ctx), "70000", "and the error on the context shows it");
}

/* Handles with different prefixes share the server but no keys; equal prefixes share keys. */
static void test_prefixes(const redis_target_t *t) {
    fsdp_store_t *a = NULL, *b = NULL, *a2 = NULL, *bare = NULL;
    char pa[64], pb[64];
    store_suite_ns("pa", pa, sizeof pa);
    store_suite_ns("pb", pb, sizeof pb);
    fsdp_store_create_redis(NULL, t->host, t->port, pa, &a);
    fsdp_store_create_redis(NULL, t->host, t->port, pb, &b);
    fsdp_store_create_redis(NULL, t->host, t->port, pa, &a2);
    fsdp_store_create_redis(NULL, t->host, t->port, NULL, &bare);
    if (!tap_ok(a && b && a2 && bare, "four handles on one server")) goto out;
    fsdp_store_set_timeout(a2, 2000);
    fsdp_store_set_timeout(bare, 2000);
    fsdp_store_set(a, "id", "A", 1);
    fsdp_store_set(b, "id", "B", 1);
    char buf[8] = "", key[96];
    size_t len = 0;
    fsdp_store_get(a2, "id", buf, sizeof buf, &len);
    tap_ok(len == 1 && buf[0] == 'A', "a second handle with the same prefix sees the key");
    snprintf(key, sizeof key, "%s/id", pb);
    fsdp_store_get(bare, key, buf, sizeof buf, &len);
    tap_ok(len == 1 && buf[0] == 'B', "without a prefix, the key is <prefix>/<key>");
out:
    fsdp_store_destroy(a);
    fsdp_store_destroy(b);
    fsdp_store_destroy(a2);
    fsdp_store_destroy(bare);
}

/* The server goes away under a connected handle: an error, not a hang or a SIGPIPE. */
static void test_server_gone(const redis_target_t *t) {
    fsdp_store_t *s = NULL;
    fsdp_store_create_redis(NULL, t->host, t->port, "gone", &s);
    if (!tap_ok(s != NULL, "a handle before the server stops")) return;
    fsdp_store_set_timeout(s, 300);
    tap_is_int(fsdp_store_set(s, "k", "v", 1), FSDP_OK, "it is connected");
    stop_server();
    char where[64];
    snprintf(where, sizeof where, "%s:%d", t->host, t->port);
    /* A value larger than the socket buffer makes hiredis write twice: the second write meets
     * the reset connection, which raises SIGPIPE unless the store blocks it. */
    size_t big_len = 4 << 20;
    char *big = calloc(1, big_len);
    int bad = 1;
    double t0 = store_suite_now_ms();
    for (int i = 0; i < 3 && big; i++) { /* the first write after a close may still succeed */
        int rc = fsdp_store_set(s, "k", big, big_len);
        if (rc == FSDP_OK) continue;
        bad = rc != FSDP_EBACKEND && rc != FSDP_ETIMEDOUT;
        tap_has_str(fsdp_store_last_error(s), where, "after the server stopped, the error names %s",
                    where);
        break;
    }
    double ms = store_suite_now_ms() - t0;
    free(big);
    tap_ok(!bad, "a stopped server is FSDP_EBACKEND or FSDP_ETIMEDOUT, and no SIGPIPE killed us");
    tap_ok(ms < 5000, "within the hang guard (%.0f ms)", ms);
    fsdp_store_destroy(s);
}

/* Opens url (which must parse) with a short timeout; NULL on failure. */
static fsdp_store_t *open_url_t(const char *url) {
    fsdp_store_t *s = NULL;
    if (fsdp_store_open_url(NULL, url, &s) != FSDP_OK) return NULL;
    fsdp_store_set_timeout(s, 2000);
    return s;
}

/* Issue 25 item 4: the URL's path selects the database, ?prefix= is the key prefix. */
static void test_db_numbers(int port) {
    char u3[128], u4[128], u0[128], bare3[128];
    snprintf(u3, sizeof u3, "redis://127.0.0.1:%d/3?prefix=dbt", port);
    snprintf(u4, sizeof u4, "redis://127.0.0.1:%d/4?prefix=dbt", port);
    snprintf(u0, sizeof u0, "redis://127.0.0.1:%d?prefix=dbt", port);
    snprintf(bare3, sizeof bare3, "redis://127.0.0.1:%d/3", port);
    fsdp_store_t *a = open_url_t(u3), *b = open_url_t(u4), *z = open_url_t(u0),
                 *c = open_url_t(bare3);
    if (!tap_ok(a && b && z && c, "redis: handles on databases 3, 4 and 0")) goto out;
    tap_is_int(fsdp_store_set(a, "k", "three", 5), FSDP_OK, "redis: set in database 3");
    int found = -1;
    fsdp_store_check(b, "k", &found);
    tap_is_int(found, 0, "redis: database 4 does not see it");
    found = -1;
    fsdp_store_check(z, "k", &found);
    tap_is_int(found, 0, "redis: database 0 does not see it");
    char buf[8];
    size_t len = 0;
    tap_ok(fsdp_store_get(c, "dbt/k", buf, sizeof buf, &len) == FSDP_OK && len == 5,
           "redis: database 3 without a prefix has it as dbt/k (the prefix is ?prefix=)");
    fsdp_store_t *bad = NULL;
    char u99[128];
    snprintf(u99, sizeof u99, "redis://127.0.0.1:%d/99", port);
    bad = open_url_t(u99);
    tap_is_int(bad ? fsdp_store_set(bad, "k", "v", 1) : -1, FSDP_EBACKEND,
               "redis: a database the server lacks fails the first operation");
    tap_has_str(bad ? fsdp_store_last_error(bad) : "", "SELECT 99", "redis: naming SELECT 99");
    fsdp_store_destroy(bad);
out:
    fsdp_store_destroy(a);
    fsdp_store_destroy(b);
    fsdp_store_destroy(z);
    fsdp_store_destroy(c);
}

#define PASS "pw-Hunter2-xyzzy"

/* Issue 25 item 4 and issue 26: AUTH from the URL, and no message shows the password. */
static void test_auth(int port) {
    char url[160];
    snprintf(url, sizeof url, "redis://:" PASS "@127.0.0.1:%d/2?prefix=auth", port);
    fsdp_store_t *s = open_url_t(url);
    char buf[8];
    size_t len = 0;
    tap_ok(s && fsdp_store_set(s, "k", "v", 1) == FSDP_OK &&
               fsdp_store_get(s, "k", buf, sizeof buf, &len) == FSDP_OK && len == 1,
           "redis: redis://:password@host works against a requirepass server");
    fsdp_store_destroy(s);
    snprintf(url, sizeof url, "redis://default:" PASS "@127.0.0.1:%d/2?prefix=auth", port);
    s = open_url_t(url);
    len = 0;
    tap_ok(s && fsdp_store_get(s, "k", buf, sizeof buf, &len) == FSDP_OK && len == 1,
           "redis: redis://user:password@host (AUTH default) sees the same key");
    fsdp_store_destroy(s);

    snprintf(url, sizeof url, "redis://:wrong-" PASS "@127.0.0.1:%d", port);
    s = open_url_t(url);
    double t0 = store_suite_now_ms();
    int rc = s ? fsdp_store_set(s, "k", "v", 1) : -1;
    double ms = store_suite_now_ms() - t0;
    tap_is_int(rc, FSDP_EBACKEND, "redis: a wrong password fails the first operation");
    const char *e = s ? fsdp_store_last_error(s) : "";
    tap_ok(strstr(e, "AUTH") && !strstr(e, PASS),
           "redis: the error says AUTH, not the password: %s", e);
    tap_ok(ms < 1500, "redis: at once, not after retrying until the timeout (%.0f ms)", ms);
    fsdp_store_destroy(s);

    snprintf(url, sizeof url, "redis://alice:" PASS "@127.0.0.1:%d", port);
    s = open_url_t(url);
    rc = s ? fsdp_store_set(s, "k", "v", 1) : -1;
    e = s ? fsdp_store_last_error(s) : "";
    tap_ok(rc == FSDP_EBACKEND && strstr(e, "alice") && !strstr(e, PASS),
           "redis: an unknown user is refused, naming the user, not the password: %s", e);
    fsdp_store_destroy(s);

    snprintf(url, sizeof url, "redis://127.0.0.1:%d", port);
    s = open_url_t(url);
    rc = s ? fsdp_store_set(s, "k", "v", 1) : -1;
    tap_ok(rc == FSDP_EBACKEND && strstr(s ? fsdp_store_last_error(s) : "", "NOAUTH"),
           "redis: no password on a requirepass server: the server's NOAUTH is reported");
    fsdp_store_destroy(s);

    /* What the launcher and fsdp_init_from_env print: a bad URL's refusal hides the password. */
    fsdp_ctx_t *ctx = store_suite_ctx();
    snprintf(url, sizeof url, "redis://:" PASS "@127.0.0.1:%d/x", port);
    tap_is_int(fsdp_store_open_url(ctx, url, &s), FSDP_EINVAL, "redis: a bad database path");
    tap_ok(!strstr(fsdp_ctx_last_error(ctx), PASS), "redis: its message hides the password");
}

int main(void) {
    char exe_buf[1024];
    const char *exe = find_program("redis-server", exe_buf, sizeof exe_buf);
    if (!exe) return tap_skip_all("redis-server is not installed");
    tap_plan_lazy();
    owner_pid = getpid();
    atexit(stop_server);
    const char *tmp = getenv("TMPDIR");
    snprintf(server_log, sizeof server_log, "%s/t_store_redis.%d.log", tmp && *tmp ? tmp : "/tmp",
             (int)getpid());

    test_unreachable();

    char why[512] = "";
    int port = -1;
    for (int attempt = 0; attempt < 3 && server_pid < 0; attempt++) {
        port = free_port(); /* another process may take it before the server binds: retry */
        if (port > 0 && start_server(exe, port, NULL, why, sizeof why) == 0) break;
    }
    if (!tap_ok(server_pid > 0, "redis-server started on 127.0.0.1:%d", port)) {
        tap_diag("%s", why);
        return tap_done();
    }
    redis_target_t target = {"127.0.0.1", port};
    store_factory_t f = {"redis", open_redis, &target};
    store_suite_run(&f);
    store_suite_two_processes(&f);
    store_suite_cross_process(&f, 4, 1000);
    test_prefixes(&target);
    test_db_numbers(port);
    test_server_gone(&target);
    stop_server();
    for (int attempt = 0; attempt < 3 && server_pid < 0; attempt++) {
        port = free_port();
        if (port > 0 && start_server(exe, port, PASS, why, sizeof why) == 0) break;
    }
    if (tap_ok(server_pid > 0, "redis-server with requirepass started on 127.0.0.1:%d", port))
        test_auth(port);
    else
        tap_diag("%s", why);
    stop_server();
    unlink(server_log);
    return tap_done();
}

#endif /* FSDP_HAVE_HIREDIS */
