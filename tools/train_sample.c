/* SPDX-License-Identifier: MIT */
/*
 * train_sample.c: fsdp-train's text sample at the end of a run (temperature, top-k). With
 * --tokenizer the prompt is encoded and the sample decoded by GPT-2's BPE; on byte-level text
 * data each token is a byte; otherwise the ids are printed.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/train.h"

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Draws the next token from the last row of logits (rank 0's choice, made from its RNG). */
static int64_t pick(const train_opts_t *o, float *logit, int64_t v, uint64_t *rng) {
    int64_t best = 0;
    for (int64_t i = 1; i < v; i++)
        if (logit[i] > logit[best]) best = i;
    if (o->temperature == 0) return best;
    /* Keep the top_k largest: find the k-th largest by repeated selection on a copy. */
    float cut = -INFINITY;
    if (o->top_k > 0 && o->top_k < v) {
        float *tmp = malloc((size_t)v * sizeof *tmp);
        if (!tmp) return best;
        memcpy(tmp, logit, (size_t)v * sizeof *tmp);
        for (int64_t kk = 0; kk < o->top_k; kk++) {
            int64_t m = 0;
            for (int64_t i = 1; i < v; i++)
                if (tmp[i] > tmp[m]) m = i;
            cut = tmp[m];
            tmp[m] = -INFINITY;
        }
        free(tmp);
    }
    double sum = 0, top = logit[best]; /* kept: the loop below overwrites logit[] */
    for (int64_t i = 0; i < v; i++) {
        double p = logit[i] >= cut ? exp((logit[i] - top) / o->temperature) : 0.0;
        logit[i] = (float)p;
        sum += p;
    }
    double u = (double)(splitmix64(rng) >> 11) * 0x1.0p-53 * sum, acc = 0;
    for (int64_t i = 0; i < v; i++) {
        acc += logit[i];
        if (u < acc) return i;
    }
    return best;
}

static void print_token(const job_t *j, int64_t t) {
    const char *b = NULL;
    size_t len = 0;
    if (j->bpe && fsdp_bpe_token_bytes(j->bpe, t, &b, &len) == 0) {
        /* The token's bytes as they are (UTF-8 split over tokens joins up on the terminal),
         * but no control character other than newline and tab. */
        for (size_t i = 0; i < len; i++) {
            unsigned char c = (unsigned char)b[i];
            putchar(c == '\n' || c == '\t' || (c >= 32 && c != 127) ? c : '?');
        }
        return;
    }
    if (j->bpe) { /* an id the tokenizer has no text for (the model's vocabulary is larger) */
        printf("<%lld>", (long long)t);
        return;
    }
    if (!j->text) {
        printf("%lld ", (long long)t);
        return;
    }
    int c = (int)t;
    putchar(c == '\n' || c == '\t' || (c >= 32 && c < 127) ? c : '?');
}

int train_sample(rank_t *k) {
    const train_opts_t *o = k->j->o;
    const fsdp_gpt_config_t *cfg = &k->j->cfg;
    int64_t cap = 0, n = 0;
    int64_t total = (int64_t)strlen(o->prompt) + o->sample_tokens + 1;
    int64_t *toks = malloc((size_t)total * sizeof *toks);
    float *row = malloc((size_t)cfg->vocab * sizeof *row);
    int rc = 0;
    if (!toks || !row) {
        free(toks);
        free(row);
        return train_fail(k, "allocating the sample", FSDP_ENOMEM);
    }
    cap = total;
    if (k->j->bpe && o->prompt[0]) {
        /* --tokenizer: the prompt in its tokens (at most one per byte, so it fits) */
        int32_t *ids = malloc(strlen(o->prompt) * sizeof *ids);
        size_t m = 0;
        rc = ids ? fsdp_bpe_encode(k->j->bpe, o->prompt, strlen(o->prompt), ids, strlen(o->prompt),
                                   &m)
                 : FSDP_ENOMEM;
        for (size_t i = 0; rc == 0 && i < m; i++)
            toks[n++] = ids[i];
        free(ids);
        if (rc < 0) goto out;
    } else if (k->j->text && o->prompt[0]) {
        for (const char *p = o->prompt; *p; p++)
            toks[n++] = (unsigned char)*p;
    } else {
        rc = fsdp_dataset_read(k->ctx, k->j->val, 0, 1, toks);
        n = 1;
        if (rc < 0) goto out;
    }
    train_say(k, "sample (%lld tokens, temperature %g, top-k %lld):\n", (long long)o->sample_tokens,
              o->temperature, (long long)o->top_k);
    if (k->r == 0)
        for (int64_t i = 0; i < n; i++)
            print_token(k->j, toks[i]);
    bool was = fsdp_set_grad_enabled(k->ctx, false);
    fsdp_module_train(k->model, false);
    uint64_t rng = o->seed ^ 0x5eedULL;
    for (int64_t i = 0; rc == 0 && i < o->sample_tokens && n < cap; i++) {
        int64_t len = n < cfg->max_seq ? n : cfg->max_seq;
        const int64_t shape[2] = {1, len};
        fsdp_tensor_t *in = NULL, *logits = NULL, *last = NULL;
        rc = fsdp_tensor_from_host(k->ctx, FSDP_DTYPE_I64, 2, shape, toks + (n - len),
                                   FSDP_MEM_OTHER, &in);
        if (rc == 0) rc = fsdp_gpt_forward(k->model, in, &logits);
        if (rc == 0) rc = fsdp_narrow(logits, 1, len - 1, 1, &last);
        if (rc == 0) rc = fsdp_tensor_to_host(last, row, (size_t)cfg->vocab * sizeof *row);
        fsdp_tensor_release(last);
        fsdp_tensor_release(logits);
        fsdp_tensor_release(in);
        int64_t next = 0;
        if (rc == 0 && k->r == 0) next = pick(o, row, cfg->vocab, &rng);
        if (rc == 0) rc = fsdp_pg_broadcast(k->pg, &next, &next, 1, FSDP_DTYPE_I64, 0, NULL);
        if (rc == 0) {
            toks[n++] = next;
            if (k->r == 0) print_token(k->j, next);
        }
    }
    fsdp_module_train(k->model, true);
    fsdp_set_grad_enabled(k->ctx, was);
    if (k->r == 0) {
        putchar('\n');
        fflush(stdout);
    }
out:
    free(toks);
    free(row);
    return rc < 0 ? train_fail(k, "sampling", rc) : 0;
}
