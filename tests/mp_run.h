/*
 * mp_run.h: runs an fu_job on real processes over the Gloo backend, as fu_run_job() runs it
 * on sim threads, so that one rank function serves both backends.
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

#endif /* FSDP_TESTS_MP_RUN_H */
