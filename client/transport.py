"""The client's gRPC transport: the channel it opens, its reconnect backoff, errors explained.

The client opens every connection (it may sit behind NAT). When the server is unreachable or
restarts, the client loop (:class:`client.app.FlClient`) reconnects with exponential backoff
and jitter (:class:`Backoff`) on the codes in :data:`RETRYABLE`, and joins again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import grpc

from fl_secure.errors import TlsError
from fl_secure.tls import channel_credentials, warn_insecure
from fl_secure.tls.layout import site_bundle

#: The header a plaintext (``--insecure``) client names itself with: there is no certificate.
INSECURE_ID_HEADER = "x-fl-secure-client-id"
#: Codes of a failed call after which the client reconnects instead of giving up.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


@dataclass(frozen=True)
class Connection:
    """Where and how to reach the server."""

    address: str
    client_id: str
    cert_dir: Path | None = None
    insecure: bool = False
    server_name: str = ""  # TLS name to check when the address is an IP without SAN

    @property
    def site_dir(self) -> Path | None:
        """This site's folder: ``cert_dir``, or its ``sites/<id>/`` when given a whole set."""
        return None if self.cert_dir is None else site_bundle(self.cert_dir, self.client_id)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call sends beside its message: the client's name on a plaintext channel."""
        return ((INSECURE_ID_HEADER, self.client_id),) if self.insecure else ()


def open_channel(conn: Connection) -> grpc.Channel:
    """A channel with the client's certificate (or, loudly, a plaintext one)."""
    options: list[tuple[str, object]] = [
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.enable_retries", 0),
        # replies of the authenticated server can be large: a CKKS round's encrypted sum is
        # ~80 bytes per parameter (tensors themselves are streamed in chunks)
        ("grpc.max_receive_message_length", 1 << 30),
    ]
    if conn.server_name:
        options.append(("grpc.ssl_target_name_override", conn.server_name))
    if conn.insecure:
        warn_insecure(f"client {conn.client_id}")
        return grpc.insecure_channel(conn.address, options=options)
    if conn.cert_dir is None:
        raise TlsError("the client needs --certs DIR (or --insecure for a loopback test)")
    creds = channel_credentials(conn.cert_dir, conn.client_id)
    return grpc.secure_channel(conn.address, creds, options=options)


class Backoff:
    """Exponential backoff with full jitter."""

    def __init__(self, initial: float = 0.5, maximum: float = 10.0) -> None:
        self.initial, self.maximum, self.attempt = initial, maximum, 0

    def next_delay(self) -> float:
        """Delay before the next attempt."""
        delay = min(self.maximum, self.initial * 2**self.attempt)
        self.attempt += 1
        return random.uniform(0, delay)  # noqa: S311 - timing jitter, not security

    def reset(self) -> None:
        """After a success."""
        self.attempt = 0


def rpc_details(exc: grpc.RpcError) -> str:
    """The reason gRPC gives for a failed call (e.g. a refused connection, a TLS failure)."""
    details = exc.details() if hasattr(exc, "details") else None
    return str(details or exc).strip()


def explain_rpc_error(exc: grpc.RpcError, address: str) -> str:
    """One line for the user: what the server or the transport said, and what to check."""
    code = exc.code() if hasattr(exc, "code") else None
    name = getattr(code, "name", str(code))
    hint = {
        "UNAVAILABLE": "is the server running and reachable, and does --certs hold the ca.pem "
        "that signed the server's certificate?",
        "PERMISSION_DENIED": "the server does not enroll this client's certificate",
        "DEADLINE_EXCEEDED": "the server did not answer in time",
    }.get(name, "")
    return f"server {address}: {name}: {rpc_details(exc)}" + (f" ({hint})" if hint else "")
