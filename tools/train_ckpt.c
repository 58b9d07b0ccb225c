/* SPDX-License-Identifier: MIT */
/*
 * train_ckpt.c: fsdp-train's checkpoints (--save-every, --resume) and --export.
 *
 * A checkpoint of step S is the checkpoint directory DIR/step-S/ (fsdp/checkpoint.h), written by
 * fsdp_checkpoint_save: every rank's file of its pieces of the model ("model.<fqn>") and of the
 * AdamW state keyed by parameter name ("optim.<fqn>.exp_avg", ...), and an index.json whose
 * metadata holds the step, the loader position, the producer, the run id, every flag (the
 * "flags" record, compact JSON of train_opts_json) and, with --precision f16, the gradient
 * scaler's state (its scale, factors, interval and growth tracker, under PyTorch's state_dict
 * keys, and the steps skipped so far); every rank file carries a copy of that metadata, which
 * the library compares with the index. The directory appears whole or not at all, so a save
 * killed at any point leaves every earlier checkpoint loadable.
 *
 * Before the ranks start, train_ckpt_resolve finds the checkpoint (--resume latest: the newest
 * complete one, skipping staging directories, unreadable or mixed ones, and directories whose
 * name and step disagree), range-checks its step and compares its flags with the run's. Rank 0
 * removes the staging directories of dead saves before each save (train_ckpt_cleanup) and
 * prunes after it (train_ckpt_prune, --keep-last). A resume at any world
 * size, backend or strategy reads, on each rank, only the byte ranges of its own part
 * (fsdp_checkpoint_load). `fsdp-ckpt consolidate DIR/step-S model.safetensors` makes the one
 * full file that --init and other tools take; --export writes that file directly (its metadata
 * names the layout, "layout": "libfsdp"). --export-format hf writes, instead, a directory that
 * transformers' GPT2LMHeadModel.from_pretrained() takes: model.safetensors in Hugging Face's
 * layout ("transformer." names, Conv1D weights (in, out), "format": "pt", "layout":
 * "huggingface-gpt2") and config.json.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tools/train.h"

/* Hugging Face's config.json for GPT m's configuration: what GPT2LMHeadModel.from_pretrained
 * reads to build the model the weights fit. libfsdp's GPT is GPT-2's architecture: GELU with the
 * tanh approximation ("gelu_new"), biases everywhere, the head tied to wte, attention scaled by
 * 1/sqrt(head width). Written atomically (a temporary file renamed over path). */
static int write_hf_config(const fsdp_gpt_config_t *c, const char *path, char *err, size_t cap) {
    int64_t inner = c->d_ff > 0 ? c->d_ff : 4 * c->d_model;
    json_t *j = json_pack(
        "{s:s, s:[s], s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:s, s:f, s:f, s:f, s:f, s:f, s:b, s:b,"
        " s:b, s:s, s:s}",
        "model_type", "gpt2", "architectures", "GPT2LMHeadModel", "vocab_size",
        (json_int_t)c->vocab, "n_positions", (json_int_t)c->max_seq, "n_ctx",
        (json_int_t)c->max_seq, "n_embd", (json_int_t)c->d_model, "n_layer", (json_int_t)c->n_layer,
        "n_head", (json_int_t)c->n_head, "n_inner", (json_int_t)inner, "activation_function",
        "gelu_new", "layer_norm_epsilon", c->layer_norm_eps, "initializer_range", c->init_std,
        "resid_pdrop", c->dropout, "embd_pdrop", c->dropout, "attn_pdrop", c->dropout,
        "tie_word_embeddings", 1, "scale_attn_weights", 1, "use_cache", 1, "torch_dtype", "float32",
        "libfsdp_version", fsdp_version_string());
    if (!j) {
        snprintf(err, cap, "writing %s: out of memory", path);
        return FSDP_ENOMEM;
    }
    size_t n = strlen(path) + 32;
    char *tmp = malloc(n);
    int rc = FSDP_OK;
    if (!tmp) {
        rc = FSDP_ENOMEM;
        snprintf(err, cap, "writing %s: out of memory", path);
    } else {
        snprintf(tmp, n, "%s.tmp-%ld", path, (long)getpid());
        if (json_dump_file(j, tmp, JSON_INDENT(2) | JSON_SORT_KEYS) != 0 ||
            rename(tmp, path) != 0) {
            snprintf(err, cap, "writing %s: %s", path, strerror(errno));
            unlink(tmp);
            rc = FSDP_EINVAL;
        }
    }
    free(tmp);
    json_decref(j);
    return rc;
}

/* Rank 0's part of an export: the file, or (hf) the directory with its two files. */
static int write_export(const fsdp_module_t *model, const char *path, bool hf,
                        const fsdp_safetensors_kv_t *meta, size_t nmeta, char *err, size_t cap) {
    fsdp_ctx_t *ctx = fsdp_module_ctx(model);
    if (!hf) {
        int rc = fsdp_safetensors_save_module(model, path, meta, nmeta);
        if (rc < 0) snprintf(err, cap, "writing %s: %s", path, fsdp_ctx_last_error(ctx));
        return rc;
    }
    struct stat sb;
    if (mkdir(path, 0777) != 0 &&
        !(errno == EEXIST && stat(path, &sb) == 0 && S_ISDIR(sb.st_mode))) {
        snprintf(err, cap, "--export-format hf: %s must be a directory (or not exist): %s", path,
                 errno == EEXIST ? "it exists and is not a directory" : strerror(errno));
        return FSDP_EINVAL;
    }
    char file[4096], conf[4096];
    int n1 = snprintf(file, sizeof file, "%s/model.safetensors", path);
    int n2 = snprintf(conf, sizeof conf, "%s/config.json", path);
    if (n1 < 0 || n2 < 0 || (size_t)n1 >= sizeof file || (size_t)n2 >= sizeof conf) {
        snprintf(err, cap, "--export: the path is too long: %s", path);
        return FSDP_EINVAL;
    }
    int rc = fsdp_gpt2_hf_save(model, file, meta, nmeta);
    if (rc < 0) {
        snprintf(err, cap, "writing %s: %s", file, fsdp_ctx_last_error(ctx));
        return rc;
    }
    return write_hf_config(fsdp_gpt_get_config(model), conf, err, cap);
}

/* Gathers the full model to rank 0, which writes it (write_export); collective. */
static int save_full(fsdp_ctx_t *ctx, fsdp_unit_t *root, const fsdp_module_t *model,
                     const char *path, bool hf, int64_t step, char *err, size_t cap) {
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
        /* The layout is named, so that --init never has to guess it from the shapes (the square
         * attn.c_proj weights read the same either way). */
        fsdp_safetensors_kv_t meta[] = {{"step", s_step},
                                        {"producer", TRAIN_PROG},
                                        {"layout", hf ? TRAIN_LAYOUT_HF : TRAIN_LAYOUT_LIBFSDP}};
        save_rc = write_export(model, path, hf, meta, 3, err, cap);
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

int train_save_full(fsdp_ctx_t *ctx, fsdp_unit_t *root, const fsdp_module_t *model,
                    const char *path, int64_t step, char *err, size_t cap) {
    return save_full(ctx, root, model, path, false, step, err, cap);
}

int train_export_hf(fsdp_ctx_t *ctx, fsdp_unit_t *root, const fsdp_module_t *model, const char *dir,
                    int64_t step, char *err, size_t cap) {
    return save_full(ctx, root, model, dir, true, step, err, cap);
}

/* The gradient scaler's state in the optimizer file's metadata (PyTorch's state_dict keys). */
#define SCALER_KEYS 6
static const char *const SCALER_KEY[SCALER_KEYS] = {
    "grad_scaler.scale",           "grad_scaler.growth_factor",  "grad_scaler.backoff_factor",
    "grad_scaler.growth_interval", "grad_scaler.growth_tracker", "grad_scaler.skipped_steps"};

static int meta_u64(const fsdp_ckpt_t *ck, const char *key, uint64_t *out) {
    const char *v = fsdp_ckpt_metadata(ck, key);
    if (!v) return FSDP_EINVAL;
    char *end = NULL;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || end == v || *end) return FSDP_EINVAL;
    *out = x;
    return 0;
}

static int meta_double(const fsdp_ckpt_t *ck, const char *key, double *out) {
    const char *v = fsdp_ckpt_metadata(ck, key);
    if (!v) return FSDP_EINVAL;
    char *end = NULL;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || *end) return FSDP_EINVAL;
    *out = x;
    return 0;
}

/* The scaler's state from the index's metadata, loaded into scaler (validated there:
 * nothing changes on an error); *skipped receives the steps skipped so far. */
static int load_scaler(const fsdp_ckpt_t *ost, const char *opath, fsdp_grad_scaler_t *scaler,
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

int train_ckpt_save(fsdp_ctx_t *ctx, fsdp_unit_t *root, fsdp_optim_t *opt, const char *dir,
                    int64_t step, const train_ckpt_extra_t *extra, char *err, size_t cap) {
    char sdir[4096];
    int n = snprintf(sdir, sizeof sdir, "%s/step-%" PRId64, dir, step);
    if (n <= 0 || (size_t)n >= sizeof sdir) {
        snprintf(err, cap, "checkpoint directory name too long: %s", dir);
        return FSDP_EINVAL;
    }
    fsdp_grad_scaler_state_t gs = {0};
    int rc = extra->scaler ? fsdp_grad_scaler_state_dict(extra->scaler, &gs) : 0;
    if (rc < 0) {
        snprintf(err, cap, "the gradient scaler's state: %s", fsdp_ctx_last_error(ctx));
        return rc;
    }
    char s_step[32], s_pos[32], sv[SCALER_KEYS][40];
    snprintf(s_step, sizeof s_step, "%" PRId64, step);
    snprintf(s_pos, sizeof s_pos, "%" PRIu64, extra->position);
    /* %.17g: every double reads back to the same bits */
    snprintf(sv[0], sizeof sv[0], "%.17g", gs.scale);
    snprintf(sv[1], sizeof sv[1], "%.17g", gs.growth_factor);
    snprintf(sv[2], sizeof sv[2], "%.17g", gs.backoff_factor);
    snprintf(sv[3], sizeof sv[3], "%" PRId64, gs.growth_interval);
    snprintf(sv[4], sizeof sv[4], "%" PRId64, gs.growth_tracker);
    snprintf(sv[5], sizeof sv[5], "%" PRId64, extra->skipped);
    fsdp_safetensors_kv_t meta[5 + SCALER_KEYS];
    size_t k = 0;
    meta[k++] = (fsdp_safetensors_kv_t){"step", s_step};
    meta[k++] = (fsdp_safetensors_kv_t){"loader_position", s_pos};
    meta[k++] = (fsdp_safetensors_kv_t){"producer", TRAIN_PROG};
    if (extra->run_id) meta[k++] = (fsdp_safetensors_kv_t){"run_id", extra->run_id};
    if (extra->flags) meta[k++] = (fsdp_safetensors_kv_t){"flags", extra->flags};
    for (int i = 0; extra->scaler && i < SCALER_KEYS; i++)
        meta[k++] = (fsdp_safetensors_kv_t){SCALER_KEY[i], sv[i]};
    rc = fsdp_checkpoint_save(root, opt, sdir, meta, k);
    if (rc < 0) snprintf(err, cap, "saving %s: %s", sdir, fsdp_ctx_last_error(ctx));
    return rc;
}

int train_ckpt_load(fsdp_ctx_t *ctx, fsdp_unit_t *root, fsdp_optim_t *opt, const char *sdir,
                    int64_t *step, train_ckpt_extra_t *extra, char *err, size_t cap) {
    err[0] = 0;
    fsdp_ckpt_t *ck = NULL;
    uint64_t s = 0, pos = 0;
    int64_t skipped = 0;
    int rc = fsdp_ckpt_open(ctx, sdir, &ck);
    if (rc < 0) goto lib_fail;
    if (!fsdp_ckpt_metadata(ck, "step") || !fsdp_ckpt_metadata(ck, "loader_position")) {
        snprintf(err, cap,
                 "--resume: %s lacks fsdp-train's metadata (step, loader_position): not a "
                 "checkpoint written by --save-every",
                 sdir);
        rc = FSDP_EINVAL;
        goto out;
    }
    /* Range-checked before use: a step of 2^63 must not wrap to a negative one. */
    if (meta_u64(ck, "step", &s) < 0 || s > (uint64_t)TRAIN_MAX_STEPS ||
        meta_u64(ck, "loader_position", &pos) < 0) {
        bool bad_step = meta_u64(ck, "step", &s) < 0 || s > (uint64_t)TRAIN_MAX_STEPS;
        snprintf(err, cap, "--resume: %s: the metadata's %s is '%.40s', not %s", sdir,
                 bad_step ? "step" : "loader_position",
                 fsdp_ckpt_metadata(ck, bad_step ? "step" : "loader_position"),
                 bad_step ? "a step count from 0 to 2^40" : "a token position (0 to 2^64-1)");
        rc = FSDP_EINVAL;
        goto out;
    }
    if (extra->scaler && (rc = load_scaler(ck, sdir, extra->scaler, &skipped, err, cap)) < 0) {
        if (err[0]) goto out;
        goto lib_fail;
    }
    if (skipped > (int64_t)s) {
        snprintf(err, cap, "--resume: %s: %lld skipped steps of %llu steps", sdir,
                 (long long)skipped, (unsigned long long)s);
        rc = FSDP_EINVAL;
        goto out;
    }
    /* the optimizer is loaded first (checked whole before anything changes), then the model */
    if ((rc = fsdp_checkpoint_load(root, opt, ck)) < 0) goto lib_fail;
    *step = (int64_t)s;
    extra->position = pos;
    extra->skipped = skipped;
    goto out;
lib_fail:
    snprintf(err, cap, "--resume: %s", fsdp_ctx_last_error(ctx));
out:
    fsdp_ckpt_close(ck);
    return rc;
}

/* ---- finding, checking, cleaning and pruning checkpoints (rank 0 or before the ranks) ------ */

/* The step of a directory entry called "step-<digits>" (exactly, at most 2^40); -1 otherwise.
 * *suffix receives what follows the digits. */
static int64_t step_of(const char *name, const char **suffix) {
    if (strncmp(name, "step-", 5) != 0 || name[5] < '0' || name[5] > '9') return -1;
    int64_t v = 0;
    const char *p = name + 5;
    for (; *p >= '0' && *p <= '9'; p++) {
        v = v * 10 + (*p - '0');
        if (v > TRAIN_MAX_STEPS) return -1;
    }
    if (suffix) *suffix = p;
    return v;
}

/* Why checkpoint directory sdir cannot be resumed from, into why; 0 when it can. A directory
 * named step-N must also say step N in its metadata (a checkpoint is never mixed from two
 * saves: the library compares every rank file's copy of the metadata with the index). */
static int unusable(const char *sdir, char *why, size_t cap) {
    const char *base = strrchr(sdir, '/');
    base = base ? base + 1 : sdir;
    const char *suffix = "";
    int64_t named = step_of(base, &suffix);
    if (named >= 0 && (strcmp(suffix, ".partial") == 0 || strcmp(suffix, ".partial.old") == 0)) {
        snprintf(why, cap, "it is the staging directory of a save that did not finish");
        return -1;
    }
    fsdp_ckpt_t *ck = NULL;
    fsdp_ctx_t *quiet = train_quiet_ctx();
    if (!quiet) {
        snprintf(why, cap, "out of memory");
        return -1;
    }
    int rc = fsdp_ckpt_open(quiet, sdir, &ck);
    if (rc < 0) {
        char stage[4200];
        struct stat sb;
        snprintf(stage, sizeof stage, "%s.partial", sdir);
        if (stat(sdir, &sb) != 0 && stat(stage, &sb) == 0)
            snprintf(why, cap, "its save did not finish (only %.900s is there)", stage);
        else
            snprintf(why, cap, "%s", fsdp_ctx_last_error(quiet));
    } else {
        /* every file's header is checked against the index, metadata copies included */
        rc = fsdp_ckpt_check_files(ck);
        const char *st = fsdp_ckpt_metadata(ck, "step");
        uint64_t v = 0;
        if (rc < 0) {
            snprintf(why, cap, "%s", fsdp_ckpt_last_error(ck));
        } else if (!st) {
            snprintf(why, cap, "its index has no step: not written by --save-every");
            rc = -1;
        } else if (meta_u64(ck, "step", &v) < 0 || v > (uint64_t)TRAIN_MAX_STEPS) {
            /* range-checked here, before any rank starts: 2^63 must not wrap */
            snprintf(why, cap, "its metadata's step is '%.40s', not a step count from 0 to 2^40",
                     st);
            rc = -1;
        } else if (named >= 0 && (int64_t)v != named) {
            snprintf(why, cap, "it is named step %lld but its metadata says step %llu",
                     (long long)named, (unsigned long long)v);
            rc = -1;
        }
    }
    fsdp_ckpt_close(ck);
    fsdp_ctx_destroy(quiet);
    return rc < 0 ? -1 : 0;
}

typedef struct found_step {
    int64_t step;
    char name[64];
} found_step_t;

static int cmp_step_desc(const void *a, const void *b) {
    const found_step_t *x = a, *y = b;
    return x->step < y->step ? 1 : x->step > y->step ? -1 : 0;
}

/* The entries of dir named step-N (suffix "" for checkpoints, ".partial"... for staging
 * directories), newest first; -1 (errno set) when dir cannot be read. */
static int list_steps(const char *dir, bool staging, found_step_t **out, size_t *n) {
    *out = NULL;
    *n = 0;
    DIR *d = opendir(dir);
    if (!d) return -1;
    size_t cap = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        const char *suffix = "";
        int64_t s = step_of(de->d_name, &suffix);
        if (s < 0 || strlen(de->d_name) >= sizeof(*out)->name) continue;
        bool is_stage = strcmp(suffix, ".partial") == 0 || strcmp(suffix, ".partial.old") == 0;
        if (staging ? !is_stage : *suffix != '\0') continue;
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            found_step_t *g = realloc(*out, cap * sizeof *g);
            if (!g) {
                closedir(d);
                free(*out);
                *out = NULL;
                errno = ENOMEM;
                return -1;
            }
            *out = g;
        }
        (*out)[*n].step = s;
        snprintf((*out)[*n].name, sizeof(*out)[*n].name, "%s", de->d_name);
        (*n)++;
    }
    closedir(d);
    if (*n > 1) qsort(*out, *n, sizeof **out, cmp_step_desc); /* *out may be NULL for none */
    return 0;
}

/* --resume latest: the newest usable checkpoint of dir into path. */
static int find_latest(const char *dir, bool say, char *path, size_t cap) {
    found_step_t *f = NULL, *partial = NULL;
    size_t n = 0, np = 0;
    if (list_steps(dir, false, &f, &n) < 0) {
        if (say)
            fprintf(stderr, "%s: --resume latest: cannot read --checkpoint-dir %s: %s\n",
                    TRAIN_PROG, dir, strerror(errno));
        return 2;
    }
    int status = 2;
    for (size_t i = 0; i < n; i++) {
        char why[1024];
        snprintf(path, cap, "%s/%s", dir, f[i].name);
        if (unusable(path, why, sizeof why) == 0) {
            status = 0;
            break;
        }
        if (say) fprintf(stderr, "%s: --resume latest: skipping %s: %s\n", TRAIN_PROG, path, why);
    }
    if (status != 0 && say) {
        list_steps(dir, true, &partial, &np);
        fprintf(stderr, "%s: --resume latest: %s holds no complete checkpoint", TRAIN_PROG, dir);
        if (np > 0)
            fprintf(stderr, " (%s/%s%s is a save that did not finish)", dir, partial[0].name,
                    np > 1 ? " and others" : "");
        else if (n == 0)
            fprintf(stderr, " (no step-N directory)");
        fputc('\n', stderr);
    }
    free(f);
    free(partial);
    return status;
}

/* A JSON value as text for a message (compact; "?" when out of memory). */
static void json_text(const json_t *v, char *buf, size_t cap) {
    char *t = v ? json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT) : NULL;
    snprintf(buf, cap, "%s", v ? (t ? t : "?") : "(not recorded)");
    free(t);
}

/* Whether --resume-override lists flag name. */
static bool overridden(const char *list, const char *name) {
    size_t len = strlen(name);
    for (const char *p = list; p && *p;) {
        while (*p == '-')
            p++;
        size_t l = strcspn(p, ",");
        if (l == len && strncmp(p, name, len) == 0) return true;
        p += l;
        if (*p == ',') p++;
    }
    return false;
}

/* Compares the flags recorded in checkpoint sdir with o's. */
static int check_flags(const train_opts_t *o, const char *sdir, bool say, char *run_id,
                       size_t idcap) {
    fsdp_ckpt_t *ck = NULL;
    if (fsdp_ckpt_open(NULL, sdir, &ck) < 0) return 2; /* unusable() said why already */
    const char *rid = fsdp_ckpt_metadata(ck, "run_id"), *text = fsdp_ckpt_metadata(ck, "flags");
    snprintf(run_id, idcap, "%s", rid ? rid : "");
    json_t *saved = text ? json_loads(text, 0, NULL) : NULL, *given = train_opts_json(o);
    int status = 0;
    if (!given) {
        status = 2;
        if (say) fprintf(stderr, "%s: out of memory\n", TRAIN_PROG);
    } else if (!json_is_object(saved)) {
        if (say)
            fprintf(stderr,
                    "%s: warning: %s holds no record of its flags (written by an earlier "
                    "fsdp-train): they are not compared\n",
                    TRAIN_PROG, sdir);
    } else {
        const char *key;
        json_t *gv;
        int ndiff = 0;
        json_object_foreach(given, key, gv) {
            if (train_flag_resume_free(key) || overridden(o->resume_override, key)) continue;
            json_t *sv = json_object_get(saved, key);
            if (sv && json_equal(sv, gv)) continue;
            /* a flag that did not exist when the checkpoint was written, at its default */
            if (!sv) continue;
            char a[256], b[256];
            json_text(sv, a, sizeof a);
            json_text(gv, b, sizeof b);
            if (say && ndiff++ == 0)
                fprintf(stderr,
                        "%s: --resume %s: the checkpoint was written with other flags (give "
                        "--resume-override FLAG,... to accept a change):\n",
                        TRAIN_PROG, sdir);
            if (say) fprintf(stderr, "  --%s: saved %s, given %s\n", key, a, b);
            status = 2;
        }
    }
    json_decref(saved);
    json_decref(given);
    fsdp_ckpt_close(ck);
    return status;
}

int train_ckpt_resolve(const train_opts_t *o, bool say, char *path, size_t cap, char *run_id,
                       size_t idcap) {
    if (strcmp(o->resume, "latest") == 0) {
        int st = find_latest(o->checkpoint_dir, say, path, cap);
        if (st != 0) return st;
    } else {
        char why[1024];
        snprintf(path, cap, "%s", o->resume);
        if (unusable(path, why, sizeof why) != 0) {
            if (say) fprintf(stderr, "%s: --resume %s: %s\n", TRAIN_PROG, path, why);
            return 2;
        }
    }
    return check_flags(o, path, say, run_id, idcap);
}

/* fsdp_ckpt_remove with the library's message in why. */
static int remove_ckpt(const char *path, char *why, size_t cap) {
    fsdp_ctx_t *quiet = train_quiet_ctx();
    if (!quiet) {
        snprintf(why, cap, "out of memory");
        return -1;
    }
    int rc = fsdp_ckpt_remove(quiet, path);
    if (rc < 0) snprintf(why, cap, "%s", fsdp_ctx_last_error(quiet));
    fsdp_ctx_destroy(quiet);
    return rc;
}

void train_ckpt_cleanup(const char *dir) {
    found_step_t *f = NULL;
    size_t n = 0;
    if (list_steps(dir, true, &f, &n) < 0) return; /* no directory yet */
    for (size_t i = 0; i < n; i++) {
        char path[4200], why[1024];
        snprintf(path, sizeof path, "%s/%s", dir, f[i].name);
        if (remove_ckpt(path, why, sizeof why) == 0)
            fprintf(stderr, "%s: removed %s, left by a save that did not finish\n", TRAIN_PROG,
                    path);
        else
            fprintf(stderr, "%s: warning: %s\n", TRAIN_PROG, why);
    }
    free(f);
}

void train_ckpt_prune(const char *dir, int64_t keep, int64_t kept) {
    found_step_t *f = NULL;
    size_t n = 0;
    if (keep <= 0 || list_steps(dir, false, &f, &n) < 0) return;
    int64_t left = keep - 1; /* the one just saved is one of them */
    for (size_t i = 0; i < n; i++) {
        char path[4200], why[1024];
        if (f[i].step == kept) continue;
        if (left > 0) {
            left--;
            continue;
        }
        snprintf(path, sizeof path, "%s/%s", dir, f[i].name);
        if (remove_ckpt(path, why, sizeof why) < 0)
            fprintf(stderr, "%s: warning: --keep-last %lld: %s\n", TRAIN_PROG, (long long)keep,
                    why);
    }
    free(f);
}
