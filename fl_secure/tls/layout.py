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
    with StagedFiles() as files:
        files.write(path, data, mode=mode)


class StagedFiles:
    """Files that must change together, written to temporary names and renamed at the end.

    Use it as a context manager. ``write`` puts each file into a temporary file next to its
    target (created 0600, given its mode before the rename). Only when the block ends without
    an error are they all renamed into place; otherwise the temporaries are removed and every
    target keeps its old content. So a failed write (a full disk) cannot leave a new key
    beside an old certificate, or a new CA certificate beside the old CA key.
    """

    def __init__(self) -> None:
        self._staged: list[tuple[Path, Path]] = []  # (temporary file, target)

    def __enter__(self) -> StagedFiles:
        return self

    def write(self, path: Path, data: bytes, *, mode: int) -> None:
        """Write ``data`` for ``path`` to a temporary file; TlsError naming ``path`` if it fails."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            self._staged.append((Path(tmp), path))
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())  # a full disk may report itself only here
            os.chmod(tmp, mode)
        except OSError as exc:
            raise TlsError(
                f"cannot write {path}: {exc.strerror or exc}; no file was replaced"
            ) from exc

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        try:
            if exc_type is None:  # every file was written: now they replace the old ones
                for tmp, path in self._staged:
                    try:
                        os.replace(tmp, path)
                    except OSError as exc:
                        raise TlsError(f"cannot replace {path}: {exc.strerror or exc}") from exc
        finally:
            for tmp, _path in self._staged:  # what is left after an error
                tmp.unlink(missing_ok=True)
