/* SPDX-License-Identifier: MIT */
/*
 * cuda_gemm.h: the host-side planning of the CUDA device's matrix products, in plain C so that
 * t_cuda_host checks it in every build (no CUDA header is needed here).
 *
 * Three things are decided before cuBLASLt or cuBLAS is called, and all three live here:
 *   - which library path a dtype takes (fsdp__cuda_gemm_type): f32, bf16 and f16 go through
 *     cuBLASLt with f32 accumulation and f32 alpha/beta, f64 through cublasDgemmStridedBatched,
 *     every other dtype is refused; the low-precision products of gemm_lp
 *     (fsdp__cuda_gemm_lp_type) take bf16 or f16 operands with a C of the same dtype or f32;
 *   - the column-major problem the library solves (fsdp__cuda_lt_plan): row-major
 *     C (m x n) = op(A) op(B) is column-major C^T (n x m) = op(B)^T op(A)^T, so the library's
 *     first operand is our B and its second our A, each with its own transpose flag, the row
 *     strides as leading dimensions;
 *   - the alignment the heuristic is told (fsdp__cuda_lt_align): the largest power of two up to
 *     256 that divides the byte address of every matrix of a batch.
 */
#ifndef FSDP_CUDA_GEMM_H
#define FSDP_CUDA_GEMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/dtype.h>

/* How the CUDA device multiplies matrices of one dtype. */
typedef enum fsdp_cuda_gemm_path {
    FSDP_CUDA_GEMM_NONE = 0, /* not supported: FSDP_ENOTSUP naming the dtype */
    FSDP_CUDA_GEMM_LT,       /* cuBLASLt, CUBLAS_COMPUTE_32F (TF32 optional for f32 only) */
    FSDP_CUDA_GEMM_DGEMM     /* cublasDgemmStridedBatched */
} fsdp_cuda_gemm_path_t;

/* cuBLASLt's element type of A, B and C (cuda_device.c maps these to cudaDataType_t). */
typedef enum fsdp_cuda_lt_elem {
    FSDP_CUDA_LT_R32F = 0,
    FSDP_CUDA_LT_R16BF,
    FSDP_CUDA_LT_R16F
} fsdp_cuda_lt_elem_t;

typedef struct fsdp_cuda_gemm_type {
    fsdp_cuda_gemm_path_t path;
    fsdp_cuda_lt_elem_t elem; /* of A and B; meaningful for FSDP_CUDA_GEMM_LT */
    size_t size;              /* bytes per element of A and B */
    bool tf32_allowed;        /* FSDP_CUDA_TF32 applies (f32 inputs only) */
    fsdp_cuda_lt_elem_t celem; /* of C (and D): elem, except f32 for gemm_lp's f32 outputs */
    size_t csize;              /* bytes per element of C */
} fsdp_cuda_gemm_type_t;

/* The dispatch table: the path of dtype dt (FSDP_CUDA_GEMM_NONE for integers, bool, unknown). */
static inline fsdp_cuda_gemm_type_t fsdp__cuda_gemm_type(fsdp_dtype_t dt) {
    fsdp_cuda_gemm_type_t t = {
        FSDP_CUDA_GEMM_NONE, FSDP_CUDA_LT_R32F, 0, false, FSDP_CUDA_LT_R32F, 0};
    switch (dt) {
    case FSDP_DTYPE_F32:
        t.path = FSDP_CUDA_GEMM_LT;
        t.size = 4;
        t.tf32_allowed = true;
        break;
    case FSDP_DTYPE_BF16:
        t.path = FSDP_CUDA_GEMM_LT;
        t.elem = FSDP_CUDA_LT_R16BF;
        t.size = 2;
        break;
    case FSDP_DTYPE_F16:
        t.path = FSDP_CUDA_GEMM_LT;
        t.elem = FSDP_CUDA_LT_R16F;
        t.size = 2;
        break;
    case FSDP_DTYPE_F64:
        t.path = FSDP_CUDA_GEMM_DGEMM;
        t.size = 8;
        break;
    default:
        break;
    }
    t.celem = t.elem;
    t.csize = t.size;
    return t;
}

/* The path of gemm_lp's product: A and B of dtype dt (bf16 or f16), C of ct (dt or f32), through
 * cuBLASLt with f32 accumulation; FSDP_CUDA_GEMM_NONE for any other pair. */
static inline fsdp_cuda_gemm_type_t fsdp__cuda_gemm_lp_type(fsdp_dtype_t dt, fsdp_dtype_t ct) {
    fsdp_cuda_gemm_type_t t = fsdp__cuda_gemm_type(dt);
    if ((dt != FSDP_DTYPE_BF16 && dt != FSDP_DTYPE_F16) || (ct != dt && ct != FSDP_DTYPE_F32)) {
        t.path = FSDP_CUDA_GEMM_NONE;
        return t;
    }
    if (ct == FSDP_DTYPE_F32) {
        t.celem = FSDP_CUDA_LT_R32F;
        t.csize = 4;
    }
    return t;
}

/* The largest power of two up to 256 dividing p, p + stride, p + 2 stride, ... in bytes, where
 * stride is in elements of `size` bytes and only matters when batch > 1. */
static inline uint32_t fsdp__cuda_lt_align(uintptr_t p, int64_t stride, size_t size,
                                           int64_t batch) {
    uint64_t bits = (uint64_t)p | 256;
    if (batch > 1) bits |= (uint64_t)stride * (uint64_t)size;
    return (uint32_t)(bits & (~bits + 1));
}

/* One stored matrix as the column-major library sees it. */
typedef struct fsdp_cuda_lt_mat {
    uint64_t rows, cols; /* of the stored (column-major) matrix */
    int64_t ld;          /* leading dimension: our row stride */
    int64_t stride;      /* elements between batch entries */
    bool trans;          /* the library applies op = transpose to it */
    uintptr_t ptr;
} fsdp_cuda_lt_mat_t;

/* The library's view of row-major C = op(A) op(B): mat[0] is the library's A (our B), mat[1]
 * its B (our A), mat[2] its C (our C, n x m column-major). */
typedef struct fsdp_cuda_lt_plan {
    fsdp_cuda_lt_mat_t mat[3];
    uint32_t align[3]; /* fsdp__cuda_lt_align of each (D is C) */
} fsdp_cuda_lt_plan_t;

/* size: bytes per element of A and B; csize: of C. */
static inline void fsdp__cuda_lt_plan(fsdp_cuda_lt_plan_t *pl, size_t size, size_t csize, bool ta,
                                      bool tb, int64_t m, int64_t n, int64_t k, const void *a,
                                      int64_t lda, int64_t sa, const void *b, int64_t ldb,
                                      int64_t sb, void *c, int64_t ldc, int64_t sc, int64_t batch) {
    /* Our B stored row-major is (tb ? n x k : k x n), i.e. column-major (tb ? k x n : n x k). */
    pl->mat[0] = (fsdp_cuda_lt_mat_t){(uint64_t)(tb ? k : n), (uint64_t)(tb ? n : k), ldb, sb,
                                      tb, (uintptr_t)b};
    pl->mat[1] = (fsdp_cuda_lt_mat_t){(uint64_t)(ta ? m : k), (uint64_t)(ta ? k : m), lda, sa,
                                      ta, (uintptr_t)a};
    pl->mat[2] = (fsdp_cuda_lt_mat_t){(uint64_t)n, (uint64_t)m, ldc, sc, false, (uintptr_t)c};
    for (int i = 0; i < 3; i++)
        pl->align[i] =
            fsdp__cuda_lt_align(pl->mat[i].ptr, pl->mat[i].stride, i == 2 ? csize : size, batch);
}

/* Products of at least this many multiply-adds (m n k) have their badly aligned matrices
 * padded (fsdp__cuda_lt_pad). */
#define FSDP_CUDA_LT_PAD_MIN_MACS ((double)(1 << 30))

/*
 * A leading dimension that is not a multiple of 16 bytes leaves cuBLASLt only its kernels for
 * one-element alignment, several times slower on tensor cores (GPT-2's head, 50257 columns: 7 ms
 * on an H200 where an aligned product takes about 1). For a large unbatched product, such a
 * matrix is better copied into a buffer whose leading dimension is rounded up to 16 bytes, and
 * a result copied back. Returns, for each matrix of the plan, the padded leading dimension, or 0
 * where it stays as it is; size and csize as for fsdp__cuda_lt_plan.
 */
static inline void fsdp__cuda_lt_pad(const fsdp_cuda_lt_plan_t *pl, size_t size, size_t csize,
                                     int64_t m, int64_t n, int64_t k, int64_t batch,
                                     int64_t pad_ld[3]) {
    const bool big = batch == 1 && (double)m * (double)n * (double)k >= FSDP_CUDA_LT_PAD_MIN_MACS;
    for (int i = 0; i < 3; i++) {
        const int64_t es = (int64_t)(i == 2 ? csize : size), per = 16 / es;
        pad_ld[i] = 0;
        if (big && (pl->mat[i].ld * es) % 16 != 0)
            pad_ld[i] = ((int64_t)pl->mat[i].rows + per - 1) / per * per;
    }
}

#endif /* FSDP_CUDA_GEMM_H */
