"""The binary codec of the SecAgg wire messages (:mod:`privacy.secagg.messages`).

Wire format of every message (``to_bytes`` / ``from_bytes``): ``b"FLSA"``, version byte,
message-kind byte, then fields in order; strings and byte strings are a big-endian ``u32``
length and the bytes (UTF-8 for strings); integers are big-endian; vectors are a ``u32`` count
and little-endian ``u32`` (``modulus_bits <= 32``) or ``u64`` words. Readers are strict: wrong
magic, version, kind, lengths, values out of range or trailing bytes raise
:class:`~fl_secure.errors.ProtocolError`.
"""

from __future__ import annotations

import struct

from fl_secure.errors import ProtocolError
from privacy.secagg.shamir import FIELD_BYTES, PRIME

WIRE_VERSION = 1

MAGIC = b"FLSA"
#: Prefix of every signed payload, KDF context and associated data (domain separation).
DOMAIN = b"fl-secure/secagg/v1/"
#: The message-kind byte of each message (and of the plaintext inside an encrypted share).
KIND_ADVERT, KIND_SHARE, KIND_MASKED, KIND_REQUEST, KIND_RESPONSE = 1, 2, 3, 4, 5
KIND_SHARE_PLAINTEXT = 6
KIND_CONSISTENCY = 7
NONCE_BYTES = 12
MAX_ID_BYTES = 255
MAX_ROUND_ID_BYTES = 255
MAX_CIPHERTEXT_BYTES = 4096


def length_prefixed(*parts: bytes) -> bytes:
    """Length-prefixed concatenation (unambiguous context strings for HKDF and signatures)."""
    return b"".join(struct.pack(">I", len(p)) + p for p in parts)


class Writer:
    """Builds one message: the header (magic, version, ``kind``), then fields in order."""

    def __init__(self, kind: int) -> None:
        self._buf = bytearray(MAGIC + bytes([WIRE_VERSION, kind]))

    def u8(self, value: int) -> Writer:
        """An unsigned byte."""
        self._buf += struct.pack(">B", value)
        return self

    def u32(self, value: int) -> Writer:
        """A big-endian ``u32``."""
        self._buf += struct.pack(">I", value)
        return self

    def blob(self, data: bytes) -> Writer:
        """A ``u32`` length, then the bytes."""
        self._buf += struct.pack(">I", len(data)) + data
        return self

    def text(self, value: str) -> Writer:
        """A UTF-8 string as a blob."""
        return self.blob(value.encode("utf-8"))

    def raw(self, data: bytes) -> Writer:
        """Bytes as they are (fixed-width fields)."""
        self._buf += data
        return self

    def done(self) -> bytes:
        """The message's bytes."""
        return bytes(self._buf)


class Reader:
    """Reads one message strictly: header first, then fields in order, then :meth:`end`.

    Raises:
        ProtocolError: Naming ``what`` and the field, at any deviation from the format.
    """

    def __init__(self, data: bytes, kind: int, what: str) -> None:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ProtocolError(f"{what}: expected bytes, got {type(data).__name__}")
        self._data = bytes(data)
        self._pos = 0
        self._what = what
        header = self.take(len(MAGIC) + 2)
        if header[: len(MAGIC)] != MAGIC:
            raise ProtocolError(f"{what}: not a SecAgg message (bad magic)")
        if header[-2] != WIRE_VERSION:
            raise ProtocolError(
                f"{what}: wire version {header[-2]} is not supported (expected {WIRE_VERSION})"
            )
        if header[-1] != kind:
            raise ProtocolError(f"{what}: message kind {header[-1]}, expected {kind}")

    def take(self, n: int) -> bytes:
        """The next ``n`` bytes."""
        if n > len(self._data) - self._pos:
            raise ProtocolError(f"{self._what}: truncated message")
        out = self._data[self._pos : self._pos + n]
        self._pos += n
        return out

    def u8(self) -> int:
        """An unsigned byte."""
        return int(self.take(1)[0])

    def u32(self) -> int:
        """A big-endian ``u32``."""
        value: int = struct.unpack(">I", self.take(4))[0]
        return value

    def blob(self, field: str, *, exact: int | None = None, max_len: int | None = None) -> bytes:
        """A length-prefixed byte string of ``exact`` or at most ``max_len`` bytes."""
        n = self.u32()
        if exact is not None and n != exact:
            raise ProtocolError(f"{self._what}: {field} has {n} bytes, expected {exact}")
        if max_len is not None and n > max_len:
            raise ProtocolError(f"{self._what}: {field} has {n} bytes, at most {max_len} allowed")
        return self.take(n)

    def text(self, field: str) -> str:
        """A UTF-8 string (a client id: at most 255 bytes)."""
        raw = self.blob(field, max_len=MAX_ID_BYTES)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"{self._what}: {field} is not valid UTF-8") from exc

    def element(self, field: str) -> int:
        """A big-endian element of the Shamir field."""
        value = int.from_bytes(self.take(FIELD_BYTES), "big")
        if value >= PRIME:
            raise ProtocolError(f"{self._what}: {field} is not an element of GF(2^521 - 1)")
        return value

    def end(self) -> None:
        """Refuse trailing bytes."""
        if self._pos != len(self._data):
            raise ProtocolError(f"{self._what}: {len(self._data) - self._pos} trailing bytes")


def check_id(client_id: str, what: str) -> None:
    """Refuse a client id that is not a non-empty string of at most 255 UTF-8 bytes."""
    if not isinstance(client_id, str) or not client_id:
        raise ProtocolError(f"{what}: client ids must be non-empty strings, got {client_id!r}")
    if len(client_id.encode("utf-8")) > MAX_ID_BYTES:
        raise ProtocolError(f"{what}: client id {client_id[:40]!r}... exceeds {MAX_ID_BYTES} bytes")
