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
        self._checked = {}  # _torch_checks' outcomes

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
                          "tls_ca")
        state = self.__dict__.copy()
        del state["_checked"]
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
        self._checked = {}

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
        of any attn_mask. torch's checks of the inputs hold (_torch_checks);
        meta tensors get torch's answer on the meta device, and empty inputs
        (L, S or B of 0) torch's answer, without a call where it needs no
        weights."""
        _check_ranks(query, key, value, key_padding_mask)
        _check_dtypes(query, key, value)
        batched = query.dim() == 3
        batch_dim = 0 if self.batch_first else 1
        seq_dim = 1 - batch_dim if batched else 0
        _check_batches(query, key, value, batch_dim if batched else None)
        key_padding_mask, attn_mask = _mask(key_padding_mask), _mask(attn_mask)
        wire_mask = _attn_mask(attn_mask, query.shape[batch_dim] if batched else 1,
                               self.num_heads, query.shape[seq_dim], key.shape[seq_dim])
        checked = self._torch_checks(query, key, value, key_padding_mask, need_weights,
                                     attn_mask, average_attn_weights)
        attn_mask = wire_mask
        if "meta" in (query.device.type, key.device.type, value.device.type):
            return checked  # torch's answer on the meta device: shapes, no call
        no_keys = False
        if 0 in query.shape or 0 in key.shape or 0 in value.shape:
            output, weights = (None if t is None else
                               torch.zeros(t.shape, dtype=t.dtype, device=query.device)
                               for t in checked)
            if output.numel() == 0:  # no query or batch row: nothing to compute
                return output, weights
            # No key (S of 0): torch's answer is out_proj's bias, or its answer
            # over bias_k and the zero key, whose weights the server has. One
            # zero key row, masked out, stands for none; its column of the
            # weights is dropped. With no key there is nothing causal to mask.
            no_keys = True
            key = key.new_zeros(key.shape[:seq_dim] + (1,) + key.shape[seq_dim + 1:])
            value = value.new_zeros(value.shape[:seq_dim] + (1,) + value.shape[seq_dim + 1:])
            key_padding_mask = torch.ones((query.shape[batch_dim], 1) if batched else (1,),
                                          dtype=torch.bool)
            attn_mask, is_causal = None, False
        if not batched:
            same_key, same_value = key is query, value is key
            query = query.unsqueeze(batch_dim)
            key = query if same_key else key.unsqueeze(batch_dim)
            value = key if same_value else value.unsqueeze(batch_dim)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        self_attention = key is query and value is key
        fields = {
            "model": self.model,
            "layout": "batch_first" if self.batch_first else "sequence_first",
            "need_weights": bool(need_weights),
            "average_weights": bool(average_attn_weights),
            "key_padding_mask": key_padding_mask,
            "attn_mask": attn_mask,
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
            weights = weights[..., 1:].contiguous() if no_keys else weights
            weights = weights.to(query.dtype)
        if not batched:
            output = output.squeeze(batch_dim)
            if weights is not None:
                weights = weights.squeeze(0)
        return output, weights

    def _torch_checks(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                      average_attn_weights):
        """torch's forward on the meta device, with parameters of the layer's
        shapes in the query's dtype: torch's checks of the inputs (a failure
        is INVALID_ARGUMENT) and its answer, (output, weights) as meta tensors,
        computing nothing. The outcome is kept per shapes, dtypes and flags
        (a model calls with few), so a call pays for the check once."""
        signature = (bool(need_weights), bool(average_attn_weights)) + tuple(
            None if t is None else (tuple(t.shape), t.dtype)
            for t in (query, key, value, key_padding_mask, attn_mask))
        outcome = self._checked.get(signature)
        if outcome is None:
            try:
                outcome = tuple(None if t is None else (t.shape, t.dtype) for t in self._on_meta(
                    query, key, value, key_padding_mask, need_weights, attn_mask,
                    average_attn_weights))
            except (AssertionError, RuntimeError) as error:
                outcome = f"RemoteMultiheadAttention: {error}"
            if len(self._checked) >= _CHECKS_KEPT:
                self._checked.clear()
            self._checked[signature] = outcome
        if isinstance(outcome, str):
            raise invalid(outcome)
        return tuple(None if t is None else torch.empty(t[0], dtype=t[1], device="meta")
                     for t in outcome)

    def _on_meta(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                 average_attn_weights):
        dtype = query.dtype

        def meta(t):
            if t is None:
                return None
            return t.to("meta", dtype if t.is_floating_point() else t.dtype)

        def zeros(*shape):
            return torch.zeros(shape, dtype=dtype, device="meta")

        e = self.embed_dim
        q, k, v = meta(query), meta(key), meta(value)
        if self.batch_first and query.dim() == 3:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        # Float key_padding_masks, which torch 1.13 refuses beside a bool
        # attn_mask, are the wire's too: their shape is checked as a bool one's.
        padding = key_padding_mask
        if padding is not None and padding.is_floating_point():
            padding = padding.to(torch.bool)
        bias_kv = zeros(1, 1, e) if self.config.add_bias_kv else None
        output, weights = torch.nn.functional.multi_head_attention_forward(
            q, k, v, e, self.num_heads, zeros(3 * e, e), zeros(3 * e), bias_kv, bias_kv,
            self.config.add_zero_attn, 0.0, zeros(e, e), zeros(e), training=False,
            key_padding_mask=meta(padding), need_weights=need_weights, attn_mask=meta(attn_mask),
            use_separate_proj_weight=True, q_proj_weight=zeros(e, e),
            k_proj_weight=zeros(e, self.kdim), v_proj_weight=zeros(e, self.vdim),
            average_attn_weights=average_attn_weights)
        if self.batch_first and query.dim() == 3:
            output = output.transpose(0, 1)
        return output, weights


_CHECKS_KEPT = 256
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_dtypes(query, key, value):
    """torch's layer takes query, key and value in its own dtype. These take
    one dtype, float32, bfloat16 or float16, whatever the served layer's: the
    server computes each (in float32 at most, so float64 is refused, not
    rounded)."""
    if query.dtype not in _INPUT_DTYPES:
        raise invalid(f"query: dtype {query.dtype} is not torch.float32, torch.bfloat16 or "
                      "torch.float16 (the server computes in float32 at most)")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise invalid(f"{name}: dtype {t.dtype} is not the query's {query.dtype}; "
                          "query, key and value take one dtype")


def _check_batches(query, key, value, batch_dim):
    """torch takes key and value of the query's batch; the wire would
    broadcast a batch of 1."""
    if batch_dim is None:
        return
    for name, t in (("key", key), ("value", value)):
        if t.shape[batch_dim] != query.shape[batch_dim]:
            raise invalid(f"{name}: batch {t.shape[batch_dim]} (shape {list(t.shape)}) is not "
                          f"the query's {query.shape[batch_dim]} (shape {list(query.shape)})")


def _check_ranks(query, key, value, key_padding_mask):
    """torch.nn.MultiheadAttention's ranks: a 3-D (batched) or 2-D (unbatched)
    query, key and value of its rank, key_padding_mask one less."""
    if query.dim() not in (2, 3):
        raise invalid(f"query: shape {list(query.shape)} is {query.dim()}-D; want 3-D "
                      "(batched) or 2-D (unbatched)")
    kind = "batched" if query.dim() == 3 else "unbatched"
    for name, t, rank in (("key", key, query.dim()), ("value", value, query.dim()),
                          ("key_padding_mask", key_padding_mask, query.dim() - 1)):
        if t is not None and t.dim() != rank:
            raise invalid(f"{name}: shape {list(t.shape)} is {t.dim()}-D; want {rank}-D with "
                          f"the {kind} query {list(query.shape)}")


def _mask(mask):
    """torch's mask as the wire takes it: bool (byte masks are bool) or float."""
    if mask is None:
        return None
    if mask.dtype == torch.uint8:
        return mask.bool()
    return mask


def _attn_mask(mask, batch, num_heads, queries, keys):
    """torch's 3-D attn_mask [B * H, L, S] is the wire's [B, H, L, S]."""
    if mask is not None and mask.dim() == 3:
        if tuple(mask.shape) != (batch * num_heads, queries, keys):
            raise invalid(f"attn_mask: 3-D shape {list(mask.shape)} is not [batch * num_heads, "
                          f"L, S] with batch * num_heads = {batch} * {num_heads} = "
                          f"{batch * num_heads}, L = {queries} and S = {keys}")
        mask = mask.reshape(batch, num_heads, queries, keys)
    return mask


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def export_model(layer, folder, name=None):
    """Writes `layer`, a torch.nn.MultiheadAttention, to `folder` as a model
    the server loads (docs/models.md): config.pbtxt (its constructor's
    arguments as an attention.v1.ModelConfig) and weights.safetensors (its
    state_dict under torch's names, in its dtype: float32, bfloat16 or float16;
    others as float32). The model is named after the folder, as the server
    requires: a `name` that is not the folder's is INVALID_ARGUMENT, and
    nothing is written. Returns the ModelConfig written."""
    if not isinstance(layer, torch.nn.MultiheadAttention):
        raise invalid(f"export_model: {type(layer).__name__} is not a torch.nn.MultiheadAttention")
    basename = os.path.basename(os.path.normpath(folder))
    if name and name != basename:
        raise invalid(f'export_model: name "{name}" does not match its folder "{basename}" '
                      f"({folder}): the server refuses a model not named after its folder")
    name = basename
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

