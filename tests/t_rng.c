/* SPDX-License-Identifier: MIT */
/*
 * t_rng.c: tests of fsdp/rng.h.
 *
 * Philox is checked against published known answers; the stream functions against the
 * header's definitions (counter and key layout, four words a block, offset advancing by
 * ceil(n/4)); determinism however a request is split; simple moments of the uniform and normal
 * distributions; and concurrent use of separate generators from two threads.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/rng.h>

#include "tap.h"

/*
 * Known answers of Philox4x32 with 10 rounds, the three "philox4x32 10" lines of the file
 * tests/kat_vectors in the Random123 distribution (D. E. Shaw Research,
 * github.com/DEShawResearch/random123); the values were checked against several public copies
 * of those lines. Columns: counter[4], key[2], expected output[4].
 */
static const struct {
    uint32_t ctr[4], key[2], out[4];
} kat[] = {
    {{0x00000000, 0x00000000, 0x00000000, 0x00000000},
     {0x00000000, 0x00000000},
     {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
    {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
     {0xffffffff, 0xffffffff},
     {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
    {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
     {0xa4093822, 0x299f31d0},
     {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
};

static void test_kat(void) {
    for (size_t i = 0; i < sizeof kat / sizeof kat[0]; i++) {
        uint32_t out[4];
        fsdp_philox4x32_10(kat[i].ctr, kat[i].key, out);
        tap_is_mem(out, kat[i].out, sizeof out, "philox4x32_10 known answer %zu (ctr %08x...)", i,
                   kat[i].ctr[0]);
    }
    /* The output may overwrite the counter it was computed from. */
    uint32_t inout[4];
    memcpy(inout, kat[2].ctr, sizeof inout);
    fsdp_philox4x32_10(inout, kat[2].key, inout);
    tap_is_mem(inout, kat[2].out, sizeof inout, "philox4x32_10 with out == ctr");
}

/* Word i of a stream, straight from the definition in the header. */
static uint32_t ref_word(uint64_t seed, uint64_t stream, uint64_t i) {
    uint64_t b = i / 4;
    const uint32_t ctr[4] = {(uint32_t)b, (uint32_t)(b >> 32), (uint32_t)stream,
                             (uint32_t)(stream >> 32)};
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    uint32_t out[4];
    fsdp_philox4x32_10(ctr, key, out);
    return out[i % 4];
}

#define SEED UINT64_C(0x0123456789abcdef)
#define STREAM UINT64_C(0xfedcba9876543210)

static void test_layout(void) {
    fsdp_rng_t r;
    memset(&r, 0xff, sizeof r);
    fsdp_rng_init(&r, SEED, STREAM);
    tap_ok(r.seed == SEED && r.stream == STREAM && r.offset == 0,
           "rng_init sets seed and stream and starts at block 0");

    uint32_t w[64];
    fsdp_rng_u32(&r, w, 64);
    int same = 1;
    for (int i = 0; i < 64; i++)
        same &= w[i] == ref_word(SEED, STREAM, (uint64_t)i);
    tap_ok(same && r.offset == 16, "rng_u32: words of blocks 0..15 in order, offset 16");

    /* A block index above 2^32 checks that its high half goes into counter word 1. */
    uint64_t off = (UINT64_C(1) << 32) + 5;
    r.offset = off;
    fsdp_rng_u32(&r, w, 8);
    same = 1;
    for (int i = 0; i < 8; i++)
        same &= w[i] == ref_word(SEED, STREAM, off * 4 + (uint64_t)i);
    tap_ok(same && r.offset == off + 2, "rng_u32 from block 2^32 + 5 uses the 64-bit counter");
}

static void test_offsets(void) {
    fsdp_rng_t r;
    fsdp_rng_init(&r, 7, 3);
    uint32_t w[16];
    int ok = 1;
    uint64_t want = 0;
    /* n = 0..9 words per call: each call starts on a fresh block. */
    for (size_t n = 0; n < 10; n++) {
        uint64_t start = r.offset;
        fsdp_rng_u32(&r, w, n);
        for (size_t i = 0; i < n; i++)
            ok &= w[i] == ref_word(7, 3, start * 4 + i);
        want += (n + 3) / 4;
        ok &= r.offset == want;
    }
    tap_ok(ok, "rng_u32: n = 0..9 each start at a block boundary and advance ceil(n/4)");

    float f[16];
    uint64_t o = r.offset;
    fsdp_rng_uniform_f32(&r, f, 5, 0, 1);
    fsdp_rng_uniform_f32(&r, f, 0, 0, 1);
    fsdp_rng_uniform_f32(&r, f, 4, 0, 1);
    tap_is_uint(r.offset - o, 3, "uniform: 5, 0 and 4 values advance 2 + 0 + 1 blocks");
    o = r.offset;
    fsdp_rng_normal_f32(&r, f, 1, 0, 1);
    fsdp_rng_normal_f32(&r, f, 3, 0, 1);
    fsdp_rng_normal_f32(&r, f, 5, 0, 1);
    fsdp_rng_normal_f32(&r, f, 8, 0, 1);
    tap_is_uint(r.offset - o, 1 + 1 + 2 + 2, "normal: 1, 3, 5 and 8 values advance 1+1+2+2");
}

/* Call sizes for the split tests: a small LCG, so the test depends on nothing else. */
static unsigned next_size(unsigned *s) {
    *s = *s * 1103515245u + 12345u;
    return (*s >> 16) % 40;
}

/* Draws `total` words in calls of random multiples of 4 (including 0). */
static void draw_split_u32(fsdp_rng_t *r, uint32_t *out, size_t total, unsigned *seed) {
    size_t i = 0;
    while (i < total) {
        size_t n = 4 * (size_t)next_size(seed);
        if (n > total - i) n = total - i;
        fsdp_rng_u32(r, out + i, n);
        i += n;
    }
}

#define SPLIT_N 4096

static void test_split(void) {
    static uint32_t a[SPLIT_N], b[SPLIT_N];
    fsdp_rng_t ra, rb;
    fsdp_rng_init(&ra, SEED, 11);
    fsdp_rng_init(&rb, SEED, 11);
    fsdp_rng_u32(&ra, a, SPLIT_N);
    unsigned s = 1;
    draw_split_u32(&rb, b, SPLIT_N, &s);
    tap_ok(memcmp(a, b, sizeof a) == 0 && ra.offset == SPLIT_N / 4 && rb.offset == ra.offset,
           "u32: one call of %d equals calls of random multiples of 4", SPLIT_N);

    static float fa[SPLIT_N], fb[SPLIT_N];
    fsdp_rng_init(&ra, SEED, 12);
    fsdp_rng_init(&rb, SEED, 12);
    fsdp_rng_uniform_f32(&ra, fa, SPLIT_N, -1.0f, 1.0f);
    for (size_t i = 0; i < SPLIT_N;) {
        size_t n = 4 * (size_t)next_size(&s);
        if (n > SPLIT_N - i) n = SPLIT_N - i;
        fsdp_rng_uniform_f32(&rb, fb + i, n, -1.0f, 1.0f);
        i += n;
    }
    tap_ok(memcmp(fa, fb, sizeof fa) == 0 && rb.offset == ra.offset,
           "uniform: one call equals calls of random multiples of 4");

    fsdp_rng_init(&ra, SEED, 13);
    fsdp_rng_init(&rb, SEED, 13);
    fsdp_rng_normal_f32(&ra, fa, SPLIT_N, 0.0f, 1.0f);
    for (size_t i = 0; i < SPLIT_N;) {
        size_t n = 4 * (size_t)next_size(&s);
        if (n > SPLIT_N - i) n = SPLIT_N - i;
        fsdp_rng_normal_f32(&rb, fb + i, n, 0.0f, 1.0f);
        i += n;
    }
    tap_ok(memcmp(fa, fb, sizeof fa) == 0 && rb.offset == ra.offset,
           "normal: one call equals calls of random multiples of 4");

    /* A rank drawing its share of a global tensor starts at the right offset. */
    fsdp_rng_init(&rb, SEED, 11);
    rb.offset = 1000 / 4;
    fsdp_rng_u32(&rb, b, 96);
    tap_ok(memcmp(a + 1000, b, 96 * sizeof b[0]) == 0,
           "u32: starting at offset 250 = words 1000..");
}

/* Counts equal words at equal positions: two independent streams agree by chance ~2^-32. */
static int count_equal(const uint32_t *a, const uint32_t *b, size_t n) {
    int c = 0;
    for (size_t i = 0; i < n; i++)
        c += a[i] == b[i];
    return c;
}

static void test_independence(void) {
    uint32_t a[256], b[256];
    fsdp_rng_t r;
    fsdp_rng_init(&r, 42, 0);
    fsdp_rng_u32(&r, a, 256);
    fsdp_rng_init(&r, 42, 1);
    fsdp_rng_u32(&r, b, 256);
    tap_is_int(count_equal(a, b, 256), 0, "streams 0 and 1 of one seed differ");
    fsdp_rng_init(&r, 43, 0);
    fsdp_rng_u32(&r, b, 256);
    tap_is_int(count_equal(a, b, 256), 0, "seeds 42 and 43 differ");
    fsdp_rng_init(&r, 42 + (UINT64_C(1) << 32), 0);
    fsdp_rng_u32(&r, b, 256);
    tap_is_int(count_equal(a, b, 256), 0, "seeds differing only in the high word differ");
    fsdp_rng_init(&r, 42, UINT64_C(1) << 32);
    fsdp_rng_u32(&r, b, 256);
    tap_is_int(count_equal(a, b, 256), 0, "streams differing only in the high word differ");
    fsdp_rng_init(&r, 42, 0);
    fsdp_rng_u32(&r, b, 256);
    tap_is_int(count_equal(a, b, 256), 256, "re-initialising repeats the stream");
}

#define NSTAT 1000000

static void test_uniform(void) {
    /* The definition, word by word. */
    fsdp_rng_t r;
    fsdp_rng_init(&r, 5, 6);
    float f[1000];
    fsdp_rng_uniform_f32(&r, f, 1000, -3.0f, 5.0f);
    int exact = 1;
    for (uint64_t i = 0; i < 1000; i++) {
        double u = (double)(ref_word(5, 6, i) >> 8) * 0x1p-24;
        float want = (float)(-3.0 + 8.0 * u);
        exact &= f[i] == want;
    }
    tap_ok(exact, "uniform: lo + (hi - lo) * (w >> 8) * 2^-24, word by word");

    static float v[NSTAT];
    fsdp_rng_init(&r, 99, 0);
    fsdp_rng_uniform_f32(&r, v, NSTAT, -2.0f, 3.0f);
    double sum = 0, sum2 = 0;
    float lo = v[0], hi = v[0];
    for (int i = 0; i < NSTAT; i++) {
        sum += v[i];
        if (v[i] < lo) lo = v[i];
        if (v[i] > hi) hi = v[i];
    }
    double mean = sum / NSTAT;
    for (int i = 0; i < NSTAT; i++)
        sum2 += (v[i] - mean) * (v[i] - mean);
    double var = sum2 / (NSTAT - 1);
    tap_ok(lo >= -2.0f && hi < 3.0f && lo < -1.99f && hi > 2.99f,
           "uniform [-2, 3): 1e6 samples within range and reach both ends (min %g, max %g)",
           (double)lo, (double)hi);
    /* Standard error of the mean is sqrt(25/12 / 1e6) = 0.0014; allow about 5 of them. */
    tap_is_near(mean, 0.5, 0, 0.0075, "uniform [-2, 3): mean");
    tap_is_near(var, 25.0 / 12.0, 0.01, 0, "uniform [-2, 3): variance");
    tap_is_uint(r.offset, NSTAT / 4, "uniform: 1e6 samples advance 250000 blocks");

    /* When hi is the float right after lo, lo + span * u rounds onto hi for about half of the
     * words; the half-open range must still hold. */
    float one_up = nextafterf(1.0f, 2.0f);
    fsdp_rng_uniform_f32(&r, f, 1000, 1.0f, one_up);
    int in = 1;
    for (int i = 0; i < 1000; i++)
        in &= f[i] == 1.0f;
    tap_ok(in, "uniform [1, nextafter(1)): every value is 1, never the rounded-up hi");
    fsdp_rng_uniform_f32(&r, f, 1000, 1e8f, 1e8f + 8.0f); /* floats 8 apart there: 1 value */
    in = 1;
    for (int i = 0; i < 1000; i++)
        in &= f[i] == 1e8f;
    tap_ok(in, "uniform [1e8, 1e8 + 8): every value is 1e8");
    fsdp_rng_uniform_f32(&r, f, 1000, 4.0f, 4.0f);
    in = 1;
    for (int i = 0; i < 1000; i++)
        in &= f[i] == 4.0f;
    tap_ok(in, "uniform with lo == hi gives lo");
}

static void test_normal(void) {
    /* The definition, pair by pair, including an odd count that uses z0 of the last pair. */
    fsdp_rng_t r;
    fsdp_rng_init(&r, 8, 9);
    float f[11];
    fsdp_rng_normal_f32(&r, f, 11, 1.5f, 2.0f);
    int exact = 1;
    for (uint64_t j = 0; j < 6; j++) {
        double u1 = ((double)(ref_word(8, 9, 2 * j) >> 8) + 1.0) * 0x1p-24;
        double u2 = (double)(ref_word(8, 9, 2 * j + 1) >> 8) * 0x1p-24;
        double rad = sqrt(-2.0 * log(u1));
        double z0 = rad * cos(6.283185307179586476925286766559 * u2);
        double z1 = rad * sin(6.283185307179586476925286766559 * u2);
        exact &= f[2 * j] == (float)(1.5 + 2.0 * z0);
        if (2 * j + 1 < 11) exact &= f[2 * j + 1] == (float)(1.5 + 2.0 * z1);
    }
    tap_ok(exact && r.offset == 3, "normal: Box-Muller on word pairs, odd n uses z0 of the last");

    static float v[NSTAT];
    fsdp_rng_init(&r, 1234, 5);
    fsdp_rng_normal_f32(&r, v, NSTAT, 0.0f, 1.0f);
    double sum = 0, sum2 = 0;
    long within1 = 0, finite = 0;
    for (int i = 0; i < NSTAT; i++) {
        sum += v[i];
        finite += isfinite(v[i]) != 0;
        within1 += fabs(v[i]) < 1.0;
    }
    double mean = sum / NSTAT;
    for (int i = 0; i < NSTAT; i++)
        sum2 += (v[i] - mean) * (v[i] - mean);
    double sd = sqrt(sum2 / (NSTAT - 1));
    tap_is_int(finite, NSTAT, "normal: 1e6 samples are all finite");
    /* Standard errors: mean 0.001, std 0.0007, P(|z| < 1) 0.00047; about 5 of each. */
    tap_is_near(mean, 0.0, 0, 0.005, "normal(0, 1): mean");
    tap_is_near(sd, 1.0, 0, 0.0035, "normal(0, 1): standard deviation");
    tap_is_near((double)within1 / NSTAT, 0.682689, 0, 0.0025, "normal(0, 1): P(|z| < 1)");

    fsdp_rng_normal_f32(&r, v, NSTAT, 3.0f, 0.5f);
    sum = sum2 = 0;
    for (int i = 0; i < NSTAT; i++)
        sum += v[i];
    mean = sum / NSTAT;
    for (int i = 0; i < NSTAT; i++)
        sum2 += (v[i] - mean) * (v[i] - mean);
    sd = sqrt(sum2 / (NSTAT - 1));
    tap_ok(fabs(mean - 3.0) < 0.0025 && fabs(sd - 0.5) < 0.002,
           "normal(3, 0.5): mean %.5f, std %.5f", mean, sd);
}

/* ---- two threads, each with its own generator ---- */

#define TN 200000

struct job {
    uint64_t seed, stream;
    uint32_t *u;
    float *uni, *nrm;
    unsigned split_seed;
};

static void run_job(struct job *j, int split) {
    fsdp_rng_t r;
    fsdp_rng_init(&r, j->seed, j->stream);
    if (split)
        draw_split_u32(&r, j->u, TN, &j->split_seed);
    else
        fsdp_rng_u32(&r, j->u, TN);
    fsdp_rng_uniform_f32(&r, j->uni, TN, 0.0f, 1.0f);
    fsdp_rng_normal_f32(&r, j->nrm, TN, 0.0f, 1.0f);
}

static void *job_thread(void *arg) {
    run_job(arg, 1);
    return NULL;
}

static void test_threads(void) {
    struct job seq[2], par[2];
    int ok = 1;
    for (int t = 0; t < 2; t++) {
        struct job *js[2] = {&seq[t], &par[t]};
        for (int k = 0; k < 2; k++) {
            js[k]->seed = 77 + (uint64_t)t;
            js[k]->stream = (uint64_t)t;
            js[k]->u = malloc(TN * sizeof(uint32_t));
            js[k]->uni = malloc(TN * sizeof(float));
            js[k]->nrm = malloc(TN * sizeof(float));
            js[k]->split_seed = 100u + (unsigned)t;
            ok &= js[k]->u && js[k]->uni && js[k]->nrm;
        }
    }
    if (!ok) tap_bail("out of memory");
    for (int t = 0; t < 2; t++)
        run_job(&seq[t], 0);
    pthread_t th[2];
    for (int t = 0; t < 2; t++)
        if (pthread_create(&th[t], NULL, job_thread, &par[t]) != 0) tap_bail("pthread_create");
    for (int t = 0; t < 2; t++)
        pthread_join(th[t], NULL);
    for (int t = 0; t < 2; t++) {
        tap_ok(memcmp(seq[t].u, par[t].u, TN * sizeof(uint32_t)) == 0 &&
                   memcmp(seq[t].uni, par[t].uni, TN * sizeof(float)) == 0 &&
                   memcmp(seq[t].nrm, par[t].nrm, TN * sizeof(float)) == 0,
               "thread %d: concurrent draws equal the sequential ones", t);
    }
    for (int t = 0; t < 2; t++) {
        struct job *js[2] = {&seq[t], &par[t]};
        for (int k = 0; k < 2; k++) {
            free(js[k]->u);
            free(js[k]->uni);
            free(js[k]->nrm);
        }
    }
}

int main(void) {
    tap_plan_lazy();
    test_kat();
    test_layout();
    test_offsets();
    test_split();
    test_independence();
    test_uniform();
    test_normal();
    test_threads();
    return tap_done();
}
