/* SPDX-License-Identifier: MIT */
/*
 * errno.c: names and descriptions of status codes, and the shared error-formatting helpers.
 */
#include <stdio.h>

#include "internal.h"

const char *fsdp_strerror(int rc) {
    switch (rc) {
#define FSDP__ERRNO_DESC(name, value, desc)                                                    \
    case value:                                                                                \
        return desc;
        FSDP_ERRNO_MAP(FSDP__ERRNO_DESC)
#undef FSDP__ERRNO_DESC
    }
    return "unknown status";
}

const char *fsdp_err_name(int rc) {
    switch (rc) {
#define FSDP__ERRNO_NAME(name, value, desc)                                                    \
    case value:                                                                                \
        return "FSDP_" #name;
        FSDP_ERRNO_MAP(FSDP__ERRNO_NAME)
#undef FSDP__ERRNO_NAME
    }
    return "FSDP_E?";
}

int fsdp__verr(char *buf, int rc, const char *fmt, va_list ap) {
    if (buf) vsnprintf(buf, FSDP_ERR_LEN, fmt, ap);
    return rc;
}

int fsdp__err(char *buf, int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fsdp__verr(buf, rc, fmt, ap);
    va_end(ap);
    return rc;
}
