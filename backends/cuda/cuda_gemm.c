/* SPDX-License-Identifier: MIT */
/*
 * cuda_gemm.c: the CUDA device's matrix products: f32, bf16 and f16 through cuBLASLt
 * (accumulated in f32; TF32 only when the device was told so) and f64 through cuBLAS, strided
 * batched, on the compute stream. cuda_gemm.h plans each call (path per dtype, the column-major
 * operands, their alignment); this file turns the plan into cuBLASLt descriptors.
 */
#include <config.h>

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cuda/cuda_gemm.h"
#include "backends/cuda/cuda_impl.h"
#include "backends/cuda/cuda_kernels.h"

/* ---- gemm ---- */

/*
 * cuda_gemm.h plans the call (path per dtype, the column-major operands, their alignment);
 * the code below only turns that plan into cuBLASLt descriptors, for f32, bf16 and f16 alike.
 */
static cudaDataType_t lt_data_type(fsdp_cuda_lt_elem_t e) {
    return e == FSDP_CUDA_LT_R16BF ? CUDA_R_16BF : e == FSDP_CUDA_LT_R16F ? CUDA_R_16F : CUDA_R_32F;
}

static int gemm_lt(fsdp_device_t *dev, struct cuda_dev *cd, fsdp_cuda_gemm_type_t ty, bool ta,
                   bool tb, int64_t m, int64_t n, int64_t k, float alpha, const void *a,
                   int64_t lda, int64_t sa, const void *b, int64_t ldb, int64_t sb, float beta,
                   void *c, int64_t ldc, int64_t sc, int64_t batch) {
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t lay[3] = {NULL, NULL, NULL};
    cublasLtMatmulPreference_t pref = NULL;
    cublasStatus_t st;
    int rc = FSDP_OK;
    fsdp_cuda_lt_plan_t pl;
    fsdp__cuda_lt_plan(&pl, ty.size, ty.csize, ta, tb, m, n, k, a, lda, sa, b, ldb, sb, c, ldc, sc,
                       batch);
    const cublasOperation_t op0 = pl.mat[0].trans ? CUBLAS_OP_T : CUBLAS_OP_N,
                            op1 = pl.mat[1].trans ? CUBLAS_OP_T : CUBLAS_OP_N;
    /* Half-precision inputs accumulate in f32 on tensor cores already; TF32 only concerns f32. */
    const cublasComputeType_t ct =
        cd->tf32 && ty.tf32_allowed ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    const cudaDataType_t et = lt_data_type(ty.elem), ect = lt_data_type(ty.celem);
    const int32_t nb = (int32_t)batch;
    const uint64_t ws = LT_WORKSPACE;
    /* Badly aligned matrices of a large product go through padded copies (fsdp__cuda_lt_pad),
     * made and read back on the compute stream, from memory counted as FSDP_MEM_OTHER. */
    int64_t pad_ld[3];
    void *pad[3] = {NULL, NULL, NULL};
    fsdp__cuda_lt_pad(&pl, ty.size, ty.csize, m, n, k, batch, pad_ld);
    for (int i = 0; i < 3 && rc == FSDP_OK; i++) {
        if (!pad_ld[i]) continue;
        const size_t es = i == 2 ? ty.csize : ty.size;
        fsdp_cuda_lt_mat_t *mt = &pl.mat[i];
        rc = fsdp_device_alloc(dev, FSDP_MEM_OTHER, (size_t)pad_ld[i] * mt->cols * es, &pad[i]);
        if (rc == FSDP_OK && (i < 2 || beta != 0.0f))
            rc = launched(dev,
                          cudaMemcpy2DAsync(pad[i], (size_t)pad_ld[i] * es, (const void *)mt->ptr,
                                            (size_t)mt->ld * es, mt->rows * es, mt->cols,
                                            cudaMemcpyDeviceToDevice, cd->compute),
                          "copying a matrix to its padded buffer");
        if (rc < 0) goto out;
        mt->ld = pad_ld[i];
        mt->ptr = (uintptr_t)pad[i];
        pl.align[i] = fsdp__cuda_lt_align(mt->ptr, mt->stride, es, batch);
    }
    static const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
#define LT(call, what)                                                                             \
    do {                                                                                           \
        if ((st = (call)) != CUBLAS_STATUS_SUCCESS) {                                              \
            rc = blas_fail(dev, st, what);                                                         \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)
    /* alpha and beta are f32 (the scale type) for every element type. */
    LT(cublasLtMatmulDescCreate(&op, ct, CUDA_R_32F), "cublasLtMatmulDescCreate");
    LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &op0, sizeof op0),
       "setting TRANSA");
    LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &op1, sizeof op1),
       "setting TRANSB");
    for (int i = 0; i < 3; i++) {
        LT(cublasLtMatrixLayoutCreate(&lay[i], i == 2 ? ect : et, pl.mat[i].rows, pl.mat[i].cols,
                                      pl.mat[i].ld),
           i == 0   ? "layout of B"
           : i == 1 ? "layout of A"
                    : "layout of C");
        if (batch > 1) {
            LT(cublasLtMatrixLayoutSetAttribute(lay[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &nb,
                                                sizeof nb),
               "setting the batch count");
            LT(cublasLtMatrixLayoutSetAttribute(lay[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                &pl.mat[i].stride, sizeof pl.mat[i].stride),
               "setting the batch stride");
        }
    }
    LT(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                            sizeof ws),
       "setting the workspace size");
    /* The heuristic assumes 256-byte aligned operands unless told otherwise; views into a flat
     * parameter or a batch stride can be less aligned, so it is told what every matrix of the
     * batch has (D is C). */
    for (int i = 0; i < 4; i++)
        LT(cublasLtMatmulPreferenceSetAttribute(pref, align_attr[i], &pl.align[i < 3 ? i : 2],
                                                sizeof pl.align[0]),
           "setting an operand's alignment");
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    LT(cublasLtMatmulAlgoGetHeuristic(cd->lt, op, lay[0], lay[1], lay[2], lay[2], pref, 1, &heur,
                                      &found),
       "cublasLtMatmulAlgoGetHeuristic");
    if (found < 1) {
        rc = fsdp__ctx_err(dev->ctx, FSDP_EBACKEND,
                           "%s gemm: cuBLASLt has no algorithm for m %lld n %lld k %lld", dev->name,
                           (long long)m, (long long)n, (long long)k);
        goto out;
    }
    void *cp = (void *)pl.mat[2].ptr;
    LT(cublasLtMatmul(cd->lt, op, &alpha, (const void *)pl.mat[0].ptr, lay[0],
                      (const void *)pl.mat[1].ptr, lay[1], &beta, cp, lay[2], cp, lay[2],
                      &heur.algo, cd->lt_ws, LT_WORKSPACE, cd->compute),
       "cublasLtMatmul");
    if (pad[2])
        rc = launched(dev,
                      cudaMemcpy2DAsync(c, (size_t)ldc * ty.csize, pad[2],
                                        (size_t)pad_ld[2] * ty.csize, (size_t)n * ty.csize,
                                        (size_t)m, cudaMemcpyDeviceToDevice, cd->compute),
                      "copying the result out of its padded buffer");
#undef LT
out:
    for (int i = 0; i < 3; i++)
        fsdp_device_free(dev, pad[i]);
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    for (int i = 2; i >= 0; i--)
        if (lay[i]) cublasLtMatrixLayoutDestroy(lay[i]);
    if (op) cublasLtMatmulDescDestroy(op);
    return rc;
}

int fsdp__cuda_gemm(fsdp_device_t *dev, fsdp_dtype_t dt, bool trans_a, bool trans_b, int64_t m,
                    int64_t n, int64_t k, double alpha, const void *a, int64_t lda,
                    int64_t stride_a, const void *b, int64_t ldb, int64_t stride_b, double beta,
                    void *c, int64_t ldc, int64_t stride_c, int64_t batch) {
    const fsdp_cuda_gemm_type_t ty = fsdp__cuda_gemm_type(dt);
    if (ty.path == FSDP_CUDA_GEMM_NONE)
        return fsdp__ctx_err(dev->ctx, FSDP_ENOTSUP,
                             "cuda gemm: dtype %s is not supported (the kernel takes f32, f64, "
                             "bf16 or f16)",
                             fsdp_dtype_name(dt));
    int chk = fsdp__gemm_check(dev, "cuda", trans_a, trans_b, m, n, k, lda, ldb, ldc, batch);
    if (chk != 0) return chk < 0 ? chk : FSDP_OK;
    USE(cd, dev);
    if (k == 0)
        return launched(
            dev, fsdp__cuda_k_scale_c(cd->compute, (int)dt, m, n, beta, c, ldc, stride_c, batch),
            "gemm (k = 0) scale kernel");
    if (batch > INT_MAX)
        return fsdp__ctx_err(dev->ctx, FSDP_ENOTSUP, "cuda gemm: batch %lld beyond 32 bits",
                             (long long)batch);
    if (ty.path == FSDP_CUDA_GEMM_LT)
        return gemm_lt(dev, cd, ty, trans_a, trans_b, m, n, k, (float)alpha, a, lda, stride_a, b,
                       ldb, stride_b, (float)beta, c, ldc, stride_c, batch);
    if (m > INT_MAX || n > INT_MAX || k > INT_MAX || lda > INT_MAX || ldb > INT_MAX ||
        ldc > INT_MAX)
        return fsdp__ctx_err(dev->ctx, FSDP_ENOTSUP,
                             "cuda gemm: f64 sizes beyond 32 bits (m %lld, n %lld, k %lld)",
                             (long long)m, (long long)n, (long long)k);
    cublasStatus_t st = cublasDgemmStridedBatched(
        cd->blas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, (int)n,
        (int)m, (int)k, &alpha, b, (int)ldb, stride_b, a, (int)lda, stride_a, &beta, c, (int)ldc,
        stride_c, (int)batch);
    return st == CUBLAS_STATUS_SUCCESS ? FSDP_OK : blas_fail(dev, st, "cublasDgemmStridedBatched");
}

/* Products of bf16 or f16 operands with a C of the same dtype or f32 (the tensor layer's
 * low-precision path): cuBLASLt with f32 accumulation, as gemm takes those dtypes, the layout
 * of C alone having the output's element type. */
int fsdp__cuda_gemm_lp(fsdp_device_t *dev, fsdp_dtype_t dt, fsdp_dtype_t ct, bool trans_a,
                       bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const void *a,
                       int64_t lda, int64_t stride_a, const void *b, int64_t ldb, int64_t stride_b,
                       double beta, void *c, int64_t ldc, int64_t stride_c, int64_t batch) {
    const fsdp_cuda_gemm_type_t ty = fsdp__cuda_gemm_lp_type(dt, ct);
    if (ty.path != FSDP_CUDA_GEMM_LT)
        return fsdp__ctx_err(dev->ctx, FSDP_ENOTSUP,
                             "cuda gemm_lp: operands of %s into %s are not supported (bf16 or "
                             "f16 operands, C of their dtype or f32)",
                             fsdp_dtype_name(dt), fsdp_dtype_name(ct));
    int chk = fsdp__gemm_check(dev, "cuda", trans_a, trans_b, m, n, k, lda, ldb, ldc, batch);
    if (chk != 0) return chk < 0 ? chk : FSDP_OK;
    USE(cd, dev);
    if (k == 0)
        return launched(
            dev, fsdp__cuda_k_scale_c(cd->compute, (int)ct, m, n, beta, c, ldc, stride_c, batch),
            "gemm_lp (k = 0) scale kernel");
    if (batch > INT_MAX)
        return fsdp__ctx_err(dev->ctx, FSDP_ENOTSUP, "cuda gemm_lp: batch %lld beyond 32 bits",
                             (long long)batch);
    return gemm_lt(dev, cd, ty, trans_a, trans_b, m, n, k, (float)alpha, a, lda, stride_a, b, ldb,
                   stride_b, (float)beta, c, ldc, stride_c, batch);
}
