"""Empirical epsilon of a mechanism beside its accountant's, and the audit's size.

:mod:`audits.mechanism_audit` on mechanisms calibrated to a claim (honest) or given less noise
than they claim (broken): the bound never exceeds an honest claim, refutes a broken one, and
says when its size cannot test the claim.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from audits.mechanism import Mechanism
from audits.mechanism_audit import (
    MAX_AUTO_TRIALS,
    _perfect_bound,
    audit_mechanism,
    audit_size,
    perfect_attack_epsilon,
    trials_to_test,
)
from audits.run_audit import findings
from privacy.dp.calibration import calibrate_noise


@pytest.mark.parametrize("placement", ["central", "distributed", "local"])
@pytest.mark.parametrize("epsilon", [1.0, 8.0])
def test_mechanism_audit_never_exceeds_the_accountant(placement: str, epsilon: float) -> None:
    z = calibrate_noise(target_epsilon=epsilon, sample_rate=1.0, steps=8, delta=1e-5)
    mech = Mechanism(z, 1.0, 3.0, placement, 8, 1.0, 3, 3, 1e-5, epsilon)
    found = audit_mechanism(mech, seed=1)
    assert found["epsilon_lower_bound"] <= epsilon
    if epsilon == 8.0 and placement != "local":  # local noise is sqrt(3) x what is accounted
        assert found["epsilon_lower_bound"] > 1.0  # the audit is not vacuous (measured 3.2-3.4)
    # 1000 trials can show at most 4.73: epsilon 1 is tested, epsilon 8 cannot be, and the
    # audit says so instead of "not exceeded"
    assert found["can_test_accountant"] is (epsilon == 1.0)
    assert found["exceeds_accountant"] is (False if epsilon == 1.0 else None)


def test_a_mechanism_with_less_noise_than_it_claims_is_flagged() -> None:
    # Prepare: the noise of epsilon 1, divided by 4 (a broken mechanism claiming epsilon 1)
    z = calibrate_noise(target_epsilon=1.0, sample_rate=1.0, steps=8, delta=1e-5)
    mech = Mechanism(z / 4, 1.0, 3.0, "central", 8, 1.0, 0, 3, 1e-5, 1.0)
    # Execute
    found = audit_mechanism(mech, seed=1)
    # Assert: the bound passes the claim (measured 1.8), and the finding says so
    assert found["can_test_accountant"] is True and found["exceeds_accountant"] is True
    assert found["epsilon_lower_bound"] > 1.0
    codes = {f["code"] for f in findings({"attacks": {"canary": found}})}
    assert codes == {"audit-exceeds-accountant"}


def test_the_audit_sizes_itself_to_test_the_claim() -> None:
    # Prepare: claims of epsilon 8 (one round), 1 and none; one of 12
    z = calibrate_noise(target_epsilon=8.0, sample_rate=1.0, steps=1, delta=1e-5)
    eight = Mechanism(z, 1.0, 3.0, "central", 1, 1.0, 0, 3, 1e-5, 8.0)
    # Execute / Assert: 1.25 x the fewest trials that can show more than 8 (26130)
    n = audit_size(eight)
    assert n == 32_664 and n > trials_to_test(8.0, 1e-5, 0.025) == 26_130
    assert audit_mechanism(eight, canaries=n, trials=n, seed=3)["can_test_accountant"] is True
    assert audit_size(dataclasses.replace(eight, accountant_epsilon=1.0)) == 1000
    assert audit_size(dataclasses.replace(eight, accountant_epsilon=None)) == 1000
    # no audit up to the cap can test 12: the cap, and the audit says it cannot test
    twelve = dataclasses.replace(eight, accountant_epsilon=12.0)
    assert audit_size(twelve) == MAX_AUTO_TRIALS
    capped = audit_mechanism(twelve, canaries=MAX_AUTO_TRIALS, trials=MAX_AUTO_TRIALS, seed=3)
    assert capped["can_test_accountant"] is False
    assert capped["largest_bound_this_audit_can_show"] == pytest.approx(8.83, abs=0.01)


def test_an_audit_sized_for_epsilon_8_can_refute_a_mechanism_without_noise() -> None:
    # Prepare: a claim of epsilon 8 (one round) that 1000 trials cannot test; the size the
    # audit names
    z = calibrate_noise(target_epsilon=8.0, sample_rate=1.0, steps=1, delta=1e-5)
    honest = Mechanism(z, 1.0, 3.0, "central", 1, 1.0, 0, 3, 1e-5, 8.0)
    small = audit_mechanism(honest, seed=1)
    assert small["can_test_accountant"] is False and small["trials_to_test_accountant"] > 20_000
    (finding,) = findings({"attacks": {"canary": small}})
    assert finding["code"] == "audit-cannot-test-accountant"
    assert f"--canary-trials {small['trials_to_test_accountant']}" in finding["message"]
    n = trials_to_test(8.0, 1e-5, 0.025)
    assert n == small["trials_to_test_accountant"]
    # Execute: that many trials, on the honest mechanism and on one with almost no noise
    fair = audit_mechanism(honest, canaries=n, trials=n, seed=2)
    broken = audit_mechanism(dataclasses.replace(honest, noise_multiplier=z / 1000), canaries=n,
                             trials=n, seed=2)  # fmt: skip
    # Assert: the sized audit can test the claim; it passes the honest mechanism and refutes
    # the broken one
    assert fair["can_test_accountant"] is True and fair["exceeds_accountant"] is False
    assert fair["trials_to_test_accountant"] is None
    assert fair["trials_to_test_accountant_more_than"] is None
    assert small["trials_to_test_accountant_more_than"] is None
    assert broken["exceeds_accountant"] is True and broken["epsilon_lower_bound"] > 8.0


def test_the_trials_that_test_a_claim_follow_the_closed_form_of_a_perfect_attack() -> None:
    # the closed form 1 - (alpha / 2) ** (1 / h) is the exact Clopper-Pearson bound
    for n in (2, 14, 1000, 26_130, 60_000, 1_000_000):
        assert perfect_attack_epsilon(n, 1e-5, 0.025) == pytest.approx(
            _perfect_bound(n, 1e-5, 0.025), rel=1e-12, abs=1e-12
        )
    # the fewest: n trials can show more than epsilon, n - 2 cannot, far beyond 2^63 / 2
    for epsilon in (0.5, 8.0, 20.0, 25.0):
        n = trials_to_test(epsilon, 1e-5, 0.025)
        assert n is not None and n % 2 == 0
        assert perfect_attack_epsilon(n, 1e-5, 0.025) > epsilon
        assert perfect_attack_epsilon(n - 2, 1e-5, 0.025) <= epsilon
    assert trials_to_test(20.0, 1e-5, 0.025) == 4_252_056_142  # (as the doubling search found)
    # 10^12 trials show at most 25.46: a larger claim, or an infinite one, names no count
    assert perfect_attack_epsilon(1e12, 1e-5, 0.025) == pytest.approx(25.46, abs=0.01)
    for epsilon in (26.0, 42.5, 54.4, math.inf):
        assert trials_to_test(epsilon, 1e-5, 0.025) is None
    assert trials_to_test(12.0, 1e-5, 0.025, limit=1_000_000) is None  # needs 1,426,412
