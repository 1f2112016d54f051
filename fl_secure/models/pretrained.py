"""``model.pretrained``: a weights file, or the name of a built-in pretrained face model.

``model.pretrained = "dlib-resnet"`` takes dlib's face ResNet (Davis King, CC0 1.0; the
``face_recognition_models`` package, ``pip install 'fl-secure[faces]'``), converted once to
a safetensors cache by :func:`fl_secure.models.dlib_weights.dlib_resnet_weights`; any other
value is a local file. Nothing is downloaded. :func:`pretrained_provenance` states which
bytes a run started from (SHA-256 of the weights and of their source), for the run's
summary and its compliance report.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Final

from fl_secure.errors import CheckpointError
from fl_secure.models.dlib_weights import DLIB_RESNET_DAT, dlib_resnet_weights

BUILTIN_PRETRAINED: Final = {
    "dlib-resnet": (
        "dlib's face-recognition ResNet (dlib_face_recognition_resnet_model_v1.dat, Davis King, "
        "CC0 1.0; 99.38% on LFW as reported by dlib), for model.backbone = 'dlib-resnet'"
    ),
}
"""Names ``model.pretrained`` accepts besides a file path, with what each is."""


def is_builtin(value: str) -> bool:
    """Whether ``value`` names a built-in pretrained model rather than a file."""
    return value in BUILTIN_PRETRAINED


def resolve_pretrained(value: str) -> Path:
    """The weights file ``model.pretrained = value`` loads (built-ins converted on first use).

    Raises:
        ConfigError: a built-in whose package is not installed (the message names the extra).
        CheckpointError: the built-in's source file is unreadable or not what it should be.
    """
    if value == "dlib-resnet":
        return dlib_resnet_weights().path
    return Path(value)


def _sha256(path: Path) -> str:
    try:
        with path.open("rb") as handle:
            return hashlib.file_digest(handle, "sha256").hexdigest()
    except OSError as error:
        raise CheckpointError(f"cannot read pretrained weights {path}: {error}") from error


def pretrained_provenance(value: str) -> dict[str, Any] | None:
    """What ``model.pretrained = value`` started the run from; None for a random start.

    Returns:
        ``name`` (the config value), ``file`` and ``sha256`` of the weights loaded, and for a
        built-in its ``source`` file, the source's ``source_sha256`` and ``description``.
    """
    if not value:
        return None
    if value == "dlib-resnet":
        weights = dlib_resnet_weights()
        return {
            "name": value,
            "file": str(weights.path),
            "sha256": weights.sha256,
            "source": f"{DLIB_RESNET_DAT} ({weights.source})",
            "source_sha256": weights.source_sha256,
            "description": BUILTIN_PRETRAINED[value],
        }
    path = Path(value)
    return {"name": value, "file": str(path), "sha256": _sha256(path)}


def check_pretrained_unchanged(value: str, recorded: Any, *, what: str) -> None:
    """Refuse to rebuild a run's model from pretrained weights other than it started from.

    A run with ``train.trainable`` other than ``all`` checkpoints only what it trains; the
    frozen rest comes from ``model.pretrained`` again. ``recorded`` is the run's
    ``provenance.pretrained`` (:func:`pretrained_provenance` when it started); None or a
    record without ``sha256`` (a run that did not record it) is not checked.

    Raises:
        CheckpointError: naming both digests and files, when the weights differ now.
    """
    if not value or not isinstance(recorded, dict) or not recorded.get("sha256"):
        return
    now = pretrained_provenance(value)
    if now is not None and now["sha256"] != recorded["sha256"]:
        raise CheckpointError(
            f"{what} started from model.pretrained = {value!r} with SHA-256 "
            f"{recorded['sha256']} ({recorded.get('file')}), but those weights are now "
            f"{now['sha256']} ({now['file']}): the frozen layers its checkpoints do not "
            "hold would come from other weights; restore the run's pretrained file"
        )
