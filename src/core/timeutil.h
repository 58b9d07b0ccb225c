/* SPDX-License-Identifier: MIT */
/*
 * timeutil.h: monotonic time, a thread's processor time, and deadlines for timed waits.
 *
 * Condition variables wait on CLOCK_MONOTONIC (see fsdp__cond_init) so that a change of the wall
 * clock never stretches or cuts a timeout.
 */
#ifndef FSDP_TIMEUTIL_H
#define FSDP_TIMEUTIL_H

#include <pthread.h>
#include <stdint.h>
#include <time.h>

/* Monotonic time in nanoseconds. */
int64_t fsdp__now_ns(void);

/* Processor time the calling thread has used, in nanoseconds (time it spent descheduled does
 * not count); monotonic time where the system has no per-thread clock. */
int64_t fsdp__thread_cpu_ns(void);

/* The absolute CLOCK_MONOTONIC time `ms` milliseconds from now. */
struct timespec fsdp__deadline_ms(int64_t ms);

/* Initializes a condition variable that waits on CLOCK_MONOTONIC. */
int fsdp__cond_init(pthread_cond_t *cv);

/* Sleeps for ms milliseconds (restarting after signals). */
void fsdp__sleep_ms(int64_t ms);

#endif /* FSDP_TIMEUTIL_H */
