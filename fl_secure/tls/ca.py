"""A certificate directory: create the CA, server and client certificates; add clients later.

The CA key (``ca/ca.key``) is what makes a client identity: whoever holds it can enroll anyone
the server would accept. Keep it offline once the certificates are issued and pass its path to
``issue_client_certificate`` (``ca_key=``) when adding a client. Each party's folder holds only
its own private keys (:class:`~fl_secure.tls.layout.CertificateSet`).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fl_secure.errors import TlsError
from fl_secure.tls.certs import (
    CLOCK_SKEW,
    CertifiedKey,
    KeyType,
    PrivateKey,
    check_days,
    load_certified_key,
    make_certificate,
)
from fl_secure.tls.enrollment import EnrollmentList, certificate_fingerprint
from fl_secure.tls.identity import (
    REGISTRY_FILE,
    enrolled_signing_keys,
    signing_key_path,
    write_signing_keys,
)
from fl_secure.tls.layout import (
    CA_CERT,
    CA_KEY,
    CA_PART,
    Bundle,
    CertificateSet,
    StagedFiles,
    is_layout_root,
    read_bytes,
    validate_client_id,
)
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
    """Create a CA, a server, client certificates and keys: one folder per party.

    The one-machine convenience (and the embedded mode's): every key is made here, then each
    party gets only its own. ``ca/`` holds the CA key and its records, ``server/`` what the
    server reads (no client secret), ``sites/<id>/`` what one site reads. On separate machines
    a site makes its own keys instead (:mod:`fl_secure.tls.request`).

    Args:
        out_dir: directory to write into (created if needed).
        clients: a count (ids ``client-0`` .. ``client-{N-1}``) or explicit client ids.
        hosts: DNS names and IP addresses clients dial the server at (its SAN).
        days: validity of the server and client certificates, capped at the CA's expiry.
        ca_days: validity of the CA; no certificate it signs outlives it.
        key_type: key algorithm of every key.
        overwrite: replace an existing CA (every certificate it signed stops being trusted).
            Site folders of the old CA that are not re-issued are left in ``sites/`` but are
            no longer enrolled.

    Returns:
        The paths written. ``ca/ca.key`` must be moved offline after issuing.

    Raises:
        TlsError: invalid or duplicate client ids, invalid hosts or days, or an existing CA
            without ``overwrite``.
    """
    ids = _client_ids(clients)
    check_days(days)
    paths = CertificateSet(Path(out_dir), ids)
    old = Path(out_dir)  # the single-folder layout of earlier versions
    candidates = (paths.ca_cert, paths.ca_key, old / CA_CERT, old / CA_KEY)
    existing = [p for p in candidates if p.exists()]
    if existing and not overwrite:
        raise TlsError(
            f"{existing[0]} already exists: a new CA would invalidate every certificate the old "
            "one signed. Add a client with issue_client_certificate(), pick another --out, or "
            "pass overwrite=True (--overwrite) to start over"
        )
    ca = make_certificate("ca", CA_COMMON_NAME, days=ca_days, key_type=key_type)
    start, end = leaf_validity(ca, days, "the server and client certificates")
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
    signing = {client_id: Ed25519PrivateKey.generate() for client_id in ids}
    # Everything is generated before anything is replaced: a bad argument or a failed write
    # (a full disk) leaves the old set whole, never a new ca.pem beside the old ca.key.
    with StagedFiles() as files:
        ca.stage(files, paths.ca_cert, paths.ca_key)
        server.stage(files, paths.server_cert, paths.server_key)
        files.write(paths.server.ca_cert, ca.cert_pem, mode=0o644)
        enrollment = EnrollmentList({})
        for client_id, cert in issued.items():
            _stage_site(files, paths.site(client_id), client_id, ca, cert, signing[client_id])
            files.write(paths.ca.client_cert(client_id), cert.cert_pem, mode=0o644)
            fingerprint = certificate_fingerprint(cert.certificate)
            enrollment = enrollment.with_client(client_id, fingerprint)
        for bundle in (paths.ca, paths.server):
            files.write(bundle.enrollment, enrollment.to_json(), mode=0o644)
        # Ed25519 identities for secure aggregation, a CA-signed list of exactly these clients
        stage_registry(
            files,
            paths.ca_dir,
            _public_hex(signing),
            signer=ca.private_key,
            copies=[paths.server_dir, *(paths.site_dir(c) for c in ids)],
            replace=True,
            fresh=True,
        )
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
    """Issue a certificate and keys for one more client in a set of ``init_certificates``.

    The one-machine convenience: the keys are made here and written to ``sites/<id>/``. The
    client is enrolled in ``ca/`` and ``server/``, and the re-signed registry is copied to the
    server and every site folder. (A site on its own machine uses ``certs request`` instead.)

    Args:
        ca_dir: a directory written by ``init_certificates``.
        client_id: the new client's id.
        days: validity, capped at the CA's own expiry.
        key_type: key algorithm.
        ca_key: path of the CA key when it is kept outside ``ca/`` (e.g. on offline media).
        overwrite: re-issue an existing client (one with ``sites/<id>/clients/<id>.pem``, or
            listed in ``enrolled.json`` or ``signing_keys.json``); with fingerprint pinning
            this revokes its old certificate.

    Returns:
        The new certificate and key, also written to ``sites/<id>/clients/<id>.pem`` / ``.key``.

    Raises:
        TlsError: invalid id or days, client already issued without ``overwrite``, CA or
            enrollment list missing or invalid, or a signing-key registry that does not verify
            against ``ca.pem`` (it is never re-signed).
    """
    paths = CertificateSet(Path(ca_dir), (validate_client_id(client_id),))
    check_days(days)
    cert_path = paths.client_cert(client_id)
    ca = load_ca_for_issue(paths.ca_dir, client_id, overwrite, ca_key, also=[cert_path])
    start, end = leaf_validity(ca, days, f"the certificate of {client_id}")
    cert = make_certificate(
        "client",
        client_id,
        issuer=ca,
        days=days,
        not_before=start,
        not_after=end,
        key_type=key_type,
    )
    signing = Ed25519PrivateKey.generate()
    sites = [paths.site_dir(c) for c in {*paths.site_ids(), client_id}]
    with StagedFiles() as files:  # all of the files, or none (a failed write changes nothing)
        _stage_site(files, paths.site(client_id), client_id, ca, cert, signing)
        stage_enrollment(
            files,
            paths.ca_dir,
            client_id,
            cert.certificate,
            _public_hex({client_id: signing})[client_id],
            signer=ca.private_key,
            copies=[*([paths.server_dir] if paths.server_dir.is_dir() else []), *sites],
            replace=overwrite,
        )
    return cert


def resign_registry(
    ca_dir: str | os.PathLike[str], *, ca_key: str | os.PathLike[str] | None = None
) -> int:
    """Re-sign ``signing_keys.json`` unchanged but for its next version; return that version.

    It also migrates a registry written before versions (signed over the bare file, which
    sites refuse): its old signature is checked against ``ca.pem`` and its entries signed
    again as version 1. Given a folder of ``init_certificates`` (or its ``ca/``), the new
    registry is also copied to its ``server/`` and every ``sites/<id>/``; elsewhere every
    site needs the new ``signing_keys.json`` and ``signing_keys.sig``.

    Args:
        ca_dir: the CA's folder (``ca/``), or the folder ``init_certificates`` wrote.
        ca_key: path of the CA key when it is kept outside the CA's folder.

    Raises:
        TlsError: the registry is missing, or verifies neither in the current format nor in
            the old one (an altered list is never re-signed); the CA key is unreadable.
    """
    directory = Path(ca_dir)
    if is_layout_root(directory):
        root: CertificateSet | None = CertificateSet(directory)
    elif directory.name == CA_PART and is_layout_root(directory.parent):
        root = CertificateSet(directory.parent)
    else:
        root = None
    folder = root.ca_dir if root is not None else directory
    copies = []
    if root is not None:
        server = [root.server_dir] if root.server_dir.is_dir() else []
        copies = [*server, *(root.site_dir(c) for c in root.site_ids())]
    try:
        current = read_registry(folder)
        keys, version = dict(current.keys), current.version + 1
    except TlsError:
        keys, version = legacy_registry_keys(folder), 1  # the old format, checked
    ca_files = Bundle(folder)
    ca = load_certified_key(ca_files.ca_cert, Path(ca_key) if ca_key else ca_files.ca_key)
    body = encode_registry(keys, version)
    signature = sign_registry(ca.private_key, body)
    with StagedFiles() as files:  # every copy, or none
        for target in (folder, *copies):
            files.write(target / REGISTRY_FILE, body, mode=0o644)
            files.write(target / REGISTRY_SIGNATURE, signature, mode=0o644)
    logger.info("re-signed %s as version %d", folder / REGISTRY_FILE, version)
    return version


def load_ca_for_issue(
    ca_dir: Path,
    client_id: str,
    overwrite: bool,
    ca_key: str | os.PathLike[str] | None,
    *,
    also: Sequence[Path] = (),
) -> CertifiedKey:
    """The CA, once ``client_id`` is known to be new (or ``overwrite``) and the registry verifies.

    Raises:
        TlsError: the id is already issued (its certificate in ``ca_dir`` or ``also``, its
            entry in ``enrolled.json`` or ``signing_keys.json``) without ``overwrite``; the
            enrollment list, the registry or the CA cannot be loaded or does not verify.
    """
    ca_files = Bundle(ca_dir)
    enrollment = EnrollmentList.load(ca_files.enrollment)
    signing_keys = enrolled_signing_keys(ca_dir)  # an altered registry stops here
    cert_paths = [ca_files.client_cert(client_id), *also]
    found = [
        str(where)
        for where, present in (
            *((p, p.exists()) for p in cert_paths),
            (ca_files.enrollment, enrollment.is_enrolled(client_id)),
            (ca_dir / REGISTRY_FILE, client_id in signing_keys),
        )
        if present
    ]
    if found and not overwrite:
        raise TlsError(
            f"client {client_id!r} is already issued: found in {', '.join(found)}; re-issue it "
            "with overwrite=True (`fl-secure certs issue --overwrite`, `certs sign "
            "--overwrite`); with fingerprint pinning the old certificate is then refused"
        )
    return load_certified_key(ca_files.ca_cert, Path(ca_key) if ca_key else ca_files.ca_key)


def stage_enrollment(
    files: StagedFiles,
    ca_dir: Path,
    client_id: str,
    cert: x509.Certificate,
    signing_public_hex: str,
    *,
    signer: PrivateKey,
    copies: Sequence[Path],
    replace: bool,
) -> None:
    """Enroll one client: the CA's records, and the server's and sites' copies of them.

    ``ca_dir/enrolled.json`` gets the certificate's fingerprint, ``ca_dir/clients/<id>.pem``
    the certificate, the registry (re-signed only if it verifies) its signing key. A folder in
    ``copies`` that holds a server certificate gets the client added to its own
    ``enrolled.json``; every folder in ``copies`` gets the re-signed registry and ``ca.pem``.
    """
    ca_files = Bundle(ca_dir)
    fingerprint = certificate_fingerprint(cert)
    enrollment = EnrollmentList.load(ca_files.enrollment).with_client(client_id, fingerprint)
    files.write(ca_files.enrollment, enrollment.to_json(), mode=0o644)
    pem = cert.public_bytes(serialization.Encoding.PEM)
    files.write(ca_files.client_cert(client_id), pem, mode=0o644)
    for copy in copies:
        served = Bundle(copy)
        if served.server_cert.exists():  # a server folder keeps its own list, plus this id
            own = EnrollmentList.load(served.enrollment) if served.enrollment.exists() else None
            listed = (own or EnrollmentList({})).with_client(client_id, fingerprint)
            files.write(served.enrollment, listed.to_json(), mode=0o644)
    stage_registry(
        files,
        ca_dir,
        {client_id: signing_public_hex},
        signer=signer,
        copies=copies,
        replace=replace,
    )


def stage_registry(
    files: StagedFiles,
    ca_dir: Path,
    public_keys: dict[str, str],
    *,
    signer: PrivateKey,
    copies: Sequence[Path],
    replace: bool,
    fresh: bool = False,
) -> None:
    """Re-sign the CA's registry with ``public_keys`` added; copy it (and ``ca.pem``) to ``copies``.

    The registry is made by :func:`~fl_secure.tls.identity.write_signing_keys` in ``ca_dir``;
    its files are then written into each copy as well, so that a server or a site verifies
    exactly the list the CA signed. No private key is written anywhere.
    """
    captured = _CapturedFiles()
    write_signing_keys(
        CertificateSet(ca_dir),
        list(public_keys),
        captured,
        signer=signer,
        replace=replace,
        fresh=fresh,
        public_keys=public_keys,
    )
    ca_pem = files.staged(Bundle(ca_dir).ca_cert) or read_bytes(
        Bundle(ca_dir).ca_cert, "CA certificate"
    )
    for path, data, mode in captured.written:
        relative = path.relative_to(ca_dir)
        for folder in (ca_dir, *copies):
            files.write(folder / relative, data, mode=mode)
    for folder in copies:
        files.write(Bundle(folder).ca_cert, ca_pem, mode=0o644)


class _CapturedFiles(StagedFiles):
    """What :func:`write_signing_keys` writes, kept in memory to be written where it belongs."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[tuple[Path, bytes, int]] = []

    def write(self, path: Path, data: bytes, *, mode: int) -> None:
        """Keep ``data`` for ``path``; nothing is written."""
        self.written.append((path, data, mode))


def _stage_site(
    files: StagedFiles,
    site: Bundle,
    client_id: str,
    ca: CertifiedKey,
    cert: CertifiedKey,
    signing: Ed25519PrivateKey,
) -> None:
    """A site folder's own files: ``ca.pem``, its certificate and key, its signing key."""
    cert.stage(files, site.client_cert(client_id), site.client_key(client_id))
    files.write(site.ca_cert, ca.cert_pem, mode=0o644)
    files.write(signing_key_path(site.directory, client_id), signing_key_pem(signing), mode=0o600)


def signing_key_pem(key: Ed25519PrivateKey) -> bytes:
    """An Ed25519 private key as unencrypted PKCS#8 PEM (written 0600)."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _public_hex(keys: dict[str, Ed25519PrivateKey]) -> dict[str, str]:
    """Id -> hex raw public key, as the registry lists it."""
    return {c: k.public_key().public_bytes_raw().hex() for c, k in keys.items()}


def leaf_validity(ca: CertifiedKey, days: int, what: str) -> tuple[dt.datetime, dt.datetime]:
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
