/* SPDX-License-Identifier: MIT */
/*
 * gloo_mesh.c: the authenticated connections of a Gloo group (see gloo_mesh.h).
 *
 * One thread, one poll() loop over the listener, the connections this rank makes (to lower
 * ranks) and the ones it accepts (from higher ranks, and from anyone else who finds the port).
 * The handshake on a connection from rank c to rank a, with K the job's key:
 *
 *   c -> a  hello      "FSDPMSH1", version 1, 3 zero bytes, c, a, size (big-endian u32), Nc (32)
 *   a -> c  challenge  Na (32), HMAC-SHA256(K, "A" | hello | Na)
 *   c -> a  proof      HMAC-SHA256(K, "C" | hello | Na)
 *   a -> c  accept     one byte, 1
 *
 * Both nonces are fresh random bytes, so a proof cannot be replayed; the labels keep the
 * acceptor's answer (which anyone who connects can ask for) from serving as a connector's
 * proof. c checks a's answer too, so a socket is used only when both ends hold K. Everything
 * a stranger can send is read into fixed buffers and checked before any state changes, and an
 * accepted connection that has not finished its handshake within HANDSHAKE_MS is dropped.
 */
#define _GNU_SOURCE

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <fsdp/errno.h>
#include <fsdp/log.h>

#include "backends/gloo/gloo_mesh.h"
#include "core/hmac.h"
#include "core/timeutil.h"

#define NONCE 32
#define MAC 32
#define HELLO_LEN 56 /* magic 8, version 1, zeros 3, three u32, nonce */
#define CHALLENGE_LEN (NONCE + MAC)
#define BACKLOG 128
#define HANDSHAKE_MS 10000 /* an accepted connection's time to prove itself */
#define MAX_PENDING 256    /* accepted connections still proving themselves */
#define LOGGED_DROPS 8     /* warnings printed before only counting */
#define RETRY_MIN_MS 20
#define RETRY_MAX_MS 500
#define ADDR_MIN_MS 2 /* looking for a peer's address in the store */
#define ADDR_MAX_MS 100

static const char kMagic[8] = {'F', 'S', 'D', 'P', 'M', 'S', 'H', '1'};

enum state {
    OUT_ADDR,      /* the peer's address is not in the store yet; look again at `at` */
    OUT_WAIT,      /* not connected; the next try is at `at` */
    OUT_CONNECT,   /* connect() in progress */
    OUT_CHALLENGE, /* hello sent; reading the challenge */
    OUT_ACCEPT,    /* proof sent; reading the accept byte */
    IN_HELLO,      /* accepted; reading the hello */
    IN_PROOF,      /* challenge sent; reading the proof */
};

typedef struct conn {
    int fd;
    enum state st;
    int peer;    /* the rank at the other end (-1: not yet known, for accepted connections) */
    int64_t at;  /* OUT_ADDR, OUT_WAIT: next try; IN_*: the handshake's deadline (ns) */
    int backoff; /* ms before the next try after a failure (outgoing) */
    uint8_t hello[HELLO_LEN];
    uint8_t nonce_a[NONCE];
    uint8_t buf[CHALLENGE_LEN];
    size_t got, want;
    char from[INET6_ADDRSTRLEN + 8]; /* the other end's address, for the log */
} conn_t;

typedef struct mesh {
    const fsdp_ctx_t *ctx;
    int rank, size;
    const uint8_t *key;
    struct sockaddr_storage *peer_addr; /* [size]: the listeners of lower ranks */
    socklen_t *peer_len;
    conn_t *out; /* [size]: the connection to each lower rank */
    conn_t *in;  /* accepted connections still proving themselves */
    int nin;
    int *fds; /* the result */
    int left; /* peers not yet connected */
    int dropped;
    char last_fail[160]; /* the last reason an outgoing attempt failed, for the timeout message */
} mesh_t;

static void put_u32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24), p[1] = (uint8_t)(v >> 16), p[2] = (uint8_t)(v >> 8),
    p[3] = (uint8_t)v;
}

static uint32_t get_u32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* HMAC-SHA256(key, label | hello | nonce_a). */
static int mac(const uint8_t *key, char label, const uint8_t *hello, const uint8_t *nonce_a,
               uint8_t out[MAC]) {
    uint8_t data[1 + HELLO_LEN + NONCE];
    data[0] = (uint8_t)label;
    memcpy(data + 1, hello, HELLO_LEN);
    memcpy(data + 1 + HELLO_LEN, nonce_a, NONCE);
    return fsdp__hmac_sha256(key, FSDP_GLOO_KEY_BYTES, data, sizeof data, out);
}

static void addr_str(const struct sockaddr_storage *ss, char *out, size_t cap) {
    char host[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
        inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
        port = ntohs(a->sin_port);
    } else if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
        inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
        port = ntohs(a->sin6_port);
    }
    snprintf(out, cap, ss->ss_family == AF_INET6 ? "[%s]:%d" : "%s:%d", host, port);
}

/* Sends all of p on a fresh socket (whose send buffer cannot be full). */
static int send_all(int fd, const void *p, size_t n) {
    ssize_t w;
    do
        w = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    while (w < 0 && errno == EINTR);
    return w == (ssize_t)n ? 0 : -1;
}

/* Reads what is there into c->buf, up to c->want bytes: 1 when complete, 0 when more is to
 * come, -1 on end of file or an error. */
static int read_some(conn_t *c) {
    while (c->got < c->want) {
        ssize_t r = recv(c->fd, c->buf + c->got, c->want - c->got, MSG_DONTWAIT);
        if (r > 0) {
            c->got += (size_t)r;
            continue;
        }
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
        return -1;
    }
    return 1;
}

static void expect(conn_t *c, enum state st, size_t want) {
    c->st = st;
    c->got = 0;
    c->want = want;
}

static void drop(mesh_t *m, int i, const char *why) {
    conn_t *c = &m->in[i];
    m->dropped++;
    if (m->dropped <= LOGGED_DROPS)
        fsdp_log(m->ctx, FSDP_LOG_WARN,
                 "gloo: rank %d of %d dropped a connection from %s that did not prove it belongs "
                 "to the job (%s)%s",
                 m->rank, m->size, c->from, why,
                 m->dropped == LOGGED_DROPS ? "; further ones are only counted" : "");
    close(c->fd);
    m->in[i] = m->in[--m->nin];
}

/* An outgoing attempt failed: close it and try again after the back-off. */
static void retry(mesh_t *m, conn_t *c, const char *why) {
    snprintf(m->last_fail, sizeof m->last_fail, "to rank %d: %s", c->peer, why);
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    c->st = OUT_WAIT;
    c->at = fsdp__now_ns() + (int64_t)c->backoff * 1000000;
    c->backoff = c->backoff * 2 > RETRY_MAX_MS ? RETRY_MAX_MS : c->backoff * 2;
}

static void connected(mesh_t *m, int peer, int fd) {
    if (m->fds[peer] >= 0)
        close(m->fds[peer]); /* a proven retry replaces an earlier connection of the same peer */
    else
        m->left--;
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    m->fds[peer] = fd;
}

static void start_out(mesh_t *m, conn_t *c) {
    c->fd = socket(m->peer_addr[c->peer].ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (c->fd < 0) {
        retry(m, c, strerror(errno));
        return;
    }
    int rc;
    do
        rc = connect(c->fd, (const struct sockaddr *)&m->peer_addr[c->peer], m->peer_len[c->peer]);
    while (rc < 0 && errno == EINTR);
    if (rc < 0 && errno != EINPROGRESS) {
        retry(m, c, strerror(errno));
        return;
    }
    c->st = OUT_CONNECT;
}

/* Advances an outgoing connection on a poll event. */
static void step_out(mesh_t *m, conn_t *c) {
    if (c->st == OUT_CONNECT) {
        int err = 0;
        socklen_t len = sizeof err;
        if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0) err = errno;
        if (err) {
            retry(m, c, strerror(err));
            return;
        }
        memcpy(c->hello, kMagic, sizeof kMagic);
        memset(c->hello + 8, 0, 4);
        c->hello[8] = 1;
        put_u32(c->hello + 12, (uint32_t)m->rank);
        put_u32(c->hello + 16, (uint32_t)c->peer);
        put_u32(c->hello + 20, (uint32_t)m->size);
        if (fsdp__random_bytes(c->hello + 24, NONCE) < 0 ||
            send_all(c->fd, c->hello, HELLO_LEN) < 0) {
            retry(m, c, "cannot send the hello");
            return;
        }
        expect(c, OUT_CHALLENGE, CHALLENGE_LEN);
        return;
    }
    int r = read_some(c);
    if (r < 0) {
        retry(m, c, "the peer closed the connection during the handshake");
        return;
    }
    if (r == 0) return;
    if (c->st == OUT_CHALLENGE) {
        uint8_t want[MAC], proof[MAC];
        memcpy(c->nonce_a, c->buf, NONCE);
        if (mac(m->key, 'A', c->hello, c->nonce_a, want) < 0 ||
            !fsdp__mac_equal(want, c->buf + NONCE, MAC)) {
            retry(m, c, "the listener's answer is not the job's (a different key)");
            return;
        }
        if (mac(m->key, 'C', c->hello, c->nonce_a, proof) < 0 || send_all(c->fd, proof, MAC) < 0) {
            retry(m, c, "cannot send the proof");
            return;
        }
        expect(c, OUT_ACCEPT, 1);
        return;
    }
    if (c->buf[0] != 1) {
        retry(m, c, "the peer refused the proof");
        return;
    }
    connected(m, c->peer, c->fd);
    c->fd = -1;
    c->st = OUT_WAIT;
    c->at = INT64_MAX; /* done */
}

/* Advances an accepted connection on a poll event; drops it when it fails. Returns 1 when the
 * connection at i left the list (dropped or done), else 0. */
static int step_in(mesh_t *m, int i) {
    conn_t *c = &m->in[i];
    int r = read_some(c);
    if (r < 0) {
        drop(m, i, c->got ? "it closed during the handshake" : "it closed without a hello");
        return 1;
    }
    if (r == 0) return 0;
    if (c->st == IN_HELLO) {
        const uint8_t *h = c->buf;
        int from = (int)get_u32(h + 12), to = (int)get_u32(h + 16), size = (int)get_u32(h + 20);
        if (memcmp(h, kMagic, sizeof kMagic) != 0 || h[8] != 1) {
            drop(m, i, "not a libfsdp hello");
            return 1;
        }
        if (to != m->rank || size != m->size || from <= m->rank || from >= m->size) {
            drop(m, i, "a hello for another rank or group");
            return 1;
        }
        memcpy(c->hello, h, HELLO_LEN);
        c->peer = from;
        uint8_t challenge[CHALLENGE_LEN];
        if (fsdp__random_bytes(c->nonce_a, NONCE) < 0 ||
            mac(m->key, 'A', c->hello, c->nonce_a, challenge + NONCE) < 0) {
            drop(m, i, "cannot make a challenge");
            return 1;
        }
        memcpy(challenge, c->nonce_a, NONCE);
        if (send_all(c->fd, challenge, CHALLENGE_LEN) < 0) {
            drop(m, i, "cannot send the challenge");
            return 1;
        }
        expect(c, IN_PROOF, MAC);
        return 0;
    }
    uint8_t want[MAC];
    if (mac(m->key, 'C', c->hello, c->nonce_a, want) < 0 || !fsdp__mac_equal(want, c->buf, MAC)) {
        drop(m, i, "a wrong proof");
        return 1;
    }
    const uint8_t ok = 1;
    if (send_all(c->fd, &ok, 1) < 0) {
        drop(m, i, "it closed before the accept");
        return 1;
    }
    connected(m, c->peer, c->fd);
    m->in[i] = m->in[--m->nin];
    return 1;
}

static void accept_all(mesh_t *m, int lfd) {
    for (;;) {
        struct sockaddr_storage ss;
        socklen_t len = sizeof ss;
        int fd = accept4(lfd, (struct sockaddr *)&ss, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            return; /* EAGAIN, or out of descriptors: the rest wait in the backlog */
        }
        conn_t *c = &m->in[m->nin++];
        memset(c, 0, sizeof *c);
        c->fd = fd;
        c->peer = -1;
        c->at = fsdp__now_ns() + (int64_t)HANDSHAKE_MS * 1000000;
        addr_str(&ss, c->from, sizeof c->from);
        expect(c, IN_HELLO, HELLO_LEN);
        if (m->nin == MAX_PENDING) {
            /* Full: the oldest one, most likely a stranger holding a slot, makes room. */
            drop(m, 0, "too many connections still proving themselves");
        }
    }
}

/* Listens on addr (port 0) and publishes where. */
static int listen_and_publish(mesh_t *m, fsdp_store_t *store, const struct sockaddr *addr,
                              socklen_t addrlen, int *lfd, char *msg, size_t cap) {
    struct sockaddr_storage ss;
    if (addrlen > sizeof ss || (addr->sa_family != AF_INET && addr->sa_family != AF_INET6)) {
        snprintf(msg, cap, "the group's address is not IPv4 or IPv6");
        return FSDP_EINVAL;
    }
    memcpy(&ss, addr, addrlen);
    if (ss.ss_family == AF_INET)
        ((struct sockaddr_in *)&ss)->sin_port = 0;
    else
        ((struct sockaddr_in6 *)&ss)->sin6_port = 0;
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    const int on = 1;
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on) < 0 ||
        bind(fd, (struct sockaddr *)&ss, addrlen) < 0 || listen(fd, BACKLOG) < 0) {
        char where[INET6_ADDRSTRLEN + 8];
        addr_str(&ss, where, sizeof where);
        snprintf(msg, cap, "cannot listen on %s: %s", where, strerror(errno));
        if (fd >= 0) close(fd);
        return FSDP_EBACKEND;
    }
    socklen_t len = sizeof ss;
    getsockname(fd, (struct sockaddr *)&ss, &len);
    char host[INET6_ADDRSTRLEN] = "", value[INET6_ADDRSTRLEN + 16], key[32];
    int port;
    if (ss.ss_family == AF_INET) {
        inet_ntop(AF_INET, &((struct sockaddr_in *)&ss)->sin_addr, host, sizeof host);
        port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
    } else {
        inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&ss)->sin6_addr, host, sizeof host);
        port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    }
    int n = snprintf(value, sizeof value, "%d %s %d", ss.ss_family == AF_INET ? 4 : 6, host, port);
    snprintf(key, sizeof key, "mesh/%d", m->rank);
    int rc = fsdp_store_set(store, key, value, (size_t)n);
    if (rc < 0) {
        snprintf(msg, cap, "store: %s", fsdp_store_last_error(store));
        close(fd);
        return rc;
    }
    *lfd = fd;
    return FSDP_OK;
}

/* Reads where rank q listens: FSDP_OK, 1 when rank q has not published it yet, or a failure. */
static int peer_address(mesh_t *m, fsdp_store_t *store, int q, char *msg, size_t cap) {
    char key[32], value[INET6_ADDRSTRLEN + 16], host[INET6_ADDRSTRLEN];
    size_t len = 0;
    int found = 0;
    snprintf(key, sizeof key, "mesh/%d", q);
    int rc = fsdp_store_check(store, key, &found);
    if (rc == FSDP_OK && !found) return 1;
    if (rc == FSDP_OK) rc = fsdp_store_get(store, key, value, sizeof value - 1, &len);
    if (rc < 0 || len >= sizeof value) {
        snprintf(msg, cap, "rank %d's address: %s", q,
                 rc < 0 ? fsdp_store_last_error(store) : "too long");
        return rc < 0 ? rc : FSDP_EBACKEND;
    }
    value[len] = '\0';
    int family, port;
    struct sockaddr_storage *ss = &m->peer_addr[q];
    memset(ss, 0, sizeof *ss);
    if (sscanf(value, "%d %45s %d", &family, host, &port) == 3 && port > 0 && port < 65536) {
        if (family == 4) {
            struct sockaddr_in *a = (struct sockaddr_in *)ss;
            a->sin_family = AF_INET;
            a->sin_port = htons((uint16_t)port);
            if (inet_pton(AF_INET, host, &a->sin_addr) == 1) {
                m->peer_len[q] = sizeof *a;
                return FSDP_OK;
            }
        } else if (family == 6) {
            struct sockaddr_in6 *a = (struct sockaddr_in6 *)ss;
            a->sin6_family = AF_INET6;
            a->sin6_port = htons((uint16_t)port);
            if (inet_pton(AF_INET6, host, &a->sin6_addr) == 1) {
                m->peer_len[q] = sizeof *a;
                return FSDP_OK;
            }
        }
    }
    snprintf(msg, cap, "rank %d published a malformed address '%s' under %s", q, value, key);
    return FSDP_EBACKEND;
}

static void name_missing(const mesh_t *m, char *msg, size_t cap, int64_t timeout_ms) {
    size_t n = (size_t)snprintf(msg, cap, "no authenticated connection within %lld ms with rank",
                                (long long)timeout_ms);
    const char *sep = " ";
    for (int q = 0; q < m->size && n < cap; q++) {
        if (q == m->rank || m->fds[q] >= 0) continue;
        n += (size_t)snprintf(msg + n, cap - n, "%s%d", sep, q);
        sep = ", ";
    }
    if (n < cap && m->last_fail[0])
        n += (size_t)snprintf(msg + n, cap - n, " (last failure %s)", m->last_fail);
    if (n < cap && m->dropped)
        snprintf(msg + n, cap - n, "; %d connection(s) dropped that did not prove membership",
                 m->dropped);
}

int fsdp__gloo_mesh_key(fsdp_store_t *store, int rank, uint8_t key[FSDP_GLOO_KEY_BYTES], char *msg,
                        size_t cap) {
    int rc;
    if (rank == 0) {
        if (fsdp__random_bytes(key, FSDP_GLOO_KEY_BYTES) < 0) {
            snprintf(msg, cap, "cannot draw the job's key: %s", strerror(errno));
            return FSDP_EBACKEND;
        }
        rc = fsdp_store_set(store, "auth.key", key, FSDP_GLOO_KEY_BYTES);
    } else {
        size_t len = 0;
        rc = fsdp_store_get(store, "auth.key", key, FSDP_GLOO_KEY_BYTES, &len);
        if (rc == FSDP_OK && len != FSDP_GLOO_KEY_BYTES) {
            snprintf(msg, cap, "the job's key in the store has %zu bytes, not %d", len,
                     FSDP_GLOO_KEY_BYTES);
            return FSDP_EBACKEND;
        }
    }
    if (rc < 0) snprintf(msg, cap, "the job's key: store: %s", fsdp_store_last_error(store));
    return rc;
}

int fsdp__gloo_mesh_connect(const fsdp_ctx_t *ctx, fsdp_store_t *store, int rank, int size,
                            const struct sockaddr *addr, socklen_t addrlen,
                            const uint8_t key[FSDP_GLOO_KEY_BYTES], int64_t timeout_ms, int *fds,
                            int *dropped, char *msg, size_t cap) {
    mesh_t m = {.ctx = ctx, .rank = rank, .size = size, .key = key, .fds = fds, .left = size - 1};
    int lfd = -1, rc = FSDP_ENOMEM;
    struct pollfd *pfd = NULL;
    int *who = NULL;
    *dropped = 0;
    for (int q = 0; q < size; q++)
        fds[q] = -1;
    m.peer_addr = calloc((size_t)size, sizeof *m.peer_addr);
    m.peer_len = calloc((size_t)size, sizeof *m.peer_len);
    m.out = calloc((size_t)size, sizeof *m.out);
    m.in = calloc(MAX_PENDING, sizeof *m.in);
    pfd = calloc((size_t)size + MAX_PENDING + 1, sizeof *pfd);
    who = calloc((size_t)size + MAX_PENDING + 1, sizeof *who);
    if (!m.peer_addr || !m.peer_len || !m.out || !m.in || !pfd || !who) {
        snprintf(msg, cap, "out of memory");
        goto out;
    }
    const int64_t deadline = fsdp__now_ns() + timeout_ms * 1000000;
    fsdp_store_set_timeout(store, timeout_ms);
    rc = listen_and_publish(&m, store, addr, addrlen, &lfd, msg, cap);
    if (rc < 0) goto out;
    for (int q = 0; q < rank; q++) {
        m.out[q].peer = q;
        m.out[q].fd = -1;
        m.out[q].st = OUT_ADDR;
        m.out[q].at = 0;
        m.out[q].backoff = ADDR_MIN_MS;
    }
    while (m.left > 0) {
        int64_t now = fsdp__now_ns();
        if (now >= deadline) {
            name_missing(&m, msg, cap, timeout_ms);
            rc = FSDP_ETIMEDOUT;
            goto out;
        }
        int64_t wake = deadline;
        int n = 0;
        pfd[n] = (struct pollfd){.fd = lfd, .events = POLLIN};
        who[n++] = -1;
        for (int q = 0; q < rank; q++) {
            conn_t *c = &m.out[q];
            if (c->st == OUT_ADDR && c->at <= now) {
                rc = peer_address(&m, store, q, msg, cap);
                if (rc < 0) goto out;
                if (rc == 0) {
                    c->st = OUT_WAIT;
                    c->backoff = RETRY_MIN_MS;
                } else {
                    c->at = now + (int64_t)c->backoff * 1000000;
                    c->backoff = c->backoff * 2 > ADDR_MAX_MS ? ADDR_MAX_MS : c->backoff * 2;
                }
            }
            if (c->st == OUT_ADDR) {
                if (c->at < wake) wake = c->at;
                continue;
            }
            if (c->st == OUT_WAIT) {
                if (c->at == INT64_MAX) continue; /* done */
                if (c->at <= now) start_out(&m, c);
                if (c->st == OUT_WAIT) {
                    if (c->at < wake) wake = c->at;
                    continue;
                }
            }
            pfd[n] =
                (struct pollfd){.fd = c->fd, .events = c->st == OUT_CONNECT ? POLLOUT : POLLIN};
            who[n++] = q;
        }
        for (int i = 0; i < m.nin; i++) {
            if (m.in[i].at <= now) {
                drop(&m, i, m.in[i].st == IN_HELLO ? "no hello in time" : "no proof in time");
                i--;
                continue;
            }
            if (m.in[i].at < wake) wake = m.in[i].at;
            pfd[n] = (struct pollfd){.fd = m.in[i].fd, .events = POLLIN};
            who[n++] = size + i;
        }
        int64_t wait_ms = (wake - now + 999999) / 1000000;
        if (poll(pfd, (nfds_t)n, (int)(wait_ms > 1000 ? 1000 : wait_ms)) < 0 && errno != EINTR) {
            snprintf(msg, cap, "poll: %s", strerror(errno));
            rc = FSDP_EBACKEND;
            goto out;
        }
        /* Accepted connections first, from the end, so that removals do not move the ones
         * still to be looked at; then the outgoing ones; then new arrivals. */
        for (int k = n - 1; k > 0; k--)
            if (who[k] >= size && pfd[k].revents) step_in(&m, who[k] - size);
        for (int k = 1; k < n; k++)
            if (who[k] >= 0 && who[k] < size && pfd[k].revents) step_out(&m, &m.out[who[k]]);
        if (pfd[0].revents) accept_all(&m, lfd);
    }
    rc = FSDP_OK;
out:
    if (rc < 0)
        for (int q = 0; q < size; q++)
            if (fds[q] >= 0) close(fds[q]), fds[q] = -1;
    if (m.out)
        for (int q = 0; q < rank; q++)
            if (m.out[q].fd >= 0) close(m.out[q].fd);
    /* Still proving themselves: strangers once every peer is connected; on a failure they may
     * be late peers, so they are closed without being counted. */
    while (m.nin > 0) {
        if (rc < 0) {
            close(m.in[--m.nin].fd);
            continue;
        }
        drop(&m, m.nin - 1,
             m.in[m.nin - 1].st == IN_HELLO ? "no hello yet when the group was connected"
                                            : "no proof yet when the group was connected");
    }
    if (lfd >= 0) close(lfd);
    if (m.dropped > LOGGED_DROPS)
        fsdp_log(ctx, FSDP_LOG_WARN,
                 "gloo: rank %d of %d dropped %d connections in all that did "
                 "not prove they belong to the job",
                 rank, size, m.dropped);
    *dropped = m.dropped;
    free(m.peer_addr);
    free(m.peer_len);
    free(m.out);
    free(m.in);
    free(pfd);
    free(who);
    return rc;
}
