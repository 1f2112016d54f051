"""AdaFedFR's R over gRPC + mTLS: computed per round by the server, checked by the client.

The process test with client-level DP and SecAgg is
``tests/server/test_processes.py::test_adafedfr_with_client_level_dp_and_secure_aggregation_in_processes``.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from client.setup import build_local_trainer
from fl_secure.algorithms import get_strategy
from fl_secure.algorithms.adafedfr import (
    REPRESENTATIONS,
    AdaFedFR,
    public_dataset,
    public_identity_features,
)
from fl_secure.config import Config, load_config
from fl_secure.data.plan import plan_federation
from fl_secure.errors import ProtocolError
from fl_secure.messages import LocalTraining, Tensors
from fl_secure.runs import RunDir
from fl_secure.training import build_model, get_tensors, set_tensors
from server.coordinator import Coordinator, CoordinatorSettings


class RecordingTrainer:
    """Test double of a client: keeps every download, returns a constant update."""

    def __init__(self, shift: float) -> None:
        self.shift, self.num_examples = shift, 4
        self.seen: list[Tensors] = []

    def train(self, shared: Tensors, training: LocalTraining):  # type: ignore[no-untyped-def]
        self.seen.append(shared)
        update = OrderedDict(
            (k, np.full_like(v, self.shift)) for k, v in shared.items() if k != REPRESENTATIONS
        )
        return update, self.num_examples, {}

    def evaluate(self, shared: Tensors):  # type: ignore[no-untyped-def]
        return 1, {}


def _eq4(config: Config, params: Tensors) -> np.ndarray:
    """R recomputed from scratch: Eq. 4 on the public set under the given backbone."""
    model = build_model(config.model, 1, config.data.image_size, config.run.seed)
    set_tensors(model, params)
    public = public_dataset(config)
    return public_identity_features(model.backbone, public.images, public.labels).numpy()


def test_each_round_sends_eq4_of_that_rounds_global_model(
    tiny_adafedfr: Path, grpc_run_factory
) -> None:
    # Prepare: a coordinator with AdaFedFR's broadcaster, two clients over gRPC + mTLS
    config = load_config(tiny_adafedfr)
    strategy = get_strategy("adafedfr", config.algorithm)
    model = build_model(config.model, 1, config.data.image_size, config.run.seed)
    initial = get_tensors(model, strategy.shared_names(model))
    globals_: list[Tensors] = [initial]  # the global model each round starts from
    run = grpc_run_factory(
        initial,
        clients=2,
        rounds=2,
        min_clients=2,
        broadcast=strategy.broadcaster(config),
        on_round=lambda record: globals_.append(run.coordinator.params),
    )
    trainers = {f"client-{i}": RecordingTrainer(0.01 * (i + 1)) for i in range(2)}
    # Execute: two rounds
    threads = [run.start_client(c, t)[0] for c, t in trainers.items()]  # type: ignore[arg-type]
    run.driver.join(timeout=120)
    for th in threads:
        th.join(timeout=30)
    assert run.coordinator.status == "completed", run.coordinator.stop_reason
    # Assert: round r's download is the global model of round r plus R = Eq. 4 under it
    # (5 public identities x 16), the same for every client; R changes as the model does
    for c in trainers:
        assert len(trainers[c].seen) == 2
        for seen, params in zip(trainers[c].seen, globals_, strict=False):
            assert list(seen) == [*params, REPRESENTATIONS]
            for name in params:
                np.testing.assert_array_equal(seen[name], params[name])
            np.testing.assert_allclose(seen[REPRESENTATIONS], _eq4(config, params), atol=1e-6)
            assert seen[REPRESENTATIONS].shape == (5, 16)
    first, second = (s[REPRESENTATIONS] for s in trainers["client-0"].seen)
    assert np.abs(first - second).max() > 1e-4


def _trainer(config: Config):  # type: ignore[no-untyped-def]
    plan = plan_federation(config)
    share = plan.clients[0]
    return build_local_trainer(
        config,
        share.train,
        share.test,
        plan.train_identities,
        client_id="client-0",
        image_size=config.data.image_size,
    )


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r[:, :8], r"shape \(5, 8\), expected \[G >= 1, 16\]"),
        (lambda r: r[None], r"shape \(1, 5, 16\)"),
        (lambda r: np.where(np.arange(16) == 3, np.nan, r).astype(np.float32), "NaN"),
        (lambda r: 2 * r, "not unit rows"),
    ],
)
def test_a_malformed_r_is_refused_before_training(
    tiny_adafedfr: Path, mutate, message: str
) -> None:
    # Prepare: a real client trainer of the tiny AdaFedFR run and a well-formed download
    config = load_config(tiny_adafedfr)
    trainer = _trainer(config)
    shared = trainer.shared_parameters()
    good = _eq4(config, shared)
    assert isinstance(trainer.strategy, AdaFedFR)
    before = get_tensors(trainer.model, trainer.shared_names)
    # Execute / Assert: the bad R is named and nothing trained
    sent = OrderedDict([*shared.items(), (REPRESENTATIONS, mutate(good))])
    with pytest.raises(ValueError, match=message):
        trainer.train(sent, LocalTraining(local_steps=1, batch_size=4))
    after = get_tensors(trainer.model, trainer.shared_names)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    # ... an unexpected extra broadcast name is refused too, and a good R trains
    extra = OrderedDict([*sent.items(), ("broadcast.other", np.zeros(2, np.float32))])
    with pytest.raises(ValueError, match="broadcast.public_representations"):
        trainer.train(extra, LocalTraining(local_steps=1, batch_size=4))
    sent[REPRESENTATIONS] = good
    update, _, metrics = trainer.train(sent, LocalTraining(local_steps=1, batch_size=4))
    assert list(update) == trainer.shared_names and {"lmc", "kcl", "bce"} <= set(metrics)
    torch.testing.assert_close(
        trainer.strategy.public_representations, torch.from_numpy(good), rtol=0, atol=0
    )


def test_the_coordinator_refuses_a_non_finite_broadcast(tmp_path: Path) -> None:
    # Prepare: a broadcaster that yields NaN
    bad = OrderedDict([(REPRESENTATIONS, np.full((2, 2), np.nan, np.float32))])
    coord = Coordinator(
        CoordinatorSettings(rounds=1, min_clients=1, final_evaluation=False),
        OrderedDict([("backbone.w", np.zeros(2, np.float32))]),
        enrolled={"c0"},
        run_dir=RunDir(tmp_path / "run"),
        server_step=lambda p, u, r: p,
        broadcast=lambda params, round_: bad,
    )
    # Execute / Assert
    with pytest.raises(ProtocolError, match="non-finite"):
        coord._prepare_broadcast(1)
