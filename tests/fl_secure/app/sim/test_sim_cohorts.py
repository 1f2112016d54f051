"""Cohorts follow the config and come from the CSPRNG; a private head survives skipped rounds."""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load

import server.membership as membership_module
from fl_secure.app.sim.engine import SimulationEngine
from fl_secure.app.sim.executor import (
    PRIVATE_KEY,
    ClientJob,
    ClientResult,
    SerialExecutor,
    VirtualClientWorker,
)
from fl_secure.app.sim.server_side import SimServer
from fl_secure.config import Config, load_config
from fl_secure.data.plan import plan_client_id
from tests.fl_secure.app.sim.tiny import tiny_toml


def _toml(algorithm: str, rounds: int) -> str:
    train = {"rounds": rounds, "local_steps": 2, "batch_size": 4, "lr": 0.05}
    return tiny_toml(name="cohorts", seed=5, identities=54, clients=24, algorithm=algorithm,
                     train=train, server={"min_clients": 1})  # fmt: skip


def _config(tmp_path: Path, overrides: list[str], algorithm: str = "fedavg", rounds: int = 3):
    path = tmp_path / "cohorts.toml"
    path.write_text(_toml(algorithm, rounds))
    return load_config(path, overrides)


class CountingRandom(secrets.SystemRandom):
    """The CSPRNG Membership draws from, counted."""

    calls = 0  # uniforms (Poisson draws)
    samples = 0  # fixed-size draws

    def random(self) -> float:
        CountingRandom.calls += 1
        return super().random()

    def sample(self, population: Sequence[str], k: int, **kwargs: object) -> list[str]:  # type: ignore[override]
        CountingRandom.samples += 1
        return super().sample(population, k)


def test_fixed_size_cohorts_are_drawn_by_the_coordinators_csprng(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: Membership's secrets.SystemRandom, counted
    monkeypatch.setattr(membership_module.secrets, "SystemRandom", CountingRandom)
    CountingRandom.samples = 0
    server = SimServer(_config(tmp_path, ["server.clients_per_round=6"]), None)
    # Execute: 300 draws
    cohorts = [server.draw_cohort(1) for _ in range(300)]
    # Assert: 6 distinct clients each time, one CSPRNG sample per draw, every client drawn
    # about 6/24 of the time (binomial sd 0.025: 5 sd)
    assert all(len(c) == len(set(c)) == 6 for c in cohorts)
    assert CountingRandom.samples == 300
    rates = np.array([sum(plan_client_id(i) in c for c in cohorts) for i in range(24)]) / 300
    assert np.all(np.abs(rates - 0.25) < 0.125)
    assert len({tuple(c) for c in cohorts}) > 250  # 134,596 possible cohorts


def test_poisson_cohorts_include_each_client_at_the_sample_rate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(membership_module.secrets, "SystemRandom", CountingRandom)
    CountingRandom.calls = 0
    server = SimServer(_config(tmp_path, ["server.sample_rate=0.25"]), None)
    sizes = [len(server.draw_cohort(1)) for _ in range(400)]
    # one CSPRNG uniform per client and draw; sizes Binomial(24, 0.25): mean 6, sd 2.12
    assert CountingRandom.calls == 400 * 24
    assert abs(np.mean(sizes) - 6.0) < 5 * 2.12 / np.sqrt(400)
    assert min(sizes) < 6 < max(sizes)  # the size varies, as Poisson sampling's does


class Recording(SerialExecutor):
    """A serial executor that keeps every job and result."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.log: list[tuple[ClientJob, ClientResult]] = []

    def map(self, jobs: Sequence[ClientJob]) -> list[ClientResult]:
        results = super().map(jobs)
        self.log.extend(zip(jobs, results, strict=True))
        return results


def test_a_private_head_survives_the_rounds_its_client_skips(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: FedPE (a private head per client), 6 of 24 a round; rounds 1 and 3 draw
    # clients 0-5, round 2 clients 6-11
    config = _config(tmp_path, ["server.clients_per_round=6"], algorithm="fedpe")
    schedule = {1: range(6), 2: range(6, 12), 3: range(6)}
    monkeypatch.setattr(
        SimServer, "draw_cohort", lambda self, n: [plan_client_id(i) for i in schedule[n]]
    )
    recorder: list[Recording] = []

    def factory(cfg: Config) -> Recording:
        recorder.append(Recording(cfg))
        return recorder[0]

    engine = SimulationEngine(config, executor=factory, evaluated=0)
    # Execute
    _, status = engine.run()
    log = [(j, r) for j, r in recorder[0].log if j.kind == "train"]
    # Assert: client-0 got back in round 3 exactly the state it returned in round 1, which
    # holds its trained head (not the one it was built with)
    assert status == "completed"
    (first, out1) = next((j, r) for j, r in log if j.client_id == "client-0" and j.round == 1)
    (third, out3) = next((j, r) for j, r in log if j.client_id == "client-0" and j.round == 3)
    assert first.state == {} and PRIVATE_KEY in out1.state
    assert third.state == out1.state
    head = load(out1.state[PRIVATE_KEY])
    fresh = VirtualClientWorker(config).trainer(0)
    built_with = fresh.model.state_dict()
    assert set(head) and all(name in built_with for name in head)
    assert any(not np.array_equal(head[k].numpy(), built_with[k].numpy()) for k in head)
    # ... and the carried head is the one round 3 trains from: without it the upload differs
    assert set(engine.carry) == {plan_client_id(i) for i in range(12)}
    again = VirtualClientWorker(config).run(third)  # reproducible: the same upload again
    assert all(np.array_equal(again.upload[k], v) for k, v in out3.upload.items())
    bare = VirtualClientWorker(config).run(
        ClientJob(third.client_id, 0, 3, third.sent, third.task, {})
    )
    same = OrderedDict((k, np.array_equal(again.upload[k], bare.upload[k])) for k in again.upload)
    assert not all(same.values())


def test_a_design_with_unsimulated_client_state_is_refused_only_with_sampled_cohorts(
    tmp_path: Path,
) -> None:
    from fl_secure.app.sim.server_side import check_engine
    from fl_secure.errors import ConfigError

    everyone = _config(tmp_path, ["partition.kind=domain"], algorithm="fedfr")
    check_engine(everyone)  # every client in every round: its pseudo labels are kept
    sampled = _config(tmp_path, ["partition.kind=domain", "server.clients_per_round=6"], "fedfr")
    with pytest.raises(ConfigError, match="'fedfr' with sampled cohorts: its target clients"):
        check_engine(sampled)
