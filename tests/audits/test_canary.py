"""Empirical epsilon lower bounds: reference values, soundness against the accountant."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from audits.canary import (
    best_threshold,
    clopper_pearson_bound,
    clopper_pearson_upper,
    draw_inclusion,
    epsilon_from_rates,
    one_run_audit,
    one_run_bound,
    one_run_p_value,
    threshold_audit,
)
from privacy.dp.calibration import calibrate_noise, epsilon_for

DELTA = 1e-5


@pytest.fixture(scope="module")
def gaussian_at_eps1() -> tuple[float, float]:
    """Noise std of a sensitivity-1 Gaussian mechanism at epsilon=1, and its accounted eps."""
    z = calibrate_noise(target_epsilon=1.0, sample_rate=1.0, steps=1, delta=DELTA)
    eps = epsilon_for(accountant="pld", noise_multiplier=z, sample_rate=1.0, steps=1, delta=DELTA)
    assert 3.5 < z < 4.0 and eps <= 1.0  # analytic Gaussian mechanism: sigma ~ 3.73
    return z, eps


def test_clopper_pearson_upper_matches_its_definition() -> None:
    for k, n, alpha in [(0, 10, 0.05), (3, 50, 0.025), (49, 50, 0.01), (400, 1000, 0.05)]:
        p = clopper_pearson_upper(k, n, alpha)
        assert stats.binom.cdf(k, n, p) == pytest.approx(alpha, rel=1e-8)
    assert clopper_pearson_upper(0, 1000, 0.025) == pytest.approx(1 - 0.025 ** (1 / 1000))
    assert clopper_pearson_upper(7, 7, 0.05) == 1.0


def test_epsilon_from_rates_reference_values() -> None:
    assert epsilon_from_rates(0.1, 0.2, 0.0) == pytest.approx(math.log(8.0))
    assert epsilon_from_rates(0.1, 0.2, 0.1) == pytest.approx(math.log(0.7 / 0.1))
    assert epsilon_from_rates(0.5, 0.5, 0.0) == 0.0  # a coin flip refutes nothing
    assert epsilon_from_rates(0.0, 0.3, 0.0) == math.inf


def test_perfect_attack_reaches_the_cap_of_the_trial_count() -> None:
    bound = clopper_pearson_bound(
        true_positives=1000, false_negatives=0, false_positives=0, true_negatives=1000, delta=DELTA
    )
    p = 1 - 0.025 ** (1 / 1000)  # alpha = 0.05 split over the two rates
    assert bound.epsilon == pytest.approx(math.log((1 - DELTA - p) / p))
    assert bound.epsilon == bound.max_epsilon == pytest.approx(5.6006, abs=1e-4)
    assert bound.confidence == 0.95
    small = clopper_pearson_bound(
        true_positives=100, false_negatives=0, false_positives=0, true_negatives=100, delta=DELTA
    )
    assert small.max_epsilon < bound.max_epsilon  # fewer trials, lower cap


def test_non_private_mechanism_gives_a_clearly_positive_bound() -> None:
    g = torch.Generator().manual_seed(0)
    scores_in, scores_out = (
        1 + 0.05 * torch.randn(2000, generator=g),
        0.05 * torch.randn(2000, generator=g),
    )
    bound, threshold = threshold_audit(scores_in, scores_out, delta=DELTA)
    assert 0.0 < threshold < 1.0
    assert bound.epsilon > 5.0 and bound.epsilon == bound.max_epsilon
    included = draw_inclusion(1000, generator=g)
    scores = included.double() + 0.05 * torch.randn(1000, generator=g, dtype=torch.float64)
    one = one_run_audit(scores, included, k_plus=50, k_minus=50, delta=DELTA)
    assert one.counts == {"canaries": 1000, "guesses": 100, "correct": 100}
    assert one.epsilon > 3.0 and one.epsilon == one.max_epsilon


@pytest.mark.parametrize("seed", range(5))
def test_random_guesses_give_about_zero(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    bound, _ = threshold_audit(
        torch.randn(2000, generator=g), torch.randn(2000, generator=g), delta=DELTA
    )
    assert bound.epsilon < 0.1
    included = draw_inclusion(1000, generator=g)
    one = one_run_audit(
        torch.randn(1000, generator=g), included, k_plus=100, k_minus=100, delta=DELTA
    )
    assert one.epsilon < 0.2
    assert one.max_epsilon > 3.0


def test_exact_error_rates_of_the_gaussian_never_exceed_the_accountant(gaussian_at_eps1) -> None:
    # With the true (FPR, FNR) of every threshold test the formula must stay <= the accounted
    # epsilon (Kairouz et al. 2015); at a 4x smaller noise it must exceed it somewhere.
    sigma, eps = gaussian_at_eps1
    thresholds = torch.linspace(-30, 30, 6001, dtype=torch.float64).tolist()
    norm = stats.norm
    implied = [
        epsilon_from_rates(norm.sf(t / sigma), norm.cdf((t - 1) / sigma), DELTA) for t in thresholds
    ]
    assert max(implied) <= eps
    assert max(implied) > 0.5  # the formula is not vacuous at the calibrated noise
    weaker = [
        epsilon_from_rates(norm.sf(4 * t / sigma), norm.cdf(4 * (t - 1) / sigma), DELTA)
        for t in thresholds
    ]
    assert max(weaker) > eps


def test_empirical_bounds_stay_below_the_accountant_over_many_audits(gaussian_at_eps1) -> None:
    sigma, eps = gaussian_at_eps1
    cp, one = [], []
    for seed in range(30):
        g = torch.Generator().manual_seed(seed)
        scores_in = 1 + sigma * torch.randn(2000, generator=g, dtype=torch.float64)
        scores_out = sigma * torch.randn(2000, generator=g, dtype=torch.float64)
        cp.append(threshold_audit(scores_in, scores_out, delta=DELTA)[0].epsilon)
        included = draw_inclusion(1000, generator=g)
        scores = included.double() + sigma * torch.randn(1000, generator=g, dtype=torch.float64)
        one.append(one_run_audit(scores, included, k_plus=50, k_minus=50, delta=DELTA).epsilon)
    assert max(cp) <= eps and max(one) <= eps  # fails if a lower bound passes the upper bound
    assert max(one) > 0.0  # and the audit is not trivially zero


def test_the_threshold_audit_refutes_a_mechanism_with_a_quarter_of_the_noise(
    gaussian_at_eps1,
) -> None:
    # Prepare: scores of a Gaussian mechanism claiming epsilon 1 with 1/4 of its noise (true
    # epsilon about 4.7)
    sigma, eps = gaussian_at_eps1
    bounds = []
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        scores_in = 1 + sigma / 4 * torch.randn(2000, generator=g, dtype=torch.float64)
        scores_out = sigma / 4 * torch.randn(2000, generator=g, dtype=torch.float64)
        # Execute
        bounds.append(threshold_audit(scores_in, scores_out, delta=DELTA)[0].epsilon)
    # Assert: the claim is refuted in most audits, by a margin (measured median 1.67; a
    # threshold chosen from the plain error frequencies sat in the far tails: median 1.38)
    assert float(np.median(bounds)) > 1.45 * eps


def _reference_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """Steinke, Nasr & Jagielski 2023, reference code (loop form)."""
    q = 1 / (1 + math.exp(-eps))
    beta = stats.binom.sf(v - 1, r, q)
    alpha, total = 0.0, 0.0
    for i in range(1, v + 1):
        total += stats.binom.pmf(v - i, r, q)
        if total > i * alpha:
            alpha = total / i
    return min(beta + alpha * delta * 2 * m, 1.0)


def test_one_run_p_value_matches_the_reference_algorithm() -> None:
    for m, r, v, eps, delta in [
        (1000, 100, 80, 1.0, 1e-5), (1000, 200, 150, 0.5, 1e-3), (50, 20, 20, 3.0, 1e-2),
        (1000, 100, 30, 0.2, 1e-5), (10, 0, 0, 1.0, 1e-5),
    ]:  # fmt: skip
        assert one_run_p_value(m, r, v, eps, delta) == pytest.approx(
            _reference_p_value(m, r, v, eps, delta), rel=1e-10, abs=1e-300
        )
    # pure DP: exactly the binomial tail of Thm. 3.1
    assert one_run_p_value(1000, 100, 80, 1.0, 0.0) == pytest.approx(
        stats.binom.sf(79, 100, 1 / (1 + math.exp(-1.0)))
    )


def test_one_run_bound_is_the_rejection_boundary() -> None:
    b = one_run_bound(1000, 100, 85, delta=DELTA)
    assert b.epsilon > 0.5
    assert one_run_p_value(1000, 100, 85, b.epsilon, DELTA) < 0.05
    assert one_run_p_value(1000, 100, 85, b.epsilon + 1e-6, DELTA) >= 0.05
    assert one_run_bound(1000, 100, 84, delta=DELTA).epsilon < b.epsilon  # monotone in v


def test_best_threshold_separates_two_point_masses() -> None:
    t = best_threshold(torch.tensor([2.0, 2.0, 3.0]), torch.tensor([0.0, 1.0]), delta=0.0)
    assert t == 1.5


def test_draw_inclusion_default_is_csprng_bits() -> None:
    bits = draw_inclusion(4096)
    assert bits.dtype == torch.bool and bits.shape == (4096,)
    assert 1800 < int(bits.sum()) < 2300
    seeded = draw_inclusion(64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(seeded, draw_inclusion(64, generator=torch.Generator().manual_seed(1)))
