"""Book-keeping clipping against Opacus' per-example gradients and against a per-example loop."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from opacus import GradSampleModule
from torch import nn
from torch.func import functional_call, grad, vmap

from fl_secure.config import ModelConfig
from fl_secure.data.types import FaceDataset
from fl_secure.errors import PrivacyError
from fl_secure.messages import LocalTraining
from fl_secure.models.heads import make_head
from fl_secure.training import FaceModel, LocalData, build_model
from privacy.dp.bookkeeping import BookKeepingClipper, _conv_weight_norms2, unsupported_modules
from privacy.dp.dpsgd import DPSGDSettings, resolve_clipping, train_local_dpsgd
from privacy.dp.noise import SeededGaussian

torch.set_num_threads(1)

SIZE, CLASSES = 32, 5


def _model(head: str, backbone: str = "cnn-small") -> FaceModel:
    cfg = ModelConfig(backbone=backbone, embedding_size=16, head=head)  # type: ignore[arg-type]
    return build_model(cfg, CLASSES, SIZE, seed=0)


def _batch(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, SIZE, SIZE, generator=g) * 2 - 1, torch.arange(n) % (CLASSES - 1)


def _opacus_clipped_sum(
    model: FaceModel, images: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, clip: float
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Opacus' hooks: per-example gradients, their norms, Opacus' factor, the clipped sum."""
    model = copy.deepcopy(model)
    gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=True)
    loss = nn.functional.cross_entropy(model(images, labels, mask), labels, reduction="sum")
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    per = [p.grad_sample.reshape(len(labels), -1) for p in params]  # type: ignore[attr-defined]
    norms = torch.cat(per, dim=1).norm(dim=1)
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    sums = [(factors @ g).view_as(p) for g, p in zip(per, params, strict=True)]
    gsm.to_standard_module()
    return norms, sums


def _assert_close_to_scale(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to rounding: float64 to 1e-9, float32 to 1e-4 of the largest entry."""
    scale = 1e-9 if want.dtype == torch.float64 else 1e-4
    torch.testing.assert_close(got, want, rtol=0, atol=scale * float(want.abs().max()) + 1e-12)


@pytest.mark.parametrize("head", ["cosface", "arcface", "softmax"])
@pytest.mark.parametrize("backbone", ["cnn-small", "resnet18"])
def test_clipped_sum_and_norms_equal_opacus_hooks(head: str, backbone: str) -> None:
    # Prepare: float64 (no float32 rounding over millions of terms), the last class absent
    # (mask), the stem frozen; a clip that bites for some examples.
    model = _model(head, backbone).double()
    first_conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    first_conv.weight.requires_grad_(False)
    images, labels = _batch(7)
    images = images.double()
    mask = torch.arange(CLASSES) < CLASSES - 1
    ref_norms, ref_sums = _opacus_clipped_sum(model, images, labels, mask, 1.0)
    clip = float(ref_norms.median())
    ref_norms, ref_sums = _opacus_clipped_sum(model, images, labels, mask, clip)
    clipper = BookKeepingClipper(model, clip)

    # Execute
    with clipper.attached():
        logits = model(images, labels, mask)
        losses = nn.functional.cross_entropy(logits, labels, reduction="none")
        norms = clipper.clip_and_sum(losses)

    # Assert: same norms, same clipped sums; some examples were clipped, some not.
    torch.testing.assert_close(norms, ref_norms, rtol=1e-9, atol=0)
    assert (ref_norms > clip).any() and (ref_norms < clip).any()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert first_conv.weight.grad is None
    for p, want in zip(trainable, ref_sums, strict=True):
        assert p.grad is not None
        _assert_close_to_scale(p.grad, want)


@pytest.mark.parametrize(
    ("in_channels", "out_channels", "kernel", "stride", "side", "bias"),
    [
        (3, 8, 3, 2, 32, False),  # many positions: per-example gradients by grouped conv
        (16, 32, 3, 1, 4, True),  # few positions: ghost norm
        (8, 16, 1, 2, 8, False),  # 1x1 shortcut
    ],
)
def test_conv_norms_on_both_sides_of_the_ghost_rule_equal_torch_func(
    in_channels: int, out_channels: int, kernel: int, stride: int, side: int, bias: bool
) -> None:
    # Prepare
    torch.manual_seed(0)
    conv = nn.Conv2d(in_channels, out_channels, kernel, stride, padding=kernel // 2, bias=bias)
    a = torch.randn(6, in_channels, side, side)
    g = torch.randn_like(conv(a))
    params = {k: v.detach() for k, v in conv.named_parameters()}

    def weighted(p: dict[str, torch.Tensor], x: torch.Tensor, gx: torch.Tensor) -> torch.Tensor:
        return (functional_call(conv, p, (x[None],))[0] * gx).sum()

    per = vmap(grad(weighted), in_dims=(None, 0, 0))(params, a, g)
    positions = g.shape[2] * g.shape[3]
    p, q = conv.weight[0].numel(), out_channels
    ghost = positions * (p + q) < p * q

    # Execute
    norms2 = _conv_weight_norms2(conv, a, g)

    # Assert
    assert ghost == (side == 4)
    torch.testing.assert_close(norms2, per["weight"].flatten(1).square().sum(1), rtol=1e-4, atol=0)


@pytest.mark.parametrize("head", ["arcface", "softmax"])
def test_training_equals_opacus_hooks_step_for_step(head: str) -> None:
    # Prepare: same seeded noise and sampling; physical batches of 3 (accumulation).
    n, q = 12, 0.5
    images, labels = _batch(n, seed=4)
    dataset = FaceDataset(images, labels, tuple(f"id{i}" for i in range(CLASSES)))
    mask = torch.arange(CLASSES) < CLASSES - 1
    data = LocalData(train=dataset, test=dataset, train_targets=labels, class_mask=mask)
    training = LocalTraining(local_steps=3, learning_rate=0.05, optimizer="sgd", momentum=0.9)
    models = {engine: _model(head) for engine in ("book-keeping", "opacus")}
    before = [p.detach().clone() for p in models["opacus"].parameters()]

    # Execute
    metrics = {
        engine: train_local_dpsgd(
            model,
            data,
            training,
            DPSGDSettings(0.5, 0.3, q, max_physical_batch_size=3, clipping=engine),
            noise=SeededGaussian(7),
        )
        for engine, model in models.items()
    }

    # Assert
    moved = max(
        float((p.detach() - b).abs().max())
        for p, b in zip(models["opacus"].parameters(), before, strict=True)
    )
    assert moved > 1e-2
    for ours, ref, b in zip(
        models["book-keeping"].parameters(), models["opacus"].parameters(), before, strict=True
    ):
        _assert_close_to_scale(ours.detach() - b, ref.detach() - b)
    assert metrics["book-keeping"]["train_loss"] == pytest.approx(
        metrics["opacus"]["train_loss"], rel=1e-5
    )


class _LayerNormBackbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.flat = nn.Flatten()
        self.norm = nn.LayerNorm(3 * SIZE * SIZE)
        self.embed = nn.Linear(3 * SIZE * SIZE, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(self.norm(self.flat(x)))  # type: ignore[no-any-return]


class _TwiceBackbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.flat = nn.Flatten()
        self.first = nn.Linear(3 * SIZE * SIZE, 16)
        self.again = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.again(self.again(self.first(self.flat(x))))  # type: ignore[no-any-return]


def _plain_model(backbone: nn.Module) -> FaceModel:
    return FaceModel(backbone, make_head("cosface", CLASSES, 16))


def test_unsupported_layers_fall_back_to_opacus_or_are_named() -> None:
    # Prepare
    model = _plain_model(_LayerNormBackbone())
    images, labels = _batch(6)
    dataset = FaceDataset(images, labels, tuple(f"id{i}" for i in range(CLASSES)))
    data = LocalData(train=dataset, test=dataset, train_targets=labels, class_mask=None)
    training = LocalTraining(local_steps=1, learning_rate=0.1)
    before = model.backbone.norm.weight.detach().clone()

    # Execute / Assert: auto trains with Opacus' hooks (LayerNorm has a grad sampler there).
    assert unsupported_modules(model) == ["backbone.norm (LayerNorm: no book-keeping rule)"]
    assert resolve_clipping(model, "auto") == "opacus"
    train_local_dpsgd(model, data, training, DPSGDSettings(1.0, 1.0, 0.5), noise=SeededGaussian(0))
    assert not torch.equal(model.backbone.norm.weight, before)
    with pytest.raises(PrivacyError, match=r"backbone\.norm \(LayerNorm"):
        resolve_clipping(model, "book-keeping")
    with pytest.raises(PrivacyError, match="clipping = 'ghost'"):
        DPSGDSettings(1.0, 1.0, 0.5, clipping="ghost")  # type: ignore[arg-type]


def test_a_module_run_twice_is_refused() -> None:
    # Prepare
    model = _plain_model(_TwiceBackbone())
    clipper = BookKeepingClipper(model, 1.0)
    images, labels = _batch(4)

    # Execute / Assert
    with clipper.attached(), pytest.raises(PrivacyError, match=r"backbone\.again ran twice"):
        model(images, labels)


def _record_hooks(model: nn.Module) -> list[Any]:
    return [m._forward_hooks for m in model.modules() if m._forward_hooks]


def test_hooks_are_removed_after_training_and_after_an_error() -> None:
    model = _model("cosface")
    clipper = BookKeepingClipper(model, 1.0)
    with pytest.raises(RuntimeError, match="boom"), clipper.attached():
        assert _record_hooks(model)
        raise RuntimeError("boom")
    assert not _record_hooks(model)
