/* SPDX-License-Identifier: MIT */
/*
 * nccl_id.h: the rendezvous of an NCCL communicator through a store, apart from NCCL.
 *
 * Rank 0 publishes an opaque id (NCCL's ncclUniqueId, 128 bytes) under a key; the others wait
 * for it with the store's timeout and check its length. Nothing here needs NCCL or a GPU, so it
 * is built in every configuration and tested with made-up ids.
 */
#ifndef FSDP_NCCL_ID_H
#define FSDP_NCCL_ID_H

#include <stddef.h>
#include <stdint.h>

#include <fsdp/store.h>

/*
 * Numbers the NCCL worlds created on `store` (the counter "nccl.worlds", as Gloo numbers its
 * own) and returns in *out a clone of store under the prefix "nccl.<n>" for this world's keys,
 * with timeout_ms as its timeout. size is the world size. On failure msg says why.
 */
int fsdp__nccl_world_store(fsdp_store_t *store, int size, int64_t timeout_ms, fsdp_store_t **out,
                           char *msg, size_t cap);

/*
 * Exchanges the id under `key` of `store`: rank 0 sets it from id[0, len), every other rank
 * waits for it (the store's timeout) and copies it into id. A value of another length is
 * FSDP_EBACKEND. On failure msg (cap bytes) names the key and the store's reason.
 */
int fsdp__nccl_id_exchange(fsdp_store_t *store, const char *key, int rank, void *id, size_t len,
                           char *msg, size_t cap);

#endif /* FSDP_NCCL_ID_H */
