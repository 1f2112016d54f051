"""The masks of SecAgg: AES-256-CTR keystreams read as words of the masked arithmetic.

``PRG(seed)`` (Bonawitz et al., CCS 2017) is AES-256-CTR keyed by the 32-byte seed with an
all-zero IV, its keystream read as little-endian words (:func:`prg_mask`); a client adds its
masks, and the server removes the survivors' self masks and the dropped clients' pairwise
masks, chunk by chunk (:class:`Keystreams`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fl_secure.errors import PrivacyError
from privacy.secagg.arithmetic import BLOCK, CHUNK, ZEROS, modulus_mask, word_dtype
from privacy.secagg.keys import SECRET_BYTES


class Keystreams:
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
        self._buf = bytearray(self._wire.itemsize * CHUNK + BLOCK - 1)

    def apply_all(self, acc: np.ndarray) -> None:
        """:meth:`apply` to ``acc`` chunk by chunk, from the streams' current position."""
        for start in range(0, acc.size, CHUNK):
            self.apply(acc[start : start + CHUNK])

    def apply(self, part: np.ndarray) -> None:
        """``part +=`` (or ``-=``) the next ``part.size <= CHUNK`` words of every stream."""
        m = part.size
        for stream, subtract in self._streams:
            stream.update_into(ZEROS[: self._wire.itemsize * m], self._buf)
            words = np.frombuffer(self._buf, dtype=self._wire, count=m)
            if subtract:
                np.subtract(part, words, out=part)
            else:
                np.add(part, words, out=part)


def apply_keystreams(acc: np.ndarray, seeds: Sequence[tuple[bytes, bool]]) -> None:
    """For each ``(seed, subtract)``: ``acc += / -= AES-256-CTR(seed, IV = 0)``.

    The keystream is read as little-endian words of acc's width: ``uint32`` words add mod
    2^32, ``uint64`` words mod 2^64 (see :func:`word_dtype`).
    """
    Keystreams(seeds, acc.dtype).apply_all(acc)


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
    mask = modulus_mask(modulus_bits)
    out = np.zeros(length, dtype=word_dtype(modulus_bits))
    apply_keystreams(out, [(seed, False)])
    return out.astype(np.uint64) & mask
