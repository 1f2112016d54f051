"""Zero-concentrated DP of discrete Gaussian releases, and its (epsilon, delta).

Integer (discrete Gaussian) noise is not the continuous Gaussian that the PLD, PRV and
subsampled-RDP analyses of :mod:`privacy.dp.accountants` are exact for. What is proven for it
is a concentrated-DP bound:

* one vector of independent discrete Gaussians ``N_Z(0, sigma^2)`` added to an integer vector
  of L2 sensitivity ``Delta`` is ``rho``-zCDP with ``rho = Delta^2 / (2 sigma^2)`` (Canonne,
  Kamath & Steinke, "The Discrete Gaussian for Differential Privacy", NeurIPS 2020,
  Theorem 4: the Rényi divergence of ``N_Z(0, sigma^2)`` shifted by an integer ``s`` is at
  most ``alpha s^2 / (2 sigma^2)``; independent coordinates add their divergences);
* the sum of ``m`` clients' ``N_Z(0, sigma^2)`` (the distributed discrete Gaussian) is
  ``1/2 eps^2``-zCDP with ``eps^2 = Delta^2 / (m sigma^2) + tau d / 2`` (Kairouz, Liu &
  Steinke, ICML 2021, Theorem 1; :func:`privacy.dp.discrete_gaussian.ddg_tau`).

A release of noise multiplier ``z`` (``sigma = z Delta``, and ``tau d`` held below
:data:`ZCDP_SLACK` of the first term where it enters) is therefore accounted as
``rho = (1 + ZCDP_SLACK) / (2 z^2)``; zCDP composes by adding ``rho`` (Bun & Steinke,
TCC 2016, Lemma 2.3), and ``rho``-zCDP is ``(alpha, alpha rho)``-RDP for every
``alpha > 1``, converted to (epsilon, delta) by Canonne, Kamath & Steinke 2020,
Proposition 12 (the conversion of Balle et al., AISTATS 2020, Theorem 21, that Opacus and
dp_accounting use):

    epsilon = min_alpha  alpha rho + (log(1 / delta) + (alpha - 1) log(1 - 1 / alpha)
                                      - log(alpha)) / (alpha - 1).

Any ``alpha`` gives a valid bound; the minimum is taken over a fixed grid of 20,001 orders
(``1 + 10^k``, ``k`` in [-3, 7], a relative step of 0.1%).

Sampling. No amplification by sampling is claimed for these releases: the Poisson-subsampled
RDP analysis of Mironov, Talwar & Zhang (2019) is exact for the continuous Gaussian only, and
a release of a sampled cohort is bounded by the release of any cohort (joint quasi-convexity
of the Rényi divergence). A fixed-size cohort (replace-one adjacency) moves the sum by up to
``2 Delta``, so its ``rho`` is four times as large.

For the quickstart (20 rounds, every client each round, delta 1e-5) a noise multiplier of
2.6875 is epsilon 7.99 by the continuous Gaussian's PLD and 8.59 by this bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from fl_secure.errors import PrivacyError
from privacy.dp.discrete_gaussian import ZCDP_SLACK

#: ``alpha - 1`` over 10 decades (relative step 0.1%): the orders the conversion searches.
_ORDERS = 1.0 + np.logspace(-3.0, 7.0, 20_001)

REPLACE_ONE_FACTOR = 4.0
"""``rho`` of a replace-one release relative to zero-out: the sensitivity doubles."""


def release_rho(noise_multiplier: float, *, replace_one: bool = False) -> float:
    """``rho`` of one discrete Gaussian release of multiplier ``z`` (see the module docstring)."""
    if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise PrivacyError(
            f"noise_multiplier must be a finite number > 0, got {noise_multiplier!r}"
        )
    rho = (1.0 + ZCDP_SLACK) / (2.0 * noise_multiplier**2)
    return rho * REPLACE_ONE_FACTOR if replace_one else rho


def composed_rho(noise_multipliers: Iterable[float], *, replace_one: bool = False) -> float:
    """``rho`` of the composition of releases (``inf`` if one carries no noise, ``z = 0``)."""
    total = 0.0
    for z in noise_multipliers:
        if not z > 0:
            return math.inf
        total += release_rho(z, replace_one=replace_one)
    return total


def zcdp_epsilon(rho: float, delta: float) -> float:
    """Epsilon at ``delta`` of a ``rho``-zCDP mechanism (CKS20 Proposition 12, grid of orders).

    ``rho = 0`` releases nothing (0.0); ``rho = inf`` is unbounded.
    """
    if not (math.isfinite(delta) and 0 < delta < 1):
        raise PrivacyError(f"delta must be in (0, 1), got {delta!r}")
    if not rho >= 0:
        raise PrivacyError(f"rho must be >= 0, got {rho!r}")
    if rho == 0:
        return 0.0
    if math.isinf(rho):
        return math.inf
    a = _ORDERS
    eps = a * rho + (math.log(1.0 / delta) + (a - 1.0) * np.log1p(-1.0 / a) - np.log(a)) / (a - 1.0)
    return max(float(eps.min()), 0.0)
