/* SPDX-License-Identifier: MIT */
/*
 * gloo_shm_impl.h: what the two halves of the shared-memory transport share: the segment's
 * header and the group's state (gloo_shm_create.c makes them, gloo_shm.c runs collectives on
 * them), and the cross-memory read both use. Private to backends/gloo/.
 */
#ifndef FSDP_GLOO_SHM_IMPL_H
#define FSDP_GLOO_SHM_IMPL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "backends/gloo/gloo_shm.h"

struct shm_hdr {
    uint32_t magic, size;
    uint64_t slot;
    _Alignas(64) _Atomic uint32_t gen;
    _Alignas(64) _Atomic uint32_t count;
    _Alignas(64) _Atomic uint32_t closed; /* 1 + the rank that closed the group; 0 while open */
};

struct fsdp_gloo_shm {
    int rank, size;
    size_t slot;  /* bytes per slot */
    size_t bytes; /* of the mapping */
    struct shm_hdr *h;
    int32_t *pid;   /* [size] */
    uint64_t *addr; /* [size]: each rank's send buffer of the collective in progress (CMA) */
    char *slots;    /* size * slot */
    char *result;   /* slot */
    int cma;        /* peers' send buffers are read in place (process_vm_readv) */
    int spin;       /* pause iterations a barrier's waiter spins before it sleeps */
    uint64_t probe; /* what a peer's probe reads from this rank's memory */
    /* Processor time this rank took to read CAL_BYTES from its next peer in place and to copy
     * them locally, best of CAL_REPS - 1 (ns); 0 when not measured. */
    int64_t cal_read_ns, cal_copy_ns;
};

/* The spin of a barrier's waiter when it may have a core to itself (gloo_shm_create.c). */
#define FSDP__GLOO_SHM_SPIN 4000

/* Reads bytes from address `from` of process pid into dst (process_vm_readv, in as many calls
 * as the kernel needs). Returns 0, or -1 with errno. */
int fsdp__gloo_shm_cma_read(pid_t pid, void *dst, uint64_t from, size_t bytes);

/* Unmaps s's segment (if mapped) and frees s. */
void fsdp__gloo_shm_unmap(fsdp_gloo_shm_t *s);

#endif /* FSDP_GLOO_SHM_IMPL_H */
