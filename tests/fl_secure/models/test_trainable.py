"""``train.trainable``: what trains and is shared; frozen parts stay bit-identical."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fl_secure.algorithms import FedAvg, FedPE
from fl_secure.checkpoints import CheckpointStore
from fl_secure.config import ModelConfig, TrainConfig
from fl_secure.data.types import FaceDataset
from fl_secure.errors import ConfigError
from fl_secure.messages import LocalTraining
from fl_secure.models import get_backbone
from fl_secure.models.trainable import can_cache_trunk, select_trainable
from fl_secure.training import (
    LocalData,
    build_model,
    embed,
    held_out_features,
    parameter_groups,
    train_local,
    with_trunk_features,
)
from privacy.dp.dpsgd import Clipping, DPSGDSettings, train_local_dpsgd
from privacy.dp.noise import SeededGaussian

torch.set_num_threads(1)

SIZE = 32
CFG = ModelConfig(backbone="cnn-small", embedding_size=8, head="cosface")


def _data(n: int = 12, classes: int = 3) -> LocalData:
    g = torch.Generator().manual_seed(4)
    labels = torch.arange(n) % classes
    images = torch.rand(n, 3, SIZE, SIZE, generator=g) * 2 - 1
    dataset = FaceDataset(images, labels, tuple(f"id{i}" for i in range(classes)))
    return LocalData(train=dataset, test=dataset, train_targets=labels, class_mask=None)


def _sgd(steps: int) -> LocalTraining:
    return LocalTraining(local_steps=steps, batch_size=4, learning_rate=0.1, weight_decay=5e-4)


def test_aliases_name_the_embedding_layer_and_the_last_stage() -> None:
    cnn = get_backbone("cnn-small", embedding_size=8, image_size=SIZE)
    assert select_trainable(cnn, "embedding") == ["embedding.weight", "embedding.bias"]
    last = select_trainable(cnn, "last-stage")
    assert last[-2:] == ["embedding.weight", "embedding.bias"]
    assert {n.split(".")[1] for n in last[:-2]} == {"3"}  # stages.3: the fourth, last stage
    resnet = get_backbone("resnet18", embedding_size=8, image_size=SIZE)
    assert select_trainable(resnet, "embedding") == ["fc.weight", "fc.bias"]
    assert all(n.startswith(("layer4.", "fc.")) for n in select_trainable(resnet, "last-stage"))
    dlib = get_backbone("dlib-resnet", embedding_size=128, image_size=150)
    assert select_trainable(dlib, "embedding") == ["embedding.weight"]
    assert select_trainable(dlib, "last-stage")[0].startswith("blocks.13.")
    # patterns and lists
    assert select_trainable(cnn, "stages.3.conv2.*, embedding.bias") == [
        "stages.3.conv2.weight",
        "embedding.bias",
    ]
    assert select_trainable(cnn, "all") == [n for n, _ in cnn.named_parameters()]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("embeding", "'embeding' names no parameter of the cnn-small backbone; aliases: all, "),
        ("layer9.*", "top-level modules: stem, stages, pool, dropout, embedding"),
        ("embedding,", "expected 'all' or a comma-separated list"),
        ("", "expected 'all' or a comma-separated list"),
        ("all,embedding", "'all' cannot be combined"),
    ],
)
def test_a_selector_naming_no_parameter_is_a_clear_error(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match="train.trainable") as caught:
        if not spec.strip() or "," in spec:
            TrainConfig(trainable=spec)
        build_model(CFG, 3, SIZE, seed=0, trainable=spec)
    assert message in str(caught.value)


def test_frozen_parameters_stay_bit_identical_and_are_not_shared() -> None:
    # Prepare: a model whose embedding layer alone trains
    model = build_model(CFG, 3, SIZE, seed=0, trainable="embedding")
    before = copy.deepcopy(model.state_dict())
    # Execute: local SGD with weight decay and momentum
    train_local(model, _data(), _sgd(4), generator=torch.Generator().manual_seed(0))
    # Assert: the trunk is bit-identical, the embedding moved, the head trained too
    after = model.state_dict()
    for name, value in before.items():
        moved = not torch.equal(value, after[name])
        trains = name.startswith(("backbone.embedding.", "head."))
        assert moved == trains, name
    assert FedAvg().shared_names(model) == [
        "backbone.embedding.weight",
        "backbone.embedding.bias",
        "head.classifier.weight",
    ]
    assert FedPE().shared_names(model) == ["backbone.embedding.weight", "backbone.embedding.bias"]
    assert len(FedPE().shared_names(build_model(CFG, 3, SIZE, seed=0))) > 2  # "all"


def test_frozen_batch_norm_keeps_its_running_statistics() -> None:
    cfg = ModelConfig(backbone="resnet18-bn", embedding_size=8, head="cosface")
    model = build_model(cfg, 3, SIZE, seed=0, trainable="embedding")
    before = copy.deepcopy(model.backbone.bn1.running_mean)
    train_local(model, _data(), _sgd(2), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model.backbone.bn1.running_mean, before)
    assert model.training and not model.backbone.bn1.training
    # a trained batch-norm layer's running statistics travel with its weights
    last = build_model(cfg, 3, SIZE, seed=0, trainable="last-stage")
    shared = FedPE().shared_names(last)
    assert "backbone.layer4.1.bn2.running_var" in shared and "backbone.fc.weight" in shared
    assert not any(n.startswith("backbone.layer3.") for n in shared)
    assert last.train().backbone.layer4[1].bn2.training


def test_cached_trunk_features_train_as_the_images_do() -> None:
    # Prepare: two copies of one model; one site caches the trunk's features
    model = build_model(CFG, 3, SIZE, seed=0, trainable="embedding")
    cached_model = copy.deepcopy(model)
    data = _data()
    cached = with_trunk_features(cached_model.backbone, data)
    assert cached.train.trunk_features and cached.train.images.shape == (12, 128)
    assert can_cache_trunk(model.backbone)
    # the tail maps the features as the whole backbone maps the images
    np.testing.assert_allclose(
        embed(model.backbone, data.test.images), embed(cached_model.backbone, cached.test.images),
        rtol=0, atol=1e-6,
    )  # fmt: skip
    # Execute: the same local training on both
    train_local(model, data, _sgd(3), generator=torch.Generator().manual_seed(1))
    train_local(cached_model, cached, _sgd(3), generator=torch.Generator().manual_seed(1))
    # Assert: the same trained parameters
    for (name, a), b in zip(
        model.state_dict().items(), cached_model.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("spec", "shape"), [("last-stage", (3, 256, 4, 4)), ("embedding", (3, 256))]
)
def test_dlib_resnet_caches_the_output_of_its_frozen_blocks(
    spec: str, shape: tuple[int, ...]
) -> None:
    # Prepare: dlib's architecture (random weights), the last block and the embedding train
    config = ModelConfig(backbone="dlib-resnet", embedding_size=128)
    model = build_model(config, 2, 150, seed=0, trainable=spec)
    g = torch.Generator().manual_seed(0)
    images = torch.rand(3, 3, 150, 150, generator=g) * 2 - 1
    data = FaceDataset(images, torch.tensor([0, 1, 1]), ("a", "b"))
    # Execute
    cached = held_out_features(model.backbone, data)
    # Assert: the frozen blocks' output, mapped on by the trainable ones as the images are
    assert cached.trunk_features and tuple(cached.images.shape) == shape
    np.testing.assert_allclose(
        embed(model.backbone, images), embed(model.backbone, cached.images), rtol=0, atol=1e-5
    )
    assert not can_cache_trunk(build_model(config, 2, 150, seed=0, trainable="all").backbone)


def test_no_cache_when_a_trunk_parameter_trains() -> None:
    model = build_model(CFG, 3, SIZE, seed=0, trainable="last-stage")  # FaceCNN: the tail only
    data = _data()
    assert not can_cache_trunk(model.backbone)
    assert with_trunk_features(model.backbone, data) is data
    assert with_trunk_features(build_model(CFG, 3, SIZE, seed=0).backbone, data) is data


TINY = """
[run]
name = "tiny-trainable"
seed = 2
[data]
source = "synthetic"
image_size = 32
num_identities = 18
images_per_identity = 6
held_out_identities = 6
[partition]
num_clients = 3
[model]
backbone = "cnn-small"
embedding_size = 16
[algorithm]
name = "fedpe"
[train]
rounds = 2
local_steps = 2
batch_size = 8
trainable = "embedding"
[server]
min_clients = 3
round_timeout = 120.0
[privacy]
unit = "client"
noise_placement = "distributed"
noise_multiplier = 1.0
[secure_aggregation]
scheme = "secagg"
"""


@pytest.mark.slow
def test_a_private_secure_run_shares_only_the_trainable_part(tmp_path: Path) -> None:
    # Prepare: client-level DP under SecAgg, the embedding layer alone trains
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    # Execute: embedded (server + 3 client processes over gRPC + mTLS), then fl-secure eval
    done = subprocess.run(
        [sys.executable, "-m", "fl_secure.app.cli", "train", "--config", str(path),
         "--out", str(tmp_path / "runs"), "--json", "--quiet"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = Path(json.loads(done.stdout.strip().splitlines()[-1])["run_dir"])
    scored = subprocess.run(
        [sys.executable, "-m", "fl_secure.app.cli", "eval", "--run", str(run_dir), "--json"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    # Assert: the checkpoint holds the embedding layer alone, which moved; the trunk is the
    # initial one everywhere (eval rebuilds it from the seed and scores the checkpoint)
    latest = CheckpointStore(run_dir / "checkpoints").latest()
    assert latest is not None and latest.round == 2
    assert list(latest.parameters) == ["backbone.embedding.weight", "backbone.embedding.bias"]
    initial = build_model(ModelConfig(backbone="cnn-small", embedding_size=16), 1, 32, 2)
    start = initial.backbone.embedding.weight.detach().numpy()
    assert float(np.abs(latest.parameters["backbone.embedding.weight"] - start).max()) > 1e-4
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert "tar_at_far_1e-2" in scored.stdout


def test_the_head_trains_at_its_own_rate() -> None:
    # Prepare: the embedding layer at lr 0.01, the head at 10x
    model = build_model(CFG, 3, SIZE, seed=0, trainable="embedding", head_lr_scale=10.0)
    training = LocalTraining(learning_rate=0.01, optimizer="adam", weight_decay=0.0)
    groups = parameter_groups(model, training)
    # Assert: two groups, frozen parameters in neither, the head at 0.1
    assert [len(g["params"]) for g in groups] == [2, 1]
    assert groups[1]["lr"] == pytest.approx(0.1) and "lr" not in groups[0]
    assert groups[1]["params"][0] is model.head.classifier.weight
    # Execute: one Adam step moves each parameter by its group's rate (Adam's first step is
    # lr x sign(grad))
    before = copy.deepcopy(model.state_dict())
    train_local(model, _data(), LocalTraining(local_steps=1, batch_size=12, learning_rate=0.01,
                optimizer="adam", weight_decay=0.0), generator=torch.Generator())  # fmt: skip
    after = model.state_dict()
    head_step = (after["head.classifier.weight"] - before["head.classifier.weight"]).abs().max()
    emb_step = (
        (after["backbone.embedding.weight"] - before["backbone.embedding.weight"]).abs().max()
    )
    assert float(head_step) == pytest.approx(0.1, rel=1e-3)
    assert float(emb_step) == pytest.approx(0.01, rel=1e-3)
    assert len(parameter_groups(build_model(CFG, 3, SIZE, seed=0), training)) == 1


@pytest.mark.parametrize("clipping", ["book-keeping", "opacus"])
def test_example_level_dpsgd_noises_and_moves_only_what_trains(clipping: Clipping) -> None:
    # Prepare: the embedding layer trains; the trunk is frozen; noise is on
    model = build_model(CFG, 3, SIZE, seed=0, trainable="embedding")
    before = copy.deepcopy(model.state_dict())
    settings = DPSGDSettings(
        noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.5, clipping=clipping
    )
    # Execute: two DP-SGD steps on raw images (no cached features)
    train_local_dpsgd(model, _data(), _sgd(2), settings, noise=SeededGaussian(seed=1))
    # Assert: frozen parameters bit-identical, the embedding layer and the head moved
    after = model.state_dict()
    for name, value in before.items():
        trains = name.startswith(("backbone.embedding.", "head."))
        assert (not torch.equal(value, after[name])) == trains, name
