/* SPDX-License-Identifier: MIT */
/*
 * vsim_measure.c: kernel times measured on a CPU device, for the shape-only device's calls
 * (fsdp_vsim_measure_kernels).
 *
 * A roofline knows a kernel's FLOPs and bytes but not how well the kernel library does at that
 * shape: on a CPU, BLAS reaches 90% of its peak on a large square product and 25% on the
 * attention's batches of 64 x 64 x 32, and an element-wise map runs at its own speed. So a
 * simulator of this machine can ask for each call to be timed instead: the shape-only device
 * describes the call (struct fsdp__vcall: the operation and every size, dtype and flag its speed
 * may depend on), and the first time a description is seen the same operation runs on the CPU
 * device over zeroed scratch buffers of the sizes it reads and writes: a warm-up, then
 * MEASURE_REPS timed runs, whose median is kept in a table keyed by the description. Before each
 * timed run the core's own cache is evicted (MEASURE_EVICT_BYTES written), so the inputs come
 * from the last-level cache at best, and the outputs are flushed to memory, as in a training
 * step, where a kernel writes into blocks the allocator recycles, long out of the cache. Timed
 * hot, fsdp-train's kernels predicted its step 25% short; with every buffer flushed, 18% long;
 * this way, within 1 to 12% (docs/simulation.md). Values do not matter to these kernels' speed
 * (zeros are neither NaN nor subnormal; indices and targets of 0 are valid), so the times are
 * those of the real call up to cache state; the one exception, an attention's mask, which
 * decides how much of each row the fused softmax runs, is given the GPT's causal one. Calls whose
 * buffers together pass MEASURE_MAX_BYTES, and calls the CPU device cannot run as asked (it fails
 * them, or the scratch buffers cannot be had), keep the roofline.
 */
#include <config.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backends/vsim/vsim_impl.h"
#include "core/timeutil.h"

#define MEASURE_REPS 5
#define MEASURE_MAX_BYTES ((size_t)256 << 20)
#define MEASURE_MAX_BUFS 8
/* Written before every timed run, so that the call's buffers come from the last-level cache, not
 * from the core's own: L2 caches are 1 to 2 MiB a core on current server CPUs. */
#define MEASURE_EVICT_BYTES ((size_t)16 << 20)

struct entry {
    struct fsdp__vcall call;
    double seconds;
    bool used;
};

struct fsdp__vmeasure {
    fsdp_device_t *dev;   /* the CPU device the calls run on */
    double scale;         /* measured seconds are multiplied by it */
    struct entry *tab;    /* open addressing, linear probing */
    size_t cap, n;        /* slots, and descriptions seen */
    size_t measured;      /* descriptions with a measured time */
    unsigned char *evict; /* MEASURE_EVICT_BYTES */
};

int fsdp__vmeasure_create(fsdp_device_t *dev, double scale, struct fsdp__vmeasure **out) {
    struct fsdp__vmeasure *m = calloc(1, sizeof *m);
    if (!m) return FSDP_ENOMEM;
    m->cap = 256;
    m->tab = calloc(m->cap, sizeof *m->tab);
    m->evict = malloc(MEASURE_EVICT_BYTES);
    if (!m->tab || !m->evict) {
        fsdp__vmeasure_destroy(m);
        return FSDP_ENOMEM;
    }
    m->dev = dev;
    m->scale = scale;
    *out = m;
    return FSDP_OK;
}

void fsdp__vmeasure_destroy(struct fsdp__vmeasure *m) {
    if (!m) return;
    free(m->evict);
    free(m->tab);
    free(m);
}

size_t fsdp__vmeasure_count(const struct fsdp__vmeasure *m) {
    return m ? m->measured : 0;
}

/* ---- the table -------------------------------------------------------------------------- */

static uint64_t hash_call(const struct fsdp__vcall *c) {
    uint64_t h = 1469598103934665603ull ^ (uint64_t)c->op;
    for (int i = 0; i < c->nv; i++) {
        h ^= (uint64_t)c->v[i];
        h *= 1099511628211ull;
        h ^= h >> 29;
    }
    return h;
}

static bool same_call(const struct fsdp__vcall *a, const struct fsdp__vcall *b) {
    return a->op == b->op && a->nv == b->nv &&
           memcmp(a->v, b->v, (size_t)a->nv * sizeof a->v[0]) == 0;
}

static struct entry *slot(struct entry *tab, size_t cap, const struct fsdp__vcall *c) {
    size_t i = (size_t)hash_call(c) & (cap - 1);
    while (tab[i].used && !same_call(&tab[i].call, c))
        i = (i + 1) & (cap - 1);
    return &tab[i];
}

static int grow(struct fsdp__vmeasure *m) {
    size_t cap = m->cap * 2;
    struct entry *tab = calloc(cap, sizeof *tab);
    if (!tab) return FSDP_ENOMEM;
    for (size_t i = 0; i < m->cap; i++)
        if (m->tab[i].used) *slot(tab, cap, &m->tab[i].call) = m->tab[i];
    free(m->tab);
    m->tab = tab;
    m->cap = cap;
    return FSDP_OK;
}

/* ---- replaying a call ------------------------------------------------------------------- */

/* Elements a strided view of shape spans: 1 + sum (shape[i] - 1) * stride[i]; 0 when it is
 * empty, SIZE_MAX when a stride is negative (not replayed). */
static size_t span(int ndim, const int64_t *shape, const int64_t *stride) {
    size_t s = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] == 0) return 0;
        if (stride[i] < 0) return SIZE_MAX;
        s += (size_t)(shape[i] - 1) * (size_t)stride[i];
    }
    return s;
}

static size_t numel(int ndim, const int64_t *shape) {
    size_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= (size_t)shape[i];
    return n;
}

/* Elements of one operand of a gemm: rows x cols at leading dimension ld, batch at stride. */
static size_t gemm_span(int64_t rows, int64_t cols, int64_t ld, int64_t stride, int64_t batch) {
    if (rows == 0 || cols == 0 || batch == 0) return 0;
    return (size_t)(stride * (batch - 1) + (rows - 1) * ld + cols);
}

/* The buffers a call reads and writes, in bytes, in the order run() takes them; 0 for a NULL
 * argument. Returns their number, or -1 when the call is not replayed. */
static int buffers(const struct fsdp__vcall *c, size_t *b) {
    const int64_t *v = c->v;
    size_t es = fsdp_dtype_size((fsdp_dtype_t)v[0]);
    switch (c->op) {
    case FSDP__VOP_FILL: /* dt, n */
        b[0] = (size_t)v[1] * es;
        return 1;
    case FSDP__VOP_CAST: /* dt, xt, n */
        b[0] = (size_t)v[2] * es;
        b[1] = (size_t)v[2] * fsdp_dtype_size((fsdp_dtype_t)v[1]);
        return 2;
    case FSDP__VOP_COPY_STRIDED: { /* dt, ndim, shape[ndim], xstride[ndim] */
        int nd = (int)v[1];
        size_t sx = span(nd, v + 2, v + 2 + nd);
        if (sx == SIZE_MAX) return -1;
        b[0] = numel(nd, v + 2) * es;
        b[1] = sx * es;
        return 2;
    }
    case FSDP__VOP_UNARY: /* dt, op, n */
        b[0] = b[1] = (size_t)v[2] * es;
        return 2;
    case FSDP__VOP_UNARY_BWD: /* dt, op, n, has x, has y */
        b[0] = v[3] ? (size_t)v[2] * es : 0;
        b[1] = v[4] ? (size_t)v[2] * es : 0;
        b[2] = b[3] = (size_t)v[2] * es;
        return 4;
    case FSDP__VOP_BINARY: { /* dt, op, ndim, shape, astride, bstride */
        int nd = (int)v[2];
        size_t sa = span(nd, v + 3, v + 3 + nd), sb = span(nd, v + 3, v + 3 + 2 * nd);
        if (sa == SIZE_MAX || sb == SIZE_MAX) return -1;
        b[0] = numel(nd, v + 3) * es;
        b[1] = sa * es;
        b[2] = sb * es;
        return 3;
    }
    case FSDP__VOP_AXPY: /* dt, n */
        b[0] = b[1] = (size_t)v[1] * es;
        return 2;
    case FSDP__VOP_WHERE: /* dt, n, has a, has b */
        b[0] = (size_t)v[1];
        b[1] = v[2] ? (size_t)v[1] * es : 0;
        b[2] = v[3] ? (size_t)v[1] * es : 0;
        b[3] = (size_t)v[1] * es;
        return 4;
    case FSDP__VOP_REDUCE_SUM: /* dt, outer, r, inner */
    case FSDP__VOP_REDUCE_MAX: /* dt, outer, r, inner, has idx */
        b[0] = (size_t)(v[1] * v[2] * v[3]) * es;
        b[1] = (size_t)(v[1] * v[3]) * es;
        b[2] = c->op == FSDP__VOP_REDUCE_MAX && v[4] ? (size_t)(v[1] * v[3]) * 8 : 0;
        return 3;
    case FSDP__VOP_SUM_SQUARES: /* dt, n */
        b[0] = (size_t)v[1] * es;
        b[1] = 64;
        return 2;
    case FSDP__VOP_GEMM: { /* dt, ta, tb, m, n, k, lda, sa, ldb, sb, ldc, sc, batch, beta != 0 */
        int64_t m = v[3], n = v[4], k = v[5], batch = v[12];
        b[0] = gemm_span(v[1] ? k : m, v[1] ? m : k, v[6], v[7], batch) * es;
        b[1] = gemm_span(v[2] ? n : k, v[2] ? k : n, v[8], v[9], batch) * es;
        b[2] = gemm_span(m, n, v[10], v[11], batch) * es;
        return 3;
    }
    case FSDP__VOP_SOFTMAX: /* dt, log, rows, n */
        b[0] = b[1] = (size_t)(v[2] * v[3]) * es;
        return 2;
    case FSDP__VOP_SOFTMAX_BWD: /* dt, log, rows, n */
        b[0] = b[1] = b[2] = (size_t)(v[2] * v[3]) * es;
        return 3;
    case FSDP__VOP_LAYER_NORM: /* dt, rows, n, has w, has b */
        b[0] = b[3] = (size_t)(v[1] * v[2]) * es;
        b[1] = v[3] ? (size_t)v[2] * es : 0;
        b[2] = v[4] ? (size_t)v[2] * es : 0;
        b[4] = b[5] = (size_t)v[1] * 8;
        return 6;
    case FSDP__VOP_LAYER_NORM_BWD: /* dt, rows, n, has w, has gx, has gw, has gb */
        b[0] = b[4] = (size_t)(v[1] * v[2]) * es;
        b[1] = v[3] ? (size_t)v[2] * es : 0;
        b[2] = b[3] = (size_t)v[1] * 8;
        b[5] = v[4] ? (size_t)(v[1] * v[2]) * es : 0;
        b[6] = v[5] ? (size_t)v[2] * es : 0;
        b[7] = v[6] ? (size_t)v[2] * es : 0;
        return 8;
    case FSDP__VOP_EMBEDDING: /* dt, n, dim: every index 0, so w is one row */
        b[0] = (size_t)v[1] * 8;
        b[1] = (size_t)v[2] * es;
        b[2] = (size_t)(v[1] * v[2]) * es;
        return 3;
    case FSDP__VOP_EMBEDDING_BWD: /* dt, n, dim, padding_idx */
        b[0] = (size_t)v[1] * 8;
        b[1] = (size_t)(v[1] * v[2]) * es;
        b[2] = (size_t)v[2] * es;
        return 3;
    case FSDP__VOP_CROSS_ENTROPY: /* dt, rows, n, has logp */
        b[0] = (size_t)(v[1] * v[2]) * es;
        b[1] = (size_t)v[1] * 8;
        b[2] = (size_t)v[1] * 8;
        b[3] = v[3] ? (size_t)(v[1] * v[2]) * es : 0;
        return 4;
    case FSDP__VOP_CROSS_ENTROPY_BWD: /* dt, rows, n */
        b[0] = b[3] = (size_t)(v[1] * v[2]) * es;
        b[1] = b[2] = (size_t)v[1] * 8;
        return 4;
    case FSDP__VOP_DROPOUT: /* dt, n, has mask */
        b[0] = b[1] = (size_t)v[1] * es;
        b[2] = v[2] ? (size_t)v[1] : 0;
        return 3;
    case FSDP__VOP_ADAM: /* dt, n, amsgrad, decoupled */
        b[0] = b[1] = b[2] = b[3] = (size_t)v[1] * es;
        b[4] = v[2] ? (size_t)v[1] * es : 0;
        return 5;
    case FSDP__VOP_SGD: /* dt, n, has buf, nesterov, first */
        b[0] = b[1] = (size_t)v[1] * es;
        b[2] = v[2] ? (size_t)v[1] * es : 0;
        return 3;
    case FSDP__VOP_MEMCPY: /* u8, n */
        b[0] = b[1] = (size_t)v[1];
        return 2;
    case FSDP__VOP_MEMSET: /* u8, n */
        b[0] = (size_t)v[1];
        return 1;
    case FSDP__VOP_ATTENTION: /* dt, batch, t, heads, hd, has mask: qkv, mask, p, y */
        b[0] = (size_t)(v[1] * v[2] * 3 * v[3] * v[4]) * es;
        b[1] = v[5] ? (size_t)(v[2] * v[2]) * es : 0;
        b[2] = (size_t)(v[1] * v[3] * v[2] * v[2]) * es;
        b[3] = (size_t)(v[1] * v[2] * v[3] * v[4]) * es;
        return 4;
    case FSDP__VOP_ATTENTION_BWD: /* dt, batch, t, heads, hd: qkv, p, gy, gqkv */
        b[0] = b[3] = (size_t)(v[1] * v[2] * 3 * v[3] * v[4]) * es;
        b[1] = (size_t)(v[1] * v[3] * v[2] * v[2]) * es;
        b[2] = (size_t)(v[1] * v[2] * v[3] * v[4]) * es;
        return 4;
    default:
        return -1;
    }
}

/* Which of buffers()'s buffers each operation writes (bit i: buffer i). */
static const unsigned written[] = {
    [FSDP__VOP_FILL] = 0x1,          [FSDP__VOP_CAST] = 0x1,
    [FSDP__VOP_COPY_STRIDED] = 0x1,  [FSDP__VOP_UNARY] = 0x2,
    [FSDP__VOP_UNARY_BWD] = 0x8,     [FSDP__VOP_BINARY] = 0x1,
    [FSDP__VOP_AXPY] = 0x2,          [FSDP__VOP_WHERE] = 0x8,
    [FSDP__VOP_REDUCE_SUM] = 0x6,    [FSDP__VOP_REDUCE_MAX] = 0x6,
    [FSDP__VOP_SUM_SQUARES] = 0x2,   [FSDP__VOP_GEMM] = 0x4,
    [FSDP__VOP_SOFTMAX] = 0x2,       [FSDP__VOP_SOFTMAX_BWD] = 0x4,
    [FSDP__VOP_LAYER_NORM] = 0x38,   [FSDP__VOP_LAYER_NORM_BWD] = 0xe0,
    [FSDP__VOP_EMBEDDING] = 0x4,     [FSDP__VOP_EMBEDDING_BWD] = 0x4,
    [FSDP__VOP_CROSS_ENTROPY] = 0xc, [FSDP__VOP_CROSS_ENTROPY_BWD] = 0x8,
    [FSDP__VOP_DROPOUT] = 0x6,       [FSDP__VOP_ADAM] = 0x1d,
    [FSDP__VOP_SGD] = 0x5,           [FSDP__VOP_MEMCPY] = 0x1,
    [FSDP__VOP_MEMSET] = 0x1,        [FSDP__VOP_ATTENTION] = 0xc,
    [FSDP__VOP_ATTENTION_BWD] = 0x8,
};

/* Sends the n bytes at p out of every cache level to memory. */
static void flush_out(const void *p, size_t n) {
#if defined(__GNUC__) && (defined(__x86_64__) || (defined(__i386__) && defined(__SSE2__)))
    for (size_t o = 0; o < n; o += 64)
        __builtin_ia32_clflush((const char *)p + o);
    __builtin_ia32_mfence();
#else
    (void)p, (void)n; /* no portable flush: the buffers stay in the last-level cache */
#endif
}

/* Gives the zeroed buffers of call c what the kernel must see to take the path a step takes,
 * the GPT's (the one caller of the fused attention): an attention's mask is the causal one (0
 * on and below the diagonal, -inf above), whose masked part the CPU kernel skips; the weights an
 * attention's backward reads are a causal softmax's (row i: 1 / (i + 1) on its first i + 1
 * columns, zeros after), since the kernel finds what to skip in their zeros, and all-zero
 * weights would let it skip nearly everything. The CPU device's buffers are host memory. */
static void prepare(const struct fsdp__vcall *c, void *const *p) {
    if (c->v[0] != FSDP_DTYPE_F32 || !p[1]) return;
    const int64_t t = c->v[2];
    if (c->op == FSDP__VOP_ATTENTION) {
        float *m = p[1];
        for (int64_t i = 0; i < t; i++)
            for (int64_t j = i + 1; j < t; j++)
                m[i * t + j] = -INFINITY;
    } else if (c->op == FSDP__VOP_ATTENTION_BWD) {
        float *w = p[1];
        for (int64_t tile = 0; tile < c->v[1] * c->v[3]; tile++, w += t * t)
            for (int64_t i = 0; i < t; i++)
                for (int64_t j = 0; j <= i; j++)
                    w[i * t + j] = 1.0f / (float)(i + 1);
    }
}

/* Runs call c once on dev over buffers p (as buffers() lists them). */
static int run(fsdp_device_t *dev, const struct fsdp__vcall *c, void *const *p) {
    const struct fsdp_dev_ops *o = dev->ops;
    const int64_t *v = c->v;
    fsdp_dtype_t dt = (fsdp_dtype_t)v[0];
    switch (c->op) {
    case FSDP__VOP_FILL:
        return o->fill(dev, dt, (size_t)v[1], 0.0, p[0]);
    case FSDP__VOP_CAST:
        return o->cast(dev, dt, p[0], (fsdp_dtype_t)v[1], p[1], (size_t)v[2]);
    case FSDP__VOP_COPY_STRIDED: {
        int nd = (int)v[1];
        return o->copy_strided(dev, dt, nd, v + 2, p[0], p[1], v + 2 + nd);
    }
    case FSDP__VOP_UNARY:
        return o->unary(dev, dt, (fsdp_unary_op_t)v[1], (size_t)v[2], 1.0, p[0], p[1]);
    case FSDP__VOP_UNARY_BWD:
        return o->unary_backward(dev, dt, (fsdp_unary_op_t)v[1], (size_t)v[2], 1.0, p[0], p[1],
                                 p[2], p[3]);
    case FSDP__VOP_BINARY: {
        int nd = (int)v[2];
        return o->binary(dev, dt, (fsdp_binary_op_t)v[1], nd, v + 3, p[0], p[1], v + 3 + nd, p[2],
                         v + 3 + 2 * nd);
    }
    case FSDP__VOP_AXPY:
        return o->axpy(dev, dt, (size_t)v[1], 1.0, p[0], p[1]);
    case FSDP__VOP_WHERE:
        return o->where(dev, dt, (size_t)v[1], p[0], p[1], 0.0, p[2], 0.0, p[3]);
    case FSDP__VOP_REDUCE_SUM:
        return o->reduce_sum(dev, dt, (size_t)v[1], (size_t)v[2], (size_t)v[3], 1.0, p[0], p[1]);
    case FSDP__VOP_REDUCE_MAX:
        return o->reduce_max(dev, dt, (size_t)v[1], (size_t)v[2], (size_t)v[3], p[0], p[1], p[2]);
    case FSDP__VOP_SUM_SQUARES:
        return o->sum_squares(dev, dt, (size_t)v[1], p[0], p[1]);
    case FSDP__VOP_GEMM:
        return o->gemm(dev, dt, v[1] != 0, v[2] != 0, v[3], v[4], v[5], 1.0, p[0], v[6], v[7], p[1],
                       v[8], v[9], v[13] ? 1.0 : 0.0, p[2], v[10], v[11], v[12]);
    case FSDP__VOP_SOFTMAX:
        return o->softmax(dev, dt, v[1] != 0, (size_t)v[2], (size_t)v[3], p[0], p[1]);
    case FSDP__VOP_SOFTMAX_BWD:
        return o->softmax_backward(dev, dt, v[1] != 0, (size_t)v[2], (size_t)v[3], p[0], p[1],
                                   p[2]);
    case FSDP__VOP_LAYER_NORM:
        return o->layer_norm(dev, dt, (size_t)v[1], (size_t)v[2], 1e-5, p[0], p[1], p[2], p[3],
                             p[4], p[5]);
    case FSDP__VOP_LAYER_NORM_BWD:
        return o->layer_norm_backward(dev, dt, (size_t)v[1], (size_t)v[2], p[0], p[1], p[2], p[3],
                                      p[4], p[5], p[6], p[7]);
    case FSDP__VOP_EMBEDDING:
        return o->embedding(dev, dt, (size_t)v[1], (size_t)v[2], p[0], p[1], p[2]);
    case FSDP__VOP_EMBEDDING_BWD:
        return o->embedding_backward(dev, dt, (size_t)v[1], (size_t)v[2], p[0], v[3], p[1], p[2]);
    case FSDP__VOP_CROSS_ENTROPY:
        return o->cross_entropy(dev, dt, (size_t)v[1], (size_t)v[2], p[0], p[1], -100, 0.0, p[2],
                                p[3]);
    case FSDP__VOP_CROSS_ENTROPY_BWD:
        return o->cross_entropy_backward(dev, dt, (size_t)v[1], (size_t)v[2], p[0], p[1], -100, 0.0,
                                         p[2], p[3]);
    case FSDP__VOP_DROPOUT:
        return o->dropout(dev, dt, (size_t)v[1], 0.1, 1, 0, 0, p[0], p[1], p[2]);
    case FSDP__VOP_ADAM:
        return o->adam_step(dev, dt, (size_t)v[1], p[0], p[1], p[2], p[3], p[4], 1e-3, 0.9, 0.95,
                            1e-8, 0.1, v[3] != 0, v[2] != 0, 10);
    case FSDP__VOP_SGD:
        return o->sgd_step(dev, dt, (size_t)v[1], p[0], p[1], p[2], 1e-3, 0.9, 0.0, 0.0, v[3] != 0,
                           v[4] != 0);
    case FSDP__VOP_MEMCPY:
        return fsdp_device_memcpy(dev, p[0], p[1], (size_t)v[1], FSDP_COPY_D2D, NULL);
    case FSDP__VOP_MEMSET:
        return fsdp_device_memset(dev, p[0], 0, (size_t)v[1], NULL);
    case FSDP__VOP_ATTENTION: /* the mask, if any, causal (prepare) */
        return o->attention(dev, dt, v[1], v[2], v[3], v[4], 0.125, p[0], p[1], p[2], p[3]);
    case FSDP__VOP_ATTENTION_BWD:
        return o->attention_backward(dev, dt, v[1], v[2], v[3], v[4], 0.125, p[0], p[1], p[2],
                                     p[3]);
    default:
        return FSDP_ENOTSUP;
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median time of call c on m's device, or -1 when it is not replayed. */
static double measure(struct fsdp__vmeasure *m, const struct fsdp__vcall *c) {
    size_t bytes[MEASURE_MAX_BUFS] = {0}, total = 0;
    void *p[MEASURE_MAX_BUFS] = {0};
    int nb = buffers(c, bytes);
    if (nb < 0) return -1;
    for (int i = 0; i < nb; i++)
        total += bytes[i];
    if (total > MEASURE_MAX_BYTES) return -1;
    int rc = FSDP_OK;
    for (int i = 0; i < nb && rc == FSDP_OK; i++) {
        if (bytes[i] == 0) continue;
        rc = fsdp_device_alloc(m->dev, FSDP_MEM_OTHER, bytes[i], &p[i]);
        if (rc == FSDP_OK) rc = fsdp_device_memset(m->dev, p[i], 0, bytes[i], NULL);
    }
    if (rc == FSDP_OK) prepare(c, p);
    double t[MEASURE_REPS];
    for (int r = -1; r < MEASURE_REPS && rc == FSDP_OK; r++) { /* r = -1 warms up */
        memset(m->evict, r, MEASURE_EVICT_BYTES);
        for (int i = 0; i < nb; i++)
            if (p[i] && (written[c->op] >> i & 1)) flush_out(p[i], bytes[i]);
        int64_t t0 = fsdp__now_ns();
        rc = run(m->dev, c, p);
        if (r >= 0) t[r] = (double)(fsdp__now_ns() - t0) * 1e-9;
    }
    for (int i = 0; i < nb; i++)
        fsdp_device_free(m->dev, p[i]);
    if (rc < 0) return -1; /* not as asked (a dtype it lacks) or no memory: the roofline */
    qsort(t, MEASURE_REPS, sizeof t[0], cmp_double);
    return t[MEASURE_REPS / 2];
}

int fsdp__vmeasure_time(struct fsdp__vmeasure *m, const struct fsdp__vcall *c, double *seconds) {
    struct entry *e = slot(m->tab, m->cap, c);
    if (!e->used) {
        double s = measure(m, c);
        if ((m->n + 1) * 2 > m->cap) {
            int rc = grow(m);
            if (rc < 0) return rc;
            e = slot(m->tab, m->cap, c);
        }
        e->call = *c;
        e->seconds = s;
        e->used = true;
        m->n++;
        if (s >= 0) m->measured++;
    }
    *seconds = e->seconds < 0 ? -1 : e->seconds * m->scale;
    return FSDP_OK;
}
