"""HF-MAML: the Hessian-free product (Eq. 3), the update (Eq. 1-2), masking, the registry."""

from __future__ import annotations

import numpy as np
import torch

from fl_secure.algorithms import get_strategy
from fl_secure.algorithms.hfmaml import _grads, _loss, finite_difference_hvp, hfmaml_step
from fl_secure.config import AlgorithmConfig, ModelConfig
from fl_secure.training import build_model

CFG = ModelConfig(backbone="cnn-small", embedding_size=16, head="cosface", scale=16, margin=0.2)


def _smooth_model():
    """The small face model in float64 with GELU for ReLU: Eq. 3 assumes a twice
    differentiable loss (a ReLU kink crossed by w +- delta v makes any finite difference of
    gradients jump, whatever delta)."""
    model = build_model(CFG, 4, 32, seed=0).double()
    for module in model.modules():
        for name, child in module.named_children():
            if isinstance(child, torch.nn.ReLU):
                setattr(module, name, torch.nn.GELU())
    return model


def _batch(seed: int, n: int = 6, classes: int = 4):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, 32, 32, generator=g, dtype=torch.float64)
    targets = torch.randint(0, classes, (n,), generator=g)
    return images, targets, None


def test_finite_difference_hvp_matches_autograd() -> None:
    # Prepare: a small float64 face model, a batch and a direction v
    model = _smooth_model()
    params = [p for p in model.parameters() if p.requires_grad]
    batch = _batch(1)
    g = torch.Generator().manual_seed(2)
    v = [torch.randn(p.shape, generator=g, dtype=torch.float64) * 1e-2 for p in params]
    # Execute: Eq. 3 with delta = 1e-3, and autograd's exact H v (double backward)
    fd = finite_difference_hvp(model, batch, v, delta=1e-3)
    grads = torch.autograd.grad(_loss(model, *batch), params, create_graph=True)
    dot = sum((gi * vi).sum() for gi, vi in zip(grads, v, strict=True))
    exact = torch.autograd.grad(dot, params, allow_unused=True)
    exact = [torch.zeros_like(p) if e is None else e for p, e in zip(params, exact, strict=True)]
    # Assert: relative error < 1e-3 (the acceptance bound), parameters restored bit-exactly
    flat_fd = torch.cat([t.ravel() for t in fd])
    flat_exact = torch.cat([t.ravel() for t in exact])
    assert float((flat_fd - flat_exact).norm() / flat_exact.norm()) < 1e-3
    again = _smooth_model()
    for a, b in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)


def test_alpha_zero_reduces_to_sgd_on_the_second_batch() -> None:
    # With alpha = 0: w~ = w and w <- w - beta grad f(w, D'): one SGD step on D'
    model = build_model(CFG, 4, 32, seed=0).double()
    reference = build_model(CFG, 4, 32, seed=0).double()
    batches = [_batch(s) for s in (3, 4, 5)]
    hfmaml_step(model, batches, alpha=0.0, beta=0.1, delta=1e-3)
    params = [p for p in reference.parameters() if p.requires_grad]
    grads = _grads(_loss(reference, *batches[1]), params)
    with torch.no_grad():
        for p, gr in zip(params, grads, strict=True):
            p.sub_(0.1 * gr)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_step_follows_eq1_with_the_hessian_term() -> None:
    # w_new = w - beta (g - alpha H g), g = grad f(w - alpha grad F(w, D), D')
    model, reference = _smooth_model(), _smooth_model()
    batches = [_batch(s) for s in (6, 7, 8)]
    alpha, beta, delta = 0.05, 0.1, 1e-8  # Eq. 3 errs by O(delta^2 ||g||^2), ||g|| ~ 300
    hfmaml_step(model, batches, alpha=alpha, beta=beta, delta=delta)
    params = [p for p in reference.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    inner = _grads(_loss(reference, *batches[0]), params)
    with torch.no_grad():
        for p, gr in zip(params, inner, strict=True):
            p.sub_(alpha * gr)
    g = _grads(_loss(reference, *batches[1]), params)
    with torch.no_grad():
        for p, s in zip(params, start, strict=True):
            p.copy_(s)
    grads = torch.autograd.grad(_loss(reference, *batches[2]), params, create_graph=True)
    dot = sum((gi * vi).sum() for gi, vi in zip(grads, g, strict=True))
    hg = torch.autograd.grad(dot, params, allow_unused=True)
    hg = [torch.zeros_like(p) if h is None else h for p, h in zip(params, hg, strict=True)]
    expected = [s - beta * (gi - alpha * hi) for s, gi, hi in zip(start, g, hg, strict=True)]
    got = [p.detach() for p in model.parameters() if p.requires_grad]
    err = max(float((a - b).abs().max()) for a, b in zip(got, expected, strict=True))
    scale = max(float(p.abs().max()) for p in expected)
    assert err < 1e-6 * scale  # Eq. 3's O(delta^2) error, relative to the weights


def test_registry_and_absent_classes_stay_frozen() -> None:
    # Prepare: the global-head variant; the client holds classes 0 and 2 of 5
    from fl_secure.data.types import FaceDataset
    from fl_secure.messages import LocalTraining
    from fl_secure.training import LocalData

    strategy = get_strategy("hfmaml-global", AlgorithmConfig(name="hfmaml-global"))
    assert strategy.exposure == "global-head" and "HF-MAML" in strategy.describe()
    assert get_strategy("hfmaml", AlgorithmConfig(name="hfmaml")).exposure == "private-embedding"
    model = build_model(CFG, 5, 32, seed=0)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(24, 3, 32, 32, generator=g)
    labels = torch.tensor([0, 2] * 12)
    data = FaceDataset(images=images, labels=labels, identity_names=["a", "b", "c", "d", "e"])
    mask = torch.tensor([True, False, True, False, False])
    local = LocalData(train=data, test=data, train_targets=labels, class_mask=mask)
    before = model.head.weight.detach().clone()
    # Execute
    metrics = strategy.local_train(
        model, local, LocalTraining(local_steps=3, batch_size=4), generator=g
    )
    # Assert: held classes moved, absent ones are exactly as sent
    after = model.head.weight.detach()
    assert torch.equal(after[~mask], before[~mask])
    assert not torch.equal(after[mask], before[mask])
    assert metrics["local_steps"] == 3.0 and np.isfinite(metrics["train_loss"])


def test_a_client_with_fewer_than_three_images_is_named() -> None:
    import pytest

    from fl_secure.data.types import FaceDataset
    from fl_secure.messages import LocalTraining
    from fl_secure.training import LocalData

    strategy = get_strategy("hfmaml", AlgorithmConfig(name="hfmaml"))
    model = build_model(CFG, 2, 32, seed=0)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    data = FaceDataset(images=images, labels=torch.tensor([0, 1]), identity_names=["a", "b"])
    local = LocalData(train=data, test=data, train_targets=data.labels, class_mask=None)
    with pytest.raises(ValueError, match="at least 3 training images .* this client has 2"):
        strategy.local_train(model, local, LocalTraining(local_steps=1, batch_size=4),
                             generator=torch.Generator().manual_seed(0))  # fmt: skip
