/* SPDX-License-Identifier: MIT */
/*
 * t_gloo_mesh.c: the Gloo backend's connections prove they belong to the job (issue 26, item 1,
 * "peers authenticate"; backends/gloo/gloo_mesh.h).
 *
 * Ranks are threads, each with its own context, over one in-memory store. Before the other
 * ranks start, strangers reach rank 0's listener first, the way the racing stranger of
 * t_fsdprun_netns.sh does: one stays silent, one sends garbage, one sends a hello for a rank that
 * does not exist, one sends a good hello and a made-up proof, and one runs the whole protocol
 * with a key of its own. Every one is dropped and logged, the listener keeps waiting, and the
 * group still forms, each socket leading to the rank it claims. Then: two ranks with different
 * keys never connect, and say why; the key is the same on every rank; and a whole Gloo world
 * made with a stranger holding rank 0's listener runs an all-reduce.
 */
#define _GNU_SOURCE

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <fsdp.h>

#include "backends/gloo/gloo_mesh.h"
#include "tap.h"

#define N 3
#define TIMEOUT_MS 20000

typedef struct rank_run {
    pthread_t thread;
    int rank, size;
    fsdp_store_t *store;
    uint8_t key[FSDP_GLOO_KEY_BYTES];
    int64_t timeout_ms;
    int fds[N];
    int dropped, rc;
    char msg[512];
    /* what the log sink saw */
    pthread_mutex_t mu;
    int warnings;
    char log[8][400];
} rank_run_t;

static void sink(void *user, int rank, fsdp_log_level_t level, const char *msg) {
    rank_run_t *r = user;
    pthread_mutex_lock(&r->mu);
    if (level == FSDP_LOG_WARN && r->warnings < 8)
        snprintf(r->log[r->warnings++], sizeof r->log[0], "%s", msg);
    pthread_mutex_unlock(&r->mu);
}

static void *rank_main(void *arg) {
    rank_run_t *r = arg;
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    o.rank = r->rank;
    o.world_size = r->size;
    fsdp_ctx_t *ctx = NULL;
    r->rc = fsdp_ctx_create(&o, &ctx);
    if (r->rc < 0) return NULL;
    fsdp_ctx_set_log_sink(ctx, sink, r);
    struct sockaddr_in addr = {.sin_family = AF_INET};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    r->rc = fsdp__gloo_mesh_connect(ctx, r->store, r->rank, r->size, (struct sockaddr *)&addr,
                                    sizeof addr, r->key, r->timeout_ms, r->fds, &r->dropped, r->msg,
                                    sizeof r->msg);
    fsdp_ctx_destroy(ctx);
    return NULL;
}

static void start(rank_run_t *r, fsdp_store_t *shared, int rank, int size, const uint8_t *key,
                  int64_t timeout_ms) {
    memset(r, 0, sizeof *r);
    pthread_mutex_init(&r->mu, NULL);
    r->rank = rank;
    r->size = size;
    r->timeout_ms = timeout_ms;
    memcpy(r->key, key, FSDP_GLOO_KEY_BYTES);
    fsdp_store_clone(shared, NULL, &r->store);
    pthread_create(&r->thread, NULL, rank_main, r);
}

static void finish(rank_run_t *r) {
    pthread_join(r->thread, NULL);
    fsdp_store_destroy(r->store);
    pthread_mutex_destroy(&r->mu);
}

/* Where rank q of the mesh on `store` listens (waits for it). */
static int mesh_addr(fsdp_store_t *store, int q, struct sockaddr_in *out) {
    char key[32], value[96], host[64];
    size_t len = 0;
    int family, port;
    snprintf(key, sizeof key, "mesh/%d", q);
    if (fsdp_store_get(store, key, value, sizeof value - 1, &len) < 0) return -1;
    value[len < sizeof value ? len : sizeof value - 1] = '\0';
    if (sscanf(value, "%d %63s %d", &family, host, &port) != 3 || family != 4) return -1;
    memset(out, 0, sizeof *out);
    out->sin_family = AF_INET;
    out->sin_port = htons((uint16_t)port);
    return inet_pton(AF_INET, host, &out->sin_addr) == 1 ? 0 : -1;
}

static int dial(const struct sockaddr_in *a) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd >= 0 && connect(fd, (const struct sockaddr *)a, sizeof *a) == 0) return fd;
    if (fd >= 0) close(fd);
    return -1;
}

/* Reads n bytes within 5 s: 1 when all came, 0 on end of file, -1 otherwise. */
static int read_n(int fd, void *p, size_t n) {
    size_t got = 0;
    while (got < n) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        if (poll(&pfd, 1, 5000) <= 0) return -1;
        ssize_t r = recv(fd, (char *)p + got, n - got, 0);
        if (r == 0) return 0;
        if (r < 0) return -1;
        got += (size_t)r;
    }
    return 1;
}

static void hello(uint8_t h[56], uint32_t from, uint32_t to, uint32_t size) {
    memset(h, 0, 56);
    memcpy(h, "FSDPMSH1", 8);
    h[8] = 1;
    for (int i = 0; i < 4; i++) {
        h[12 + i] = (uint8_t)(from >> (24 - 8 * i));
        h[16 + i] = (uint8_t)(to >> (24 - 8 * i));
        h[20 + i] = (uint8_t)(size >> (24 - 8 * i));
    }
    for (int i = 24; i < 56; i++)
        h[i] = (uint8_t)(i * 7 + 3);
}

/* A stranger who speaks the protocol: sends a hello from rank 1, reads the challenge, and
 * answers with HMAC under `key` (its own, not the job's) or with made-up bytes (key NULL).
 * Returns 1 when the listener then closed the connection without accepting it. */
static int forge(const struct sockaddr_in *a, const uint8_t *key) {
    int fd = dial(a);
    if (fd < 0) return 0;
    uint8_t h[56], ch[64], proof[32], data[1 + 56 + 32], ack;
    hello(h, 1, 0, N);
    int closed = 0;
    if (send(fd, h, sizeof h, MSG_NOSIGNAL) == (ssize_t)sizeof h &&
        read_n(fd, ch, sizeof ch) == 1) {
        memset(proof, 0x5a, sizeof proof);
        if (key) {
            unsigned len = 0;
            data[0] = 'C';
            memcpy(data + 1, h, 56);
            memcpy(data + 57, ch, 32);
            HMAC(EVP_sha256(), key, FSDP_GLOO_KEY_BYTES, data, sizeof data, proof, &len);
        }
        if (send(fd, proof, sizeof proof, MSG_NOSIGNAL) == (ssize_t)sizeof proof)
            closed = read_n(fd, &ack, 1) == 0;
    }
    close(fd);
    return closed;
}

/* Each rank sends its number on every socket and reads the peer's: the socket to q must lead
 * to q. */
static int sockets_lead_to_claimed_ranks(rank_run_t *r, int n) {
    for (int a = 0; a < n; a++)
        for (int q = 0; q < n; q++) {
            if (q == a) continue;
            unsigned char me = (unsigned char)a;
            if (r[a].fds[q] < 0 || send(r[a].fds[q], &me, 1, MSG_NOSIGNAL) != 1) return 0;
        }
    for (int a = 0; a < n; a++)
        for (int q = 0; q < n; q++) {
            unsigned char got = 0xff;
            if (q == a) continue;
            if (read_n(r[a].fds[q], &got, 1) != 1 || got != q) return 0;
        }
    return 1;
}

static int logged(rank_run_t *r, const char *what) {
    for (int i = 0; i < r->warnings; i++)
        if (strstr(r->log[i], what) && strstr(r->log[i], "did not prove it belongs")) return 1;
    return 0;
}

static void strangers_first(void) {
    fsdp_store_t *store = NULL;
    fsdp_store_create_memory(NULL, &store);
    fsdp_store_set_timeout(store, TIMEOUT_MS);
    uint8_t key[FSDP_GLOO_KEY_BYTES], other[FSDP_GLOO_KEY_BYTES];
    char msg[256];
    int rc = fsdp__gloo_mesh_key(store, 0, key, msg, sizeof msg);
    for (size_t i = 0; i < sizeof other; i++)
        other[i] = (uint8_t)(key[i] ^ 0x01);
    tap_ok(rc == FSDP_OK, "rank 0 draws the job's key and publishes it in the store");

    rank_run_t r[N];
    start(&r[0], store, 0, N, key, TIMEOUT_MS);
    struct sockaddr_in a0;
    int have = mesh_addr(store, 0, &a0) == 0;
    tap_ok(have, "rank 0 publishes where it listens (mesh/0)");

    /* The strangers, all before ranks 1 and 2 exist. */
    int silent = have ? dial(&a0) : -1;
    int garbage = have ? dial(&a0) : -1;
    if (garbage >= 0) {
        char junk[56];
        memset(junk, 'x', sizeof junk);
        if (send(garbage, junk, sizeof junk, MSG_NOSIGNAL) != (ssize_t)sizeof junk) garbage = -1;
    }
    int nowhere = have ? dial(&a0) : -1;
    if (nowhere >= 0) {
        uint8_t h[56];
        hello(h, 7, 0, N);
        if (send(nowhere, h, sizeof h, MSG_NOSIGNAL) != (ssize_t)sizeof h) nowhere = -1;
    }
    int made_up = have && forge(&a0, NULL);
    int wrong_key = have && forge(&a0, other);
    tap_ok(silent >= 0 && garbage >= 0 && nowhere >= 0,
           "three strangers hold connections to rank 0");
    tap_ok(made_up, "a stranger with a good hello but a made-up proof is turned away");
    tap_ok(wrong_key, "a stranger that runs the protocol with a key of its own is turned away");

    for (int q = 1; q < N; q++)
        start(&r[q], store, q, N, key, TIMEOUT_MS);
    for (int q = 0; q < N; q++)
        finish(&r[q]);
    int ok = 1;
    for (int q = 0; q < N; q++)
        if (r[q].rc != FSDP_OK) {
            ok = 0;
            tap_diag("rank %d: %s", q, r[q].msg);
        }
    tap_ok(ok, "with five strangers first at rank 0's listener, all %d ranks connect", N);
    tap_ok(ok && sockets_lead_to_claimed_ranks(r, N),
           "each rank's socket to rank q leads to rank q");
    tap_is_int(r[0].dropped, 5, "rank 0 dropped and counted the five strangers");
    tap_is_int(r[1].dropped + r[2].dropped, 0, "ranks 1 and 2 dropped nothing");
    tap_ok(logged(&r[0], "no hello yet") && logged(&r[0], "not a libfsdp hello") &&
               logged(&r[0], "another rank or group") && logged(&r[0], "a wrong proof"),
           "rank 0 logged each dropped connection with its reason (%d warnings)", r[0].warnings);
    for (int i = 0; i < r[0].warnings; i++)
        tap_diag("rank 0: %s", r[0].log[i]);
    int closed = 1;
    char c;
    if (garbage >= 0) closed &= read_n(garbage, &c, 1) == 0;
    if (nowhere >= 0) closed &= read_n(nowhere, &c, 1) == 0;
    tap_ok(closed, "the strangers' connections were closed by rank 0");
    for (int q = 0; q < N; q++)
        for (int p = 0; p < N; p++)
            if (r[q].fds[p] >= 0) close(r[q].fds[p]);
    if (silent >= 0) close(silent);
    if (garbage >= 0) close(garbage);
    if (nowhere >= 0) close(nowhere);
    fsdp_store_destroy(store);
}

static void different_keys(void) {
    fsdp_store_t *store = NULL;
    fsdp_store_create_memory(NULL, &store);
    uint8_t k0[FSDP_GLOO_KEY_BYTES], k1[FSDP_GLOO_KEY_BYTES];
    memset(k0, 1, sizeof k0);
    memset(k1, 2, sizeof k1);
    rank_run_t r[2];
    start(&r[0], store, 0, 2, k0, 1500);
    start(&r[1], store, 1, 2, k1, 1500);
    finish(&r[0]);
    finish(&r[1]);
    tap_ok(r[0].rc == FSDP_ETIMEDOUT && r[1].rc == FSDP_ETIMEDOUT,
           "two ranks with different keys never connect: both time out (%s, %s)",
           fsdp_err_name(r[0].rc), fsdp_err_name(r[1].rc));
    tap_ok_why(strstr(r[1].msg, "rank 0") && strstr(r[1].msg, "different key"), r[1].msg,
               "the connecting rank names the rank and the reason");
    tap_ok_why(r[0].dropped >= 1 && strstr(r[0].msg, "rank 1"), r[0].msg,
               "the listening rank names the rank it waited for and dropped the attempts (%d)",
               r[0].dropped);
    fsdp_store_destroy(store);
}

static void key_agreement(void) {
    fsdp_store_t *store = NULL, *s1 = NULL;
    fsdp_store_create_memory(NULL, &store);
    fsdp_store_clone(store, NULL, &s1);
    uint8_t k0[FSDP_GLOO_KEY_BYTES], k1[FSDP_GLOO_KEY_BYTES], zero[FSDP_GLOO_KEY_BYTES] = {0};
    char msg[256];
    int rc0 = fsdp__gloo_mesh_key(store, 0, k0, msg, sizeof msg);
    int rc1 = fsdp__gloo_mesh_key(s1, 1, k1, msg, sizeof msg);
    tap_ok(rc0 == FSDP_OK && rc1 == FSDP_OK && memcmp(k0, k1, sizeof k0) == 0 &&
               memcmp(k0, zero, sizeof k0) != 0,
           "every rank reads the same non-zero key");
    fsdp_store_set(store, "auth.key", "short", 5);
    rc1 = fsdp__gloo_mesh_key(s1, 1, k1, msg, sizeof msg);
    tap_ok_why(rc1 == FSDP_EBACKEND && strstr(msg, "5 bytes"), msg,
               "a key of the wrong length in the store is refused");
    fsdp_store_destroy(s1);
    fsdp_store_destroy(store);
}

int main(void) {
    if (!fsdp_gloo_available()) {
        printf("1..0 # SKIP libfsdp was built without Gloo\n");
        return 0;
    }
    tap_plan_lazy();
    key_agreement();
    strangers_first();
    different_keys();
    return tap_done();
}
