#!/usr/bin/env python3
"""Writes models/demo: the built-in nn.MultiheadAttention(64, 4) served by default.

Deterministic (a fixed linear congruential generator, no torch needed), so anyone
can regenerate weights.safetensors byte for byte:  python3 models/make_demo_model.py
"""
import json
import os
import struct

EMBED_DIM, NUM_HEADS = 64, 4


def uniform(state, n, bound):
    out = []
    for _ in range(n):
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        out.append(((state >> 11) / 2**53 * 2 - 1) * bound)
    return state, out


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, (shape, values) in sorted(tensors.items()):
        blob = struct.pack("<%df" % len(values), *values)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def main():
    e = EMBED_DIM
    bound = 1 / e**0.5
    state = 20261121
    tensors = {}
    for name, shape in [("in_proj_weight", [3 * e, e]), ("in_proj_bias", [3 * e]),
                        ("out_proj.weight", [e, e]), ("out_proj.bias", [e])]:
        n = 1
        for d in shape:
            n *= d
        state, values = uniform(state, n, bound)
        tensors[name] = (shape, values)
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")
    os.makedirs(folder, exist_ok=True)
    write_safetensors(os.path.join(folder, "weights.safetensors"), tensors)


if __name__ == "__main__":
    main()
