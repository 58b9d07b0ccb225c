/* SPDX-License-Identifier: MIT */
/*
 * t_pg_dummy.c: the DummyProcessGroup for construction-only tests (WRAP-TA-*: size 2 at rank 0,
 * collectives complete at once as no-ops or fail, as chosen at creation).
 */
#include <string.h>

#include <fsdp.h>

#include "tap.h"

int main(void) {
    tap_plan_lazy();
    fsdp_pg_t *pg = NULL;
    tap_is_int(fsdp_pg_create_dummy(NULL, 0, 2, FSDP_DUMMY_NOOP, &pg), FSDP_OK,
               "dummy group of size 2 at rank 0, without a context");
    tap_is_int(fsdp_pg_rank(pg), 0, "rank");
    tap_is_int(fsdp_pg_size(pg), 2, "size");
    tap_is_str(fsdp_pg_backend(pg), "dummy", "backend name");
    float x[4] = {1, 2, 3, 4}, y[8] = {9, 9, 9, 9, 9, 9, 9, 9};
    tap_is_int(fsdp_pg_all_reduce(pg, x, y, 4, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL), FSDP_OK,
               "a no-op all_reduce completes");
    tap_ok(y[0] == 9 && y[3] == 9, "without touching the buffers");
    fsdp_work_t *w = NULL;
    tap_is_int(fsdp_pg_all_gather(pg, x, y, 4, FSDP_DTYPE_F32, &w), FSDP_OK, "async no-op");
    int done = 0;
    fsdp_work_test(w, &done);
    tap_is_int(done, 1, "its work is already complete");
    tap_is_int(fsdp_work_wait(w, 0), FSDP_OK, "and waits OK with a zero timeout");
    fsdp_work_release(w);
    tap_is_int(fsdp_pg_all_reduce(pg, NULL, y, 4, FSDP_DTYPE_F32, FSDP_REDOP_SUM, NULL),
               FSDP_EINVAL, "arguments are still checked");
    tap_has_str(fsdp_pg_last_error(pg), "send is NULL", "with a message");
    fsdp_pg_t *sub = NULL;
    tap_is_int(fsdp_pg_split(pg, 0, 0, &sub), FSDP_ENOTSUP, "splitting is not supported");
    fsdp_pg_counters_t c;
    fsdp_pg_get_counters(pg, &c);
    tap_is_uint(c.calls[FSDP_COLL_ALL_REDUCE], 1, "counters count the dummy's collectives");
    tap_is_uint(c.bytes[FSDP_COLL_ALL_GATHER], 32, "all_gather bytes are size * count");
    fsdp_pg_destroy(pg);

    tap_is_int(fsdp_pg_create_dummy(NULL, 3, 4, FSDP_DUMMY_FAIL, &pg), FSDP_OK, "failing dummy");
    tap_is_int(fsdp_pg_barrier(pg, NULL), FSDP_ENOTSUP, "its collectives fail");
    tap_has_str(fsdp_pg_last_error(pg), "FSDP_DUMMY_FAIL", "the message says why");
    tap_is_int(fsdp_pg_broadcast(pg, x, y, 4, FSDP_DTYPE_F32, 0, &w), FSDP_OK,
               "an async call returns a work");
    tap_is_int(fsdp_work_wait(w, -1), FSDP_ENOTSUP, "whose wait reports the failure");
    tap_has_str(fsdp_work_error(w), "broadcast", "and the work's error names the collective");
    fsdp_work_release(w);
    fsdp_pg_destroy(pg);

    tap_is_int(fsdp_pg_create_dummy(NULL, 2, 2, FSDP_DUMMY_NOOP, &pg), FSDP_EINVAL,
               "rank 2 of 2 is rejected");
    tap_ok(pg == NULL, "and no group is returned");
    tap_is_int(fsdp_pg_create_dummy(NULL, 0, 1, 7, &pg), FSDP_EINVAL, "a bad mode is rejected");
    fsdp_pg_destroy(NULL);
    return tap_done();
}
