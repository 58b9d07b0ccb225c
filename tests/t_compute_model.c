/* SPDX-License-Identifier: MIT */
/*
 * t_compute_model.c: the compute model of fsdp/cluster.h (the roofline and the FLOPs and bytes
 * of FSDP's kernels), the presets' device figures, and the calibration of this CPU.
 *
 * The roofline is checked on a toy device with round numbers (bf16 products at 100 TFLOP/s,
 * 1 TB/s of memory: the ridge at 100 FLOP/B) and the counts against hand-computed values. The
 * calibration is checked for sanity only (positive, finite, within wide bounds, quick): the
 * machines that run the tests are shared, so its values are printed, never compared.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <fsdp.h>
#include <fsdp/cluster.h>
#include <fsdp/sim.h>

#include "core/timeutil.h"
#include "tap.h"
#include "toy_cluster.h"

static fsdp_ctx_t *ctx;

static fsdp_compute_model_t toy(void) {
    return toy_compute();
}

static fsdp_kernel_estimate_t kt(const fsdp_compute_model_t *m, fsdp_kernel_class_t cls,
                                 fsdp_dtype_t dt, double flops, double bytes) {
    fsdp_kernel_cost_t k = {cls, dt, flops, bytes};
    fsdp_kernel_estimate_t e;
    memset(&e, 0, sizeof e);
    if (fsdp_compute_kernel_time(ctx, m, &k, &e) < 0) {
        tap_ok(0, "fsdp_compute_kernel_time failed: %s", fsdp_ctx_last_error(ctx));
        e.seconds = -1;
    }
    return e;
}

static double time_of(const fsdp_compute_model_t *m, const fsdp_kernel_cost_t *k) {
    fsdp_kernel_estimate_t e;
    if (fsdp_compute_kernel_time(ctx, m, k, &e) < 0) {
        tap_ok(0, "fsdp_compute_kernel_time failed: %s", fsdp_ctx_last_error(ctx));
        return -1;
    }
    return e.seconds;
}

/* ---------------------------------------------------------------------------------------------
 * Roofline */

static void test_roofline(void) {
    fsdp_compute_model_t m = toy();
    /* 1 TFLOP over 1 GB: 1000 FLOP/B, far above the ridge: 10 ms of compute. */
    fsdp_kernel_estimate_t e = kt(&m, FSDP_KERNEL_MATMUL, FSDP_DTYPE_BF16, 1e12, 1e9);
    tap_is_near(e.seconds, 1e-6 + 1e-2, 1e-12, 0, "compute-bound product: launch + flops/peak");
    tap_ok(!e.memory_bound, "  compute-bound");
    tap_is_near(e.compute, 1e-2, 1e-12, 0, "  compute term");
    tap_is_near(e.memory, 1e-3, 1e-12, 0, "  memory term");
    tap_is_near(e.intensity, 1000, 1e-12, 0, "  intensity 1000 FLOP/B");
    tap_is_near(e.ridge, 100, 1e-12, 0, "  ridge 100 FLOP/B");
    tap_is_near(e.peak_flops, 100e12, 0, 0, "  at the bf16 rate");
    /* The same FLOPs over 20 GB: 50 FLOP/B, below the ridge: 20 ms of memory traffic. */
    e = kt(&m, FSDP_KERNEL_MATMUL, FSDP_DTYPE_BF16, 1e12, 2e10);
    tap_is_near(e.seconds, 1e-6 + 2e-2, 1e-12, 0, "memory-bound product: launch + bytes/bw");
    tap_ok(e.memory_bound, "  memory-bound");
    /* The switch happens at the ridge point. */
    e = kt(&m, FSDP_KERNEL_MATMUL, FSDP_DTYPE_BF16, 99e9, 1e9);
    tap_ok(e.memory_bound, "99 FLOP/B: memory-bound");
    tap_is_near(e.seconds, 1e-6 + 1e-3, 1e-12, 0, "  1 ms of traffic");
    e = kt(&m, FSDP_KERNEL_MATMUL, FSDP_DTYPE_BF16, 101e9, 1e9);
    tap_ok(!e.memory_bound, "101 FLOP/B: compute-bound");
    tap_is_near(e.seconds, 1e-6 + 1.01e-3, 1e-12, 0, "  1.01 ms of compute");
    e = kt(&m, FSDP_KERNEL_MATMUL, FSDP_DTYPE_BF16, 100e9, 1e9);
    tap_ok(!e.memory_bound && fabs(e.seconds - (1e-6 + 1e-3)) < 1e-15,
           "at the ridge both terms are equal (counted compute-bound)");
    /* Rates by dtype and class. */
    e = kt(&m, FSDP_KERNEL_MATMUL, FSDP_DTYPE_F32, 1e12, 1);
    tap_is_near(e.seconds, 1e-6 + 0.1, 1e-12, 0, "f32 product at the f32 rate (10 TFLOP/s)");
    tap_is_near(e.ridge, 10, 1e-12, 0, "  ridge 10 FLOP/B");
    m.allow_tf32 = true;
    e = kt(&m, FSDP_KERNEL_MATMUL, FSDP_DTYPE_F32, 1e12, 1);
    tap_is_near(e.seconds, 1e-6 + 0.02, 1e-12, 0, "with allow_tf32: the TF32 rate (50 TFLOP/s)");
    e = kt(&m, FSDP_KERNEL_ATTENTION, FSDP_DTYPE_BF16, 1e12, 1);
    tap_is_near(e.seconds, 1e-6 + 0.01, 1e-12, 0, "attention runs on the matrix units");
    e = kt(&m, FSDP_KERNEL_ELEMENTWISE, FSDP_DTYPE_BF16, 5e12, 0);
    tap_is_near(e.seconds, 1e-6 + 1, 1e-12, 0, "element-wise kernels at vector_flops");
    tap_is_near(e.intensity, 0, 0, 0, "  intensity 0 without bytes");
    e = kt(&m, FSDP_KERNEL_ROWWISE, FSDP_DTYPE_I64, 0, 1e9);
    tap_is_near(e.seconds, 1e-6 + 1e-3, 1e-12, 0, "a row kernel of i64: no matrix rate needed");
    e = kt(&m, FSDP_KERNEL_ELEMENTWISE, FSDP_DTYPE_F32, 0, 0);
    tap_is_near(e.seconds, 1e-6, 0, 0, "an empty kernel costs its launch");
    /* Efficiencies scale both terms of their class only. */
    m = toy();
    m.eff[FSDP_KERNEL_MATMUL] = 0.5;
    e = kt(&m, FSDP_KERNEL_MATMUL, FSDP_DTYPE_BF16, 1e12, 1e9);
    tap_ok(fabs(e.compute - 2e-2) < 1e-15 && fabs(e.memory - 2e-3) < 1e-15,
           "eff 0.5 doubles both terms of its class");
    e = kt(&m, FSDP_KERNEL_ELEMENTWISE, FSDP_DTYPE_BF16, 0, 1e9);
    tap_is_near(e.memory, 1e-3, 1e-12, 0, "  and leaves other classes alone");
    /* More FLOPs or more bytes never go faster. */
    int bad = 0;
    m = toy();
    for (int c = 0; c < FSDP_KERNEL_CLASS_COUNT; c++) {
        double prev = -1;
        for (double x = 0; x <= 1e15; x = x < 1 ? 1 : x * 7) {
            double t = kt(&m, (fsdp_kernel_class_t)c, FSDP_DTYPE_BF16, x, x / 64).seconds;
            if (t < prev) bad++;
            prev = t;
        }
    }
    tap_is_int(bad, 0, "kernel time grows with FLOPs and bytes");
}

/* ---------------------------------------------------------------------------------------------
 * FLOPs and bytes of FSDP's kernels */

static void is_cost(int rc, const fsdp_kernel_cost_t *k, fsdp_kernel_class_t cls, double flops,
                    double bytes, const char *what) {
    tap_is_int(rc, 0, "%s", what);
    tap_is_str(fsdp_kernel_class_name(k->cls), fsdp_kernel_class_name(cls), "  class");
    tap_is_near(k->flops, flops, 1e-15, 0, "  %g FLOPs", flops);
    tap_is_near(k->bytes, bytes, 1e-15, 0, "  %g bytes", bytes);
}

static void test_counts(void) {
    fsdp_kernel_cost_t k;
    int rc = fsdp_kernel_matmul(ctx, 3, 5, 7, 2, FSDP_DTYPE_F32, &k);
    is_cost(rc, &k, FSDP_KERNEL_MATMUL, 2 * 3 * 5 * 7 * 2, (21 + 35 + 15) * 2 * 4,
            "matmul 2 x (3x7 @ 7x5) f32: 2mnk FLOPs, A+B+C bytes");
    tap_is_int(k.dtype, FSDP_DTYPE_F32, "  dtype kept");
    rc = fsdp_kernel_matmul(ctx, 2048, 36864, 12288, 1, FSDP_DTYPE_BF16, &k);
    is_cost(rc, &k, FSDP_KERNEL_MATMUL, 2.0 * 2048 * 36864 * 12288,
            (2048.0 * 12288 + 12288.0 * 36864 + 2048.0 * 36864) * 2,
            "GPT-3's QKV projection of 2048 tokens (exact in double)");
    rc = fsdp_kernel_elementwise(ctx, 1000, 2, 1, 1, FSDP_DTYPE_BF16, &k);
    is_cost(rc, &k, FSDP_KERNEL_ELEMENTWISE, 1000, 3000 * 2, "binary op on 1000 bf16");
    rc = fsdp_kernel_softmax(ctx, 4, 10, false, FSDP_DTYPE_F32, &k);
    is_cost(rc, &k, FSDP_KERNEL_ROWWISE, 5 * 40, 2 * 40 * 4, "softmax 4x10 forward");
    rc = fsdp_kernel_softmax(ctx, 4, 10, true, FSDP_DTYPE_F32, &k);
    is_cost(rc, &k, FSDP_KERNEL_ROWWISE, 4 * 40, 3 * 40 * 4, "softmax backward");
    rc = fsdp_kernel_layer_norm(ctx, 4, 10, false, FSDP_DTYPE_BF16, &k);
    is_cost(rc, &k, FSDP_KERNEL_ROWWISE, 8 * 40, (2 * 40 + 2 * 10) * 2 + 2 * 4 * 4,
            "layer norm 4x10 forward");
    rc = fsdp_kernel_layer_norm(ctx, 4, 10, true, FSDP_DTYPE_BF16, &k);
    is_cost(rc, &k, FSDP_KERNEL_ROWWISE, 13 * 40, (3 * 40 + 3 * 10) * 2 + 2 * 4 * 4,
            "layer norm backward");
    rc = fsdp_kernel_cross_entropy(ctx, 4, 10, false, FSDP_DTYPE_F32, &k);
    is_cost(rc, &k, FSDP_KERNEL_ROWWISE, 4 * 40, 40 * 4 + 4 * 8 + 4 * 4,
            "cross-entropy 4 rows of 10 classes forward");
    rc = fsdp_kernel_cross_entropy(ctx, 4, 10, true, FSDP_DTYPE_F32, &k);
    is_cost(rc, &k, FSDP_KERNEL_ROWWISE, 3 * 40, 2 * 40 * 4 + 4 * 8, "cross-entropy backward");

    /* Attention of one GPT-3 layer: 96 heads of 128 over 2048 tokens. */
    double fwd = 4.0 * 96 * 2048 * 2048 * 128;
    rc = fsdp_kernel_attention(ctx, 1, 96, 2048, 2048, 128, false, false, FSDP_DTYPE_BF16, &k);
    is_cost(rc, &k, FSDP_KERNEL_ATTENTION, fwd, 96.0 * 2 * 4096 * 128 * 2,
            "attention forward: 4 b h sq sk d");
    rc = fsdp_kernel_attention(ctx, 1, 96, 2048, 2048, 128, true, false, FSDP_DTYPE_BF16, &k);
    tap_is_near(k.flops, fwd / 2, 1e-15, 0, "causal attention: half");
    rc = fsdp_kernel_attention(ctx, 1, 96, 2048, 2048, 128, false, true, FSDP_DTYPE_BF16, &k);
    is_cost(rc, &k, FSDP_KERNEL_ATTENTION, 2.5 * fwd, 96.0 * 4 * 4096 * 128 * 2,
            "attention backward: 2.5 x forward");
    rc = fsdp_kernel_attention(ctx, 2, 3, 5, 7, 11, false, false, FSDP_DTYPE_F32, &k);
    is_cost(rc, &k, FSDP_KERNEL_ATTENTION, 4.0 * 6 * 5 * 7 * 11, 6.0 * 2 * (5 + 7) * 11 * 4,
            "cross-attention, seq_q != seq_k");

    /* Optimizer updates. */
    rc = fsdp_kernel_optimizer(ctx, FSDP_KERNEL_OPTIM_ADAMW, 1000000, FSDP_DTYPE_F32, &k);
    is_cost(rc, &k, FSDP_KERNEL_ELEMENTWISE, 13e6, 28e6, "AdamW on 1M f32: 13 FLOPs, 7 arrays");
    rc = fsdp_kernel_optimizer(ctx, FSDP_KERNEL_OPTIM_SGD, 1000000, FSDP_DTYPE_F32, &k);
    is_cost(rc, &k, FSDP_KERNEL_ELEMENTWISE, 2e6, 12e6, "SGD: 2 FLOPs, 3 arrays");
    rc = fsdp_kernel_optimizer(ctx, FSDP_KERNEL_OPTIM_SGD_MOMENTUM, 1000000, FSDP_DTYPE_BF16, &k);
    is_cost(rc, &k, FSDP_KERNEL_ELEMENTWISE, 4e6, 10e6, "SGD with momentum: 4 FLOPs, 5 arrays");
    rc = fsdp_kernel_matmul(ctx, 0, 5, 7, 1, FSDP_DTYPE_F32, &k);
    is_cost(rc, &k, FSDP_KERNEL_MATMUL, 0, 35 * 4, "an empty product still reads B");
}

/* ---------------------------------------------------------------------------------------------
 * Presets */

static void test_presets(void) {
    fsdp_cluster_t a, h;
    tap_is_int(fsdp_cluster_preset(ctx, "dgx-a100-80gb", 1, &a), 0, "DGX A100 preset");
    tap_is_int(fsdp_cluster_preset(ctx, "dgx-h100", 1, &h), 0, "DGX H100 preset");
    const fsdp_compute_model_t *ca = &a.compute, *ch = &h.compute;
    tap_ok(ca->matmul_flops[FSDP_DTYPE_BF16] == 312e12 &&
               ca->matmul_flops[FSDP_DTYPE_F16] == 312e12 &&
               ca->matmul_flops[FSDP_DTYPE_F32] == 19.5e12 &&
               ca->matmul_flops[FSDP_DTYPE_F64] == 19.5e12 && ca->tf32_flops == 156e12 &&
               !ca->allow_tf32 && ca->vector_flops == 19.5e12,
           "A100: 312 TFLOP/s bf16/f16 dense, 19.5 f32 and f64, 156 TF32 (off)");
    tap_ok(ca->mem_bw == 2039e9 && ca->mem_bytes == (size_t)80 << 30,
           "A100 80GB: HBM2e 2039 GB/s, 80 GiB");
    tap_ok(ch->matmul_flops[FSDP_DTYPE_BF16] == 989.5e12 &&
               ch->matmul_flops[FSDP_DTYPE_F16] == 989.5e12 &&
               ch->matmul_flops[FSDP_DTYPE_F32] == 67e12 && ch->tf32_flops == 494.5e12 &&
               ch->vector_flops == 67e12,
           "H100 SXM: 989.5 TFLOP/s bf16/f16 dense, 67 f32, 494.5 TF32");
    tap_ok(ch->mem_bw == 3350e9 && ch->mem_bytes == (size_t)80 << 30, "H100: HBM3 3.35 TB/s");
    tap_ok(ca->matmul_flops[FSDP_DTYPE_I32] == 0 && ca->matmul_flops[FSDP_DTYPE_U8] == 0,
           "no integer products");
    tap_ok(ca->launch == 4e-6 && ca->eff[FSDP_KERNEL_MATMUL] == 0.8 &&
               ca->eff[FSDP_KERNEL_ATTENTION] == 0.6 && ca->eff[FSDP_KERNEL_ELEMENTWISE] == 0.85 &&
               ca->eff[FSDP_KERNEL_ROWWISE] == 0.7,
           "A100 launch and efficiencies as documented");
    tap_ok(ch->eff[FSDP_KERNEL_ATTENTION] == 0.35, "H100 attention at FlashAttention-2's 35%%");
    fsdp_kernel_estimate_t e = kt(ca, FSDP_KERNEL_MATMUL, FSDP_DTYPE_BF16, 1, 1);
    tap_is_near(e.ridge, 312e12 / 2039e9, 1e-12, 0, "A100 bf16 ridge: 153 FLOP/B");

    /* One GPT-3 175B layer's forward products at batch 1 x 2048 tokens, bf16, on an A100:
     * the four projections (24 T d^2 FLOPs) and the two attention products (4 T^2 d), each one
     * kernel. The projections are compute-bound, the attention products memory-bound. */
    const int64_t T = 2048, d = 12288, heads = 96, hd = 128;
    fsdp_kernel_cost_t ks[6];
    fsdp_kernel_matmul(ctx, T, 3 * d, d, 1, FSDP_DTYPE_BF16, &ks[0]);  /* QKV */
    fsdp_kernel_matmul(ctx, T, T, hd, heads, FSDP_DTYPE_BF16, &ks[1]); /* Q K^T */
    fsdp_kernel_matmul(ctx, T, hd, T, heads, FSDP_DTYPE_BF16, &ks[2]); /* P V */
    fsdp_kernel_matmul(ctx, T, d, d, 1, FSDP_DTYPE_BF16, &ks[3]);      /* out proj */
    fsdp_kernel_matmul(ctx, T, 4 * d, d, 1, FSDP_DTYPE_BF16, &ks[4]);  /* MLP up */
    fsdp_kernel_matmul(ctx, T, d, 4 * d, 1, FSDP_DTYPE_BF16, &ks[5]);  /* MLP down */
    double flops = 0, t = 0;
    int mem_bound = 0;
    for (int i = 0; i < 6; i++) {
        fsdp_kernel_estimate_t ke;
        fsdp_compute_kernel_time(ctx, ca, &ks[i], &ke);
        flops += ks[i].flops;
        t += ke.seconds;
        mem_bound += ke.memory_bound;
    }
    double want = 24.0 * T * d * d + 4.0 * T * T * d;
    tap_is_near(flops, want, 1e-15, 0, "GPT-3 layer forward products: 24 T d^2 + 4 T^2 d FLOPs");
    tap_is_int(mem_bound, 2, "  the two attention products are memory-bound");
    tap_ok(t > want / 312e12 && t < 2 * want / 312e12,
           "  between the peak time and twice it (%.3f ms)", t * 1e3);
    tap_diag("GPT-3 175B layer forward products, 1 x 2048 tokens, bf16, A100: %.4g FLOPs in "
             "%.3f ms (%.0f TFLOP/s; %.3f ms at peak)",
             flops, t * 1e3, flops / t / 1e12, want / 312e12 * 1e3);
    fsdp_kernel_cost_t adam;
    fsdp_kernel_optimizer(ctx, FSDP_KERNEL_OPTIM_ADAMW, 1000000000, FSDP_DTYPE_F32, &adam);
    tap_diag("AdamW step on 1e9 f32 parameters, A100: %.2f ms", time_of(ca, &adam) * 1e3);
}

/* ---------------------------------------------------------------------------------------------
 * Errors */

static void is_err(int rc, const char *needle, const char *what) {
    tap_is_int(rc, FSDP_EINVAL, "%s fails", what);
    tap_has_str(fsdp_ctx_last_error(ctx), needle, "  and says so");
}

static void test_errors(void) {
    fsdp_compute_model_t m;
    fsdp_kernel_cost_t k = {FSDP_KERNEL_MATMUL, FSDP_DTYPE_BF16, 1, 1};
    fsdp_kernel_estimate_t e;

    m = toy();
    m.eff[FSDP_KERNEL_ROWWISE] = 0;
    is_err(fsdp_compute_model_check(ctx, &m), "compute.eff[rowwise] is 0", "efficiency 0");
    m = toy();
    m.eff[FSDP_KERNEL_MATMUL] = NAN;
    is_err(fsdp_compute_kernel_time(ctx, &m, &k, &e),
           "fsdp_compute_kernel_time: compute.eff[matmul] is nan", "NaN efficiency");
    m = toy();
    m.vector_flops = 0;
    is_err(fsdp_compute_model_check(ctx, &m), "compute.vector_flops is 0", "no vector rate");
    m = toy();
    m.mem_bw = NAN;
    is_err(fsdp_compute_model_check(ctx, &m), "compute.mem_bw is nan", "NaN memory bandwidth");
    m = toy();
    m.mem_bw = 0;
    is_err(fsdp_compute_model_check(ctx, &m), "compute.mem_bw is 0", "zero memory bandwidth");
    m = toy();
    m.matmul_flops[FSDP_DTYPE_BF16] = -1;
    is_err(fsdp_compute_model_check(ctx, &m), "compute.matmul_flops[bf16] is -1",
           "a negative rate");
    m = toy();
    m.tf32_flops = 0;
    m.allow_tf32 = true;
    is_err(fsdp_compute_model_check(ctx, &m), "allow_tf32 is set but compute.tf32_flops is 0",
           "TF32 allowed without a TF32 rate");
    m = toy();
    m.launch = -1;
    is_err(fsdp_compute_model_check(ctx, &m), "compute.launch is -1", "a negative launch");
    m = toy();
    m.matmul_launch = -2;
    is_err(fsdp_compute_model_check(ctx, &m), "compute.matmul_launch is -2",
           "a negative fixed cost of a product");
    is_err(fsdp_compute_model_check(ctx, NULL), "compute is NULL", "a NULL model");

    /* A product's fixed cost adds to its launch, and to no other class's. */
    m = toy();
    m.matmul_launch = 1e-4;
    fsdp_kernel_cost_t mm = {FSDP_KERNEL_MATMUL, FSDP_DTYPE_F32, 1e9, 1e6};
    fsdp_kernel_cost_t ew = {FSDP_KERNEL_ELEMENTWISE, FSDP_DTYPE_F32, 1e6, 1e6};
    fsdp_kernel_estimate_t with, without, ew_with, ew_without;
    fsdp_compute_kernel_time(ctx, &m, &mm, &with);
    fsdp_compute_kernel_time(ctx, &m, &ew, &ew_with);
    m.matmul_launch = 0;
    fsdp_compute_kernel_time(ctx, &m, &mm, &without);
    fsdp_compute_kernel_time(ctx, &m, &ew, &ew_without);
    tap_is_near(with.seconds - without.seconds, 1e-4, 1e-9, 0,
                "matmul_launch adds to a product's time");
    tap_is_near(with.launch, m.launch + 1e-4, 1e-12, 0, "  and is reported in its launch");
    tap_ok(ew_with.seconds == ew_without.seconds, "  but not to an element-wise kernel's");

    m = toy();
    memset(&e, 0x33, sizeof e);
    fsdp_kernel_estimate_t before = e;
    fsdp_kernel_cost_t bad = {FSDP_KERNEL_MATMUL, FSDP_DTYPE_I32, 1, 1};
    is_err(fsdp_compute_kernel_time(ctx, &m, &bad, &e), "compute.matmul_flops[i32] is 0",
           "an i32 product on a device without one");
    bad = (fsdp_kernel_cost_t){(fsdp_kernel_class_t)9, FSDP_DTYPE_F32, 1, 1};
    is_err(fsdp_compute_kernel_time(ctx, &m, &bad, &e), "kernel.cls 9 is not a kernel class",
           "a bad class");
    bad = (fsdp_kernel_cost_t){FSDP_KERNEL_MATMUL, FSDP_DTYPE_COUNT, 1, 1};
    is_err(fsdp_compute_kernel_time(ctx, &m, &bad, &e), "kernel.dtype 8 is not a dtype",
           "a bad dtype");
    bad = (fsdp_kernel_cost_t){FSDP_KERNEL_MATMUL, FSDP_DTYPE_F32, NAN, 1};
    is_err(fsdp_compute_kernel_time(ctx, &m, &bad, &e), "kernel.flops is nan", "NaN FLOPs");
    bad = (fsdp_kernel_cost_t){FSDP_KERNEL_MATMUL, FSDP_DTYPE_F32, 1, -1};
    is_err(fsdp_compute_kernel_time(ctx, &m, &bad, &e), "kernel.bytes is -1", "negative bytes");
    is_err(fsdp_compute_kernel_time(ctx, &m, NULL, &e), "kernel is NULL", "a NULL kernel");
    is_err(fsdp_compute_kernel_time(ctx, &m, &k, NULL), "out is NULL", "a NULL estimate");
    tap_is_mem(&e, &before, sizeof e, "failed estimates leave *out alone");

    fsdp_kernel_cost_t c = {FSDP_KERNEL_ROWWISE, FSDP_DTYPE_U8, 7, 7}, cbefore = c;
    is_err(fsdp_kernel_matmul(ctx, -1, 2, 3, 1, FSDP_DTYPE_F32, &c),
           "fsdp_kernel_matmul: m is -1 (must be >= 0)", "a negative m");
    is_err(fsdp_kernel_matmul(ctx, 1, 2, 3, -2, FSDP_DTYPE_F32, &c), "batch is -2",
           "a negative batch");
    is_err(fsdp_kernel_matmul(ctx, 1, 2, 3, 1, FSDP_DTYPE_COUNT, &c), "dtype 8 is not a dtype",
           "a bad dtype");
    is_err(fsdp_kernel_matmul(ctx, 1, 2, 3, 1, FSDP_DTYPE_F32, NULL), "out is NULL", "NULL out");
    is_err(fsdp_kernel_elementwise(ctx, 10, -1, 1, 1, FSDP_DTYPE_F32, &c), "inputs is -1",
           "negative inputs");
    is_err(fsdp_kernel_elementwise(ctx, 10, 1, 1, NAN, FSDP_DTYPE_F32, &c), "flops_per_elem is nan",
           "NaN FLOPs per element");
    is_err(fsdp_kernel_softmax(ctx, 1, -3, false, FSDP_DTYPE_F32, &c), "cols is -3",
           "negative softmax columns");
    is_err(fsdp_kernel_layer_norm(ctx, -1, 3, true, FSDP_DTYPE_F32, &c), "rows is -1",
           "negative norm rows");
    is_err(fsdp_kernel_cross_entropy(ctx, 1, -5, false, FSDP_DTYPE_F32, &c), "classes is -5",
           "negative classes");
    is_err(fsdp_kernel_attention(ctx, 1, 2, 3, 4, -1, false, false, FSDP_DTYPE_BF16, &c),
           "fsdp_kernel_attention: head_dim is -1", "a negative head dimension");
    is_err(fsdp_kernel_optimizer(ctx, FSDP_KERNEL_OPTIM_COUNT, 10, FSDP_DTYPE_F32, &c),
           "kind 3 is not an optimizer", "an unknown optimizer");
    tap_is_mem(&c, &cbefore, sizeof c, "failed counts leave *out alone");
    tap_is_str(fsdp_kernel_class_name(FSDP_KERNEL_CLASS_COUNT), "invalid", "class name: invalid");
}

/* ---------------------------------------------------------------------------------------------
 * Calibration of this CPU */

static void test_calibrate(void) {
    fsdp_calibrate_options_t o;
    fsdp_calibrate_options_init(&o);
    tap_is_int(o.ranks, 2, "calibration defaults to 2 ranks");
    fsdp_cluster_t cl;
    memset(&cl, 0, sizeof cl);
    int64_t t0 = fsdp__now_ns();
    int rc = fsdp_cluster_calibrate_cpu(ctx, &o, &cl);
    double took = (double)(fsdp__now_ns() - t0) * 1e-9;
    tap_ok(rc == 0, "calibration of this CPU (%s)", rc ? fsdp_ctx_last_error(ctx) : "ok");
    /* Well under a second on an idle machine; the bound leaves room for a loaded one and for
     * sanitizers. */
    tap_ok(took < 5, "  took %.3f s", took);
    tap_is_int(fsdp_cluster_check(ctx, &cl), 0, "  passes the checks");
    tap_is_str(cl.name, "cpu", "  named cpu");
    tap_ok(cl.net.nodes == 1 && cl.net.gpus_per_node == 2, "  one node of 2 ranks");
    const fsdp_compute_model_t *m = &cl.compute;
    double f32 = m->matmul_flops[FSDP_DTYPE_F32], f64 = m->matmul_flops[FSDP_DTYPE_F64];
    tap_ok(f32 >= 1e8 && f32 <= 1e14, "  f32 products: %.3g FLOP/s", f32);
    tap_ok(f64 >= 1e7 && f64 <= 1e14, "  f64 products: %.3g FLOP/s", f64);
    tap_ok(m->matmul_flops[FSDP_DTYPE_BF16] == f32 && m->matmul_flops[FSDP_DTYPE_F16] == f32,
           "  bf16 and f16 at the f32 rate");
    tap_ok(m->vector_flops >= 1e7 && m->vector_flops <= 1e14, "  element-wise: %.3g FLOP/s",
           m->vector_flops);
    tap_ok(m->matmul_launch >= 0 && m->matmul_launch <= 0.1, "  fixed cost of a product: %.3g s",
           m->matmul_launch);
    tap_ok(m->mem_bw >= 1e8 && m->mem_bw <= 1e13, "  memory: %.3g B/s", m->mem_bw);
    tap_ok(m->launch > 0 && m->launch <= 1e-3, "  launch: %.3g s", m->launch);
    tap_ok(m->mem_bytes > 0, "  memory size: %zu bytes", m->mem_bytes);
    tap_ok(cl.net.base_latency >= 0 && cl.net.base_latency <= 0.5,
           "  sim collective latency: %.3g s", cl.net.base_latency);
    tap_ok(cl.net.intra_bw >= 1e6 && cl.net.intra_bw <= 1e13,
           "  sim collective bandwidth: %.3g B/s", cl.net.intra_bw);
    tap_ok(cl.net.intra_latency == 0 && cl.net.inter_latency == 0 && cl.net.intra_eff == 1,
           "  no per-hop latency, efficiencies 1");
    /* The calibrated model answers like any other. */
    fsdp_net_group_t g = {2, 2, 1};
    fsdp_net_estimate_t ne;
    tap_is_int(fsdp_net_coll_time(ctx, &cl.net, &g, FSDP_COLL_ALL_REDUCE, 1 << 22,
                                  FSDP_NET_ALGO_AUTO, &ne),
               0, "  an all_reduce on the calibrated model");
    tap_diag("this CPU: f32 %.3g FLOP/s, f64 %.3g FLOP/s, memory %.3g B/s, launch %.3g s; sim "
             "all_reduce: %.3g s + bytes / %.3g B/s; 4 MiB all_reduce over 2 ranks: %.3g s",
             f32, f64, m->mem_bw, m->launch, cl.net.base_latency, cl.net.intra_bw, ne.seconds);

    /* Without the collectives, and without a context. */
    o.ranks = 0;
    tap_is_int(fsdp_cluster_calibrate_cpu(NULL, &o, &cl), 0, "calibration without collectives");
    tap_ok(cl.net.gpus_per_node == 1 && cl.net.intra_bw == cl.compute.mem_bw / 2 &&
               cl.net.base_latency == 0,
           "  one rank per node, links at half the copy bandwidth, no latency");
    o.ranks = 1;
    memset(&cl, 0x22, sizeof cl);
    fsdp_cluster_t before = cl;
    rc = fsdp_cluster_calibrate_cpu(ctx, &o, &cl);
    tap_is_int(rc, FSDP_EINVAL, "one rank cannot time a collective");
    tap_has_str(fsdp_ctx_last_error(ctx), "opts.ranks is 1", "  and says so");
    tap_is_mem(&cl, &before, sizeof cl, "  *out left alone");
    tap_is_int(fsdp_cluster_calibrate_cpu(ctx, NULL, NULL), FSDP_EINVAL, "a NULL out");

    /* The backend whose collectives are timed. */
    fsdp_calibrate_options_init(&o);
    tap_ok(o.backend == NULL && o.coll_bytes == 0, "the defaults: the sim backend, 4 MiB");
    o.backend = "mpi";
    rc = fsdp_cluster_calibrate_cpu(ctx, &o, &cl);
    tap_is_int(rc, FSDP_EINVAL, "an unknown backend is refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "opts.backend is \"mpi\"", "  and named");
    tap_is_mem(&cl, &before, sizeof cl, "  *out left alone");
    o.backend = "gloo";
    o.coll_bytes = 256 << 10;
    rc = fsdp_cluster_calibrate_cpu(ctx, &o, &cl);
    if (fsdp_gloo_available()) {
        tap_ok(rc == 0, "Gloo's collectives, at 256 KiB (%s)",
               rc ? fsdp_ctx_last_error(ctx) : "ok");
        tap_ok(cl.net.gpus_per_node == 2 && cl.net.base_latency >= 0 &&
                   cl.net.base_latency <= 0.5 && cl.net.intra_bw > 0,
               "  latency %.3g s, bandwidth %.3g B/s", cl.net.base_latency, cl.net.intra_bw);
        tap_is_int(fsdp_cluster_check(ctx, &cl), 0, "  passes the checks");
    } else {
        tap_is_int(rc, FSDP_ENOTSUP, "Gloo's collectives: not in this build");
        tap_has_str(fsdp_ctx_last_error(ctx), "no Gloo backend", "  and says so");
        tap_skip(1, "no Gloo in this build");
    }
}

/* Every rank of a sim world calibrates over its group: opts.pg. */
#define PG_RANKS 3
typedef struct pg_calib {
    const char *backend; /* ignored with pg; set to something invalid to show it */
    int ranks;
    fsdp_cluster_t cl[PG_RANKS];
    int rc[PG_RANKS];
} pg_calib_t;

static int calib_rank(fsdp_ctx_t *c, void *arg) {
    pg_calib_t *p = arg;
    fsdp_calibrate_options_t o;
    fsdp_calibrate_options_init(&o);
    o.pg = fsdp_ctx_pg(c);
    o.ranks = p->ranks;
    o.backend = p->backend;
    o.coll_bytes = 96 << 10;
    int r = fsdp_ctx_rank(c);
    memset(&p->cl[r], 0x5a, sizeof p->cl[r]);
    p->rc[r] = fsdp_cluster_calibrate_cpu(c, &o, &p->cl[r]);
    return 0;
}

static void test_calibrate_pg(void) {
    fsdp_calibrate_options_t o;
    fsdp_calibrate_options_init(&o);
    tap_ok(o.pg == NULL, "calibration over a process group: none by default");
    fsdp_sim_options_t so;
    fsdp_sim_options_init(&so);
    so.world_size = PG_RANKS;
    pg_calib_t p;
    memset(&p, 0, sizeof p);
    /* Refused without a group, ignored with one. */
    p.ranks = 1;
    p.backend = "mpi";
    tap_is_int(fsdp_sim_run(&so, calib_rank, &p, NULL), 0, "%d ranks calibrate over their group",
               PG_RANKS);
    for (int r = 0; r < PG_RANKS; r++)
        tap_ok(p.rc[r] == 0, "  rank %d: %s", r, p.rc[r] ? fsdp_strerror(p.rc[r]) : "ok");
    tap_is_int(fsdp_cluster_check(ctx, &p.cl[0]), 0, "  rank 0's cluster passes the checks");
    tap_ok(p.cl[0].net.gpus_per_node == PG_RANKS && p.cl[0].net.nodes == 1,
           "  one node of the group's %d ranks (opts.ranks ignored)", PG_RANKS);
    tap_ok(p.cl[0].net.base_latency >= 0 && p.cl[0].net.base_latency <= 0.5 &&
               p.cl[0].net.intra_bw >= 1e6,
           "  the group's latency %.3g s, bandwidth %.3g B/s", p.cl[0].net.base_latency,
           p.cl[0].net.intra_bw);
    double f32 = p.cl[0].compute.matmul_flops[FSDP_DTYPE_F32];
    tap_ok(f32 >= 1e8 && f32 <= 1e14, "  rank 0 measured the device: f32 %.3g FLOP/s", f32);
    bool same = true;
    for (int r = 1; r < PG_RANKS; r++)
        same = same && memcmp(&p.cl[r], &p.cl[0], sizeof p.cl[0]) == 0;
    tap_ok(same, "  every rank received rank 0's cluster, bit for bit");

    /* A group of one times no collectives, as ranks = 0. */
    so.world_size = 1;
    memset(&p, 0, sizeof p);
    p.ranks = 2;
    tap_is_int(fsdp_sim_run(&so, calib_rank, &p, NULL), 0, "a group of one");
    tap_ok(p.rc[0] == 0 && p.cl[0].net.gpus_per_node == 1 && p.cl[0].net.base_latency == 0 &&
               p.cl[0].net.intra_bw == p.cl[0].compute.mem_bw / 2,
           "  one rank per node, links at half the copy bandwidth, no latency");
}

int main(void) {
    tap_plan_lazy();
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    if (fsdp_ctx_create(&o, &ctx) < 0) {
        printf("Bail out! no context\n");
        return 1;
    }
    test_roofline();
    test_counts();
    test_presets();
    test_errors();
    test_calibrate();
    test_calibrate_pg();
    fsdp_ctx_destroy(ctx);
    return tap_done();
}
