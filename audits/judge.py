"""An independent judge of reconstructions: identification, feature distance, SSIM and PSNR.

The evaluator is a separate network trained on the target identities' own (private) images,
which the attacker never sees -- the protocol of model-inversion evaluations since Zhang et
al., "The Secret Revealer: Generative Model-Inversion Attacks Against Deep Neural Networks",
CVPR 2020, Sec. 4.1 ("attack accuracy" by an evaluation classifier, and "KNN distance": the
feature-space distance from a reconstruction to the closest private image of its target).
Its architecture is the repo's residual CNN (:mod:`fl_secure.models.cnn`) with a CosFace head
(Wang et al., CVPR 2018); it shares no weights with the attacked model.

Every score is reported beside its chance level: a random guess is top-1 correct with
probability ``1 / num_targets`` and top-5 correct with ``min(5, num_targets) / num_targets``;
top-1 and top-5 also carry a 95% Clopper-Pearson interval, since an audit scores a handful of
targets. KNN distance, SSIM and PSNR have a chance level too: the same measure taken against
the *other* targets' private images. A reconstruction that carries nothing about its target
is as close to the other targets as to its own, so it scores that level in expectation; one
that carries the target's face is closer to its own target than to the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from audits.canary import clopper_pearson_interval
from audits.image_metrics import psnr, ssim, to_unit_range
from fl_secure.models import get_backbone, make_head
from fl_secure.models.heads import ClassHead


@dataclass(frozen=True)
class EvaluatorConfig:
    """How the judge's evaluator is trained (defaults: about a CPU minute on 40x10 images)."""

    backbone: str = "cnn-small"  # key of fl_secure.models.BACKBONES
    embedding_size: int = 128  # feature space of the KNN distance
    epochs: int = 30  # passes over the private images
    batch_size: int = 32
    lr: float = 3e-3  # Adam, cosine-decayed to 0
    weight_decay: float = 5e-4
    flip: bool = True  # random horizontal flips as augmentation
    seed: int = 0  # initialisation and batch order (the evaluator is not a secret)
    # larger images are averaged down to this side first (0: never): cnn-small's features
    # collapse on 150-px LFW chips (nearest-neighbour top-1 of 10 targets 0.14, at 32 px 0.50)
    max_image_size: int = 32

    def __post_init__(self) -> None:
        """Reject values that cannot train."""
        if self.epochs < 1 or self.batch_size < 1 or self.embedding_size < 1:
            raise ValueError("epochs, batch_size and embedding_size must be >= 1")
        if self.max_image_size < 0:
            raise ValueError(f"max_image_size must be >= 0 (0: none), got {self.max_image_size}")
        if not self.lr > 0 or self.weight_decay < 0:
            raise ValueError("lr must be > 0 and weight_decay >= 0")


class Evaluator(nn.Module):
    """Backbone plus CosFace head over the target identities ``0 .. num_classes - 1``."""

    def __init__(self, backbone: nn.Module, head: ClassHead, input_size: int = 0) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.input_size = input_size  # images larger than this are averaged down (0: never)

    def fit(self, images: torch.Tensor) -> torch.Tensor:
        """``images`` averaged down to the evaluator's input size, if they are larger."""
        if not self.input_size or images.shape[-1] <= self.input_size:
            return images
        return F.adaptive_avg_pool2d(images, self.input_size)

    @property
    def num_classes(self) -> int:
        """Number of target identities the evaluator separates."""
        return self.head.num_classes

    @torch.no_grad()
    def features(self, images: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
        """L2-normalised evaluator embeddings ``[N, D]`` of ``[N, 3, H, W]`` images."""
        self.eval()
        parts = [
            self.backbone(self.fit(images[i : i + batch_size]))
            for i in range(0, len(images), batch_size)
        ]
        return F.normalize(torch.cat(parts), dim=1) if parts else images.new_zeros((0, 1))

    @torch.no_grad()
    def scores(self, images: torch.Tensor) -> torch.Tensor:
        """``[N, num_classes]`` cosines to the class embeddings (no margin)."""
        feats = self.features(images)
        return feats @ F.normalize(self.head.weight, dim=1).T


def train_evaluator(
    images: torch.Tensor, labels: torch.Tensor, *, config: EvaluatorConfig | None = None
) -> Evaluator:
    """Train the judge's evaluator on the targets' private images.

    Args:
        images: ``[N, 3, H, W]`` private images of the targets, in ``[-1, 1]``.
        labels: ``[N]`` int64 target index in ``0 .. num_targets - 1``.
        config: training settings.

    Returns:
        The trained evaluator, in eval mode.

    Raises:
        ValueError: on malformed inputs.
    """
    cfg = config or EvaluatorConfig()
    if images.dim() != 4 or labels.shape != images.shape[:1] or labels.dtype != torch.int64:
        raise ValueError("images must be [N, 3, H, W] with int64 labels [N]")
    num_classes = int(labels.max()) + 1
    gen = torch.Generator().manual_seed(cfg.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        side = images.shape[-1]
        size = min(side, cfg.max_image_size) if cfg.max_image_size else side
        backbone = get_backbone(cfg.backbone, embedding_size=cfg.embedding_size, image_size=size)
        head = make_head("cosface", num_classes, cfg.embedding_size)
    model = Evaluator(backbone, head, input_size=size)
    images = model.fit(images)
    params = list(model.parameters())
    optimizer = torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = -(-len(images) // cfg.batch_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, cfg.epochs * steps_per_epoch)
    model.train()
    for _ in range(cfg.epochs):
        order = torch.randperm(len(images), generator=gen)
        for start in range(0, len(images), cfg.batch_size):
            idx = order[start : start + cfg.batch_size]
            x, y = images[idx], labels[idx]
            if cfg.flip:
                flip = torch.rand(len(idx), generator=gen) < 0.5
                x = torch.where(flip[:, None, None, None], x.flip(-1), x)
            loss = F.cross_entropy(model.head(model.backbone(x), y), y)
            optimizer.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)
            optimizer.step()
            schedule.step()
    model.eval()
    return model


@dataclass(frozen=True)
class JudgeResult:
    """Scores of a set of reconstructions, each aimed at one target identity.

    Attributes:
        num_targets: identities the evaluator separates.
        top1: fraction of reconstructions the evaluator assigns to their target.
        top5: fraction with the target among the evaluator's 5 best classes.
        chance_top1: ``1 / num_targets``.
        chance_top5: ``min(5, num_targets) / num_targets``.
        knn_distance: mean Euclidean distance, between L2-normalised evaluator features, to
            the nearest private image of the target (0 = identical features, 2 = opposite).
        ssim: mean SSIM (images in ``[0, 1]``) to that nearest private image.
        psnr: mean PSNR in dB to that nearest private image.
        top1_ci95: 95% Clopper-Pearson interval of ``top1`` over the reconstructions.
        top5_ci95: the same for ``top5``.
        chance_knn_distance: what a reconstruction that carries nothing about its target
            scores: the KNN distance to each *other* target's nearest private image, averaged
            over those targets and the reconstructions.
        chance_ssim: the same for SSIM (to each other target's nearest private image).
        chance_psnr: the same for PSNR (dB).
        predicted: ``[N, min(5, num_targets)]`` the evaluator's best classes per image.
        per_image_knn: ``[N]`` KNN distances.
        per_image_ssim: ``[N]``.
        per_image_psnr: ``[N]``.
        nearest: ``[N]`` index into the private images of each reconstruction's nearest one.
    """

    num_targets: int
    top1: float
    top5: float
    chance_top1: float
    chance_top5: float
    knn_distance: float
    ssim: float
    psnr: float
    top1_ci95: tuple[float, float]
    top5_ci95: tuple[float, float]
    chance_knn_distance: float
    chance_ssim: float
    chance_psnr: float
    predicted: torch.Tensor
    per_image_knn: torch.Tensor
    per_image_ssim: torch.Tensor
    per_image_psnr: torch.Tensor
    nearest: torch.Tensor

    def summary(self) -> dict[str, Any]:
        """The aggregate numbers as a JSON-serialisable dict (chance beside accuracy)."""
        return {
            "num_targets": self.num_targets,
            "num_reconstructions": int(self.predicted.shape[0]),
            "top1": self.top1,
            "top1_ci95": list(self.top1_ci95),
            "chance_top1": self.chance_top1,
            "top5": self.top5,
            "top5_ci95": list(self.top5_ci95),
            "chance_top5": self.chance_top5,
            "knn_distance": self.knn_distance,
            "chance_knn_distance": self.chance_knn_distance,
            "ssim": self.ssim,
            "chance_ssim": self.chance_ssim,
            "psnr_db": self.psnr,
            "chance_psnr_db": self.chance_psnr,
        }


def judge(
    evaluator: Evaluator,
    recon_images: torch.Tensor,
    target_labels: torch.Tensor,
    private_images: torch.Tensor,
    private_labels: torch.Tensor,
) -> JudgeResult:
    """Score reconstructions with the independent evaluator.

    Args:
        evaluator: from :func:`train_evaluator` on the private images.
        recon_images: ``[N, 3, H, W]`` reconstructions in ``[-1, 1]``.
        target_labels: ``[N]`` int64 target each reconstruction aims at (evaluator index).
        private_images: ``[M, 3, H, W]`` the targets' private images in ``[-1, 1]``.
        private_labels: ``[M]`` int64 target index of each private image.

    Returns:
        The scores; distances, SSIM and PSNR against the private image of the target that is
        nearest in evaluator feature space, and their chance levels against the nearest
        private image of every other target.

    Raises:
        ValueError: on mismatched shapes, a target with no private image, or fewer than two
            targets among the private images (no other target to set a chance level by).
    """
    if recon_images.dim() != 4 or target_labels.shape != recon_images.shape[:1]:
        raise ValueError("recon_images must be [N, 3, H, W] with target_labels [N]")
    if private_labels.shape != private_images.shape[:1]:
        raise ValueError("private_labels must be [M] matching private_images")
    if len(recon_images) == 0:
        raise ValueError("no reconstructions to judge")
    missing = set(target_labels.tolist()) - set(private_labels.tolist())
    if missing:
        raise ValueError(f"targets {sorted(missing)} have no private image to compare with")
    num_targets = evaluator.num_classes
    k = min(5, num_targets)
    predicted = evaluator.scores(recon_images).topk(k, dim=1).indices
    hits = predicted == target_labels.unsqueeze(1)
    recon_feats = evaluator.features(recon_images)
    private_feats = evaluator.features(private_images)
    dist = torch.cdist(recon_feats.double(), private_feats.double())
    # per_target[i, c]: distance from reconstruction i to target c's nearest private image
    classes = torch.unique(private_labels)
    if len(classes) < 2:
        raise ValueError("the private images cover one target: no chance level to compare with")
    per_target, near = _nearest_per_target(dist, private_labels, classes)
    own = classes.unsqueeze(0) == target_labels.unsqueeze(1)  # [N, C], one True per row
    knn, nearest = per_target[own], near[own]
    recon01 = to_unit_range(recon_images)
    nearest01 = to_unit_range(private_images[nearest])
    s, p = ssim(recon01, nearest01), psnr(recon01, nearest01)
    # chance: the same measures against every other target's nearest private image
    rows, cols = (~own).nonzero(as_tuple=True)
    other = to_unit_range(private_images[near[rows, cols]])
    chance_s, chance_p = ssim(recon01[rows], other), psnr(recon01[rows], other)
    n = int(hits.shape[0])
    top1_hits, top5_hits = int(hits[:, 0].sum()), int(hits.any(dim=1).sum())
    return JudgeResult(
        num_targets=num_targets,
        top1=top1_hits / n,
        top5=top5_hits / n,
        chance_top1=1.0 / num_targets,
        chance_top5=k / num_targets,
        knn_distance=float(knn.mean()),
        ssim=float(s.mean()),
        psnr=float(p.mean()),
        top1_ci95=clopper_pearson_interval(top1_hits, n),
        top5_ci95=clopper_pearson_interval(top5_hits, n),
        chance_knn_distance=float(per_target[~own].mean()),
        chance_ssim=float(chance_s.mean()),
        chance_psnr=float(chance_p.mean()),
        predicted=predicted,
        per_image_knn=knn,
        per_image_ssim=s,
        per_image_psnr=p,
        nearest=nearest,
    )


def _nearest_per_target(
    dist: torch.Tensor, labels: torch.Tensor, classes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, C]`` distance to, and index of, each class's nearest image (``dist`` is ``[N, M]``)."""
    values, indices = [], []
    for c in classes.tolist():
        v, i = dist.masked_fill(labels.unsqueeze(0) != c, float("inf")).min(dim=1)
        values.append(v)
        indices.append(i)
    return torch.stack(values, dim=1), torch.stack(indices, dim=1)
