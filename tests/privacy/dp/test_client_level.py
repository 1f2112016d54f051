"""Client-level DP: clipping, the noise of an aggregated update in each placement, the plan."""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import pytest
from scipy import stats

from fl_secure.aggregation import StreamingMean
from fl_secure.errors import PrivacyError
from fl_secure.messages import TensorSpec
from privacy.dp.calibration import epsilon_for
from privacy.dp.client_level import (
    NoisyClippedSum,
    add_gaussian,
    client_noise_std,
    clip_update,
    effective_noise_multiplier,
    plan_client_level,
    update_norm,
)
from privacy.dp.noise import SecureGaussian, SeededGaussian

SPECS = [
    TensorSpec("w", np.dtype(np.float32), (500, 400)),
    TensorSpec("b", np.dtype(np.float32), (200,)),
]
D = 500 * 400 + 200


def _zeros() -> OrderedDict[str, np.ndarray]:
    return OrderedDict((s.name, np.zeros(s.shape, s.dtype)) for s in SPECS)


def _flat(update: OrderedDict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([v.astype(np.float64).ravel() for v in update.values()])


def test_secure_gaussian_is_standard_normal_and_not_repeating() -> None:
    # Prepare / Execute: two independent CSPRNG sources
    a, b = SecureGaussian().standard_normal(200_001), SecureGaussian().standard_normal(1000)
    # Assert: Kolmogorov-Smirnov against N(0, 1); odd lengths handled; two keys differ
    assert a.shape == (200_001,)
    assert stats.kstest(a, "norm").pvalue > 1e-4
    assert not np.allclose(a[:1000], b)
    u = SecureGaussian().uniform(100_000)
    assert 0.0 <= u.min() and u.max() < 1.0
    assert stats.kstest(u, "uniform").pvalue > 1e-4


def test_clip_update_bounds_the_norm_and_keeps_the_direction() -> None:
    # Prepare
    rng = np.random.default_rng(0)
    update = OrderedDict((s.name, rng.standard_normal(s.shape).astype(np.float32)) for s in SPECS)
    norm = update_norm(update)
    # Execute
    clipped, before = clip_update(update, 2.0)
    small, _ = clip_update(OrderedDict((k, v * 1e-4) for k, v in update.items()), 2.0)
    # Assert: ||clip(u)|| = C exactly (float32 rounding), same direction; small ones untouched
    assert before == pytest.approx(norm)
    assert update_norm(clipped) == pytest.approx(2.0, rel=1e-5)
    cos = _flat(clipped) @ _flat(update) / (update_norm(clipped) * norm)
    assert cos == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_array_equal(small["w"], (update["w"] * 1e-4).astype(np.float32))
    with pytest.raises(PrivacyError, match="NaN"):
        clip_update(OrderedDict(w=np.array([np.nan], np.float32)), 1.0)


@pytest.mark.parametrize(
    ("placement", "survivors", "expected_factor"),
    [
        ("central", 4, 1.0),  # server adds z C once
        ("local", 4, 2.0),  # four clients each add z C: sqrt(4) z C
        ("distributed", 3, 1.0),  # t = 3 shares of z C / sqrt(3): exactly z C
        ("distributed", 4, math.sqrt(4 / 3)),  # one more survivor than t: sqrt(4/3) z C
    ],
)
def test_aggregated_noise_has_the_configured_std_and_zero_mean(
    placement: str, survivors: int, expected_factor: float
) -> None:
    # Prepare: zero updates, so the aggregate is pure noise; the real CSPRNG
    z, c, t, denominator = 1.3, 0.5, 3, 4.0
    source = SecureGaussian()
    agg = NoisyClippedSum(
        SPECS,
        clip_norm=c,
        denominator=denominator,
        central_std=z * c if placement == "central" else 0.0,
        source=source,
        reclip=placement == "central",
    )
    # Execute: each survivor clips and adds its own noise, the server sums (and maybe noises)
    for _ in range(survivors):
        clipped, _ = clip_update(_zeros(), c)
        std = client_noise_std(placement, z, c, t)
        agg.add(add_gaussian(clipped, std, source) if std > 0 else clipped, weight=7.0)
    noise = _flat(agg.mean())
    # Assert: std of the released average = factor * z C / W (sd of the estimate is
    # sigma / sqrt(2 D) = 0.16 %, so 1 % is > 6 sd); mean within 5 standard errors
    sigma = expected_factor * z * c / denominator
    assert noise.std() == pytest.approx(sigma, rel=0.01)
    assert abs(noise.mean()) < 5 * sigma / math.sqrt(D)
    # the ledger's figure: the measured factor for distributed shares; z as accounted for
    # local noise (one honest client's share suffices) and central noise
    accounted = expected_factor if placement == "distributed" else 1.0
    assert effective_noise_multiplier(placement, z, survivors, t) == pytest.approx(accounted * z)


def test_distributed_noise_refuses_too_few_shares() -> None:
    with pytest.raises(PrivacyError, match="2 of the required 3"):
        effective_noise_multiplier("distributed", 1.0, 2, 3)


def test_central_aggregate_reclips_and_divides_by_the_expected_cohort() -> None:
    # Prepare: one client did not clip (norm 10 > C = 1); weights must be ignored
    big = OrderedDict(w=np.full((4,), 5.0, np.float32))  # norm 10
    small = OrderedDict(w=np.full((4,), 0.25, np.float32))  # norm 0.5
    spec = [TensorSpec("w", np.dtype(np.float32), (4,))]
    agg = NoisyClippedSum(
        spec, clip_norm=1.0, denominator=4.0, central_std=0.0, source=SeededGaussian(0), reclip=True
    )
    # Execute
    agg.add(big, weight=100.0)
    agg.add(small, weight=1.0)
    # Assert: (0.5 + 0.25) / 4 per coordinate; one update was re-clipped
    np.testing.assert_allclose(agg.mean()["w"], np.full(4, 0.75 / 4), rtol=1e-6)
    assert agg.clipped == 1


def test_noiseless_sum_over_the_cohort_is_the_plain_mean_bit_for_bit() -> None:
    # Prepare: three unclipped float32 updates; no noise, no re-clipping, W = 3 = the count
    rng = np.random.default_rng(7)
    updates = [
        OrderedDict((s.name, rng.standard_normal(s.shape).astype(s.dtype)) for s in SPECS)
        for _ in range(3)
    ]
    noisy = NoisyClippedSum(
        SPECS, clip_norm=1.0, denominator=3.0, central_std=0.0, source=SeededGaussian(0),
        reclip=False,
    )  # fmt: skip
    plain = StreamingMean(SPECS)
    # Execute: both fold the same float64 sums (the DP one ignores the weights)
    for update in updates:
        noisy.add(update, weight=5.0)
        plain.add(update, weight=1.0)
    # Assert: the same bits, tensor by tensor
    for name, expected in plain.mean().items():
        got = noisy.mean()[name]
        assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes()


def test_plan_calibrates_noise_to_the_budget_over_the_rounds() -> None:
    # Prepare / Execute: 4 clients, all every round (q = 1), 20 rounds, epsilon 8
    plan = plan_client_level(
        noise_multiplier=0.0,
        clip_norm=1.0,
        target_epsilon=8.0,
        delta=1e-5,
        accountant="pld",
        placement="local",
        rounds=20,
        population=4,
        clients_per_round=0,
        sample_rate=0.0,
    )
    eps = epsilon_for(
        accountant="pld",
        noise_multiplier=plan.noise_multiplier,
        sample_rate=1.0,
        steps=20,
        delta=1e-5,
        noise="discrete_gaussian",  # local noise: integers on a grid, by their zCDP bound
    )
    # Assert: within the budget and tight to 1 %; W = 4
    assert plan.calibrated and plan.sampling == "poisson" and plan.denominator == 4.0
    assert 0.99 * 8.0 <= eps <= 8.0


def test_plan_for_fixed_cohorts_needs_pld() -> None:
    plan = plan_client_level(
        noise_multiplier=1.0,
        clip_norm=1.0,
        target_epsilon=0.0,
        delta=1e-5,
        accountant="pld",
        placement="central",
        rounds=5,
        population=10,
        clients_per_round=5,
        sample_rate=0.0,
    )
    assert (plan.sampling, plan.sample_rate, plan.denominator) == ("fixed_size", 0.5, 5)
    with pytest.raises(PrivacyError, match="only analysed by the 'pld'"):
        plan_client_level(
            noise_multiplier=1.0,
            clip_norm=1.0,
            target_epsilon=0.0,
            delta=1e-5,
            accountant="rdp",
            placement="central",
            rounds=5,
            population=10,
            clients_per_round=5,
            sample_rate=0.0,
        )
