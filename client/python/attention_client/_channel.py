"""What the blocking and asyncio clients set up alike: channel options (as
the C++ client's: round-robin over the target's addresses, reconnect
backoffs, retries of UNAVAILABLE on unary calls, message size), TLS
credentials, the bearer token, and the health check's hand-encoded messages
(grpc.health.v1 has no stubs in Debian's grpcio)."""
import json
import numbers
import os
import ssl

import grpc

from attention_client._errors import invalid
from attention_client._wire import _varint

# gRPC's background poll, which lets a failing channel's reconnection through
# a proxy complete (why: docs/client.md, "Reconnects and retries"). gRPC reads
# it when it starts, at the process's first channel, so it is set on import; a
# value the process was given is kept.
os.environ.setdefault("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "100")

SERVICE = "/attention.v1.AttentionService/"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
_HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}

# Unary methods are safe to repeat (docs/client.md, "Reconnects and retries"):
# attempts in all, and the most of the random waits between them (the first,
# then doubled, up to the last). gRPC retries no streams; an asyncio session's
# stream resends its step by the same policy (aio._StepStream).
RETRY_ATTEMPTS = 4
RETRY_FIRST_BACKOFF_S, RETRY_MAX_BACKOFF_S, RETRY_BACKOFF_MULTIPLIER = 0.1, 1.0, 2
# Calls rotate over every address the target resolves to (a headless
# Service's pods, "ipv4:A,B"), as the C++ client's do; gRPC's default policy
# would send them all to the first.
_SERVICE_CONFIG = json.dumps({
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [{
        "name": [{"service": "attention.v1.AttentionService", "method": m} for m in (
            "Attend", "GetServerInfo", "ListModels", "GetModel", "CloseSessions", "GetSession")]
        + [{"service": "grpc.health.v1.Health", "method": "Check"}],
        "retryPolicy": {"maxAttempts": RETRY_ATTEMPTS,
                        "initialBackoff": f"{RETRY_FIRST_BACKOFF_S:g}s",
                        "maxBackoff": f"{RETRY_MAX_BACKOFF_S:g}s",
                        "backoffMultiplier": RETRY_BACKOFF_MULTIPLIER,
                        "retryableStatusCodes": ["UNAVAILABLE"]},
    }],
    "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1},
})


def _read(option, value):
    if value is None or isinstance(value, bytes):
        return value
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as e:
        raise invalid(f"{option}: cannot read {value}: {e.strerror}") from None


def _check_tls_files(ca_arg, ca, cert_arg, cert, key_arg, key):
    """What gRPC reports only as a failed connection ("empty address list",
    naming nothing): a tls_ca without a certificate, a tls_cert without one, a
    tls_key that is not the certificate's or is encrypted. Checked with
    Python's ssl, as the server checks its own files at start."""
    def name(option, arg):
        return option if isinstance(arg, bytes) else f"{option}: {arg}"

    def holds_certificate(pem):
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(
                cadata=pem.decode("latin-1"))
            return True
        except ssl.SSLError:
            return False

    for option, arg, pem in (("tls_ca", ca_arg, ca), ("tls_cert", cert_arg, cert)):
        if pem is not None and not holds_certificate(pem):
            raise invalid(f"{name(option, arg)} holds no PEM certificate (BEGIN CERTIFICATE)")
    if cert is None or not hasattr(os, "memfd_create"):
        return

    def no_passphrase():
        raise _Encrypted

    # ssl loads a key pair from files only: memory files keep the key off disk.
    fds = [os.memfd_create("attention-tls"), os.memfd_create("attention-tls")]
    try:
        for fd, pem in zip(fds, (cert, key)):
            os.write(fd, pem)
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(
            *(f"/proc/self/fd/{fd}" for fd in fds), password=no_passphrase)
    except _Encrypted:
        raise invalid(f"{name('tls_key', key_arg)} is encrypted; give an unencrypted PEM "
                      "private key") from None
    except ssl.SSLError as e:
        if "KEY_VALUES_MISMATCH" in str(e):
            raise invalid(f"{name('tls_key', key_arg)} is not the key of the certificate in "
                          f"{name('tls_cert', cert_arg)}") from None
        raise invalid(f"{name('tls_key', key_arg)} holds no unencrypted PEM private key "
                      "(BEGIN PRIVATE KEY)") from None
    finally:
        for fd in fds:
            os.close(fd)


class _Encrypted(Exception):
    pass


AFFINITY_HEADER = "attention-affinity"
# The longest timeout, in seconds (about 31 years): grpcio takes one over
# about 7.4e9 s for a deadline already past.
MAX_TIMEOUT_S = 1e9


def affinity_header_value(key):
    """The header's value for `key` (a session or group id, any text): gRPC
    carries only printable ASCII in a header, so the UTF-8 bytes outside
    '!'..'~', and '%' itself, go as %XX, as the C++ client sends them
    (common/metadata.h), so that both route a session to one replica."""
    return "".join(chr(b) if 0x20 < b < 0x7F and b != 0x25 else f"%{b:02X}"
                   for b in str(key).encode())


class Settings:
    """A client's arguments, checked: the channel's options and credentials,
    and each call's metadata and default timeout."""

    def __init__(self, target, token, tls_ca, tls_cert, tls_key, tls_server_name, timeout,
                 max_message_mb):
        if (tls_cert is None) != (tls_key is None):
            raise invalid("tls_cert and tls_key go together; only one is set")
        if not isinstance(target, str) or not target:
            raise invalid(f"target: {target!r} is not a gRPC target (a str: \"host:port\")")
        self.target = target
        self.timeout = None
        self.timeout = self.call_timeout(timeout)
        if token is not None and not isinstance(token, str):
            raise invalid(f"token: {type(token).__name__} is not a str")
        for i, ch in enumerate(token or ""):
            if not " " <= ch <= "~":
                raise invalid(f"token: character {i} of {len(token)} is {ch!r}; a token goes in "
                              "a header, so it must be printable ASCII (a newline read from a "
                              "file with it, too, must be removed)")
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        if isinstance(max_message_mb, bool) or not isinstance(max_message_mb, numbers.Integral) \
                or not 0 < max_message_mb < 2048:
            raise invalid(f"max_message_mb: {max_message_mb!r} is not an int from 1 to 2047")
        max_bytes = int(max_message_mb) << 20
        self.options = [
            ("grpc.max_send_message_length", max_bytes),
            ("grpc.max_receive_message_length", max_bytes),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
            ("grpc.min_reconnect_backoff_ms", 1000),
            ("grpc.enable_retries", 1),
            ("grpc.service_config", _SERVICE_CONFIG),
        ]
        if tls_server_name:
            self.options.append(("grpc.ssl_target_name_override", tls_server_name))
        # Any TLS argument turns TLS on, as the C++ client's options do: a
        # server name alone verifies the server against the system's roots.
        self.tls = tls_ca is not None or tls_cert is not None or bool(tls_server_name)
        self.client_certificate = tls_cert is not None
        self.credentials = None
        ca = _read("tls_ca", tls_ca)
        if self.tls:
            cert, key = _read("tls_cert", tls_cert), _read("tls_key", tls_key)
            _check_tls_files(tls_ca, ca, tls_cert, cert, tls_key, key)
            self.credentials = grpc.ssl_channel_credentials(
                root_certificates=ca, private_key=key, certificate_chain=cert)
        # What a pickled RemoteMultiheadAttention makes its client again from:
        # the constructor's arguments but the secrets (token, client
        # certificate and key), which are not written into saved models.
        self.public_arguments = {"tls_ca": ca, "tls_server_name": tls_server_name,
                                 "timeout": timeout, "max_message_mb": max_message_mb}

    def closed_socket_hint(self):
        """Which of these arguments could be why a server closed the
        connection during the handshake (_errors.from_rpc_error)."""
        if not self.tls:
            return ("a server that serves TLS closes plaintext connections: if this one does, "
                    "pass tls_ca")
        if not self.client_certificate:
            return ("a server that requires client certificates (mTLS) closes the connection of "
                    "a client without one: if this one does, pass tls_cert and tls_key")
        return ("a server that requires client certificates (mTLS) closes the connection of a "
                "client whose certificate its --tls_client_ca did not sign: check tls_cert")

    def call_metadata(self, affinity):
        """A call's metadata: the token's, and "attention-affinity" when the
        call belongs to a session (docs/sessions.md, "Sessions across
        replicas"): a proxy hashing on it keeps the session on one replica."""
        if not affinity:
            return self.metadata
        return (self.metadata or ()) + ((AFFINITY_HEADER, affinity_header_value(affinity)),)

    def call_timeout(self, timeout):
        """The deadline of one call: its own timeout, or the client's. Longer
        than MAX_TIMEOUT_S (inf among them) gRPC takes as past already."""
        if timeout is ...:
            return self.timeout
        if timeout is not None and (isinstance(timeout, (bool, str, bytes)) or
                                    not isinstance(timeout, numbers.Real) or
                                    not 0 < timeout <= MAX_TIMEOUT_S):
            raise invalid(f"timeout: {timeout!r} is not a positive number of seconds up to "
                          f"{MAX_TIMEOUT_S:.0e}, or None (no deadline)")
        return timeout


def health_request(service):
    data = service.encode()
    return b"\x0a" + _varint(len(data)) + data if data else b""


def health_status(raw):
    """The status name in a HealthCheckResponse's bytes."""
    if len(raw) >= 2 and raw[0] == 0x08:
        return _HEALTH_STATUS.get(raw[1], str(raw[1]))
    return "UNKNOWN"
