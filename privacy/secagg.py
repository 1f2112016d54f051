"""Secure aggregation (SecAgg and SecAgg+) as transport-free, message-based state machines.

Implements the single-server secure aggregation protocol of Bonawitz et al., "Practical Secure
Aggregation for Privacy-Preserving Machine Learning", CCS 2017 (SecAgg, Figure 4: rounds
*AdvertiseKeys*, *ShareKeys*, *MaskedInputCollection*, *Unmasking*), with the sparse
communication graph of Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic
Overhead", CCS 2020 (SecAgg+): each client shares its secrets with, and masks against, only its
``k`` neighbours in a random ``k``-regular graph, with threshold ``t`` of ``k``. There is one code
path: SecAgg is the special case of the complete graph (``k = n - 1``, ``neighbours = 0``).

Per round, each client ``u`` with neighbours ``N(u)`` sends (all arithmetic mod ``R = 2^bits``)

    y_u = x_u + PRG(b_u) + sum_{v in N(u) cap U2, u < v} PRG(s_uv)
                         - sum_{v in N(u) cap U2, u > v} PRG(s_uv)                  (Round 2)

where ``x_u`` is the fixed-point encoded update, ``b_u`` a fresh self-mask seed, ``s_uv`` the
X25519 agreement of ``u``'s and ``v``'s mask keys and ``U2`` the clients whose key shares were
routed. The pairwise masks cancel in the sum; the server removes the rest (Round 4):

    z = sum_{u in U3} y_u - sum_{u in U3} PRG(b_u)
        + sum_{u in U2 - U3} sum_{v in N(u) cap U3} (+/-) PRG(s_uv)

with ``b_u`` rebuilt from ``t`` Shamir shares for every client whose masked input arrived
(``U3``) and the mask private key ``s_u^SK`` rebuilt for every client that shared its keys but
dropped before sending its masked input. No client ever reveals both shares of one client.

Primitives (all from ``cryptography``): X25519 key agreement and HKDF-SHA256 (context binding
the round id and both client ids in canonical order) give 32-byte keys; key advertisements are
signed with each client's long-term Ed25519 identity key and verified against the enrolled
registry; shares travel encrypted with AES-256-GCM (associated data binding sender, receiver
and round; the server only relays ciphertexts); masks are AES-256-CTR keystreams read as
little-endian 64-bit words. Shamir sharing is implemented here over the prime field
``GF(2^521 - 1)`` with randomness from :mod:`secrets`.

Not implemented: Round 3 (*ConsistencyCheck*), which only matters against an actively malicious
server. The server here is honest-but-curious; the local guards (signed keys, ``2t > k``, the
refusal to reveal both shares of a client) are the ones a client can enforce by itself.

Wire format of every message (``to_bytes`` / ``from_bytes``): ``b"FLSA"``, version byte,
message-kind byte, then fields in order; strings and byte strings are a big-endian ``u32``
length and the bytes (UTF-8 for strings); integers are big-endian; vectors are a ``u32`` count
and little-endian ``u32`` (``modulus_bits <= 32``) or ``u64`` words. Readers are strict: wrong
magic, version, kind, lengths, values out of range or trailing bytes raise
:class:`~fl_secure.errors.ProtocolError`.

Errors: :class:`~fl_secure.errors.ProtocolError` for malformed or out-of-order messages,
:class:`~fl_secure.errors.PrivacyError` for authentication failures (bad signature, tampered
ciphertext) and refused reveals, :class:`~fl_secure.errors.RoundAborted` when too few clients
remain for the thresholds (the sum is then never computed).
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fl_secure.errors import PrivacyError, ProtocolError, RoundAborted, UpdateError

PRIME = 2**521 - 1  # Mersenne prime: the Shamir field GF(p); 32-byte secrets are < p
FIELD_BYTES = 66  # big-endian width of one field element
SECRET_BYTES = 32  # seeds and X25519 private keys
WIRE_VERSION = 1

_MAGIC = b"FLSA"
_DOMAIN = b"fl-secure/secagg/v1/"
_KIND_ADVERT, _KIND_SHARE, _KIND_MASKED, _KIND_REQUEST, _KIND_RESPONSE = 1, 2, 3, 4, 5
_KIND_SHARE_PLAINTEXT = 6
_NONCE_BYTES = 12
_MAX_ID_BYTES = 255
_MAX_ROUND_ID_BYTES = 255
_MAX_CIPHERTEXT_BYTES = 4096
_CHUNK = 1 << 16  # mask words per AES-CTR call: 512 KB buffers (8 MB ones fault pages: 2.6x slower)
# The plaintext of every keystream chunk (AES-CTR of zeros is the keystream), made once: the
# keystreams are written with ``update_into`` into reused buffers, never freshly allocated ones.
_ZEROS = memoryview(bytes(8 * _CHUNK))
_BLOCK = 16  # AES block: ``update_into`` wants room for ``len(data) + _BLOCK - 1`` bytes
_MAX_EXACT = 2**52  # clip_range * scale must stay exactly representable in float64


# --------------------------------------------------------------------------------------------
# Binary codec


def _lp(*parts: bytes) -> bytes:
    """Length-prefixed concatenation (unambiguous context strings for HKDF and signatures)."""
    return b"".join(struct.pack(">I", len(p)) + p for p in parts)


class _Writer:
    def __init__(self, kind: int) -> None:
        self._buf = bytearray(_MAGIC + bytes([WIRE_VERSION, kind]))

    def u8(self, value: int) -> _Writer:
        self._buf += struct.pack(">B", value)
        return self

    def u32(self, value: int) -> _Writer:
        self._buf += struct.pack(">I", value)
        return self

    def blob(self, data: bytes) -> _Writer:
        self._buf += struct.pack(">I", len(data)) + data
        return self

    def text(self, value: str) -> _Writer:
        return self.blob(value.encode("utf-8"))

    def raw(self, data: bytes) -> _Writer:
        self._buf += data
        return self

    def done(self) -> bytes:
        return bytes(self._buf)


class _Reader:
    def __init__(self, data: bytes, kind: int, what: str) -> None:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ProtocolError(f"{what}: expected bytes, got {type(data).__name__}")
        self._data = bytes(data)
        self._pos = 0
        self._what = what
        header = self.take(len(_MAGIC) + 2)
        if header[: len(_MAGIC)] != _MAGIC:
            raise ProtocolError(f"{what}: not a SecAgg message (bad magic)")
        if header[-2] != WIRE_VERSION:
            raise ProtocolError(
                f"{what}: wire version {header[-2]} is not supported (expected {WIRE_VERSION})"
            )
        if header[-1] != kind:
            raise ProtocolError(f"{what}: message kind {header[-1]}, expected {kind}")

    def take(self, n: int) -> bytes:
        if n > len(self._data) - self._pos:
            raise ProtocolError(f"{self._what}: truncated message")
        out = self._data[self._pos : self._pos + n]
        self._pos += n
        return out

    def u8(self) -> int:
        return int(self.take(1)[0])

    def u32(self) -> int:
        value: int = struct.unpack(">I", self.take(4))[0]
        return value

    def blob(self, field: str, *, exact: int | None = None, max_len: int | None = None) -> bytes:
        n = self.u32()
        if exact is not None and n != exact:
            raise ProtocolError(f"{self._what}: {field} has {n} bytes, expected {exact}")
        if max_len is not None and n > max_len:
            raise ProtocolError(f"{self._what}: {field} has {n} bytes, at most {max_len} allowed")
        return self.take(n)

    def text(self, field: str) -> str:
        raw = self.blob(field, max_len=_MAX_ID_BYTES)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"{self._what}: {field} is not valid UTF-8") from exc

    def element(self, field: str) -> int:
        value = int.from_bytes(self.take(FIELD_BYTES), "big")
        if value >= PRIME:
            raise ProtocolError(f"{self._what}: {field} is not an element of GF(2^521 - 1)")
        return value

    def end(self) -> None:
        if self._pos != len(self._data):
            raise ProtocolError(f"{self._what}: {len(self._data) - self._pos} trailing bytes")


def _check_id(client_id: str, what: str) -> None:
    if not isinstance(client_id, str) or not client_id:
        raise ProtocolError(f"{what}: client ids must be non-empty strings, got {client_id!r}")
    if len(client_id.encode("utf-8")) > _MAX_ID_BYTES:
        raise ProtocolError(
            f"{what}: client id {client_id[:40]!r}... exceeds {_MAX_ID_BYTES} bytes"
        )


# --------------------------------------------------------------------------------------------
# Messages


def _advert_payload(client_id: str, round_id: bytes, c_pk: bytes, s_pk: bytes) -> bytes:
    return _DOMAIN + b"advertise" + _lp(round_id, client_id.encode("utf-8"), c_pk, s_pk)


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
        return _advert_payload(self.client_id, self.round_id, self.c_pk, self.s_pk)

    def to_bytes(self) -> bytes:
        """Serialise (see the module docstring for the format)."""
        return (
            _Writer(_KIND_ADVERT)
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
        r = _Reader(data, _KIND_ADVERT, "AdvertiseKeys")
        out = cls(
            client_id=r.text("client_id"),
            round_id=r.blob("round_id", max_len=_MAX_ROUND_ID_BYTES),
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
            _Writer(_KIND_SHARE)
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
        r = _Reader(data, _KIND_SHARE, "EncryptedShare")
        out = cls(
            sender=r.text("sender"),
            receiver=r.text("receiver"),
            round_id=r.blob("round_id", max_len=_MAX_ROUND_ID_BYTES),
            nonce=r.blob("nonce", exact=_NONCE_BYTES),
            ciphertext=r.blob("ciphertext", max_len=_MAX_CIPHERTEXT_BYTES),
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
        vector = _check_vector(self.vector, self.modulus_bits, None, "MaskedInput")
        words = vector.astype("<u4" if self.modulus_bits <= 32 else "<u8", copy=False)
        return (
            _Writer(_KIND_MASKED)
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
        r = _Reader(data, _KIND_MASKED, "MaskedInput")
        client_id = r.text("client_id")
        round_id = r.blob("round_id", max_len=_MAX_ROUND_ID_BYTES)
        bits = r.u8()
        if not 1 <= bits <= 64:
            raise ProtocolError(f"MaskedInput: modulus_bits = {bits}, expected 1..64")
        n = r.u32()
        width = 4 if bits <= 32 else 8
        raw = r.take(n * width)
        r.end()
        vector = np.frombuffer(raw, dtype="<u4" if width == 4 else "<u8").astype(word_dtype(bits))
        _check_vector(vector, bits, None, "MaskedInput")
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
        w = _Writer(_KIND_REQUEST).blob(self.round_id).u32(len(self.survivors))
        for s in self.survivors:
            w.text(s)
        w.u32(len(self.dropped))
        for s in self.dropped:
            w.text(s)
        return w.done()

    @classmethod
    def from_bytes(cls, data: bytes) -> UnmaskRequest:
        """Parse strictly; raises ProtocolError on any deviation from the format."""
        r = _Reader(data, _KIND_REQUEST, "UnmaskRequest")
        round_id = r.blob("round_id", max_len=_MAX_ROUND_ID_BYTES)
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
        w = _Writer(_KIND_RESPONSE).text(self.client_id).blob(self.round_id)
        for group in (self.self_mask_shares, self.key_shares):
            w.u32(len(group))
            for s in group:
                w.text(s.owner).u32(s.x).raw(s.y.to_bytes(FIELD_BYTES, "big"))
        return w.done()

    @classmethod
    def from_bytes(cls, data: bytes) -> UnmaskResponse:
        """Parse strictly; ordinates must be field elements."""
        r = _Reader(data, _KIND_RESPONSE, "UnmaskResponse")
        client_id = r.text("client_id")
        round_id = r.blob("round_id", max_len=_MAX_ROUND_ID_BYTES)
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


# --------------------------------------------------------------------------------------------
# Shamir secret sharing over GF(2^521 - 1)


def shamir_split(
    secret: int, xs: Sequence[int], threshold: int, *, prime: int = PRIME
) -> list[int]:
    """Shares ``f(x)`` of ``secret`` for each abscissa in ``xs``, ``t``-out-of-``len(xs)``.

    ``f`` is a uniformly random polynomial of degree ``threshold - 1`` with ``f(0) = secret``
    (coefficients from :func:`secrets.randbelow`), so any ``threshold - 1`` shares are
    independent of the secret and any ``threshold`` determine it.

    Args:
        secret: The secret, ``0 <= secret < prime``.
        xs: Distinct abscissae in ``[1, prime)``.
        threshold: ``t >= 1``, at most ``len(xs)``.
        prime: The field modulus.

    Returns:
        The ordinates ``f(x)`` in the order of ``xs``.

    Raises:
        PrivacyError: If the arguments are out of range.
    """
    if not 0 <= secret < prime:
        raise PrivacyError("the secret must be an element of the field")
    _check_abscissae(xs, prime)
    if not 1 <= threshold <= len(xs):
        raise PrivacyError(f"threshold {threshold} must be in [1, {len(xs)}] (number of shares)")
    coeffs = [secret] + [secrets.randbelow(prime) for _ in range(threshold - 1)]
    out = []
    for x in xs:
        acc = 0
        for c in reversed(coeffs):
            acc = (acc * x + c) % prime
        out.append(acc)
    return out


def shamir_interpolate(
    points: Sequence[tuple[int, int]], at: int = 0, *, prime: int = PRIME
) -> int:
    """Value at ``at`` of the polynomial of degree ``< len(points)`` through ``points``.

    With ``at = 0`` and ``t`` shares this reconstructs the secret (Lagrange interpolation,
    exact integer arithmetic mod ``prime``).

    Args:
        points: ``(x, y)`` pairs with distinct abscissae in ``[0, prime)``.
        at: Where to evaluate the polynomial.
        prime: The field modulus.

    Returns:
        ``f(at)`` in ``[0, prime)``.

    Raises:
        PrivacyError: If there are no points or the abscissae are not distinct.
    """
    if not points:
        raise PrivacyError("interpolation needs at least one share")
    xs = [x for x, _ in points]
    _check_abscissae(xs, prime, lowest=0)
    total = 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * (at - xj) % prime
                den = den * (xi - xj) % prime
        total = (total + yi * num * pow(den, -1, prime)) % prime
    return total


def _check_abscissae(xs: Sequence[int], prime: int, lowest: int = 1) -> None:
    if len(set(xs)) != len(xs):
        raise PrivacyError("Shamir abscissae must be distinct")
    if any(not lowest <= x < prime for x in xs):
        raise PrivacyError(f"Shamir abscissae must be in [{lowest}, prime)")


# --------------------------------------------------------------------------------------------
# Fixed-point encoding


class UniformSource(Protocol):
    """Where the stochastic-rounding uniforms come from (:class:`SecureUniform` by default)."""

    def uniform(self, n: int) -> np.ndarray:
        """``n`` independent uniforms in [0, 1) as float64."""
        ...


class SecureUniform:
    """Uniforms in [0, 1) with 32 random bits from an AES-256-CTR keystream (a CSPRNG).

    The key is drawn from ``os.urandom`` when the source is made and the counter starts at 0;
    CTR mode's 128-bit counter cannot wrap within any realistic use of one source. AES-CTR
    rather than :class:`privacy.dp.noise.SecureGaussian`'s ChaCha20 because AES-NI makes it
    about 5x faster here. 32 bits because stochastic rounding compares a uniform with the
    fractional part: with ``k / 2^32`` the rounding is unbiased to within ``2^-32`` of one
    quantization step, and an update of 10^6 parameters needs 4 MB of keystream, not 8.
    """

    secure = True
    description = "AES-256-CTR keystream (cryptography, key from os.urandom), 32-bit uniforms"

    def __init__(self) -> None:
        self._stream = Cipher(algorithms.AES(os.urandom(32)), modes.CTR(bytes(16))).encryptor()
        self._buf = bytearray(4 * _CHUNK + _BLOCK - 1)

    def uniform(self, n: int) -> np.ndarray:
        """``n`` independent uniforms in [0, 1), each ``k / 2^32`` for a uniform 32-bit ``k``."""
        if n < 0:
            raise ValueError(f"n = {n}: expected a count >= 0")
        return self.uniform_into(np.empty(n, dtype=np.float64))

    def uniform_into(self, out: np.ndarray) -> np.ndarray:
        """:meth:`uniform` written into ``out`` (1-D float64): the same draws, no allocation.

        The next ``4 * out.size`` keystream bytes, read as little-endian ``u32`` words, each
        scaled by ``2^-32`` (exact in float64).
        """
        if out.dtype != np.float64 or out.ndim != 1:
            raise ValueError("out must be a 1-D float64 array")
        for start in range(0, out.size, _CHUNK):
            m = min(_CHUNK, out.size - start)
            self._stream.update_into(_ZEROS[: 4 * m], self._buf)
            words = np.frombuffer(self._buf, dtype="<u4", count=m)  # a view of the buffer
            np.multiply(words, 2.0**-32, out=out[start : start + m], dtype=np.float64)
        return out


def _modulus_mask(modulus_bits: int) -> np.uint64:
    if not isinstance(modulus_bits, int) or not 1 <= modulus_bits <= 64:
        raise PrivacyError(f"modulus_bits = {modulus_bits!r}: expected an integer in [1, 64]")
    return np.uint64((1 << modulus_bits) - 1)


def check_modulus(num_clients: int, clip_range: float, scale: float, modulus_bits: int) -> int:
    """Refuse a configuration in which the cohort's encoded sum could wrap mod ``2^bits``.

    Each encoded coordinate is an integer in ``[-B, B]`` with ``B = ceil(clip_range * scale)``
    (stochastic rounding of values in ``[-clip_range, clip_range] * scale``), so the sum of
    ``num_clients`` inputs lies in ``[-n B, n B]``. The centred lift recovers it iff
    ``2 n B < 2^bits``.

    Args:
        num_clients: Largest number of inputs summed (the cohort size).
        clip_range: Per-coordinate clipping bound ``c > 0``.
        scale: Fixed-point scale ``s > 0`` (one unit = ``1 / s``).
        modulus_bits: ``bits`` of the modulus, 1..64.

    Returns:
        ``n B``, the largest absolute value of the encoded sum.

    Raises:
        PrivacyError: Naming the numbers if the sum could wrap or ``c s`` is not exact.
    """
    _modulus_mask(modulus_bits)
    if not (isinstance(num_clients, int) and num_clients >= 1):
        raise PrivacyError(f"num_clients = {num_clients!r}: expected an integer >= 1")
    if not (math.isfinite(clip_range) and clip_range > 0):
        raise PrivacyError(f"clip_range = {clip_range!r}: expected a finite number > 0")
    if not (math.isfinite(scale) and scale > 0):
        raise PrivacyError(f"scale = {scale!r}: expected a finite number > 0")
    product = clip_range * scale
    if product > _MAX_EXACT:
        raise PrivacyError(
            f"clip_range * scale = {product:.6g} exceeds 2^52: fixed-point values would not "
            "be exact in float64; lower the scale"
        )
    bound = math.ceil(product)
    total = num_clients * bound
    if 2 * total >= 1 << modulus_bits:
        needed = (2 * total).bit_length()
        hint = (
            f"use modulus_bits >= {needed}"
            if needed <= 64
            else "lower the scale or clip_range (even 64 bits are too few)"
        )
        raise PrivacyError(
            f"the sum of {num_clients} inputs clipped to +/-{clip_range} at scale {scale} "
            f"spans +/-{total} (B = {bound} per input), which wraps mod 2^{modulus_bits} "
            f"(needs 2 * {total} < 2^{modulus_bits}); {hint}"
        )
    return total


def encode(
    update: np.ndarray,
    clip_range: float,
    scale: float,
    modulus_bits: int,
    *,
    rounding: UniformSource | None = None,
    words: bool = False,
) -> np.ndarray:
    """Fixed-point encode an update as integers mod ``2^bits`` (``uint64``).

    Each coordinate is clipped to ``[-c, c]``, multiplied by ``scale`` and rounded
    stochastically (up with probability equal to the fractional part, so
    ``E[encode(x)] = x * scale``); negatives are represented mod ``2^bits``.

    Args:
        update: Float update of any shape (flattened, C order).
        clip_range: Per-coordinate clipping bound ``c > 0``.
        scale: Fixed-point scale ``s > 0``.
        modulus_bits: ``bits`` of the modulus, 1..64.
        rounding: Source of the rounding uniforms; a fresh :class:`SecureUniform` if None.
        words: Return the masked arithmetic's words (:func:`word_dtype`) instead of
            ``uint64``: the same values, without a conversion before masking.

    Returns:
        A flat ``uint64`` (or ``word_dtype(bits)``) vector with values below ``2^bits``.

    Raises:
        PrivacyError: If the update is not finite or the parameters are out of range.
    """
    mask = _modulus_mask(modulus_bits)
    x = np.asarray(update).ravel()
    encoder = _FixedPointEncoder(clip_range, scale, modulus_bits, rounding)
    out = np.empty(x.size, dtype=word_dtype(modulus_bits) if words else np.uint64)
    # Chunks of _CHUNK values: the float64 temporaries stay small (and are reused), where
    # whole-vector ones would fault fresh pages (about 2x slower at d = 1e6).
    for start in range(0, x.size, _CHUNK):
        encoder.encode_into(x[start : start + _CHUNK], out[start : start + _CHUNK])
    out &= out.dtype.type(mask)
    return out


class _FixedPointEncoder:
    """:func:`encode`, one chunk of at most ``_CHUNK`` values at a time, into given words.

    The float64 scratch buffers are made once and reused for every chunk (no temporaries),
    and :class:`SecureUniform` writes its draws into one of them. The words are the encoded
    values mod 2^32 or 2^64 (two's complement), not yet reduced mod ``2^bits``.
    """

    def __init__(
        self, clip_range: float, scale: float, modulus_bits: int, rounding: UniformSource | None
    ) -> None:
        check_modulus(1, clip_range, scale, modulus_bits)
        self.scale = scale
        self._bound = clip_range * scale  # fl(c s), as clip-then-scale rounds it
        self.source = rounding if rounding is not None else SecureUniform()
        self._scaled = np.empty(_CHUNK, dtype=np.float64)
        self._low = np.empty(_CHUNK, dtype=np.float64)
        self._u = np.empty(_CHUNK, dtype=np.float64)
        self._ints = np.empty(_CHUNK, dtype=np.int64)
        self._flags = np.empty(_CHUNK, dtype=bool)

    def _uniform(self, m: int) -> np.ndarray:
        if isinstance(self.source, SecureUniform):
            return self.source.uniform_into(self._u[:m])
        u = self.source.uniform(m)
        if np.shape(u) != (m,):
            raise PrivacyError(f"the rounding source returned shape {np.shape(u)}, not ({m},)")
        return np.asarray(u)

    def encode_into(self, x: np.ndarray, out: np.ndarray) -> None:
        """Encode the values ``x`` (at most ``_CHUNK``) into the words ``out``."""
        m = x.size
        scaled, low, flags = self._scaled[:m], self._low[:m], self._flags[:m]
        with np.errstate(over="ignore", invalid="ignore"):  # inf is refused or clipped below
            # clip(x, -c, c) * s == clip(x * s, -fl(c s), fl(c s)): rounding is monotonic
            np.multiply(x, self.scale, out=scaled, dtype=np.float64)
            # The sum is finite when every value is, unless finite values overflow it (only
            # absurdly large ones can); the exact check decides then. Cheaper than isfinite.
            if not math.isfinite(np.add.reduce(scaled)) and not np.isfinite(x).all():
                raise UpdateError("the update contains NaN or infinity; refusing to encode it")
        np.clip(scaled, -self._bound, self._bound, out=scaled)
        np.floor(scaled, out=low)
        scaled -= low  # the fractional part: round up with this probability
        np.less(self._uniform(m), scaled, out=flags)
        low += flags
        # two's complement; a 32-bit word keeps the value mod 2^32, which 2^bits divides
        ints = self._ints[:m]
        np.copyto(ints, low, casting="unsafe")  # exact: |values| <= 2^52
        np.copyto(out, ints.view(np.uint64), casting="unsafe")


def decode(
    sum_vector: np.ndarray, num_inputs: int, clip_range: float, scale: float, modulus_bits: int
) -> np.ndarray:
    """Map a sum of ``num_inputs`` encoded inputs mod ``2^bits`` back to floats (centred lift).

    Values ``>= 2^(bits-1)`` are negative. The result is the *sum*, not the mean: the caller
    divides by its own denominator (e.g. the expected cohort size of DP-FedAvg).

    Args:
        sum_vector: ``uint64`` vector with values below ``2^bits``.
        num_inputs: How many encoded inputs were summed (bounds the plausible range).
        clip_range: The clipping bound used by :func:`encode`.
        scale: The scale used by :func:`encode`.
        modulus_bits: ``bits`` of the modulus.

    Returns:
        The float64 sum, one value per coordinate.

    Raises:
        PrivacyError: If the configuration could wrap (see :func:`check_modulus`).
        ProtocolError: If the vector is malformed or a value lies outside ``+/- n B`` (it cannot
            be a sum of ``num_inputs`` clipped inputs: corrupted or wrongly unmasked).
    """
    bound = check_modulus(num_inputs, clip_range, scale, modulus_bits)
    v = _check_vector(np.asarray(sum_vector), modulus_bits, None, "decode")
    if modulus_bits == 64 and v.dtype == np.uint64:  # two's complement already
        signed = v.view(np.int64)
    else:
        signed = v.astype(np.int64)  # exact: v < 2^bits and a uint32 word < 2^32
    if modulus_bits < 64:  # sign extension: (v XOR 2^(bits-1)) - 2^(bits-1)
        half = np.int64(1 << (modulus_bits - 1))
        signed ^= half
        signed -= half
    peak = max(-int(signed.min()), int(signed.max())) if signed.size else 0
    if peak > bound:
        raise ProtocolError(
            f"decoded sum has a coordinate of magnitude {peak} > {bound}, "
            f"more than {num_inputs} clipped inputs can produce: the sum is corrupted"
        )
    result: np.ndarray = np.divide(signed, scale, dtype=np.float64)
    return result


def word_dtype(modulus_bits: int) -> np.dtype:
    """Words of the masked arithmetic: ``uint32`` when ``2^bits`` divides ``2^32``, else ``u64``.

    Sums and masks wrap mod ``2^32`` (or ``2^64``) and are reduced mod ``2^bits`` at the end,
    which is exact because ``2^bits`` divides the word modulus. 32-bit words halve the mask
    keystream and the memory traffic of every addition.
    """
    _modulus_mask(modulus_bits)
    return np.dtype(np.uint32) if modulus_bits <= 32 else np.dtype(np.uint64)


def _check_vector(
    vector: np.ndarray, modulus_bits: int, length: int | None, what: str
) -> np.ndarray:
    """A 1-D ``uint32`` or ``uint64`` vector with every value below ``2^bits``."""
    mask = _modulus_mask(modulus_bits)
    if (
        not isinstance(vector, np.ndarray)
        or vector.dtype not in (np.uint32, np.uint64)
        or vector.ndim != 1
    ):
        raise ProtocolError(f"{what}: expected a 1-D uint32 or uint64 vector")
    if length is not None and vector.size != length:
        raise ProtocolError(f"{what}: vector has {vector.size} entries, expected {length}")
    can_exceed = modulus_bits < 8 * vector.dtype.itemsize
    if can_exceed and vector.size and int(vector.max()) > int(mask):
        raise ProtocolError(f"{what}: values must be below 2^{modulus_bits}")
    return vector


# --------------------------------------------------------------------------------------------
# Masks


class _Keystreams:
    """Several AES-256-CTR(seed, IV = 0) masks, applied chunk by chunk to an accumulator.

    Each mask is its keystream read as little-endian words of the accumulator's width
    (``uint32`` words add mod 2^32, ``uint64`` words mod 2^64; see :func:`word_dtype`), added
    or subtracted. :meth:`apply` takes the next chunk of every stream in turn, so a chunk of
    the accumulator stays in cache while all masks are applied to it; the keystreams are
    written with ``update_into`` into one reused buffer (no allocation per chunk).
    """

    def __init__(self, seeds: Sequence[tuple[bytes, bool]], dtype: np.dtype) -> None:
        if np.dtype(dtype) not in (np.uint32, np.uint64):
            raise PrivacyError(f"mask accumulators are uint32 or uint64, not {dtype}")
        for seed, _ in seeds:
            if len(seed) != SECRET_BYTES:
                raise PrivacyError(f"mask seeds must be {SECRET_BYTES} bytes, got {len(seed)}")
        self._wire = np.dtype(dtype).newbyteorder("<")
        self._streams = [
            (Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor(), subtract)
            for seed, subtract in seeds
        ]
        self._buf = bytearray(self._wire.itemsize * _CHUNK + _BLOCK - 1)

    def apply_all(self, acc: np.ndarray) -> None:
        """:meth:`apply` to ``acc`` chunk by chunk, from the streams' current position."""
        for start in range(0, acc.size, _CHUNK):
            self.apply(acc[start : start + _CHUNK])

    def apply(self, part: np.ndarray) -> None:
        """``part +=`` (or ``-=``) the next ``part.size <= _CHUNK`` words of every stream."""
        m = part.size
        for stream, subtract in self._streams:
            stream.update_into(_ZEROS[: self._wire.itemsize * m], self._buf)
            words = np.frombuffer(self._buf, dtype=self._wire, count=m)
            if subtract:
                np.subtract(part, words, out=part)
            else:
                np.add(part, words, out=part)


def _apply_keystreams(acc: np.ndarray, seeds: Sequence[tuple[bytes, bool]]) -> None:
    """For each ``(seed, subtract)``: ``acc += / -= AES-256-CTR(seed, IV = 0)``.

    The keystream is read as little-endian words of acc's width: ``uint32`` words add mod
    2^32, ``uint64`` words mod 2^64 (see :func:`word_dtype`).
    """
    _Keystreams(seeds, acc.dtype).apply_all(acc)


def prg_mask(seed: bytes, length: int, modulus_bits: int) -> np.ndarray:
    """``PRG(seed)``: ``length`` pseudo-random values mod ``2^bits`` from AES-256-CTR.

    The 256-bit seed is the AES key; the IV is all zeros, which is safe because every seed is
    fresh per round and expanded once. Words are the keystream read as little-endian ``u32``
    when ``bits <= 32``, else ``u64`` (:func:`word_dtype`), masked to ``bits`` bits (reducing
    mod ``2^bits`` commutes with the word's wraparound).

    Args:
        seed: 32-byte seed (``b_u`` or ``s_uv``).
        length: Number of values ``d``.
        modulus_bits: ``bits`` of the modulus, 1..64.

    Returns:
        A ``uint64`` vector of length ``d`` with values below ``2^bits``.
    """
    mask = _modulus_mask(modulus_bits)
    out = np.zeros(length, dtype=word_dtype(modulus_bits))
    _apply_keystreams(out, [(seed, False)])
    return out.astype(np.uint64) & mask


def _kdf(label: bytes, shared: bytes, round_id: bytes, a: str, b: str) -> bytes:
    """HKDF-SHA256 of a key agreement, bound to the round and the two ids in canonical order."""
    lo, hi = sorted((a, b))
    info = _DOMAIN + label + _lp(round_id, lo.encode("utf-8"), hi.encode("utf-8"))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)


def _agree(private: X25519PrivateKey, public: bytes, peer: str) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as exc:  # low-order point: the shared secret would be all zeros
        raise PrivacyError(f"client {peer!r} advertised an invalid X25519 public key") from exc


def _share_ad(round_id: bytes, sender: str, receiver: str) -> bytes:
    return _DOMAIN + b"share" + _lp(round_id, sender.encode("utf-8"), receiver.encode("utf-8"))


def _pub_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes_raw()


# --------------------------------------------------------------------------------------------
# Configuration and communication graph


def neighbour_graph(ids: Sequence[str], k: int, seed: bytes) -> dict[str, frozenset[str]]:
    """The communication graph: complete (SecAgg) or a random ``k``-regular graph (SecAgg+).

    For ``0 < k < n - 1`` the graph is a Harary graph ``H_{k,n}`` (the ``n`` clients on a
    ring, each joined to the ``k // 2`` nearest on either side, plus the diametrically
    opposite client when ``k`` is odd) whose vertices are labelled by a uniformly random
    permutation of the clients: the ring order sorts the clients by
    ``SHA-256(domain, seed, id)``. This is the graph of Google's SecAgg+ implementation of
    Bell et al. The seed must be public and agreed (the round id), so every party derives the
    same graph.

    Args:
        ids: The cohort (distinct ids).
        k: Neighbours per client; ``0`` or ``n - 1`` for the complete graph.
        seed: Public randomness for the permutation.

    Returns:
        Each id mapped to the set of its neighbours (never itself).

    Raises:
        PrivacyError: If ids repeat, ``k`` is out of range or no ``k``-regular graph exists.
    """
    nodes = sorted(set(ids))
    n = len(nodes)
    if n != len(ids):
        raise PrivacyError("the cohort lists a client more than once")
    if k == 0 or k == n - 1:
        return {u: frozenset(v for v in nodes if v != u) for u in nodes}
    if not 1 <= k < n - 1:
        raise PrivacyError(f"neighbours = {k}: expected 0 (all) or 1..{n - 1} for {n} clients")
    if k % 2 == 1 and n % 2 == 1:
        raise PrivacyError(
            f"no {k}-regular graph on {n} clients exists (both odd); use {k + 1} neighbours"
        )
    ring = sorted(
        nodes,
        key=lambda u: hashlib.sha256(_DOMAIN + b"graph" + _lp(seed, u.encode("utf-8"))).digest(),
    )
    offsets = list(range(1, k // 2 + 1)) + list(range(n - k // 2, n))
    if k % 2 == 1:
        offsets.append(n // 2)
    return {u: frozenset(ring[(i + o) % n] for o in offsets) for i, u in enumerate(ring)}


def survivor_groups(
    graph: dict[str, frozenset[str]], survivors: Iterable[str]
) -> list[frozenset[str]]:
    """The connected parts of the neighbour graph restricted to ``survivors``, largest first.

    Pairwise masks cancel only along edges between survivors, so unmasking a round whose
    survivors fall into more than one part would give the server each part's own sum (a
    SecAgg+ graph with odd ``k`` can split while every survivor keeps ``t`` neighbours).
    Both the server and every client refuse to unmask unless there is exactly one part.
    """
    left = set(survivors)
    groups: list[frozenset[str]] = []
    while left:
        frontier = [min(left)]
        group: set[str] = set()
        while frontier:
            u = frontier.pop()
            if u in group:
                continue
            group.add(u)
            frontier.extend(graph[u] & left - group)
        left -= group
        groups.append(frozenset(group))
    return sorted(groups, key=lambda g: (-len(g), min(g)))


def _describe_groups(groups: list[frozenset[str]]) -> str:
    return "; ".join("{" + ", ".join(sorted(g)) + "}" for g in groups)


@dataclass(frozen=True)
class SecAggConfig:
    """Parameters of one secure-aggregation round, known to the server and every client.

    Attributes:
        round_id: Public, never-repeated round identifier (1..255 bytes); it is bound into
            every signature, KDF context and AEAD associated data, and seeds the graph.
        cohort: The ids of the clients selected for the round (stored sorted).
        threshold: ``t``: shares needed to rebuild a secret, ``k // 2 < t <= k``. A strict
            majority of each neighbourhood prevents a server from collecting ``t`` shares of
            both ``b_u`` and ``s_u^SK`` from two disjoint groups.
        clip_range: Per-coordinate clipping bound of the fixed-point encoding.
        scale: Fixed-point scale (one integer unit = ``1 / scale``).
        neighbours: ``k``: 0 for SecAgg (complete graph, ``k = n - 1``), else SecAgg+.
        modulus_bits: Arithmetic is mod ``2^modulus_bits`` (1..64); checked by
            :func:`check_modulus` so the cohort's sum cannot wrap.
        min_inputs: The fewest masked inputs a sum may be unmasked with (0: the protocol's
            own ``t + 1``). Under distributed DP each input carries a share of the noise, so a
            sum of fewer than the shares it needs would be under-noised: the server aborts
            before asking for shares, and a client refuses an unmask request listing fewer.
    """

    round_id: bytes
    cohort: tuple[str, ...]
    threshold: int
    clip_range: float
    scale: float
    neighbours: int = 0
    modulus_bits: int = 32
    min_inputs: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.round_id, bytes) or not 1 <= len(self.round_id) <= 255:
            raise PrivacyError("round_id must be 1..255 bytes")
        for u in self.cohort:
            _check_id(u, "SecAggConfig")
        object.__setattr__(self, "cohort", tuple(sorted(self.cohort)))
        n = len(self.cohort)
        if len(set(self.cohort)) != n:
            raise PrivacyError("the cohort lists a client more than once")
        if n < 2:
            raise PrivacyError(f"secure aggregation needs at least 2 clients, got {n}")
        if self.neighbours not in (0, n - 1):
            neighbour_graph(self.cohort, self.neighbours, self.round_id)  # validates k
        k = self.degree
        if not k // 2 < self.threshold <= k:
            raise PrivacyError(
                f"threshold = {self.threshold}: expected {k // 2 + 1}..{k} for {k} neighbours "
                "(a strict majority, at most the neighbourhood)"
            )
        if not 0 <= self.min_inputs <= n:
            raise PrivacyError(f"min_inputs = {self.min_inputs}: expected 0..{n} for {n} clients")
        check_modulus(n, self.clip_range, self.scale, self.modulus_bits)

    @property
    def degree(self) -> int:
        """Neighbours per client ``k`` (``n - 1`` for SecAgg)."""
        n = len(self.cohort)
        return n - 1 if self.neighbours == 0 else self.neighbours

    def graph(self) -> dict[str, frozenset[str]]:
        """The round's communication graph (see :func:`neighbour_graph`)."""
        return neighbour_graph(self.cohort, self.neighbours, self.round_id)

    def share_x(self, client_id: str) -> int:
        """Shamir abscissa of the shares a client holds: its cohort position plus one."""
        return self.cohort.index(client_id) + 1

    def encode(
        self, update: np.ndarray, rounding: UniformSource | None = None, *, words: bool = False
    ) -> np.ndarray:
        """:func:`encode` with this round's clip range, scale and modulus."""
        return encode(
            update, self.clip_range, self.scale, self.modulus_bits, rounding=rounding, words=words
        )

    def decode(self, sum_vector: np.ndarray, num_inputs: int) -> np.ndarray:
        """:func:`decode` with this round's clip range, scale and modulus (float sum)."""
        return decode(sum_vector, num_inputs, self.clip_range, self.scale, self.modulus_bits)


#: The scalar of the low-order check in :func:`_verify_advert`. Every X25519 scalar is
#: clamped to a multiple of 8, which sends a point of order dividing 8 to the identity (the
#: all-zero output ``exchange`` refuses) whatever the scalar, and a point with a large-order
#: part elsewhere unless the scalar is a multiple of that order (probability ~2^-252 for a
#: random key): so one key drawn per process gives every check the verdict a fresh key would,
#: without a key generation per advertised key (two per client and round, on every client
#: and the server). Its agreements are thrown away.
_LOW_ORDER_PROBE = X25519PrivateKey.generate()


def _verify_advert(
    advert: AdvertiseKeys, config: SecAggConfig, registry: Mapping[str, Ed25519PublicKey]
) -> None:
    """Check an advertisement's round, sender, key sizes and Ed25519 signature."""
    if not isinstance(advert, AdvertiseKeys):
        raise ProtocolError(f"expected AdvertiseKeys, got {type(advert).__name__}")
    who = advert.client_id
    if advert.round_id != config.round_id:
        raise ProtocolError(f"advertisement of {who!r} is for another round")
    if who not in config.cohort:
        raise ProtocolError(f"advertisement of {who!r}, which is not in the cohort")
    if len(advert.c_pk) != 32 or len(advert.s_pk) != 32 or advert.c_pk == advert.s_pk:
        raise ProtocolError(f"advertisement of {who!r} has malformed or equal public keys")
    identity = registry.get(who)
    if identity is None:
        raise PrivacyError(f"client {who!r} has no enrolled identity key; cannot verify its keys")
    try:
        identity.verify(advert.signature, advert.signed_payload())
    except InvalidSignature as exc:
        raise PrivacyError(
            f"the key advertisement of client {who!r} is not signed by its enrolled identity "
            "key: substituted or unsigned public keys; refusing to use them"
        ) from exc
    for name, key in (("c_pk", advert.c_pk), ("s_pk", advert.s_pk)):
        try:  # a low-order point makes every agreement with it fail (or all zeros)
            _LOW_ORDER_PROBE.exchange(X25519PublicKey.from_public_bytes(key))
        except ValueError as exc:
            raise ProtocolError(
                f"advertisement of {who!r}: {name} is not a usable X25519 public key (a "
                "low-order point); the client is left out of the round"
            ) from exc


# --------------------------------------------------------------------------------------------
# Client


class SecAggClient:
    """One client's side of one round (create a new one per round: all keys are fresh).

    Call :meth:`advertise_keys`, :meth:`share_keys`, :meth:`masked_input`, :meth:`unmask`
    in this order, each with what the server relayed. Every incoming message is verified.

    Args:
        client_id: This client's id (in ``config.cohort``).
        identity_key: Its long-term Ed25519 identity key (enrolled in ``registry``).
        config: The round's configuration.
        registry: Enrolled Ed25519 identity public keys by client id.
        vector_length: ``d``, the length of the flattened update.
        rounding: Source of stochastic-rounding uniforms (tests inject a seeded one);
            a fresh :class:`SecureUniform` if None.
    """

    def __init__(
        self,
        client_id: str,
        identity_key: Ed25519PrivateKey,
        config: SecAggConfig,
        registry: Mapping[str, Ed25519PublicKey],
        vector_length: int,
        *,
        rounding: UniformSource | None = None,
    ) -> None:
        if client_id not in config.cohort:
            raise PrivacyError(f"client {client_id!r} is not in the round's cohort")
        enrolled = registry.get(client_id)
        mine = identity_key.public_key().public_bytes_raw()
        if enrolled is None or enrolled.public_bytes_raw() != mine:
            raise PrivacyError(f"the identity key of {client_id!r} is not the enrolled one")
        if vector_length < 1:
            raise PrivacyError(f"vector_length = {vector_length}: expected >= 1")
        self.client_id = client_id
        self.config = config
        self.vector_length = vector_length
        self._identity = identity_key
        self._registry = registry
        self._rounding = rounding
        self._graph = config.graph()  # the round's whole graph: unmasking checks survivors
        self._neighbours = self._graph[client_id]
        self._c_sk = X25519PrivateKey.generate()
        self._s_sk: X25519PrivateKey | None = X25519PrivateKey.generate()
        self._b: bytes | None = None
        self._advert: AdvertiseKeys | None = None
        self._peers: dict[str, AdvertiseKeys] = {}
        self._share_keys: dict[str, bytes] = {}  # peer -> AES-GCM key (see _share_key)
        self._held: dict[str, tuple[int, int, int]] = {}  # sender -> (x, y of b, y of s_sk)
        self._revealed: dict[str, str] = {}  # owner -> "b" or "s"
        self._stage = 0

    def _expect_stage(self, stage: int, what: str) -> None:
        if self._stage != stage:
            raise ProtocolError(f"{self.client_id!r}: {what} called out of order")

    def advertise_keys(self) -> AdvertiseKeys:
        """Round 0 (*AdvertiseKeys*): sign and return ``(c_u^PK, s_u^PK)``."""
        self._expect_stage(0, "advertise_keys")
        assert self._s_sk is not None
        c_pk, s_pk = _pub_bytes(self._c_sk), _pub_bytes(self._s_sk)
        payload = _advert_payload(self.client_id, self.config.round_id, c_pk, s_pk)
        self._advert = AdvertiseKeys(
            self.client_id, self.config.round_id, c_pk, s_pk, self._identity.sign(payload)
        )
        self._stage = 1
        return self._advert

    def share_keys(self, adverts: Sequence[AdvertiseKeys]) -> tuple[EncryptedShare, ...]:
        """Round 1 (*ShareKeys*): verify adverts, then send each neighbour its shares.

        Draws the self-mask seed ``b_u`` and splits it and ``s_u^SK`` ``t``-out-of-``k'``
        among the ``k'`` neighbours that advertised keys; each neighbour's pair of shares is
        encrypted under the key agreed from ``c_u^SK`` and its ``c_v^PK``.

        Args:
            adverts: The advertisements relayed by the server (at least the neighbours').

        Returns:
            One encrypted share per neighbour that advertised keys.

        Raises:
            PrivacyError: If a signature does not verify (naming the client) or the server
                altered this client's own advertisement.
            ProtocolError: If an advertisement is malformed, repeated or for another round.
            RoundAborted: If fewer than ``t`` neighbours advertised keys.
        """
        self._expect_stage(1, "share_keys")
        assert self._advert is not None and self._s_sk is not None
        seen: dict[str, AdvertiseKeys] = {}
        keys: set[bytes] = set()
        for advert in adverts:
            _verify_advert(advert, self.config, self._registry)
            who = advert.client_id
            if who in seen:
                raise ProtocolError(f"client {who!r} advertised keys twice")
            seen[who] = advert
            if who == self.client_id:
                if advert != self._advert:
                    raise PrivacyError(f"the server altered the advertisement of {who!r}")
                continue
            if {advert.c_pk, advert.s_pk} & (keys | {self._advert.c_pk, self._advert.s_pk}):
                raise ProtocolError(f"client {who!r} advertised a public key already in use")
            keys |= {advert.c_pk, advert.s_pk}
            if who in self._neighbours:
                self._peers[who] = advert
        t = self.config.threshold
        if len(self._peers) < t:
            raise RoundAborted(
                f"{self.client_id!r}: only {len(self._peers)} neighbours advertised keys, "
                f"fewer than the threshold t = {t}"
            )
        peers = sorted(self._peers)
        xs = [self.config.share_x(v) for v in peers]
        self._b = secrets.token_bytes(SECRET_BYTES)
        b_ys = shamir_split(int.from_bytes(self._b, "big"), xs, t)
        s_ys = shamir_split(int.from_bytes(self._s_sk.private_bytes_raw(), "big"), xs, t)
        out = []
        for v, x, b_y, s_y in zip(peers, xs, b_ys, s_ys, strict=True):
            key = self._share_key(v)
            plaintext = (
                _Writer(_KIND_SHARE_PLAINTEXT)
                .text(self.client_id)
                .text(v)
                .u32(x)
                .raw(b_y.to_bytes(FIELD_BYTES, "big"))
                .raw(s_y.to_bytes(FIELD_BYTES, "big"))
                .done()
            )
            nonce = os.urandom(_NONCE_BYTES)
            ad = _share_ad(self.config.round_id, self.client_id, v)
            ct = AESGCM(key).encrypt(nonce, plaintext, ad)
            out.append(EncryptedShare(self.client_id, v, self.config.round_id, nonce, ct))
        self._stage = 2
        return tuple(out)

    def _share_key(self, peer: str) -> bytes:
        """The AES-GCM key of the pair's shares, one per pair for both directions.

        :func:`_kdf` orders the two ids, so the key that sealed this client's shares for
        ``peer`` also opens ``peer``'s shares for it (each direction has its own associated
        data and random nonces); it is derived once per round.
        """
        key = self._share_keys.get(peer)
        if key is None:
            shared = _agree(self._c_sk, self._peers[peer].c_pk, peer)
            key = _kdf(b"share-key", shared, self.config.round_id, self.client_id, peer)
            self._share_keys[peer] = key
        return key

    def _open_share(self, share: EncryptedShare) -> tuple[int, int, int]:
        sender = share.sender
        if share.round_id != self.config.round_id:
            raise ProtocolError(f"share from {sender!r} is for another round")
        if share.receiver != self.client_id:
            raise ProtocolError(f"share from {sender!r} is addressed to {share.receiver!r}")
        if sender not in self._peers:
            raise ProtocolError(f"share from {sender!r}, which is not a neighbour with keys")
        key = self._share_key(sender)
        ad = _share_ad(self.config.round_id, sender, self.client_id)
        try:
            plaintext = AESGCM(key).decrypt(share.nonce, share.ciphertext, ad)
        except (InvalidTag, ValueError) as exc:
            raise PrivacyError(
                f"the encrypted share from {sender!r} fails authentication (tampered, "
                "re-addressed or not encrypted for this client)"
            ) from exc
        r = _Reader(plaintext, _KIND_SHARE_PLAINTEXT, f"share from {sender!r}")
        inner_sender, inner_receiver, x = r.text("sender"), r.text("receiver"), r.u32()
        b_y, s_y = r.element("share of b"), r.element("share of s_sk")
        r.end()
        expected = (sender, self.client_id, self.config.share_x(self.client_id))
        if (inner_sender, inner_receiver, x) != expected:
            raise ProtocolError(f"share from {sender!r} names the wrong parties or abscissa")
        return x, b_y, s_y

    def masked_input(
        self,
        shares: Sequence[EncryptedShare],
        update: np.ndarray,
        *,
        encoded: np.ndarray | None = None,
    ) -> MaskedInput:
        """Round 2 (*MaskedInputCollection*): store the shares received, send ``y_u``.

        ``y_u = encode(x_u) + PRG(b_u) + sum_{v > u} PRG(s_uv) - sum_{v < u} PRG(s_uv)``
        mod ``2^bits``, over the neighbours ``v`` whose shares arrived (the server routed the
        shares of exactly ``U2``, so both ends of every pair agree on who masks with whom).

        Args:
            shares: The encrypted shares the server routed to this client.
            update: The float update (``vector_length`` values, any shape).
            encoded: The update already encoded as integers mod ``2^bits`` (for example by
                the distributed discrete Gaussian); replaces the fixed-point encoding.

        Returns:
            The masked input.

        Raises:
            PrivacyError: If a share fails authentication (naming its sender) or the update
                is not finite.
            ProtocolError: If a share is malformed, repeated or from a non-neighbour.
            RoundAborted: If fewer than ``t`` neighbours' shares arrived.
        """
        self._expect_stage(2, "masked_input")
        assert self._b is not None and self._s_sk is not None
        update = np.asarray(update)
        if update.size != self.vector_length:
            raise UpdateError(f"update has {update.size} values, expected {self.vector_length}")
        for share in shares:
            if share.sender in self._held:
                raise ProtocolError(f"two shares from {share.sender!r}")
            self._held[share.sender] = self._open_share(share)
        t = self.config.threshold
        if len(self._held) < t:
            raise RoundAborted(
                f"{self.client_id!r}: only {len(self._held)} neighbours shared keys, fewer "
                f"than the threshold t = {t}"
            )
        cfg, bits = self.config, self.config.modulus_bits
        seeds = [(self._b, False)]
        for v in sorted(self._held):
            shared = _agree(self._s_sk, self._peers[v].s_pk, v)
            seed = _kdf(b"mask-seed", shared, cfg.round_id, self.client_id, v)
            seeds.append((seed, v < self.client_id))
        masks = _Keystreams(seeds, word_dtype(bits))
        if encoded is None:  # encode a chunk, mask it, next chunk (it stays in cache)
            encoder = _FixedPointEncoder(cfg.clip_range, cfg.scale, bits, self._rounding)
            x = update.ravel()
            acc = np.empty(self.vector_length, dtype=word_dtype(bits))
            for start in range(0, acc.size, _CHUNK):
                part = acc[start : start + _CHUNK]
                encoder.encode_into(x[start : start + _CHUNK], part)
                masks.apply(part)
        else:
            acc = _check_vector(
                np.array(encoded, dtype=np.uint64), bits, self.vector_length, "encoded update"
            ).astype(word_dtype(bits))
            masks.apply_all(acc)
        acc &= acc.dtype.type(_modulus_mask(bits))
        self._b, self._s_sk = None, None  # no longer needed by this client
        self._share_keys.clear()
        self._stage = 3
        return MaskedInput(self.client_id, self.config.round_id, self.config.modulus_bits, acc)

    def unmask(self, request: UnmaskRequest) -> UnmaskResponse:
        """Round 4 (*Unmasking*): reveal ``b_v`` shares of survivors, ``s_v^SK`` of dropouts.

        Refuses to reveal both kinds of share of one client, in one request or across
        requests, and refuses a request that counts this client as dropped.

        Args:
            request: The server's request.

        Returns:
            The shares this client holds for the requested clients.

        Raises:
            PrivacyError: If the request would reveal both shares of a client.
            ProtocolError: If the request is malformed or out of order.
            RoundAborted: If fewer than ``t`` survivors are listed.
        """
        if self._stage != 3:
            raise ProtocolError(f"{self.client_id!r}: unmask called before masked_input")
        if request.round_id != self.config.round_id:
            raise ProtocolError("unmask request is for another round")
        survivors, dropped = set(request.survivors), set(request.dropped)
        if len(survivors) != len(request.survivors) or len(dropped) != len(request.dropped):
            raise ProtocolError("unmask request lists a client twice")
        unknown = (survivors | dropped) - set(self.config.cohort)
        if unknown:
            raise ProtocolError(f"unmask request names clients outside the cohort: {unknown}")
        both = sorted(survivors & dropped)
        both += sorted(u for u in survivors if self._revealed.get(u) == "s")
        both += sorted(u for u in dropped if self._revealed.get(u) == "b")
        if both:
            raise PrivacyError(
                f"{self.client_id!r} refuses to reveal shares of both the self mask b_u and the "
                f"mask key s_u^SK of {', '.join(map(repr, both))}: that would expose the input"
            )
        if self.client_id in dropped:
            raise PrivacyError(
                f"the server lists {self.client_id!r} as dropped although it sent its masked "
                "input; refusing to help reconstruct its mask key"
            )
        t = self.config.threshold
        if len(survivors) < t:
            raise RoundAborted(f"only {len(survivors)} survivors, fewer than t = {t}")
        if len(survivors) < self.config.min_inputs:
            raise PrivacyError(
                f"{self.client_id!r} refuses to unmask a sum of {len(survivors)} inputs: the "
                f"round needs at least {self.config.min_inputs} (under distributed DP, the "
                "noise shares the sum must carry)"
            )
        groups = survivor_groups(self._graph, survivors)
        if len(groups) > 1:
            raise PrivacyError(
                f"{self.client_id!r} refuses to unmask: the survivors split into "
                f"{len(groups)} groups no pairwise mask joins ({_describe_groups(groups)}), "
                "so the server would learn each group's own sum"
            )
        b_out, s_out = [], []
        for owner in sorted(self._held):
            x, b_y, s_y = self._held[owner]
            if owner in survivors:
                b_out.append(RevealedShare(owner, x, b_y))
                self._revealed[owner] = "b"
            elif owner in dropped:
                s_out.append(RevealedShare(owner, x, s_y))
                self._revealed[owner] = "s"
        return UnmaskResponse(self.client_id, self.config.round_id, tuple(b_out), tuple(s_out))


# --------------------------------------------------------------------------------------------
# Server


class SecAggServer:
    """The server's side of one round: verifies, relays, sums and unmasks.

    Stages (each ``add_*`` may be called once per client; a message that fails validation
    raises and is not recorded, so its sender counts as dropped):

    0. :meth:`add_advert` for each client, then :meth:`route_adverts` (Round 0),
    1. :meth:`add_shares` for each client, then :meth:`route_shares` (Round 1),
    2. :meth:`add_masked_input` for each client (folded into a running sum mod ``2^bits``,
       memory ``O(d)``), then :meth:`unmask_request` (Round 2),
    3. :meth:`add_unmask_response` for each survivor, then :meth:`finish` (Round 4).

    Args:
        config: The round's configuration.
        registry: Enrolled Ed25519 identity public keys by client id.
        vector_length: ``d``.
    """

    def __init__(
        self,
        config: SecAggConfig,
        registry: Mapping[str, Ed25519PublicKey],
        vector_length: int,
    ) -> None:
        if vector_length < 1:
            raise PrivacyError(f"vector_length = {vector_length}: expected >= 1")
        self.config = config
        self.vector_length = vector_length
        self._registry = registry
        self._graph = config.graph()
        self._adverts: dict[str, AdvertiseKeys] = {}
        self._keys_in_use: set[bytes] = set()
        self._shares: dict[str, tuple[EncryptedShare, ...]] = {}
        self._u1: frozenset[str] = frozenset()
        self._u2: frozenset[str] = frozenset()
        self._u3: set[str] = set()
        self._dropped: frozenset[str] = frozenset()
        self._sum: np.ndarray | None = None
        self._b_shares: dict[str, list[tuple[int, int]]] = {}
        self._s_shares: dict[str, list[tuple[int, int]]] = {}
        self._responders: set[str] = set()
        self._result: np.ndarray | None = None
        self._stage = 0

    # -- helpers ----------------------------------------------------------------------------

    def _expect_stage(self, stage: int, what: str) -> None:
        if self._stage == -1:
            raise RoundAborted("the round was aborted")
        if self._stage != stage:
            raise ProtocolError(f"server: {what} called out of order")

    def _abort(self, message: str) -> RoundAborted:
        self._stage = -1
        self._sum = None
        self._b_shares.clear()
        self._s_shares.clear()
        return RoundAborted(message)

    def _require_participants(self, group: Iterable[str], stage: str) -> None:
        m, t = len(list(group)), self.config.threshold
        if m < t + 1:
            raise self._abort(
                f"only {m} clients {stage}; at least t + 1 = {t + 1} are needed "
                f"(every survivor needs t = {t} surviving neighbours)"
            )
        if m < self.config.min_inputs:
            raise self._abort(
                f"only {m} clients {stage}; the round needs at least {self.config.min_inputs} "
                "inputs in its sum, so it is aborted before any share is revealed"
            )

    @property
    def survivors(self) -> tuple[str, ...]:
        """``U3``: clients whose masked input is in the sum (sorted)."""
        return tuple(sorted(self._u3))

    @property
    def result(self) -> np.ndarray | None:
        """The unmasked sum once :meth:`finish` succeeded; None before and after an abort."""
        return None if self._result is None else self._result.copy()

    # -- Round 0 ----------------------------------------------------------------------------

    def add_advert(self, advert: AdvertiseKeys) -> None:
        """Verify and record one client's key advertisement (Round 0).

        Raises:
            PrivacyError: If the signature does not verify against the registry.
            ProtocolError: If malformed, repeated, for another round or reusing a key.
        """
        self._expect_stage(0, "add_advert")
        _verify_advert(advert, self.config, self._registry)
        if advert.client_id in self._adverts:
            raise ProtocolError(f"client {advert.client_id!r} advertised keys twice")
        if {advert.c_pk, advert.s_pk} & self._keys_in_use:
            raise ProtocolError(f"client {advert.client_id!r} reuses a public key")
        self._keys_in_use |= {advert.c_pk, advert.s_pk}
        self._adverts[advert.client_id] = advert

    def route_adverts(self) -> dict[str, tuple[AdvertiseKeys, ...]]:
        """Close Round 0: ``U1``; for each ``u`` in ``U1`` its own and its neighbours' adverts.

        Raises:
            RoundAborted: If fewer than ``t + 1`` clients advertised keys.
        """
        self._expect_stage(0, "route_adverts")
        self._u1 = frozenset(self._adverts)
        self._require_participants(self._u1, "advertised keys")
        self._stage = 1
        return {
            u: tuple(self._adverts[v] for v in sorted((self._graph[u] & self._u1) | {u}))
            for u in sorted(self._u1)
        }

    # -- Round 1 ----------------------------------------------------------------------------

    def add_shares(self, sender: str, shares: Sequence[EncryptedShare]) -> None:
        """Record one client's encrypted shares: exactly one per neighbour in ``U1``.

        Raises:
            ProtocolError: If the sender is unknown or repeated, or the shares do not cover
                exactly its neighbours that advertised keys.
        """
        self._expect_stage(1, "add_shares")
        if sender not in self._u1:
            raise ProtocolError(f"shares from {sender!r}, which did not advertise keys")
        if sender in self._shares:
            raise ProtocolError(f"client {sender!r} sent its shares twice")
        receivers = []
        for s in shares:
            if s.sender != sender or s.round_id != self.config.round_id:
                raise ProtocolError(f"a share sent by {sender!r} has the wrong sender or round")
            if len(s.nonce) != _NONCE_BYTES or len(s.ciphertext) > _MAX_CIPHERTEXT_BYTES:
                raise ProtocolError(f"a share sent by {sender!r} is malformed")
            receivers.append(s.receiver)
        expected = self._graph[sender] & self._u1
        if len(receivers) != len(set(receivers)) or set(receivers) != expected:
            raise ProtocolError(
                f"client {sender!r} must send exactly one share to each of its {len(expected)} "
                f"neighbours with keys, got {len(receivers)}"
            )
        self._shares[sender] = tuple(shares)

    def route_shares(self) -> dict[str, tuple[EncryptedShare, ...]]:
        """Close Round 1: ``U2``; each client in ``U2`` gets the shares sent to it from ``U2``.

        Raises:
            RoundAborted: If fewer than ``t + 1`` clients shared their keys.
        """
        self._expect_stage(1, "route_shares")
        self._u2 = frozenset(self._shares)
        self._require_participants(self._u2, "shared their keys")
        inbox: dict[str, list[EncryptedShare]] = {u: [] for u in sorted(self._u2)}
        for sender in sorted(self._u2):
            for s in self._shares[sender]:
                if s.receiver in inbox:
                    inbox[s.receiver].append(s)
        self._shares.clear()
        self._sum = np.zeros(self.vector_length, dtype=word_dtype(self.config.modulus_bits))
        self._stage = 2
        return {u: tuple(v) for u, v in inbox.items()}

    # -- Round 2 ----------------------------------------------------------------------------

    def add_masked_input(self, masked: MaskedInput) -> None:
        """Fold one masked input into the running sum mod ``2^bits`` (it is not kept).

        Raises:
            ProtocolError: If the sender is not in ``U2``, repeated, or the vector malformed.
        """
        self._expect_stage(2, "add_masked_input")
        assert self._sum is not None
        who = masked.client_id
        if who not in self._u2:
            raise ProtocolError(f"masked input from {who!r}, which did not share its keys")
        if who in self._u3:
            raise ProtocolError(f"client {who!r} sent its masked input twice")
        if masked.round_id != self.config.round_id:
            raise ProtocolError(f"masked input from {who!r} is for another round")
        if masked.modulus_bits != self.config.modulus_bits:
            raise ProtocolError(f"masked input from {who!r} uses another modulus")
        vector = _check_vector(
            masked.vector, self.config.modulus_bits, self.vector_length, f"input from {who!r}"
        )
        self._sum += vector  # wraps mod 2^32 or 2^64 (word_dtype); reduced mod 2^bits at the end
        self._u3.add(who)

    def unmask_request(self) -> UnmaskRequest:
        """Close Round 2: ask the survivors for the shares needed to remove the masks.

        Before asking, checks that every client whose secret must be rebuilt has at least
        ``t`` neighbours in ``U3`` that hold a share; otherwise aborts without asking.

        Raises:
            RoundAborted: If a neighbourhood has fewer than ``t`` surviving share holders.
        """
        self._expect_stage(2, "unmask_request")
        self._require_participants(self._u3, "sent masked inputs")
        u3 = frozenset(self._u3)
        self._dropped = frozenset(u for u in self._u2 - u3 if self._graph[u] & u3)
        t = self.config.threshold
        short = {
            u: len(self._graph[u] & u3)
            for u in sorted(u3 | self._dropped)
            if len(self._graph[u] & u3) < t
        }
        if short:
            detail = ", ".join(f"{u!r} ({m})" for u, m in short.items())
            raise self._abort(
                f"too few surviving neighbours hold shares of {detail}; t = {t} are needed; "
                "round aborted before any share was revealed"
            )
        groups = survivor_groups(self._graph, u3)
        if len(groups) > 1:
            raise self._abort(
                f"the {len(u3)} survivors split into {len(groups)} groups no pairwise mask "
                f"joins ({_describe_groups(groups)}): unmasking would reveal each group's own "
                "sum; round aborted before any share was revealed"
            )
        self._stage = 3
        return UnmaskRequest(self.config.round_id, tuple(sorted(u3)), tuple(sorted(self._dropped)))

    # -- Round 4 ----------------------------------------------------------------------------

    def add_unmask_response(self, response: UnmaskResponse) -> None:
        """Record one survivor's revealed shares after checking they are what was asked.

        Raises:
            ProtocolError: If the responder is not a survivor, repeated, or the shares are not
                exactly those requested from it (owners, kinds, abscissa, field range).
        """
        self._expect_stage(3, "add_unmask_response")
        who = response.client_id
        if who not in self._u3:
            raise ProtocolError(f"unmask response from {who!r}, which is not a survivor")
        if who in self._responders:
            raise ProtocolError(f"client {who!r} responded twice")
        if response.round_id != self.config.round_id:
            raise ProtocolError(f"unmask response from {who!r} is for another round")
        x = self.config.share_x(who)
        groups = (
            (response.self_mask_shares, self._graph[who] & self._u3, self._b_shares),
            (response.key_shares, self._graph[who] & self._dropped, self._s_shares),
        )
        for shares, expected, _ in groups:
            owners = [s.owner for s in shares]
            if len(owners) != len(set(owners)) or set(owners) != expected:
                raise ProtocolError(f"unmask response from {who!r} has the wrong owners")
            if any(s.x != x or not 0 <= s.y < PRIME for s in shares):
                raise ProtocolError(f"unmask response from {who!r} has malformed shares")
        for shares, _, store in groups:
            for s in shares:
                store.setdefault(s.owner, []).append((s.x, s.y))
        self._responders.add(who)

    def finish(self) -> np.ndarray:
        """Close Round 4: rebuild the secrets, remove the masks, return the sum.

        Returns:
            ``sum_{u in U3} encode(x_u) mod 2^bits`` as ``uint64`` (decode with
            ``config.decode(result, len(server.survivors))``).

        Raises:
            RoundAborted: If some secret has fewer than ``t`` shares (nothing is unmasked and
                no sum is ever produced).
            ProtocolError: If rebuilt secrets are inconsistent (a bad share).
        """
        self._expect_stage(3, "finish")
        assert self._sum is not None
        t = self.config.threshold
        short = {u: len(self._b_shares.get(u, ())) for u in self._u3}
        short.update({u: len(self._s_shares.get(u, ())) for u in self._dropped})
        short = {u: m for u, m in sorted(short.items()) if m < t}
        if short:
            detail = ", ".join(f"{u!r} ({m})" for u, m in short.items())
            raise self._abort(
                f"too few unmasking responses: shares of {detail}, t = {t} needed; round aborted"
            )
        total = self._sum
        seeds: list[tuple[bytes, bool]] = []  # every mask to remove, applied in one pass
        try:
            for u in sorted(self._u3):
                b = shamir_interpolate(sorted(self._b_shares[u])[:t])
                if b >= 1 << (8 * SECRET_BYTES):
                    raise ProtocolError(f"the shares of {u!r}'s self-mask seed are inconsistent")
                seeds.append((b.to_bytes(SECRET_BYTES, "big"), True))
            for u in sorted(self._dropped):
                s = shamir_interpolate(sorted(self._s_shares[u])[:t])
                if s >= 1 << (8 * SECRET_BYTES):
                    raise ProtocolError(f"the shares of {u!r}'s mask key are inconsistent")
                s_sk = X25519PrivateKey.from_private_bytes(s.to_bytes(SECRET_BYTES, "big"))
                if _pub_bytes(s_sk) != self._adverts[u].s_pk:
                    raise ProtocolError(f"the rebuilt mask key of {u!r} is not the advertised one")
                for v in sorted(self._graph[u] & self._u3):
                    shared = _agree(s_sk, self._adverts[v].s_pk, v)
                    seed = _kdf(b"mask-seed", shared, self.config.round_id, u, v)
                    # v added PRG(s_uv) if v < u, subtracted it if v > u: undo that
                    seeds.append((seed, v < u))
        except ProtocolError:
            self._abort("inconsistent shares")
            raise
        _apply_keystreams(total, seeds)
        total = total.astype(np.uint64) & _modulus_mask(self.config.modulus_bits)
        self._result, self._sum = total, None
        self._stage = 4
        return total.copy()
