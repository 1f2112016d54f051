"""The Ray executor runs the serial executor's jobs bit for bit, and says how to install Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fl_secure.algorithms import get_strategy
from fl_secure.app.cli import main
from fl_secure.app.sim.executor import ClientJob, SerialExecutor
from fl_secure.app.sim.ray_executor import INSTALL_HINT, RayExecutor
from fl_secure.checkpoints import CheckpointStore
from fl_secure.config import Config, load_config
from fl_secure.data.plan import plan_client_id, plan_federation
from fl_secure.errors import ConfigError
from fl_secure.messages import LocalTraining
from fl_secure.training import build_run_model, get_tensors
from tests.fl_secure.app.sim.tiny import tiny_toml


def _toml(algorithm: str) -> str:
    return tiny_toml(name="tiny-ray", seed=5, identities=20, clients=5, held_out=4,
                     algorithm=algorithm,
                     train={"rounds": 2, "local_epochs": 1, "batch_size": 4})  # fmt: skip


def tiny(tmp_path: Path, algorithm: str = "fedavg") -> Config:
    path = tmp_path / f"{algorithm}.toml"
    path.write_text(_toml(algorithm))
    return load_config(path)


def jobs_of(config: Config, *, rounds: int = 1) -> list[ClientJob]:
    """Every client's job of round 1 (the global model of the config's seed), in order."""
    a = config.algorithm
    strategy = get_strategy(a.name, a, head=config.model.head, scale=config.model.scale)
    plan = plan_federation(config)
    model = build_run_model(config, len(plan.train_identities), image_size=32)
    sent = get_tensors(model, strategy.shared_names(model))
    task = LocalTraining(local_epochs=1, batch_size=4, learning_rate=0.05)
    return [
        ClientJob(plan_client_id(i), i, r, sent, task, {})
        for r in range(1, rounds + 1)
        for i in range(len(plan.clients))
    ]


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    """One embedded Ray for the module (starting one takes seconds)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow  # each executor starts Ray worker processes that import torch
def test_ray_and_serial_executors_give_bit_identical_uploads(
    tmp_path: Path, ray_session: None
) -> None:
    # Prepare: a tiny seeded federation and round 1's jobs of its 5 clients
    config = tiny(tmp_path)
    jobs = jobs_of(config)
    # Execute: the same jobs here, and on 2 Ray actors (they finish out of order)
    serial = SerialExecutor(config).map(jobs)
    executor = RayExecutor(config, num_workers=2)
    try:
        over_ray = executor.map(jobs)
    finally:
        executor.close()
    # Assert: in job order, the same counts and every uploaded tensor equal bit for bit
    assert [r.client_id for r in over_ray] == [j.client_id for j in jobs]
    assert [r.examples for r in over_ray] == [r.examples for r in serial]
    for ours, theirs in zip(over_ray, serial, strict=True):
        assert list(ours.upload) == list(theirs.upload) and ours.upload
        for name, value in theirs.upload.items():
            assert ours.upload[name].dtype == value.dtype
            assert np.array_equal(ours.upload[name], value), (ours.client_id, name)
        assert ours.metrics == theirs.metrics
        assert ours.state == theirs.state
    # and training moved the model: the uploads are not the global model sent
    sent = jobs[0].sent
    assert any(not np.array_equal(serial[0].upload[k], sent[k]) for k in sent)


@pytest.mark.slow
def test_ray_actors_train_batches_of_clients_together(tmp_path: Path, ray_session: None) -> None:
    # Prepare: 10 jobs (5 clients, 2 rounds of one model), batches of up to 3 per actor call
    config = tiny(tmp_path)
    jobs = jobs_of(config, rounds=2)
    serial = SerialExecutor(config).map(jobs)  # one at a time
    executor = RayExecutor(config, num_workers=2, client_batch=3)
    try:
        over_ray = executor.map(jobs)
    finally:
        executor.close()
    # Assert: in job order, equal to the one-at-a-time uploads to float tolerance
    assert [r.client_id for r in over_ray] == [j.client_id for j in jobs]
    for ours, theirs in zip(over_ray, serial, strict=True):
        scale = max(float(np.abs(v).max()) for v in theirs.upload.values())
        for name, value in theirs.upload.items():
            np.testing.assert_allclose(ours.upload[name], value, rtol=0, atol=1e-4 * scale)
        assert ours.metrics["train_loss"] == pytest.approx(theirs.metrics["train_loss"], rel=1e-4)
    assert any(not np.array_equal(o.upload[k], t.upload[k])  # vectorised: not the same sums
               for o, t in zip(over_ray, serial, strict=True) for k in o.upload)  # fmt: skip


@pytest.mark.slow
def test_kept_trainers_stay_on_their_actor(tmp_path: Path, ray_session: None) -> None:
    # Prepare: FedPer-style private state kept in each worker's clients (keep_trainers)
    config = tiny(tmp_path, "fedpe")
    jobs = jobs_of(config, rounds=2)
    # Execute: both rounds' jobs, kept trainers here and on 2 actors (client i on actor i % 2)
    serial = SerialExecutor(config, keep_trainers=True).map(jobs)
    executor = RayExecutor(config, num_workers=2, keep_trainers=True)
    try:
        over_ray = executor.map(jobs)
    finally:
        executor.close()
    # Assert: round 2 trained on round 1's private layers in both: the same uploads
    for ours, theirs in zip(over_ray, serial, strict=True):
        for name, value in theirs.upload.items():
            assert np.array_equal(ours.upload[name], value), (ours.client_id, name)


@pytest.mark.slow
def test_a_worker_error_comes_back_as_its_own_class(tmp_path: Path, ray_session: None) -> None:
    # Prepare: a job for a client the plan does not have
    config = tiny(tmp_path)
    job = jobs_of(config)[0]
    bad = ClientJob("client-999", 999, 1, job.sent, job.task, {})
    executor = RayExecutor(config, num_workers=1)
    try:
        # Execute / Assert: the worker's ConfigError, with its message, in the driver
        with pytest.raises(ConfigError, match="virtual client 999 is outside the plan"):
            executor.map([job, bad])
        # and the executor goes on: an empty cohort, then the good job alone
        assert executor.map([]) == []
        assert [r.client_id for r in executor.map([job])] == [job.client_id]
    finally:
        executor.close()


def test_missing_ray_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: `import ray` fails as it does where Ray is not installed
    monkeypatch.setitem(sys.modules, "ray", None)
    # Execute / Assert: a ConfigError that names the pip extra
    with pytest.raises(ConfigError, match=r"not installed.*pip install 'fl-secure\[sim\]'"):
        RayExecutor(tiny(tmp_path))
    assert INSTALL_HINT == "pip install 'fl-secure[sim]'"


def test_no_worker_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at least 1 worker, got 0"):
        RayExecutor(tiny(tmp_path), num_workers=0)


@pytest.mark.slow
def test_simulate_command_on_ray_gives_the_serial_model(tmp_path: Path) -> None:
    # Prepare: a seeded federation of 5 virtual clients, every client in every round (a
    # sampled cohort is drawn from the CSPRNG, so two runs differ), FedPer-style private
    # layers kept on their client's actor, no DP, no SecAgg
    path = tmp_path / "tiny.toml"
    path.write_text(_toml("fedpe"))
    # Execute: `fl-secure simulate` with the serial backend here, the Ray backend in a process
    assert main(["simulate", "--config", str(path), "--out", str(tmp_path / "serial"),
                 "--json", "--quiet"]) == 0  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "fl_secure.app.cli", "simulate", "--config", str(path),
         "--backend", "ray", "--workers", "2", "--out", str(tmp_path / "ray"), "--json"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    # Assert: both completed both rounds with the same model, bit for bit, and its scores
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2
    (serial_run,) = (tmp_path / "serial").iterdir()
    ray_run = Path(summary["run_dir"])
    ours = CheckpointStore(ray_run / "checkpoints").latest()
    theirs = CheckpointStore(serial_run / "checkpoints").latest()
    assert ours is not None and theirs is not None and ours.round == theirs.round == 2
    assert list(ours.parameters) == list(theirs.parameters)
    for name, value in theirs.parameters.items():
        assert np.array_equal(ours.parameters[name], value), name
    assert summary["held_out"] == json.loads((serial_run / "summary.json").read_text())["held_out"]


def test_ray_flags_need_the_ray_backend(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(_toml("fedavg"))
    code = main(["simulate", "--config", str(path), "--workers", "2", "--out", str(tmp_path)])
    assert code == 2
    assert "--workers need --backend ray" in capsys.readouterr().err
    assert not any(tmp_path.glob("*/summary.json"))  # refused before anything ran


def test_simulate_without_ray_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(_toml("fedavg"))
    monkeypatch.setitem(sys.modules, "ray", None)
    code = main(["simulate", "--config", str(path), "--backend", "ray", "--out", str(tmp_path)])
    assert code == 2
    assert "pip install 'fl-secure[sim]'" in capsys.readouterr().err
