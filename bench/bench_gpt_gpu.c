/* SPDX-License-Identifier: MIT */
/*
 * bench_gpt_gpu.c: FSDP training steps of GPT-2 small (124M) on CUDA GPUs over the NCCL
 * backend, one rank per GPU. Alone it is a world of one on GPU 0 ($LOCAL_RANK when set); under
 * the launcher it takes the launcher's world:
 *
 *     bench/bench_gpt_gpu                          # one GPU
 *     tools/fsdprun -n 8 --backend nccl bench/bench_gpt_gpu
 *
 * The model is GPT-2 small (12 blocks, 12 heads, width 768, vocabulary 50257, context 1024,
 * tied head, no dropout) unless the shape options say otherwise; --quick is a small model for a
 * smoke test. Every rank builds it on the host from the same seed, then FSDP FULL_SHARD wraps
 * it by the GPT recipe (fsdp/gpt_recipe.h, as fsdp-train): every GPTBlock a unit under a root
 * that keeps the embeddings and the final norm, use_orig_params, with the GPU as the compute
 * device (options.device), so the wrap moves the shards to the GPU. BACKWARD_PRE prefetch,
 * limit_all_gathers 2. The recipe's AdamW (lr 1e-3, betas 0.9/0.95, weight decay 0.1 on the
 * matrices but the position table, none on vectors) over the original parameters; the PyTorch
 * twin builds the same two groups. Each rank trains on its own fixed batch of
 * --batch rows drawn from splitmix64(seed + rank) (bench_util.h; gpt2_torch_fsdp.py draws the
 * same tokens).
 *
 * Precision: f32 compute and reduction. --bf16 asks for FSDP mixed precision with bf16
 * parameters and f32 gradient reduction; it runs only when the CUDA device has bf16 matrix
 * products (probed with a 2x2 product first), and the header line says which precision ran.
 *
 * Measures, printed by rank 0:
 *   - peak: the best of --peak-iters cuBLASLt bf16 GEMMs of --peak-n cubed (f32 accumulation,
 *     bf16 output) on this GPU, in FLOP/s: the denominator of MFU;
 *   - tokens/s: batch x seq x world / the median step time (a step ends when the GPU is idle,
 *     the slowest rank's time counts);
 *   - MFU: tokens/s per GPU x the model FLOPs per token / peak, where the model FLOPs per token
 *     are 6 N + 12 L T d (N: the parameters that take part in matrix products, the embedding
 *     table included for the tied head, the position table excluded; the second term is the
 *     attention scores and their weighted sum, forward and backward);
 *   - memory: the library's peak of device memory (the context's counters after the warm-up)
 *     and the GPU's used memory from cudaMemGetInfo (total - free after the last step: the
 *     caching allocator's reserve plus the CUDA context), both of the largest rank.
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The CUDA headers come in through -I, so GCC checks them like ours; cublasLt.h declares a
 * function with an empty parameter list. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <cublasLt.h>
#include <cuda_runtime.h>
#pragma GCC diagnostic pop

#include <fsdp.h>

#include "bench_util.h"

#define PROG "bench_gpt_gpu"
#define MAX_WORLD 4096

typedef struct options {
    bench_common_t c; /* the shape's batch is per rank */
    bool bf16;
    int64_t peak_n;
    int peak_iters;
} options_t;

static const bench_gpt_shape_t gpt2_small = {12, 768, 12, 1024, 8, 50257};

static void usage(FILE *f) {
    fprintf(f,
            "usage: " PROG " [options]   (one GPU), or fsdprun -n N --backend nccl " PROG
            " [options]\n"
            "FSDP FULL_SHARD training steps over NCCL; GPT-2 small unless the shape options say\n"
            "otherwise (12 layers, d 768, 12 heads, seq 1024, vocab 50257, batch 8 per rank).\n"
            "  --layers N --d N --heads N --seq N --vocab N   the model's shape\n"
            "  --batch N       sequences per rank (default 8)\n"
            "  --steps N       timed steps (default 10)\n"
            "  --warmup N      untimed steps before them (default 2)\n"
            "  --seed N        seed of the batches and of the initialisation (default 1234)\n"
            "  --lr X          AdamW learning rate (default 1e-3)\n"
            "  --bf16          FSDP mixed precision: bf16 parameters, f32 reduction, when the\n"
            "                  CUDA device has bf16 matrix products (else f32 runs and says so)\n"
            "  --peak-n N      size of the peak GEMM (default 8192)\n"
            "  --peak-iters N  GEMMs timed for the peak, the best counts (default 20)\n"
            "  --quick         small model (2 blocks, d 64, 4 heads, T 32, B 2, vocab 256), 1\n"
            "                  warm-up and 2 timed steps, peak GEMM 2048; later options override\n"
            "  --help          this text\n");
}

/* bench_gpt_gpu's own options (a bench_extra_fn); --quick also makes the peak GEMM small. */
static int own_option(void *arg, const char *prog, const char *opt, const char *val) {
    options_t *o = arg;
    int64_t v = 0;
    if (strcmp(opt, "--quick") == 0) {
        o->peak_n = 2048;
        return 2;
    }
    if (strcmp(opt, "--bf16") == 0) {
        o->bf16 = true;
        return 2;
    }
    if (strcmp(opt, "--peak-n") == 0) {
        if (bench_parse_i64(prog, opt, val, 256, 32768, &v) < 0) return -1;
        o->peak_n = v;
        return 1;
    }
    if (strcmp(opt, "--peak-iters") == 0) {
        if (bench_parse_i64(prog, opt, val, 1, 10000, &v) < 0) return -1;
        o->peak_iters = (int)v;
        return 1;
    }
    return 0;
}

/* Returns 0 to run, 1 after --help, -1 for bad options. */
static int parse_options(int argc, char **argv, options_t *o) {
    *o = (options_t){.c = bench_common_default(), .peak_n = 8192, .peak_iters = 20};
    o->c.m = gpt2_small;
    return bench_parse_args(PROG, argc, argv, INT64_MAX - MAX_WORLD, &o->c, own_option, o, usage);
}

/* ---------------------------------------------------------------------------------------- */
/* The peak: a large cuBLASLt bf16 GEMM */

static int cuda_fail(cudaError_t e, const char *what) {
    fprintf(stderr, PROG ": %s: %s (%s)\n", what, cudaGetErrorString(e), cudaGetErrorName(e));
    return -1;
}

static int lt_fail(cublasStatus_t st, const char *what) {
    fprintf(stderr, PROG ": %s: cuBLASLt status %d\n", what, (int)st);
    return -1;
}

/* Best FLOP/s of `iters` n^3 bf16 GEMMs (C = A B, f32 accumulation) on the current device. The
 * operands hold pseudo-random values in [-1, 1) (zeros would draw less power and flatter the
 * peak). Returns 0 and sets *flops, or -1 after printing why. */
static int measure_peak(int64_t n, int iters, double *flops) {
    const size_t elems = (size_t)(n * n), bytes = elems * 2, ws_bytes = (size_t)64 << 20;
    void *a = NULL, *b = NULL, *c = NULL, *ws = NULL;
    uint16_t *host = malloc(bytes);
    cublasLtHandle_t h = NULL;
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, lc = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    cudaError_t e;
    cublasStatus_t st;
    int rc = -1;
    if (!host) {
        fprintf(stderr, PROG ": out of host memory for the peak GEMM's operands\n");
        return -1;
    }
    uint64_t state = 42;
    for (size_t i = 0; i < elems; i++) {
        float x = (float)((double)(bench_splitmix64(&state) >> 11) * 0x1p-52 - 1.0);
        uint32_t bits;
        memcpy(&bits, &x, sizeof bits);
        host[i] = (uint16_t)(bits >> 16);
    }
    if ((e = cudaMalloc(&a, bytes)) != cudaSuccess || (e = cudaMalloc(&b, bytes)) != cudaSuccess ||
        (e = cudaMalloc(&c, bytes)) != cudaSuccess ||
        (e = cudaMalloc(&ws, ws_bytes)) != cudaSuccess) {
        cuda_fail(e, "cudaMalloc for the peak GEMM");
        goto out;
    }
    if ((e = cudaMemcpy(a, host, bytes, cudaMemcpyHostToDevice)) != cudaSuccess ||
        (e = cudaMemcpy(b, host, bytes, cudaMemcpyHostToDevice)) != cudaSuccess) {
        cuda_fail(e, "cudaMemcpy of the peak GEMM's operands");
        goto out;
    }
    if ((st = cublasLtCreate(&h)) != CUBLAS_STATUS_SUCCESS) {
        lt_fail(st, "cublasLtCreate");
        goto out;
    }
    if ((st = cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F)) !=
            CUBLAS_STATUS_SUCCESS ||
        (st = cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, (uint64_t)n, (uint64_t)n, n)) !=
            CUBLAS_STATUS_SUCCESS ||
        (st = cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, (uint64_t)n, (uint64_t)n, n)) !=
            CUBLAS_STATUS_SUCCESS ||
        (st = cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, (uint64_t)n, (uint64_t)n, n)) !=
            CUBLAS_STATUS_SUCCESS ||
        (st = cublasLtMatmulPreferenceCreate(&pref)) != CUBLAS_STATUS_SUCCESS ||
        (st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                   &ws_bytes, sizeof ws_bytes)) !=
            CUBLAS_STATUS_SUCCESS) {
        lt_fail(st, "setting up the peak GEMM");
        goto out;
    }
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    st = cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, lc, lc, pref, 1, &heur, &found);
    if (st != CUBLAS_STATUS_SUCCESS || found < 1) {
        lt_fail(st, "cublasLtMatmulAlgoGetHeuristic found no bf16 algorithm");
        goto out;
    }
    if ((e = cudaEventCreate(&e0)) != cudaSuccess || (e = cudaEventCreate(&e1)) != cudaSuccess) {
        cuda_fail(e, "cudaEventCreate");
        goto out;
    }
    const float alpha = 1.0f, beta = 0.0f;
    double best = INFINITY;
    for (int i = -3; i < iters; i++) { /* three untimed GEMMs first */
        cudaEventRecord(e0, NULL);
        st = cublasLtMatmul(h, op, &alpha, a, la, b, lb, &beta, c, lc, c, lc, &heur.algo, ws,
                            ws_bytes, NULL);
        cudaEventRecord(e1, NULL);
        if (st != CUBLAS_STATUS_SUCCESS) {
            lt_fail(st, "cublasLtMatmul");
            goto out;
        }
        if ((e = cudaEventSynchronize(e1)) != cudaSuccess) {
            cuda_fail(e, "the peak GEMM");
            goto out;
        }
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        if (i >= 0 && ms > 0 && ms < best) best = ms;
    }
    *flops = 2.0 * (double)n * (double)n * (double)n / (best * 1e-3);
    rc = 0;
out:
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (op) cublasLtMatmulDescDestroy(op);
    if (h) cublasLtDestroy(h);
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    cudaFree(ws);
    free(host);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* The rank */

/* Whether the context's device multiplies bf16 matrices: a 2x2 product, FSDP_ENOTSUP when not.
 * *why receives the device's reason. */
static int bf16_matmul_works(fsdp_ctx_t *ctx, bool *works, char *why, size_t cap) {
    const int64_t shape[2] = {2, 2};
    fsdp_tensor_t *a = NULL, *p = NULL;
    int rc = fsdp_tensor_empty(ctx, FSDP_DTYPE_BF16, 2, shape, FSDP_MEM_OTHER, &a);
    if (rc == 0) rc = fsdp_tensor_fill_(a, 1.0);
    if (rc == 0) rc = fsdp_matmul(a, a, &p);
    *works = rc == 0;
    if (rc == FSDP_ENOTSUP || rc == FSDP_EINVAL) {
        snprintf(why, cap, "%s", fsdp_ctx_last_error(ctx));
        rc = 0;
    }
    fsdp_tensor_release(p);
    fsdp_tensor_release(a);
    return rc;
}

/* The rank: the model made on the host, then wrapped onto the GPU by the recipe
 * (use_orig_params), with bf16 mixed precision when asked for and available. *bf16 receives
 * what runs. */
static int setup(bench_rank_t *s, const options_t *o, int ordinal, bool *bf16) {
    int rc;
    fsdp_device_options_t d;
    fsdp_device_options_init(&d);
    d.ordinal = ordinal;
    *bf16 = false;
    if ((rc = fsdp_device_create(s->ctx, FSDP_DEVICE_CUDA, &d, &s->dev)) < 0)
        return bench_rank_fail(s, "creating the CUDA device", rc);
    if ((rc = bench_rank_model(s, &o->c.m, o->c.seed)) < 0) return rc;
    if ((rc = fsdp_ctx_set_device(s->ctx, s->dev)) < 0) return bench_rank_fail(s, "set_device", rc);
    if (o->bf16) {
        char why[512] = "";
        if ((rc = bf16_matmul_works(s->ctx, bf16, why, sizeof why)) < 0)
            return bench_rank_fail(s, "probing bf16 matrix products", rc);
        if (!*bf16 && fsdp_ctx_rank(s->ctx) == 0)
            printf("# --bf16: the CUDA device has no bf16 matrix product (%s); f32 runs\n", why);
    }
    fsdp_options_t fo;
    bench_fsdp_options(&fo);
    fo.device = s->dev;
    if (*bf16) {
        fsdp_mixed_precision_init(&fo.mixed_precision);
        fo.mixed_precision.enabled = true;
        fo.mixed_precision.param_dtype = FSDP_DTYPE_BF16;
        fo.mixed_precision.reduce_dtype = FSDP_DTYPE_F32;
    }
    if ((rc = bench_rank_wrap(s, &o->c.m, &fo)) < 0) return rc;
    return bench_rank_train_setup(s, &o->c.m, &o->c.adamw, o->c.seed);
}

/* Model FLOPs of one token, forward and backward: 6 N + 12 L T d (see the top of the file). */
static double flops_per_token(const bench_gpt_shape_t *m) {
    double n = (double)(bench_gpt_params(m) - m->seq * m->d);
    return 6.0 * n + 12.0 * (double)m->layers * (double)m->seq * (double)m->d;
}

/* The GPU this process uses before any rank exists: $LOCAL_RANK, else 0. */
static int local_ordinal(void) {
    const char *lr = getenv("LOCAL_RANK");
    long v = lr && *lr ? strtol(lr, NULL, 10) : 0;
    return v >= 0 && v < 4096 ? (int)v : 0;
}

/* ---------------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
    options_t o;
    int prc = parse_options(argc, argv, &o);
    if (prc != 0) return prc > 0 ? 0 : 2;

    /* A GPU first: without one, one line naming CUDA's error. */
    int ndev = 0;
    cudaError_t ce = cudaGetDeviceCount(&ndev);
    if (ce != cudaSuccess || ndev < 1) {
        fprintf(stderr, PROG ": no CUDA device is visible (cudaGetDeviceCount: %s (%s))\n",
                ce != cudaSuccess ? cudaGetErrorString(ce) : "0 devices",
                ce != cudaSuccess ? cudaGetErrorName(ce) : "none");
        return 1;
    }
    int ordinal = local_ordinal();
    if (ordinal >= ndev) {
        fprintf(stderr, PROG ": LOCAL_RANK %d but only %d CUDA device(s) are visible\n", ordinal,
                ndev);
        return 1;
    }
    if ((ce = cudaSetDevice(ordinal)) != cudaSuccess) return cuda_fail(ce, "cudaSetDevice"), 1;
    struct cudaDeviceProp prop;
    if ((ce = cudaGetDeviceProperties(&prop, ordinal)) != cudaSuccess)
        return cuda_fail(ce, "cudaGetDeviceProperties"), 1;
    double peak = 0;
    if (measure_peak(o.peak_n, o.peak_iters, &peak) < 0) return 1;

    setenv("FSDP_BACKEND", "nccl", 1);
    bench_rank_t s = {0};
    bool bf16 = false;
    int rc = bench_rank_init(PROG, &s, o.c.seed);
    if (rc < 0) return 1;
    const int rank = fsdp_ctx_rank(s.ctx), world = fsdp_ctx_world_size(s.ctx);
    const int nsteps = o.c.warmup + o.c.steps;
    fsdp_pg_t *pg = fsdp_ctx_pg(s.ctx);
    int dev_ord = fsdp_nccl_device(pg) >= 0 ? fsdp_nccl_device(pg) : ordinal;
    double *t = calloc((size_t)nsteps * PH_COUNT, sizeof *t); /* [step][phase], seconds */
    double *loss = calloc((size_t)nsteps, sizeof *loss);
    double *med = calloc(PH_COUNT, sizeof *med);
    int status = 1;
    if (!t || !loss || !med) {
        fprintf(stderr, PROG ": out of memory\n");
        goto out;
    }
    if (setup(&s, &o, dev_ord, &bf16) < 0) {
        fprintf(stderr, PROG ": %s\n", s.err);
        goto out;
    }
    if (rank == 0) {
        printf("# " PROG ": libfsdp FSDP FULL_SHARD over nccl, world %d, %s, GPT %lld layers, d "
               "%lld, %lld heads, seq %lld, batch %lld per rank, vocab %lld, %s\n",
               world, prop.name, (long long)o.c.m.layers, (long long)o.c.m.d,
               (long long)o.c.m.heads, (long long)o.c.m.seq, (long long)o.c.m.batch,
               (long long)o.c.m.vocab,
               bf16 ? "bf16 mixed precision (bf16 parameters, f32 reduction)" : "f32");
        bench_print_setup(&s, &o.c);
        printf("peak bf16 GEMM %lld^3 (cuBLASLt, f32 accumulation, best of %d): %.1f TFLOP/s\n",
               (long long)o.peak_n, o.peak_iters, peak * 1e-12);
        fflush(stdout);
    }

    for (int k = 0; k < nsteps; k++) {
        if (k == o.c.warmup) fsdp_mem_reset_peaks(s.ctx);
        if ((rc = fsdp_pg_barrier(pg, NULL)) < 0) {
            bench_rank_report(PROG, &s, "barrier", rc);
            goto out;
        }
        double t0 = bench_now_s();
        const char *failed = NULL;
        double *ph = &t[(size_t)k * PH_COUNT];
        rc = bench_train_step(s.opt, bench_rank_loss, &s, ph, &loss[k], &failed);
        if (rc < 0) {
            bench_rank_report(PROG, &s, failed, rc);
            goto out;
        }
        /* The step ends when the GPU has finished its kernels (the optimizer's are queued). */
        if ((ce = cudaDeviceSynchronize()) != cudaSuccess) {
            cuda_fail(ce, "cudaDeviceSynchronize after a step");
            goto out;
        }
        ph[PH_STEP] = bench_now_s() - t0;
    }

    size_t free_b = 0, total_b = 0;
    if ((ce = cudaMemGetInfo(&free_b, &total_b)) != cudaSuccess) {
        cuda_fail(ce, "cudaMemGetInfo");
        goto out;
    }
    double mem[BENCH_MEM_N + 1];
    bench_mem_peaks(s.ctx, mem);
    mem[BENCH_MEM_N] = (double)(total_b - free_b);
    rc = bench_rank_results(&s, PROG, t, loss, nsteps, mem, BENCH_MEM_N + 1);
    if (rc < 0) goto out;
    status = rc;
    if (rank != 0) goto out;

    bench_print_steps(t, loss, o.c.warmup, nsteps);
    if (bench_phase_medians(t, o.c.warmup, o.c.steps, med, NULL, NULL) < 0) {
        status = 1;
        goto out;
    }
    double tok_s = (double)(o.c.m.batch * o.c.m.seq) * world / med[PH_STEP];
    double mfu = tok_s / world * flops_per_token(&o.c.m) / peak;
    bench_print_phases_mem(" (host-side; the GPU may still run)", med,
                           "library-counted device peak", mem);
    printf("GPU used memory (cudaMemGetInfo, largest rank): %.1f MiB\n",
           mem[BENCH_MEM_N] / 1048576.0);
    printf("ms/step median %.2f over %d steps\n", med[PH_STEP] * 1e3, o.c.steps);
    printf("model FLOPs per token %.4g\n", flops_per_token(&o.c.m));
    printf("tokens/s %.0f (all ranks)\n", tok_s);
    printf("MFU %.2f%% (against the measured bf16 GEMM peak)\n", mfu * 100.0);
    fflush(stdout);
out:
    bench_rank_teardown(&s);
    fsdp_ctx_destroy(s.ctx);
    free(t);
    free(loss);
    free(med);
    return status;
}
