"""Enrollment by request: a site makes its own keys, the CA signs only their public halves.

``create_request`` runs at the site. It writes the site's TLS private key and its Ed25519
signing key (both ``0600``) into the site's folder, and a request file: JSON with the id, a
PKCS#10 certificate signing request for the TLS key, and the signing public key. The request
is the only thing sent to the operator. ``sign_request`` runs at the CA: it checks the request
(the CSR's own signature, its common name against the id, the id's format, the key's type and
size), issues the certificate, enrolls the id in ``enrolled.json`` (pinned to the certificate's
fingerprint) and adds the signing key to the CA-signed registry. What it returns to the site
(``ca.pem``, ``clients/<id>.pem``, ``signing_keys.json``, ``signing_keys.sig``) holds no secret:
no private key of a site ever passes through the CA or the server.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import NameOID

from fl_secure.errors import JSON_DOCUMENT_ERRORS, TlsError
from fl_secure.tls.ca import (
    leaf_validity,
    load_ca_for_issue,
    signing_key_pem,
    stage_enrollment,
)
from fl_secure.tls.certs import (
    CLIENT_URI_PREFIX,
    KeyType,
    PublicKey,
    check_days,
    generate_key,
    issue_certificate,
)
from fl_secure.tls.identity import enrolled_signing_keys, signing_key_path
from fl_secure.tls.layout import (
    CA_PART,
    Bundle,
    CertificateSet,
    StagedFiles,
    is_layout_root,
    read_bytes,
    validate_client_id,
)

REQUEST_VERSION = 1
#: A request is a few kilobytes; anything much larger is not one (and is not parsed).
MAX_REQUEST_BYTES = 64 * 1024
_CURVES = (ec.SECP256R1, ec.SECP384R1)
_RSA_BITS = (2048, 3072, 4096)


def request_path(site_dir: Path, client_id: str) -> Path:
    """Where ``create_request`` writes the request of ``client_id``."""
    return site_dir / f"{validate_client_id(client_id)}.request.json"


def create_request(
    site_dir: str | os.PathLike[str],
    client_id: str,
    *,
    key_type: KeyType = "ec-p256",
    overwrite: bool = False,
) -> Path:
    """Make a site's TLS key, CSR and signing key; write the keys 0600 and the request file.

    Args:
        site_dir: the site's folder (created if needed); its keys stay there.
        client_id: the site's id, the common name of its certificate.
        key_type: algorithm of the TLS key.
        overwrite: replace keys made earlier (their certificate then no longer matches).

    Returns:
        The request file to send to the operator (``<site_dir>/<id>.request.json``).

    Raises:
        TlsError: an invalid id, or keys already in ``site_dir`` without ``overwrite``.
    """
    site = Bundle(Path(site_dir))
    validate_client_id(client_id)
    key_path, sign_path = site.client_key(client_id), signing_key_path(site.directory, client_id)
    existing = [p for p in (key_path, sign_path) if p.exists()]
    if existing and not overwrite:
        raise TlsError(
            f"{existing[0]} already exists: this site has keys; pass overwrite=True "
            "(--overwrite) to make new ones (the certificate issued for the old key then no "
            "longer matches, and the CA must sign the new request with --overwrite)"
        )
    key = generate_key(key_type)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, client_id)])
    uri = x509.UniformResourceIdentifier(CLIENT_URI_PREFIX + client_id)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(name)
        .add_extension(x509.SubjectAlternativeName([uri]), critical=False)
        .sign(key, hashes.SHA256())
    )
    signing = Ed25519PrivateKey.generate()
    doc = {
        "version": REQUEST_VERSION,
        "id": client_id,
        "csr": csr.public_bytes(serialization.Encoding.PEM).decode(),
        "signing_public_key": signing.public_key().public_bytes_raw().hex(),
    }
    out = request_path(site.directory, client_id)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    with StagedFiles() as files:
        files.write(key_path, key_pem, mode=0o600)
        files.write(sign_path, signing_key_pem(signing), mode=0o600)
        files.write(out, (json.dumps(doc, indent=2) + "\n").encode(), mode=0o644)
    return out


@dataclass(frozen=True)
class SigningRequest:
    """A request read and checked by :func:`read_request`.

    Attributes:
        client_id: the site's id.
        public_key: the TLS public key of the CSR.
        signing_public_hex: the site's Ed25519 public key, hex (as the registry lists it).
    """

    client_id: str
    public_key: PublicKey
    signing_public_hex: str


def read_request(path: Path) -> SigningRequest:
    """Read a request file and check everything in it.

    Raises:
        TlsError: naming the problem: not a JSON request, a missing or mistyped field, an
            invalid id, a CSR that does not parse or whose signature does not verify, a common
            name other than the id, a key of the wrong type or size, or a signing key that is
            not 32 bytes of Ed25519.
    """
    raw = read_bytes(path, "enrollment request")
    if len(raw) > MAX_REQUEST_BYTES:
        raise TlsError(f"{path} is {len(raw)} bytes: not a request (at most {MAX_REQUEST_BYTES})")
    try:
        doc = json.loads(raw)
    except JSON_DOCUMENT_ERRORS as exc:
        raise TlsError(f"{path} is not a JSON enrollment request ({exc})") from exc
    fields = _fields(path, doc)
    client_id = fields["id"]
    try:
        validate_client_id(client_id)
    except TlsError as exc:
        raise TlsError(f"{path}: {exc}") from None
    try:
        csr = x509.load_pem_x509_csr(fields["csr"].encode())
    except ValueError as exc:
        raise TlsError(f"{path}: 'csr' is not a PEM certificate signing request ({exc})") from exc
    if not csr.is_signature_valid:
        raise TlsError(
            f"{path}: the CSR's signature does not verify against its own public key: the "
            "request was altered, or not made with the key it names; make a new one with "
            "`fl-secure certs request`"
        )
    names = [a.value for a in csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if names != [client_id]:
        raise TlsError(
            f"{path}: the CSR's common name {names} is not the request's id {client_id!r}; a "
            "site may ask only for a certificate in its own name"
        )
    public_key = _checked_key(path, csr.public_key())
    try:
        signing = bytes.fromhex(fields["signing_public_key"])
        Ed25519PublicKey.from_public_bytes(signing)
    except ValueError as exc:
        raise TlsError(
            f"{path}: 'signing_public_key' is not a hex Ed25519 public key (32 bytes)"
        ) from exc
    return SigningRequest(client_id, public_key, signing.hex())


def _fields(path: Path, doc: Any) -> dict[str, str]:
    """The request's string fields, after checking its version."""
    if not isinstance(doc, dict):
        raise TlsError(f"{path} is not an enrollment request: expected a JSON object")
    if doc.get("version") != REQUEST_VERSION:
        raise TlsError(
            f"{path}: request version {doc.get('version')!r} is not {REQUEST_VERSION}; make it "
            "with this version's `fl-secure certs request`"
        )
    out = {}
    for name in ("id", "csr", "signing_public_key"):
        value = doc.get(name)
        if not isinstance(value, str):
            raise TlsError(f"{path}: field {name!r} is missing or not a string")
        out[name] = value
    return out


def _checked_key(path: Path, key: object) -> PublicKey:
    """The CSR's key if it is EC P-256/P-384 or RSA 2048-4096; TlsError otherwise."""
    if isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, _CURVES):
        return key
    if isinstance(key, rsa.RSAPublicKey) and key.key_size in _RSA_BITS:
        return key
    what = (
        f"an EC key on {key.curve.name}"
        if isinstance(key, ec.EllipticCurvePublicKey)
        else f"an RSA key of {key.key_size} bits"
        if isinstance(key, rsa.RSAPublicKey)
        else f"a {type(key).__name__}"
    )
    raise TlsError(
        f"{path}: the CSR holds {what}; use EC P-256 or P-384, or RSA of 2048, 3072 or 4096 bits"
    )


@dataclass(frozen=True)
class SignedRequest:
    """What ``sign_request`` wrote.

    Attributes:
        client_id: the enrolled id.
        certificate: the issued certificate, in the reply folder.
        reply_dir: the folder to send back to the site (no secret in it).
        updated: other folders that got the new enrollment and registry.
    """

    client_id: str
    certificate: Path
    reply_dir: Path
    updated: tuple[Path, ...]


def sign_request(
    ca_dir: str | os.PathLike[str],
    request: str | os.PathLike[str],
    *,
    days: int = 365,
    out: str | os.PathLike[str] | None = None,
    server_dir: str | os.PathLike[str] | None = None,
    ca_key: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
) -> SignedRequest:
    """Check a site's request, issue its certificate and enroll it (TLS and signing key).

    Args:
        ca_dir: the CA's folder (``ca.pem``, ``ca.key``, ``enrolled.json``, the registry):
            ``DIR/ca`` of ``certs init``.
        request: the request file the site sent.
        days: validity, capped at the CA's end.
        out: where the reply goes (``ca.pem``, ``clients/<id>.pem``, the registry): a folder
            to send to the site, or the site's folder itself; default: the request's folder.
        server_dir: a server folder to enroll the id in as well. When ``ca_dir`` is the ``ca/``
            of a ``certs init`` folder, its ``server/`` and every ``sites/<id>/`` get the new
            enrollment and registry without being named.
        ca_key: the CA key when kept outside ``ca_dir``.
        overwrite: re-issue an id already enrolled (revokes its old certificate).

    Returns:
        The paths written.

    Raises:
        TlsError: a bad request (named by :func:`read_request`), an id already issued
            without ``overwrite``, a signing key already enrolled for another id, or a CA,
            enrollment list or registry that cannot be loaded or does not verify.
    """
    ca_dir, request = Path(ca_dir), Path(request)
    check_days(days)
    req = read_request(request)
    registry = enrolled_signing_keys(ca_dir)
    taken = [c for c, k in registry.items() if k == req.signing_public_hex and c != req.client_id]
    if taken:
        raise TlsError(
            f"{request}: its signing key is already enrolled for {taken[0]!r}; every site "
            "needs its own key (make a new request with `fl-secure certs request`)"
        )
    ca = load_ca_for_issue(ca_dir, req.client_id, overwrite, ca_key)
    start, end = leaf_validity(ca, days, f"the certificate of {req.client_id}")
    cert = issue_certificate(
        "client", req.client_id, req.public_key, issuer=ca, not_before=start, not_after=end
    )
    reply = Path(out) if out is not None else request.parent
    updated = [Path(server_dir)] if server_dir is not None else []
    root = CertificateSet(ca_dir.parent)
    if ca_dir.name == CA_PART and is_layout_root(root.directory):
        updated += [root.server_dir, *(root.site_dir(c) for c in root.site_ids())]
    updated = [d for d in dict.fromkeys(updated) if d.resolve() != reply.resolve()]
    cert_path = Bundle(reply).client_cert(req.client_id)
    with StagedFiles() as files:  # every file, or none
        pem = cert.public_bytes(serialization.Encoding.PEM)
        files.write(cert_path, pem, mode=0o644)
        stage_enrollment(
            files,
            ca_dir,
            req.client_id,
            cert,
            req.signing_public_hex,
            signer=ca.private_key,
            copies=[reply, *updated],
            replace=overwrite,
        )
    return SignedRequest(req.client_id, cert_path, reply, tuple(updated))
