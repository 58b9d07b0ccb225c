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

typedef struct fsdp__tcp_server fsdp__tcp_server_t;

/*
 * Starts a server on host:port (host NULL or "" listens on every interface; port 0 picks a free
 * port) in a thread of its own. Returns 0, or a negative FSDP_E* code with the reason in err
 * (errcap bytes): FSDP_EINVAL for a bad port or a host that does not resolve, FSDP_EBACKEND when
 * the address cannot be bound (the message names host:port and the system's reason).
 */
int fsdp__tcp_server_start(const char *host, int port, fsdp__tcp_server_t **out, char *err,
                           size_t errcap);

/* The port the server listens on. */
int fsdp__tcp_server_port(const fsdp__tcp_server_t *s);

/* Stops the server: closes every connection and the listening socket, joins the thread and
 * frees everything. Returns within milliseconds whatever the clients do. NULL is accepted. */
void fsdp__tcp_server_stop(fsdp__tcp_server_t *s);

#endif /* FSDP_STORE_TCP_PROTO_H */
