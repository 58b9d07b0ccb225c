/* SPDX-License-Identifier: MIT */
/*
 * t_pg_groups.c: sub-groups on the sim backend: split by color and key, new_group, the
 * per-rank expert groups of the mixture-of-experts tests (CORE-P07/P08: new_group([rank])), the
 * 2x2 and 2x4 meshes of hybrid sharding, and errors.
 */
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "tap.h"

#define MAXW 8

typedef struct {
    int bad[MAXW];       /* bit set per failed check */
    char why[MAXW][256];
} result_t;

static void fail(result_t *res, int r, int bit, const char *why) {
    res->bad[r] |= bit;
    snprintf(res->why[r], sizeof res->why[r], "%s", why);
}

/* 2x2 split of 4 ranks by r / 2 (color) with keys reversed; then sums in each group. */
static int split_2x2(fsdp_ctx_t *ctx, void *arg) {
    result_t *res = arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    int r = fsdp_pg_rank(pg);
    fsdp_pg_t *sub = NULL;
    int rc = fsdp_pg_split(pg, r / 2, -r, &sub);
    if (rc) return rc;
    /* keys -r: the higher parent rank comes first */
    int want_rank = (r % 2 == 0) ? 1 : 0;
    if (fsdp_pg_size(sub) != 2) fail(res, r, 1, "size");
    if (fsdp_pg_rank(sub) != want_rank) fail(res, r, 2, "key order");
    if (fsdp_pg_world_rank(sub, fsdp_pg_rank(sub)) != r) fail(res, r, 4, "world rank map");
    int32_t x = r, s = -1;
    rc = fsdp_pg_all_reduce(sub, &x, &s, 1, FSDP_DTYPE_I32, FSDP_REDOP_SUM, NULL);
    int base = (r / 2) * 2;
    if (rc || s != base + base + 1) fail(res, r, 8, "sum in sub-group");
    if (fsdp_pg_seq(sub) != 1) fail(res, r, 16, "sub-group seq");
    if (fsdp_pg_seq(pg) != 1) fail(res, r, 16, "parent seq counts the split exchange only");
    /* gather inside the sub-group in its own rank order */
    int32_t g[2] = {-1, -1};
    rc = fsdp_pg_all_gather(sub, &x, g, 1, FSDP_DTYPE_I32, NULL);
    if (rc || g[0] != base + 1 || g[1] != base) fail(res, r, 32, "gather order in sub-group");
    fsdp_pg_destroy(sub);
    return rc;
}

/* MoE: every rank gets a group of its own (new_group([rank]) called by all, for each rank). */
static int expert_groups(fsdp_ctx_t *ctx, void *arg) {
    result_t *res = arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    int r = fsdp_pg_rank(pg), n = fsdp_pg_size(pg);
    fsdp_pg_t *mine = NULL;
    for (int q = 0; q < n; q++) {
        fsdp_pg_t *g = NULL;
        int rc = fsdp_pg_new_group(pg, &q, 1, &g);
        if (rc) return rc;
        if ((g != NULL) != (q == r)) fail(res, r, 1, "membership of a one-rank group");
        if (g) mine = g;
    }
    if (!mine || fsdp_pg_size(mine) != 1 || fsdp_pg_rank(mine) != 0) {
        fail(res, r, 2, "own expert group");
        return FSDP_OK;
    }
    float v[3] = {1.5f * r, 2, 3}, out[3];
    int rc = fsdp_pg_all_reduce(mine, v, out, 3, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    if (rc || out[0] != 1.5f * r) fail(res, r, 4, "one-rank all_reduce is the identity");
    rc = fsdp_pg_reduce_scatter(mine, v, out, 3, FSDP_DTYPE_F32, FSDP_REDOP_AVG, NULL);
    if (rc || out[2] != 3) fail(res, r, 8, "one-rank reduce_scatter avg");
    fsdp_pg_destroy(mine);
    return FSDP_OK;
}

/*
 * Hybrid sharding on 8 ranks as 2 replicas x 4 shards: reduce-scatter inside the shard group
 * (consecutive ranks), then all-reduce across replicas (ranks r and r + 4). The result must equal
 * a reduce-scatter over the whole world with the same chunking. The intra group is made with
 * split and the inter group with new_group, so both paths are used.
 */
static int hybrid(fsdp_ctx_t *ctx, void *arg) {
    result_t *res = arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    int r = fsdp_pg_rank(pg);
    enum { SHARDS = 4, REPL = 2, CHUNK = 5 };
    fsdp_pg_t *intra = NULL, *inter = NULL, *tmp = NULL;
    int rc = fsdp_pg_split(pg, r / SHARDS, r, &intra);
    for (int k = 0; k < SHARDS && rc == FSDP_OK; k++) {
        int members[REPL] = {k, k + SHARDS};
        rc = fsdp_pg_new_group(pg, members, REPL, &tmp);
        if (tmp) inter = tmp;
    }
    if (rc) return rc;
    if (!inter || fsdp_pg_size(inter) != 2 || fsdp_pg_size(intra) != 4) {
        fail(res, r, 1, "mesh shape");
        return FSDP_OK;
    }
    /* Integer-valued f32 so the two orders of summation agree exactly. */
    float grad[SHARDS * CHUNK], shard[CHUNK], want = 0;
    for (int i = 0; i < SHARDS * CHUNK; i++) grad[i] = (float)(r * 100 + i);
    rc = fsdp_pg_reduce_scatter(intra, grad, shard, CHUNK, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL);
    if (!rc) rc = fsdp_pg_all_reduce(inter, shard, shard, CHUNK, FSDP_DTYPE_F32, FSDP_REDOP_SUM,
                                     NULL);
    int s = fsdp_pg_rank(intra);
    for (int i = 0; i < CHUNK && !rc; i++) {
        want = 0;
        for (int q = 0; q < 8; q++) want += (float)(q * 100 + s * CHUNK + i);
        if (shard[i] != want) {
            fail(res, r, 2, "hybrid reduction differs from the world reduction");
            break;
        }
    }
    fsdp_pg_destroy(inter);
    fsdp_pg_destroy(intra);
    return rc;
}

/* Ranks that pass FSDP_PG_NO_COLOR, or are not listed, get no group; errors. */
static int edges(fsdp_ctx_t *ctx, void *arg) {
    result_t *res = arg;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    int r = fsdp_pg_rank(pg);
    fsdp_pg_t *sub = (fsdp_pg_t *)1;
    int rc = fsdp_pg_split(pg, r == 0 ? FSDP_PG_NO_COLOR : 7, 0, &sub);
    if (rc) return rc;
    if (r == 0 && sub != NULL) fail(res, r, 1, "no color gives NULL");
    if (r != 0 && (!sub || fsdp_pg_size(sub) != 2)) fail(res, r, 1, "the others form a group");
    if (r != 0) {
        int32_t one = 1, two = 0;
        rc = fsdp_pg_all_reduce(sub, &one, &two, 1, FSDP_DTYPE_I32, FSDP_REDOP_SUM, NULL);
        if (rc || two != 2) fail(res, r, 2, "the colored ranks can talk");
        fsdp_pg_destroy(sub);
    }
    int list[2] = {2, 0};
    rc = fsdp_pg_new_group(pg, list, 2, &sub);
    if (rc) return rc;
    if ((r == 1) != (sub == NULL)) fail(res, r, 4, "new_group members");
    if (sub && fsdp_pg_rank(sub) != (r == 2 ? 0 : 1)) fail(res, r, 8, "list order is rank order");
    /* A forgotten group is reclaimed when the rank exits (ASan would report a leak otherwise). */
    int bad_list[2] = {1, 1};
    if (fsdp_pg_new_group(pg, bad_list, 2, &sub) != FSDP_EINVAL) fail(res, r, 16, "duplicate");
    if (!strstr(fsdp_pg_last_error(pg), "twice")) fail(res, r, 16, "duplicate message");
    int out_of_range = 3;
    if (fsdp_pg_new_group(pg, &out_of_range, 1, &sub) != FSDP_EINVAL) fail(res, r, 32, "range");
    if (fsdp_pg_split(pg, -5, 0, &sub) != FSDP_EINVAL) fail(res, r, 64, "negative color");
    /* Ranks passing different lists are told so. */
    int differ[1] = {r == 2 ? 1 : 0};
    rc = fsdp_pg_new_group(pg, differ, 1, &sub);
    if (rc != FSDP_EMISMATCH) fail(res, r, 128, "different lists give FSDP_EMISMATCH");
    else if (!strstr(fsdp_pg_last_error(pg), "different rank list")) fail(res, r, 128, "message");
    return FSDP_OK;
}

static void check(const char *name, int n, fsdp_sim_fn fn) {
    result_t res;
    memset(&res, 0, sizeof res);
    fsdp_sim_options_t o;
    fsdp_sim_options_init(&o);
    o.world_size = n;
    o.timeout_ms = 20000;
    int rc = fsdp_sim_run(&o, fn, &res, NULL);
    tap_is_int(rc, FSDP_OK, "%s: every rank returns OK", name);
    int bad = 0;
    for (int r = 0; r < n; r++) {
        if (res.bad[r]) tap_diag("rank %d: %s (bits 0x%x)", r, res.why[r], res.bad[r]);
        bad |= res.bad[r];
    }
    tap_is_int(bad, 0, "%s: every check passes on every rank", name);
}

int main(void) {
    tap_plan_lazy();
    check("split 2x2 with reversed keys", 4, split_2x2);
    check("one-rank expert groups, world 4", 4, expert_groups);
    check("one-rank expert groups, world 1", 1, expert_groups);
    check("hybrid 2x4 reduce-scatter + all-reduce", 8, hybrid);
    check("no color, subsets and errors", 3, edges);
    return tap_done();
}
