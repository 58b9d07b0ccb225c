/* SPDX-License-Identifier: MIT */
/*
 * nccl_id.c: the store side of the NCCL rendezvous (see nccl_id.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/nccl/nccl_id.h"
#include "internal.h"

int fsdp__nccl_world_store(fsdp_store_t *store, int size, int64_t timeout_ms, fsdp_store_t **out,
                           char *msg, size_t cap) {
    *out = NULL;
    /* A rank counts itself before it reads the id of its world, and rank 0 publishes that id
     * only after counting itself, so the counts of world k + 1 all come after those of world k
     * once world k is complete (the Gloo backend numbers its worlds the same way). */
    int64_t n;
    int rc = fsdp_store_add(store, "nccl.worlds", 1, &n);
    if (rc < 0) {
        snprintf(msg, cap, "store: %s", fsdp_store_last_error(store));
        return rc;
    }
    char prefix[48];
    snprintf(prefix, sizeof prefix, "nccl.%lld", (long long)((n - 1) / size));
    fsdp_store_t *mine = NULL;
    rc = fsdp_store_clone(store, prefix, &mine);
    if (rc == FSDP_OK) rc = fsdp_store_set_timeout(mine, timeout_ms);
    if (rc < 0) {
        snprintf(msg, cap, "store: %s", fsdp_store_last_error(mine ? mine : store));
        fsdp_store_destroy(mine);
        return rc;
    }
    *out = mine;
    return FSDP_OK;
}

int fsdp__nccl_id_exchange(fsdp_store_t *store, const char *key, int rank, void *id, size_t len,
                           char *msg, size_t cap) {
    int rc;
    if (rank == 0) {
        rc = fsdp_store_set(store, key, id, len);
        if (rc < 0)
            snprintf(msg, cap, "rank 0 cannot publish the NCCL unique id under '%s': %s", key,
                     fsdp_store_last_error(store));
        return rc;
    }
    unsigned char *buf = malloc(len + 1);
    if (!buf) {
        snprintf(msg, cap, "out of memory");
        return FSDP_ENOMEM;
    }
    size_t got = 0;
    rc = fsdp_store_get(store, key, buf, len + 1, &got);
    if (rc == FSDP_OK && got != len) {
        snprintf(msg, cap,
                 "the NCCL unique id under '%s' has %zu bytes, want %zu (another program or "
                 "NCCL version wrote it?)",
                 key, got, len);
        rc = FSDP_EBACKEND;
    } else if (rc == FSDP_EINVAL && got > len) {
        snprintf(msg, cap, "the NCCL unique id under '%s' has %zu bytes, want %zu", key, got, len);
        rc = FSDP_EBACKEND;
    } else if (rc < 0) {
        snprintf(msg, cap, "rank %d did not get the NCCL unique id from rank 0 under '%s': %s",
                 rank, key, fsdp_store_last_error(store));
    } else {
        memcpy(id, buf, len);
    }
    free(buf);
    return rc;
}
