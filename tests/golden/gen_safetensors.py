#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""gen_safetensors.py: a safetensors file written by hand, and a reader that checks one.

Usage:
  python3 tests/golden/gen_safetensors.py --out tests/golden
      writes tests/golden/ref.safetensors, which tests/t_safetensors.c reads and checks;
  python3 tests/golden/gen_safetensors.py --check FILE
      reads FILE (written by libfsdp: `tests/t_safetensors.tap --write FILE`) with this script's
      own reader and prints TAP: every tensor of TENSORS must be there with its exact bytes.

Both directions use only numpy, json and struct (not the safetensors package), so the C reader
and writer are checked against an independent implementation of the format: an 8-byte
little-endian header length N, N bytes of JSON ({name: {"dtype", "shape", "data_offsets"}},
plus "__metadata__": {str: str}), then the data section. The header is padded with spaces to
a multiple of 8, as the reference writer does. TENSORS and METADATA below are mirrored in
tests/t_safetensors.c (`cases`); change both together. The output is deterministic.

Any python3 with numpy will do (Debian's /usr/bin/python3 with python3-numpy on the build
machines). make check needs Python only for t_safetensors_py.sh, which skips without it.
"""

import argparse
import json
import math
import os
import struct
import sys
import zlib

import numpy as np

# numpy types of the safetensors dtypes; BF16 goes through its uint16 bit patterns.
NP = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "BF16": "<u2",
    "I64": "<i8",
    "I32": "<i4",
    "U8": "u1",
    "BOOL": "u1",
}


def bf16_bits(values):
    """Bit patterns of values that bfloat16 represents exactly (checked)."""
    f = np.array(values, dtype="<f4")
    u = f.view("<u4")
    assert np.all(u & 0xFFFF == 0), "not exact in bfloat16"
    return (u >> 16).astype("<u2")


# (name, dtype, shape, values). Values are exact in their dtype, so both sides compare bits.
TENSORS = [
    ("a.f32", "F32", [2, 3], [(i - 2) * 0.75 for i in range(6)]),
    ("a.f64", "F64", [4], [1.0 / 3.0, -2.5e300, math.pi, -0.0]),
    ("a.f16", "F16", [2, 2], [1.0, -2.5, 65504.0, 2.0**-24]),
    ("a.bf16", "BF16", [3], [1.0, -3.140625, 2.0**100]),
    ("a.i32", "I32", [5], [-(2**31), -1, 0, 1, 2**31 - 1]),
    ("a.i64", "I64", [3], [-(2**63), 1234567890123, 2**63 - 1]),
    ("a.u8", "U8", [4], [0, 1, 128, 255]),
    ("a.bool", "BOOL", [2, 2], [1, 0, 0, 1]),
    ("scalar", "F32", [], [42.5]),
    ("empty", "F32", [0, 3], []),
    ("h.0.w", "F32", [2, 1, 2], [0.5, -0.5, 2.0**-10, 1.5 * 2.0**127]),
]

METADATA = {"format": "pt", "producer": "gen_safetensors.py", "note": "na\u00efve \"quoted\"\n"}


def tensor_bytes(dtype, values):
    if dtype == "BF16":
        return bf16_bits(values).tobytes()
    return np.array(values, dtype=NP[dtype]).tobytes()


def write(path):
    # The data section is laid out in reverse order of the header, so that a reader cannot get
    # away with assuming the two orders agree.
    data = {name: tensor_bytes(dt, vals) for name, dt, _, vals in TENSORS}
    offsets, pos = {}, 0
    for name, _, _, _ in reversed(TENSORS):
        offsets[name] = (pos, pos + len(data[name]))
        pos += len(data[name])
    header = {"__metadata__": METADATA}
    for name, dt, shape, _ in TENSORS:
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": list(offsets[name])}
    js = json.dumps(header, separators=(",", ":")).encode("utf-8")
    js += b" " * ((8 - len(js) % 8) % 8)
    blob = struct.pack("<Q", len(js)) + js
    for name, _, _, _ in reversed(TENSORS):
        blob += data[name]
    with open(path, "wb") as f:
        f.write(blob)
    print("%s: %d bytes, %d tensors, crc32 %08x" % (path, len(blob), len(TENSORS),
                                                   zlib.crc32(blob)))


class Tap:
    def __init__(self):
        self.lines, self.failed = [], 0

    def ok(self, cond, what, detail=None):
        self.lines.append("%s %d - %s" % ("ok" if cond else "not ok", len(self.lines) + 1, what))
        if not cond:
            self.failed += 1
            if detail:
                self.lines.extend("#   " + d for d in str(detail).splitlines())
        return cond

    def done(self):
        print("1..%d" % len(self.lines))
        print("\n".join(self.lines))
        return 1 if self.failed else 0


def no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError("duplicate keys in %r" % keys)
    return dict(pairs)


def check(path):
    t = Tap()
    with open(path, "rb") as f:
        blob = f.read()
    if not t.ok(len(blob) >= 8, "the file holds the 8-byte header length"):
        return t.done()
    (n,) = struct.unpack("<Q", blob[:8])
    t.ok(0 < n <= 100000000 and 8 + n <= len(blob), "header length %d fits the file" % n)
    raw = blob[8:8 + n]
    t.ok((8 + n) % 8 == 0, "the data section starts at a multiple of 8 (byte %d)" % (8 + n))
    text = raw.decode("utf-8")
    t.ok(text.startswith("{"), "the header begins with '{'")
    body = text.rstrip(" ")
    t.ok(len(text) - len(body) < 8, "the header is padded with fewer than 8 spaces")
    try:
        header = json.loads(body, object_pairs_hook=no_duplicates)
    except ValueError as e:
        t.ok(False, "the header is JSON without duplicate names", e)
        return t.done()
    t.ok(isinstance(header, dict), "the header is a JSON object")
    meta = header.pop("__metadata__", None)
    t.ok(meta == METADATA, "__metadata__ holds the strings written", "%r" % (meta,))
    data = blob[8 + n:]
    want = {name: (dt, shape, vals) for name, dt, shape, vals in TENSORS}
    t.ok(sorted(header) == sorted(want), "the tensor names are the ones written",
         "%r" % sorted(header))
    spans = []
    for name, (dt, shape, vals) in want.items():
        e = header.get(name)
        if not t.ok(isinstance(e, dict), "tensor %s: present" % name):
            continue
        t.ok(e.get("dtype") == dt and e.get("shape") == shape,
             "tensor %s: dtype %s, shape %s" % (name, dt, shape), "%r" % (e,))
        b, end = e["data_offsets"]
        spans.append((b, end, name))
        got = data[b:end]
        t.ok(got == tensor_bytes(dt, vals), "tensor %s: the bytes are exactly the values" % name,
             "got %s" % got.hex())
        if dt not in ("BF16", "BOOL") and vals:
            arr = np.frombuffer(got, dtype=NP[dt]).reshape(shape)
            t.ok(arr.shape == tuple(shape) and
                 np.array_equal(arr.ravel(), np.array(vals, dtype=NP[dt])),
                 "tensor %s: numpy reads the values back" % name)
    spans.sort()
    pos, tiled = 0, True
    for b, end, _ in spans:
        tiled = tiled and b == pos and end >= b
        pos = end
    t.ok(tiled and pos == len(data),
         "the tensors tile the %d-byte data section exactly" % len(data), "%r" % spans)
    return t.done()


def main():
    ap = argparse.ArgumentParser()
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", help="directory to write ref.safetensors into")
    g.add_argument("--check", help="a file written by libfsdp to check")
    a = ap.parse_args()
    if a.out:
        write(os.path.join(a.out, "ref.safetensors"))
        return 0
    return check(a.check)


if __name__ == "__main__":
    sys.exit(main())
