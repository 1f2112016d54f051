"""What a client's release under local client-level DP with integer noise must be, exactly."""

from __future__ import annotations

import numpy as np
import pytest

from fl_secure.messages import Tensors
from privacy.dp.client_level import clip_update
from privacy.dp.grid_noise import add_grid_discrete_gaussian
from privacy.dp.noise import NoiseSource


def assert_grid_noised_release(
    raw: Tensors, released: Tensors, z: float, clip: float, source: NoiseSource
) -> None:
    """Assert ``released`` = clip(``raw``, C) on the grid plus integer Gaussian noise.

    The release must equal, bit for bit, ``raw`` clipped to ``clip`` and randomly rounded onto
    the power-of-two grid Lambda plus integer discrete Gaussian noise drawn from ``source`` (in
    draw order, so call this on a client's releases in turn), in the raw update's names and
    dtypes. The clip must really bite. Lambda is the largest power of two with
    sqrt(d) Lambda <= 2^-10 C, every released value is an integer number of Lambdas, and the
    noise's standard deviation is z (C + sqrt(d) Lambda).
    """
    clipped, norm = clip_update(raw, clip)
    assert norm > clip  # the clip really bit
    expected = add_grid_discrete_gaussian(clipped, z, clip, source)
    assert list(raw) == list(released) == list(expected)
    for k in expected:
        assert released[k].dtype == clipped[k].dtype
        np.testing.assert_array_equal(released[k], expected[k])
    d = sum(v.size for v in clipped.values())
    step = 2.0 ** np.floor(np.log2(clip / (1024 * np.sqrt(d))))
    assert np.sqrt(d) * step <= clip / 1024 < 2 * np.sqrt(d) * step
    units = np.concatenate([v.astype(np.float64).ravel() for v in released.values()]) / step
    np.testing.assert_array_equal(units, np.round(units))
    flat = np.concatenate([v.astype(np.float64).ravel() for v in clipped.values()])
    noise = units * step - flat
    assert np.std(noise) == pytest.approx(z * (clip + np.sqrt(d) * step), rel=0.02)
