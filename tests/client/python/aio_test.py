"""attention_client.aio.Client against a real server: 32 concurrent calls,
streams, sessions (unary and on a stream) and errors; and a session's stream
against a stand-in server that ends, refuses or never answers its streams."""
import asyncio
import unittest

import grpc
import numpy as np
import torch

import attention_client
from attention_client import aio
from attention_client._proto.attention.v1 import attention_pb2
from reference import attention
from server_fixture import Server


def setUpModule():
    global server
    server = Server()
    with attention_client.Client(server.target) as c:
        server.wait_serving(c)


def tearDownModule():
    server.stop()


def randn(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


class AioTest(unittest.IsolatedAsyncioTestCase):
    async def asyncSetUp(self):
        self.client = aio.Client(server.target, timeout=60)

    async def asyncTearDown(self):
        await self.client.close()

    async def test_32_concurrent_calls_each_get_their_own_answer(self):
        queries = [randn(i, 1, 2, 3 + i % 5, 8) for i in range(32)]
        queries[::2] = [torch.from_numpy(q) for q in queries[::2]]
        answers = await asyncio.gather(*(self.client.attend(q, id=f"c{i}")
                                         for i, q in enumerate(queries)))
        for i, (q, answer) in enumerate(zip(queries, answers)):
            self.assertEqual(answer.id, f"c{i}")
            self.assertIsInstance(answer.output, type(q))
            q = np.asarray(q)
            np.testing.assert_allclose(np.asarray(answer.output), attention(q, q, q), rtol=1e-5,
                                       atol=1e-6)

    async def test_stream_from_an_async_iterable(self):
        async def requests():
            for i in range(4):
                yield {"query": randn(40 + i, 1, 1, 2, 4)}
            yield {"query": randn(50, 1, 2, 4), "valid_lens": np.array([1, 2, 3])}

        answers = [a async for a in self.client.attend_stream(requests(), need_weights=True)]
        by_id = {a.id: a for a in answers}
        self.assertEqual(sorted(by_id), ["0", "1", "2", "3", "4"])
        self.assertEqual(by_id["4"].error.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertEqual(by_id["2"].weights.shape, (1, 1, 2, 2))

    async def test_session_steps_and_recreation(self):
        rows = randn(60, 1, 2, 4, 8)
        session = self.client.session(keep_rows=True, causal="bottom_right")
        await session.step(rows[:, :, :3])
        await self.client.close_sessions([session.id])
        answer = await session.step(rows[:, :, 3:])
        self.assertEqual((session.recreations, session.position), (1, 4))
        np.testing.assert_allclose(answer.output, attention(rows[:, :, 3:], rows, rows, True),
                                   rtol=1e-5, atol=1e-6)
        await session.close()
        with self.assertRaises(attention_client.AttentionError) as e:
            await self.client.get_session(session.id)
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)

    async def test_stream_session_steps_on_one_stream(self):
        rows = randn(61, 1, 2, 6, 8)
        session = self.client.session(causal="bottom_right", stream=True, keep_rows=True)
        answers = [await session.step(rows[:, :, :3])]
        for i in range(3, 6):
            answers.append(await session.step(rows[:, :, i:i + 1]))
        for end, answer in zip((3, 4, 5, 6), answers):
            start = 0 if end == 3 else end - 1
            self.assertIsNone(answer.error)
            self.assertEqual(answer.session_positions, [end])
            np.testing.assert_allclose(
                answer.output, attention(rows[:, :, start:end], rows[:, :, :end],
                                         rows[:, :, :end], True), rtol=1e-5, atol=1e-6)
        # A refused step raises the server's error; the stream goes on.
        with self.assertRaises(attention_client.AttentionError) as e:
            await session.step(randn(62, 1, 2, 1, 4))
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        # A session the server lost is recreated from the kept rows, on the stream.
        await self.client.close_sessions([session.id])
        more = randn(63, 1, 2, 1, 8)
        answer = await session.step(more)
        everything = np.concatenate([rows, more], axis=2)
        np.testing.assert_allclose(answer.output, attention(more, everything, everything, True),
                                   rtol=1e-5, atol=1e-6)
        self.assertEqual((session.position, session.recreations, session.streams_opened),
                         (7, 1, 1))
        await session.close()
        with self.assertRaises(attention_client.AttentionError) as e:
            await self.client.get_session(session.id)
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)

    async def test_info_models_health_and_errors(self):
        self.assertEqual(await self.client.health(), "SERVING")
        self.assertTrue((await self.client.server_info()).version)
        self.assertIn("demo", [m.name for m in await self.client.models()])
        self.assertEqual((await self.client.model("demo")).num_heads, 4)
        with self.assertRaises(attention_client.AttentionError) as e:
            await self.client.attend(randn(70, 1, 2, 64), model="nope")
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
        self.assertIn('model: "nope"', str(e.exception))


class StreamSessionTest(unittest.IsolatedAsyncioTestCase):
    """A session's stream against a stand-in AttendStream: `behave(stream,
    message)` (both counted from 1) says what each message gets: "answer"
    (its query as output, position + rows), "end" (the stream ends OK
    unanswered), "unavailable" (ends UNAVAILABLE) or "hang" (never answered).
    CloseSessions is answered OK."""

    async def asyncSetUp(self):
        self.streams = []  # per stream: (metadata, [requests])
        self.behave = lambda stream, message: "answer"

        async def attend_stream(requests, context):
            seen = []
            self.streams.append((dict(context.invocation_metadata()), seen))
            stream = len(self.streams)
            async for raw in requests:
                seen.append(attention_pb2.AttendRequest.FromString(raw))
                what = self.behave(stream, len(seen))
                if what == "end":
                    return
                if what == "unavailable":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "replica draining")
                if what == "hang":
                    await asyncio.sleep(3600)
                request = seen[-1]
                yield attention_pb2.AttendResponse(
                    output=request.query,
                    session_positions=[request.session.positions[0] +
                                       request.query.shape[1]]).SerializeToString()

        async def close_sessions(raw, context):
            self.closed.append(raw)
            return b""

        self.closed = []  # CloseSessions requests
        handler = grpc.method_handlers_generic_handler("attention.v1.AttentionService", {
            "AttendStream": grpc.stream_stream_rpc_method_handler(attend_stream),
            "CloseSessions": grpc.unary_unary_rpc_method_handler(close_sessions)})
        self.fake = grpc.aio.server(handlers=[handler])
        port = self.fake.add_insecure_port("127.0.0.1:0")
        await self.fake.start()
        self.client = aio.Client(f"127.0.0.1:{port}", timeout=10)
        self.session = self.client.session("decoder-9", affinity="user-3", num_heads=1,
                                           stream=True)

    async def asyncTearDown(self):
        await self.client.close()
        await self.fake.stop(None)

    def positions(self):
        return [[r.session.positions[0] for r in seen] for _, seen in self.streams]

    async def test_a_stream_ended_unanswered_is_reopened_and_the_step_sent_again(self):
        self.behave = lambda stream, message: "end" if (stream, message) == (1, 2) else "answer"
        await self.session.step(randn(80, 1, 3, 4))
        answer = await self.session.step(randn(81, 1, 1, 4))
        await self.session.step(randn(82, 1, 1, 4))
        self.assertEqual(answer.session_positions, [4])
        self.assertEqual(self.positions(), [[0, 3], [3, 4]])
        self.assertEqual((self.session.position, self.session.streams_opened), (5, 2))
        self.assertEqual({m.get("attention-affinity") for m, _ in self.streams}, {"user-3"})

    async def test_a_step_is_sent_at_most_four_times(self):
        self.behave = lambda stream, message: "unavailable"
        with self.assertRaises(attention_client.AttentionError) as e:
            await self.session.step(randn(83, 1, 2, 4))
        self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertIn("replica draining", e.exception.details())
        self.assertEqual(self.positions(), [[0]] * 4)
        self.assertEqual((self.session.position, self.session.open), (0, False))

    async def test_a_step_past_its_timeout_cancels_the_stream(self):
        self.behave = lambda stream, message: "hang" if stream == 1 else "answer"
        with self.assertRaises(attention_client.AttentionError) as e:
            await self.session.step(randn(84, 1, 2, 4), timeout=0.3)
        self.assertEqual(e.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertIn("within 0.3 s", e.exception.details())
        answer = await self.session.step(randn(85, 1, 2, 4))
        self.assertEqual(answer.session_positions, [2])
        self.assertEqual(self.positions(), [[0], [0]])
        await self.session.close()
        self.assertFalse(self.session.open)
        self.assertEqual(len(self.closed), 1)

    async def test_a_step_the_caller_cancels_cancels_the_stream(self):
        self.behave = lambda stream, message: "hang" if stream == 1 else "answer"
        with self.assertRaises(asyncio.TimeoutError):
            await asyncio.wait_for(self.session.step(randn(86, 1, 2, 4)), 0.3)
        answer = await self.session.step(randn(87, 1, 2, 4))
        self.assertEqual(answer.session_positions, [2])
        self.assertEqual(self.session.streams_opened, 2)


if __name__ == "__main__":
    unittest.main()
