"""A mechanism released on worst-case canaries, and the canaries' scores.

:mod:`audits.canary_release`: canaries built one at a time release what the dense batch does,
a central-noise round without a canary still releases, and under client sampling the
likelihood-ratio score ranks canaries better than their sum.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from audits.canary import one_run_audit
from audits.canary_release import OneHotCanaries, canary_scores, release_round
from audits.mechanism import Mechanism
from privacy.dp.calibration import calibrate_noise
from privacy.dp.noise import SeededGaussian


@pytest.mark.parametrize(("placement", "honest"), [("central", 0), ("distributed", 3)])
def test_under_client_sampling_the_one_run_audit_ranks_by_the_likelihood_ratio(
    placement: str, honest: int
) -> None:
    # Prepare: epsilon 8 over 200 rounds at q = 0.02 (each round's ratio is a mixture)
    z = calibrate_noise(target_epsilon=8.0, sample_rate=0.02, steps=200, delta=1e-5)
    mech = Mechanism(z, 1.0, 3.0, placement, 200, 0.02, honest, 3, 1e-5, 8.0)
    for seed in range(3):
        included = np.random.default_rng(seed).random(1000) < 0.5
        bounds = []
        # Execute: the same releases, scored by their sum and by the log-likelihood ratio
        for mixture in (False, True):
            scores, _ = canary_scores(mech, included, seed=seed + 10, mixture=mixture)
            bound = one_run_audit(torch.from_numpy(scores), torch.from_numpy(included),
                                  k_plus=100, k_minus=100, delta=1e-5, alpha=0.025)  # fmt: skip
            bounds.append(bound.epsilon)
        # Assert: the ratio's bound is well above the sum's (measured 1.18-1.37 against
        # 0.36-0.75), and still below the accountant's
        assert bounds[1] > bounds[0] + 0.3 and bounds[1] <= 8.0, bounds


@pytest.mark.parametrize("placement", ["central", "distributed", "local"])
def test_canaries_built_one_at_a_time_release_exactly_the_dense_batch(placement: str) -> None:
    # Prepare: 40 of 300 coordinates carry a canary of norm 2C
    mech = Mechanism(1.3, 1.0, 5.0, placement, 1, 1.0, 3, 3, 1e-5, 3.0)
    rows = np.sort(np.random.default_rng(0).choice(300, 40, replace=False))
    dense = np.zeros((40, 300))
    dense[np.arange(40), rows] = 2.0
    # Execute
    lazy = release_round(mech, OneHotCanaries(rows, 300, 2.0), SeededGaussian(5))
    eager = release_round(mech, dense, SeededGaussian(5))
    # Assert: bit-identical releases (the same updates, in the same order, same noise)
    np.testing.assert_array_equal(lazy, eager)


def test_a_central_noise_round_without_a_sampled_canary_still_releases() -> None:
    # central noise: no honest noise shares (honest_clients 0), and no canary this round
    mech = Mechanism(1.0, 1.0, 5.0, "central", 1, 0.005, 0, 3, 1e-5, 3.0)
    out = release_round(mech, np.zeros((0, 4000)), SeededGaussian(0))
    assert out.shape == (4000,)
    assert np.std(out) == pytest.approx(1.0 * 1.0 / 5.0, rel=0.05)  # z C / W
