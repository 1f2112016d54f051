"""Virtual clients trained together equal the same clients trained one at a time.

:meth:`VirtualClientWorker.run_many` with ``client_batch`` > 1 runs the local objective of a
batch of jobs in one vectorised pass (:mod:`fl_secure.app.sim.vectorized`) and the rest of
each client's round (update, client-level DP, carry) with the client's own code. Its uploads
and metrics must equal :meth:`VirtualClientWorker.run`'s for the same jobs, to float tolerance
(batched convolutions sum in another order), over several rounds of a moving global model,
for FedAvg with SGD + momentum + weight decay, with Adam, with several local steps per round
(a batch order redrawn mid-round), and under client-level DP with seeded noise; designs with
their own objective (FedPE's private head) keep the one-at-a-time path, bit for bit.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from fl_secure.algorithms import get_strategy
from fl_secure.app.sim.executor import ClientJob, ClientResult, VirtualClientWorker
from fl_secure.app.sim.vectorized import vectorizable
from fl_secure.config import Config, load_config
from fl_secure.data.plan import plan_client_id, plan_federation
from fl_secure.messages import LocalTraining
from fl_secure.models.heads import margin_logits
from fl_secure.training import build_run_model, get_tensors
from tests.fl_secure.app.sim.test_reuse import CLIENT_DP
from tests.fl_secure.app.sim.tiny import tiny_toml


def config_of(
    tmp_path: Path, algorithm: str = "fedavg", extra: str = "", **train: object
) -> Config:
    text = tiny_toml(name="vectorized", seed=5, identities=22, clients=6, held_out=4,
                     algorithm=algorithm,
                     train={"rounds": 2, "local_epochs": 1, "batch_size": 4, **train})  # fmt: skip
    path = tmp_path / f"{algorithm}.toml"
    path.write_text(text + extra)
    return load_config(path)


def rounds(config: Config, task: LocalTraining, *, batch: int, n: int = 3) -> tuple[
    list[ClientResult], VirtualClientWorker
]:  # fmt: skip
    """Every client each round through ``run_many``; the next model moved by the mean upload."""
    a = config.algorithm
    strategy = get_strategy(a.name, a, head=config.model.head, scale=config.model.scale)
    plan = plan_federation(config)
    model = build_run_model(config, len(plan.train_identities), image_size=32)
    sent = get_tensors(model, strategy.shared_names(model))
    worker = VirtualClientWorker(config, client_batch=batch)
    carry: dict[int, dict[str, bytes]] = {}
    out: list[ClientResult] = []
    for r in range(1, n + 1):
        jobs = [ClientJob(plan_client_id(i), i, r, sent, task, carry.get(i, {}))
                for i in range(len(plan.clients))]  # fmt: skip
        results = worker.run_many(jobs)
        assert [x.client_id for x in results] == [j.client_id for j in jobs]
        for i, x in enumerate(results):
            carry[i] = x.state
        out.extend(results)
        mean = {k: np.mean([x.upload[k] for x in results], axis=0) for k in sent}
        sent = OrderedDict((k, (v + mean[k]).astype(v.dtype)) for k, v in sent.items())
    return out, worker


def assert_close(a: list[ClientResult], b: list[ClientResult]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.client_id == y.client_id and x.examples == y.examples
        assert list(x.upload) == list(y.upload)
        # float noise, relative to the update's largest entry: measured <= 4e-6 in round 1,
        # growing over rounds as every client's start moves with the others' updates
        scale = max(float(np.abs(v).max()) for v in y.upload.values())
        for k in x.upload:
            np.testing.assert_allclose(x.upload[k], y.upload[k], rtol=0, atol=1e-4 * scale)
        assert x.metrics.keys() == y.metrics.keys()
        for k in x.metrics:
            assert x.metrics[k] == pytest.approx(y.metrics[k], rel=1e-4, abs=1e-5), k
        assert x.state.keys() == y.state.keys()


TASK = LocalTraining(local_epochs=1, batch_size=4, learning_rate=0.05, momentum=0.9,
                     weight_decay=5e-4)  # fmt: skip


def test_fedavg_clients_trained_together_match_one_at_a_time(tmp_path: Path) -> None:
    config = config_of(tmp_path)
    single, _ = rounds(config, TASK, batch=1)
    together, worker = rounds(config, TASK, batch=4)
    assert worker.trained_together == len(together)  # 6 clients: a batch of 4, one of 2
    assert_close(together, single)
    moved = [np.abs(x.upload[k]).max() for x in single for k in x.upload]
    assert max(moved) > 1e-3  # the clients did train


def test_several_steps_and_a_redrawn_batch_order(tmp_path: Path) -> None:
    config = config_of(tmp_path)
    task = LocalTraining(local_steps=5, batch_size=3, learning_rate=0.05)  # 7 images: redrawn
    single, _ = rounds(config, task, batch=1, n=2)
    together, worker = rounds(config, task, batch=6, n=2)
    assert worker.trained_together == len(together)
    assert_close(together, single)


def test_adam(tmp_path: Path) -> None:
    """Adam's step (element-wise, like SGD's) over the stacked parameters.

    Adam's first step is ``lr * g / (|g| + eps)``: about ``lr * sign(g)``, so an entry whose
    gradient is float noise around 0 may flip sign between the two paths. Every other entry
    must agree to float tolerance, and a flipped one by at most two steps.
    """
    config = config_of(tmp_path)
    lr = 0.001
    task = LocalTraining(local_steps=1, batch_size=4, learning_rate=lr, optimizer="adam")
    single, _ = rounds(config, task, batch=1, n=1)
    together, worker = rounds(config, task, batch=6, n=1)
    assert worker.trained_together == len(together)
    for x, y in zip(together, single, strict=True):
        a = np.concatenate([v.ravel() for v in x.upload.values()])
        b = np.concatenate([v.ravel() for v in y.upload.values()])
        off = np.abs(a - b) > 1e-4 * lr
        assert off.mean() < 5e-3, off.mean()
        assert np.abs(a - b).max() <= 2 * lr * 1.0001
        assert x.metrics["train_loss"] == pytest.approx(y.metrics["train_loss"], rel=1e-5)


def test_client_level_dp_uploads_match(tmp_path: Path) -> None:
    config = config_of(tmp_path, extra=CLIENT_DP)
    single, _ = rounds(config, TASK, batch=1, n=2)
    together, worker = rounds(config, TASK, batch=3, n=2)
    assert worker.trained_together == len(together)
    assert_close(together, single)  # clipped, and the same seeded noise added


def test_a_private_head_design_runs_one_at_a_time(tmp_path: Path) -> None:
    """FedPE's head is not sent: the clients do not start from one model, nothing stacks."""
    config = config_of(tmp_path, "fedpe")
    single, _ = rounds(config, TASK, batch=1, n=2)
    together, worker = rounds(config, TASK, batch=4, n=2)
    assert worker.trained_together == 0
    for x, y in zip(together, single, strict=True):  # the same code path: bit for bit
        for k in x.upload:
            np.testing.assert_array_equal(x.upload[k], y.upload[k])


def test_designs_with_their_own_objective_are_not_vectorised(tmp_path: Path) -> None:
    for name in ("hfmaml", "hfmaml-global", "adafedfr", "fedaffect", "fedfr"):
        config = config_of(tmp_path, name)
        a = config.algorithm
        assert not vectorizable(get_strategy(a.name, a, head=config.model.head), config), name
    config = config_of(tmp_path, "fedavg", extra=CLIENT_DP)
    a = config.algorithm
    assert vectorizable(get_strategy(a.name, a, head=config.model.head), config)


def test_margin_mask_by_scatter_equals_one_hot() -> None:
    """The margin's target mask (a scatter, for vmap) equals the one-hot mask it replaced."""
    gen = torch.Generator().manual_seed(0)
    cosine = torch.rand(7, 11, generator=gen) * 2 - 1
    labels = torch.randint(0, 11, (7,), generator=gen)
    for m2, m3 in ((0.0, 0.35), (0.5, 0.0)):
        got = margin_logits(cosine, labels, s=30.0, m2=m2, m3=m3)
        target = cosine.gather(1, labels[:, None])[:, 0]
        if m2:
            theta = torch.acos(target.clamp(-1 + 1e-7, 1 - 1e-7))
            target = torch.where(theta + m2 <= torch.pi, torch.cos(theta + m2),
                                 target - m2 * np.sin(m2))  # fmt: skip
        one_hot = torch.nn.functional.one_hot(labels, 11).bool()
        want = 30.0 * torch.where(one_hot, (target - m3)[:, None], cosine)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
