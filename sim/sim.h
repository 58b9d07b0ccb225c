/* SPDX-License-Identifier: MIT */
/*
 * sim.h: internals of the sim backend (ranks as threads of one process).
 *
 * A run has one world; every rank has a communication worker (src/pg/pg_worker.h) that executes
 * the rank's collectives, over all its groups, in the order they were issued. Ranks of one group
 * meet in the group's shared state (sim_group_t): each posts a pointer to its descriptor, waits
 * until all have posted (the arrive barrier), moves its share of the data straight between the
 * posted buffers, and waits until all are done (the depart barrier), after which no peer touches
 * its buffers and its work completes.
 */
#ifndef FSDP_SIM_INTERNAL_H
#define FSDP_SIM_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include <fsdp/sim.h>
#include <fsdp/store.h>

#include "device/device_impl.h"
#include "pg/pg_impl.h"
#include "pg/pg_worker.h"

typedef struct sim_world sim_world_t;

/* State shared by the members of one group. */
typedef struct sim_group {
    struct sim_group *next; /* the world's registry */
    char name[96];
    int size;
    int *world_ranks;          /* [size] */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Atomic uint64_t arrive_gen; /* completed arrive barriers (written under mu) */
    _Atomic uint64_t depart_gen; /* completed depart barriers (written under mu) */
    int arrived, departed;
    const fsdp_coll_t **posted; /* [size]: each rank's descriptor for the current collective */
    uint64_t *posted_gen;       /* [size]: arrive_gen at which that rank posted */
    fsdp_device_t **posted_dev; /* [size]: where that rank's buffers live (NULL: host memory) */
    uint64_t mismatch_gen;      /* arrive_gen + 1 of the last mismatched collective */
    char mismatch[2048];
    int broken;                 /* sticky failure: every later collective fails */
    int broken_rc;
    char reason[FSDP_ERR_LEN];
    int attached;               /* members that have a handle (registry lookup stops at size) */
    int refs;                   /* handles alive; guarded by the world's registry lock */
} sim_group_t;

/* One rank of the world. */
typedef struct sim_rank {
    sim_world_t *world;
    int index;                /* world rank */
    fsdp__pg_worker_t worker; /* executes the rank's collectives (fsdp__sim_execute) in order */
    uint64_t calls;           /* collectives executed, for fault indices (by the slot's holder) */
    _Atomic int exited;       /* the rank's fn returned and its groups are gone */
    int exit_status;          /* written before exited is set */
    fsdp_ctx_t *ctx;
    fsdp_store_t *store;
    int status;
} sim_rank_t;

struct sim_world {
    int size;
    const fsdp_sim_fault_t *faults;
    size_t nfaults;
    int64_t latency_ns;     /* simulated latency slept before every collective; 0: none */
    int spin;               /* barriers spin briefly before sleeping: ranks <= online CPUs */
    pthread_mutex_t reg_mu; /* guards the registry and every group's refs/attached */
    sim_group_t *groups;
    fsdp_sim_fn fn;
    void *arg;
    sim_rank_t *ranks; /* [size] */
};

typedef struct sim_pg {
    fsdp_pg_t base;
    sim_world_t *world;
    sim_group_t *grp;
    fsdp_device_t *dev; /* fsdp_sim_pg_set_device(); NULL: buffers are host memory */
} sim_pg_t;

/* Creates rank `rank`'s handle on the group `name` of `size` members (creating the shared state
 * on first use); used for the world group and for sub-groups. */
int fsdp__sim_pg_create(sim_world_t *w, fsdp_ctx_t *ctx, const char *name, int size, int rank,
                        const int *world_ranks, fsdp_pg_t **out);

/* The execute callback of a rank's worker (arg: the sim_rank_t): runs one collective of the
 * rank and completes its work. */
void fsdp__sim_execute(void *arg, fsdp_work_t *work, int on_caller);

/* Wakes every waiter in the groups of world rank `r` (after it exited). */
void fsdp__sim_notify_exit(sim_world_t *w, int r);

#endif /* FSDP_SIM_INTERNAL_H */
