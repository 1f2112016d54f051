"""Untuned / tuned evaluation of training clients and of clients that join after training."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from client.trainer_factory import build_local_trainer
from fl_secure.app.tuning import evaluate_after_training, newcomer, tuned_metrics, tuning_task
from fl_secure.config import Config, load_config
from fl_secure.data.plan import plan_federation
from fl_secure.training import build_model, evaluate_local, get_tensors, local_training

TINY = """
[run]
seed = 1
[data]
image_size = 32
num_identities = 30
images_per_identity = 6
held_out_identities = 4
[partition]
num_clients = 3
held_out_clients = 2
[model]
backbone = "cnn-small"
embedding_size = 32
[algorithm]
name = "{algorithm}"
[train]
rounds = 1
local_steps = 4
batch_size = 8
optimizer = "adam"
lr = 0.01
[eval]
tune_steps = 3
[server]
min_clients = 3
"""


def _config(tmp_path: Path, algorithm: str, *overrides: str) -> Config:
    (tmp_path / "tiny.toml").write_text(TINY.format(algorithm=algorithm))
    return load_config(tmp_path / "tiny.toml", list(overrides))


def _global_params(config: Config, classes: int) -> dict[str, np.ndarray]:
    model = build_model(config.model, classes, config.data.image_size, config.run.seed)
    from fl_secure.algorithms import get_strategy

    return get_tensors(model, get_strategy(config.algorithm.name).shared_names(model))


def _trained_client(config: Config):  # type: ignore[no-untyped-def]
    """Client 0 after one local round: its backbone has moved away from the global one."""
    plan = plan_federation(config)
    share = plan.clients[0]
    trainer = build_local_trainer(
        config, share.train, share.test, plan.train_identities, client_id="client-0",
        image_size=config.data.image_size,
    )  # fmt: skip
    shared = trainer.shared_parameters()
    trainer.train(shared, local_training(config.train))
    return trainer, shared


def test_tuning_starts_from_the_global_backbone_and_the_clients_own_head(tmp_path: Path) -> None:
    # Prepare: a private-head client whose local backbone differs from the global one
    config = _config(tmp_path, "fedpe")
    trainer, shared = _trained_client(config)
    local = evaluate_local(trainer.model.backbone, trainer.data)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    global_model = build_model(config.model, 1, 32, config.run.seed)
    untuned = evaluate_local(global_model.backbone, trainer.data)
    assert local != untuned  # the round moved the client's backbone
    # Execute: a vanishing tuning step, then a real one
    still = dataclasses.replace(tuning_task(config), learning_rate=1e-12)
    gen = torch.Generator().manual_seed(0)
    near = tuned_metrics(trainer.model, trainer.data, shared, still, generator=gen)
    tuned = tuned_metrics(trainer.model, trainer.data, shared, tuning_task(config), generator=gen)
    # Assert: lr -> 0 reproduces the untuned global model's figures, not the local model's;
    # real tuning changes them; the client's own model (with its head) is left as it was
    for key, value in untuned.items():
        assert near[key] == pytest.approx(value, abs=1e-9), key
    assert tuned != untuned
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_newcomer_gets_the_global_backbone_and_a_head_over_its_own_identities(
    tmp_path: Path,
) -> None:
    # Prepare: a global-head algorithm, whose head has no row for a newcomer's identities
    config = _config(tmp_path, "fedavg")
    plan = plan_federation(config)
    shared = _global_params(config, len(plan.train_identities))
    share = plan.held_out_clients[0]
    # Execute
    model, data = newcomer(config, share, shared)
    # Assert
    own = np.unique(share.train.labels.numpy())
    assert model.head.weight.shape[0] == len(own) and data.class_mask is None
    assert sorted(set(data.train_targets.tolist())) == list(range(len(own)))
    state = model.state_dict()
    for name, value in shared.items():
        if name.startswith("backbone."):
            np.testing.assert_array_equal(state[name].numpy(), value)
    assert not np.isin(own, plan.train_identities).any()


@pytest.mark.parametrize("algorithm", ["fedpe", "hfmaml-global"])
def test_evaluate_after_training_reports_every_group(tmp_path: Path, algorithm: str) -> None:
    # Prepare
    config = _config(tmp_path, algorithm)
    trainer, shared = _trained_client(config)
    plan = plan_federation(config)
    # Execute
    found = evaluate_after_training(
        config, {"client-0": (trainer.model, trainer.data)}, plan.held_out_clients, shared
    )
    untuned_only = evaluate_after_training(
        dataclasses.replace(config, eval=dataclasses.replace(config.eval, tune_steps=0)),
        {"client-0": (trainer.model, trainer.data)},
        plan.held_out_clients,
        shared,
    )
    # Assert: per-client figures in [0, 1] and their across-client summary
    assert list(found["held_out_clients"]) == ["held-out-client-0", "held-out-client-1"]
    for group in ("clients_tuned", "held_out_clients", "held_out_clients_tuned"):
        scores = found[group]
        assert all(0.0 <= m["rank1"] <= 1.0 for m in scores.values())
        values = [m["tar_at_far_1e-1"] for m in scores.values()]
        assert found[f"{group}_summary"]["tar_at_far_1e-1_mean"] == pytest.approx(np.mean(values))
    assert set(untuned_only) == {"held_out_clients", "held_out_clients_summary"}
    assert untuned_only["held_out_clients"] == found["held_out_clients"]


def test_diverged_tuning_or_global_model_aborts_naming_the_client(tmp_path: Path) -> None:
    from fl_secure.errors import RoundAborted

    # Prepare: a trained client and the held-out clients of the plan
    config = _config(tmp_path, "fedavg", 'train.optimizer="sgd"')
    trainer, shared = _trained_client(config)
    plan = plan_federation(config)
    trained = {"client-0": (trainer.model, trainer.data)}
    wild = dataclasses.replace(config, eval=dataclasses.replace(config.eval, tune_lr=1e6))
    # Execute / Assert: a fine-tuning that diverges (SGD at lr 1e6)
    with pytest.raises(RoundAborted, match="client-0's model after fine-tuning: .* eval.tune_lr"):
        evaluate_after_training(wild, trained, [], shared)
    # a final global model whose embeddings vanish: the first newcomer's untuned score
    zeros = type(shared)((k, np.zeros_like(v)) for k, v in shared.items())
    untuned_only = dataclasses.replace(config, eval=dataclasses.replace(config.eval, tune_steps=0))
    with pytest.raises(RoundAborted, match=r"held-out-client-0 \(joining after training\)"):
        evaluate_after_training(untuned_only, {}, plan.held_out_clients, zeros)


def test_adafedfr_tuned_and_untuned_scores_compare_the_same_network(tiny_adafedfr: Path) -> None:
    from fl_secure.app.simulation import simulate

    # Prepare: a tuning that cannot move the weights (lr 1e-30), and a real one
    base = ["eval.tune_steps=2", "data.images_per_identity=8"]
    still = load_config(tiny_adafedfr, [*base, "eval.tune_lr=1e-30"])
    real = load_config(tiny_adafedfr, [*base, "eval.tune_lr=0.05"])
    # Execute
    found = simulate(still).summary
    moved = simulate(real).summary
    # Assert: a no-op tuning gives each client its untuned scores, which AdaFedFR computes
    # through the client's adapter (the tuned ones used to leave it out); tuning does move
    assert set(found["clients_tuned"]) == set(found["clients"]) == {"client-0", "client-1"}
    assert any("tar_at_far_1e-1" in m for m in found["clients"].values())
    for client, untuned in found["clients"].items():
        assert found["clients_tuned"][client] == untuned, client
    assert moved["clients"] == found["clients"] and moved["clients_tuned"] != found["clients"]
