"""Fixed-point encoding of updates as integers mod ``2^bits``, with stochastic rounding.

Each coordinate is clipped to ``[-c, c]``, scaled by ``s`` and rounded up with probability
equal to its fractional part (so the encoding is unbiased); negatives wrap mod ``2^bits``.
:func:`check_modulus` refuses a modulus the cohort's sum could wrap; :func:`decode` lifts a sum
back to floats and refuses one no honest cohort can produce.
"""

from __future__ import annotations

import math
import os
from typing import Protocol

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fl_secure.errors import PrivacyError, ProtocolError, UpdateError
from privacy.secagg.arithmetic import BLOCK, CHUNK, ZEROS, check_vector, modulus_mask, word_dtype

_MAX_EXACT = 2**52  # clip_range * scale must stay exactly representable in float64


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
        self._buf = bytearray(4 * CHUNK + BLOCK - 1)

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
        for start in range(0, out.size, CHUNK):
            m = min(CHUNK, out.size - start)
            self._stream.update_into(ZEROS[: 4 * m], self._buf)
            words = np.frombuffer(self._buf, dtype="<u4", count=m)  # a view of the buffer
            np.multiply(words, 2.0**-32, out=out[start : start + m], dtype=np.float64)
        return out


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
    modulus_mask(modulus_bits)
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
    mask = modulus_mask(modulus_bits)
    x = np.asarray(update).ravel()
    encoder = FixedPointEncoder(clip_range, scale, modulus_bits, rounding)
    out = np.empty(x.size, dtype=word_dtype(modulus_bits) if words else np.uint64)
    # Chunks of CHUNK values: the float64 temporaries stay small (and are reused), where
    # whole-vector ones would fault fresh pages (about 2x slower at d = 1e6).
    for start in range(0, x.size, CHUNK):
        encoder.encode_into(x[start : start + CHUNK], out[start : start + CHUNK])
    out &= out.dtype.type(mask)
    return out


class FixedPointEncoder:
    """:func:`encode`, one chunk of at most ``CHUNK`` values at a time, into given words.

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
        self._scaled = np.empty(CHUNK, dtype=np.float64)
        self._low = np.empty(CHUNK, dtype=np.float64)
        self._u = np.empty(CHUNK, dtype=np.float64)
        self._ints = np.empty(CHUNK, dtype=np.int64)
        self._flags = np.empty(CHUNK, dtype=bool)

    def _uniform(self, m: int) -> np.ndarray:
        if isinstance(self.source, SecureUniform):
            return self.source.uniform_into(self._u[:m])
        u = self.source.uniform(m)
        if np.shape(u) != (m,):
            raise PrivacyError(f"the rounding source returned shape {np.shape(u)}, not ({m},)")
        return np.asarray(u)

    def encode_into(self, x: np.ndarray, out: np.ndarray) -> None:
        """Encode the values ``x`` (at most ``CHUNK``) into the words ``out``."""
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
    v = check_vector(np.asarray(sum_vector), modulus_bits, None, "decode")
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
