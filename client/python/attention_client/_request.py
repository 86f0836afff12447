"""An AttendRequest from attend()'s arguments, named after the wire's fields."""
import numbers
import operator
import sys

import numpy as np

from attention_client import _wire
from attention_client._errors import AttentionError, invalid
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


def _set(message, attr, name, value, convert, want):
    """message.attr = convert(value); INVALID_ARGUMENT naming `name` when
    `value` is not `want` (of the wrong type, or out of the field's range)."""
    try:
        setattr(message, attr, convert(value))
    except (TypeError, ValueError, OverflowError):
        raise invalid(f"{name}: {value!r} is not {want}") from None


def _string(value):
    if not isinstance(value, str):
        raise TypeError
    return value


def _bool(name, value):
    """A bool field's value: True or False (numpy's too); anything else, a
    string such as "false" among them, is INVALID_ARGUMENT naming `name`."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise invalid(f"{name}: {value!r} is not a bool (True or False)")


def _float(value):
    if isinstance(value, (str, bytes)):
        raise TypeError
    return float(value)


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
        _set(request, "model", "model", get("model"), _string, "a model name (a str)")
    if get("num_heads"):
        _set(request, "num_heads", "num_heads", get("num_heads"), operator.index,
             "an int32 (an int below 2**31)")
    if get("layout") is not None:
        request.layout = _enum("layout", AttendRequest.Layout, get("layout"))
    if get("score") is not None:
        request.score.kind = _enum("score", Score.Kind, get("score"))
    if get("scale") is not None:
        _set(request.score, "scale", "scale", get("scale"), _float, "a number")
    if get("bandwidth") is not None:
        _set(request.score, "bandwidth", "bandwidth", get("bandwidth"), _float, "a number")
    for name in ("w_q", "w_k", "w_v", "w", "valid_lens", "key_padding_mask", "attn_mask"):
        tensor(name, get(name))
    if get("causal") is not None:
        request.mask.causal = _enum("causal", Mask.Causal, get("causal"))
    request.need_weights = _bool("need_weights", get("need_weights", False))
    request.average_weights = _bool("average_weights", get("average_weights", False))
    if get("output_dtype") is not None:
        request.output_dtype = dtype_enum("output_dtype", get("output_dtype"))
    if get("precision") is not None:
        request.precision = _enum("precision", AttendRequest.Precision, get("precision"))
    if get("dropout_p"):
        _set(request, "dropout_p", "dropout_p", get("dropout_p"), _float, "a number")
    if get("seed"):
        _set(request, "seed", "seed", get("seed"), operator.index,
             "a uint64 (an int from 0 to 2**64 - 1)")
    if session is not None:
        request.session.CopyFrom(session)
    return request.SerializeToString()


def build_stream_item(index, item, fields, kinds):
    """The bytes of the `index`-th request of a stream: `item` (a dict of
    attend()'s arguments) over the stream's `fields`, its id defaulting to
    its index. Records the answer's kind under the id in `kinds`. A request
    refused here is INVALID_ARGUMENT naming it: "requests[2]: query: ..."."""
    args = dict(fields)
    try:
        args.update(item)
    except (TypeError, ValueError):
        raise invalid(f"requests[{index}]: a {type(item).__name__}, not a dict of attend()'s "
                      "arguments") from None
    if args.get("id") in (None, ""):
        args["id"] = str(index)
    query, key, value = args.pop("query", None), args.pop("key", None), args.pop("value", None)
    try:
        raw, kind = build(query, key, value, args)
    except AttentionError as e:
        raise AttentionError(e.code(), f"requests[{index}]: {e.details()}") from None
    kinds.setdefault(str(args["id"]), []).append(kind)
    return raw


class StreamRequests:
    """The bytes of a stream's requests, for grpcio to send. grpcio swallows
    an exception raised while it takes the next request (the call fails
    UNKNOWN, or is cancelled on asyncio), so a request refused here, or an
    exception of `requests` itself, ends the requests instead (the stream is
    half-closed; the requests before it are answered) and is kept in
    `error`, raised by the client once the answers have come."""

    def __init__(self, requests, fields):
        self.requests = requests
        self.fields = fields
        self.kinds = {}
        self.error = None

    def __iter__(self):
        try:
            for index, item in enumerate(self.requests):
                yield build_stream_item(index, item, self.fields, self.kinds)
        except Exception as e:  # noqa: BLE001 - raised again by the client
            self.error = e

    async def __aiter__(self):
        try:
            if hasattr(self.requests, "__aiter__"):
                index = 0
                async for item in self.requests:
                    yield build_stream_item(index, item, self.fields, self.kinds)
                    index += 1
            else:
                for index, item in enumerate(self.requests):
                    yield build_stream_item(index, item, self.fields, self.kinds)
        except Exception as e:  # noqa: BLE001 - raised again by the client
            self.error = e
