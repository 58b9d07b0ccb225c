/* SPDX-License-Identifier: MIT */
/*
 * replay.c: the main of tests/t_fuzz_corpus.tap, which runs the committed corpus of every fuzz
 * target (fuzz/fuzz.h) in any build, libFuzzer or not (issue 26, "fuzzing in the tree").
 *
 * The corpus of target NAME is fuzz/corpus/NAME/. A file's name says what the target must make
 * of it: "ok-..." is accepted, "bad-..." refused with a message, and "any-..." (inputs whose
 * verdict is not the point, such as those the fuzzers found or minimized) only must not break a
 * promise; a broken promise aborts, which fails the test. One TAP line per file, and one per
 * target saying that its corpus has valid and malformed inputs.
 *
 *   tests/t_fuzz_corpus.tap                  the corpus under $srcdir/fuzz/corpus
 *   tests/t_fuzz_corpus.tap NAME FILE...     replays FILEs (a crash found by libFuzzer, say)
 *                                            through target NAME, printing each verdict
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz/fuzz.h"
#include "tap.h"

static const struct {
    const char *name;
    int (*fn)(const uint8_t *data, size_t size);
} targets[] = {
    {"safetensors", fuzz_safetensors_one},
    {"ckpt", fuzz_ckpt_one},
    {"data", fuzz_data_one},
    {"store_url", fuzz_store_url_one},
};
#define NTARGETS (sizeof targets / sizeof *targets)

static unsigned char *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, len = 0;
    unsigned char *p = malloc(cap);
    for (size_t k; p && (k = fread(p + len, 1, cap - len, f)) > 0;) {
        len += k;
        if (len == cap) {
            unsigned char *q = realloc(p, cap *= 2);
            if (!q) free(p);
            p = q;
        }
    }
    fclose(f);
    *n = len;
    return p;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Replays the corpus directory of target t. */
static void replay_dir(size_t t, const char *root) {
    char dir[1024], path[2048];
    int dl = snprintf(dir, sizeof dir, "%s/%s", root, targets[t].name);
    if (dl < 0 || (size_t)dl >= sizeof dir) tap_bail("the corpus path %s is too long", root);
    DIR *d = opendir(dir);
    if (!d) {
        tap_ok(0, "%s: the corpus %s is there", targets[t].name, dir);
        return;
    }
    char *names[512];
    size_t n = 0;
    for (struct dirent *e; (e = readdir(d)) && n < 512;)
        if (e->d_name[0] != '.') names[n++] = strdup(e->d_name);
    closedir(d);
    qsort(names, n, sizeof *names, cmp_str);
    int valid = 0, malformed = 0;
    for (size_t i = 0; i < n; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        size_t len = 0;
        unsigned char *data = read_all(path, &len);
        if (!data) tap_bail("reading %s failed", path);
        const int ok = strncmp(names[i], "ok-", 3) == 0, bad = strncmp(names[i], "bad-", 4) == 0;
        const int any = strncmp(names[i], "any-", 4) == 0;
        const int got = targets[t].fn(data, len);
        valid += ok;
        malformed += bad;
        if (ok || bad)
            tap_ok(got == ok, "%s/%s (%zu bytes) is %s", targets[t].name, names[i], len,
                   ok ? "accepted" : "refused with a message");
        else
            tap_ok(any, "%s/%s (%zu bytes) keeps every promise (%s)%s", targets[t].name, names[i],
                   len, got ? "accepted" : "refused",
                   any ? "" : ": its name starts with none of ok-, bad- and any-");
        free(data);
        free(names[i]);
    }
    tap_ok(valid > 0 && malformed > 0, "%s: %zu inputs, %d valid and %d malformed", targets[t].name,
           n, valid, malformed);
}

int main(int argc, char **argv) {
    if (argc >= 2) { /* a target and files */
        size_t t = 0;
        while (t < NTARGETS && strcmp(argv[1], targets[t].name) != 0)
            t++;
        if (t == NTARGETS || argc < 3) {
            fprintf(stderr, "usage: %s [safetensors|ckpt|data|store_url FILE...]\n", argv[0]);
            return 2;
        }
        for (int i = 2; i < argc; i++) {
            size_t len = 0;
            unsigned char *data = read_all(argv[i], &len);
            if (!data) {
                fprintf(stderr, "%s: cannot read %s\n", argv[0], argv[i]);
                return 1;
            }
            printf("%s: %s\n", argv[i], targets[t].fn(data, len) ? "accepted" : "refused");
            free(data);
        }
        return 0;
    }
    tap_plan_lazy();
    const char *srcdir = getenv("srcdir");
    char root[1024];
    snprintf(root, sizeof root, "%s/fuzz/corpus", srcdir && *srcdir ? srcdir : ".");
    for (size_t t = 0; t < NTARGETS; t++)
        replay_dir(t, root);
    return tap_done();
}
