"""The one exception type of the package."""
import grpc

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class AttentionError(grpc.RpcError):
    """A call that failed: `code()` is the grpc.StatusCode (the server's, or
    INVALID_ARGUMENT for arguments refused before sending), `details()` the
    server's message; str() gives both, "INVALID_ARGUMENT: query: ...".
    A grpc.RpcError, so handlers of gRPC errors catch it too."""

    def __init__(self, code, message):
        super().__init__(f"{code.name}: {message}")
        self._code = code
        self._message = message

    def __reduce__(self):
        # pickle and copy rebuild it from (code, message), not from args (the
        # one string __init__ gave the base class): a multiprocessing worker's
        # error reaches its parent.
        return type(self), (self._code, self._message)

    def code(self):
        return self._code

    def details(self):
        return self._message


def invalid(message):
    return AttentionError(grpc.StatusCode.INVALID_ARGUMENT, message)


def closed_client():
    """A call on a client after its close()."""
    return AttentionError(grpc.StatusCode.FAILED_PRECONDITION,
                          "the client is closed (close() or the end of its with block)")


def closed_during_call():
    """A call in flight when its client's close() cancelled it."""
    return AttentionError(grpc.StatusCode.CANCELLED, "the client was closed during the call")


def code_of(number):
    """The grpc.StatusCode numbered `number` (UNKNOWN for others)."""
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)


def from_rpc_error(error, settings=None):
    """An AttentionError from a grpc.RpcError (or grpc.aio.AioRpcError). gRPC's
    only word when a server refuses the TLS handshake (a client certificate
    missing or not trusted) or a plaintext connection to its TLS port is
    "Socket closed": with the client's `settings` (_channel.Settings), the
    message then also says which of its arguments could be why."""
    if isinstance(error, AttentionError):
        return error
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else str(error)) or ""
    if settings is not None and code == grpc.StatusCode.UNAVAILABLE \
            and "Socket closed" in details:
        details += f" ({settings.closed_socket_hint()})"
    return AttentionError(code or grpc.StatusCode.UNKNOWN, details)
