"""Gaussian noise for differential privacy, drawn from a cryptographically secure generator.

Opacus' ``secure_mode`` needs ``torchcsprng``, which does not build against current PyTorch,
and ``torch.normal`` draws from a Mersenne Twister whose state an observer of enough outputs
can reconstruct (so the noise could be subtracted again). :class:`SecureGaussian` instead
turns a ChaCha20 keystream (RFC 8439, from ``cryptography``, keyed from ``os.urandom``) into
standard normals with the Box-Muller transform, vectorised in numpy:

    u1 = (k1 + 1) / 2^53 in (0, 1],  u2 = k2 / 2^53 in [0, 1)   (53-bit words of the keystream)
    z1 = sqrt(-2 ln u1) cos(2 pi u2),  z2 = sqrt(-2 ln u1) sin(2 pi u2)

Caveat, stated wherever this noise is used: like every floating-point Gaussian sampler it
is subject to the floating-point attacks of Mironov (CCS 2012) in principle. Client-level
noise that leaves a client is therefore integer noise built on these uniforms: the
distributed discrete Gaussian (:mod:`privacy.dp.discrete_gaussian`) and ``local`` noise on a
grid (:mod:`privacy.dp.grid_noise`). The Gaussians here remain for ``central`` noise and
DP-SGD.

Seeded noise (:func:`seeded_source`, ``privacy.secure_rng = false``) is derived from
``run.seed`` and the party's name, which the server knows: a site ledger counts a release
made with it as unbounded against the server (:mod:`privacy.ledger.site_release`).

Tests inject :class:`SeededGaussian` (numpy PCG64) to be reproducible; it reports
``secure = False`` and every report built from it says so.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Protocol

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

if TYPE_CHECKING:  # torch is imported only where tensors are made (secagg needs no torch)
    import torch

_CHUNK = 1 << 16  # normals per keystream chunk: small temporaries, reused rather than faulted in


class NoiseSource(Protocol):
    """Where DP noise comes from."""

    @property
    def secure(self) -> bool:
        """Whether the generator is a CSPRNG (reported in ledgers and summaries)."""
        ...

    @property
    def description(self) -> str:
        """What the generator is, for logs and reports."""
        ...

    def standard_normal(self, n: int) -> np.ndarray:
        """``n`` independent N(0, 1) samples as float64."""
        ...

    def uniform(self, n: int) -> np.ndarray:
        """``n`` independent uniforms in [0, 1) (Poisson sampling decisions)."""
        ...


class SecureGaussian:
    """Standard normals from a ChaCha20 keystream keyed by ``os.urandom`` (a CSPRNG)."""

    secure = True
    description = "ChaCha20 keystream (cryptography, key from os.urandom) + Box-Muller"

    #: Keystream bytes drawn under one key before a fresh key is taken. ChaCha20 (as in
    #: ``cryptography``/OpenSSL) has a 32-bit block counter: 2^32 blocks of 64 bytes per
    #: (key, nonce). The counter starts at 0 and a new key comes well before it could wrap.
    REKEY_BYTES = 1 << 36

    def __init__(self) -> None:
        self._rekey()

    def _rekey(self) -> None:
        # cryptography's 16-byte ChaCha20 nonce = 32-bit little-endian block counter + 96-bit
        # nonce; a random counter could start near 2^32 and overflow after a few MB
        key, nonce = os.urandom(32), bytes(4) + os.urandom(12)
        self._stream = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor()
        self._used = 0

    def _words(self, n: int) -> np.ndarray:
        if self._used + 8 * n > self.REKEY_BYTES:
            self._rekey()
        self._used += 8 * n
        raw = self._stream.update(bytes(8 * n))
        return np.frombuffer(raw, dtype="<u8") >> np.uint64(11)

    def uniform(self, n: int) -> np.ndarray:
        """``n`` independent uniforms in [0, 1) with 53 random bits each."""
        return self._words(n).astype(np.float64) * 2.0**-53

    def standard_normal(self, n: int) -> np.ndarray:
        """``n`` independent N(0, 1) samples (float64), drawn in bounded chunks."""
        if n < 0:
            raise ValueError(f"n = {n}: expected a count >= 0")
        out = np.empty(n, dtype=np.float64)
        for start in range(0, n, _CHUNK):
            m = min(_CHUNK, n - start)
            pairs = (m + 1) // 2
            words = self._words(2 * pairs)
            u1 = (words[:pairs].astype(np.float64) + 1.0) * 2.0**-53
            u2 = words[pairs:].astype(np.float64) * 2.0**-53
            radius = np.sqrt(-2.0 * np.log(u1))
            # Box-Muller's angle 2 pi u2 enters as cos and sin, taken from t = tan(angle / 2)
            # (cos = (1 - t^2) / (1 + t^2), sin = 2 t / (1 + t^2)): numpy's tan is
            # vectorised, its cos and sin are not, and they were 40% of the time. The half
            # angle pi (u2 - 1/2) lies in [-pi/2, pi/2), so the full angle covers the circle.
            t = np.tan(np.pi * (u2 - 0.5))
            scale = radius / (1.0 + t * t)
            both = np.concatenate([scale * (1.0 - t * t), scale * (2.0 * t)])
            out[start : start + m] = both[:m]
        return out


class SeededGaussian:
    """Reproducible normals for tests (numpy PCG64); not a CSPRNG and reported as such."""

    secure = False

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)
        self.description = f"numpy PCG64 seeded with {seed} (NOT cryptographically secure)"

    def standard_normal(self, n: int) -> np.ndarray:
        """``n`` independent N(0, 1) samples (float64)."""
        return self._rng.standard_normal(n)

    def uniform(self, n: int) -> np.ndarray:
        """``n`` independent uniforms in [0, 1)."""
        return self._rng.random(n)


def gaussian_like(source: NoiseSource, array: np.ndarray, std: float) -> np.ndarray:
    """N(0, std^2) noise of ``array``'s shape and dtype."""
    if not (np.isfinite(std) and std >= 0):
        raise ValueError(f"noise std = {std!r}: expected a finite number >= 0")
    noise = source.standard_normal(array.size).reshape(array.shape) * std
    return noise.astype(array.dtype, copy=False)


def gaussian_tensor_like(source: NoiseSource, tensor: torch.Tensor, std: float) -> torch.Tensor:
    """N(0, std^2) noise as a tensor of ``tensor``'s shape, dtype and device."""
    if not (np.isfinite(std) and std >= 0):
        raise ValueError(f"noise std = {std!r}: expected a finite number >= 0")
    import torch  # deferred: torch takes seconds to import, and secure aggregation needs none

    noise = source.standard_normal(tensor.numel()) * std
    return torch.from_numpy(noise).reshape(tensor.shape).to(tensor.dtype).to(tensor.device)


def seeded_source(seed: int, party: str) -> SeededGaussian:
    """A reproducible source for one party of a run (``privacy.secure_rng = false``)."""
    digest = hashlib.sha256(f"{seed}:{party}:dp-noise".encode()).digest()
    return SeededGaussian(int.from_bytes(digest[:8], "little"))
