#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""gen_bpe.py: golden encodings for libfsdp's GPT-2 BPE (tests/t_bpe.c), from a reference
implementation of GPT-2's published BPE algorithm (OpenAI's encoder.py, written again here).

Usage: python3 tests/golden/gen_bpe.py > tests/golden/bpe_golden.h

It makes a small vocabulary: the 256 byte tokens, then MERGES learned on TRAIN by counting pairs
within pre-tokenized pieces (most frequent pair first, ties by the pair's text), a merged token
never made twice, plus two hand-made merges that build "aaaa" from "a" + "a" + "aa" (repeated
merges). Ids follow GPT-2's encoder.json: the byte tokens in the order of their code points in
GPT-2's byte-to-unicode alphabet (id 0 is "!"), then merge k's token as 256 + k, then
<|endoftext|>. tests/t_bpe.c writes encoder.json and vocab.bpe from the merge list by the same
rule, so the C test makes its files itself and this script is needed only to change the cases.

Each case's expected ids come from encode() below: GPT-2's pattern applied with the `regex`
module (as encoder.py does), byte-to-unicode, then bpe() merging the lowest-ranked pair. Input
bytes that are not valid UTF-8 are decoded with surrogateescape, so each such byte is one
character of class "other" (a lone surrogate), which is libfsdp's rule. make check does not run
this script; it needs python3 and python3-regex.
"""
import regex

PAT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

TRAIN = (
    "The quick brown fox jumps over the lazy dog. It's the dog's day; they're sure we've "
    "seen the other ones, and I'm told you'll see what he'd done. In 2024 the 1000 dogs ran "
    "100 times around 10 towns: 12.50 each! Ünïcödé café naïve résumé — 東京 東京 東京 "
    "letters ééé ééé and numbers ١٢٣ ١٢٣. Then the theme of the thesis: there, then, these. "
    "    indented\n\n\nlines\tand\ttabs   \n"
)

N_LEARNED = 120

CASES = [
    b"Hello world",
    b"The theme of these theses.",
    b"I'm sure it's they're, we've, you'll, he'd, 't and 'd",
    b"'s'''s 'S 'LL '",
    b"don't DON'T o'clock",
    b"  two spaces,   three   spaces  ",
    b"trailing space ",
    b" leading space",
    b"\n\nnew\tlines \n\t x\r\n",
    b"123 4567 89 1000000 2024",
    b"a1b2c3 x86_64 3.14159",
    b"price: $12.50!!! (really?) #tag @user ...",
    "naïve café résumé — Ünïcödé".encode(),
    "東京 2024年 東京タワー".encode(),
    "١٢٣ Ⅻ ² ½ 𝟘𝟙".encode(),
    "नमस्ते दुनिया".encode(),
    "👍🏽 emoji 🎉🎉".encode(),
    "\u3000ideographic\u00a0nbsp\u2003em".encode(),
    b"aaaaaaaaa aa aaa",
    b"ababab abab",
    b"\xff\xfe bad \xc3 utf8 \xe6\x9d \x80\x80 end\xf0\x9f",
    b"\xc0\xaf overlong \xed\xa0\x80 surrogate \xf4\x90\x80\x80 big",
    b"",
    b"x",
    bytes(range(0, 32)) + b" " + bytes(range(0x7F, 0xA1)),
]


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BYTE_ENCODER = bytes_to_unicode()


def pieces(data):
    text = data.decode("utf-8", "surrogateescape")
    for tok in regex.findall(PAT, text):
        yield "".join(BYTE_ENCODER[b] for b in tok.encode("utf-8", "surrogateescape"))


def learn():
    """Merges learned on TRAIN, after the two hand-made ones."""
    merges = [("a", "a"), ("aa", "aa")]
    made = {"aa", "aaaa"} | set(BYTE_ENCODER.values())
    words = [list(p) for p in pieces(TRAIN.encode())]
    while len(merges) < N_LEARNED + 2:
        counts = {}
        for w in words:
            for pair in zip(w, w[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        cands = [p for p in counts if p[0] + p[1] not in made]
        if not cands:
            break
        best = min(cands, key=lambda p: (-counts[p], p))
        merges.append(best)
        made.add(best[0] + best[1])
        for i, w in enumerate(words):
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and (w[j], w[j + 1]) == best:
                    out.append(w[j] + w[j + 1])
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
    return merges


def get_pairs(word):
    return set(zip(word, word[1:]))


def bpe(token, ranks):
    """GPT-2's bpe(): merge the lowest-ranked pair, every occurrence left to right, repeat."""
    word = tuple(token)
    pairs = get_pairs(word)
    if not pairs:
        return [token]
    while True:
        bigram = min(pairs, key=lambda pair: ranks.get(pair, float("inf")))
        if bigram not in ranks:
            break
        first, second = bigram
        new_word = []
        i = 0
        while i < len(word):
            try:
                j = word.index(first, i)
            except ValueError:
                new_word.extend(word[i:])
                break
            new_word.extend(word[i:j])
            i = j
            if word[i] == first and i < len(word) - 1 and word[i + 1] == second:
                new_word.append(first + second)
                i += 2
            else:
                new_word.append(word[i])
                i += 1
        word = tuple(new_word)
        if len(word) == 1:
            break
        pairs = get_pairs(word)
    return list(word)


def c_lit(data):
    """A C string literal of data; each hex escape ends a piece, so no digit after it is read
    as part of it."""
    parts, cur = [], ""
    for x in data:
        if 32 <= x < 127 and x not in b'"\\?':
            cur += chr(x)
        else:
            parts.append(cur + "\\x%02x" % x)
            cur = ""
    parts.append(cur)
    return " ".join('"%s"' % p for p in parts if p) or '""'


def main():
    merges = learn()
    ranks = {m: i for i, m in enumerate(merges)}
    encoder = {}
    for cp in sorted(ord(c) for c in BYTE_ENCODER.values()):
        encoder[chr(cp)] = len(encoder)
    for a, b in merges:
        encoder[a + b] = len(encoder)
    encoder["<|endoftext|>"] = len(encoder)
    print("/* SPDX-License-Identifier: MIT */")
    print("/* bpe_golden.h: generated by tests/golden/gen_bpe.py (do not edit): the merges of")
    print(" * t_bpe.c's vocabulary (GPT-2's byte alphabet, UTF-8) and the ids GPT-2's published")
    print(" * BPE algorithm gives each case. */")
    print("static const char *const golden_merges[][2] = {")
    for a, b in merges:
        print("    {%s, %s}," % (c_lit(a.encode()), c_lit(b.encode())))
    print("};")
    print("typedef struct golden_case {")
    print("    const char *text;")
    print("    size_t len;")
    print("    size_t n;")
    print("    const int32_t *ids;")
    print("} golden_case_t;")
    for k, case in enumerate(CASES):
        ids = [encoder[t] for p in pieces(case) for t in bpe(p, ranks)]
        body = ", ".join(map(str, ids)) if ids else "0"
        print("static const int32_t golden_ids_%d[] = {%s};" % (k, body))
    print("static const golden_case_t golden_cases[] = {")
    for k, case in enumerate(CASES):
        n = sum(len(bpe(p, ranks)) for p in pieces(case))
        print("    {%s, %d, %d, golden_ids_%d}," % (c_lit(case), len(case), n, k))
    print("};")


if __name__ == "__main__":
    main()
