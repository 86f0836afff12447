"""attention_client.aio.Client against a real server: 32 concurrent calls,
streams, sessions (unary and on a stream) and errors; and a session's stream
against a stand-in server that ends, refuses or never answers its streams."""
import asyncio
import functools
import inspect
import sys
import unittest
import unittest.mock

import grpc
import numpy as np
import torch

import attention_client
from attention_client import aio
from attention_client._proto.attention.v1 import attention_pb2, service_pb2
from reference import attention
from server_fixture import Server


def setUpModule():
    global server, runner
    runner = asyncio.Runner(debug=True)
    server = Server()
    with attention_client.Client(server.target) as c:
        server.wait_serving(c)


def tearDownModule():
    runner.close()
    server.stop()


class OneLoopTestCase(unittest.TestCase):
    """Runs each async test, between its asyncSetUp and asyncTearDown, on the
    module's one event loop (in debug mode, as IsolatedAsyncioTestCase). With
    a loop per test, grpc.aio delivered a call's late completions (a stand-in
    server's calls cut by its stop) to the loop the call began on, closed by
    then, and each was logged as "RuntimeError: Event loop is closed" during
    a later test."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name, test in list(vars(cls).items()):
            if name.startswith("test") and inspect.iscoroutinefunction(test):
                setattr(cls, name, cls._on_the_loop(test))

    @staticmethod
    def _on_the_loop(test):
        @functools.wraps(test)
        def run(self):
            async def whole():
                await self.asyncSetUp()
                try:
                    await test(self)
                finally:
                    await self.asyncTearDown()

            runner.run(whole())

        return run

    async def asyncSetUp(self):
        pass

    async def asyncTearDown(self):
        pass


def not_open(sid):
    """The server's NOT_FOUND message for a session it does not have
    (server/session_store.cc)."""
    return (f'session "{sid}" is not open (unknown, closed, expired or evicted); create it '
            "again with its rows")


# How the stand-in's streams end unanswered, with the details gRPC gives when a
# replica is killed or drains.
ENDINGS = {"unavailable": "replica draining", "unknown": "No status received",
           "cancelled": "Received RST_STREAM", "internal": "stream terminated"}


def randn(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


class AioTest(OneLoopTestCase):
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

    async def test_a_request_refused_before_sending_ends_the_stream_with_its_error(self):
        q = randn(51, 1, 2, 4)

        async def requests():
            yield {"query": q, "id": "a"}
            yield {"query": np.zeros((1, 2, 4), np.uint8)}
            yield {"query": q, "id": "c"}

        for label, source, text in [
                ("async", requests(), "requests[1]: query: numpy dtype uint8"),
                ("iterable", [{"query": q, "id": "a"}, {"query": q, "heads": 2}],
                 "requests[1]: unknown field(s) heads")]:
            answers = []
            with self.subTest(label), self.assertRaises(attention_client.AttentionError) as e:
                async for answer in self.client.attend_stream(source):
                    answers.append(answer)
            self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn(text, e.exception.details())
            self.assertEqual([a.id for a in answers], ["a"])
            np.testing.assert_allclose(answers[0].output, attention(q, q, q), rtol=1e-5,
                                       atol=1e-6)

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

    async def test_a_session_whose_id_is_not_ascii(self):
        rows = randn(64, 1, 2, 3, 8)
        session = self.client.session("café 1%", causal="bottom_right", stream=True,
                                      keep_rows=True)
        await session.step(rows[:, :, :2])
        self.assertEqual((await self.client.get_session("café 1%")).position, 2)
        await self.client.close_sessions(["café 1%"])
        answer = await session.step(rows[:, :, 2:])  # NOT_FOUND naming it: recreated
        self.assertEqual((session.recreations, session.position), (1, 3))
        np.testing.assert_allclose(answer.output, attention(rows[:, :, 2:], rows, rows, True),
                                   rtol=1e-5, atol=1e-6)
        await session.close()
        self.assertEqual(list((await self.client.close_sessions(["café 1%"])).not_found),
                         ["café 1%"])

    async def test_a_session_another_client_opened_is_never_taken_over(self):
        # As client_test's: B's first step of A's session's id fails with its
        # outcome unknown (here before it is sent); B's close() leaves A's
        # session open, and B's steps are ALREADY_EXISTS, appending nothing.
        rows = randn(65, 1, 2, 4, 8)
        a = self.client.session("aio-shared", causal="bottom_right")
        await a.step(rows[:, :, :2])
        last = (await self.client.get_session("aio-shared")).last_step_id
        async with aio.Client(server.target, timeout=60) as c:
            real, sent = c._attend, []

            async def attend(request, **kw):
                sent.append(request)
                if len(sent) <= 2:
                    raise attention_client.AttentionError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                                          "never sent")
                return await real(request, **kw)
            c._attend = attend
            for closes in (True, False):
                b = c.session("aio-shared", causal="bottom_right")
                with self.assertRaises(attention_client.AttentionError) as e:
                    await b.step(rows[:, :, 2:3])
                self.assertEqual(e.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
                if closes:
                    await b.close()
                    continue
                for _ in range(2):
                    with self.assertRaises(attention_client.AttentionError) as e:
                        await b.step(rows[:, :, 2:3])
                    self.assertEqual(e.exception.code(), grpc.StatusCode.ALREADY_EXISTS)
                await b.close()
        info = await self.client.get_session("aio-shared")
        self.assertEqual((info.position, info.last_step_id), (2, last))
        self.assertEqual((await a.step(rows[:, :, 2:3])).session_positions, [3])
        await a.close()

    async def test_calls_after_close_are_failed_precondition(self):
        closed = aio.Client(server.target)
        sessions = [closed.session(num_heads=1), closed.session(num_heads=1, stream=True)]
        await closed.close()
        calls = [closed.attend(randn(71, 1, 2, 4)), closed.health(),
                 *(s.step(randn(71, 1, 2, 4)) for s in sessions)]
        for call in calls:
            with self.assertRaises(attention_client.AttentionError) as e:
                await call
            self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("the client is closed", e.exception.details())
        with self.assertRaises(attention_client.AttentionError) as e:
            await self.client.attend(randn(71, 1, 2, 4), num_heads="x")
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)

    async def test_info_models_health_and_errors(self):
        self.assertEqual(await self.client.health(), "SERVING")
        self.assertTrue((await self.client.server_info()).version)
        self.assertIn("demo", [m.name for m in await self.client.models()])
        self.assertEqual((await self.client.model("demo")).num_heads, 4)
        with self.assertRaises(attention_client.AttentionError) as e:
            await self.client.attend(randn(70, 1, 2, 64), model="nope")
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
        self.assertIn('model: "nope"', str(e.exception))


class StreamSessionTest(OneLoopTestCase):
    """A session's stream against a stand-in AttendStream: `behave(stream,
    message)` (both counted from 1) says what each message gets: "answer"
    (its query as output, position + rows), "end" (the stream ends OK
    unanswered), "unavailable", "unknown", "cancelled" or "internal" (ends
    so, unanswered; "slow unavailable" after 0.2 s, "applied unknown" once
    the message is applied), "hang" (never answered), "late" (applied, then
    held unanswered until the caller gives up, setting `late_applied`
    once applied), "deadline" (DEADLINE_EXCEEDED, "applied deadline"
    once applied: an answer lost) or "no model" (NOT_FOUND naming the model,
    not the session). The stand-in holds each session's position and key
    rows as the server does: a message at another position is answered
    ABORTED, an applied one appends its rows, a read_only one appends
    nothing (its answer: the query, and the position); GetSession reports
    the position and the step_id of the last message that appended
    (idle_ms 0 while a "late" message holds the session, setting
    `asked_busy`), CloseSessions closes those it holds, and unary Attend is "answer",
    "late", "deadline", "applied deadline", "applied unavailable" (an answer
    lost with the connection: gRPC sends the call again) or "no model" by
    `behave(0, n)`. With refuse_open_creates, a create of a session it holds
    is ALREADY_EXISTS, as the server answers it. NOT_FOUND messages are the
    server's."""

    async def asyncSetUp(self):
        self.streams = []  # per stream: (metadata, [requests])
        self.unary = []  # unary Attend requests
        self.behave = lambda stream, message: "answer"
        self.held = {}  # session id -> position
        self.rows = {}  # session id -> its key rows, [1, position, E]
        self.last_step = {}  # session id -> the step_id of the last message that appended
        self.busy = set()
        self.asked_busy = asyncio.Event()
        self.get_session_refusal = None  # GetSession's NOT_FOUND message, when set
        self.refuse_open_creates = False
        self.late_applied = asyncio.Event()

        async def apply(request, what):
            """The response's bytes to `request` after `what`, or None."""
            sid, position = request.session.ids[0], request.session.positions[0]
            if what == "no model":
                return attention_pb2.AttendResponse(status=attention_pb2.Status(
                    code=grpc.StatusCode.NOT_FOUND.value[0],
                    message='model: "x" is not registered (ListModels shows what is)')
                ).SerializeToString()
            if self.refuse_open_creates and request.session.create and sid in self.held:
                return attention_pb2.AttendResponse(status=attention_pb2.Status(
                    code=grpc.StatusCode.ALREADY_EXISTS.value[0],
                    message=f'session "{sid}" is already open (position {self.held[sid]}); '
                            "continue it, or close it first")).SerializeToString()
            if sid not in self.held and not request.session.create:
                return attention_pb2.AttendResponse(status=attention_pb2.Status(
                    code=grpc.StatusCode.NOT_FOUND.value[0],
                    message=not_open(sid))).SerializeToString()
            if self.held.get(sid, 0) != position:
                return attention_pb2.AttendResponse(status=attention_pb2.Status(
                    code=grpc.StatusCode.ABORTED.value[0],
                    message=f"session {sid} holds {self.held.get(sid, 0)} rows, not "
                            f"{position}")).SerializeToString()
            deadline = attention_pb2.AttendResponse(status=attention_pb2.Status(
                code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0],
                message="Deadline Exceeded")).SerializeToString()
            if what == "deadline":
                return deadline
            if request.session.read_only:
                return attention_pb2.AttendResponse(
                    output=request.query, session_positions=[position]).SerializeToString()
            rows = request.key if request.HasField("key") else request.query
            self.held[sid] = position + rows.shape[1]
            self.last_step[sid] = request.session.step_id
            rows = np.frombuffer(rows.data, np.float32).reshape(rows.shape)
            self.rows[sid] = rows if request.session.create else np.concatenate(
                [self.rows[sid], rows], axis=1)
            if what == "applied deadline":
                return deadline
            if what == "late":
                self.busy.add(sid)
                self.late_applied.set()
                try:
                    await asyncio.sleep(60)  # the caller cancels it first
                finally:  # also when the call is cancelled
                    self.busy.discard(sid)
            return attention_pb2.AttendResponse(
                output=request.query, session_positions=[self.held[sid]]).SerializeToString()

        async def attend_stream(requests, context):
            seen = []
            self.streams.append((dict(context.invocation_metadata()), seen))
            stream = len(self.streams)
            async for raw in requests:
                seen.append(attention_pb2.AttendRequest.FromString(raw))
                what = self.behave(stream, len(seen))
                if what == "end":
                    return
                if what == "slow unavailable":
                    await asyncio.sleep(0.2)
                    what = "unavailable"
                if what == "applied unknown":
                    await apply(seen[-1], "answer")
                    what = "unknown"
                if what in ENDINGS:
                    await context.abort(grpc.StatusCode[what.upper()], ENDINGS[what])
                if what == "hang":
                    await asyncio.sleep(3600)
                yield await apply(seen[-1], what)

        async def attend(raw, context):
            self.unary.append(attention_pb2.AttendRequest.FromString(raw))
            what = self.behave(0, len(self.unary))
            if what == "applied unavailable":
                await apply(self.unary[-1], "answer")
                await context.abort(grpc.StatusCode.UNAVAILABLE, "connection lost")
            answer = attention_pb2.AttendResponse.FromString(await apply(self.unary[-1], what))
            if answer.status.code:
                await context.abort(attention_client._errors.code_of(answer.status.code),
                                    answer.status.message)
            return answer.SerializeToString()

        async def get_session(raw, context):
            sid = service_pb2.GetSessionRequest.FromString(raw).id
            if self.get_session_refusal:
                await context.abort(grpc.StatusCode.NOT_FOUND, self.get_session_refusal)
            if sid not in self.held:
                await context.abort(grpc.StatusCode.NOT_FOUND, not_open(sid))
            if sid in self.busy:
                self.asked_busy.set()
            return service_pb2.SessionInfo(
                id=sid, position=self.held[sid], idle_ms=0 if sid in self.busy else 1,
                last_step_id=self.last_step.get(sid, "")).SerializeToString()

        async def close_sessions(raw, context):
            ids = list(service_pb2.CloseSessionsRequest.FromString(raw).ids)
            self.closed.append((dict(context.invocation_metadata()).get("attention-affinity"),
                                ids))
            answer = service_pb2.CloseSessionsResponse()
            for sid in dict.fromkeys(ids):
                (answer.closed if self.held.pop(sid, None) is not None else
                 answer.not_found).append(sid)
            return answer.SerializeToString()

        self.closed = []  # per CloseSessions: (its affinity, its ids)
        handler = grpc.method_handlers_generic_handler("attention.v1.AttentionService", {
            "AttendStream": grpc.stream_stream_rpc_method_handler(attend_stream),
            "Attend": grpc.unary_unary_rpc_method_handler(attend),
            "GetSession": grpc.unary_unary_rpc_method_handler(get_session),
            "CloseSessions": grpc.unary_unary_rpc_method_handler(close_sessions)})
        self.fake = grpc.aio.server(handlers=[handler])
        port = self.fake.add_insecure_port("127.0.0.1:0")
        await self.fake.start()
        self.target = f"127.0.0.1:{port}"
        self.client = aio.Client(self.target, timeout=10)
        self.session = self.client.session("decoder-9", affinity="user-3", num_heads=1,
                                           stream=True)

    async def asyncTearDown(self):
        await self.client.close()
        await self.fake.stop(None)

    def positions(self):
        return [[r.session.positions[0] for r in seen] for _, seen in self.streams]

    async def test_steps_in_flight_when_the_client_closes_are_cancelled_errors(self):
        # grpc.aio raised its asyncio.CancelledError in the callers' tasks,
        # which no one had cancelled, so they ended cancelled; the blocking
        # client's calls get an AttentionError, and so do these now. A task
        # its caller cancelled still ends cancelled.
        self.behave = lambda stream, message: (
            "late" if stream == 0 else "hang" if message == 2 else "answer")
        await self.session.step(randn(80, 1, 3, 4))
        unary = [self.client.session(f"unary-{i}", num_heads=1) for i in range(2)]
        tasks = [asyncio.create_task(self.session.step(randn(81, 1, 1, 4)))]
        for s in unary:
            self.late_applied.clear()
            tasks.append(asyncio.create_task(s.step(randn(82, 1, 2, 4))))
            await asyncio.wait_for(self.late_applied.wait(), 10)
        while len(self.streams[0][1]) < 2:  # the stream's 2nd message, hanging
            await asyncio.sleep(0.01)
        tasks[-1].cancel()
        await self.client.close()
        for task in tasks[:-1]:
            with self.assertRaises(attention_client.AttentionError) as e:
                await task
            self.assertEqual(e.exception.code(), grpc.StatusCode.CANCELLED)
            self.assertIn("the client was closed during the call", e.exception.details())
            self.assertFalse(task.cancelled())
        with self.assertRaises(asyncio.CancelledError):
            await tasks[-1]
        self.assertTrue(tasks[-1].cancelled())

    async def test_a_stream_ended_unanswered_is_reopened_and_the_step_sent_again(self):
        self.behave = lambda stream, message: "end" if (stream, message) == (1, 2) else "answer"
        await self.session.step(randn(80, 1, 3, 4))
        answer = await self.session.step(randn(81, 1, 1, 4))
        await self.session.step(randn(82, 1, 1, 4))
        self.assertEqual(answer.session_positions, [4])
        self.assertEqual(self.positions(), [[0, 3], [3, 4]])
        self.assertEqual((self.session.position, self.session.streams_opened), (5, 2))
        self.assertEqual({m.get("attention-affinity") for m, _ in self.streams}, {"user-3"})

    async def test_a_stream_ended_unknown_cancelled_or_internal_sends_the_step_again(self):
        # As a replica SIGKILLed ends it: before applying the step, the step
        # sent again is answered...
        for ending in ("unknown", "cancelled", "internal"):
            with self.subTest(ending):
                self.streams = []
                session = self.client.session(f"ended-{ending}", num_heads=1, stream=True)
                self.behave = lambda stream, message: (ending if (stream, message) == (1, 2)
                                                       else "answer")
                await session.step(randn(89, 1, 3, 4))
                answer = await session.step(randn(90, 1, 1, 4))
                self.assertEqual(answer.session_positions, [4])
                self.assertEqual(self.positions(), [[0, 3], [3]])
                self.assertEqual((session.position, session.streams_opened), (4, 2))
        # ... and after: ABORTED, and the next step finds it applied.
        self.streams = []
        session = self.client.session("ended-applied", num_heads=1, stream=True, keep_rows=True)
        self.behave = lambda stream, message: ("applied unknown" if (stream, message) == (1, 2)
                                               else "answer")
        await session.step(randn(91, 1, 3, 4))
        with self.assertRaises(attention_client.AttentionError) as e:
            await session.step(randn(92, 1, 1, 4))
        self.assertEqual(e.exception.code(), grpc.StatusCode.ABORTED)
        self.assertEqual((self.held["ended-applied"], session.position), (4, 3))
        answer = await session.step(randn(93, 1, 1, 4))
        self.assertEqual(answer.session_positions, [5])
        self.assertEqual(self.positions(), [[0, 3], [3, 4]])
        self.assertEqual((session.position, session.kept_bytes), (5, 2 * 5 * 4 * 4))

    async def test_a_not_found_that_does_not_name_the_session_is_not_recreated(self):
        with attention_client.Client(self.target, timeout=10) as blocking:
            for label, stream in (("aio", False), ("aio", True), ("blocking", False)):
                with self.subTest(label, stream=stream):
                    self.unary, self.streams = [], []
                    sid = f"no-model-{label}-{stream}"
                    if label == "aio":
                        session = self.client.session(sid, num_heads=1, keep_rows=True,
                                                      stream=stream)
                        step = session.step
                    else:
                        session = blocking.session(sid, num_heads=1, keep_rows=True)
                        step = lambda *args: asyncio.to_thread(session.step, *args)
                    sent = lambda: len(self.unary) + sum(len(seen) for _, seen in self.streams)
                    self.behave = lambda st, message: "no model" if message == 2 else "answer"
                    await step(randn(94, 1, 2, 4))
                    with self.assertRaises(attention_client.AttentionError) as e:
                        await step(randn(95, 1, 1, 4))
                    self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
                    self.assertIn('model: "x" is not registered', e.exception.details())
                    self.assertEqual((sent(), session.recreations, session.position), (2, 0, 2))
                    # The server's NOT_FOUND for the session itself: recreated.
                    del self.held[sid]
                    answer = await step(randn(96, 1, 1, 4))
                    self.assertEqual((sent(), session.recreations, answer.session_positions),
                                     (4, 1, [3]))

    async def test_close_sessions_sends_each_id_with_its_own_affinity(self):
        with attention_client.Client(self.target, timeout=10) as blocking:
            for label, close in (
                    ("aio", self.client.close_sessions),
                    ("blocking",
                     lambda *args, **kw: asyncio.to_thread(blocking.close_sessions, *args, **kw))):
                with self.subTest(label):
                    self.held, self.closed = {"a": 1, "b": 2, "c": 3}, []
                    answer = await close(["c", "x", "a", "c"])
                    self.assertEqual(sorted(self.closed),
                                     [("a", ["a"]), ("c", ["c"]), ("x", ["x"])])
                    self.assertEqual((list(answer.closed), list(answer.not_found)),
                                     (["c", "a"], ["x"]))
                    self.assertEqual(self.held, {"b": 2})
                    # With an affinity: one call, as the caller groups them.
                    self.closed = []
                    answer = await close(["b", "y"], affinity="user-3")
                    self.assertEqual(self.closed, [("user-3", ["b", "y"])])
                    self.assertEqual((list(answer.closed), list(answer.not_found)),
                                     (["b"], ["y"]))

    async def test_a_non_ascii_id_goes_percent_encoded_in_the_affinity_header(self):
        session = self.client.session("café 1%", num_heads=1, stream=True)
        await session.step(randn(97, 1, 2, 4))
        await self.client.close_sessions(["café 1%", "x"])
        self.assertEqual([m.get("attention-affinity") for m, _ in self.streams],
                         ["caf%C3%A9%201%25"])
        self.assertIn(("caf%C3%A9%201%25", ["café 1%"]), self.closed)

    async def test_a_step_is_sent_at_most_four_times(self):
        self.behave = lambda stream, message: "unavailable"
        with self.assertRaises(attention_client.AttentionError) as e:
            await self.session.step(randn(83, 1, 2, 4))
        self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertIn("replica draining", e.exception.details())
        self.assertEqual(self.positions(), [[0]] * 4)
        self.assertEqual((self.session.position, self.session.open), (0, False))

    async def test_the_attempts_of_a_step_share_its_timeout(self):
        # Each attempt ends UNAVAILABLE no sooner than 0.2 s after it began. What
        # each attempt may wait is read where the session bounds it, so this
        # holds however late the machine runs it.
        self.behave = lambda stream, message: "slow unavailable"
        waits, pauses = [], []  # per attempt: the time it was given; the pause after it
        wait_for, sleep = asyncio.wait_for, asyncio.sleep

        def waiting(awaitable, timeout):
            if getattr(awaitable, "__qualname__", "").endswith("write_and_read"):
                waits.append(timeout)
            return wait_for(awaitable, timeout)

        def pausing(delay):
            if sys._getframe(1).f_globals["__name__"] == aio.__name__:
                pauses.append(delay)
            return sleep(delay)

        with unittest.mock.patch.object(aio.asyncio, "wait_for", waiting), \
                unittest.mock.patch.object(aio.asyncio, "sleep", pausing):
            with self.assertRaises(attention_client.AttentionError) as e:
                await self.session.step(randn(88, 1, 2, 4), timeout=0.5)
        self.assertEqual(e.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertIn("within 0.5 s", e.exception.details())
        self.assertEqual(len(waits), len(self.streams))
        self.assertIn(len(waits), (1, 2, 3))  # not 4 attempts of 0.2 s and their waits
        self.assertLessEqual(waits[0], 0.5)
        for i, pause in enumerate(pauses):  # each within what the attempts before left
            self.assertLessEqual(pause, waits[i] - 0.2)
            if i + 1 < len(waits):
                self.assertLessEqual(waits[i + 1], waits[i] - 0.2 - pause)

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

    async def check_resynced(self, session, rows, step, keep_rows):
        """`rows` [1, 4, 4] went in as steps of 2 and 1 rows and then `step`
        (the 3rd) raised after the stand-in applied it: the next step goes on
        where the stand-in is, and with keep_rows a lost session is recreated
        from every row it held."""
        self.assertEqual(session.position, 2)
        answer = await step(rows[:, 3:4])
        self.assertEqual((answer.session_positions, session.position), ([4], 4))
        self.assertEqual(self.held[session.id], 4)
        if keep_rows:
            self.assertEqual(session.kept_bytes, 2 * 4 * 4 * 4)
            del self.held[session.id]  # lost: NOT_FOUND, recreated
            more = randn(99, 1, 1, 4)
            answer = await step(more)
            self.assertEqual((answer.session_positions, session.recreations), ([5], 1))
            sent = self.unary[-1] if self.unary else self.streams[-1][1][-1]
            self.assertTrue(sent.session.create)
            np.testing.assert_array_equal(
                np.frombuffer(sent.key.data, np.float32).reshape(sent.key.shape),
                np.concatenate([rows, more], axis=1))

    async def cancel_once_applied(self, step):
        """Runs the coroutine `step`, a "late" one, and cancels it once the
        stand-in has applied it (as asyncio.wait_for would past its timeout),
        then waits until the stand-in no longer holds it."""
        self.late_applied.clear()
        task = asyncio.ensure_future(step)
        await asyncio.wait_for(self.late_applied.wait(), 30)
        task.cancel()
        with self.assertRaises(asyncio.CancelledError):
            await task
        for _ in range(3000):
            if not self.busy:
                break
            await asyncio.sleep(0.01)

    async def test_a_cancelled_step_the_server_applied_is_resynced(self):
        # Unary steps and steps on a stream; the task cancelled (wait_for) or
        # the step past its own timeout, after the stand-in applied it.
        for stream, keep_rows, cancel in [(False, False, True), (False, True, True),
                                          (True, True, False), (True, False, True)]:
            with self.subTest(stream=stream, keep_rows=keep_rows, cancel=cancel):
                self.unary, self.streams = [], []
                session = self.client.session(f"s-{stream}-{keep_rows}", num_heads=1,
                                              stream=stream, keep_rows=keep_rows)
                late = 2 if stream else len(self.unary) + 2
                self.behave = lambda st, message: "late" if message == late else "answer"
                rows = randn(98, 1, 4, 4)
                await session.step(rows[:, :2])
                if cancel:
                    await self.cancel_once_applied(session.step(rows[:, 2:3]))
                else:  # the stand-in applies it within 1 s, then holds it
                    with self.assertRaises(attention_client.AttentionError) as e:
                        await session.step(rows[:, 2:3], timeout=1)
                    self.assertEqual(e.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
                self.assertEqual(self.held[session.id], 3)  # applied all the same
                await self.check_resynced(session, rows, session.step, keep_rows)
                await session.close()

    async def test_a_blocking_step_past_its_timeout_the_server_applied_is_resynced(self):
        for keep_rows in (False, True):
            with self.subTest(keep_rows=keep_rows), attention_client.Client(self.target,
                                                                             timeout=10) as c:
                self.unary = []
                self.behave = lambda st, message: "late" if message == 2 else "answer"
                session = c.session(f"blocking-{keep_rows}", num_heads=1, keep_rows=keep_rows)
                step = lambda *args, **kw: asyncio.to_thread(session.step, *args, **kw)
                rows = randn(97, 1, 4, 4)
                await step(rows[:, :2])
                with self.assertRaises(attention_client.AttentionError) as e:
                    await step(rows[:, 2:3], timeout=1)  # applied within it, then held
                self.assertEqual(self.held[session.id], 3)
                self.assertEqual(e.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
                await self.check_resynced(session, rows, step, keep_rows)
                await asyncio.to_thread(session.close)

    async def test_a_resync_answered_a_not_found_not_naming_the_session_raises_it(self):
        session = self.client.session("resync-other", num_heads=1, keep_rows=True)
        self.behave = lambda st, message: "late" if message == 2 else "answer"
        rows = randn(95, 1, 4, 4)
        await session.step(rows[:, :2])
        await self.cancel_once_applied(session.step(rows[:, 2:3]))
        # Not the server's "no such session" (which would settle the step as
        # not applied): raised, nothing sent, asked again at the next step.
        self.get_session_refusal = "no route to attention.v1.AttentionService"
        with self.assertRaises(attention_client.AttentionError) as e:
            await session.step(rows[:, 3:4])
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
        self.assertIn("no route", e.exception.details())
        self.assertEqual(len(self.unary), 2)
        self.get_session_refusal = None
        answer = await session.step(rows[:, 3:4])
        self.assertEqual((answer.session_positions, session.kept_bytes), ([4], 2 * 4 * 4 * 4))

    async def test_kept_rows_that_no_longer_match_the_server_are_refused(self):
        session = self.client.session("diverged", num_heads=1, keep_rows=True)
        self.behave = lambda st, message: "late" if message == 2 else "answer"
        rows = randn(96, 1, 4, 4)
        await session.step(rows[:, :2])
        await self.cancel_once_applied(session.step(rows[:, 2:3]))
        self.held["diverged"] += 5  # another writer's rows
        for _ in range(2):
            with self.assertRaises(attention_client.AttentionError) as e:
                await session.step(rows[:, 3:4])
            self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("the server holds 8 rows, the client 2", e.exception.details())
        self.assertEqual(len(self.unary), 2)  # nothing sent since
        await session.close()
        self.assertEqual(len(self.closed), 1)


    # (client, stream, keep_rows) of each session kind the tests below try.
    KINDS = [("aio", False, False), ("aio", False, True), ("aio", True, False),
             ("aio", True, True), ("blocking", False, False), ("blocking", False, True)]

    def open_session(self, blocking, label, stream, keep_rows, prefix):
        """(session, its step as a coroutine function), with affinity "user-3"."""
        sid = f"{prefix}-{label}-{stream}-{keep_rows}"
        if label == "aio":
            session = self.client.session(sid, affinity="user-3", num_heads=1, stream=stream,
                                          keep_rows=keep_rows)
            return session, session.step
        session = blocking.session(sid, affinity="user-3", num_heads=1, keep_rows=keep_rows)
        return session, lambda *args, **kw: asyncio.to_thread(session.step, *args, **kw)

    def sent(self):
        """Every request the stand-in got, unary and on streams, in order."""
        return self.unary + [r for _, seen in self.streams for r in seen]

    async def test_a_step_applied_but_unanswered_sent_again_appends_once(self):
        # As C++'s Session::Step: the step the resync finds applied, sent
        # again with the same rows, goes read-only; its answer is the lost one.
        with attention_client.Client(self.target, timeout=10) as blocking:
            for kind in self.KINDS:
                with self.subTest(kind):
                    self.unary, self.streams = [], []
                    session, step = self.open_session(blocking, *kind, "retry")
                    # The 2nd message times out unapplied, and sent again, the
                    # 3rd is applied but its answer lost: two unsure steps,
                    # the same rows.
                    self.behave = lambda st, message: {2: "deadline", 3: "applied deadline"}.get(
                        message, "answer")
                    rows = randn(70, 1, 5, 4)
                    await step(rows[:, :2])
                    for _ in range(2):
                        with self.assertRaises(attention_client.AttentionError) as e:
                            await step(rows[:, 2:3])
                        self.assertEqual(e.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
                    self.assertEqual((self.held[session.id], session.position), (3, 2))
                    answer = await step(rows[:, 2:3])  # the caller's retry
                    np.testing.assert_array_equal(answer.output, rows[:, 2:3])
                    self.assertEqual((answer.session_positions, session.position), ([3], 3))
                    retry = self.sent()[-1]
                    self.assertTrue(retry.session.read_only)
                    self.assertFalse(retry.session.create)
                    self.assertEqual(list(retry.session.positions), [3])
                    self.assertFalse(retry.HasField("key") or retry.HasField("value"))
                    np.testing.assert_array_equal(self.rows[session.id], rows[:, :3])
                    # A next step of other rows is appended, and so are the
                    # same rows again once a step came between.
                    for rows_in, held in ((rows[:, 3:4], 4), (rows[:, 3:4], 5)):
                        answer = await step(rows_in)
                        self.assertEqual((answer.session_positions, session.position),
                                         ([held], held))
                        self.assertFalse(self.sent()[-1].session.read_only)
                    np.testing.assert_array_equal(
                        self.rows[session.id], np.concatenate([rows[:, :4], rows[:, 3:4]], axis=1))
                    self.assertEqual(session.kept_bytes, 2 * 5 * 4 * 4 if kind[2] else 0)
                    if kind[2]:  # the kept rows are the server's: a recreation sends them
                        del self.held[session.id]
                        await step(rows[:, 4:5])
                        self.assertEqual(session.recreations, 1)
                        np.testing.assert_array_equal(
                            self.rows[session.id],
                            np.concatenate([rows[:, :4], rows[:, 3:5]], axis=1))

    async def test_a_retry_of_a_session_lost_since_recreates_it_with_the_step_once(self):
        # As C++'s Session::Step: the retry of the step the resync found
        # applied, answered NOT_FOUND (the session lost meanwhile), recreates
        # it from the kept rows, which hold the step's; without them it is
        # NOT_FOUND and appends nothing.
        with attention_client.Client(self.target, timeout=10) as blocking:
            for kind in self.KINDS:
                with self.subTest(kind):
                    self.unary, self.streams = [], []
                    session, step = self.open_session(blocking, *kind, "retry-lost")

                    def behave(stream, message, sid=session.id):
                        if message == 3:  # the read-only retry: the session is gone
                            self.held.pop(sid, None)
                        return "applied deadline" if message == 2 else "answer"
                    self.behave = behave
                    rows = randn(71, 1, 5, 4)
                    await step(rows[:, :2])
                    with self.assertRaises(attention_client.AttentionError) as e:
                        await step(rows[:, 2:3])
                    self.assertEqual(e.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
                    if not kind[2]:
                        with self.assertRaises(attention_client.AttentionError) as e:
                            await step(rows[:, 2:3])
                        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
                        self.assertNotIn(session.id, self.held)
                        continue
                    answer = await step(rows[:, 2:3])  # the caller's retry
                    np.testing.assert_array_equal(answer.output, rows[:, 2:3])
                    self.assertEqual((answer.session_positions, session.position), ([3], 3))
                    self.assertEqual(session.recreations, 1)
                    retry, recreation = self.sent()[-2:]
                    self.assertTrue(retry.session.read_only)
                    self.assertTrue(recreation.session.create)
                    self.assertFalse(recreation.session.read_only)
                    np.testing.assert_array_equal(self.rows[session.id], rows[:, :3])
                    answer = await step(rows[:, 3:4])  # and a next step is one again
                    self.assertEqual((answer.session_positions, session.position), ([4], 4))
                    np.testing.assert_array_equal(self.rows[session.id], rows[:, :4])

    async def test_a_step_applied_but_unanswered_then_other_rows_are_appended(self):
        with attention_client.Client(self.target, timeout=10) as blocking:
            for kind in self.KINDS:
                with self.subTest(kind):
                    self.unary, self.streams = [], []
                    session, step = self.open_session(blocking, *kind, "other")
                    self.behave = lambda st, message: ("applied deadline" if message == 2
                                                       else "answer")
                    rows = randn(71, 1, 4, 4)
                    await step(rows[:, :2])
                    with self.assertRaises(attention_client.AttentionError):
                        await step(rows[:, 2:3])
                    answer = await step(rows[:, 3:4])
                    self.assertEqual((answer.session_positions, session.position), ([4], 4))
                    self.assertFalse(self.sent()[-1].session.read_only)
                    # The applied step is forgotten once another was sent.
                    answer = await step(rows[:, 2:3])
                    self.assertEqual((answer.session_positions, session.position), ([5], 5))
                    np.testing.assert_array_equal(
                        self.rows[session.id],
                        np.concatenate([rows[:, :3], rows[:, 3:4], rows[:, 2:3]], axis=1))

    async def test_a_step_resent_on_a_new_stream_after_it_was_applied_is_retried_read_only(self):
        # Its stream ends (UNKNOWN) once the step is applied; sent again on a
        # new stream it is ABORTED; the caller's retry is answered read-only.
        session = self.client.session("resent", num_heads=1, stream=True, keep_rows=True)
        self.behave = lambda stream, message: ("applied unknown" if (stream, message) == (1, 2)
                                               else "answer")
        rows = randn(72, 1, 3, 4)
        await session.step(rows[:, :2])
        with self.assertRaises(attention_client.AttentionError) as e:
            await session.step(rows[:, 2:3])
        self.assertEqual(e.exception.code(), grpc.StatusCode.ABORTED)
        answer = await session.step(rows[:, 2:3])
        np.testing.assert_array_equal(answer.output, rows[:, 2:3])
        self.assertEqual((answer.session_positions, session.position), ([3], 3))
        self.assertEqual(self.positions(), [[0, 2], [2, 3]])
        self.assertTrue(self.streams[-1][1][-1].session.read_only)
        np.testing.assert_array_equal(self.rows["resent"], rows)
        self.assertEqual(session.kept_bytes, 2 * 3 * 4 * 4)

    async def test_a_create_sent_again_after_it_was_applied_is_settled_by_its_retry(self):
        # The first step's create is applied but its answer lost, and it is
        # sent again (unary: gRPC's retry of UNAVAILABLE; stream: on a new
        # stream): refused ALREADY_EXISTS, as the server refuses it, but the
        # session is the step's own, so the step is ABORTED, and the
        # caller's retry is answered read-only.
        self.refuse_open_creates = True
        for stream in (False, True):
            with self.subTest(stream=stream):
                self.unary, self.streams = [], []
                sid = f"resent-create-{stream}"
                session = self.client.session(sid, num_heads=1, stream=stream, keep_rows=True)
                self.behave = lambda st, message: {(0, 1): "applied unavailable",
                                                   (1, 1): "applied unknown"}.get(
                    (st, message), "answer")
                rows = randn(74, 1, 3, 4)
                with self.assertRaises(attention_client.AttentionError) as e:
                    await session.step(rows[:, :2])
                self.assertEqual(e.exception.code(), grpc.StatusCode.ABORTED)
                self.assertIn("it holds this step's 2 rows: an earlier attempt of the step",
                              e.exception.details())
                self.assertEqual(len(self.sent()), 2)  # the create and its resend
                answer = await session.step(rows[:, :2])
                np.testing.assert_array_equal(answer.output, rows[:, :2])
                self.assertEqual((answer.session_positions, session.position), ([2], 2))
                self.assertTrue(self.sent()[-1].session.read_only)
                answer = await session.step(rows[:, 2:3])
                self.assertEqual((answer.session_positions, session.position), ([3], 3))
                np.testing.assert_array_equal(self.rows[sid], rows)

    async def test_a_create_of_an_id_another_client_holds_is_already_exists_every_time(self):
        # Client A's step holds its session when B's first step, of the same
        # id, is refused ALREADY_EXISTS. B cannot tell yet whether the
        # session is its own create's (sent again), so it waits until no
        # request holds it: the session names A's step as its last, so B's
        # step is ALREADY_EXISTS, every time, appending nothing, and B's
        # close() leaves A's session open. (B used to fail ABORTED, "maybe
        # its own", then take the session over at A's position and close it.)
        self.refuse_open_creates = True
        with attention_client.Client(self.target, timeout=10) as blocking:
            for kind in self.KINDS:
                with self.subTest(kind):
                    self.unary, self.streams, self.closed = [], [], []
                    b, b_step = self.open_session(blocking, *kind, "taken")
                    a = self.client.session(b.id, num_heads=1)
                    self.behave = lambda st, message: "late" if (st, message) == (0, 2) else (
                        "answer")
                    rows, other = randn(77, 1, 4, 4), randn(78, 1, 2, 4)
                    await a.step(rows[:, :2])
                    self.late_applied.clear()
                    holding = asyncio.ensure_future(a.step(rows[:, 2:3]))
                    await asyncio.wait_for(self.late_applied.wait(), 30)
                    self.asked_busy.clear()
                    refused = asyncio.ensure_future(b_step(other))
                    await asyncio.wait_for(self.asked_busy.wait(), 30)  # B asked while held
                    holding.cancel()
                    with self.assertRaises(asyncio.CancelledError):
                        await holding
                    for attempt in range(2):
                        with self.assertRaises(attention_client.AttentionError) as e:
                            await (refused if attempt == 0 else b_step(other))
                        self.assertEqual(e.exception.code(), grpc.StatusCode.ALREADY_EXISTS)
                        self.assertIn(f'session "{b.id}" is already open (position 3)',
                                      e.exception.details())
                    self.assertEqual((b.position, b.open), (0, False))
                    if kind[0] == "aio":
                        await b.close()
                    else:
                        await asyncio.to_thread(b.close)
                    self.assertEqual(self.closed, [])
                    # A's session is A's: its cancelled step found applied, then on.
                    self.assertEqual((await a.step(rows[:, 2:3])).session_positions, [3])
                    self.assertEqual((await a.step(rows[:, 3:4])).session_positions, [4])
                    np.testing.assert_array_equal(self.rows[b.id], rows)
                    await a.close()

    async def test_a_retrys_recreation_sent_again_after_it_was_applied_is_settled_by_the_next(
            self):
        # The step found applied is retried read-only, but the session is gone
        # (NOT_FOUND), so the retry recreates it from the kept rows; that
        # create is applied, its answer lost, and sent again (as in the test
        # above): ALREADY_EXISTS, but the session is the retry's own, so the
        # retry is ABORTED and the next one is answered read-only.
        self.refuse_open_creates = True
        for stream in (False, True):
            with self.subTest(stream=stream):
                self.unary, self.streams = [], []
                sid = f"resent-recreation-{stream}"
                session = self.client.session(sid, num_heads=1, stream=stream, keep_rows=True)

                def behave(st, message, sid=sid):
                    if (st, message) in ((0, 3), (1, 3)):  # the read-only retry
                        self.held.pop(sid, None)
                    return {(0, 2): "applied deadline", (1, 2): "applied deadline",
                            (0, 4): "applied unavailable", (1, 4): "applied unknown"}.get(
                        (st, message), "answer")
                self.behave = behave
                rows = randn(76, 1, 4, 4)
                await session.step(rows[:, :2])
                with self.assertRaises(attention_client.AttentionError) as e:
                    await session.step(rows[:, 2:3])
                self.assertEqual(e.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
                with self.assertRaises(attention_client.AttentionError) as e:
                    await session.step(rows[:, 2:3])
                self.assertEqual(e.exception.code(), grpc.StatusCode.ABORTED)
                self.assertIn("it holds this step's 3 rows", e.exception.details())
                retry, recreation, resent = self.sent()[2:]
                self.assertEqual((retry.session.read_only, recreation.session.create,
                                  resent.session.create), (True, True, True))
                answer = await session.step(rows[:, 2:3])
                np.testing.assert_array_equal(answer.output, rows[:, 2:3])
                self.assertEqual((answer.session_positions, session.position), ([3], 3))
                self.assertTrue(self.sent()[-1].session.read_only)
                answer = await session.step(rows[:, 3:4])
                self.assertEqual((answer.session_positions, session.position), ([4], 4))
                np.testing.assert_array_equal(self.rows[sid], rows)

    async def test_an_aborted_retry_is_settled_by_the_next_step(self):
        # The step found applied is retried read-only, but by then the copy
        # the stand-in holds is stale (one row where three were): ABORTED,
        # and the next step closes the copy and recreates the session from
        # the kept rows, the step's among them.
        for stream in (False, True):
            with self.subTest(stream=stream):
                self.unary, self.streams, self.closed = [], [], []
                sid = f"aborted-retry-{stream}"
                session = self.client.session(sid, num_heads=1, stream=stream, keep_rows=True)

                def behave(st, message, sid=sid):
                    if message == 3:  # the read-only retry
                        self.held[sid] = 1
                        self.rows[sid] = self.rows[sid][:, :1]
                    return "applied deadline" if message == 2 else "answer"
                self.behave = behave
                rows = randn(75, 1, 3, 4)
                await session.step(rows[:, :2])
                with self.assertRaises(attention_client.AttentionError) as e:
                    await session.step(rows[:, 2:3])
                self.assertEqual(e.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
                with self.assertRaises(attention_client.AttentionError) as e:
                    await session.step(rows[:, 2:3])
                self.assertEqual(e.exception.code(), grpc.StatusCode.ABORTED)
                self.assertTrue(self.sent()[-1].session.read_only)
                answer = await session.step(rows[:, 2:3])
                np.testing.assert_array_equal(answer.output, rows[:, 2:3])
                self.assertEqual(
                    (answer.session_positions, session.position, session.recreations),
                    ([3], 3, 1))
                self.assertEqual(self.closed[-1][1], [sid])
                np.testing.assert_array_equal(self.rows[sid], rows)

    async def test_a_stale_copy_is_closed_and_recreated_with_kept_rows_else_refused(self):
        # The session moved to another replica and back: this one still holds
        # its old copy, fewer rows than the answered steps put there.
        with attention_client.Client(self.target, timeout=10) as blocking:
            for kind in self.KINDS:
                with self.subTest(kind):
                    self.unary, self.streams, self.closed = [], [], []
                    session, step = self.open_session(blocking, *kind, "stale")
                    rows = randn(73, 1, 5, 4)
                    await step(rows[:, :2])
                    await step(rows[:, 2:3])
                    self.held[session.id] = 2
                    self.rows[session.id] = self.rows[session.id][:, :2]
                    with self.assertRaises(attention_client.AttentionError) as e:
                        await step(rows[:, 3:4])
                    self.assertEqual(e.exception.code(), grpc.StatusCode.ABORTED)
                    sent = len(self.sent())
                    if not kind[2]:
                        for _ in range(2):
                            with self.assertRaises(attention_client.AttentionError) as e:
                                await step(rows[:, 3:4])
                            self.assertEqual(e.exception.code(),
                                             grpc.StatusCode.FAILED_PRECONDITION)
                            self.assertIn(
                                f"session {session.id}: the server holds 2 rows, fewer than the "
                                "3 answered steps put there: a stale copy",
                                e.exception.details())
                        self.assertEqual((len(self.sent()), self.closed, session.position),
                                         (sent, [], 3))
                        continue
                    answer = await step(rows[:, 3:4])
                    self.assertEqual(self.closed, [("user-3", [session.id])])
                    self.assertEqual((answer.session_positions, session.position,
                                      session.recreations), ([4], 4, 1))
                    # NOT_FOUND at position 3, then the recreation.
                    self.assertEqual([(list(r.session.positions), r.session.create)
                                      for r in self.sent()[sent:]], [([3], False), ([0], True)])
                    np.testing.assert_array_equal(self.rows[session.id], rows[:, :4])
                    answer = await step(rows[:, 4:5])
                    self.assertEqual(answer.session_positions, [5])


if __name__ == "__main__":
    unittest.main()
