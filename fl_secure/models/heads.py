"""Classification heads for face-recognition training: softmax and combined angular margins.

The margin function is insightface arcface_torch's ``CombinedMarginLoss(s, m1, m2, m3)``:
with ``theta`` the angle between an embedding and its class embedding, the target logit is
``s * (cos(m1 * theta + m2) - m3)`` and every other logit is ``s * cos(theta_j)``. It covers
SphereFace (``m1``; Liu et al., CVPR 2017), ArcFace (``m2``; Deng et al., CVPR 2019, Eq. 3)
and CosFace (``m3``; Wang et al., CVPR 2018, Eq. 4). The heads take the margin as an
injected callable, as arcface_torch's classifiers do.

``class_mask`` implements Gansekoele et al., "Meta-Learning for Federated Face Recognition in
Imbalanced Data Regimes" (HF-MAML), section III-A: a client sets the logits of the classes it
holds no data for to -inf, so its softmax covers only its own classes and the absent class
embeddings receive exactly zero gradient.

Each head keeps its weight in a leaf module whose forward takes only the embeddings, so that
Opacus computes correct per-example gradients: it replays a hooked module's forward on the
captured input alone, and the margin and the mask act downstream of that leaf.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from fl_secure.errors import ConfigError

HeadKind = Literal["softmax", "cosface", "arcface"]
HEAD_KINDS: tuple[HeadKind, ...] = ("softmax", "cosface", "arcface")
DEFAULT_SCALE_MARGIN: dict[HeadKind, tuple[float, float]] = {
    "cosface": (30.0, 0.4),  # AdaFedFR, Implementation Details
    "arcface": (8.0, 0.5),  # HF-MAML Table III (arcface_torch uses s=64 for large class sets)
}
ACOS_EPS = 1e-7
"""Cosines are clamped to ``[-1 + eps, 1 - eps]`` before ``acos`` (its slope is infinite at 1)."""

MarginFn = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
"""``(cosine [B, C], labels [B] or None) -> logits [B, C]``."""


def margin_logits(
    cosine: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    s: float,
    m1: float = 1.0,
    m2: float = 0.0,
    m3: float = 0.0,
    easy_margin: bool = False,
) -> torch.Tensor:
    """Scaled logits with the combined margin ``cos(m1*theta + m2) - m3`` on each target class.

    When ``m1 * theta + m2`` would pass pi the margin would stop being a penalty, so the
    target logit is replaced as in arcface_torch: for ``m1 == 1`` by its linear surrogate
    ``cos(theta) - m2 * sin(m2)`` (ArcFace's threshold trick), for ``m1 != 1`` by SphereFace's
    monotone extension ``(-1)**k * cos(phi) - 2k`` with ``k = floor(phi / pi)``. With
    ``easy_margin`` the margin is applied only where ``cos(theta) > 0``.

    Args:
        cosine: ``[B, C]`` cosines between embeddings and class embeddings.
        labels: ``[B]`` target classes, or ``None`` for plain ``s * cosine`` (evaluation).
        s: scale of all logits.
        m1: multiplicative angular margin (SphereFace); 1 disables it.
        m2: additive angular margin (ArcFace); 0 disables it.
        m3: additive cosine margin (CosFace); 0 disables it.
        easy_margin: apply the angular margin only where ``cos(theta) > 0``.

    Returns:
        ``[B, C]`` logits; non-target entries are exactly ``s * cosine``.
    """
    if labels is None:
        return s * cosine
    target = cosine.gather(1, labels.unsqueeze(1)).squeeze(1)
    if m1 != 1.0 or m2 != 0.0:
        theta = torch.acos(target.clamp(-1.0 + ACOS_EPS, 1.0 - ACOS_EPS))
        phi = m1 * theta + m2
        if easy_margin:
            fallback = target
            keep = target > 0
        elif m1 == 1.0:
            fallback = target - m2 * math.sin(m2)
            keep = phi <= math.pi
        else:
            k = torch.floor(phi / math.pi)
            fallback = (1.0 - 2.0 * torch.remainder(k, 2.0)) * torch.cos(phi) - 2.0 * k
            keep = phi <= math.pi
        target = torch.where(keep, torch.cos(phi), fallback)
    target = target - m3
    # a scatter, not F.one_hot: the same mask, and it runs under torch.func.vmap
    is_target = torch.zeros_like(cosine, dtype=torch.bool).scatter(1, labels.unsqueeze(1), True)
    return s * torch.where(is_target, target.unsqueeze(1), cosine)


@dataclass(frozen=True)
class CombinedMargin:
    """The margin function with fixed parameters: a :data:`MarginFn`."""

    s: float  # logit scale
    m1: float = 1.0  # SphereFace multiplicative angular margin (1 = off)
    m2: float = 0.0  # ArcFace additive angular margin (0 = off)
    m3: float = 0.0  # CosFace additive cosine margin (0 = off)
    easy_margin: bool = False  # arcface_torch's easy margin

    def __post_init__(self) -> None:
        """Reject parameters outside the ranges the margins are defined for."""
        if not self.s > 0:
            raise ConfigError(f"margin scale s must be > 0, got {self.s}")
        if not self.m1 >= 1.0:
            raise ConfigError(f"SphereFace margin m1 must be >= 1, got {self.m1}")
        if not 0.0 <= self.m2 < math.pi / 2:
            raise ConfigError(f"ArcFace margin m2 must be in [0, pi/2), got {self.m2}")
        if not 0.0 <= self.m3 < 1.0:
            raise ConfigError(f"CosFace margin m3 must be in [0, 1), got {self.m3}")

    def __call__(self, cosine: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """Apply :func:`margin_logits` with this margin's parameters."""
        return margin_logits(
            cosine,
            labels,
            s=self.s,
            m1=self.m1,
            m2=self.m2,
            m3=self.m3,
            easy_margin=self.easy_margin,
        )


class CosineClassifier(nn.Module):
    """Cosines between L2-normalised embeddings and L2-normalised class embeddings ``W``."""

    def __init__(self, num_classes: int, embedding_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_classes, embedding_size))
        nn.init.normal_(self.weight, std=0.01)  # arcface_torch's initialisation

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Return ``[B, num_classes]`` cosines."""
        return F.linear(F.normalize(embeddings, dim=1), F.normalize(self.weight, dim=1))


class ClassHead(nn.Module, ABC):
    """Head mapping embeddings to class logits; absent classes can be masked to -inf."""

    def __init__(self, num_classes: int, embedding_size: int):
        super().__init__()
        if num_classes < 1 or embedding_size < 1:
            raise ConfigError(
                f"num_classes and embedding_size must be positive, got {num_classes} "
                f"and {embedding_size}"
            )
        self.num_classes = num_classes

    @property
    @abstractmethod
    def weight(self) -> torch.Tensor:
        """The class embeddings ``W``, ``[num_classes, embedding_size]``."""

    @abstractmethod
    def logits(self, embeddings: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """Unmasked ``[B, num_classes]`` logits."""

    def forward(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor | None = None,
        class_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return ``[B, num_classes]`` logits.

        Args:
            embeddings: ``[B, embedding_size]`` backbone outputs (need not be normalised).
            labels: ``[B]`` int64 target classes; margin heads apply their margin to these.
            class_mask: ``[num_classes]`` bool, False for classes whose logits become -inf.

        Raises:
            ValueError: if a label is out of range or names a masked class, or the mask has
                the wrong shape or dtype.
        """
        if labels is not None and labels.numel() > 0:
            if labels.dtype != torch.int64 or labels.shape != embeddings.shape[:1]:
                raise ValueError(f"labels must be int64 [B]; got {labels.dtype} {labels.shape}")
            if int(labels.min()) < 0 or int(labels.max()) >= self.num_classes:
                raise ValueError(f"labels must be in [0, {self.num_classes})")
        if class_mask is not None:
            if class_mask.dtype != torch.bool or class_mask.shape != (self.num_classes,):
                raise ValueError(
                    f"class_mask must be bool [{self.num_classes}]; got "
                    f"{class_mask.dtype} {tuple(class_mask.shape)}"
                )
            if labels is not None and not bool(class_mask[labels].all()):
                absent = sorted({int(c) for c in labels[~class_mask[labels]]})
                raise ValueError(f"labels {absent} name classes that class_mask excludes")
        logits = self.logits(embeddings, labels)
        if class_mask is None:
            return logits
        return logits.masked_fill(~class_mask, float("-inf"))


class MarginHead(ClassHead):
    """Cosine classifier with an injected margin (CosFace, ArcFace, SphereFace, combined)."""

    def __init__(self, num_classes: int, embedding_size: int, margin: MarginFn):
        super().__init__(num_classes, embedding_size)
        self.classifier = CosineClassifier(num_classes, embedding_size)
        self.margin = margin

    @property
    def weight(self) -> torch.Tensor:
        """The class embeddings ``W`` (normalised only inside the forward)."""
        return self.classifier.weight

    def logits(self, embeddings: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """Margin-adjusted, scaled cosine logits."""
        return self.margin(self.classifier(embeddings), labels)


class SoftmaxHead(ClassHead):
    """Plain linear classifier (with bias): no normalisation, no margin."""

    def __init__(self, num_classes: int, embedding_size: int):
        super().__init__(num_classes, embedding_size)
        self.classifier = nn.Linear(embedding_size, num_classes)

    @property
    def weight(self) -> torch.Tensor:
        """The linear layer's weight, ``[num_classes, embedding_size]``."""
        return self.classifier.weight

    def logits(self, embeddings: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """Linear logits (``labels`` are not used)."""
        logits: torch.Tensor = self.classifier(embeddings)
        return logits


def make_head(
    kind: HeadKind,
    num_classes: int,
    embedding_size: int,
    *,
    s: float | None = None,
    m: float | None = None,
) -> ClassHead:
    """Build a classification head by kind.

    Args:
        kind: ``"softmax"``, ``"cosface"`` (``m`` is the cosine margin m3) or ``"arcface"``
            (``m`` is the angular margin m2).
        num_classes: number of classes (identities).
        embedding_size: length of the embeddings fed to the head.
        s: logit scale; default 30 for CosFace, 8 for ArcFace.
        m: margin; default 0.4 for CosFace, 0.5 for ArcFace.

    Returns:
        The head.

    Raises:
        ConfigError: if ``kind`` is unknown, a parameter is out of range, or ``s``/``m`` is
            given for the softmax head.
    """
    if kind == "softmax":
        if s is not None or m is not None:
            raise ConfigError("the softmax head takes no scale s or margin m")
        return SoftmaxHead(num_classes, embedding_size)
    if kind not in DEFAULT_SCALE_MARGIN:
        raise ConfigError(f"unknown head kind {kind!r}; allowed kinds: {', '.join(HEAD_KINDS)}")
    default_s, default_m = DEFAULT_SCALE_MARGIN[kind]
    scale = default_s if s is None else s
    margin = default_m if m is None else m
    if kind == "cosface":
        return MarginHead(num_classes, embedding_size, CombinedMargin(s=scale, m3=margin))
    return MarginHead(num_classes, embedding_size, CombinedMargin(s=scale, m2=margin))
