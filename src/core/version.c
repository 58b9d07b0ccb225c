/* SPDX-License-Identifier: MIT */
/*
 * version.c: the version of the library that is loaded, for comparison with the headers', and
 * how it was built (fsdp_build_info; git-revision.h is made by make in the build tree).
 */
#include "core/build_info.h"
#include "internal.h"

const char *fsdp_version_string(void) {
    return FSDP_VERSION_STRING;
}

int fsdp_version_code(void) {
    return FSDP_VERSION_CODE;
}

const char *fsdp_build_info(void) {
    return FSDP_BUILD_INFO;
}
