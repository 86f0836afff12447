#!/usr/bin/env python3
"""Exports a torch.nn.MultiheadAttention into a model folder the server can serve.

    python3 models/export_model.py --out models/my_layer --embed_dim 64 --num_heads 4 \
        [--kdim 32] [--vdim 32] [--no-bias] [--add_bias_kv] [--add_zero_attn] [--seed 0]

builds a freshly initialised layer with those arguments (use it as a template), or, from
your own code:

    from export_model import export
    export(my_mha_layer, "models/my_layer")

Writes DIR/config.pbtxt and DIR/weights.safetensors (the layer's state_dict under torch's
key names, as float32). Needs torch; the service itself does not.
"""
import argparse
import json
import os
import struct


def _write_safetensors(path, state_dict):
    header, blobs, offset = {}, [], 0
    for name in sorted(state_dict):
        t = state_dict[name].detach().to("cpu").float().contiguous()
        blob = t.numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def export(layer, folder, name=None):
    """Writes `layer` (a torch.nn.MultiheadAttention) to `folder`. The model is named
    after the folder, as the server requires: another `name` is a ValueError, and
    nothing is written."""
    basename = os.path.basename(os.path.normpath(folder))
    if name and name != basename:
        raise ValueError('export: name "%s" does not match its folder "%s" (%s): the server '
                         "refuses a model not named after its folder" % (name, basename, folder))
    name = basename
    os.makedirs(folder, exist_ok=True)
    has_bias = layer.in_proj_bias is not None
    lines = [
        'name: "%s"' % name,
        "embed_dim: %d" % layer.embed_dim,
        "num_heads: %d" % layer.num_heads,
        "kdim: %d" % layer.kdim,
        "vdim: %d" % layer.vdim,
        "bias: %s" % ("true" if has_bias else "false"),
        "add_bias_kv: %s" % ("true" if layer.bias_k is not None else "false"),
        "add_zero_attn: %s" % ("true" if layer.add_zero_attn else "false"),
    ]
    with open(os.path.join(folder, "config.pbtxt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    _write_safetensors(os.path.join(folder, "weights.safetensors"), layer.state_dict())


def main():
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--embed_dim", type=int, required=True)
    p.add_argument("--num_heads", type=int, required=True)
    p.add_argument("--kdim", type=int)
    p.add_argument("--vdim", type=int)
    p.add_argument("--no-bias", dest="bias", action="store_false")
    p.add_argument("--add_bias_kv", action="store_true")
    p.add_argument("--add_zero_attn", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    layer = torch.nn.MultiheadAttention(a.embed_dim, a.num_heads, bias=a.bias,
                                        add_bias_kv=a.add_bias_kv, add_zero_attn=a.add_zero_attn,
                                        kdim=a.kdim, vdim=a.vdim)
    export(layer, a.out)


if __name__ == "__main__":
    main()
