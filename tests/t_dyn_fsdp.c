/* SPDX-License-Identifier: MIT */
/*
 * t_dyn_fsdp.c: the corner cases of seed 004 (test_dynamo_distributed.py) that have a C analog,
 * each under DDP or FSDP on sim ranks against the same module run locally (the custom layer of
 * DYN-SP-11 is in t_function.c):
 *   - DYN-SP-18: a module that reads one buffer twice and keeps a plain (unregistered) tensor
 *     attribute, under FSDP: neither is flattened, and the output equals the local one;
 *   - DYN-SP-19: one buffer registered under two modules, doubled in place by every forward:
 *     after wrapping it is still one storage, 15 forwards under FSDP give the local values
 *     exactly, and the state dict lists it under both names;
 *   - DYN-MP-08: a forward that sets a module attribute: the change persists under FSDP, the
 *     output is 2 * net(x), and the root stays the root (lazy init once);
 *   - DYN-MP-07, DYN-MP-09: the dynamo ToyModel (hidden 501, so every shard is padded) under
 *     FSDP as one root unit and as a unit per Linear at world sizes 1, 2 and 4: the output
 *     equals the unwrapped model's;
 *   - DYN-SP-08: DDP and FSDP wrappers called with batch sizes 100, 200 and 300 in turn give
 *     the local output each time;
 *   - DYN-FK-03: a module without parameters (randn(3) * randn(3)) under DDP and FSDP: no
 *     bucket, no flat parameter, no collective after creation, the local output.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "models/models.h"
#include "tap.h"

#define W 2

/* ---- DYN-SP-18: one buffer read twice, a plain tensor attribute ------------------------------ */

typedef struct dup_mod {
    fsdp_tensor_t *plain; /* not registered: FSDP must leave it alone */
} dup_mod_t;

static int dup_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                       fsdp_tensor_t **out) {
    (void)nin, (void)nout;
    dup_mod_t *d = fsdp_module_impl(m);
    fsdp_tensor_t *buf = fsdp_module_buffer(m, "_buf"), *a = NULL, *b = NULL, *pp = NULL;
    int rc = fsdp_add(in[0], buf, &a);
    if (rc == 0) rc = fsdp_add(a, buf, &b);
    if (rc == 0) rc = fsdp_add(d->plain, d->plain, &pp);
    if (rc == 0) rc = fsdp_add(b, pp, &out[0]);
    fsdp_tensor_release(a), fsdp_tensor_release(b), fsdp_tensor_release(pp);
    return rc;
}

static void dup_destroy(void *impl) {
    dup_mod_t *d = impl;
    fsdp_tensor_release(d->plain);
    free(d);
}

static const fsdp_module_ops_t dup_ops = {"DuplicateModule", dup_forward, dup_destroy};

/* A tensor of n values start, start + 1, ... */
static int ramp(fsdp_ctx_t *ctx, int64_t n, float start, fsdp_mem_cat_t cat, fsdp_tensor_t **out) {
    float v[16];
    for (int64_t i = 0; i < n && i < 16; i++)
        v[i] = start + (float)i;
    return fsdp_tensor_from_host(ctx, FSDP_DTYPE_F32, 1, (const int64_t[]){n}, v, cat, out);
}

static int dup_create(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    dup_mod_t *d = calloc(1, sizeof *d);
    fsdp_tensor_t *buf = NULL;
    int rc = d ? ramp(ctx, 4, 0.5f, FSDP_MEM_OTHER, &d->plain) : FSDP_ENOMEM;
    if (rc == 0) rc = ramp(ctx, 4, -2.0f, FSDP_MEM_OTHER, &buf);
    if (rc == 0) rc = fsdp_module_create(ctx, &dup_ops, d, out);
    if (rc == 0) rc = fsdp_module_add_buffer(*out, "_buf", buf, true);
    if (rc < 0 && !*out && d) dup_destroy(d);
    fsdp_tensor_release(buf);
    return rc;
}

static int sp18_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_res_t *r = fu_res_of(arg, ctx);
    int rc = FSDP_OK;
    fsdp_module_t *local = NULL, *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *x = NULL, *yl = NULL, *y = NULL;
    fsdp_named_list_t l = {0};
    FU_TRY(out, "models", dup_create(ctx, &local));
    FU_TRY(out, "models", dup_create(ctx, &m));
    fsdp_tensor_t *plain = ((dup_mod_t *)fsdp_module_impl(m))->plain;
    fsdp_options_t o;
    fu_job_options(arg, &o);
    FU_TRY(out, "wrap", fsdp_wrap(m, &o, &root));
    FU_TRY(out, "input", ramp(ctx, 4, 10.0f, FSDP_MEM_OTHER, &x));
    FU_TRY(out, "local forward", fsdp_module_forward1(local, x, &yl));
    FU_TRY(out, "FSDP forward", fsdp_module_forward1(m, x, &y));
    fu_ck(r, fu_same_bits(y, yl) == 1, "x + buf + buf + (p + p) equals the local output",
          "differs");
    FU_TRY(out, "named params", fsdp_named_params(root, &l));
    fsdp_flat_sizes_t fs;
    fsdp_unit_flat_sizes(root, &fs);
    fu_ck(r, l.n == 0 && fs.unpadded_numel == 0,
          "neither the buffer nor the plain attribute is flattened",
          "%zu parameters, %lld flat elements", l.n, (long long)fs.unpadded_numel);
    fu_ck(r,
          fsdp_module_buffer(m, "_buf") != NULL &&
              ((dup_mod_t *)fsdp_module_impl(m))->plain == plain,
          "the buffer stays registered and the attribute is the same tensor", "changed");
out:
    fsdp_named_list_free(&l);
    fsdp_tensor_release(x), fsdp_tensor_release(yl), fsdp_tensor_release(y);
    fsdp_unit_destroy(root);
    fsdp_module_release(m), fsdp_module_release(local);
    return rc;
}

/* ---- DYN-SP-19: one buffer under two modules, doubled in place ---------------------------------
 */

static int bufmod_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                          fsdp_tensor_t **out) {
    (void)nin, (void)nout;
    return fsdp_add(in[0], fsdp_module_buffer(m, "_buf"), &out[0]);
}

static const fsdp_module_ops_t bufmod_ops = {"BufModule", bufmod_forward, NULL};

static int shared_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                          fsdp_tensor_t **out) {
    (void)nin, (void)nout;
    fsdp_tensor_t *buf = fsdp_module_buffer(m, "_buf"), *dbl = NULL, *a = NULL, *b = NULL;
    bool was = fsdp_set_grad_enabled(fsdp_module_ctx(m), false); /* buf.mul_(2) */
    int rc = fsdp_scale(buf, 2.0, &dbl);
    if (rc == 0) rc = fsdp_tensor_copy_(buf, dbl);
    fsdp_set_grad_enabled(fsdp_module_ctx(m), was);
    if (rc == 0) rc = fsdp_add(in[0], buf, &a);
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(m, "_buf_module"), a, &b);
    if (rc == 0) rc = fsdp_add(b, fsdp_module_param(m, "_param"), &out[0]);
    fsdp_tensor_release(dbl), fsdp_tensor_release(a), fsdp_tensor_release(b);
    return rc;
}

static const fsdp_module_ops_t shared_ops = {"SharedBufModel", shared_forward, NULL};

static int shared_create(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_module_t *m = NULL, *c = NULL;
    fsdp_tensor_t *buf = NULL, *p = NULL;
    int rc = ramp(ctx, 4, 1.0f, FSDP_MEM_OTHER, &buf);
    if (rc == 0) rc = ramp(ctx, 1, 0.25f, FSDP_MEM_PARAMS, &p);
    if (rc == 0) rc = fsdp_module_create(ctx, &shared_ops, NULL, &m);
    if (rc == 0) rc = fsdp_module_create(ctx, &bufmod_ops, NULL, &c);
    if (rc == 0) rc = fsdp_module_add_param(m, "_param", p);
    if (rc == 0) rc = fsdp_module_add_buffer(c, "_buf", buf, true);
    if (rc == 0) rc = fsdp_module_add_child(m, "_buf_module", c);
    if (rc == 0) rc = fsdp_module_add_buffer(m, "_buf", buf, true);
    fsdp_module_release(c), fsdp_tensor_release(buf), fsdp_tensor_release(p);
    if (rc < 0) {
        fsdp_module_release(m);
        return rc;
    }
    *out = m;
    return FSDP_OK;
}

static int sp19_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_res_t *r = fu_res_of(arg, ctx);
    int rc = FSDP_OK;
    fsdp_module_t *local = NULL, *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *x = NULL;
    fsdp_named_list_t sd = {0};
    FU_TRY(out, "models", shared_create(ctx, &local));
    FU_TRY(out, "models", shared_create(ctx, &m));
    fsdp_options_t o;
    fu_job_options(arg, &o);
    FU_TRY(out, "wrap", fsdp_wrap(m, &o, &root));
    FU_TRY(out, "input", ramp(ctx, 4, 3.0f, FSDP_MEM_OTHER, &x));
    int same = 0;
    for (int k = 0; k < 15; k++) {
        fsdp_tensor_t *yl = NULL, *y = NULL;
        rc = fsdp_module_forward1(local, x, &yl);
        if (rc == 0) rc = fsdp_module_forward1(m, x, &y);
        if (rc == 0 && fu_same_bits(y, yl) == 1) same++;
        fsdp_tensor_release(yl), fsdp_tensor_release(y);
        fsdp_tape_clear(ctx); /* the graph of a forward without backward is dropped */
        if (rc < 0) {
            fu_fatal(r, ctx, "forward", rc);
            goto out;
        }
    }
    fu_ck(r, same == 15, "15 forwards that double a shared buffer equal the local ones",
          "%d of 15 equal", same);
    fsdp_tensor_t *a = fsdp_module_buffer(m, "_buf"),
                  *b = fsdp_module_buffer(m, "_buf_module._buf");
    fu_ck(r, a && a == b && fsdp_tensor_data(a) == fsdp_tensor_data(b),
          "after wrapping the buffer is one tensor under both names", "two tensors");
    float v[4];
    fu_ck(r, a && fsdp_tensor_to_host(a, v, sizeof v) == 0 && v[0] == 32768.0f && v[3] == 131072.0f,
          "the in-place doublings all landed in it (1 * 2^15)", "%g", (double)v[0]);
    FU_TRY(out, "state dict", fsdp_module_state_dict(m, &sd));
    int hits = 0;
    for (size_t i = 0; i < sd.n; i++)
        if (strcmp(sd.names[i], "_buf") == 0 || strcmp(sd.names[i], "_buf_module._buf") == 0)
            hits += sd.tensors[i] && fsdp_tensor_data(sd.tensors[i]) == fsdp_tensor_data(a);
    fu_ck(r, hits == 2, "the state dict lists the shared buffer under both names", "%d of 2", hits);
out:
    fsdp_named_list_free(&sd);
    fsdp_tensor_release(x);
    fsdp_unit_destroy(root);
    fsdp_module_release(m), fsdp_module_release(local);
    return rc;
}

/* ---- DYN-MP-08: a forward that sets an attribute -----------------------------------------------
 */

typedef struct mutating {
    int state;
} mutating_t;

static int mutating_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                            fsdp_tensor_t **out) {
    (void)nin, (void)nout;
    mutating_t *mt = fsdp_module_impl(m);
    mt->state = 2; /* self.state = 2 */
    fsdp_tensor_t *y = NULL;
    int rc = fsdp_module_forward1(fsdp_module_child(m, "net"), in[0], &y);
    if (rc == 0) rc = fsdp_scale(y, (double)mt->state, &out[0]);
    fsdp_tensor_release(y);
    return rc;
}

static void mutating_destroy(void *impl) {
    free(impl);
}

static const fsdp_module_ops_t mutating_ops = {"MutatingModel", mutating_forward, mutating_destroy};

static int mutating_create(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_rng_init(fsdp_ctx_rng(ctx), 5, 0);
    mutating_t *mt = calloc(1, sizeof *mt);
    fsdp_module_t *net = NULL;
    int rc = mt ? fsdp_linear_create(ctx, 8, 8, true, &net) : FSDP_ENOMEM;
    if (mt) mt->state = 1;
    if (rc == 0) rc = fsdp_module_create(ctx, &mutating_ops, mt, out);
    if (rc == 0)
        rc = fsdp_module_add_child(*out, "net", net);
    else
        free(mt);
    fsdp_module_release(net);
    return rc;
}

static int mp08_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_res_t *r = fu_res_of(arg, ctx);
    int rc = FSDP_OK;
    fsdp_module_t *local = NULL, *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *x = NULL, *yn = NULL, *y2 = NULL, *y = NULL;
    FU_TRY(out, "models", mutating_create(ctx, &local));
    FU_TRY(out, "models", mutating_create(ctx, &m));
    fsdp_options_t o;
    fu_job_options(arg, &o);
    FU_TRY(out, "wrap", fu_wrap_types(m, &o, (const char *const[]){"Linear", NULL}, &root));
    FU_TRY(out, "input", ramp(ctx, 8, -1.0f, FSDP_MEM_OTHER, &x));
    FU_TRY(out, "net(x)", fsdp_module_forward1(fsdp_module_child(local, "net"), x, &yn));
    FU_TRY(out, "2 net(x)", fsdp_scale(yn, 2.0, &y2));
    int same = 0, roots = 0;
    for (int k = 0; k < 3; k++) {
        rc = fsdp_module_forward1(m, x, &y);
        if (rc == 0 && fu_same_bits(y, y2) == 1) same++;
        roots += fsdp_unit_is_root(root) &&
                 !fsdp_unit_is_root(fsdp_unit_of(fsdp_module_child(m, "net")));
        fsdp_tensor_release(y);
        y = NULL;
        fsdp_tape_clear(ctx);
        if (rc < 0) {
            fu_fatal(r, ctx, "forward", rc);
            goto out;
        }
    }
    fu_ck(r, ((mutating_t *)fsdp_module_impl(m))->state == 2,
          "the attribute set inside forward persists under FSDP", "state %d",
          ((mutating_t *)fsdp_module_impl(m))->state);
    fu_ck(r, same == 3, "the output is 2 * net(x) in each of 3 forwards", "%d of 3", same);
    fu_ck(r, roots == 3, "the root stays the root and the child a child (lazy init once)",
          "%d of 3", roots);
out:
    fsdp_tensor_release(x), fsdp_tensor_release(yn), fsdp_tensor_release(y2);
    fsdp_unit_destroy(root);
    fsdp_module_release(m), fsdp_module_release(local);
    return rc;
}

/* ---- DYN-FK-03: no parameters ------------------------------------------------------------------
 */

static int noparam_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                           fsdp_tensor_t **out) {
    (void)nin, (void)in, (void)nout;
    fsdp_ctx_t *ctx = fsdp_module_ctx(m);
    fsdp_tensor_t *a = NULL, *b = NULL;
    const int64_t n[1] = {3};
    int rc = fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 1, n, FSDP_MEM_OTHER, &a);
    if (rc == 0) rc = fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 1, n, FSDP_MEM_OTHER, &b);
    if (rc == 0) rc = fsdp_tensor_normal_(a, 0, 1);
    if (rc == 0) rc = fsdp_tensor_normal_(b, 0, 1);
    if (rc == 0) rc = fsdp_mul(a, b, &out[0]);
    fsdp_tensor_release(a), fsdp_tensor_release(b);
    return rc;
}

static const fsdp_module_ops_t noparam_ops = {"NoParams", noparam_forward, NULL};

static int fk03_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_res_t *r = fu_res_of(arg, ctx);
    int rc = FSDP_OK;
    fsdp_module_t *local = NULL, *md = NULL, *mf = NULL;
    fsdp_ddp_t *ddp = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *x = NULL, *yl = NULL, *yd = NULL, *yf = NULL;
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    FU_TRY(out, "models", fsdp_module_create(ctx, &noparam_ops, NULL, &local));
    FU_TRY(out, "models", fsdp_module_create(ctx, &noparam_ops, NULL, &md));
    FU_TRY(out, "models", fsdp_module_create(ctx, &noparam_ops, NULL, &mf));
    FU_TRY(out, "DDP", fsdp_ddp_create(md, pg, NULL, &ddp));
    fsdp_options_t o;
    fsdp_options_init(&o);
    o.use_orig_params = true;
    FU_TRY(out, "FSDP", fsdp_wrap(mf, &o, &root));
    FU_TRY(out, "input", ramp(ctx, 3, 0, FSDP_MEM_OTHER, &x));
    fsdp_pg_counters_t c0, c1;
    fsdp_pg_get_counters(pg, &c0);
    fsdp_rng_init(fsdp_ctx_rng(ctx), 9, 0);
    FU_TRY(out, "local", fsdp_module_forward1(local, x, &yl));
    fsdp_rng_init(fsdp_ctx_rng(ctx), 9, 0);
    FU_TRY(out, "DDP forward", fsdp_ddp_forward1(ddp, x, &yd));
    fsdp_rng_init(fsdp_ctx_rng(ctx), 9, 0);
    FU_TRY(out, "FSDP forward", fsdp_module_forward1(mf, x, &yf));
    fsdp_pg_get_counters(pg, &c1);
    fsdp_ddp_stats_t st;
    fsdp_ddp_get_stats(ddp, &st);
    fsdp_flat_sizes_t fs;
    fsdp_unit_flat_sizes(root, &fs);
    fu_ck(r, st.num_buckets == 0 && st.num_params == 0 && fs.padded_numel == 0,
          "no bucket and no flat parameter", "%zu buckets, %lld flat elements", st.num_buckets,
          (long long)fs.padded_numel);
    uint64_t bytes = 0;
    for (int k = 0; k < FSDP_COLL_COUNT; k++)
        bytes += c1.bytes[k] - c0.bytes[k];
    fu_ck(r, bytes == 0, "the forwards move no bytes", "%llu bytes", (unsigned long long)bytes);
    fu_ck(r, fu_same_bits(yd, yl) == 1 && fu_same_bits(yf, yl) == 1,
          "randn(3) * randn(3) under DDP and FSDP equals the local output", "differs");
out:
    fsdp_tensor_release(x), fsdp_tensor_release(yl), fsdp_tensor_release(yd);
    fsdp_tensor_release(yf);
    fsdp_ddp_destroy(ddp);
    fsdp_unit_destroy(root);
    fsdp_module_release(local), fsdp_module_release(md), fsdp_module_release(mf);
    return rc;
}

/* ---- DYN-MP-07 / DYN-MP-09: ToyModel forward parity, root only and a unit per Linear ----------
 */

typedef struct toy_job {
    fu_job_t j; /* first */
    bool per_linear;
} toy_job_t;

/* hidden 501: a flat parameter whose size no world size here divides, so shards are padded. */
#define TOY_HIDDEN 501

static int toy_rank(fsdp_ctx_t *ctx, void *arg) {
    toy_job_t *tj = arg;
    fu_res_t *r = fu_res_of(&tj->j, ctx);
    int rc = FSDP_OK;
    fsdp_module_t *local = NULL, *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *x = NULL, *yl = NULL, *y = NULL;
    FU_TRY(out, "models", tm_toy_create(ctx, TM_TOY_IN, TOY_HIDDEN, TM_TOY_OUT, &local));
    FU_TRY(out, "models", tm_toy_create(ctx, TM_TOY_IN, TOY_HIDDEN, TM_TOY_OUT, &m));
    fsdp_options_t o;
    fu_job_options(&tj->j, &o);
    if (tj->per_linear)
        FU_TRY(out, "wrap", fu_wrap_types(m, &o, (const char *const[]){"Linear", NULL}, &root));
    else
        FU_TRY(out, "wrap", fsdp_wrap(m, &o, &root));
    size_t nunits = 0;
    fsdp_unit_t **units = NULL;
    FU_TRY(out, "units", fsdp_units(root, &units, &nunits));
    free(units);
    fu_ck(r, nunits == (tj->per_linear ? 5u : 1u), "the units", "%zu", nunits);
    fsdp_rng_init(fsdp_ctx_rng(ctx), 20, 0);
    FU_TRY(out, "input",
           fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 2, (const int64_t[]){20, TM_TOY_IN},
                             FSDP_MEM_OTHER, &x));
    FU_TRY(out, "input", fsdp_tensor_normal_(x, 0, 1));
    int same = 0;
    for (int k = 0; k < 2; k++) {
        FU_TRY(out, "local", fsdp_module_forward1(local, x, &yl));
        FU_TRY(out, "FSDP", fsdp_module_forward1(m, x, &y));
        same += fu_same_bits(y, yl) == 1;
        fsdp_tensor_release(yl), fsdp_tensor_release(y);
        yl = y = NULL;
        fsdp_tape_clear(ctx);
    }
    fu_ck(r, same == 2, "the output equals the unwrapped model's bitwise, twice", "%d of 2", same);
out:
    fsdp_tensor_release(x), fsdp_tensor_release(yl), fsdp_tensor_release(y);
    fsdp_unit_destroy(root);
    fsdp_module_release(m), fsdp_module_release(local);
    return rc;
}

static void test_toy(void) {
    static const int worlds[] = {1, 2, 4};
    for (int k = 0; k < 2; k++)
        for (size_t i = 0; i < sizeof worlds / sizeof worlds[0]; i++) {
            toy_job_t tj;
            fu_job_init(&tj.j,
                        k ? "DYN-MP-07 DYN-MP-09 ToyModel, a unit per Linear"
                          : "DYN-MP-07 DYN-MP-09 ToyModel, one root unit",
                        worlds[i], FSDP_FULL_SHARD, true);
            tj.per_linear = k == 1;
            fu_run_job(&tj.j, toy_rank);
        }
}

/* ---- DYN-SP-08: batch sizes that change from call to call -------------------------------------
 */

#define FOO_N 30
#define FOO_D 50
#define FOO_K 70
#define FOO_OUT 64

/* Foo: linear1(flatten(linear0(x^T))) for x (B, N, D): linear0 N -> K on (B, D, N), then
 * (B, D * K) -> FOO_OUT. */
static int foo_forward(fsdp_module_t *m, int nin, fsdp_tensor_t *const *in, int nout,
                       fsdp_tensor_t **out) {
    (void)nin, (void)nout;
    fsdp_tensor_t *t = NULL, *a = NULL, *f = NULL;
    int64_t b = fsdp_tensor_shape(in[0])[0];
    int rc = fsdp_transpose(in[0], 1, 2, &t);
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(m, "linear0"), t, &a);
    if (rc == 0) rc = fsdp_reshape(a, 2, (const int64_t[]){b, FOO_D * FOO_K}, &f);
    if (rc == 0) rc = fsdp_module_forward1(fsdp_module_child(m, "linear1"), f, &out[0]);
    fsdp_tensor_release(t), fsdp_tensor_release(a), fsdp_tensor_release(f);
    return rc;
}

static const fsdp_module_ops_t foo_ops = {"Foo", foo_forward, NULL};

static int foo_create(fsdp_ctx_t *ctx, fsdp_module_t **out) {
    fsdp_rng_init(fsdp_ctx_rng(ctx), 8, 0);
    fsdp_module_t *m = NULL, *l0 = NULL, *l1 = NULL;
    int rc = fsdp_linear_create(ctx, FOO_N, FOO_K, true, &l0);
    if (rc == 0) rc = fsdp_linear_create(ctx, FOO_D * FOO_K, FOO_OUT, true, &l1);
    if (rc == 0) rc = fsdp_module_create(ctx, &foo_ops, NULL, &m);
    if (rc == 0) rc = fsdp_module_add_child(m, "linear0", l0);
    if (rc == 0) rc = fsdp_module_add_child(m, "linear1", l1);
    fsdp_module_release(l0), fsdp_module_release(l1);
    if (rc < 0) {
        fsdp_module_release(m);
        return rc;
    }
    *out = m;
    return FSDP_OK;
}

static int sp08_rank(fsdp_ctx_t *ctx, void *arg) {
    fu_res_t *r = fu_res_of(arg, ctx);
    int rc = FSDP_OK;
    fsdp_module_t *local = NULL, *md = NULL, *mf = NULL;
    fsdp_ddp_t *ddp = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_tensor_t *x = NULL, *yl = NULL, *yd = NULL, *yf = NULL;
    FU_TRY(out, "models", foo_create(ctx, &local));
    FU_TRY(out, "models", foo_create(ctx, &md));
    FU_TRY(out, "models", foo_create(ctx, &mf));
    FU_TRY(out, "DDP", fsdp_ddp_create(md, fsdp_ctx_pg(ctx), NULL, &ddp));
    fsdp_options_t o;
    fu_job_options(arg, &o);
    FU_TRY(out, "wrap", fu_wrap_types(mf, &o, (const char *const[]){"Linear", NULL}, &root));
    static const int64_t sizes[] = {100, 200, 300};
    for (int k = 0; k < 3; k++) {
        fsdp_rng_init(fsdp_ctx_rng(ctx), 30, (uint64_t)k);
        FU_TRY(out, "input",
               fsdp_tensor_empty(ctx, FSDP_DTYPE_F32, 3, (const int64_t[]){sizes[k], FOO_N, FOO_D},
                                 FSDP_MEM_OTHER, &x));
        FU_TRY(out, "input", fsdp_tensor_normal_(x, 0, 1));
        FU_TRY(out, "local", fsdp_module_forward1(local, x, &yl));
        FU_TRY(out, "DDP", fsdp_ddp_forward1(ddp, x, &yd));
        FU_TRY(out, "FSDP", fsdp_module_forward1(mf, x, &yf));
        fu_ck(r, fu_same_bits(yd, yl) == 1 && fu_same_bits(yf, yl) == 1,
              sizes[k] == 100   ? "batch 100: DDP and FSDP give the local output bitwise"
              : sizes[k] == 200 ? "batch 200 on the same wrappers: the local output bitwise"
                                : "batch 300 on the same wrappers: the local output bitwise",
              "differs");
        fsdp_tensor_release(x), fsdp_tensor_release(yl), fsdp_tensor_release(yd);
        fsdp_tensor_release(yf);
        x = yl = yd = yf = NULL;
        fsdp_tape_clear(ctx);
    }
out:
    fsdp_tensor_release(x), fsdp_tensor_release(yl), fsdp_tensor_release(yd);
    fsdp_tensor_release(yf);
    fsdp_ddp_destroy(ddp);
    fsdp_unit_destroy(root);
    fsdp_module_release(local), fsdp_module_release(md), fsdp_module_release(mf);
    return rc;
}

int main(void) {
    tap_plan_lazy();
    fu_run("DYN-SP-18 FSDP", W, FSDP_FULL_SHARD, true, sp18_rank);
    fu_run("DYN-SP-19 FSDP", W, FSDP_FULL_SHARD, true, sp19_rank);
    fu_run("DYN-MP-08 FSDP", W, FSDP_FULL_SHARD, true, mp08_rank);
    fu_run("DYN-FK-03", W, FSDP_FULL_SHARD, true, fk03_rank);
    test_toy();
    fu_run("DYN-SP-08 DDP and FSDP", W, FSDP_FULL_SHARD, true, sp08_rank);
    return tap_done();
}
