/* SPDX-License-Identifier: MIT */
/*
 * t_train_hf.c: fsdp-train's Hugging Face round trip (issue 25, "Hugging Face round trip"),
 * through the program itself.
 *   - --export-format hf writes a directory: model.safetensors with GPT2LMHeadModel names
 *     ("transformer."), Conv1D weights (in, out) for c_attn, attn.c_proj, c_fc and mlp.c_proj,
 *     "format": "pt" and "layout": "huggingface-gpt2" in the metadata, no lm_head or buffers; and
 *     config.json (parsed with jansson) with the model's sizes, gpt2, GPT2LMHeadModel, gelu_new
 *     (libfsdp's tanh GELU), tied embeddings and the layer-norm epsilon;
 *   - the default export names its layout ("layout": "libfsdp"), and its tensors are the hf
 *     export's of the same run, transposed where Conv1D, bit for bit;
 *   - --init of the hf directory gives parameters equal bit for bit to the libfsdp export's, and
 *     the losses of a run continued from it equal those of one continued from the libfsdp file;
 *   - --init takes files written as Hugging Face writes them (made here with the library's
 *     safetensors writer): the original gpt2 layout (no prefix, Conv1D, attn.bias and
 *     attn.masked_bias buffers) and save_pretrained's ("transformer." prefix, Conv1D, a copy of
 *     wte as lm_head.weight), and also a bare Conv1D file with no buffers or metadata and an old
 *     libfsdp export with no "layout"; each is loaded bit for bit and named in one line;
 *   - a file with a mismatched shape is refused, naming the tensor and both shapes.
 * T_KEEP=1 in the environment keeps the scratch directory (under $TMPDIR) for a look.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <fsdp.h>
#include <jansson.h>

#include "fs_util.h"
#include "tap.h"

#define TINY                                                                                       \
    "--model tiny --n-layer 2 --n-embd 32 --n-head 2 --seq-len 16 --batch-size 4 --world-size 2 "  \
    "--sample-tokens 0 --val-steps 1 --warmup 1 --val-every 0"

static char dir[512];

/* Runs fsdp-train with args; stdout and stderr go to dir/<tag>.out. Returns the exit status. */
static int train(const char *tag, const char *args) {
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "'%s' " TINY " %s > '%s/%s.out' 2>&1", TRAIN_BIN, args, dir, tag);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/* The file's text (malloc'ed, "" when unreadable). */
static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    char *buf = calloc(1, 1 << 16);
    if (f && buf) {
        size_t n = fread(buf, 1, (1 << 16) - 1, f);
        buf[n] = 0;
    }
    if (f) fclose(f);
    return buf;
}

static char *out_of(const char *tag) {
    char p[600];
    snprintf(p, sizeof p, "%s/%s.out", dir, tag);
    return slurp(p);
}

static bool conv1d(const char *libfsdp_name) {
    return fsdp_gpt2_hf_is_conv1d(libfsdp_name);
}

/* Tensor `name` of st as f32 (malloc'ed), *rows and *cols its 2-D shape (cols 1 for 1-D). */
static float *read_f32(fsdp_safetensors_t *st, const char *name, int64_t *rows, int64_t *cols) {
    fsdp_safetensors_info_t in;
    if (fsdp_safetensors_find(st, name, &in) < 0) return NULL;
    float *v = malloc((size_t)in.numel * sizeof *v);
    if (!v || fsdp_safetensors_read(st, name, FSDP_DTYPE_F32, v, (size_t)in.numel * 4) < 0) {
        free(v);
        return NULL;
    }
    *rows = in.ndim > 0 ? in.shape[0] : 1;
    *cols = in.ndim > 1 ? in.numel / in.shape[0] : 1;
    return v;
}

/* Whether every tensor of `ref` (a libfsdp-layout file) is in `other` (named with prefix,
 * transposed where Conv1D when hf) with the same bits; *n counts the tensors compared. */
static bool same_weights(const char *ref, const char *other, const char *prefix, bool hf, size_t *n,
                         char *why, size_t cap) {
    fsdp_safetensors_t *a = NULL, *b = NULL;
    bool ok =
        fsdp_safetensors_open(NULL, ref, &a) == 0 && fsdp_safetensors_open(NULL, other, &b) == 0;
    *n = 0;
    snprintf(why, cap, "cannot open %s or %s", ref, other);
    for (size_t i = 0; ok && i < fsdp_safetensors_count(a); i++) {
        fsdp_safetensors_info_t in;
        fsdp_safetensors_info(a, i, &in);
        char hn[256];
        snprintf(hn, sizeof hn, "%s%s", prefix, in.name);
        int64_t r1, c1, r2, c2;
        float *x = read_f32(a, in.name, &r1, &c1), *y = read_f32(b, hn, &r2, &c2);
        bool t = hf && conv1d(in.name);
        ok = x && y && (t ? (r1 == c2 && c1 == r2) : (r1 == r2 && c1 == c2));
        for (int64_t p = 0; ok && p < r1; p++)
            for (int64_t q = 0; ok && q < c1; q++)
                ok = memcmp(&x[p * c1 + q], t ? &y[q * c2 + p] : &y[p * c1 + q], 4) == 0;
        if (!ok) snprintf(why, cap, "tensor %s differs (or is missing as %s)", in.name, hn);
        free(x);
        free(y);
        if (ok) ++*n;
    }
    fsdp_safetensors_close(a);
    fsdp_safetensors_close(b);
    return ok && *n > 0;
}

/* The "loss" of every train record of a metrics file, as text "l1 l2 ..." (17 digits). */
static void losses(const char *path, char *buf, size_t cap) {
    FILE *f = fopen(path, "r");
    char line[8192];
    size_t o = 0;
    buf[0] = 0;
    while (f && fgets(line, sizeof line, f)) {
        json_t *j = json_loads(line, 0, NULL);
        const char *ty = json_string_value(json_object_get(j, "type"));
        if (ty && strcmp(ty, "train") == 0 && o + 32 < cap)
            o += (size_t)snprintf(buf + o, cap - o, "%.17g ",
                                  json_number_value(json_object_get(j, "loss")));
        json_decref(j);
    }
    if (f) fclose(f);
}

/* ---- files written the way Hugging Face writes them ---------------------------------------- */

typedef struct hf_file {
    const char *prefix; /* "" (GPT2Model, the original gpt2) or "transformer." (save_pretrained) */
    bool buffers;       /* h.<i>.attn.bias (1, 1, T, T) and h.<i>.attn.masked_bias () */
    bool lm_head;       /* lm_head.weight, a copy of wte.weight */
    bool conv1d;        /* Conv1D weights (in, out); false: libfsdp's (out, in) */
    const char *bad;    /* a tensor written with a wrong shape, or NULL */
} hf_file_t;

/* Writes model m's weights to path as f says. */
static void write_like_hf(fsdp_ctx_t *ctx, const fsdp_module_t *m, const char *path,
                          const hf_file_t *f) {
    fsdp_named_list_t sd;
    if (fsdp_module_state_dict(m, &sd) < 0) tap_bail("state_dict");
    const fsdp_gpt_config_t *c = fsdp_gpt_get_config(m);
    size_t cap = sd.n + 2 * (size_t)c->n_layer + 2;
    fsdp_named_list_t out = {.names = calloc(cap, sizeof(char *)),
                             .tensors = calloc(cap, sizeof(fsdp_tensor_t *)),
                             .owned = true};
    if (!out.names || !out.tensors) tap_bail("out of memory");
    for (size_t i = 0; i < sd.n; i++) {
        const fsdp_tensor_t *t = sd.tensors[i];
        int nd = fsdp_tensor_ndim(t);
        const int64_t *sh = fsdp_tensor_shape(t);
        int64_t numel = fsdp_tensor_numel(t);
        float *v = malloc((size_t)numel * 4), *w = malloc((size_t)numel * 4 + 4);
        if (!v || !w || fsdp_tensor_to_host(t, v, (size_t)numel * 4) < 0) tap_bail("to_host");
        int64_t shape[2] = {sh[0], nd > 1 ? sh[1] : 1};
        if (f->conv1d && conv1d(sd.names[i])) {
            for (int64_t p = 0; p < sh[0]; p++)
                for (int64_t q = 0; q < sh[1]; q++)
                    w[q * sh[0] + p] = v[p * sh[1] + q];
            shape[0] = sh[1];
            shape[1] = sh[0];
        } else {
            memcpy(w, v, (size_t)numel * 4);
        }
        char name[256];
        snprintf(name, sizeof name, "%s%s", f->prefix, sd.names[i]);
        if (f->bad && strcmp(sd.names[i], f->bad) == 0) shape[1] += 1; /* the wrong shape */
        if (shape[0] * shape[1] > numel) w = realloc(w, (size_t)(shape[0] * shape[1]) * 4);
        if (!w || fsdp_tensor_from_host(ctx, FSDP_DTYPE_F32, nd, shape, w, FSDP_MEM_OTHER,
                                        &out.tensors[out.n]) < 0)
            tap_bail("from_host: %s", fsdp_ctx_last_error(ctx));
        out.names[out.n++] = strdup(name);
        free(v);
        free(w);
    }
    /* The causal-mask buffers of the original file, after each block's tensors' names. */
    for (int64_t l = 0; f->buffers && l < c->n_layer; l++) {
        int64_t T = c->max_seq, s4[4] = {1, 1, T, T};
        float *mask = calloc((size_t)(T * T), 4), mb = -1e4f;
        for (int64_t p = 0; mask && p < T; p++)
            for (int64_t q = 0; q <= p; q++)
                mask[p * T + q] = 1.0f;
        char name[256];
        snprintf(name, sizeof name, "%sh.%lld.attn.bias", f->prefix, (long long)l);
        if (!mask || fsdp_tensor_from_host(ctx, FSDP_DTYPE_F32, 4, s4, mask, FSDP_MEM_OTHER,
                                           &out.tensors[out.n]) < 0)
            tap_bail("mask");
        out.names[out.n++] = strdup(name);
        snprintf(name, sizeof name, "%sh.%lld.attn.masked_bias", f->prefix, (long long)l);
        if (fsdp_tensor_from_host(ctx, FSDP_DTYPE_F32, 0, s4, &mb, FSDP_MEM_OTHER,
                                  &out.tensors[out.n]) < 0)
            tap_bail("masked_bias");
        out.names[out.n++] = strdup(name);
        free(mask);
    }
    if (f->lm_head) {
        /* wte.weight comes first; a copy, as a file cannot hold two names for one tensor */
        if (fsdp_tensor_clone(out.tensors[0], FSDP_MEM_OTHER, &out.tensors[out.n]) < 0)
            tap_bail("clone");
        out.names[out.n++] = strdup("lm_head.weight");
    }
    fsdp_safetensors_kv_t meta[] = {{"format", "pt"}};
    if (fsdp_safetensors_save(ctx, path, &out, meta, 1) < 0)
        tap_bail("save %s: %s", path, fsdp_ctx_last_error(ctx));
    fsdp_named_list_free(&out);
    fsdp_named_list_free(&sd);
}

int main(void) {
    tap_plan_lazy();
    setenv("FSDP_NUM_THREADS", "1", 1);
    char tmpl[512];
    tap_tmppath(tmpl, sizeof tmpl, "t_train_hf-XXXXXX");
    if (!mkdtemp(tmpl)) tap_bail("mkdtemp: %s", strerror(errno));
    snprintf(dir, sizeof dir, "%s", tmpl);
    char args[4096], why[512];
    size_t n = 0;

    /* ---- the round trip -------------------------------------------------------------------- */
    const char *hfdir = fsu_join(dir, "hf");
    snprintf(args, sizeof args, "--steps 3 --export-format hf --export '%s'", hfdir);
    tap_is_int(train("hf", args), 0, "a 3-step run exports --export-format hf to a directory");
    char hffile[600], lfile[600], p2[600];
    snprintf(hffile, sizeof hffile, "%s/model.safetensors", hfdir);
    snprintf(lfile, sizeof lfile, "%s/l.safetensors", dir);
    snprintf(p2, sizeof p2, "%s/p2.safetensors", dir);
    snprintf(args, sizeof args, "--steps 3 --export '%s'", lfile);
    tap_is_int(train("l", args), 0, "the same run exports the libfsdp layout");

    fsdp_safetensors_t *st = NULL;
    if (fsdp_safetensors_open(NULL, hffile, &st) < 0) tap_bail("open %s", hffile);
    tap_is_str(fsdp_safetensors_metadata(st, "format"), "pt", "hf export: \"format\": \"pt\"");
    tap_is_str(fsdp_safetensors_metadata(st, "layout"), "huggingface-gpt2",
               "hf export: its layout in the metadata");
    static const struct {
        const char *name;
        int64_t r, c;
    } shapes[] = {{"transformer.wte.weight", 256, 32},
                  {"transformer.wpe.weight", 64, 32},
                  {"transformer.h.0.attn.c_attn.weight", 32, 96},
                  {"transformer.h.0.attn.c_proj.weight", 32, 32},
                  {"transformer.h.1.mlp.c_fc.weight", 32, 128},
                  {"transformer.h.1.mlp.c_proj.weight", 128, 32},
                  {"transformer.ln_f.weight", 32, 0}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        fsdp_safetensors_info_t in;
        bool ok = fsdp_safetensors_find(st, shapes[i].name, &in) == 0 &&
                  in.ndim == (shapes[i].c ? 2 : 1) && in.shape[0] == shapes[i].r &&
                  (!shapes[i].c || in.shape[1] == shapes[i].c);
        tap_ok(ok, "hf export: %s is (%lld, %lld) (0: 1-D; Conv1D: (in, out))", shapes[i].name,
               (long long)shapes[i].r, (long long)shapes[i].c);
    }
    fsdp_safetensors_info_t in;
    tap_ok(fsdp_safetensors_find(st, "lm_head.weight", &in) < 0 &&
               fsdp_safetensors_find(st, "transformer.h.0.attn.bias", &in) < 0,
           "hf export: no lm_head.weight (tied) and no attn.bias buffers");
    tap_is_size(fsdp_safetensors_count(st), 2 + 2 * 12 + 2, "hf export: 28 tensors");
    fsdp_safetensors_close(st);

    json_error_t je;
    json_t *cj = json_load_file(fsu_join(hfdir, "config.json"), 0, &je);
    tap_ok(cj != NULL, "config.json parses (%s)", cj ? "ok" : je.text);
    tap_is_str(json_string_value(json_object_get(cj, "model_type")), "gpt2", "config: model_type");
    tap_is_str(json_string_value(json_array_get(json_object_get(cj, "architectures"), 0)),
               "GPT2LMHeadModel", "config: architectures");
    tap_is_str(json_string_value(json_object_get(cj, "activation_function")), "gelu_new",
               "config: activation_function is gelu_new (libfsdp's tanh GELU)");
    static const struct {
        const char *key;
        int64_t v;
    } ints[] = {{"n_embd", 32}, {"n_layer", 2},      {"n_head", 2},   {"n_positions", 64},
                {"n_ctx", 64},  {"vocab_size", 256}, {"n_inner", 128}};
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
        tap_is_int(json_integer_value(json_object_get(cj, ints[i].key)), ints[i].v, "config: %s",
                   ints[i].key);
    tap_ok(json_real_value(json_object_get(cj, "layer_norm_epsilon")) == 1e-5,
           "config: layer_norm_epsilon 1e-5");
    tap_ok(json_is_true(json_object_get(cj, "tie_word_embeddings")), "config: tied embeddings");
    json_decref(cj);

    if (fsdp_safetensors_open(NULL, lfile, &st) < 0) tap_bail("open %s", lfile);
    tap_is_str(fsdp_safetensors_metadata(st, "layout"), "libfsdp",
               "the default export names its layout");
    tap_ok(fsdp_safetensors_find(st, "h.0.attn.c_attn.weight", &in) == 0 && in.shape[0] == 96,
           "the default export keeps libfsdp's names and (out, in) weights");
    fsdp_safetensors_close(st);
    bool same = same_weights(lfile, hffile, "transformer.", true, &n, why, sizeof why);
    tap_ok_why(same, why,
               "hf export = libfsdp export of the same run, Conv1D transposed, bit for bit (%zu)",
               n);

    snprintf(args, sizeof args, "--steps 0 --init '%s' --export '%s'", hfdir, p2);
    tap_is_int(train("init_hf", args), 0, "--init of the hf directory runs");
    char *o = out_of("init_hf");
    tap_has_str(o, "GPT2LMHeadModel layout", "--init says it found save_pretrained's layout");
    free(o);
    same = same_weights(lfile, p2, "", false, &n, why, sizeof why);
    tap_ok_why(same, why,
               "--init from hf: parameters bit for bit those of the run that exported (%zu)", n);
    char m3[600], m4[600], l3[4096], l4[4096];
    snprintf(m3, sizeof m3, "%s/m3.jsonl", dir);
    snprintf(m4, sizeof m4, "%s/m4.jsonl", dir);
    snprintf(args, sizeof args, "--steps 2 --init '%s' --metrics '%s'", hfdir, m3);
    tap_is_int(train("c3", args), 0, "a run continues from the hf export");
    snprintf(args, sizeof args, "--steps 2 --init '%s' --metrics '%s'", lfile, m4);
    tap_is_int(train("c4", args), 0, "a run continues from the libfsdp export");
    losses(m3, l3, sizeof l3);
    losses(m4, l4, sizeof l4);
    tap_ok(l3[0] != 0, "the continued run has losses (%s)", l3);
    tap_is_str(l3, l4, "continued from hf or libfsdp: the same losses, first one included");

    /* ---- files as Hugging Face writes them --------------------------------------------------- */
    fsdp_ctx_options_t co;
    fsdp_ctx_options_init(&co);
    co.log_level = FSDP_LOG_OFF;
    fsdp_ctx_t *ctx = NULL;
    fsdp_gpt_config_t cfg;
    fsdp_gpt_config_init(&cfg);
    cfg.vocab = 256;
    cfg.max_seq = 64;
    cfg.n_layer = 2;
    cfg.n_head = 2;
    cfg.d_model = 32;
    fsdp_module_t *m = NULL;
    if (fsdp_ctx_create(&co, &ctx) < 0 || fsdp_gpt_create(ctx, &cfg, &m) < 0) tap_bail("model");
    /* Weights unlike fsdp-train's own initialisation, so a load that did nothing shows. */
    fsdp_named_list_t ps;
    if (fsdp_module_named_params(m, false, &ps) < 0) tap_bail("params");
    for (size_t i = 0; i < ps.n; i++) {
        int64_t k = fsdp_tensor_numel(ps.tensors[i]);
        float *v = malloc((size_t)k * 4);
        for (int64_t e = 0; v && e < k; e++)
            v[e] = (float)((e * 7919 + (int64_t)i * 104729) % 2003) / 1000.0f - 1.0f;
        if (!v || fsdp_tensor_copy_from_host(ps.tensors[i], v, (size_t)k * 4) < 0) tap_bail("fill");
        free(v);
    }
    fsdp_named_list_free(&ps);
    char ref[600];
    snprintf(ref, sizeof ref, "%s/ref.safetensors", dir);
    if (fsdp_safetensors_save_module(m, ref, NULL, 0) < 0) tap_bail("ref"); /* no "layout" */
    static const struct {
        const char *tag, *says;
        hf_file_t f;
    } files[] = {
        {"orig", "GPT2Model layout", {"", true, false, true, NULL}},
        {"pretrained", "GPT2LMHeadModel layout", {"transformer.", false, true, true, NULL}},
        {"bare", "GPT2Model layout", {"", false, false, true, NULL}},
        {"oldlib", "the libfsdp layout", {"", false, false, false, NULL}},
    };
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char fp[600], ep[600];
        snprintf(fp, sizeof fp, "%s/%s.safetensors", dir, files[i].tag);
        snprintf(ep, sizeof ep, "%s/%s.out.safetensors", dir, files[i].tag);
        write_like_hf(ctx, m, fp, &files[i].f);
        snprintf(args, sizeof args, "--steps 0 --init '%s' --export '%s'", fp, ep);
        tap_is_int(train(files[i].tag, args), 0, "--init of a %s file runs", files[i].tag);
        o = out_of(files[i].tag);
        tap_has_str(o, files[i].says, "--init names the %s file's layout", files[i].tag);
        free(o);
        same = same_weights(ref, ep, "", false, &n, why, sizeof why);
        tap_ok_why(same, why, "--init of the %s file loads every parameter bit for bit (%zu)",
                   files[i].tag, n);
    }
    char bp[600];
    snprintf(bp, sizeof bp, "%s/bad.safetensors", dir);
    hf_file_t bad = {"", true, false, true, "h.1.mlp.c_fc.weight"};
    write_like_hf(ctx, m, bp, &bad);
    snprintf(args, sizeof args, "--steps 0 --init '%s'", bp);
    int st_bad = train("bad", args);
    tap_ok(st_bad != 0, "--init of a file with a wrong shape fails (exit %d)", st_bad);
    o = out_of("bad");
    tap_has_str(o, "h.1.mlp.c_fc.weight", "the refusal names the tensor");
    tap_has_str(o, "32, 129", "the refusal gives the file's shape");
    tap_has_str(o, "128, 32", "the refusal gives the model's shape");
    free(o);
    fsdp_module_release(m);
    fsdp_ctx_destroy(ctx);
    if (!getenv("T_KEEP")) fsu_remove_tree(dir);
    return tap_done();
}
