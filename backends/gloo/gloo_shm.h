/* SPDX-License-Identifier: MIT */
/*
 * gloo_shm.h: the shared-memory transport of the gloo process group, for a group whose ranks
 * all run on one host.
 *
 * Over TCP loopback every byte of a collective is copied by the kernel twice (into a socket
 * buffer, out of it) and Gloo's event-loop thread competes with the ranks' compute threads for
 * the cores. When every rank of a group sees the same host (the same boot id, IPC namespace and
 * PID namespace), the group also maps one POSIX shared-memory segment: a slot per rank and a
 * result area. A collective then moves through the slots with plain copies and futex barriers,
 * and reduces with fsdp__reduce() in rank order, exactly as the TCP path and the sim backend do,
 * so results are bitwise the same. The Gloo comm stays: it serves FSDP_GLOO_CHECK and stays the
 * way every rank can still be reached.
 *
 * FSDP_GLOO_SHM=0 in the environment keeps every group on TCP. The decision is collective: a
 * group uses the segment only when every rank asked for it, sees the same host and mapped it.
 *
 * Failures: a wait ends with FSDP_ETIMEDOUT after the collective's timeout, or FSDP_EREMOTE
 * naming the peer as soon as a peer process has exited or a peer has closed the group
 * (fsdp__gloo_shm_close, as the TCP path closes its connections).
 *
 * Thread-safety: as gloo_comm.h: one thread at a time per shm (the rank's execution slot).
 */
#ifndef FSDP_GLOO_SHM_H
#define FSDP_GLOO_SHM_H

#include <stddef.h>
#include <stdint.h>

#include <fsdp/pg.h>
#include <fsdp/store.h>

#include "backends/gloo/gloo_comm.h"

typedef struct fsdp_gloo_shm fsdp_gloo_shm_t;

/*
 * Agrees with the other ranks, through `store` (the group's rendezvous store, whose timeout
 * bounds every wait), on whether the group uses shared memory, and maps the segment if so.
 * Returns FSDP_OK with *out set (msg then says whether peers are read in place, and why), or
 * FSDP_OK with *out NULL when the group stays on TCP (msg then says why), or a store failure.
 * msg is for the debug log.
 */
int fsdp__gloo_shm_create(fsdp_store_t *store, int rank, int size, fsdp_gloo_shm_t **out,
                          char *msg, size_t cap);

/* Runs one collective (count > 0, or a barrier), with gloo_comm.h's statuses and *peer. */
int fsdp__gloo_shm_run(fsdp_gloo_shm_t *s, const fsdp_gloo_op_t *op, int *peer, char *msg,
                       size_t cap);

/* 1 when the group reads its peers' buffers in place (cross-memory attach, process_vm_readv):
 * all-gather and reduce-scatter then copy each byte once, by the kernel, instead of into a slot
 * and out of it. Decided at creation by every rank: each reads a word of each peer's memory,
 * and prices a read of its next peer against a local copy (gloo_shm.c). FSDP_GLOO_CMA=0 turns
 * it off, FSDP_GLOO_CMA=1 skips the price. 0 otherwise, and for NULL. */
int fsdp__gloo_shm_cma(const fsdp_gloo_shm_t *s);

/* This rank's prices (processor time, ns) of reading 4 MiB of its next peer in place and of
 * copying 4 MiB locally, 0 when not measured; returns whether they voted for reading in place
 * (1 or 0), or -1 when they were not measured (NULL, FSDP_GLOO_CMA set, or the kernel forbade
 * the reads). */
int fsdp__gloo_shm_cma_price(const fsdp_gloo_shm_t *s, int64_t *read_ns, int64_t *copy_ns);

/* Marks the group closed by this rank, so that peers waiting on it fail at once. */
void fsdp__gloo_shm_close(fsdp_gloo_shm_t *s);

/* Unmaps the segment; NULL is accepted. */
void fsdp__gloo_shm_destroy(fsdp_gloo_shm_t *s);

/* 2 when pg is a gloo group whose collectives go through shared memory and read peers' buffers
 * in place, 1 through shared memory alone, 0 when they go over TCP, -1 when pg is not a gloo
 * group (gloo_pg.c; for tests and the debug log). */
int fsdp__gloo_pg_shm(const fsdp_pg_t *pg);

/* The pause iterations a barrier's waiter spins on s before it sleeps (-1 for NULL), and the
 * same of pg's segment (-1 when pg is not a gloo group on shared memory; gloo_pg.c, for
 * tests). */
int fsdp__gloo_shm_spin(const fsdp_gloo_shm_t *s);
int fsdp__gloo_pg_spin(const fsdp_pg_t *pg);

/* fsdp__gloo_shm_cma_price of pg's segment (-1 with 0 prices when pg is not a gloo group on
 * shared memory; gloo_pg.c, for tests). */
int fsdp__gloo_pg_cma_price(const fsdp_pg_t *pg, int64_t *read_ns, int64_t *copy_ns);

#endif /* FSDP_GLOO_SHM_H */
