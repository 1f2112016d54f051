"""Read a PyTorch ``.pth``/``.pt`` state dict without letting the file execute code.

Practitioners bring insightface arcface_torch weights as ``backbone.pth``, a pickle written by
``torch.save(backbone.state_dict(), path)``. A pickle from an untrusted source can run any
code when unpickled, so the file is read only with PyTorch's restricted unpickler
(``torch.load(..., weights_only=True)``), which rebuilds tensors, containers and primitive
values and refuses every other global (a custom class, ``os.system``, ...). What it returns
must then be a flat mapping of names to tensors; anything else is refused.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import torch

from fl_secure.errors import CheckpointError

TORCH_SUFFIXES: Final = (".pth", ".pt")
"""File suffixes read as PyTorch pickles; every other file is read as safetensors."""
WRAPPER_KEYS: Final = ("state_dict", "state_dict_backbone")
"""Top-level keys whose mapping is the state dict: a common wrapper, and the backbone entry of
arcface_torch's resumable ``checkpoint_gpu_<rank>.pt``."""
DATA_PARALLEL_PREFIX: Final = "module."
"""Prefix ``nn.DataParallel``/``DistributedDataParallel`` adds to every name."""


def is_torch_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a PyTorch pickle (``.pth`` or ``.pt``, any case)."""
    return Path(path).suffix.lower() in TORCH_SUFFIXES


def read_torch_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read a state dict saved by ``torch.save`` into CPU tensors, without running code.

    A top-level ``"state_dict"`` (or arcface_torch's ``"state_dict_backbone"``) mapping is
    unwrapped, and a ``"module."`` prefix common to every name is stripped.

    Args:
        path: a ``.pth``/``.pt`` file on local disk.

    Returns:
        The tensors by name, on the CPU.

    Raises:
        CheckpointError: if the file is missing, truncated or not a torch pickle, holds any
            object the restricted unpickler refuses, or is not a flat ``str -> Tensor``
            mapping (the message names the file and the offending key).
    """
    source = Path(path)
    if not source.is_file():
        raise CheckpointError(f"weights file {source} does not exist or is not a file")
    try:
        loaded = torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"refused {source}: it is not a plain tensor state dict, or is damaged "
            f"(PyTorch's weights_only unpickler: {_first_line(error)})"
        ) from error
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as error:
        raise CheckpointError(
            f"cannot read {source} as a PyTorch file (truncated or not written by "
            f"torch.save?): {_first_line(error)}"
        ) from error
    return _flat_state_dict(loaded, source)


def _flat_state_dict(loaded: object, source: Path) -> dict[str, torch.Tensor]:
    """Check that ``loaded`` is (or wraps) a ``str -> Tensor`` mapping; strip ``module.``."""
    if not isinstance(loaded, Mapping):
        raise CheckpointError(
            f"{source} holds a {type(loaded).__name__}, expected a state dict (a mapping of "
            "parameter names to tensors)"
        )
    state: Mapping[Any, object] = loaded
    for wrapper in WRAPPER_KEYS:
        inner = state.get(wrapper)
        if isinstance(inner, Mapping):
            state = inner
            break
    tensors: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{source}: key {key!r} is a {type(key).__name__}, not a str")
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{source}: key {key!r} holds a {type(value).__name__}, expected a tensor"
            )
        if value.layout != torch.strided:
            raise CheckpointError(
                f"{source}: key {key!r} is a {value.layout} tensor, expected a dense one"
            )
        tensors[key] = value.detach()
    if tensors and all(key.startswith(DATA_PARALLEL_PREFIX) for key in tensors):
        tensors = {key.removeprefix(DATA_PARALLEL_PREFIX): v for key, v in tensors.items()}
    if not tensors:
        raise CheckpointError(f"{source} holds no tensors")
    return tensors


def _first_line(error: BaseException) -> str:
    """The telling line of an exception's message (PyTorch's run to many lines).

    For the restricted unpickler that is the line naming what it refused ("Unsupported
    global: GLOBAL __main__.Foo", "unsupported GLOBAL posix.system"); otherwise the first line.
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if "unsupported" in line.lower():
            return line.split("WeightsUnpickler error: ")[-1]
    return lines[0] if lines else type(error).__name__
