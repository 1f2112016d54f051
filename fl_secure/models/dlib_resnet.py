"""dlib's face-recognition ResNet (``dlib_face_recognition_resnet_model_v1``) in PyTorch.

The network of dlib's ``examples/dnn_face_recognition_ex.cpp`` (King, "High Quality Face
Recognition with Deep Metric Learning", dlib blog, 2017; 99.38% on LFW): a ResNet (He et al.,
"Deep Residual Learning for Image Recognition", CVPR 2016) of 29 convolutions -- a 7x7/2 stem
and 14 basic blocks of widths 32, 64, 128, 256, 256 -- with its batch norms frozen into
per-channel affine layers, global average pooling and a 128-d linear embedding without bias,
trained with a pairwise metric loss. :meth:`DlibResNet.from_dlib` fills it from dlib's file as
read by :mod:`fl_secure.models.dlib_format`; the embeddings then equal dlib's
``face_recognition_model_v1.compute_face_descriptor`` on the same 150x150 chips.

What dlib computes differently from torchvision's ResNet, and is reproduced here:

* Padding: a convolution or pooling with stride 1 pads ``size // 2``, any other stride pads 0.
  The sides are 150 -> 72 (stem conv) -> 35 (3x3/2 max pool) -> 17 -> 8 -> 4 -> 2.
* A downsampling block's shortcut is a 2x2/2 average pool, not a 1x1 convolution, and
  ``add_prev`` adds tensors of different shapes as if the smaller one were zero-padded at the
  end of each axis (more channels; and at 8 -> 3 vs 4 and 4 -> 1 vs 2, more rows and columns).
* Input: ``(pixel - mean) / 256`` per RGB channel with dlib's means (122.782, 117.001,
  104.298). :meth:`DlibResNet.forward` takes this project's ``[-1, 1]`` images
  (:class:`fl_secure.data.types.FaceDataset`) and maps them to pixels first.

Each affine layer is a depthwise 1x1 convolution (``weight = gamma``, ``bias = beta``): the same
arithmetic, and a module Opacus computes per-sample gradients for.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Final, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fl_secure.errors import CheckpointError, ConfigError
from fl_secure.models.dlib_layers import Affine, Conv, DlibNet, Fc

EMBEDDING_SIZE: Final = 128
IMAGE_SIZE: Final = 150
DLIB_CHANNEL_MEANS: Final = (122.782, 117.001, 104.298)
"""dlib's ``input_rgb_image`` defaults, the means the released model was trained with."""
STAGES: Final = ((32, 3, False), (64, 4, True), (128, 3, True), (256, 3, True), (256, 1, True))
"""(width, blocks, whether the first block downsamples), input to output: dlib's alevel4..0."""
STEM_WIDTH: Final = 32


def zero_padded_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` as dlib's ``add_prev`` computes it for tensors of different shapes.

    The result has the larger size on every axis; an element missing from one operand
    counts as zero (the operands are aligned at index 0 of each axis).
    """
    shape = [max(x, y) for x, y in zip(a.shape, b.shape, strict=True)]
    return _pad_to(a, shape) + _pad_to(b, shape)


def _pad_to(x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``x`` zero-padded at the end of each of its ``[B, C, H, W]`` axes to ``shape``."""
    if list(x.shape) == list(shape):
        return x
    pads: list[int] = []
    for axis in (3, 2, 1):  # F.pad takes the last axis first
        pads += [0, shape[axis] - x.shape[axis]]
    return F.pad(x, pads)


def channel_affine(channels: int) -> nn.Conv2d:
    """An ``affine_`` layer in conv mode, ``gamma[c] * x + beta[c]``, identity at init."""
    affine = nn.Conv2d(channels, channels, 1, groups=channels, bias=True)
    nn.init.ones_(affine.weight)
    if affine.bias is not None:
        nn.init.zeros_(affine.bias)
    return affine


def dlib_conv(in_channels: int, out_channels: int, size: int, stride: int) -> nn.Conv2d:
    """A convolution with dlib's default padding: ``size // 2`` at stride 1, else 0."""
    padding = size // 2 if stride == 1 else 0
    return nn.Conv2d(in_channels, out_channels, size, stride, padding=padding, bias=True)


class DlibStem(nn.Module):
    """``max_pool<3,3,2,2,relu<affine<con<32,7,7,2,2,input>>>>``: 150 -> 72 -> 35."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = dlib_conv(3, STEM_WIDTH, 7, 2)
        self.affine = channel_affine(STEM_WIDTH)
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The stem's output for normalised input."""
        result: torch.Tensor = self.pool(self.act(self.affine(self.conv(x))))
        return result


class DlibResidualBlock(nn.Module):
    """dlib's ``ares`` / ``ares_down``: ``relu(affine(conv(relu(affine(conv(x))))) + s(x))``.

    ``s`` is the identity, or a 2x2/2 average pool when the block downsamples (its first
    convolution then has stride 2 and no padding); the sum zero-pads the smaller operand.
    """

    def __init__(self, in_channels: int, out_channels: int, *, downsample: bool):
        super().__init__()
        self.conv1 = dlib_conv(in_channels, out_channels, 3, 2 if downsample else 1)
        self.affine1 = channel_affine(out_channels)
        self.conv2 = dlib_conv(out_channels, out_channels, 3, 1)
        self.affine2 = channel_affine(out_channels)
        self.act = nn.ReLU()
        self.shortcut: nn.Module = nn.AvgPool2d(2, 2) if downsample else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output, with dlib's zero-padded residual sum."""
        out = self.act(self.affine1(self.conv1(x)))
        out = self.affine2(self.conv2(out))
        result: torch.Tensor = self.act(zero_padded_add(out, self.shortcut(x)))
        return result


class DlibResNet(nn.Module):
    """dlib's face ResNet mapping ``[B, 3, 150, 150]`` images in ``[-1, 1]`` to 128-d.

    Args:
        embedding_size: must be 128, the size of dlib's embedding.
        image_size: must be 150, the side of dlib's ``input_rgb_image_sized<150>``.
        channel_means: RGB means on the 0..255 pixel scale subtracted before dividing by 256.

    Raises:
        ConfigError: if ``embedding_size`` or ``image_size`` is not dlib's.
    """

    channel_means: torch.Tensor

    def __init__(
        self,
        *,
        embedding_size: int = EMBEDDING_SIZE,
        image_size: int = IMAGE_SIZE,
        channel_means: Sequence[float] = DLIB_CHANNEL_MEANS,
    ):
        super().__init__()
        if embedding_size != EMBEDDING_SIZE:
            raise ConfigError(
                f"model.embedding_size must be {EMBEDDING_SIZE} for the dlib-resnet backbone "
                f"(dlib's network outputs {EMBEDDING_SIZE}-d descriptors), got {embedding_size}"
            )
        if image_size != IMAGE_SIZE:
            raise ConfigError(
                f"data.image_size must be {IMAGE_SIZE} for the dlib-resnet backbone (dlib's "
                f"input_rgb_image_sized<{IMAGE_SIZE}> face chips), got {image_size}"
            )
        if len(channel_means) != 3:
            raise ConfigError(f"channel_means must be 3 RGB values, got {tuple(channel_means)}")
        self.embedding_size = embedding_size
        self.image_size = image_size
        means = torch.tensor(channel_means, dtype=torch.float32).view(1, 3, 1, 1)
        self.register_buffer("channel_means", means, persistent=False)
        self.stem = DlibStem()
        blocks: list[DlibResidualBlock] = []
        in_channels = STEM_WIDTH
        for width, count, downsample in STAGES:
            for index in range(count):
                down = downsample and index == 0
                blocks.append(DlibResidualBlock(in_channels, width, downsample=down))
                in_channels = width
        self.blocks = nn.Sequential(*blocks)
        self.embedding = nn.Linear(in_channels, embedding_size, bias=False)
        last = len(blocks) - STAGES[-1][1]
        self.TRAINABLE_ALIASES = {  # train.trainable selectors (fl_secure.models.trainable)
            "embedding": ("embedding.*",),
            "last-stage": (*(f"blocks.{i}.*" for i in range(last, len(blocks))), "embedding.*"),
        }

    def trunk_cut(self) -> int | None:
        """Blocks before the first trainable one (``train.trainable``), if the stem is frozen.

        :meth:`trunk_features` computes the stem and those blocks; :meth:`forward` takes
        their output. ``len(blocks)``: only the embedding layer trains (pooled features).
        """
        if any(p.requires_grad for p in self.stem.parameters()):
            return None
        for index, block in enumerate(self.blocks):
            if any(p.requires_grad for p in block.parameters()):
                return index
        return len(self.blocks)

    def can_cache_trunk(self) -> bool:
        """Whether a frozen stem and first blocks let a site cache their output."""
        cut = self.trunk_cut()
        return cut is not None and cut > 0

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Map ``[B, 3, 150, 150]`` RGB images in ``[-1, 1]`` to ``[B, 128]`` embeddings.

        A pixel ``p`` in 0..255 is ``p / 127.5 - 1`` here; dlib's input layer then computes
        ``(p - mean) / 256``. The embeddings are not normalised (dlib's are not either).
        Any other input is :meth:`trunk_features`' output, computed once by a site that
        caches its frozen trunk (:mod:`fl_secure.models.trainable`): ``[B, 256]`` pooled
        features, or the ``[B, C, h, w]`` output of the frozen blocks.
        """
        if images.dim() == 2:  # pooled features of every block
            return self._tail(images, len(self.blocks))
        if images.shape[1] != 3:  # the output of the frozen blocks before trunk_cut()
            return self._tail(images, self.trunk_cut() or 0)
        return self._tail(self._stem_input(images), -1)

    def _stem_input(self, images: torch.Tensor) -> torch.Tensor:
        pixels = (images + 1.0) * 127.5
        return (pixels - self.channel_means) / 256.0

    def _tail(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Blocks from ``start`` on (-1: the stem first), pooling, the embedding layer."""
        if start < 0:
            x, start = self.stem(x), 0
        if x.dim() == 4:
            for block in self.blocks[start:]:
                x = block(x)
            x = x.mean(dim=(2, 3))  # dlib's avg_pool_everything
        embeddings: torch.Tensor = self.embedding(x)
        return embeddings

    def trunk_features(self, images: torch.Tensor) -> torch.Tensor:
        """What the trainable part takes: the frozen stem and blocks' output (pooled if all).

        ``[B, 256]`` when only the embedding layer trains, else the ``[B, C, h, w]`` output
        of the blocks before :meth:`trunk_cut`.
        """
        cut = self.trunk_cut()
        x: torch.Tensor = self.stem(self._stem_input(images))
        for block in self.blocks[: cut if cut is not None else 0]:
            x = block(x)
        return x.mean(dim=(2, 3)) if cut == len(self.blocks) else x

    def parameter_layers(self) -> Iterator[nn.Conv2d | nn.Linear]:
        """The layers with parameters in dlib's file order (input to output)."""
        yield self.stem.conv
        yield self.stem.affine
        for module in self.blocks:
            block = cast(DlibResidualBlock, module)
            yield from (block.conv1, block.affine1, block.conv2, block.affine2)
        yield self.embedding

    @classmethod
    def from_dlib(cls, net: DlibNet) -> DlibResNet:
        """The network with the weights of a parsed dlib file, in evaluation mode.

        Raises:
            CheckpointError: if the file's input layer or topology is not dlib's face
                ResNet; the message names the first layer that differs.
        """
        check_topology(net)
        model = cls(channel_means=net.input.means)
        source = [layer for layer in net.layers if isinstance(layer, Conv | Affine | Fc)]
        with torch.no_grad():
            for target, layer in zip(model.parameter_layers(), source, strict=True):
                _copy_weights(target, layer)
        return model.eval()


def expected_summaries() -> list[str]:
    """The face ResNet layer by layer, input to output, as ``DlibNet.summaries`` lists it."""
    lines = [
        f"con {STEM_WIDTH}<-3 7x7 stride 2 pad 0",
        f"affine conv {STEM_WIDTH}",
        "relu",
        "max_pool 3x3 stride 2 pad 0",
    ]
    in_channels = STEM_WIDTH
    for width, count, downsample in STAGES:
        for index in range(count):
            down = downsample and index == 0
            stride, pad = (2, 0) if down else (1, 1)
            lines += ["tag/skip", f"con {width}<-{in_channels} 3x3 stride {stride} pad {pad}"]
            lines += [f"affine conv {width}", "relu", f"con {width}<-{width} 3x3 stride 1 pad 1"]
            lines += [f"affine conv {width}"]
            if down:  # tag2, skip1 back to the block's input, then the shortcut's pool
                lines += ["tag/skip", "tag/skip", "avg_pool 2x2 stride 2 pad 0"]
            lines += ["add_prev", "relu"]
            in_channels = width
    return [*lines, "avg_pool everything", f"fc {EMBEDDING_SIZE}<-{in_channels} no-bias"]


def check_topology(net: DlibNet) -> None:
    """Raise CheckpointError unless ``net`` is dlib's face ResNet on 150x150 RGB chips."""
    if net.input.size != (IMAGE_SIZE, IMAGE_SIZE):
        raise CheckpointError(
            f"{net.source}: expected the input layer input_rgb_image_sized<{IMAGE_SIZE}>, found "
            f"an RGB input of size {net.input.size}"
        )
    expected, found = expected_summaries(), net.summaries
    for index, (want, got) in enumerate(zip(expected, found, strict=False)):
        if want != got:
            raise CheckpointError(
                f"{net.source} is not dlib's face ResNet: layer {index} (from the input) is "
                f"{got!r}, dlib_face_recognition_resnet_model_v1 has {want!r} there"
            )
    if len(expected) != len(found):
        raise CheckpointError(
            f"{net.source} is not dlib's face ResNet: it has {len(found)} layers (counting "
            f"tag and skip layers), dlib_face_recognition_resnet_model_v1 has {len(expected)}"
        )


def _copy_weights(target: nn.Conv2d | nn.Linear, layer: Conv | Affine | Fc) -> None:
    """Copy one parsed layer's arrays into ``target`` (shapes checked by the topology)."""
    bias: np.ndarray | None
    if isinstance(layer, Affine):
        weight, bias = layer.gamma.reshape(-1, 1, 1, 1), layer.beta
    else:
        weight, bias = layer.weight, layer.bias
    target.weight.copy_(torch.from_numpy(np.ascontiguousarray(weight)))
    if bias is not None and target.bias is not None:
        target.bias.copy_(torch.from_numpy(np.ascontiguousarray(bias)))
