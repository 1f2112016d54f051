"""Backbones, safetensors weight I/O and margin heads (fl_secure.models)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from opacus.validators import ModuleValidator

from fl_secure.errors import CheckpointError, ConfigError
from fl_secure.models import (
    BACKBONES,
    CombinedMargin,
    MarginHead,
    SoftmaxHead,
    get_backbone,
    load_pretrained,
    make_head,
    margin_logits,
    save_weights,
)

# --------------------------------------------------------------------------- backbones


# dlib-resnet takes only 150x150 chips (tests/fl_secure/models/test_dlib_resnet.py), the
# iresnets only 112x112 (tests/fl_secure/models/test_iresnet.py)
@pytest.mark.parametrize(
    "name", sorted(n for n in BACKBONES if n != "dlib-resnet" and not n.startswith("iresnet"))
)
@pytest.mark.parametrize("size", [64, 112])
def test_backbone_maps_images_to_embeddings(name: str, size: int) -> None:
    # Prepare
    torch.manual_seed(0)
    model = get_backbone(name, embedding_size=128, image_size=size)
    images = torch.randn(2, 3, size, size)
    # Execute
    embeddings = model(images)
    # Assert
    assert embeddings.shape == (2, 128)
    assert torch.isfinite(embeddings).all()


def test_default_backbone_embedding_size_is_512() -> None:
    assert get_backbone()(torch.randn(1, 3, 64, 64)).shape == (1, 512)


@pytest.mark.parametrize("name", ["cnn", "cnn-small", "resnet18"])
def test_group_norm_backbones_pass_the_opacus_validator(name: str) -> None:
    assert ModuleValidator.validate(get_backbone(name), strict=True) == []


def test_batch_norm_resnet_is_rejected_by_the_opacus_validator() -> None:
    errors = ModuleValidator.validate(get_backbone("resnet18-bn"), strict=False)
    assert errors


OPACUS_HOOK_WARNING = "ignore:Full backward hook is firing:UserWarning"


@pytest.mark.filterwarnings(OPACUS_HOOK_WARNING)
@pytest.mark.parametrize("name", ["cnn-small", "resnet18"])
def test_opacus_per_sample_gradients_sum_to_the_batch_gradient(name: str) -> None:
    # Prepare: in-place ops after hooked modules would make Opacus raise here
    torch.manual_seed(0)
    model = GradSampleModule(get_backbone(name, embedding_size=8), loss_reduction="sum")
    images = torch.randn(2, 3, 32, 32)
    # Execute
    model(images).square().sum().backward()
    # Assert
    for parameter in model.parameters():
        assert parameter.grad_sample.shape == (2, *parameter.shape)
        torch.testing.assert_close(
            parameter.grad_sample.sum(0), parameter.grad, rtol=1e-4, atol=1e-5
        )


def test_unknown_backbone_raises_config_error_listing_the_names() -> None:
    with pytest.raises(ConfigError) as info:
        get_backbone("vit")
    for name in BACKBONES:
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("name", "kwargs", "needle"),
    [
        ("cnn", {"image_size": 16}, "image_size"),
        ("cnn", {"embedding_size": 0}, "embedding_size"),
        ("cnn", {"widths": (8, 16, 32)}, "widths"),
        ("cnn", {"dropout": 1.0}, "dropout"),
        ("resnet18", {"norm": "layer"}, "norm"),
        ("resnet18", {"image_size": 8}, "image_size"),
    ],
)
def test_invalid_backbone_arguments_raise_config_error(
    name: str, kwargs: dict[str, object], needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle):
        get_backbone(name, **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- weight I/O


@pytest.mark.parametrize("name", ["cnn-small", "resnet18-bn"])
def test_safetensors_round_trip_is_bit_exact(name: str, tmp_path: Path) -> None:
    # Prepare: resnet18-bn also carries buffers (running stats, int64 counter)
    torch.manual_seed(0)
    source = get_backbone(name, embedding_size=32)
    source(torch.randn(4, 3, 32, 32))  # moves the BatchNorm running statistics
    torch.manual_seed(1)
    target = get_backbone(name, embedding_size=32)
    path = tmp_path / "weights.safetensors"
    # Execute
    save_weights(source, path, metadata={"backbone": name})
    load_pretrained(target, path)
    # Assert
    expected, loaded = source.state_dict(), target.state_dict()
    assert expected.keys() == loaded.keys()
    for key, value in expected.items():
        assert loaded[key].dtype == value.dtype, key
        assert torch.equal(loaded[key], value), key
    assert [p.name for p in tmp_path.iterdir()] == ["weights.safetensors"]  # no temp file left


def test_shape_mismatch_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_weights(get_backbone("cnn-small", embedding_size=128), path)
    with pytest.raises(CheckpointError, match=r"embedding\.weight.*\(128, 128\).*\(512, 128\)"):
        load_pretrained(get_backbone("cnn-small", embedding_size=512), path)


def test_missing_and_unexpected_keys_are_named(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_weights(get_backbone("cnn-small"), path)
    with pytest.raises(CheckpointError, match=r"missing keys \['bn1\.bias'.*unexpected keys \["):
        load_pretrained(get_backbone("resnet18"), path)


def test_missing_or_corrupt_file_raises_checkpoint_error(tmp_path: Path) -> None:
    model = get_backbone("cnn-small")
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(CheckpointError, match="cannot write"):
        save_weights(model, tmp_path / "a-file" / "w.safetensors")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_pretrained(model, tmp_path / "absent.safetensors")
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_pretrained(model, corrupt)


# --------------------------------------------------------------------------- heads


def _head_with_weights(kind: str, weight: torch.Tensor) -> MarginHead | SoftmaxHead:
    head = make_head(kind, weight.shape[0], weight.shape[1]).double()  # type: ignore[arg-type]
    with torch.no_grad():
        head.weight.copy_(weight)
    assert isinstance(head, MarginHead | SoftmaxHead)
    return head


# e = (3, 4) / 5; W rows (1, 0), (0, 1), (1, 1) / sqrt(2): cosines 0.6, 0.8, 0.7 * sqrt(2)
EMBEDDING = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
WEIGHT = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]], dtype=torch.float64)
COSINES = [0.6, 0.8, 0.7 * math.sqrt(2.0)]


def test_cosface_logits_match_the_formula() -> None:
    head = _head_with_weights("cosface", WEIGHT)
    logits = head(EMBEDDING, torch.tensor([0]))
    expected = [30.0 * (0.6 - 0.4), 30.0 * 0.8, 30.0 * COSINES[2]]
    torch.testing.assert_close(logits[0], torch.tensor(expected, dtype=torch.float64))


def test_arcface_logits_match_the_formula() -> None:
    head = _head_with_weights("arcface", WEIGHT)
    logits = head(EMBEDDING, torch.tensor([1]))
    target = 8.0 * (0.8 * math.cos(0.5) - 0.6 * math.sin(0.5))  # cos(theta + m)
    expected = [8.0 * 0.6, target, 8.0 * COSINES[2]]
    torch.testing.assert_close(logits[0], torch.tensor(expected, dtype=torch.float64))


def test_without_labels_logits_are_scaled_cosines() -> None:
    head = _head_with_weights("arcface", WEIGHT)
    torch.testing.assert_close(head(EMBEDDING)[0], 8.0 * torch.tensor(COSINES, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["cosface", "arcface"])
def test_margin_changes_only_the_target_logit(kind: str) -> None:
    # Prepare
    torch.manual_seed(0)
    head = make_head(kind, 7, 16)  # type: ignore[arg-type]
    embeddings, labels = torch.randn(5, 16), torch.tensor([0, 3, 6, 3, 1])
    # Execute
    plain = head(embeddings)
    with_margin = head(embeddings, labels)
    # Assert: non-target logits are exactly s * cos, every target logit is lowered
    target = F.one_hot(labels, 7).bool()
    assert torch.equal(with_margin[~target], plain[~target])
    assert (with_margin[target] < plain[target]).all()


def test_arcface_threshold_trick_beyond_pi() -> None:
    # theta = acos(-0.95) = 2.82 > pi - 0.5: arcface_torch's cos(theta) - m * sin(m)
    cosine = torch.tensor([[-0.95, 0.1]], dtype=torch.float64)
    logits = margin_logits(cosine, torch.tensor([0]), s=2.0, m2=0.5)
    torch.testing.assert_close(logits[0, 0].item(), 2.0 * (-0.95 - 0.5 * math.sin(0.5)))
    easy = margin_logits(cosine, torch.tensor([0]), s=2.0, m2=0.5, easy_margin=True)
    torch.testing.assert_close(easy[0, 0].item(), 2.0 * -0.95)


def test_sphereface_margin_values() -> None:
    cosine = torch.tensor([[0.6], [-0.5]], dtype=torch.float64)
    logits = margin_logits(cosine, torch.tensor([0, 0]), s=1.0, m1=2.0)
    # cos(2 theta) = 2 cos^2 - 1 = -0.28; for phi = 2 acos(-0.5) = 4 pi / 3 > pi (k = 1):
    # -cos(phi) - 2 = -1.5
    torch.testing.assert_close(logits[:, 0], torch.tensor([-0.28, -1.5], dtype=torch.float64))


@pytest.mark.parametrize(
    ("m1", "m2", "m3"), [(1.0, 0.5, 0.0), (1.0, 0.0, 0.4), (1.35, 0.0, 0.0), (1.0, 0.3, 0.2)]
)
def test_target_logit_decreases_with_the_angle_and_gradients_stay_finite(
    m1: float, m2: float, m3: float
) -> None:
    cosine = torch.linspace(1.0, -1.0, 2001, dtype=torch.float64).unsqueeze(1).requires_grad_()
    target = margin_logits(cosine, torch.zeros(2001, dtype=torch.int64), s=1.0, m1=m1, m2=m2, m3=m3)
    assert (target[1:] <= target[:-1] + 1e-12).all()
    target.sum().backward()
    assert cosine.grad is not None and torch.isfinite(cosine.grad).all()


@pytest.mark.parametrize("kind", ["softmax", "cosface", "arcface"])
def test_class_mask_gives_minus_inf_and_exactly_zero_gradient(kind: str) -> None:
    # Prepare: the client holds classes 0, 1 and 3 of 6 (HF-MAML section III-A)
    torch.manual_seed(0)
    head = make_head(kind, 6, 16)  # type: ignore[arg-type]
    mask = torch.tensor([True, True, False, True, False, False])
    embeddings, labels = torch.randn(8, 16), torch.tensor([0, 1, 3, 3, 1, 0, 0, 1])
    # Execute
    logits = head(embeddings, labels, class_mask=mask)
    F.cross_entropy(logits, labels).backward()
    # Assert
    assert torch.isneginf(logits[:, ~mask]).all()
    assert torch.isfinite(logits[:, mask]).all()
    grad = head.weight.grad
    assert grad is not None
    assert (grad[~mask] == 0).all()
    assert (grad[mask].abs().sum(dim=1) > 0).all()


def test_class_mask_rejects_labels_of_absent_classes_and_bad_masks() -> None:
    head = make_head("arcface", 4, 8)
    embeddings = torch.randn(2, 8)
    mask = torch.tensor([True, False, True, True])
    with pytest.raises(ValueError, match=r"labels \[1\]"):
        head(embeddings, torch.tensor([0, 1]), class_mask=mask)
    with pytest.raises(ValueError, match="class_mask"):
        head(embeddings, torch.tensor([0, 2]), class_mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        head(embeddings, torch.tensor([0, 4]))


@pytest.mark.filterwarnings(OPACUS_HOOK_WARNING)
def test_margin_head_per_sample_gradients_under_opacus() -> None:
    # Prepare: Opacus replays the weight-owning leaf on its input only; the margin and the
    # mask act downstream, so per-sample gradients must still sum to the batch gradient
    torch.manual_seed(0)
    head = GradSampleModule(make_head("arcface", 10, 16).double(), loss_reduction="sum")
    mask = torch.arange(10) < 3
    embeddings = torch.randn(6, 16, dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    # Execute
    F.cross_entropy(head(embeddings, labels, class_mask=mask), labels, reduction="sum").backward()
    # Assert
    weight = head._module.weight
    torch.testing.assert_close(weight.grad_sample.sum(0), weight.grad)
    assert (weight.grad_sample[:, ~mask] == 0).all()


def test_make_head_defaults_and_errors() -> None:
    cosface, arcface = make_head("cosface", 3, 4), make_head("arcface", 3, 4)
    assert isinstance(cosface, MarginHead) and isinstance(arcface, MarginHead)
    assert cosface.margin == CombinedMargin(s=30.0, m3=0.4)
    assert arcface.margin == CombinedMargin(s=8.0, m2=0.5)
    assert make_head("arcface", 3, 4, s=64.0).margin == CombinedMargin(s=64.0, m2=0.5)
    assert isinstance(make_head("softmax", 3, 4), SoftmaxHead)
    with pytest.raises(ConfigError, match="softmax"):
        make_head("softmax", 3, 4, s=30.0)
    with pytest.raises(ConfigError, match="allowed kinds: softmax, cosface, arcface"):
        make_head("sphereface", 3, 4)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="m2"):
        make_head("arcface", 3, 4, m=2.0)
