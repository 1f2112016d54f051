"""FedAffect building blocks (FedAffect slides, Algorithm 1; SimCLR NT-Xent; Relation Network)."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from client.trainer_factory import build_local_trainer
from fl_secure.algorithms import check_config, get_strategy
from fl_secure.algorithms.fedaffect import (
    FedAffect,
    FedAffectModel,
    build_fedaffect_model,
    expression_targets,
    held_out_expression_split,
    make_expression_evaluator,
)
from fl_secure.algorithms.fedaffect_relation import (
    RelationModule,
    expression_accuracy,
    prototypes,
    relation_loss,
    relation_targets,
    sample_episode,
)
from fl_secure.algorithms.fedaffect_rounds import (
    ClientData,
    ClientState,
    FedAffectConfig,
    client_round,
    local_few_shot,
    weighted_average,
)
from fl_secure.algorithms.fedaffect_simclr import augment, nt_xent, projection_head
from fl_secure.config import AlgorithmConfig, Config, config_from_dict
from fl_secure.data.plan import plan_federation
from fl_secure.data.synthetic import EXPRESSIONS, SyntheticFaceConfig, generate_synthetic_faces
from fl_secure.data.types import FaceDataset
from fl_secure.errors import ConfigError, DataError
from fl_secure.models.factory import get_backbone
from fl_secure.runs import RunDir
from fl_secure.training import build_model, get_tensors, local_training
from server.bootstrap import build_server


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------ NT-Xent


def _nt_xent_loop(z1: np.ndarray, z2: np.ndarray, tau: float) -> float:
    """Algorithm 1 lines 26-27 written out: views interleaved as z_{2k-1}, z_{2k} (1-based)."""
    b = len(z1)
    z = np.empty((2 * b, z1.shape[1]))
    z[0::2], z[1::2] = z1, z2

    def sim(u: np.ndarray, v: np.ndarray) -> float:
        return float(u @ v / (np.linalg.norm(u) * np.linalg.norm(v)))

    def ell(i: int, j: int) -> float:
        den = sum(math.exp(sim(z[i], z[k]) / tau) for k in range(2 * b) if k != i)
        return -math.log(math.exp(sim(z[i], z[j]) / tau) / den)

    return sum(ell(2 * k, 2 * k + 1) + ell(2 * k + 1, 2 * k) for k in range(b)) / (2 * b)


@pytest.mark.parametrize(
    ("seed", "b", "d", "tau"), [(0, 2, 3, 0.5), (1, 5, 8, 0.1), (2, 7, 4, 1.0)]
)
def test_nt_xent_equals_loop_formula(seed: int, b: int, d: int, tau: float) -> None:
    rng = np.random.default_rng(seed)
    z1, z2 = rng.standard_normal((b, d)), rng.standard_normal((b, d))
    got = float(nt_xent(torch.from_numpy(z1), torch.from_numpy(z2), tau))
    assert got == pytest.approx(_nt_xent_loop(z1, z2, tau), abs=1e-6)


def test_nt_xent_coinciding_orthogonal_views_attain_the_closed_form_minimum() -> None:
    b, tau = 4, 0.5
    eye = torch.eye(6, dtype=torch.float64)[:b]
    best = float(nt_xent(eye, 3.0 * eye, tau))  # scale does not matter: cosine similarity
    # each anchor: positive cosine 1, 2B - 2 negatives with cosine 0
    assert best == pytest.approx(math.log(1 + (2 * b - 2) * math.exp(-1 / tau)), abs=1e-12)
    assert float(nt_xent(eye, eye.roll(1, dims=0), tau)) > best + 1.0  # views disagree
    # it is the minimum over every configuration whose cosines between different images are
    # >= 0 (positive vectors): the positive term is <= 1/tau, each negative term >= 1
    gen = _gen(0)
    for _ in range(50):
        z1 = torch.rand(b, 6, generator=gen, dtype=torch.float64)
        z2 = z1 + 0.3 * torch.rand(b, 6, generator=gen, dtype=torch.float64)
        assert float(nt_xent(z1, z2, tau)) > best
    # not a global minimum: a regular simplex (negative cosines -1/(B-1)) is lower still
    simplex = torch.eye(b, dtype=torch.float64) - 1.0 / b
    assert float(nt_xent(simplex, simplex, tau)) < best - 0.1


def test_nt_xent_rejects_mismatched_views() -> None:
    with pytest.raises(ValueError, match="two"):
        nt_xent(torch.zeros(3, 4), torch.zeros(2, 4), 0.5)


def test_augment_is_reproducible_in_range_and_random() -> None:
    images = torch.rand(4, 3, 32, 32, generator=_gen(0)) * 2 - 1
    a, b = augment(images, _gen(5)), augment(images, _gen(5))
    assert torch.equal(a, b)
    assert a.shape == images.shape
    assert float(a.min()) >= -1.0 and float(a.max()) <= 1.0
    c = augment(images, _gen(6))
    assert float((a - c).abs().mean()) > 0.05
    assert float((a - images).abs().mean()) > 0.05


# ------------------------------------------------------------------------ episodes


def test_episode_has_n_classes_k_support_q_query_disjoint_with_correct_labels() -> None:
    # class 4 has 3 images only: never eligible for K + Q = 5
    labels = torch.tensor([0] * 7 + [1] * 5 + [2] * 9 + [3] * 6 + [4] * 3 + [5] * 8)
    labels = labels[torch.randperm(len(labels), generator=_gen(1))]
    n, k, q = 4, 2, 3
    seen: set[int] = set()
    for seed in range(40):
        ep = sample_episode(labels, n, k, q, _gen(seed))
        assert ep.support.shape == (n * k,) and ep.query.shape == (n * q,)
        assert len(set(ep.classes.tolist())) == n
        assert 4 not in ep.classes.tolist()
        both = torch.cat([ep.support, ep.query]).tolist()
        assert len(set(both)) == len(both)  # no repeats, support and query disjoint
        assert ep.support_labels.tolist() == [c for c in range(n) for _ in range(k)]
        assert ep.query_labels.tolist() == [c for c in range(n) for _ in range(q)]
        assert torch.equal(labels[ep.support], ep.classes[ep.support_labels])
        assert torch.equal(labels[ep.query], ep.classes[ep.query_labels])
        seen |= set(ep.classes.tolist())
    assert seen == {0, 1, 2, 3, 5}
    with pytest.raises(ValueError, match="only 5 have"):
        sample_episode(labels, 6, k, q, _gen(0))


def test_relation_targets_are_one_hot() -> None:
    labels = torch.tensor([2, 0, 1, 1, 2])
    t = relation_targets(labels, 3)
    assert t.tolist() == [[0, 0, 1], [1, 0, 0], [0, 1, 0], [0, 1, 0], [0, 0, 1]]


def test_prototypes_and_relation_loss_match_hand_computation() -> None:
    emb = torch.tensor([[1.0, 0.0], [3.0, 2.0], [0.0, 4.0]])
    assert prototypes(emb, torch.tensor([0, 0, 1]), 2).tolist() == [[2.0, 1.0], [0.0, 4.0]]

    images = torch.randn(6, 3, 2, 2, generator=_gen(0))
    encoder = nn.Flatten()
    relation = RelationModule(12, hidden=5)
    ep = sample_episode(torch.tensor([0, 0, 1, 1, 2, 2]), 2, 1, 1, _gen(3))
    flat = images.flatten(1)
    protos = flat[ep.support]  # K = 1: the prototype is the support embedding
    expected = 0.0
    for i, qi in enumerate(ep.query.tolist()):
        for c in range(2):
            pn, qn = relation.norm(protos[c]), relation.norm(flat[qi])
            pair = torch.cat([pn, qn, (pn - qn).abs(), pn * qn])
            score = torch.sigmoid(relation.net(pair)).detach()
            expected += (float(score) - float(ep.query_labels[i] == c)) ** 2
    with torch.no_grad():
        got = float(relation_loss(encoder, relation, images, ep))
    assert got == pytest.approx(expected / 4, abs=1e-6)


# ---------------------------------------------------------------------- aggregation


def test_weighted_average_equals_hand_computation() -> None:
    a = OrderedDict(w=torch.tensor([1.0, 2.0]), n=torch.tensor(7))
    b = OrderedDict(w=torch.tensor([5.0, -2.0]), n=torch.tensor(9))
    c = OrderedDict(w=torch.tensor([0.0, 4.0]), n=torch.tensor(1))
    out = weighted_average([a, b, c], [10, 30, 60])
    # 0.1 * [1, 2] + 0.3 * [5, -2] + 0.6 * [0, 4] = [1.6, 2.0]
    assert out["w"].tolist() == pytest.approx([1.6, 2.0], abs=1e-6)
    assert out["w"].dtype == torch.float32
    assert int(out["n"]) == 7  # non-float tensors: the first client's
    with pytest.raises(ValueError, match="sizes"):
        weighted_average([a, b], [0, 0])
    with pytest.raises(ValueError, match="different keys"):
        weighted_average([a, OrderedDict(w=a["w"])], [1, 1])


# ---------------------------------------------------------------- local training


@pytest.fixture(scope="module")
def faces() -> tuple[torch.Tensor, torch.Tensor]:
    ds = generate_synthetic_faces(
        SyntheticFaceConfig(num_identities=30, images_per_identity=4, image_size=32, seed=3)
    )
    return ds.images, torch.from_numpy(ds.attributes["expression"])


def _mean_relation_loss(
    encoder: nn.Module, relation: nn.Module, images: torch.Tensor, labels: torch.Tensor
) -> float:
    encoder.eval()
    with torch.no_grad():
        losses = [
            float(
                relation_loss(encoder, relation, images, sample_episode(labels, 5, 2, 2, _gen(s)))
            )
            for s in range(1000, 1020)
        ]
    return sum(losses) / len(losses)


def _labelled_subset(labels: torch.Tensor, per_class: int) -> torch.Tensor:
    return torch.cat([torch.nonzero(labels == c).flatten()[:per_class] for c in range(5)])


def test_local_few_shot_decreases_the_relation_loss(
    faces: tuple[torch.Tensor, torch.Tensor],
) -> None:
    images, expressions = faces
    idx = _labelled_subset(expressions, 6)
    data = ClientData(images[idx], expressions[idx], images[:0])
    torch.manual_seed(0)
    encoder = get_backbone("cnn-small", embedding_size=32, image_size=32)
    relation = RelationModule(32, hidden=32)
    before = _mean_relation_loss(encoder, relation, data.labelled, data.labels)
    cfg = FedAffectConfig(n_way=5, k_shot=2, n_query=2, episodes=40, learning_rate=2e-3)
    losses = local_few_shot(encoder, relation, data, cfg, _gen(0))
    after = _mean_relation_loss(encoder, relation, data.labelled, data.labels)
    assert len(losses) == 40
    # below the best constant score (1/N everywhere: (1/N)(1 - 1/N) = 0.16), so the
    # prototypes discriminate, not just the output bias
    assert after < 0.8 * before and after < 0.16


def test_client_round_skips_few_shot_without_enough_labels_and_keeps_projection_private(
    faces: tuple[torch.Tensor, torch.Tensor],
) -> None:
    images, expressions = faces
    idx = _labelled_subset(expressions, 1)  # 5 labels for 5 classes: not > C (line 5)
    data = ClientData(images[idx], expressions[idx], images[20:52])
    torch.manual_seed(0)
    encoder = get_backbone("cnn-small", embedding_size=16, image_size=32)
    relation = RelationModule(16, hidden=8)
    projection = projection_head(16, 8)
    enc0, rel0, proj0 = (copy.deepcopy(m.state_dict()) for m in (encoder, relation, projection))
    cfg = FedAffectConfig(repr_steps=2, batch_size=8)
    metrics = client_round(
        encoder, relation, ClientState(projection), data, cfg, _gen(0), len(EXPRESSIONS)
    )
    assert set(metrics) == {"nt_xent"}
    assert all(torch.equal(relation.state_dict()[k], v) for k, v in rel0.items())
    assert any(not torch.equal(encoder.state_dict()[k], v) for k, v in enc0.items())
    assert any(not torch.equal(projection.state_dict()[k], v) for k, v in proj0.items())
    # NT-Xent of 8 images lies between 0 and log(2B - 1) = log 15 (random embeddings)
    assert 0.0 < metrics["nt_xent"] < math.log(15) + 0.5


def test_expression_accuracy_is_nearest_prototype_by_relation_score() -> None:
    class Cosine(nn.Module):  # relation score: 1 for the matching prototype direction
        def forward(self, protos: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
            return (
                torch.nn.functional.normalize(queries, dim=1)
                @ torch.nn.functional.normalize(protos, dim=1).T
            )

    support = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    queries = torch.tensor([[0.9, 0.1, 0.0], [0.2, 0.8, 0.0], [0.0, 0.0, 1.0], [1.0, 0.2, 0.0]])
    acc = expression_accuracy(
        nn.Identity(), Cosine(), support, torch.tensor([0, 1]), queries,
        torch.tensor([0, 1, 2, 1]), num_classes=3,
    )  # fmt: skip
    # class 2 has no support image, so it is never predicted: 2 of 4 queries are right
    assert acc == pytest.approx(0.5)


# ------------------------------------------------------------------------ the Strategy


def _strategy_config(**algorithm: object) -> Config:
    return config_from_dict(
        {
            "data": {"image_size": 32, "num_identities": 10, "images_per_identity": 10,
                     "held_out_identities": 2, "expression_strength": 2.5},
            "partition": {"num_clients": 2},
            "model": {"backbone": "cnn-small", "embedding_size": 16},
            "algorithm": {"name": "fedaffect", "labels_per_class": 3, "k_shot": 1,
                          "n_query": 1, "projection_dim": 8, "relation_hidden": 8,
                          **algorithm},
            "train": {"local_steps": 2, "batch_size": 8, "optimizer": "adam", "lr": 1e-3},
        }
    )  # fmt: skip


def test_expression_targets_label_a_spread_few_per_class_and_mark_the_rest() -> None:
    # Prepare: 12 images, expressions 0 x6, 1 x4, 2 x2, no 3 or 4
    expr = np.array([0, 1, 0, 0, 1, 2, 0, 1, 0, 2, 1, 0])
    data = FaceDataset(
        images=torch.zeros(12, 3, 4, 4),
        labels=torch.zeros(12, dtype=torch.int64),
        identity_names=("a",),
        attributes={"expression": expr},
    )
    # Execute
    targets = expression_targets(data, 3).numpy()
    # Assert: 3 of class 0 at the first, middle and last of its 6 positions (0, 3.?, 11)
    zeros = np.flatnonzero(expr == 0)  # [0, 2, 3, 6, 8, 11]
    assert np.flatnonzero(targets == 0).tolist() == zeros[[0, 2, 5]].tolist()
    assert np.flatnonzero(targets == 1).tolist() == [1, 7, 10]  # of [1, 4, 7, 10]
    assert np.flatnonzero(targets == 2).tolist() == [5, 9]  # all 2 available
    assert (targets[targets >= 0] == expr[targets >= 0]).all()
    assert (targets == -1).sum() == 12 - 8
    with pytest.raises(DataError, match="expression"):
        expression_targets(dataclasses.replace(data, attributes={}), 3)


def test_strategy_trains_f_g_and_private_p_and_reports_the_data_size() -> None:
    # Prepare: a client of the plan, built as a gRPC client builds it
    config = _strategy_config()
    plan = plan_federation(config)
    share = plan.clients[0]
    trainer = build_local_trainer(
        config, share.train, share.test, plan.train_identities, client_id="c", image_size=32
    )
    model = trainer.model
    assert isinstance(model, FedAffectModel) and isinstance(trainer.strategy, FedAffect)
    names = [f"backbone.{k}" for k in model.backbone.state_dict()]
    names += [f"head.{k}" for k in model.relation.state_dict()]
    assert trainer.shared_names == names  # f and g
    assert trainer._private_names() == [k for k in model.state_dict() if "projection." in k]
    shared = get_tensors(model, names)
    p0 = {k: v.clone() for k, v in model.projection.state_dict().items()}
    # Execute
    result = trainer.strategy.client_update(
        model, trainer.data, local_training(config.train), shared, generator=_gen(0)
    )
    # Assert: the update covers f and g only, both moved; p moved too but is not in it
    assert list(result.update) == names
    moved = {k for k, v in result.update.items() if np.abs(v).max() > 0}
    assert any(k.startswith("backbone.") for k in moved)
    assert any(k.startswith("head.") for k in moved)
    assert any(not torch.equal(model.projection.state_dict()[k], v) for k, v in p0.items())
    # D_k = labelled + unlabelled; 2 episodes and 2 NT-Xent steps
    labelled = int((trainer.data.train_targets >= 0).sum())
    assert result.num_examples == len(share.train)
    assert result.metrics["labelled"] == labelled
    assert result.metrics["labelled"] + result.metrics["unlabelled"] == len(share.train)
    assert result.metrics["local_steps"] == 4.0
    assert set(result.metrics) >= {"relation_loss", "nt_xent"}


def test_ablation_without_unlabelled_runs_no_nt_xent() -> None:
    config = _strategy_config(use_unlabelled=False)
    plan = plan_federation(config)
    share = plan.clients[1]
    trainer = build_local_trainer(
        config, share.train, share.test, plan.train_identities, client_id="c", image_size=32
    )
    p0 = {k: v.clone() for k, v in trainer.model.state_dict().items() if "projection." in k}
    shared = get_tensors(trainer.model, trainer.shared_names)
    result = trainer.strategy.client_update(
        trainer.model, trainer.data, local_training(config.train), shared, generator=_gen(1)
    )
    assert "nt_xent" not in result.metrics and "relation_loss" in result.metrics
    assert result.metrics["local_steps"] == 2.0
    state = trainer.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in p0.items())  # p untouched


def test_same_initial_encoder_as_build_model_and_server_initial_parameters(
    tmp_path: Path,
) -> None:
    config = _strategy_config()
    fa = build_fedaffect_model(config.model, config.algorithm, 32, config.run.seed)
    plain = build_model(config.model, 3, 32, config.run.seed)
    for k, v in plain.backbone.state_dict().items():
        assert torch.equal(fa.backbone.state_dict()[k], v)
    side = build_server(config, RunDir(tmp_path), enrolled={"client-0", "client-1"})
    initial = side.coordinator.params
    assert list(initial) == side.strategy.shared_names(fa)
    for k, v in get_tensors(fa, initial).items():
        np.testing.assert_array_equal(initial[k], v)


def test_expression_evaluator_matches_a_direct_computation() -> None:
    config = _strategy_config()
    plan = plan_federation(config)
    model = build_fedaffect_model(config.model, config.algorithm, 32, 5)
    params = get_tensors(model, [k for k in model.state_dict() if "projection." not in k])
    evaluate = make_expression_evaluator(config.model, config.algorithm, 32, 0, plan.held_out)
    got = evaluate(params)
    s_img, s_lab, q_img, q_lab = held_out_expression_split(plan.held_out, 3)
    assert len(s_lab) + len(q_lab) == len(plan.held_out)
    assert torch.bincount(s_lab, minlength=5).max() <= 3
    want = expression_accuracy(model.backbone, model.relation, s_img, s_lab, q_img, q_lab, 5)
    assert got["expression_accuracy"] == pytest.approx(want)
    counts = torch.bincount(q_lab, minlength=5)
    assert got["expression_majority"] == pytest.approx(float(counts.max()) / len(q_lab))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.labels_per_class=0"], "algorithm.labels_per_class"),
        (["algorithm.n_way=6"], "algorithm.n_way"),
        (["algorithm.k_shot=0"], "algorithm.k_shot"),
        (["algorithm.n_query=0"], "algorithm.n_query"),
        (["algorithm.nt_xent_tau=0"], "algorithm.nt_xent_tau"),
        (["algorithm.projection_dim=0"], "algorithm.projection_dim"),
        (["algorithm.relation_hidden=0"], "algorithm.relation_hidden"),
        (["data.expression_strength=2.6"], "data.expression_strength"),
        (["privacy.unit=example", "privacy.noise_multiplier=1.0"], "NT-Xent couples"),
    ],
)
def test_fedaffect_config_is_range_checked(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_config(config_from_dict({"algorithm": {"name": "fedaffect"}}, overrides))


def test_registry_builds_fedaffect_with_the_run_settings() -> None:
    params = AlgorithmConfig(name="fedaffect", labels_per_class=7)
    strategy = get_strategy("fedaffect", params)
    assert isinstance(strategy, FedAffect) and strategy.params.labels_per_class == 7
    assert strategy.shares_head and not strategy.uploads_head


def test_the_simulation_refuses_fedaffect_with_a_pointer_to_the_grpc_path() -> None:
    from fl_secure.app.simulation import simulate

    with pytest.raises(ConfigError, match="fl-secure train"):
        simulate(_strategy_config())


def test_client_evaluation_is_expression_accuracy_against_its_own_labelled_support() -> None:
    # Prepare: a FedAffect client of a tiny synthetic run (expressions learnable at 2.5)
    from client.trainer_factory import build_local_trainer
    from fl_secure.algorithms.fedaffect_relation import expression_accuracy as accuracy_of
    from fl_secure.config import config_from_dict
    from fl_secure.data.plan import plan_federation

    config = config_from_dict(
        {
            "data": {"image_size": 32, "num_identities": 8, "images_per_identity": 10,
                     "held_out_identities": 2, "expression_strength": 2.5},
            "partition": {"num_clients": 2},
            "model": {"backbone": "cnn-small", "embedding_size": 16},
            "algorithm": {"name": "fedaffect", "labels_per_class": 2},
            "server": {"min_clients": 2},
        }
    )  # fmt: skip
    plan = plan_federation(config)
    share = plan.clients[0]
    trainer = build_local_trainer(
        config, share.train, share.test, plan.train_identities, client_id="c0", image_size=32
    )
    # Execute
    _, metrics = trainer.evaluate(trainer.shared_parameters())
    # Assert: the relation scores of its test images against the prototypes of its labelled
    # training images (the support), and the majority-class rate beside it
    data = trainer.data
    labelled = data.train_targets >= 0
    truth = torch.from_numpy(np.asarray(data.test.attributes["expression"], dtype=np.int64))
    expected = accuracy_of(
        trainer.model.backbone, trainer.model.head, data.train.images[labelled],
        data.train_targets[labelled], data.test.images, truth, 5,
    )  # fmt: skip
    assert metrics["expression_accuracy"] == pytest.approx(expected)
    assert 0.0 <= metrics["expression_accuracy"] <= 1.0
    majority = float(torch.bincount(truth, minlength=5).max()) / len(truth)
    assert metrics["expression_majority"] == pytest.approx(majority)
