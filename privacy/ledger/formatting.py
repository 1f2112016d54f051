"""A ledger for people and for tools: a readable table, and ``privacy ledger --json``."""

from __future__ import annotations

import json
from collections.abc import Sequence

from privacy.ledger.entries import FORMAT_VERSION, Entry, JsonValue, canonical_json
from privacy.ledger.guarantee import ledger_guarantee
from privacy.ledger.verification import VerifyResult


def format_ledger(entries: Sequence[Entry]) -> str:
    """A readable table of ``entries``, one line each."""
    header = ("seq", "round", "kind", "party", "created_at", "hash", "payload")
    lines = [
        (
            str(e.seq),
            str(e.round),
            e.kind,
            e.party,
            e.created_at[:19] + "Z",
            e.hash[:12],
            " ".join(f"{k}={_short(v)}" for k, v in sorted(e.payload.items())),
        )
        for e in entries
    ]
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header) - 1)]
    out = []
    for row in [header, *lines]:
        out.append(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
        )
    return "\n".join(line.rstrip() for line in out)


def _short(value: JsonValue) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, str):
        return value if value and " " not in value else json.dumps(value)
    return canonical_json(value)


def ledger_json(
    entries: Sequence[Entry], verify_result: VerifyResult | None, *, run_id: str | None = None
) -> dict[str, JsonValue]:
    """JSON-ready form of a ledger for ``fl-secure privacy ledger --json``."""
    client = [e for e in entries if e.kind == "client_level"]
    example = [e for e in entries if e.kind == "example_level"]
    recorded = client or example
    epsilon, delta = ledger_guarantee(entries)
    discarded = [e.round for e in entries if e.kind == "discarded_sum"]
    out: dict[str, JsonValue] = {
        "format_version": FORMAT_VERSION,
        "run_id": run_id,
        "entries": [e.to_dict() for e in entries],
        "rounds_recorded": list[JsonValue](sorted({e.round for e in recorded})),
        "discarded_sums": list[JsonValue](discarded),
        "privacy_unit": "client" if client or discarded else _dpsgd_unit(example),
        "epsilon": epsilon,
        "delta": delta,
    }
    if verify_result is not None:
        out["verify"] = {"ok": verify_result.ok, "problems": list(verify_result.problems)}
    return out


def _dpsgd_unit(rows: Sequence[Entry]) -> str | None:
    """``example`` or ``identity``: what the DP-SGD rows' payloads name (``example`` if none)."""
    if not rows:
        return None
    named = {str(e.payload.get("privacy_unit", "example")) for e in rows}
    return named.pop() if len(named) == 1 else "/".join(sorted(named))
