/* SPDX-License-Identifier: MIT */
/*
 * cpus.h: how many CPUs this process may run on, for the choices that depend on whether its
 * threads have a core each (the CPU device's threads, whether a waiter spins).
 */
#ifndef FSDP_CPUS_H
#define FSDP_CPUS_H

/* The CPUs in this process's affinity mask (sched_getaffinity: taskset, cpusets), else the
 * online CPUs; at least 1. */
int fsdp__cpu_count(void);

#endif /* FSDP_CPUS_H */
