"""A client's signed CKKS upload, and the bundle of them that a decryptor checks and sums.

Each client signs its serialized :class:`~privacy.ckks.update.EncryptedUpdate` with its
long-term Ed25519 identity key (the one that signs SecAgg key advertisements, enrolled in the
CA-signed ``signing_keys.json``). The signature covers a context string, the round id (fresh
and random for every attempt of every round, so it also names the attempt), the client id
and the SHA-256 of the update's bytes (ciphertexts, plaintext layers, weight and count). A
decryptor receives the survivors' signed uploads themselves, never a sum the server made, so
the server cannot hand it a "sum" of one victim's ciphertexts, an earlier round's, or one
client's twice (:mod:`privacy.ckks.verified_sum`).

Byte formats (all lengths big-endian ``u32``, never pickle)::

    upload = "FLSCKSU" NUL | version u16 | client_id | round_id | signature | update
    bundle = "FLSCKSB" NUL | version u16 | count u32 | upload ... (each length-prefixed)
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidSignature

from fl_secure.errors import PrivacyError, ProtocolError
from privacy.secagg.codec import length_prefixed

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

#: What a CKKS upload's signature is about (never valid as another message's signature).
CONTEXT = b"fl-secure/ckks/v1/signed-upload"
UPLOAD_MAGIC, BUNDLE_MAGIC, VERSION = b"FLSCKSU\x00", b"FLSCKSB\x00", 1
ROUND_ID_BYTES, SIGNATURE_BYTES, MAX_CLIENT_ID_BYTES = 16, 64, 256
#: Largest bundle a decryptor is sent: one gRPC message, under the client's 1 GiB receive limit.
MAX_BUNDLE_BYTES = (1 << 30) - (1 << 20)
_HEAD = struct.Struct(">8sH")
_LEN = struct.Struct(">I")


def upload_statement(round_id: bytes, client_id: str, update: bytes) -> bytes:
    """The bytes a client signs: context, round id, client id, SHA-256 of the update."""
    digest = hashlib.sha256(update).digest()
    return CONTEXT + length_prefixed(round_id, client_id.encode("utf-8"), digest)


@dataclass(frozen=True)
class SignedUpload:
    """One client's serialized encrypted update, signed for one round.

    Attributes:
        client_id: The uploading client (its certificate's id).
        round_id: The round (attempt) the update is for: ``CkksSetup.round_id``.
        signature: Ed25519 signature of :func:`upload_statement` by the client's enrolled key.
        update: :meth:`~privacy.ckks.update.EncryptedUpdate.to_bytes` of its update.
    """

    client_id: str
    round_id: bytes
    signature: bytes
    update: bytes

    @classmethod
    def sign(
        cls, identity: Ed25519PrivateKey, client_id: str, round_id: bytes, update: bytes
    ) -> SignedUpload:
        """Sign ``update`` for ``round_id`` as ``client_id``."""
        statement = upload_statement(round_id, client_id, update)
        return cls(client_id, round_id, identity.sign(statement), update)

    def verify(self, registry: Mapping[str, Ed25519PublicKey]) -> None:
        """Check the signature against the client's key in the CA-signed registry.

        Raises:
            PrivacyError: The client is not enrolled, or the signature does not verify.
        """
        key = registry.get(self.client_id)
        if key is None:
            raise PrivacyError(
                f"the CKKS upload of {self.client_id!r} names a client with no enrolled signing key"
            )
        try:
            key.verify(self.signature, upload_statement(self.round_id, self.client_id, self.update))
        except InvalidSignature as exc:
            raise PrivacyError(
                f"the CKKS upload of {self.client_id!r} is not signed by its enrolled key for "
                "this round: altered, forged or signed for another round"
            ) from exc

    def to_bytes(self) -> bytes:
        """The upload's bytes (see the module's format)."""
        return _HEAD.pack(UPLOAD_MAGIC, VERSION) + length_prefixed(
            self.client_id.encode("utf-8"), self.round_id, self.signature, self.update
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> SignedUpload:
        """Strict inverse of :meth:`to_bytes` (the signature is not checked here).

        Raises:
            ProtocolError: Naming what is malformed.
        """
        fields = _parse(data, UPLOAD_MAGIC, "signed CKKS upload", count=4)
        raw_id, round_id, signature, update = fields
        try:
            client_id = raw_id.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError("signed CKKS upload: the client id is not UTF-8") from exc
        if not client_id or len(raw_id) > MAX_CLIENT_ID_BYTES:
            raise ProtocolError(
                f"signed CKKS upload: client id of {len(raw_id)} bytes, expected 1 to "
                f"{MAX_CLIENT_ID_BYTES}"
            )
        if len(round_id) != ROUND_ID_BYTES or len(signature) != SIGNATURE_BYTES:
            raise ProtocolError(
                f"signed CKKS upload of {client_id!r}: round id of {len(round_id)} bytes and "
                f"signature of {len(signature)}, expected {ROUND_ID_BYTES} and {SIGNATURE_BYTES}"
            )
        return cls(client_id, round_id, signature, update)


def encode_bundle(uploads: Sequence[bytes]) -> bytes:
    """The survivors' signed uploads (each :meth:`SignedUpload.to_bytes`) for a decryptor."""
    return _HEAD.pack(BUNDLE_MAGIC, VERSION) + _LEN.pack(len(uploads)) + length_prefixed(*uploads)


def decode_bundle(data: bytes, *, max_count: int) -> list[bytes]:
    """Strict inverse of :func:`encode_bundle`, refusing more than ``max_count`` uploads.

    Raises:
        ProtocolError: Naming what is malformed.
    """
    data = bytes(data)
    _parse(data[: _HEAD.size], BUNDLE_MAGIC, "bundle", count=0)  # magic and version first
    if len(data) < _HEAD.size + _LEN.size:
        raise ProtocolError("bundle of signed CKKS uploads truncated")
    (count,) = _LEN.unpack_from(data, _HEAD.size)
    if count > max_count:
        raise ProtocolError(
            f"bundle of {count} signed CKKS uploads, more than the {max_count} of the cohort"
        )
    head = data[: _HEAD.size]
    return _parse(head + data[_HEAD.size + _LEN.size :], BUNDLE_MAGIC, "bundle", count=count)


def _parse(data: bytes, magic: bytes, what: str, *, count: int) -> list[bytes]:
    """``count`` length-prefixed fields after the magic and version; nothing after them."""
    data = bytes(data)
    if len(data) < _HEAD.size:
        raise ProtocolError(f"{what} truncated: {len(data)} bytes")
    found, version = _HEAD.unpack_from(data)
    if found != magic:
        raise ProtocolError(f"not a {what} (bad magic bytes)")
    if version != VERSION:
        raise ProtocolError(f"{what} format version {version}; this build reads {VERSION}")
    pos, fields = _HEAD.size, []
    for i in range(count):
        if pos + _LEN.size > len(data):
            raise ProtocolError(f"{what} truncated: field {i} of {count} is missing")
        (length,) = _LEN.unpack_from(data, pos)
        pos += _LEN.size
        if pos + length > len(data):
            raise ProtocolError(
                f"{what} truncated: field {i} declares {length} bytes, {len(data) - pos} remain"
            )
        fields.append(data[pos : pos + length])
        pos += length
    if pos != len(data):
        raise ProtocolError(f"{what} has {len(data) - pos} unexpected bytes after its fields")
    return fields
