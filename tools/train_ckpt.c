/*
 * train_ckpt.c: fsdp-train's checkpoints (--save-every, --resume) and --export.
 *
 * A checkpoint of step S is a directory DIR/step-S/ holding
 *   model.safetensors            the full model, gathered to rank 0 and written by it, under
 *                                libfsdp's parameter names (the file --export writes, so --init
 *                                takes it at any world size, and so does any safetensors reader);
 *   optim-rank-R-of-W.safetensors rank R's pieces of the optimizer state, keyed by parameter
 *                                name (fsdp_sharded_optim_state_dict: its range of every
 *                                moment buffer, each with its place in the global tensor in a
 *                                "piece:<name>" metadata entry, and the step counts), with the
 *                                step, the world size, the loader position and, with
 *                                --precision f16, the gradient scaler's state (its scale,
 *                                factors, interval and growth tracker, PyTorch's state_dict
 *                                keys, and the steps skipped so far) in the metadata.
 * The optimizer state stays sharded: gathering it would cost twice the model's size on rank 0.
 * A resume at another world size (or sharding) reads every rank's file and takes the ranges it
 * holds now (fsdp_load_sharded_optim_state_dict); reading only those byte ranges is the
 * checkpoint format's next step. Every file is written atomically by the safetensors writer (a
 * temporary name in the same directory, fsync, rename, fsync of the directory), so a save that
 * is killed leaves any earlier file of the same name whole; a barrier after the writes means
 * that when any rank goes on, every file of the step exists.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/stat.h>

#include "tools/train.h"

static int path_in(char *buf, size_t cap, const char *dir, const char *fmt, int r, int w) {
    int n = snprintf(buf, cap, "%s/", dir);
    if (n <= 0 || (size_t)n >= cap) return FSDP_EINVAL;
    int m = snprintf(buf + n, cap - (size_t)n, fmt, r, w);
    return m > 0 && (size_t)m < cap - (size_t)n ? 0 : FSDP_EINVAL;
}

#define MODEL_FILE "model.safetensors"
#define OPTIM_FMT "optim-rank-%d-of-%d.safetensors"

int train_save_full(fsdp_ctx_t *ctx, fsdp_unit_t *root, const fsdp_module_t *model,
                    const char *path, int64_t step, char *err, size_t cap) {
    fsdp_summon_options_t so;
    fsdp_summon_options_init(&so);
    so.writeback = false;
    so.rank0_only = true;
    int rc = fsdp_summon_begin(root, &so);
    if (rc < 0) {
        snprintf(err, cap, "gathering the full parameters: %s", fsdp_ctx_last_error(ctx));
        return rc;
    }
    int save_rc = 0;
    if (fsdp_ctx_rank(ctx) == 0) {
        char s_step[32];
        snprintf(s_step, sizeof s_step, "%" PRId64, step);
        fsdp_safetensors_kv_t meta[] = {{"step", s_step}, {"producer", TRAIN_PROG}};
        save_rc = fsdp_safetensors_save_module(model, path, meta, 2);
        if (save_rc < 0) snprintf(err, cap, "writing %s: %s", path, fsdp_ctx_last_error(ctx));
    }
    rc = fsdp_summon_end(root);
    if (rc < 0 && save_rc == 0)
        snprintf(err, cap, "ending the summon: %s", fsdp_ctx_last_error(ctx));
    if (save_rc < 0 || rc < 0) return save_rc < 0 ? save_rc : rc;
    /* No rank goes on (to write its optimizer file, say) until rank 0 has the model file on
     * disk: the files of a checkpoint are written in one order on every run, so a failure
     * part way (a full disk, a file-size limit) always stops at the same file. */
    if ((rc = fsdp_pg_barrier(fsdp_ctx_pg(ctx), NULL)) < 0)
        snprintf(err, cap, "the barrier after writing %s: %s", path, fsdp_ctx_last_error(ctx));
    return rc;
}

/* The gradient scaler's state in the optimizer file's metadata (PyTorch's state_dict keys). */
#define SCALER_KEYS 6
static const char *const SCALER_KEY[SCALER_KEYS] = {
    "grad_scaler.scale",           "grad_scaler.growth_factor",  "grad_scaler.backoff_factor",
    "grad_scaler.growth_interval", "grad_scaler.growth_tracker", "grad_scaler.skipped_steps"};

int train_ckpt_save(fsdp_ctx_t *ctx, fsdp_unit_t *root, const fsdp_module_t *model,
                    fsdp_optim_t *opt, const char *dir, int64_t step,
                    const train_ckpt_extra_t *extra, char *err, size_t cap) {
    int r = fsdp_ctx_rank(ctx), w = fsdp_ctx_world_size(ctx);
    char sdir[4096], mpath[4200], opath[4200];
    int n = snprintf(sdir, sizeof sdir, "%s/step-%" PRId64, dir, step);
    if (n <= 0 || (size_t)n >= sizeof sdir ||
        path_in(mpath, sizeof mpath, sdir, MODEL_FILE, r, w) < 0 ||
        path_in(opath, sizeof opath, sdir, OPTIM_FMT, r, w) < 0) {
        snprintf(err, cap, "checkpoint directory name too long: %s", dir);
        return FSDP_EINVAL;
    }
    /* Every rank makes the directories; EEXIST from a peer that got there first is fine. */
    if ((mkdir(dir, 0777) < 0 && errno != EEXIST) || (mkdir(sdir, 0777) < 0 && errno != EEXIST)) {
        snprintf(err, cap, "cannot create %s: %s", sdir, strerror(errno));
        return FSDP_EINVAL;
    }
    int rc = train_save_full(ctx, root, model, mpath, step, err, cap);
    if (rc < 0) return rc;
    fsdp_shard_list_t pieces = {0};
    fsdp_named_list_t osd = {0};
    fsdp_safetensors_kv_t *meta = NULL;
    char(*geo)[2][512] = NULL;
    rc = fsdp_sharded_optim_state_dict(root, opt, &pieces);
    fsdp_grad_scaler_state_t gs = {0};
    if (rc == 0 && extra->scaler) rc = fsdp_grad_scaler_state_dict(extra->scaler, &gs);
    size_t nm = 3 + SCALER_KEYS + pieces.n;
    if (rc == 0) {
        meta = calloc(nm, sizeof *meta);
        geo = calloc(pieces.n + 1, sizeof *geo);
        osd.names = calloc(pieces.n + 1, sizeof *osd.names);
        osd.tensors = calloc(pieces.n + 1, sizeof *osd.tensors);
        if (!meta || !geo || !osd.names || !osd.tensors) rc = FSDP_ENOMEM;
    }
    if (rc == 0) {
        char s_step[32], s_world[32], s_pos[32], sv[SCALER_KEYS][40];
        snprintf(s_step, sizeof s_step, "%" PRId64, step);
        snprintf(s_world, sizeof s_world, "%d", w);
        snprintf(s_pos, sizeof s_pos, "%" PRIu64, extra->position);
        /* %.17g: every double reads back to the same bits */
        snprintf(sv[0], sizeof sv[0], "%.17g", gs.scale);
        snprintf(sv[1], sizeof sv[1], "%.17g", gs.growth_factor);
        snprintf(sv[2], sizeof sv[2], "%.17g", gs.backoff_factor);
        snprintf(sv[3], sizeof sv[3], "%" PRId64, gs.growth_interval);
        snprintf(sv[4], sizeof sv[4], "%" PRId64, gs.growth_tracker);
        snprintf(sv[5], sizeof sv[5], "%" PRId64, extra->skipped);
        size_t k = 0;
        meta[k++] = (fsdp_safetensors_kv_t){"step", s_step};
        meta[k++] = (fsdp_safetensors_kv_t){"world_size", s_world};
        meta[k++] = (fsdp_safetensors_kv_t){"loader_position", s_pos};
        for (int i = 0; extra->scaler && i < SCALER_KEYS; i++)
            meta[k++] = (fsdp_safetensors_kv_t){SCALER_KEY[i], sv[i]};
        /* each piece with its place in the global tensor: "piece:<name>" =
         * "<replicated> <offset> <ndim> <dims...>" */
        for (size_t i = 0; i < pieces.n; i++) {
            const fsdp_shard_entry_t *e = &pieces.e[i];
            snprintf(geo[i][0], sizeof geo[i][0], "piece:%s", e->name);
            int len = snprintf(geo[i][1], sizeof geo[i][1], "%d %" PRId64 " %d",
                               e->replicated ? 1 : 0, e->offset, e->ndim);
            for (int d = 0; d < e->ndim && len > 0 && (size_t)len < sizeof geo[i][1]; d++)
                len += snprintf(geo[i][1] + len, sizeof geo[i][1] - (size_t)len, " %" PRId64,
                                e->shape[d]);
            meta[k++] = (fsdp_safetensors_kv_t){geo[i][0], geo[i][1]};
            osd.names[i] = e->name;
            osd.tensors[i] = e->t;
        }
        osd.n = pieces.n;
        rc = fsdp_safetensors_save(ctx, opath, &osd, meta, k);
    }
    free(osd.names); /* borrowed from pieces */
    free(osd.tensors);
    free(meta);
    free(geo);
    fsdp_shard_list_free(&pieces);
    if (rc < 0) {
        snprintf(err, cap, "saving %s: %s", opath, fsdp_ctx_last_error(ctx));
        return rc;
    }
    if ((rc = fsdp_pg_barrier(fsdp_ctx_pg(ctx), NULL)) < 0)
        snprintf(err, cap, "the barrier after saving: %s", fsdp_ctx_last_error(ctx));
    return rc;
}

static int meta_u64(fsdp_safetensors_t *st, const char *key, uint64_t *out) {
    const char *v = fsdp_safetensors_metadata(st, key);
    if (!v) return FSDP_EINVAL;
    char *end = NULL;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || end == v || *end) return FSDP_EINVAL;
    *out = x;
    return 0;
}

static int meta_double(fsdp_safetensors_t *st, const char *key, double *out) {
    const char *v = fsdp_safetensors_metadata(st, key);
    if (!v) return FSDP_EINVAL;
    char *end = NULL;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || *end) return FSDP_EINVAL;
    *out = x;
    return 0;
}

/* The scaler's state from the optimizer file's metadata, loaded into scaler (validated there:
 * nothing changes on an error); *skipped receives the steps skipped so far. */
static int load_scaler(fsdp_safetensors_t *ost, const char *opath, fsdp_grad_scaler_t *scaler,
                       int64_t *skipped, char *err, size_t cap) {
    fsdp_grad_scaler_state_t gs = {0};
    uint64_t iv = 0, tr = 0, sk = 0;
    if (meta_double(ost, SCALER_KEY[0], &gs.scale) < 0 ||
        meta_double(ost, SCALER_KEY[1], &gs.growth_factor) < 0 ||
        meta_double(ost, SCALER_KEY[2], &gs.backoff_factor) < 0 ||
        meta_u64(ost, SCALER_KEY[3], &iv) < 0 || meta_u64(ost, SCALER_KEY[4], &tr) < 0 ||
        meta_u64(ost, SCALER_KEY[5], &sk) < 0 || iv > INT64_MAX || tr > INT64_MAX ||
        sk > INT64_MAX) {
        snprintf(err, cap,
                 "--resume: %s holds no gradient scaler state (%s and the other grad_scaler.* "
                 "keys): it was written by a run without --precision f16",
                 opath, SCALER_KEY[0]);
        return FSDP_EINVAL;
    }
    gs.growth_interval = (int64_t)iv;
    gs.growth_tracker = (int64_t)tr;
    int rc = fsdp_grad_scaler_load_state_dict(scaler, &gs);
    if (rc < 0) return rc;
    *skipped = (int64_t)sk;
    return FSDP_OK;
}

/* The world size that wrote step directory sdir: W of its optim-rank-0-of-W file. */
static int saved_world(const char *sdir, int *world) {
    DIR *d = opendir(sdir);
    if (!d) return FSDP_EINVAL;
    struct dirent *de;
    *world = 0;
    while ((de = readdir(d)) != NULL) {
        int r = -1, w = 0;
        char tail[32] = "";
        if (sscanf(de->d_name, "optim-rank-%d-of-%d.%31s", &r, &w, tail) == 3 && r == 0 && w > 0 &&
            strcmp(tail, "safetensors") == 0)
            *world = w;
    }
    closedir(d);
    return *world > 0 ? FSDP_OK : FSDP_EINVAL;
}

/* Appends the pieces of one rank's optimizer file (each tensor with its "piece:<name>"
 * geometry) to l. */
static int read_pieces(fsdp_safetensors_t *st, const char *path, fsdp_shard_list_t *l, size_t *cap,
                       char *err, size_t ecap) {
    fsdp_named_list_t all = {0};
    int rc = fsdp_safetensors_load_all(st, &all);
    for (size_t i = 0; i < all.n && rc == 0; i++) {
        char key[600];
        snprintf(key, sizeof key, "piece:%s", all.names[i]);
        const char *g = fsdp_safetensors_metadata(st, key);
        int repl = 0, nd = 0, used = 0;
        long long off = 0;
        fsdp_shard_entry_t e = {0};
        if (!g || sscanf(g, "%d %lld %d%n", &repl, &off, &nd, &used) < 3 || nd < 0 ||
            nd > FSDP_MAX_DIMS) {
            snprintf(err, ecap,
                     "--resume: %s: tensor '%s' has no place in a global tensor (no "
                     "valid '%s' metadata): not a checkpoint of this fsdp-train",
                     path, all.names[i], key);
            rc = FSDP_EINVAL;
            break;
        }
        const char *p = g + used;
        for (int d = 0; d < nd && rc == 0; d++) {
            long long v = 0;
            int k = 0;
            if (sscanf(p, "%lld%n", &v, &k) < 1) rc = FSDP_EINVAL;
            e.shape[d] = v;
            p += k;
        }
        if (rc < 0) {
            snprintf(err, ecap, "--resume: %s: bad '%s' metadata '%s'", path, key, g);
            break;
        }
        if (*cap == l->n) {
            size_t nc = *cap ? 2 * *cap : 64;
            fsdp_shard_entry_t *ne = realloc(l->e, nc * sizeof *ne);
            if (!ne) {
                rc = FSDP_ENOMEM;
                break;
            }
            l->e = ne;
            *cap = nc;
        }
        e.name = strdup(all.names[i]);
        e.t = fsdp_tensor_retain(all.tensors[i]);
        e.ndim = nd;
        e.offset = off;
        e.replicated = repl != 0;
        l->e[l->n++] = e;
        if (!e.name) rc = FSDP_ENOMEM;
    }
    fsdp_named_list_free(&all);
    return rc;
}

int train_ckpt_load(fsdp_ctx_t *ctx, fsdp_unit_t *root, fsdp_module_t *model, fsdp_optim_t *opt,
                    const char *sdir, int64_t *step, train_ckpt_extra_t *extra, char *err,
                    size_t cap) {
    char mpath[4200], opath[4200];
    err[0] = 0;
    int sw = 0;
    if (saved_world(sdir, &sw) < 0) {
        snprintf(err, cap,
                 "--resume: %s holds no optim-rank-0-of-W.safetensors: not a step "
                 "directory written by --save-every",
                 sdir);
        return FSDP_EINVAL;
    }
    if (path_in(mpath, sizeof mpath, sdir, MODEL_FILE, 0, sw) < 0) {
        snprintf(err, cap, "--resume: directory name too long");
        return FSDP_EINVAL;
    }
    fsdp_safetensors_t *ost = NULL, *mst = NULL;
    fsdp_shard_list_t pieces = {0};
    size_t pcap = 0;
    uint64_t s = 0, pos = 0, mstep = 0;
    int64_t skipped = 0;
    const char *bad_file = mpath;
    int rc = FSDP_OK;
    /* Every rank reads every rank's optimizer file of the saved world size: the pieces of the
     * state, wherever it was cut, from which it takes the ranges it holds now. */
    for (int q = 0; q < sw && rc == 0; q++) {
        uint64_t qs = 0, qw = 0, qp = 0;
        if (path_in(opath, sizeof opath, sdir, OPTIM_FMT, q, sw) < 0) {
            snprintf(err, cap, "--resume: directory name too long");
            rc = FSDP_EINVAL;
            break;
        }
        bad_file = opath;
        if ((rc = fsdp_safetensors_open(ctx, opath, &ost)) < 0) goto lib_fail;
        if (meta_u64(ost, "step", &qs) < 0 || meta_u64(ost, "world_size", &qw) < 0 ||
            meta_u64(ost, "loader_position", &qp) < 0 || qw != (uint64_t)sw ||
            (q > 0 && (qs != s || qp != pos))) {
            snprintf(err, cap,
                     "--resume: %s lacks fsdp-train's metadata, or its step, world size or "
                     "loader position disagree with rank 0's file",
                     opath);
            rc = FSDP_EINVAL;
            break;
        }
        s = qs;
        pos = qp;
        if (q == 0 && extra->scaler &&
            (rc = load_scaler(ost, opath, extra->scaler, &skipped, err, cap)) < 0) {
            if (err[0]) break;
            goto lib_fail;
        }
        if ((rc = read_pieces(ost, opath, &pieces, &pcap, err, cap)) < 0) {
            if (err[0]) break;
            goto lib_fail;
        }
        fsdp_safetensors_close(ost);
        ost = NULL;
    }
    if (rc < 0) goto out;
    bad_file = mpath;
    if ((rc = fsdp_safetensors_open(ctx, mpath, &mst)) < 0) goto lib_fail;
    if (meta_u64(mst, "step", &mstep) < 0 || mstep != s) {
        snprintf(err, cap, "--resume: %s is not the model of step %" PRIu64 " (%s)", mpath, s,
                 fsdp_safetensors_metadata(mst, "step") ? fsdp_safetensors_metadata(mst, "step")
                                                        : "no step");
        rc = FSDP_EINVAL;
        goto out;
    }
    /* The optimizer state first (its load checks everything before it modifies anything),
     * then the full model goes into every rank's shard through a summon with writeback
     * (strict: every parameter present with its shape). */
    bad_file = sdir;
    if ((rc = fsdp_load_sharded_optim_state_dict(root, opt, &pieces)) < 0) goto lib_fail;
    bad_file = mpath;
    fsdp_summon_options_t so;
    fsdp_summon_options_init(&so);
    if ((rc = fsdp_summon_begin(root, &so)) < 0) goto lib_fail;
    rc = fsdp_safetensors_load_module(mst, model, true);
    int rc2 = fsdp_summon_end(root);
    if (rc == 0) rc = rc2;
    if (rc < 0) goto lib_fail;
    *step = (int64_t)s;
    extra->position = pos;
    extra->skipped = skipped;
    goto out;
lib_fail:
    snprintf(err, cap, "--resume: %s: %s", bad_file, fsdp_ctx_last_error(ctx));
out:
    fsdp_shard_list_free(&pieces);
    fsdp_safetensors_close(ost);
    fsdp_safetensors_close(mst);
    return rc;
}
