/* SPDX-License-Identifier: MIT */
/*
 * t_vsim.c: the virtual-time simulator (fsdp/vsim.h): the shape-only device, the clock's rules,
 * the virtual-time groups, and the real FSDP runtime on them.
 *
 * Times are checked exactly against the cost models (fsdp_compute_kernel_time,
 * fsdp_net_coll_time) on a toy cluster of round numbers, so every expectation follows from the
 * rules of the header: a kernel starts when its stream and the host are there, a collective when
 * its stream, the host and the network are. The FSDP checks compare the accounting of a
 * simulated rank with that of the same rank of a real sim run, byte for byte.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <fsdp.h>

#include "tap.h"
#include "toy_cluster.h"
#include "tensor/tensor_impl.h" /* grad_fresh: FSDP's mark on a zeroed gradient view */
#include "trace_json.h"

#define US 1e-6

static fsdp_cluster_t toy(int nodes) {
    return toy_cluster(nodes);
}

static fsdp_ctx_t *mkctx(int rank, int world) {
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    o.rank = rank;
    o.world_size = world;
    o.log_level = FSDP_LOG_ERROR + 1;
    fsdp_ctx_t *ctx = NULL;
    if (fsdp_ctx_create(&o, &ctx) < 0) tap_bail("fsdp_ctx_create");
    return ctx;
}

static fsdp_vsim_stats_t stats(fsdp_vsim_t *vs) {
    fsdp_vsim_stats_t s;
    fsdp_vsim_stats(vs, &s);
    return s;
}

static double kernel_time(const fsdp_cluster_t *cl, const fsdp_kernel_cost_t *k) {
    fsdp_kernel_estimate_t e;
    if (fsdp_compute_kernel_time(NULL, &cl->compute, k, &e) < 0) return -1;
    return e.seconds;
}

static double coll_time(const fsdp_cluster_t *cl, int size, int stride, fsdp_coll_kind_t kind,
                        size_t bytes) {
    fsdp_net_group_t g;
    fsdp_net_estimate_t e;
    if (fsdp_net_group_strided(NULL, &cl->net, size, stride, &g) < 0 ||
        fsdp_net_coll_time(NULL, &cl->net, &g, kind, bytes, FSDP_NET_ALGO_AUTO, &e) < 0)
        return -1;
    return e.seconds;
}

/* ---- the device ----------------------------------------------------------------------------- */

static void test_device(void) {
    fsdp_ctx_t *ctx = mkctx(1, 4);
    fsdp_cluster_t cl = toy(1);
    fsdp_vsim_t *vs = NULL;
    tap_is_int(fsdp_vsim_create(ctx, &cl, &vs), FSDP_OK, "fsdp_vsim_create: rank 1 of 4");
    fsdp_device_t *dev = fsdp_vsim_device(vs);
    fsdp_pg_t *world = fsdp_vsim_world(vs);
    tap_ok(fsdp_device_kind(dev) == FSDP_DEVICE_META, "the device is FSDP_DEVICE_META");
    tap_is_str(fsdp_device_name(dev), "meta", "its name");
    tap_ok(world && fsdp_pg_rank(world) == 1 && fsdp_pg_size(world) == 4,
           "the world group is rank 1 of 4");
    tap_ok(fsdp_ctx_pg(ctx) == world, "and became the context's world group");
    tap_is_str(fsdp_pg_backend(world), "vsim", "its backend is vsim");
    fsdp_ctx_set_device(ctx, dev);

    /* Allocation is counted, not backed: a terabyte costs nothing. */
    fsdp_mem_stats_t m0, m1;
    fsdp_mem_get_stats(ctx, &m0);
    fsdp_tensor_t *big = NULL;
    int64_t tb[2] = {1 << 20, 1 << 18}; /* 2^38 f32: 1 TiB */
    tap_is_int(fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, tb, FSDP_MEM_ACTIVATIONS, &big), FSDP_OK,
               "a 1 TiB shape-only tensor is created");
    fsdp_mem_get_stats(ctx, &m1);
    tap_is_size(m1.current[FSDP_MEM_ACTIVATIONS] - m0.current[FSDP_MEM_ACTIVATIONS],
                (size_t)1 << 40, "and counted in its category, byte for byte");
    tap_ok((uintptr_t)fsdp_tensor_data(big) >= (uintptr_t)0xfff0000000000000ull,
           "its address lies in the upper half, where no host memory is");
    fsdp_tensor_release(big);
    fsdp_mem_get_stats(ctx, &m1);
    tap_is_size(m1.current[FSDP_MEM_ACTIVATIONS], m0.current[FSDP_MEM_ACTIVATIONS],
                "released, the count goes back");

    /* Values read back are zeros, whatever was written. */
    fsdp_tensor_t *a = NULL, *b = NULL, *c = NULL;
    int64_t sa[2] = {256, 512}, sb[2] = {512, 128};
    fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 2, sa, 3.0, FSDP_MEM_OTHER, &a);
    double v = -1;
    tap_ok(a && fsdp_tensor_item(a, 7, &v) == FSDP_OK && v == 0,
           "a tensor filled with 3 reads back 0 (got %g)", v);

    /* Random initialisation draws nothing but moves the stream as a real draw does. */
    fsdp_rng_t before = *fsdp_ctx_rng(ctx);
    tap_is_int(fsdp_tensor_normal_(a, 0, 1), FSDP_OK, "normal_ on a shape-only tensor");
    tap_is_uint(fsdp_ctx_rng(ctx)->offset - before.offset, (256 * 512 + 3) / 4,
                "advances the random stream by the blocks the values would take");

    /* A matrix product costs the roofline's time for its FLOPs and bytes, exactly. */
    fsdp_vsim_reset_stats(vs);
    fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, sb, FSDP_MEM_OTHER, &b);
    fsdp_vsim_reset_stats(vs);
    tap_is_int(fsdp_matmul(a, b, &c), FSDP_OK, "a (256 x 512) @ (512 x 128) product");
    fsdp_kernel_cost_t k;
    fsdp_kernel_matmul(NULL, 256, 128, 512, 1, FSDP_DTYPE_F32, &k);
    fsdp_vsim_stats_t s = stats(vs);
    tap_is_near(s.class_time[FSDP_KERNEL_MATMUL], kernel_time(&cl, &k), 1e-12, 0,
                "charges the matmul roofline time");
    tap_is_near(s.matmul_flops, 2.0 * 256 * 512 * 128, 0, 0, "and counts its FLOPs");
    tap_is_near(s.now - s.start, s.compute_busy, 1e-12, 0,
                "the step is the compute stream's busy time when nothing waits");
    /* fsdp_matmul is the product and the clearing of its output: its time as a whole. */
    double tmm = s.now - s.start;
    tap_is_near(s.compute_idle, 0, 0, 0, "and it never stood idle");
    fsdp_tensor_release(c);

    /* A copy on a side stream overlaps a kernel on the compute stream. */
    fsdp_stream_t *side = NULL;
    fsdp_event_t *ev = NULL;
    fsdp_stream_create(dev, &side);
    fsdp_event_create(dev, &ev);
    void *buf = NULL;
    size_t nb = (size_t)64 << 20;
    fsdp_device_alloc(dev, FSDP_MEM_OTHER, nb, &buf);
    fsdp_vsim_reset_stats(vs);
    double t0 = stats(vs).start;
    fsdp_device_memcpy(dev, buf, buf, nb, FSDP_COPY_D2D, side); /* 128 MiB moved: 134 us */
    fsdp_matmul(a, b, &c);                                      /* about 27 us */
    fsdp_tensor_release(c);
    fsdp_kernel_cost_t cp = {
        .cls = FSDP_KERNEL_ELEMENTWISE, .dtype = FSDP_DTYPE_U8, .bytes = 2.0 * (double)nb};
    double tcopy = kernel_time(&cl, &cp);
    s = stats(vs);
    tap_is_near(s.now - t0, tcopy, 1e-12, 0,
                "a copy on a side stream and a kernel run side by side: max(%g, %g) s", tcopy, tmm);
    /* The compute stream waits for the copy through an event: the next kernel starts after it. */
    fsdp_event_record(ev, side);
    fsdp_event_wait(ev, NULL);
    fsdp_matmul(a, b, &c);
    fsdp_tensor_release(c);
    s = stats(vs);
    tap_is_near(s.now - t0, tcopy + tmm, 1e-12, 0, "a kernel after an event wait starts after it");
    tap_is_near(s.compute_idle, tcopy - tmm, 1e-9, 0,
                "and the compute stream's wait is idle time (%g s)", tcopy - tmm);
    tap_ok(s.copy_busy >= tcopy && s.copy_busy < tcopy + tmm,
           "the copy's time is in copy_busy (%g s)", s.copy_busy);
    fsdp_device_free(dev, buf);

    /* Collectives: on a stream they overlap; a stream wait makes the compute stream wait. */
    fsdp_tensor_t *x = NULL, *y = NULL;
    int64_t sx[1] = {1 << 20}, sy[1] = {4 << 20};
    fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 1, sx, FSDP_MEM_COMM, &x);
    fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 1, sy, FSDP_MEM_COMM, &y);
    double tag = coll_time(&cl, 4, 1, FSDP_COLL_ALL_GATHER, (size_t)16 << 20);
    fsdp_vsim_reset_stats(vs);
    t0 = stats(vs).start;
    fsdp_coll_desc_t d = {.kind = FSDP_COLL_ALL_GATHER,
                          .send = fsdp_tensor_data(x),
                          .recv = fsdp_tensor_data(y),
                          .count = 1 << 20,
                          .dtype = FSDP_DTYPE_F32,
                          .stream = fsdp_stream_native(side)};
    fsdp_work_t *w = NULL;
    tap_is_int(fsdp_pg_collective(world, &d, &w), FSDP_OK, "an all-gather of 16 MiB on a stream");
    fsdp_matmul(a, b, &c);
    fsdp_tensor_release(c);
    s = stats(vs);
    tap_is_near(s.comm_busy, tag, 1e-12, 0, "costs the network model's time (%g s)", tag);
    tap_is_near(s.coll_bytes[FSDP_COLL_ALL_GATHER], 16.0 * 1048576, 0, 0,
                "counts the nccl-tests bytes");
    tap_is_near(s.now - t0, fmax(tag, tmm), 1e-12, 0, "and overlaps the kernel queued after it");
    tap_is_int(fsdp_work_wait_stream(w, fsdp_stream_native(NULL)), FSDP_OK,
               "the compute stream waits for it");
    fsdp_work_release(w);
    fsdp_matmul(a, b, &c);
    fsdp_tensor_release(c);
    s = stats(vs);
    tap_is_near(s.now - t0, tag + tmm, 1e-12, 0, "the next kernel starts at the all-gather's end");
    tap_is_near(s.compute_idle, tag - tmm, 1e-9, 0, "the exposed communication is idle time");
    /* Without a stream a collective runs on the compute stream, as on NCCL's default stream. */
    fsdp_vsim_reset_stats(vs);
    t0 = stats(vs).start;
    tap_is_int(fsdp_pg_all_gather(world, fsdp_tensor_data(x), fsdp_tensor_data(y), 1 << 20,
                                  FSDP_DTYPE_F32, NULL),
               FSDP_OK, "a blocking all-gather");
    fsdp_matmul(a, b, &c);
    fsdp_tensor_release(c);
    s = stats(vs);
    tap_is_near(s.now - t0, tag + tmm, 1e-12, 0, "is followed, not overlapped, by the next kernel");
    tap_is_uint(s.collectives, 1, "one collective counted");

    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    fsdp_event_destroy(ev);
    fsdp_stream_destroy(side);
    fsdp_ctx_set_device(ctx, NULL);
    fsdp_vsim_destroy(vs);
    fsdp_ctx_destroy(ctx);
}

/* ---- contention: a collective holds SMs --------------------------------------------------- */

/* Runs fsdp_matmul(a, b) count times on the compute stream; returns the simulated seconds from
 * t0 to the end of everything queued. */
static double products(fsdp_vsim_t *vs, fsdp_tensor_t *a, fsdp_tensor_t *b, int count, double t0) {
    for (int i = 0; i < count; i++) {
        fsdp_tensor_t *c = NULL;
        fsdp_matmul(a, b, &c);
        fsdp_tensor_release(c);
    }
    return stats(vs).now - t0;
}

static void test_contention(void) {
    fsdp_ctx_t *ctx = mkctx(0, 4);
    fsdp_cluster_t cl = toy(1);
    cl.compute.sms = 10;
    cl.net.intra_channels = 2; /* a collective takes a fifth of the GPU */
    cl.net.inter_channels = 1;
    fsdp_vsim_t *vs = NULL;
    tap_is_int(fsdp_vsim_create(ctx, &cl, &vs), FSDP_OK, "a GPU of 10 SMs, collectives on 2");
    fsdp_device_t *dev = fsdp_vsim_device(vs);
    fsdp_pg_t *world = fsdp_vsim_world(vs);
    fsdp_ctx_set_device(ctx, dev);
    fsdp_stream_t *side = NULL;
    fsdp_stream_create(dev, &side);
    fsdp_tensor_t *a = NULL, *b = NULL, *x = NULL, *y = NULL;
    int64_t sa[2] = {256, 512}, sb[2] = {512, 128}, sx[1] = {1 << 20}, sy[1] = {4 << 20};
    fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, sa, FSDP_MEM_OTHER, &a);
    fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, sb, FSDP_MEM_OTHER, &b);
    fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 1, sx, FSDP_MEM_COMM, &x);
    fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 1, sy, FSDP_MEM_COMM, &y);
    fsdp_coll_desc_t d = {.kind = FSDP_COLL_ALL_GATHER,
                          .send = fsdp_tensor_data(x),
                          .recv = fsdp_tensor_data(y),
                          .count = 1 << 20,
                          .dtype = FSDP_DTYPE_F32,
                          .stream = fsdp_stream_native(side)};
    double tag = coll_time(&cl, 4, 1, FSDP_COLL_ALL_GATHER, (size_t)16 << 20);

    /* Alone, one product; then as many as fit in a fifth of the all-gather. */
    fsdp_vsim_reset_stats(vs);
    double tmm = products(vs, a, b, 1, stats(vs).start);
    int fit = (int)(0.2 * tag / tmm);
    tap_ok(fit >= 1, "the products are short beside the all-gather (%g against %g s)", tmm, tag);

    /* Kernels inside a collective run at 8/10 of their speed. */
    fsdp_vsim_reset_stats(vs);
    double t0 = stats(vs).start;
    fsdp_work_t *w = NULL;
    fsdp_pg_collective(world, &d, &w);
    double got = products(vs, a, b, fit, t0);
    fsdp_vsim_stats_t s = stats(vs);
    tap_is_near(got, tag, 1e-12, 0, "the step is the all-gather's (%g s)", tag);
    tap_is_near(s.compute_busy, fit * tmm / 0.8, 1e-12, 0,
                "%d products beside it take 1/0.8 of their time (%g s)", fit, fit * tmm / 0.8);
    tap_is_near(s.contention, fit * tmm * 0.25, 1e-12, 0, "the difference is the contention");
    fsdp_work_wait_stream(w, fsdp_stream_native(NULL));
    fsdp_work_release(w);

    /* Work that outlasts the collective is slowed only while it overlaps it. */
    int many = (int)(2 * tag / tmm) + 1;
    fsdp_vsim_reset_stats(vs);
    t0 = stats(vs).start;
    fsdp_pg_collective(world, &d, &w);
    got = products(vs, a, b, many, t0);
    s = stats(vs);
    /* In [0, tag) the stream does 0.8 tag of work and the rest runs at full speed; the product
     * that straddles the end is slowed for its part inside. */
    double want = many * tmm + 0.2 * tag;
    tap_is_near(got, want, 1e-12, 0, "%d products over an all-gather: their time + 0.2 x it (%g s)",
                many, want);
    tap_is_near(s.contention, 0.2 * tag, 1e-12, 0, "the contention is a fifth of the collective");
    fsdp_work_wait_stream(w, fsdp_stream_native(NULL));
    fsdp_work_release(w);

    /* A kernel after the collective's end runs at full speed. */
    fsdp_vsim_reset_stats(vs);
    t0 = stats(vs).start;
    fsdp_pg_collective(world, &d, &w);
    fsdp_work_wait_stream(w, fsdp_stream_native(NULL));
    fsdp_work_release(w);
    got = products(vs, a, b, 1, t0);
    s = stats(vs);
    tap_is_near(got, tag + tmm, 1e-12, 0, "after a stream wait the product runs unslowed");
    tap_is_near(s.contention, 0, 0, 0, "with no contention");

    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    fsdp_stream_destroy(side);
    fsdp_ctx_set_device(ctx, NULL);
    fsdp_vsim_destroy(vs);

    /* A collective that holds every SM (the CPU model whose ranks fill the cores) stops the
     * kernels it overlaps: a product issued beside it ends the collective's time after it would
     * have. */
    cl.net.intra_channels = cl.compute.sms;
    tap_is_int(fsdp_vsim_create(ctx, &cl, &vs), FSDP_OK, "a collective on all 10 SMs");
    dev = fsdp_vsim_device(vs);
    world = fsdp_vsim_world(vs);
    fsdp_ctx_set_device(ctx, dev);
    fsdp_stream_create(dev, &side);
    fsdp_tensor_t *a2 = NULL, *b2 = NULL, *x2 = NULL, *y2 = NULL;
    fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, sa, FSDP_MEM_OTHER, &a2);
    fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, sb, FSDP_MEM_OTHER, &b2);
    fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 1, sx, FSDP_MEM_COMM, &x2);
    fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 1, sy, FSDP_MEM_COMM, &y2);
    d.send = fsdp_tensor_data(x2);
    d.recv = fsdp_tensor_data(y2);
    d.stream = fsdp_stream_native(side);
    fsdp_vsim_reset_stats(vs);
    t0 = stats(vs).start;
    fsdp_pg_collective(world, &d, &w);
    got = products(vs, a2, b2, 1, t0);
    s = stats(vs);
    tap_is_near(got, tag + tmm, 1e-12, 0, "  a product beside it ends after it (%g s)", tag + tmm);
    tap_is_near(s.contention, tag, 1e-12, 0, "  the contention is the whole collective");
    fsdp_work_wait_stream(w, fsdp_stream_native(NULL));
    fsdp_work_release(w);
    fsdp_tensor_release(a2);
    fsdp_tensor_release(b2);
    fsdp_tensor_release(x2);
    fsdp_tensor_release(y2);
    fsdp_stream_destroy(side);
    fsdp_ctx_set_device(ctx, NULL);
    fsdp_vsim_destroy(vs);
    cl.net.intra_channels = 2;

    /* A collective may hold every SM (the kernels it overlaps then wait), not more. */
    cl.net.inter_channels = 10;
    tap_is_int(fsdp_cluster_check(ctx, &cl), FSDP_OK, "inter_channels = sms is accepted");
    cl.net.inter_channels = 11;
    tap_is_int(fsdp_cluster_check(ctx, &cl), FSDP_EINVAL, "inter_channels > sms is refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "net.inter_channels is 11", "naming the field");
    tap_has_str(fsdp_ctx_last_error(ctx), "compute.sms (10)", "and the SMs");
    cl.net.inter_channels = -1;
    tap_is_int(fsdp_cluster_check(ctx, &cl), FSDP_EINVAL, "a negative channel count is refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "net.inter_channels is -1", "naming it");
    cl.net.inter_channels = 1;
    cl.compute.sms = -3;
    tap_is_int(fsdp_cluster_check(ctx, &cl), FSDP_EINVAL, "negative SMs are refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "compute.sms is -3", "naming them");
    fsdp_ctx_destroy(ctx);
}

/* ---- native half kernels -------------------------------------------------------------------- */

/* A bf16 relu's kernels and bytes on a simulator whose kernels are (or are not) native. */
static void relu_cost(bool native, uint64_t *kernels, double *seconds) {
    fsdp_ctx_t *ctx = mkctx(0, 1);
    fsdp_cluster_t cl = toy(1);
    cl.compute.lowp_kernels = native;
    fsdp_vsim_t *vs = NULL;
    fsdp_vsim_create(ctx, &cl, &vs);
    fsdp_ctx_set_device(ctx, fsdp_vsim_device(vs));
    fsdp_tensor_t *x = NULL, *y = NULL;
    int64_t shape[1] = {1 << 24};
    fsdp_tensor_empty(ctx, FSDP_DTYPE_BF16, 1, shape, FSDP_MEM_OTHER, &x);
    fsdp_vsim_reset_stats(vs);
    int rc = fsdp_relu(x, &y);
    fsdp_vsim_stats_t s = stats(vs);
    *kernels = rc == 0 ? s.kernels : 0;
    *seconds = s.now - s.start;
    tap_ok(rc == 0 && y && fsdp_tensor_dtype(y) == FSDP_DTYPE_BF16,
           "%s kernels: a bf16 relu gives a bf16 tensor", native ? "native" : "libfsdp");
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    fsdp_ctx_set_device(ctx, NULL);
    fsdp_vsim_destroy(vs);
    fsdp_ctx_destroy(ctx);
}

static void test_native_half(void) {
    uint64_t kw = 0, kn = 0;
    double tw = 0, tn = 0;
    relu_cost(false, &kw, &tw);
    relu_cost(true, &kn, &tn);
    fsdp_cluster_t cl = toy(1);
    fsdp_kernel_cost_t k;
    fsdp_kernel_elementwise(NULL, 1 << 24, 1, 1, 1, FSDP_DTYPE_BF16, &k);
    tap_is_uint(kn, 1, "native: one kernel, no casts");
    tap_is_near(tn, kernel_time(&cl, &k), 1e-12, 0, "native: charged at bf16 bytes (%g s)", tn);
    tap_is_uint(kw, 3, "libfsdp: widen, relu in f32, round (3 kernels)");
    tap_ok(tw > 2.5 * tn, "libfsdp's widened relu costs %g s, over 2.5 times the native one", tw);
}

/* ---- a fresh gradient is written, not added ------------------------------------------------- */

/* backward of sum(2 x) for a bf16 leaf x whose .grad is a zeroed tensor, marked fresh or not;
 * on ctx's device. Returns x's gradient (retained), NULL on failure. */
static fsdp_tensor_t *grad_of_2x(fsdp_ctx_t *ctx, bool fresh) {
    int64_t shape[1] = {1 << 16};
    fsdp_tensor_t *x = NULL, *g0 = NULL, *y = NULL, *l = NULL, *out = NULL;
    fsdp_tensor_zeros(ctx, FSDP_DTYPE_BF16, 1, shape, FSDP_MEM_PARAMS, &x);
    fsdp_tensor_zeros(ctx, FSDP_DTYPE_BF16, 1, shape, FSDP_MEM_GRADS, &g0);
    fsdp_tensor_set_requires_grad(x, true);
    fsdp_tensor_set_grad(x, g0);
    x->grad_fresh = fresh;
    int dims[1] = {0};
    if (fsdp_scale(x, 2.0, &y) == 0 && fsdp_sum(y, 1, dims, false, &l) == 0 &&
        fsdp_backward(l, NULL) == 0) {
        out = fsdp_tensor_retain(fsdp_tensor_grad(x));
        tap_ok(!x->grad_fresh, "  the mark is cleared by the first write (fresh %d)", fresh);
    }
    fsdp_tensor_release(l);
    fsdp_tensor_release(y);
    fsdp_tensor_release(g0);
    fsdp_tensor_release(x);
    return out;
}

static void test_fresh_grad(void) {
    /* On the CPU: the same gradient, bit for bit. */
    fsdp_ctx_t *ctx = mkctx(0, 1);
    fsdp_tensor_t *a = grad_of_2x(ctx, false), *b = grad_of_2x(ctx, true);
    double va = -1, vb = -1;
    if (a) fsdp_tensor_item(a, 123, &va);
    if (b) fsdp_tensor_item(b, 123, &vb);
    tap_ok(a && b && va == 2 && vb == 2, "a fresh gradient view receives the gradient (%g, %g)", va,
           vb);
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    fsdp_ctx_destroy(ctx);
    /* On the simulator: written, it costs one copy; added, the widening add's kernels. */
    ctx = mkctx(0, 1);
    fsdp_cluster_t cl = toy(1);
    fsdp_vsim_t *vs = NULL;
    fsdp_vsim_create(ctx, &cl, &vs);
    fsdp_ctx_set_device(ctx, fsdp_vsim_device(vs));
    uint64_t k[2];
    double t[2];
    for (int fresh = 0; fresh < 2; fresh++) {
        fsdp_vsim_reset_stats(vs);
        fsdp_tensor_release(grad_of_2x(ctx, fresh));
        fsdp_vsim_stats_t s = stats(vs);
        k[fresh] = s.kernels;
        t[fresh] = s.compute_busy;
    }
    tap_ok(k[1] + 3 <= k[0] && t[1] < t[0],
           "written: %llu kernels, %g s; added: %llu kernels, %g s", (unsigned long long)k[1], t[1],
           (unsigned long long)k[0], t[0]);
    fsdp_ctx_set_device(ctx, NULL);
    fsdp_vsim_destroy(vs);
    fsdp_ctx_destroy(ctx);
}

/* ---- groups and host buffers ---------------------------------------------------------------- */

static void test_groups(void) {
    fsdp_ctx_t *ctx = mkctx(5, 16);
    fsdp_cluster_t cl = toy(2);
    fsdp_vsim_t *vs = NULL;
    tap_is_int(fsdp_vsim_create(ctx, &cl, &vs), FSDP_OK, "rank 5 of 16 on 2 nodes of 8");
    fsdp_pg_t *world = fsdp_vsim_world(vs);

    /* Host buffers: as if every rank had passed the same values. */
    double in = 2.5, out = 0;
    fsdp_pg_all_reduce(world, &in, &out, 1, FSDP_DTYPE_F64, FSDP_REDOP_SUM, NULL);
    tap_is_near(out, 40, 0, 0, "a host all_reduce sum gives 16 x the value");
    fsdp_pg_all_reduce(world, &in, &out, 1, FSDP_DTYPE_F64, FSDP_REDOP_AVG, NULL);
    tap_is_near(out, 2.5, 0, 0, "avg gives the value");
    int64_t mine = 7, all[16] = {0};
    fsdp_pg_all_gather(world, &mine, all, 1, FSDP_DTYPE_I64, NULL);
    int same = 1;
    for (int i = 0; i < 16; i++)
        same &= all[i] == 7;
    tap_ok(same, "a host all_gather repeats the value on every rank");
    fsdp_pg_t *sp = NULL;
    tap_is_int(fsdp_pg_split(world, 5 % 2, 5, &sp), FSDP_OK, "fsdp_pg_split works");
    tap_is_int(sp ? fsdp_pg_size(sp) : -1, 16, "and puts every rank in one group (symmetric)");

    /* fsdp_vsim_group: HYBRID_SHARD's groups, with their place on the nodes. */
    fsdp_pg_t *shard = NULL, *rep = NULL, *again = NULL;
    tap_is_int(fsdp_vsim_group(vs, 8, 1, &shard), FSDP_OK, "shard groups of 8");
    tap_ok(shard && fsdp_pg_size(shard) == 8 && fsdp_pg_rank(shard) == 5,
           "rank 5 is rank 5 of its shard group");
    tap_is_int(fsdp_vsim_group(vs, 2, 8, &rep), FSDP_OK, "replicate groups of 2 with stride 8");
    tap_ok(rep && fsdp_pg_size(rep) == 2 && fsdp_pg_rank(rep) == 0, "rank 5 is rank 0 of {5, 13}");
    fsdp_vsim_group(vs, 8, 1, &again);
    tap_ok(again == shard, "asking again gives the same group");
    fsdp_vsim_stats_t s0, s1;
    fsdp_vsim_reset_stats(vs);
    fsdp_vsim_stats(vs, &s0);
    fsdp_device_t *dev = fsdp_vsim_device(vs);
    void *sb = NULL, *rb = NULL;
    fsdp_device_alloc(dev, FSDP_MEM_COMM, (size_t)1 << 20, &sb);
    fsdp_device_alloc(dev, FSDP_MEM_COMM, (size_t)2 << 20, &rb);
    fsdp_pg_all_reduce(rep, sb, sb, 1 << 18, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    fsdp_vsim_stats(vs, &s1);
    double want = coll_time(&cl, 2, 8, FSDP_COLL_ALL_REDUCE, (size_t)1 << 20);
    tap_is_near(s1.now - s0.start, want, 1e-12, 0,
                "an all_reduce across nodes costs the strided group's time (%g s)", want);
    fsdp_vsim_reset_stats(vs);
    fsdp_vsim_stats(vs, &s0);
    fsdp_pg_all_gather(shard, sb, rb, 1 << 16, FSDP_DTYPE_F32, NULL);
    fsdp_vsim_stats(vs, &s1);
    want = coll_time(&cl, 8, 1, FSDP_COLL_ALL_GATHER, (size_t)2 << 20);
    tap_is_near(s1.now - s0.start, want, 1e-12, 0, "an all_gather in a node, the NVLink time");
    fsdp_device_free(dev, sb);
    fsdp_device_free(dev, rb);

    /* Errors name what is wrong. */
    fsdp_pg_t *bad = NULL;
    tap_is_int(fsdp_vsim_group(vs, 3, 1, &bad), FSDP_EINVAL, "a group of 3 in 16 is refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "size 3 and stride 1", "naming the sizes");
    fsdp_vsim_destroy(vs);
    fsdp_ctx_destroy(ctx);

    ctx = mkctx(0, 40);
    tap_is_int(fsdp_vsim_create(ctx, &cl, &vs), FSDP_EINVAL, "40 ranks on 16 GPUs are refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "world_size 40 does not fit", "with the sizes");
    fsdp_ctx_destroy(ctx);
    ctx = mkctx(0, 12);
    tap_is_int(fsdp_vsim_create(ctx, &cl, &vs), FSDP_EINVAL,
               "12 ranks over nodes of 8 are refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "whole nodes", "as not filling whole nodes");
    fsdp_ctx_destroy(ctx);
}

/* ---- FSDP on the simulator ------------------------------------------------------------------ */

typedef struct acct {
    size_t wrapped[FSDP_MEM_NCAT]; /* current bytes after the wrap */
    size_t stepped[FSDP_MEM_NCAT]; /* after one step (zero_grad(false) keeps the gradients) */
} acct_t;

typedef struct fsdp_case {
    int rank;
    fsdp_backward_prefetch_t prefetch;
    bool bf16;         /* mixed precision in bf16 */
    int limit;         /* limit_all_gathers: 0 for the default (2), -1 for none */
    int layers;        /* GPT blocks: 0 for 3 */
    int width;         /* d_model: 0 for 32 */
    bool ckpt;         /* activation checkpointing of every block */
    bool gpt3;         /* GPT-3 175B's blocks (d_model 12288, 96 heads, 2048 positions) */
    size_t peak_grads; /* peak gradient bytes of the measured step */
    const char *trace; /* record the measured step's trace there (simulated runs) */
    acct_t got;
    double step, compute, comm, idle;
} fsdp_case_t;

static void tiny_cfg(fsdp_gpt_config_t *cfg) {
    fsdp_gpt_config_init(cfg);
    cfg->vocab = 96;
    cfg->max_seq = 16;
    cfg->n_layer = 3;
    cfg->n_head = 2;
    cfg->d_model = 32;
}

/* One rank's step of the tiny GPT: wrap, forward, backward, AdamW. */
static int gpt_step(fsdp_ctx_t *ctx, fsdp_case_t *c, fsdp_vsim_t *vs) {
    fsdp_gpt_config_t cfg;
    tiny_cfg(&cfg);
    if (c->layers) cfg.n_layer = c->layers;
    if (c->width) cfg.d_model = c->width;
    if (c->gpt3) {
        cfg.d_model = 12288;
        cfg.n_head = 96;
        cfg.max_seq = 2048;
        cfg.vocab = 50257;
    }
    fsdp_module_t *model = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_tensor_t *in = NULL, *loss = NULL;
    fsdp_trace_t *trace = NULL;
    int rc = fsdp_gpt_recipe_create_model(ctx, &cfg, 3, &model);
    fsdp_options_t fo;
    fsdp_options_init(&fo);
    fo.backward_prefetch = c->prefetch;
    fo.limit_all_gathers = c->limit < 0 ? 0 : c->limit ? c->limit : 2;
    if (c->bf16) {
        fo.mixed_precision.enabled = true;
        fo.mixed_precision.param_dtype = FSDP_DTYPE_BF16;
        fo.mixed_precision.reduce_dtype = FSDP_DTYPE_BF16;
    }
    if (rc == 0) rc = fsdp_gpt_recipe_wrap(model, &fo, &root);
    fsdp_mem_stats_t m;
    fsdp_mem_get_stats(ctx, &m);
    memcpy(c->got.wrapped, m.current, sizeof m.current);
    if (rc == 0 && c->ckpt)
        rc = fsdp_apply_activation_checkpointing(model, "GPTBlock", NULL, NULL, NULL);
    if (rc == 0) rc = fsdp_gpt_recipe_create_adamw(model, NULL, &opt);
    int64_t shape[2] = {c->gpt3 ? 1 : 2, cfg.max_seq};
    if (rc == 0) rc = fsdp_tensor_zeros(ctx, FSDP_DTYPE_I64, 2, shape, FSDP_MEM_OTHER, &in);
    for (int s = 0; s < 2 && rc == 0; s++) {
        if (vs && s == 1) {
            fsdp_vsim_reset_stats(vs);
            fsdp_mem_reset_peaks(ctx);
            if (c->trace && (rc = fsdp_trace_create(NULL, &trace)) == 0)
                rc = fsdp_trace_start(ctx, trace);
        }
        rc = fsdp_optim_zero_grad(opt, true);
        if (rc == 0) rc = fsdp_gpt_forward_loss(model, in, in, &loss, NULL);
        if (rc == 0) rc = fsdp_backward(loss, NULL);
        fsdp_tensor_release(loss);
        loss = NULL;
        if (rc == 0) rc = fsdp_optim_step(opt);
    }
    if (vs) fsdp_vsim_sync(vs);
    if (trace) {
        fsdp_trace_stop(ctx);
        if (rc == 0) rc = fsdp_trace_write(trace, c->trace);
        fsdp_trace_destroy(trace);
    }
    fsdp_mem_get_stats(ctx, &m);
    memcpy(c->got.stepped, m.current, sizeof m.current);
    c->peak_grads = m.peak[FSDP_MEM_GRADS];
    if (vs) {
        fsdp_vsim_stats_t st;
        fsdp_vsim_stats(vs, &st);
        c->step = st.now - st.start;
        c->compute = st.compute_busy;
        c->comm = st.comm_busy;
        c->idle = st.compute_idle;
    }
    fsdp_tensor_release(in);
    fsdp_optim_destroy(opt);
    fsdp_unit_destroy(root);
    fsdp_module_release(model);
    return rc;
}

static int real_rank(fsdp_ctx_t *ctx, void *arg) {
    fsdp_case_t *c = arg;
    if (fsdp_ctx_rank(ctx) != c->rank) {
        fsdp_case_t mine = *c;
        return gpt_step(ctx, &mine, NULL);
    }
    return gpt_step(ctx, c, NULL);
}

static int simulated(const fsdp_cluster_t *cl, int world, fsdp_case_t *c) {
    fsdp_ctx_t *ctx = mkctx(c->rank, world);
    fsdp_vsim_t *vs = NULL;
    int rc = fsdp_vsim_create(ctx, cl, &vs);
    if (rc == 0) {
        fsdp_ctx_set_device(ctx, fsdp_vsim_device(vs));
        rc = gpt_step(ctx, c, vs);
        if (rc < 0) tap_diag("simulated step: %s", fsdp_ctx_last_error(ctx));
    }
    fsdp_ctx_set_device(ctx, NULL);
    fsdp_vsim_destroy(vs);
    fsdp_ctx_destroy(ctx);
    return rc;
}

static void test_fsdp(void) {
    /* The accounting of a simulated rank is the real rank's. */
    fsdp_sim_options_t so;
    fsdp_sim_options_init(&so);
    so.world_size = 4;
    fsdp_case_t real = {.rank = 2, .prefetch = FSDP_BACKWARD_PRE};
    tap_is_int(fsdp_sim_run(&so, real_rank, &real, NULL), FSDP_OK, "a real 4-rank step (sim)");
    fsdp_cluster_t cl = toy(1);
    fsdp_case_t sim = {.rank = 2, .prefetch = FSDP_BACKWARD_PRE};
    tap_is_int(simulated(&cl, 4, &sim), FSDP_OK, "the same step, simulated as rank 2 of 4");
    static const fsdp_mem_cat_t cats[] = {FSDP_MEM_PARAMS, FSDP_MEM_GRADS, FSDP_MEM_OPTIM};
    for (size_t i = 0; i < 3; i++) {
        tap_is_size(sim.got.wrapped[cats[i]], real.got.wrapped[cats[i]],
                    "after the wrap, %s bytes are the real rank's", fsdp_mem_cat_name(cats[i]));
        tap_is_size(sim.got.stepped[cats[i]], real.got.stepped[cats[i]],
                    "after two steps, %s bytes are the real rank's", fsdp_mem_cat_name(cats[i]));
    }
    tap_ok(sim.step > 0 && sim.step >= fmax(sim.compute, sim.comm) - 1e-12 &&
               sim.step <= sim.compute + sim.comm + sim.idle + 1e-9,
           "the step (%g s) lies between max(compute %g, comm %g) and their sum", sim.step,
           sim.compute, sim.comm);

    /* Deterministic: the same configuration gives the same times, bit for bit. */
    fsdp_case_t again = {.rank = 2, .prefetch = FSDP_BACKWARD_PRE};
    simulated(&cl, 4, &again);
    tap_ok(again.step == sim.step && again.idle == sim.idle,
           "a second simulation gives the same step time bit for bit");

    /* Prefetch hides communication: on a slow network over two nodes the compute stream waits
     * less with BACKWARD_PRE than without prefetch, and the step is shorter. */
    fsdp_cluster_t slow = toy(2);
    slow.net.nic_bw = 0.05e9;
    slow.compute.matmul_flops[FSDP_DTYPE_F32] = 0.02e12;
    fsdp_case_t pre = {.rank = 9, .prefetch = FSDP_BACKWARD_PRE};
    fsdp_case_t none = {.rank = 9, .prefetch = FSDP_BACKWARD_PREFETCH_NONE};
    tap_is_int(simulated(&slow, 16, &pre), FSDP_OK, "16 ranks over 2 nodes, prefetch");
    tap_is_int(simulated(&slow, 16, &none), FSDP_OK, "and without prefetch");
    tap_ok(pre.idle < none.idle && pre.step < none.step,
           "prefetch exposes less communication (%g < %g s) and shortens the step (%g < %g s)",
           pre.idle, none.idle, pre.step, none.step);
    tap_is_near(pre.comm, none.comm, 1e-12, 0, "for the same communication time");

    /* The trace of a simulated step is in simulated time: its collectives' spans add up to the
     * network's busy time, and with prefetch more of them overlap compute spans. */
    char tpre[64], tnone[64];
    snprintf(tpre, sizeof tpre, "t_vsim_pre_%d.json", (int)getpid());
    snprintf(tnone, sizeof tnone, "t_vsim_none_%d.json", (int)getpid());
    fsdp_case_t tp = pre, tn = none;
    tp.trace = tpre;
    tn.trace = tnone;
    tap_is_int(simulated(&slow, 16, &tp), FSDP_OK, "the prefetching step, traced");
    tap_is_int(simulated(&slow, 16, &tn), FSDP_OK, "the step without prefetch, traced");
    tap_ok(tp.step == pre.step, "tracing does not change the simulated step (%g s)", tp.step);
    tj_trace_t a, b;
    char err[1024] = "";
    int la = tj_load(tpre, &a), lb = tj_load(tnone, &b);
    tap_ok(la == 0 && lb == 0 && tj_check_nesting(&a, err, sizeof err) == 0,
           "both traces are valid and nest (%s%s)", la ? a.err : "", err);
    if (la == 0 && lb == 0) {
        int64_t comm_ns = 0, comm_none = 0;
        double fa = tj_overlap_fraction(&a, 9, &comm_ns);
        double fb = tj_overlap_fraction(&b, 9, &comm_none);
        tap_is_near((double)comm_ns * 1e-9, tp.comm, 1e-6, 1e-8,
                    "the communication spans add up to the network's busy time");
        tap_is_uint(tj_count(&a, 9, 1, "forward", NULL), 4, "4 forward spans (3 blocks, root)");
        tap_is_uint(tj_count(&a, 9, 1, "backward", NULL), 4, "and 4 backward spans");
        tap_ok(fa > fb, "prefetch overlaps more communication with compute (%.2f > %.2f)", fa, fb);
        int64_t last_end = 0;
        for (size_t i = 0; i < a.nspans; i++)
            if (a.spans[i].ts + a.spans[i].dur > last_end)
                last_end = a.spans[i].ts + a.spans[i].dur;
        tap_ok(last_end <= (int64_t)(1e9 * (tp.step + 10)) && last_end > (int64_t)(1e9 * tp.step),
               "the spans lie in simulated time (last end %.6f s)", (double)last_end * 1e-9);
    }
    tj_free(&a);
    tj_free(&b);
    remove(tpre);
    remove(tnone);

    /* The limiter holds the host back on a device with streams: without it the host runs up to
     * the launch queue ahead, and the gradient buffers released only once the device is past
     * them pile up; with it the host stays two reshards ahead. */
    fsdp_case_t lim = {.rank = 1,
                       .prefetch = FSDP_BACKWARD_PRE,
                       .layers = 96,
                       .gpt3 = true,
                       .limit = 2,
                       .ckpt = true,
                       .bf16 = true};
    fsdp_case_t nolim = lim;
    nolim.limit = -1;
    fsdp_cluster_t cq;
    fsdp_cluster_preset(NULL, "fsdp-paper-a100", 64, &cq);
    cq.compute.lowp_kernels = true;
    tap_is_int(simulated(&cq, 512, &lim), FSDP_OK,
               "GPT-3 175B (checkpointed) on 512 ranks, limit_all_gathers 2");
    tap_is_int(simulated(&cq, 512, &nolim), FSDP_OK, "the same without a limit");
    tap_ok(lim.peak_grads < nolim.peak_grads,
           "the limit bounds the gradient memory the host holds ahead (%zu < %zu bytes)",
           lim.peak_grads, nolim.peak_grads);

    /* bf16 mixed precision: with native half kernels the products' f32 gradients meet half ones
     * in the engine (the tied embedding), which widens the half one; the step is shorter. */
    fsdp_case_t wide = {.rank = 1, .prefetch = FSDP_BACKWARD_PRE, .bf16 = true};
    fsdp_case_t nat = wide;
    fsdp_cluster_t cn = toy(1);
    tap_is_int(simulated(&cn, 4, &wide), FSDP_OK, "a bf16 step, libfsdp's kernels");
    cn.compute.lowp_kernels = true;
    tap_is_int(simulated(&cn, 4, &nat), FSDP_OK, "a bf16 step, native half kernels");
    tap_ok(nat.compute < wide.compute, "native half kernels compute for less (%g < %g s)",
           nat.compute, wide.compute);
    tap_is_size(nat.got.stepped[FSDP_MEM_OPTIM], wide.got.stepped[FSDP_MEM_OPTIM],
                "with the same optimizer state");
}

int main(void) {
    tap_plan_lazy();
    test_device();
    test_contention();
    test_native_half();
    test_fresh_grad();
    test_groups();
    test_fsdp();
    return tap_done();
}
