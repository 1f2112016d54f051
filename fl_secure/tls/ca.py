"""A certificate directory: create the CA, server and client certificates; add clients later.

The CA key (``ca.key``) is what makes a client identity: whoever holds it can enroll anyone the
server would accept. Keep it offline once the certificates are issued and pass its path to
``issue_client_certificate`` (``ca_key=``) when adding a client.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from fl_secure.errors import TlsError
from fl_secure.tls.certs import (
    CLOCK_SKEW,
    CertifiedKey,
    KeyType,
    check_days,
    load_certified_key,
    make_certificate,
)
from fl_secure.tls.enrollment import EnrollmentList, certificate_fingerprint
from fl_secure.tls.identity import REGISTRY_FILE, enrolled_signing_keys, write_signing_keys
from fl_secure.tls.layout import CertificateSet, StagedFiles, validate_client_id
from fl_secure.tls.registry import (
    REGISTRY_SIGNATURE,
    encode_registry,
    legacy_registry_keys,
    read_registry,
    sign_registry,
)

logger = logging.getLogger(__name__)

CA_COMMON_NAME = "fl-secure CA"
SERVER_COMMON_NAME = "fl-secure server"


def init_certificates(
    out_dir: str | os.PathLike[str],
    *,
    clients: int | Sequence[str],
    hosts: Sequence[str] = ("localhost", "127.0.0.1", "::1"),
    days: int = 365,
    ca_days: int = 3650,
    key_type: KeyType = "ec-p256",
    overwrite: bool = False,
) -> CertificateSet:
    """Create a CA, a server certificate, client certificates and ``enrolled.json``.

    Args:
        out_dir: directory to write into (created if needed).
        clients: a count (ids ``client-0`` .. ``client-{N-1}``) or explicit client ids.
        hosts: DNS names and IP addresses clients dial the server at (its SAN).
        days: validity of the server and client certificates, capped at the CA's expiry.
        ca_days: validity of the CA; no certificate it signs outlives it.
        key_type: key algorithm of every key.
        overwrite: replace an existing CA (every certificate it signed stops being trusted).
            Client files of the old CA that are not re-issued are left in ``clients/`` but are
            no longer enrolled.

    Returns:
        The paths written. ``ca.key`` must be moved offline after issuing.

    Raises:
        TlsError: invalid or duplicate client ids, invalid hosts or days, or an existing CA
            without ``overwrite``.
    """
    ids = _client_ids(clients)
    check_days(days)
    paths = CertificateSet(Path(out_dir), ids)
    existing = [p for p in (paths.ca_cert, paths.ca_key) if p.exists()]
    if existing and not overwrite:
        raise TlsError(
            f"{existing[0]} already exists: a new CA would invalidate every certificate the old "
            "one signed. Add a client with issue_client_certificate(), pick another --out, or "
            "pass overwrite=True (--overwrite) to start over"
        )
    ca = make_certificate("ca", CA_COMMON_NAME, days=ca_days, key_type=key_type)
    start, end = _leaf_validity(ca, days, "the server and client certificates")
    server = make_certificate(
        "server",
        SERVER_COMMON_NAME,
        issuer=ca,
        hosts=hosts,
        days=days,
        not_before=start,
        not_after=end,
        key_type=key_type,
    )
    issued = {
        client_id: make_certificate(
            "client",
            client_id,
            issuer=ca,
            days=days,
            not_before=start,
            not_after=end,
            key_type=key_type,
        )
        for client_id in ids
    }
    # Everything is generated before anything is replaced: a bad argument or a failed write
    # (a full disk) leaves the old set whole, never a new ca.pem beside the old ca.key.
    with StagedFiles() as files:
        ca.stage(files, paths.ca_cert, paths.ca_key)
        server.stage(files, paths.server_cert, paths.server_key)
        enrollment = EnrollmentList({})
        for client_id, cert in issued.items():
            cert.stage(files, paths.client_cert(client_id), paths.client_key(client_id))
            fingerprint = certificate_fingerprint(cert.certificate)
            enrollment = enrollment.with_client(client_id, fingerprint)
        files.write(paths.enrollment, enrollment.to_json(), mode=0o644)
        # Ed25519 identities for secure aggregation, a CA-signed list of exactly these clients
        write_signing_keys(paths, ids, files, signer=ca.private_key, replace=True, fresh=True)
    logger.info("wrote a CA, a server and %d client certificates to %s", len(ids), out_dir)
    logger.warning("move %s OFFLINE: whoever holds it can mint client identities", paths.ca_key)
    return paths


def issue_client_certificate(
    ca_dir: str | os.PathLike[str],
    client_id: str,
    *,
    days: int = 365,
    key_type: KeyType = "ec-p256",
    ca_key: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
) -> CertifiedKey:
    """Issue a certificate for one more client and enroll it in ``enrolled.json``.

    Args:
        ca_dir: a directory written by ``init_certificates``.
        client_id: the new client's id.
        days: validity, capped at the CA's own expiry.
        key_type: key algorithm.
        ca_key: path of the CA key when it is kept outside ``ca_dir`` (e.g. on offline media).
        overwrite: re-issue an existing client (one with ``clients/<id>.pem``, or listed in
            ``enrolled.json`` or ``signing_keys.json``); with fingerprint pinning this revokes
            its old certificate.

    Returns:
        The new certificate and key, also written to ``clients/<id>.pem`` / ``clients/<id>.key``.

    Raises:
        TlsError: invalid id or days, client already issued without ``overwrite``, CA or
            enrollment list missing or invalid, or a signing-key registry that does not verify
            against ``ca.pem`` (it is never re-signed).
    """
    paths = CertificateSet(Path(ca_dir), (validate_client_id(client_id),))
    check_days(days)
    cert_path = paths.client_cert(client_id)
    enrollment = EnrollmentList.load(paths.enrollment)
    signing_keys = enrolled_signing_keys(paths.directory)  # an altered registry stops here
    found = [
        str(where)
        for where, present in (
            (cert_path, cert_path.exists()),
            (paths.enrollment, enrollment.is_enrolled(client_id)),
            (paths.directory / REGISTRY_FILE, client_id in signing_keys),
        )
        if present
    ]
    if found and not overwrite:
        raise TlsError(
            f"client {client_id!r} is already issued: found in {', '.join(found)}; re-issue it "
            "with overwrite=True (`fl-secure certs issue --overwrite`); with fingerprint "
            "pinning the old certificate is then refused"
        )
    ca = load_certified_key(paths.ca_cert, Path(ca_key) if ca_key else paths.ca_key)
    start, end = _leaf_validity(ca, days, f"the certificate of {client_id}")
    cert = make_certificate(
        "client",
        client_id,
        issuer=ca,
        days=days,
        not_before=start,
        not_after=end,
        key_type=key_type,
    )
    enrollment = enrollment.with_client(client_id, certificate_fingerprint(cert.certificate))
    with StagedFiles() as files:  # all of the files, or none (a failed write changes nothing)
        cert.stage(files, cert_path, paths.client_key(client_id))
        files.write(paths.enrollment, enrollment.to_json(), mode=0o644)
        write_signing_keys(paths, [client_id], files, signer=ca.private_key, replace=overwrite)
    return cert


def resign_registry(
    ca_dir: str | os.PathLike[str], *, ca_key: str | os.PathLike[str] | None = None
) -> int:
    """Re-sign ``signing_keys.json`` unchanged but for its next version; return that version.

    It also migrates a registry written before versions (signed over the bare file, which
    sites refuse): its old signature is checked against ``ca.pem`` and its entries signed
    again as version 1. Every site then needs the new ``signing_keys.json`` and
    ``signing_keys.sig``.

    Args:
        ca_dir: a directory written by ``init_certificates``.
        ca_key: path of the CA key when it is kept outside ``ca_dir``.

    Raises:
        TlsError: the registry is missing, or verifies neither in the current format nor in
            the old one (an altered list is never re-signed); the CA key is unreadable.
    """
    directory = Path(ca_dir)
    try:
        current = read_registry(directory)
        keys, version = dict(current.keys), current.version + 1
    except TlsError:
        keys, version = legacy_registry_keys(directory), 1  # the old format, checked
    paths = CertificateSet(directory)
    ca = load_certified_key(paths.ca_cert, Path(ca_key) if ca_key else paths.ca_key)
    body = encode_registry(keys, version)
    with StagedFiles() as files:
        files.write(directory / REGISTRY_FILE, body, mode=0o644)
        files.write(directory / REGISTRY_SIGNATURE, sign_registry(ca.private_key, body), mode=0o644)
    logger.info("re-signed %s as version %d", directory / REGISTRY_FILE, version)
    return version


def _leaf_validity(ca: CertifiedKey, days: int, what: str) -> tuple[dt.datetime, dt.datetime]:
    """Start and end of a certificate signed by ``ca``: ``days`` from now, cut at the CA's end.

    A certificate must not outlive the CA that vouches for it; ``what`` names it in the warning
    logged when its end is cut.
    """
    now = dt.datetime.now(dt.UTC)
    end = min(now + dt.timedelta(days=days), ca.certificate.not_valid_after_utc)
    if end < now + dt.timedelta(days=days):
        logger.warning("%s cut to end with the CA, on %s", what, f"{end:%Y-%m-%d}")
    return now - CLOCK_SKEW, end


def _client_ids(clients: int | Sequence[str]) -> tuple[str, ...]:
    """Expand a count to default ids, or validate explicit ids."""
    if isinstance(clients, str):
        raise TlsError(f"clients={clients!r}: give a count or a list of ids, not one string")
    if isinstance(clients, int):
        if clients < 0:
            raise TlsError(f"clients must be >= 0, got {clients}")
        return tuple(f"client-{i}" for i in range(clients))
    ids = tuple(validate_client_id(c) for c in clients)
    duplicates = sorted({c for c in ids if ids.count(c) > 1})
    if duplicates:
        raise TlsError(f"duplicate client ids {duplicates}: every client needs its own id")
    return ids
