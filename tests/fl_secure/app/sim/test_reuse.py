"""A worker's one reset model trains every virtual client bit for bit as a freshly built one.

:class:`fl_secure.app.sim.reuse.ModelPool` resets one model per job instead of building a
client's model; the uploads, metrics and carries (private heads, accountants) of several
rounds, the clients in a shuffled order each round, must equal those of workers that build
every client afresh (``reuse_models=False``), for FedAvg, FedPE (a private head drawn from
each client's own seed) and client-level DP.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from fl_secure.algorithms import get_strategy
from fl_secure.app.sim.executor import ClientJob, ClientResult, VirtualClientWorker
from fl_secure.app.sim.reuse import reusable
from fl_secure.config import Config, load_config
from fl_secure.data.plan import plan_client_id, plan_federation
from fl_secure.messages import LocalTraining
from fl_secure.training import build_run_model, get_tensors
from tests.fl_secure.app.sim.tiny import tiny_toml


def _toml(algorithm: str) -> str:
    return tiny_toml(name="reuse", seed=11, identities=22, clients=6, held_out=4,
                     algorithm=algorithm,
                     train={"rounds": 3, "local_epochs": 1, "batch_size": 4})  # fmt: skip


CLIENT_DP = """
[privacy]
unit = "client"
noise_placement = "distributed"
clip_norm = 1.0
noise_multiplier = 1.0
delta = 1e-3
secure_rng = false
[secure_aggregation]
scheme = "secagg+"
"""


def config_of(tmp_path: Path, algorithm: str, extra: str = "") -> Config:
    path = tmp_path / f"{algorithm}.toml"
    path.write_text(_toml(algorithm) + extra)
    return load_config(path)


def run_rounds(config: Config, *, reuse: bool, rounds: int = 3) -> list[ClientResult]:
    """Every client, every round, in a shuffled order; the carry and a moving global model."""
    a = config.algorithm
    strategy = get_strategy(a.name, a, head=config.model.head, scale=config.model.scale)
    plan = plan_federation(config)
    model = build_run_model(config, len(plan.train_identities), image_size=32)
    sent = get_tensors(model, strategy.shared_names(model))
    task = LocalTraining(local_epochs=1, batch_size=4, learning_rate=0.05)
    worker = VirtualClientWorker(config, reuse_models=reuse)
    assert (worker.models is not None) == reuse
    carry: dict[int, dict[str, bytes]] = {}
    results = []
    order = np.random.default_rng(3)
    for r in range(1, rounds + 1):
        for i in order.permutation(len(plan.clients)):
            job = ClientJob(plan_client_id(int(i)), int(i), r, sent, task, carry.get(int(i), {}))
            result = worker.run(job)
            carry[int(i)] = result.state
            results.append(result)
        # the next round's model: moved by the last upload, so that rounds differ
        sent = OrderedDict((k, v + 0.1 * results[-1].upload[k]) for k, v in sent.items())
    if reuse:
        assert worker.models is not None and worker.models.built == 1  # one model, reset
    return results


def assert_identical(a: list[ClientResult], b: list[ClientResult]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.client_id == y.client_id
        assert list(x.upload) == list(y.upload)
        for k in x.upload:
            assert x.upload[k].dtype == y.upload[k].dtype
            np.testing.assert_array_equal(x.upload[k], y.upload[k], strict=True)
        assert x.examples == y.examples and x.metrics == y.metrics
        assert x.state == y.state  # the carried bytes, bit for bit


@pytest.mark.parametrize(
    ("algorithm", "extra"), [("fedavg", ""), ("fedpe", ""), ("fedavg", CLIENT_DP)]
)
def test_reset_model_trains_as_a_fresh_one(tmp_path: Path, algorithm: str, extra: str) -> None:
    config = config_of(tmp_path, algorithm, extra)
    fresh = run_rounds(config, reuse=False)
    reused = run_rounds(config, reuse=True)
    assert_identical(reused, fresh)
    assert any(np.abs(v).sum() > 0 for v in reused[0].upload.values())  # it trained


def test_designs_with_outside_state_build_per_job(tmp_path: Path) -> None:
    for algorithm, expected in (("fedavg", True), ("fedpe", True), ("adafedfr", False)):
        config = config_of(tmp_path, algorithm)
        a = config.algorithm
        strategy = get_strategy(a.name, a, head=config.model.head, scale=config.model.scale)
        assert reusable(strategy, config) is expected
