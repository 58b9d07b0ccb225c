/* SPDX-License-Identifier: MIT */
/*
 * coll_check.h: backend-agnostic checks of one collective against closed-form expected values.
 *
 * The foundation's collective suite (seed behaviour F02, "Collectives that FSDP and the
 * references use") runs every collective over every dtype and reduction operator, and checks
 * each result element against a value computed in the test from a closed form, never by
 * running another implementation of the collective. The same helpers serve every backend: they
 * take a process group, run on one rank, and talk to the group through the public fsdp_pg_* API
 * only. Every rank of the group must call them with the same arguments, in the same order, as
 * for any collective.
 *
 * Inputs. coll_check_value() gives rank `rank`'s input element `index` for operator `op`. The
 * values are chosen per dtype and operator so that the contract of fsdp/pg.h fixes every result
 * bit:
 *   - floats (f32, f64, f16, bf16): sums and averages use quarter-integers in [-8, 8), and
 *     2048 on rank 0 at every fifth index, min and max use half-integers in [-60, 60], products use
 *     factors from {1, -1, 2, 0.5, 1.5, -3, -0.5} on ranks below 8 and +-1 above. All of them
 *     are exact in bf16 and f16, and every sum and product over up to 64 ranks is exact in f32
 *     (and in double), so the order of accumulation does not matter. For f16 and bf16 the only
 *     rounding is the one the contract prescribes: the f32 result (divided by the group size in
 *     f32 for avg) rounded once to the 16-bit type, which is where the 2048 and the factors 1.5
 *     and 3 make the difference with a 16-bit accumulation show.
 *   - i32, i64, u8: sums and products mix small values with full-range ones, so they wrap around
 *     modulo 2^bits as documented; avg is the wrapped sum divided by the group size with
 *     truncation toward zero; min and max include the extreme values of the type.
 *   - bool: for sum and max ("or") one rank at most has a 1 at an index; for prod and min
 *     ("and") one rank at most has a 0; some indices have no such rank.
 *   - COLL_CHECK_MOVE: for the collectives that only move data, hashed bit patterns of (rank,
 *     index) (never a NaN or an infinity), so a misplaced element is seen.
 * Every value depends on the index through index % COLL_CHECK_PERIOD (a prime), which lets the
 * checker compare large buffers against one precomputed period with memcmp. The price: an
 * element displaced by a multiple of the period would go unseen, so chunk counts that are
 * multiples of it are best avoided.
 *
 * Expected values. coll_check_expected() reduces the closed forms of ranks 0 .. size-1 in double
 * (floats) or in unsigned integers of the type's width (wrap-around), then applies the
 * contract: avg divides in the accumulation type (f32 for f16/bf16), f16/bf16 results are
 * rounded once with fsdp_f32_to_f16()/fsdp_f32_to_bf16(), bool sum/max are "or" and prod/min
 * are "and".
 */
#ifndef FSDP_TESTS_COLL_CHECK_H
#define FSDP_TESTS_COLL_CHECK_H

#include <stddef.h>

#include <fsdp.h>

/* Pseudo-operator: the input patterns of the collectives that do not reduce. */
#define COLL_CHECK_MOVE FSDP_REDOP_COUNT

/* Inputs are periodic in the element index with this (prime) period. */
#define COLL_CHECK_PERIOD 16381u

/* Return value of the checks when the collective ran but a result was wrong. */
#define COLL_CHECK_MISMATCH 1

/* Writes rank `rank`'s input element `index` for `op` (or COLL_CHECK_MOVE) into *out, as one
 * element of type dt. */
void coll_check_value(fsdp_dtype_t dt, int rank, size_t index, fsdp_redop_t op, void *out);

/* Writes into *out the result the contract prescribes at element `index` for reducing the inputs
 * of ranks 0 .. size-1 with op (one element of type dt). */
void coll_check_expected(fsdp_dtype_t dt, fsdp_redop_t op, int size, size_t index, void *out);

/* Formats one element of type dt ("-2.5 (0xc100)", "-7", "1"). */
void coll_check_format(fsdp_dtype_t dt, const void *elem, char *buf, size_t cap);

/* What a collective kind takes. */
int coll_check_has_op(fsdp_coll_kind_t kind);
int coll_check_has_root(fsdp_coll_kind_t kind);
/* 1 when the kind has an in-place form (every data collective except all_to_all). */
int coll_check_has_in_place(fsdp_coll_kind_t kind);

/* The count whose message (as the counters of fsdp/pg.h count bytes: size * count elements for
 * all_gather, reduce_scatter and all_to_all, count elements otherwise) is `bytes` long, rounded
 * down. */
size_t coll_check_count_for_bytes(fsdp_coll_kind_t kind, fsdp_dtype_t dt, int size, size_t bytes);

/* One check. */
typedef struct coll_check_args {
    fsdp_coll_kind_t kind;
    fsdp_dtype_t dtype;
    fsdp_redop_t op; /* reductions only */
    size_t count;    /* as the fsdp_pg_* call takes it */
    /* The in-place form (see fsdp/pg.h). For all_to_all, which has none, send == recv is
     * passed and the check is that the call is rejected with FSDP_EINVAL (accepted when count
     * is 0: nothing overlaps then). */
    int in_place;
    int root; /* broadcast and reduce */
    /* Pass NULL for the buffers the contract says are not used: broadcast's send on non-roots
     * and reduce's recv on non-roots (out of place only). */
    int null_unused;
    /* Issue with a work handle and fsdp_work_wait() it, instead of a blocking call. */
    int async;
} coll_check_args_t;

/*
 * Allocates guarded buffers, fills them from the closed forms, runs the collective through the
 * public API, and verifies: every element of the destination, that send is unchanged (and, for
 * reduce, that a non-root's recv is untouched), that nothing is written into guard regions
 * around every buffer, that the call consumed exactly one sequence number, and that the
 * group's counters grew by one call and the message's bytes. Returns 0 when all of that holds,
 * COLL_CHECK_MISMATCH when a check failed, or the negative status of a failed call; `why`
 * (cap bytes) then names the first problem (for a wrong element: where, got, want).
 */
int coll_check_run_args(fsdp_pg_t *pg, const coll_check_args_t *args, char *why, size_t cap);

/* Allocator of the send and recv buffers for the calling process (NULL, NULL: malloc and
 * free, the default). The checker reads and writes them from the host, so for a GPU backend
 * they must be memory both sides reach, such as CUDA managed memory. Set it before the first
 * check, or after coll_check_release(). */
void coll_check_set_alloc(void *(*alloc)(size_t bytes), void (*release)(void *p));

/* The checks keep their buffers from one call to the next, per thread; this frees the calling
 * thread's. Call it before a thread that ran checks exits. */
void coll_check_release(void);

/* coll_check_run_args() with null_unused = 0 and async = 0. */
int coll_check_run(fsdp_pg_t *pg, fsdp_coll_kind_t kind, fsdp_dtype_t dt, fsdp_redop_t op,
                   size_t count, int in_place, int root, char *why, size_t cap);

#endif /* FSDP_TESTS_COLL_CHECK_H */
