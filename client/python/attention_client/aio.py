"""attention_client.aio.Client: attention_client.Client's methods for asyncio.

    async with attention_client.aio.Client("127.0.0.1:50051") as client:
        answer = await client.attend(q, k, v, num_heads=4)
        async for answer in client.attend_stream(requests):
            ...
        session = client.session(model="demo", causal="bottom_right")
        await session.step(prompt)

One Client per event loop (grpc.aio channels belong to the loop they were
made on). Arguments, answers and errors are those of attention_client.Client.
"""
import grpc

from attention_client import _channel, _request, _session, _wire
from attention_client._client import Client as _BlockingClient
from attention_client._errors import AttentionError, from_rpc_error
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

    async def close(self):
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def _call(self, method, request, timeout, affinity=None):
        try:
            return await method(request, timeout=self._settings.call_timeout(timeout),
                                metadata=self._settings.call_metadata(affinity))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def attend(self, query, key=None, value=None, *, timeout=..., **fields):
        """As attention_client.Client.attend."""
        raw, kind = _request.build(query, key, value, fields)
        return _wire.decode(await self._call(self._attend, raw, timeout), kind)

    async def attend_stream(self, requests, *, timeout=..., **fields):
        """As attention_client.Client.attend_stream; `requests` may be an
        iterable or an async iterable of dicts."""
        kinds = {}

        async def encoded():
            if hasattr(requests, "__aiter__"):
                index = 0
                async for item in requests:
                    yield _request.build_stream_item(index, item, fields, kinds)
                    index += 1
            else:
                for index, item in enumerate(requests):
                    yield _request.build_stream_item(index, item, fields, kinds)

        call = self._attend_stream(encoded(), timeout=self._settings.call_timeout(timeout),
                                   metadata=self._settings.metadata)
        try:
            async for raw in call:
                yield _wire.decode_stream(raw, kinds)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()

    def session(self, id=None, *, keep_rows=False, cache_dtype="float32", affinity=None,
                **fields):
        """As attention_client.Client.session; its step() and close() are coroutines."""
        return Session(self, _session.SessionCore(id, keep_rows, cache_dtype, fields, affinity))

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
        ids = list(ids)
        return await self._call(self._stub.CloseSessions,
                                service_pb2.CloseSessionsRequest(ids=ids), timeout,
                                affinity or (ids[0] if ids else None))


class Session(_session.SessionBase):
    """As attention_client.Session, with coroutines step() and close()."""

    async def step(self, query, key=None, value=None, *, timeout=...):
        core = self._core
        step = core.prepare(query, key, value)
        try:
            raw = await self._client._call(self._client._attend, core.request(step), timeout,
                                     core.affinity)
        except grpc.RpcError as e:
            if not core.may_recreate(e):
                raise
            request, base = core.recreation(step)
            answer = _wire.decode(await self._client._call(self._client._attend, request, timeout,
                                                      core.affinity),
                                  step[3])
            core.advance(step, base, answer, recreated=True)
            return answer
        answer = _wire.decode(raw, step[3])
        core.advance(step, core.position, answer)
        return answer

    async def close(self, *, timeout=...):
        if self._core.closed:
            return
        if self._core.created:
            await self._client.close_sessions([self.id], timeout=timeout,
                                              affinity=self._core.affinity)
        self._core.closed = True

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
