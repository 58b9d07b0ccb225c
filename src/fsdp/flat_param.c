/* SPDX-License-Identifier: MIT */
/*
 * flat_param.c: where each parameter lives in a unit's flat parameter and in each rank's shard.
 *
 * The arithmetic follows PyTorch's FlatParamHandle (spec: fsdp-reference.md section 1.2):
 * parameters are concatenated in order; with alignment (use_orig_params) each one starts at a
 * multiple of align_numel elements and the total is padded to a multiple of the world size;
 * every rank holds shard_numel = ceil(total / world) elements, rank r the unsharded range
 * [r * shard_numel, (r + 1) * shard_numel), zero-padded past the end.
 */
#include <stdlib.h>

#include "fsdp/fsdp_impl.h"

int fsdp__layout_build(int n, const int64_t *numel, int align_numel, int world,
                       fsdp__layout_t *out) {
    *out = (fsdp__layout_t){0};
    out->n = n;
    out->world = world;
    size_t cnt = (size_t)(n > 0 ? n : 1);
    out->numel = calloc(cnt, sizeof *out->numel);
    out->offset = calloc(cnt, sizeof *out->offset);
    if (!out->numel || !out->offset) {
        fsdp__layout_free(out);
        return FSDP_ENOMEM;
    }
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        if (align_numel > 1) {
            int64_t pad = align_numel - total % align_numel;
            if (pad > 0 && pad < align_numel) total += pad;
        }
        out->numel[i] = numel[i];
        out->offset[i] = total;
        total += numel[i];
    }
    if (align_numel > 1 && world > 1 && total % world != 0) total += world - total % world;
    out->unpadded_numel = total;
    out->shard_numel = (total + world - 1) / world;
    out->padded_numel = out->shard_numel * world;
    return FSDP_OK;
}

void fsdp__layout_free(fsdp__layout_t *l) {
    free(l->numel);
    free(l->offset);
    l->numel = l->offset = NULL;
    l->n = 0;
}

void fsdp__layout_shard_info(const fsdp__layout_t *l, int i, int rank, fsdp__shard_info_t *out) {
    *out = (fsdp__shard_info_t){0};
    int64_t ps = l->offset[i], pe = l->offset[i] + l->numel[i] - 1; /* inclusive */
    int64_t ss = (int64_t)rank * l->shard_numel, se = ss + l->shard_numel - 1;
    if (l->numel[i] == 0 || l->shard_numel == 0 || ss > pe || se < ps) return;
    out->in_shard = true;
    if (ss <= ps) {
        out->intra_start = 0;
        out->offset_in_shard = ps - ss;
    } else {
        out->intra_start = ss - ps;
        out->offset_in_shard = 0;
    }
    int64_t intra_end = (pe < se ? pe : se) - ps;
    out->numel_in_shard = intra_end - out->intra_start + 1;
}

void fsdp__divide_factors(int world, double *pre, double *post) {
    int f = 1;
    while (world % f == 0 && world / f > f) f *= 2;
    *pre = (double)f;
    *post = (double)world / (double)f;
}
