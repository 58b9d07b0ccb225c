/* SPDX-License-Identifier: MIT */
/*
 * cpu_pin.h: pinning a test process to one CPU of its affinity mask and back, for the checks of
 * what depends on the CPUs a process may run on (core/cpus.h). The includer defines _GNU_SOURCE.
 */
#ifndef FSDP_TESTS_CPU_PIN_H
#define FSDP_TESTS_CPU_PIN_H

#include <sched.h>

/* Saves the affinity mask in *saved and pins the process to the mask's first CPU. Returns 0, or
 * -1 with nothing changed. Children forked meanwhile inherit the pin. */
static inline int cpu_pin_one(cpu_set_t *saved) {
    cpu_set_t one;
    if (sched_getaffinity(0, sizeof *saved, saved) != 0) return -1;
    CPU_ZERO(&one);
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, saved)) {
            CPU_SET(c, &one);
            break;
        }
    return sched_setaffinity(0, sizeof one, &one);
}

/* Restores the mask cpu_pin_one saved. */
static inline void cpu_unpin(const cpu_set_t *saved) {
    sched_setaffinity(0, sizeof *saved, saved);
}

#endif /* FSDP_TESTS_CPU_PIN_H */
