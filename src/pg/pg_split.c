/* SPDX-License-Identifier: MIT */
/*
 * pg_split.c: sub-groups, built once in the core for every backend.
 *
 * Both split and new_group are collective over the parent: the core all-gathers what each rank
 * passed (through the parent itself), works out the members, checks that the ranks agree, and
 * asks the backend for a handle on a group made of those members. The new group's name is the
 * parent's name, the parent sequence number of the exchange and the color, which is the same on
 * every member and never reused, so backends can use it as a rendezvous key.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pg/pg_impl.h"

/* All-gathers n int64 values from every rank of pg into all[size * n] (synchronously). */
static int exchange(fsdp_pg_t *pg, const int64_t *mine, size_t n, int64_t *all) {
    fsdp_coll_t c = {.kind = FSDP_COLL_ALL_GATHER,
                     .send = mine,
                     .recv = all,
                     .count = n,
                     .dtype = FSDP_DTYPE_I64,
                     .host = true};
    return fsdp__pg_issue(pg, &c, NULL);
}

static int create(fsdp_pg_t *pg, const int *members, int n, int new_rank, uint64_t tag,
                  const char *kind, int color, fsdp_pg_t **out) {
    char name[sizeof pg->name];
    int len =
        snprintf(name, sizeof name, "%s.%llu%s%d", pg->name, (unsigned long long)tag, kind, color);
    if (len < 0 || (size_t)len >= sizeof name)
        return fsdp__pg_err(pg, FSDP_EINVAL,
                            "sub-group of '%s': the name '%s...' is longer than %zu characters "
                            "(groups nested too deeply)",
                            pg->name, name, sizeof name - 1);
    int rc = pg->ops->split ? pg->ops->split(pg, color, members, n, new_rank, name, out)
                            : pg->ops->create_subgroup(pg, members, n, new_rank, name, out);
    if (rc == FSDP_OK) fsdp_pg_set_timeout(*out, pg->timeout_ms);
    return rc;
}

int fsdp_pg_split(fsdp_pg_t *pg, int color, int key, fsdp_pg_t **out) {
    if (!out) return pg ? fsdp__pg_err(pg, FSDP_EINVAL, "fsdp_pg_split: out is NULL") : FSDP_EINVAL;
    *out = NULL;
    if (!pg) return FSDP_EINVAL;
    if (color < 0 && color != FSDP_PG_NO_COLOR)
        return fsdp__pg_err(pg, FSDP_EINVAL,
                            "fsdp_pg_split on group '%s' (rank %d): color %d must be >= 0 or "
                            "FSDP_PG_NO_COLOR",
                            pg->name, pg->rank, color);
    if (!pg->ops->create_subgroup && !pg->ops->split)
        return fsdp__pg_err(pg, FSDP_ENOTSUP, "fsdp_pg_split: the %s backend cannot split groups",
                            pg->ops->name);
    uint64_t tag = pg->seq;
    int64_t mine[2] = {color, key};
    int64_t *all = malloc((size_t)pg->size * 2 * sizeof *all);
    int *members = malloc((size_t)pg->size * sizeof *members);
    int rc = FSDP_OK;
    if (!all || !members) {
        rc = fsdp__pg_err(pg, FSDP_ENOMEM, "fsdp_pg_split: out of memory");
        goto out;
    }
    FSDP_TRY(rc, out, exchange(pg, mine, 2, all));
    if (color == FSDP_PG_NO_COLOR) {
        /* A backend that splits over the whole parent needs this rank in the call too. */
        if (pg->ops->split) rc = pg->ops->split(pg, -1, NULL, 0, -1, NULL, out);
        goto out;
    }
    /* Members in (key, parent rank) order: insertion sort, the lists are short. */
    int n = 0, new_rank = -1;
    for (int q = 0; q < pg->size; q++) {
        if (all[2 * q] != color) continue;
        int i = n++;
        while (i > 0 && all[2 * members[i - 1] + 1] > all[2 * q + 1]) {
            members[i] = members[i - 1];
            i--;
        }
        members[i] = q;
    }
    for (int i = 0; i < n; i++)
        if (members[i] == pg->rank) new_rank = i;
    rc = create(pg, members, n, new_rank, tag, "c", color, out);
out:
    free(all);
    free(members);
    return rc;
}

/* FNV-1a over the list, to check cheaply that every rank passed the same one. */
static int64_t list_hash(const int *ranks, int n) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++) {
        h ^= (uint64_t)(uint32_t)ranks[i];
        h *= 1099511628211ull;
    }
    h ^= (uint64_t)n;
    return (int64_t)(h >> 1);
}

int fsdp_pg_new_group(fsdp_pg_t *pg, const int *ranks, int n, fsdp_pg_t **out) {
    if (!out)
        return pg ? fsdp__pg_err(pg, FSDP_EINVAL, "fsdp_pg_new_group: out is NULL") : FSDP_EINVAL;
    *out = NULL;
    if (!pg) return FSDP_EINVAL;
    if (!pg->ops->create_subgroup && !pg->ops->split)
        return fsdp__pg_err(pg, FSDP_ENOTSUP,
                            "fsdp_pg_new_group: the %s backend cannot create groups",
                            pg->ops->name);
    if (n < 1 || n > pg->size || !ranks)
        return fsdp__pg_err(
            pg, FSDP_EINVAL,
            "fsdp_pg_new_group on group '%s' (rank %d): %d ranks given, need 1 to %d", pg->name,
            pg->rank, n, pg->size);
    int new_rank = -1;
    for (int i = 0; i < n; i++) {
        if (ranks[i] < 0 || ranks[i] >= pg->size)
            return fsdp__pg_err(pg, FSDP_EINVAL,
                                "fsdp_pg_new_group on group '%s' (rank %d): ranks[%d] = %d is "
                                "outside [0, %d)",
                                pg->name, pg->rank, i, ranks[i], pg->size);
        for (int j = 0; j < i; j++)
            if (ranks[j] == ranks[i])
                return fsdp__pg_err(pg, FSDP_EINVAL,
                                    "fsdp_pg_new_group on group '%s' (rank %d): rank %d is listed "
                                    "twice (ranks[%d] and ranks[%d])",
                                    pg->name, pg->rank, ranks[i], j, i);
        if (ranks[i] == pg->rank) new_rank = i;
    }
    uint64_t tag = pg->seq;
    int64_t mine = list_hash(ranks, n);
    int64_t *all = malloc((size_t)pg->size * sizeof *all);
    if (!all) return fsdp__pg_err(pg, FSDP_ENOMEM, "fsdp_pg_new_group: out of memory");
    int rc = exchange(pg, &mine, 1, all);
    if (rc == FSDP_OK) {
        for (int q = 0; q < pg->size; q++) {
            if (all[q] != mine) {
                rc =
                    fsdp__pg_err(pg, FSDP_EMISMATCH,
                                 "fsdp_pg_new_group on group '%s': rank %d passed a different rank "
                                 "list than rank %d (every rank must pass the same list)",
                                 pg->name, q, pg->rank);
                break;
            }
        }
    }
    free(all);
    if (rc < 0) return rc;
    if (new_rank < 0) return pg->ops->split ? pg->ops->split(pg, -1, NULL, 0, -1, NULL, out) : rc;
    return create(pg, ranks, n, new_rank, tag, "g", 0, out);
}
