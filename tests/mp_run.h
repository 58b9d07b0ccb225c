/* SPDX-License-Identifier: MIT */
/*
 * mp_run.h: runs an fu_job on real processes over the Gloo backend (or NCCL, one GPU per
 * rank), as fu_run_job() runs it on sim threads, so that one rank function serves every
 * backend.
 *
 * The job is copied into memory shared with the children (MAP_SHARED), so that each rank
 * process records its checks (and anything else the job struct carries: losses, parameter
 * values) where the parent reads them back; fu_job_t holds no pointers for that reason. Each
 * child makes its own context (rank r of world, the job's seed), a file store in a fresh
 * directory, and a Gloo world group over loopback attached to the context, runs the rank
 * function, tears everything down and exits. The parent waits for all of them (killing them
 * after a deadline), copies the job back, removes the store directory and prints the job's
 * TAP lines.
 */
#ifndef FSDP_TESTS_MP_RUN_H
#define FSDP_TESTS_MP_RUN_H

#include <stddef.h>

#include "fsdp_util.h"

/* Runs fn(ctx, job) on j->world processes. size is the number of bytes of the struct j starts
 * (a test's own job type with fu_job_t as its first member; sizeof(fu_job_t) otherwise); the
 * whole struct travels to the children and back. Returns FSDP_ENOTSUP, printing nothing, when
 * libfsdp has no Gloo backend; otherwise prints the job's lines and returns the run's status. */
int mp_run_job(fu_job_t *j, size_t size, fsdp_sim_fn fn);

/* The process group of each rank process. */
typedef enum mp_backend { MP_GLOO, MP_NCCL } mp_backend_t;

/*
 * mp_run_job() over the backend be. MP_NCCL: rank r's world group is an NCCL group on GPU r,
 * and its context's device (fsdp_ctx_set_device) is a CUDA device on that GPU, so that what
 * the rank function makes on the context's device lives on its GPU. Returns FSDP_ENOTSUP,
 * printing nothing, when libfsdp lacks the backend.
 */
int mp_run_job_on(fu_job_t *j, size_t size, fsdp_sim_fn fn, mp_backend_t be);

/* The CUDA devices libfsdp can use here, counted in a child process (a process that has used
 * CUDA cannot fork ranks that use it); 0 without CUDA or a GPU. */
int mp_cuda_devices(void);

#endif /* FSDP_TESTS_MP_RUN_H */
