/* SPDX-License-Identifier: MIT */
/*
 * compute.c: the roofline time of a kernel and the FLOPs and bytes of the kernels FSDP training
 * runs (the compute model of fsdp/cluster.h).
 *
 * Counts are doubles: a 175B-parameter model's products reach 1e18 FLOPs per step, beyond what
 * an int64_t product of sizes could hold without care, and a double keeps 15 significant
 * digits, far more than the model is worth.
 */
#include <math.h>
#include <string.h>

#include "model/model_impl.h"

int fsdp_compute_kernel_time(fsdp_ctx_t *ctx, const fsdp_compute_model_t *m,
                             const fsdp_kernel_cost_t *k, fsdp_kernel_estimate_t *out) {
    static const char who[] = "fsdp_compute_kernel_time";
    int rc = fsdp__compute_model_check(ctx, who, m);
    if (rc < 0) return rc;
    if (!k) return fsdp__model_err(ctx, FSDP_EINVAL, "%s: kernel is NULL", who);
    if (!out) return fsdp__model_err(ctx, FSDP_EINVAL, "%s: out is NULL", who);
    if ((int)k->cls < 0 || k->cls >= FSDP_KERNEL_CLASS_COUNT)
        return fsdp__model_err(ctx, FSDP_EINVAL, "%s: kernel.cls %d is not a kernel class", who,
                               (int)k->cls);
    if (!fsdp_dtype_valid((int)k->dtype))
        return fsdp__model_err(ctx, FSDP_EINVAL, "%s: kernel.dtype %d is not a dtype", who,
                               (int)k->dtype);
    if (!(isfinite(k->flops) && k->flops >= 0))
        return fsdp__model_err(ctx, FSDP_EINVAL, "%s: kernel.flops is %g (must be >= 0 and finite)",
                               who, k->flops);
    if (!(isfinite(k->bytes) && k->bytes >= 0))
        return fsdp__model_err(ctx, FSDP_EINVAL, "%s: kernel.bytes is %g (must be >= 0 and finite)",
                               who, k->bytes);
    double peak;
    if (k->cls == FSDP_KERNEL_MATMUL || k->cls == FSDP_KERNEL_ATTENTION) {
        peak =
            k->dtype == FSDP_DTYPE_F32 && m->allow_tf32 ? m->tf32_flops : m->matmul_flops[k->dtype];
        if (peak == 0)
            return fsdp__model_err(ctx, FSDP_EINVAL,
                                   "%s: compute.matmul_flops[%s] is 0: the device has no %s "
                                   "kernel of dtype %s",
                                   who, fsdp_dtype_name(k->dtype), fsdp_kernel_class_name(k->cls),
                                   fsdp_dtype_name(k->dtype));
    } else {
        peak = m->vector_flops;
    }
    double e = m->eff[k->cls];
    fsdp_kernel_estimate_t r;
    memset(&r, 0, sizeof r);
    r.launch = m->launch;
    r.compute = k->flops / (peak * e);
    r.memory = k->bytes / (m->mem_bw * e);
    r.memory_bound = r.memory > r.compute;
    if (k->cls == FSDP_KERNEL_MATMUL) r.launch += m->matmul_launch;
    r.seconds = r.launch + (r.memory_bound ? r.memory : r.compute);
    r.peak_flops = peak;
    r.intensity = k->bytes > 0 ? k->flops / k->bytes : 0;
    r.ridge = peak / m->mem_bw;
    *out = r;
    return FSDP_OK;
}

/* ---------------------------------------------------------------------------------------------
 * FLOPs and bytes per operation. */

/* Checks the common arguments; `names` and `dims` list the sizes that must not be negative. */
static int check_kernel_args(fsdp_ctx_t *ctx, const char *who, fsdp_dtype_t dt,
                             fsdp_kernel_cost_t *out, int ndims, const char *const *names,
                             const int64_t *dims) {
    if (!out) return fsdp__model_err(ctx, FSDP_EINVAL, "%s: out is NULL", who);
    if (!fsdp_dtype_valid((int)dt))
        return fsdp__model_err(ctx, FSDP_EINVAL, "%s: dtype %d is not a dtype", who, (int)dt);
    for (int i = 0; i < ndims; i++)
        if (dims[i] < 0)
            return fsdp__model_err(ctx, FSDP_EINVAL, "%s: %s is %lld (must be >= 0)", who, names[i],
                                   (long long)dims[i]);
    return FSDP_OK;
}

static void set_cost(fsdp_kernel_cost_t *out, fsdp_kernel_class_t cls, fsdp_dtype_t dt,
                     double flops, double bytes) {
    out->cls = cls;
    out->dtype = dt;
    out->flops = flops;
    out->bytes = bytes;
}

int fsdp_kernel_matmul(fsdp_ctx_t *ctx, int64_t m, int64_t n, int64_t k, int64_t batch,
                       fsdp_dtype_t dt, fsdp_kernel_cost_t *out) {
    static const char *const names[] = {"m", "n", "k", "batch"};
    const int64_t dims[] = {m, n, k, batch};
    int rc = check_kernel_args(ctx, "fsdp_kernel_matmul", dt, out, 4, names, dims);
    if (rc < 0) return rc;
    double M = (double)m, N = (double)n, K = (double)k, B = (double)batch;
    set_cost(out, FSDP_KERNEL_MATMUL, dt, 2 * M * N * K * B,
             (M * K + K * N + M * N) * B * (double)fsdp_dtype_size(dt));
    return FSDP_OK;
}

int fsdp_kernel_elementwise(fsdp_ctx_t *ctx, int64_t numel, int inputs, int outputs,
                            double flops_per_elem, fsdp_dtype_t dt, fsdp_kernel_cost_t *out) {
    static const char who[] = "fsdp_kernel_elementwise";
    static const char *const names[] = {"numel", "inputs", "outputs"};
    const int64_t dims[] = {numel, inputs, outputs};
    int rc = check_kernel_args(ctx, who, dt, out, 3, names, dims);
    if (rc < 0) return rc;
    if (!(isfinite(flops_per_elem) && flops_per_elem >= 0))
        return fsdp__model_err(ctx, FSDP_EINVAL,
                               "%s: flops_per_elem is %g (must be >= 0 and finite)", who,
                               flops_per_elem);
    double e = (double)numel;
    set_cost(out, FSDP_KERNEL_ELEMENTWISE, dt, e * flops_per_elem,
             e * (inputs + outputs) * (double)fsdp_dtype_size(dt));
    return FSDP_OK;
}

int fsdp_kernel_softmax(fsdp_ctx_t *ctx, int64_t rows, int64_t cols, bool backward, fsdp_dtype_t dt,
                        fsdp_kernel_cost_t *out) {
    static const char *const names[] = {"rows", "cols"};
    const int64_t dims[] = {rows, cols};
    int rc = check_kernel_args(ctx, "fsdp_kernel_softmax", dt, out, 2, names, dims);
    if (rc < 0) return rc;
    double e = (double)rows * (double)cols, es = (double)fsdp_dtype_size(dt);
    if (backward)
        set_cost(out, FSDP_KERNEL_ROWWISE, dt, 4 * e, 3 * e * es); /* y, dy -> dx */
    else
        set_cost(out, FSDP_KERNEL_ROWWISE, dt, 5 * e, 2 * e * es); /* x -> y */
    return FSDP_OK;
}

int fsdp_kernel_layer_norm(fsdp_ctx_t *ctx, int64_t rows, int64_t cols, bool backward,
                           fsdp_dtype_t dt, fsdp_kernel_cost_t *out) {
    static const char *const names[] = {"rows", "cols"};
    const int64_t dims[] = {rows, cols};
    int rc = check_kernel_args(ctx, "fsdp_kernel_layer_norm", dt, out, 2, names, dims);
    if (rc < 0) return rc;
    double R = (double)rows, C = (double)cols, e = R * C, es = (double)fsdp_dtype_size(dt);
    double stats = 2 * R * 4; /* f32 mean and rstd per row */
    if (backward)             /* x, dy, w, mean, rstd -> dx, dw, db */
        set_cost(out, FSDP_KERNEL_ROWWISE, dt, 13 * e, (3 * e + 3 * C) * es + stats);
    else /* x, w, b -> y, mean, rstd */
        set_cost(out, FSDP_KERNEL_ROWWISE, dt, 8 * e, (2 * e + 2 * C) * es + stats);
    return FSDP_OK;
}

int fsdp_kernel_cross_entropy(fsdp_ctx_t *ctx, int64_t rows, int64_t classes, bool backward,
                              fsdp_dtype_t dt, fsdp_kernel_cost_t *out) {
    static const char *const names[] = {"rows", "classes"};
    const int64_t dims[] = {rows, classes};
    int rc = check_kernel_args(ctx, "fsdp_kernel_cross_entropy", dt, out, 2, names, dims);
    if (rc < 0) return rc;
    double R = (double)rows, e = R * (double)classes, es = (double)fsdp_dtype_size(dt);
    double targets = R * 8; /* i64 */
    if (backward)           /* logits, targets -> dlogits */
        set_cost(out, FSDP_KERNEL_ROWWISE, dt, 3 * e, 2 * e * es + targets);
    else /* logits, targets -> f32 loss per row */
        set_cost(out, FSDP_KERNEL_ROWWISE, dt, 4 * e, e * es + targets + R * 4);
    return FSDP_OK;
}

int fsdp_kernel_attention(fsdp_ctx_t *ctx, int64_t batch, int64_t heads, int64_t seq_q,
                          int64_t seq_k, int64_t head_dim, bool causal, bool backward,
                          fsdp_dtype_t dt, fsdp_kernel_cost_t *out) {
    static const char *const names[] = {"batch", "heads", "seq_q", "seq_k", "head_dim"};
    const int64_t dims[] = {batch, heads, seq_q, seq_k, head_dim};
    int rc = check_kernel_args(ctx, "fsdp_kernel_attention", dt, out, 5, names, dims);
    if (rc < 0) return rc;
    double bh = (double)batch * (double)heads, q = (double)seq_q, k = (double)seq_k;
    double d = (double)head_dim, es = (double)fsdp_dtype_size(dt);
    double fwd = 4 * bh * q * k * d * (causal ? 0.5 : 1);
    if (backward) /* Q, K, V, O, dO -> dQ, dK, dV */
        set_cost(out, FSDP_KERNEL_ATTENTION, dt, 2.5 * fwd, bh * 4 * (q + k) * d * es);
    else /* Q, K, V -> O */
        set_cost(out, FSDP_KERNEL_ATTENTION, dt, fwd, bh * 2 * (q + k) * d * es);
    return FSDP_OK;
}

int fsdp_kernel_optimizer(fsdp_ctx_t *ctx, fsdp_kernel_optim_t kind, int64_t numel, fsdp_dtype_t dt,
                          fsdp_kernel_cost_t *out) {
    static const char who[] = "fsdp_kernel_optimizer";
    static const char *const names[] = {"numel"};
    const int64_t dims[] = {numel};
    int rc = check_kernel_args(ctx, who, dt, out, 1, names, dims);
    if (rc < 0) return rc;
    double flops, arrays;
    switch (kind) {
    case FSDP_KERNEL_OPTIM_SGD:
        flops = 2, arrays = 3;
        break;
    case FSDP_KERNEL_OPTIM_SGD_MOMENTUM:
        flops = 4, arrays = 5;
        break;
    case FSDP_KERNEL_OPTIM_ADAMW:
        flops = 13, arrays = 7;
        break;
    default:
        return fsdp__model_err(ctx, FSDP_EINVAL, "%s: kind %d is not an optimizer", who, (int)kind);
    }
    double e = (double)numel;
    set_cost(out, FSDP_KERNEL_ELEMENTWISE, dt, flops * e, arrays * e * (double)fsdp_dtype_size(dt));
    return FSDP_OK;
}
