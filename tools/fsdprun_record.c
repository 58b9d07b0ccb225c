/* SPDX-License-Identifier: MIT */
/*
 * fsdprun_record.c: the failure records of a job on several nodes (issue 26, item 2).
 *
 * A rank killed by a signal prints nothing, and only its own node's fsdprun sees how it ended.
 * So when a rank of this node fails, fsdprun writes one line to the job's store under
 * "fsdprun/failed/<node>": "@MS rank R (host H) failed: CAUSE; its last line: '...'", MS being
 * when it was reaped (ms since the epoch). When the job has failed here, fsdprun also reads the
 * other nodes' records, waiting up to RECORD_WAIT_S for them, and prints each as
 * "fsdprun: node N reports: ...", before its own summary, which names the earliest record
 * older than this node's failure as what came before it (the nodes' clocks agreeing to well
 * under the time a peer's death takes to be noticed, as NTP keeps them).
 *
 * fsdprun links no libfsdp, so it speaks the two stores a multi-node job can have without a
 * server of its own: the TCP store (the one node 0 serves, or a tcp:// --store), through its
 * wire protocol (store_tcp_proto.h), and a file:// store on a shared file system, with the file
 * store's naming (store_file_name.h), its checks of the directory (owned by us, writable by no
 * one else) and its atomic writes (a temporary file renamed over the key). Redis stores get no
 * records: the ranks' own messages are all there is (docs/design.md).
 */
#define _GNU_SOURCE

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "store/store_file_name.h"
#include "tools/fsdprun.h"

#define RECORD_MAX (RECORD_CAP - 1) /* bytes of one record */
#define RECORD_WAIT_S 5.0           /* how long to wait for the other nodes' records */
#define IO_TIMEOUT_MS 2000          /* each connect, send and receive of the TCP client */

typedef struct where {
    int kind;            /* 0: no store records can go to; 1: TCP; 2: file */
    fsdp__tcp_key_t key; /* the TCP store's key (FSDP_STORE_KEY_FILE); len 0: none */
    char host[256];
    int port;
    char dir[PATH_MAX];
} where_t;

/* Where this job's store is, for records. */
static void locate(const job_t *job, where_t *w) {
    memset(w, 0, sizeof *w);
    const char *url = job->opt.store ? job->opt.store : job->store_url;
    if (strncmp(url, "file://", 7) == 0) {
        w->kind = 2;
        snprintf(w->dir, sizeof w->dir, "%s", url + 7);
        return;
    }
    if (strncmp(url, "tcp://", 6) != 0) return;
    const char *h = url + 6, *end;
    if (*h == '[') {
        end = strchr(h, ']');
        if (!end || end[1] != ':') return;
        snprintf(w->host, sizeof w->host, "%.*s", (int)(end - h - 1), h + 1);
        end++;
    } else {
        end = strchr(h, ':');
        if (!end) return;
        snprintf(w->host, sizeof w->host, "%.*s", (int)(end - h), h);
    }
    w->port = atoi(end + 1);
    char why[512];
    if (job->tcp_key.len)
        w->key = job->tcp_key;
    else if (fsdp__tcp_key_from_env(&w->key, why, sizeof why) < 0)
        return; /* the ranks have said why already */
    if (w->port > 0 && w->port < 65536) w->kind = 1;
}

/* ---- the TCP store ------------------------------------------------------------------------ */

static int io_all(int fd, void *p, size_t n, int out) {
    size_t done = 0;
    while (done < n) {
        struct pollfd pfd = {.fd = fd, .events = out ? POLLOUT : POLLIN};
        if (poll(&pfd, 1, IO_TIMEOUT_MS) <= 0) return -1;
        ssize_t r = out ? send(fd, (char *)p + done, n - done, MSG_NOSIGNAL)
                        : recv(fd, (char *)p + done, n - done, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        done += (size_t)r;
    }
    return 0;
}

static int tcp_open(const where_t *w) {
    char port[16];
    snprintf(port, sizeof port, "%d", w->port);
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai = NULL;
    if (getaddrinfo(w->host, port, &hints, &ai) != 0) return -1;
    int fd = -1;
    for (struct addrinfo *a = ai; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) continue;
        struct pollfd pfd = {.fd = fd, .events = POLLOUT};
        int err = 0;
        socklen_t len = sizeof err;
        if ((connect(fd, a->ai_addr, a->ai_addrlen) < 0 && errno != EINPROGRESS) ||
            poll(&pfd, 1, IO_TIMEOUT_MS) <= 0 ||
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0 || err)
            close_fd(&fd);
    }
    freeaddrinfo(ai);
    /* The greeting says whether the server wants the key (store_tcp_proto.h). */
    unsigned char greet[TCP_GREET_AUTH], hello[TCP_HELLO_AUTH], proof[TCP_PROOF];
    if (fd < 0 || io_all(fd, greet, TCP_MAGIC_LEN, 0) < 0) {
        close_fd(&fd);
        return -1;
    }
    unsigned char *ns = greet + TCP_MAGIC_LEN, *nc = hello + TCP_MAGIC_LEN;
    int ok = 0;
    memcpy(hello, TCP_AUTH_MAGIC, TCP_MAGIC_LEN);
    if (memcmp(greet, TCP_MAGIC, TCP_MAGIC_LEN) == 0) {
        ok = !w->key.len && io_all(fd, TCP_MAGIC, TCP_MAGIC_LEN, 1) == 0;
    } else if (memcmp(greet, TCP_AUTH_MAGIC, TCP_MAGIC_LEN) == 0 && w->key.len) {
        ok = io_all(fd, ns, TCP_NONCE, 0) == 0 && fsdp__tcp_nonce(nc, TCP_NONCE) == 0 &&
             fsdp__tcp_proof(&w->key, 'C', ns, nc, nc + TCP_NONCE) == 0 &&
             io_all(fd, hello, sizeof hello, 1) == 0 && io_all(fd, proof, TCP_PROOF, 0) == 0 &&
             fsdp__tcp_proof_ok(&w->key, 'S', ns, nc, proof);
    }
    if (!ok) close_fd(&fd);
    return fd;
}

/* One request: 'S' (value, len) or 'G' (into value, *len = its length). 0, 1 when a get found
 * nothing, -1 on failure. */
static int tcp_request(int fd, char op, const char *key, char *value, size_t *len) {
    uint8_t head[1 + 2 + 64 + 4];
    size_t klen = strlen(key), n = 0;
    head[n++] = (uint8_t)op;
    head[n++] = (uint8_t)(klen >> 8), head[n++] = (uint8_t)klen;
    memcpy(head + n, key, klen);
    n += klen;
    if (op == 'S') {
        head[n++] = (uint8_t)(*len >> 24), head[n++] = (uint8_t)(*len >> 16);
        head[n++] = (uint8_t)(*len >> 8), head[n++] = (uint8_t)*len;
    }
    uint8_t st;
    if (io_all(fd, head, n, 1) < 0 || (op == 'S' && io_all(fd, value, *len, 1) < 0) ||
        io_all(fd, &st, 1, 0) < 0)
        return -1;
    if (op == 'G' && st == TCP_MISSING) return 1;
    if (st != TCP_OK) return -1;
    if (op == 'S') return 0;
    uint8_t l[4];
    if (io_all(fd, l, 4, 0) < 0) return -1;
    size_t vlen = (size_t)l[0] << 24 | (size_t)l[1] << 16 | (size_t)l[2] << 8 | l[3];
    if (vlen > RECORD_MAX || io_all(fd, value, vlen, 0) < 0) return -1;
    *len = vlen;
    return 0;
}

/* ---- the file store ----------------------------------------------------------------------- */

/* The store's directory, checked as the file store checks it. */
static int file_dir(const where_t *w) {
    int dfd = open(w->dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    struct stat st;
    if (dfd >= 0 && (fstat(dfd, &st) < 0 || st.st_uid != geteuid() || (st.st_mode & 022)))
        close_fd(&dfd);
    return dfd;
}

static int file_set(const where_t *w, const char *key, const char *value, size_t len) {
    int dfd = file_dir(w);
    if (dfd < 0) return -1;
    char name[NAME_BYTES + 1], file[NAME_BYTES + 8], tmp[NAME_BYTES + 48];
    fsdp__store_file_name(key, name);
    snprintf(file, sizeof file, "k.%s", name);
    snprintf(tmp, sizeof tmp, "%s.tmp-%ld-rec", file, (long)getpid());
    int fd = openat(dfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    int rc = fd < 0 ? -1 : 0;
    for (size_t done = 0; rc == 0 && done < len;) {
        ssize_t n = write(fd, value + done, len - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0)
            rc = -1;
        else
            done += (size_t)n;
    }
    if (fd >= 0) close(fd);
    if (rc == 0 && renameat(dfd, tmp, dfd, file) < 0) rc = -1;
    if (rc < 0 && fd >= 0) unlinkat(dfd, tmp, 0);
    close(dfd);
    return rc;
}

static int file_get(const where_t *w, const char *key, char *value, size_t *len) {
    int dfd = file_dir(w);
    if (dfd < 0) return -1;
    char name[NAME_BYTES + 1], file[NAME_BYTES + 8];
    fsdp__store_file_name(key, name);
    snprintf(file, sizeof file, "k.%s", name);
    int fd = openat(dfd, file, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    close(dfd);
    if (fd < 0) return errno == ENOENT ? 1 : -1;
    struct stat st;
    ssize_t n = -1;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size <= RECORD_MAX)
        n = read(fd, value, (size_t)st.st_size);
    close(fd);
    if (n < 0) return -1;
    *len = (size_t)n;
    return 0;
}

/* ---- records ------------------------------------------------------------------------------ */

static void record_key(int node, char *key, size_t cap) {
    snprintf(key, cap, "fsdprun/failed/%d", node);
}

void record_failure(const job_t *job) {
    if (job->opt.nnodes < 2 || job->first_fail < 0) return;
    where_t w;
    locate(job, &w);
    if (!w.kind) return;
    const rank_t *f = &job->ranks[job->first_fail];
    char host[256] = "?", cause[64], text[RECORD_MAX + 1], key[48];
    gethostname(host, sizeof host - 1);
    if (WIFEXITED(job->first_status)) {
        snprintf(cause, sizeof cause, "status %d", WEXITSTATUS(job->first_status));
    } else {
        const char *name = signal_name(WTERMSIG(job->first_status));
        snprintf(cause, sizeof cause, "signal %d%s%s%s", WTERMSIG(job->first_status),
                 name ? " (" : "", name ? name : "", name ? ")" : "");
    }
    int n = snprintf(text, sizeof text, "@%lld rank %d (host %s) failed: %s; its last line: %s%s%s",
                     job->first_fail_ms, f->rank, host, cause, f->last[0] ? "'" : "",
                     f->last[0] ? f->last : "none", f->last[0] ? "'" : "");
    size_t len = n < 0 ? 0 : (size_t)n >= sizeof text ? sizeof text - 1 : (size_t)n;
    record_key(job->opt.node_rank, key, sizeof key);
    int rc;
    if (w.kind == 2) {
        rc = file_set(&w, key, text, len);
    } else {
        int fd = tcp_open(&w);
        rc = fd < 0 ? -1 : tcp_request(fd, 'S', key, text, &len);
        if (fd >= 0) close(fd);
    }
    if (rc < 0) say("fsdprun: warning: could not leave this node's failure record in the store");
}

int print_records(job_t *job) {
    if (job->opt.nnodes < 2 || job->first_fail < 0) return 0;
    where_t w;
    locate(job, &w);
    if (!w.kind) return 0;
    int nn = job->opt.nnodes, found = 0, others = nn - 1;
    char *seen = calloc((size_t)nn, 1);
    if (!seen) return 0;
    double until = now_s() + RECORD_WAIT_S;
    long long earliest = -1;
    for (;;) {
        int fd = w.kind == 1 ? tcp_open(&w) : -1;
        if (w.kind == 1 && fd < 0) break; /* the store is gone: node 0 has finished */
        for (int node = 0; node < nn; node++) {
            if (node == job->opt.node_rank || seen[node]) continue;
            char key[48], text[RECORD_MAX + 1];
            size_t len = 0;
            record_key(node, key, sizeof key);
            int rc =
                w.kind == 1 ? tcp_request(fd, 'G', key, text, &len) : file_get(&w, key, text, &len);
            if (rc != 0) continue;
            text[len] = '\0';
            seen[node] = 1;
            found++;
            char *body = text;
            long long at = -1;
            if (text[0] == '@') {
                at = strtoll(text + 1, &body, 10);
                while (*body == ' ')
                    body++;
            }
            say("fsdprun: node %d reports: %s", node, body);
            if (at >= 0 && at < job->first_fail_ms && (earliest < 0 || at < earliest)) {
                earliest = at;
                snprintf(job->first_in_job, sizeof job->first_in_job,
                         "%lld ms earlier, node %d: %s", job->first_fail_ms - at, node, body);
            }
        }
        if (fd >= 0) close(fd);
        if (found == others || now_s() >= until) break;
        usleep(100 * 1000);
    }
    free(seen);
    return found;
}
