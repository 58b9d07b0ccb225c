/* SPDX-License-Identifier: MIT */
/*
 * store_tcp_auth.c: the TCP store's key (store_tcp_proto.h): loading it from the file that
 * FSDP_STORE_KEY_FILE names, and the HMAC-SHA256 proofs of holding it.
 *
 * Like the server, this file depends on nothing of libfsdp but the FSDP_E* codes, so that
 * fsdprun compiles it in too. The key file is checked as ssh checks a private key: opened
 * without following a link and without blocking (a FIFO must not hang a rank), a regular file
 * owned by the user, with no permission for the group or others, of 16 to 1024 bytes, all of
 * which are the key.
 */
#define _GNU_SOURCE

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <config.h>
#include <fsdp/errno.h>

#include "core/hmac.h"
#include "store/store_tcp_proto.h"

int fsdp__tcp_key_load(const char *path, fsdp__tcp_key_t *key, char *why, size_t cap) {
    key->len = 0;
#ifndef FSDP_HAVE_CRYPTO
    snprintf(why, cap,
             "FSDP_STORE_KEY_FILE '%s': libfsdp was built without OpenSSL's libcrypto, "
             "which the TCP store's key needs",
             path);
    return FSDP_ENOTSUP;
#else
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        snprintf(why, cap, "FSDP_STORE_KEY_FILE '%s': %s", path,
                 e == ELOOP ? "is a symbolic link" : strerror(e));
        return e == ELOOP ? FSDP_EINVAL : FSDP_EBACKEND;
    }
    struct stat st;
    int rc = FSDP_EINVAL;
    if (fstat(fd, &st) < 0) {
        snprintf(why, cap, "FSDP_STORE_KEY_FILE '%s': %s", path, strerror(errno));
        rc = FSDP_EBACKEND;
    } else if (!S_ISREG(st.st_mode)) {
        snprintf(why, cap, "FSDP_STORE_KEY_FILE '%s' is not a regular file", path);
    } else if (st.st_uid != geteuid()) {
        snprintf(why, cap, "FSDP_STORE_KEY_FILE '%s' belongs to uid %ld, not to this user (%ld)",
                 path, (long)st.st_uid, (long)geteuid());
    } else if (st.st_mode & 077) {
        snprintf(why, cap,
                 "FSDP_STORE_KEY_FILE '%s' has mode %04o: others may read or change it (chmod "
                 "600)",
                 path, (unsigned)(st.st_mode & 07777));
    } else if (st.st_size < TCP_KEY_MIN || st.st_size > TCP_KEY_MAX) {
        snprintf(why, cap, "FSDP_STORE_KEY_FILE '%s' has %lld bytes; a key has %d to %d", path,
                 (long long)st.st_size, TCP_KEY_MIN, TCP_KEY_MAX);
    } else {
        size_t want = (size_t)st.st_size, got = 0;
        while (got < want) {
            ssize_t n = read(fd, key->bytes + got, want - got);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) break;
            got += (size_t)n;
        }
        if (got == want) {
            key->len = want;
            rc = FSDP_OK;
        } else {
            snprintf(why, cap, "FSDP_STORE_KEY_FILE '%s': cannot read it whole", path);
            rc = FSDP_EBACKEND;
        }
    }
    close(fd);
    return rc;
#endif
}

int fsdp__tcp_key_from_env(fsdp__tcp_key_t *key, char *why, size_t cap) {
    key->len = 0;
    const char *path = getenv("FSDP_STORE_KEY_FILE");
    if (!path || !*path) return FSDP_OK;
    return fsdp__tcp_key_load(path, key, why, cap);
}

int fsdp__tcp_nonce(unsigned char *p, size_t n) {
    return fsdp__random_bytes(p, n);
}

int fsdp__tcp_proof(const fsdp__tcp_key_t *key, char label, const unsigned char *ns,
                    const unsigned char *nc, unsigned char out[TCP_PROOF]) {
    unsigned char data[1 + 2 * TCP_NONCE];
    data[0] = (unsigned char)label;
    memcpy(data + 1, ns, TCP_NONCE);
    memcpy(data + 1 + TCP_NONCE, nc, TCP_NONCE);
    return fsdp__hmac_sha256(key->bytes, key->len, data, sizeof data, out);
}

int fsdp__tcp_proof_ok(const fsdp__tcp_key_t *key, char label, const unsigned char *ns,
                       const unsigned char *nc, const unsigned char *got) {
    unsigned char want[TCP_PROOF];
    return key->len > 0 && fsdp__tcp_proof(key, label, ns, nc, want) == 0 &&
           fsdp__mac_equal(want, got, TCP_PROOF);
}
