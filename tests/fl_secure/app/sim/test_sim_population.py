"""A population of 10,000 virtual clients costs what its cohorts cost, not 10,000 clients.

The data plan is the one thing every client needs; here 10,000 plan entries point at the
shares of a 20-client plan (the synthetic generator would take minutes for 10,000
identities), so the test measures the engine alone: how many clients it builds, how many stay
alive, and what the driver keeps between rounds.
"""

from __future__ import annotations

import dataclasses
import gc
import pickle
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import fl_secure.app.sim.executor as executor_module
import fl_secure.app.sim.server_side as server_side
from fl_secure.app.sim.engine import SimulationEngine
from fl_secure.app.sim.executor import ClientJob, SerialExecutor
from fl_secure.config import load_config
from fl_secure.data.plan import plan_federation
from tests.fl_secure.app.sim.tiny import tiny_toml

if TYPE_CHECKING:
    from fl_secure.config import Config

POPULATION, SHARES, COHORT, ROUNDS, EVALUATED = 10_000, 20, 5, 2, 3


def _toml(clients: int) -> str:
    train = {"rounds": 2, "local_steps": 1, "batch_size": 4, "lr": 0.05}
    return tiny_toml(name="population", seed=11, identities=50, clients=clients, train=train,
                     server={"min_clients": 2, "clients_per_round": 5})  # fmt: skip


def _config(tmp_path: Path, clients: int) -> Config:
    path = tmp_path / f"population-{clients}.toml"
    path.write_text(_toml(clients))
    return load_config(path)


def test_ten_thousand_virtual_clients_build_only_their_cohorts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a 10,000-client plan whose entries share the 20 shares of a small plan, and a
    # record of every client the workers build
    small = plan_federation(_config(tmp_path, SHARES))
    big = dataclasses.replace(small, clients=[small.clients[i % SHARES] for i in range(POPULATION)])
    monkeypatch.setattr(server_side, "plan_population", lambda config: big)
    monkeypatch.setattr(executor_module, "plan_population", lambda config: big)
    built: list[int] = []
    alive: weakref.WeakSet[object] = weakref.WeakSet()
    original = executor_module.build_local_trainer

    def counted(*args: object, **kwargs: object) -> object:
        trainer = original(*args, **kwargs)  # type: ignore[arg-type]
        built.append(1)
        alive.add(trainer)
        return trainer

    monkeypatch.setattr(executor_module, "build_local_trainer", counted)
    config = _config(tmp_path, POPULATION)
    # Execute: two rounds of 5 drawn clients, 3 clients scoring the model before and after
    engine = SimulationEngine(config, evaluated=EVALUATED)
    records, status = engine.run()
    gc.collect()
    # Assert: one client built per job (5 a round, 3 evaluations twice), none kept alive,
    # none of the 10,000 built otherwise; FedAvg clients carry nothing between rounds
    assert status == "completed" and engine.server.population == POPULATION
    assert engine.cohort_sizes == [COHORT] * ROUNDS
    assert len(built) == COHORT * ROUNDS + EVALUATED == 13
    engine.evaluate_clients()
    assert len(built) == COHORT * ROUNDS + 2 * EVALUATED
    gc.collect()
    assert len(alive) == 0
    assert engine.carry == {}
    assert isinstance(engine.executor, SerialExecutor)
    assert engine.executor.worker.kept == {}
    assert [r["round"] for r in records] == [0, 1, 2]


def test_jobs_and_results_are_plain_picklable_data(tmp_path: Path) -> None:
    # Prepare: a worker of the 20-client plan, as a Ray actor would hold one
    config = _config(tmp_path, SHARES)
    engine = SimulationEngine(config, evaluated=0)
    job = engine._job("client-3", 1, engine.server.state.rules.training_for(1))
    # Execute: the job and its result through pickle, as to another process and back
    moved = pickle.loads(pickle.dumps(job))
    result = engine.executor.map([moved])[0]
    back = pickle.loads(pickle.dumps(result))
    # Assert: the same upload, bit for bit, and the job's fields as sent
    assert isinstance(moved, ClientJob) and moved.index == 3 and moved.round == 1
    assert list(back.upload) == list(result.upload) == list(engine.server.state.params)
    for name, value in result.upload.items():
        assert back.upload[name].tobytes() == value.tobytes()
    assert back.examples == len(engine.server.plan.clients[3].train)
