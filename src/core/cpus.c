/* SPDX-License-Identifier: MIT */
/*
 * cpus.c: the CPUs this process may run on (cpus.h).
 */
#define _GNU_SOURCE

#include "core/cpus.h"

#include <sched.h>
#include <unistd.h>

int fsdp__cpu_count(void) {
    cpu_set_t set;
    int n = 0;
    if (sched_getaffinity(0, sizeof set, &set) == 0) n = CPU_COUNT(&set);
    if (n <= 0) {
        long online = sysconf(_SC_NPROCESSORS_ONLN);
        n = online > 0 ? (int)online : 1;
    }
    return n;
}
