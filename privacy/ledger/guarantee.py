"""What a run's ledger states: its (epsilon, delta), and the model file it was released with."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fl_secure.checkpoints import CheckpointStore
from fl_secure.errors import CheckpointError
from privacy.ledger.entries import CLIENT_KINDS, Entry, JsonValue


def ledger_guarantee(entries: Sequence[Entry]) -> tuple[JsonValue, JsonValue]:
    """``(epsilon, delta)`` the ledger's entries state for the run (``None`` without any).

    Client level: the newest ``client_level`` or ``discarded_sum`` entry (each carries the
    running total).
    Example level: the worst client's, each client's entries being cumulative.
    """
    client = [e for e in entries if e.kind in CLIENT_KINDS]
    example = [e for e in entries if e.kind == "example_level"]
    if client:
        return client[-1].payload.get("epsilon"), client[-1].payload.get("delta")
    if example:
        worst = max(example, key=lambda e: float(e.payload.get("epsilon") or 0.0))  # type: ignore[arg-type]
        return worst.payload.get("epsilon"), worst.payload.get("delta")
    return None, None


def released_model(entries: Sequence[Entry], latest: tuple[int, Path] | None) -> dict[str, Any]:
    """The model the ledger says it released, checked against the run's latest parameters file.

    Every round's ledger rows carry ``model_sha256``: the SHA-256 of the parameters file the
    round released (``checkpoints/round-NNNNNN.safetensors``; ``sha256sum`` of the file gives
    it). Ledgers written before that carry none, which is no problem but leaves the guarantee
    unbound to a file.

    Args:
        entries: The ledger's entries.
        latest: The round and file ``checkpoints/latest.json`` points at (None: none).

    Returns:
        ``checkpoint`` (file name), ``round``, ``sha256`` (of the file), ``ledger_sha256``
        (what the rows of that round name), ``matches_ledger`` (None when the ledger names
        none) and ``problem`` (None, or what is wrong, naming the file and both digests).
    """
    out: dict[str, Any] = {
        "checkpoint": None,
        "round": None,
        "sha256": None,
        "ledger_sha256": None,
        "matches_ledger": None,
        "problem": None,
    }
    if latest is None:
        return out
    round_, path = latest
    out.update(checkpoint=f"checkpoints/{path.name}", round=round_)
    try:
        out["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:
        out["problem"] = f"the released model's file {out['checkpoint']} cannot be read ({exc})"
        return out
    released = [e for e in entries if e.kind in ("client_level", "example_level")]
    named = {str(e.payload["model_sha256"]) for e in released if "model_sha256" in e.payload}
    later = sorted({e.round for e in released if e.round > round_})
    if later:
        out["problem"] = (
            f"the ledger records round {later[-1]} but checkpoints/latest.json points at round "
            f"{round_}: the run's latest model is not the last one the ledger released"
        )
    of_round = {
        str(e.payload["model_sha256"])
        for e in released
        if e.round == round_ and "model_sha256" in e.payload
    }
    if not of_round:
        if named and out["problem"] is None:  # the ledger names models, but not this one
            out["problem"] = f"the ledger names no model for round {round_}"
        return out
    if len(of_round) > 1:
        out["problem"] = f"the ledger's rows of round {round_} name {len(of_round)} models"
        return out
    out["ledger_sha256"] = recorded = of_round.pop()
    out["matches_ledger"] = recorded == out["sha256"]
    if not out["matches_ledger"] and out["problem"] is None:
        out["problem"] = (
            f"{out['checkpoint']} has SHA-256 {out['sha256'][:16]}, but the ledger's rows of "
            f"round {round_} name {recorded[:16]}: the file is not the model the run released"
        )
    return out


def released_model_of_run(run: Path, entries: Sequence[Entry]) -> dict[str, Any]:
    """:func:`released_model` of the run's latest checkpoint; a broken pointer is a problem."""
    try:
        latest = CheckpointStore(Path(run) / "checkpoints").latest_file()
    except CheckpointError as exc:
        return {**released_model(entries, None), "problem": str(exc)}
    return released_model(entries, latest)
