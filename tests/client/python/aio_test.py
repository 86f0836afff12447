"""attention_client.aio.Client against a real server: 32 concurrent calls,
streams, sessions and errors."""
import asyncio
import unittest

import grpc
import numpy as np
import torch

import attention_client
from attention_client import aio
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

    async def test_info_models_health_and_errors(self):
        self.assertEqual(await self.client.health(), "SERVING")
        self.assertTrue((await self.client.server_info()).version)
        self.assertIn("demo", [m.name for m in await self.client.models()])
        self.assertEqual((await self.client.model("demo")).num_heads, 4)
        with self.assertRaises(attention_client.AttentionError) as e:
            await self.client.attend(randn(70, 1, 2, 64), model="nope")
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
        self.assertIn('model: "nope"', str(e.exception))


if __name__ == "__main__":
    unittest.main()
