"""Verifying a ledger: every row's hash, its order, its epsilon, and the signed head.

The chain makes edits, deletions and reorderings done without recomputing every later hash
evident. It is not a signature: whoever can write the file can rewrite the whole chain, or
drop its tail. The server's signed head and its copies (:mod:`privacy.ledger.anchors`)
detect both; every row's epsilon is recomputed from its parameters
(:mod:`privacy.ledger.recompute`), so a rechained ledger with lowered figures fails too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from privacy.ledger.anchors import Anchors, check_anchors
from privacy.ledger.entries import (
    FORMAT_VERSION,
    Entry,
    LedgerError,
    canonical_json,
    chain_hash,
    check_payload,
    genesis_hash,
)
from privacy.ledger.recompute import recompute_problems


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of :func:`verify_chain`; each problem names the seq (or ``meta``) it concerns."""

    ok: bool
    problems: list[str] = field(default_factory=list)
    entries: int = 0
    head: str = ""
    #: entries appended after the recorded ``(entries, head)`` (a resumed run still going)
    after_record: int = 0
    #: whether the anchors were checked (a signed head was given to check against)
    signed: bool = False
    #: entries after the signed head (the server stopped between a commit and its signature)
    unsigned_after: int = 0


def verify_ledger(
    meta: Mapping[str, str],
    rows: Sequence[Sequence[Any]],
    run_id: str,
    expected_head: str | None = None,
    recorded: tuple[int, str] | None = None,
    anchors: Anchors | None = None,
    *,
    recompute: bool = True,
) -> VerifyResult:
    """:func:`verify_chain`, every row's epsilon recomputed, and the ``anchors`` checked."""
    result = verify_chain(meta, rows, run_id, expected_head, recorded)
    try:
        entries = [
            Entry(int(s), str(k), int(r), str(p), json.loads(t), str(c), str(ph), str(h))
            for s, k, r, p, t, c, ph, h in rows
        ]
    except (TypeError, ValueError):
        return result  # verify_chain has named the malformed rows
    if not all(isinstance(e.payload, dict) for e in entries):
        return result
    problems = list(result.problems) + (recompute_problems(entries) if recompute else [])
    after = 0
    if anchors is not None:
        found, after = check_anchors(entries, run_id, anchors)
        problems += found
    return VerifyResult(
        ok=not problems,
        problems=problems,
        entries=result.entries,
        head=result.head,
        after_record=result.after_record,
        signed=anchors is not None and anchors.head is not None,
        unsigned_after=after,
    )


def verify_chain(
    meta: Mapping[str, str],
    rows: Sequence[Sequence[Any]],
    run_id: str,
    expected_head: str | None = None,
    recorded: tuple[int, str] | None = None,
) -> VerifyResult:
    """Recheck a ledger's meta table and the whole chain of its ``rows`` (in seq order).

    Args:
        meta: The meta table as a mapping.
        rows: The entries' rows, columns ``seq, kind, round, party, payload, created_at,
            prev_hash, hash``.
        run_id: The run the ledger belongs to.
        expected_head: The hash the newest entry must have.
        recorded: ``(entries, head)`` written elsewhere when the run ended (``summary.json``):
            the ledger must hold at least that many entries and its ``entries``-th must
            have that hash. Entries after it are counted in ``after_record``, not flagged
            (a resumed run appends to a ledger whose summary is older).
    """
    problems = check_meta(meta, run_id)
    prev, expected_seq, head = genesis_hash(run_id), 1, genesis_hash(run_id)
    client_rounds: dict[int, int] = {}
    for row in rows:
        seq = row[0]
        if seq != expected_seq:
            missing = f"seq {expected_seq}" + (f"..{seq - 1}" if seq - 1 > expected_seq else "")
            problems.append(f"seq {seq}: {missing} missing (deleted rows)")
        expected_seq = seq + 1
        problems += check_row(row, prev, seq == rows[0][0], client_rounds)
        prev = head = str(row[7])
    if expected_head is not None and head != expected_head:
        problems.append(
            f"seq {expected_seq - 1}: ledger head {head[:12]} is not the expected "
            f"{expected_head[:12]} (entries dropped from the end, or the chain rewritten)"
        )
    after = 0
    if recorded is not None:
        count, recorded_at = recorded
        if len(rows) < count:
            problems.append(
                f"seq {expected_seq - 1}: the ledger has {len(rows)} entries but the run "
                f"recorded {count} ending at {recorded_at[:12]} (entries dropped from "
                "the end)"
            )
        else:
            at = genesis_hash(run_id) if count == 0 else str(rows[count - 1][7])
            if at != recorded_at:
                problems.append(
                    f"seq {count}: hash {at[:12]} is not the head {recorded_at[:12]} the "
                    "run recorded (the chain was rewritten)"
                )
            after = len(rows) - count
    return VerifyResult(
        ok=not problems, problems=problems, entries=len(rows), head=head, after_record=after
    )


def recorded_head(summary: Mapping[str, Any]) -> tuple[int, str] | None:
    """``(entries, head)`` of the ledger as a run's ``summary.json`` recorded them, if it did."""
    privacy = summary.get("privacy")
    if not isinstance(privacy, Mapping):
        return None
    count, head = privacy.get("ledger_entries"), privacy.get("ledger_head")
    if isinstance(count, int) and not isinstance(count, bool) and isinstance(head, str):
        return count, head
    return None


def check_meta(meta: Mapping[str, str], run_id: str) -> list[str]:
    """The problems of a ledger's meta table: its format version and run id."""
    problems = []
    if meta.get("format_version") != str(FORMAT_VERSION):
        problems.append(f"meta: format_version is {meta.get('format_version')!r}")
    if meta.get("run_id") != run_id:
        problems.append(f"meta: run_id is {meta.get('run_id')!r}, expected {run_id!r}")
    return problems


def check_row(
    row: Sequence[Any], prev: str, first: bool, client_rounds: dict[int, int]
) -> list[str]:
    """The problems of one row: its link to ``prev``, its hash, its payload, a repeated round.

    ``client_rounds`` (round -> seq of its ``client_level`` row) is updated as rows pass.
    """
    seq, kind, round_, party, text, created_at, prev_hash, digest = row
    where = f"seq {seq}"
    if prev_hash != prev:
        if first:
            return [f"{where}: prev_hash is not the genesis of this run (run id edited?)"]
        return [f"{where}: prev_hash does not match the previous entry (rows deleted or reordered)"]
    try:
        payload = json.loads(text)
        if not isinstance(payload, dict) or canonical_json(payload) != text:
            return [f"{where}: payload is not canonical JSON of an object (row edited)"]
        if not (isinstance(round_, int) and isinstance(party, str) and isinstance(created_at, str)):
            return [f"{where}: malformed row (round, party or created_at of the wrong type)"]
        if chain_hash(prev_hash, seq, kind, round_, party, payload, created_at) != digest:
            return [f"{where}: hash mismatch (row edited or added without a valid hash)"]
        check_payload(kind, payload)
    except (TypeError, ValueError, LedgerError) as exc:
        return [f"{where}: invalid entry ({exc})"]
    if kind == "client_level":
        if round_ in client_rounds:
            return [f"{where}: round {round_} already recorded at seq {client_rounds[round_]}"]
        client_rounds[round_] = seq
    return []
