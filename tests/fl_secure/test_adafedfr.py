"""AdaFedFR: Eq. 4 representations, Eq. 6 selection and loss, Eq. 8 weights, Algorithm 1."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F  # noqa: N812

from fl_secure.algorithms import get_strategy
from fl_secure.algorithms.adafedfr import (
    AdaFedFR,
    bytes_per_round,
    public_dataset,
    public_identity_features,
)
from fl_secure.algorithms.adafedfr_losses import (
    LOSS_WEIGHTS,
    TAU,
    ClientState,
    SelectionVector,
    adafedfr_losses,
    k_negative_contrastive_loss,
    select_negatives,
)
from fl_secure.app.simulation import simulate
from fl_secure.config import ModelConfig, load_config
from fl_secure.data.plan import load_dataset
from fl_secure.data.types import FaceDataset
from fl_secure.messages import LocalTraining
from fl_secure.training import FaceModel, LocalData, build_model, embed, get_tensors

CFG = ModelConfig(backbone="cnn-small", embedding_size=16)  # CosFace s=30, m=0.4 by default
SIZE = 32


def _f(value: torch.Tensor) -> float:
    return float(value.detach())


def _images(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _dataset(labels: list[int], seed: int) -> FaceDataset:
    names = tuple(f"id-{i}" for i in range(max(labels) + 1))
    return FaceDataset(_images(len(labels), seed), torch.tensor(labels), names)


def _client(strategy: AdaFedFR, num_public: int = 6) -> tuple[FaceModel, LocalData]:
    """A tiny model with a private head over 3 local identities, and its data."""
    train = _dataset([0, 0, 0, 1, 1, 1, 2, 2, 2], seed=1)
    test = _dataset([0, 1, 2], seed=2)
    data = strategy.local_data(train, test, np.arange(3))
    model = build_model(CFG, 3, SIZE, seed=0)
    public = _dataset([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5][: 2 * num_public], seed=3)
    strategy.public_representations = public_identity_features(
        model.backbone, public.images, public.labels
    )
    return model, data


def test_eq4_means_equal_a_direct_computation() -> None:
    # Prepare: a random backbone and public images of identities 9, 3, 7 (unsorted, uneven)
    backbone = build_model(CFG, 1, SIZE, seed=0).backbone.train()
    labels = torch.tensor([9, 3, 9, 7, 3, 9, 7, 7, 7, 3])
    images = _images(len(labels), seed=5)
    # Execute
    r = public_identity_features(backbone, images, labels, batch_size=3)
    # Assert: row g = normalize(mean over identity g of normalize(F(x))), sorted identities,
    # computed here one identity and one image at a time
    backbone.eval()
    expected = []
    for identity in (3, 7, 9):
        feats = [F.normalize(backbone(images[i : i + 1]), dim=1)[0] for i in range(len(labels))]
        own = [f for f, y in zip(feats, labels.tolist(), strict=True) if y == identity]
        mean = torch.stack(own).mean(dim=0)
        expected.append(mean / mean.norm())
    assert r.shape == (3, CFG.embedding_size)
    torch.testing.assert_close(r, torch.stack(expected).detach(), atol=1e-6, rtol=1e-5)
    assert backbone.training is False  # we switched it; the function restores what it found
    backbone.train()
    public_identity_features(backbone, images, labels)
    assert backbone.training is True


def test_phi_stays_in_open_interval_under_large_gradients() -> None:
    # Prepare: phi over 8 public identities; huge gradients pushing half up, half down
    selection = SelectionVector(8)
    opt = torch.optim.SGD(selection.parameters(), lr=10.0, momentum=0.9)
    sign = torch.tensor([1.0, -1.0] * 4)
    # Execute: 300 steps of 1e6 * (+-phi)
    for _ in range(300):
        opt.zero_grad()
        (1e6 * sign * selection()).sum().backward()
        opt.step()
        selection.project_()
        phi = selection().detach()
        # Assert: strictly inside (0, 1) and finite after every step
        assert bool(torch.isfinite(phi).all())
        assert float(phi.min()) > 0.0 and float(phi.max()) < 1.0
    assert float(phi[sign > 0].max()) < 1e-4 and float(phi[sign < 0].min()) > 1 - 1e-4
    # ... and phi can still come back (the sigmoid is not saturated to a zero gradient)
    before = selection().detach().clone()
    plain = torch.optim.SGD(selection.parameters(), lr=1e5)
    plain.zero_grad()
    (-sign * selection()).sum().backward()
    plain.step()
    assert bool((selection().detach()[sign > 0] > before[sign > 0]).all())


def test_top_k_picks_the_k_largest_weighted_terms() -> None:
    # Prepare: similarities of 5 samples to 20 public representations, a random phi
    g = torch.Generator().manual_seed(0)
    sim = torch.rand(5, 20, generator=g, dtype=torch.float64) * 2 - 1
    phi = torch.rand(20, generator=g, dtype=torch.float64) * 0.98 + 0.01
    # Execute
    chosen = select_negatives(sim, phi, k=4)
    # Assert: per row, exactly the 4 indices of largest phi_i e^{sim_i / tau} (brute force)
    for b in range(5):
        terms = [float(phi[i]) * math.exp(float(sim[b, i]) / TAU) for i in range(20)]
        expected = sorted(range(20), key=lambda i: -terms[i])[:4]
        assert sorted(chosen[b].tolist()) == sorted(expected)
    # with phi constant the choice is the k most similar representations
    flat = select_negatives(sim, torch.full((20,), 0.5, dtype=torch.float64), k=3)
    for b in range(5):
        assert sorted(flat[b].tolist()) == sorted(torch.argsort(-sim[b])[:3].tolist())
    # k >= G keeps every representation
    assert select_negatives(sim, phi, k=50).shape == (5, 20)


def test_eq6_loss_equals_a_direct_computation() -> None:
    # Prepare: features, global features, R and phi
    g = torch.Generator().manual_seed(1)
    f, fg = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    r = F.normalize(torch.randn(10, 8, generator=g), dim=1)
    phi = torch.rand(10, generator=g) * 0.9 + 0.05
    for k in (3, 10):
        # Execute
        loss = k_negative_contrastive_loss(f, fg, r, phi, k)
        # Assert: -log(e^{p/tau} / (e^{p/tau} + sum over the top-k of phi_i e^{s_i/tau}))
        expected = 0.0
        for b in range(4):
            u = f[b] / f[b].norm()
            p = float(u @ (fg[b] / fg[b].norm()))
            terms = sorted(
                (float(phi[i]) * math.exp(float(u @ r[i]) / TAU) for i in range(10)),
                reverse=True,
            )
            expected -= math.log(math.exp(p / TAU) / (math.exp(p / TAU) + sum(terms[:k])))
        assert abs(float(loss) - expected / 4) < 1e-5


def test_eq8_total_is_the_weighted_sum_and_gradients_follow_algorithm_1() -> None:
    # Prepare: a client with its adapter and phi, a frozen copy of the global backbone
    strategy = AdaFedFR(num_negatives=3)
    model, data = _client(strategy)
    r = strategy.public_representations
    assert r is not None
    state = strategy.client_state(model, num_public=r.shape[0])
    with torch.no_grad():  # phi away from 1/2 so the check sees its weighting
        state.selection.logits.copy_(torch.linspace(-2, 2, r.shape[0]))
    reference = copy.deepcopy(model.backbone).eval()
    images, targets = data.train.images, data.train_targets

    def grads(loss: torch.Tensor) -> dict[str, torch.Tensor]:
        named = [*model.named_parameters(), *state.named_parameters(prefix="state")]
        found = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        return {
            n: torch.zeros_like(p) if gr is None else gr
            for (n, p), gr in zip(named, found, strict=True)
        }

    # Execute: Eq. 8, and the three parts computed separately
    losses = adafedfr_losses(model, state, reference, images, targets, r, k=3)
    emb = model.backbone(images)
    lmc = F.cross_entropy(model.head(emb, targets), targets)
    kcl = k_negative_contrastive_loss(emb, reference(images), r, state.selection(), 3)
    bce = state.adapter.bce_loss(emb.detach(), targets, r)
    # Assert: the weights are 1 / 5 / 10 and the total is their weighted sum
    assert LOSS_WEIGHTS == (1.0, 5.0, 10.0)
    assert math.isclose(_f(losses.lmc), _f(lmc), rel_tol=1e-6)
    assert math.isclose(_f(losses.kcl), _f(kcl), rel_tol=1e-6)
    assert math.isclose(_f(losses.bce), _f(bce), rel_tol=1e-6)
    assert _f(bce) > 0 and _f(kcl) > 0
    assert math.isclose(_f(losses.total), _f(lmc) + 5 * _f(kcl) + 10 * _f(bce), rel_tol=1e-6)
    # Algorithm 1 lines 19-22: head <- grad lmc; adapter <- grad bce; backbone <- grad
    # (lmc + kcl), never bce; phi <- grad of the total (= its kcl term)
    total = grads(losses.total)
    g_lmc = grads(F.cross_entropy(model.head(model.backbone(images), targets), targets))
    emb = model.backbone(images)
    g_kcl = grads(k_negative_contrastive_loss(emb, reference(images), r, state.selection(), 3))
    g_bce = grads(state.adapter.bce_loss(model.backbone(images).detach(), targets, r))
    for name, value in total.items():
        if name.startswith("head."):
            expected = g_lmc[name]
        elif name.startswith("backbone."):
            expected = g_lmc[name] + 5 * g_kcl[name]
            assert float(g_bce[name].abs().max()) == 0.0
        elif name.startswith("state.adapter."):
            expected = 10 * g_bce[name]
            assert float(expected.abs().max()) > 0
        else:
            assert name == "state.selection.logits"
            expected = 5 * g_kcl[name]
            assert float(expected.abs().max()) > 0
        torch.testing.assert_close(value, expected, atol=1e-5, rtol=1e-4)


def test_one_local_step_decreases_the_total_loss() -> None:
    # Prepare: a tiny client; one full-batch step without momentum or weight decay
    strategy = AdaFedFR(num_negatives=3)
    model, data = _client(strategy)
    r = strategy.public_representations
    assert r is not None
    state = strategy.client_state(model, num_public=r.shape[0])
    reference = copy.deepcopy(model.backbone).eval()  # w^t, as local_train copies it
    images, targets = data.train.images, data.train_targets

    def total() -> float:
        return _f(adafedfr_losses(model, state, reference, images, targets, r, k=3).total)

    before = total()
    training = LocalTraining(
        local_epochs=1,
        local_steps=1,
        batch_size=len(data.train),
        learning_rate=1e-5,  # s = 30 and s' = 40 make the first gradients large
        momentum=0.0,
        weight_decay=0.0,
        optimizer="sgd",
    )
    # Execute
    metrics = strategy.local_train(model, data, training, generator=torch.Generator())
    # Assert: the same state was trained, the step's loss was `before`, and it went down
    assert strategy.client_state(model) is state
    assert math.isclose(metrics["train_loss"], before, rel_tol=1e-5)
    after = total()
    assert after < before


def test_adapter_and_head_are_private() -> None:
    # Prepare: a client after one round of AdaFedFR
    strategy = AdaFedFR(num_negatives=3)
    model, data = _client(strategy)
    names = strategy.shared_names(model)
    shared = get_tensors(model, names)
    r = strategy.public_representations
    assert r is not None
    state: ClientState = strategy.client_state(model, num_public=r.shape[0])
    adapter_before = copy.deepcopy(state.adapter.state_dict())
    training = LocalTraining(local_steps=2, batch_size=4, learning_rate=0.01)
    # Execute
    result = strategy.client_update(model, data, training, shared, generator=torch.Generator())
    # Assert: only backbone tensors are shared and uploaded; the adapter trained privately
    assert names == [f"backbone.{k}" for k in model.backbone.state_dict()]
    assert list(result.update) == names
    assert not any(n.startswith(("head.", "adapter", "selection")) for n in names)
    assert all(k not in model.state_dict() for k in state.state_dict())
    changed = [
        k for k, v in state.adapter.state_dict().items() if not torch.equal(v, adapter_before[k])
    ]
    assert changed  # the adapter did train, but nothing of it is in the update
    assert strategy.exposure == "private-embedding" and strategy.shares_head is False


def test_personalized_model_starts_as_the_generic_one() -> None:
    # The adapter map is the identity at start: same embeddings as the backbone
    strategy = AdaFedFR()
    model, data = _client(strategy)
    r = strategy.public_representations
    assert r is not None
    strategy.client_state(model, num_public=r.shape[0])
    personal = embed(strategy.personalized_backbone(model), data.test.images)
    np.testing.assert_allclose(personal, embed(model.backbone, data.test.images), atol=1e-6)


def test_bytes_per_round() -> None:
    # R is G x d float32 down; the shared parameters go down and their update comes up
    model = build_model(CFG, 3, SIZE, seed=0)
    shared = get_tensors(model, AdaFedFR().shared_names(model))
    params = 4 * sum(p.numel() for p in model.backbone.parameters()) + 4 * sum(
        b.numel() for b in model.backbone.buffers() if b.dtype == torch.float32
    )
    found = bytes_per_round(shared, num_public=50, embedding_size=16)
    assert found == {
        "representations": 50 * 16 * 4,
        "parameters_down": params,
        "parameters_up": params,
        "total": 50 * 16 * 4 + 2 * params,
    }


def test_simulation_sends_r_each_round_and_counts_its_bytes(tiny_adafedfr: Path) -> None:
    # Prepare: a tiny synthetic run of AdaFedFR with 5 public identities
    config = load_config(tiny_adafedfr)
    strategy = get_strategy("adafedfr", config.algorithm)
    # Execute
    result = simulate(config)
    # Assert: the registry builds it with k from the config; every round's record has the
    # bytes of R (5 x 16 float32) plus the backbone down and its update up; the clients
    # trained on Eq. 8 (its parts are reported); the public set is disjoint from the run's
    assert isinstance(strategy, AdaFedFR) and strategy.num_negatives == 3
    params = sum(v.nbytes for v in result.params.values())
    assert list(result.params) == [n for n in result.params if n.startswith("backbone.")]
    for record in result.records[1:]:
        assert record["bytes_per_client"] == {
            "broadcast": 5 * 16 * 4,  # R, the only broadcast tensor
            "parameters_down": params,
            "parameters_up": params,
            "total": 5 * 16 * 4 + 2 * params,
        }
        for metrics in record["clients"].values():
            assert {"lmc", "kcl", "bce", "phi_mean"} <= set(metrics)
            assert 0.0 < metrics["phi_mean"] < 1.0
    public = public_dataset(config)
    assert public.identity_names[0] == "synthetic-000012" and len(public) == 10
    run_ids = set(load_dataset(config.data, config.run.seed).identity_names)
    assert run_ids.isdisjoint(public.identity_names)


def test_a_restarted_client_continues_with_its_adapter_and_phi(tmp_path: Path, caplog) -> None:
    # Prepare: a client whose adapter and phi moved away from their initial values.
    from safetensors.torch import load_file, save

    from client.trainer import LocalTrainer

    strategy = AdaFedFR()
    model, data = _client(strategy)
    trainer = LocalTrainer(strategy, model, data, state_dir=tmp_path, seed=0)
    state = strategy.client_state(model, num_public=6)
    with torch.no_grad():
        for p in state.parameters():
            p.add_(torch.randn_like(p))
    saved = {k: v.clone() for k, v in state.state_dict().items()}

    # Execute: the client evaluates (which saves its private state), then restarts.
    trainer.evaluate(trainer.shared_parameters())
    restarted_strategy = AdaFedFR()
    restarted_model, _ = _client(restarted_strategy)
    LocalTrainer(restarted_strategy, restarted_model, data, state_dir=tmp_path, seed=0)

    # Assert: the same adapter and phi, so the same personalised embeddings.
    restored = restarted_strategy.client_state(restarted_model).state_dict()
    assert set(restored) == set(saved) and len(saved) >= 4
    for k, v in saved.items():
        assert torch.equal(restored[k], v), k
    images = data.test.images[:4]
    with torch.no_grad():
        torch.testing.assert_close(
            restarted_strategy.personalized(restarted_model)(images),
            strategy.personalized(model)(images),
        )

    # A saved state that does not fit this model is ignored with a warning naming why.
    path = tmp_path / "private.safetensors"
    tensors = load_file(str(path))
    tensors["strategy.adapter.classes"] = torch.zeros(5, 16)
    path.write_bytes(save(tensors))
    other_strategy = AdaFedFR()
    other_model, _ = _client(other_strategy)
    with caplog.at_level("WARNING"):
        LocalTrainer(other_strategy, other_model, data, state_dir=tmp_path, seed=0)
    assert other_model not in other_strategy._states
    assert "the saved AdaFedFR state does not fit this model" in caplog.text
