"""FedGC / FedCos server step (FedGC paper, Algorithm 1 line 13, Eq. 5, Eq. 11, Remark)."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from client.trainer import LocalTrainer
from fl_secure.algorithms import FedCos, FedGC, FedPE, check_config, get_strategy
from fl_secure.algorithms.fedgc import (
    WEIGHT,
    correct_embeddings,
    cosine_regularizer,
    softmax_regularizer,
)
from fl_secure.checkpoints import CheckpointStore
from fl_secure.config import (
    AlgorithmConfig,
    Config,
    ModelConfig,
    PrivacyConfig,
    SecureAggregationConfig,
)
from fl_secure.data.types import FaceDataset
from fl_secure.errors import ConfigError
from fl_secure.messages import LocalTraining, Tensors
from fl_secure.training import build_model


def _heads(seed: int, rows: tuple[int, ...] = (4, 3, 5), d: int = 8) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((r, d)) for r in rows]


def _reg(weights: list[np.ndarray], kind: str = "softmax", normalize: bool = True) -> float:
    owners = torch.cat([torch.full((len(w),), k) for k, w in enumerate(weights)])
    w = torch.from_numpy(np.concatenate(weights))
    fn = softmax_regularizer if kind == "softmax" else cosine_regularizer
    return float(fn(w, owners, normalize=normalize))


def _eq11_gradient(weights: list[np.ndarray]) -> np.ndarray:
    """Eq. 11 summed over anchors, written out with loops: only cross-client pairs appear."""
    w = np.concatenate(weights)
    owners = np.concatenate([np.full(len(x), k) for k, x in enumerate(weights)])
    grad = np.zeros_like(w)
    for a in range(len(w)):  # anchor W'_ki
        others = [b for b in range(len(w)) if owners[b] != owners[a]]
        denominator = np.exp(w[a] @ w[a]) + sum(np.exp(w[b] @ w[a]) for b in others)
        for b in others:  # dReg/dW_zj += p(zj | ki) W'_ki
            grad[b] += np.exp(w[b] @ w[a]) / denominator * w[a]
    return grad


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_softmax_step_decreases_eq5(seed: int, normalize: bool) -> None:
    # Prepare: three clients' class embeddings; the paper's lambda 20, a round lr of 1e-3
    weights = _heads(seed)
    # Execute
    after = correct_embeddings(weights, step=20 * 1e-3, normalize=normalize)
    # Assert: Reg (Eq. 5) went down and every row moved
    assert _reg(after, normalize=normalize) < _reg(weights, normalize=normalize)
    for before, now in zip(weights, after, strict=True):
        assert np.all(np.linalg.norm(now - before, axis=1) > 1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_cosine_step_decreases_fedcos_regularizer(seed: int) -> None:
    weights = _heads(seed)
    after = correct_embeddings(weights, step=1e-3, regularizer="cosine")
    assert _reg(after, "cosine") < _reg(weights, "cosine")


def test_gradient_is_eq11_with_cross_client_pairs_only() -> None:
    # Prepare: unit rows, so normalisation is the identity at this point and Eq. 5 verbatim
    weights = [w / np.linalg.norm(w, axis=1, keepdims=True) for w in _heads(3)]
    step = 0.05
    # Execute: the implemented step (autograd) without normalisation
    after = correct_embeddings(weights, step=step, normalize=False)
    # Assert: W - step * (Eq. 11), the hand-written cross-client-only gradient
    expected = np.concatenate(weights) - step * _eq11_gradient(weights)
    np.testing.assert_allclose(np.concatenate(after), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("regularizer", ["softmax", "cosine"])
def test_one_client_has_no_correction(regularizer: str) -> None:
    (weight,) = _heads(4, rows=(6,))
    (after,) = correct_embeddings([weight], step=10.0, regularizer=regularizer)  # type: ignore[arg-type]
    np.testing.assert_array_equal(after, weight)
    assert _reg([weight], regularizer) == 0.0


@pytest.mark.parametrize("regularizer", ["softmax", "cosine"])
def test_within_client_geometry_is_unchanged_to_first_order(regularizer: str) -> None:
    # Prepare: each client's rows live in its own coordinate block, so the cross-client
    # gradient of a row (a combination of the other clients' rows, Eq. 11) is orthogonal to
    # every row of its own client.
    rng = np.random.default_rng(5)
    weights = []
    for k in range(3):
        w = np.zeros((3, 12))
        w[:, 4 * k : 4 * k + 4] = rng.standard_normal((3, 4))
        weights.append(w)

    def own_cosines(ws: list[np.ndarray]) -> np.ndarray:
        return np.stack([_cos(w) for w in ws])

    before = own_cosines(weights)
    changes = []
    for step in (1e-3, 2e-3):
        after = correct_embeddings(weights, step=step, regularizer=regularizer)  # type: ignore[arg-type]
        # the own block of every row is exactly as it was: no within-client term
        for k, (w0, w1) in enumerate(zip(weights, after, strict=True)):
            np.testing.assert_allclose(w1[:, 4 * k : 4 * k + 4], w0[:, 4 * k : 4 * k + 4])
            assert np.abs(w1 - w0).max() > 1e-6  # ... while the rows did move
        changes.append(np.abs(own_cosines(after) - before).max())
    # Assert: within-client cosines change at second order only (doubling the step ~x4)
    assert changes[0] < 1e-4
    assert 3.5 < changes[1] / changes[0] < 4.5


def _cos(w: np.ndarray) -> np.ndarray:
    u = w / np.linalg.norm(w, axis=1, keepdims=True)
    cosines: np.ndarray = u @ u.T
    return cosines


def test_strategy_step_changes_only_the_class_embeddings() -> None:
    # Prepare: two clients with a softmax head (weight and bias)
    w0, w1 = (w.astype(np.float32) for w in _heads(6, rows=(3, 2)))
    bias = "head.classifier.bias"
    heads = {
        "c0": OrderedDict([(WEIGHT, w0), (bias, np.ones(3, np.float32))]),
        "c1": OrderedDict([(WEIGHT, w1), (bias, np.zeros(2, np.float32))]),
    }
    strategy = FedGC(reg_lambda=20.0)
    # Execute
    out = strategy.server_heads(heads, learning_rate=1e-3, round_=1)
    # Assert: biases untouched, weights = the joint step in sorted client order (lambda *
    # the server's eta 0.1, at the default CosFace logit scale 30; not the clients' lr)
    expected = correct_embeddings([heads["c0"][WEIGHT], heads["c1"][WEIGHT]], step=2.0, scale=30.0)
    for k, client in enumerate(("c0", "c1")):
        assert list(out[client]) == list(heads[client])
        np.testing.assert_array_equal(out[client][bias], heads[client][bias])
        np.testing.assert_array_equal(out[client][WEIGHT], expected[k])
        assert out[client][WEIGHT].dtype == np.float32


def test_a_softmax_head_gets_eq5_on_its_raw_rows_and_a_margin_head_on_directions() -> None:
    # Prepare: rows of different norms (a softmax head's logits depend on them)
    rng = np.random.default_rng(7)
    weights = [w * rng.uniform(0.5, 2.0, size=(len(w), 1)) for w in _heads(3)]
    heads = {f"c{k}": OrderedDict([(WEIGHT, w)]) for k, w in enumerate(weights)}
    step, lr = 0.05, 1e-3  # lambda 20 x the server's eta 0.0025; lr: the clients', unused
    # Execute: the strategies a run builds for each head kind
    softmax = get_strategy("fedgc", AlgorithmConfig(reg_eta=step / 20.0), head="softmax")
    cosface = get_strategy("fedgc", AlgorithmConfig(reg_eta=step / 20.0), head="cosface")
    raw = softmax.server_heads(heads, learning_rate=lr, round_=1)
    directions = cosface.server_heads(heads, learning_rate=lr, round_=1)
    # Assert: softmax = W - step * Eq. 11 (Eq. 5 verbatim); cosface = the normalised step at
    # CosFace's logit scale
    expected = np.concatenate(weights) - step * _eq11_gradient(weights)
    got = np.concatenate([raw[f"c{k}"][WEIGHT] for k in range(3)])
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
    normalised = correct_embeddings(weights, step=step, normalize=True, scale=30.0)
    for k in range(3):
        np.testing.assert_array_equal(directions[f"c{k}"][WEIGHT], normalised[k])
    assert not np.allclose(got, np.concatenate(normalised))


def test_fedgc_is_fedpe_on_the_client_with_heads_uploaded() -> None:
    # Prepare
    model = build_model(ModelConfig(backbone="cnn-small", embedding_size=8), 3, 32, 0)
    labels = torch.tensor([7, 7, 9, 11])
    names = tuple(f"id-{i}" for i in range(20))
    data = FaceDataset(images=torch.zeros(4, 3, 32, 32), labels=labels, identity_names=names)
    identities = np.arange(20)
    gc, pe = get_strategy("fedgc", AlgorithmConfig(reg_lambda=5.0)), FedPE()
    # Execute
    local = gc.local_data(data, data, identities)
    # Assert: private head over the client's own classes only, so no absent-class mask
    assert isinstance(gc, FedGC) and gc.reg_lambda == 5.0
    assert local.class_mask is None and local.train_targets.tolist() == [0, 0, 1, 2]
    assert gc.shared_names(model) == pe.shared_names(model)
    assert gc.head_names(model) == ["head.classifier.weight"] and pe.head_names(model) == []
    assert gc.exposure == FedCos.exposure == "server-sees-heads"
    assert isinstance(get_strategy("fedcos", AlgorithmConfig()), FedCos)


def test_fedgc_refuses_secure_aggregation_and_client_level_dp() -> None:
    fedgc = AlgorithmConfig(name="fedgc")
    secagg = SecureAggregationConfig(scheme="secagg")
    with pytest.raises(ConfigError, match="secure aggregation exists to hide"):
        check_config(Config(algorithm=fedgc, secure_aggregation=secagg))
    with pytest.raises(ConfigError, match="privacy.unit = 'client'"):
        check_config(
            Config(
                algorithm=AlgorithmConfig(name="fedcos"),
                privacy=PrivacyConfig(unit="client", noise_placement="local", noise_multiplier=1.0),
            )
        )
    # example-level DP composes (the heads are DP-SGD output), and lambda must be >= 0
    check_config(
        Config(algorithm=fedgc, privacy=PrivacyConfig(unit="example", noise_multiplier=1.0))
    )
    with pytest.raises(ConfigError, match="algorithm.reg_lambda"):
        AlgorithmConfig(name="fedgc", reg_lambda=-1.0)


def test_checkpoint_keeps_per_client_heads(tmp_path: Path) -> None:
    # Prepare
    store = CheckpointStore(tmp_path)
    params: Tensors = OrderedDict([("backbone.w", np.ones(3, np.float32))])
    heads: dict[str, Tensors] = {
        "client-1": OrderedDict(
            [(WEIGHT, np.full((2, 3), 1.0, np.float32)), ("head.b", np.ones(2))]
        ),
        "client-0": OrderedDict(
            [(WEIGHT, np.full((4, 3), 2.0, np.float32)), ("head.b", np.ones(4))]
        ),
    }
    # Execute
    store.save(1, params, {"status": "running"}, client_tensors=heads)
    loaded = store.latest()
    # Assert: same clients, tensor order and values; the round state has no extra keys
    assert loaded is not None and loaded.state == {"status": "running"}
    assert set(loaded.client_tensors) == set(heads)
    for client, tensors in heads.items():
        assert list(loaded.client_tensors[client]) == list(tensors)
        for name, value in tensors.items():
            np.testing.assert_array_equal(loaded.client_tensors[client][name], value)


def test_client_trains_from_the_head_the_server_sent() -> None:
    # Prepare: a FedGC client with 3 identities and a head the server corrected
    strategy = FedGC()
    model = build_model(ModelConfig(backbone="cnn-small", embedding_size=8), 3, 32, 0)
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    names = ("a", "b", "c")
    images = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    data = FaceDataset(images=images, labels=labels, identity_names=names)
    trainer = LocalTrainer(strategy, model, strategy.local_data(data, data, np.arange(3)), seed=0)
    local = model.head.weight.detach().numpy().copy()
    sent = np.random.default_rng(1).standard_normal(local.shape).astype(np.float32)
    shared = trainer.shared_parameters()
    training = LocalTraining(local_steps=1, batch_size=6, learning_rate=1e-9, momentum=0.0)
    # Execute
    update, examples, _ = trainer.train(OrderedDict([*shared.items(), (WEIGHT, sent)]), training)
    # Assert: the update is the shared update, then the head trained from the sent rows
    assert list(update) == [*shared, WEIGHT] and examples == 6
    np.testing.assert_allclose(update[WEIGHT], sent, atol=1e-6)
    assert np.abs(sent - local).max() > 0.5
    assert all(np.abs(update[k]).max() < 1e-6 for k in shared)  # lr ~ 0: no backbone change


def _fedpe_trainer(state_dir: Path) -> LocalTrainer:
    strategy = FedPE()
    model = build_model(ModelConfig(backbone="cnn-small", embedding_size=8), 3, 32, 0)
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    images = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    data = FaceDataset(images=images, labels=labels, identity_names=("a", "b", "c"))
    local = strategy.local_data(data, data, np.arange(3))
    return LocalTrainer(strategy, model, local, state_dir=state_dir, seed=0)


def test_a_diverged_round_leaves_the_private_head_as_it_was(tmp_path: Path, caplog) -> None:
    from fl_secure.errors import ProtocolError

    # Prepare: a FedPE client (private head) whose state was saved once
    trainer = _fedpe_trainer(tmp_path)
    shared = trainer.shared_parameters()
    trainer.train(shared, LocalTraining(local_steps=1, batch_size=6, learning_rate=0.01))
    saved = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert saved
    head = trainer.model.head.weight.detach().clone()
    # Execute: a round with an infinite learning rate (a broken or hostile server's task)
    with caplog.at_level("ERROR", logger="client.trainer"):
        trainer.train(shared, LocalTraining(local_steps=1, batch_size=6, learning_rate=np.inf))
    # Assert: the file is unchanged, the model holds the saved head again, and a restart
    # loads a finite head
    assert "not saving the private state" in caplog.text
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == saved
    assert torch.equal(trainer.model.head.weight, head)
    assert torch.isfinite(_fedpe_trainer(tmp_path).model.head.weight).all()
    # parameters that do not fit the model are refused with the protocol's error
    wrong = OrderedDict((k, np.zeros((2, *v.shape), v.dtype)) for k, v in shared.items())
    with pytest.raises(ProtocolError, match="has shape"):
        trainer.train(wrong, LocalTraining(local_steps=1, batch_size=6))
    with pytest.raises(ProtocolError, match="do not match this client's model"):
        trainer.train(OrderedDict(list(shared.items())[1:]), LocalTraining(local_steps=1))
