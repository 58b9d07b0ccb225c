/* SPDX-License-Identifier: MIT */
/*
 * shard_parity.h: what the stream-ordering tests (t_fsdp_stream, t_fsdp_agstream) share to
 * compare a run on a device with streams against a plain one: every unit's local shard read
 * back, and the F03 check that losses and shards are bitwise the reference's.
 */
#ifndef FSDP_TESTS_SHARD_PARITY_H
#define FSDP_TESTS_SHARD_PARITY_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp/fsdp_impl.h"
#include "fsdp_util.h"

/* This rank's local shard of every unit of root's tree, in the tree's order, as f32 values
 * widened, into *out (its old array freed). */
static inline int sp_shard_values(const fsdp_unit_t *root, fu_vals_t *out) {
    fu_vals_free(out);
    for (size_t i = 0; i < root->nall; i++) {
        const fsdp_tensor_t *flat = fsdp_unit_flat_param(root->all[i]);
        if (!flat) continue;
        int64_t n = 0;
        float *f = fu_host_f32(flat, &n);
        double *v = f ? realloc(out->v, (out->n + (size_t)n + 1) * sizeof *v) : NULL;
        if (!v) {
            free(f);
            return FSDP_ENOMEM;
        }
        out->v = v;
        for (int64_t e = 0; e < n; e++)
            out->v[out->n++] = f[e];
        free(f);
    }
    return FSDP_OK;
}

/* F03 (results must not change with the execution path): a run's n losses and its shards are
 * bitwise its reference's. `run` and `ref` name them in the two checks ("STREAM's", "BLOCK's"). */
static inline void sp_ck_bitwise_run(fu_res_t *r, const double *loss, const double *ref_loss,
                                     size_t n, const fu_vals_t *params, const fu_vals_t *ref_params,
                                     const char *run, const char *ref) {
    char name[300], why[200] = "";
    snprintf(name, sizeof name, "F03: %s losses are bitwise %s", run, ref);
    fu_ck(r, memcmp(loss, ref_loss, n * sizeof *loss) == 0, name, "step 0: %.9g vs %.9g", loss[0],
          ref_loss[0]);
    snprintf(name, sizeof name, "F03: %s shards after %zu steps are bitwise %s", run, n, ref);
    fu_ck(r, ref_params->n > 0 && fu_vals_same(params, ref_params, why, sizeof why), name, "%s",
          why[0] ? why : "no values");
}

#endif /* FSDP_TESTS_SHARD_PARITY_H */
