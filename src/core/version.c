/* SPDX-License-Identifier: MIT */
/*
 * version.c: the version of the library that is loaded, for comparison with the headers'.
 */
#include "internal.h"

const char *fsdp_version_string(void) {
    return FSDP_VERSION_STRING;
}

int fsdp_version_code(void) {
    return FSDP_VERSION_CODE;
}
