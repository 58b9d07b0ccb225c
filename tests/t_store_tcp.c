/* SPDX-License-Identifier: MIT */
/*
 * t_store_tcp.c: the TCP store (issue 25, item 1) against a fsdp_store_server this test runs on a
 * free loopback port: the common suite (values, timeouts, keys, clones, rank threads, whole
 * values, two processes, forked adders), many keys, and what only a server faces: a client
 * killed mid-request, malformed requests, a client that stalls, a peer that declares a huge
 * value and sends nothing, a port that serves something else, the server stopping under its
 * clients, and a port already in use.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fsdp.h>

#include "store_suite.h"
#include "tap.h"

typedef struct tcp_target {
    int port;
} tcp_target_t;

static int open_tcp(void *arg, const char *ns, fsdp_store_t **out) {
    const tcp_target_t *t = arg;
    return fsdp_store_create_tcp(NULL, "127.0.0.1", t->port, ns, out);
}

/* A raw connection to the server on port, or -1. */
static int raw_connect(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Reads what arrives within ms (until EOF); returns the byte count, *eof set at EOF. */
static size_t raw_read(int fd, unsigned char *buf, size_t cap, int ms, int *eof) {
    size_t got = 0;
    *eof = 0;
    double end = store_suite_now_ms() + ms;
    while (got < cap) {
        int left = (int)(end - store_suite_now_ms());
        if (left <= 0) break;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, left) <= 0) break;
        ssize_t n = recv(fd, buf + got, cap - got, 0);
        if (n <= 0) {
            *eof = 1;
            break;
        }
        got += (size_t)n;
    }
    return got;
}

/* A store handle with a short timeout on the server, or NULL. */
static fsdp_store_t *handle(int port, const char *prefix, int64_t timeout_ms) {
    fsdp_store_t *s = NULL;
    if (fsdp_store_create_tcp(NULL, "127.0.0.1", port, prefix, &s) != FSDP_OK) return NULL;
    fsdp_store_set_timeout(s, timeout_ms);
    return s;
}

/* The server still serves: a set and a get round trip on a fresh handle. */
static int still_serves(int port, const char *key) {
    fsdp_store_t *s = handle(port, "alive", 2000);
    char buf[8];
    size_t len = 0;
    int ok = s && fsdp_store_set(s, key, "ok", 2) == FSDP_OK &&
             fsdp_store_get(s, key, buf, sizeof buf, &len) == FSDP_OK && len == 2;
    if (!ok && s) tap_diag("%s", fsdp_store_last_error(s));
    fsdp_store_destroy(s);
    return ok;
}

static void test_many_keys(int port) {
    fsdp_store_t *s = handle(port, "many", 5000);
    if (!tap_ok(s != NULL, "tcp: a handle for many keys")) return;
    enum { N = 5000 };
    int ok = 1;
    char key[32], val[32], buf[32];
    double t0 = store_suite_now_ms();
    for (int i = 0; i < N && ok; i++) {
        snprintf(key, sizeof key, "k%d", i);
        int n = snprintf(val, sizeof val, "v%d", i * 3);
        ok = fsdp_store_set(s, key, val, (size_t)n) == FSDP_OK;
    }
    for (int i = 0; i < N && ok; i++) {
        size_t len = 0;
        snprintf(key, sizeof key, "k%d", i);
        int n = snprintf(val, sizeof val, "v%d", i * 3);
        ok = fsdp_store_get(s, key, buf, sizeof buf, &len) == FSDP_OK && len == (size_t)n &&
             memcmp(buf, val, len) == 0;
        if (!ok) tap_diag("key %s: %s", key, fsdp_store_last_error(s));
    }
    tap_ok(ok, "tcp: %d keys set and each read back (the server's table grows; %.0f ms)", N,
           store_suite_now_ms() - t0);
    fsdp_store_destroy(s);
}

/* A client killed in the middle of a set: nothing of it is applied, and the server serves on. */
static void test_killed_mid_request(int port) {
    int ready[2];
    if (pipe(ready) != 0) tap_bail("pipe");
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        int fd = raw_connect(port);
        unsigned char req[3 + 4 + 4 + 1000];
        memcpy(req, "FSDPTCP1", 8);
        if (fd < 0 || send(fd, req, 8, 0) != 8) _exit(1);
        /* set "half" with a 1 MiB value of which only 1000 bytes are ever sent */
        req[0] = 'S', req[1] = 0, req[2] = 4;
        memcpy(req + 3, "half", 4);
        req[7] = 0, req[8] = 0x10, req[9] = 0, req[10] = 0;
        memset(req + 11, 'x', 1000);
        if (send(fd, req, sizeof req, 0) != (ssize_t)sizeof req) _exit(1);
        if (write(ready[1], "r", 1) != 1) _exit(1);
        pause();
        _exit(0);
    }
    close(ready[1]);
    char c = 0;
    tap_ok(read(ready[0], &c, 1) == 1, "tcp: a client sent part of a 1 MiB set");
    close(ready[0]);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    fsdp_store_t *s = handle(port, NULL, 500);
    int found = -1;
    tap_is_int(s ? fsdp_store_check(s, "half", &found) : -1, FSDP_OK,
               "tcp: check after the client was killed mid-request");
    tap_is_int(found, 0, "tcp: its partial set was not applied");
    fsdp_store_destroy(s);
    tap_ok(still_serves(port, "after-kill"), "tcp: the server serves on after the kill");
}

/* Malformed requests are answered with the refusal status (4) and the connection is closed. */
static void bad_request(int port, const unsigned char *req, size_t n, int greet, const char *what) {
    int fd = raw_connect(port);
    if (fd < 0) {
        tap_ok(0, "tcp: connect for %s", what);
        return;
    }
    if (greet) send(fd, "FSDPTCP1", 8, MSG_NOSIGNAL);
    send(fd, req, n, MSG_NOSIGNAL);
    unsigned char buf[64];
    int eof = 0;
    size_t got = raw_read(fd, buf, sizeof buf, 2000, &eof);
    close(fd);
    if (greet)
        tap_ok(got == 9 && memcmp(buf, "FSDPTCP1", 8) == 0 && buf[8] == 4 && eof,
               "tcp: %s: refused (status 4) and disconnected (%zu bytes, eof %d)", what, got, eof);
    else
        tap_ok(got == 8 && eof, "tcp: %s: disconnected without an answer (%zu bytes, eof %d)", what,
               got, eof);
}

static void test_malformed(int port) {
    const unsigned char op[] = {'X', 0, 1, 'k'};
    bad_request(port, op, sizeof op, 1, "an unknown operation");
    const unsigned char nokey[] = {'G', 0, 0};
    bad_request(port, nokey, sizeof nokey, 1, "an empty key");
    const unsigned char longkey[] = {'G', 0xff, 0xff};
    bad_request(port, longkey, sizeof longkey, 1, "a 65535-byte key");
    const unsigned char huge[] = {'S', 0, 1, 'k', 0x7f, 0xff, 0xff, 0xff};
    bad_request(port, huge, sizeof huge, 1, "a value of 2 GiB declared");
    const unsigned char nul[] = {'G', 0, 3, 'a', 0, 'b'};
    bad_request(port, nul, sizeof nul, 1, "a key with a NUL");
    const unsigned char hello[] = "GET / HTTP/1.0\r\n\r\n";
    bad_request(port, hello, sizeof hello - 1, 0, "a client that is not ours (HTTP)");
    tap_ok(still_serves(port, "after-bad"), "tcp: the server serves on after malformed requests");
}

/* The VmSize of this process, in KiB (the server runs in it). */
static long vm_kib(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kib = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmSize: %ld", &kib) == 1) break;
    if (f) fclose(f);
    return kib;
}

/* Peers that declare 64 MiB values and stall: the server allocates by what arrived, and serves
 * others meanwhile. */
static void test_stalled_declarers(int port) {
    enum { PEERS = 16 };
    int fds[PEERS];
    long before = vm_kib();
    int opened = 0;
    for (int i = 0; i < PEERS; i++) {
        fds[i] = raw_connect(port);
        if (fds[i] < 0) break;
        opened++;
        const unsigned char req[] = {'F', 'S', 'D', 'P',  'T', 'C', 'P', '1', 'S',
                                     0,   1,   'k', 0x04, 0,   0,   0,   'x'};
        send(fds[i], req, sizeof req, MSG_NOSIGNAL);
    }
    tap_ok(still_serves(port, "while-stalled"),
           "tcp: others are served while %d peers stall mid-request", opened);
    long after = vm_kib();
    tap_ok(before > 0 && after - before < 64 * 1024,
           "tcp: %d peers declaring 64 MiB each grew the process by %ld KiB, not by GiBs", opened,
           after - before);
    for (int i = 0; i < opened; i++)
        close(fds[i]);
}

/* A port where something else listens (accepts and never greets): an error saying so, in time. */
static void test_not_a_server(void) {
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t n = sizeof a;
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, sizeof a) != 0 || listen(lfd, 4) != 0 ||
        getsockname(lfd, (struct sockaddr *)&a, &n) != 0)
        tap_bail("a listening socket");
    int port = ntohs(a.sin_port);
    fsdp_store_t *s = handle(port, NULL, 400);
    double t0 = store_suite_now_ms();
    int rc = s ? fsdp_store_set(s, "k", "v", 1) : -1;
    double ms = store_suite_now_ms() - t0;
    tap_is_int(rc, FSDP_ETIMEDOUT, "tcp: a port that never greets times out");
    tap_has_str(s ? fsdp_store_last_error(s) : "", "did not greet",
                "tcp: and the error says the server did not greet");
    tap_ok(ms < 5000, "tcp: within the hang guard (%.0f ms for 400 ms)", ms);
    fsdp_store_destroy(s);
    close(lfd);

    /* A closed port: ETIMEDOUT naming host:port. */
    s = handle(port, NULL, 300);
    char where[64];
    snprintf(where, sizeof where, "127.0.0.1:%d", port);
    char buf[4];
    size_t len = 0;
    tap_is_int(s ? fsdp_store_get(s, "k", buf, sizeof buf, &len) : -1, FSDP_ETIMEDOUT,
               "tcp: get on a closed port times out");
    tap_has_str(s ? fsdp_store_last_error(s) : "", where, "tcp: the error names %s", where);
    fsdp_store_destroy(s);
}

/* The server stops under a connected handle and a stalled raw client. */
static void test_server_stops(void) {
    fsdp_store_server_t *srv = NULL;
    if (!tap_is_int(fsdp_store_server_start(NULL, "127.0.0.1", 0, &srv), FSDP_OK,
                    "tcp: a second server on another free port"))
        return;
    int port = fsdp_store_server_port(srv);
    fsdp_store_t *s = handle(port, NULL, 400);
    tap_is_int(s ? fsdp_store_set(s, "k", "v", 1) : -1, FSDP_OK, "tcp: connected to it");
    int raw = raw_connect(port);
    send(raw, "FSDPTCP1S\0", 10, MSG_NOSIGNAL); /* half a header, then nothing */
    fsdp_store_server_t *dup = NULL;
    fsdp_ctx_t *ctx = store_suite_ctx();
    tap_is_int(fsdp_store_server_start(ctx, "127.0.0.1", port, &dup), FSDP_EBACKEND,
               "tcp: a server on a port in use is refused");
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    tap_has_str(fsdp_ctx_last_error(ctx), ps, "tcp: and the error names the port");
    tap_is_int(fsdp_store_server_start(ctx, NULL, 70000, &dup), FSDP_EINVAL,
               "tcp: port 70000 is refused");
    double t0 = store_suite_now_ms();
    fsdp_store_server_stop(srv);
    double ms = store_suite_now_ms() - t0;
    tap_ok(ms < 1000, "tcp: stop returns at once with clients connected (%.1f ms)", ms);
    t0 = store_suite_now_ms();
    int rc = s ? fsdp_store_set(s, "k", "w", 1) : -1;
    ms = store_suite_now_ms() - t0;
    tap_ok(rc == FSDP_EBACKEND || rc == FSDP_ETIMEDOUT,
           "tcp: the next operation fails (%s) in %.0f ms", fsdp_err_name(rc), ms);
    char where[64];
    snprintf(where, sizeof where, "127.0.0.1:%d", port);
    tap_has_str(s ? fsdp_store_last_error(s) : "", where, "tcp: naming %s", where);
    fsdp_store_destroy(s);
    if (raw >= 0) close(raw);
    fsdp_store_server_stop(NULL);
}

static void test_limits(int port) {
    fsdp_store_t *s = handle(port, NULL, 2000);
    size_t big = (64u << 20) + 1;
    char *v = calloc(1, big);
    tap_is_int(s && v ? fsdp_store_set(s, "huge", v, big) : -1, FSDP_EINVAL,
               "tcp: a value over 64 MiB is refused");
    tap_has_str(s ? fsdp_store_last_error(s) : "", "huge", "tcp: naming the key");
    free(v);
    fsdp_ctx_t *ctx = store_suite_ctx();
    fsdp_store_t *t = NULL;
    tap_is_int(fsdp_store_create_tcp(ctx, "", 1, NULL, &t), FSDP_EINVAL, "tcp: an empty host");
    tap_is_int(fsdp_store_create_tcp(ctx, "h", 0, NULL, &t), FSDP_EINVAL, "tcp: port 0");
    tap_has_str(fsdp_ctx_last_error(ctx), "port 0", "tcp: the error shows the port");
    fsdp_store_destroy(s);
}

int main(void) {
    tap_plan_lazy();
    signal(SIGPIPE, SIG_IGN); /* the raw clients of this test write to closed sockets */
    fsdp_store_server_t *srv = NULL;
    if (!tap_is_int(fsdp_store_server_start(NULL, "127.0.0.1", 0, &srv), FSDP_OK,
                    "tcp: a server on a free loopback port"))
        return tap_done();
    tcp_target_t target = {fsdp_store_server_port(srv)};
    tap_ok(target.port > 0, "tcp: it reports its port (%d)", target.port);
    store_factory_t f = {"tcp", open_tcp, &target};
    store_suite_run(&f);
    store_suite_two_processes(&f);
    store_suite_cross_process(&f, 4, 500);
    test_many_keys(target.port);
    test_killed_mid_request(target.port);
    test_malformed(target.port);
    test_stalled_declarers(target.port);
    test_limits(target.port);
    test_not_a_server();
    test_server_stops();
    fsdp_store_server_stop(srv);
    return tap_done();
}
