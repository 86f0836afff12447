"""The hand-appended tensors of a request parse, with protobuf, as the
request a protobuf-built one would be; bfloat16 bits travel unchanged."""
import unittest

import numpy as np
import torch

from attention_client import _request
from attention_client._proto.attention.v1 import attention_pb2, tensor_pb2

Tensor = tensor_pb2.Tensor


class WireTest(unittest.TestCase):
    def test_every_tensor_field_lands_where_protobuf_puts_it(self):
        arrays = {name: np.arange(i + 1, dtype=np.float32).reshape(1, -1) for i, name in
                  enumerate(_request.TENSOR_PATHS)}
        fields = {k: v for k, v in arrays.items() if k not in ("query", "key", "value")}
        raw, _ = _request.build(arrays["query"], arrays["key"], arrays["value"], dict(
            fields, id="r", model="m", num_heads=2, layout="SEQUENCE_FIRST", score="bilinear",
            scale=0.5, bandwidth=2.0, causal="top_left", need_weights=True,
            average_weights=True, output_dtype="bfloat16", precision="fast", dropout_p=0.25,
            seed=9))
        r = attention_pb2.AttendRequest.FromString(raw)
        self.assertEqual((r.id, r.model, r.num_heads, r.layout), ("r", "m", 2, 1))
        self.assertEqual((r.score.kind, r.score.scale, r.score.bandwidth), (3, 0.5, 2.0))
        self.assertEqual((r.mask.causal, r.need_weights, r.average_weights), (1, True, True))
        self.assertEqual((r.output_dtype, r.precision, r.dropout_p, r.seed),
                         (Tensor.BFLOAT16, 1, 0.25, 9))
        messages = {"query": r.query, "key": r.key, "value": r.value, "w_q": r.score.w_q,
                    "w_k": r.score.w_k, "w_v": r.score.w_v, "w": r.score.w,
                    "valid_lens": r.mask.valid_lens, "key_padding_mask": r.mask.key_padding_mask,
                    "attn_mask": r.mask.attn_mask}
        for name, array in arrays.items():
            with self.subTest(name):
                self.assertEqual(list(messages[name].shape), list(array.shape))
                self.assertEqual(messages[name].data, array.tobytes())

    def test_bfloat16_float16_bool_and_int_tensors_keep_their_bytes(self):
        bf16 = torch.randn(2, 3).to(torch.bfloat16)
        for x, dtype, data in [
            (bf16, Tensor.BFLOAT16, bf16.view(torch.int16).numpy().tobytes()),
            (torch.ones(2, dtype=torch.float16), Tensor.FLOAT16, np.ones(2, np.float16).tobytes()),
            (np.array([True, False]), Tensor.BOOL, b"\x01\x00"),
            (torch.tensor([3], dtype=torch.int32), Tensor.INT32, b"\x03\x00\x00\x00"),
            (np.array([[4]], np.int64), Tensor.INT64, b"\x04" + b"\x00" * 7),
            (np.zeros((0, 4), np.float32), Tensor.FLOAT32, b""),
        ]:
            with self.subTest(dtype=Tensor.DType.Name(dtype)):
                q = attention_pb2.AttendRequest.FromString(_request.build(x, None, None, {})[0]).query
                self.assertEqual((q.dtype, list(q.shape), q.data), (dtype, list(x.shape), data))

    def test_non_contiguous_inputs_are_sent_in_row_major_order(self):
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
        q = attention_pb2.AttendRequest.FromString(_request.build(x, None, None, {})[0]).query
        self.assertEqual(q.data, x.contiguous().numpy().tobytes())


if __name__ == "__main__":
    unittest.main()
