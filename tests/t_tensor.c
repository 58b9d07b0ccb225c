/* SPDX-License-Identifier: MIT */
/*
 * t_tensor.c: tensors as views of shared storage: creation, strides, views and their copies,
 * host transfers through any layout, raw views into a flat buffer (how FSDP hands out
 * parameters), storage free/restore, gradients as views, and memory accounting.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "tap.h"

static fsdp_ctx_t *ctx;

static fsdp_tensor_t *arange(int ndim, const int64_t *shape) {
    fsdp_tensor_t *t = NULL;
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    float *v = malloc((size_t)n * sizeof *v);
    for (int64_t i = 0; i < n; i++) v[i] = (float)i;
    fsdp_tensor_from_host(ctx, FSDP_DTYPE_F32, ndim, shape, v, FSDP_MEM_OTHER, &t);
    free(v);
    return t;
}

static void read_f32(const fsdp_tensor_t *t, float *out) {
    fsdp_tensor_to_host(t, out, (size_t)fsdp_tensor_numel(t) * sizeof(float));
}

static void creation(void) {
    fsdp_tensor_t *t = NULL;
    int64_t shape[2] = {2, 3};
    tap_is_int(fsdp_tensor_zeros(ctx, FSDP_DTYPE_F32, 2, shape, FSDP_MEM_OTHER, &t), 0, "zeros");
    tap_is_int(fsdp_tensor_numel(t), 6, "numel 6");
    tap_ok(fsdp_tensor_is_contiguous(t), "new tensors are contiguous");
    tap_is_int(fsdp_tensor_strides(t)[0], 3, "row stride 3");
    char d[64];
    tap_is_str(fsdp_tensor_describe(t, d, sizeof d), "f32[2, 3]", "describe");
    double x = -1;
    fsdp_tensor_item(t, 5, &x);
    tap_ok(x == 0.0, "zeros are zero");
    fsdp_tensor_release(t);

    t = NULL;
    tap_is_int(fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 0, NULL, FSDP_MEM_OTHER, &t), 0,
               "a scalar has ndim 0");
    tap_is_int(fsdp_tensor_numel(t), 1, "a scalar has one element");
    fsdp_tensor_release(t);

    int64_t bad[2] = {2, -1};
    t = (fsdp_tensor_t *)1;
    tap_is_int(fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, bad, FSDP_MEM_OTHER, &t), FSDP_EINVAL,
               "negative size rejected");
    tap_ok(t == NULL, "out is NULL on failure");
    tap_has_str(fsdp_ctx_last_error(ctx), "dimension 1", "message names the dimension");
    tap_is_int(fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 9, shape, FSDP_MEM_OTHER, &t), FSDP_EINVAL,
               "more than FSDP_MAX_DIMS dimensions rejected");
    tap_is_int(fsdp_tensor_empty(ctx, (fsdp_dtype_t)42, 2, shape, FSDP_MEM_OTHER, &t),
               FSDP_EINVAL, "bad dtype rejected");

    fsdp_tensor_t *h = NULL;
    uint16_t half[2] = {fsdp_f32_to_bf16(1.5f), fsdp_f32_to_bf16(-2.0f)};
    int64_t two = 2;
    fsdp_tensor_from_host(ctx, FSDP_DTYPE_BF16, 1, &two, half, FSDP_MEM_OTHER, &h);
    fsdp_tensor_item(h, 1, &x);
    tap_ok(x == -2.0, "bf16 item converts");
    fsdp_tensor_release(h);
}

static void views(void) {
    int64_t shape[2] = {3, 4};
    fsdp_tensor_t *a = arange(2, shape), *t = NULL, *v = NULL, *c = NULL;
    float got[12];

    tap_is_int(fsdp_transpose(a, 0, 1, &t), 0, "transpose");
    tap_ok(!fsdp_tensor_is_contiguous(t), "a transpose is not contiguous");
    tap_ok(fsdp_tensor_same_storage(a, t), "a transpose shares storage");
    read_f32(t, got);
    tap_ok(got[0] == 0 && got[1] == 4 && got[2] == 8 && got[3] == 1, "transpose reads columns");
    int64_t flat = 12;
    tap_is_int(fsdp_view(t, 1, &flat, &v), FSDP_EINVAL, "view of a transpose is refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "not contiguous", "and says why");
    tap_is_int(fsdp_reshape(t, 1, &flat, &v), 0, "reshape copies instead");
    tap_ok(!fsdp_tensor_same_storage(v, a), "reshape of a transpose owns its storage");
    read_f32(v, got);
    tap_ok(got[1] == 4 && got[11] == 11, "reshape keeps row-major order of the view");
    fsdp_tensor_release(v);
    v = NULL;

    int64_t inferred[2] = {2, -1};
    tap_is_int(fsdp_view(a, 2, inferred, &v), 0, "view with -1");
    tap_is_int(fsdp_tensor_size(v, 1), 6, "-1 is inferred");
    tap_ok(fsdp_tensor_same_storage(v, a), "a view shares storage");
    fsdp_tensor_release(v);
    int64_t wrong[1] = {5};
    tap_is_int(fsdp_view(a, 1, wrong, &v), FSDP_EINVAL, "view of the wrong size is refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "[3, 4]", "message names the shape");

    tap_is_int(fsdp_narrow(a, 1, 1, 2, &v), 0, "narrow");
    read_f32(v, got);
    tap_ok(got[0] == 1 && got[1] == 2 && got[2] == 5 && got[5] == 10, "narrow picks columns");
    tap_is_int(fsdp_tensor_storage_offset(v), 1, "narrow offsets the view");
    fsdp_tensor_release(v);
    tap_is_int(fsdp_slice(a, 1, 3, &v), 0, "slice rows");
    tap_is_int(fsdp_tensor_storage_offset(v), 4, "slice starts at row 1");
    tap_ok(fsdp_tensor_is_contiguous(v), "a row slice is contiguous");
    fsdp_tensor_release(v);
    tap_is_int(fsdp_slice(a, 2, 4, &v), FSDP_EINVAL, "slice past the end is refused");

    int perm[2] = {1, 0};
    tap_is_int(fsdp_permute(a, perm, &v), 0, "permute");
    tap_is_int(fsdp_tensor_size(v, 0), 4, "permuted shape");
    fsdp_tensor_release(v);
    int badperm[2] = {0, 0};
    tap_is_int(fsdp_permute(a, badperm, &v), FSDP_EINVAL, "a non-permutation is refused");

    tap_is_int(fsdp_unsqueeze(a, 0, &v), 0, "unsqueeze");
    tap_is_int(fsdp_tensor_ndim(v), 3, "unsqueeze adds a dimension");
    tap_is_int(fsdp_squeeze(v, 0, &c), 0, "squeeze");
    tap_is_int(fsdp_tensor_ndim(c), 2, "squeeze removes it");
    fsdp_tensor_release(c);
    fsdp_tensor_release(v);

    int64_t row[2] = {1, 4}, big[3] = {2, 3, 4};
    fsdp_tensor_t *r = arange(2, row);
    tap_is_int(fsdp_expand(r, 3, big, &v), 0, "expand");
    tap_is_int(fsdp_tensor_strides(v)[1], 0, "expanded dimension has stride 0");
    float e[24];
    read_f32(v, e);
    tap_ok(e[0] == 0 && e[4] == 0 && e[23] == 3, "expand repeats the row");
    fsdp_tensor_release(v);
    fsdp_tensor_release(r);

    tap_is_int(fsdp_contiguous(t, &c), 0, "contiguous of a transpose");
    tap_ok(fsdp_tensor_is_contiguous(c) && !fsdp_tensor_same_storage(c, a), "copies");
    fsdp_tensor_release(c);
    tap_is_int(fsdp_contiguous(a, &c), 0, "contiguous of a contiguous tensor");
    tap_ok(c == a, "is the tensor itself");
    fsdp_tensor_release(c);
    fsdp_tensor_release(t);
    fsdp_tensor_release(a);
}

static void writes(void) {
    int64_t shape[2] = {2, 3};
    fsdp_tensor_t *a = NULL, *t = NULL;
    fsdp_tensor_zeros(ctx, FSDP_DTYPE_F32, 2, shape, FSDP_MEM_OTHER, &a);
    fsdp_transpose(a, 0, 1, &t);
    float src[6] = {1, 2, 3, 4, 5, 6}, got[6];
    tap_is_int(fsdp_tensor_copy_from_host(t, src, sizeof src), 0, "write through a transpose");
    read_f32(a, got);
    /* t[i][j] = a[j][i]; t row-major is (0,0),(0,1),(1,0),... */
    tap_ok(got[0] == 1 && got[3] == 2 && got[1] == 3 && got[5] == 6, "lands transposed");
    tap_is_int(fsdp_tensor_copy_from_host(t, src, 5), FSDP_EINVAL, "wrong byte count refused");
    tap_has_str(fsdp_ctx_last_error(ctx), "24", "message gives the expected bytes");
    tap_is_int(fsdp_tensor_fill_(t, 7.0), 0, "fill a strided view");
    read_f32(a, got);
    tap_ok(got[0] == 7 && got[5] == 7, "filled");

    fsdp_tensor_t *d = NULL;
    fsdp_tensor_zeros(ctx, FSDP_DTYPE_F64, 2, shape, FSDP_MEM_OTHER, &d);
    tap_is_int(fsdp_tensor_copy_(d, a), 0, "copy_ converts dtypes");
    double x = 0;
    fsdp_tensor_item(d, 4, &x);
    tap_ok(x == 7.0, "converted value");
    fsdp_tensor_release(d);
    fsdp_tensor_release(t);
    fsdp_tensor_release(a);
}

/* A flat buffer with per-parameter views: FSDP's flat parameter layout. */
static void flat_views(void) {
    int64_t n = 10;
    fsdp_tensor_t *flat = NULL, *w = NULL, *b = NULL;
    fsdp_tensor_zeros(ctx, FSDP_DTYPE_F32, 1, &n, FSDP_MEM_PARAMS, &flat);
    int64_t ws[2] = {2, 3}, bs[1] = {2};
    tap_is_int(fsdp_tensor_view_of(flat, 0, 2, ws, &w), 0, "weight view at 0");
    tap_is_int(fsdp_tensor_view_of(flat, 6, 1, bs, &b), 0, "bias view at 6");
    int64_t too[1] = {5};
    fsdp_tensor_t *bad = NULL;
    tap_is_int(fsdp_tensor_view_of(flat, 6, 1, too, &bad), FSDP_EINVAL, "a view past the end");
    tap_has_str(fsdp_ctx_last_error(ctx), "10 elements", "names the storage size");
    fsdp_tensor_fill_(b, 3.0);
    double x = 0;
    fsdp_tensor_item(flat, 7, &x);
    tap_ok(x == 3.0, "writes through a view reach the flat buffer");

    fsdp_mem_stats_t s0, s1, s2;
    fsdp_mem_get_stats(ctx, &s0);
    tap_is_int(fsdp_tensor_storage_resize(w, 0), 0, "free the flat storage");
    fsdp_mem_get_stats(ctx, &s1);
    tap_is_size(s0.current[FSDP_MEM_PARAMS] - s1.current[FSDP_MEM_PARAMS], 40,
                "40 bytes of params freed");
    tap_ok(fsdp_tensor_data(b) == NULL, "every view sees the freed storage");
    float buf[2];
    tap_is_int(fsdp_tensor_to_host(b, buf, sizeof buf), FSDP_EINVAL,
               "reading a freed storage is an error, not a crash");
    tap_is_int(fsdp_tensor_storage_resize(flat, 12), FSDP_EINVAL, "resize to another size");
    tap_is_int(fsdp_tensor_storage_resize(flat, 40), 0, "restore the storage");
    fsdp_mem_get_stats(ctx, &s2);
    tap_is_size(s2.current[FSDP_MEM_PARAMS], s0.current[FSDP_MEM_PARAMS], "accounted again");
    tap_ok(fsdp_tensor_data(b) != NULL, "views work again");

    /* A gradient that is a view into a flat gradient. */
    fsdp_tensor_t *fg = NULL, *gv = NULL;
    fsdp_tensor_zeros(ctx, FSDP_DTYPE_F32, 1, &n, FSDP_MEM_GRADS, &fg);
    fsdp_tensor_view_of(fg, 6, 1, bs, &gv);
    fsdp_tensor_set_requires_grad(b, true);
    tap_is_int(fsdp_tensor_set_grad(b, gv), 0, "a gradient may be a view");
    tap_ok(fsdp_tensor_grad(b) == gv, "and is kept as given");
    fsdp_tensor_t *wrong = NULL;
    fsdp_tensor_zeros(ctx, FSDP_DTYPE_F32, 1, &n, FSDP_MEM_GRADS, &wrong);
    tap_is_int(fsdp_tensor_set_grad(b, wrong), FSDP_EINVAL, "a gradient of the wrong shape");
    tap_has_str(fsdp_ctx_last_error(ctx), "f32[10]", "message names both shapes");
    tap_is_int(fsdp_tensor_zero_grad(b, true), 0, "set to none");
    tap_ok(fsdp_tensor_grad(b) == NULL, "grad is none");
    fsdp_tensor_release(wrong);
    fsdp_tensor_release(gv);
    fsdp_tensor_release(fg);
    fsdp_tensor_release(w);
    fsdp_tensor_release(b);
    fsdp_tensor_release(flat);
}

static void wrap_and_random(void) {
    float mem[4] = {1, 2, 3, 4};
    int64_t four = 4;
    fsdp_tensor_t *t = NULL;
    tap_is_int(fsdp_tensor_wrap(fsdp_ctx_device(ctx), mem, FSDP_DTYPE_F32, 1, &four, &t), 0,
               "wrap user memory");
    fsdp_tensor_fill_(t, 9.0);
    tap_ok(mem[2] == 9.0f, "writes reach the user's memory");
    tap_is_int(fsdp_tensor_storage_resize(t, 0), FSDP_EINVAL, "wrapped memory is never freed");
    fsdp_tensor_release(t);

    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    o.seed = 123;
    fsdp_ctx_t *c1 = NULL, *c2 = NULL;
    fsdp_ctx_create(&o, &c1);
    fsdp_ctx_create(&o, &c2);
    int64_t n = 64;
    fsdp_tensor_t *a = NULL, *b = NULL;
    fsdp_tensor_empty(c1, FSDP_DTYPE_F32, 1, &n, FSDP_MEM_OTHER, &a);
    fsdp_tensor_empty(c2, FSDP_DTYPE_F32, 1, &n, FSDP_MEM_OTHER, &b);
    fsdp_tensor_uniform_(a, -1, 1);
    fsdp_tensor_uniform_(b, -1, 1);
    float x[64], y[64];
    read_f32(a, x);
    read_f32(b, y);
    tap_is_mem(x, y, sizeof x, "same seed, same uniform draws");
    bool in = true;
    for (int i = 0; i < 64; i++) in = in && x[i] >= -1 && x[i] < 1;
    tap_ok(in, "uniform draws lie in [lo, hi)");
    fsdp_tensor_uniform_(a, -1, 1);
    read_f32(a, y);
    tap_ok(memcmp(x, y, sizeof x) != 0, "the stream advances");
    fsdp_tensor_release(a);
    fsdp_tensor_release(b);
    fsdp_ctx_destroy(c1);
    fsdp_ctx_destroy(c2);
}

int main(void) {
    tap_plan_lazy();
    fsdp_ctx_create(NULL, &ctx);
    fsdp_mem_stats_t before, after;
    fsdp_ctx_device(ctx);
    fsdp_mem_get_stats(ctx, &before);
    creation();
    views();
    writes();
    flat_views();
    wrap_and_random();
    fsdp_mem_get_stats(ctx, &after);
    tap_is_size(after.total_current, before.total_current, "every tensor's memory is returned");
    fsdp_ctx_destroy(ctx);
    return tap_done();
}
