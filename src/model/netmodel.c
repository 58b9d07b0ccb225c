/* SPDX-License-Identifier: MIT */
/*
 * netmodel.c: the time of a collective on a group of GPUs (the network model of fsdp/cluster.h).
 *
 * The formulas are those of the header; this file only counts hops, picks the bottleneck
 * bandwidth and, for FSDP_NET_ALGO_AUTO, the faster algorithm. Everything is double arithmetic
 * on checked inputs: no allocation except fsdp_net_group_from_ranks's sorted copy.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/model_impl.h"

const char *fsdp_net_algo_name(fsdp_net_algo_t algo) {
    switch (algo) {
    case FSDP_NET_ALGO_AUTO:
        return "auto";
    case FSDP_NET_ALGO_RING:
        return "ring";
    case FSDP_NET_ALGO_TREE:
        return "tree";
    case FSDP_NET_ALGO_DIRECT:
        return "direct";
    case FSDP_NET_ALGO_LOCAL:
        return "local";
    default:
        return "invalid";
    }
}

double fsdp_net_bus_factor(fsdp_coll_kind_t kind, int n) {
    if (n < 1) return 0;
    switch (kind) {
    case FSDP_COLL_ALL_GATHER:
    case FSDP_COLL_REDUCE_SCATTER:
    case FSDP_COLL_ALL_TO_ALL:
        return (double)(n - 1) / n;
    case FSDP_COLL_ALL_REDUCE:
        return 2.0 * (n - 1) / n;
    case FSDP_COLL_BROADCAST:
    case FSDP_COLL_REDUCE:
        return 1;
    default:
        return 0;
    }
}

int fsdp_net_coll_bytes(fsdp_ctx_t *ctx, fsdp_coll_kind_t kind, int n, size_t count,
                        fsdp_dtype_t dt, size_t *out) {
    static const char who[] = "fsdp_net_coll_bytes";
    if (!out) return fsdp__model_err(ctx, FSDP_EINVAL, "%s: out is NULL", who);
    if (n < 1) return fsdp__model_err(ctx, FSDP_EINVAL, "%s: n is %d (must be >= 1)", who, n);
    if (!fsdp_dtype_valid((int)dt))
        return fsdp__model_err(ctx, FSDP_EINVAL, "%s: dtype %d is not a dtype", who, (int)dt);
    size_t ranks;
    switch (kind) {
    case FSDP_COLL_ALL_GATHER:
    case FSDP_COLL_REDUCE_SCATTER:
    case FSDP_COLL_ALL_TO_ALL:
        ranks = (size_t)n;
        break;
    case FSDP_COLL_ALL_REDUCE:
    case FSDP_COLL_BROADCAST:
    case FSDP_COLL_REDUCE:
    case FSDP_COLL_BARRIER:
        ranks = 1;
        break;
    default:
        return fsdp__model_err(ctx, FSDP_EINVAL, "%s: kind %d is not a collective", who, (int)kind);
    }
    if (kind == FSDP_COLL_BARRIER) count = 0;
    size_t es = fsdp_dtype_size(dt);
    if (count > SIZE_MAX / es / ranks)
        return fsdp__model_err(ctx, FSDP_EINVAL,
                               "%s: %s of %zu elements of %s on %d ranks overflows size_t", who,
                               fsdp_coll_name(kind), count, fsdp_dtype_name(dt), n);
    *out = count * es * ranks;
    return FSDP_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Groups */

int fsdp__net_group_check(fsdp_ctx_t *ctx, const char *who, const fsdp_net_model_t *net,
                          const fsdp_net_group_t *g) {
    if (!g) return fsdp__model_err(ctx, FSDP_EINVAL, "%s: group is NULL", who);
    if (g->size < 1)
        return fsdp__model_err(ctx, FSDP_EINVAL, "%s: group.size is %d (must be >= 1)", who,
                               g->size);
    if (g->ranks_per_node < 1 || g->ranks_per_node > net->gpus_per_node)
        return fsdp__model_err(ctx, FSDP_EINVAL,
                               "%s: group.ranks_per_node is %d (must be in [1, "
                               "net.gpus_per_node %d])",
                               who, g->ranks_per_node, net->gpus_per_node);
    if (g->size % g->ranks_per_node != 0)
        return fsdp__model_err(ctx, FSDP_EINVAL,
                               "%s: group.ranks_per_node %d does not divide group.size %d", who,
                               g->ranks_per_node, g->size);
    int nodes = g->size / g->ranks_per_node;
    if (nodes > net->nodes)
        return fsdp__model_err(ctx, FSDP_EINVAL,
                               "%s: the group spans %d nodes (group.size %d / "
                               "group.ranks_per_node %d) but the cluster has net.nodes %d: the "
                               "group is larger than the cluster",
                               who, nodes, g->size, g->ranks_per_node, net->nodes);
    if (g->stride < 1)
        return fsdp__model_err(ctx, FSDP_EINVAL, "%s: group.stride is %d (must be >= 1)", who,
                               g->stride);
    if ((int64_t)(g->ranks_per_node - 1) * g->stride >= net->gpus_per_node)
        return fsdp__model_err(ctx, FSDP_EINVAL,
                               "%s: group.ranks_per_node %d ranks at group.stride %d do not fit "
                               "a node of net.gpus_per_node %d",
                               who, g->ranks_per_node, g->stride, net->gpus_per_node);
    return FSDP_OK;
}

int fsdp_net_group_check(fsdp_ctx_t *ctx, const fsdp_net_model_t *net, const fsdp_net_group_t *g) {
    static const char who[] = "fsdp_net_group_check";
    int rc = fsdp__net_model_check(ctx, who, net);
    if (rc < 0) return rc;
    return fsdp__net_group_check(ctx, who, net, g);
}

int fsdp_net_group_strided(fsdp_ctx_t *ctx, const fsdp_net_model_t *net, int size, int stride,
                           fsdp_net_group_t *out) {
    static const char who[] = "fsdp_net_group_strided";
    int rc = fsdp__net_model_check(ctx, who, net);
    if (rc < 0) return rc;
    if (!out) return fsdp__model_err(ctx, FSDP_EINVAL, "%s: out is NULL", who);
    if (size < 1)
        return fsdp__model_err(ctx, FSDP_EINVAL, "%s: size is %d (must be >= 1)", who, size);
    if (stride < 1)
        return fsdp__model_err(ctx, FSDP_EINVAL, "%s: stride is %d (must be >= 1)", who, stride);
    int gpn = net->gpus_per_node;
    int64_t last = (int64_t)(size - 1) * stride;
    if (last >= (int64_t)net->nodes * gpn)
        return fsdp__model_err(ctx, FSDP_EINVAL,
                               "%s: %d ranks at stride %d reach world rank %lld, beyond the "
                               "cluster's %d GPUs (net.nodes %d x net.gpus_per_node %d): the "
                               "group is larger than the cluster",
                               who, size, stride, (long long)last, net->nodes * gpn, net->nodes,
                               gpn);
    int rpn;
    if (stride < gpn) {
        if (gpn % stride != 0)
            return fsdp__model_err(ctx, FSDP_EINVAL,
                                   "%s: stride %d does not divide net.gpus_per_node %d, so nodes "
                                   "would hold different numbers of the group's ranks",
                                   who, stride, gpn);
        rpn = gpn / stride < size ? gpn / stride : size;
        if (size % rpn != 0)
            return fsdp__model_err(ctx, FSDP_EINVAL,
                                   "%s: %d ranks at stride %d fill nodes of %d of them unevenly "
                                   "(%d ranks per node does not divide %d)",
                                   who, size, stride, rpn, rpn, size);
    } else {
        if (stride % gpn != 0)
            return fsdp__model_err(ctx, FSDP_EINVAL,
                                   "%s: stride %d is not a multiple of net.gpus_per_node %d, so "
                                   "the group's ranks sit at different places of their nodes",
                                   who, stride, gpn);
        rpn = 1;
    }
    out->size = size;
    out->ranks_per_node = rpn;
    out->stride = stride;
    return FSDP_OK;
}

static int cmp_int(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

int fsdp_net_group_from_ranks(fsdp_ctx_t *ctx, const fsdp_net_model_t *net, const int *world_ranks,
                              int n, fsdp_net_group_t *out) {
    static const char who[] = "fsdp_net_group_from_ranks";
    int rc = fsdp__net_model_check(ctx, who, net);
    if (rc < 0) return rc;
    if (!out) return fsdp__model_err(ctx, FSDP_EINVAL, "%s: out is NULL", who);
    if (n < 1) return fsdp__model_err(ctx, FSDP_EINVAL, "%s: n is %d (must be >= 1)", who, n);
    if (!world_ranks) return fsdp__model_err(ctx, FSDP_EINVAL, "%s: world_ranks is NULL", who);
    int gpn = net->gpus_per_node, world = net->nodes * gpn;
    for (int i = 0; i < n; i++)
        if (world_ranks[i] < 0 || world_ranks[i] >= world)
            return fsdp__model_err(ctx, FSDP_EINVAL,
                                   "%s: world_ranks[%d] is %d, outside the cluster's [0, %d)", who,
                                   i, world_ranks[i], world);
    int *r = malloc((size_t)n * sizeof *r);
    if (!r) return fsdp__model_err(ctx, FSDP_ENOMEM, "%s: no memory for %d ranks", who, n);
    memcpy(r, world_ranks, (size_t)n * sizeof *r);
    qsort(r, (size_t)n, sizeof *r, cmp_int);
    int rpn = 0, stride = 0;
    rc = FSDP_OK;
    for (int i = 0; i < n && rc == FSDP_OK;) {
        int node = r[i] / gpn, j = i + 1;
        while (j < n && r[j] / gpn == node) {
            if (r[j] == r[j - 1]) {
                rc =
                    fsdp__model_err(ctx, FSDP_EINVAL, "%s: world rank %d appears twice", who, r[j]);
                break;
            }
            int s = r[j] - r[j - 1];
            if (stride == 0) stride = s;
            if (s != stride) {
                rc = fsdp__model_err(ctx, FSDP_EINVAL,
                                     "%s: the group's ranks on node %d are not evenly spaced "
                                     "(world ranks %d and %d are %d apart, others %d)",
                                     who, node, r[j - 1], r[j], s, stride);
                break;
            }
            j++;
        }
        if (rc < 0) break;
        if (rpn == 0) rpn = j - i;
        if (j - i != rpn)
            rc = fsdp__model_err(ctx, FSDP_EINVAL,
                                 "%s: node %d holds %d of the group's ranks, another node %d: "
                                 "every node a group spans must hold the same number",
                                 who, node, j - i, rpn);
        i = j;
    }
    free(r);
    if (rc < 0) return rc;
    out->size = n;
    out->ranks_per_node = rpn;
    out->stride = stride ? stride : 1;
    return FSDP_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Collectives */

/* What the algorithms need to know about a group on a network. */
typedef struct shape {
    int n, r, nodes;
    double b_intra; /* B/s per GPU over NVLink, after efficiency */
    double b_nic;   /* B/s: a GPU's share of its node's NICs, after efficiency */
    double b;       /* B/s: the bottleneck of ring and tree (B in the header) */
} shape_t;

static shape_t shape_of(const fsdp_net_model_t *net, const fsdp_net_group_t *g) {
    shape_t s;
    s.n = g->size;
    s.r = g->ranks_per_node;
    s.nodes = g->size / g->ranks_per_node;
    s.b_intra = net->intra_bw * net->intra_eff;
    s.b_nic = net->nics_per_node * net->nic_bw * net->inter_eff / net->gpus_per_node;
    if (s.nodes == 1) {
        s.b = s.b_intra;
    } else {
        s.b = s.r * s.b_nic;
        if (s.r > 1 && s.b_intra < s.b) s.b = s.b_intra;
    }
    return s;
}

static void set_latency(const fsdp_net_model_t *net, int intra_hops, int inter_hops,
                        fsdp_net_estimate_t *e) {
    e->intra_hops = intra_hops;
    e->inter_hops = inter_hops;
    e->latency =
        net->base_latency + intra_hops * net->intra_latency + inter_hops * net->inter_latency;
}

static void ring(const fsdp_net_model_t *net, const shape_t *s, fsdp_coll_kind_t kind, double S,
                 fsdp_net_estimate_t *e) {
    int hops, inter;
    /* The chunk that arrives last travels n - 1 consecutive links of the ring (all_gather,
     * reduce_scatter; twice for all_reduce), which cross every node boundary but one or all of
     * them; broadcast and reduce run down an open chain, which crosses N - 1. */
    int crossings = s->nodes > 1 ? (s->nodes < s->n - 1 ? s->nodes : s->n - 1) : 0;
    switch (kind) {
    case FSDP_COLL_ALL_REDUCE:
        hops = 2 * (s->n - 1);
        inter = 2 * crossings;
        break;
    case FSDP_COLL_BROADCAST:
    case FSDP_COLL_REDUCE:
        hops = s->n - 1;
        inter = s->nodes - 1;
        break;
    default: /* all_gather, reduce_scatter */
        hops = s->n - 1;
        inter = crossings;
        break;
    }
    e->algo = FSDP_NET_ALGO_RING;
    set_latency(net, hops - inter, inter, e);
    e->link_bw = s->b;
    e->transfer = S * fsdp_net_bus_factor(kind, s->n) / s->b;
}

static int ceil_log2(int x) {
    int k = 0;
    while ((1 << k) < x)
        k++;
    return k;
}

static void tree(const fsdp_net_model_t *net, const shape_t *s, double S, fsdp_net_estimate_t *e) {
    e->algo = FSDP_NET_ALGO_TREE;
    set_latency(net, 2 * (s->r - 1), 2 * ceil_log2(s->nodes), e);
    e->link_bw = s->b * net->tree_eff;
    e->transfer = 2 * S / e->link_bw;
}

static void direct(const fsdp_net_model_t *net, const shape_t *s, double S,
                   fsdp_net_estimate_t *e) {
    e->algo = FSDP_NET_ALGO_DIRECT;
    if (s->nodes > 1)
        set_latency(net, 0, 1, e);
    else
        set_latency(net, 1, 0, e);
    double local = (double)(s->r - 1) / s->n * S / s->b_intra;
    double remote = (double)(s->n - s->r) / s->n * S / s->b_nic;
    e->transfer = local > remote ? local : remote;
    /* The bandwidth the whole (n-1)/n share would need to finish in that time. */
    e->link_bw = e->transfer > 0 ? (double)(s->n - 1) / s->n * S / e->transfer
                                 : (s->nodes > 1 ? s->b_nic : s->b_intra);
}

int fsdp_net_coll_time(fsdp_ctx_t *ctx, const fsdp_net_model_t *net, const fsdp_net_group_t *g,
                       fsdp_coll_kind_t kind, size_t bytes, fsdp_net_algo_t algo,
                       fsdp_net_estimate_t *out) {
    static const char who[] = "fsdp_net_coll_time";
    int rc = fsdp__net_model_check(ctx, who, net);
    if (rc < 0) return rc;
    if ((rc = fsdp__net_group_check(ctx, who, net, g)) < 0) return rc;
    if (!out) return fsdp__model_err(ctx, FSDP_EINVAL, "%s: out is NULL", who);
    if ((int)kind < 0 || kind >= FSDP_COLL_COUNT)
        return fsdp__model_err(ctx, FSDP_EINVAL, "%s: kind %d is not a collective", who, (int)kind);
    if ((int)algo < 0 || algo >= FSDP_NET_ALGO_COUNT || algo == FSDP_NET_ALGO_LOCAL)
        return fsdp__model_err(
            ctx, FSDP_EINVAL, "%s: algo %d is not one of auto, ring, tree, direct", who, (int)algo);
    bool a2a = kind == FSDP_COLL_ALL_TO_ALL;
    bool reduces = kind == FSDP_COLL_ALL_REDUCE || kind == FSDP_COLL_BARRIER;
    if ((a2a && (algo == FSDP_NET_ALGO_RING || algo == FSDP_NET_ALGO_TREE)) ||
        (!a2a && algo == FSDP_NET_ALGO_DIRECT) || (!reduces && algo == FSDP_NET_ALGO_TREE))
        return fsdp__model_err(ctx, FSDP_ENOTSUP, "%s: %s has no %s algorithm in the model", who,
                               fsdp_coll_name(kind), fsdp_net_algo_name(algo));

    fsdp_net_estimate_t e;
    memset(&e, 0, sizeof e);
    shape_t s = shape_of(net, g);
    e.nodes = s.nodes;
    /* A barrier is charged as the all_reduce of nothing; its bus factor (0) is kept. */
    double S = kind == FSDP_COLL_BARRIER ? 0 : (double)bytes;
    fsdp_coll_kind_t as = kind == FSDP_COLL_BARRIER ? FSDP_COLL_ALL_REDUCE : kind;
    if (s.n == 1) {
        e.algo = FSDP_NET_ALGO_LOCAL;
    } else if (a2a) {
        direct(net, &s, S, &e);
    } else if (algo == FSDP_NET_ALGO_TREE) {
        tree(net, &s, S, &e);
    } else {
        ring(net, &s, as, S, &e);
        if (algo == FSDP_NET_ALGO_AUTO && as == FSDP_COLL_ALL_REDUCE) {
            fsdp_net_estimate_t t = e;
            tree(net, &s, S, &t);
            /* Ties go to the ring, as inside a node, where the two have the same hops. */
            if (t.latency + t.transfer < e.latency + e.transfer) e = t;
        }
    }
    e.seconds = e.latency + e.transfer;
    if (s.n > 1) e.channels = s.nodes > 1 ? net->inter_channels : net->intra_channels;
    e.alg_bw = e.seconds > 0 ? S / e.seconds : 0;
    e.bus_bw = e.alg_bw * fsdp_net_bus_factor(kind, s.n);
    *out = e;
    return FSDP_OK;
}
