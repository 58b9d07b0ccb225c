/* SPDX-License-Identifier: MIT */
/*
 * fsdp/export.h: the export macro of libfsdp's public API.
 *
 * The library is built with -fvisibility=hidden; only declarations marked FSDP_EXTERN are
 * exported from the shared object. C++ users get C linkage through FSDP_BEGIN_DECLS.
 */
#ifndef FSDP_EXPORT_H
#define FSDP_EXPORT_H

#if defined(__GNUC__) || defined(__clang__)
#define FSDP_EXTERN __attribute__((visibility("default")))
#define FSDP_PRINTF(fmt, args) __attribute__((format(printf, fmt, args)))
#else
#define FSDP_EXTERN
#define FSDP_PRINTF(fmt, args)
#endif

#ifdef __cplusplus
#define FSDP_BEGIN_DECLS extern "C" {
#define FSDP_END_DECLS }
#else
#define FSDP_BEGIN_DECLS
#define FSDP_END_DECLS
#endif

#endif /* FSDP_EXPORT_H */
