/* SPDX-License-Identifier: MIT */
/*
 * t_fsdp_agstream.c: the root's all-gather stream (src/fsdp/streams.c, "the all-gather stream";
 * docs/design.md "Stream-ordered collective waits"), on a device that allocates per stream
 * (spec F01: all-gather unshards; F03: results must not change with asynchronous ordering).
 *
 * This build has no GPU. The compute device P is the CPU's vtable plus a compute stream (a token
 * per rank), streams and events that order nothing (the CPU's work is done when its call returns),
 * and the three stream-pool entries: alloc_on lists every block with the stream it was asked
 * for, record_stream notes the compute stream's use of a listed block, free checks that a listed
 * block's use was recorded before it goes (else the pool could hand it out while the compute
 * stream still reads it), and cast_on counts the casts queued on the all-gather stream. The
 * group "ag-test" wraps the rank's sim world group and, for every all-gather, notes whether it
 * was issued inside an iteration (between the root's pre-forward and the end of its backward)
 * and into which block. (On a CPU-kind device the collectives' descriptors carry no stream, so
 * the stream shows in the block the all-gather writes, the casts and the event waits.)
 *
 * Checks, world 2, Sequential(4 x Linear(6, 6)), a unit per Linear, two SGD steps, then a forward
 * without grad and a summon; FULL_SHARD and SHARD_GRAD_OP in f32, FULL_SHARD with bf16 parameters,
 * NO_SHARD, and FULL_SHARD with FSDP_AG_STREAM=0:
 *   - losses and shards are bitwise those of a plain CPU device over the sim group;
 *   - every all-gather of an iteration is issued on the root's all-gather stream into a block
 *     allocated from that stream's pool, and its shard cast there (bf16); the all-gather stream
 *     waited for an event of the compute stream at every iteration's start;
 *   - every such block is freed only after its use by the compute stream was recorded, and none
 *     is left after the units are destroyed;
 *   - the forward without grad ends the iteration, and the summon's all-gathers go through the
 *     side stream with memory of the compute stream's pool;
 *   - NO_SHARD and FSDP_AG_STREAM=0 never use the all-gather stream.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <config.h>
#include <fsdp.h>

#include "device/device_impl.h"
#include "fsdp/fsdp_impl.h"
#include "fsdp_util.h"
#include "shard_parity.h"
#include "models/models.h"
#include "pg/pg_impl.h"
#include "tap.h"
#include "tensor/tensor_impl.h"

#define STEPS 2
#define NLIN 4
#define DIM 6
#define MAXB 256

typedef struct block {
    void *ptr;
    size_t bytes;
    void *stream;
    bool recorded; /* the compute stream's use was recorded */
} block_t;

/* Per rank: what P and the group saw (reset by each run). */
typedef struct arank {
    int token;         /* the compute stream's address is the handle */
    fsdp_unit_t *root; /* whose all-gather stream is looked at */
    block_t blk[MAXB]; /* live blocks from alloc_on */
    size_t nblk;
    uint64_t allocs_on, frees_on, unrecorded_frees, bad_records, table_full;
    uint64_t casts_on_ag;
    uint64_t ag_orders;              /* waits of the all-gather stream on a compute-stream event */
    uint64_t ag_in, ag_in_into_pool; /* all-gathers inside an iteration */
    uint64_t ag_out, ag_out_into_pool; /* ... outside one */
} arank_t;

static arank_t ar[FU_MAXR];
static struct fsdp_dev_ops p_ops;

static arank_t *ar_of(fsdp_device_t *dev) {
    return &ar[fsdp_ctx_rank(dev->ctx)];
}

/* The device's handle of the root's all-gather stream, or NULL. */
static void *ag_handle(const arank_t *a) {
    return a->root ? fsdp__stream_handle(a->root->ag_stream) : NULL;
}

static block_t *find_block(arank_t *a, const void *p) {
    for (size_t i = 0; i < a->nblk; i++)
        if ((const char *)p >= (char *)a->blk[i].ptr &&
            (const char *)p < (char *)a->blk[i].ptr + (a->blk[i].bytes ? a->blk[i].bytes : 1))
            return &a->blk[i];
    return NULL;
}

/* ---- the device P ---------------------------------------------------------------------------- */

static void *p_compute_stream(fsdp_device_t *dev) {
    return &ar_of(dev)->token;
}

static int p_stream_create(fsdp_device_t *dev, void **out) {
    (void)dev;
    *out = malloc(1);
    return *out ? FSDP_OK : FSDP_ENOMEM;
}

static void p_stream_destroy(fsdp_device_t *dev, void *stream) {
    (void)dev;
    free(stream);
}

static int p_stream_sync(fsdp_device_t *dev, void *stream) {
    (void)dev, (void)stream;
    return FSDP_OK;
}

/* An event remembers the stream it was recorded on (NULL: the compute stream). */
typedef struct pev {
    void *stream;
    bool recorded;
} pev_t;

static int p_event_create(fsdp_device_t *dev, void **out) {
    (void)dev;
    *out = calloc(1, sizeof(pev_t));
    return *out ? FSDP_OK : FSDP_ENOMEM;
}

static void p_event_destroy(fsdp_device_t *dev, void *ev) {
    (void)dev;
    free(ev);
}

static int p_event_record(fsdp_device_t *dev, void *ev, void *stream) {
    pev_t *e = ev;
    e->stream = stream == &ar_of(dev)->token ? NULL : stream;
    e->recorded = true;
    return FSDP_OK;
}

static int p_event_wait(fsdp_device_t *dev, void *ev, void *stream) {
    arank_t *a = ar_of(dev);
    const pev_t *e = ev;
    if (stream && stream == ag_handle(a) && e->recorded && !e->stream) a->ag_orders++;
    return FSDP_OK;
}

static int p_event_sync(fsdp_device_t *dev, void *ev) {
    (void)dev, (void)ev;
    return FSDP_OK;
}

static int p_alloc_on(fsdp_device_t *dev, size_t bytes, void *stream, void **out) {
    arank_t *a = ar_of(dev);
    int rc = fsdp__cpu_dev_ops.alloc(dev, bytes, out);
    if (rc < 0) return rc;
    a->allocs_on++;
    if (a->nblk == MAXB) {
        a->table_full++;
        return FSDP_OK;
    }
    a->blk[a->nblk++] = (block_t){*out, bytes, stream, false};
    return FSDP_OK;
}

static int p_record_stream(fsdp_device_t *dev, void *ptr, void *stream) {
    arank_t *a = ar_of(dev);
    block_t *b = find_block(a, ptr);
    if (!b || stream != &a->token)
        a->bad_records++;
    else
        b->recorded = true;
    return FSDP_OK;
}

static int p_cast_on(fsdp_device_t *dev, fsdp_dtype_t dt, void *y, fsdp_dtype_t xt, const void *x,
                     size_t n, void *stream) {
    arank_t *a = ar_of(dev);
    if (stream && stream == ag_handle(a)) a->casts_on_ag++;
    return fsdp__cpu_dev_ops.cast(dev, dt, y, xt, x, n);
}

static void p_free(fsdp_device_t *dev, void *ptr) {
    arank_t *a = ar_of(dev);
    for (size_t i = 0; ptr && i < a->nblk; i++) {
        if (a->blk[i].ptr != ptr) continue;
        a->frees_on++;
        if (!a->blk[i].recorded) a->unrecorded_frees++;
        a->blk[i] = a->blk[--a->nblk];
        break;
    }
    fsdp__cpu_dev_ops.free(dev, ptr);
}

/* ---- the group "ag-test" --------------------------------------------------------------------- */

typedef struct apg {
    fsdp_pg_t base;
    fsdp_pg_t *inner; /* borrowed */
} apg_t;

static int apg_post(fsdp_pg_t *pg, fsdp_work_t *w) {
    apg_t *g = (apg_t *)pg;
    arank_t *a = &ar[pg->rank];
    const fsdp_coll_t *c = &w->coll;
    if (c->kind == FSDP_COLL_ALL_GATHER && a->root) {
        void *ags = ag_handle(a);
        const block_t *b = find_block(a, c->recv);
        bool into = ags && b && b->stream == ags && b->ptr == c->recv;
        if (a->root->ag_ordered) {
            a->ag_in++;
            a->ag_in_into_pool += into;
        } else {
            a->ag_out++;
            a->ag_out_into_pool += into;
        }
    }
    int st = fsdp__pg_issue(g->inner, c, NULL);
    if (st < 0)
        fsdp__work_complete(w, st, "%s", fsdp_pg_last_error(g->inner));
    else
        fsdp__work_complete(w, FSDP_OK, NULL);
    return FSDP_OK;
}

static void apg_destroy(fsdp_pg_t *pg) {
    fsdp__pg_fini(pg);
    free(pg);
}

static const struct fsdp_pg_ops apg_ops = {
    .name = "ag-test",
    .post = apg_post,
    .destroy = apg_destroy,
};

static apg_t *apg_create(fsdp_ctx_t *ctx, fsdp_pg_t *inner) {
    apg_t *g = calloc(1, sizeof *g);
    if (!g) return NULL;
    g->inner = inner;
    if (fsdp__pg_init(&g->base, &apg_ops, ctx, inner->rank, inner->size, NULL, "ag-test") < 0) {
        fsdp__pg_fini(&g->base);
        free(g);
        return NULL;
    }
    return g;
}

/* ---- a run ----------------------------------------------------------------------------------- */

typedef struct ajob {
    fu_job_t base;
    bool env_off; /* FSDP_AG_STREAM=0 for this job */
} ajob_t;

typedef struct result {
    double loss[STEPS];
    fu_vals_t params;
} result_t;

static int fwd_bwd(fsdp_ctx_t *ctx, fsdp_module_t *m, int s, bool grad, double *loss_out) {
    fsdp_tensor_t *x = NULL, *y = NULL, *loss = NULL;
    bool was = fsdp_set_grad_enabled(ctx, grad);
    int rc = fu_rand_input(ctx, 300 + 10 * (uint64_t)s + (uint64_t)fsdp_ctx_rank(ctx), 3, DIM, &x);
    if (rc == 0) rc = fsdp_module_forward1(m, x, &y);
    if (rc == 0) rc = tm_sum_loss(y, &loss);
    if (rc == 0 && loss_out) rc = fsdp_tensor_item(loss, 0, loss_out);
    if (rc == 0 && grad) rc = fsdp_backward(loss, NULL);
    fsdp_set_grad_enabled(ctx, was);
    fsdp_tensor_release(loss);
    fsdp_tensor_release(y);
    fsdp_tensor_release(x);
    return rc;
}

static int train(fsdp_ctx_t *ctx, ajob_t *j, bool pools, result_t *res) {
    static const char *const types[] = {"Linear", NULL};
    fu_res_t *r = fu_res_of(&j->base, ctx);
    int rk = fsdp_ctx_rank(ctx);
    arank_t *a = &ar[rk];
    fsdp_device_t *dev = NULL;
    apg_t *g = NULL;
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_optim_t *opt = NULL;
    int rc = FSDP_OK;
    memset(a, 0, sizeof *a);
    FU_TRY(out, "creating the device", fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &dev));
    if (pools) {
        dev->ops = &p_ops;
        g = apg_create(ctx, fsdp_ctx_pg(ctx));
        if (!g) FU_TRY(out, "creating the test group", FSDP_ENOMEM);
    }
    FU_TRY(out, "building", fu_linear_stack(ctx, NLIN, DIM, &m));
    fsdp_options_t o;
    fu_job_options(&j->base, &o);
    o.device = dev;
    o.pg = pools ? &g->base : fsdp_ctx_pg(ctx);
    o.check_exec_order = false;
    FU_TRY(out, "wrapping", fu_wrap_types(m, &o, types, &root));
    FU_TRY(out, "fsdp_ctx_set_device", fsdp_ctx_set_device(ctx, dev));
    FU_TRY(out, "SGD", fu_make_fsdp_sgd(ctx, root, 0.05, 0.9, &opt));
    a->root = root;
    for (int s = 0; s < STEPS; s++) {
        FU_TRY(out, "forward and backward", fwd_bwd(ctx, m, s, true, &res->loss[s]));
        FU_TRY(out, "step", fsdp_optim_step(opt));
        FU_TRY(out, "zero_grad", fsdp_optim_zero_grad(opt, true));
    }
    FU_TRY(out, "a forward without grad", fwd_bwd(ctx, m, STEPS, false, NULL));
    bool ended = !root->ag_ordered;
    FU_TRY(out, "summon", fu_summon_nowb(root));
    FU_TRY(out, "summon end", fsdp_summon_end(root));
    FU_TRY(out, "reading the shards", sp_shard_values(root, &res->params));
    if (!pools) goto out;

    bool sharded = fsdp__is_sharded(j->base.strategy);
    bool want = sharded && !j->env_off;
    fu_ck(r, ended, "a forward without grad ends the iteration", "the stream is still ordered");
    if (want) {
        fu_ck(r, a->ag_in > 0 && a->ag_in_into_pool == a->ag_in,
              "F01: every all-gather of an iteration gathers into a block of the root's "
              "all-gather stream's pool",
              "%llu all-gathers, %llu into its pool", (unsigned long long)a->ag_in,
              (unsigned long long)a->ag_in_into_pool);
        fu_ck(r, a->ag_orders >= STEPS + 1,
              "the all-gather stream waits for the compute stream at every iteration's start",
              "%llu waits for %d iterations", (unsigned long long)a->ag_orders, STEPS + 1);
        if (j->base.mp.enabled)
            fu_ck(r, a->casts_on_ag == a->ag_in,
                  "bf16: each all-gather's low-precision shard is cast on the all-gather stream",
                  "%llu casts for %llu all-gathers", (unsigned long long)a->casts_on_ag,
                  (unsigned long long)a->ag_in);
        fu_ck(r, a->ag_out > 0 && a->ag_out_into_pool == 0,
              "the summon's all-gathers (outside an iteration) gather into memory of the compute "
              "stream's pool, through the side stream",
              "%llu of %llu into the all-gather stream's pool",
              (unsigned long long)a->ag_out_into_pool, (unsigned long long)a->ag_out);
    } else {
        fu_ck(r, a->allocs_on == 0 && a->ag_in_into_pool == 0 && a->ag_out_into_pool == 0,
              sharded ? "FSDP_AG_STREAM=0: no all-gather uses the all-gather stream's pool"
                      : "NO_SHARD: no all-gather stream and no allocation from its pool",
              "%llu allocations, %llu all-gathers into it", (unsigned long long)a->allocs_on,
              (unsigned long long)(a->ag_in_into_pool + a->ag_out_into_pool));
    }
out:
    a->root = NULL;
    fsdp_ctx_set_device(ctx, NULL);
    fsdp_optim_destroy(opt);
    fsdp_unit_destroy(root);
    if (pools && rc == 0 && fsdp__is_sharded(j->base.strategy) && !j->env_off)
        fu_ck(r,
              a->allocs_on > 0 && a->frees_on == a->allocs_on && a->nblk == 0 &&
                  a->unrecorded_frees == 0 && a->bad_records == 0 && a->table_full == 0,
              "every block of the all-gather stream's pool is freed after the compute stream's "
              "use of it was recorded, and none is left",
              "%llu allocated, %llu freed, %zu left, %llu freed unrecorded, %llu bad records",
              (unsigned long long)a->allocs_on, (unsigned long long)a->frees_on, a->nblk,
              (unsigned long long)a->unrecorded_frees, (unsigned long long)a->bad_records);
    fsdp_module_release(m);
    if (g) fsdp_pg_destroy(&g->base);
    fsdp_device_destroy(dev);
    return rc;
}

static int parity_rank(fsdp_ctx_t *ctx, void *arg) {
    ajob_t *j = arg;
    fu_res_t *r = fu_res_of(&j->base, ctx);
    result_t blk, pl;
    memset(&blk, 0, sizeof blk);
    memset(&pl, 0, sizeof pl);
    int rc = train(ctx, j, false, &blk);
    if (rc == 0) rc = train(ctx, j, true, &pl);
    if (rc == 0)
        sp_ck_bitwise_run(r, pl.loss, blk.loss, STEPS, &pl.params, &blk.params,
                          "the stream-pool run's", "those of a plain CPU device");
    fu_vals_free(&blk.params);
    fu_vals_free(&pl.params);
    return rc;
}

int main(void) {
    p_ops = fsdp__cpu_dev_ops;
    p_ops.compute_stream = p_compute_stream;
    p_ops.stream_create = p_stream_create;
    p_ops.stream_destroy = p_stream_destroy;
    p_ops.stream_sync = p_stream_sync;
    p_ops.event_create = p_event_create;
    p_ops.event_destroy = p_event_destroy;
    p_ops.event_record = p_event_record;
    p_ops.event_wait = p_event_wait;
    p_ops.event_sync = p_event_sync;
    p_ops.event_query = NULL;
    p_ops.alloc_on = p_alloc_on;
    p_ops.record_stream = p_record_stream;
    p_ops.cast_on = p_cast_on;
    p_ops.free = p_free;
    tap_plan_lazy();

    static ajob_t j; /* large: off the stack */
    static const struct {
        const char *title;
        fsdp_sharding_strategy_t s;
        bool bf16, env_off;
    } cases[] = {
        {"agstream FULL_SHARD", FSDP_FULL_SHARD, false, false},
        {"agstream SHARD_GRAD_OP", FSDP_SHARD_GRAD_OP, false, false},
        {"agstream FULL_SHARD bf16 params", FSDP_FULL_SHARD, true, false},
        {"agstream NO_SHARD", FSDP_NO_SHARD, false, false},
        {"agstream FULL_SHARD FSDP_AG_STREAM=0", FSDP_FULL_SHARD, false, true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fu_job_init(&j.base, cases[i].title, 2, cases[i].s, false);
        j.env_off = cases[i].env_off;
        if (cases[i].bf16) {
            j.base.mp.enabled = true;
            j.base.mp.param_dtype = FSDP_DTYPE_BF16;
        }
        /* Set before the ranks' threads start and cleared after they joined. */
        if (j.env_off) setenv("FSDP_AG_STREAM", "0", 1);
        fu_run_job(&j.base, parity_rank);
        unsetenv("FSDP_AG_STREAM");
    }
    return tap_done();
}
