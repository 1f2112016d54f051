"""ResNet-18 face-embedding backbone, as used by HF-MAML.

Gansekoele et al., "Meta-Learning for Federated Face Recognition in Imbalanced Data Regimes"
(HF-MAML), Table III: a ResNet-18 (He et al., CVPR 2016) followed by a linear layer to a
512-d embedding and an ArcFace head. Here the ImageNet classifier is dropped and the 512-d
pooled features map straight to the embedding (``fc = Linear(512, embedding_size)``). The
network is built without weights (as ``resnet18(weights=None)``: nothing is ever downloaded;
use :func:`fl_secure.models.factory.load_pretrained` with a local safetensors file instead).

``norm="group"`` (default) replaces every BatchNorm by GroupNorm with 32 groups (Wu & He,
ECCV 2018), which Opacus accepts for DP-SGD; ``norm="batch"`` keeps torchvision's BatchNorm
for non-private training. Pooling is adaptive, so any input side >= 32 works. Torchvision's
in-place ReLUs and residual additions are made out-of-place: Opacus' backward hooks forbid
modifying a hooked module's output in place ("Output 0 of BackwardHookFunction is a view and
is being modified inplace").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet

from fl_secure.errors import ConfigError
from fl_secure.models.cnn import MIN_IMAGE_SIZE, group_norm

Norm = Literal["group", "batch"]
NORMS: tuple[Norm, ...] = ("group", "batch")
GN_GROUPS = 32


class OutOfPlaceBasicBlock(BasicBlock):  # type: ignore[misc]  # torchvision is untyped
    """Torchvision's ResNet basic block without its in-place residual addition."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``relu(bn2(conv2(relu(bn1(conv1(x))))) + downsample(x))``."""
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        result: torch.Tensor = self.relu(out + identity)
        return result


def resnet18_face(
    *,
    embedding_size: int = 512,
    image_size: int = 64,
    norm: Norm = "group",
) -> nn.Module:
    """Build a randomly initialised ResNet-18 whose ``fc`` outputs the face embedding.

    The module names and shapes are torchvision's (``conv1``, ``layer1.0.bn1``, ..., ``fc``),
    so a local copy of torchvision weights converted to safetensors loads into the
    ``norm="batch"`` variant (all but ``fc``).

    Args:
        embedding_size: length of the output embedding.
        image_size: side of the square input; only checked (pooling is adaptive).
        norm: ``"group"`` for GroupNorm (Opacus-compatible) or ``"batch"`` for BatchNorm.

    Returns:
        A torchvision ``ResNet`` mapping ``[B, 3, H, W]`` to ``[B, embedding_size]``.

    Raises:
        ConfigError: if an argument is out of range or ``norm`` is unknown.
    """
    if embedding_size < 1:
        raise ConfigError(f"embedding_size must be a positive integer, got {embedding_size}")
    if image_size < MIN_IMAGE_SIZE:
        raise ConfigError(f"image_size must be at least {MIN_IMAGE_SIZE}, got {image_size}")
    norm_layer: Callable[[int], nn.Module]
    if norm == "group":
        norm_layer = _group_norm
    elif norm == "batch":
        norm_layer = nn.BatchNorm2d
    else:
        raise ConfigError(f"norm must be one of {', '.join(NORMS)}; got {norm!r}")
    model: nn.Module = ResNet(
        OutOfPlaceBasicBlock, [2, 2, 2, 2], num_classes=embedding_size, norm_layer=norm_layer
    )
    for module in model.modules():
        if isinstance(module, nn.ReLU):
            module.inplace = False
    return model


def _group_norm(channels: int) -> nn.Module:
    """Torchvision ``norm_layer`` callable: GroupNorm with 32 groups."""
    return group_norm(channels, GN_GROUPS)
