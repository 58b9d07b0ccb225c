/* SPDX-License-Identifier: MIT */
/*
 * fsdp/bpe.h: GPT-2's byte-level BPE tokenizer, read from the standard encoder.json and
 * vocab.bpe files.
 *
 * encoder.json maps each token, written in GPT-2's byte-to-unicode alphabet (every byte 0..255
 * stands for one printable code point: the printable Latin-1 bytes for themselves, the others for
 * U+0100 upwards), to its id. vocab.bpe lists the merges, one "A B" pair per line in rank order,
 * after an optional "#version" line. Encoding follows GPT-2's published encoder:
 *   1. the text is split by GPT-2's pre-tokenizer pattern, applied to its UTF-8 code points:
 *      's 't 're 've 'm 'll 'd, then ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`, `\s+(?!\S)`
 *      and `\s+`, the first alternative that matches at each point (letters, numbers and
 *      whitespace are Unicode's classes, for every code point; see src/io/bpe_unicode.c);
 *   2. each piece's bytes start as one symbol each, and the adjacent pair of lowest merge rank
 *      is merged, every occurrence left to right, until no pair has a rank;
 *   3. each symbol is its id in encoder.json.
 * A byte that is not part of valid UTF-8 (a stray continuation byte, a truncated or overlong
 * sequence, an encoded surrogate, a code point above U+10FFFF) counts as one character of the
 * "other" class, as Python's surrogateescape gives it, so every byte string encodes (and decodes
 * back to itself) as long as encoder.json has the 256 byte tokens, as GPT-2's has. Special tokens
 * such as <|endoftext|> are never produced by encoding: their text encodes as ordinary text, as
 * in GPT-2's encoder; decoding them gives their text.
 *
 * Loading checks everything once: the JSON (an object of distinct names and distinct ids in
 * [0, 2^31)), every name in the byte-to-unicode alphabet, the 256 byte tokens, and every merge
 * line (two symbols of the vocabulary whose concatenation is one too). Errors name the file, the
 * line or the entry. Loading reports on the caller's context (or logs, without one); later calls
 * report on the tokenizer (fsdp_bpe_last_error).
 *
 * Thread-safety: a loaded tokenizer is immutable except for its error text: encoding and
 * decoding from several threads at once is safe as long as none of them fails.
 */
#ifndef FSDP_BPE_H
#define FSDP_BPE_H

#include <stddef.h>
#include <stdint.h>

#include <fsdp/context.h>
#include <fsdp/export.h>

FSDP_BEGIN_DECLS

typedef struct fsdp_bpe fsdp_bpe_t;

/*
 * Reads encoder_json and vocab_bpe. ctx may be NULL (errors are then logged). The caller owns
 * *out (NULL on failure) and frees it with fsdp_bpe_destroy(). Errors: FSDP_EINVAL for a
 * missing or malformed file (the message names the file and the entry or line), FSDP_ENOMEM.
 */
FSDP_EXTERN int fsdp_bpe_load(fsdp_ctx_t *ctx, const char *encoder_json, const char *vocab_bpe,
                              fsdp_bpe_t **out);
/* fsdp_bpe_load() of dir/encoder.json and dir/vocab.bpe. */
FSDP_EXTERN int fsdp_bpe_load_dir(fsdp_ctx_t *ctx, const char *dir, fsdp_bpe_t **out);
/* Frees the tokenizer; NULL is accepted. */
FSDP_EXTERN void fsdp_bpe_destroy(fsdp_bpe_t *bpe);

/* One more than the largest id of encoder.json (50257 for GPT-2's); 0 for NULL. */
FSDP_EXTERN int64_t fsdp_bpe_vocab_size(const fsdp_bpe_t *bpe);
/* Number of merges read from vocab.bpe; 0 for NULL. */
FSDP_EXTERN size_t fsdp_bpe_num_merges(const fsdp_bpe_t *bpe);

/*
 * Encodes the len bytes of text (any bytes; see the top of this file) into out, which must hold
 * `cap` ids; *n receives how many were written. Every token covers at least one byte, so
 * cap >= len always suffices. Errors: FSDP_EINVAL for NULL arguments or when cap is too small
 * (*n then holds the ids that fitted).
 */
FSDP_EXTERN int fsdp_bpe_encode(fsdp_bpe_t *bpe, const void *text, size_t len, int32_t *out,
                                size_t cap, size_t *n);

/* The bytes of token id: *bytes (borrowed from the tokenizer) and *len. FSDP_EINVAL naming the
 * id when it is negative, not below fsdp_bpe_vocab_size, or an id encoder.json does not use. */
FSDP_EXTERN int fsdp_bpe_token_bytes(fsdp_bpe_t *bpe, int64_t id, const char **bytes, size_t *len);

/*
 * Decodes n ids into their bytes, written to out (cap bytes, not terminated); *len receives
 * the decoded length, which is set even when it does not fit (FSDP_EINVAL: call again with
 * *len bytes). An id without a token is FSDP_EINVAL naming it and its position.
 */
FSDP_EXTERN int fsdp_bpe_decode(fsdp_bpe_t *bpe, const int32_t *ids, size_t n, void *out,
                                size_t cap, size_t *len);

/*
 * Encodes the whole of the file text_path into the llm.c token file bin_path (what
 * fsdp_dataset_open reads): a header of 256 little-endian int32 (20240520, the magic; 1, the
 * version; the token count), then the tokens as little-endian uint16. bin_path is replaced
 * atomically (a temporary file beside it, fsync'ed and renamed; only a regular file is replaced).
 * *ntokens (may be NULL) receives the count. FSDP_EINVAL when the vocabulary has more than 65536
 * ids (they do not fit uint16), when text_path cannot be read, or when it gives more than
 * 2^31 - 1 tokens; FSDP_EBACKEND for a failed write; FSDP_ENOMEM. Reads the text into memory
 * (about 13 bytes per byte of text at the peak); blocks on the file system.
 */
FSDP_EXTERN int fsdp_bpe_encode_file(fsdp_bpe_t *bpe, const char *text_path, const char *bin_path,
                                     uint64_t *ntokens);

/* The last error reported on the tokenizer ("" when none). */
FSDP_EXTERN const char *fsdp_bpe_last_error(const fsdp_bpe_t *bpe);

FSDP_END_DECLS

#endif /* FSDP_BPE_H */
