"""The CA-signed registry of the sites' Ed25519 signing keys: its format, signature and version.

``signing_keys.json`` lists every enrolled site's public signing key; ``signing_keys.sig`` is
the CA's signature of it. Two properties are bound into what the CA signs:

* **Context.** The CA key also signs X.509 certificates. The registry is therefore signed over
  ``REGISTRY_CONTEXT + file bytes`` (``fl-secure signing-key registry v1`` and a NUL byte),
  never over the bare file: a certificate signature covers a DER ``TBSCertificate``, which
  begins with a SEQUENCE tag (``0x30``), while every registry message begins with ``f``
  (``0x66``), so no signature of one kind verifies as the other.
* **Version.** Each re-signing (``certs init``, ``certs issue``, ``certs resign-registry``)
  writes the next integer ``version`` and the UTC time it was issued. A site remembers the
  newest version it accepted (:mod:`fl_secure.tls.registry_seen`) and refuses an older one, so
  an old registry, which still lists a revoked site's old key, cannot be served to it again.

The file (format 2)::

    {"format": 2, "version": 3, "issued": "2026-11-28T00:40:12Z",
     "keys": {"client-0": "<hex Ed25519 public>", ...}}

A registry written before versions (``{"version": 1, "keys": ...}``, signed over the bare
file) is refused with a message naming ``fl-secure certs resign-registry``, which re-signs it
in this format (:func:`legacy_registry_keys` is the only reader of the old signature).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa

from fl_secure.errors import JSON_DOCUMENT_ERRORS, TlsError
from fl_secure.tls.certs import PrivateKey, load_ca_certificates
from fl_secure.tls.layout import read_bytes, validate_client_id

REGISTRY_FILE = "signing_keys.json"
REGISTRY_SIGNATURE = "signing_keys.sig"
#: Prefixed to the file bytes before the CA signs them: a registry signature is never a
#: signature of anything else the CA signs (an X.509 TBSCertificate starts with 0x30).
REGISTRY_CONTEXT = b"fl-secure signing-key registry v1\x00"
REGISTRY_FORMAT = 2
RESIGN_HINT = (
    "the operator re-signs it with `fl-secure certs resign-registry --out DIR` (it needs the CA "
    "key) and gives every site the new signing_keys.json and signing_keys.sig"
)


@dataclass(frozen=True)
class SignedRegistry:
    """A registry whose CA signature has been checked.

    Attributes:
        version: Its version: each re-signing writes the previous one's plus 1.
        issued: When the CA signed it (UTC, ISO 8601).
        keys: Client id -> hex Ed25519 public key.
        sha256: Hex SHA-256 of the file bytes (two registries of one version must match).
        ca_sha256: Hex SHA-256 of the DER certificate of the CA whose signature verified.
    """

    version: int
    issued: str
    keys: Mapping[str, str]
    sha256: str
    ca_sha256: str


def registry_message(body: bytes) -> bytes:
    """What the CA signs for the registry file ``body``: the context string, then the bytes."""
    return REGISTRY_CONTEXT + body


def encode_registry(
    keys: Mapping[str, str], version: int, issued: dt.datetime | None = None
) -> bytes:
    """The bytes of ``signing_keys.json`` for ``keys`` at ``version`` (issued now by default)."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise TlsError(f"a registry version is an integer >= 1, not {version!r}")
    when = (issued or dt.datetime.now(dt.UTC)).astimezone(dt.UTC)
    doc = {
        "format": REGISTRY_FORMAT,
        "version": version,
        "issued": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "keys": dict(sorted(keys.items())),
    }
    return (json.dumps(doc, indent=2) + "\n").encode()


def sign_registry(signer: PrivateKey, body: bytes) -> bytes:
    """The CA's signature (ECDSA or RSA PKCS#1 v1.5, SHA-256) of :func:`registry_message`."""
    message = registry_message(body)
    if isinstance(signer, ec.EllipticCurvePrivateKey):
        return signer.sign(message, ec.ECDSA(hashes.SHA256()))
    return signer.sign(message, padding.PKCS1v15(), hashes.SHA256())


def read_registry(directory: Path) -> SignedRegistry:
    """The registry of ``directory`` once its signature verifies against ``ca.pem``.

    Raises:
        TlsError: The registry or its signature is missing, ``ca.pem`` is unreadable or not a
            CA, the signature does not verify (the list was altered, signed by someone else,
            or signed in the old format without the context string), or the file is not a
            format-2 registry.
    """
    directory = Path(directory)
    body = read_bytes(directory / REGISTRY_FILE, "signing-key registry")
    signature = read_bytes(directory / REGISTRY_SIGNATURE, "signing-key registry signature")
    cas = load_ca_certificates(directory / "ca.pem")
    message = registry_message(body)
    signer = next((ca for ca in cas if _signed_by(ca, signature, message)), None)
    if signer is None:
        legacy = _legacy_format(body)
        raise TlsError(
            f"{directory / REGISTRY_FILE} does not verify against {directory / 'ca.pem'}: "
            + (
                "it was signed before registries carried a version and a context string, and "
                f"is refused (an old copy could list revoked keys); {RESIGN_HINT}"
                if legacy
                else f"it is not signed by the CA ({directory / REGISTRY_SIGNATURE} does not "
                "match it), so the list of client signing keys was altered; refusing to use "
                "it. Restore both files from the operator's trusted copy"
            )
        )
    return _parse(directory / REGISTRY_FILE, body, signer)


def legacy_registry_keys(directory: Path) -> dict[str, str]:
    """The keys of a registry written before versions, once its bare signature verifies.

    Only :func:`fl_secure.tls.ca.resign_registry` calls it, where the CA key re-signs the
    entries in format 2; sites and the server never accept this format.

    Raises:
        TlsError: it is not an old-format registry, or its signature does not verify.
    """
    directory = Path(directory)
    body = read_bytes(directory / REGISTRY_FILE, "signing-key registry")
    signature = read_bytes(directory / REGISTRY_SIGNATURE, "signing-key registry signature")
    cas = load_ca_certificates(directory / "ca.pem")
    if not _legacy_format(body) or not any(_signed_by(ca, signature, body) for ca in cas):
        raise TlsError(
            f"{directory / REGISTRY_FILE} is neither a registry of the CA in "
            f"{directory / 'ca.pem'} nor an old-format one it signed; refusing to re-sign it. "
            "Restore both files from the operator's trusted copy"
        )
    return _keys(directory / REGISTRY_FILE, json.loads(body))


def _legacy_format(body: bytes) -> bool:
    """Whether ``body`` parses as a registry of the format before versions (no ``format``)."""
    try:
        doc = json.loads(body)
        return isinstance(doc, dict) and "format" not in doc and isinstance(doc["keys"], dict)
    except JSON_DOCUMENT_ERRORS:
        return False


def _parse(path: Path, body: bytes, ca: x509.Certificate) -> SignedRegistry:
    """Read a registry file whose signature has verified; TlsError naming what is wrong."""
    try:
        doc = json.loads(body)
        fmt, version, issued = doc["format"], doc["version"], doc["issued"]
        dt.datetime.fromisoformat(issued)
    except JSON_DOCUMENT_ERRORS as exc:
        raise TlsError(f"{path} is not a valid signing-key registry ({exc!r})") from exc
    if fmt != REGISTRY_FORMAT:
        raise TlsError(f"{path} is registry format {fmt!r}; this version reads format 2")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise TlsError(f"{path} has version {version!r}; a registry version is an integer >= 1")
    return SignedRegistry(
        version=version,
        issued=str(issued),
        keys=_keys(path, doc),
        sha256=hashlib.sha256(body).hexdigest(),
        ca_sha256=ca.fingerprint(hashes.SHA256()).hex(),
    )


def _keys(path: Path, doc: Any) -> dict[str, str]:
    """The ``keys`` object of a registry document, with valid ids and hex strings."""
    try:
        keys = {str(k): str(v) for k, v in doc["keys"].items()}
    except JSON_DOCUMENT_ERRORS as exc:
        raise TlsError(f"{path} is not a valid signing-key registry ({exc!r})") from exc
    for client_id in keys:
        validate_client_id(client_id)
    return keys


def _signed_by(ca: x509.Certificate, signature: bytes, message: bytes) -> bool:
    """Whether ``signature`` is the CA's ECDSA / RSA PKCS#1 v1.5 signature of ``message``."""
    public = ca.public_key()
    try:
        if isinstance(public, ec.EllipticCurvePublicKey):
            public.verify(signature, message, ec.ECDSA(hashes.SHA256()))
        elif isinstance(public, rsa.RSAPublicKey):
            public.verify(signature, message, padding.PKCS1v15(), hashes.SHA256())
        else:
            return False
    except InvalidSignature:
        return False
    return True
