"""Identity-level DP-SGD: a step against a plain loop, sensitivity C, frozen parameters."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from fl_secure.config import ModelConfig
from fl_secure.data.types import FaceDataset
from fl_secure.messages import LocalTraining
from fl_secure.training import FaceModel, LocalData, build_model, with_trunk_features
from privacy.dp.dpsgd import DPSGDSettings
from privacy.dp.identity_dpsgd import (
    clipped_identity_sum,
    identity_groups,
    number_of_identities,
    train_local_identity_dpsgd,
    trainable_parameters,
)
from privacy.dp.noise import SeededGaussian, gaussian_tensor_like

torch.set_num_threads(1)

SIZE = 32
CLASSES = 4


def _model() -> FaceModel:
    cfg = ModelConfig(backbone="cnn-small", embedding_size=8, head="arcface", scale=8.0, margin=0.3)
    return build_model(cfg, CLASSES, SIZE, seed=0)


def _data(counts: tuple[int, ...] = (1, 2, 3, 4)) -> LocalData:
    """Identity ``i`` holds ``counts[i]`` random images, interleaved (not sorted by identity)."""
    g = torch.Generator().manual_seed(1)
    labels = torch.cat([torch.full((c,), i) for i, c in enumerate(counts)])
    labels = labels[torch.randperm(len(labels), generator=g)]
    images = torch.rand(len(labels), 3, SIZE, SIZE, generator=g) * 2 - 1
    dataset = FaceDataset(images, labels, tuple(f"id{i}" for i in range(CLASSES)))
    return LocalData(train=dataset, test=dataset, train_targets=labels, class_mask=None)


def _sgd(steps: int, lr: float) -> LocalTraining:
    return LocalTraining(local_steps=steps, learning_rate=lr, momentum=0.0, weight_decay=0.0)


def _identity_grad(model: FaceModel, data: LocalData, identity: int) -> list[torch.Tensor]:
    """Plain torch: backward of the summed loss of every image of one identity, in one batch."""
    idx = torch.nonzero(data.train.labels == identity).flatten()
    images, targets = data.train.images[idx], data.train_targets[idx]
    model.zero_grad(set_to_none=True)
    logits = model(images, targets, data.class_mask)
    nn.functional.cross_entropy(logits, targets, reduction="sum").backward()  # type: ignore[no-untyped-call]
    grads = [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for p in trainable_parameters(model)
    ]
    model.zero_grad(set_to_none=True)
    return grads


def test_identity_groups_collect_every_image_of_each_identity() -> None:
    labels = torch.tensor([7, 3, 7, 9, 3, 7])
    groups = identity_groups(labels)
    assert [g.tolist() for g in groups] == [[1, 4], [0, 2, 5], [3]]
    assert number_of_identities(labels) == 3


def test_one_step_at_zero_noise_equals_the_plain_loop_reference() -> None:
    # Prepare: 4 identities of 1-4 images, q = 0.6, chunks of 2 images (identity 3 takes two
    # forward passes), no noise; the reference is a per-identity backward, clip, sum, divide
    q, m, seed = 0.6, 4, 5
    model, data = _model(), _data()
    reference = copy.deepcopy(model)
    before = [p.detach().clone() for p in model.parameters()]
    sampled = np.flatnonzero(SeededGaussian(seed).uniform(m) < q)
    assert len(sampled) >= 2 and 3 in sampled  # several identities, one over two chunks
    grads = [_identity_grad(reference, data, int(i)) for i in sampled]
    norms = [float(torch.stack([g.norm() for g in per]).norm()) for per in grads]
    clip = math.sqrt(min(norms) * max(norms))  # clips the largest, not the smallest
    assert min(norms) < clip < max(norms)
    lr = 0.03 / clip
    summed = [torch.zeros_like(p) for p in before]
    for per, norm in zip(grads, norms, strict=True):
        factor = min(1.0, clip / (norm + 1e-6))
        for total, g in zip(summed, per, strict=True):
            total += factor * g
    expected = [p - lr * s / (q * m) for p, s in zip(before, summed, strict=True)]
    settings = DPSGDSettings(0.0, clip, q, max_physical_batch_size=2)

    # Execute
    metrics = train_local_identity_dpsgd(
        model, data, _sgd(1, lr), settings, noise=SeededGaussian(seed)
    )

    # Assert: parameters to 1e-6, the update itself well above that
    moved = max(float((e - b).abs().max()) for e, b in zip(expected, before, strict=True))
    assert moved > 1e-3
    for p, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-6)
    assert metrics["local_steps"] == 1.0 and metrics["dp_noise_secure"] == 0.0
    assert all(p.grad is None for p in model.parameters())


def test_the_noise_is_the_sources_gaussian_of_std_z_c_over_the_expected_batch() -> None:
    # Prepare: q = 1 (every identity), a learning rate 1 step; the step's noise replayed
    z, clip, q, seed = 0.8, 0.5, 1.0, 2
    model, data = _model(), _data()
    before = [p.detach().clone() for p in model.parameters()]
    groups = identity_groups(data.train.labels)
    twin = copy.deepcopy(model)
    summed, _ = clipped_identity_sum(twin, data, groups, trainable_parameters(twin), clip, 64)
    assert max(float(s.abs().max()) for s in summed) > 1e-3
    replica = SeededGaussian(seed)
    replica.uniform(len(groups))  # the sampling draws come first
    noise = [gaussian_tensor_like(replica, p, z * clip) for p in before]
    settings = DPSGDSettings(z, clip, q)
    # Execute
    train_local_identity_dpsgd(model, data, _sgd(1, 1.0), settings, noise=SeededGaussian(seed))
    # Assert: p - (sum + noise) / (q m)
    for p, b, s, n in zip(model.parameters(), before, summed, noise, strict=True):
        torch.testing.assert_close(p.detach(), b - (s + n) / len(groups), rtol=0, atol=1e-5)


def test_an_identity_with_many_images_moves_the_sum_by_at_most_c() -> None:
    # Prepare: identity 3 holds 12 images whose loss is scaled up 1e4 (a person whose images
    # dominate the data); the sum over all identities with and without it
    clip = 0.25
    model, data = _model(), _data((2, 2, 2, 12))
    params = trainable_parameters(model)
    groups = identity_groups(data.train.labels)
    hot = data.train.labels == 3
    loud = LocalData(
        train=FaceDataset(
            torch.where(hot[:, None, None, None], data.train.images * 1e4, data.train.images),
            data.train.labels,
            data.train.identity_names,
        ),
        test=data.test,
        train_targets=data.train_targets,
        class_mask=None,
    )
    # Execute
    with_it, _ = clipped_identity_sum(model, loud, groups, params, clip, 5)
    without, _ = clipped_identity_sum(model, loud, groups[:3], params, clip, 5)
    alone, _ = clipped_identity_sum(model, loud, groups[3:], params, clip, 5)
    # Assert: the change is identity 3's clipped gradient, of norm <= C (and it did clip)
    diffs = [(a - b).norm() for a, b in zip(with_it, without, strict=True)]
    change = float(torch.stack(diffs).norm())
    assert 0.9 * clip < change <= clip * (1 + 1e-5)
    raw = _identity_grad(model, loud, 3)
    assert float(torch.stack([g.norm() for g in raw]).norm()) > 10 * clip
    for a, w, wo in zip(alone, with_it, without, strict=True):
        torch.testing.assert_close(a, w - wo, rtol=0, atol=1e-5)


@pytest.mark.parametrize("z", [0.0, 1.0])
def test_frozen_parameters_get_no_update_and_no_noise(z: float) -> None:
    # Prepare: the backbone's first layers frozen (requires_grad False), Adam with weight
    # decay (which would move any parameter it holds), noise on
    model, data = _model(), _data()
    frozen = list(model.backbone.parameters())[:2]
    for p in frozen:
        p.requires_grad_(False)
    kept = [p.detach().clone() for p in frozen]
    others = [p.detach().clone() for p in trainable_parameters(model)]
    training = LocalTraining(local_steps=3, learning_rate=0.01, optimizer="adam", weight_decay=0.1)
    settings = DPSGDSettings(z, 1.0, 0.5)
    # Execute
    train_local_identity_dpsgd(model, data, training, settings, noise=SeededGaussian(0))
    # Assert: frozen exactly as they were, and never given a gradient; the rest moved
    for p, k in zip(frozen, kept, strict=True):
        assert torch.equal(p.detach(), k) and p.grad is None and not p.requires_grad
    assert all(
        not torch.equal(p.detach(), o)
        for p, o in zip(trainable_parameters(model), others, strict=True)
    )


def test_the_steps_follow_the_identity_rate() -> None:
    # 4 identities at q = 0.5: one local epoch is round(1 / q) = 2 steps, each a noisy step
    model, data = _model(), _data()
    source = SeededGaussian(1)
    metrics = train_local_identity_dpsgd(
        model, data, LocalTraining(local_epochs=3), DPSGDSettings(1.0, 1.0, 0.5), noise=source
    )
    assert metrics["local_steps"] == 6.0
    # each step drew 4 uniforms, then one normal per trainable coordinate
    coords = sum(p.numel() for p in trainable_parameters(model))
    replay = SeededGaussian(1)
    for _ in range(6):
        replay.uniform(4)
        replay.standard_normal(coords)
    assert source.uniform(3).tolist() == replay.uniform(3).tolist()


def test_train_trainable_frozen_trunk_gets_no_update_and_cached_features_train() -> None:
    # Prepare: train.trainable = "embedding" freezes the trunk; the site embeds it once
    # (trunk features in place of the images), as client.trainer_factory does
    cfg = ModelConfig(backbone="cnn-small", embedding_size=8)
    model = build_model(cfg, CLASSES, SIZE, seed=0, trainable="embedding")
    frozen = {k: p.detach().clone() for k, p in model.named_parameters() if not p.requires_grad}
    trains = {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
    assert frozen and sorted(trains) == [
        "backbone.embedding.bias", "backbone.embedding.weight", "head.classifier.weight",
    ]  # fmt: skip
    data = with_trunk_features(model.backbone, _data())
    assert data.train.images.dim() == 2  # the trunk's features, not pixels
    # Execute: three noisy identity-level steps
    settings = DPSGDSettings(1.0, 1.0, 0.5)
    train_local_identity_dpsgd(model, data, _sgd(3, 0.05), settings, noise=SeededGaussian(0))
    # Assert: the frozen trunk exactly as it was; the selected layers (and the head) moved
    for k, p in model.named_parameters():
        if k in frozen:
            assert torch.equal(p.detach(), frozen[k]) and p.grad is None
        else:
            assert not torch.equal(p.detach(), trains[k])
