"""The ChaCha20 noise source must never run out of keystream."""

from __future__ import annotations

import numpy as np

import privacy.dp.noise as noise
from privacy.dp.noise import SecureGaussian


def test_a_nonce_whose_random_bytes_are_all_ones_still_gives_megabytes(monkeypatch) -> None:
    # Prepare: os.urandom returns 0xff bytes, so a nonce whose first 4 bytes (ChaCha20's block
    # counter in cryptography) were random would start at 2^32 - 1 and overflow after 64 bytes
    monkeypatch.setattr(noise.os, "urandom", lambda n: b"\xff" * n)
    source = SecureGaussian()
    # Execute: 2 x 8 MB of keystream
    draws = [source.uniform(1 << 20) for _ in range(2)]
    # Assert: no overflow; the words are still uniform-looking
    assert all(d.shape == (1 << 20,) and 0.49 < d.mean() < 0.51 for d in draws)


def test_the_source_takes_a_fresh_key_before_its_budget_is_spent(monkeypatch) -> None:
    # Prepare: a tiny per-key budget, and count the keys taken
    monkeypatch.setattr(SecureGaussian, "REKEY_BYTES", 8 * 1000)
    keys: list[bytes] = []
    real = noise.os.urandom

    def counting(n: int) -> bytes:
        out = real(n)
        if n == 32:
            keys.append(out)
        return out

    monkeypatch.setattr(noise.os, "urandom", counting)
    source = SecureGaussian()
    # Execute: 10 draws of 600 words (600 normals use 600 words)
    samples = np.concatenate([source.standard_normal(600) for _ in range(10)])
    # Assert: a new key every time the next draw would pass 1000 words; all distinct
    assert len(keys) == 10 and len(set(keys)) == 10
    assert abs(samples.mean()) < 0.1 and abs(samples.std() - 1) < 0.05
