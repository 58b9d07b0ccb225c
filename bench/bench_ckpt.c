/* SPDX-License-Identifier: MIT */
/*
 * bench_ckpt.c: saving and loading a sharded checkpoint directory (fsdp_checkpoint_save,
 * fsdp_checkpoint_load) against cp of the same bytes on the same disk, in one process.
 *
 * The model is a GPT built, wrapped (one unit per block, use_orig_params, FULL_SHARD) and
 * optimized (AdamW) by the GPT recipe, as every GPT benchmark here; by default ~100 M parameters
 * (12 blocks, width 768, 12 heads, vocabulary 16384, sequence 32), over --world sim ranks
 * (default 4). One training step on a single sequence makes AdamW's state (two moments per
 * parameter), so a checkpoint holds 3 x 4 bytes per parameter (~1.2 GB).
 *
 * Each round, on every rank after a barrier:
 *   save   fsdp_checkpoint_save to a new directory (ranks write their files in parallel, rank 0
 *          the index; every file fsync'ed, the directory renamed into place and its parent
 *          synced), as fsdp-train writes DIR/step-<S>;
 *   load   fsdp_ckpt_open + fsdp_checkpoint_load into a second model and AdamW at the same world
 *          size, built from other weights and never stepped, as a resume does (each rank preads
 *          its byte ranges into its shards and AdamW's state, which the first load creates).
 * Then, in the same process, the baselines on the same bytes and disk:
 *   cp+sync  cp -r DIR/ckpt DIR/copy, then sync of the copied files (the save's durability);
 *   cp       cp -r DIR/ckpt DIR/copy (into the page cache only);
 *   read     cat of every file to /dev/null (reading alone).
 * Rates are bytes of the directory per second; the ratios are save / cp+sync and load / cp (the
 * issue's target: >= 0.5 for both). Medians of --rounds rounds (default 3). The page cache is
 * warm for the loads and reads (the files were just written), as for a resume right after a
 * save; a cold-cache load is bounded by the disk like cat.
 *
 * Options: --layers N --d N --heads N --vocab N --world N --rounds N --dir PATH (default
 * $TMPDIR or /tmp), --quick (2 blocks, width 128: a smoke test). Exit status 0 when every run
 * succeeded and the second model and optimizer, loaded, were bitwise the saved ones (checked
 * once, by saving them and comparing every tensor of the two directories), 1 otherwise, 2 for
 * bad options.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <dirent.h>

#include <fsdp.h>

#include "bench_util.h"

#define PROG "bench_ckpt"
#define MAX_ROUNDS 16

typedef struct job {
    bench_gpt_shape_t m;
    int world, rounds;
    char dir[1024];
    double t1[64][MAX_ROUNDS][2]; /* [rank][round]: save, load seconds */
    int64_t nparams;
} job_t;

static int rank_fn(fsdp_ctx_t *ctx, void *arg) {
    job_t *j = arg;
    bench_rank_t s = {.ctx = ctx}, f = {.ctx = ctx}; /* f: a fresh model the loads go into */
    int r = fsdp_ctx_rank(ctx), rc;
    fsdp_options_t fo;
    fsdp_adam_options_t h;
    double ph[PH_COUNT], loss;
    const char *failed = "";
    char ck[1100];
    snprintf(ck, sizeof ck, "%s/ckpt", j->dir);
    bench_fsdp_options(&fo);
    fsdp_gpt_recipe_adamw_options_init(&h);
    if ((rc = bench_rank_model(&s, &j->m, 1)) < 0 || (rc = bench_rank_wrap(&s, &j->m, &fo)) < 0 ||
        (rc = bench_rank_train_setup(&s, &j->m, &h, 7)) < 0)
        goto out;
    if ((rc = bench_rank_model(&f, &j->m, 2)) < 0 || (rc = bench_rank_wrap(&f, &j->m, &fo)) < 0 ||
        (rc = bench_rank_train_setup(&f, &j->m, &h, 7)) < 0) {
        snprintf(s.err, sizeof s.err, "%s", f.err);
        goto out;
    }
    if (r == 0) j->nparams = s.nparams;
    if ((rc = bench_train_step(s.opt, bench_rank_loss, &s, ph, &loss, &failed)) < 0) {
        rc = bench_rank_fail(&s, failed, rc);
        goto out;
    }
    fsdp_pg_t *pg = fsdp_ctx_pg(ctx);
    for (int k = 0; k < j->rounds; k++) {
        fsdp_ckpt_t *h2 = NULL;
        /* a new directory each round, as fsdp-train's step-<S> (the last one is "ckpt") */
        if (k + 1 < j->rounds)
            snprintf(ck, sizeof ck, "%s/round-%d", j->dir, k);
        else
            snprintf(ck, sizeof ck, "%s/ckpt", j->dir);
        if ((rc = fsdp_pg_barrier(pg, NULL)) < 0) goto out;
        double a = bench_now_s();
        if ((rc = fsdp_checkpoint_save(s.root, s.opt, ck, NULL, 0)) < 0) {
            rc = bench_rank_fail(&s, "fsdp_checkpoint_save", rc);
            goto out;
        }
        double b = bench_now_s();
        if ((rc = fsdp_pg_barrier(pg, NULL)) < 0) goto out;
        double c = bench_now_s();
        rc = fsdp_ckpt_open(ctx, ck, &h2);
        if (rc == 0) rc = fsdp_checkpoint_load(f.root, f.opt, h2);
        fsdp_ckpt_close(h2);
        double d = bench_now_s();
        if (rc < 0) {
            rc = bench_rank_fail(&s, "fsdp_checkpoint_load", rc);
            goto out;
        }
        j->t1[r][k][0] = b - a;
        j->t1[r][k][1] = d - c;
    }
    /* the fresh model's loaded state, saved, must be the same bytes */
    char again[1100];
    snprintf(again, sizeof again, "%s/again", j->dir);
    if ((rc = fsdp_checkpoint_save(f.root, f.opt, again, NULL, 0)) < 0)
        rc = bench_rank_fail(&s, "saving the loaded state", rc);
out:
    if (rc < 0 && s.err[0]) fprintf(stderr, "%s: %s\n", PROG, s.err);
    bench_rank_teardown(&f);
    bench_rank_teardown(&s);
    return rc;
}

static double dir_bytes(const char *dir) {
    DIR *d = opendir(dir);
    double n = 0;
    struct dirent *de;
    char p[2200];
    struct stat sb;
    while (d && (de = readdir(d)) != NULL) {
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        if (stat(p, &sb) == 0 && S_ISREG(sb.st_mode)) n += (double)sb.st_size;
    }
    if (d) closedir(d);
    return n;
}

/* Whether checkpoints a and b hold the same tensors with the same bytes (read whole, as
 * stored; which rank's file holds a replicated scalar may differ). */
static bool same_tensors(const char *a, const char *b) {
    fsdp_ckpt_t *x = NULL, *y = NULL;
    bool same = fsdp_ckpt_open(NULL, a, &x) == 0 && fsdp_ckpt_open(NULL, b, &y) == 0 &&
                fsdp_ckpt_count(x) == fsdp_ckpt_count(y);
    for (size_t i = 0; same && i < fsdp_ckpt_count(x); i++) {
        fsdp_ckpt_info_t ix, iy;
        fsdp_ckpt_info(x, i, &ix);
        size_t nb = (size_t)ix.numel * ix.esize;
        void *bx = malloc(nb + 1), *by = malloc(nb + 1);
        same = fsdp_ckpt_find(y, ix.name, &iy) == 0 && iy.numel == ix.numel &&
               strcmp(ix.st_dtype, iy.st_dtype) == 0 && bx && by &&
               fsdp_ckpt_read_raw(x, ix.name, 0, ix.numel, bx, nb) == 0 &&
               fsdp_ckpt_read_raw(y, ix.name, 0, ix.numel, by, nb) == 0 && memcmp(bx, by, nb) == 0;
        if (!same) fprintf(stderr, "%s: '%s' differs after the load\n", PROG, ix.name);
        free(bx);
        free(by);
    }
    fsdp_ckpt_close(x);
    fsdp_ckpt_close(y);
    return same;
}

/* Runs a shell command, returning its wall time (or -1 when it failed). */
static double timed(const char *cmd) {
    double a = bench_now_s();
    int rc = system(cmd);
    double b = bench_now_s();
    return rc == 0 ? b - a : -1;
}

static int usage(const char *why) {
    if (why) fprintf(stderr, "%s: %s (try --help)\n", PROG, why);
    return 2;
}

int main(int argc, char **argv) {
    static job_t j;
    j.m = (bench_gpt_shape_t){12, 768, 12, 32, 1, 16384};
    j.world = 4;
    j.rounds = 3;
    snprintf(j.dir, sizeof j.dir, "%s", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int64_t x = 0;
        if (strcmp(o, "--help") == 0) {
            printf("usage: %s [--layers N] [--d N] [--heads N] [--vocab N] [--world N] "
                   "[--rounds N] [--dir PATH] [--quick]\n(see the top of bench/bench_ckpt.c)\n",
                   PROG);
            return 0;
        }
        if (strcmp(o, "--quick") == 0) {
            j.m = (bench_gpt_shape_t){2, 128, 4, 32, 1, 1024};
            j.rounds = 2;
            continue;
        }
        if (!v) return usage("an option needs a value");
        i++;
        if (strcmp(o, "--dir") == 0) {
            snprintf(j.dir, sizeof j.dir, "%s", v);
            continue;
        }
        if (bench_parse_i64(PROG, o, v, 1, INT32_MAX, &x) < 0) return 2;
        if (strcmp(o, "--layers") == 0)
            j.m.layers = x;
        else if (strcmp(o, "--d") == 0)
            j.m.d = x;
        else if (strcmp(o, "--heads") == 0)
            j.m.heads = x;
        else if (strcmp(o, "--vocab") == 0)
            j.m.vocab = x;
        else if (strcmp(o, "--world") == 0 && x <= 64)
            j.world = (int)x;
        else if (strcmp(o, "--rounds") == 0 && x <= MAX_ROUNDS)
            j.rounds = (int)x;
        else
            return usage("unknown option or value out of range");
    }
    char base[1024];
    if (snprintf(base, sizeof base, "%.990s/bench_ckpt.XXXXXX", j.dir) >= (int)sizeof base)
        return usage("--dir too long");
    if (!mkdtemp(base)) return usage("cannot create a directory under --dir");
    snprintf(j.dir, sizeof j.dir, "%s", base);
    fsdp_sim_options_t so;
    fsdp_sim_options_init(&so);
    so.world_size = j.world;
    so.seed = 1;
    int rc = fsdp_sim_run(&so, rank_fn, &j, NULL);
    char ck[1100], cmd[4600];
    snprintf(ck, sizeof ck, "%s/ckpt", j.dir);
    double bytes = dir_bytes(ck);
    double save[MAX_ROUNDS], load[MAX_ROUNDS], cps[MAX_ROUNDS], cp[MAX_ROUNDS], rd[MAX_ROUNDS];
    bool same = false;
    if (rc == 0) {
        char again[1100];
        snprintf(again, sizeof again, "%s/again", j.dir);
        same = same_tensors(ck, again);
        for (int k = 0; k < j.rounds; k++) {
            save[k] = load[k] = 0;
            for (int r = 0; r < j.world; r++) {
                if (j.t1[r][k][0] > save[k]) save[k] = j.t1[r][k][0];
                if (j.t1[r][k][1] > load[k]) load[k] = j.t1[r][k][1];
            }
            snprintf(cmd, sizeof cmd,
                     "rm -rf '%s/copy' && cp -r '%s' '%s/copy' && sync '%s/copy'/*", j.dir, ck,
                     j.dir, j.dir);
            cps[k] = timed(cmd);
            snprintf(cmd, sizeof cmd, "rm -rf '%s/copy'", j.dir);
            if (system(cmd) != 0) cps[k] = -1;
            snprintf(cmd, sizeof cmd, "cp -r '%s' '%s/copy'", ck, j.dir);
            cp[k] = timed(cmd);
            snprintf(cmd, sizeof cmd, "cat '%s'/* > /dev/null", ck);
            rd[k] = timed(cmd);
            snprintf(cmd, sizeof cmd, "rm -rf '%s/copy'", j.dir);
            if (system(cmd) != 0) cp[k] = -1;
        }
    }
    snprintf(cmd, sizeof cmd, getenv("BENCH_CKPT_KEEP") ? "true" : "rm -rf '%s'", j.dir);
    if (system(cmd) != 0) fprintf(stderr, "%s: could not remove %s\n", PROG, j.dir);
    if (rc < 0) return 1;
    double ms = bench_median(save, j.rounds), ml = bench_median(load, j.rounds),
           mcs = bench_median(cps, j.rounds), mc = bench_median(cp, j.rounds),
           mr = bench_median(rd, j.rounds);
    double gb = bytes / 1e9;
    printf("# GPT %lld params (%lld blocks, d %lld, vocab %lld), AdamW state; %d sim ranks; "
           "checkpoint %.3f GB in %d rank files + index; medians of %d rounds\n",
           (long long)j.nparams, (long long)j.m.layers, (long long)j.m.d, (long long)j.m.vocab,
           j.world, gb, j.world, j.rounds);
    printf("%-8s %10s %10s %12s\n", "what", "seconds", "GB/s", "vs baseline");
    printf("%-8s %10.3f %10.2f %12s\n", "cp+sync", mcs, gb / mcs, "1.00 (save)");
    printf("%-8s %10.3f %10.2f %12s\n", "cp", mc, gb / mc, "1.00 (load)");
    printf("%-8s %10.3f %10.2f %12s\n", "read", mr, gb / mr, "-");
    printf("%-8s %10.3f %10.2f %12.2f\n", "save", ms, gb / ms, mcs / ms);
    printf("%-8s %10.3f %10.2f %12.2f\n", "load", ml, gb / ml, mc / ml);
    printf("# target: save >= 0.5x cp+sync: %s; load >= 0.5x cp: %s; the second model, loaded "
           "and saved, holds the checkpoint's tensors bit for bit: %s\n",
           mcs / ms >= 0.5 ? "met" : "MISSED", mc / ml >= 0.5 ? "met" : "MISSED",
           same ? "yes" : "NO");
    return same && mcs > 0 && mc > 0 ? 0 : 1;
}
