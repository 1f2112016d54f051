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

from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fl_secure.errors import TlsError
from fl_secure.tls.identity import REGISTRY_FILE
from fl_secure.tls.key_scan import (
    client_certificate_owners,
    folder_files,
    private_keys,
    public_of_certificate_file,
    registry_owners,
)
from fl_secure.tls.layout import CA_CERT, CA_KEY, CLIENTS_DIR, SERVER_CERT, SERVER_KEY, SITES_PART
from privacy.ledger.signed_head import KEY_FILE as LEDGER_KEY

#: The clients' CKKS secret context (privacy.ckks.keys.SECRET_FILE; not imported: it loads
#: tenseal, which only CKKS runs need).
CKKS_SECRET_NAME = "clients.secret"  # noqa: S105 - a file name


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
    files = folder_files(directory, "pass the folder with ca.pem, server.pem and server.key")
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
    registry = registry_owners(directory)
    clients = client_certificate_owners(files)
    own = {
        public_of_certificate_file(directory / SERVER_CERT): "the server's TLS key",
        public_of_certificate_file(directory / CA_CERT): "the CA key",
    }
    for path, key, public in private_keys(files):
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
