/* SPDX-License-Identifier: MIT */
/*
 * t_errno.c: status codes, their names and descriptions, and the version.
 */
#include <string.h>

#include <fsdp.h>

#include "tap.h"

int main(void) {
    tap_plan_lazy();
    static const struct {
        int code;
        const char *name;
    } codes[] = {
        {FSDP_OK, "FSDP_OK"},           {FSDP_EINVAL, "FSDP_EINVAL"},
        {FSDP_ENOMEM, "FSDP_ENOMEM"},   {FSDP_ENOTSUP, "FSDP_ENOTSUP"},
        {FSDP_ETIMEDOUT, "FSDP_ETIMEDOUT"}, {FSDP_EREMOTE, "FSDP_EREMOTE"},
        {FSDP_EMISMATCH, "FSDP_EMISMATCH"}, {FSDP_EBACKEND, "FSDP_EBACKEND"},
        {FSDP_EINTERNAL, "FSDP_EINTERNAL"},
    };
    size_t n = sizeof codes / sizeof codes[0];
    for (size_t i = 0; i < n; i++) {
        tap_is_str(fsdp_err_name(codes[i].code), codes[i].name, "name of %d", codes[i].code);
        tap_ok(strcmp(fsdp_strerror(codes[i].code), "unknown status") != 0,
               "%s has a description: \"%s\"", codes[i].name, fsdp_strerror(codes[i].code));
        if (codes[i].code != FSDP_OK) tap_ok(codes[i].code < 0, "%s is negative", codes[i].name);
        for (size_t j = 0; j < i; j++)
            if (codes[j].code == codes[i].code || !strcmp(fsdp_strerror(codes[i].code),
                                                          fsdp_strerror(codes[j].code)))
                tap_ok(0, "%s and %s are distinct", codes[i].name, codes[j].name);
    }
    tap_is_str(fsdp_strerror(FSDP_OK), "success", "FSDP_OK means success");
    tap_is_str(fsdp_strerror(-1000), "unknown status", "an unknown code is described as such");
    tap_is_str(fsdp_err_name(17), "FSDP_E?", "an unknown code has the placeholder name");
    tap_is_str(fsdp_version_string(), FSDP_VERSION_STRING, "library and header versions agree");
    tap_is_int(fsdp_version_code(), FSDP_VERSION_CODE, "version codes agree");
    return tap_done();
}
