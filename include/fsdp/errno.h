/* SPDX-License-Identifier: MIT */
/*
 * fsdp/errno.h: status codes.
 *
 * Every fallible libfsdp function returns an int: FSDP_OK (0) on success or one of the negative
 * codes below. The codes say what kind of failure happened; the detail (which parameter, which
 * rank, which sizes) is kept as text on the object involved: fsdp_pg_last_error(),
 * fsdp_ctx_last_error(), fsdp_store_last_error(), fsdp_work_error().
 */
#ifndef FSDP_ERRNO_H
#define FSDP_ERRNO_H

#include <fsdp/export.h>

/* X(name, value, description). The one list from which the enum, fsdp_strerror() and
 * fsdp_err_name() are generated. */
#define FSDP_ERRNO_MAP(X)                                                            \
    X(OK, 0, "success")                                                              \
    X(EINVAL, -1, "invalid argument")                                                \
    X(ENOMEM, -2, "out of memory")                                                   \
    X(ENOTSUP, -3, "operation not supported")                                        \
    X(ETIMEDOUT, -4, "timed out")                                                    \
    X(EREMOTE, -5, "a peer rank failed")                                             \
    X(EMISMATCH, -6, "ranks issued different collectives")                           \
    X(EBACKEND, -7, "backend failure")                                               \
    X(EINTERNAL, -8, "internal error")

FSDP_BEGIN_DECLS

typedef enum fsdp_status {
#define FSDP__ERRNO_ENUM(name, value, desc) FSDP_##name = value,
    FSDP_ERRNO_MAP(FSDP__ERRNO_ENUM)
#undef FSDP__ERRNO_ENUM
} fsdp_status_t;

/* A sentence describing status code `rc` ("invalid argument"); "unknown status" for a code
 * outside the list. The string is static. Thread-safe. */
FSDP_EXTERN const char *fsdp_strerror(int rc);

/* The code's name ("FSDP_EINVAL"); "FSDP_E?" for a code outside the list. Thread-safe. */
FSDP_EXTERN const char *fsdp_err_name(int rc);

FSDP_END_DECLS

#endif /* FSDP_ERRNO_H */
