"""Requests and answers as bytes, and numpy / torch tensors as wire tensors.

A request is serialized by protobuf without its tensors' elements; each tensor
is then appended by hand as the same field (protobuf merges a message field
that occurs twice), its elements taken straight from the array's memory. The
one b"".join that makes the request's bytes is the only copy of the elements
made in Python. An answer's output and weights are read out of the answer's
bytes by offset, and copied once into the arrays returned.

The client's own work is on every call's path (docs/benchmarks.md, "Python
client"), so the common case takes few steps: a tensor's header (its field
tags, lengths, dtype and shape) is made once per field, dtype and shape, and
an answer's scalars are read by hand, protobuf parsing only what is left (a
status, session positions).
"""
import functools
import sys

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from attention_client import _heap
from attention_client._errors import AttentionError, code_of, invalid
from attention_client._proto.attention.v1 import attention_pb2, tensor_pb2

Tensor = tensor_pb2.Tensor
_LITTLE = sys.byteorder == "little"

_NUMPY_DTYPES = {
    np.dtype(np.float32): Tensor.FLOAT32,
    np.dtype(np.float16): Tensor.FLOAT16,
    np.dtype(np.bool_): Tensor.BOOL,
    np.dtype(np.int32): Tensor.INT32,
    np.dtype(np.int64): Tensor.INT64,
}
# The numpy dtype whose bytes are a wire dtype's; numpy has no bfloat16, so its
# bits travel as uint16.
_WIRE_NUMPY = {
    Tensor.FLOAT32: np.dtype("<f4"),
    Tensor.BFLOAT16: np.dtype("<u2"),
    Tensor.FLOAT16: np.dtype("<f2"),
    Tensor.BOOL: np.dtype(np.bool_),
    Tensor.INT32: np.dtype("<i4"),
    Tensor.INT64: np.dtype("<i8"),
}
# The same in this machine's byte order: what answers are copied into.
_NATIVE_NUMPY = {dtype: wire.newbyteorder("=") for dtype, wire in _WIRE_NUMPY.items()}


def _torch():
    """The torch module if it has been imported (never imports it)."""
    return sys.modules.get("torch")


class Kind:
    """How answers come back: numpy arrays, or torch tensors on `device`."""
    __slots__ = ("torch", "device")

    def __init__(self, torch_device=None):
        self.torch = torch_device is not None
        self.device = torch_device


NUMPY = Kind()


class WireTensor:
    """A tensor in its wire form: dtype, shape, and `array`, a C-contiguous
    little-endian numpy array holding the elements' bytes (bfloat16 as uint16)."""
    __slots__ = ("dtype", "shape", "array")

    def __init__(self, dtype, shape, array):
        self.dtype = dtype
        self.shape = tuple(map(int, shape))
        self.array = array

    @property
    def nbytes(self):
        return self.array.nbytes


def _numpy_wire(name, array):
    dtype = _NUMPY_DTYPES.get(array.dtype)  # a wire dtype in this machine's order
    if dtype is None:
        if array.dtype.newbyteorder("=") == np.float64:
            array = array.astype(np.float32)
        dtype = _NUMPY_DTYPES.get(array.dtype.newbyteorder("="))
        if dtype is None:
            raise invalid(f"{name}: numpy dtype {array.dtype} is not float32, float16, bool, "
                          "int32 or int64 (float64 is sent as float32)")
    want = _WIRE_NUMPY[dtype]
    if array.dtype != want:
        array = array.astype(want)
    return WireTensor(dtype, array.shape, np.ascontiguousarray(array))


def _torch_wire(name, tensor):
    torch = _torch()
    if tensor.is_meta:
        raise invalid(f"{name}: a tensor on the meta device has no elements to send")
    if tensor.layout != torch.strided:
        raise invalid(f"{name}: a {tensor.layout} tensor; send a dense one (.to_dense())")
    if tensor.requires_grad:
        tensor = tensor.detach()  # numpy() takes no tensor that requires grad
    if not tensor.is_cpu:
        tensor = tensor.cpu()
    if tensor.dtype == torch.float64:
        tensor = tensor.float()
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        array = tensor.view(torch.int16).numpy().view(np.uint16)
        return WireTensor(Tensor.BFLOAT16, tensor.shape, _little(array))
    if tensor.dtype not in (torch.float32, torch.float16, torch.bool, torch.int32, torch.int64):
        raise invalid(f"{name}: torch dtype {tensor.dtype} is not float32, bfloat16, float16, "
                      "bool, int32 or int64 (float64 is sent as float32)")
    array = tensor.numpy()
    return WireTensor(_NUMPY_DTYPES[array.dtype], array.shape, _little(array))


def _little(array):
    return array if _LITTLE or array.dtype.itemsize == 1 else array.astype(
        array.dtype.newbyteorder("<"))


def kind_of(x):
    """The kind of answer a request whose query is `x` gets."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        return Kind(x.device)
    return NUMPY


def to_wire(name, x):
    """`x` (numpy array, torch tensor, anything np.asarray takes, or a
    WireTensor) as a WireTensor; INVALID_ARGUMENT for a dtype the wire lacks."""
    if type(x) is np.ndarray:
        return _numpy_wire(name, x)
    if isinstance(x, WireTensor):
        return x
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        return _torch_wire(name, x)
    try:
        return _numpy_wire(name, np.asarray(x))
    except (TypeError, ValueError) as e:
        raise invalid(f"{name}: {e}") from None


def from_wire(dtype, shape, data, kind, start=0, end=None):
    """A numpy array or torch tensor (as `kind`) that owns a copy of the
    elements in data[start:end] (`data` a bytes-like object)."""
    wire = _WIRE_NUMPY.get(dtype)
    if wire is None:
        raise AttentionError(grpc.StatusCode.INTERNAL, f"answer tensor has unknown dtype {dtype}")
    size = (len(data) if end is None else end) - start
    if size % wire.itemsize:
        raise ValueError(f"{size} bytes of tensor data are not whole {wire.name} elements")
    array = np.frombuffer(data, wire, size // wire.itemsize, start).reshape(shape).astype(
        _NATIVE_NUMPY[dtype])
    if not kind.torch:
        if dtype == Tensor.BFLOAT16:
            # numpy has no bfloat16: widen to float32, which is exact.
            return (array.astype(np.uint32) << 16).view(np.float32)
        return array
    torch = _torch()
    if dtype == Tensor.BFLOAT16:
        tensor = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(array)
    return tensor if kind.device.type == "cpu" else tensor.to(kind.device)


# --- protobuf wire format ---------------------------------------------------

def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf, pos):
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _tag(field, wire_type):
    return _varint(field << 3 | wire_type)


@functools.lru_cache(maxsize=256)
def _tensor_header(path, dtype, shape, nbytes):
    """The bytes before the elements of a tensor of `dtype`, `shape` and
    `nbytes` bytes of elements as field `path` (field numbers from the request
    down) of a request: every enclosing field's tag and length, and the
    Tensor's dtype, shape and data tag and length."""
    header = Tensor(dtype=dtype, shape=shape).SerializeToString()
    if nbytes:
        header += _tag(3, 2) + _varint(nbytes)
    length = len(header) + nbytes
    prefix = b""
    for field in reversed(path):
        prefix = _tag(field, 2) + _varint(length) + prefix
        length = len(prefix) + len(header) + nbytes
    return prefix + header


def encode(head, tensors):
    """The bytes of a request: `head` (an AttendRequest without the tensors,
    serialized) with each (path, WireTensor) of `tensors` set."""
    pieces = [head]
    for path, tensor in tensors:
        array = tensor.array
        pieces.append(_tensor_header(path, tensor.dtype, tensor.shape, array.nbytes))
        if array.nbytes:
            pieces.append(array)  # C-contiguous: joined straight from its memory
    raw = b"".join(pieces)
    _heap.keep(len(raw))
    return raw


def _fields(buf, start, end):
    """(field, wire_type, value_start, value_end, field_start) for each field
    of the message in buf[start:end]; a varint's value is its integer in
    value_start."""
    pos = start
    while pos < end:
        field_start = pos
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _read_varint(buf, pos)
            yield field, wire_type, value, pos, field_start
        elif wire_type == 2:
            n, pos = _read_varint(buf, pos)
            yield field, wire_type, pos, pos + n, field_start
            pos += n
        elif wire_type == 1:
            yield field, wire_type, pos, pos + 8, field_start
            pos += 8
        elif wire_type == 5:
            yield field, wire_type, pos, pos + 4, field_start
            pos += 4
        else:
            raise ValueError(f"wire type {wire_type}")
        if pos > end:
            raise ValueError("field past the end")


def _decode_tensor(buf, start, end, kind):
    dtype, shape, data, other = Tensor.FLOAT32, [], None, False
    for field, wire_type, a, b, _ in _fields(buf, start, end):
        if field == 1 and wire_type == 0:
            dtype = a
        elif field == 2 and wire_type == 2:
            pos = a
            while pos < b:
                d, pos = _read_varint(buf, pos)
                shape.append(d)
        elif field == 2 and wire_type == 0:
            shape.append(a)
        elif field == 3 and wire_type == 2:
            data = a, b
        else:
            other = True
    if other:  # float_data / int_data: let protobuf read it.
        t = Tensor.FromString(bytes(buf[start:end]))
        if t.float_data:
            return from_wire(Tensor.FLOAT32, list(t.shape),
                             np.asarray(t.float_data, "<f4").tobytes(), kind)
        return from_wire(t.dtype, list(t.shape),
                         np.asarray(t.int_data, _WIRE_NUMPY[t.dtype]).tobytes(), kind)
    if data is None:
        return from_wire(dtype, shape, b"", kind)
    return from_wire(dtype, shape, buf, kind, *data)


def _int64(n):
    """A varint's value as an int64 field holds it."""
    return n - (1 << 64) if n >> 63 else n


def _int32(n):
    """A varint's value as an int32 field holds it (its low 32 bits)."""
    n &= 0xFFFFFFFF
    return n - (1 << 32) if n >> 31 else n


class Answer:
    """One answer: `output` and `weights` (None unless asked for) as numpy
    arrays or torch tensors, like the request's query; `id`, the server's
    `queue_us`, `compute_us` and `batch_size`, a session request's
    `session_positions`; on a stream, `error` (an AttentionError) for a request
    the server refused, whose output is then None."""
    __slots__ = ("output", "weights", "id", "queue_us", "compute_us", "batch_size",
                 "session_positions", "error")

    def __repr__(self):
        def shape(x):
            return None if x is None else list(x.shape)
        return (f"Answer(id={self.id!r}, output={shape(self.output)}, weights={shape(self.weights)}"
                f", compute_us={self.compute_us}" + (f", error={self.error}" if self.error else "")
                + ")")


def decode(raw, kind):
    """An Answer from an AttendResponse's bytes."""
    answer = Answer()
    answer.output = answer.weights = answer.error = None
    answer.id = ""
    answer.queue_us = answer.compute_us = answer.batch_size = 0
    answer.session_positions = []
    rest = []  # the status, session positions and unknown fields, for protobuf
    try:
        for field, wire_type, a, b, field_start in _fields(raw, 0, len(raw)):
            if wire_type == 2 and (field == 2 or field == 3):
                tensor = _decode_tensor(raw, a, b, kind)
                if field == 2:
                    answer.output = tensor
                else:
                    answer.weights = tensor
            elif wire_type == 0 and field == 5:
                answer.queue_us = _int64(a)
            elif wire_type == 0 and field == 6:
                answer.compute_us = _int64(a)
            elif wire_type == 0 and field == 7:
                answer.batch_size = _int32(a)
            elif wire_type == 2 and field == 1:
                answer.id = str(raw[a:b], "utf-8")
            else:
                rest.append(raw[field_start:b])
        response = attention_pb2.AttendResponse.FromString(b"".join(rest)) if rest else None
    except (ValueError, IndexError, DecodeError) as e:
        raise AttentionError(grpc.StatusCode.INTERNAL, f"malformed answer: {e}") from None
    if response is not None:
        answer.session_positions = list(response.session_positions)
        if response.HasField("status") and response.status.code != 0:
            answer.error = AttentionError(code_of(response.status.code),
                                          response.status.message)
            answer.output = answer.weights = None
    return answer


def decode_stream(raw, kinds):
    """An Answer on a stream: its kind is the one its request's id has first
    in `kinds` (id -> list of Kind, in the order the requests were sent)."""
    answer_id = ""
    try:
        for field, wire_type, a, b, _ in _fields(raw, 0, len(raw)):
            if field == 1 and wire_type == 2:
                answer_id = bytes(raw[a:b]).decode("utf-8", "replace")
    except (ValueError, IndexError):
        pass
    pending = kinds.get(answer_id)
    kind = pending.pop(0) if pending else NUMPY
    if pending == []:
        del kinds[answer_id]
    return decode(raw, kind)
