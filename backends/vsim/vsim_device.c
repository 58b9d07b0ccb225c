/* SPDX-License-Identifier: MIT */
/*
 * vsim_device.c: the shape-only device (FSDP_DEVICE_META), whose kernels cost simulated time.
 *
 * Allocations are addresses, not memory: each is a unique, 64-byte aligned address in the upper
 * half of the 64-bit space, where no host memory can be (user space ends far below 2^63 on every
 * 64-bit Linux), so a group can tell a shape-only buffer from a host one by its address alone
 * (fsdp__vaddr) and a stray dereference faults at once instead of reading something. Addresses
 * are handed out in increasing order and never reused: the range holds 2^52 bytes (4 PiB), a few
 * thousand steps of a GPT-3 175B simulation, and running out is FSDP_ENOMEM with a message. The
 * device layer's map does the accounting.
 *
 * Every kernel fills an fsdp_kernel_cost_t with the model layer's counts for its operation and
 * charges it on the compute stream (charge()); copies and fills of memory are charged on the
 * stream they were queued on. fsdp/vsim.h gives the clock's rules. Each also describes its call
 * (VCALL: the operation, its dtype, sizes and flags), so that a simulator measuring kernels
 * (fsdp_vsim_measure_kernels, vsim_measure.c) charges that call's measured time instead of the
 * roofline's.
 */
#include <config.h>

#include <stdlib.h>
#include <string.h>

#include "backends/vsim/vsim_impl.h"
#include "core/trace.h"

#if UINTPTR_MAX > 0xffffffffu
#define VADDR_BASE ((uintptr_t)0xfff0000000000000ull)
#else
#define VADDR_BASE ((uintptr_t)0) /* not used: creation fails on 32-bit pointers */
#endif

struct fsdp__vdev {
    struct fsdp__vclock clock;
    uintptr_t next; /* the next address never handed out */
};

struct fsdp__vclock *fsdp__vdev_clock(fsdp_device_t *dev) {
    if (!dev || dev->ops != &fsdp__meta_dev_ops || !dev->impl) return NULL;
    return &((struct fsdp__vdev *)dev->impl)->clock;
}

bool fsdp__vaddr(const void *p) {
    return VADDR_BASE != 0 && (uintptr_t)p >= VADDR_BASE;
}

/* ---- the clock ------------------------------------------------------------------------------ */

static struct fsdp__vclock *clock_of(fsdp_device_t *dev) {
    return &((struct fsdp__vdev *)dev->impl)->clock;
}

static struct fsdp__vstream *stream_of(struct fsdp__vclock *c, void *stream) {
    return stream ? (struct fsdp__vstream *)stream : &c->compute;
}

/* The time a kernel of `seconds` at full speed takes from `start` when the collectives it
 * overlaps hold part of the GPU: inside a collective it runs at 1 - share of its speed. Forgets
 * the collectives that ended before start (kernels start in order). */
static double stretch(struct fsdp__vclock *c, double start, double seconds) {
    while (c->busy_len && c->busy[c->busy_head].end <= start) {
        c->busy_head = (c->busy_head + 1) % FSDP__VBUSY;
        c->busy_len--;
    }
    /* Untouched work keeps its time exactly (no rounding through start + seconds - start). */
    if (!c->busy_len || c->busy[c->busy_head].start >= start + seconds) return seconds;
    double t = start, left = seconds;
    for (unsigned i = 0; i < c->busy_len && left > 0; i++) {
        const struct fsdp__vbusy *b = &c->busy[(c->busy_head + i) % FSDP__VBUSY];
        if (b->start > t) {
            if (left <= b->start - t) break;
            left -= b->start - t;
            t = b->start;
        }
        double rate = 1 - b->share, work = (b->end - t) * rate;
        if (left <= work) return t + left / rate - start;
        left -= work;
        t = b->end;
    }
    return t + left - start;
}

/* Queues work of *seconds on stream s: it starts when the stream and the host are there. On the
 * compute stream *seconds becomes the time it takes beside the collectives it overlaps. */
static double queue(fsdp_device_t *dev, struct fsdp__vclock *c, struct fsdp__vstream *s,
                    double *seconds) {
    bool compute = s == &c->compute;
    /* A full launch queue holds the host until the oldest queued operation has finished. */
    if (compute && c->queued >= FSDP__VQUEUE)
        fsdp__vclock_host_wait(c, c->ends[c->queued % FSDP__VQUEUE]);
    double start = s->t > c->host ? s->t : c->host;
    if (compute) {
        if (c->started && start > s->t) {
            c->stats.compute_idle += start - s->t;
            /* The compute stream stood idle while the host waited (for a collective, an event):
             * a wait span of the trace, as a blocked host is in a real run's. */
            if (fsdp__tracing(dev->ctx))
                fsdp__trace_span_at(dev->ctx, FSDP__TRACE_WAIT, "idle", (int64_t)(s->t * 1e9),
                                    (int64_t)(start * 1e9));
        }
        c->started = true;
        if (c->busy_len) {
            double full = *seconds;
            *seconds = stretch(c, start, full);
            c->stats.contention += *seconds - full;
        }
    }
    s->t = start + *seconds;
    if (compute) c->ends[c->queued++ % FSDP__VQUEUE] = s->t;
    fsdp__vclock_reach(c, s->t);
    return s->t;
}

/* A call description of operation opv with the listed values (vsim_impl.h). */
#define VCALL(opv, ...)                                                                            \
    (&(struct fsdp__vcall){.op = (opv),                                                            \
                           .nv = (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)),        \
                           .v = {__VA_ARGS__}})

/* The seconds kernel k takes: the measured time of its call where the clock measures and has
 * one (call may be NULL: none), else the roofline's. */
static int kernel_seconds(fsdp_device_t *dev, struct fsdp__vclock *c, const fsdp_kernel_cost_t *k,
                          const struct fsdp__vcall *call, double *out) {
    if (c->measure && call && call->nv > 0) {
        int rc = fsdp__vmeasure_time(c->measure, call, out);
        if (rc < 0) return fsdp__ctx_err(dev->ctx, rc, "%s: out of memory measuring", dev->name);
        if (*out >= 0) return FSDP_OK;
    }
    fsdp_kernel_estimate_t e;
    int rc = fsdp_compute_kernel_time(dev->ctx, c->model, k, &e);
    if (rc == FSDP_OK) *out = e.seconds;
    return rc;
}

/* Charges kernel k, described by call (or NULL), on the compute stream. */
static int charge(fsdp_device_t *dev, const fsdp_kernel_cost_t *k, const struct fsdp__vcall *call) {
    struct fsdp__vclock *c = clock_of(dev);
    if (!c->model) return FSDP_OK;
    double seconds;
    int rc = kernel_seconds(dev, c, k, call, &seconds);
    if (rc < 0) return rc;
    queue(dev, c, &c->compute, &seconds);
    c->stats.compute_busy += seconds;
    if ((unsigned)k->cls < FSDP_KERNEL_CLASS_COUNT) c->stats.class_time[k->cls] += seconds;
    c->stats.flops += k->flops;
    if (k->cls == FSDP_KERNEL_MATMUL || k->cls == FSDP_KERNEL_ATTENTION)
        c->stats.matmul_flops += k->flops;
    c->stats.kernels++;
    return FSDP_OK;
}

/* A kernel of `cls` touching `bytes` with `flops` (the counts the helpers do not cover). */
static int charge_raw(fsdp_device_t *dev, fsdp_kernel_class_t cls, fsdp_dtype_t dt, double flops,
                      double bytes, const struct fsdp__vcall *call) {
    fsdp_kernel_cost_t k = {.cls = cls, .dtype = dt, .flops = flops, .bytes = bytes};
    return charge(dev, &k, call);
}

static int charge_elementwise(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, int in, int out,
                              double flops_per_elem, const struct fsdp__vcall *call) {
    fsdp_kernel_cost_t k;
    int rc = fsdp_kernel_elementwise(dev->ctx, (int64_t)n, in, out, flops_per_elem, dt, &k);
    return rc < 0 ? rc : charge(dev, &k, call);
}

/* A copy or fill of `bytes` moved through device memory, on `stream`; `sync`: the host waits
 * for it (a copy to or from the host on the default stream). */
static int charge_copy(fsdp_device_t *dev, void *stream, double bytes, bool sync,
                       const struct fsdp__vcall *call) {
    struct fsdp__vclock *c = clock_of(dev);
    if (!c->model) return FSDP_OK;
    fsdp_kernel_cost_t k = {.cls = FSDP_KERNEL_ELEMENTWISE, .dtype = FSDP_DTYPE_U8, .bytes = bytes};
    double seconds;
    int rc = kernel_seconds(dev, c, &k, call, &seconds);
    if (rc < 0) return rc;
    struct fsdp__vstream *s = stream_of(c, stream);
    double end = queue(dev, c, s, &seconds);
    c->stats.copy_busy += seconds;
    if (s == &c->compute) c->stats.compute_busy += seconds;
    if (sync) fsdp__vclock_host_wait(c, end);
    return FSDP_OK;
}

/* ---- addresses ------------------------------------------------------------------------------ */

static int meta_alloc(fsdp_device_t *dev, size_t bytes, void **out) {
    struct fsdp__vdev *v = dev->impl;
    size_t r = bytes ? (bytes + 63) & ~(size_t)63 : 64;
    /* A guard of 64 bytes between blocks keeps one-past-the-end pointers distinct. */
    if (bytes > SIZE_MAX - 128 || r > UINTPTR_MAX - v->next - 64)
        return fsdp__ctx_err(dev->ctx, FSDP_ENOMEM,
                             "%s: the shape-only address range is used up (%zu bytes asked after "
                             "%.0f GiB handed out)",
                             dev->name, bytes, (double)(v->next - VADDR_BASE) / 1073741824.0);
    *out = (void *)v->next;
    v->next += r + 64;
    return FSDP_OK;
}

static void meta_free(fsdp_device_t *dev, void *ptr) {
    (void)dev, (void)ptr; /* addresses are not reused: the range holds petabytes */
}

/* Stream pools: an address is never handed out twice, so every stream's pool is the one range
 * and no block can be reused early; recording a stream's use has nothing to protect. */
static int meta_alloc_on(fsdp_device_t *dev, size_t bytes, void *stream, void **out) {
    (void)stream;
    return meta_alloc(dev, bytes, out);
}

static int meta_record_stream(fsdp_device_t *dev, void *ptr, void *stream) {
    (void)dev, (void)ptr, (void)stream;
    return FSDP_OK;
}

/* ---- memory and streams --------------------------------------------------------------------- */

static int meta_memcpy(fsdp_device_t *dev, void *dst, const void *src, size_t n,
                       fsdp_copy_kind_t kind, void *stream) {
    switch (kind) {
    case FSDP_COPY_H2H:
        memmove(dst, src, n);
        return FSDP_OK;
    case FSDP_COPY_D2H:
        memset(dst, 0, n); /* values of a shape-only tensor read as zeros */
        return charge_copy(dev, stream, (double)n, !stream, NULL);
    case FSDP_COPY_H2D:
        return charge_copy(dev, stream, (double)n, !stream, NULL);
    default:
        return charge_copy(dev, stream, 2.0 * (double)n, false,
                           VCALL(FSDP__VOP_MEMCPY, FSDP_DTYPE_U8, (int64_t)n));
    }
}

static int meta_memset(fsdp_device_t *dev, void *dst, int byte, size_t n, void *stream) {
    (void)dst, (void)byte;
    return charge_copy(dev, stream, (double)n, false,
                       VCALL(FSDP__VOP_MEMSET, FSDP_DTYPE_U8, (int64_t)n));
}

static int meta_stream_create(fsdp_device_t *dev, void **out) {
    struct fsdp__vstream *s = calloc(1, sizeof *s);
    if (!s) return fsdp__ctx_err(dev->ctx, FSDP_ENOMEM, "%s: out of host memory", dev->name);
    s->t = clock_of(dev)->host; /* a new stream starts empty, now */
    *out = s;
    return FSDP_OK;
}

static void meta_stream_destroy(fsdp_device_t *dev, void *stream) {
    (void)dev;
    free(stream);
}

static int meta_stream_sync(fsdp_device_t *dev, void *stream) {
    struct fsdp__vclock *c = clock_of(dev);
    fsdp__vclock_host_wait(c, stream_of(c, stream)->t);
    return FSDP_OK;
}

static int meta_event_create(fsdp_device_t *dev, void **out) {
    struct fsdp__vevent *e = calloc(1, sizeof *e);
    if (!e) return fsdp__ctx_err(dev->ctx, FSDP_ENOMEM, "%s: out of host memory", dev->name);
    *out = e;
    return FSDP_OK;
}

static void meta_event_destroy(fsdp_device_t *dev, void *ev) {
    (void)dev;
    free(ev);
}

static int meta_event_record(fsdp_device_t *dev, void *ev, void *stream) {
    struct fsdp__vclock *c = clock_of(dev);
    double t = stream_of(c, stream)->t;
    ((struct fsdp__vevent *)ev)->t = t > c->host ? t : c->host;
    return FSDP_OK;
}

static int meta_event_wait(fsdp_device_t *dev, void *ev, void *stream) {
    struct fsdp__vclock *c = clock_of(dev);
    fsdp__vclock_stream_wait(c, stream_of(c, stream), ((struct fsdp__vevent *)ev)->t);
    return FSDP_OK;
}

static int meta_event_sync(fsdp_device_t *dev, void *ev) {
    fsdp__vclock_host_wait(clock_of(dev), ((struct fsdp__vevent *)ev)->t);
    return FSDP_OK;
}

static int meta_event_query(fsdp_device_t *dev, void *ev) {
    return ((struct fsdp__vevent *)ev)->t <= clock_of(dev)->host;
}

static void *meta_compute_stream(fsdp_device_t *dev) {
    return &clock_of(dev)->compute;
}

static int meta_init(fsdp_device_t *dev) {
#if UINTPTR_MAX <= 0xffffffffu
    return fsdp__ctx_err(dev->ctx, FSDP_ENOTSUP,
                         "fsdp_device_create: the shape-only device needs 64-bit pointers");
#else
    struct fsdp__vdev *v = calloc(1, sizeof *v);
    if (!v) return fsdp__ctx_err(dev->ctx, FSDP_ENOMEM, "fsdp_device_create: out of memory");
    v->next = VADDR_BASE;
    dev->impl = v;
    if (dev->num_threads <= 0) dev->num_threads = 1;
    return FSDP_OK;
#endif
}

static void meta_fini(fsdp_device_t *dev) {
    struct fsdp__vdev *v = dev->impl;
    free(v);
    dev->impl = NULL;
}

/* ---- kernels: each charges its operation's FLOPs and bytes ---------------------------------- */

static int meta_fill(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, double value, void *y) {
    (void)value, (void)y;
    return charge_elementwise(dev, dt, n, 0, 1, 0, VCALL(FSDP__VOP_FILL, dt, (int64_t)n));
}

static int meta_cast(fsdp_device_t *dev, fsdp_dtype_t dt, void *y, fsdp_dtype_t xt, const void *x,
                     size_t n) {
    (void)y, (void)x;
    return charge_raw(dev, FSDP_KERNEL_ELEMENTWISE, dt, (double)n,
                      (double)n * (double)(fsdp_dtype_size(dt) + fsdp_dtype_size(xt)),
                      VCALL(FSDP__VOP_CAST, dt, xt, (int64_t)n));
}

/* The cast queued on `stream`: a pass over both buffers there, as a copy is. */
static int meta_cast_on(fsdp_device_t *dev, fsdp_dtype_t dt, void *y, fsdp_dtype_t xt,
                        const void *x, size_t n, void *stream) {
    (void)y, (void)x;
    return charge_copy(dev, stream, (double)n * (double)(fsdp_dtype_size(dt) + fsdp_dtype_size(xt)),
                       false, VCALL(FSDP__VOP_CAST, dt, xt, (int64_t)n));
}

static size_t shape_numel(int ndim, const int64_t *shape) {
    size_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= (size_t)shape[i];
    return n;
}

/* The description of a strided operation: `head` values, then `narr` arrays of ndim values
 * (the shape, then the strides). Not described (nv 0) when it does not fit. */
static void strided_call(struct fsdp__vcall *call, int op, int nhead, const int64_t *head, int ndim,
                         int narr, const int64_t *const *arr) {
    memset(call, 0, sizeof *call);
    call->op = op;
    if (ndim < 0 || nhead + narr * ndim > FSDP__VCALL_MAX) return;
    memcpy(call->v, head, (size_t)nhead * sizeof *head);
    for (int a = 0; a < narr; a++)
        memcpy(call->v + nhead + a * ndim, arr[a], (size_t)ndim * sizeof *arr[a]);
    call->nv = nhead + narr * ndim;
}

static int meta_copy_strided(fsdp_device_t *dev, fsdp_dtype_t dt, int ndim, const int64_t *shape,
                             void *y, const void *x, const int64_t *xstride) {
    (void)y, (void)x;
    struct fsdp__vcall call;
    strided_call(&call, FSDP__VOP_COPY_STRIDED, 2, (const int64_t[]){dt, ndim}, ndim, 2,
                 (const int64_t *const[]){shape, xstride});
    return charge_elementwise(dev, dt, shape_numel(ndim, shape), 1, 1, 0, &call);
}

/* FLOPs per element of a unary map (the transcendental ones count a few). */
static double unary_flops(fsdp_unary_op_t op, bool backward) {
    switch (op) {
    case FSDP_UNARY_GELU_ERF:
    case FSDP_UNARY_GELU_TANH:
        return backward ? 12 : 8;
    case FSDP_UNARY_TANH:
    case FSDP_UNARY_SIGMOID:
    case FSDP_UNARY_EXP:
    case FSDP_UNARY_LOG:
    case FSDP_UNARY_POW:
        return backward ? 4 : 2;
    default:
        return backward ? 2 : 1;
    }
}

static int meta_unary(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_unary_op_t op, size_t n,
                      double alpha, const void *x, void *y) {
    (void)alpha, (void)x, (void)y;
    return charge_elementwise(dev, dt, n, 1, 1, unary_flops(op, false),
                              VCALL(FSDP__VOP_UNARY, dt, op, (int64_t)n));
}

static int meta_unary_backward(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_unary_op_t op, size_t n,
                               double alpha, const void *x, const void *y, const void *gy,
                               void *gx) {
    (void)alpha, (void)gy, (void)gx;
    return charge_elementwise(dev, dt, n, 2, 1, unary_flops(op, true),
                              VCALL(FSDP__VOP_UNARY_BWD, dt, op, (int64_t)n, x != NULL, y != NULL));
}

static int meta_binary(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_binary_op_t op, int ndim,
                       const int64_t *shape, void *y, const void *a, const int64_t *astride,
                       const void *b, const int64_t *bstride) {
    (void)y, (void)a, (void)b;
    struct fsdp__vcall call;
    strided_call(&call, FSDP__VOP_BINARY, 3, (const int64_t[]){dt, op, ndim}, ndim, 3,
                 (const int64_t *const[]){shape, astride, bstride});
    return charge_elementwise(dev, dt, shape_numel(ndim, shape), 2, 1, 1, &call);
}

static int meta_axpy(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, double alpha, const void *x,
                     void *y) {
    (void)alpha, (void)x, (void)y;
    return charge_elementwise(dev, dt, n, 2, 1, 2, VCALL(FSDP__VOP_AXPY, dt, (int64_t)n));
}

static int meta_where(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, const uint8_t *cond,
                      const void *a, double av, const void *b, double bv, void *y) {
    (void)cond, (void)av, (void)bv, (void)y;
    double es = (double)fsdp_dtype_size(dt);
    double bytes = (double)n * (1 + es * (1 + (a != NULL) + (b != NULL)));
    return charge_raw(dev, FSDP_KERNEL_ELEMENTWISE, dt, (double)n, bytes,
                      VCALL(FSDP__VOP_WHERE, dt, (int64_t)n, a != NULL, b != NULL));
}

static int meta_reduce(fsdp_device_t *dev, fsdp_dtype_t dt, size_t outer, size_t r, size_t inner,
                       double extra_out_bytes, const struct fsdp__vcall *call) {
    double in = (double)outer * (double)r * (double)inner, out = (double)outer * (double)inner;
    double es = (double)fsdp_dtype_size(dt);
    return charge_raw(dev, FSDP_KERNEL_ROWWISE, dt, in, (in + out) * es + out * extra_out_bytes,
                      call);
}

static int meta_reduce_sum(fsdp_device_t *dev, fsdp_dtype_t dt, size_t outer, size_t r,
                           size_t inner, double alpha, const void *x, void *y) {
    (void)alpha, (void)x, (void)y;
    return meta_reduce(dev, dt, outer, r, inner, 0,
                       VCALL(FSDP__VOP_REDUCE_SUM, dt, (int64_t)outer, (int64_t)r, (int64_t)inner));
}

static int meta_reduce_max(fsdp_device_t *dev, fsdp_dtype_t dt, size_t outer, size_t r,
                           size_t inner, const void *x, void *y, int64_t *idx) {
    (void)x, (void)y;
    return meta_reduce(
        dev, dt, outer, r, inner, idx ? 8 : 0,
        VCALL(FSDP__VOP_REDUCE_MAX, dt, (int64_t)outer, (int64_t)r, (int64_t)inner, idx != NULL));
}

static int meta_sum_squares(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, const void *x,
                            void *out) {
    (void)x, (void)out;
    return charge_raw(dev, FSDP_KERNEL_ROWWISE, dt, 2.0 * (double)n,
                      (double)n * (double)fsdp_dtype_size(dt),
                      VCALL(FSDP__VOP_SUM_SQUARES, dt, (int64_t)n));
}

static int meta_coll_reduce(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_redop_t op, int divisor,
                            double prescale, void *const *outs, int nout, const void *const *ins,
                            int nin, size_t n, void *stream) {
    (void)op, (void)divisor, (void)prescale, (void)outs, (void)ins;
    /* A collective's reduction runs on the collective's stream: charged like a copy there. */
    return charge_copy(dev, stream, (double)n * (double)(nin + nout) * fsdp_dtype_size(dt), false,
                       NULL);
}

/* Charges a product described by call (NULL: not described) after the gemm checks. */
static int charge_gemm(fsdp_device_t *dev, fsdp_dtype_t dt, bool trans_a, bool trans_b, int64_t m,
                       int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, int64_t batch,
                       const struct fsdp__vcall *call) {
    int rc = fsdp__gemm_check(dev, "meta", trans_a, trans_b, m, n, k, lda, ldb, ldc, batch);
    if (rc != 0) return rc < 0 ? rc : FSDP_OK;
    fsdp_kernel_cost_t kc;
    if ((rc = fsdp_kernel_matmul(dev->ctx, m, n, k, batch, dt, &kc)) < 0) return rc;
    return charge(dev, &kc, call);
}

static int meta_gemm(fsdp_device_t *dev, fsdp_dtype_t dt, bool trans_a, bool trans_b, int64_t m,
                     int64_t n, int64_t k, double alpha, const void *a, int64_t lda,
                     int64_t stride_a, const void *b, int64_t ldb, int64_t stride_b, double beta,
                     void *c, int64_t ldc, int64_t stride_c, int64_t batch) {
    (void)alpha, (void)a, (void)b, (void)c;
    return charge_gemm(dev, dt, trans_a, trans_b, m, n, k, lda, ldb, ldc, batch,
                       VCALL(FSDP__VOP_GEMM, dt, trans_a, trans_b, m, n, k, lda, stride_a, ldb,
                             stride_b, ldc, stride_c, batch, beta != 0));
}

/* A device with 16-bit products: not described, as the CPU device has none to time. */
static int meta_gemm_lp(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_dtype_t ct, bool trans_a,
                        bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const void *a,
                        int64_t lda, int64_t stride_a, const void *b, int64_t ldb, int64_t stride_b,
                        double beta, void *c, int64_t ldc, int64_t stride_c, int64_t batch) {
    (void)ct, (void)alpha, (void)a, (void)stride_a, (void)b, (void)stride_b, (void)beta, (void)c;
    (void)stride_c;
    return charge_gemm(dev, dt, trans_a, trans_b, m, n, k, lda, ldb, ldc, batch, NULL);
}

static int meta_softmax(fsdp_device_t *dev, fsdp_dtype_t dt, bool log, size_t rows, size_t n,
                        const void *x, void *y) {
    (void)x, (void)y;
    fsdp_kernel_cost_t k;
    int rc = fsdp_kernel_softmax(dev->ctx, (int64_t)rows, (int64_t)n, false, dt, &k);
    return rc < 0 ? rc
                  : charge(dev, &k, VCALL(FSDP__VOP_SOFTMAX, dt, log, (int64_t)rows, (int64_t)n));
}

static int meta_softmax_backward(fsdp_device_t *dev, fsdp_dtype_t dt, bool log, size_t rows,
                                 size_t n, const void *y, const void *gy, void *gx) {
    (void)y, (void)gy, (void)gx;
    fsdp_kernel_cost_t k;
    int rc = fsdp_kernel_softmax(dev->ctx, (int64_t)rows, (int64_t)n, true, dt, &k);
    return rc < 0
               ? rc
               : charge(dev, &k, VCALL(FSDP__VOP_SOFTMAX_BWD, dt, log, (int64_t)rows, (int64_t)n));
}

/* Attention over packed heads, as a CPU rank runs it (the device's attn_fused, set where a CPU
 * device measures the kernels): the measured call, or FlashAttention's count without one. */
static int meta_attention(fsdp_device_t *dev, fsdp_dtype_t dt, int64_t batch, int64_t t,
                          int64_t heads, int64_t hd, double scale, const void *qkv,
                          const void *mask, void *p, void *y) {
    (void)scale, (void)qkv, (void)p, (void)y;
    fsdp_kernel_cost_t k;
    int rc = fsdp_kernel_attention(dev->ctx, batch, heads, t, t, hd, false, false, dt, &k);
    return rc < 0
               ? rc
               : charge(dev, &k, VCALL(FSDP__VOP_ATTENTION, dt, batch, t, heads, hd, mask != NULL));
}

static int meta_attention_backward(fsdp_device_t *dev, fsdp_dtype_t dt, int64_t batch, int64_t t,
                                   int64_t heads, int64_t hd, double scale, const void *qkv,
                                   const void *p, const void *gy, void *gqkv) {
    (void)scale, (void)qkv, (void)p, (void)gy, (void)gqkv;
    fsdp_kernel_cost_t k;
    int rc = fsdp_kernel_attention(dev->ctx, batch, heads, t, t, hd, false, true, dt, &k);
    return rc < 0 ? rc : charge(dev, &k, VCALL(FSDP__VOP_ATTENTION_BWD, dt, batch, t, heads, hd));
}

static int meta_layer_norm(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n, double eps,
                           const void *x, const void *w, const void *b, void *y, void *mean,
                           void *rstd) {
    (void)eps, (void)x, (void)y, (void)mean, (void)rstd;
    fsdp_kernel_cost_t k;
    int rc = fsdp_kernel_layer_norm(dev->ctx, (int64_t)rows, (int64_t)n, false, dt, &k);
    return rc < 0 ? rc
                  : charge(dev, &k,
                           VCALL(FSDP__VOP_LAYER_NORM, dt, (int64_t)rows, (int64_t)n, w != NULL,
                                 b != NULL));
}

static int meta_layer_norm_backward(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n,
                                    const void *x, const void *w, const void *mean,
                                    const void *rstd, const void *gy, void *gx, void *gw,
                                    void *gb) {
    (void)x, (void)mean, (void)rstd, (void)gy;
    fsdp_kernel_cost_t k;
    int rc = fsdp_kernel_layer_norm(dev->ctx, (int64_t)rows, (int64_t)n, true, dt, &k);
    return rc < 0 ? rc
                  : charge(dev, &k,
                           VCALL(FSDP__VOP_LAYER_NORM_BWD, dt, (int64_t)rows, (int64_t)n, w != NULL,
                                 gx != NULL, gw != NULL, gb != NULL));
}

static int meta_batch_norm(fsdp_device_t *dev, fsdp_dtype_t dt, bool train, size_t nb, size_t c,
                           size_t l, double eps, double momentum, const void *x, const void *w,
                           const void *b, void *running_mean, void *running_var, void *y,
                           void *mean, void *rstd) {
    (void)train, (void)eps, (void)momentum, (void)x, (void)w, (void)b, (void)running_mean;
    (void)running_var, (void)y, (void)mean, (void)rstd;
    size_t n = nb * c * l;
    return charge_raw(dev, FSDP_KERNEL_ROWWISE, dt, 8.0 * (double)n,
                      3.0 * (double)n * (double)fsdp_dtype_size(dt), NULL);
}

static int meta_batch_norm_backward(fsdp_device_t *dev, fsdp_dtype_t dt, bool train, size_t nb,
                                    size_t c, size_t l, const void *x, const void *w,
                                    const void *mean, const void *rstd, const void *gy, void *gx,
                                    void *gw, void *gb) {
    (void)train, (void)x, (void)w, (void)mean, (void)rstd, (void)gy, (void)gx, (void)gw, (void)gb;
    size_t n = nb * c * l;
    return charge_raw(dev, FSDP_KERNEL_ROWWISE, dt, 13.0 * (double)n,
                      4.0 * (double)n * (double)fsdp_dtype_size(dt), NULL);
}

static int meta_embedding(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, size_t dim,
                          const int64_t *idx, const void *w, void *y) {
    (void)idx, (void)w, (void)y;
    return charge_raw(dev, FSDP_KERNEL_ELEMENTWISE, dt, 0,
                      (double)n * (8.0 + 2.0 * (double)dim * (double)fsdp_dtype_size(dt)),
                      VCALL(FSDP__VOP_EMBEDDING, dt, (int64_t)n, (int64_t)dim));
}

static int meta_embedding_backward(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, size_t dim,
                                   const int64_t *idx, int64_t padding_idx, const void *gy,
                                   void *gw) {
    (void)idx, (void)gy, (void)gw;
    return charge_raw(dev, FSDP_KERNEL_ELEMENTWISE, dt, (double)n * (double)dim,
                      (double)n * (8.0 + 3.0 * (double)dim * (double)fsdp_dtype_size(dt)),
                      VCALL(FSDP__VOP_EMBEDDING_BWD, dt, (int64_t)n, (int64_t)dim, padding_idx));
}

static int meta_cross_entropy(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n,
                              const void *logits, const int64_t *target, int64_t ignore_index,
                              double label_smoothing, void *loss, void *logp) {
    (void)logits, (void)target, (void)ignore_index, (void)label_smoothing, (void)loss;
    fsdp_kernel_cost_t k;
    int rc = fsdp_kernel_cross_entropy(dev->ctx, (int64_t)rows, (int64_t)n, false, dt, &k);
    if (rc < 0) return rc;
    if (logp) k.bytes += (double)rows * (double)n * (double)fsdp_dtype_size(dt);
    return charge(dev, &k,
                  VCALL(FSDP__VOP_CROSS_ENTROPY, dt, (int64_t)rows, (int64_t)n, logp != NULL));
}

static int meta_cross_entropy_backward(fsdp_device_t *dev, fsdp_dtype_t dt, size_t rows, size_t n,
                                       const void *logp, const int64_t *target,
                                       int64_t ignore_index, double label_smoothing,
                                       const void *gloss, void *gx) {
    (void)logp, (void)target, (void)ignore_index, (void)label_smoothing, (void)gloss, (void)gx;
    fsdp_kernel_cost_t k;
    int rc = fsdp_kernel_cross_entropy(dev->ctx, (int64_t)rows, (int64_t)n, true, dt, &k);
    return rc < 0
               ? rc
               : charge(dev, &k, VCALL(FSDP__VOP_CROSS_ENTROPY_BWD, dt, (int64_t)rows, (int64_t)n));
}

static int meta_dropout(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, double p, uint64_t seed,
                        uint64_t stream, uint64_t offset, const void *x, void *y, uint8_t *mask) {
    (void)p, (void)seed, (void)stream, (void)offset, (void)x, (void)y;
    return charge_raw(dev, FSDP_KERNEL_ELEMENTWISE, dt, 12.0 * (double)n,
                      (double)n * (1.0 + 2.0 * (double)fsdp_dtype_size(dt)),
                      VCALL(FSDP__VOP_DROPOUT, dt, (int64_t)n, mask != NULL));
}

static int meta_sgd_step(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, void *p, const void *g,
                         void *buf, double lr, double momentum, double dampening, double wd,
                         bool nesterov, bool first) {
    (void)p, (void)g, (void)lr, (void)momentum, (void)dampening, (void)wd;
    fsdp_kernel_cost_t k;
    int rc = fsdp_kernel_optimizer(
        dev->ctx, buf ? FSDP_KERNEL_OPTIM_SGD_MOMENTUM : FSDP_KERNEL_OPTIM_SGD, (int64_t)n, dt, &k);
    return rc < 0 ? rc
                  : charge(dev, &k,
                           VCALL(FSDP__VOP_SGD, dt, (int64_t)n, buf != NULL, nesterov, first));
}

static int meta_adam_step(fsdp_device_t *dev, fsdp_dtype_t dt, size_t n, void *p, const void *g,
                          void *m, void *v, void *vmax, double lr, double beta1, double beta2,
                          double eps, double wd, bool decoupled, bool amsgrad, int64_t t) {
    (void)p, (void)g, (void)m, (void)v, (void)vmax, (void)lr, (void)beta1, (void)beta2, (void)eps;
    (void)wd, (void)t;
    fsdp_kernel_cost_t k;
    int rc = fsdp_kernel_optimizer(dev->ctx, FSDP_KERNEL_OPTIM_ADAMW, (int64_t)n, dt, &k);
    return rc < 0 ? rc : charge(dev, &k, VCALL(FSDP__VOP_ADAM, dt, (int64_t)n, amsgrad, decoupled));
}

const struct fsdp_dev_ops fsdp__meta_dev_ops = {
    .name = "meta",
    .kind = FSDP_DEVICE_META,

    .alloc = meta_alloc,
    .alloc_on = meta_alloc_on,
    .record_stream = meta_record_stream,
    .cast_on = meta_cast_on,
    .free = meta_free,
    .memcpy = meta_memcpy,
    .memset = meta_memset,
    .stream_create = meta_stream_create,
    .stream_destroy = meta_stream_destroy,
    .stream_sync = meta_stream_sync,
    .event_create = meta_event_create,
    .event_destroy = meta_event_destroy,
    .event_record = meta_event_record,
    .event_wait = meta_event_wait,
    .event_sync = meta_event_sync,
    .event_query = meta_event_query,
    .compute_stream = meta_compute_stream,
    .init = meta_init,
    .fini = meta_fini,

    .fill = meta_fill,
    .cast = meta_cast,
    .copy_strided = meta_copy_strided,
    .unary = meta_unary,
    .unary_backward = meta_unary_backward,
    .binary = meta_binary,
    .axpy = meta_axpy,
    .where = meta_where,

    .reduce_sum = meta_reduce_sum,
    .reduce_max = meta_reduce_max,
    .sum_squares = meta_sum_squares,
    .coll_reduce = meta_coll_reduce,

    .gemm = meta_gemm,
    .gemm_lp_dtypes = FSDP__DT_BIT(FSDP_DTYPE_BF16) | FSDP__DT_BIT(FSDP_DTYPE_F16),
    .gemm_lp = meta_gemm_lp,

    .softmax = meta_softmax,
    .softmax_backward = meta_softmax_backward,
    .attention = meta_attention,
    .attention_backward = meta_attention_backward,
    .layer_norm = meta_layer_norm,
    .layer_norm_backward = meta_layer_norm_backward,
    .batch_norm = meta_batch_norm,
    .batch_norm_backward = meta_batch_norm_backward,
    .embedding = meta_embedding,
    .embedding_backward = meta_embedding_backward,
    .cross_entropy = meta_cross_entropy,
    .cross_entropy_backward = meta_cross_entropy_backward,
    .dropout = meta_dropout,
    .sgd_step = meta_sgd_step,
    .adam_step = meta_adam_step,
};
