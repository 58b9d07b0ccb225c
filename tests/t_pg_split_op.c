/* SPDX-License-Identifier: MIT */
/*
 * t_pg_split_op.c: the core's use of a backend's optional `split` operation (src/pg/pg_impl.h),
 * which the NCCL backend needs because ncclCommSplit is collective over the whole parent.
 *
 * A one-rank fake backend records every call the core makes to it: with `split` set, the core
 * calls it (never create_subgroup) for fsdp_pg_split with the rank's color and for
 * fsdp_pg_new_group with color 0, and also on a rank that passes FSDP_PG_NO_COLOR, with color
 * -1, after the exchange; the group it returns is the caller's.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pg/pg_impl.h"
#include "tap.h"

static struct {
    int splits, creates;
    int color, n, new_rank, member0;
    char name[96];
} calls;

static int fake_post(fsdp_pg_t *pg, fsdp_work_t *w) {
    const fsdp_coll_t *c = &w->coll;
    (void)pg;
    /* One rank: an all_gather is a copy (the core's exchange), the rest have nothing to do. */
    if (c->kind == FSDP_COLL_ALL_GATHER && c->count && c->send != c->recv)
        memcpy(c->recv, c->send, c->count * fsdp_dtype_size(c->dtype));
    fsdp__work_complete(w, FSDP_OK, NULL);
    return FSDP_OK;
}

static void fake_destroy(fsdp_pg_t *pg) {
    fsdp__pg_fini(pg);
    free(pg);
}

static int fake_create_subgroup(fsdp_pg_t *parent, const int *members, int n, int new_rank,
                                const char *name, fsdp_pg_t **out);
static int fake_split(fsdp_pg_t *parent, int color, const int *members, int n, int new_rank,
                      const char *name, fsdp_pg_t **out);

static const struct fsdp_pg_ops fake_ops = {.name = "fake",
                                            .post = fake_post,
                                            .create_subgroup = fake_create_subgroup,
                                            .split = fake_split,
                                            .destroy = fake_destroy};

static int fake_create_subgroup(fsdp_pg_t *parent, const int *members, int n, int new_rank,
                                const char *name, fsdp_pg_t **out) {
    (void)parent, (void)members, (void)n, (void)new_rank, (void)name, (void)out;
    calls.creates++;
    return FSDP_EINTERNAL;
}

static int fake_split(fsdp_pg_t *parent, int color, const int *members, int n, int new_rank,
                      const char *name, fsdp_pg_t **out) {
    calls.splits++;
    calls.color = color;
    calls.n = n;
    calls.new_rank = new_rank;
    calls.member0 = members ? members[0] : -100;
    snprintf(calls.name, sizeof calls.name, "%s", name ? name : "(null)");
    if (color < 0) return FSDP_OK;
    fsdp_pg_t *g = calloc(1, sizeof *g);
    if (!g) return FSDP_ENOMEM;
    if (fsdp__pg_init(g, &fake_ops, parent->ctx, new_rank, n, NULL, name) < 0) {
        fake_destroy(g);
        return FSDP_ENOMEM;
    }
    *out = g;
    return FSDP_OK;
}

int main(void) {
    tap_plan_lazy();
    fsdp_pg_t *pg = calloc(1, sizeof *pg);
    if (!pg || fsdp__pg_init(pg, &fake_ops, NULL, 0, 1, NULL, "world") < 0) tap_bail("init");

    fsdp_pg_t *sub = NULL;
    memset(&calls, 0, sizeof calls);
    int rc = fsdp_pg_split(pg, 5, 0, &sub);
    tap_is_int(rc, FSDP_OK, "split with color 5 succeeds");
    tap_ok(calls.splits == 1 && calls.creates == 0,
           "... through the backend's split, not create_subgroup");
    tap_ok(calls.color == 5 && calls.n == 1 && calls.new_rank == 0 && calls.member0 == 0,
           "... with the rank's color, the members and the new rank");
    tap_is_str(calls.name, "world.0c5", "... and the group's name");
    tap_ok(sub && fsdp_pg_size(sub) == 1 && strcmp(fsdp_pg_name(sub), "world.0c5") == 0,
           "the group split returned is the caller's");
    fsdp_pg_destroy(sub);

    sub = (fsdp_pg_t *)&calls; /* must be reset */
    memset(&calls, 0, sizeof calls);
    rc = fsdp_pg_split(pg, FSDP_PG_NO_COLOR, 0, &sub);
    tap_is_int(rc, FSDP_OK, "split with FSDP_PG_NO_COLOR succeeds");
    tap_ok(calls.splits == 1 && calls.color == -1 && calls.n == 0 && calls.new_rank == -1 &&
               calls.member0 == -100 && strcmp(calls.name, "(null)") == 0,
           "... and still calls split, with color -1 and no members");
    tap_ok(sub == NULL, "... and *out is NULL");

    memset(&calls, 0, sizeof calls);
    int zero = 0;
    rc = fsdp_pg_new_group(pg, &zero, 1, &sub);
    tap_is_int(rc, FSDP_OK, "new_group({0}) succeeds");
    tap_ok(calls.splits == 1 && calls.creates == 0 && calls.color == 0 && calls.n == 1,
           "... through split with color 0");
    tap_has_str(calls.name, "g0", "... naming the group as new_group does");
    fsdp_pg_destroy(sub);
    tap_is_uint(fsdp_pg_seq(pg), 3, "each of the three calls made one exchange on the parent");
    fsdp_pg_destroy(pg);
    return tap_done();
}
