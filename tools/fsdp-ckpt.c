/* SPDX-License-Identifier: MIT */
/*
 * fsdp-ckpt.c: the command-line tool for checkpoint directories (fsdp/checkpoint.h).
 *
 *   fsdp-ckpt info DIR [--json]                  what the index says: files, metadata, tensors
 *   fsdp-ckpt consolidate DIR OUT [--all]        one full safetensors file from the pieces
 *   fsdp-ckpt shard IN DIR --world N             a directory of N rank files from a full file
 *   fsdp-ckpt verify DIR                         every header checked, every byte read
 *
 * Everything goes through the public API: fsdp_ckpt_open and its readers, the io layer's writer
 * (fsdp_ckpt_prepare, fsdp_ckpt_write_rank for each rank in this one process, fsdp_ckpt_finish)
 * and the safetensors reader and writer, on one silent CPU context whose last-error text is what
 * the tool prints. Exit status: 0 on success, 1 when the library fails (its message names the
 * file and the tensor), 2 for a bad command line (one line saying what is wrong). Nothing here
 * aborts.
 *
 * Memory: consolidate and shard hold the tensors they write in memory (the output's size, or the
 * input's), because fsdp_safetensors_save and fsdp_ckpt_write_rank take whole lists; the reads
 * themselves are by byte range.
 */
#include <config.h>

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include <fsdp.h>

#define PROG "fsdp-ckpt"
/* The prefix of the model's entries in a checkpoint (fsdp_checkpoint_save's names). */
#define MODEL_PREFIX "model."
#define MAX_WORLD 4096

static const char usage_text[] =
    "usage: " PROG " info DIR [--json]\n"
    "       " PROG " consolidate DIR OUT.safetensors [--all]\n"
    "       " PROG " shard IN.safetensors DIR --world N\n"
    "       " PROG " verify DIR\n"
    "       " PROG " --help | --version\n"
    "Inspects, consolidates, re-shards and checks libfsdp checkpoint directories (per-rank\n"
    "rank-R-of-W.safetensors files and an index.json, as fsdp_checkpoint_save writes them).\n"
    "\n"
    "commands:\n"
    "  info DIR               world size, files and bytes, metadata, and one line per tensor:\n"
    "                         name, dtype, shape, elements, replicated or its chunks\n"
    "    --json               the same as one JSON object\n"
    "  consolidate DIR OUT    one full safetensors file: the model's entries (model.<name>)\n"
    "                         under <name>, as fsdp-train --init takes them, with the index's\n"
    "                         metadata\n"
    "    --all                every tensor (model and optimizer) under its checkpoint name\n"
    "  shard IN DIR           a checkpoint directory from a full safetensors file: every tensor\n"
    "                         as model.<name>, cut into N contiguous pieces of its elements\n"
    "    --world N            the number of rank files (1 to 4096; required)\n"
    "  verify DIR             checks every file's header against the index and reads every byte;\n"
    "                         prints \"ok: N tensors, M files, B bytes\"\n"
    "\n"
    "exit status: 0 ok, 1 the checkpoint or a file is bad (the message names it), 2 usage.\n";

/* The command line, checked. */
typedef struct opts {
    const char *cmd;
    const char *pos[2]; /* the positional arguments */
    int npos;
    bool json; /* info */
    bool all;  /* consolidate */
    int world; /* shard; 0 until given */
} opts_t;

static int usage_error(const char *fmt, ...) FSDP_PRINTF(1, 2);
static int usage_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs(PROG ": ", stderr);
    vfprintf(stderr, fmt, ap);
    fputs(" (try " PROG " --help)\n", stderr);
    va_end(ap);
    return 2;
}

/* A failure of the library: its message (left on ctx), after what the tool was doing. */
static int lib_error(fsdp_ctx_t *ctx, int rc, const char *what) {
    const char *msg = ctx ? fsdp_ctx_last_error(ctx) : "";
    fprintf(stderr, PROG ": %s: %s\n", what, msg && msg[0] ? msg : fsdp_strerror(rc));
    return 1;
}

/* ---- the command line ------------------------------------------------------------------------ */

static int parse_world(const char *v, int *out) {
    char *end = NULL;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno != 0 || end == v || *end != '\0')
        return usage_error("--world: '%s' is not an integer", v);
    if (x < 1 || x > MAX_WORLD)
        return usage_error("--world: %s is out of range [1, %d]", v, MAX_WORLD);
    *out = (int)x;
    return 0;
}

/* Returns 0 to run, 1 when --help or --version was served, 2 for a usage error. */
static int parse_args(int argc, char **argv, opts_t *o) {
    *o = (opts_t){0};
    if (argc < 2) return usage_error("no command given (info, consolidate, shard or verify)");
    const char *c = argv[1];
    if (strcmp(c, "--help") == 0 || strcmp(c, "-h") == 0) {
        fputs(usage_text, stdout);
        return 1;
    }
    if (strcmp(c, "--version") == 0) {
        printf(PROG " (%s) %s\n%s\n", PACKAGE_NAME, PACKAGE_VERSION, fsdp_build_info());
        return 1;
    }
    if (strcmp(c, "info") && strcmp(c, "consolidate") && strcmp(c, "shard") && strcmp(c, "verify"))
        return usage_error("unknown command '%s' (info, consolidate, shard or verify)", c);
    o->cmd = c;
    bool only_pos = false;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (!only_pos && strcmp(a, "--") == 0) {
            only_pos = true;
            continue;
        }
        if (only_pos || a[0] != '-' || a[1] == '\0') {
            if (o->npos == 2) return usage_error("%s: unexpected argument '%s'", c, a);
            o->pos[o->npos++] = a;
            continue;
        }
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            fputs(usage_text, stdout);
            return 1;
        }
        if (strcmp(a, "--json") == 0) {
            if (strcmp(c, "info") != 0) return usage_error("--json applies to info only");
            o->json = true;
        } else if (strcmp(a, "--all") == 0) {
            if (strcmp(c, "consolidate") != 0)
                return usage_error("--all applies to consolidate only");
            o->all = true;
        } else if (strcmp(a, "--world") == 0 || strncmp(a, "--world=", 8) == 0) {
            if (strcmp(c, "shard") != 0) return usage_error("--world applies to shard only");
            const char *v = a[7] == '=' ? a + 8 : (i + 1 < argc ? argv[++i] : NULL);
            if (!v) return usage_error("--world needs a value");
            int rc = parse_world(v, &o->world);
            if (rc != 0) return rc;
        } else {
            return usage_error("%s: unknown option '%s'", c, a);
        }
    }
    if (strcmp(c, "info") == 0 || strcmp(c, "verify") == 0) {
        if (o->npos != 1)
            return usage_error("%s: %s", c, o->npos ? "too many arguments" : "no DIR given");
    } else if (strcmp(c, "consolidate") == 0) {
        if (o->npos != 2)
            return usage_error("consolidate: %s", o->npos ? "no OUT.safetensors given"
                                                          : "no DIR and OUT.safetensors given");
    } else {
        if (o->npos != 2)
            return usage_error("shard: %s",
                               o->npos ? "no DIR given" : "no IN.safetensors and DIR given");
        if (o->world == 0) return usage_error("shard: --world N is required");
    }
    return 0;
}

/* ---- info ------------------------------------------------------------------------------------ */

/* Prints s with control bytes escaped, so that one entry stays one line. */
static void put_shown(const char *s) {
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '\n')
            fputs("\\n", stdout);
        else if (*p == '\t')
            fputs("\\t", stdout);
        else if (*p < 0x20 || *p == 0x7f)
            printf("\\x%02x", *p);
        else
            putchar(*p);
    }
}

static void shape_str(const fsdp_ckpt_info_t *in, char *buf, size_t cap) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < in->ndim && n < cap; d++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%" PRId64, d ? ", " : "", in->shape[d]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

/* A JSON string of s; a path that is not UTF-8 has its other bytes shown as '?'. */
static json_t *jstr(const char *s) {
    json_t *j = json_string(s);
    if (j) return j;
    char *c = strdup(s);
    if (!c) return NULL;
    for (char *p = c; *p; p++)
        if ((unsigned char)*p >= 0x80) *p = '?';
    j = json_string(c);
    free(c);
    return j;
}

static int info_json(fsdp_ckpt_t *ck, const char *dir, uint64_t total) {
    json_t *root = json_object(), *files = json_array(), *meta = json_object(),
           *tensors = json_array();
    bool ok = root && files && meta && tensors;
    for (size_t i = 0; ok && i < fsdp_ckpt_file_count(ck); i++) {
        const char *name = NULL;
        uint64_t size = 0;
        fsdp_ckpt_file(ck, i, &name, &size);
        ok = json_array_append_new(
                 files, json_pack("{s:o,s:I}", "name", jstr(name), "size", (json_int_t)size)) == 0;
    }
    for (size_t i = 0; ok && i < fsdp_ckpt_metadata_count(ck); i++) {
        fsdp_safetensors_kv_t kv;
        fsdp_ckpt_metadata_at(ck, i, &kv);
        ok = json_object_set_new(meta, kv.key, jstr(kv.value)) == 0;
    }
    for (size_t i = 0; ok && i < fsdp_ckpt_count(ck); i++) {
        fsdp_ckpt_info_t in;
        fsdp_ckpt_info(ck, i, &in);
        json_t *shape = json_array();
        for (int d = 0; shape && d < in.ndim; d++)
            if (json_array_append_new(shape, json_integer(in.shape[d])) != 0) {
                json_decref(shape);
                shape = NULL;
            }
        ok = shape && json_array_append_new(
                          tensors, json_pack("{s:o,s:s,s:o,s:I,s:b,s:I}", "name", jstr(in.name),
                                             "dtype", in.st_dtype, "shape", shape, "numel",
                                             (json_int_t)in.numel, "replicated", in.replicated,
                                             "chunks", (json_int_t)in.nchunks)) == 0;
    }
    if (ok)
        ok = json_object_set_new(root, "directory", jstr(dir)) == 0 &&
             json_object_set_new(root, "world_size", json_integer(fsdp_ckpt_world_size(ck))) == 0 &&
             json_object_set(root, "files", files) == 0 &&
             json_object_set_new(root, "total_bytes", json_integer((json_int_t)total)) == 0 &&
             json_object_set(root, "metadata", meta) == 0 &&
             json_object_set(root, "tensors", tensors) == 0;
    char *text = ok ? json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER) : NULL;
    json_decref(files);
    json_decref(meta);
    json_decref(tensors);
    json_decref(root);
    if (!text) {
        fprintf(stderr, PROG ": info: building the JSON output: out of memory\n");
        return 1;
    }
    puts(text);
    free(text);
    return 0;
}

static int cmd_info(fsdp_ctx_t *ctx, const opts_t *o) {
    const char *dir = o->pos[0];
    fsdp_ckpt_t *ck = NULL;
    int rc = fsdp_ckpt_open(ctx, dir, &ck);
    if (rc < 0) return lib_error(ctx, rc, "info");
    uint64_t total = 0;
    for (size_t i = 0; i < fsdp_ckpt_file_count(ck); i++) {
        uint64_t size = 0;
        fsdp_ckpt_file(ck, i, NULL, &size);
        total += size;
    }
    int status = 0;
    if (o->json) {
        status = info_json(ck, dir, total);
        goto out;
    }
    size_t nt = fsdp_ckpt_count(ck), nmeta = fsdp_ckpt_metadata_count(ck);
    printf("directory:  ");
    put_shown(dir);
    printf("\nworld size: %d\nfiles:      %zu, %" PRIu64 " bytes\nmetadata:   %zu\n",
           fsdp_ckpt_world_size(ck), fsdp_ckpt_file_count(ck), total, nmeta);
    for (size_t i = 0; i < nmeta; i++) {
        fsdp_safetensors_kv_t kv;
        fsdp_ckpt_metadata_at(ck, i, &kv);
        fputs("  ", stdout);
        put_shown(kv.key);
        fputs(" = ", stdout);
        put_shown(kv.value);
        putchar('\n');
    }
    printf("tensors:    %zu\n", nt);
    /* columns as wide as their widest entry */
    int wname = 4, wshape = 5;
    char sh[256];
    for (size_t i = 0; i < nt; i++) {
        fsdp_ckpt_info_t in;
        fsdp_ckpt_info(ck, i, &in);
        shape_str(&in, sh, sizeof sh);
        size_t ln = strlen(in.name), ls = strlen(sh);
        if (ln > (size_t)wname) wname = ln > 100 ? 100 : (int)ln;
        if (ls > (size_t)wshape) wshape = (int)ls;
    }
    for (size_t i = 0; i < nt; i++) {
        fsdp_ckpt_info_t in;
        fsdp_ckpt_info(ck, i, &in);
        shape_str(&in, sh, sizeof sh);
        fputs("  ", stdout);
        put_shown(in.name);
        int pad = wname - (int)strlen(in.name);
        printf("%*s  %-4s  %-*s  %12" PRId64 "  ", pad > 0 ? pad : 0, "", in.st_dtype, wshape, sh,
               in.numel);
        if (in.replicated)
            puts("replicated");
        else
            printf("%zu chunk%s\n", in.nchunks, in.nchunks == 1 ? "" : "s");
    }
out:
    fsdp_ckpt_close(ck);
    return status;
}

/* ---- verify ---------------------------------------------------------------------------------- */

static int cmd_verify(fsdp_ctx_t *ctx, const opts_t *o) {
    fsdp_ckpt_t *ck = NULL;
    int rc = fsdp_ckpt_open(ctx, o->pos[0], &ck);
    if (rc == 0) rc = fsdp_ckpt_verify(ck);
    if (rc < 0) {
        fsdp_ckpt_close(ck);
        return lib_error(ctx, rc, "verify");
    }
    uint64_t total = 0;
    for (size_t i = 0; i < fsdp_ckpt_file_count(ck); i++) {
        uint64_t size = 0;
        fsdp_ckpt_file(ck, i, NULL, &size);
        total += size;
    }
    printf("ok: %zu tensors, %zu files, %" PRIu64 " bytes\n", fsdp_ckpt_count(ck),
           fsdp_ckpt_file_count(ck), total);
    fsdp_ckpt_close(ck);
    return 0;
}

/* ---- consolidate ----------------------------------------------------------------------------- */

static int cmd_consolidate(fsdp_ctx_t *ctx, const opts_t *o) {
    const char *dir = o->pos[0], *out = o->pos[1];
    const size_t plen = strlen(MODEL_PREFIX);
    fsdp_ckpt_t *ck = NULL;
    fsdp_named_list_t list = {0};
    fsdp_safetensors_kv_t *meta = NULL;
    int rc = fsdp_ckpt_open(ctx, dir, &ck), status = 0;
    if (rc < 0) return lib_error(ctx, rc, "consolidate");
    size_t nt = fsdp_ckpt_count(ck), nmeta = fsdp_ckpt_metadata_count(ck);
    list.owned = true;
    list.names = calloc(nt ? nt : 1, sizeof *list.names);
    list.tensors = calloc(nt ? nt : 1, sizeof *list.tensors);
    meta = calloc(nmeta ? nmeta : 1, sizeof *meta);
    if (!list.names || !list.tensors || !meta) {
        fprintf(stderr, PROG ": consolidate: out of memory\n");
        status = 1;
        goto out;
    }
    for (size_t i = 0; i < nt; i++) {
        fsdp_ckpt_info_t in;
        fsdp_ckpt_info(ck, i, &in);
        if (!o->all && strncmp(in.name, MODEL_PREFIX, plen) != 0) continue;
        if (in.dtype == FSDP_DTYPE_COUNT) {
            fprintf(stderr,
                    PROG ": consolidate: '%s': tensor '%s' is stored as %s, which libfsdp has no "
                         "type for, so it cannot be written\n",
                    dir, in.name, in.st_dtype);
            status = 1;
            goto out;
        }
        fsdp_tensor_t *t = NULL;
        if ((rc = fsdp_tensor_empty(ctx, in.dtype, in.ndim, in.shape, FSDP_MEM_OTHER, &t)) < 0) {
            status = lib_error(ctx, rc, "consolidate");
            goto out;
        }
        list.tensors[list.n] = t;
        list.names[list.n] = strdup(o->all ? in.name : in.name + plen);
        list.n++;
        if (!list.names[list.n - 1]) {
            fprintf(stderr, PROG ": consolidate: out of memory\n");
            status = 1;
            goto out;
        }
        /* In the stored dtype, so bitwise: on a little-endian host this is fsdp_ckpt_read_raw;
         * elsewhere it also puts the bytes in host order, which the writer expects. */
        size_t bytes = (size_t)in.numel * in.esize;
        rc = fsdp_ckpt_read(ck, in.name, 0, in.numel, in.dtype, fsdp_tensor_data(t), bytes);
        if (rc < 0) {
            status = lib_error(ctx, rc, "consolidate");
            goto out;
        }
    }
    if (list.n == 0 && !o->all) {
        fprintf(stderr,
                PROG ": consolidate: '%s' holds no model entries (" MODEL_PREFIX "<name>); --all "
                     "writes every tensor\n",
                dir);
        status = 1;
        goto out;
    }
    for (size_t i = 0; i < nmeta; i++)
        fsdp_ckpt_metadata_at(ck, i, &meta[i]);
    if ((rc = fsdp_safetensors_save(ctx, out, &list, meta, nmeta)) < 0)
        status = lib_error(ctx, rc, "consolidate");
out:
    fsdp_named_list_free(&list);
    free(meta);
    fsdp_ckpt_close(ck);
    return status;
}

/* ---- shard ----------------------------------------------------------------------------------- */

/* Rank r's pieces of every tensor of all: elements [r * c, min((r + 1) * c, numel)) of the
 * flattened tensor, c = ceil(numel / world), as 1-D views named MODEL_PREFIX + name. */
static int rank_pieces(const fsdp_named_list_t *all, int r, int world, fsdp_shard_list_t *l) {
    *l = (fsdp_shard_list_t){0};
    if (!(l->e = calloc(all->n ? all->n : 1, sizeof *l->e))) return FSDP_ENOMEM;
    for (size_t i = 0; i < all->n; i++) {
        fsdp_tensor_t *t = all->tensors[i];
        int64_t numel = fsdp_tensor_numel(t);
        int64_t c = numel / world + (numel % world != 0);
        int64_t off = c * r;
        /* an empty piece is skipped; a tensor with no elements is written (empty) by rank 0 */
        if (off >= numel && (numel > 0 || r > 0)) continue;
        int64_t cnt = numel - off < c ? numel - off : c;
        if (cnt < 0) cnt = 0;
        fsdp_shard_entry_t *e = &l->e[l->n];
        *e = (fsdp_shard_entry_t){0};
        size_t nlen = strlen(MODEL_PREFIX) + strlen(all->names[i]) + 1;
        if (!(e->name = malloc(nlen))) return FSDP_ENOMEM;
        l->n++;
        snprintf(e->name, nlen, MODEL_PREFIX "%s", all->names[i]);
        int rc = fsdp_tensor_view_of(t, fsdp_tensor_storage_offset(t) + off, 1, &cnt, &e->t);
        if (rc < 0) return rc;
        e->ndim = fsdp_tensor_ndim(t);
        memcpy(e->shape, fsdp_tensor_shape(t), sizeof(int64_t) * (size_t)e->ndim);
        e->offset = off;
        e->replicated = false;
    }
    return FSDP_OK;
}

static int cmd_shard(fsdp_ctx_t *ctx, const opts_t *o) {
    const char *in = o->pos[0], *dir = o->pos[1];
    int world = o->world;
    fsdp_safetensors_t *st = NULL;
    fsdp_named_list_t all = {0};
    fsdp_safetensors_kv_t *meta = NULL;
    int status = 0, rc = fsdp_safetensors_open(ctx, in, &st);
    if (rc < 0) return lib_error(ctx, rc, "shard");
    size_t n = fsdp_safetensors_count(st), nmeta = fsdp_safetensors_metadata_count(st);
    /* everything the directory cannot hold is refused before anything is written */
    for (size_t i = 0; i < n; i++) {
        fsdp_safetensors_info_t info;
        fsdp_safetensors_info(st, i, &info);
        const char *why =
            info.dtype == FSDP_DTYPE_COUNT ? "has a dtype libfsdp has no type for" : NULL;
        if (why) {
            fprintf(stderr,
                    PROG ": shard: '%s': tensor '%s' (%s) %s; a checkpoint directory cannot hold "
                         "it\n",
                    in, info.name, info.st_dtype, why);
            status = 1;
            goto out;
        }
    }
    if (!(meta = calloc(nmeta ? nmeta : 1, sizeof *meta))) {
        fprintf(stderr, PROG ": shard: out of memory\n");
        status = 1;
        goto out;
    }
    for (size_t i = 0; i < nmeta; i++)
        fsdp_safetensors_metadata_at(st, i, &meta[i]);
    if ((rc = fsdp_safetensors_load_all(st, &all)) < 0 || (rc = fsdp_ckpt_prepare(ctx, dir)) < 0) {
        status = lib_error(ctx, rc, "shard");
        goto out;
    }
    for (int r = 0; r < world; r++) {
        fsdp_shard_list_t l;
        rc = rank_pieces(&all, r, world, &l);
        if (rc == FSDP_ENOMEM) {
            fprintf(stderr, PROG ": shard: out of memory\n");
            fsdp_shard_list_free(&l);
            status = 1;
            goto out;
        }
        if (rc == 0) rc = fsdp_ckpt_write_rank(ctx, dir, r, world, &l);
        fsdp_shard_list_free(&l);
        if (rc < 0) {
            status = lib_error(ctx, rc, "shard");
            goto out;
        }
    }
    if ((rc = fsdp_ckpt_finish(ctx, dir, world, meta, nmeta)) < 0) {
        status = lib_error(ctx, rc, "shard");
        goto out;
    }
    printf("%s: %zu tensors in %d rank files\n", dir, n, world);
out:
    fsdp_named_list_free(&all);
    free(meta);
    fsdp_safetensors_close(st);
    return status;
}

/* ---- main ------------------------------------------------------------------------------------ */

int main(int argc, char **argv) {
    opts_t o;
    int status = parse_args(argc, argv, &o);
    if (status != 0) return status == 1 ? 0 : 2;
    /* A silent context: the library's messages are printed once, by the tool. */
    fsdp_ctx_options_t co;
    fsdp_ctx_options_init(&co);
    co.log_level = FSDP_LOG_OFF;
    fsdp_ctx_t *ctx = NULL;
    if (fsdp_ctx_create(&co, &ctx) < 0) {
        fprintf(stderr, PROG ": creating a context: out of memory\n");
        return 1;
    }
    if (strcmp(o.cmd, "info") == 0)
        status = cmd_info(ctx, &o);
    else if (strcmp(o.cmd, "verify") == 0)
        status = cmd_verify(ctx, &o);
    else if (strcmp(o.cmd, "consolidate") == 0)
        status = cmd_consolidate(ctx, &o);
    else
        status = cmd_shard(ctx, &o);
    fsdp_ctx_destroy(ctx);
    if (fflush(stdout) != 0 && status == 0) {
        fprintf(stderr, PROG ": writing the output: %s\n", strerror(errno));
        status = 1;
    }
    return status;
}
