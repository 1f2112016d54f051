"""insightface arcface_torch's improved ResNets (iresnet18/34/50) with its exact module names.

The backbone of insightface's ``recognition/arcface_torch`` (``backbones/iresnet.py``): the
"IR" ResNet of Deng et al., "ArcFace: Additive Angular Margin Loss for Deep Face Recognition"
(CVPR 2019, Sec. 3.2 "Network Settings": BN-Conv-BN-PReLU-Conv-BN residual units, a 3x3/1
stem and the "E" output block BN-Dropout-FC-BN), after Han et al.'s pre-activation ordering.
A 112 x 112 input is halved by the first unit of each of the four stages (56, 28, 14, 7); the
512 x 7 x 7 map is flattened into a linear layer and a final BatchNorm1d gives the embedding.

Module names and shapes are insightface's, so a ``backbone.pth`` that arcface_torch saved with
``torch.save(backbone.state_dict(), ...)`` loads with ``strict=True``
(:func:`fl_secure.models.factory.load_pretrained` reads it with PyTorch's restricted
``weights_only`` unpickler; :mod:`fl_secure.models.arcface_convert` turns it into safetensors).
Depths: iresnet18 = units ``[2, 2, 2, 2]``, iresnet34 = ``[3, 4, 6, 3]``, iresnet50 =
``[3, 4, 14, 3]``; iresnet50 with a 512-d embedding has 43,590,848 parameters.

Input: ``[B, 3, 112, 112]`` RGB floats in ``[-1, 1]``, this project's convention
(:class:`fl_secure.data.types.FaceDataset`) and arcface_torch's own: its training set decodes
RGB (``mx.image.imdecode``) and applies ``Normalize(mean=0.5, std=0.5)`` after ``ToTensor``,
and its ``inference.py`` converts BGR to RGB and computes ``(x / 255 - 0.5) / 0.5``. No
rescaling is done here.

BatchNorm: every unit has three BatchNorm layers, which is fine for inference, evaluation and
non-private fine-tuning (freezing parts with ``requires_grad=False`` to train fewer weights).
Opacus' DP-SGD refuses BatchNorm, as for the ``resnet18-bn`` backbone: in training mode it
normalises each example with its batch's statistics, so per-example gradients do not exist;
this project's :func:`privacy.dp.dpsgd.validate_model` refuses any BatchNorm, even a frozen
one, so example-level DP-SGD cannot train an iresnet (use a GroupNorm backbone there).
As in the original, ``features.weight`` is built at 1.0 without a gradient; but
:func:`fl_secure.training.build_model` sets ``requires_grad`` of every backbone parameter from
``train.trainable``, so with ``"all"`` it trains too. ``train.trainable = "embedding"`` trains
``fc`` only (``features`` is then frozen and kept in eval mode with the checkpoint's
statistics), ``"last-stage"`` also ``layer4``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Final

import torch
from torch import nn

from fl_secure.errors import ConfigError

IMAGE_SIZE: Final = 112
EMBEDDING_SIZE: Final = 512
"""insightface's ``num_features``; any positive size builds, released checkpoints use 512."""
BN_EPS: Final = 1e-05
STAGE_WIDTHS: Final = (64, 128, 256, 512)
DEPTHS: Final = {
    "iresnet18": (2, 2, 2, 2),
    "iresnet34": (3, 4, 6, 3),
    "iresnet50": (3, 4, 14, 3),
}
"""Residual units per stage, by backbone name."""
FINAL_SIDE: Final = IMAGE_SIZE // 2 ** len(STAGE_WIDTHS)  # 7: the map ``fc`` flattens


def conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    """A 3x3 convolution without bias, padding 1."""
    return nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)


class IBasicBlock(nn.Module):
    """Residual unit ``BN-Conv3x3-BN-PReLU-Conv3x3(stride)-BN`` plus the shortcut.

    The shortcut is the identity, or ``downsample`` (1x1 convolution with the stride, then
    BatchNorm) where the width or the side changes. Nothing follows the addition.
    """

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_channels, eps=BN_EPS)
        self.conv1 = conv3x3(in_channels, channels)
        self.bn2 = nn.BatchNorm2d(channels, eps=BN_EPS)
        self.prelu = nn.PReLU(channels)
        self.conv2 = conv3x3(channels, channels, stride)
        self.bn3 = nn.BatchNorm2d(channels, eps=BN_EPS)
        self.downsample: nn.Sequential | None = None
        if stride != 1 or in_channels != channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(channels, eps=BN_EPS),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``bn3(conv2(prelu(bn2(conv1(bn1(x)))))) + shortcut(x)`` (out of place)."""
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        shortcut = x if self.downsample is None else self.downsample(x)
        result: torch.Tensor = out + shortcut
        return result


class IResNet(nn.Module):
    """arcface_torch's ``IResNet`` with ``IBasicBlock`` units, mapping 112x112 faces to embeddings.

    Args:
        depths: residual units in each of the four stages (see :data:`DEPTHS`).
        embedding_size: output length (insightface's ``num_features``).
        image_size: must be 112: ``fc`` flattens a 7 x 7 map.
        dropout: probability of the dropout before ``fc`` (insightface's default 0).

    Raises:
        ConfigError: if an argument is out of range.
    """

    TRAINABLE_ALIASES: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "embedding": ("fc.*",),  # train.trainable selectors (fl_secure.models.trainable)
        "last-stage": ("layer4.*", "fc.*"),
    }

    def __init__(
        self,
        depths: Sequence[int],
        *,
        embedding_size: int = EMBEDDING_SIZE,
        image_size: int = IMAGE_SIZE,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        _check_arguments(depths, embedding_size, image_size, dropout)
        self.conv1 = conv3x3(3, STAGE_WIDTHS[0])
        self.bn1 = nn.BatchNorm2d(STAGE_WIDTHS[0], eps=BN_EPS)
        self.prelu = nn.PReLU(STAGE_WIDTHS[0])
        stages = []
        in_channels = STAGE_WIDTHS[0]
        for width, units in zip(STAGE_WIDTHS, depths, strict=True):
            blocks = [IBasicBlock(in_channels, width, stride=2)]
            blocks += [IBasicBlock(width, width) for _ in range(units - 1)]
            stages.append(nn.Sequential(*blocks))
            in_channels = width
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.bn2 = nn.BatchNorm2d(in_channels, eps=BN_EPS)
        self.dropout = nn.Dropout(p=dropout)  # out of place (insightface: inplace=True)
        self.fc = nn.Linear(in_channels * FINAL_SIDE * FINAL_SIDE, embedding_size)
        self.features = nn.BatchNorm1d(embedding_size, eps=BN_EPS)
        self._init_weights()

    def _init_weights(self) -> None:
        """Initialise as insightface: conv ~ N(0, 0.1), BN affine 1/0, ``features`` fixed."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.normal_(module.weight, 0.0, 0.1)
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.ones_(self.features.weight)
        self.features.weight.requires_grad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, 3, 112, 112]`` images in ``[-1, 1]`` to ``[B, embedding_size]``."""
        x = self.prelu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = self.dropout(torch.flatten(self.bn2(x), 1))
        result: torch.Tensor = self.features(self.fc(x))
        return result


def _check_arguments(
    depths: Sequence[int], embedding_size: int, image_size: int, dropout: float
) -> None:
    """Raise :class:`ConfigError` naming the first argument out of range."""
    if len(depths) != len(STAGE_WIDTHS) or any(units < 1 for units in depths):
        raise ConfigError(f"depths must be 4 positive unit counts, got {tuple(depths)}")
    if embedding_size < 1:
        raise ConfigError(f"embedding_size must be a positive integer, got {embedding_size}")
    if image_size != IMAGE_SIZE:
        raise ConfigError(
            f"data.image_size must be {IMAGE_SIZE} for the iresnet backbones (insightface's "
            f"112 x 112 aligned faces; fc flattens a {FINAL_SIDE} x {FINAL_SIDE} map), "
            f"got {image_size}"
        )
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"dropout must be in [0, 1), got {dropout}")


def iresnet(
    name: str,
    *,
    embedding_size: int = EMBEDDING_SIZE,
    image_size: int = IMAGE_SIZE,
    dropout: float = 0.0,
) -> IResNet:
    """Build the randomly initialised iresnet of :data:`DEPTHS` called ``name``.

    Raises:
        ConfigError: if ``name`` is not in :data:`DEPTHS` or an argument is out of range.
    """
    if name not in DEPTHS:
        raise ConfigError(f"unknown iresnet {name!r}; allowed: {', '.join(DEPTHS)}")
    return IResNet(
        DEPTHS[name], embedding_size=embedding_size, image_size=image_size, dropout=dropout
    )
