/* SPDX-License-Identifier: MIT */
/*
 * store_tcp_proto.h: the wire protocol of the TCP store (docs/design.md, "The TCP store"), shared
 * by its client (store_tcp.c) and its server (store_tcp_server.c), and the server's interface.
 *
 * The server file depends on nothing but libc, pthreads and the FSDP_E* codes, so that fsdprun,
 * which links no libfsdp, compiles it in to serve the store of a multi-node job.
 *
 * Both sides start by sending the 8 bytes of TCP_MAGIC; then the client sends requests and the
 * server answers each one, in order. Integers are big-endian.
 *
 *   request:  op (1 byte) | key length (2) | key | op-specific part
 *             'S' set:    value length (4) | value
 *             'G' get:    nothing
 *             'A' add:    delta (8, two's complement)
 *             'C' check:  nothing
 *   reply:    status (1 byte) | status-specific part
 *             TCP_OK on get: value length (4) | value;  on add: the new value (8)
 *             TCP_MISSING (get, check), TCP_NOT_COUNTER (add), TCP_FULL (set, add): nothing
 *             TCP_BAD: nothing, and the server closes the connection.
 *
 * A key has 1..TCP_MAX_KEY bytes and a value at most TCP_MAX_VALUE; anything else is TCP_BAD.
 *
 * A server given the job's key (FSDP_STORE_KEY_FILE, store_tcp_auth.c) greets with
 * TCP_AUTH_MAGIC and a nonce Ns instead, and takes only a client whose hello is TCP_AUTH_MAGIC,
 * a nonce Nc and HMAC-SHA256(key, "C" | Ns | Nc); it answers HMAC-SHA256(key, "S" | Ns | Nc),
 * which the client checks, and closes the connection of a client that fails. The client reads
 * the greeting first and refuses a server that does not ask for the key it holds.
 */
#ifndef FSDP_STORE_TCP_PROTO_H
#define FSDP_STORE_TCP_PROTO_H

#include <stddef.h>
#include <stdint.h>

#define TCP_MAGIC "FSDPTCP1"
#define TCP_MAGIC_LEN 8
#define TCP_MAX_KEY 1024                /* bytes of a key (the front end's keys are < 512) */
#define TCP_MAX_VALUE (64u << 20)       /* bytes of one value */
#define TCP_MAX_TOTAL ((size_t)1 << 30) /* bytes of all keys and values the server holds */
#define TCP_MAX_CONNS 4096              /* connections the server keeps at once */

enum { TCP_OK = 0, TCP_MISSING = 1, TCP_NOT_COUNTER = 2, TCP_FULL = 3, TCP_BAD = 4 };

#define TCP_AUTH_MAGIC "FSDPTCPA"
#define TCP_NONCE 32
#define TCP_PROOF 32
#define TCP_GREET_AUTH (TCP_MAGIC_LEN + TCP_NONCE)             /* a keyed server's greeting */
#define TCP_HELLO_AUTH (TCP_MAGIC_LEN + TCP_NONCE + TCP_PROOF) /* a keyed client's hello */
#define TCP_KEY_MIN 16   /* bytes of a key file */
#define TCP_KEY_MAX 1024

/* The job's key for the TCP store; len 0: none. */
typedef struct fsdp__tcp_key {
    size_t len;
    unsigned char bytes[TCP_KEY_MAX];
} fsdp__tcp_key_t;

/*
 * Loads the key named by FSDP_STORE_KEY_FILE (store_tcp_auth.c): FSDP_OK with key->len 0 when
 * the variable is unset or empty; FSDP_OK with the key; else FSDP_EINVAL (the file is not a
 * regular file of the user's, readable by nobody else, of TCP_KEY_MIN..TCP_KEY_MAX bytes),
 * FSDP_EBACKEND (it cannot be read) or FSDP_ENOTSUP (built without libcrypto), with why
 * naming the variable, the path and the fault.
 */
int fsdp__tcp_key_from_env(fsdp__tcp_key_t *key, char *why, size_t cap);
/* The same for a given path. */
int fsdp__tcp_key_load(const char *path, fsdp__tcp_key_t *key, char *why, size_t cap);
/* n random bytes from the kernel; 0 or -1. */
int fsdp__tcp_nonce(unsigned char *p, size_t n);
/* HMAC-SHA256(key, label | ns | nc) into out; 0 or -1. */
int fsdp__tcp_proof(const fsdp__tcp_key_t *key, char label, const unsigned char *ns,
                    const unsigned char *nc, unsigned char out[TCP_PROOF]);
/* 1 when `got` is the proof for (label, ns, nc), compared in constant time; else 0. */
int fsdp__tcp_proof_ok(const fsdp__tcp_key_t *key, char label, const unsigned char *ns,
                       const unsigned char *nc, const unsigned char *got);

typedef struct fsdp__tcp_server fsdp__tcp_server_t;

/*
 * Starts a server on host:port (host NULL or "" listens on every interface; port 0 picks a free
 * port) in a thread of its own; with a key (non-NULL, len > 0), only clients that prove they hold
 * it are served. Returns 0, or a negative FSDP_E* code with the reason in err
 * (errcap bytes): FSDP_EINVAL for a bad port or a host that does not resolve, FSDP_EBACKEND when
 * the address cannot be bound (the message names host:port and the system's reason).
 */
int fsdp__tcp_server_start(const char *host, int port, const fsdp__tcp_key_t *key,
                           fsdp__tcp_server_t **out, char *err, size_t errcap);

/* Clients the server turned away for a missing or wrong proof of the key. */
unsigned long fsdp__tcp_server_rejected(const fsdp__tcp_server_t *s);

/* The port the server listens on. */
int fsdp__tcp_server_port(const fsdp__tcp_server_t *s);

/* Stops the server: closes every connection and the listening socket, joins the thread and
 * frees everything. Returns within milliseconds whatever the clients do. NULL is accepted. */
void fsdp__tcp_server_stop(fsdp__tcp_server_t *s);

#endif /* FSDP_STORE_TCP_PROTO_H */
