/* SPDX-License-Identifier: MIT */
/*
 * hmac.c: random bytes, HMAC-SHA256 and a constant-time comparison (hmac.h).
 */
#define _GNU_SOURCE

#include <errno.h>
#include <sys/random.h>
#include <sys/types.h>

#include <config.h>

#ifdef FSDP_HAVE_CRYPTO
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#endif

#include "core/hmac.h"

int fsdp__random_bytes(void *p, size_t n) {
    unsigned char *b = p;
    while (n > 0) {
        ssize_t got = getrandom(b, n, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return -1;
        b += got, n -= (size_t)got;
    }
    return 0;
}

int fsdp__hmac_sha256(const void *key, size_t key_len, const void *data, size_t len,
                      unsigned char out[FSDP_HMAC_BYTES]) {
#ifdef FSDP_HAVE_CRYPTO
    unsigned got = 0;
    if (key_len > (size_t)0x7fffffff ||
        !HMAC(EVP_sha256(), key, (int)key_len, data, len, out, &got) || got != FSDP_HMAC_BYTES)
        return -1;
    return 0;
#else
    (void)key, (void)key_len, (void)data, (void)len, (void)out;
    return -1;
#endif
}

int fsdp__mac_equal(const unsigned char *a, const unsigned char *b, size_t n) {
#ifdef FSDP_HAVE_CRYPTO
    return CRYPTO_memcmp(a, b, n) == 0;
#else
    (void)a, (void)b, (void)n;
    return 0;
#endif
}
