"""The hand-appended tensors of a request parse, with protobuf, as the
request a protobuf-built one would be; bfloat16 bits travel unchanged; an
answer's hand-read fields are what protobuf reads; AttentionError pickles."""
import copy
import multiprocessing
import pickle
import unittest

import grpc
import numpy as np
import torch

from attention_client import AttentionError, _request, _session, _wire
from attention_client._proto.attention.v1 import attention_pb2, service_pb2, tensor_pb2

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

    def test_sparse_and_meta_tensors_are_invalid_argument(self):
        # They raised a plain TypeError and NotImplementedError.
        for x, text in [(torch.eye(3).to_sparse(), "query: a torch.sparse_coo tensor"),
                        (torch.empty(2, 3, device="meta"), "query: a tensor on the meta device")]:
            with self.subTest(text=text), self.assertRaises(AttentionError) as e:
                _request.build(x, None, None, {})
            self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn(text, e.exception.details())

    def test_tensors_that_require_grad_are_sent(self):
        x = torch.randn(2, 3, requires_grad=True)
        y = x * 2  # not a leaf
        for t in (x, y):
            q = attention_pb2.AttendRequest.FromString(_request.build(t, None, None, {})[0]).query
            self.assertEqual(q.data, t.detach().numpy().tobytes())

    def test_float64_and_other_byte_orders_are_sent_as_wire_dtypes(self):
        for x, dtype, data in [
            (np.array([1.5, -2.0]), Tensor.FLOAT32, np.array([1.5, -2.0], "<f4").tobytes()),
            (np.array([1.5, -2.0], ">f4"), Tensor.FLOAT32, np.array([1.5, -2.0], "<f4").tobytes()),
            (np.array([1.5, -2.0], ">f8"), Tensor.FLOAT32, np.array([1.5, -2.0], "<f4").tobytes()),
            (np.array([7, -1], ">i8"), Tensor.INT64, np.array([7, -1], "<i8").tobytes()),
            (np.array([0.5], ">f2"), Tensor.FLOAT16, np.array([0.5], "<f2").tobytes()),
        ]:
            with self.subTest(dtype=str(x.dtype)):
                q = attention_pb2.AttendRequest.FromString(_request.build(x, None, None, {})[0]).query
                self.assertEqual((q.dtype, list(q.shape), q.data), (dtype, list(x.shape), data))

    def test_requests_of_one_shape_differ_only_in_their_elements(self):
        # A tensor's header is made once per field, dtype and shape.
        for i in range(3):
            q = np.full((2, 3, 4), i, np.float32)
            k = np.full((2, 5, 4), -i, np.float32)
            raw, _ = _request.build(q, k, None, {"num_heads": 1} if i == 2 else {})
            expected = attention_pb2.AttendRequest(
                query=Tensor(shape=q.shape, data=q.tobytes()),
                key=Tensor(shape=k.shape, data=k.tobytes()), num_heads=1 if i == 2 else 0)
            self.assertEqual(attention_pb2.AttendRequest.FromString(raw), expected)

    def test_an_answer_reads_every_field_as_protobuf_does(self):
        out = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
        weights = np.array([[[0.25, 0.75]]], np.float16)
        response = attention_pb2.AttendResponse(
            id="r-\u00e9", output=Tensor(shape=out.shape, data=out.tobytes()),
            weights=Tensor(dtype=Tensor.FLOAT16, shape=weights.shape, data=weights.tobytes()),
            queue_us=-3, compute_us=1 << 40, batch_size=-2, session_positions=[5, 9])
        answer = _wire.decode(response.SerializeToString(), _wire.NUMPY)
        self.assertEqual((answer.id, answer.queue_us, answer.compute_us, answer.batch_size),
                         ("r-\u00e9", -3, 1 << 40, -2))
        self.assertEqual(answer.session_positions, [5, 9])
        self.assertIsNone(answer.error)
        np.testing.assert_array_equal(answer.output, out)
        np.testing.assert_array_equal(answer.weights, weights)
        self.assertEqual(answer.weights.dtype, np.float16)
        self.assertTrue(answer.output.flags.writeable and answer.output.flags.owndata)

        response.status.code, response.status.message = 5, "gone"
        answer = _wire.decode(response.SerializeToString(), _wire.NUMPY)
        self.assertEqual((answer.error.code(), answer.error.details()),
                         (grpc.StatusCode.NOT_FOUND, "gone"))
        self.assertIsNone(answer.output)

    def test_a_malformed_answer_is_internal(self):
        def answer(**fields):
            return attention_pb2.AttendResponse(**fields).SerializeToString()
        good = answer(output=Tensor(shape=[3], data=b"\0" * 12))
        for name, raw in [
            ("truncated", good[:-1]),
            ("partial element", answer(output=Tensor(shape=[3], data=b"\0" * 11))),
            ("elements not the shape's", answer(output=Tensor(shape=[4], data=b"\0" * 12))),
            ("unknown dtype", answer(output=Tensor(dtype=9, shape=[3], data=b"\0" * 12))),
            ("id not UTF-8", b"\x0a\x02\xff\xfe"),
            ("truncated status", b"\x22\x02\x08"),
        ]:
            with self.subTest(name):
                with self.assertRaises(AttentionError) as e:
                    _wire.decode(raw, _wire.NUMPY)
                self.assertEqual(e.exception.code(), grpc.StatusCode.INTERNAL)
        np.testing.assert_array_equal(_wire.decode(good, _wire.NUMPY).output, np.zeros(3))

class AttentionErrorTest(unittest.TestCase):
    def assertSameError(self, got, want):
        self.assertIsInstance(got, AttentionError)
        self.assertEqual((got.code(), got.details(), str(got)),
                         (want.code(), want.details(), str(want)))

    def test_pickle_and_copy_keep_code_and_message(self):
        error = AttentionError(grpc.StatusCode.NOT_FOUND, 'model: "nope" is not served')
        self.assertSameError(pickle.loads(pickle.dumps(error)), error)
        self.assertSameError(copy.copy(error), error)
        self.assertSameError(copy.deepcopy(error), error)

    def test_an_error_raised_in_a_pool_worker_reaches_the_caller(self):
        # A worker's exception is pickled back to the pool; one that cannot be
        # rebuilt leaves the pool's result waiting for ever.
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            result = pool.apply_async(_request.build, (None, None, None, {}))
            with self.assertRaises(AttentionError) as e:
                result.get(timeout=30)
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertEqual(e.exception.details(), "query: missing")


class SessionResyncTest(unittest.TestCase):
    def test_a_session_still_held_past_the_timeout_is_asked_again(self):
        # The step before failed with its outcome unknown, and a request still
        # holds the session (idle_ms 0): its position is not committed, so the
        # step fails DEADLINE_EXCEEDED and the next one asks again.
        core = _session.SessionCore("s", False, "float32", {})
        core.resync_needed = True
        held = service_pb2.SessionInfo(id="s", position=0, idle_ms=0)
        with self.assertRaises(AttentionError) as e:
            core.resync(held)
        self.assertEqual(e.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertIn("a request still holds it", e.exception.details())
        self.assertTrue(core.resync_needed)
        self.assertFalse(core.created)
        core.resync(service_pb2.SessionInfo(id="s", position=0, idle_ms=5))
        self.assertFalse(core.resync_needed)

    def test_a_session_this_client_never_created_is_not_taken_over(self):
        # The first step failed with its outcome unknown, and the server holds
        # a session of that id naming another's step as its last (or, from a
        # server that names none, another count of rows): another client's.
        # Nothing is adopted; the next step creates, which the server refuses
        # ALREADY_EXISTS. (It used to go on at the server's position: the
        # step appended to another client's session.)
        for keep_rows in (False, True):
            for info in (service_pb2.SessionInfo(id="s", position=5, idle_ms=5,
                                                 last_step_id="other-client"),
                         service_pb2.SessionInfo(id="s", position=5, idle_ms=5)):
                with self.subTest(keep_rows=keep_rows, named=info.HasField("last_step_id")):
                    core = _session.SessionCore("s", keep_rows, "float32", {})
                    step = core.prepare(np.ones((1, 1, 2), np.float32), None, None)
                    core.failed(step, AttentionError(grpc.StatusCode.DEADLINE_EXCEEDED, "lost"))
                    self.assertFalse(core.resync(info))
                    self.assertEqual((core.created, core.position, core.unsure,
                                      core.resync_needed), (False, 0, [], False))
                    request = attention_pb2.AttendRequest.FromString(core.request(step))
                    self.assertEqual((request.session.create, list(request.session.positions)),
                                     (True, [0]))

    def test_a_refused_create_is_aborted_only_if_the_session_names_its_step(self):
        core = _session.SessionCore("s", False, "float32", {})
        step = core.prepare(np.ones((1, 2, 2), np.float32), None, None)
        refused = AttentionError(grpc.StatusCode.ALREADY_EXISTS,
                                 'session "s" is already open (position 2)')
        info = service_pb2.SessionInfo(id="s", position=2, idle_ms=5, last_step_id=step[4])
        self.assertEqual(core.create_refused(step, refused, info).code(),
                         grpc.StatusCode.ABORTED)
        # Another's, though of this step's count: the id is taken.
        info.last_step_id = "other-client"
        self.assertIs(core.create_refused(step, refused, info), refused)
        # Still held once the step's timeout passed: not known yet, and
        # settled by the next step's resync, which adopts no other's session.
        info.idle_ms = 0
        error = core.create_refused(step, refused, info)
        self.assertEqual(error.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertIn("a request still holds it", error.details())

    def resynced(self, keep_rows, failed):
        """A session at position 2 whose step `failed` [1, 1, 2] failed with its
        outcome unknown, after a resync that found the server at 3 rows."""
        core = _session.SessionCore("s", keep_rows, "float32", {})
        core.advance(core.prepare(np.zeros((1, 2, 2), np.float32), None, None), 0, None)
        core.failed(core.prepare(failed, None, None),
                    AttentionError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
        self.assertFalse(core.resync(service_pb2.SessionInfo(id="s", position=3, idle_ms=5)))
        self.assertEqual((core.position, core.resync_needed), (3, False))
        return core

    def test_resync_takes_the_servers_last_step_id_over_the_count(self):
        # As C++'s Session::Resync: where the server names the last step that
        # appended, an unsure step of the right count is applied only if it
        # is that step; another writer's step of the same count is not.
        for keep_rows in (False, True):
            with self.subTest(keep_rows=keep_rows):
                core = _session.SessionCore("s", keep_rows, "float32", {})
                core.advance(core.prepare(np.zeros((1, 2, 2), np.float32), None, None), 0, None)
                step = core.prepare(np.ones((1, 1, 2), np.float32), None, None)
                request = attention_pb2.AttendRequest.FromString(core.request(step))
                self.assertEqual(request.session.step_id, step[4])
                self.assertEqual(len(step[4]), 16)
                core.failed(step, AttentionError(grpc.StatusCode.DEADLINE_EXCEEDED, "lost"))
                for other in ("other-writer", ""):  # a writer that named its step, or not
                    info = service_pb2.SessionInfo(id="s", position=3, idle_ms=5,
                                                   last_step_id=other)
                    if keep_rows:
                        with self.assertRaises(AttentionError) as e:
                            core.resync(info)
                        self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
                        self.assertIn(f'none of which makes 3 as its last step (step_id "{other}") '
                                      'did', e.exception.details())
                    else:
                        self.assertFalse(core.resync(info))  # on at the server's position
                        self.assertEqual((core.position, core.applied), (3, None))
                        break
                core = _session.SessionCore("s", keep_rows, "float32", {})
                core.advance(core.prepare(np.zeros((1, 2, 2), np.float32), None, None), 0, None)
                step = core.prepare(np.ones((1, 1, 2), np.float32), None, None)
                core.failed(step, AttentionError(grpc.StatusCode.DEADLINE_EXCEEDED, "lost"))
                self.assertFalse(core.resync(service_pb2.SessionInfo(
                    id="s", position=3, idle_ms=5, last_step_id=step[4])))
                self.assertEqual(core.position, 3)
                self.assertEqual(core.applied[4], step[4])

    def test_a_retry_is_the_applied_steps_rows_byte_for_byte(self):
        # As C++'s SameRows: dtype, shape and bytes (a NaN is its own retry;
        # -0.0 is not 0.0's), and the caller's array as it was when sent.
        for keep_rows in (False, True):
            with self.subTest(keep_rows=keep_rows):
                row = np.array([[[np.nan, 1.0]]], np.float32)
                core = self.resynced(keep_rows, row)
                row[0, 0, 1] = 2.0  # the caller refills its buffer: another step's rows
                self.assertFalse(core.retried(core.prepare(row, None, None)))
                core = self.resynced(keep_rows, np.array([[[0.0, 1.0]]], np.float32))
                self.assertFalse(core.retried(core.prepare(
                    np.array([[[-0.0, 1.0]]], np.float32), None, None)))
                row = np.array([[[np.nan, 1.0]]], np.float32)
                core = self.resynced(keep_rows, row)
                step = core.prepare(row.copy(), None, None)
                self.assertTrue(core.retried(step))
                # Until its answer (core.applied cleared) or another step: a
                # retry of a failed retry is one too.
                self.assertTrue(core.retried(step))
                self.assertFalse(core.retried(core.prepare(np.zeros((1, 1, 2), np.float32),
                                                           None, None)))
                self.assertFalse(core.retried(step))
                request = attention_pb2.AttendRequest.FromString(
                    core.request(step, read_only=True))
                self.assertTrue(request.session.read_only)
                self.assertEqual((list(request.session.positions), request.session.create),
                                 ([3], False))
                self.assertFalse(request.HasField("key") or request.HasField("value"))
                self.assertEqual(request.query.shape, [1, 1, 2])

    def test_a_server_holding_fewer_rows_than_answered_holds_a_stale_copy(self):
        for keep_rows in (False, True):
            with self.subTest(keep_rows=keep_rows):
                core = _session.SessionCore("s", keep_rows, "float32", {})
                core.advance(core.prepare(np.zeros((1, 3, 2), np.float32), None, None), 0, None)
                step = core.prepare(np.ones((1, 1, 2), np.float32), None, None)
                core.failed(step, AttentionError(grpc.StatusCode.ABORTED, "holds 2 rows, not 3"))
                info = service_pb2.SessionInfo(id="s", position=2, idle_ms=5)
                if keep_rows:
                    # The caller closes it, and the step, NOT_FOUND, recreates.
                    self.assertTrue(core.resync(info))
                    self.assertEqual((core.position, core.resync_needed), (3, True))
                    continue
                with self.assertRaises(AttentionError) as e:
                    core.resync(info)
                self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
                self.assertEqual(
                    e.exception.details(),
                    "session s: the server holds 2 rows, fewer than the 3 answered steps put "
                    "there: a stale copy (its replica left and came back while the session lived "
                    "elsewhere); close the session and create it again")
                self.assertEqual((core.position, core.resync_needed), (3, True))


if __name__ == "__main__":
    unittest.main()
