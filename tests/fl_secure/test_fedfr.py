"""FedFR (Algorithm 1): DCL (Eq. 3), C-FINCH pseudo labels, FedPav on the source client."""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from client.trainer import LocalTrainer
from client.trainer_factory import build_local_trainer
from fl_secure.algorithms.cfinch import c_finch, finch, pairwise_f_score
from fl_secure.algorithms.fedfr import (
    FedFR,
    domain_constraint,
    domain_constraint_loss,
    is_source_domain,
    is_target_domain,
    pseudo_labelled,
    pseudo_labels,
    without_singletons,
)
from fl_secure.algorithms.registry import check_config, get_strategy
from fl_secure.config import AlgorithmConfig, Config, ModelConfig, PartitionConfig, config_from_dict
from fl_secure.data.plan import load_dataset, plan_federation
from fl_secure.data.synthetic import SyntheticFaceConfig, generate_synthetic_faces
from fl_secure.data.types import FaceDataset
from fl_secure.errors import ConfigError
from fl_secure.messages import LocalTraining, Tensors
from fl_secure.training import build_model, embed, get_tensors, local_training

CFG = ModelConfig(backbone="cnn-small", embedding_size=16, head="cosface", scale=16, margin=0.2)
TRAINING = LocalTraining(
    local_steps=12, batch_size=8, learning_rate=0.1, momentum=0.0, weight_decay=0.0
)


def test_dcl_gradient_is_lambda_times_distance() -> None:
    g = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (7,), (2, 2, 3)]
    theta = [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]
    theta_r = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    lam = 0.37
    loss = domain_constraint_loss(theta, theta_r, lam)
    grads = torch.autograd.grad(loss, theta)
    for grad, p, r in zip(grads, theta, theta_r, strict=True):
        assert torch.equal(grad, lam * (p.detach() - r))  # bit-exact in float64
    squares = [float(((p.detach() - r) ** 2).sum()) for p, r in zip(theta, theta_r, strict=True)]
    expected = 0.5 * lam * sum(squares)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-12)


def test_training_hooks_add_the_dcl_gradient() -> None:
    # The hooks used in training must give the gradient of F + DCL, computed by autograd
    model = build_model(CFG, 4, 32, seed=0).double()
    params = list(model.backbone.parameters())
    g = torch.Generator().manual_seed(1)
    images = torch.randn(6, 3, 32, 32, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 4, (6,), generator=g)
    lam = 0.5
    with domain_constraint(params, lam) as reference:
        with torch.no_grad():  # move theta away from theta_r so that the term is not zero
            for p in params:
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=torch.float64))
        ce = nn.functional.cross_entropy(model(images, targets), targets)
        hooked = torch.autograd.grad(ce, params)
    ce = nn.functional.cross_entropy(model(images, targets), targets)
    exact = torch.autograd.grad(ce + domain_constraint_loss(params, reference, lam), params)
    plain = torch.autograd.grad(
        nn.functional.cross_entropy(model(images, targets), targets), params
    )
    for h, e, p, r, q in zip(hooked, exact, params, reference, plain, strict=True):
        assert torch.allclose(h, e, rtol=1e-12, atol=1e-14)
        assert torch.allclose(h - q, lam * (p.detach() - r), rtol=1e-9, atol=1e-14)
    # outside the block the hooks are gone
    again = torch.autograd.grad(
        nn.functional.cross_entropy(model(images, targets), targets), params
    )
    assert all(torch.equal(a, q) for a, q in zip(again, plain, strict=True))


def clustered_images(seed: int) -> tuple[FaceDataset, np.ndarray]:
    """12 identities of unequal sizes (1 to 15 images): Gaussian clusters in image space."""
    rng = np.random.default_rng(seed)
    sizes = [1, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 15]
    centres = rng.normal(size=(len(sizes), 3 * 4 * 4))
    y = np.repeat(np.arange(len(sizes)), sizes)
    x = centres[y] + rng.normal(scale=0.15, size=(len(y), 48))
    data = FaceDataset(
        images=torch.from_numpy(x.reshape(-1, 3, 4, 4).astype(np.float32)),
        labels=torch.from_numpy(y.astype(np.int64)),
        identity_names=tuple(f"id-{i}" for i in range(len(sizes))),
        attributes={"domain": np.ones(len(y), dtype=np.int64)},
    )
    return data, y


def test_pseudo_labels_recover_well_separated_identities() -> None:
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Flatten(), nn.Linear(48, 16))  # a fixed random projection
    scores = []
    for seed in range(3):
        data, y = clustered_images(seed)
        labels = pseudo_labels(backbone, data.images, 0.3)
        scores.append(pairwise_f_score(y, labels))
        # without the threshold no FINCH level is as good (measured best level 0.86, 0.65,
        # 0.79): random centres in 16-D can be first neighbours at cosine distance ~0.5
        levels = finch(embed(backbone, data.images))
        assert max(pairwise_f_score(y, lv) for lv in levels) < scores[-1] - 0.1
        # pseudo-labelled set: true labels replaced, images and attributes kept
        relabelled = pseudo_labelled(data, labels)
        assert torch.equal(relabelled.labels, torch.from_numpy(labels))
        assert relabelled.identity_names[0] == "pseudo-000000"
        assert relabelled.num_identities == labels.max() + 1
        assert not is_source_domain(relabelled)
    # measured: F = 1.000 on all three draws (12 clusters; d = 0.5 merges to 10, F 0.80-0.86)
    assert min(scores) > 0.9
    # the singleton identity (1 image) is dropped with drop_singletons
    data, y = clustered_images(0)
    dropped = pseudo_labels(backbone, data.images, 0.3, drop_singletons=True)
    assert dropped[y == 0].tolist() == [-1]
    assert (dropped[y != 0] >= 0).all()
    kept = pseudo_labelled(data, dropped)
    assert len(kept) == len(y) - 1
    assert pairwise_f_score(y[y != 0], kept.labels.numpy()) > 0.9


def test_without_singletons() -> None:
    assert without_singletons(np.array([4, 4, 7, 2, 2, 9])).tolist() == [0, 0, -1, 1, 1, -1]
    assert without_singletons(np.array([0, 1, 2])).tolist() == [-1, -1, -1]


def faces(domain: str | None) -> FaceDataset:
    cfg = SyntheticFaceConfig(4, 6, image_size=32, seed=0, domain=domain)  # type: ignore[arg-type]
    return generate_synthetic_faces(cfg)


def update_norm(
    strategy: FedFR, train: FaceDataset, seed: int = 0
) -> tuple[float, dict[str, float]]:
    model = build_model(CFG, 4, 32, seed=0)
    data = strategy.local_data(train, train.subset([]), np.arange(4))
    shared = get_tensors(model, strategy.shared_names(model))
    result = strategy.client_update(
        model, data, TRAINING, shared, generator=torch.Generator().manual_seed(seed)
    )
    norm = float(
        np.sqrt(sum(float((u.astype(np.float64) ** 2).sum()) for u in result.update.values()))
    )
    return norm, result.metrics


def test_dcl_pulls_the_source_update_towards_the_global_model() -> None:
    torch.set_num_threads(1)
    source = faces(None)
    assert is_source_domain(source)
    free, free_metrics = update_norm(FedFR(0.0), source)
    mild = update_norm(FedFR(0.5), source)[0]
    pulled, pulled_metrics = update_norm(FedFR(5.0), source)
    # measured ||theta - theta_r|| after E = 12 steps (lr 0.1, same seed): 15.35 without
    # DCL, 8.78 with lambda = 0.5, 1.10 with lambda = 5
    assert free > 10
    assert pulled < mild < 0.7 * free
    assert pulled < 0.2 * free
    assert "dcl" not in free_metrics
    assert pulled_metrics["dcl"] == pytest.approx(0.5 * 5.0 * pulled**2, rel=1e-4)
    # target clients (shifted domain) keep their loss: lambda has no effect at all
    target = faces("shifted")
    assert not is_source_domain(target)
    assert update_norm(FedFR(5.0), target)[0] == update_norm(FedFR(0.0), target)[0]


def test_strategy_shares_the_backbone_only() -> None:
    model = build_model(CFG, 4, 32, seed=0)
    strategy = FedFR(0.01)
    names = strategy.shared_names(model)
    assert names and all(n.startswith("backbone.") for n in names)
    assert strategy.exposure == "private-embedding"
    assert "0.01" in strategy.describe()
    with pytest.raises(ValueError, match="dcl_lambda"):
        FedFR(-1.0)


def domain_config(**algorithm: object) -> Config:
    """A tiny FedFR federation: source client 0, target clients 1-2 (shifted domain)."""
    return config_from_dict(
        {
            "run": {"seed": 3},
            "data": {
                "image_size": 32,
                "num_identities": 16,
                "images_per_identity": 6,
                "held_out_identities": 4,
            },
            "partition": {"kind": "domain", "num_clients": 3, "source_fraction": 0.5},
            "model": {"backbone": "cnn-small", "embedding_size": 16, "scale": 16, "margin": 0.2},
            "algorithm": {"name": "fedfr", **algorithm},
            "train": {"local_steps": 3, "batch_size": 8, "optimizer": "sgd", "lr": 0.05},
            "server": {"min_clients": 3},
        }
    )


def test_domain_plan_gives_one_source_client_and_shifted_target_clients() -> None:
    config = domain_config()
    plan = plan_federation(config)
    assert len(plan.clients) == 3
    ids = [np.unique(c.train.labels.numpy()) for c in plan.clients]
    assert len(ids[0]) == 6  # half of the 12 training identities
    assert sorted(len(i) for i in ids[1:]) == [3, 3]
    everyone = np.concatenate([*ids, plan.held_out.identities()])
    assert len(np.unique(everyone)) == len(everyone) == 16  # all roles disjoint
    assert np.array_equal(np.sort(np.concatenate(ids)), plan.train_identities)
    assert is_source_domain(plan.clients[0].train) and is_source_domain(plan.clients[0].test)
    for share in plan.clients[1:]:
        assert is_target_domain(share.train) and is_target_domain(share.test)
    assert is_target_domain(plan.held_out)
    # the target images are the generator's shifted rendering of the same identity ids
    shifted = load_dataset(config.data, 3, domain="shifted")
    first = int(plan.held_out.labels[0])
    expected = shifted.images[shifted.labels == first]
    assert torch.equal(plan.held_out.images[plan.held_out.labels == first], expected)


def test_fedfr_config_checks() -> None:
    strategy = get_strategy("fedfr", AlgorithmConfig(name="fedfr", dcl_lambda=0.2))
    assert isinstance(strategy, FedFR)
    assert strategy.dcl_lambda == 0.2
    assert strategy.cfinch_threshold == pytest.approx(0.9**2 / 2)  # the paper's d = 0.9
    for key, value in (("dcl_lambda", -0.1), ("dcl_lambda", math.inf), ("cfinch_threshold", 0)):
        with pytest.raises(ConfigError, match=f"algorithm.{key}"):
            AlgorithmConfig(name="fedfr", **{key: value})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="partition.num_clients"):
        PartitionConfig(kind="domain", num_clients=1)
    with pytest.raises(ConfigError, match="partition.source_fraction"):
        PartitionConfig(kind="domain", source_fraction=1.0)
    with pytest.raises(ConfigError, match="data.source = 'synthetic'"):
        config_from_dict(
            {"data": {"source": "folders", "path": "/nowhere"}, "partition": {"kind": "domain"}}
        )
    # pseudo labels couple a target client's images: DP-SGD's per-example bound misses that
    fedfr = {"algorithm": {"name": "fedfr"}, "partition": {"kind": "domain"}}
    example = {"unit": "example", "noise_multiplier": 1.0}
    with pytest.raises(ConfigError, match="'fedfr' cannot run with privacy.unit = 'example'"):
        check_config(config_from_dict({**fedfr, "privacy": example}))
    client = config_from_dict({**fedfr, "privacy": {"unit": "client", "noise_multiplier": 1.0}})
    check_config(client)
    assert client.privacy.unit == "client"


def target_update(
    config: Config, train: FaceDataset, test: FaceDataset
) -> tuple[LocalTrainer, list[Tensors]]:
    """Two rounds of a target client from the run's initial model (its trainer and updates)."""
    plan = plan_federation(config)
    trainer = build_local_trainer(
        config, train, test, plan.train_identities, client_id="client-1", image_size=32
    )
    params = get_tensors(build_model(config.model, 1, 32, config.run.seed), trainer.shared_names)
    task = local_training(config.train)
    first = trainer.train(params, task)[0]
    second = trainer.train(OrderedDict((k, params[k] + first[k]) for k in params), task)[0]
    return trainer, [first, second]


def test_target_client_pseudo_labels_with_the_received_model_not_its_labels() -> None:
    torch.set_num_threads(1)
    config = domain_config(cfinch_threshold=0.3)
    share = plan_federation(config).clients[1]
    trainer, updates = target_update(config, share.train, share.test)
    strategy = trainer.strategy
    assert isinstance(strategy, FedFR)
    # before any model arrives the targets are unlabelled: nothing to train on
    assert (strategy.local_data(share.train, share.test, np.arange(16)).train_targets == -1).all()
    # pseudo labels = C-FINCH on the features of the first model received (Algorithm 1 l. 6-7)
    received = build_model(config.model, 1, 32, config.run.seed)
    expected = c_finch(embed(received.backbone, share.train.images), 0.3)
    assert strategy.pseudo is not None
    assert np.array_equal(strategy.pseudo.train_targets.numpy(), expected)
    assert trainer.model.head.weight.shape[0] == expected.max() + 1  # one row per cluster
    assert strategy.training_data(trainer.data) is strategy.pseudo  # what tuning trains on
    source = plan_federation(config).clients[0]
    labelled = strategy.local_data(source.train, source.test, np.arange(16))
    assert strategy.training_data(labelled) is labelled
    assert strategy.pseudo.train.identity_names[0] == "pseudo-000000"
    assert all(k.startswith("backbone.") for k in updates[0])
    # the true labels never reach training: scrambled labels give bit-identical updates
    rng = np.random.default_rng(0)
    scrambled = dataclasses.replace(
        share.train, labels=torch.from_numpy(rng.permutation(share.train.labels.numpy()))
    )
    assert not torch.equal(scrambled.labels, share.train.labels)
    _, again = target_update(config, scrambled, share.test)
    for mine, theirs in zip(updates, again, strict=True):
        assert all(np.array_equal(mine[k], theirs[k]) for k in mine)
    assert any(np.abs(u).max() > 0 for u in updates[1].values())


def test_source_pretraining_reads_the_source_client_only_and_seeds_the_fedfr_run(
    tmp_path: Path,
) -> None:
    # Prepare: the tiny domain federation; its centralized run is FedFR's source pre-training
    from fl_secure.app.centralized import pretraining_clients, run_centralized
    from fl_secure.models import load_pretrained

    config = dataclasses.replace(
        domain_config(), train=dataclasses.replace(domain_config().train, rounds=1)
    )
    plan = plan_federation(config)
    # Execute
    summary = run_centralized(config, out=tmp_path, progress=False)
    weights = Path(summary["run_dir"]) / "backbone.safetensors"
    seeded = dataclasses.replace(
        config, model=dataclasses.replace(config.model, pretrained=str(weights))
    )
    trainer = build_local_trainer(
        seeded, plan.clients[1].train, plan.clients[1].test, plan.train_identities,
        client_id="client-1", image_size=32,
    )  # fmt: skip
    # Assert: only the labelled source client's images are pooled (Algorithm 1 lines 1-2) ...
    assert pretraining_clients(config, plan) == [plan.clients[0]]
    pooled = dataclasses.replace(
        config, partition=dataclasses.replace(config.partition, kind="equal")
    )
    assert pretraining_clients(pooled, plan) == list(plan.clients)  # other kinds: everyone
    # ... and a FedFR client of the run that starts from f_s holds exactly those weights
    expected = build_model(config.model, 1, 32, config.run.seed).backbone
    load_pretrained(expected, weights)
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(trainer.model.backbone.state_dict()[name], value)


def test_a_simulated_fedfr_run_fine_tunes_target_clients_on_their_pseudo_labels() -> None:
    # Prepare: fine-tuning after training is on (eval.tune_steps > 0)
    from fl_secure.app.simulation import simulate

    base = domain_config(cfinch_threshold=0.3)
    config = dataclasses.replace(
        base,
        train=dataclasses.replace(base.train, rounds=1),
        eval=dataclasses.replace(base.eval, tune_steps=2),
    )
    # Execute: a target client's own targets are -1, so tuning on them cannot run
    result = simulate(config)
    # Assert: every training client, target ones included, has its tuned figures
    tuned = result.summary["clients_tuned"]
    assert sorted(tuned) == ["client-0", "client-1", "client-2"]
    assert all(0.0 <= m["rank1"] <= 1.0 for m in tuned.values())
