"""Key custody: the server's certificate folder must hold no client secret.

A server that holds a client's TLS key can connect as that client; one that holds a client's
Ed25519 signing key can sign a key advertisement in its name that verifies against the
CA-signed registry (and so substitute its own keys in secure aggregation); one that holds the
clients' CKKS secret can decrypt every upload. The honest-but-curious server of the threat
model would do exactly that with what it is given, so it is given none of it:
``fl-secure server`` refuses to start on a folder that holds one (:func:`check_server_folder`).

The check names files by what the project writes (``clients/<id>.key``,
``clients/<id>.sign.key``, ``ckks/clients.secret``, ``sites/``) and, wherever a file was put,
reads every PEM private key in the folder: the only ones a server may hold are its own TLS key
(the key of ``server.pem``), its ledger signing key (no client's registered key) and, warned
about elsewhere, the CA key.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fl_secure.errors import TlsError
from fl_secure.tls.certs import CLIENT_URI_PREFIX
from fl_secure.tls.identity import REGISTRY_FILE, REGISTRY_SIGNATURE, load_signing_registry
from fl_secure.tls.layout import CA_CERT, CA_KEY, CLIENTS_DIR, SERVER_CERT, SERVER_KEY, SITES_PART
from privacy.ledger.signed_head import KEY_FILE as LEDGER_KEY

#: The clients' CKKS secret context (privacy.ckks.keys.SECRET_FILE; not imported: it loads
#: tenseal, which only CKKS runs need).
CKKS_SECRET_NAME = "clients.secret"  # noqa: S105 - a file name

#: Files larger than this are not read for PEM keys (a CKKS public context is megabytes).
MAX_SCANNED_BYTES = 1 << 20
#: A folder with more files than this is not a certificate folder.
MAX_SCANNED_FILES = 10_000
_PEM_PRIVATE = b"PRIVATE KEY-----"

FIX = (
    "the server's --certs folder must hold no client secret: remove it (a site's keys stay "
    "at the site). `fl-secure certs init --out DIR` writes the server's own folder as "
    "DIR/server (ca.pem, server.pem, server.key, enrolled.json, signing_keys.json/.sig, "
    "ckks/server.public); pass that"
)


def check_server_folder(directory: Path) -> None:
    """Refuse a server folder that holds a client's private key or the CKKS secret.

    Raises:
        TlsError: naming the first such file, what it is, and what to do.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return  # the loaders name a missing folder
    sites = directory / SITES_PART
    if sites.is_dir():
        raise TlsError(
            f"{directory} holds {sites}, the sites' folders with their private keys: this is "
            f"the whole `certs init` folder, not the server's part; pass {directory / 'server'}"
            f" instead. {FIX}"
        )
    files = list(_files(directory))
    for path in files:
        relative = path.relative_to(directory)
        if path.name == CKKS_SECRET_NAME or path.suffix == ".secret":
            raise TlsError(f"{path} is a CKKS secret context (it decrypts every upload); {FIX}")
        if relative.parts[:1] == (CLIENTS_DIR,) and path.suffix == ".key":
            kind = "signing" if path.name.endswith(".sign.key") else "TLS"
            raise TlsError(f"{path} is a client's {kind} private key; {FIX}")
    _check_private_keys(directory, files)


def _check_private_keys(directory: Path, files: list[Path]) -> None:
    """Every PEM private key in the folder is the server's, its ledger's or the CA's."""
    registry = _registry(directory)
    clients = _client_certificates(files)
    own = {
        _public_of_cert(directory / SERVER_CERT): "the server's TLS key",
        _public_of_cert(directory / CA_CERT): "the CA key",
    }
    for path in files:
        data = _head(path)
        if data is None or _PEM_PRIVATE not in data:
            continue
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm):
            continue  # not a key the server could use (an encrypted one is not loaded either)
        public = _public_bytes(key)
        if public in registry:
            raise TlsError(
                f"{path} is the signing private key of client {registry[public]!r} (its public "
                f"key is that client's entry in {REGISTRY_FILE}): whoever holds it can sign "
                f"key advertisements in that client's name; {FIX}"
            )
        if public in clients:
            raise TlsError(
                f"{path} is the TLS private key of client {clients[public]!r} (it matches that "
                f"client's certificate): whoever holds it can connect as that client; {FIX}"
            )
        top = path.parent == directory
        if top and isinstance(key, Ed25519PrivateKey) and path.name == LEDGER_KEY:
            continue  # the server's ledger signing key
        if top and own.get(public) and path.name in (SERVER_KEY, CA_KEY):
            continue
        raise TlsError(
            f"{path} holds a private key that is not the server's own (server.key of "
            f"server.pem, {LEDGER_KEY}); the server may hold only its own keys: a "
            f"client's key would let it act as that client; {FIX}"
        )


def _files(directory: Path) -> Iterator[Path]:
    """The regular files under ``directory``, sorted, at most ``MAX_SCANNED_FILES``."""
    count = 0
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not path.is_symlink():
            count += 1
            if count > MAX_SCANNED_FILES:
                raise TlsError(
                    f"{directory} holds more than {MAX_SCANNED_FILES} files: not a server "
                    "certificate folder; pass the folder with ca.pem, server.pem and server.key"
                )
            yield path


def _head(path: Path) -> bytes | None:
    """The file's bytes when it is small enough to be a PEM file."""
    try:
        if path.stat().st_size > MAX_SCANNED_BYTES:
            return None
        return path.read_bytes()
    except OSError:
        return None


def _registry(directory: Path) -> dict[bytes, str]:
    """Raw Ed25519 public key -> client id, from the folder's registry when it verifies."""
    if not (directory / REGISTRY_FILE).exists() or not (directory / REGISTRY_SIGNATURE).exists():
        return {}
    try:
        registry = load_signing_registry(directory)
    except TlsError:
        return {}  # the start-up that needs it names the problem
    return {k.public_bytes_raw(): c for c, k in registry.items()}


def _client_certificates(files: list[Path]) -> dict[bytes, str]:
    """Public key -> client id of every client certificate among ``files``."""
    out: dict[bytes, str] = {}
    for path in files:
        data = _head(path)
        if data is None or b"-----BEGIN CERTIFICATE-----" not in data:
            continue
        try:
            certs = x509.load_pem_x509_certificates(data)
        except ValueError:
            continue
        for cert in certs:
            client = _client_id(cert)
            if client is not None:
                out[_public_bytes_of(cert)] = client
    return out


def _client_id(cert: x509.Certificate) -> str | None:
    """The id of a client certificate (its SAN URI), or None for another certificate."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
        if uri.startswith(CLIENT_URI_PREFIX):
            return uri.removeprefix(CLIENT_URI_PREFIX)
    return None


def _public_of_cert(path: Path) -> bytes:
    """The public key of the certificate at ``path``; b"" when there is none."""
    data = _head(path) if path.is_file() else None
    if data is None:
        return b""
    try:
        return _public_bytes_of(x509.load_pem_x509_certificate(data))
    except ValueError:
        return b""


def _public_bytes_of(cert: x509.Certificate) -> bytes:
    return cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _public_bytes(key: object) -> bytes:
    """Raw bytes for an Ed25519 key (as the registry lists it), DER SPKI for the others."""
    if isinstance(key, Ed25519PrivateKey):
        return key.public_key().public_bytes_raw()
    public = key.public_key()  # type: ignore[attr-defined]
    return bytes(
        public.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
