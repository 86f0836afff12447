"""attention_client.Client: blocking calls."""
import time

import grpc

from attention_client import _channel, _request, _session, _wire
from attention_client._errors import AttentionError, closed_client, from_rpc_error, invalid
from attention_client._proto.attention.v1 import model_pb2, service_pb2, service_pb2_grpc


class Client:
    """A channel to one attention service (target "host:port", or any gRPC
    target such as "dns:///name:port"). Thread-safe; close() or a with block
    ends the channel.

    token: sent as "authorization: Bearer <token>" on every call (a str of
        printable ASCII, as a header carries).
    tls_ca: the CA's PEM (a path or bytes) to verify the server with; TLS is
    used when it or tls_cert / tls_key (a client certificate, for mutual TLS)
    is set; tls_server_name overrides the name checked in its certificate.
    timeout: each call's deadline in seconds (None: none); each method takes
    its own timeout= too. Every failure raises AttentionError."""

    def __init__(self, target, *, token=None, tls_ca=None, timeout=30.0, tls_cert=None,
                 tls_key=None, tls_server_name=None, max_message_mb=256):
        self._settings = _channel.Settings(target, token, tls_ca, tls_cert, tls_key,
                                           tls_server_name, timeout, max_message_mb)
        s = self._settings
        if s.tls:
            self._channel = grpc.secure_channel(target, s.credentials, options=s.options)
        else:
            self._channel = grpc.insecure_channel(target, options=s.options)
        self._attend = self._channel.unary_unary(_channel.SERVICE + "Attend")
        self._attend_stream = self._channel.stream_stream(_channel.SERVICE + "AttendStream")
        self._health = self._channel.unary_unary(_channel.HEALTH_CHECK)
        self._stub = service_pb2_grpc.AttentionServiceStub(self._channel)
        self._closed = False

    def close(self):
        self._closed = True
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method, request, timeout, affinity=None):
        if self._closed:
            raise closed_client()
        try:
            return method(request, timeout=self._settings.call_timeout(timeout),
                          metadata=self._settings.call_metadata(affinity))
        except grpc.RpcError as e:
            raise from_rpc_error(e, self._settings) from None

    def attend(self, query, key=None, value=None, *, timeout=..., **fields):
        """Attention of `query` over `key` and `value` (numpy arrays or torch
        tensors; absent: key = query, value = key). `fields` are
        AttendRequest's fields by name (docs/python.md). Returns an Answer whose
        output and weights are the query's kind: numpy arrays, or torch
        tensors on its device."""
        raw, kind = _request.build(query, key, value, fields)
        return _wire.decode(self._call(self._attend, raw, timeout), kind)

    def attend_stream(self, requests, *, timeout=..., **fields):
        """Sends each request of the iterable `requests` (dicts of attend()'s
        arguments: query, key, value and fields; `fields` apply to every one) on
        one AttendStream and yields an Answer per request as the server answers
        it. A request without an id gets its index as one. A request the server
        refuses is answered with .error set, and the stream goes on; a failure
        of the whole stream raises AttentionError. A request refused before
        sending (INVALID_ARGUMENT, "requests[i]: ...") ends the requests: those
        before it are answered, then it is raised (as is an exception raised
        by `requests` itself)."""
        if self._closed:
            raise closed_client()
        encoded = _request.StreamRequests(requests, fields)
        call = self._attend_stream(iter(encoded), timeout=self._settings.call_timeout(timeout),
                                   metadata=self._settings.metadata)
        try:
            for raw in call:
                yield _wire.decode_stream(raw, encoded.kinds)
        except grpc.RpcError as e:
            if encoded.error is not None:
                raise encoded.error from None
            raise from_rpc_error(e, self._settings) from None
        finally:
            call.cancel()
        if encoded.error is not None:
            raise encoded.error

    def session(self, id=None, *, keep_rows=False, cache_dtype="float32", affinity=None,
                stream=False, **fields):
        """A Session: keys and values kept on the server between steps.
        `id` (default: a random one) must not be open on the server; `fields`
        are what every step sends besides its rows (model or num_heads and
        score, causal="bottom_right", layout, ...); cache_dtype "float32" or
        "bfloat16"; keep_rows keeps every row sent, to recreate the session
        when the server answers that it has none such (NOT_FOUND 'session
        "<id>" ...'; another NOT_FOUND is raised as it is). Every call of the
        session carries "attention-affinity": `affinity` (a group id of the
        caller's), or the id, %-encoded (_channel.affinity_header_value).
        stream=True is attention_client.aio's: here steps are unary calls."""
        if stream:
            raise invalid("stream=True: the blocking client's session steps are unary Attend "
                          "calls (a blocking grpcio stream cannot bound one answer's wait, and "
                          "its steps were no faster); attention_client.aio's sessions step on "
                          "a stream")
        return Session(self, _session.SessionCore(id, keep_rows, cache_dtype, fields, affinity))

    def server_info(self, *, timeout=...):
        """GetServerInfo: an attention.v1.ServerInfo message."""
        return self._call(self._stub.GetServerInfo, service_pb2.GetServerInfoRequest(), timeout)

    def models(self, *, timeout=...):
        """ListModels: a list of attention.v1.ModelConfig messages."""
        return list(self._call(self._stub.ListModels, model_pb2.ListModelsRequest(),
                               timeout).models)

    def model(self, name, *, timeout=...):
        """GetModel: the attention.v1.ModelConfig of `name`; NOT_FOUND if unknown."""
        return self._call(self._stub.GetModel, model_pb2.GetModelRequest(name=name),
                          timeout).config

    def health(self, service="", *, timeout=...):
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", ..."""
        return _channel.health_status(
            self._call(self._health, _channel.health_request(service), timeout))

    def get_session(self, id, *, timeout=..., affinity=None):
        """GetSession: an attention.v1.SessionInfo; NOT_FOUND when not open.
        Sent with "attention-affinity": `affinity`, or the id."""
        return self._call(self._stub.GetSession, service_pb2.GetSessionRequest(id=id), timeout,
                          affinity or id)

    def close_sessions(self, ids, *, timeout=..., affinity=None):
        """CloseSessions: a CloseSessionsResponse listing `closed` and `not_found`.
        With `affinity`, one call sent with "attention-affinity": `affinity`.
        Without, one call per distinct id, sent with that id (a proxy hashing
        on it reaches each id's replica), all at once; their answers merged
        in the order of `ids`, or the first failure in that order raised once
        every call has ended."""
        ids = list(ids)
        distinct = list(dict.fromkeys(ids))
        if affinity or len(distinct) < 2:
            return self._call(self._stub.CloseSessions, service_pb2.CloseSessionsRequest(ids=ids),
                              timeout, affinity or (ids[0] if ids else None))
        if self._closed:
            raise closed_client()
        wait = self._settings.call_timeout(timeout)
        calls = [self._stub.CloseSessions.future(service_pb2.CloseSessionsRequest(ids=[id]),
                                                 timeout=wait,
                                                 metadata=self._settings.call_metadata(id))
                 for id in distinct]
        answers = []
        for call in calls:
            try:
                answers.append(call.result())
            except grpc.RpcError as e:
                answers.append(from_rpc_error(e, self._settings))
        return merge_closed(answers)


def merge_closed(answers):
    """One CloseSessionsResponse of the answers to one CloseSessions per id,
    in their order; the first exception among them is raised."""
    merged = service_pb2.CloseSessionsResponse()
    for answer in answers:
        if isinstance(answer, BaseException):
            raise answer
        merged.closed.extend(answer.closed)
        merged.not_found.extend(answer.not_found)
    return merged


class Session(_session.SessionBase):
    """One session (Client.session). step() sends rows, close() ends it; a
    with block closes it. Thread-compatible: one Session per decoder."""

    def step(self, query, key=None, value=None, *, timeout=...):
        """Sends `query` and appends `key` and `value` (absent: key = query,
        value = key) to the session: a batch of one, [1, S_new, E]
        ([S_new, 1, E] with layout="sequence_first") or [1, H, S_new, D].
        The first step creates the session. Returns the Answer, over every row
        the session holds. A step the server refuses changes nothing; after one
        whose outcome is unknown (DEADLINE_EXCEEDED, UNAVAILABLE, ABORTED, an
        interrupt, ...) the next step first asks the server where the session
        is (GetSession, _session.SessionCore.resync). If the server had applied
        it, sending the same rows again (the natural retry) appends nothing:
        it is sent read-only, and answered as the lost answer would have been
        (with keep_rows, over a session recreated from the kept rows if the
        server has lost it since)."""
        core = self._core
        step = core.prepare(query, key, value)
        if core.resync_needed:
            self._resync(timeout)
        if core.retried(step):
            # A failure leaves nothing unsure: the read-only retry appends
            # nothing, and after a recreation whose outcome is unknown the
            # same retry is read-only again (if it was applied) or recreates
            # again (NOT_FOUND).
            try:
                raw = self._client._call(self._client._attend, core.request(step, read_only=True),
                                         timeout, core.affinity)
            except grpc.RpcError as e:
                if not core.may_recreate(e):
                    core.retry_failed(e)
                    raise
                # The session lost since its step was applied: made again
                # from the kept rows, which hold the step's.
                try:
                    raw = self._client._call(self._client._attend,
                                             core.recreation(step, applied=True)[0], timeout,
                                             core.affinity)
                except grpc.RpcError as e:
                    failure = self._failure(step, e, timeout, applied=True)
                    core.retry_failed(failure)
                    if failure is e:
                        raise
                    raise failure from e
                core.recreations += 1
            answer = _wire.decode(raw, step[3])
            core.succeeded()
            return answer
        try:
            try:
                raw = self._client._call(self._client._attend, core.request(step), timeout,
                                         core.affinity)
                answer = _wire.decode(raw, step[3])
                base, recreated = core.position, False
            except grpc.RpcError as e:
                if not core.may_recreate(e):
                    raise
                request, base = core.recreation(step)
                answer = _wire.decode(self._client._call(self._client._attend, request, timeout,
                                                          core.affinity), step[3])
                recreated = True
        except BaseException as e:
            failure = self._failure(step, e, timeout)
            core.failed(step, failure)
            if failure is e:
                raise
            raise failure from e
        core.advance(step, base, answer, recreated=recreated)
        core.succeeded()
        return answer

    def _failure(self, step, error, timeout, applied=False):
        """What the step that raised `error` fails with: `error`, unless its
        create was refused ALREADY_EXISTS, then after asking the server
        (GetSession, once no request holds the session) as
        _session.SessionCore.create_refused says (applied: the create was
        the recreation of the retry of a step found applied)."""
        if not _session.refused_create(error):
            return error
        try:
            info = self._session_info(timeout)
        except AttentionError:
            info = None
        return self._core.create_refused(step, error, info, applied)

    def _session_info(self, timeout):
        """GetSession's SessionInfo once no request holds the session (or the
        timeout has passed); None when the server has no such session."""
        core = self._core
        wait = self._client._settings.call_timeout(timeout)
        deadline = None if wait is None else time.monotonic() + wait
        while True:
            try:
                info = self._client.get_session(core.id, timeout=timeout, affinity=core.affinity)
            except AttentionError as e:
                if not _session.not_found(e, core.id):
                    raise
                return None
            if info.idle_ms != 0 or (deadline is not None and time.monotonic() >= deadline):
                return info
            time.sleep(_session.RESYNC_POLL_S)

    def _resync(self, timeout):
        """Where the server has the session, once no request holds it (or the
        timeout has passed)."""
        core = self._core
        if core.resync(self._session_info(timeout)):
            # A stale copy: closed, so that the step recreates the session.
            self._client.close_sessions([core.id], timeout=timeout, affinity=core.affinity)
            core.unsure_settled()

    def close(self, *, timeout=...):
        """Closes the session on the server (OK if it no longer had it); later
        steps fail FAILED_PRECONDITION. After a first step whose outcome is
        unknown, only if the server names that step (resync): never another
        client's session of the same id."""
        core = self._core
        if core.closed:
            return
        if not core.created and core.unsure:
            self._resync(timeout)
        if core.created:
            self._client.close_sessions([self.id], timeout=timeout, affinity=core.affinity)
        core.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
