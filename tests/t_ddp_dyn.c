/* SPDX-License-Identifier: MIT */
/*
 * t_ddp_dyn.c: the DDP behaviours of seed 004 (test_dynamo_distributed.py) that a C library can
 * carry, part one: PyTorch's bucket arithmetic with its small first bucket
 * (DYN-SP-03/04/09/11/13) and parameters_to_ignore (DYN-SP-13). Part two, the launch order,
 * static_graph, a world of one and the option errors, is t_ddp_static.c.
 *
 * The bucket arithmetic is checked twice: on fsdp_ddp_assign_buckets with the seeds' real sizes
 * (ToyModel's 100 MB layers need no memory there), and on wrappers over the seeds' custom model
 * (three 512 x 512 weights). Multi-rank cases run over sim ranks (threads) that store what they
 * saw in per-rank slots; the main thread reports.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "ddp_util.h"
#include "models/models.h"
#include "tap.h"

#define MIB ((size_t)1 << 20)

/* ---- DYN-SP-03/04/09/11/13: PyTorch's bucket arithmetic -------------------------------------- */

/* Byte sizes of ToyModel(in, hidden, out)'s parameters in reverse registration order (the order
 * DDP buckets them): net.6 (bias, weight), net.4, net.2, net.0. */
static size_t toy_sizes(size_t in, size_t hid, size_t out, size_t *b) {
    size_t shapes[4][2] = {{in, hid}, {hid, hid}, {hid, hid}, {hid, out}};
    size_t n = 0;
    for (int l = 3; l >= 0; l--) {
        b[n++] = shapes[l][1] * 4;                /* bias */
        b[n++] = shapes[l][0] * shapes[l][1] * 4; /* weight */
    }
    return n;
}

/* get_custom_model's parameters in reverse order, the listed ones left out:
 * seq.4.linear.bias, seq.4.linear.weight, seq.2.weight, seq.0.linear.bias, seq.0.linear.weight. */
static const char *const custom_names[5] = {"seq.4.linear.bias", "seq.4.linear.weight",
                                            "seq.2.weight", "seq.0.linear.bias",
                                            "seq.0.linear.weight"};
static const size_t custom_bytes[5] = {2048, MIB, MIB, 2048, MIB};
static const char *const custom_ignored[2] = {"seq.2.weight", "seq.4.linear.bias"};

static size_t custom_sizes(bool ignore, size_t *b) {
    size_t n = 0;
    for (int i = 0; i < 5; i++)
        if (!ignore || (strcmp(custom_names[i], custom_ignored[0]) != 0 &&
                        strcmp(custom_names[i], custom_ignored[1]) != 0))
            b[n++] = custom_bytes[i];
    return n;
}

/* "0 0 0 0 1 1 2 2": each tensor's bucket. */
static void assignment_str(const size_t *of, size_t n, char *buf, size_t len) {
    size_t o = 0;
    buf[0] = 0;
    for (size_t i = 0; i < n && o + 24 < len; i++)
        o += (size_t)snprintf(buf + o, len - o, "%s%zu", i ? " " : "", of[i]);
}

static void check_assign(const char *what, const size_t *bytes, const fsdp_dtype_t *dts, size_t n,
                         size_t first, size_t cap, const char *want) {
    size_t of[16], nb = 0;
    char got[128];
    int rc = fsdp_ddp_assign_buckets(NULL, n, bytes, dts, first, cap, of, &nb);
    assignment_str(of, n, got, sizeof got);
    if (rc < 0) snprintf(got, sizeof got, "%s", fsdp_err_name(rc));
    tap_is_str(got, want, "%s", what);
}

static void test_assign(void) {
    size_t b[16];
    size_t n = toy_sizes(10, 5000, 5, b);
    check_assign("DYN-SP-03: ToyModel(10, 5000, 5) at 25 MiB: net.6 + net.4 close the 1 MiB first "
                 "bucket, net.2 and net.0 one each: 3 buckets",
                 b, NULL, n, MIB, 25 * MIB, "0 0 0 0 1 1 2 2");
    n = toy_sizes(1000, 1000, 1000, b);
    check_assign("DYN-SP-04: ToyModel(1000, 1000, 1000) at 3.5 MiB: every 4 MB layer closes its "
                 "bucket: 4 buckets",
                 b, NULL, n, MIB, 7 * MIB / 2, "0 0 1 1 2 2 3 3");
    n = toy_sizes(10, 5, 5, b);
    check_assign("DYN-SP-09: ToyModel(10, 5, 5) at 250 MiB: everything below the first bucket's "
                 "1 MiB: 1 bucket",
                 b, NULL, n, MIB, 250 * MIB, "0 0 0 0 0 0 0 0");
    n = custom_sizes(false, b);
    check_assign("DYN-SP-11: the custom model at 1 MiB: seq.4, seq.2, seq.0: 3 buckets", b, NULL, n,
                 MIB, MIB, "0 0 1 2 2");
    check_assign("DYN-SP-13: the custom model at 25 MiB: seq.4 closes the first bucket, the rest "
                 "(2 MiB + 2 KiB) is one: 2 buckets",
                 b, NULL, n, MIB, 25 * MIB, "0 0 1 1 1");
    n = custom_sizes(true, b);
    check_assign("DYN-SP-13: without seq.2.weight and seq.4.linear.bias: seq.4.linear.weight "
                 "(1 MiB) closes the first bucket, seq.0 (1 MiB + 2 KiB) is the second",
                 b, NULL, n, MIB, 25 * MIB, "0 1 1");
    /* The rule's edges. */
    size_t e[4] = {100, 200, 56, 300};
    check_assign("F50 buckets: a bucket closes with the tensor that takes it to its limit "
                 "(300 B >= 256), not before it",
                 e, NULL, 4, 256, 256, "0 0 1 1");
    check_assign("F50 buckets: the first bucket's limit is min(first_bucket_bytes, cap)", e, NULL,
                 4, 4096, 256, "0 0 1 1");
    check_assign("F50 buckets: a small first bucket (100 B) before 1 KiB ones", e, NULL, 4, 100,
                 1024, "0 1 1 1");
    fsdp_dtype_t dts[4] = {FSDP_DTYPE_F32, FSDP_DTYPE_F64, FSDP_DTYPE_F32, FSDP_DTYPE_F64};
    size_t m[4] = {64, 64, 300, 64};
    check_assign("F50 buckets: one open bucket per dtype, each dtype with its own small first "
                 "bucket, numbered by their first tensor",
                 m, dts, 4, 128, 512, "0 1 0 1");
    size_t of[4], nb = 7;
    tap_is_int(fsdp_ddp_assign_buckets(NULL, 0, NULL, NULL, MIB, MIB, NULL, &nb), 0,
               "F50 buckets: no tensors, no buckets (DYN-FK-03)");
    tap_is_size(nb, 0, "F50 buckets: nbuckets 0");
    tap_is_int(fsdp_ddp_assign_buckets(NULL, 4, e, NULL, 0, MIB, of, &nb), FSDP_EINVAL,
               "errors: assign_buckets with first_bucket_bytes 0");
    tap_is_int(fsdp_ddp_assign_buckets(NULL, 4, e, NULL, MIB, 0, of, &nb), FSDP_EINVAL,
               "errors: assign_buckets with bucket_cap_bytes 0");
    tap_is_int(fsdp_ddp_assign_buckets(NULL, 4, NULL, NULL, MIB, MIB, of, &nb), FSDP_EINVAL,
               "errors: assign_buckets with NULL nbytes");
    dts[2] = (fsdp_dtype_t)99;
    tap_is_int(fsdp_ddp_assign_buckets(NULL, 4, m, dts, MIB, MIB, of, &nb), FSDP_EINVAL,
               "errors: assign_buckets with a dtype out of range");
}

/* ---- the custom model (get_custom_model) ----------------------------------------------------- */

/* MyLinear: { linear: Linear(512, 512) }; forward = linear. */
static int mylinear_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                            fsdp_tensor_t **out) {
    if (nin != 1 || nout != 1) return FSDP_EINVAL;
    return fsdp_module_forward1(fsdp_module_child(m, "linear"), in[0], &out[0]);
}
static const fsdp_module_ops_t mylinear_ops = {"MyLinear", mylinear_forward, NULL};

/* MyCustomLinear: { weight: (512, 512) }; forward = x W^T + 0.3. */
static int custom_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                          fsdp_tensor_t **out) {
    fsdp_tensor_t *t = NULL;
    if (nin != 1 || nout != 1) return FSDP_EINVAL;
    int rc = fsdp_linear(in[0], fsdp_module_param(m, "weight"), NULL, &t);
    if (rc == 0) rc = fsdp_add_scalar(t, 0.3, &out[0]);
    fsdp_tensor_release(t);
    return rc;
}
static const fsdp_module_ops_t custom_ops = {"MyCustomLinear", custom_forward, NULL};

/* The root: { seq: Sequential(MyLinear, ReLU, MyCustomLinear, ReLU, MyLinear, ReLU) }. */
static int root_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                        fsdp_tensor_t **out) {
    if (nin != 1 || nout != 1) return FSDP_EINVAL;
    return fsdp_module_forward1(fsdp_module_child(m, "seq"), in[0], &out[0]);
}
static const fsdp_module_ops_t root_ops = {"MyModule", root_forward, NULL};

static int append_new(fsdp_module_t *seq, fsdp_module_t *c, int rc) {
    if (rc == 0) rc = fsdp_module_append(seq, c);
    fsdp_module_release(c);
    return rc;
}

static int mylinear_create(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_module_t *l = NULL;
    int rc = fsdp_module_create(ctx, &mylinear_ops, NULL, out);
    if (rc == 0) rc = fsdp_linear_create(ctx, 512, 512, true, &l);
    if (rc == 0) rc = fsdp_module_add_child(*out, "linear", l);
    fsdp_module_release(l);
    return rc;
}

/* Same values on every rank (seeded 3). */
static int custom_model_create(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_module_t *root = NULL, *seq = NULL, *c = NULL;
    fsdp_tensor_t *w = NULL;
    const int64_t shape[2] = {512, 512};
    int rc;
    *out = NULL;
    tm_manual_seed(ctx, 3);
    CHECK(rc, fail, fsdp_module_create(ctx, &root_ops, NULL, &root));
    CHECK(rc, fail, fsdp_sequential_create(ctx, &seq));
    CHECK(rc, fail, fsdp_module_add_child(root, "seq", seq));
    for (int k = 0; k < 3 && rc == 0; k++) {
        c = NULL;
        if (k == 1) {
            rc = fsdp_module_create(ctx, &custom_ops, NULL, &c);
            if (rc == 0) rc = fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, shape, FSDP_MEM_PARAMS, &w);
            if (rc == 0) rc = fsdp_tensor_normal_(w, 0.0, 0.05);
            if (rc == 0) rc = fsdp_module_add_param(c, "weight", w);
            fsdp_tensor_release(w);
        } else {
            rc = mylinear_create(ctx, &c);
        }
        rc = append_new(seq, c, rc);
        c = NULL;
        if (rc == 0) rc = fsdp_relu_create(ctx, &c);
        rc = append_new(seq, c, rc);
    }
    if (rc < 0) goto fail;
    fsdp_module_release(seq);
    *out = root;
    return FSDP_OK;
fail:
    fsdp_module_release(seq);
    fsdp_module_release(root);
    return rc;
}

/* A (4, 512) input of uniform [0, 1) values drawn after seeding `seed`. */
static int input512(fsdp_ctx_t *ctx, uint64_t seed, fsdp_tensor_t **x) {
    const int64_t shape[2] = {4, 512};
    *x = NULL;
    tm_manual_seed(ctx, seed);
    int rc = fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, shape, FSDP_MEM_ACTIVATIONS, x);
    if (rc == 0) rc = fsdp_tensor_uniform_(*x, 0.0, 1.0);
    return rc;
}

/* FNV-1a of n bytes. */
static uint64_t fnv(const void *p, size_t n) {
    const unsigned char *c = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ c[i]) * 1099511628211ull;
    return h;
}

/* ---- DYN-SP-13: parameters_to_ignore on the custom model ---------------------------------------
 */

#define CUSTOM_NP (3 * 512 * 512 + 2 * 512)
#define NCFG 4

typedef struct {
    size_t nb, n_ignored;
    size_t bn[4], bbytes[4];
    char names[4][3][24];
    int clean; /* no ignored parameter in any bucket */
} layout_t;

typedef struct {
    struct {
        int rc;
        char msg[256];
        layout_t lay[NCFG]; /* (ignore, cap): (no, 25 MiB) (yes, 25 MiB) (no, 1 MiB) (yes, 1 MiB) */
        uint64_t ar_calls, ar_bytes, stats_bytes;
        int ignored_local;      /* ignored gradients are this rank's own, bitwise */
        double worst_avg;       /* the others against the average of the local gradients */
        uint64_t h_ign, h_kept; /* hashes of the ignored and of the other gradients */
    } r[MAXW];
} custom_t;

static bool is_ignored(const char *name) {
    return strcmp(name, custom_ignored[0]) == 0 || strcmp(name, custom_ignored[1]) == 0;
}

static void record_layout(fsdp_ddp_t *d, layout_t *l) {
    fsdp_ddp_stats_t st;
    fsdp_ddp_get_stats(d, &st);
    l->nb = st.num_buckets;
    l->n_ignored = st.num_ignored_params;
    l->clean = 1;
    for (size_t b = 0; b < st.num_buckets; b++) {
        if (b < 4) {
            l->bn[b] = fsdp_ddp_bucket_num_params(d, b);
            l->bbytes[b] = fsdp_ddp_bucket_bytes(d, b);
        }
        for (size_t i = 0; i < fsdp_ddp_bucket_num_params(d, b); i++) {
            const char *nm = NULL;
            fsdp_ddp_bucket_param(d, b, i, &nm);
            if (b < 4 && i < 3) snprintf(l->names[b][i], sizeof l->names[b][i], "%s", nm);
            l->clean &= !is_ignored(nm);
        }
    }
}

static int custom_fn(fsdp_ctx_t *ctx, void *arg) {
    custom_t *t = arg;
    int rank = fsdp_ctx_rank(ctx), world = fsdp_ctx_world_size(ctx), rc;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    fsdp_module_t *m = NULL, *ref = NULL;
    fsdp_ddp_t *d = NULL;
    fsdp_tensor_t *x = NULL;
    fsdp_ddp_options_t o;
    float *g = malloc(sizeof *g * CUSTOM_NP), *lg = malloc(sizeof *lg * CUSTOM_NP);
    float *own = malloc(sizeof *own * CUSTOM_NP);
    double *acc = calloc(CUSTOM_NP, sizeof *acc);
    if (!g || !lg || !own || !acc) {
        rc = FSDP_ENOMEM;
        goto out;
    }
    for (int c = 0; c < NCFG; c++) {
        fsdp_ddp_options_init(&o);
        o.bucket_cap_bytes = c < 2 ? 25 * MIB : MIB;
        if (c % 2) {
            o.parameters_to_ignore = custom_ignored;
            o.num_parameters_to_ignore = 2;
        }
        fsdp_module_t *mc = NULL;
        fsdp_ddp_t *dc = NULL;
        rc = custom_model_create(ctx, &mc);
        if (rc == 0) rc = fsdp_ddp_create(mc, pg, &o, &dc);
        if (rc == 0) record_layout(dc, &t->r[rank].lay[c]);
        if (rc == 0 && c == 1) {
            m = mc; /* kept for the step below */
            d = dc;
        } else {
            rank_release(NULL, dc, mc, NULL);
        }
        if (rc < 0) goto out;
    }
    /* Configuration 1 (ignoring, 25 MiB) takes a step on this rank's input. */
    CHECK(rc, out, input512(ctx, 10 + (uint64_t)rank, &x));
    fsdp_pg_reset_counters(pg);
    CHECK(rc, out, ddp_step(d, x, NULL));
    fsdp_tensor_release(x);
    x = NULL;
    {
        fsdp_pg_counters_t c;
        fsdp_ddp_stats_t st;
        fsdp_pg_get_counters(pg, &c);
        fsdp_ddp_get_stats(d, &st);
        t->r[rank].ar_calls = c.calls[FSDP_COLL_ALL_REDUCE];
        t->r[rank].ar_bytes = c.bytes[FSDP_COLL_ALL_REDUCE];
        t->r[rank].stats_bytes = st.last_allreduce_bytes;
    }
    CHECK(rc, out, grads_to_host(m, g, CUSTOM_NP, NULL));
    /* Every rank's local gradients on an undistributed copy. */
    CHECK(rc, out, custom_model_create(ctx, &ref));
    for (int r = 0; r < world; r++) {
        CHECK(rc, out, fsdp_module_zero_grad(ref, true));
        CHECK(rc, out, input512(ctx, 10 + (uint64_t)r, &x));
        CHECK(rc, out, plain_step(ref, x, NULL));
        fsdp_tensor_release(x);
        x = NULL;
        CHECK(rc, out, grads_to_host(ref, lg, CUSTOM_NP, NULL));
        if (r == rank) memcpy(own, lg, sizeof *own * CUSTOM_NP);
        for (size_t i = 0; i < CUSTOM_NP; i++)
            acc[i] += lg[i];
    }
    fsdp_named_list_t l = {0};
    CHECK(rc, out, fsdp_module_named_params(m, false, &l));
    size_t off = 0;
    int local = 1;
    double worst = 0;
    uint64_t hi = 1, hk = 1;
    for (size_t p = 0; p < l.n; p++) {
        size_t k = (size_t)fsdp_tensor_numel(l.tensors[p]);
        if (is_ignored(l.names[p])) {
            local &= memcmp(g + off, own + off, k * sizeof *g) == 0;
            hi = hi * 31 + fnv(g + off, k * sizeof *g);
        } else {
            for (size_t i = off; i < off + k; i++) {
                double want = acc[i] / world;
                double w = fabs((double)g[i] - want) / (1e-5 + 1.3e-6 * fabs(want));
                if (w > worst) worst = w;
            }
            hk = hk * 31 + fnv(g + off, k * sizeof *g);
        }
        off += k;
    }
    fsdp_named_list_free(&l);
    t->r[rank].ignored_local = local;
    t->r[rank].worst_avg = worst;
    t->r[rank].h_ign = hi;
    t->r[rank].h_kept = hk;
out:
    free(g);
    free(lg);
    free(own);
    free(acc);
    rank_release(x, d, m, ref);
    if (rc < 0) snprintf(t->r[rank].msg, sizeof t->r[rank].msg, "%s", fsdp_ctx_last_error(ctx));
    t->r[rank].rc = rc;
    return rc;
}

static void layout_is(const layout_t *l, const char *want_names, const size_t *want_bytes,
                      size_t nb, const char *what) {
    char got[256] = "", wantb[128] = "", gotb[128] = "";
    size_t o = 0, ob = 0, ow = 0;
    for (size_t b = 0; b < l->nb && b < 4; b++) {
        o += (size_t)snprintf(got + o, sizeof got - o, "%s[", b ? " " : "");
        for (size_t i = 0; i < l->bn[b] && i < 3; i++)
            o += (size_t)snprintf(got + o, sizeof got - o, "%s%s", i ? " " : "", l->names[b][i]);
        o += (size_t)snprintf(got + o, sizeof got - o, "]");
        ob += (size_t)snprintf(gotb + ob, sizeof gotb - ob, "%s%zu", b ? " " : "", l->bbytes[b]);
    }
    for (size_t b = 0; b < nb; b++)
        ow += (size_t)snprintf(wantb + ow, sizeof wantb - ow, "%s%zu", b ? " " : "", want_bytes[b]);
    tap_is_str(got, want_names, "%s: buckets", what);
    tap_is_str(gotb, wantb, "%s: bucket bytes", what);
}

static void test_ignore_custom(void) {
    static custom_t t;
    int rc = run_sim(2, custom_fn, &t, NULL, 0, NULL);
    tap_ok(rc == 0 && t.r[0].rc == 0 && t.r[1].rc == 0,
           "DYN-SP-13: W=2 wrappers over the custom model, with and without parameters_to_ignore "
           "(%s)",
           fsdp_strerror(rc));
    if (t.r[0].rc < 0) tap_diag("rank 0: %s", t.r[0].msg);
    const layout_t *l = t.r[0].lay;
    static const size_t b_all25[2] = {MIB + 2048, 2 * MIB + 2048}, b_ign25[2] = {MIB, MIB + 2048};
    static const size_t b_all1[3] = {MIB + 2048, MIB, MIB + 2048}, b_ign1[2] = {MIB, MIB + 2048};
    layout_is(&l[0],
              "[seq.4.linear.bias seq.4.linear.weight] [seq.2.weight seq.0.linear.bias "
              "seq.0.linear.weight]",
              b_all25, 2, "DYN-SP-13 25 MiB, nothing ignored");
    layout_is(&l[1], "[seq.4.linear.weight] [seq.0.linear.bias seq.0.linear.weight]", b_ign25, 2,
              "DYN-SP-13 25 MiB, seq.2.weight and seq.4.linear.bias ignored");
    layout_is(&l[2],
              "[seq.4.linear.bias seq.4.linear.weight] [seq.2.weight] [seq.0.linear.bias "
              "seq.0.linear.weight]",
              b_all1, 3, "DYN-SP-11 1 MiB, nothing ignored");
    layout_is(&l[3], "[seq.4.linear.weight] [seq.0.linear.bias seq.0.linear.weight]", b_ign1, 2,
              "DYN-SP-13 1 MiB, ignored");
    int same = 1;
    for (int c = 0; c < NCFG; c++)
        same &= memcmp(&t.r[1].lay[c], &t.r[0].lay[c], sizeof(layout_t)) == 0;
    tap_ok(same, "DYN-SP-13: rank 1 built the same buckets as rank 0");
    tap_ok(l[1].clean && l[3].clean && l[1].n_ignored == 2 && l[0].n_ignored == 0,
           "DYN-SP-13: no bucket holds an ignored parameter; stats count 2 ignored (%zu)",
           l[1].n_ignored);
    for (int r = 0; r < 2; r++) {
        tap_ok(t.r[r].ignored_local,
               "DYN-SP-13 rank %d: the ignored parameters' .grad is this rank's local gradient, "
               "bitwise",
               r);
        tap_ok(t.r[r].worst_avg <= 1,
               "DYN-SP-13 rank %d: the other parameters' .grad is the average of the ranks' "
               "local gradients (worst %.3g)",
               r, t.r[r].worst_avg);
        tap_is_uint(t.r[r].ar_calls, 3, "DYN-SP-13 rank %d: 2 buckets + used flags all-reduced", r);
        tap_is_uint(t.r[r].ar_bytes, 2 * MIB + 2048 + 3 * 4,
                    "DYN-SP-13 rank %d: all-reduce bytes = the 3 bucketed gradients + 3 flags, "
                    "the ignored ones excluded",
                    r);
        tap_is_uint(t.r[r].stats_bytes, t.r[r].ar_bytes,
                    "DYN-SP-13 rank %d: stats report the same bytes", r);
    }
    tap_ok(t.r[0].h_ign != t.r[1].h_ign,
           "DYN-SP-13: the ignored gradients differ across ranks (not averaged)");
    tap_ok(t.r[0].h_kept == t.r[1].h_kept,
           "DYN-SP-13: the other gradients are bitwise equal across ranks");
}

/* ---- parameters_to_ignore: the cross-rank check and broadcasts skip ignored tensors -----------
 */

/* "Extra": lin = Linear(8, 4) drawn from a per-rank seed; parameter extra f32 [1 + rank] and
 * buffer stat f32 [2 + rank] (shapes differ across ranks), buffer scale f32 [4];
 * y = lin(x) + scale. */
static const fsdp_module_ops_t extra_ops = {"Extra", lin_plus_scale_forward, NULL};

static int extra_create(fsdp_ctx_t *ctx, int rank, fsdp_module_t **out) {
    fsdp_module_t *m = NULL, *l = NULL;
    fsdp_tensor_t *e = NULL, *s = NULL, *sc = NULL;
    int rc;
    *out = NULL;
    CHECK(rc, fail, fsdp_module_create(ctx, &extra_ops, NULL, &m));
    tm_manual_seed(ctx, 50 + (uint64_t)rank);
    CHECK(rc, fail, fsdp_linear_create(ctx, 8, 4, true, &l));
    CHECK(rc, fail, fsdp_module_add_child(m, "lin", l));
    CHECK(rc, fail,
          fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 1, (int64_t[]){1 + rank}, 1.0 + rank,
                           FSDP_MEM_PARAMS, &e));
    CHECK(rc, fail, fsdp_tensor_set_requires_grad(e, true));
    CHECK(rc, fail, fsdp_module_add_param(m, "extra", e));
    CHECK(rc, fail,
          fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 1, (int64_t[]){2 + rank}, 10.0 + rank,
                           FSDP_MEM_OTHER, &s));
    CHECK(rc, fail, fsdp_module_add_buffer(m, "stat", s, true));
    CHECK(
        rc, fail,
        fsdp_tensor_full(ctx, FSDP_DTYPE_F32, 1, (int64_t[]){4}, 20.0 + rank, FSDP_MEM_OTHER, &sc));
    CHECK(rc, fail, fsdp_module_add_buffer(m, "scale", sc, true));
    *out = m;
    m = NULL;
fail:
    fsdp_module_release(l);
    fsdp_tensor_release(e);
    fsdp_tensor_release(s);
    fsdp_tensor_release(sc);
    fsdp_module_release(m);
    return rc;
}

typedef struct {
    struct {
        int rc, rc_plain, rc_bad;
        char msg[512], msg_bad[512];
        float w[32], extra0, stat0, stat_fwd, scale_fwd;
        size_t nign_p, nign_b, nparams;
    } r[MAXW];
} extra_t;

static int extra_fn(fsdp_ctx_t *ctx, void *arg) {
    extra_t *t = arg;
    int rank = fsdp_ctx_rank(ctx), rc;
    fsdp_module_t *m = NULL;
    fsdp_ddp_t *d = NULL;
    fsdp_tensor_t *x = NULL;
    fsdp_ddp_options_t o;
    static const char *const ign[2] = {"stat", "extra"}, *const typo[2] = {"stat", "extar"};
    fsdp_ddp_options_init(&o);
    CHECK(rc, out, extra_create(ctx, rank, &m));
    /* Rank 1 misspells a name: it fails on its own check, and rank 0 with it (no hang). */
    o.parameters_to_ignore = rank == 1 ? typo : ign;
    o.num_parameters_to_ignore = 2;
    t->r[rank].rc_bad = fsdp_ddp_create(m, fsdp_ctx_pg(ctx), &o, &d);
    snprintf(t->r[rank].msg_bad, sizeof t->r[rank].msg_bad, "%s", fsdp_ctx_last_error(ctx));
    fsdp_ddp_destroy(d);
    d = NULL;
    fsdp_ddp_options_init(&o);
    /* Without the ignore list the shapes differ: every rank fails alike, naming 'extra'. */
    t->r[rank].rc_plain = fsdp_ddp_create(m, fsdp_ctx_pg(ctx), &o, &d);
    snprintf(t->r[rank].msg, sizeof t->r[rank].msg, "%s", fsdp_ctx_last_error(ctx));
    fsdp_ddp_destroy(d);
    d = NULL;
    o.parameters_to_ignore = ign;
    o.num_parameters_to_ignore = 2;
    CHECK(rc, out, fsdp_ddp_create(m, fsdp_ctx_pg(ctx), &o, &d));
    CHECK(rc, out, fsdp_tensor_to_host(fsdp_module_param(m, "lin.weight"), t->r[rank].w, 128));
    double v;
    CHECK(rc, out, fsdp_tensor_item(fsdp_module_param(m, "extra"), 0, &v));
    t->r[rank].extra0 = (float)v;
    CHECK(rc, out, fsdp_tensor_item(fsdp_module_buffer(m, "stat"), 0, &v));
    t->r[rank].stat0 = (float)v;
    /* A forward broadcasts scale but not stat. */
    CHECK(rc, out, fsdp_tensor_fill_(fsdp_module_buffer(m, "stat"), 30.0 + rank));
    CHECK(rc, out, fsdp_tensor_fill_(fsdp_module_buffer(m, "scale"), 40.0 + rank));
    CHECK(rc, out, input_as_rank(ctx, rank, &x));
    CHECK(rc, out, ddp_step(d, x, NULL));
    CHECK(rc, out, fsdp_tensor_item(fsdp_module_buffer(m, "stat"), 0, &v));
    t->r[rank].stat_fwd = (float)v;
    CHECK(rc, out, fsdp_tensor_item(fsdp_module_buffer(m, "scale"), 0, &v));
    t->r[rank].scale_fwd = (float)v;
    fsdp_ddp_stats_t st;
    fsdp_ddp_get_stats(d, &st);
    t->r[rank].nign_p = st.num_ignored_params;
    t->r[rank].nign_b = st.num_ignored_buffers;
    t->r[rank].nparams = st.num_params;
out:
    rank_release(x, d, m, NULL);
    t->r[rank].rc = rc;
    return rc;
}

static void test_ignore_extra(void) {
    static extra_t t;
    int rc = run_sim(2, extra_fn, &t, NULL, 0, NULL);
    tap_ok(rc == 0 && t.r[0].rc == 0 && t.r[1].rc == 0,
           "DYN-SP-13: W=2, a parameter and a buffer whose shapes differ across ranks, ignored "
           "(%s)",
           fsdp_strerror(rc));
    tap_ok(t.r[0].rc_bad == FSDP_EINVAL && t.r[1].rc_bad == FSDP_EINVAL,
           "DYN-SP-13: a name only rank 1 misspells fails both ranks, without waiting for a "
           "timeout");
    tap_has_str(t.r[1].msg_bad, "parameters_to_ignore[1] 'extar' is neither",
                "DYN-SP-13: rank 1's message names the entry");
    tap_has_str(t.r[0].msg_bad, "rank 1 failed its own checks", "DYN-SP-13: rank 0's names rank 1");
    for (int r = 0; r < 2; r++) {
        tap_is_int(t.r[r].rc_plain, FSDP_EINVAL,
                   "DYN-SP-13 rank %d: not ignored, the shape check refuses them", r);
        tap_has_str(t.r[r].msg, "parameter 'extra' differs across ranks",
                    "DYN-SP-13 rank %d: naming the parameter", r);
        tap_ok(t.r[r].nign_p == 1 && t.r[r].nign_b == 1 && t.r[r].nparams == 2,
               "DYN-SP-13 rank %d: 1 parameter and 1 buffer ignored, lin's 2 bucketed", r);
        tap_ok(t.r[r].extra0 == 1.0f + r && t.r[r].stat0 == 10.0f + r,
               "DYN-SP-13 rank %d: sync_module_states leaves the ignored parameter and buffer "
               "alone (%g, %g)",
               r, t.r[r].extra0, t.r[r].stat0);
        tap_ok(t.r[r].stat_fwd == 30.0f + r && t.r[r].scale_fwd == 40.0f,
               "DYN-SP-13 rank %d: broadcast_buffers skips the ignored buffer, not the other "
               "(%g, %g)",
               r, t.r[r].stat_fwd, t.r[r].scale_fwd);
    }
    tap_ok(memcmp(t.r[0].w, t.r[1].w, sizeof t.r[0].w) == 0,
           "DYN-SP-13: lin.weight (not ignored) was broadcast from rank 0");
}

int main(void) {
    tap_plan_lazy();
    test_assign();
    test_ignore_custom();
    test_ignore_extra();
    return tap_done();
}
