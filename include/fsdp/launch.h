/* SPDX-License-Identifier: MIT */
/*
 * fsdp/launch.h: who am I in a multi-process job? Reading the launcher's environment.
 *
 * A job of N processes is started by a launcher (fsdprun, torchrun, Slurm's srun, Open MPI's
 * mpirun), and each launcher tells a process its place through environment variables. These
 * functions read them into one record that process-group set-up (a later
 * fsdp_init_from_env) consumes. They do no I/O other than reading variables, keep no state and
 * are thread-safe as long as the getter is.
 *
 * Sources, tried in this order; the first with its rank or its world-size variable set wins, so
 * that a half-set pair is reported rather than skipped (for Slurm only SLURM_PROCID counts: an
 * salloc shell has SLURM_NTASKS set, and a single process started in it is not a rank):
 *
 *  1. fsdprun and torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE. The node is
 *     NODE_RANK and NNODES (fsdprun) or GROUP_RANK and GROUP_WORLD_SIZE (torchrun). The source
 *     is "fsdprun" when NNODES is set, "torchrun" otherwise (also for RANK/WORLD_SIZE set by
 *     hand). Without both LOCAL_* variables the process is taken to be on a single node:
 *     local = global.
 *  2. Slurm (srun): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; node SLURM_NODEID and
 *     SLURM_NNODES. The local world size comes from SLURM_TASKS_PER_NODE, which is the layout
 *     Slurm actually used ("4(x2),3": nodes 0 and 1 run 4 tasks, node 2 runs 3), read at entry
 *     SLURM_NODEID (not needed when every node has the same count). When SLURM_TASKS_PER_NODE
 *     is unset, SLURM_NTASKS_PER_NODE (the --ntasks-per-node request, a maximum, so capped at
 *     SLURM_NTASKS) is used; with neither, a job on one node (SLURM_NNODES=1) has
 *     local = global, and anything else is an error. Note that a batch script itself also
 *     carries SLURM_PROCID=0: start the ranks with srun (or fsdprun), not by running the
 *     program in the script.
 *  3. Open MPI (mpirun): OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK,
 *     OMPI_COMM_WORLD_LOCAL_SIZE. Open MPI gives no node index (OMPI_COMM_WORLD_NODE_RANK is a
 *     rank among the processes of a node), so node_rank and nnodes stay -1.
 *  4. None of them: rank 0 of 1, source "none".
 *
 * Every source also reads FSDP_STORE (the rendezvous store URL, e.g. "file:///shared/dir",
 * "redis://host:6379?prefix=job42" or "tcp://host:29500") and FSDP_BACKEND (the process-group
 * backend, default "gloo"). MASTER_ADDR and MASTER_PORT are read by fsdp_init_from_env only.
 *
 * A variable set to the empty string counts as unset. Numbers are plain decimal digits
 * (no sign, no spaces) up to INT_MAX.
 */
#ifndef FSDP_LAUNCH_H
#define FSDP_LAUNCH_H

#include <stddef.h>
#include <stdint.h>

#include <fsdp/export.h>

FSDP_BEGIN_DECLS

/* Where this process sits in the job. */
typedef struct fsdp_launch_env {
    int rank;             /* global rank, in [0, world_size) */
    int world_size;       /* number of processes in the job, >= 1 */
    int local_rank;       /* rank among the processes of this node, in [0, local_world_size) */
    int local_world_size; /* number of processes on this node, in [1, world_size] */
    int node_rank;        /* index of this node, in [0, nnodes); -1 when unknown */
    int nnodes;           /* number of nodes; -1 when unknown */
    char store_url[512];  /* FSDP_STORE, "" when unset */
    char backend[32];     /* FSDP_BACKEND, "gloo" when unset */
    char source[16];      /* "fsdprun", "torchrun", "slurm", "openmpi" or "none" */
} fsdp_launch_env_t;

/* A getenv-like lookup: the value of variable `name`, or NULL when it is unset. The returned
 * string must stay valid until the parse returns. */
typedef const char *(*fsdp_launch_getenv_fn)(const char *name, void *arg);

/*
 * Reads the launch environment of this process (through getenv) into *out.
 *
 * Returns FSDP_OK, or FSDP_EINVAL when the variables are inconsistent: a value that is not a
 * number or is negative, a rank not less than its world size, a local rank not less than the
 * local world size, a local world size larger than the world size, a node rank not less than
 * the node count, a malformed SLURM_TASKS_PER_NODE, a half-set pair (RANK without WORLD_SIZE,
 * LOCAL_RANK without LOCAL_WORLD_SIZE, ...), or a store URL or backend name that does not fit
 * its field. The error text names the variables and their values. On failure *out is left
 * unchanged.
 *
 * msg (may be NULL) receives the error text, cut to msg_cap bytes including the NUL, and ""
 * on success. Reading the process environment is not safe against a concurrent setenv().
 */
FSDP_EXTERN int fsdp_launch_env_read(fsdp_launch_env_t *out, char *msg, size_t msg_cap);

/* The same, with every variable looked up through get(name, arg) instead of getenv, so that
 * callers and tests can supply a table. get must not be NULL. */
FSDP_EXTERN int fsdp_launch_env_parse(fsdp_launch_getenv_fn get, void *arg, fsdp_launch_env_t *out,
                                      char *msg, size_t msg_cap);

/* ---- making the rank from its environment ------------------------------------------------------ */

typedef struct fsdp_ctx fsdp_ctx_t;

typedef struct fsdp_init_options {
    /* sizeof this struct as the caller was built; set by fsdp_init_options_init() */
    size_t size;
    uint64_t seed;      /* of the context's random stream (stream id = rank); default 0 */
    int log_level;      /* a fsdp_log_level_t, or -1 (default) for the level FSDP_LOG asks for */
    int64_t timeout_ms; /* rendezvous, store waits and the world group's collectives; 0 (the
                           default): $FSDP_TIMEOUT_MS when set, else FSDP_PG_DEFAULT_TIMEOUT_MS */
} fsdp_init_options_t;

/* Fills o with the defaults above. */
FSDP_EXTERN void fsdp_init_options_init(fsdp_init_options_t *o, size_t size);
#define fsdp_init_options_init(o) (fsdp_init_options_init)((o), sizeof *(o))

/*
 * Makes this process's rank from its launch environment, so that one program runs unchanged
 * under fsdprun, torchrun-style launchers, srun and mpirun (fsdp_launch_env_read):
 *   - a context for RANK of WORLD_SIZE;
 *   - the rendezvous store, in this order of precedence:
 *       1. FSDP_STORE, any URL fsdp_store_open_url opens (file:///dir, redis://host:port,
 *          tcp://host:port);
 *       2. MASTER_ADDR and MASTER_PORT, as PyTorch's env:// initialisation: rank 0 serves the
 *          TCP store (fsdp_store_server_start) on MASTER_ADDR:MASTER_PORT, listening on that
 *          address only, in a thread owned by its context, and every rank (rank 0 too)
 *          connects to it; one of the two without the other, or a port outside 1..65535, is
 *          FSDP_EINVAL naming the variable. Rank 0's context must outlive the other ranks'
 *          use of the store (a last collective, such as a barrier, before fsdp_ctx_destroy);
 *       3. without either, a world of one gets an in-memory store, and a larger world is
 *          FSDP_EINVAL saying that neither is set;
 *   - the world group of FSDP_BACKEND ("gloo", the default), connected to every peer and
 *     attached to the context (fsdp_ctx_pg, fsdp_ctx_store).
 * Collective: every rank of the job must call it. The context owns the group and the store:
 * fsdp_ctx_destroy(*out) frees all three. o may be NULL (defaults). Errors, each naming the
 * variable, URL or backend at fault and the rank: FSDP_EINVAL for the environment or an unknown
 * backend (the sim backend runs ranks as threads: fsdp_sim_run), FSDP_ENOTSUP for a backend
 * this build lacks, and the store's and the backend's statuses (FSDP_ETIMEDOUT when peers do
 * not arrive). The message is copied to msg (msg_cap bytes) when msg is not NULL, and logged
 * at error level otherwise, so that it is printed once. On failure *out is NULL and nothing is
 * left behind.
 */
FSDP_EXTERN int fsdp_init_from_env(const fsdp_init_options_t *o, fsdp_ctx_t **out, char *msg,
                                   size_t msg_cap);

FSDP_END_DECLS

#endif /* FSDP_LAUNCH_H */
