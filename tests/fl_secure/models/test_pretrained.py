"""``model.pretrained``: the built-in dlib face model by name, and the weights' provenance."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import pytest
import torch

from fl_secure.config import ModelConfig, load_config
from fl_secure.errors import ConfigError
from fl_secure.models import save_weights
from fl_secure.models.dlib_weights import dlib_resnet_weights, load_dlib_resnet
from fl_secure.models.pretrained import pretrained_provenance
from fl_secure.training import build_model

needs_models = pytest.mark.skipif(
    importlib.util.find_spec("face_recognition_models") is None,
    reason="face_recognition_models is not installed (pip install .[faces])",
)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FL_SECURE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@needs_models
def test_the_builtin_name_loads_dlibs_weights_and_states_their_digests(cache: Path) -> None:
    # Prepare / Execute: the model of a config that names the built-in
    config = ModelConfig(backbone="dlib-resnet", embedding_size=128, pretrained="dlib-resnet")
    model = build_model(config, 3, 150, seed=0, trainable="embedding")
    reference, weights = load_dlib_resnet()
    # Assert: dlib's weights bit for bit, from the cache under $FL_SECURE_CACHE
    for key, value in reference.state_dict().items():
        assert torch.equal(model.backbone.state_dict()[key], value), key
    assert weights.path.parent == cache
    # Assert: provenance names the file loaded and the .dat, with SHA-256s of their bytes
    prov = pretrained_provenance("dlib-resnet")
    assert prov is not None and prov["name"] == "dlib-resnet"
    assert prov["sha256"] == hashlib.sha256(weights.path.read_bytes()).hexdigest()
    assert prov["source_sha256"] == hashlib.sha256(weights.source.read_bytes()).hexdigest()
    assert prov["sha256"] == dlib_resnet_weights().sha256


def test_a_file_is_stated_with_its_digest_and_a_random_start_with_none(tmp_path: Path) -> None:
    path = tmp_path / "start.safetensors"
    save_weights(build_model(ModelConfig(backbone="cnn-small"), 1, 32, seed=1).backbone, path)
    prov = pretrained_provenance(str(path))
    assert prov == {
        "name": str(path),
        "file": str(path),
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }
    assert pretrained_provenance("") is None


def test_the_builtin_name_is_not_a_path_and_needs_its_backbone(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    model = '[model]\nbackbone = "dlib-resnet"\nembedding_size = 128\npretrained = "dlib-resnet"\n'
    path.write_text(model + '[data]\nsource = "folders"\npath = "x"\n')
    assert load_config(path).model.pretrained == "dlib-resnet"  # not tmp_path / "dlib-resnet"
    with pytest.raises(ConfigError, match="model.pretrained.*'dlib-resnet' is for model.backbone"):
        ModelConfig(backbone="cnn", pretrained="dlib-resnet")
