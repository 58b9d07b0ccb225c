/* SPDX-License-Identifier: MIT */
/*
 * store_tcp_server.c: the server of the TCP store (protocol: store_tcp_proto.h).
 *
 * One thread runs a poll loop over the listening socket, a wake-up pipe and every connection;
 * all sockets are non-blocking, so no client, however slow, dead or hostile, can stall the loop,
 * and fsdp__tcp_server_stop() returns as soon as the thread sees the pipe. Only that thread
 * touches the data (a chained hash table of keys), so it needs no lock.
 *
 * Invariants that bound what a peer can make the server hold:
 * - A connection reads only the bytes its current request still needs (the header first, then
 *   the lengths it declares, each checked against TCP_MAX_KEY and TCP_MAX_VALUE before anything
 *   else is read), so its input buffer never holds more than one request. The buffer grows by
 *   doubling as bytes arrive, never ahead of them: a peer that declares 64 MiB and sends nothing
 *   costs 4 KiB.
 * - While a reply is unsent the connection is not read, so a client that pipelines requests
 *   without reading replies holds at most one reply.
 * - All keys and values together stay under TCP_MAX_TOTAL (a set or add past it is TCP_FULL),
 *   and at most TCP_MAX_CONNS connections are kept (more are accepted and closed at once).
 * - A connection that ends or fails mid-request is dropped with its partial request; nothing it
 *   sent is applied unless the request was whole. A malformed request gets TCP_BAD, then close.
 *
 * With the job's key (FSDP_STORE_KEY_FILE), a connection is served only once its hello proved
 * the key (store_tcp_proto.h); one that fails is closed before any request is read.
 *
 * This file uses nothing of libfsdp but the FSDP_E* codes: fsdprun compiles it in.
 */
/* accept4 and pipe2 are Linux (and BSD) extensions. */
#define _GNU_SOURCE

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <fsdp/errno.h>

#include "store/store_counter.h"
#include "store/store_tcp_proto.h"

typedef struct item {
    struct item *next;
    char *key; /* NUL-terminated; keys never hold NUL (they come from C strings) */
    size_t klen;
    unsigned char *val;
    size_t vlen;
} item_t;

typedef struct conn {
    int fd;
    int hello;                      /* the client's magic (and proof, with a key) has arrived */
    unsigned char nonce[TCP_NONCE]; /* Ns, sent in the greeting (with a key) */
    int closing;                    /* close once the output is sent */
    unsigned char *in;              /* the current request, `have` bytes of it so far */
    size_t have, cap;
    unsigned char *out; /* the unsent reply: bytes [off, len) */
    size_t off, len, out_cap;
} conn_t;

struct fsdp__tcp_server {
    int lfd, port;
    fsdp__tcp_key_t key;    /* len 0: no key asked for */
    unsigned long rejected; /* clients turned away for a missing or wrong proof */
    int wake[2];
    pthread_t thread;
    conn_t **conns;
    size_t nconns, conns_cap;
    item_t **buckets;
    size_t nbuckets, nitems, total; /* total: bytes of all keys and values */
};

static int fail(char *err, size_t cap, int rc, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int fail(char *err, size_t cap, int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    if (err && cap) vsnprintf(err, cap, fmt, ap);
    va_end(ap);
    return rc;
}

static uint32_t be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static void put_be32(unsigned char *p, uint32_t v) {
    for (int i = 3; i >= 0; i--, v >>= 8)
        p[i] = (unsigned char)v;
}

static void put_be64(unsigned char *p, uint64_t v) {
    for (int i = 7; i >= 0; i--, v >>= 8)
        p[i] = (unsigned char)v;
}

static uint64_t be64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | p[i];
    return v;
}

/* ---- the data ---------------------------------------------------------------------------- */

static size_t hash(const char *k, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)k[i]) * 1099511628211ull;
    return (size_t)h;
}

static item_t *find(struct fsdp__tcp_server *s, const char *k, size_t n) {
    for (item_t *it = s->buckets[hash(k, n) % s->nbuckets]; it; it = it->next)
        if (it->klen == n && memcmp(it->key, k, n) == 0) return it;
    return NULL;
}

/* Doubles the table when it holds more items than buckets (a failed doubling keeps the old). */
static void grow_table(struct fsdp__tcp_server *s) {
    if (s->nitems <= s->nbuckets) return;
    size_t nb = s->nbuckets * 2;
    item_t **b = calloc(nb, sizeof *b);
    if (!b) return;
    for (size_t i = 0; i < s->nbuckets; i++)
        for (item_t *it = s->buckets[i], *next; it; it = next) {
            next = it->next;
            size_t h = hash(it->key, it->klen) % nb;
            it->next = b[h];
            b[h] = it;
        }
    free(s->buckets);
    s->buckets = b;
    s->nbuckets = nb;
}

/* Sets key to a copy of the value; TCP_OK, TCP_FULL, or -1 when out of memory. */
static int put(struct fsdp__tcp_server *s, const char *k, size_t n, const void *v, size_t len) {
    item_t *it = find(s, k, n);
    size_t old = it ? it->vlen : 0, add = it ? 0 : n;
    if (s->total - old + len + add > TCP_MAX_TOTAL) return TCP_FULL;
    unsigned char *copy = malloc(len ? len : 1);
    if (!copy) return -1;
    if (len) memcpy(copy, v, len);
    if (!it) {
        it = calloc(1, sizeof *it);
        char *key = malloc(n + 1);
        if (!it || !key) {
            free(it);
            free(key);
            free(copy);
            return -1;
        }
        memcpy(key, k, n);
        key[n] = 0;
        it->key = key;
        it->klen = n;
        size_t h = hash(k, n) % s->nbuckets;
        it->next = s->buckets[h];
        s->buckets[h] = it;
        s->nitems++;
        grow_table(s);
    }
    free(it->val);
    it->val = copy;
    it->vlen = len;
    s->total = s->total - old + len + add;
    return TCP_OK;
}

/* ---- connections ------------------------------------------------------------------------- */

static void conn_free(conn_t *c) {
    if (c->fd >= 0) close(c->fd);
    free(c->in);
    free(c->out);
    free(c);
}

/* Appends n bytes to the unsent reply; -1 when out of memory. */
static int emit(conn_t *c, const void *p, size_t n) {
    if (c->len + n > c->out_cap) {
        size_t cap = c->out_cap ? c->out_cap : 64;
        while (cap < c->len + n)
            cap *= 2;
        unsigned char *o = realloc(c->out, cap);
        if (!o) return -1;
        c->out = o;
        c->out_cap = cap;
    }
    memcpy(c->out + c->len, p, n);
    c->len += n;
    return 0;
}

static int emit_status(conn_t *c, int status) {
    unsigned char b = (unsigned char)status;
    return emit(c, &b, 1);
}

/* How many bytes the current request has in all, as far as its header tells; 0 when what has
 * arrived is already malformed (unknown op, key or value length out of range). */
static size_t need_of(const struct fsdp__tcp_server *s, const conn_t *c) {
    if (!c->hello) return s->key.len ? TCP_HELLO_AUTH : TCP_MAGIC_LEN;
    if (c->have < 3) return 3;
    size_t k = (size_t)c->in[1] << 8 | c->in[2];
    if (k == 0 || k > TCP_MAX_KEY) return 0;
    switch (c->in[0]) {
    case 'G':
    case 'C':
        return 3 + k;
    case 'A':
        return 3 + k + 8;
    case 'S':
        if (c->have < 3 + k + 4) return 3 + k + 4;
        if (be32(c->in + 3 + k) > TCP_MAX_VALUE) return 0;
        return 3 + k + 4 + be32(c->in + 3 + k);
    default:
        return 0;
    }
}

/* Applies the whole request in c->in and queues its reply; -1 to drop the connection. */
static int serve(struct fsdp__tcp_server *s, conn_t *c) {
    if (!c->hello && s->key.len) {
        const unsigned char *nc = c->in + TCP_MAGIC_LEN;
        unsigned char proof[TCP_PROOF];
        if (memcmp(c->in, TCP_AUTH_MAGIC, TCP_MAGIC_LEN) != 0 ||
            !fsdp__tcp_proof_ok(&s->key, 'C', c->nonce, nc, nc + TCP_NONCE) ||
            fsdp__tcp_proof(&s->key, 'S', c->nonce, nc, proof) < 0) {
            __atomic_add_fetch(&s->rejected, 1, __ATOMIC_RELAXED);
            return -1; /* no proof of the key: dropped before it can read or write */
        }
        c->hello = 1;
        return emit(c, proof, sizeof proof);
    }
    if (!c->hello) {
        if (memcmp(c->in, TCP_MAGIC, TCP_MAGIC_LEN) != 0) return -1; /* not our client */
        c->hello = 1;
        return 0;
    }
    size_t k = (size_t)c->in[1] << 8 | c->in[2];
    const char *key = (const char *)c->in + 3;
    if (memchr(key, 0, k)) { /* keys are C strings */
        c->closing = 1;
        return emit_status(c, TCP_BAD);
    }
    item_t *it = find(s, key, k);
    unsigned char b[9];
    switch (c->in[0]) {
    case 'S': {
        int st = put(s, key, k, c->in + 3 + k + 4, be32(c->in + 3 + k));
        return st < 0 ? -1 : emit_status(c, st);
    }
    case 'G':
        if (!it) return emit_status(c, TCP_MISSING);
        b[0] = TCP_OK;
        put_be32(b + 1, (uint32_t)it->vlen);
        return emit(c, b, 5) < 0 || emit(c, it->val, it->vlen) < 0 ? -1 : 0;
    case 'C':
        return emit_status(c, it ? TCP_OK : TCP_MISSING);
    default: { /* 'A' */
        int64_t cur = 0, delta = (int64_t)be64(c->in + 3 + k), sum;
        if (it && fsdp__store_parse_counter(it->val, it->vlen, &cur) != 0)
            return emit_status(c, TCP_NOT_COUNTER);
        if (__builtin_add_overflow(cur, delta, &sum)) return emit_status(c, TCP_NOT_COUNTER);
        char text[32];
        int n = snprintf(text, sizeof text, "%lld", (long long)sum);
        int st = put(s, key, k, text, (size_t)n);
        if (st < 0) return -1;
        if (st != TCP_OK) return emit_status(c, st);
        b[0] = TCP_OK;
        put_be64(b + 1, (uint64_t)sum);
        return emit(c, b, 9);
    }
    }
}

/* Reads what the current request still needs; -1 to drop the connection. */
static int conn_read(struct fsdp__tcp_server *s, conn_t *c) {
    for (int round = 0; round < 16 && c->len == 0 && !c->closing; round++) {
        size_t need = need_of(s, c);
        if (need == 0) {
            c->closing = 1;
            return emit_status(c, TCP_BAD);
        }
        if (c->have == c->cap && c->cap < need) { /* grow with what arrived, never ahead */
            size_t cap = c->cap * 2 > 4096 ? c->cap * 2 : 4096;
            if (cap > need) cap = need;
            unsigned char *in = realloc(c->in, cap);
            if (!in) return -1;
            c->in = in;
            c->cap = cap;
        }
        size_t want = (need < c->cap ? need : c->cap) - c->have;
        ssize_t got = recv(c->fd, c->in + c->have, want, 0);
        if (got == 0) return -1; /* the client closed, perhaps mid-request */
        if (got < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -1;
        c->have += (size_t)got;
        if (c->have < need_of(s, c) || need_of(s, c) == 0) continue;
        if (serve(s, c) < 0) return -1;
        c->have = 0;
        if (c->cap > 65536) { /* do not keep a big request's buffer on an idle connection */
            free(c->in);
            c->in = NULL;
            c->cap = 0;
        }
    }
    return 0;
}

/* Sends what it can of the reply; -1 to drop the connection (or when closing is done). */
static int conn_write(conn_t *c) {
    while (c->off < c->len) {
        ssize_t n = send(c->fd, c->out + c->off, c->len - c->off, MSG_NOSIGNAL);
        if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -1;
        c->off += (size_t)n;
    }
    c->off = c->len = 0;
    return c->closing ? -1 : 0;
}

static void accept_all(struct fsdp__tcp_server *s) {
    for (;;) {
        int fd = accept4(s->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) return; /* EAGAIN, or a connection that died before we took it */
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
        if (s->nconns == s->conns_cap) {
            size_t cap = s->conns_cap ? s->conns_cap * 2 : 16;
            conn_t **cs = realloc(s->conns, cap * sizeof *cs);
            if (!cs) {
                close(fd);
                return;
            }
            s->conns = cs;
            s->conns_cap = cap;
        }
        conn_t *c = calloc(1, sizeof *c);
        if (!c || s->nconns >= TCP_MAX_CONNS) {
            free(c);
            close(fd);
            continue;
        }
        c->fd = fd;
        int greeted = s->key.len ? fsdp__tcp_nonce(c->nonce, TCP_NONCE) == 0 &&
                                       emit(c, TCP_AUTH_MAGIC, TCP_MAGIC_LEN) == 0 &&
                                       emit(c, c->nonce, TCP_NONCE) == 0
                                 : emit(c, TCP_MAGIC, TCP_MAGIC_LEN) == 0;
        if (!greeted) {
            conn_free(c);
            continue;
        }
        s->conns[s->nconns++] = c;
    }
}

static void *loop(void *arg) {
    struct fsdp__tcp_server *s = arg;
    struct pollfd *pf = NULL;
    size_t pf_cap = 0;
    for (;;) {
        size_t n = s->nconns + 2;
        if (n > pf_cap) {
            struct pollfd *p = realloc(pf, n * sizeof *p);
            if (!p && pf_cap < 2) { /* out of memory: wait, do not spin */
                poll(NULL, 0, 10);
                continue;
            }
            if (!p) { /* keep serving the connections the old array covers */
                n = pf_cap;
            } else {
                pf = p;
                pf_cap = n;
            }
        }
        pf[0] = (struct pollfd){.fd = s->wake[0], .events = POLLIN};
        pf[1] = (struct pollfd){.fd = s->lfd, .events = POLLIN};
        for (size_t i = 0; i + 2 < n; i++)
            pf[i + 2] = (struct pollfd){.fd = s->conns[i]->fd,
                                        .events = s->conns[i]->len ? POLLOUT : POLLIN};
        if (poll(pf, (nfds_t)n, -1) < 0) continue; /* EINTR */
        if (pf[0].revents) break;
        size_t polled = n - 2;
        for (size_t i = 0; i < polled; i++) {
            conn_t *c = s->conns[i];
            short ev = pf[i + 2].revents;
            if (!ev) continue;
            int rc = 0;
            if (ev & POLLOUT)
                rc = conn_write(c);
            else if (ev & (POLLIN | POLLHUP | POLLERR))
                rc = conn_read(s, c);
            if (rc == 0 && c->len) rc = conn_write(c); /* answer at once when the socket can */
            if (rc < 0) {
                conn_free(c);
                s->conns[i] = NULL;
            }
        }
        size_t kept = 0; /* compact, keeping order */
        for (size_t i = 0; i < s->nconns; i++)
            if (s->conns[i]) s->conns[kept++] = s->conns[i];
        s->nconns = kept;
        if (pf[1].revents) accept_all(s);
    }
    free(pf);
    return NULL;
}

/* ---- start and stop ---------------------------------------------------------------------- */

static int listen_on(const char *host, int port, int *fd_out, char *err, size_t cap) {
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    const char *h = host && *host ? host : NULL;
    int g = getaddrinfo(h, ps, &hints, &res);
    if (g != 0)
        return fail(err, cap, FSDP_EINVAL, "tcp store server: cannot resolve '%s': %s", h ? h : "*",
                    gai_strerror(g));
    int fd = -1, saved = 0;
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            saved = errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) < 0 || listen(fd, 1024) < 0) {
            saved = errno;
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    if (fd < 0)
        return fail(err, cap, FSDP_EBACKEND, "tcp store server: cannot listen on %s%s%s:%d: %s",
                    h && strchr(h, ':') ? "[" : "", h ? h : "*", h && strchr(h, ':') ? "]" : "",
                    port, strerror(saved));
    *fd_out = fd;
    return 0;
}

static void free_server(struct fsdp__tcp_server *s) {
    for (size_t i = 0; i < s->nconns; i++)
        conn_free(s->conns[i]);
    free(s->conns);
    for (size_t i = 0; s->buckets && i < s->nbuckets; i++)
        for (item_t *it = s->buckets[i], *next; it; it = next) {
            next = it->next;
            free(it->key);
            free(it->val);
            free(it);
        }
    free(s->buckets);
    if (s->lfd >= 0) close(s->lfd);
    if (s->wake[0] >= 0) close(s->wake[0]);
    if (s->wake[1] >= 0) close(s->wake[1]);
    free(s);
}

int fsdp__tcp_server_start(const char *host, int port, const fsdp__tcp_key_t *key,
                           fsdp__tcp_server_t **out, char *err, size_t errcap) {
    *out = NULL;
    if (port < 0 || port > 65535)
        return fail(err, errcap, FSDP_EINVAL, "tcp store server: port %d is outside 0..65535",
                    port);
    struct fsdp__tcp_server *s = calloc(1, sizeof *s);
    if (!s) return fail(err, errcap, FSDP_ENOMEM, "tcp store server: out of memory");
    if (key && key->len) s->key = *key;
    s->lfd = s->wake[0] = s->wake[1] = -1;
    s->nbuckets = 1024;
    s->buckets = calloc(s->nbuckets, sizeof *s->buckets);
    if (!s->buckets || pipe2(s->wake, O_CLOEXEC) < 0) {
        free_server(s);
        return fail(err, errcap, FSDP_ENOMEM, "tcp store server: out of memory or descriptors");
    }
    int rc = listen_on(host, port, &s->lfd, err, errcap);
    if (rc < 0) {
        free_server(s);
        return rc;
    }
    struct sockaddr_storage a;
    socklen_t alen = sizeof a;
    getsockname(s->lfd, (struct sockaddr *)&a, &alen);
    s->port = ntohs(a.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&a)->sin6_port
                                            : ((struct sockaddr_in *)&a)->sin_port);
    /* The thread takes no signals: they stay with the host's own threads. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int e = pthread_create(&s->thread, NULL, loop, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (e != 0) {
        free_server(s);
        return fail(err, errcap, FSDP_EBACKEND, "tcp store server: cannot start its thread: %s",
                    strerror(e));
    }
    *out = s;
    return 0;
}

unsigned long fsdp__tcp_server_rejected(const fsdp__tcp_server_t *s) {
    return s ? __atomic_load_n(&s->rejected, __ATOMIC_RELAXED) : 0;
}

int fsdp__tcp_server_port(const fsdp__tcp_server_t *s) {
    return s ? s->port : -1;
}

void fsdp__tcp_server_stop(fsdp__tcp_server_t *s) {
    if (!s) return;
    char b = 1;
    while (write(s->wake[1], &b, 1) < 0 && errno == EINTR) {
    }
    pthread_join(s->thread, NULL);
    free_server(s);
}
