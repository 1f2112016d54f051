"""Checkpoints of the global shared parameters: safetensors plus a JSON round state.

A checkpoint is written atomically after each completed round, so ``--resume`` after a crash
(even ``kill -9``) continues from the last completed round.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load, save

from fl_secure.errors import CheckpointError
from fl_secure.messages import Tensors
from fl_secure.runs import atomic_write_bytes, atomic_write_json


@dataclass(frozen=True)
class Checkpoint:
    """The state a run resumes from."""

    round: int
    parameters: Tensors
    state: dict[str, Any]


class CheckpointStore:
    """Writes ``round-%06d.safetensors`` and ``latest.json`` in a folder; keeps the last few."""

    def __init__(self, folder: Path, *, keep: int = 3) -> None:
        self.folder = folder
        self.keep = keep

    def save(self, round_: int, parameters: Tensors, state: dict[str, Any]) -> Path:
        """Save the parameters after ``round_``, then point ``latest.json`` at them."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"round-{round_:06d}.safetensors"
        arrays = {k: np.ascontiguousarray(v) for k, v in parameters.items()}
        order = json.dumps(list(parameters))
        atomic_write_bytes(path, save(arrays, metadata={"round": str(round_), "order": order}))
        atomic_write_json(
            self.folder / "latest.json", {"round": round_, "file": path.name, **state}
        )
        for old in sorted(self.folder.glob("round-*.safetensors"))[: -self.keep]:
            old.unlink(missing_ok=True)
        return path

    def latest(self) -> Checkpoint | None:
        """The last completed checkpoint, or None for a fresh run."""
        pointer = self.folder / "latest.json"
        if not pointer.exists():
            return None
        try:
            state = json.loads(pointer.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {pointer}: {exc}") from exc
        return self._read(state)

    def load(self, round_: int) -> Checkpoint:
        """The checkpoint of ``round_`` (only the last few are kept)."""
        path = self.folder / f"round-{round_:06d}.safetensors"
        if not path.exists():
            kept = sorted(p.name for p in self.folder.glob("round-*.safetensors"))
            raise CheckpointError(f"no checkpoint of round {round_}; kept: {kept}")
        return self._read({"file": path.name, "round": round_})

    def _read(self, state: dict[str, Any]) -> Checkpoint:
        try:
            path = self.folder / str(state.pop("file"))
            round_ = int(state.pop("round"))
            raw = path.read_bytes()
        except (OSError, KeyError, ValueError) as exc:
            raise CheckpointError(f"cannot read checkpoint in {self.folder}: {exc}") from exc
        arrays = load(raw)
        with safe_open(str(path), framework="numpy") as handle:  # metadata: parameter order
            meta = handle.metadata() or {}
        order = json.loads(meta.get("order", "[]")) or sorted(arrays)
        return Checkpoint(
            round=round_, parameters=OrderedDict((k, arrays[k]) for k in order), state=state
        )
