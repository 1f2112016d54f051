"""gRPC side of mutual TLS: credentials, the peer's identity, and the per-call enrollment check.

How gRPC reports a refused peer: a client whose certificate fails verification (unknown CA,
expired, wrong EKU, none at all) or that speaks plaintext to a TLS port never reaches a
handler; the TLS handshake fails on the server and the client only sees ``UNAVAILABLE``
("Socket closed"). A verified but unenrolled client reaches the handler, where
``require_enrolled`` aborts with ``PERMISSION_DENIED``.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import NoReturn

import grpc
from cryptography.hazmat.primitives import serialization

from fl_secure.errors import TlsError
from fl_secure.logsafe import RefusalLog
from fl_secure.tls.certs import (
    CertifiedKey,
    check_issued_by,
    load_ca_certificates,
    load_certified_key,
)
from fl_secure.tls.enrollment import EnrollmentList
from fl_secure.tls.layout import Bundle, server_bundle, site_bundle, validate_client_id

logger = logging.getLogger(__name__)
#: Refused peers, one line per address per interval (a loop of refused calls is no flood).
_refusals = RefusalLog(logger)


class InsecureTransportWarning(RuntimeWarning):
    """Traffic is sent without TLS: updates and identities are exposed to the network."""


def server_credentials(cert_dir: str | os.PathLike[str]) -> grpc.ServerCredentials:
    """Server credentials that require a client certificate signed by the directory's CA.

    ``cert_dir`` is the server's folder (or the whole ``certs init`` folder: its ``server/``).

    Raises:
        TlsError: ``ca.pem``, ``server.pem`` or ``server.key`` is missing, invalid, mismatched
            or expired, or ``server.pem`` was not issued by ``ca.pem``.
    """
    paths = Bundle(server_bundle(cert_dir))
    server = load_certified_key(paths.server_cert, paths.server_key)
    ca_pem = _trusted_ca_pem(paths, server, paths.server_cert)
    return grpc.ssl_server_credentials(
        [(server.key_pem, server.cert_pem)], root_certificates=ca_pem, require_client_auth=True
    )


def channel_credentials(
    cert_dir: str | os.PathLike[str], client_id: str
) -> grpc.ChannelCredentials:
    """Channel credentials presenting ``clients/<client_id>.pem`` and trusting ``ca.pem``.

    ``cert_dir`` is the site's folder (or the whole ``certs init`` folder: its
    ``sites/<client_id>/``).

    Raises:
        TlsError: a file is missing, invalid, mismatched or expired, or the client certificate
            was not issued by ``ca.pem``.
    """
    paths = Bundle(site_bundle(cert_dir, validate_client_id(client_id)))
    client = load_certified_key(paths.client_cert(client_id), paths.client_key(client_id))
    ca_pem = _trusted_ca_pem(paths, client, paths.client_cert(client_id))
    return grpc.ssl_channel_credentials(
        root_certificates=ca_pem, private_key=client.key_pem, certificate_chain=client.cert_pem
    )


def _trusted_ca_pem(paths: Bundle, own: CertifiedKey, own_path: Path) -> bytes:
    """``ca.pem`` parsed and checked to have issued ``own``, as PEM for gRPC.

    gRPC takes the raw bytes without checking them: a damaged file would only surface as a
    failed bind on the server ("is the port in use?") or as endless retries on the client.
    """
    cas = load_ca_certificates(paths.ca_cert)
    check_issued_by(own.certificate, own_path, cas, paths.ca_cert)
    return b"".join(ca.public_bytes(serialization.Encoding.PEM) for ca in cas)


def peer_client_id(context: grpc.ServicerContext) -> str | None:
    """The common name of the peer's verified certificate, or None for an unauthenticated peer.

    The id is read from ``x509_common_name`` of ``context.auth_context()`` and only when
    ``transport_security_type`` is ``ssl``. (gRPC's own ``peer_identities()`` would return the
    SAN URI instead, because client certificates carry one.)
    """
    auth = context.auth_context() or {}
    if [bytes(v) for v in auth.get("transport_security_type", ())] != [b"ssl"]:
        return None
    names = auth.get("x509_common_name") or []
    if len(names) != 1:
        return None
    return bytes(names[0]).decode("utf-8", errors="replace")


def require_enrolled(context: grpc.ServicerContext, enrollment: EnrollmentList) -> str:
    """Return the peer's client id, or abort the call if the peer is not an enrolled client.

    Aborts with ``UNAUTHENTICATED`` when the peer has no verified certificate, and with
    ``PERMISSION_DENIED`` when its id is not enrolled or, with pinning, its certificate's
    fingerprint differs from the enrolled one. For synchronous servers (``context.abort``
    raises); ``grpc.aio`` contexts need an awaiting variant.
    """
    client_id = peer_client_id(context)
    if client_id is None:
        _abort(
            context,
            grpc.StatusCode.UNAUTHENTICATED,
            "no verified client certificate: connect with mutual TLS "
            "(fl-secure certs init --out DIR --clients N)",
        )
    if not enrollment.is_enrolled(client_id):
        _abort(
            context,
            grpc.StatusCode.PERMISSION_DENIED,
            f"client {client_id!r} is not enrolled on this server; ask the operator to add it "
            "to enrolled.json",
        )
    pems = (context.auth_context() or {}).get("x509_pem_cert") or [None]
    if not enrollment.matches(client_id, pems[0]):
        _abort(
            context,
            grpc.StatusCode.PERMISSION_DENIED,
            f"certificate of client {client_id!r} is not the enrolled one (SHA-256 fingerprint "
            "differs); use the certificate issued last for this client",
        )
    return client_id


def warn_insecure(what: str = "this connection") -> None:
    """Warn loudly, as a Python warning and a log record, that ``what`` runs without TLS."""
    message = (
        f"INSECURE: {what} uses plaintext gRPC without TLS. Model updates, round metadata and "
        "client identities can be read and forged by anyone on the network path, and the "
        "server cannot tell which client is which. Use it only on a trusted loopback for "
        "testing; create certificates with `fl-secure certs init --out DIR --clients N`."
    )
    warnings.warn(message, InsecureTransportWarning, stacklevel=2)
    logger.warning(message)


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """Log and abort the call; ``context.abort`` raises, the final raise is a safety net."""
    peer = context.peer()
    _refusals.warn(peer.rpartition(":")[0] or peer, "refused peer %s: %s", peer, message)
    context.abort(code, message)
    raise TlsError(message)
