"""Backbone factory keyed by short names, and safetensors weight I/O.

Follows the layout of insightface's arcface_torch (Deng et al., "ArcFace: Additive Angular
Margin Loss for Deep Face Recognition", CVPR 2019): ``get_model("r18")`` picks one backbone
per file by a short name. Weights are written as safetensors; they are read from safetensors
or, for checkpoints such as insightface's ``backbone.pth``, from a PyTorch pickle through
PyTorch's restricted ``weights_only`` unpickler (:mod:`fl_secure.models.torch_weights`), so
loading a file from an untrusted site cannot execute code.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from torch import nn

from fl_secure.errors import CheckpointError, ConfigError
from fl_secure.models.cnn import FaceCNN
from fl_secure.models.dlib_resnet import DlibResNet
from fl_secure.models.iresnet import iresnet
from fl_secure.models.resnet import resnet18_face
from fl_secure.models.torch_weights import is_torch_file, read_torch_state_dict
from fl_secure.runs import atomic_write_bytes

BACKBONES: Final[Mapping[str, Callable[..., nn.Module]]] = MappingProxyType(
    {
        "cnn": FaceCNN,  # GroupNorm residual CNN, widths 32-64-128-256 (Opacus-compatible)
        "cnn-small": partial(FaceCNN, widths=(16, 32, 64, 128)),  # narrower, for tests
        "resnet18": partial(resnet18_face, norm="group"),  # HF-MAML's ResNet-18, GroupNorm
        "resnet18-bn": partial(resnet18_face, norm="batch"),  # BatchNorm: not for DP-SGD
        # dlib's face ResNet: embedding 128, image 150 only; pretrained weights from
        # fl_secure.models.dlib_weights.dlib_resnet_weights()
        "dlib-resnet": DlibResNet,
        # insightface arcface_torch's IResNets (BatchNorm: not for DP-SGD unless frozen);
        # image 112 only; load its backbone.pth with model.pretrained
        "iresnet18": partial(iresnet, "iresnet18"),
        "iresnet34": partial(iresnet, "iresnet34"),
        "iresnet50": partial(iresnet, "iresnet50"),
    }
)
"""Backbone builders by name; each takes ``embedding_size`` and ``image_size`` keywords."""

DEFAULT_BACKBONE: Final = "cnn"


def get_backbone(
    name: str = DEFAULT_BACKBONE,
    *,
    embedding_size: int = 512,
    image_size: int = 64,
    **kwargs: Any,
) -> nn.Module:
    """Build a randomly initialised backbone mapping ``[B, 3, H, W]`` to ``[B, embedding_size]``.

    Args:
        name: key of :data:`BACKBONES`.
        embedding_size: length of the embedding the backbone outputs.
        image_size: side of the square input images.
        **kwargs: extra keyword arguments of the builder (e.g. ``dropout`` for the CNNs).

    Returns:
        The backbone, in training mode.

    Raises:
        ConfigError: if ``name`` is unknown or an argument is out of range.
    """
    try:
        builder = BACKBONES[name]
    except KeyError:
        raise ConfigError(
            f"unknown backbone {name!r}; allowed names: {', '.join(BACKBONES)}"
        ) from None
    return builder(embedding_size=embedding_size, image_size=image_size, **kwargs)


def save_weights(
    model: nn.Module, path: str | os.PathLike[str], *, metadata: Mapping[str, str] | None = None
) -> None:
    """Write the model's ``state_dict`` (parameters and buffers) to a safetensors file.

    The write is atomic (:func:`fl_secure.runs.atomic_write_bytes`): a crash never leaves a
    truncated file under the final name.

    Args:
        model: the module to save.
        path: destination file; missing parent directories are created.
        metadata: optional string key/value pairs stored in the file header.

    Raises:
        CheckpointError: if the file cannot be written.
    """
    target = Path(path)
    tensors = {
        key: value.detach().to("cpu").contiguous().clone()
        for key, value in model.state_dict().items()
    }
    data = save(tensors, metadata=dict(metadata) if metadata else None)
    try:
        atomic_write_bytes(target, data)
    except OSError as error:
        raise CheckpointError(f"cannot write weights to {target}: {error}") from error


def load_pretrained(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Load weights from a safetensors file, or a PyTorch ``.pth``/``.pt`` state dict.

    A ``.pth``/``.pt`` file (e.g. insightface arcface_torch's ``backbone.pth``) is read by
    :func:`fl_secure.models.torch_weights.read_torch_state_dict`: PyTorch's restricted
    unpickler, a top-level ``"state_dict"`` unwrapped, a ``"module."`` prefix stripped; a
    BatchNorm ``num_batches_tracked`` counter absent from such a file (older PyTorch wrote
    none) keeps the model's value. Any other file is read as safetensors (:func:`save_weights`).

    Every key of the model's ``state_dict`` must be in the file with the same shape and
    dtype and finite values, and the file must hold no other key; nothing is loaded otherwise.

    Args:
        model: the module to fill in place.
        path: a safetensors, ``.pth`` or ``.pt`` file on local disk.

    Raises:
        CheckpointError: if the file is missing or unreadable, holds anything but tensors, or
            names, shapes or dtypes do not match the model (the message names the file and
            the offending keys).
    """
    source = Path(path)
    if is_torch_file(source):
        tensors = read_torch_state_dict(source)
        for key, value in model.state_dict().items():
            if key.endswith(".num_batches_tracked") and key not in tensors:
                tensors[key] = value
    else:
        tensors = _read_safetensors(source)
    check_state_dict(model, tensors, source)
    model.load_state_dict(tensors, strict=True)


def _read_safetensors(source: Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file, on the CPU."""
    if not source.is_file():
        raise CheckpointError(f"weights file {source} does not exist or is not a file")
    try:
        return load_file(source, device="cpu")
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"cannot read {source} as safetensors: {error}") from error


def check_state_dict(model: nn.Module, tensors: Mapping[str, torch.Tensor], source: Path) -> None:
    """Check that ``tensors`` fit ``model`` exactly: names, shapes, dtypes, finite values.

    Raises:
        CheckpointError: naming ``source`` and the first key that does not fit.
    """
    expected = model.state_dict()
    missing = sorted(expected.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - expected.keys())
    if missing or unexpected:
        raise CheckpointError(
            f"{source} does not match the model: missing keys {missing}, "
            f"unexpected keys {unexpected}"
        )
    for key, value in expected.items():
        stored = tensors[key]
        if stored.shape != value.shape:
            raise CheckpointError(
                f"{source}: key {key!r} has shape {tuple(stored.shape)}, "
                f"the model expects {tuple(value.shape)}"
            )
        if stored.dtype != value.dtype:
            raise CheckpointError(
                f"{source}: key {key!r} has dtype {stored.dtype}, the model expects {value.dtype}"
            )
        if stored.is_floating_point() and not bool(torch.isfinite(stored).all()):
            bad = int((~torch.isfinite(stored)).sum())
            raise CheckpointError(f"{source}: key {key!r} holds {bad} NaN/Inf values")
