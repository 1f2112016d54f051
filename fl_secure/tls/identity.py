"""Long-term Ed25519 signing keys of the clients and the CA-signed registry of their public keys.

Secure aggregation signs each client's per-round key advertisement with a long-term identity
key, so that a server relaying the advertisements cannot substitute its own keys (Bonawitz et
al. 2017, the actively-secure variant's signatures). Every client, not only the server, must
know the enrolled public keys, and the server must not be able to forge that list: it is
written as ``signing_keys.json`` and signed by the CA (``signing_keys.sig``, ECDSA/RSA with
SHA-256 over the exact file bytes). A party with ``ca.pem`` verifies it before use.

Files (next to the TLS files of :class:`~fl_secure.tls.layout.CertificateSet`)::

    signing_keys.json           {"version": 1, "keys": {"client-0": "<hex Ed25519 public>", ...}}
    signing_keys.sig            CA signature of signing_keys.json
    clients/<id>.sign.key       the client's Ed25519 private key (PKCS#8 PEM, mode 0600)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fl_secure.errors import JSON_DOCUMENT_ERRORS, TlsError
from fl_secure.tls.certs import PrivateKey, load_ca_certificates
from fl_secure.tls.layout import (
    CLIENTS_DIR,
    CertificateSet,
    StagedFiles,
    read_bytes,
    validate_client_id,
)

REGISTRY_FILE = "signing_keys.json"
REGISTRY_SIGNATURE = "signing_keys.sig"


def signing_key_path(directory: Path, client_id: str) -> Path:
    """Where a client's Ed25519 private key lives."""
    return directory / CLIENTS_DIR / f"{validate_client_id(client_id)}.sign.key"


def write_signing_keys(
    paths: CertificateSet,
    client_ids: Sequence[str],
    files: StagedFiles,
    *,
    signer: PrivateKey,
    replace: bool = False,
    fresh: bool = False,
    public_keys: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Create an Ed25519 key per client and the CA-signed registry; return id -> hex public.

    Clients already in the registry keep their key unless ``replace`` (a re-issued client:
    a key that may have leaked with the old certificate must not outlive it); ``fresh``
    starts the registry over (a new CA: no earlier entry is carried into its signature).
    Otherwise the existing registry must verify against ``ca.pem`` before its entries are
    signed again: the CA key must not launder a key substituted in the folder. The registry
    is signed with ``signer`` (the CA key). The new files are added to ``files``, written
    together with the certificates they belong to. ``public_keys`` (id -> hex Ed25519 public
    key) enrolls keys a site made itself (``certs sign``): no private key is made or written
    for those ids.

    Raises:
        TlsError: the existing registry or its signature is missing or does not verify.
    """
    directory = paths.directory
    registry = {} if fresh else enrolled_signing_keys(directory)
    for client_id in client_ids:
        if public_keys and client_id in public_keys:  # the site's own key: no secret here
            registry[client_id] = public_keys[client_id]
            continue
        key_path = signing_key_path(directory, client_id)
        if client_id in registry and key_path.exists() and not replace:
            continue
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        files.write(key_path, pem, mode=0o600)
        registry[client_id] = key.public_key().public_bytes_raw().hex()
    text = json.dumps({"version": 1, "keys": dict(sorted(registry.items()))}, indent=2) + "\n"
    body = text.encode()
    if isinstance(signer, ec.EllipticCurvePrivateKey):
        signature = signer.sign(body, ec.ECDSA(hashes.SHA256()))
    else:
        signature = signer.sign(body, padding.PKCS1v15(), hashes.SHA256())
    files.write(directory / REGISTRY_FILE, body, mode=0o644)
    files.write(directory / REGISTRY_SIGNATURE, signature, mode=0o644)
    return registry


def enrolled_signing_keys(directory: Path) -> dict[str, str]:
    """The registry's entries (id -> hex public key) once it verifies; {} when there is none.

    Raises:
        TlsError: ``signing_keys.json`` or ``signing_keys.sig`` exists but the pair does not
            verify against ``ca.pem`` (or one of the two is missing).
    """
    if not (directory / REGISTRY_FILE).exists() and not (directory / REGISTRY_SIGNATURE).exists():
        return {}
    return {k: v.public_bytes_raw().hex() for k, v in load_signing_registry(directory).items()}


def _read_registry_unverified(directory: Path) -> dict[str, str]:
    raw = read_bytes(directory / REGISTRY_FILE, "signing-key registry")
    try:
        doc = json.loads(raw)
        keys = {str(k): str(v) for k, v in doc["keys"].items()}
    except JSON_DOCUMENT_ERRORS as exc:
        raise TlsError(f"{directory / REGISTRY_FILE} is not a valid signing-key registry") from exc
    return keys


def load_signing_registry(directory: Path) -> dict[str, Ed25519PublicKey]:
    """The enrolled Ed25519 public keys, after checking the CA's signature of the registry.

    Raises:
        TlsError: The registry or its signature is missing, ``ca.pem`` is unreadable or not a
            CA, or the signature does not verify against it (the list was altered or signed by
            someone else).
    """
    directory = Path(directory)
    body = read_bytes(directory / REGISTRY_FILE, "signing-key registry")
    signature = read_bytes(directory / REGISTRY_SIGNATURE, "signing-key registry signature")
    cas = load_ca_certificates(directory / "ca.pem")
    if not any(_signed_by(ca, signature, body) for ca in cas):
        raise TlsError(
            f"{directory / REGISTRY_FILE} does not verify against {directory / 'ca.pem'}: it "
            f"is not signed by the CA ({directory / REGISTRY_SIGNATURE} does not match it), so "
            "the list of client signing keys was altered; refusing to use it. Restore both "
            "files from the operator's trusted copy"
        )
    out: dict[str, Ed25519PublicKey] = {}
    for client_id, hex_key in _read_registry_unverified(directory).items():
        try:
            out[validate_client_id(client_id)] = Ed25519PublicKey.from_public_bytes(
                bytes.fromhex(hex_key)
            )
        except ValueError as exc:
            raise TlsError(f"signing key of {client_id!r} is not an Ed25519 key") from exc
    return out


def _signed_by(ca: x509.Certificate, signature: bytes, body: bytes) -> bool:
    """Whether ``signature`` is the CA's ECDSA / RSA PKCS#1 v1.5 signature of ``body``."""
    public = ca.public_key()
    try:
        if isinstance(public, ec.EllipticCurvePublicKey):
            public.verify(signature, body, ec.ECDSA(hashes.SHA256()))
        elif isinstance(public, rsa.RSAPublicKey):
            public.verify(signature, body, padding.PKCS1v15(), hashes.SHA256())
        else:
            return False
    except InvalidSignature:
        return False
    return True


def load_signing_key(directory: Path, client_id: str) -> Ed25519PrivateKey:
    """A client's Ed25519 private key.

    Raises:
        TlsError: The file is missing, unreadable or not an Ed25519 private key.
    """
    path = signing_key_path(Path(directory), client_id)
    try:
        key = serialization.load_pem_private_key(read_bytes(path, "signing key"), password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise TlsError(
            f"{path} is not a readable PEM private key ({exc}); copy this site's "
            "clients/<id>.sign.key again from the operator"
        ) from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise TlsError(f"{path} is not an Ed25519 private key")
    return key


def load_signing_identity(
    directory: Path, client_id: str
) -> tuple[Ed25519PrivateKey, dict[str, Ed25519PublicKey]]:
    """A client's signing key and the verified registry, checked to enroll exactly that key.

    A site that keeps an old key after being re-issued (or an old registry) would sign with a
    key its peers do not accept and be dropped mid-round; it is stopped here instead.

    Raises:
        TlsError: the key or the registry cannot be loaded, the registry has no entry for
            ``client_id``, or the entry is another public key.
    """
    directory = Path(directory)
    key = load_signing_key(directory, client_id)
    registry = load_signing_registry(directory)
    enrolled = registry.get(client_id)
    if enrolled is None:
        raise TlsError(
            f"no entry for {client_id!r} in {directory / REGISTRY_FILE}: the other sites would "
            "reject this site's signatures; copy signing_keys.json and signing_keys.sig issued "
            "last from the operator"
        )
    if enrolled.public_bytes_raw() != key.public_key().public_bytes_raw():
        raise TlsError(
            f"{signing_key_path(directory, client_id)} is not the key enrolled for "
            f"{client_id!r} in {directory / REGISTRY_FILE}: one of the two is stale (was the "
            "site re-issued?) and the other sites would reject this site's signatures; copy "
            "this site's clients/<id>.sign.key, signing_keys.json and signing_keys.sig issued "
            "last from the operator"
        )
    return key, registry


def registry_matches(registry: Mapping[str, Ed25519PublicKey], ids: Sequence[str]) -> list[str]:
    """Ids of ``ids`` without an enrolled signing key."""
    return [i for i in ids if i not in registry]
