"""Target-domain degradations of aligned face chips: low resolution, grey and blur, occlusion.

The same degradation is applied at every site and at evaluation, so it is a pure function of
the image (and, for occlusion, of a per-image key and a seed): no global random state. A
configuration names it by a spec (``data.degrade = "lowres:24"``), parsed by
:func:`parse_degradation`; steps can be chained with ``+`` (``"lowres:32+greyblur:1"``).

- ``lowres:<side>``: area downsampling so that the shorter side is ``side`` pixels (each
  low-resolution pixel is the mean of the area it covers, pixels cut by its border weighed by
  their overlap, as OpenCV's ``INTER_AREA``; PIL's ``BOX`` agrees where ``side`` divides the
  size), then bilinear upsampling back (half-pixel centres, edges clamped: PIL's, OpenCV's and
  torch's ``align_corners=False`` convention);
- ``greyblur:<sigma>``: grey by ITU-R BT.601 luma (``0.299 R + 0.587 G + 0.114 B``, what PIL's
  ``convert("L")`` uses) on all three channels, then a Gaussian blur of ``sigma`` pixels
  (kernel radius ``int(4 sigma + 0.5)``, mirrored edges: ``scipy.ndimage.gaussian_filter``'s
  defaults);
- ``occlusion:<fraction>[:<seed>]``: a black rectangle covering ``fraction`` of the image
  area, of the image's aspect ratio, at a position drawn from SHA-256 of the seed and the
  image's key (a deterministic cousin of random erasing: Zhong et al., "Random Erasing Data
  Augmentation", AAAI 2020).

Every step is linear in the pixels, so each is a pair of matrices applied to the rows and the
columns, computed in float64.

Conventions: images are numpy arrays ``HxWxC`` either ``uint8`` (the chips as read; the
result is rounded to ``uint8`` once, after the last step) or floating point in pixel units
``[0, 255]`` (the result is float64, not rounded). :func:`degrade_tensor` and
:func:`degrade_dataset` take the loaders' float tensors in ``[-1, 1]``, ``[N, 3, H, W]``.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import torch

from fl_secure.data.types import FaceDataset
from fl_secure.errors import ConfigError, DataError

LUMA_BT601: Final = np.array([0.299, 0.587, 0.114])
#: the conversion of float64 pixels back to the convention of the input image
_Back = Callable[[np.ndarray], np.ndarray]
SPEC_HELP: Final = (
    "expected 'none' or steps joined by '+': lowres:<side px>, greyblur:<sigma px>, "
    "occlusion:<area fraction in (0, 1)>[:<seed>]"
)
#: images :func:`degrade_dataset` degrades at once
CHUNK: Final = 64


def low_resolution(image: np.ndarray, side: int) -> np.ndarray:
    """Area-downsample ``image`` so that its shorter side is ``side``, then bilinear back up.

    Raises:
        DataError: ``side`` below 1 or above the image's shorter side.
    """
    return Degradation((LowResolution(side),))(image)


def grey_blur(image: np.ndarray, sigma: float) -> np.ndarray:
    """BT.601 grey on every channel, then a Gaussian blur of ``sigma`` pixels (0: grey only)."""
    return Degradation((GreyBlur(sigma),))(image)


def occlusion(image: np.ndarray, fraction: float, *, seed: int, key: str) -> np.ndarray:
    """``image`` with the black box :func:`occlusion_box` gives for ``seed`` and ``key``."""
    return Degradation((Occlusion(fraction, seed),))(image, key)


def occlusion_box(
    height: int, width: int, fraction: float, *, seed: int, key: str
) -> tuple[int, int, int, int]:
    """``(top, left, bottom, right)`` (exclusive ends) of the occluding box of one image.

    Its sides are ``round(sqrt(fraction) * height)`` by ``round(sqrt(fraction) * width)``;
    its corner comes from SHA-256 of ``seed`` and ``key``, so the same image (by key) gets the
    same box at every site and in every run, and different images get independent boxes.

    Raises:
        DataError: ``fraction`` outside ``(0, 1)`` or an empty ``key``.
    """
    if not 0.0 < fraction < 1.0:
        raise DataError(f"occlusion fraction must be in (0, 1), got {fraction}")
    if not key:
        raise DataError("occlusion needs each image's key (its name or index), got ''")
    rows = max(1, round(math.sqrt(fraction) * height))
    cols = max(1, round(math.sqrt(fraction) * width))
    digest = hashlib.sha256(f"fl-secure occlusion\0{seed}\0{key}".encode()).digest()
    top = int.from_bytes(digest[:8], "big") % (height - rows + 1)
    left = int.from_bytes(digest[8:16], "big") % (width - cols + 1)
    return top, left, top + rows, left + cols


@dataclass(frozen=True)
class LowResolution:
    """``lowres:<side>``: see :func:`low_resolution`."""

    side: int

    @property
    def spec(self) -> str:
        """The spec :func:`parse_degradation` reads back into this step."""
        return f"lowres:{self.side}"

    def apply(self, pixels: np.ndarray, keys: Sequence[str]) -> np.ndarray:
        """The step on float64 pixels in ``[0, 255]``, ``NxHxWxC``."""
        return _low_resolution(pixels, self.side)


@dataclass(frozen=True)
class GreyBlur:
    """``greyblur:<sigma>``: see :func:`grey_blur`."""

    sigma: float

    @property
    def spec(self) -> str:
        """The spec :func:`parse_degradation` reads back into this step."""
        return f"greyblur:{self.sigma!r}"

    def apply(self, pixels: np.ndarray, keys: Sequence[str]) -> np.ndarray:
        """The step on float64 pixels in ``[0, 255]``, ``NxHxWxC``."""
        return _grey_blur(pixels, self.sigma)


@dataclass(frozen=True)
class Occlusion:
    """``occlusion:<fraction>[:<seed>]``: see :func:`occlusion`."""

    fraction: float
    seed: int = 0

    @property
    def spec(self) -> str:
        """The spec :func:`parse_degradation` reads back into this step."""
        return f"occlusion:{self.fraction!r}:{self.seed}"

    def apply(self, pixels: np.ndarray, keys: Sequence[str]) -> np.ndarray:
        """The step on float64 pixels in ``[0, 255]``, ``NxHxWxC``, one key per image."""
        return _occlusion(pixels, self.fraction, self.seed, keys)


Step = LowResolution | GreyBlur | Occlusion


@dataclass(frozen=True)
class Degradation:
    """Steps applied in order (none: the identity), rounded once at the end for ``uint8``."""

    steps: tuple[Step, ...] = ()

    @property
    def spec(self) -> str:
        """The canonical spec: ``parse_degradation(d.spec) == d``."""
        return "+".join(step.spec for step in self.steps) or "none"

    def __call__(self, image: np.ndarray, key: str = "") -> np.ndarray:
        """The degraded ``HxWxC`` image (``key``: the image's name, for occlusion)."""
        if image.ndim != 3:
            raise DataError(f"expected an HxWxC image, got shape {image.shape}")
        degraded: np.ndarray = self.batch(image[None], [key])[0]
        return degraded

    def batch(self, images: np.ndarray, keys: Sequence[str]) -> np.ndarray:
        """The degraded ``NxHxWxC`` images, one key per image (for occlusion)."""
        if images.ndim != 4 or len(keys) != images.shape[0]:
            raise DataError(
                f"expected NxHxWxC images with N keys, got shape {images.shape} and "
                f"{len(keys)} keys"
            )
        pixels, back = _to_pixels(images)
        for step in self.steps:
            pixels = step.apply(pixels, keys)
        return back(pixels)


def parse_degradation(spec: str) -> Degradation:
    """The degradation a spec names: ``"none"``, ``"lowres:24"``, ``"lowres:32+greyblur:1"``.

    Raises:
        ConfigError: an unknown step or a value out of range, naming the spec.
    """
    text = spec.strip().lower()
    if text in ("", "none"):
        return Degradation()
    steps: list[Step] = []
    for part in text.split("+"):
        name, *args = part.strip().split(":")
        try:
            steps.append(_parse_step(name, args))
        except ValueError as exc:
            raise ConfigError(f"degradation spec {spec!r}: {exc}; {SPEC_HELP}") from None
    return Degradation(tuple(steps))


def _parse_step(name: str, args: list[str]) -> Step:
    if name == "lowres" and len(args) == 1:
        side = int(args[0])
        if side < 1:
            raise ValueError(f"lowres side must be >= 1, got {side}")
        return LowResolution(side)
    if name == "greyblur" and len(args) == 1:
        sigma = float(args[0])
        if not 0.0 <= sigma <= 100.0:
            raise ValueError(f"greyblur sigma must be in [0, 100], got {args[0]}")
        return GreyBlur(sigma)
    if name == "occlusion" and len(args) in (1, 2):
        fraction = float(args[0])
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"occlusion fraction must be in (0, 1), got {args[0]}")
        seed = int(args[1]) if len(args) == 2 else 0
        if seed < 0:
            raise ValueError(f"occlusion seed must be >= 0, got {seed}")
        return Occlusion(fraction, seed)
    raise ValueError(f"{':'.join([name, *args])!r} is not a degradation step")


def degrade_tensor(
    degradation: Degradation, images: torch.Tensor, keys: Sequence[str]
) -> torch.Tensor:
    """Degrade float images in ``[-1, 1]``, ``[N, C, H, W]``, one key per image; float32 out.

    Raises:
        DataError: not a 4-d tensor, or not one key per image.
    """
    if images.dim() != 4 or len(keys) != images.shape[0]:
        raise DataError(
            f"expected [N, C, H, W] images with N keys, got {tuple(images.shape)} and "
            f"{len(keys)} keys"
        )
    if not degradation.steps:
        return images.to(torch.float32)
    pixels = (images.detach().cpu().to(torch.float64).numpy().transpose(0, 2, 3, 1) + 1.0) * 127.5
    out = degradation.batch(pixels, keys)
    return torch.from_numpy(out.transpose(0, 3, 1, 2) / 127.5 - 1.0).to(torch.float32)


def degrade_dataset(
    dataset: FaceDataset, degradation: Degradation, *, run_seed: int | None = None
) -> FaceDataset:
    """The data set with every image degraded; labels, names and attributes unchanged.

    Each image's key is ``<identity>/<k>``, ``k`` its rank among its identity's images, so an
    image keeps its occlusion box whatever other identities are loaded with it; ``run_seed``
    (a run's ``run.seed``) prefixes it, ``<run_seed>/<identity>/<k>``, so another run draws
    other boxes. Images are degraded :data:`CHUNK` at a time (float64 working memory stays
    small at 150 px), in the data set's order.
    """
    if not degradation.steps:
        return dataset
    prefix = "" if run_seed is None else f"{run_seed}/"
    seen: Counter[int] = Counter()
    keys = []
    for label in dataset.labels.tolist():
        keys.append(f"{prefix}{dataset.identity_names[label]}/{seen[label]}")
        seen[label] += 1
    chunks = [
        degrade_tensor(degradation, dataset.images[i : i + CHUNK], keys[i : i + CHUNK])
        for i in range(0, len(dataset), CHUNK)
    ]
    images = torch.cat(chunks) if chunks else dataset.images
    return FaceDataset(
        images=images,
        labels=dataset.labels,
        identity_names=dataset.identity_names,
        attributes=dataset.attributes,
        source=f"{dataset.source} degraded {degradation.spec}",
    )


# ------------------------------------------------------------------ the maths, float64 pixels


def _to_pixels(image: np.ndarray) -> tuple[np.ndarray, _Back]:
    if image.dtype == np.uint8:
        return image.astype(np.float64), _round_uint8
    if np.issubdtype(image.dtype, np.floating):
        return image.astype(np.float64), _identity
    raise DataError(f"expected uint8 or float pixels, got {image.dtype}")


def _round_uint8(pixels: np.ndarray) -> np.ndarray:
    out: np.ndarray = np.clip(np.rint(pixels), 0, 255).astype(np.uint8)
    return out


def _identity(pixels: np.ndarray) -> np.ndarray:
    return pixels


def _rows_cols(pixels: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``rows @ channel @ cols.T`` for every channel of every image."""
    out: np.ndarray = np.einsum("ij,njkc,lk->nilc", rows, pixels, cols, optimize=True)
    return out


def _low_resolution(pixels: np.ndarray, side: int) -> np.ndarray:
    h, w = pixels.shape[1:3]
    if not 1 <= side <= min(h, w):
        raise DataError(f"lowres:{side} needs a side in [1, {min(h, w)}] for {h}x{w} images")
    low_h, low_w = (side, max(1, round(w * side / h))) if h <= w else (round(h * side / w), side)
    low = _rows_cols(pixels, _area_matrix(low_h, h), _area_matrix(low_w, w))
    return _rows_cols(low, _bilinear_matrix(h, low_h), _bilinear_matrix(w, low_w))


def _area_matrix(n_out: int, n_in: int) -> np.ndarray:
    """Box filter from ``n_in`` to ``n_out <= n_in`` samples: each output averages its span."""
    scale = n_in / n_out
    lo = np.arange(n_out)[:, None] * scale
    j = np.arange(n_in)[None, :]
    overlap = np.minimum(lo + scale, j + 1) - np.maximum(lo, j)
    weights: np.ndarray = np.clip(overlap, 0.0, None) / scale
    return weights


def _bilinear_matrix(n_out: int, n_in: int) -> np.ndarray:
    """Linear interpolation from ``n_in`` to ``n_out`` samples, half-pixel centres, clamped."""
    x = np.clip((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0.0, n_in - 1)
    x0 = np.floor(x).astype(np.int64)
    x1 = np.minimum(x0 + 1, n_in - 1)
    matrix = np.zeros((n_out, n_in))
    np.add.at(matrix, (np.arange(n_out), x0), 1.0 - (x - x0))
    np.add.at(matrix, (np.arange(n_out), x1), x - x0)
    return matrix


def _grey_blur(pixels: np.ndarray, sigma: float) -> np.ndarray:
    if pixels.shape[3] != 3:
        raise DataError(f"greyblur needs RGB images, got {pixels.shape[3]} channels")
    grey = (pixels @ LUMA_BT601)[..., None]
    h, w = grey.shape[1:3]
    blurred = _rows_cols(grey, _gaussian_matrix(h, sigma), _gaussian_matrix(w, sigma))
    return np.repeat(blurred, 3, axis=3)


def _gaussian_matrix(n: int, sigma: float) -> np.ndarray:
    """Gaussian smoothing of ``n`` samples, mirrored edges (``d c b a | a b c d``)."""
    radius = int(4.0 * sigma + 0.5)
    if radius == 0:
        return np.eye(n)
    offsets = np.arange(-radius, radius + 1)
    weights = np.exp(-0.5 * (offsets / sigma) ** 2)
    weights /= weights.sum()
    source = (np.arange(n)[:, None] + offsets[None, :]) % (2 * n)
    source = np.where(source >= n, 2 * n - 1 - source, source)
    matrix = np.zeros((n, n))
    np.add.at(matrix, (np.repeat(np.arange(n), offsets.size), source.ravel()), np.tile(weights, n))
    return matrix


def _occlusion(pixels: np.ndarray, fraction: float, seed: int, keys: Sequence[str]) -> np.ndarray:
    h, w = pixels.shape[1:3]
    out = pixels.copy()
    for image, key in zip(out, keys, strict=True):
        top, left, bottom, right = occlusion_box(h, w, fraction, seed=seed, key=key)
        image[top:bottom, left:right] = 0.0
    return out
