"""AdaFedFR's R over gRPC + mTLS: computed per round by the server, checked by the client.

With real LocalTrainers and client-level DP on (the privacy module's clip and noise,
Algorithm 1 lines 23-26): the download, the release, epsilon per round and the bytes per round
are checked against reference computations. The process test with client-level DP and SecAgg is
``tests/server/test_processes.py::test_adafedfr_with_client_level_dp_and_secure_aggregation_in_processes``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from client.trainer_factory import build_local_trainer
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
from privacy.dp.calibration import epsilon_for
from privacy.dp.noise import seeded_source
from server.coordinator import Coordinator
from server.settings import CoordinatorSettings

from .grid_release import assert_grid_noised_release  # type: ignore[import-not-found]


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
    tiny_adafedfr: Path, grpc_run_factory: Callable[..., Any]
) -> None:
    # Prepare: a coordinator with AdaFedFR's broadcaster, two clients over gRPC + mTLS
    config = load_config(tiny_adafedfr)
    strategy = get_strategy("adafedfr", config.algorithm)
    model = build_model(config.model, 1, config.data.image_size, config.run.seed)
    initial = get_tensors(model, strategy.shared_names(model))
    globals_: list[Tensors] = [initial]  # the global model each round starts from
    run: Any = grpc_run_factory(
        initial,
        clients=2,
        rounds=2,
        min_clients=2,
        broadcast=strategy.broadcaster(config),
        on_round=lambda record: globals_.append(run.coordinator.params),
    )
    trainers = {f"client-{i}": RecordingTrainer(0.01 * (i + 1)) for i in range(2)}
    # Execute: two rounds
    threads = [run.start_client(c, t)[0] for c, t in trainers.items()]
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
    tiny_adafedfr: Path, mutate: Callable[[np.ndarray], np.ndarray], message: str
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
        coord.model.prepare_broadcast(1)


def test_dp_rounds_over_mtls_release_only_the_clipped_noised_backbone(
    tiny_adafedfr: Path, tmp_path: Path, serve: Any
) -> None:
    # Prepare: the tiny AdaFedFR run with client-level DP (Algorithm 1 lines 23-26 = the
    # privacy module's clip and local discrete Gaussian noise on a grid, z = 1, C = 0.05,
    # reproducible noise)
    # served by build_server over gRPC + mTLS to two real LocalTrainers in threads
    z, clip = 1.0, 0.05
    config = load_config(
        tiny_adafedfr,
        [
            "privacy.unit=client",
            "privacy.noise_placement=local",
            f"privacy.noise_multiplier={z}",
            f"privacy.clip_norm={clip}",
            "privacy.secure_rng=false",
            "server.min_clients=2",
            "server.round_timeout=120",
        ],
    )
    # Execute: two rounds
    side, recorders = serve(tmp_path, config, ["client-0", "client-1"])
    coord = side.coordinator
    assert coord.status == "completed", coord.stop_reason
    records = [r for r in RunDir(tmp_path / "run").read_metrics() if r["round"] >= 1]
    assert [r["round"] for r in records] == [1, 2]
    # Assert: each round every client got the round's global backbone plus R = Eq. 4 under it
    for rec in recorders.values():
        assert len(rec.received) == len(rec.released) == len(rec.raw) == 2
        shared = rec.trainer.shared_names
        assert shared and all(name.startswith("backbone.") for name in shared)
        for received in rec.received:
            assert list(received) == [*shared, REPRESENTATIONS]
            params = OrderedDict((k, received[k]) for k in shared)
            np.testing.assert_allclose(received[REPRESENTATIONS], _eq4(config, params), atol=1e-6)
    # ... the release is exactly clip(raw, C) randomly rounded onto the power-of-two grid
    # Lambda plus integer discrete Gaussian noise, from the privacy module's source of that
    # client (no other noise), with the backbone's names only: the head z, the adapter theta
    # and phi (which did train) never leave the client
    for cid, rec in recorders.items():
        source = seeded_source(config.run.seed, cid)
        for raw, (released, _) in zip(rec.raw, rec.released, strict=True):
            assert list(raw) == rec.trainer.shared_names
            assert_grid_noised_release(raw, released, z, clip, source)
        model = rec.trainer.model
        assert rec.trainer.shared_names == [f"backbone.{k}" for k in model.backbone.state_dict()]
        strategy = rec.trainer.strategy
        assert isinstance(strategy, AdaFedFR)
        state = strategy.client_state(model)  # theta and phi live beside the model, and trained
        adapter = state.adapter.transform.weight.detach()
        assert float((adapter - torch.eye(adapter.shape[0])).abs().max()) > 0
        assert float(state.selection.logits.detach().abs().max()) > 0
        backbone = {id(p) for p in model.backbone.parameters()}
        assert not any(id(p) in backbone for p in [*state.parameters(), *model.head.parameters()])
    # ... the next global model is the mean of the two releases (the server sees no more)
    got = recorders["client-0"].received
    for k in recorders["client-0"].trainer.shared_names:
        mean = sum(rec.released[0][0][k].astype(np.float64) for rec in recorders.values()) / 2
        np.testing.assert_allclose(got[1][k], (got[0][k] + mean).astype(np.float32), atol=1e-6)
    # ... epsilon after each round in metrics.jsonl is the zCDP bound of the integer local
    # noise (q = 1)
    expected_eps = [
        epsilon_for(accountant="pld", noise_multiplier=z, sample_rate=1.0, steps=r, delta=1e-5,
                    noise="discrete_gaussian")
        for r in (1, 2)
    ]  # fmt: skip
    assert [r["epsilon"] for r in records] == pytest.approx(expected_eps, rel=1e-9)
    # ... and the bytes recorded per round are the sizes of what a client got and sent
    for record, received in zip(records, recorders["client-0"].received, strict=True):
        down = sum(v.nbytes for k, v in received.items() if k != REPRESENTATIONS)
        up = sum(v.nbytes for v in recorders["client-0"].released[0][0].values())
        r_bytes = received[REPRESENTATIONS].nbytes
        assert r_bytes == 5 * 16 * 4
        assert record["bytes_per_client"] == {
            "broadcast": r_bytes,
            "parameters_down": down,
            "parameters_up": up,
            "total": r_bytes + down + up,
        }


def test_fedfr_style_data_sharing_ships_the_public_images_over_mtls(
    tiny_adafedfr: Path, tmp_path: Path, serve: Any
) -> None:
    # Prepare: the tiny run as fedfr-public (AdaFedFR's baseline), two real clients
    from fl_secure.algorithms.publicshare import IMAGES, LABELS, to_pixels

    config = load_config(tiny_adafedfr, ["algorithm.name=fedfr-public", "server.min_clients=2"])
    public = public_dataset(config)
    # Execute: two rounds
    side, recorders = serve(tmp_path, config, ["client-0", "client-1"])
    assert side.coordinator.status == "completed", side.coordinator.stop_reason
    # Assert: every download carried the public set as 8-bit images (5 identities x 2) and
    # indices 0..4, counted in the round's bytes; only the backbone went up
    records = [r for r in RunDir(tmp_path / "run").read_metrics() if r["round"] >= 1]
    pixels = to_pixels(public.images)
    for rec in recorders.values():
        assert len(rec.received) == 2
        for received, (released, _) in zip(rec.received, rec.released, strict=True):
            np.testing.assert_array_equal(received[IMAGES], pixels)
            assert received[LABELS].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
            assert list(released) == rec.trainer.shared_names
        assert (
            rec.trainer.model.head.weight.shape[0]
            == len(np.unique(rec.trainer.data.train.labels.numpy())) + 5
        )  # own identities, then the public ones
    for record in records:
        assert record["bytes_per_client"]["broadcast"] == pixels.nbytes + 10 * 8
