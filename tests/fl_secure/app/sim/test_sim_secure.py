"""Secure aggregation and example-level DP in the engine, checked against what was uploaded."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant

import fl_secure.app.sim.secure as secure_module
from fl_secure.app.sim.engine import SimulationEngine
from fl_secure.app.sim.executor import ClientJob, ClientResult, SerialExecutor
from fl_secure.app.sim.server_side import SimServer
from fl_secure.app.simulated_run import write_simulated_run
from fl_secure.config import Config, load_config
from fl_secure.data.plan import plan_client_id
from fl_secure.errors import ConfigError, RoundAborted
from fl_secure.runs import RunDir, new_run_dir
from privacy.secagg.in_process import CohortSum
from privacy.secagg.stages import ADVERTISE, MASKED, UNMASK
from tests.fl_secure.app.sim.tiny import tiny_toml


def _toml(rounds: int) -> str:
    train = {"rounds": rounds, "local_steps": 1, "batch_size": 4, "lr": 0.05}
    return tiny_toml(name="secure", seed=9, identities=54, clients=24, train=train,
                     server={"min_clients": 2})  # fmt: skip


def _config(tmp_path: Path, overrides: list[str], rounds: int = 1) -> Config:
    path = tmp_path / "secure.toml"
    path.write_text(_toml(rounds))
    return load_config(path, overrides)


class Recording(SerialExecutor):
    """A serial executor that keeps every training job's result."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.log: list[tuple[ClientJob, ClientResult]] = []

    def map(self, jobs: Sequence[ClientJob]) -> list[ClientResult]:
        results = super().map(jobs)
        self.log.extend((j, r) for j, r in zip(jobs, results, strict=True) if j.kind == "train")
        return results


def _scheduled(monkeypatch: pytest.MonkeyPatch, schedule: dict[int, list[int]]) -> None:
    monkeypatch.setattr(
        SimServer, "draw_cohort", lambda self, n: [plan_client_id(i) for i in schedule[n]]
    )


def test_a_secure_round_releases_the_mean_of_its_survivors_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: SecAgg among clients 0-7 (t = 4); client-1 drops before advertising, client-2
    # after its masked input (so it is in the sum), client-3 before sending its masked input
    config = _config(tmp_path, ["secure_aggregation.scheme=secagg"])
    _scheduled(monkeypatch, {1: list(range(8))})
    drops = {"client-1": ADVERTISE, "client-2": UNMASK, "client-3": MASKED}
    monkeypatch.setattr(secure_module, "injected_dropouts", lambda *a, **k: dict(drops))
    executors: list[Recording] = []
    engine = SimulationEngine(
        config, executor=lambda cfg: executors.append(Recording(cfg)) or executors[0], evaluated=0
    )
    initial = engine.server.state.params
    # Execute
    record = engine.train_round(1)
    # Assert: the survivors are the cohort without the clients that left before masking, and
    # the new model is w + their mean update, to the fixed-point precision (2^-20 a value)
    survivors = record["secure_aggregation"]["survivors"]
    assert sorted(survivors) == sorted(plan_client_id(i) for i in (0, 2, 4, 5, 6, 7))
    assert record["secure_aggregation"]["scheme"] == "secagg"
    assert sorted(record["clients"]) == sorted(survivors)
    # the fixed-point encoding clips each value to +-clip_range, as over gRPC
    bound = config.secure_aggregation.clip_range
    uploads = {
        r.client_id: {k: np.clip(v.astype(np.float64), -bound, bound) for k, v in r.upload.items()}
        for _, r in executors[0].log
    }
    assert len(uploads) == 8
    for name, value in engine.server.state.params.items():
        mean = np.mean([uploads[c][name] for c in survivors], axis=0)
        everyone = np.mean([u[name] for u in uploads.values()], axis=0)
        np.testing.assert_allclose(value, initial[name] + mean, rtol=0, atol=2e-6)
        if np.abs(mean - everyone).max() > 1e-4:  # the dropped clients' updates are not in it
            assert np.abs(value - (initial[name] + everyone)).max() > 1e-5


def test_ckks_is_refused_with_its_reason(tmp_path: Path) -> None:
    config = _config(tmp_path, ["secure_aggregation.scheme=ckks"])
    with pytest.raises(ConfigError, match="'ckks' is not simulated"):
        SimServer(config, None)


def test_a_dpsgd_clients_accountant_is_carried_between_its_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: example-level DP-SGD (q = 0.5, z = 1.2, PLD), client-0 and client-1 in rounds 1
    # and 3, others in round 2
    overrides = [
        "privacy.unit=example",
        "privacy.noise_multiplier=1.2",
        "privacy.clip_norm=1.0",
        "privacy.sample_rate=0.5",
        "privacy.accountant=pld",
        "privacy.delta=1e-5",
    ]
    config = _config(tmp_path, overrides, rounds=3)
    _scheduled(monkeypatch, {1: [0, 1], 2: [2, 3], 3: [0, 1]})
    # Execute
    run = write_simulated_run(config, tmp_path / "runs")
    # Assert: client-0's epsilon in round 3 composes the DP-SGD steps of both its rounds, as
    # dp_accounting's PLD of that many Poisson-subsampled Gaussian steps says
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first, third = records[1]["clients"]["client-0"], records[3]["clients"]["client-0"]
    steps = int(first["dp_steps"] + third["dp_steps"])
    pld = pld_privacy_accountant.PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    )
    pld.compose(dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(1.2)), steps)
    assert third["dp_epsilon"] == pytest.approx(pld.get_epsilon(1e-5), rel=1e-6)
    assert third["dp_epsilon"] > first["dp_epsilon"] > 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["privacy_unit"] == "example"
    assert summary["privacy"]["clients_epsilon"]["client-0"] == pytest.approx(third["dp_epsilon"])
    assert RunDir(run).path == run and (run / "ledger.sqlite").exists()


def test_a_secure_round_aborted_after_unmasking_is_counted_like_a_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: local noise under SecAgg (the guarantee covers the server's view), and rounds
    # whose sum is unmasked and then cannot be decoded; one retry
    overrides = [
        "secure_aggregation.scheme=secagg",
        "privacy.unit=client",
        "privacy.noise_placement=local",
        "privacy.noise_multiplier=2.0",
        "privacy.clip_norm=0.5",
        "server.max_retries=1",
    ]
    config = _config(tmp_path, overrides)
    _scheduled(monkeypatch, {1: list(range(4))})
    unmasked = CohortSum(None, (), "the sum could not be decoded", {"seconds.unmask": 0.1})
    monkeypatch.setattr(secure_module, "run_cohort_round", lambda *a, **k: unmasked)
    run = RunDir(new_run_dir(tmp_path, "aborted"))
    engine = SimulationEngine(config, run_dir=run, evaluated=0)
    # Execute: both attempts abort after the server saw their sums
    with pytest.raises(RoundAborted, match="every attempt failed"):
        engine.train_round(1)
    # Assert: each attempt's sum is in the ledger as a discarded sum, composed like a round
    kinds = [e.kind for e in engine.server.privacy.ledger.entries()]  # type: ignore[union-attr]
    assert kinds == ["discarded_sum", "discarded_sum"]
    assert engine.server.privacy.discarded_sums == 2  # type: ignore[union-attr]
    assert engine.server.privacy.epsilon > 0  # type: ignore[union-attr]


def test_injected_dropouts_take_the_configured_fraction_reproducibly() -> None:
    cohort = [plan_client_id(i) for i in range(10)]
    drops = secure_module.injected_dropouts(3, 2, 0, cohort, 0.3)
    assert len(drops) == 3 and set(drops) <= set(cohort)
    assert all(ADVERTISE <= stage <= UNMASK for stage in drops.values())
    assert secure_module.injected_dropouts(3, 2, 0, cohort, 0.3) == drops  # same round: same
    assert secure_module.injected_dropouts(3, 2, 0, cohort, 0.0) == {}
