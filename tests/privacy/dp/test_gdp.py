"""Gaussian DP: the exact epsilon of composed Gaussian releases against dp_accounting's PLD."""

from __future__ import annotations

import math

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from scipy import stats

from fl_secure.errors import PrivacyError
from privacy.dp.gdp import composed_mu, gaussian_epsilon


def _pld_epsilon(multipliers: list[float], delta: float) -> float:
    """dp_accounting's PLD accountant over Gaussian releases (no sampling)."""
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    for z in multipliers:
        acc.compose(dp_event.GaussianDpEvent(z))
    return float(acc.get_epsilon(delta))


@pytest.mark.parametrize(
    ("multipliers", "delta"),
    [([1.0], 1e-5), ([1.0, 2.0, 0.8], 1e-5), ([3.0] * 40, 1e-6), ([0.7, 5.0, 1.3, 1.3], 1e-3)],
)
def test_composed_gaussian_epsilon_matches_dp_accounting_pld(
    multipliers: list[float], delta: float
) -> None:
    # Execute: the closed form (GDP composition, exact curve)
    eps = gaussian_epsilon(composed_mu(multipliers), delta)
    # Assert: dp_accounting's PLD accountant agrees to its discretisation (1e-4)
    assert eps == pytest.approx(_pld_epsilon(multipliers, delta), rel=1e-5, abs=1e-4)


def test_the_epsilon_found_meets_delta_on_the_exact_curve() -> None:
    # Assert: at the returned epsilon, Balle & Wang's delta(epsilon) is the asked delta
    mu = composed_mu([0.9, 1.1, 2.0])
    eps = gaussian_epsilon(mu, 1e-6)
    n = stats.norm
    delta = n.cdf(-eps / mu + mu / 2) - math.exp(eps) * n.cdf(-eps / mu - mu / 2)
    assert delta == pytest.approx(1e-6, rel=1e-6)
    assert gaussian_epsilon(0.0, 1e-5) == 0.0  # nothing released
    assert gaussian_epsilon(composed_mu([1.0, 0.0]), 1e-5) == math.inf  # an un-noised release
    with pytest.raises(PrivacyError, match="delta"):
        gaussian_epsilon(1.0, 0.0)
