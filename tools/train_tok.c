/* SPDX-License-Identifier: MIT */
/*
 * train_tok.c: fsdp-train's --tokenizer: text data encoded with GPT-2's BPE (fsdp/bpe.h).
 *
 * A text file given as --data or --val-data (or the default corpus) is encoded once, when it is
 * opened, into an llm.c token file under $TMPDIR (fsdp_bpe_encode_file), which is opened as the
 * dataset and unlinked at once: the dataset keeps its descriptor, so nothing is left behind
 * however the run ends. Each process of a multi-process run encodes its own copy; the encoding
 * is deterministic, so every rank reads the same tokens. A token file is opened as it is.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tools/train.h"

int train_open_data(fsdp_ctx_t *quiet, fsdp_bpe_t *bpe, const char *path, fsdp_dataset_t **out,
                    bool *encoded, char *err, size_t cap) {
    *encoded = false;
    int rc = fsdp_dataset_open(quiet, path, FSDP_DATA_AUTO, out);
    if (rc < 0) {
        snprintf(err, cap, "%s", fsdp_ctx_last_error(quiet));
        return rc;
    }
    if (!bpe || fsdp_dataset_format(*out) != FSDP_DATA_TEXT) return 0;
    fsdp_dataset_destroy(*out);
    *out = NULL;
    const char *tmpdir = getenv("TMPDIR");
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s/fsdp-train-tokens-XXXXXX", tmpdir && *tmpdir ? tmpdir : "/tmp");
    int fd = mkstemp(tmp);
    if (fd < 0) {
        snprintf(err, cap, "--tokenizer: cannot create a token file in %s: %s",
                 tmpdir && *tmpdir ? tmpdir : "/tmp", strerror(errno));
        return FSDP_EINVAL;
    }
    close(fd);
    uint64_t n = 0;
    rc = fsdp_bpe_encode_file(bpe, path, tmp, &n);
    if (rc < 0)
        snprintf(err, cap, "--tokenizer: %s", fsdp_bpe_last_error(bpe));
    else if ((rc = fsdp_dataset_open(quiet, tmp, FSDP_DATA_TOKENS, out)) < 0)
        snprintf(err, cap, "%s", fsdp_ctx_last_error(quiet));
    unlink(tmp);
    *encoded = rc == 0;
    return rc;
}
