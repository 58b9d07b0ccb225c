/*
 * train_ckpt.c: fsdp-train's checkpoints (--save-every, --resume) and --export.
 *
 * A checkpoint of step S is a directory DIR/step-S/ holding
 *   model.safetensors            the full model, gathered to rank 0 and written by it, under
 *                                libfsdp's parameter names (the file --export writes, so --init
 *                                takes it at any world size, and so does any safetensors reader);
 *   optim-rank-R-of-W.safetensors rank R's optimizer state (fsdp_optim_state_dict: its part of
 *                                every moment buffer, and the step counts), with the step, the
 *                                world size, the loader position and, with --precision f16,
 *                                the gradient scaler's state (its scale, factors, interval and
 *                                growth tracker, PyTorch's state_dict keys, and the steps
 *                                skipped so far) in the metadata.
 * The optimizer state stays sharded: gathering it would cost twice the model's size on rank 0,
 * and AdamW's moments are only needed by the rank that owns them; the price is that the
 * optimizer state resumes only at the world size (and sharding, model and batch flags) that
 * wrote it, which is checked. Every file is written atomically by the safetensors writer (a
 * temporary name in the same directory, fsync, rename, fsync of the directory), so a save that
 * is killed leaves any earlier file of the same name whole; a barrier after the writes means
 * that when any rank goes on, every file of the step exists.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
    fsdp_named_list_t osd = {0};
    rc = fsdp_optim_state_dict(opt, &osd);
    fsdp_grad_scaler_state_t gs = {0};
    if (rc == 0 && extra->scaler) rc = fsdp_grad_scaler_state_dict(extra->scaler, &gs);
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
        fsdp_safetensors_kv_t meta[3 + SCALER_KEYS] = {
            {"step", s_step}, {"world_size", s_world}, {"loader_position", s_pos}};
        for (int i = 0; i < SCALER_KEYS; i++)
            meta[3 + i] = (fsdp_safetensors_kv_t){SCALER_KEY[i], sv[i]};
        rc = fsdp_safetensors_save(ctx, opath, &osd, meta, extra->scaler ? 3 + SCALER_KEYS : 3);
    }
    fsdp_named_list_free(&osd);
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

int train_ckpt_load(fsdp_ctx_t *ctx, fsdp_unit_t *root, fsdp_module_t *model, fsdp_optim_t *opt,
                    const char *sdir, int64_t *step, train_ckpt_extra_t *extra, char *err,
                    size_t cap) {
    int r = fsdp_ctx_rank(ctx), w = fsdp_ctx_world_size(ctx);
    char mpath[4200], opath[4200];
    err[0] = 0;
    if (path_in(mpath, sizeof mpath, sdir, MODEL_FILE, r, w) < 0 ||
        path_in(opath, sizeof opath, sdir, OPTIM_FMT, r, w) < 0) {
        snprintf(err, cap, "--resume: directory name too long");
        return FSDP_EINVAL;
    }
    fsdp_safetensors_t *ost = NULL, *mst = NULL;
    fsdp_named_list_t osd = {0};
    uint64_t s = 0, world = 0, pos = 0, mstep = 0;
    const char *bad_file = opath;
    int rc = fsdp_safetensors_open(ctx, opath, &ost);
    if (rc < 0) {
        snprintf(err, cap,
                 "--resume: %s (the optimizer state resumes at the world size that wrote it)",
                 fsdp_ctx_last_error(ctx));
        return rc;
    }
    if (meta_u64(ost, "step", &s) < 0 || meta_u64(ost, "world_size", &world) < 0 ||
        meta_u64(ost, "loader_position", &pos) < 0 || world != (uint64_t)w) {
        snprintf(err, cap,
                 "--resume: %s lacks fsdp-train's metadata or was written by another "
                 "world size",
                 opath);
        rc = FSDP_EINVAL;
        goto out;
    }
    bad_file = mpath;
    if ((rc = fsdp_safetensors_open(ctx, mpath, &mst)) < 0) goto lib_fail;
    if (meta_u64(mst, "step", &mstep) < 0 || mstep != s) {
        snprintf(err, cap, "--resume: %s is not the model of step %" PRIu64 " (%s)", mpath, s,
                 fsdp_safetensors_metadata(mst, "step") ? fsdp_safetensors_metadata(mst, "step")
                                                        : "no step");
        rc = FSDP_EINVAL;
        goto out;
    }
    /* The optimizer state is checked first (loading validates everything before it modifies
     * anything), then the full model goes into every rank's shard through a summon with
     * writeback (strict: every parameter present with its shape). */
    bad_file = opath;
    int64_t skipped = 0;
    if (extra->scaler && (rc = load_scaler(ost, opath, extra->scaler, &skipped, err, cap)) < 0) {
        if (err[0]) goto out;
        goto lib_fail;
    }
    if ((rc = fsdp_safetensors_load_all(ost, &osd)) < 0) goto lib_fail;
    if ((rc = fsdp_optim_load_state_dict(opt, &osd)) < 0) goto lib_fail;
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
    fsdp_named_list_free(&osd);
    fsdp_safetensors_close(ost);
    fsdp_safetensors_close(mst);
    return rc;
}
