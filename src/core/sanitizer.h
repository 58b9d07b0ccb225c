/* SPDX-License-Identifier: MIT */
/*
 * sanitizer.h: FSDP_UNDER_ASAN and FSDP_UNDER_TSAN, 1 when the file is compiled with
 * AddressSanitizer or ThreadSanitizer, else 0. GCC says so with __SANITIZE_ADDRESS__ and
 * __SANITIZE_THREAD__; clang before 16 defines neither and answers __has_feature instead. The
 * library and the tests ask here, so that both agree under either compiler (issue 26, item 9).
 */
#ifndef FSDP_CORE_SANITIZER_H
#define FSDP_CORE_SANITIZER_H

#if defined(__SANITIZE_ADDRESS__)
#define FSDP_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FSDP_UNDER_ASAN 1
#endif
#endif
#ifndef FSDP_UNDER_ASAN
#define FSDP_UNDER_ASAN 0
#endif

#if defined(__SANITIZE_THREAD__)
#define FSDP_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FSDP_UNDER_TSAN 1
#endif
#endif
#ifndef FSDP_UNDER_TSAN
#define FSDP_UNDER_TSAN 0
#endif

#endif
