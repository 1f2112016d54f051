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
    "a site makes its key with `fl-secure certs request` and installs what `fl-secure certs "
    "sign` returns; on one machine `fl-secure certs init --out DIR --clients N` writes "
    "DIR/server and DIR/sites/<id> (docs/deployment.md)"
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


#: The parts of the folder ``init_certificates`` writes, one per party.
CA_PART, SERVER_PART, SITES_PART = "ca", "server", "sites"


@dataclass(frozen=True)
class Bundle:
    """One party's flat folder: what that party's process reads, and nothing of the others'.

    A CA folder holds ``ca.pem``, ``ca.key``, the master ``enrolled.json`` and signing-key
    registry and ``clients/<id>.pem`` (certificates only); a server folder ``ca.pem``,
    ``server.pem``, ``server.key``, ``enrolled.json``, the registry and the CKKS public
    context; a site folder ``ca.pem``, ``clients/<id>.pem``, ``clients/<id>.key``,
    ``clients/<id>.sign.key``, the registry and the CKKS secret context.

    Attributes:
        directory: the folder.
    """

    directory: Path

    @property
    def ca_cert(self) -> Path:
        """The CA certificate every party trusts."""
        return self.directory / CA_CERT

    @property
    def ca_key(self) -> Path:
        """The CA private key (only in the CA folder; keep it offline)."""
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


@dataclass(frozen=True)
class CertificateSet:
    """The folder written by ``init_certificates``: one part per party, none holds another's key.

    ::

        ca/              ca.pem ca.key enrolled.json signing_keys.* clients/<id>.pem
                         the CA and its records; keep ca.key OFFLINE
        server/          what `fl-secure server --certs` reads: no client secret
        sites/<id>/      what `fl-secure client --certs` reads: that site's keys only

    The properties name the file of the party that uses it: ``ca_cert`` and ``ca_key`` are the
    CA's, ``server_cert``, ``server_key`` and ``enrollment`` the server's, ``client_cert`` and
    ``client_key`` the site's.

    Attributes:
        directory: the directory itself.
        client_ids: the clients issued when the set was created.
    """

    directory: Path
    client_ids: tuple[str, ...] = ()

    @property
    def ca_dir(self) -> Path:
        """The CA's folder (CA key and records); keep it offline."""
        return self.directory / CA_PART

    @property
    def server_dir(self) -> Path:
        """The server's folder: what ``fl-secure server --certs`` reads."""
        return self.directory / SERVER_PART

    def site_dir(self, client_id: str) -> Path:
        """One site's folder: what ``fl-secure client --id ID --certs`` reads."""
        return self.directory / SITES_PART / validate_client_id(client_id)

    @property
    def ca(self) -> Bundle:
        """The CA's files."""
        return Bundle(self.ca_dir)

    @property
    def server(self) -> Bundle:
        """The server's files."""
        return Bundle(self.server_dir)

    def site(self, client_id: str) -> Bundle:
        """One site's files."""
        return Bundle(self.site_dir(client_id))

    def site_ids(self) -> list[str]:
        """The ids of the site folders present, sorted."""
        sites = self.directory / SITES_PART
        return sorted(p.name for p in sites.iterdir() if p.is_dir()) if sites.is_dir() else []

    @property
    def ca_cert(self) -> Path:
        """The CA certificate (the CA's copy; every part holds one)."""
        return self.ca.ca_cert

    @property
    def ca_key(self) -> Path:
        """The CA private key; move it offline once certificates are issued."""
        return self.ca.ca_key

    @property
    def server_cert(self) -> Path:
        """The server certificate."""
        return self.server.server_cert

    @property
    def server_key(self) -> Path:
        """The server private key."""
        return self.server.server_key

    @property
    def enrollment(self) -> Path:
        """The server's enrollment list (``server/enrolled.json``)."""
        return self.server.enrollment

    def client_cert(self, client_id: str) -> Path:
        """The certificate of one client, in its site folder."""
        return self.site(client_id).client_cert(client_id)

    def client_key(self, client_id: str) -> Path:
        """The private key of one client, in its site folder."""
        return self.site(client_id).client_key(client_id)


def is_layout_root(directory: Path) -> bool:
    """Whether ``directory`` is the folder ``init_certificates`` wrote (not one party's part)."""
    return (directory / SERVER_PART / SERVER_CERT).is_file() or (directory / SITES_PART).is_dir()


def server_bundle(directory: str | os.PathLike[str]) -> Path:
    """The server's folder: ``directory`` itself, or its ``server/`` part given the whole set.

    In-process callers (tests, the embedded mode) may pass the folder ``init_certificates``
    wrote; ``fl-secure server`` takes only the server's part and refuses the whole set.
    """
    directory = Path(directory)
    return directory / SERVER_PART if is_layout_root(directory) else directory


def site_bundle(directory: str | os.PathLike[str], client_id: str) -> Path:
    """One site's folder: ``directory`` itself, or its ``sites/<id>/`` part given the whole set."""
    directory = Path(directory)
    site = directory / SITES_PART / validate_client_id(client_id)
    return site if is_layout_root(directory) and site.is_dir() else directory


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

    def staged(self, path: Path) -> bytes | None:
        """What was last staged for ``path`` (None when nothing was)."""
        for tmp, target in reversed(self._staged):
            if target == path:
                return tmp.read_bytes()
        return None

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
