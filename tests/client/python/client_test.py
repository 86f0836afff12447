"""attention_client.Client against a real server: info, bfloat16 and float16
round trips, the heap of a program that only calls, errors, deadlines, streams,
sessions, TLS and bearer tokens."""
import asyncio
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import unittest

import grpc
import numpy as np
import torch

import attention_client
import attention_client.aio
from attention_client import AttentionError, _heap, _request
from attention_client._proto.attention.v1 import attention_pb2
from reference import attention
from server_fixture import Server


def setUpModule():
    global server, client
    server = Server()
    client = attention_client.Client(server.target, timeout=30)
    server.wait_serving(client)


def tearDownModule():
    client.close()
    server.stop()


def rng(seed):
    return np.random.default_rng(seed)


def randn(seed, *shape):
    return rng(seed).standard_normal(shape).astype(np.float32)


class InfoTest(unittest.TestCase):
    def test_server_info_models_model_and_health(self):
        info = client.server_info()
        self.assertTrue(info.version)
        self.assertGreater(info.limits.max_message_bytes, 0)
        self.assertIn("demo", [m.name for m in client.models()])
        demo = client.model("demo")
        self.assertEqual((demo.embed_dim, demo.num_heads), (64, 4))
        self.assertEqual(client.health(), "SERVING")


class DTypeTest(unittest.TestCase):
    # One key: every weight is exactly 1, so the output is the value itself and
    # any rounding through float32 on the way would show.
    def one_key(self, dtype, seed, exponents=20):
        g = torch.Generator().manual_seed(seed)
        scale = 2.0 ** torch.randint(-exponents, exponents, (1, 2, 1, 16), generator=g)
        v = (torch.randn(1, 2, 1, 16, generator=g) * scale).to(dtype)
        q = torch.randn(1, 2, 3, 16, generator=g).to(dtype)
        return q, torch.randn(1, 2, 1, 16, generator=g).to(dtype), v

    def test_bfloat16_round_trips_bit_exactly(self):
        q, k, v = self.one_key(torch.bfloat16, 1)
        out = client.attend(q, k, v, output_dtype="bfloat16").output
        self.assertEqual(out.dtype, torch.bfloat16)
        want = v.expand(1, 2, 3, 16)
        self.assertTrue(torch.equal(out.view(torch.int16), want.contiguous().view(torch.int16)))

    def test_float16_round_trips_bit_exactly(self):
        q, k, v = self.one_key(torch.float16, 2, exponents=8)
        out = client.attend(q, k, v, output_dtype=torch.float16).output
        self.assertEqual(out.dtype, torch.float16)
        self.assertTrue(torch.equal(out.view(torch.int16),
                                    v.expand(1, 2, 3, 16).contiguous().view(torch.int16)))

    def test_bfloat16_answer_to_numpy_is_its_exact_float32_widening(self):
        q, k, v = self.one_key(torch.bfloat16, 3)
        out = client.attend(q.float().numpy(), k.float().numpy(), v.float().numpy(),
                            output_dtype="BFLOAT16").output
        self.assertEqual(out.dtype, np.float32)
        np.testing.assert_array_equal(out, v.float().expand(1, 2, 3, 16).numpy())

    def test_answers_are_writable_and_on_the_query_device_kind(self):
        q = torch.from_numpy(randn(4, 1, 3, 8))
        out = client.attend(q).output
        out += 1  # writable: owns its memory
        self.assertEqual(out.device, q.device)


# A program that does nothing but call: 0.75 MiB requests (the benchmark's),
# minor page faults per call.
_CALLING_PROGRAM = """
import resource, sys
import numpy as np
import attention_client
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 8, 128, 64)).astype(np.float32) for _ in range(3))
with attention_client.Client(sys.argv[1]) as client:
    for _ in range(20):
        client.attend(q, k, v)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(100):
        client.attend(q, k, v)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / 100)
"""


class HeapTest(unittest.TestCase):
    @unittest.skipUnless(_heap._glibc(), "glibc's malloc")
    def test_calls_of_a_mib_do_not_fault_their_heap_back_in(self):
        # glibc's defaults would return the heap's top to the kernel after each
        # call, and the next would fault 80-170 pages back in (_heap.py).
        env = {k: v for k, v in os.environ.items()
               if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
        out = subprocess.run([sys.executable, "-c", _CALLING_PROGRAM, server.target], env=env,
                             check=True, stdout=subprocess.PIPE, text=True).stdout
        self.assertLess(float(out), 10)


class ErrorTest(unittest.TestCase):
    def test_server_errors_carry_code_and_message(self):
        with self.assertRaises(AttentionError) as e:
            client.attend(randn(5, 2, 3, 4), valid_lens=np.array([1, 2, 3]))
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("mask.valid_lens", e.exception.details())
        self.assertIn("INVALID_ARGUMENT", str(e.exception))
        self.assertIsInstance(e.exception, grpc.RpcError)

    def test_unknown_model_is_not_found(self):
        with self.assertRaises(AttentionError) as e:
            client.attend(randn(6, 1, 2, 64), model="nope")
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
        self.assertIn('model: "nope"', e.exception.details())
        with self.assertRaises(AttentionError) as e:
            client.model("nope")
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_arguments_refused_before_sending_are_invalid_argument(self):
        for call, text in [
            (lambda: client.attend(randn(7, 1, 2, 4), heads=2), "unknown field(s) heads"),
            (lambda: client.attend(np.zeros((1, 2, 4), np.uint8)), "query: numpy dtype uint8"),
            (lambda: client.attend(randn(7, 1, 2, 4), score="softmax"), "score: 'softmax'"),
            (lambda: client.attend(randn(7, 1, 2, 4), causal="left"), "causal: 'left'"),
            (lambda: client.session("c", cache_dtype="foo"),
             "session c: cache_dtype 'foo' is not float32 or bfloat16"),
            (lambda: client.session("c", cache_dtype="float16"),
             "session c: cache_dtype 'float16' is not float32 or bfloat16"),
        ]:
            with self.subTest(text=text), self.assertRaises(AttentionError) as e:
                call()
            self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            if "cache_dtype" in text:  # not the list of every tensor dtype
                self.assertNotIn("int32", e.exception.details())
            self.assertIn(text, e.exception.details())

    def test_arguments_of_the_wrong_type_or_range_are_invalid_argument(self):
        q = randn(8, 1, 2, 4)
        for kwargs, text in [({"seed": -1}, "seed: -1 is not a uint64"),
                             ({"seed": 2 ** 64}, "seed: 18446744073709551616 is not a uint64"),
                             ({"num_heads": "x"}, "num_heads: 'x' is not an int32"),
                             ({"num_heads": 2 ** 40}, "num_heads: 1099511627776 is not an int32"),
                             ({"scale": "x"}, "scale: 'x' is not a number"),
                             ({"dropout_p": "x"}, "dropout_p: 'x' is not a number"),
                             ({"model": 123}, "model: 123 is not a model name"),
                             ({"timeout": "x"}, "timeout: 'x' is not a positive number"),
                             # gRPC took these for deadlines already past
                             ({"timeout": float("inf")}, "timeout: inf is not a positive number"),
                             ({"timeout": 1e10}, "up to 1e+09, or None"),
                             # bool("false") is True: these were sent as True
                             ({"need_weights": "false"}, "need_weights: 'false' is not a bool"),
                             ({"average_weights": "no"}, "average_weights: 'no' is not a bool"),
                             ({"need_weights": np.array([1, 0])}, "need_weights: array([1, 0])")]:
            with self.subTest(**kwargs), self.assertRaises(AttentionError) as e:
                client.attend(q, **kwargs)
            self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn(text, e.exception.details())
        for kwargs, text in [({"target": 123}, "target: 123"),
                             ({"timeout": "x"}, "timeout: 'x'"),
                             ({"timeout": float("inf")}, "timeout: inf"),
                             ({"max_message_mb": "x"}, "max_message_mb: 'x'"),
                             ({"token": "ab\ncd"}, "token: character 2 of 5 is '\\n'"),
                             ({"token": "s3cret\r"}, "token: character 6 of 7 is '\\r'"),
                             ({"token": b"s3cret"}, "token: bytes is not a str")]:
            with self.subTest(**kwargs), self.assertRaises(AttentionError) as e:
                attention_client.Client(**dict({"target": server.target}, **kwargs))
            self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn(text, e.exception.details())

    def test_the_longest_timeout_and_numpy_bools_are_taken(self):
        q = randn(8, 1, 2, 4)
        answer = client.attend(q, timeout=1e9, need_weights=np.bool_(True),
                               average_weights=np.bool_(False))
        self.assertEqual(answer.weights.shape, (1, 1, 2, 2))

    def test_calls_after_close_are_failed_precondition(self):
        closed = attention_client.Client(server.target)
        session = closed.session(num_heads=1)
        closed.close()
        for call in (lambda: closed.attend(randn(8, 1, 2, 4)), closed.health,
                     lambda: list(closed.attend_stream([{"query": randn(8, 1, 2, 4)}])),
                     lambda: session.step(randn(8, 1, 2, 4))):
            with self.assertRaises(AttentionError) as e:
                call()
            self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("the client is closed", e.exception.details())

    def test_a_call_longer_than_its_timeout_is_deadline_exceeded(self):
        # 34 GFLOP: several hundred ms of compute on any machine, against 50 ms.
        long_call = np.ones((1, 4, 4096, 128), np.float32)
        with self.assertRaises(AttentionError) as e:
            client.attend(long_call, timeout=0.05)
        self.assertEqual(e.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)


class FieldsTest(unittest.TestCase):
    def test_heads_layout_causal_and_weights(self):
        q, k, v = randn(9, 3, 2, 8), randn(10, 5, 2, 8), randn(11, 5, 2, 8)  # [L, B, E]
        answer = client.attend(q, k, v, num_heads=2, layout="sequence_first",
                               causal="bottom_right", need_weights=True, average_weights=True)
        heads = lambda x: x.transpose(1, 0, 2).reshape(2, -1, 2, 4).transpose(0, 2, 1, 3)
        want = attention(heads(q), heads(k), heads(v), causal_bottom_right=True)
        want = want.transpose(2, 0, 1, 3).reshape(3, 2, 8)  # back to [L, B, E]
        np.testing.assert_allclose(answer.output, want, rtol=1e-5, atol=1e-5)
        self.assertEqual(answer.weights.shape, (2, 3, 5))
        np.testing.assert_allclose(answer.weights.sum(-1), 1, rtol=1e-5)

    def test_scores_masks_dropout_and_precision_reach_the_server(self):
        q = randn(12, 1, 1, 4, 8)
        kw = dict(score="dot", scale=None, attn_mask=np.array([[False, True, True, True]]),
                  precision="fast", seed=7)
        np.testing.assert_allclose(client.attend(q, **kw).output[0, 0, 0], q[0, 0, 0], rtol=2e-2)
        a = client.attend(q, need_weights=True, dropout_p=0.5, seed=3).weights
        b = client.attend(q, need_weights=True, dropout_p=0.5, seed=3).weights
        np.testing.assert_array_equal(a, b)
        self.assertTrue((a == 0).any())
        cos = client.attend(q, score="cosine", scale=10.0, need_weights=True).weights
        plain = client.attend(q, score="cosine", need_weights=True).weights
        self.assertFalse(np.allclose(cos, plain))
        gauss = client.attend(q, score="gaussian", bandwidth=0.5, need_weights=True).weights
        np.testing.assert_allclose(gauss.sum(-1), 1, rtol=1e-5)


class StreamTest(unittest.TestCase):
    def test_answers_carry_ids_and_a_bad_request_does_not_end_the_stream(self):
        q1, q2 = randn(13, 1, 2, 3, 4), torch.from_numpy(randn(14, 1, 2, 5, 4))
        requests = [{"query": q1, "id": "a"},
                    {"query": q2},
                    {"query": q1, "valid_lens": np.array([1, 2, 3])},
                    {"query": q1, "model": "nope", "id": "z"}]
        answers = {a.id: a for a in client.attend_stream(iter(requests), need_weights=True)}
        self.assertEqual(sorted(answers), ["1", "2", "a", "z"])
        np.testing.assert_allclose(answers["a"].output, attention(q1, q1, q1), rtol=1e-5,
                                   atol=1e-6)
        self.assertIsNotNone(answers["a"].weights)
        self.assertIsInstance(answers["1"].output, torch.Tensor)
        self.assertEqual(tuple(answers["1"].output.shape), (1, 2, 5, 4))
        self.assertEqual(answers["2"].error.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("mask.valid_lens", answers["2"].error.details())
        self.assertIsNone(answers["2"].output)
        self.assertEqual(answers["z"].error.code(), grpc.StatusCode.NOT_FOUND)
        self.assertIsNone(answers["a"].error)

    def test_a_request_refused_before_sending_ends_the_stream_with_its_error(self):
        q = randn(26, 1, 2, 3, 4)
        for bad, text in [({"query": np.zeros((1, 2, 4), np.uint8)},
                           "requests[1]: query: numpy dtype uint8"),
                          ({"query": q, "heads": 2}, "requests[1]: unknown field(s) heads"),
                          ({"query": q, "causal": "left"}, "requests[1]: causal: 'left'"),
                          ("not a dict", "requests[1]: a str, not a dict")]:
            answers = []
            with self.subTest(text=text), self.assertRaises(AttentionError) as e:
                for answer in client.attend_stream(iter([{"query": q, "id": "a"}, bad,
                                                         {"query": q, "id": "c"}])):
                    answers.append(answer)
            self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn(text, e.exception.details())
            # The requests before it are answered; none after it is sent.
            self.assertEqual([a.id for a in answers], ["a"])
            np.testing.assert_allclose(answers[0].output, attention(q, q, q), rtol=1e-5,
                                       atol=1e-6)
        with self.assertRaises(AttentionError) as e:
            list(client.attend_stream([{"query": q}], heads=2))
        self.assertIn("requests[0]: unknown field(s) heads", e.exception.details())

    def test_an_exception_of_the_requests_iterable_is_raised_as_it_is(self):
        def requests():
            yield {"query": randn(27, 1, 2, 3, 4)}
            raise KeyError("the caller's own")

        with self.assertRaises(KeyError) as e:
            list(client.attend_stream(requests()))
        self.assertIn("the caller's own", str(e.exception))

    def test_a_failed_stream_raises(self):
        with attention_client.Client("127.0.0.1:1", timeout=5) as nowhere:
            with self.assertRaises(AttentionError) as e:
                list(nowhere.attend_stream([{"query": randn(15, 1, 2, 4)}]))
        self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)


class SessionTest(unittest.TestCase):
    def stateless(self, q, keys):
        return attention(q, keys, keys, causal_bottom_right=True)

    def test_steps_equal_the_stateless_answer_over_every_row(self):
        rows = randn(16, 1, 2, 6, 8)  # [1, H, S, D]
        with client.session(causal="bottom_right") as s:
            first = s.step(rows[:, :, :4])
            self.assertEqual(s.position, 4)
            np.testing.assert_allclose(first.output, self.stateless(rows[:, :, :4], rows[:, :, :4]),
                                       rtol=1e-5, atol=1e-6)
            for i in (4, 5):
                answer = s.step(rows[:, :, i:i + 1])
                self.assertEqual(answer.session_positions, [i + 1])
                np.testing.assert_allclose(answer.output,
                                           self.stateless(rows[:, :, i:i + 1], rows[:, :, :i + 1]),
                                           rtol=1e-5, atol=1e-6)
            self.assertEqual(client.get_session(s.id).position, 6)
            self.assertTrue(s.open)
        self.assertFalse(s.open)
        with self.assertRaises(AttentionError) as e:
            s.step(rows[:, :, :1])
        self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
        with self.assertRaises(AttentionError) as e:
            client.get_session(s.id)
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_kept_rows_recreate_a_session_the_server_lost(self):
        rows = torch.from_numpy(randn(17, 1, 2, 5, 8))
        s = client.session(keep_rows=True, causal="bottom_right", cache_dtype="float32")
        s.step(rows[:, :, :3])
        s.step(rows[:, :, 3:4])
        self.assertEqual(s.kept_bytes, 2 * 4 * 2 * 8 * 4)
        self.assertEqual(list(client.close_sessions([s.id]).closed), [s.id])
        answer = s.step(rows[:, :, 4:5])
        self.assertEqual((s.recreations, s.position), (1, 5))
        self.assertIsInstance(answer.output, torch.Tensor)
        np.testing.assert_allclose(answer.output.numpy(),
                                   self.stateless(rows[:, :, 4:5].numpy(), rows.numpy()),
                                   rtol=1e-5, atol=1e-6)
        self.assertEqual(client.get_session(s.id).position, 5)
        s.close()

    @staticmethod
    def interpose(c, around):
        """From now on, every Attend call of client `c` is recorded in the list
        returned (its request) and made by around(n, send), n counting from
        1: send() makes the call."""
        real, sent = c._attend, []

        def attend(request, **kw):
            sent.append(attention_pb2.AttendRequest.FromString(request))
            return around(len(sent), lambda: real(request, **kw))
        c._attend = attend
        return sent

    @staticmethod
    def lose_answer(n, send):
        """An `around` for interpose: the 2nd call is made, its answer lost."""
        answer = send()
        if n == 2:
            raise AttentionError(grpc.StatusCode.DEADLINE_EXCEEDED, "answer lost")
        return answer

    def test_a_step_whose_answer_was_lost_sent_again_gets_that_answer(self):
        # The server applies the 2nd request but its answer is lost (as past
        # a deadline): the step sent again appends nothing, and its read-only
        # answer is the one that was lost.
        rows = randn(20, 1, 2, 5, 8)
        for keep_rows in (False, True):
            with self.subTest(keep_rows=keep_rows), attention_client.Client(
                    server.target, timeout=30) as c:
                sent = self.interpose(c, self.lose_answer)
                with c.session(causal="bottom_right", keep_rows=keep_rows) as s:
                    s.step(rows[:, :, :3])
                    with self.assertRaises(AttentionError):
                        s.step(rows[:, :, 3:4])
                    answer = s.step(rows[:, :, 3:4])
                    self.assertEqual((s.position, c.get_session(s.id).position), (4, 4))
                    self.assertTrue(sent[-1].session.read_only)
                    np.testing.assert_allclose(
                        answer.output, self.stateless(rows[:, :, 3:4], rows[:, :, :4]),
                        rtol=1e-5, atol=1e-6)
                    answer = s.step(rows[:, :, 4:5])
                    self.assertEqual(answer.session_positions, [5])
                    np.testing.assert_allclose(answer.output,
                                               self.stateless(rows[:, :, 4:5], rows),
                                               rtol=1e-5, atol=1e-6)

    def assert_retry_recreated(self, c, s, sent, rows):
        """s.step(rows[:, :, 3:4]), the retry of the step found applied (the
        4th row), is sent read-only (the next of `sent`), finds no session
        and recreates it from the kept rows (the one after), the step's row
        once, answered as the lost answer would have been."""
        first = len(sent)
        answer = s.step(rows[:, :, 3:4])
        self.assertEqual((s.position, s.recreations, c.get_session(s.id).position), (4, 1, 4))
        self.assertTrue(sent[first].session.read_only)
        self.assertTrue(sent[first + 1].session.create)
        np.testing.assert_allclose(answer.output,
                                   self.stateless(rows[:, :, 3:4], rows[:, :, :4]),
                                   rtol=1e-5, atol=1e-6)

    def test_a_retry_of_a_session_lost_since_its_step_was_applied_recreates_it(self):
        # The 2nd request's answer is lost after the server applied it; the
        # session is gone before the retry: the retry, read-only, is
        # NOT_FOUND, and recreates the session from the kept rows (the
        # step's among them), answered as the lost answer would have been.
        rows = randn(21, 1, 2, 5, 8)
        with attention_client.Client(server.target, timeout=30) as c:
            def around(n, send):
                if n == 3:
                    c.close_sessions([sent[-1].session.ids[0]])
                return self.lose_answer(n, send)
            sent = self.interpose(c, around)
            with c.session(causal="bottom_right", keep_rows=True) as s:
                s.step(rows[:, :, :3])
                with self.assertRaises(AttentionError):
                    s.step(rows[:, :, 3:4])
                self.assert_retry_recreated(c, s, sent, rows)
                answer = s.step(rows[:, :, 4:5])
                self.assertEqual(answer.session_positions, [5])
                np.testing.assert_allclose(answer.output, self.stateless(rows[:, :, 4:5], rows),
                                           rtol=1e-5, atol=1e-6)

    def test_a_create_sent_again_after_it_was_applied_is_settled_by_its_retry(self):
        # A create applied but its answer lost, and sent again (as gRPC sends
        # a step again after its connection failed): the server refuses it
        # ALREADY_EXISTS, but the session is the step's own, so the step is
        # ABORTED and its retry is answered read-only. The first step's
        # create (1st call), then a recreation's (4th, after the 3rd is
        # NOT_FOUND).
        rows = randn(24, 1, 2, 5, 8)
        with attention_client.Client(server.target, timeout=30) as c:
            def around(n, send):
                if n in (1, 4):
                    send()  # applied, its answer lost
                return send()
            sent = self.interpose(c, around)
            with c.session(causal="bottom_right", keep_rows=True) as s:
                with self.assertRaises(AttentionError) as e:
                    s.step(rows[:, :, :3])
                self.assertEqual(e.exception.code(), grpc.StatusCode.ABORTED)
                self.assertIn("is already open (position 3)", e.exception.details())
                self.assertIn("an earlier attempt of the step, whose answer was lost, created it",
                              e.exception.details())
                answer = s.step(rows[:, :, :3])
                self.assertTrue(sent[1].session.read_only)
                self.assertEqual((s.position, c.get_session(s.id).position), (3, 3))
                np.testing.assert_allclose(answer.output,
                                           self.stateless(rows[:, :, :3], rows[:, :, :3]),
                                           rtol=1e-5, atol=1e-6)
                c.close_sessions([s.id])
                with self.assertRaises(AttentionError) as e:
                    s.step(rows[:, :, 3:4])
                self.assertEqual(e.exception.code(), grpc.StatusCode.ABORTED)
                self.assertIn("it holds this step's 4 rows", e.exception.details())
                self.assertTrue(sent[3].session.create)
                answer = s.step(rows[:, :, 3:4])
                self.assertTrue(sent[4].session.read_only)
                self.assertEqual((s.position, c.get_session(s.id).position), (4, 4))
                np.testing.assert_allclose(answer.output,
                                           self.stateless(rows[:, :, 3:4], rows[:, :, :4]),
                                           rtol=1e-5, atol=1e-6)
                answer = s.step(rows[:, :, 4:5])
                self.assertEqual(answer.session_positions, [5])
                np.testing.assert_allclose(answer.output, self.stateless(rows[:, :, 4:5], rows),
                                           rtol=1e-5, atol=1e-6)
            with self.assertRaises(AttentionError) as e:
                c.get_session(s.id)
            self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)  # closed

    def test_a_retrys_recreation_sent_again_after_it_was_applied_is_settled_by_the_next(self):
        # The 2nd request is applied, its answer lost; the session is gone
        # before the read-only retry (3rd), so the retry recreates it (4th),
        # and that create is applied, its answer lost, and sent again: the
        # server refuses it ALREADY_EXISTS, but the session is the retry's
        # own, so the retry is ABORTED and the next one is answered read-only.
        rows = randn(26, 1, 2, 5, 8)
        with attention_client.Client(server.target, timeout=30) as c:
            def around(n, send):
                if n == 3:
                    c.close_sessions([sent[-1].session.ids[0]])
                if n == 4:
                    send()  # applied, its answer lost
                return self.lose_answer(n, send)
            sent = self.interpose(c, around)
            with c.session(causal="bottom_right", keep_rows=True) as s:
                s.step(rows[:, :, :3])
                with self.assertRaises(AttentionError):
                    s.step(rows[:, :, 3:4])
                with self.assertRaises(AttentionError) as e:
                    s.step(rows[:, :, 3:4])
                self.assertEqual(e.exception.code(), grpc.StatusCode.ABORTED)
                self.assertIn("it holds this step's 4 rows", e.exception.details())
                self.assertEqual((sent[2].session.read_only, sent[3].session.create),
                                 (True, True))
                answer = s.step(rows[:, :, 3:4])
                self.assertTrue(sent[4].session.read_only)
                self.assertEqual((s.position, c.get_session(s.id).position), (4, 4))
                np.testing.assert_allclose(answer.output,
                                           self.stateless(rows[:, :, 3:4], rows[:, :, :4]),
                                           rtol=1e-5, atol=1e-6)

    def test_an_aborted_retry_is_settled_by_the_next_step(self):
        # The 2nd request is applied, its answer lost; before the read-only
        # retry (3rd) the session is a stale copy of 1 row, as a replica
        # keeps one while the session lives elsewhere: the retry is ABORTED,
        # and the next step closes the copy and recreates the session from
        # the kept rows, the step's among them.
        rows = randn(25, 1, 2, 5, 8)
        with attention_client.Client(server.target, timeout=30) as c:
            real = c._attend

            def around(n, send):
                if n == 3:
                    sid = sent[-1].session.ids[0]
                    c.close_sessions([sid])
                    stale = attention_pb2.SessionSpec(ids=[sid], positions=[0], create=True)
                    real(_request.build(rows[:, :, :1], None, None, {"causal": "bottom_right"},
                                        stale)[0])
                return self.lose_answer(n, send)
            sent = self.interpose(c, around)
            with c.session(causal="bottom_right", keep_rows=True) as s:
                s.step(rows[:, :, :3])
                with self.assertRaises(AttentionError):
                    s.step(rows[:, :, 3:4])
                with self.assertRaises(AttentionError) as e:
                    s.step(rows[:, :, 3:4])
                self.assertEqual(e.exception.code(), grpc.StatusCode.ABORTED)
                self.assertTrue(sent[2].session.read_only)
                self.assert_retry_recreated(c, s, sent, rows)

    def test_another_writers_step_of_the_same_count_is_not_taken_for_a_lost_one(self):
        # The 2nd request never reaches the server (its outcome unknown to
        # the client); another writer appends one row meanwhile. By the count
        # it would pass for the lost step; the server's last_step_id says not.
        rows = randn(22, 1, 2, 5, 8)
        with attention_client.Client(server.target, timeout=30) as c:
            def around(n, send):
                if n == 2:
                    raise AttentionError(grpc.StatusCode.DEADLINE_EXCEEDED, "never sent")
                return send()
            self.interpose(c, around)
            s = c.session(causal="bottom_right", keep_rows=True)
            s.step(rows[:, :, :3])
            with self.assertRaises(AttentionError):
                s.step(rows[:, :, 3:4])
            other = attention_pb2.SessionSpec(ids=[s.id], positions=[3], step_id="other-writer")
            c._attend(_request.build(rows[:, :, 4:5], None, None, {"causal": "bottom_right"},
                                     other)[0])
            self.assertEqual(c.get_session(s.id).last_step_id, "other-writer")
            with self.assertRaises(AttentionError) as e:
                s.step(rows[:, :, 3:4])
            self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn('as its last step (step_id "other-writer") did', e.exception.details())
            c.close_sessions([s.id])

    def test_a_recreation_refused_for_another_clients_session_leaves_it_alone(self):
        # A's session is lost (closed here before A's 2nd call), and B opens
        # the id before A's recreation (3rd call): the recreation is refused
        # ALREADY_EXISTS, and A's session is over. A neither steps on B's
        # session nor closes it. (A used to go on, and its close() closed B's.)
        rows = randn(30, 1, 2, 6, 8)
        with attention_client.Client(server.target, timeout=30) as c:
            def around(n, send):
                if n == 2:
                    c.close_sessions(["py-contested"])
                if n == 3:
                    client.session("py-contested", causal="bottom_right").step(rows[:, :, :5])
                return send()
            sent = self.interpose(c, around)
            a = c.session("py-contested", causal="bottom_right", keep_rows=True)
            a.step(rows[:, :, :2])
            with self.assertRaises(AttentionError) as e:
                a.step(rows[:, :, 2:3])
            self.assertEqual(e.exception.code(), grpc.StatusCode.ALREADY_EXISTS)
            self.assertIn("this session is over", e.exception.details())
            self.assertTrue(sent[2].session.create)
            self.assertFalse(a.open)
            with self.assertRaises(AttentionError) as e:
                a.step(rows[:, :, 2:3])
            self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("another client has opened the id", e.exception.details())
            a.close()
            self.assertEqual(len(sent), 3)
        self.assertEqual(client.get_session("py-contested").position, 5)
        client.close_sessions(["py-contested"])

    def test_a_session_another_client_opened_is_never_taken_over(self):
        # Client A's session is open when B's first step of the same id fails
        # with its outcome unknown (here before it is sent): B's close() does
        # not close A's session, and B's next steps, finding it named after
        # A's step, are refused ALREADY_EXISTS, appending nothing. A create
        # refused while A's request holds the session (GetSession's idle_ms
        # 0, as answered here the first time) waits until it is idle: the same
        # ALREADY_EXISTS, not an "unsure" ABORTED. (B used to take the session
        # over at A's position, and to close it.)
        rows = randn(29, 1, 2, 4, 8)
        a = client.session("py-shared", causal="bottom_right")
        a.step(rows[:, :, :2])
        last = client.get_session("py-shared").last_step_id
        for keep_rows in (False, True):
            with self.subTest(keep_rows=keep_rows), attention_client.Client(
                    server.target, timeout=30) as c:
                def around(n, send):
                    if n in (1, 2):
                        raise AttentionError(grpc.StatusCode.DEADLINE_EXCEEDED, "never sent")
                    return send()
                sent = self.interpose(c, around)
                for closes in (True, False):
                    b = c.session("py-shared", causal="bottom_right", keep_rows=keep_rows)
                    with self.assertRaises(AttentionError) as e:
                        b.step(rows[:, :, 2:3])
                    self.assertEqual(e.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
                    if closes:
                        b.close()
                        continue
                    for _ in range(2):
                        with self.assertRaises(AttentionError) as e:
                            b.step(rows[:, :, 2:3])
                        self.assertEqual(e.exception.code(), grpc.StatusCode.ALREADY_EXISTS)
                    self.assertEqual((b.position, b.open), (0, False))
                    b.close()
                self.assertTrue(all(r.session.create for r in sent))
                real, asked = c._stub.GetSession, []

                def get_session(request, **kw):
                    info = real(request, **kw)
                    asked.append(info.idle_ms)
                    if len(asked) == 1:
                        info.idle_ms = 0  # as while A's request holds the session
                    return info
                c._stub.GetSession = get_session
                b = c.session("py-shared", causal="bottom_right", keep_rows=keep_rows)
                with self.assertRaises(AttentionError) as e:
                    b.step(rows[:, :, 2:3])
                self.assertEqual(e.exception.code(), grpc.StatusCode.ALREADY_EXISTS)
                self.assertIn('session "py-shared" is already open (position 2)',
                              e.exception.details())
                self.assertEqual(len(asked), 2)
                b.close()
            info = client.get_session("py-shared")
            self.assertEqual((info.position, info.last_step_id), (2, last))
        answer = a.step(rows[:, :, 2:3])
        self.assertEqual(answer.session_positions, [3])
        np.testing.assert_allclose(answer.output, self.stateless(rows[:, :, 2:3], rows[:, :, :3]),
                                   rtol=1e-5, atol=1e-6)
        a.close()

    def test_close_after_a_first_step_of_unknown_outcome_closes_a_session_it_created(self):
        # The first step's create is applied but its answer lost: close()
        # finds the session named after that step, and closes it.
        with attention_client.Client(server.target, timeout=30) as c:
            self.interpose(c, lambda n, send: self.lose_answer(n + 1, send))
            s = c.session(causal="bottom_right")
            with self.assertRaises(AttentionError):
                s.step(randn(30, 1, 2, 3, 8))
            self.assertEqual(c.get_session(s.id).position, 3)
            s.close()
            with self.assertRaises(AttentionError) as e:
                c.get_session(s.id)
            self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_without_kept_rows_a_lost_session_is_not_found(self):
        s = client.session("py-lost", causal="bottom_right")
        s.step(randn(18, 1, 2, 2, 8))
        client.close_sessions(["py-lost"])
        with self.assertRaises(AttentionError) as e:
            s.step(randn(19, 1, 2, 1, 8))
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
        self.assertIn("py-lost", e.exception.details())
        self.assertEqual(s.position, 2)

    def test_a_session_whose_id_is_not_ascii(self):
        # Its "attention-affinity" goes %-encoded; the server's NOT_FOUND names it.
        rows = randn(28, 1, 2, 4, 8)
        s = client.session("café 1%", keep_rows=True, causal="bottom_right")
        s.step(rows[:, :, :3])
        self.assertEqual(client.get_session("café 1%").position, 3)
        self.assertEqual(list(client.close_sessions(["café 1%", "py-never"]).closed),
                         ["café 1%"])
        answer = s.step(rows[:, :, 3:])
        self.assertEqual((s.recreations, s.position), (1, 4))
        np.testing.assert_allclose(answer.output, self.stateless(rows[:, :, 3:], rows),
                                   rtol=1e-5, atol=1e-6)
        s.close()
        with self.assertRaises(AttentionError) as e:
            client.get_session("café 1%")
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
        self.assertIn('session "café 1%"', e.exception.details())


        s = client.session(keep_rows=True, num_heads=2, causal="bottom_right")
        s.step(randn(20, 1, 3, 8))
        with self.assertRaises(AttentionError) as e:
            s.step(randn(21, 1, 1, 6))
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("query: FLOAT32 [1, 1, 6] cannot follow the session's kept FLOAT32 key "
                      "rows", e.exception.details())
        self.assertEqual((s.position, client.get_session(s.id).position), (3, 3))
        s.close()

    def test_a_taken_id_and_a_wrong_position_are_the_servers_errors(self):
        a = client.session("py-taken", model="demo")
        a.step(randn(22, 1, 2, 64))
        b = client.session("py-taken", model="demo")
        with self.assertRaises(AttentionError) as e:
            b.step(randn(23, 1, 2, 64))
        self.assertEqual(e.exception.code(), grpc.StatusCode.ALREADY_EXISTS)
        a._core.position = 7  # as if another writer's step had been lost
        with self.assertRaises(AttentionError) as e:
            a.step(randn(24, 1, 1, 64))
        self.assertEqual(e.exception.code(), grpc.StatusCode.ABORTED)
        a.close()

    def test_bad_session_arguments(self):
        for kwargs, text in [({"id": "x" * 129}, "want 1 to 128"),
                             ({"cache_dtype": "float16"}, "cache_dtype"),
                             ({"query": randn(25, 1, 1, 4)}, "set by step()"),
                             ({"stream": True}, "attention_client.aio's sessions step on a "
                                                "stream")]:
            with self.subTest(text=text), self.assertRaises(AttentionError) as e:
                client.session(**kwargs)
            self.assertIn(text, e.exception.details())


_OPENSSL_CNF = """[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca_ext]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
[server_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost,IP:127.0.0.1
"""


def make_certs(folder):
    """A CA and a server certificate for 127.0.0.1 signed by it, with openssl."""
    with open(os.path.join(folder, "openssl.cnf"), "w") as f:
        f.write(_OPENSSL_CNF)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    run = lambda *args: subprocess.run(["openssl", *args], cwd=folder, check=True,
                                       capture_output=True, timeout=30)
    run("req", "-x509", "-config", "openssl.cnf", "-extensions", "ca_ext", *key, "-days", "2",
        "-subj", "/CN=attention test CA", "-keyout", "ca.key", "-out", "ca.pem")
    run("req", "-new", "-config", "openssl.cnf", *key, "-subj", "/CN=localhost",
        "-keyout", "server.key", "-out", "server.csr")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-set_serial", "2", "-days", "2", "-extfile", "openssl.cnf", "-extensions", "server_ext",
        "-out", "server.pem")


class AffinityTest(unittest.TestCase):
    """Session calls carry "attention-affinity" (the id, or the caller's
    group), for a proxy to route on; other calls none. A stand-in server
    records each call's metadata and answers NOT_FOUND."""

    def setUp(self):
        from concurrent import futures
        self.seen = []

        class Recorder(grpc.GenericRpcHandler):
            def service(handler, details):
                metadata = dict(details.invocation_metadata)
                self.seen.append((details.method.rsplit("/", 1)[-1],
                                  metadata.get("attention-affinity")))

                def refuse(request, context):
                    context.abort(grpc.StatusCode.NOT_FOUND, "session not open")
                return grpc.unary_unary_rpc_method_handler(refuse)

        self.fake = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                                handlers=[Recorder()])
        port = self.fake.add_insecure_port("127.0.0.1:0")
        self.fake.start()
        self.client = attention_client.Client(f"127.0.0.1:{port}", timeout=10)

    def tearDown(self):
        self.client.close()
        self.fake.stop(None)

    def test_session_calls_carry_their_affinity(self):
        s = self.client.session("decoder-3", num_heads=1)
        with self.assertRaises(AttentionError):
            s.step(randn(1, 1, 2, 4))
        grouped = self.client.session("decoder-4", affinity="user-42", num_heads=1)
        with self.assertRaises(AttentionError):
            grouped.step(randn(2, 1, 2, 4))
        with self.assertRaises(AttentionError):
            self.client.get_session("decoder-5")
        with self.assertRaises(AttentionError):
            self.client.close_sessions(["decoder-6"])
        with self.assertRaises(AttentionError):
            self.client.attend(randn(3, 1, 2, 4))
        self.assertEqual(self.seen, [("Attend", "decoder-3"), ("Attend", "user-42"),
                                     ("GetSession", "decoder-5"),
                                     ("CloseSessions", "decoder-6"), ("Attend", None)])

    def test_an_id_outside_printable_ascii_goes_percent_encoded(self):
        # As common/metadata.h's AffinityHeaderValue: UTF-8 bytes outside
        # '!'..'~', and '%', as %XX.
        for affinity in (None, "café 1%"):
            s = self.client.session("café 1%" if affinity is None else "d", affinity=affinity,
                                    num_heads=1)
            with self.assertRaises(AttentionError) as e:
                s.step(randn(4, 1, 2, 4))
            self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(AttentionError):
            self.client.get_session("é")
        self.assertEqual(self.seen, [("Attend", "caf%C3%A9%201%25"),
                                     ("Attend", "caf%C3%A9%201%25"), ("GetSession", "%C3%A9")])


class ReplicasTest(unittest.TestCase):
    """A target of several addresses (a headless Service's pods, "ipv4:A,B"):
    calls rotate over them all, as the C++ client's do. gRPC's default
    policy would send every call to the first."""

    @classmethod
    def setUpClass(cls):
        cls.servers = []
        for name in ("replica-a", "replica-b"):
            cls.servers.append(Server(flags=["--replica_name", name]))
            with attention_client.Client(cls.servers[-1].target) as c:
                cls.servers[-1].wait_serving(c)
        cls.target = "ipv4:" + ",".join(s.target for s in cls.servers)

    @classmethod
    def tearDownClass(cls):
        for s in cls.servers:
            s.stop()

    def test_calls_rotate_over_every_address_of_the_target(self):
        # Calls until both replicas have answered (the second connection may
        # come up a moment after the first), for at most 10 s.
        seen = []
        with attention_client.Client(self.target, timeout=10) as c:
            deadline = time.monotonic() + 10
            while len(set(seen)) < 2 and time.monotonic() < deadline:
                seen.append(c.server_info().replica)
        self.assertEqual(set(seen), {"replica-a", "replica-b"}, seen)

    def test_the_asyncio_clients_calls_rotate_too(self):
        import asyncio

        from attention_client import aio

        async def answering():
            seen = []
            c = aio.Client(self.target, timeout=10)
            try:
                deadline = time.monotonic() + 10
                while len(set(seen)) < 2 and time.monotonic() < deadline:
                    seen.append((await c.server_info()).replica)
            finally:
                await c.close()
            return seen

        seen = asyncio.run(answering())
        self.assertEqual(set(seen), {"replica-a", "replica-b"}, seen)


class ProxyRestartTest(unittest.TestCase):
    HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
    CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "..", "deploy", "haproxy",
                          "haproxy.cfg")

    def start_proxy(self, port, replica, metrics_port):
        env = dict(os.environ, ATTENTION_PROXY_BIND=f"127.0.0.1:{port}")
        for i in (1, 2, 3):
            env[f"ATTENTION_REPLICA_{i}"] = replica
            env[f"ATTENTION_REPLICA_{i}_CHECK_PORT"] = str(metrics_port)
        proxy = subprocess.Popen([self.HAPROXY, "-db", "-f", self.CONFIG], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.addCleanup(lambda: (proxy.kill(), proxy.wait()))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return proxy
            time.sleep(0.02)
        self.fail("haproxy did not start")

    @unittest.skipUnless(os.path.exists(HAPROXY), "haproxy is not installed")
    def test_a_client_connected_before_the_proxy_restarted_reconnects(self):
        # No call waits while a channel fails, so nothing polled its
        # reconnection, and HAProxy, which waits for the client's preface,
        # timed each attempt out: the client failed every call from then on.
        replica = Server(flags=("--metrics_port", "0"))
        self.addCleanup(replica.stop)
        deadline = time.monotonic() + 10
        while not (found := re.search(r"metrics on http://127\.0\.0\.1:(\d+)/", replica.log())):
            self.assertLess(time.monotonic(), deadline, replica.log())
            time.sleep(0.05)
        metrics_port = int(found.group(1))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proxy = self.start_proxy(port, replica.target, metrics_port)
        q = randn(31, 1, 2, 4)

        def answered_within(seconds):
            deadline = time.monotonic() + seconds
            while True:
                try:
                    c.attend(q, timeout=2)
                    return True
                except AttentionError:
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(0.1)

        with attention_client.Client(f"127.0.0.1:{port}", timeout=5) as c:
            self.assertTrue(answered_within(15))
            proxy.kill()
            proxy.wait()
            with self.assertRaises(AttentionError) as e:
                c.attend(q)
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)
            time.sleep(1)  # a few failed reconnects
            self.start_proxy(port, replica.target, metrics_port)
            self.assertTrue(answered_within(15), "still failing 15 s after HAProxy came back")


def call_on_new_client(make, target, call, **kwargs):
    """call(client) on a new Client or aio.Client (in its own event loop)."""
    if make is attention_client.Client:
        with make(target, **kwargs) as c:
            return call(c)

    async def run():
        async with make(target, **kwargs) as c:
            result = call(c)
            return await result if result is not None else None
    return asyncio.run(run())


class SecurityTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory(prefix="attention_py_tls_")
        d = cls.dir.name
        make_certs(d)
        with open(os.path.join(d, "token"), "w") as f:
            f.write("s3cret\n")
        cls.server = Server(flags=["--tls_cert", f"{d}/server.pem", "--tls_key", f"{d}/server.key",
                                   "--auth_token_file", f"{d}/token"])
        cls.ca = os.path.join(d, "ca.pem")

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()
        cls.dir.cleanup()

    def test_tls_with_the_token_is_served(self):
        with attention_client.Client(self.server.target, tls_ca=self.ca, token="s3cret") as c:
            self.server.wait_serving(c)
            self.assertEqual(c.attend(randn(26, 1, 2, 4)).output.shape, (1, 2, 4))
            self.assertTrue(c.server_info().version)

    def test_a_missing_or_wrong_token_is_unauthenticated_but_health_is_exempt(self):
        with open(self.ca, "rb") as f:
            ca_bytes = f.read()
        for token in (None, "wrong"):
            with attention_client.Client(self.server.target, tls_ca=ca_bytes, token=token) as c:
                self.server.wait_serving(c)
                with self.assertRaises(AttentionError) as e:
                    c.attend(randn(27, 1, 2, 4))
                self.assertEqual(e.exception.code(), grpc.StatusCode.UNAUTHENTICATED)

    def test_plaintext_to_a_tls_server_fails_unavailable(self):
        with attention_client.Client(self.server.target, token="s3cret", timeout=5) as c:
            with self.assertRaises(AttentionError) as e:
                c.health()
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)
            # gRPC says only "Socket closed"; the client says what could be why.
            self.assertIn("Socket closed", e.exception.details())
            self.assertIn("closes plaintext connections: if this one does, pass tls_ca",
                          e.exception.details())

    def test_a_client_an_mtls_server_refuses_is_told_what_could_be_why(self):
        d = self.dir.name
        mtls = Server(flags=["--tls_cert", f"{d}/server.pem", "--tls_key", f"{d}/server.key",
                             "--tls_client_ca", self.ca])
        self.addCleanup(mtls.stop)
        # The server's certificate, signed by the CA but for server use only,
        # is refused as a client's.
        for make in (attention_client.Client, attention_client.aio.Client):
            for cert, hint in ((None, "without one: if this one does, pass tls_cert and tls_key"),
                               ("server", "did not sign: check tls_cert")):
                files = {} if cert is None else {"tls_cert": f"{d}/{cert}.pem",
                                                 "tls_key": f"{d}/{cert}.key"}
                with self.subTest(make.__module__, cert=cert), \
                        self.assertRaises(AttentionError) as e:
                    call_on_new_client(make, mtls.target, lambda c: c.health(), tls_ca=self.ca,
                                       timeout=5, **files)
                self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)
                self.assertIn("Socket closed", e.exception.details())
                self.assertIn(hint, e.exception.details())

    def test_a_server_name_alone_turns_tls_on(self):
        # It was taken for plaintext: the call, token and all, went in the
        # clear to a plaintext server. Now the handshake fails there.
        plaintext = Server(flags=["--auth_token_file", os.path.join(self.dir.name, "token")])
        self.addCleanup(plaintext.stop)
        with attention_client.Client(plaintext.target, token="s3cret", timeout=10) as c:
            plaintext.wait_serving(c)
        for make in (attention_client.Client, attention_client.aio.Client):
            with self.subTest(make.__module__), self.assertRaises(AttentionError) as e:
                call_on_new_client(make, plaintext.target, lambda c: c.server_info(),
                                   token="s3cret", tls_server_name="localhost", timeout=5)
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)

    def test_tls_files_grpc_cannot_use_are_invalid_argument_naming_them(self):
        # gRPC refused them only as "UNAVAILABLE: empty address list".
        d = self.dir.name
        key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
        for args in (["req", "-x509", *key, "-days", "2", "-subj", "/CN=client", "-keyout",
                      "client.key", "-out", "client.pem"],
                     ["req", "-x509", *key, "-days", "2", "-subj", "/CN=other", "-keyout",
                      "other.key", "-out", "other.pem"],
                     ["pkey", "-in", "client.key", "-aes256", "-passout", "pass:x", "-out",
                      "encrypted.key"]):
            subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=30)
        cases = [
            ({"tls_ca": f"{d}/server.key"}, f"tls_ca: {d}/server.key holds no PEM certificate"),
            ({"tls_ca": b"not pem"}, "tls_ca holds no PEM certificate"),
            ({"tls_cert": f"{d}/client.key", "tls_key": f"{d}/client.key"},
             f"tls_cert: {d}/client.key holds no PEM certificate"),
            ({"tls_cert": f"{d}/client.pem", "tls_key": f"{d}/other.key"},
             f"tls_key: {d}/other.key is not the key of the certificate in tls_cert: "
             f"{d}/client.pem"),
            ({"tls_cert": f"{d}/client.pem", "tls_key": f"{d}/encrypted.key"},
             f"tls_key: {d}/encrypted.key is encrypted"),
            ({"tls_cert": f"{d}/client.pem", "tls_key": f"{d}/client.pem"},
             f"tls_key: {d}/client.pem holds no unencrypted PEM private key"),
        ]
        for make in (attention_client.Client, attention_client.aio.Client):
            for kwargs, text in cases:
                with self.subTest(make.__module__, **{k: str(v) for k, v in kwargs.items()}):
                    with self.assertRaises(AttentionError) as e:
                        call_on_new_client(make, self.server.target, lambda c: None,
                                           **{"tls_ca": self.ca, **kwargs})
                    self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
                    self.assertIn(text, e.exception.details())
        with open(f"{d}/client.key", "rb") as f:
            key_bytes = f.read()
        attention_client.Client(self.server.target, tls_ca=self.ca, tls_cert=f"{d}/client.pem",
                                tls_key=key_bytes).close()


if __name__ == "__main__":
    unittest.main()
