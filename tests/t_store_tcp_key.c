/* SPDX-License-Identifier: MIT */
/*
 * t_store_tcp_key.c: the TCP store with the job's key (FSDP_STORE_KEY_FILE; issue 26, "peers
 * authenticate": the store holds the key the Gloo connections prove, so on several nodes it must
 * not serve strangers).
 *
 * Checks: key files that are refused (readable by others, a link, a FIFO, too short) with the
 * path and the fault, without blocking; a keyed server serves a client holding the key; a client
 * without a key, a client with another key and a raw stranger with a made-up proof are turned
 * away (counted by the server) and the server still serves; a client with a key refuses a
 * server that does not ask for it.
 */
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fsdp.h>

#include "store/store_tcp_proto.h"
#include "tap.h"

static char dir[64];

/* Writes a key file of n bytes with `mode`; returns its path (static buffer per name). */
static const char *key_file(const char *name, size_t n, unsigned char fill, mode_t mode) {
    static char paths[8][128];
    static int next;
    char *p = paths[next++ % 8];
    snprintf(p, 128, "%s/%s", dir, name);
    unlink(p);
    int fd = open(p, O_WRONLY | O_CREAT | O_EXCL, 0600);
    unsigned char buf[64];
    memset(buf, fill, sizeof buf);
    if (fd >= 0) {
        if (write(fd, buf, n) != (ssize_t)n) tap_diag("short write to %s", p);
        fchmod(fd, mode);
        close(fd);
    }
    return p;
}

/* fsdp_store_create_tcp with FSDP_STORE_KEY_FILE = path: its status, the context's message in
 * msg. */
static int create_with(const char *path, int port, fsdp_store_t **out, char *msg, size_t cap) {
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    o.log_level = FSDP_LOG_OFF;
    fsdp_ctx_t *ctx = NULL;
    fsdp_ctx_create(&o, &ctx);
    if (path)
        setenv("FSDP_STORE_KEY_FILE", path, 1);
    else
        unsetenv("FSDP_STORE_KEY_FILE");
    *out = NULL;
    int rc = fsdp_store_create_tcp(ctx, "127.0.0.1", port, NULL, out);
    snprintf(msg, cap, "%s", fsdp_ctx_last_error(ctx));
    fsdp_ctx_destroy(ctx);
    if (*out) fsdp_store_set_timeout(*out, 1500);
    return rc;
}

/* A set and a get through a handle made with the key at path (NULL: none): 1 when both work;
 * else 0 with the store's message in msg. */
static int round_trip(const char *path, int port, char *msg, size_t cap) {
    fsdp_store_t *s = NULL;
    msg[0] = '\0';
    if (create_with(path, port, &s, msg, cap) != FSDP_OK) return 0;
    char buf[8];
    size_t len = 0;
    int ok = fsdp_store_set(s, "k", "v1", 2) == FSDP_OK &&
             fsdp_store_get(s, "k", buf, sizeof buf, &len) == FSDP_OK && len == 2;
    if (!ok) snprintf(msg, cap, "%s", fsdp_store_last_error(s));
    fsdp_store_destroy(s);
    return ok;
}

static void refused_files(void) {
    char msg[512];
    fsdp_store_t *s = NULL;
    const char *open_file = key_file("k644", 32, 7, 0644);
    tap_ok_why(create_with(open_file, 1, &s, msg, sizeof msg) == FSDP_EINVAL &&
                   strstr(msg, open_file) && strstr(msg, "mode 0644"),
               msg, "a key file others may read is refused, naming it and its mode");
    char link[128];
    snprintf(link, sizeof link, "%s/link", dir);
    symlink(key_file("real", 32, 7, 0600), link);
    tap_ok_why(create_with(link, 1, &s, msg, sizeof msg) == FSDP_EINVAL &&
                   strstr(msg, "symbolic link"),
               msg, "a key file that is a symbolic link is refused");
    char fifo[128];
    snprintf(fifo, sizeof fifo, "%s/fifo", dir);
    mkfifo(fifo, 0600);
    tap_ok_why(create_with(fifo, 1, &s, msg, sizeof msg) == FSDP_EINVAL &&
                   strstr(msg, "not a regular file"),
               msg, "a FIFO as the key file is refused at once, without blocking");
    tap_ok_why(create_with(key_file("short", 5, 7, 0600), 1, &s, msg, sizeof msg) == FSDP_EINVAL &&
                   strstr(msg, "has 5 bytes"),
               msg, "a key of 5 bytes is refused (16 to 1024)");
    fsdp_store_server_t *srv = NULL;
    setenv("FSDP_STORE_KEY_FILE", open_file, 1);
    tap_ok(fsdp_store_server_start(NULL, "127.0.0.1", 0, &srv) == FSDP_EINVAL && !srv,
           "a server is not started with a refused key file");
    unsetenv("FSDP_STORE_KEY_FILE");
}

int main(void) {
    tap_plan_lazy();
    snprintf(dir, sizeof dir, "/tmp/t_store_tcp_key.XXXXXX");
    if (!mkdtemp(dir)) {
        printf("Bail out! mkdtemp failed\n");
        return 1;
    }
    refused_files();

    const char *key_a = key_file("a", 32, 0xa5, 0600), *key_b = key_file("b", 32, 0x5a, 0600);
    char err[256], msg[512];
    fsdp__tcp_key_t ka;
    int rc = fsdp__tcp_key_load(key_a, &ka, err, sizeof err);
    fsdp__tcp_server_t *srv = NULL;
    if (rc == FSDP_OK) rc = fsdp__tcp_server_start("127.0.0.1", 0, &ka, &srv, err, sizeof err);
    if (!tap_ok_why(rc == FSDP_OK, err, "a server with the key starts")) return tap_done();
    int port = fsdp__tcp_server_port(srv);

    tap_ok_why(round_trip(key_a, port, msg, sizeof msg), msg,
               "a client holding the key sets and gets");
    tap_ok_why(!round_trip(NULL, port, msg, sizeof msg) && strstr(msg, "requires the job's key"),
               msg, "a client without a key is told the server requires one");
    unsigned long before = fsdp__tcp_server_rejected(srv);
    tap_ok_why(!round_trip(key_b, port, msg, sizeof msg) && strstr(msg, "turned the key away"), msg,
               "a client with another key is turned away");
    tap_ok(fsdp__tcp_server_rejected(srv) > before, "the server counted it (%lu rejected)",
           fsdp__tcp_server_rejected(srv) - before);

    /* A stranger who speaks the protocol but has no key: a made-up proof, then a request. */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    unsigned char greet[TCP_GREET_AUTH], hello[TCP_HELLO_AUTH + 32], reply[64];
    int got_greet = connect(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
                    recv(fd, greet, sizeof greet, MSG_WAITALL) == (ssize_t)sizeof greet &&
                    memcmp(greet, TCP_AUTH_MAGIC, TCP_MAGIC_LEN) == 0;
    tap_ok(got_greet, "a keyed server greets with FSDPTCPA and a nonce");
    memset(hello, 0x11, sizeof hello);
    memcpy(hello, TCP_AUTH_MAGIC, TCP_MAGIC_LEN);
    memcpy(hello + TCP_HELLO_AUTH, "G\0\010auth.key", 11); /* a get after the hello */
    before = fsdp__tcp_server_rejected(srv);
    ssize_t sent = send(fd, hello, TCP_HELLO_AUTH + 11, MSG_NOSIGNAL);
    struct pollfd p = {.fd = fd, .events = POLLIN};
    ssize_t r = poll(&p, 1, 2000) == 1 ? recv(fd, reply, sizeof reply, 0) : -2;
    tap_ok(sent > 0 && (r == 0 || r == -1),
           "a stranger's made-up proof gets the connection closed, with no reply (recv %zd)", r);
    tap_ok(fsdp__tcp_server_rejected(srv) == before + 1, "the server counted the stranger");
    close(fd);
    tap_ok_why(round_trip(key_a, port, msg, sizeof msg), msg,
               "after all of them, a client holding the key is still served");
    fsdp__tcp_server_stop(srv);

    /* A client with a key does not hand its data to a server that does not ask for it. */
    srv = NULL;
    rc = fsdp__tcp_server_start("127.0.0.1", 0, NULL, &srv, err, sizeof err);
    port = fsdp__tcp_server_port(srv);
    tap_ok_why(rc == FSDP_OK && !round_trip(key_a, port, msg, sizeof msg) &&
                   strstr(msg, "does not ask for the job's key"),
               msg, "a client with a key refuses a server that does not ask for it");
    tap_ok_why(round_trip(NULL, port, msg, sizeof msg), msg,
               "without a key, the same server serves as before");
    fsdp__tcp_server_stop(srv);

    char cmd[160];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) tap_diag("could not remove %s", dir);
    return tap_done();
}
