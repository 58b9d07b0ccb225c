/* SPDX-License-Identifier: MIT */
/*
 * gloo_mesh.h: the authenticated connections of a Gloo group (issue 26, "peers authenticate").
 *
 * Debian's Gloo gives each pair of ranks a listening socket that accepts whoever connects
 * first, with no proof of who it is. The gloo backend therefore makes every connection itself
 * and hands Gloo only sockets whose other end proved it belongs to the job:
 *
 *   - the job's key: 32 random bytes that rank 0 of the world makes and publishes in the store,
 *     the one thing the ranks already trust (a private directory, a Redis server with AUTH);
 *   - per group, each rank listens on the group's address (backlog 128, port 0), publishes
 *     "mesh/<rank>" = "<family> <address> <port>", connects to every lower rank and accepts
 *     every higher one;
 *   - on each connection, a challenge-response in both directions with HMAC-SHA256 under the
 *     key (docs/design.md, "Who can reach a rank", has the messages). A connection that fails
 *     it (garbage, silence, a wrong proof, a rank out of range) is dropped, counted and logged,
 *     and the listener keeps waiting; a real peer whose attempt failed tries again.
 *
 * The result is one connected socket per peer, given to gloo_comm.cc, which makes Gloo pairs of
 * them. Transport code only: the backend's C side (gloo_pg.c) calls it once per group.
 */
#ifndef FSDP_GLOO_MESH_H
#define FSDP_GLOO_MESH_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include <fsdp/context.h>
#include <fsdp/store.h>

#define FSDP_GLOO_KEY_BYTES 32

/*
 * The job's key, from `store` (a world group's rendezvous store): rank 0 draws it from the
 * kernel's random source and publishes it under "auth.key"; the other ranks wait for it.
 * Returns FSDP_OK, or a status with the reason in msg.
 */
int fsdp__gloo_mesh_key(fsdp_store_t *store, int rank, uint8_t key[FSDP_GLOO_KEY_BYTES], char *msg,
                        size_t cap);

/*
 * Connects `rank` of a group of `size` to every other rank, through `store` (the group's own
 * rendezvous store), listening on `addr` (its port is ignored). Waits at most timeout_ms. On
 * success fds[q] is a connected socket to rank q, whose peer proved it holds `key`
 * (fds[rank] = -1), and the caller owns them. *dropped counts the connections that failed the
 * proof; each of the first few is logged as a warning through ctx (may be NULL). On failure
 * every socket is closed and msg says which ranks were never connected.
 */
int fsdp__gloo_mesh_connect(const fsdp_ctx_t *ctx, fsdp_store_t *store, int rank, int size,
                            const struct sockaddr *addr, socklen_t addrlen,
                            const uint8_t key[FSDP_GLOO_KEY_BYTES], int64_t timeout_ms, int *fds,
                            int *dropped, char *msg, size_t cap);

#endif /* FSDP_GLOO_MESH_H */
