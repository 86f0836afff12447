"""An AttendRequest from attend()'s arguments, named after the wire's fields."""
import numbers
import sys

from attention_client import _wire
from attention_client._errors import invalid
from attention_client._proto.attention.v1 import attention_pb2, tensor_pb2

AttendRequest = attention_pb2.AttendRequest
Score = attention_pb2.Score
Mask = attention_pb2.Mask
Tensor = tensor_pb2.Tensor

# Where each tensor argument goes: field numbers from AttendRequest down.
TENSOR_PATHS = {
    "query": (3,), "key": (4,), "value": (5,),
    "w_q": (8, 3), "w_k": (8, 4), "w_v": (8, 5), "w": (8, 6),
    "valid_lens": (9, 1), "key_padding_mask": (9, 2), "attn_mask": (9, 3),
}
FIELDS = frozenset({
    "id", "model", "num_heads", "layout", "score", "scale", "w_q", "w_k", "w_v", "w",
    "bandwidth", "valid_lens", "key_padding_mask", "attn_mask", "causal", "need_weights",
    "average_weights", "output_dtype", "precision", "dropout_p", "seed",
})


def _enum(field, enum, value, aliases=None):
    """An enum value from its number, its name in any case, or an alias."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if value in enum.values():
            return int(value)
    elif isinstance(value, str):
        name = value.upper()
        if name in enum.keys():
            return enum.Value(name)
    if aliases is not None and value in aliases:
        return aliases[value]
    names = ", ".join(n.lower() for n in enum.keys())
    raise invalid(f"{field}: {value!r} is not one of {names}")


def dtype_enum(field, value):
    """A Tensor.DType from its name (any case: "bfloat16"), number, or a torch
    or numpy dtype."""
    aliases = {}
    torch = sys.modules.get("torch")
    if torch is not None:
        aliases.update({torch.float32: Tensor.FLOAT32, torch.bfloat16: Tensor.BFLOAT16,
                        torch.float16: Tensor.FLOAT16})
    try:
        import numpy as np
        if not isinstance(value, (str, numbers.Integral)) and np.dtype(value) in (
                np.float32, np.float16):
            return Tensor.FLOAT32 if np.dtype(value) == np.float32 else Tensor.FLOAT16
    except TypeError:
        pass
    return _enum(field, Tensor.DType, value, aliases)


def build(query, key, value, fields, session=None):
    """(the request's bytes, the Kind its answer comes back as). `fields` are
    attend()'s keyword arguments; `session` a SessionSpec or None."""
    if fields and not FIELDS.issuperset(fields):
        unknown = set(fields) - FIELDS
        raise invalid(f"unknown field(s) {', '.join(sorted(unknown))}; the fields are "
                      f"{', '.join(sorted(FIELDS))}")
    if query is None:
        raise invalid("query: missing")
    tensors = [(TENSOR_PATHS["query"], _wire.to_wire("query", query))]
    if key is not None:
        tensors.append((TENSOR_PATHS["key"], _wire.to_wire("key", key)))
    if value is not None:
        tensors.append((TENSOR_PATHS["value"], _wire.to_wire("value", value)))
    # Without fields or a session, every field but the tensors has its default:
    # nothing to serialize.
    head = _head(fields, session, tensors) if fields or session is not None else b""
    return _wire.encode(head, tensors), _wire.kind_of(query)


def _head(fields, session, tensors):
    """The bytes of the request's fields but its tensors; the tensor fields
    among `fields` are appended to `tensors`."""
    request = AttendRequest()

    def tensor(name, x):
        if x is not None:
            tensors.append((TENSOR_PATHS[name], _wire.to_wire(name, x)))

    get = fields.get
    if get("id") is not None:
        request.id = str(get("id"))
    if get("model"):
        request.model = get("model")
    if get("num_heads"):
        request.num_heads = int(get("num_heads"))
    if get("layout") is not None:
        request.layout = _enum("layout", AttendRequest.Layout, get("layout"))
    if get("score") is not None:
        request.score.kind = _enum("score", Score.Kind, get("score"))
    if get("scale") is not None:
        request.score.scale = float(get("scale"))
    if get("bandwidth") is not None:
        request.score.bandwidth = float(get("bandwidth"))
    for name in ("w_q", "w_k", "w_v", "w", "valid_lens", "key_padding_mask", "attn_mask"):
        tensor(name, get(name))
    if get("causal") is not None:
        request.mask.causal = _enum("causal", Mask.Causal, get("causal"))
    request.need_weights = bool(get("need_weights", False))
    request.average_weights = bool(get("average_weights", False))
    if get("output_dtype") is not None:
        request.output_dtype = dtype_enum("output_dtype", get("output_dtype"))
    if get("precision") is not None:
        request.precision = _enum("precision", AttendRequest.Precision, get("precision"))
    if get("dropout_p"):
        request.dropout_p = float(get("dropout_p"))
    if get("seed"):
        request.seed = int(get("seed"))
    if session is not None:
        request.session.CopyFrom(session)
    return request.SerializeToString()


def build_stream_item(index, item, fields, kinds):
    """The bytes of the `index`-th request of a stream: `item` (a dict of
    attend()'s arguments) over the stream's `fields`, its id defaulting to
    its index. Records the answer's kind under the id in `kinds`."""
    args = dict(fields)
    args.update(item)
    if args.get("id") in (None, ""):
        args["id"] = str(index)
    query, key, value = args.pop("query", None), args.pop("key", None), args.pop("value", None)
    raw, kind = build(query, key, value, args)
    kinds.setdefault(str(args["id"]), []).append(kind)
    return raw
