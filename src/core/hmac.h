/* SPDX-License-Identifier: MIT */
/*
 * hmac.h: the few cryptographic steps libfsdp takes, in one place: random nonces and keys from
 * the kernel, HMAC-SHA256 (OpenSSL's libcrypto) and a constant-time comparison. The gloo
 * backend's connections (backends/gloo/gloo_mesh.c) and the TCP store's key
 * (src/store/store_tcp_auth.c) build their proofs on them.
 *
 * Depends on libc and libcrypto only, so that fsdprun, which links no libfsdp, compiles it in.
 * Built without libcrypto (FSDP_HAVE_CRYPTO unset), fsdp__hmac_sha256 fails and
 * fsdp__mac_equal says no.
 */
#ifndef FSDP_CORE_HMAC_H
#define FSDP_CORE_HMAC_H

#include <stddef.h>

#define FSDP_HMAC_BYTES 32

/* n bytes from getrandom(2); 0, or -1 with errno set. */
int fsdp__random_bytes(void *p, size_t n);

/* HMAC-SHA256(key, data) into out; 0, or -1 (no libcrypto, or it failed). */
int fsdp__hmac_sha256(const void *key, size_t key_len, const void *data, size_t len,
                      unsigned char out[FSDP_HMAC_BYTES]);

/* 1 when the n bytes at a and b are equal, compared in time that does not depend on where they
 * differ; else 0 (also without libcrypto). */
int fsdp__mac_equal(const unsigned char *a, const unsigned char *b, size_t n);

#endif /* FSDP_CORE_HMAC_H */
