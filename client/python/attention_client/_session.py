"""A session's state, shared by the blocking and the asyncio clients: what
client/session.h does in C++. The id and positions are filled in, the first
step creates the session, and with keep_rows every key and value row sent is
kept so that a step the server answers that it has no such session
(not_found) is retried once as a recreation: one create request carrying
every kept row and then the step's, whose answer is the step's answer.

A step that fails without the server's refusal (past its deadline, its task
cancelled, the connection lost, ABORTED after a resend) may have been applied
all the same. Its outcome is unknown, so the next step first asks the server
(GetSession) how many rows the session holds and goes on from there: the
step counts as applied when the server holds its rows too and names it as
the last step that appended (each step carries a random step_id; a server
that names none: by the count alone; with keep_rows, its rows are then
kept), and the next step, if it has the same rows (its retry), is sent
read-only, for the answer that was lost (with keep_rows, a session lost
since is recreated from the kept rows, the step's among them). A server holding fewer rows
than the answered steps put there holds a stale copy: with keep_rows it is
closed and the step recreates the session, else the step is
FAILED_PRECONDITION. With keep_rows a count that no such step explains is
FAILED_PRECONDITION rather than kept rows that no longer match the server's.
A session this client never created is another's unless it names one of
this client's steps: never adopted, and never closed by close()."""
import uuid

import grpc
import numpy as np

from attention_client import _request, _wire
from attention_client._errors import AttentionError, invalid
from attention_client._proto.attention.v1 import attention_pb2, tensor_pb2

_MAX_ID_BYTES = 128
_STEP_FIELDS = ("query", "key", "value", "id")
# Failures after which the server may have applied the step: not its refusal.
# ABORTED (position mismatch) is the answer to a resend of a step whose first
# attempt was applied (gRPC's retries of unary steps, a stream step's resends).
_UNSURE_CODES = frozenset({
    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED,
    grpc.StatusCode.DATA_LOSS})


def not_found(error, session_id):
    """Whether `error` says that the server has no session `session_id`: every
    such NOT_FOUND of the server's starts 'session "<id>"'
    (server/session_store.cc, server/attention_service.cc), unlike another
    NOT_FOUND (a model that is not registered)."""
    return (error.code() == grpc.StatusCode.NOT_FOUND and
            (error.details() or "").startswith(f'session "{session_id}"'))


def refused_create(error):
    """Whether a step failed ALREADY_EXISTS: its create was refused
    (SessionCore.create_refused says what that may mean)."""
    return isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.ALREADY_EXISTS


# While a request holds the session (GetSession's idle_ms 0) the one whose
# outcome is unknown may still be appending: its wait between GetSessions.
RESYNC_POLL_S = 0.02


class _RowLog:
    """The rows of one input (keys or values) sent so far, in order."""

    def __init__(self, name):
        self.name = name
        self.dtype = None
        self.axis = None
        self.dims = None  # the shape of all kept rows
        self.parts = []

    def check(self, rows, axis, field=None):
        """Raises unless `rows` (of the request's `field`) can follow the kept rows."""
        if self.dims is None:
            return
        same = rows.dtype == self.dtype and axis == self.axis and len(rows.shape) == len(self.dims)
        same = same and all(d == axis or rows.shape[d] == self.dims[d] for d in range(len(self.dims)))
        if not same:
            raise invalid(
                f"{field or self.name}: {tensor_pb2.Tensor.DType.Name(rows.dtype)} "
                f"{list(rows.shape)} cannot follow the session's kept "
                f"{tensor_pb2.Tensor.DType.Name(self.dtype)} {self.name} rows "
                f"{list(self.dims)} (keep_rows needs one dtype, and one shape but for the rows)")

    def append(self, rows, axis):
        if self.dims is None:
            self.dtype, self.axis = rows.dtype, axis
            self.dims = list(rows.shape)
            self.dims[axis] = 0
        self.parts.append(np.array(rows.array, copy=True))
        self.dims[axis] += rows.shape[axis]

    def with_rows(self, rows, axis):
        """Every kept row followed by those of `rows`, as one WireTensor."""
        if not self.parts:
            return rows
        self.check(rows, axis)
        array = np.concatenate(self.parts + [rows.array], axis=axis)
        return _wire.WireTensor(self.dtype, array.shape, array)

    def kept(self):
        """Every kept row, as one WireTensor."""
        array = np.concatenate(self.parts, axis=self.axis)
        return _wire.WireTensor(self.dtype, array.shape, array)

    @property
    def nbytes(self):
        return sum(p.nbytes for p in self.parts)


class SessionCore:
    """The state of one session; the clients' Session classes do the calls."""

    def __init__(self, session_id, keep_rows, cache_dtype, fields, affinity=None):
        if session_id is None:
            session_id = uuid.uuid4().hex
        session_id = str(session_id)
        if not 1 <= len(session_id.encode()) <= _MAX_ID_BYTES:
            raise invalid(f'session id "{session_id}" has {len(session_id.encode())} bytes; '
                          f"want 1 to {_MAX_ID_BYTES}")
        taken = [f for f in _STEP_FIELDS if f in fields]
        if taken:
            raise invalid(f"session {session_id}: {', '.join(taken)} are set by step(), not by "
                          "session()")
        try:
            self.cache_dtype = _request.dtype_enum("cache_dtype", cache_dtype)
        except AttentionError:  # it would name every tensor dtype
            self.cache_dtype = None
        if self.cache_dtype not in (tensor_pb2.Tensor.FLOAT32, tensor_pb2.Tensor.BFLOAT16):
            raise invalid(f"session {session_id}: cache_dtype {cache_dtype!r} is not float32 or "
                          "bfloat16")
        unknown = set(fields) - _request.FIELDS
        if unknown:
            raise invalid(f"session {session_id}: unknown field(s) {', '.join(sorted(unknown))}")
        self.id = session_id
        # "attention-affinity" of every call of the session.
        self.affinity = str(affinity) if affinity else session_id
        self.fields = dict(fields)
        self.sequence_first = fields.get("layout") is not None and _request._enum(
            "layout", attention_pb2.AttendRequest.Layout,
            fields["layout"]) == attention_pb2.AttendRequest.SEQUENCE_FIRST
        self.position = 0
        self.created = False
        self.closed = False
        # A recreation found the id another client's: the session is over,
        # and never touches that one.
        self.taken = False
        self.recreations = 0
        self.keys = _RowLog("key") if keep_rows else None
        self.values = _RowLog("value") if keep_rows else None
        # Steps sent at `position` whose outcome is unknown, and whether the
        # next step asks the server first (resync).
        self.unsure = []
        self.resync_needed = False
        # The unsure step resync found applied, until the next step is sent.
        self.applied = None

    def _axis(self, name, rows):
        if len(rows.shape) == 3:
            return 0 if self.sequence_first else 1
        if len(rows.shape) == 4:
            return 2
        raise invalid(f"{name}: shape {list(rows.shape)} is not rank 3 or 4, as a session's rows are")

    def prepare(self, query, key, value):
        """A step: (query, key, value as WireTensors or None, kind of the answer,
        its step_id: the server remembers it for resync)."""
        if self.closed:
            raise AttentionError(grpc.StatusCode.FAILED_PRECONDITION, f"session {self.id} is closed")
        if self.taken:
            raise AttentionError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"session {self.id} is over: the server lost it, and another client has opened "
                "the id since; open a session of another id")
        kind = _wire.kind_of(query)
        q = _wire.to_wire("query", query)
        k = None if key is None else _wire.to_wire("key", key)
        v = None if value is None else _wire.to_wire("value", value)
        step = (q, k, v, kind, uuid.uuid4().hex[:16])
        if self.keys is not None:
            keys, values = self._rows(step)
            # By the self-attention rule the query may stand for the keys,
            # and the keys for the values.
            key_field = "key" if k is not None else "query"
            value_field = "value" if v is not None else key_field
            self.keys.check(keys, self._axis(key_field, keys), key_field)
            self.values.check(values, self._axis(value_field, values), value_field)
        return step

    @staticmethod
    def _rows(step):
        q, k, v = step[:3]
        keys = k if k is not None else q
        return keys, v if v is not None else keys

    def request(self, step, read_only=False):
        """The bytes of `step` at the session's position; read_only: its
        query alone, appending nothing."""
        q, k, v = step[:3]
        spec = attention_pb2.SessionSpec(ids=[self.id], positions=[self.position],
                                         step_id=step[4])
        if read_only:
            spec.read_only = True
            k = v = None
        elif not self.created:
            spec.create = True
            spec.cache_dtype = self.cache_dtype
        return _request.build(q, k, v, self.fields, spec)[0]

    def retried(self, step):
        """Whether `step`, about to be sent, is the retry of the step resync
        found applied (the same key and value rows): it is then sent
        read_only, and its answer is the one that was lost. That step is
        remembered until its retry is answered (a retry of a failed retry is
        one too) or another step is sent."""
        if self.applied is not None and self._same_rows(step, self.applied):
            return True
        self.applied = None
        return False

    def may_recreate(self, error):
        """Whether a step that failed with `error` is retried as a recreation:
        the server has no such session, and the kept rows can make it again."""
        return self.created and self.keys is not None and not_found(error, self.id)

    def recreation(self, step, applied=False):
        """The bytes of `step` as a create request over every kept row, and the
        position it is sent at. applied: `step` is the retry of the step
        resync found applied, whose rows are kept already."""
        q = step[0]
        keys, values = self._rows(step)
        if applied:
            all_keys, all_values = self.keys.kept(), self.values.kept()
        else:
            all_keys = self.keys.with_rows(keys, self._axis("key", keys))
            all_values = self.values.with_rows(values, self._axis("value", values))
        spec = attention_pb2.SessionSpec(ids=[self.id], positions=[0], create=True,
                                         cache_dtype=self.cache_dtype, step_id=step[4])
        base = all_keys.shape[self._axis("key", keys)] - keys.shape[self._axis("key", keys)]
        return _request.build(q, all_keys, all_values, self.fields, spec)[0], base

    def advance(self, step, base, answer, recreated=False):
        """After an OK answer to `step` sent at position `base` (None: a
        step the server turned out to have applied, on resync)."""
        self.created = True
        keys, values = self._rows(step)
        if answer is not None and len(answer.session_positions) == 1:
            self.position = answer.session_positions[0]
        else:
            self.position = base + keys.shape[self._axis("key", keys)]
        if recreated:
            self.recreations += 1
        if self.keys is not None:
            self.keys.append(keys, self._axis("key", keys))
            self.values.append(values, self._axis("value", values))

    def succeeded(self):
        """After an answered step: no step before it can still be applied (its
        position has passed), nor be retried."""
        self.unsure_settled()
        self.applied = None

    def unsure_settled(self):
        """After a resync that settled the unsure steps: none is unsure any
        more; the step found applied before, if any, still takes its retry
        read-only (a resync after that retry was ABORTED keeps it so)."""
        self.unsure = []
        self.resync_needed = False

    def retry_failed(self, error):
        """After the read-only retry of the step resync found applied, or the
        recreation that followed it, raised `error`: the retry appended
        nothing, and the same retry again settles a recreation (read-only if
        it was applied, else recreating again), so nothing is unsure.
        ABORTED: the session is no longer where the step left it (another
        writer's rows, a stale copy on a replica it moved back to, or the
        recreation's own, refused when sent again), so the next step asks
        the server first."""
        if isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.ABORTED:
            self.resync_needed = True

    def failed(self, step, error):
        """After `step` raised `error`: a failure that is not the server's
        refusal (an AttentionError of _UNSURE_CODES, or any other exception,
        as a cancelled task's) leaves its outcome unknown."""
        code = error.code() if isinstance(error, grpc.RpcError) else None
        if code is None or code in _UNSURE_CODES:
            # A copy: the caller may refill its arrays before the step is
            # matched against the server's count or a retry.
            self.unsure.append(tuple(
                t if t is None else _wire.WireTensor(t.dtype, t.shape, t.array.copy())
                for t in step[:3]) + step[3:])
            self.resync_needed = True

    def create_refused(self, step, error, info, applied=False):
        """The error `step` fails with after `error`, ALREADY_EXISTS
        (refused_create), which only a create (the first step's, or a
        recreation's) gets. gRPC sends a step again when its connection
        fails (so does a stream session), and a create whose first attempt
        was applied is refused so: if the session names this step as the
        last that appended, the step fails ABORTED instead, an outcome
        unknown that the next step settles; if it names another, the id is
        another's and the step fails ALREADY_EXISTS, every time. `info`:
        the server's SessionInfo, asked after the refusal once no request
        held the session (or the step's timeout passed); None: it has no
        such session, or could not say. applied: `step` is the retry of the
        step resync found applied, whose rows the position counts."""
        if applied:
            rows = self.position
        else:
            rows = (self.position if self.created else 0) + (self._count(step) or 0)
        if info is not None and info.idle_ms != 0:
            # Ours only if it names this step as the last that appended (a
            # server that names none: by the count alone).
            ours = (info.last_step_id == step[4] if info.HasField("last_step_id")
                    else int(info.position) == rows)
            if not ours:
                # Another's session: the id is taken. A recreation's (this
                # client's session lost since) ends this one.
                if not self.created:
                    return error
                self.created = False
                self.taken = True
                return AttentionError(
                    error.code(),
                    f"{error.details()}; the server had lost this client's session, and another "
                    "client has opened the id since: this session is over")
            return AttentionError(
                grpc.StatusCode.ABORTED,
                f"{error.details()}; it holds this step's {rows} rows: an earlier attempt of the "
                "step, whose answer was lost, created it; send the step again for its answer")
        if info is not None:
            # Held past the step's timeout, by this step's first attempt or by
            # another's request: not known yet, asked again by the next step.
            return AttentionError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"{error.details()}; a request still holds it, so whether it is this step's own "
                "(an earlier attempt of the step may have created it) is not known yet; send "
                "the step again")
        # Gone again (that attempt failed after all), or the server could not
        # say: settled by the next step, which adopts no session that does not
        # name one of this client's steps (resync).
        return AttentionError(
            grpc.StatusCode.ABORTED,
            f"{error.details()}; it may be this step's own (an earlier attempt of the step, "
            "whose answer was lost, may have created it): send the step again")

    def resync(self, info):
        """Before a step after one whose outcome is unknown (or close() after
        a first step so): `info` is the server's SessionInfo, or None when it
        has no such session. True when the server holds a stale copy that the
        caller must close (close_sessions([id]) with the session's affinity,
        then unsure_settled()) for the step to recreate the session from the
        kept rows."""
        if info is None:
            # Never created, or lost (the step is then NOT_FOUND, recreated
            # from the kept rows): nothing of the unsure steps is held.
            self.unsure_settled()
            return False
        if info.idle_ms == 0:
            # A request still holds it past the step's timeout: its position
            # is not committed yet. Asked again before the next step.
            raise AttentionError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"session {self.id}: a request still holds it, so whether the step that failed "
                "before was applied is not known yet; try the step again")
        held = int(info.position)
        if self.created and held == self.position:
            self.resync_needed = False  # none applied (yet): a later one is ABORTED
            return False
        if self.created and held < self.position:
            # Fewer rows than answered steps put there: a stale copy, left on
            # a replica the session has moved back to (it was recreated
            # elsewhere meanwhile).
            if self.keys is None:
                raise AttentionError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"session {self.id}: the server holds {held} rows, fewer than the "
                    f"{self.position} answered steps put there: a stale copy (its replica left "
                    "and came back while the session lived elsewhere); close the session and "
                    "create it again")
            return True
        # The step the server last applied, where it names it: one of ours
        # only if it has that id (another writer's may have none); a server
        # from before step ids: by the count alone.
        named = info.HasField("last_step_id")
        last = info.last_step_id
        applied = [step for step in self.unsure
                   if self._count(step) is not None and self.position + self._count(step) == held
                   and (not named or step[4] == last)]
        if applied and all(self._same_rows(step, applied[0]) for step in applied[1:]):
            self.advance(applied[0], self.position, None)
            self.succeeded()
            self.applied = applied[0]
            return False
        if not self.created:
            # No first step of this client's made it: the session is
            # another's, never taken over (the step's create is refused
            # ALREADY_EXISTS), nor closed by close().
            self.unsure_settled()
            return False
        if self.keys is None:
            # Nothing kept to match: go on at the server's position.
            self.created = True
            self.position = held
            self.unsure_settled()
            return False
        raise AttentionError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"session {self.id}: the server holds {held} rows, the client {self.position} "
            f"and {len(self.unsure)} step(s) whose outcome is unknown, none of which makes "
            f"{held}" + (f' as its last step (step_id "{last}") did' if named else "") +
            ": the kept rows no longer match the server's (another writer?); close "
            "the session and open another")

    def _count(self, step):
        """The rows `step` appends (None: not a session's rank)."""
        keys, _ = self._rows(step)
        try:
            return keys.shape[self._axis("key", keys)]
        except AttentionError:
            return None

    def _same_rows(self, a, b):
        """Whether `a` and `b` send the same key and value rows: dtype, shape
        and bytes (as the C++ client compares them)."""
        return all(x.dtype == y.dtype and x.shape == y.shape and
                   np.array_equal(x.array.reshape(-1).view(np.uint8),
                                  y.array.reshape(-1).view(np.uint8))
                   for x, y in zip(self._rows(a), self._rows(b)))

    @property
    def kept_bytes(self):
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class SessionBase:
    """What the blocking and asyncio Session share: the read-only state."""

    def __init__(self, client, core):
        self._client = client
        self._core = core

    @property
    def id(self):
        """The session's id."""
        return self._core.id

    @property
    def position(self):
        """Rows the server holds after the last answered step: the next position."""
        return self._core.position

    @property
    def open(self):
        """A step created the session and close() has not been called."""
        return self._core.created and not self._core.closed

    @property
    def recreations(self):
        """Steps answered by recreating the session from the kept rows."""
        return self._core.recreations

    @property
    def kept_bytes(self):
        """Bytes of the kept key and value rows (0 without keep_rows)."""
        return self._core.kept_bytes

    def __repr__(self):
        return f"Session(id={self.id!r}, position={self.position}, open={self.open})"
