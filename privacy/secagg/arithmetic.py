"""The words of the masked arithmetic mod ``2^bits``, and the keystream chunks they come in.

Sums and masks are ``uint32`` words when ``2^bits`` divides ``2^32``, else ``uint64``
(:func:`word_dtype`); both are reduced mod ``2^bits`` at the end (:func:`modulus_mask`).
Keystreams (masks, rounding uniforms) are read :data:`CHUNK` words at a time.
"""

from __future__ import annotations

import numpy as np

from fl_secure.errors import PrivacyError, ProtocolError

CHUNK = 1 << 16  # mask words per AES-CTR call: 512 KB buffers (8 MB ones fault pages: 2.6x slower)
# The plaintext of every keystream chunk (AES-CTR of zeros is the keystream), made once: the
# keystreams are written with ``update_into`` into reused buffers, never freshly allocated ones.
ZEROS = memoryview(bytes(8 * CHUNK))
BLOCK = 16  # AES block: ``update_into`` wants room for ``len(data) + BLOCK - 1`` bytes


def modulus_mask(modulus_bits: int) -> np.uint64:
    """``2^bits - 1``: reduces a word mod ``2^bits``; refuses ``bits`` outside 1..64."""
    if not isinstance(modulus_bits, int) or not 1 <= modulus_bits <= 64:
        raise PrivacyError(f"modulus_bits = {modulus_bits!r}: expected an integer in [1, 64]")
    return np.uint64((1 << modulus_bits) - 1)


def word_dtype(modulus_bits: int) -> np.dtype:
    """Words of the masked arithmetic: ``uint32`` when ``2^bits`` divides ``2^32``, else ``u64``.

    Sums and masks wrap mod ``2^32`` (or ``2^64``) and are reduced mod ``2^bits`` at the end,
    which is exact because ``2^bits`` divides the word modulus. 32-bit words halve the mask
    keystream and the memory traffic of every addition.
    """
    modulus_mask(modulus_bits)
    return np.dtype(np.uint32) if modulus_bits <= 32 else np.dtype(np.uint64)


def check_vector(
    vector: np.ndarray, modulus_bits: int, length: int | None, what: str
) -> np.ndarray:
    """A 1-D ``uint32`` or ``uint64`` vector with every value below ``2^bits``."""
    mask = modulus_mask(modulus_bits)
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
