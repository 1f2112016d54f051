"""Which private keys a certificate folder holds, and whose they are.

Both ends check their folder before they start: the server's must hold no client secret
(:func:`server.custody.check_server_folder`), a site's no other party's key
(:func:`client.custody.check_site_folder`). A key is told by what it opens, not by its file
name: every PEM private key in the folder is matched against the CA-signed signing-key
registry and the client certificates found beside it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

from fl_secure.errors import TlsError
from fl_secure.tls.certs import CLIENT_URI_PREFIX
from fl_secure.tls.identity import REGISTRY_FILE, REGISTRY_SIGNATURE, load_signing_registry

#: Files larger than this are not read for PEM keys (a CKKS public context is megabytes).
MAX_SCANNED_BYTES = 1 << 20
#: A folder with more files than this is not a certificate folder.
MAX_SCANNED_FILES = 10_000
_PEM_PRIVATE = b"PRIVATE KEY-----"


def folder_files(directory: Path, hint: str) -> list[Path]:
    """The regular files under ``directory``, sorted, at most ``MAX_SCANNED_FILES``.

    Raises:
        TlsError: more files than that; ``hint`` says which folder to pass instead.
    """
    found: list[Path] = []
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not path.is_symlink():
            found.append(path)
            if len(found) > MAX_SCANNED_FILES:
                raise TlsError(
                    f"{directory} holds more than {MAX_SCANNED_FILES} files: not a certificate "
                    f"folder; {hint}"
                )
    return found


def read_small(path: Path) -> bytes | None:
    """The file's bytes when it is small enough to be a PEM file."""
    try:
        if path.stat().st_size > MAX_SCANNED_BYTES:
            return None
        return path.read_bytes()
    except OSError:
        return None


def private_keys(files: list[Path]) -> Iterator[tuple[Path, PrivateKeyTypes, bytes]]:
    """Every unencrypted PEM private key among ``files``: (path, key, public key bytes).

    The public bytes are raw for an Ed25519 key (as the registry lists it) and DER
    SubjectPublicKeyInfo for the others (as a certificate carries it).
    """
    for path in files:
        data = read_small(path)
        if data is None or _PEM_PRIVATE not in data:
            continue
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm):
            continue  # not a key anyone could use (an encrypted one is not loaded either)
        yield path, key, public_bytes(key)


def registry_owners(directory: Path) -> dict[bytes, str]:
    """Raw Ed25519 public key -> client id, from the folder's registry when it verifies."""
    if not (directory / REGISTRY_FILE).exists() or not (directory / REGISTRY_SIGNATURE).exists():
        return {}
    try:
        registry = load_signing_registry(directory)
    except TlsError:
        return {}  # the start-up that needs it names the problem
    return {k.public_bytes_raw(): c for c, k in registry.items()}


def client_certificate_owners(files: list[Path]) -> dict[bytes, str]:
    """Public key -> client id of every client certificate among ``files``."""
    out: dict[bytes, str] = {}
    for path in files:
        data = read_small(path)
        if data is None or b"-----BEGIN CERTIFICATE-----" not in data:
            continue
        try:
            certs = x509.load_pem_x509_certificates(data)
        except ValueError:
            continue
        for cert in certs:
            client = client_id_of(cert)
            if client is not None:
                out[certificate_public_bytes(cert)] = client
    return out


def client_id_of(cert: x509.Certificate) -> str | None:
    """The id of a client certificate (its SAN URI), or None for another certificate."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
        if uri.startswith(CLIENT_URI_PREFIX):
            return uri.removeprefix(CLIENT_URI_PREFIX)
    return None


def public_of_certificate_file(path: Path) -> bytes:
    """The public key of the certificate at ``path``; b"" when there is none."""
    data = read_small(path) if path.is_file() else None
    if data is None:
        return b""
    try:
        return certificate_public_bytes(x509.load_pem_x509_certificate(data))
    except ValueError:
        return b""


def certificate_public_bytes(cert: x509.Certificate) -> bytes:
    """A certificate's public key as DER SubjectPublicKeyInfo."""
    return cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def public_bytes(key: PrivateKeyTypes) -> bytes:
    """Raw bytes for an Ed25519 key (as the registry lists it), DER SPKI for the others."""
    if isinstance(key, Ed25519PrivateKey):
        return key.public_key().public_bytes_raw()
    public = key.public_key()
    return bytes(
        public.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
