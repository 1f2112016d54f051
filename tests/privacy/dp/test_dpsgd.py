"""DP-SGD local training: one step against a hand computation, noise, sampling, cleanup."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from fl_secure.config import ModelConfig
from fl_secure.data.types import FaceDataset
from fl_secure.errors import PrivacyError
from fl_secure.messages import LocalTraining
from fl_secure.training import FaceModel, LocalData, build_model, train_local
from privacy.dp.dpsgd import (
    Clipping,
    DPSGDSettings,
    PoissonBatchSampler,
    dpsgd_steps,
    train_local_dpsgd,
    validate_model,
)
from privacy.dp.noise import SecureGaussian, SeededGaussian, gaussian_tensor_like

torch.set_num_threads(1)

SIZE = 32
CLASSES = 4


def _model(head: str = "arcface", backbone: str = "cnn-small") -> FaceModel:
    if head == "softmax":
        cfg = ModelConfig(backbone=backbone, embedding_size=8, head="softmax")
    else:
        cfg = ModelConfig(backbone=backbone, embedding_size=8, head=head, scale=8.0, margin=0.3)
    return build_model(cfg, CLASSES, SIZE, seed=0)


def _data(n: int, *, masked: bool) -> LocalData:
    """``n`` random images; with ``masked`` the last class is absent (FedAvg's class mask)."""
    g = torch.Generator().manual_seed(1)
    present = CLASSES - 1 if masked else CLASSES
    labels = torch.arange(n) % present
    images = torch.rand(n, 3, SIZE, SIZE, generator=g) * 2 - 1
    dataset = FaceDataset(images, labels, tuple(f"id{i}" for i in range(CLASSES)))
    mask = torch.arange(CLASSES) < present if masked else None
    return LocalData(train=dataset, test=dataset, train_targets=labels, class_mask=mask)


def _sgd(steps: int, lr: float) -> LocalTraining:
    return LocalTraining(local_steps=steps, learning_rate=lr, momentum=0.0, weight_decay=0.0)


def _per_example_grads(model: FaceModel, data: LocalData, index: int) -> list[torch.Tensor]:
    """Plain torch: the gradient of one example's loss, alone in its batch."""
    images = data.train.images[index : index + 1]
    targets = data.train_targets[index : index + 1]
    loss = nn.functional.cross_entropy(model(images, targets, data.class_mask), targets)
    return list(torch.autograd.grad(loss, list(model.parameters())))


def _assert_parameters(
    model: FaceModel, expected: list[torch.Tensor], before: list[torch.Tensor]
) -> None:
    """Parameters equal ``expected`` to 1e-6, while the update itself exceeds 1e-3."""
    moved = max(float((e - b).abs().max()) for e, b in zip(expected, before, strict=True))
    assert moved > 1e-3
    for p, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("clipping", ["book-keeping", "opacus"])
@pytest.mark.parametrize(("head", "masked"), [("arcface", True), ("softmax", False)])
def test_one_step_equals_hand_computation(head: str, masked: bool, clipping: Clipping) -> None:
    # Prepare: 6 examples, q = 0.5 (expected batch 3), physical batches of 2, plain SGD.
    n, q, sigma, seed = 6, 0.5, 0.7, 3
    model, data = _model(head), _data(n, masked=masked)
    reference = copy.deepcopy(model)
    before = [p.detach().clone() for p in model.parameters()]
    replica = SeededGaussian(seed)  # replays the sampling and noise draws of the step
    included = np.flatnonzero(replica.uniform(n) < q)
    assert len(included) >= 3  # more than one physical batch of 2
    grads = [_per_example_grads(reference, data, int(i)) for i in included]
    norms = [float(torch.stack([g.norm() for g in per]).norm()) for per in grads]
    clip = math.sqrt(min(norms) * max(norms))  # clips the largest, not the smallest
    lr = 0.03 / clip  # updates of ~1e-2: float32 rounding stays far below the tolerance
    summed = [torch.zeros_like(p) for p in before]
    for per, norm in zip(grads, norms, strict=True):
        factor = min(1.0, clip / (norm + 1e-6))  # Opacus' clipping factor
        for total, g in zip(summed, per, strict=True):
            total += factor * g
    noise = [gaussian_tensor_like(replica, p, sigma * clip) for p in before]
    expected = [
        p - lr * (s + z) / round(q * n) for p, s, z in zip(before, summed, noise, strict=True)
    ]
    if masked:  # the absent class keeps its row exactly
        expected[-1][CLASSES - 1] = before[-1][CLASSES - 1]
    settings = DPSGDSettings(sigma, clip, q, max_physical_batch_size=2, clipping=clipping)

    # Execute
    metrics = train_local_dpsgd(model, data, _sgd(1, lr), settings, noise=SeededGaussian(seed))

    # Assert
    _assert_parameters(model, expected, before)
    if masked:
        assert torch.equal(model.head.weight[CLASSES - 1], before[-1][CLASSES - 1])
        assert not torch.equal(model.head.weight[0], before[-1][0])
    assert metrics["local_steps"] == 1.0
    assert metrics["dp_noise_secure"] == 0.0
    assert 0.0 <= metrics["train_accuracy"] <= 1.0 and metrics["train_loss"] > 0


def test_zero_noise_without_clipping_is_sgd_on_the_expected_batch_mean() -> None:
    # Prepare: sigma = 0, C large enough that nothing is clipped: plain SGD on the batch sum.
    n, q, lr, seed = 5, 0.6, 1e-3, 0
    model, data = _model("cosface"), _data(n, masked=False)
    reference = copy.deepcopy(model)
    before = [p.detach().clone() for p in model.parameters()]
    replica = SeededGaussian(seed)
    included = np.flatnonzero(replica.uniform(n) < q)
    grads = [_per_example_grads(reference, data, int(i)) for i in included]
    summed = [sum(per[k] for per in grads) for k in range(len(grads[0]))]
    expected = [p - lr * s / round(q * n) for p, s in zip(before, summed, strict=True)]

    # Execute
    train_local_dpsgd(
        model, data, _sgd(1, lr), DPSGDSettings(0.0, 1e6, q), noise=SeededGaussian(seed)
    )

    # Assert
    _assert_parameters(model, expected, before)


@pytest.mark.parametrize("clipping", ["book-keeping", "opacus"])
def test_empty_batch_step_adds_exactly_the_noise(clipping: Clipping) -> None:
    # Prepare: n = 20, q = 0.1 (expected batch 2); a seed whose first two batches are empty.
    n, q, sigma, clip, lr = 20, 0.1, 1.5, 0.4, 0.5

    def empty_start(seed: int) -> bool:
        r = SeededGaussian(seed)
        if (r.uniform(n) < q).any():
            return False
        for p in _model().parameters():
            r.standard_normal(p.numel())
        return not (r.uniform(n) < q).any()

    seed = next(s for s in range(10_000) if empty_start(s))
    model, data = _model(), _data(n, masked=False)
    before = [p.detach().clone() for p in model.parameters()]
    replica, noise = SeededGaussian(seed), [torch.zeros_like(p) for p in before]
    for _ in range(2):
        replica.uniform(n)
        for total, p in zip(noise, before, strict=True):
            total += gaussian_tensor_like(replica, p, sigma * clip)

    # Execute
    settings = DPSGDSettings(sigma, clip, q, clipping=clipping)
    metrics = train_local_dpsgd(model, data, _sgd(2, lr), settings, noise=SeededGaussian(seed))

    # Assert: two noise-only steps, each dividing by the expected batch size 2.
    for p, b, z in zip(model.parameters(), before, noise, strict=True):
        torch.testing.assert_close(p.detach(), b - lr * z / 2, rtol=0, atol=1e-6)
    assert metrics["local_steps"] == 2.0
    assert metrics["train_loss"] == 0.0 and metrics["train_accuracy"] == 0.0


def test_noise_statistics_with_the_csprng() -> None:
    # Prepare: q so small that the batch is empty (expected batch 1): the change is noise only.
    sigma, clip, lr = 3.0, 0.2, 0.5
    model, data = _model(), _data(8, masked=False)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])

    # Execute
    metrics = train_local_dpsgd(
        model, data, _sgd(1, lr), DPSGDSettings(sigma, clip, 1e-12), noise=SecureGaussian()
    )

    # Assert: N(0, (lr * sigma * C / 1)^2) per parameter, within 5 standard errors.
    delta = (torch.cat([p.detach().flatten() for p in model.parameters()]) - before).double()
    std, count = lr * sigma * clip, delta.numel()
    assert count > 100_000
    assert abs(float(delta.mean())) < 5 * std / math.sqrt(count)
    assert float(delta.std()) == pytest.approx(std, rel=5 / math.sqrt(2 * count))
    assert metrics["dp_noise_secure"] == 1.0


def test_poisson_batches_have_mean_size_q_times_n() -> None:
    # Prepare
    n, q, steps = 200, 0.1, 400
    sampler = PoissonBatchSampler(n, q, steps, SecureGaussian())

    # Execute
    batches = list(sampler)

    # Assert: Binomial(n, q) sizes, distinct sorted indices in range.
    sizes = np.array([len(b) for b in batches])
    assert len(batches) == len(sampler) == steps
    assert abs(sizes.mean() - n * q) < 5 * math.sqrt(n * q * (1 - q) / steps)
    assert sizes.var() == pytest.approx(n * q * (1 - q), rel=0.36)  # 5 standard errors
    assert all(b == sorted(set(b)) and all(0 <= i < n for i in b) for b in batches)


def test_poisson_decisions_are_the_sources_uniforms() -> None:
    # Prepare
    n, q = 50, 0.3
    replica = SeededGaussian(7)

    # Execute
    batches = list(PoissonBatchSampler(n, q, 3, SeededGaussian(7)))

    # Assert
    assert batches == [np.flatnonzero(replica.uniform(n) < q).tolist() for _ in range(3)]


def _hook_state(model: nn.Module) -> list[tuple[str, list[str]]]:
    return [(name, sorted(vars(m))) for name, m in model.named_modules()]


@pytest.mark.parametrize("clipping", ["book-keeping", "opacus"])
def test_model_is_plain_after_training_and_can_train_again(clipping: Clipping) -> None:
    # Prepare
    model, data, fresh = _model(), _data(12, masked=True), _model()
    settings = DPSGDSettings(1.0, 1.0, 0.5, max_physical_batch_size=4, clipping=clipping)
    snapshots = [copy.deepcopy(model.state_dict())]

    # Execute: SGD with momentum, then Adam, then plain train_local.
    for optimizer in ("sgd", "adam"):
        training = LocalTraining(local_steps=2, learning_rate=0.01, optimizer=optimizer)
        train_local_dpsgd(model, data, training, settings, noise=SecureGaussian())
        snapshots.append(copy.deepcopy(model.state_dict()))
    train_local(model, data, _sgd(1, 0.01), generator=torch.Generator().manual_seed(0))

    # Assert: same attributes as a never-trained model, no hooks, no per-example state.
    assert _hook_state(model) == _hook_state(fresh)
    assert list(model.state_dict()) == list(fresh.state_dict())
    for module in model.modules():
        assert not module._forward_hooks and not module._backward_hooks
        assert not module._forward_pre_hooks and not module._backward_pre_hooks
        assert module._is_full_backward_hook is None
    for p in model.parameters():
        assert vars(p) == {}
    for first, second in zip(snapshots, snapshots[1:], strict=False):
        assert not torch.equal(first["backbone.stem.0.weight"], second["backbone.stem.0.weight"])
    assert model(data.train.images[:2]).shape == (2, CLASSES)


def test_validate_model_refuses_batchnorm_and_accepts_groupnorm() -> None:
    # Prepare
    bn, gn = _model(backbone="resnet18-bn"), _model(backbone="cnn")
    data = _data(4, masked=False)
    before = copy.deepcopy(bn.state_dict())

    # Execute / Assert
    validate_model(gn)
    with pytest.raises(PrivacyError, match=r"backbone\.bn1 \(BatchNorm2d\): BatchNorm") as err:
        validate_model(bn)
    assert "GroupNorm backbone" in str(err.value)
    with pytest.raises(PrivacyError, match="BatchNorm"):
        train_local_dpsgd(
            bn, data, _sgd(1, 0.1), DPSGDSettings(1.0, 1.0, 0.5), noise=SeededGaussian(0)
        )
    for k, v in bn.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_validate_model_refuses_a_frozen_batchnorm() -> None:
    # Prepare: Opacus' validator skips modules without trainable parameters.
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    model[1].requires_grad_(False)

    # Execute / Assert
    with pytest.raises(PrivacyError, match=r"1 \(BatchNorm1d\)"):
        validate_model(model)


def test_dpsgd_steps() -> None:
    assert dpsgd_steps(100, LocalTraining(local_steps=7, local_epochs=3), 0.04) == 7
    assert dpsgd_steps(100, LocalTraining(local_epochs=3, local_steps=0), 0.04) == 75
    assert dpsgd_steps(100, LocalTraining(local_epochs=3, local_steps=0), 0.3) == 9
    assert dpsgd_steps(5, LocalTraining(local_epochs=2, local_steps=0), 1.0) == 2
    with pytest.raises(PrivacyError, match="sample_rate"):
        dpsgd_steps(100, LocalTraining(), 0.0)
    with pytest.raises(PrivacyError, match="num_examples"):
        dpsgd_steps(0, LocalTraining(), 0.5)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"noise_multiplier": float("nan")}, "noise_multiplier"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"sample_rate": 1.5}, "sample_rate"),
        ({"max_physical_batch_size": 0}, "max_physical_batch_size"),
    ],
)
def test_settings_out_of_range_are_refused(kwargs: dict[str, float], field: str) -> None:
    values: dict[str, float] = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "sample_rate": 0.1}
    with pytest.raises(PrivacyError, match=field):
        DPSGDSettings(**{**values, **kwargs})  # type: ignore[arg-type]
