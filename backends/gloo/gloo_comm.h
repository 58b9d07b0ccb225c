/* SPDX-License-Identifier: MIT */
/*
 * gloo_comm.h: the C interface of the Gloo transport (gloo_comm.cc, the only C++ in libfsdp).
 *
 * The backend is split in two along the language line. gloo_pg.c (C) implements the
 * process-group vtable: the per-rank worker thread and its queue, sticky failures, the mismatch
 * check and the messages; gloo_mesh.c (C) makes the group's authenticated connections.
 * gloo_comm.cc (C++) owns the Gloo objects of one group (a tcp device, a gloo::Context and its
 * pairs over those connections) and runs one collective at a time on them. Every
 * function below catches every C++ exception and turns it into a status code, a message and,
 * where Gloo's message names a peer's address, that peer's rank; nothing escapes into C.
 *
 * Only plain C types cross this interface, so gloo_comm.cc never sees libfsdp's internal
 * structures (internal.h uses C11 atomics, which C++ cannot compile).
 *
 * Thread-safety: one comm is used by one thread at a time (the rank's execution slot); creation
 * of a sub-group's comm may run while the parent's device serves other comms.
 */
#ifndef FSDP_GLOO_COMM_H
#define FSDP_GLOO_COMM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include <fsdp/dtype.h>
#include <fsdp/errno.h>
#include <fsdp/pg.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fsdp_gloo_comm fsdp_gloo_comm_t;

/* One collective, with the meanings of fsdp/pg.h. */
typedef struct fsdp_gloo_op {
    fsdp_coll_kind_t kind;
    const void *send;
    void *recv;
    size_t count; /* elements per rank */
    fsdp_dtype_t dtype;
    fsdp_redop_t op;
    double prescale; /* sums: 0, or each input is multiplied by it first (pg.h) */
    int root;
    uint32_t tag;       /* the same on every rank; the low bits of the sequence number */
    int64_t timeout_ms; /* bounds every wait of the collective */
} fsdp_gloo_op_t;

/* The address Gloo's tcp device would use for `iface` (when non-NULL and non-empty) or
 * `hostname` (NULL or empty: 127.0.0.1), resolved as Gloo resolves it. */
int fsdp__gloo_resolve(const char *hostname, const char *iface, struct sockaddr_storage *addr,
                       socklen_t *addrlen, char *msg, size_t cap);

/*
 * Creates the comm of a world group: a tcp device on `iface` or `hostname` and a context of
 * `size` ranks whose pair with rank q is the connected socket fds[q] (fds[rank] is ignored), as
 * gloo_mesh.c made them. The comm takes every socket over, also on failure (each fds[q] is then
 * -1). Returns FSDP_OK, or a status with its reason in msg (cap bytes).
 */
int fsdp__gloo_comm_create(int rank, int size, const char *hostname, const char *iface, int *fds,
                           int64_t timeout_ms, fsdp_gloo_comm_t **out, char *msg, size_t cap);

/* Creates the comm of a sub-group on the parent's device, with its own context and pairs over
 * fds, as fsdp__gloo_comm_create. */
int fsdp__gloo_comm_create_sub(fsdp_gloo_comm_t *parent, int rank, int size, int *fds,
                               int64_t timeout_ms, fsdp_gloo_comm_t **out, char *msg, size_t cap);

/*
 * Runs one collective to completion. count must be > 0 for data collectives (the caller handles
 * empty ones). Returns FSDP_OK, or FSDP_ETIMEDOUT, FSDP_EREMOTE, FSDP_ENOMEM or FSDP_EBACKEND
 * with Gloo's reason in msg and, when it names a peer's address, the peer's rank in *peer
 * (else -1).
 */
int fsdp__gloo_comm_run(fsdp_gloo_comm_t *comm, const fsdp_gloo_op_t *op, int *peer, char *msg,
                        size_t cap);

/* Peer `peer`'s IP address as seen on our connection to it ("" when unknown), into buf. */
void fsdp__gloo_comm_peer_host(const fsdp_gloo_comm_t *comm, int peer, char *buf, size_t cap);

/* Closes every connection of the comm, so that peers waiting on this rank fail at once. */
void fsdp__gloo_comm_close(fsdp_gloo_comm_t *comm);

/* Frees the comm (closing its connections); NULL is accepted. */
void fsdp__gloo_comm_destroy(fsdp_gloo_comm_t *comm);

#ifdef __cplusplus
}
#endif

#endif /* FSDP_GLOO_COMM_H */
