/* SPDX-License-Identifier: MIT */
/*
 * t_vsim_measure.c: kernel times measured on this machine's CPU device for a simulated rank
 * (fsdp_vsim_measure_kernels).
 *
 * A measured time is this machine's, so it is checked through what the rules fix exactly: a
 * call of a description seen before costs what it cost then, to the bit; another shape is
 * measured anew; the scale multiplies; calls the CPU device does not replay, and every call
 * once measuring is switched off, cost the roofline's time exactly. That the measured times
 * predict a real step is bench/sim_predict.sh's business (docs/simulation.md), not a test's.
 * A simulated CPU rank takes the fused attention a real one takes, and only while measuring.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <fsdp.h>

#include "tap.h"
#include "toy_cluster.h"

static fsdp_ctx_t *mkctx(void) {
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    o.log_level = FSDP_LOG_ERROR + 1;
    fsdp_ctx_t *ctx = NULL;
    if (fsdp_ctx_create(&o, &ctx) < 0) tap_bail("fsdp_ctx_create");
    return ctx;
}

static double matmul_time(fsdp_vsim_t *vs) {
    fsdp_vsim_stats_t s;
    fsdp_vsim_stats(vs, &s);
    return s.class_time[FSDP_KERNEL_MATMUL];
}

/* The matmul class time one product a (m x k) @ b (k x n) adds. */
static double product(fsdp_ctx_t *ctx, fsdp_vsim_t *vs, int64_t m, int64_t k, int64_t n) {
    fsdp_tensor_t *a = NULL, *b = NULL, *c = NULL;
    int64_t sa[2] = {m, k}, sb[2] = {k, n};
    double before = matmul_time(vs), t = -1;
    if (fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, sa, FSDP_MEM_OTHER, &a) == FSDP_OK &&
        fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, sb, FSDP_MEM_OTHER, &b) == FSDP_OK &&
        fsdp_matmul(a, b, &c) == FSDP_OK)
        t = matmul_time(vs) - before;
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    fsdp_tensor_release(c);
    return t;
}

static double roofline_matmul(const fsdp_cluster_t *cl, int64_t m, int64_t k, int64_t n) {
    fsdp_kernel_cost_t kc;
    fsdp_kernel_estimate_t e;
    fsdp_kernel_matmul(NULL, m, n, k, 1, FSDP_DTYPE_F32, &kc);
    return fsdp_compute_kernel_time(NULL, &cl->compute, &kc, &e) == FSDP_OK ? e.seconds : -1;
}

static void test_errors(void) {
    fsdp_ctx_t *ctx = mkctx(), *mctx = mkctx();
    fsdp_cluster_t cl = toy_cluster(1);
    fsdp_vsim_t *vs = NULL;
    if (fsdp_vsim_create(ctx, &cl, &vs) < 0) tap_bail("fsdp_vsim_create");
    fsdp_device_t *cpu = fsdp_ctx_device(mctx);
    tap_is_int(fsdp_vsim_measure_kernels(NULL, cpu, 1), FSDP_EINVAL, "no simulator");
    tap_is_int(fsdp_vsim_measure_kernels(vs, fsdp_vsim_device(vs), 1), FSDP_EINVAL,
               "the shape-only device cannot time a call");
    tap_has_str(fsdp_ctx_last_error(ctx), "CPU device", "  and the message says what can");
    const double bad[] = {0, -1, NAN, INFINITY};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        tap_is_int(fsdp_vsim_measure_kernels(vs, cpu, bad[i]), FSDP_EINVAL, "scale %g refused",
                   bad[i]);
        tap_has_str(fsdp_ctx_last_error(ctx), "scale is", "  and named");
    }
    tap_is_size(fsdp_vsim_measured_calls(vs), 0, "nothing measured after the refusals");
    tap_is_size(fsdp_vsim_measured_calls(NULL), 0, "no simulator: 0 calls");
    tap_is_int(fsdp_vsim_measure_kernels(vs, NULL, 0), FSDP_OK,
               "switching off needs no scale (dev NULL)");
    fsdp_vsim_destroy(vs);
    fsdp_ctx_destroy(mctx);
    fsdp_ctx_destroy(ctx);
}

static void test_measured(void) {
    fsdp_ctx_t *ctx = mkctx(), *mctx = mkctx();
    fsdp_cluster_t cl = toy_cluster(1);
    fsdp_vsim_t *vs = NULL;
    if (fsdp_vsim_create(ctx, &cl, &vs) < 0) tap_bail("fsdp_vsim_create");
    fsdp_ctx_set_device(ctx, fsdp_vsim_device(vs));
    fsdp_device_t *cpu = fsdp_ctx_device(mctx);
    tap_is_int(fsdp_vsim_measure_kernels(vs, cpu, 1), FSDP_OK, "kernels measured on the CPU");

    /* The toy cluster's 10 TFLOP/s make a 256 x 512 x 128 product take 3 us; no CPU does. */
    double roof = roofline_matmul(&cl, 256, 512, 128);
    double first = product(ctx, vs, 256, 512, 128);
    size_t calls = fsdp_vsim_measured_calls(vs);
    tap_ok(first > 2 * roof, "a product costs its measured time: %.3g s (roofline %.3g s)", first,
           roof);
    tap_ok(calls >= 1, "  %zu calls measured", calls);
    double again = product(ctx, vs, 256, 512, 128);
    tap_ok(again == first, "the same product again costs the same, to the bit (%.17g)", again);
    tap_is_size(fsdp_vsim_measured_calls(vs), calls, "  and is not measured again");
    double other = product(ctx, vs, 64, 512, 128);
    tap_ok(other > 0 && fsdp_vsim_measured_calls(vs) > calls,
           "another shape is measured anew (%.3g s, %zu calls)", other,
           fsdp_vsim_measured_calls(vs));

    /* Buffers over 256 MiB together are not replayed: a fill of 512 MiB costs the roofline. */
    calls = fsdp_vsim_measured_calls(vs);
    fsdp_vsim_stats_t s0, s1;
    fsdp_vsim_stats(vs, &s0);
    fsdp_tensor_t *big = NULL;
    int64_t sb[1] = {(int64_t)1 << 27};
    tap_is_int(fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 1, sb, 1.0, FSDP_MEM_OTHER, &big), FSDP_OK,
               "a 512 MiB fill");
    fsdp_vsim_stats(vs, &s1);
    fsdp_kernel_cost_t kc;
    fsdp_kernel_estimate_t e;
    fsdp_kernel_elementwise(NULL, (int64_t)1 << 27, 0, 1, 0, FSDP_DTYPE_F32, &kc);
    fsdp_compute_kernel_time(NULL, &cl.compute, &kc, &e);
    tap_is_near(s1.class_time[FSDP_KERNEL_ELEMENTWISE] - s0.class_time[FSDP_KERNEL_ELEMENTWISE],
                e.seconds, 1e-15, 0, "  costs the roofline's %.3g s, as it is not replayed",
                e.seconds);
    tap_is_size(fsdp_vsim_measured_calls(vs), calls, "  and is not counted as measured");
    fsdp_tensor_release(big);

    /* A scale multiplies the measurements of a new table. Two measurements of one call can
     * differ several times over on a loaded machine, so the check is on the scale's order: a
     * product of 33.5 MFLOP takes more than 100 ns on any CPU, and less than a second. */
    tap_is_int(fsdp_vsim_measure_kernels(vs, cpu, 1e6), FSDP_OK, "measured again, scale 1e6");
    tap_is_size(fsdp_vsim_measured_calls(vs), 0, "  with a new table");
    double scaled = product(ctx, vs, 256, 512, 128);
    tap_ok(scaled > 0.1 && scaled < 1e6,
           "  the product now costs %.3g s: 1e6 times a measured time between 100 ns and 1 s",
           scaled);

    /* Switched off, every call costs the roofline again. */
    tap_is_int(fsdp_vsim_measure_kernels(vs, NULL, 0), FSDP_OK, "measuring switched off");
    tap_is_size(fsdp_vsim_measured_calls(vs), 0, "  no table");
    fsdp_vsim_reset_stats(vs); /* the scaled times above would swamp the sum's precision */
    double back = product(ctx, vs, 256, 512, 128);
    tap_is_near(back, roof, 1e-12, 0, "  the product costs the roofline's time exactly");

    fsdp_ctx_set_device(ctx, NULL);
    fsdp_vsim_destroy(vs);
    fsdp_ctx_destroy(mctx);
    fsdp_ctx_destroy(ctx);
}

static double attention_time(fsdp_vsim_t *vs) {
    fsdp_vsim_stats_t s;
    fsdp_vsim_stats(vs, &s);
    return s.class_time[FSDP_KERNEL_ATTENTION];
}

/* One GPT step on the simulated rank; returns the attention class time it added. */
static double gpt_step(fsdp_ctx_t *ctx, fsdp_vsim_t *vs, fsdp_module_t *m) {
    const int64_t shape[2] = {2, 16};
    const int64_t ids[32] = {0};
    fsdp_tensor_t *tok = NULL, *tgt = NULL, *loss = NULL;
    double before = attention_time(vs);
    if (fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, 2, shape, ids, FSDP_MEM_OTHER, &tok) < 0 ||
        fsdp_tensor_from_host(ctx, FSDP_DTYPE_I64, 2, shape, ids, FSDP_MEM_OTHER, &tgt) < 0 ||
        fsdp_gpt_forward_loss(m, tok, tgt, &loss, NULL) < 0 || fsdp_backward(loss, NULL) < 0)
        tap_bail("GPT step on the simulated rank: %s", fsdp_ctx_last_error(ctx));
    fsdp_tensor_release(tok);
    fsdp_tensor_release(tgt);
    fsdp_tensor_release(loss);
    fsdp_tape_clear(ctx);
    return attention_time(vs) - before;
}

/* A simulated CPU rank runs the calls a real one does: the GPT's attention as one fused kernel
 * a block (src/device/cpu_attention.c), timed on the CPU device, while kernels are measured
 * there; composed from products and row kernels again once measuring is off, as on the GPU
 * devices, which have no fused kernel. */
static void test_attention(void) {
    fsdp_ctx_t *ctx = mkctx(), *mctx = mkctx();
    fsdp_cluster_t cl = toy_cluster(1);
    fsdp_vsim_t *vs = NULL;
    if (fsdp_vsim_create(ctx, &cl, &vs) < 0) tap_bail("fsdp_vsim_create");
    fsdp_ctx_set_device(ctx, fsdp_vsim_device(vs));
    fsdp_gpt_config_t cfg;
    fsdp_gpt_config_init(&cfg);
    cfg.vocab = 32;
    cfg.max_seq = 16;
    cfg.n_layer = 2;
    cfg.n_head = 2;
    cfg.d_model = 16;
    fsdp_module_t *m = NULL;
    if (fsdp_gpt_create(ctx, &cfg, &m) < 0) tap_bail("gpt_create: %s", fsdp_ctx_last_error(ctx));
    double roof = gpt_step(ctx, vs, m);
    tap_ok(roof == 0, "not measured: the GPT's attention is composed (no attention kernel)");
    tap_is_int(fsdp_vsim_measure_kernels(vs, fsdp_ctx_device(mctx), 1), FSDP_OK,
               "kernels measured on the CPU");
    size_t calls = fsdp_vsim_measured_calls(vs);
    double fused = gpt_step(ctx, vs, m);
    tap_ok(fused > 0, "measured: the fused attention kernel runs (%.3g s of attention a step)",
           fused);
    tap_ok(fsdp_vsim_measured_calls(vs) >= calls + 2,
           "  forward and backward timed on the CPU (%zu calls measured)",
           fsdp_vsim_measured_calls(vs));
    tap_is_int(fsdp_vsim_measure_kernels(vs, NULL, 0), FSDP_OK, "measuring switched off");
    tap_ok(gpt_step(ctx, vs, m) == 0, "  composed again");
    fsdp_module_release(m);
    fsdp_ctx_set_device(ctx, NULL);
    fsdp_vsim_destroy(vs);
    fsdp_ctx_destroy(mctx);
    fsdp_ctx_destroy(ctx);
}

int main(void) {
    tap_plan_lazy();
    test_errors();
    test_measured();
    test_attention();
    return tap_done();
}
