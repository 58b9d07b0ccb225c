/* SPDX-License-Identifier: MIT */
/*
 * store_file_name.h: how the file store names a key's files, shared by the store
 * (store_file.c) and fsdprun, which writes and reads its failure records in a job's file store
 * without linking libfsdp (tools/fsdprun_record.c).
 *
 * A key's value lives in "k.<name>" (its lock in "l.<name>"), where <name> is the key with every
 * byte outside [A-Za-z0-9_-] written as %XX, so '/' never makes a subdirectory and no name is
 * "." or "..". A name longer than NAME_BYTES is its first NAME_HEAD bytes, '~' (which encoding
 * never produces) and a 128-bit hash of the whole key. Header-only: libc alone.
 */
#ifndef FSDP_STORE_FILE_NAME_H
#define FSDP_STORE_FILE_NAME_H

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* Longest encoded name: "t." + name + ".XXXXXX" stays well below NAME_MAX (255). */
#define NAME_BYTES 200
/* Bytes of the encoded key kept in front of the hash of a long name. */
#define NAME_HEAD 160

/* A 64-bit FNV-1a hash of s from `seed`, finished with a strong mixer. */
static inline uint64_t fsdp__store_file_hash(const char *s, uint64_t seed) {
    uint64_t h = 0xcbf29ce484222325ULL ^ seed;
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 0x100000001b3ULL;
    }
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

/* Writes key's file name (without the kind) into name (NAME_BYTES + 1 bytes). */
static inline void fsdp__store_file_name(const char *key, char *name) {
    static const char hex[] = "0123456789ABCDEF";
    char full[3 * 512 + 1];
    size_t n = 0;
    for (const unsigned char *p = (const unsigned char *)key; *p && n + 4 < sizeof full; p++) {
        int plain = (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') ||
                    (*p >= '0' && *p <= '9') || *p == '_' || *p == '-';
        if (plain) {
            full[n++] = (char)*p;
        } else {
            full[n++] = '%';
            full[n++] = hex[*p >> 4];
            full[n++] = hex[*p & 15];
        }
    }
    full[n] = 0;
    if (n <= NAME_BYTES) {
        memcpy(name, full, n + 1);
        return;
    }
    snprintf(name, NAME_BYTES + 1, "%.*s~%016" PRIx64 "%016" PRIx64, NAME_HEAD, full,
             fsdp__store_file_hash(key, 0), fsdp__store_file_hash(key, 0x9e3779b97f4a7c15ULL));
}

#endif /* FSDP_STORE_FILE_NAME_H */
