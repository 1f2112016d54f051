"""Face model (backbone + margin head), local training loop and local evaluation.

Shared by the gRPC client, the embedded centralized baseline and (later) the simulation
backend, so every path trains with the same code.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fl_secure.config import Config, ModelConfig, TrainConfig
from fl_secure.data.types import FaceDataset
from fl_secure.errors import CheckpointError
from fl_secure.evaluation import rank1, rank1_leave_one_out, verification_metrics
from fl_secure.messages import LocalTraining, Tensors
from fl_secure.models import get_backbone, load_pretrained, make_head
from fl_secure.models.heads import ClassHead
from fl_secure.models.pretrained import resolve_pretrained
from fl_secure.models.trainable import (
    ALL,
    apply_trainable,
    can_cache_trunk,
    keep_frozen_norms_in_eval,
    trained_state_names,
)

#: The figures a run reports first (held-out identities, or a client's own test images).
HEADLINE = ("tar_at_far_1e-1", "tar_at_far_1e-2", "tar_at_far_1e-3", "roc_auc", "eer", "rank1")


class FaceModel(nn.Module):
    """Backbone producing embeddings plus a margin head over ``num_classes`` identities."""

    def __init__(self, backbone: nn.Module, head: ClassHead, *, head_lr_scale: float = 1.0):
        super().__init__()
        self.backbone = backbone
        self.head: ClassHead = head
        self.head_lr_scale = head_lr_scale  # train.head_lr_scale (parameter_groups)

    def forward(
        self,
        images: torch.Tensor,
        labels: torch.Tensor | None = None,
        class_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of the margin head."""
        result: torch.Tensor = self.head(self.backbone(images), labels, class_mask)
        return result

    def train(self, mode: bool = True) -> FaceModel:
        """Training mode, except frozen batch-norm layers, which keep their statistics."""
        super().train(mode)
        if mode:
            keep_frozen_norms_in_eval(self)
        return self


def build_model(
    cfg: ModelConfig,
    num_classes: int,
    image_size: int,
    seed: int,
    *,
    trainable: str = ALL,
    head_lr_scale: float = 1.0,
    head_seed: int | None = None,
) -> FaceModel:
    """The run's model, initialised deterministically from ``seed`` (same on every party).

    ``trainable`` is the run's ``train.trainable``: the backbone parameters it does not
    select are frozen (:func:`fl_secure.models.trainable.apply_trainable`);
    ``head_lr_scale`` is ``train.head_lr_scale`` (:func:`parameter_groups`). ``head_seed``:
    a private head's own seed (:func:`private_head_seed`); None draws the head from the
    backbone's stream, as a shared head must be (the same on every party).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        backbone = get_backbone(
            cfg.backbone, embedding_size=cfg.embedding_size, image_size=image_size
        )
        if head_seed is not None:
            torch.manual_seed(head_seed)
        if cfg.head == "softmax":
            head = make_head("softmax", num_classes, cfg.embedding_size)
        else:
            head = make_head(cfg.head, num_classes, cfg.embedding_size, s=cfg.scale, m=cfg.margin)
    if cfg.pretrained:  # a file, or a built-in name ("dlib-resnet")
        load_pretrained(backbone, resolve_pretrained(cfg.pretrained))
    apply_trainable(backbone, trainable, backbone_name=cfg.backbone)
    return FaceModel(backbone, head, head_lr_scale=head_lr_scale)


def private_head_seed(run_seed: int, client_id: str) -> int:
    """The seed of ``client_id``'s private head: its own, derived from the run seed and its id.

    Private heads (FedPE, FedGC, FedFR, AdaFedFR, HF-MAML's local variant) drawn from the run
    seed alone would start identical on every client (row ``i`` the same vector everywhere),
    which is not how the papers start them and tilts every private-head comparison. The head
    holds no data, so a seed the server could also derive reveals nothing; it keeps runs
    reproducible.
    """
    digest = hashlib.sha256(f"{run_seed}:private-head:{client_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def build_run_model(
    config: Config, num_classes: int, *, image_size: int = 0, head_seed: int | None = None
) -> FaceModel:
    """:func:`build_model` set up by a run's config: seed, ``train.trainable``, head rate.

    Every party of a run builds its model here, so all of them freeze and share the same
    parameters. ``image_size``: 0 for ``data.image_size``; ``head_seed``: a client's private
    head (:func:`private_head_seed`), None for a shared one.
    """
    return build_model(
        config.model,
        num_classes,
        image_size or config.data.image_size,
        config.run.seed,
        trainable=config.train.trainable,
        head_lr_scale=config.train.head_lr_scale,
        head_seed=head_seed,
    )


def get_tensors(model: nn.Module, names: Iterable[str]) -> Tensors:
    """Copies of the named parameters as numpy arrays, in the given order."""
    state = model.state_dict()
    return OrderedDict((n, state[n].detach().cpu().numpy().copy()) for n in names)


def set_tensors(model: nn.Module, tensors: Tensors) -> None:
    """Load the named arrays into the model's parameters (strict on names and shapes)."""
    state = model.state_dict()
    for name, array in tensors.items():
        if name not in state or tuple(state[name].shape) != tuple(array.shape):
            raise ValueError(f"parameter {name!r} does not fit the model")
        state[name].copy_(torch.from_numpy(np.array(array, copy=True)))


def load_checkpoint_into(
    module: nn.Module, params: Tensors, *, source: str, prefix: str = "", required: str = ""
) -> None:
    """Load a checkpoint's ``prefix``-named arrays into ``module``, or say what does not fit.

    Every floating-point key of ``module``'s state that starts with ``required`` must be in
    the checkpoint (``""``: every key; integer buffers such as BatchNorm's step counters are
    not shared), and every array must match its parameter's shape. When ``train.trainable``
    froze part of ``module``, only its trainable parameters are required.

    Raises:
        CheckpointError: naming the missing, unknown or misshapen keys and ``source``.
    """
    picked = type(params)((k[len(prefix) :], v) for k, v in params.items() if k.startswith(prefix))
    state = module.state_dict()
    # train.trainable froze part of the model: only what trains is in a checkpoint
    partial = any(not p.requires_grad for p in module.parameters())
    shared = set(trained_state_names(module)) if partial else set(state)
    missing = [
        prefix + k
        for k, v in state.items()
        if k.startswith(required) and k not in picked and v.is_floating_point() and k in shared
    ]
    unknown = [prefix + k for k in picked if k not in state]
    shapes = [
        f"{prefix}{k} has shape {tuple(v.shape)}, the model expects {tuple(state[k].shape)}"
        for k, v in picked.items()
        if k in state and tuple(v.shape) != tuple(state[k].shape)
    ]
    if missing or unknown or shapes:
        problems = ([f"missing {missing[:5]}"] if missing else []) + (
            [f"unknown {unknown[:5]}"] if unknown else []
        )
        raise CheckpointError(
            f"{source} does not fit the model of the run's config: "
            + "; ".join(problems + shapes[:5])
        )
    set_tensors(module, picked)


@dataclass(frozen=True)
class LocalData:
    """One party's data: labels remapped to the head's class indices."""

    train: FaceDataset
    test: FaceDataset
    train_targets: torch.Tensor  # class index of each training image in the head
    class_mask: torch.Tensor | None  # bool [num_classes]; None = every class present


def held_out_features(backbone: nn.Module, dataset: FaceDataset) -> FaceDataset:
    """``dataset`` as the frozen trunk's features if :func:`with_trunk_features` would cache."""
    if not can_cache_trunk(backbone) or dataset.trunk_features:
        return dataset
    return _trunk_features(backbone, dataset)


def with_trunk_features(backbone: nn.Module, data: LocalData) -> LocalData:
    """``data`` with its images replaced by the frozen trunk's features, computed once.

    Only when every trainable parameter lies in the backbone's tail
    (:func:`fl_secure.models.trainable.can_cache_trunk`); ``data`` unchanged otherwise.
    The backbone then maps those ``[N, D]`` features through its tail as it would the images.
    """
    if not can_cache_trunk(backbone) or data.train.trunk_features:
        return data
    train = _trunk_features(backbone, data.train)
    test = train if data.test is data.train else _trunk_features(backbone, data.test)
    return dataclasses.replace(data, train=train, test=test)


@torch.no_grad()
def _trunk_features(backbone: nn.Module, dataset: FaceDataset, batch: int = 64) -> FaceDataset:
    was_training = backbone.training
    backbone.eval()  # the trunk is frozen; eval mode: dropout off, norms' running statistics
    images = dataset.images
    parts = [backbone.trunk_features(images[i : i + batch])  # type: ignore[operator]
             for i in range(0, len(images), batch)]  # fmt: skip
    backbone.train(was_training)
    features = torch.cat(parts) if parts else torch.zeros(0, 1)
    return dataclasses.replace(dataset, images=features.contiguous(), trunk_features=True)


class AbsentRows:
    """Keeps the head entries of classes a client does not hold exactly as the server sent them.

    Those entries get zero gradient (their logits are masked), but weight decay, optimizer
    state or DP noise would still move them; :meth:`restore` after every step puts them back.
    Every head parameter indexed by class is kept: the class embeddings ``W`` and, for the
    softmax head, the bias.
    """

    def __init__(self, model: FaceModel, class_mask: torch.Tensor | None) -> None:
        self.absent = None if class_mask is None else ~class_mask
        self.saved: list[tuple[nn.Parameter, torch.Tensor]] = []
        if self.absent is not None:
            classes = len(self.absent)
            self.saved = [
                (p, p.detach()[self.absent].clone())
                for p in model.head.parameters()
                if p.dim() >= 1 and p.shape[0] == classes
            ]

    def restore(self) -> None:
        """Write the saved entries back (a no-op when every class is present)."""
        if self.absent is None:
            return
        with torch.no_grad():
            for param, rows in self.saved:
                param[self.absent] = rows


def round_start_copy(backbone: nn.Module) -> nn.Module:
    """A frozen copy of ``backbone`` that embeds as the local model does at the round's start.

    For the reference embeddings of HF-MAML's Eq. 4 and AdaFedFR's ``f_g`` (Eq. 6): at the
    round's first step they must equal the local model's own. The copy is in eval mode
    except its batch-norm layers, which use the batch's statistics as the training model's
    do; in eval mode they would use the running ones, and the two differ even at equal
    weights (the statistics the copy's forwards add to its running ones are never read).
    """
    frozen = copy.deepcopy(backbone).eval()
    for p in frozen.parameters():
        p.requires_grad_(False)
    for module in frozen.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.train()
    return frozen


def local_training(t: TrainConfig) -> LocalTraining:
    """The local-training settings a task carries, from the run's ``[train]`` section."""
    return LocalTraining(
        local_epochs=t.local_epochs,
        local_steps=t.local_steps,
        batch_size=t.batch_size,
        learning_rate=t.lr,
        momentum=t.momentum,
        weight_decay=t.weight_decay,
        optimizer=t.optimizer,
    )


def round_learning_rate(base: float, round_: int, rounds: int, schedule: str) -> float:
    """Learning rate of round ``round_`` (1-based) of ``rounds``: constant or cosine decay."""
    if schedule == "constant":
        return base
    if schedule == "cosine":
        return base * 0.5 * (1.0 + math.cos(math.pi * (round_ - 1) / max(rounds, 1)))
    raise ValueError(f"unknown lr schedule {schedule!r}; allowed: constant, cosine")


def parameter_groups(model: nn.Module, training: LocalTraining) -> list[dict[str, Any]]:
    """The model's trainable parameters for :func:`make_optimizer`, as optimizer groups.

    A :class:`FaceModel` with ``head_lr_scale`` != 1 (``train.head_lr_scale``) gets two
    groups: the backbone at the round's learning rate, the head at that rate times the
    scale. A pretrained backbone fine-tunes at a small rate while a freshly initialised head
    (one row per identity) must move far: at one rate, either the head learns too slowly to
    give the embedding useful gradients or the embedding is pulled from its pretrained
    optimum. Frozen parameters (``train.trainable``) are in no group.
    """
    scale = float(getattr(model, "head_lr_scale", 1.0))
    if scale == 1.0 or not isinstance(model, FaceModel):
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    head = {id(p) for p in model.head.parameters()}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in head]
    mine = [p for p in model.head.parameters() if p.requires_grad]
    lr = training.learning_rate * scale
    head_group = {"params": mine, "lr": lr, "lr_scale": scale}
    return [g for g in ({"params": rest}, head_group) if g["params"]]


def make_optimizer(
    params: Iterable[nn.Parameter] | Iterable[dict[str, Any]], training: LocalTraining
) -> torch.optim.Optimizer:
    """SGD with momentum (the seed papers' optimiser) or Adam, over parameters or groups."""
    if training.optimizer == "adam":
        return torch.optim.Adam(
            params, lr=training.learning_rate, weight_decay=training.weight_decay
        )
    if training.optimizer != "sgd":
        raise ValueError(f"unknown optimizer {training.optimizer!r}; allowed: sgd, adam")
    return torch.optim.SGD(
        params,
        lr=training.learning_rate,
        momentum=training.momentum,
        weight_decay=training.weight_decay,
    )


def train_local(
    model: FaceModel,
    data: LocalData,
    training: LocalTraining,
    *,
    generator: torch.Generator,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, float]:
    """Train for ``local_epochs`` epochs (or ``local_steps`` batches); return loss/accuracy."""
    model.train()
    opt = optimizer or make_optimizer(parameter_groups(model, training), training)
    n = len(data.train)
    batch = min(training.batch_size, n)
    steps_per_epoch = max(1, n // batch)
    total = training.local_steps or training.local_epochs * steps_per_epoch
    loss_fn = nn.CrossEntropyLoss()
    losses: list[float] = []
    correct = seen = 0
    order = torch.randperm(n, generator=generator)
    cursor = 0
    absent = AbsentRows(model, data.class_mask)
    for _ in range(total):
        if cursor + batch > n:
            order, cursor = torch.randperm(n, generator=generator), 0
        idx = order[cursor : cursor + batch]
        cursor += batch
        images, targets = data.train.images[idx], data.train_targets[idx]
        emb = model.backbone(images)
        loss = loss_fn(model.head(emb, targets, data.class_mask), targets)
        with torch.no_grad():  # accuracy of this step's forward: no second pass (BatchNorm)
            plain = model.head(emb.detach(), None, data.class_mask)
            correct += int((plain.argmax(1) == targets).sum())
            seen += len(targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        absent.restore()
        losses.append(float(loss.detach()))
    return {
        "train_loss": float(np.mean(losses)) if losses else 0.0,
        "train_accuracy": correct / max(seen, 1),
        "local_steps": float(total),
    }


@torch.no_grad()
def embed(
    backbone: nn.Module, images: torch.Tensor, batch_size: int = 256, *, unit: bool = True
) -> np.ndarray:
    """Embeddings of ``images`` in evaluation mode, L2-normalised unless ``unit`` is False.

    The float32 normalisation turns a zero row, or one whose norm overflows float32, into
    zeros; ``unit=False`` returns the backbone's outputs as they are, for
    :func:`fl_secure.evaluation.normalise_rows` (float64, refuses degenerate rows).
    """
    was_training = backbone.training
    backbone.eval()
    outputs = [backbone(images[i : i + batch_size]) for i in range(0, len(images), batch_size)]
    backbone.train(was_training)
    emb = torch.cat(outputs) if outputs else torch.zeros(0, 1)
    if not unit:
        return emb.cpu().numpy()
    return torch.nn.functional.normalize(emb, dim=1).cpu().numpy()


def evaluate_verification(
    backbone: nn.Module, dataset: FaceDataset, *, roc_points: bool = False
) -> dict[str, float]:
    """Verification over all pairs of ``dataset`` plus leave-one-out rank-1."""
    emb = embed(backbone, dataset.images)
    labels = dataset.labels.numpy()
    metrics = verification_metrics(emb, labels, roc_points=roc_points)
    metrics["rank1"] = float(rank1_leave_one_out(emb, labels))
    return metrics


def evaluate_local(backbone: nn.Module, data: LocalData) -> dict[str, float]:
    """A client's view: verification on its test images, rank-1 against its train gallery."""
    if len(data.test) == 0:  # every identity had a single image here: nothing to score
        return {}
    test_emb = embed(backbone, data.test.images)
    labels = data.test.labels.numpy()
    counts = np.unique(labels, return_counts=True)[1]
    # Verification needs impostor pairs (two identities) and genuine pairs: a client of a
    # skewed partition may hold one identity; it then reports rank-1 only.
    verifiable = len(counts) >= 2 and bool((counts >= 2).any())
    metrics = verification_metrics(test_emb, labels) if verifiable else {}
    gallery = embed(backbone, data.train.images)
    metrics["rank1"] = float(rank1(gallery, data.train.labels.numpy(), test_emb, labels))
    return metrics
