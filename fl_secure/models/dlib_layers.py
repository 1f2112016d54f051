"""The layers of a dlib DNN as :mod:`fl_secure.models.dlib_format` reads them from a file.

One frozen dataclass per layer type of dlib's face-recognition network, with the
hyper-parameters dlib stores and the parameters as float32 numpy arrays in PyTorch's layouts.
Each has a one-line ``summary`` of its hyper-parameters, which is what a topology check
compares (arrays are left out of equality).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np


@dataclass(frozen=True)
class Conv:
    """``con_``: a 2-D convolution (cross-correlation) with its bias."""

    kernel: tuple[int, int]  # (nr, nc)
    stride: tuple[int, int]  # (y, x)
    padding: tuple[int, int]  # (y, x), zeros
    weight: np.ndarray = field(compare=False, repr=False)  # [out, in, nr, nc]
    bias: np.ndarray | None = field(compare=False, repr=False)  # [out], None: no bias

    @property
    def summary(self) -> str:
        """Hyper-parameters as one line, e.g. ``con 64<-32 3x3 stride 2 pad 0``."""
        out_ch, in_ch = self.weight.shape[:2]
        bias = "" if self.bias is not None else " no-bias"
        return (
            f"con {out_ch}<-{in_ch} {self.kernel[0]}x{self.kernel[1]} stride "
            f"{_pair(self.stride)} pad {_pair(self.padding)}{bias}"
        )


@dataclass(frozen=True)
class Affine:
    """``affine_``: ``gamma * x + beta``, per channel in conv mode (batch norm, frozen)."""

    mode: Literal["conv", "fc"]
    disabled: bool
    gamma: np.ndarray = field(compare=False, repr=False)  # conv: [k]; fc: [k, nr, nc]
    beta: np.ndarray = field(compare=False, repr=False)

    @property
    def summary(self) -> str:
        """E.g. ``affine conv 64``."""
        state = " disabled" if self.disabled else ""
        return f"affine {self.mode} {self.gamma.shape[0] if self.gamma.size else 0}{state}"


@dataclass(frozen=True)
class Relu:
    """``relu_``."""

    disabled: bool = False

    @property
    def summary(self) -> str:
        """``relu``."""
        return "relu disabled" if self.disabled else "relu"


@dataclass(frozen=True)
class Pool:
    """``max_pool_`` or ``avg_pool_``; a kernel of ``(0, 0)`` pools the whole feature map."""

    kind: Literal["max", "avg"]
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]

    @property
    def summary(self) -> str:
        """E.g. ``max_pool 3x3 stride 2 pad 0`` or ``avg_pool everything``."""
        if self.kernel == (0, 0):
            return f"{self.kind}_pool everything"
        return (
            f"{self.kind}_pool {self.kernel[0]}x{self.kernel[1]} stride {_pair(self.stride)} "
            f"pad {_pair(self.padding)}"
        )


@dataclass(frozen=True)
class AddPrev:
    """``add_prev_``: adds a tagged earlier output (which tag is not stored in the file)."""

    @property
    def summary(self) -> str:
        """``add_prev``."""
        return "add_prev"


@dataclass(frozen=True)
class Fc:
    """``fc_``: a fully connected layer."""

    weight: np.ndarray = field(compare=False, repr=False)  # [out, in] as torch.nn.Linear
    bias: np.ndarray | None = field(compare=False, repr=False)

    @property
    def summary(self) -> str:
        """E.g. ``fc 128<-256 no-bias``."""
        bias = "" if self.bias is not None else " no-bias"
        return f"fc {self.weight.shape[0]}<-{self.weight.shape[1]}{bias}"


@dataclass(frozen=True)
class TagOrSkip:
    """A tag or a skip layer: the file stores neither which of the two nor its ID."""

    @property
    def summary(self) -> str:
        """``tag/skip``."""
        return "tag/skip"


DlibLayer = Conv | Affine | Relu | Pool | AddPrev | Fc | TagOrSkip


@dataclass(frozen=True)
class InputRGB:
    """``input_rgb_image[_sized]``: ``(pixel - mean) / 256`` per channel, RGB order."""

    means: tuple[float, float, float]
    size: tuple[int, int] | None  # (nr, nc) of the sized input, None for input_rgb_image


@dataclass(frozen=True)
class LossMetric:
    """``loss_metric_``: the metric-learning loss; its output is the embedding as it is."""

    margin: float
    distance_threshold: float


@dataclass(frozen=True)
class DlibNet:
    """A parsed network: input layer, computational layers from input to output, loss."""

    source: Path
    input: InputRGB
    layers: tuple[DlibLayer, ...]
    loss: LossMetric

    @property
    def summaries(self) -> list[str]:
        """One line per layer, input to output."""
        return [layer.summary for layer in self.layers]


def _pair(values: tuple[int, int]) -> str:
    """``2`` for ``(2, 2)``, ``1x2`` otherwise."""
    return str(values[0]) if values[0] == values[1] else f"{values[0]}x{values[1]}"
