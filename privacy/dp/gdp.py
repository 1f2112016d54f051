"""Gaussian differential privacy: exact epsilon of composed Gaussian releases, and one image's.

A composition of Gaussian mechanisms with multipliers ``z_i`` is exactly one Gaussian
mechanism with ``mu = sqrt(sum_i 1 / z_i^2)`` (Dong, Roth & Su, "Gaussian Differential
Privacy", JRSS-B 2022, Corollary 3.3), whose (epsilon, delta) curve is exact (Balle & Wang,
ICML 2018, Theorem 8; Dong et al. Corollary 2.13):

    delta(epsilon) = Phi(-epsilon / mu + mu / 2) - e^epsilon Phi(-epsilon / mu - mu / 2).

No accountant's discretisation enters: this is the tight curve of the releases
(:func:`gaussian_epsilon`, :func:`composed_mu`).

:func:`example_epsilon` protects one training image (add/remove one image) over releases of
two kinds, each stating its own part (:meth:`ExampleRelease.example_events`): Gaussian
releases (a client-level release is one of multiplier ``z / 2``: one image moves the clipped
update by up to ``2 C``), which compose exactly into one Gaussian, and DP-SGD releases
(``T`` steps of the Poisson-subsampled Gaussian), which compose with them in dp_accounting's
PLD accountant (the accountant of :mod:`privacy.dp.accountants.pld`, same grid).

With ``discrete=True`` the Gaussian releases are integer (discrete Gaussian) noise, for
which only a zCDP bound is proven (:mod:`privacy.dp.zcdp`): they are charged
``rho = mu^2 / 2`` each; alone they convert by :func:`~privacy.dp.zcdp.zcdp_epsilon`,
with DP-SGD releases they compose in Rényi DP (the Poisson-subsampled Gaussian's RDP of
Mironov, Talwar & Zhang 2019, as Opacus computes it, plus ``alpha rho``) over Opacus' orders.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

import numpy as np

from fl_secure.errors import PrivacyError


class ExampleRelease(Protocol):
    """A release as one training image sees it (a site ledger's row)."""

    def example_events(self, *, own: bool) -> tuple[float, tuple[float, float, int] | None]:
        """(Gaussian ``mu`` at sensitivity 1, DP-SGD ``(z, q, steps)`` or None).

        ``own``: the noise of this site's own share only (its peers collude).
        """
        ...


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon at ``delta`` of a ``mu``-GDP mechanism (one Gaussian, ``mu = 1 / z``).

    ``mu = 0`` releases nothing (epsilon 0); ``mu = inf`` is a release without noise.
    """
    if not 0 < delta < 1:
        raise PrivacyError(f"delta must be in (0, 1), not {delta!r}")
    if not mu >= 0:
        raise PrivacyError(f"mu must be >= 0, not {mu!r}")
    if mu == 0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    # deferred: scipy.optimize takes a second to import, and most callers never get here
    from scipy.optimize import brentq
    from scipy.special import log_ndtr

    def excess(eps: float) -> float:  # delta(eps) - delta, decreasing in eps
        first = math.exp(log_ndtr(-eps / mu + mu / 2))
        second = math.exp(eps + log_ndtr(-eps / mu - mu / 2))
        return first - second - delta

    if excess(0.0) <= 0:
        return 0.0
    hi = 1.0
    while excess(hi) > 0:
        hi *= 2
        if hi > 1e6:  # pragma: no cover - mu would be astronomically large
            return math.inf
    return float(brentq(excess, 0.0, hi, xtol=1e-12, rtol=1e-12))


def composed_mu(noise_multipliers: Iterable[float]) -> float:
    """``mu`` of the composition of Gaussian releases with these multipliers (``inf``: none)."""
    total = 0.0
    for z in noise_multipliers:
        if not z > 0:
            return math.inf
        total += 1.0 / (z * z)
    return math.sqrt(total)


def example_epsilon(
    releases: Iterable[ExampleRelease], delta: float, *, own: bool = False, discrete: bool = False
) -> float:
    """One image's epsilon at ``delta`` over ``releases`` (see the module docstring).

    The Gaussian releases compose exactly into one Gaussian (``mu = sqrt(sum mu_i^2)``);
    DP-SGD releases with the same ``(z, q)`` into one self-composition; the pieces compose
    in dp_accounting's PLD accountant (add/remove one image).
    """
    if not 0 < delta < 1:
        raise PrivacyError(f"delta must be in (0, 1), not {delta!r}")
    mu2 = 0.0
    steps: dict[tuple[float, float], int] = {}
    for row in releases:
        mu, dpsgd = row.example_events(own=own)
        if math.isinf(mu):
            return math.inf
        mu2 += mu * mu
        if dpsgd is not None:
            z, q, n = dpsgd
            steps[(z, q)] = steps.get((z, q), 0) + n
    if discrete and mu2 > 0:
        return _discrete_example_epsilon(mu2, steps, delta)
    if not steps:
        return gaussian_epsilon(math.sqrt(mu2), delta)
    # deferred: dp_accounting (also under privacy.dp.accountants.pld) takes seconds to import,
    # and figures without a DP-SGD release never need it
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    from privacy.dp.accountants.pld import VALUE_DISCRETIZATION_INTERVAL

    acc = pld_privacy_accountant.PLDAccountant(
        value_discretization_interval=VALUE_DISCRETIZATION_INTERVAL
    )
    if mu2 > 0:
        acc.compose(dp_accounting.GaussianDpEvent(1.0 / math.sqrt(mu2)))
    for (z, q), n in sorted(steps.items()):
        sampled = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
        acc.compose(dp_accounting.SelfComposedDpEvent(sampled, n))
    return float(acc.get_epsilon(delta))


def _discrete_example_epsilon(
    mu2: float, steps: dict[tuple[float, float], int], delta: float
) -> float:
    """:func:`example_epsilon` when the Gaussian part is integer noise (zCDP, ``rho = mu^2/2``)."""
    # deferred imports: see example_epsilon
    from privacy.dp.discrete_gaussian import ZCDP_SLACK
    from privacy.dp.zcdp import zcdp_epsilon

    rho = mu2 / 2.0 * (1.0 + ZCDP_SLACK)
    if not steps:
        return zcdp_epsilon(rho, delta)
    # deferred, as opacus above: the RDP curve is needed only when DP-SGD steps are combined
    from opacus.accountants.analysis import rdp as rdp_analysis

    from privacy.dp.accountants.rdp import DEFAULT_ORDERS

    orders = list(DEFAULT_ORDERS)
    curve = sum(
        rdp_analysis.compute_rdp(q=q, noise_multiplier=z, steps=n, orders=orders)
        for (z, q), n in sorted(steps.items())
    )
    curve = curve + rho * np.asarray(orders)
    eps, _ = rdp_analysis.get_privacy_spent(orders=orders, rdp=curve, delta=delta)
    return float(eps)
