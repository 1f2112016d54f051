"""Key custody at a site: its certificate folder holds its own keys and no other party's.

The one-machine set-up (``fl-secure certs init``) writes every party's folder side by side;
an operator who copies the whole tree, or a site folder with a neighbour's keys or the CA's,
to a site hands that site another party's power: another site's TLS key connects as that
site, its Ed25519 signing key signs key advertisements in its name (accepted against the
CA-signed registry), the CA key mints certificates for anyone, the server's key serves as the
server. ``fl-secure client`` refuses to start on such a folder (:func:`check_site_folder`),
as ``fl-secure server`` refuses a folder with a client's key (:mod:`server.custody`).

Keys are told by what they open: every PEM private key in the folder is matched against the
CA-signed registry, the client certificates, the CA certificate and the server certificate
found in the folder, whatever the file is called; a key that matches none of them and is not
the site's own (its TLS key, its registered signing key) is refused too, as a renamed key of
another site would match nothing here. The clients' CKKS secret, which every site holds, is
the site's own.
"""

from __future__ import annotations

from pathlib import Path

from fl_secure.errors import TlsError
from fl_secure.tls.key_scan import (
    client_certificate_owners,
    folder_files,
    private_keys,
    public_of_certificate_file,
    registry_owners,
)
from fl_secure.tls.layout import (
    CA_CERT,
    CA_KEY,
    CLIENTS_DIR,
    SERVER_CERT,
    SERVER_KEY,
    SITES_PART,
    validate_client_id,
)

FIX = (
    "a site's --certs folder holds only its own keys: `fl-secure certs init --out DIR` writes "
    "each site's folder as DIR/sites/<id> (ca.pem, clients/<id>.pem, .key, .sign.key, the "
    "registry, ckks/); `fl-secure certs request` makes one at the site itself"
)


def check_site_folder(directory: Path, client_id: str) -> None:
    """Refuse a site folder that holds another site's, the server's or the CA's private key.

    Raises:
        TlsError: naming the first such file, whose key it is, and what to pass instead.
    """
    directory = Path(directory)
    client_id = validate_client_id(client_id)
    if not directory.is_dir():
        return  # the loaders name a missing folder
    sites = directory / SITES_PART
    if sites.is_dir():
        raise TlsError(
            f"{directory} holds {sites}, every site's folder with its private keys: this is "
            f"the whole `certs init` folder; pass {sites / client_id} instead. {FIX}"
        )
    files = folder_files(directory, f"pass this site's own folder ({FIX})")
    for path in files:
        relative = path.relative_to(directory)
        if relative == Path(CA_KEY):
            raise TlsError(f"{path} is the CA's private key (it signs any certificate); {FIX}")
        if relative == Path(SERVER_KEY):
            raise TlsError(f"{path} is the server's private key; {FIX}")
        if relative.parts[:1] == (CLIENTS_DIR,) and path.suffix == ".key":
            owner = path.name.removesuffix(".key").removesuffix(".sign")
            if owner != client_id:
                kind = "signing" if path.name.endswith(".sign.key") else "TLS"
                raise TlsError(
                    f"{path} is site {owner!r}'s {kind} private key, in the folder of "
                    f"{client_id!r}; {FIX}"
                )
    _check_private_keys(directory, files, client_id)


def _check_private_keys(directory: Path, files: list[Path], client_id: str) -> None:
    """No PEM private key in the folder opens another party's registry entry or certificate."""
    registry = registry_owners(directory)
    clients = client_certificate_owners(files)
    ca = public_of_certificate_file(directory / CA_CERT)
    server = public_of_certificate_file(directory / SERVER_CERT)
    own_tls = public_of_certificate_file(directory / CLIENTS_DIR / f"{client_id}.pem")
    own_files = {directory / CLIENTS_DIR / f"{client_id}{end}" for end in (".key", ".sign.key")}
    for path, _key, public in private_keys(files):
        owner = registry.get(public)
        if owner is not None and owner != client_id:
            raise TlsError(
                f"{path} is the signing private key of site {owner!r} (its public key is that "
                f"site's registry entry): it signs key advertisements in that site's name; "
                f"{FIX}"
            )
        owner = clients.get(public)
        if owner is not None and owner != client_id:
            raise TlsError(
                f"{path} is the TLS private key of site {owner!r} (it matches that site's "
                f"certificate): it connects as that site; {FIX}"
            )
        if ca and public == ca:
            raise TlsError(f"{path} is the CA's private key (it signs any certificate); {FIX}")
        if server and public == server:
            raise TlsError(f"{path} is the server's private key; {FIX}")
        mine = public == own_tls or registry.get(public) == client_id
        if not mine and path not in own_files:  # its own files before `certs sign` answers
            raise TlsError(
                f"{path} holds a private key that is not {client_id!r}'s own (the key of "
                f"clients/{client_id}.pem, or its registered signing key): a key of another "
                f"party would let this site act as that party; {FIX}"
            )
