#!/usr/bin/python3
"""Reads a safetensors file with the standard library alone (independently of
fulcrumctl's writer) and checks it: the header parses, every tensor's byte
range matches its dtype and shape, the ranges tile the data exactly, every
float is finite. With --fingerprint, the FNV-1a hash of the dense F32
tensors' bytes, in file order, must equal it (the hash workers report for
their final weights).

usage: safetensors_check.py FILE [--fingerprint HEX] [--min-tensors N]
"""
import json
import math
import struct
import sys

SIZES = {"F32": 4, "F64": 8, "F16": 2, "BF16": 2, "I64": 8, "U64": 8, "I32": 4, "U32": 4, "U8": 1, "I8": 1}


def fail(msg):
    print("safetensors_check: " + msg, file=sys.stderr)
    sys.exit(1)


def main(argv):
    if len(argv) < 2:
        fail("usage: safetensors_check.py FILE [--fingerprint HEX] [--min-tensors N]")
    path = argv[1]
    want_fp = None
    min_tensors = 1
    i = 2
    while i < len(argv):
        if argv[i] == "--fingerprint":
            want_fp = argv[i + 1]
        elif argv[i] == "--min-tensors":
            min_tensors = int(argv[i + 1])
        else:
            fail("unknown argument " + argv[i])
        i += 2
    blob = open(path, "rb").read()
    if len(blob) < 8:
        fail("file shorter than its header length")
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        fail("header length %d runs past the file (%d bytes)" % (n, len(blob)))
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    meta = header.pop("__metadata__", {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        fail("__metadata__ must map strings to strings")
    spans = []
    for name, t in header.items():
        dtype, shape, (begin, end) = t["dtype"], t["shape"], t["data_offsets"]
        if dtype not in SIZES:
            fail("%s: unknown dtype %s" % (name, dtype))
        count = 1
        for d in shape:
            if not isinstance(d, int) or d < 0:
                fail("%s: bad shape %r" % (name, shape))
            count *= d
        if end - begin != count * SIZES[dtype]:
            fail("%s: %d bytes for %s %r" % (name, end - begin, dtype, shape))
        spans.append((begin, end, name, dtype))
    spans.sort()
    pos = 0
    for begin, end, name, _ in spans:
        if begin != pos:
            fail("%s starts at %d, expected %d (hole or overlap)" % (name, begin, pos))
        pos = end
    if pos != len(data):
        fail("tensors cover %d bytes of %d" % (pos, len(data)))
    if len(spans) < min_tensors:
        fail("%d tensors, expected at least %d" % (len(spans), min_tensors))
    h = 1469598103934665603
    for begin, end, name, dtype in spans:
        if dtype != "F32":
            continue
        chunk = data[begin:end]
        for v in struct.unpack("<%df" % ((end - begin) // 4), chunk):
            if not math.isfinite(v):
                fail("%s holds a non-finite value" % name)
        if not name.endswith(".values"):
            for b in chunk:
                h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    fp = "%016x" % h
    for begin, end, name, dtype in spans:
        print("%s %s %r" % (name, dtype, header[name]["shape"]))
    print("metadata %s" % json.dumps(meta, sort_keys=True))
    print("fingerprint %s" % fp)
    if want_fp is not None and fp != want_fp:
        fail("fingerprint %s, expected %s" % (fp, want_fp))


if __name__ == "__main__":
    main(sys.argv)
