/* SPDX-License-Identifier: MIT */
/*
 * nccl_pg_impl.h: what the two files of the NCCL group share: the group, its queue of ops and
 * the rank's order over its groups (nccl_pg.c: the backend entries, creation, sub-groups;
 * nccl_exec.c: error translation, enqueueing a collective on the communication stream, and the
 * watchdog that completes, copies back and fails ops in order).
 */
#ifndef FSDP_NCCL_PG_IMPL_H
#define FSDP_NCCL_PG_IMPL_H

#include <cuda_runtime.h>
#include "backends/nccl/nccl_inc.h"

#include <pthread.h>
#include <stdint.h>

#include "backends/nccl/nccl_map.h"
#include "pg/pg_impl.h"

/* The watchdog's polling interval while a collective runs. */
#define POLL_NS 50000

typedef struct nccl_op {
    fsdp_work_t *w;
    cudaEvent_t end;
    int64_t head_ns; /* when it reached the head of the queue (0: not yet) */
    void *stage;     /* device copy of the host buffers (cudaMallocAsync), or NULL */
    void *back_host; /* host recv to copy back into once complete, or NULL */
    const void *back_dev;
    size_t back_bytes;
    int fail_rc; /* enqueueing failed: fail the group when this op reaches the head */
    char fail_msg[FSDP_ERR_LEN];
    struct nccl_op *next;
} nccl_op_t;

struct nccl_pg;

/* The rank's order over its NCCL groups (fsdp/pg.h: a rank's collectives run in the order it
 * issued them, over all its groups, like one CUDA stream). Shared by the NCCL groups of one
 * context (a shared state of the context); last is guarded by mu. */
typedef struct nccl_rank {
    pthread_mutex_t mu;
    struct nccl_pg *last; /* the group of the rank's last collective, or NULL */
} nccl_rank_t;

typedef struct nccl_pg {
    fsdp_pg_t base;
    nccl_rank_t *rk;
    cudaEvent_t last_ev; /* recorded after the group's last collective */
    int device;
    ncclComm_t comm;    /* NULL once aborted */
    cudaStream_t cs;    /* the communication stream */
    cudaStream_t xs;    /* the watchdog's copy-back stream */
    unsigned char *one; /* a device byte for barrier */
    pthread_mutex_t mu;
    pthread_cond_t cv;   /* wakes the watchdog */
    pthread_cond_t idle; /* broadcast when the queue becomes empty */
    nccl_op_t *head, *tail;
    int stop;
    int broken_rc; /* sticky failure (0: none) and its message, guarded by mu */
    char broken_msg[FSDP_ERR_LEN];
    int started;
    pthread_t thread;
} nccl_pg_t;

/* ---- defined in nccl_exec.c ---------------------------------------------------------------- */

/* CUDA's and NCCL's statuses as libfsdp's (the one translation): the message goes to msg. */
int fsdp__nccl_cuda_err(cudaError_t e, const char *what, char *msg, size_t cap);
int fsdp__nccl_err(ncclResult_t r, ncclComm_t comm, const char *what, char *msg, size_t cap);
int fsdp__nccl_is_plain_host(const void *p);
int fsdp__nccl_enqueue(nccl_pg_t *gp, nccl_op_t *op, const fsdp_nccl_plan_t *plan, char *msg,
                       size_t cap);
void fsdp__nccl_describe(const nccl_pg_t *gp, const fsdp_coll_t *c, char *buf, size_t cap);
void *fsdp__nccl_watchdog_main(void *arg);
/* Waits until comm's pending operation (init, split, finalize, a call that returned
 * ncclInProgress) is over, at most until deadline_ns; ncclInProgress when the deadline passed. */
ncclResult_t fsdp__nccl_comm_settle(ncclComm_t comm, int64_t deadline_ns);
/* The monotonic time ms milliseconds from now, in ns. */
int64_t fsdp__nccl_deadline_after(int64_t ms);

#endif /* FSDP_NCCL_PG_IMPL_H */
