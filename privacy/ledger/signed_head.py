"""The ledger's signed head: the server's Ed25519 signature over ``(run, entries, head hash)``.

The hash chain (:mod:`privacy.ledger.entries`) shows edits to rows that later rows were
chained over, but whoever can write ``ledger.sqlite`` can drop its tail or rewrite the whole
chain. After every commit the server therefore signs the new head with a key kept in its own
folder (``ledger_signing.key`` beside ``server.key``, mode 0600; never in the run folder
unless the run keeps its certificates there, as an embedded run does) and writes::

    RUN_DIR/ledger.head.json  {"version": 1, "run_id", "entries", "head", "public_key", "signature"}

``signature`` is Ed25519 (RFC 8032) over the canonical JSON of
``["fl-secure ledger head", 1, run_id, entries, head]``. The same signed head is copied into
each checkpoint's state (the head before that round's rows), into ``summary.json`` and into
each site's ledger (the head the server sent with the site's task): copies a forger of the
run folder cannot re-sign, and (the sites') cannot reach. Checking them is
:mod:`privacy.ledger.anchors`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fl_secure.runs import atomic_write_bytes, atomic_write_json
from privacy.ledger.entries import LedgerError, canonical_json

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

# cryptography is imported where it is used: reading a ledger (`fl-secure --help` builds the
# parser of `privacy ledger`) must not load it.

KEY_FILE, PUBLIC_KEY_FILE = "ledger_signing.key", "ledger_signing.pub"
_DOMAIN, _VERSION = "fl-secure ledger head", 1
_FIELDS = ("version", "run_id", "entries", "head", "public_key", "signature")


def head_path(ledger_path: Path) -> Path:
    """Where the signed head of ``ledger_path`` lives (beside it: ``ledger.head.json``)."""
    return Path(ledger_path).with_suffix(".head.json")


@dataclass(frozen=True)
class SignedHead:
    """A ledger head and the server's signature of it (hex strings)."""

    run_id: str
    entries: int
    head: str
    public_key: str
    signature: str

    def message(self) -> bytes:
        """The signed bytes."""
        return _message(self.run_id, self.entries, self.head)

    def signature_ok(self) -> bool:
        """Whether ``signature`` is ``public_key``'s Ed25519 signature of :meth:`message`."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        try:
            key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(self.public_key))
            key.verify(bytes.fromhex(self.signature), self.message())
        except (ValueError, InvalidSignature):
            return False
        return True

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "version": _VERSION,
            "run_id": self.run_id,
            "entries": self.entries,
            "head": self.head,
            "public_key": self.public_key,
            "signature": self.signature,
        }

    @classmethod
    def from_dict(cls, value: Any, where: str) -> SignedHead:
        """Parse a stored signed head; LedgerError names ``where`` and what is wrong."""
        if not isinstance(value, Mapping) or set(value) != set(_FIELDS):
            raise LedgerError(f"{where}: a signed ledger head needs exactly the keys {_FIELDS}")
        if value["version"] != _VERSION:
            raise LedgerError(f"{where}: signed head version {value['version']!r}, not 1")
        entries = value["entries"]
        if isinstance(entries, bool) or not isinstance(entries, int) or entries < 0:
            raise LedgerError(f"{where}: entries = {entries!r} is not a count")
        text = [value[k] for k in ("run_id", "head", "public_key", "signature")]
        if not all(isinstance(v, str) and v for v in text):
            raise LedgerError(f"{where}: run_id, head, public_key and signature must be strings")
        return cls(str(value["run_id"]), entries, *map(str, text[1:]))


def _message(run_id: str, entries: int, head: str) -> bytes:
    return canonical_json([_DOMAIN, _VERSION, run_id, entries, head]).encode("utf-8")


class HeadSigner:
    """The server's ledger signing key."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public_key = key.public_key().public_bytes_raw().hex()

    @classmethod
    def generate(cls) -> HeadSigner:
        """A fresh key held in memory only (tests, throw-away runs)."""
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, directory: Path) -> HeadSigner:
        """The key in ``directory`` (the server's certificate folder), created if absent.

        The private key is written 0600 (a ``mkstemp`` file renamed into place), the raw
        public key as hex beside it (``ledger_signing.pub``, 0644) for verifiers to pin.

        Raises:
            LedgerError: The key file exists but cannot be read as an Ed25519 key.
        """
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        path = Path(directory) / KEY_FILE
        if not path.exists():
            key = Ed25519PrivateKey.generate()
            pem = key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
            atomic_write_bytes(path, pem)  # mkstemp: 0600 from the start
        try:
            loaded = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as exc:
            raise LedgerError(f"cannot read the ledger signing key {path}: {exc}") from exc
        if not isinstance(loaded, Ed25519PrivateKey):
            raise LedgerError(f"{path} is not an Ed25519 private key")
        signer = cls(loaded)
        public = Path(directory) / PUBLIC_KEY_FILE
        if not public.exists() or public.read_text(encoding="utf-8").strip() != signer.public_key:
            atomic_write_bytes(public, (signer.public_key + "\n").encode())
            public.chmod(0o644)
        return signer

    def sign(self, run_id: str, entries: int, head: str) -> SignedHead:
        """The signed head of run ``run_id``'s ledger of ``entries`` rows ending at ``head``."""
        signature = self._key.sign(_message(run_id, entries, head)).hex()
        return SignedHead(run_id, entries, head, self.public_key, signature)


def write_head(path: Path, signed: SignedHead) -> None:
    """Write (atomically, synced) the signed head file."""
    atomic_write_json(path, signed.to_dict())


def read_head(path: Path) -> SignedHead | None:
    """The signed head file at ``path``; None if there is none.

    Raises:
        LedgerError: The file exists but is damaged.
    """
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LedgerError(f"{path}: unreadable signed ledger head ({exc})") from exc
    return SignedHead.from_dict(value, str(path))


def read_public_key(path: Path) -> str:
    """A pinned public key: ``ledger_signing.pub`` (hex), or a folder holding it.

    Raises:
        LedgerError: Not a 32-byte hex Ed25519 public key.
    """
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    path = Path(path)
    if path.is_dir():
        path = path / PUBLIC_KEY_FILE
    try:
        text = path.read_text(encoding="utf-8").strip()
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(text))
    except (OSError, ValueError) as exc:
        raise LedgerError(f"{path} is not a ledger public key (64 hex digits): {exc}") from exc
    return text
