/* SPDX-License-Identifier: MIT */
/*
 * t_checkpoint.c: checkpoint directories that reshard (the checkpoint issue's "A checkpoint
 * format that reshards": per-rank safetensors files and a JSON index, written in parallel,
 * appearing complete or not at all, read by byte ranges at any world size and strategy).
 *
 * On the io layer alone (one process, hand-made pieces of known values):
 *   - three ranks' pieces of an f32 tensor, a bf16 tensor held by two replicas, a replicated i64
 *     tensor and an f64 scalar make a directory whose index lists each tensor once with its
 *     chunks, its world size and its metadata; reads of ranges that cross chunks, and reads
 *     converted to f64, give the written values;
 *   - byte ranges: a read touches only the files its range lies in (the data of another rank's
 *     file is overwritten with garbage, and a range outside it still reads right);
 *   - saving again over the directory replaces it whole, and leaves no staging directory;
 *     a stale staging directory is cleared; one holding a foreign file is refused, naming it,
 *     and the published directory is untouched.
 * Through FSDP (TransformerWithSharedParams, RECURSIVE wrapping, AdamW after two steps, sim):
 *   - fsdp_checkpoint_save at world 2 (FULL_SHARD), then fsdp_checkpoint_load at worlds 1, 3
 *     and 4 under SHARD_GRAD_OP or FULL_SHARD and at 4 under HYBRID_SHARD (groups of 2): the
 *     loaded model's FULL state dict is bitwise the saved model's, and saving it again gives a
 *     directory whose every tensor (model and optimizer) is bitwise the first one's;
 *   - under HYBRID_SHARD the second replica writes no model or moment pieces (only the
 *     optimizer's scalars, which every rank writes), and the index still covers every tensor.
 */
#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fsdp.h>

#include "fsdp_util.h"
#include "models/models.h"
#include "tap.h"

static char tmpdir[256];

static void path_of(char *buf, size_t cap, const char *a, const char *b) {
    snprintf(buf, cap, "%s/%s%s%s", tmpdir, a, b ? "/" : "", b ? b : "");
}

static bool exists(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0;
}

/* ---- the io layer --------------------------------------------------------------------------- */

#define NA 15 /* "a": f32 [5, 3] */
#define NB 7  /* "b": bf16 [7] */

static float a_val(int i) {
    return (float)i * 0.25f - 1.5f;
}

static int add_piece(fsdp_ctx_t *ctx, fsdp_shard_list_t *l, const char *name, fsdp_dtype_t dt,
                     const void *data, int64_t n, int nd, const int64_t *shape, int64_t off,
                     bool repl) {
    fsdp_shard_entry_t *e = &l->e[l->n];
    *e = (fsdp_shard_entry_t){.ndim = nd, .offset = off, .replicated = repl};
    memcpy(e->shape, shape, (size_t)nd * sizeof *shape);
    int rc = repl ? fsdp_tensor_from_host(ctx, dt, nd, shape, data, FSDP_MEM_OTHER, &e->t)
                  : fsdp_tensor_from_host(ctx, dt, 1, &n, data, FSDP_MEM_OTHER, &e->t);
    e->name = strdup(name);
    l->n++;
    return rc;
}

/* Writes the hand-made checkpoint into dir (a = base + i / 4 shifts the values for a rewrite). */
static int write_small(fsdp_ctx_t *ctx, const char *dir, float shift) {
    float a[NA];
    uint16_t b[NB];
    int64_t c[4] = {7, -1, 1LL << 40, 3};
    double s = 2.5;
    for (int i = 0; i < NA; i++)
        a[i] = a_val(i) + shift;
    for (int i = 0; i < NB; i++) {
        float f = (float)i - 3.0f;
        fsdp_dtype_convert(&b[i], FSDP_DTYPE_BF16, &f, FSDP_DTYPE_F32, 1);
    }
    const int64_t sa[2] = {5, 3}, sb[1] = {NB}, sc[1] = {4};
    int rc = fsdp_ckpt_prepare(ctx, dir);
    for (int r = 0; r < 3 && rc == 0; r++) {
        fsdp_shard_list_t l = {0};
        l.e = calloc(8, sizeof *l.e);
        /* a: [0, 6) [6, 11) [11, 15) */
        static const int64_t lo[3] = {0, 6, 11}, hi[3] = {6, 11, 15};
        rc = add_piece(ctx, &l, "a", FSDP_DTYPE_F32, a + lo[r], hi[r] - lo[r], 2, sa, lo[r], false);
        /* b: [0, 4) on rank 0; [4, 7) on ranks 1 and 2 (replicas) */
        if (rc == 0)
            rc = r == 0 ? add_piece(ctx, &l, "b", FSDP_DTYPE_BF16, b, 4, 1, sb, 0, false)
                        : add_piece(ctx, &l, "b", FSDP_DTYPE_BF16, b + 4, 3, 1, sb, 4, false);
        if (rc == 0 && r == 0) rc = add_piece(ctx, &l, "c", FSDP_DTYPE_I64, c, 4, 1, sc, 0, true);
        if (rc == 0 && r == 0) rc = add_piece(ctx, &l, "s", FSDP_DTYPE_F64, &s, 1, 0, sc, 0, true);
        /* "e": an empty tensor (0 x 3), replicated, and rank 2's empty piece of it */
        static const int64_t se[2] = {0, 3};
        if (rc == 0 && r == 0) rc = add_piece(ctx, &l, "e", FSDP_DTYPE_F32, a, 0, 2, se, 0, true);
        if (rc == 0) rc = fsdp_ckpt_write_rank(ctx, dir, r, 3, &l);
        fsdp_shard_list_free(&l);
    }
    fsdp_safetensors_kv_t meta[] = {{"step", "12"}, {"note", "hand-made"}};
    return rc == 0 ? fsdp_ckpt_finish(ctx, dir, 3, meta, 2) : rc;
}

static void io_tests(void) {
    fsdp_ctx_t *ctx = NULL;
    fsdp_ctx_create(NULL, &ctx);
    char dir[400], p[1100], stage[500];
    path_of(dir, sizeof dir, "small", NULL);
    int rc = write_small(ctx, dir, 0.0f);
    tap_ok(rc == 0, "io: three ranks' pieces make a checkpoint directory (%s)",
           rc ? fsdp_ctx_last_error(ctx) : "ok");
    fsdp_ckpt_t *ck = NULL;
    rc = fsdp_ckpt_open(ctx, dir, &ck);
    tap_ok(rc == 0, "io: it opens (%s)", rc ? fsdp_ctx_last_error(ctx) : "ok");
    if (rc < 0) {
        fsdp_ctx_destroy(ctx);
        return;
    }
    fsdp_ckpt_info_t ia, ib, ic, is, ie;
    bool found = fsdp_ckpt_find(ck, "a", &ia) == 0 && fsdp_ckpt_find(ck, "b", &ib) == 0 &&
                 fsdp_ckpt_find(ck, "c", &ic) == 0 && fsdp_ckpt_find(ck, "s", &is) == 0;
    tap_ok(found && fsdp_ckpt_count(ck) == 5 && fsdp_ckpt_world_size(ck) == 3 &&
               fsdp_ckpt_file_count(ck) == 3,
           "io: the index lists 5 tensors, world size 3, 3 files");
    tap_ok(fsdp_ckpt_find(ck, "e", &ie) == 0 && ie.numel == 0 && ie.nchunks == 0 && ie.ndim == 2 &&
               ie.shape[1] == 3 && fsdp_ckpt_read(ck, "e", 0, 0, FSDP_DTYPE_F32, NULL, 0) == 0,
           "io: a tensor with no elements is listed with its shape [0, 3] and no chunk, and reads");
    tap_ok(found && ia.nchunks == 3 && ia.ndim == 2 && ia.shape[0] == 5 && ia.shape[1] == 3 &&
               !ia.replicated && strcmp(ia.st_dtype, "F32") == 0,
           "io: the f32 tensor has its global shape [5, 3] and 3 chunks");
    tap_ok(found && ib.nchunks == 2 && strcmp(ib.st_dtype, "BF16") == 0,
           "io: the piece two replicas wrote is indexed once (2 chunks, not 3)");
    tap_ok(found && ic.replicated && ic.nchunks == 1 && is.ndim == 0 && is.numel == 1,
           "io: replicated tensors have one chunk; a scalar has shape []");
    const char *st = fsdp_ckpt_metadata(ck, "step");
    tap_ok(st && strcmp(st, "12") == 0 && fsdp_ckpt_metadata_count(ck) == 2,
           "io: the index carries the metadata");
    float a[NA];
    double ad[NA];
    rc = fsdp_ckpt_read(ck, "a", 4, 9, FSDP_DTYPE_F32, a, 9 * sizeof(float));
    bool same = rc == 0;
    for (int i = 0; same && i < 9; i++)
        same = a[i] == a_val(4 + i);
    tap_ok(same, "io: elements [4, 13) of the f32 tensor, across its 3 chunks, read back");
    rc = fsdp_ckpt_read(ck, "a", 0, NA, FSDP_DTYPE_F64, ad, sizeof ad);
    same = rc == 0;
    for (int i = 0; same && i < NA; i++)
        same = ad[i] == (double)a_val(i);
    tap_ok(same, "io: the f32 tensor read as f64 converts every element");
    float bf[NB];
    rc = fsdp_ckpt_read(ck, "b", 0, NB, FSDP_DTYPE_F32, bf, sizeof bf);
    same = rc == 0;
    for (int i = 0; same && i < NB; i++)
        same = bf[i] == (float)i - 3.0f;
    int64_t c[4];
    rc = fsdp_ckpt_read(ck, "c", 0, 4, FSDP_DTYPE_I64, c, sizeof c);
    tap_ok(same && rc == 0 && c[0] == 7 && c[2] == (1LL << 40),
           "io: the bf16 tensor (from two files) and the replicated i64 tensor read back");
    rc = fsdp_ckpt_read(ck, "a", 10, 6, FSDP_DTYPE_F32, a, 6 * sizeof(float));
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_ckpt_last_error(ck), "'a'"),
           "io: a range past the end is FSDP_EINVAL naming the tensor");
    fsdp_ckpt_close(ck);

    /* byte ranges: garbage in rank 2's data section leaves reads elsewhere right */
    path_of(p, sizeof p, "small", "rank-2-of-3.safetensors");
    struct stat sb;
    int fd = open(p, O_WRONLY);
    bool wrote = fd >= 0 && fstat(fd, &sb) == 0;
    if (wrote) {
        unsigned char junk[8];
        memset(junk, 0xff, sizeof junk);
        wrote = pwrite(fd, junk, sizeof junk, sb.st_size - (off_t)sizeof junk) == sizeof junk;
    }
    if (fd >= 0) close(fd);
    rc = fsdp_ckpt_open(ctx, dir, &ck);
    if (rc == 0) rc = fsdp_ckpt_read(ck, "a", 0, 11, FSDP_DTYPE_F32, a, 11 * sizeof(float));
    same = rc == 0 && wrote;
    for (int i = 0; same && i < 11; i++)
        same = a[i] == a_val(i);
    tap_ok(same, "io: a read of ranks 0 and 1's range does not touch rank 2's file (%s)",
           rc ? fsdp_ctx_last_error(ctx) : "ok");
    fsdp_ckpt_close(ck);

    /* an index whose world size disagrees with its files */
    path_of(p, sizeof p, "small", "index.json");
    FILE *fi = fopen(p, "r+");
    char text[8192];
    size_t len = fi ? fread(text, 1, sizeof text - 1, fi) : 0;
    text[len] = 0;
    char *w = strstr(text, "\"world_size\": 3");
    if (fi && w) {
        w[14] = '5';
        rewind(fi);
        fwrite(text, 1, len, fi);
    }
    if (fi) fclose(fi);
    ck = NULL;
    rc = fsdp_ckpt_open(ctx, dir, &ck);
    tap_ok(w && rc == FSDP_EINVAL && !ck &&
               strstr(fsdp_ctx_last_error(ctx), "world_size 5 but 3 files"),
           "io: an index whose world_size (5) disagrees with its 3 files is refused (%s)",
           fsdp_ctx_last_error(ctx));

    /* replacing, stale and foreign staging directories */
    rc = write_small(ctx, dir, 100.0f);
    fsdp_ckpt_open(ctx, dir, &ck);
    rc = rc == 0 && ck ? fsdp_ckpt_read(ck, "a", 0, NA, FSDP_DTYPE_F32, a, sizeof a) : FSDP_EINVAL;
    fsdp_ckpt_close(ck);
    fsdp_ckpt_staging_path(dir, stage, sizeof stage);
    tap_ok(rc == 0 && a[0] == a_val(0) + 100.0f && a[14] == a_val(14) + 100.0f && !exists(stage),
           "io: saving over a checkpoint replaces it whole and leaves no staging directory");
    mkdir(stage, 0777);
    snprintf(p, sizeof p, "%s/rank-0-of-3.safetensors", stage);
    FILE *f = fopen(p, "w");
    if (f) fclose(f);
    rc = write_small(ctx, dir, 0.0f);
    tap_ok(rc == 0 && !exists(stage), "io: a stale staging directory of a killed save is cleared");
    mkdir(stage, 0777);
    snprintf(p, sizeof p, "%s/notes.txt", stage);
    f = fopen(p, "w");
    if (f) fclose(f);
    rc = write_small(ctx, dir, 50.0f);
    tap_ok(rc == FSDP_EINVAL && strstr(fsdp_ctx_last_error(ctx), "notes.txt") && exists(p),
           "io: a staging directory holding a foreign file is refused, naming it, and kept");
    fsdp_ckpt_open(ctx, dir, &ck);
    rc = ck ? fsdp_ckpt_read(ck, "a", 0, NA, FSDP_DTYPE_F32, a, sizeof a) : FSDP_EINVAL;
    fsdp_ckpt_close(ck);
    tap_ok(rc == 0 && a[3] == a_val(3), "io: ... and the published checkpoint is untouched");
    unlink(p);
    rmdir(stage);
    fsdp_ctx_destroy(ctx);
}

/* ---- through FSDP --------------------------------------------------------------------------- */

typedef struct ck_job {
    fu_job_t j; /* first */
    bool save;
    bool hybrid; /* groups of 2 ranks */
    const char *dir, *dir2;
    fsdp_named_list_t *full; /* rank 0's FULL state dict at the save (host copies) */
    fsdp_ctx_t *host;        /* the context of those copies */
} ck_job_t;

/* Copies rank 0's FULL state dict to host tensors of cj->host, which outlive the sim run. */
static int keep(ck_job_t *cj, const fsdp_named_list_t *sd) {
    fsdp_named_list_t *f = cj->full;
    f->names = calloc(sd->n + 1, sizeof *f->names);
    f->tensors = calloc(sd->n + 1, sizeof *f->tensors);
    f->owned = true;
    if (!f->names || !f->tensors) return FSDP_ENOMEM;
    int rc = FSDP_OK;
    for (size_t i = 0; i < sd->n && rc == 0; i++) {
        const fsdp_tensor_t *t = sd->tensors[i];
        size_t nb = (size_t)fsdp_tensor_numel(t) * fsdp_dtype_size(fsdp_tensor_dtype(t));
        void *h = malloc(nb + 1);
        rc = h ? fsdp_tensor_to_host(t, h, nb) : FSDP_ENOMEM;
        if (rc == 0)
            rc = fsdp_tensor_from_host(cj->host, fsdp_tensor_dtype(t), fsdp_tensor_ndim(t),
                                       fsdp_tensor_shape(t), h, FSDP_MEM_OTHER, &f->tensors[i]);
        free(h);
        f->names[i] = strdup(sd->names[i]);
        f->n = i + 1;
    }
    return rc;
}

static int ck_rank(fsdp_ctx_t *ctx, void *arg) {
    ck_job_t *cj = arg;
    fu_res_t *r = fu_res_of(&cj->j, ctx);
    fsdp_module_t *m = NULL;
    fsdp_unit_t *root = NULL;
    fsdp_optim_t *opt = NULL;
    fsdp_named_list_t params = {0}, sd = {0};
    fsdp_pg_t *shard = NULL, *repl = NULL;
    fsdp_ckpt_t *ck = NULL;
    int rc, rank = fsdp_ctx_rank(ctx);
    fsdp_options_t o;
    fu_job_options(&cj->j, &o);
    o.check_exec_order = false;
    if (cj->hybrid) {
        FU_TRY(done, "groups", fsdp_pg_split(fsdp_ctx_pg(ctx), rank / 2, rank, &shard));
        FU_TRY(done, "groups", fsdp_pg_split(fsdp_ctx_pg(ctx), rank % 2, rank, &repl));
        o.pg = shard;
        o.replicate_pg = repl;
    }
    FU_TRY(done, "model", tm_transformer_create(ctx, false, true, &m));
    FU_TRY(done, "wrapping", fu_wrap_transformer_opts(m, &o, &root));
    FU_TRY(done, "optimizer", fsdp_named_params(root, &params));
    FU_TRY(done, "optimizer", fsdp_optim_adam_create(ctx, NULL, true, &opt));
    FU_TRY(done, "optimizer",
           fsdp_optim_add_group(opt, params.n, params.tensors, (const char *const *)params.names,
                                NULL, NULL));
    if (cj->save) {
        for (int step = 0; step < 2; step++)
            FU_TRY(done, "training", fu_transformer_step(ctx, m, opt));
        fsdp_safetensors_kv_t meta[] = {{"step", "2"}};
        FU_TRY(done, "saving", fsdp_checkpoint_save(root, opt, cj->dir, meta, 1));
        FU_TRY(done, "FULL state dict", fsdp_full_state_dict(root, NULL, &sd));
        if (rank == 0) FU_TRY(done, "keeping the FULL state dict", keep(cj, &sd));
        goto done;
    }
    FU_TRY(done, "opening", fsdp_ckpt_open(ctx, cj->dir, &ck));
    FU_TRY(done, "loading", fsdp_checkpoint_load(root, opt, ck));
    FU_TRY(done, "FULL state dict", fsdp_full_state_dict(root, NULL, &sd));
    bool same = sd.n == cj->full->n;
    char why[300] = "";
    for (size_t i = 0; same && i < sd.n; i++) {
        const fsdp_tensor_t *a = sd.tensors[i], *b = cj->full->tensors[i];
        same = strcmp(sd.names[i], cj->full->names[i]) == 0 && fu_same_bits(a, b) == 1;
        if (!same) snprintf(why, sizeof why, "'%s' differs", sd.names[i]);
    }
    fu_ck(r, same, "the loaded model's FULL state dict is bitwise the saved one", "%s", why);
    FU_TRY(done, "saving again", fsdp_checkpoint_save(root, opt, cj->dir2, NULL, 0));
done:
    fsdp_ckpt_close(ck);
    fsdp_tape_clear(ctx);
    fsdp_named_list_free(&params);
    fsdp_named_list_free(&sd);
    fsdp_optim_destroy(opt);
    fsdp_unit_destroy(root);
    fsdp_module_release(m);
    fsdp_pg_destroy(shard);
    fsdp_pg_destroy(repl);
    return rc < 0 ? rc : 0;
}

/* Whether every tensor of checkpoints a and b is bitwise equal (read whole, as stored). */
static bool same_dirs(const char *a, const char *b, char *why, size_t cap) {
    fsdp_ckpt_t *x = NULL, *y = NULL;
    bool same = fsdp_ckpt_open(NULL, a, &x) == 0 && fsdp_ckpt_open(NULL, b, &y) == 0 &&
                fsdp_ckpt_count(x) == fsdp_ckpt_count(y);
    if (!same) snprintf(why, cap, "cannot open both, or counts differ");
    for (size_t i = 0; same && i < fsdp_ckpt_count(x); i++) {
        fsdp_ckpt_info_t ix, iy;
        fsdp_ckpt_info(x, i, &ix);
        same = fsdp_ckpt_find(y, ix.name, &iy) == 0 && iy.numel == ix.numel &&
               strcmp(ix.st_dtype, iy.st_dtype) == 0;
        size_t nb = (size_t)ix.numel * ix.esize;
        void *bx = malloc(nb + 1), *by = malloc(nb + 1);
        same = same && bx && by && fsdp_ckpt_read_raw(x, ix.name, 0, ix.numel, bx, nb) == 0 &&
               fsdp_ckpt_read_raw(y, ix.name, 0, ix.numel, by, nb) == 0 && memcmp(bx, by, nb) == 0;
        if (!same) snprintf(why, cap, "'%s' differs", ix.name);
        free(bx);
        free(by);
    }
    fsdp_ckpt_close(x);
    fsdp_ckpt_close(y);
    return same;
}

/* Pieces of sharded tensors (model entries and moment buffers) in rank file r of world w of dir,
 * or -1 when it cannot be opened. */
static long rank_file_pieces(const char *dir, int r, int w) {
    char p[600];
    snprintf(p, sizeof p, "%s/rank-%d-of-%d.safetensors", dir, r, w);
    fsdp_safetensors_t *st = NULL;
    if (fsdp_safetensors_open(NULL, p, &st) < 0) return -1;
    long n = 0;
    for (size_t i = 0; i < fsdp_safetensors_count(st); i++) {
        fsdp_safetensors_info_t in;
        fsdp_safetensors_info(st, i, &in);
        n += strncmp(in.name, "model.", 6) == 0 || strstr(in.name, ".exp_avg") != NULL;
    }
    fsdp_safetensors_close(st);
    return n;
}

static void fsdp_tests(void) {
    fsdp_named_list_t full = {0};
    fsdp_ctx_t *host = NULL;
    fsdp_ctx_create(NULL, &host);
    char dir[400], dir2[400], why[300] = "";
    path_of(dir, sizeof dir, "w2", NULL);
    ck_job_t *cj = calloc(1, sizeof *cj);
    fu_job_init(&cj->j, "save at world 2, FULL_SHARD", 2, FSDP_FULL_SHARD, false);
    cj->save = true;
    cj->dir = dir;
    cj->full = &full;
    cj->host = host;
    fu_run_job(&cj->j, ck_rank);
    static const struct {
        int world;
        fsdp_sharding_strategy_t s;
        bool hybrid;
        const char *label;
    } loads[] = {{1, FSDP_FULL_SHARD, false, "FULL_SHARD"},
                 {3, FSDP_SHARD_GRAD_OP, false, "SHARD_GRAD_OP"},
                 {4, FSDP_FULL_SHARD, false, "FULL_SHARD"},
                 {4, FSDP_HYBRID_SHARD, true, "HYBRID_SHARD (groups of 2)"}};
    for (size_t i = 0; i < sizeof loads / sizeof loads[0]; i++) {
        char prefix[160], sub[32];
        snprintf(prefix, sizeof prefix, "load at world %d, %s", loads[i].world, loads[i].label);
        snprintf(sub, sizeof sub, "again-%zu", i);
        path_of(dir2, sizeof dir2, sub, NULL);
        fu_job_init(&cj->j, prefix, loads[i].world, loads[i].s, false);
        cj->save = false;
        cj->hybrid = loads[i].hybrid;
        cj->dir2 = dir2;
        fu_run_job(&cj->j, ck_rank);
        tap_ok(same_dirs(dir, dir2, why, sizeof why),
               "%s: saved again, every model and optimizer tensor is bitwise the first "
               "checkpoint's %s",
               prefix, why);
        if (loads[i].hybrid)
            tap_ok(rank_file_pieces(dir2, 1, 4) > 0 && rank_file_pieces(dir2, 2, 4) == 0 &&
                       rank_file_pieces(dir2, 3, 4) == 0,
                   "%s: the second replica's files hold no model or moment pieces (written once)",
                   prefix);
    }
    fsdp_named_list_free(&full);
    fsdp_ctx_destroy(host);
    free(cj);
}

static void rm_rf(const char *p) {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", p);
    if (system(cmd) != 0) fprintf(stderr, "# could not remove %s\n", p);
}

int main(void) {
    tap_plan_lazy();
    snprintf(tmpdir, sizeof tmpdir, "%s/t_checkpoint.XXXXXX",
             getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(tmpdir)) {
        printf("Bail out! cannot create a temporary directory\n");
        return 1;
    }
    io_tests();
    fsdp_tests();
    if (!getenv("KEEP")) rm_rf(tmpdir);
    return tap_done();
}
