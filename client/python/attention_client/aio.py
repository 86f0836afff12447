"""attention_client.aio.Client: attention_client.Client's methods for asyncio.

    async with attention_client.aio.Client("127.0.0.1:50051") as client:
        answer = await client.attend(q, k, v, num_heads=4)
        async for answer in client.attend_stream(requests):
            ...
        session = client.session(model="demo", causal="bottom_right", stream=True)
        await session.step(prompt)

One Client per event loop (grpc.aio channels belong to the loop they were
made on). Arguments, answers and errors are those of attention_client.Client.
"""
import asyncio
import random

import grpc

from attention_client import _channel, _request, _session, _wire
from attention_client._client import Client as _BlockingClient, merge_closed
from attention_client._errors import (AttentionError, closed_client, closed_during_call,
                                      from_rpc_error)
from attention_client._proto.attention.v1 import model_pb2, service_pb2, service_pb2_grpc
from attention_client._wire import Answer

__all__ = ["Answer", "AttentionError", "Client", "Session"]


class Client:
    __doc__ = _BlockingClient.__doc__

    def __init__(self, target, *, token=None, tls_ca=None, timeout=30.0, tls_cert=None,
                 tls_key=None, tls_server_name=None, max_message_mb=256):
        self._settings = _channel.Settings(target, token, tls_ca, tls_cert, tls_key,
                                           tls_server_name, timeout, max_message_mb)
        s = self._settings
        if s.tls:
            self._channel = grpc.aio.secure_channel(target, s.credentials, options=s.options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=s.options)
        self._attend = self._channel.unary_unary(_channel.SERVICE + "Attend")
        self._attend_stream = self._channel.stream_stream(_channel.SERVICE + "AttendStream")
        self._health = self._channel.unary_unary(_channel.HEALTH_CHECK)
        self._stub = service_pb2_grpc.AttentionServiceStub(self._channel)
        self._closed = False
        # Streams open now: closing the channel does not end one whose read
        # waits inside another coroutine (a session step's), so close() does.
        self._streams = set()

    async def close(self):
        self._closed = True
        for call in list(self._streams):
            call.cancel()
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def _call(self, method, request, timeout, affinity=None):
        if self._closed:
            raise closed_client()
        try:
            return await method(request, timeout=self._settings.call_timeout(timeout),
                                metadata=self._settings.call_metadata(affinity))
        except grpc.RpcError as e:
            raise from_rpc_error(e, self._settings) from None
        except asyncio.CancelledError:
            self._raise_if_closed_during_call()
            raise

    def _raise_if_closed_during_call(self):
        """In an `except asyncio.CancelledError`: close() cancels the calls in
        flight, which grpc.aio raises as CancelledError in tasks no one
        cancelled; those get AttentionError CANCELLED, as the blocking client's
        calls do. A cancellation of the caller's own task stays one."""
        task = asyncio.current_task()
        cancelling = getattr(task, "cancelling", None)  # Python 3.11
        if self._closed and cancelling is not None and cancelling() == 0:
            raise closed_during_call() from None

    async def attend(self, query, key=None, value=None, *, timeout=..., **fields):
        """As attention_client.Client.attend."""
        raw, kind = _request.build(query, key, value, fields)
        return _wire.decode(await self._call(self._attend, raw, timeout), kind)

    async def attend_stream(self, requests, *, timeout=..., **fields):
        """As attention_client.Client.attend_stream; `requests` may be an
        iterable or an async iterable of dicts."""
        if self._closed:
            raise closed_client()
        encoded = _request.StreamRequests(requests, fields)
        call = self._attend_stream(encoded.__aiter__(),
                                   timeout=self._settings.call_timeout(timeout),
                                   metadata=self._settings.metadata)
        self._streams.add(call)
        try:
            async for raw in call:
                yield _wire.decode_stream(raw, encoded.kinds)
        except grpc.RpcError as e:
            if encoded.error is not None:
                raise encoded.error from None
            raise from_rpc_error(e, self._settings) from None
        except asyncio.CancelledError:
            self._raise_if_closed_during_call()
            raise
        finally:
            call.cancel()
            self._streams.discard(call)
        if encoded.error is not None:
            raise encoded.error

    def session(self, id=None, *, keep_rows=False, cache_dtype="float32", affinity=None,
                stream=False, **fields):
        """As attention_client.Client.session; its step() and close() are
        coroutines. stream=True sends the steps on one AttendStream (_StepStream)
        instead of a unary Attend each."""
        core = _session.SessionCore(id, keep_rows, cache_dtype, fields, affinity)
        return Session(self, core, _StepStream(self, core.affinity) if stream else None)

    async def server_info(self, *, timeout=...):
        return await self._call(self._stub.GetServerInfo, service_pb2.GetServerInfoRequest(),
                                timeout)

    async def models(self, *, timeout=...):
        return list((await self._call(self._stub.ListModels, model_pb2.ListModelsRequest(),
                                      timeout)).models)

    async def model(self, name, *, timeout=...):
        return (await self._call(self._stub.GetModel, model_pb2.GetModelRequest(name=name),
                                 timeout)).config

    async def health(self, service="", *, timeout=...):
        return _channel.health_status(
            await self._call(self._health, _channel.health_request(service), timeout))

    async def get_session(self, id, *, timeout=..., affinity=None):
        return await self._call(self._stub.GetSession, service_pb2.GetSessionRequest(id=id),
                                timeout, affinity or id)

    async def close_sessions(self, ids, *, timeout=..., affinity=None):
        """As attention_client.Client.close_sessions."""
        ids = list(ids)
        distinct = list(dict.fromkeys(ids))
        if affinity or len(distinct) < 2:
            return await self._call(self._stub.CloseSessions,
                                    service_pb2.CloseSessionsRequest(ids=ids), timeout,
                                    affinity or (ids[0] if ids else None))
        return merge_closed(await asyncio.gather(
            *(self._call(self._stub.CloseSessions, service_pb2.CloseSessionsRequest(ids=[id]),
                         timeout, id) for id in distinct), return_exceptions=True))


# How a session's stream that ended without answering may end for its step to
# be sent again on another: UNAVAILABLE (the server ended it OK, as a draining
# replica does, or the connection failed), and UNKNOWN, CANCELLED or INTERNAL
# not of the client's making (a replica killed: "UNKNOWN: No status
# received", "CANCELLED: Received RST_STREAM").
_RESEND_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN,
                           grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL})


class _Unanswered(Exception):
    """The stream ended without answering: `error`, and whether the step may
    be sent again (_RESEND_CODES)."""

    def __init__(self, error, resend):
        super().__init__(error)
        self.error, self.resend = error, resend


class _StepStream:
    """A session's AttendStream (session(stream=True)): a step is one message
    and its answer, the pair bounded by the step's timeout; the stream itself
    has no deadline. It opens at the first step, and again after one ends. A
    step whose stream ends without answering (_RESEND_CODES) is sent again on
    a new stream, by the channel's retry policy for unary steps
    (_channel.RETRY_ATTEMPTS and the backoffs beside it), all attempts and
    the waits between them within the step's timeout: safe, since a session
    request whose position has passed is ABORTED, never appended twice (the
    next step then asks where the session is: _session). A step past its
    timeout cancels the stream (a late answer would answer the next step)."""

    def __init__(self, client, affinity):
        self._client = client
        self._metadata = client._settings.call_metadata(affinity)
        self._call = None
        self.opened = 0  # streams opened so far

    async def send(self, request, timeout):
        """The answer's bytes to `request`; AttentionError when the stream
        fails. `timeout` bounds every attempt and the waits between them."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        backoff = _channel.RETRY_FIRST_BACKOFF_S
        for attempt in range(1, _channel.RETRY_ATTEMPTS + 1):
            try:
                return await self._exchange(request, deadline, timeout)
            except _Unanswered as e:
                if self._client._closed:
                    raise closed_during_call() from None
                if not e.resend or attempt == _channel.RETRY_ATTEMPTS:
                    raise e.error from None
            pause = random.uniform(0, backoff)
            if deadline is not None:
                pause = max(0.0, min(pause, deadline - loop.time()))
            await asyncio.sleep(pause)
            backoff = min(backoff * _channel.RETRY_BACKOFF_MULTIPLIER,
                          _channel.RETRY_MAX_BACKOFF_S)

    async def _exchange(self, request, deadline, timeout):
        """One attempt, until `deadline` (loop time; None: none) of the step's
        `timeout`."""
        if self._client._closed:
            raise closed_client()
        left = None if deadline is None else deadline - asyncio.get_running_loop().time()
        if left is not None and left <= 0:
            raise AttentionError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no answer on the session's AttendStream within {timeout} s (its attempts "
                "on streams that ended unanswered took it all)")
        if self._call is None:
            self._call = self._client._attend_stream(metadata=self._metadata)
            self._client._streams.add(self._call)
            self.opened += 1
        call = self._call

        async def write_and_read():
            await call.write(request)
            return await call.read()

        try:
            answer = await asyncio.wait_for(write_and_read(), left)
        except asyncio.TimeoutError:
            self.cancel()
            raise AttentionError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no answer on the session's AttendStream within {timeout} s (the stream is "
                "cancelled; the next step opens another)") from None
        except grpc.RpcError as e:  # the stream ended so
            raise self._ended(call, from_rpc_error(e, self._client._settings)) from None
        except asyncio.CancelledError:  # the caller's task: the answer may still come
            self.cancel()
            self._client._raise_if_closed_during_call()
            raise
        except asyncio.InvalidStateError:  # written after the stream ended
            answer = grpc.aio.EOF
        if answer is grpc.aio.EOF:
            code = await call.code()
            if code == grpc.StatusCode.OK:
                error = AttentionError(grpc.StatusCode.UNAVAILABLE,
                                       "the server ended the AttendStream without answering")
            else:
                error = AttentionError(code, await call.details() or "")
            raise self._ended(call, error)
        return answer

    def _ended(self, call, error):
        """`call`, the stream, ended with `error` instead of an answer."""
        mine = call is not self._call  # cancelled here (cancel, close), not by the server
        self.cancel()
        return _Unanswered(error, error.code() in _RESEND_CODES and not mine)

    async def close(self, timeout):
        """Half-closes the stream and waits (up to `timeout`) for the server to end it."""
        call, self._call = self._call, None
        if call is None:
            return
        self._client._streams.discard(call)
        try:
            await asyncio.wait_for(call.done_writing(), timeout)
            await asyncio.wait_for(call.code(), timeout)
        except (asyncio.TimeoutError, grpc.RpcError, asyncio.InvalidStateError):
            pass
        finally:
            call.cancel()

    def cancel(self):
        if self._call is not None:
            self._call.cancel()
            self._client._streams.discard(self._call)
            self._call = None


class Session(_session.SessionBase):
    """As attention_client.Session, with coroutines step() and close(); with
    stream=True its steps share one AttendStream (_StepStream)."""

    def __init__(self, client, core, stream=None):
        super().__init__(client, core)
        self._stream = stream

    @property
    def streams_opened(self):
        """AttendStreams the session has opened (0 without stream=True)."""
        return 0 if self._stream is None else self._stream.opened

    async def _send(self, request, kind, timeout):
        if self._stream is None:
            return _wire.decode(await self._client._call(self._client._attend, request, timeout,
                                                         self._core.affinity), kind)
        answer = _wire.decode(
            await self._stream.send(request, self._client._settings.call_timeout(timeout)), kind)
        if answer.error is not None:
            raise answer.error
        return answer

    async def step(self, query, key=None, value=None, *, timeout=...):
        core = self._core
        step = core.prepare(query, key, value)
        if core.resync_needed:
            await self._resync(timeout)
        if core.retried(step):  # as attention_client.Session.step
            try:
                answer = await self._send(core.request(step, read_only=True), step[3], timeout)
            except grpc.RpcError as e:
                if not core.may_recreate(e):
                    core.retry_failed(e)
                    raise
                try:
                    answer = await self._send(core.recreation(step, applied=True)[0], step[3],
                                              timeout)
                except grpc.RpcError as e:
                    failure = await self._failure(step, e, timeout, applied=True)
                    core.retry_failed(failure)
                    if failure is e:
                        raise
                    raise failure from e
                core.recreations += 1
            core.succeeded()
            return answer
        try:
            try:
                answer = await self._send(core.request(step), step[3], timeout)
                base, recreated = core.position, False
            except grpc.RpcError as e:
                if not core.may_recreate(e):
                    raise
                request, base = core.recreation(step)
                answer = await self._send(request, step[3], timeout)
                recreated = True
        except BaseException as e:  # also a cancelled task's: the server may have applied it
            failure = await self._failure(step, e, timeout)
            core.failed(step, failure)
            if failure is e:
                raise
            raise failure from e
        core.advance(step, base, answer, recreated=recreated)
        core.succeeded()
        return answer

    async def _failure(self, step, error, timeout, applied=False):
        """As attention_client.Session._failure."""
        if not _session.refused_create(error):
            return error
        try:
            info = await self._session_info(timeout)
        except AttentionError:
            info = None
        return self._core.create_refused(step, error, info, applied)

    async def _session_info(self, timeout):
        """As attention_client.Session._session_info."""
        core = self._core
        loop = asyncio.get_running_loop()
        wait = self._client._settings.call_timeout(timeout)
        deadline = None if wait is None else loop.time() + wait
        while True:
            try:
                info = await self._client.get_session(core.id, timeout=timeout,
                                                      affinity=core.affinity)
            except AttentionError as e:
                if not _session.not_found(e, core.id):
                    raise
                return None
            if info.idle_ms != 0 or (deadline is not None and loop.time() >= deadline):
                return info
            await asyncio.sleep(_session.RESYNC_POLL_S)

    async def _resync(self, timeout):
        """As attention_client.Session._resync."""
        core = self._core
        if core.resync(await self._session_info(timeout)):
            # A stale copy: closed, so that the step recreates the session.
            await self._client.close_sessions([core.id], timeout=timeout, affinity=core.affinity)
            core.unsure_settled()

    async def close(self, *, timeout=...):
        """As attention_client.Session.close."""
        core = self._core
        if core.closed:
            return
        if self._stream is not None:
            await self._stream.close(self._client._settings.call_timeout(timeout))
        if not core.created and core.unsure:
            await self._resync(timeout)
        if core.created:
            await self._client.close_sessions([self.id], timeout=timeout, affinity=core.affinity)
        core.closed = True

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
