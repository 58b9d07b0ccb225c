/*
 * vsim_impl.h: the clock shared by the shape-only device and the virtual-time groups.
 *
 * One clock per simulated rank (fsdp/vsim.h says what it models). The shape-only device owns it
 * (its impl), so a device made with fsdp_device_create(FSDP_DEVICE_META) has one too; without a
 * compute model (model NULL) nothing is charged and every time stays 0. The simulator points the
 * clock at its cluster's compute model and its groups charge collectives on the same clock.
 *
 * Invariants: every time is >= 0 and only grows; host <= the time of anything it waited for;
 * stream times are those of the last work queued on them; one thread uses a clock (the rank's),
 * so it has no lock.
 */
#ifndef FSDP_VSIM_IMPL_H
#define FSDP_VSIM_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/cluster.h>
#include <fsdp/vsim.h>

#include "device/device_impl.h"

/* A stream of the shape-only device (also its native handle): the time its last work ends. */
struct fsdp__vstream {
    double t;
};

/* An event: the time of the point it recorded (0: never recorded, complete). */
struct fsdp__vevent {
    double t;
};

/* How many operations the host may queue on the compute stream ahead of the one running: CUDA's
 * launch queue blocks the host beyond about a thousand pending launches. */
#define FSDP__VQUEUE 1024

struct fsdp__vclock {
    const fsdp_compute_model_t *model; /* NULL: charge nothing */
    double host;                       /* the host's time */
    struct fsdp__vstream compute;      /* the compute stream */
    double net_free;                   /* when the network finishes its last collective */
    double latest;                     /* the latest time anything reached */
    bool started;                      /* a kernel ran since the last reset */
    double ends[FSDP__VQUEUE];         /* end times of the last queued compute operations */
    uint64_t queued;                   /* operations queued on the compute stream */
    fsdp_vsim_stats_t stats;
};

/* The device's state: its clock and the allocator of its addresses. */
struct fsdp__vdev;

/* The clock of a shape-only device (NULL for another device). */
struct fsdp__vclock *fsdp__vdev_clock(fsdp_device_t *dev);

/* Whether p lies in the address range of shape-only allocations (of any device). */
bool fsdp__vaddr(const void *p);

/* Notes that the clock reached t. */
static inline void fsdp__vclock_reach(struct fsdp__vclock *c, double t) {
    if (t > c->latest) c->latest = t;
}

/* Stream s waits until t (a stream or event wait, a collective's end); the compute stream's
 * wait counts as idle time once it has run a kernel. */
static inline void fsdp__vclock_stream_wait(struct fsdp__vclock *c, struct fsdp__vstream *s,
                                            double t) {
    if (t <= s->t) return;
    if (s == &c->compute && c->started) c->stats.compute_idle += t - s->t;
    s->t = t;
    fsdp__vclock_reach(c, t);
}

/* The host waits until t. */
static inline void fsdp__vclock_host_wait(struct fsdp__vclock *c, double t) {
    if (t > c->host) c->host = t;
    fsdp__vclock_reach(c, t);
}

/* The shape-only device's vtable (the launch layer's registry serves FSDP_DEVICE_META). */
extern const struct fsdp_dev_ops fsdp__meta_dev_ops;

#endif /* FSDP_VSIM_IMPL_H */
