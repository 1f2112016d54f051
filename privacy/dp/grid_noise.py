"""Integer noise on a power-of-two grid for an update released in floating point.

Mironov ("On Significance of the Least Significant Bits For Differential Privacy", CCS 2012)
showed that noise sampled in floating point and added in floating point leaks the input: the
set of floating-point outputs a given input can reach has holes, which differ from input to
input, so the low-order bits of one output can tell two inputs apart with certainty. A
client's ``local`` noise reaches the server on each plain update, so it is drawn on a grid
instead, with integer noise (the client step of Kairouz, Liu & Steinke's distributed
discrete Gaussian, ICML 2021, without its random rotation, for one client's own noise):

1. ``Lambda``: a power of two with ``sqrt(d) Lambda <= 2^-10 C`` (:func:`grid_step`);
2. the clipped update ``x`` (``||x||_2 <= C``) in grid units, ``v = x / Lambda`` (exact: a
   power-of-two scaling), is rounded randomly and unbiasedly to integers ``n``
   (:func:`privacy.dp.discrete_gaussian.randomized_round`); each coordinate moves by less
   than 1, so ``||n||_2 < C / Lambda + sqrt(d) = D`` (checked in exact integer arithmetic);
3. ``n + Y``, ``Y`` a vector of discrete Gaussians ``N_Z(0, sigma^2)`` with ``sigma = z D``
   (Canonne, Kamath & Steinke, NeurIPS 2020, Algorithm 3), is computed in int64 and released
   as ``(n + Y) Lambda`` in the update's dtype.

Privacy: for any fixed rounding uniforms, neighbouring inputs (this client's update against
a zero one) give integer vectors at most ``D`` apart, and ``N_Z(0, sigma^2)`` shifted by an
integer vector of norm ``D`` is ``D^2 / (2 sigma^2) = 1 / (2 z^2)``-zCDP (CKS20 Theorem 4, over
independent coordinates); the rounding uniforms are the same distribution for both inputs,
and a mixture over them keeps the bound (joint quasi-convexity of the Rényi divergence). The
float cast at the end is a function of the integers alone (post-processing): every released
value is a multiple of ``Lambda`` whatever the input, and a value of magnitude ``2^24 Lambda``
or more is a multiple of a larger power of two (still on the grid). The release is accounted
by its zCDP bound (:mod:`privacy.dp.zcdp`), which does not depend on ``Lambda``.

The grid costs noise: ``sigma Lambda = z (C + sqrt(d) Lambda) <= (1 + 2^-10) z C``, at most
0.1% more than the continuous Gaussian's ``z C``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np

from fl_secure.errors import PrivacyError
from fl_secure.messages import Tensors
from privacy.dp.discrete_gaussian import randomized_round, sample_discrete_gaussian
from privacy.dp.noise import NoiseSource

GRID_BITS = 10
"""The grid's rounding adds at most ``2^-GRID_BITS`` of the clip norm to the sensitivity."""

#: Relative slack on ``C / Lambda`` in the sensitivity bound: the floating-point error of
#: rescaling the update to norm ``C / Lambda`` (float64, ~1e-16) is far below it.
_NORM_SLACK = 1e-12


def grid_step(clip_norm: float, d: int) -> float:
    """``Lambda``: the largest power of two with ``sqrt(d) Lambda <= 2^-GRID_BITS C``."""
    if not (math.isfinite(clip_norm) and clip_norm > 0) or d < 1:
        raise PrivacyError(f"a grid needs clip_norm > 0 and d >= 1, got {clip_norm!r}, {d}")
    return 2.0 ** math.floor(math.log2(clip_norm / (2.0**GRID_BITS * math.sqrt(d))))


def grid_sensitivity(clip_norm: float, step: float, d: int) -> float:
    """``D``: bound on the L2 norm of the rounded integer vector of a clipped update."""
    return clip_norm / step * (1.0 + _NORM_SLACK) + math.sqrt(d)


def add_grid_discrete_gaussian(
    update: Mapping[str, np.ndarray],
    noise_multiplier: float,
    clip_norm: float,
    source: NoiseSource,
) -> Tensors:
    """``update`` (clipped to ``clip_norm``) on its grid plus discrete Gaussian noise ``z D``.

    Returns each tensor in its own dtype; every value is a multiple of
    :func:`grid_step` ``(clip_norm, d)``, ``d`` the number of values over all tensors.

    Raises:
        PrivacyError: ``noise_multiplier`` is not a finite number > 0, or the update holds
            NaN or infinity.
    """
    if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise PrivacyError(
            f"noise_multiplier must be a finite number > 0, got {noise_multiplier!r}"
        )
    names = list(update)
    arrays = [np.asarray(update[k]) for k in names]
    flat = np.concatenate([a.astype(np.float64).ravel() for a in arrays]) if arrays else None
    if flat is None or flat.size == 0:
        return OrderedDict((k, a.copy()) for k, a in zip(names, arrays, strict=True))
    if not np.all(np.isfinite(flat)):
        raise PrivacyError("the update contains NaN or infinity; refusing to release it")
    d = flat.size
    step = grid_step(clip_norm, d)
    v = flat / step  # exact: a power of two
    norm = float(np.linalg.norm(v))
    if norm > clip_norm / step:  # a float32 clip can pass C by an ulp: back onto the ball
        v *= (clip_norm / step) / norm
    bound = grid_sensitivity(clip_norm, step, d)
    ints = randomized_round(source, v)
    # exact in int64: |n_i| <= |v_i| + 1 and ||v|| <= C / Lambda ~ 2^10 sqrt(d), far below 2^31
    squared = int(np.dot(ints, ints))
    if squared > bound * bound:  # pragma: no cover - ||n - v|| < sqrt(d) rules it out
        raise PrivacyError(
            f"the rounded update has norm {math.sqrt(squared):.6g} > {bound:.6g} grid units"
        )
    ints += sample_discrete_gaussian(source, noise_multiplier * bound, d)
    values = ints.astype(np.float64) * step  # exact while |n| < 2^53
    out: Tensors = OrderedDict()
    start = 0
    for name, array in zip(names, arrays, strict=True):
        part = values[start : start + array.size].reshape(array.shape)
        out[name] = part.astype(array.dtype)
        start += array.size
    return out
