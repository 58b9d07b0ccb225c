/* SPDX-License-Identifier: MIT */
/*
 * bpe_impl.h: what the GPT-2 tokenizer's files share: the character classes of its
 * pre-tokenizer (bpe_unicode.c, a generated table) for bpe.c.
 */
#ifndef FSDP_BPE_IMPL_H
#define FSDP_BPE_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* A closed range of code points [lo, hi]. */
typedef struct fsdp__uni_range {
    uint32_t lo, hi;
} fsdp__uni_range_t;

/* The classes GPT-2's pattern tells apart. */
typedef enum fsdp__uni_class {
    FSDP__UNI_OTHER = 0, /* [^\s\p{L}\p{N}]: punctuation, symbols, marks, controls, ... */
    FSDP__UNI_LETTER,    /* \p{L} */
    FSDP__UNI_NUMBER,    /* \p{N} */
    FSDP__UNI_SPACE      /* \s */
} fsdp__uni_class_t;

/* The class of code point c (any value; above U+10FFFF and surrogates are OTHER). */
fsdp__uni_class_t fsdp__uni_class(uint32_t c);

#endif /* FSDP_BPE_IMPL_H */
