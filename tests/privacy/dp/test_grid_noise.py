"""Local noise leaves a client on a power-of-two grid, as integers (Mironov's attack).

Mironov (CCS 2012): noise drawn and added in floating point leaves input-dependent holes in
the set of outputs, so low-order bits can reveal the input. A client's local noise now goes
out as ``(round(x / Lambda) + N_Z(0, sigma^2)) Lambda``: every released value is a multiple of
``Lambda`` (a power of two fixed by C and d alone), whatever the input.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import pytest

from fl_secure.config import config_from_dict
from privacy.client_round import ClientPrivacy
from privacy.dp.noise import SeededGaussian

C, Z, DIM = 1.0, 0.5, 256


def _grid(clip_norm: float, d: int) -> float:
    """The largest power of two with sqrt(d) Lambda <= 2^-10 C (written out)."""
    step = 1.0
    while math.sqrt(d) * step > clip_norm / 1024:
        step /= 2
    while math.sqrt(d) * step * 2 <= clip_norm / 1024:
        step *= 2
    return step


def _releases(update: np.ndarray, n: int, seed: int) -> np.ndarray:
    cfg = config_from_dict({"privacy": {"unit": "client", "noise_multiplier": Z, "clip_norm": C}})
    client = ClientPrivacy(cfg, num_examples=10, source=SeededGaussian(seed))
    out = [client.release(OrderedDict(w=update.copy()), {}, trained=True)[0]["w"] for _ in range(n)]
    return np.stack(out)


def test_released_values_lie_on_one_grid_whatever_the_input() -> None:
    # Prepare: input 0, and an input of norm C whose values are not on any coarse grid
    zero = np.zeros(DIM, np.float32)
    one = np.full(DIM, C / math.sqrt(DIM), np.float32) * np.float32(1 + 2**-20)
    one[0] += np.float32(3e-7)
    step = _grid(C, DIM)  # 2^-14 here
    assert step == 2.0**-14
    # Execute
    from_zero = _releases(zero, 20, seed=1).astype(np.float64)
    from_one = _releases(one, 20, seed=2).astype(np.float64)
    # Assert: the low-order bits below the grid are zero for both inputs: every value is an
    # integer multiple of Lambda (float noise would leave almost none on it)
    for values in (from_zero, from_one):
        units = values / step
        assert np.array_equal(units, np.round(units))
    # and the noise is the discrete Gaussian of sigma = z (C / Lambda + sqrt(d)) grid units,
    # z C (1 + 2^-10) at most: the grid costs 0.1% of noise at most
    sigma = Z * (C / step + math.sqrt(DIM)) * step
    assert sigma <= Z * C * (1 + 2**-10)
    assert from_zero.std() == pytest.approx(sigma, rel=0.03)
    # unbiased: the mean released value is the input's (within 5 standard errors)
    assert abs((from_one - one).mean()) < 5 * sigma / math.sqrt(from_one.size)


def test_a_float16_update_goes_out_on_the_grid_too() -> None:
    update = np.full(DIM, 0.01, np.float16)
    released = _releases(update, 2, seed=3).astype(np.float64)
    units = released / _grid(C, DIM)
    assert np.array_equal(units, np.round(units))
