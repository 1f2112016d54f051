"""Checkpoints of the global shared parameters: safetensors plus a JSON round state.

A checkpoint is written atomically after each completed round, so ``--resume`` after a crash
(even ``kill -9``) continues from the last completed round. Per-client server state (FedGC's
latest class embeddings of each client) goes to ``clients-%06d.safetensors`` next to it, keys
``"<client id>/<tensor name>"``, written before ``latest.json`` points at the round.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
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
    client_tensors: dict[str, Tensors] = field(default_factory=dict)  # client id -> tensors


class CheckpointStore:
    """Writes ``round-%06d.safetensors`` and ``latest.json`` in a folder; keeps the last few."""

    def __init__(self, folder: Path, *, keep: int = 3) -> None:
        self.folder = folder
        self.keep = keep

    def path_of(self, round_: int) -> Path:
        """Where the parameters after ``round_`` are written."""
        return self.folder / f"round-{round_:06d}.safetensors"

    @staticmethod
    def encode(round_: int, parameters: Tensors) -> bytes:
        """The bytes of a parameters file (safetensors; the tensor order in its metadata).

        The released model's SHA-256 is the SHA-256 of these bytes, so the ledger can name
        the file before it is written (``sha256sum`` of the file checks it).
        """
        arrays = {k: np.ascontiguousarray(v) for k, v in parameters.items()}
        order = json.dumps(list(parameters))
        return save(arrays, metadata={"round": str(round_), "order": order})

    def save(
        self,
        round_: int,
        parameters: Tensors,
        state: dict[str, Any],
        *,
        client_tensors: Mapping[str, Tensors] | None = None,
        encoded: bytes | None = None,
    ) -> Path:
        """Save the parameters after ``round_``, then point ``latest.json`` at them.

        ``encoded``: :meth:`encode` of the same round and parameters, when the caller already
        made it (to hash it); written as it is.
        """
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path_of(round_)
        if encoded is None:
            encoded = self.encode(round_, parameters)
        atomic_write_bytes(path, encoded)
        pointer: dict[str, Any] = {
            "round": round_,
            "file": path.name,
            "sha256": hashlib.sha256(encoded).hexdigest(),  # checked when it is read back
            **state,
        }
        if client_tensors:
            clients = self.folder / f"clients-{round_:06d}.safetensors"
            flat = {
                f"{client}/{name}": np.ascontiguousarray(array)
                for client, tensors in client_tensors.items()
                for name, array in tensors.items()
            }
            meta = {"round": str(round_), "order": json.dumps(list(flat))}
            raw_clients = save(flat, metadata=meta)
            atomic_write_bytes(clients, raw_clients)
            pointer["clients_file"] = clients.name
            pointer["clients_sha256"] = hashlib.sha256(raw_clients).hexdigest()
        stale = [
            old
            for pattern in ("round-*.safetensors", "clients-*.safetensors")
            for old in sorted(self.folder.glob(pattern))[: -self.keep]
        ]
        # every kept file's SHA-256, so that an older round named by load() is checked too
        digests = self._kept_digests()
        digests[path.name] = pointer["sha256"]
        if "clients_file" in pointer:
            digests[pointer["clients_file"]] = pointer["clients_sha256"]
        gone = {old.name for old in stale}
        pointer["kept_sha256"] = {
            name: digest
            for name, digest in sorted(digests.items())
            if name not in gone and (self.folder / name).exists()
        }
        atomic_write_json(self.folder / "latest.json", pointer)
        for old in stale:
            old.unlink(missing_ok=True)
        return path

    def _kept_digests(self) -> dict[str, str]:
        """The SHA-256 of each file the current ``latest.json`` knows (empty if none)."""
        try:
            state = self.latest_state()
        except CheckpointError:
            return {}
        if state is None:
            return {}
        known = state.get("kept_sha256")
        out = dict(known) if isinstance(known, dict) else {}
        for file, digest in (("file", "sha256"), ("clients_file", "clients_sha256")):
            if isinstance(state.get(file), str) and isinstance(state.get(digest), str):
                out[state[file]] = state[digest]
        return {str(k): str(v) for k, v in out.items()}

    def latest(self) -> Checkpoint | None:
        """The last completed checkpoint, or None for a fresh run."""
        state = self.latest_state()
        return None if state is None else self._read(state)

    def latest_file(self) -> tuple[int, Path] | None:
        """The round and parameters file ``latest.json`` points at (nothing read), or None."""
        state = self.latest_state()
        if state is None:
            return None
        try:
            return int(state["round"]), self.folder / Path(str(state["file"])).name
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{self.folder / 'latest.json'}: {exc!r}") from exc

    def latest_state(self) -> dict[str, Any] | None:
        """``latest.json`` alone (no tensors read), or None for a fresh run."""
        pointer = self.folder / "latest.json"
        if not pointer.exists():
            return None
        try:
            state = json.loads(pointer.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {pointer}: {exc}") from exc
        if not isinstance(state, dict):
            raise CheckpointError(f"{pointer}: expected a JSON object, got {type(state).__name__}")
        return state

    def load(self, round_: int) -> Checkpoint:
        """The checkpoint of ``round_`` (only the last few are kept).

        Checked against the SHA-256 ``latest.json`` records for it, as :meth:`latest` is
        (checkpoints written before those digests were kept are read unchecked).
        """
        path = self.path_of(round_)
        if not path.exists():
            kept = sorted(p.name for p in self.folder.glob("round-*.safetensors"))
            raise CheckpointError(f"no checkpoint of round {round_}; kept: {kept}")
        state = self.latest_state()
        if state is not None and state.get("file") == path.name:
            return self._read(state)
        digests = self._kept_digests()
        pointer: dict[str, Any] = {"file": path.name, "round": round_}
        if path.name in digests:
            pointer["sha256"] = digests[path.name]
        return self._read(pointer)

    def _read(self, state: dict[str, Any]) -> Checkpoint:
        if not isinstance(state, dict):
            raise CheckpointError(
                f"{self.folder / 'latest.json'}: expected a JSON object, got {type(state).__name__}"
            )
        try:
            path = self.folder / str(state.pop("file"))
            round_ = int(state.pop("round"))
            raw = path.read_bytes()
        except (OSError, KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"cannot read checkpoint in {self.folder}: {exc!r}") from exc
        arrays, order = _read_tensors(path, raw)  # names a truncated or garbled file first
        _check_digest(path, raw, state.pop("sha256", None))
        state.pop("kept_sha256", None)
        clients: dict[str, Tensors] = {}
        if "clients_file" in state:
            clients_path = self.folder / str(state.pop("clients_file"))
            try:
                raw_clients = clients_path.read_bytes()
            except OSError as exc:
                raise CheckpointError(f"cannot read per-client state: {exc}") from exc
            flat, keys = _read_tensors(clients_path, raw_clients)
            _check_digest(clients_path, raw_clients, state.pop("clients_sha256", None))
            for key in keys:
                client, _, name = key.partition("/")
                clients.setdefault(client, OrderedDict())[name] = flat[key]
        return Checkpoint(
            round=round_,
            parameters=OrderedDict((k, arrays[k]) for k in order),
            state=state,
            client_tensors=clients,
        )


def _check_digest(path: Path, raw: bytes, expected: object) -> None:
    """``raw`` against the SHA-256 ``latest.json`` recorded (older pointers record none)."""
    if expected is None:
        return
    if hashlib.sha256(raw).hexdigest() != expected:
        raise CheckpointError(
            f"{path} is damaged or altered: its SHA-256 is not the one latest.json recorded "
            "when it was written; restore it, or resume from an older round"
        )


def _read_tensors(path: Path, raw: bytes) -> tuple[dict[str, np.ndarray], list[str]]:
    """Arrays of a checkpoint file and their stored order; CheckpointError names the damage."""
    try:
        arrays = load(raw)
        with safe_open(str(path), framework="numpy") as handle:  # metadata: parameter order
            meta = handle.metadata() or {}
        order = json.loads(meta.get("order", "[]")) or sorted(arrays)
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is damaged (not readable as safetensors): {exc}") from exc
    if not isinstance(order, list) or sorted(map(str, order)) != sorted(arrays):
        raise CheckpointError(f"{path} is damaged: its stored order does not list its tensors")
    for name, array in arrays.items():
        if array.dtype.kind in "fc" and not np.isfinite(array).all():
            bad = int(array.size - np.isfinite(array).sum())
            raise CheckpointError(f"{path} is damaged: {name!r} holds {bad} NaN/Inf values")
    return arrays, [str(k) for k in order]
