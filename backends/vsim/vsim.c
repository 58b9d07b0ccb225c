/* SPDX-License-Identifier: MIT */
/*
 * vsim.c: the simulator (fsdp/vsim.h) and its virtual-time process groups.
 *
 * A group is a process-group backend like sim or gloo, behind the same core (pg.c checks every
 * argument, numbers and counts the collectives), so FSDP cannot tell it from a real one. Its
 * post() completes every collective at once on the calling thread: it charges the network model's
 * time on the rank's clock (the collective's stream, or the compute stream for one issued
 * without a stream, as NCCL's default stream would be) and records the simulated end in the
 * work (w->vtime), which a stream wait (wait_stream) or a host wait (host_waited) then reaches.
 * Buffers of the shape-only device are left alone; host buffers are completed as if every rank
 * had passed the same values (fsdp/vsim.h).
 *
 * Invariants: the simulator owns its device, its world group and every group made by
 * fsdp_vsim_group (a list, destroyed before the device); all of them share the device's clock;
 * every group knows its layout over the nodes (fsdp_net_group_t), from which each collective's
 * time comes.
 */
#include <config.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/vsim/vsim_impl.h"
#include "core/trace.h"
#include "pg/pg_impl.h"

typedef struct vpg {
    fsdp_pg_t base; /* first: fsdp_pg_t * and vpg_t * convert */
    fsdp_vsim_t *vs;
    fsdp_net_group_t layout;
    int size, stride; /* for fsdp_vsim_group's groups: what they were made with (0: other) */
    struct vpg *next; /* the simulator's list */
} vpg_t;

struct fsdp_vsim {
    fsdp_ctx_t *ctx;
    fsdp_cluster_t cl;
    fsdp_device_t *dev;
    struct fsdp__vclock *clock;
    vpg_t *world;
    vpg_t *groups; /* every group but the world, newest first */
};

/* ---- host buffers: completed as if every rank had passed the same values -------------------- */

/* x *= k for n elements of dt (the sum of k equal contributions); other dtypes stay as they are
 * (bool "or" and the low-precision types, which no host exchange uses). */
static void scale_host(void *x, fsdp_dtype_t dt, size_t n, int k) {
    for (size_t i = 0; i < n; i++) {
        switch (dt) {
        case FSDP_DTYPE_F32:
            ((float *)x)[i] *= (float)k;
            break;
        case FSDP_DTYPE_F64:
            ((double *)x)[i] *= k;
            break;
        case FSDP_DTYPE_I32:
            ((int32_t *)x)[i] = (int32_t)((uint32_t)((int32_t *)x)[i] * (uint32_t)k);
            break;
        case FSDP_DTYPE_I64:
            ((int64_t *)x)[i] = (int64_t)((uint64_t)((int64_t *)x)[i] * (uint64_t)k);
            break;
        default:
            return;
        }
    }
}

static void host_complete(fsdp_pg_t *pg, const fsdp_coll_t *c) {
    if (c->kind == FSDP_COLL_BARRIER || !c->recv || fsdp__vaddr(c->recv)) return;
    if (c->send && fsdp__vaddr(c->send)) return;
    size_t es = fsdp_dtype_size(c->dtype), chunk = c->count * es;
    char *recv = c->recv;
    const char *send = c->send;
    int n = pg->size;
    switch (c->kind) {
    case FSDP_COLL_ALL_GATHER:
        for (int i = 0; i < n; i++)
            if (recv + (size_t)i * chunk != send) memmove(recv + (size_t)i * chunk, send, chunk);
        break;
    case FSDP_COLL_ALL_TO_ALL: /* every rank sends this rank its chunk `rank` */
        for (int i = 0; i < n; i++)
            if (i != pg->rank)
                memmove(recv + (size_t)i * chunk, send + (size_t)pg->rank * chunk, chunk);
        if (recv != send)
            memmove(recv + (size_t)pg->rank * chunk, send + (size_t)pg->rank * chunk, chunk);
        break;
    case FSDP_COLL_REDUCE_SCATTER:
        memmove(recv, send + (size_t)pg->rank * chunk, chunk);
        if (c->op == FSDP_REDOP_SUM) scale_host(recv, c->dtype, c->count, n);
        break;
    case FSDP_COLL_ALL_REDUCE:
    case FSDP_COLL_REDUCE:
        if (send && send != recv) memmove(recv, send, chunk);
        if (c->op == FSDP_REDOP_SUM) scale_host(recv, c->dtype, c->count, n);
        break;
    case FSDP_COLL_BROADCAST:
        if (send && send != recv) memmove(recv, send, chunk);
        break;
    default:
        break;
    }
}

/* ---- the group ------------------------------------------------------------------------------ */

static int vpg_post(fsdp_pg_t *pg, fsdp_work_t *w) {
    vpg_t *g = (vpg_t *)pg;
    struct fsdp__vclock *c = g->vs->clock;
    const fsdp_coll_t *co = &w->coll;
    host_complete(pg, co);
    size_t bytes = 0;
    int rc = co->kind == FSDP_COLL_BARRIER
                 ? FSDP_OK
                 : fsdp_net_coll_bytes(pg->ctx, co->kind, pg->size, co->count, co->dtype, &bytes);
    fsdp_net_estimate_t e;
    if (rc == FSDP_OK)
        rc = fsdp_net_coll_time(pg->ctx, &g->vs->cl.net, &g->layout, co->kind, bytes,
                                FSDP_NET_ALGO_AUTO, &e);
    if (rc < 0) return fsdp__pg_err(pg, rc, "%s", fsdp_ctx_last_error(pg->ctx));
    struct fsdp__vstream *s = co->stream ? (struct fsdp__vstream *)co->stream : &c->compute;
    double start = c->host;
    if (s->t > start) start = s->t;
    if (e.seconds > 0 && c->net_free > start) start = c->net_free;
    double end = start + e.seconds;
    if (e.seconds > 0) c->net_free = end;
    if (e.channels > 0 && g->vs->cl.compute.sms > 0)
        fsdp__vclock_busy(c, start, end, (double)e.channels / g->vs->cl.compute.sms);
    fsdp__vclock_stream_wait(c, s, end);
    w->vtime = end;
    /* The trace gets the simulated span; the core's record at completion (real time) is off. */
    if (w->trace_issued && fsdp__tracing(pg->ctx))
        fsdp__trace_coll_at(pg->ctx, fsdp_coll_name(co->kind), pg->name, co->seq, bytes,
                            (int64_t)(start * 1e9), (int64_t)(end * 1e9));
    w->trace_issued = 0;
    c->stats.collectives++;
    c->stats.comm_busy += e.seconds;
    c->stats.coll_bytes[co->kind] += (double)bytes;
    c->stats.coll_time[co->kind] += e.seconds;
    fsdp__work_complete(w, FSDP_OK, NULL);
    return FSDP_OK;
}

static int vpg_wait_stream(fsdp_pg_t *pg, fsdp_work_t *w, void *stream) {
    vpg_t *g = (vpg_t *)pg;
    struct fsdp__vclock *c = g->vs->clock;
    struct fsdp__vstream *s = stream ? (struct fsdp__vstream *)stream : &c->compute;
    /* Where the compute stream stands waiting, the trace shows the exposed communication. */
    double from = s->t > c->host ? s->t : c->host;
    if (s == &c->compute && w->vtime > from && fsdp__tracing(pg->ctx))
        fsdp__trace_span_at(pg->ctx, FSDP__TRACE_WAIT, fsdp_coll_name(w->coll.kind),
                            (int64_t)(from * 1e9), (int64_t)(w->vtime * 1e9));
    fsdp__vclock_stream_wait(c, s, w->vtime);
    return FSDP_OK;
}

static void vpg_host_waited(fsdp_pg_t *pg, fsdp_work_t *w) {
    fsdp__vclock_host_wait(((vpg_t *)pg)->vs->clock, w->vtime);
}

static void vpg_destroy(fsdp_pg_t *pg) {
    vpg_t *g = (vpg_t *)pg;
    fsdp_vsim_t *vs = g->vs;
    for (vpg_t **p = &vs->groups; *p; p = &(*p)->next)
        if (*p == g) {
            *p = g->next;
            break;
        }
    if (vs->world == g) vs->world = NULL;
    fsdp__pg_fini(pg);
    free(g);
}

static int vpg_new(fsdp_vsim_t *vs, int rank, int size, const int *world_ranks,
                   const fsdp_net_group_t *layout, const char *name, vpg_t **out);

static int vpg_create_subgroup(fsdp_pg_t *parent, const int *members, int n, int new_rank,
                               const char *name, fsdp_pg_t **out) {
    vpg_t *pp = (vpg_t *)parent;
    int *wr = malloc((size_t)n * sizeof *wr);
    if (!wr) return fsdp__pg_err(parent, FSDP_ENOMEM, "out of memory for a sub-group");
    for (int i = 0; i < n; i++)
        wr[i] = parent->world_ranks[members[i]];
    fsdp_net_group_t layout;
    int rc = fsdp_net_group_from_ranks(parent->ctx, &pp->vs->cl.net, wr, n, &layout);
    vpg_t *g = NULL;
    if (rc == FSDP_OK) rc = vpg_new(pp->vs, new_rank, n, wr, &layout, name, &g);
    free(wr);
    if (rc < 0) return fsdp__pg_err(parent, rc, "%s", fsdp_ctx_last_error(parent->ctx));
    *out = &g->base;
    return FSDP_OK;
}

static const struct fsdp_pg_ops vpg_ops = {
    .name = "vsim",
    .post = vpg_post,
    .create_subgroup = vpg_create_subgroup,
    .wait_stream = vpg_wait_stream,
    .host_waited = vpg_host_waited,
    .destroy = vpg_destroy,
};

static int vpg_new(fsdp_vsim_t *vs, int rank, int size, const int *world_ranks,
                   const fsdp_net_group_t *layout, const char *name, vpg_t **out) {
    vpg_t *g = calloc(1, sizeof *g);
    if (!g) return fsdp__ctx_err(vs->ctx, FSDP_ENOMEM, "fsdp_vsim: out of memory for a group");
    int rc = fsdp__pg_init(&g->base, &vpg_ops, vs->ctx, rank, size, world_ranks, name);
    if (rc < 0) {
        fsdp__pg_fini(&g->base);
        free(g);
        return fsdp__ctx_err(vs->ctx, rc, "fsdp_vsim: out of memory for a group");
    }
    g->vs = vs;
    g->layout = *layout;
    g->next = vs->groups;
    vs->groups = g;
    *out = g;
    return FSDP_OK;
}

/* ---- the simulator -------------------------------------------------------------------------- */

/* The trace's clock: the compute stream's time, when the work queued so far ends, so that a span
 * opened and closed around some kernels covers their simulated execution. */
static int64_t trace_clock(void *arg) {
    const struct fsdp__vclock *c = arg;
    double t = c->compute.t > c->host ? c->compute.t : c->host;
    return (int64_t)(t * 1e9);
}

int fsdp_vsim_create(fsdp_ctx_t *ctx, const fsdp_cluster_t *cl, fsdp_vsim_t **out) {
    static const char who[] = "fsdp_vsim_create";
    if (!out) return fsdp__ctx_err(ctx, FSDP_EINVAL, "%s: out is NULL", who);
    *out = NULL;
    if (!ctx) return fsdp__ctx_err(NULL, FSDP_EINVAL, "%s: ctx is NULL", who);
    int rc = fsdp_cluster_check(ctx, cl);
    if (rc < 0) return rc;
    int world_size = ctx->world_size, rank = ctx->rank;
    int gpn = cl->net.gpus_per_node;
    if ((int64_t)world_size > (int64_t)cl->net.nodes * gpn)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "%s: world_size %d does not fit cluster \"%s\" (%d nodes of %d GPUs)",
                             who, world_size, cl->name, cl->net.nodes, gpn);
    if (world_size > gpn && world_size % gpn != 0)
        return fsdp__ctx_err(ctx, FSDP_EINVAL,
                             "%s: world_size %d spans several nodes of %d GPUs but does not fill "
                             "whole nodes",
                             who, world_size, gpn);
    fsdp_net_group_t layout;
    if ((rc = fsdp_net_group_strided(ctx, &cl->net, world_size, 1, &layout)) < 0) return rc;
    fsdp_vsim_t *vs = calloc(1, sizeof *vs);
    if (!vs) return fsdp__ctx_err(ctx, FSDP_ENOMEM, "%s: out of memory", who);
    vs->ctx = ctx;
    vs->cl = *cl;
    rc = fsdp__device_create(ctx, FSDP_DEVICE_META, &fsdp__meta_dev_ops, NULL, &vs->dev);
    if (rc == FSDP_OK) {
        vs->clock = fsdp__vdev_clock(vs->dev);
        vs->clock->model = &vs->cl.compute;
        if (cl->compute.lowp_kernels)
            vs->dev->lp_native = FSDP__DT_BIT(FSDP_DTYPE_BF16) | FSDP__DT_BIT(FSDP_DTYPE_F16);
        rc = vpg_new(vs, rank, world_size, NULL, &layout, "vsim", &vs->world);
    }
    if (rc == FSDP_OK && !ctx->pg) fsdp__ctx_attach(ctx, &vs->world->base, NULL);
    if (rc == FSDP_OK) fsdp__ctx_set_trace_clock(ctx, trace_clock, vs->clock);
    if (rc < 0) {
        fsdp_vsim_destroy(vs);
        return rc;
    }
    *out = vs;
    return FSDP_OK;
}

void fsdp_vsim_destroy(fsdp_vsim_t *vs) {
    if (!vs) return;
    if (vs->ctx->trace_clock == trace_clock) fsdp__ctx_set_trace_clock(vs->ctx, NULL, NULL);
    while (vs->groups)
        fsdp_pg_destroy(&vs->groups->base); /* unlinks itself */
    if (vs->clock) fsdp__vmeasure_destroy(vs->clock->measure);
    fsdp_device_destroy(vs->dev);
    free(vs);
}

fsdp_device_t *fsdp_vsim_device(fsdp_vsim_t *vs) {
    return vs ? vs->dev : NULL;
}

fsdp_pg_t *fsdp_vsim_world(fsdp_vsim_t *vs) {
    return vs && vs->world ? &vs->world->base : NULL;
}

const fsdp_cluster_t *fsdp_vsim_cluster(const fsdp_vsim_t *vs) {
    return vs ? &vs->cl : NULL;
}

int fsdp_vsim_measure_kernels(fsdp_vsim_t *vs, fsdp_device_t *dev, double scale) {
    static const char who[] = "fsdp_vsim_measure_kernels";
    if (!vs) return FSDP_EINVAL;
    if (dev && fsdp_device_kind(dev) != FSDP_DEVICE_CPU)
        return fsdp__ctx_err(vs->ctx, FSDP_EINVAL,
                             "%s: dev is \"%s\"; kernels are measured on a CPU device", who,
                             fsdp_device_name(dev));
    if (dev && !(isfinite(scale) && scale > 0))
        return fsdp__ctx_err(vs->ctx, FSDP_EINVAL, "%s: scale is %g (must be > 0 and finite)", who,
                             scale);
    struct fsdp__vmeasure *m = NULL;
    if (dev && fsdp__vmeasure_create(dev, scale, &m) < 0)
        return fsdp__ctx_err(vs->ctx, FSDP_ENOMEM, "%s: out of memory", who);
    fsdp__vmeasure_destroy(vs->clock->measure);
    vs->clock->measure = m;
    /* The simulated rank takes the fused attention where the measuring CPU device has it. */
    vs->dev->attn_fused = dev && dev->ops->attention ? dev->attn_fused : 0;
    return FSDP_OK;
}

size_t fsdp_vsim_measured_calls(const fsdp_vsim_t *vs) {
    return vs && vs->clock ? fsdp__vmeasure_count(vs->clock->measure) : 0;
}

int fsdp_vsim_group(fsdp_vsim_t *vs, int size, int stride, fsdp_pg_t **out) {
    static const char who[] = "fsdp_vsim_group";
    if (!vs || !out) return FSDP_EINVAL;
    *out = NULL;
    if (!vs->world)
        return fsdp__ctx_err(vs->ctx, FSDP_EINVAL, "%s: the world group was destroyed", who);
    int world = vs->world->base.size, rank = vs->world->base.rank;
    if (size < 1 || stride < 1 || (int64_t)size * stride > world || world % (size * stride) != 0)
        return fsdp__ctx_err(vs->ctx, FSDP_EINVAL,
                             "%s: size %d and stride %d do not divide the world of %d ranks into "
                             "whole blocks of size * stride ranks",
                             who, size, stride, world);
    for (vpg_t *g = vs->groups; g; g = g->next)
        if (g->size == size && g->stride == stride) {
            *out = &g->base;
            return FSDP_OK;
        }
    fsdp_net_group_t layout;
    int rc = fsdp_net_group_strided(vs->ctx, &vs->cl.net, size, stride, &layout);
    if (rc < 0) return rc;
    int block = size * stride, base = rank / block * block;
    int first = base + (rank - base) % stride;
    int *wr = malloc((size_t)size * sizeof *wr);
    if (!wr) return fsdp__ctx_err(vs->ctx, FSDP_ENOMEM, "%s: out of memory", who);
    for (int i = 0; i < size; i++)
        wr[i] = first + i * stride;
    char name[64];
    snprintf(name, sizeof name, "vsim.%dx%d", size, stride);
    vpg_t *g = NULL;
    rc = vpg_new(vs, (rank - first) / stride, size, wr, &layout, name, &g);
    free(wr);
    if (rc < 0) return rc;
    g->size = size;
    g->stride = stride;
    *out = &g->base;
    return FSDP_OK;
}

void fsdp_vsim_sync(fsdp_vsim_t *vs) {
    if (!vs) return;
    struct fsdp__vclock *c = vs->clock; /* latest covers the network: every end reaches it */
    fsdp__vclock_stream_wait(c, &c->compute, c->latest);
    fsdp__vclock_host_wait(c, c->latest);
}

int fsdp_vsim_stats(const fsdp_vsim_t *vs, fsdp_vsim_stats_t *out) {
    if (!vs || !out) return FSDP_EINVAL;
    *out = vs->clock->stats;
    out->now = vs->clock->latest;
    return FSDP_OK;
}

void fsdp_vsim_reset_stats(fsdp_vsim_t *vs) {
    if (!vs) return;
    fsdp_vsim_sync(vs);
    struct fsdp__vclock *c = vs->clock;
    memset(&c->stats, 0, sizeof c->stats);
    c->stats.start = c->latest;
    c->started = false;
}
