"""The mechanism a run's summary states, as the canary audit runs it (:mod:`audits.mechanism`).

Prepare / Execute / Assert on summaries written by hand: the noise shares a release carries,
the fields a client-level DP summary must state, and a claim no practical audit can test.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest

from audits.canary_release import release_std
from audits.mechanism import mechanism_of_run
from audits.mechanism_audit import MAX_TRIALS_TO_TEST, audit_mechanism
from audits.run_audit import findings, summary_lines
from fl_secure.errors import CheckpointError
from privacy.dp.calibration import calibrate_noise


def _summary(placement: str, scheme: str, z: float, epsilon: float) -> dict[str, Any]:
    return {
        "privacy_unit": "client",
        "noise_placement": placement,
        "epsilon": epsilon,
        "delta": 1e-5,
        "rounds_completed": 8,
        "privacy": {"noise_multiplier": z, "clip_norm": 1.0, "aggregate_denominator": 3.0},
        "secure_aggregation": {"scheme": scheme},
    }


@pytest.mark.parametrize(
    ("placement", "scheme", "contributors"),
    [("local", "none", 1), ("local", "secagg", 3), ("distributed", "secagg+", 3),
     ("central", "none", 0)],
)  # fmt: skip
def test_canaries_face_the_noise_of_the_fewest_honest_clients_a_round_has(
    placement: str, scheme: str, contributors: int
) -> None:
    # Prepare: 10 enrolled clients, rounds of at least 3
    z = calibrate_noise(target_epsilon=8.0, sample_rate=1.0, steps=8, delta=1e-5)
    summary = _summary(placement, scheme, z, 8.0)
    # Execute
    mech = mechanism_of_run(summary, num_clients=10, min_clients=3, rounds=8)
    found = audit_mechanism(mech, seed=1)
    # Assert: noise shares of the fewest honest clients, not of all 10 enrolled ones
    assert mech.honest_clients == contributors
    assert found["epsilon_lower_bound"] <= 8.0
    if contributors <= 1 or placement == "distributed":  # z C on the canary, as accounted
        assert found["epsilon_lower_bound"] > 1.0  # not vacuous (10 shares gave 0.3)


@pytest.mark.parametrize(
    ("encrypted", "contributors"),
    [(["backbone.embedding"], 1), (["backbone.stages", "head"], 1), ("all", 3), (None, 3)],
)  # fmt: skip
def test_a_ckks_run_that_encrypts_some_layers_shows_each_clients_noise_share_alone(
    encrypted: Any, contributors: int
) -> None:
    # Prepare: local noise under CKKS; ckks_layers encrypts a subset (or every layer: "all",
    # or a summary written without encrypted_layers)
    z = calibrate_noise(target_epsilon=8.0, sample_rate=1.0, steps=8, delta=1e-5)
    summary = _summary("local", "ckks", z, 8.0)
    if encrypted is not None:
        summary["secure_aggregation"]["encrypted_layers"] = encrypted
    # Execute
    mech = mechanism_of_run(summary, num_clients=10, min_clients=3, rounds=8)
    # Assert: the layers left in the clear reach the server one client at a time, so a
    # canary there carries one share z C; the encrypted sum carries min_clients of them
    assert mech.honest_clients == contributors
    assert release_std(mech) == pytest.approx(math.sqrt(contributors) * z * 1.0 / 3.0)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("privacy.noise_multiplier", None, "privacy.noise_multiplier is missing (expected a"),
        ("privacy.clip_norm", None, "privacy.clip_norm is missing (expected a number"),
        ("privacy.clip_norm", "1.0", "privacy.clip_norm is '1.0', not a number"),
        ("privacy.aggregate_denominator", True, "privacy.aggregate_denominator is True, not a"),
        ("epsilon", None, "epsilon is missing (expected a number; a client-level DP run"),
        ("noise_placement", None, "noise_placement is None, not one of central, local, distr"),
        ("privacy", [], "privacy is [], not an object"),
    ],
)  # fmt: skip
def test_a_summary_without_a_privacy_field_is_refused_by_name(
    field: str, value: Any, message: str
) -> None:
    # Prepare: a client-level DP summary with one field removed (None) or damaged
    summary = _summary("central", "none", 1.0, 8.0)
    *parents, key = field.split(".")
    node = summary[parents[0]] if parents else summary
    if value is None:
        del node[key]
    else:
        node[key] = value
    # Execute / Assert: CheckpointError naming the file and the field, not a KeyError
    with pytest.raises(CheckpointError, match=re.escape(f"RUN/summary.json is damaged: {message}")):
        mechanism_of_run(summary, num_clients=3, min_clients=3, rounds=8,
                         source="RUN/summary.json")  # fmt: skip


@pytest.mark.parametrize(
    ("unit", "record"), [("example", "one training image's"), ("identity", "one person's")]
)
def test_a_dpsgd_run_is_not_called_a_run_without_dp(unit: str, record: str) -> None:
    summary = {"privacy_unit": unit, "epsilon": 2.0, "delta": 1e-5, "rounds_completed": 4}
    mech = mechanism_of_run(summary, num_clients=3, min_clients=3, rounds=4)
    found = audit_mechanism(mech, canaries=200, trials=200, seed=0)
    assert found["accountant_epsilon"] is None  # no client-level claim to compare with
    assert found["accountant"].startswith(f"none at the client level: the run's DP is {unit}")
    assert f"bounds {record} influence" in found["accountant"]


@pytest.mark.parametrize("epsilon", [54.38, math.inf])
def test_a_claim_no_practical_audit_can_test_is_reported_not_a_crash(epsilon: float) -> None:
    # Prepare: z 0.2 over 2 rounds, the accountant's epsilon 54.4 (PLD), or no bound at all
    summary = _summary("central", "none", 0.2, epsilon) | {"rounds_completed": 2}
    mech = mechanism_of_run(summary, num_clients=3, min_clients=3, rounds=2)
    # Execute
    found = audit_mechanism(mech, canaries=1000, trials=1000, seed=0)
    # Assert: the audit cannot test it and says that no audit up to the limit can
    assert found["can_test_accountant"] is False and found["exceeds_accountant"] is None
    assert found["trials_to_test_accountant"] is None
    assert found["trials_to_test_accountant_more_than"] == MAX_TRIALS_TO_TEST == 10**12
    (finding,) = findings({"attacks": {"canary": found}})
    assert finding["code"] == "audit-cannot-test-accountant"
    assert "--canary-trials" not in finding["message"]
    if math.isfinite(epsilon):
        assert "no audit of up to 1,000,000,000,000 trials can" in finding["message"]
    else:
        assert "no audit can: an infinite epsilon bounds nothing" in finding["message"]
    assert any(line.startswith("finding [audit-cannot") for line in summary_lines(
        {"attacks": {"canary": found}}
    ))  # fmt: skip
