"""insightface arcface_torch's iresnets: names and shapes, and reading ``backbone.pth`` safely.

The reference is insightface's ``recognition/arcface_torch/backbones/iresnet.py``: the expected
state-dict names and shapes below are enumerated from that file's module layout (stem, four
stages of ``IBasicBlock``, output block), independently of our builder. Checkpoints are written
here the way arcface_torch writes them: ``torch.save(backbone.state_dict(), path)``.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from opacus.validators import ModuleValidator
from safetensors import safe_open

from fl_secure.config import ModelConfig
from fl_secure.errors import CheckpointError, ConfigError, PrivacyError
from fl_secure.models.arcface_convert import convert_arcface_checkpoint, main
from fl_secure.models.factory import get_backbone, load_pretrained
from fl_secure.models.trainable import select_trainable
from fl_secure.training import build_model
from privacy.dp.dpsgd import validate_model

Shape = tuple[int, ...]
EMBEDDING = 128  # a smaller fc than the released 512 keeps the iresnet18 tests fast


def insightface_layout(depths: tuple[int, ...], features: int = 512) -> Iterator[tuple[str, Shape]]:
    """(name, shape) of every state-dict entry of insightface's IResNet, in module order."""

    def bn(prefix: str, c: int) -> Iterator[tuple[str, Shape]]:
        for leaf in ("weight", "bias", "running_mean", "running_var"):
            yield f"{prefix}.{leaf}", (c,)
        yield f"{prefix}.num_batches_tracked", ()

    yield "conv1.weight", (64, 3, 3, 3)
    yield from bn("bn1", 64)
    yield "prelu.weight", (64,)
    inplanes = 64
    for stage, (planes, units) in enumerate(zip((64, 128, 256, 512), depths, strict=True), 1):
        for unit in range(units):
            p = f"layer{stage}.{unit}"
            yield from bn(f"{p}.bn1", inplanes)
            yield f"{p}.conv1.weight", (planes, inplanes, 3, 3)
            yield from bn(f"{p}.bn2", planes)
            yield f"{p}.prelu.weight", (planes,)
            yield f"{p}.conv2.weight", (planes, planes, 3, 3)
            yield from bn(f"{p}.bn3", planes)
            if unit == 0:  # stride 2 in every stage: _make_layer adds a downsample
                yield f"{p}.downsample.0.weight", (planes, inplanes, 1, 1)
                yield from bn(f"{p}.downsample.1", planes)
            inplanes = planes
    yield from bn("bn2", 512)
    yield "fc.weight", (features, 512 * 7 * 7)
    yield "fc.bias", (features,)
    yield from bn("features", features)


def shapes(model: torch.nn.Module) -> list[tuple[str, Shape]]:
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


@pytest.fixture(scope="module")
def r18() -> torch.nn.Module:
    """A random iresnet18 whose BatchNorm statistics moved (as a trained one's have)."""
    torch.manual_seed(0)
    model = fresh()
    model.train()
    with torch.no_grad():
        model(torch.randn(2, 3, 112, 112))
    return model.eval()


def fresh() -> torch.nn.Module:
    return get_backbone("iresnet18", embedding_size=EMBEDDING, image_size=112)


def saved(model: torch.nn.Module, path: Path, wrap: bool = False) -> Path:
    state = model.state_dict()
    if wrap:  # DistributedDataParallel names inside a training checkpoint
        state = {"state_dict": {f"module.{k}": v for k, v in state.items()}, "epoch": 3}
    torch.save(state, path)
    return path


# --------------------------------------------------------------------------- architecture


def test_iresnet50_names_and_shapes_are_insightfaces() -> None:
    # Prepare
    torch.manual_seed(0)
    model = get_backbone("iresnet50", image_size=112)
    # Execute
    ours = shapes(model)
    # Assert: parameters = stem 1,920 + stages 30,741,312 + bn2 1,024 + fc 12,845,568 +
    # features 1,024 = 43,590,848, summed from insightface's layer shapes (insightface_layout)
    assert ours == list(insightface_layout((3, 4, 14, 3)))
    assert len(ours) == 475
    assert sum(p.numel() for p in model.parameters()) == 43_590_848
    state = dict(ours)
    assert state["layer3.13.conv2.weight"] == (256, 256, 3, 3)
    assert state["fc.weight"] == (512, 25088)
    assert state["features.weight"] == (512,)
    assert not model.features.weight.requires_grad
    assert torch.equal(model.features.weight, torch.ones(512))
    assert model.eval()(torch.rand(1, 3, 112, 112) * 2 - 1).shape == (1, 512)


@pytest.mark.parametrize(
    ("name", "depths", "params"),
    [("iresnet18", (2, 2, 2, 2), 24_025_600), ("iresnet34", (3, 4, 6, 3), 34_139_328)],
)
def test_iresnet18_and_34_layouts(name: str, depths: tuple[int, ...], params: int) -> None:
    model = get_backbone(name, embedding_size=128, image_size=112)
    assert shapes(model) == list(insightface_layout(depths, features=128))
    # the same count with 512 features: minus (512 - 128) * (25088 + 1 + 2)
    assert sum(p.numel() for p in model.parameters()) == params - 384 * 25091


@pytest.mark.parametrize("size", [64, 111, 150])
def test_image_size_other_than_112_names_data_image_size(size: int) -> None:
    with pytest.raises(ConfigError, match=r"data\.image_size must be 112"):
        get_backbone("iresnet34", image_size=size)
    with pytest.raises(ConfigError, match=r"data\.image_size"):
        build_model(ModelConfig(backbone="iresnet18"), num_classes=4, image_size=size, seed=0)


def test_batch_norm_is_refused_for_dp_sgd_even_when_frozen() -> None:
    # Prepare: everything but fc frozen, as a run training fewer weights would
    model = get_backbone("iresnet18", embedding_size=8, image_size=112)
    for name, parameter in model.named_parameters():
        parameter.requires_grad = name.startswith("fc.")
    # Execute / Assert: Opacus' validator flags BatchNorm only where it is trained; the
    # project's check refuses a frozen one too (batch statistics still mix the examples)
    assert ModuleValidator.validate(get_backbone("iresnet18", image_size=112), strict=False)
    assert ModuleValidator.validate(model, strict=False) == []
    with pytest.raises(PrivacyError, match=r"layer1\.0\.bn1 \(BatchNorm2d\): BatchNorm mixes"):
        validate_model(model)


def test_trainable_aliases_select_fc_and_the_last_stage() -> None:
    # Prepare
    cfg = ModelConfig(backbone="iresnet18", embedding_size=8)
    # Execute
    embedding = build_model(cfg, num_classes=2, image_size=112, seed=0, trainable="embedding")
    everything = build_model(cfg, num_classes=2, image_size=112, seed=0)
    stage = select_trainable(everything.backbone, "last-stage")
    # Assert: features (BatchNorm1d) is frozen with "embedding" and stays in eval mode
    trains = [n for n, p in embedding.backbone.named_parameters() if p.requires_grad]
    assert trains == ["fc.weight", "fc.bias"]
    assert not embedding.train().backbone.features.training
    assert stage[0] == "layer4.0.bn1.weight" and stage[-2:] == ["fc.weight", "fc.bias"]
    assert all(p.requires_grad for p in everything.backbone.parameters())


# --------------------------------------------------------------------------- backbone.pth


def test_arcface_backbone_pth_loads_through_model_pretrained(
    r18: torch.nn.Module, tmp_path: Path
) -> None:
    # Prepare: the file arcface_torch writes, and a batch of [-1, 1] images
    path = saved(r18, tmp_path / "backbone.pth")
    images = torch.rand(1, 3, 112, 112) * 2 - 1
    cfg = ModelConfig(
        backbone="iresnet18", embedding_size=EMBEDDING, head="arcface", pretrained=str(path)
    )
    # Execute
    model = build_model(cfg, num_classes=3, image_size=112, seed=7).backbone.eval()
    # Assert
    for key, value in r18.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    with torch.no_grad():
        assert torch.equal(model(images), r18(images))


def test_wrapped_checkpoint_with_module_prefix_loads(r18: torch.nn.Module, tmp_path: Path) -> None:
    path = saved(r18, tmp_path / "checkpoint.pt", wrap=True)
    model = fresh()
    load_pretrained(model, path)
    assert torch.equal(
        model.state_dict()["layer4.1.bn3.running_var"], r18.layer4[1].bn3.running_var
    )


def test_checkpoint_without_batch_counters_loads(r18: torch.nn.Module, tmp_path: Path) -> None:
    # Prepare: PyTorch < 0.4.1 wrote no num_batches_tracked buffers
    state = {k: v for k, v in r18.state_dict().items() if "num_batches_tracked" not in k}
    torch.save(state, tmp_path / "old.pth")
    model = fresh()
    # Execute
    load_pretrained(model, tmp_path / "old.pth")
    # Assert
    assert torch.equal(model.fc.weight, r18.fc.weight)


class Payload:
    """Unpickling this would write a marker file: the restricted unpickler must not call it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[Path, str]]:
        return Path.write_text, (self.marker, "code ran")


@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
def test_pickle_with_objects_is_refused_without_running_them(tmp_path: Path) -> None:
    # Prepare
    marker = tmp_path / "marker"
    path = tmp_path / "backbone.pth"
    torch.save({"conv1.weight": torch.zeros(64, 3, 3, 3), "x": Payload(marker)}, path)
    plain = tmp_path / "plain.pth"
    plain.write_bytes(pickle.dumps({"conv1.weight": Payload(marker)}))
    # Execute / Assert
    for bad in (path, plain):
        with pytest.raises(CheckpointError, match=f"refused {bad}"):
            load_pretrained(fresh(), bad)
    assert not marker.exists()
    pickle.loads(plain.read_bytes())  # the payload is real: plain pickle runs it
    assert marker.read_text() == "code ran"


@pytest.mark.filterwarnings("ignore:Validating sparse tensor invariants:UserWarning")
def test_truncated_or_non_tensor_checkpoints_are_refused(
    r18: torch.nn.Module, tmp_path: Path
) -> None:
    model = fresh()
    whole = saved(r18, tmp_path / "whole.pth").read_bytes()
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes(whole[: len(whole) // 3])
    with pytest.raises(CheckpointError, match=f"cannot read {truncated}"):
        load_pretrained(model, truncated)
    cases = [
        ([torch.zeros(1)], "holds a list, expected a state dict"),
        ({"conv1.weight": 1.5}, "key 'conv1.weight' holds a float, expected a tensor"),
        ({"conv1.weight": {"nested": torch.zeros(1)}}, "key 'conv1.weight' holds a dict"),
        ({3: torch.zeros(1)}, "key 3 is a int, not a str"),
        ({"conv1.weight": torch.zeros(2, 2).to_sparse()}, "torch.sparse_coo tensor, expected"),
    ]
    for number, (content, needle) in enumerate(cases):
        path = tmp_path / f"case{number}.pt"
        torch.save(content, path)
        with pytest.raises(CheckpointError, match=needle):
            load_pretrained(model, path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_pretrained(model, tmp_path / "absent.pth")


def test_wrong_shape_dtype_or_value_names_the_key(r18: torch.nn.Module, tmp_path: Path) -> None:
    model = fresh()
    good = r18.state_dict()
    changes = [
        (
            "fc.weight",
            torch.zeros(256, 25088),
            r"key 'fc\.weight' has shape \(256, 25088\), the "
            r"model expects \(128, 25088\)",
        ),
        ("prelu.weight", torch.zeros(64, dtype=torch.float16), "key 'prelu.weight' has dtype"),
        ("bn2.bias", torch.full((512,), float("nan")), "key 'bn2.bias' holds 512 NaN/Inf"),
    ]
    for key, value, needle in changes:
        path = tmp_path / f"{key}.pth"
        torch.save({**good, key: value}, path)
        with pytest.raises(CheckpointError, match=needle):
            load_pretrained(model, path)
    torch.save({k: v for k, v in good.items() if k != "fc.bias"}, tmp_path / "missing.pth")
    with pytest.raises(CheckpointError, match=r"missing keys \['fc\.bias'\]"):
        load_pretrained(model, tmp_path / "missing.pth")


def test_convert_to_safetensors_infers_the_backbone(r18: torch.nn.Module, tmp_path: Path) -> None:
    # Prepare
    source = saved(r18, tmp_path / "backbone.pth", wrap=True)
    target = tmp_path / "backbone.safetensors"
    # Execute
    name, size = convert_arcface_checkpoint(source, target)
    # Assert
    assert (name, size) == ("iresnet18", EMBEDDING)
    with safe_open(str(target), "pt") as handle:
        assert handle.metadata()["backbone"] == "iresnet18"
        assert len(handle.metadata()["source_sha256"]) == 64
    model = get_backbone(name, embedding_size=size, image_size=112)
    load_pretrained(model, target)
    for key, value in r18.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_convert_command_reports_a_refused_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({"conv1.weight": torch.zeros(64, 3, 3, 3)}, tmp_path / "other.pth")
    assert main([str(tmp_path / "other.pth"), str(tmp_path / "out.safetensors")]) == 1
    assert "not those of a known iresnet" in capsys.readouterr().err
    assert not (tmp_path / "out.safetensors").exists()
