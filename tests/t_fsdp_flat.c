/* SPDX-License-Identifier: MIT */
/*
 * t_fsdp_flat.c: the flat-parameter arithmetic (fsdp-reference.md section 1.2) and the gradient
 * divide factors (section 1.10), checked against the worked examples and against a brute-force
 * walk over every element.
 */
#include <stdlib.h>

#include "fsdp/fsdp_impl.h"
#include "tap.h"

/* Every element of every parameter appears in exactly one rank's shard, at the place the shard
 * info says; padding never overlaps a parameter. */
static void brute_force(const char *what, int n, const int64_t *numel, int align, int world) {
    fsdp__layout_t l;
    if (fsdp__layout_build(n, numel, align, world, &l) != 0) {
        tap_ok(0, "%s: layout built", what);
        return;
    }
    bool ok = l.padded_numel == l.shard_numel * world && l.padded_numel >= l.unpadded_numel &&
              l.shard_numel * world - l.unpadded_numel < world;
    int64_t end = 0;
    for (int i = 0; i < n && ok; i++) {
        if (l.offset[i] < end) ok = false;
        if (align > 1 && l.offset[i] % align != 0) ok = false;
        end = l.offset[i] + numel[i];
        int64_t covered = 0;
        for (int r = 0; r < world; r++) {
            fsdp__shard_info_t s;
            fsdp__layout_shard_info(&l, i, r, &s);
            if (!s.in_shard) {
                if (s.numel_in_shard != 0) ok = false;
                continue;
            }
            /* Element intra_start + k of parameter i is unsharded element offset + intra_start
             * + k, which rank r holds at r * S + offset_in_shard + k. */
            int64_t unsharded = l.offset[i] + s.intra_start;
            if (unsharded != (int64_t)r * l.shard_numel + s.offset_in_shard) ok = false;
            if (s.offset_in_shard + s.numel_in_shard > l.shard_numel) ok = false;
            if (s.intra_start + s.numel_in_shard > numel[i]) ok = false;
            covered += s.numel_in_shard;
        }
        if (covered != numel[i]) ok = false;
    }
    if (align > 1 && world > 1 && l.unpadded_numel % world != 0) ok = false;
    tap_ok(ok, "%s: %d params, align %d, world %d: shards cover every element once (S %lld)",
           what, n, align, world, (long long)l.shard_numel);
    fsdp__layout_free(&l);
}

int main(void) {
    tap_plan_lazy();

    /* Spec examples: N = 76, W = 8 gives S = 10, rank 7 holds 6 elements and 4 padding. */
    {
        const int64_t numel[1] = {76};
        fsdp__layout_t l;
        fsdp__layout_build(1, numel, 1, 8, &l);
        tap_is_int(l.shard_numel, 10, "N 76 W 8: shard numel 10");
        tap_is_int(l.padded_numel, 80, "N 76 W 8: padded numel 80");
        fsdp__shard_info_t s;
        fsdp__layout_shard_info(&l, 0, 7, &s);
        tap_ok(s.in_shard && s.numel_in_shard == 6 && s.intra_start == 70 &&
                   s.offset_in_shard == 0,
               "N 76 W 8: rank 7 holds elements 70..75 (got in %d, n %lld, start %lld)",
               s.in_shard, (long long)s.numel_in_shard, (long long)s.intra_start);
        fsdp__layout_free(&l);
    }
    /* N = 5, W = 4: S = 2, rank 3 has an empty chunk and pads 2. */
    {
        const int64_t numel[1] = {5};
        fsdp__layout_t l;
        fsdp__layout_build(1, numel, 1, 4, &l);
        fsdp__shard_info_t s;
        fsdp__layout_shard_info(&l, 0, 3, &s);
        tap_ok(l.shard_numel == 2 && !s.in_shard && s.numel_in_shard == 0,
               "N 5 W 4: S 2 and rank 3 holds nothing of the parameter");
        fsdp__layout_shard_info(&l, 0, 2, &s);
        tap_ok(s.in_shard && s.numel_in_shard == 1 && s.intra_start == 4,
               "N 5 W 4: rank 2 holds the last element");
        fsdp__layout_free(&l);
    }
    /* Alignment (use_orig_params): f32 aligns to 4 elements, then the total to the world. */
    {
        const int64_t numel[3] = {3, 5, 2};
        fsdp__layout_t l;
        fsdp__layout_build(3, numel, 4, 3, &l);
        tap_ok(l.offset[0] == 0 && l.offset[1] == 4 && l.offset[2] == 12,
               "aligned offsets 0, 4, 12 (got %lld, %lld, %lld)", (long long)l.offset[0],
               (long long)l.offset[1], (long long)l.offset[2]);
        tap_is_int(l.unpadded_numel, 15, "aligned total 14 padded to a multiple of 3: 15");
        tap_is_int(l.shard_numel, 5, "aligned shard numel 5");
        fsdp__layout_free(&l);
        fsdp__layout_build(3, numel, 1, 3, &l);
        tap_ok(l.offset[1] == 3 && l.offset[2] == 8 && l.unpadded_numel == 10 &&
                   l.shard_numel == 4,
               "unaligned: offsets 0, 3, 8, total 10, shard 4");
        fsdp__layout_free(&l);
    }
    /* A parameter spanning three shards: intra_start and offset_in_shard on each. */
    {
        const int64_t numel[3] = {2, 9, 1};
        fsdp__layout_t l;
        fsdp__layout_build(3, numel, 1, 3, &l); /* 12 elements, S 4 */
        fsdp__shard_info_t s0, s1, s2;
        fsdp__layout_shard_info(&l, 1, 0, &s0);
        fsdp__layout_shard_info(&l, 1, 1, &s1);
        fsdp__layout_shard_info(&l, 1, 2, &s2);
        tap_ok(s0.offset_in_shard == 2 && s0.numel_in_shard == 2 && s0.intra_start == 0,
               "middle parameter on rank 0: shard offset 2, 2 elements");
        tap_ok(s1.offset_in_shard == 0 && s1.numel_in_shard == 4 && s1.intra_start == 2,
               "middle parameter on rank 1: elements 2..5");
        tap_ok(s2.offset_in_shard == 0 && s2.numel_in_shard == 3 && s2.intra_start == 6,
               "middle parameter on rank 2: elements 6..8");
        fsdp__layout_free(&l);
    }
    /* Zero-size parameters are in no shard. */
    {
        const int64_t numel[3] = {4, 0, 4};
        fsdp__layout_t l;
        fsdp__layout_build(3, numel, 1, 2, &l);
        bool none = true;
        for (int r = 0; r < 2; r++) {
            fsdp__shard_info_t s;
            fsdp__layout_shard_info(&l, 1, r, &s);
            none &= !s.in_shard;
        }
        tap_ok(none, "a zero-size parameter is in no rank's shard");
        fsdp__layout_free(&l);
    }

    /* Brute force over many shapes. */
    const int64_t sizes[][6] = {{1, 1, 1, 1, 1, 1},   {7, 3, 11, 2, 5, 13}, {496, 0, 0, 0, 0, 0},
                                {32, 4, 64, 16, 256, 16}, {1, 1000, 3, 3, 3, 1}};
    const int counts[] = {6, 6, 1, 6, 6};
    for (int k = 0; k < 5; k++)
        for (int world = 1; world <= 8; world++) {
            brute_force("unaligned", counts[k], sizes[k], 1, world);
            brute_force("aligned f32", counts[k], sizes[k], 4, world);
        }

    /* Gradient divide factors (section 1.10): pre * post = W; pre the largest power of two
     * with pre < W / pre that divides W... as PyTorch's loop computes. */
    const struct {
        int w;
        double pre, post;
    } f[] = {{1, 1, 1}, {2, 2, 1}, {3, 2, 1.5}, {4, 2, 2}, {8, 4, 2}, {16, 4, 4}, {32, 8, 4}};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        double pre, post;
        fsdp__divide_factors(f[i].w, &pre, &post);
        tap_ok(pre == f[i].pre && post == f[i].post,
               "divide factors W %d: pre %g post %g (want %g, %g)", f[i].w, pre, post, f[i].pre,
               f[i].post);
    }
    return tap_done();
}
