/*
 * t_cuda_host.c: the parts of the CUDA device that can be checked without a GPU, in every
 * build:
 *   - the Philox function the dropout kernel runs (backends/cuda/cuda_philox.h, compiled here
 *     for the host) gives fsdp_philox4x32_10's words bit for bit;
 *   - the cast kernel's element conversion (backends/cuda/cuda_cast.h, compiled here for the host)
 *     gives fsdp_dtype_convert's bits for every pair of dtypes;
 *   - dropout masks built from that header with the kernel's layout (one Philox block per four
 *     elements, block offset + i / 4) equal the CPU device's masks bit for bit;
 *   - fsdp_device_create(FSDP_DEVICE_CUDA) fails cleanly where there is no GPU (FSDP_ENOTSUP and
 *     a message) or no CUDA build, and rejects an ordinal past the visible devices.
 */
#include <config.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp.h>

#include "backends/cuda/cuda_cast.h"
#include "backends/cuda/cuda_philox.h"
#include "device/device_impl.h"
#include "tap.h"

#ifdef FSDP_HAVE_CUDA
#include "backends/cuda/cuda_device.h"
#endif

static uint64_t rs = 0x243F6A8885A308D3u;

static uint64_t next64(void) {
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return rs;
}

static fsdp_ctx_t *new_ctx(void) {
    fsdp_ctx_options_t o;
    fsdp_ctx_options_init(&o);
    fsdp_ctx_t *ctx = NULL;
    if (fsdp_ctx_create(&o, &ctx) < 0) tap_bail("cannot create a context");
    return ctx;
}

static void test_philox(void) {
    size_t bad = 0;
    const uint32_t edge[] = {0, 1, 0x7fffffffu, 0x80000000u, 0xffffffffu};
    for (int it = 0; it < 20000; it++) {
        uint32_t c[4], k[2], want[4], got[4];
        for (int j = 0; j < 4; j++)
            c[j] = it < 625 ? edge[(it / (j == 0   ? 1
                                          : j == 1 ? 5
                                          : j == 2 ? 25
                                                   : 125)) %
                                   5]
                            : (uint32_t)next64();
        k[0] = it % 3 == 0 ? 0xffffffffu : (uint32_t)next64();
        k[1] = it % 5 == 0 ? 0 : (uint32_t)next64();
        fsdp_philox4x32_10(c, k, want);
        fsdp_cuda_philox(c, k[0], k[1], got);
        if (memcmp(want, got, sizeof want) != 0) bad++;
    }
    tap_is_size(bad, 0, "cuda_philox.h gives fsdp_philox4x32_10's words for 20000 counters/keys");

    /* A known stream through the public generator: blocks 0.. of (seed, stream). */
    fsdp_rng_t rng;
    fsdp_rng_init(&rng, UINT64_C(0x0123456789abcdef), UINT64_C(0xfedcba9876543210));
    uint32_t words[64];
    fsdp_rng_u32(&rng, words, 64);
    bad = 0;
    for (uint64_t b = 0; b < 16; b++) {
        uint32_t w[4];
        fsdp_cuda_philox_block(UINT64_C(0x0123456789abcdef), UINT64_C(0xfedcba9876543210), b, w);
        if (memcmp(w, words + 4 * b, sizeof w) != 0) bad++;
    }
    tap_is_size(bad, 0, "fsdp_cuda_philox_block(seed, stream, b) is block b of fsdp_rng_u32");
}

/* The mask the dropout kernel computes, element by element as its threads do. */
static void kernel_mask(size_t n, double p, uint64_t seed, uint64_t stream, uint64_t offset,
                        uint8_t *mask) {
    uint32_t thr = fsdp_cuda_dropout_threshold(p);
    for (size_t q = 0; q < (n + 3) / 4; q++) {
        uint32_t w[4];
        fsdp_cuda_philox_block(seed, stream, offset + (uint64_t)q, w);
        for (size_t j = 0; j < 4 && 4 * q + j < n; j++)
            mask[4 * q + j] = (uint8_t)fsdp_cuda_dropout_keep(w[j], thr);
    }
}

static void test_dropout_layout(void) {
    fsdp_ctx_t *ctx = new_ctx();
    fsdp_device_t *cpu = NULL;
    if (fsdp_device_create(ctx, FSDP_DEVICE_CPU, NULL, &cpu) < 0) tap_bail("no CPU device");
    const size_t n = 4099; /* not a multiple of 4: the last block is partial */
    float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
    uint8_t *m_cpu = malloc(n), *m_k = malloc(n);
    for (size_t i = 0; i < n; i++)
        x[i] = (float)i;
    const double ps[] = {0.1, 0.5, 0.9, 1.0 / 3.0, 0x1p-24, 1.0 - 0x1p-24};
    const uint64_t offsets[] = {0, 7, UINT64_C(0xfffffffe), UINT64_MAX - 2};
    for (size_t a = 0; a < sizeof ps / sizeof ps[0]; a++) {
        for (size_t b = 0; b < sizeof offsets / sizeof offsets[0]; b++) {
            uint64_t seed = next64(), stream = b == 3 ? UINT64_MAX : next64();
            int rc = cpu->ops->dropout(cpu, FSDP_DTYPE_F32, n, ps[a], seed, stream, offsets[b], x,
                                       y, m_cpu);
            kernel_mask(n, ps[a], seed, stream, offsets[b], m_k);
            size_t kept = 0;
            for (size_t i = 0; i < n; i++)
                kept += m_k[i];
            tap_ok(rc == 0 && memcmp(m_cpu, m_k, n) == 0,
                   "p %.9g offset %llu: the kernel's mask equals the CPU's bitwise (%zu of %zu "
                   "kept)",
                   ps[a], (unsigned long long)offsets[b], kept, n);
        }
    }
    fsdp_device_destroy(cpu);
    fsdp_ctx_destroy(ctx);
    free(x);
    free(y);
    free(m_cpu);
    free(m_k);
}

static void test_cast(void) {
    enum { N = 20000 };
    double *vals = malloc(N * sizeof *vals);
    for (size_t i = 0; i < N; i++) {
        uint64_t r = next64();
        double v;
        switch (i % 6) {
        case 0:
            v = ldexp((double)(r >> 11) * 0x1p-53 - 0.5, (int)(r % 80) - 40);
            break;
        case 1:
            v = (double)(int64_t)r;
            break; /* beyond every integer range */
        case 2:
            v = (double)((int64_t)(r % 600) - 300) + (double)(r >> 60) / 16.0;
            break;
        case 3:
            v = ldexp(1.0 + (double)(r >> 40) * 0x1p-24, (int)(r % 40) - 30);
            break;
        case 4: {
            /* Any double bit pattern: NaNs with payloads, subnormals, infinities. */
            memcpy(&v, &r, sizeof v);
            break;
        }
        default:
            v = ldexp((double)(r >> 11) * 0x1p-53, (int)(r % 300) - 150);
            break;
        }
        vals[i] = v;
    }
    const double special[] = {0.0,
                              -0.0,
                              65504.0,
                              65519.99,
                              65520.0,
                              -65520.0,
                              0x1p-24,
                              0x1p-25,
                              0x1.8p-25,
                              0x1p-14,
                              0x1.ffcp-15,
                              3.3895313892515355e38,
                              INFINITY,
                              -INFINITY,
                              NAN,
                              2147483647.5,
                              -2147483648.5,
                              255.9,
                              -0.9,
                              9223372036854775807.0,
                              -9223372036854775808.0,
                              0.5,
                              1.5,
                              2.5};
    for (size_t i = 0; i < sizeof special / sizeof special[0]; i++)
        vals[i] = special[i];
    for (int xt = 0; xt < FSDP_DTYPE_COUNT; xt++) {
        size_t xs = fsdp_dtype_size(xt);
        unsigned char *x = malloc(N * xs);
        if (xt == FSDP_DTYPE_I64) {
            /* Whole int64 range, not only what a double holds. */
            for (size_t i = 0; i < N; i++) {
                int64_t v = (int64_t)next64() >> (next64() % 63);
                memcpy(x + i * 8, &v, 8);
            }
        } else if (fsdp_dtype_convert(x, xt, vals, FSDP_DTYPE_F64, N) < 0) {
            tap_bail("convert to %s", fsdp_dtype_name(xt));
        }
        for (int yt = 0; yt < FSDP_DTYPE_COUNT; yt++) {
            size_t ys = fsdp_dtype_size(yt);
            unsigned char *want = calloc(N, ys), *got = calloc(N, ys);
            int rc = fsdp_dtype_convert(want, yt, x, xt, N);
            for (size_t i = 0; i < N; i++)
                fsdp_cuda_cast_one(yt, got, xt, x, i);
            size_t bad = 0, first = 0;
            for (size_t i = 0; i < N; i++)
                if (memcmp(want + i * ys, got + i * ys, ys) != 0 && bad++ == 0) first = i;
            if (bad)
                tap_diag("first difference at %zu (source value %.17g)", first,
                         xt == FSDP_DTYPE_I64 ? 0.0 : vals[first]);
            tap_ok(rc == 0 && bad == 0, "cast kernel %s -> %s: %d values bitwise dtype.c's",
                   fsdp_dtype_name(xt), fsdp_dtype_name(yt), N);
            free(want);
            free(got);
        }
        free(x);
    }
    free(vals);
}

static void test_create(void) {
    fsdp_ctx_t *ctx = new_ctx();
    fsdp_device_t *dev = (fsdp_device_t *)&dev; /* must be reset to NULL on failure */
    int rc = fsdp_device_create(ctx, FSDP_DEVICE_CUDA, NULL, &dev);
#ifndef FSDP_HAVE_CUDA
    tap_is_int(rc, FSDP_ENOTSUP, "without CUDA, creating a CUDA device is FSDP_ENOTSUP");
    tap_ok(dev == NULL, "and *out is NULL");
    tap_has_str(fsdp_ctx_last_error(ctx), "not built", "the message says it was not built");
#else
    char why[256];
    int count = fsdp__cuda_visible_devices(why, sizeof why);
    tap_diag("CUDA devices visible: %d (%s)", count, why);
    if (count == 0) {
        tap_is_int(rc, FSDP_ENOTSUP, "no GPU: creating a CUDA device is FSDP_ENOTSUP, no crash");
        tap_ok(dev == NULL, "and *out is NULL");
        tap_has_str(fsdp_ctx_last_error(ctx), "no CUDA device is visible",
                    "the message says no device is visible");
        tap_diag("message: %s", fsdp_ctx_last_error(ctx));
        fsdp_device_options_t o;
        fsdp_device_options_init(&o);
        o.ordinal = 1;
        rc = fsdp_device_create(ctx, FSDP_DEVICE_CUDA, &o, &dev);
        tap_is_int(rc, FSDP_ENOTSUP, "ordinal 1 without a GPU: FSDP_ENOTSUP as well");
    } else {
        tap_is_int(rc, 0, "a GPU is visible: the CUDA device is created");
        tap_is_str(fsdp_device_name(dev), "cuda:0", "named cuda:0");
        fsdp_device_destroy(dev);
        fsdp_device_options_t o;
        fsdp_device_options_init(&o);
        o.ordinal = count;
        rc = fsdp_device_create(ctx, FSDP_DEVICE_CUDA, &o, &dev);
        tap_is_int(rc, FSDP_EINVAL, "ordinal %d of %d visible devices is FSDP_EINVAL", count,
                   count);
        tap_has_str(fsdp_ctx_last_error(ctx), "is not a CUDA device", "with a message");
    }
    fsdp_device_options_t neg;
    fsdp_device_options_init(&neg);
    neg.ordinal = -1;
    rc = fsdp_device_create(ctx, FSDP_DEVICE_CUDA, &neg, &dev);
    tap_is_int(rc, FSDP_EINVAL, "a negative ordinal is FSDP_EINVAL");
#endif
    fsdp_ctx_destroy(ctx);
}

int main(void) {
    tap_plan_lazy();
    test_philox();
    test_dropout_layout();
    test_cast();
    test_create();
    return tap_done();
}
