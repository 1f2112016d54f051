"""Model building (incl. pretrained weights), strategies' client and server steps."""

from __future__ import annotations

import copy
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from fl_secure.algorithms import FedAvg, FedPE, get_strategy
from fl_secure.config import ModelConfig
from fl_secure.data.types import FaceDataset
from fl_secure.errors import CheckpointError, ConfigError
from fl_secure.messages import LocalTraining
from fl_secure.models import save_weights
from fl_secure.training import (
    LocalData,
    build_model,
    get_tensors,
    load_checkpoint_into,
    round_learning_rate,
    round_start_copy,
    train_local,
)

CFG = ModelConfig(backbone="cnn-small", embedding_size=16, head="cosface", scale=16, margin=0.2)


def _data(labels: list[int]) -> FaceDataset:
    g = torch.Generator().manual_seed(0)
    images = torch.rand(len(labels), 3, 32, 32, generator=g) * 2 - 1
    return FaceDataset(images, torch.tensor(labels), tuple(f"id{i}" for i in range(10)))


def test_same_seed_same_model_and_pretrained_weights_load(tmp_path: Path) -> None:
    a = build_model(CFG, 3, 32, seed=5)
    b = build_model(CFG, 3, 32, seed=5)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb)
    donor = build_model(CFG, 3, 32, seed=99).backbone
    save_weights(donor, tmp_path / "backbone.safetensors")
    cfg = ModelConfig(**{**CFG.__dict__, "pretrained": str(tmp_path / "backbone.safetensors")})
    loaded = build_model(cfg, 3, 32, seed=5).backbone
    for k, v in donor.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_pretrained_file_missing_is_a_clear_error(tmp_path: Path) -> None:
    cfg = ModelConfig(**{**CFG.__dict__, "pretrained": str(tmp_path / "nope.safetensors")})
    with pytest.raises(CheckpointError, match=r"nope\.safetensors does not exist"):
        build_model(cfg, 3, 32, seed=0)


def test_pretrained_weights_with_nan_are_refused_before_training(tmp_path: Path) -> None:
    donor = build_model(CFG, 3, 32, seed=99).backbone
    name = next(k for k, v in donor.state_dict().items() if v.is_floating_point())
    with torch.no_grad():
        donor.state_dict()[name].view(-1)[:2] = torch.tensor([float("nan"), float("inf")])
    save_weights(donor, tmp_path / "nan.safetensors")
    cfg = ModelConfig(**{**CFG.__dict__, "pretrained": str(tmp_path / "nan.safetensors")})
    with pytest.raises(CheckpointError, match=f"key '{name}' holds 2 NaN/Inf values"):
        build_model(cfg, 3, 32, seed=0)


def test_shared_names_by_design() -> None:
    model = build_model(CFG, 4, 32, seed=0)
    pe, avg = FedPE().shared_names(model), FedAvg().shared_names(model)
    assert all(n.startswith("backbone.") for n in pe)
    assert set(avg) - set(pe) == {"head.classifier.weight"}
    assert get_strategy("fedpe").exposure == "private-embedding"
    assert get_strategy("fedavg").exposure == "global-head"
    allowed = (
        "allowed: adafedfr, fedaffect, fedavg, fedcos, fedfr, fedfr-public, fedgc, fedpe, "
        "hfmaml, hfmaml-global"
    )
    with pytest.raises(ConfigError, match=allowed):
        get_strategy("fedsgd")


def test_local_data_label_spaces() -> None:
    train, test = _data([7, 7, 2, 2]), _data([7, 2])
    federation = np.array([1, 2, 5, 7])
    pe = FedPE().local_data(train, test, federation)
    assert pe.train_targets.tolist() == [1, 1, 0, 0] and pe.class_mask is None
    avg = FedAvg().local_data(train, test, federation)
    assert avg.train_targets.tolist() == [3, 3, 1, 1]
    assert avg.class_mask is not None and avg.class_mask.tolist() == [False, True, False, True]


@pytest.mark.parametrize("strategy", [FedPE(), FedAvg()])
def test_client_update_is_the_change_of_shared_parameters(strategy) -> None:
    train, test = _data([7, 7, 2, 2, 7, 2]), _data([7, 2])
    federation = np.array([2, 5, 7])
    data = strategy.local_data(train, test, federation)
    classes = strategy.num_head_classes(len(federation), np.array([2, 7]))
    model = build_model(CFG, classes, 32, seed=0)
    shared = get_tensors(model, strategy.shared_names(model))
    training = LocalTraining(local_steps=2, batch_size=3, learning_rate=0.01, optimizer="adam")
    head_before = model.head.weight.detach().clone()
    result = strategy.client_update(
        model, data, training, shared, generator=torch.Generator().manual_seed(0)
    )
    after = get_tensors(model, shared.keys())
    assert list(result.update) == list(shared)
    for k in shared:
        np.testing.assert_allclose(result.update[k], after[k] - shared[k], rtol=0, atol=1e-7)
    assert any(np.abs(u).max() > 0 for u in result.update.values())
    assert result.num_examples == 6
    if isinstance(strategy, FedAvg):  # class 5 is absent at this client: its row is untouched
        row = 1
        assert torch.equal(model.head.weight[row], head_before[row])
        assert not torch.equal(model.head.weight[0], head_before[0])


def test_server_update_adds_the_mean_update() -> None:
    params = OrderedDict(w=np.ones(3, np.float32))
    out = FedPE().server_update(params, OrderedDict(w=np.full(3, 0.5, np.float32)), 1)
    np.testing.assert_array_equal(out["w"], np.full(3, 1.5, np.float32))
    assert out["w"].dtype == np.float32


def test_cosine_schedule() -> None:
    assert round_learning_rate(0.1, 1, 10, "cosine") == pytest.approx(0.1)
    assert round_learning_rate(0.1, 6, 10, "cosine") == pytest.approx(0.05)
    assert round_learning_rate(0.1, 10, 10, "cosine") == pytest.approx(
        0.1 * (1 + np.cos(0.9 * np.pi)) / 2
    )
    assert round_learning_rate(0.1, 7, 10, "constant") == 0.1


def test_a_single_identity_client_reports_rank1_only() -> None:
    # A skewed partition can leave a client with one identity: no impostor pairs to verify
    from fl_secure.data.types import FaceDataset
    from fl_secure.training import evaluate_local

    model = build_model(CFG, 1, 32, seed=0)
    images = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    data = FaceDataset(images=images, labels=torch.zeros(6, dtype=torch.int64),
                       identity_names=["only"])  # fmt: skip
    local = LocalData(train=data, test=data, train_targets=data.labels, class_mask=None)
    assert evaluate_local(model.backbone, local) == {"rank1": 1.0}


def test_a_client_without_test_images_reports_nothing() -> None:
    # An attribute partition can leave a client one image per identity: all for training
    from fl_secure.data.types import FaceDataset
    from fl_secure.training import evaluate_local

    model = build_model(CFG, 2, 32, seed=0)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    train = FaceDataset(images=images, labels=torch.tensor([0, 1]), identity_names=["a", "b"])
    empty = train.subset(np.array([], dtype=np.int64))
    local = LocalData(train=train, test=empty, train_targets=train.labels, class_mask=None)
    assert evaluate_local(model.backbone, local) == {}


def test_absent_classes_keep_their_softmax_bias_as_well_as_their_row() -> None:
    # Prepare: a softmax head (weight and bias per class); classes 0 and 2 are absent
    config = ModelConfig(backbone="cnn-small", embedding_size=16, head="softmax")
    model = build_model(config, 3, 32, seed=0)
    data = FedAvg().local_data(_data([5, 5, 5, 5]), _data([5]), np.array([2, 5, 7]))
    bias_before = model.head.classifier.bias.detach().clone()
    weight_before = model.head.weight.detach().clone()
    training = LocalTraining(
        local_steps=3, batch_size=2, learning_rate=0.1, optimizer="adam", weight_decay=5e-4
    )
    # Execute
    train_local(model, data, training, generator=torch.Generator().manual_seed(0))
    # Assert: weight decay and Adam leave the absent classes' entries exactly as sent
    bias = model.head.classifier.bias.detach()
    for absent in (0, 2):
        assert bias[absent] == bias_before[absent]
        assert torch.equal(model.head.weight[absent], weight_before[absent])
    assert bias[1] != bias_before[1]


def test_a_round_start_copy_embeds_as_the_training_model_with_batch_norm() -> None:
    # Prepare: a BatchNorm backbone, not yet trained (running statistics at their start)
    model = build_model(
        ModelConfig(backbone="resnet18-bn", embedding_size=16, head="cosface"), 3, 32, seed=0
    )
    images = torch.rand(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    model.train()
    # Execute
    reference = round_start_copy(model.backbone)
    with torch.no_grad():
        expected = model.backbone(images)
        found = reference(images)
        eval_mode = copy.deepcopy(model.backbone).eval()(images)
    # Assert: the copy equals the training model at equal weights; eval mode would not
    torch.testing.assert_close(found, expected, rtol=0, atol=1e-6)
    assert (eval_mode - expected).abs().max() > 0.1
    assert not any(p.requires_grad for p in reference.parameters())


def test_train_local_updates_batch_norm_statistics_once_per_step() -> None:
    model = build_model(
        ModelConfig(backbone="resnet18-bn", embedding_size=16, head="cosface"), 2, 32, seed=0
    )
    data = FedPE().local_data(_data([1, 1, 2, 2]), _data([1, 2]), np.array([1, 2]))
    training = LocalTraining(local_steps=3, batch_size=2, learning_rate=0.01, optimizer="sgd")
    train_local(model, data, training, generator=torch.Generator().manual_seed(0))
    tracked = [
        int(m.num_batches_tracked)
        for m in model.backbone.modules()
        if isinstance(m, torch.nn.BatchNorm2d)
    ]
    assert tracked and set(tracked) == {3}


def test_batch_norm_step_counters_are_not_shared() -> None:
    # Prepare: resnet18-bn carries int64 num_batches_tracked buffers beside its floats
    config = ModelConfig(backbone="resnet18-bn", embedding_size=16, head="cosface")
    model = build_model(config, 3, 32, seed=0)
    counters = [k for k, v in model.state_dict().items() if not v.is_floating_point()]
    assert counters and all(k.endswith("num_batches_tracked") for k in counters)
    # Execute
    names = FedAvg().shared_names(model)
    # Assert: every float tensor (running statistics included) is shared, no counter is
    floats = [k for k, v in model.state_dict().items() if v.is_floating_point()]
    assert names == floats
    # and a checkpoint of the shared tensors loads into a fresh model of the run
    fresh = build_model(config, 3, 32, seed=1)
    load_checkpoint_into(fresh, get_tensors(model, names), source="global.safetensors")
    for name in names:
        assert torch.equal(fresh.state_dict()[name], model.state_dict()[name])
