/* SPDX-License-Identifier: MIT */
/*
 * store_tcp.c: the TCP store's client (fsdp_store_create_tcp) and the public face of its server
 * (fsdp_store_server_*, the server itself is store_tcp_server.c; the protocol store_tcp_proto.h).
 *
 * The client follows the Redis store's pattern: one connection per store data, shared by its
 * handles under a mutex, made by the first operation and again after a failure; refused
 * connections are retried until the operation's deadline so that ranks may start before the
 * server; get and wait poll (1 ms doubling to 50 ms). Every connect, send and receive waits in
 * poll() for at most the time left, so nothing blocks past the handle's timeout (a connect
 * attempt is also capped at 1 s, which bounds how long other threads wait for the mutex).
 * A request that failed on the wire is not resent (an add may have counted): the connection is
 * dropped and the error returned. Sends use MSG_NOSIGNAL, so a dead server is an error code,
 * not a SIGPIPE. Replies are length-checked: a value longer than TCP_MAX_VALUE, or a reply that
 * is not one of the protocol's, drops the connection.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/timeutil.h"
#include "store/store_impl.h"
#include "store/store_tcp_proto.h"

#define HOST_CAP 256
#define CONNECT_SLICE_MS 1000

typedef struct tcp_store {
    pthread_mutex_t mu; /* guards refs and fd */
    int refs;
    int fd; /* -1 until connected and after a failure */
    int port;
    char host[HOST_CAP];
    char where[HOST_CAP + 16];  /* "host:port", for messages */
    fsdp__tcp_key_t key;        /* FSDP_STORE_KEY_FILE's key; len 0: none */
    fsdp__tcp_server_t *server; /* a server this data owns (fsdp__store_tcp_serve), or NULL */
} tcp_store_t;

static int64_t ms_left(int64_t deadline_ns) {
    int64_t ns = deadline_ns - fsdp__now_ns();
    return ns <= 0 ? 0 : (ns + 999999) / 1000000;
}

/* Waits until fd is ready for `events` or the deadline passes; 1 ready, 0 timed out, -1 error. */
static int wait_fd(int fd, short events, int64_t deadline_ns) {
    for (;;) {
        int64_t ms = ms_left(deadline_ns);
        struct pollfd p = {.fd = fd, .events = events};
        int rc = poll(&p, 1, ms > 1000000 ? 1000000 : (int)ms);
        if (rc < 0 && errno == EINTR) continue;
        if (rc < 0) return -1;
        if (rc == 0) return ms > 1000000 ? wait_fd(fd, events, deadline_ns) : 0;
        return 1;
    }
}

/* Reads exactly n bytes by the slice's end: 0, an errno (ECONNRESET at end of file), or -1 with
 * why set. */
static int recv_some(int fd, unsigned char *p, size_t n, int64_t slice, char *why, size_t cap) {
    size_t got = 0;
    while (got < n) {
        if (wait_fd(fd, POLLIN, slice) <= 0) {
            snprintf(why, cap, "the server did not greet within the connect time");
            return -1;
        }
        ssize_t r = recv(fd, p + got, n - got, 0);
        if (r == 0) return ECONNRESET;
        if (r < 0) {
            if (errno == EAGAIN || errno == EINTR) continue;
            return errno;
        }
        got += (size_t)r;
    }
    return 0;
}

/* One connect attempt to every address of host:port, each bounded by the slice; on success the
 * magic (and, with a key, the proofs) has been exchanged. *key_fault is set when the server and
 * this handle disagree about the key, which no retry mends. The caller holds t->mu. */
static void connect_locked(tcp_store_t *t, int64_t deadline_ns, char *why, size_t cap,
                           int *key_fault) {
    int64_t slice = fsdp__now_ns() + CONNECT_SLICE_MS * INT64_C(1000000);
    if (slice > deadline_ns) slice = deadline_ns;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", t->port);
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    int g = getaddrinfo(t->host, ps, &hints, &res);
    if (g != 0) {
        snprintf(why, cap, "cannot resolve '%s': %s", t->host, gai_strerror(g));
        return;
    }
    for (struct addrinfo *a = res; a && t->fd < 0; a = a->ai_next) {
        int fd =
            socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            snprintf(why, cap, "socket: %s", strerror(errno));
            continue;
        }
        int err = 0;
        if (connect(fd, a->ai_addr, a->ai_addrlen) < 0) {
            err = errno;
            if (err == EINPROGRESS) {
                socklen_t len = sizeof err;
                int w = wait_fd(fd, POLLOUT, slice);
                err = w <= 0 ? ETIMEDOUT : 0;
                if (w > 0 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0) err = errno;
            }
        }
        /* Both sides say who they are, so that a port serving something else is named as such
         * rather than misread; the server first, since its greeting says whether it wants the
         * key (and carries its nonce). */
        unsigned char greet[TCP_GREET_AUTH];
        if (!err) err = recv_some(fd, greet, TCP_MAGIC_LEN, slice, why, cap);
        int keyed = !err && memcmp(greet, TCP_AUTH_MAGIC, TCP_MAGIC_LEN) == 0;
        if (!err && !keyed && memcmp(greet, TCP_MAGIC, TCP_MAGIC_LEN) != 0) {
            snprintf(why, cap, "what listens there is not a libfsdp TCP store server");
            err = -1;
        } else if (!err && keyed && !t->key.len) {
            snprintf(why, cap,
                     "the server requires the job's key: set FSDP_STORE_KEY_FILE to "
                     "the key file its launcher was given");
            err = -1;
            *key_fault = 1;
        } else if (!err && !keyed && t->key.len) {
            snprintf(why, cap,
                     "the server does not ask for the job's key, which "
                     "FSDP_STORE_KEY_FILE gives: refusing to use it");
            err = -1;
            *key_fault = 1;
        } else if (!err && !keyed) {
            if (send(fd, TCP_MAGIC, TCP_MAGIC_LEN, MSG_NOSIGNAL) != TCP_MAGIC_LEN)
                err = errno ? errno : EIO;
        } else if (!err) {
            unsigned char hello[TCP_HELLO_AUTH], proof[TCP_PROOF];
            unsigned char *ns = greet + TCP_MAGIC_LEN, *nc = hello + TCP_MAGIC_LEN;
            memcpy(hello, TCP_AUTH_MAGIC, TCP_MAGIC_LEN);
            err = recv_some(fd, ns, TCP_NONCE, slice, why, cap);
            if (!err && (fsdp__tcp_nonce(nc, TCP_NONCE) < 0 ||
                         fsdp__tcp_proof(&t->key, 'C', ns, nc, nc + TCP_NONCE) < 0)) {
                snprintf(why, cap, "cannot make the proof of the key");
                err = -1;
            }
            if (!err && send(fd, hello, sizeof hello, MSG_NOSIGNAL) != (ssize_t)sizeof hello)
                err = errno ? errno : EIO;
            if (!err) {
                err = recv_some(fd, proof, TCP_PROOF, slice, why, cap);
                if (err == ECONNRESET) {
                    snprintf(why, cap,
                             "the server turned the key away: FSDP_STORE_KEY_FILE "
                             "holds another key than the server's");
                    err = -1;
                    *key_fault = 1;
                }
            }
            if (!err && !fsdp__tcp_proof_ok(&t->key, 'S', ns, nc, proof)) {
                snprintf(why, cap, "the server did not prove it holds the job's key");
                err = -1;
                *key_fault = 1;
            }
        }
        if (err) {
            if (err > 0) snprintf(why, cap, "%s", strerror(err));
            close(fd);
            continue;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        t->fd = fd;
    }
    freeaddrinfo(res);
}

static int send_all(int fd, const void *p, size_t n, int64_t deadline_ns) {
    const unsigned char *b = p;
    while (n > 0) {
        ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            if (wait_fd(fd, POLLOUT, deadline_ns) <= 0) return -1;
            continue;
        }
        if (w < 0) return -1;
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Receives n bytes into p (NULL: discards them). */
static int recv_all(int fd, void *p, size_t n, int64_t deadline_ns) {
    unsigned char sink[4096], *b = p;
    while (n > 0) {
        size_t want = b ? n : (n < sizeof sink ? n : sizeof sink);
        ssize_t r = recv(fd, b ? b : sink, want, 0);
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            if (wait_fd(fd, POLLIN, deadline_ns) <= 0) return -1;
            continue;
        }
        if (r <= 0) {
            if (r == 0) errno = ECONNRESET;
            return -1;
        }
        if (b) b += r;
        n -= (size_t)r;
    }
    return 0;
}

/* What a request sends and what its reply fills in. */
typedef struct exchange {
    char op;
    const char *key;
    const void *value; /* set */
    size_t len;        /* set: value bytes */
    int64_t delta;     /* add */
    void *buf;         /* get: where the value goes, cap bytes */
    size_t cap;
    size_t vlen;     /* get: the value's full length */
    int64_t counter; /* add: the new value */
    int status;      /* TCP_* */
} exchange_t;

/* Sends one request and reads its reply over the open connection; -1 on a wire failure. */
static int exchange_locked(tcp_store_t *t, exchange_t *x, int64_t deadline_ns, char *why,
                           size_t cap) {
    size_t k = strlen(x->key);
    unsigned char head[3 + TCP_MAX_KEY + 8];
    size_t h = 0;
    head[h++] = (unsigned char)x->op;
    head[h++] = (unsigned char)(k >> 8);
    head[h++] = (unsigned char)k;
    memcpy(head + h, x->key, k);
    h += k;
    if (x->op == 'S') {
        uint32_t v = (uint32_t)x->len;
        for (int i = 0; i < 4; i++)
            head[h++] = (unsigned char)(v >> (24 - 8 * i));
    } else if (x->op == 'A') {
        uint64_t d = (uint64_t)x->delta;
        for (int i = 0; i < 8; i++)
            head[h++] = (unsigned char)(d >> (56 - 8 * i));
    }
    unsigned char st;
    if (send_all(t->fd, head, h, deadline_ns) < 0 ||
        (x->op == 'S' && x->len && send_all(t->fd, x->value, x->len, deadline_ns) < 0) ||
        recv_all(t->fd, &st, 1, deadline_ns) < 0)
        goto wire;
    x->status = st;
    if (st == TCP_BAD) {
        snprintf(why, cap, "the server refused the request as malformed");
        return -1;
    }
    if (st > TCP_BAD) {
        snprintf(why, cap, "the server sent status %u, which is not in the protocol", st);
        return -1;
    }
    if (st != TCP_OK) return 0;
    unsigned char b[8];
    if (x->op == 'G') {
        if (recv_all(t->fd, b, 4, deadline_ns) < 0) goto wire;
        size_t n = (size_t)b[0] << 24 | (size_t)b[1] << 16 | (size_t)b[2] << 8 | b[3];
        if (n > TCP_MAX_VALUE) {
            snprintf(why, cap, "the server announced a value of %zu bytes, over the limit of %u", n,
                     TCP_MAX_VALUE);
            return -1;
        }
        size_t keep = n < x->cap ? n : x->cap;
        if ((keep && recv_all(t->fd, x->buf, keep, deadline_ns) < 0) ||
            recv_all(t->fd, NULL, n - keep, deadline_ns) < 0)
            goto wire;
        x->vlen = n;
    } else if (x->op == 'A') {
        if (recv_all(t->fd, b, 8, deadline_ns) < 0) goto wire;
        uint64_t v = 0;
        for (int i = 0; i < 8; i++)
            v = v << 8 | b[i];
        x->counter = (int64_t)v;
    }
    return 0;
wire:
    snprintf(why, cap, "%s",
             fsdp__now_ns() >= deadline_ns ? "no reply in time"
             : errno                       ? strerror(errno)
                                           : "connection lost");
    return -1;
}

/* Runs one request, connecting first if needed (refused connections are retried until the
 * deadline). */
static int command(tcp_store_t *t, exchange_t *x, int64_t deadline_ns, int64_t timeout_ms,
                   const char *op, char *err) {
    char why[768] = "";
    int64_t nap = 0;
    for (;;) {
        int key_fault = 0;
        pthread_mutex_lock(&t->mu);
        if (t->fd < 0) connect_locked(t, deadline_ns, why, sizeof why, &key_fault);
        if (t->fd >= 0) {
            int rc = exchange_locked(t, x, deadline_ns, why, sizeof why);
            if (rc == 0) {
                pthread_mutex_unlock(&t->mu);
                return FSDP_OK;
            }
            close(t->fd);
            t->fd = -1;
            pthread_mutex_unlock(&t->mu);
            int late = fsdp__now_ns() >= deadline_ns;
            return fsdp__err(err, late ? FSDP_ETIMEDOUT : FSDP_EBACKEND,
                             "tcp store %s: %s '%s': %s%s", t->where, op, x->key, why,
                             late ? " (the handle's timeout ran out)" : "");
        }
        pthread_mutex_unlock(&t->mu);
        if (key_fault)
            return fsdp__err(err, FSDP_EINVAL, "tcp store %s: %s '%s': %s", t->where, op, x->key,
                             why);
        if (fsdp__now_ns() >= deadline_ns)
            return fsdp__err(err, FSDP_ETIMEDOUT,
                             "tcp store %s: %s '%s': cannot connect to the store server at %s "
                             "within %lld ms: %s",
                             t->where, op, x->key, t->where, (long long)timeout_ms, why);
        nap = fsdp__store_backoff_ms(nap);
        int64_t ms = ms_left(deadline_ns);
        fsdp__sleep_ms(nap < ms ? nap : ms);
    }
}

static int full(const tcp_store_t *t, const char *op, const char *key, char *err) {
    return fsdp__err(err, FSDP_ENOMEM,
                     "tcp store %s: %s '%s': the server holds its limit of %zu MiB of keys and "
                     "values",
                     t->where, op, key, TCP_MAX_TOTAL >> 20);
}

static int tcp_set(void *data, const char *key, const void *value, size_t len, int64_t timeout_ms,
                   char *err) {
    tcp_store_t *t = data;
    if (len > TCP_MAX_VALUE)
        return fsdp__err(err, FSDP_EINVAL,
                         "tcp store %s: set '%s': the value has %zu bytes; the limit is %u",
                         t->where, key, len, TCP_MAX_VALUE);
    exchange_t x = {.op = 'S', .key = key, .value = value, .len = len};
    int rc = command(t, &x, fsdp__store_deadline_ns(timeout_ms), timeout_ms, "set", err);
    if (rc == FSDP_OK && x.status == TCP_FULL) return full(t, "set", key, err);
    return rc;
}

static int tcp_get(void *data, const char *key, void *buf, size_t cap, size_t *len,
                   int64_t timeout_ms, char *err) {
    tcp_store_t *t = data;
    int64_t deadline = fsdp__store_deadline_ns(timeout_ms), nap = 0;
    for (;;) {
        exchange_t x = {.op = 'G', .key = key, .buf = buf, .cap = buf ? cap : 0};
        int rc = command(t, &x, deadline, timeout_ms, "get", err);
        if (rc < 0) return rc;
        if (x.status == TCP_OK) {
            *len = x.vlen;
            return FSDP_OK;
        }
        if (fsdp__now_ns() >= deadline)
            return fsdp__err(err, FSDP_ETIMEDOUT,
                             "tcp store %s: key '%s' did not appear within %lld ms", t->where, key,
                             (long long)timeout_ms);
        nap = fsdp__store_backoff_ms(nap);
        int64_t ms = ms_left(deadline);
        fsdp__sleep_ms(nap < ms ? nap : ms);
    }
}

static int tcp_add(void *data, const char *key, int64_t delta, int64_t *result, int64_t timeout_ms,
                   char *err) {
    tcp_store_t *t = data;
    exchange_t x = {.op = 'A', .key = key, .delta = delta};
    int rc = command(t, &x, fsdp__store_deadline_ns(timeout_ms), timeout_ms, "add", err);
    if (rc < 0) return rc;
    if (x.status == TCP_NOT_COUNTER)
        return fsdp__err(err, FSDP_EINVAL,
                         "tcp store %s: add %" PRId64 " on '%s', whose value is not a counter "
                         "or would overflow",
                         t->where, delta, key);
    if (x.status == TCP_FULL) return full(t, "add", key, err);
    *result = x.counter;
    return FSDP_OK;
}

static int tcp_check(void *data, const char *key, int *found, int64_t timeout_ms, char *err) {
    tcp_store_t *t = data;
    exchange_t x = {.op = 'C', .key = key};
    int rc = command(t, &x, fsdp__store_deadline_ns(timeout_ms), timeout_ms, "check", err);
    if (rc == FSDP_OK) *found = x.status == TCP_OK;
    return rc;
}

static void tcp_retain(void *data) {
    tcp_store_t *t = data;
    pthread_mutex_lock(&t->mu);
    t->refs++;
    pthread_mutex_unlock(&t->mu);
}

static void tcp_release(void *data) {
    tcp_store_t *t = data;
    pthread_mutex_lock(&t->mu);
    int last = --t->refs == 0;
    pthread_mutex_unlock(&t->mu);
    if (!last) return;
    if (t->fd >= 0) close(t->fd);
    fsdp__tcp_server_stop(t->server); /* after our own connection is gone */
    pthread_mutex_destroy(&t->mu);
    free(t);
}

static const struct fsdp_store_ops tcp_ops = {
    .name = "tcp",
    .set = tcp_set,
    .get = tcp_get,
    .add = tcp_add,
    .check = tcp_check,
    .retain = tcp_retain,
    .release = tcp_release,
};

int fsdp_store_create_tcp(fsdp_ctx_t *ctx, const char *host, int port, const char *prefix,
                          fsdp_store_t **out) {
    if (!out) return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "fsdp_store_create_tcp: out is NULL");
    *out = NULL;
    if (!host || !*host)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "fsdp_store_create_tcp: host is %s",
                                    host ? "empty" : "NULL");
    if (strlen(host) >= HOST_CAP)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "fsdp_store_create_tcp: host '%.64s...' is longer than %d "
                                    "bytes",
                                    host, HOST_CAP - 1);
    if (port < 1 || port > 65535)
        return fsdp__ctx_err_or_log(
            ctx, FSDP_EINVAL, "fsdp_store_create_tcp(%s): port %d is outside 1..65535", host, port);
    if (prefix && strlen(prefix) >= sizeof((fsdp_store_t *)0)->prefix)
        return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                    "fsdp_store_create_tcp(%s:%d): prefix '%.64s...' is longer "
                                    "than %zu bytes",
                                    host, port, prefix, sizeof((fsdp_store_t *)0)->prefix - 1);
    tcp_store_t *t = calloc(1, sizeof *t);
    if (!t) return fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "fsdp_store_create_tcp: out of memory");
    char why[FSDP_ERR_LEN / 2];
    int krc = fsdp__tcp_key_from_env(&t->key, why, sizeof why);
    if (krc < 0) {
        free(t);
        return fsdp__ctx_err_or_log(ctx, krc, "fsdp_store_create_tcp(%s:%d): %s", host, port, why);
    }
    snprintf(t->host, sizeof t->host, "%s", host);
    t->port = port;
    t->fd = -1;
    snprintf(t->where, sizeof t->where, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
    pthread_mutex_init(&t->mu, NULL);
    t->refs = 1;
    int rc = fsdp__store_wrap(&tcp_ops, t, out);
    if (rc < 0) return fsdp__ctx_err_or_log(ctx, rc, "fsdp_store_create_tcp: out of memory");
    if (prefix) snprintf((*out)->prefix, sizeof(*out)->prefix, "%s", prefix);
    return FSDP_OK;
}

int fsdp__store_tcp_serve(fsdp_ctx_t *ctx, const char *bind_host, const char *host, int port,
                          fsdp_store_t **out) {
    *out = NULL;
    char err[FSDP_ERR_LEN];
    fsdp__tcp_server_t *srv = NULL;
    fsdp__tcp_key_t key;
    int rc = fsdp__tcp_key_from_env(&key, err, sizeof err);
    if (rc == FSDP_OK) rc = fsdp__tcp_server_start(bind_host, port, &key, &srv, err, sizeof err);
    if (rc < 0) return fsdp__ctx_err_or_log(ctx, rc, "%s", err);
    rc = fsdp_store_create_tcp(ctx, host, fsdp__tcp_server_port(srv), NULL, out);
    if (rc < 0) {
        fsdp__tcp_server_stop(srv);
        return rc;
    }
    ((tcp_store_t *)(*out)->data)->server = srv;
    return FSDP_OK;
}

/* ---- the server's public face ------------------------------------------------------------ */

struct fsdp_store_server {
    fsdp__tcp_server_t *s;
};

int fsdp_store_server_start(fsdp_ctx_t *ctx, const char *host, int port,
                            fsdp_store_server_t **out) {
    if (!out) return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL, "fsdp_store_server_start: out is NULL");
    *out = NULL;
    fsdp_store_server_t *w = calloc(1, sizeof *w);
    if (!w) return fsdp__ctx_err_or_log(ctx, FSDP_ENOMEM, "fsdp_store_server_start: out of memory");
    char err[FSDP_ERR_LEN];
    fsdp__tcp_key_t key;
    int rc = fsdp__tcp_key_from_env(&key, err, sizeof err);
    if (rc == FSDP_OK) rc = fsdp__tcp_server_start(host, port, &key, &w->s, err, sizeof err);
    if (rc < 0) {
        free(w);
        return fsdp__ctx_err_or_log(ctx, rc, "fsdp_store_server_start: %s", err);
    }
    *out = w;
    return FSDP_OK;
}

int fsdp_store_server_port(const fsdp_store_server_t *server) {
    return server ? fsdp__tcp_server_port(server->s) : -1;
}

void fsdp_store_server_stop(fsdp_store_server_t *server) {
    if (!server) return;
    fsdp__tcp_server_stop(server->s);
    free(server);
}
