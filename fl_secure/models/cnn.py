"""A small residual CNN face-embedding backbone that Opacus can train with DP-SGD.

The block is the basic residual block of He et al., "Deep Residual Learning for Image
Recognition" (CVPR 2016), with every BatchNorm replaced by GroupNorm (Wu & He, "Group
Normalization", ECCV 2018): BatchNorm mixes examples of a batch, which makes per-example
gradients -- and hence DP-SGD (Abadi et al., CCS 2016) -- ill-defined, so
``opacus.validators.ModuleValidator.validate(model, strict=True)`` rejects it, while GroupNorm
normalises each example on its own. The embedding head follows the face-recognition recipe
of insightface's arcface_torch: global pooling, optional dropout, one linear layer to the
embedding, no normalisation (the margin heads in :mod:`fl_secure.models.heads` L2-normalise).

Every stage halves the resolution and the pooling is adaptive, so the same network runs on
64x64 (default) and 112x112 crops. No operation is in-place: Opacus' hooks capture module
inputs and outputs, which an in-place activation would overwrite.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from fl_secure.errors import ConfigError

MIN_IMAGE_SIZE = 32
"""Smallest input side: the stem and the four stages divide the side by 2**5."""


def group_norm(channels: int, max_groups: int) -> nn.GroupNorm:
    """GroupNorm with the largest group count dividing ``channels`` and at most ``max_groups``."""
    return nn.GroupNorm(math.gcd(channels, max_groups), channels)


class ResidualBlock(nn.Module):
    """Basic residual block: two 3x3 convolutions with GroupNorm and a projection shortcut."""

    def __init__(self, in_channels: int, out_channels: int, *, stride: int, gn_groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.norm1 = group_norm(out_channels, gn_groups)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False)
        self.norm2 = group_norm(out_channels, gn_groups)
        self.act = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                group_norm(out_channels, gn_groups),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``relu(F(x) + shortcut(x))``."""
        out = self.act(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        result: torch.Tensor = self.act(out + self.shortcut(x))
        return result


class FaceCNN(nn.Module):
    """Stem, four residual stages, global average pooling, dropout, linear embedding.

    Args:
        embedding_size: length of the output embedding.
        image_size: side of the square input; only checked (pooling is adaptive).
        widths: channels of the four stages (the stem has ``widths[0]``).
        blocks: residual blocks per stage; the first block of each stage has stride 2.
        gn_groups: at most this many GroupNorm groups per layer.
        dropout: dropout probability before the embedding layer (0 disables it).
    """

    def __init__(
        self,
        *,
        embedding_size: int = 512,
        image_size: int = 64,
        widths: Sequence[int] = (32, 64, 128, 256),  # channels per stage
        blocks: Sequence[int] = (1, 1, 1, 1),  # residual blocks per stage
        gn_groups: int = 8,  # GroupNorm groups (fewer if a width is not divisible)
        dropout: float = 0.0,  # before the embedding layer, as in arcface_torch
    ):
        super().__init__()
        _check_config(embedding_size, image_size, widths, blocks, gn_groups, dropout)
        self.embedding_size = embedding_size
        self.image_size = image_size
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, 2, padding=1, bias=False),
            group_norm(widths[0], gn_groups),
            nn.ReLU(),
        )
        layers: list[nn.Module] = []
        in_channels = widths[0]
        for width, count in zip(widths, blocks, strict=True):
            for index in range(count):
                stride = 2 if index == 0 else 1
                layers.append(ResidualBlock(in_channels, width, stride=stride, gn_groups=gn_groups))
                in_channels = width
        self.stages = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.embedding = nn.Linear(in_channels, embedding_size)
        last = len(layers) - blocks[-1]
        self.TRAINABLE_ALIASES = {  # train.trainable selectors (fl_secure.models.trainable)
            "embedding": ("embedding.*",),
            "last-stage": (*(f"stages.{i}.*" for i in range(last, len(layers))), "embedding.*"),
        }

    def can_cache_trunk(self) -> bool:
        """Whether only the embedding layer trains, so :meth:`trunk_features` can be cached."""
        trains = [n for n, p in self.named_parameters() if p.requires_grad]
        return all(n.startswith("embedding.") for n in trains)

    def trunk_features(self, images: torch.Tensor) -> torch.Tensor:
        """Pooled features ``[B, C]`` of the last stage: what the embedding layer takes."""
        features: torch.Tensor = self.pool(self.stages(self.stem(images))).flatten(1)
        return features

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Map ``[B, 3, H, W]`` images to ``[B, embedding_size]`` unnormalised embeddings.

        A 2-D ``[B, C]`` input is taken as :meth:`trunk_features` already computed (a site
        that caches its frozen trunk's features, :mod:`fl_secure.models.trainable`).
        """
        features = images if images.dim() == 2 else self.trunk_features(images)
        embeddings: torch.Tensor = self.embedding(self.dropout(features))
        return embeddings


def _check_config(
    embedding_size: int,
    image_size: int,
    widths: Sequence[int],
    blocks: Sequence[int],
    gn_groups: int,
    dropout: float,
) -> None:
    """Raise ConfigError naming the first invalid FaceCNN argument."""
    if embedding_size < 1:
        raise ConfigError(f"embedding_size must be a positive integer, got {embedding_size}")
    if image_size < MIN_IMAGE_SIZE:
        raise ConfigError(f"image_size must be at least {MIN_IMAGE_SIZE}, got {image_size}")
    if len(widths) != 4 or any(w < 1 for w in widths):
        raise ConfigError(f"widths must be 4 positive channel counts, got {tuple(widths)}")
    if len(blocks) != 4 or any(b < 1 for b in blocks):
        raise ConfigError(f"blocks must be 4 positive block counts, got {tuple(blocks)}")
    if gn_groups < 1:
        raise ConfigError(f"gn_groups must be a positive integer, got {gn_groups}")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"dropout must be in [0, 1), got {dropout}")
