/* SPDX-License-Identifier: MIT */
/*
 * t_core.c: logging, per-rank memory accounting, the context, the reduction kernels, the
 * large-message copies (core/copy.h), and the CPUs the process may run on (core/cpus.h).
 */
#define _GNU_SOURCE

#include <math.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "core/copy.h"
#include "core/cpus.h"
#include "core/reduce.h"
#include "cpu_pin.h"
#include "tap.h"

/* A log sink that keeps the last message and counts them. */
typedef struct {
    int count;
    int rank;
    fsdp_log_level_t level;
    char last[1024];
} captured_t;

static void capture(void *user, int rank, fsdp_log_level_t level, const char *msg) {
    captured_t *c = user;
    c->count++;
    c->rank = rank;
    c->level = level;
    snprintf(c->last, sizeof c->last, "%s", msg);
}

static void test_log(void) {
    fsdp_log_level_t lv;
    tap_is_int(fsdp_log_level_parse("WARN", &lv), FSDP_OK, "level names are case-insensitive");
    tap_is_int(lv, FSDP_LOG_WARN, "WARN parses to warn");
    tap_is_int(fsdp_log_level_parse("trace", &lv), FSDP_OK, "trace is accepted");
    tap_is_int(lv, FSDP_LOG_DEBUG, "trace means debug");
    tap_is_int(fsdp_log_level_parse("loud", &lv), FSDP_EINVAL, "an unknown level is rejected");
    setenv("FSDP_LOG", "info", 1);
    tap_is_int(fsdp_log_level_from_env(), FSDP_LOG_INFO, "FSDP_LOG=info is read");
    setenv("FSDP_LOG", "nonsense", 1);
    tap_is_int(fsdp_log_level_from_env(), FSDP_LOG_WARN, "a bad FSDP_LOG falls back to warn");
    unsetenv("FSDP_LOG");
    tap_is_int(fsdp_log_level_from_env(), FSDP_LOG_WARN, "the default level is warn");

    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    o.rank = 2;
    o.world_size = 4;
    o.log_level = FSDP_LOG_INFO;
    fsdp_ctx_t *ctx = NULL;
    tap_is_int(fsdp_ctx_create(&o, &ctx), FSDP_OK, "context for rank 2 of 4");
    captured_t cap = {0};
    fsdp_ctx_set_log_sink(ctx, capture, &cap);
    fsdp_log(ctx, FSDP_LOG_WARN, "shard %d of %s", 3, "layer1");
    tap_is_int(cap.count, 1, "a warning reaches the sink");
    tap_is_str(cap.last, "shard 3 of layer1", "the sink gets the formatted message");
    tap_is_int(cap.rank, 2, "the sink is told the rank");
    tap_is_int(cap.level, FSDP_LOG_WARN, "the sink is told the level");
    fsdp_log(ctx, FSDP_LOG_DEBUG, "hidden");
    tap_is_int(cap.count, 1, "debug is filtered at level info");
    fsdp_ctx_set_log_level(ctx, FSDP_LOG_DEBUG);
    fsdp_log(ctx, FSDP_LOG_DEBUG, "shown");
    tap_is_int(cap.count, 2, "debug passes after raising the level");
    fsdp_ctx_set_log_level(ctx, FSDP_LOG_OFF);
    fsdp_log(ctx, FSDP_LOG_ERROR, "muted");
    tap_is_int(cap.count, 2, "level off silences errors too");

    /* Warnings stay queryable whatever the level. */
    char w[64];
    tap_is_int((int)fsdp_ctx_warnings(ctx, w, sizeof w), 1,
               "fsdp_ctx_warnings counts the one warning so far (debug and error lines are not "
               "warnings)");
    tap_is_str(w, "shard 3 of layer1", "and returns its text");
    fsdp_log(ctx, FSDP_LOG_WARN, "frozen %s", "lora.A");
    tap_is_int(cap.count, 2, "a warning at level off does not reach the sink");
    tap_is_int((int)fsdp_ctx_warnings(ctx, w, 6), 2, "but it is counted");
    tap_is_str(w, "froze", "and its text kept (cut to the buffer given)");
    tap_is_int((int)fsdp_ctx_warnings(ctx, NULL, 0), 2, "the text is optional");
    tap_is_int((int)fsdp_ctx_warnings(NULL, w, sizeof w), 0, "a NULL context has none");
    tap_is_str(w, "", "and no text");
    fsdp_ctx_destroy(ctx);
}

typedef struct {
    fsdp_ctx_t *ctx;
    int iters;
} churn_arg_t;

static void *churn(void *p) {
    churn_arg_t *a = p;
    for (int i = 0; i < a->iters; i++) {
        void *x = NULL;
        fsdp_mem_alloc(a->ctx, FSDP_MEM_COMM, 1000, &x);
        fsdp_mem_free(a->ctx, x);
    }
    return NULL;
}

static void test_mem(void) {
    fsdp_ctx_t *ctx = NULL;
    fsdp_ctx_create(NULL, &ctx);
    fsdp_mem_stats_t st;
    void *a = NULL, *b = NULL, *c = NULL;
    tap_is_int(fsdp_mem_alloc(ctx, FSDP_MEM_PARAMS, 1000, &a), FSDP_OK, "allocate params");
    tap_ok(a && ((uintptr_t)a % 64) == 0, "tracked memory is 64-byte aligned");
    memset(a, 1, 1000);
    fsdp_mem_alloc(ctx, FSDP_MEM_GRADS, 3000, &b);
    fsdp_mem_get_stats(ctx, &st);
    tap_is_size(st.current[FSDP_MEM_PARAMS], 1000, "params current");
    tap_is_size(st.current[FSDP_MEM_GRADS], 3000, "grads current");
    tap_is_size(st.total_current, 4000, "total current");
    fsdp_mem_free(ctx, b);
    fsdp_mem_alloc(ctx, FSDP_MEM_OPTIM, 500, &c);
    fsdp_mem_get_stats(ctx, &st);
    tap_is_size(st.current[FSDP_MEM_GRADS], 0, "grads back to zero after free");
    tap_is_size(st.peak[FSDP_MEM_GRADS], 3000, "grads peak survives the free");
    tap_is_size(st.total_current, 1500, "total after free");
    tap_is_size(st.total_peak, 4000, "total peak");
    tap_is_size(st.allocs, 3, "allocation count");
    fsdp_mem_reset_peaks(ctx);
    fsdp_mem_get_stats(ctx, &st);
    tap_is_size(st.peak[FSDP_MEM_GRADS], 0, "reset peaks: grads peak = current");
    tap_is_size(st.total_peak, 1500, "reset peaks: total peak = current");
    void *z = (void *)1;
    tap_is_int(fsdp_mem_alloc(ctx, FSDP_MEM_OTHER, 0, &z), FSDP_OK, "zero bytes is fine");
    tap_ok(z == NULL, "zero bytes gives NULL");
    tap_is_int(fsdp_mem_alloc(ctx, FSDP_MEM_NCAT, 8, &z), FSDP_EINVAL, "bad category rejected");
    tap_has_str(fsdp_ctx_last_error(ctx), "category", "the error names the category");
    tap_is_int(fsdp_mem_alloc(ctx, FSDP_MEM_OTHER, SIZE_MAX - 8, &z), FSDP_ENOMEM,
               "an impossible size is ENOMEM, not a crash");
    tap_has_str(fsdp_ctx_last_error(ctx), "bytes", "the ENOMEM message gives the size");
    tap_is_int(fsdp_mem_account_free(ctx, FSDP_MEM_ACTIVATIONS, 10), FSDP_EINTERNAL,
               "freeing more than is accounted is reported");
    fsdp_mem_get_stats(ctx, &st);
    tap_is_size(st.current[FSDP_MEM_ACTIVATIONS], 0, "and the counter stays at zero");
    fsdp_mem_free(ctx, a);
    fsdp_mem_free(ctx, c);
    fsdp_mem_free(ctx, NULL);
    /* Two threads of one rank allocating concurrently never lose bytes. */
    pthread_t t[2];
    churn_arg_t arg = {ctx, 20000};
    for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, churn, &arg);
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
    fsdp_mem_get_stats(ctx, &st);
    tap_is_size(st.current[FSDP_MEM_COMM], 0, "concurrent alloc/free balances to zero");
    tap_ok(st.peak[FSDP_MEM_COMM] >= 1000 && st.peak[FSDP_MEM_COMM] <= 2000,
           "concurrent peak is between one and two blocks (%zu)", st.peak[FSDP_MEM_COMM]);
    for (int k = 0; k < FSDP_MEM_NCAT; k++)
        tap_ok(strcmp(fsdp_mem_cat_name((fsdp_mem_cat_t)k), "invalid") != 0, "category %d named %s",
               k, fsdp_mem_cat_name((fsdp_mem_cat_t)k));
    fsdp_ctx_destroy(ctx);
}

static void test_ctx(void) {
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    fsdp_ctx_t *ctx = (fsdp_ctx_t *)1;
    o.world_size = 0;
    tap_is_int(fsdp_ctx_create(&o, &ctx), FSDP_EINVAL, "world_size 0 is rejected");
    tap_ok(ctx == NULL, "and *out is cleared");
    o.world_size = 2;
    o.rank = 2;
    tap_is_int(fsdp_ctx_create(&o, &ctx), FSDP_EINVAL, "rank == world_size is rejected");
    o.rank = 1;
    o.seed = 1234;
    tap_is_int(fsdp_ctx_create(&o, &ctx), FSDP_OK, "rank 1 of 2");
    tap_is_int(fsdp_ctx_rank(ctx), 1, "rank query");
    tap_is_int(fsdp_ctx_world_size(ctx), 2, "world size query");
    tap_ok(fsdp_ctx_pg(ctx) == NULL, "no group attached yet");
    fsdp_rng_t *rng = fsdp_ctx_rng(ctx);
    tap_is_uint(rng->seed, 1234, "rng seeded from the options");
    tap_is_uint(rng->stream, 1, "rng stream is the rank");
    /* A dummy group made on the context and forgotten is reclaimed by destroy (ASan checks). */
    fsdp_pg_t *pg = NULL;
    tap_is_int(fsdp_pg_create_dummy(ctx, 1, 2, FSDP_DUMMY_NOOP, &pg), FSDP_OK, "dummy group");
    fsdp_ctx_set_log_level(ctx, FSDP_LOG_OFF);
    fsdp_ctx_destroy(ctx);
    fsdp_ctx_destroy(NULL);
    tap_ok(1, "destroying a context reclaims its groups; NULL is accepted");
}

/* fsdp__reduce: rank order, aliasing of output and input, f32 accumulation of bf16. */
static void test_reduce(void) {
    enum { N = 5000 };
    float *a = malloc(N * sizeof *a), *b = malloc(N * sizeof *b), *c = malloc(N * sizeof *c);
    float *out = malloc(N * sizeof *out);
    for (int i = 0; i < N; i++) {
        a[i] = 1e8f;
        b[i] = -1e8f;
        c[i] = 1.0f + (float)i;
    }
    const void *ins[3] = {a, b, c};
    void *outs[1] = {out};
    fsdp__reduce(outs, 1, ins, 3, N, FSDP_DTYPE_F32, FSDP_REDOP_SUM, 3, 0.0);
    int ok = 1;
    for (int i = 0; i < N; i++) ok &= out[i] == (a[i] + b[i]) + c[i];
    tap_ok(ok, "f32 sum is ((a + b) + c), not reassociated");
    /* The output aliases the last input: each block is read before it is written. */
    float *c2 = malloc(N * sizeof *c2);
    memcpy(c2, c, N * sizeof *c2);
    const void *ins2[3] = {a, b, c2};
    void *outs2[1] = {c2};
    fsdp__reduce(outs2, 1, ins2, 3, N, FSDP_DTYPE_F32, FSDP_REDOP_SUM, 3, 0.0);
    tap_is_mem(c2, out, N * sizeof *c2, "output aliasing the last input gives the same result");
    uint16_t h[3] = {fsdp_f32_to_bf16(256.0f), fsdp_f32_to_bf16(1.0f), fsdp_f32_to_bf16(1.0f)};
    const void *hin[3] = {&h[0], &h[1], &h[2]};
    uint16_t hout;
    void *hout_p[1] = {&hout};
    fsdp__reduce(hout_p, 1, hin, 3, 1, FSDP_DTYPE_BF16, FSDP_REDOP_SUM, 3, 0.0);
    tap_is_near(fsdp_bf16_to_f32(hout), 258.0, 0, 0,
                "bf16 256 + 1 + 1 accumulates in f32 (bf16 steps would give 256)");
    int32_t big[2] = {INT32_MAX, 1}, isum;
    const void *iin[2] = {&big[0], &big[1]};
    void *iout[1] = {&isum};
    fsdp__reduce(iout, 1, iin, 2, 1, FSDP_DTYPE_I32, FSDP_REDOP_SUM, 2, 0.0);
    tap_is_int(isum, INT32_MIN, "i32 sum wraps around instead of being undefined");
    float nan = NAN, one = 1.0f, fmn;
    const void *nin[2] = {&one, &nan};
    void *nout[1] = {&fmn};
    fsdp__reduce(nout, 1, nin, 2, 1, FSDP_DTYPE_F32, FSDP_REDOP_MIN, 2, 0.0);
    tap_ok(isnan(fmn), "min propagates NaN");
    tap_ok(!fsdp__redop_supported(FSDP_DTYPE_BOOL, FSDP_REDOP_AVG), "avg is not defined on bool");
    free(a);
    free(b);
    free(c);
    free(c2);
    free(out);
}

/* fsdp__copy_large and fsdp__copy_large2 (the transports' copies): every length around the
 * vector loop's edges and past FSDP_COPY_STREAM_MIN, every alignment of source and
 * destinations modulo 16 (two destinations aligned alike or not): the bytes of memcpy, and not
 * one byte outside them. */
static void test_copy(void) {
    const size_t big = FSDP_COPY_STREAM_MIN + 77, pad = 64;
    const size_t lens[] = {0, 1, 15, 16, 17, 63, 64, 65, 200, FSDP_COPY_STREAM_MIN - 1,
                           FSDP_COPY_STREAM_MIN, big};
    unsigned char *src = malloc(big + pad), *d1 = malloc(big + 2 * pad),
                  *d2 = malloc(big + 2 * pad);
    if (!src || !d1 || !d2) {
        tap_ok(0, "copy: buffers allocated");
        free(src), free(d1), free(d2);
        return;
    }
    for (size_t i = 0; i < big + pad; i++)
        src[i] = (unsigned char)(i * 131 + 7);
    long bad1 = 0, bad2 = 0, cases = 0;
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        const size_t n = lens[li];
        for (size_t so = 0; so < 16; so += 5) {
            for (size_t o1 = 0; o1 < 16; o1 += 3) {
                for (size_t o2 = o1; o2 < o1 + 16; o2 += 7) {
                    /* one destination */
                    memset(d1, 0xee, n + 2 * pad);
                    fsdp__copy_large(d1 + pad + o1, src + so, n);
                    for (size_t i = 0; i < n + 2 * pad; i++) {
                        const bool in = i >= pad + o1 && i < pad + o1 + n;
                        bad1 += d1[i] != (in ? src[so + i - pad - o1] : 0xee);
                    }
                    /* two */
                    memset(d1, 0xee, n + 2 * pad);
                    memset(d2, 0xdd, n + 2 * pad);
                    fsdp__copy_large2(d1 + pad + o1, d2 + pad + (o2 & 15), src + so, n);
                    for (size_t i = 0; i < n + 2 * pad; i++) {
                        const bool in1 = i >= pad + o1 && i < pad + o1 + n;
                        const bool in2 = i >= pad + (o2 & 15) && i < pad + (o2 & 15) + n;
                        bad2 += d1[i] != (in1 ? src[so + i - pad - o1] : 0xee);
                        bad2 += d2[i] != (in2 ? src[so + i - pad - (o2 & 15)] : 0xdd);
                    }
                    cases++;
                }
            }
        }
    }
    tap_ok(bad1 == 0, "copy: fsdp__copy_large gives memcpy's bytes and nothing outside them (%ld "
                      "cases of lengths 0 to %zu and alignments; %ld bytes wrong)",
           cases, big, bad1);
    tap_ok(bad2 == 0, "copy: fsdp__copy_large2 gives memcpy's bytes in both destinations, aligned "
                      "alike or not, and nothing outside them (%ld cases; %ld bytes wrong)",
           cases, bad2);
    free(src);
    free(d1);
    free(d2);
}

/* The affinity mask, not the machine: pinned to one CPU the process counts one, unpinned it
 * counts its mask again. */
static void test_cpus(void) {
    cpu_set_t mask;
    int before = fsdp__cpu_count();
    tap_ok(sched_getaffinity(0, sizeof mask, &mask) == 0 && before == CPU_COUNT(&mask),
           "cpu count: the %d CPUs of the affinity mask", before);
    int pinned = cpu_pin_one(&mask);
    int in_one = fsdp__cpu_count();
    if (pinned == 0) cpu_unpin(&mask);
    tap_ok(pinned == 0 && in_one == 1 && fsdp__cpu_count() == before,
           "  pinned to one CPU it counts %d, and %d again after", in_one, fsdp__cpu_count());
}

int main(void) {
    tap_plan_lazy();
    test_log();
    test_mem();
    test_ctx();
    test_reduce();
    test_copy();
    test_cpus();
    return tap_done();
}
