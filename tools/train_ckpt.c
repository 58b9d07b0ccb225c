/*
 * train_ckpt.c: fsdp-train's resumable checkpoints (--save-every, --resume).
 *
 * A checkpoint of step S is a directory DIR/step-S/ with one safetensors file per rank,
 * rank-R-of-W.safetensors, holding that rank's state only: its part of every parameter
 * ("param.<name>", the 1-D views of the local shard that use_orig_params shows, possibly
 * empty) and its optimizer state ("optim.<key>", fsdp_optim_state_dict), with the step, the
 * world size and the loader position in the metadata. Nothing is gathered, so saving costs no
 * communication and no full copy of the model; the price is that a checkpoint resumes only at
 * the world size (and sharding, model and batch flags) that wrote it, which is checked. Each
 * file is written atomically by the safetensors writer; a barrier after the writes means that
 * when any rank goes on, every file of the step exists.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "train.h"

static int ckpt_path(char *buf, size_t cap, const char *dir, int r, int w) {
    int n = snprintf(buf, cap, "%s/rank-%d-of-%d.safetensors", dir, r, w);
    return n > 0 && (size_t)n < cap ? 0 : FSDP_EINVAL;
}

/* A list of `a`'s entries under prefix pa, then b's under pb (names owned, tensors borrowed). */
static int join(const fsdp_named_list_t *a, const char *pa, const fsdp_named_list_t *b,
                const char *pb, fsdp_named_list_t *out) {
    size_t n = a->n + b->n;
    *out = (fsdp_named_list_t){0};
    out->names = calloc(n + 1, sizeof *out->names);
    out->tensors = calloc(n + 1, sizeof *out->tensors);
    if (!out->names || !out->tensors) return FSDP_ENOMEM;
    for (size_t i = 0; i < n; i++) {
        const fsdp_named_list_t *l = i < a->n ? a : b;
        size_t k = i < a->n ? i : i - a->n;
        const char *p = i < a->n ? pa : pb;
        size_t len = strlen(p) + strlen(l->names[k]) + 1;
        if (!(out->names[i] = malloc(len))) return FSDP_ENOMEM;
        snprintf(out->names[i], len, "%s%s", p, l->names[k]);
        out->tensors[i] = l->tensors[k];
        out->n = i + 1;
    }
    return 0;
}

static void unjoin(fsdp_named_list_t *l) {
    for (size_t i = 0; l->names && i < l->n; i++)
        free(l->names[i]);
    free(l->names);
    free(l->tensors);
    *l = (fsdp_named_list_t){0};
}

int train_ckpt_save(fsdp_ctx_t *ctx, fsdp_unit_t *root, fsdp_optim_t *opt, const char *dir,
                    int64_t step, uint64_t position, char *err, size_t cap) {
    int r = fsdp_ctx_rank(ctx), w = fsdp_ctx_world_size(ctx);
    char sdir[4096], path[4200];
    int n = snprintf(sdir, sizeof sdir, "%s/step-%" PRId64, dir, step);
    if (n <= 0 || (size_t)n >= sizeof sdir || ckpt_path(path, sizeof path, sdir, r, w) < 0) {
        snprintf(err, cap, "checkpoint directory name too long: %s", dir);
        return FSDP_EINVAL;
    }
    /* Every rank makes the directories; EEXIST from a peer that got there first is fine. */
    if ((mkdir(dir, 0777) < 0 && errno != EEXIST) || (mkdir(sdir, 0777) < 0 && errno != EEXIST)) {
        snprintf(err, cap, "cannot create %s: %s", sdir, strerror(errno));
        return FSDP_EINVAL;
    }
    fsdp_named_list_t params = {0}, osd = {0}, all = {0};
    int rc = fsdp_named_params(root, &params);
    if (rc == 0) rc = fsdp_optim_state_dict(opt, &osd);
    if (rc == 0) rc = join(&params, "param.", &osd, "optim.", &all);
    if (rc == 0) {
        char s_step[32], s_world[32], s_pos[32];
        snprintf(s_step, sizeof s_step, "%" PRId64, step);
        snprintf(s_world, sizeof s_world, "%d", w);
        snprintf(s_pos, sizeof s_pos, "%" PRIu64, position);
        fsdp_safetensors_kv_t meta[] = {
            {"step", s_step}, {"world_size", s_world}, {"loader_position", s_pos}};
        rc = fsdp_safetensors_save(ctx, path, &all, meta, 3);
    }
    unjoin(&all);
    fsdp_named_list_free(&params);
    fsdp_named_list_free(&osd);
    if (rc < 0) {
        snprintf(err, cap, "saving %s: %s", path, fsdp_ctx_last_error(ctx));
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

int train_ckpt_load(fsdp_ctx_t *ctx, fsdp_unit_t *root, fsdp_optim_t *opt, const char *sdir,
                    int64_t *step, uint64_t *position, char *err, size_t cap) {
    int r = fsdp_ctx_rank(ctx), w = fsdp_ctx_world_size(ctx);
    char path[4200];
    if (ckpt_path(path, sizeof path, sdir, r, w) < 0) {
        snprintf(err, cap, "--resume: directory name too long");
        return FSDP_EINVAL;
    }
    fsdp_safetensors_t *st = NULL;
    fsdp_named_list_t params = {0}, dst = {0}, all = {0}, osd = {0};
    uint64_t s = 0, world = 0, pos = 0;
    int rc = fsdp_safetensors_open(ctx, path, &st);
    if (rc < 0) {
        snprintf(err, cap, "--resume: %s (a checkpoint resumes at the world size that wrote it)",
                 fsdp_ctx_last_error(ctx));
        return rc;
    }
    if (meta_u64(st, "step", &s) < 0 || meta_u64(st, "world_size", &world) < 0 ||
        meta_u64(st, "loader_position", &pos) < 0 || world != (uint64_t)w) {
        snprintf(err, cap,
                 "--resume: %s lacks fsdp-train's metadata or was written by another "
                 "world size",
                 path);
        rc = FSDP_EINVAL;
        goto out;
    }
    /* Parameters by name into this rank's shard views. */
    if ((rc = fsdp_named_params(root, &params)) < 0) goto lib_fail;
    fsdp_named_list_t none = {0};
    if ((rc = join(&params, "param.", &none, "", &dst)) < 0) goto lib_fail;
    /* The optimizer's entries of the file, without their prefix. */
    if ((rc = fsdp_safetensors_load_all(st, &all)) < 0) goto lib_fail;
    osd.names = calloc(all.n + 1, sizeof *osd.names);
    osd.tensors = calloc(all.n + 1, sizeof *osd.tensors);
    if (!osd.names || !osd.tensors) {
        rc = FSDP_ENOMEM;
        goto lib_fail;
    }
    size_t nparam = 0;
    for (size_t i = 0; i < all.n; i++) {
        if (strncmp(all.names[i], "optim.", 6) == 0) {
            osd.names[osd.n] = all.names[i] + 6;
            osd.tensors[osd.n++] = all.tensors[i];
        } else {
            nparam++;
        }
    }
    if (nparam != dst.n) {
        snprintf(err, cap,
                 "--resume: %s holds %zu parameters, this model %zu: written with "
                 "other model flags",
                 path, nparam, dst.n);
        rc = FSDP_EINVAL;
        goto out;
    }
    /* Check the optimizer state first (it validates without modifying), then the parameters
     * (also checked completely before anything is written). */
    if ((rc = fsdp_optim_load_state_dict(opt, &osd)) < 0) goto lib_fail;
    rc = fsdp_safetensors_load_into(st, &dst, false);
    if (rc < 0) goto lib_fail;
    *step = (int64_t)s;
    *position = pos;
    goto out;
lib_fail:
    snprintf(err, cap, "--resume: %s: %s", path, fsdp_ctx_last_error(ctx));
out:
    free(osd.names);
    free(osd.tensors);
    fsdp_named_list_free(&all);
    unjoin(&dst);
    fsdp_named_list_free(&params);
    fsdp_safetensors_close(st);
    return rc;
}
