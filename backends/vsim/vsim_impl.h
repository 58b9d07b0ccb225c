/* SPDX-License-Identifier: MIT */
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

/* A collective on the network that compute kernels may overlap: [start, end), and the share of
 * the compute throughput it takes from them (its SMs over the GPU's). */
struct fsdp__vbusy {
    double start, end, share;
};

/* Collectives remembered for the kernels that start after them; the network runs one at a time,
 * so they are disjoint and in time order. FSDP queues a collective after the kernels it may
 * overlap (the side stream waits for the compute stream first), so the few in flight suffice. */
#define FSDP__VBUSY 64

struct fsdp__vclock {
    const fsdp_compute_model_t *model;    /* NULL: charge nothing */
    struct fsdp__vmeasure *measure;       /* non-NULL: measured kernel times where it has them */
    double host;                          /* the host's time */
    struct fsdp__vstream compute;         /* the compute stream */
    double net_free;                      /* when the network finishes its last collective */
    double latest;                        /* the latest time anything reached */
    bool started;                         /* a kernel ran since the last reset */
    double ends[FSDP__VQUEUE];            /* end times of the last queued compute operations */
    uint64_t queued;                      /* operations queued on the compute stream */
    struct fsdp__vbusy busy[FSDP__VBUSY]; /* a ring: busy_len of them from busy_head */
    unsigned busy_head, busy_len;
    fsdp_vsim_stats_t stats;
};

/* Operations the measuring device replays (vsim_measure.c). */
enum fsdp__vop {
    FSDP__VOP_FILL,
    FSDP__VOP_CAST,
    FSDP__VOP_COPY_STRIDED,
    FSDP__VOP_UNARY,
    FSDP__VOP_UNARY_BWD,
    FSDP__VOP_BINARY,
    FSDP__VOP_AXPY,
    FSDP__VOP_WHERE,
    FSDP__VOP_REDUCE_SUM,
    FSDP__VOP_REDUCE_MAX,
    FSDP__VOP_SUM_SQUARES,
    FSDP__VOP_GEMM,
    FSDP__VOP_SOFTMAX,
    FSDP__VOP_SOFTMAX_BWD,
    FSDP__VOP_LAYER_NORM,
    FSDP__VOP_LAYER_NORM_BWD,
    FSDP__VOP_EMBEDDING,
    FSDP__VOP_EMBEDDING_BWD,
    FSDP__VOP_CROSS_ENTROPY,
    FSDP__VOP_CROSS_ENTROPY_BWD,
    FSDP__VOP_DROPOUT,
    FSDP__VOP_ADAM,
    FSDP__VOP_SGD,
    FSDP__VOP_MEMCPY,
    FSDP__VOP_MEMSET,
    FSDP__VOP_ATTENTION,
    FSDP__VOP_ATTENTION_BWD,
};

#define FSDP__VCALL_MAX 32

/* A kernel call as far as its speed goes: the operation, then its dtype and every size and flag
 * (which pointers are NULL, a transpose, a log-softmax), in the order vsim_measure.c reads
 * them. Two calls with the same description take the same time. nv = 0: not described (the
 * roofline prices it). */
struct fsdp__vcall {
    int op;
    int nv;
    int64_t v[FSDP__VCALL_MAX];
};

/* Measured kernel times: a table from call descriptions to the median time of the call on a CPU
 * device, filled the first time each description is seen. */
struct fsdp__vmeasure;
int fsdp__vmeasure_create(fsdp_device_t *dev, double scale, struct fsdp__vmeasure **out);
void fsdp__vmeasure_destroy(struct fsdp__vmeasure *m);
/* The measured seconds of call c (times the scale), or -1 when the call is not replayed (its
 * buffers are too large, the CPU device fails it): the caller uses the roofline. Fails only
 * when the table cannot grow (FSDP_ENOMEM). */
int fsdp__vmeasure_time(struct fsdp__vmeasure *m, const struct fsdp__vcall *c, double *seconds);
/* Descriptions measured so far (not counting those left to the roofline). */
size_t fsdp__vmeasure_count(const struct fsdp__vmeasure *m);

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

/* Notes a collective over [start, end) that takes `share` of the compute throughput from the
 * kernels it overlaps (0: none). The oldest is forgotten when the ring is full. */
static inline void fsdp__vclock_busy(struct fsdp__vclock *c, double start, double end,
                                     double share) {
    if (!(share > 0) || !(end > start)) return;
    if (c->busy_len == FSDP__VBUSY) {
        c->busy_head = (c->busy_head + 1) % FSDP__VBUSY;
        c->busy_len--;
    }
    c->busy[(c->busy_head + c->busy_len++) % FSDP__VBUSY] =
        (struct fsdp__vbusy){.start = start, .end = end, .share = share};
}

/* The host waits until t. */
static inline void fsdp__vclock_host_wait(struct fsdp__vclock *c, double t) {
    if (t > c->host) c->host = t;
    fsdp__vclock_reach(c, t);
}

/* The shape-only device's vtable (the launch layer's registry serves FSDP_DEVICE_META). */
extern const struct fsdp_dev_ops fsdp__meta_dev_ops;

#endif /* FSDP_VSIM_IMPL_H */
