"""torch.nn.MultiheadAttention computed by the attention service.

    layer = RemoteMultiheadAttention("127.0.0.1:50051", "my_layer", batch_first=True)
    output, weights = layer(x, x, x, key_padding_mask=pad)

export_model(mha, "models/my_layer") writes a local torch.nn.MultiheadAttention
as a model folder the server loads (docs/models.md).
"""
import copy
import json
import os
import struct

import torch
from google.protobuf import text_format

from attention_client._client import Client
from attention_client._errors import invalid
from attention_client._proto.attention.v1 import model_pb2

__all__ = ["RemoteMultiheadAttention", "export_model"]

_OUTPUT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class RemoteMultiheadAttention(torch.nn.Module):
    """A drop-in torch.nn.MultiheadAttention whose forward the server computes
    with its registered layer `model`. Construction fetches the layer's config
    (GetModel: AttentionError NOT_FOUND if the server has no such model) and
    exposes it as torch's attributes (embed_dim, num_heads, kdim, vdim,
    head_dim, batch_first). `client` is an attention_client.Client to share
    (then `target` may be None); the layer has no parameters of its own, and
    runs the layer as in eval mode (the model config has no dropout). A deep
    copy shares the client; pickle and torch.save write it as its target and
    non-secret arguments, and loading makes a Client of them (docs/python.md)."""

    def __init__(self, target, model, *, batch_first=False, client=None):
        super().__init__()
        if client is None:
            if target is None:
                raise invalid("RemoteMultiheadAttention: give a target or a client")
            client = Client(target)
        self.client = client
        self.model = model
        self.config = client.model(model)
        c = self.config
        self.embed_dim = int(c.embed_dim)
        self.num_heads = int(c.num_heads)
        self.kdim = int(c.kdim) or self.embed_dim
        self.vdim = int(c.vdim) or self.embed_dim
        self.head_dim = self.embed_dim // self.num_heads
        self.batch_first = bool(batch_first)
        self.dropout = 0.0
        # torch.nn.TransformerEncoderLayer and TransformerEncoder in eval mode
        # take a fused fast path that reads the projection weights themselves
        # (in_proj_weight, in_proj_bias, out_proj) when _qkv_same_embed_dim is
        # True. The weights are the server's: False (as torch's own layer with
        # kdim or vdim != embed_dim has it) makes them call forward() instead,
        # and the weights torch would read are None, as torch's are when absent.
        self._qkv_same_embed_dim = False
        self.in_proj_weight = self.in_proj_bias = None

    def __deepcopy__(self, memo):
        # A copy (as nn.TransformerEncoder and TransformerDecoder make of their
        # layer) shares the client: one channel, its token and TLS kept.
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        state = {k: v for k, v in self.__dict__.items() if k != "client"}
        copied.__dict__.update(copy.deepcopy(state, memo))
        copied.__dict__["client"] = self.client
        return copied

    def __getstate__(self):
        # pickle and torch.save: the client as its target and arguments but
        # the secrets (a gRPC channel does not pickle); __setstate__ makes a
        # Client of them.
        settings = getattr(self.client, "_settings", None)
        if settings is None:
            raise invalid(f"RemoteMultiheadAttention: cannot pickle a layer whose client is a "
                          f"{type(self.client).__name__}, not an attention_client.Client")
        if settings.tls and settings.public_arguments["tls_ca"] is None:
            # Its TLS rests on the system's roots and a client certificate,
            # which is not written: loaded, the client would be plaintext.
            raise invalid("RemoteMultiheadAttention: cannot pickle a layer whose client has "
                          "TLS without tls_ca (its client certificate is not saved, and "
                          "without it the loaded client would not use TLS); give the client "
                          "tls_ca, or save the layer's state_dict")
        state = self.__dict__.copy()
        state["client"] = (settings.target, settings.public_arguments)
        # The generated message classes are not importable by the name pickle
        # would record: the config travels as its bytes.
        state["config"] = self.config.SerializeToString()
        return state

    def __setstate__(self, state):
        target, arguments = state.pop("client")
        state["config"] = model_pb2.ModelConfig.FromString(state["config"])
        super().__setstate__(state)
        self.client = Client(target, **arguments)

    def extra_repr(self):
        return (f"model={self.model!r}, embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"kdim={self.kdim}, vdim={self.vdim}, batch_first={self.batch_first}")

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        """torch.nn.MultiheadAttention.forward: (attn_output, attn_weights),
        attn_weights None unless need_weights; batched ([L, B, E], or [B, L, E]
        with batch_first) or unbatched ([L, E]) inputs. attn_mask is [L, S] or
        [B * num_heads, L, S]; masks are bool (True = masked out) or float
        (added to the scores); is_causal masks key j > query i (top left) on top
        of any attn_mask."""
        batched = query.dim() == 3
        batch_dim = 0 if self.batch_first else 1
        if not batched:
            same_key, same_value = key is query, value is key
            query = query.unsqueeze(batch_dim)
            key = query if same_key else key.unsqueeze(batch_dim)
            value = key if same_value else value.unsqueeze(batch_dim)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        batch = query.shape[batch_dim]
        self_attention = key is query and value is key
        fields = {
            "model": self.model,
            "layout": "batch_first" if self.batch_first else "sequence_first",
            "need_weights": bool(need_weights),
            "average_weights": bool(average_attn_weights),
            "key_padding_mask": _mask(key_padding_mask),
            "attn_mask": _attn_mask(attn_mask, batch, self.num_heads),
        }
        if is_causal:
            fields["causal"] = "top_left"
        if query.dtype in (torch.bfloat16, torch.float16):
            fields["output_dtype"] = _OUTPUT_DTYPES[query.dtype]
        if self_attention:
            answer = self.client.attend(query, **fields)
        else:
            answer = self.client.attend(query, key, value, **fields)
        output, weights = answer.output.to(query.dtype), answer.weights
        if weights is not None:
            weights = weights.to(query.dtype)
        if not batched:
            output = output.squeeze(batch_dim)
            if weights is not None:
                weights = weights.squeeze(0)
        return output, weights


def _mask(mask):
    """torch's mask as the wire takes it: bool (byte masks are bool) or float."""
    if mask is None:
        return None
    if mask.dtype == torch.uint8:
        return mask.bool()
    return mask


def _attn_mask(mask, batch, num_heads):
    """torch's 3-D attn_mask [B * H, L, S] is the wire's [B, H, L, S]."""
    mask = _mask(mask)
    if mask is not None and mask.dim() == 3:
        if mask.shape[0] != batch * num_heads:
            raise invalid(f"attn_mask: 3-D shape {list(mask.shape)} is not [batch * num_heads, "
                          f"L, S] with batch * num_heads = {batch} * {num_heads} = "
                          f"{batch * num_heads}")
        mask = mask.reshape(batch, num_heads, mask.shape[1], mask.shape[2])
    return mask


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def export_model(layer, folder, name=None):
    """Writes `layer`, a torch.nn.MultiheadAttention, to `folder` as a model
    the server loads (docs/models.md): config.pbtxt (its constructor's
    arguments as an attention.v1.ModelConfig) and weights.safetensors (its
    state_dict under torch's names, in its dtype: float32, bfloat16 or float16;
    others as float32). The model is named after the folder unless `name` is
    given. Returns the ModelConfig written."""
    if not isinstance(layer, torch.nn.MultiheadAttention):
        raise invalid(f"export_model: {type(layer).__name__} is not a torch.nn.MultiheadAttention")
    name = name or os.path.basename(os.path.normpath(folder))
    config = model_pb2.ModelConfig(
        name=name, embed_dim=layer.embed_dim, num_heads=layer.num_heads, kdim=layer.kdim,
        vdim=layer.vdim, bias=layer.in_proj_bias is not None,
        add_bias_kv=layer.bias_k is not None, add_zero_attn=bool(layer.add_zero_attn))
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.pbtxt"), "w") as f:
        f.write("# torch.nn.MultiheadAttention, exported by attention_client.torch.export_model\n")
        f.write(text_format.MessageToString(config))
    _write_safetensors(os.path.join(folder, "weights.safetensors"), layer.state_dict())
    return config


def _write_safetensors(path, state_dict):
    header, blobs, offset = {}, [], 0
    for key in sorted(state_dict):
        t = state_dict[key].detach().cpu()
        if t.dtype not in _SAFETENSORS_DTYPES:
            t = t.float()
        t = t.contiguous()
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        blob = raw.numpy().astype(raw.numpy().dtype.newbyteorder("<")).tobytes()
        header[key] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for blob in blobs:
            f.write(blob)

