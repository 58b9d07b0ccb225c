/* SPDX-License-Identifier: MIT */
/*
 * fsdp-tokenize.c: encodes text files with GPT-2's BPE (fsdp/bpe.h) into llm.c token files,
 * the .bin files that fsdp-train --data reads; or decodes such a file back to text.
 *
 *   fsdp-tokenize --tokenizer DIR [--decode] IN OUT
 *
 * DIR holds encoder.json and vocab.bpe (GPT-2's files, or any vocabulary in their format). A bad
 * argument is one line on stderr and exit status 2; a failure to read, encode or write is one
 * line and exit status 1.
 */
#include <config.h>

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#define PROG "fsdp-tokenize"

static const char usage_text[] =
    "usage: " PROG " --tokenizer DIR [--decode] IN OUT\n"
    "       " PROG " --help | --version\n"
    "Encodes the text file IN with GPT-2's byte-level BPE (DIR/encoder.json, DIR/vocab.bpe) into\n"
    "the llm.c token file OUT (a header of 256 int32: 20240520, 1, the token count; then uint16\n"
    "tokens), which fsdp-train --data reads. Any bytes encode. OUT is replaced atomically.\n"
    "  --tokenizer DIR   the directory of encoder.json and vocab.bpe\n"
    "  --decode          the other way: IN is a token file, OUT receives its text\n"
    "  --help            this text\n"
    "  --version         the version, git revision and what is compiled in\n";

static int usage_error(const char *msg, const char *arg) {
    fprintf(stderr, PROG ": %s%s%s (see --help)\n", msg, arg ? ": " : "", arg ? arg : "");
    return 2;
}

/* --decode: the tokens of the token file in, as text, to out. */
static int decode(fsdp_ctx_t *ctx, fsdp_bpe_t *bpe, const char *in, const char *out) {
    fsdp_dataset_t *ds = NULL;
    if (fsdp_dataset_open(ctx, in, FSDP_DATA_TOKENS, &ds) < 0) {
        fprintf(stderr, PROG ": %s\n", fsdp_ctx_last_error(ctx));
        return 1;
    }
    FILE *f = fopen(out, "wb");
    int status = 0;
    if (!f) {
        fprintf(stderr, PROG ": cannot open %s: %s\n", out, strerror(errno));
        fsdp_dataset_destroy(ds);
        return 1;
    }
    uint64_t n = fsdp_dataset_num_tokens(ds);
    int64_t chunk[4096];
    for (uint64_t i = 0; i < n && status == 0;) {
        uint64_t k = n - i < 4096 ? n - i : 4096;
        if (fsdp_dataset_read(ctx, ds, i, k, chunk) < 0) {
            fprintf(stderr, PROG ": %s\n", fsdp_ctx_last_error(ctx));
            status = 1;
        }
        for (uint64_t t = 0; t < k && status == 0; t++) {
            const char *b = NULL;
            size_t len = 0;
            if (fsdp_bpe_token_bytes(bpe, chunk[t], &b, &len) < 0) {
                fprintf(stderr, PROG ": %s: token %llu: %s\n", in, (unsigned long long)(i + t),
                        fsdp_bpe_last_error(bpe));
                status = 1;
            } else if (fwrite(b, 1, len, f) != len) {
                fprintf(stderr, PROG ": writing %s: %s\n", out, strerror(errno));
                status = 1;
            }
        }
        i += k;
    }
    if (fclose(f) != 0 && status == 0) {
        fprintf(stderr, PROG ": writing %s: %s\n", out, strerror(errno));
        status = 1;
    }
    fsdp_dataset_destroy(ds);
    return status;
}

int main(int argc, char **argv) {
    const char *dir = NULL, *pos[2] = {NULL, NULL};
    bool dec = false;
    int npos = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            fputs(usage_text, stdout);
            return 0;
        }
        if (strcmp(a, "--version") == 0) {
            printf(PROG " (%s) %s\n%s\n", PACKAGE_NAME, PACKAGE_VERSION, fsdp_build_info());
            return 0;
        }
        if (strcmp(a, "--tokenizer") == 0) {
            if (i + 1 == argc) return usage_error("--tokenizer needs a directory", NULL);
            dir = argv[++i];
        } else if (strcmp(a, "--decode") == 0) {
            dec = true;
        } else if (a[0] == '-' && a[1]) {
            return usage_error("unknown option", a);
        } else if (npos == 2) {
            return usage_error("unexpected argument", a);
        } else {
            pos[npos++] = a;
        }
    }
    if (!dir) return usage_error("--tokenizer DIR is required", NULL);
    if (npos != 2) return usage_error("give the input and the output file", NULL);
    fsdp_ctx_options_t co;
    fsdp_ctx_options_init(&co);
    co.log_level = FSDP_LOG_OFF;
    fsdp_ctx_t *ctx = NULL;
    fsdp_bpe_t *bpe = NULL;
    if (fsdp_ctx_create(&co, &ctx) < 0) {
        fputs(PROG ": out of memory\n", stderr);
        return 1;
    }
    int status = 0;
    if (fsdp_bpe_load_dir(ctx, dir, &bpe) < 0) {
        fprintf(stderr, PROG ": --tokenizer: %s\n", fsdp_ctx_last_error(ctx));
        status = 2;
    } else if (dec) {
        status = decode(ctx, bpe, pos[0], pos[1]);
    } else {
        uint64_t n = 0;
        if (fsdp_bpe_encode_file(bpe, pos[0], pos[1], &n) < 0) {
            fprintf(stderr, PROG ": %s\n", fsdp_bpe_last_error(bpe));
            status = 1;
        } else {
            printf("%s: %llu tokens (vocabulary of %lld) -> %s\n", pos[0], (unsigned long long)n,
                   (long long)fsdp_bpe_vocab_size(bpe), pos[1]);
        }
    }
    fsdp_bpe_destroy(bpe);
    fsdp_ctx_destroy(ctx);
    return status;
}
