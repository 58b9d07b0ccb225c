/* SPDX-License-Identifier: MIT */
/*
 * bench_vec.c: the CPU device's f32 SIMD kernels (src/device/cpu_vec.h), per instruction set.
 * (ln_bwd_row's per-element figure covers its two passes over the row.)
 *
 *   bench_vec [--rounds N] [--elements N]
 *
 * Times each kernel on rows of the lengths a GPT step uses (64: a head's width; 128: a
 * sequence, the attention softmax's rows; 384: d_model, layer norm's rows; 1536: the MLP's
 * GELU rows; 8192: a vocabulary's logits), about --elements elements per measurement, once for
 * every instruction set this build and CPU have (fsdp__vec_set_isa), in turns, --rounds times,
 * and prints the median nanoseconds per element and the ratio to the baseline set in the same
 * process. A run compares dispatch and code per set on one machine at one moment; each row's
 * baseline is measured beside it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "device/cpu_vec.h"

enum { K_EXP, K_EXP_SUM, K_TANH, K_GELU, K_GELU_BWD, K_MAX, K_SUM, K_SUMSQ, K_DOT, K_LN_BWD, NK };
static const char *const kname[NK] = {"exp", "exp_sum", "tanh",      "gelu_tanh", "gelu_tanh_bwd",
                                      "max", "sum",     "sumsq_dev", "dot",       "ln_bwd_row"};
static const size_t lens[] = {64, 128, 384, 1536, 8192};
#define NLEN (sizeof lens / sizeof lens[0])
#define MAX_ROUNDS 64

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static volatile double sink;

/* Nanoseconds per element of kernel k over rows of n, `rows` rows. */
static double run(int k, size_t n, size_t rows, const float *x, const float *g, float *y) {
    double t0 = now_ns(), acc = 0;
    for (size_t r = 0; r < rows; r++) {
        const float *xr = x + (r % 16) * n; /* 16 distinct rows, so the data stays in cache */
        float *yr = y + (r % 16) * n;
        switch (k) {
        case K_EXP:
            fsdp__vec_exp_f32(n, xr, 0.5f, yr);
            break;
        case K_EXP_SUM:
            acc += fsdp__vec_exp_sum_f32(n, xr, 0.5f, yr);
            break;
        case K_TANH:
            fsdp__vec_tanh_f32(n, xr, yr);
            break;
        case K_GELU:
            fsdp__vec_gelu_tanh_f32(n, xr, yr);
            break;
        case K_GELU_BWD:
            fsdp__vec_gelu_tanh_bwd_f32(n, xr, g, yr);
            break;
        case K_MAX:
            acc += fsdp__vec_max_f32(n, xr);
            break;
        case K_SUM:
            acc += fsdp__vec_sum_f32(n, xr);
            break;
        case K_SUMSQ:
            acc += fsdp__vec_sumsq_dev_f32(n, xr, 0.25);
            break;
        case K_LN_BWD:
            fsdp__vec_ln_bwd_row_f32(n, xr, g, 0.1f, 1.3f, g, yr);
            break;
        default:
            acc += fsdp__vec_dot_f32(n, xr, g);
            break;
        }
    }
    sink = acc;
    return (now_ns() - t0) / (double)(rows * n);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int rounds = 7;
    size_t elements = (size_t)1 << 21;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--rounds") == 0 && i + 1 < argc)
            rounds = atoi(argv[++i]);
        else if (strcmp(argv[i], "--elements") == 0 && i + 1 < argc)
            elements = (size_t)strtoull(argv[++i], NULL, 10);
        else {
            fprintf(stderr, "usage: bench_vec [--rounds N (1..%d)] [--elements N]\n", MAX_ROUNDS);
            return strcmp(argv[i], "--help") == 0 ? 0 : 2;
        }
    }
    if (rounds < 1 || rounds > MAX_ROUNDS || elements < 8192) {
        fprintf(stderr, "bench_vec: --rounds must be 1..%d and --elements at least 8192\n",
                MAX_ROUNDS);
        return 2;
    }
    size_t cap = 16 * lens[NLEN - 1];
    float *x = malloc(cap * sizeof *x), *y = malloc(cap * sizeof *y), *g = malloc(cap * sizeof *g);
    if (!x || !y || !g) {
        fprintf(stderr, "bench_vec: out of memory\n");
        return 1;
    }
    srand(1);
    for (size_t i = 0; i < cap; i++) {
        x[i] = (float)rand() / (float)RAND_MAX * 8.0f - 4.0f;
        g[i] = (float)rand() / (float)RAND_MAX - 0.5f;
    }
    int isas[FSDP_VEC_NISA], nisa = 0;
    int best = fsdp__vec_isa();
    for (int i = 0; i < FSDP_VEC_NISA; i++)
        if (fsdp__vec_set_isa(i) == 0) isas[nisa++] = i;
    fsdp__vec_set_isa(best);
    printf("# bench_vec: ns per element, median of %d rounds of about %zu elements; the "
           "dispatcher picks %s\n",
           rounds, elements, fsdp__vec_isa_name(best));
    printf("%-14s %6s", "kernel", "n");
    for (int i = 0; i < nisa; i++)
        printf(" %9s", fsdp__vec_isa_name(isas[i]));
    for (int i = 1; i < nisa; i++)
        printf(" %7s/%s", fsdp__vec_isa_name(isas[i]), "base");
    printf("\n");
    for (int k = 0; k < NK; k++)
        for (size_t l = 0; l < NLEN; l++) {
            size_t n = lens[l], rows = elements / n;
            double t[FSDP_VEC_NISA][MAX_ROUNDS], med[FSDP_VEC_NISA];
            for (int r = 0; r < rounds; r++)
                for (int i = 0; i < nisa; i++) {
                    fsdp__vec_set_isa(isas[i]);
                    t[i][r] = run(k, n, rows, x, g, y);
                }
            printf("%-14s %6zu", kname[k], n);
            for (int i = 0; i < nisa; i++) {
                qsort(t[i], (size_t)rounds, sizeof(double), cmp_double);
                med[i] = t[i][rounds / 2];
                printf(" %9.3f", med[i]);
            }
            for (int i = 1; i < nisa; i++)
                printf(" %12.2f", med[i] / med[0]);
            printf("\n");
        }
    fsdp__vec_set_isa(best);
    free(x);
    free(y);
    free(g);
    return 0;
}
