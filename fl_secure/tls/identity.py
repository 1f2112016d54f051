"""Long-term Ed25519 signing keys of the clients and the CA-signed registry of their public keys.

Secure aggregation signs each client's per-round key advertisement with a long-term identity
key, so that a server relaying the advertisements cannot substitute its own keys (Bonawitz et
al. 2017, the actively-secure variant's signatures). Every client, not only the server, must
know the enrolled public keys, and the server must not be able to forge that list: it is
written as ``signing_keys.json`` and signed by the CA (``signing_keys.sig``, ECDSA/RSA with
SHA-256 over a context string and the exact file bytes, :mod:`fl_secure.tls.registry`). A
party with ``ca.pem`` verifies it before use; a site also refuses a registry older than one it
accepted before (:mod:`fl_secure.tls.registry_seen`).

Files (next to the TLS files of :class:`~fl_secure.tls.layout.CertificateSet`)::

    signing_keys.json           {"format": 2, "version": N, "issued": "<UTC ISO 8601>",
                                 "keys": {"client-0": "<hex Ed25519 public>", ...}}
    signing_keys.sig            CA signature of the context string + signing_keys.json
    clients/<id>.sign.key       the client's Ed25519 private key (PKCS#8 PEM, mode 0600)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fl_secure.errors import TlsError
from fl_secure.tls.certs import PrivateKey
from fl_secure.tls.layout import (
    CLIENTS_DIR,
    CertificateSet,
    StagedFiles,
    read_bytes,
    validate_client_id,
)
from fl_secure.tls.registry import (
    REGISTRY_FILE,
    REGISTRY_SIGNATURE,
    SignedRegistry,
    encode_registry,
    read_registry,
    sign_registry,
)
from fl_secure.tls.registry_seen import RegistrySeen

__all__ = [
    "REGISTRY_FILE",
    "REGISTRY_SIGNATURE",
    "enrolled_signing_keys",
    "load_signing_identity",
    "load_signing_key",
    "load_signing_registry",
    "registry_matches",
    "signing_key_path",
    "write_signing_keys",
]


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
    is signed with ``signer`` (the CA key), as the next version of the existing one (version 1
    when ``fresh`` or when there is none), so that a site refuses the old one from then on.
    The new files are added to ``files``, written together with the certificates they belong
    to. ``public_keys`` (id -> hex Ed25519 public key) enrolls keys a site made itself
    (``certs sign``): no private key is made or written for those ids.

    Raises:
        TlsError: the existing registry or its signature is missing or does not verify.
    """
    directory = paths.directory
    current = None if fresh else _current_registry(directory)
    registry = dict(current.keys) if current is not None else {}
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
    version = current.version + 1 if current is not None else 1
    body = encode_registry(registry, version)
    files.write(directory / REGISTRY_FILE, body, mode=0o644)
    files.write(directory / REGISTRY_SIGNATURE, sign_registry(signer, body), mode=0o644)
    return registry


def _current_registry(directory: Path) -> SignedRegistry | None:
    """The verified registry of ``directory``, or None when it has neither file."""
    if not (directory / REGISTRY_FILE).exists() and not (directory / REGISTRY_SIGNATURE).exists():
        return None
    return read_registry(directory)


def enrolled_signing_keys(directory: Path) -> dict[str, str]:
    """The registry's entries (id -> hex public key) once it verifies; {} when there is none.

    Raises:
        TlsError: ``signing_keys.json`` or ``signing_keys.sig`` exists but the pair does not
            verify against ``ca.pem`` (or one of the two is missing).
    """
    current = _current_registry(Path(directory))
    if current is None:
        return {}
    return {k: v.public_bytes_raw().hex() for k, v in _public_keys(current).items()}


def load_signing_registry(
    directory: Path, *, seen: RegistrySeen | None = None
) -> dict[str, Ed25519PublicKey]:
    """The enrolled Ed25519 public keys, after checking the CA's signature of the registry.

    Args:
        directory: The certificate folder (``ca.pem``, ``signing_keys.json`` / ``.sig``).
        seen: A site's record of the newest registry it accepted: an older one is refused,
            a newer one recorded (None: no such check, e.g. the server).

    Raises:
        TlsError: The registry or its signature is missing, ``ca.pem`` is unreadable or not a
            CA, the signature does not verify against it (the list was altered, signed by
            someone else, or in the format before versions), or ``seen`` holds a newer one.
    """
    directory = Path(directory)
    registry = read_registry(directory)
    keys = _public_keys(registry)
    if seen is not None:
        seen.accept(registry, directory)
    return keys


def _public_keys(registry: SignedRegistry) -> dict[str, Ed25519PublicKey]:
    out: dict[str, Ed25519PublicKey] = {}
    for client_id, hex_key in registry.keys.items():
        try:
            out[validate_client_id(client_id)] = Ed25519PublicKey.from_public_bytes(
                bytes.fromhex(hex_key)
            )
        except ValueError as exc:
            raise TlsError(f"signing key of {client_id!r} is not an Ed25519 key") from exc
    return out


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
    directory: Path, client_id: str, *, seen: RegistrySeen | None = None
) -> tuple[Ed25519PrivateKey, dict[str, Ed25519PublicKey]]:
    """A client's signing key and the verified registry, checked to enroll exactly that key.

    A site that keeps an old key after being re-issued (or an old registry) would sign with a
    key its peers do not accept and be dropped mid-round; it is stopped here instead. With
    ``seen`` (the site's record), a registry older than one it accepted before is refused.

    Raises:
        TlsError: the key or the registry cannot be loaded, the registry is older than
            ``seen`` holds, the registry has no entry for ``client_id``, or the entry is
            another public key.
    """
    directory = Path(directory)
    key = load_signing_key(directory, client_id)
    registry = load_signing_registry(directory, seen=seen)
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
