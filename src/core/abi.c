/* SPDX-License-Identifier: MIT */
/*
 * abi.c: the one check of the size member that every public options struct starts with (the ABI
 * policy of docs/design.md): its _init stores the size the caller was compiled with, and every
 * function that reads or fills such a struct goes through these helpers.
 */
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

static size_t abi_size_of(const void *o) {
    size_t size;
    memcpy(&size, o, sizeof size);
    return size;
}

/* Why a size cannot be a caller's layout of abi's struct, into buf; or 0. what names the size
 * in the message ("opts->size"); advise adds how to make a struct that passes (a size read from
 * a struct; not one a caller passed as an argument). */
static int abi_size_error(char *buf, const char *fn, const char *what, size_t size,
                          const fsdp__abi_struct_t *abi, bool advise) {
    char advice[160] = "";
    if (advise) snprintf(advice, sizeof advice, ": initialise it with %s", abi->init);
    if (size == 0 && advise)
        return fsdp__err(buf, FSDP_EINVAL,
                         "%s: %s is 0: a %s must be initialised with %s before its fields "
                         "are set",
                         fn, what, abi->type, abi->init);
    if (size < abi->v1_size)
        return fsdp__err(buf, FSDP_EINVAL,
                         "%s: %s is %zu, smaller than the %zu bytes of the first %s layout%s", fn,
                         what, size, abi->v1_size, abi->type, advice);
    if (size > abi->size + FSDP__ABI_MAX_GROWTH)
        return fsdp__err(buf, FSDP_EINVAL,
                         "%s: %s is %zu, not the size of any %s (%zu bytes in this libfsdp)%s", fn,
                         what, size, abi->type, abi->size, advice);
    return FSDP_OK;
}

int fsdp__abi_check_buf(char *buf, const char *fn, const char *arg, const void *o,
                        const fsdp__abi_struct_t *abi) {
    if (!o) return FSDP_OK;
    const size_t size = abi_size_of(o);
    char what[128];
    snprintf(what, sizeof what, "%s->size", arg);
    int rc = abi_size_error(buf, fn, what, size, abi, true);
    if (rc < 0) return rc;
    const unsigned char *b = o;
    for (size_t i = abi->size; i < size; i++)
        if (b[i] != 0)
            return fsdp__err(buf, FSDP_ENOTSUP,
                             "%s: %s->size is %zu but this libfsdp's %s has %zu bytes, and byte "
                             "%zu past them is not zero: the caller, built against a newer "
                             "libfsdp, sets an option this library does not have",
                             fn, arg, size, abi->type, abi->size, i);
    return FSDP_OK;
}

int fsdp__abi_check(fsdp_ctx_t *ctx, const char *fn, const char *arg, const void *o,
                    const fsdp__abi_struct_t *abi) {
    char buf[FSDP_ERR_LEN];
    int rc = fsdp__abi_check_buf(buf, fn, arg, o, abi);
    return rc < 0 ? fsdp__ctx_err_or_log(ctx, rc, "%s", buf) : FSDP_OK;
}

int fsdp__abi_check_embedded(fsdp_ctx_t *ctx, const char *fn, const char *arg, const void *o,
                             const fsdp__abi_struct_t *abi, const char *outer_init) {
    if (!o) return FSDP_OK;
    const size_t size = abi_size_of(o);
    if (size == abi->size) return FSDP_OK;
    return fsdp__ctx_err_or_log(ctx, FSDP_EINVAL,
                                "%s: %s.size is %zu, not %zu (a %s inside another struct has "
                                "this library's layout): initialise it with %s (%s does)",
                                fn, arg, size, abi->size, abi->type, abi->init, outer_init);
}

int fsdp__abi_fill(fsdp_ctx_t *ctx, const char *fn, const char *what, void *dst, size_t dst_size,
                   const void *src, const fsdp__abi_struct_t *abi) {
    if (!dst) return FSDP_EINVAL;
    char buf[FSDP_ERR_LEN];
    int rc = abi_size_error(buf, fn, what, dst_size, abi, false);
    if (rc < 0) {
        /* A size below the first layout gets zeros and itself where it fits, so that no consumer
         * takes the struct; a size too large to be a layout is not the caller's object's, and
         * nothing is written. */
        if (dst_size < abi->v1_size) {
            memset(dst, 0, dst_size);
            if (dst_size >= sizeof dst_size) memcpy(dst, &dst_size, sizeof dst_size);
        }
        return fsdp__ctx_err_or_log(ctx, rc, "%s", buf);
    }
    unsigned char *d = dst;
    const size_t n = dst_size < abi->size ? dst_size : abi->size;
    memcpy(d, src, n);
    if (dst_size > n) memset(d + n, 0, dst_size - n);
    memcpy(d, &dst_size, sizeof dst_size);
    return FSDP_OK;
}

void fsdp__abi_init(void *o, size_t size, const void *d, const fsdp__abi_struct_t *abi) {
    fsdp__abi_fill(NULL, abi->init, "size", o, size, d, abi);
}

void fsdp__abi_copy_in(void *dst, const void *src, const fsdp__abi_struct_t *abi) {
    const size_t size = abi_size_of(src);
    memcpy(dst, src, size < abi->size ? size : abi->size);
    memcpy(dst, &abi->size, sizeof abi->size);
}
