"""Example-level figures a client reports: what the server accepts, its ledger row, its event."""

from __future__ import annotations

import pytest

from fl_secure.errors import PrivacyError, ProtocolError
from fl_secure.messages import LocalTraining
from privacy.dp.accountants.accountant import ADJACENCY
from privacy.dp.example_level import (
    MAX_DP_STEPS_PER_ROUND,
    check_example_metrics,
    example_event,
    example_payload,
)

# two epochs at q = 0.05: 2 * round(1 / 0.05) = 40 steps
TASK = LocalTraining(local_epochs=2)
GOOD = {"dp_epsilon": 1.5, "dp_steps": 40.0, "dp_noise_multiplier": 1.1, "dp_sample_rate": 0.05}


def test_figures_the_task_allows_are_accepted() -> None:
    check_example_metrics("c0", GOOD, TASK)
    check_example_metrics("c0", {**GOOD, "dp_steps": 0.0}, TASK)  # the unchanged parameters


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"dp_epsilon": None}, r"client c0 sent no example-level accounting \(dp_epsilon\)"),
        ({"dp_steps": float("nan")}, "client c0: dp_steps not finite"),
        ({"dp_sample_rate": 1e-7}, r"dp_sample_rate = 1e-07, expected \[1e-06, 1\]"),
        ({"dp_noise_multiplier": 0.01}, "dp_noise_multiplier = 0.01, below the 0.05"),
        ({"dp_epsilon": -1.0}, "dp_epsilon = -1 < 0"),
        ({"dp_steps": 41.0}, r"dp_steps = 41, expected an integer in 0..40"),
        ({"dp_steps": 2.5}, r"dp_steps = 2.5, expected an integer"),
    ],
)
def test_figures_the_accountant_could_not_take_are_refused_by_name(
    change: dict[str, float | None], match: str
) -> None:
    # Prepare: one key changed (None: left out)
    metrics = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    # Execute / Assert
    with pytest.raises(ProtocolError, match=match):
        check_example_metrics("c0", metrics, TASK)


def test_steps_are_capped_at_what_the_server_accounts_per_round() -> None:
    # Prepare: a task of more local steps than the server composes in a round
    task = LocalTraining(local_steps=MAX_DP_STEPS_PER_ROUND + 1)
    over = {**GOOD, "dp_steps": float(MAX_DP_STEPS_PER_ROUND + 1)}
    # Execute / Assert
    check_example_metrics("c0", {**GOOD, "dp_steps": float(MAX_DP_STEPS_PER_ROUND)}, task)
    with pytest.raises(ProtocolError, match=f"at most {MAX_DP_STEPS_PER_ROUND} per round"):
        check_example_metrics("c0", over, task)


def test_the_ledger_payload_and_the_accountant_event_of_a_release() -> None:
    # Execute
    payload = example_payload(
        "c0", {**GOOD, "dp_noise_secure": 1.0}, delta=1e-5, accountant="prv", clip_norm=1.0
    )
    # Assert: the reported figures, typed; the event composes the steps taken
    assert payload == {
        "client_reported_epsilon": 1.5,
        "delta": 1e-5,
        "accountant": "prv",
        "steps": 40,
        "noise_multiplier": 1.1,
        "sample_rate": 0.05,
        "clip_norm": 1.0,
        "adjacency": ADJACENCY["poisson"],
        "privacy_unit": "example",
        "noise_secure": True,
    }
    assert example_event(payload) == [
        {"noise_multiplier": 1.1, "sample_rate": 0.05, "num_steps": 40}
    ]
    assert example_event({**payload, "steps": 0}) == []  # no step, no privacy loss
    with pytest.raises(PrivacyError, match="client c1 sent no example-level accounting"):
        example_payload("c1", {}, delta=1e-5, accountant="prv", clip_norm=1.0)
