/* SPDX-License-Identifier: MIT */
/*
 * fsdp/export.h: the export macro of libfsdp's public API.
 *
 * The library is built with -fvisibility=hidden; only declarations marked FSDP_EXTERN are
 * exported from the shared object. C++ users get C linkage through FSDP_BEGIN_DECLS.
 *
 * Options structs (the ABI policy, docs/design.md). Every struct of options or configuration
 * that has an _init function starts with `size_t size`, and the _init function is the only way
 * to make one: declare it, call fsdp_X_init(&o), then set fields. fsdp_X_init is a macro that
 * passes sizeof the struct as the program was compiled to the exported function of the same
 * name, which stores it in o.size; every function that reads or fills the struct checks it
 * (FSDP_EINVAL for 0, as a designated initialiser or memset leaves it). So a release can append
 * fields without breaking programs built against an older header: the fields they do not have
 * take their defaults. A struct the library hands out (a getter's answer, the overrides given to
 * a custom wrap policy) carries the library's size: code built against a newer header reads or
 * writes a field only when size covers it.
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
