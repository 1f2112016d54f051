"""Where certificate files live, which client ids are allowed, and how files are written."""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fl_secure.errors import TlsError

CA_CERT, CA_KEY = "ca.pem", "ca.key"
SERVER_CERT, SERVER_KEY = "server.pem", "server.key"
CLIENTS_DIR, ENROLLMENT_FILE = "clients", "enrolled.json"
INIT_HINT = (
    "the operator creates them with `fl-secure certs init --out DIR --clients N`; a site copies "
    "its files from there (README: Server and clients on separate machines)"
)

_CLIENT_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def validate_client_id(client_id: str) -> str:
    """Return ``client_id`` if it matches ``[A-Za-z0-9._-]{1,64}``, else raise TlsError.

    The id names files (``clients/<id>.pem``), so ``.`` and ``..`` are refused too.
    """
    if not _CLIENT_ID.fullmatch(client_id) or client_id in {".", ".."}:
        raise TlsError(
            f"invalid client id {client_id!r}: use 1-64 characters from A-Z a-z 0-9 . _ -"
            " (not '.' or '..')"
        )
    return client_id


@dataclass(frozen=True)
class CertificateSet:
    """Paths of a certificate directory written by ``init_certificates``.

    Attributes:
        directory: the directory itself.
        client_ids: the clients issued when the set was created.
    """

    directory: Path
    client_ids: tuple[str, ...] = ()

    @property
    def ca_cert(self) -> Path:
        """The CA certificate every party trusts."""
        return self.directory / CA_CERT

    @property
    def ca_key(self) -> Path:
        """The CA private key; move it offline once certificates are issued."""
        return self.directory / CA_KEY

    @property
    def server_cert(self) -> Path:
        """The server certificate."""
        return self.directory / SERVER_CERT

    @property
    def server_key(self) -> Path:
        """The server private key."""
        return self.directory / SERVER_KEY

    @property
    def enrollment(self) -> Path:
        """The enrollment list (``enrolled.json``)."""
        return self.directory / ENROLLMENT_FILE

    def client_cert(self, client_id: str) -> Path:
        """The certificate of one client."""
        return self.directory / CLIENTS_DIR / f"{validate_client_id(client_id)}.pem"

    def client_key(self, client_id: str) -> Path:
        """The private key of one client."""
        return self.directory / CLIENTS_DIR / f"{validate_client_id(client_id)}.key"


def read_bytes(path: Path, what: str) -> bytes:
    """Read a file, raising TlsError that names ``what`` and the path when it cannot."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise TlsError(f"{what} {path} does not exist; {INIT_HINT}") from None
    except OSError as exc:
        raise TlsError(f"cannot read {what} {path}: {exc.strerror}; check permissions") from exc


def write_atomic(path: Path, data: bytes, *, mode: int) -> None:
    """Write ``data`` to ``path`` via a same-directory temp file, with ``mode`` set before rename.

    The temp file is created 0600 by ``mkstemp``, so a private key is never readable by others,
    not even for an instant, and a crash leaves either the old file or the new one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
