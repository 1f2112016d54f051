"""A site's own ledger: its releases, persistence, its budgets against the server."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from scipy.optimize import minimize_scalar

from fl_secure.config import Config, config_from_dict
from fl_secure.errors import PrivacyError
from privacy.client_round import ClientPrivacy
from privacy.ledger.site_ledger import FILE_NAME, SiteLedger


def _zcdp_epsilon(multipliers: list[float], delta: float) -> float:
    """Discrete Gaussian releases (no sampling): ``rho = sum 1 / (2 z^2)``-zCDP, converted by
    Canonne, Kamath & Steinke 2020, Proposition 12, minimised over a continuous order."""
    rho = sum(1 / (2 * z * z) for z in multipliers)

    def eps(log_a1: float) -> float:
        a = 1.0 + math.exp(log_a1)
        tail = math.log(1 / delta) + (a - 1) * math.log(1 - 1 / a) - math.log(a)
        return a * rho + tail / (a - 1)

    return float(minimize_scalar(eps, bounds=(-8.0, 16.0), method="bounded").fun)


def _config(scheme: str = "none", **privacy: object) -> Config:
    return config_from_dict(
        {"partition": {"num_clients": 6}, "server": {"min_clients": 4, "max_retries": 1},
         "train": {"rounds": 100},
         "privacy": {"unit": "client", "noise_multiplier": 1.0, **privacy},
         "secure_aggregation": {"scheme": scheme}}
    )  # fmt: skip


def test_releases_survive_a_restart_and_tasks_are_not_answered_twice(tmp_path: Path) -> None:
    # Prepare: max_retries = 1 (two attempts per round); round 2 answered once, then restart
    config = _config()
    site = SiteLedger(tmp_path)
    assert site.refusal(config, "run-a", 2, b"a" * 16, last_round=0) == ""
    site.record(config, "run-a", 2, b"a" * 16)
    # Execute: a restarted client reads the same folder
    again = SiteLedger(tmp_path)
    # Assert: the replay, a third attempt and an older round are refused after the restart
    assert "replayed task" in again.refusal(config, "run-a", 2, b"a" * 16, last_round=0)
    assert again.refusal(config, "run-a", 2, b"b" * 16, last_round=0) == ""
    again.record(config, "run-a", 2, b"b" * 16)
    assert "already sent 2 updates for round 2" in SiteLedger(tmp_path).refusal(
        config, "run-a", 2, b"c" * 16, last_round=0
    )
    assert "older than round 2" in again.refusal(config, "run-a", 1, b"d" * 16, last_round=0)
    assert again.refusal(config, "run-b", 1, b"d" * 16, last_round=0) == ""  # another run
    assert again.record(config, "run-a", 2, b"b" * 16) is None  # counted once
    assert [r.round for r in SiteLedger(tmp_path).releases] == [2, 2]


def test_the_budget_allows_exactly_the_releases_the_reference_accountant_allows(
    tmp_path: Path,
) -> None:
    # Prepare: z = 1.5, local noise, a site budget of 4 at delta 1e-5
    config = _config(noise_multiplier=1.5)
    site = SiteLedger(tmp_path, max_epsilon=4.0, delta=1e-5)
    expected = 0
    while _zcdp_epsilon([1.5] * (expected + 1), 1e-5) <= 4.0:
        expected += 1
    # Execute: one round after another until the site refuses
    for round_ in range(1, 100):
        refusal = site.refusal(config, "run", round_, bytes([round_]) * 16, last_round=0)
        if refusal:
            break
        site.record(config, "run", round_, bytes([round_]) * 16)
    # Assert: as many releases as the zCDP bound allows, then a refusal that says why
    assert len(site.releases) == expected > 0
    assert "above its budget of 4" in refusal
    assert site.epsilon() <= 4.0 < site.epsilon(extra=site.releases[-1])
    assert "above its budget" in SiteLedger(tmp_path, max_epsilon=4.0).refusal(
        config, "run", 99, b"z" * 16, last_round=0
    )  # and after a restart


def test_with_colluding_peers_only_the_sites_own_noise_share_counts(tmp_path: Path) -> None:
    # Prepare: distributed noise, z = 2 for the sum of t = 4 shares: each share z / 2
    config = _config("secagg", noise_multiplier=2.0, noise_placement="distributed")
    site = SiteLedger(tmp_path)
    for round_ in range(1, 6):
        site.record(config, "run", round_, bytes([round_]) * 16)
    # Assert
    assert site.epsilon() == pytest.approx(_zcdp_epsilon([2.0] * 5, 1e-5), abs=1e-4)
    colluding = site.epsilon(colluding_peers=True)
    assert colluding == pytest.approx(_zcdp_epsilon([1.0] * 5, 1e-5), abs=1e-4)
    summary = site.summary()
    assert summary["releases"] == 5 and summary["epsilon_colluding_peers"] == colluding
    assert summary["releases_without_client_level_noise"] == 0


def test_a_release_without_client_level_noise_makes_the_site_epsilon_unbounded(
    tmp_path: Path,
) -> None:
    site = SiteLedger(tmp_path)
    site.record(_config(), "run-a", 1, b"a" * 16)
    site.record(config_from_dict({}), "run-b", 1, b"b" * 16)  # a non-private run
    assert site.epsilon() == math.inf
    assert site.summary()["releases_without_client_level_noise"] == 1


@pytest.mark.parametrize(
    ("privacy", "match"),
    [
        ({"unit": "none"}, "privacy.unit is 'none'"),
        ({"unit": "example"}, "privacy.unit is 'example'"),
        ({"noise_placement": "central"}, "noise is central"),
        ({"noise_multiplier": 0.0, "target_epsilon": 4.0}, "without a calibrated"),
    ],
)
def test_a_site_with_a_budget_refuses_a_run_that_cannot_keep_it(
    tmp_path: Path, privacy: dict[str, object], match: str
) -> None:
    config = config_from_dict({"privacy": {"unit": "client", "noise_multiplier": 1.0, **privacy}})
    with pytest.raises(PrivacyError, match=match):
        SiteLedger(tmp_path, max_epsilon=8.0).check_run(config)
    SiteLedger(tmp_path).check_run(config)  # without a budget it is only recorded


def test_a_budget_needs_a_state_folder_and_a_damaged_ledger_is_left_alone(tmp_path: Path) -> None:
    with pytest.raises(PrivacyError, match="needs a state folder"):
        SiteLedger(None, max_epsilon=8.0)
    path = tmp_path / FILE_NAME
    path.write_text('{"format": "fl-secure site ledger", "version": 1, "releases": [{"run', "utf-8")
    with pytest.raises(PrivacyError, match="cannot be read"):
        SiteLedger(tmp_path)
    doc = {"format": "fl-secure site ledger", "version": 1, "releases": [{"round": "1"}]}
    path.write_text(json.dumps(doc), "utf-8")
    with pytest.raises(PrivacyError, match="exactly the keys"):
        SiteLedger(tmp_path)
    assert json.loads(path.read_text("utf-8")) == doc  # not overwritten
    row = json.dumps(
        {"run_id": "r", "round": 1, "nonce": "00", "unit": "client", "placement": "local",
         "scheme": "none", "noise_multiplier": 1, "own_noise_multiplier": 1, "time": "t"}
    ).replace('"noise_multiplier": 1', '"noise_multiplier": 1' + "0" * 400)  # fmt: skip
    head = '{"format": "fl-secure site ledger", '
    for damaged, match in (
        (head + '"version": 1, "releases": [' + row + "]}", "'noise_multiplier' is not a finite"),
        ("[" * 100_000 + "]" * 100_000, "cannot be read"),
        (head + '"version": true, "releases": []}', "version True is unknown"),
    ):
        path.write_text(damaged, "utf-8")
        with pytest.raises(PrivacyError, match=match):
            SiteLedger(tmp_path)
        assert path.read_text("utf-8") == damaged


def test_a_client_level_config_without_its_calibrated_noise_is_refused() -> None:
    # a config file's 0 means "calibrate"; a server that sends it on would get bare updates
    config = config_from_dict(
        {"privacy": {"unit": "client", "noise_multiplier": 0.0, "target_epsilon": 4.0}}
    )
    with pytest.raises(PrivacyError, match="without a calibrated privacy.noise_multiplier"):
        ClientPrivacy(config, num_examples=10)


# ------------------------------------------------------------------ example level


def _example_config(**privacy: object) -> Config:
    return config_from_dict(
        {"partition": {"num_clients": 6}, "server": {"min_clients": 4, "max_retries": 1},
         "train": {"rounds": 100},
         "privacy": {"unit": "example", "noise_multiplier": 1.1, "sample_rate": 0.05,
                     **privacy}}
    )  # fmt: skip


def _opacus_prv(z: float, q: float, steps: int, delta: float) -> float:
    from opacus.accountants import PRVAccountant

    acc = PRVAccountant()
    acc.history = [(z, q, steps)]
    return float(acc.get_epsilon(delta, eps_error=0.01))


def test_example_epsilon_of_dpsgd_releases_matches_opacus_prv(tmp_path: Path) -> None:
    # Prepare: three rounds of 40 DP-SGD steps at z = 1.1, q = 0.05, one untrained release
    config = _example_config()
    site = SiteLedger(tmp_path)
    for round_ in (1, 2, 3):
        site.record(config, "run", round_, bytes([round_]) * 16, (1.1, 0.05, 40))
    site.record(config, "run", 4, b"\4" * 16, (1.1, 0.05, 0))  # the unchanged parameters
    # Assert: the PLD composition agrees with Opacus' PRV accountant (another numerical
    # method) over the same 120 steps; the untrained release costs nothing; it survives
    # a restart, and the client-level figure is unbounded (no client-level noise)
    reference = _opacus_prv(1.1, 0.05, 120, 1e-5)
    assert site.example_epsilon() == pytest.approx(reference, rel=0.02)
    again = SiteLedger(tmp_path)
    assert again.example_epsilon() == site.example_epsilon()
    assert again.summary()["dpsgd_steps"] == 120
    assert again.epsilon() == math.inf


def test_a_client_level_release_counts_for_one_image_at_twice_the_sensitivity(
    tmp_path: Path,
) -> None:
    # Prepare: five client-level releases with z = 3 (local noise)
    config = _config(noise_multiplier=3.0)
    site = SiteLedger(tmp_path)
    for round_ in range(1, 6):
        site.record(config, "run", round_, bytes([round_]) * 16)
    # Assert: one image moves the clipped update by up to 2 C: five discrete Gaussians of
    # z / 2, by their zCDP bound
    assert site.example_epsilon() == pytest.approx(_zcdp_epsilon([1.5] * 5, 1e-5), abs=1e-4)
    # the site's own figure (its whole update present or zeroed: sensitivity C) is smaller
    assert site.example_epsilon() > site.epsilon()
    # a non-private release makes it unbounded
    site.record(config_from_dict({}), "run-b", 1, b"b" * 16)
    assert site.example_epsilon() == math.inf


def test_a_version_1_ledger_is_read_and_its_example_rows_count_as_unbounded(
    tmp_path: Path,
) -> None:
    # Prepare: a version 1 file (before the DP-SGD fields) with a client and an example row
    row = {"run_id": "r", "round": 1, "nonce": "00", "unit": "client", "placement": "local",
           "scheme": "none", "noise_multiplier": 2.0, "own_noise_multiplier": 2.0,
           "time": "2026-11-01T00:00:00+00:00"}  # fmt: skip
    doc = {"format": "fl-secure site ledger", "version": 1, "releases": [row]}
    (tmp_path / FILE_NAME).write_text(json.dumps(doc), "utf-8")
    # Assert: read as it was; the client row counts at z / 2 for one image
    site = SiteLedger(tmp_path)
    assert site.epsilon() == pytest.approx(_zcdp_epsilon([2.0], 1e-5), abs=1e-4)
    assert site.example_epsilon() == pytest.approx(_zcdp_epsilon([1.0], 1e-5), abs=1e-4)
    # an example row of version 1 did not record its steps: unbounded, not zero
    doc["releases"] = [row, {**row, "round": 2, "unit": "example", "noise_multiplier": 0.0,
                             "own_noise_multiplier": 0.0}]  # fmt: skip
    (tmp_path / FILE_NAME).write_text(json.dumps(doc), "utf-8")
    assert SiteLedger(tmp_path).example_epsilon() == math.inf
    # the next save writes version 2 rows
    site = SiteLedger(tmp_path)
    site.record(_example_config(), "r2", 1, b"x" * 16, (1.1, 0.05, 10))
    saved = json.loads((tmp_path / FILE_NAME).read_text("utf-8"))
    assert saved["version"] == 2 and saved["releases"][1]["dpsgd_steps"] == -1
    assert saved["releases"][2]["dpsgd_steps"] == 10


def test_the_example_budget_declines_rounds_the_reference_would_pass(tmp_path: Path) -> None:
    # Prepare: an example budget of 3 at delta 1e-5; each round plans 50 steps, z 1.1, q 0.05
    config = _example_config()
    site = SiteLedger(tmp_path, max_example_epsilon=3.0)
    site.check_run(config, "run")  # an example-level run is joined (max_epsilon refuses it)
    plan = (1.1, 0.05, 50)
    # Execute: rounds until the site declines one
    for round_ in range(1, 50):
        refusal = site.refusal(config, "run", round_, bytes([round_]) * 16, last_round=0,
                               dpsgd=plan)  # fmt: skip
        if refusal:
            break
        site.record(config, "run", round_, bytes([round_]) * 16, plan)
    # Assert: the releases kept the budget and one more would have passed it, by the
    # reference too (Opacus PRV, to its tolerance)
    done = len(site.releases)
    assert done >= 2
    assert "example-level epsilon (one training image)" in refusal
    assert "above its budget of 3" in refusal
    assert site.example_epsilon() <= 3.0
    assert _opacus_prv(1.1, 0.05, 50 * done, 1e-5) <= 3.0 * 1.02
    assert _opacus_prv(1.1, 0.05, 50 * (done + 1), 1e-5) > 3.0 * 0.98
    # a smaller round still fits if the budget allows it: the plan, not a fixed cost
    assert site.refusal(config, "run", 90, b"s" * 16, last_round=0, dpsgd=(1.1, 0.05, 1)) == ""


@pytest.mark.parametrize(
    ("privacy", "match"),
    [
        ({"unit": "none"}, "privacy.unit 'none'"),
        ({"unit": "client", "noise_placement": "central"}, "central noise"),
        ({"unit": "client", "noise_multiplier": 0.0, "target_epsilon": 4.0}, "without a calib"),
        ({"unit": "client", "noise_multiplier": 0.1}, "example-level epsilon"),
    ],
)
def test_an_example_budget_refuses_a_run_without_noise_against_the_server(
    tmp_path: Path, privacy: dict[str, object], match: str
) -> None:
    config = config_from_dict({"privacy": {"noise_multiplier": 1.0, **privacy}})
    with pytest.raises(PrivacyError, match=match):
        SiteLedger(tmp_path, max_example_epsilon=2.0).check_run(config)
    SiteLedger(tmp_path, max_example_epsilon=2.0).check_run(_config(noise_multiplier=5.0))
    with pytest.raises(PrivacyError, match="example-level budget must be a number > 0"):
        SiteLedger(tmp_path, max_example_epsilon=0.0)
    with pytest.raises(PrivacyError, match="needs a state folder"):
        SiteLedger(None, max_example_epsilon=1.0)


def test_an_example_release_without_its_steps_counts_as_unbounded(tmp_path: Path) -> None:
    # a release (or a plan) that came without its DP-SGD figures is never taken as free
    config = _example_config()
    site = SiteLedger(tmp_path, max_example_epsilon=50.0)
    refusal = site.refusal(config, "run", 1, b"a" * 16, last_round=0)  # no plan given
    assert "example-level epsilon (one training image) to inf" in refusal
    assert site.record(config, "run", 1, b"a" * 16).dpsgd_steps == -1  # type: ignore[union-attr]
    assert site.example_epsilon() == math.inf
    # the unchanged parameters (0 steps) are free
    free = SiteLedger(tmp_path / "free")
    free.record(config, "run", 1, b"a" * 16, (1.1, 0.05, 0))
    assert free.example_epsilon() == 0.0
