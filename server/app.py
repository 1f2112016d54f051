"""Start the gRPC server over a coordinator, with mutual TLS (or, loudly, without)."""

from __future__ import annotations

import logging
import math
from concurrent import futures
from typing import TYPE_CHECKING

import grpc

from fl_secure.errors import ConfigError
from fl_secure.memory import retain_freed_memory
from fl_secure.tls import (
    EnrollmentList,
    require_enrolled,
    server_credentials,
    warn_insecure,
)
from fl_secure.tls.layout import Bundle, server_bundle
from server.servicer import MAX_CALLS_PER_CLIENT, Authenticator, FlSecureServicer
from server.wire import add_servicer

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from server.coordinator import Coordinator

log = logging.getLogger(__name__)

#: Open connections one enrolled client's share allows (handshaking or not); see
#: :func:`connection_options`.
CONNECTIONS_PER_CLIENT = 8
#: Connections the server holds at least, whatever the enrollment.
MIN_CONNECTIONS = 256
#: A connection with no call open for this long is closed (GOAWAY; a client reconnects).
MAX_CONNECTION_IDLE_MS = 5 * 60 * 1000
#: Keepalive pings a client may send this often on a connection whose calls send no data.
#: A client pings every 20 s while a call is open (``client.transport.open_channel``), and
#: the server holds calls open for long: a secure stage waits for the whole cohort, the
#: attendance call for the whole round. gRPC's default (5 minutes) counts each such ping
#: as a strike and closes the connection on the third (GOAWAY "too_many_pings", at ~100 s),
#: failing every call on it: a key stage that waited that long lost its whole cohort.
MIN_PING_INTERVAL_MS = 10_000

#: Metadata key naming the client on an ``--insecure`` connection (no certificate to read).
INSECURE_ID_HEADER = "x-fl-secure-client-id"


def tls_authenticator(enrollment: EnrollmentList) -> Authenticator:
    """Identity = the verified certificate's CN, which must be enrolled."""

    def authenticate(context: grpc.ServicerContext) -> str:
        return require_enrolled(context, enrollment)

    return authenticate


def insecure_authenticator(enrolled: set[str]) -> Authenticator:
    """Identity claimed in metadata: for loopback tests only, never for real data."""

    def authenticate(context: grpc.ServicerContext) -> str:
        claimed = dict(context.invocation_metadata()).get(INSECURE_ID_HEADER)
        if not isinstance(claimed, str) or claimed not in enrolled:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"client {claimed!r} not enrolled")
        return str(claimed)

    return authenticate


def load_enrollment(cert_dir: Path) -> EnrollmentList:
    """The server folder's enrollment list (``enrolled.json``; ``server/`` of a whole set)."""
    return EnrollmentList.load(Bundle(server_bundle(cert_dir)).enrollment)


def _num_values(coordinator: Coordinator) -> int:
    return sum(math.prod(s.shape) for s in coordinator.specs)


def check_address(address: str) -> None:
    """Refuse an address that is not ``host:port`` with a port in 0..65535 (0: any free port).

    gRPC takes a port above 65535 modulo 2^16 and listens somewhere else without a word.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(
            f"server address {address!r}: expected host:port with a port in 0..65535 "
            "(e.g. 0.0.0.0:50051, [::]:50051; port 0 picks a free one)"
        )


def connection_options(coordinator: Coordinator) -> list[tuple[str, int]]:
    """Options of gRPC core that bound what peers can hold before and between calls.

    A TCP connection that does not finish its TLS handshake within ``handshake_timeout`` is
    closed (gRPC's default keeps it 120 s); at most ``max(MIN_CONNECTIONS,
    CONNECTIONS_PER_CLIENT * enrolled)`` connections are open at once, handshaking ones
    included (past it a new one is closed at accept); a connection without a call for
    ``MAX_CONNECTION_IDLE_MS`` is closed.
    """
    enrolled = max(len(coordinator.enrolled), 1)
    return [
        ("grpc.server_handshake_timeout_ms", int(coordinator.settings.handshake_timeout * 1000)),
        (
            "grpc.max_allowed_incoming_connections",
            max(MIN_CONNECTIONS, CONNECTIONS_PER_CLIENT * enrolled),
        ),
        ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ]


def _bind(address: str, add_port: Callable[[], int]) -> int:
    try:
        return add_port()
    except RuntimeError as exc:  # grpcio >= 1.60 raises where older ones returned 0
        raise ConfigError(
            f"could not bind the server to {address}: {exc} (is the port in use, or the "
            "host not an address of this machine?)"
        ) from exc


def start_server(
    coordinator: Coordinator,
    address: str,
    *,
    cert_dir: Path | None,
    insecure: bool = False,
    max_workers: int | None = None,
) -> tuple[grpc.Server, int]:
    """Bind and start; return the server and the port actually bound (address port 0 = any)."""
    check_address(address)
    retain_freed_memory()  # the round's unmasking and aggregation reuse freed buffers
    # each client may hold MAX_CALLS_PER_CLIENT calls; the rest is slack
    workers = max_workers or MAX_CALLS_PER_CLIENT * max(len(coordinator.enrolled), 1) + 8
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fl-secure-rpc"),
        options=[
            ("grpc.so_reuseport", 0),
            # the largest unary message a client sends: a CKKS decryptor's float64 sum
            ("grpc.max_receive_message_length", max(4 << 20, 8 * _num_values(coordinator) + 65536)),
            *connection_options(coordinator),
        ],
    )
    if insecure:
        warn_insecure("the fl-secure server")
        authenticate = insecure_authenticator(coordinator.enrolled)
        port = _bind(address, lambda: server.add_insecure_port(address))
    else:
        if cert_dir is None:
            raise ConfigError("the server needs --certs DIR (or --insecure for a loopback test)")
        enrollment = load_enrollment(cert_dir)
        authenticate = tls_authenticator(enrollment)
        credentials = server_credentials(cert_dir)
        port = _bind(address, lambda: server.add_secure_port(address, credentials))
    if port == 0:
        raise ConfigError(f"could not bind the server to {address}")
    add_servicer(server, FlSecureServicer(coordinator, authenticate))
    server.start()
    log.info("serving on port %d (%s)", port, "INSECURE" if insecure else "mutual TLS")
    return server, port
