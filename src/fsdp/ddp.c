/*
 * ddp.c: DistributedDataParallel, the reference the FSDP parity tests compare against. The
 * semantics (buckets, rounding, unused parameters, no_sync, buffers) are in fsdp/ddp.h.
 *
 * State of one synced backward ("a round"): `armed` is set by a forward run with sync and grad
 * mode on; the first grad hook (or the wrapper's tape mark) of the next backward queues the
 * final callback (`cb_queued`); hooks mark parameters ready and launch buckets in order
 * (buckets [0, next_launch) are launched); the final callback launches the rest, all-reduces
 * the used flags, waits, writes the averages into .grad and ends the round.
 *
 * Invariants:
 *   - A launched bucket's flat buffer (and the used-flag buffer once launched) belongs to its
 *     all-reduce until the work has been waited for; nothing reads or writes it meanwhile.
 *   - params[] is in reverse registration order (the bucketing order); each bucket's idx[] is
 *     increasing, so a flat buffer holds its parameters in that order.
 *   - refs counts the owner's reference plus one per tape mark whose arg is the wrapper, so a
 *     mark left on a tape never sees freed memory; fsdp_ddp_destroy() frees the contents at
 *     once and the struct itself when the last reference goes.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/autograd.h>
#include <fsdp/ddp.h>

#include "internal.h"
#include "tensor/tensor_impl.h"

struct ddp_param {
    fsdp_ddp_t *d;
    fsdp_tensor_t *t; /* retained */
    char *name;       /* fully qualified name */
    size_t bucket;
    int64_t offset;      /* first element in the bucket's flat buffer */
    fsdp_tensor_t *view; /* of the flat buffer, shaped like t; NULL at world size 1 */
    bool hooked;
    bool ready; /* its hook fired in this round */
    bool used;  /* it got a gradient since the last synced backward */
};

struct ddp_bucket {
    fsdp_dtype_t dt;
    size_t n;
    size_t *idx; /* n indices into params, increasing */
    int64_t numel;
    size_t bytes;
    size_t nready;
    fsdp_tensor_t *flat; /* numel elements, FSDP_MEM_COMM; NULL at world size 1 */
    fsdp_work_t *work;   /* outstanding all-reduce, or NULL */
};

struct fsdp_ddp {
    int refs;
    bool alive;
    fsdp_ctx_t *ctx;
    fsdp_module_t *m;
    fsdp_pg_t *pg; /* NULL for a world of one without a group */
    int rank, world;
    fsdp_ddp_options_t opt;
    bool sync;
    bool require_forward_param_sync; /* PyTorch's flag: broadcast buffers before the forward */
    bool armed;
    bool cb_queued;
    size_t nparams;
    struct ddp_param *params;
    size_t nbuckets;
    struct ddp_bucket *buckets;
    size_t next_launch;
    fsdp_tensor_t *used_flags; /* i32 (nparams) on the parameters' device; world > 1 */
    int32_t *used_host;        /* nparams */
    fsdp_work_t *used_work;
    /* This round's counts, and the totals reported by fsdp_ddp_get_stats. */
    uint64_t calls, bytes, early;
    fsdp_ddp_stats_t stats;
};

static const char *pname(const struct ddp_param *p) {
    return p->name ? p->name : "?";
}

/* ---- options --------------------------------------------------------------------------------- */

void fsdp_ddp_options_init(fsdp_ddp_options_t *o) {
    if (!o) return;
    memset(o, 0, sizeof *o);
    o->bucket_cap_bytes = FSDP_DDP_DEFAULT_BUCKET_CAP_BYTES;
    o->broadcast_buffers = true;
    o->sync_module_states = true;
    o->dummy = false;
}

/* ---- collectives on host data ---------------------------------------------------------------- */

/* Blocking all-gather of n int64 per rank through device tensors (NCCL needs device memory):
 * out receives world * n values. */
static int gather_i64(fsdp_ddp_t *d, const int64_t *in, size_t n, int64_t *out) {
    fsdp_tensor_t *s = NULL, *r = NULL;
    int rc;
    int64_t ns = (int64_t)n, nr = (int64_t)n * d->world;
    FSDP_TRY(rc, out, fsdp_tensor_from_host(d->ctx, FSDP_DTYPE_I64, 1, &ns, in, FSDP_MEM_COMM, &s));
    FSDP_TRY(rc, out, fsdp_tensor_empty(d->ctx, FSDP_DTYPE_I64, 1, &nr, FSDP_MEM_COMM, &r));
    rc = fsdp_pg_all_gather(d->pg, fsdp_tensor_data(s), fsdp_tensor_data(r), n, FSDP_DTYPE_I64,
                            NULL);
    if (rc < 0) {
        fsdp__ctx_err(d->ctx, rc,
                      "fsdp_ddp_create (rank %d): all-gather of the model description failed: %s",
                      d->rank, fsdp_pg_last_error(d->pg));
        goto out;
    }
    rc = fsdp_tensor_to_host(r, out, (size_t)nr * sizeof(int64_t));
out:
    fsdp_tensor_release(s);
    fsdp_tensor_release(r);
    return rc;
}

/* Broadcasts t's values from rank 0 in place (through a contiguous copy when t is not
 * contiguous). what ("parameter", "buffer") and the name go into the error message. */
static int bcast_tensor(fsdp_ddp_t *d, fsdp_tensor_t *t, const char *what, const char *name) {
    fsdp_tensor_t *c = NULL;
    int64_t n = fsdp_tensor_numel(t);
    int rc = FSDP_OK;
    char desc[160];
    if (n == 0) return FSDP_OK;
    if (fsdp_tensor_is_contiguous(t) && fsdp_tensor_data(t)) {
        rc = fsdp_pg_broadcast(d->pg, fsdp_tensor_data(t), fsdp_tensor_data(t), (size_t)n,
                               fsdp_tensor_dtype(t), 0, NULL);
    } else {
        FSDP_TRY(rc, fail, fsdp_tensor_clone(t, FSDP_MEM_COMM, &c));
        rc = fsdp_pg_broadcast(d->pg, fsdp_tensor_data(c), fsdp_tensor_data(c), (size_t)n,
                               fsdp_tensor_dtype(c), 0, NULL);
        if (rc == 0) rc = fsdp_tensor_copy_(t, c);
    }
    if (rc < 0) goto fail;
    fsdp_tensor_release(c);
    return FSDP_OK;
fail:
    fsdp_tensor_release(c);
    return fsdp__ctx_err(
        d->ctx, rc, "DDP (rank %d): broadcast of %s '%s' %s from rank 0 failed: %s", d->rank, what,
        name, fsdp_tensor_describe(t, desc, sizeof desc), d->pg ? fsdp_pg_last_error(d->pg) : "");
}

static int bcast_list(fsdp_ddp_t *d, const fsdp_named_list_t *l, const char *what) {
    for (size_t i = 0; i < l->n; i++) {
        int rc = bcast_tensor(d, l->tensors[i], what, l->names[i]);
        if (rc < 0) return rc;
    }
    return FSDP_OK;
}

/* ---- creation checks ------------------------------------------------------------------------- */

/* Per tensor: kind, requires_grad, dtype, ndim, name hash, shape[FSDP_MAX_DIMS]. */
#define META_LEN (5 + FSDP_MAX_DIMS)

static int64_t name_hash(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; s && *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return (int64_t)(h >> 1);
}

static void describe_meta(const int64_t *m, char *buf, size_t len) {
    char shape[160];
    snprintf(buf, len, "%s%s (requires_grad %d)", fsdp_dtype_name((fsdp_dtype_t)m[2]),
             fsdp__shape_str((int)m[3], m + 5, shape, sizeof shape), (int)m[1]);
}

/* PyTorch's _verify_param_shape_across_processes: every rank must hold the same parameters and
 * buffers (count, dtype, shape, requires_grad, name). Each rank compares every rank with rank 0
 * on the same gathered data, so all ranks fail alike, with the same message. */
static int verify_model(fsdp_ddp_t *d, const fsdp_named_list_t *ps, const fsdp_named_list_t *bs) {
    int64_t cnt[2] = {(int64_t)ps->n, (int64_t)bs->n};
    int64_t *all = NULL, *meta = NULL, *gathered = NULL;
    size_t n = ps->n + bs->n;
    int rc;
    all = malloc(sizeof(int64_t) * 2 * (size_t)d->world);
    if (!all) goto oom;
    FSDP_TRY(rc, out, gather_i64(d, cnt, 2, all));
    for (int r = 1; r < d->world; r++) {
        if (all[2 * r] != all[0] || all[2 * r + 1] != all[1]) {
            rc = fsdp__ctx_err(d->ctx, FSDP_EINVAL,
                               "fsdp_ddp_create (rank %d): rank %d has %lld parameters and %lld "
                               "buffers, rank 0 has %lld and %lld; DDP needs the same model on "
                               "every rank",
                               d->rank, r, (long long)all[2 * r], (long long)all[2 * r + 1],
                               (long long)all[0], (long long)all[1]);
            goto out;
        }
    }
    if (n == 0) {
        rc = FSDP_OK;
        goto out;
    }
    meta = calloc(n * META_LEN, sizeof *meta);
    gathered = malloc(sizeof *gathered * n * META_LEN * (size_t)d->world);
    if (!meta || !gathered) goto oom;
    for (size_t i = 0; i < n; i++) {
        bool is_param = i < ps->n;
        fsdp_tensor_t *t = is_param ? ps->tensors[i] : bs->tensors[i - ps->n];
        const char *nm = is_param ? ps->names[i] : bs->names[i - ps->n];
        int64_t *m = meta + i * META_LEN;
        m[0] = is_param;
        m[1] = fsdp_tensor_requires_grad(t);
        m[2] = fsdp_tensor_dtype(t);
        m[3] = fsdp_tensor_ndim(t);
        m[4] = name_hash(nm);
        memcpy(m + 5, fsdp_tensor_shape(t), sizeof(int64_t) * (size_t)m[3]);
    }
    FSDP_TRY(rc, out, gather_i64(d, meta, n * META_LEN, gathered));
    for (int r = 1; r < d->world; r++) {
        for (size_t i = 0; i < n; i++) {
            const int64_t *m0 = gathered + i * META_LEN;
            const int64_t *mr = gathered + ((size_t)r * n + i) * META_LEN;
            if (memcmp(m0, mr, sizeof(int64_t) * META_LEN) == 0) continue;
            bool is_param = i < ps->n;
            const char *nm = is_param ? ps->names[i] : bs->names[i - ps->n];
            const char *what = is_param ? "parameter" : "buffer";
            if (m0[4] != mr[4]) {
                rc = fsdp__ctx_err(d->ctx, FSDP_EINVAL,
                                   "fsdp_ddp_create (rank %d): %s %zu is named differently on "
                                   "rank %d and rank 0 (this rank calls it '%s'); DDP needs the "
                                   "same model on every rank",
                                   d->rank, what, is_param ? i : i - ps->n, r, nm);
            } else {
                char a[200], b[200];
                describe_meta(m0, a, sizeof a);
                describe_meta(mr, b, sizeof b);
                rc = fsdp__ctx_err(d->ctx, FSDP_EINVAL,
                                   "fsdp_ddp_create (rank %d): %s '%s' differs across ranks: "
                                   "rank 0 has %s, rank %d has %s; DDP needs the same model on "
                                   "every rank",
                                   d->rank, what, nm, a, r, b);
            }
            goto out;
        }
    }
    rc = FSDP_OK;
out:
    free(all);
    free(meta);
    free(gathered);
    return rc;
oom:
    rc = fsdp__ctx_err(d->ctx, FSDP_ENOMEM, "fsdp_ddp_create: out of memory");
    goto out;
}

/* ---- buckets --------------------------------------------------------------------------------- */

static int bucket_append(fsdp_ddp_t *d, size_t b, size_t i) {
    struct ddp_bucket *bk = &d->buckets[b];
    size_t *ni = realloc(bk->idx, sizeof *ni * (bk->n + 1));
    if (!ni) return fsdp__ctx_err(d->ctx, FSDP_ENOMEM, "fsdp_ddp_create: out of memory");
    bk->idx = ni;
    bk->idx[bk->n++] = i;
    struct ddp_param *p = &d->params[i];
    int64_t numel = fsdp_tensor_numel(p->t);
    p->bucket = b;
    p->offset = bk->numel;
    bk->numel += numel;
    bk->bytes += (size_t)numel * fsdp_dtype_size(bk->dt);
    return FSDP_OK;
}

/* Greedy packing in params[] order (reverse registration order), one open bucket per dtype; a
 * bucket is closed when the next parameter of its dtype would overflow it, or when it is full.
 * Buckets are created in order of their first parameter, which is PyTorch's final order. */
static int build_buckets(fsdp_ddp_t *d) {
    long open[FSDP_DTYPE_COUNT];
    size_t cap = d->opt.bucket_cap_bytes;
    for (int k = 0; k < FSDP_DTYPE_COUNT; k++)
        open[k] = -1;
    d->buckets = calloc(d->nparams > 0 ? d->nparams : 1, sizeof *d->buckets);
    if (!d->buckets) return fsdp__ctx_err(d->ctx, FSDP_ENOMEM, "fsdp_ddp_create: out of memory");
    for (size_t i = 0; i < d->nparams; i++) {
        fsdp_dtype_t dt = fsdp_tensor_dtype(d->params[i].t);
        size_t pb = (size_t)fsdp_tensor_numel(d->params[i].t) * fsdp_dtype_size(dt);
        long b = open[dt];
        if (b >= 0 && d->buckets[b].bytes + pb > cap) b = -1;
        if (b < 0) {
            b = (long)d->nbuckets++;
            d->buckets[b].dt = dt;
        }
        int rc = bucket_append(d, (size_t)b, i);
        if (rc < 0) return rc;
        open[dt] = d->buckets[b].bytes >= cap ? -1 : b;
    }
    return FSDP_OK;
}

/* Flat buffers on the parameters' device, one view per parameter, and the used flags. */
static int alloc_buffers(fsdp_ddp_t *d) {
    fsdp_device_t *dev = fsdp_tensor_device(d->params[0].t);
    int rc;
    for (size_t b = 0; b < d->nbuckets; b++) {
        struct ddp_bucket *bk = &d->buckets[b];
        FSDP_TRY(rc, fail,
                 fsdp__tensor_new(d->ctx, dev, bk->dt, 1, &bk->numel, FSDP_MEM_COMM, &bk->flat));
        for (size_t j = 0; j < bk->n; j++) {
            struct ddp_param *p = &d->params[bk->idx[j]];
            FSDP_TRY(rc, fail,
                     fsdp_tensor_view_of(bk->flat, p->offset, fsdp_tensor_ndim(p->t),
                                         fsdp_tensor_shape(p->t), &p->view));
        }
    }
    int64_t n = (int64_t)d->nparams;
    FSDP_TRY(rc, fail,
             fsdp__tensor_new(d->ctx, dev, FSDP_DTYPE_I32, 1, &n, FSDP_MEM_COMM, &d->used_flags));
    d->used_host = calloc(d->nparams, sizeof *d->used_host);
    if (!d->used_host) rc = fsdp__ctx_err(d->ctx, FSDP_ENOMEM, "fsdp_ddp_create: out of memory");
fail:
    return rc;
}

/* ---- one round ------------------------------------------------------------------------------- */

static int wait_all(fsdp_ddp_t *d);

/* Copies bucket b's contributions into its flat buffer and launches its all-reduce. A launch
 * refused because an earlier all-reduce already failed (the group's failure is sticky) reports
 * that earlier failure, the root cause, instead. */
static int launch(fsdp_ddp_t *d, size_t b) {
    struct ddp_bucket *bk = &d->buckets[b];
    double inv = 1.0 / (double)d->world;
    int rc = FSDP_OK;
    for (size_t j = 0; j < bk->n && rc == 0; j++) {
        struct ddp_param *p = &d->params[bk->idx[j]];
        fsdp_tensor_t *g = fsdp_tensor_grad(p->t), *scaled = NULL;
        if (p->used && g) {
            rc = fsdp_scale(g, inv, &scaled);
            if (rc == 0) rc = fsdp_tensor_copy_(p->view, scaled);
            fsdp_tensor_release(scaled);
        } else {
            rc = fsdp_tensor_zero_(p->view);
        }
        if (rc < 0)
            return fsdp__ctx_err(d->ctx, rc,
                                 "DDP (rank %d): copying the gradient of '%s' into bucket %zu "
                                 "failed: %s",
                                 d->rank, pname(p), b, fsdp_ctx_last_error(d->ctx));
    }
    if (bk->numel > 0) {
        rc = fsdp_pg_all_reduce(d->pg, fsdp_tensor_data(bk->flat), fsdp_tensor_data(bk->flat),
                                (size_t)bk->numel, bk->dt, FSDP_REDOP_SUM, &bk->work);
        if (rc < 0) {
            fsdp__ctx_err(d->ctx, rc,
                          "DDP (rank %d): launching the all-reduce of bucket %zu (%zu parameters "
                          "from '%s', %lld %s elements) failed: %s",
                          d->rank, b, bk->n, pname(&d->params[bk->idx[0]]), (long long)bk->numel,
                          fsdp_dtype_name(bk->dt), fsdp_pg_last_error(d->pg));
            int earlier = wait_all(d);
            return earlier < 0 ? earlier : rc;
        }
        d->calls++;
        d->bytes += bk->bytes;
    }
    return FSDP_OK;
}

/* Launches buckets in order while the next one is complete. */
static int launch_ready(fsdp_ddp_t *d) {
    while (d->next_launch < d->nbuckets &&
           d->buckets[d->next_launch].nready == d->buckets[d->next_launch].n) {
        int rc = launch(d, d->next_launch);
        d->next_launch++;
        if (rc < 0) return rc;
        d->early++;
    }
    return FSDP_OK;
}

/* Waits for every outstanding work of the round; returns the first failure (with its message on
 * the context) after waiting for all of them, so no buffer stays borrowed. */
static int wait_all(fsdp_ddp_t *d) {
    int first = FSDP_OK;
    for (size_t b = 0; b < d->nbuckets; b++) {
        struct ddp_bucket *bk = &d->buckets[b];
        if (!bk->work) continue;
        int rc = fsdp_work_wait(bk->work, -1);
        if (rc < 0 && first == 0)
            first = fsdp__ctx_err(d->ctx, rc,
                                  "DDP (rank %d): the all-reduce of bucket %zu (%zu parameters "
                                  "from '%s', %zu bytes) failed: %s",
                                  d->rank, b, bk->n, pname(&d->params[bk->idx[0]]), bk->bytes,
                                  fsdp_work_error(bk->work));
        fsdp_work_release(bk->work);
        bk->work = NULL;
    }
    if (d->used_work) {
        int rc = fsdp_work_wait(d->used_work, -1);
        if (rc < 0 && first == 0)
            first = fsdp__ctx_err(d->ctx, rc,
                                  "DDP (rank %d): the all-reduce of the used-parameter flags "
                                  "(%zu) failed: %s",
                                  d->rank, d->nparams, fsdp_work_error(d->used_work));
        fsdp_work_release(d->used_work);
        d->used_work = NULL;
    }
    return first;
}

/* Ends a round: ready marks and launches are forgotten. With clear_used, so are the used
 * flags (after a synced backward). */
static void end_round(fsdp_ddp_t *d, bool clear_used) {
    for (size_t i = 0; i < d->nparams; i++) {
        d->params[i].ready = false;
        if (clear_used) d->params[i].used = false;
    }
    for (size_t b = 0; b < d->nbuckets; b++)
        d->buckets[b].nready = 0;
    d->next_launch = 0;
    d->armed = false;
    d->cb_queued = false;
}

/* Writes the reduced values back into .grad of every parameter used on some rank. */
static int write_back(fsdp_ddp_t *d, size_t *unused) {
    int rc = fsdp_tensor_to_host(d->used_flags, d->used_host, d->nparams * sizeof(int32_t));
    if (rc < 0) return rc;
    for (size_t i = 0; i < d->nparams; i++) {
        struct ddp_param *p = &d->params[i];
        if (d->used_host[i] == 0) {
            (*unused)++;
            continue;
        }
        fsdp_tensor_t *g = fsdp_tensor_grad(p->t);
        if (g) {
            rc = fsdp_tensor_copy_(g, p->view);
        } else {
            fsdp_tensor_t *c = NULL;
            rc = fsdp_tensor_clone(p->view, FSDP_MEM_GRADS, &c);
            if (rc == 0) rc = fsdp_tensor_set_grad(p->t, c);
            fsdp_tensor_release(c);
        }
        if (rc < 0)
            return fsdp__ctx_err(d->ctx, rc,
                                 "DDP (rank %d): writing the averaged gradient of '%s' failed: "
                                 "%s",
                                 d->rank, pname(p), fsdp_ctx_last_error(d->ctx));
    }
    return FSDP_OK;
}

/* The final callback of a synced backward. */
static int final_cb(fsdp_ctx_t *ctx, void *arg) {
    fsdp_ddp_t *d = arg;
    int rc = FSDP_OK;
    size_t unused = 0;
    (void)ctx;
    if (!d->alive || !d->armed) {
        d->cb_queued = false;
        return FSDP_OK;
    }
    if (d->world > 1 && d->nparams > 0) {
        while (d->next_launch < d->nbuckets && rc == 0)
            rc = launch(d, d->next_launch++);
        if (rc == 0) {
            for (size_t i = 0; i < d->nparams; i++)
                d->used_host[i] = d->params[i].used;
            rc = fsdp_tensor_copy_from_host(d->used_flags, d->used_host,
                                            d->nparams * sizeof(int32_t));
        }
        if (rc == 0) {
            rc = fsdp_pg_all_reduce(d->pg, fsdp_tensor_data(d->used_flags),
                                    fsdp_tensor_data(d->used_flags), d->nparams, FSDP_DTYPE_I32,
                                    FSDP_REDOP_SUM, &d->used_work);
            if (rc < 0)
                fsdp__ctx_err(d->ctx, rc,
                              "DDP (rank %d): launching the all-reduce of the used-parameter "
                              "flags failed: %s",
                              d->rank, fsdp_pg_last_error(d->pg));
            else {
                d->calls++;
                d->bytes += d->nparams * sizeof(int32_t);
            }
        }
        int wrc = wait_all(d);
        if (rc == 0) rc = wrc;
        if (rc == 0) rc = write_back(d, &unused);
    } else {
        for (size_t i = 0; i < d->nparams; i++)
            unused += !d->params[i].used;
    }
    if (rc == 0) {
        d->stats.synced_backwards++;
        d->stats.last_allreduce_calls = d->calls;
        d->stats.last_allreduce_bytes = d->bytes;
        d->stats.last_early_launches = d->early;
        d->stats.last_unused_params = unused;
    }
    d->calls = d->bytes = d->early = 0;
    end_round(d, true);
    return rc;
}

static int queue_final(fsdp_ddp_t *d) {
    if (d->cb_queued) return FSDP_OK;
    int rc = fsdp_queue_callback(d->ctx, final_cb, d);
    if (rc < 0) return rc;
    d->cb_queued = true;
    return FSDP_OK;
}

static int grad_hook(fsdp_tensor_t *leaf, void *arg) {
    struct ddp_param *p = arg;
    fsdp_ddp_t *d = p->d;
    int rc;
    (void)leaf;
    p->used = true;
    if (!d->armed) return FSDP_OK; /* no_sync: accumulate locally */
    FSDP_TRY(rc, out, queue_final(d));
    if (p->ready) {
        /* A second hook in one backward (the parameter is used in several recompute regions):
         * the gradient grew after it was marked ready, which is fine until the bucket left. */
        if (d->world > 1 && p->bucket < d->next_launch)
            return fsdp__ctx_err(d->ctx, FSDP_EINVAL,
                                 "DDP (rank %d): parameter '%s' received more gradient after its "
                                 "bucket %zu was all-reduced (is it used in several "
                                 "checkpointed regions?)",
                                 d->rank, pname(p), p->bucket);
        return FSDP_OK;
    }
    p->ready = true;
    d->buckets[p->bucket].nready++;
    if (d->world > 1) rc = launch_ready(d);
out:
    return rc;
}

/* The tape mark a synced forward leaves: queues the final callback even when no parameter gets
 * a gradient on this rank, so the rank still joins the round's collectives. */
static int mark_fn(fsdp_ctx_t *ctx, void *arg, bool has_grad) {
    fsdp_ddp_t *d = arg;
    (void)ctx;
    (void)has_grad;
    if (!d->alive || !d->armed) return FSDP_OK;
    return queue_final(d);
}

static void ddp_unref(fsdp_ddp_t *d) {
    if (--d->refs == 0) free(d);
}

static void mark_free(void *arg) {
    ddp_unref(arg);
}

/* A round that never reached its final callback (a backward that failed, or a graph dropped
 * after its hooks ran): wait for its works and forget it. */
static void drop_stale_round(fsdp_ddp_t *d) {
    if (!d->cb_queued) return;
    (void)wait_all(d);
    d->calls = d->bytes = d->early = 0;
    end_round(d, false);
}

/* ---- public API ------------------------------------------------------------------------------ */

static void free_contents(fsdp_ddp_t *d) {
    (void)wait_all(d);
    for (size_t i = 0; i < d->nparams; i++) {
        struct ddp_param *p = &d->params[i];
        if (p->hooked && p->t) fsdp_tensor_remove_grad_hook(p->t, grad_hook, p);
        fsdp_tensor_release(p->view);
        fsdp_tensor_release(p->t);
        free(p->name);
    }
    free(d->params);
    d->params = NULL;
    d->nparams = 0;
    for (size_t b = 0; b < d->nbuckets; b++) {
        fsdp_tensor_release(d->buckets[b].flat);
        free(d->buckets[b].idx);
    }
    free(d->buckets);
    d->buckets = NULL;
    d->nbuckets = 0;
    fsdp_tensor_release(d->used_flags);
    d->used_flags = NULL;
    free(d->used_host);
    d->used_host = NULL;
    fsdp_module_release(d->m);
    d->m = NULL;
}

void fsdp_ddp_destroy(fsdp_ddp_t *d) {
    if (!d || !d->alive) return;
    free_contents(d);
    d->alive = false;
    ddp_unref(d);
}

static bool has_ddp_hook(const fsdp_tensor_t *t) { return fsdp_tensor_has_grad_hook(t, grad_hook); }

int fsdp_ddp_create(fsdp_module_t *m, fsdp_pg_t *pg, const fsdp_ddp_options_t *o,
                    fsdp_ddp_t **out) {
    fsdp_ctx_t *ctx = m ? fsdp_module_ctx(m) : NULL;
    fsdp_named_list_t ps = {0}, bs = {0};
    fsdp_ddp_t *d = NULL;
    int rc;
    if (out) *out = NULL;
    if (!m || !out)
        return fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_ddp_create: %s is NULL",
                             !m ? "the module" : "out");
    d = calloc(1, sizeof *d);
    if (!d) return fsdp__ctx_err(ctx, FSDP_ENOMEM, "fsdp_ddp_create: out of memory");
    d->refs = 1;
    d->alive = true;
    d->ctx = ctx;
    d->sync = true;
    d->require_forward_param_sync = true;
    if (o)
        d->opt = *o;
    else
        fsdp_ddp_options_init(&d->opt);
    if (d->opt.bucket_cap_bytes == 0) {
        rc = fsdp__ctx_err(ctx, FSDP_EINVAL, "fsdp_ddp_create: bucket_cap_bytes must be > 0");
        goto fail;
    }
    if (!pg && !d->opt.dummy) pg = fsdp_ctx_pg(ctx);
    d->pg = pg;
    d->rank = pg ? fsdp_pg_rank(pg) : 0;
    d->world = pg ? fsdp_pg_size(pg) : 1;
    d->m = fsdp_module_retain(m);
    if (d->opt.dummy) goto done;

    FSDP_TRY(rc, fail, fsdp_module_named_params(m, false, &ps));
    FSDP_TRY(rc, fail, fsdp_module_named_buffers(m, false, &bs));
    size_t ntrain = 0;
    for (size_t i = 0; i < ps.n; i++) {
        fsdp_tensor_t *t = ps.tensors[i];
        if (!fsdp_tensor_requires_grad(t)) continue;
        if (has_ddp_hook(t)) {
            rc = fsdp__ctx_err(ctx, FSDP_EINVAL,
                               "fsdp_ddp_create (rank %d): parameter '%s' is already bucketed by "
                               "another DDP wrapper; destroy that one first",
                               d->rank, ps.names[i]);
            goto fail;
        }
        if (fsdp_tensor_device(t) != fsdp_tensor_device(ps.tensors[0])) {
            rc = fsdp__ctx_err(ctx, FSDP_EINVAL,
                               "fsdp_ddp_create (rank %d): parameter '%s' is on %s but '%s' is on "
                               "%s; DDP needs every parameter on one device",
                               d->rank, ps.names[i], fsdp_device_name(fsdp_tensor_device(t)),
                               ps.names[0], fsdp_device_name(fsdp_tensor_device(ps.tensors[0])));
            goto fail;
        }
        ntrain++;
    }
    if (d->world > 1) {
        FSDP_TRY(rc, fail, verify_model(d, &ps, &bs));
        if (d->opt.sync_module_states) {
            FSDP_TRY(rc, fail, bcast_list(d, &ps, "parameter"));
            FSDP_TRY(rc, fail, bcast_list(d, &bs, "buffer"));
        }
    }
    d->params = calloc(ntrain > 0 ? ntrain : 1, sizeof *d->params);
    if (!d->params) {
        rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "fsdp_ddp_create: out of memory");
        goto fail;
    }
    for (size_t i = ps.n; i-- > 0;) {
        fsdp_tensor_t *t = ps.tensors[i];
        if (!fsdp_tensor_requires_grad(t)) continue;
        struct ddp_param *p = &d->params[d->nparams++];
        p->d = d;
        p->t = fsdp_tensor_retain(t);
        p->name = strdup(ps.names[i]);
        if (!p->name) {
            rc = fsdp__ctx_err(ctx, FSDP_ENOMEM, "fsdp_ddp_create: out of memory");
            goto fail;
        }
    }
    FSDP_TRY(rc, fail, build_buckets(d));
    if (d->world > 1 && d->nparams > 0) FSDP_TRY(rc, fail, alloc_buffers(d));
    for (size_t i = 0; i < d->nparams; i++) {
        FSDP_TRY(rc, fail, fsdp_tensor_add_grad_hook(d->params[i].t, grad_hook, &d->params[i]));
        d->params[i].hooked = true;
    }
    for (size_t b = 0; b < d->nbuckets; b++)
        d->stats.bucket_bytes += d->buckets[b].bytes;
done:
    d->stats.num_params = d->nparams;
    d->stats.num_buckets = d->nbuckets;
    fsdp_named_list_free(&ps);
    fsdp_named_list_free(&bs);
    *out = d;
    return FSDP_OK;
fail:
    fsdp_named_list_free(&ps);
    fsdp_named_list_free(&bs);
    free_contents(d);
    free(d);
    return rc;
}

int fsdp_ddp_forward(fsdp_ddp_t *d, int nin, fsdp_tensor_t *const *in, int nout,
                     fsdp_tensor_t **out) {
    if (!d || !d->alive)
        return fsdp__ctx_err(d ? d->ctx : NULL, FSDP_EINVAL,
                             "fsdp_ddp_forward: the wrapper is NULL or destroyed");
    fsdp_ctx_t *ctx = d->ctx;
    int rc;
    if (!d->opt.dummy && !fsdp_in_backward(ctx)) {
        drop_stale_round(d);
        if (d->world > 1 && d->opt.broadcast_buffers && d->require_forward_param_sync) {
            fsdp_named_list_t bs = {0};
            rc = fsdp_module_named_buffers(d->m, false, &bs);
            if (rc == 0) rc = bcast_list(d, &bs, "buffer");
            fsdp_named_list_free(&bs);
            if (rc < 0) return rc;
        }
        if (d->sync && fsdp_is_grad_enabled(ctx)) {
            d->refs++; /* the mark's reference; mark_free drops it, even on failure */
            FSDP_TRY(rc, fail, fsdp_tape_mark(ctx, "DDP", 0, NULL, mark_fn, d, mark_free));
            d->armed = true;
            d->require_forward_param_sync = true;
        } else {
            d->require_forward_param_sync = false;
        }
    }
    return fsdp_module_forward(d->m, nin, in, nout, out);
fail:
    return rc;
}

int fsdp_ddp_forward1(fsdp_ddp_t *d, fsdp_tensor_t *x, fsdp_tensor_t **y) {
    return fsdp_ddp_forward(d, 1, &x, 1, y);
}

fsdp_module_t *fsdp_ddp_module(const fsdp_ddp_t *d) {
    return d && d->alive ? d->m : NULL;
}

fsdp_pg_t *fsdp_ddp_pg(const fsdp_ddp_t *d) {
    return d && d->alive ? d->pg : NULL;
}

int fsdp_ddp_set_sync(fsdp_ddp_t *d, bool sync) {
    if (!d || !d->alive)
        return fsdp__ctx_err(d ? d->ctx : NULL, FSDP_EINVAL,
                             "fsdp_ddp_set_sync: the wrapper is NULL or destroyed");
    d->sync = sync;
    return FSDP_OK;
}

bool fsdp_ddp_sync(const fsdp_ddp_t *d) {
    return d && d->sync;
}

int fsdp_ddp_get_stats(const fsdp_ddp_t *d, fsdp_ddp_stats_t *out) {
    if (!d || !out)
        return fsdp__ctx_err(d ? d->ctx : NULL, FSDP_EINVAL, "fsdp_ddp_get_stats: NULL argument");
    *out = d->stats;
    return FSDP_OK;
}

size_t fsdp_ddp_bucket_num_params(const fsdp_ddp_t *d, size_t b) {
    return d && d->alive && b < d->nbuckets ? d->buckets[b].n : 0;
}

fsdp_tensor_t *fsdp_ddp_bucket_param(const fsdp_ddp_t *d, size_t b, size_t i, const char **name) {
    if (name) *name = NULL;
    if (!d || !d->alive || b >= d->nbuckets || i >= d->buckets[b].n) return NULL;
    const struct ddp_param *p = &d->params[d->buckets[b].idx[i]];
    if (name) *name = p->name;
    return p->t;
}
