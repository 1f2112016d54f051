"""Helpers the SecAgg test files share: a fixed round id, reproducible uniforms, a config."""

from __future__ import annotations

import numpy as np

from privacy.secagg.config import SecAggConfig

ROUND = b"round-0007"


class SeededUniform:
    """Reproducible rounding uniforms, so a test can recompute a client's encoding."""

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def uniform(self, n: int) -> np.ndarray:
        return self._rng.random(n)


def ids(n: int) -> list[str]:
    """``n`` client ids in cohort order."""
    return [f"client-{i:03d}" for i in range(n)]


def config(n: int, t: int, k: int = 0, bits: int = 32, scale: float = 2.0**10) -> SecAggConfig:
    """A round of ``n`` clients, threshold ``t``, ``k`` neighbours (0: complete graph)."""
    return SecAggConfig(
        round_id=ROUND,
        cohort=tuple(ids(n)),
        threshold=t,
        clip_range=1.0,
        scale=scale,
        neighbours=k,
        modulus_bits=bits,
    )
