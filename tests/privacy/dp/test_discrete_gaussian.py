"""Integer DP noise: the discrete Gaussian's distribution, rounding, the DDG sum and bound."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from fl_secure.config import SecureAggregationConfig
from fl_secure.errors import PrivacyError
from privacy.dp.discrete_gaussian import (
    ddg_client_sigma,
    ddg_decode,
    ddg_encode,
    ddg_noise_multiplier,
    ddg_tau,
    integer_l2_bound,
    randomized_round,
    sample_discrete_gaussian,
    sample_discrete_laplace,
)
from privacy.dp.noise import SecureGaussian, SeededGaussian
from privacy.secagg.round_setup import check_ddg


def _pmf(values: np.ndarray, log_weight) -> np.ndarray:
    w = np.exp([log_weight(v) for v in values])
    return w / w.sum()


@pytest.mark.parametrize("sigma", [0.8, 1.5, 4.0])
def test_discrete_gaussian_matches_its_pmf(sigma: float) -> None:
    # Prepare / Execute: 200k draws from the CSPRNG
    draws = sample_discrete_gaussian(SecureGaussian(), sigma, 200_000)
    # Assert: chi-square against P[y] ∝ exp(-y^2 / 2 sigma^2) on the bulk (tails pooled)
    support = np.arange(-int(4 * sigma) - 1, int(4 * sigma) + 2)
    full = np.arange(-60, 61)
    pmf_full = _pmf(full, lambda y: -(y**2) / (2 * sigma**2))
    inside = np.isin(full, support)
    expected = np.append(pmf_full[inside], pmf_full[~inside].sum()) * draws.size
    observed = np.append([np.sum(draws == v) for v in support], np.sum(~np.isin(draws, support)))
    assert stats.chisquare(observed, expected).pvalue > 1e-4
    assert abs(draws.mean()) < 5 * sigma / math.sqrt(draws.size)


def test_discrete_laplace_matches_its_pmf() -> None:
    draws = sample_discrete_laplace(SecureGaussian(), 3, 200_000)
    support = np.arange(-15, 16)
    pmf = _pmf(np.arange(-200, 201), lambda y: -abs(y) / 3)
    full = np.arange(-200, 201)
    inside = np.isin(full, support)
    expected = np.append(pmf[inside], pmf[~inside].sum()) * draws.size
    observed = np.append([np.sum(draws == v) for v in support], np.sum(~np.isin(draws, support)))
    assert stats.chisquare(observed, expected).pvalue > 1e-4


def test_large_sigma_has_the_gaussian_moments() -> None:
    sigma = 3.0e5
    draws = sample_discrete_gaussian(SecureGaussian(), sigma, 400_000).astype(np.float64)
    assert draws.std() == pytest.approx(sigma, rel=0.01)
    assert abs(draws.mean()) < 5 * sigma / math.sqrt(draws.size)


def test_randomized_rounding_is_unbiased() -> None:
    x = np.full(200_000, 2.3)
    r = randomized_round(SecureGaussian(), x)
    assert set(np.unique(r)) == {2, 3}
    assert r.mean() == pytest.approx(2.3, abs=0.005)


def test_distributed_sum_decodes_to_the_sum_plus_the_configured_noise() -> None:
    # Prepare: 4 clients, d = 50k, gamma = 2^-16, each adds sigma so that 3 sum to z D2
    rng, source = np.random.default_rng(0), SeededGaussian(1)
    d, gamma, bits, z, clip = 50_000, 2.0**-16, 40, 0.02, 1.0
    updates = [rng.standard_normal(d) for _ in range(4)]
    updates = [u * min(1.0, clip / np.linalg.norm(u)) for u in updates]
    bound = integer_l2_bound(clip, gamma, d)
    sigma = ddg_client_sigma(z, bound, 3)
    # Execute: encode, sum mod 2^40 (as secure aggregation would), decode
    total = np.zeros(d, dtype=np.uint64)
    for u in updates:
        total = (total + ddg_encode(source, u, gamma=gamma, sigma=sigma, modulus_bits=bits)) & (
            np.uint64((1 << bits) - 1)
        )
    decoded = ddg_decode(total, gamma=gamma, modulus_bits=bits)
    noise = decoded - np.sum(updates, axis=0)
    # Assert: zero-mean noise of std sqrt(4) sigma gamma (rounding adds < 1e-4 of it)
    expected = math.sqrt(4) * sigma * gamma
    assert noise.std() == pytest.approx(expected, rel=0.02)
    assert abs(noise.mean()) < 5 * expected / math.sqrt(d)
    # ... and the sum of 4 is accounted as a Gaussian of multiplier sqrt(4/3) z (tau ~ 0)
    assert ddg_tau(sigma, 4) == 0.0
    assert ddg_noise_multiplier(sigma, 4, bound, d) == pytest.approx(z * math.sqrt(4 / 3))


def test_tau_penalises_small_sigma() -> None:
    # KLS21 Thm 1: tau = 10 sum_{k=1}^{m-1} exp(-2 pi^2 sigma^2 k / (k + 1)); at sigma = 0.5,
    # m = 10 the nine terms (to 4 places) sum to 0.2346
    terms = [0.0848, 0.0373, 0.0247, 0.0193, 0.0164, 0.0146, 0.0133, 0.0124, 0.0118]
    assert ddg_tau(0.5, 10) == pytest.approx(10 * sum(terms), rel=2e-3)
    assert ddg_tau(0.5, 10) == pytest.approx(2.3453253, rel=1e-7)
    # eps = sqrt(D2^2 / (m sigma^2) + tau d / 2) and z = 1 / eps: far below sqrt(m) sigma / D2
    eps = math.sqrt(1.0 / (10 * 0.25) + 2.3453253 * 1000 / 2)
    assert ddg_noise_multiplier(0.5, 10, 1.0, 1000) == pytest.approx(1 / eps, rel=1e-7)
    assert 1 / eps < 0.1 * math.sqrt(10) * 0.5


def test_integer_l2_bound_is_the_clip_in_units_plus_the_rounding() -> None:
    # ||round(x / gamma)|| <= C / gamma + sqrt(d): each coordinate moves by less than 1
    assert integer_l2_bound(1.0, 2.0**-16, 50_000) == 65536 + math.sqrt(50_000)
    rng, source = np.random.default_rng(3), SecureGaussian()
    gamma, d = 2.0**-2, 10_000  # coarse: the rounding term sqrt(d) = 100 dominates C / gamma
    for _ in range(20):
        x = rng.standard_normal(d)
        x /= np.linalg.norm(x)  # on the clip sphere, C = 1
        r = randomized_round(source, x / gamma)
        assert np.linalg.norm(r) <= integer_l2_bound(1.0, gamma, d)


def test_a_discrete_gaussian_too_narrow_for_its_z_is_refused() -> None:
    # Prepare: no fractional bits (gamma = 1), d = 1000, z = 0.01: sigma = z D2 / sqrt(3) is
    # about 0.19, where tau makes the sum far less private than the Gaussian accounted

    cfg = SecureAggregationConfig(scheme="secagg", scale_bits=0, clip_range=8.0)
    with pytest.raises(PrivacyError, match="not as private as z = 0.01: KLS21's tau term"):
        check_ddg((0.01, 1.0, 3), cfg, 4, 1000)
    sigma, _ = check_ddg((0.01, 1.0, 3), SecureAggregationConfig(scheme="secagg", scale_bits=16,
                         clip_range=8.0, modulus_bits=48), 4, 1000)  # fmt: skip
    assert sigma == pytest.approx(0.01 * (2**16 + math.sqrt(1000)) / math.sqrt(3))
