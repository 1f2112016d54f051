"""The five SecAgg wire messages and the share a client reveals (Bonawitz et al., CCS 2017).

Round 0 :class:`AdvertiseKeys`, Round 1 :class:`EncryptedShare`, Round 2 :class:`MaskedInput`,
Round 4 :class:`UnmaskRequest` and :class:`UnmaskResponse` (of :class:`RevealedShare`); each
encodes with the strict codec of :mod:`privacy.secagg.codec`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fl_secure.errors import ProtocolError
from privacy.secagg.arithmetic import check_vector, word_dtype
from privacy.secagg.codec import (
    DOMAIN,
    KIND_ADVERT,
    KIND_MASKED,
    KIND_REQUEST,
    KIND_RESPONSE,
    KIND_SHARE,
    MAX_CIPHERTEXT_BYTES,
    MAX_ROUND_ID_BYTES,
    NONCE_BYTES,
    Reader,
    Writer,
    length_prefixed,
)
from privacy.secagg.shamir import FIELD_BYTES


def advert_payload(client_id: str, round_id: bytes, c_pk: bytes, s_pk: bytes) -> bytes:
    """What a client signs in its :class:`AdvertiseKeys`: round, id and both public keys."""
    return DOMAIN + b"advertise" + length_prefixed(round_id, client_id.encode("utf-8"), c_pk, s_pk)


@dataclass(frozen=True)
class AdvertiseKeys:
    """Round 0 (*AdvertiseKeys*): a client's two fresh X25519 public keys, signed.

    Attributes:
        client_id: The advertising client.
        round_id: The round the keys are for (signed, so adverts cannot be replayed).
        c_pk: Raw 32-byte X25519 public key for encrypting shares (``c_u^PK``).
        s_pk: Raw 32-byte X25519 public key for pairwise masks (``s_u^PK``).
        signature: Ed25519 signature by the client's enrolled identity key over
            the domain tag, round id, client id and both keys.
    """

    client_id: str
    round_id: bytes
    c_pk: bytes
    s_pk: bytes
    signature: bytes

    def signed_payload(self) -> bytes:
        """The bytes the signature covers."""
        return advert_payload(self.client_id, self.round_id, self.c_pk, self.s_pk)

    def to_bytes(self) -> bytes:
        """Serialise (see the module docstring for the format)."""
        return (
            Writer(KIND_ADVERT)
            .text(self.client_id)
            .blob(self.round_id)
            .blob(self.c_pk)
            .blob(self.s_pk)
            .blob(self.signature)
            .done()
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> AdvertiseKeys:
        """Parse strictly; raises ProtocolError on any deviation from the format."""
        r = Reader(data, KIND_ADVERT, "AdvertiseKeys")
        out = cls(
            client_id=r.text("client_id"),
            round_id=r.blob("round_id", max_len=MAX_ROUND_ID_BYTES),
            c_pk=r.blob("c_pk", exact=32),
            s_pk=r.blob("s_pk", exact=32),
            signature=r.blob("signature", exact=64),
        )
        r.end()
        return out


@dataclass(frozen=True)
class EncryptedShare:
    """Round 1 (*ShareKeys*): one client's shares of ``b_u`` and ``s_u^SK`` for one neighbour.

    The server relays it unopened. The AES-256-GCM plaintext holds sender, receiver, the
    receiver's Shamir abscissa and both ordinates; the associated data binds sender, receiver
    and round.

    Attributes:
        sender: The client whose secrets are shared.
        receiver: The neighbour that holds the shares.
        round_id: The round.
        nonce: Random 96-bit AES-GCM nonce.
        ciphertext: AES-GCM ciphertext with its 16-byte tag.
    """

    sender: str
    receiver: str
    round_id: bytes
    nonce: bytes
    ciphertext: bytes

    def to_bytes(self) -> bytes:
        """Serialise (see the module docstring for the format)."""
        return (
            Writer(KIND_SHARE)
            .text(self.sender)
            .text(self.receiver)
            .blob(self.round_id)
            .blob(self.nonce)
            .blob(self.ciphertext)
            .done()
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> EncryptedShare:
        """Parse strictly; raises ProtocolError on any deviation from the format."""
        r = Reader(data, KIND_SHARE, "EncryptedShare")
        out = cls(
            sender=r.text("sender"),
            receiver=r.text("receiver"),
            round_id=r.blob("round_id", max_len=MAX_ROUND_ID_BYTES),
            nonce=r.blob("nonce", exact=NONCE_BYTES),
            ciphertext=r.blob("ciphertext", max_len=MAX_CIPHERTEXT_BYTES),
        )
        r.end()
        return out


@dataclass(frozen=True, eq=False)
class MaskedInput:
    """Round 2 (*MaskedInputCollection*): ``y_u``, the masked encoded update, mod ``2^bits``.

    Attributes:
        client_id: The sending client.
        round_id: The round.
        modulus_bits: ``bits`` of the modulus ``2^bits``.
        vector: ``uint32`` or ``uint64`` vector of length ``d`` with every value below
            ``2^bits`` (``uint32`` as received when ``bits <= 32``).
    """

    client_id: str
    round_id: bytes
    modulus_bits: int
    vector: np.ndarray

    def to_bytes(self) -> bytes:
        """Serialise; words are 4 bytes when ``modulus_bits <= 32``, else 8."""
        vector = check_vector(self.vector, self.modulus_bits, None, "MaskedInput")
        words = vector.astype("<u4" if self.modulus_bits <= 32 else "<u8", copy=False)
        return (
            Writer(KIND_MASKED)
            .text(self.client_id)
            .blob(self.round_id)
            .u8(self.modulus_bits)
            .u32(vector.size)
            .raw(words.tobytes())
            .done()
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> MaskedInput:
        """Parse strictly; values must be below ``2^modulus_bits``."""
        r = Reader(data, KIND_MASKED, "MaskedInput")
        client_id = r.text("client_id")
        round_id = r.blob("round_id", max_len=MAX_ROUND_ID_BYTES)
        bits = r.u8()
        if not 1 <= bits <= 64:
            raise ProtocolError(f"MaskedInput: modulus_bits = {bits}, expected 1..64")
        n = r.u32()
        width = 4 if bits <= 32 else 8
        raw = r.take(n * width)
        r.end()
        vector = np.frombuffer(raw, dtype="<u4" if width == 4 else "<u8").astype(word_dtype(bits))
        check_vector(vector, bits, None, "MaskedInput")
        return cls(client_id=client_id, round_id=round_id, modulus_bits=bits, vector=vector)


@dataclass(frozen=True)
class UnmaskRequest:
    """Round 4 (*Unmasking*) request: who is in the sum, who dropped after sharing keys.

    Attributes:
        round_id: The round.
        survivors: ``U3``: clients whose masked input is in the sum (reveal ``b_u`` shares).
        dropped: Clients in ``U2 - U3`` with a neighbour in ``U3`` (reveal ``s_u^SK`` shares).
    """

    round_id: bytes
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]

    def to_bytes(self) -> bytes:
        """Serialise (see the module docstring for the format)."""
        w = Writer(KIND_REQUEST).blob(self.round_id).u32(len(self.survivors))
        for s in self.survivors:
            w.text(s)
        w.u32(len(self.dropped))
        for s in self.dropped:
            w.text(s)
        return w.done()

    @classmethod
    def from_bytes(cls, data: bytes) -> UnmaskRequest:
        """Parse strictly; raises ProtocolError on any deviation from the format."""
        r = Reader(data, KIND_REQUEST, "UnmaskRequest")
        round_id = r.blob("round_id", max_len=MAX_ROUND_ID_BYTES)
        survivors = tuple(r.text("survivor") for _ in range(r.u32()))
        dropped = tuple(r.text("dropped") for _ in range(r.u32()))
        r.end()
        return cls(round_id=round_id, survivors=survivors, dropped=dropped)


@dataclass(frozen=True)
class RevealedShare:
    """One Shamir share ``(x, y)`` of a secret of client ``owner``, revealed to the server.

    Attributes:
        owner: The client whose secret (``b_u`` or ``s_u^SK``) this is a share of.
        x: Abscissa: the holder's position in the sorted cohort plus one.
        y: Ordinate, an element of GF(2^521 - 1).
    """

    owner: str
    x: int
    y: int


@dataclass(frozen=True)
class UnmaskResponse:
    """Round 4 (*Unmasking*) response of one surviving client.

    Attributes:
        client_id: The responding client (the holder of the shares).
        round_id: The round.
        self_mask_shares: Shares of ``b_u`` for the requested survivors among its neighbours.
        key_shares: Shares of ``s_u^SK`` for the requested dropped clients among its neighbours.
    """

    client_id: str
    round_id: bytes
    self_mask_shares: tuple[RevealedShare, ...]
    key_shares: tuple[RevealedShare, ...]

    def to_bytes(self) -> bytes:
        """Serialise (see the module docstring for the format)."""
        w = Writer(KIND_RESPONSE).text(self.client_id).blob(self.round_id)
        for group in (self.self_mask_shares, self.key_shares):
            w.u32(len(group))
            for s in group:
                w.text(s.owner).u32(s.x).raw(s.y.to_bytes(FIELD_BYTES, "big"))
        return w.done()

    @classmethod
    def from_bytes(cls, data: bytes) -> UnmaskResponse:
        """Parse strictly; ordinates must be field elements."""
        r = Reader(data, KIND_RESPONSE, "UnmaskResponse")
        client_id = r.text("client_id")
        round_id = r.blob("round_id", max_len=MAX_ROUND_ID_BYTES)
        groups: list[tuple[RevealedShare, ...]] = []
        for _ in range(2):
            groups.append(
                tuple(
                    RevealedShare(owner=r.text("owner"), x=r.u32(), y=r.element("share"))
                    for _ in range(r.u32())
                )
            )
        r.end()
        return cls(client_id, round_id, groups[0], groups[1])
